//! The rendered manifests in `deploy/kubernetes/<backend>/`, parsed into k8s-openapi's typed
//! structs, and the wiring between them checked: what `helm lint` and kube-linter cannot see.
//!
//! - Every object parses, and parsing loses nothing (a misspelt field would be dropped).
//! - Each sidecar's `--csi-address` and its plugin's `--endpoint` name the same file: the same
//!   volume, the same path inside it.
//! - node-driver-registrar's `--kubelet-registration-path` is the node plugin's socket as kubelet
//!   sees it on the host; the registration directory is kubelet's.
//! - csi-node mounts the kubelet directory at the same path with Bidirectional propagation,
//!   /dev, and the state directory it is told about (shared with csi-controller for local).
//! - Each plugin's liveness probe hits the livenessprobe sidecar that probes its socket.
//! - The sidecars run in the mode the backend needs (distributed for local, leader election for
//!   the replicated aws controller) with the environment that mode reads.
//! - RBAC: every service account holds exactly what its pod's containers need, taken from each
//!   sidecar's upstream rbac.yaml: no missing rule, no extra one.
//! - CSIDriver, StorageClass and VolumeSnapshotClass agree with the backend and the driver name.
//! - The central controller is unprivileged and non-root; only the node plugins are privileged.

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::core::v1::{Container, PodSpec, ServiceAccount};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding};
use k8s_openapi::api::storage::v1::{CSIDriver, StorageClass};
use k8s_openapi::serde::Deserialize;
use k8s_openapi::serde::Serialize;
use k8s_openapi::serde::de::DeserializeOwned;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const BACKENDS: [&str; 2] = ["local", "aws"];

#[derive(Default)]
struct Manifests {
    backend: &'static str,
    deployments: Vec<Deployment>,
    daemonsets: Vec<DaemonSet>,
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    cluster_role_bindings: Vec<ClusterRoleBinding>,
    roles: Vec<Role>,
    role_bindings: Vec<RoleBinding>,
    csi_drivers: Vec<CSIDriver>,
    storage_classes: Vec<StorageClass>,
    pdbs: Vec<PodDisruptionBudget>,
    /// Kinds without a k8s-openapi type (VolumeSnapshotClass, ServiceMonitor).
    untyped: Vec<serde_yaml::Value>,
}

fn load(backend: &'static str) -> Manifests {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/kubernetes")
        .join(backend);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask render`)", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    let mut m = Manifests {
        backend,
        ..Manifests::default()
    };
    for file in files {
        let text = std::fs::read_to_string(&file).expect("readable manifest");
        let name = file.display().to_string();
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let value = serde_yaml::Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("{name}: not YAML: {e}"));
            if value.is_null() {
                panic!("{name}: an empty document (kubectl would reject it)");
            }
            let kind = value["kind"].as_str().unwrap_or_default().to_string();
            match kind.as_str() {
                "Deployment" => m.deployments.push(typed(value, &name)),
                "DaemonSet" => m.daemonsets.push(typed(value, &name)),
                "ServiceAccount" => m.service_accounts.push(typed(value, &name)),
                "ClusterRole" => m.cluster_roles.push(typed(value, &name)),
                "ClusterRoleBinding" => m.cluster_role_bindings.push(typed(value, &name)),
                "Role" => m.roles.push(typed(value, &name)),
                "RoleBinding" => m.role_bindings.push(typed(value, &name)),
                "CSIDriver" => m.csi_drivers.push(typed(value, &name)),
                "StorageClass" => m.storage_classes.push(typed(value, &name)),
                "PodDisruptionBudget" => m.pdbs.push(typed(value, &name)),
                "VolumeSnapshotClass" => {
                    assert_eq!(
                        value["apiVersion"].as_str(),
                        Some("snapshot.storage.k8s.io/v1")
                    );
                    m.untyped.push(value);
                }
                other => panic!("{name}: unexpected kind {other:?}"),
            }
        }
    }
    m
}

/// Parses `value` as `T` and checks that serializing it back gives `value` again: k8s-openapi
/// ignores fields it does not know, so a misspelt one would otherwise vanish unnoticed.
fn typed<T: DeserializeOwned + Serialize>(value: serde_yaml::Value, file: &str) -> T {
    let object: T = serde_yaml::from_value(value.clone()).unwrap_or_else(|e| {
        panic!(
            "{file}: {} does not parse: {e}",
            value["kind"].as_str().unwrap_or("?")
        )
    });
    let original = serde_json::to_value(&value).expect("YAML as JSON");
    let round_trip = serde_json::to_value(&object).expect("serializable");
    assert_eq!(
        round_trip,
        original,
        "{file}: {} {} changes when parsed (an unknown or misspelt field?)",
        value["kind"].as_str().unwrap_or("?"),
        value["metadata"]["name"].as_str().unwrap_or("?")
    );
    object
}

// ---------------------------------------------------------------------------------------------
// Pods and containers

struct Pod<'a> {
    /// `Deployment/ferrovol-controller`, for messages.
    what: String,
    namespace: String,
    spec: &'a PodSpec,
    replicas: Option<i32>,
}

impl Manifests {
    fn pods(&self) -> Vec<Pod<'_>> {
        let mut pods = Vec::new();
        for d in &self.deployments {
            let spec = d.spec.as_ref().expect("Deployment spec");
            pods.push(Pod {
                what: format!("Deployment/{}", name(&d.metadata)),
                namespace: d.metadata.namespace.clone().expect("namespaced"),
                spec: spec.template.spec.as_ref().expect("pod spec"),
                replicas: spec.replicas,
            });
        }
        for d in &self.daemonsets {
            let spec = d.spec.as_ref().expect("DaemonSet spec");
            pods.push(Pod {
                what: format!("DaemonSet/{}", name(&d.metadata)),
                namespace: d.metadata.namespace.clone().expect("namespaced"),
                spec: spec.template.spec.as_ref().expect("pod spec"),
                replicas: None,
            });
        }
        pods
    }

    fn driver_name(&self) -> String {
        assert_eq!(self.csi_drivers.len(), 1, "{}: one CSIDriver", self.backend);
        name(&self.csi_drivers[0].metadata)
    }

    fn all_containers(&self) -> Vec<(String, Container)> {
        self.pods()
            .iter()
            .flat_map(|p| {
                p.spec
                    .containers
                    .iter()
                    .map(|c| (p.what.clone(), c.clone()))
            })
            .collect()
    }
}

fn name(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.name.clone().expect("named object")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Node,
    Controller,
    Provisioner,
    Attacher,
    Resizer,
    Snapshotter,
    LivenessProbe,
    Registrar,
}

fn kind(c: &Container) -> Kind {
    let image = c.image.as_deref().expect("image");
    let repo = image.rsplit_once(':').map_or(image, |(r, _)| r);
    match repo.rsplit('/').next().expect("repository") {
        "ferrovol-node" | "ferrovol-controller" => {
            let command = c
                .command
                .as_ref()
                .and_then(|c| c.first())
                .expect("plugin command");
            match command.as_str() {
                "/usr/bin/csi-node" => Kind::Node,
                "/usr/bin/csi-controller" => Kind::Controller,
                other => panic!("{}: unknown plugin command {other}", c.name),
            }
        }
        "csi-provisioner" => Kind::Provisioner,
        "csi-attacher" => Kind::Attacher,
        "csi-resizer" => Kind::Resizer,
        "csi-snapshotter" => Kind::Snapshotter,
        "livenessprobe" => Kind::LivenessProbe,
        "csi-node-driver-registrar" => Kind::Registrar,
        other => panic!("{}: unknown image {other}", c.name),
    }
}

fn args(c: &Container) -> &[String] {
    c.args.as_deref().unwrap_or_default()
}

/// The value of `--flag=value`, at most once.
fn arg<'a>(c: &'a Container, flag: &str) -> Option<&'a str> {
    let prefix = format!("{flag}=");
    let values: Vec<&str> = args(c)
        .iter()
        .filter_map(|a| a.strip_prefix(&prefix))
        .collect();
    assert!(values.len() <= 1, "{}: {flag} given twice", c.name);
    values.first().copied()
}

fn has(c: &Container, flag: &str) -> bool {
    args(c).iter().any(|a| a == flag)
}

/// The socket a container serves (plugins) or connects to (sidecars).
fn socket(c: &Container) -> Option<String> {
    match kind(c) {
        Kind::Node | Kind::Controller => Some(
            arg(c, "--endpoint")
                .and_then(|e| e.strip_prefix("unix://"))
                .unwrap_or_else(|| panic!("{}: --endpoint=unix://… missing", c.name))
                .to_string(),
        ),
        _ => arg(c, "--csi-address").map(str::to_string),
    }
}

/// `path` in `c`'s file system as (volume name, path inside the volume), through the mount
/// with the longest matching mountPath.
fn resolve(c: &Container, path: &str) -> (String, String) {
    c.volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let rest = path.strip_prefix(m.mount_path.trim_end_matches('/'))?;
            let rest = if rest.is_empty() {
                ""
            } else {
                rest.strip_prefix('/')?
            };
            Some((m.mount_path.len(), m.name.clone(), rest.to_string()))
        })
        .max()
        .map(|(_, v, rest)| (v, rest))
        .unwrap_or_else(|| panic!("{}: nothing mounted at {path}", c.name))
}

fn host_path<'a>(pod: &'a Pod, volume: &str) -> Option<&'a str> {
    pod.spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == volume)
        .unwrap_or_else(|| panic!("{}: no volume {volume}", pod.what))
        .host_path
        .as_ref()
        .map(|h| h.path.as_str())
}

fn env_field(c: &Container, var: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == var)?
        .value_from
        .as_ref()?
        .field_ref
        .as_ref()
        .map(|f| f.field_path.clone())
}

fn port_number(c: &Container, name: &str) -> i32 {
    c.ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("{}: no port named {name}", c.name))
        .container_port
}

fn http_endpoint_port(c: &Container) -> i32 {
    arg(c, "--http-endpoint")
        .and_then(|e| e.strip_prefix(':'))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{}: --http-endpoint=:PORT missing", c.name))
}

fn each_backend(check: impl Fn(&Manifests)) {
    for backend in BACKENDS {
        check(&load(backend));
    }
}

// ---------------------------------------------------------------------------------------------
// The checks

#[test]
fn csi_driver_and_classes_follow_the_backend() {
    each_backend(|m| {
        let driver = m.driver_name();
        let local = m.backend == "local";
        assert_eq!(
            driver,
            if local {
                "local.csi.ferrovol.dev"
            } else {
                "ebs.csi.ferrovol.dev"
            }
        );
        let spec = m.csi_drivers[0].spec.clone();
        assert_eq!(
            spec.attach_required,
            Some(!local),
            "{}: attachRequired",
            m.backend
        );
        assert_eq!(spec.pod_info_on_mount, Some(true));
        assert_eq!(spec.fs_group_policy.as_deref(), Some("File"));
        assert_eq!(
            spec.storage_capacity,
            Some(local),
            "{}: storageCapacity",
            m.backend
        );

        let has_attacher = m
            .all_containers()
            .iter()
            .any(|(_, c)| kind(c) == Kind::Attacher);
        assert_eq!(
            has_attacher, !local,
            "{}: an attacher exactly when attachRequired",
            m.backend
        );

        assert_eq!(m.storage_classes.len(), 1);
        let sc = &m.storage_classes[0];
        assert_eq!(sc.provisioner, driver);
        assert_eq!(
            sc.volume_binding_mode.as_deref(),
            Some("WaitForFirstConsumer")
        );
        let has_resizer = m
            .all_containers()
            .iter()
            .any(|(_, c)| kind(c) == Kind::Resizer);
        assert_eq!(
            sc.allow_volume_expansion,
            Some(has_resizer),
            "{}: allowVolumeExpansion must say whether a resizer runs",
            m.backend
        );
        assert_eq!(
            sc.parameters
                .as_ref()
                .and_then(|p| p.get("csi.storage.k8s.io/fstype"))
                .map(String::as_str),
            Some("ext4")
        );

        for class in &m.untyped {
            assert_eq!(class["driver"].as_str(), Some(driver.as_str()));
        }
        let has_snapshotter = m
            .all_containers()
            .iter()
            .any(|(_, c)| kind(c) == Kind::Snapshotter);
        assert_eq!(
            has_snapshotter,
            !m.untyped.is_empty(),
            "VolumeSnapshotClass iff snapshotter"
        );

        for (what, c) in m.all_containers() {
            if matches!(kind(&c), Kind::Node | Kind::Controller) {
                assert_eq!(
                    arg(&c, "--driver-name"),
                    Some(driver.as_str()),
                    "{what} {}",
                    c.name
                );
                assert_eq!(arg(&c, "--backend"), Some(m.backend), "{what} {}", c.name);
            }
        }
    });
}

#[test]
fn sidecars_and_plugins_share_their_sockets() {
    each_backend(|m| {
        for pod in m.pods() {
            let plugins: Vec<(&Container, (String, String))> = pod
                .spec
                .containers
                .iter()
                .filter(|c| matches!(kind(c), Kind::Node | Kind::Controller))
                .map(|c| (c, resolve(c, &socket(c).expect("plugin socket"))))
                .collect();
            assert!(!plugins.is_empty(), "{}: no plugin container", pod.what);
            let distinct: BTreeSet<_> = plugins.iter().map(|(_, s)| s.clone()).collect();
            assert_eq!(
                distinct.len(),
                plugins.len(),
                "{}: two plugins on one socket",
                pod.what
            );
            let mut users: BTreeMap<&str, Vec<Kind>> = BTreeMap::new();
            for c in &pod.spec.containers {
                if matches!(kind(c), Kind::Node | Kind::Controller) {
                    continue;
                }
                let path = socket(c)
                    .unwrap_or_else(|| panic!("{} {}: --csi-address missing", pod.what, c.name));
                let target = resolve(c, &path);
                let (plugin, _) = plugins
                    .iter()
                    .find(|(_, s)| *s == target)
                    .unwrap_or_else(|| {
                        panic!(
                            "{} {}: --csi-address={path} is {target:?}, which no plugin serves \
                             (plugins: {:?})",
                            pod.what,
                            c.name,
                            plugins
                                .iter()
                                .map(|(p, s)| (&p.name, s))
                                .collect::<Vec<_>>()
                        )
                    });
                users.entry(plugin.name.as_str()).or_default().push(kind(c));
            }
            for (plugin, _) in &plugins {
                let users = users.get(plugin.name.as_str()).cloned().unwrap_or_default();
                assert!(
                    users.contains(&Kind::LivenessProbe),
                    "{} {}: no livenessprobe on its socket",
                    pod.what,
                    plugin.name
                );
                let expected: &[Kind] = match kind(plugin) {
                    Kind::Node => &[Kind::Registrar],
                    _ => &[Kind::Provisioner],
                };
                for k in expected {
                    assert!(
                        users.contains(k),
                        "{} {}: no {k:?} on its socket",
                        pod.what,
                        plugin.name
                    );
                }
            }
        }
    });
}

#[test]
fn registrar_points_kubelet_at_the_node_socket() {
    each_backend(|m| {
        let driver = m.driver_name();
        assert_eq!(m.daemonsets.len(), 1);
        let pods = m.pods();
        let pod = pods
            .iter()
            .find(|p| p.what.starts_with("DaemonSet/"))
            .expect("node pod");
        let node = pod
            .spec
            .containers
            .iter()
            .find(|c| kind(c) == Kind::Node)
            .expect("csi-node");
        let kubelet_dir = arg(node, "--kubelet-dir").expect("--kubelet-dir");
        let (volume, inside) = resolve(node, &socket(node).expect("socket"));
        let host_dir = host_path(pod, &volume).expect("the node socket must be on a hostPath");
        assert_eq!(host_dir, format!("{kubelet_dir}/plugins/{driver}"));
        let on_host = format!("{host_dir}/{inside}");

        let registrars: Vec<&Container> = pod
            .spec
            .containers
            .iter()
            .filter(|c| kind(c) == Kind::Registrar)
            .collect();
        assert_eq!(registrars.len(), 1);
        let registrar = registrars[0];
        assert_eq!(
            arg(registrar, "--kubelet-registration-path"),
            Some(on_host.as_str())
        );
        let (reg_volume, reg_inside) = resolve(registrar, "/registration");
        assert_eq!(reg_inside, "");
        assert_eq!(
            host_path(pod, &reg_volume),
            Some(format!("{kubelet_dir}/plugins_registry").as_str())
        );
        // Its health endpoint is probed.
        let probe = registrar
            .liveness_probe
            .as_ref()
            .expect("registrar liveness probe");
        let port = probe.http_get.as_ref().expect("httpGet").port.clone();
        let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(port) = port else {
            panic!("named port expected");
        };
        assert_eq!(port_number(registrar, &port), http_endpoint_port(registrar));
    });
}

#[test]
fn node_plugin_mounts_propagate() {
    each_backend(|m| {
        let pods = m.pods();
        let pod = pods
            .iter()
            .find(|p| p.what.starts_with("DaemonSet/"))
            .expect("node pod");
        let node = pod
            .spec
            .containers
            .iter()
            .find(|c| kind(c) == Kind::Node)
            .expect("csi-node");
        let kubelet_dir = arg(node, "--kubelet-dir").expect("--kubelet-dir");
        let mount = |c: &Container, path: &str| {
            c.volume_mounts
                .iter()
                .flatten()
                .find(|v| v.mount_path == path)
                .cloned()
                .unwrap_or_else(|| panic!("{}: nothing mounted at {path}", c.name))
        };
        let kubelet = mount(node, kubelet_dir);
        assert_eq!(
            host_path(pod, &kubelet.name),
            Some(kubelet_dir),
            "kubelet dir at its host path"
        );
        assert_eq!(kubelet.mount_propagation.as_deref(), Some("Bidirectional"));
        // Bidirectional propagation is only allowed in a privileged container.
        assert_eq!(
            node.security_context.as_ref().and_then(|s| s.privileged),
            Some(true)
        );
        let dev = mount(node, "/dev");
        assert_eq!(host_path(pod, &dev.name), Some("/dev"));

        let state_dir = arg(node, "--state-dir").expect("--state-dir");
        let state = mount(node, state_dir);
        let host_state = host_path(pod, &state.name).expect("state dir on a hostPath");
        assert_eq!(host_state, state_dir);

        // No other container may propagate mounts to the host.
        for c in &pod.spec.containers {
            for v in c.volume_mounts.iter().flatten() {
                if v.mount_propagation.as_deref() == Some("Bidirectional") {
                    assert_eq!(kind(c), Kind::Node, "{}: Bidirectional mount", c.name);
                }
            }
        }

        let controller = pod
            .spec
            .containers
            .iter()
            .find(|c| kind(c) == Kind::Controller);
        if m.backend == "local" {
            let controller = controller.expect("local: csi-controller in the node pod");
            assert_eq!(arg(controller, "--state-dir"), Some(state_dir));
            let shared = mount(controller, state_dir);
            assert_eq!(
                host_path(pod, &shared.name),
                Some(host_state),
                "one state directory"
            );
            // It must see csi-node's staging mounts to freeze them.
            let seen = mount(controller, kubelet_dir);
            assert_eq!(host_path(pod, &seen.name), Some(kubelet_dir));
            assert_eq!(seen.mount_propagation.as_deref(), Some("HostToContainer"));
            for c in [node, controller] {
                assert_eq!(arg(c, "--node-id"), Some("$(NODE_NAME)"), "{}", c.name);
                assert_eq!(env_field(c, "NODE_NAME").as_deref(), Some("spec.nodeName"));
            }
        } else {
            assert!(
                controller.is_none(),
                "aws: no csi-controller in the node pod"
            );
        }
    });
}

#[test]
fn liveness_probes_reach_the_plugins() {
    each_backend(|m| {
        for pod in m.pods() {
            for plugin in pod
                .spec
                .containers
                .iter()
                .filter(|c| matches!(kind(c), Kind::Node | Kind::Controller))
            {
                let target = resolve(plugin, &socket(plugin).expect("socket"));
                let prober = pod
                    .spec
                    .containers
                    .iter()
                    .filter(|c| kind(c) == Kind::LivenessProbe)
                    .find(|c| resolve(c, &socket(c).expect("--csi-address")) == target)
                    .unwrap_or_else(|| panic!("{} {}: no livenessprobe", pod.what, plugin.name));
                let probe = plugin
                    .liveness_probe
                    .as_ref()
                    .expect("plugin liveness probe");
                let get = probe.http_get.as_ref().expect("httpGet");
                assert_eq!(get.path.as_deref(), Some("/healthz"));
                let k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(port) =
                    &get.port
                else {
                    panic!("named port expected");
                };
                assert_eq!(
                    port_number(plugin, port),
                    http_endpoint_port(prober),
                    "{} {}: the probe's port is {}'s",
                    pod.what,
                    plugin.name,
                    prober.name
                );
            }
        }
    });
}

#[test]
fn sidecars_run_in_the_backends_mode() {
    each_backend(|m| {
        let local = m.backend == "local";
        if local {
            assert!(m.deployments.is_empty(), "local: no central Deployment");
        } else {
            assert_eq!(m.deployments.len(), 1, "aws: one central Deployment");
        }
        for pod in m.pods() {
            let node_pod = pod.what.starts_with("DaemonSet/");
            let leader_election = pod.replicas.is_some_and(|r| r > 1);
            for c in &pod.spec.containers {
                let k = kind(c);
                let controller_sidecar = matches!(
                    k,
                    Kind::Provisioner | Kind::Attacher | Kind::Resizer | Kind::Snapshotter
                );
                if !controller_sidecar {
                    continue;
                }
                assert_eq!(
                    node_pod,
                    local,
                    "{} {}: controller sidecars belong in the {} pod",
                    pod.what,
                    c.name,
                    if local { "node" } else { "controller" }
                );
                assert_eq!(
                    has(c, "--leader-election"),
                    leader_election,
                    "{} {}: leader election",
                    pod.what,
                    c.name
                );
                assert!(
                    arg(c, "--timeout").is_some(),
                    "{}: --timeout chosen",
                    c.name
                );
                if local {
                    assert!(
                        matches!(k, Kind::Provisioner | Kind::Snapshotter),
                        "local: {k:?} has no node mode"
                    );
                    assert!(has(c, "--node-deployment"), "{}: --node-deployment", c.name);
                    assert_eq!(
                        env_field(c, "NODE_NAME").as_deref(),
                        Some("spec.nodeName"),
                        "{}",
                        c.name
                    );
                }
                if k == Kind::Provisioner {
                    assert!(has(c, "--extra-create-metadata"));
                    assert_eq!(arg(c, "--default-fstype"), Some("ext4"));
                    assert_eq!(
                        has(c, "--enable-capacity"),
                        local,
                        "capacity tracking for local"
                    );
                    if local {
                        assert!(has(c, "--strict-topology"));
                        // Level 1 above the pod: the DaemonSet owns the CSIStorageCapacities.
                        assert_eq!(arg(c, "--capacity-ownerref-level"), Some("1"));
                        assert_eq!(
                            env_field(c, "NAMESPACE").as_deref(),
                            Some("metadata.namespace")
                        );
                        assert_eq!(env_field(c, "POD_NAME").as_deref(), Some("metadata.name"));
                    }
                }
            }
        }
        let kinds: BTreeSet<Kind> = m.all_containers().iter().map(|(_, c)| kind(c)).collect();
        let expected: BTreeSet<Kind> = if local {
            [
                Kind::Node,
                Kind::Controller,
                Kind::Provisioner,
                Kind::Snapshotter,
                Kind::LivenessProbe,
                Kind::Registrar,
            ]
            .into()
        } else {
            [
                Kind::Node,
                Kind::Controller,
                Kind::Provisioner,
                Kind::Attacher,
                Kind::Resizer,
                Kind::Snapshotter,
                Kind::LivenessProbe,
                Kind::Registrar,
            ]
            .into()
        };
        assert_eq!(kinds, expected, "{}: containers", m.backend);
    });
}

#[test]
fn pods_are_as_privileged_as_they_must_be_and_no_more() {
    each_backend(|m| {
        for pod in m.pods() {
            let node_pod = pod.what.starts_with("DaemonSet/");
            assert_eq!(
                pod.spec.priority_class_name.as_deref(),
                Some(if node_pod {
                    "system-node-critical"
                } else {
                    "system-cluster-critical"
                })
            );
            let sa = pod
                .spec
                .service_account_name
                .as_deref()
                .expect("own service account");
            assert!(
                m.service_accounts.iter().any(|s| name(&s.metadata) == sa
                    && s.metadata.namespace.as_deref() == Some(pod.namespace.as_str())),
                "{}: service account {sa} is not rendered",
                pod.what
            );
            if node_pod {
                let tolerations = pod.spec.tolerations.as_deref().unwrap_or_default();
                assert!(
                    tolerations
                        .iter()
                        .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
                    "the node plugin tolerates every taint"
                );
            } else {
                let sc = pod
                    .spec
                    .security_context
                    .as_ref()
                    .expect("pod securityContext");
                assert_eq!(sc.run_as_non_root, Some(true));
                assert_eq!(sc.run_as_user, Some(65532), "the controller image's user");
            }
            for c in &pod.spec.containers {
                if matches!(kind(c), Kind::Node | Kind::Controller) {
                    // The root filesystem is read-only: the state directory must be a volume.
                    let dir = arg(c, "--state-dir")
                        .unwrap_or_else(|| panic!("{} {}: --state-dir", pod.what, c.name));
                    resolve(c, dir);
                }
                let sc = c
                    .security_context
                    .as_ref()
                    .unwrap_or_else(|| panic!("{}: securityContext", c.name));
                assert_eq!(
                    sc.read_only_root_filesystem,
                    Some(true),
                    "{}: read-only root",
                    c.name
                );
                let privileged = sc.privileged == Some(true);
                let must = node_pod && matches!(kind(c), Kind::Node | Kind::Controller);
                assert_eq!(privileged, must, "{} {}: privileged", pod.what, c.name);
                if !privileged {
                    assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", c.name);
                    let drop = sc
                        .capabilities
                        .as_ref()
                        .and_then(|c| c.drop.clone())
                        .unwrap_or_default();
                    assert_eq!(drop, ["ALL"], "{}: drops every capability", c.name);
                    assert!(
                        sc.capabilities
                            .as_ref()
                            .and_then(|c| c.add.as_ref())
                            .is_none()
                    );
                }
                let resources = c
                    .resources
                    .as_ref()
                    .unwrap_or_else(|| panic!("{}: resources", c.name));
                let requests = resources.requests.as_ref().expect("requests");
                assert!(
                    requests.contains_key("cpu") && requests.contains_key("memory"),
                    "{}",
                    c.name
                );
                assert!(
                    resources
                        .limits
                        .as_ref()
                        .is_some_and(|l| l.contains_key("memory")),
                    "{}: memory limit",
                    c.name
                );
                let image = c.image.as_deref().expect("image");
                let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or_default();
                assert!(
                    !tag.is_empty() && tag != "latest" && !tag.contains('/'),
                    "{}: pinned image",
                    c.name
                );
            }
        }
        if m.backend == "aws" {
            let pdb = m.pdbs.first().expect("aws: a PodDisruptionBudget");
            let selector = pdb
                .spec
                .as_ref()
                .and_then(|s| s.selector.as_ref())
                .and_then(|s| s.match_labels.clone())
                .expect("selector");
            let labels = m.deployments[0]
                .spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.labels.clone())
                .expect("pod labels");
            assert!(
                selector.iter().all(|(k, v)| labels.get(k) == Some(v)),
                "the PDB selects the controller pods"
            );
        }
    });
}

// ---------------------------------------------------------------------------------------------
// RBAC

/// (namespace or "" for cluster-wide, API group, resource, verb)
type Grant = (String, String, String, String);

fn expand(scope: &str, group: &str, resources: &[&str], verbs: &[&str]) -> Vec<Grant> {
    let mut out = Vec::new();
    for r in resources {
        for v in verbs {
            out.push((
                scope.to_string(),
                group.to_string(),
                (*r).to_string(),
                (*v).to_string(),
            ));
        }
    }
    out
}

const READ: &[&str] = &["get", "list", "watch"];
const EVENTS: &[&str] = &["list", "watch", "create", "update", "patch"];
const LEASES: &[&str] = &["get", "watch", "list", "delete", "update", "create"];

/// What each container needs, from the sidecars' upstream rbac.yaml (external-provisioner
/// v6.3.0, external-attacher v4.12.0, external-resizer v2.2, external-snapshotter v8.6.0),
/// narrowed to the mode the container runs in.
fn needs(c: &Container, namespace: &str, snapshots: bool, attach: bool) -> Vec<Grant> {
    let mut g = Vec::new();
    let le = has(c, "--leader-election");
    match kind(c) {
        Kind::Provisioner => {
            g.extend(expand(
                "",
                "",
                &["persistentvolumes"],
                &["get", "list", "watch", "create", "patch", "delete"],
            ));
            g.extend(expand(
                "",
                "",
                &["persistentvolumeclaims"],
                &["get", "list", "watch", "update"],
            ));
            g.extend(expand(
                "",
                "storage.k8s.io",
                &["storageclasses", "csinodes"],
                READ,
            ));
            g.extend(expand("", "", &["nodes"], READ));
            g.extend(expand("", "", &["events"], EVENTS));
            if snapshots {
                g.extend(expand(
                    "",
                    "snapshot.storage.k8s.io",
                    &["volumesnapshots"],
                    &["get", "list", "watch", "update"],
                ));
                g.extend(expand(
                    "",
                    "snapshot.storage.k8s.io",
                    &["volumesnapshotcontents"],
                    &["get", "list"],
                ));
            }
            if attach {
                g.extend(expand("", "storage.k8s.io", &["volumeattachments"], READ));
            }
            if has(c, "--enable-capacity") {
                g.extend(expand(
                    namespace,
                    "storage.k8s.io",
                    &["csistoragecapacities"],
                    &[
                        "get", "list", "watch", "create", "update", "patch", "delete",
                    ],
                ));
                // The owner lookup (--capacity-ownerref-level=1) reads the pod only.
                g.extend(expand(namespace, "", &["pods"], &["get"]));
            }
        }
        Kind::Attacher => {
            g.extend(expand(
                "",
                "",
                &["persistentvolumes"],
                &["get", "list", "watch", "patch"],
            ));
            g.extend(expand("", "storage.k8s.io", &["csinodes"], READ));
            g.extend(expand(
                "",
                "storage.k8s.io",
                &["volumeattachments"],
                &["get", "list", "watch", "patch"],
            ));
            g.extend(expand(
                "",
                "storage.k8s.io",
                &["volumeattachments/status"],
                &["patch"],
            ));
        }
        Kind::Resizer => {
            g.extend(expand(
                "",
                "",
                &["persistentvolumes"],
                &["get", "list", "watch", "patch"],
            ));
            g.extend(expand("", "", &["persistentvolumeclaims"], READ));
            g.extend(expand(
                "",
                "",
                &["persistentvolumeclaims/status"],
                &["patch"],
            ));
            g.extend(expand("", "", &["events"], EVENTS));
            g.extend(expand(
                "",
                "storage.k8s.io",
                &["volumeattributesclasses"],
                READ,
            ));
            if arg(c, "--handle-volume-inuse-error") != Some("false") {
                g.extend(expand("", "", &["pods"], READ));
            }
        }
        Kind::Snapshotter => {
            g.extend(expand("", "", &["events"], EVENTS));
            g.extend(expand(
                "",
                "snapshot.storage.k8s.io",
                &["volumesnapshotclasses"],
                READ,
            ));
            g.extend(expand(
                "",
                "snapshot.storage.k8s.io",
                &["volumesnapshotcontents"],
                &["get", "list", "watch", "update", "patch"],
            ));
            g.extend(expand(
                "",
                "snapshot.storage.k8s.io",
                &["volumesnapshotcontents/status"],
                &["update", "patch"],
            ));
        }
        Kind::Node => {
            if arg(c, "--remove-taint").is_some() {
                // csi-node waits for its CSINode to list the driver, then patches its Node.
                g.extend(expand("", "", &["nodes"], &["get", "patch"]));
                g.extend(expand("", "storage.k8s.io", &["csinodes"], &["get"]));
            }
        }
        Kind::Controller | Kind::LivenessProbe | Kind::Registrar => {}
    }
    if le {
        g.extend(expand(
            namespace,
            "coordination.k8s.io",
            &["leases"],
            LEASES,
        ));
    }
    g
}

fn rule_grants(scope: &str, rules: &[PolicyRule], what: &str) -> Vec<Grant> {
    let mut out = Vec::new();
    for rule in rules {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "{what}: unexpected rule shape"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                for verb in &rule.verbs {
                    assert!(
                        group != "*" && resource != "*" && verb != "*",
                        "{what}: wildcard"
                    );
                    out.push((
                        scope.to_string(),
                        group.clone(),
                        resource.clone(),
                        verb.clone(),
                    ));
                }
            }
        }
    }
    out
}

fn granted(m: &Manifests, sa: &str, namespace: &str) -> BTreeSet<Grant> {
    let is_subject = |subjects: &Option<Vec<k8s_openapi::api::rbac::v1::Subject>>| {
        subjects.iter().flatten().any(|s| {
            s.kind == "ServiceAccount" && s.name == sa && s.namespace.as_deref() == Some(namespace)
        })
    };
    let mut out = BTreeSet::new();
    for b in &m.cluster_role_bindings {
        if is_subject(&b.subjects) {
            assert_eq!(b.role_ref.kind, "ClusterRole");
            let role = m
                .cluster_roles
                .iter()
                .find(|r| name(&r.metadata) == b.role_ref.name)
                .unwrap_or_else(|| {
                    panic!(
                        "ClusterRoleBinding {} names a missing role",
                        name(&b.metadata)
                    )
                });
            out.extend(rule_grants(
                "",
                role.rules.as_deref().unwrap_or_default(),
                &name(&role.metadata),
            ));
        }
    }
    for b in &m.role_bindings {
        if is_subject(&b.subjects) {
            assert_eq!(b.role_ref.kind, "Role");
            let ns = b.metadata.namespace.as_deref().expect("namespaced binding");
            let role = m
                .roles
                .iter()
                .find(|r| {
                    name(&r.metadata) == b.role_ref.name
                        && r.metadata.namespace.as_deref() == Some(ns)
                })
                .unwrap_or_else(|| {
                    panic!("RoleBinding {} names a missing role", name(&b.metadata))
                });
            out.extend(rule_grants(
                ns,
                role.rules.as_deref().unwrap_or_default(),
                &name(&role.metadata),
            ));
        }
    }
    out
}

#[test]
fn rbac_grants_each_pod_exactly_what_its_containers_need() {
    each_backend(|m| {
        let snapshots = !m.untyped.is_empty();
        let attach = m.csi_drivers[0].spec.attach_required == Some(true);
        let mut accounts = BTreeSet::new();
        for pod in m.pods() {
            let sa = pod
                .spec
                .service_account_name
                .clone()
                .expect("service account");
            accounts.insert(sa.clone());
            let need: BTreeSet<Grant> = pod
                .spec
                .containers
                .iter()
                .flat_map(|c| needs(c, &pod.namespace, snapshots, attach))
                .collect();
            let have = granted(m, &sa, &pod.namespace);
            let missing: Vec<_> = need.difference(&have).collect();
            let extra: Vec<_> = have.difference(&need).collect();
            assert!(
                missing.is_empty() && extra.is_empty(),
                "{} ({}): service account {sa}\n  missing: {missing:?}\n  extra: {extra:?}",
                pod.what,
                m.backend
            );
        }
        // Every role is bound, and only to the pods' service accounts.
        for b in &m.cluster_role_bindings {
            for s in b.subjects.iter().flatten() {
                assert!(
                    accounts.contains(&s.name),
                    "{} binds {}",
                    name(&b.metadata),
                    s.name
                );
            }
        }
        for r in &m.cluster_roles {
            assert!(
                m.cluster_role_bindings
                    .iter()
                    .any(|b| b.role_ref.name == name(&r.metadata)),
                "ClusterRole {} is bound to nobody",
                name(&r.metadata)
            );
        }
        for r in &m.roles {
            assert!(
                m.role_bindings
                    .iter()
                    .any(|b| b.role_ref.name == name(&r.metadata)),
                "Role {} is bound to nobody",
                name(&r.metadata)
            );
        }
    });
}
