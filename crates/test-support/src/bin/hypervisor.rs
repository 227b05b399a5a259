//! `ferrovol-hypervisor --endpoint URL --root DIR [--zone Z]`: starts an instance in the EC2
//! emulator at URL and plays its hypervisor (see `test_support::aws::Hypervisor`) until
//! SIGTERM. Prints `instance=<id>` and `by-id=<dir>` `sys=<dir>` once ready. Used by
//! `cargo xtask sanity` for the aws backend.

#![allow(clippy::unwrap_used)] // test and tool code: a panic with a line number is the report

use anyhow::{Context, Result};
use test_support::aws;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let endpoint = get("--endpoint").context("--endpoint URL is required")?;
    let root = std::path::PathBuf::from(get("--root").context("--root DIR is required")?);
    let zone = get("--zone").unwrap_or_else(|| aws::ZONE.to_string());
    let ec2 = aws::client(&endpoint);
    let instance = aws::run_instance(&ec2, &zone).await?;
    let hv = aws::Hypervisor::start(ec2, instance.clone(), &root)?;
    println!(
        "instance={instance}\nby-id={}\nsys={}",
        hv.by_id.display(),
        hv.sys.display()
    );
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    drop(hv);
    Ok(())
}
