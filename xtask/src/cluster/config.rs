//! What the components read: certificates and keys (openssl), kubeconfigs, and the containerd,
//! CNI, kubelet and kube-proxy configuration files. All of it is made anew by every `up`.

use super::{API_PORT, API_SERVICE_IP, BRIDGE, NODE_IP, NODE_NAME, POD_CIDR, Paths};
use crate::tools;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A client identity: file stem, common name (the user), organization (the group). The kubelet's
/// is `system:node:<NODE_NAME>` (the Node authorizer and NodeRestriction know it by that name),
/// added by [`pki`].
const CLIENTS: &[(&str, &str, &str)] = &[
    ("admin", "ferrovol-e2e-admin", "system:masters"),
    (
        "kube-controller-manager",
        "system:kube-controller-manager",
        "",
    ),
    ("kube-scheduler", "system:kube-scheduler", ""),
    ("kube-proxy", "system:kube-proxy", ""),
    (
        "snapshot-controller",
        "ferrovol-e2e-snapshot-controller",
        "system:masters",
    ),
    (
        "apiserver-kubelet-client",
        "kube-apiserver-kubelet-client",
        "system:masters",
    ),
];

/// Makes the CA, the apiserver's serving certificate, a client certificate per component and the
/// service-account signing key in `paths.pki`.
pub fn pki(paths: &Paths) -> Result<()> {
    let dir = &paths.pki;
    std::fs::create_dir_all(dir)?;
    let openssl = |args: &[&str]| -> Result<()> {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .context("cannot run openssl")?;
        if !out.status.success() {
            bail!(
                "`openssl {}` failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    };
    // P-256 keys for the clients: generated in milliseconds, read by Go and by rustls (kube-rs)
    // alike. RSA for the CA and the apiserver's serving certificate, which older TLS clients
    // handle more often than ECDSA. (busybox's wget handshakes with neither: Go's TLS server
    // refuses it, so check Services from a busybox pod with `nc`, not `wget https://`.)
    const KEY: [&str; 4] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    const RSA: [&str; 2] = ["-newkey", "rsa:2048"];
    openssl(
        &[
            &["req", "-x509", "-new", "-nodes", "-days", "3650"][..],
            &RSA,
            &[
                "-keyout",
                "ca.key",
                "-out",
                "ca.crt",
                "-subj",
                "/CN=ferrovol-e2e-ca",
            ],
            &["-addext", "basicConstraints=critical,CA:TRUE"],
            &[
                "-addext",
                "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            ],
        ]
        .concat(),
    )?;
    let mut leaves: Vec<(&str, String, &str, &[&str])> = CLIENTS
        .iter()
        .map(|(stem, cn, org)| {
            let subject = if org.is_empty() {
                format!("/CN={cn}")
            } else {
                format!("/O={org}/CN={cn}")
            };
            (*stem, subject, "extendedKeyUsage=clientAuth\n", &KEY[..])
        })
        .collect();
    leaves.push((
        "kubelet",
        format!("/O=system:nodes/CN=system:node:{NODE_NAME}"),
        "extendedKeyUsage=clientAuth\n",
        &KEY,
    ));
    let server_ext = format!(
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:{NODE_IP},IP:{API_SERVICE_IP},IP:127.0.0.1,\
         DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,\
         DNS:kubernetes.default.svc.cluster.local\n"
    );
    leaves.push(("apiserver", "/CN=kube-apiserver".into(), &server_ext, &RSA));
    for (stem, subject, ext, key_args) in &leaves {
        let ext_file = format!("{stem}.ext");
        std::fs::write(
            dir.join(&ext_file),
            format!(
                "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n{ext}"
            ),
        )?;
        let (key, csr, crt) = (
            format!("{stem}.key"),
            format!("{stem}.csr"),
            format!("{stem}.crt"),
        );
        openssl(
            &[
                &["req", "-new", "-nodes"][..],
                key_args,
                &["-keyout", &key, "-out", &csr, "-subj", subject],
            ]
            .concat(),
        )?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "3650",
            "-out",
            &crt,
            "-extfile",
            &ext_file,
        ])?;
    }
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        "sa.key",
    ])?;
    openssl(&["pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}

/// Writes `<paths.root>/<stem>.kubeconfig` for the client identity `stem` (the admin's is
/// `paths.kubeconfig`), with the certificates inlined so that the file can be copied anywhere.
pub fn kubeconfig(paths: &Paths, stem: &str) -> Result<PathBuf> {
    let read = |name: &str| -> Result<String> {
        let path = paths.pki.join(name);
        Ok(base64(&std::fs::read(&path).with_context(|| {
            format!("cannot read {}", path.display())
        })?))
    };
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: ferrovol-e2e
  cluster:
    server: https://{NODE_IP}:{API_PORT}
    certificate-authority-data: {ca}
users:
- name: {stem}
  user:
    client-certificate-data: {crt}
    client-key-data: {key}
contexts:
- name: ferrovol-e2e
  context:
    cluster: ferrovol-e2e
    user: {stem}
current-context: ferrovol-e2e
",
        ca = read("ca.crt")?,
        crt = read(&format!("{stem}.crt"))?,
        key = read(&format!("{stem}.key"))?,
    );
    let path = if stem == "admin" {
        paths.kubeconfig.clone()
    } else {
        paths.root.join(format!("{stem}.kubeconfig"))
    };
    std::fs::write(&path, text).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

/// containerd's own root, state and socket, so that it never meets a system containerd; the CRI
/// plugin with the project's pause image, runc with cgroupfs, and the CNI configuration below.
pub fn containerd(paths: &Paths, snapshotter: &str, restrict_oom_score_adj: bool) -> Result<()> {
    let q = |p: &Path| toml_str(&p.to_string_lossy());
    let text = format!(
        r#"version = 2
root = {root}
state = {state}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper"]

[grpc]
  address = {socket}

[ttrpc]
  address = {ttrpc}

[plugins."io.containerd.internal.v1.opt"]
  path = {opt}

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {pause}
  # Without CAP_SYS_RESOURCE (some sandboxes) runc cannot lower a container's oom_score_adj.
  restrict_oom_score_adj = {restrict_oom_score_adj}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = {snapshotter}
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {cni_bin}
    conf_dir = {cni_conf}
"#,
        root = q(&paths.root.join("containerd")),
        state = q(&paths.run.join("containerd")),
        socket = q(&paths.containerd_socket),
        ttrpc = q(&paths.run.join("containerd.sock.ttrpc")),
        opt = q(&paths.root.join("containerd-opt")),
        pause = toml_str(super::images::PAUSE_IMAGE),
        snapshotter = toml_str(snapshotter),
        cni_bin = toml_str(tools::CNI_BIN_DIR),
        cni_conf = q(&paths.cni_conf),
    );
    std::fs::write(paths.root.join("containerd.toml"), text)?;

    // One bridge, addresses from host-local (its state in the run directory, not
    // /var/lib/cni), no masquerading: pods only talk to each other and to this host.
    std::fs::create_dir_all(&paths.cni_conf)?;
    let conflist = format!(
        r#"{{
  "cniVersion": "1.0.0",
  "name": "ferrovol-e2e",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "{BRIDGE}",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {{
        "type": "host-local",
        "ranges": [[{{"subnet": "{POD_CIDR}", "gateway": "{NODE_IP}"}}]],
        "routes": [{{"dst": "0.0.0.0/0"}}],
        "dataDir": {ipam}
      }}
    }},
    {{"type": "portmap", "capabilities": {{"portMappings": true}}}}
  ]
}}
"#,
        ipam = toml_str(&paths.run.join("cni-ipam").to_string_lossy()),
    );
    std::fs::write(paths.cni_conf.join("10-ferrovol-e2e.conflist"), conflist)?;
    Ok(())
}

/// The kubelet's configuration file.
pub fn kubelet(paths: &Paths) -> Result<PathBuf> {
    let resolv = if Path::new("/etc/resolv.conf").is_file() {
        "/etc/resolv.conf"
    } else {
        ""
    };
    let text = format!(
        r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This host mounts cgroups v1 ("hybrid"); Kubernetes 1.35+ refuses that unless told otherwise.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://{socket}
failSwapOn: false
address: {NODE_IP}
port: 10250
healthzBindAddress: 127.0.0.1
healthzPort: 10248
readOnlyPort: 0
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {ca}
authorization:
  mode: Webhook
clusterDomain: cluster.local
# Not /var/log/pods: everything the cluster writes stays below target/cluster.
podLogsDir: {pod_logs}
resolvConf: "{resolv}"
# Images cannot be pulled again here (no registry): never collect them, never evict for disk.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
registerNode: true
maxPods: 110
podPidsLimit: -1
protectKernelDefaults: false
makeIPTablesUtilChains: true
"#,
        socket = paths.containerd_socket.display(),
        ca = paths.pki.join("ca.crt").display(),
        pod_logs = paths.pod_logs.display(),
    );
    let path = paths.root.join("kubelet.yaml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// kube-proxy's configuration file: iptables mode, and no sysctl or rlimit it cannot set here.
pub fn kube_proxy(paths: &Paths, kubeconfig: &Path) -> Result<PathBuf> {
    let text = format!(
        r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection:
  kubeconfig: {kubeconfig}
mode: iptables
clusterCIDR: {POD_CIDR}
hostnameOverride: {NODE_NAME}
bindAddress: 0.0.0.0
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# Lowering its own oom_score_adj needs CAP_SYS_RESOURCE, which some sandboxes withhold.
oomScoreAdj: 0
# 0 leaves the host's conntrack sysctls alone (they may be read-only here).
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
        kubeconfig = kubeconfig.display(),
    );
    let path = paths.root.join("kube-proxy.yaml");
    std::fs::write(&path, text)?;
    Ok(path)
}

/// A TOML (and JSON) basic string.
fn toml_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i)) as usize & 63]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_pads() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }
}
