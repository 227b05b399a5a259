use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

/// Every task works relative to the repository root, which is the parent of this crate.
pub fn enter_repo_root() -> Result<()> {
    let root = repo_root();
    std::env::set_current_dir(&root).with_context(|| format!("cannot enter {}", root.display()))
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the repository root")
        .to_path_buf()
}

pub fn flag(args: &[String], name: &str) -> bool {
    args.iter().any(|a| a == name)
}
