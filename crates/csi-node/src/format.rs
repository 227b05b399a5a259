//! Creating and growing filesystems, with a recorded intent so that an interrupted mkfs can be
//! told apart from a foreign filesystem.
//!
//! A crash in the middle of mkfs leaves a partial signature that would block every retry (the
//! device is no longer blank). Before formatting, the node writes an intent naming the volume,
//! the device *incarnation* (the backend's identity for it) and the filesystem type; it removes
//! the intent once mkfs has finished. A device that carries a signature is formatted again only
//! when an intent for exactly that incarnation exists — content the plugin itself was creating
//! and never handed to a workload.

use cloud_backend::sys::atomic;
use cloud_backend::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FormatIntent {
    pub volume_id: String,
    pub identity: String,
    pub fs_type: String,
}

#[derive(Debug, Clone)]
pub struct Intents {
    dir: PathBuf,
}

impl Intents {
    pub fn new(dir: PathBuf) -> Result<Self> {
        std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
        Ok(Intents { dir })
    }

    fn path(&self, volume_id: &str) -> PathBuf {
        self.dir.join(format!("{volume_id}.json"))
    }

    pub fn get(&self, volume_id: &str) -> Result<Option<FormatIntent>> {
        atomic::read_json(&self.path(volume_id))
    }

    pub fn record(&self, intent: &FormatIntent) -> Result<()> {
        atomic::write_json(&self.path(&intent.volume_id), intent)
    }

    pub fn clear(&self, volume_id: &str) -> Result<()> {
        atomic::remove_file(&self.path(volume_id))
    }
}

/// A helper program that dies with the plugin. Without this, a plugin killed in the middle of
/// mkfs would leave mkfs running, and the retry would race it on the same device.
pub fn command(program: &str) -> Command {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(program);
    cmd.stdin(Stdio::null());
    // SAFETY: the closure runs in the child between fork and exec and calls only prctl, which
    // is async-signal-safe. The parent thread waits for the child, so it outlives it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

fn run(program: &str, args: &[&str], target: &Path) -> Result<()> {
    let out = command(program)
        .args(args)
        .arg(target)
        .output()
        .context(|| format!("running {program}"))?;
    if !out.status.success() {
        return Err(Error::Command {
            program: program.to_string(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(())
}

/// Creates a filesystem. `force` overwrites an existing signature and is used only to finish
/// a format this plugin recorded an intent for. Discards are skipped: the device is blank (a
/// fresh sparse file or a fresh cloud volume) and discarding it would only cost time.
pub fn mkfs(device: &Path, fs_type: &str, force: bool) -> Result<()> {
    match (fs_type, force) {
        ("ext4", false) => run(
            "mkfs.ext4",
            &[
                "-q",
                "-E",
                "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
            ],
            device,
        ),
        ("ext4", true) => run(
            "mkfs.ext4",
            &[
                "-q",
                "-F",
                "-E",
                "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
            ],
            device,
        ),
        ("xfs", false) => run("mkfs.xfs", &["-q", "-K"], device),
        ("xfs", true) => run("mkfs.xfs", &["-q", "-K", "-f"], device),
        (other, _) => Err(Error::InvalidArgument(format!(
            "fs_type {other:?} is not supported"
        ))),
    }
}

/// Size in bytes of the filesystem on `device`, read from its superblock; `None` when the
/// superblock is not one we understand.
pub fn filesystem_bytes(device: &Path, fs_type: &str) -> Result<Option<u64>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(device).context(|| format!("opening {}", device.display()))?;
    let mut sb = [0u8; 1024];
    match fs_type {
        "ext4" | "ext3" | "ext2" => {
            f.read_exact_at(&mut sb, 1024)
                .context(|| format!("reading the superblock of {}", device.display()))?;
            let le32 =
                |o: usize| u32::from_le_bytes([sb[o], sb[o + 1], sb[o + 2], sb[o + 3]]) as u64;
            if le32(0x38) & 0xffff != 0xEF53 {
                return Ok(None);
            }
            let incompat_64bit = le32(0x60) & 0x80 != 0;
            let blocks = le32(0x4) | if incompat_64bit { le32(0x150) << 32 } else { 0 };
            Ok(Some(blocks << (10 + le32(0x18))))
        }
        "xfs" => {
            f.read_exact_at(&mut sb[..512], 0)
                .context(|| format!("reading the superblock of {}", device.display()))?;
            if &sb[0..4] != b"XFSB" {
                return Ok(None);
            }
            let blocksize = u32::from_be_bytes([sb[4], sb[5], sb[6], sb[7]]) as u64;
            let dblocks =
                u64::from_be_bytes([sb[8], sb[9], sb[10], sb[11], sb[12], sb[13], sb[14], sb[15]]);
            Ok(Some(dblocks * blocksize))
        }
        _ => Ok(None),
    }
}

/// Whether the device has grown past its filesystem by at least one MiB (xfs leaves a partial
/// allocation group unused, so smaller differences are not growth).
pub fn needs_growth(device: &Path, fs_type: &str, device_bytes: u64) -> Result<bool> {
    Ok(filesystem_bytes(device, fs_type)?.is_some_and(|fs| device_bytes >= fs + (1 << 20)))
}

/// Grows an *unmounted* ext filesystem: e2fsck first (resize2fs demands a freshly checked
/// filesystem), then resize2fs. Needs no capability beyond opening the device.
pub fn grow_offline(fs_type: &str, device: &Path) -> Result<()> {
    if !matches!(fs_type, "ext4" | "ext3" | "ext2") {
        return Ok(());
    }
    let out = command("e2fsck")
        .args(["-f", "-p"])
        .arg(device)
        .output()
        .context(|| "running e2fsck".to_string())?;
    // 0: clean, 1: errors corrected. Anything else leaves the filesystem alone.
    if !matches!(out.status.code(), Some(0) | Some(1)) {
        return Err(Error::Command {
            program: "e2fsck".into(),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    run("resize2fs", &[], device)
}

/// Grows a *mounted* filesystem to fill its (larger) device. Already full-size is success.
pub fn grow(fs_type: &str, device: &Path, mount_point: &Path) -> Result<()> {
    let res = match fs_type {
        "ext4" | "ext3" | "ext2" => run("resize2fs", &[], device),
        "xfs" => run("xfs_growfs", &["-d"], mount_point),
        other => Err(Error::FailedPrecondition(format!(
            "cannot grow a {other} filesystem"
        ))),
    };
    match res {
        // The kernel's online ext4 resize (EXT4_IOC_RESIZE_FS) needs CAP_SYS_RESOURCE; say so
        // instead of passing on resize2fs's bare "Permission denied".
        Err(Error::Command { stderr, .. }) if stderr.contains("Permission denied") => {
            Err(Error::FailedPrecondition(format!(
                "online resize of {} was refused by the kernel: the node plugin lacks CAP_SYS_RESOURCE. \
             Run it privileged, or unstage the volume: it is grown offline at the next NodeStageVolume",
                device.display()
            )))
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_sizes_match_what_mkfs_made() {
        let dir = tempfile::tempdir().unwrap();
        for (fs, size) in [("ext4", 64u64 << 20), ("xfs", 300 << 20)] {
            let img = dir.path().join(fs);
            std::fs::File::create(&img).unwrap().set_len(size).unwrap();
            let prog = format!("mkfs.{fs}");
            let st = Command::new(&prog)
                .arg("-q")
                .arg(&img)
                .status()
                .unwrap_or_else(|e| panic!("{prog}: {e}"));
            assert!(st.success());
            let got = filesystem_bytes(&img, fs).unwrap().unwrap();
            assert!(
                got <= size && got > size - (8 << 20),
                "{fs}: {got} of {size}"
            );
            assert!(!needs_growth(&img, fs, size).unwrap());
            assert!(needs_growth(&img, fs, size * 2).unwrap());
        }
        assert_eq!(
            filesystem_bytes(&dir.path().join("ext4"), "xfs").unwrap(),
            None
        );
    }

    #[test]
    fn offline_growth_of_ext4_reaches_the_new_size() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(32 << 20)
            .unwrap();
        assert!(
            Command::new("mkfs.ext4")
                .arg("-q")
                .arg(&img)
                .status()
                .unwrap()
                .success()
        );
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        grow_offline("ext4", &img).unwrap();
        assert_eq!(filesystem_bytes(&img, "ext4").unwrap(), Some(64 << 20));
    }
}
