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
pub const GO_TOOLS: &[GoTool] = &[GoTool {
    name: "csi-sanity",
    package: "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity",
    version: "v5.4.0",
}];

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
    let mut cmd = Command::new(go);
    cmd.arg("install")
        .arg(format!("{}@{}", tool.package, tool.version))
        .env("GOBIN", &scratch)
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local")
        // Outside the repository, so that no go.mod or go.work can interfere.
        .current_dir(&tools_dir);
    let installed = util::run(&mut cmd, GO_INSTALL_TIMEOUT)
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

/// Makes sure every command of [`DEBIAN_COMMANDS`] exists, installing the missing ones' packages
/// with apt-get (which needs root).
pub fn debian_packages() -> Result<()> {
    let missing: Vec<&(&str, &str)> = DEBIAN_COMMANDS
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
fn cache_dir() -> Result<PathBuf> {
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

/// An executable named `name` in PATH, /usr/sbin, /sbin or one of `extra_dirs`.
fn find_command(name: &str, extra_dirs: &[&str]) -> Option<PathBuf> {
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
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}
