//! The XDP fast path's userspace half: which sessions are in the kernel, how
//! they got there, how they leave (docs/fast-path.md,
//! docs/adr/0005-xdp-fast-path.md).
//!
//! - [`FastPath`]: what workers, the sink and the manager share. It is the
//!   engine's [`OffloadHook`] for both families: `last_seen` reads the
//!   kernel's stamps of a session that looks expired, `remove` deletes both
//!   directions' entries before the engine frees the session. It keeps the
//!   index of installed sessions (bounded by the map sizes) and fences:
//!   [`FastPath::fence`] deletes every installed session the next tables
//!   will not hold, before they are published.
//! - [`OffloadManager`]: one thread (`egret-offload`). Every
//!   [`TICK`] it drains the engine's offload requests (both families),
//!   resolves the next hop of each direction, installs both entries and
//!   reports the outcome to the engine; it keeps the next-hop table in step
//!   with the kernel's neighbours and re-points sessions when routes change.
//!
//! Installation of one session (the engine queued it once confirmed:
//! UDP after the first reply, TCP after both SYNs, never hairpinned ones):
//!
//! ```text
//!  not TCP/UDP ------------------------------> offload_done(false)  not_eligible
//!  no longer valid under the current tables -> offload_done(false)  refused_invalid
//!  its egress IP past its deadline ----------> offload_withdrawn      refused_invalid
//!    (asks again later: a dormant IP's sessions return to XDP once it is valid)
//!  next hop: no route / table full ----------> offload_done(false)  refused_no_route / refused_next_hops_full
//!  next hop through a link not driven -------> offload_done(false)  refused_kernel_route
//!    (an overlay's tunnel: XDP cannot send into it, so the session stays
//!    in the engine, which hands its packets to the pod to the kernel;
//!    docs/adr/0008-overlay-return-through-the-kernel.md)
//!  insert outbound + inbound entries
//!     map full -------------------------------> undo, offload_done(false)  refused_map_full
//!  index it, offload_done(true)
//!     false: the session died meanwhile ------> unindex, delete both   lost_race
//!     true ------------------------------------> installed
//! ```
//!
//! The install batch runs under the read side of a gate whose write side
//! [`FastPath::fence`] holds across the engine's publication of new tables,
//! so a session is either indexed before a fence (and fenced) or checked
//! against the new tables (and refused).

pub mod next_hops;

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_bpf::fast_path::{DIR_INBOUND, DIR_OUTBOUND, POLICY_SLOTS};
use egret_bpf::{BpfError, FpEntry, FpKey, FpRewrite, Octets, SteeringProgram, VerdictReason};
use egret_dataplane::engine::Engine;
use egret_dataplane::fib::{Fib, Route};
use egret_dataplane::nat::key::{proto, FlowKey, NatAddr};
use egret_dataplane::nat::rewrite::{direction_rewrite, DirectionRewrite, IpFamily};
use egret_dataplane::nat::session::SessionView;
use egret_dataplane::nat::table::{NatTable, OffloadHook};
use egret_dataplane::stats::Direction;
use egret_dataplane::tables::{PolicyFamily, Tables};
use parking_lot::{Mutex, RwLock, RwLockWriteGuard};

use crate::view::FastPathCounters;
use egret_dataplane::clock::EngineClock;
use next_hops::{no_key_because, route_key, HopError, NextHopTable};

/// How often the manager looks for work when idle.
pub const TICK: Duration = Duration::from_millis(2);
/// Sessions installed per family per tick, at most.
pub const BATCH: usize = 1024;

/// One installed session: the view it was installed from (its keys and
/// incarnation) and the next-hop ids of its two directions.
#[derive(Debug, Clone, Copy)]
pub struct Installed<A> {
    /// The session as installed.
    pub view: SessionView<A>,
    /// Next-hop ids: [outbound, inbound].
    pub next_hops: [u32; 2],
}

type Index<A> = Mutex<HashMap<(u32, u32), Installed<A>>>;

/// Userspace counters of the fast path.
#[derive(Debug, Default)]
pub struct FastPathStats {
    /// Sessions installed.
    pub installed: AtomicU64,
    /// Not installed: the session map is full.
    pub refused_map_full: AtomicU64,
    /// Not installed: no route to one side.
    pub refused_no_route: AtomicU64,
    /// Not installed: one side's route leaves through a link the gateway
    /// does not drive (an overlay's tunnel device).
    pub refused_kernel_route: AtomicU64,
    /// Not installed: the next-hop table is full.
    pub refused_next_hops_full: AtomicU64,
    /// Not installed: no longer valid under the tables in force, or its
    /// egress IP is past its deadline.
    pub refused_invalid: AtomicU64,
    /// Not installed: not TCP/UDP (ICMP sessions stay in userspace).
    pub not_eligible: AtomicU64,
    /// Installed, but the session ended meanwhile: undone.
    pub lost_race: AtomicU64,
    /// Map operations that failed (logged).
    pub errors: AtomicU64,
    /// Installed sessions removed with their session (expiry, eviction, revalidation).
    pub removed: AtomicU64,
    /// Installed sessions deleted before a new configuration took effect.
    pub fenced: AtomicU64,
    /// Installed sessions taken back because their route went away.
    pub withdrawn: AtomicU64,
    /// Installed sessions taken out because their egress IP's deadline
    /// passed (fenced; kept by the workers if the IP is dormant).
    pub expired: AtomicU64,
    /// Next-hop entries rewritten after a neighbour or interface change.
    pub next_hop_updates: AtomicU64,
    /// Session directions re-pointed at another next hop after a route change.
    pub rerouted: AtomicU64,
    /// Next-hop ids in use (gauge, written by the manager).
    pub next_hops: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// What the workers, the sink and the manager share.
pub struct FastPath {
    program: Arc<SteeringProgram>,
    clock: EngineClock,
    installed4: Index<Ipv4Addr>,
    installed6: Index<Ipv6Addr>,
    /// Next-hop ids released by removals, for the manager to drop.
    released: Mutex<Vec<u32>>,
    gate: RwLock<()>,
    /// Egress IPs past their deadline whose sessions were taken out of the
    /// kernel ([`FastPath::set_expired`]): none of theirs is installed
    /// until they are valid again, so the fast path's deadline need not
    /// cover them. Changed under the gate's write side.
    expired: Mutex<BTreeSet<IpAddr>>,
    udp_inbound_refresh: AtomicBool,
    /// The counters.
    pub stats: FastPathStats,
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("installed4", &self.installed4.lock().len())
            .field("installed6", &self.installed6.lock().len())
            .finish_non_exhaustive()
    }
}

/// The per-family parts: map key and entry types, the engine's NAT table.
pub trait FpFamily: IpFamily + NatAddr + PolicyFamily + Into<IpAddr> + Send + Sync + 'static {
    /// The engine's NAT state of this family.
    fn nat(engine: &Engine) -> &NatTable<Self>;
    /// The index of installed sessions of this family.
    fn index(fp: &FastPath) -> &Index<Self>;
    /// Writes one direction's entry.
    fn insert(p: &SteeringProgram, rw: &DirectionRewrite<Self>, r: &FpRewrite) -> Result<(), BpfError>;
    /// Deletes one direction's entry; whether it was there.
    fn delete(p: &SteeringProgram, key: &FlowKey<Self>) -> Result<bool, BpfError>;
    /// The entry's stamp (CLOCK_MONOTONIC ns) and next hop.
    fn read_entry(p: &SteeringProgram, key: &FlowKey<Self>) -> Result<Option<(u64, u32)>, BpfError>;
    /// Points an existing entry at another next hop, keeping its stamp.
    fn repoint(p: &SteeringProgram, key: &FlowKey<Self>, next_hop: u32) -> Result<bool, BpfError>;
    /// The acknowledgment number and window the program last recorded
    /// under `key` (TCP segments with ACK set it translated).
    fn tcp_seen(p: &SteeringProgram, key: &FlowKey<Self>) -> Option<(u32, u16)>;
}

/// The table key of a flow key (`N`: the address width).
fn fp_key<A: NatAddr + Octets<N>, const N: usize>(k: &FlowKey<A>) -> FpKey<N> {
    FpKey::new(k.src, k.dst, k.sport(), k.dport(), k.proto)
}

// The operations of [`FpFamily`], written once over the address width.

fn insert_entry<A: NatAddr + Octets<N>, const N: usize>(
    p: &SteeringProgram,
    rw: &DirectionRewrite<A>,
    r: &FpRewrite,
) -> Result<(), BpfError> {
    p.fp_insert(&fp_key(&rw.key), &FpEntry::new(rw.new_src, rw.new_dst, r))
}

fn read_entry<A: NatAddr + Octets<N>, const N: usize>(
    p: &SteeringProgram,
    key: &FlowKey<A>,
) -> Result<Option<(u64, u32)>, BpfError> {
    Ok(p.fp_get(&fp_key::<A, N>(key))?.map(|e| (e.last_seen_ns, e.next_hop)))
}

fn repoint_entry<A: NatAddr + Octets<N>, const N: usize>(
    p: &SteeringProgram,
    key: &FlowKey<A>,
    next_hop: u32,
) -> Result<bool, BpfError> {
    let k = fp_key::<A, N>(key);
    let Some(mut e) = p.fp_get(&k)? else { return Ok(false) };
    e.next_hop = next_hop;
    p.fp_insert(&k, &e)?;
    Ok(true)
}

impl FpFamily for Ipv4Addr {
    fn nat(engine: &Engine) -> &NatTable<Self> {
        engine.nat4()
    }
    fn index(fp: &FastPath) -> &Index<Self> {
        &fp.installed4
    }
    fn insert(p: &SteeringProgram, rw: &DirectionRewrite<Self>, r: &FpRewrite) -> Result<(), BpfError> {
        insert_entry::<_, 4>(p, rw, r)
    }
    fn delete(p: &SteeringProgram, key: &FlowKey<Self>) -> Result<bool, BpfError> {
        p.fp_delete(&fp_key::<_, 4>(key))
    }
    fn read_entry(p: &SteeringProgram, key: &FlowKey<Self>) -> Result<Option<(u64, u32)>, BpfError> {
        read_entry::<_, 4>(p, key)
    }
    fn repoint(p: &SteeringProgram, key: &FlowKey<Self>, next_hop: u32) -> Result<bool, BpfError> {
        repoint_entry::<_, 4>(p, key, next_hop)
    }
    fn tcp_seen(p: &SteeringProgram, key: &FlowKey<Self>) -> Option<(u32, u16)> {
        p.fp_tcp_seen(&fp_key::<_, 4>(key))
    }
}

impl FpFamily for Ipv6Addr {
    fn nat(engine: &Engine) -> &NatTable<Self> {
        engine.nat6()
    }
    fn index(fp: &FastPath) -> &Index<Self> {
        &fp.installed6
    }
    fn insert(p: &SteeringProgram, rw: &DirectionRewrite<Self>, r: &FpRewrite) -> Result<(), BpfError> {
        insert_entry::<_, 16>(p, rw, r)
    }
    fn delete(p: &SteeringProgram, key: &FlowKey<Self>) -> Result<bool, BpfError> {
        p.fp_delete(&fp_key::<_, 16>(key))
    }
    fn read_entry(p: &SteeringProgram, key: &FlowKey<Self>) -> Result<Option<(u64, u32)>, BpfError> {
        read_entry::<_, 16>(p, key)
    }
    fn repoint(p: &SteeringProgram, key: &FlowKey<Self>, next_hop: u32) -> Result<bool, BpfError> {
        repoint_entry::<_, 16>(p, key, next_hop)
    }
    fn tcp_seen(p: &SteeringProgram, key: &FlowKey<Self>) -> Option<(u32, u16)> {
        p.fp_tcp_seen(&fp_key::<_, 16>(key))
    }
}

const DIRECTIONS: [Direction; 2] = [Direction::Outbound, Direction::Inbound];

fn keys<A: FpFamily>(view: &SessionView<A>) -> [FlowKey<A>; 2] {
    [view.tuple.outbound_key(), view.tuple.inbound_key()]
}

/// Where each direction's packets go after translation: the remote
/// (outbound), the pod (inbound).
fn destinations<A: FpFamily>(view: &SessionView<A>) -> [IpAddr; 2] {
    [view.tuple.remote.into(), view.tuple.pod.into()]
}

impl FastPath {
    /// The shared half over a loaded program; turns the program's fast path
    /// on. `udp_inbound_refresh` is the configuration's
    /// `nat.udpInboundRefresh` (kept current by [`FastPath::fence`]).
    pub fn new(program: Arc<SteeringProgram>, clock: EngineClock, udp_inbound_refresh: bool) -> Result<Self, BpfError> {
        program.fp_set_enabled(true)?;
        Ok(Self {
            program,
            clock,
            installed4: Mutex::new(HashMap::new()),
            installed6: Mutex::new(HashMap::new()),
            released: Mutex::new(Vec::new()),
            gate: RwLock::new(()),
            expired: Mutex::new(BTreeSet::new()),
            udp_inbound_refresh: AtomicBool::new(udp_inbound_refresh),
            stats: FastPathStats::default(),
        })
    }

    /// Registers `self` as the offload hook of `engine` (once) for each
    /// family the program was given sessions for; a family with none stays
    /// in the workers (`xdp.fastPathSessions: {ipv6: 0}`). Returns whether
    /// every such family was connected.
    pub fn connect(self: &Arc<Self>, engine: &Engine) -> bool {
        let options = self.program.options();
        let a = options.fast_path_sessions_v4 == 0 || engine.nat4().set_offload_hook(self.clone());
        let b = options.fast_path_sessions_v6 == 0 || engine.nat6().set_offload_hook(self.clone());
        a && b
    }

    /// The engine clock this fast path converts stamps with.
    pub fn clock(&self) -> &EngineClock {
        &self.clock
    }

    /// Installed sessions: (IPv4, IPv6).
    pub fn installed(&self) -> (usize, usize) {
        (self.installed4.lock().len(), self.installed6.lock().len())
    }

    /// The installed sessions of a family, copied.
    pub fn installed_sessions<A: FpFamily>(&self) -> Vec<Installed<A>> {
        A::index(self).lock().values().copied().collect()
    }

    fn error(&self, what: &str, e: &BpfError) {
        bump(&self.stats.errors);
        tracing::warn!(error = %e, "fast path: {what}");
    }

    /// Deletes both directions' entries of `view`.
    fn delete_entries<A: FpFamily>(&self, view: &SessionView<A>) {
        for key in keys(view) {
            if let Err(e) = A::delete(&self.program, &key) {
                self.error("deleting a session entry failed", &e);
            }
        }
    }

    /// Forgets an installed session: unindexes it and queues its next hops
    /// for release. Returns whether it was indexed.
    fn unindex<A: FpFamily>(&self, view: &SessionView<A>) -> bool {
        let removed = A::index(self).lock().remove(&(view.index, view.seq));
        match removed {
            Some(i) => {
                self.released.lock().extend(i.next_hops);
                true
            }
            None => false,
        }
    }

    /// Deletes from the kernel every installed session that `next` will not
    /// hold (its policy, egress IP or port range gone), waits until no XDP
    /// run still holds one of them, and returns the count with a guard:
    /// hold it until `next` is published, so no session valid only under
    /// the old tables is installed in between.
    pub fn fence<'a>(&'a self, next: &Tables) -> (usize, RwLockWriteGuard<'a, ()>) {
        let gate = self.gate.write();
        self.udp_inbound_refresh.store(next.nat.udp_inbound_refresh, Ordering::Relaxed);
        let n = self.fence_family::<Ipv4Addr>(next) + self.fence_family::<Ipv6Addr>(next);
        if n > 0 {
            // A frame whose run copied an entry before its deletion is still
            // translated with it; once this returns, no such frame is left
            // (the egress IP may be released right after the publication).
            if let Err(e) = self.program.wait_for_runs_in_flight() {
                self.error("waiting for XDP runs in flight after a fence", &e);
            }
        }
        (n, gate)
    }

    fn fence_family<A: FpFamily>(&self, next: &Tables) -> usize {
        let doomed: Vec<SessionView<A>> =
            A::index(self).lock().values().filter(|i| !NatTable::still_valid(&i.view, next)).map(|i| i.view).collect();
        for view in &doomed {
            // Kernel first: from here on the engine sees every packet, and
            // under the new tables it drops them.
            self.delete_entries(view);
            if self.unindex(view) {
                bump(&self.stats.fenced);
            }
        }
        doomed.len()
    }

    /// Makes `expired` the egress IPs past their deadline (see the field):
    /// the sessions of those newly in it leave the kernel (their fast-path
    /// record folded into the engine's session first, which keeps them),
    /// and no XDP run still holds one once this returns; those no longer
    /// in it may be installed again. Returns how many sessions left.
    pub fn set_expired(&self, engine: &Engine, expired: BTreeSet<IpAddr>) -> usize {
        let _gate = self.gate.write();
        let mut current = self.expired.lock();
        let newly: BTreeSet<IpAddr> = expired.difference(&current).copied().collect();
        let mut n = 0;
        if !newly.is_empty() {
            n = self.withdraw_family::<Ipv4Addr>(engine, &newly) + self.withdraw_family::<Ipv6Addr>(engine, &newly);
            if n > 0 {
                if let Err(e) = self.program.wait_for_runs_in_flight() {
                    self.error("waiting for XDP runs in flight after taking expired sessions out", &e);
                }
            }
        }
        *current = expired;
        n
    }

    /// The egress IPs whose sessions are kept out of the kernel.
    pub fn expired(&self) -> BTreeSet<IpAddr> {
        self.expired.lock().clone()
    }

    fn withdraw_family<A: FpFamily>(&self, engine: &Engine, ips: &BTreeSet<IpAddr>) -> usize {
        let views: Vec<SessionView<A>> = A::index(self)
            .lock()
            .values()
            .filter(|i| ips.contains(&i.view.tuple.egress.into()))
            .map(|i| i.view)
            .collect();
        let nat = A::nat(engine);
        for view in &views {
            nat.offload_fold(view);
            self.delete_entries(view);
            if self.unindex(view) {
                nat.offload_withdrawn(view);
                bump(&self.stats.expired);
            }
        }
        views.len()
    }

    /// Deletes every entry and forgets every session (the fast path is being
    /// turned off with the daemon).
    pub fn clear(&self) {
        let _gate = self.gate.write();
        self.installed4.lock().clear();
        self.installed6.lock().clear();
        if let Err(e) = self.program.fp_clear() {
            self.error("clearing the session maps failed", &e);
        }
    }

    /// The counters as `egret counters` shows them.
    pub fn snapshot(&self) -> FastPathCounters {
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let named = |list: &[(&str, &AtomicU64)]| list.iter().map(|(n, c)| (n.to_string(), get(c))).collect();
        let mut packets = Vec::new();
        match self.program.verdict_counters() {
            Ok(v) => {
                let hits = v
                    .iter()
                    .filter(|(r, _)| matches!(r, VerdictReason::TxFastPath | VerdictReason::RedirectFastPath))
                    .map(|(_, n)| *n)
                    .sum();
                packets.push(("hit".to_string(), hits));
            }
            Err(e) => self.error("reading the verdict counters failed", &e),
        }
        match self.program.fp_counters() {
            Ok(v) => packets.extend(v.into_iter().map(|(r, n)| (r.name().to_string(), n))),
            Err(e) => self.error("reading the fast-path counters failed", &e),
        }
        let (v4, v6) = self.installed();
        let options = self.program.options();
        FastPathCounters {
            enabled: true,
            sessions_v4: v4 as u64,
            sessions_v6: v6 as u64,
            capacity_v4: u64::from(options.fast_path_sessions_v4),
            capacity_v6: u64::from(options.fast_path_sessions_v6),
            next_hops: get(&s.next_hops),
            packets,
            offloads: named(&[
                ("installed", &s.installed),
                ("refused_map_full", &s.refused_map_full),
                ("refused_no_route", &s.refused_no_route),
                ("refused_kernel_route", &s.refused_kernel_route),
                ("refused_next_hops_full", &s.refused_next_hops_full),
                ("refused_invalid", &s.refused_invalid),
                ("not_eligible", &s.not_eligible),
                ("lost_race", &s.lost_race),
                ("errors", &s.errors),
            ]),
            removals: named(&[
                ("removed", &s.removed),
                ("fenced", &s.fenced),
                ("withdrawn", &s.withdrawn),
                ("expired", &s.expired),
            ]),
            next_hop_updates: get(&s.next_hop_updates),
            rerouted: get(&s.rerouted),
        }
    }
}

impl<A: FpFamily> OffloadHook<A> for FastPath {
    /// The latest stamp of the session's directions that refresh it: both,
    /// except UDP's inbound one unless `nat.udpInboundRefresh` (RFC 4787
    /// REQ-6), exactly as the engine refreshes on its own packets.
    fn last_seen(&self, view: &SessionView<A>) -> Option<u32> {
        let refresh_inbound = view.tuple.proto != proto::UDP || self.udp_inbound_refresh.load(Ordering::Relaxed);
        let mut best = None;
        for (key, dir) in keys(view).iter().zip(DIRECTIONS) {
            if dir == Direction::Inbound && !refresh_inbound {
                continue;
            }
            match A::read_entry(&self.program, key) {
                Ok(Some((ns, _))) => best = best.max(self.clock.stamp_secs(ns)),
                Ok(None) => {}
                Err(e) => self.error("reading a session entry failed", &e),
            }
        }
        best
    }

    /// The pod's direction (outbound) as the program recorded it: the
    /// acknowledgments and windows the pod sent while offloaded.
    fn pod_ack(&self, view: &SessionView<A>) -> Option<(u32, u16)> {
        A::tcp_seen(&self.program, &view.tuple.outbound_key())
    }

    fn remove(&self, view: &SessionView<A>) {
        self.delete_entries(view);
        if self.unindex(view) {
            bump(&self.stats.removed);
        }
    }
}

/// The manager: installs what the engine asks for and keeps next hops current.
pub struct OffloadManager {
    fp: Arc<FastPath>,
    engine: Engine,
    hops: NextHopTable,
    fib_generation: u64,
    routes: Vec<(IpAddr, u8, Route)>,
}

impl std::fmt::Debug for OffloadManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadManager").field("next_hops", &self.hops.len()).finish_non_exhaustive()
    }
}

fn sorted_routes(fib: &Fib) -> Vec<(IpAddr, u8, Route)> {
    let mut v: Vec<_> = fib.routes().collect();
    v.sort_by_key(|r| (r.0, r.1, r.2.oif, r.2.gateway));
    v
}

impl OffloadManager {
    /// A manager for `fp` over `engine`, with `next_hops` table entries.
    pub fn new(fp: Arc<FastPath>, engine: Engine, next_hops: u32) -> Self {
        // Roles are set before the manager starts and do not change at run
        // time (interfaces are restart-only settings).
        let hops = NextHopTable::new(next_hops).not_back(engine.ingress().outside_interfaces());
        Self { fp, engine, hops, fib_generation: u64::MAX, routes: Vec::new() }
    }

    /// One round: releases, forwarding changes, installations. Returns the
    /// number of sessions it handled (0 when idle).
    pub fn run_once(&mut self) -> usize {
        let now = Instant::now();
        let released: Vec<u32> = std::mem::take(&mut *self.fp.released.lock());
        for id in released {
            self.hops.release(id, now);
        }
        let fp = self.fp.clone();
        let _gate = fp.gate.read();
        let fib = self.engine.fib();
        if fib.generation() != self.fib_generation {
            self.fib_generation = fib.generation();
            self.sync_fib(&fib, now);
        }
        let tables = self.engine.tables();
        let n =
            self.install_family::<Ipv4Addr>(&tables, &fib, now) + self.install_family::<Ipv6Addr>(&tables, &fib, now);
        self.fp.stats.next_hops.store(self.hops.len() as u64, Ordering::Relaxed);
        // The program's traffic keeps its next hops' kernel entries alive (next_hops.rs).
        self.hops.touch_in_use(self.engine.neighbor_use(), self.fp.clock.at(now).secs());
        n
    }

    /// Runs until `stop`: a round every [`TICK`] (at once again when a round
    /// had a full batch).
    pub fn run(mut self, stop: Arc<AtomicBool>) {
        while !stop.load(Ordering::Acquire) {
            if self.run_once() < BATCH {
                std::thread::sleep(TICK);
            }
        }
    }

    fn sync_fib(&mut self, fib: &Fib, now: Instant) {
        for (id, value) in self.hops.sync(fib) {
            match self.fp.program.fp_set_next_hop(id, &value) {
                Ok(()) => bump(&self.fp.stats.next_hop_updates),
                Err(e) => self.fp.error("updating a next hop failed", &e),
            }
        }
        let routes = sorted_routes(fib);
        if routes != self.routes {
            self.routes = routes;
            self.reroute::<Ipv4Addr>(fib, now);
            self.reroute::<Ipv6Addr>(fib, now);
        }
    }

    /// After a route change: points every installed direction whose
    /// (interface, next hop) changed at the new one; sessions that lost
    /// their route go back to userspace (which drops them as `no_route`,
    /// or, when the route to the pod now leaves through a tunnel Egret does
    /// not drive, hands the replies to the kernel: ADR 0008).
    fn reroute<A: FpFamily>(&mut self, fib: &Fib, now: Instant) {
        for inst in self.fp.installed_sessions::<A>() {
            let mut ids = inst.next_hops;
            let mut lost = false;
            for (d, (dst, key)) in destinations(&inst.view).into_iter().zip(keys(&inst.view)).enumerate() {
                let want = route_key(fib, dst);
                if want == self.hops.key_of(ids[d]) {
                    continue;
                }
                let Some(want) = want else {
                    lost = true;
                    break;
                };
                match self.acquire(fib, want, now) {
                    Some(id) => match A::repoint(&self.fp.program, &key, id) {
                        Ok(_) => {
                            self.hops.release(ids[d], now);
                            ids[d] = id;
                            bump(&self.fp.stats.rerouted);
                        }
                        Err(e) => {
                            self.hops.release(id, now);
                            self.fp.error("re-pointing a session entry failed", &e);
                        }
                    },
                    None => {
                        lost = true;
                        break;
                    }
                }
            }
            let mut index = A::index(&self.fp).lock();
            let Some(entry) = index.get_mut(&(inst.view.index, inst.view.seq)) else {
                // Removed meanwhile: its old ids were queued for release;
                // the new ones are ours to drop.
                drop(index);
                for (d, id) in ids.iter().enumerate() {
                    if *id != inst.next_hops[d] {
                        self.hops.release(*id, now);
                    }
                }
                continue;
            };
            entry.next_hops = ids;
            drop(index);
            if lost {
                A::nat(&self.engine).offload_fold(&inst.view);
                self.fp.delete_entries(&inst.view);
                if self.fp.unindex(&inst.view) {
                    A::nat(&self.engine).offload_withdrawn(&inst.view);
                    bump(&self.fp.stats.withdrawn);
                }
            }
        }
    }

    /// A reference on next hop `key`, writing a new entry first.
    fn acquire(&mut self, fib: &Fib, key: next_hops::HopKey, now: Instant) -> Option<u32> {
        let (id, write) = self.hops.acquire_key(fib, key, now).ok()?;
        if let Some(v) = write {
            if let Err(e) = self.fp.program.fp_set_next_hop(id, &v) {
                self.fp.error("writing a next hop failed", &e);
                self.hops.release(id, now);
                return None;
            }
        }
        Some(id)
    }

    fn install_family<A: FpFamily>(&mut self, tables: &Tables, fib: &Fib, now: Instant) -> usize {
        let engine = self.engine.clone();
        let nat = A::nat(&engine);
        let requests = nat.drain_offload_requests(BATCH);
        let n = requests.len();
        for view in requests {
            self.install(nat, &view, tables, fib, now);
        }
        n
    }

    /// Installs one session (see the module doc for every outcome).
    pub fn install<A: FpFamily>(
        &mut self,
        nat: &NatTable<A>,
        view: &SessionView<A>,
        tables: &Tables,
        fib: &Fib,
        now: Instant,
    ) -> bool {
        let fp = self.fp.clone();
        let stats = &fp.stats;
        if view.tuple.proto != proto::TCP && view.tuple.proto != proto::UDP {
            nat.offload_done(view, false);
            bump(&stats.not_eligible);
            return false;
        }
        if !NatTable::still_valid(view, tables) {
            nat.offload_done(view, false);
            bump(&stats.refused_invalid);
            return false;
        }
        if fp.expired.lock().contains(&view.tuple.egress.into()) {
            // Not for good: a dormant IP's session may ask again once the
            // IP is valid again.
            nat.offload_withdrawn(view);
            bump(&stats.refused_invalid);
            return false;
        }
        let mut ids = [0u32; 2];
        for (d, dst) in destinations(view).into_iter().enumerate() {
            let got = match route_key(fib, dst) {
                None => Err(no_key_because(fib, dst)),
                Some(key) => self.acquire(fib, key, now).ok_or(HopError::Full),
            };
            match got {
                Ok(id) => ids[d] = id,
                Err(e) => {
                    for id in &ids[..d] {
                        self.hops.release(*id, now);
                    }
                    nat.offload_done(view, false);
                    bump(match e {
                        HopError::NoRoute => &stats.refused_no_route,
                        HopError::KernelRoute => &stats.refused_kernel_route,
                        HopError::Full => &stats.refused_next_hops_full,
                    });
                    return false;
                }
            }
        }
        let slot = view.policy_slot.min((POLICY_SLOTS - 1) as u16);
        for (d, dir) in DIRECTIONS.into_iter().enumerate() {
            let rw = direction_rewrite(&view.tuple, view.deltas, dir);
            let r = FpRewrite {
                new_sport: rw.new_sport,
                new_dport: rw.new_dport,
                l3_delta: rw.l3_delta,
                l4_delta: rw.l4_delta,
                next_hop: ids[d],
                policy_slot: slot,
                direction: if dir == Direction::Outbound { DIR_OUTBOUND } else { DIR_INBOUND },
            };
            if let Err(e) = A::insert(&self.fp.program, &rw, &r) {
                if d == 1 {
                    let _ = A::delete(&self.fp.program, &view.tuple.outbound_key());
                }
                for id in ids {
                    self.hops.release(id, now);
                }
                nat.offload_done(view, false);
                match e {
                    BpfError::FastPathFull { .. } => bump(&stats.refused_map_full),
                    other => self.fp.error("installing a session entry failed", &other),
                }
                return false;
            }
        }
        // Indexed before the engine may hand it to a remover (see the
        // module doc): a removal after offload_done(true) finds it here.
        A::index(&self.fp).lock().insert((view.index, view.seq), Installed { view: *view, next_hops: ids });
        if nat.offload_done(view, true) {
            bump(&stats.installed);
            true
        } else {
            self.fp.delete_entries(view);
            A::index(&self.fp).lock().remove(&(view.index, view.seq));
            for id in ids {
                self.hops.release(id, now);
            }
            bump(&stats.lost_race);
            false
        }
    }
}
