//! The cluster's binaries: Kubernetes, etcd and the CSI sidecars built from the pinned wrapper
//! modules in xtask/cluster/, and the pause binary. Each lands in
//! `$FERROVOL_CACHE/cluster/<name>-<version>-<hash>/`, where the hash covers the wrapper module's
//! files, so editing a wrapper builds anew while a fresh clone reuses the cache.

use crate::{tools, util};
use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct GoBuild {
    pub name: &'static str,
    /// Directory of the wrapper module, below xtask/cluster/.
    pub module: &'static str,
    pub version: &'static str,
    /// (binary, Go package): each is built with `go build -o <dir>/<binary> <package>`.
    pub binaries: &'static [(&'static str, &'static str)],
    pub ldflags: &'static str,
    /// What the first build costs, for the progress line.
    pub cold: &'static str,
}

pub const KUBERNETES_VERSION: &str = "v1.36.3";

pub const KUBERNETES: GoBuild = GoBuild {
    name: "kubernetes",
    module: "kubernetes",
    version: KUBERNETES_VERSION,
    // kubectl first: it is what `cluster::kubectl()` asks for on its own.
    binaries: &[
        ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
        ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
        (
            "kube-controller-manager",
            "k8s.io/kubernetes/cmd/kube-controller-manager",
        ),
        ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
        ("kubelet", "k8s.io/kubernetes/cmd/kubelet"),
        ("kube-proxy", "k8s.io/kubernetes/cmd/kube-proxy"),
    ],
    // Without these the binaries call themselves v0.0.0-master, which kubectl's version-skew
    // warning and the sidecars' server-version checks misread.
    ldflags: "-X k8s.io/component-base/version.gitVersion=v1.36.3 \
              -X k8s.io/component-base/version.gitMajor=1 \
              -X k8s.io/component-base/version.gitMinor=36 \
              -X k8s.io/component-base/version.gitTreeState=clean \
              -X k8s.io/client-go/pkg/version.gitVersion=v1.36.3 \
              -X k8s.io/client-go/pkg/version.gitMajor=1 \
              -X k8s.io/client-go/pkg/version.gitMinor=36",
    cold: "about 25 min on 2 cores",
};

pub const ETCD: GoBuild = GoBuild {
    name: "etcd",
    module: "etcd",
    version: "v3.6.16",
    binaries: &[("etcd", "go.etcd.io/etcd/server/v3")],
    ldflags: "",
    cold: "about 3 min on 2 cores",
};

/// The snapshot CRDs come from this module's config/crd, copied next to the binaries.
pub const SNAPSHOTTER_CLIENT: &str = "github.com/kubernetes-csi/external-snapshotter/client/v8";
pub const SNAPSHOTTER_VERSION: &str = "v8.6.0";

pub const SIDECARS: GoBuild = GoBuild {
    name: "sidecars",
    module: "sidecars",
    version: "v8.6.0",
    binaries: &[
        (
            "csi-provisioner",
            "github.com/kubernetes-csi/external-provisioner/v6/cmd/csi-provisioner",
        ),
        (
            "csi-attacher",
            "github.com/kubernetes-csi/external-attacher/v4/cmd/csi-attacher",
        ),
        (
            "csi-resizer",
            "github.com/kubernetes-csi/external-resizer/v2/cmd/csi-resizer",
        ),
        (
            "csi-snapshotter",
            "github.com/kubernetes-csi/external-snapshotter/v8/cmd/csi-snapshotter",
        ),
        (
            "snapshot-controller",
            "github.com/kubernetes-csi/external-snapshotter/v8/cmd/snapshot-controller",
        ),
        (
            "csi-node-driver-registrar",
            "ferrovol.invalid/cluster/sidecars/cmd/csi-node-driver-registrar",
        ),
        (
            "livenessprobe",
            "ferrovol.invalid/cluster/sidecars/cmd/livenessprobe",
        ),
    ],
    ldflags: "",
    cold: "about 8 min on 2 cores",
};

const GO_BUILD_TIMEOUT: Duration = Duration::from_secs(90 * 60);
const HEARTBEAT: Duration = Duration::from_secs(60);

/// `$FERROVOL_CACHE/cluster/<name>-<version>-<hash>` for `build`, and its wrapper module.
fn cache_key(build: &GoBuild) -> Result<(PathBuf, PathBuf)> {
    let module = util::repo_root().join("xtask/cluster").join(build.module);
    let key = format!("{}-{}-{}", build.name, build.version, tree_hash(&module)?);
    Ok((tools::cache_dir()?.join("cluster").join(key), module))
}

fn complete(build: &GoBuild, dir: &Path) -> bool {
    build
        .binaries
        .iter()
        .all(|(bin, _)| dir.join(bin).is_file())
        && (build.name != SIDECARS.name || dir.join("crd").is_dir())
}

/// The directory holding `build`'s binaries if the cache has them all.
pub fn go_binaries_if_cached(build: &GoBuild) -> Result<Option<PathBuf>> {
    let (dir, _) = cache_key(build)?;
    Ok(complete(build, &dir).then_some(dir))
}

/// The directory holding `build`'s binaries, building them first if the cache lacks any.
pub fn go_binaries(build: &GoBuild) -> Result<PathBuf> {
    let (dir, module) = cache_key(build)?;
    if complete(build, &dir) {
        return Ok(dir);
    }
    let parent = dir
        .parent()
        .context("cache dir has no parent")?
        .to_path_buf();
    let key = dir
        .file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into_owned();
    let go = tools::find_command("go", &["/usr/local/go/bin"]).context(
        "`go` not found in PATH nor /usr/local/go/bin: install Go 1.26 (https://go.dev/dl)",
    )?;
    let names: Vec<&str> = build.binaries.iter().map(|(bin, _)| *bin).collect();
    println!(
        "cluster: building {} {} ({}) into {}\n  first run only: {}; the output of `go build -v` goes to {}",
        build.name,
        build.version,
        names.join(", "),
        dir.display(),
        build.cold,
        parent.join(format!(".{key}.log")).display(),
    );
    // Build into a scratch directory and rename it into place, so that an interrupted build
    // never passes for a complete one.
    let scratch = parent.join(format!(".{key}.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)
        .with_context(|| format!("cannot create {}", scratch.display()))?;
    let log = parent.join(format!(".{key}.log"));
    let started = Instant::now();
    let built = (|| {
        for (bin, package) in build.binaries {
            let t = Instant::now();
            let mut cmd = Command::new(&go);
            cmd.current_dir(&module)
                // The committed go.sum pins every dependency: fail rather than resolve anew.
                .env("GOFLAGS", "-mod=readonly")
                .env("GOTOOLCHAIN", "local")
                // Static binaries: the sidecars go into images that hold nothing else.
                .env("CGO_ENABLED", "0")
                .args(["build", "-v", "-trimpath", "-ldflags"])
                .arg(format!("-s -w {}", build.ldflags))
                .arg("-o")
                .arg(scratch.join(bin))
                .arg(package);
            go_build(&mut cmd, &log, bin, started)?;
            println!("cluster:   {bin} built in {}", human(t.elapsed()),);
        }
        if build.name == SIDECARS.name {
            copy_crds(&go, &module, &scratch.join("crd"))?;
        }
        if !complete(build, &scratch) {
            bail!(
                "the build did not produce every binary in {}",
                scratch.display()
            );
        }
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove the incomplete {}", dir.display()))?;
        }
        std::fs::rename(&scratch, &dir)
            .with_context(|| format!("cannot rename {} to {}", scratch.display(), dir.display()))
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    built.with_context(|| format!("building {} {}", build.name, build.version))?;
    println!(
        "cluster: {} {} built in {}",
        build.name,
        build.version,
        human(started.elapsed())
    );
    Ok(dir)
}

/// Runs one `go build -v`, its output in `log`, printing a line every minute so that a long
/// cold build does not look hung.
fn go_build(cmd: &mut Command, log: &Path, bin: &str, started: Instant) -> Result<()> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("cannot open {}", log.display()))?;
    cmd.stdout(file.try_clone()?)
        .stderr(file)
        .stdin(Stdio::null());
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{}`", util::display(cmd)))?;
    let mut last_heartbeat = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                return Ok(());
            }
            bail!(
                "`go build` of {bin} failed ({status}); the end of {}:\n{}",
                log.display(),
                util::tail(log, 30)
            );
        }
        if started.elapsed() > GO_BUILD_TIMEOUT {
            // wait_timeout with no time left kills the build and everything it started.
            let _ = util::wait_timeout(&mut child, Duration::ZERO);
            bail!(
                "`go build` of {bin} timed out after {}",
                human(GO_BUILD_TIMEOUT)
            );
        }
        if last_heartbeat.elapsed() >= HEARTBEAT {
            last_heartbeat = Instant::now();
            // `go build -v` prints each package it compiles, one a line.
            let packages = std::fs::read_to_string(log)
                .map(|text| text.lines().count())
                .unwrap_or(0);
            println!(
                "cluster:   … still building {bin} ({} elapsed, {packages} lines of `go build -v` so far)",
                human(started.elapsed())
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Copies the snapshot CRDs (config/crd/*.yaml of the snapshotter's client module, as pinned by
/// the sidecars' go.sum) to `to`.
fn copy_crds(go: &Path, module: &Path, to: &Path) -> Result<()> {
    let out = Command::new(go)
        .current_dir(module)
        .env("GOFLAGS", "-mod=readonly")
        .env("GOTOOLCHAIN", "local")
        .args(["mod", "download", "-json"])
        .arg(format!("{SNAPSHOTTER_CLIENT}@{SNAPSHOTTER_VERSION}"))
        .output()
        .context("cannot run go mod download")?;
    let json = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "`go mod download {SNAPSHOTTER_CLIENT}@{SNAPSHOTTER_VERSION}` failed: {json}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dir = json
        .lines()
        .find_map(|l| l.trim().strip_prefix("\"Dir\": \""))
        .and_then(|l| l.strip_suffix("\","))
        .context("`go mod download -json` printed no Dir")?;
    let crd_dir = Path::new(dir).join("config/crd");
    std::fs::create_dir_all(to)?;
    let mut copied = 0;
    for entry in
        std::fs::read_dir(&crd_dir).with_context(|| format!("cannot read {}", crd_dir.display()))?
    {
        let path = entry?.path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.ends_with(".yaml") && name != "kustomization.yaml" {
            std::fs::copy(&path, to.join(&*name))
                .with_context(|| format!("cannot copy {}", path.display()))?;
            copied += 1;
        }
    }
    if copied == 0 {
        bail!("no CRD in {}", crd_dir.display());
    }
    Ok(())
}

/// The pause binary, `gcc -static` from xtask/cluster/pause/pause.c.
pub fn pause() -> Result<PathBuf> {
    let source_dir = util::repo_root().join("xtask/cluster/pause");
    let dir = tools::cache_dir()?
        .join("cluster")
        .join(format!("pause-{}", tree_hash(&source_dir)?));
    let binary = dir.join("pause");
    if binary.is_file() {
        return Ok(binary);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let scratch = dir.join(format!(".pause.{}", std::process::id()));
    util::run(
        Command::new("gcc")
            .args(["-static", "-Os", "-s", "-o"])
            .arg(&scratch)
            .arg(source_dir.join("pause.c")),
        Duration::from_secs(120),
    )
    .context("building the pause binary (Debian: gcc, libc6-dev)")?;
    std::fs::rename(&scratch, &binary)?;
    Ok(binary)
}

/// First 12 hex digits of a SHA-256 over the names and contents of the files below `dir`
/// (sorted), which keys a build in the cache.
fn tree_hash(dir: &Path) -> Result<String> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in
            std::fs::read_dir(&d).with_context(|| format!("cannot read {}", d.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                stack.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut hasher = Sha256::new();
    for file in files {
        let rel = file.strip_prefix(dir).unwrap_or(&file);
        hasher.update(rel.to_string_lossy().as_bytes());
        hasher.update([0]);
        hasher.update(
            std::fs::read(&file).with_context(|| format!("cannot read {}", file.display()))?,
        );
        hasher.update([0]);
    }
    Ok(hex::encode(hasher.finalize())[..12].to_string())
}

pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}.{}s", s, d.subsec_millis() / 100)
    }
}
