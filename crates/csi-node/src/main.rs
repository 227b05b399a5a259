//! `csi-node`: serves the CSI Identity and Node services on a Unix socket for kubelet.

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use cloud_backend::aws::{AwsNode, AwsNodeConfig, InstanceMetadata};
use cloud_backend::local::{LocalBackend, LocalConfig};
use cloud_backend::sys::lock::Locks;
use csi_identity::{IdentityService, logging, server};
use csi_node::format::Intents;
use csi_node::mounter::SysMounter;
use csi_node::paths::KubeletDir;
use csi_node::{NodeConfig, NodeService};
use csi_proto::v1::{identity_server::IdentityServer, node_server::NodeServer};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// Sparse files on loop devices under --state-dir.
    Local,
    /// Amazon EBS volumes attached by the controller, found here through their NVMe links.
    Aws,
}

/// ferrovol CSI node plugin: the Identity and Node services on a Unix socket, called by
/// kubelet and registered by node-driver-registrar. Needs CAP_SYS_ADMIN (mounts, loop devices).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// CSI endpoint to serve, a Unix socket: unix:///absolute/path.sock.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,

    /// Storage backend.
    #[arg(long, value_enum, env = "FERROVOL_BACKEND", default_value = "local")]
    backend: Backend,

    /// Driver name reported to kubelet; must match the controller's. Default:
    /// local.csi.ferrovol.dev (local) or ebs.csi.ferrovol.dev (aws).
    #[arg(long, env = "FERROVOL_DRIVER_NAME")]
    driver_name: Option<String>,

    /// This node's id: the Kubernetes node name (local) or the EC2 instance id (aws; read
    /// from instance metadata when unset).
    #[arg(long, env = "NODE_ID", default_value = "")]
    node_id: String,

    /// aws: availability zone of this instance (instance metadata when unset).
    #[arg(long, env = "FERROVOL_AVAILABILITY_ZONE")]
    availability_zone: Option<String>,

    /// aws: instance type, for the attachment limit (instance metadata when unset).
    #[arg(long, env = "FERROVOL_INSTANCE_TYPE")]
    instance_type: Option<String>,

    /// aws: attachment slots kept for the root volume and network interfaces when the
    /// limit is derived from the instance type.
    #[arg(long, env = "FERROVOL_RESERVED_ATTACHMENTS")]
    reserved_attachments: Option<i64>,

    /// aws: where udev keeps /dev/disk/by-id links (a test hypervisor can stand in).
    #[arg(long, env = "FERROVOL_BY_ID_DIR", default_value = "/dev/disk/by-id")]
    by_id_dir: PathBuf,

    /// aws: the sysfs root, where device serials are read.
    #[arg(long, env = "FERROVOL_SYS_ROOT", default_value = "/sys")]
    sys_root: PathBuf,

    /// aws: seconds NodeStage waits for an attached volume's device to appear.
    #[arg(long, env = "FERROVOL_DEVICE_WAIT_SECONDS", default_value_t = 30)]
    device_wait_seconds: u64,

    /// Remove this taint from the Node once kubelet lists the driver in its CSINode (e.g.
    /// local.csi.ferrovol.dev/agent-not-ready), so pods needing a volume wait for the plugin.
    /// Needs --kube-node-name and RBAC get on csinodes, get/patch on nodes.
    #[arg(long, env = "FERROVOL_STARTUP_TAINT")]
    remove_taint: Option<String>,

    /// This node's Kubernetes name (the downward API's spec.nodeName), for the startup taint
    /// and, with aws, the identity fallback from the Node object when instance metadata is
    /// unreachable.
    #[arg(long, env = "NODE_NAME")]
    kube_node_name: Option<String>,

    /// Serve Prometheus metrics on this address (e.g. 0.0.0.0:8081); off when unset.
    #[arg(long, env = "FERROVOL_METRICS_ADDRESS")]
    metrics_address: Option<std::net::SocketAddr>,

    /// kubelet's root directory. Every staging and target path must lie strictly below it,
    /// reachable without symbolic links; anything else is refused.
    #[arg(long, env = "FERROVOL_KUBELET_DIR", default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,

    /// Directory for node records (format intents, attachments) and, with the local backend,
    /// the volumes themselves; shared with the controller on the same node.
    #[arg(long, env = "FERROVOL_STATE_DIR", default_value = "/var/lib/ferrovol")]
    state_dir: PathBuf,

    /// Maximum number of volumes this node accepts (0: no limit for local; derived from the
    /// instance type for aws).
    #[arg(long, env = "FERROVOL_MAX_VOLUMES", default_value_t = 0)]
    max_volumes_per_node: i64,

    /// Log format: text or json.
    #[arg(long, env = "FERROVOL_LOG_FORMAT", default_value = "text")]
    log_format: logging::Format,

    /// Log level or tracing filter (e.g. info, debug, csi_node=trace); RUST_LOG wins.
    #[arg(long, env = "FERROVOL_LOG_LEVEL", default_value = "info")]
    log_level: String,
}

fn main() -> Result<()> {
    let args = Args::parse();
    logging::init(args.log_format, &args.log_level);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(16)
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(run(args))
}

async fn run(args: Args) -> Result<()> {
    if args.max_volumes_per_node < 0 {
        bail!("--max-volumes-per-node must not be negative");
    }
    let socket = server::socket_path(&args.endpoint).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&args.kubelet_dir)
        .with_context(|| format!("creating {}", args.kubelet_dir.display()))?;
    let kubelet = KubeletDir::open(&args.kubelet_dir).context("opening the kubelet directory")?;
    let intents = Intents::new(args.state_dir.join("node/format-intents"))
        .context("opening the format intent directory")?;
    if let Some(addr) = args.metrics_address {
        csi_identity::metrics::serve(addr)
            .await
            .with_context(|| format!("binding the metrics address {addr}"))?;
    }
    match args.backend {
        Backend::Local => {
            if args.node_id.is_empty() {
                bail!("--node-id (or NODE_ID) must not be empty with the local backend");
            }
            let driver = args
                .driver_name
                .clone()
                .unwrap_or_else(|| "local.csi.ferrovol.dev".into());
            let topology_key = format!("{driver}/node");
            let backend = LocalBackend::new(LocalConfig {
                state_dir: args.state_dir.clone(),
                node_id: args.node_id.clone(),
                topology_key: topology_key.clone(),
            })
            .context("opening the local backend's state directory")?;
            // A controller killed in the middle of a snapshot copy leaves the filesystem it froze
            // frozen, and with it every pod writing to it. Whichever plugin starts first thaws it.
            cloud_backend::sys::copy::thaw_leftovers(&args.state_dir.join("frozen"))
                .context("thawing filesystems left frozen")?;
            let locks = backend.locks().clone();
            let cfg = NodeConfig {
                node_id: args.node_id.clone(),
                max_volumes_per_node: args.max_volumes_per_node,
                topology: BTreeMap::from([(topology_key, args.node_id.clone())]),
                multi_node: false,
            };
            let node = NodeService::new(backend, SysMounter, kubelet, locks, intents, cfg);
            spawn_taint_removal(&args, &driver)?;
            serve(&socket, driver, "local", node).await
        }
        Backend::Aws => {
            let driver = args
                .driver_name
                .clone()
                .unwrap_or_else(|| "ebs.csi.ferrovol.dev".into());
            let meta = aws_identity(&args).await?;
            let max_volumes = if args.max_volumes_per_node > 0 {
                args.max_volumes_per_node
            } else {
                // Nitro slots are shared with network interfaces; one more for the root volume.
                let reserved = args
                    .reserved_attachments
                    .unwrap_or(1 + meta.interfaces as i64);
                (cloud_backend::aws::instance_limits(&meta.instance_type) - reserved).max(1)
            };
            let backend = AwsNode::new(AwsNodeConfig {
                by_id_dir: args.by_id_dir.clone(),
                sys_root: args.sys_root.clone(),
                device_wait: std::time::Duration::from_secs(args.device_wait_seconds),
            });
            let locks =
                Locks::new(args.state_dir.join("locks")).context("opening the lock directory")?;
            let cfg = NodeConfig {
                node_id: meta.instance_id.clone(),
                max_volumes_per_node: max_volumes,
                topology: BTreeMap::from([(
                    cloud_backend::aws::ZONE_KEY.to_string(),
                    meta.zone.clone(),
                )]),
                multi_node: false,
            };
            tracing::info!(instance = %meta.instance_id, zone = %meta.zone, instance_type = %meta.instance_type, max_volumes, "node identity");
            let node = NodeService::new(backend, SysMounter, kubelet, locks, intents, cfg);
            spawn_taint_removal(&args, &driver)?;
            serve(&socket, driver, "aws", node).await
        }
    }
}

/// Starts removing the startup taint in the background, when asked to.
fn spawn_taint_removal(args: &Args, driver: &str) -> Result<()> {
    let Some(key) = args.remove_taint.clone().filter(|k| !k.is_empty()) else {
        return Ok(());
    };
    let Some(node) = args.kube_node_name.clone().filter(|n| !n.is_empty()) else {
        bail!("--remove-taint needs --kube-node-name (or NODE_NAME from the downward API)");
    };
    tokio::spawn(csi_node::kube::remove_startup_taint(
        node,
        driver.to_string(),
        key,
    ));
    Ok(())
}

/// The instance's identity: flags first, then instance metadata (IMDSv2) for what is missing.
async fn aws_identity(args: &Args) -> Result<InstanceMetadata> {
    let mut meta = InstanceMetadata {
        instance_id: args.node_id.clone(),
        zone: args.availability_zone.clone().unwrap_or_default(),
        instance_type: args.instance_type.clone().unwrap_or_default(),
        interfaces: 1,
    };
    if meta.instance_id.is_empty() || meta.zone.is_empty() || meta.instance_type.is_empty() {
        match cloud_backend::aws::instance_metadata().await {
            Ok(imds) => {
                for (mine, theirs) in [
                    (&mut meta.instance_id, imds.instance_id),
                    (&mut meta.zone, imds.zone),
                    (&mut meta.instance_type, imds.instance_type),
                ] {
                    if mine.is_empty() {
                        *mine = theirs;
                    }
                }
                meta.interfaces = imds.interfaces;
            }
            Err(e) if meta.instance_id.is_empty() || meta.zone.is_empty() => {
                let Some(node) = args.kube_node_name.as_deref() else {
                    bail!(
                        "cannot tell which instance this is: {e}; pass --node-id and --availability-zone (or NODE_ID and FERROVOL_AVAILABILITY_ZONE)"
                    );
                };
                tracing::warn!(error = %e, "instance metadata unreachable; reading the identity from the Node object");
                let (id, zone, itype) = csi_node::kube::aws_identity_from_node(node)
                    .await
                    .with_context(|| format!("instance metadata is unreachable ({e}) and so is the identity of Node {node}"))?;
                for (mine, theirs) in [
                    (&mut meta.instance_id, id),
                    (&mut meta.zone, zone),
                    (&mut meta.instance_type, itype),
                ] {
                    if mine.is_empty() {
                        *mine = theirs;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "instance metadata unreachable; using the flags given")
            }
        }
    }
    if !cloud_backend::aws::is_instance_id(&meta.instance_id) {
        bail!(
            "node id {:?} is not an EC2 instance id (i-…)",
            meta.instance_id
        );
    }
    Ok(meta)
}

async fn serve<B: cloud_backend::NodeBackend>(
    socket: &std::path::Path,
    driver: String,
    backend: &str,
    node: NodeService<B, SysMounter>,
) -> Result<()> {
    let identity = IdentityService::new(
        driver.clone(),
        [("backend".to_string(), backend.to_string())].into(),
        csi_identity::plugin_capabilities(true),
        Arc::new(|| true),
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<NodeServer<NodeService<B, SysMounter>>>()
        .await;
    let listener = server::bind(socket)
        .await
        .with_context(|| format!("binding {}", socket.display()))?;
    tracing::info!(driver = %driver, backend, endpoint = %socket.display(), "csi-node serving");
    tonic::transport::Server::builder()
        .layer(csi_identity::metrics::RpcMetricsLayer)
        .add_service(health_service)
        .add_service(IdentityServer::new(identity))
        .add_service(NodeServer::new(node))
        .serve_with_incoming_shutdown(server::incoming(listener), server::shutdown_signal())
        .await
        .context("serving gRPC")?;
    let _ = std::fs::remove_file(socket);
    tracing::info!("csi-node stopped");
    Ok(())
}
