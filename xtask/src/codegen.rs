//! `cargo xtask codegen [--check]`: compiles proto/csi.proto with protox (pure Rust, no protoc)
//! and generates the prost messages and tonic services into crates/csi-proto/src/generated/.
//! The output is committed so that building the driver never needs a protobuf compiler;
//! `--check` regenerates into a scratch directory and fails if the committed code differs.

use anyhow::{Context, Result, bail, ensure};
use sha2::{Digest, Sha256};
use std::path::Path;

/// The spec file is copied verbatim from github.com/container-storage-interface/spec@v1.12.0.
/// Pinning its hash here makes an accidental edit of the proto fail codegen loudly.
const CSI_PROTO_SHA256: &str = "5b81236a3809f3ff0b877ff9b82215d0b74a8e291d7f3ec6ee1a44f537c0f86a";
const PROTO: &str = "proto/csi.proto";
const OUT_DIR: &str = "crates/csi-proto/src/generated";

pub fn run(check: bool) -> Result<()> {
    let proto = std::fs::read(PROTO).with_context(|| format!("reading {PROTO}"))?;
    let digest = hex::encode(Sha256::digest(&proto));
    ensure!(
        digest == CSI_PROTO_SHA256,
        "{PROTO} has sha256 {digest}, expected {CSI_PROTO_SHA256}: the spec file must stay a verbatim copy of CSI v1.12.0"
    );

    let scratch = std::env::temp_dir().join(format!("ferrovol-codegen-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let result = generate(&scratch).and_then(|()| {
        if check {
            compare(&scratch, Path::new(OUT_DIR))
        } else {
            install(&scratch, Path::new(OUT_DIR))
        }
    });
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn generate(out: &Path) -> Result<()> {
    let fds =
        protox::compile([PROTO], ["proto"]).context("compiling proto/csi.proto with protox")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .out_dir(out)
        .compile_fds(fds)
        .context("generating Rust code with tonic-prost-build")?;
    Ok(())
}

fn generated_files(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = Vec::new();
    if dir.exists() {
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            files.push((name, std::fs::read(entry.path())?));
        }
    }
    files.sort();
    Ok(files)
}

fn compare(fresh: &Path, committed: &Path) -> Result<()> {
    if generated_files(fresh)? != generated_files(committed)? {
        bail!("{OUT_DIR} is stale: run `cargo xtask codegen` and commit the result");
    }
    println!("codegen: {OUT_DIR} is up to date");
    Ok(())
}

fn install(fresh: &Path, committed: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(committed);
    std::fs::create_dir_all(committed)?;
    for (name, bytes) in generated_files(fresh)? {
        std::fs::write(committed.join(&name), bytes)?;
        println!("codegen: wrote {OUT_DIR}/{name}");
    }
    Ok(())
}
