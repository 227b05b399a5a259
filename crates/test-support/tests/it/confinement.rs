//! Whoever can write a Kubernetes object can shape the paths and the publish context the node
//! plugin receives. Nothing outside the kubelet directory may be mounted over, removed, or
//! mounted into a pod.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use std::collections::HashMap;
use test_support::v1::*;
use test_support::*;
use tonic::Code;

#[tokio::test]
async fn planted_symlinks_dotdot_and_outside_paths_are_refused() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("confine")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability("ext4");
    let id = ctrl
        .create_volume(create_request("pvc-confine", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let staging_root = h.kubelet.join("plugins/staging");
    std::os::unix::fs::symlink("/etc", staging_root.join("to-etc"))?;
    std::os::unix::fs::symlink("/", staging_root.join("to-root"))?;
    let pods = h.kubelet.join("pods/evil/volumes");
    std::fs::create_dir_all(&pods)?;
    std::os::unix::fs::symlink("/", pods.join("vol"))?;
    std::os::unix::fs::symlink("/etc", h.kubelet.join("pods/evil-dir"))?;
    let etc_before: Vec<_> = std::fs::read_dir("/etc")?
        .flatten()
        .map(|e| e.file_name())
        .collect();

    let attempts: Vec<(String, Code)> = vec![
        // The staging path itself is a link to /etc: not a directory we may mount on.
        (
            staging_root.join("to-etc").display().to_string(),
            Code::FailedPrecondition,
        ),
        // A link on the way: refused by the kernel walk.
        (
            staging_root.join("to-root/tmp/x").display().to_string(),
            Code::InvalidArgument,
        ),
        (
            format!("{}/plugins/staging/../../../../etc", h.kubelet.display()),
            Code::InvalidArgument,
        ),
        ("/etc".into(), Code::InvalidArgument),
        ("/".into(), Code::InvalidArgument),
        (h.kubelet.display().to_string(), Code::InvalidArgument),
    ];
    for (path, code) in attempts {
        let mut r = stage_request(&id, &staging_root, cap.clone());
        r.staging_target_path = path.clone();
        let err = node.node_stage_volume(r).await.unwrap_err();
        assert_eq!(err.code(), code, "{path}: {err:?}");
        assert!(!err.message().is_empty());
    }
    assert!(
        h.mounts().is_empty(),
        "nothing was mounted: {:?}",
        h.mounts()
    );
    assert!(cloud_backend_mounts_at(&["/", "/etc"]).is_empty());

    // Publishing onto a planted link (to /) or through one (to /etc) is refused too.
    let staging = h.staging_path("pv-ok");
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    for (target, code) in [
        (pods.join("vol"), Code::FailedPrecondition),
        (h.kubelet.join("pods/evil-dir/vol"), Code::InvalidArgument),
    ] {
        let err = node
            .node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{}: {err:?}", target.display());
        let err = node
            .node_publish_volume(publish_request(
                &id,
                &staging,
                &target,
                block_capability(),
                false,
            ))
            .await
            .unwrap_err();
        assert!(
            matches!(err.code(), Code::FailedPrecondition | Code::InvalidArgument),
            "{err:?}"
        );
    }
    // Unpublish of a planted link leaves it (and what it points at) alone.
    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: id.clone(),
        target_path: pods.join("vol").display().to_string(),
    })
    .await?;
    assert!(
        std::fs::symlink_metadata(pods.join("vol"))?
            .file_type()
            .is_symlink()
    );
    assert_eq!(
        h.mounts().len(),
        1,
        "only the staging mount exists: {:?}",
        h.mounts()
    );
    let etc_after: Vec<_> = std::fs::read_dir("/etc")?
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(etc_before, etc_after, "/etc untouched");
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    Ok(())
}

fn cloud_backend_mounts_at(points: &[&str]) -> Vec<String> {
    // Mount points exactly at these paths that the plugin could have added (compared to a
    // fresh namespace, "/" always exists once; more would be ours).
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut out = Vec::new();
    for p in points {
        let n = text
            .lines()
            .filter(|l| l.split(' ').nth(4) == Some(p))
            .count();
        if (*p == "/" && n > 1) || (*p != "/" && n > 0) {
            out.push(p.to_string());
        }
    }
    out
}

#[tokio::test]
async fn a_device_named_in_the_publish_context_is_never_trusted() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("confine-device")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability("ext4");
    let a = ctrl
        .create_volume(create_request("pvc-a", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let b = ctrl
        .create_volume(create_request("pvc-b", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let (sa, sb) = (h.staging_path("pv-a"), h.staging_path("pv-b"));
    node.node_stage_volume(stage_request(&a, &sa, cap.clone()))
        .await?;
    std::fs::write(sa.join("owner"), b"volume a")?;
    let dev_a = h.loop_of(&a).expect("a is attached");

    // Whoever wrote this VolumeAttachment status wants volume a's device (or the root disk)
    // mounted as volume b.
    for device in [dev_a.clone(), "/dev/vda".to_string()] {
        let mut r = stage_request(&b, &sb, cap.clone());
        r.publish_context = HashMap::from([
            ("devicePath".to_string(), device.clone()),
            ("device".to_string(), device.clone()),
        ]);
        node.node_stage_volume(r).await?;
        let dev_b = h.loop_of(&b).expect("b has its own device");
        assert_ne!(dev_b, dev_a);
        assert_eq!(
            mount_device(&sb),
            Some(dev_numbers(std::path::Path::new(&dev_b))),
            "b's staging holds b's own device"
        );
        assert!(!sb.join("owner").exists(), "a's data is not visible as b");
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: b.clone(),
            staging_target_path: sb.display().to_string(),
        })
        .await?;
    }
    assert_eq!(std::fs::read(sa.join("owner"))?, b"volume a");
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: a.clone(),
        staging_target_path: sa.display().to_string(),
    })
    .await?;
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    Ok(())
}
