//! Egret's control plane: where the gateway's configuration comes from and
//! how it reaches the dataplane.
//!
//! - [`config`]: the YAML file (`docs/config.md`), validated with errors that
//!   name the file, the field and the value.
//! - [`netlink`]: interfaces, routes and neighbours from the kernel.
//! - [`view`]: what the outside sees of a running gateway; [`admin`] (the
//!   CLI's unix socket) and [`metrics`] (Prometheus, `/ready`) render it.
//! - [`daemon`]: `egret gateway`: workers, XDP attach, reloads, signals.
//! - [`offload`]: the XDP fast path's userspace half: installing confirmed
//!   sessions into the kernel, next hops, expiry stamps, fencing.
//! - [`sink`]: the seam between configuration sources and the running gateway.
//! - [`translog`]: translation logs: the workers' rings drained and sent as
//!   IPFIX (RFC 8158) and syslog (RFC 5424, VPP's format) (ADR 0034).
//! - [`failclosed`]: nftables rules so a stopped gateway never forwards pods' traffic untranslated.
//! - [`nft_counters`]: drop counters that keep their values when Egret replaces its nftables tables.
//! - [`k8s`]: Kubernetes mode (CRDs, desired tables, Lease ownership, sync).
//! - [`ha`]: between gateways: the peer channel (`ha::channel`) and its keys
//!   (`ha::auth`); its `setsockopt(TCP_MD5SIG)` is the crate's only unsafe code.
//! - [`cloud`]: cloud egress IPs (AWS Elastic IPs) that move with their Lease.
//! - [`node`]: `egret node`, the worker-node agent that routes selected pods to their gateway.
#![deny(unsafe_code)]

pub mod admin;
pub mod cloud;
pub mod config;
pub mod daemon;
pub mod failclosed;
pub mod ha;
pub mod k8s;
pub mod metrics;
pub mod netlink;
pub mod nft_counters;
pub mod nft_watch;
pub mod node;
pub mod offload;
pub mod port_use;
pub mod sink;
pub mod translog;
pub mod view;

#[cfg(test)]
mod test_support;
