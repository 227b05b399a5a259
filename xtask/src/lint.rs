//! `cargo xtask lint`: the deployment's linters, all pinned in `tools::GO_TOOLS`.
//!
//! - `helm lint --strict` of `charts/ferrovol` for each backend, with the default values and with
//!   every optional part switched on (metrics, ServiceMonitors, one replica, AWS settings), so
//!   that each branch of the templates is rendered and checked against values.schema.json.
//! - kube-linter on the committed manifests in `deploy/kubernetes/<backend>/`, with
//!   `deploy/kubernetes/.kube-linter.yaml` (all built-in checks, minus the few a CSI node
//!   plugin cannot satisfy, each explained there).
//! - actionlint on `.github/workflows/*.yml`, with shellcheck on their `run:` scripts.

use crate::render::{self, BACKENDS, CHART, KUBE_VERSION, OUT_DIR};
use crate::{tools, util};
use anyhow::{Context, Result};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const KUBE_LINTER_CONFIG: &str = "deploy/kubernetes/.kube-linter.yaml";
const WORKFLOWS: &str = ".github/workflows";
const LINT_TIMEOUT: Duration = Duration::from_secs(5 * 60);

/// Values that switch on every optional template branch.
const ALL_OPTIONS: &str = "metrics.enabled=true,metrics.serviceMonitor.enabled=true,\
    controller.replicas=1,aws.region=us-east-1,aws.endpointUrl=http://127.0.0.1:5000,\
    aws.credentialsSecret=aws-credentials,aws.clusterId=prod-1,aws.defaultZone=us-east-1a,node.hostNetwork=true,storageClass.isDefault=true,\
    volumeSnapshotClass.isDefault=true,imagePullSecrets[0].name=pull,\
    controller.extraArgs[0]=--poll-initial-ms=100,controller.extraEnv[0].name=HTTPS_PROXY,\
    controller.extraEnv[0].value=http://proxy:3128,node.extraArgs[0]=--device-wait-seconds=60,\
    node.extraVolumes[0].name=extra,node.extraVolumes[0].hostPath.path=/srv/extra,\
    node.extraVolumeMounts[0].name=extra,node.extraVolumeMounts[0].mountPath=/srv/extra";

pub fn run() -> Result<()> {
    helm_lint()?;
    kube_linter()?;
    actionlint()?;
    println!("lint: helm lint, kube-linter and actionlint passed");
    Ok(())
}

fn helm_lint() -> Result<()> {
    let helm = tools::go_tool("helm")?;
    for backend in BACKENDS {
        for extra in [
            None,
            Some(ALL_OPTIONS),
            Some("snapshots.enabled=false,node.startupTaint.enabled=false"),
        ] {
            let mut cmd = render::helm_command(&helm);
            cmd.args(["lint", "--strict", CHART, "--kube-version", KUBE_VERSION])
                .args(["--set", &format!("backend={backend}")]);
            if let Some(extra) = extra {
                cmd.args(["--set", extra]);
            }
            util::run(&mut cmd, LINT_TIMEOUT)
                .with_context(|| format!("helm lint --strict (backend {backend})"))?;
        }
    }
    Ok(())
}

fn kube_linter() -> Result<()> {
    let kube_linter = tools::go_tool("kube-linter")?;
    let mut cmd = Command::new(kube_linter);
    cmd.args(["lint", "--config", KUBE_LINTER_CONFIG]);
    for backend in BACKENDS {
        cmd.arg(Path::new(OUT_DIR).join(backend));
    }
    util::run(&mut cmd, LINT_TIMEOUT).context("kube-linter on the rendered manifests")
}

fn actionlint() -> Result<()> {
    tools::lint_packages()?;
    let actionlint = tools::go_tool("actionlint")?;
    let mut files: Vec<_> = std::fs::read_dir(WORKFLOWS)
        .with_context(|| format!("reading {WORKFLOWS}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "yml" || e == "yaml"))
        .collect();
    files.sort();
    util::run(Command::new(actionlint).args(&files), LINT_TIMEOUT)
        .context("actionlint on the workflows")
}
