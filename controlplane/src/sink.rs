//! The seam between where configuration comes from (the YAML file, the
//! Kubernetes control plane) and the running gateway that applies it.
//!
//! Sources compute the *whole* desired state each time (level-triggered, as
//! controller-rs and statedb reconcilers do) and hand it to a [`TablesSink`].
//! The daemon implements the sink: it installs the fail-closed table,
//! updates the XDP program's maps and publishes the engine's tables before
//! `apply` returns, all of them or none (daemon/sink.rs), so a source that
//! removes an egress IP (a lost Lease) knows the gateway has stopped
//! translating and answering for it when the call returns. That ordering is
//! what fencing relies on; a refused apply still gives up the addresses the
//! new state no longer holds.

use std::net::IpAddr;

use egret_dataplane::tables::TablesSpec;

use crate::daemon::sink::CapacityError;
use crate::failclosed::FailClosedError;

/// Why a desired state could not be applied. Each says what the gateway
/// runs instead (daemon/sink.rs: an apply is whole or refused; a refused
/// one still gives up the addresses the new state no longer holds).
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    /// The spec was rejected (global settings invalid); nothing changed.
    #[error("configuration rejected: {0}; nothing changed")]
    Rejected(String),
    /// The new state does not fit the XDP maps.
    #[error(
        "configuration too large for the XDP maps: {reason}; the previous configuration stays ({kept}); {}",
        match fail_closed {
            Ok(()) => "the fail-closed table drops what the new configuration selects".to_string(),
            Err(e) => format!("the fail-closed table could not be updated either: {e}"),
        }
    )]
    TooLarge {
        /// Which map, how many entries, its capacity.
        reason: CapacityError,
        /// Whether the kernel's table now covers the new state.
        fail_closed: Result<(), FailClosedError>,
        /// What was given up of the previous state.
        kept: String,
    },
    /// The fail-closed table for the new state could not be installed.
    #[error("fail-closed rules not installed: {error}; the previous configuration stays ({kept})")]
    FailClosed {
        /// nft's error.
        error: FailClosedError,
        /// What was given up of the previous state.
        kept: String,
    },
    /// A map write failed in the kernel (the capacity had been checked);
    /// the maps were put back as the engine's tables have them.
    #[error(
        "XDP maps not updated: {error}; {}",
        match restored {
            Ok(()) => "maps restored, the previous configuration stays (the fail-closed table already covers the new one)".to_string(),
            Err(e) => format!("restoring the previous maps failed too ({e}): the maps are partly updated, the fail-closed table covers the new configuration"),
        }
    )]
    Maps {
        /// The first error.
        error: String,
        /// Whether the previous maps were put back.
        restored: Result<(), egret_bpf::BpfError>,
    },
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

    /// Sets until when the data plane may serve each address, whatever its
    /// tables say (ADR 0004, "The data plane's own deadline"): `Some(t)`,
    /// valid strictly before `t` (CLOCK_MONOTONIC, as `Instant` is on
    /// Linux); `None`, no limit (file mode). Addresses not named keep what
    /// they had. Takes effect before returning, needs no kernel command that
    /// can block, and is never refused: fencing relies on it.
    fn set_valid_until(&self, deadlines: &[(IpAddr, Option<std::time::Instant>)]);

    /// The data plane's sessions for session sync (`crate::ha`); None where
    /// there is no data plane (tests' sinks).
    fn sessions(&self) -> Option<std::sync::Arc<dyn crate::ha::SessionStore>> {
        None
    }
}
