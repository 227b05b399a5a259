//! The `local` backend: every volume is a sparse file under a state directory, turned into a
//! loop device on the node at NodeStage and released at NodeUnstage.
//!
//! Multi-node by distribution, not by sharing: each node provisions on its own disk (the
//! controller service runs on every node, beside the node service, sharing the state
//! directory), and every volume carries the node topology key so the scheduler places pods
//! where the data is.
//!
//! On-disk layout under the state directory:
//!
//! ```text
//! volumes/<id>/disk.img      the volume's bytes (sparse)
//! volumes/<id>/meta.json     written last, atomically: its presence commits the volume
//! snapshots/<id>/data.img    a full copy (reflink where possible)
//! snapshots/<id>/meta.json   commit point of the snapshot
//! locks/<key>.lock           per-volume flock(2) files, shared with the node plugin
//! frozen/<id>                mount points frozen by a copy in progress (thawed at start-up)
//! node/attached/<id>.json    which loop device the node attached for a volume
//! ```
//!
//! Ids derive from names (see [`crate::ids`]), so a create retried after a crash lands on the
//! same directory; anything without `meta.json` there is an interrupted create and is redone.

mod controller;
mod node;

use crate::error::{Error, IoContext, Result};
use crate::sys::lock::Locks;
use crate::{AccessKind, ContentSource};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// Size of a volume created without a capacity request.
pub const DEFAULT_VOLUME_BYTES: u64 = GIB;
/// Smallest volume: ext4 needs a few MiB for its journal and metadata.
pub const MIN_VOLUME_BYTES: u64 = 16 * MIB;
/// mkfs.xfs refuses filesystems smaller than 300 MiB.
pub const MIN_XFS_BYTES: u64 = 300 * MIB;
/// StorageClass parameters under this prefix are added by external-provisioner
/// (`--extra-create-metadata`) and are accepted and ignored.
pub const RESERVED_PARAMETER_PREFIX: &str = "csi.storage.k8s.io/";

#[derive(Debug, Clone)]
pub struct LocalConfig {
    pub state_dir: PathBuf,
    /// This node's name; the volume's topology segment value.
    pub node_id: String,
    /// The topology key, e.g. `local.csi.ferrovol.dev/node`.
    pub topology_key: String,
}

#[derive(Debug, Clone)]
pub struct LocalBackend {
    cfg: LocalConfig,
    locks: Locks,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct VolumeMeta {
    id: String,
    name: String,
    /// Random, unique to this incarnation of the id: node-side format intents name it.
    uid: String,
    capacity_bytes: u64,
    parameters: BTreeMap<String, String>,
    content_source: Option<ContentSource>,
    access: Option<AccessKind>,
    fs_type: Option<String>,
    node_id: String,
    created_at: (i64, i32),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct SnapshotMeta {
    id: String,
    name: String,
    source_volume_id: String,
    size_bytes: u64,
    created_at: (i64, i32),
}

impl LocalBackend {
    pub fn new(cfg: LocalConfig) -> Result<Self> {
        for sub in ["volumes", "snapshots", "frozen", "node/attached"] {
            let dir = cfg.state_dir.join(sub);
            std::fs::create_dir_all(&dir).context(|| format!("creating {}", dir.display()))?;
        }
        let locks = Locks::new(cfg.state_dir.join("locks"))?;
        Ok(LocalBackend { cfg, locks })
    }

    /// The lock registry shared by this backend's controller and node sides.
    pub fn locks(&self) -> &Locks {
        &self.locks
    }

    pub fn config(&self) -> &LocalConfig {
        &self.cfg
    }

    /// Start-up repair: thaws filesystems a killed copy left frozen and removes volume and
    /// snapshot directories whose creation never committed. Entries whose lock is held by a
    /// live operation are left to it.
    pub fn recover(&self) -> Result<()> {
        crate::sys::copy::thaw_leftovers(&self.cfg.state_dir.join("frozen"))?;
        for kind in ["volumes", "snapshots"] {
            let dir = self.cfg.state_dir.join(kind);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let id = entry.file_name().to_string_lossy().into_owned();
                let valid = crate::ids::is_valid(crate::ids::VOLUME_PREFIX, &id)
                    || crate::ids::is_valid(crate::ids::SNAPSHOT_PREFIX, &id);
                if !valid || entry.path().join("meta.json").exists() {
                    continue;
                }
                if let Ok(_guard) = self.locks.try_lock(&id) {
                    tracing::warn!(%id, "removing the remains of an interrupted create");
                    crate::sys::atomic::remove_dir_all(&entry.path())?;
                }
            }
        }
        Ok(())
    }

    fn volume_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("volumes").join(id)
    }

    fn snapshot_dir(&self, id: &str) -> PathBuf {
        self.cfg.state_dir.join("snapshots").join(id)
    }

    fn image(&self, id: &str) -> PathBuf {
        self.volume_dir(id).join("disk.img")
    }

    fn read_volume(&self, id: &str) -> Result<Option<VolumeMeta>> {
        crate::sys::atomic::read_json(&self.volume_dir(id).join("meta.json"))
    }

    fn read_snapshot(&self, id: &str) -> Result<Option<SnapshotMeta>> {
        crate::sys::atomic::read_json(&self.snapshot_dir(id).join("meta.json"))
    }

    fn topology(&self) -> crate::Topology {
        BTreeMap::from([(self.cfg.topology_key.clone(), self.cfg.node_id.clone())])
    }
}

fn now() -> (i64, i32) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    (d.as_secs() as i64, d.subsec_nanos() as i32)
}

fn round_up(bytes: u64, unit: u64) -> Option<u64> {
    bytes.checked_add(unit - 1).map(|b| b / unit * unit)
}

/// Picks the size of a new volume from the CSI capacity range.
///
/// `required` 0 means "any size": the default, shrunk to fit under `limit`. Sizes are whole MiB
/// (loop devices and filesystems want aligned sizes), never below the filesystem's minimum.
pub fn choose_size(required: u64, limit: u64, fs_type: Option<&str>) -> Result<u64> {
    if limit > 0 && required > limit {
        return Err(Error::InvalidArgument(format!(
            "capacity range is impossible: required_bytes {required} exceeds limit_bytes {limit}"
        )));
    }
    let minimum = if fs_type == Some("xfs") {
        MIN_XFS_BYTES
    } else {
        MIN_VOLUME_BYTES
    };
    let wanted = if required == 0 {
        if limit > 0 {
            DEFAULT_VOLUME_BYTES.min(limit / MIB * MIB)
        } else {
            DEFAULT_VOLUME_BYTES
        }
    } else {
        required
    };
    let size = round_up(wanted.max(minimum), MIB)
        .ok_or_else(|| Error::OutOfRange(format!("required_bytes {required} is too large")))?;
    if limit > 0 && size > limit {
        let why = if fs_type == Some("xfs") {
            format!("xfs needs at least {} MiB", MIN_XFS_BYTES / MIB)
        } else {
            format!(
                "volumes are whole MiB and at least {} MiB",
                MIN_VOLUME_BYTES / MIB
            )
        };
        return Err(Error::OutOfRange(format!(
            "cannot provide a volume within limit_bytes {limit}: {why}"
        )));
    }
    Ok(size)
}

/// Rejects parameters the local backend does not understand, naming them.
pub fn validate_parameters(parameters: &BTreeMap<String, String>, allowed: &[&str]) -> Result<()> {
    let unknown: Vec<&str> = parameters
        .keys()
        .map(String::as_str)
        .filter(|k| !k.starts_with(RESERVED_PARAMETER_PREFIX) && !allowed.contains(k))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    let accepted = if allowed.is_empty() {
        "none".to_string()
    } else {
        allowed.join(", ")
    };
    Err(Error::InvalidArgument(format!(
        "unknown parameter(s) {unknown:?}; this backend accepts: {accepted} (keys under {RESERVED_PARAMETER_PREFIX} are accepted and ignored)"
    )))
}

fn ensure_dir(path: &Path) -> Result<()> {
    std::fs::create_dir_all(path).context(|| format!("creating {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_the_capacity_range() {
        assert_eq!(choose_size(0, 0, None).unwrap(), DEFAULT_VOLUME_BYTES);
        assert_eq!(choose_size(1, 0, None).unwrap(), MIN_VOLUME_BYTES);
        assert_eq!(choose_size(64 * MIB + 1, 0, None).unwrap(), 65 * MIB);
        assert_eq!(choose_size(64 * MIB, 64 * MIB, None).unwrap(), 64 * MIB);
        assert_eq!(choose_size(0, 100 * MIB, None).unwrap(), 100 * MIB);
        assert_eq!(
            choose_size(100 * MIB, 0, Some("xfs")).unwrap(),
            MIN_XFS_BYTES
        );
        assert!(matches!(
            choose_size(100 * MIB, 200 * MIB, Some("xfs")),
            Err(Error::OutOfRange(_))
        ));
        assert!(matches!(
            choose_size(2 * MIB, MIB, None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            choose_size(MIB, 2 * MIB, None),
            Err(Error::OutOfRange(_))
        ));
        assert!(matches!(
            choose_size(u64::MAX, 0, None),
            Err(Error::OutOfRange(_))
        ));
    }

    #[test]
    fn unknown_parameters_are_named() {
        let mut p = BTreeMap::new();
        p.insert("csi.storage.k8s.io/pvc/name".to_string(), "x".to_string());
        assert!(validate_parameters(&p, &[]).is_ok());
        p.insert("fstpye".to_string(), "ext4".to_string());
        let err = validate_parameters(&p, &[]).unwrap_err().to_string();
        assert!(err.contains("fstpye"), "{err}");
    }
}
