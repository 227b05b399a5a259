//! The images the cluster's containerd holds, written with the OCI writer of `cargo xtask images`
//! (no container engine, no registry): the CSI sidecars under the names the chart asks for, the
//! pause image and a busybox workload image.

use super::build;
use crate::images::{SimpleEntry, write_simple_image};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const PAUSE_IMAGE: &str = "localhost/ferrovol-e2e/pause:1";
pub const BUSYBOX_IMAGE: &str = "localhost/ferrovol-e2e/busybox:1";

/// (binary of the sidecars build, image): the chart's default image names. csi-resizer v2.2.1 is
/// not served by the Go module proxy; the image carries v2.2.0 under the chart's tag.
pub const SIDECAR_IMAGES: &[(&str, &str)] = &[
    (
        "csi-provisioner",
        "registry.k8s.io/sig-storage/csi-provisioner:v6.3.0",
    ),
    (
        "csi-attacher",
        "registry.k8s.io/sig-storage/csi-attacher:v4.12.0",
    ),
    (
        "csi-resizer",
        "registry.k8s.io/sig-storage/csi-resizer:v2.2.1",
    ),
    (
        "csi-snapshotter",
        "registry.k8s.io/sig-storage/csi-snapshotter:v8.6.0",
    ),
    (
        "livenessprobe",
        "registry.k8s.io/sig-storage/livenessprobe:v2.19.0",
    ),
    (
        "csi-node-driver-registrar",
        "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.17.0",
    ),
];

/// Writes every image archive into `dir` and returns their paths.
pub fn write_all(sidecars: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut archives = Vec::new();
    for (bin, reference) in SIDECAR_IMAGES {
        let archive = dir.join(format!("{bin}.tar"));
        // Like the upstream images: the static binary at /<name>, which is the entrypoint.
        write_simple_image(
            reference,
            &[&format!("/{bin}")],
            &[
                (
                    format!("/{bin}"),
                    SimpleEntry::Host(sidecars.join(bin), 0o755),
                ),
                ("/tmp".to_string(), SimpleEntry::Dir(0o1777)),
            ],
            &archive,
        )
        .with_context(|| format!("writing the {reference} image"))?;
        archives.push(archive);
    }

    let pause = dir.join("pause.tar");
    write_simple_image(
        PAUSE_IMAGE,
        &["/pause"],
        &[(
            "/pause".to_string(),
            SimpleEntry::Host(build::pause()?, 0o755),
        )],
        &pause,
    )?;
    archives.push(pause);

    let busybox = dir.join("busybox.tar");
    write_simple_image(BUSYBOX_IMAGE, &[], &busybox_files()?, &busybox)?;
    archives.push(busybox);
    Ok(archives)
}

/// Debian's static busybox at /bin/busybox and a symlink to it for each applet it lists, with no
/// entrypoint: pods name their command (`sh -c …`).
fn busybox_files() -> Result<Vec<(String, SimpleEntry)>> {
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .context("busybox not found (Debian: busybox-static)")?;
    let out = Command::new(&busybox)
        .arg("--list")
        .output()
        .context("cannot run busybox --list")?;
    let mut files = vec![
        (
            "/bin/busybox".to_string(),
            SimpleEntry::Host(busybox, 0o755),
        ),
        ("/tmp".to_string(), SimpleEntry::Dir(0o1777)),
        (
            "/etc/passwd".to_string(),
            SimpleEntry::Bytes(b"root:x:0:0:root:/root:/bin/sh\n".to_vec(), 0o644),
        ),
        (
            "/etc/group".to_string(),
            SimpleEntry::Bytes(b"root:x:0:\n".to_vec(), 0o644),
        ),
    ];
    for applet in String::from_utf8_lossy(&out.stdout).lines() {
        let applet = applet.trim();
        if !applet.is_empty() && applet != "busybox" && !applet.contains('/') {
            files.push((
                format!("/bin/{applet}"),
                SimpleEntry::Symlink("busybox".into()),
            ));
        }
    }
    Ok(files)
}
