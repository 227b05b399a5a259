use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Topology segments, e.g. `{"local.csi.ferrovol.dev/node": "worker-1"}`.
pub type Topology = BTreeMap<String, String>;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackendCapabilities {
    pub snapshots: bool,
    pub clone: bool,
    pub expand: bool,
    pub list_volumes: bool,
    pub get_capacity: bool,
    /// ControllerPublish/Unpublish do real work (EBS attach); false for local files.
    pub attach: bool,
    /// Multi-node access modes this backend can serve.
    pub multi_node: bool,
    /// ControllerModifyVolume (mutable parameters).
    pub modify: bool,
    /// The backend serialises and merges expand/modify of one volume itself (so the service
    /// must not answer the second of two concurrent requests with ABORTED).
    pub coalesces_modifications: bool,
    /// GetCapacity reports the nodes' own space (local) — topology-aware capacity tracking.
    pub node_local: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AccessKind {
    Mount,
    Block,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "type", content = "id")]
pub enum ContentSource {
    Snapshot(String),
    Volume(String),
}

#[derive(Debug, Clone)]
pub struct CreateVolume {
    pub name: String,
    /// The size to allocate, already rounded by the caller to what the request allows.
    pub required_bytes: u64,
    /// 0 means no limit.
    pub limit_bytes: u64,
    pub parameters: BTreeMap<String, String>,
    pub mutable_parameters: BTreeMap<String, String>,
    pub content_source: Option<ContentSource>,
    /// Filesystem the volume will carry, if known at create time (affects minimum size).
    pub fs_type: Option<String>,
    /// Topology the volume must be accessible from (requisite).
    pub accessibility: Vec<Topology>,
    /// Topology preferred by the scheduler, most preferred first.
    pub preferred: Vec<Topology>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub id: String,
    pub name: String,
    pub capacity_bytes: u64,
    pub parameters: BTreeMap<String, String>,
    pub content_source: Option<ContentSource>,
    pub accessible_topology: Vec<Topology>,
    /// Context handed to the node at stage/publish (volume_context).
    pub context: BTreeMap<String, String>,
    /// Nodes the volume is published to (attach-capable backends).
    pub published_nodes: Vec<String>,
    /// `None` when healthy; a message when the backend sees something wrong.
    pub abnormal: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub id: String,
    pub name: String,
    pub source_volume_id: String,
    pub size_bytes: u64,
    /// Seconds and nanoseconds since the Unix epoch.
    pub created_at: (i64, i32),
    pub ready: bool,
}

#[derive(Debug, Clone, Default)]
pub struct SnapshotFilter {
    pub snapshot_id: Option<String>,
    pub source_volume_id: Option<String>,
}

#[derive(Debug, Clone)]
pub struct Page<T> {
    pub entries: Vec<T>,
    /// The last id of this page when more entries follow.
    pub next: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub available_bytes: u64,
    pub maximum_volume_bytes: u64,
    pub minimum_volume_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachedDevice {
    pub path: PathBuf,
    /// An identifier of this exact incarnation of the volume (never reused after delete and
    /// re-create), recorded in format intents.
    pub identity: String,
    pub size_bytes: u64,
}
