//! Egret's control plane: where the gateway's configuration comes from and
//! how it reaches the dataplane.
//!
//! - [`sink`]: the seam between configuration sources and the running gateway.
#![forbid(unsafe_code)]

pub mod sink;
