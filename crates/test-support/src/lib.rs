//! A harness that runs the real `csi-controller` and `csi-node` binaries on temporary Unix
//! sockets and talks to them over gRPC, as the sidecars and kubelet would. Used by the
//! process-level tests (this crate's `tests/`), by `cargo xtask demo` and by `cargo xtask bench`.
//!
//! Everything a harness creates lives under one directory (`$FERROVOL_TEST_ROOT`, else the
//! system temp dir); dropping the harness stops the plugins, unmounts what is left under its
//! kubelet directory and detaches loop devices backed by its files.

use anyhow::{Context, Result, bail};
use csi_proto::v1::controller_client::ControllerClient;
use csi_proto::v1::identity_client::IdentityClient;
use csi_proto::v1::node_client::NodeClient;
use csi_proto::v1::volume_capability::{
    AccessMode, AccessType, BlockVolume, MountVolume, access_mode::Mode,
};
use csi_proto::v1::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub mod aws;
pub mod faultproxy;

pub use csi_proto::v1;

pub const MIB: i64 = 1 << 20;
pub const NODE_ID: &str = "test-node";
pub const DRIVER: &str = "local.csi.ferrovol.dev";

/// Directory holding the driver binaries: `$FERROVOL_BIN_DIR`, else the target directory this
/// test or tool was built into.
pub fn bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERROVOL_BIN_DIR") {
        return PathBuf::from(d);
    }
    let exe = std::env::current_exe().expect("current_exe");
    let mut dir = exe.parent().expect("exe has a parent").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

fn test_root() -> PathBuf {
    std::env::var_os("FERROVOL_TEST_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
}

/// Mounting tests must not be able to leak mounts into the host: they run in a private mount
/// namespace (`cargo xtask test` arranges it). Running them any other way is an error, not a skip.
pub fn require_private_mount_namespace() {
    let mine = std::fs::read_link("/proc/self/ns/mnt")
        .ok()
        .map(|p| p.display().to_string());
    // `cargo xtask` records the namespace it started in; /proc/1 is the fallback (it is not
    // readable in every sandbox).
    let host = std::env::var("FERROVOL_HOST_MNT_NS").ok().or_else(|| {
        std::fs::read_link("/proc/1/ns/mnt")
            .ok()
            .map(|p| p.display().to_string())
    });
    assert!(
        mine.is_some() && host.is_some() && mine != host,
        "this test mounts filesystems and must run in a private mount namespace: run it through `cargo xtask test` \
         (or `FERROVOL_HOST_MNT_NS=$(readlink /proc/self/ns/mnt) unshare --mount --propagation private cargo test …`)"
    );
    // SAFETY: geteuid has no preconditions.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test needs root (loop devices and mount(2))"
    );
}

pub struct Options {
    pub node_extra_args: Vec<String>,
    pub controller_extra_args: Vec<String>,
    pub log_level: String,
    /// Run the aws backend against this emulator and hypervisor stand-in instead of local.
    pub aws: Option<AwsTarget>,
}

/// Where the aws backend's plugins find their cloud and their devices in a test.
#[derive(Debug, Clone)]
pub struct AwsTarget {
    pub endpoint: String,
    pub instance_id: String,
    pub by_id: PathBuf,
    pub sys: PathBuf,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            node_extra_args: vec![],
            controller_extra_args: vec![],
            log_level: "info".into(),
            aws: None,
        }
    }
}

pub struct Plugin {
    child: Option<Child>,
    args: Vec<String>,
    program: PathBuf,
    pub socket: PathBuf,
    pub log: PathBuf,
    env: Vec<(String, String)>,
}

impl Plugin {
    fn spawn(
        program: PathBuf,
        socket: PathBuf,
        log: PathBuf,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<Self> {
        let mut p = Plugin {
            child: None,
            args,
            program,
            socket,
            log,
            env,
        };
        p.start()?;
        Ok(p)
    }

    pub fn start(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(&self.program)
            .args(&self.args)
            .envs(self.env.iter().cloned())
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} (build it with `cargo build --workspace --bins`)",
                    self.program.display()
                )
            })?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if std::os::unix::net::UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!(
                    "{} exited with {status}; log:\n{}",
                    self.program.display(),
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        bail!(
            "{} did not open {} within 10 s",
            self.program.display(),
            self.socket.display()
        )
    }

    /// SIGKILL: a crash, with no chance to clean up.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM and wait: an orderly shutdown. Returns whether it exited successfully.
    pub fn terminate(&mut self) -> bool {
        let Some(mut c) = self.child.take() else {
            return true;
        };
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = c.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
        false
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Both plugins of the local backend on one node, sharing a state directory.
pub struct Harness {
    pub root: PathBuf,
    pub kubelet: PathBuf,
    pub state: PathBuf,
    pub controller: Plugin,
    pub node: Plugin,
}

impl Harness {
    pub fn start(name: &str) -> Result<Self> {
        Self::start_with(name, Options::default())
    }

    pub fn start_with(name: &str, opts: Options) -> Result<Self> {
        let root = test_root().join(format!("{name}-{}-{}", std::process::id(), unique()));
        let kubelet = root.join("kubelet");
        let state = root.join("state");
        for d in [
            &kubelet,
            &state,
            &kubelet.join("plugins/staging"),
            &kubelet.join("pods"),
        ] {
            std::fs::create_dir_all(d)?;
        }
        let bins = bin_dir();
        let mut c_args = vec![
            format!(
                "--endpoint=unix://{}",
                root.join("controller.sock").display()
            ),
            format!("--state-dir={}", state.display()),
            format!("--log-level={}", opts.log_level),
        ];
        let mut n_args = vec![
            format!("--endpoint=unix://{}", root.join("node.sock").display()),
            format!("--state-dir={}", state.display()),
            format!("--kubelet-dir={}", kubelet.display()),
            format!("--log-level={}", opts.log_level),
        ];
        let mut env = vec![("NO_COLOR".to_string(), "1".to_string())];
        match &opts.aws {
            None => {
                c_args.push(format!("--node-id={NODE_ID}"));
                n_args.push(format!("--node-id={NODE_ID}"));
            }
            Some(t) => {
                c_args.extend([
                    "--backend=aws".to_string(),
                    format!("--aws-endpoint-url={}", t.endpoint),
                    format!("--default-zone={}", aws::ZONE),
                    "--poll-initial-ms=20".to_string(),
                    "--cloud-check-seconds=1".to_string(),
                ]);
                n_args.extend([
                    "--backend=aws".to_string(),
                    format!("--node-id={}", t.instance_id),
                    format!("--availability-zone={}", aws::ZONE),
                    "--instance-type=m5.large".to_string(),
                    format!("--by-id-dir={}", t.by_id.display()),
                    format!("--sys-root={}", t.sys.display()),
                    "--device-wait-seconds=10".to_string(),
                ]);
                env.extend(aws::env());
            }
        }
        c_args.extend(opts.controller_extra_args);
        n_args.extend(opts.node_extra_args);
        let controller = Plugin::spawn(
            bins.join("csi-controller"),
            root.join("controller.sock"),
            root.join("controller.log"),
            c_args,
            env.clone(),
        )?;
        let node = Plugin::spawn(
            bins.join("csi-node"),
            root.join("node.sock"),
            root.join("node.log"),
            n_args,
            env,
        )?;
        Ok(Harness {
            root,
            kubelet,
            state,
            controller,
            node,
        })
    }

    pub async fn controller(&self) -> Result<ControllerClient<Channel>> {
        Ok(ControllerClient::new(
            csi_identity::server::connect(&self.controller.socket.display().to_string()).await?,
        ))
    }

    pub async fn node(&self) -> Result<NodeClient<Channel>> {
        Ok(NodeClient::new(
            csi_identity::server::connect(&self.node.socket.display().to_string()).await?,
        ))
    }

    pub async fn identity(&self, node: bool) -> Result<IdentityClient<Channel>> {
        let sock = if node {
            &self.node.socket
        } else {
            &self.controller.socket
        };
        Ok(IdentityClient::new(
            csi_identity::server::connect(&sock.display().to_string()).await?,
        ))
    }

    /// A staging path as kubelet would choose it (kubelet creates the directory).
    pub fn staging_path(&self, volume: &str) -> PathBuf {
        let p = self.kubelet.join("plugins/staging").join(volume);
        std::fs::create_dir_all(&p).expect("create staging dir");
        p
    }

    /// A publish target as kubelet would choose it (kubelet creates the parent only).
    pub fn target_path(&self, pod: &str) -> PathBuf {
        let parent = self.kubelet.join("pods").join(pod).join("volumes");
        std::fs::create_dir_all(&parent).expect("create pod dir");
        parent.join("vol")
    }

    /// Loop devices whose backing file lives under this harness's state directory.
    pub fn loop_devices(&self) -> Vec<(String, String)> {
        loop_devices_under(&self.root)
    }

    /// Mount points under this harness's directory.
    pub fn mounts(&self) -> Vec<String> {
        mounts_under(&self.root)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.controller.kill();
        self.node.kill();
        // A plugin killed mid-copy may have left a filesystem frozen; a frozen filesystem
        // cannot be unmounted for real and would pin its loop device.
        let _ = cloud_backend::sys::copy::thaw_leftovers(&self.state.join("frozen"));
        for m in mounts_under(&self.root).into_iter().rev() {
            let c = std::ffi::CString::new(m).expect("no NUL");
            // SAFETY: umount2 with a NUL-terminated path; MNT_DETACH so a busy mount cannot block teardown.
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        for (dev, _) in loop_devices_under(&self.root) {
            let _ = Command::new("losetup").args(["-d", &dev]).status();
        }
        if std::env::var_os("FERROVOL_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// `(device, backing file)` for every loop device backed by a file under `dir`.
pub fn loop_devices_under(dir: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return out;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        if let Ok(backing) = std::fs::read_to_string(e.path().join("loop/backing_file")) {
            let backing = backing.trim().trim_end_matches(" (deleted)").to_string();
            if backing.starts_with(&*dir.to_string_lossy()) {
                out.push((format!("/dev/{name}"), backing));
            }
        }
    }
    out.sort();
    out
}

/// Mount points under `dir`, in mount order.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    cloud_backend::sys::mountinfo::read()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m.mount_point.starts_with(dir))
        .map(|m| m.mount_point.display().to_string())
        .collect()
}

pub fn mount_capability(fs_type: &str) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs_type.into(),
            mount_flags: vec![],
            volume_mount_group: String::new(),
        })),
    }
}

pub fn block_capability() -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub fn create_request(name: &str, bytes: i64, cap: VolumeCapability) -> CreateVolumeRequest {
    CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(CapacityRange {
            required_bytes: bytes,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        ..Default::default()
    }
}

pub fn stage_request(
    volume_id: &str,
    staging: &Path,
    cap: VolumeCapability,
) -> NodeStageVolumeRequest {
    NodeStageVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn publish_request(
    volume_id: &str,
    staging: &Path,
    target: &Path,
    cap: VolumeCapability,
    readonly: bool,
) -> NodePublishVolumeRequest {
    NodePublishVolumeRequest {
        volume_id: volume_id.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        readonly,
        ..Default::default()
    }
}

/// `df`'s view of a mounted filesystem's size in bytes, from the real `df` program.
pub fn df_size(path: &Path) -> u64 {
    let out = Command::new("df")
        .args(["--output=size", "-B1"])
        .arg(path)
        .output()
        .expect("df");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .nth(1)
        .and_then(|l| l.trim().parse().ok())
        .expect("df output")
}

/// The filesystem type blkid sees on a device or image, if any.
pub fn blkid_type(dev: &Path) -> Option<String> {
    let out = Command::new("blkid")
        .args(["-p", "-s", "TYPE", "-o", "value"])
        .arg(dev)
        .output()
        .ok()?;
    let t = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!t.is_empty()).then_some(t)
}

/// Whether this process may use CAP_SYS_RESOURCE, which the kernel demands for online ext4
/// resize. Some sandboxes (this project's CI VMs among them) drop it even for root.
pub fn has_cap_sys_resource() -> bool {
    const CAP_SYS_RESOURCE: u32 = 24;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| {
                    l.strip_prefix("CapEff:")
                        .map(|v| u64::from_str_radix(v.trim(), 16).ok())
                })
                .flatten()
        })
        .is_some_and(|caps| caps >> CAP_SYS_RESOURCE & 1 == 1)
}

/// A small deterministic generator (xorshift64*), so a failing random schedule can be replayed
/// from its printed seed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// Major and minor number of the device mounted at `path`, from mountinfo.
pub fn mount_device(path: &Path) -> Option<(u32, u32)> {
    cloud_backend::sys::mountinfo::read()
        .ok()?
        .iter()
        .rev()
        .find(|m| m.mount_point == path)
        .map(|m| (m.major, m.minor))
}

/// How many mounts sit exactly at `path`.
pub fn mount_count(path: &Path) -> usize {
    cloud_backend::sys::mountinfo::read()
        .map(|v| v.iter().filter(|m| m.mount_point == path).count())
        .unwrap_or(0)
}

/// Major and minor number of a device node.
pub fn dev_numbers(path: &Path) -> (u32, u32) {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(path).expect("stat device").rdev();
    (libc::major(rdev), libc::minor(rdev))
}

/// The filesystem UUID blkid reads from a device or image.
pub fn blkid_uuid(dev: &Path) -> Option<String> {
    let out = Command::new("blkid")
        .args(["-p", "-s", "UUID", "-o", "value"])
        .arg(dev)
        .output()
        .ok()?;
    let t = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!t.is_empty()).then_some(t)
}

/// Retries `call` while it answers ABORTED (another operation on the volume still running)
/// or UNAVAILABLE (plugin restarting), as kubelet and the sidecars do.
pub async fn retry<T, F, Fut>(what: &str, mut call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match call().await {
            Ok(r) => return Ok(r.into_inner()),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Aborted
                        | tonic::Code::Unavailable
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Cancelled
                ) && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(s) => bail!("{what}: {s:?}"),
        }
    }
}

impl Harness {
    /// The volume's image file (local backend layout).
    pub fn image(&self, volume_id: &str) -> PathBuf {
        self.state.join("volumes").join(volume_id).join("disk.img")
    }

    /// The loop device backed by this volume's image, if exactly one; panics on more.
    pub fn loop_of(&self, volume_id: &str) -> Option<String> {
        let image = self.image(volume_id).display().to_string();
        let devs: Vec<String> = self
            .loop_devices()
            .into_iter()
            .filter(|(_, b)| *b == image)
            .map(|(d, _)| d)
            .collect();
        assert!(
            devs.len() <= 1,
            "volume {volume_id} is attached to several loop devices: {devs:?}"
        );
        devs.into_iter().next()
    }
}

pub fn secrets(value: &str) -> HashMap<String, String> {
    HashMap::from([("password".to_string(), value.to_string())])
}
