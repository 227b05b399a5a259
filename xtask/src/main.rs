//! Project automation, in the style of rust-analyzer's xtask: `main` only dispatches, each task
//! lives in a module of its own, and every task runs from the repository root whatever the
//! caller's working directory.

mod codegen;
mod util;

use anyhow::{Result, bail};

const USAGE: &str = "\
cargo xtask <task> [options]

tasks:
  codegen [--check]   regenerate crates/csi-proto from proto/csi.proto (--check: fail if stale)
";

fn main() -> Result<()> {
    util::enter_repo_root()?;
    let mut args = std::env::args().skip(1);
    let task = args.next().unwrap_or_default();
    let rest: Vec<String> = args.collect();
    match task.as_str() {
        "codegen" => codegen::run(util::flag(&rest, "--check")),
        "" | "help" | "--help" | "-h" => {
            print!("{USAGE}");
            Ok(())
        }
        other => bail!("unknown task `{other}`\n\n{USAGE}"),
    }
}
