//! `csi-controller`: serves the CSI Identity and Controller services on a Unix socket.

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use cloud_backend::local::{LocalBackend, LocalConfig};
use csi_controller::ControllerService;
use csi_identity::{IdentityService, logging, server};
use csi_proto::v1::{controller_server::ControllerServer, identity_server::IdentityServer};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// Sparse files on loop devices under --state-dir, provisioned on this node.
    Local,
}

/// ferrovol CSI controller plugin: the Identity and Controller services on a Unix socket,
/// called by external-provisioner, -attacher, -resizer, -snapshotter and livenessprobe.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// CSI endpoint to serve, a Unix socket: unix:///absolute/path.sock.
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    endpoint: String,

    /// Storage backend.
    #[arg(long, value_enum, env = "FERROVOL_BACKEND", default_value = "local")]
    backend: Backend,

    /// Driver name reported to Kubernetes; part of every PV, so never change it on a live
    /// cluster. Default: local.csi.ferrovol.dev for the local backend.
    #[arg(long, env = "FERROVOL_DRIVER_NAME")]
    driver_name: Option<String>,

    /// Name of the node this controller provisions on (local backend: volumes live here).
    #[arg(long, env = "NODE_ID")]
    node_id: Option<String>,

    /// Directory holding volume images, metadata and locks (local backend). Must be the same
    /// directory the node plugin on this node uses.
    #[arg(long, env = "FERROVOL_STATE_DIR", default_value = "/var/lib/ferrovol")]
    state_dir: PathBuf,

    /// Log format: text or json.
    #[arg(long, env = "FERROVOL_LOG_FORMAT", default_value = "text")]
    log_format: logging::Format,

    /// Log level or tracing filter (e.g. info, debug, csi_controller=trace); RUST_LOG wins.
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
    let socket = server::socket_path(&args.endpoint).map_err(anyhow::Error::msg)?;
    match args.backend {
        Backend::Local => {
            let driver = args
                .driver_name
                .clone()
                .unwrap_or_else(|| "local.csi.ferrovol.dev".into());
            let Some(node_id) = args.node_id.clone().filter(|n| !n.is_empty()) else {
                bail!(
                    "--node-id (or NODE_ID) is required with the local backend: volumes are created on this node"
                );
            };
            let backend = LocalBackend::new(LocalConfig {
                state_dir: args.state_dir.clone(),
                node_id,
                topology_key: format!("{driver}/node"),
            })
            .context("opening the local backend's state directory")?;
            backend
                .recover()
                .context("repairing state left by an earlier run")?;
            let locks = backend.locks().clone();
            serve(
                &socket,
                driver,
                "local",
                ControllerService::new(Arc::new(backend), locks),
            )
            .await
        }
    }
}

async fn serve<B: cloud_backend::ControllerBackend>(
    socket: &std::path::Path,
    driver: String,
    backend: &str,
    controller: ControllerService<B>,
) -> Result<()> {
    let identity = IdentityService::new(
        driver.clone(),
        [("backend".to_string(), backend.to_string())].into(),
        csi_identity::plugin_capabilities(true),
        Arc::new(|| true),
    );
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<ControllerServer<ControllerService<B>>>()
        .await;
    let listener = server::bind(socket)
        .await
        .with_context(|| format!("binding {}", socket.display()))?;
    tracing::info!(driver = %driver, backend, endpoint = %socket.display(), "csi-controller serving");
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(IdentityServer::new(identity))
        .add_service(ControllerServer::new(controller))
        .serve_with_incoming_shutdown(server::incoming(listener), server::shutdown_signal())
        .await
        .context("serving gRPC")?;
    let _ = std::fs::remove_file(socket);
    tracing::info!("csi-controller stopped");
    Ok(())
}
