//! The node side of the aws backend: find the attached EBS volume's block device, and prove it
//! is that volume before anyone formats or mounts it.
//!
//! On Nitro instances EBS volumes are NVMe namespaces whose controller serial is the volume id
//! without its dash (`vol0123…`); udev links them as
//! `/dev/disk/by-id/nvme-Amazon_Elastic_Block_Store_vol0123…`. Links can be stale, so the
//! device the link points at must carry the serial too. The device name from the publish
//! context is only a fallback, checked the same way. The directories are configurable so tests
//! can stand in for the hypervisor. This side never calls EC2.

use super::is_volume_id;
use crate::error::{Error, IoContext, Result};
use crate::sys::loopdev;
use crate::{AttachedDevice, NodeBackend};
use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct AwsNodeConfig {
    /// Where udev keeps the by-id links (`/dev/disk/by-id`).
    pub by_id_dir: PathBuf,
    /// The sysfs root (`/sys`).
    pub sys_root: PathBuf,
    /// How long NodeStage waits for an attached device to appear.
    pub device_wait: Duration,
}

impl Default for AwsNodeConfig {
    fn default() -> Self {
        AwsNodeConfig {
            by_id_dir: "/dev/disk/by-id".into(),
            sys_root: "/sys".into(),
            device_wait: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone)]
pub struct AwsNode {
    cfg: AwsNodeConfig,
}

/// EBS attachment slots of an instance type, before subtracting the root volume and network
/// interfaces. Nitro types share 28 slots between EBS volumes, ENIs and instance stores;
/// Xen types allow 39 volumes.
pub fn instance_limits(instance_type: &str) -> i64 {
    const XEN: &[&str] = &[
        "t2.", "m4.", "c4.", "r4.", "x1.", "x1e.", "d2.", "i3.", "p2.", "p3.", "g3.", "h1.", "m3.",
        "c3.", "r3.",
    ];
    if XEN.iter().any(|p| instance_type.starts_with(p)) {
        39
    } else {
        28
    }
}

impl AwsNode {
    pub fn new(cfg: AwsNodeConfig) -> Self {
        AwsNode { cfg }
    }

    /// The serial the device at `dev` reports, from sysfs.
    fn serial(&self, dev: &Path) -> Option<String> {
        let name = dev.file_name()?.to_string_lossy().into_owned();
        for p in [
            self.cfg
                .sys_root
                .join("block")
                .join(&name)
                .join("device/serial"),
            self.cfg
                .sys_root
                .join("class/block")
                .join(&name)
                .join("device/serial"),
        ] {
            if let Ok(s) = std::fs::read_to_string(&p) {
                return Some(s.trim().to_string());
            }
        }
        None
    }

    /// `candidate` resolved to a block device whose serial names `volume_id`, else `None`.
    fn verified(&self, candidate: &Path, volume_id: &str) -> Result<Option<PathBuf>> {
        let dev = match std::fs::canonicalize(candidate) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io(format!("resolving {}", candidate.display()), e)),
        };
        let md = std::fs::metadata(&dev).context(|| format!("stat {}", dev.display()))?;
        if !md.file_type().is_block_device() {
            return Ok(None);
        }
        let want = volume_id.replace('-', "");
        match self.serial(&dev) {
            Some(s) if s == want || s == volume_id => Ok(Some(dev)),
            Some(other) => {
                tracing::warn!(%volume_id, device = %dev.display(), serial = %other, "device serial names another volume; ignoring it");
                Ok(None)
            }
            None => {
                tracing::warn!(%volume_id, device = %dev.display(), "device has no serial to tie it to the volume; ignoring it");
                Ok(None)
            }
        }
    }

    fn find_now(
        &self,
        volume_id: &str,
        publish_context: &BTreeMap<String, String>,
    ) -> Result<Option<AttachedDevice>> {
        if !is_volume_id(volume_id) {
            return Ok(None);
        }
        let link = self.cfg.by_id_dir.join(format!(
            "nvme-Amazon_Elastic_Block_Store_{}",
            volume_id.replace('-', "")
        ));
        let mut found = self.verified(&link, volume_id)?;
        if found.is_none()
            && let Some(path) = publish_context.get("devicePath")
        {
            found = self.verified(Path::new(path), volume_id)?;
        }
        let Some(path) = found else { return Ok(None) };
        let size_bytes = loopdev::device_size(&path)?;
        Ok(Some(AttachedDevice {
            path,
            identity: volume_id.to_string(),
            size_bytes,
        }))
    }
}

impl NodeBackend for AwsNode {
    fn is_volume_id(&self, id: &str) -> bool {
        is_volume_id(id)
    }

    async fn attach(
        &self,
        volume_id: &str,
        publish_context: &BTreeMap<String, String>,
    ) -> Result<AttachedDevice> {
        // The controller attached it; wait for the device to show up on this node.
        let deadline = Instant::now() + self.cfg.device_wait;
        loop {
            if let Some(d) = self.find_now(volume_id, publish_context)? {
                return Ok(d);
            }
            if Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "no block device on this node can be tied to {volume_id} (no {}/nvme-Amazon_Elastic_Block_Store_{} link with a matching serial, \
                     and the publish context's devicePath did not match either); is it attached to this instance?",
                    self.cfg.by_id_dir.display(),
                    volume_id.replace('-', "")
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn find(&self, volume_id: &str) -> Result<Option<AttachedDevice>> {
        self.find_now(volume_id, &BTreeMap::new())
    }

    async fn detach(&self, _volume_id: &str) -> Result<()> {
        // Detaching is the controller's job (ControllerUnpublishVolume); nothing to release here.
        Ok(())
    }

    async fn refresh_capacity(&self, volume_id: &str) -> Result<u64> {
        let d = self.find_now(volume_id, &BTreeMap::new())?.ok_or_else(|| {
            Error::FailedPrecondition(format!("volume {volume_id} is not attached to this node"))
        })?;
        let rdev = std::fs::metadata(&d.path)
            .context(|| format!("stat {}", d.path.display()))?
            .rdev();
        // NVMe namespaces pick up a resize by themselves; a loop device (the test hypervisor's
        // stand-in) has to be told.
        if libc::major(rdev) == 7 {
            return loopdev::refresh_capacity(&d.path);
        }
        loopdev::device_size(&d.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attachment_limits_by_generation() {
        assert_eq!(instance_limits("m5.large"), 28);
        assert_eq!(instance_limits("t2.micro"), 39);
    }

    #[tokio::test]
    async fn a_link_to_a_device_with_another_serial_is_not_trusted() {
        let dir = tempfile::tempdir().unwrap();
        let by_id = dir.path().join("by-id");
        let sys = dir.path().join("sys");
        std::fs::create_dir_all(&by_id).unwrap();
        // /dev/null is a char device, not a block device: never accepted.
        std::os::unix::fs::symlink(
            "/dev/null",
            by_id.join("nvme-Amazon_Elastic_Block_Store_vol0123456789abcdef0"),
        )
        .unwrap();
        let node = AwsNode::new(AwsNodeConfig {
            by_id_dir: by_id,
            sys_root: sys,
            device_wait: Duration::from_millis(50),
        });
        assert!(node.find("vol-0123456789abcdef0").await.unwrap().is_none());
        let err = node
            .attach("vol-0123456789abcdef0", &BTreeMap::new())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unavailable(_)), "{err}");
    }
}

/// What the node needs to know about its instance.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceMetadata {
    pub instance_id: String,
    pub zone: String,
    pub instance_type: String,
    /// Network interfaces attached (they share Nitro attachment slots with volumes).
    pub interfaces: usize,
}

/// Reads the instance's identity from IMDSv2 (token-protected; a hop limit of 1 on the
/// instance makes this fail from a pod network namespace — then pass the values by flag).
pub async fn instance_metadata() -> Result<InstanceMetadata> {
    let client = aws_config::imds::Client::builder()
        .max_attempts(2)
        .connect_timeout(Duration::from_secs(1))
        .read_timeout(Duration::from_secs(2))
        .build();
    let get = |path: &'static str| {
        let client = client.clone();
        async move {
            client
                .get(path)
                .await
                .map(|s| s.as_ref().trim().to_string())
                .map_err(|e| Error::Unavailable(format!("instance metadata {path}: {e}")))
        }
    };
    let interfaces = get("/latest/meta-data/network/interfaces/macs/")
        .await
        .map(|s| s.lines().count())
        .unwrap_or(1);
    Ok(InstanceMetadata {
        instance_id: get("/latest/meta-data/instance-id").await?,
        zone: get("/latest/meta-data/placement/availability-zone").await?,
        instance_type: get("/latest/meta-data/instance-type").await?,
        interfaces,
    })
}
