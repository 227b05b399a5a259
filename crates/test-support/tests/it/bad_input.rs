//! Bad input gets the status code the CSI spec names and a message a person can act on —
//! never a panic, never a partial change.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use std::collections::HashMap;
use test_support::v1::*;
use test_support::*;
use tonic::Code;

fn expect<T: std::fmt::Debug>(
    what: &str,
    r: Result<tonic::Response<T>, tonic::Status>,
    code: Code,
    hint: &str,
) {
    let err = r.expect_err(what);
    assert_eq!(err.code(), code, "{what}: {err:?}");
    assert!(
        err.message().to_lowercase().contains(&hint.to_lowercase()),
        "{what}: message {:?} should mention {hint:?}",
        err.message()
    );
}

#[tokio::test]
async fn controller_refuses_bad_requests_with_the_spec_codes() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("bad-controller")?;
    let mut c = h.controller().await?;
    let cap = mount_capability("ext4");

    expect(
        "no name",
        c.create_volume(create_request("", MIB, cap.clone())).await,
        Code::InvalidArgument,
        "name is required",
    );
    expect(
        "no capabilities",
        c.create_volume(CreateVolumeRequest {
            name: "x".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "volume_capabilities",
    );
    let mut r = create_request("x", MIB, cap.clone());
    r.parameters = HashMap::from([
        ("fstpye".into(), "ext4".into()),
        ("csi.storage.k8s.io/pvc/name".into(), "ok".into()),
    ]);
    expect(
        "unknown parameter",
        c.create_volume(r).await,
        Code::InvalidArgument,
        "fstpye",
    );
    expect(
        "fsType off the allow-list",
        c.create_volume(create_request("x", MIB, mount_capability("btrfs")))
            .await,
        Code::InvalidArgument,
        "btrfs",
    );
    let mut r = create_request("x", 10 * MIB, cap.clone());
    r.capacity_range = Some(CapacityRange {
        required_bytes: 10 * MIB,
        limit_bytes: 5 * MIB,
    });
    expect(
        "required above limit",
        c.create_volume(r).await,
        Code::InvalidArgument,
        "exceeds limit_bytes",
    );
    let mut r = create_request("x", MIB, cap.clone());
    r.capacity_range = Some(CapacityRange {
        required_bytes: MIB,
        limit_bytes: 2 * MIB,
    });
    expect(
        "limit below the minimum volume",
        c.create_volume(r).await,
        Code::OutOfRange,
        "at least",
    );
    let mut r = create_request("x", 100 * MIB, mount_capability("xfs"));
    r.capacity_range = Some(CapacityRange {
        required_bytes: 100 * MIB,
        limit_bytes: 200 * MIB,
    });
    expect(
        "xfs below 300 MiB with a tight limit",
        c.create_volume(r).await,
        Code::OutOfRange,
        "xfs needs at least 300",
    );
    let mut r = create_request("x", -1, cap.clone());
    r.capacity_range = Some(CapacityRange {
        required_bytes: -1,
        limit_bytes: 0,
    });
    expect(
        "negative capacity",
        c.create_volume(r).await,
        Code::InvalidArgument,
        "negative",
    );
    let mut r = create_request("x", 1 << 50, cap.clone());
    r.capacity_range = Some(CapacityRange {
        required_bytes: 1 << 50,
        limit_bytes: 0,
    });
    expect(
        "more than the disk holds",
        c.create_volume(r).await,
        Code::ResourceExhausted,
        "not enough space",
    );
    let mut multi = cap.clone();
    multi.access_mode = Some(volume_capability::AccessMode {
        mode: volume_capability::access_mode::Mode::MultiNodeMultiWriter as i32,
    });
    expect(
        "multi-node access",
        c.create_volume(create_request("x", MIB, multi)).await,
        Code::InvalidArgument,
        "MULTI_NODE_MULTI_WRITER",
    );
    let mut r = create_request("x", MIB, cap.clone());
    r.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: "../../etc/shadow".into(),
            },
        )),
    });
    expect(
        "hostile snapshot id",
        c.create_volume(r).await,
        Code::NotFound,
        "does not exist",
    );
    let mut r = create_request("x", MIB, cap.clone());
    r.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![Topology {
            segments: HashMap::from([(format!("{DRIVER}/node"), "another-node".into())]),
        }],
        preferred: vec![],
    });
    expect(
        "wrong node",
        c.create_volume(r).await,
        Code::ResourceExhausted,
        "not in the requested topology",
    );

    // None of the refusals above left anything behind.
    assert!(
        c.list_volumes(ListVolumesRequest::default())
            .await?
            .into_inner()
            .entries
            .is_empty()
    );
    assert_eq!(std::fs::read_dir(h.state.join("volumes"))?.count(), 0);

    // Same name, incompatible size → ALREADY_EXISTS.
    c.create_volume(create_request("same", 32 * MIB, cap.clone()))
        .await?;
    let mut r = create_request("same", 64 * MIB, cap.clone());
    r.capacity_range = Some(CapacityRange {
        required_bytes: 64 * MIB,
        limit_bytes: 64 * MIB,
    });
    expect(
        "same name, other size",
        c.create_volume(r).await,
        Code::AlreadyExists,
        "already exists",
    );

    expect(
        "delete without id",
        c.delete_volume(DeleteVolumeRequest::default()).await,
        Code::InvalidArgument,
        "volume_id is required",
    );
    c.delete_volume(DeleteVolumeRequest {
        volume_id: "../../../etc".into(),
        ..Default::default()
    })
    .await?;
    assert!(std::path::Path::new("/etc/passwd").exists());
    expect(
        "get of a malformed id",
        c.controller_get_volume(ControllerGetVolumeRequest {
            volume_id: "../x".into(),
        })
        .await,
        Code::NotFound,
        "does not exist",
    );
    expect(
        "invalid token",
        c.list_volumes(ListVolumesRequest {
            starting_token: "garbage".into(),
            ..Default::default()
        })
        .await,
        Code::Aborted,
        "starting_token",
    );
    expect(
        "negative max_entries",
        c.list_volumes(ListVolumesRequest {
            max_entries: -1,
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "max_entries",
    );
    expect(
        "expand without a range",
        c.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: "vol-x".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "capacity_range",
    );
    expect(
        "snapshot without source",
        c.create_snapshot(CreateSnapshotRequest {
            name: "s".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "source_volume_id",
    );
    expect(
        "snapshot of a missing volume",
        c.create_snapshot(CreateSnapshotRequest {
            name: "s".into(),
            source_volume_id: "vol-00000000000000000000000000000000".into(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "does not exist",
    );
    Ok(())
}

#[tokio::test]
async fn node_refuses_bad_ids_paths_and_capabilities() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("bad-node")?;
    let mut c = h.controller().await?;
    let mut n = h.node().await?;
    let cap = mount_capability("ext4");
    let id = c
        .create_volume(create_request("pvc", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let staging = h.staging_path("pv");
    let kubelet = h.kubelet.display().to_string();

    expect(
        "no volume id",
        n.node_stage_volume(stage_request("", &staging, cap.clone()))
            .await,
        Code::InvalidArgument,
        "volume_id is required",
    );
    expect(
        "malformed volume id",
        n.node_stage_volume(stage_request("../../dev/sda", &staging, cap.clone()))
            .await,
        Code::NotFound,
        "does not exist",
    );
    for (bad, hint) in [
        ("relative/staging".to_string(), "absolute"),
        (format!("{kubelet}/plugins/../../../etc"), ".."),
        ("/etc/ferrovol".to_string(), "outside the kubelet directory"),
        ("/".to_string(), "outside the kubelet directory"),
        (kubelet.clone(), "kubelet directory itself"),
    ] {
        let mut r = stage_request(&id, &staging, cap.clone());
        r.staging_target_path = bad.clone();
        expect(
            &format!("staging {bad}"),
            n.node_stage_volume(r).await,
            Code::InvalidArgument,
            hint,
        );
    }
    expect(
        "fsType off the allow-list",
        n.node_stage_volume(stage_request(&id, &staging, mount_capability("vfat")))
            .await,
        Code::InvalidArgument,
        "vfat",
    );
    let mut flags = cap.clone();
    if let Some(volume_capability::AccessType::Mount(m)) = &mut flags.access_type {
        m.mount_flags = vec!["bind".into()];
    }
    expect(
        "a bind mount flag",
        n.node_stage_volume(stage_request(&id, &staging, flags))
            .await,
        Code::InvalidArgument,
        "bind",
    );
    let mut no_cap = stage_request(&id, &staging, cap.clone());
    no_cap.volume_capability = None;
    expect(
        "no capability",
        n.node_stage_volume(no_cap).await,
        Code::InvalidArgument,
        "volume_capability",
    );
    assert!(
        h.loop_devices().is_empty(),
        "no refused stage attached a device"
    );

    n.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    for (bad, hint) in [
        ("/".to_string(), "outside"),
        (kubelet.clone(), "itself"),
        ("/tmp/elsewhere".to_string(), "outside"),
        (format!("{kubelet}/pods/./x"), ".."),
    ] {
        let r = publish_request(
            &id,
            &staging,
            std::path::Path::new(&bad),
            cap.clone(),
            false,
        );
        expect(
            &format!("target {bad}"),
            n.node_publish_volume(r).await,
            Code::InvalidArgument,
            hint,
        );
    }
    expect(
        "stats of a path outside",
        n.node_get_volume_stats(NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: "/etc".into(),
            ..Default::default()
        })
        .await,
        Code::NotFound,
        "no volume",
    );
    n.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    assert!(h.mounts().is_empty());
    Ok(())
}
