use super::*;
use crate::sys::{atomic, copy, loopdev, mountinfo};
use crate::{
    BackendCapabilities, Capacity, ControllerBackend, CreateVolume, Page, Snapshot, SnapshotFilter,
    Topology, Volume, ids,
};
use std::os::unix::fs::MetadataExt;

/// Runs blocking filesystem work off the async runtime.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}

impl VolumeMeta {
    fn to_volume(&self, backend: &LocalBackend, abnormal: Option<String>) -> Volume {
        Volume {
            id: self.id.clone(),
            name: self.name.clone(),
            capacity_bytes: self.capacity_bytes,
            parameters: self.parameters.clone(),
            content_source: self.content_source.clone(),
            accessible_topology: vec![backend.topology()],
            context: BTreeMap::new(),
            published_nodes: Vec::new(),
            abnormal,
        }
    }
}

impl SnapshotMeta {
    fn to_snapshot(&self) -> Snapshot {
        Snapshot {
            id: self.id.clone(),
            name: self.name.clone(),
            source_volume_id: self.source_volume_id.clone(),
            size_bytes: self.size_bytes,
            created_at: self.created_at,
            ready: true,
        }
    }
}

impl LocalBackend {
    fn create_volume_sync(&self, req: CreateVolume) -> Result<Volume> {
        let id = ids::derive(ids::VOLUME_PREFIX, &req.name);
        if let Some(existing) = self.read_volume(&id)? {
            return self.compare_existing(existing, &req);
        }
        if !req.accessibility.is_empty() && !req.accessibility.iter().any(|t| self.matches(t)) {
            return Err(Error::ResourceExhausted(format!(
                "this node ({}) is not in the requested topology {:?}; local volumes live on the node that creates them",
                self.cfg.node_id, req.accessibility
            )));
        }
        let size = choose_size(req.required_bytes, req.limit_bytes, req.fs_type.as_deref())?;
        let dir = self.volume_dir(&id);
        // Whatever is here has no meta.json: the remains of an interrupted create. Redo it.
        atomic::remove_dir_all(&dir)?;
        let available = self.available_bytes()?;
        if size > available {
            return Err(Error::ResourceExhausted(format!(
                "not enough space on node {}: {size} bytes requested, {available} available (free space minus what existing volumes may still grow into)",
                self.cfg.node_id
            )));
        }
        ensure_dir(&dir)?;
        // Any failure from here on removes what this call created: a refused create leaves no
        // trace (a crash instead leaves an uncommitted directory, which the next call redoes).
        let result = self.populate_volume(&id, &dir, size, &req);
        if result.is_err() {
            let _ = atomic::remove_dir_all(&dir);
        }
        result
    }

    fn populate_volume(
        &self,
        id: &str,
        dir: &Path,
        size: u64,
        req: &CreateVolume,
    ) -> Result<Volume> {
        let tmp = dir.join("disk.img.tmp");
        match &req.content_source {
            None => {
                let f = std::fs::File::create(&tmp)
                    .context(|| format!("creating {}", tmp.display()))?;
                f.set_len(size)
                    .context(|| format!("sizing {}", tmp.display()))?;
                f.sync_all()
                    .context(|| format!("syncing {}", tmp.display()))?;
            }
            Some(ContentSource::Snapshot(snap)) => {
                let meta = self.valid_snapshot(snap)?.ok_or_else(|| {
                    Error::NotFound(format!("source snapshot {snap} does not exist"))
                })?;
                if meta.size_bytes > size {
                    return Err(Error::OutOfRange(format!(
                        "snapshot {snap} holds {} bytes; the new volume ({size} bytes) must be at least that large",
                        meta.size_bytes
                    )));
                }
                copy::copy_image(&self.snapshot_dir(snap).join("data.img"), &tmp)?;
            }
            Some(ContentSource::Volume(src)) => {
                let meta = self.valid_volume(src)?.ok_or_else(|| {
                    Error::NotFound(format!("source volume {src} does not exist"))
                })?;
                if meta.capacity_bytes > size {
                    return Err(Error::OutOfRange(format!(
                        "source volume {src} holds {} bytes; the clone ({size} bytes) must be at least that large",
                        meta.capacity_bytes
                    )));
                }
                let _source_lock = self.locks.try_lock(src)?;
                self.consistent_copy(src, &tmp)?;
            }
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&tmp)
            .context(|| format!("opening {}", tmp.display()))?;
        if file
            .metadata()
            .context(|| format!("stat {}", tmp.display()))?
            .len()
            < size
        {
            file.set_len(size)
                .context(|| format!("growing {}", tmp.display()))?;
        }
        file.sync_all()
            .context(|| format!("syncing {}", tmp.display()))?;
        std::fs::rename(&tmp, self.image(id)).context(|| format!("renaming {}", tmp.display()))?;
        let meta = VolumeMeta {
            id: id.to_string(),
            name: req.name.clone(),
            uid: random_uid(),
            capacity_bytes: size,
            parameters: req.parameters.clone(),
            content_source: req.content_source.clone(),
            access: None,
            fs_type: req.fs_type.clone(),
            node_id: self.cfg.node_id.clone(),
            created_at: now(),
        };
        atomic::write_json(&dir.join("meta.json"), &meta)?;
        tracing::info!(volume_id = %id, size, "created volume");
        Ok(meta.to_volume(self, None))
    }

    fn compare_existing(&self, existing: VolumeMeta, req: &CreateVolume) -> Result<Volume> {
        if existing.name != req.name {
            return Err(Error::Internal(format!(
                "volume id {} derived from name {:?} belongs to {:?}",
                existing.id, req.name, existing.name
            )));
        }
        let cap = existing.capacity_bytes;
        let fits = cap >= req.required_bytes && (req.limit_bytes == 0 || cap <= req.limit_bytes);
        if !fits {
            return Err(Error::AlreadyExists(format!(
                "volume {:?} already exists with {cap} bytes, outside the requested range (required {}, limit {})",
                req.name, req.required_bytes, req.limit_bytes
            )));
        }
        if existing.parameters != req.parameters {
            return Err(Error::AlreadyExists(format!(
                "volume {:?} already exists with different parameters",
                req.name
            )));
        }
        if existing.content_source != req.content_source {
            return Err(Error::AlreadyExists(format!(
                "volume {:?} already exists with a different content source ({:?})",
                req.name, existing.content_source
            )));
        }
        Ok(existing.to_volume(self, None))
    }

    fn matches(&self, topology: &Topology) -> bool {
        topology
            .iter()
            .all(|(k, v)| *k == self.cfg.topology_key && *v == self.cfg.node_id)
    }

    fn valid_volume(&self, id: &str) -> Result<Option<VolumeMeta>> {
        if !ids::is_valid(ids::VOLUME_PREFIX, id) {
            return Ok(None);
        }
        self.read_volume(id)
    }

    fn valid_snapshot(&self, id: &str) -> Result<Option<SnapshotMeta>> {
        if !ids::is_valid(ids::SNAPSHOT_PREFIX, id) {
            return Ok(None);
        }
        self.read_snapshot(id)
    }

    /// Copies volume `src`'s image to `dst` without tearing it. The caller holds `src`'s lock,
    /// so the node cannot attach it meanwhile.
    ///
    /// - Not attached to a loop device: nobody can write it; a plain copy is consistent.
    /// - Attached: a reflink is an atomic point-in-time copy (crash-consistent, like a cloud
    ///   snapshot). Without reflinks, freeze the filesystem on it around a sparse copy.
    /// - Attached but not mounted here (raw block, or a mount we cannot see): refuse.
    fn consistent_copy(&self, src: &str, dst: &Path) -> Result<copy::CopyMethod> {
        let image = self.image(src);
        let attached = loopdev::find(loopdev::BackingId::of(&image)?)?;
        let Some(device) = attached.first() else {
            return copy::copy_image(&image, dst);
        };
        if copy::try_reflink(&image, dst)? {
            return Ok(copy::CopyMethod::Reflink);
        }
        let mounts = mountinfo::read()?;
        let Some(mount) = mountinfo::find_by_device(&mounts, device.major, device.minor)
            .into_iter()
            .next()
            .cloned()
        else {
            return Err(Error::FailedPrecondition(format!(
                "volume {src} is in use as a raw block device ({}) and the state directory's filesystem cannot reflink; \
                 a copy now could be torn. Stop the workload, or keep the state directory on xfs or btrfs",
                device.path.display()
            )));
        };
        let marker = self.cfg.state_dir.join("frozen").join(src);
        let freeze = copy::Freeze::new(&mount.mount_point, marker)?;
        tracing::info!(volume_id = %src, mount_point = %mount.mount_point.display(), "froze filesystem for a consistent copy");
        let result = copy::sparse_copy(&image, dst);
        drop(freeze);
        result.map(|()| copy::CopyMethod::Sparse)
    }

    /// Free space on the state directory's filesystem minus what sparse files may still grow
    /// into: the bytes already promised to existing volumes and snapshots.
    fn available_bytes(&self) -> Result<u64> {
        let free = statvfs_free(&self.cfg.state_dir)?;
        let mut promised: u64 = 0;
        for (kind, file) in [("volumes", "disk.img"), ("snapshots", "data.img")] {
            let dir = self.cfg.state_dir.join(kind);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                if let Ok(md) = std::fs::metadata(entry.path().join(file)) {
                    promised += md.len().saturating_sub(md.blocks() * 512);
                }
            }
        }
        Ok(free.saturating_sub(promised))
    }

    fn list_ids(&self, kind: &str, prefix: &str) -> Result<Vec<String>> {
        let dir = self.cfg.state_dir.join(kind);
        let mut out: Vec<String> = std::fs::read_dir(&dir)
            .context(|| format!("listing {}", dir.display()))?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|id| ids::is_valid(prefix, id))
            .filter(|id| dir.join(id).join("meta.json").exists())
            .collect();
        out.sort();
        Ok(out)
    }

    fn create_snapshot_sync(
        &self,
        name: String,
        source: String,
        parameters: BTreeMap<String, String>,
    ) -> Result<Snapshot> {
        validate_parameters(&parameters, &[])?;
        let id = ids::derive(ids::SNAPSHOT_PREFIX, &name);
        if let Some(existing) = self.read_snapshot(&id)? {
            if existing.source_volume_id != source {
                return Err(Error::AlreadyExists(format!(
                    "snapshot {name:?} already exists for source volume {}",
                    existing.source_volume_id
                )));
            }
            return Ok(existing.to_snapshot());
        }
        let volume = self
            .valid_volume(&source)?
            .ok_or_else(|| Error::NotFound(format!("source volume {source} does not exist")))?;
        let available = self.available_bytes()?;
        if volume.capacity_bytes > available {
            return Err(Error::ResourceExhausted(format!(
                "not enough space for a snapshot of {source}: {} bytes needed, {available} available",
                volume.capacity_bytes
            )));
        }
        let dir = self.snapshot_dir(&id);
        atomic::remove_dir_all(&dir)?;
        ensure_dir(&dir)?;
        let tmp = dir.join("data.img.tmp");
        let _source_lock = self.locks.try_lock(&source)?;
        let method = self.consistent_copy(&source, &tmp)?;
        std::fs::rename(&tmp, dir.join("data.img"))
            .context(|| format!("renaming {}", tmp.display()))?;
        let meta = SnapshotMeta {
            id: id.clone(),
            name,
            source_volume_id: source.clone(),
            size_bytes: volume.capacity_bytes,
            created_at: now(),
        };
        atomic::write_json(&dir.join("meta.json"), &meta)?;
        tracing::info!(snapshot_id = %id, volume_id = %source, ?method, "created snapshot");
        Ok(meta.to_snapshot())
    }

    fn expand_sync(&self, id: &str, new_size: u64) -> Result<u64> {
        let mut meta = self
            .valid_volume(id)?
            .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
        let image = self.image(id);
        if new_size <= meta.capacity_bytes {
            return Ok(meta.capacity_bytes);
        }
        let size = round_up(new_size, MIB)
            .ok_or_else(|| Error::OutOfRange(format!("{new_size} bytes is too large")))?;
        let growth = size - meta.capacity_bytes;
        let available = self.available_bytes()?;
        if growth > available {
            return Err(Error::ResourceExhausted(format!(
                "not enough space to grow {id} by {growth} bytes: {available} available"
            )));
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&image)
            .context(|| format!("opening {}", image.display()))?;
        // Growing the file first and recording it second: a crash in between leaves a file
        // larger than its record, which the retried expand repairs.
        if file
            .metadata()
            .context(|| format!("stat {}", image.display()))?
            .len()
            < size
        {
            file.set_len(size)
                .context(|| format!("growing {}", image.display()))?;
        }
        file.sync_all()
            .context(|| format!("syncing {}", image.display()))?;
        meta.capacity_bytes = size;
        atomic::write_json(&self.volume_dir(id).join("meta.json"), &meta)?;
        Ok(size)
    }

    fn delete_volume_sync(&self, id: &str) -> Result<()> {
        if !ids::is_valid(ids::VOLUME_PREFIX, id) {
            return Ok(());
        }
        let dir = self.volume_dir(id);
        if !dir.exists() {
            return Ok(());
        }
        let image = self.image(id);
        if let Ok(backing) = loopdev::BackingId::of(&image)
            && let Some(dev) = loopdev::find(backing)?.first()
        {
            return Err(Error::FailedPrecondition(format!(
                "volume {id} is staged on this node ({}); unstage it before deleting",
                dev.path.display()
            )));
        }
        // Uncommit first: a crash after this leaves a directory without meta.json, which
        // listings ignore and the next delete or start-up removes.
        atomic::remove_file(&dir.join("meta.json"))?;
        atomic::sync_dir(&dir.join("meta.json"))?;
        atomic::remove_dir_all(&dir)?;
        tracing::info!(volume_id = %id, "deleted volume");
        Ok(())
    }

    fn delete_snapshot_sync(&self, id: &str) -> Result<()> {
        if !ids::is_valid(ids::SNAPSHOT_PREFIX, id) {
            return Ok(());
        }
        let dir = self.snapshot_dir(id);
        atomic::remove_file(&dir.join("meta.json"))?;
        atomic::remove_dir_all(&dir)?;
        Ok(())
    }

    fn volume_health(&self, meta: &VolumeMeta) -> Option<String> {
        match std::fs::metadata(self.image(&meta.id)) {
            Ok(md) if md.len() >= meta.capacity_bytes => None,
            Ok(md) => Some(format!(
                "image holds {} bytes, {} recorded",
                md.len(),
                meta.capacity_bytes
            )),
            Err(e) => Some(format!("image unreadable: {e}")),
        }
    }
}

fn random_uid() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

fn statvfs_free(path: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument(format!("{} contains a NUL byte", path.display())))?;
    // SAFETY: statvfs writes into a zeroed struct we own; the path is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::io(
            format!("statvfs {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

fn page<T, F: Fn(&T) -> &str>(
    items: Vec<T>,
    start_after: Option<&str>,
    max: usize,
    id: F,
) -> Page<T> {
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

impl ControllerBackend for LocalBackend {
    fn capabilities(&self) -> BackendCapabilities {
        BackendCapabilities {
            snapshots: true,
            clone: true,
            expand: true,
            list_volumes: true,
            get_capacity: true,
            attach: false,
            multi_node: false,
            modify: false,
            coalesces_modifications: false,
            node_local: true,
        }
    }

    fn create_lock_key(&self, name: &str) -> String {
        ids::derive(ids::VOLUME_PREFIX, name)
    }

    fn snapshot_lock_key(&self, name: &str) -> String {
        ids::derive(ids::SNAPSHOT_PREFIX, name)
    }

    fn is_volume_id(&self, id: &str) -> bool {
        ids::is_valid(ids::VOLUME_PREFIX, id)
    }

    fn is_snapshot_id(&self, id: &str) -> bool {
        ids::is_valid(ids::SNAPSHOT_PREFIX, id)
    }

    fn validate_parameters(&self, parameters: &BTreeMap<String, String>) -> Result<()> {
        validate_parameters(parameters, &[])
    }

    async fn create_volume(&self, req: CreateVolume) -> Result<Volume> {
        let this = self.clone();
        blocking(move || this.create_volume_sync(req)).await
    }

    async fn delete_volume(&self, id: &str) -> Result<()> {
        let (this, id) = (self.clone(), id.to_string());
        blocking(move || this.delete_volume_sync(&id)).await
    }

    async fn get_volume(&self, id: &str) -> Result<Volume> {
        let (this, id) = (self.clone(), id.to_string());
        blocking(move || {
            let meta = this
                .valid_volume(&id)?
                .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist")))?;
            let health = this.volume_health(&meta);
            Ok(meta.to_volume(&this, health))
        })
        .await
    }

    async fn list_volumes(
        &self,
        start_after: Option<&str>,
        max_entries: usize,
    ) -> Result<Page<Volume>> {
        let (this, start) = (self.clone(), start_after.map(str::to_string));
        blocking(move || {
            let mut vols = Vec::new();
            for id in this.list_ids("volumes", ids::VOLUME_PREFIX)? {
                // A volume deleted between listing and reading is simply not listed.
                if let Some(meta) = this.read_volume(&id)? {
                    let health = this.volume_health(&meta);
                    vols.push(meta.to_volume(&this, health));
                }
            }
            Ok(page(vols, start.as_deref(), max_entries, |v| &v.id))
        })
        .await
    }

    async fn expand_volume(&self, id: &str, new_size: u64) -> Result<u64> {
        let (this, id) = (self.clone(), id.to_string());
        blocking(move || this.expand_sync(&id, new_size)).await
    }

    async fn capacity(&self, topology: Option<&Topology>) -> Result<Capacity> {
        if topology.is_some_and(|t| !self.matches(t)) {
            return Ok(Capacity {
                available_bytes: 0,
                maximum_volume_bytes: 0,
                minimum_volume_bytes: MIN_VOLUME_BYTES,
            });
        }
        let this = self.clone();
        blocking(move || {
            let available = this.available_bytes()? / MIB * MIB;
            Ok(Capacity {
                available_bytes: available,
                maximum_volume_bytes: available,
                minimum_volume_bytes: MIN_VOLUME_BYTES,
            })
        })
        .await
    }

    async fn create_snapshot(
        &self,
        name: &str,
        source_volume_id: &str,
        parameters: &BTreeMap<String, String>,
    ) -> Result<Snapshot> {
        let (this, name, source, params) = (
            self.clone(),
            name.to_string(),
            source_volume_id.to_string(),
            parameters.clone(),
        );
        blocking(move || this.create_snapshot_sync(name, source, params)).await
    }

    async fn delete_snapshot(&self, id: &str) -> Result<()> {
        let (this, id) = (self.clone(), id.to_string());
        blocking(move || this.delete_snapshot_sync(&id)).await
    }

    async fn list_snapshots(
        &self,
        filter: SnapshotFilter,
        start_after: Option<&str>,
        max_entries: usize,
    ) -> Result<Page<Snapshot>> {
        let (this, start) = (self.clone(), start_after.map(str::to_string));
        blocking(move || {
            let candidates = match &filter.snapshot_id {
                Some(id) if !ids::is_valid(ids::SNAPSHOT_PREFIX, id) => Vec::new(),
                Some(id) => vec![id.clone()],
                None => this.list_ids("snapshots", ids::SNAPSHOT_PREFIX)?,
            };
            let mut snaps = Vec::new();
            for id in candidates {
                if let Some(meta) = this.read_snapshot(&id)?
                    && filter
                        .source_volume_id
                        .as_ref()
                        .is_none_or(|v| *v == meta.source_volume_id)
                {
                    snaps.push(meta.to_snapshot());
                }
            }
            Ok(page(snaps, start.as_deref(), max_entries, |s| &s.id))
        })
        .await
    }

    async fn publish(
        &self,
        _volume_id: &str,
        _node_id: &str,
        _read_only: bool,
    ) -> Result<BTreeMap<String, String>> {
        Err(Error::Unsupported(
            "the local backend has no attach step: volumes are files on the node that created them"
                .into(),
        ))
    }

    async fn unpublish(&self, _volume_id: &str, _node_id: Option<&str>) -> Result<()> {
        Err(Error::Unsupported(
            "the local backend has no attach step".into(),
        ))
    }
}
