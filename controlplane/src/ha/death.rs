//! Proof of a peer's death (issue 28 §1): which channel ends let this
//! gateway take a peer's IPs before their Leases expire.
//!
//! | evidence | verdict |
//! |---|---|
//! | [`End::Gone`]: a signed FIN without goodbye (the socket in CLOSE_WAIT) | dead now: only the kernel closing an exited process's sockets sends it |
//! | [`End::Reset`]: a signed RST without goodbye | dead only if the same incarnation is not back within `confirm` |
//! | the peer comes up as a new incarnation | the old incarnation is dead (one process per node holds the channel's port) |
//! | anything else (silence, aborted here, refused, goodbye) | nothing |
//!
//! Why a reset needs confirming: an RST comes from a process that exited
//! with unread data, but also from a socket aborted on the peer's node while
//! its process lives (`ss -K`, a kernel socket abort). Seen as death, a live
//! holder met a second owner 0.06-0.16 s later, and repeated aborts moved an
//! IP back and forth between two live gateways (issue 28). A live process
//! redials (or is redialled) within milliseconds of an abort, with the same
//! incarnation; a dead one never comes back as itself.
//!
//! What is left: a live holder whose socket is aborted *and* whose channel
//! cannot come back for `confirm` (the network between the two breaks at
//! the same moment) is taken for dead; its next renewal then fails on the
//! taker's newer Lease and it stops serving (ADR 0013).

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use super::channel::End;

/// A peer process proven dead: its name and the incarnation that died.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dead {
    /// The peer's gateway name.
    pub peer: String,
    /// The incarnation whose records may be taken over.
    pub incarnation: u64,
    /// What proved it, for the log.
    pub why: &'static str,
}

/// The evidence about each peer, between channel events.
#[derive(Debug)]
pub struct Deaths {
    confirm: Duration,
    /// Resets waiting for their confirmation: peer -> (incarnation, since).
    pending: BTreeMap<String, (u64, Instant)>,
    /// The last incarnation seen up, per peer.
    seen: BTreeMap<String, u64>,
    /// Resets that came back as the same incarnation (the peer was alive).
    pub resets_survived: u64,
}

impl Deaths {
    /// Resets are confirmed after `confirm` without the peer's return.
    pub fn new(confirm: Duration) -> Deaths {
        Deaths { confirm, pending: BTreeMap::new(), seen: BTreeMap::new(), resets_survived: 0 }
    }

    /// The peer's connection ended with `end`.
    pub fn on_down(&mut self, peer: &str, incarnation: u64, end: &End, now: Instant) -> Option<Dead> {
        if end.proves_death() {
            self.pending.remove(peer);
            return Some(Dead { peer: peer.to_string(), incarnation, why: "its channel ended with a signed FIN" });
        }
        if end.suggests_death() {
            self.pending.entry(peer.to_string()).or_insert((incarnation, now));
        } else if matches!(end, End::Goodbye(_)) {
            self.pending.remove(peer);
        }
        None
    }

    /// The peer's connection came up as `incarnation`.
    pub fn on_up(&mut self, peer: &str, incarnation: u64) -> Option<Dead> {
        let before = self.seen.insert(peer.to_string(), incarnation);
        if let Some((pending, _)) = self.pending.remove(peer) {
            if pending == incarnation {
                self.resets_survived += 1;
                return None;
            }
            return Some(Dead {
                peer: peer.to_string(),
                incarnation: pending,
                why: "its channel was reset and it came back as a new process",
            });
        }
        match before {
            Some(old) if old != incarnation => {
                Some(Dead { peer: peer.to_string(), incarnation: old, why: "it came back as a new process" })
            }
            _ => None,
        }
    }

    /// Resets whose peer stayed away for the confirmation window.
    pub fn due(&mut self, now: Instant) -> Vec<Dead> {
        let confirm = self.confirm;
        let due: Vec<String> =
            self.pending.iter().filter(|(_, (_, since))| now >= *since + confirm).map(|(p, _)| p.clone()).collect();
        due.into_iter()
            .filter_map(|peer| {
                let (incarnation, _) = self.pending.remove(&peer)?;
                Some(Dead { peer, incarnation, why: "its channel was reset and did not come back" })
            })
            .collect()
    }

    /// Peers whose reset waits for its confirmation.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_millis(500);

    #[test]
    fn a_fin_proves_death_at_once() {
        let mut d = Deaths::new(W);
        let now = Instant::now();
        let dead = d.on_down("gw-a", 7, &End::Gone, now).expect("dead");
        assert_eq!((dead.peer.as_str(), dead.incarnation), ("gw-a", 7));
    }

    #[test]
    fn a_reset_the_same_process_survives_proves_nothing() {
        let mut d = Deaths::new(W);
        let now = Instant::now();
        d.on_up("gw-a", 7);
        assert_eq!(d.on_down("gw-a", 7, &End::Reset, now), None);
        assert_eq!(d.pending(), 1);
        assert_eq!(d.on_up("gw-a", 7), None, "back as itself: alive");
        assert_eq!(d.due(now + W * 4), vec![]);
        assert_eq!(d.resets_survived, 1);
        // Repeated aborts: never a death.
        for i in 1..=30u32 {
            let t = now + Duration::from_millis(300) * i;
            assert_eq!(d.on_down("gw-a", 7, &End::Reset, t), None);
            assert_eq!(d.due(t + Duration::from_millis(10)), vec![]);
            assert_eq!(d.on_up("gw-a", 7), None);
        }
        assert_eq!(d.resets_survived, 31);
    }

    #[test]
    fn a_reset_that_stays_away_is_a_death_after_the_window() {
        let mut d = Deaths::new(W);
        let now = Instant::now();
        d.on_up("gw-a", 7);
        d.on_down("gw-a", 7, &End::Reset, now);
        // Other ends while it is away (redials that fail) keep the first reset's clock.
        d.on_down("gw-a", 7, &End::Unreachable("timeout".into()), now + W / 2);
        assert_eq!(d.due(now + W - Duration::from_millis(1)), vec![]);
        let dead = d.due(now + W);
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].incarnation, 7);
        assert_eq!(d.due(now + W * 2), vec![], "once");
    }

    #[test]
    fn a_new_incarnation_proves_the_old_one_dead() {
        let mut d = Deaths::new(W);
        let now = Instant::now();
        d.on_up("gw-a", 7);
        d.on_down("gw-a", 7, &End::Reset, now);
        assert_eq!(d.on_up("gw-a", 8).map(|x| x.incarnation), Some(7));
        // Without a reset before (a silent peer restarted).
        d.on_down("gw-a", 8, &End::Silent, now);
        assert_eq!(d.on_up("gw-a", 9).map(|x| x.incarnation), Some(8));
        assert_eq!(d.on_up("gw-b", 1), None, "first sight proves nothing");
    }

    #[test]
    fn local_aborts_silence_and_goodbyes_prove_nothing() {
        let mut d = Deaths::new(W);
        let now = Instant::now();
        for end in [End::Aborted, End::Silent, End::Closed, End::Goodbye("drain".into()), End::Superseded] {
            assert_eq!(d.on_down("gw-a", 7, &end, now), None, "{end}");
        }
        assert_eq!(d.due(now + W * 10), vec![]);
        d.on_down("gw-a", 7, &End::Reset, now);
        d.on_down("gw-a", 7, &End::Goodbye("stop".into()), now);
        assert_eq!(d.due(now + W * 10), vec![], "a goodbye after the reset: it stopped gracefully");
    }
}
