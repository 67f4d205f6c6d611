//! The seam between where configuration comes from (the YAML file, the
//! Kubernetes control plane) and the running gateway that applies it.
//!
//! Sources compute the *whole* desired state each time (level-triggered, as
//! controller-rs and statedb reconcilers do) and hand it to a [`TablesSink`].
//! The daemon implements the sink: it publishes the engine's tables and
//! updates the XDP program's maps before `apply` returns, so a source that
//! removes an egress IP (a lost Lease) knows the gateway has stopped
//! translating and answering for it when the call returns. That ordering is
//! what fencing relies on.

use std::net::IpAddr;

use egret_dataplane::tables::TablesSpec;

/// Why a desired state could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The spec was rejected (global settings invalid); nothing changed.
    #[error("configuration rejected: {0}")]
    Rejected(String),
    /// The engine took it but the XDP maps could not be updated.
    #[error("XDP maps not updated: {0}")]
    Maps(String),
}

/// Something that makes a desired state real.
pub trait TablesSink: Send + Sync + 'static {
    /// Makes `spec` the gateway's configuration (engine tables and BPF
    /// maps) before returning. Invalid policies inside `spec` are reported by
    /// the engine and skipped; the others apply.
    fn apply(&self, spec: &TablesSpec) -> Result<(), ApplyError>;

    /// Announces addresses this gateway has just taken: gratuitous ARP for
    /// IPv4, unsolicited neighbour advertisements for IPv6, on the
    /// interfaces the addresses are reachable on.
    fn announce(&self, ips: &[IpAddr]);
}
