//! The standby's side of session sync: shadow copies of the sessions of the
//! egress IPs this gateway stands by for, kept aside (not in the data plane)
//! until it takes one of those IPs over (conntrackd's external cache).
//!
//! A shadow is built from one holder's messages: a full copy (FullBegin,
//! Sessions with that epoch, FullEnd) replaces it whole, which is how a lost
//! or refused message cannot leave the standby wrong for longer than one
//! resynchronisation period; incremental Sessions (epoch 0) update it in
//! between. Records carry ages, not timestamps (clocks differ between
//! machines): each is stamped with the local time it arrived, and its age at
//! take-over is its age when sent plus the time since.
//!
//! A full copy is paced over many ticks (`replicate.rs`): it is a snapshot
//! of the holder's table when FullBegin was sent, and the incremental
//! changes that follow it arrive interleaved with its chunks. A copy is
//! received in place (mark and sweep, so a standby never holds a session
//! twice: its memory bound counts sessions, not copies of them): FullBegin
//! starts a new mark, every record of the copy and every incremental change
//! marks its session, and FullEnd sweeps the sessions left unmarked (gone on
//! the holder). A copy's record of a session already marked is skipped (an
//! incremental change since the snapshot is newer), and so is one of a
//! session removed since the copy began (a tombstone until its end).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::time::Duration;

use egret_dataplane::nat::sync::{SessionKeyRecord, SessionRecord};
use tokio::time::Instant;

use super::messages::Message;

/// What identifies a session: its whole tuple, translated port included
/// (a removal of an older session of the same flow on another port must
/// not remove the newer one: `nat::sync`'s drain order).
type Key = SessionKeyRecord;

/// One session: its record, the local time it arrived, and the mark of the
/// copy (or change) that last confirmed it.
#[derive(Debug)]
struct Entry {
    record: SessionRecord,
    at: Instant,
    mark: u32,
}

/// Sessions by key.
type Sessions = HashMap<Key, Entry>;

/// A full copy being received.
#[derive(Debug)]
struct Pending {
    epoch: u64,
    /// The shadow's mark for this copy: sessions not carrying it at
    /// FullEnd are swept.
    mark: u32,
    /// Sessions removed incrementally since the copy began: its own (older)
    /// records of them are skipped.
    removed: HashSet<Key>,
    /// Records of the copy received (kept, skipped or refused).
    received: u64,
    /// Records of the copy refused by the memory bound.
    refused: u64,
}

#[derive(Debug)]
struct Shadow {
    holder: String,
    sessions: Sessions,
    /// A full copy being received.
    pending: Option<Pending>,
    /// The last full copy that completed.
    complete: Option<u64>,
    /// The mark of the copy being received (or of the last one).
    mark: u32,
    updated: Instant,
}

/// One shadow, for status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShadowStatus {
    /// The egress IP.
    pub ip: IpAddr,
    /// The holder it came from.
    pub holder: String,
    /// Sessions held.
    pub sessions: usize,
    /// Whether a full copy completed (else only incremental changes are known).
    pub in_sync: bool,
    /// Since the last message.
    pub age: Duration,
}

/// Shadows (egress IPs) a standby keeps at most, by default: far more
/// than the egress IPs of a cluster, and a bound on what a peer's bug can
/// make it keep (each shadow costs a few hundred bytes even when empty).
pub const MAX_SHADOWS: usize = 4096;

/// The shadows of every IP this gateway stands by for.
#[derive(Debug)]
pub struct Standby {
    by_ip: BTreeMap<IpAddr, Shadow>,
    /// Bound on the sessions held over all shadows (memory).
    max_sessions: usize,
    /// Bound on the number of shadows (IPs).
    max_shadows: usize,
    held: usize,
    /// Records (and removals during a copy, which need a tombstone)
    /// refused because the bound was reached.
    pub refused: u64,
    /// Messages about a new IP dropped because `max_shadows` IPs have one.
    pub shadows_refused: u64,
}

impl Standby {
    /// A store holding at most `max_sessions` records in all, in at most
    /// [`MAX_SHADOWS`] shadows.
    pub fn new(max_sessions: usize) -> Self {
        Self::with_limits(max_sessions, MAX_SHADOWS)
    }

    /// A store holding at most `max_sessions` records in all, in at most
    /// `max_shadows` shadows (IPs).
    pub fn with_limits(max_sessions: usize, max_shadows: usize) -> Self {
        Standby { by_ip: BTreeMap::new(), max_sessions, max_shadows, held: 0, refused: 0, shadows_refused: 0 }
    }

    /// Sessions held, and tombstones of copies being received.
    fn count(&mut self) {
        self.held =
            self.by_ip.values().map(|s| s.sessions.len() + s.pending.as_ref().map_or(0, |p| p.removed.len())).sum();
    }

    /// Takes in a message from `from`; returns the answer to send back, if any.
    pub fn on_message(&mut self, from: &str, msg: Message, now: Instant) -> Option<Message> {
        match msg {
            Message::FullBegin { ip, epoch } => {
                let sh = self.shadow(ip, from, now)?;
                sh.mark = sh.mark.wrapping_add(1);
                sh.pending = Some(Pending { epoch, mark: sh.mark, removed: HashSet::new(), received: 0, refused: 0 });
                self.count();
                None
            }
            Message::Sessions { ip, epoch, upserts, removes } => {
                let mut room = self.max_sessions.saturating_sub(self.held);
                let sh = self.shadow(ip, from, now)?;
                let mut refused = 0u64;
                // A record of another egress IP is a peer's bug: never
                // installed under this one.
                let upserts = upserts.into_iter().filter(|r| r.egress == ip);
                let mark = sh.mark;
                // Upserts `record`; a new session only if there is room.
                let put = |t: &mut Sessions, room: &mut usize, record: SessionRecord| match t.get_mut(&record.key()) {
                    Some(e) => {
                        *e = Entry { record, at: now, mark };
                        true
                    }
                    None if *room > 0 => {
                        *room -= 1;
                        t.insert(record.key(), Entry { record, at: now, mark });
                        true
                    }
                    None => false,
                };
                if epoch == 0 {
                    // Incremental: newer than any copy being received, so
                    // it marks its session (kept at the copy's end, and the
                    // copy's own record of it skipped).
                    for r in upserts {
                        // A session back since its removal: its tombstone's
                        // room is the session's.
                        room += usize::from(sh.pending.as_mut().is_some_and(|p| p.removed.remove(&r.key())));
                        if !put(&mut sh.sessions, &mut room, r) {
                            refused += 1;
                            // The copy would end without it: not complete.
                            if let Some(p) = &mut sh.pending {
                                p.refused += 1;
                            }
                        }
                    }
                    for k in removes {
                        // A removed session's room is its tombstone's.
                        room += usize::from(sh.sessions.remove(&k).is_some());
                        if let Some(p) = &mut sh.pending {
                            if p.removed.contains(&k) {
                                continue;
                            }
                            if room > 0 {
                                room -= 1;
                                p.removed.insert(k);
                            } else {
                                // No room for the tombstone: the copy can
                                // no longer be trusted to end right.
                                p.refused += 1;
                                refused += 1;
                            }
                        }
                    }
                } else if let Some(p) = sh.pending.as_mut().filter(|p| p.epoch == epoch) {
                    for r in upserts {
                        p.received += 1;
                        let k = r.key();
                        if p.removed.contains(&k) || sh.sessions.get(&k).is_some_and(|e| e.mark == p.mark) {
                            continue;
                        }
                        if !put(&mut sh.sessions, &mut room, r) {
                            p.refused += 1;
                            refused += 1;
                        }
                    }
                    for k in removes {
                        sh.sessions.remove(&k);
                    }
                }
                // Else a copy this standby did not see begin: ignored, the next one counts.
                sh.updated = now;
                self.refused += refused;
                self.count();
                None
            }
            Message::FullEnd { ip, epoch, count } => {
                let sh = self.shadow(ip, from, now)?;
                let answer = match sh.pending.take() {
                    Some(p) if p.epoch == epoch => {
                        // Sessions neither in the copy nor changed since it
                        // began are gone on the holder.
                        sh.sessions.retain(|_, e| e.mark == p.mark);
                        if p.received == count && p.refused == 0 {
                            sh.complete = Some(epoch);
                            Some(Message::SyncAck { ip, epoch })
                        } else {
                            // Incomplete (refused records, or a copy begun
                            // before a reconnect): keep what is known, do not
                            // acknowledge; the holder sends the next copy on
                            // its period.
                            sh.complete = None;
                            None
                        }
                    }
                    other => {
                        sh.pending = other;
                        None
                    }
                };
                sh.updated = now;
                self.count();
                answer
            }
            Message::DropShadow { ip } => {
                if self.by_ip.get(&ip).is_some_and(|s| s.holder == from) {
                    self.by_ip.remove(&ip);
                    self.count();
                }
                None
            }
            _ => None,
        }
    }

    /// The shadow of `ip` from `holder`; one from another holder is replaced
    /// (the IP moved). None (counted) when `ip` has none and
    /// `max_shadows` IPs have one.
    fn shadow(&mut self, ip: IpAddr, holder: &str, now: Instant) -> Option<&mut Shadow> {
        if !self.by_ip.contains_key(&ip) && self.by_ip.len() >= self.max_shadows {
            self.shadows_refused += 1;
            return None;
        }
        let fresh = || Shadow {
            holder: holder.to_string(),
            sessions: HashMap::new(),
            pending: None,
            complete: None,
            mark: 0,
            updated: now,
        };
        let sh = self.by_ip.entry(ip).or_insert_with(fresh);
        if sh.holder != holder {
            *sh = fresh();
        }
        Some(sh)
    }

    /// Takes the shadow of `ip` out, for installing into the data plane: the
    /// records with their ages brought up to `now`.
    pub fn take(&mut self, ip: IpAddr, now: Instant) -> Option<(String, Vec<SessionRecord>)> {
        let sh = self.by_ip.remove(&ip)?;
        self.count();
        let records = sh
            .sessions
            .into_values()
            .map(|Entry { mut record, at, .. }| {
                let waited = u32::try_from(now.saturating_duration_since(at).as_secs()).unwrap_or(u32::MAX);
                record.idle_secs = record.idle_secs.saturating_add(waited);
                record
            })
            .collect();
        Some((sh.holder, records))
    }

    /// Forgets shadows whose IP is now held by neither their holder nor
    /// this gateway `me` (`holders`: the Lease holder of each IP as last
    /// seen; a shadow of an IP this gateway just took waits for
    /// [`Standby::take`]).
    pub fn retain_holders(&mut self, me: &str, holders: &BTreeMap<IpAddr, Option<String>>) {
        let before = self.by_ip.len();
        self.by_ip.retain(|ip, sh| match holders.get(ip) {
            Some(Some(h)) => *h == sh.holder || h == me,
            // Released or unknown: kept (a released IP is taken by the next
            // candidate, which may be us).
            _ => true,
        });
        if self.by_ip.len() != before {
            self.count();
        }
    }

    /// Sessions held in all shadows, with the tombstones of copies being
    /// received (what the memory bound counts).
    pub fn sessions(&self) -> usize {
        self.held
    }

    /// The IPs this gateway holds a copy of (complete or not).
    pub fn ips(&self) -> std::collections::BTreeSet<IpAddr> {
        self.by_ip.keys().copied().collect()
    }

    /// Every shadow.
    pub fn status(&self, now: Instant) -> Vec<ShadowStatus> {
        self.by_ip
            .iter()
            .map(|(ip, s)| ShadowStatus {
                ip: *ip,
                holder: s.holder.clone(),
                sessions: s.sessions.len(),
                in_sync: s.complete.is_some(),
                age: now.saturating_duration_since(s.updated),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn rec(pod_port: u16, idle_secs: u32) -> SessionRecord {
        SessionRecord {
            proto: 17,
            pod: "198.18.0.11".parse().unwrap(),
            pod_port,
            remote: "203.0.113.80".parse().unwrap(),
            remote_port: 53,
            egress: "198.51.100.10".parse().unwrap(),
            egress_port: pod_port,
            tcp: 0,
            tcp_track: 0,
            flags: 0,
            idle_secs,
        }
    }

    #[test]
    fn a_full_copy_replaces_the_shadow_and_only_a_complete_one_is_acknowledged() {
        let t0 = Instant::now();
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let mut s = Standby::new(100);
        // Incremental changes before any copy: kept, not in sync.
        s.on_message("gw-1", Message::Sessions { ip, epoch: 0, upserts: vec![rec(1, 0)], removes: vec![] }, t0);
        assert!(!s.status(t0)[0].in_sync);
        // A complete copy replaces it (port 1 is gone on the holder).
        assert_eq!(s.on_message("gw-1", Message::FullBegin { ip, epoch: 5 }, t0), None);
        s.on_message(
            "gw-1",
            Message::Sessions { ip, epoch: 5, upserts: vec![rec(2, 3), rec(3, 0)], removes: vec![] },
            t0,
        );
        let ack = s.on_message("gw-1", Message::FullEnd { ip, epoch: 5, count: 2 }, t0);
        assert_eq!(ack, Some(Message::SyncAck { ip, epoch: 5 }));
        assert_eq!(s.sessions(), 2);
        // Incremental removal, then take-over 10 s later: ages grew by 10 s.
        s.on_message("gw-1", Message::Sessions { ip, epoch: 0, upserts: vec![], removes: vec![rec(3, 0).key()] }, t0);
        let (holder, mut got) = s.take(ip, t0 + Duration::from_secs(10)).unwrap();
        got.sort_by_key(|r| r.pod_port);
        assert_eq!(holder, "gw-1");
        assert_eq!(got, vec![rec(2, 13)]);
        assert_eq!(s.sessions(), 0);
        // A copy with records missing (count differs) is kept but not acknowledged.
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 6 }, t0);
        s.on_message("gw-1", Message::Sessions { ip, epoch: 6, upserts: vec![rec(4, 0)], removes: vec![] }, t0);
        assert_eq!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 6, count: 2 }, t0), None);
        // Another holder's messages replace the shadow; DropShadow from a
        // gateway that is not the holder is ignored.
        s.on_message("gw-2", Message::FullBegin { ip, epoch: 1 }, t0);
        assert_eq!(s.status(t0)[0].holder, "gw-2");
        s.on_message("gw-1", Message::DropShadow { ip }, t0);
        assert_eq!(s.status(t0).len(), 1);
        s.on_message("gw-2", Message::DropShadow { ip }, t0);
        assert!(s.status(t0).is_empty());
    }

    #[test]
    fn the_memory_bound_refuses_records_and_the_copy_is_not_acknowledged() {
        let t0 = Instant::now();
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let mut s = Standby::new(2);
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 1 }, t0);
        s.on_message(
            "gw-1",
            Message::Sessions { ip, epoch: 1, upserts: (1..=3).map(|p| rec(p, 0)).collect(), removes: vec![] },
            t0,
        );
        assert_eq!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 1, count: 3 }, t0), None);
        assert_eq!((s.sessions(), s.refused), (2, 1));
    }

    /// Review finding 7: a copy was received beside the shadow it replaces,
    /// so the memory bound counted every session twice and a standby whose
    /// bound fit the holder's table once never acknowledged a second copy.
    #[test]
    fn a_copy_is_received_in_place_so_a_bound_that_fits_the_table_fits_every_copy() {
        let t0 = Instant::now();
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let mut s = Standby::new(3);
        for epoch in 1..=3u64 {
            s.on_message("gw-1", Message::FullBegin { ip, epoch }, t0);
            // Mid-copy the standby holds each session once.
            s.on_message("gw-1", Message::Sessions { ip, epoch, upserts: vec![rec(1, 0)], removes: vec![] }, t0);
            assert_eq!(s.sessions(), if epoch == 1 { 1 } else { 3 });
            let rest = Message::Sessions { ip, epoch, upserts: vec![rec(2, 0), rec(3, 0)], removes: vec![] };
            s.on_message("gw-1", rest, t0);
            let ack = s.on_message("gw-1", Message::FullEnd { ip, epoch, count: 3 }, t0);
            assert_eq!(ack, Some(Message::SyncAck { ip, epoch }), "copy {epoch}");
            assert_eq!((s.sessions(), s.refused), (3, 0));
        }
        // A copy of a table that turned over needs room for old and new
        // until its end: refused, unacknowledged, and the next one fits.
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 4 }, t0);
        let new = Message::Sessions { ip, epoch: 4, upserts: (4..=6).map(|p| rec(p, 0)).collect(), removes: vec![] };
        s.on_message("gw-1", new, t0);
        assert_eq!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 4, count: 3 }, t0), None);
        assert_eq!(s.sessions(), 0, "what the copy could not hold is swept with the old sessions");
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 5 }, t0);
        let new = Message::Sessions { ip, epoch: 5, upserts: (4..=6).map(|p| rec(p, 0)).collect(), removes: vec![] };
        s.on_message("gw-1", new, t0);
        assert!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 5, count: 3 }, t0).is_some());
        let (_, mut got) = s.take(ip, t0).unwrap();
        got.sort_by_key(|r| r.pod_port);
        assert_eq!(got, (4..=6).map(|p| rec(p, 0)).collect::<Vec<_>>());
    }

    /// The review of finding 7's fix: at the bound, a removal during a copy
    /// must free its session's room for its tombstone (else no copy is
    /// ever acknowledged under churn), and an incremental change refused
    /// during a copy must keep that copy from being acknowledged (else the
    /// standby claims a table it lacks a session of).
    #[test]
    fn at_the_bound_removals_make_room_and_a_refused_change_spoils_the_copy() {
        let t0 = Instant::now();
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let copy = |s: &mut Standby, epoch: u64, ports: &[u16], mid: Option<Message>| {
            s.on_message("gw-1", Message::FullBegin { ip, epoch }, t0);
            if let Some(m) = mid {
                s.on_message("gw-1", m, t0);
            }
            let upserts = ports.iter().map(|p| rec(*p, 0)).collect();
            s.on_message("gw-1", Message::Sessions { ip, epoch, upserts, removes: vec![] }, t0);
            s.on_message("gw-1", Message::FullEnd { ip, epoch, count: ports.len() as u64 }, t0)
        };
        let mut s = Standby::new(3);
        assert!(copy(&mut s, 1, &[1, 2, 3], None).is_some());
        // Port 1 closes during copy 2, whose snapshot still has it.
        let close = Message::Sessions { ip, epoch: 0, upserts: vec![], removes: vec![rec(1, 0).key()] };
        assert!(copy(&mut s, 2, &[1, 2, 3], Some(close)).is_some(), "the tombstone takes port 1's room");
        let (_, got) = s.take(ip, t0).unwrap();
        assert_eq!(got.len(), 2, "port 1 is not resurrected by the copy: {got:?}");
        assert_eq!(s.refused, 0);

        let mut s = Standby::new(4);
        assert!(copy(&mut s, 1, &[1, 2, 3], None).is_some());
        // During copy 2: port 1 closes (a tombstone), 4 and 5 open; 5 finds no room.
        let churn = Message::Sessions { ip, epoch: 0, upserts: vec![rec(4, 0), rec(5, 0)], removes: vec![] };
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 2 }, t0);
        s.on_message("gw-1", Message::Sessions { ip, epoch: 0, upserts: vec![], removes: vec![rec(1, 0).key()] }, t0);
        s.on_message("gw-1", churn, t0);
        s.on_message(
            "gw-1",
            Message::Sessions { ip, epoch: 2, upserts: (1..=3).map(|p| rec(p, 0)).collect(), removes: vec![] },
            t0,
        );
        assert_eq!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 2, count: 3 }, t0), None, "port 5 is missing");
        assert_eq!(s.refused, 1);
        assert!(!s.status(t0)[0].in_sync);
    }

    /// A paced copy is a snapshot older than the incremental changes that
    /// arrive between its chunks: they must survive the copy's end, and the
    /// copy's older records of the same sessions must not undo them.
    #[test]
    fn incremental_changes_during_a_paced_copy_survive_it() {
        let t0 = Instant::now();
        let ip: IpAddr = "198.51.100.10".parse().unwrap();
        let mut s = Standby::new(100);
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 3 }, t0);
        s.on_message("gw-1", Message::Sessions { ip, epoch: 3, upserts: vec![rec(1, 0)], removes: vec![] }, t0);
        // After the snapshot: port 5 created, port 2 refreshed (idle 0), port 3 removed.
        let inc =
            Message::Sessions { ip, epoch: 0, upserts: vec![rec(5, 0), rec(2, 0)], removes: vec![rec(3, 9).key()] };
        s.on_message("gw-1", inc, t0);
        // The rest of the snapshot: older records of ports 2 and 3.
        s.on_message(
            "gw-1",
            Message::Sessions { ip, epoch: 3, upserts: vec![rec(2, 9), rec(3, 9), rec(4, 9)], removes: vec![] },
            t0,
        );
        let ack = s.on_message("gw-1", Message::FullEnd { ip, epoch: 3, count: 4 }, t0);
        assert_eq!(ack, Some(Message::SyncAck { ip, epoch: 3 }), "every record of the copy arrived");
        let (_, mut got) = s.take(ip, t0).unwrap();
        got.sort_by_key(|r| r.pod_port);
        assert_eq!(got, vec![rec(1, 0), rec(2, 0), rec(4, 9), rec(5, 0)]);
    }

    /// Review finding 8: a peer's bug (or a compromised peer) sending
    /// copies for ever more IPs made the standby keep a shadow for each.
    #[test]
    fn the_number_of_shadows_is_bounded_and_refusals_are_counted() {
        let t0 = Instant::now();
        let mut s = Standby::with_limits(100, 2);
        let ips: Vec<IpAddr> = (10..13).map(|i| IpAddr::from([198, 51, 100, i])).collect();
        for ip in &ips {
            s.on_message("gw-1", Message::FullBegin { ip: *ip, epoch: 1 }, t0);
        }
        assert_eq!(s.status(t0).iter().map(|st| st.ip).collect::<Vec<_>>(), ips[..2].to_vec());
        assert_eq!(s.shadows_refused, 1);
        // Its other messages are dropped too, and nothing is acknowledged.
        let ip = ips[2];
        s.on_message("gw-1", Message::Sessions { ip, epoch: 1, upserts: vec![], removes: vec![] }, t0);
        assert_eq!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 1, count: 0 }, t0), None);
        assert_eq!((s.status(t0).len(), s.shadows_refused), (2, 3));
        // The IPs it has still work; once one is dropped, a new one fits.
        assert!(s.on_message("gw-1", Message::FullEnd { ip: ips[0], epoch: 1, count: 0 }, t0).is_some());
        s.on_message("gw-1", Message::DropShadow { ip: ips[1] }, t0);
        s.on_message("gw-1", Message::FullBegin { ip, epoch: 2 }, t0);
        assert!(s.on_message("gw-1", Message::FullEnd { ip, epoch: 2, count: 0 }, t0).is_some());
    }

    #[test]
    fn records_of_another_egress_ip_are_not_kept() {
        let t0 = Instant::now();
        let ip: IpAddr = "198.51.100.11".parse().unwrap();
        let mut s = Standby::new(10);
        // rec() translates to 198.51.100.10, not to the message's IP.
        s.on_message("gw-1", Message::Sessions { ip, epoch: 0, upserts: vec![rec(1, 0)], removes: vec![] }, t0);
        assert_eq!(s.sessions(), 0);
    }
}
