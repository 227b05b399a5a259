//! Confinement of staging and target paths to the kubelet directory.
//!
//! Anything that can write a Kubernetes object can shape the paths the node plugin receives, so
//! a path is accepted only if it is absolute, free of `.`/`..` components, strictly below the
//! configured kubelet directory, and reachable from it without following any symlink. The walk
//! is done by the kernel with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from a
//! descriptor of the kubelet directory, and the mount itself targets the descriptor it
//! produced (`/proc/self/fd/N`), so a path swapped after the check cannot redirect the mount.

use cloud_backend::{Error, Result};
use std::ffi::{CString, OsStr, OsString};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

const RESOLVE_NO_MAGICLINKS: u64 = 0x02;
const RESOLVE_NO_SYMLINKS: u64 = 0x04;
const RESOLVE_BENEATH: u64 = 0x08;

#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

#[derive(Debug)]
pub struct KubeletDir {
    root: PathBuf,
    fd: OwnedFd,
}

/// What a confined path currently is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Missing,
    Directory,
    File,
    Other,
}

/// A path checked to lie below the kubelet directory, with its parent directory opened.
#[derive(Debug)]
pub struct Confined {
    pub path: PathBuf,
    parent: OwnedFd,
    name: OsString,
}

impl KubeletDir {
    /// `root` must exist; it is canonicalised once here, at start-up, when it is trusted.
    pub fn open(root: &Path) -> Result<Self> {
        let root = std::fs::canonicalize(root)
            .map_err(|e| Error::io(format!("resolving kubelet directory {}", root.display()), e))?;
        let fd = open_dir_plain(&root)?;
        Ok(KubeletDir { root, fd })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Checks `path` (as received in a request field called `field`) and opens its parent.
    pub fn confine(&self, field: &str, path: &str) -> Result<Confined> {
        let rel = self.relative(field, path)?;
        let mut components: Vec<&OsStr> = rel.iter().collect();
        let name = components
            .pop()
            .expect("relative() returns a non-empty path")
            .to_os_string();
        let parent_rel: PathBuf = components.iter().collect();
        let parent = if parent_rel.as_os_str().is_empty() {
            dup(&self.fd)?
        } else {
            openat2(&self.fd, &parent_rel, libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC).map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP) | Some(libc::EXDEV) => Error::InvalidArgument(format!(
                    "{field} {path:?} goes through a symbolic link; paths must stay inside {} without links",
                    self.root.display()
                )),
                Some(libc::ENOENT) | Some(libc::ENOTDIR) => Error::NotFound(format!("the parent directory of {field} {path:?} does not exist")),
                _ => Error::io(format!("opening the parent of {path}"), e),
            })?
        };
        Ok(Confined {
            path: PathBuf::from(path),
            parent,
            name,
        })
    }

    /// The lexical checks: absolute, normal components only, strictly below the root.
    fn relative(&self, field: &str, path: &str) -> Result<PathBuf> {
        if path.is_empty() {
            return Err(Error::InvalidArgument(format!("{field} is required")));
        }
        let p = Path::new(path);
        if !p.is_absolute() {
            return Err(Error::InvalidArgument(format!(
                "{field} {path:?} must be an absolute path"
            )));
        }
        if p.components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
            || path.split('/').any(|s| s == "." || s == "..")
        {
            return Err(Error::InvalidArgument(format!(
                "{field} {path:?} must not contain . or .. components"
            )));
        }
        let rel = p.strip_prefix(&self.root).map_err(|_| {
            Error::InvalidArgument(format!(
                "{field} {path:?} is outside the kubelet directory {}",
                self.root.display()
            ))
        })?;
        if rel.as_os_str().is_empty() {
            return Err(Error::InvalidArgument(format!(
                "{field} {path:?} is the kubelet directory itself"
            )));
        }
        Ok(rel.to_path_buf())
    }

    /// True when `path` passes the lexical checks (for read-only RPCs, where a path that cannot
    /// be ours means "not found" rather than "invalid").
    pub fn is_inside(&self, path: &str) -> bool {
        self.relative("path", path).is_ok()
    }
}

impl Confined {
    fn c_name(&self) -> CString {
        CString::new(self.name.as_bytes()).expect("path components never contain NUL")
    }

    /// What is at the path now, without following a final symlink. A dead mount (EIO, stale
    /// handle) counts as `Other`.
    pub fn kind(&self) -> Result<Kind> {
        // SAFETY: fstatat on an owned directory descriptor and a NUL-terminated name.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        let rc = unsafe {
            libc::fstatat(
                self.parent.as_raw_fd(),
                self.c_name().as_ptr(),
                &mut st,
                libc::AT_SYMLINK_NOFOLLOW,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(Kind::Missing),
                Some(libc::EIO) | Some(libc::ESTALE) | Some(libc::ENOTCONN) => Ok(Kind::Other),
                _ => Err(Error::io(format!("stat {}", self.path.display()), e)),
            };
        }
        Ok(match st.st_mode & libc::S_IFMT {
            libc::S_IFDIR => Kind::Directory,
            libc::S_IFREG => Kind::File,
            _ => Kind::Other,
        })
    }

    /// Opens the final component itself (refusing a symlink) as an O_PATH descriptor whose
    /// `/proc/self/fd/N` name is a safe mount target. (No O_NOFOLLOW: with O_PATH it would open
    /// the link itself; RESOLVE_NO_SYMLINKS makes a final link fail with ELOOP instead.)
    pub fn open_target(&self) -> Result<OwnedFd> {
        openat2(
            &self.parent,
            Path::new(&self.name),
            libc::O_PATH | libc::O_CLOEXEC,
        )
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => {
                Error::InvalidArgument(format!("{} is a symbolic link", self.path.display()))
            }
            Some(libc::ENOENT) => {
                Error::NotFound(format!("{} does not exist", self.path.display()))
            }
            _ => Error::io(format!("opening {}", self.path.display()), e),
        })
    }

    pub fn create_dir(&self) -> Result<()> {
        // SAFETY: mkdirat relative to an owned directory descriptor.
        let rc = unsafe { libc::mkdirat(self.parent.as_raw_fd(), self.c_name().as_ptr(), 0o750) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(Error::io(
                    format!("creating directory {}", self.path.display()),
                    e,
                ));
            }
        }
        Ok(())
    }

    pub fn create_file(&self) -> Result<()> {
        // SAFETY: openat relative to an owned directory descriptor; O_NOFOLLOW refuses links.
        let fd = unsafe {
            libc::openat(
                self.parent.as_raw_fd(),
                self.c_name().as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                0o640,
            )
        };
        if fd < 0 {
            return Err(Error::io(
                format!("creating file {}", self.path.display()),
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: fd was just returned by openat and is owned by nobody else.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(())
    }

    /// Removes what the plugin created at the path: an empty directory or an empty file.
    /// Anything holding data is not ours and is left alone; returns whether it was removed.
    pub fn remove_if_empty(&self) -> Result<bool> {
        match self.kind()? {
            Kind::Missing => Ok(true),
            Kind::Directory => {
                // SAFETY: unlinkat relative to an owned directory descriptor.
                let rc = unsafe {
                    libc::unlinkat(
                        self.parent.as_raw_fd(),
                        self.c_name().as_ptr(),
                        libc::AT_REMOVEDIR,
                    )
                };
                if rc == 0 {
                    return Ok(true);
                }
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::ENOTEMPTY) | Some(libc::EEXIST) | Some(libc::EBUSY) => Ok(false),
                    Some(libc::ENOENT) => Ok(true),
                    _ => Err(Error::io(format!("removing {}", self.path.display()), e)),
                }
            }
            Kind::File => {
                let fd = self.open_target()?;
                let size = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd()))
                    .map(|m| m.len())
                    .unwrap_or(1);
                drop(fd);
                if size != 0 {
                    return Ok(false);
                }
                // SAFETY: as above.
                let rc =
                    unsafe { libc::unlinkat(self.parent.as_raw_fd(), self.c_name().as_ptr(), 0) };
                if rc != 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::ENOENT) {
                        return Err(Error::io(format!("removing {}", self.path.display()), e));
                    }
                }
                Ok(true)
            }
            Kind::Other => Ok(false),
        }
    }
}

fn open_dir_plain(path: &Path) -> Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument("path contains NUL".into()))?;
    // SAFETY: open with a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::io(
            format!("opening {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn dup(fd: &OwnedFd) -> Result<OwnedFd> {
    fd.try_clone()
        .map_err(|e| Error::io("duplicating a descriptor", e))
}

fn openat2(dir: &OwnedFd, rel: &Path, flags: i32) -> std::io::Result<OwnedFd> {
    let c = CString::new(rel.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    let how = OpenHow {
        flags: flags as u64,
        mode: 0,
        resolve: RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS,
    };
    // SAFETY: openat2 reads `how` (size given) and a NUL-terminated path.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            dir.as_raw_fd(),
            c.as_ptr(),
            &how as *const OpenHow,
            std::mem::size_of::<OpenHow>(),
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor returned by the kernel.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setup() -> (tempfile::TempDir, KubeletDir) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("pods/p1/volumes")).unwrap();
        let k = KubeletDir::open(dir.path()).unwrap();
        (dir, k)
    }

    fn p(k: &KubeletDir, rel: &str) -> String {
        format!("{}/{rel}", k.root().display())
    }

    #[test]
    fn accepts_paths_below_the_root() {
        let (_d, k) = setup();
        let c = k
            .confine("target_path", &p(&k, "pods/p1/volumes/mount"))
            .unwrap();
        assert_eq!(c.kind().unwrap(), Kind::Missing);
        c.create_dir().unwrap();
        assert_eq!(c.kind().unwrap(), Kind::Directory);
        assert!(c.remove_if_empty().unwrap());
    }

    #[test]
    fn refuses_relative_dotdot_outside_and_root() {
        let (_d, k) = setup();
        let root = k.root().display().to_string();
        for bad in [
            "relative/path".to_string(),
            format!("{root}/pods/../../etc"),
            format!("{root}/pods/./p1"),
            "/etc/passwd".to_string(),
            "/".to_string(),
            root.clone(),
            format!("{root}-sibling/x"),
        ] {
            let err = k.confine("target_path", &bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn refuses_symlinks_anywhere_on_the_way() {
        let (_d, k) = setup();
        std::os::unix::fs::symlink("/etc", k.root().join("pods/p1/evil")).unwrap();
        std::os::unix::fs::symlink("/", k.root().join("pods/rootlink")).unwrap();
        let err = k
            .confine("target_path", &p(&k, "pods/p1/evil/x"))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let err = k
            .confine("target_path", &p(&k, "pods/rootlink/etc/x"))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // The final component as a link: confine() succeeds (parent is fine) but using it fails.
        let c = k.confine("target_path", &p(&k, "pods/p1/evil")).unwrap();
        assert_eq!(c.kind().unwrap(), Kind::Other);
        assert!(c.open_target().is_err());
        assert!(
            !c.remove_if_empty().unwrap(),
            "a link is not ours to remove"
        );
        assert!(std::fs::symlink_metadata(k.root().join("pods/p1/evil")).is_ok());
    }

    #[test]
    fn keeps_directories_and_files_holding_data() {
        let (_d, k) = setup();
        std::fs::create_dir(k.root().join("pods/p1/full")).unwrap();
        std::fs::write(k.root().join("pods/p1/full/data"), b"keep me").unwrap();
        std::fs::write(k.root().join("pods/p1/file"), b"keep me too").unwrap();
        assert!(
            !k.confine("t", &p(&k, "pods/p1/full"))
                .unwrap()
                .remove_if_empty()
                .unwrap()
        );
        assert!(
            !k.confine("t", &p(&k, "pods/p1/file"))
                .unwrap()
                .remove_if_empty()
                .unwrap()
        );
        assert_eq!(
            std::fs::read(k.root().join("pods/p1/full/data")).unwrap(),
            b"keep me"
        );
        assert_eq!(
            std::fs::read(k.root().join("pods/p1/file")).unwrap(),
            b"keep me too"
        );
    }
}
