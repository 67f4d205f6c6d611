//! Egret's control plane: where the gateway's configuration comes from and
//! how it reaches the dataplane.
//!
//! - [`sink`]: the seam between configuration sources and the running gateway.
//! - [`k8s`]: Kubernetes mode (CRDs, desired tables, Lease ownership, sync).
#![forbid(unsafe_code)]

pub mod k8s;
pub mod sink;
