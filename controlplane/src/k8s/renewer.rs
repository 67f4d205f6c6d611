//! Lease renewals on a task of their own (issue 28 §2).
//!
//! Before this, the sync loop planned renewals at the end of each pass,
//! after applying tables (an `nft` run may take up to its 5 s timeout) and
//! installing the sessions of IPs just taken over (1.2 M sessions take
//! 0.8-1.9 s). A pass longer than `renewDeadline` let every held IP's
//! deadline pass: the next pass fenced them, deleted their sessions, and a
//! take-over that had kept its flows lost them all (seen on a loaded
//! machine). Now:
//!
//! - the renewer task plans and sends renewals ([`LeaseManager::plan_renewals`])
//!   every `retryPeriod`, takes their results into the Lease state machine
//!   and pushes the new deadlines to the data plane ([`ValidUntil`]) itself;
//! - the sync loop runs its applies and imports off the runtime's thread
//!   (`spawn_blocking`), so the renewer, the channel's heartbeats and the
//!   Lease requests run while a pass waits for them.
//!
//! The sync loop still creates, acquires, releases and deletes Leases (those
//! must follow its applies), still fences, and tells the renewer what each
//! Lease carries besides its holder ([`RenewInputs`]: the next hop, the
//! failsafe peers).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use parking_lot::Mutex;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use super::controller::{send_lease_request, LeaseResult};
use super::lease::{Failure, HaFields, LeaseManager, LeaseRecord};
use super::liveness::{LivenessAction, OwnOutcome};
use super::liveness_requests::{send_liveness_request, LivenessResult};
use super::valid_until::ValidUntil;
use super::K8sOptions;

/// What a renewal of one IP's Lease writes besides its holder.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RenewInput {
    /// The companion next hop (annotation).
    pub next_hop: Option<IpAddr>,
    /// The failsafe peers, this process's incarnation and the standby
    /// (with `kubernetes.ha`).
    pub ha: Option<HaFields>,
    /// The holder's epoch (with liveness Leases, ADR 0016): a record
    /// written under it carries it.
    pub epoch: Option<u64>,
}

/// The renewals' state the sync loop reads (failsafe, status).
#[derive(Debug, Default)]
pub struct RenewBook {
    /// When each outstanding renewal was sent.
    pub sent: BTreeMap<IpAddr, Instant>,
    /// Held IPs whose last renewal failed (API error or conflict).
    pub failing: BTreeSet<IpAddr>,
    /// Renewals that failed for want of an API server.
    pub api_errors: u64,
    /// Renewals that met a newer record.
    pub conflicts: u64,
    /// How long renewals took to be answered (or to fail).
    pub latency: crate::view::Latencies,
    /// With liveness Leases: when the outstanding write of this gateway's
    /// liveness Lease was sent.
    pub liveness_sent: Option<Instant>,
    /// With liveness Leases: the last write of this gateway's liveness
    /// Lease failed (every held IP's renewal fails with it).
    pub liveness_failing: bool,
    /// A renewal the API server answered that the Lease watch has not
    /// shown yet: the oldest such, kept until the watch shows it (the sync
    /// loop restarts a watch that lags it: [`WatchProbe`]).
    pub probe: Option<WatchProbe>,
}

/// A successful write of a Lease, to see the Lease watch show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WatchProbe {
    /// The egress IP whose Lease it was (None: this gateway's liveness Lease).
    pub ip: Option<IpAddr>,
    /// The `resourceVersion` the write returned.
    pub resource_version: u64,
    /// When its answer came.
    pub answered: Instant,
}

impl RenewBook {
    /// Notes a write answered at `now` with `record`, unless an older one
    /// is still unseen by the watch.
    fn note_written(&mut self, ip: Option<IpAddr>, record: Option<&LeaseRecord>, now: Instant) {
        let Some(rv) = record.and_then(|r| r.resource_version.parse().ok()) else { return };
        self.probe.get_or_insert(WatchProbe { ip, resource_version: rv, answered: now });
    }

    /// Whether `ip`'s renewals fail: the last one failed, or one has been
    /// unanswered for a retry period (a dead API server may not refuse).
    pub fn failing(&self, ip: IpAddr, now: Instant, retry_period: std::time::Duration) -> bool {
        let late = |t: &Instant| now >= *t + retry_period;
        self.failed(ip) || self.sent.get(&ip).is_some_and(late) || self.liveness_sent.as_ref().is_some_and(late)
    }

    /// Whether the last renewal of `ip` (or of the liveness Lease) failed.
    pub fn failed(&self, ip: IpAddr) -> bool {
        self.liveness_failing || self.failing.contains(&ip)
    }
}

/// The renewer's task, aborted when dropped: renewals must never outlive
/// the sync loop that fences (a control plane dropped where it stands, its
/// renewer still renewing, would keep its IPs from everyone).
#[derive(Debug)]
pub struct RenewTask(pub tokio::task::JoinHandle<()>);

impl Drop for RenewTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the sync loop and the renewer share.
#[derive(Clone, Debug)]
pub struct Renewer {
    /// Per IP in use: what its Lease carries (written by each pass).
    pub inputs: Arc<Mutex<BTreeMap<IpAddr, RenewInput>>>,
    /// The renewals' state.
    pub book: Arc<Mutex<RenewBook>>,
}

impl Renewer {
    /// A renewer for `mgr`, whose [`LeaseManager::plan`] stops planning
    /// renewals from now on.
    pub fn new(mgr: &Mutex<LeaseManager>) -> Renewer {
        mgr.lock().renew_elsewhere();
        Renewer { inputs: Arc::default(), book: Arc::default() }
    }

    /// Runs until the task is aborted. `wake` is the sync loop's: it runs a
    /// pass after a failed renewal (a failsafe round) or a lost Lease.
    pub async fn run(
        self,
        mgr: Arc<Mutex<LeaseManager>>,
        api: Api<Lease>,
        opts: K8sOptions,
        valid_until: Arc<Mutex<ValidUntil>>,
        wake: Arc<Notify>,
    ) {
        let (tx, mut rx) = mpsc::unbounded_channel::<LeaseResult>();
        let (ltx, mut lrx) = mpsc::unbounded_channel::<LivenessResult>();
        loop {
            let now = Instant::now();
            let (own, next_own) = mgr.lock().plan_liveness(now);
            if let Some(action) = own {
                let prev = mgr.lock().liveness().and_then(|l| l.own()).cloned();
                self.book.lock().liveness_sent = Some(now);
                let (api, opts, ltx) = (api.clone(), opts.clone(), ltx.clone());
                tokio::spawn(async move {
                    let _ = ltx.send(send_liveness_request(api, opts, action, prev).await);
                });
            }
            let (actions, next) = mgr.lock().plan_renewals(now);
            let next = next.min(next_own);
            for (ip, action) in actions {
                let input = self.inputs.lock().get(&ip).cloned().unwrap_or_default();
                let prev = mgr.lock().record(ip).cloned();
                self.book.lock().sent.entry(ip).or_insert(now);
                let (api, opts, tx) = (api.clone(), opts.clone(), tx.clone());
                tokio::spawn(async move {
                    let r = send_lease_request(api, opts, ip, input, prev, action).await;
                    let _ = tx.send(r);
                });
            }
            tokio::select! {
                () = tokio::time::sleep_until(next) => {}
                Some(r) = lrx.recv() => self.on_liveness_result(&mgr, &valid_until, &wake, r),
                Some(r) = rx.recv() => {
                    self.on_result(&mgr, &valid_until, &wake, r);
                    while let Ok(r) = rx.try_recv() {
                        self.on_result(&mgr, &valid_until, &wake, r);
                    }
                }
            }
        }
    }

    fn on_liveness_result(
        &self,
        mgr: &Mutex<LeaseManager>,
        valid_until: &Mutex<ValidUntil>,
        wake: &Notify,
        r: LivenessResult,
    ) {
        let now = Instant::now();
        let took = now.saturating_duration_since(r.sent);
        {
            let mut book = self.book.lock();
            book.liveness_sent = None;
            book.latency.record(took);
            match &r.result {
                Ok(written) => {
                    book.liveness_failing = false;
                    book.note_written(None, written.as_ref(), now);
                }
                Err(f) => {
                    tracing::debug!(ms = took.as_millis() as u64, failure = ?f, "liveness renewal failed");
                    if matches!(f, Failure::Conflict) {
                        book.conflicts += 1;
                    } else {
                        book.api_errors += 1;
                    }
                    book.liveness_failing = true;
                }
            }
        }
        let taken =
            matches!(r.action, LivenessAction::Create { .. } | LivenessAction::Acquire { .. }) && r.result.is_ok();
        let (out, revived) = mgr.lock().on_liveness_result(&r.action, r.sent, r.result, r.fresh, now);
        if taken {
            let epoch = mgr.lock().liveness().map(|l| l.epoch());
            tracing::info!(epoch, ms = took.as_millis() as u64, "liveness Lease taken");
        }
        valid_until.lock().push(mgr, None);
        match out {
            // Taken: the IPs waiting for a valid liveness are decided now,
            // not at their next retry (a preferred gateway would lose its
            // turn to the next candidate's stagger).
            OwnOutcome::Renewed { .. } if revived.is_empty() && taken => wake.notify_one(),
            OwnOutcome::Renewed { .. } if revived.is_empty() => {}
            OwnOutcome::Renewed { .. } => {
                tracing::info!(ips = ?revived, "served again: the liveness Lease was renewed under the epoch their Leases name");
                wake.notify_one();
            }
            OwnOutcome::Lost => {
                tracing::warn!("liveness Lease lost (expired by a peer, or deleted): a new epoch is taken");
                wake.notify_one();
            }
            OwnOutcome::Failed => wake.notify_one(),
        }
    }

    fn on_result(&self, mgr: &Mutex<LeaseManager>, valid_until: &Mutex<ValidUntil>, wake: &Notify, r: LeaseResult) {
        let now = Instant::now();
        let ok = r.result.is_ok();
        let took = now.saturating_duration_since(r.sent);
        let ms = took.as_millis() as u64;
        {
            let mut book = self.book.lock();
            book.sent.remove(&r.ip);
            book.latency.record(took);
            match &r.result {
                Ok(_) | Err(Failure::NotFound) => {
                    tracing::debug!(ip = %r.ip, ms, "lease renewed");
                    book.failing.remove(&r.ip);
                    if let Ok(written) = &r.result {
                        book.note_written(Some(r.ip), written.as_ref(), now);
                    }
                }
                Err(f) => {
                    tracing::debug!(ip = %r.ip, ms, failure = ?f, "lease renewal failed");
                    if matches!(f, Failure::Conflict) {
                        book.conflicts += 1;
                    } else {
                        book.api_errors += 1;
                    }
                    book.failing.insert(r.ip);
                }
            }
        }
        {
            let mut m = mgr.lock();
            m.on_result(r.ip, &r.action, r.sent, r.result, now);
            if let Some(fresh) = r.fresh {
                // Newer than the watch: one naming someone else fences at once.
                m.observe(r.ip, Some(fresh), now);
            }
        }
        valid_until.lock().push(mgr, None);
        if !ok {
            wake.notify_one();
        }
    }
}
