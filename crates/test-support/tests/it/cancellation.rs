//! tonic drops a handler when the caller's deadline passes. The work must finish anyway (no
//! half-formatted device, no torn snapshot), a retry meanwhile gets ABORTED, and the retry after
//! completion gets the finished result.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use std::time::Duration;
use test_support::v1::*;
use test_support::*;
use tonic::{Code, Request};

fn with_deadline<T>(msg: T, d: Duration) -> Request<T> {
    let mut r = Request::new(msg);
    r.set_timeout(d);
    r
}

#[tokio::test]
async fn a_stage_cut_short_by_its_deadline_still_formats_once() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("cancel-stage")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability("xfs");
    // A large xfs volume: mkfs writes headers across many allocation groups and takes a while.
    let id = ctrl
        .create_volume(create_request("pvc-cancel", 8 * 1024 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let staging = h.staging_path("pv-cancel");
    let req = stage_request(&id, &staging, cap.clone());
    let err = node
        .node_stage_volume(with_deadline(req.clone(), Duration::from_millis(1)))
        .await
        .unwrap_err();
    // The client's own timer fires first (CANCELLED) or the server's (DEADLINE_EXCEEDED).
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    let mut aborted = 0;
    loop {
        match node.node_stage_volume(req.clone()).await {
            Ok(_) => break,
            Err(s) if s.code() == Code::Aborted => {
                aborted += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(s) => panic!("retry failed: {s:?}"),
        }
    }
    assert!(
        aborted > 0,
        "the retry should have met the first call still running"
    );
    assert_eq!(blkid_type(&h.image(&id)).as_deref(), Some("xfs"));
    assert_eq!(mount_count(&staging), 1);
    assert!(h.loop_of(&id).is_some());
    let intents: Vec<_> = std::fs::read_dir(h.state.join("node/format-intents"))?
        .flatten()
        .collect();
    assert!(
        intents.is_empty(),
        "the format completed and its intent was cleared"
    );
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    Ok(())
}

#[tokio::test]
async fn a_snapshot_cut_short_by_its_deadline_is_complete_and_untorn() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("cancel-snap")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability("ext4");
    let id = ctrl
        .create_volume(create_request("pvc-src", 512 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let (staging, target) = (h.staging_path("pv-src"), h.target_path("pod-src"));
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
        .await?;
    // 256 MiB of real data makes the copy slow enough to outlive a short deadline.
    let mut rng = Rng::new(7);
    let data: Vec<u8> = (0..256 * MIB as usize / 8)
        .flat_map(|_| rng.next_u64().to_le_bytes())
        .collect();
    std::fs::write(target.join("big"), &data)?;

    let req = CreateSnapshotRequest {
        source_volume_id: id.clone(),
        name: "snap-cancel".into(),
        ..Default::default()
    };
    let err = ctrl
        .create_snapshot(with_deadline(req.clone(), Duration::from_millis(1)))
        .await
        .unwrap_err();
    // The client's own timer fires first (CANCELLED) or the server's (DEADLINE_EXCEEDED).
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    let snap = retry("snapshot", || {
        let (mut c, r) = (ctrl.clone(), req.clone());
        async move { c.create_snapshot(r).await }
    })
    .await?
    .snapshot
    .unwrap();
    let listed = ctrl
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: id.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(listed.entries.len(), 1, "exactly one snapshot");
    let leftovers: Vec<_> = std::fs::read_dir(h.state.join("snapshots").join(&snap.snapshot_id))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "no temporary copy left: {leftovers:?}"
    );

    let mut restore = create_request("pvc-restore", 512 * MIB, cap.clone());
    restore.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id,
            },
        )),
    });
    let rid = ctrl
        .create_volume(restore)
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let rstaging = h.staging_path("pv-restore");
    node.node_stage_volume(stage_request(&rid, &rstaging, cap.clone()))
        .await?;
    assert!(
        std::fs::read(rstaging.join("big"))? == data,
        "the snapshot holds every byte written before it"
    );
    for (v, s) in [(&rid, &rstaging), (&id, &staging)] {
        if v == &id {
            node.node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: target.display().to_string(),
            })
            .await?;
        }
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: v.clone(),
            staging_target_path: s.display().to_string(),
        })
        .await?;
    }
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    Ok(())
}
