//! The mounter seam: everything the node service does to the mount table goes through
//! [`Mounter`], injected at start-up, so the service logic can be exercised with a fake and the
//! real implementation stays small.

use crate::paths::Confined;
use cloud_backend::sys::mountinfo::{self, MountEntry};
use cloud_backend::{Error, Result};
use std::os::fd::AsRawFd;
use std::path::Path;
use sys_mount::{Mount, MountFlags};

pub trait Mounter: Send + Sync + 'static {
    /// Mounts the filesystem on `device` at `target` with the CSI mount flags.
    fn mount_fs(
        &self,
        device: &Path,
        target: &Confined,
        fs_type: &str,
        flags: &[String],
    ) -> Result<()>;
    /// Bind-mounts `source` (a staging directory or a device node) onto `target`.
    fn bind(&self, source: &Path, target: &Confined, read_only: bool) -> Result<()>;
    /// Unmounts whatever is mounted at `target` (one layer).
    fn unmount(&self, target: &Confined) -> Result<()>;
    /// The current mount table.
    fn mounts(&self) -> Result<Vec<MountEntry>>;
}

/// The real thing: mount(2) through sys-mount, umount2(2) directly.
#[derive(Debug, Default, Clone)]
pub struct SysMounter;

/// Splits CSI mount flags into mount(2) flags and filesystem data.
pub fn split_flags(fs_type: &str, flags: &[String]) -> (MountFlags, String) {
    let mut mf = MountFlags::empty();
    let mut data: Vec<&str> = Vec::new();
    for f in flags {
        match f.as_str() {
            "ro" => mf |= MountFlags::RDONLY,
            "rw" | "defaults" => {}
            "noatime" => mf |= MountFlags::NOATIME,
            "nodiratime" => mf |= MountFlags::NODIRATIME,
            "relatime" => mf |= MountFlags::RELATIME,
            "strictatime" => mf |= MountFlags::STRICTATIME,
            "nosuid" => mf |= MountFlags::NOSUID,
            "nodev" => mf |= MountFlags::NODEV,
            "noexec" => mf |= MountFlags::NOEXEC,
            "sync" => mf |= MountFlags::SYNCHRONOUS,
            "dirsync" => mf |= MountFlags::DIRSYNC,
            other => data.push(other),
        }
    }
    // Clones and snapshots of an xfs volume carry the source's UUID; without nouuid the
    // second one refuses to mount on the same node.
    if fs_type == "xfs" && !data.contains(&"nouuid") {
        data.push("nouuid");
    }
    (mf, data.join(","))
}

fn proc_fd_path(fd: &impl AsRawFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

impl Mounter for SysMounter {
    fn mount_fs(
        &self,
        device: &Path,
        target: &Confined,
        fs_type: &str,
        flags: &[String],
    ) -> Result<()> {
        let (mf, data) = split_flags(fs_type, flags);
        let fd = target.open_target()?;
        let mut builder = Mount::builder().fstype(fs_type).flags(mf);
        if !data.is_empty() {
            builder = builder.data(&data);
        }
        builder
            .mount(device, proc_fd_path(&fd))
            .map(drop)
            .map_err(|e| {
                Error::io(
                    format!(
                        "mounting {} ({fs_type}) at {}",
                        device.display(),
                        target.path.display()
                    ),
                    e,
                )
            })
    }

    fn bind(&self, source: &Path, target: &Confined, read_only: bool) -> Result<()> {
        let fd = target.open_target()?;
        Mount::builder()
            .flags(MountFlags::BIND)
            .mount(source, proc_fd_path(&fd))
            .map(drop)
            .map_err(|e| {
                Error::io(
                    format!(
                        "bind-mounting {} at {}",
                        source.display(),
                        target.path.display()
                    ),
                    e,
                )
            })?;
        drop(fd);
        if read_only {
            // A bind mount ignores MS_RDONLY on creation; read-only takes a second call.
            // Reopen the target: the new descriptor resolves to the root of the new mount.
            let fd = target.open_target()?;
            let res = Mount::builder()
                .flags(MountFlags::BIND | MountFlags::REMOUNT | MountFlags::RDONLY)
                .mount("", proc_fd_path(&fd))
                .map(drop)
                .map_err(|e| {
                    Error::io(format!("remounting {} read-only", target.path.display()), e)
                });
            drop(fd);
            if let Err(e) = res {
                // Never leave a writable mount where a read-only one was asked for.
                let _ = self.unmount(target);
                return Err(e);
            }
        }
        Ok(())
    }

    fn unmount(&self, target: &Confined) -> Result<()> {
        use std::os::unix::ffi::OsStrExt;
        // umount2 through /proc/self/fd/N would fail with EBUSY (the descriptor pins the
        // mount), so unmount by path: the caller confined it a moment ago, and UMOUNT_NOFOLLOW
        // refuses a final symlink. sys-mount's UnmountFlags::NOFOLLOW carries O_NOFOLLOW's
        // value instead of UMOUNT_NOFOLLOW's and the kernel rejects it, hence libc here.
        const UMOUNT_NOFOLLOW: i32 = 8;
        let c = std::ffi::CString::new(target.path.as_os_str().as_bytes())
            .map_err(|_| Error::InvalidArgument("path contains NUL".into()))?;
        // SAFETY: umount2 with a NUL-terminated path.
        let rc = unsafe { libc::umount2(c.as_ptr(), UMOUNT_NOFOLLOW) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                return Ok(()); // not a mount point (any more)
            }
            return Err(Error::io(
                format!("unmounting {}", target.path.display()),
                e,
            ));
        }
        Ok(())
    }

    fn mounts(&self) -> Result<Vec<MountEntry>> {
        mountinfo::read()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_split_into_syscall_flags_and_data() {
        let (mf, data) = split_flags("ext4", &["noatime".into(), "discard".into(), "ro".into()]);
        assert_eq!(mf, MountFlags::NOATIME | MountFlags::RDONLY);
        assert_eq!(data, "discard");
        let (_, data) = split_flags("xfs", &[]);
        assert_eq!(data, "nouuid");
    }
}
