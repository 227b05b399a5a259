//! `cargo xtask render [--check]`: renders the Helm chart `charts/ferrovol` with `helm template`,
//! once per backend with the chart's default values, into `deploy/kubernetes/<backend>/`: one
//! file per chart template, so the manifests can be read and applied without Helm
//! (`kubectl apply -f deploy/kubernetes/local/`). The output is committed; `--check` renders
//! into memory and fails if the committed files differ (CI runs it through `cargo xtask test`).
//!
//! helm is the pinned build from `tools::GO_TOOLS`, run with a Helm home of its own so that the
//! user's repositories and plugins cannot change the output. Rendering is deterministic: the
//! chart uses no random or time functions, and helm sorts objects by kind.
//!
//! `cargo xtask helm <args>` runs that same pinned helm (the release workflow packages and
//! pushes the chart with it).

use crate::{tools, util};
use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

pub const CHART: &str = "charts/ferrovol";
pub const OUT_DIR: &str = "deploy/kubernetes";
pub const BACKENDS: &[&str] = &["local", "aws"];
/// The rendered manifests are for this release name and namespace.
const RELEASE: &str = "ferrovol";
const NAMESPACE: &str = "kube-system";
/// `.Capabilities.KubeVersion` for `helm template` and `helm lint`, whose own default (1.20) is
/// older than the chart's kubeVersion constraint.
pub const KUBE_VERSION: &str = "1.34.0";

const HELM_TIMEOUT: Duration = Duration::from_secs(2 * 60);

pub fn run(check: bool) -> Result<()> {
    let helm = tools::go_tool("helm")?;
    let mut stale = Vec::new();
    for backend in BACKENDS {
        let fresh = render(&helm, backend)?;
        let dir = Path::new(OUT_DIR).join(backend);
        if check {
            let committed = read_dir_yaml(&dir)?;
            if committed != fresh {
                stale.push(dir.display().to_string());
            }
        } else {
            install(&dir, &fresh)?;
        }
    }
    if !stale.is_empty() {
        bail!(
            "{} stale: run `cargo xtask render` and commit the result",
            stale.join(" and ")
        );
    }
    println!(
        "render: {OUT_DIR}/{{{}}} {}",
        BACKENDS.join(","),
        if check { "up to date" } else { "written" }
    );
    Ok(())
}

/// `cargo xtask helm <args>`: the pinned helm, with the caller's Helm home (registry logins).
pub fn helm_passthrough(args: &[String]) -> Result<()> {
    let helm = tools::go_tool("helm")?;
    util::run(Command::new(helm).args(args), Duration::from_secs(15 * 60))
}

/// `helm` with a Helm home below the target directory: no repositories, plugins or registry
/// credentials of the user's take part.
pub fn helm_command(helm: &Path) -> Command {
    let home = util::target_dir().join("helm-home");
    let mut cmd = Command::new(helm);
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"));
    for var in [
        "HELM_DRIVER",
        "HELM_NAMESPACE",
        "HELM_KUBECONTEXT",
        "KUBECONFIG",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// The chart rendered for `backend`: file name → contents.
fn render(helm: &Path, backend: &str) -> Result<BTreeMap<String, String>> {
    let mut cmd = helm_command(helm);
    cmd.args(["template", RELEASE, CHART, "--namespace", NAMESPACE])
        .args(["--kube-version", KUBE_VERSION])
        .args(["--set", &format!("backend={backend}")]);
    let out = capture(&mut cmd, HELM_TIMEOUT)
        .with_context(|| format!("rendering {CHART} for backend {backend}"))?;
    split(&out, backend)
}

/// Splits `helm template` output into one file per template (`# Source: ferrovol/templates/x.yaml`),
/// keeping helm's order of the objects within each file.
fn split(rendered: &str, backend: &str) -> Result<BTreeMap<String, String>> {
    let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for doc in rendered.split("\n---\n") {
        let doc = doc.trim_start_matches("---\n").trim();
        if doc.is_empty() {
            continue;
        }
        let mut lines = doc.lines();
        let source = lines
            .next()
            .and_then(|l| l.strip_prefix("# Source: "))
            .with_context(|| format!("a rendered object without a `# Source:` line:\n{doc}"))?;
        let name = Path::new(source)
            .file_name()
            .with_context(|| format!("odd source {source}"))?
            .to_string_lossy()
            .into_owned();
        let body: Vec<&str> = lines.collect();
        files
            .entry(name)
            .or_default()
            .push(body.join("\n").trim().to_string());
    }
    if files.is_empty() {
        bail!("helm template rendered nothing for backend {backend}");
    }
    Ok(files
        .into_iter()
        .map(|(name, docs)| {
            let header = format!(
                "# Generated by `cargo xtask render` from {CHART}/templates/{name}\n\
                 # (backend={backend}, release {RELEASE}, namespace {NAMESPACE}). Do not edit: change \
                 the chart and re-render.\n"
            );
            // The header belongs to the first object: a comment-only document before a `---`
            // would be an empty object to kubectl and kube-linter.
            let body: Vec<String> = docs.iter().map(|d| format!("{d}\n")).collect();
            (name, header + &body.join("---\n"))
        })
        .collect())
}

/// The `*.yaml` files of `dir` (none if it does not exist).
fn read_dir_yaml(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut files = BTreeMap::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(files),
        Err(err) => return Err(err).with_context(|| format!("reading {}", dir.display())),
    };
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            files.insert(name, text);
        }
    }
    Ok(files)
}

/// Replaces the `*.yaml` files of `dir` with `files`.
fn install(dir: &Path, files: &BTreeMap<String, String>) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for name in read_dir_yaml(dir)?.keys() {
        if !files.contains_key(name) {
            let path = dir.join(name);
            std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
    }
    for (name, text) in files {
        let path = dir.join(name);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Runs `cmd` like `util::run` and returns its standard output (kept in a file below the target
/// directory, so that a large output cannot fill a pipe and block the child).
pub fn capture(cmd: &mut Command, timeout: Duration) -> Result<String> {
    let dir = util::target_dir().join("xtask-capture");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let path: PathBuf = dir.join(format!("{}.out", std::process::id()));
    let file =
        std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
    cmd.stdout(file);
    let result = util::run(cmd, timeout)
        .and_then(|()| std::fs::read_to_string(&path).context("reading the captured output"));
    let _ = std::fs::remove_file(&path);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_by_source_in_order() {
        let out = "---\n# Source: ferrovol/templates/b.yaml\nkind: A\n---\n\
                   # Source: ferrovol/templates/a.yaml\nkind: B\n---\n\
                   # Source: ferrovol/templates/b.yaml\nkind: C\n";
        let files = split(out, "local").expect("split");
        assert_eq!(files.len(), 2);
        assert!(files["a.yaml"].ends_with("re-render.\nkind: B\n"));
        let b = &files["b.yaml"];
        assert!(b.starts_with("# Generated by `cargo xtask render`"), "{b}");
        assert!(b.ends_with("re-render.\nkind: A\n---\nkind: C\n"), "{b}");
    }

    #[test]
    fn refuses_objects_without_source() {
        assert!(split("---\nkind: A\n", "aws").is_err());
    }
}
