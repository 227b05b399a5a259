//! The storage behind ferrovol, seen through two small traits:
//!
//! - [`ControllerBackend`]: volumes, snapshots, listing, capacity and (where the storage has
//!   it) attach/detach — what the CSI Controller service needs.
//! - [`NodeBackend`]: making a volume's block device present on this node and proving that a
//!   device really is that volume — what the CSI Node service needs. It never calls a cloud API.
//!
//! Implementations: [`local`] (sparse files on loop devices, the embedded default).
//! This crate knows nothing of gRPC: failures are [`Error`] values, which the service crates map
//! to status codes in one place.

pub mod aws;
pub mod error;
pub mod ids;
pub mod local;
pub mod metrics;
pub mod sys;
mod types;

pub use error::{Error, IoContext, Result};
pub use types::*;

use std::collections::BTreeMap;
use std::future::Future;

/// What the Controller service asks of a storage backend. Every method is idempotent; callers
/// hold the per-volume lock (see [`sys::lock`]) around mutating calls.
pub trait ControllerBackend: Send + Sync + 'static {
    fn capabilities(&self) -> BackendCapabilities;

    /// The lock key that serialises creation of the volume called `name`.
    fn create_lock_key(&self, name: &str) -> String;
    /// The lock key that serialises creation of the snapshot called `name`.
    fn snapshot_lock_key(&self, name: &str) -> String;

    /// Checks `id` has the shape of this backend's volume ids. A malformed id cannot name an
    /// existing volume: callers answer NOT_FOUND (or success, for deletes) without touching disk.
    fn is_volume_id(&self, id: &str) -> bool;
    fn is_snapshot_id(&self, id: &str) -> bool;

    /// Checks the StorageClass parameters before anything is created.
    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()>;

    /// Checks mutable parameters (VolumeAttributesClass) before anything is changed.
    fn validate_mutable_parameters(&self, mutable: &BTreeMap<String, String>) -> Result<()> {
        if mutable.is_empty() {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "mutable parameters {:?} are not supported by this backend",
            mutable.keys().collect::<Vec<_>>()
        )))
    }

    /// Applies mutable parameters to an existing volume (ControllerModifyVolume).
    fn modify_volume(
        &self,
        id: &str,
        mutable: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (id, mutable);
        async {
            Err(Error::Unsupported(
                "ControllerModifyVolume is not supported by this backend".into(),
            ))
        }
    }

    fn create_volume(&self, req: CreateVolume) -> impl Future<Output = Result<Volume>> + Send;
    fn delete_volume(&self, id: &str) -> impl Future<Output = Result<()>> + Send;
    fn get_volume(&self, id: &str) -> impl Future<Output = Result<Volume>> + Send;
    /// Volumes ordered by id, starting after `start_after`.
    fn list_volumes(
        &self,
        start_after: Option<&str>,
        max_entries: usize,
    ) -> impl Future<Output = Result<Page<Volume>>> + Send;
    fn expand_volume(&self, id: &str, new_size: u64) -> impl Future<Output = Result<u64>> + Send;
    fn capacity(
        &self,
        topology: Option<&Topology>,
    ) -> impl Future<Output = Result<Capacity>> + Send;

    fn create_snapshot(
        &self,
        name: &str,
        source_volume_id: &str,
        parameters: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<Snapshot>> + Send;
    fn delete_snapshot(&self, id: &str) -> impl Future<Output = Result<()>> + Send;
    fn list_snapshots(
        &self,
        filter: SnapshotFilter,
        start_after: Option<&str>,
        max_entries: usize,
    ) -> impl Future<Output = Result<Page<Snapshot>>> + Send;

    /// Attaches the volume to a node; returns the publish context the node needs.
    fn publish(
        &self,
        volume_id: &str,
        node_id: &str,
        read_only: bool,
    ) -> impl Future<Output = Result<BTreeMap<String, String>>> + Send;
    /// Detaches the volume from `node_id`, or from every node when it is `None`.
    fn unpublish(
        &self,
        volume_id: &str,
        node_id: Option<&str>,
    ) -> impl Future<Output = Result<()>> + Send;
}

/// What the Node service asks of a storage backend: block devices on this node, tied to
/// volume ids. Implementations must never hand back a device they cannot prove is the volume.
pub trait NodeBackend: Send + Sync + 'static {
    fn is_volume_id(&self, id: &str) -> bool;

    /// Makes the volume's device present (attaching a loop device, or waiting for the cloud's
    /// attachment to show up) and returns it. Idempotent: an attached volume is found, never
    /// attached twice.
    fn attach(
        &self,
        volume_id: &str,
        publish_context: &BTreeMap<String, String>,
    ) -> impl Future<Output = Result<AttachedDevice>> + Send;

    /// The device of an already attached volume, if any.
    fn find(&self, volume_id: &str) -> impl Future<Output = Result<Option<AttachedDevice>>> + Send;

    /// Releases the device after the last unmount. A volume that is gone (deleted, device
    /// vanished) is success.
    fn detach(&self, volume_id: &str) -> impl Future<Output = Result<()>> + Send;

    /// Makes the device see a capacity change made by the controller; returns the new size.
    fn refresh_capacity(&self, volume_id: &str) -> impl Future<Output = Result<u64>> + Send;
}
