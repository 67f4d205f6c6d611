//! Egret's control plane: where the gateway's configuration comes from and
//! how it reaches the dataplane.
//!
//! - [`config`]: the YAML file (`docs/config.md`), validated with errors that
//!   name the file, the field and the value.
//! - [`sink`]: the seam between configuration sources and the running gateway.
#![forbid(unsafe_code)]

pub mod config;
pub mod netlink;
pub mod sink;
