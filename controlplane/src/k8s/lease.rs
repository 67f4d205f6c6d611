//! One owner per egress IP: the Lease state machine.
//!
//! Every egress IP in use has one `coordination.k8s.io/v1` Lease in the
//! configured namespace, named after the IP ([`lease_name`]). The gateways
//! eligible for the IP compete for it; this module decides, for one gateway,
//! what to do about each Lease. It does no I/O and reads no clock: the
//! controller passes `now` (a monotonic [`Instant`]) and carries out the
//! [`Action`]s, so every rule below is tested without a cluster.
//!
//! ```text
//!             (candidate; absent/released: after rank x retryPeriod;
//!              held by another: after it expired by OUR clock + rank x retryPeriod)
//!   Idle ----------------- Create / Acquire ok ----------------------> Held
//!    ^                                                                 |  |
//!    |   renew ok at t_send: deadline = t_send + renewDeadline  <------+  |
//!    |                                                                    |
//!    +---- deadline passed (no renew ok) / someone else's record / ---- Fenced
//!          no longer a candidate: removed from the tables FIRST,         |
//!          then (if still ours on the server) Release                    |
//!                                                                        |
//!   deadline passed, the Lease still ours, still a candidate: Dormant ---+
//!   (in the tables with its sessions, served by nothing; taken back at
//!    once -> Held; someone else's record / released / 404 / no longer a
//!    candidate -> out of the tables; ADR 0018)
//! ```
//!
//! Safety (never two gateways serving one IP), with D = leaseDuration,
//! R = renewDeadline:
//! - The holder counts its validity from the moment it *sent* its last
//!   successful renewal, t_send, and stops serving the IP at t_send + R (the
//!   controller applies tables without the IP at that instant, before any
//!   further API call).
//! - Another gateway counts expiry from the moment it *observed* the record
//!   change, which is after the server accepted the renewal, so after
//!   t_send; it takes over no earlier than t_send + D.
//! - A take-over is a replace with the observed `resourceVersion`: if the
//!   holder renewed after the record the taker saw, the API server refuses
//!   it (409). So the taker's record is the holder's latest success.
//! - Hence the margin D - R (2 s with the defaults 4 s / 2 s) covers the
//!   holder's apply latency and timer slack; clocks are never compared
//!   across machines, only rates (drift is negligible over seconds).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use super::liveness::{free_from, HolderLiveness, Liveness, LivenessAction, OwnOutcome};

/// Timing of Leases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTiming {
    /// How long a Lease is valid after a renewal, as others see it (D).
    pub lease_duration: Duration,
    /// The holder stops serving an IP this long after its last successful
    /// renewal was sent (R < D).
    pub renew_deadline: Duration,
    /// How often the holder renews; also the back-off and the take-over
    /// stagger between ranked candidates.
    pub retry_period: Duration,
}

impl Default for LeaseTiming {
    fn default() -> Self {
        LeaseTiming {
            lease_duration: Duration::from_secs(4),
            renew_deadline: Duration::from_secs(2),
            retry_period: Duration::from_millis(500),
        }
    }
}

/// The smallest fencing margin (leaseDuration - renewDeadline) accepted.
pub const MIN_FENCING_MARGIN: Duration = Duration::from_millis(500);

/// Timing that cannot be safe.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// The margin between the holder's fencing and others' take-over is too small.
    #[error("kubernetes.leaseDuration ({lease_duration:?}) must exceed kubernetes.renewDeadline ({renew_deadline:?}) by at least {MIN_FENCING_MARGIN:?} (the fencing margin)")]
    MarginTooSmall {
        /// Configured lease duration.
        lease_duration: Duration,
        /// Configured renew deadline.
        renew_deadline: Duration,
    },
    /// Renewing no more often than the deadline leaves no retry.
    #[error(
        "kubernetes.retryPeriod ({retry_period:?}) must be shorter than kubernetes.renewDeadline ({renew_deadline:?})"
    )]
    RetryTooSlow {
        /// Configured retry period.
        retry_period: Duration,
        /// Configured renew deadline.
        renew_deadline: Duration,
    },
    /// Lease durations are whole seconds on the wire.
    #[error("kubernetes.leaseDuration ({lease_duration:?}) must be a whole number of seconds, at least 1 s (Lease.spec.leaseDurationSeconds)")]
    NotWholeSeconds {
        /// Configured lease duration.
        lease_duration: Duration,
    },
    /// A zero duration.
    #[error("kubernetes.retryPeriod must be above zero")]
    ZeroRetry,
}

impl LeaseTiming {
    /// Checks that the timing keeps the fencing margin.
    pub fn validate(&self) -> Result<(), TimingError> {
        if self.lease_duration.subsec_nanos() != 0 || self.lease_duration.is_zero() {
            return Err(TimingError::NotWholeSeconds { lease_duration: self.lease_duration });
        }
        if self.retry_period.is_zero() {
            return Err(TimingError::ZeroRetry);
        }
        if self.lease_duration < self.renew_deadline + MIN_FENCING_MARGIN {
            return Err(TimingError::MarginTooSmall {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
            });
        }
        if self.retry_period >= self.renew_deadline {
            return Err(TimingError::RetryTooSlow {
                retry_period: self.retry_period,
                renew_deadline: self.renew_deadline,
            });
        }
        Ok(())
    }

    /// The fencing margin: how long before others may take an IP the holder
    /// has already stopped serving it.
    pub fn margin(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_deadline)
    }

    /// How long a better-ranked candidate's work on other IPs may delay a
    /// free IP's turn past when this gateway first saw it free (four
    /// leaseDurations; see `better_candidates_turn`).
    pub fn busy_cap(&self) -> Duration {
        self.lease_duration * 4
    }

    /// How long after its last observed renewal a record held by another
    /// gateway stays valid: the larger of its `leaseDurationSeconds` and our
    /// own `leaseDuration`. A record without the field, or with a negative
    /// or zero one (read as 0 by `observe::lease_record`), would otherwise
    /// be free at once; a holder configured with a longer duration than ours
    /// fences later than we would, so its duration counts.
    pub fn expiry(&self, record: &LeaseRecord) -> Duration {
        record.duration.max(self.lease_duration)
    }
}

/// The Lease name of an egress IP: `egret-ip4-198-51-100-10`, or for IPv6
/// the eight zero-padded groups, `egret-ip6-2001-0db8-0000-...-0001`.
pub fn lease_name(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(a) => {
            let o = a.octets();
            format!("egret-ip4-{}-{}-{}-{}", o[0], o[1], o[2], o[3])
        }
        IpAddr::V6(a) => {
            let g: Vec<String> = a.segments().iter().map(|s| format!("{s:04x}")).collect();
            format!("egret-ip6-{}", g.join("-"))
        }
    }
}

/// One of a Lease's `metadata.ownerReferences`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    /// `apiVersion`.
    pub api_version: String,
    /// `kind`.
    pub kind: String,
    /// `name`.
    pub name: String,
    /// `uid`.
    pub uid: String,
    /// `controller`.
    pub controller: Option<bool>,
    /// `blockOwnerDeletion`.
    pub block_owner_deletion: Option<bool>,
}

impl From<&OwnerReference> for Owner {
    fn from(r: &OwnerReference) -> Self {
        Owner {
            api_version: r.api_version.clone(),
            kind: r.kind.clone(),
            name: r.name.clone(),
            uid: r.uid.clone(),
            controller: r.controller,
            block_owner_deletion: r.block_owner_deletion,
        }
    }
}

impl From<&Owner> for OwnerReference {
    fn from(o: &Owner) -> Self {
        OwnerReference {
            api_version: o.api_version.clone(),
            kind: o.kind.clone(),
            name: o.name.clone(),
            uid: o.uid.clone(),
            controller: o.controller,
            block_owner_deletion: o.block_owner_deletion,
        }
    }
}

/// The parts of a Lease this machine looks at.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseRecord {
    /// `metadata.ownerReferences`, kept on every write (the gateway
    /// DaemonSets', k8s/uninstall.rs).
    pub owners: Vec<Owner>,
    /// `holderIdentity` (None or empty: released).
    pub holder: Option<String>,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
    /// `metadata.resourceVersion`.
    pub resource_version: String,
    /// `leaseTransitions`.
    pub transitions: i32,
    /// `acquireTime` (wall clock, for status only).
    pub acquire_time: Option<Timestamp>,
    /// `renewTime` (wall clock, for status only).
    pub renew_time: Option<Timestamp>,
    /// The gateways the holder asks before it keeps the IP through an API
    /// outage (annotation [`FAILSAFE_ANNOTATION`]; None: the holder runs
    /// without the peer channel). Only they may take the Lease over once it
    /// expired, while one of them is still there: see [`LeaseManager::plan`].
    pub failsafe: Option<BTreeSet<String>>,
    /// The holder process's channel incarnation (annotation
    /// [`INCARNATION_ANNOTATION`]): a proof of death names the process it
    /// is about, and only that process's records are freed by it.
    pub incarnation: Option<u64>,
    /// The gateway holding the holder's session copy when it last wrote
    /// the Lease (annotation [`STANDBY_ANNOTATION`]): takers go by
    /// preference, but one without a copy defers to this standby while it
    /// is connected ([`LeaseManager::set_standby_view`]).
    pub standby: Option<String>,
    /// The epoch (annotation [`super::liveness::EPOCH_ANNOTATION`]): on a
    /// gateway's liveness Lease its current epoch, on an egress IP's record
    /// the holder's epoch when it wrote it (None: a record renewed per IP,
    /// written before liveness Leases).
    pub epoch: Option<u64>,
}

/// What a holder running the peer channel writes into its Lease.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HaFields {
    /// The gateways it asks through an API outage ([`FAILSAFE_ANNOTATION`]).
    pub failsafe_peers: Vec<String>,
    /// Its process's incarnation ([`INCARNATION_ANNOTATION`]).
    pub incarnation: u64,
    /// The standby holding its sessions ([`STANDBY_ANNOTATION`]).
    pub standby: Option<String>,
}

/// The Lease annotation naming the standby that holds the holder's
/// sessions.
pub const STANDBY_ANNOTATION: &str = "egret.dev/standby";

/// The Lease annotation naming the holder process's channel incarnation.
pub const INCARNATION_ANNOTATION: &str = "egret.dev/holder-incarnation";

/// The Lease annotation listing the gateways the holder asks for failsafe
/// acknowledgments (Patroni's `/failsafe` key): comma-separated Node names.
pub const FAILSAFE_ANNOTATION: &str = "egret.dev/failsafe-peers";

impl LeaseRecord {
    fn holder(&self) -> Option<&str> {
        self.holder.as_deref().filter(|h| !h.is_empty())
    }

    fn newer_than(&self, other: &LeaseRecord) -> bool {
        match (self.resource_version.parse::<u64>(), other.resource_version.parse::<u64>()) {
            (Ok(a), Ok(b)) => a > b,
            _ => self.resource_version != other.resource_version,
        }
    }
}

/// What to do about one Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Create it with this gateway as holder (it does not exist).
    Create,
    /// Take it over (expired, released, or already naming this gateway):
    /// replace with this gateway as holder, on `resource_version`.
    Acquire {
        /// Precondition.
        resource_version: String,
        /// The holder being replaced, if any (for Events).
        previous: Option<String>,
        /// `leaseTransitions` after this change.
        transitions: i32,
        /// Keep the acquire time (re-taking our own Lease).
        keep_acquire_time: bool,
    },
    /// Renew it, on `resource_version`.
    Renew {
        /// Precondition.
        resource_version: String,
    },
    /// Clear the holder (the IP is already out of the tables), on `resource_version`.
    Release {
        /// Precondition.
        resource_version: String,
    },
    /// Delete it (its IP is no longer used by anyone), on `resource_version`.
    Delete {
        /// Precondition.
        resource_version: String,
    },
    /// Not a write of this IP's Lease: expire the liveness Lease of the
    /// gateway its record names (ADR 0016), which was observed unchanged
    /// for leaseDuration, on the version observed. Once that succeeds the
    /// record is void and the next plan acquires it.
    Expire(LivenessAction),
}

/// How an action failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    /// 409: someone changed it first (or it already exists).
    Conflict,
    /// 404: it does not exist.
    NotFound,
    /// Anything else: unreachable, timeout, refused.
    Other(String),
}

/// A successful take-over, for Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taken {
    /// The IP.
    pub ip: IpAddr,
    /// Who held it before (None: nobody or released).
    pub previous: Option<String>,
}

#[derive(Clone, Debug)]
struct IpState {
    /// Last record seen (None: absent, or not seen yet).
    record: Option<LeaseRecord>,
    /// Local time the current record (or its absence) was first seen.
    observed_at: Instant,
    /// Send time of our last successful create/acquire/renew, while we
    /// hold it, moved forward by failsafe confirmations.
    held_since_send: Option<Instant>,
    /// Send time of our last successful create/acquire/renew through the
    /// API server (what bounds a lone holder's failsafe).
    written_send: Option<Instant>,
    /// A request is outstanding.
    in_flight: bool,
    /// Not before this instant (back-off, renew cadence).
    next_attempt: Instant,
    /// When the current record's holder was proven dead (its process ended
    /// while its node stayed up: `ha::channel`'s authenticated end of
    /// connection). Cleared by any newer record.
    gone_at: Option<Instant>,
    /// A failsafe acknowledgment given to this holder: no take-over before
    /// the instant (the holder's own deadline is earlier by the fencing
    /// margin). Cleared by a newer record naming someone else.
    promise: Option<(String, Instant)>,
    /// When this gateway, not listed in the record's failsafe peers, first
    /// saw none of them still there (the escape from Patroni's rule, see
    /// [`LeaseManager::plan`]). Cleared by a newer record, or when one of
    /// them is back.
    orphaned_at: Option<Instant>,
    /// Fenced by its deadline while the Lease still named this gateway
    /// (issue 28 §2): the IP stays in the tables with its sessions, served
    /// by nothing (its data-plane deadline has passed), until the Lease is
    /// ours again (served at once, every flow kept) or names someone else
    /// or the IP leaves this gateway's candidacy (then out of the tables).
    dormant: bool,
    /// The watch (or a read) has shown our record at the version we
    /// wrote, or later: a later absence is a deletion, not the watch
    /// lagging our own create.
    confirmed: bool,
}

/// Why a failsafe request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FailsafeRefusal {
    /// This gateway holds the IP itself.
    #[error("this gateway holds the IP")]
    HeldHere,
    /// The newest record names another holder.
    #[error("the Lease names {0}")]
    OtherHolder(String),
    /// A Lease request of ours for the IP is in flight.
    #[error("a Lease request is in flight here")]
    InFlight,
    /// The newest record names nobody: the IP was released, and the next
    /// candidate takes it now. A promise would hold that candidate off for
    /// leaseDuration (a request sent before the release and received
    /// after it did, in a drain).
    #[error("the Lease was released")]
    Released,
    /// This gateway is not a candidate for the IP (any more): it does not
    /// vouch for a holder whose view of the candidates is older than its
    /// own (a gateway not listed may take the Lease once no listed one is
    /// left, [`LeaseManager::plan`]).
    #[error("this gateway is not a candidate for the IP")]
    NotCandidate,
}

/// The Lease state machine of one gateway, over all egress IPs.
#[derive(Debug)]
pub struct LeaseManager {
    me: String,
    timing: LeaseTiming,
    ips: BTreeMap<IpAddr, IpState>,
    /// The earliest instant a planned step is due (take-over, renew, fence).
    wake: Option<Instant>,
    /// The candidates of every IP in use, as the last [`LeaseManager::plan`]
    /// got them (None: no plan yet).
    candidates: Option<BTreeMap<IpAddr, Vec<String>>>,
    /// Every gateway Node still there, drained ones included (None: not
    /// known, the peer channel is off). See [`LeaseManager::set_gateways`].
    gateways: Option<BTreeSet<String>>,
    /// See [`LeaseManager::set_lone_failsafe`].
    lone_failsafe: Duration,
    /// Renewals are planned by [`LeaseManager::plan_renewals`] (the
    /// renewer task), not by [`LeaseManager::plan`].
    renewals_elsewhere: bool,
    /// The peers whose channel is up and the IPs this gateway holds a
    /// session copy of (None: the peer channel is off). See
    /// [`LeaseManager::set_standby_view`].
    standby_view: Option<(BTreeSet<String>, BTreeSet<IpAddr>)>,
    /// Ownership follows gateway liveness Leases (ADR 0016; None: every
    /// held IP's Lease is renewed, ADR 0004). See
    /// [`LeaseManager::use_liveness`].
    liveness: Option<Liveness>,
    /// The IPs this gateway competes for, as the last [`LeaseManager::fence`]
    /// got them (newer than the last plan's candidates within a pass).
    competing: Option<BTreeSet<IpAddr>>,
    /// What a held IP's record should say of the peer channel. See
    /// [`LeaseManager::set_record_fields`].
    record_fields: BTreeMap<IpAddr, HaFields>,
    /// The owner reference every record should carry (the gateway's
    /// DaemonSet, once read). See [`LeaseManager::set_record_owner`].
    record_owner: Option<Owner>,
}

/// Whether `r` carries `f`: the failsafe peers, the incarnation and the
/// standby it should.
fn record_says(r: &LeaseRecord, f: &HaFields) -> bool {
    r.failsafe.as_ref().is_some_and(|p| p.iter().eq(f.failsafe_peers.iter().collect::<BTreeSet<_>>()))
        && r.incarnation == Some(f.incarnation)
        && r.standby == f.standby
}

/// Whether `r` lacks the owner reference `owner` it should carry.
fn lacks_owner(owner: Option<&Owner>, r: &LeaseRecord) -> bool {
    owner.is_some_and(|o| {
        !r.owners
            .iter()
            .any(|x| x.api_version == o.api_version && x.kind == o.kind && x.name == o.name && x.uid == o.uid)
    })
}

/// With liveness Leases, when a free IP's turn passes to the candidates
/// below those in `better` (before their stagger): once every better
/// candidate has been seen alive and then not seen creating or taking an
/// IP's record for renewDeadline. At a cold start the preferred gateway gets the
/// first turn even when its liveness Lease came after this gateway's, and
/// keeps it while it works through its share: it creates its records 16 at
/// a time, and a next candidate that waited only its stagger took most of
/// them (200 IPs on three gateways went 153/21/26; ADR 0016 has the runs
/// of each step of this rule). Bounds: a better
/// candidate's work counts only until `busy_until`, so one that keeps
/// taking other IPs cannot hold a free IP off for ever; one whose liveness
/// Lease this gateway has never seen is waited for leaseDuration after this
/// gateway started (its cold start may be slower than ours), one seen but
/// not alive counts for nothing.
fn better_candidates_turn<'a>(
    l: &Liveness,
    better: impl Iterator<Item = &'a String>,
    busy_until: Instant,
    t: LeaseTiming,
) -> Option<Instant> {
    better
        .filter_map(|n| match l.live_since(n) {
            Some(live) => Some(live.max(l.took_at(n).map_or(live, |took| took.min(busy_until))) + t.renew_deadline),
            None if l.seen(n).is_none() => Some(l.started() + t.lease_duration),
            None => None,
        })
        .max()
}

/// At most this many Lease requests of the sync loop in flight at once
/// (creates, acquires, releases, deletes, expiries). A cold start of a
/// thousand IPs sent at once queued this gateway's renewals behind them at
/// the API server: its liveness renewals took 2-6.5 s, its deadlines
/// passed, and every IP it had just taken went dormant (measured with
/// `k8s_scale` at 300 IPs). In waves of this size they go through at the
/// API server's pace; renewals are not counted (the renewer's own task).
pub const MAX_LEASE_REQUESTS_IN_FLIGHT: usize = 16;

/// How long a lone holder keeps an IP through an API outage by default.
pub const DEFAULT_LONE_FAILSAFE: Duration = Duration::from_secs(300);

impl LeaseManager {
    /// A manager for the gateway named `me`.
    pub fn new(me: impl Into<String>, timing: LeaseTiming) -> Self {
        LeaseManager {
            me: me.into(),
            timing,
            ips: BTreeMap::new(),
            wake: None,
            candidates: None,
            gateways: None,
            lone_failsafe: DEFAULT_LONE_FAILSAFE,
            renewals_elsewhere: false,
            standby_view: None,
            liveness: None,
            competing: None,
            record_fields: BTreeMap::new(),
            record_owner: None,
        }
    }

    /// What each IP's record should say of the peer channel now (failsafe
    /// peers, incarnation, standby; the sync loop's view). With liveness
    /// Leases nothing renews a held IP's record, so one whose annotations
    /// differ is rewritten (on its version, at most once per
    /// retryPeriod): takers judge by them (Patroni's rule, the standby
    /// deferral), and a standby that dropped its copy must not be named.
    pub fn set_record_fields(&mut self, fields: BTreeMap<IpAddr, HaFields>) {
        self.record_fields = fields;
    }

    /// The owner reference every record should carry (the gateway's
    /// DaemonSet; None while it is not known or being deleted). Every write
    /// adds it, but with liveness Leases a held record is not written
    /// again: one created before the DaemonSet was read would never get it
    /// (`k8s_node` found one), and an uninstall would leave it behind. Such
    /// a record is rewritten once, like one whose peer-channel fields
    /// differ.
    pub fn set_record_owner(&mut self, owner: Option<Owner>) {
        self.record_owner = owner;
    }

    /// From now on held IPs are not renewed one by one: this gateway
    /// renews its own liveness Lease ([`LeaseManager::plan_liveness`]),
    /// writes an IP's record only when it takes, releases or deletes it
    /// (under its epoch), and judges other gateways' records by their
    /// liveness Leases (ADR 0016). Records without an epoch (written by a
    /// gateway that renews per IP) keep ADR 0004's rules.
    pub fn use_liveness(&mut self, now: Instant) {
        self.liveness = Some(Liveness::new(self.me.clone(), self.timing, now));
    }

    /// The liveness Leases as this gateway sees them (None: per-IP
    /// renewals).
    pub fn liveness(&self) -> Option<&Liveness> {
        self.liveness.as_ref()
    }

    /// Feeds the liveness Lease of gateway `node` as the watch shows it
    /// (None: absent). Returns [`OwnOutcome::Lost`] when it is ours and a
    /// peer expired it: a new epoch is taken, and no record of the old one
    /// is revived by a later renewal.
    pub fn observe_liveness(&mut self, node: &str, record: Option<LeaseRecord>, now: Instant) -> Option<OwnOutcome> {
        self.liveness.as_mut()?.observe(node, record, now)
    }

    /// Feeds every liveness Lease the watch shows (per gateway): each is
    /// observed, and a gateway followed before but missing now counts as
    /// absent. Returns [`OwnOutcome::Lost`] as [`LeaseManager::observe_liveness`].
    pub fn observe_liveness_all(&mut self, seen: &BTreeMap<String, LeaseRecord>, now: Instant) -> Option<OwnOutcome> {
        let l = self.liveness.as_mut()?;
        let gone: Vec<String> = l.known().filter(|n| !seen.contains_key(*n)).map(str::to_string).collect();
        for n in gone {
            l.observe(&n, None, now);
        }
        let mut out = None;
        for (n, r) in seen {
            if let Some(o) = l.observe(n, Some(r.clone()), now) {
                out = Some(o);
            }
        }
        out
    }

    /// The write of this gateway's own liveness Lease due at `now`, marked
    /// in flight, and when the next is due. Report it with
    /// [`LeaseManager::on_liveness_result`].
    pub fn plan_liveness(&mut self, now: Instant) -> (Option<LivenessAction>, Instant) {
        match self.liveness.as_mut() {
            Some(l) => l.plan_own(now),
            None => (None, now + self.timing.retry_period),
        }
    }

    /// Records the outcome of this gateway's liveness write sent at `sent`
    /// (`fresh`: the Lease as the API server had it after a conflict). A
    /// success makes every IP whose record names this gateway under its
    /// epoch, and of which it is still a candidate, valid until `sent` +
    /// renewDeadline, dormant ones included (they are served again with
    /// every session). Returns the outcome and the IPs served again.
    pub fn on_liveness_result(
        &mut self,
        action: &LivenessAction,
        sent: Instant,
        result: Result<Option<LeaseRecord>, Failure>,
        fresh: Option<LeaseRecord>,
        now: Instant,
    ) -> (OwnOutcome, Vec<IpAddr>) {
        let Some(l) = self.liveness.as_mut() else { return (OwnOutcome::Failed, Vec::new()) };
        let out = l.on_own_result(action, sent, result, fresh, now);
        let mut revived = Vec::new();
        if let OwnOutcome::Renewed { sent } = out {
            revived = self.validate_current_epoch(sent);
        }
        (out, revived)
    }

    /// Moves every IP of the current epoch this gateway is a candidate for
    /// to `base` (a successful liveness write sent then). Returns the IPs
    /// that were not held before.
    fn validate_current_epoch(&mut self, base: Instant) -> Vec<IpAddr> {
        let Some(epoch) = self.liveness.as_ref().map(Liveness::epoch) else { return Vec::new() };
        let me = self.me.clone();
        let cands = self.candidates.clone().unwrap_or_default();
        let mut revived = Vec::new();
        for (ip, st) in &mut self.ips {
            let ours = st.record.as_ref().is_some_and(|r| r.holder() == Some(me.as_str()) && r.epoch == Some(epoch));
            // A candidate by the last plan and still competing by the last
            // fence: a pass fences an IP it stops competing for before its
            // plan releases it, and a renewal answered in between must not
            // serve it again (a drain's hand-over was held up by that).
            let candidate = cands.get(ip).is_some_and(|c| c.contains(&me))
                && self.competing.as_ref().is_none_or(|c| c.contains(ip));
            if !ours || !candidate || st.in_flight {
                continue;
            }
            if st.held_since_send.is_none() {
                revived.push(*ip);
            }
            st.held_since_send = Some(st.held_since_send.map_or(base, |h| h.max(base)));
            st.written_send = Some(base);
            st.dormant = false;
        }
        revived
    }

    /// From now on [`LeaseManager::plan`] leaves renewals to
    /// [`LeaseManager::plan_renewals`], which a task of their own calls
    /// (issue 28 §2: nothing the sync loop does may delay them).
    pub fn renew_elsewhere(&mut self) {
        self.renewals_elsewhere = true;
    }

    /// The renewals due at `now` (held IPs, ours on the server, still
    /// candidates by the last plan, none in flight), marked in flight, and
    /// the instant the next one is due (at most a retry period away).
    /// Report each with [`LeaseManager::on_result`].
    pub fn plan_renewals(&mut self, now: Instant) -> (Vec<(IpAddr, Action)>, Instant) {
        let me = self.me.clone();
        let mut wake = now + self.timing.retry_period;
        let mut actions = Vec::new();
        if self.liveness.is_some() {
            // The liveness Lease renews them all (plan_liveness).
            return (actions, wake);
        }
        for (ip, st) in &mut self.ips {
            if st.held_since_send.is_none() || st.in_flight {
                continue;
            }
            if now < st.next_attempt {
                wake = wake.min(st.next_attempt);
                continue;
            }
            let candidate = self.candidates.as_ref().is_some_and(|c| c.get(ip).is_some_and(|c| c.contains(&me)));
            let Some(r) = st.record.as_ref().filter(|r| r.holder() == Some(me.as_str())) else { continue };
            if !candidate {
                continue;
            }
            st.in_flight = true;
            actions.push((*ip, Action::Renew { resource_version: r.resource_version.clone() }));
        }
        (actions, wake)
    }

    /// The lone holder's bound (issue 28 §3), the same on every gateway. A
    /// holder whose record lists no failsafe peers (no other gateway is
    /// eligible for the IP) keeps it through an API outage with nobody's
    /// promise, but only until `bound` after its last write reached the API
    /// server; any other gateway may take its Lease `bound` after the
    /// record expired. Without it, a lone holder that died silently (its
    /// instance terminated, its node powered off) kept its IP from every
    /// gateway added later, forever.
    ///
    /// Safety: the holder's last write was sent at `S`, before anyone saw
    /// it (at `seen >= S`). It serves until at most `S + bound +
    /// renewDeadline`; others take over at `seen + leaseDuration + bound`,
    /// later by at least the fencing margin.
    pub fn set_lone_failsafe(&mut self, bound: Duration) {
        self.lone_failsafe = bound;
    }

    /// This gateway's identity.
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The timing.
    pub fn timing(&self) -> LeaseTiming {
        self.timing
    }

    fn state(&mut self, ip: IpAddr, now: Instant) -> &mut IpState {
        self.ips.entry(ip).or_insert(IpState {
            record: None,
            observed_at: now,
            held_since_send: None,
            written_send: None,
            in_flight: false,
            next_attempt: now,
            gone_at: None,
            promise: None,
            orphaned_at: None,
            dormant: false,
            confirmed: false,
        })
    }

    /// Every gateway Node still there (labelled a gateway, drained or not),
    /// this one included; the peer channel passes it after each pass (its
    /// peer set). With it, a gateway not listed in a holder's failsafe peers
    /// may take the holder's expired Lease once none of them is left
    /// ([`LeaseManager::plan`]); without it (never called), never.
    pub fn set_gateways(&mut self, gateways: BTreeSet<String>) {
        self.gateways = Some(gateways);
    }

    /// What the peer channel knows (issue 28 §3, the right standby): the
    /// peers connected now (`up`) and the IPs of which this gateway holds
    /// a copy of the holder's sessions (`copies`). With it, a candidate
    /// without a copy defers a take-over by `leaseDuration` to the standby
    /// the Lease names when that standby is connected (alive) and a
    /// candidate: the standby takes the IP with its sessions even when it
    /// is slow to act (a starved CPU), instead of the next candidate
    /// taking it without them one `retryPeriod` later. A candidate holding
    /// a copy, or the named standby, never defers. A released Lease names
    /// a standby only when the holder handed it a complete copy first:
    /// the same deferral applies, and that standby takes it at once.
    pub fn set_standby_view(&mut self, up: BTreeSet<String>, copies: BTreeSet<IpAddr>) {
        self.standby_view = Some((up, copies));
    }

    /// How long this gateway defers a take-over of `ip`, whose record is
    /// `record`, to the standby it names ([`LeaseManager::set_standby_view`]).
    fn standby_deferral(&self, ip: IpAddr, record: &LeaseRecord, ranked: &[String]) -> Duration {
        let Some((up, copies)) = &self.standby_view else { return Duration::ZERO };
        let Some(standby) = record.standby.as_deref() else { return Duration::ZERO };
        let alive_candidate = up.contains(standby) && ranked.iter().any(|n| n == standby);
        if standby == self.me || record.holder() == Some(standby) || copies.contains(&ip) || !alive_candidate {
            return Duration::ZERO;
        }
        self.timing.lease_duration
    }

    /// Whether a gateway listed in a holder's failsafe peers may still keep
    /// the holder's IP alive by its promises: it is a candidate for the IP,
    /// or it is a gateway Node still there that is a candidate for no IP at
    /// all (drained: it takes nothing, but it runs and answers failsafe
    /// requests until it sees its drain). Unknown gateways count as there.
    fn still_there(&self, ip: IpAddr, peer: &str) -> bool {
        let (Some(cands), Some(gateways)) = (&self.candidates, &self.gateways) else { return true };
        if cands.get(&ip).is_some_and(|c| c.iter().any(|n| n == peer)) {
            return true;
        }
        gateways.contains(peer) && !cands.values().any(|c| c.iter().any(|n| n == peer))
    }

    /// Feeds the Lease of `ip` as the watch shows it (None: absent). A
    /// record seen for the first time (or changed) restarts its expiry
    /// clock; a record naming another holder while we hold the IP fences it.
    pub fn observe(&mut self, ip: IpAddr, record: Option<LeaseRecord>, now: Instant) {
        let me = self.me.clone();
        let liveness = self.liveness.is_some();
        let mut took = None;
        let st = self.state(ip, now);
        if let (Some(old), Some(new)) = (&st.record, &record) {
            st.confirmed |= !old.newer_than(new);
        }
        let changed = match (&st.record, &record) {
            (None, None) => false,
            (Some(old), Some(new)) => new.newer_than(old),
            // The watch lags our own create: absence while we hold the IP is
            // that lag (a real deletion shows as 404 on the next renewal).
            // With liveness Leases nothing renews the record: once the watch
            // has shown it, its absence is a deletion (by hand, say), and
            // the IP is fenced now rather than served beside a new record.
            (Some(_), None) => st.held_since_send.is_none() || (liveness && st.confirmed),
            (None, Some(_)) => true,
        };
        if changed {
            if record.as_ref().and_then(LeaseRecord::holder) != Some(me.as_str()) {
                // Someone else's (or nobody's): not ours to serve, nor to
                // keep sessions for.
                st.held_since_send = None;
                st.dormant = false;
            }
            let new_holder = record.as_ref().and_then(|r| r.holder().map(str::to_string));
            if new_holder.is_some() && st.record.as_ref().and_then(LeaseRecord::holder) != new_holder.as_deref() {
                took = new_holder.clone();
            }
            if st.promise.as_ref().is_some_and(|(h, _)| new_holder.as_deref() != Some(h.as_str())) {
                st.promise = None;
            }
            // A late renewal by the process proven dead (sent before it
            // died) keeps the proof; a record by anyone else, or by its
            // next process, ends it.
            let same_process = match (&st.record, &record) {
                (Some(old), Some(new)) => {
                    new.holder().is_some() && old.holder() == new.holder() && old.incarnation == new.incarnation
                }
                _ => false,
            };
            if !same_process {
                st.gone_at = None;
            }
            st.orphaned_at = None;
            st.record = record;
            st.observed_at = now;
        }
        if let (Some(h), Some(l)) = (took, self.liveness.as_mut()) {
            l.note_take(&h, now);
        }
    }

    /// The process of gateway `holder` ended while its node stayed up (the
    /// peer channel's authenticated end of connection, without a goodbye):
    /// it serves nothing any more (its XDP link and workers died with it), so
    /// the Leases it holds by our newest records may be taken over without
    /// waiting for them to expire, each candidate after its rank's stagger.
    /// Returns those IPs. A newer record (the holder restarted and took its
    /// Lease back) cancels this.
    /// Only records written by that process (`incarnation`, the one whose
    /// channel ended) are freed: a late proof about a process that already
    /// restarted and renewed its Lease frees nothing.
    pub fn holder_gone(&mut self, holder: &str, incarnation: u64, now: Instant) -> Vec<IpAddr> {
        let mut ips = Vec::new();
        for (ip, st) in &mut self.ips {
            let by_it =
                st.record.as_ref().is_some_and(|r| r.holder() == Some(holder) && r.incarnation == Some(incarnation));
            if st.held_since_send.is_none() && by_it {
                st.gone_at.get_or_insert(now);
                ips.push(*ip);
            }
        }
        ips
    }

    /// A failsafe request (Patroni's DCS failsafe): `holder`, which cannot
    /// renew through the API server, asks whether it may keep `ip`. Accepted
    /// unless this gateway holds it, has a Lease request for it in flight, or
    /// its newest record names someone else; accepting promises not to take
    /// the IP before `now + leaseDuration`. The holder counts its extension
    /// from when it *sent* the request (before `now`) and fences at that +
    /// renewDeadline, so the fencing margin holds exactly as for a renewal.
    pub fn promise(&mut self, ip: IpAddr, holder: &str, now: Instant) -> Result<(), FailsafeRefusal> {
        let until = now + self.timing.lease_duration;
        let me = self.me.clone();
        let candidate = self.candidates.as_ref().is_none_or(|c| c.get(&ip).is_some_and(|c| c.contains(&me)));
        let st = self.state(ip, now);
        if st.held_since_send.is_some() {
            return Err(FailsafeRefusal::HeldHere);
        }
        if st.in_flight {
            return Err(FailsafeRefusal::InFlight);
        }
        if !candidate {
            return Err(FailsafeRefusal::NotCandidate);
        }
        match st.record.as_ref().map(|r| r.holder()) {
            Some(Some(h)) if h != holder => return Err(FailsafeRefusal::OtherHolder(h.to_string())),
            Some(None) => return Err(FailsafeRefusal::Released),
            _ => {}
        }
        let until = match &st.promise {
            Some((h, u)) if h == holder => until.max(*u),
            _ => until,
        };
        st.promise = Some((holder.to_string(), until));
        Ok(())
    }

    /// The failsafe promises this gateway still keeps at `now`: (IP, the
    /// holder promised, the instant before which it takes nothing). What a
    /// graceful stop writes to the peer cache (`ha::promises`), so the next
    /// process keeps them ([`LeaseManager::restore_promise`]).
    pub fn promises(&self, now: Instant) -> Vec<(IpAddr, String, Instant)> {
        self.ips
            .iter()
            .filter_map(|(ip, st)| st.promise.as_ref().map(|(h, until)| (*ip, h.clone(), *until)))
            .filter(|(_, _, until)| *until > now)
            .collect()
    }

    /// A promise the previous process on this node gave to `holder` and
    /// wrote down when it stopped: kept exactly like one given here (no
    /// take-over of `ip` before `until`; a newer record naming someone else
    /// cancels it, as it cancels a live one). Call before the first
    /// [`LeaseManager::plan`].
    pub fn restore_promise(&mut self, ip: IpAddr, holder: &str, until: Instant, now: Instant) {
        let st = self.state(ip, now);
        let until = match &st.promise {
            Some((h, u)) if h == holder => until.max(*u),
            _ => until,
        };
        st.promise = Some((holder.to_string(), until));
    }

    /// Every other eligible gateway accepted a failsafe request for `ip`
    /// sent at `sent`: while the IP is still held (not fenced) and ours on
    /// the server, its deadline moves to `sent + renewDeadline`, exactly as
    /// a renewal sent then would move it. Returns whether it did.
    pub fn failsafe_confirmed(&mut self, ip: IpAddr, sent: Instant) -> bool {
        let me = self.me.clone();
        let Some(st) = self.ips.get_mut(&ip) else { return false };
        let ours = st.record.as_ref().and_then(|r| r.holder()) == Some(me.as_str());
        let lone = st.record.as_ref().and_then(|r| r.failsafe.as_ref()).is_some_and(BTreeSet::is_empty);
        let sent = match (lone, st.written_send) {
            (true, Some(w)) => sent.min(w + self.lone_failsafe),
            _ => sent,
        };
        match st.held_since_send {
            Some(s) if ours => {
                st.held_since_send = Some(s.max(sent));
                true
            }
            _ => false,
        }
    }

    /// Forgets Leases of IPs that are neither in use nor held nor in flight.
    pub fn forget_unused(&mut self, in_use: &BTreeSet<IpAddr>, watched: &BTreeSet<IpAddr>) {
        self.ips.retain(|ip, st| {
            in_use.contains(ip) || watched.contains(ip) || st.held_since_send.is_some() || st.in_flight
        });
    }

    /// Drops the IPs whose renew deadline has passed, or whose candidacy
    /// ended, and returns them. The data plane serves none of them any more
    /// (their deadline, [`LeaseManager::deadlines`], is gone). An IP fenced
    /// by its deadline while the Lease still names this gateway, which is
    /// still a candidate, becomes dormant ([`LeaseManager::dormant`]): it
    /// stays in the tables with its sessions, and the next plan takes the
    /// Lease back at once. The others must leave the tables before the
    /// caller carries out any further action.
    pub fn fence(&mut self, now: Instant, competing: &BTreeSet<IpAddr>) -> Vec<IpAddr> {
        self.competing = Some(competing.clone());
        let deadline = self.timing.renew_deadline;
        let me = self.me.clone();
        let mut fenced = Vec::new();
        for (ip, st) in &mut self.ips {
            if !competing.contains(ip) {
                st.dormant = false;
            }
            if let Some(sent) = st.held_since_send {
                if now >= sent + deadline || !competing.contains(ip) {
                    st.held_since_send = None;
                    st.next_attempt = st.next_attempt.min(now);
                    st.dormant =
                        competing.contains(ip) && st.record.as_ref().and_then(LeaseRecord::holder) == Some(&me);
                    fenced.push(*ip);
                }
            }
        }
        fenced
    }

    /// The dormant IPs: fenced by their deadline, the Lease still naming
    /// this gateway. They stay in the tables (with their sessions) but are
    /// served by nothing until [`LeaseManager::held`] has them again.
    pub fn dormant(&self) -> BTreeSet<IpAddr> {
        self.ips.keys().copied().filter(|ip| self.is_dormant(*ip)).collect()
    }

    /// Whether `ip` is dormant ([`LeaseManager::dormant`]).
    pub fn is_dormant(&self, ip: IpAddr) -> bool {
        self.ips.get(&ip).is_some_and(|st| {
            st.dormant
                && st.held_since_send.is_none()
                && st.record.as_ref().and_then(LeaseRecord::holder) == Some(self.me.as_str())
        })
    }

    /// The IPs this gateway may serve at `now`.
    pub fn held(&self, now: Instant) -> BTreeSet<IpAddr> {
        self.ips
            .iter()
            .filter(|(_, st)| st.held_since_send.is_some_and(|s| now < s + self.timing.renew_deadline))
            .map(|(ip, _)| *ip)
            .collect()
    }

    /// The newest record of `ip` known (from the watch or our own responses,
    /// which may be newer than the watch's).
    pub fn record(&self, ip: IpAddr) -> Option<&LeaseRecord> {
        self.ips.get(&ip).and_then(|st| st.record.as_ref())
    }

    /// The deadline by which `ip` must be out of the tables, if held.
    pub fn deadline(&self, ip: IpAddr) -> Option<Instant> {
        self.ips.get(&ip).and_then(|st| st.held_since_send).map(|s| s + self.timing.renew_deadline)
    }

    /// Every IP this manager tracks with its deadline (None: not held):
    /// what the data plane may serve, and until when (ADR 0004). The
    /// deadline moves only on a successful create/acquire/renew, to its
    /// send time + renewDeadline, which others' take-over follows by at
    /// least the fencing margin.
    pub fn deadlines(&self) -> impl Iterator<Item = (IpAddr, Option<Instant>)> + '_ {
        self.ips.iter().map(|(ip, st)| (*ip, st.held_since_send.map(|s| s + self.timing.renew_deadline)))
    }

    /// Plans the next actions. `candidates` maps every egress IP in use to
    /// its eligible gateways, most preferred first. Call it only after the
    /// tables without the fenced IPs were applied. Marks the returned
    /// actions in flight; report each with [`LeaseManager::on_result`].
    ///
    /// `tables_current` says whether the tables of this pass were applied:
    /// when the apply failed, the data plane may still serve an IP this
    /// gateway stopped holding, so no Lease is given up ([`Action::Release`],
    /// [`Action::Delete`]) until an apply succeeds; everything else goes on.
    pub fn plan(
        &mut self,
        now: Instant,
        candidates: &BTreeMap<IpAddr, Vec<String>>,
        tables_current: bool,
    ) -> Vec<(IpAddr, Action)> {
        let t = self.timing;
        let me = self.me.clone();
        let mut wake: Option<Instant> = None;
        let mut soon = |at: Instant| {
            wake = Some(wake.map_or(at, |w: Instant| w.min(at)));
        };
        let mut actions = Vec::new();
        for ip in candidates.keys() {
            self.state(*ip, now);
        }
        self.candidates = Some(candidates.clone());
        // With liveness Leases: this gateway's epoch and the base of its
        // records, if still valid (None inside: it may take nothing now).
        let live: Option<(u64, Option<Instant>)> = self.liveness.as_ref().map(|l| (l.epoch(), l.base(now)));
        if let Some(l) = self.liveness.as_mut() {
            let holders: Vec<String> =
                self.ips.values().filter_map(|st| st.record.as_ref()?.holder().map(str::to_string)).collect();
            l.note_holders(holders.iter().map(String::as_str), now);
        }
        let mut expiring_now: BTreeSet<String> = BTreeSet::new();
        let mut in_flight = self.ips.values().filter(|st| st.in_flight).count();
        // The escape from Patroni's rule: IPs whose holder lists failsafe
        // peers other than this gateway, none of them still there.
        let orphaned: BTreeSet<IpAddr> =
            self.ips
                .iter()
                .filter(|(ip, st)| {
                    st.record.as_ref().and_then(|r| r.failsafe.as_ref()).is_some_and(|f| {
                        !f.is_empty() && !f.contains(&me) && !f.iter().any(|p| self.still_there(**ip, p))
                    })
                })
                .map(|(ip, _)| *ip)
                .collect();
        for (ip, st) in &mut self.ips {
            if !orphaned.contains(ip) {
                st.orphaned_at = None;
            } else if st.orphaned_at.is_none() {
                st.orphaned_at = Some(now);
            }
        }
        let deferrals: BTreeMap<IpAddr, Duration> = self
            .ips
            .iter()
            .filter_map(|(ip, st)| {
                let r = st.record.as_ref()?;
                Some((*ip, self.standby_deferral(*ip, r, candidates.get(ip)?)))
            })
            .collect();
        for (ip, st) in &mut self.ips {
            if let Some(sent) = st.held_since_send {
                soon(sent + t.renew_deadline);
            }
            if st.in_flight {
                continue;
            }
            if now < st.next_attempt {
                soon(st.next_attempt);
                continue;
            }
            let holder = st.record.as_ref().and_then(|r| r.holder().map(str::to_string));
            let rv = st.record.as_ref().map(|r| r.resource_version.clone());
            let ranked = candidates.get(ip);
            // A free IP taken by a candidate ranked below others: its rank
            // and when the turn passed to it, for the log.
            let mut free_turn: Option<(usize, Option<Instant>)> = None;
            let mine_on_server = holder.as_deref() == Some(me.as_str());
            let action = match ranked.filter(|c| c.contains(&me)) {
                // Not a candidate (or not in use): give up what is ours on the server.
                None => match (st.held_since_send, mine_on_server, rv) {
                    (Some(_), _, _) => None, // fence() has not run yet; next pass.
                    (None, true, Some(rv)) if ranked.is_none() => Some(Action::Delete { resource_version: rv }),
                    (None, true, Some(rv)) => Some(Action::Release { resource_version: rv }),
                    (None, false, Some(rv)) if ranked.is_none() => {
                        // Garbage: an unused IP's Lease that expired. Anyone may delete it.
                        // (A record with an epoch carries a duration meant for
                        // gateways of earlier versions: ours counts, and only
                        // once its holder serves it no more: released, or its
                        // liveness Lease past that epoch or long absent. A
                        // holder whose view lags still renews it otherwise.)
                        let expiry = |r: &LeaseRecord| if r.epoch.is_some() { t.lease_duration } else { t.expiry(r) };
                        let expires = st.observed_at + st.record.as_ref().map_or(t.lease_duration, expiry);
                        let holder_done = match st.record.as_ref() {
                            Some(r) if r.epoch.is_some() && r.holder().is_some() => {
                                let h = r.holder().zip(r.epoch).and_then(|(h, e)| self.liveness.as_ref()?.holder(h, e));
                                match h {
                                    Some(HolderLiveness::Void { .. }) => true,
                                    Some(HolderLiveness::Absent { since }) => now >= since + t.lease_duration,
                                    _ => false,
                                }
                            }
                            _ => true,
                        };
                        if !holder_done {
                            soon(now + t.retry_period);
                            None
                        } else if now >= expires + t.lease_duration {
                            Some(Action::Delete { resource_version: rv })
                        } else {
                            soon(expires + t.lease_duration);
                            None
                        }
                    }
                    _ => None,
                },
                // Held with liveness Leases: nothing to write, unless the
                // record is of an older epoch (the liveness Lease was lost
                // and taken again while a failsafe kept the IP) or says
                // something else of the peer channel than it should now.
                Some(_) if st.held_since_send.is_some() && live.is_some() => match (live, &st.record, rv) {
                    (Some((epoch, Some(_))), Some(r), Some(rv))
                        if mine_on_server
                            && (r.epoch != Some(epoch)
                                || self.record_fields.get(ip).is_some_and(|f| !record_says(r, f))
                                || lacks_owner(self.record_owner.as_ref(), r)) =>
                    {
                        Some(Action::Acquire {
                            resource_version: rv,
                            previous: None,
                            transitions: r.transitions,
                            keep_acquire_time: true,
                        })
                    }
                    _ => None,
                },
                Some(_) if st.held_since_send.is_some() && self.renewals_elsewhere => None,
                // With liveness Leases nothing is taken or taken back while
                // this gateway's own liveness is not valid.
                Some(_) if live.is_some_and(|(_, base)| base.is_none()) => {
                    soon(now + t.retry_period);
                    None
                }
                // Ours under the current epoch and the liveness valid: it
                // is held again without a write (not a candidate for a
                // while, then again before the release).
                Some(_)
                    if mine_on_server
                        && live
                            .is_some_and(|(epoch, _)| st.record.as_ref().is_some_and(|r| r.epoch == Some(epoch))) =>
                {
                    let base = live.and_then(|(_, b)| b);
                    st.held_since_send = base;
                    st.written_send = base;
                    st.dormant = false;
                    None
                }
                Some(ranked) => {
                    if st.held_since_send.is_some() {
                        match (mine_on_server, rv) {
                            (true, Some(rv)) => Some(Action::Renew { resource_version: rv }),
                            _ => None,
                        }
                    } else if mine_on_server {
                        // Ours on the server but not served (fenced, or we restarted):
                        // nobody else may take it before it expires, so take it back now.
                        let r = st.record.as_ref();
                        Some(Action::Acquire {
                            resource_version: rv.unwrap_or_default(),
                            previous: None,
                            transitions: r.map_or(0, |r| r.transitions),
                            keep_acquire_time: true,
                        })
                    } else {
                        // Rank among the candidates other than the current holder.
                        // (Not the standby the record names first: the record
                        // may name one whose copy the holder already dropped
                        // for a more preferred one; docs/kubernetes.md, "Under
                        // load", says what was tried.)
                        let rank = ranked
                            .iter()
                            .filter(|n| Some(n.as_str()) != holder.as_deref())
                            .position(|n| *n == me)
                            .unwrap_or(0);
                        let stagger = t.retry_period * u32::try_from(rank).unwrap_or(u32::MAX);
                        // A Lease whose standby is alive: without a copy, let
                        // the standby take it first. A released one was
                        // handed over to the standby it names (it names one
                        // only with a complete copy): that standby takes it
                        // at once, whatever its rank.
                        let named_standby = st.record.as_ref().and_then(|r| r.standby.as_deref()) == Some(me.as_str());
                        let stagger = match holder {
                            None if named_standby => Duration::ZERO,
                            _ => stagger + deferrals.get(ip).copied().unwrap_or_default(),
                        };
                        let promised = st.promise.as_ref().map(|(_, until)| *until);
                        // A record written under an epoch: its holder's
                        // liveness Lease says whether it still serves it.
                        let holder_liveness = match (&self.liveness, &st.record, &holder) {
                            (Some(l), Some(r), Some(h)) => r.epoch.and_then(|e| l.holder(h, e)),
                            _ => None,
                        };
                        let handed_over = holder.is_none() && named_standby && st.record.is_some();
                        let turn_from = self.liveness.as_ref().filter(|_| !handed_over).and_then(|l| {
                            let better = ranked.iter().filter(|n| Some(n.as_str()) != holder.as_deref());
                            let busy_until = st.observed_at + t.busy_cap();
                            better_candidates_turn(l, better.take_while(|n| **n != me), busy_until, t)
                        });
                        let free_at = match (&st.record, &holder) {
                            (None, _) | (Some(_), None) => {
                                let from = turn_from.map_or(st.observed_at, |t| t.max(st.observed_at));
                                Some((from + stagger).max(promised.unwrap_or(now)))
                            }
                            // Proven dead: nothing it promised or renewed matters.
                            (Some(_), Some(_)) if st.gone_at.is_some() => st.gone_at.map(|g| g + stagger),
                            // Written under an epoch of a holder whose liveness
                            // Lease was never seen or noted: next pass.
                            (Some(r), Some(_))
                                if r.epoch.is_some() && self.liveness.is_some() && holder_liveness.is_none() =>
                            {
                                soon(now + t.retry_period);
                                None
                            }
                            // By its holder's liveness (ADR 0016), with the same
                            // rules as a renewed record: a lone holder keeps it the
                            // lone bound longer, only listed failsafe peers race
                            // unless none is left, promises hold it off. A live
                            // holder's Lease is expired first (below).
                            (Some(r), Some(_)) if holder_liveness.is_some() => {
                                let lone = r.failsafe.as_ref().is_some_and(BTreeSet::is_empty);
                                let unlisted = r.failsafe.as_ref().is_some_and(|f| !f.contains(&me));
                                let from = match holder_liveness.as_ref() {
                                    Some(HolderLiveness::Void { since }) => Some(*since),
                                    Some(h) if lone => free_from(h, t.lease_duration).map(|f| f + self.lone_failsafe),
                                    Some(h) => free_from(h, t.lease_duration),
                                    None => None,
                                };
                                match from {
                                    _ if !lone && unlisted && st.orphaned_at.is_none() => None,
                                    // This gateway's view of the liveness lags the record.
                                    None => {
                                        soon(now + t.retry_period);
                                        None
                                    }
                                    Some(from) => {
                                        let from = st.orphaned_at.map_or(from, |o| from.max(o + t.lease_duration));
                                        Some((from + stagger).max(promised.unwrap_or(now)))
                                    }
                                }
                            }
                            // A lone holder (it named nobody) keeps its IP through an
                            // outage for the lone bound at most: free after it.
                            (Some(r), Some(_)) if r.failsafe.as_ref().is_some_and(BTreeSet::is_empty) => {
                                let expired = st.observed_at + t.expiry(r) + self.lone_failsafe;
                                Some((expired + stagger).max(promised.unwrap_or(now)))
                            }
                            // Patroni's rule: once the holder names the gateways it
                            // asks through an API outage, only they may race...
                            (Some(r), Some(_))
                                if r.failsafe.as_ref().is_some_and(|f| !f.contains(&me))
                                    && st.orphaned_at.is_none() =>
                            {
                                None
                            }
                            // ... unless none of them is still there (deleted, no
                            // longer a candidate; a drained one counts as there):
                            // then anyone may, leaseDuration after this gateway
                            // saw it (what a listed one that sees it later may
                            // still have promised runs out meanwhile).
                            (Some(r), Some(_)) => {
                                let expired = st.observed_at + t.expiry(r);
                                let expired = st.orphaned_at.map_or(expired, |o| expired.max(o + t.lease_duration));
                                Some((expired + stagger).max(promised.unwrap_or(now)))
                            }
                        };
                        let Some(free_at) = free_at else {
                            continue;
                        };
                        if now < free_at {
                            soon(free_at);
                            None
                        } else if let (
                            Some(HolderLiveness::Live { resource_version, transitions, .. }),
                            Some(h),
                            Some(l),
                        ) = (holder_liveness, holder.as_ref(), self.liveness.as_mut())
                        {
                            // Its holder's liveness Lease first: cleared on the
                            // version observed, so that a renewal this gateway
                            // has not seen yet makes it fail.
                            if l.expiring(h) || !expiring_now.insert(h.clone()) {
                                soon(now + t.retry_period);
                                None
                            } else {
                                Some(Action::Expire(LivenessAction::Expire {
                                    holder: h.clone(),
                                    resource_version,
                                    transitions: transitions + 1,
                                }))
                            }
                        } else {
                            if rank > 0 && holder.is_none() {
                                free_turn = Some((rank, turn_from));
                            }
                            match &st.record {
                                None => Some(Action::Create),
                                Some(r) => Some(Action::Acquire {
                                    resource_version: r.resource_version.clone(),
                                    previous: holder.clone(),
                                    transitions: r.transitions + i32::from(holder.is_some()),
                                    keep_acquire_time: false,
                                }),
                            }
                        }
                    }
                }
            };
            let action = match action {
                Some(Action::Release { .. } | Action::Delete { .. }) if !tables_current => {
                    // Retried once a pass applies its tables.
                    soon(now + t.retry_period);
                    None
                }
                a => a,
            };
            if let Some(a) = action {
                if in_flight >= MAX_LEASE_REQUESTS_IN_FLIGHT {
                    // Next wave.
                    soon(now + t.retry_period / 10);
                    continue;
                }
                if let (Action::Expire(LivenessAction::Expire { holder, .. }), Some(l)) = (&a, self.liveness.as_mut()) {
                    l.expire_sent(holder);
                }
                if let Some((rank, turn_from)) = free_turn {
                    tracing::debug!(
                        %ip, rank, turn_passed = ?turn_from.map(|f| now.saturating_duration_since(f)),
                        seen_free = ?now.saturating_duration_since(st.observed_at),
                        "taking a free IP: the better-ranked candidates' turn passed"
                    );
                }
                in_flight += 1;
                st.in_flight = true;
                actions.push((*ip, a));
            }
        }
        self.wake = wake;
        actions
    }

    /// When the controller should run again at the latest (a due take-over,
    /// renewal or fencing deadline), never later than one retry period.
    pub fn next_wake(&self, now: Instant) -> Instant {
        let cap = now + self.timing.retry_period;
        self.wake.map_or(cap, |w| w.min(cap))
    }

    /// Records the outcome of an action sent at `sent`. Returns the take-over
    /// when this gateway just acquired an IP held by nobody or someone else.
    pub fn on_result(
        &mut self,
        ip: IpAddr,
        action: &Action,
        sent: Instant,
        result: Result<Option<LeaseRecord>, Failure>,
        now: Instant,
    ) -> Option<Taken> {
        let t = self.timing;
        if let Action::Expire(LivenessAction::Expire { holder, .. }) = action {
            let failed = result.is_err();
            let st = self.state(ip, now);
            st.in_flight = false;
            st.next_attempt = if failed { now + t.retry_period } else { now };
            if let Some(l) = self.liveness.as_mut() {
                l.on_expire_result(holder, result, None, now);
            }
            return None;
        }
        // With liveness Leases a record written now is valid from the
        // base of this gateway's liveness (not later than the write), and
        // only under the current epoch.
        let live_base = self.liveness.as_ref().map(|l| (l.epoch(), l.base(now)));
        let st = self.state(ip, now);
        st.in_flight = false;
        match result {
            Ok(record) => {
                // A dormant IP taken back did not move: no take-over.
                let was_held = st.held_since_send.is_some() || st.dormant;
                st.dormant = false;
                match action {
                    // Given up while the renewal was in flight (a drain, a
                    // stop, no longer a candidate: fenced without dormancy):
                    // the write landed, but the IP is not served again; the
                    // next pass releases the Lease. Reviving it here served
                    // it again for a pass, and the deletion of its sessions
                    // after the give-up then went to its standby as
                    // removals (a drain handed the IP over with none).
                    Action::Renew { .. } if !was_held => {
                        st.written_send = Some(sent);
                        st.next_attempt = now;
                    }
                    Action::Create | Action::Acquire { .. } if live_base.is_some() => {
                        let epoch_now = record.as_ref().and_then(|r| r.epoch) == live_base.map(|(e, _)| e);
                        let base = live_base.and_then(|(_, b)| b).filter(|_| epoch_now);
                        st.held_since_send = base.map(|b| b.min(sent));
                        st.written_send = base;
                        st.next_attempt = sent + t.retry_period;
                    }
                    Action::Create | Action::Acquire { .. } | Action::Renew { .. } => {
                        st.held_since_send = Some(sent);
                        st.written_send = Some(sent);
                        st.next_attempt = sent + t.retry_period;
                    }
                    Action::Release { .. } | Action::Delete { .. } => {
                        st.held_since_send = None;
                        st.next_attempt = now;
                    }
                    Action::Expire(_) => {}
                }
                if let Some(r) = &record {
                    st.record = Some(r.clone());
                    st.observed_at = now;
                    st.confirmed = false;
                } else if matches!(action, Action::Delete { .. }) {
                    st.record = None;
                    st.observed_at = now;
                }
                match action {
                    Action::Create => Some(Taken { ip, previous: None }),
                    Action::Acquire { previous, keep_acquire_time, .. } if !*keep_acquire_time || !was_held => {
                        Some(Taken { ip, previous: previous.clone() })
                    }
                    _ => None,
                }
            }
            Err(Failure::NotFound) => {
                st.record = None;
                st.observed_at = now;
                st.next_attempt = now;
                st.dormant = false;
                None
            }
            Err(Failure::Conflict) | Err(Failure::Other(_)) => {
                st.next_attempt = now + t.retry_period;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const D: Duration = Duration::from_secs(4);
    const R: Duration = Duration::from_secs(2);
    const P: Duration = Duration::from_millis(500);

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn rec(holder: Option<&str>, rv: u64) -> LeaseRecord {
        LeaseRecord {
            holder: holder.map(str::to_string),
            duration: D,
            resource_version: rv.to_string(),
            ..Default::default()
        }
    }

    /// A record of `holder` (None: released) at version `rv`, written
    /// under epoch 1.
    fn rec1(holder: Option<&str>, rv: u64) -> LeaseRecord {
        LeaseRecord { epoch: Some(1), ..rec(holder, rv) }
    }

    fn cands(ipaddr: &str, names: &[&str]) -> BTreeMap<IpAddr, Vec<String>> {
        [(ip(ipaddr), names.iter().map(|s| s.to_string()).collect())].into()
    }

    fn mgr(me: &str) -> LeaseManager {
        LeaseManager::new(me, LeaseTiming::default())
    }

    fn gateways(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    /// gw-a's manager holding `x` by a Lease it created at `t0` (record
    /// version 10, the answer read at `done`), among the candidates `c`.
    fn holding(x: IpAddr, c: &BTreeMap<IpAddr, Vec<String>>, t0: Instant, done: Instant) -> LeaseManager {
        let mut a = mgr("gw-a");
        a.observe(x, None, t0);
        assert_eq!(a.plan(t0, c, true), vec![(x, Action::Create)]);
        a.on_result(x, &Action::Create, t0, Ok(Some(rec(Some("gw-a"), 10))), done);
        a
    }

    /// `me`'s manager with liveness Leases, its own written at `t0` under
    /// epoch 1 (version 5).
    fn live_since(me: &str, t0: Instant) -> LeaseManager {
        let mut m = mgr(me);
        m.use_liveness(t0);
        let own = m.plan_liveness(t0).0.unwrap();
        let live = rec1(Some(me), 5);
        m.on_liveness_result(&own, t0, Ok(Some(live)), None, t0);
        m
    }

    /// `me`'s manager with liveness Leases (its own written at `t0` under
    /// epoch 1, version 5) holding `x` by a record it created at `t0`
    /// (version 10), among the candidates `c`. Returns it and its record.
    fn holding_by_liveness(
        me: &str,
        x: IpAddr,
        c: &BTreeMap<IpAddr, Vec<String>>,
        t0: Instant,
    ) -> (LeaseManager, LeaseRecord, LeaseRecord) {
        let mut m = live_since(me, t0);
        let live = m.liveness().and_then(Liveness::own).cloned().unwrap();
        m.observe(x, None, t0);
        assert_eq!(m.plan(t0, c, true), vec![(x, Action::Create)]);
        let mine = rec1(Some(me), 10);
        m.on_result(x, &Action::Create, t0, Ok(Some(mine.clone())), t0);
        assert!(m.held(t0).contains(&x));
        (m, live, mine)
    }

    /// With liveness Leases nothing renews an IP's record, so a deletion
    /// (by hand) would go unnoticed by a 404: once the watch has shown our
    /// record, its absence fences the IP. Before that, absence is the
    /// watch lagging our own create.
    #[test]
    fn with_liveness_a_deleted_record_fences_once_the_watch_had_shown_it() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let (mut a, _, mine) = holding_by_liveness("gw-a", x, &c, t0);
        a.observe(x, None, t0);
        assert!(a.held(t0).contains(&x), "the watch lags our create");
        a.observe(x, Some(mine), t0);
        a.observe(x, None, t0);
        assert!(!a.held(t0).contains(&x), "deleted after the watch showed it");
    }

    /// With liveness Leases a held IP's record is rewritten when what it
    /// should say of the peer channel changes (here its standby), once,
    /// without a take-over event, and not again while it says it.
    #[test]
    fn with_liveness_a_held_record_is_rewritten_when_its_standby_changes() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b", "gw-c"]);
        let (mut a, _, mut mine) = holding_by_liveness("gw-a", x, &c, t0);
        let fields = |standby: &str| HaFields {
            failsafe_peers: vec!["gw-b".into(), "gw-c".into()],
            incarnation: 7,
            standby: Some(standby.into()),
        };
        mine.failsafe = Some(gateways(&["gw-c", "gw-b"]));
        mine.incarnation = Some(7);
        mine.standby = Some("gw-b".into());
        mine.resource_version = "11".into();
        a.observe(x, Some(mine.clone()), t0);
        a.set_record_fields([(x, fields("gw-b"))].into());
        let t1 = t0 + P;
        assert_eq!(a.plan(t1, &c, true), vec![], "the record says what it should");
        a.set_record_fields([(x, fields("gw-c"))].into());
        let actions = a.plan(t1, &c, true);
        let [(_, rewrite @ Action::Acquire { keep_acquire_time: true, previous: None, .. })] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        assert_eq!(a.plan(t1, &c, true), vec![], "in flight");
        mine.standby = Some("gw-c".into());
        mine.resource_version = "12".into();
        let taken = a.on_result(x, rewrite, t1, Ok(Some(mine)), t1);
        assert_eq!(taken, None, "a rewrite is no take-over");
        assert!(a.held(t1).contains(&x));
        assert_eq!(a.plan(t1 + P, &c, true), vec![]);
    }

    /// With liveness Leases a held record written before the gateway read
    /// its DaemonSet is rewritten once to carry the DaemonSet as owner
    /// (an uninstall deletes the records through it), and not again while
    /// it does; a DaemonSet not known asks for nothing.
    #[test]
    fn with_liveness_a_held_record_without_its_owner_is_rewritten_once() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let (mut a, _, mut mine) = holding_by_liveness("gw-a", x, &c, t0);
        a.observe(x, Some(mine.clone()), t0);
        let t1 = t0 + P;
        assert_eq!(a.plan(t1, &c, true), vec![], "no owner known yet");
        let ds = Owner {
            api_version: "apps/v1".into(),
            kind: "DaemonSet".into(),
            name: "egret-gateway".into(),
            uid: "u-1".into(),
            ..Default::default()
        };
        a.set_record_owner(Some(ds.clone()));
        let actions = a.plan(t1, &c, true);
        let [(_, rewrite @ Action::Acquire { keep_acquire_time: true, previous: None, .. })] = actions.as_slice()
        else {
            panic!("{actions:?}")
        };
        mine.owners = vec![ds.clone()];
        mine.resource_version = "11".into();
        assert_eq!(a.on_result(x, rewrite, t1, Ok(Some(mine.clone())), t1), None, "a rewrite is no take-over");
        assert!(a.held(t1).contains(&x));
        assert_eq!(a.plan(t1 + P, &c, true), vec![], "it carries its owner");
        // The DaemonSet deleted and made again: a new uid.
        a.set_record_owner(Some(Owner { uid: "u-2".into(), ..ds }));
        assert!(matches!(a.plan(t1 + P + P, &c, true).as_slice(), [(_, Action::Acquire { .. })]));
    }

    /// A cold start with liveness Leases: the second-ranked gateway's turn
    /// for a free IP counts from when it saw the preferred gateway's
    /// liveness Lease come alive, not from when it saw the IP free (its
    /// own Lease was written first; before this rule it took the IP one
    /// retryPeriod after its start, while the preferred gateway had been
    /// able to take it for a few milliseconds: `k8s_drain` failed 2 of 3
    /// runs, and `k8s_scale`'s cold start went mostly to one gateway).
    #[test]
    fn with_liveness_a_free_ip_waits_for_the_better_candidates_turn_from_when_it_came_alive() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let mut b = live_since("gw-b", t0);
        b.observe(x, None, t0);
        let late = t0 + ms(400);
        let mut a_live = rec1(Some("gw-a"), 6);
        b.observe_liveness("gw-a", Some(a_live.clone()), late);
        let retry = LeaseTiming::default().retry_period;
        let idle = LeaseTiming::default().renew_deadline;
        assert_eq!(b.plan(t0 + retry, &c, true), vec![], "gw-a's turn: it came alive at +400 ms");
        // Its renewals do not restart the turn.
        a_live.resource_version = "7".into();
        b.observe_liveness("gw-a", Some(a_live), late + ms(300));
        renew_liveness(&mut b, late + ms(1500), 11);
        assert_eq!(b.plan(late + idle + retry - ms(1), &c, true), vec![]);
        let at = late + idle + retry;
        assert_eq!(b.plan(at, &c, true), vec![(x, Action::Create)], "gw-a did not take it in its turn");
        // A better one whose liveness Lease was never seen is waited for
        // leaseDuration after this gateway started (its cold start may be
        // slower), then the stagger runs.
        let d = LeaseTiming::default().lease_duration;
        let mut b2 = live_since("gw-b", t0);
        b2.observe(x, None, t0);
        renew_liveness(&mut b2, t0 + d - ms(100), 11);
        assert_eq!(b2.plan(t0 + d + retry - ms(1), &c, true), vec![]);
        assert_eq!(b2.plan(t0 + d + retry, &c, true), vec![(x, Action::Create)], "gw-a never came");
        // One seen but not alive (its Lease names nobody) counts for
        // nothing: the stagger counts from when the IP was seen free.
        let mut b3 = live_since("gw-b", t0);
        b3.observe(x, None, t0);
        b3.observe_liveness("gw-a", Some(rec(None, 6)), t0);
        assert_eq!(b3.plan(t0 + retry, &c, true), vec![(x, Action::Create)]);
    }

    /// Renews `m`'s liveness Lease at `at` if it is due (version `rv`).
    fn renew_liveness(m: &mut LeaseManager, at: Instant, rv: u64) {
        if let (Some(a), _) = m.plan_liveness(at) {
            let live = rec1(Some(m.me()), rv);
            m.on_liveness_result(&a, at, Ok(Some(live)), None, at);
        }
    }

    /// A better candidate seen creating or taking other IPs' records keeps
    /// a free IP's turn (a cold start of many IPs: 153/21/26 at 200 IPs),
    /// for at most `busy_cap` past when the IP was seen free.
    #[test]
    fn with_liveness_a_free_ip_waits_while_the_better_candidate_works_through_its_share() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let mut c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let mut b = live_since("gw-b", t0);
        b.observe(x, None, t0);
        let a_live = rec1(Some("gw-a"), 6);
        b.observe_liveness("gw-a", Some(a_live), t0);
        let retry = LeaseTiming::default().retry_period;
        // gw-a creates the records of other IPs, one every 300 ms.
        let mut rv = 100;
        let mut a_takes = |b: &mut LeaseManager, c: &mut BTreeMap<IpAddr, Vec<String>>, at: Instant| {
            rv += 1;
            let other = IpAddr::from([198, 51, 100, 100 + (rv % 100) as u8]);
            c.insert(other, vec!["gw-a".into()]);
            let r = rec1(Some("gw-a"), rv);
            b.observe(other, Some(r), at);
        };
        let idle = LeaseTiming::default().renew_deadline;
        a_takes(&mut b, &mut c, t0 + ms(300));
        assert_eq!(b.plan(t0 + retry, &c, true), vec![], "gw-a took another IP at +300 ms");
        renew_liveness(&mut b, t0 + ms(1500), 11);
        a_takes(&mut b, &mut c, t0 + ms(1600));
        renew_liveness(&mut b, t0 + ms(3000), 12);
        assert_eq!(b.plan(t0 + ms(1600) + idle + retry - ms(1), &c, true), vec![]);
        let at = t0 + ms(1600) + idle + retry;
        assert_eq!(b.plan(at, &c, true), vec![(x, Action::Create)], "gw-a stopped taking");
        // One that never stops holds the IP off for busy_cap at most.
        let mut b2 = live_since("gw-b", t0);
        b2.observe(x, None, t0);
        let a_live = rec1(Some("gw-a"), 6);
        b2.observe_liveness("gw-a", Some(a_live), t0);
        let cap = LeaseTiming::default().busy_cap();
        let mut at = t0;
        let mut own = 10;
        let created = loop {
            at += ms(250);
            own += 1;
            renew_liveness(&mut b2, at, own);
            a_takes(&mut b2, &mut c, at);
            let actions = b2.plan(at, &c, true);
            if actions.contains(&(x, Action::Create)) {
                break at;
            }
            assert!(at < t0 + cap + idle + retry + ms(250), "still waiting at +{} ms", (at - t0).as_millis());
        };
        assert!(created >= t0 + cap + idle + retry, "taken at +{} ms", (created - t0).as_millis());
    }

    /// The named standby takes a released record at once, also after it
    /// lost its own liveness Lease and took its next epoch (k8s_ha's drain
    /// after both-cut-holder).
    #[test]
    fn after_a_lost_liveness_the_named_standby_takes_a_released_record_at_once() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-b", "gw-a", "gw-c"]);
        let (mut b, _, _) = holding_by_liveness("gw-b", x, &c, t0);
        // Cut off: gw-a expires gw-b's liveness and takes x.
        let t1 = t0 + Duration::from_secs(10);
        b.fence(t1, &c.keys().copied().collect());
        let mut a_rec = rec(Some("gw-a"), 20);
        a_rec.epoch = Some(7);
        b.observe(x, Some(a_rec), t1);
        let mut a_live = rec(Some("gw-a"), 21);
        a_live.epoch = Some(7);
        b.observe_liveness("gw-a", Some(a_live), t1);
        let renew = b.plan_liveness(t1).0.unwrap();
        assert!(matches!(renew, LivenessAction::Renew { .. }));
        let (out, _) = b.on_liveness_result(&renew, t1, Err(Failure::Conflict), Some(rec(None, 22)), t1);
        assert_eq!(out, OwnOutcome::Lost);
        let again = b.plan_liveness(t1).0.unwrap();
        assert!(matches!(again, LivenessAction::Acquire { epoch: 2, .. }), "{again:?}");
        let mut live2 = rec(Some("gw-b"), 23);
        live2.epoch = Some(2);
        let t2 = t1 + Duration::from_millis(100);
        b.on_liveness_result(&again, t2, Ok(Some(live2)), None, t2);
        assert_eq!(b.plan(t2, &c, true), vec![]);
        // gw-a is drained: it releases x naming gw-b its standby.
        let t3 = t2 + Duration::from_secs(1);
        let mut released = rec(None, 30);
        released.epoch = Some(7);
        released.standby = Some("gw-b".into());
        b.observe(x, Some(released), t3);
        // A failsafe request gw-a sent before its release, received after.
        assert_eq!(b.promise(x, "gw-a", t3), Err(FailsafeRefusal::Released));
        let c2 = cands("198.51.100.10", &["gw-b", "gw-c"]);
        let actions = b.plan(t3, &c2, true);
        assert!(matches!(actions.as_slice(), [(_, Action::Acquire { .. })]), "{actions:?}");
    }

    /// A released record is handed over to the standby it names: no turn
    /// of a better-ranked candidate holds it off, however busy.
    #[test]
    fn the_named_standby_takes_a_released_record_while_a_better_candidate_is_busy() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-c", "gw-b"]);
        let mut b = live_since("gw-b", t0);
        let c_live = rec1(Some("gw-c"), 6);
        b.observe_liveness("gw-c", Some(c_live), t0);
        let other = rec1(Some("gw-c"), 7);
        b.observe(ip("198.51.100.11"), Some(other), t0);
        let mut released = rec1(None, 8);
        released.standby = Some("gw-b".into());
        b.observe(x, Some(released), t0);
        let actions = b.plan(t0, &c, true);
        assert!(matches!(actions.as_slice(), [(_, Action::Acquire { .. })]), "{actions:?}");
        // Released without naming it: gw-c's turn first.
        let mut b2 = live_since("gw-b", t0);
        let c_live = rec1(Some("gw-c"), 6);
        b2.observe_liveness("gw-c", Some(c_live), t0);
        let bare = rec1(None, 8);
        b2.observe(x, Some(bare), t0);
        assert_eq!(b2.plan(t0 + ms(600), &c, true), vec![]);
    }

    /// A pass fences an IP it stops competing for (a drain) and releases it
    /// in its plan; a liveness renewal answered in between does not serve
    /// it again.
    #[test]
    fn a_renewal_between_a_fence_and_the_plan_does_not_revive_what_was_given_up() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let (mut a, mut live, _) = holding_by_liveness("gw-a", x, &c, t0);
        let t1 = t0 + Duration::from_millis(600);
        assert_eq!(a.fence(t1, &BTreeSet::new()), vec![x], "drained: no longer competing");
        let renew = a.plan_liveness(t1).0.unwrap();
        live.resource_version = "6".into();
        let (_, revived) = a.on_liveness_result(&renew, t1, Ok(Some(live)), None, t1);
        assert!(revived.is_empty(), "{revived:?}");
        let c2 = cands("198.51.100.10", &["gw-b"]);
        assert!(matches!(a.plan(t1, &c2, true).as_slice(), [(_, Action::Release { .. })]));
    }

    /// An unused IP's record written under an epoch is deleted by others
    /// only once its holder serves it no more (issue 28 §4): a holder whose
    /// view of the policies lags keeps it valid by its liveness renewals.
    #[test]
    fn an_unused_epoch_record_is_garbage_only_once_its_holder_is_done() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let mut b = mgr("gw-b");
        b.use_liveness(t0);
        let mut r = rec(Some("gw-a"), 10);
        r.epoch = Some(3);
        b.observe(x, Some(r), t0);
        let mut live = rec(Some("gw-a"), 11);
        live.epoch = Some(3);
        live.duration = D;
        b.observe_liveness("gw-a", Some(live.clone()), t0);
        let none = BTreeMap::new();
        let late = t0 + D * 10;
        // gw-a renews: its liveness Lease keeps changing.
        let mut v = 11;
        let mut t = t0;
        while t < late {
            t += Duration::from_millis(500);
            v += 1;
            live.resource_version = v.to_string();
            b.observe_liveness("gw-a", Some(live.clone()), t);
            assert_eq!(b.plan(t, &none, true), vec![], "deleted while its holder renews");
        }
        // gw-a moved to its next epoch: the record is void, garbage after the usual wait.
        live.epoch = Some(4);
        live.resource_version = (v + 1).to_string();
        b.observe_liveness("gw-a", Some(live), late);
        assert!(matches!(b.plan(late, &none, true).as_slice(), [(_, Action::Delete { .. })]));
    }

    #[test]
    fn lease_names_are_valid_and_distinct() {
        assert_eq!(lease_name(ip("198.51.100.10")), "egret-ip4-198-51-100-10");
        assert_eq!(lease_name(ip("2001:db8::1")), "egret-ip6-2001-0db8-0000-0000-0000-0000-0000-0001");
        assert_eq!(lease_name(ip("2001:db8::")), "egret-ip6-2001-0db8-0000-0000-0000-0000-0000-0000");
    }

    #[test]
    fn timing_validation_keeps_the_margin() {
        assert_eq!(LeaseTiming::default().validate(), Ok(()));
        assert_eq!(LeaseTiming::default().margin(), Duration::from_secs(2));
        let t = LeaseTiming {
            lease_duration: Duration::from_secs(2),
            renew_deadline: Duration::from_secs(2),
            retry_period: P,
        };
        assert!(matches!(t.validate(), Err(TimingError::MarginTooSmall { .. })));
        assert_eq!(
            t.validate().unwrap_err().to_string(),
            "kubernetes.leaseDuration (2s) must exceed kubernetes.renewDeadline (2s) by at least 500ms (the fencing margin)"
        );
        let t = LeaseTiming { lease_duration: ms(4500), renew_deadline: R, retry_period: P };
        assert!(matches!(t.validate(), Err(TimingError::NotWholeSeconds { .. })));
        let t = LeaseTiming { lease_duration: D, renew_deadline: R, retry_period: R };
        assert!(matches!(t.validate(), Err(TimingError::RetryTooSlow { .. })));
    }

    #[test]
    fn preferred_creates_at_once_others_wait_their_rank() {
        let t0 = Instant::now();
        let c = cands("198.51.100.10", &["gw-a", "gw-b", "gw-c"]);
        let mut a = mgr("gw-a");
        let mut b = mgr("gw-b");
        let mut cc = mgr("gw-c");
        for m in [&mut a, &mut b, &mut cc] {
            m.observe(ip("198.51.100.10"), None, t0);
        }
        assert_eq!(a.plan(t0, &c, true), vec![(ip("198.51.100.10"), Action::Create)]);
        assert_eq!(b.plan(t0, &c, true), vec![]);
        assert_eq!(b.next_wake(t0), t0 + P, "rank 1 waits one retry period");
        assert_eq!(b.plan(t0 + P, &c, true), vec![(ip("198.51.100.10"), Action::Create)]);
        assert_eq!(cc.plan(t0 + P, &c, true), vec![]);
        assert_eq!(cc.plan(t0 + 2 * P, &c, true), vec![(ip("198.51.100.10"), Action::Create)]);
    }

    #[test]
    fn holder_renews_every_retry_period_and_fences_at_the_deadline() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let mut a = mgr("gw-a");
        a.observe(x, None, t0);
        let acts = a.plan(t0, &c, true);
        assert_eq!(acts, vec![(x, Action::Create)]);
        let taken = a.on_result(x, &Action::Create, t0, Ok(Some(rec(Some("gw-a"), 10))), t0 + ms(20));
        assert_eq!(taken, Some(Taken { ip: x, previous: None }));
        assert_eq!(a.held(t0 + ms(20)), [x].into());
        assert_eq!(a.plan(t0 + ms(20), &c, true), vec![], "renew waits for the retry period");
        let renew = a.plan(t0 + P, &c, true);
        assert_eq!(renew, vec![(x, Action::Renew { resource_version: "10".into() })]);
        // The API server is gone: the renewal never returns.
        let competing: BTreeSet<IpAddr> = [x].into();
        assert_eq!(a.fence(t0 + R - ms(1), &competing), Vec::<IpAddr>::new());
        assert_eq!(a.held(t0 + R - ms(1)), [x].into());
        assert_eq!(a.deadline(x), Some(t0 + R));
        assert!(a.next_wake(t0 + P) <= t0 + R);
        assert_eq!(a.fence(t0 + R, &competing), vec![x], "fenced exactly at t_send + renewDeadline");
        assert_eq!(a.held(t0 + R), BTreeSet::new());
        // The late renewal fails: still fenced, retries after the back-off.
        a.on_result(x, &renew[0].1, t0 + P, Err(Failure::Other("timeout".into())), t0 + R + ms(10));
        assert_eq!(a.held(t0 + R + ms(10)), BTreeSet::new());
    }

    #[test]
    fn a_deadline_fence_keeps_the_ip_dormant_until_its_lease_is_ours_again() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let competing: BTreeSet<IpAddr> = [x].into();
        let mut a = holding(x, &c, t0, t0 + ms(20));
        // A starved machine: no renewal answered before the deadline.
        assert_eq!(a.fence(t0 + R, &competing), vec![x]);
        assert_eq!(a.held(t0 + R), BTreeSet::new(), "served by nothing");
        assert_eq!(a.deadline(x), None, "the data plane is told it expired");
        assert_eq!(a.dormant(), [x].into(), "kept in the tables with its sessions");
        // Taken back at once: the Lease still names us, nobody may take it.
        let back = a.plan(t0 + R, &c, true);
        assert_eq!(
            back,
            vec![(
                x,
                Action::Acquire {
                    resource_version: "10".into(),
                    previous: None,
                    transitions: 0,
                    keep_acquire_time: true
                }
            )]
        );
        let sent = t0 + R + ms(5);
        let taken = a.on_result(x, &back[0].1, sent, Ok(Some(rec(Some("gw-a"), 12))), sent + ms(300));
        assert_eq!(taken, None, "the IP did not move: no take-over, no Event");
        assert_eq!(a.held(sent + ms(300)), [x].into());
        assert_eq!(a.dormant(), BTreeSet::new());
        assert_eq!(a.deadline(x), Some(sent + R), "counted from the take-back's send time");
    }

    #[test]
    fn a_dormant_ip_leaves_the_tables_once_the_lease_names_another_or_we_are_no_candidate() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let competing: BTreeSet<IpAddr> = [x].into();
        let dormant = || {
            let mut a = holding(x, &c, t0, t0);
            a.fence(t0 + R, &competing);
            assert_eq!(a.dormant(), [x].into());
            a
        };
        // Someone else's record (it took the IP once the Lease expired).
        let mut a = dormant();
        a.observe(x, Some(rec(Some("gw-b"), 11)), t0 + D);
        assert_eq!(a.dormant(), BTreeSet::new());
        // Released or deleted.
        let mut a = dormant();
        a.observe(x, Some(rec(None, 11)), t0 + D);
        assert_eq!(a.dormant(), BTreeSet::new());
        let mut a = dormant();
        let back = a.plan(t0 + R, &c, true);
        a.on_result(x, &back[0].1, t0 + R, Err(Failure::NotFound), t0 + R + ms(10));
        assert_eq!(a.dormant(), BTreeSet::new());
        // Not a candidate any more.
        let mut a = dormant();
        a.fence(t0 + R + ms(10), &BTreeSet::new());
        assert_eq!(a.dormant(), BTreeSet::new());
        // A take-back refused by a conflict: dormant until the watch shows
        // whose the newer record is.
        let mut a = dormant();
        let back = a.plan(t0 + R, &c, true);
        a.on_result(x, &back[0].1, t0 + R, Err(Failure::Conflict), t0 + R + ms(10));
        assert_eq!(a.dormant(), [x].into());
        assert_eq!(a.held(t0 + R + ms(10)), BTreeSet::new());
        a.observe(x, Some(rec(Some("gw-b"), 13)), t0 + R + ms(20));
        assert_eq!(a.dormant(), BTreeSet::new());
    }

    #[test]
    fn a_foreign_record_or_lost_candidacy_fences_without_dormancy() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let mut a = holding(x, &c, t0, t0);
        a.observe(x, Some(rec(Some("gw-b"), 11)), t0 + ms(100));
        assert_eq!(a.fence(t0 + ms(100), &[x].into()), Vec::<IpAddr>::new(), "observe already dropped it");
        assert_eq!(a.dormant(), BTreeSet::new());
        let mut a = holding(x, &c, t0, t0);
        assert_eq!(a.fence(t0 + ms(100), &BTreeSet::new()), vec![x]);
        assert_eq!(a.dormant(), BTreeSet::new(), "no longer a candidate: out of the tables");
    }

    /// Found by k8s_ha's drain in a CI run: a renewal sent before the
    /// drain's pass fenced the IP landed after it, and served the IP again
    /// until the next pass.
    #[test]
    fn a_renewal_that_lands_after_the_ip_was_given_up_does_not_serve_it_again() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let mut a = holding(x, &c, t0, t0);
        let (renew, _) = a.plan_renewals(t0 + P);
        assert_eq!(renew.len(), 1);
        // Drained: no longer a candidate, fenced without dormancy.
        assert_eq!(a.fence(t0 + P + ms(10), &BTreeSet::new()), vec![x]);
        a.on_result(x, &renew[0].1, t0 + P, Ok(Some(rec(Some("gw-a"), 11))), t0 + P + ms(50));
        assert_eq!(a.held(t0 + P + ms(50)), BTreeSet::new(), "given up: not served again");
        assert_eq!(a.deadline(x), None);
        assert_eq!(a.dormant(), BTreeSet::new());
        // The Lease names us: the next pass, where we are no candidate, releases it.
        let gone: BTreeMap<IpAddr, Vec<String>> = [(x, vec!["gw-b".to_string()])].into();
        let next = a.plan(t0 + P + ms(60), &gone, true);
        assert!(matches!(next.as_slice(), [(ip, Action::Release { .. })] if *ip == x), "{next:?}");
        // A deadline fence (dormant) is still taken back by a late renewal.
        let mut a = holding(x, &c, t0, t0);
        let (renew, _) = a.plan_renewals(t0 + P);
        a.fence(t0 + R, &[x].into());
        assert_eq!(a.dormant(), [x].into());
        a.on_result(x, &renew[0].1, t0 + P, Ok(Some(rec(Some("gw-a"), 11))), t0 + R + ms(5));
        assert_eq!(a.held(t0 + R + ms(5)), [x].into(), "resumed");
        assert_eq!(a.deadline(x), Some(t0 + P + R), "until its send time + R");
    }

    #[test]
    fn a_late_successful_renewal_counts_from_its_send_time() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a"]);
        let mut a = holding(x, &c, t0, t0);
        let renew = a.plan(t0 + P, &c, true);
        // Answered 1.8 s later: valid until send + R = t0 + 2.5 s, not answer + R.
        a.on_result(x, &renew[0].1, t0 + P, Ok(Some(rec(Some("gw-a"), 11))), t0 + P + ms(1800));
        assert_eq!(a.deadline(x), Some(t0 + P + R));
    }

    #[test]
    fn others_take_over_only_after_expiry_by_their_own_clock() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b", "gw-c"]);
        let mut b = mgr("gw-b");
        let mut cc = mgr("gw-c");
        // gw-a holds; b and c last saw a renewal at t0.
        b.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        cc.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        assert_eq!(b.plan(t0 + D - ms(1), &c, true), vec![]);
        assert_eq!(b.next_wake(t0 + D - ms(1)), t0 + D);
        // Excluding the holder, gw-b is rank 0 and gw-c rank 1.
        let acts = b.plan(t0 + D, &c, true);
        assert_eq!(
            acts,
            vec![(
                x,
                Action::Acquire {
                    resource_version: "10".into(),
                    previous: Some("gw-a".into()),
                    transitions: 1,
                    keep_acquire_time: false
                }
            )]
        );
        assert_eq!(cc.plan(t0 + D, &c, true), vec![]);
        assert_eq!(cc.plan(t0 + D + P - ms(1), &c, true), vec![]);
        assert_eq!(cc.plan(t0 + D + P, &c, true).len(), 1);
        let taken = b.on_result(x, &acts[0].1, t0 + D, Ok(Some(rec(Some("gw-b"), 11))), t0 + D + ms(5));
        assert_eq!(taken, Some(Taken { ip: x, previous: Some("gw-a".into()) }));
        // A renewal seen later restarts the clock of those still waiting.
        let mut b2 = mgr("gw-b");
        b2.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        b2.observe(x, Some(rec(Some("gw-a"), 12)), t0 + ms(3000));
        assert_eq!(b2.plan(t0 + D, &c, true), vec![]);
        assert_eq!(b2.plan(t0 + ms(3000) + D, &c, true).len(), 1);
        // The same record seen again does not.
        let mut b3 = mgr("gw-b");
        b3.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        b3.observe(x, Some(rec(Some("gw-a"), 10)), t0 + ms(3000));
        assert_eq!(b3.plan(t0 + D, &c, true).len(), 1);
    }

    /// The safety property with the default timing: the holder is out of its
    /// tables (fenced) strictly before any other gateway may take over, for
    /// every renewal pattern where the last success was sent at `s`.
    #[test]
    fn the_holder_always_fences_before_anyone_takes_over() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-b", "gw-a"]);
        let competing: BTreeSet<IpAddr> = [x].into();
        for last_ok_ms in [0u64, 400, 1000, 1700] {
            for seen_delay_ms in [0u64, 1, 300] {
                let mut a = mgr("gw-a");
                let mut b = mgr("gw-b");
                let sent = t0 + ms(last_ok_ms);
                a.observe(x, None, t0);
                a.on_result(x, &Action::Create, sent, Ok(Some(rec(Some("gw-a"), 7))), sent + ms(1));
                b.observe(x, Some(rec(Some("gw-a"), 7)), sent + ms(seen_delay_ms));
                // Find the first instant (1 ms steps) b would act, and when a fenced.
                let mut fenced_at = None;
                let mut take_at = None;
                for step in 0..10_000u64 {
                    let now = t0 + ms(step);
                    if fenced_at.is_none() && !a.fence(now, &competing).is_empty() {
                        fenced_at = Some(now);
                    }
                    if take_at.is_none() && !b.plan(now, &c, true).is_empty() {
                        take_at = Some(now);
                    }
                }
                let (f, tk) = (fenced_at.unwrap(), take_at.unwrap());
                assert_eq!(f, sent + R);
                assert!(tk >= f + (D - R), "take-over {tk:?} < fence {f:?} + margin");
            }
        }
    }

    #[test]
    fn a_foreign_record_fences_at_once_and_ours_is_taken_back() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let mut a = holding(x, &c, t0, t0);
        a.observe(x, Some(rec(Some("gw-b"), 11)), t0 + ms(100));
        assert_eq!(a.held(t0 + ms(100)), BTreeSet::new(), "someone else's record: stop serving");
        // After a restart the record still names us: take it back without waiting.
        let mut a2 = mgr("gw-a");
        a2.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        assert_eq!(
            a2.plan(t0, &c, true),
            vec![(
                x,
                Action::Acquire {
                    resource_version: "10".into(),
                    previous: None,
                    transitions: 0,
                    keep_acquire_time: true
                }
            )]
        );
    }

    #[test]
    fn not_a_candidate_any_more_fences_then_releases() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let mut a = holding(x, &cands("198.51.100.10", &["gw-a"]), t0, t0);
        // gw-a lost its gateway label: only gw-b is eligible now.
        let c = cands("198.51.100.10", &["gw-b"]);
        assert_eq!(a.plan(t0 + ms(10), &c, true), vec![], "no release while still in the tables");
        assert_eq!(a.fence(t0 + ms(10), &BTreeSet::new()), vec![x]);
        assert_eq!(a.plan(t0 + ms(10), &c, true), vec![(x, Action::Release { resource_version: "10".into() })]);
        // The IP is no longer used at all: delete.
        let mut a = mgr("gw-a");
        a.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        assert_eq!(a.plan(t0, &BTreeMap::new(), true), vec![(x, Action::Delete { resource_version: "10".into() })]);
    }

    #[test]
    fn failures_back_off_and_conflicts_do_not_grant() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a"]);
        let mut a = mgr("gw-a");
        a.observe(x, None, t0);
        let acts = a.plan(t0, &c, true);
        assert_eq!(a.plan(t0, &c, true), vec![], "one request in flight per IP");
        assert_eq!(a.on_result(x, &acts[0].1, t0, Err(Failure::Conflict), t0 + ms(5)), None);
        assert_eq!(a.held(t0 + ms(5)), BTreeSet::new());
        assert_eq!(a.plan(t0 + ms(5), &c, true), vec![]);
        assert_eq!(a.plan(t0 + ms(5) + P, &c, true), vec![(x, Action::Create)]);
    }
    /// Issue 14 item 7: a record's `leaseDurationSeconds` shorter than ours,
    /// missing or negative (read as 0 by `observe::lease_record`) must not
    /// let anyone take the Lease early; a longer one is honoured.
    #[test]
    fn take_over_waits_for_the_larger_of_the_records_and_our_duration() {
        // (record's duration, earliest take-over after the observed renewal)
        let cases: [(Duration, Duration, &str); 5] = [
            (Duration::ZERO, D, "missing or negative (read as 0): ours"),
            (Duration::from_secs(1), D, "shorter than ours: ours"),
            (D, D, "equal"),
            (Duration::from_secs(10), Duration::from_secs(10), "longer than ours: the record's"),
            (Duration::from_secs(3600), Duration::from_secs(3600), "much longer: the record's"),
        ];
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-b", "gw-a"]);
        for (record_duration, expected, what) in cases {
            let t0 = Instant::now();
            let mut b = mgr("gw-b");
            let mut r = rec(Some("gw-a"), 10);
            r.duration = record_duration;
            b.observe(x, Some(r), t0);
            assert_eq!(b.plan(t0 + expected - ms(1), &c, true), vec![], "{what}: too early");
            assert_eq!(b.plan(t0 + expected, &c, true).len(), 1, "{what}: due");
        }
        // Garbage collection of an unused IP's Lease waits for the same expiry.
        for (record_duration, expected, what) in cases {
            let t0 = Instant::now();
            let mut b = mgr("gw-b");
            let mut r = rec(Some("gw-a"), 10);
            r.duration = record_duration;
            b.observe(x, Some(r), t0);
            let unused = BTreeMap::new();
            assert_eq!(b.plan(t0 + expected + D - ms(1), &unused, true), vec![], "{what}: delete too early");
            assert_eq!(
                b.plan(t0 + expected + D, &unused, true),
                vec![(x, Action::Delete { resource_version: "10".into() })],
                "{what}: delete due"
            );
        }
    }

    /// Issue 16: a holder proven dead (its process ended, the node answered)
    /// is taken over without waiting for its Lease to expire, in rank order;
    /// a newer record (it restarted and took its Lease back) cancels that.
    #[test]
    fn a_dead_holder_is_taken_over_at_once_unless_it_came_back() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b", "gw-c"]);
        let mut b = mgr("gw-b");
        let mut cc = mgr("gw-c");
        let by = |inc: u64, rv: u64| LeaseRecord { incarnation: Some(inc), ..rec(Some("gw-a"), rv) };
        b.observe(x, Some(by(7, 10)), t0);
        cc.observe(x, Some(by(7, 10)), t0);
        assert_eq!(b.plan(t0 + ms(100), &c, true), vec![]);
        assert_eq!(b.holder_gone("gw-a", 8, t0 + ms(200)), Vec::<IpAddr>::new(), "another process of gw-a");
        assert_eq!(b.holder_gone("gw-x", 7, t0 + ms(200)), Vec::<IpAddr>::new(), "only the holder's IPs");
        assert_eq!(b.holder_gone("gw-a", 7, t0 + ms(200)), vec![x]);
        assert_eq!(b.plan(t0 + ms(200), &c, true).len(), 1, "rank 0: at once");
        cc.holder_gone("gw-a", 7, t0 + ms(200));
        assert_eq!(cc.plan(t0 + ms(200), &c, true), vec![], "rank 1 waits its stagger");
        assert_eq!(cc.plan(t0 + ms(200) + P, &c, true).len(), 1);
        // The holder restarted and renewed: its Lease is live again.
        let mut b2 = mgr("gw-b");
        b2.observe(x, Some(by(7, 10)), t0);
        b2.holder_gone("gw-a", 7, t0 + ms(200));
        b2.observe(x, Some(by(9, 11)), t0 + ms(250));
        assert_eq!(b2.plan(t0 + ms(300), &c, true), vec![]);
        assert_eq!(b2.plan(t0 + ms(250) + D, &c, true).len(), 1, "expiry rules again");
        // The proof arrives late, after the restarted process (incarnation 9)
        // renewed: it is about incarnation 7 and frees nothing.
        let mut b3 = mgr("gw-b");
        b3.observe(x, Some(by(9, 11)), t0);
        assert_eq!(b3.holder_gone("gw-a", 7, t0 + ms(10)), Vec::<IpAddr>::new());
        assert_eq!(b3.plan(t0 + ms(20), &c, true), vec![]);
        // Issue 28 §3: a renewal the dead process sent before it died, seen
        // after the proof, keeps the proof (it is the same incarnation).
        let mut b4 = mgr("gw-b");
        b4.observe(x, Some(by(7, 10)), t0);
        assert_eq!(b4.holder_gone("gw-a", 7, t0 + ms(200)), vec![x]);
        b4.observe(x, Some(by(7, 11)), t0 + ms(210));
        assert_eq!(b4.plan(t0 + ms(220), &c, true).len(), 1, "the late renewal did not cancel the proof");
    }

    /// Issue 28 §3, the right standby: gw-a held the IP with gw-c as its
    /// standby (named in the Lease); gw-b is preferred but holds no copy.
    /// While gw-c is connected, gw-b defers by leaseDuration, on a proof of
    /// death and on expiry alike; gw-c takes at its own rank. gw-b does not
    /// defer when gw-c is not connected, not a candidate, or when gw-b holds
    /// a copy itself, nor without the channel. A released Lease naming gw-c
    /// goes to gw-c at once.
    #[test]
    fn a_candidate_without_a_copy_defers_to_the_live_standby_the_lease_names() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b", "gw-c"]);
        let held = LeaseRecord { incarnation: Some(7), standby: Some("gw-c".into()), ..rec(Some("gw-a"), 10) };
        let with_view = |me: &str, up: &[&str], copies: &[IpAddr]| {
            let mut m = mgr(me);
            m.set_standby_view(gateways(up), copies.iter().copied().collect());
            m.observe(x, Some(held.clone()), t0);
            m
        };
        // On expiry.
        let mut b = with_view("gw-b", &["gw-a", "gw-c"], &[]);
        assert_eq!(b.plan(t0 + D, &c, true), vec![], "gw-b defers to gw-c");
        assert_eq!(b.plan(t0 + D + D - ms(1), &c, true), vec![]);
        assert_eq!(b.plan(t0 + D + D, &c, true).len(), 1, "then takes it if gw-c did not");
        let mut cc = with_view("gw-c", &["gw-a", "gw-b"], &[x]);
        assert_eq!(cc.plan(t0 + D + P, &c, true).len(), 1, "gw-c, the standby, at its rank");
        // On a proof of death.
        let mut b = with_view("gw-b", &["gw-c"], &[]);
        b.holder_gone("gw-a", 7, t0 + ms(200));
        assert_eq!(b.plan(t0 + ms(200), &c, true), vec![]);
        assert_eq!(b.plan(t0 + ms(200) + D, &c, true).len(), 1);
        let mut cc = with_view("gw-c", &["gw-b"], &[]);
        cc.holder_gone("gw-a", 7, t0 + ms(200));
        assert_eq!(cc.plan(t0 + ms(200) + P, &c, true).len(), 1, "the named standby never defers");
        // No deferral: the standby is not connected; gw-b holds a copy too;
        // gw-c is no candidate; no channel.
        let mut b = with_view("gw-b", &["gw-a"], &[]);
        assert_eq!(b.plan(t0 + D, &c, true).len(), 1, "gw-c not connected");
        let mut b = with_view("gw-b", &["gw-c"], &[x]);
        assert_eq!(b.plan(t0 + D, &c, true).len(), 1, "gw-b has a copy");
        let mut b = with_view("gw-b", &["gw-c"], &[]);
        assert_eq!(b.plan(t0 + D, &cands("198.51.100.10", &["gw-a", "gw-b"]), true).len(), 1, "gw-c no candidate");
        let mut b = mgr("gw-b");
        b.observe(x, Some(held.clone()), t0);
        assert_eq!(b.plan(t0 + D, &c, true).len(), 1, "without the channel");
        // A released Lease naming its standby (the holder handed gw-c a
        // complete copy before releasing: a drain, a graceful stop): gw-c
        // takes it at once although gw-b ranks first; gw-b defers to it
        // while gw-c is connected (beside two CPU hogs gw-b took a drained
        // IP first, without the sessions: every long-lived flow lost).
        let released = LeaseRecord { holder: None, resource_version: "11".into(), ..held.clone() };
        let mut b = with_view("gw-b", &["gw-c"], &[]);
        b.observe(x, Some(released.clone()), t0);
        assert_eq!(b.plan(t0 + P, &c, true), vec![], "released to gw-c: gw-b defers");
        assert_eq!(b.plan(t0 + P + D - ms(1), &c, true), vec![]);
        assert_eq!(b.plan(t0 + P + D, &c, true).len(), 1, "then takes it at its rank if gw-c did not");
        let mut cc = with_view("gw-c", &["gw-b"], &[x]);
        cc.observe(x, Some(released.clone()), t0);
        assert_eq!(cc.plan(t0, &c, true).len(), 1, "gw-c, the named standby, at once");
        // Released without a standby (no complete copy anywhere), or to one
        // that is not connected: taken by rank.
        let mut b = with_view("gw-b", &["gw-c"], &[]);
        b.observe(x, Some(LeaseRecord { standby: None, ..released.clone() }), t0);
        assert_eq!(b.plan(t0 + P, &c, true).len(), 1, "released, no standby: by rank (1 behind gw-a)");
        let mut b = with_view("gw-b", &["gw-a"], &[]);
        b.observe(x, Some(released), t0);
        assert_eq!(b.plan(t0 + P, &c, true).len(), 1, "released to a gw-c not connected: by rank");
    }

    /// Issue 28 §3: a holder no other gateway could vouch for (it named no
    /// failsafe peers) keeps its IP through an API outage for the lone bound
    /// only, and any gateway may take its Lease that long after it expired:
    /// a lone holder that died silently strands its IP for a stated time,
    /// not forever. The holder stops first, by the fencing margin.
    #[test]
    fn a_lone_holder_keeps_its_ip_for_the_lone_bound_and_no_longer() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let bound = Duration::from_secs(60);
        let t = LeaseTiming::default();
        let mut a = mgr("gw-a");
        a.set_lone_failsafe(bound);
        a.observe(x, None, t0);
        a.plan(t0, &cands("198.51.100.10", &["gw-a"]), true);
        let mut lone = rec(Some("gw-a"), 10);
        lone.failsafe = Some(BTreeSet::new());
        a.on_result(x, &Action::Create, t0, Ok(Some(lone.clone())), t0 + ms(5));
        // The API server is gone; a confirms alone every retry period.
        let competing: BTreeSet<IpAddr> = [x].into();
        let mut fenced_at = None;
        let mut now = t0;
        while now < t0 + bound * 2 {
            now += P;
            if fenced_at.is_none() && !a.fence(now, &competing).is_empty() {
                fenced_at = Some(now);
            }
            a.failsafe_confirmed(x, now);
        }
        let fenced_at = fenced_at.expect("the lone holder fenced");
        assert!(fenced_at >= t0 + bound, "kept through the outage for the bound: {:?}", fenced_at - t0);
        assert!(fenced_at <= t0 + bound + t.renew_deadline + P, "{:?}", fenced_at - t0);
        // Another gateway (added later, in another zone) sees the record at
        // t0 + 10 ms: free at expiry + bound, after the holder fenced.
        let mut n = mgr("gw-n");
        n.set_lone_failsafe(bound);
        n.observe(x, Some(lone.clone()), t0 + ms(10));
        n.set_gateways(gateways(&["gw-a", "gw-n"]));
        let c = cands("198.51.100.10", &["gw-a", "gw-n"]);
        let free = t0 + ms(10) + t.lease_duration + bound;
        assert_eq!(n.plan(free - ms(1), &c, true), vec![]);
        assert!(free >= fenced_at + t.lease_duration - t.renew_deadline - P, "fencing margin");
        assert_eq!(n.plan(free, &c, true).len(), 1, "stranded no longer than the bound");
    }

    /// Issue 16 (Patroni's failsafe): a promise keeps a peer from taking the
    /// IP for leaseDuration after the request arrived; the holder's own
    /// extension counts from its send time, so the fencing margin holds.
    #[test]
    fn failsafe_promises_hold_off_take_over_and_extend_the_holder() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b"]);
        let competing: BTreeSet<IpAddr> = [x].into();
        let mut a = holding(x, &c, t0, t0 + ms(5));
        let mut b = mgr("gw-b");
        b.observe(x, Some(rec(Some("gw-a"), 10)), t0 + ms(10));
        // The API server is gone for a: every retry period it asks b instead.
        let mut fenced_at = None;
        let mut taken_at = None;
        for step in 1..=40u64 {
            let sent = t0 + P * u32::try_from(step).unwrap();
            let arrived = sent + ms(30);
            if step <= 20 {
                assert_eq!(b.promise(x, "gw-a", arrived), Ok(()));
                assert!(a.failsafe_confirmed(x, sent) || fenced_at.is_some());
            }
            for now in [sent, arrived] {
                if fenced_at.is_none() && !a.fence(now, &competing).is_empty() {
                    fenced_at = Some(now);
                }
                if taken_at.is_none() && !b.plan(now, &c, true).is_empty() {
                    taken_at = Some(now);
                }
            }
        }
        let last_sent = t0 + P * 20;
        assert_eq!(fenced_at, Some(last_sent + R), "kept through the outage, fenced R after the last ack");
        let taken = taken_at.unwrap();
        assert!(taken >= fenced_at.unwrap() + (D - R), "take-over {taken:?} before fence + margin");
        // Refusals: someone else's record, our own IP, a request in flight.
        let mut b = mgr("gw-b");
        b.observe(x, Some(rec(Some("gw-c"), 12)), t0);
        assert_eq!(b.promise(x, "gw-a", t0), Err(FailsafeRefusal::OtherHolder("gw-c".into())));
        let mut a2 = mgr("gw-a");
        a2.observe(x, None, t0);
        a2.plan(t0, &c, true);
        a2.on_result(x, &Action::Create, t0, Ok(Some(rec(Some("gw-a"), 10))), t0 + ms(5));
        assert_eq!(a2.promise(x, "gw-b", t0 + ms(100)), Err(FailsafeRefusal::HeldHere));
        let mut b = mgr("gw-b");
        b.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        assert_eq!(b.plan(t0 + D, &c, true).len(), 1);
        assert_eq!(b.promise(x, "gw-a", t0 + D), Err(FailsafeRefusal::InFlight));
        // A holder that was fenced is not extended by a late confirmation
        // (a was fenced in the loop above), nor is an IP it never had.
        assert!(a.held(t0 + P * 40).is_empty());
        assert!(!a.failsafe_confirmed(x, t0 + P * 40));
        assert!(a.held(t0 + P * 40).is_empty());
        assert!(!a.failsafe_confirmed(ip("198.51.100.99"), t0));
    }

    /// A peer restarting during an API outage: the promise its previous
    /// process gave (and wrote down) is kept exactly like a live one. The
    /// restarted gw-b, most preferred and seeing no Lease (the API server is
    /// away, or the Lease is gone), creates nothing before the promise ends;
    /// a newer record naming another holder cancels it, as it does a live
    /// one.
    #[test]
    fn a_restored_promise_holds_off_take_over_like_a_live_one() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-b", "gw-a"]);
        let until = t0 + ms(3_000);
        let mut b = mgr("gw-b");
        b.restore_promise(x, "gw-a", until, t0);
        assert_eq!(b.promises(t0), vec![(x, "gw-a".to_string(), until)]);
        for step in 0..6u32 {
            assert_eq!(b.plan(t0 + P * step, &c, true), vec![], "taken at {step} x P, inside the promise");
        }
        assert_eq!(b.plan(until, &c, true), vec![(x, Action::Create)], "free once it ended");
        assert!(b.promises(until).is_empty(), "an ended promise is not written again");
        // The Lease seen again, still naming gw-a: the promise stays.
        let mut b = mgr("gw-b");
        b.restore_promise(x, "gw-a", until, t0);
        b.observe(x, Some(rec(Some("gw-a"), 10)), t0 + ms(10));
        assert_eq!(b.promises(t0 + ms(10)).len(), 1);
        // Naming gw-c: cancelled.
        b.observe(x, Some(rec(Some("gw-c"), 11)), t0 + ms(20));
        assert!(b.promises(t0 + ms(20)).is_empty());
        // A live promise to the same holder is kept to the later end.
        let mut b = mgr("gw-b");
        assert_eq!(b.promise(x, "gw-a", t0), Ok(()));
        b.restore_promise(x, "gw-a", t0 + ms(100), t0);
        assert_eq!(b.promises(t0), vec![(x, "gw-a".to_string(), t0 + D)]);
    }

    /// Patroni's rule: only gateways the holder lists (those it asks through
    /// an outage) may take its expired Lease; released or dead, anyone may.
    #[test]
    fn only_listed_failsafe_peers_take_an_expired_lease() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let c = cands("198.51.100.10", &["gw-a", "gw-b", "gw-n"]);
        let mut r = rec(Some("gw-a"), 10);
        r.failsafe = Some(["gw-b".to_string()].into());
        r.incarnation = Some(3);
        let mut n = mgr("gw-n");
        n.observe(x, Some(r.clone()), t0);
        assert_eq!(n.plan(t0 + D * 10, &c, true), vec![], "gw-n is not listed");
        n.holder_gone("gw-a", 3, t0 + D * 10);
        assert_eq!(n.plan(t0 + D * 10 + P, &c, true).len(), 1, "a dead holder's Lease: listed or not");
        let mut b = mgr("gw-b");
        b.observe(x, Some(r), t0);
        assert_eq!(b.plan(t0 + D, &c, true).len(), 1, "gw-b is listed");
    }

    /// Review finding 3: the rule above stranded the IP when every listed
    /// gateway was gone (its Node deleted, or no longer a candidate for the
    /// IP). The escape: once none of them is still there, anyone may take
    /// the expired Lease, leaseDuration after it saw that; a drained one is
    /// still there (it takes nothing, but it runs and may have promised),
    /// and so is everyone while the gateways are not known.
    #[test]
    fn the_failsafe_rule_frees_an_ip_whose_listed_peers_are_all_gone_but_not_drained() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let y = ip("198.51.100.11");
        let mut r = rec(Some("gw-a"), 10);
        r.failsafe = Some(["gw-b".to_string()].into());
        let late = t0 + D * 10;
        // gw-b's Node was deleted: only gw-a (silent) and gw-n are left.
        let c = cands("198.51.100.10", &["gw-a", "gw-n"]);
        let mut n = mgr("gw-n");
        n.observe(x, Some(r.clone()), t0);
        assert_eq!(n.plan(late, &c, true), vec![], "gateways not known yet: the rule holds");
        n.set_gateways(gateways(&["gw-a", "gw-n"]));
        assert_eq!(n.plan(late + ms(1), &c, true), vec![], "gone: not before leaseDuration after seeing it");
        assert_eq!(n.plan(late + ms(1) + D - ms(1), &c, true), vec![]);
        let acts = n.plan(late + ms(1) + D, &c, true);
        assert!(matches!(acts.as_slice(), [(ip, Action::Acquire { .. })] if *ip == x), "{acts:?}");
        // gw-b runs but is no longer a candidate for x (it is for y): gone too.
        let mut c2 = c.clone();
        c2.insert(y, vec!["gw-b".into()]);
        let mut n = mgr("gw-n");
        n.observe(x, Some(r.clone()), t0);
        n.set_gateways(gateways(&["gw-a", "gw-b", "gw-n"]));
        assert_eq!(n.plan(late, &c2, true), vec![]);
        assert_eq!(n.plan(late + D, &c2, true).len(), 1);
        // gw-b is drained: a candidate for nothing, but its Node is there.
        let mut n = mgr("gw-n");
        n.observe(x, Some(r.clone()), t0);
        n.set_gateways(gateways(&["gw-a", "gw-b", "gw-n"]));
        for k in 0..20u32 {
            assert_eq!(n.plan(late + P * k, &c, true), vec![], "a drained listed peer keeps the rule");
        }
        // gw-b deleted, then back as a candidate before the wait ran out: the rule again.
        let mut n = mgr("gw-n");
        n.observe(x, Some(r.clone()), t0);
        n.set_gateways(gateways(&["gw-a", "gw-n"]));
        assert_eq!(n.plan(late, &c, true), vec![]);
        let back = cands("198.51.100.10", &["gw-a", "gw-b", "gw-n"]);
        n.set_gateways(gateways(&["gw-a", "gw-b", "gw-n"]));
        assert_eq!(n.plan(late + D / 2, &back, true), vec![]);
        assert_eq!(n.plan(late + D * 2, &back, true), vec![], "gw-b is listed and there");
        // A holder alone (it listed nobody) keeps its IP through an outage
        // with nobody's promise, for the lone bound (default 5 min): no
        // escape before it, it may be serving.
        let mut alone = rec(Some("gw-a"), 10);
        alone.failsafe = Some(BTreeSet::new());
        let mut n = mgr("gw-n");
        n.observe(x, Some(alone), t0);
        n.set_gateways(gateways(&["gw-a", "gw-n"]));
        assert_eq!(n.plan(late, &c, true), vec![]);
        assert_eq!(n.plan(late + D * 2, &c, true), vec![]);
        assert_eq!(n.plan(t0 + D + DEFAULT_LONE_FAILSAFE, &c, true).len(), 1, "free after the lone bound");
    }

    /// The other half of the escape: a gateway that is no longer a
    /// candidate for an IP (by its own view) refuses failsafe requests for
    /// it, so the holder it no longer vouches for fences.
    #[test]
    fn a_gateway_that_is_not_a_candidate_promises_nothing() {
        let t0 = Instant::now();
        let x = ip("198.51.100.10");
        let mut b = mgr("gw-b");
        b.observe(x, Some(rec(Some("gw-a"), 10)), t0);
        assert_eq!(b.promise(x, "gw-a", t0), Ok(()), "before any plan: not known, accepted");
        b.plan(t0, &cands("198.51.100.10", &["gw-a", "gw-b"]), true);
        assert_eq!(b.promise(x, "gw-a", t0 + ms(10)), Ok(()));
        b.plan(t0 + ms(20), &cands("198.51.100.10", &["gw-a", "gw-n"]), true);
        assert_eq!(b.promise(x, "gw-a", t0 + ms(30)), Err(FailsafeRefusal::NotCandidate));
        b.plan(t0 + ms(40), &BTreeMap::new(), true);
        assert_eq!(b.promise(x, "gw-a", t0 + ms(50)), Err(FailsafeRefusal::NotCandidate), "the IP is not in use");
    }

    /// Issue 14 item 7: when the tables of a pass could not be applied, the
    /// data plane may still serve an IP the state machine fenced: no Release
    /// or Delete goes out until an apply succeeds; other actions go on.
    #[test]
    fn nothing_is_given_up_while_the_tables_are_not_applied() {
        let x = ip("198.51.100.10");
        let y = ip("198.51.100.11");
        struct Case {
            what: &'static str,
            candidates: BTreeMap<IpAddr, Vec<String>>,
            given_up: Action,
        }
        let cases = [
            Case {
                what: "no longer a candidate: release",
                candidates: cands("198.51.100.10", &["gw-b"]),
                given_up: Action::Release { resource_version: "10".into() },
            },
            Case {
                what: "no longer in use: delete",
                candidates: BTreeMap::new(),
                given_up: Action::Delete { resource_version: "10".into() },
            },
        ];
        for case in cases {
            let t0 = Instant::now();
            let mut a = holding(x, &cands("198.51.100.10", &["gw-a"]), t0, t0);
            let mut c = case.candidates.clone();
            c.insert(y, vec!["gw-a".into()]);
            let competing: BTreeSet<IpAddr> =
                c.iter().filter(|(_, v)| v.contains(&"gw-a".to_string())).map(|(k, _)| *k).collect();
            assert_eq!(a.fence(t0 + ms(10), &competing), vec![x], "{}", case.what);
            // The fencing apply failed: the other IP is still created, x is kept.
            let acts = a.plan(t0 + ms(10), &c, false);
            assert_eq!(acts, vec![(y, Action::Create)], "{}: nothing given up", case.what);
            assert!(a.next_wake(t0 + ms(10)) <= t0 + ms(10) + P, "{}: retried", case.what);
            assert_eq!(a.plan(t0 + ms(20), &c, false), vec![], "{}: still kept", case.what);
            // An apply succeeded: now it goes.
            assert_eq!(a.plan(t0 + ms(30), &c, true), vec![(x, case.given_up)], "{}", case.what);
        }
    }
}
