use crate::format::{self, FormatIntent, Intents};
use crate::mounter::Mounter;
use crate::paths::{Confined, Kind, KubeletDir};
use crate::probe::{self, Content};
use cloud_backend::sys::ioctl;
use cloud_backend::sys::lock::{LockGuard, Locks};
use cloud_backend::sys::mountinfo::{self, MountEntry};
use cloud_backend::{AttachedDevice, Error, NodeBackend, Result};
use csi_identity::status::{invalid, to_status};
use csi_identity::task::run_to_completion;
use csi_identity::validate::{self, Access, Capability};
use csi_proto::v1::node_server::Node;
use csi_proto::v1::*;
use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use tonic::{Request, Response, Status};

#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub node_id: String,
    /// 0: no limit reported.
    pub max_volumes_per_node: i64,
    pub topology: BTreeMap<String, String>,
    pub multi_node: bool,
}

pub struct NodeService<B, M> {
    inner: Arc<Inner<B, M>>,
}

struct Inner<B, M> {
    backend: B,
    mounter: M,
    kubelet: KubeletDir,
    locks: Locks,
    intents: Intents,
    cfg: NodeConfig,
}

impl<B: NodeBackend, M: Mounter> NodeService<B, M> {
    pub fn new(
        backend: B,
        mounter: M,
        kubelet: KubeletDir,
        locks: Locks,
        intents: Intents,
        cfg: NodeConfig,
    ) -> Self {
        NodeService {
            inner: Arc::new(Inner {
                backend,
                mounter,
                kubelet,
                locks,
                intents,
                cfg,
            }),
        }
    }

    fn lock(&self, volume_id: &str) -> std::result::Result<LockGuard, Status> {
        self.inner.locks.try_lock(volume_id).map_err(to_status)
    }

    /// Runs `work` on a blocking thread inside a task that outlives the caller, holding `guard`.
    async fn run<T, F>(&self, guard: LockGuard, work: F) -> std::result::Result<T, Status>
    where
        T: Send + 'static,
        F: FnOnce(&Inner<B, M>, &tokio::runtime::Handle) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        let handle = tokio::runtime::Handle::current();
        run_to_completion(async move {
            let res = tokio::task::spawn_blocking(move || {
                let _guard = guard;
                work(&inner, &handle)
            })
            .await;
            match res {
                Ok(r) => r.map_err(to_status),
                Err(e) => Err(Status::internal(format!("node operation failed: {e}"))),
            }
        })
        .await
    }
}

fn to_btree(m: &HashMap<String, String>) -> BTreeMap<String, String> {
    m.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
}

/// Does this mount entry show `device` mounted (filesystem) or bound (device node)?
fn shows_device(m: &MountEntry, dev: &Path, major: u32, minor: u32) -> bool {
    if m.major == major && m.minor == minor {
        return true;
    }
    // A device node bind-mounted onto a file appears as devtmpfs with root /<name>.
    m.fs_type == "devtmpfs"
        && dev
            .file_name()
            .is_some_and(|n| m.root == Path::new("/").join(n))
}

fn dev_numbers(dev: &Path) -> Result<(u32, u32)> {
    let md = std::fs::metadata(dev).map_err(|e| Error::io(format!("stat {}", dev.display()), e))?;
    Ok((libc::major(md.rdev()), libc::minor(md.rdev())))
}

/// What every step of one node RPC needs to know about the call it serves.
#[derive(Clone, Copy)]
struct Call<'a> {
    rt: &'a tokio::runtime::Handle,
    volume_id: &'a str,
    publish_context: &'a BTreeMap<String, String>,
}

impl<B: NodeBackend, M: Mounter> Inner<B, M> {
    fn attach(
        &self,
        rt: &tokio::runtime::Handle,
        volume_id: &str,
        publish_context: &BTreeMap<String, String>,
    ) -> Result<AttachedDevice> {
        rt.block_on(self.backend.attach(volume_id, publish_context))
    }

    /// Unmounts every layer at `target`.
    fn unmount_all(&self, target: &Confined) -> Result<()> {
        for _ in 0..8 {
            let mounts = self.mounter.mounts()?;
            if mountinfo::find_by_mount_point(&mounts, &target.path).is_none() {
                return Ok(());
            }
            self.mounter.unmount(target)?;
        }
        Err(Error::Internal(format!(
            "{} is still mounted after 8 unmounts",
            target.path.display()
        )))
    }

    /// NodeStage for a filesystem volume, and the re-stage that NodePublish performs after a
    /// reboot (`allow_format` false there: a publish never formats).
    fn stage_mount(
        &self,
        call: &Call<'_>,
        staging: &Confined,
        fs_type: &str,
        flags: &[String],
        allow_format: bool,
    ) -> Result<()> {
        let Call {
            rt,
            volume_id,
            publish_context,
        } = *call;
        let device = self.attach(rt, volume_id, publish_context)?;
        let (major, minor) = dev_numbers(&device.path)?;
        let mounts = self.mounter.mounts()?;
        if let Some(m) = mountinfo::find_by_mount_point(&mounts, &staging.path) {
            if m.major == major && m.minor == minor {
                return Ok(()); // already staged: idempotent success
            }
            return Err(Error::AlreadyExists(format!(
                "{} already holds another device ({}); refusing to stage {volume_id} over it",
                staging.path.display(),
                m.source
            )));
        }
        if let Some(other) = mounts
            .iter()
            .find(|m| shows_device(m, &device.path, major, minor))
        {
            return Err(Error::FailedPrecondition(format!(
                "{} (volume {volume_id}) is already mounted at {}; refusing to mount it twice",
                device.path.display(),
                other.mount_point.display()
            )));
        }
        match staging.kind()? {
            Kind::Missing => staging.create_dir()?,
            Kind::Directory => {}
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "{} exists and is not a directory",
                    staging.path.display()
                )));
            }
        }
        let fresh = self.ensure_filesystem(volume_id, &device, fs_type, allow_format)?;
        // A volume restored or cloned into a larger size, or expanded while unstaged, carries a
        // filesystem smaller than its device: grow it here. ext4 grows best before the mount
        // (offline resize needs no CAP_SYS_RESOURCE); xfs can only grow while mounted.
        let grow = !fresh && format::needs_growth(&device.path, fs_type, device.size_bytes)?;
        if grow && fs_type != "xfs" {
            format::grow_offline(fs_type, &device.path)?;
        }
        self.mounter
            .mount_fs(&device.path, staging, fs_type, flags)?;
        if grow && fs_type == "xfs" {
            format::grow(fs_type, &device.path, &staging.path)?;
        }
        Ok(())
    }

    /// Makes sure `device` carries a `fs_type` filesystem; returns whether it was just created.
    /// Never formats a device carrying anything, except to finish this plugin's own interrupted
    /// format of this very device incarnation.
    fn ensure_filesystem(
        &self,
        volume_id: &str,
        device: &AttachedDevice,
        fs_type: &str,
        allow_format: bool,
    ) -> Result<bool> {
        let intent = self.intents.get(volume_id)?;
        let ours = intent
            .as_ref()
            .is_some_and(|i| i.identity == device.identity && i.fs_type == fs_type);
        if intent.is_some() && !ours {
            // An intent for an earlier incarnation (volume deleted and re-created) proves nothing.
            self.intents.clear(volume_id)?;
        }
        let content = probe::probe(&device.path)?;
        let force = match (&content, ours) {
            (Content::Filesystem(t), false) if t == fs_type => return Ok(false),
            (Content::Filesystem(t), false) => {
                return Err(Error::FailedPrecondition(format!(
                    "volume {volume_id} already carries a {t} filesystem but {fs_type} was requested; refusing to format a device that holds data"
                )));
            }
            (Content::Other(what), false) => {
                return Err(Error::FailedPrecondition(format!(
                    "volume {volume_id} carries {what}; refusing to format a device that holds data"
                )));
            }
            (Content::Blank, _) => false,
            (_, true) => {
                tracing::warn!(%volume_id, ?content, "finishing a format this plugin started and did not complete");
                true
            }
        };
        if !allow_format {
            return Err(Error::FailedPrecondition(format!(
                "volume {volume_id} has no filesystem yet; NodeStageVolume must run before NodePublishVolume"
            )));
        }
        self.intents.record(&FormatIntent {
            volume_id: volume_id.to_string(),
            identity: device.identity.clone(),
            fs_type: fs_type.to_string(),
        })?;
        format::mkfs(&device.path, fs_type, force)?;
        self.intents.clear(volume_id)?;
        tracing::info!(%volume_id, device = %device.path.display(), fs_type, "created filesystem");
        Ok(true)
    }

    fn stage_block(
        &self,
        rt: &tokio::runtime::Handle,
        volume_id: &str,
        staging: &Confined,
        publish_context: &BTreeMap<String, String>,
    ) -> Result<()> {
        self.attach(rt, volume_id, publish_context)?;
        if staging.kind()? == Kind::Missing {
            staging.create_dir()?;
        }
        Ok(())
    }

    fn unstage(
        &self,
        rt: &tokio::runtime::Handle,
        volume_id: &str,
        staging: &Confined,
    ) -> Result<()> {
        self.unmount_all(staging)?;
        if let Some(device) = rt.block_on(self.backend.find(volume_id))? {
            let (major, minor) = dev_numbers(&device.path)?;
            let mounts = self.mounter.mounts()?;
            if let Some(m) = mounts
                .iter()
                .find(|m| shows_device(m, &device.path, major, minor))
            {
                return Err(Error::FailedPrecondition(format!(
                    "volume {volume_id} is still in use at {}; unpublish it before unstaging",
                    m.mount_point.display()
                )));
            }
        }
        rt.block_on(self.backend.detach(volume_id))
    }

    fn publish(
        &self,
        call: &Call<'_>,
        cap: &Capability,
        staging: &Confined,
        target: &Confined,
        read_only: bool,
    ) -> Result<()> {
        let Call {
            rt,
            volume_id,
            publish_context,
        } = *call;
        let read_only = read_only || cap.read_only_mode();
        match &cap.access {
            Access::Mount {
                fs_type,
                mount_flags,
            } => {
                let mounts = self.mounter.mounts()?;
                let staged = mountinfo::find_by_mount_point(&mounts, &staging.path).cloned();
                let staged = match staged {
                    Some(s) => s,
                    None => {
                        // After a reboot kubelet may publish before it re-stages: re-attach and
                        // re-mount (never format) so the workload gets its data back.
                        self.stage_mount(call, staging, fs_type, mount_flags, false)?;
                        let mounts = self.mounter.mounts()?;
                        mountinfo::find_by_mount_point(&mounts, &staging.path)
                            .cloned()
                            .ok_or_else(|| {
                                Error::Internal(format!(
                                    "{} vanished right after staging",
                                    staging.path.display()
                                ))
                            })?
                    }
                };
                let device = rt.block_on(self.backend.find(volume_id))?.ok_or_else(|| {
                    Error::FailedPrecondition(format!(
                        "volume {volume_id} is not attached to this node; stage it first"
                    ))
                })?;
                let (major, minor) = dev_numbers(&device.path)?;
                if (staged.major, staged.minor) != (major, minor) {
                    return Err(Error::FailedPrecondition(format!(
                        "{} holds {}, not volume {volume_id}",
                        staging.path.display(),
                        staged.source
                    )));
                }
                if let Some(existing) =
                    mountinfo::find_by_mount_point(&mounts_now(self)?, &target.path)
                {
                    return compatible(
                        existing,
                        (major, minor),
                        &device.path,
                        read_only,
                        &target.path,
                    );
                }
                match target.kind()? {
                    Kind::Missing => target.create_dir()?,
                    Kind::Directory => {}
                    _ => {
                        return Err(Error::FailedPrecondition(format!(
                            "{} exists and is not a directory",
                            target.path.display()
                        )));
                    }
                }
                self.mounter.bind(&staging.path, target, read_only)
            }
            Access::Block => {
                let device = match rt.block_on(self.backend.find(volume_id))? {
                    Some(d) => d,
                    None => self.attach(rt, volume_id, publish_context)?,
                };
                let (major, minor) = dev_numbers(&device.path)?;
                if let Some(existing) =
                    mountinfo::find_by_mount_point(&mounts_now(self)?, &target.path)
                {
                    return compatible(
                        existing,
                        (major, minor),
                        &device.path,
                        read_only,
                        &target.path,
                    );
                }
                match target.kind()? {
                    Kind::Missing => target.create_file()?,
                    Kind::File => {}
                    _ => {
                        return Err(Error::FailedPrecondition(format!(
                            "{} exists and is not a file; raw block targets are files",
                            target.path.display()
                        )));
                    }
                }
                // The read-only flag of a device is shared by every user of it, so read-only and
                // read-write raw publishes of one volume cannot coexist on a node.
                let others = self
                    .mounter
                    .mounts()?
                    .into_iter()
                    .filter(|m| shows_device(m, &device.path, major, minor))
                    .count();
                let device_ro = ioctl::block_device_read_only(&device.path).map_err(|e| {
                    Error::io(
                        format!("reading the read-only flag of {}", device.path.display()),
                        e,
                    )
                })?;
                if others > 0 && device_ro != read_only {
                    return Err(Error::FailedPrecondition(format!(
                        "volume {volume_id} is already published {} on this node; a raw block volume cannot be read-only and read-write at once",
                        if device_ro { "read-only" } else { "read-write" }
                    )));
                }
                if device_ro != read_only {
                    ioctl::set_block_device_read_only(&device.path, read_only).map_err(|e| {
                        Error::io(
                            format!("setting the read-only flag of {}", device.path.display()),
                            e,
                        )
                    })?;
                }
                self.mounter.bind(&device.path, target, read_only)
            }
        }
    }

    fn unpublish(
        &self,
        rt: &tokio::runtime::Handle,
        volume_id: &str,
        target: &Confined,
    ) -> Result<()> {
        let was_block = mountinfo::find_by_mount_point(&self.mounter.mounts()?, &target.path)
            .is_some_and(|m| m.fs_type == "devtmpfs");
        self.unmount_all(target)?;
        if was_block {
            // The last raw publish gone: give the device its writability back for the next user.
            if let Some(device) = rt.block_on(self.backend.find(volume_id))? {
                let (major, minor) = dev_numbers(&device.path)?;
                let still_used = self
                    .mounter
                    .mounts()?
                    .iter()
                    .any(|m| shows_device(m, &device.path, major, minor));
                if !still_used && ioctl::block_device_read_only(&device.path).unwrap_or(false) {
                    ioctl::set_block_device_read_only(&device.path, false).map_err(|e| {
                        Error::io(
                            format!("clearing the read-only flag of {}", device.path.display()),
                            e,
                        )
                    })?;
                }
            }
        }
        if !target.remove_if_empty()? {
            tracing::warn!(target = %target.path.display(), "target holds data this plugin did not put there; leaving it in place");
        }
        Ok(())
    }

    /// The mount at `path` if it shows this volume's device.
    fn volume_mount(
        &self,
        rt: &tokio::runtime::Handle,
        volume_id: &str,
        path: &Path,
    ) -> Result<(MountEntry, AttachedDevice)> {
        let mounts = self.mounter.mounts()?;
        let mount = mountinfo::find_by_mount_point(&mounts, path)
            .cloned()
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "volume {volume_id} is not mounted at {}",
                    path.display()
                ))
            })?;
        let device = rt.block_on(self.backend.find(volume_id))?.ok_or_else(|| {
            Error::NotFound(format!("volume {volume_id} is not attached to this node"))
        })?;
        let (major, minor) = dev_numbers(&device.path)?;
        if !shows_device(&mount, &device.path, major, minor) {
            return Err(Error::NotFound(format!(
                "{} does not hold volume {volume_id}",
                path.display()
            )));
        }
        Ok((mount, device))
    }

    fn expand(&self, rt: &tokio::runtime::Handle, volume_id: &str, path: &Path) -> Result<u64> {
        let (mount, device) = self.volume_mount(rt, volume_id, path)?;
        let size = rt.block_on(self.backend.refresh_capacity(volume_id))?;
        if mount.fs_type != "devtmpfs" {
            format::grow(&mount.fs_type, &device.path, &mount.mount_point)?;
        }
        Ok(size)
    }
}

fn mounts_now<B: NodeBackend, M: Mounter>(inner: &Inner<B, M>) -> Result<Vec<MountEntry>> {
    inner.mounter.mounts()
}

/// A target already mounted: the same volume with the same read-only-ness is success; anything
/// else is ALREADY_EXISTS (the spec's "published with incompatible capability").
fn compatible(
    existing: &MountEntry,
    dev: (u32, u32),
    device: &Path,
    read_only: bool,
    target: &Path,
) -> Result<()> {
    if !shows_device(existing, device, dev.0, dev.1) {
        return Err(Error::AlreadyExists(format!(
            "{} already holds another volume ({})",
            target.display(),
            existing.source
        )));
    }
    if existing.is_read_only() != read_only {
        return Err(Error::AlreadyExists(format!(
            "{} is already published {}; unpublish it before publishing it {}",
            target.display(),
            if existing.is_read_only() {
                "read-only"
            } else {
                "read-write"
            },
            if read_only { "read-only" } else { "read-write" }
        )));
    }
    Ok(())
}

fn statvfs(path: &Path) -> Result<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| Error::InvalidArgument("path contains NUL".into()))?;
    // SAFETY: statvfs writes into a zeroed struct we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(Error::io(
            format!("statvfs {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(st)
}

impl<B: NodeBackend, M: Mounter> NodeService<B, M> {
    fn volume_id(&self, id: &str) -> std::result::Result<(), Status> {
        validate::require("volume_id", id)
    }

    fn confine(&self, field: &str, path: &str) -> std::result::Result<Confined, Status> {
        self.inner.kubelet.confine(field, path).map_err(to_status)
    }
}

#[tonic::async_trait]
impl<B: NodeBackend, M: Mounter> Node for NodeService<B, M> {
    /// MUST make the volume available at the staging path: attach its device, create the
    /// filesystem only if the device is blank, mount it with the requested flags. Repeating
    /// the call MUST succeed; a staging path holding something else is ALREADY_EXISTS.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, staging = %request.get_ref().staging_target_path))]
    async fn node_stage_volume(
        &self,
        request: Request<NodeStageVolumeRequest>,
    ) -> std::result::Result<Response<NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.volume_id(&req.volume_id)?;
        validate::require("staging_target_path", &req.staging_target_path)?;
        let cap = validate::capability(
            req.volume_capability
                .as_ref()
                .ok_or_else(|| invalid("volume_capability is required"))?,
            self.inner.cfg.multi_node,
        )?;
        let staging = self.confine("staging_target_path", &req.staging_target_path)?;
        if !self.inner.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let publish_context = to_btree(&req.publish_context);
        let guard = self.lock(&req.volume_id)?;
        let id = req.volume_id.clone();
        self.run(guard, move |inner, rt| match &cap.access {
            Access::Mount {
                fs_type,
                mount_flags,
            } => {
                let call = Call {
                    rt,
                    volume_id: &id,
                    publish_context: &publish_context,
                };
                inner.stage_mount(&call, &staging, fs_type, mount_flags, true)
            }
            Access::Block => inner.stage_block(rt, &id, &staging, &publish_context),
        })
        .await?;
        Ok(Response::new(NodeStageVolumeResponse {}))
    }

    /// MUST undo NodeStageVolume: unmount the staging path and release the device. A volume
    /// that is not staged (or no longer exists) is success.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, staging = %request.get_ref().staging_target_path))]
    async fn node_unstage_volume(
        &self,
        request: Request<NodeUnstageVolumeRequest>,
    ) -> std::result::Result<Response<NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        self.volume_id(&req.volume_id)?;
        validate::require("staging_target_path", &req.staging_target_path)?;
        let staging = self.confine("staging_target_path", &req.staging_target_path)?;
        if !self.inner.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let guard = self.lock(&req.volume_id)?;
        let id = req.volume_id.clone();
        self.run(guard, move |inner, rt| inner.unstage(rt, &id, &staging))
            .await?;
        Ok(Response::new(NodeUnstageVolumeResponse {}))
    }

    /// MUST make the staged volume available at the target path: a bind mount of the staging
    /// directory, or of the device node onto a file for raw block; read-only when asked.
    /// Repeating the call MUST succeed; an incompatible existing publish is ALREADY_EXISTS.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, target = %request.get_ref().target_path))]
    async fn node_publish_volume(
        &self,
        request: Request<NodePublishVolumeRequest>,
    ) -> std::result::Result<Response<NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.volume_id(&req.volume_id)?;
        validate::require("target_path", &req.target_path)?;
        let cap = validate::capability(
            req.volume_capability
                .as_ref()
                .ok_or_else(|| invalid("volume_capability is required"))?,
            self.inner.cfg.multi_node,
        )?;
        validate::require("staging_target_path", &req.staging_target_path)?;
        let staging = self.confine("staging_target_path", &req.staging_target_path)?;
        let target = self.confine("target_path", &req.target_path)?;
        if staging.path == target.path {
            return Err(invalid("target_path must differ from staging_target_path"));
        }
        if !self.inner.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let publish_context = to_btree(&req.publish_context);
        let guard = self.lock(&req.volume_id)?;
        let id = req.volume_id.clone();
        let read_only = req.readonly;
        self.run(guard, move |inner, rt| {
            let call = Call {
                rt,
                volume_id: &id,
                publish_context: &publish_context,
            };
            inner.publish(&call, &cap, &staging, &target, read_only)
        })
        .await?;
        Ok(Response::new(NodePublishVolumeResponse {}))
    }

    /// MUST undo NodePublishVolume: unmount the target and delete what the plugin created
    /// there. A target already gone is success; a target holding data the plugin did not put
    /// there is left intact.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, target = %request.get_ref().target_path))]
    async fn node_unpublish_volume(
        &self,
        request: Request<NodeUnpublishVolumeRequest>,
    ) -> std::result::Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        self.volume_id(&req.volume_id)?;
        validate::require("target_path", &req.target_path)?;
        let target = self.confine("target_path", &req.target_path)?;
        if !self.inner.backend.is_volume_id(&req.volume_id) {
            return Err(to_status(Error::NotFound(format!(
                "volume {} does not exist",
                req.volume_id
            ))));
        }
        let guard = self.lock(&req.volume_id)?;
        let id = req.volume_id.clone();
        self.run(guard, move |inner, rt| inner.unpublish(rt, &id, &target))
            .await?;
        Ok(Response::new(NodeUnpublishVolumeResponse {}))
    }

    /// MUST report usage of the volume at volume_path (bytes, and inodes for filesystems);
    /// an unknown volume or path is NOT_FOUND. Reports an abnormal condition when the mount has
    /// vanished.
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, path = %request.get_ref().volume_path))]
    async fn node_get_volume_stats(
        &self,
        request: Request<NodeGetVolumeStatsRequest>,
    ) -> std::result::Result<Response<NodeGetVolumeStatsResponse>, Status> {
        let req = request.into_inner();
        self.volume_id(&req.volume_id)?;
        validate::require("volume_path", &req.volume_path)?;
        if !self.inner.backend.is_volume_id(&req.volume_id)
            || !self.inner.kubelet.is_inside(&req.volume_path)
        {
            return Err(to_status(Error::NotFound(format!(
                "no volume {} at {}",
                req.volume_id, req.volume_path
            ))));
        }
        let path = self.confine("volume_path", &req.volume_path)?;
        let inner = self.inner.clone();
        let id = req.volume_id.clone();
        let rt = tokio::runtime::Handle::current();
        let resp = tokio::task::spawn_blocking(move || -> Result<NodeGetVolumeStatsResponse> {
            if path.kind()? == Kind::Missing {
                return Err(Error::NotFound(format!(
                    "{} does not exist",
                    path.path.display()
                )));
            }
            let (mount, device) = match inner.volume_mount(&rt, &id, &path.path) {
                Ok(m) => m,
                Err(Error::NotFound(why)) => {
                    return Ok(NodeGetVolumeStatsResponse {
                        usage: vec![],
                        volume_condition: Some(VolumeCondition {
                            abnormal: true,
                            message: why,
                        }),
                    });
                }
                Err(e) => return Err(e),
            };
            let usage = if mount.fs_type == "devtmpfs" {
                vec![VolumeUsage {
                    total: device.size_bytes as i64,
                    unit: volume_usage::Unit::Bytes as i32,
                    ..Default::default()
                }]
            } else {
                let st = statvfs(&path.path)?;
                let bs = st.f_frsize as i64;
                vec![
                    VolumeUsage {
                        available: st.f_bavail as i64 * bs,
                        total: st.f_blocks as i64 * bs,
                        used: (st.f_blocks - st.f_bfree) as i64 * bs,
                        unit: volume_usage::Unit::Bytes as i32,
                    },
                    VolumeUsage {
                        available: st.f_favail as i64,
                        total: st.f_files as i64,
                        used: (st.f_files - st.f_ffree) as i64,
                        unit: volume_usage::Unit::Inodes as i32,
                    },
                ]
            };
            Ok(NodeGetVolumeStatsResponse {
                usage,
                volume_condition: Some(VolumeCondition {
                    abnormal: false,
                    message: "volume is mounted and healthy".into(),
                }),
            })
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(to_status)?;
        Ok(Response::new(resp))
    }

    /// MUST grow what the node sees of the volume to its new size: refresh the device's
    /// capacity, then the filesystem (volume_path may be the staging or the target path).
    #[tracing::instrument(skip_all, fields(volume_id = %request.get_ref().volume_id, path = %request.get_ref().volume_path))]
    async fn node_expand_volume(
        &self,
        request: Request<NodeExpandVolumeRequest>,
    ) -> std::result::Result<Response<NodeExpandVolumeResponse>, Status> {
        let req = request.into_inner();
        self.volume_id(&req.volume_id)?;
        validate::require("volume_path", &req.volume_path)?;
        if let Some(cap) = &req.volume_capability {
            validate::capability(cap, self.inner.cfg.multi_node)?;
        }
        if !self.inner.backend.is_volume_id(&req.volume_id)
            || !self.inner.kubelet.is_inside(&req.volume_path)
        {
            return Err(to_status(Error::NotFound(format!(
                "no volume {} at {}",
                req.volume_id, req.volume_path
            ))));
        }
        let path = self.confine("volume_path", &req.volume_path)?;
        let guard = self.lock(&req.volume_id)?;
        let id = req.volume_id.clone();
        let size = self
            .run(guard, move |inner, rt| inner.expand(rt, &id, &path.path))
            .await?;
        Ok(Response::new(NodeExpandVolumeResponse {
            capacity_bytes: size as i64,
        }))
    }

    #[tracing::instrument(skip_all)]
    async fn node_get_capabilities(
        &self,
        _request: Request<NodeGetCapabilitiesRequest>,
    ) -> std::result::Result<Response<NodeGetCapabilitiesResponse>, Status> {
        use node_service_capability::rpc::Type;
        // VOLUME_MOUNT_GROUP is deliberately absent: ext4 and xfs have no gid mount option, and
        // advertising it would make kubelet skip its own fsGroup handling.
        let types = [
            Type::StageUnstageVolume,
            Type::GetVolumeStats,
            Type::ExpandVolume,
            Type::VolumeCondition,
            Type::SingleNodeMultiWriter,
        ];
        Ok(Response::new(NodeGetCapabilitiesResponse {
            capabilities: types
                .into_iter()
                .map(|t| NodeServiceCapability {
                    r#type: Some(node_service_capability::Type::Rpc(
                        node_service_capability::Rpc { r#type: t as i32 },
                    )),
                })
                .collect(),
        }))
    }

    /// MUST identify this node the way the controller's topology and attach calls expect.
    #[tracing::instrument(skip_all)]
    async fn node_get_info(
        &self,
        _request: Request<NodeGetInfoRequest>,
    ) -> std::result::Result<Response<NodeGetInfoResponse>, Status> {
        let cfg = &self.inner.cfg;
        Ok(Response::new(NodeGetInfoResponse {
            node_id: cfg.node_id.clone(),
            max_volumes_per_node: cfg.max_volumes_per_node,
            accessible_topology: Some(Topology {
                segments: cfg
                    .topology
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            }),
        }))
    }
}
