//! Crash-safe file replacement: write a temporary file beside the target, fsync it, rename it
//! over the target, fsync the directory. After a crash a reader sees the old content or the
//! new one, never a mixture; a leftover `*.tmp` is garbage that the next write replaces.

use crate::error::{IoContext, Result};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

pub fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let mut file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .context(|| format!("creating {}", tmp.display()))?;
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).context(|| format!("renaming {} into place", tmp.display()))?;
    sync_dir(path)
}

pub fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<()> {
    let bytes = serde_json::to_vec_pretty(value)
        .map_err(|e| crate::Error::Internal(format!("serialising {}: {e}", path.display())))?;
    write(path, &bytes)
}

/// Reads a JSON document written by [`write_json`]; `Ok(None)` when it does not exist.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<Option<T>> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| crate::Error::Internal(format!("{} is corrupt: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(crate::Error::io(format!("reading {}", path.display()), e)),
    }
}

/// Makes a rename, create or unlink inside the parent directory durable.
pub fn sync_dir(path: &Path) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .context(|| format!("syncing directory {}", dir.display()))
}

/// Removes a file; a file that is already gone is success.
pub fn remove_file(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(crate::Error::io(format!("removing {}", path.display()), e)),
    }
}

/// Removes a directory tree; a tree that is already gone is success.
pub fn remove_dir_all(path: &Path) -> Result<()> {
    match fs::remove_dir_all(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(crate::Error::io(format!("removing {}", path.display()), e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.json");
        write_json(&path, &vec![1, 2, 3]).unwrap();
        write_json(&path, &vec![4]).unwrap();
        let back: Vec<i32> = read_json(&path).unwrap().unwrap();
        assert_eq!(back, vec![4]);
        assert!(!path.with_extension("tmp").exists());
    }

    #[test]
    fn corrupt_document_is_reported_not_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("meta.json");
        fs::write(&path, b"{half").unwrap();
        let err = read_json::<Vec<i32>>(&path).unwrap_err();
        assert!(err.to_string().contains("corrupt"), "{err}");
    }
}
