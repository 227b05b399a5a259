//! Per-volume mutual exclusion that holds across threads *and* processes.
//!
//! Two node plugin instances overlap during a rolling restart, and the local backend's
//! controller and node plugin share one state directory, so an in-memory map is not enough:
//! each key is an `flock(2)` on a file under the lock directory. `flock` locks belong to the
//! open file description, so two attempts from one process exclude each other too.
//!
//! Locks are *tried*, never waited for: the CSI spec wants a concurrent operation on the same
//! volume answered with ABORTED, and the caller (kubelet, a sidecar) retries.

use crate::error::{Error, IoContext, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone)]
pub struct Locks {
    dir: PathBuf,
}

/// Holds the lock until dropped. Dropping releases it (closing the descriptor); a guard made
/// with [`LockGuard::remove_on_release`] also unlinks the lock file first, for keys that will
/// never be used again (a deleted volume).
#[derive(Debug)]
pub struct LockGuard {
    file: File,
    path: PathBuf,
    remove: bool,
}

impl Locks {
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir)
            .context(|| format!("creating lock directory {}", dir.display()))?;
        Ok(Locks { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Takes the lock for `key` or fails at once with [`Error::Busy`].
    /// `key` must already be validated to be a plain file name (ids are allow-listed).
    pub fn try_lock(&self, key: &str) -> Result<LockGuard> {
        debug_assert!(!key.contains('/') && !key.starts_with('.'));
        let path = self.dir.join(format!("{key}.lock"));
        loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .custom_flags(libc::O_CLOEXEC)
                .open(&path)
                .context(|| format!("opening lock {}", path.display()))?;
            // SAFETY: flock on a descriptor we own.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc != 0 {
                let err = std::io::Error::last_os_error();
                if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(Error::Busy(format!(
                        "another operation on {key} is in progress; retry later"
                    )));
                }
                return Err(Error::io(format!("locking {}", path.display()), err));
            }
            // The previous holder may have unlinked the file between our open and our flock;
            // then we hold a lock nobody else can see. Start again on the current file.
            let held = file
                .metadata()
                .context(|| format!("stat {}", path.display()))?;
            match std::fs::metadata(&path) {
                Ok(now) if now.ino() == held.ino() && now.dev() == held.dev() => {
                    return Ok(LockGuard {
                        file,
                        path,
                        remove: false,
                    });
                }
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(format!("stat {}", path.display()), e)),
            }
        }
    }
}

impl LockGuard {
    pub fn remove_on_release(&mut self) {
        self.remove = true;
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.remove {
            let _ = std::fs::remove_file(&self.path);
        }
        // Closing `self.file` (after this body) releases the flock.
        let _ = &self.file;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_holder_is_refused_until_release() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Locks::new(dir.path()).unwrap();
        let first = locks.try_lock("vol-a").unwrap();
        assert!(matches!(locks.try_lock("vol-a"), Err(Error::Busy(_))));
        assert!(locks.try_lock("vol-b").is_ok(), "keys are independent");
        drop(first);
        assert!(locks.try_lock("vol-a").is_ok());
    }

    #[test]
    fn removed_lock_file_does_not_split_the_lock() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Locks::new(dir.path()).unwrap();
        let mut first = locks.try_lock("vol-a").unwrap();
        first.remove_on_release();
        drop(first);
        let second = locks.try_lock("vol-a").unwrap();
        assert!(matches!(locks.try_lock("vol-a"), Err(Error::Busy(_))));
        drop(second);
    }

    #[test]
    fn lock_excludes_another_process() {
        let dir = tempfile::tempdir().unwrap();
        let locks = Locks::new(dir.path()).unwrap();
        let _held = locks.try_lock("vol-x").unwrap();
        // flock(1) from util-linux in another process must fail to take the same lock.
        let status = std::process::Command::new("flock")
            .args(["--nonblock", "--conflict-exit-code", "75"])
            .arg(dir.path().join("vol-x.lock"))
            .arg("true")
            .status()
            .expect("flock(1) from util-linux is needed for this test");
        assert_eq!(status.code(), Some(75));
    }
}
