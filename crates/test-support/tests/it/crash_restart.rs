//! The node plugin is SIGKILLed at random points of NodeStage, NodePublish and NodeExpand,
//! restarted, and the call retried as kubelet would. Every volume must end staged and published
//! exactly once, data intact, no duplicate loop device, no stray mount.
//!
//! FERROVOL_CRASH_ITERATIONS (default 200) and FERROVOL_CRASH_SEED replay a schedule.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use std::path::PathBuf;
use std::time::Duration;
use test_support::v1::*;
use test_support::*;

#[derive(Clone, Copy, PartialEq, Debug)]
enum State {
    Unstaged,
    Staged,
    Published,
}

struct Vol {
    id: String,
    staging: PathBuf,
    target: PathBuf,
    state: State,
    size: i64,
    payload: Option<Vec<u8>>,
    df: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_plugin_survives_sigkill_at_any_point() -> anyhow::Result<()> {
    require_private_mount_namespace();
    let iterations: usize = std::env::var("FERROVOL_CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let seed: u64 = std::env::var("FERROVOL_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_f00d);
    println!("crash schedule: {iterations} iterations, FERROVOL_CRASH_SEED={seed}");
    let mut rng = Rng::new(seed);
    let mut h = Harness::start("crash")?;
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    // xfs, because it grows online everywhere (ext4's online growth needs CAP_SYS_RESOURCE).
    let cap = mount_capability("xfs");
    let mut vols = Vec::new();
    for i in 0..4 {
        let name = format!("pvc-crash-{i}");
        let id = ctrl
            .create_volume(create_request(&name, 300 * MIB, cap.clone()))
            .await?
            .into_inner()
            .volume
            .unwrap()
            .volume_id;
        vols.push(Vol {
            id,
            staging: h.staging_path(&name),
            target: h.target_path(&name),
            state: State::Unstaged,
            size: 300 * MIB,
            payload: None,
            df: 0,
        });
    }

    let mut kills = 0;
    for i in 0..iterations {
        let v = &mut vols[rng.below(4) as usize];
        let action = match v.state {
            State::Unstaged => "stage",
            State::Staged => "publish",
            State::Published => ["expand", "teardown", "verify"][rng.below(3) as usize],
        };
        if action == "expand" {
            v.size += 16 * MIB;
            ctrl.controller_expand_volume(ControllerExpandVolumeRequest {
                volume_id: v.id.clone(),
                capacity_range: Some(CapacityRange {
                    required_bytes: v.size,
                    limit_bytes: 0,
                }),
                ..Default::default()
            })
            .await?;
        }
        let stage = stage_request(&v.id, &v.staging, cap.clone());
        let publish = publish_request(&v.id, &v.staging, &v.target, cap.clone(), false);
        let expand = NodeExpandVolumeRequest {
            volume_id: v.id.clone(),
            volume_path: v.target.display().to_string(),
            ..Default::default()
        };
        if matches!(action, "stage" | "publish" | "expand") {
            // Fire the call, kill the plugin somewhere inside it, restart, and let the caller retry.
            let mut client = node.clone();
            let (s, p, e) = (stage.clone(), publish.clone(), expand.clone());
            let call = tokio::spawn(async move {
                match action {
                    "stage" => client.node_stage_volume(s).await.map(drop),
                    "publish" => client.node_publish_volume(p).await.map(drop),
                    _ => client.node_expand_volume(e).await.map(drop),
                }
            });
            tokio::time::sleep(Duration::from_micros(rng.below(40_000))).await;
            h.node.kill();
            kills += 1;
            let _ = call.await;
            h.node.start()?;
            node = h.node().await?;
        }
        match action {
            "stage" => {
                retry("stage", || {
                    let (mut c, r) = (node.clone(), stage.clone());
                    async move { c.node_stage_volume(r).await }
                })
                .await?;
                v.state = State::Staged;
            }
            "publish" => {
                retry("publish", || {
                    let (mut c, r) = (node.clone(), publish.clone());
                    async move { c.node_publish_volume(r).await }
                })
                .await?;
                v.state = State::Published;
            }
            "expand" => {
                let got = retry("expand", || {
                    let (mut c, r) = (node.clone(), expand.clone());
                    async move { c.node_expand_volume(r).await }
                })
                .await?;
                assert_eq!(
                    got.capacity_bytes, v.size,
                    "iteration {i}: the device has the new size"
                );
                let df = df_size(&v.target);
                assert!(
                    df >= v.df + 15 * MIB as u64,
                    "iteration {i}: the filesystem grew by the 16 MiB added ({} -> {df})",
                    v.df
                );
            }
            "teardown" => {
                node.node_unpublish_volume(NodeUnpublishVolumeRequest {
                    volume_id: v.id.clone(),
                    target_path: v.target.display().to_string(),
                })
                .await?;
                node.node_unstage_volume(NodeUnstageVolumeRequest {
                    volume_id: v.id.clone(),
                    staging_target_path: v.staging.display().to_string(),
                })
                .await?;
                v.state = State::Unstaged;
            }
            _ => {}
        }
        // The invariants, checked against the kernel after every step.
        let staged = v.state != State::Unstaged;
        let published = v.state == State::Published;
        assert_eq!(
            h.loop_of(&v.id).is_some(),
            staged,
            "iteration {i} ({action}): loop device presence"
        );
        assert_eq!(
            mount_count(&v.staging),
            usize::from(staged),
            "iteration {i} ({action}): staging mounted exactly once"
        );
        assert_eq!(
            mount_count(&v.target),
            usize::from(published),
            "iteration {i} ({action}): target mounted exactly once"
        );
        if published {
            v.df = df_size(&v.target);
            let file = v.target.join("payload");
            match &v.payload {
                Some(data) => {
                    assert_eq!(&std::fs::read(&file)?, data, "iteration {i}: data intact")
                }
                None => {
                    let data: Vec<u8> = (0..64 * 1024).map(|_| rng.next_u64() as u8).collect();
                    std::fs::write(&file, &data)?;
                    std::fs::File::open(&file)?.sync_all()?;
                    v.payload = Some(data);
                }
            }
        }
    }
    println!("{kills} kills, all converged");

    for v in &vols {
        node.node_unpublish_volume(NodeUnpublishVolumeRequest {
            volume_id: v.id.clone(),
            target_path: v.target.display().to_string(),
        })
        .await?;
        node.node_unstage_volume(NodeUnstageVolumeRequest {
            volume_id: v.id.clone(),
            staging_target_path: v.staging.display().to_string(),
        })
        .await?;
    }
    assert!(h.mounts().is_empty(), "stray mounts: {:?}", h.mounts());
    assert!(
        h.loop_devices().is_empty(),
        "stray loop devices: {:?}",
        h.loop_devices()
    );
    let intents: Vec<_> = std::fs::read_dir(h.state.join("node/format-intents"))?
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(intents.is_empty(), "format intents left: {intents:?}");
    Ok(())
}
