//! The cases. Each gets a fresh namespace; the harness deletes it afterwards, and the `cleanup`
//! case, run last, checks that deleting everything leaves nothing behind.

use crate::config::{Backend, Ctx};
use crate::host;
use crate::k8s::{self, Ns, Poll, Use, wait};
use crate::{Case, Outcome};
use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Namespace, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{StorageClass, VolumeAttachment};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, PostParams};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub static ALL: &[Case] = &[
    Case {
        name: "statefulset_data_survives_pod_restart",
        run: |c, ns| Box::pin(statefulset(c, ns)),
        last: false,
    },
    Case {
        name: "online_expansion",
        run: |c, ns| Box::pin(online_expansion(c, ns)),
        last: false,
    },
    Case {
        name: "snapshot_restore",
        run: |c, ns| Box::pin(snapshot_restore(c, ns)),
        last: false,
    },
    Case {
        name: "clone_from_pvc",
        run: |c, ns| Box::pin(clone_from_pvc(c, ns)),
        last: false,
    },
    Case {
        name: "raw_block_device",
        run: |c, ns| Box::pin(raw_block(c, ns)),
        last: false,
    },
    Case {
        name: "read_only_mount",
        run: |c, ns| Box::pin(read_only(c, ns)),
        last: false,
    },
    Case {
        name: "read_write_once_pod",
        run: |c, ns| Box::pin(rwop(c, ns)),
        last: false,
    },
    Case {
        name: "manifests_server_dry_run",
        run: |c, ns| Box::pin(manifests_dry_run(c, ns)),
        last: false,
    },
    Case {
        name: "cleanup_leaves_nothing",
        run: |c, ns| Box::pin(cleanup(c, ns)),
        last: true,
    },
];

/// 1 GiB: EBS sizes are whole GiB, and both backends' volumes are sparse.
const SIZE: &str = "1Gi";
/// Binding includes provisioning, which waits for the pod to be scheduled.
const BIND: Duration = Duration::from_secs(180);
/// A pod with a volume: provision (or restore, or copy), attach, stage, publish.
const RUN: Duration = Duration::from_secs(240);
const GONE: Duration = Duration::from_secs(120);

fn token() -> String {
    format!("ferrovol-e2e-{}", k8s::suffix())
}

async fn node_of(ns: &Ns, pod: &str) -> Result<String> {
    ns.pod(pod)
        .await?
        .spec
        .and_then(|s| s.node_name)
        .context("the pod has no node")
}

/// Writes `data` to `file` in pod `pod` and flushes it to the device: snapshots and clones copy
/// the device, not the page cache.
async fn write_file(ns: &Ns, pod: &str, file: &str, data: &str) -> Result<()> {
    ns.sh(pod, &format!("printf %s '{data}' > {file} && sync"))
        .await
        .map(drop)
}

async fn read_file(ns: &Ns, pod: &str, file: &str) -> Result<String> {
    ns.sh(pod, &format!("cat {file}")).await
}

/// The file-system type and options of the mount at `path` in `pod`, from /proc/mounts.
async fn mount_of(ns: &Ns, pod: &str, path: &str) -> Result<(String, String)> {
    let line = ns
        .sh(pod, &format!("grep ' {path} ' /proc/mounts"))
        .await
        .with_context(|| format!("{path} is not a mount point in {pod}"))?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    ensure!(fields.len() >= 4, "odd /proc/mounts line {line:?}");
    Ok((fields[2].to_string(), fields[3].to_string()))
}

/// The PV behind a claim must be this driver's.
async fn check_pv_driver(ctx: &Ctx, pv: &str) -> Result<()> {
    let pv = Api::<PersistentVolume>::all(ctx.client.clone())
        .get(pv)
        .await?;
    let driver = pv
        .spec
        .and_then(|s| s.csi)
        .map(|c| c.driver)
        .unwrap_or_default();
    ensure!(
        driver == ctx.cfg.driver,
        "the claim is bound to a volume of driver {driver:?}, not {}",
        ctx.cfg.driver
    );
    Ok(())
}

/// 1. A StatefulSet's claim binds, its pod writes; the pod is deleted and recreated by the
///    StatefulSet controller, and the data is still there.
async fn statefulset(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    let pod = k8s::pod(
        "unused",
        &[Use::Mount {
            claim: "data",
            path: "/data",
            read_only: false,
        }],
        None,
    );
    let mut template = pod["spec"].clone();
    template["volumes"] = json!([]);
    template["containers"][0]["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]);
    ns.make::<StatefulSet>(json!({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "web"},
        "spec": {
            "serviceName": "web",
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {"metadata": {"labels": {"app": "web"}}, "spec": template},
            "volumeClaimTemplates": [{
                "metadata": {"name": "data"},
                "spec": {
                    "storageClassName": cfg.storage_class,
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": SIZE}},
                },
            }],
        },
    }))
    .await?;
    let first = ns.wait_running("web-0", RUN).await?;
    let pv = ns.wait_bound("data-web-0", BIND).await?;
    check_pv_driver(&ctx, &pv).await?;
    let (fs, _) = mount_of(&ns, "web-0", "/data").await?;
    ensure!(
        fs == cfg.fs_type,
        "/data is {fs}, the StorageClass asks for {}",
        cfg.fs_type
    );
    let data = token();
    write_file(&ns, "web-0", "/data/token", &data).await?;

    let first_uid = first.metadata.uid.unwrap_or_default();
    ns.api::<Pod>()
        .delete("web-0", &DeleteParams::default())
        .await?;
    let api = ns.api::<Pod>();
    wait("web-0 to be recreated", RUN, || {
        let (api, first_uid) = (api.clone(), first_uid.clone());
        async move {
            Ok(match api.get_opt("web-0").await? {
                Some(p) if p.metadata.uid.as_deref() != Some(first_uid.as_str()) => Poll::Ready(()),
                Some(p) => Poll::Pending(format!("still the old pod: {}", k8s::describe_pod(&p))),
                None => Poll::Pending("no pod".into()),
            })
        }
    })
    .await?;
    ns.wait_running("web-0", RUN).await?;
    let got = read_file(&ns, "web-0", "/data/token").await?;
    ensure!(
        got == data,
        "after the restart /data/token holds {got:?}, not {data:?}"
    );
    // The claim must be the same one, not a new empty volume that happens to be mounted.
    ensure!(
        ns.wait_bound("data-web-0", BIND).await? == pv,
        "the claim was re-bound to another volume"
    );
    Ok(Outcome::Passed)
}

/// 2. Online expansion: the claim grows and so does the file system under the running pod.
async fn online_expansion(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    if cfg.backend == Backend::Local {
        // The chart offers no expansion for local (no node-local resizer, see values.yaml), and
        // says so with allowVolumeExpansion: false. Check that the API server refuses a resize,
        // then report the case as not applicable.
        let sc = Api::<StorageClass>::all(ctx.client.clone())
            .get(&cfg.storage_class)
            .await?;
        ensure!(
            sc.allow_volume_expansion != Some(true),
            "the local StorageClass allows expansion, but the chart runs no resizer for local"
        );
        ns.make::<PersistentVolumeClaim>(k8s::pvc(
            "data",
            &cfg.storage_class,
            SIZE,
            "ReadWriteOnce",
            json!({}),
        ))
        .await?;
        ns.make::<Pod>(k8s::pod(
            "app",
            &[Use::Mount {
                claim: "data",
                path: "/data",
                read_only: false,
            }],
            None,
        ))
        .await?;
        ns.wait_running("app", RUN).await?;
        match k8s::resize(&ns, "data", "2Gi").await {
            Ok(_) => bail!("the API server accepted a resize on a StorageClass without expansion"),
            Err(e) if format!("{e:#}").contains("resize") => {}
            Err(e) => bail!("the resize was refused, but not for the expected reason: {e:#}"),
        }
        return Ok(Outcome::Skipped(
            "not applicable to the local backend: the chart runs no resizer for it and its \
             StorageClass has allowVolumeExpansion: false (checked: the API server refuses a \
             resize)"
                .into(),
        ));
    }

    // xfs, not the chart's ext4: growing a mounted ext4 needs CAP_SYS_RESOURCE for the resize
    // ioctl, which this sandbox's node plugin lacks, so the driver answers FAILED_PRECONDITION
    // and grows ext4 offline at the next stage. xfs_growfs works online.
    let class = format!("ferrovol-e2e-xfs-{}", k8s::suffix());
    let sc: StorageClass = serde_json::from_value(json!({
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": class, "labels": {(k8s::PART_OF.0): k8s::PART_OF.1}},
        "provisioner": cfg.driver,
        "volumeBindingMode": "WaitForFirstConsumer",
        "reclaimPolicy": "Delete",
        "allowVolumeExpansion": true,
        "parameters": {"csi.storage.k8s.io/fstype": "xfs"},
    }))?;
    let classes = Api::<StorageClass>::all(ctx.client.clone());
    classes.create(&PostParams::default(), &sc).await?;
    let result = grow(&ctx, &ns, &class).await;
    // The class is cluster-scoped: the namespace's deletion does not take it along.
    if let Err(e) = classes.delete(&class, &DeleteParams::default()).await {
        println!("[online_expansion] warning: cannot delete StorageClass {class}: {e}");
    }
    result
}

async fn grow(ctx: &Ctx, ns: &Ns, class: &str) -> Result<Outcome> {
    ns.make::<PersistentVolumeClaim>(k8s::pvc("data", class, "1Gi", "ReadWriteOnce", json!({})))
        .await?;
    ns.make::<Pod>(k8s::pod(
        "app",
        &[Use::Mount {
            claim: "data",
            path: "/data",
            read_only: false,
        }],
        None,
    ))
    .await?;
    let pod = ns.wait_running("app", RUN).await?;
    let pv = ns.wait_bound("data", BIND).await?;
    check_pv_driver(ctx, &pv).await?;
    let (fs, _) = mount_of(ns, "app", "/data").await?;
    ensure!(fs == "xfs", "/data is {fs}, not xfs");
    let data = token();
    write_file(ns, "app", "/data/token", &data).await?;
    let before = df_kib(ns, "app").await?;
    println!("[online_expansion] /data is {before} KiB; asking for 2Gi");
    k8s::resize(ns, "data", "2Gi").await?;

    // The file system must grow past the old volume's size (2 GiB less xfs's overhead).
    let ns2 = ns.clone();
    let after = wait(
        "the file system in the running pod to grow",
        Duration::from_secs(240),
        || {
            let ns = ns2.clone();
            async move {
                let now = df_kib(&ns, "app").await?;
                Ok(if now > 1024 * 1024 + 512 * 1024 {
                    Poll::Ready(now)
                } else {
                    let pvc = ns.pvc("data").await?;
                    Poll::Pending(format!(
                        "df says {now} KiB; claim capacity {:?}, conditions {:?}",
                        pvc.status.as_ref().and_then(|s| s.capacity.clone()),
                        pvc.status
                            .as_ref()
                            .and_then(|s| s.conditions.as_ref())
                            .map(|cs| cs
                                .iter()
                                .map(|c| format!(
                                    "{}: {}",
                                    c.type_,
                                    c.message.clone().unwrap_or_default()
                                ))
                                .collect::<Vec<_>>())
                    ))
                })
            }
        },
    )
    .await?;
    println!("[online_expansion] /data grew from {before} to {after} KiB");
    let api = ns.api::<PersistentVolumeClaim>();
    wait(
        "the claim's capacity to reach 2Gi",
        Duration::from_secs(60),
        || {
            let api = api.clone();
            async move {
                let pvc = api.get("data").await?;
                let cap = pvc
                    .status
                    .and_then(|s| s.capacity)
                    .and_then(|c| c.get("storage").map(|q| q.0.clone()))
                    .unwrap_or_default();
                Ok(if cap == "2Gi" {
                    Poll::Ready(())
                } else {
                    Poll::Pending(format!("capacity {cap:?}"))
                })
            }
        },
    )
    .await?;
    // Online means the very same container, never restarted, with its data.
    let now = ns.pod("app").await?;
    ensure!(
        now.metadata.uid == pod.metadata.uid,
        "the pod was replaced during the expansion"
    );
    let restarts: i32 = now
        .status
        .and_then(|s| s.container_statuses)
        .unwrap_or_default()
        .iter()
        .map(|c| c.restart_count)
        .sum();
    ensure!(
        restarts == 0,
        "the pod's container restarted during the expansion"
    );
    let got = read_file(ns, "app", "/data/token").await?;
    ensure!(got == data, "after the expansion /data/token holds {got:?}");
    Ok(Outcome::Passed)
}

/// Total size of /data in KiB, as `df` in the pod sees it.
async fn df_kib(ns: &Ns, pod: &str) -> Result<u64> {
    let out = ns.sh(pod, "df -k /data | tail -n 1").await?;
    out.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("cannot read the size from df's {out:?}"))
}

/// 3. A VolumeSnapshot of a claim with data, and a claim restored from it holding that data
///    (and not what was written after the snapshot).
async fn snapshot_restore(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "source",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOnce",
        json!({}),
    ))
    .await?;
    ns.make::<Pod>(k8s::pod(
        "writer",
        &[Use::Mount {
            claim: "source",
            path: "/data",
            read_only: false,
        }],
        None,
    ))
    .await?;
    ns.wait_running("writer", RUN).await?;
    let node = node_of(&ns, "writer").await?;
    let before = token();
    write_file(&ns, "writer", "/data/token", &before).await?;

    let snaps = ns.dynamic(&k8s::snapshot_resource());
    let snap: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "snapshot.storage.k8s.io/v1",
        "kind": "VolumeSnapshot",
        "metadata": {"name": "snap"},
        "spec": {
            "volumeSnapshotClassName": cfg.snapshot_class,
            "source": {"persistentVolumeClaimName": "source"},
        },
    }))?;
    snaps.create(&PostParams::default(), &snap).await?;
    let status = wait("the snapshot to be ready", Duration::from_secs(180), || {
        let snaps = snaps.clone();
        async move {
            let s = snaps.get("snap").await?;
            let status = s.data.get("status").cloned().unwrap_or_default();
            if let Some(err) = status.get("error") {
                // The snapshotter retries; keep waiting but show why.
                return Ok(Poll::Pending(format!("error {err}")));
            }
            Ok(if status.get("readyToUse") == Some(&json!(true)) {
                Poll::Ready(status)
            } else {
                Poll::Pending(format!("status {status}"))
            })
        }
    })
    .await?;
    println!(
        "[snapshot_restore] snapshot ready: content {}, restoreSize {}",
        status["boundVolumeSnapshotContentName"], status["restoreSize"]
    );
    let content = status["boundVolumeSnapshotContentName"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let contents: Api<DynamicObject> =
        Api::all_with(ctx.client.clone(), &k8s::snapshot_content_resource());
    if let Some(root) = &cfg.hypervisor_root {
        // moto reports a snapshot complete at once; the hypervisor stand-in copies the disk when
        // it sees the snapshot. Wait for its copy, or the write below could race it.
        let handle = contents.get(&content).await?.data["status"]["snapshotHandle"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let image = root.join("snapshots").join(format!("{handle}.img"));
        wait(
            "the hypervisor stand-in to copy the snapshot",
            Duration::from_secs(60),
            || {
                let image = image.clone();
                async move {
                    Ok(if image.exists() {
                        Poll::Ready(())
                    } else {
                        Poll::Pending(format!("no {}", image.display()))
                    })
                }
            },
        )
        .await?;
    }
    // Written after the snapshot: the restore must not have it.
    write_file(&ns, "writer", "/data/token", "after-the-snapshot").await?;

    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "restored",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOnce",
        json!({"dataSource": {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "snap"}}),
    ))
    .await?;
    // A local snapshot lives on its source's node, and so must the restore.
    ns.make::<Pod>(k8s::pod(
        "reader",
        &[Use::Mount {
            claim: "restored",
            path: "/data",
            read_only: false,
        }],
        Some(&node),
    ))
    .await?;
    ns.wait_running("reader", RUN).await?;
    let pv = ns.wait_bound("restored", BIND).await?;
    check_pv_driver(&ctx, &pv).await?;
    let got = read_file(&ns, "reader", "/data/token").await?;
    ensure!(
        got == before,
        "the restored volume holds {got:?}, the snapshot was taken of {before:?}"
    );

    // Deleting the snapshot deletes its content (deletionPolicy Delete) and the backend's copy.
    snaps.delete("snap", &DeleteParams::default()).await?;
    wait("the snapshot and its content to go", GONE, || {
        let (snaps, contents, content) = (snaps.clone(), contents.clone(), content.clone());
        async move {
            if snaps.get_opt("snap").await?.is_some() {
                return Ok(Poll::Pending("VolumeSnapshot still there".into()));
            }
            Ok(match contents.get_opt(&content).await? {
                None => Poll::Ready(()),
                Some(c) => Poll::Pending(format!(
                    "content {content}: {}",
                    c.data.get("status").cloned().unwrap_or_default()
                )),
            })
        }
    })
    .await?;
    Ok(Outcome::Passed)
}

/// 3b. A claim cloned from a claim (dataSource PersistentVolumeClaim) holds the source's data.
async fn clone_from_pvc(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    if cfg.backend == Backend::Aws {
        return Ok(Outcome::Skipped(
            "not applicable to the aws backend: EBS has no volume clone, so the driver does not \
             offer CLONE_VOLUME (snapshot_restore covers copies for aws)"
                .into(),
        ));
    }
    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "source",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOnce",
        json!({}),
    ))
    .await?;
    ns.make::<Pod>(k8s::pod(
        "writer",
        &[Use::Mount {
            claim: "source",
            path: "/data",
            read_only: false,
        }],
        None,
    ))
    .await?;
    ns.wait_running("writer", RUN).await?;
    let node = node_of(&ns, "writer").await?;
    let data = token();
    write_file(&ns, "writer", "/data/token", &data).await?;
    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "clone",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOnce",
        json!({"dataSource": {"kind": "PersistentVolumeClaim", "name": "source"}}),
    ))
    .await?;
    // A local clone is made on the source's node.
    ns.make::<Pod>(k8s::pod(
        "reader",
        &[Use::Mount {
            claim: "clone",
            path: "/data",
            read_only: false,
        }],
        Some(&node),
    ))
    .await?;
    ns.wait_running("reader", RUN).await?;
    let pv = ns.wait_bound("clone", BIND).await?;
    check_pv_driver(&ctx, &pv).await?;
    let source_pv = ns.wait_bound("source", BIND).await?;
    ensure!(pv != source_pv, "the clone is bound to its source's volume");
    let got = read_file(&ns, "reader", "/data/token").await?;
    ensure!(got == data, "the clone holds {got:?}, its source {data:?}");
    // Independent copies: a write to the clone does not reach the source.
    write_file(&ns, "reader", "/data/token", "clone-only").await?;
    let source_now = read_file(&ns, "writer", "/data/token").await?;
    ensure!(
        source_now == data,
        "writing the clone changed the source to {source_now:?}"
    );
    Ok(Outcome::Passed)
}

/// 4a. A raw block claim used as a device: bytes written by one pod are read back by the next.
async fn raw_block(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "disk",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOnce",
        json!({"volumeMode": "Block"}),
    ))
    .await?;
    let dev = "/dev/xvdf";
    ns.make::<Pod>(k8s::pod(
        "first",
        &[Use::Device {
            claim: "disk",
            path: dev,
        }],
        None,
    ))
    .await?;
    ns.wait_running("first", RUN).await?;
    let pv = ns.wait_bound("disk", BIND).await?;
    check_pv_driver(&ctx, &pv).await?;
    ns.sh("first", &format!("test -b {dev}"))
        .await
        .context("the claim is not a block device in the pod")?;
    let size: u64 = ns
        .sh("first", &format!("blockdev --getsize64 {dev}"))
        .await?
        .parse()
        .context("blockdev --getsize64")?;
    ensure!(
        size >= 1 << 30,
        "the device has {size} bytes, the claim asked for 1 GiB"
    );
    // 1 MiB of random bytes at offset 4 KiB, flushed to the device.
    let written = ns
        .sh(
            "first",
            &format!(
                "dd if=/dev/urandom of=/tmp/pattern bs=4096 count=256 2>/dev/null && \
                 dd if=/tmp/pattern of={dev} bs=4096 seek=1 count=256 conv=fsync 2>/dev/null && \
                 md5sum < /tmp/pattern"
            ),
        )
        .await?;
    ns.delete_pod("first", GONE).await?;
    ns.make::<Pod>(k8s::pod(
        "second",
        &[Use::Device {
            claim: "disk",
            path: dev,
        }],
        None,
    ))
    .await?;
    ns.wait_running("second", RUN).await?;
    let read = ns
        .sh(
            "second",
            &format!("dd if={dev} bs=4096 skip=1 count=256 2>/dev/null | md5sum"),
        )
        .await?;
    ensure!(
        read == written,
        "the second pod read back md5 {read}, the first wrote {written}"
    );
    Ok(Outcome::Passed)
}

/// 4b. A claim published read-only: the data is readable, writing fails.
async fn read_only(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "data",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOnce",
        json!({}),
    ))
    .await?;
    ns.make::<Pod>(k8s::pod(
        "writer",
        &[Use::Mount {
            claim: "data",
            path: "/data",
            read_only: false,
        }],
        None,
    ))
    .await?;
    ns.wait_running("writer", RUN).await?;
    let data = token();
    write_file(&ns, "writer", "/data/token", &data).await?;
    ns.delete_pod("writer", GONE).await?;

    ns.make::<Pod>(k8s::pod(
        "reader",
        &[Use::Mount {
            claim: "data",
            path: "/data",
            read_only: true,
        }],
        None,
    ))
    .await?;
    ns.wait_running("reader", RUN).await?;
    let (_, options) = mount_of(&ns, "reader", "/data").await?;
    ensure!(
        options.split(',').any(|o| o == "ro"),
        "/data is mounted {options}, not read-only"
    );
    let got = read_file(&ns, "reader", "/data/token").await?;
    ensure!(
        got == data,
        "the read-only mount shows {got:?}, not {data:?}"
    );
    let attempt = ns.exec("reader", "echo x > /data/new").await?;
    ensure!(
        attempt.code != 0,
        "writing to the read-only mount succeeded"
    );
    ensure!(
        attempt.stderr.to_lowercase().contains("read-only"),
        "writing failed, but not because the file system is read-only: {}",
        attempt.stderr.trim()
    );
    Ok(Outcome::Passed)
}

/// 4c. ReadWriteOncePod: a second pod using the claim stays unschedulable while the first runs,
///     and runs once the first is gone.
async fn rwop(ctx: Arc<Ctx>, ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    ns.make::<PersistentVolumeClaim>(k8s::pvc(
        "data",
        &cfg.storage_class,
        SIZE,
        "ReadWriteOncePod",
        json!({}),
    ))
    .await?;
    let uses = [Use::Mount {
        claim: "data",
        path: "/data",
        read_only: false,
    }];
    ns.make::<Pod>(k8s::pod("first", &uses, None)).await?;
    ns.wait_running("first", RUN).await?;
    let data = token();
    write_file(&ns, "first", "/data/token", &data).await?;

    ns.make::<Pod>(k8s::pod("second", &uses, None)).await?;
    let api = ns.api::<Pod>();
    let message = wait(
        "the second pod to be found unschedulable",
        Duration::from_secs(90),
        || {
            let api = api.clone();
            async move {
                let pod = api.get("second").await?;
                let status = pod.status.clone().unwrap_or_default();
                if status.phase.as_deref() == Some("Running") {
                    bail!("the second pod runs beside the first on a ReadWriteOncePod claim");
                }
                let unschedulable = status.conditions.unwrap_or_default().into_iter().find(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.reason.as_deref() == Some("Unschedulable")
                });
                Ok(match unschedulable {
                    Some(c) => Poll::Ready(c.message.unwrap_or_default()),
                    None => Poll::Pending(k8s::describe_pod(&pod)),
                })
            }
        },
    )
    .await?;
    println!("[read_write_once_pod] second pod unschedulable: {message}");
    ensure!(
        message.contains("ReadWriteOncePod"),
        "the second pod is unschedulable, but not because of ReadWriteOncePod: {message}"
    );
    // Still pending a while later: not merely slow to start.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let second = ns.pod("second").await?;
    ensure!(
        second
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none(),
        "the second pod was scheduled while the first holds the claim: {}",
        k8s::describe_pod(&second)
    );

    ns.delete_pod("first", GONE).await?;
    ns.wait_running("second", RUN).await?;
    let got = read_file(&ns, "second", "/data/token").await?;
    ensure!(got == data, "the second pod sees {got:?}, not {data:?}");
    Ok(Outcome::Passed)
}

/// 6. The committed manifests of this backend pass a server-side dry run against this API
///    server (which checks them against its own schemas and admission, unlike kube-linter).
async fn manifests_dry_run(ctx: Arc<Ctx>, _ns: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    let dir = cfg.manifests.join(cfg.backend.to_string());
    let files = host::entries(&dir)?;
    ensure!(
        files.iter().any(|f| f.ends_with(".yaml")),
        "no manifests in {}",
        dir.display()
    );
    let kubectl = cfg
        .kubectl
        .clone()
        .unwrap_or_else(|| Path::new("kubectl").to_path_buf());
    let out = tokio::process::Command::new(&kubectl)
        .args(["apply", "--dry-run=server", "-f"])
        .arg(&dir)
        .output()
        .await
        .with_context(|| format!("running {}", kubectl.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!(
        "[manifests_server_dry_run] kubectl apply --dry-run=server -f {}:\n{stdout}",
        dir.display()
    );
    ensure!(
        out.status.success(),
        "kubectl apply --dry-run=server failed ({}):\n{stderr}",
        out.status
    );
    // Every object in the files must have been through the server.
    let documents: usize = files
        .iter()
        .filter(|f| f.ends_with(".yaml"))
        .map(|f| {
            std::fs::read_to_string(dir.join(f))
                .map(|t| t.lines().filter(|l| l.starts_with("kind: ")).count())
                .unwrap_or(0)
        })
        .sum();
    let applied = stdout
        .lines()
        .filter(|l| l.contains("(server dry run)"))
        .count();
    ensure!(
        applied == documents,
        "{documents} objects in the manifests, but the server dry run reported {applied}"
    );
    Ok(Outcome::Passed)
}

/// 5. Deleting everything the cases made leaves nothing: no PV, VolumeAttachment or snapshot
///    content of the driver, no backend volume or snapshot, no loop device, no CSI mount.
async fn cleanup(ctx: Arc<Ctx>, own: Ns) -> Result<Outcome> {
    let cfg = &ctx.cfg;
    let client = ctx.client.clone();
    let selector = ListParams::default().labels(&k8s::label_selector());
    let namespaces = Api::<Namespace>::all(client.clone());
    for ns in namespaces.list(&selector).await?.items {
        let name = ns.metadata.name.unwrap_or_default();
        if name != own.name {
            namespaces
                .delete(&name, &DeleteParams::default())
                .await
                .ok();
        }
    }
    let classes = Api::<StorageClass>::all(client.clone());
    for sc in classes.list(&selector).await?.items {
        classes
            .delete(
                &sc.metadata.name.unwrap_or_default(),
                &DeleteParams::default(),
            )
            .await
            .ok();
    }
    let own_name = own.name.clone();
    wait(
        "the cases' namespaces to be deleted",
        Duration::from_secs(300),
        || {
            let (namespaces, selector, own_name) =
                (namespaces.clone(), selector.clone(), own_name.clone());
            async move {
                let left: Vec<String> = namespaces
                    .list(&selector)
                    .await?
                    .items
                    .into_iter()
                    .filter_map(|n| n.metadata.name)
                    .filter(|n| *n != own_name)
                    .collect();
                Ok(if left.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending(format!("still there: {}", left.join(" ")))
                })
            }
        },
    )
    .await?;

    let driver = cfg.driver.clone();
    let pvs = Api::<PersistentVolume>::all(client.clone());
    wait(
        "the driver's PersistentVolumes to be deleted",
        Duration::from_secs(180),
        || {
            let (pvs, driver) = (pvs.clone(), driver.clone());
            async move {
                let left: Vec<String> = pvs
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|pv| {
                        pv.spec
                            .as_ref()
                            .and_then(|s| s.csi.as_ref())
                            .is_some_and(|c| c.driver == driver)
                    })
                    .map(|pv| {
                        format!(
                            "{} ({})",
                            pv.metadata.name.unwrap_or_default(),
                            pv.status.and_then(|s| s.phase).unwrap_or_default()
                        )
                    })
                    .collect();
                Ok(if left.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending(format!("left: {}", left.join(", ")))
                })
            }
        },
    )
    .await?;
    let attachments = Api::<VolumeAttachment>::all(client.clone());
    wait(
        "the driver's VolumeAttachments to be deleted",
        Duration::from_secs(120),
        || {
            let (attachments, driver) = (attachments.clone(), driver.clone());
            async move {
                let left: Vec<String> = attachments
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|va| va.spec.attacher == driver)
                    .filter_map(|va| va.metadata.name)
                    .collect();
                Ok(if left.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending(format!("left: {}", left.join(", ")))
                })
            }
        },
    )
    .await?;
    let contents: Api<DynamicObject> =
        Api::all_with(client.clone(), &k8s::snapshot_content_resource());
    wait(
        "the driver's VolumeSnapshotContents to be deleted",
        Duration::from_secs(120),
        || {
            let (contents, driver) = (contents.clone(), driver.clone());
            async move {
                let left: Vec<String> = contents
                    .list(&ListParams::default())
                    .await?
                    .items
                    .into_iter()
                    .filter(|c| c.data["spec"]["driver"].as_str() == Some(driver.as_str()))
                    .filter_map(|c| c.metadata.name)
                    .collect();
                Ok(if left.is_empty() {
                    Poll::Ready(())
                } else {
                    Poll::Pending(format!("left: {}", left.join(", ")))
                })
            }
        },
    )
    .await?;

    match cfg.backend {
        Backend::Local => {
            // The local backend's layout: <stateDir>/{volumes,snapshots}/<id>/.
            let state = cfg.state_dir.clone();
            wait(
                "the local backend's volumes and snapshots to be deleted",
                Duration::from_secs(60),
                || {
                    let state = state.clone();
                    async move {
                        let mut left = Vec::new();
                        for kind in ["volumes", "snapshots"] {
                            for e in host::entries(&state.join(kind))? {
                                left.push(format!("{kind}/{e}"));
                            }
                        }
                        Ok(if left.is_empty() {
                            Poll::Ready(())
                        } else {
                            Poll::Pending(format!(
                                "left in {}: {}",
                                state.display(),
                                left.join(", ")
                            ))
                        })
                    }
                },
            )
            .await?;
        }
        Backend::Aws => {
            // Only what carries the driver's tag: moto also holds the instance's root volume,
            // for which the hypervisor stand-in keeps a disk image too. The stand-in's loop
            // devices are checked below.
            let moto = cfg.moto.clone().context("no moto endpoint")?;
            wait(
                "moto to hold no volume or snapshot of the driver",
                Duration::from_secs(60),
                || {
                    let moto = moto.clone();
                    async move {
                        let tag = [
                            ("Filter.1.Name", "tag-key"),
                            ("Filter.1.Value.1", "ferrovol.dev/cluster"),
                        ];
                        let volumes = host::xml_values(
                            &host::ec2_query(&moto, "DescribeVolumes", &tag)?,
                            "volumeId",
                        );
                        let snapshots = host::xml_values(
                            &host::ec2_query(&moto, "DescribeSnapshots", &tag)?,
                            "snapshotId",
                        );
                        Ok(if volumes.is_empty() && snapshots.is_empty() {
                            Poll::Ready(())
                        } else {
                            Poll::Pending(format!("volumes {volumes:?}, snapshots {snapshots:?}"))
                        })
                    }
                },
            )
            .await?;
        }
    }

    // Loop devices: the node's (local) and the hypervisor's (aws) are backed by files in these.
    let mut roots = vec![cfg.state_dir.clone()];
    roots.extend(cfg.hypervisor_root.clone());
    let before = ctx.loops_before.clone();
    let new_loops = wait(
        "the volumes' loop devices to be detached",
        Duration::from_secs(60),
        || {
            let (roots, before) = (roots.clone(), before.clone());
            async move {
                let new: Vec<host::LoopDevice> = host::loop_devices()
                    .into_iter()
                    .filter(|d| !before.contains(d))
                    .collect();
                let ours: Vec<String> = new
                    .iter()
                    .filter(|d| {
                        roots.iter().any(|r| {
                            Path::new(d.backing_file.trim_end_matches(" (deleted)")).starts_with(r)
                        })
                    })
                    .map(|d| format!("{} → {}", d.name, d.backing_file))
                    .collect();
                Ok(if ours.is_empty() {
                    Poll::Ready(new)
                } else {
                    Poll::Pending(format!("attached: {}", ours.join(", ")))
                })
            }
        },
    )
    .await?;
    for d in new_loops {
        // Not the driver's (their backing files are elsewhere): something else on this machine.
        println!(
            "[cleanup_leaves_nothing] note: {} → {} appeared during the run, not ours",
            d.name, d.backing_file
        );
    }

    let kubelet = cfg.kubelet_dir.clone();
    wait("the CSI mounts to be gone", Duration::from_secs(60), || {
        let kubelet = kubelet.clone();
        async move {
            let csi = kubelet.join("plugins/kubernetes.io/csi");
            let pods = kubelet.join("pods");
            let left: Vec<String> = host::mount_points()
                .into_iter()
                .filter(|p| {
                    p.starts_with(&csi)
                        || (p.starts_with(&pods)
                            && p.components().any(|c| c.as_os_str() == "kubernetes.io~csi"))
                })
                .map(|p| p.display().to_string())
                .collect();
            Ok(if left.is_empty() {
                Poll::Ready(())
            } else {
                Poll::Pending(format!("mounted: {}", left.join(", ")))
            })
        }
    })
    .await?;
    Ok(Outcome::Passed)
}
