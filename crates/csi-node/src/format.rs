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

fn run(program: &str, args: &[&str], target: &Path) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .arg(target)
        .stdin(Stdio::null())
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
        ("ext4", false) => run("mkfs.ext4", &["-q", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"], device),
        ("ext4", true) => run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1"], device),
        ("xfs", false) => run("mkfs.xfs", &["-q", "-K"], device),
        ("xfs", true) => run("mkfs.xfs", &["-q", "-K", "-f"], device),
        (other, _) => Err(Error::InvalidArgument(format!("fs_type {other:?} is not supported"))),
    }
}

/// Grows a mounted filesystem to fill its (larger) device. Already full-size is success.
pub fn grow(fs_type: &str, device: &Path, mount_point: &Path) -> Result<()> {
    match fs_type {
        "ext4" | "ext3" | "ext2" => run("resize2fs", &[], device),
        "xfs" => run("xfs_growfs", &["-d"], mount_point),
        other => Err(Error::FailedPrecondition(format!("cannot grow a {other} filesystem"))),
    }
}
