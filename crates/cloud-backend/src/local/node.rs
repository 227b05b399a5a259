//! The node side of the local backend: volume image ↔ loop device.

use super::*;
use crate::sys::{atomic, loopdev};
use crate::{AttachedDevice, NodeBackend, ids};

/// What the node attached for a volume, so that unstage can release it even after the
/// volume's image is gone. The loop device is re-checked against `backing` before any use:
/// device numbers are reused.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct AttachRecord {
    device: PathBuf,
    backing_dev: u64,
    backing_ino: u64,
}

impl LocalBackend {
    fn record_path(&self, id: &str) -> PathBuf {
        self.cfg
            .state_dir
            .join("node/attached")
            .join(format!("{id}.json"))
    }

    fn attach_sync(&self, id: &str) -> Result<AttachedDevice> {
        let meta = self
            .read_volume(id)?
            .ok_or_else(|| Error::NotFound(format!("volume {id} does not exist on this node")))?;
        let image = self.image(id);
        let backing = loopdev::BackingId::of(&image)?;
        let device = match loopdev::find(backing)?.as_slice() {
            [one] => one.clone(),
            [] => {
                let dev = loopdev::attach(&image, false)?;
                tracing::info!(volume_id = %id, device = %dev.path.display(), "attached loop device");
                dev
            }
            many => {
                return Err(Error::Internal(format!(
                    "volume {id} is attached to {} loop devices ({}); refusing to guess which one holds its data",
                    many.len(),
                    many.iter()
                        .map(|d| d.path.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        };
        atomic::write_json(
            &self.record_path(id),
            &AttachRecord {
                device: device.path.clone(),
                backing_dev: backing.dev,
                backing_ino: backing.ino,
            },
        )?;
        let size_bytes = loopdev::device_size(&device.path)?;
        Ok(AttachedDevice {
            path: device.path,
            identity: meta.uid,
            size_bytes,
        })
    }

    fn find_sync(&self, id: &str) -> Result<Option<AttachedDevice>> {
        let Some(meta) = self.read_volume(id)? else {
            return Ok(None);
        };
        let Ok(backing) = loopdev::BackingId::of(&self.image(id)) else {
            return Ok(None);
        };
        let Some(device) = loopdev::find(backing)?.into_iter().next() else {
            return Ok(None);
        };
        let size_bytes = loopdev::device_size(&device.path)?;
        Ok(Some(AttachedDevice {
            path: device.path,
            identity: meta.uid,
            size_bytes,
        }))
    }

    fn detach_sync(&self, id: &str) -> Result<()> {
        let record_path = self.record_path(id);
        let mut targets: Vec<(PathBuf, loopdev::BackingId)> = Vec::new();
        if let Some(rec) = atomic::read_json::<AttachRecord>(&record_path)? {
            targets.push((
                rec.device,
                loopdev::BackingId {
                    dev: rec.backing_dev,
                    ino: rec.backing_ino,
                },
            ));
        }
        // Without a record (crash between attach and record), find it from the kernel's side.
        if let Ok(backing) = loopdev::BackingId::of(&self.image(id)) {
            for dev in loopdev::find(backing)? {
                targets.push((dev.path, backing));
            }
        }
        for (device, backing) in targets {
            loopdev::detach(&device, backing)?;
            tracing::info!(volume_id = %id, device = %device.display(), "detached loop device");
        }
        atomic::remove_file(&record_path)
    }
}

use super::controller::blocking;

impl NodeBackend for LocalBackend {
    fn is_volume_id(&self, id: &str) -> bool {
        ids::is_valid(ids::VOLUME_PREFIX, id)
    }

    async fn attach(
        &self,
        volume_id: &str,
        _publish_context: &BTreeMap<String, String>,
    ) -> Result<AttachedDevice> {
        // The local backend ignores any device named in the publish context: the only device
        // it will use is the loop device whose backing file is this volume's image.
        let (this, id) = (self.clone(), volume_id.to_string());
        blocking(move || this.attach_sync(&id)).await
    }

    async fn find(&self, volume_id: &str) -> Result<Option<AttachedDevice>> {
        let (this, id) = (self.clone(), volume_id.to_string());
        blocking(move || this.find_sync(&id)).await
    }

    async fn detach(&self, volume_id: &str) -> Result<()> {
        let (this, id) = (self.clone(), volume_id.to_string());
        blocking(move || this.detach_sync(&id)).await
    }

    async fn refresh_capacity(&self, volume_id: &str) -> Result<u64> {
        let (this, id) = (self.clone(), volume_id.to_string());
        blocking(move || {
            let dev = this.find_sync(&id)?.ok_or_else(|| {
                Error::FailedPrecondition(format!("volume {id} is not staged on this node"))
            })?;
            loopdev::refresh_capacity(&dev.path)
        })
        .await
    }
}
