//! `csi-node`: serves the CSI Identity and Node services on a Unix socket for kubelet.

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use cloud_backend::local::{LocalBackend, LocalConfig};
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
    /// local.csi.ferrovol.dev for the local backend.
    #[arg(long, env = "FERROVOL_DRIVER_NAME")]
    driver_name: Option<String>,

    /// This node's id (the Kubernetes node name).
    #[arg(long, env = "NODE_ID")]
    node_id: String,

    /// kubelet's root directory. Every staging and target path must lie strictly below it,
    /// reachable without symbolic links; anything else is refused.
    #[arg(long, env = "FERROVOL_KUBELET_DIR", default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,

    /// Directory for node records (format intents, attachments) and, with the local backend,
    /// the volumes themselves; shared with the controller on the same node.
    #[arg(long, env = "FERROVOL_STATE_DIR", default_value = "/var/lib/ferrovol")]
    state_dir: PathBuf,

    /// Maximum number of volumes this node accepts (0: no limit).
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
    if args.node_id.is_empty() {
        bail!("--node-id (or NODE_ID) must not be empty");
    }
    if args.max_volumes_per_node < 0 {
        bail!("--max-volumes-per-node must not be negative");
    }
    let socket = server::socket_path(&args.endpoint).map_err(anyhow::Error::msg)?;
    std::fs::create_dir_all(&args.kubelet_dir)
        .with_context(|| format!("creating {}", args.kubelet_dir.display()))?;
    let kubelet = KubeletDir::open(&args.kubelet_dir).context("opening the kubelet directory")?;
    let intents = Intents::new(args.state_dir.join("node/format-intents"))
        .context("opening the format intent directory")?;
    match args.backend {
        Backend::Local => {
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
            serve(&socket, driver, "local", node).await
        }
    }
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
