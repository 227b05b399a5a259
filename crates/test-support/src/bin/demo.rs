//! `cargo xtask demo`: both plugins started on the local backend, and one volume walked
//! through its life the way external-provisioner, external-resizer, external-snapshotter and
//! kubelet drive it, with progress output.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use anyhow::{Result, ensure};
use std::collections::HashMap;
use std::time::Instant;
use test_support::v1::*;
use test_support::*;

macro_rules! step {
    ($what:expr, $e:expr) => {{
        let t = Instant::now();
        let r = $e;
        println!(
            "  ✔ {:<58} {:>7.1} ms",
            $what,
            t.elapsed().as_secs_f64() * 1e3
        );
        r
    }};
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    require_private_mount_namespace();
    println!("ferrovol demo — local backend, real loop devices and mounts\n");
    let h = Harness::start("demo")?;
    println!(
        "  csi-controller on {}\n  csi-node       on {}\n",
        h.controller.socket.display(),
        h.node.socket.display()
    );
    let mut ident = h.identity(true).await?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;

    println!("node-driver-registrar and livenessprobe:");
    let info = step!(
        "GetPluginInfo",
        ident
            .get_plugin_info(GetPluginInfoRequest {})
            .await?
            .into_inner()
    );
    println!("      driver {} version {}", info.name, info.vendor_version);
    let ninfo = step!(
        "NodeGetInfo",
        node.node_get_info(NodeGetInfoRequest {})
            .await?
            .into_inner()
    );
    step!("Probe", ident.probe(ProbeRequest {}).await?);

    println!("external-provisioner (--node-deployment, capacity tracking):");
    let topo = ninfo.accessible_topology.clone().unwrap_or_default();
    let cap = step!(
        "GetCapacity for this node",
        ctrl.get_capacity(GetCapacityRequest {
            accessible_topology: Some(topo.clone()),
            ..Default::default()
        })
        .await?
        .into_inner()
    );
    println!("      {} MiB available", cap.available_capacity / MIB);
    let mut req = create_request("pvc-demo", 320 * MIB, mount_capability("xfs"));
    req.parameters = HashMap::from([
        ("csi.storage.k8s.io/pvc/name".into(), "data-demo-0".into()),
        ("csi.storage.k8s.io/pvc/namespace".into(), "default".into()),
    ]);
    req.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![topo.clone()],
        preferred: vec![topo],
    });
    let vol = step!(
        "CreateVolume pvc-demo (320 MiB, xfs)",
        ctrl.create_volume(req.clone())
            .await?
            .into_inner()
            .volume
            .unwrap()
    );
    step!(
        "CreateVolume again (idempotent retry)",
        ctrl.create_volume(req).await?
    );
    let id = vol.volume_id.clone();
    println!("      volume id {id}");

    println!("kubelet:");
    let cap = mount_capability("xfs");
    let staging = h.staging_path("pv-demo");
    let target = h.target_path("demo-0");
    step!(
        "NodeStageVolume (loop device + mkfs.xfs + mount)",
        node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
            .await?
    );
    step!(
        "NodePublishVolume (bind mount into the pod)",
        node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
            .await?
    );
    step!(
        "the pod writes hello.txt",
        std::fs::write(target.join("hello.txt"), b"hello from ferrovol\n")?
    );
    let stats = step!(
        "NodeGetVolumeStats",
        node.node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner()
    );
    println!(
        "      {} of {} bytes used",
        stats.usage[0].used, stats.usage[0].total
    );

    println!("external-resizer, then kubelet (online expansion):");
    let before = df_size(&target);
    step!(
        "ControllerExpandVolume to 512 MiB",
        ctrl.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 512 * MIB,
                limit_bytes: 0
            }),
            ..Default::default()
        })
        .await?
    );
    step!(
        "NodeExpandVolume (loop capacity + xfs_growfs)",
        node.node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await?
    );
    let after = df_size(&target);
    println!("      df: {} MiB -> {} MiB", before >> 20, after >> 20);
    ensure!(after > before, "the filesystem did not grow");

    println!("external-snapshotter, then external-provisioner restoring it:");
    let snap = step!(
        "CreateSnapshot of the published volume",
        ctrl.create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snapshot-demo".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap()
    );
    let mut restore = create_request("pvc-demo-restore", 512 * MIB, cap.clone());
    restore.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            },
        )),
    });
    let restored = step!(
        "CreateVolume from the snapshot",
        ctrl.create_volume(restore)
            .await?
            .into_inner()
            .volume
            .unwrap()
    );
    let st2 = h.staging_path("pv-demo-restore");
    step!(
        "NodeStageVolume of the restored volume (no mkfs)",
        node.node_stage_volume(stage_request(&restored.volume_id, &st2, cap.clone()))
            .await?
    );
    let text = std::fs::read_to_string(st2.join("hello.txt"))?;
    println!("      restored volume says: {}", text.trim());

    println!("tear-down:");
    step!(
        "NodeUnpublishVolume",
        node.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: target.display().to_string()
        })
        .await?
    );
    step!(
        "NodeUnstageVolume",
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string()
        })
        .await?
    );
    step!(
        "NodeUnstageVolume (restored)",
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: restored.volume_id.clone(),
            staging_target_path: st2.display().to_string()
        })
        .await?
    );
    step!(
        "DeleteSnapshot",
        ctrl.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: snap.snapshot_id,
            ..Default::default()
        })
        .await?
    );
    step!("DeleteVolume ×2", {
        ctrl.delete_volume(DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await?;
        ctrl.delete_volume(DeleteVolumeRequest {
            volume_id: restored.volume_id,
            ..Default::default()
        })
        .await?
    });
    ensure!(
        h.loop_devices().is_empty(),
        "loop devices left behind: {:?}",
        h.loop_devices()
    );
    ensure!(
        h.mounts().is_empty(),
        "mounts left behind: {:?}",
        h.mounts()
    );
    println!("\nno loop device, mount or volume file left behind. demo: 1 passed, 0 failed");
    Ok(())
}
