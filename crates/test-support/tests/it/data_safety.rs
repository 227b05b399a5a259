//! A device that already carries data is never formatted.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use test_support::v1::*;
use test_support::*;

#[tokio::test]
async fn a_filesystem_is_never_reformatted_as_another_type() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("safety-fs")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    for (have, want) in [("ext4", "xfs"), ("xfs", "ext4")] {
        let name = format!("pvc-{have}");
        let id = ctrl
            .create_volume(create_request(&name, 300 * MIB, mount_capability(have)))
            .await?
            .into_inner()
            .volume
            .unwrap()
            .volume_id;
        let staging = h.staging_path(&name);
        node.node_stage_volume(stage_request(&id, &staging, mount_capability(have)))
            .await?;
        std::fs::write(staging.join("precious"), b"do not lose me")?;
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await?;

        let err = node
            .node_stage_volume(stage_request(&id, &staging, mount_capability(want)))
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
        assert!(
            err.message().contains(have) && err.message().contains("refusing to format"),
            "{}",
            err.message()
        );
        assert!(h.mounts().is_empty(), "a refused stage mounts nothing");
        let image = h.state.join("volumes").join(&id).join("disk.img");
        assert_eq!(
            blkid_type(&image).as_deref(),
            Some(have),
            "the filesystem is untouched"
        );

        node.node_stage_volume(stage_request(&id, &staging, mount_capability(have)))
            .await?;
        assert_eq!(std::fs::read(staging.join("precious"))?, b"do not lose me");
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: id.clone(),
            staging_target_path: staging.display().to_string(),
        })
        .await?;
    }
    assert!(h.loop_devices().is_empty());
    Ok(())
}

#[tokio::test]
async fn raw_data_and_partition_tables_are_never_formatted() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let h = Harness::start("safety-raw")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let id = ctrl
        .create_volume(create_request("pvc-raw", 32 * MIB, block_capability()))
        .await?
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
    let image = h.state.join("volumes").join(&id).join("disk.img");

    // A block-mode workload wrote bytes with no signature at all.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&image)?;
        f.write_all_at(b"database pages, no filesystem signature", 512)?;
    }
    let staging = h.staging_path("pv-raw");
    let err = node
        .node_stage_volume(stage_request(&id, &staging, mount_capability("ext4")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("refusing to format"),
        "{}",
        err.message()
    );

    // A partition table.
    let st = std::process::Command::new("sfdisk")
        .arg("-q")
        .arg(&image)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b"label: gpt\n,,L\n")?;
            c.wait()
        })?;
    assert!(st.success(), "sfdisk (util-linux fdisk) wrote a GPT");
    let err = node
        .node_stage_volume(stage_request(&id, &staging, mount_capability("xfs")))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("gpt"), "{}", err.message());
    let out = std::process::Command::new("sfdisk")
        .arg("--dump")
        .arg(&image)
        .output()?;
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("label: gpt"),
        "the partition table is intact"
    );
    node.node_unstage_volume(NodeUnstageVolumeRequest {
        volume_id: id.clone(),
        staging_target_path: staging.display().to_string(),
    })
    .await?;
    assert!(h.mounts().is_empty());
    assert!(h.loop_devices().is_empty());
    Ok(())
}
