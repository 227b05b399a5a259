//! ferrovol's CSI Node service: stage (attach, probe, format when blank, mount), publish (bind
//! mount, or a device bind for raw block), expand, stats and node info.
//!
//! The node plugin keeps no state in memory: every call rebuilds what it needs from the kernel
//! (`/proc/self/mountinfo`, the loop devices) and from the small records it writes atomically,
//! so a restart, a crash or a reboot between any two steps is repaired by the next call.

pub mod format;
pub mod kube;
pub mod mounter;
pub mod paths;
pub mod probe;
mod service;

pub use service::{NodeConfig, NodeService};
