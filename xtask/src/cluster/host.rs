//! What the cluster needs from and changes on the host: the checks that say clearly why a
//! cluster cannot run here, shared mount propagation, the pod bridge, and the cleanup of what
//! the kubelet, kube-proxy and the CNI plugins leave behind (iptables rules, cgroups,
//! network namespaces, interfaces).

use super::{BRIDGE, NODE_IP, POD_PREFIX};
use anyhow::{Context, Result, bail};
use std::path::Path;
use std::process::Command;

/// Controllers the kubelet (cgroupfs driver) and runc need, on cgroup v1 or v2.
const CGROUP_CONTROLLERS: &[&str] = &["cpu", "cpuacct", "cpuset", "memory", "pids"];

/// Fails with a message naming what this host lacks for a cluster. Returns whether
/// CAP_SYS_RESOURCE is missing (containerd must then not lower oom_score_adj) and the
/// containerd snapshotter to use.
pub fn check() -> Result<(bool, &'static str)> {
    if !crate::tools::is_root() {
        bail!(
            "cluster: must run as root (the kubelet mounts volumes, containerd makes namespaces)"
        );
    }
    let mut lacks = Vec::new();

    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let unified = mountinfo
        .lines()
        .any(|l| l.split(' ').nth(4) == Some("/sys/fs/cgroup") && l.contains(" - cgroup2 "));
    if unified {
        let controllers =
            std::fs::read_to_string("/sys/fs/cgroup/cgroup.controllers").unwrap_or_default();
        let available: Vec<&str> = controllers.split_whitespace().collect();
        for c in CGROUP_CONTROLLERS {
            // cgroup v2 folds cpuacct into cpu.
            if *c != "cpuacct" && !available.contains(c) {
                lacks.push(format!(
                    "the cgroup v2 controller `{c}` (/sys/fs/cgroup/cgroup.controllers has: {})",
                    controllers.trim()
                ));
            }
        }
    } else {
        let v1_options: Vec<&str> = mountinfo
            .lines()
            .filter(|l| l.contains(" - cgroup "))
            .filter_map(|l| l.rsplit(' ').next())
            .collect();
        for c in CGROUP_CONTROLLERS {
            if !v1_options.iter().any(|o| o.split(',').any(|opt| opt == *c)) {
                lacks.push(format!(
                    "a mounted cgroup v1 hierarchy with the `{c}` controller (see /proc/cgroups \
                     and `grep cgroup /proc/self/mountinfo`)"
                ));
            }
        }
    }

    let filesystems = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    let overlay = filesystems
        .lines()
        .any(|l| l.trim_end().ends_with("overlay"));

    if !Path::new("/proc/sys/net/ipv4").is_dir() {
        lacks.push("IPv4 networking (/proc/sys/net/ipv4)".into());
    }
    if !iptables_works("iptables") {
        lacks.push(
            "a working iptables nat table (`iptables -w -t nat -S` fails: kube-proxy cannot \
             program Services)"
                .into(),
        );
    }
    if !Path::new("/sys/class/net").join(BRIDGE).exists() {
        // The pod network is a bridge; try to make it (and keep it, `up` needs it next).
        let made = Command::new("ip")
            .args(["link", "add", BRIDGE, "type", "bridge"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !made {
            lacks.push(
                "Linux bridge support (`ip link add NAME type bridge` fails): the pod network \
                 is a bridge"
                    .into(),
            );
        }
    }
    if !lacks.is_empty() {
        bail!(
            "cluster: this host cannot run a Kubernetes node, it lacks:\n  - {}",
            lacks.join("\n  - ")
        );
    }
    if !Path::new("/proc/sys/net/bridge").is_dir() {
        println!(
            "cluster: warning: br_netfilter is not loaded (no /proc/sys/net/bridge): pods reach \
             Services, but not a Service whose endpoint sits on the same bridge"
        );
    }
    let snapshotter = if overlay {
        "overlayfs"
    } else {
        println!(
            "cluster: no overlay file system in this kernel: containerd copies layers (native)"
        );
        "native"
    };
    Ok((!has_cap_sys_resource(), snapshotter))
}

fn iptables_works(bin: &str) -> bool {
    Command::new(bin)
        .args(["-w", "-t", "nat", "-S"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// CAP_SYS_RESOURCE (bit 24) in this process's effective set.
fn has_cap_sys_resource() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << 24) != 0)
}

/// Makes `/` a shared mount (recursively) when it is not: the node plugin's Bidirectional
/// mounts under /var/lib/kubelet must propagate back to the host and on to other containers,
/// which needs a shared peer group. systemd makes `/` shared at boot; hosts without systemd
/// (containers, sandboxes) leave it private. The cluster's processes run in the host's mount
/// namespace rather than a shared namespace of their own so that `down`, the tests and anyone
/// debugging see the volumes' mounts where the kubelet made them. The change is left in place by
/// `down`: it is how every systemd host runs anyway.
pub fn share_root_mount() -> Result<()> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .context("cannot read /proc/self/mountinfo")?;
    let root_shared = mountinfo.lines().any(|l| {
        let fields: Vec<&str> = l.split(' ').collect();
        fields.get(4) == Some(&"/")
            && fields[6..]
                .iter()
                .take_while(|f| **f != "-")
                .any(|f| f.starts_with("shared:"))
    });
    if root_shared {
        return Ok(());
    }
    println!(
        "cluster: `/` is a private mount here; making it shared (mount --make-rshared /) so that \
         Bidirectional mount propagation works"
    );
    crate::util::run(
        Command::new("mount").args(["--make-rshared", "/"]),
        std::time::Duration::from_secs(30),
    )
    .context("cannot make / shared: the node plugin's Bidirectional mounts need it")
}

/// The pod bridge with the node's address (the CNI bridge plugin finds it ready), forwarding on,
/// and bridged traffic through iptables where br_netfilter exists.
pub fn network() -> Result<()> {
    let ip = |args: &[&str]| -> Result<std::process::Output> {
        Command::new("ip")
            .args(args)
            .output()
            .context("cannot run ip")
    };
    if !Path::new("/sys/class/net").join(BRIDGE).exists() {
        let out = ip(&["link", "add", BRIDGE, "type", "bridge"])?;
        if !out.status.success() {
            bail!(
                "cannot create the bridge {BRIDGE}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let addr = format!("{NODE_IP}/{POD_PREFIX}");
    let shown = ip(&["-o", "addr", "show", "dev", BRIDGE])?;
    if !String::from_utf8_lossy(&shown.stdout).contains(&format!(" {addr} ")) {
        let out = ip(&["addr", "add", &addr, "dev", BRIDGE])?;
        if !out.status.success() {
            bail!(
                "cannot give {BRIDGE} the address {addr}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    let out = ip(&["link", "set", BRIDGE, "up"])?;
    if !out.status.success() {
        bail!(
            "cannot bring {BRIDGE} up: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .context("cannot enable IPv4 forwarding (/proc/sys/net/ipv4/ip_forward)")?;
    let bridge_nf = Path::new("/proc/sys/net/bridge/bridge-nf-call-iptables");
    if bridge_nf.exists() {
        let _ = std::fs::write(bridge_nf, "1");
    }
    Ok(())
}

/// Removes the bridge and every interface enslaved to it (the pods' veths, when their network
/// namespaces outlived the pods).
pub fn remove_network() {
    if !Path::new("/sys/class/net").join(BRIDGE).exists() {
        return;
    }
    if let Ok(entries) = std::fs::read_dir(Path::new("/sys/class/net").join(BRIDGE).join("brif")) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let _ = Command::new("ip").args(["link", "del", &name]).output();
        }
    }
    match Command::new("ip").args(["link", "del", BRIDGE]).output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!(
            "warning: cannot remove {BRIDGE}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ),
        Err(err) => eprintln!("warning: cannot run ip: {err}"),
    }
}

/// Drops every iptables (and ip6tables) chain and rule that kube-proxy, the kubelet or the CNI
/// plugins made: chains named KUBE-* or CNI-*, and rules jumping to them or carrying their
/// comments. Each table is rewritten in one `iptables-restore`, so the host's other rules stay
/// as they are.
pub fn remove_iptables_rules() {
    for (save, restore) in [
        ("iptables-save", "iptables-restore"),
        ("ip6tables-save", "ip6tables-restore"),
    ] {
        let Ok(out) = Command::new(save).output() else {
            continue;
        };
        if !out.status.success() {
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let ours = |line: &str| {
            line.starts_with(":KUBE-")
                || line.starts_with(":CNI-")
                || (line.starts_with("-A ")
                    && (line.contains("KUBE-")
                        || line.contains("CNI-")
                        || line.contains("ferrovol-e2e")))
        };
        if !text.lines().any(ours) {
            continue;
        }
        // Only the tables with something of ours are restored; the others are not touched.
        let mut tables: Vec<(String, Vec<&str>, bool)> = Vec::new();
        for line in text.lines() {
            if let Some(name) = line.strip_prefix('*') {
                tables.push((name.to_string(), vec![line], false));
            } else if let Some((_, lines, touched)) = tables.last_mut() {
                if ours(line) {
                    *touched = true;
                } else {
                    lines.push(line);
                }
            }
        }
        let script: String = tables
            .iter()
            .filter(|(_, _, touched)| *touched)
            .flat_map(|(_, lines, _)| lines.iter().map(|l| format!("{l}\n")))
            .collect();
        let result = Command::new(restore)
            .arg("-w")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write as _;
                if let Some(mut stdin) = child.stdin.take() {
                    stdin.write_all(script.as_bytes())?;
                }
                child.wait_with_output()
            });
        match result {
            Ok(out) if out.status.success() => {}
            Ok(out) => eprintln!(
                "warning: {restore} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ),
            Err(err) => eprintln!("warning: cannot run {restore}: {err}"),
        }
    }
}

/// Lines of `iptables-save` and `ip6tables-save` that are the cluster's, for `status` and for
/// checking `down`.
pub fn leftover_iptables_rules() -> Vec<String> {
    ["iptables-save", "ip6tables-save"]
        .iter()
        .filter_map(|save| Command::new(save).output().ok())
        .flat_map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| l.contains("KUBE-") || l.contains("CNI-"))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Removes the `kubepods` cgroups the kubelet made (cgroupfs driver), deepest first, in every
/// v1 hierarchy and in the unified one. Only empty cgroups can go: run after every container
/// is gone.
pub fn remove_cgroups() {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let roots: Vec<String> = mountinfo
        .lines()
        .filter(|l| l.contains(" - cgroup ") || l.contains(" - cgroup2 "))
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .collect();
    for root in roots {
        let top = Path::new(&root).join("kubepods");
        if !top.is_dir() {
            continue;
        }
        let mut dirs = vec![top.clone()];
        let mut i = 0;
        while i < dirs.len() {
            if let Ok(entries) = std::fs::read_dir(&dirs[i]) {
                for entry in entries.flatten() {
                    if entry.file_type().is_ok_and(|t| t.is_dir()) {
                        dirs.push(entry.path());
                    }
                }
            }
            i += 1;
        }
        for dir in dirs.iter().rev() {
            if let Err(err) = std::fs::remove_dir(dir) {
                eprintln!("warning: cannot remove the cgroup {}: {err}", dir.display());
            }
        }
    }
}

/// The sysctls `up` and the kubelet change (the kubelet sets its "kernel defaults" unless
/// protectKernelDefaults is on, in which case it refuses to start on any other value).
const SYSCTLS: &[&str] = &[
    "net/ipv4/ip_forward",
    "net/bridge/bridge-nf-call-iptables",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

/// Records the current values of [`SYSCTLS`] in `file`, unless a previous `up` already did (its
/// values are the host's own).
pub fn save_sysctls(file: &Path) -> Result<()> {
    if file.exists() {
        return Ok(());
    }
    let text: String = SYSCTLS
        .iter()
        .filter_map(|k| {
            std::fs::read_to_string(Path::new("/proc/sys").join(k))
                .ok()
                .map(|v| format!("{k} {}\n", v.trim()))
        })
        .collect();
    std::fs::write(file, text).with_context(|| format!("cannot write {}", file.display()))
}

/// Puts back the values [`save_sysctls`] recorded, then forgets them.
pub fn restore_sysctls(file: &Path) {
    let Ok(text) = std::fs::read_to_string(file) else {
        return;
    };
    for line in text.lines() {
        if let Some((key, value)) = line.split_once(' ') {
            let path = Path::new("/proc/sys").join(key);
            let current = std::fs::read_to_string(&path).unwrap_or_default();
            if current.trim() != value
                && let Err(err) = std::fs::write(&path, value)
            {
                eprintln!("warning: cannot restore {}: {err}", path.display());
            }
        }
    }
    let _ = std::fs::remove_file(file);
}

/// Detaches every loop device whose backing file is one of the regular files below `dirs`,
/// matched by device and inode (`losetup -O BACK-MAJ:MIN,BACK-INO`): a device attached inside a
/// container reports its backing file's path as the container saw it.
pub fn detach_loop_devices(dirs: &[&Path]) {
    use std::os::unix::fs::MetadataExt;
    let Ok(out) = Command::new("losetup")
        .args(["--list", "--noheadings", "-O", "NAME,BACK-MAJ:MIN,BACK-INO"])
        .output()
    else {
        return;
    };
    let attached: Vec<(String, String, u64)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            Some((
                f.next()?.to_string(),
                f.next()?.to_string(),
                f.next()?.parse().ok()?,
            ))
        })
        .collect();
    if attached.is_empty() {
        return;
    }
    let mut files = Vec::new();
    let mut stack: Vec<std::path::PathBuf> = dirs.iter().map(|d| d.to_path_buf()).collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                let (major, minor) = (libc_major(meta.dev()), libc_minor(meta.dev()));
                files.push((format!("{major}:{minor}"), meta.ino()));
            }
        }
    }
    for (dev, backing_dev, ino) in &attached {
        if files.iter().any(|(d, i)| d == backing_dev && i == ino) {
            match Command::new("losetup").args(["-d", dev]).output() {
                Ok(out) if out.status.success() => {}
                _ => eprintln!("warning: cannot detach {dev}"),
            }
        }
    }
}

/// glibc's gnu_dev_major and gnu_dev_minor.
fn libc_major(dev: u64) -> u64 {
    ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0x0000_0fff)
}

fn libc_minor(dev: u64) -> u64 {
    ((dev >> 12) & 0xffff_ff00) | (dev & 0x0000_00ff)
}
