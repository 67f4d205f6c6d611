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

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;

use tokio::time::Instant;

use super::messages::Message;

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
}

impl Failsafe {
    /// Starts a round at `now` for `ips` (each with the other gateways
    /// eligible for it). Returns the requests to send, and the IPs confirmed
    /// at once (nobody else is eligible: Patroni's single node stays). An IP
    /// with an eligible peer that is not connected is not asked: it cannot
    /// be confirmed this round.
    pub fn start(
        &mut self,
        ips: &BTreeMap<IpAddr, Vec<String>>,
        up: &BTreeSet<String>,
        now: Instant,
    ) -> (Vec<(String, Message)>, Vec<IpAddr>) {
        self.next_id += 1;
        let id = self.next_id;
        let mut alone = Vec::new();
        let mut awaiting = BTreeMap::new();
        let mut per_peer: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
        for (ip, peers) in ips {
            if peers.is_empty() {
                alone.push(*ip);
                continue;
            }
            if !peers.iter().all(|p| up.contains(p)) {
                continue;
            }
            awaiting.insert(*ip, peers.iter().cloned().collect::<BTreeSet<_>>());
            for p in peers {
                per_peer.entry(p.clone()).or_default().push(*ip);
            }
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
            if round.awaiting.get(ip).is_some_and(|w| w.contains(from)) && round.refused.insert(*ip) {
                self.refused += 1;
                self.last_refusal = Some((*ip, from.to_string(), why.clone()));
            }
        }
        let mut done = Vec::new();
        for ip in accepted {
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
}
