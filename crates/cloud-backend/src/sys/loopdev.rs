//! Loop devices: attach a backing file, find the device already attached to a file, refresh
//! its capacity after the file grew, detach it.
//!
//! A backing file is identified by its device and inode number (what `LOOP_GET_STATUS64`
//! reports), never by path: a path can be renamed, deleted or reach the same file through a
//! different mount, and the sysfs `backing_file` text is truncated and ambiguous.

use super::ioctl::*;
use crate::error::{Error, IoContext, Result};
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

const LO_NAME_SIZE: usize = 64;
const LO_KEY_SIZE: usize = 32;

#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; LO_KEY_SIZE],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    fn zeroed() -> Self {
        // SAFETY: plain-old-data struct of integers and byte arrays; all-zero is valid.
        unsafe { std::mem::zeroed() }
    }
}

/// The identity of a backing file as the loop driver records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackingId {
    pub dev: u64,
    pub ino: u64,
}

impl BackingId {
    pub fn of(path: &Path) -> Result<Self> {
        let md = std::fs::metadata(path).context(|| format!("stat {}", path.display()))?;
        Ok(BackingId {
            dev: md.dev(),
            ino: md.ino(),
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoopDevice {
    pub number: u32,
    pub path: PathBuf,
    pub major: u32,
    pub minor: u32,
    pub backing: BackingId,
}

fn status(dev: &File) -> std::io::Result<LoopInfo64> {
    let mut info = LoopInfo64::zeroed();
    // SAFETY: LOOP_GET_STATUS64 fills a loop_info64 we own.
    let rc = unsafe {
        libc::ioctl(
            dev.as_raw_fd(),
            LOOP_GET_STATUS64,
            &mut info as *mut LoopInfo64,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(info)
}

fn dev_numbers(path: &Path) -> Result<(u32, u32)> {
    let md = std::fs::metadata(path).context(|| format!("stat {}", path.display()))?;
    let rdev = md.rdev();
    Ok((libc::major(rdev), libc::minor(rdev)))
}

/// Every attached loop device, as the kernel reports it.
pub fn list() -> Result<Vec<LoopDevice>> {
    list_in(Path::new("/sys/block"), Path::new("/dev"))
}

fn list_in(sys_block: &Path, dev_dir: &Path) -> Result<Vec<LoopDevice>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(sys_block) {
        Ok(e) => e,
        Err(e) => return Err(Error::io(format!("listing {}", sys_block.display()), e)),
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(number) = name
            .strip_prefix("loop")
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        // The `loop/` subdirectory exists only while a file is attached.
        if !entry.path().join("loop").exists() {
            continue;
        }
        let path = dev_dir.join(&name);
        let Ok(file) = File::open(&path) else {
            continue;
        };
        let Ok(info) = status(&file) else { continue }; // detached meanwhile: ENXIO
        let Ok((major, minor)) = dev_numbers(&path) else {
            continue;
        };
        out.push(LoopDevice {
            number,
            path,
            major,
            minor,
            backing: BackingId {
                dev: info.lo_device,
                ino: info.lo_inode,
            },
        });
    }
    out.sort_by_key(|d| d.number);
    Ok(out)
}

/// Every loop device attached to the file `backing`. More than one means someone else
/// attached it too; callers treat that as an error rather than guess.
pub fn find(backing: BackingId) -> Result<Vec<LoopDevice>> {
    Ok(list()?
        .into_iter()
        .filter(|d| d.backing == backing)
        .collect())
}

/// Attaches `file` to a free loop device and returns it. The caller must hold the volume's lock
/// and have checked with [`find`] that the file is not attached already.
pub fn attach(file: &Path, read_only: bool) -> Result<LoopDevice> {
    let backing = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(file)
        .context(|| format!("opening backing file {}", file.display()))?;
    let md = backing
        .metadata()
        .context(|| format!("stat {}", file.display()))?;
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .context(|| "opening /dev/loop-control".to_string())?;

    let mut info = LoopInfo64::zeroed();
    if read_only {
        info.lo_flags |= 1; // LO_FLAGS_READ_ONLY
    }
    let name = file.as_os_str().as_encoded_bytes();
    let n = name.len().min(LO_NAME_SIZE - 1);
    info.lo_file_name[..n].copy_from_slice(&name[..n]);

    // Another process may take the free device between GET_FREE and CONFIGURE: retry.
    for _ in 0..32 {
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let number = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if number < 0 {
            return Err(Error::io(
                "finding a free loop device",
                std::io::Error::last_os_error(),
            ));
        }
        let path = PathBuf::from(format!("/dev/loop{number}"));
        let dev = match OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(Error::Unavailable(format!(
                    "{} does not exist; is /dev a devtmpfs?",
                    path.display()
                )));
            }
            Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
        };
        let config = LoopConfig {
            fd: backing.as_raw_fd() as u32,
            block_size: 0,
            info,
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads a loop_config we own for the duration of the call.
        let rc = unsafe {
            libc::ioctl(
                dev.as_raw_fd(),
                LOOP_CONFIGURE,
                &config as *const LoopConfig,
            )
        };
        if rc == 0 {
            // The block layer's read-only flag (BLKROSET) outlives a detach: a device number
            // reused from a read-only raw publish would refuse every write. Reset it.
            super::ioctl::set_block_device_read_only(&path, read_only)
                .context(|| format!("resetting the read-only flag of {}", path.display()))?;
            let (major, minor) = dev_numbers(&path)?;
            return Ok(LoopDevice {
                number: number as u32,
                path,
                major,
                minor,
                backing: BackingId {
                    dev: md.dev(),
                    ino: md.ino(),
                },
            });
        }
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::EBUSY) => continue,
            Some(libc::EINVAL) | Some(libc::ENOTTY) => {
                // Kernels before 5.8 lack LOOP_CONFIGURE.
                legacy_configure(&dev, &backing, &info)
                    .context(|| format!("attaching {} to {}", file.display(), path.display()))?;
                let (major, minor) = dev_numbers(&path)?;
                return Ok(LoopDevice {
                    number: number as u32,
                    path,
                    major,
                    minor,
                    backing: BackingId {
                        dev: md.dev(),
                        ino: md.ino(),
                    },
                });
            }
            _ => {
                return Err(Error::io(
                    format!("attaching {} to {}", file.display(), path.display()),
                    err,
                ));
            }
        }
    }
    Err(Error::Busy(
        "every free loop device was taken concurrently; retry".into(),
    ))
}

fn legacy_configure(dev: &File, backing: &File, info: &LoopInfo64) -> std::io::Result<()> {
    // SAFETY: LOOP_SET_FD takes a file descriptor; LOOP_SET_STATUS64 reads a loop_info64.
    unsafe {
        if libc::ioctl(dev.as_raw_fd(), LOOP_SET_FD, backing.as_raw_fd()) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::ioctl(
            dev.as_raw_fd(),
            LOOP_SET_STATUS64,
            info as *const LoopInfo64,
        ) < 0
        {
            let err = std::io::Error::last_os_error();
            libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD, 0);
            return Err(err);
        }
    }
    Ok(())
}

/// Detaches `device`, after checking it is still attached to `expected` (device numbers are
/// reused: a stale record must not detach somebody else's device). Already detached is success.
pub fn detach(device: &Path, expected: BackingId) -> Result<()> {
    let dev = match File::open(device) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(format!("opening {}", device.display()), e)),
    };
    match status(&dev) {
        Ok(info)
            if (BackingId {
                dev: info.lo_device,
                ino: info.lo_inode,
            }) == expected => {}
        Ok(_) => return Ok(()), // reused for another file: ours is already gone
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(()),
        Err(e) => {
            return Err(Error::io(
                format!("reading status of {}", device.display()),
                e,
            ));
        }
    }
    // SAFETY: LOOP_CLR_FD takes no argument.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD, 0) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ENXIO) {
            return Err(Error::io(format!("detaching {}", device.display()), err));
        }
    }
    drop(dev);
    // While anybody else holds the device open, the kernel only marks it for auto-clear and
    // answers success. Report "detached" only once it really is, so nothing leaks silently.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        match File::open(device).and_then(|d| status(&d)) {
            Ok(info)
                if (BackingId {
                    dev: info.lo_device,
                    ino: info.lo_inode,
                }) == expected => {}
            _ => return Ok(()),
        }
        if std::time::Instant::now() > deadline {
            return Err(Error::Busy(format!(
                "{} is still held open by another process; it is marked to detach on last close. Retry once it is released",
                device.display()
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Tells the loop driver that the backing file changed size, and returns the new device size.
pub fn refresh_capacity(device: &Path) -> Result<u64> {
    let dev = File::open(device).context(|| format!("opening {}", device.display()))?;
    // SAFETY: LOOP_SET_CAPACITY takes no argument.
    let rc = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_SET_CAPACITY, 0) };
    if rc < 0 {
        return Err(Error::io(
            format!("refreshing capacity of {}", device.display()),
            std::io::Error::last_os_error(),
        ));
    }
    block_device_size(dev.as_fd()).context(|| format!("reading size of {}", device.display()))
}

/// Size in bytes of the block device at `path`.
pub fn device_size(path: &Path) -> Result<u64> {
    let dev = File::open(path).context(|| format!("opening {}", path.display()))?;
    block_device_size(dev.as_fd()).context(|| format!("reading size of {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn struct_layouts_match_the_kernel_abi() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
