//! Gateways that lose nothing (issue 16, ADR 0012): the channel between
//! gateways and what runs over it.
//!
//! | file | owns |
//! |---|---|
//! | `auth.rs` | the shared key, the handshake's proofs, sealing frames |
//! | `keys.rs` | the keys held while one rolls out (primary, accepted), re-read from their files |
//! | `channel.rs` | one authenticated connection per pair of gateways; how each ended |
//! | `death.rs` | which ends prove a peer's process died (a signed FIN; a signed RST not followed by the same process's return; a new incarnation) |
//! | `messages.rs` | what the frames mean |
//! | `replicate.rs` | the holder's side of session sync: standbys, full copies, incremental changes |
//! | `standby.rs` | the standby's shadow sessions, installed when it takes an IP over |
//! | `memory.rs` | how many sessions a standby may keep: a quarter of the memory limit |
//! | `failsafe.rs` | the holder's side of Patroni's failsafe: keep an IP through an API outage while every other eligible gateway agrees |
//! | `promises.rs` | failsafe promises written at a graceful stop and kept by the next process (a peer restarting during an API outage) |
//!
//! The Lease stays the authority on who owns an IP; the channel only adds
//! evidence and state:
//! - a peer whose process died ([`death`]: a signed FIN without goodbye, or
//!   a signed RST after which the same process does not come back) loses its
//!   Leases to the next candidate at once
//!   ([`crate::k8s::lease::LeaseManager::holder_gone`]), instead of after
//!   leaseDuration;
//! - a holder that cannot reach the API server keeps its IPs while all other
//!   eligible gateways promise not to take them
//!   ([`crate::k8s::lease::LeaseManager::promise`]);
//! - the standby of each IP holds a copy of its sessions and installs it on
//!   take-over, so flows keep their ports.
//!
//! [`Ha::start`] runs one task: channel events, a 20 ms tick (journal ->
//! incremental changes, due full copies) and the sync loop's [`View`]. The
//! sync loop itself starts failsafe rounds ([`Ha::failsafe_round`]), so they
//! stop when it stops.

pub mod auth;
pub mod channel;
pub mod death;
pub mod failsafe;
pub mod keys;
pub mod memory;
pub mod messages;
pub mod promises;
pub mod replicate;
pub mod standby;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use egret_dataplane::nat::sync::{ImportReport, SessionRecord, SyncEvent};
use parking_lot::Mutex;
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use self::channel::{ChannelConfig, End, PeerEvent, PeerStatus, Peers};
use self::death::{Dead, Deaths};
use self::failsafe::Failsafe;
use self::messages::Message;
use self::replicate::{ReplicaStatus, Replicator};
use self::standby::{ShadowStatus, Standby};
use crate::k8s::lease::LeaseManager;

/// The channel's TCP port when `kubernetes.ha.port` is not set.
pub const DEFAULT_PORT: u16 = 4720;
/// How often the task looks at the journal and the due copies.
const TICK: Duration = Duration::from_millis(20);
/// Journal events taken per tick.
const DRAIN_MAX: usize = 65_536;

/// The data plane's sessions, as session sync needs them (the daemon's
/// sink implements it over the engine).
pub trait SessionStore: Send + Sync + 'static {
    /// Takes up to `max` changes from the journal (turning it on at the first call).
    fn drain(&self, max: usize) -> Vec<SyncEvent>;
    /// Changes lost to a full journal so far.
    fn overflows(&self) -> u64;
    /// Every live session translating to `ip`.
    fn export(&self, ip: IpAddr) -> Vec<SessionRecord>;
    /// Installs sessions of an IP just taken over (its tables applied).
    fn import(&self, records: &[SessionRecord]) -> ImportReport;
}

/// `kubernetes.ha`, resolved.
#[derive(Clone, Debug)]
pub struct HaOptions {
    /// The channel's address on this gateway.
    pub listen: SocketAddr,
    /// The port on every gateway.
    pub port: u16,
    /// The keys, the primary first.
    pub keys: Arc<keys::KeyRing>,
    /// Their files, re-read every [`keys::CHECK_PERIOD`] (None: fixed keys).
    pub key_files: Option<keys::KeyFiles>,
    /// Liveness of a silent peer.
    pub liveness: Duration,
    /// Full copy period.
    pub resync_period: Duration,
    /// Where the last known peer set is kept across restarts (so a gateway
    /// restarted while the API server is down still reaches its peers).
    pub peer_cache: Option<PathBuf>,
    /// How long a holder no other gateway can vouch for keeps an IP through
    /// an API outage ([`LeaseManager::set_lone_failsafe`]).
    pub lone_failsafe: Duration,
}

impl PartialEq for HaOptions {
    fn eq(&self, o: &Self) -> bool {
        self.listen == o.listen
            && self.port == o.port
            && self.liveness == o.liveness
            && self.resync_period == o.resync_period
            && self.peer_cache == o.peer_cache
            && self.lone_failsafe == o.lone_failsafe
            && self.key_files == o.key_files
            && self.keys.ids() == o.keys.ids()
    }
}
impl Eq for HaOptions {}

/// What the sync loop tells the channel task after each pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct View {
    /// Every other gateway and its channel address.
    pub peers: BTreeMap<String, SocketAddr>,
    /// Each IP this gateway holds, with the other gateways eligible for it
    /// (most preferred first).
    pub held: BTreeMap<IpAddr, Vec<String>>,
    /// Held IPs whose renewals fail for want of an API server.
    pub failing: BTreeSet<IpAddr>,
    /// The Lease holder of every IP as last seen.
    pub holders: BTreeMap<IpAddr, Option<String>>,
    /// The Lease timing's retry period (failsafe rounds).
    pub retry_period: Duration,
}

/// Counters, for metrics.
#[derive(Debug, Default)]
pub struct HaCounters {
    /// Peers proven dead ([`death`]).
    pub peers_gone: AtomicU64,
    /// Channels reset without goodbye whose peer came back as the same
    /// process (an abort on a node, `ss -K`): not taken for deaths.
    pub peer_resets_survived: AtomicU64,
    /// IPs that became free early because their holder died.
    pub early_takeovers_allowed: AtomicU64,
    /// Failsafe requests answered with acceptance (per IP).
    pub promises_given: AtomicU64,
    /// Failsafe requests refused (per IP).
    pub promises_refused: AtomicU64,
    /// Shadow sessions installed on take-over.
    pub sessions_imported: AtomicU64,
    /// Shadow sessions that could not be installed.
    pub sessions_not_imported: AtomicU64,
    /// Frames the channel refused (queue full): each forces a full copy.
    pub sends_refused: AtomicU64,
}

/// Everything `egret status` and the metrics show.
#[derive(Clone, Debug, Default)]
pub struct HaStatus {
    /// The channel's peers.
    pub peers: Vec<PeerStatus>,
    /// Held IPs and their standbys.
    pub replicas: Vec<ReplicaStatus>,
    /// IPs this gateway stands by for.
    pub shadows: Vec<ShadowStatus>,
    /// Failsafe: IPs kept, IPs refused, the last refusal.
    pub failsafe_confirmed: u64,
    /// Failsafe refusals.
    pub failsafe_refused: u64,
    /// The last refusal (IP, peer, reason).
    pub failsafe_last_refusal: Option<(IpAddr, String, String)>,
    /// Whether a dead peer can be told from a silent one (TCP-MD5 works).
    pub end_authenticated: bool,
    /// The channel's keys, the primary first.
    pub keys: Vec<auth::KeyId>,
    /// Session records sent.
    pub records_sent: u64,
    /// Full copies started.
    pub full_copies: u64,
    /// Full copies sent whole (their last frame queued; a copy is paced
    /// over ticks and may be abandoned when its standby goes away).
    pub copies_sent: u64,
    /// Journal overflows seen.
    pub journal_overflows: u64,
    /// Session records this standby refused (its memory bound).
    pub shadow_records_refused: u64,
    /// Messages about an IP refused because the standby keeps the most
    /// shadows it may ([`standby::MAX_SHADOWS`]).
    pub shadows_refused: u64,
}

struct State {
    deaths: Deaths,
    standby: Standby,
    replicator: Replicator,
    failsafe: Failsafe,
    view: View,
    up: BTreeSet<String>,
    overflows_seen: u64,
    last_round: Option<Instant>,
}

/// Why the channel could not start.
#[derive(Debug, thiserror::Error)]
pub enum HaError {
    /// The channel.
    #[error(transparent)]
    Channel(#[from] channel::ChannelError),
}

/// The running channel side of this gateway.
pub struct Ha {
    me: String,
    peers: Peers,
    mgr: Arc<Mutex<LeaseManager>>,
    wake: Arc<Notify>,
    state: Arc<Mutex<State>>,
    view: watch::Sender<View>,
    sessions: Option<Arc<dyn SessionStore>>,
    counters: Arc<HaCounters>,
    task: JoinHandle<()>,
    peer_cache: Option<PathBuf>,
    _key_watch: Option<AbortOnDrop>,
}

/// A task that stops with its owner.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl std::fmt::Debug for Ha {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ha").field("me", &self.me).finish_non_exhaustive()
    }
}

impl Ha {
    /// Starts the channel and its task. `mgr` is the sync loop's Lease state
    /// machine (promises and proofs of death go into it under its lock);
    /// `wake` makes the sync loop run a pass (a take-over became due, a
    /// deadline moved).
    pub async fn start(
        me: &str,
        opts: &HaOptions,
        mgr: Arc<Mutex<LeaseManager>>,
        sessions: Option<Arc<dyn SessionStore>>,
        wake: Arc<Notify>,
    ) -> Result<Ha, HaError> {
        let mut cfg = ChannelConfig::new(me, opts.listen, opts.keys.clone());
        cfg.liveness = opts.liveness;
        Self::start_with(cfg, opts, mgr, sessions, wake).await
    }

    /// [`Ha::start`] with the channel's configuration given whole (its
    /// queue and rate bounds: tests and benchmarks).
    pub async fn start_with(
        cfg: ChannelConfig,
        opts: &HaOptions,
        mgr: Arc<Mutex<LeaseManager>>,
        sessions: Option<Arc<dyn SessionStore>>,
        wake: Arc<Notify>,
    ) -> Result<Ha, HaError> {
        let me = cfg.me.clone();
        let me = me.as_str();
        let confirm = cfg.liveness / 4;
        let limit = memory::memory_limit();
        let shadow_bound = memory::shadow_bound(limit);
        tracing::info!(memory_limit = ?limit, shadow_sessions = shadow_bound, "session sync: the most sessions this gateway keeps as a standby");
        tracing::info!(keys = %keys::describe(&cfg.keys), "peer channel: keys");
        let (peers, events) = Peers::start(cfg).await?;
        let key_watch = opts.key_files.clone().map(|files| {
            let p = peers.clone();
            let ids = p.keys().ids();
            AbortOnDrop(tokio::spawn(keys::watch(files, ids, keys::CHECK_PERIOD, move |ring| p.set_keys(ring))))
        });
        if !peers.end_authenticated() {
            tracing::warn!(
                "peer channel: TCP-MD5 unavailable in this kernel: a crashed peer is noticed only when its Lease expires"
            );
        }
        let state = Arc::new(Mutex::new(State {
            deaths: Deaths::new(confirm),
            standby: Standby::new(shadow_bound),
            replicator: Replicator::new(opts.resync_period),
            failsafe: Failsafe::default(),
            view: View::default(),
            up: BTreeSet::new(),
            overflows_seen: 0,
            last_round: None,
        }));
        mgr.lock().set_lone_failsafe(opts.lone_failsafe);
        if let Some(cache) = &opts.peer_cache {
            restore_promises(&promises::path_for(cache), &mgr);
        }
        let cached = opts.peer_cache.as_deref().map(load_peer_cache).unwrap_or_default();
        if !cached.is_empty() {
            tracing::info!(peers = ?cached.keys().collect::<Vec<_>>(), "peer channel: last known peers (until the API server answers)");
            peers.set_peers(cached);
        }
        let (view_tx, view_rx) = watch::channel(View::default());
        let counters = Arc::new(HaCounters::default());
        let task = tokio::spawn(run(Task {
            me: me.to_string(),
            peers: peers.clone(),
            state: state.clone(),
            mgr: mgr.clone(),
            sessions: sessions.clone(),
            wake: wake.clone(),
            counters: counters.clone(),
            peer_cache: opts.peer_cache.clone(),
            events,
            view: view_rx,
        }));
        Ok(Ha {
            me: me.to_string(),
            peers,
            mgr,
            wake,
            state,
            view: view_tx,
            sessions,
            counters,
            task,
            peer_cache: opts.peer_cache.clone(),
            _key_watch: key_watch,
        })
    }

    /// The sync loop's view after a pass (only changes wake the task).
    /// Its peer set (every gateway Node with a channel address, drained
    /// ones included) also tells the Lease state machine which gateways are
    /// still there ([`LeaseManager::set_gateways`]: the escape from the
    /// failsafe-peers rule).
    pub fn update(&self, view: View) {
        let gateways = view.peers.keys().cloned().chain([self.me.clone()]).collect();
        let (up, copies) = {
            let st = self.state.lock();
            (st.up.clone(), st.standby.ips())
        };
        let mut mgr = self.mgr.lock();
        mgr.set_gateways(gateways);
        mgr.set_standby_view(up, copies);
        drop(mgr);
        self.view.send_if_modified(|v| {
            if *v == view {
                false
            } else {
                *v = view;
                true
            }
        });
    }

    /// Installs the shadow sessions of IPs this gateway just took over:
    /// called after tables holding them were applied, before they are
    /// announced (nothing reaches this gateway for them before that).
    pub fn activate(&self, ips: &[IpAddr]) {
        self.activator().activate(ips);
    }

    /// What [`Ha::activate`] needs, to run on another thread (the sync
    /// loop installs sessions off the runtime's thread).
    pub fn activator(&self) -> Activator {
        Activator { state: self.state.clone(), sessions: self.sessions.clone(), counters: self.counters.clone() }
    }

    /// Runs a failsafe round for the held IPs whose renewals fail, at most
    /// once per retry period. Called by the sync loop on every pass, so
    /// rounds stop when the loop stops (a dead loop must not keep its IPs
    /// alive through its peers' promises).
    pub fn failsafe_round(&self, view: &View) {
        let now = Instant::now();
        let round = {
            let mut st = self.state.lock();
            let due = !view.failing.is_empty() && st.last_round.is_none_or(|t| now >= t + view.retry_period * 3 / 4);
            if !due {
                return;
            }
            st.last_round = Some(now);
            let ips: BTreeMap<IpAddr, Vec<String>> =
                view.failing.iter().filter_map(|ip| view.held.get(ip).map(|others| (*ip, others.clone()))).collect();
            let up = st.up.clone();
            st.failsafe.start(&ips, &up, now)
        };
        let (msgs, alone) = round;
        for (peer, m) in msgs {
            let (k, payload) = m.encode();
            if let Err(e) = self.peers.send(&peer, k, payload) {
                tracing::debug!(peer = %peer, error = %e, "failsafe: request not sent");
            }
        }
        confirm(&self.mgr, &self.wake, now, &alone);
    }

    /// Whether the channel's task ended (it runs until [`Ha::shutdown`]; it
    /// ends only by a panic): the sync loop then stops the control plane,
    /// as for its own death (no failsafe answers, no session sync, no
    /// proof of death would be given any more).
    pub fn stopped(&self) -> bool {
        self.task.is_finished()
    }

    /// The address the channel listens on (its port resolved).
    pub fn local_addr(&self) -> SocketAddr {
        self.peers.local_addr()
    }

    /// This process's channel incarnation (written into the Leases it
    /// holds, so a proof of its death frees only its own records).
    pub fn incarnation(&self) -> u64 {
        self.peers.incarnation()
    }

    /// The standby of each held IP (its most preferred connected other
    /// candidate, to which its sessions are copied): written into the
    /// IP's Lease (`egret.dev/standby`), where takers without a copy defer
    /// to it ([`crate::k8s::lease::LeaseManager::set_standby_view`]).
    pub fn standbys(&self) -> BTreeMap<IpAddr, String> {
        let st = self.state.lock();
        st.replicator.status(Instant::now()).into_iter().map(|r| (r.ip, r.standby)).collect()
    }

    /// Whether the standby of `ip` holds its latest full copy.
    pub fn in_sync(&self, ip: IpAddr) -> bool {
        self.state.lock().replicator.in_sync(ip)
    }

    /// The standby of `ip` now, when it holds its latest full copy.
    pub fn synced_standby(&self, ip: IpAddr) -> Option<String> {
        self.state.lock().replicator.synced_standby(ip).map(str::to_owned)
    }

    /// Asks for a full copy of each IP to its standby at the next tick
    /// (before handing them over); [`Ha::in_sync`] says when it arrived.
    pub fn request_full_copies(&self, ips: &[IpAddr]) {
        let mut st = self.state.lock();
        let standbys: Vec<String> = st
            .replicator
            .status(Instant::now())
            .into_iter()
            .filter(|r| ips.contains(&r.ip))
            .map(|r| r.standby)
            .collect();
        for s in standbys {
            st.replicator.resync_peer(&s);
        }
    }

    /// Sends a full copy of each IP to its standby now and waits (at most
    /// `wait`) until every standby acknowledged one: before giving IPs up
    /// (drain, shutdown). Returns the IPs not in sync by then.
    pub async fn flush(&self, ips: &[IpAddr], wait: Duration) -> Vec<IpAddr> {
        self.request_full_copies(ips);
        let deadline = Instant::now() + wait;
        loop {
            let missing: Vec<IpAddr> = {
                let st = self.state.lock();
                ips.iter().copied().filter(|ip| !st.replicator.in_sync(*ip)).collect()
            };
            if missing.is_empty() || Instant::now() >= deadline {
                return missing;
            }
            tokio::time::sleep(TICK / 2).await;
        }
    }

    /// Everything there is to show.
    pub fn status(&self) -> HaStatus {
        let now = Instant::now();
        let st = self.state.lock();
        HaStatus {
            peers: self.peers.status(),
            replicas: st.replicator.status(now),
            shadows: st.standby.status(now),
            failsafe_confirmed: st.failsafe.confirmed,
            failsafe_refused: st.failsafe.refused,
            failsafe_last_refusal: st.failsafe.last_refusal.clone(),
            end_authenticated: self.peers.end_authenticated(),
            keys: self.peers.keys().ids(),
            records_sent: st.replicator.records_sent,
            full_copies: st.replicator.full_copies,
            copies_sent: st.replicator.copies_sent,
            journal_overflows: st.overflows_seen,
            shadow_records_refused: st.standby.refused,
            shadows_refused: st.standby.shadows_refused,
        }
    }

    /// The counters.
    pub fn counters(&self) -> &Arc<HaCounters> {
        &self.counters
    }

    /// Says goodbye to every peer and stops. With a peer cache, the
    /// failsafe promises still running are first written beside it
    /// ([`promises`]: the next process keeps them) and each holder is told
    /// which, in the same write as the Goodbye ([`Message::PromisesKept`]),
    /// so it may count this gateway as accepting while it restarts.
    pub async fn shutdown(self, reason: &str) {
        // The task answers failsafe requests: stopped (and awaited) first,
        // so no promise is given after the ones written down.
        self.task.abort();
        let _ = self.task.await;
        if let Some(cache) = &self.peer_cache {
            let now = Instant::now();
            let kept: Vec<promises::KeptPromise> = self
                .mgr
                .lock()
                .promises(now)
                .into_iter()
                .map(|(ip, holder, until)| promises::KeptPromise { ip, holder, until })
                .collect();
            let path = promises::path_for(cache);
            match promises::save(&path, &kept, now, std::time::SystemTime::now()) {
                Ok(()) => {
                    let mut per_holder: BTreeMap<&str, Vec<IpAddr>> = BTreeMap::new();
                    for p in &kept {
                        per_holder.entry(p.holder.as_str()).or_default().push(p.ip);
                    }
                    for (holder, ips) in per_holder {
                        let (k, payload) = Message::PromisesKept { ips: ips.clone() }.encode();
                        match self.peers.send_before_goodbye(holder, k, payload) {
                            Ok(()) => {
                                tracing::info!(holder, ips = ?ips, path = %path.display(), "failsafe: promises written for the next process; the holder is told with the Goodbye")
                            }
                            Err(e) => tracing::info!(holder, error = %e, "failsafe: promises written, holder not told"),
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "failsafe: promises not written: holders will count this gateway as absent while it restarts")
                }
            }
        }
        self.peers.shutdown(reason).await;
    }
}

/// Installs the shadow sessions of IPs just taken over ([`Ha::activator`]).
pub struct Activator {
    state: Arc<Mutex<State>>,
    sessions: Option<Arc<dyn SessionStore>>,
    counters: Arc<HaCounters>,
}

impl std::fmt::Debug for Activator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activator").finish_non_exhaustive()
    }
}

impl Activator {
    /// See [`Ha::activate`]. The shadow is taken under the state's lock;
    /// the import runs without it.
    pub fn activate(&self, ips: &[IpAddr]) {
        let Some(store) = &self.sessions else { return };
        let now = Instant::now();
        for ip in ips {
            let taken = self.state.lock().standby.take(*ip, now);
            let Some((holder, records)) = taken else { continue };
            let t0 = Instant::now();
            let report = store.import(&records);
            self.counters.sessions_imported.fetch_add(report.installed, Ordering::Relaxed);
            let missed = (records.len() as u64).saturating_sub(report.installed + report.already_present);
            self.counters.sessions_not_imported.fetch_add(missed, Ordering::Relaxed);
            tracing::info!(
                ip = %ip, from = %holder, sessions = records.len(),
                installed = report.installed, already_present = report.already_present,
                conflicts = report.conflicts, invalid = report.invalid, expired = report.expired,
                table_full = report.table_full, over_source_limit = report.over_source_limit,
                micros = t0.elapsed().as_micros() as u64,
                "take-over: sessions of the previous holder installed"
            );
        }
    }
}

struct Task {
    me: String,
    peers: Peers,
    state: Arc<Mutex<State>>,
    mgr: Arc<Mutex<LeaseManager>>,
    sessions: Option<Arc<dyn SessionStore>>,
    wake: Arc<Notify>,
    counters: Arc<HaCounters>,
    peer_cache: Option<PathBuf>,
    events: mpsc::Receiver<PeerEvent>,
    view: watch::Receiver<View>,
}

async fn run(mut t: Task) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ev = t.events.recv() => match ev {
                Some(ev) => t.on_event(ev),
                None => return,
            },
            changed = t.view.changed() => {
                if changed.is_err() {
                    return;
                }
                let view = t.view.borrow_and_update().clone();
                t.on_view(view);
            }
            _ = tick.tick() => t.on_tick(),
        }
    }
}

impl Task {
    fn send(&self, peer: &str, m: &Message) -> bool {
        let (k, payload) = m.encode();
        match self.peers.send(peer, k, payload) {
            Ok(()) => true,
            Err(e) => {
                if matches!(e, channel::SendError::Full { .. }) {
                    self.counters.sends_refused.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(peer, error = %e, "peer channel: frame not sent");
                false
            }
        }
    }

    /// [`Task::send`] for [`replicate::Replicator::pace`]: bulk frames go
    /// under the queue's bulk share and wait when it is used up.
    fn send_paced(&self, peer: &str, m: &Message, bulk: bool) -> replicate::Pace {
        if !bulk {
            return if self.send(peer, m) { replicate::Pace::Sent } else { replicate::Pace::Failed };
        }
        let (k, payload) = m.encode();
        match self.peers.send_bulk(peer, k, payload) {
            Ok(()) => replicate::Pace::Sent,
            Err(channel::SendError::BulkWait { .. }) => replicate::Pace::Wait,
            Err(e) => {
                if matches!(e, channel::SendError::Full { .. }) {
                    self.counters.sends_refused.fetch_add(1, Ordering::Relaxed);
                }
                tracing::debug!(peer, error = %e, "peer channel: copy frame not sent");
                replicate::Pace::Failed
            }
        }
    }

    fn on_event(&mut self, ev: PeerEvent) {
        let now = Instant::now();
        match ev {
            PeerEvent::Up { peer, incarnation } => {
                tracing::info!(peer = %peer, incarnation, "peer channel: up");
                let dead = {
                    let mut st = self.state.lock();
                    st.up.insert(peer.clone());
                    st.replicator.resync_peer(&peer);
                    st.failsafe.peer_up(&peer);
                    let survived = st.deaths.resets_survived;
                    let dead = st.deaths.on_up(&peer, incarnation);
                    if st.deaths.resets_survived > survived {
                        self.counters.peer_resets_survived.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(peer = %peer, incarnation, "peer channel: reset, and back as the same process: alive, nothing taken over");
                    }
                    dead
                };
                if let Some(dead) = dead {
                    self.proven_dead(dead, now);
                }
            }
            PeerEvent::Down { peer, incarnation, end } => {
                let dead = {
                    let mut st = self.state.lock();
                    st.up.remove(&peer);
                    st.failsafe.peer_down(&peer, matches!(end, End::Goodbye(_)));
                    st.deaths.on_down(&peer, incarnation, &end, now)
                };
                if let Some(dead) = dead {
                    self.proven_dead(dead, now);
                } else if end.suggests_death() {
                    tracing::info!(peer = %peer, incarnation, end = %end, "peer channel: down; a death only if the same process is not back within the confirmation window");
                } else if !matches!(end, End::Local(_) | End::Superseded) {
                    tracing::info!(peer = %peer, incarnation, end = %end, "peer channel: down");
                }
            }
            PeerEvent::Frame { peer, kind, payload } => match Message::decode(kind, &payload) {
                Ok(m) => self.on_message(&peer, m, now),
                Err(e) => tracing::warn!(peer = %peer, error = %e, "peer channel: malformed message dropped"),
            },
        }
    }

    /// A peer's process is proven dead ([`death`]): the Leases its
    /// incarnation holds may be taken over without waiting for them.
    fn proven_dead(&self, dead: Dead, now: Instant) {
        self.counters.peers_gone.fetch_add(1, Ordering::Relaxed);
        let ips = self.mgr.lock().holder_gone(&dead.peer, dead.incarnation, now);
        self.counters.early_takeovers_allowed.fetch_add(ips.len() as u64, Ordering::Relaxed);
        tracing::warn!(peer = %dead.peer, incarnation = dead.incarnation, why = dead.why, ips = ?ips, "peer channel: the peer's process died; its IPs are taken over without waiting for their Leases");
        self.wake.notify_one();
    }

    fn on_message(&mut self, from: &str, m: Message, now: Instant) {
        match m {
            Message::FailsafeRequest { id, ips } => {
                let (mut accepted, mut refused) = (Vec::new(), Vec::new());
                {
                    let mut mgr = self.mgr.lock();
                    for ip in ips {
                        match mgr.promise(ip, from, now) {
                            Ok(()) => accepted.push(ip),
                            Err(why) => refused.push((ip, why.to_string())),
                        }
                    }
                }
                self.counters.promises_given.fetch_add(accepted.len() as u64, Ordering::Relaxed);
                self.counters.promises_refused.fetch_add(refused.len() as u64, Ordering::Relaxed);
                if !refused.is_empty() {
                    tracing::info!(holder = from, refused = ?refused, "failsafe: refused");
                }
                self.send(from, &Message::FailsafeReply { id, accepted, refused });
            }
            Message::FailsafeReply { id, accepted, refused } => {
                let done = self.state.lock().failsafe.on_reply(from, id, &accepted, &refused);
                if let Some((sent, ips)) = done {
                    confirm(&self.mgr, &self.wake, sent, &ips);
                }
            }
            Message::PromisesKept { ips } => {
                let timing = self.mgr.lock().timing();
                let bridged = self.state.lock().failsafe.bridge(from, &ips, timing);
                tracing::info!(peer = from, ips = ?ips, bridged = ?bridged, "failsafe: the peer stops and keeps its promises; it counts as accepting while it restarts");
            }
            Message::SyncAck { ip, epoch } => {
                let mut st = self.state.lock();
                let was = st.replicator.in_sync(ip);
                st.replicator.on_ack(from, ip, epoch);
                if !was && st.replicator.in_sync(ip) {
                    let sessions = st.replicator.copy_size(ip).unwrap_or_default();
                    tracing::info!(ip = %ip, standby = from, epoch, sessions, "session sync: the standby holds a complete copy");
                }
            }
            m => {
                let answer = self.state.lock().standby.on_message(from, m, now);
                if let Some(a) = answer {
                    self.send(from, &a);
                }
            }
        }
    }

    fn on_view(&mut self, view: View) {
        self.peers.set_peers(view.peers.clone());
        if let Some(path) = &self.peer_cache {
            if !view.peers.is_empty() {
                save_peer_cache(path, &view.peers);
            }
        }
        let mut st = self.state.lock();
        st.standby.retain_holders(&self.me, &view.holders);
        st.view = view;
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        let dead = self.state.lock().deaths.due(now);
        for d in dead {
            self.proven_dead(d, now);
        }
        // The journal first, with the replicas as they were: changes made
        // while an IP was still held reach its standby even when this tick
        // sees the IP gone (review finding 9; its removals are not sent,
        // see `Replicator::incremental`).
        let journal = self.sessions.as_ref().map(|store| (store.drain(DRAIN_MAX), store.overflows()));
        // Held by the Lease manager now: an IP given up (fenced by a drain
        // or a graceful stop) leaves it at once, before its tables are
        // applied without it, while the view says so only after the pass.
        let held_now = self.mgr.lock().held(now);
        // Each held IP replicates to its most preferred connected candidate.
        let (drops, msgs) = {
            let mut st = self.state.lock();
            let standbys: BTreeMap<IpAddr, Option<String>> = st
                .view
                .held
                .iter()
                .map(|(ip, others)| (*ip, others.iter().find(|p| st.up.contains(*p)).cloned()))
                .collect();
            let mut msgs = Vec::new();
            if let Some((events, overflows)) = journal {
                if overflows != st.overflows_seen {
                    st.overflows_seen = overflows;
                    st.replicator.resync_all();
                }
                // Removals only of IPs still held: once an IP is given up,
                // its sessions end because this gateway took the IP out of
                // its tables, and the next holder must keep them (a rolling
                // restart's hand-over emptied the standby's copy this way).
                msgs = st.replicator.incremental(events, &held_now);
            }
            (st.replicator.set_standbys(&standbys), msgs)
        };
        // The changes before the DropShadow of a replaced standby (else
        // they would make it a new shadow).
        let mut failed = BTreeSet::new();
        for (peer, m) in msgs {
            if !failed.contains(&peer) && !self.send(&peer, &m) {
                failed.insert(peer);
            }
        }
        for (peer, m) in drops {
            self.send(&peer, &m);
        }
        // Then any due full copy.
        if let Some(store) = &self.sessions {
            let due: Vec<_> = {
                let mut st = self.state.lock();
                let up = st.up.clone();
                st.replicator.due_full(now).into_iter().filter(|(_, s, _)| up.contains(s)).collect()
            };
            // A due copy starts with a snapshot; every tick sends what the
            // peers' queues take of the copies in progress (replicate.rs).
            for (ip, _standby, epoch) in due {
                let records = store.export(ip);
                self.state.lock().replicator.start_copy(ip, epoch, records);
            }
            let refused = {
                let mut st = self.state.lock();
                st.replicator.pace(&mut |peer, m, bulk| self.send_paced(peer, m, bulk))
            };
            failed.extend(refused);
            if !failed.is_empty() {
                let mut st = self.state.lock();
                for p in &failed {
                    st.replicator.resync_peer(p);
                }
            }
        }
    }
}

/// Every other eligible gateway accepted `ips` in a round sent at `sent`:
/// their deadlines move (if still held), and the sync loop runs to tell the
/// data plane.
fn confirm(mgr: &Mutex<LeaseManager>, wake: &Notify, sent: Instant, ips: &[IpAddr]) {
    if ips.is_empty() {
        return;
    }
    let mut moved = Vec::new();
    {
        let mut mgr = mgr.lock();
        for ip in ips {
            if mgr.failsafe_confirmed(*ip, sent) {
                moved.push(*ip);
            }
        }
    }
    if !moved.is_empty() {
        tracing::debug!(ips = ?moved, "failsafe: every eligible gateway agreed; deadlines moved");
        wake.notify_one();
    }
}

/// Loads the promises a previous process on this node wrote when it
/// stopped into the Lease state machine (before its first plan). A file
/// that cannot be read is ignored with a warning: its promises are not kept
/// (the holder's bridge then rests on a promise broken; the file is written
/// whole or not at all, so only a damaged disk or a foreign writer gets
/// here).
fn restore_promises(path: &std::path::Path, mgr: &Mutex<LeaseManager>) {
    let now = Instant::now();
    let mut mgr = mgr.lock();
    let max = mgr.timing().lease_duration;
    match promises::load(path, now, std::time::SystemTime::now(), max) {
        Ok(kept) => {
            for p in &kept {
                mgr.restore_promise(p.ip, &p.holder, p.until, now);
            }
            if !kept.is_empty() {
                tracing::info!(
                    promises = ?kept.iter().map(|p| (p.ip, p.holder.as_str(), p.until.saturating_duration_since(now))).collect::<Vec<_>>(),
                    "failsafe: promises of the previous process kept"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "failsafe: promise file ignored"),
    }
}

/// The peer set last saved, as `name address` lines (empty when missing or
/// unreadable: the API server will tell).
fn load_peer_cache(path: &std::path::Path) -> BTreeMap<String, SocketAddr> {
    let Ok(text) = std::fs::read_to_string(path) else { return BTreeMap::new() };
    text.lines()
        .filter_map(|l| {
            let (n, a) = l.split_once(' ')?;
            Some((n.to_string(), a.trim().parse().ok()?))
        })
        .collect()
}

fn save_peer_cache(path: &std::path::Path, peers: &BTreeMap<String, SocketAddr>) {
    let text: String = peers.iter().map(|(n, a)| format!("{n} {a}\n")).collect();
    if std::fs::read_to_string(path).ok().as_deref() == Some(text.as_str()) {
        return;
    }
    let tmp = path.with_extension("tmp");
    let res = std::fs::write(&tmp, &text).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = res {
        tracing::warn!(path = %path.display(), error = %e, "peer channel: peer cache not written");
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::path::Path;

    use egret_dataplane::nat::sync::SessionRecord;

    use super::*;
    use crate::k8s::lease::{Action, LeaseRecord, LeaseTiming};

    /// A deadline so a broken test fails instead of hanging; not a timing claim.
    const DEADLINE: Duration = Duration::from_secs(60);
    const IP: &str = "198.51.100.10";

    /// A data plane with a fixed session table and a journal the test fills.
    struct Table(Vec<SessionRecord>, Arc<Mutex<Vec<SyncEvent>>>);

    impl SessionStore for Table {
        fn drain(&self, _max: usize) -> Vec<SyncEvent> {
            std::mem::take(&mut *self.1.lock())
        }
        fn overflows(&self) -> u64 {
            0
        }
        fn export(&self, ip: IpAddr) -> Vec<SessionRecord> {
            self.0.iter().filter(|r| r.egress == ip).cloned().collect()
        }
        fn import(&self, _records: &[SessionRecord]) -> ImportReport {
            ImportReport::default()
        }
    }

    /// gw-a's Lease manager, holding `ip` (created, candidates gw-a, gw-b).
    fn holder_of(ip: IpAddr, timing: LeaseTiming) -> Arc<Mutex<LeaseManager>> {
        let a_mgr = Arc::new(Mutex::new(LeaseManager::new("gw-a", timing)));
        {
            let mut m = a_mgr.lock();
            let now = Instant::now();
            m.observe(ip, None, now);
            let cands: BTreeMap<IpAddr, Vec<String>> = [(ip, vec!["gw-a".into(), "gw-b".into()])].into();
            assert_eq!(m.plan(now, &cands, true), vec![(ip, Action::Create)]);
            let rec = LeaseRecord {
                holder: Some("gw-a".into()),
                duration: timing.lease_duration,
                resource_version: "1".into(),
                ..Default::default()
            };
            m.on_result(ip, &Action::Create, now, Ok(Some(rec)), now);
        }
        a_mgr
    }

    /// `n` distinct TCP sessions of egress IP [`IP`].
    fn sessions(n: usize) -> Vec<SessionRecord> {
        (0..n)
            .map(|i| SessionRecord {
                proto: 6,
                pod: IpAddr::from([198, 18, (i / 60_000 / 256) as u8, (i / 60_000 % 256) as u8]),
                pod_port: 1024 + (i % 60_000) as u16,
                remote: "203.0.113.80".parse().unwrap(),
                remote_port: 443,
                egress: IP.parse().unwrap(),
                egress_port: 1024 + (i % 60_000) as u16,
                tcp: 2,
                tcp_track: 0,
                flags: 0,
                idle_secs: 3,
            })
            .collect()
    }

    fn options() -> HaOptions {
        let key =
            auth::SharedKey::from_bytes(Path::new("/test/peer.key"), b"egret-test-secret-0123456789abcd").unwrap();
        HaOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            port: 0,
            keys: Arc::new(key.into()),
            key_files: None,
            liveness: Duration::from_secs(2),
            resync_period: Duration::from_secs(3600),
            peer_cache: None,
            lone_failsafe: Duration::from_secs(300),
        }
    }

    struct Pair {
        a: Ha,
        b: Ha,
        a_mgr: Arc<Mutex<LeaseManager>>,
        view_a: View,
        /// gw-a's journal.
        journal: Arc<Mutex<Vec<SyncEvent>>>,
    }

    /// gw-a holds [`IP`] with `n` sessions, gw-b is its standby; `tune`
    /// sets both channels' bounds.
    async fn pair(n: usize, tune: impl Fn(&mut ChannelConfig)) -> Pair {
        let ip: IpAddr = IP.parse().unwrap();
        let opts = options();
        let timing = LeaseTiming::default();
        let a_mgr = holder_of(ip, timing);
        let b_mgr = Arc::new(Mutex::new(LeaseManager::new("gw-b", timing)));
        let chan = |me: &str| {
            let mut c = ChannelConfig::new(me, opts.listen, opts.keys.clone());
            tune(&mut c);
            c
        };
        let journal = Arc::new(Mutex::new(Vec::new()));
        let store: Arc<dyn SessionStore> = Arc::new(Table(sessions(n), journal.clone()));
        let empty: Arc<dyn SessionStore> = Arc::new(Table(Vec::new(), Arc::default()));
        let wake = Arc::new(Notify::new());
        let a = Ha::start_with(chan("gw-a"), &opts, a_mgr.clone(), Some(store), wake.clone()).await.unwrap();
        let b = Ha::start_with(chan("gw-b"), &opts, b_mgr, Some(empty), wake).await.unwrap();
        let holders: BTreeMap<IpAddr, Option<String>> = [(ip, Some("gw-a".to_string()))].into();
        let view_a = View {
            peers: [("gw-b".to_string(), b.local_addr())].into(),
            held: [(ip, vec!["gw-b".to_string()])].into(),
            failing: BTreeSet::new(),
            holders: holders.clone(),
            retry_period: timing.retry_period,
        };
        a.update(view_a.clone());
        b.update(View {
            peers: [("gw-a".to_string(), a.local_addr())].into(),
            holders,
            retry_period: timing.retry_period,
            ..View::default()
        });
        Pair { a, b, a_mgr, view_a, journal }
    }

    async fn until(what: &str, mut cond: impl FnMut() -> bool) {
        let wait = async {
            while !cond() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        if tokio::time::timeout(DEADLINE, wait).await.is_err() {
            panic!("{what}: not within {DEADLINE:?}");
        }
    }

    /// The standby holds a complete copy of `n` sessions and the holder knows.
    fn copied(p: &Pair, n: usize) -> bool {
        let ip: IpAddr = IP.parse().unwrap();
        p.a.in_sync(ip) && p.b.status().shadows.iter().any(|s| s.ip == ip && s.in_sync && s.sessions == n)
    }

    /// Review finding 2: a full copy larger than the peer's send queue was
    /// queued whole, refused and restarted forever. Paced, it completes
    /// through the real channel, and a failsafe round started while it is
    /// under way goes through beside it (its frames keep their share of the
    /// queue). The queue is 256 KiB and the rate 400 kB/s, so the copy of
    /// 20,000 sessions (about 0.8 MB) takes about two seconds.
    #[tokio::test]
    async fn a_copy_larger_than_the_send_queue_completes_and_the_failsafe_goes_through_meanwhile() {
        let ip: IpAddr = IP.parse().unwrap();
        let n = 20_000;
        let p = pair(n, |c| {
            c.max_queue_bytes = 256 << 10;
            c.bulk_queue_bytes = 64 << 10;
            c.max_frame = 64 << 10;
            c.max_bytes_per_sec = 400_000;
        })
        .await;
        until("the copy starts", || p.a.status().full_copies >= 1).await;
        // The API server is gone for gw-a: it asks gw-b while the copy runs.
        let deadline_before = p.a_mgr.lock().deadline(ip).unwrap();
        let failing = View { failing: [ip].into(), ..p.view_a.clone() };
        let mut during = false;
        until("the failsafe round is confirmed", || {
            p.a.failsafe_round(&failing);
            let st = p.a.status();
            during |= st.replicas.iter().any(|r| r.copying.is_some());
            st.failsafe_confirmed >= 1
        })
        .await;
        until("the standby holds the whole copy", || copied(&p, n)).await;
        assert!(during, "the copy was under way during the failsafe exchange");
        assert!(p.a_mgr.lock().deadline(ip).unwrap() > deadline_before, "gw-a's deadline moved");
        assert!(p.b.counters().promises_given.load(Ordering::Relaxed) >= 1);
        let st = p.a.status();
        assert_eq!(st.full_copies, 1, "one copy, never restarted");
        assert_eq!(st.copies_sent, 1);
        assert_eq!(p.a.counters().sends_refused.load(Ordering::Relaxed), 0);
        assert_eq!(st.peers[0].send_full, 0, "no frame refused");
        p.a.shutdown("test over").await;
        p.b.shutdown("test over").await;
    }

    /// A hand-over keeps the standby's copy whole: once gw-a gives its IP up
    /// (fenced, as a graceful stop or a drain does before taking the IP out
    /// of its tables), the removals of the sessions that then end are not
    /// sent; before, they are. Found by a rolling restart beside two CPU
    /// hogs: the stopping holder's tables without the IP ended its
    /// sessions, their removals emptied the standby's copy, and the
    /// standby took the IP with none (0/3 long-lived flows kept).
    #[tokio::test]
    async fn removals_after_the_ip_is_given_up_do_not_reach_the_standby() {
        let ip: IpAddr = IP.parse().unwrap();
        let n = 20;
        let p = pair(n, |_| {}).await;
        until("the standby holds the copy", || copied(&p, n)).await;
        assert_eq!(p.a.synced_standby(ip).as_deref(), Some("gw-b"), "what a release names");
        let shadow = |p: &Pair| p.b.status().shadows.iter().find(|s| s.ip == ip).map(|s| s.sessions);
        let remove = |p: &Pair, range: std::ops::Range<usize>| {
            p.journal.lock().extend(sessions(n)[range].iter().map(|r| SyncEvent::Remove(r.key())));
        };
        // Held: a session that ends is removed from the copy.
        remove(&p, 0..2);
        until("held: the removals reach the standby", || shadow(&p) == Some(n - 2)).await;
        // Given up: the sessions that end now stay in the copy.
        p.a_mgr.lock().fence(Instant::now(), &BTreeSet::new());
        remove(&p, 2..n);
        until("the journal is drained", || p.journal.lock().is_empty()).await;
        // Two ticks more, for anything in flight.
        tokio::time::sleep(TICK * 4).await;
        assert_eq!(shadow(&p), Some(n - 2), "given up: the copy stays whole");
        p.a.shutdown("test over").await;
        p.b.shutdown("test over").await;
    }

    /// A peer restarting during an API outage (issue 16 §4): gw-b, the only
    /// other eligible gateway, stops gracefully and comes back as a new
    /// process with the same peer cache. Meanwhile gw-a's failsafe rounds
    /// keep confirming on gw-b's kept promise (before: absence was refusal,
    /// and no round could be confirmed until gw-b answered again); the new
    /// process keeps the promise (it would otherwise create the Lease at
    /// once, being most preferred and seeing none), then answers live.
    #[tokio::test]
    async fn failsafe_rounds_keep_confirming_while_a_peer_restarts_gracefully() {
        let ip: IpAddr = IP.parse().unwrap();
        // Long enough that the bridge (leaseDuration - renewDeadline - the
        // fencing margin after gw-b's last acceptance) outlasts a slow run.
        let timing = LeaseTiming {
            lease_duration: Duration::from_secs(60),
            renew_deadline: Duration::from_secs(20),
            retry_period: Duration::from_millis(500),
        };
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("peers");
        let opts = options();
        let opts_b = HaOptions { peer_cache: Some(cache.clone()), ..options() };
        let a_mgr = holder_of(ip, timing);
        let wake = Arc::new(Notify::new());
        let a = Ha::start("gw-a", &opts, a_mgr.clone(), None, wake.clone()).await.unwrap();
        let b_mgr = Arc::new(Mutex::new(LeaseManager::new("gw-b", timing)));
        let b = Ha::start("gw-b", &opts_b, b_mgr, None, wake.clone()).await.unwrap();
        let holders: BTreeMap<IpAddr, Option<String>> = [(ip, Some("gw-a".to_string()))].into();
        let view_a = |b_addr: SocketAddr| View {
            peers: [("gw-b".to_string(), b_addr)].into(),
            held: [(ip, vec!["gw-b".to_string()])].into(),
            failing: [ip].into(),
            holders: holders.clone(),
            retry_period: timing.retry_period,
        };
        let view_b = View {
            peers: [("gw-a".to_string(), a.local_addr())].into(),
            holders: holders.clone(),
            retry_period: timing.retry_period,
            ..View::default()
        };
        let failing = view_a(b.local_addr());
        a.update(failing.clone());
        b.update(view_b.clone());
        // The API server is gone for gw-a: gw-b accepts its rounds.
        until("gw-b accepts a round", || {
            a.failsafe_round(&failing);
            a.status().failsafe_confirmed >= 1
        })
        .await;
        // gw-b stops gracefully: its promise is written, gw-a told.
        b.shutdown("restart").await;
        let path = promises::path_for(&cache);
        assert!(path.exists(), "the promise is written beside the peer cache");
        let b_up = |a: &Ha| a.status().peers.iter().any(|p| p.name == "gw-b" && p.state == channel::PeerState::Up);
        until("gw-a sees gw-b gone", || !b_up(&a)).await;
        let (before, deadline) = (a.status().failsafe_confirmed, a_mgr.lock().deadline(ip).unwrap());
        until("a round is confirmed while gw-b is away", || {
            a.failsafe_round(&failing);
            a.status().failsafe_confirmed > before
        })
        .await;
        assert!(!b_up(&a), "gw-b was away throughout");
        assert!(a_mgr.lock().deadline(ip).unwrap() > deadline, "gw-a's deadline moved on gw-b's kept promise");
        // The new process keeps the promise: most preferred, seeing no
        // Lease, it still creates nothing.
        let b2_mgr = Arc::new(Mutex::new(LeaseManager::new("gw-b", timing)));
        let b2 = Ha::start("gw-b", &opts_b, b2_mgr.clone(), None, wake.clone()).await.unwrap();
        {
            let now = Instant::now();
            let mut m = b2_mgr.lock();
            let kept = m.promises(now);
            assert_eq!(kept.len(), 1);
            assert_eq!((kept[0].0, kept[0].1.as_str()), (ip, "gw-a"));
            let cands: BTreeMap<IpAddr, Vec<String>> = [(ip, vec!["gw-b".into(), "gw-a".into()])].into();
            assert_eq!(m.plan(now, &cands, true), vec![], "the restarted gw-b keeps its predecessor's promise");
        }
        // Back, it answers for itself.
        let failing = view_a(b2.local_addr());
        a.update(failing.clone());
        b2.update(view_b);
        until("the new gw-b accepts", || {
            a.failsafe_round(&failing);
            b2.counters().promises_given.load(Ordering::Relaxed) >= 1
        })
        .await;
        a.shutdown("test over").await;
        b2.shutdown("test over").await;
    }

    /// A promise file that cannot be read is ignored (with a warning): the
    /// gateway starts, keeps nothing from it, and its next graceful stop
    /// writes a good one over it.
    #[tokio::test]
    async fn a_corrupt_promise_file_is_ignored_and_replaced_at_the_next_stop() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("peers");
        let path = promises::path_for(&cache);
        std::fs::write(&path, "egret-promises 1\n198.51.100.10 gw-a\n").unwrap();
        let opts = HaOptions { peer_cache: Some(cache), ..options() };
        let mgr = Arc::new(Mutex::new(LeaseManager::new("gw-b", LeaseTiming::default())));
        let b = Ha::start("gw-b", &opts, mgr.clone(), None, Arc::new(Notify::new())).await.unwrap();
        assert!(mgr.lock().promises(Instant::now()).is_empty());
        let ip: IpAddr = IP.parse().unwrap();
        mgr.lock().promise(ip, "gw-a", Instant::now()).unwrap();
        b.shutdown("restart").await;
        let kept = promises::load(&path, Instant::now(), std::time::SystemTime::now(), Duration::from_secs(4)).unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!((kept[0].ip, kept[0].holder.as_str()), (ip, "gw-a"));
    }

    /// A failsafe round trip of gw-a (request, promise, reply), from its start.
    async fn failsafe_rtt(p: &Pair, failing: &View) -> Duration {
        let before = p.a.status().failsafe_confirmed;
        let t0 = Instant::now();
        p.a.failsafe_round(failing);
        until("the failsafe round", || p.a.status().failsafe_confirmed > before).await;
        t0.elapsed()
    }

    /// Benchmark, not a test: full copies of `EGRET_COPY_SESSIONS` (600,000)
    /// sessions with the default channel bounds, three rounds; prints the
    /// time from the copy's start to the standby's acknowledgment and the
    /// bytes per session on the wire. `cargo test -p egret-controlplane
    /// --lib --release -- --ignored --nocapture ha::tests::full_copy_benchmark`
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "benchmark: run by hand"]
    async fn full_copy_benchmark() {
        let ip: IpAddr = IP.parse().unwrap();
        let n: usize = std::env::var("EGRET_COPY_SESSIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(600_000);
        let p = pair(n, |_| {}).await;
        let bytes_out = |p: &Pair| p.a.status().peers[0].bytes_out;
        let t0 = Instant::now();
        until("the first copy", || copied(&p, n)).await;
        println!("copy 1 (at connect): {n} sessions in {:?}", t0.elapsed());
        // A failsafe round trip (request, promise, reply) from its start.
        let failing = View { failing: [ip].into(), ..p.view_a.clone() };
        for round in 2..=4 {
            tokio::time::sleep(Duration::from_millis(400)).await; // the rounds' own pacing
            let idle = failsafe_rtt(&p, &failing).await;
            tokio::time::sleep(Duration::from_millis(400)).await;
            let b0 = bytes_out(&p);
            let t0 = Instant::now();
            p.a.request_full_copies(&[ip]);
            let copying = || p.a.status().replicas.iter().any(|r| r.copying.is_some_and(|(sent, _)| sent > 0));
            until("the copy starts", copying).await;
            let busy = failsafe_rtt(&p, &failing).await;
            let still = copying();
            until("the copy", || copied(&p, n)).await;
            let took = t0.elapsed();
            let bytes = bytes_out(&p) - b0;
            println!(
                "copy {round}: {n} sessions in {took:?} ({:.0} sessions/s), {bytes} bytes on the wire, {:.1} bytes/session; \
                 failsafe round trip idle {idle:?}, during the copy {busy:?} (copy still under way after it: {still})",
                n as f64 / took.as_secs_f64(),
                bytes as f64 / n as f64
            );
        }
        assert_eq!(p.a.counters().sends_refused.load(Ordering::Relaxed), 0);
        p.a.shutdown("x").await;
        p.b.shutdown("x").await;
    }
}
