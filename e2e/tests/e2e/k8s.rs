//! Kubernetes helpers: a namespace per case, objects built from JSON, bounded waits, exec, and
//! the diagnostics printed when a case fails.

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::core::v1::{Event, Namespace, PersistentVolumeClaim, Pod};
use kube::Client;
use kube::api::{Api, AttachParams, DeleteParams, ListParams, LogParams, Patch, PatchParams};
use kube::api::{DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use std::future::Future;
use std::time::{Duration, Instant};
use tokio::io::AsyncReadExt;

/// Every namespace, StorageClass and the like the tests create carries this label, so that the
/// cleanup case (and `cargo xtask e2e`) can find leftovers of any run.
pub const PART_OF: (&str, &str) = ("app.kubernetes.io/part-of", "ferrovol-e2e");
pub const WORKLOAD_IMAGE: &str = "localhost/ferrovol-e2e/busybox:1";
const POLL: Duration = Duration::from_secs(1);

pub fn label_selector() -> String {
    format!("{}={}", PART_OF.0, PART_OF.1)
}

/// The state of something being waited for: done, or not yet and what it looks like now.
pub enum Poll<T> {
    Ready(T),
    Pending(String),
}

/// Polls `check` every second until it is ready, fails, or `timeout` passes. API errors count as
/// "not yet": the API server of a loaded one-node cluster can hiccup.
pub async fn wait<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Poll<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last;
    loop {
        match check().await {
            Ok(Poll::Ready(v)) => return Ok(v),
            Ok(Poll::Pending(state)) => last = state,
            Err(err) if is_api_error(&err) => last = format!("API error: {err:#}"),
            Err(err) => return Err(err.context(format!("while waiting for {what}"))),
        }
        if Instant::now() >= deadline {
            bail!(
                "timed out after {} s waiting for {what}; last seen: {last}",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

fn is_api_error(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|e| e.downcast_ref::<kube::Error>().is_some())
}

/// A random-enough suffix for names: several runs may share a cluster.
pub fn suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    format!(
        "{:06x}",
        (nanos ^ std::process::id().rotate_left(16)) & 0xff_ffff
    )
}

pub fn snapshot_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshot",
    ))
}

pub fn snapshot_content_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "snapshot.storage.k8s.io",
        "v1",
        "VolumeSnapshotContent",
    ))
}

/// Output of a command run in a container.
pub struct Exec {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// A case's namespace.
#[derive(Clone)]
pub struct Ns {
    pub client: Client,
    pub name: String,
}

impl Ns {
    pub async fn create(client: &Client, case: &str) -> Result<Ns> {
        let short: String = case.chars().take(30).collect::<String>().replace('_', "-");
        let name = format!("e2e-{}-{}", short.trim_end_matches('-'), suffix());
        let ns: Namespace = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {(PART_OF.0): PART_OF.1}},
        }))?;
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        Ok(Ns {
            client: client.clone(),
            name,
        })
    }

    pub async fn delete(&self) -> Result<()> {
        match Api::<Namespace>::all(self.client.clone())
            .delete(&self.name, &DeleteParams::default())
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    pub fn dynamic(&self, ar: &ApiResource) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.name, ar)
    }

    /// Creates a namespaced object given as JSON (`kind` and `apiVersion` included).
    pub async fn make<K>(&self, object: Value) -> Result<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + std::fmt::Debug
            + serde::de::DeserializeOwned
            + serde::Serialize,
        <K as kube::Resource>::DynamicType: Default,
    {
        let what = object["metadata"]["name"]
            .as_str()
            .unwrap_or("?")
            .to_string();
        let typed: K = serde_json::from_value(object).context("building the object")?;
        self.api::<K>()
            .create(&PostParams::default(), &typed)
            .await
            .with_context(|| format!("creating {what} in {}", self.name))
    }

    pub async fn pvc(&self, name: &str) -> Result<PersistentVolumeClaim> {
        Ok(self.api::<PersistentVolumeClaim>().get(name).await?)
    }

    pub async fn pod(&self, name: &str) -> Result<Pod> {
        Ok(self.api::<Pod>().get(name).await?)
    }

    /// Waits until pod `name` runs with every container ready; fails at once if it ended.
    pub async fn wait_running(&self, name: &str, timeout: Duration) -> Result<Pod> {
        let api = self.api::<Pod>();
        wait(&format!("pod {}/{name} to run", self.name), timeout, || {
            let api = api.clone();
            async move {
                let Some(pod) = api.get_opt(name).await? else {
                    return Ok(Poll::Pending("no such pod yet".into()));
                };
                let status = pod.status.clone().unwrap_or_default();
                let phase = status.phase.clone().unwrap_or_default();
                if phase == "Failed" || phase == "Succeeded" {
                    bail!("pod {name} ended ({phase}): {}", describe_pod(&pod));
                }
                let ready = status
                    .container_statuses
                    .as_ref()
                    .is_some_and(|cs| !cs.is_empty() && cs.iter().all(|c| c.ready));
                if phase == "Running" && ready && pod.metadata.deletion_timestamp.is_none() {
                    Ok(Poll::Ready(pod))
                } else {
                    Ok(Poll::Pending(describe_pod(&pod)))
                }
            }
        })
        .await
    }

    /// Deletes pod `name` and waits until it is gone (its volumes unpublished).
    pub async fn delete_pod(&self, name: &str, timeout: Duration) -> Result<()> {
        let api = self.api::<Pod>();
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        wait(&format!("pod {}/{name} to go", self.name), timeout, || {
            let api = api.clone();
            async move {
                Ok(match api.get_opt(name).await? {
                    None => Poll::Ready(()),
                    Some(pod) => Poll::Pending(describe_pod(&pod)),
                })
            }
        })
        .await
    }

    /// Waits until claim `name` is Bound; returns its PV's name.
    pub async fn wait_bound(&self, name: &str, timeout: Duration) -> Result<String> {
        let api = self.api::<PersistentVolumeClaim>();
        wait(
            &format!("claim {}/{name} to bind", self.name),
            timeout,
            || {
                let api = api.clone();
                async move {
                    let Some(pvc) = api.get_opt(name).await? else {
                        return Ok(Poll::Pending("no such claim".into()));
                    };
                    let phase = pvc
                        .status
                        .as_ref()
                        .and_then(|s| s.phase.clone())
                        .unwrap_or_default();
                    match pvc.spec.as_ref().and_then(|s| s.volume_name.clone()) {
                        Some(pv) if phase == "Bound" => Ok(Poll::Ready(pv)),
                        _ => Ok(Poll::Pending(format!("phase {phase:?}"))),
                    }
                }
            },
        )
        .await
    }

    /// Runs `script` with `sh -c` in pod `pod`.
    pub async fn exec(&self, pod: &str, script: &str) -> Result<Exec> {
        let mut attached = self
            .api::<Pod>()
            .exec(pod, ["sh", "-c", script], &AttachParams::default())
            .await
            .with_context(|| format!("exec in {}/{pod}", self.name))?;
        let (mut out, mut err) = (
            attached.stdout().context("no stdout")?,
            attached.stderr().context("no stderr")?,
        );
        let status = attached.take_status().context("no status channel")?;
        let (mut stdout, mut stderr) = (String::new(), String::new());
        let (a, b) = tokio::join!(
            out.read_to_string(&mut stdout),
            err.read_to_string(&mut stderr)
        );
        a?;
        b?;
        let status = status.await;
        attached.join().await.ok();
        let code = match status {
            Some(s) if s.status.as_deref() == Some("Success") => 0,
            Some(s) => s
                .details
                .and_then(|d| d.causes)
                .unwrap_or_default()
                .iter()
                .find(|c| c.reason.as_deref() == Some("ExitCode"))
                .and_then(|c| c.message.as_deref()?.parse().ok())
                .ok_or_else(|| anyhow!("exec in {pod} failed: {:?}", s.message))?,
            None => bail!("exec in {pod}: no exit status"),
        };
        Ok(Exec {
            code,
            stdout,
            stderr,
        })
    }

    /// [`exec`](Self::exec) that must succeed; returns stdout, trimmed.
    pub async fn sh(&self, pod: &str, script: &str) -> Result<String> {
        let out = self.exec(pod, script).await?;
        if out.code != 0 {
            bail!(
                "`{script}` in {pod} exited with {}: {}{}",
                out.code,
                out.stdout,
                out.stderr
            );
        }
        Ok(out.stdout.trim().to_string())
    }

    /// Events, pods (with logs), claims and snapshots of the namespace, for a failure report.
    pub async fn diagnostics(&self) -> String {
        let mut out = format!("---- diagnostics of namespace {} ----\n", self.name);
        if let Ok(events) = self.api::<Event>().list(&ListParams::default()).await {
            let mut events = events.items;
            events.sort_by_key(|e| {
                e.last_timestamp
                    .as_ref()
                    .map(|t| t.0)
                    .or_else(|| e.event_time.as_ref().map(|t| t.0))
            });
            out.push_str("events:\n");
            for e in events {
                out.push_str(&format!(
                    "  {} {}/{} {}: {}\n",
                    e.type_.unwrap_or_default(),
                    e.involved_object.kind.unwrap_or_default(),
                    e.involved_object.name.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default().trim()
                ));
            }
        }
        if let Ok(pvcs) = self
            .api::<PersistentVolumeClaim>()
            .list(&ListParams::default())
            .await
        {
            out.push_str("claims:\n");
            for pvc in pvcs.items {
                let status = pvc.status.unwrap_or_default();
                out.push_str(&format!(
                    "  {}: phase {:?}, volume {:?}, capacity {:?}, conditions {:?}\n",
                    pvc.metadata.name.unwrap_or_default(),
                    status.phase.unwrap_or_default(),
                    pvc.spec.and_then(|s| s.volume_name).unwrap_or_default(),
                    status.capacity.unwrap_or_default(),
                    status
                        .conditions
                        .unwrap_or_default()
                        .iter()
                        .map(|c| format!(
                            "{}={} {}",
                            c.type_,
                            c.status,
                            c.message.clone().unwrap_or_default()
                        ))
                        .collect::<Vec<_>>()
                ));
            }
        }
        if let Ok(snaps) = self
            .dynamic(&snapshot_resource())
            .list(&ListParams::default())
            .await
        {
            for s in snaps.items {
                out.push_str(&format!(
                    "snapshot {}: {}\n",
                    s.metadata.name.unwrap_or_default(),
                    s.data.get("status").cloned().unwrap_or_default()
                ));
            }
        }
        if let Ok(pods) = self.api::<Pod>().list(&ListParams::default()).await {
            for pod in pods.items {
                let name = pod.metadata.name.clone().unwrap_or_default();
                out.push_str(&format!("pod {name}: {}\n", describe_pod(&pod)));
                let params = LogParams {
                    tail_lines: Some(40),
                    ..LogParams::default()
                };
                if let Ok(log) = self.api::<Pod>().logs(&name, &params).await
                    && !log.trim().is_empty()
                {
                    out.push_str(&indent(&log));
                }
            }
        }
        out
    }
}

/// One line about a pod: phase, node, conditions that are not true, container states.
pub fn describe_pod(pod: &Pod) -> String {
    let status = pod.status.clone().unwrap_or_default();
    let mut parts = vec![format!(
        "phase {}",
        status.phase.clone().unwrap_or_else(|| "?".into())
    )];
    if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
        parts.push(format!("node {node}"));
    }
    if pod.metadata.deletion_timestamp.is_some() {
        parts.push("terminating".into());
    }
    for c in status.conditions.unwrap_or_default() {
        if c.status != "True" {
            parts.push(format!(
                "{}={} ({}: {})",
                c.type_,
                c.status,
                c.reason.unwrap_or_default(),
                c.message.unwrap_or_default()
            ));
        }
    }
    for c in status.container_statuses.unwrap_or_default() {
        let state = c.state.unwrap_or_default();
        if let Some(w) = state.waiting {
            parts.push(format!(
                "{} waiting: {} {}",
                c.name,
                w.reason.unwrap_or_default(),
                w.message.unwrap_or_default()
            ));
        } else if let Some(t) = state.terminated {
            parts.push(format!(
                "{} terminated: exit {} {}",
                c.name,
                t.exit_code,
                t.reason.unwrap_or_default()
            ));
        }
        if c.restart_count > 0 {
            parts.push(format!("{} restarted {} times", c.name, c.restart_count));
        }
    }
    parts.join("; ")
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    | {l}\n")).collect()
}

/// The last lines of every container of the driver's pods (kube-system, chart labels), covering
/// `since`: what the driver did during a failed case.
pub async fn driver_logs(client: &Client, since: Duration) -> String {
    let api: Api<Pod> = Api::namespaced(client.clone(), "kube-system");
    let mut out = String::from("---- driver logs ----\n");
    let pods = match api
        .list(&ListParams::default().labels("app.kubernetes.io/name=ferrovol"))
        .await
    {
        Ok(p) => p.items,
        Err(e) => return format!("{out}cannot list the driver's pods: {e}\n"),
    };
    for pod in pods {
        let name = pod.metadata.name.clone().unwrap_or_default();
        out.push_str(&format!("pod kube-system/{name}: {}\n", describe_pod(&pod)));
        for c in pod.spec.map(|s| s.containers).unwrap_or_default() {
            let params = LogParams {
                container: Some(c.name.clone()),
                tail_lines: Some(60),
                since_seconds: Some(since.as_secs() as i64 + 30),
                ..LogParams::default()
            };
            match api.logs(&name, &params).await {
                Ok(log) if !log.trim().is_empty() => {
                    out.push_str(&format!("  {}:\n{}", c.name, indent(&log)));
                }
                Ok(_) => {}
                Err(e) => out.push_str(&format!("  {}: no logs: {e}\n", c.name)),
            }
        }
    }
    out
}

/// A claim of `size` on `class`; `extra` is merged into its spec (volumeMode, dataSource…).
pub fn pvc(name: &str, class: &str, size: &str, access: &str, extra: Value) -> Value {
    let mut spec = json!({
        "storageClassName": class,
        "accessModes": [access],
        "resources": {"requests": {"storage": size}},
    });
    if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            spec.insert(k.clone(), v.clone());
        }
    }
    json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": spec,
    })
}

/// How a pod uses a claim.
pub enum Use<'a> {
    /// Mounted at `path`; `read_only` sets the pod volume's `persistentVolumeClaim.readOnly`,
    /// which kubelet passes to the driver as a read-only publish.
    Mount {
        claim: &'a str,
        path: &'a str,
        read_only: bool,
    },
    /// A raw block device at `path`.
    Device { claim: &'a str, path: &'a str },
}

/// The workload pod: busybox idling until told to stop, using `uses`, pinned to `node` if set.
pub fn pod(name: &str, uses: &[Use], node: Option<&str>) -> Value {
    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    let mut devices = Vec::new();
    for (i, u) in uses.iter().enumerate() {
        let vol = format!("v{i}");
        match u {
            Use::Mount {
                claim,
                path,
                read_only,
            } => {
                volumes.push(json!({"name": vol, "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}));
                mounts.push(json!({"name": vol, "mountPath": path}));
            }
            Use::Device { claim, path } => {
                volumes.push(json!({"name": vol, "persistentVolumeClaim": {"claimName": claim}}));
                devices.push(json!({"name": vol, "devicePath": path}));
            }
        }
    }
    let mut spec = json!({
        // The workload sleeps in one-second steps so that SIGTERM ends it at once.
        "terminationGracePeriodSeconds": 2,
        "containers": [{
            "name": "app",
            "image": WORKLOAD_IMAGE,
            // Imported into the node's containerd; there is no registry to pull from.
            "imagePullPolicy": "Never",
            "command": ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"],
            "volumeMounts": mounts,
            "volumeDevices": devices,
        }],
        "volumes": volumes,
    });
    if let Some(node) = node {
        spec["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    }
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": spec,
    })
}

/// Merge-patches the requested size of claim `name`.
pub async fn resize(ns: &Ns, name: &str, size: &str) -> Result<PersistentVolumeClaim> {
    let patch = json!({"spec": {"resources": {"requests": {"storage": size}}}});
    Ok(ns
        .api::<PersistentVolumeClaim>()
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?)
}
