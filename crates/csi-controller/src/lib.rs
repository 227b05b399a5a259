//! ferrovol's CSI Controller service, generic over a [`ControllerBackend`].
//!
//! Each RPC checks its arguments first (INVALID_ARGUMENT before any lookup, as the spec and
//! csi-sanity want), takes the per-volume lock for mutations (ABORTED when busy), and runs the
//! backend call to completion in a task of its own.

use cloud_backend::sys::lock::Locks;
use cloud_backend::{ContentSource, ControllerBackend, Error, SnapshotFilter, Topology};
use csi_identity::status::{invalid, to_status};
use csi_identity::task::run_to_completion;
use csi_identity::validate;
use csi_proto::v1::controller_server::Controller;
use csi_proto::v1::*;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tonic::{Request, Response, Status};

/// The Node service's NodeGetInfo alone, served by the local backend's csi-controller: with
/// `--node-deployment`, external-provisioner asks the socket it provisions through which node
/// it is on. Every other Node RPC belongs to csi-node and is UNIMPLEMENTED here.
#[derive(Debug, Clone)]
pub struct NodeInfoOnly {
    pub node_id: String,
    pub topology: BTreeMap<String, String>,
}

fn served_by_csi_node<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented(
        "served by csi-node, not by the controller's socket",
    ))
}

#[tonic::async_trait]
impl csi_proto::v1::node_server::Node for NodeInfoOnly {
    async fn node_stage_volume(
        &self,
        _r: Request<NodeStageVolumeRequest>,
    ) -> Result<Response<NodeStageVolumeResponse>, Status> {
        served_by_csi_node()
    }

    async fn node_unstage_volume(
        &self,
        _r: Request<NodeUnstageVolumeRequest>,
    ) -> Result<Response<NodeUnstageVolumeResponse>, Status> {
        served_by_csi_node()
    }

    async fn node_publish_volume(
        &self,
        _r: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        served_by_csi_node()
    }

    async fn node_unpublish_volume(
        &self,
        _r: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        served_by_csi_node()
    }

    async fn node_get_volume_stats(
        &self,
        _r: Request<NodeGetVolumeStatsRequest>,
    ) -> Result<Response<NodeGetVolumeStatsResponse>, Status> {
        served_by_csi_node()
    }

    async fn node_expand_volume(
        &self,
        _r: Request<NodeExpandVolumeRequest>,
    ) -> Result<Response<NodeExpandVolumeResponse>, Status> {
        served_by_csi_node()
    }

    async fn node_get_capabilities(
        &self,
        _r: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: vec![],
        }))
    }

    /// MUST identify the node exactly as csi-node does, so the topology external-provisioner
    /// writes matches what kubelet registered.
    async fn node_get_info(
        &self,
        _r: Request<NodeGetInfoRequest>,
    ) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(csi_proto::v1::Topology {
                segments: to_map(&self.topology),
            }),
        }))
    }
}

pub struct ControllerService<B> {
    backend: Arc<B>,
    locks: Locks,
}

impl<B: ControllerBackend> ControllerService<B> {
    pub fn new(backend: Arc<B>, locks: Locks) -> Self {
        ControllerService { backend, locks }
    }

    fn lock(&self, key: &str) -> Result<cloud_backend::sys::lock::LockGuard, Status> {
        self.locks.try_lock(key).map_err(to_status)
    }

    /// Expand and modify take the volume lock, unless the backend merges concurrent
    /// modifications of one volume itself (EBS allows one modification per six hours, so the
    /// second of two concurrent requests must join the first, not be refused).
    fn modification_lock(
        &self,
        volume_id: &str,
    ) -> Result<Option<cloud_backend::sys::lock::LockGuard>, Status> {
        if self.backend.capabilities().coalesces_modifications {
            return Ok(None);
        }
        self.lock(volume_id).map(Some)
    }

    fn multi_node(&self) -> bool {
        self.backend.capabilities().multi_node
    }
}

fn to_map(m: &BTreeMap<String, String>) -> HashMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn from_map(m: &HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

fn topology(t: &Topology) -> csi_proto::v1::Topology {
    csi_proto::v1::Topology {
        segments: to_map(t),
    }
}

fn content_source(c: &ContentSource) -> VolumeContentSource {
    use volume_content_source::{SnapshotSource, Type, VolumeSource};
    VolumeContentSource {
        r#type: Some(match c {
            ContentSource::Snapshot(id) => Type::Snapshot(SnapshotSource {
                snapshot_id: id.clone(),
            }),
            ContentSource::Volume(id) => Type::Volume(VolumeSource {
                volume_id: id.clone(),
            }),
        }),
    }
}

fn volume(v: &cloud_backend::Volume) -> Volume {
    Volume {
        capacity_bytes: v.capacity_bytes as i64,
        volume_id: v.id.clone(),
        volume_context: to_map(&v.context),
        content_source: v.content_source.as_ref().map(content_source),
        accessible_topology: v.accessible_topology.iter().map(topology).collect(),
    }
}

fn snapshot(s: &cloud_backend::Snapshot) -> Snapshot {
    Snapshot {
        size_bytes: s.size_bytes as i64,
        snapshot_id: s.id.clone(),
        source_volume_id: s.source_volume_id.clone(),
        creation_time: Some(prost_types::Timestamp {
            seconds: s.created_at.0,
            nanos: s.created_at.1,
        }),
        ready_to_use: s.ready,
        group_snapshot_id: String::new(),
    }
}

fn condition(abnormal: &Option<String>) -> VolumeCondition {
    VolumeCondition {
        abnormal: abnormal.is_some(),
        message: abnormal
            .clone()
            .unwrap_or_else(|| "volume is healthy".into()),
    }
}

fn capacity_range(range: &Option<CapacityRange>) -> Result<(u64, u64), Status> {
    let Some(r) = range else { return Ok((0, 0)) };
    if r.required_bytes < 0 || r.limit_bytes < 0 {
        return Err(invalid(
            "capacity_range: required_bytes and limit_bytes must not be negative",
        ));
    }
    if r.limit_bytes > 0 && r.required_bytes > r.limit_bytes {
        return Err(invalid(format!(
            "capacity_range is impossible: required_bytes {} exceeds limit_bytes {}",
            r.required_bytes, r.limit_bytes
        )));
    }
    Ok((r.required_bytes as u64, r.limit_bytes as u64))
}

/// A pagination token is the last id of the previous page. Anything else did not come from us.
fn starting_token(token: &str, valid: impl Fn(&str) -> bool) -> Result<Option<String>, Status> {
    if token.is_empty() {
        return Ok(None);
    }
    if !valid(token) {
        return Err(Status::aborted(format!(
            "starting_token {token:?} was not returned by a previous list call"
        )));
    }
    Ok(Some(token.to_string()))
}

fn max_entries(n: i32) -> Result<usize, Status> {
    usize::try_from(n).map_err(|_| invalid(format!("max_entries must not be negative (got {n})")))
}

#[tonic::async_trait]
impl<B: ControllerBackend> Controller for ControllerService<B> {
    /// MUST create a volume with the requested name, capacity, capabilities and content; the
    /// same name again with compatible arguments MUST return the same volume, with
    /// incompatible ones ALREADY_EXISTS. An unsatisfiable capacity is OUT_OF_RANGE, a missing
    /// source NOT_FOUND, no room in the requested topology RESOURCE_EXHAUSTED.
    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name))]
    async fn create_volume(
        &self,
        request: Request<CreateVolumeRequest>,
    ) -> Result<Response<CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::name(&req.name)?;
        let caps = validate::capabilities(&req.volume_capabilities, self.multi_node())?;
        let (required_bytes, limit_bytes) = capacity_range(&req.capacity_range)?;
        let parameters = from_map(&req.parameters);
        self.backend
            .validate_parameters(&parameters)
            .map_err(to_status)?;
        let mutable_parameters = from_map(&req.mutable_parameters);
        self.backend
            .validate_mutable_parameters(&mutable_parameters)
            .map_err(to_status)?;
        let fs_types: Vec<&str> = caps
            .iter()
            .filter_map(|c| match &c.access {
                validate::Access::Mount { fs_type, .. } => Some(fs_type.as_str()),
                validate::Access::Block => None,
            })
            .collect();
        // The size floor follows the most demanding filesystem the volume may carry.
        let fs_type = fs_types
            .contains(&"xfs")
            .then(|| "xfs".to_string())
            .or_else(|| fs_types.first().map(|f| f.to_string()));
        let source = match req.volume_content_source.and_then(|s| s.r#type) {
            None => None,
            Some(volume_content_source::Type::Snapshot(s)) => {
                validate::require("volume_content_source.snapshot.snapshot_id", &s.snapshot_id)?;
                Some(ContentSource::Snapshot(s.snapshot_id))
            }
            Some(volume_content_source::Type::Volume(v)) => {
                validate::require("volume_content_source.volume.volume_id", &v.volume_id)?;
                Some(ContentSource::Volume(v.volume_id))
            }
        };
        let topologies = |ts: &[csi_proto::v1::Topology]| -> Vec<Topology> {
            ts.iter().map(|t| from_map(&t.segments)).collect()
        };
        let (accessibility, preferred) = req
            .accessibility_requirements
            .map(|a| (topologies(&a.requisite), topologies(&a.preferred)))
            .unwrap_or_default();
        let spec = cloud_backend::CreateVolume {
            name: req.name.clone(),
            required_bytes,
            limit_bytes,
            parameters,
            mutable_parameters,
            content_source: source,
            fs_type,
            accessibility,
            preferred,
        };
        let guard = self.lock(&self.backend.create_lock_key(&req.name))?;
        let backend = self.backend.clone();
        let vol = run_to_completion(async move {
            let _guard = guard;
            backend.create_volume(spec).await.map_err(to_status)
        })
        .await?;
        Ok(Response::new(CreateVolumeResponse {
            volume: Some(volume(&vol)),
        }))
    }

    /// MUST delete the volume; a volume that does not exist is success (idempotence). A volume
    /// still in use is FAILED_PRECONDITION.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id))]
    async fn delete_volume(
        &self,
        request: Request<DeleteVolumeRequest>,
    ) -> Result<Response<DeleteVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        if !self.backend.is_volume_id(&req.volume_id) {
            return Ok(Response::new(DeleteVolumeResponse {}));
        }
        let mut guard = self.lock(&req.volume_id)?;
        let backend = self.backend.clone();
        run_to_completion(async move {
            backend
                .delete_volume(&req.volume_id)
                .await
                .map_err(to_status)?;
            guard.remove_on_release();
            Ok(())
        })
        .await?;
        Ok(Response::new(DeleteVolumeResponse {}))
    }

    /// MUST make the volume available on the node and return what the node needs to find it.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, node_id = %request.get_ref().node_id))]
    async fn controller_publish_volume(
        &self,
        request: Request<ControllerPublishVolumeRequest>,
    ) -> Result<Response<ControllerPublishVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        validate::require("node_id", &req.node_id)?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or_else(|| invalid("volume_capability is required"))?;
        validate::capability(cap, self.multi_node())?;
        if !self.backend.capabilities().attach {
            return Err(Status::unimplemented(
                "this backend has no attach step (PUBLISH_UNPUBLISH_VOLUME is not advertised)",
            ));
        }
        if !self.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let guard = self.lock(&req.volume_id)?;
        let backend = self.backend.clone();
        let ctx = run_to_completion(async move {
            let _guard = guard;
            backend
                .publish(&req.volume_id, &req.node_id, req.readonly)
                .await
                .map_err(to_status)
        })
        .await?;
        Ok(Response::new(ControllerPublishVolumeResponse {
            publish_context: to_map(&ctx),
        }))
    }

    /// MUST detach the volume from the node (every node when node_id is empty); a volume
    /// already detached or gone is success.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, node_id = %request.get_ref().node_id))]
    async fn controller_unpublish_volume(
        &self,
        request: Request<ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<ControllerUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        if !self.backend.capabilities().attach {
            return Err(Status::unimplemented(
                "this backend has no attach step (PUBLISH_UNPUBLISH_VOLUME is not advertised)",
            ));
        }
        if !self.backend.is_volume_id(&req.volume_id) {
            return Ok(Response::new(ControllerUnpublishVolumeResponse {}));
        }
        let guard = self.lock(&req.volume_id)?;
        let backend = self.backend.clone();
        run_to_completion(async move {
            let _guard = guard;
            let node = (!req.node_id.is_empty()).then_some(req.node_id.as_str());
            backend
                .unpublish(&req.volume_id, node)
                .await
                .map_err(to_status)
        })
        .await?;
        Ok(Response::new(ControllerUnpublishVolumeResponse {}))
    }

    /// MUST say whether the volume supports every listed capability (and the given context and
    /// parameters); an unknown volume is NOT_FOUND.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id))]
    async fn validate_volume_capabilities(
        &self,
        request: Request<ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        if req.volume_capabilities.is_empty() {
            return Err(invalid("volume_capabilities is required"));
        }
        if !self.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let vol = self
            .backend
            .get_volume(&req.volume_id)
            .await
            .map_err(to_status)?;
        let unsupported = req
            .volume_capabilities
            .iter()
            .find_map(|c| validate::capability(c, self.multi_node()).err());
        if let Some(err) = unsupported {
            return Ok(Response::new(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: err.message().to_string(),
            }));
        }
        if !req.parameters.is_empty() && from_map(&req.parameters) != vol.parameters {
            return Ok(Response::new(ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: "the volume was created with different parameters".into(),
            }));
        }
        Ok(Response::new(ValidateVolumeCapabilitiesResponse {
            confirmed: Some(validate_volume_capabilities_response::Confirmed {
                volume_context: req.volume_context,
                volume_capabilities: req.volume_capabilities,
                parameters: req.parameters,
                mutable_parameters: HashMap::new(),
            }),
            message: String::new(),
        }))
    }

    /// MUST list volumes in a stable order; a token not produced by us is ABORTED.
    #[tracing::instrument(skip_all)]
    async fn list_volumes(
        &self,
        request: Request<ListVolumesRequest>,
    ) -> Result<Response<ListVolumesResponse>, Status> {
        let req = request.into_inner();
        let max = max_entries(req.max_entries)?;
        let start = starting_token(&req.starting_token, |t| self.backend.is_volume_id(t))?;
        let page = self
            .backend
            .list_volumes(start.as_deref(), max)
            .await
            .map_err(to_status)?;
        let attach = self.backend.capabilities().attach;
        Ok(Response::new(ListVolumesResponse {
            entries: page
                .entries
                .iter()
                .map(|v| list_volumes_response::Entry {
                    volume: Some(volume(v)),
                    status: Some(list_volumes_response::VolumeStatus {
                        published_node_ids: if attach {
                            v.published_nodes.clone()
                        } else {
                            Vec::new()
                        },
                        volume_condition: Some(condition(&v.abnormal)),
                    }),
                })
                .collect(),
            next_token: page.next.unwrap_or_default(),
        }))
    }

    /// MUST report the capacity available for new volumes with the given capabilities,
    /// parameters and topology.
    #[tracing::instrument(skip_all)]
    async fn get_capacity(
        &self,
        request: Request<GetCapacityRequest>,
    ) -> Result<Response<GetCapacityResponse>, Status> {
        let req = request.into_inner();
        for cap in &req.volume_capabilities {
            validate::capability(cap, self.multi_node())?;
        }
        self.backend
            .validate_parameters(&from_map(&req.parameters))
            .map_err(to_status)?;
        let topo = req.accessible_topology.map(|t| from_map(&t.segments));
        let cap = self
            .backend
            .capacity(topo.as_ref())
            .await
            .map_err(to_status)?;
        Ok(Response::new(GetCapacityResponse {
            available_capacity: cap.available_bytes as i64,
            maximum_volume_size: Some(cap.maximum_volume_bytes as i64),
            minimum_volume_size: Some(cap.minimum_volume_bytes as i64),
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn controller_get_capabilities(
        &self,
        _request: Request<ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<ControllerGetCapabilitiesResponse>, Status> {
        use controller_service_capability::rpc::Type;
        let c = self.backend.capabilities();
        let mut types = vec![
            Type::CreateDeleteVolume,
            Type::GetVolume,
            Type::VolumeCondition,
            Type::SingleNodeMultiWriter,
        ];
        if c.snapshots {
            types.extend([Type::CreateDeleteSnapshot, Type::ListSnapshots]);
        }
        if c.clone {
            types.push(Type::CloneVolume);
        }
        if c.expand {
            types.push(Type::ExpandVolume);
        }
        if c.list_volumes {
            types.push(Type::ListVolumes);
        }
        if c.get_capacity {
            types.push(Type::GetCapacity);
        }
        if c.attach {
            // PUBLISH_READONLY is not offered: EBS attachments have no read-only mode; read-only
            // is enforced on the node (read-only mounts, BLKROSET for raw block).
            types.extend([
                Type::PublishUnpublishVolume,
                Type::ListVolumesPublishedNodes,
            ]);
        }
        if c.modify {
            types.push(Type::ModifyVolume);
        }
        Ok(Response::new(ControllerGetCapabilitiesResponse {
            capabilities: types
                .into_iter()
                .map(|t| ControllerServiceCapability {
                    r#type: Some(controller_service_capability::Type::Rpc(
                        controller_service_capability::Rpc { r#type: t as i32 },
                    )),
                })
                .collect(),
        }))
    }

    /// MUST snapshot the source volume under the given name; the same name with another source
    /// is ALREADY_EXISTS. The copy is consistent: see the backend.
    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name, volume_id = %request.get_ref().source_volume_id))]
    async fn create_snapshot(
        &self,
        request: Request<CreateSnapshotRequest>,
    ) -> Result<Response<CreateSnapshotResponse>, Status> {
        let req = request.into_inner();
        validate::name(&req.name)?;
        validate::require("source_volume_id", &req.source_volume_id)?;
        let parameters = from_map(&req.parameters);
        if !self.backend.capabilities().snapshots {
            return Err(Status::unimplemented(
                "this backend does not support snapshots",
            ));
        }
        let guard = self.lock(&self.backend.snapshot_lock_key(&req.name))?;
        let backend = self.backend.clone();
        let snap = run_to_completion(async move {
            let _guard = guard;
            backend
                .create_snapshot(&req.name, &req.source_volume_id, &parameters)
                .await
                .map_err(to_status)
        })
        .await?;
        Ok(Response::new(CreateSnapshotResponse {
            snapshot: Some(snapshot(&snap)),
        }))
    }

    /// MUST delete the snapshot; one that does not exist is success.
    #[tracing::instrument(skip_all, fields(snapshot_id = %request.get_ref().snapshot_id))]
    async fn delete_snapshot(
        &self,
        request: Request<DeleteSnapshotRequest>,
    ) -> Result<Response<DeleteSnapshotResponse>, Status> {
        let req = request.into_inner();
        validate::require("snapshot_id", &req.snapshot_id)?;
        if !self.backend.is_snapshot_id(&req.snapshot_id) {
            return Ok(Response::new(DeleteSnapshotResponse {}));
        }
        let mut guard = self.lock(&req.snapshot_id)?;
        let backend = self.backend.clone();
        run_to_completion(async move {
            backend
                .delete_snapshot(&req.snapshot_id)
                .await
                .map_err(to_status)?;
            guard.remove_on_release();
            Ok(())
        })
        .await?;
        Ok(Response::new(DeleteSnapshotResponse {}))
    }

    /// MUST list snapshots, filtered by id or source volume (no match is an empty list, not an
    /// error), paginated like ListVolumes.
    #[tracing::instrument(skip_all)]
    async fn list_snapshots(
        &self,
        request: Request<ListSnapshotsRequest>,
    ) -> Result<Response<ListSnapshotsResponse>, Status> {
        let req = request.into_inner();
        let max = max_entries(req.max_entries)?;
        let start = starting_token(&req.starting_token, |t| self.backend.is_snapshot_id(t))?;
        let filter = SnapshotFilter {
            snapshot_id: (!req.snapshot_id.is_empty()).then_some(req.snapshot_id),
            source_volume_id: (!req.source_volume_id.is_empty()).then_some(req.source_volume_id),
        };
        let page = self
            .backend
            .list_snapshots(filter, start.as_deref(), max)
            .await
            .map_err(to_status)?;
        Ok(Response::new(ListSnapshotsResponse {
            entries: page
                .entries
                .iter()
                .map(|s| list_snapshots_response::Entry {
                    snapshot: Some(snapshot(s)),
                })
                .collect(),
            next_token: page.next.unwrap_or_default(),
        }))
    }

    /// MUST grow the volume to at least required_bytes (never shrink; already large enough is
    /// success) and say whether the node must finish the job.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id))]
    async fn controller_expand_volume(
        &self,
        request: Request<ControllerExpandVolumeRequest>,
    ) -> Result<Response<ControllerExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        if req.capacity_range.is_none() {
            return Err(invalid("capacity_range is required"));
        }
        let (required, limit) = capacity_range(&req.capacity_range)?;
        if required == 0 {
            return Err(invalid(
                "capacity_range.required_bytes must be set to the new size",
            ));
        }
        if let Some(cap) = &req.volume_capability {
            validate::capability(cap, self.multi_node())?;
        }
        if !self.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let guard = self.modification_lock(&req.volume_id)?;
        let backend = self.backend.clone();
        let size = run_to_completion(async move {
            let _guard = guard;
            backend
                .expand_volume(&req.volume_id, required)
                .await
                .map_err(to_status)
        })
        .await?;
        if limit > 0 && size > limit {
            return Err(to_status(Error::OutOfRange(format!(
                "the volume is {size} bytes, above limit_bytes {limit}"
            ))));
        }
        Ok(Response::new(ControllerExpandVolumeResponse {
            capacity_bytes: size as i64,
            node_expansion_required: true,
        }))
    }

    /// MUST describe an existing volume and its condition; unknown is NOT_FOUND.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id))]
    async fn controller_get_volume(
        &self,
        request: Request<ControllerGetVolumeRequest>,
    ) -> Result<Response<ControllerGetVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        if !self.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let v = self
            .backend
            .get_volume(&req.volume_id)
            .await
            .map_err(to_status)?;
        Ok(Response::new(ControllerGetVolumeResponse {
            volume: Some(volume(&v)),
            status: Some(controller_get_volume_response::VolumeStatus {
                published_node_ids: v.published_nodes.clone(),
                volume_condition: Some(condition(&v.abnormal)),
            }),
        }))
    }

    /// MUST apply the mutable parameters (a VolumeAttributesClass) to the volume; unknown keys
    /// are INVALID_ARGUMENT, an unknown volume NOT_FOUND.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id))]
    async fn controller_modify_volume(
        &self,
        request: Request<ControllerModifyVolumeRequest>,
    ) -> Result<Response<ControllerModifyVolumeResponse>, Status> {
        let req = request.into_inner();
        validate::require("volume_id", &req.volume_id)?;
        if !self.backend.capabilities().modify {
            return Err(Status::unimplemented(
                "ControllerModifyVolume is not supported by this backend",
            ));
        }
        if !self.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        // An unknown volume is NOT_FOUND whatever the parameters say.
        self.backend
            .get_volume(&req.volume_id)
            .await
            .map_err(to_status)?;
        let mutable = from_map(&req.mutable_parameters);
        self.backend
            .validate_mutable_parameters(&mutable)
            .map_err(to_status)?;
        if mutable.is_empty() {
            return Ok(Response::new(ControllerModifyVolumeResponse {}));
        }
        let guard = self.modification_lock(&req.volume_id)?;
        let backend = self.backend.clone();
        run_to_completion(async move {
            let _guard = guard;
            backend
                .modify_volume(&req.volume_id, &mutable)
                .await
                .map_err(to_status)
        })
        .await?;
        Ok(Response::new(ControllerModifyVolumeResponse {}))
    }

    /// MUST describe an existing snapshot; unknown is NOT_FOUND.
    #[tracing::instrument(skip_all, fields(snapshot_id = %request.get_ref().snapshot_id))]
    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<GetSnapshotResponse>, Status> {
        let req = request.into_inner();
        validate::require("snapshot_id", &req.snapshot_id)?;
        let filter = SnapshotFilter {
            snapshot_id: Some(req.snapshot_id.clone()),
            source_volume_id: None,
        };
        let page = self
            .backend
            .list_snapshots(filter, None, 0)
            .await
            .map_err(to_status)?;
        let snap = page.entries.first().ok_or_else(|| {
            to_status(Error::NotFound(format!(
                "snapshot {} does not exist",
                req.snapshot_id
            )))
        })?;
        Ok(Response::new(GetSnapshotResponse {
            snapshot: Some(snapshot(snap)),
        }))
    }
}
