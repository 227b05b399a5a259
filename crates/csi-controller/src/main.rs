//! `csi-controller`: serves the CSI Identity and Controller services on a Unix socket.

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use cloud_backend::aws::{AwsBackend, AwsConfig};
use cloud_backend::local::{LocalBackend, LocalConfig};
use cloud_backend::sys::lock::Locks;
use csi_controller::{ControllerService, NodeInfoOnly};
use csi_identity::{IdentityService, logging, server};
use csi_proto::v1::{
    controller_server::ControllerServer, identity_server::IdentityServer, node_server::NodeServer,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Backend {
    /// Sparse files on loop devices under --state-dir, provisioned on this node.
    Local,
    /// Amazon EBS through the EC2 API.
    Aws,
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
    /// cluster. Default: local.csi.ferrovol.dev (local) or ebs.csi.ferrovol.dev (aws).
    #[arg(long, env = "FERROVOL_DRIVER_NAME")]
    driver_name: Option<String>,

    /// Name of the node this controller provisions on (local backend: volumes live here).
    #[arg(long, env = "NODE_ID")]
    node_id: Option<String>,

    /// Directory holding volume images, metadata and locks (local backend), or only locks
    /// (aws backend). The local backend's node plugin on this node must use the same one.
    #[arg(long, env = "FERROVOL_STATE_DIR", default_value = "/var/lib/ferrovol")]
    state_dir: PathBuf,

    /// aws: EC2 endpoint override (an emulator, a private cloud, a VPC endpoint).
    #[arg(long, env = "FERROVOL_AWS_ENDPOINT_URL")]
    aws_endpoint_url: Option<String>,

    /// aws: region; default from the environment (AWS_REGION) or instance metadata.
    #[arg(long, env = "FERROVOL_AWS_REGION")]
    aws_region: Option<String>,

    /// aws: value of the ferrovol.dev/cluster tag on everything this driver creates; lists only
    /// see volumes and snapshots carrying it.
    #[arg(long, env = "FERROVOL_CLUSTER_ID", default_value = "ferrovol")]
    cluster_id: String,

    /// aws: zone for volumes whose request carries no topology.
    #[arg(long, env = "FERROVOL_DEFAULT_ZONE")]
    default_zone: Option<String>,

    /// aws: coalesce concurrent DescribeVolumes/DescribeInstances lookups into shared calls.
    #[arg(long, env = "FERROVOL_BATCHING", default_value_t = true, action = clap::ArgAction::Set)]
    batching: bool,

    /// aws: first delay of the polling backoff while waiting for EC2 (milliseconds).
    #[arg(long, env = "FERROVOL_POLL_INITIAL_MS", default_value_t = 500)]
    poll_initial_ms: u64,

    /// aws: how long an expand or modify waits for company before one ModifyVolume carries
    /// them all (milliseconds). EBS allows one modification per volume every six hours, so
    /// external-resizer's expand and modify must land in the same window.
    #[arg(long, env = "FERROVOL_MODIFY_WINDOW_MS", default_value_t = 2000)]
    modify_window_ms: u64,

    /// aws: EC2 call attempts (adaptive retry of throttling and server errors).
    #[arg(long, env = "FERROVOL_AWS_MAX_ATTEMPTS", default_value_t = 10)]
    aws_max_attempts: u32,

    /// aws: seconds between background checks of the cloud API (reported in logs and
    /// metrics, never through Probe).
    #[arg(long, env = "FERROVOL_CLOUD_CHECK_SECONDS", default_value_t = 60)]
    cloud_check_seconds: u64,

    /// Serve Prometheus metrics on this address (e.g. 0.0.0.0:8080); off when unset.
    #[arg(long, env = "FERROVOL_METRICS_ADDRESS")]
    metrics_address: Option<std::net::SocketAddr>,

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
    if let Some(addr) = args.metrics_address {
        csi_identity::metrics::serve(addr)
            .await
            .with_context(|| format!("binding the metrics address {addr}"))?;
    }
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
            let node_info = NodeInfoOnly {
                node_id: node_id.clone(),
                topology: [(format!("{driver}/node"), node_id.clone())].into(),
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
                Some(node_info),
            )
            .await
        }
        Backend::Aws => {
            let driver = args
                .driver_name
                .clone()
                .unwrap_or_else(|| "ebs.csi.ferrovol.dev".into());
            let cfg = AwsConfig {
                endpoint_url: args.aws_endpoint_url.clone(),
                region: args.aws_region.clone(),
                cluster_id: args.cluster_id.clone(),
                default_zone: args.default_zone.clone(),
                batching: args.batching,
                poll_initial: Duration::from_millis(args.poll_initial_ms),
                modify_window: Duration::from_millis(args.modify_window_ms),
                max_attempts: args.aws_max_attempts.max(1),
                ..AwsConfig::default()
            };
            let backend = AwsBackend::new(cloud_backend::aws::ec2_client(&cfg).await, cfg);
            // In-flight operations are serialised per name and volume with file locks: a second
            // controller replica (or a restarted one) sharing the directory sees them too.
            let locks =
                Locks::new(args.state_dir.join("locks")).context("opening the lock directory")?;
            spawn_cloud_check(
                backend.clone(),
                Duration::from_secs(args.cloud_check_seconds.max(1)),
            );
            serve(
                &socket,
                driver,
                "aws",
                ControllerService::new(Arc::new(backend), locks),
                None,
            )
            .await
        }
    }
}

/// Checks the cloud API in the background and reports the result in logs and metrics. Probe
/// stays local: EC2 throttling or an outage must not make livenessprobe restart us in a loop.
fn spawn_cloud_check(backend: AwsBackend, every: Duration) {
    tokio::spawn(async move {
        let mut healthy = None;
        loop {
            let ok = match backend.health_check().await {
                Ok(()) => true,
                Err(e) => {
                    if healthy != Some(false) {
                        tracing::warn!(error = %e, "the EC2 API is not answering; CSI calls will fail until it does");
                    }
                    false
                }
            };
            if ok && healthy == Some(false) {
                tracing::info!("the EC2 API answers again");
            }
            healthy = Some(ok);
            cloud_backend::metrics::global().set(
                "ferrovol_cloud_healthy",
                vec![],
                if ok { 1.0 } else { 0.0 },
            );
            tokio::time::sleep(every).await;
        }
    });
}

async fn serve<B: cloud_backend::ControllerBackend>(
    socket: &std::path::Path,
    driver: String,
    backend: &str,
    controller: ControllerService<B>,
    node_info: Option<NodeInfoOnly>,
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
        .layer(csi_identity::metrics::RpcMetricsLayer)
        .add_service(health_service)
        .add_service(IdentityServer::new(identity))
        .add_service(ControllerServer::new(controller))
        .add_optional_service(node_info.map(NodeServer::new))
        .serve_with_incoming_shutdown(server::incoming(listener), server::shutdown_signal())
        .await
        .context("serving gRPC")?;
    let _ = std::fs::remove_file(socket);
    tracing::info!("csi-controller stopped");
    Ok(())
}
