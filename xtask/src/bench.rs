//! `cargo xtask bench [-- args]`: builds the driver in release mode and runs test-support's
//! `ferrovol-bench` against it, in a private mount namespace, passing the extra arguments on.
//! Scratch files go to target/bench-root/.

use crate::{tools, util};
use anyhow::{Context, Result};
use std::time::Duration;

const BENCH_TIMEOUT: Duration = Duration::from_secs(30 * 60);

pub fn run(args: &[String]) -> Result<()> {
    let args = match args.first() {
        Some(first) if first == "--" => &args[1..],
        _ => args,
    };
    tools::debian_packages()?;
    util::run(
        util::cargo().args(["build", "--profile", util::PROFILE, "--workspace", "--bins"]),
        util::BUILD_TIMEOUT,
    )
    .context("building the driver binaries (release)")?;
    let target = util::target_dir();
    let mut cmd = util::unshare(util::cargo().get_program());
    cmd.args([
        "run",
        "--quiet",
        "--profile",
        util::PROFILE,
        "-p",
        "test-support",
        "--bin",
        "ferrovol-bench",
        "--",
    ])
    .args(args);
    util::run_with_test_root(
        &mut cmd,
        &target.join(util::PROFILE),
        &target.join("bench-root"),
        BENCH_TIMEOUT,
    )
    .context("ferrovol-bench failed")
}
