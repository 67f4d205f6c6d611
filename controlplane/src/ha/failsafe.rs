//! The holder's side of the failsafe (Patroni's DCS failsafe mode, ADR
//! 0012): while it cannot renew a Lease because the API server does not
//! answer, it asks every other eligible gateway of the IP whether it may
//! keep it. Only when ALL of them accept (no quorum, by design: a gateway
//! that was not asked, or did not answer, could take the IP once the Lease
//! expired) does the IP's deadline move, to the request's send time +
//! renewDeadline (`LeaseManager::failsafe_confirmed`); the peers promised
//! not to take it before their receipt time + leaseDuration
//! (`LeaseManager::promise`), so the fencing margin holds as for a renewal.
//! The other side of a request is `LeaseManager::promise`, called by the
//! channel task under the same lock the sync loop plans with.
//!
//! A peer that stops gracefully keeps its promises across its restart
//! (`promises.rs`) and says which (`Message::PromisesKept`, with its
//! Goodbye). While it is away, [`Failsafe::bridge`] lets it count as
//! accepting those IPs in rounds sent early enough that the deadline they
//! give (send time + renewDeadline) stays `MIN_FENCING_MARGIN` before the
//! earliest end of its last promise (the send time of the last round it
//! accepted + leaseDuration): ADR 0013, "A peer restarting".

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;

use tokio::time::Instant;

use super::messages::Message;
use crate::k8s::lease::{LeaseTiming, MIN_FENCING_MARGIN};

/// Rounds kept for late replies.
const ROUNDS_KEPT: usize = 8;

#[derive(Debug)]
struct Round {
    id: u64,
    sent: Instant,
    /// Per IP, the peers whose acceptance is still missing.
    awaiting: BTreeMap<IpAddr, BTreeSet<String>>,
    refused: BTreeSet<IpAddr>,
}

/// Failsafe rounds of one gateway.
#[derive(Debug, Default)]
pub struct Failsafe {
    next_id: u64,
    rounds: VecDeque<Round>,
    /// IPs kept by a round (counted per IP and round).
    pub confirmed: u64,
    /// IPs refused by some peer (counted per IP and round).
    pub refused: u64,
    /// The last refusal, for status: (IP, peer, reason).
    pub last_refusal: Option<(IpAddr, String, String)>,
    /// Per (peer, IP), the send time of the latest round the peer accepted
    /// the IP in: its promise runs at least until that + leaseDuration.
    accepted: BTreeMap<(String, IpAddr), Instant>,
    /// Per peer away after a graceful stop with its promises kept, per IP,
    /// the latest send time of a round it may count as accepting in.
    bridges: BTreeMap<String, BTreeMap<IpAddr, Instant>>,
    /// Acceptances counted on a kept promise of a peer that was away (per
    /// IP, peer and round).
    pub bridged: u64,
}

impl Failsafe {
    /// `peer` stopped gracefully and its next process keeps its promises
    /// for `ips` (`Message::PromisesKept`, right before its Goodbye). For
    /// each IP it had accepted in a round sent at s, its promise ends no
    /// earlier than s + leaseDuration (it received the request after s and
    /// promised from then): rounds sent until s + leaseDuration -
    /// renewDeadline - `MIN_FENCING_MARGIN` may count it as accepting, so
    /// the deadlines they give end that margin before the promise. Returns
    /// the IPs bridged (none for an IP it never accepted).
    pub fn bridge(&mut self, peer: &str, ips: &[IpAddr], timing: LeaseTiming) -> Vec<IpAddr> {
        let mut out = Vec::new();
        for ip in ips {
            let Some(s) = self.accepted.get(&(peer.to_string(), *ip)) else { continue };
            let Some(usable) =
                timing.lease_duration.checked_sub(timing.renew_deadline + MIN_FENCING_MARGIN).map(|d| *s + d)
            else {
                continue;
            };
            self.bridges.entry(peer.to_string()).or_default().insert(*ip, usable);
            out.push(*ip);
        }
        out
    }

    /// A new connection to `peer` came up (perhaps a new process): only
    /// acceptances over it count from now on, and it answers for itself.
    pub fn peer_up(&mut self, peer: &str) {
        self.accepted.retain(|(p, _), _| p != peer);
        self.bridges.remove(peer);
    }

    /// The connection to `peer` ended. Bridges set by its `PromisesKept`
    /// stay only when it ended with a Goodbye (`graceful`): a crash proves
    /// nothing about what the next process keeps.
    pub fn peer_down(&mut self, peer: &str, graceful: bool) {
        self.accepted.retain(|(p, _), _| p != peer);
        if !graceful {
            self.bridges.remove(peer);
        }
    }

    /// Starts a round at `now` for `ips` (each with the other gateways
    /// eligible for it). Returns the requests to send, and the IPs confirmed
    /// at once (nobody else is eligible: Patroni's single node stays; or
    /// every other eligible gateway is away with its promise kept and
    /// bridged, [`Failsafe::bridge`]). An IP with an eligible peer that is
    /// neither connected nor bridged is not asked: it cannot be confirmed
    /// this round.
    pub fn start(
        &mut self,
        ips: &BTreeMap<IpAddr, Vec<String>>,
        up: &BTreeSet<String>,
        now: Instant,
    ) -> (Vec<(String, Message)>, Vec<IpAddr>) {
        self.next_id += 1;
        let id = self.next_id;
        for b in self.bridges.values_mut() {
            b.retain(|_, usable| *usable >= now);
        }
        self.bridges.retain(|_, b| !b.is_empty());
        let mut alone = Vec::new();
        let mut awaiting = BTreeMap::new();
        let mut per_peer: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        for (ip, peers) in ips {
            let bridged = |p: &String| !up.contains(p) && self.bridges.get(p).is_some_and(|b| b.contains_key(ip));
            if !peers.iter().all(|p| up.contains(p) || bridged(p)) {
                continue;
            }
            let asked: BTreeSet<String> = peers.iter().filter(|p| up.contains(*p)).cloned().collect();
            self.bridged += (peers.len() - asked.len()) as u64;
            if asked.is_empty() {
                alone.push(*ip);
                continue;
            }
            for p in &asked {
                per_peer.entry(p.clone()).or_default().push(*ip);
            }
            awaiting.insert(*ip, asked);
        }
        self.confirmed += alone.len() as u64;
        if !awaiting.is_empty() {
            self.rounds.push_back(Round { id, sent: now, awaiting, refused: BTreeSet::new() });
            while self.rounds.len() > ROUNDS_KEPT {
                self.rounds.pop_front();
            }
        }
        let msgs = per_peer.into_iter().map(|(p, ips)| (p, Message::FailsafeRequest { id, ips })).collect();
        (msgs, alone)
    }

    /// A reply from `from`. Returns the send time of its round and the IPs
    /// every asked peer has now accepted in it.
    pub fn on_reply(
        &mut self,
        from: &str,
        id: u64,
        accepted: &[IpAddr],
        refused: &[(IpAddr, String)],
    ) -> Option<(Instant, Vec<IpAddr>)> {
        let round = self.rounds.iter_mut().find(|r| r.id == id)?;
        for (ip, why) in refused {
            self.accepted.remove(&(from.to_string(), *ip));
            if round.awaiting.get(ip).is_some_and(|w| w.contains(from)) && round.refused.insert(*ip) {
                self.refused += 1;
                self.last_refusal = Some((*ip, from.to_string(), why.clone()));
            }
        }
        let mut done = Vec::new();
        for ip in accepted {
            if round.awaiting.get(ip).is_some_and(|w| w.contains(from)) {
                let s = self.accepted.entry((from.to_string(), *ip)).or_insert(round.sent);
                *s = (*s).max(round.sent);
            }
            if round.refused.contains(ip) {
                continue;
            }
            if let Some(w) = round.awaiting.get_mut(ip) {
                if w.remove(from) && w.is_empty() {
                    done.push(*ip);
                }
            }
        }
        for ip in &done {
            round.awaiting.remove(ip);
        }
        self.confirmed += done.len() as u64;
        Some((round.sent, done))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use super::*;

    #[test]
    fn every_peer_must_accept_and_one_refusal_or_absence_is_enough_to_fail() {
        let t0 = Instant::now();
        let x: IpAddr = "198.51.100.10".parse().unwrap();
        let y: IpAddr = "198.51.100.11".parse().unwrap();
        let z: IpAddr = "198.51.100.12".parse().unwrap();
        let w: IpAddr = "198.51.100.13".parse().unwrap();
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ips: BTreeMap<IpAddr, Vec<String>> =
            [(x, names(&["gw-b", "gw-c"])), (y, names(&["gw-b", "gw-c"])), (z, names(&["gw-b", "gw-d"])), (w, vec![])]
                .into();
        let up: BTreeSet<String> = ["gw-b".to_string(), "gw-c".to_string()].into();
        let mut f = Failsafe::default();
        let (msgs, alone) = f.start(&ips, &up, t0);
        assert_eq!(alone, vec![w], "nobody else eligible: kept");
        let to: BTreeSet<&str> = msgs.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(to, ["gw-b", "gw-c"].into(), "z is not asked: gw-d is not connected");
        let id = match &msgs[0].1 {
            Message::FailsafeRequest { id, .. } => *id,
            m => panic!("{m:?}"),
        };
        assert_eq!(f.on_reply("gw-b", id, &[x, y], &[]), Some((t0, Vec::<IpAddr>::new())));
        let (sent, done) = f.on_reply("gw-c", id, &[x], &[(y, "the Lease names gw-e".into())]).unwrap();
        assert_eq!((sent, done), (t0, vec![x]));
        assert_eq!(f.refused, 1);
        assert!(f.on_reply("gw-c", id + 7, &[x], &[]).is_none(), "unknown round");
        assert_eq!(
            f.on_reply("gw-c", id, &[x, y], &[]).unwrap().1,
            Vec::<IpAddr>::new(),
            "nothing twice, refused stays refused"
        );
    }

    /// A peer that stopped gracefully with its promises kept counts as
    /// accepting the IPs it had accepted, in rounds sent until its last
    /// acceptance + leaseDuration - renewDeadline - the fencing margin; not
    /// an IP it never accepted, not after a crash, and not once it is back
    /// (it answers for itself).
    #[test]
    fn a_peer_away_with_its_promises_kept_counts_as_accepting_until_they_end() {
        let t0 = Instant::now();
        let timing = LeaseTiming::default(); // D 4 s, R 2 s: usable for 1.5 s after s
        let ms = Duration::from_millis;
        let x: IpAddr = "198.51.100.10".parse().unwrap();
        let y: IpAddr = "198.51.100.11".parse().unwrap();
        let ips: BTreeMap<IpAddr, Vec<String>> = [(x, vec!["gw-b".to_string()]), (y, vec!["gw-b".to_string()])].into();
        let up: BTreeSet<String> = ["gw-b".to_string()].into();
        let mut f = Failsafe::default();
        let (msgs, _) = f.start(&ips, &up, t0);
        let Message::FailsafeRequest { id, .. } = msgs[0].1 else { panic!() };
        f.on_reply("gw-b", id, &[x], &[(y, "no".into())]);
        // gw-b stops: PromisesKept (x and y), then its Goodbye.
        assert_eq!(f.bridge("gw-b", &[x, y], timing), vec![x], "y was never accepted");
        f.peer_down("gw-b", true);
        let away = BTreeSet::new();
        let (msgs, confirmed) = f.start(&ips, &away, t0 + ms(1_500));
        assert!(msgs.is_empty());
        assert_eq!(confirmed, vec![x], "x on gw-b's kept promise");
        assert_eq!(f.bridged, 1);
        let (_, confirmed) = f.start(&ips, &away, t0 + ms(1_501));
        assert!(confirmed.is_empty(), "the deadline would come closer than the margin to the promise's end");
        // Back: asked again, no bridge.
        f.peer_up("gw-b");
        let (msgs, confirmed) = f.start(&ips, &up, t0 + ms(100));
        assert_eq!((msgs.len(), confirmed.len()), (1, 0));
        // A crash after PromisesKept (no Goodbye): nothing counts.
        let Message::FailsafeRequest { id, .. } = msgs[0].1 else { panic!() };
        f.on_reply("gw-b", id, &[x], &[]);
        assert_eq!(f.bridge("gw-b", &[x], timing), vec![x]);
        f.peer_down("gw-b", false);
        assert!(f.start(&ips, &away, t0 + ms(200)).1.is_empty());
        // Acceptances over an earlier connection do not count either.
        f.peer_up("gw-b");
        f.peer_down("gw-b", true);
        assert_eq!(f.bridge("gw-b", &[x], timing), Vec::<IpAddr>::new());
    }
}
