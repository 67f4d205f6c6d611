//! What the node agent's `/healthz` and `/ready` mean.
//!
//! - `/healthz` (the liveness probe) fails when the reconcile loop is stuck:
//!   once the watches have synced, a pass finishes at least every resync
//!   period (30 s by default), so no pass finished for the resync period
//!   plus [`PASS_LIMIT`] means one is hung (a kernel or `nft` call that does
//!   not return) and only a restart helps. The kernel keeps the agent's
//!   rules across the restart. Waiting for the API server before the first
//!   sync is not a failure: a restart would wait the same.
//! - `/ready` fails while the watches have not synced, until a pass has
//!   applied everything once, and whenever `/healthz` fails. A pass that
//!   failed later is counted and reported (`egret node status`, the
//!   metrics), not a readiness failure: the rules already in the kernel
//!   keep working.
//!
//! A watch task or the metrics server that ends is a dead component: the
//! agent exits with an error naming it (the loop sees it at its next
//! wake-up), and the DaemonSet restarts it.

use std::time::Duration;

/// How long a pass may take beyond the resync period before the loop counts
/// as stuck (an `nft` run has a 5 s timeout; the kernel's netlink answers in
/// milliseconds; a loaded node gets the rest).
pub const PASS_LIMIT: Duration = Duration::from_secs(60);

/// What the probes read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    /// The watches have synced.
    pub synced: bool,
    /// Some pass has applied everything.
    pub programmed: bool,
    /// Time since the last pass finished (since the watches synced, before
    /// the first one).
    pub since_pass: Option<Duration>,
    /// The resync period.
    pub resync: Duration,
}

/// Why a probe fails.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProbeFailure {
    /// `/healthz` and `/ready`: no pass has finished for longer than the
    /// resync period plus [`PASS_LIMIT`] since the watches synced.
    #[error(
        "the reconcile loop is stuck: no pass has finished for {} s (limit {} s: the resync period + {} s)",
        since.as_secs(),
        limit.as_secs(),
        PASS_LIMIT.as_secs()
    )]
    Stuck {
        /// Time since the last pass finished.
        since: Duration,
        /// The resync period plus [`PASS_LIMIT`].
        limit: Duration,
    },
    /// `/ready`: the watches have not synced (the API server is not
    /// answering yet, or is still listing).
    #[error("the watches have not synced yet")]
    NotSynced,
    /// `/ready`: no pass has applied everything yet.
    #[error("no pass has applied everything yet")]
    NotProgrammed,
}

impl Probe {
    /// `/healthz`: `Err` when the reconcile loop is stuck.
    pub fn alive(&self) -> Result<(), ProbeFailure> {
        let limit = self.resync + PASS_LIMIT;
        match self.since_pass {
            Some(since) if self.synced && since > limit => Err(ProbeFailure::Stuck { since, limit }),
            _ => Ok(()),
        }
    }

    /// `/ready`: `Err` until everything was applied once, and while the
    /// loop is stuck.
    pub fn ready(&self) -> Result<(), ProbeFailure> {
        if !self.synced {
            return Err(ProbeFailure::NotSynced);
        }
        self.alive()?;
        if !self.programmed {
            return Err(ProbeFailure::NotProgrammed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(synced: bool, programmed: bool, since: u64) -> Probe {
        Probe { synced, programmed, since_pass: Some(Duration::from_secs(since)), resync: Duration::from_secs(30) }
    }

    #[test]
    fn a_loop_that_stops_finishing_passes_fails_both_probes() {
        assert_eq!(probe(true, true, 5).alive(), Ok(()));
        assert_eq!(probe(true, true, 5).ready(), Ok(()));
        assert_eq!(probe(true, true, 90).alive(), Ok(()), "the resync period plus the limit is allowed");
        let stuck = probe(true, true, 91);
        let why = stuck.alive().unwrap_err();
        assert_eq!(why, ProbeFailure::Stuck { since: Duration::from_secs(91), limit: Duration::from_secs(90) });
        let text = why.to_string();
        assert_eq!(
            text,
            "the reconcile loop is stuck: no pass has finished for 91 s (limit 90 s: the resync period + 60 s)"
        );
        assert_eq!(stuck.ready(), Err(why));
    }

    #[test]
    fn waiting_for_the_api_server_is_not_a_failure_but_not_ready() {
        let waiting = probe(false, false, 600);
        assert_eq!(waiting.alive(), Ok(()));
        assert_eq!(waiting.ready(), Err(ProbeFailure::NotSynced));
        assert_eq!(ProbeFailure::NotSynced.to_string(), "the watches have not synced yet");
        let first = probe(true, false, 1);
        assert_eq!(first.alive(), Ok(()));
        assert_eq!(first.ready(), Err(ProbeFailure::NotProgrammed));
        assert_eq!(ProbeFailure::NotProgrammed.to_string(), "no pass has applied everything yet");
        let never = Probe { synced: true, since_pass: None, ..probe(true, true, 0) };
        assert_eq!(never.alive(), Ok(()));
    }
}
