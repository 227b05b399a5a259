//! A volume walked through its whole life over gRPC, on real loop devices and real mounts:
//! create → stage → publish → write → unpublish → unstage → stage again (data still there) →
//! expand while published (df sees it) → stats → snapshot → restore and clone (data in both)
//! → delete everything → nothing left behind.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use std::path::Path;
use test_support::v1::*;
use test_support::*;

async fn lifecycle(fs_type: &str, size: i64) -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start(&format!("lifecycle-{fs_type}"))?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability(fs_type);

    let vol = ctrl
        .create_volume(create_request("pvc-life", size, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(vol.capacity_bytes, size);
    assert_eq!(
        vol.accessible_topology[0]
            .segments
            .get(&format!("{DRIVER}/node"))
            .map(String::as_str),
        Some(NODE_ID)
    );
    let id = vol.volume_id.clone();
    let staging = h.staging_path("pv-life");
    let target = h.target_path("pod-a");

    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    assert_eq!(
        h.loop_devices().len(),
        1,
        "one loop device for one staged volume"
    );
    // Staging twice is idempotent and never attaches a second device.
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    assert_eq!(h.loop_devices().len(), 1);
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
        .await?;
    std::fs::write(
        target.join("hello.txt"),
        b"written through the publish target",
    )?;

    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await?;
    assert!(!target.exists(), "unpublish removes the target it created");
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    assert!(
        h.loop_devices().is_empty(),
        "unstage releases the loop device"
    );
    assert!(
        h.mounts().is_empty(),
        "unstage leaves nothing mounted: {:?}",
        h.mounts()
    );

    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    assert_eq!(
        std::fs::read(staging.join("hello.txt"))?,
        b"written through the publish target"
    );
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
        .await?;

    // Online expansion: controller grows the file, node refreshes the loop device and the fs.
    let before = df_size(&target);
    let grown = size * 2;
    let resp = ctrl
        .controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: grown,
                limit_bytes: 0,
            }),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(resp.capacity_bytes, grown);
    assert!(resp.node_expansion_required);
    let expand = NodeExpandVolumeRequest {
        volume_id: id.clone(),
        volume_path: target.display().to_string(),
        capacity_range: Some(CapacityRange {
            required_bytes: grown,
            limit_bytes: 0,
        }),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap.clone()),
        ..Default::default()
    };
    if fs_type == "ext4" && !has_cap_sys_resource() {
        // Online ext4 growth needs CAP_SYS_RESOURCE, which this machine withholds even from
        // root: the node must say so clearly, and grow the filesystem offline at the next stage.
        let err = node.node_expand_volume(expand).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
        assert!(
            err.message().contains("CAP_SYS_RESOURCE"),
            "{}",
            err.message()
        );
        node.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: target.display().to_string(),
        })
        .await?;
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await?;
        node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
            .await?;
        node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
            .await?;
    } else {
        let nresp = node.node_expand_volume(expand).await?.into_inner();
        assert_eq!(nresp.capacity_bytes, grown);
    }
    let after = df_size(&target);
    assert!(
        after > before + (size as u64) / 2,
        "df must see the filesystem grow: {before} -> {after}"
    );
    assert_eq!(
        std::fs::read(target.join("hello.txt"))?,
        b"written through the publish target"
    );

    let stats = node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    let bytes = stats
        .usage
        .iter()
        .find(|u| u.unit == volume_usage::Unit::Bytes as i32)
        .expect("byte usage");
    assert_eq!(bytes.total as u64, after, "stats agree with df");
    assert!(bytes.used > 0 && bytes.available > 0);
    assert!(
        stats
            .usage
            .iter()
            .any(|u| u.unit == volume_usage::Unit::Inodes as i32 && u.total > 0)
    );
    assert!(!stats.volume_condition.unwrap().abnormal);

    // Snapshot of a staged, published volume: taken consistently (reflink or freeze).
    let snap = ctrl
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-life".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    assert!(snap.ready_to_use);
    assert_eq!(snap.source_volume_id, id);
    let restore = ctrl
        .create_volume(CreateVolumeRequest {
            volume_content_source: Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Snapshot(
                    volume_content_source::SnapshotSource {
                        snapshot_id: snap.snapshot_id.clone(),
                    },
                )),
            }),
            ..create_request("pvc-restored", grown, cap.clone())
        })
        .await?
        .into_inner()
        .volume
        .unwrap();
    assert!(
        restore.content_source.is_some(),
        "the content source is echoed back"
    );
    let clone = ctrl
        .create_volume(CreateVolumeRequest {
            volume_content_source: Some(VolumeContentSource {
                r#type: Some(volume_content_source::Type::Volume(
                    volume_content_source::VolumeSource {
                        volume_id: id.clone(),
                    },
                )),
            }),
            ..create_request("pvc-clone", grown, cap.clone())
        })
        .await?
        .into_inner()
        .volume
        .unwrap();

    // Both copies carry the data, and both mount beside the original (xfs needs nouuid).
    for (vol, pv, pod) in [
        (&restore, "pv-restored", "pod-r"),
        (&clone, "pv-clone", "pod-c"),
    ] {
        let st = h.staging_path(pv);
        let tg = h.target_path(pod);
        node.node_stage_volume(stage_request(&vol.volume_id, &st, cap.clone()))
            .await?;
        node.node_publish_volume(publish_request(
            &vol.volume_id,
            &st,
            &tg,
            cap.clone(),
            false,
        ))
        .await?;
        assert_eq!(
            std::fs::read(tg.join("hello.txt"))?,
            b"written through the publish target",
            "{pv}"
        );
        node.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            target_path: tg.display().to_string(),
        })
        .await?;
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: vol.volume_id.clone(),
            staging_target_path: st.display().to_string(),
        })
        .await?;
    }

    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await?;
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    for v in [&id, &restore.volume_id, &clone.volume_id] {
        ctrl.delete_volume(DeleteVolumeRequest {
            volume_id: v.clone(),
            ..Default::default()
        })
        .await?;
    }
    ctrl.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id.clone(),
        ..Default::default()
    })
    .await?;

    assert!(
        h.loop_devices().is_empty(),
        "loop devices left: {:?}",
        h.loop_devices()
    );
    assert!(h.mounts().is_empty(), "mounts left: {:?}", h.mounts());
    for dir in [
        "volumes",
        "snapshots",
        "node/attached",
        "node/format-intents",
    ] {
        let left: Vec<_> = std::fs::read_dir(h.state.join(dir))?
            .flatten()
            .map(|e| e.path())
            .collect();
        assert!(left.is_empty(), "files left in {dir}: {left:?}");
    }
    let listed = ctrl
        .list_volumes(ListVolumesRequest::default())
        .await?
        .into_inner();
    assert!(listed.entries.is_empty());
    Ok(())
}

#[tokio::test]
async fn ext4_volume_lifecycle() -> anyhow::Result<()> {
    lifecycle("ext4", 64 * MIB).await
}

#[tokio::test]
async fn xfs_volume_lifecycle() -> anyhow::Result<()> {
    lifecycle("xfs", 300 * MIB).await
}

#[tokio::test]
async fn raw_block_volume_lifecycle() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("lifecycle-block")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = block_capability();
    let id = ctrl
        .create_volume(create_request("pvc-block", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let staging = h.staging_path("pv-block");
    let target = h.target_path("pod-b");
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
        .await?;
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::metadata(&target)?.file_type().is_block_device(),
        "the device node is bound onto the target file"
    );
    write_at(&target, 4096, b"raw block payload")?;

    let stats = node
        .node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(stats.usage[0].total, 32 * MIB);

    ctrl.controller_expand_volume(ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 48 * MIB,
            limit_bytes: 0,
        }),
        ..Default::default()
    })
    .await?;
    let n = node
        .node_expand_volume(NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(
        n.capacity_bytes,
        48 * MIB,
        "the loop device sees the new capacity"
    );

    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await?;
    assert!(!target.exists());
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), true))
        .await?;
    assert_eq!(read_at(&target, 4096, 17)?, b"raw block payload");
    let err = write_at(&target, 0, b"must not land").unwrap_err();
    assert!(
        matches!(
            err.raw_os_error(),
            Some(libc::EPERM) | Some(libc::EROFS) | Some(libc::EACCES)
        ),
        "{err}"
    );
    assert_eq!(
        read_at(&target, 0, 13)?,
        vec![0; 13],
        "nothing was written through the read-only publish"
    );
    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: target.display().to_string(),
    })
    .await?;
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    ctrl.delete_volume(DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await?;
    assert!(h.loop_devices().is_empty());
    assert!(h.mounts().is_empty());
    Ok(())
}

#[tokio::test]
async fn read_only_publish_refuses_writes() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("readonly")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability("ext4");
    let id = ctrl
        .create_volume(create_request("pvc-ro", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let staging = h.staging_path("pv-ro");
    let (rw, ro) = (h.target_path("pod-rw"), h.target_path("pod-ro"));
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &rw, cap.clone(), false))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &ro, cap.clone(), true))
        .await?;
    std::fs::write(rw.join("f"), b"x")?;
    let err = std::fs::write(ro.join("g"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS));
    assert_eq!(std::fs::read(ro.join("f"))?, b"x");
    // The same target asked again read-write is an incompatible publish.
    let err = node
        .node_publish_volume(publish_request(&id, &staging, &ro, cap.clone(), false))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::AlreadyExists, "{err:?}");
    for t in [&rw, &ro] {
        node.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: id.clone(),
            target_path: t.display().to_string(),
        })
        .await?;
    }
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    assert!(h.mounts().is_empty());
    Ok(())
}

fn write_at(path: &Path, offset: u64, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all_at(data, offset)?;
    f.sync_all()
}

fn read_at(path: &Path, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0; len];
    std::fs::File::open(path)?.read_exact_at(&mut buf, offset)?;
    Ok(buf)
}
