//! `cargo xtask bench`:
//! - local backend: latency of each RPC over many full volume lifecycles (real loop devices,
//!   real mkfs, real mounts), whole-lifecycle time, a shell baseline, and the idle and peak
//!   resident memory of both plugin binaries;
//! - aws backend, against the moto emulator behind the counting proxy: EC2 calls per volume
//!   lifecycle (create, attach, detach, delete), sequential and with many lifecycles at once,
//!   latency per RPC, and the controller's memory under that load.
//!
//! Usage: ferrovol-bench [--backend local|aws|all] [--lifecycles N] [--size-mib M]
//!        [--fs ext4|xfs] [--aws-lifecycles N] [--aws-concurrency N]

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use anyhow::{Context, Result, bail};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use test_support::v1::*;
use test_support::*;

struct Samples(BTreeMap<&'static str, Vec<Duration>>);

impl Samples {
    fn add(&mut self, name: &'static str, d: Duration) {
        self.0.entry(name).or_default().push(d);
    }
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[idx].as_secs_f64() * 1e3
}

fn rss_kib(pid: u32, field: &str) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix(field)
                .map(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>())
        })
        .context("no such field")?
        .context("parse")
}

macro_rules! timed {
    ($s:expr, $name:expr, $e:expr) => {{
        let t = Instant::now();
        let r = $e;
        $s.add($name, t.elapsed());
        r
    }};
}

/// What NodeStage and NodePublish do, as bare commands: the floor the driver is measured
/// against.
fn shell_baseline(root: &std::path::Path, size: i64, fs: &str, n: usize) -> Result<Samples> {
    use std::process::Command;
    let run = |cmd: &mut Command| -> Result<String> {
        let out = cmd.output()?;
        if !out.status.success() {
            bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let mut s = Samples(BTreeMap::new());
    let dir = root.join("baseline");
    std::fs::create_dir_all(dir.join("stage"))?;
    std::fs::create_dir_all(dir.join("target"))?;
    for _ in 0..n {
        let img = dir.join("disk.img");
        std::fs::File::create(&img)?.set_len(size as u64)?;
        let t = Instant::now();
        let dev = run(Command::new("losetup").args(["-f", "--show"]).arg(&img))?;
        if fs == "xfs" {
            run(Command::new("mkfs.xfs").args(["-q", "-K", &dev]))?;
        } else {
            run(Command::new("mkfs.ext4").args([
                "-q",
                "-E",
                "nodiscard,lazy_itable_init=1,lazy_journal_init=1",
                &dev,
            ]))?;
        }
        run(Command::new("mount").arg(&dev).arg(dir.join("stage")))?;
        s.add("shell: losetup+mkfs+mount", t.elapsed());
        let t = Instant::now();
        run(Command::new("mount")
            .arg("--bind")
            .arg(dir.join("stage"))
            .arg(dir.join("target")))?;
        s.add("shell: mount --bind", t.elapsed());
        run(Command::new("umount").arg(dir.join("target")))?;
        run(Command::new("umount").arg(dir.join("stage")))?;
        run(Command::new("losetup").args(["-d", &dev]))?;
        std::fs::remove_file(&img)?;
    }
    Ok(s)
}

fn print_table(s: &mut Samples) {
    println!("{:<32} {:>10} {:>10} {:>8}", "RPC", "p50 ms", "p99 ms", "n");
    for (name, v) in s.0.iter_mut() {
        let len = v.len();
        println!(
            "{:<32} {:>10.2} {:>10.2} {:>8}",
            name,
            pct(v, 0.5),
            pct(v, 0.99),
            len
        );
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    require_private_mount_namespace();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |flag: &str, default: &str| -> String {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| default.to_string())
    };
    let backend = get("--backend", "all");
    if !["local", "aws", "all"].contains(&backend.as_str()) {
        bail!("--backend must be local, aws or all");
    }
    if backend != "aws" {
        local(&get).await?;
    }
    if backend != "local" {
        let sequential: usize = get("--aws-lifecycles", "20").parse()?;
        let concurrency: usize = get("--aws-concurrency", "100").parse()?;
        if sequential == 0 || concurrency == 0 {
            bail!("--aws-lifecycles and --aws-concurrency must be at least 1");
        }
        aws_bench(sequential, concurrency).await?;
    }
    Ok(())
}

async fn local(get: &dyn Fn(&str, &str) -> String) -> Result<()> {
    let n: usize = get("--lifecycles", "50").parse()?;
    let size: i64 = get("--size-mib", "1024").parse::<i64>()? * MIB;
    let fs = get("--fs", "ext4");
    if n == 0 {
        bail!("--lifecycles must be at least 1");
    }

    let h = Harness::start_with(
        "bench",
        Options {
            log_level: "warn".into(),
            ..Default::default()
        },
    )?;
    let (cpid, npid) = (h.controller.pid().unwrap(), h.node.pid().unwrap());
    let mut ctrl = h.controller().await?;
    let mut node = h.node().await?;
    let mut ident = h.identity(true).await?;
    // Idle: after start-up and one trivial call on each, before any volume work.
    ident.probe(ProbeRequest {}).await?;
    ctrl.controller_get_capabilities(ControllerGetCapabilitiesRequest {})
        .await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = (rss_kib(cpid, "VmRSS:")?, rss_kib(npid, "VmRSS:")?);

    let cap = mount_capability(&fs);
    let mut s = Samples(BTreeMap::new());
    let total = Instant::now();
    for i in 0..n {
        let t0 = Instant::now();
        let name = format!("bench-{i}");
        let id = timed!(
            s,
            "CreateVolume",
            ctrl.create_volume(create_request(&name, size, cap.clone()))
                .await?
        )
        .into_inner()
        .volume
        .unwrap()
        .volume_id;
        let staging = h.staging_path(&name);
        let target = h.target_path(&name);
        timed!(
            s,
            "NodeStageVolume (blank, mkfs)",
            node.node_stage_volume(stage_request(&id, &staging, cap.clone()))
                .await?
        );
        timed!(
            s,
            "NodePublishVolume",
            node.node_publish_volume(publish_request(&id, &staging, &target, cap.clone(), false))
                .await?
        );
        timed!(
            s,
            "NodeGetVolumeStats",
            node.node_get_volume_stats(NodeGetVolumeStatsRequest {
                volume_id: id.clone(),
                volume_path: target.display().to_string(),
                ..Default::default()
            })
            .await?
        );
        timed!(
            s,
            "CreateSnapshot (published)",
            ctrl.create_snapshot(CreateSnapshotRequest {
                source_volume_id: id.clone(),
                name: format!("snap-{name}"),
                ..Default::default()
            })
            .await?
        );
        let snap_id = ctrl
            .list_snapshots(ListSnapshotsRequest {
                source_volume_id: id.clone(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .entries[0]
            .snapshot
            .clone()
            .unwrap()
            .snapshot_id;
        timed!(
            s,
            "DeleteSnapshot",
            ctrl.delete_snapshot(DeleteSnapshotRequest {
                snapshot_id: snap_id,
                ..Default::default()
            })
            .await?
        );
        timed!(
            s,
            "NodeUnpublishVolume",
            node.node_unpublish_volume(NodeUnpublishVolumeRequest {
                volume_id: id.clone(),
                target_path: target.display().to_string()
            })
            .await?
        );
        timed!(
            s,
            "NodeUnstageVolume",
            node.node_unstage_volume(NodeUnstageVolumeRequest {
                volume_id: id.clone(),
                staging_target_path: staging.display().to_string()
            })
            .await?
        );
        timed!(
            s,
            "DeleteVolume",
            ctrl.delete_volume(DeleteVolumeRequest {
                volume_id: id,
                ..Default::default()
            })
            .await?
        );
        s.add("whole lifecycle", t0.elapsed());
    }
    let wall = total.elapsed();
    let baseline = shell_baseline(&h.root, size, &fs, n.min(20))?;
    let peak = (rss_kib(cpid, "VmHWM:")?, rss_kib(npid, "VmHWM:")?);
    if !h.loop_devices().is_empty() || !h.mounts().is_empty() {
        bail!("the benchmark left loop devices or mounts behind");
    }

    println!(
        "ferrovol bench — local backend, {n} lifecycles of a {} MiB {fs} volume ({:.1} s)\n",
        size / MIB,
        wall.as_secs_f64()
    );
    print_table(&mut s);
    println!();
    println!(
        "baseline: the same steps as bare commands (no probe, intent, lock, confinement, records)"
    );
    let mut base = baseline;
    for (name, v) in base.0.iter_mut() {
        let len = v.len();
        println!(
            "{:<32} {:>10.2} {:>10.2} {:>8}",
            name,
            pct(v, 0.5),
            pct(v, 0.99),
            len
        );
    }
    let stage = pct(s.0.get_mut("NodeStageVolume (blank, mkfs)").unwrap(), 0.5);
    let publish = pct(s.0.get_mut("NodePublishVolume").unwrap(), 0.5);
    let raw_stage = pct(base.0.get_mut("shell: losetup+mkfs+mount").unwrap(), 0.5);
    let raw_bind = pct(base.0.get_mut("shell: mount --bind").unwrap(), 0.5);
    println!(
        "driver overhead at p50: NodeStage {:+.2} ms over the shell, NodePublish {:+.2} ms",
        stage - raw_stage,
        publish - raw_bind
    );
    println!();
    println!("{:<32} {:>10} {:>10}", "memory", "idle MiB", "peak MiB");
    println!(
        "{:<32} {:>10.1} {:>10.1}",
        "csi-controller",
        idle.0 as f64 / 1024.0,
        peak.0 as f64 / 1024.0
    );
    println!(
        "{:<32} {:>10.1} {:>10.1}",
        "csi-node",
        idle.1 as f64 / 1024.0,
        peak.1 as f64 / 1024.0
    );
    Ok(())
}

/// One controller-side lifecycle on the aws backend: CreateVolume, ControllerPublish,
/// ControllerUnpublish, DeleteVolume, each timed.
async fn aws_lifecycle(
    mut ctrl: test_support::v1::controller_client::ControllerClient<tonic::transport::Channel>,
    name: String,
    instance: String,
) -> Result<Vec<(&'static str, Duration)>> {
    let cap = mount_capability("ext4");
    let mut times = vec![];
    let t0 = Instant::now();
    let mut req = create_request(&name, 1 << 30, cap.clone());
    req.accessibility_requirements = Some(TopologyRequirement {
        requisite: vec![Topology {
            segments: [(
                "topology.kubernetes.io/zone".to_string(),
                aws::ZONE.to_string(),
            )]
            .into(),
        }],
        preferred: vec![],
    });
    let t = Instant::now();
    let id = ctrl
        .create_volume(req)
        .await?
        .into_inner()
        .volume
        .context("no volume")?
        .volume_id;
    times.push(("CreateVolume", t.elapsed()));
    let t = Instant::now();
    ctrl.controller_publish_volume(ControllerPublishVolumeRequest {
        volume_id: id.clone(),
        node_id: instance.clone(),
        volume_capability: Some(cap),
        ..Default::default()
    })
    .await?;
    times.push(("ControllerPublishVolume", t.elapsed()));
    let t = Instant::now();
    ctrl.controller_unpublish_volume(ControllerUnpublishVolumeRequest {
        volume_id: id.clone(),
        node_id: instance,
        ..Default::default()
    })
    .await?;
    times.push(("ControllerUnpublishVolume", t.elapsed()));
    let t = Instant::now();
    ctrl.delete_volume(DeleteVolumeRequest {
        volume_id: id,
        ..Default::default()
    })
    .await?;
    times.push(("DeleteVolume", t.elapsed()));
    times.push(("whole lifecycle", t0.elapsed()));
    Ok(times)
}

/// The controller's background cloud check (every second in the harness), not a lifecycle's.
const HEALTH_CHECK_ACTION: &str = "DescribeAvailabilityZones";

fn print_calls(proxy: &faultproxy::FaultProxy, lifecycles: usize) {
    let mut calls = proxy.calls();
    let health = calls.remove(HEALTH_CHECK_ACTION).unwrap_or(0);
    let total: u64 = calls.values().sum();
    println!(
        "EC2 calls: {total} for {lifecycles} lifecycles = {:.2} per lifecycle",
        total as f64 / lifecycles as f64
    );
    for (action, n) in &calls {
        println!(
            "  {action:<28} {n:>6}  ({:.2} per lifecycle)",
            *n as f64 / lifecycles as f64
        );
    }
    println!("  (not counted: {health} {HEALTH_CHECK_ACTION} of the background health check)");
}

async fn aws_bench(sequential: usize, concurrency: usize) -> Result<()> {
    let root = std::env::var_os("FERROVOL_TEST_ROOT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("bench-aws-{}", std::process::id()));
    std::fs::create_dir_all(root.join("by-id"))?;
    std::fs::create_dir_all(root.join("sys"))?;
    let moto = aws::Moto::start(&root.join("moto.log"))?;
    let proxy = faultproxy::FaultProxy::start(&moto.endpoint)?;
    let instance = aws::run_instance(&moto.client(), aws::ZONE).await?;
    let h = Harness::start_with(
        "bench-aws",
        Options {
            log_level: "warn".into(),
            aws: Some(AwsTarget {
                endpoint: proxy.endpoint.clone(),
                instance_id: instance.clone(),
                by_id: root.join("by-id"),
                sys: root.join("sys"),
            }),
            ..Default::default()
        },
    )?;
    let cpid = h.controller.pid().context("controller not running")?;
    let ctrl = h.controller().await?;
    // The controller's start-up calls (the cloud health check) are not a lifecycle's.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = rss_kib(cpid, "VmRSS:")?;

    println!();
    println!(
        "ferrovol bench — aws backend against moto (through the counting proxy), controller RPCs"
    );
    proxy.reset_calls();
    let mut s = Samples(BTreeMap::new());
    let wall = Instant::now();
    for i in 0..sequential {
        for (name, d) in aws_lifecycle(ctrl.clone(), format!("seq-{i}"), instance.clone()).await? {
            s.add(name, d);
        }
    }
    println!(
        "\nsequential: {sequential} lifecycles in {:.1} s",
        wall.elapsed().as_secs_f64()
    );
    print_calls(&proxy, sequential);
    print_table(&mut s);

    proxy.reset_calls();
    let mut s = Samples(BTreeMap::new());
    let peak_rss = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let sampler = tokio::spawn({
        let peak_rss = peak_rss.clone();
        async move {
            loop {
                if let Ok(kib) = rss_kib(cpid, "VmRSS:") {
                    peak_rss.fetch_max(kib, std::sync::atomic::Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let wall = Instant::now();
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            tokio::spawn(aws_lifecycle(
                ctrl.clone(),
                format!("conc-{i}"),
                instance.clone(),
            ))
        })
        .collect();
    for t in tasks {
        for (name, d) in t.await?? {
            s.add(name, d);
        }
    }
    let elapsed = wall.elapsed();
    sampler.abort();
    println!(
        "\nconcurrent: {concurrency} lifecycles at once, done in {:.1} s",
        elapsed.as_secs_f64()
    );
    print_calls(&proxy, concurrency);
    print_table(&mut s);
    let left = aws::volumes_tagged(&moto.client(), "ferrovol.dev/cluster", "ferrovol")
        .await?
        .len();
    if left != 0 {
        bail!("the aws benchmark left {left} volumes in the emulator");
    }
    println!();
    println!(
        "{:<32} {:>10} {:>10} {:>10}",
        "memory", "idle MiB", "load MiB", "peak MiB"
    );
    println!(
        "{:<32} {:>10.1} {:>10.1} {:>10.1}",
        "csi-controller (aws)",
        idle as f64 / 1024.0,
        peak_rss.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1024.0,
        rss_kib(cpid, "VmHWM:")? as f64 / 1024.0
    );
    drop(h);
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}
