//! Installs what a fresh Debian 12 machine lacks for the tests: the file-system and block-device
//! commands the driver runs (from Debian packages), and pinned Go tools such as csi-sanity, built
//! once per version into a cache outside the clone (`$FERROVOL_CACHE`, else
//! `$HOME/.cache/ferrovol`) so that `git clean` or a fresh clone does not rebuild them.

use crate::util;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A Go tool installed with `go install <package>@<version>`.
pub struct GoTool {
    pub name: &'static str,
    pub package: &'static str,
    pub version: &'static str,
}

/// Pinned tool versions. Bumping a version installs the new one next to the old in the cache.
pub const GO_TOOLS: &[GoTool] = &[
    GoTool {
        name: "csi-sanity",
        package: "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity",
        version: "v5.4.0",
    },
    // `cargo xtask render` and `lint`: the chart, its rendered manifests and the workflows.
    GoTool {
        name: "helm",
        package: "helm.sh/helm/v3/cmd/helm",
        version: "v3.21.4",
    },
    GoTool {
        name: "kube-linter",
        package: "golang.stackrox.io/kube-linter/cmd/kube-linter",
        version: "v0.8.3",
    },
    GoTool {
        name: "actionlint",
        package: "github.com/rhysd/actionlint/cmd/actionlint",
        version: "v1.7.12",
    },
];

/// Modules the Go module proxy serves only under another path (their repository's), while
/// their go.mod declares the vanity path: `go install` cannot fetch them, so they are built in
/// a throwaway wrapper module that requires the vanity path and replaces it with the source.
const GO_MODULE_SOURCES: &[(&str, &str)] = &[(
    "golang.stackrox.io/kube-linter",
    "github.com/stackrox/kube-linter",
)];

/// Commands the driver and its tests run, and the Debian 12 package providing each.
pub const DEBIAN_COMMANDS: &[(&str, &str)] = &[
    ("mkfs.ext4", "e2fsprogs"),
    ("resize2fs", "e2fsprogs"),
    ("e2fsck", "e2fsprogs"),
    ("mkfs.xfs", "xfsprogs"),
    ("xfs_growfs", "xfsprogs"),
    ("blkid", "util-linux"),
    ("losetup", "mount"),
    ("unshare", "util-linux"),
    ("flock", "util-linux"),
    ("sfdisk", "fdisk"),
    ("df", "coreutils"),
];

/// Commands `cargo xtask images --test` runs, and the Debian 12 package providing each: podman
/// loads and runs the images with runc, skopeo inspects the archives, and a throwaway containerd
/// imports and runs them as a Kubernetes node would.
pub const IMAGE_TEST_COMMANDS: &[(&str, &str)] = &[
    ("podman", "podman"),
    ("runc", "runc"),
    ("skopeo", "skopeo"),
    ("containerd", "containerd"),
    ("ctr", "containerd"),
];

/// Commands `cargo xtask cluster` runs, and the Debian 12 package providing each: the container
/// runtime, the CNI plugins (Debian installs them in /usr/lib/cni, checked by
/// [`cluster_packages`]), what kube-proxy and the kubelet call, the workload image's busybox,
/// and openssl for the cluster's certificates.
pub const CLUSTER_COMMANDS: &[(&str, &str)] = &[
    ("containerd", "containerd"),
    ("ctr", "containerd"),
    ("runc", "runc"),
    ("iptables", "iptables"),
    ("iptables-save", "iptables"),
    ("iptables-restore", "iptables"),
    ("conntrack", "conntrack"),
    ("ip", "iproute2"),
    ("busybox", "busybox-static"),
    ("openssl", "openssl"),
    ("socat", "socat"),
    ("nsenter", "util-linux"),
    ("losetup", "mount"),
    ("gcc", "gcc"),
];

/// Commands `cargo xtask lint` runs besides the Go tools: actionlint checks the workflows'
/// `run:` scripts with shellcheck.
pub const LINT_COMMANDS: &[(&str, &str)] = &[("shellcheck", "shellcheck")];

const GO_INSTALL_TIMEOUT: Duration = Duration::from_secs(15 * 60);
const APT_UPDATE_TIMEOUT: Duration = Duration::from_secs(5 * 60);
const APT_INSTALL_TIMEOUT: Duration = Duration::from_secs(15 * 60);

pub fn csi_sanity() -> Result<PathBuf> {
    go_tool("csi-sanity")
}

/// Path of the pinned build of the Go tool `name`, installing it on first use.
pub fn go_tool(name: &str) -> Result<PathBuf> {
    let tool = GO_TOOLS
        .iter()
        .find(|t| t.name == name)
        .with_context(|| format!("{name} is not in tools::GO_TOOLS"))?;
    let tools_dir = cache_dir()?.join("tools");
    let dir = tools_dir.join(format!("{}-{}", tool.name, tool.version));
    let binary = dir.join(tool.name);
    if binary.is_file() {
        return Ok(binary);
    }

    let go = find_command("go", &["/usr/local/go/bin"]).with_context(|| {
        format!(
            "`go` not found in PATH nor /usr/local/go/bin: install Go (https://go.dev/dl) so that \
             {} {} can be built, or put a {} binary at {}",
            tool.name,
            tool.version,
            tool.name,
            binary.display()
        )
    })?;
    println!(
        "tools: installing {} {} into {} (first run only, this takes a few minutes)",
        tool.name,
        tool.version,
        dir.display()
    );
    // Build into a scratch directory and rename it into place, so that an interrupted build
    // never passes for an installed tool.
    let scratch = tools_dir.join(format!(
        ".{}-{}.{}",
        tool.name,
        tool.version,
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)
        .with_context(|| format!("cannot create {}", scratch.display()))?;
    let installed = build_go_tool(&go, tool, &scratch, &tools_dir)
        .with_context(|| format!("installing {} {}", tool.name, tool.version))
        .and_then(|()| {
            if !scratch.join(tool.name).is_file() {
                bail!(
                    "`go install` did not produce {}",
                    scratch.join(tool.name).display()
                );
            }
            // A directory without the binary is a leftover: replace it.
            if dir.exists() && !binary.is_file() {
                let _ = std::fs::remove_dir_all(&dir);
            }
            match std::fs::rename(&scratch, &dir) {
                // A concurrent run may have installed it meanwhile.
                Err(_) if binary.is_file() => Ok(()),
                other => other.with_context(|| format!("cannot create {}", dir.display())),
            }
        });
    let _ = std::fs::remove_dir_all(&scratch);
    installed?;
    println!("tools: installed {}", binary.display());
    Ok(binary)
}

/// `go install`s `tool` into `scratch`, or for a module of [`GO_MODULE_SOURCES`] builds it there
/// in a wrapper module (itself in `scratch`, removed afterwards).
fn build_go_tool(go: &Path, tool: &GoTool, scratch: &Path, tools_dir: &Path) -> Result<()> {
    let go_cmd = |dir: &Path| {
        let mut cmd = Command::new(go);
        cmd.env("GOFLAGS", "-mod=mod")
            .env("GOTOOLCHAIN", "local")
            .current_dir(dir);
        cmd
    };
    let Some((module, source)) = GO_MODULE_SOURCES
        .iter()
        .find(|(module, _)| tool.package.starts_with(&format!("{module}/")))
    else {
        // Outside the repository, so that no go.mod or go.work can interfere.
        let mut cmd = go_cmd(tools_dir);
        cmd.arg("install")
            .arg(format!("{}@{}", tool.package, tool.version))
            .env("GOBIN", scratch);
        return util::run(&mut cmd, GO_INSTALL_TIMEOUT);
    };
    let wrapper = scratch.join("wrapper");
    std::fs::create_dir_all(&wrapper)
        .with_context(|| format!("cannot create {}", wrapper.display()))?;
    let v = tool.version;
    util::run(
        go_cmd(&wrapper).args(["mod", "init", "ferrovol.invalid/tool-wrapper"]),
        GO_INSTALL_TIMEOUT,
    )?;
    util::run(
        go_cmd(&wrapper).args([
            "mod",
            "edit",
            &format!("-require={module}@{v}"),
            &format!("-replace={module}@{v}={source}@{v}"),
        ]),
        GO_INSTALL_TIMEOUT,
    )?;
    let built = util::run(
        go_cmd(&wrapper)
            .arg("build")
            .arg("-o")
            .arg(scratch.join(tool.name))
            .arg(tool.package),
        GO_INSTALL_TIMEOUT,
    );
    let _ = std::fs::remove_dir_all(&wrapper);
    built
}

/// Makes sure every command of [`DEBIAN_COMMANDS`] exists, installing the missing ones' packages
/// with apt-get (which needs root).
pub fn debian_packages() -> Result<()> {
    install_missing(DEBIAN_COMMANDS)
}

/// [`debian_packages`] for [`IMAGE_TEST_COMMANDS`].
pub fn image_test_packages() -> Result<()> {
    install_missing(IMAGE_TEST_COMMANDS)
}

/// [`debian_packages`] for [`LINT_COMMANDS`].
pub fn lint_packages() -> Result<()> {
    install_missing(LINT_COMMANDS)
}

/// [`debian_packages`] for [`CLUSTER_COMMANDS`], plus the CNI plugins, which are no commands in
/// PATH.
pub fn cluster_packages() -> Result<()> {
    install_missing(CLUSTER_COMMANDS)?;
    if !Path::new(CNI_BIN_DIR).join("bridge").is_file() {
        install_missing(&[("/usr/lib/cni/bridge", "containernetworking-plugins")])?;
    }
    Ok(())
}

/// Where Debian's containernetworking-plugins puts the plugins.
pub const CNI_BIN_DIR: &str = "/usr/lib/cni";

fn install_missing(table: &[(&str, &str)]) -> Result<()> {
    let missing: Vec<&(&str, &str)> = table
        .iter()
        .filter(|(cmd, _)| find_command(cmd, &[]).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let commands: Vec<&str> = missing.iter().map(|(cmd, _)| *cmd).collect();
    let mut packages: Vec<&str> = missing.iter().map(|(_, pkg)| *pkg).collect();
    packages.sort_unstable();
    packages.dedup();
    let what = format!(
        "missing commands: {}; Debian packages to install: {}",
        commands.join(" "),
        packages.join(" ")
    );
    if find_command("apt-get", &[]).is_none() {
        bail!("{what}; apt-get is not available, install them with your package manager");
    }
    if !is_root() {
        bail!(
            "{what}; run as root or `sudo apt-get install {}`",
            packages.join(" ")
        );
    }
    println!("tools: {what}");
    util::run(
        Command::new("apt-get").args(["update", "-qq"]),
        APT_UPDATE_TIMEOUT,
    )
    .context("apt-get update")?;
    util::run(
        Command::new("apt-get")
            .args(["install", "-y", "-qq"])
            .args(&packages)
            .env("DEBIAN_FRONTEND", "noninteractive"),
        APT_INSTALL_TIMEOUT,
    )
    .context("apt-get install")?;
    let still: Vec<&str> = commands
        .iter()
        .copied()
        .filter(|cmd| find_command(cmd, &[]).is_none())
        .collect();
    if !still.is_empty() {
        bail!(
            "installed {} but still missing: {}",
            packages.join(" "),
            still.join(" ")
        );
    }
    Ok(())
}

/// `$FERROVOL_CACHE`, else `$HOME/.cache/ferrovol`, as an absolute path.
pub fn cache_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("FERROVOL_CACHE").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME")
                .filter(|h| !h.is_empty())
                .context("neither FERROVOL_CACHE nor HOME is set: cannot place the tool cache")?;
            Path::new(&home).join(".cache").join("ferrovol")
        }
    };
    Ok(if dir.is_absolute() {
        dir
    } else {
        std::env::current_dir()?.join(dir)
    })
}

/// An executable named `name` in PATH, /usr/sbin, /sbin or one of `extra_dirs` (`name` may also be
/// an absolute path).
pub fn find_command(name: &str, extra_dirs: &[&str]) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(
            ["/usr/sbin", "/sbin"]
                .iter()
                .chain(extra_dirs)
                .map(PathBuf::from),
        )
        .map(|dir| dir.join(name))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// Effective uid 0, read from /proc/self/status (`Uid: real effective saved fs`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// The moto EC2 emulator the aws backend's tests run against, pinned.
pub const MOTO_VERSION: &str = "5.2.5";

/// Path of `moto_server` from a virtualenv of its own in the cache (keyed by version), made on
/// first use with the machine's python3.
pub fn moto() -> Result<PathBuf> {
    let venv = cache_dir()?.join(format!("moto-{MOTO_VERSION}"));
    let server = venv.join("bin/moto_server");
    if server.is_file() {
        return Ok(server);
    }
    let python = find_command("python3", &[])
        .context("python3 is needed for the moto EC2 emulator (Debian: python3, python3-venv)")?;
    println!(
        "installing moto[server]=={MOTO_VERSION} into {} (once per version)",
        venv.display()
    );
    let _ = std::fs::remove_dir_all(&venv);
    crate::util::run(
        Command::new(&python).args(["-m", "venv"]).arg(&venv),
        Duration::from_secs(5 * 60),
    )
    .context("creating the moto virtualenv (on Debian: apt-get install python3-venv)")?;
    crate::util::run(
        Command::new(venv.join("bin/pip")).args([
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("moto[server]=={MOTO_VERSION}"),
        ]),
        GO_INSTALL_TIMEOUT,
    )
    .context("installing moto from PyPI")?;
    if !server.is_file() {
        bail!("moto installed but {} is missing", server.display());
    }
    Ok(server)
}
