//! The holder's side of session sync: which standby each held egress IP
//! replicates to, full copies on a period and on every (re)connect, and the
//! incremental changes in between (conntrackd's FTFW over a reliable
//! stream: the channel is TCP, so nothing is acknowledged per message; a
//! broken connection or a refused send makes the next copy full).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use egret_dataplane::nat::sync::{SessionRecord, SyncEvent};
use tokio::time::Instant;

use super::messages::Message;

/// Records per Sessions frame (about 50 bytes each: frames of ~25 KB).
pub const BATCH: usize = 512;

#[derive(Clone, Debug)]
struct Replica {
    standby: String,
    /// The copy being (or last) sent.
    epoch: u64,
    /// The last copy the standby acknowledged.
    acked: Option<u64>,
    last_full: Option<Instant>,
    needs_full: bool,
}

/// One held IP's replication, for status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// The egress IP.
    pub ip: IpAddr,
    /// Its standby.
    pub standby: String,
    /// Whether the standby acknowledged the latest full copy and nothing
    /// was lost since.
    pub in_sync: bool,
    /// Since the last full copy was sent.
    pub since_full: Option<Duration>,
}

/// Replication of every IP this gateway holds.
#[derive(Debug)]
pub struct Replicator {
    by_ip: BTreeMap<IpAddr, Replica>,
    next_epoch: u64,
    resync: Duration,
    /// Records sent (full and incremental), removals included.
    pub records_sent: u64,
    /// Full copies sent.
    pub full_copies: u64,
}

impl Replicator {
    /// A replicator sending a full copy of each IP every `resync`.
    pub fn new(resync: Duration) -> Self {
        Replicator { by_ip: BTreeMap::new(), next_epoch: 1, resync, records_sent: 0, full_copies: 0 }
    }

    /// Sets the held IPs and each one's standby (None: none reachable).
    /// Returns the DropShadow messages for standbys that were replaced while
    /// the IP stays here. An IP this gateway no longer holds keeps its
    /// shadow on the standby: that is the copy the next holder installs.
    pub fn set_standbys(&mut self, want: &BTreeMap<IpAddr, Option<String>>) -> Vec<(String, Message)> {
        let mut out = Vec::new();
        self.by_ip.retain(|ip, r| match want.get(ip) {
            Some(Some(s)) if *s == r.standby => true,
            Some(_) => {
                out.push((r.standby.clone(), Message::DropShadow { ip: *ip }));
                false
            }
            None => false,
        });
        for (ip, s) in want {
            if let (Some(s), false) = (s, self.by_ip.contains_key(ip)) {
                self.by_ip.insert(
                    *ip,
                    Replica { standby: s.clone(), epoch: 0, acked: None, last_full: None, needs_full: true },
                );
            }
        }
        out
    }

    /// `peer` (re)connected, or a send to it failed: everything it stands
    /// by for needs a full copy.
    pub fn resync_peer(&mut self, peer: &str) {
        for r in self.by_ip.values_mut().filter(|r| r.standby == peer) {
            r.needs_full = true;
            r.acked = None;
        }
    }

    /// Changes were lost (the journal overflowed): every IP needs a full copy.
    pub fn resync_all(&mut self) {
        for r in self.by_ip.values_mut() {
            r.needs_full = true;
            r.acked = None;
        }
    }

    /// The IPs whose full copy is due at `now` (needed, or the period
    /// passed), each with its standby and a new epoch; marks them sent.
    pub fn due_full(&mut self, now: Instant) -> Vec<(IpAddr, String, u64)> {
        let mut out = Vec::new();
        for (ip, r) in &mut self.by_ip {
            let due = r.needs_full || r.last_full.is_none_or(|t| now >= t + self.resync);
            if due {
                r.epoch = self.next_epoch;
                self.next_epoch += 1;
                r.last_full = Some(now);
                r.needs_full = false;
                out.push((*ip, r.standby.clone(), r.epoch));
            }
        }
        self.full_copies += out.len() as u64;
        out
    }

    /// The messages of one full copy.
    pub fn full_copy(&mut self, ip: IpAddr, epoch: u64, records: Vec<SessionRecord>) -> Vec<Message> {
        let count = records.len() as u64;
        self.records_sent += count;
        let mut out = vec![Message::FullBegin { ip, epoch }];
        let mut it = records.into_iter().peekable();
        while it.peek().is_some() {
            let upserts: Vec<SessionRecord> = it.by_ref().take(BATCH).collect();
            out.push(Message::Sessions { ip, epoch, upserts, removes: Vec::new() });
        }
        out.push(Message::FullEnd { ip, epoch, count });
        out
    }

    /// Routes journal events to the standbys of their egress IPs, batched;
    /// events of IPs without a standby are dropped (their full copy covers
    /// them once one appears).
    pub fn incremental(&mut self, events: Vec<SyncEvent>) -> Vec<(String, Message)> {
        let mut per_ip: BTreeMap<IpAddr, (Vec<SessionRecord>, Vec<_>)> = BTreeMap::new();
        for e in events {
            match e {
                SyncEvent::Upsert(r) if self.by_ip.contains_key(&r.egress) => {
                    per_ip.entry(r.egress).or_default().0.push(r)
                }
                SyncEvent::Remove(k) if self.by_ip.contains_key(&k.egress) => {
                    per_ip.entry(k.egress).or_default().1.push(k)
                }
                _ => {}
            }
        }
        let mut out = Vec::new();
        for (ip, (ups, rms)) in per_ip {
            let Some(r) = self.by_ip.get(&ip) else { continue };
            self.records_sent += (ups.len() + rms.len()) as u64;
            let mut ups = ups.into_iter().peekable();
            let mut rms = rms.into_iter().peekable();
            while ups.peek().is_some() || rms.peek().is_some() {
                let upserts: Vec<_> = ups.by_ref().take(BATCH).collect();
                let removes: Vec<_> = rms.by_ref().take(BATCH).collect();
                out.push((r.standby.clone(), Message::Sessions { ip, epoch: 0, upserts, removes }));
            }
        }
        out
    }

    /// The standby `from` acknowledged copy `epoch` of `ip`.
    pub fn on_ack(&mut self, from: &str, ip: IpAddr, epoch: u64) {
        if let Some(r) = self.by_ip.get_mut(&ip).filter(|r| r.standby == from && r.epoch == epoch) {
            r.acked = Some(epoch);
        }
    }

    /// Whether `ip`'s standby holds its latest copy and nothing was lost since.
    pub fn in_sync(&self, ip: IpAddr) -> bool {
        self.by_ip.get(&ip).is_some_and(|r| !r.needs_full && r.acked == Some(r.epoch))
    }

    /// The standbys in use.
    pub fn standbys(&self) -> BTreeSet<String> {
        self.by_ip.values().map(|r| r.standby.clone()).collect()
    }

    /// Every held IP's replication.
    pub fn status(&self, now: Instant) -> Vec<ReplicaStatus> {
        self.by_ip
            .iter()
            .map(|(ip, r)| ReplicaStatus {
                ip: *ip,
                standby: r.standby.clone(),
                in_sync: !r.needs_full && r.acked == Some(r.epoch),
                since_full: r.last_full.map(|t| now.saturating_duration_since(t)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Found by the lab's drain: the holder gave the IP up, told its standby
    /// to drop the shadow, and the standby took the IP with nothing.
    #[test]
    fn giving_an_ip_up_keeps_the_standbys_copy_and_a_new_standby_drops_the_old() {
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let mut r = Replicator::new(Duration::from_secs(30));
        assert!(r.set_standbys(&[(ip, Some("gw-2".to_string()))].into()).is_empty());
        assert_eq!(r.due_full(Instant::now()).len(), 1);
        // Standby changes while the IP stays here: the old one drops it.
        let out = r.set_standbys(&[(ip, Some("gw-3".to_string()))].into());
        assert_eq!(out, vec![("gw-2".to_string(), Message::DropShadow { ip })]);
        // The IP leaves (fenced, drained, released): nobody is told to drop.
        assert!(r.set_standbys(&BTreeMap::new()).is_empty());
        assert!(r.standbys().is_empty());
    }
}
