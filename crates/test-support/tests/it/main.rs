//! The process-level tests, as one test binary: each links the whole driver stack (the AWS SDK
//! included), and one link instead of nine keeps the shared release build quick.

mod aws;
mod aws_faults;
mod bad_input;
mod cancellation;
mod confinement;
mod crash_restart;
mod data_safety;
mod lifecycle;
mod reboot;
mod secrets;
