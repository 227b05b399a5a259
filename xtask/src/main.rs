//! Project automation, in the style of rust-analyzer's xtask: `main` only dispatches, each task
//! lives in a module of its own, and every task runs from the repository root whatever the
//! caller's working directory.

mod bench;
mod cluster;
mod codegen;
mod demo;
mod e2e;
mod images;
mod lint;
mod render;
mod sanity;
mod test;
mod tools;
mod util;

use anyhow::{Result, bail};

const USAGE: &str = "\
cargo xtask <task> [options]

tasks:
  codegen [--check]   regenerate crates/csi-proto from proto/csi.proto (--check: fail if stale)
  test                everything CI checks: tools, codegen --check, fmt, clippy, cargo test, sanity,
                      images --test
  sanity [--keep]     run csi-sanity against the local backend, for mount and block volumes
                      (--keep: keep the logs and reports in target/sanity/<pid>/ after a success)
  demo                run test-support's ferrovol-demo against the driver binaries
  bench [-- args]     run test-support's ferrovol-bench against release builds of the driver:
                      local lifecycles, then aws against moto (EC2 calls per lifecycle, 100 at
                      once); `-- --backend local|aws` picks one (other flags: the top of
                      crates/test-support/src/bin/bench.rs)
  images [--test]     build the ferrovol-controller and ferrovol-node images into target/images/
                      without a container engine, checked reproducible (--test: run them under
                      podman and containerd; --update-lock: pin Debian's current packages in
                      xtask/images.lock)
  render [--check]    helm template charts/ferrovol into deploy/kubernetes/<backend>/ (--check:
                      fail if the committed manifests are stale)
  lint                helm lint --strict, kube-linter on deploy/kubernetes, actionlint on the
                      workflows
  helm <args>         run the pinned helm (the release workflow packages and pushes the chart)
  cluster up|down|status
                      a one-node Kubernetes cluster on this machine for the e2e tests (root;
                      kubeconfig target/cluster/kubeconfig, logs target/cluster/logs/)
  e2e [--keep] [--backend local|aws|all] [-- FILTER…]
                      cluster up, the driver's images and chart installed, the kube-rs tests of
                      e2e/ for each backend (aws against moto), cluster down (--keep: leave it up)

Tasks that run the driver do so in a private mount namespace (unshare), which needs root.
Pinned tools such as csi-sanity are cached in $FERROVOL_CACHE (default ~/.cache/ferrovol).
";

fn main() -> Result<()> {
    util::enter_repo_root()?;
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "codegen" => codegen::run(util::flag(&rest, "--check")),
        "test" => test::run(),
        "sanity" => sanity::run(util::flag(&rest, "--keep")),
        // Hidden: `sanity` re-executes itself as this inside a private mount namespace.
        "sanity-inner" => sanity::run_inner(&rest),
        "demo" => demo::run(),
        "bench" => bench::run(&rest),
        "images" => images::run(&rest),
        "render" => render::run(util::flag(&rest, "--check")),
        "lint" => lint::run(),
        "helm" => render::helm_passthrough(&rest),
        "cluster" => cluster::run(&rest),
        "e2e" => e2e::run(&rest),
        "" | "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n\n{USAGE}"),
    }
}
