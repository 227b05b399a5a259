//! What the tests are told by `cargo xtask e2e`, through the environment.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Backend {
    Local,
    Aws,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Local => "local",
            Backend::Aws => "aws",
        })
    }
}

pub struct Config {
    pub backend: Backend,
    /// The chart's driver name for the backend.
    pub driver: String,
    pub storage_class: String,
    pub snapshot_class: String,
    /// The chart's StorageClass fsType.
    pub fs_type: String,
    /// kubectl, for the server-side dry run of the rendered manifests.
    pub kubectl: Option<PathBuf>,
    /// `deploy/kubernetes` of the repository.
    pub manifests: PathBuf,
    /// The node's state directory (the chart's node.stateDir), seen from the host.
    pub state_dir: PathBuf,
    /// kubelet's root directory on the node.
    pub kubelet_dir: PathBuf,
    /// aws: moto's endpoint, reachable from here.
    pub moto: Option<String>,
    /// aws: the hypervisor stand-in's root (its disks, by-id links and sysfs).
    pub hypervisor_root: Option<PathBuf>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Config {
    /// - `FERROVOL_E2E_BACKEND`: `local` or `aws` (required)
    /// - `KUBECONFIG`: the cluster (required; kube-rs reads it)
    /// - `FERROVOL_E2E_DRIVER`, `FERROVOL_E2E_STORAGE_CLASS`, `FERROVOL_E2E_SNAPSHOT_CLASS`,
    ///   `FERROVOL_E2E_FS_TYPE`: default to the chart's defaults
    /// - `FERROVOL_E2E_KUBECTL`: kubectl (default: `kubectl` in PATH)
    /// - `FERROVOL_E2E_STATE_DIR` (default /var/lib/ferrovol), `FERROVOL_E2E_KUBELET_DIR`
    ///   (default /var/lib/kubelet)
    /// - aws: `FERROVOL_E2E_MOTO` (endpoint URL) and `FERROVOL_E2E_HYPERVISOR_ROOT` (required)
    pub fn from_env() -> Result<Config> {
        let backend = match var("FERROVOL_E2E_BACKEND").as_deref() {
            Some("local") => Backend::Local,
            Some("aws") => Backend::Aws,
            other => bail!(
                "FERROVOL_E2E_BACKEND must be local or aws (got {other:?}); run the tests with \
                 `cargo xtask e2e`, which installs the driver and sets it"
            ),
        };
        if var("KUBECONFIG").is_none() {
            bail!("KUBECONFIG is not set: run the tests with `cargo xtask e2e`");
        }
        let default_driver = match backend {
            Backend::Local => "local.csi.ferrovol.dev",
            Backend::Aws => "ebs.csi.ferrovol.dev",
        };
        let (moto, hypervisor_root) = match backend {
            Backend::Local => (None, None),
            Backend::Aws => (
                Some(var("FERROVOL_E2E_MOTO").context("FERROVOL_E2E_MOTO is required for aws")?),
                Some(PathBuf::from(var("FERROVOL_E2E_HYPERVISOR_ROOT").context(
                    "FERROVOL_E2E_HYPERVISOR_ROOT is required for aws",
                )?)),
            ),
        };
        Ok(Config {
            backend,
            driver: var("FERROVOL_E2E_DRIVER").unwrap_or_else(|| default_driver.into()),
            storage_class: var("FERROVOL_E2E_STORAGE_CLASS").unwrap_or_else(|| "ferrovol".into()),
            snapshot_class: var("FERROVOL_E2E_SNAPSHOT_CLASS").unwrap_or_else(|| "ferrovol".into()),
            fs_type: var("FERROVOL_E2E_FS_TYPE").unwrap_or_else(|| "ext4".into()),
            kubectl: var("FERROVOL_E2E_KUBECTL").map(PathBuf::from),
            manifests: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes"),
            state_dir: PathBuf::from(
                var("FERROVOL_E2E_STATE_DIR").unwrap_or_else(|| "/var/lib/ferrovol".into()),
            ),
            kubelet_dir: PathBuf::from(
                var("FERROVOL_E2E_KUBELET_DIR").unwrap_or_else(|| "/var/lib/kubelet".into()),
            ),
            moto,
            hypervisor_root,
        })
    }
}

/// Shared by every case.
pub struct Ctx {
    pub cfg: Config,
    pub client: kube::Client,
    /// Loop devices that existed before any case ran: the cleanup check ignores them.
    pub loops_before: Vec<crate::host::LoopDevice>,
}

impl Ctx {
    pub async fn new() -> Result<Ctx> {
        let cfg = Config::from_env()?;
        let client = kube::Client::try_default()
            .await
            .context("connecting to the cluster of $KUBECONFIG")?;
        let version = client
            .apiserver_version()
            .await
            .context("asking the API server for its version")?;
        println!("e2e: API server {}", version.git_version);
        Ok(Ctx {
            cfg,
            client,
            loops_before: crate::host::loop_devices(),
        })
    }
}
