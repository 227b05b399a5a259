//! The CSI v1.12.0 protocol as Rust types and tonic services.
//!
//! Everything under `generated/` is produced by `cargo xtask codegen` from `proto/csi.proto`
//! and committed; this is the only crate in the workspace that holds generated code.

#[allow(clippy::all, clippy::pedantic, missing_docs, unreachable_pub)]
pub mod v1 {
    include!("generated/csi.v1.rs");
}
