//! CSI secrets never reach a log line, even at the most verbose level.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use test_support::v1::*;
use test_support::*;

const CANARY: &str = "s3cr3t-canary-7f1d9a";

#[tokio::test]
async fn secrets_are_never_logged() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start_with(
        "secrets",
        Options {
            log_level: "trace".into(),
            ..Default::default()
        },
    )?;
    let mut c = h.controller().await?;
    let mut n = h.node().await?;
    let cap = mount_capability("ext4");
    let mut req = create_request("pvc-secret", 32 * MIB, cap.clone());
    req.secrets = secrets(CANARY);
    let id = c
        .create_volume(req)
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let mut bad = create_request("", 32 * MIB, cap.clone());
    bad.secrets = secrets(CANARY);
    assert!(c.create_volume(bad).await.is_err());

    let staging = h.staging_path("pv-secret");
    let target = h.target_path("pod-secret");
    let mut stage = stage_request(&id, &staging, cap.clone());
    stage.secrets = secrets(CANARY);
    n.node_stage_volume(stage).await?;
    let mut publish = publish_request(&id, &staging, &target, cap.clone(), false);
    publish.secrets = secrets(CANARY);
    n.node_publish_volume(publish).await?;
    let snap = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-secret".into(),
            secrets: secrets(CANARY),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    c.controller_expand_volume(ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 64 * MIB,
            limit_bytes: 0,
        }),
        secrets: secrets(CANARY),
        ..Default::default()
    })
    .await?;
    n.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await?;
    n.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        secrets: secrets(CANARY),
    })
    .await?;
    c.delete_volume(DeleteVolumeRequest {
        volume_id: id.clone(),
        secrets: secrets(CANARY),
    })
    .await?;

    let logs = format!("{}\n{}", h.controller.logs(), h.node.logs());
    assert!(
        logs.lines().count() > 20,
        "trace logging must actually produce output for this test to mean anything:\n{logs}"
    );
    assert!(logs.contains(&id), "the logs do name the volume");
    let leaks: Vec<&str> = logs.lines().filter(|l| l.contains(CANARY)).collect();
    assert!(leaks.is_empty(), "secrets leaked into the logs: {leaks:#?}");
    Ok(())
}
