//! `/proc/self/mountinfo`, the kernel's truth about what is mounted where. After a restart the
//! plugins rebuild everything from here (and from the loop devices), never from memory.

use crate::error::{IoContext, Result};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u32,
    pub major: u32,
    pub minor: u32,
    /// The path inside the filesystem that is mounted here (`/` unless a bind of a subtree).
    pub root: PathBuf,
    pub mount_point: PathBuf,
    pub mount_options: String,
    pub fs_type: String,
    pub source: String,
    pub super_options: String,
}

impl MountEntry {
    pub fn is_read_only(&self) -> bool {
        self.mount_options.split(',').any(|o| o == "ro")
    }
}

pub fn read() -> Result<Vec<MountEntry>> {
    read_from(Path::new("/proc/self/mountinfo"))
}

pub fn read_from(path: &Path) -> Result<Vec<MountEntry>> {
    let text = std::fs::read_to_string(path).context(|| format!("reading {}", path.display()))?;
    Ok(parse(&text))
}

/// Parses mountinfo text; malformed lines (never produced by a real kernel) are skipped.
pub fn parse(text: &str) -> Vec<MountEntry> {
    text.lines().filter_map(parse_line).collect()
}

fn parse_line(line: &str) -> Option<MountEntry> {
    // 36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
    let (left, right) = line.split_once(" - ")?;
    let mut l = left.split(' ');
    let mount_id = l.next()?.parse().ok()?;
    let _parent = l.next()?;
    let (major, minor) = l.next()?.split_once(':')?;
    let root = PathBuf::from(unescape(l.next()?));
    let mount_point = PathBuf::from(unescape(l.next()?));
    let mount_options = l.next()?.to_string();
    let mut r = right.split(' ');
    let fs_type = unescape(r.next()?);
    let source = unescape(r.next()?);
    let super_options = r.next().unwrap_or_default().to_string();
    Some(MountEntry {
        mount_id,
        major: major.parse().ok()?,
        minor: minor.parse().ok()?,
        root,
        mount_point,
        mount_options,
        fs_type,
        source,
        super_options,
    })
}

/// The kernel escapes space, tab, newline and backslash in paths as `\ooo` octal.
pub fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    use std::os::unix::ffi::OsStringExt;
    std::ffi::OsString::from_vec(out)
        .to_string_lossy()
        .into_owned()
}

/// The mount whose mount point is exactly `path` (the last one, if stacked).
pub fn find_by_mount_point<'a>(mounts: &'a [MountEntry], path: &Path) -> Option<&'a MountEntry> {
    mounts.iter().rev().find(|m| m.mount_point == path)
}

/// Every mount of the block device `major:minor`.
pub fn find_by_device(mounts: &[MountEntry], major: u32, minor: u32) -> Vec<&MountEntry> {
    mounts
        .iter()
        .filter(|m| m.major == major && m.minor == minor)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
22 1 253:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
36 22 7:3 / /var/lib/kubelet/plugins/x/staging\\040dir rw,noatime shared:7 - xfs /dev/loop3 rw,nouuid
37 22 7:3 / /var/lib/kubelet/pods/p/vol ro,relatime - xfs /dev/loop3 rw,nouuid
38 22 0:5 /loop3 /var/lib/kubelet/pods/p/block\\134x rw - devtmpfs udev rw,size=10k
";

    #[test]
    fn parses_fields_and_decodes_octal_escapes() {
        let m = parse(SAMPLE);
        assert_eq!(m.len(), 4);
        assert_eq!(
            m[1].mount_point,
            Path::new("/var/lib/kubelet/plugins/x/staging dir")
        );
        assert_eq!((m[1].major, m[1].minor), (7, 3));
        assert_eq!(m[1].fs_type, "xfs");
        assert_eq!(m[1].source, "/dev/loop3");
        assert!(m[2].is_read_only());
        assert!(!m[1].is_read_only());
        assert_eq!(
            m[3].mount_point,
            Path::new("/var/lib/kubelet/pods/p/block\\x")
        );
        assert_eq!(m[3].root, Path::new("/loop3"));
    }

    #[test]
    fn finds_by_point_and_device() {
        let m = parse(SAMPLE);
        assert!(find_by_mount_point(&m, Path::new("/var/lib/kubelet/pods/p/vol")).is_some());
        assert!(find_by_mount_point(&m, Path::new("/var/lib/kubelet/pods/p")).is_none());
        assert_eq!(find_by_device(&m, 7, 3).len(), 2);
    }

    #[test]
    fn garbage_lines_are_skipped() {
        assert!(parse("nonsense\n1 2 x / / rw - a b c\n").is_empty());
    }

    #[test]
    fn reads_this_process_mountinfo() {
        let m = read().unwrap();
        assert!(m.iter().any(|e| e.mount_point == Path::new("/")));
    }
}
