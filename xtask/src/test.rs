//! `cargo xtask test`: everything CI checks, in order, on a fresh Debian 12 machine: the tools,
//! generated code, formatting, clippy, the workspace's tests (in a private mount namespace, as
//! they mount file systems), the Helm chart's rendered manifests and linters (render --check,
//! lint), csi-sanity, and the container images (release build, assembled twice for
//! reproducibility, run under podman). Stops at the first failing step and names it.

use crate::{codegen, images, lint, render, sanity, tools, util};
use anyhow::{Context, Result};
use std::time::Duration;

const FMT_TIMEOUT: Duration = Duration::from_secs(5 * 60);
const CLIPPY_TIMEOUT: Duration = Duration::from_secs(30 * 60);
const TEST_TIMEOUT: Duration = Duration::from_secs(40 * 60);

pub fn run() -> Result<()> {
    step("tools", || {
        tools::debian_packages()?;
        tools::csi_sanity().map(drop)
    })?;
    step("codegen --check", || codegen::run(true))?;
    // The chart and the workflows: deploy/kubernetes matches the chart, then helm lint,
    // kube-linter and actionlint. The wiring of the rendered objects is checked by the
    // deploy-check crate's tests, which `cargo test` runs.
    step("render --check", || render::run(true))?;
    step("lint", lint::run)?;
    step("fmt", fmt)?;
    step("clippy", || {
        util::run(
            util::cargo().args([
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ]),
            CLIPPY_TIMEOUT,
        )
    })?;
    step("build", || {
        util::run(
            util::cargo().args(["build", "--profile", util::PROFILE, "--workspace", "--bins"]),
            util::BUILD_TIMEOUT,
        )
    })?;
    step("cargo test", || {
        let target = util::target_dir();
        let mut cmd = util::unshare(util::cargo().get_program());
        cmd.args(["test", "--profile", util::PROFILE, "--workspace"]);
        util::run_with_test_root(
            &mut cmd,
            &target.join(util::PROFILE),
            &target.join("test-root"),
            TEST_TIMEOUT,
        )
    })?;
    step("sanity", || sanity::run(false))?;
    step("images", images::test)?;
    println!("xtask test: all checks passed");
    Ok(())
}

fn step(name: &str, f: impl FnOnce() -> Result<()>) -> Result<()> {
    println!("\n==> xtask test: {name}");
    f().with_context(|| format!("xtask test: step `{name}` failed"))
}

fn fmt() -> Result<()> {
    let rustfmt_available = util::cargo()
        .args(["fmt", "--version"])
        .output()
        .is_ok_and(|out| out.status.success());
    if !rustfmt_available {
        println!(
            "note: `cargo fmt` is not available (rustup component add rustfmt); skipping the format check"
        );
        return Ok(());
    }
    util::run(util::cargo().args(["fmt", "--all", "--check"]), FMT_TIMEOUT)
}
