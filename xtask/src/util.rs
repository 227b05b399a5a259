/// The one build profile tests, csi-sanity, the demo, the benchmark and the images share, so a
/// cold CI run compiles the workspace (aws-sdk-ec2 above all) once, not once per purpose.
pub const PROFILE: &str = "release";

/// Bound of a release build of the workspace. A cold one (aws-sdk-ec2 and LTO links) takes
/// 20-odd minutes on 2 cores, much longer when the machine is shared; the bound only catches a
/// hang.
pub const BUILD_TIMEOUT: Duration = Duration::from_secs(50 * 60);

use anyhow::{Context, Result, bail};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// Every task works relative to the repository root, which is the parent of this crate.
pub fn enter_repo_root() -> Result<()> {
    let root = repo_root();
    std::env::set_current_dir(&root).with_context(|| format!("cannot enter {}", root.display()))
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the repository root")
        .to_path_buf()
}

pub fn flag(args: &[String], name: &str) -> bool {
    args.iter().any(|a| a == name)
}

/// Cargo's target directory as an absolute path (`CARGO_TARGET_DIR` is honoured).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => repo_root().join(dir),
        _ => repo_root().join("target"),
    }
}

/// The cargo that runs this xtask (`cargo run` sets `CARGO`), so nested builds use the same
/// toolchain.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    forget_cargo_run_env(&mut cmd);
    cmd
}

/// Drops what `cargo run` set for xtask itself from a child's environment. ring's build script
/// declares `rerun-if-env-changed` on CARGO_MANIFEST_DIR and CARGO_PKG_*, so a nested cargo that
/// inherited xtask's values and a cargo started by hand would each find the other's ring stale,
/// and rebuild it and everything above it (aws-sdk-ec2: twenty minutes) on every switch.
fn forget_cargo_run_env(cmd: &mut Command) {
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(is_cargo_run_var) {
            cmd.env_remove(name);
        }
    }
}

fn is_cargo_run_var(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
        )
}

/// `unshare --mount --propagation private -- <program>`: the program and everything it starts run
/// in a private mount namespace, so no mount it makes can reach the host, and every such mount
/// disappears when the last process of the namespace exits. `$FERROVOL_HOST_MNT_NS` tells the
/// children which namespace they must not be in (see [`in_private_mount_namespace`]).
pub fn unshare(program: impl AsRef<OsStr>) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--"])
        .arg(program);
    // The program is often cargo itself (see `cargo`).
    forget_cargo_run_env(&mut cmd);
    if let Some(ns) = mount_namespace() {
        cmd.env(HOST_MNT_NS_VAR, ns);
    }
    cmd
}

/// `PATH` with /usr/sbin and /sbin appended when missing: the driver runs mkfs, blkid and
/// losetup, which Debian installs there.
pub fn path_with_sbin() -> OsString {
    let current = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs: Vec<PathBuf> = std::env::split_paths(&current).collect();
    for extra in ["/usr/sbin", "/sbin"] {
        if !dirs.iter().any(|d| d == Path::new(extra)) {
            dirs.push(extra.into());
        }
    }
    std::env::join_paths(dirs).unwrap_or(current)
}

/// Shell-like rendering of a command for progress lines and error messages.
pub fn display(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|arg| {
            let arg = arg.to_string_lossy();
            if arg.is_empty() || arg.contains(|c: char| c.is_whitespace() || c == '"' || c == '\'')
            {
                format!("'{}'", arg.replace('\'', r"'\''"))
            } else {
                arg.into_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` to completion, failing if it exits unsuccessfully or runs longer than `timeout`.
/// On timeout the child and all its descendants are killed.
pub fn run(cmd: &mut Command, timeout: Duration) -> Result<()> {
    let full = display(cmd);
    println!("$ {full}");
    // The progress line shows the whole command; errors, which may be repeated up a chain of
    // contexts, keep it short.
    let shown = match full.char_indices().nth(120) {
        Some((cut, _)) => format!("{}…", &full[..cut]),
        None => full,
    };
    let mut child = cmd
        .spawn()
        .with_context(|| format!("cannot start `{shown}`"))?;
    match wait_timeout(&mut child, timeout)? {
        Some(status) if status.success() => Ok(()),
        Some(status) => bail!("`{shown}` failed ({status})"),
        None => bail!("`{shown}` timed out after {} s", timeout.as_secs()),
    }
}

/// Waits for `child` for at most `timeout` (polling every 50 ms). Returns `None` if the deadline
/// passed, in which case the child, its descendants and, if the child leads a process group of
/// its own (`CommandExt::process_group(0)`), that group have been killed and reaped.
pub fn wait_timeout(child: &mut Child, timeout: Duration) -> Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            kill_tree(child);
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGKILLs `child`, every descendant of it (found through /proc before any is killed, so that
/// reparented grandchildren are not missed) and its process group if it leads one, then reaps it.
fn kill_tree(child: &mut Child) {
    let root = child.id();
    let mut pids = descendants(root);
    pids.push(root.to_string());
    if process_group(root) == Some(root) {
        pids.push(format!("-{root}"));
    }
    let _ = signal(&pids, "KILL");
    let _ = child.kill();
    let _ = child.wait();
}

/// Sends `SIGsig` to the given pids (a `-pgid` entry names a process group) with the shell's
/// `kill` builtin: std cannot signal arbitrary processes and procps may not be installed.
pub fn signal(pids: &[String], sig: &str) -> Result<()> {
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(r#"kill -s {sig} -- "$@" 2>/dev/null"#))
        .arg("sh")
        .args(pids)
        .status()
        .context("cannot run sh to send a signal")?;
    if !status.success() {
        bail!("kill -s {sig} {} failed", pids.join(" "));
    }
    Ok(())
}

/// (pid, ppid, pgrp) from /proc/<pid>/stat; the command name may contain spaces and parentheses,
/// so the fields are read after its last `)`.
fn stat_fields(pid: &str) -> Option<(u32, u32, u32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let pid = stat.split(' ').next()?.parse().ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(1); // state
    let ppid = fields.next()?.parse().ok()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((pid, ppid, pgrp))
}

fn process_group(pid: u32) -> Option<u32> {
    stat_fields(&pid.to_string()).map(|(_, _, pgrp)| pgrp)
}

pub fn descendants(root: u32) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let procs: Vec<(u32, u32)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| stat_fields(&e.file_name().to_string_lossy()))
        .map(|(pid, ppid, _)| (pid, ppid))
        .collect();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            procs
                .iter()
                .filter(|&&(_, ppid)| ppid == parent)
                .map(|&(pid, _)| pid),
        );
        i += 1;
    }
    found
        .into_iter()
        .skip(1)
        .map(|pid| pid.to_string())
        .collect()
}

/// Environment variable through which xtask tells its namespaced children (sanity-inner, the
/// test-support harness) which mount namespace they must not be in.
pub const HOST_MNT_NS_VAR: &str = "FERROVOL_HOST_MNT_NS";

/// This process's mount namespace, as `readlink /proc/self/ns/mnt` shows it (`mnt:[4026531832]`).
pub fn mount_namespace() -> Option<String> {
    mount_namespace_of("self")
}

fn mount_namespace_of(pid: &str) -> Option<String> {
    std::fs::read_link(format!("/proc/{pid}/ns/mnt"))
        .ok()
        .map(|p| p.display().to_string())
}

/// Whether this process runs in a mount namespace other than the host's. The host's is the one
/// recorded in `$FERROVOL_HOST_MNT_NS` by the xtask that started us, else that of pid 1, else
/// (where /proc/1/ns/mnt cannot be read, as in some sandboxes) that of the parent process.
pub fn in_private_mount_namespace() -> bool {
    let Some(own) = mount_namespace() else {
        return false;
    };
    let host = std::env::var(HOST_MNT_NS_VAR)
        .ok()
        .filter(|ns| !ns.is_empty())
        .or_else(|| mount_namespace_of("1"))
        .or_else(|| {
            let (_, ppid, _) = stat_fields("self")?;
            mount_namespace_of(&ppid.to_string())
        });
    host.is_some_and(|host| host != own)
}

/// The canonical form of `path` when it exists: the kernel reports resolved paths in
/// mountinfo and in loop devices' backing_file.
fn resolved(path: &Path) -> PathBuf {
    path.canonicalize().unwrap_or_else(|_| path.to_path_buf())
}

/// Lazily unmounts every mount below `under` (deepest first), then detaches every loop device
/// backed by a file below it. The cleanup "trap" of every task that lets the driver mount things.
pub fn cleanup(under: &Path) {
    cleanup_mounts(under);
    cleanup_loop_devices(under);
}

/// Detaches (`losetup -d`) every loop device whose backing file lies below `under`. A device that
/// is still in use is marked autoclear by the kernel and goes away with its last user.
pub fn cleanup_loop_devices(under: &Path) {
    let under = resolved(under);
    for dev in loop_devices_below(&under) {
        if let Err(err) = run(
            Command::new("losetup").args(["-d", &dev]),
            Duration::from_secs(30),
        ) {
            eprintln!("warning: cannot detach {dev}: {err:#}");
        }
    }
    // A device still in use only goes away with its last user; give it a moment, then say so
    // loudly: nothing should still use it once the namespace that mounted it is gone.
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut left = loop_devices_below(&under);
    while !left.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        left = loop_devices_below(&under);
    }
    for dev in left {
        eprintln!(
            "warning: {dev} (backed by a file below {}) is still attached: something still \
             holds it, such as a file system left frozen or mounted in another namespace",
            under.display()
        );
    }
}

/// `/dev/loopN` for every loop device whose backing file lies below `under`.
fn loop_devices_below(under: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    let mut devices: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("loop"))
        .filter(|name| {
            std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file"))
                .is_ok_and(|backing| backing_file_is_below(&backing, under))
        })
        .map(|name| format!("/dev/{name}"))
        .collect();
    devices.sort();
    devices
}

fn backing_file_is_below(backing: &str, under: &Path) -> bool {
    let backing = backing.trim_end_matches('\n');
    let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
    Path::new(backing).starts_with(under)
}

/// Lazily unmounts (`umount -l`) every mount point at or below `under` listed in
/// /proc/self/mountinfo, deepest first.
pub fn cleanup_mounts(under: &Path) {
    let mut points = mounts_below(under);
    if points.is_empty() {
        return;
    }
    // Deepest first; a path mounted several times over appears once per mount and is unmounted
    // as many times.
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for point in &points {
        let mut cmd = Command::new("umount");
        cmd.arg("-l").arg(point);
        if let Err(err) = run(&mut cmd, Duration::from_secs(30)) {
            eprintln!("warning: {err:#}");
        }
    }
    for point in mounts_below(under) {
        eprintln!("warning: {} is still mounted", point.display());
    }
}

/// Mount points at or below `under`, from /proc/self/mountinfo.
pub fn mounts_below(under: &Path) -> Vec<PathBuf> {
    let under = resolved(under);
    let Ok(mountinfo) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|field| PathBuf::from(decode_mountinfo(field)))
        .filter(|point| point.starts_with(&under))
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as three octal digits (`\040`).
fn decode_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && bytes[i + 1..i + 4]
                .iter()
                .all(|b| (b'0'..=b'7').contains(b))
        {
            let value = bytes[i + 1..i + 4]
                .iter()
                .fold(0u32, |acc, b| acc * 8 + u32::from(b - b'0'));
            out.push(value as u8);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Makes `dir` an empty directory. Whatever a previous, interrupted run left mounted or attached
/// below it is cleaned up first, and the removal is refused while anything stays mounted there:
/// removing a tree with a live mount inside would delete the mounted file system's contents.
pub fn fresh_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        cleanup(dir);
        remove_dir(dir)?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

/// Removes `dir` unless something is still mounted below it.
pub fn remove_dir(dir: &Path) -> Result<()> {
    let mounted = mounts_below(dir);
    if let Some(point) = mounted.first() {
        bail!(
            "refusing to remove {}: {} is still mounted",
            dir.display(),
            point.display()
        );
    }
    match std::fs::remove_dir_all(dir) {
        Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
            Err(err).with_context(|| format!("cannot remove {}", dir.display()))
        }
        _ => Ok(()),
    }
}

/// Runs `cmd` (normally made by [`unshare`]) with the environment the driver's test binaries
/// expect: `FERROVOL_BIN_DIR` (where csi-controller and csi-node are) and `FERROVOL_TEST_ROOT`
/// (their scratch space, made empty first). Whatever the outcome, everything mounted or attached
/// below the test root is cleaned up afterwards.
pub fn run_with_test_root(
    cmd: &mut Command,
    bin_dir: &Path,
    test_root: &Path,
    timeout: Duration,
) -> Result<()> {
    for bin in ["csi-controller", "csi-node"] {
        if !bin_dir.join(bin).is_file() {
            bail!(
                "{} is missing: the driver binaries were not built",
                bin_dir.join(bin).display()
            );
        }
    }
    // Emptying the root and cleaning up below it would wreck another run using it.
    let _lock = lock_dir(test_root)?;
    fresh_dir(test_root)?;
    cmd.env("FERROVOL_BIN_DIR", bin_dir)
        .env("FERROVOL_TEST_ROOT", test_root)
        .env("FERROVOL_MOTO", crate::tools::moto()?)
        .env("PATH", path_with_sbin());
    let result = run(cmd, timeout);
    cleanup(test_root);
    result
}

/// Takes `<dir>.lock` (flock, released when the returned file is dropped), failing at once if
/// another xtask holds it. Only xtask takes it: anything else sharing `dir` is not kept out.
pub fn lock_dir(dir: &Path) -> Result<std::fs::File> {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    let path = dir.with_file_name(name);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let file = std::fs::File::create(&path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => bail!(
            "{} is in use by another xtask run (it holds {})",
            dir.display(),
            path.display()
        ),
        Err(std::fs::TryLockError::Error(err)) => {
            Err(err).with_context(|| format!("cannot lock {}", path.display()))
        }
    }
}

/// The last `n` lines of a text file, for error messages that point at a log.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cargo sets CARGO_MANIFEST_DIR and CARGO_PKG_NAME for this test binary too, so both must
    /// be removed from a nested cargo's environment, while CARGO_HOME-style settings stay.
    #[test]
    fn nested_cargo_does_not_inherit_what_cargo_run_set() {
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        for cmd in [cargo(), unshare("cargo")] {
            let removed: Vec<_> = cmd
                .get_envs()
                .filter(|(_, v)| v.is_none())
                .map(|(k, _)| k.to_string_lossy().into_owned())
                .collect();
            for var in ["CARGO_MANIFEST_DIR", "CARGO_PKG_NAME", "CARGO_PKG_VERSION"] {
                assert!(removed.iter().any(|r| r == var), "{var} kept: {removed:?}");
            }
            assert!(!removed.iter().any(|r| r == "CARGO_HOME" || r == "CARGO"));
        }
    }

    #[test]
    fn mountinfo_escapes() {
        assert_eq!(decode_mountinfo(r"/a\040b/c\011d\134e"), "/a b/c\td\\e");
        assert_eq!(decode_mountinfo(r"/plain"), "/plain");
        assert_eq!(decode_mountinfo(r"/end\04"), r"/end\04");
    }

    #[test]
    fn timeout_kills_the_whole_tree() {
        // The grandchild records its pid; it must be gone once `run` returns.
        let dir = std::env::temp_dir().join(format!("xtask-timeout-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let pid_file = dir.join("pid");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"sh -c 'echo $$ > "$1"; exec sleep 30' sh "$1"; sleep 30"#);
        cmd.arg("sh").arg(&pid_file);
        let started = Instant::now();
        // Long enough for the grandchild to have started even on a loaded machine (with
        // 500 ms it sometimes had not written its pid yet).
        let err = run(&mut cmd, Duration::from_secs(3))
            .expect_err("must time out")
            .to_string();
        assert!(err.contains("timed out after 3 s"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(15));
        let pid = std::fs::read_to_string(&pid_file).expect("grandchild pid");
        std::thread::sleep(Duration::from_millis(100));
        // Killed, so at most a zombie awaiting its reaper.
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
        assert!(
            stat.is_empty() || stat.contains(") Z "),
            "grandchild survived: {stat}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn failure_names_the_command() {
        let err = run(
            Command::new("sh").args(["-c", "exit 3"]),
            Duration::from_secs(10),
        );
        let err = err.expect_err("exit 3 is a failure").to_string();
        assert!(err.contains("`sh -c 'exit 3'` failed"), "{err}");
    }

    #[test]
    fn a_locked_dir_cannot_be_taken_twice() {
        let dir = std::env::temp_dir()
            .join(format!("xtask-lock-{}", std::process::id()))
            .join("root");
        let first = lock_dir(&dir).expect("first lock");
        let err = lock_dir(&dir)
            .expect_err("second lock must fail")
            .to_string();
        assert!(err.contains("in use by another xtask run"), "{err}");
        drop(first);
        lock_dir(&dir).expect("lock after release");
        let _ = std::fs::remove_dir_all(dir.parent().expect("parent"));
    }

    #[test]
    fn own_stat() {
        let (pid, ppid, _) = stat_fields("self").expect("/proc/self/stat");
        assert_eq!(pid, std::process::id());
        assert!(ppid > 0);
    }

    #[test]
    fn loop_backing_files() {
        let under = Path::new("/w/target/sanity/1");
        assert!(backing_file_is_below(
            "/w/target/sanity/1/state/v.img\n",
            under
        ));
        assert!(backing_file_is_below(
            "/w/target/sanity/1/state/v.img (deleted)\n",
            under
        ));
        assert!(!backing_file_is_below(
            "/w/target/sanity/10/state/v.img\n",
            under
        ));
    }
}
