//! Gateway liveness Leases (issue 28 §4, ADR 0016): one Lease per gateway
//! renewed every `retryPeriod`, instead of one renewal per held egress IP.
//!
//! Each gateway renews `egret-gw-<node>` ([`liveness_lease_name`]), whose
//! annotation [`EPOCH_ANNOTATION`] carries its *epoch*: a number that grows
//! by one each time the gateway takes the Lease afresh (a new process, or
//! after losing it), so that a gateway's epochs are ordered. An egress IP's
//! record (its own Lease, `lease.rs`) then names the holder and the epoch
//! it was written under, and is written only when ownership changes. Like
//! the rest of the state machines here, this module does no I/O and reads
//! no clock.
//!
//! Rules, with D = leaseDuration and R = renewDeadline:
//!
//! - **The holder** counts from the *send* time S of its last successful
//!   write of its own liveness Lease (every write is conditional on the
//!   `resourceVersion` it last saw): every IP whose record names it with
//!   its current epoch is valid until S + R ([`Liveness::base`]).
//! - **A taker** may rewrite an IP record whose holder's liveness Lease it
//!   observed unchanged for D only after *expiring* that Lease: a write
//!   clearing its holder, conditional on the `resourceVersion` it observed
//!   ([`LivenessAction::Expire`]). A record counts as void only once its
//!   holder's liveness Lease, as seen, has moved past the record's epoch
//!   or names nobody at that epoch ([`HolderLiveness::Void`]). A record of
//!   an epoch later than the liveness Lease seen means this gateway's view
//!   lags ([`HolderLiveness::Ahead`]): nothing is decided until it catches
//!   up. (Found by the simulation in `liveness_sim.rs`: a taker whose watch
//!   still showed the expired Lease read a record the holder had just
//!   rewritten under its next epoch as void, and took it.)
//! - **Why the write**: the taker's view of the liveness Lease may lag (a
//!   slow watch). Without the write, a holder that renewed at S' after the
//!   version the taker saw would serve until S' + R while the taker, whose
//!   rewrite of the IP record is conditional only on the *record's*
//!   version (which the renewal did not touch), took the IP at S + D: two
//!   owners as soon as S' - S exceeds the margin D - R. With it, the
//!   expiry and any later renewal are both conditional on the liveness
//!   Lease's version, so exactly one succeeds: if the expiry does, the
//!   holder's last success was the version the taker saw, sent at S, and
//!   the expiry was written at or after S + D, when the holder's IPs had
//!   stopped at S + R; if the renewal does, the expiry fails (409).
//! - **A holder that lost its Lease** (a renewal refused with 409 or 404,
//!   or the watch showing it cleared) takes the next epoch, but not before
//!   its last base + renewDeadline (a Lease deleted by hand gives no
//!   margin of its own): its old records are void to everyone, and it
//!   serves an IP again only after rewriting the IP's record (conditional
//!   on the record's version) under the new epoch.
//! - **An absent liveness Lease** (deleted by hand): its holder's renewals
//!   fail (404), so its records count as expired D after the absence was
//!   first seen, as an unrenewed per-IP record would.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use tokio::time::Instant;

use super::lease::{Failure, LeaseRecord, LeaseTiming};

/// The annotation carrying an epoch: on a liveness Lease, its gateway's
/// current epoch; on an egress IP's record, the holder's epoch when it
/// wrote the record.
pub const EPOCH_ANNOTATION: &str = "egret.dev/epoch";

/// The annotation a gateway writes into another gateway's liveness Lease
/// when it expires it: the expirer's name, for `kubectl describe`.
pub const EXPIRED_BY_ANNOTATION: &str = "egret.dev/expired-by";

/// The annotation naming the gateway a liveness Lease belongs to (its
/// holder is cleared when a peer expires it).
pub const GATEWAY_ANNOTATION: &str = "egret.dev/gateway";

/// `leaseDurationSeconds` of an egress IP's record written under an epoch.
/// Such a record is never renewed; a gateway of an earlier version (which
/// renews per IP and judges a record by its own renewals) must never count
/// it as expired, and with this duration it does not: it takes the record
/// only once released or its holder proven dead. Gateways of this version
/// ignore the field for records with an epoch.
pub const RECORD_DURATION_SECS: i32 = i32::MAX;

/// The name prefix of the gateways' liveness Leases.
pub const LIVENESS_PREFIX: &str = "egret-gw-";

/// The liveness Lease name of gateway `node`: `egret-gw-<node>`. Node
/// names are DNS subdomains of at most 253 characters, as Lease names
/// must be; a name too long for the prefix keeps its first 235
/// characters and adds 16 hex digits of a hash of the whole name.
pub fn liveness_lease_name(node: &str) -> String {
    let full = format!("{LIVENESS_PREFIX}{node}");
    if full.len() <= 253 {
        return full;
    }
    // FNV-1a: stable across builds and platforms (the name is shared by
    // every gateway).
    let h = node.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3));
    let head: String = node.chars().take(253 - LIVENESS_PREFIX.len() - 17).collect();
    format!("{LIVENESS_PREFIX}{}-{h:016x}", head.trim_end_matches(['-', '.']))
}

/// The node a liveness Lease name belongs to (None: not a liveness Lease,
/// or a hashed name, which [`Liveness::observe`]'s callers match by the
/// Lease's holder instead).
pub fn liveness_node(lease_name: &str) -> Option<&str> {
    lease_name.strip_prefix(LIVENESS_PREFIX).filter(|n| !n.is_empty())
}

/// A write to a liveness Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LivenessAction {
    /// Create this gateway's Lease (not seen yet), with its epoch.
    Create {
        /// The epoch to write.
        epoch: u64,
    },
    /// Take this gateway's Lease (written by a previous process, or
    /// expired by a peer) under a new epoch, on `resource_version`.
    Acquire {
        /// Precondition.
        resource_version: String,
        /// The epoch to write.
        epoch: u64,
        /// `leaseTransitions` after this change.
        transitions: i32,
    },
    /// Renew this gateway's Lease, on `resource_version`.
    Renew {
        /// Precondition.
        resource_version: String,
    },
    /// Clear another gateway's Lease (it was observed unchanged for
    /// leaseDuration), on the `resource_version` observed.
    Expire {
        /// The gateway whose Lease it is.
        holder: String,
        /// Precondition.
        resource_version: String,
        /// `leaseTransitions` after this change.
        transitions: i32,
    },
}

/// How the records of a holder written under one epoch stand, by this
/// gateway's view of the holder's liveness Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HolderLiveness {
    /// Its liveness Lease names it under that epoch; unless renewed, it
    /// may be expired ([`LivenessAction::Expire`] on `resource_version`)
    /// from `expires_at` on.
    Live {
        /// leaseDuration after the last change was observed.
        expires_at: Instant,
        /// The version observed.
        resource_version: String,
        /// Its `leaseTransitions`.
        transitions: i32,
    },
    /// Its liveness Lease has moved past that epoch, or names nobody at
    /// it, since `since` (observed): it serves none of those records.
    Void {
        /// When this gateway saw it.
        since: Instant,
    },
    /// The record's epoch is later than the liveness Lease seen: this
    /// gateway's watch lags; wait for it.
    Ahead,
    /// No liveness Lease of the holder seen since `since`: its records
    /// expire leaseDuration after that.
    Absent {
        /// When this gateway first missed it.
        since: Instant,
    },
}

/// What became of this gateway's own liveness write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OwnOutcome {
    /// Written: every record under the current epoch is valid until
    /// `sent` + renewDeadline.
    Renewed {
        /// The write's send time.
        sent: Instant,
    },
    /// The Lease was expired by a peer or deleted: a new epoch is taken,
    /// and no record of the old one is served any more.
    Lost,
    /// Not written (no API server, or the Lease not known yet): retried.
    Failed,
}

#[derive(Clone, Debug)]
struct Seen {
    record: Option<LeaseRecord>,
    observed_at: Instant,
    /// When this gateway first saw it name its gateway under its current
    /// epoch (None: it names nobody, or was never seen).
    live_since: Option<Instant>,
    /// When this gateway last saw an IP's record come to name it (a
    /// create or a take): it is working through its IPs.
    took_at: Option<Instant>,
}

impl Seen {
    fn unseen(now: Instant) -> Self {
        Seen { record: None, observed_at: now, live_since: None, took_at: None }
    }
}

/// The liveness Leases as one gateway sees and writes them.
#[derive(Debug)]
pub struct Liveness {
    me: String,
    timing: LeaseTiming,
    epoch: u64,
    /// Our own Lease as last seen (the watch, or our writes' answers).
    own: Option<LeaseRecord>,
    /// Send time of the last successful write of our own Lease under the
    /// current epoch.
    base: Option<Instant>,
    own_in_flight: bool,
    own_next: Instant,
    /// When this gateway started following liveness Leases.
    started: Instant,
    /// The other gateways' Leases.
    others: BTreeMap<String, Seen>,
    /// Expiries in flight, per gateway.
    expiring: BTreeSet<String>,
    /// Times this gateway lost its Lease (a peer expired it, or it was
    /// deleted).
    pub lost: u64,
    /// Expiries of other gateways' Leases written by this gateway.
    pub expired: u64,
}

impl Liveness {
    /// The liveness of gateway `me`, starting at `epoch` (pick one a
    /// restarted process cannot repeat: the peer channel's incarnation).
    /// The first epoch is one more than the Lease's (read before it is
    /// taken), or 1 for a Lease this gateway creates.
    pub fn new(me: impl Into<String>, timing: LeaseTiming, now: Instant) -> Self {
        Liveness {
            me: me.into(),
            timing,
            epoch: 0,
            own: None,
            base: None,
            own_in_flight: false,
            own_next: now,
            started: now,
            others: BTreeMap::new(),
            expiring: BTreeSet::new(),
            lost: 0,
            expired: 0,
        }
    }

    /// This gateway's current epoch: what its records carry (0: none
    /// taken yet).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The send time of the last successful write of our own Lease under
    /// the current epoch, while it is still valid at `now` (before it +
    /// renewDeadline): what every record of the current epoch is valid
    /// from. None: nothing may be served or taken.
    pub fn base(&self, now: Instant) -> Option<Instant> {
        self.base.filter(|b| now < *b + self.timing.renew_deadline)
    }

    /// The send time of the last successful write of our own Lease under
    /// the current epoch, valid or not.
    pub fn last_written(&self) -> Option<Instant> {
        self.base
    }

    /// Our own Lease as last seen.
    pub fn own(&self) -> Option<&LeaseRecord> {
        self.own.as_ref()
    }

    /// Feeds a liveness Lease of gateway `node` as the watch shows it
    /// (None: absent). Returns [`OwnOutcome::Lost`] when it is ours and now
    /// names another epoch or nobody while we had it.
    pub fn observe(&mut self, node: &str, record: Option<LeaseRecord>, now: Instant) -> Option<OwnOutcome> {
        if node == self.me {
            return self.observe_own(record, now);
        }
        let seen = self.others.entry(node.to_string()).or_insert(Seen::unseen(now));
        let changed = match (&seen.record, &record) {
            (None, None) => false,
            (Some(old), Some(new)) => newer(new, old),
            _ => true,
        };
        if changed {
            let live =
                |r: &Option<LeaseRecord>| r.as_ref().filter(|r| r.holder.as_deref() == Some(node)).map(|r| r.epoch);
            let (was, is) = (live(&seen.record), live(&record));
            seen.live_since = match (was, is) {
                (_, None) => None,
                (Some(a), Some(b)) if a == b => seen.live_since,
                _ => Some(now),
            };
            seen.record = record;
            seen.observed_at = now;
        }
        None
    }

    /// When this gateway first saw `node`'s liveness Lease name it under
    /// its current epoch (None: not live as seen, or this gateway). A
    /// candidate ranked below it counts its stagger for a free IP from
    /// then: at a cold start the preferred gateway, whose Lease may be
    /// written later than another's, still gets the first turn.
    pub fn live_since(&self, node: &str) -> Option<Instant> {
        self.others.get(node)?.live_since
    }

    /// Notes that an IP's record came to name `holder` at `now` (it was
    /// created or taken by it).
    pub fn note_take(&mut self, holder: &str, now: Instant) {
        if holder != self.me {
            self.others.entry(holder.to_string()).or_insert(Seen::unseen(now)).took_at = Some(now);
        }
    }

    /// When this gateway last saw an IP's record come to name `node` (None:
    /// never, or this gateway). See [`Liveness::note_take`].
    pub fn took_at(&self, node: &str) -> Option<Instant> {
        self.others.get(node)?.took_at
    }

    fn observe_own(&mut self, record: Option<LeaseRecord>, now: Instant) -> Option<OwnOutcome> {
        let Some(new) = record else {
            // The watch lags our own create; a real deletion shows as 404
            // on the next renewal.
            return None;
        };
        if self.own.as_ref().is_some_and(|old| !newer(&new, old)) {
            return None;
        }
        let ours = self.names_us(&new);
        self.own = Some(new);
        if !ours && self.base.is_some() {
            self.lose(now);
            return Some(OwnOutcome::Lost);
        }
        None
    }

    fn names_us(&self, r: &LeaseRecord) -> bool {
        r.holder.as_deref() == Some(self.me.as_str()) && r.epoch == Some(self.epoch)
    }

    fn lose(&mut self, now: Instant) {
        // The next epoch only once the old one's records stopped here.
        self.own_next = self.base.map_or(now, |b| now.max(b + self.timing.renew_deadline));
        self.base = None;
        self.lost += 1;
    }

    /// The epoch the next take of our own Lease writes: one more than any
    /// seen.
    fn next_epoch(&self) -> u64 {
        self.own.as_ref().and_then(|r| r.epoch).unwrap_or(0).max(self.epoch) + 1
    }

    /// The write of our own Lease due at `now` (None: one is in flight or
    /// not due yet), marked in flight, and when the next is due.
    pub fn plan_own(&mut self, now: Instant) -> (Option<LivenessAction>, Instant) {
        if self.own_in_flight {
            return (None, now + self.timing.retry_period);
        }
        if now < self.own_next {
            return (None, self.own_next);
        }
        let action = match &self.own {
            None => LivenessAction::Create { epoch: self.next_epoch() },
            Some(r) if self.names_us(r) && self.base.is_some() => {
                LivenessAction::Renew { resource_version: r.resource_version.clone() }
            }
            Some(r) => LivenessAction::Acquire {
                resource_version: r.resource_version.clone(),
                epoch: self.next_epoch(),
                transitions: r.transitions + i32::from(r.holder.as_deref() != Some(self.me.as_str())),
            },
        };
        self.own_in_flight = true;
        (Some(action), now + self.timing.retry_period)
    }

    /// Records the outcome of our own write sent at `sent`; `fresh` is the
    /// Lease as the API server had it after a conflict.
    pub fn on_own_result(
        &mut self,
        action: &LivenessAction,
        sent: Instant,
        result: Result<Option<LeaseRecord>, Failure>,
        fresh: Option<LeaseRecord>,
        now: Instant,
    ) -> OwnOutcome {
        self.own_in_flight = false;
        match result {
            Ok(Some(r)) => {
                if let LivenessAction::Create { epoch } | LivenessAction::Acquire { epoch, .. } = action {
                    self.epoch = *epoch;
                }
                self.own = Some(r);
                self.base = Some(sent);
                self.own_next = sent + self.timing.retry_period;
                OwnOutcome::Renewed { sent }
            }
            Ok(None) | Err(Failure::Other(_)) => {
                self.own_next = now + self.timing.retry_period;
                OwnOutcome::Failed
            }
            Err(Failure::NotFound) => {
                self.own = None;
                if self.base.is_some() {
                    self.lose(now);
                    return OwnOutcome::Lost;
                }
                self.own_next = now;
                OwnOutcome::Failed
            }
            Err(Failure::Conflict) => {
                self.own_next = now + self.timing.retry_period;
                let Some(fresh) = fresh else { return OwnOutcome::Failed };
                // Our own write whose answer was lost may have landed: a
                // record naming us under our epoch is ours (its send time
                // is unknown, so the base stays where it was).
                if matches!(action, LivenessAction::Renew { .. }) && !self.names_us(&fresh) && self.base.is_some() {
                    self.own = Some(fresh);
                    self.lose(now);
                    return OwnOutcome::Lost;
                }
                self.own = Some(fresh);
                self.own_next = now;
                OwnOutcome::Failed
            }
        }
    }

    /// Notes every gateway named by an IP record, so that one whose
    /// liveness Lease was never seen counts as absent from `now`.
    pub fn note_holders<'a>(&mut self, holders: impl IntoIterator<Item = &'a str>, now: Instant) {
        for h in holders {
            if h != self.me {
                self.others.entry(h.to_string()).or_insert(Seen::unseen(now));
            }
        }
    }

    /// How records of `holder` written under `epoch` stand (None: the
    /// holder is this gateway, or was never noted).
    pub fn holder(&self, holder: &str, epoch: u64) -> Option<HolderLiveness> {
        let seen = self.others.get(holder)?;
        let Some(r) = &seen.record else { return Some(HolderLiveness::Absent { since: seen.observed_at }) };
        let seen_epoch = r.epoch.unwrap_or(0);
        Some(match epoch.cmp(&seen_epoch) {
            std::cmp::Ordering::Greater => HolderLiveness::Ahead,
            std::cmp::Ordering::Equal if r.holder.as_deref() == Some(holder) => HolderLiveness::Live {
                expires_at: seen.observed_at + self.timing.expiry(r),
                resource_version: r.resource_version.clone(),
                transitions: r.transitions,
            },
            _ => HolderLiveness::Void { since: seen.observed_at },
        })
    }

    /// When this gateway started following liveness Leases.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The Lease of gateway `node` as last seen (another gateway's).
    pub fn seen(&self, node: &str) -> Option<&LeaseRecord> {
        self.others.get(node)?.record.as_ref()
    }

    /// The gateways whose liveness Lease this gateway follows (seen, or
    /// named by a record).
    pub fn known(&self) -> impl Iterator<Item = &str> {
        self.others.keys().map(String::as_str)
    }

    /// Whether an expiry of `holder`'s Lease is in flight.
    pub fn expiring(&self, holder: &str) -> bool {
        self.expiring.contains(holder)
    }

    /// Marks an expiry of `holder`'s Lease in flight.
    pub fn expire_sent(&mut self, holder: &str) {
        self.expiring.insert(holder.to_string());
    }

    /// Records the outcome of an expiry of `holder`'s Lease: the answer
    /// (or, after a conflict, the Lease as the API server has it) is the
    /// newest view of it.
    pub fn on_expire_result(
        &mut self,
        holder: &str,
        result: Result<Option<LeaseRecord>, Failure>,
        fresh: Option<LeaseRecord>,
        now: Instant,
    ) {
        self.expiring.remove(holder);
        match result {
            Ok(Some(r)) => {
                self.expired += 1;
                self.observe(holder, Some(r), now);
            }
            Err(Failure::NotFound) => {
                self.observe(holder, None, now);
            }
            Err(Failure::Conflict) => {
                if let Some(r) = fresh {
                    self.observe(holder, Some(r), now);
                }
            }
            Ok(None) | Err(Failure::Other(_)) => {}
        }
    }

    /// How long after its last observed change a holder's Lease counts as
    /// expired by this gateway ([`LeaseTiming::expiry`]).
    pub fn timing(&self) -> LeaseTiming {
        self.timing
    }
}

fn newer(a: &LeaseRecord, b: &LeaseRecord) -> bool {
    match (a.resource_version.parse::<u64>(), b.resource_version.parse::<u64>()) {
        (Ok(x), Ok(y)) => x > y,
        _ => a.resource_version != b.resource_version,
    }
}

/// The instant a record of a holder becomes free by its liveness, before
/// the stagger, promises and Patroni's rule: `Live` needs an expiry first
/// (None: `Ahead`, not decided).
pub fn free_from(h: &HolderLiveness, lease_duration: Duration) -> Option<Instant> {
    match h {
        HolderLiveness::Live { expires_at, .. } => Some(*expires_at),
        HolderLiveness::Void { since } => Some(*since),
        HolderLiveness::Absent { since } => Some(*since + lease_duration),
        HolderLiveness::Ahead => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn t() -> LeaseTiming {
        LeaseTiming::default()
    }

    fn rec(holder: Option<&str>, epoch: u64, rv: u64) -> LeaseRecord {
        LeaseRecord {
            holder: holder.map(str::to_string),
            epoch: Some(epoch),
            duration: Duration::from_secs(4),
            resource_version: rv.to_string(),
            ..Default::default()
        }
    }

    #[test]
    fn names_fit_a_lease_name_and_are_stable() {
        assert_eq!(liveness_lease_name("gw-1"), "egret-gw-gw-1");
        assert_eq!(liveness_node("egret-gw-gw-1"), Some("gw-1"));
        assert_eq!(liveness_node("egret-ip4-1-2-3-4"), None);
        let long = "a".repeat(253);
        let n = liveness_lease_name(&long);
        assert!(n.len() <= 253, "{}", n.len());
        assert_eq!(n, liveness_lease_name(&long));
        assert_ne!(n, liveness_lease_name(&"b".repeat(253)));
    }

    #[test]
    fn the_first_write_creates_then_renewals_follow_and_set_the_base() {
        let t0 = Instant::now();
        let mut l = Liveness::new("gw-1", t(), t0);
        let (a, _) = l.plan_own(t0);
        assert_eq!(a, Some(LivenessAction::Create { epoch: 1 }));
        assert_eq!(l.plan_own(t0).0, None, "one in flight");
        let out = l.on_own_result(&a.unwrap(), t0, Ok(Some(rec(Some("gw-1"), 1, 10))), None, t0);
        assert_eq!(out, OwnOutcome::Renewed { sent: t0 });
        assert_eq!(l.epoch(), 1);
        assert_eq!(l.base(t0), Some(t0));
        assert_eq!(l.base(t0 + t().renew_deadline), None, "valid until base + R only");
        let r = t0 + t().retry_period;
        assert_eq!(l.plan_own(r).0, Some(LivenessAction::Renew { resource_version: "10".into() }));
    }

    #[test]
    fn a_lease_left_by_a_previous_process_is_acquired_under_the_next_epoch() {
        let t0 = Instant::now();
        let mut l = Liveness::new("gw-1", t(), t0);
        assert_eq!(l.observe("gw-1", Some(rec(Some("gw-1"), 3, 5)), t0), None, "nothing to lose yet");
        assert_eq!(
            l.plan_own(t0).0,
            Some(LivenessAction::Acquire { resource_version: "5".into(), epoch: 4, transitions: 0 })
        );
        // A create that meets the Lease learns it from the conflict.
        let mut l = Liveness::new("gw-1", t(), t0);
        let (a, _) = l.plan_own(t0);
        l.on_own_result(&a.unwrap(), t0, Err(Failure::Conflict), Some(rec(Some("gw-1"), 8, 6)), t0);
        assert!(matches!(l.plan_own(t0).0, Some(LivenessAction::Acquire { epoch: 9, .. })));
    }

    #[test]
    fn an_expiry_by_a_peer_loses_the_epoch_and_the_next_waits_for_the_old_deadline() {
        let t0 = Instant::now();
        let r = t().renew_deadline;
        let mut l = Liveness::new("gw-1", t(), t0);
        let (a, _) = l.plan_own(t0);
        l.on_own_result(&a.unwrap(), t0, Ok(Some(rec(Some("gw-1"), 1, 10))), None, t0);
        // A renewal refused: the Lease was cleared by gw-2.
        let t1 = t0 + t().retry_period;
        let (a, _) = l.plan_own(t1);
        let out = l.on_own_result(&a.unwrap(), t1, Err(Failure::Conflict), Some(rec(None, 1, 11)), t1);
        assert_eq!(out, OwnOutcome::Lost);
        assert_eq!(l.base(t1), None);
        assert_eq!(l.plan_own(t1).0, None, "not before the old base + R");
        assert!(matches!(l.plan_own(t0 + r).0, Some(LivenessAction::Acquire { epoch: 2, .. })));
        // Through the watch instead.
        let mut l = Liveness::new("gw-1", t(), t0);
        let (a, _) = l.plan_own(t0);
        l.on_own_result(&a.unwrap(), t0, Ok(Some(rec(Some("gw-1"), 1, 10))), None, t0);
        assert_eq!(l.observe("gw-1", Some(rec(None, 1, 11)), t1), Some(OwnOutcome::Lost));
        assert!(matches!(l.plan_own(t0 + r).0, Some(LivenessAction::Acquire { epoch: 2, .. })));
    }

    #[test]
    fn a_conflict_with_our_own_landed_write_is_not_a_loss() {
        let t0 = Instant::now();
        let mut l = Liveness::new("gw-1", t(), t0);
        let (a, _) = l.plan_own(t0);
        l.on_own_result(&a.unwrap(), t0, Ok(Some(rec(Some("gw-1"), 1, 10))), None, t0);
        let (a, _) = l.plan_own(t0 + t().retry_period);
        let out = l.on_own_result(&a.unwrap(), t0, Err(Failure::Conflict), Some(rec(Some("gw-1"), 1, 12)), t0);
        assert_eq!(out, OwnOutcome::Failed);
        assert_eq!(l.base(t0), Some(t0), "the base stays");
        assert_eq!(l.plan_own(t0).0, Some(LivenessAction::Renew { resource_version: "12".into() }));
    }

    #[test]
    fn a_holder_is_live_until_unchanged_for_the_duration_then_void_once_expired() {
        let t0 = Instant::now();
        let mut l = Liveness::new("gw-1", t(), t0);
        l.observe("gw-2", Some(rec(Some("gw-2"), 5, 20)), t0);
        let d = t().lease_duration;
        assert_eq!(
            l.holder("gw-2", 5),
            Some(HolderLiveness::Live { expires_at: t0 + d, resource_version: "20".into(), transitions: 0 })
        );
        assert_eq!(l.holder("gw-2", 4), Some(HolderLiveness::Void { since: t0 }), "an earlier epoch");
        assert_eq!(l.holder("gw-2", 6), Some(HolderLiveness::Ahead), "a later epoch: our view lags");
        let t1 = t0 + Duration::from_secs(1);
        l.observe("gw-2", Some(rec(Some("gw-2"), 5, 21)), t1);
        assert!(matches!(l.holder("gw-2", 5), Some(HolderLiveness::Live { expires_at, .. }) if expires_at == t1 + d));
        // An older version seen late changes nothing.
        l.observe("gw-2", Some(rec(Some("gw-2"), 5, 20)), t1 + d);
        assert!(matches!(l.holder("gw-2", 5), Some(HolderLiveness::Live { expires_at, .. }) if expires_at == t1 + d));
        l.expire_sent("gw-2");
        assert!(l.expiring("gw-2"));
        l.on_expire_result("gw-2", Ok(Some(rec(None, 5, 22))), None, t1 + d);
        assert!(!l.expiring("gw-2"));
        assert_eq!(l.holder("gw-2", 5), Some(HolderLiveness::Void { since: t1 + d }));
        assert_eq!(l.holder("gw-2", 6), Some(HolderLiveness::Ahead), "its next epoch is not void");
        assert_eq!(l.expired, 1);
    }

    #[test]
    fn a_holder_never_seen_is_absent_from_when_it_was_noted() {
        let t0 = Instant::now();
        let mut l = Liveness::new("gw-1", t(), t0);
        assert_eq!(l.holder("gw-3", 1), None);
        l.note_holders(["gw-3", "gw-1"], t0);
        assert_eq!(l.holder("gw-3", 1), Some(HolderLiveness::Absent { since: t0 }));
        assert_eq!(l.holder("gw-1", 1), None, "ourselves");
        assert_eq!(free_from(&HolderLiveness::Absent { since: t0 }, t().lease_duration), Some(t0 + t().lease_duration));
    }
}
