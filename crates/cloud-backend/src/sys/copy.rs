//! Copies of volume images: a reflink (`FICLONE`) where the filesystem shares extents (xfs,
//! btrfs), else a sparse-aware copy that walks the data extents with `SEEK_DATA`/`SEEK_HOLE`
//! and moves them with `copy_file_range`, so a 10 GiB volume holding 1 MiB copies 1 MiB.
//! Also the filesystem freeze that makes a plain copy of a live image consistent.

use super::ioctl::{FICLONE, FIFREEZE, FITHAW};
use crate::error::{Error, IoContext, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    Reflink,
    Sparse,
}

/// Tries only a reflink; `Ok(false)` when the filesystem cannot share extents.
pub fn try_reflink(src: &Path, dst: &Path) -> Result<bool> {
    let from = File::open(src).context(|| format!("opening {}", src.display()))?;
    let to = create(dst)?;
    // SAFETY: FICLONE takes the source descriptor as its argument.
    let rc = unsafe { libc::ioctl(to.as_raw_fd(), FICLONE, from.as_raw_fd()) };
    if rc == 0 {
        to.sync_all()
            .context(|| format!("syncing {}", dst.display()))?;
        return Ok(true);
    }
    let err = std::io::Error::last_os_error();
    match err.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::EXDEV) | Some(libc::EINVAL) => {
            drop(to);
            let _ = std::fs::remove_file(dst);
            Ok(false)
        }
        _ => Err(Error::io(
            format!("reflinking {} to {}", src.display(), dst.display()),
            err,
        )),
    }
}

fn create(dst: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(dst)
        .context(|| format!("creating {}", dst.display()))
}

/// Copies `src` to a new `dst`, keeping holes, and fsyncs the result.
pub fn sparse_copy(src: &Path, dst: &Path) -> Result<()> {
    let from = File::open(src).context(|| format!("opening {}", src.display()))?;
    let len = from
        .metadata()
        .context(|| format!("stat {}", src.display()))?
        .len();
    let to = create(dst)?;
    to.set_len(len)
        .context(|| format!("sizing {}", dst.display()))?;
    let (fi, fo) = (from.as_raw_fd(), to.as_raw_fd());
    let mut pos: i64 = 0;
    let end = len as i64;
    while pos < end {
        // SAFETY: lseek on a descriptor we own.
        let data = unsafe { libc::lseek(fi, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // only a hole remains
            }
            return Err(Error::io(format!("seeking data in {}", src.display()), err));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fi, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(Error::io(
                format!("seeking hole in {}", src.display()),
                std::io::Error::last_os_error(),
            ));
        }
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            let want = (hole - off_in) as usize;
            // SAFETY: copy_file_range with explicit offsets on descriptors we own.
            let n = unsafe { libc::copy_file_range(fi, &mut off_in, fo, &mut off_out, want, 0) };
            if n < 0 {
                return Err(Error::io(
                    format!("copying {} to {}", src.display(), dst.display()),
                    std::io::Error::last_os_error(),
                ));
            }
            if n == 0 {
                return Err(Error::Internal(format!(
                    "{} shrank while it was being copied",
                    src.display()
                )));
            }
        }
        pos = hole;
    }
    to.sync_all()
        .context(|| format!("syncing {}", dst.display()))
}

/// Reflink if possible, else a sparse copy.
pub fn copy_image(src: &Path, dst: &Path) -> Result<CopyMethod> {
    if try_reflink(src, dst)? {
        return Ok(CopyMethod::Reflink);
    }
    sparse_copy(src, dst)?;
    Ok(CopyMethod::Sparse)
}

/// A frozen filesystem: thawed when dropped. While frozen, writes to it block, and its image
/// on the device is consistent, so a copy taken now is not torn.
///
/// A process killed while holding a freeze would leave the filesystem frozen forever; callers
/// record the mount point in a marker file before freezing and [`thaw_leftovers`] thaws
/// whatever a previous incarnation left behind at start-up.
pub struct Freeze {
    dir: File,
    mount_point: PathBuf,
    marker: PathBuf,
}

impl Freeze {
    pub fn new(mount_point: &Path, marker: PathBuf) -> Result<Self> {
        super::atomic::write(&marker, mount_point.as_os_str().as_encoded_bytes())?;
        let dir =
            File::open(mount_point).context(|| format!("opening {}", mount_point.display()))?;
        // SAFETY: FIFREEZE takes no meaningful argument.
        let rc = unsafe { libc::ioctl(dir.as_raw_fd(), FIFREEZE, 0) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            let _ = std::fs::remove_file(&marker);
            return Err(Error::io(
                format!("freezing {}", mount_point.display()),
                err,
            ));
        }
        Ok(Freeze {
            dir,
            mount_point: mount_point.to_path_buf(),
            marker,
        })
    }
}

impl Drop for Freeze {
    fn drop(&mut self) {
        // SAFETY: FITHAW takes no meaningful argument.
        let rc = unsafe { libc::ioctl(self.dir.as_raw_fd(), FITHAW, 0) };
        if rc < 0 {
            tracing::error!(mount_point = %self.mount_point.display(), error = %std::io::Error::last_os_error(), "thawing filesystem failed");
        } else {
            let _ = std::fs::remove_file(&self.marker);
        }
    }
}

/// Thaws the filesystems named by marker files in `dir` (left by a process that died while
/// copying) and removes the markers. A filesystem that is not frozen answers EINVAL: fine.
pub fn thaw_leftovers(dir: &Path) -> Result<usize> {
    let mut thawed = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(0);
    };
    for entry in entries.flatten() {
        let marker = entry.path();
        let Ok(target) = std::fs::read(&marker) else {
            continue;
        };
        let mount_point = PathBuf::from(String::from_utf8_lossy(&target).into_owned());
        if let Ok(d) = File::open(&mount_point) {
            // SAFETY: as in Drop.
            if unsafe { libc::ioctl(d.as_raw_fd(), FITHAW, 0) } == 0 {
                tracing::warn!(mount_point = %mount_point.display(), "thawed a filesystem left frozen by an interrupted copy");
                thawed += 1;
            }
        }
        let _ = std::fs::remove_file(&marker);
    }
    Ok(thawed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn sparse_copy_keeps_data_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src.img");
        let dst = dir.path().join("dst.img");
        let mut f = File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(5 << 20)).unwrap();
        f.write_all(&[0xAB; 8192]).unwrap();
        f.seek(SeekFrom::Start(40 << 20)).unwrap();
        f.write_all(b"tail").unwrap();
        f.sync_all().unwrap();
        drop(f);

        sparse_copy(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        let allocated = std::fs::metadata(&dst).unwrap().blocks() * 512;
        assert!(
            allocated < 1 << 20,
            "copy allocated {allocated} bytes: holes were filled"
        );
    }

    #[test]
    fn copy_image_falls_back_when_reflink_is_unavailable() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("a");
        std::fs::write(&src, b"hello").unwrap();
        let dst = dir.path().join("b");
        copy_image(&src, &dst).unwrap();
        assert_eq!(std::fs::read(&dst).unwrap(), b"hello");
    }
}
