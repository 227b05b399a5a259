//! The handful of ioctl request numbers ferrovol needs, with the reasons they are hard-coded:
//! libc does not export them.

pub const LOOP_SET_FD: libc::c_ulong = 0x4C00;
pub const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
pub const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
pub const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
pub const LOOP_SET_CAPACITY: libc::c_ulong = 0x4C07;
pub const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
pub const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
/// `_IOR(0x12, 114, size_t)`
pub const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
/// `_IOWR('X', 119, int)` / `_IOWR('X', 120, int)`
pub const FIFREEZE: libc::c_ulong = 0xC004_5877;
pub const FITHAW: libc::c_ulong = 0xC004_5878;
/// `_IOW(0x94, 9, int)`
pub const FICLONE: libc::c_ulong = 0x4004_9409;

/// `_IO(0x12, 93)` / `_IO(0x12, 94)`: set / get a block device's read-only flag.
pub const BLKROSET: libc::c_ulong = 0x125D;
pub const BLKROGET: libc::c_ulong = 0x125E;

/// Marks a block device read-only (or writable again). A read-only bind mount does not stop
/// writes to a device node, so a read-only raw-block publish needs the device flag itself.
pub fn set_block_device_read_only(path: &std::path::Path, read_only: bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    let flag: libc::c_int = read_only.into();
    // SAFETY: BLKROSET reads one int through the pointer.
    if unsafe { libc::ioctl(f.as_raw_fd(), BLKROSET, &flag as *const libc::c_int) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub fn block_device_read_only(path: &std::path::Path) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path)?;
    let mut flag: libc::c_int = 0;
    // SAFETY: BLKROGET writes one int through the pointer.
    if unsafe { libc::ioctl(f.as_raw_fd(), BLKROGET, &mut flag as *mut libc::c_int) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(flag != 0)
}

/// Size in bytes of an open block device.
pub fn block_device_size(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 through the pointer, which outlives the call.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}
