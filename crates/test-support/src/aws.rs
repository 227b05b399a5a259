//! The aws backend's test world: the moto EC2 emulator on loopback, and a stand-in for the
//! hypervisor that turns moto's attachment records into block devices on this machine.

use anyhow::{Context, Result, bail};
use aws_sdk_ec2::types::{Placement, VolumeAttachmentState};
use cloud_backend::sys::loopdev;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const REGION: &str = "us-east-1";
pub const ZONE: &str = "us-east-1a";
pub const GIB: u64 = 1 << 30;

/// The environment a plugin needs to talk to moto.
pub fn env() -> Vec<(String, String)> {
    [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", REGION),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

/// A `moto_server` process on a free loopback port.
pub struct Moto {
    child: Child,
    pub endpoint: String,
    pub port: u16,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Moto {
    /// Starts moto. Its path comes from `$FERROVOL_MOTO` (set by `cargo xtask`, which installs
    /// a pinned moto); missing moto is an error, never a skip.
    pub fn start(log: &Path) -> Result<Moto> {
        let server = std::env::var_os("FERROVOL_MOTO").map(PathBuf::from).context(
            "FERROVOL_MOTO is not set: the aws tests need the moto EC2 emulator; run them through `cargo xtask test`, which installs it",
        )?;
        let port = free_port()?;
        let log = std::fs::File::create(log)?;
        let child = Command::new(&server)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", server.display()))?;
        let mut m = Moto {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
            port,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if let Ok(Some(status)) = m.child.try_wait() {
                bail!("moto_server exited with {status}");
            }
            if Instant::now() > deadline {
                bail!("moto_server did not listen on port {port} within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        m.endpoint = format!("http://127.0.0.1:{port}");
        Ok(m)
    }

    pub fn client(&self) -> aws_sdk_ec2::Client {
        client(&self.endpoint)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An EC2 client for `endpoint` with the emulator's dummy credentials.
pub fn client(endpoint: &str) -> aws_sdk_ec2::Client {
    let conf = aws_sdk_ec2::Config::builder()
        .behavior_version(aws_sdk_ec2::config::BehaviorVersion::latest())
        .region(aws_sdk_ec2::config::Region::new(REGION))
        .credentials_provider(aws_sdk_ec2::config::Credentials::new(
            "testing", "testing", None, None, "test",
        ))
        .endpoint_url(endpoint)
        .build();
    aws_sdk_ec2::Client::from_conf(conf)
}

/// A filter on the tag `tag=value`.
pub fn tagged(tag: &str, value: &str) -> aws_sdk_ec2::types::Filter {
    aws_sdk_ec2::types::Filter::builder()
        .name(format!("tag:{tag}"))
        .values(value)
        .build()
}

/// Ids of the volumes in the emulator carrying `tag=value`, whatever their state.
pub async fn volumes_tagged(
    ec2: &aws_sdk_ec2::Client,
    tag: &str,
    value: &str,
) -> Result<Vec<String>> {
    let out = ec2
        .describe_volumes()
        .filters(tagged(tag, value))
        .send()
        .await
        .context("DescribeVolumes in moto")?;
    Ok(out
        .volumes()
        .iter()
        .filter_map(|v| v.volume_id().map(str::to_string))
        .collect())
}

/// Ids of the snapshots in the emulator carrying `tag=value`.
pub async fn snapshots_tagged(
    ec2: &aws_sdk_ec2::Client,
    tag: &str,
    value: &str,
) -> Result<Vec<String>> {
    let out = ec2
        .describe_snapshots()
        .filters(tagged(tag, value))
        .send()
        .await
        .context("DescribeSnapshots in moto")?;
    Ok(out
        .snapshots()
        .iter()
        .filter_map(|s| s.snapshot_id().map(str::to_string))
        .collect())
}

/// Starts an instance in the emulator (the node the tests attach to).
pub async fn run_instance(ec2: &aws_sdk_ec2::Client, zone: &str) -> Result<String> {
    let out = ec2
        .run_instances()
        .image_id("ami-12c6146b")
        .instance_type(aws_sdk_ec2::types::InstanceType::M5Large)
        .min_count(1)
        .max_count(1)
        .placement(Placement::builder().availability_zone(zone).build())
        .send()
        .await
        .context("RunInstances in moto")?;
    out.instances()
        .first()
        .and_then(|i| i.instance_id())
        .map(str::to_string)
        .context("moto returned no instance")
}

/// Plays the hypervisor for one instance: when the emulator records an attachment of a volume
/// to it, the volume's disk (a sparse file kept across attachments) appears as a loop device
/// with the by-id link and NVMe serial a real Nitro instance would show; on detach they go.
/// Snapshots capture the source disk's bytes, and volumes made from a snapshot start with them.
pub struct Hypervisor {
    pub by_id: PathBuf,
    pub sys: PathBuf,
    pub disks: PathBuf,
    stop: Arc<AtomicBool>,
    state: Arc<Mutex<HashMap<String, loopdev::LoopDevice>>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Hypervisor {
    pub fn start(ec2: aws_sdk_ec2::Client, instance_id: String, root: &Path) -> Result<Hypervisor> {
        let (by_id, sys, disks, snaps) = (
            root.join("by-id"),
            root.join("sys"),
            root.join("disks"),
            root.join("snapshots"),
        );
        for d in [&by_id, &sys.join("block"), &disks, &snaps] {
            std::fs::create_dir_all(d)?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let state: Arc<Mutex<HashMap<String, loopdev::LoopDevice>>> = Arc::default();
        let world = World {
            ec2,
            instance_id,
            by_id: by_id.clone(),
            sys: sys.clone(),
            disks: disks.clone(),
            snaps,
            state: state.clone(),
            stop: stop.clone(),
        };
        let s = stop.clone();
        let task = tokio::spawn(async move {
            while !s.load(Ordering::Relaxed) {
                if let Err(e) = world.reconcile().await {
                    eprintln!("hypervisor: {e:#}");
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        });
        Ok(Hypervisor {
            by_id,
            sys,
            disks,
            stop,
            state,
            task: Some(task),
        })
    }

    /// The disk image behind a volume.
    pub fn disk(&self, volume_id: &str) -> PathBuf {
        self.disks.join(format!("{volume_id}.img"))
    }

    /// Loop devices currently presented.
    pub fn attached(&self) -> Vec<String> {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect()
    }
}

impl Drop for Hypervisor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.task.take() {
            t.abort();
        }
        for (_, dev) in self.state.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = loopdev::detach(&dev.path, dev.backing);
        }
    }
}

struct World {
    ec2: aws_sdk_ec2::Client,
    instance_id: String,
    by_id: PathBuf,
    sys: PathBuf,
    disks: PathBuf,
    snaps: PathBuf,
    state: Arc<Mutex<HashMap<String, loopdev::LoopDevice>>>,
    stop: Arc<AtomicBool>,
}

impl World {
    fn link(&self, volume_id: &str) -> PathBuf {
        self.by_id.join(format!(
            "nvme-Amazon_Elastic_Block_Store_{}",
            volume_id.replace('-', "")
        ))
    }

    async fn reconcile(&self) -> Result<()> {
        let vols = self.ec2.describe_volumes().send().await?.volumes().to_vec();
        // Only our own snapshots: the emulator also serves a large public catalogue.
        let snaps = self
            .ec2
            .describe_snapshots()
            .filters(
                aws_sdk_ec2::types::Filter::builder()
                    .name("tag-key")
                    .values("CSIVolumeSnapshotName")
                    .build(),
            )
            .send()
            .await?
            .snapshots()
            .to_vec();
        for s in &snaps {
            let (Some(sid), Some(vid)) = (s.snapshot_id(), s.volume_id()) else {
                continue;
            };
            let dst = self.snaps.join(format!("{sid}.img"));
            let src = self.disks.join(format!("{vid}.img"));
            if !dst.exists() && src.exists() {
                let tmp = dst.with_extension("tmp");
                cloud_backend::sys::copy::copy_image(&src, &tmp)?;
                std::fs::rename(&tmp, &dst)?;
            }
        }
        let mut live = std::collections::HashSet::new();
        for v in &vols {
            let Some(id) = v.volume_id() else { continue };
            live.insert(id.to_string());
            let disk = self.disks.join(format!("{id}.img"));
            let size = v.size().unwrap_or(1) as u64 * GIB;
            if !disk.exists() {
                let tmp = disk.with_extension("tmp");
                match v
                    .snapshot_id()
                    .filter(|s| !s.is_empty())
                    .map(|s| self.snaps.join(format!("{s}.img")))
                {
                    Some(from) if from.exists() => {
                        cloud_backend::sys::copy::copy_image(&from, &tmp)?;
                    }
                    _ => {
                        std::fs::File::create(&tmp)?;
                    }
                }
                std::fs::rename(&tmp, &disk)?;
            }
            let f = std::fs::OpenOptions::new().write(true).open(&disk)?;
            if f.metadata()?.len() < size {
                f.set_len(size)?; // a ModifyVolume grew it
            }
            let here = v.attachments().iter().any(|a| {
                a.instance_id() == Some(self.instance_id.as_str())
                    && matches!(
                        a.state(),
                        Some(VolumeAttachmentState::Attached)
                            | Some(VolumeAttachmentState::Attaching)
                    )
            });
            let present = self
                .state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(id)
                .cloned();
            match (here, present) {
                (true, None) => {
                    // Attach and record under the lock, so a concurrent Drop either sees the
                    // device (and detaches it) or stops this attach from happening.
                    let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                    if self.stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    let dev = loopdev::attach(&disk, false)?;
                    let name = dev
                        .path
                        .file_name()
                        .context("device name")?
                        .to_string_lossy()
                        .into_owned();
                    let serial_dir = self.sys.join("block").join(&name).join("device");
                    std::fs::create_dir_all(&serial_dir)?;
                    std::fs::write(
                        serial_dir.join("serial"),
                        format!("{}\n", id.replace('-', "")),
                    )?;
                    let _ = std::fs::remove_file(self.link(id));
                    std::os::unix::fs::symlink(&dev.path, self.link(id))?;
                    state.insert(id.to_string(), dev);
                }
                (false, Some(dev)) => self.unplug(id, &dev)?,
                _ => {}
            }
        }
        let gone: Vec<(String, loopdev::LoopDevice)> = self
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|(k, _)| !live.contains(*k))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        for (id, dev) in gone {
            self.unplug(&id, &dev)?;
        }
        for entry in std::fs::read_dir(&self.disks)?.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name.strip_suffix(".img")
                && !live.contains(id)
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(())
    }

    fn unplug(&self, id: &str, dev: &loopdev::LoopDevice) -> Result<()> {
        let _ = std::fs::remove_file(self.link(id));
        if let Some(name) = dev.path.file_name() {
            let _ = std::fs::remove_dir_all(self.sys.join("block").join(name));
        }
        // A device still mounted (a detach forced behind the node's back) stays until released.
        match loopdev::detach(&dev.path, dev.backing) {
            Ok(()) => {
                self.state
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(id);
                Ok(())
            }
            Err(cloud_backend::Error::Busy(m)) => {
                eprintln!("hypervisor: {id}: {m}");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}
