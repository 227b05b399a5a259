//! The aws backend against a real EC2 API emulator (moto) on loopback, driven over gRPC through
//! the real binaries, with a hypervisor stand-in presenting attached volumes as loop devices.

#![allow(clippy::unwrap_used)] // test code: a panic with a line number is the report

use std::collections::HashMap;
use std::io::{Read, Write};
use test_support::aws::{self, Hypervisor, Moto};
use test_support::faultproxy::FaultProxy;
use test_support::v1::*;
use test_support::*;
use tonic::Code;

const GIB: i64 = 1 << 30;

pub(crate) struct World {
    pub h: Harness,
    /// Straight to the emulator, bypassing any fault proxy: what the tests check with.
    pub ec2: aws_sdk_ec2::Client,
    pub instance: String,
    pub hv: Hypervisor,
    pub metrics: std::net::SocketAddr,
    /// Between the driver and the emulator, when the world was made with one.
    pub proxy: Option<FaultProxy>,
    _moto: Moto,
}

async fn world(name: &str) -> anyhow::Result<World> {
    world_with(name, false).await
}

/// A world whose driver talks to the emulator through a [`FaultProxy`] when `proxied`.
pub(crate) async fn world_with(name: &str, proxied: bool) -> anyhow::Result<World> {
    require_private_mount_namespace();
    let root = std::env::var_os("FERROVOL_TEST_ROOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("{name}-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let moto = Moto::start(&root.join("moto.log"))?;
    let ec2 = moto.client();
    let instance = aws::run_instance(&ec2, aws::ZONE).await?;
    let hv = Hypervisor::start(ec2.clone(), instance.clone(), &root.join("hypervisor"))?;
    let metrics: std::net::SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let proxy = if proxied {
        Some(FaultProxy::start(&moto.endpoint)?)
    } else {
        None
    };
    let target = AwsTarget {
        endpoint: proxy
            .as_ref()
            .map_or_else(|| moto.endpoint.clone(), |p| p.endpoint.clone()),
        instance_id: instance.clone(),
        by_id: hv.by_id.clone(),
        sys: hv.sys.clone(),
    };
    let h = Harness::start_with(
        name,
        Options {
            aws: Some(target),
            controller_extra_args: vec![format!("--metrics-address={metrics}")],
            ..Default::default()
        },
    )?;
    Ok(World {
        h,
        ec2,
        instance,
        hv,
        metrics,
        proxy,
        _moto: moto,
    })
}

fn scrape(addr: std::net::SocketAddr) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// Sum of a counter over all label sets matching `needle` (e.g. `operation="ModifyVolume"`).
fn counter(text: &str, name: &str, needle: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

pub(crate) fn zone_topology() -> TopologyRequirement {
    let t = Topology {
        segments: HashMap::from([(cloud_backend_zone_key(), aws::ZONE.to_string())]),
    };
    TopologyRequirement {
        requisite: vec![t.clone()],
        preferred: vec![t],
    }
}

fn cloud_backend_zone_key() -> String {
    "topology.kubernetes.io/zone".to_string()
}

pub(crate) async fn describe(ec2: &aws_sdk_ec2::Client, id: &str) -> aws_sdk_ec2::types::Volume {
    ec2.describe_volumes()
        .volume_ids(id)
        .send()
        .await
        .unwrap()
        .volumes()[0]
        .clone()
}

pub(crate) fn tags(v: &aws_sdk_ec2::types::Volume) -> HashMap<String, String> {
    v.tags()
        .iter()
        .map(|t| {
            (
                t.key().unwrap_or_default().to_string(),
                t.value().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn controller_rpcs_against_the_emulator() -> anyhow::Result<()> {
    let w = world("aws-controller").await?;
    let mut c = w.h.controller().await?;
    let cap = mount_capability("ext4");

    // CreateVolume: type, iopsPerGB capped, templated tags, zone from topology, whole GiB.
    let mut req = create_request("pvc-a", 5 * GIB, cap.clone());
    req.parameters = HashMap::from([
        ("type".into(), "io2".into()),
        ("iopsPerGB".into(), "100".into()),
        (
            "tagSpecification_1".into(),
            "owner={{ .PVCNamespace }}/{{ .PVCName }}".into(),
        ),
        ("csi.storage.k8s.io/pvc/name".into(), "data-0".into()),
        ("csi.storage.k8s.io/pvc/namespace".into(), "db".into()),
    ]);
    req.accessibility_requirements = Some(zone_topology());
    let vol = c
        .create_volume(req.clone())
        .await?
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(vol.capacity_bytes, 5 * GIB);
    assert_eq!(
        vol.accessible_topology[0]
            .segments
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some(aws::ZONE)
    );
    let v = describe(&w.ec2, &vol.volume_id).await;
    assert_eq!(v.volume_type().unwrap().as_str(), "io2");
    assert_eq!(v.iops(), Some(500));
    assert_eq!(v.availability_zone(), Some(aws::ZONE));
    let t = tags(&v);
    assert_eq!(t.get("CSIVolumeName").map(String::as_str), Some("pvc-a"));
    assert_eq!(t.get("owner").map(String::as_str), Some("db/data-0"));
    assert_eq!(
        t.get("ferrovol.dev/cluster").map(String::as_str),
        Some("ferrovol")
    );
    assert_eq!(
        t.get("kubernetes.io/created-for/pvc/name")
            .map(String::as_str),
        Some("data-0")
    );

    // Idempotent by name (moto ignores ClientToken: only the tag lookup prevents a duplicate).
    let again = c
        .create_volume(req.clone())
        .await?
        .into_inner()
        .volume
        .unwrap();
    assert_eq!(again.volume_id, vol.volume_id);
    let named = aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-a").await?;
    assert_eq!(named.len(), 1, "exactly one volume for the name");
    let mut other = req.clone();
    other.capacity_range = Some(CapacityRange {
        required_bytes: 8 * GIB,
        limit_bytes: 8 * GIB,
    });
    assert_eq!(
        c.create_volume(other).await.unwrap_err().code(),
        Code::AlreadyExists
    );

    // Bad parameters and sizes, refused before EC2 is called.
    let mut bad = create_request("pvc-bad", GIB, cap.clone());
    bad.parameters = HashMap::from([("type".into(), "gp9".into())]);
    let e = c.create_volume(bad.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("gp9"));
    bad.parameters = HashMap::from([
        ("type".into(), "gp3".into()),
        ("iops".into(), "90000".into()),
    ]);
    assert_eq!(
        c.create_volume(bad.clone()).await.unwrap_err().code(),
        Code::InvalidArgument
    );
    bad.parameters = HashMap::from([("type".into(), "standard".into())]);
    bad.capacity_range = Some(CapacityRange {
        required_bytes: 2000 * GIB,
        limit_bytes: 0,
    });
    assert_eq!(
        c.create_volume(bad).await.unwrap_err().code(),
        Code::OutOfRange
    );
    let mut odd = create_request("pvc-odd", GIB + 1, cap.clone());
    odd.accessibility_requirements = Some(zone_topology());
    let odd = c.create_volume(odd).await?.into_inner().volume.unwrap();
    assert_eq!(odd.capacity_bytes, 2 * GIB, "rounded up to whole GiB");

    // Attach: a device name per instance, never reused while taken; idempotent.
    let p1 = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: w.instance.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?
        .into_inner();
    let dev1 = p1.publish_context.get("devicePath").cloned().unwrap();
    let p1b = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: w.instance.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(p1b.publish_context.get("devicePath"), Some(&dev1));
    let p2 = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: odd.volume_id.clone(),
            node_id: w.instance.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_ne!(
        p2.publish_context.get("devicePath"),
        Some(&dev1),
        "a taken device name is never handed out again"
    );
    let v = describe(&w.ec2, &vol.volume_id).await;
    assert_eq!(v.attachments()[0].instance_id(), Some(w.instance.as_str()));
    for (volume_id, node_id, code) in [
        (
            vol.volume_id.clone(),
            "i-00000000".to_string(),
            Code::NotFound,
        ),
        (
            vol.volume_id.clone(),
            "not-an-instance".to_string(),
            Code::NotFound,
        ),
        (
            "vol-00000000".to_string(),
            w.instance.clone(),
            Code::NotFound,
        ),
    ] {
        let e = c
            .controller_publish_volume(ControllerPublishVolumeRequest {
                volume_id,
                node_id,
                volume_capability: Some(cap.clone()),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{e:?}");
    }
    let e = c
        .delete_volume(DeleteVolumeRequest {
            volume_id: vol.volume_id.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        e.code(),
        Code::FailedPrecondition,
        "an attached volume is not deleted: {e:?}"
    );
    let got = c
        .controller_get_volume(ControllerGetVolumeRequest {
            volume_id: vol.volume_id.clone(),
        })
        .await?
        .into_inner();
    assert_eq!(
        got.status.unwrap().published_node_ids,
        vec![w.instance.clone()]
    );

    // Detach from every node (empty node id), twice.
    for _ in 0..2 {
        c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: vol.volume_id.clone(),
            node_id: String::new(),
            ..Default::default()
        })
        .await?;
    }
    assert!(
        describe(&w.ec2, &vol.volume_id)
            .await
            .attachments()
            .iter()
            .all(|a| a.state() == Some(&aws_sdk_ec2::types::VolumeAttachmentState::Detached))
    );
    c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: odd.volume_id.clone(),
        node_id: w.instance.clone(),
        ..Default::default()
    })
    .await?;

    // Expand and modify: one ModifyVolume when they arrive together.
    let before = counter(
        &scrape(w.metrics),
        "ferrovol_cloud_api_requests_total",
        "operation=\"ModifyVolume\"",
    );
    let (mut c1, mut c2) = (c.clone(), c.clone());
    let id = vol.volume_id.clone();
    let (e, m) = tokio::join!(
        c1.controller_expand_volume(ControllerExpandVolumeRequest {
            volume_id: id.clone(),
            capacity_range: Some(CapacityRange {
                required_bytes: 10 * GIB,
                limit_bytes: 0
            }),
            ..Default::default()
        }),
        c2.controller_modify_volume(ControllerModifyVolumeRequest {
            volume_id: id.clone(),
            mutable_parameters: HashMap::from([("iops".into(), "4000".into())]),
            ..Default::default()
        })
    );
    assert_eq!(e?.into_inner().capacity_bytes, 10 * GIB);
    m?;
    let after = counter(
        &scrape(w.metrics),
        "ferrovol_cloud_api_requests_total",
        "operation=\"ModifyVolume\"",
    );
    assert_eq!(
        after - before,
        1,
        "expand and modify coalesced into one ModifyVolume"
    );
    let v = describe(&w.ec2, &id).await;
    assert_eq!((v.size(), v.iops()), (Some(10), Some(4000)));
    let e = c
        .controller_modify_volume(ControllerModifyVolumeRequest {
            volume_id: id.clone(),
            mutable_parameters: HashMap::from([("colour".into(), "blue".into())]),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Snapshots: idempotent by name, paginated, filtered.
    let s1 = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-a".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    let s1b = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-a".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(s1.snapshot_id, s1b.snapshot_id);
    assert!(s1.ready_to_use);
    let e = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: odd.volume_id.clone(),
            name: "snap-a".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists);
    let s2 = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: odd.volume_id.clone(),
            name: "snap-b".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    let page1 = c
        .list_snapshots(ListSnapshotsRequest {
            max_entries: 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(page1.entries.len(), 1);
    assert!(!page1.next_token.is_empty());
    let page2 = c
        .list_snapshots(ListSnapshotsRequest {
            starting_token: page1.next_token,
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(page2.entries.len(), 1);
    let by_source = c
        .list_snapshots(ListSnapshotsRequest {
            source_volume_id: odd.volume_id.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(by_source.entries.len(), 1);
    assert_eq!(
        by_source.entries[0].snapshot.as_ref().unwrap().snapshot_id,
        s2.snapshot_id
    );
    let mut restore = create_request("pvc-restore", 0, cap.clone());
    restore.capacity_range = None;
    restore.accessibility_requirements = Some(zone_topology());
    restore.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: s1.snapshot_id.clone(),
            },
        )),
    });
    let r = c.create_volume(restore).await?.into_inner().volume.unwrap();
    assert!(r.content_source.is_some());
    assert_eq!(r.capacity_bytes, 10 * GIB, "at least the snapshot's size");

    let listed = c
        .list_volumes(ListVolumesRequest::default())
        .await?
        .into_inner();
    assert_eq!(listed.entries.len(), 3);
    for s in [&s1, &s2] {
        for _ in 0..2 {
            c.delete_snapshot(DeleteSnapshotRequest {
                snapshot_id: s.snapshot_id.clone(),
                ..Default::default()
            })
            .await?;
        }
    }
    for v in [&vol.volume_id, &odd.volume_id, &r.volume_id] {
        for _ in 0..2 {
            c.delete_volume(DeleteVolumeRequest {
                volume_id: v.clone(),
                ..Default::default()
            })
            .await?;
        }
    }
    let left = aws::volumes_tagged(&w.ec2, "ferrovol.dev/cluster", "ferrovol").await?;
    assert!(left.is_empty(), "nothing leaked: {left:?}");
    let text = scrape(w.metrics);
    assert!(
        text.contains("ferrovol_cloud_api_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(
        text.contains("ferrovol_csi_operation_duration_seconds_count{method=\"CreateVolume\""),
        "per-RPC latency is exported"
    );
    assert!(
        text.contains("ferrovol_cloud_healthy 1"),
        "the background cloud check reports health"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_attach_stage_and_restore_on_the_node() -> anyhow::Result<()> {
    let w = world("aws-node").await?;
    let mut c = w.h.controller().await?;
    let mut n = w.h.node().await?;
    let info = n.node_get_info(NodeGetInfoRequest {}).await?.into_inner();
    assert_eq!(info.node_id, w.instance);
    assert_eq!(
        info.accessible_topology
            .unwrap()
            .segments
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some(aws::ZONE)
    );
    assert_eq!(
        info.max_volumes_per_node, 26,
        "m5.large: 28 Nitro slots minus the root volume and one interface"
    );

    let cap = mount_capability("xfs");
    let mut req = create_request("pvc-node", GIB, cap.clone());
    req.accessibility_requirements = Some(zone_topology());
    let id = c
        .create_volume(req)
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let ctx = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: w.instance.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?
        .into_inner()
        .publish_context;
    let (staging, target) = (w.h.staging_path("pv-node"), w.h.target_path("pod-node"));
    let mut stage = stage_request(&id, &staging, cap.clone());
    stage.publish_context = ctx.clone();
    n.node_stage_volume(stage.clone()).await?;
    let mut publish = publish_request(&id, &staging, &target, cap.clone(), false);
    publish.publish_context = ctx.clone();
    n.node_publish_volume(publish.clone()).await?;
    std::fs::write(target.join("data"), b"on an EBS volume")?;
    assert_eq!(blkid_type(&w.hv.disk(&id)).as_deref(), Some("xfs"));

    // Online expansion through ModifyVolume and the node.
    let before = df_size(&target);
    c.controller_expand_volume(ControllerExpandVolumeRequest {
        volume_id: id.clone(),
        capacity_range: Some(CapacityRange {
            required_bytes: 2 * GIB,
            limit_bytes: 0,
        }),
        ..Default::default()
    })
    .await?;
    let got = retry("node expand", || {
        let (mut n, r) = (
            n.clone(),
            NodeExpandVolumeRequest {
                volume_id: id.clone(),
                volume_path: target.display().to_string(),
                ..Default::default()
            },
        );
        async move {
            let resp = n.node_expand_volume(r).await?;
            if resp.get_ref().capacity_bytes < 2 * GIB {
                // The hypervisor has not grown the disk yet.
                return Err(tonic::Status::unavailable("not grown yet"));
            }
            Ok(resp)
        }
    })
    .await?;
    assert_eq!(got.capacity_bytes, 2 * GIB);
    assert!(df_size(&target) > before, "the filesystem grew");

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
    let snap = c
        .create_snapshot(CreateSnapshotRequest {
            source_volume_id: id.clone(),
            name: "snap-node".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .unwrap();
    c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: w.instance.clone(),
        ..Default::default()
    })
    .await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // (The instance's root volume, which moto creates with it, stays attached.)
    while w.hv.attached().contains(&id) && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        !w.hv.attached().contains(&id),
        "the detach removed the device"
    );

    // Restore the snapshot into a new volume, attach it, stage it: the data is there.
    let mut restore = create_request("pvc-node-restore", 2 * GIB, cap.clone());
    restore.accessibility_requirements = Some(zone_topology());
    restore.volume_content_source = Some(VolumeContentSource {
        r#type: Some(volume_content_source::Type::Snapshot(
            volume_content_source::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            },
        )),
    });
    let rid = c
        .create_volume(restore)
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let rctx = c
        .controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: rid.clone(),
            node_id: w.instance.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?
        .into_inner()
        .publish_context;
    let rst = w.h.staging_path("pv-node-restore");
    let mut stage = stage_request(&rid, &rst, cap.clone());
    stage.publish_context = rctx;
    n.node_stage_volume(stage).await?;
    assert_eq!(std::fs::read(rst.join("data"))?, b"on an EBS volume");
    n.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: rid.clone(),
        staging_target_path: rst.display().to_string(),
    })
    .await?;
    c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: rid.clone(),
        node_id: String::new(),
        ..Default::default()
    })
    .await?;
    for v in [&id, &rid] {
        c.delete_volume(DeleteVolumeRequest {
            volume_id: v.clone(),
            ..Default::default()
        })
        .await?;
    }
    c.delete_snapshot(DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        ..Default::default()
    })
    .await?;
    assert!(w.h.mounts().is_empty(), "{:?}", w.h.mounts());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_that_cannot_be_tied_to_the_volume_is_never_used() -> anyhow::Result<()> {
    let w = world("aws-trust").await?;
    let mut c = w.h.controller().await?;
    let mut n = w.h.node().await?;
    let cap = mount_capability("ext4");
    let mut ids = Vec::new();
    for name in ["pvc-x", "pvc-y"] {
        let mut req = create_request(name, GIB, cap.clone());
        req.accessibility_requirements = Some(zone_topology());
        let id = c
            .create_volume(req)
            .await?
            .into_inner()
            .volume
            .unwrap()
            .volume_id;
        c.controller_publish_volume(ControllerPublishVolumeRequest {
            volume_id: id.clone(),
            node_id: w.instance.clone(),
            volume_capability: Some(cap.clone()),
            ..Default::default()
        })
        .await?;
        ids.push(id);
    }
    let link = |id: &str| {
        w.hv.by_id.join(format!(
            "nvme-Amazon_Elastic_Block_Store_{}",
            id.replace('-', "")
        ))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !(link(&ids[0]).exists() && link(&ids[1]).exists())
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // A stale (or forged) link: x's name pointing at y's device, and a publish context naming
    // the root disk. The serial check must refuse both.
    let y_dev = std::fs::read_link(link(&ids[1]))?;
    std::fs::remove_file(link(&ids[0]))?;
    std::os::unix::fs::symlink(&y_dev, link(&ids[0]))?;
    let staging = w.h.staging_path("pv-x");
    let mut stage = stage_request(&ids[0], &staging, cap.clone());
    stage.publish_context = HashMap::from([("devicePath".to_string(), "/dev/vda".to_string())]);
    let e = n.node_stage_volume(stage).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("tied"), "{}", e.message());
    assert!(w.h.mounts().is_empty());
    assert_eq!(
        blkid_type(&w.hv.disk(&ids[1])),
        None,
        "y's device was not formatted"
    );
    for id in &ids {
        c.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
            volume_id: id.clone(),
            node_id: String::new(),
            ..Default::default()
        })
        .await?;
        c.delete_volume(DeleteVolumeRequest {
            volume_id: id.clone(),
            ..Default::default()
        })
        .await?;
    }
    Ok(())
}
