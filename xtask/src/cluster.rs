//! `cargo xtask cluster up | down | status`: a real one-node Kubernetes cluster on this machine,
//! as host processes, for the e2e tests (e2e/).
//!
//! etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, the kubelet,
//! kube-proxy (iptables mode) and snapshot-controller run as host processes started by `up`,
//! detached (each in a session of its own), their pids in `target/cluster/pids/` and their
//! output in `target/cluster/logs/<component>.log`. The Kubernetes, etcd and sidecar binaries
//! are built once from the pinned wrapper modules in xtask/cluster/ into `$FERROVOL_CACHE`
//! (see [`build`]); containerd, runc and the CNI plugins come from Debian.
//!
//! Network: a bridge (`ferrovol-cni0`) carries the pods (10.244.0.0/24) and holds the node's
//! address, 10.244.0.1, which the apiserver binds to and advertises: pods cannot reach the host's
//! 127.0.0.1, and some sandboxes have no dummy interfaces. Services are 10.96.0.0/24; the
//! `kubernetes` Service is 10.96.0.1:443, which kube-proxy forwards to 10.244.0.1:6443.
//!
//! `up` makes a fresh cluster (new certificates, empty etcd) unless one is already running;
//! `down` stops everything and removes what the cluster left on the host: containers, mounts
//! under the kubelet's and the cluster's directories, loop devices backed by files there,
//! network namespaces, the bridge and veths, iptables rules and chains, the kubelet's cgroups.
//! It keeps the logs.

mod build;
mod config;
mod host;
mod images;

use crate::{tools, util};
use anyhow::{Context, Result, bail};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The node's name (the kubelet's `--hostname-override`), whatever the host is called.
pub const NODE_NAME: &str = "ferrovol-e2e";
/// The kubelet's root directory; the chart's hostPath volumes assume it.
pub const KUBELET_DIR: &str = "/var/lib/kubelet";
/// The node's address: on the pod bridge, so that pods reach the apiserver through it.
pub const NODE_IP: &str = "10.244.0.1";
pub const POD_CIDR: &str = "10.244.0.0/24";
const POD_PREFIX: &str = "24";
pub const SERVICE_CIDR: &str = "10.96.0.0/24";
/// The `kubernetes` Service's ClusterIP.
pub const API_SERVICE_IP: &str = "10.96.0.1";
pub const API_PORT: u16 = 6443;
const BRIDGE: &str = "ferrovol-cni0";
/// Runtime state that must not sit in the work tree: sockets (whose paths must stay short) and
/// containerd's state.
const RUN_DIR: &str = "/run/ferrovol-cluster";
/// The local backend's state directory in the chart (hostPath); `down` removes the volumes'
/// files, which belong to the cluster `down` destroyed.
const DRIVER_STATE_DIR: &str = "/var/lib/ferrovol";
const ETCD_CLIENT_PORT: u16 = 23790;
const ETCD_PEER_PORT: u16 = 23800;

const START_TIMEOUT: Duration = Duration::from_secs(120);
const NODE_READY_TIMEOUT: Duration = Duration::from_secs(180);
const STOP_TIMEOUT: Duration = Duration::from_secs(20);
const IMPORT_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// The components in start order; `down` stops them in reverse.
const COMPONENTS: &[&str] = &[
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "containerd",
    "kubelet",
    "kube-proxy",
    "snapshot-controller",
];

pub fn run(args: &[String]) -> Result<()> {
    match args.first().map(String::as_str) {
        Some("up") => up(),
        Some("down") => down(),
        Some("status") => status(),
        _ => bail!("usage: cargo xtask cluster up | down | status"),
    }
}

/// The admin kubeconfig (certificates inlined).
pub fn kubeconfig() -> PathBuf {
    Paths::new().kubeconfig
}

pub fn logs_dir() -> PathBuf {
    Paths::new().logs
}

/// The pinned kubectl, built on first use.
pub fn kubectl() -> Result<PathBuf> {
    Ok(build::go_binaries(&build::KUBERNETES)?.join("kubectl"))
}

/// Imports an image archive (OCI or docker-archive tar) into the cluster's containerd, namespace
/// k8s.io, where the kubelet finds it.
pub fn import_image(archive: &Path) -> Result<()> {
    let paths = Paths::new();
    util::run(
        paths
            .ctr()
            .args(["images", "import", "--snapshotter"])
            .arg(snapshotter(&paths))
            .arg(archive),
        IMPORT_TIMEOUT,
    )
    .with_context(|| {
        format!(
            "importing {} into the cluster's containerd",
            archive.display()
        )
    })
}

/// Where everything lives.
struct Paths {
    /// target/cluster: configuration, certificates, data, logs, pids, images.
    root: PathBuf,
    pki: PathBuf,
    logs: PathBuf,
    pids: PathBuf,
    images: PathBuf,
    cni_conf: PathBuf,
    kubeconfig: PathBuf,
    /// The pods' logs (the kubelet's podLogsDir), linked from /var/log/containers.
    pod_logs: PathBuf,
    /// The host's sysctl values from before the first `up`, which `down` puts back.
    sysctls: PathBuf,
    run: PathBuf,
    containerd_socket: PathBuf,
}

impl Paths {
    fn new() -> Paths {
        let root = util::target_dir().join("cluster");
        let run = PathBuf::from(RUN_DIR);
        Paths {
            pki: root.join("pki"),
            logs: root.join("logs"),
            pids: root.join("pids"),
            images: root.join("images"),
            cni_conf: root.join("cni"),
            kubeconfig: root.join("kubeconfig"),
            sysctls: root.join("sysctls.orig"),
            pod_logs: root.join("pod-logs"),
            containerd_socket: run.join("containerd.sock"),
            run,
            root,
        }
    }

    fn ctr(&self) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address")
            .arg(&self.containerd_socket)
            .args(["--namespace", "k8s.io"]);
        cmd
    }

    fn pid_file(&self, component: &str) -> PathBuf {
        self.pids.join(format!("{component}.pid"))
    }
}

/// The snapshotter `up` configured, recorded next to containerd's configuration.
fn snapshotter(paths: &Paths) -> String {
    std::fs::read_to_string(paths.root.join("snapshotter"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "overlayfs".into())
}

// ---------------------------------------------------------------------------------------------
// up

/// Starts the cluster (building what the cache lacks) and returns once the node is Ready, the
/// images are imported, the snapshot CRDs are installed and the default ServiceAccount exists.
/// Does nothing if the cluster already runs; a half-running one is taken down first.
pub fn up() -> Result<()> {
    let started = Instant::now();
    let paths = Paths::new();
    // Two xtasks starting or stopping the one cluster at once would wreck each other.
    let _lock = util::lock_dir(&paths.root)?;
    let running: Vec<&str> = COMPONENTS
        .iter()
        .copied()
        .filter(|c| running_pid(&paths, c).is_some())
        .collect();
    if running.len() == COMPONENTS.len() && api_ready(&paths) {
        println!("cluster: already up ({} ready)", paths.kubeconfig.display());
        return Ok(());
    }
    if !running.is_empty() || paths.pids.exists() {
        println!(
            "cluster: a previous cluster is partly running or was not taken down ({}): down first",
            if running.is_empty() {
                "nothing runs".to_string()
            } else {
                running.join(", ")
            }
        );
        down_locked(&paths)?;
    }

    let (restrict_oom, snapshotter) = host::check()?;
    tools::cluster_packages()?;
    let kube = build::go_binaries(&build::KUBERNETES)?;
    let etcd = build::go_binaries(&build::ETCD)?;
    let sidecars = build::go_binaries(&build::SIDECARS)?;
    println!(
        "cluster: writing the images into {}",
        paths.images.display()
    );
    let archives = images::write_all(&sidecars, &paths.images)?;

    let result = start_all(
        &paths,
        &kube,
        &etcd,
        &sidecars,
        &archives,
        restrict_oom,
        snapshotter,
    );
    if let Err(err) = result {
        eprintln!(
            "cluster: `up` failed; the components' logs are in {} (the cluster is left as it is \
             for inspection: `cargo xtask cluster down` removes it)",
            paths.logs.display()
        );
        return Err(err);
    }
    println!(
        "cluster: up in {} — node {NODE_NAME} Ready\n  kubeconfig: {}\n  kubectl:    {}\n  logs:       {}",
        build::human(started.elapsed()),
        paths.kubeconfig.display(),
        kube.join("kubectl").display(),
        paths.logs.display(),
    );
    Ok(())
}

fn start_all(
    paths: &Paths,
    kube: &Path,
    etcd: &Path,
    sidecars: &Path,
    archives: &[PathBuf],
    restrict_oom: bool,
    snapshotter: &str,
) -> Result<()> {
    host::share_root_mount()?;
    host::save_sysctls(&paths.sysctls)?;
    host::network()?;

    // A fresh cluster: the previous one's data and configuration go, its logs stay until the
    // components start again.
    for dir in [&paths.pki, &paths.cni_conf, &paths.pids] {
        util::fresh_dir(dir)?;
    }
    util::fresh_dir(&paths.root.join("etcd"))?;
    util::fresh_dir(&paths.root.join("containerd"))?;
    util::fresh_dir(&paths.run)?;
    std::fs::create_dir_all(&paths.logs)?;
    std::fs::create_dir_all(KUBELET_DIR)?;
    std::fs::write(paths.root.join("snapshotter"), snapshotter)?;

    println!(
        "cluster: certificates and configuration in {}",
        paths.root.display()
    );
    config::pki(paths)?;
    let admin = config::kubeconfig(paths, "admin")?;
    let cm_config = config::kubeconfig(paths, "kube-controller-manager")?;
    let scheduler_config = config::kubeconfig(paths, "kube-scheduler")?;
    let kubelet_kubeconfig = config::kubeconfig(paths, "kubelet")?;
    let proxy_kubeconfig = config::kubeconfig(paths, "kube-proxy")?;
    let snapshot_kubeconfig = config::kubeconfig(paths, "snapshot-controller")?;
    config::containerd(paths, snapshotter, restrict_oom)?;
    let kubelet_config = config::kubelet(paths)?;
    let proxy_config = config::kube_proxy(paths, &proxy_kubeconfig)?;
    let pki = |name: &str| paths.pki.join(name).into_os_string();

    let etcd_url = format!("http://127.0.0.1:{ETCD_CLIENT_PORT}");
    let peer_url = format!("http://127.0.0.1:{ETCD_PEER_PORT}");
    start(
        paths,
        "etcd",
        &etcd.join("etcd"),
        &args(&[
            "--name".into(),
            NODE_NAME.into(),
            "--data-dir".into(),
            paths.root.join("etcd").into_os_string(),
            "--listen-client-urls".into(),
            etcd_url.clone().into(),
            "--advertise-client-urls".into(),
            etcd_url.clone().into(),
            "--listen-peer-urls".into(),
            peer_url.clone().into(),
            "--initial-advertise-peer-urls".into(),
            peer_url.clone().into(),
            "--initial-cluster".into(),
            format!("{NODE_NAME}={peer_url}").into(),
            // A throwaway test cluster: speed over durability.
            "--unsafe-no-fsync".into(),
            "--log-level".into(),
            "warn".into(),
        ]),
    )?;
    wait_for(paths, "etcd", || etcd_healthy(ETCD_CLIENT_PORT))?;

    let api_args = args(&[
        format!("--etcd-servers={etcd_url}").into(),
        format!("--bind-address={NODE_IP}").into(),
        format!("--advertise-address={NODE_IP}").into(),
        format!("--secure-port={API_PORT}").into(),
        "--tls-cert-file".into(),
        pki("apiserver.crt"),
        "--tls-private-key-file".into(),
        pki("apiserver.key"),
        "--client-ca-file".into(),
        pki("ca.crt"),
        "--kubelet-client-certificate".into(),
        pki("apiserver-kubelet-client.crt"),
        "--kubelet-client-key".into(),
        pki("apiserver-kubelet-client.key"),
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
        "--service-account-key-file".into(),
        pki("sa.pub"),
        "--service-account-signing-key-file".into(),
        pki("sa.key"),
        format!("--service-cluster-ip-range={SERVICE_CIDR}").into(),
        "--authorization-mode=Node,RBAC".into(),
        // The node's name resolves nowhere: `kubectl logs` and `exec` go to its address.
        "--kubelet-preferred-address-types=InternalIP".into(),
        "--enable-admission-plugins=NodeRestriction".into(),
        "--allow-privileged=true".into(),
        "--cert-dir".into(),
        paths.root.join("apiserver-certs").into_os_string(),
        "--v=1".into(),
    ]);
    start(
        paths,
        "kube-apiserver",
        &kube.join("kube-apiserver"),
        &api_args,
    )?;
    wait_for(paths, "kube-apiserver", || api_ready(paths))?;

    start(
        paths,
        "kube-controller-manager",
        &kube.join("kube-controller-manager"),
        &args(&[
            "--kubeconfig".into(),
            cm_config.into_os_string(),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            "--service-account-private-key-file".into(),
            pki("sa.key"),
            "--root-ca-file".into(),
            pki("ca.crt"),
            "--use-service-account-credentials=true".into(),
            "--cluster-signing-cert-file".into(),
            pki("ca.crt"),
            "--cluster-signing-key-file".into(),
            pki("ca.key"),
            "--v=1".into(),
        ]),
    )?;
    start(
        paths,
        "kube-scheduler",
        &kube.join("kube-scheduler"),
        &args(&[
            "--kubeconfig".into(),
            scheduler_config.into_os_string(),
            "--leader-elect=false".into(),
            "--bind-address=127.0.0.1".into(),
            "--v=1".into(),
        ]),
    )?;

    start(
        paths,
        "containerd",
        Path::new("containerd"),
        &args(&[
            "--config".into(),
            paths.root.join("containerd.toml").into_os_string(),
        ]),
    )?;
    wait_for(paths, "containerd", || {
        paths
            .ctr()
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })?;
    println!(
        "cluster: importing {} images into containerd",
        archives.len()
    );
    for archive in archives {
        import_image(archive)?;
    }

    start(
        paths,
        "kubelet",
        &kube.join("kubelet"),
        &args(&[
            "--config".into(),
            kubelet_config.into_os_string(),
            "--kubeconfig".into(),
            kubelet_kubeconfig.into_os_string(),
            "--root-dir".into(),
            KUBELET_DIR.into(),
            "--cert-dir".into(),
            paths.root.join("kubelet-pki").into_os_string(),
            format!("--node-ip={NODE_IP}").into(),
            format!("--hostname-override={NODE_NAME}").into(),
            "--v=2".into(),
        ]),
    )?;
    start(
        paths,
        "kube-proxy",
        &kube.join("kube-proxy"),
        &args(&[
            "--config".into(),
            proxy_config.into_os_string(),
            "--v=1".into(),
        ]),
    )?;

    println!("cluster: installing the VolumeSnapshot CRDs");
    let kubectl = kube.join("kubectl");
    util::run(
        Command::new(&kubectl)
            .arg("--kubeconfig")
            .arg(&admin)
            .args(["apply", "--server-side", "-f"])
            .arg(sidecars.join("crd")),
        START_TIMEOUT,
    )?;
    start(
        paths,
        "snapshot-controller",
        &sidecars.join("snapshot-controller"),
        &args(&[
            "--kubeconfig".into(),
            snapshot_kubeconfig.into_os_string(),
            "--leader-election=false".into(),
            // The local backend snapshots on the node that holds the volume.
            "--enable-distributed-snapshotting".into(),
            "--v=2".into(),
        ]),
    )?;

    println!("cluster: waiting for node {NODE_NAME} to be Ready");
    let deadline = Instant::now() + NODE_READY_TIMEOUT;
    loop {
        let ready = kubectl_output(
            paths,
            &[
                "get",
                "node",
                NODE_NAME,
                "-o",
                "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}",
            ],
        );
        if ready.as_deref().is_ok_and(|s| s.trim() == "True") {
            break;
        }
        check_alive(paths)?;
        if Instant::now() > deadline {
            bail!(
                "node {NODE_NAME} is not Ready after {} s; the kubelet's log ends with:\n{}",
                NODE_READY_TIMEOUT.as_secs(),
                util::tail(&paths.logs.join("kubelet.log"), 30)
            );
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    // Pods cannot be created before the ServiceAccount controller made `default`.
    wait_for(paths, "kube-controller-manager", || {
        kubectl_output(
            paths,
            &["get", "serviceaccount", "default", "-n", "default"],
        )
        .is_ok()
    })?;
    Ok(())
}

fn args(list: &[OsString]) -> Vec<OsString> {
    list.to_vec()
}

/// Starts `component` detached from this process (a session of its own, so that neither the end
/// of `cargo xtask` nor a Ctrl-C in its terminal reaches it), output to its log, pid recorded.
fn start(paths: &Paths, component: &str, program: &Path, args: &[OsString]) -> Result<()> {
    std::fs::create_dir_all(&paths.logs)?;
    std::fs::create_dir_all(&paths.pids)?;
    let log_path = paths.logs.join(format!("{component}.log"));
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("cannot create {}", log_path.display()))?;
    println!(
        "cluster: starting {component} (log: {})",
        log_path.display()
    );
    // setsid(1) execs the program in place (the child leads no process group yet), so the pid
    // is the component's own.
    let child = Command::new("setsid")
        .arg(program)
        .args(args)
        .current_dir(&paths.root)
        .env("PATH", util::path_with_sbin())
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("cannot start {component} ({})", program.display()))?;
    let pid = child.id();
    // Dropping `child` neither kills nor waits: the component outlives this process and is
    // reaped by init.
    drop(child);
    // Give setsid the moment it needs to exec, so that the recorded start time is the
    // component's.
    std::thread::sleep(Duration::from_millis(50));
    let start_time = start_time(pid).context("the component exited at once")?;
    std::fs::write(paths.pid_file(component), format!("{pid} {start_time}\n"))?;
    Ok(())
}

/// Waits until `ready` holds, failing early with the end of its log if `component` died.
fn wait_for(paths: &Paths, component: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    while !ready() {
        check_alive(paths)?;
        if Instant::now() > deadline {
            bail!(
                "{component} is not ready after {} s; its log ends with:\n{}",
                START_TIMEOUT.as_secs(),
                util::tail(&paths.logs.join(format!("{component}.log")), 30)
            );
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    Ok(())
}

/// Fails, with the end of its log, if a started component has exited.
fn check_alive(paths: &Paths) -> Result<()> {
    for component in COMPONENTS {
        if paths.pid_file(component).exists() && running_pid(paths, component).is_none() {
            bail!(
                "{component} exited; its log ({}) ends with:\n{}",
                paths.logs.join(format!("{component}.log")).display(),
                util::tail(&paths.logs.join(format!("{component}.log")), 30)
            );
        }
    }
    Ok(())
}

fn etcd_healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    if stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    response.contains("\"health\":\"true\"")
}

fn api_ready(paths: &Paths) -> bool {
    kubectl_output(paths, &["get", "--raw", "/readyz"]).is_ok_and(|s| s.trim() == "ok")
}

/// `kubectl --kubeconfig <admin> <args>`'s stdout, or its stderr as the error.
fn kubectl_output(paths: &Paths, args: &[&str]) -> Result<String> {
    let kubectl = kubectl()?;
    let out = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(&paths.kubeconfig)
        .arg("--request-timeout=5s")
        .args(args)
        .output()
        .context("cannot run kubectl")?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

// ---------------------------------------------------------------------------------------------
// Processes

/// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), which tells a component
/// from an unrelated process that reused its pid.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // Fields after the command name start at 3 (state); start time is field 22.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(22 - 3)?.parse().ok()
}

/// The pid of `component` if it still runs.
fn running_pid(paths: &Paths, component: &str) -> Option<u32> {
    let text = std::fs::read_to_string(paths.pid_file(component)).ok()?;
    let mut fields = text.split_whitespace();
    let pid: u32 = fields.next()?.parse().ok()?;
    let recorded: u64 = fields.next()?.parse().ok()?;
    (start_time(pid) == Some(recorded)).then_some(pid)
}

/// SIGTERM, then SIGKILL after [`STOP_TIMEOUT`].
fn stop(paths: &Paths, component: &str) {
    let Some(pid) = running_pid(paths, component) else {
        let _ = std::fs::remove_file(paths.pid_file(component));
        return;
    };
    println!("cluster: stopping {component} (pid {pid})");
    let _ = util::signal(&[pid.to_string()], "TERM");
    let deadline = Instant::now() + STOP_TIMEOUT;
    while running_pid(paths, component).is_some() {
        if Instant::now() > deadline {
            eprintln!(
                "warning: {component} ignored SIGTERM for {} s: killed",
                STOP_TIMEOUT.as_secs()
            );
            let _ = util::signal(&[pid.to_string()], "KILL");
            std::thread::sleep(Duration::from_millis(200));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = std::fs::remove_file(paths.pid_file(component));
}

/// Pids of the containerd shims serving the cluster's containerd (they name its socket on their
/// command line) and of everything below them: the containers' processes.
fn shim_processes(paths: &Paths) -> Vec<String> {
    let socket = paths.containerd_socket.to_string_lossy().into_owned();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(pid) = name.parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let argv: Vec<String> = cmdline
            .split(|&b| b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if argv.first().is_some_and(|a| a.contains("containerd-shim")) && argv.contains(&socket) {
            pids.extend(util::descendants(pid));
            pids.push(pid.to_string());
        }
    }
    pids
}

// ---------------------------------------------------------------------------------------------
// down

/// Stops the cluster and removes everything it left on the host except the logs (and the image
/// archives, which `up` rewrites). Safe to run when nothing runs.
pub fn down() -> Result<()> {
    let paths = Paths::new();
    let _lock = util::lock_dir(&paths.root)?;
    down_locked(&paths)
}

fn down_locked(paths: &Paths) -> Result<()> {
    // The kubelet first, so that it restarts no container while they are being killed.
    for component in ["snapshot-controller", "kubelet"] {
        stop(paths, component);
    }

    // Every container, and the network namespaces of the pods (from their OCI specs), before
    // containerd goes: the namespaces' mounts are only known through it.
    let mut netns: Vec<String> = Vec::new();
    if running_pid(paths, "containerd").is_some() {
        let ids = ctr_lines(paths, &["containers", "list", "-q"]);
        for id in &ids {
            let info = ctr_lines(paths, &["containers", "info", id]).join("\n");
            netns.extend(netns_paths(&info));
        }
        for id in ctr_lines(paths, &["tasks", "list", "-q"]) {
            let _ = paths
                .ctr()
                .args(["tasks", "kill", "--all", "--signal", "SIGKILL", &id])
                .output();
        }
    }
    for component in COMPONENTS.iter().rev() {
        stop(paths, component);
    }
    let leftovers = shim_processes(paths);
    if !leftovers.is_empty() {
        println!(
            "cluster: killing {} leftover container processes",
            leftovers.len()
        );
        let _ = util::signal(&leftovers, "KILL");
        std::thread::sleep(Duration::from_millis(500));
    }

    // kube-proxy knows its own rules best; whatever it misses, and the CNI plugins' and the
    // kubelet's, goes next.
    if let Ok(kube) = cached_kubernetes() {
        let _ = Command::new(kube.join("kube-proxy"))
            .arg("--cleanup")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    host::remove_iptables_rules();

    netns.sort();
    netns.dedup();
    for ns in &netns {
        let path = Path::new(ns);
        if path.exists() {
            let _ = Command::new("umount").arg(path).output();
            let _ = std::fs::remove_file(path);
        }
    }
    host::remove_network();
    host::restore_sysctls(&paths.sysctls);

    for dir in [
        Path::new(KUBELET_DIR),
        &paths.root,
        &paths.run,
        Path::new(DRIVER_STATE_DIR),
    ] {
        util::cleanup(dir);
    }
    host::remove_cgroups();
    remove_container_log_links(&paths.pod_logs);
    // The node plugin attaches loop devices inside its container, where the backing file's path
    // is not the host's: find them by the backing file's inode instead.
    host::detach_loop_devices(&[
        Path::new(KUBELET_DIR),
        Path::new(DRIVER_STATE_DIR),
        &paths.root,
    ]);

    let mut failures = Vec::new();
    for dir in [
        PathBuf::from(KUBELET_DIR),
        paths.run.clone(),
        PathBuf::from(DRIVER_STATE_DIR),
    ] {
        if let Err(err) = util::remove_dir(&dir) {
            failures.push(format!("{err:#}"));
        }
    }
    if let Ok(entries) = std::fs::read_dir(&paths.root) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path == paths.logs || path == paths.images {
                continue;
            }
            let removed = if path.is_dir() {
                util::remove_dir(&path)
            } else {
                std::fs::remove_file(&path).map_err(Into::into)
            };
            if let Err(err) = removed {
                failures.push(format!("{err:#}"));
            }
        }
    }
    let rules = host::leftover_iptables_rules();
    if !rules.is_empty() {
        failures.push(format!("iptables rules remain:\n{}", rules.join("\n")));
    }
    if !failures.is_empty() {
        bail!(
            "cluster: down left something behind:\n{}",
            failures.join("\n")
        );
    }
    println!("cluster: down (logs kept in {})", paths.logs.display());
    Ok(())
}

/// The kubelet links each container's log from /var/log/containers (a fixed path): drop the
/// links into `pod_logs`.
fn remove_container_log_links(pod_logs: &Path) {
    let Ok(entries) = std::fs::read_dir("/var/log/containers") else {
        return;
    };
    for entry in entries.flatten() {
        if std::fs::read_link(entry.path()).is_ok_and(|target| target.starts_with(pod_logs)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The Kubernetes binaries if they are built; `down` never builds.
fn cached_kubernetes() -> Result<PathBuf> {
    let kube = build::go_binaries_if_cached(&build::KUBERNETES)?;
    kube.context("not built")
}

fn ctr_lines(paths: &Paths, args: &[&str]) -> Vec<String> {
    paths
        .ctr()
        .args(args)
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Network namespace paths (`/var/run/netns/cni-…`) named in a container's OCI spec.
fn netns_paths(info: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = info;
    while let Some(i) = rest.find("/netns/cni-") {
        let start = rest[..i].rfind('"').map_or(i, |q| q + 1);
        let end = rest[i..].find('"').map_or(rest.len(), |q| i + q);
        found.push(rest[start..end].to_string());
        rest = &rest[end..];
    }
    found
}

// ---------------------------------------------------------------------------------------------
// status

/// Prints which components run and, when the apiserver answers, the node and the pods.
pub fn status() -> Result<()> {
    let paths = Paths::new();
    for component in COMPONENTS {
        match running_pid(&paths, component) {
            Some(pid) => println!("{component:<24} running (pid {pid})"),
            None => println!("{component:<24} stopped"),
        }
    }
    println!("logs: {}", logs_dir().display());
    if running_pid(&paths, "kube-apiserver").is_some() && api_ready(&paths) {
        println!("kubeconfig: {}", kubeconfig().display());
        for args in [
            &["get", "nodes", "-o", "wide"][..],
            &["get", "pods", "-A", "-o", "wide"][..],
        ] {
            match kubectl_output(&paths, args) {
                Ok(out) => print!("\n{out}"),
                Err(err) => println!("\nkubectl {}: {err:#}", args.join(" ")),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn netns_from_a_spec() {
        let info = r#"{"namespaces":[{"type":"pid"},{"type":"network","path":"/var/run/netns/cni-1234-ab"}],"x":"/netns/cni-9"}"#;
        assert_eq!(
            netns_paths(info),
            vec![
                "/var/run/netns/cni-1234-ab".to_string(),
                "/netns/cni-9".to_string()
            ]
        );
    }

    #[test]
    fn own_start_time() {
        assert!(start_time(std::process::id()).is_some());
    }
}
