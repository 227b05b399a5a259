//! The aws backend through the fault-injecting proxy: EC2 throttles, fails with 5xx, loses
//! answers, answers late, and says the things the emulator never says (IncorrectState, a
//! device name in use, VolumeLimitExceeded, IdempotentParameterMismatch). Whatever happens,
//! a create yields exactly one volume, every lifecycle completes when retried as the CO
//! retries, and nothing is left behind in the emulator or on the node.

#![allow(clippy::unwrap_used)] // test code: a panic with a line number is the report

use crate::aws::{World, world_with, zone_topology};
use std::time::{Duration, Instant};
use test_support::aws;
use test_support::faultproxy::{Fault, FaultProxy};
use test_support::v1::*;
use test_support::*;
use tonic::Code;

const GIB: i64 = 1 << 30;

fn proxy(w: &World) -> &FaultProxy {
    w.proxy.as_ref().unwrap()
}

fn request(name: &str) -> CreateVolumeRequest {
    let mut req = create_request(name, GIB, mount_capability("ext4"));
    req.accessibility_requirements = Some(zone_topology());
    req
}

/// Retries `call` as external-provisioner and -attacher do: every error but the ones that say
/// the request itself is wrong, with a short pause, for a bounded time. Returns the answer and
/// the codes of the failures seen on the way.
async fn as_the_co_would<T, F, Fut>(what: &str, mut call: F) -> (T, Vec<Code>)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut failures = vec![];
    loop {
        match call().await {
            Ok(r) => return (r.into_inner(), failures),
            Err(s)
                if !matches!(
                    s.code(),
                    Code::InvalidArgument | Code::AlreadyExists | Code::OutOfRange
                ) && Instant::now() < deadline =>
            {
                failures.push(s.code());
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("{what}: {s:?} after {failures:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_through_faults_makes_exactly_one_volume() -> anyhow::Result<()> {
    let w = world_with("aws-faults-create", true).await?;
    let p = proxy(&w);
    let mut c = w.h.controller().await?;

    // (name, fault, how many calls it hits, CreateVolume calls expected in all)
    let cases = [
        ("pvc-throttled", Fault::Throttle, 2, 3),
        ("pvc-5xx", Fault::ServerError, 2, 3),
        // The emulator creates the volume, the answer is lost: the driver must find it by
        // name instead of creating another (the SDK's own retry would have).
        ("pvc-lost-answer", Fault::LoseAnswer, 1, 1),
        (
            "pvc-token-burnt",
            Fault::error(
                "IdempotentParameterMismatch",
                "The client token you have provided is associated with a resource that is already deleted. Please use a different client token.",
            ),
            1,
            2,
        ),
    ];
    for (name, fault, times, expected_calls) in cases {
        p.reset_calls();
        p.inject("CreateVolume", fault.clone(), times);
        let v = c
            .create_volume(request(name))
            .await
            .unwrap_or_else(|e| panic!("{name} ({fault:?}): {e:?}"))
            .into_inner()
            .volume
            .unwrap();
        assert_eq!(
            aws::volumes_tagged(&w.ec2, "CSIVolumeName", name).await?,
            vec![v.volume_id.clone()],
            "{name}: exactly one volume"
        );
        assert_eq!(
            p.calls_of("CreateVolume"),
            expected_calls,
            "{name}: CreateVolume calls"
        );
        // Asked again (the CO's retry of a call it saw time out): the same volume.
        let again = c.create_volume(request(name)).await?.into_inner();
        assert_eq!(again.volume.unwrap().volume_id, v.volume_id);
    }

    // Out of quota: a clear RESOURCE_EXHAUSTED, nothing created; once quota is back, one.
    p.inject(
        "CreateVolume",
        Fault::error(
            "VolumeLimitExceeded",
            "You have exceeded your maximum gp3 storage limit of 50 TiB in this region.",
        ),
        1,
    );
    let e = c.create_volume(request("pvc-quota")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("VolumeLimitExceeded"), "{e:?}");
    assert!(
        aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-quota")
            .await?
            .is_empty()
    );
    let v = c.create_volume(request("pvc-quota")).await?.into_inner();
    assert_eq!(
        aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-quota").await?,
        vec![v.volume.unwrap().volume_id]
    );

    // Lasting throttling: the driver gives up with UNAVAILABLE (the CO retries), having
    // created nothing.
    p.inject("CreateVolume", Fault::Throttle, 100);
    let e = c.create_volume(request("pvc-storm")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    p.clear();
    assert!(
        aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-storm")
            .await?
            .is_empty()
    );

    // Snapshots have no ClientToken at all: only the lookup by name prevents a duplicate.
    let source = aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-quota").await?[0].clone();
    for (name, fault, times) in [
        ("snap-lost-answer", Fault::LoseAnswer, 1),
        ("snap-throttled", Fault::Throttle, 2),
    ] {
        p.inject("CreateSnapshot", fault, times);
        let s = c
            .create_snapshot(CreateSnapshotRequest {
                source_volume_id: source.clone(),
                name: name.into(),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("{name}: {e:?}"))
            .into_inner()
            .snapshot
            .unwrap();
        assert_eq!(
            aws::snapshots_tagged(&w.ec2, "CSIVolumeSnapshotName", name).await?,
            vec![s.snapshot_id.clone()],
            "{name}: exactly one snapshot"
        );
        c.delete_snapshot(DeleteSnapshotRequest {
            snapshot_id: s.snapshot_id,
            ..Default::default()
        })
        .await?;
    }

    for id in aws::volumes_tagged(&w.ec2, "ferrovol.dev/cluster", "ferrovol").await? {
        c.delete_volume(DeleteVolumeRequest {
            volume_id: id,
            ..Default::default()
        })
        .await?;
    }
    assert!(
        aws::volumes_tagged(&w.ec2, "ferrovol.dev/cluster", "ferrovol")
            .await?
            .is_empty()
    );
    assert!(
        aws::snapshots_tagged(&w.ec2, "ferrovol.dev/cluster", "ferrovol")
            .await?
            .is_empty()
    );
    assert!(
        p.faults_applied() >= 10,
        "the faults were injected: {}",
        p.faults_applied()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lifecycle_completes_through_faults_and_nothing_leaks() -> anyhow::Result<()> {
    let w = world_with("aws-faults-lifecycle", true).await?;
    let p = proxy(&w);
    let c = w.h.controller().await?;
    let n = w.h.node().await?;
    let cap = mount_capability("ext4");
    let in_use = Fault::error(
        "InvalidParameterValue",
        "Invalid value '/dev/xvdba' for unixDevice. Attachment point /dev/xvdba is already in use",
    );
    // One lifecycle per plan: the faults it meets on the way.
    let plans: Vec<Vec<(&str, Fault, u32)>> = vec![
        vec![("AttachVolume", in_use, 1)],
        vec![
            (
                "AttachVolume",
                Fault::error(
                    "IncorrectState",
                    "vol-0123 is in the 'creating' state and cannot be attached",
                ),
                1,
            ),
            (
                "DeleteVolume",
                Fault::error("IncorrectState", "The volume is still detaching"),
                1,
            ),
        ],
        vec![(
            "AttachVolume",
            Fault::error(
                "AttachmentLimitExceeded",
                "You have reached the maximum number of attachments for this instance",
            ),
            1,
        )],
        vec![
            ("DescribeVolumes", Fault::ServerError, 2),
            ("DescribeInstances", Fault::Throttle, 2),
        ],
        vec![
            ("DetachVolume", Fault::LoseAnswer, 1),
            ("DeleteVolume", Fault::LoseAnswer, 1),
        ],
        vec![
            ("AttachVolume", Fault::LoseAnswer, 1),
            ("CreateVolume", Fault::Slow(Duration::from_secs(2)), 1),
        ],
        vec![
            ("DetachVolume", Fault::Throttle, 3),
            (
                "DescribeVolumes",
                Fault::Slow(Duration::from_millis(700)),
                3,
            ),
        ],
    ];
    let mut seen = vec![];
    let mut ids = vec![];
    for (i, plan) in plans.into_iter().enumerate() {
        for (action, fault, times) in &plan {
            p.inject(action, fault.clone(), *times);
        }
        let name = format!("pvc-life-{i}");
        let (created, f1) = as_the_co_would("create", || {
            let mut c = c.clone();
            let r = request(&name);
            async move { c.create_volume(r).await }
        })
        .await;
        let id = created.volume.unwrap().volume_id;
        ids.push(id.clone());
        let (published, f2) = as_the_co_would("attach", || {
            let mut c = c.clone();
            let r = ControllerPublishVolumeRequest {
                volume_id: id.clone(),
                node_id: w.instance.clone(),
                volume_capability: Some(cap.clone()),
                ..Default::default()
            };
            async move { c.controller_publish_volume(r).await }
        })
        .await;
        let (staging, target) = (
            w.h.staging_path(&format!("pv-life-{i}")),
            w.h.target_path(&format!("pod-life-{i}")),
        );
        let mut stage = stage_request(&id, &staging, cap.clone());
        stage.publish_context = published.publish_context.clone();
        retry("stage", || {
            let (mut n, r) = (n.clone(), stage.clone());
            async move { n.node_stage_volume(r).await }
        })
        .await?;
        let mut publish = publish_request(&id, &staging, &target, cap.clone(), false);
        publish.publish_context = published.publish_context.clone();
        retry("publish", || {
            let (mut n, r) = (n.clone(), publish.clone());
            async move { n.node_publish_volume(r).await }
        })
        .await?;
        std::fs::write(target.join("data"), format!("lifecycle {i}"))?;
        n.clone()
            .node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: target.display().to_string(),
            })
            .await?;
        n.clone()
            .node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: staging.display().to_string(),
            })
            .await?;
        let (_, f3) = as_the_co_would("detach", || {
            let mut c = c.clone();
            let r = ControllerUnpublishVolumeRequest {
                volume_id: id.clone(),
                node_id: w.instance.clone(),
                ..Default::default()
            };
            async move { c.controller_unpublish_volume(r).await }
        })
        .await;
        let (_, f4) = as_the_co_would("delete", || {
            let mut c = c.clone();
            let r = DeleteVolumeRequest {
                volume_id: id.clone(),
                ..Default::default()
            };
            async move { c.delete_volume(r).await }
        })
        .await;
        assert!(
            aws::volumes_tagged(&w.ec2, "CSIVolumeName", &name)
                .await?
                .is_empty(),
            "lifecycle {i}: the volume is gone"
        );
        p.clear();
        seen.push((i, [f1, f2, f3, f4].concat()));
    }
    // The errors the CO sees are the spec's: FAILED_PRECONDITION for a state to wait out,
    // RESOURCE_EXHAUSTED for a limit, UNAVAILABLE for an outage; never INTERNAL.
    for (i, codes) in &seen {
        assert!(
            codes.iter().all(|c| matches!(
                c,
                Code::FailedPrecondition
                    | Code::ResourceExhausted
                    | Code::Unavailable
                    | Code::Aborted
            )),
            "lifecycle {i}: {codes:?}"
        );
    }
    assert_eq!(seen[1].1[0], Code::FailedPrecondition, "IncorrectState");
    assert_eq!(seen[2].1, vec![Code::ResourceExhausted], "attachment limit");

    // Nothing left: no volume of ours in the emulator, no disk on the node, no mount.
    assert!(
        aws::volumes_tagged(&w.ec2, "ferrovol.dev/cluster", "ferrovol")
            .await?
            .is_empty()
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    let on_node = || {
        let attached = w.hv.attached();
        ids.iter()
            .filter(|id| attached.contains(id))
            .cloned()
            .collect::<Vec<_>>()
    };
    while !on_node().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(on_node().is_empty(), "still attached: {:?}", on_node());
    for id in &ids {
        let disk = w.hv.disk(id).display().to_string();
        assert!(
            !loop_devices_under(&w.hv.disks)
                .iter()
                .any(|(_, f)| *f == disk),
            "{id}: a loop device is left"
        );
    }
    assert!(w.h.mounts().is_empty(), "{:?}", w.h.mounts());
    Ok(())
}

/// SIGKILL in the middle of CreateVolume (EC2 has the volume, the answer has not arrived),
/// then a restart: the CO's retry gets that volume, and no second one exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_controller_killed_mid_create_returns_the_same_volume_after_restart() -> anyhow::Result<()>
{
    let mut w = world_with("aws-faults-kill", true).await?;
    proxy(&w).inject("CreateVolume", Fault::Slow(Duration::from_secs(5)), 1);
    let c = w.h.controller().await?;
    let in_flight = tokio::spawn({
        let mut c = c.clone();
        async move { c.create_volume(request("pvc-killed")).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let made = loop {
        let ids = aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-killed").await?;
        if !ids.is_empty() {
            break ids;
        }
        assert!(Instant::now() < deadline, "the emulator never got the call");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    w.h.controller.kill();
    assert!(
        in_flight.await?.is_err(),
        "the call died with the controller"
    );
    w.h.controller.start()?;
    let p = proxy(&w);
    p.reset_calls();
    let c = w.h.controller().await?;
    let v = retry("create after restart", || {
        let mut c = c.clone();
        async move { c.create_volume(request("pvc-killed")).await }
    })
    .await?
    .volume
    .unwrap();
    assert_eq!(
        vec![v.volume_id.clone()],
        made,
        "the volume made before the kill"
    );
    assert_eq!(
        aws::volumes_tagged(&w.ec2, "CSIVolumeName", "pvc-killed").await?,
        made,
        "no duplicate"
    );
    assert_eq!(
        p.calls_of("CreateVolume"),
        0,
        "found by name, not created again"
    );
    c.clone()
        .delete_volume(DeleteVolumeRequest {
            volume_id: v.volume_id,
            ..Default::default()
        })
        .await?;
    assert!(
        aws::volumes_tagged(&w.ec2, "ferrovol.dev/cluster", "ferrovol")
            .await?
            .is_empty()
    );
    Ok(())
}
