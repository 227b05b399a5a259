//! A node reboot, as the plugin sees it: every mount and loop device gone behind its back, the
//! staging directories still there. The next NodeStage — or a NodePublish arriving first —
//! re-attaches and re-mounts without formatting, and the data is there.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use test_support::v1::*;
use test_support::*;

#[tokio::test]
async fn volumes_come_back_after_a_reboot_without_reformatting() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let mut h = Harness::start("reboot")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let mut vols = Vec::new();
    for (name, fs, size) in [
        ("pvc-reboot-ext4", "ext4", 64 * MIB),
        ("pvc-reboot-xfs", "xfs", 300 * MIB),
    ] {
        let cap = mount_capability(fs);
        let id = ctrl
            .create_volume(create_request(name, size, cap.clone()))
            .await?
            .into_inner()
            .volume
            .unwrap()
            .volume_id;
        let (staging, target) = (h.staging_path(name), h.target_path(name));
        node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
            .await?;
        node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
            .await?;
        std::fs::write(target.join("before-reboot"), name.as_bytes())?;
        let uuid = blkid_uuid(&h.image(&id)).expect("a filesystem UUID");
        vols.push((id, cap, staging, target, uuid, name));
    }

    // The reboot: plugins die, every mount and loop device vanishes, directories stay.
    h.node.kill();
    h.controller.kill();
    for m in h.mounts().into_iter().rev() {
        assert!(
            std::process::Command::new("umount")
                .arg("-l")
                .arg(&m)
                .status()?
                .success()
        );
    }
    // Pages written through the mounts reach the image files before the devices go away.
    for (dev, _) in h.loop_devices() {
        assert!(
            std::process::Command::new("losetup")
                .args(["-d", &dev])
                .status()?
                .success()
        );
    }
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    h.controller.start()?;
    h.node.start()?;
    node = h.node().await?;

    // Volume 0: kubelet stages then publishes. Volume 1: a publish arrives first.
    let (id, cap, staging, target, uuid, name) = &vols[0];
    node.node_stage_volume(stage_request(id, staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish_request(id, staging, target, cap.clone(), false))
        .await?;
    assert_eq!(
        std::fs::read(target.join("before-reboot"))?,
        name.as_bytes()
    );
    assert_eq!(
        blkid_uuid(&h.image(id)).as_ref(),
        Some(uuid),
        "not reformatted"
    );
    let (id, cap, staging, target, uuid, name) = &vols[1];
    node.node_publish_volume(publish_request(id, staging, target, cap.clone(), false))
        .await?;
    assert_eq!(
        std::fs::read(target.join("before-reboot"))?,
        name.as_bytes()
    );
    assert_eq!(
        blkid_uuid(&h.image(id)).as_ref(),
        Some(uuid),
        "not reformatted"
    );
    assert_eq!(mount_count(staging), 1, "the publish re-staged the volume");

    for (id, _, staging, target, _, _) in &vols {
        assert!(h.loop_of(id).is_some());
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
    }
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    Ok(())
}

#[tokio::test]
async fn unstage_and_unpublish_succeed_when_the_backend_state_is_gone() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("gone")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let cap = mount_capability("ext4");
    let id = ctrl
        .create_volume(create_request("pvc-gone", 32 * MIB, cap.clone()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let (staging, target) = (h.staging_path("pv-gone"), h.target_path("pod-gone"));
    node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
        .await?;

    // The device vanishes behind the plugin's back (lazily detached, as on a yanked disk), and
    // the volume's files are wiped.
    let dev = h.loop_of(&id).expect("attached");
    for m in [&target, &staging] {
        assert!(
            std::process::Command::new("umount")
                .arg("-l")
                .arg(m)
                .status()?
                .success()
        );
    }
    assert!(
        std::process::Command::new("losetup")
            .args(["-d", &dev])
            .status()?
            .success()
    );
    std::fs::remove_dir_all(h.state.join("volumes").join(&id))?;

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
    assert!(!target.exists());
    assert!(h.mounts().is_empty() && h.loop_devices().is_empty());
    let records: Vec<_> = std::fs::read_dir(h.state.join("node/attached"))?
        .flatten()
        .collect();
    assert!(records.is_empty(), "attach records cleaned up");
    Ok(())
}

#[tokio::test]
async fn unpublish_never_deletes_data_it_did_not_create() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("foreign")?;
    let mut node = h.node().await?;
    let target = h.target_path("pod-foreign");
    std::fs::create_dir_all(&target)?;
    std::fs::write(target.join("not-yours"), b"a plain directory holding files")?;
    node.node_unpublish_volume(NodeUnpublishVolumeRequest {
        volume_id: "vol-00000000000000000000000000000001".into(),
        target_path: target.display().to_string(),
    })
    .await?;
    assert_eq!(
        std::fs::read(target.join("not-yours"))?,
        b"a plain directory holding files"
    );
    Ok(())
}
