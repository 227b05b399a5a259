//! What is on a block device, before anything is allowed to format it.
//!
//! The probe is `blkid -p` (util-linux's low-level probe, no cache). blkid-rs recognises only
//! LUKS headers; libblkid bindings need bindgen and a C toolchain at build time and link the
//! driver to a C library. The blkid program probes every filesystem, partition table and
//! RAID/LUKS signature libblkid knows, and its exit status separates "found nothing" (2) from
//! failure (anything else but 0), which is exactly the distinction data safety needs: an
//! error from the probe is never "blank".
//!
//! "Blank" additionally requires the first and last MiB to read as zeros, so raw data written
//! by a block-mode workload (no signature at all) is never mistaken for an empty disk.

use cloud_backend::{Error, IoContext, Result};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Content {
    /// No signature and zeros at both ends: safe to format.
    Blank,
    /// A filesystem of this type.
    Filesystem(String),
    /// Something else that must not be overwritten (partition table, LUKS, RAID, raw data).
    Other(String),
}

pub fn probe(device: &Path) -> Result<Content> {
    let out = crate::format::command("blkid")
        .args(["-p", "-o", "export"])
        .arg(device)
        .output()
        .context(|| "running blkid (util-linux) to probe the device".to_string())?;
    match out.status.code() {
        Some(0) => Ok(parse_export(&String::from_utf8_lossy(&out.stdout))),
        Some(2) => {
            if edges_are_zero(device)? {
                Ok(Content::Blank)
            } else {
                Ok(Content::Other(
                    "data without a recognisable signature".into(),
                ))
            }
        }
        Some(8) => Ok(Content::Other(
            "several conflicting signatures (blkid: ambivalent result)".into(),
        )),
        _ => Err(Error::Command {
            program: format!("blkid -p {}", device.display()),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        }),
    }
}

pub fn parse_export(text: &str) -> Content {
    let mut fs_type = None;
    let mut usage = None;
    let mut pt_type = None;
    for line in text.lines() {
        match line.split_once('=') {
            Some(("TYPE", v)) => fs_type = Some(v.to_string()),
            Some(("USAGE", v)) => usage = Some(v.to_string()),
            Some(("PTTYPE", v)) => pt_type = Some(v.to_string()),
            _ => {}
        }
    }
    match (fs_type, usage.as_deref(), pt_type) {
        (Some(t), Some("filesystem"), _) => Content::Filesystem(t),
        (Some(t), _, _) => Content::Other(format!("{t} signature")),
        (None, _, Some(pt)) => Content::Other(format!("{pt} partition table")),
        (None, _, None) => Content::Other("a signature blkid could not name".into()),
    }
}

fn edges_are_zero(device: &Path) -> Result<bool> {
    const WINDOW: u64 = 1 << 20;
    let mut f = std::fs::File::open(device).context(|| format!("opening {}", device.display()))?;
    let size = f
        .seek(SeekFrom::End(0))
        .context(|| format!("sizing {}", device.display()))?;
    let mut buf = vec![0u8; WINDOW.min(size) as usize];
    for start in [0, size.saturating_sub(WINDOW)] {
        f.seek(SeekFrom::Start(start))
            .context(|| format!("seeking {}", device.display()))?;
        f.read_exact(&mut buf)
            .context(|| format!("reading {}", device.display()))?;
        if buf.iter().any(|b| *b != 0) {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn export_output_is_classified() {
        assert_eq!(
            parse_export("DEVNAME=/dev/loop0\nUUID=x\nTYPE=ext4\nUSAGE=filesystem\n"),
            Content::Filesystem("ext4".into())
        );
        assert!(
            matches!(parse_export("TYPE=crypto_LUKS\nUSAGE=crypto\n"), Content::Other(s) if s.contains("crypto_LUKS"))
        );
        assert!(matches!(parse_export("PTTYPE=gpt\n"), Content::Other(s) if s.contains("gpt")));
    }

    #[test]
    fn probe_of_files_distinguishes_blank_data_and_filesystems() {
        let dir = tempfile::tempdir().unwrap();
        let blank = dir.path().join("blank");
        std::fs::File::create(&blank)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        assert_eq!(probe(&blank).unwrap(), Content::Blank);

        let data = dir.path().join("data");
        let f = std::fs::File::create(&data).unwrap();
        f.set_len(8 << 20).unwrap();
        std::fs::write(&data, b"application bytes, no signature").unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&data)
            .unwrap()
            .set_len(8 << 20)
            .unwrap();
        assert!(matches!(probe(&data).unwrap(), Content::Other(_)));

        let fs = dir.path().join("fs");
        std::fs::File::create(&fs)
            .unwrap()
            .set_len(16 << 20)
            .unwrap();
        let st = Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&fs)
            .status()
            .expect("mkfs.ext4 (e2fsprogs) is needed");
        assert!(st.success());
        assert_eq!(probe(&fs).unwrap(), Content::Filesystem("ext4".into()));
    }

    #[test]
    fn probe_failure_is_an_error_not_blank() {
        let err = probe(Path::new("/nonexistent/device")).unwrap_err();
        assert!(
            matches!(err, Error::Command { .. } | Error::Io { .. }),
            "{err}"
        );
    }
}
