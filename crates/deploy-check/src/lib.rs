//! No library code: `tests/wiring.rs` parses every object that `cargo xtask render` wrote into
//! `deploy/kubernetes/<backend>/` into k8s-openapi's typed structs and checks how the pieces fit
//! together (sockets, mounts, registration path, probes, RBAC, the CSIDriver object). See that
//! file for the list.
