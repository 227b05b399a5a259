//! `cargo xtask demo`: builds the driver and runs test-support's `ferrovol-demo`, which walks a
//! volume through its whole life against the real binaries, in a private mount namespace.
//! Scratch files go to target/demo-root/.

use crate::{tools, util};
use anyhow::{Context, Result};
use std::time::Duration;

const DEMO_TIMEOUT: Duration = Duration::from_secs(10 * 60);

pub fn run() -> Result<()> {
    tools::debian_packages()?;
    util::run(
        util::cargo().args(["build", "--profile", util::PROFILE, "--workspace", "--bins"]),
        util::BUILD_TIMEOUT,
    )
    .context("building the driver binaries")?;
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
        "ferrovol-demo",
    ]);
    util::run_with_test_root(
        &mut cmd,
        &target.join(util::PROFILE),
        &target.join("demo-root"),
        DEMO_TIMEOUT,
    )
    .context("ferrovol-demo failed")
}
