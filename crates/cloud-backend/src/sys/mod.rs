//! Host primitives shared by the backends and the node plugin: file locks, atomic files,
//! `/proc/self/mountinfo`, loop devices, filesystem freeze and sparse-aware copies.
//! Thin, synchronous wrappers over system calls; callers run them on blocking threads.

pub mod atomic;
pub mod copy;
pub mod ioctl;
pub mod lock;
pub mod loopdev;
pub mod mountinfo;
