use super::batch::Batcher;
use super::coalesce::{Coalescer, Modification};
use super::params::{self, GIB};
use super::*;
use crate::{
    BackendCapabilities, Capacity, ContentSource, ControllerBackend, CreateVolume, Page, Snapshot,
    SnapshotFilter, Topology, Volume,
};
use aws_sdk_ec2::types::{
    Filter, ResourceType, SnapshotState, Tag, TagSpecification, VolumeAttachmentState,
    VolumeModificationState, VolumeState, VolumeType,
};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// The EBS side of the driver. Cheap to clone.
#[derive(Clone)]
pub struct AwsBackend {
    inner: Arc<Inner>,
}

struct Inner {
    ec2: aws_sdk_ec2::Client,
    cfg: AwsConfig,
    volumes: Batcher<aws_sdk_ec2::types::Volume>,
    instances: Batcher<aws_sdk_ec2::types::Instance>,
    coalescer: Coalescer,
    /// Device names handed out per instance and not yet released by a detach: never reused
    /// while taken, even before EC2 shows the attachment.
    reserved: Mutex<HashMap<String, HashMap<String, String>>>,
}

/// How long a volume CreateVolume answered with may stay invisible to DescribeVolumes before
/// it counts as gone.
const VISIBILITY_GRACE: Duration = Duration::from_secs(10);

fn filter(name: &str, values: Vec<String>) -> Filter {
    Filter::builder()
        .name(name)
        .set_values(Some(values))
        .build()
}

fn tag(k: &str, v: &str) -> Tag {
    Tag::builder().key(k).value(v).build()
}

fn tag_value<'a>(tags: &'a [Tag], key: &str) -> Option<&'a str> {
    tags.iter()
        .find(|t| t.key() == Some(key))
        .and_then(|t| t.value())
}

/// A CSI name → EC2 ClientToken (at most 64 characters).
pub fn client_token(name: &str) -> String {
    client_token_generation(name, 0)
}

/// The ClientToken of `name` after `generation` tokens were found burnt. Generation 0 is the
/// plain digest of the name, so a controller restarted mid-create sends the same token again.
fn client_token_generation(name: &str, generation: u32) -> String {
    let mut h = Sha256::new();
    h.update(name.as_bytes());
    if generation > 0 {
        h.update(format!("\0{generation}").as_bytes());
    }
    hex::encode(h.finalize())
}

impl AwsBackend {
    pub fn new(ec2: aws_sdk_ec2::Client, cfg: AwsConfig) -> Self {
        let vc = ec2.clone();
        let volumes = Batcher::new(
            cfg.batching,
            cfg.batch_window,
            500,
            Arc::new(move |ids: Vec<String>| {
                let c = vc.clone();
                Box::pin(async move {
                    let mut out = HashMap::new();
                    let mut next = None;
                    loop {
                        let resp = call(
                            "DescribeVolumes",
                            c.describe_volumes()
                                .filters(filter("volume-id", ids.clone()))
                                .set_next_token(next)
                                .send(),
                        )
                        .await?;
                        for v in resp.volumes() {
                            if let Some(id) = v.volume_id() {
                                out.insert(id.to_string(), v.clone());
                            }
                        }
                        next = resp.next_token().map(str::to_string);
                        if next.is_none() {
                            return Ok(out);
                        }
                    }
                })
            }),
        );
        let ic = ec2.clone();
        let instances = Batcher::new(
            cfg.batching,
            cfg.batch_window,
            50,
            Arc::new(move |ids: Vec<String>| {
                let c = ic.clone();
                Box::pin(async move {
                    let resp = call(
                        "DescribeInstances",
                        c.describe_instances()
                            .filters(filter("instance-id", ids))
                            .send(),
                    )
                    .await?;
                    Ok(resp
                        .reservations()
                        .iter()
                        .flat_map(|r| r.instances())
                        .filter_map(|i| i.instance_id().map(|id| (id.to_string(), i.clone())))
                        .collect())
                })
            }),
        );
        let mc = ec2.clone();
        let poll = cfg.poll_initial;
        let coalescer = Coalescer::new(
            cfg.modify_window,
            Arc::new(move |id: String, m: Modification| {
                let c = mc.clone();
                Box::pin(async move { apply_modification(&c, &id, m, poll).await })
            }),
        );
        AwsBackend {
            inner: Arc::new(Inner {
                ec2,
                cfg,
                volumes,
                instances,
                coalescer,
                reserved: Mutex::new(HashMap::new()),
            }),
        }
    }

    pub fn config(&self) -> &AwsConfig {
        &self.inner.cfg
    }

    /// A cheap read-only call for the background health check (never used by Probe: a cloud
    /// outage must not make livenessprobe restart the controller in a loop).
    pub async fn health_check(&self) -> Result<()> {
        call(
            "DescribeAvailabilityZones",
            self.inner.ec2.describe_availability_zones().send(),
        )
        .await
        .map(drop)
    }

    async fn find_by_name(&self, name: &str) -> Result<Option<aws_sdk_ec2::types::Volume>> {
        let resp = call(
            "DescribeVolumes",
            self.inner
                .ec2
                .describe_volumes()
                .set_filters(Some(self.name_filters(VOLUME_NAME_TAG, name)))
                .send(),
        )
        .await?;
        let mut live: Vec<_> = resp
            .volumes()
            .iter()
            .filter(|v| {
                !matches!(
                    v.state(),
                    Some(VolumeState::Deleting) | Some(VolumeState::Deleted)
                )
            })
            .cloned()
            .collect();
        if live.len() > 1 {
            // Two volumes for one name can only come from outside interference; never guess.
            live.sort_by(|a, b| a.volume_id().cmp(&b.volume_id()));
            return Err(Error::Internal(format!(
                "{} EBS volumes carry {VOLUME_NAME_TAG}={name}: {:?}; delete the extra ones",
                live.len(),
                live.iter()
                    .filter_map(|v| v.volume_id())
                    .collect::<Vec<_>>()
            )));
        }
        Ok(live.pop())
    }

    fn to_volume(&self, v: &aws_sdk_ec2::types::Volume) -> Volume {
        Volume {
            id: v.volume_id().unwrap_or_default().to_string(),
            name: tag_value(v.tags(), VOLUME_NAME_TAG)
                .unwrap_or_default()
                .to_string(),
            capacity_bytes: v.size().unwrap_or(0) as u64 * GIB,
            parameters: BTreeMap::new(),
            content_source: v
                .snapshot_id()
                .filter(|s| !s.is_empty())
                .map(|s| ContentSource::Snapshot(s.to_string())),
            accessible_topology: v
                .availability_zone()
                .map(|z| vec![BTreeMap::from([(ZONE_KEY.to_string(), z.to_string())])])
                .unwrap_or_default(),
            context: BTreeMap::new(),
            published_nodes: v
                .attachments()
                .iter()
                .filter(|a| {
                    matches!(
                        a.state(),
                        Some(VolumeAttachmentState::Attached)
                            | Some(VolumeAttachmentState::Attaching)
                    )
                })
                .filter_map(|a| a.instance_id().map(str::to_string))
                .collect(),
            abnormal: match v.state() {
                Some(VolumeState::Error) => Some("EBS reports the volume in state error".into()),
                _ => None,
            },
        }
    }

    fn pick_zone(&self, req: &CreateVolume) -> Result<String> {
        let from = |ts: &[Topology]| ts.iter().find_map(|t| t.get(ZONE_KEY).cloned());
        from(&req.preferred)
            .or_else(|| from(&req.accessibility))
            .or_else(|| self.inner.cfg.default_zone.clone())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "no zone: the request names no {ZONE_KEY} topology and no --default-zone is set"
                ))
            })
    }

    /// Polls (through the batcher) until the volume reaches `want`, with a bounded backoff.
    async fn wait_state(&self, id: &str, want: VolumeState) -> Result<aws_sdk_ec2::types::Volume> {
        let mut delay = self.inner.cfg.poll_initial;
        let start = Instant::now();
        let deadline = start + Duration::from_secs(300);
        loop {
            match self.inner.volumes.get(id).await? {
                // EC2 is eventually consistent: a volume CreateVolume just answered with may
                // not be listed for a few seconds.
                None if start.elapsed() < VISIBILITY_GRACE => {}
                Some(v) if v.state() == Some(&want) => return Ok(v),
                Some(v) if v.state() == Some(&VolumeState::Error) => {
                    return Err(Error::Internal(format!(
                        "EBS volume {id} went into state error"
                    )));
                }
                Some(_) => {}
                None => return Err(Error::NotFound(format!("volume {id} does not exist"))),
            }
            if Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "volume {id} did not become {want:?} within 5 minutes; retry"
                )));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 3 / 2).min(Duration::from_secs(10));
        }
    }

    /// An existing volume of the same name answers the create if it is compatible.
    async fn existing(
        &self,
        v: aws_sdk_ec2::types::Volume,
        req: &CreateVolume,
        p: &params::VolumeParams,
    ) -> Result<Volume> {
        let id = v.volume_id().unwrap_or_default().to_string();
        let bytes = v.size().unwrap_or(0) as u64 * GIB;
        let fits =
            bytes >= req.required_bytes && (req.limit_bytes == 0 || bytes <= req.limit_bytes);
        let same_type = v.volume_type().map(|t| t.as_str()) == Some(p.volume_type.as_str());
        let want_snapshot = match &req.content_source {
            Some(ContentSource::Snapshot(s)) => Some(s.as_str()),
            _ => None,
        };
        let same_source = v.snapshot_id().filter(|s| !s.is_empty()) == want_snapshot;
        if !fits || !same_type || !same_source {
            return Err(Error::AlreadyExists(format!(
                "volume {:?} already exists as {id} ({bytes} bytes, type {:?}, snapshot {:?}), incompatible with this request",
                req.name,
                v.volume_type().map(|t| t.as_str()),
                v.snapshot_id()
            )));
        }
        let v = if v.state() == Some(&VolumeState::Creating) {
            self.wait_state(&id, VolumeState::Available).await?
        } else {
            v
        };
        Ok(self.to_volume(&v))
    }

    fn reserve_device(
        &self,
        instance: &aws_sdk_ec2::types::Instance,
        volume_id: &str,
    ) -> Result<String> {
        let iid = instance.instance_id().unwrap_or_default().to_string();
        let mut reserved = self
            .inner
            .reserved
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mine = reserved.entry(iid.clone()).or_default();
        if let Some((dev, _)) = mine.iter().find(|(_, v)| *v == volume_id) {
            return Ok(dev.clone());
        }
        let taken: std::collections::HashSet<String> = instance
            .block_device_mappings()
            .iter()
            .filter_map(|m| m.device_name().map(|d| d.to_string()))
            .chain(mine.keys().cloned())
            .collect();
        for a in b'b'..=b'z' {
            for b in b'a'..=b'z' {
                let name = format!("/dev/xvd{}{}", a as char, b as char);
                if !taken.contains(&name) {
                    mine.insert(name.clone(), volume_id.to_string());
                    return Ok(name);
                }
            }
        }
        Err(Error::ResourceExhausted(format!(
            "no free device name left on instance {iid}"
        )))
    }

    fn release_device(&self, instance_id: &str, volume_id: &str) {
        let mut reserved = self
            .inner
            .reserved
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(m) = reserved.get_mut(instance_id) {
            m.retain(|_, v| v != volume_id);
        }
    }

    /// Waits for the attachment of `volume_id` to `instance_id` to reach `attached`; gives up
    /// (so the caller can detach and retry) if it stays `attaching` beyond the bound.
    async fn wait_attached(&self, volume_id: &str, instance_id: &str) -> Result<Option<String>> {
        let mut delay = self.inner.cfg.poll_initial;
        let start = Instant::now();
        loop {
            let v = self.inner.volumes.get(volume_id).await?.ok_or_else(|| {
                Error::NotFound(format!("volume {volume_id} vanished while attaching"))
            })?;
            let att = v
                .attachments()
                .iter()
                .find(|a| a.instance_id() == Some(instance_id));
            match att.and_then(|a| a.state()) {
                Some(VolumeAttachmentState::Attached) => {
                    return Ok(att.and_then(|a| a.device()).map(str::to_string));
                }
                Some(VolumeAttachmentState::Attaching) | None
                    if start.elapsed() < self.inner.cfg.attach_stuck_after => {}
                Some(VolumeAttachmentState::Attaching) | None => return Ok(None),
                Some(other) => {
                    return Err(Error::Unavailable(format!(
                        "attachment of {volume_id} to {instance_id} is {other:?}; retry"
                    )));
                }
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 9 / 5).min(Duration::from_secs(15));
        }
    }

    async fn detach(&self, volume_id: &str, instance_id: &str, device: Option<&str>) -> Result<()> {
        let res = call(
            "DetachVolume",
            self.inner
                .ec2
                .detach_volume()
                .volume_id(volume_id)
                .instance_id(instance_id)
                .set_device(device.map(str::to_string))
                .send(),
        )
        .await;
        match res {
            // Already detached (or detaching, or gone): that is what we want.
            Ok(_) | Err(Error::NotFound(_)) | Err(Error::FailedPrecondition(_)) => {}
            Err(e) => return Err(e),
        }
        let mut delay = self.inner.cfg.poll_initial;
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            let Some(v) = self.inner.volumes.get(volume_id).await? else {
                break;
            };
            if !v.attachments().iter().any(|a| {
                a.instance_id() == Some(instance_id)
                    && a.state() != Some(&VolumeAttachmentState::Detached)
            }) {
                break;
            }
            if Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "{volume_id} is still detaching from {instance_id}; retry"
                )));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 9 / 5).min(Duration::from_secs(15));
        }
        self.release_device(instance_id, volume_id);
        Ok(())
    }

    /// Only what this driver instance manages: the cluster tag.
    fn cluster_filter(&self) -> Filter {
        filter(
            &format!("tag:{CLUSTER_TAG}"),
            vec![self.inner.cfg.cluster_id.clone()],
        )
    }

    /// What was created for the CSI name `name` (under `name_tag`) by this driver instance.
    fn name_filters(&self, name_tag: &str, name: &str) -> Vec<Filter> {
        vec![
            filter(&format!("tag:{name_tag}"), vec![name.to_string()]),
            self.cluster_filter(),
        ]
    }

    fn tag_specs(
        &self,
        resource: ResourceType,
        name_tag: &str,
        name: &str,
        extra: &BTreeMap<String, String>,
    ) -> TagSpecification {
        let mut b = TagSpecification::builder()
            .resource_type(resource)
            .tags(tag(name_tag, name))
            .tags(tag(CLUSTER_TAG, &self.inner.cfg.cluster_id));
        for (k, v) in extra {
            b = b.tags(tag(k, v));
        }
        b.build()
    }

    async fn snapshot_by_name(&self, name: &str) -> Result<Option<aws_sdk_ec2::types::Snapshot>> {
        let resp = call(
            "DescribeSnapshots",
            self.inner
                .ec2
                .describe_snapshots()
                .set_filters(Some(self.name_filters(SNAPSHOT_NAME_TAG, name)))
                .send(),
        )
        .await?;
        Ok(resp.snapshots().first().cloned())
    }
}

fn to_snapshot(s: &aws_sdk_ec2::types::Snapshot) -> Snapshot {
    Snapshot {
        id: s.snapshot_id().unwrap_or_default().to_string(),
        name: tag_value(s.tags(), SNAPSHOT_NAME_TAG)
            .unwrap_or_default()
            .to_string(),
        source_volume_id: s.volume_id().unwrap_or_default().to_string(),
        size_bytes: s.volume_size().unwrap_or(0) as u64 * GIB,
        created_at: s
            .start_time()
            .map(|t| (t.secs(), t.subsec_nanos() as i32))
            .unwrap_or((0, 0)),
        ready: s.state() == Some(&SnapshotState::Completed),
    }
}

fn page<T>(
    mut items: Vec<T>,
    id: impl Fn(&T) -> &str,
    start_after: Option<&str>,
    max: usize,
) -> Page<T> {
    items.sort_by(|a, b| id(a).cmp(id(b)));
    let mut entries: Vec<T> = items
        .into_iter()
        .filter(|t| start_after.is_none_or(|s| id(t) > s))
        .collect();
    let next = if max > 0 && entries.len() > max {
        entries.truncate(max);
        entries.last().map(|t| id(t).to_string())
    } else {
        None
    };
    Page { entries, next }
}

/// One ModifyVolume with everything merged, then a wait until EBS reports the modification as
/// `optimizing` (the new size is usable from then on; `completed` can take hours).
async fn apply_modification(
    ec2: &aws_sdk_ec2::Client,
    id: &str,
    m: Modification,
    poll: Duration,
) -> Result<u64> {
    let resp = call(
        "ModifyVolume",
        ec2.modify_volume()
            .volume_id(id)
            .set_size(m.size_gib.map(|g| g as i32))
            .set_volume_type(m.volume_type.as_deref().map(VolumeType::from))
            .set_iops(m.iops.map(|i| i as i32))
            .set_throughput(m.throughput.map(|t| t as i32))
            .send(),
    )
    .await?;
    let target = resp
        .volume_modification()
        .and_then(|v| v.target_size())
        .or(m.size_gib.map(|g| g as i32))
        .unwrap_or(0) as u64;
    let mut delay = poll;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let mods = call(
            "DescribeVolumesModifications",
            ec2.describe_volumes_modifications().volume_ids(id).send(),
        )
        .await?;
        match mods
            .volumes_modifications()
            .first()
            .and_then(|v| v.modification_state())
        {
            Some(VolumeModificationState::Optimizing)
            | Some(VolumeModificationState::Completed)
            | None => return Ok(target),
            Some(VolumeModificationState::Failed) => {
                let why = mods
                    .volumes_modifications()
                    .first()
                    .and_then(|v| v.status_message())
                    .unwrap_or("no reason given");
                return Err(Error::Internal(format!("EBS failed to modify {id}: {why}")));
            }
            Some(_) => {}
        }
        if Instant::now() > deadline {
            return Err(Error::Unavailable(format!(
                "the modification of {id} is still in progress; retry"
            )));
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 3 / 2).min(Duration::from_secs(15));
    }
}

fn mutable_modification(
    mutable: &BTreeMap<String, String>,
    size_gib: u64,
) -> Result<(Modification, BTreeMap<String, String>)> {
    let mut m = Modification::default();
    let mut tags = BTreeMap::new();
    let mut vp = params::VolumeParams::default();
    for (k, v) in mutable {
        match k.as_str() {
            "type" => {
                m.volume_type = Some(params::limits(&v.to_ascii_lowercase())?.name.to_string())
            }
            "iops" => {
                m.iops =
                    Some(v.trim().parse().map_err(|_| {
                        Error::InvalidArgument(format!("iops={v:?} must be a number"))
                    })?)
            }
            "throughput" => {
                m.throughput = Some(v.trim().parse().map_err(|_| {
                    Error::InvalidArgument(format!("throughput={v:?} must be a number"))
                })?)
            }
            k if k.starts_with("tagSpecification_") => {
                let (tk, tv) = v.split_once('=').ok_or_else(|| {
                    Error::InvalidArgument(format!("{k}={v:?} must have the form key=value"))
                })?;
                tags.insert(tk.trim().to_string(), tv.trim().to_string());
            }
            k => {
                return Err(Error::InvalidArgument(format!(
                    "mutable parameter {k:?} is not supported; use {} or tagSpecification_N",
                    params::MUTABLE_KEYS.join(", ")
                )));
            }
        }
    }
    if let Some(t) = &m.volume_type {
        vp.volume_type = t.clone();
        vp.iops = m.iops;
        vp.throughput = m.throughput;
        if m.iops.is_some() {
            params::iops(&vp, size_gib)?;
        }
        params::throughput(&vp)?;
    }
    Ok((m, tags))
}

impl ControllerBackend for AwsBackend {
    fn capabilities(&self) -> BackendCapabilities {
        BackendCapabilities {
            snapshots: true,
            clone: false,
            expand: true,
            list_volumes: true,
            get_capacity: false,
            attach: true,
            multi_node: false,
            modify: true,
            coalesces_modifications: true,
            node_local: false,
        }
    }

    fn create_lock_key(&self, name: &str) -> String {
        format!("name-{}", &client_token(name)[..32])
    }

    fn snapshot_lock_key(&self, name: &str) -> String {
        format!("snapname-{}", &client_token(name)[..32])
    }

    fn is_volume_id(&self, id: &str) -> bool {
        is_volume_id(id)
    }

    fn is_snapshot_id(&self, id: &str) -> bool {
        is_snapshot_id(id)
    }

    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        params::parse(parameters).map(drop)
    }

    fn validate_mutable_parameters(&self, mutable: &BTreeMap<String, String>) -> Result<()> {
        mutable_modification(mutable, 1 << 20).map(drop)
    }

    async fn create_volume(&self, req: CreateVolume) -> Result<Volume> {
        let mut p = params::parse(&req.parameters)?;
        let (m, mtags) = mutable_modification(&req.mutable_parameters, 1 << 20)?;
        if let Some(t) = m.volume_type {
            p.volume_type = t;
        }
        p.iops = m.iops.or(p.iops);
        p.throughput = m.throughput.or(p.throughput);
        p.tags.extend(mtags);
        let limits = params::limits(&p.volume_type)?;
        let mut gib = params::size_gib(req.required_bytes, req.limit_bytes, limits)?;
        let snapshot = match &req.content_source {
            None => None,
            Some(ContentSource::Volume(_)) => {
                return Err(Error::Unsupported(
                    "cloning EBS volumes is not supported: take a snapshot and restore it".into(),
                ));
            }
            Some(ContentSource::Snapshot(id)) => {
                if !is_snapshot_id(id) {
                    return Err(Error::NotFound(format!("snapshot {id} does not exist")));
                }
                let snaps = call(
                    "DescribeSnapshots",
                    self.inner
                        .ec2
                        .describe_snapshots()
                        .filters(filter("snapshot-id", vec![id.clone()]))
                        .send(),
                )
                .await?;
                let snap = snaps
                    .snapshots()
                    .first()
                    .ok_or_else(|| Error::NotFound(format!("snapshot {id} does not exist")))?;
                let snap_gib = snap.volume_size().unwrap_or(0) as u64;
                if gib < snap_gib {
                    if req.limit_bytes > 0 && snap_gib * GIB > req.limit_bytes {
                        return Err(Error::OutOfRange(format!(
                            "snapshot {id} holds {snap_gib} GiB, more than limit_bytes {}",
                            req.limit_bytes
                        )));
                    }
                    gib = snap_gib;
                }
                Some(id.clone())
            }
        };
        let iops = params::iops(&p, gib)?;
        let throughput = params::throughput(&p)?;
        let zone = self.pick_zone(&req)?;
        if let Some(v) = self.find_by_name(&req.name).await? {
            return self.existing(v, &req, &p).await;
        }
        let mut extra = p.tags.clone();
        for (meta, key) in [
            (
                "csi.storage.k8s.io/pvc/name",
                "kubernetes.io/created-for/pvc/name",
            ),
            (
                "csi.storage.k8s.io/pvc/namespace",
                "kubernetes.io/created-for/pvc/namespace",
            ),
            (
                "csi.storage.k8s.io/pv/name",
                "kubernetes.io/created-for/pv/name",
            ),
        ] {
            if let Some(v) = req.parameters.get(meta) {
                extra.insert(key.to_string(), v.clone());
            }
        }
        let tags = self.tag_specs(ResourceType::Volume, VOLUME_NAME_TAG, &req.name, &extra);
        // Which ClientToken to send: bumped when EC2 says the current one is burnt (used
        // earlier with other parameters, or answering with a volume that no longer exists).
        let mut generation = 0;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let created = call(
                "CreateVolume",
                self.inner
                    .ec2
                    .create_volume()
                    .availability_zone(&zone)
                    .size(gib as i32)
                    .volume_type(VolumeType::from(p.volume_type.as_str()))
                    .set_iops(iops.map(|i| i as i32))
                    .set_throughput(throughput.map(|t| t as i32))
                    .encrypted(p.encrypted)
                    .set_kms_key_id(p.kms_key_id.clone())
                    .set_snapshot_id(snapshot.clone())
                    .client_token(client_token_generation(&req.name, generation))
                    .tag_specifications(tags.clone())
                    .customize()
                    .config_override(without_sdk_retries())
                    .send(),
            )
            .await;
            let failure = match created {
                Ok(out) => {
                    let id = out.volume_id().unwrap_or_default().to_string();
                    match self.wait_state(&id, VolumeState::Available).await {
                        Ok(v) => {
                            tracing::info!(volume_id = %id, name = %req.name, gib, zone = %zone, attempt, "created EBS volume");
                            return Ok(self.to_volume(&v));
                        }
                        Err(Error::NotFound(m)) => Error::AlreadyExists(m),
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => e,
            };
            // The call may have created the volume before failing (a dropped answer, a
            // timeout): look before anything else, so that neither the retry below nor the
            // CO's retry makes a second one.
            if let Some(v) = self.find_by_name(&req.name).await? {
                return self.existing(v, &req, &p).await;
            }
            match failure {
                // IdempotentParameterMismatch, or a token that named a deleted volume: nothing
                // of this name exists (looked up just now), so the token is someone else's
                // history. A fresh one is safe.
                Error::AlreadyExists(m) if generation < 2 => {
                    tracing::warn!(name = %req.name, generation, "ClientToken burnt ({m}); retrying with a new one");
                    generation += 1;
                }
                e @ Error::Unavailable(_) if attempt < CREATE_ATTEMPTS => {
                    let pause = create_backoff(attempt);
                    tracing::warn!(name = %req.name, attempt, ?pause, "CreateVolume failed: {e}; retrying");
                    tokio::time::sleep(pause).await;
                }
                e => return Err(e),
            }
        }
    }

    async fn delete_volume(&self, id: &str) -> Result<()> {
        match call(
            "DeleteVolume",
            self.inner.ec2.delete_volume().volume_id(id).send(),
        )
        .await
        {
            Ok(_) | Err(Error::NotFound(_)) => Ok(()),
            Err(Error::FailedPrecondition(m)) => Err(Error::FailedPrecondition(format!(
                "volume {id} is still attached: {m}"
            ))),
            Err(e) => Err(e),
        }
    }

    async fn get_volume(&self, id: &str) -> Result<Volume> {
        let v = self
            .inner
            .volumes
            .get(id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
        Ok(self.to_volume(&v))
    }

    async fn list_volumes(
        &self,
        start_after: Option<&str>,
        max_entries: usize,
    ) -> Result<Page<Volume>> {
        let mut all = Vec::new();
        let mut next = None;
        loop {
            let resp = call(
                "DescribeVolumes",
                self.inner
                    .ec2
                    .describe_volumes()
                    .filters(self.cluster_filter())
                    .max_results(500)
                    .set_next_token(next)
                    .send(),
            )
            .await?;
            all.extend(resp.volumes().iter().map(|v| self.to_volume(v)));
            next = resp.next_token().map(str::to_string);
            if next.is_none() {
                break;
            }
        }
        Ok(page(all, |v| &v.id, start_after, max_entries))
    }

    async fn expand_volume(&self, id: &str, new_size: u64) -> Result<u64> {
        let v = self
            .inner
            .volumes
            .get(id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
        let current = v.size().unwrap_or(0) as u64;
        let want = new_size.div_ceil(GIB);
        if want <= current {
            return Ok(current * GIB);
        }
        let l = params::limits(v.volume_type().map(|t| t.as_str()).unwrap_or("gp3"))?;
        if want > l.max_gib {
            return Err(Error::OutOfRange(format!(
                "{} volumes hold at most {} GiB",
                l.name, l.max_gib
            )));
        }
        let gib = self
            .inner
            .coalescer
            .modify(
                id,
                Modification {
                    size_gib: Some(want),
                    ..Default::default()
                },
            )
            .await?;
        Ok(gib.max(want) * GIB)
    }

    async fn modify_volume(&self, id: &str, mutable: &BTreeMap<String, String>) -> Result<()> {
        let v = self
            .inner
            .volumes
            .get(id)
            .await?
            .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
        let (m, tags) = mutable_modification(mutable, v.size().unwrap_or(0) as u64)?;
        if !tags.is_empty() {
            let mut b = self.inner.ec2.create_tags().resources(id);
            for (k, val) in &tags {
                b = b.tags(tag(k, val));
            }
            call("CreateTags", b.send()).await?;
        }
        if m != Modification::default() {
            self.inner.coalescer.modify(id, m).await?;
        }
        Ok(())
    }

    async fn capacity(&self, _topology: Option<&Topology>) -> Result<Capacity> {
        Err(Error::Unsupported(
            "EBS capacity is not reported (GET_CAPACITY is not advertised)".into(),
        ))
    }

    async fn create_snapshot(
        &self,
        name: &str,
        source_volume_id: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<Snapshot> {
        let mut extra = BTreeMap::new();
        for (k, v) in parameters {
            if let Some(_n) = k.strip_prefix("tagSpecification_") {
                let (tk, tv) = v.split_once('=').ok_or_else(|| {
                    Error::InvalidArgument(format!("{k}={v:?} must have the form key=value"))
                })?;
                extra.insert(
                    tk.trim().to_string(),
                    params::template(tv.trim(), parameters)?,
                );
            } else if !k.starts_with(crate::local::RESERVED_PARAMETER_PREFIX) {
                return Err(Error::InvalidArgument(format!(
                    "unknown snapshot parameter {k:?}; the aws backend accepts tagSpecification_N"
                )));
            }
        }
        if let Some(s) = self.snapshot_by_name(name).await? {
            if s.volume_id() != Some(source_volume_id) {
                return Err(Error::AlreadyExists(format!(
                    "snapshot {name:?} already exists for volume {:?}",
                    s.volume_id()
                )));
            }
            return Ok(to_snapshot(&s));
        }
        if !is_volume_id(source_volume_id)
            || self.inner.volumes.get(source_volume_id).await?.is_none()
        {
            return Err(Error::NotFound(format!(
                "source volume {source_volume_id} does not exist"
            )));
        }
        let tags = self.tag_specs(ResourceType::Snapshot, SNAPSHOT_NAME_TAG, name, &extra);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let created = call(
                "CreateSnapshot",
                self.inner
                    .ec2
                    .create_snapshot()
                    .volume_id(source_volume_id)
                    .description(format!("Created by ferrovol for {name}"))
                    .tag_specifications(tags.clone())
                    .customize()
                    .config_override(without_sdk_retries())
                    .send(),
            )
            .await;
            let e = match created {
                Ok(out) => {
                    return Ok(Snapshot {
                        id: out.snapshot_id().unwrap_or_default().to_string(),
                        name: name.to_string(),
                        source_volume_id: source_volume_id.to_string(),
                        size_bytes: out.volume_size().unwrap_or(0) as u64 * GIB,
                        created_at: out
                            .start_time()
                            .map(|t| (t.secs(), t.subsec_nanos() as i32))
                            .unwrap_or((0, 0)),
                        ready: out.state() == Some(&SnapshotState::Completed),
                    });
                }
                Err(e) => e,
            };
            // CreateSnapshot has no ClientToken: the name tag is the only way to tell whether
            // a call whose answer was lost took effect.
            if let Some(s) = self.snapshot_by_name(name).await? {
                return Ok(to_snapshot(&s));
            }
            match e {
                Error::Unavailable(_) if attempt < CREATE_ATTEMPTS => {
                    let pause = create_backoff(attempt);
                    tracing::warn!(%name, attempt, ?pause, "CreateSnapshot failed: {e}; retrying");
                    tokio::time::sleep(pause).await;
                }
                e => return Err(e),
            }
        }
    }

    async fn delete_snapshot(&self, id: &str) -> Result<()> {
        match call(
            "DeleteSnapshot",
            self.inner.ec2.delete_snapshot().snapshot_id(id).send(),
        )
        .await
        {
            Ok(_) | Err(Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn list_snapshots(
        &self,
        f: SnapshotFilter,
        start_after: Option<&str>,
        max_entries: usize,
    ) -> Result<Page<Snapshot>> {
        if f.snapshot_id.as_deref().is_some_and(|s| !is_snapshot_id(s))
            || f.source_volume_id
                .as_deref()
                .is_some_and(|v| !is_volume_id(v))
        {
            return Ok(Page {
                entries: vec![],
                next: None,
            });
        }
        let mut req = self
            .inner
            .ec2
            .describe_snapshots()
            .filters(self.cluster_filter());
        if let Some(s) = &f.snapshot_id {
            req = req.filters(filter("snapshot-id", vec![s.clone()]));
        }
        if let Some(v) = &f.source_volume_id {
            req = req.filters(filter("volume-id", vec![v.clone()]));
        }
        let resp = call("DescribeSnapshots", req.send()).await?;
        Ok(page(
            resp.snapshots().iter().map(to_snapshot).collect(),
            |s| &s.id,
            start_after,
            max_entries,
        ))
    }

    async fn publish(
        &self,
        volume_id: &str,
        node_id: &str,
        _read_only: bool,
    ) -> Result<BTreeMap<String, String>> {
        if !is_instance_id(node_id) {
            return Err(Error::NotFound(format!(
                "node {node_id:?} is not an EC2 instance id"
            )));
        }
        let (instance, volume) = tokio::join!(
            self.inner.instances.get(node_id),
            self.inner.volumes.get(volume_id)
        );
        let instance = instance?
            .ok_or_else(|| Error::NotFound(format!("instance {node_id} does not exist")))?;
        let volume =
            volume?.ok_or_else(|| Error::NotFound(format!("volume {volume_id} does not exist")))?;
        let zone = instance.placement().and_then(|p| p.availability_zone());
        if zone.is_some() && volume.availability_zone() != zone {
            return Err(Error::FailedPrecondition(format!(
                "volume {volume_id} is in {:?} but instance {node_id} is in {zone:?}; EBS volumes attach within their zone",
                volume.availability_zone()
            )));
        }
        let context = |device: &str| {
            BTreeMap::from([
                ("devicePath".to_string(), device.to_string()),
                ("volumeId".to_string(), volume_id.to_string()),
            ])
        };
        for a in volume.attachments() {
            let live = matches!(
                a.state(),
                Some(VolumeAttachmentState::Attached) | Some(VolumeAttachmentState::Attaching)
            );
            if live
                && a.instance_id() != Some(node_id)
                && !volume.multi_attach_enabled().unwrap_or(false)
            {
                return Err(Error::FailedPrecondition(format!(
                    "volume {volume_id} is attached to {:?}; it must be detached there first",
                    a.instance_id()
                )));
            }
        }
        for attempt in 0..4 {
            let already = volume.attachments().iter().find(|a| {
                a.instance_id() == Some(node_id)
                    && a.state() != Some(&VolumeAttachmentState::Detached)
            });
            let device = match (attempt, already) {
                (0, Some(a)) => a.device().unwrap_or_default().to_string(),
                _ => {
                    let device = self.reserve_device(&instance, volume_id)?;
                    let res = call(
                        "AttachVolume",
                        self.inner
                            .ec2
                            .attach_volume()
                            .volume_id(volume_id)
                            .instance_id(node_id)
                            .device(&device)
                            .send(),
                    )
                    .await;
                    match res {
                        Ok(_) => {}
                        Err(Error::InvalidArgument(m))
                            if m.contains("already in use") || m.contains("is in use") =>
                        {
                            // Taken behind our back: keep it reserved (so it is not offered
                            // again) under a placeholder, and try the next name.
                            let mut r = self
                                .inner
                                .reserved
                                .lock()
                                .unwrap_or_else(|e| e.into_inner());
                            r.entry(node_id.to_string())
                                .or_default()
                                .insert(device.clone(), format!("(in use) {m}"));
                            continue;
                        }
                        Err(e) => {
                            self.release_device(node_id, volume_id);
                            return Err(e);
                        }
                    }
                    device
                }
            };
            match self.wait_attached(volume_id, node_id).await? {
                Some(dev) => return Ok(context(&dev)),
                None if attempt < 3 => {
                    tracing::warn!(%volume_id, %node_id, "attachment stuck in attaching; detaching and retrying");
                    self.detach(volume_id, node_id, Some(&device)).await?;
                }
                None => break,
            }
        }
        Err(Error::Unavailable(format!(
            "volume {volume_id} did not attach to {node_id}; retry"
        )))
    }

    async fn unpublish(&self, volume_id: &str, node_id: Option<&str>) -> Result<()> {
        let Some(v) = self.inner.volumes.get(volume_id).await? else {
            return Ok(());
        };
        for a in v.attachments() {
            let Some(inst) = a.instance_id() else {
                continue;
            };
            if node_id.is_some_and(|n| n != inst)
                || a.state() == Some(&VolumeAttachmentState::Detached)
            {
                continue;
            }
            self.detach(volume_id, inst, a.device()).await?;
        }
        if let Some(n) = node_id {
            self.release_device(n, volume_id);
        }
        Ok(())
    }
}
