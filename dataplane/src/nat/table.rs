//! One address family's NAT instance: the session table, the mappings and
//! port pools, and the fragment cache, with the operations the engine's slow
//! path and the sweeper need.
//!
//! - Outbound creation: paired pooling picks the egress IP, the per-source
//!   limit and the table capacity are checked (evicting under pressure, see
//!   below), a port is allocated by try-insert within the pod's port quota
//!   on that egress IP (`nat.maxPortsPerSource`), and the session is
//!   inserted with its precomputed checksum deltas.
//! - Eviction under pressure takes from the offender first: among a sample
//!   of sessions, an expired one; else one of the source holding the most
//!   sessions, when that source holds more than an even share of the table
//!   (capacity / sources); else the longest idle, transitory TCP first. A
//!   pod filling the table therefore loses its own sessions, not other
//!   pods' established ones.
//! - Inbound creation: only with endpoint-independent filtering, for a port a
//!   pod's mapping holds.
//! - Expiry (RFC 4787 REQ-5, RFC 5382 REQ-5, RFC 5508 REQ-1): a session is
//!   expired as soon as its idle time passes its timeout, whether the sweeper
//!   has reached it or not (a lookup that finds it expired treats it as a
//!   miss). The sweeper visits a bounded number of slots per tick.
//! - Revalidation: every session records the configuration generation it
//!   was checked against; after a reload it is checked again on its next
//!   packet (or by the sweeper) and removed if its policy, its egress IP or
//!   its port range no longer holds. Losing an egress IP therefore stops its
//!   translation at the very next packet.
//! - Translation logs (translog.rs, ADR 0034): a worker's successful
//!   insert and removal each push one record to the worker's ring when it
//!   passes one ([`CreateCtx::log`], [`End::log`]); an offloaded session's
//!   end carries the fast path's last-seen stamp, read before its kernel
//!   entries are deleted. [`NatTable::import`] logs nothing.
//! - Session sync (nat/sync.rs): once enabled, creations and removals are
//!   journaled for the control plane to send a standby, which installs
//!   them with their exact ports when it takes the egress IP over
//!   ([`NatTable::import`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam::queue::ArrayQueue;
use dashmap::DashMap;
use parking_lot::Mutex;

use super::fragments::FragmentCache;
use super::key::{proto, FlowKey, NatAddr, SessionTuple};
use super::mapping::{AcquireError, Acquired, ClaimError, MappingRequest, Mappings};
use super::pool_memo::PoolMemo;
use super::port_alloc::{candidates, PortPool, PortRange, PortRng};
use super::port_blocks::{self, BlockClaimError, BlockPool, BlockRefusal, PortBlocks};
use super::session::{offload, session_flags, InsertError, SessionInit, SessionTable, SessionView};
use super::shard_map::ShardMap;
use super::sync::{ImportRefusal, ImportReport, JournalEntry, SessionKeyRecord, SessionRecord, SyncEvent, SyncJournal};
use super::tcp_state;
use crate::policy::Decision;
use crate::stats::{Direction, DropReason, Event, WorkerStats};
use crate::tables::{FilteringBehavior, MappingBehavior, NatSettings, Policy, PolicyFamily, Tables};
use crate::translog::{log_flags, EndReason, LogKind, LogRecord, LogTo};

/// Sessions sampled to choose a victim when the table is full.
const EVICTION_SAMPLE: u32 = 32;

/// How strongly a session is chosen for eviction, compared in order:
/// expired, its source's sessions above an even share of the table,
/// transitory TCP, seconds idle.
type EvictionScore = (bool, u64, bool, u32);

/// An outbound packet that found no session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutboundRequest<A> {
    /// The pod.
    pub pod: A,
    /// The pod's port (ICMP: identifier).
    pub pod_port: u16,
    /// The destination.
    pub remote: A,
    /// The destination port (ICMP: 0).
    pub remote_port: u16,
    /// The protocol.
    pub proto: u8,
    /// TCP flags (0 for other protocols).
    pub tcp_flags: u8,
}

impl<A: NatAddr> OutboundRequest<A> {
    /// The session this request would make through `egress`, its egress
    /// port not chosen yet (0).
    fn tuple(&self, egress: A) -> SessionTuple<A> {
        SessionTuple {
            pod: self.pod,
            remote: self.remote,
            egress,
            pod_port: self.pod_port,
            remote_port: self.remote_port,
            egress_port: 0,
            proto: self.proto,
        }
    }
}

/// Computes a session's checksum deltas (the engine's rewrite module knows how).
pub type DeltaFn<'a, A> = &'a dyn Fn(&SessionTuple<A>) -> u32;

/// The XDP fast path as the NAT state sees it (implemented by the daemon).
///
/// Sessions whose packets may bypass userspace are marked
/// [`offload::INSTALLED`]. Userspace stays the authority on expiry: when an
/// installed session looks idle by its own last-seen stamp, the NAT asks the
/// hook for the kernel's stamp before expiring it, and it removes the kernel's
/// entries (through the hook) before the session's slot is freed.
pub trait OffloadHook<A>: Send + Sync {
    /// The last second (engine clock) the fast path translated a packet of
    /// this session, if it has one.
    fn last_seen(&self, view: &SessionView<A>) -> Option<u32>;
    /// The acknowledgment number and raw window of the latest TCP segment
    /// with ACK set that the fast path translated from the pod (its outbound
    /// direction), if it recorded one for the session as installed now.
    fn pod_ack(&self, view: &SessionView<A>) -> Option<(u32, u16)> {
        let _ = view;
        None
    }
    /// Removes the session's entries from the fast path. Must take effect
    /// before returning.
    fn remove(&self, view: &SessionView<A>);
}

/// The XDP program's mapped-port filter as the NAT sees it (rule 4a in
/// steer.bpf.c; the daemon implements it over `egret_bpf::MappedPorts`).
///
/// The NAT marks a port mapped before its first session is inserted,
/// before the packet that created it is sent (so no reply can come back to
/// a port still marked unmapped), and unmapped once its last session is
/// removed. In endpoint-independent mode the port's owner cell counts its
/// sessions (the mapping lives exactly as long as they do, so its port
/// stays reachable from any remote while it lives) and marks it
/// (`PortMarks`, ADR 0048); in endpoint-dependent mode the NAT counts each
/// port's sessions itself.
pub trait PortMapHook<A>: Send + Sync {
    /// Starts filtering (`egress`, `proto`): its NAT ports no session uses
    /// are dropped by the program from now on.
    fn track(&self, egress: A, proto: u8);
    /// Marks `port` of (`egress`, `proto`) mapped or not. Calls for one port
    /// are serialised by the NAT.
    fn set(&self, egress: A, proto: u8, port: u16, mapped: bool);
    /// Stops filtering `egress` (this gateway no longer holds it).
    fn forget(&self, egress: A);
    /// Where (`egress`, `proto`)'s bits are now, for a caller that marks
    /// many of its ports to keep ([`Self::set_at`]); `None` (the default)
    /// when the hook has no such place, or the pair is not tracked.
    fn locate(&self, _egress: A, _proto: u8) -> Option<PortBitsAt> {
        None
    }
    /// [`Self::set`] at a place [`Self::locate`] gave, without looking the
    /// pair up. False, and nothing marked, when the place is no longer the
    /// pair's (the filter forgot it since): the caller then calls
    /// [`Self::set`] and locates the pair again.
    fn set_at(&self, _at: PortBitsAt, _port: u16, _mapped: bool) -> bool {
        false
    }
}

/// A place a [`PortMapHook`] gave for one (egress IP, protocol)'s bits:
/// opaque to the NAT, which keeps it per port pool (`PortMarks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortBitsAt(pub std::num::NonZeroU64);

/// Sessions waiting to be offloaded, per family.
pub(crate) const OFFLOAD_QUEUE: usize = 8192;

/// Why a session is being removed, and where its end is logged.
#[derive(Clone, Copy, Debug)]
pub struct End<'a> {
    /// Why.
    pub reason: EndReason,
    /// The fast path's last-seen stamp (engine seconds), when the caller
    /// read it on the way here: folded into the logged last packet, never
    /// read twice.
    pub fast_path_seen: Option<u32>,
    /// The worker's ring; `None`: logging is off.
    pub log: Option<LogTo<'a>>,
}

impl End<'_> {
    /// An end that logs nothing (tests, and callers outside the workers).
    pub const fn unlogged(reason: EndReason) -> End<'static> {
        End { reason, fast_path_seen: None, log: None }
    }
}

/// What [`NatTable::offload_refresh`] found for a session that looks expired.
enum Refresh {
    /// The fast path saw a packet within the timeout: the session lives.
    Alive,
    /// Expired; the fast path's stamp if one was read.
    Expired(Option<u32>),
}

/// One address family's NAT state.
pub struct NatTable<A: NatAddr> {
    /// The sessions.
    pub sessions: SessionTable<A>,
    /// Mappings and port pools.
    pub mappings: Mappings<A>,
    /// Fragment translations.
    pub fragments: FragmentCache<A>,
    /// Sessions per pod (nat/shard_map.rs).
    per_source: ShardMap<A, u32>,
    offload_hook: OnceLock<Arc<dyn OffloadHook<A>>>,
    offload_queue: ArrayQueue<(u32, u32)>,
    port_map_hook: OnceLock<Arc<dyn PortMapHook<A>>>,
    /// Sessions per (egress IP, protocol, port) in endpoint-dependent mode,
    /// while a port map is connected (in endpoint-independent mode the
    /// owner cells count them: `PortMarks`). A `ShardMap`: one spin-locked
    /// shard per update, its line asked for with a new flow's others.
    port_users: ShardMap<(A, u8, u16), u32>,
    /// The session sync journal, once enabled (nat/sync.rs).
    sync: OnceLock<SyncJournal<A>>,
    /// Port blocks of the egress IPs in block mode (nat/port_blocks.rs).
    blocks: DashMap<A, Arc<BlockPool<A>>, ahash::RandomState>,
    /// Block pools replaced by a change of geometry whose blocks are still
    /// held (rare; [`NatTable::block_pool`]).
    retired_blocks: Mutex<Vec<Arc<BlockPool<A>>>>,
    /// The epoch of the last block pool made for each egress IP in block
    /// mode, while it has one ([`NatTable::block_pool`]).
    block_epochs: DashMap<A, u16, ahash::RandomState>,
    /// Egress IPs no longer held whose pools the sweep is to forget
    /// ([`NatTable::forget_egress`]), each with the second from which it
    /// found them all gone; and whether there is anything for the sweep
    /// to do (those, or retired block pools).
    unheld_pools: Mutex<Vec<(A, Option<u32>)>>,
    pools_left: AtomicBool,
}

/// How long an egress IP no longer held stays on the sweep's list after
/// its pools were all found gone: a worker still on the tables from before
/// it left may make one again, which the list's next sweeps then forget.
pub const FORGET_SETTLE_SECS: u32 = 2;

/// Whether nothing holds `b`: no block taken, and no reference but its
/// holder's (the map's or the retired list's; a worker on an older
/// snapshot may be about to take a block in it). Asked under the map's
/// shard lock or the retired list's lock.
fn blocks_unused<A: NatAddr>(b: &Arc<BlockPool<A>>) -> bool {
    if Arc::strong_count(b) != 1 {
        return false;
    }
    std::sync::atomic::fence(Ordering::Acquire);
    b.taken() == 0
}

impl<A: NatAddr> std::fmt::Debug for NatTable<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatTable")
            .field("sessions", &self.sessions.len())
            .field("mappings", &self.mappings.len())
            .field("offload", &self.offload_hook.get().is_some())
            .finish_non_exhaustive()
    }
}

impl<A: NatAddr + PolicyFamily> NatTable<A> {
    /// A NAT instance sized by `settings` (capacity, mapping mode and fragment
    /// cache are fixed for its life).
    pub fn new(settings: &NatSettings) -> Self {
        NatTable {
            sessions: SessionTable::new(settings.max_sessions),
            mappings: Mappings::new(settings.mapping == MappingBehavior::EndpointIndependent),
            fragments: FragmentCache::new(settings.fragments.cache_entries, settings.fragments.timeout),
            per_source: ShardMap::with_default_shards(),
            offload_hook: OnceLock::new(),
            offload_queue: ArrayQueue::new(OFFLOAD_QUEUE),
            port_map_hook: OnceLock::new(),
            port_users: ShardMap::with_default_shards(),
            sync: OnceLock::new(),
            blocks: DashMap::with_hasher(ahash::RandomState::new()),
            retired_blocks: Mutex::new(Vec::new()),
            block_epochs: DashMap::with_hasher(ahash::RandomState::new()),
            unheld_pools: Mutex::new(Vec::new()),
            pools_left: AtomicBool::new(false),
        }
    }

    /// The port blocks of `egress` in block mode `cfg` over `range`, of
    /// the tables of `generation`, made on first use. A change of
    /// `logSessions` or `maxPerPod` applies in place; a change of block
    /// size or range makes a pool of another epoch, and the old one, while
    /// a block of it is held, is retired: its sessions leave into it
    /// ([`session_flags::BLOCK_EPOCH`]) and its blocks' release is logged
    /// as they are freed (ADR 0042). A caller on tables older than the
    /// pool's configuration gets the pool as it is.
    pub fn block_pool(&self, egress: A, cfg: PortBlocks, range: PortRange, generation: u64) -> Arc<BlockPool<A>> {
        if let Some(b) = self.blocks.get(&egress) {
            if (b.same_geometry(cfg, range) && b.config() == cfg) || generation < b.generation() {
                return b.clone();
            }
        }
        match self.blocks.entry(egress) {
            dashmap::Entry::Occupied(mut o) => {
                let b = o.get();
                if generation < b.generation() || (b.same_geometry(cfg, range) && b.config() == cfg) {
                } else if b.same_geometry(cfg, range) {
                    b.set_config(cfg, generation);
                } else {
                    let epoch = self.next_block_epoch(egress, Some(b.epoch()));
                    let old = o.insert(Arc::new(BlockPool::made(egress, cfg, range, epoch, generation)));
                    self.retire_blocks(old);
                }
                o.get().clone()
            }
            dashmap::Entry::Vacant(v) => {
                let epoch = self.next_block_epoch(egress, None);
                v.insert(Arc::new(BlockPool::made(egress, cfg, range, epoch, generation))).clone()
            }
        }
    }

    /// The epoch of the next block pool of `egress`: the one after the
    /// last made for it, passing over those of its pools still alive (the
    /// `current` one and the retired), so a session's epoch names one
    /// pool. Called under `egress`'s entry in the block map.
    fn next_block_epoch(&self, egress: A, current: Option<u16>) -> u16 {
        let mut used = [false; port_blocks::EPOCHS as usize];
        if let Some(e) = current {
            used[usize::from(e)] = true;
        }
        for b in self.retired_blocks.lock().iter().filter(|b| b.egress() == egress) {
            used[usize::from(b.epoch())] = true;
        }
        let mut last = self.block_epochs.entry(egress).or_insert(port_blocks::EPOCHS - 1);
        let next = (1..=port_blocks::EPOCHS)
            .map(|k| (*last + k) % port_blocks::EPOCHS)
            .find(|e| !used[usize::from(*e)])
            .unwrap_or((*last + 1) % port_blocks::EPOCHS);
        *last = next;
        next
    }

    /// Keeps `old`, no longer its egress IP's pool, while a block of it is
    /// held (or a worker still holds it); the sweep drops it after.
    fn retire_blocks(&self, old: Arc<BlockPool<A>>) {
        if !blocks_unused(&old) {
            let mut retired = self.retired_blocks.lock();
            retired.push(old);
            self.pools_left.store(true, Ordering::Relaxed);
        }
    }

    /// The port blocks of `egress`, if it has been in block mode.
    pub fn existing_block_pool(&self, egress: A) -> Option<Arc<BlockPool<A>>> {
        self.blocks.get(&egress).map(|b| b.clone())
    }

    /// Every egress IP's port blocks, including those of an IP no longer
    /// in block mode and the pools retired by a change of block size or
    /// range whose blocks are still held (metrics, `egret port-blocks`).
    pub fn block_pools(&self) -> Vec<Arc<BlockPool<A>>> {
        let mut all: Vec<_> = self.blocks.iter().map(|b| b.value().clone()).collect();
        all.extend(self.retired_blocks.lock().iter().cloned());
        all
    }

    /// Connects the XDP program's mapped-port filter (once, before traffic).
    pub fn set_port_map_hook(&self, hook: Arc<dyn PortMapHook<A>>) -> bool {
        if self.port_map_hook.set(hook.clone()).is_err() {
            return false;
        }
        // Endpoint-independent: the pools' owner cells mark their ports
        // (nat/port_alloc.rs, `PortMarks`); endpoint-dependent: the
        // sessions' own count per port here (`port_used`).
        if self.mappings.endpoint_independent() {
            self.mappings.connect_marks(hook);
        }
        true
    }

    /// Starts filtering the TCP and UDP NAT ports of an egress IP this
    /// gateway now holds (the engine calls it on every publish), and takes
    /// it off the sweep's list of IPs to forget.
    pub fn track_egress(&self, egress: A) {
        let mut regained = false;
        if self.pools_left.load(Ordering::Relaxed) {
            self.unheld_pools.lock().retain(|(e, _)| {
                regained |= *e == egress;
                *e != egress
            });
        }
        if let Some(h) = self.port_map_hook.get() {
            h.track(egress, proto::TCP);
            h.track(egress, proto::UDP);
            if regained {
                // The filter dropped the IP's bits when it was forgotten,
                // and its sessions may still hold ports: their owner cells
                // (endpoint-independent) or their counts per port
                // (endpoint-dependent) mark them again, each under the
                // lock its port's set and clear take.
                self.mappings.remark(egress);
                self.port_users.for_each(|&(e, proto, port), &n| {
                    if e == egress && n > 0 {
                        h.set(e, proto, port, true);
                    }
                });
            }
        }
    }

    /// Forgets an egress IP this gateway no longer holds: its port
    /// filter, and its pools, mappings and blocks once nothing holds them.
    /// Those its sessions still hold (the sweep has not reached them)
    /// stay, so each session gives back what it took, and the IP, back
    /// before then, finds its ports still taken. The IP stays on the
    /// sweep's list until its pools are gone and stay gone for
    /// [`FORGET_SETTLE_SECS`] (a worker on the tables from before may make
    /// one again meanwhile), or until it is held again
    /// ([`NatTable::track_egress`]); ADR 0042.
    pub fn forget_egress(&self, egress: A) {
        self.forget_pools(egress);
        {
            let mut left = self.unheld_pools.lock();
            if !left.iter().any(|(e, _)| *e == egress) {
                left.push((egress, None));
            }
        }
        self.pools_left.store(true, Ordering::Relaxed);
        if let Some(h) = self.port_map_hook.get() {
            // The counts per port stay (endpoint-dependent mode): they
            // drain as the IP's sessions end, and mark their ports again if
            // the IP is held again first (`track_egress`).
            h.forget(egress);
        }
    }

    /// Drops what nothing holds of `egress`'s pools and blocks; whether
    /// all of them are gone (the retired block pools too).
    fn forget_pools(&self, egress: A) -> bool {
        let pools_gone = self.mappings.forget_egress(egress);
        self.blocks.remove_if(&egress, |_, b| blocks_unused(b));
        let blocks_gone =
            !self.blocks.contains_key(&egress) && !self.retired_blocks.lock().iter().any(|b| b.egress() == egress);
        if blocks_gone {
            self.block_epochs.remove(&egress);
        }
        pools_gone && blocks_gone
    }

    /// The sweep's part, at `now` (seconds): drops the retired block pools
    /// whose last block was freed, and forgets the pools of egress IPs no
    /// longer held once their last session has ended. A flag's test when
    /// there is nothing to do; one worker at a time.
    fn forget_unheld_pools(&self, now: u32) {
        if !self.pools_left.load(Ordering::Relaxed) {
            return;
        }
        let Some(mut left) = self.unheld_pools.try_lock() else { return };
        left.retain_mut(|(egress, gone_since)| {
            if !self.forget_pools(*egress) {
                *gone_since = None;
                return true;
            }
            let since = *gone_since.get_or_insert(now);
            now.saturating_sub(since) < FORGET_SETTLE_SECS
        });
        // Under the retired list's lock: a pool retired meanwhile sets the
        // flag after this (found by a review).
        let mut retired = self.retired_blocks.lock();
        retired.retain(|b| !blocks_unused(b));
        self.pools_left.store(!retired.is_empty() || !left.is_empty(), Ordering::Relaxed);
    }

    /// Sessions using (egress, proto, port) while a port map is connected.
    pub fn port_users(&self, egress: A, proto: u8, port: u16) -> u32 {
        self.port_users.count((egress, proto, port))
    }

    /// Inserts a session, its port marked mapped first (so the mark is never
    /// behind a session another worker could already remove).
    /// With `log`, a successful insert pushes the session's create record.
    fn insert_marked(
        &self,
        tuple: &SessionTuple<A>,
        init: &SessionInit,
        log: Option<LogTo<'_>>,
    ) -> Result<SessionView<A>, InsertError> {
        self.port_used(tuple, init.flags);
        let r = self.sessions.insert(tuple, init);
        match &r {
            Ok(v) => {
                if let Some(j) = self.sync.get() {
                    j.push(JournalEntry::Live { index: v.index, seq: v.seq });
                }
                if let Some(l) = log {
                    let flags =
                        if init.flags & session_flags::INBOUND_CREATED != 0 { log_flags::INBOUND_CREATED } else { 0 };
                    l.push(LogRecord::session(LogKind::SessionCreate, tuple, l.now_ms, flags));
                }
            }
            Err(_) => self.port_unused(tuple, init.flags),
        }
        r
    }

    /// A session now uses its external port: the first marks it mapped.
    /// A session on a mapping (endpoint-independent mode) is counted by
    /// its mapping's owner cell, which marked the port when it was
    /// claimed (`PortMarks`, nat/port_alloc.rs): only endpoint-dependent
    /// sessions are counted here.
    #[inline]
    fn port_used(&self, t: &SessionTuple<A>, flags: u16) {
        if flags & session_flags::HAS_MAPPING != 0 {
            return;
        }
        let Some(h) = self.port_map_hook.get() else { return };
        if t.proto != proto::TCP && t.proto != proto::UDP {
            return;
        }
        // The key's shard lock serialises this port's set and clear.
        let key = (t.egress, t.proto, t.egress_port);
        self.port_users.update(&key, |l| match l.get_mut(&key) {
            Some(n) => *n = n.saturating_add(1),
            None => {
                h.set(t.egress, t.proto, t.egress_port, true);
                l.insert(key, 1);
            }
        });
    }

    /// A session no longer uses its external port: the last marks it
    /// unmapped (a session on a mapping: its mapping's release does).
    #[inline]
    fn port_unused(&self, t: &SessionTuple<A>, flags: u16) {
        if flags & session_flags::HAS_MAPPING != 0 {
            return;
        }
        let Some(h) = self.port_map_hook.get() else { return };
        let key = (t.egress, t.proto, t.egress_port);
        self.port_users.update(&key, |l| {
            let Some(n) = l.get_mut(&key) else { return };
            *n = n.saturating_sub(1);
            if *n == 0 {
                h.set(t.egress, t.proto, t.egress_port, false);
                l.remove(&key);
            }
        });
    }

    /// Connects the XDP fast path (once). Until then nothing is offloaded.
    pub fn set_offload_hook(&self, hook: Arc<dyn OffloadHook<A>>) -> bool {
        self.offload_hook.set(hook).is_ok()
    }

    /// Whether a fast path is connected.
    #[inline]
    pub fn offload_enabled(&self) -> bool {
        self.offload_hook.get().is_some()
    }

    /// Queues a confirmed session for offloading (once per session).
    pub fn request_offload(&self, view: &SessionView<A>) {
        if view.offload & offload::BUSY != 0 || !self.offload_enabled() {
            return;
        }
        if self
            .sessions
            .set_offload(view.index, view.seq, offload::REQUESTED, 0)
            .is_some_and(|b| b & offload::BUSY == 0)
            && self.offload_queue.push((view.index, view.seq)).is_err()
        {
            // Queue full: a later packet, of either direction, asks again
            // (a UDP flow's remote may answer only once).
            let _ = self.sessions.set_offload(view.index, view.seq, offload::CONFIRMED, offload::REQUESTED);
        }
    }

    /// The sessions queued for offloading that still live, oldest first.
    pub fn drain_offload_requests(&self, max: usize) -> Vec<SessionView<A>> {
        let mut v = Vec::new();
        while v.len() < max {
            let Some((index, seq)) = self.offload_queue.pop() else { break };
            if let Some(view) = self.sessions.view_if(index, seq) {
                v.push(view);
            }
        }
        v
    }

    /// Records the outcome of an installation attempt.
    pub fn offload_done(&self, view: &SessionView<A>, installed: bool) -> bool {
        let bits = if installed { offload::INSTALLED } else { offload::REFUSED };
        self.sessions.set_offload(view.index, view.seq, bits, offload::REQUESTED).is_some()
    }

    /// Takes the fast path's record of an installed session into the
    /// session itself: its last-seen stamp (the later of the two) and, for
    /// TCP, the pod's latest acknowledgment. Call it while the kernel's
    /// entries are still there, before the daemon deletes them without
    /// ending the session ([`NatTable::offload_withdrawn`]): else a flow
    /// that ran in the fast path for longer than its idle timeout would
    /// look expired to the next sweep.
    pub fn offload_fold(&self, view: &SessionView<A>) {
        let Some(hook) = self.offload_hook.get() else { return };
        if let (Some(seen), Some(now)) = (hook.last_seen(view), self.sessions.view_if(view.index, view.seq)) {
            if seen > now.last_seen {
                self.sessions.touch(view.index, view.seq, seen);
            }
        }
        if view.tuple.proto == proto::TCP {
            if let Some((ack, window)) = hook.pod_ack(view) {
                let _ = self.sessions.update_tcp_track(view.index, view.seq, |t| tcp_state::track_ack(t, ack, window));
            }
        }
    }

    /// Records that the fast path no longer holds a session (removed by the daemon).
    pub fn offload_withdrawn(&self, view: &SessionView<A>) {
        let _ = self.sessions.set_offload(view.index, view.seq, 0, offload::INSTALLED | offload::REQUESTED);
    }

    /// The last second a packet of the session was translated by either
    /// tier: its own stamp, or the fast path's when the session is installed
    /// there and that is more recent. What operators see (`egret sessions`);
    /// expiry reads the fast path only for sessions that look expired.
    pub fn last_seen(&self, view: &SessionView<A>) -> u32 {
        if view.offload & offload::INSTALLED == 0 {
            return view.last_seen;
        }
        let fast_path = self.offload_hook.get().and_then(|h| h.last_seen(view));
        fast_path.map_or(view.last_seen, |seen| seen.max(view.last_seen))
    }

    /// The session's TCP tracking word (`tcp_state::track`) with, for an
    /// installed session, the fast path's record of the pod's latest
    /// acknowledgment merged in (the later of the two: the workers see only
    /// an offloaded session's control segments). `None` when the slot no
    /// longer holds this incarnation.
    pub fn tcp_track(&self, view: &SessionView<A>) -> Option<u64> {
        let own = self.sessions.tcp_track(view.index, view.seq)?;
        if view.offload & offload::INSTALLED == 0 {
            return Some(own);
        }
        let fast_path = self.offload_hook.get().and_then(|h| h.pod_ack(view));
        Some(fast_path.map_or(own, |(ack, window)| tcp_state::track_ack(own, ack, window)))
    }

    /// For an installed session that looks expired, whether the fast
    /// path's more recent stamp keeps it alive (refreshing the session's
    /// own); else the stamp read, if any, for its end's record.
    fn offload_refresh(&self, view: &SessionView<A>, now: u32, nat: &NatSettings) -> Refresh {
        if view.offload & offload::INSTALLED == 0 {
            return Refresh::Expired(None);
        }
        let Some(seen) = self.offload_hook.get().and_then(|h| h.last_seen(view)) else {
            return Refresh::Expired(None);
        };
        if seen > view.last_seen && now.saturating_sub(seen) <= Self::timeout(view, nat) {
            self.sessions.touch(view.index, view.seq, seen);
            return Refresh::Alive;
        }
        Refresh::Expired(Some(seen))
    }

    /// The fast path's stamp of an installed session, read only when its
    /// end will be logged (one map lookup; none while logging is off).
    fn fast_path_seen_for_log(&self, view: &SessionView<A>, log: Option<LogTo<'_>>) -> Option<u32> {
        if log.is_none() || view.offload & offload::INSTALLED == 0 {
            return None;
        }
        self.offload_hook.get().and_then(|h| h.last_seen(view))
    }

    /// The idle timeout of a session, in seconds.
    #[inline]
    pub fn timeout(view: &SessionView<A>, nat: &NatSettings) -> u32 {
        match view.tuple.proto {
            proto::TCP => {
                if tcp_state::phase(view.tcp).is_transitory() {
                    nat.timeouts.tcp_transitory
                } else {
                    nat.timeouts.tcp_established
                }
            }
            proto::ICMP | proto::ICMPV6 => nat.timeouts.icmp,
            _ => nat.timeouts.udp,
        }
    }

    /// Whether the session's idle time has passed its timeout at `now` seconds.
    #[inline(always)]
    pub fn is_expired(view: &SessionView<A>, now: u32, nat: &NatSettings) -> bool {
        now.saturating_sub(view.last_seen) > Self::timeout(view, nat)
    }

    /// Whether the session still holds under `tables`.
    pub fn still_valid(view: &SessionView<A>, tables: &Tables) -> bool {
        Self::valid_policy(&view.tuple, tables).is_some()
    }

    /// The policy under which `t` holds in `tables`: its egress IP is held,
    /// its external port in that IP's range, and the policy (pod, remote)
    /// classifies to picks that egress IP for the pod.
    fn valid_policy<'t>(t: &SessionTuple<A>, tables: &'t Tables) -> Option<&'t Policy> {
        let entry = tables.egress(t.egress.ip())?;
        if !entry.ports.contains(t.egress_port) {
            return None;
        }
        match tables.classify(t.pod, t.remote) {
            Decision::Steer(id) => tables.policy(id).filter(|p| p.egress_for(t.pod) == Some(t.egress)),
            _ => None,
        }
    }

    /// Checks a session found by a lookup: expired or no longer valid
    /// sessions are removed (and `false` returned), their end logged to
    /// `log`.
    #[inline]
    pub fn check(
        &self,
        view: &SessionView<A>,
        tables: &Tables,
        now: u32,
        stats: &WorkerStats,
        log: Option<LogTo<'_>>,
    ) -> bool {
        if Self::is_expired(view, now, &tables.nat) {
            if let Refresh::Expired(fast_path_seen) = self.offload_refresh(view, now, &tables.nat) {
                let reason = if view.tuple.proto == proto::TCP
                    && matches!(tcp_state::phase(view.tcp), tcp_state::Phase::Closing | tcp_state::Phase::Closed)
                {
                    EndReason::TcpClosed
                } else {
                    EndReason::Expired
                };
                let reason = Self::unless_handed_over(view, tables, reason);
                if self.remove(view, End { reason, fast_path_seen, log }) {
                    stats.event(Event::SessionExpired);
                }
                return false;
            }
        }
        if view.generation != tables.generation_tag() {
            if !Self::still_valid(view, tables) {
                let fast_path_seen = self.fast_path_seen_for_log(view, log);
                let reason = Self::unless_handed_over(view, tables, EndReason::Invalidated);
                if self.remove(view, End { reason, fast_path_seen, log }) {
                    stats.event(Event::SessionInvalidated);
                }
                return false;
            }
            self.sessions.set_generation(view.index, view.seq, tables.generation_tag());
        }
        true
    }

    /// `reason`, or `handed-over` when the session's egress IP is no
    /// longer held here and was handed over with a current copy (ADR 0034
    /// §8: the next holder imported the session and logs its end; this
    /// removal goes to the local journal only). Asked only at a removal.
    #[inline]
    fn unless_handed_over(view: &SessionView<A>, tables: &Tables, reason: EndReason) -> EndReason {
        if tables.spec.handed_over.is_empty() {
            return reason;
        }
        Self::handed_over_reason(view, tables, reason)
    }

    #[cold]
    #[inline(never)]
    fn handed_over_reason(view: &SessionView<A>, tables: &Tables, reason: EndReason) -> EndReason {
        let ip = view.tuple.egress.ip();
        if !tables.owns_egress(ip) && tables.handed_over(ip) {
            EndReason::HandedOver
        } else {
            reason
        }
    }

    /// Removes a session and releases its mapping; with `end.log`, pushes
    /// its delete record (the removal time, and its last packet: its own
    /// stamp or the fast path's, the later). Returns whether this call
    /// removed it.
    #[inline]
    pub fn remove(&self, view: &SessionView<A>, end: End<'_>) -> bool {
        let hook = self.offload_hook.get();
        let removed = self.sessions.remove_with(view.index, view.seq, |dying| {
            // The kernel's entries go first: no packet may be translated with
            // a session that is gone.
            if let (Some(hook), true) = (hook, dying.offload & offload::INSTALLED != 0) {
                hook.remove(dying);
            }
        });
        let Some(v) = removed else { return false };
        let t = &v.tuple;
        if let Some(j) = self.sync.get() {
            j.push(JournalEntry::Removed(*t));
        }
        // A pod in block mode: its blocks are the log, not its sessions.
        let log = if v.flags & session_flags::UNLOGGED == 0 { end.log } else { None };
        if let Some(l) = log {
            let mut flags = 0;
            if v.flags & session_flags::INBOUND_CREATED != 0 {
                flags |= log_flags::INBOUND_CREATED;
            }
            if v.flags & session_flags::ADOPTED != 0 {
                flags |= log_flags::ADOPTED;
            }
            if v.offload & offload::INSTALLED != 0 {
                flags |= log_flags::OFFLOADED;
            }
            let mut r = LogRecord::session(LogKind::SessionDelete, t, l.now_ms, flags);
            r.value = v.last_seen.max(end.fast_path_seen.unwrap_or(0));
            r.detail = end.reason as u8;
            l.push(r);
        }
        if v.flags & session_flags::IN_BLOCK != 0 {
            self.leave_block(t, v.flags, end.log);
        }
        self.port_unused(t, v.flags);
        if v.flags & session_flags::HAS_MAPPING != 0 {
            self.mappings.release(t.egress, t.pod, t.pod_port, t.proto, t.egress_port);
        } else if let Some(pool) = self.mappings.existing_pool(t.egress, t.proto) {
            pool.count_in_use(-1);
            pool.release_source_towards(t.pod, t.remote, t.remote_port);
        }
        self.unadmit_source(t.pod);
        true
    }

    /// A session in a port block ended: one session fewer in its block,
    /// in the pool it was made in (`flags`' epoch: the egress IP's current
    /// pool, or one retired by a change of geometry). The last frees the
    /// block and logs the release, after the session's own delete when
    /// that is logged. Out of line: the removal of a session in no block
    /// pays only the flag's test.
    #[cold]
    #[inline(never)]
    fn leave_block(&self, t: &SessionTuple<A>, flags: u16, log: Option<LogTo<'_>>) {
        if let Some(b) = self.existing_block_pool(t.egress).filter(|b| b.holds_session(flags)) {
            b.leave(t.pod, t.egress_port, log);
            return;
        }
        let mut retired = self.retired_blocks.lock();
        if let Some(i) = retired.iter().position(|b| b.egress() == t.egress && b.holds_session(flags)) {
            retired[i].leave(t.pod, t.egress_port, log);
            if blocks_unused(&retired[i]) {
                retired.swap_remove(i);
            }
        }
    }

    fn admit_source(&self, pod: A, limit: u32) -> bool {
        self.per_source.count_up(pod, limit)
    }

    fn unadmit_source(&self, pod: A) {
        self.per_source.count_down(pod);
    }

    /// Sessions `pod` holds.
    pub fn source_sessions(&self, pod: A) -> u32 {
        self.per_source.count(pod)
    }

    /// Makes room when the table is full, taking from the offender first:
    /// among a sample of sessions, an expired one; else one of the sample's
    /// source holding the most sessions, if that is more than an even share
    /// of the table (capacity / sources with sessions); else the one idle
    /// longest, transitory TCP first (an approximation of VPP's per-thread
    /// LRU without its per-session list links). Returns whether a session
    /// was removed. A victim on an egress IP handed over in sync is logged
    /// `handed-over`, as a revalidation would (ADR 0034 §8).
    pub fn evict_one(&self, now: u32, tables: &Tables, stats: &WorkerStats, log: Option<LogTo<'_>>) -> bool {
        let nat = &tables.nat;
        // Without a lock: the table is full, so every new flow comes here
        // until one is evicted, and locking each shard for an exact count
        // would have every worker wait on every other.
        let sources = self.per_source.len_estimate().max(1);
        let fair_share = (self.sessions.capacity() / sources) as u64;
        let mut victim: Option<(EvictionScore, SessionView<A>)> = None;
        self.sessions.sweep(EVICTION_SAMPLE, |v| {
            let expired = Self::is_expired(v, now, nat);
            let held = u64::from(self.source_sessions(v.tuple.pod));
            let offender = held.saturating_sub(fair_share);
            let transitory = v.tuple.proto == proto::TCP && tcp_state::phase(v.tcp).is_transitory();
            let score = (expired, offender, transitory, now.saturating_sub(v.last_seen));
            if victim.as_ref().is_none_or(|(s, _)| score > *s) {
                victim = Some((score, *v));
            }
        });
        let end = |v: &SessionView<A>| End {
            reason: Self::unless_handed_over(v, tables, EndReason::Evicted),
            fast_path_seen: self.fast_path_seen_for_log(v, log),
            log,
        };
        match victim {
            Some((_, v)) if self.remove(&v, end(&v)) => {
                stats.event(Event::SessionEvicted);
                true
            }
            _ => false,
        }
    }

    /// Creates the session of an outbound packet that matched `policy`.
    pub fn create_outbound(
        &self,
        req: &OutboundRequest<A>,
        policy: &Policy,
        tables: &Tables,
        ctx: &mut CreateCtx<'_, A>,
    ) -> Result<SessionView<A>, DropReason> {
        let egress = policy.egress_for(req.pod).ok_or(DropReason::NoEgressIpForFamily)?;
        self.create_outbound_on(req, policy, egress, tables, ctx)
    }

    /// [`Self::create_outbound`] on `egress`, the pod's egress IP under
    /// `policy` already chosen (a worker's [`crate::tables::EgressMemo`]).
    pub fn create_outbound_on(
        &self,
        req: &OutboundRequest<A>,
        policy: &Policy,
        egress: A,
        tables: &Tables,
        ctx: &mut CreateCtx<'_, A>,
    ) -> Result<SessionView<A>, DropReason> {
        let nat = &tables.nat;
        let entry = tables.egress(egress.ip()).ok_or(DropReason::EgressIpNotOwned)?;
        let mut asked = None;
        let (pool, ahead): (&PortPool<A>, _) = match ctx.pools.take() {
            Some(memo) => {
                let (pool, ahead) = memo.get(tables.generation, egress, req.proto, || {
                    self.mappings.pool(egress, req.proto, entry.ports, tables.generation)
                });
                (pool, Some(ahead))
            }
            None => (asked.insert(self.mappings.pool(egress, req.proto, entry.ports, tables.generation)), None),
        };
        if entry.blocks.is_none() {
            let random =
                ahead.as_deref().map_or_else(|| ctx.rng.clone().port_in(entry.ports), |a| a.peek(entry.ports, ctx.rng));
            self.prefetch_creation(req, egress, pool, entry.ports, random);
        }
        if !self.admit_source(req.pod, nat.max_sessions_per_source) {
            return Err(DropReason::SourceSessionLimit);
        }
        if self.sessions.len() >= self.sessions.capacity() && !self.evict_one(ctx.now, tables, ctx.stats, ctx.log) {
            self.unadmit_source(req.pod);
            return Err(DropReason::SessionTableFull);
        }
        let mut init = SessionInit {
            deltas: 0,
            now: ctx.now,
            tcp: if req.proto == proto::TCP { tcp_state::initial(Direction::Outbound, req.tcp_flags) } else { 0 },
            generation: tables.generation_tag(),
            policy_slot: policy.counter_slot,
            flags: 0,
        };
        if tables.owns_egress(req.remote.ip()) {
            init.flags |= session_flags::HAIRPIN;
        }
        let mut tuple = req.tuple(egress);
        pool.set_source_quota(nat.ports_per_source(entry.ports));
        if let Some(cfg) = entry.blocks {
            let blocks = self.block_pool(egress, cfg, entry.ports, tables.generation);
            let result = self.create_in_block(&blocks, pool, &mut tuple, &mut init, nat, ctx)?;
            return self.created_outbound(result, &tuple, ctx);
        }
        let result = if self.mappings.endpoint_independent() {
            let acquired = self.mappings.try_acquire(
                pool,
                MappingRequest { egress, pod: req.pod, pod_port: req.pod_port, proto: req.proto },
                entry.ports,
                nat.port_alloc_attempts,
                ctx.rng,
                ahead,
            );
            let acquired = match acquired {
                Ok(a) => a,
                Err(e) => {
                    self.unadmit_source(req.pod);
                    return Err(match e {
                        AcquireError::SourceQuota => DropReason::SourcePortQuota,
                        AcquireError::Exhausted => DropReason::PortsExhausted,
                    });
                }
            };
            tuple.egress_port = acquired.port();
            init.flags |= session_flags::HAS_MAPPING;
            init.deltas = (ctx.deltas)(&tuple);
            let r = self.insert_marked(&tuple, &init, ctx.log);
            if r.is_err() {
                self.mappings.release(egress, req.pod, req.pod_port, req.proto, tuple.egress_port);
            } else {
                match acquired {
                    Acquired::Preserved(_) => ctx.stats.event(Event::PortPreserved),
                    Acquired::Random(_) => ctx.stats.event(Event::PortRandomized),
                    Acquired::Existing(_) => {}
                }
            }
            r
        } else {
            // Endpoint-dependent: a port is taken towards one remote
            // (address, port) only, so the quota counts the pod's sessions
            // towards it.
            if !pool.admit_source_towards(req.pod, req.remote, req.remote_port) {
                self.unadmit_source(req.pod);
                return Err(DropReason::SourcePortQuota);
            }
            let mut r = Err(InsertError::InboundTaken);
            for (i, port) in candidates(req.pod_port, entry.ports, nat.port_alloc_attempts, ctx.rng).enumerate() {
                tuple.egress_port = port;
                if self.sessions.inbound_taken(&tuple.inbound_key()) {
                    continue;
                }
                init.deltas = (ctx.deltas)(&tuple);
                r = self.insert_marked(&tuple, &init, ctx.log);
                match r {
                    Err(InsertError::InboundTaken) => continue,
                    Ok(_) => {
                        pool.count_in_use(1);
                        ctx.stats.event(if i == 0 && port == req.pod_port {
                            Event::PortPreserved
                        } else {
                            Event::PortRandomized
                        });
                        break;
                    }
                    Err(_) => break,
                }
            }
            if r == Err(InsertError::InboundTaken) {
                pool.count_exhausted();
            }
            if r.is_err() {
                pool.release_source_towards(req.pod, req.remote, req.remote_port);
            }
            r
        };
        self.created_outbound(result, &tuple, ctx)
    }

    /// Asks for the lines creating the session of `req` on `egress` will
    /// write, all at once before the first lock (nat/shard_map.rs, ADR
    /// 0036): the pod's session count, the session index's buckets of the
    /// outbound key and of the inbound keys of the first two candidate
    /// ports (the pod's own, and `random`, the first random one the
    /// allocation will try: the worker's port drawn ahead in the pool,
    /// whose owner cell was asked for when it was drawn, or the worker's
    /// generator's next draw, read from a copy), the
    /// pod's count in the pool (its mappings, or in endpoint-dependent
    /// mode its sessions towards the remote), in endpoint-independent
    /// mode the mapping and the candidates' owner cells, and in
    /// endpoint-dependent mode with the mapped-port filter connected the
    /// candidates' session counts.
    fn prefetch_creation(
        &self,
        req: &OutboundRequest<A>,
        egress: A,
        pool: &PortPool<A>,
        range: PortRange,
        random: u16,
    ) {
        self.per_source.prefetch(&req.pod);
        let mut tuple = req.tuple(egress);
        self.sessions.prefetch_key(&tuple.outbound_key());
        let preserved = range.contains(req.pod_port).then_some(req.pod_port);
        let eim = self.mappings.endpoint_independent();
        if eim {
            self.mappings.prefetch(MappingRequest { egress, pod: req.pod, pod_port: req.pod_port, proto: req.proto });
            pool.prefetch_source(req.pod, A::from_bits_zero(), 0);
        } else {
            pool.prefetch_source(req.pod, req.remote, req.remote_port);
        }
        let port_users = !eim && self.port_map_hook.get().is_some();
        for port in preserved.into_iter().chain(std::iter::once(random)) {
            tuple.egress_port = port;
            self.sessions.prefetch_key(&tuple.inbound_key());
            if eim {
                pool.prefetch_claim(port);
            }
            if port_users {
                self.port_users.prefetch(&(egress, req.proto, port));
            }
        }
    }

    /// The outcome of an outbound creation's insert: the session, the
    /// session another worker made first, or why none was made (the
    /// pod's session count given back).
    fn created_outbound(
        &self,
        result: Result<SessionView<A>, InsertError>,
        tuple: &SessionTuple<A>,
        ctx: &mut CreateCtx<'_, A>,
    ) -> Result<SessionView<A>, DropReason> {
        match result {
            Ok(v) => {
                ctx.stats.event(Event::SessionCreatedOutbound);
                Ok(v)
            }
            Err(e) => {
                self.unadmit_source(tuple.pod);
                match e {
                    InsertError::OutboundExists(_) => {
                        self.made_first(&tuple.outbound_key()).ok_or(DropReason::SessionRace)
                    }
                    InsertError::Full => Err(DropReason::SessionTableFull),
                    InsertError::InboundTaken => Err(DropReason::PortsExhausted),
                }
            }
        }
    }

    /// The session another worker made first for `key` (its outbound key,
    /// or the inbound key of an inbound session). Its key being in the
    /// index, it is live or about to be: its maker's next steps make it so
    /// (nat/session.rs, `INSERTING`), which a few tries wait for. A maker
    /// stopped right between (preempted), or a session already removed
    /// again, gives `None`.
    #[cold]
    fn made_first(&self, key: &FlowKey<A>) -> Option<SessionView<A>> {
        for _ in 0..64 {
            if let Some((_, v)) = self.sessions.lookup(key) {
                return Some(v);
            }
            std::hint::spin_loop();
        }
        None
    }

    /// Creates an outbound session on an egress IP in block mode
    /// (nat/port_blocks.rs): its port comes from the pod's blocks, or a
    /// new block; port preservation is off. Its session records are
    /// logged only when the block mode asks for them. A refusal gives
    /// back what it took (the pod's session count included) and says why.
    fn create_in_block(
        &self,
        blocks: &BlockPool<A>,
        pool: &super::port_alloc::PortPool<A>,
        tuple: &mut SessionTuple<A>,
        init: &mut SessionInit,
        nat: &NatSettings,
        ctx: &mut CreateCtx<'_, A>,
    ) -> Result<Result<SessionView<A>, InsertError>, DropReason> {
        let (pod, pod_port) = (tuple.pod, tuple.pod_port);
        init.flags |= session_flags::IN_BLOCK | blocks.epoch_flags();
        let mut session_log = ctx.log;
        if !blocks.config().log_sessions {
            init.flags |= session_flags::UNLOGGED;
            session_log = None;
        }
        let refused = |e: BlockRefusal| match e {
            BlockRefusal::PodLimit => DropReason::SourcePortQuota,
            BlockRefusal::Exhausted => DropReason::PortsExhausted,
        };
        if self.mappings.endpoint_independent() {
            let req = MappingRequest { egress: tuple.egress, pod, pod_port, proto: tuple.proto };
            let acquired = self.mappings.try_acquire_by(pool, req, || {
                blocks
                    .allocate(pod, nat.port_alloc_attempts, ctx.rng, ctx.log, |port| {
                        pool.try_claim(port, pod, pod_port).then_some(Acquired::Random(port))
                    })
                    .map_err(|e| match e {
                        BlockRefusal::PodLimit => AcquireError::SourceQuota,
                        BlockRefusal::Exhausted => {
                            pool.count_exhausted();
                            AcquireError::Exhausted
                        }
                    })
            });
            let acquired = match acquired {
                Ok(a) => a,
                Err(e) => {
                    self.unadmit_source(pod);
                    return Err(match e {
                        AcquireError::SourceQuota => DropReason::SourcePortQuota,
                        AcquireError::Exhausted => DropReason::PortsExhausted,
                    });
                }
            };
            tuple.egress_port = acquired.port();
            if matches!(acquired, Acquired::Existing(_)) && !blocks.join(pod, tuple.egress_port) {
                // A mapping from before the block mode: logged as it was made.
                init.flags &= !(session_flags::IN_BLOCK | session_flags::UNLOGGED | session_flags::BLOCK_EPOCH);
                session_log = ctx.log;
            }
            init.flags |= session_flags::HAS_MAPPING;
            init.deltas = (ctx.deltas)(tuple);
            let r = self.insert_marked(tuple, init, session_log);
            if r.is_err() {
                self.mappings.release(tuple.egress, pod, pod_port, tuple.proto, tuple.egress_port);
                if init.flags & session_flags::IN_BLOCK != 0 {
                    blocks.leave(pod, tuple.egress_port, ctx.log);
                }
            } else if !matches!(acquired, Acquired::Existing(_)) {
                ctx.stats.event(Event::PortRandomized);
            }
            return Ok(r);
        }
        // Endpoint-dependent: a port of the pod's blocks serves every
        // remote (address, port) it is not yet used towards.
        if !pool.admit_source_towards(pod, tuple.remote, tuple.remote_port) {
            self.unadmit_source(pod);
            return Err(DropReason::SourcePortQuota);
        }
        let made = blocks.allocate(pod, nat.port_alloc_attempts, ctx.rng, ctx.log, |port| {
            tuple.egress_port = port;
            if self.sessions.inbound_taken(&tuple.inbound_key()) {
                return None;
            }
            init.deltas = (ctx.deltas)(tuple);
            match self.insert_marked(tuple, init, session_log) {
                Err(InsertError::InboundTaken) => None,
                r => Some(r),
            }
        });
        match made {
            Ok(Ok(v)) => {
                pool.count_in_use(1);
                ctx.stats.event(Event::PortRandomized);
                Ok(Ok(v))
            }
            Ok(Err(e)) => {
                blocks.leave(pod, tuple.egress_port, ctx.log);
                pool.release_source_towards(pod, tuple.remote, tuple.remote_port);
                Ok(Err(e))
            }
            Err(e) => {
                if e == BlockRefusal::Exhausted {
                    pool.count_exhausted();
                }
                pool.release_source_towards(pod, tuple.remote, tuple.remote_port);
                self.unadmit_source(pod);
                Err(refused(e))
            }
        }
    }

    /// Creates a session for an inbound packet (`key`: remote -> egress) to a
    /// port a pod's mapping holds, when filtering allows it.
    pub fn create_inbound(
        &self,
        key: &FlowKey<A>,
        tables: &Tables,
        ctx: &mut CreateCtx<'_, A>,
    ) -> Result<SessionView<A>, DropReason> {
        let nat = &tables.nat;
        let owner = self.mappings.existing_pool(key.dst, key.proto).and_then(|p| p.owner(key.dport()).map(|o| (p, o)));
        let Some((pool, owner)) = owner else { return Err(DropReason::InboundNoMapping) };
        if nat.filtering != FilteringBehavior::EndpointIndependent {
            return Err(DropReason::InboundFiltered);
        }
        // The session must hold under the current policy, exactly as if the
        // pod had sent first; otherwise its replies would not be translated.
        let policy = match tables.classify(owner.pod, key.src) {
            Decision::Steer(id) => tables.policy(id),
            _ => None,
        };
        let Some(policy) = policy.filter(|p| p.egress_for(owner.pod) == Some(key.dst)) else {
            return Err(DropReason::InboundFiltered);
        };
        if !self.admit_source(owner.pod, nat.max_sessions_per_source) {
            return Err(DropReason::SourceSessionLimit);
        }
        if self.sessions.len() >= self.sessions.capacity() && !self.evict_one(ctx.now, tables, ctx.stats, ctx.log) {
            self.unadmit_source(owner.pod);
            return Err(DropReason::SessionTableFull);
        }
        if !self.mappings.add_ref(&pool, key.dport(), owner.pod, owner.pod_port) {
            self.unadmit_source(owner.pod);
            return Err(DropReason::InboundNoMapping);
        }
        let tuple = SessionTuple {
            pod: owner.pod,
            remote: key.src,
            egress: key.dst,
            pod_port: owner.pod_port,
            remote_port: key.sport(),
            egress_port: key.dport(),
            proto: key.proto,
        };
        let mut init = SessionInit {
            deltas: (ctx.deltas)(&tuple),
            now: ctx.now,
            tcp: if key.proto == proto::TCP { tcp_state::initial(Direction::Inbound, ctx.tcp_flags) } else { 0 },
            generation: tables.generation_tag(),
            policy_slot: policy.counter_slot,
            flags: session_flags::HAS_MAPPING
                | session_flags::INBOUND_CREATED
                | if tables.owns_egress(key.src.ip()) { session_flags::HAIRPIN } else { 0 },
        };
        // In block mode the mapping's port is in the pod's block: the
        // session counts there too.
        let blocks = tables.egress(key.dst.ip()).and_then(|e| e.blocks).and_then(|_| self.existing_block_pool(key.dst));
        let mut session_log = ctx.log;
        if let Some(b) = blocks.as_ref().filter(|b| b.join(tuple.pod, tuple.egress_port)) {
            init.flags |= session_flags::IN_BLOCK | b.epoch_flags();
            if !b.config().log_sessions {
                init.flags |= session_flags::UNLOGGED;
                session_log = None;
            }
        }
        match self.insert_marked(&tuple, &init, session_log) {
            Ok(v) => {
                ctx.stats.event(Event::SessionCreatedInbound);
                Ok(v)
            }
            Err(e) => {
                self.mappings.release(tuple.egress, tuple.pod, tuple.pod_port, tuple.proto, tuple.egress_port);
                if let Some(b) = blocks.filter(|_| init.flags & session_flags::IN_BLOCK != 0) {
                    b.leave(tuple.pod, tuple.egress_port, ctx.log);
                }
                self.unadmit_source(owner.pod);
                match e {
                    // The key was in the index: a wait that runs out is a
                    // race (its maker preempted, or the session dying), as
                    // for an outbound creation, not a filtered endpoint.
                    InsertError::InboundTaken | InsertError::OutboundExists(_) => {
                        self.made_first(key).ok_or(DropReason::SessionRace)
                    }
                    InsertError::Full => Err(DropReason::SessionTableFull),
                }
            }
        }
    }

    /// Visits `budget` slots: removes expired sessions and revalidates those
    /// checked against an older configuration, their ends logged to `log`.
    /// Bounded work per call.
    pub fn sweep(&self, budget: u32, now: u32, tables: &Tables, stats: &WorkerStats, log: Option<LogTo<'_>>) -> u32 {
        let visited = self.sessions.sweep(budget, |v| {
            let _ = self.check(v, tables, now, stats, log);
        });
        self.forget_unheld_pools(now);
        visited
    }

    /// Starts recording session changes for a standby gateway in a journal
    /// of `capacity` entries (nat/sync.rs). Once: a later call keeps the
    /// first journal and returns `false`. Sessions living before are not
    /// in it: a full [`export`](Self::export) sends them.
    pub fn enable_sync_journal(&self, capacity: usize) -> bool {
        self.sync.set(SyncJournal::new(capacity)).is_ok()
    }

    /// The sync journal, once enabled.
    pub fn sync_journal(&self) -> Option<&SyncJournal<A>> {
        self.sync.get()
    }

    /// Journals a live session whose state changed in a way its standby
    /// must know (the engine calls it when a TCP session changes phase:
    /// established, closing, closed), drained as an upsert.
    #[inline]
    pub fn sync_changed(&self, view: &SessionView<A>) {
        if let Some(j) = self.sync.get() {
            j.push(JournalEntry::Live { index: view.index, seq: view.seq });
        }
    }

    /// Changes the journal dropped because it was full (0 while disabled).
    /// When it grows, the standby missed something: send it a full export.
    pub fn sync_overflows(&self) -> u64 {
        self.sync.get().map_or(0, SyncJournal::overflows)
    }

    /// Takes up to `max` changes from the journal, oldest first, and
    /// appends what they mean at `now` (engine seconds) to `out`:
    /// - a creation (or TCP phase change) whose session still lives: an
    ///   upsert of the session as it is now (TCP state, idle time with the fast path's stamps folded
    ///   in); one that ended meanwhile: nothing (its removal follows);
    /// - a removal whose outbound key no live session holds: a removal; one
    ///   whose key a newer session holds already (a worker re-created it
    ///   before the removal was journaled): the old key's removal if its
    ///   external port differs, then an upsert of the live session, so a
    ///   late removal never deletes the newer session at the standby.
    ///
    /// Returns the number of journal entries taken.
    pub fn drain_sync(&self, max: usize, now: u32, out: &mut Vec<SyncEvent>) -> usize {
        let Some(j) = self.sync.get() else { return 0 };
        let mut taken = 0;
        while taken < max {
            let Some(e) = j.pop() else { break };
            taken += 1;
            match e {
                JournalEntry::Live { index, seq } => {
                    if let Some(r) = self.sessions.view_if(index, seq).and_then(|v| self.record(&v, now)) {
                        out.push(SyncEvent::Upsert(r));
                    }
                }
                JournalEntry::Removed(t) => {
                    let old = SessionKeyRecord::from_tuple(&t);
                    match self.sessions.lookup(&t.outbound_key()).and_then(|(_, v)| self.record(&v, now)) {
                        Some(r) => {
                            if r.key() != old {
                                out.push(SyncEvent::Remove(old));
                            }
                            out.push(SyncEvent::Upsert(r));
                        }
                        None => out.push(SyncEvent::Remove(old)),
                    }
                }
            }
        }
        taken
    }

    /// The record of a live session at `now`: its TCP tracking word and
    /// last-seen second with the fast path's merged in (the values expiry
    /// and the RST check use). `None` when the slot no longer holds it.
    fn record(&self, v: &SessionView<A>, now: u32) -> Option<SessionRecord> {
        let track = self.tcp_track(v)?;
        let idle = now.saturating_sub(self.last_seen(v));
        Some(SessionRecord::from_tuple(&v.tuple, v.tcp, track, v.flags & !session_flags::LOCAL, idle))
    }

    /// Appends the record of every live session on `egress` to `out` (a full
    /// resync for a standby; walks the whole slab, not for the hot path).
    pub fn export(&self, egress: A, now: u32, out: &mut Vec<SessionRecord>) {
        for v in self.sessions.iter() {
            if v.tuple.egress == egress {
                if let Some(r) = self.record(&v, now) {
                    out.push(r);
                }
            }
        }
    }

    /// Installs sessions received from the gateway that held their egress
    /// IP before, each with exactly its external port, as live sessions
    /// (call it after publishing tables that hold the IP, before announcing
    /// it). A record is installed when `tables` hold it as
    /// [`still_valid`](Self::still_valid) would (else `invalid`), it is not
    /// idle past its timeout, no session holds its outbound or inbound key
    /// (`already_present` for the very same session, else `conflicts`), the
    /// table has room (nothing is evicted for it) and the pod is under its
    /// session limit and port quota. It then claims its port in the pool
    /// (endpoint-independent: joins or makes the pod port's mapping, so
    /// a new remote reaching the port creates an inbound session as before;
    /// endpoint-dependent: the pool's in-use count and the per-destination
    /// quota), keeps its TCP state, flags (hairpin recomputed) and idle
    /// time (last seen = `now` - idle, saturating), and carries the
    /// generation before `tables`' so its first packet (or the sweep)
    /// revalidates it as after a reload. Imported sessions log nothing
    /// (the holder logged their creation; their end is logged here, flagged
    /// [`session_flags::ADOPTED`]) and are journaled
    /// like created ones.
    pub fn import<'r>(
        &self,
        records: impl IntoIterator<Item = &'r SessionRecord>,
        tables: &Tables,
        now: u32,
        deltas: DeltaFn<'_, A>,
    ) -> ImportReport {
        let mut report = ImportReport::default();
        for r in records {
            self.import_one(r, tables, now, deltas, &mut report);
        }
        report
    }

    fn import_one(&self, r: &SessionRecord, tables: &Tables, now: u32, deltas: DeltaFn<'_, A>, rep: &mut ImportReport) {
        let nat = &tables.nat;
        let Some(tuple) = r.tuple::<A>() else {
            rep.refuse(r, ImportRefusal::Invalid);
            return;
        };
        let (Some(policy), Some(entry)) = (Self::valid_policy(&tuple, tables), tables.egress(tuple.egress.ip())) else {
            rep.refuse(r, ImportRefusal::Invalid);
            return;
        };
        if let Some((_, v)) = self.sessions.lookup(&tuple.outbound_key()) {
            if v.tuple == tuple {
                rep.already_present += 1;
            } else {
                rep.refuse(r, ImportRefusal::Conflict);
            }
            return;
        }
        if self.sessions.inbound_taken(&tuple.inbound_key()) {
            rep.refuse(r, ImportRefusal::Conflict);
            return;
        }
        let endpoint_independent = self.mappings.endpoint_independent();
        let mut flags = (r.flags & session_flags::INBOUND_CREATED) | session_flags::ADOPTED;
        if endpoint_independent {
            flags |= session_flags::HAS_MAPPING;
        }
        if tables.owns_egress(tuple.remote.ip()) {
            flags |= session_flags::HAIRPIN;
        }
        let init = SessionInit {
            deltas: deltas(&tuple),
            now: now.saturating_sub(r.idle_secs),
            tcp: if tuple.proto == proto::TCP { r.tcp } else { 0 },
            // Not the current generation: revalidated at its first packet.
            generation: tables.generation_tag().wrapping_sub(1),
            policy_slot: policy.counter_slot,
            flags,
        };
        let probe = SessionView::made(0, 0, tuple, &init);
        if Self::is_expired(&probe, now, nat) {
            rep.refuse(r, ImportRefusal::Expired);
            return;
        }
        if !self.admit_source(tuple.pod, nat.max_sessions_per_source) {
            rep.refuse(r, ImportRefusal::OverSourceLimit);
            return;
        }
        if self.sessions.len() >= self.sessions.capacity() {
            self.unadmit_source(tuple.pod);
            rep.refuse(r, ImportRefusal::TableFull);
            return;
        }
        let pool = self.mappings.pool(tuple.egress, tuple.proto, entry.ports, tables.generation);
        pool.set_source_quota(nat.ports_per_source(entry.ports));
        let claimed = if endpoint_independent {
            let req =
                MappingRequest { egress: tuple.egress, pod: tuple.pod, pod_port: tuple.pod_port, proto: tuple.proto };
            self.mappings.claim_exact(&pool, req, tuple.egress_port)
        } else if pool.admit_source_towards(tuple.pod, tuple.remote, tuple.remote_port) {
            Ok(Acquired::Random(tuple.egress_port))
        } else {
            Err(ClaimError::SourceQuota)
        };
        if let Err(e) = claimed {
            self.unadmit_source(tuple.pod);
            match e {
                ClaimError::SourceQuota => rep.refuse(r, ImportRefusal::OverSourceLimit),
                ClaimError::Taken => rep.refuse(r, ImportRefusal::Conflict),
            }
            return;
        }
        // In block mode the port's block becomes (or is) the pod's.
        let mut init = init;
        let blocks = entry.blocks.map(|cfg| self.block_pool(tuple.egress, cfg, entry.ports, tables.generation));
        if let Some(b) = &blocks {
            if let Err(e) = b.claim_exact(tuple.pod, tuple.egress_port) {
                if endpoint_independent {
                    self.mappings.release(tuple.egress, tuple.pod, tuple.pod_port, tuple.proto, tuple.egress_port);
                } else {
                    pool.release_source_towards(tuple.pod, tuple.remote, tuple.remote_port);
                }
                self.unadmit_source(tuple.pod);
                match e {
                    BlockClaimError::PodLimit => rep.refuse(r, ImportRefusal::OverSourceLimit),
                    BlockClaimError::Taken | BlockClaimError::Outside => rep.refuse(r, ImportRefusal::Conflict),
                }
                return;
            }
            init.flags |= session_flags::IN_BLOCK | b.epoch_flags();
            if !b.config().log_sessions {
                init.flags |= session_flags::UNLOGGED;
            }
        }
        // No log: the holder logged its creation; this gateway logs its end.
        match self.insert_marked(&tuple, &init, None) {
            Ok(v) => {
                if !endpoint_independent {
                    pool.count_in_use(1);
                }
                if tuple.proto == proto::TCP {
                    let _ = self.sessions.update_tcp_track(v.index, v.seq, |_| r.tcp_track);
                }
                rep.installed += 1;
            }
            Err(e) => {
                if endpoint_independent {
                    self.mappings.release(tuple.egress, tuple.pod, tuple.pod_port, tuple.proto, tuple.egress_port);
                } else {
                    pool.release_source_towards(tuple.pod, tuple.remote, tuple.remote_port);
                }
                if let Some(b) = &blocks {
                    b.leave(tuple.pod, tuple.egress_port, None);
                }
                self.unadmit_source(tuple.pod);
                match e {
                    InsertError::Full => rep.refuse(r, ImportRefusal::TableFull),
                    InsertError::InboundTaken | InsertError::OutboundExists(_) => {
                        rep.refuse(r, ImportRefusal::Conflict)
                    }
                }
            }
        }
    }
}

/// What session creation needs from the worker.
#[derive(Debug)]
pub struct CreateCtx<'a, A: NatAddr> {
    /// Now, in engine seconds.
    pub now: u32,
    /// The worker's port RNG.
    pub rng: &'a mut PortRng,
    /// The worker's counters.
    pub stats: &'a WorkerStats,
    /// The delta function.
    pub deltas: DeltaFnBox<'a, A>,
    /// TCP flags of the packet creating an inbound session.
    pub tcp_flags: u8,
    /// The worker's translation log ring (`None`: logging is off).
    pub log: Option<LogTo<'a>>,
    /// The worker's memo of port pools (`None`: the shared map is asked).
    pub pools: Option<&'a mut PoolMemo<A>>,
}

impl<'a, A: NatAddr> CreateCtx<'a, A> {
    /// A context at `now` with no TCP flags, no translation log and no
    /// pool memo (the shared map is asked); set those fields as needed.
    pub fn new(now: u32, rng: &'a mut PortRng, stats: &'a WorkerStats, deltas: DeltaFnBox<'a, A>) -> Self {
        CreateCtx { now, rng, stats, deltas, tcp_flags: 0, log: None, pools: None }
    }
}

/// The delta function of a [`CreateCtx`] (a wrapper so the context is `Debug`).
pub struct DeltaFnBox<'a, A>(pub DeltaFn<'a, A>);

impl<A> std::fmt::Debug for DeltaFnBox<'_, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeltaFn")
    }
}

impl<'a, A> std::ops::Deref for DeltaFnBox<'a, A> {
    type Target = dyn Fn(&SessionTuple<A>) -> u32 + 'a;
    fn deref(&self) -> &Self::Target {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::num::NonZeroU64;

    use super::*;
    use crate::policy::PolicyId;
    use crate::tables::{EgressIpSpec, PolicySlots, PolicySpec, TablesSpec};

    const POD: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
    const REMOTE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);
    const E: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

    fn tables(gen: u64, f: impl FnOnce(&mut TablesSpec)) -> Tables {
        let mut spec = TablesSpec {
            policies: vec![PolicySpec {
                name: "p".into(),
                sources: vec!["192.0.2.0/24".parse().unwrap()],
                destinations: vec!["0.0.0.0/0".parse().unwrap()],
                except: vec![],
                egress_ips: vec![E.into()],
            }],
            egress_ips: vec![EgressIpSpec { ip: E.into(), ports: None, answer_neighbor: true, port_blocks: None }],
            ..Default::default()
        };
        f(&mut spec);
        Tables::compile(&spec, gen, &PolicySlots::default()).unwrap()
    }

    fn req(pod_port: u16, remote_port: u16, proto: u8) -> OutboundRequest<Ipv4Addr> {
        OutboundRequest { pod: POD, pod_port, remote: REMOTE, remote_port, proto, tcp_flags: tcp_state::flags::SYN }
    }

    struct Env {
        rng: PortRng,
        stats: WorkerStats,
    }

    impl Env {
        fn new() -> Self {
            Env { rng: PortRng::new(42), stats: WorkerStats::default() }
        }
        fn ctx(&mut self, now: u32) -> CreateCtx<'_, Ipv4Addr> {
            CreateCtx::new(now, &mut self.rng, &self.stats, DeltaFnBox(&|_| 0))
        }
    }

    fn policy(t: &Tables) -> &Policy {
        t.policy(PolicyId(0)).unwrap()
    }

    #[test]
    fn endpoint_independent_mapping_reuses_port_across_destinations() {
        let t = tables(1, |_| {});
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        let a = nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        let mut r2 = req(40000, 53, proto::UDP);
        r2.remote = Ipv4Addr::new(203, 0, 113, 77);
        let b = nat.create_outbound(&r2, policy(&t), &t, &mut env.ctx(0)).unwrap();
        assert_eq!(a.tuple.egress_port, 40000, "pod port preserved");
        assert_eq!((b.tuple.egress, b.tuple.egress_port), (E, 40000), "same mapping for another destination");
        assert_eq!(nat.mappings.len(), 1);
        assert!(nat.remove(&a, End::unlogged(EndReason::Expired)));
        assert!(nat.remove(&b, End::unlogged(EndReason::Expired)));
        assert_eq!(nat.mappings.len(), 0);
        assert_eq!(nat.mappings.existing_pool(E, proto::UDP).unwrap().in_use(), 0);
        assert_eq!(nat.source_sessions(POD), 0);
    }

    #[test]
    fn endpoint_dependent_mode_reuses_one_port_towards_different_destinations() {
        let t = tables(1, |s| s.nat.mapping = MappingBehavior::EndpointDependent);
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        let range = crate::nat::port_alloc::PortRange { first: 50000, last: 50000 };
        let t = tables(1, |s| {
            s.nat.mapping = MappingBehavior::EndpointDependent;
            s.egress_ips[0].ports = Some(range);
            // This test is about exhaustion: no quota in the way.
            s.nat.max_ports_per_source = Some(65_536);
        });
        let a = nat.create_outbound(&req(1, 80, proto::TCP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        let b = nat.create_outbound(&req(2, 443, proto::TCP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        assert_eq!((a.tuple.egress_port, b.tuple.egress_port), (50000, 50000));
        // Same destination again: the one port is taken for it.
        assert_eq!(
            nat.create_outbound(&req(3, 80, proto::TCP), policy(&t), &t, &mut env.ctx(0)),
            Err(DropReason::PortsExhausted)
        );
        assert_eq!(nat.mappings.existing_pool(E, proto::TCP).unwrap().exhausted(), 1);
    }

    #[test]
    fn expiry_follows_protocol_and_tcp_phase() {
        let t = tables(1, |_| {});
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        let u = nat.create_outbound(&req(1000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(100)).unwrap();
        assert!(!NatTable::is_expired(&u, 400, &t.nat));
        assert!(NatTable::is_expired(&u, 401, &t.nat), "UDP 300 s");
        let c = nat.create_outbound(&req(1001, 80, proto::TCP), policy(&t), &t, &mut env.ctx(100)).unwrap();
        assert!(NatTable::is_expired(&c, 341, &t.nat), "SYN only: transitory 240 s");
        nat.sessions.update_tcp(c.index, c.seq, |s| tcp_state::update(s, Direction::Inbound, tcp_state::flags::SYN));
        let c = nat.sessions.view(c.index).unwrap();
        assert!(!NatTable::is_expired(&c, 341, &t.nat));
        assert!(NatTable::is_expired(&c, 100 + 7441, &t.nat), "established 2 h 4 min");
        // check() removes an expired session and counts it.
        assert!(!nat.check(&u, &t, 1000, &env.stats, None));
        assert_eq!(env.stats.snapshot().event(Event::SessionExpired), 1);
        assert!(nat.sessions.lookup(&u.tuple.outbound_key()).is_none());
    }

    #[test]
    fn reload_keeps_valid_sessions_and_drops_the_others() {
        let t1 = tables(1, |_| {});
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        let s = nat.create_outbound(&req(1000, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        // An unrelated change: still valid, generation updated.
        let t2 = tables(2, |sp| sp.neighbor_addresses.push("198.51.100.99".parse().unwrap()));
        assert!(nat.check(&s, &t2, 1, &env.stats, None));
        assert_eq!(nat.sessions.view(s.index).unwrap().generation, 2);
        // The destination is now excepted: removed.
        let t3 = tables(3, |sp| sp.policies[0].except.push("203.0.113.0/24".parse().unwrap()));
        let s = nat.sessions.view(s.index).unwrap();
        assert!(!nat.check(&s, &t3, 1, &env.stats, None));
        assert_eq!(env.stats.snapshot().event(Event::SessionInvalidated), 1);
        // Losing the egress IP invalidates as well.
        let s = nat.create_outbound(&req(1001, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        let t4 = tables(4, |sp| sp.egress_ips.clear());
        assert!(!nat.check(&s, &t4, 1, &env.stats, None));
        assert_eq!(
            nat.create_outbound(&req(1002, 53, proto::UDP), policy(&t4), &t4, &mut env.ctx(1)),
            Err(DropReason::EgressIpNotOwned)
        );
    }

    #[test]
    fn per_source_limit_and_capacity_eviction() {
        let t = tables(1, |s| {
            s.nat.max_sessions_per_source = 2;
            s.nat.max_sessions = 3;
        });
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        nat.create_outbound(&req(1, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        nat.create_outbound(&req(2, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        assert_eq!(
            nat.create_outbound(&req(3, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)),
            Err(DropReason::SourceSessionLimit)
        );
        let mut other = req(3, 53, proto::UDP);
        other.pod = Ipv4Addr::new(192, 0, 2, 11);
        nat.create_outbound(&other, policy(&t), &t, &mut env.ctx(5)).unwrap();
        // Full: the next session evicts the longest idle one (created at 0).
        other.pod_port = 4;
        nat.create_outbound(&other, policy(&t), &t, &mut env.ctx(10)).unwrap();
        assert_eq!(nat.sessions.len(), 3);
        assert_eq!(env.stats.snapshot().event(Event::SessionEvicted), 1);
        assert_eq!(nat.source_sessions(POD), 1);
    }

    #[test]
    fn a_source_over_its_port_quota_is_dropped_while_another_pod_gets_a_port() {
        for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
            // 40 ports: the default quota is a quarter, 10.
            let t = tables(1, |s| {
                s.nat.mapping = mapping;
                s.egress_ips[0].ports = Some(crate::nat::port_alloc::PortRange { first: 50000, last: 50039 });
            });
            let nat = NatTable::new(&t.nat);
            let mut env = Env::new();
            for p in 0..10 {
                nat.create_outbound(&req(1000 + p, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
            }
            assert_eq!(
                nat.create_outbound(&req(2000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)),
                Err(DropReason::SourcePortQuota),
                "{mapping:?}"
            );
            let mut other = req(2000, 53, proto::UDP);
            other.pod = Ipv4Addr::new(192, 0, 2, 11);
            let v = nat.create_outbound(&other, policy(&t), &t, &mut env.ctx(0)).unwrap();
            assert!((50000..=50039).contains(&v.tuple.egress_port));
            assert_eq!(nat.source_sessions(POD), 10, "the refused packet holds no session");
            // A session of the pod ends: its port goes back to its quota.
            let (_, first) = nat.sessions.lookup(&FlowKey::new(POD, REMOTE, 1000, 53, proto::UDP)).unwrap();
            assert!(nat.remove(&first, End::unlogged(EndReason::Expired)));
            nat.create_outbound(&req(2000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        }
        // The key overrides the quarter.
        let t = tables(1, |s| s.nat.max_ports_per_source = Some(2));
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        nat.create_outbound(&req(1, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        nat.create_outbound(&req(2, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        assert_eq!(
            nat.create_outbound(&req(3, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)),
            Err(DropReason::SourcePortQuota)
        );
        // Another session of an existing mapping costs no port.
        let mut again = req(2, 53, proto::UDP);
        again.remote = Ipv4Addr::new(203, 0, 113, 6);
        nat.create_outbound(&again, policy(&t), &t, &mut env.ctx(0)).unwrap();
    }

    #[test]
    fn eviction_under_pressure_takes_the_offenders_sessions() {
        let t = tables(1, |s| s.nat.max_sessions = 10);
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        // Two quiet pods' sessions, idle longest (created at 0).
        let quiet = [Ipv4Addr::new(192, 0, 2, 20), Ipv4Addr::new(192, 0, 2, 21)];
        for pod in quiet {
            let mut r = req(1000, 53, proto::UDP);
            r.pod = pod;
            nat.create_outbound(&r, policy(&t), &t, &mut env.ctx(0)).unwrap();
        }
        // The offender fills the rest, more recently.
        for p in 0..8 {
            nat.create_outbound(&req(2000 + p, 53, proto::UDP), policy(&t), &t, &mut env.ctx(50)).unwrap();
        }
        // Under pressure, the offender's next sessions (and a third pod's) evict the offender's.
        for p in 8..12 {
            nat.create_outbound(&req(2000 + p, 53, proto::UDP), policy(&t), &t, &mut env.ctx(60)).unwrap();
        }
        let mut third = req(3000, 53, proto::UDP);
        third.pod = Ipv4Addr::new(192, 0, 2, 22);
        nat.create_outbound(&third, policy(&t), &t, &mut env.ctx(60)).unwrap();
        assert_eq!(env.stats.snapshot().event(Event::SessionEvicted), 5);
        for pod in quiet {
            assert_eq!(nat.source_sessions(pod), 1, "{pod}'s established session was kept");
        }
        assert_eq!(nat.source_sessions(POD), 7);
    }

    /// A port map that records its calls, and the bits they leave, as
    /// the program's bitmap would hold them (`forget` drops an IP's bits).
    /// It hands out places as `egret_bpf::MappedPorts` does: a place
    /// stays good until its IP is forgotten, so the pools' marks go
    /// through `set_at` and a regained IP's through `set` first.
    #[derive(Default)]
    struct FakePortMap {
        calls: parking_lot::Mutex<Vec<(Ipv4Addr, u8, u16, bool)>>,
        /// Each place given: (egress, proto, the egress's forgets then).
        places: parking_lot::Mutex<Vec<(Ipv4Addr, u8, usize)>>,
    }

    impl FakePortMap {
        /// Whether (egress, proto, port)'s bit is set after the calls so far.
        fn marked(&self, egress: Ipv4Addr, proto: u8, port: u16) -> bool {
            let calls = self.calls.lock();
            let since = calls.iter().rposition(|c| c.0 == egress && c.2 == 0 && c.1 == 0).map_or(0, |i| i + 1);
            calls[since..].iter().rev().find(|c| (c.0, c.1, c.2) == (egress, proto, port)).is_some_and(|c| c.3)
        }

        /// The calls for (egress, proto), forgets left out.
        fn calls(&self, egress: Ipv4Addr, proto: u8) -> Vec<(u16, bool)> {
            self.calls.lock().iter().filter(|c| c.0 == egress && c.1 == proto).map(|c| (c.2, c.3)).collect()
        }

        fn forgets(&self, egress: Ipv4Addr) -> usize {
            self.calls.lock().iter().filter(|c| c.0 == egress && (c.1, c.2) == (0, 0)).count()
        }
    }

    impl PortMapHook<Ipv4Addr> for FakePortMap {
        fn track(&self, _: Ipv4Addr, _: u8) {}
        fn set(&self, egress: Ipv4Addr, proto: u8, port: u16, mapped: bool) {
            self.calls.lock().push((egress, proto, port, mapped));
        }
        /// Recorded as (egress, 0, 0, false): every bit of `egress` gone.
        fn forget(&self, egress: Ipv4Addr) {
            self.calls.lock().push((egress, 0, 0, false));
        }
        fn locate(&self, egress: Ipv4Addr, proto: u8) -> Option<PortBitsAt> {
            let forgets = self.forgets(egress);
            let mut places = self.places.lock();
            places.push((egress, proto, forgets));
            NonZeroU64::new(places.len() as u64).map(PortBitsAt)
        }
        fn set_at(&self, at: PortBitsAt, port: u16, mapped: bool) -> bool {
            let place = self.places.lock().get(at.0.get() as usize - 1).copied();
            match place {
                Some((egress, proto, forgets)) if forgets == self.forgets(egress) => {
                    self.set(egress, proto, port, mapped);
                    true
                }
                _ => false,
            }
        }
    }

    /// A NAT in `mapping` mode with a [`FakePortMap`] connected.
    fn filtered_nat(mapping: MappingBehavior) -> (Tables, NatTable<Ipv4Addr>, Arc<FakePortMap>, Env) {
        let t = tables(1, |s| s.nat.mapping = mapping);
        let nat = NatTable::new(&t.nat);
        let map = Arc::new(FakePortMap::default());
        assert!(nat.set_port_map_hook(map.clone()));
        (t, nat, map, Env::new())
    }

    /// Two sessions on one external port in either mode: on one
    /// endpoint-independent mapping (its owner cell marks the port), or
    /// towards two remotes in endpoint-dependent mode (the NAT's count
    /// per port does). The bit is set once, by the first, and cleared
    /// once, after the last.
    #[test]
    fn a_port_is_marked_mapped_from_its_first_session_until_its_last_is_gone() {
        for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
            let (t, nat, map, mut env) = filtered_nat(mapping);
            let a = nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
            assert_eq!(a.tuple.egress_port, 40000, "{mapping:?}: the pod's port preserved");
            assert_eq!(map.calls(E, proto::UDP), vec![(40000, true)], "{mapping:?}: marked when the session is made");
            let mut r2 = req(40000, 53, proto::UDP);
            r2.remote = Ipv4Addr::new(203, 0, 113, 77);
            let b = nat.create_outbound(&r2, policy(&t), &t, &mut env.ctx(0)).unwrap();
            assert_eq!(b.tuple.egress_port, 40000, "{mapping:?}: the second session on the same port");
            let users = match mapping {
                MappingBehavior::EndpointIndependent => {
                    assert_eq!(nat.port_users(E, proto::UDP, 40000), 0, "the owner cell counts, not the map");
                    nat.mappings.existing_pool(E, proto::UDP).and_then(|p| p.owner(40000)).map_or(0, |o| o.refs)
                }
                MappingBehavior::EndpointDependent => nat.port_users(E, proto::UDP, 40000),
            };
            assert_eq!(users, 2, "{mapping:?}");
            assert!(nat.remove(&a, End::unlogged(EndReason::Expired)));
            assert_eq!(map.calls(E, proto::UDP).len(), 1, "{mapping:?}: still mapped while a session uses it");
            assert!(nat.remove(&b, End::unlogged(EndReason::Expired)));
            assert_eq!(
                map.calls(E, proto::UDP),
                vec![(40000, true), (40000, false)],
                "{mapping:?}: unmarked after the last"
            );
            assert_eq!(nat.port_users(E, proto::UDP, 40000), 0);
            // ICMP identifiers are not filtered in XDP: not marked.
            nat.create_outbound(&req(7, 0, proto::ICMP), policy(&t), &t, &mut env.ctx(0)).unwrap();
            assert_eq!(map.calls(E, proto::ICMP), vec![], "{mapping:?}");
        }
    }

    /// A port a session holds is marked when the filter is connected after
    /// it was claimed (endpoint-independent), and again, in either mode,
    /// when the filter forgot the egress IP and the IP is held again before
    /// the session ended; a second session on the port then does not clear
    /// the bit when the first ends.
    #[test]
    fn held_ports_are_marked_when_the_filter_connects_and_when_an_ip_comes_back() {
        let t = tables(1, |_| {});
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        let a = nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        let map = Arc::new(FakePortMap::default());
        assert!(nat.set_port_map_hook(map.clone()));
        assert!(map.marked(E, proto::UDP, 40000), "marked when connected");
        // Held again with nothing forgotten in between: no walk, no call.
        let n = map.calls.lock().len();
        nat.track_egress(E);
        assert_eq!(map.calls.lock().len(), n);
        assert!(nat.remove(&a, End::unlogged(EndReason::Expired)));
        assert!(!map.marked(E, proto::UDP, 40000), "unmarked after the last session");

        for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
            let (t, nat, map, mut env) = filtered_nat(mapping);
            let a = nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
            nat.forget_egress(E);
            assert!(!map.marked(E, proto::UDP, 40000), "{mapping:?}: the filter forgot the IP");
            nat.track_egress(E);
            assert!(map.marked(E, proto::UDP, 40000), "{mapping:?}: marked again when the IP is held again");
            let mut r2 = req(40000, 53, proto::UDP);
            r2.remote = Ipv4Addr::new(203, 0, 113, 77);
            let b = nat.create_outbound(&r2, policy(&t), &t, &mut env.ctx(0)).unwrap();
            assert_eq!(b.tuple.egress_port, 40000, "{mapping:?}");
            assert!(nat.remove(&a, End::unlogged(EndReason::Expired)));
            assert!(map.marked(E, proto::UDP, 40000), "{mapping:?}: still marked while the second session lives");
            assert!(nat.remove(&b, End::unlogged(EndReason::Expired)));
            assert!(!map.marked(E, proto::UDP, 40000), "{mapping:?}: unmarked after the last");
            if mapping == MappingBehavior::EndpointIndependent {
                // The pool's place, located at its first mark, went stale
                // with the forget and was located again by the regain's.
                assert_eq!(map.places.lock().len(), 2, "the pool located its bits twice");
            }
        }
    }

    #[test]
    fn inbound_creation_needs_endpoint_independent_filtering() {
        let t = tables(1, |_| {});
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        let s = nat.create_outbound(&req(40000, 3478, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        let stranger = FlowKey::new(Ipv4Addr::new(203, 0, 113, 99), E, 9999, s.tuple.egress_port, proto::UDP);
        assert_eq!(nat.create_inbound(&stranger, &t, &mut env.ctx(1)), Err(DropReason::InboundFiltered));
        let unmapped = FlowKey::new(Ipv4Addr::new(203, 0, 113, 99), E, 9999, 41000, proto::UDP);
        assert_eq!(nat.create_inbound(&unmapped, &t, &mut env.ctx(1)), Err(DropReason::InboundNoMapping));
        let t_eif = tables(2, |sp| sp.nat.filtering = FilteringBehavior::EndpointIndependent);
        let v = nat.create_inbound(&stranger, &t_eif, &mut env.ctx(1)).unwrap();
        assert_eq!((v.tuple.pod, v.tuple.pod_port, v.tuple.remote_port), (POD, 40000, 9999));
        assert_eq!(nat.mappings.existing_pool(E, proto::UDP).unwrap().owner(40000).unwrap().refs, 2);
        assert!(nat.sessions.lookup(&stranger).is_some());
        assert!(nat.remove(&s, End::unlogged(EndReason::Expired)));
        assert!(nat.remove(&v, End::unlogged(EndReason::Expired)));
        assert_eq!(nat.mappings.existing_pool(E, proto::UDP).unwrap().in_use(), 0);
    }

    /// A table under endpoint-independent filtering, and its environment.
    fn eif_table() -> (Tables, NatTable<Ipv4Addr>, Env) {
        let t = tables(1, |s| s.nat.filtering = FilteringBehavior::EndpointIndependent);
        let nat = NatTable::new(&t.nat);
        (t, nat, Env::new())
    }

    /// The pod's session to REMOTE from port 40000, then a stranger's
    /// inbound session on its mapping: (the outbound, the stranger's key,
    /// the inbound).
    fn outbound_then_inbound(
        t: &Tables,
        nat: &NatTable<Ipv4Addr>,
        env: &mut Env,
    ) -> (SessionView<Ipv4Addr>, FlowKey<Ipv4Addr>, SessionView<Ipv4Addr>) {
        let s = nat.create_outbound(&req(40000, 3478, proto::UDP), policy(t), t, &mut env.ctx(0)).unwrap();
        let stranger = FlowKey::new(Ipv4Addr::new(203, 0, 113, 99), E, 9999, s.tuple.egress_port, proto::UDP);
        let first = nat.create_inbound(&stranger, t, &mut env.ctx(1)).unwrap();
        (s, stranger, first)
    }

    /// A worker whose flow another worker made between its lookup and its
    /// insert (the flow cache missed on both) is answered that worker's
    /// session, and gives back all it took for its own: the pod's session
    /// count, the mapping's reference, the port, the pool's per-pod count.
    #[test]
    fn a_creation_another_worker_made_first_answers_its_session_and_gives_back_what_it_took() {
        for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
            let t = tables(1, |s| s.nat.mapping = mapping);
            let nat = NatTable::new(&t.nat);
            let mut env = Env::new();
            let first = nat.create_outbound(&req(40000, 3478, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
            let again = nat.create_outbound(&req(40000, 3478, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
            assert_eq!((again.index, again.seq), (first.index, first.seq), "{mapping:?}: the first session");
            assert_eq!(nat.sessions.len(), 1, "{mapping:?}");
            assert_eq!(nat.source_sessions(POD), 1, "{mapping:?}: the loser's count given back");
            let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
            assert_eq!(pool.in_use(), 1, "{mapping:?}: the loser's port given back");
            match mapping {
                MappingBehavior::EndpointIndependent => {
                    assert_eq!(nat.mappings.len(), 1);
                    assert_eq!(
                        pool.owner(first.tuple.egress_port).unwrap().refs,
                        1,
                        "the loser's reference given back"
                    );
                    assert_eq!(pool.source_ports(POD), 1);
                }
                MappingBehavior::EndpointDependent => {
                    let mut counts = Vec::new();
                    pool.for_each_source(|pod, remote, port, n| counts.push((pod, remote, port, n)));
                    assert_eq!(counts, vec![(POD, REMOTE, 3478, 1)], "the loser's count towards it given back");
                }
            }
            assert_eq!(env.stats.snapshot().event(Event::SessionCreatedOutbound), 1, "{mapping:?}: one made");
            assert!(nat.remove(&first, End::unlogged(EndReason::Expired)));
            assert_eq!((nat.source_sessions(POD), pool.in_use()), (0, 0), "{mapping:?}");
        }
        // An inbound creation (endpoint-independent filtering) the same way.
        let (t, nat, mut env) = eif_table();
        let (s, stranger, first) = outbound_then_inbound(&t, &nat, &mut env);
        let again = nat.create_inbound(&stranger, &t, &mut env.ctx(1)).unwrap();
        assert_eq!((again.index, again.seq), (first.index, first.seq), "inbound: the first session");
        assert_eq!((nat.sessions.len(), nat.source_sessions(POD)), (2, 2), "inbound: the loser's count given back");
        assert_eq!(env.stats.snapshot().event(Event::SessionCreatedInbound), 1, "inbound: one made");
        let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
        assert_eq!(pool.owner(40000).unwrap().refs, 2, "inbound: the loser's reference given back");
        assert!(nat.remove(&s, End::unlogged(EndReason::Expired)));
        assert!(nat.remove(&first, End::unlogged(EndReason::Expired)));
        assert_eq!((nat.source_sessions(POD), pool.in_use(), nat.mappings.len()), (0, 0, 0));
    }

    /// A creation that meets its flow's session dying (another worker is
    /// removing it) is a race, in either direction, and gives back what
    /// it took (found by a review).
    #[test]
    fn a_creation_meeting_its_flows_dying_session_is_a_race() {
        let (t, nat, mut env) = eif_table();
        let (s, stranger, first) = outbound_then_inbound(&t, &nat, &mut env);
        let mut out = None;
        nat.sessions.remove_with(s.index, s.seq, |_| {
            out = Some(nat.create_outbound(&req(40000, 3478, proto::UDP), policy(&t), &t, &mut env.ctx(2)));
        });
        assert_eq!(out.unwrap().map(|_| ()), Err(DropReason::SessionRace), "outbound");
        let mut got = None;
        nat.sessions.remove_with(first.index, first.seq, |_| {
            got = Some(nat.create_inbound(&stranger, &t, &mut env.ctx(2)));
        });
        assert_eq!(got.unwrap().map(|_| ()), Err(DropReason::SessionRace), "inbound");
        let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
        assert_eq!(pool.owner(40000).unwrap().refs, 2, "what the refused creations took is given back");
        assert_eq!(nat.source_sessions(POD), 2);
    }

    #[test]
    fn sweep_removes_expired_sessions_in_bounded_steps() {
        let t = tables(1, |_| {});
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        for p in 0..100u16 {
            nat.create_outbound(&req(1000 + p, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        }
        assert_eq!(nat.sweep(10, 1000, &t, &env.stats, None), 10);
        assert_eq!(nat.sessions.len(), 90);
        for _ in 0..9 {
            nat.sweep(10, 1000, &t, &env.stats, None);
        }
        assert_eq!(nat.sessions.len(), 0);
        assert_eq!(nat.mappings.len(), 0);
    }

    /// A session made before its egress IP's range was widened keeps its
    /// port in the one pool: the pod's next flow joins the mapping, and the
    /// old session's end leaves it to the new one (a new pool had lost the
    /// claim: the old session's end freed the new flow's port for another
    /// pod; found by a review).
    #[test]
    fn a_session_from_before_a_wider_range_releases_into_its_own_pool() {
        let t1 = tables(1, |s| s.egress_ips[0].ports = Some(PortRange { first: 40000, last: 40999 }));
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        let old = nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        let t2 = tables(2, |s| s.egress_ips[0].ports = Some(PortRange { first: 40000, last: 41999 }));
        assert!(nat.check(&old, &t2, 1, &env.stats, None), "still valid");
        let old = nat.sessions.view(old.index).unwrap();
        let mut r2 = req(40000, 53, proto::UDP);
        r2.remote = Ipv4Addr::new(203, 0, 113, 77);
        let new = nat.create_outbound(&r2, policy(&t2), &t2, &mut env.ctx(1)).unwrap();
        assert_eq!(new.tuple.egress_port, 40000);
        let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
        assert_eq!((pool.owner(40000).map(|o| o.refs), pool.in_use()), (Some(2), 1), "one mapping, two sessions");
        assert!(nat.remove(&old, End::unlogged(EndReason::Expired)));
        assert_eq!(pool.owner(40000).map(|o| o.refs), Some(1), "the new flow still holds the port");
        assert_eq!(pool.source_ports(POD), 1);
        assert!(nat.remove(&new, End::unlogged(EndReason::Expired)));
        assert_eq!((pool.owner(40000), pool.in_use(), nat.mappings.len()), (None, 0, 0));
    }

    /// An egress IP that leaves and comes back before the sweep reaches
    /// its sessions finds its pool as they left it.
    #[test]
    fn an_egress_ip_back_before_its_sessions_ended_finds_their_ports_taken() {
        let t1 = tables(1, |_| {});
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        let old = nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        nat.forget_egress(E);
        let t3 = tables(3, |_| {});
        let mut r2 = req(40000, 53, proto::UDP);
        r2.remote = Ipv4Addr::new(203, 0, 113, 77);
        let new = nat.create_outbound(&r2, policy(&t3), &t3, &mut env.ctx(1)).unwrap();
        assert_eq!(new.tuple.egress_port, 40000);
        assert!(nat.check(&old, &t3, 2, &env.stats, None), "valid again");
        let old = nat.sessions.view(old.index).unwrap();
        assert!(nat.remove(&old, End::unlogged(EndReason::Expired)));
        let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
        assert_eq!(pool.owner(40000).map(|o| o.refs), Some(1));
        assert!(nat.remove(&new, End::unlogged(EndReason::Expired)));
        assert_eq!(pool.owner(40000), None);
    }

    /// An egress IP that leaves: its pools stay while its sessions hold
    /// them, and the sweep that ends the last one forgets them.
    #[test]
    fn the_sweep_forgets_a_gone_egress_ips_pools_once_its_sessions_ended() {
        for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
            let (t1, nat, mut env) = blocks_of_16(mapping);
            nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
            nat.forget_egress(E);
            assert!(nat.mappings.existing_pool(E, proto::UDP).is_some(), "{mapping:?}: a session holds it");
            assert!(nat.existing_block_pool(E).is_some(), "{mapping:?}");
            let gone = tables(2, |s| {
                s.nat.mapping = mapping;
                s.policies.clear();
                s.egress_ips.clear();
            });
            nat.sweep(1024, 1, &gone, &env.stats, None);
            assert_eq!(nat.sessions.len(), 0, "{mapping:?}: invalidated");
            assert!(nat.mappings.existing_pool(E, proto::UDP).is_none(), "{mapping:?}: forgotten");
            assert!(nat.existing_block_pool(E).is_none(), "{mapping:?}");
            assert_eq!(nat.mappings.len(), 0, "{mapping:?}");
        }
    }

    /// Endpoint-dependent mode: sessions of a range moved away are removed
    /// by the sweep and leave the pool's count as the live ones make it
    /// (a new pool had counted the old ones' ends: `in_use` 0 with one
    /// session live; found by a review).
    #[test]
    fn endpoint_dependent_counts_hold_across_a_moved_range() {
        let edm = |gen, first| {
            tables(gen, |s| {
                s.nat.mapping = MappingBehavior::EndpointDependent;
                s.egress_ips[0].ports = Some(PortRange { first, last: first + 999 });
            })
        };
        let t1 = edm(1, 40000);
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        let t2 = edm(2, 50000);
        let new = nat.create_outbound(&req(40001, 53, proto::UDP), policy(&t2), &t2, &mut env.ctx(1)).unwrap();
        assert!((50000..=50999).contains(&new.tuple.egress_port));
        nat.sweep(1024, 1, &t2, &env.stats, None);
        let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
        assert_eq!((nat.sessions.len(), pool.in_use()), (1, 1), "the old session gone, the new one counted");
        let mut counts = Vec::new();
        pool.for_each_source(|pod, remote, port, n| counts.push((pod, remote, port, n)));
        assert_eq!(counts, vec![(POD, REMOTE, 53, 1)]);
    }

    /// A session of the pod in blocks of 16 (2 a pod), then another under
    /// the tables of generation 2 with `then`'s blocks, both logged to the
    /// ring, which is drained: (instance, env, ring, the first, the second).
    fn a_session_before_and_after(
        then: Option<PortBlocks>,
    ) -> (NatTable<Ipv4Addr>, Env, crate::translog::LogRing, SessionView<Ipv4Addr>, SessionView<Ipv4Addr>) {
        let t1 = tables(1, |s| s.egress_ips[0].port_blocks = blocks(16, 2, false));
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        let ring = crate::translog::LogRing::new(64);
        let make = |pod_port, t: &Tables, env: &mut Env| {
            nat.create_outbound(&req(pod_port, 53, proto::UDP), policy(t), t, &mut logged_ctx(env, &ring, 1)).unwrap()
        };
        let old = make(1, &t1, &mut env);
        let t2 = tables(2, |s| s.egress_ips[0].port_blocks = then);
        assert!(nat.check(&old, &t2, 1, &env.stats, None), "its port is still in the range: valid");
        let new = make(2, &t2, &mut env);
        drain(&ring);
        (nat, env, ring, old, new)
    }

    /// A change of `logSessions` or `maxPerPod` applies to the blocks in
    /// place: a session made before leaves the pod's block counted right
    /// (a new pool had been made: the old session's end freed the block
    /// the new session used, and logged its release; found by a review).
    #[test]
    fn a_block_modes_log_setting_changes_in_place() {
        let (nat, env, ring, old, new) = a_session_before_and_after(blocks(16, 3, true));
        let b = nat.existing_block_pool(E).unwrap();
        assert_eq!(b.config(), blocks(16, 3, true).unwrap());
        let start = b.blocks_of(POD)[0];
        assert!((start..start + 16).contains(&new.tuple.egress_port), "the same block");
        assert_eq!(b.holder(start), Some((POD, 2)));
        let log = Some(LogTo { ring: &ring, stats: &env.stats, now_ms: 3000 });
        assert!(nat.remove(&old, End { reason: EndReason::Expired, fast_path_seen: None, log }));
        assert_eq!(b.holder(start), Some((POD, 1)), "the new session still counted");
        assert!(drain(&ring).iter().all(|r| r.kind() != Some(LogKind::BlockFree)), "no release while in use");
    }

    /// A change of block size makes the next pool; the old one, retired,
    /// keeps its blocks until their sessions end, and logs their release
    /// then. Each session leaves the pool it was made in.
    #[test]
    fn a_new_block_size_retires_the_old_blocks_until_their_sessions_end() {
        let (nat, env, ring, old, new) = a_session_before_and_after(blocks(32, 2, false));
        let second = nat.existing_block_pool(E).unwrap();
        let pools = nat.block_pools();
        assert_eq!(pools.len(), 2, "the retired pool is reported while held");
        assert!(pools.iter().any(|p| p.epoch() != second.epoch() && p.config().size == 16));
        drop(pools);
        let new_block = second.blocks_of(POD)[0];
        assert!((new_block..new_block + 32).contains(&new.tuple.egress_port));
        let log = Some(LogTo { ring: &ring, stats: &env.stats, now_ms: 3000 });
        assert!(nat.remove(&old, End { reason: EndReason::Expired, fast_path_seen: None, log }));
        let freed: Vec<_> = drain(&ring).iter().map(|r| (r.kind(), r.remote_port - r.egress_port + 1)).collect();
        assert_eq!(freed, vec![(Some(LogKind::BlockFree), 16)], "the old block's release, of 16 ports");
        assert_eq!(second.holder(new_block), Some((POD, 1)), "the new block untouched");
        assert_eq!(nat.block_pools().len(), 1, "the retired pool gone with its last block");
    }

    /// A block pool made again after its IP left, while a pool retired by
    /// a change of block size still holds a block, takes an epoch of its
    /// own: the retired pool's session leaves that one, not the new pool
    /// (found by a review: the new pool started at epoch 0 again, the
    /// retired one's epoch).
    #[test]
    fn a_block_pool_made_again_never_takes_a_live_pools_epoch() {
        let one_range = |gen, size| {
            tables(gen, |s| {
                s.egress_ips[0].ports = Some(PortRange { first: 40000, last: 40015 });
                s.egress_ips[0].port_blocks = blocks(size, 2, false);
            })
        };
        let t1 = one_range(1, 16);
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        let ring = crate::translog::LogRing::new(64);
        let s1 = nat.create_outbound(&req(1, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        let t2 = one_range(2, 8);
        let s = nat.create_outbound(&req(3, 53, proto::UDP), policy(&t2), &t2, &mut env.ctx(0)).unwrap();
        assert!(nat.remove(&s, End::unlogged(EndReason::Expired)));
        nat.forget_egress(E);
        assert!(nat.existing_block_pool(E).is_none(), "the idle current pool dropped; the retired one held");
        let t3 = one_range(3, 16);
        let _s2 = nat.create_outbound(&req(2, 53, proto::UDP), policy(&t3), &t3, &mut env.ctx(1)).unwrap();
        let cur = nat.existing_block_pool(E).unwrap();
        assert_eq!(cur.holder(40000), Some((POD, 1)));
        let log = Some(LogTo { ring: &ring, stats: &env.stats, now_ms: 3000 });
        assert!(nat.remove(&s1, End { reason: EndReason::Expired, fast_path_seen: None, log }));
        assert_eq!(cur.holder(40000), Some((POD, 1)), "the new session's block untouched");
        let freed: Vec<_> = drain(&ring).iter().map(|r| r.kind()).collect();
        assert_eq!(freed, vec![Some(LogKind::BlockFree)], "the retired pool's block freed");
        assert_eq!(nat.block_pools().len(), 1);
    }

    /// A worker still on the tables from before a change asks for the
    /// pools with the old configuration: it moves neither the block
    /// layout nor the port range back (found by a review: each such call
    /// made a new block pool, retiring the current one).
    #[test]
    fn a_worker_on_older_tables_moves_no_pool_back() {
        let t1 = tables(1, |s| s.egress_ips[0].port_blocks = blocks(16, 2, false));
        let t2 = tables(2, |s| {
            s.egress_ips[0].port_blocks = blocks(32, 3, true);
            s.egress_ips[0].ports = Some(PortRange { first: 40000, last: 49999 });
        });
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        nat.create_outbound(&req(1, 53, proto::UDP), policy(&t2), &t2, &mut env.ctx(0)).unwrap();
        let current = nat.existing_block_pool(E).unwrap();
        let stale = nat.create_outbound(&req(2, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        let after = nat.existing_block_pool(E).unwrap();
        assert!(Arc::ptr_eq(&current, &after), "no new pool");
        assert_eq!(after.config(), blocks(32, 3, true).unwrap());
        assert_eq!(nat.block_pools().len(), 1, "nothing retired");
        assert!(after.holds_session(nat.sessions.view(stale.index).unwrap().flags));
        let pool = nat.mappings.existing_pool(E, proto::UDP).unwrap();
        assert_eq!(pool.range(), PortRange { first: 40000, last: 49999 });
    }

    /// The sweep forgets a gone IP's pools whatever tables the worker
    /// sweeping is on (found by a review: a sweep on the tables from
    /// before the IP left took it off the list for good), and a pool a
    /// worker on those tables makes again soon after is forgotten too.
    #[test]
    fn the_sweep_forgets_a_gone_ips_pools_whatever_tables_it_sweeps_with() {
        let t1 = tables(1, |_| {});
        let nat = NatTable::new(&t1.nat);
        let mut env = Env::new();
        nat.create_outbound(&req(40000, 53, proto::UDP), policy(&t1), &t1, &mut env.ctx(0)).unwrap();
        nat.forget_egress(E);
        nat.sweep(16, 1, &t1, &env.stats, None);
        let gone = tables(2, |s| {
            s.policies.clear();
            s.egress_ips.clear();
        });
        nat.sweep(1024, 2, &gone, &env.stats, None);
        assert_eq!(nat.sessions.len(), 0);
        assert!(nat.mappings.existing_pool(E, proto::UDP).is_none(), "forgotten");
        // A worker still on t1 makes the pool again; the next sweeps forget it.
        nat.mappings.pool(E, proto::UDP, PortRange::default(), 1);
        nat.sweep(16, 3, &gone, &env.stats, None);
        assert!(nat.mappings.existing_pool(E, proto::UDP).is_none(), "made again, forgotten again");
        nat.sweep(16, 2 + FORGET_SETTLE_SECS, &gone, &env.stats, None);
        assert!(!nat.pools_left.load(Ordering::Relaxed), "off the list once settled");
    }

    fn blocks(size: u16, max_per_pod: u16, log_sessions: bool) -> Option<PortBlocks> {
        Some(PortBlocks { size, max_per_pod, log_sessions })
    }

    /// Tables with `mapping` and the egress IP in blocks of 16 (2 a pod, not
    /// logged per session), and an instance for them.
    fn blocks_of_16(mapping: MappingBehavior) -> (Tables, NatTable<Ipv4Addr>, Env) {
        let t = tables(1, |s| {
            s.nat.mapping = mapping;
            s.egress_ips[0].port_blocks = blocks(16, 2, false);
        });
        let nat = NatTable::new(&t.nat);
        (t, nat, Env::new())
    }

    fn logged_ctx<'a>(env: &'a mut Env, ring: &'a crate::translog::LogRing, now: u32) -> CreateCtx<'a, Ipv4Addr> {
        let stats = &env.stats;
        CreateCtx {
            log: Some(LogTo { ring, stats, now_ms: u64::from(now) * 1000 }),
            ..CreateCtx::new(now, &mut env.rng, stats, DeltaFnBox(&|_| 0))
        }
    }

    fn drain(ring: &crate::translog::LogRing) -> Vec<LogRecord> {
        std::iter::from_fn(|| ring.pop()).collect()
    }

    #[test]
    fn a_pods_sessions_share_its_block_and_are_logged_per_block() {
        for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
            let (t, nat, mut env) = blocks_of_16(mapping);
            let ring = crate::translog::LogRing::new(64);
            let mut made = Vec::new();
            for (i, p) in [40000u16, 40001, 40002].into_iter().enumerate() {
                let proto = if i == 2 { proto::TCP } else { proto::UDP };
                made.push(
                    nat.create_outbound(&req(p, 53, proto), policy(&t), &t, &mut logged_ctx(&mut env, &ring, 1))
                        .unwrap(),
                );
            }
            let b = nat.existing_block_pool(E).unwrap();
            let start = b.blocks_of(POD)[0];
            assert_eq!(b.blocks_of(POD).len(), 1, "{mapping:?}");
            assert!(made.iter().all(|v| (start..start + 16).contains(&v.tuple.egress_port)), "{mapping:?}");
            assert_eq!(b.holder(start), Some((POD, 3)), "TCP and UDP count in one block");
            assert_eq!(env.stats.snapshot().event(Event::PortPreserved), 0, "no port preservation in block mode");
            let records = drain(&ring);
            assert_eq!(records.len(), 1, "one block record, no session records: {records:?}");
            assert_eq!(
                (records[0].kind(), records[0].egress_port, records[0].remote_port),
                (Some(LogKind::BlockAllocate), start, start + 15)
            );
            // Another pod: a block of its own.
            let mut other = req(40000, 53, proto::UDP);
            other.pod = Ipv4Addr::new(192, 0, 2, 11);
            let o = nat.create_outbound(&other, policy(&t), &t, &mut logged_ctx(&mut env, &ring, 2)).unwrap();
            assert!(!(start..start + 16).contains(&o.tuple.egress_port));
            assert_eq!(drain(&ring).len(), 1);
            // The block is freed with its last session, whatever ended it.
            let log = |now_ms| Some(LogTo { ring: &ring, stats: &env.stats, now_ms });
            assert!(nat.remove(&made[0], End { reason: EndReason::Expired, fast_path_seen: None, log: log(5000) }));
            assert!(nat.remove(&made[1], End { reason: EndReason::Evicted, fast_path_seen: None, log: log(6000) }));
            assert!(drain(&ring).is_empty(), "no session end records, the block lives");
            assert!(nat.remove(&made[2], End { reason: EndReason::Expired, fast_path_seen: None, log: log(7000) }));
            let records = drain(&ring);
            assert_eq!(records.len(), 1);
            assert_eq!(
                (records[0].kind(), records[0].egress_port, records[0].time_ms),
                (Some(LogKind::BlockFree), start, 7000)
            );
            assert_eq!((b.taken(), b.blocks_of(POD).len()), (1, 0));
            assert_eq!(nat.mappings.len(), usize::from(mapping == MappingBehavior::EndpointIndependent));
        }
    }

    #[test]
    fn block_mode_logs_sessions_too_when_asked() {
        let t = tables(1, |s| s.egress_ips[0].port_blocks = blocks(8, 1, true));
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        let ring = crate::translog::LogRing::new(64);
        let v =
            nat.create_outbound(&req(1, 53, proto::UDP), policy(&t), &t, &mut logged_ctx(&mut env, &ring, 1)).unwrap();
        let kinds: Vec<_> = drain(&ring).iter().map(|r| r.kind()).collect();
        assert_eq!(kinds, vec![Some(LogKind::BlockAllocate), Some(LogKind::SessionCreate)]);
        let log = Some(LogTo { ring: &ring, stats: &env.stats, now_ms: 9 });
        assert!(nat.remove(&v, End { reason: EndReason::Expired, fast_path_seen: None, log }));
        let kinds: Vec<_> = drain(&ring).iter().map(|r| r.kind()).collect();
        assert_eq!(kinds, vec![Some(LogKind::SessionDelete), Some(LogKind::BlockFree)]);
    }

    #[test]
    fn a_pod_at_max_per_pod_is_refused_as_over_quota() {
        let t = tables(1, |s| s.egress_ips[0].port_blocks = blocks(8, 2, false));
        let nat = NatTable::new(&t.nat);
        let mut env = Env::new();
        for p in 0..16 {
            nat.create_outbound(&req(1000 + p, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        }
        assert_eq!(
            nat.create_outbound(&req(2000, 53, proto::UDP), policy(&t), &t, &mut env.ctx(0)),
            Err(DropReason::SourcePortQuota)
        );
        assert_eq!(nat.source_sessions(POD), 16, "the refused flow holds nothing");
        // TCP has its own ports in the same blocks.
        nat.create_outbound(&req(2000, 80, proto::TCP), policy(&t), &t, &mut env.ctx(0)).unwrap();
        // Endpoint-dependent: one block's port serves many remotes.
        let t = tables(1, |s| {
            s.nat.mapping = MappingBehavior::EndpointDependent;
            s.egress_ips[0].port_blocks = blocks(8, 1, false);
        });
        let nat = NatTable::new(&t.nat);
        for p in 0..64 {
            let mut r = req(1000 + p, 53, proto::UDP);
            r.remote = Ipv4Addr::new(203, 0, 113, 100 + (p % 8) as u8);
            nat.create_outbound(&r, policy(&t), &t, &mut env.ctx(0)).unwrap();
        }
        assert_eq!(nat.existing_block_pool(E).unwrap().taken(), 1, "64 sessions towards 8 remotes in 8 ports");
    }

    #[test]
    fn an_imported_session_marks_its_block_as_its_pods() {
        let t = tables(1, |s| s.egress_ips[0].port_blocks = blocks(8, 1, false));
        let nat = NatTable::new(&t.nat);
        let tuple = |pod, pod_port, egress_port| SessionTuple {
            pod,
            remote: REMOTE,
            egress: E,
            pod_port,
            remote_port: 53,
            egress_port,
            proto: proto::UDP,
        };
        let other = Ipv4Addr::new(192, 0, 2, 11);
        let records = [
            SessionRecord::from_tuple(&tuple(POD, 1, 40003), 0, 0, session_flags::HAS_MAPPING, 0),
            SessionRecord::from_tuple(&tuple(POD, 2, 40006), 0, 0, session_flags::HAS_MAPPING, 0),
            SessionRecord::from_tuple(&tuple(other, 1, 40005), 0, 0, session_flags::HAS_MAPPING, 0),
        ];
        let rep = nat.import(&records, &t, 10, &|_| 0);
        assert_eq!((rep.installed, rep.conflicts), (2, 1), "the third port lies in POD's block");
        let b = nat.existing_block_pool(E).unwrap();
        assert_eq!((b.blocks_of(POD), b.holder(40000)), (vec![40000], Some((POD, 2))));
        // The pod's next session lands in the imported block; imports log nothing.
        let mut env = Env::new();
        let ring = crate::translog::LogRing::new(8);
        let v =
            nat.create_outbound(&req(3, 53, proto::UDP), policy(&t), &t, &mut logged_ctx(&mut env, &ring, 11)).unwrap();
        assert!((40000..40008).contains(&v.tuple.egress_port));
        assert!(drain(&ring).is_empty());
        // The sync records of block sessions carry no local flags.
        let mut out = Vec::new();
        nat.export(E, 11, &mut out);
        assert!(out.iter().all(|r| r.flags & session_flags::LOCAL == 0), "{out:?}");
    }

    /// Log volume and port use of one workload, per session and in block
    /// mode (docs/benchmarks.md, "Port blocks"). A count, not a timing:
    /// `cargo test -q -p egret-dataplane --lib port_blocks_volume -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement"]
    fn port_blocks_volume() {
        // IPFIX data record bytes (ipfix.rs, IPv4 with destinations):
        // create 34, delete 42, block 25; the journal: 88 + identity.
        let ipfix = |k: Option<LogKind>| match k {
            Some(LogKind::SessionCreate) => 34,
            Some(LogKind::SessionDelete) => 42,
            _ => 25,
        };
        // (name, pods, seconds between a pod's new flows, session life in s, simulated s)
        let workloads = [("short flows", 100u32, 1u32, 120u32, 600u32), ("few long flows", 100, 30, 600, 1800)];
        println!("| workload | mode | flows | records | IPFIX data bytes | ports used (end) | ports reserved (end) | peak reserved |");
        println!("|---|---|---|---|---|---|---|---|");
        for (name, pods, every, life, secs) in workloads {
            for blocks in [None, blocks(32, 32, false), blocks(128, 32, false)] {
                let t = tables(1, |s| {
                    s.egress_ips[0].port_blocks = blocks;
                    s.nat.max_sessions = 1 << 17;
                    s.nat.max_ports_per_source = Some(65_536);
                });
                let nat = NatTable::new(&t.nat);
                let mut env = Env::new();
                let ring = crate::translog::LogRing::new(1 << 20);
                let mut live: std::collections::VecDeque<(u32, SessionView<Ipv4Addr>)> = Default::default();
                let (mut flows, mut records, mut bytes, mut peak) = (0u64, 0u64, 0u64, 0u64);
                let mut next_port = [10_000u16; 256];
                for now in 0..secs {
                    while live.front().is_some_and(|(end, _)| *end <= now) {
                        let (_, v) = live.pop_front().unwrap();
                        let log = Some(LogTo { ring: &ring, stats: &env.stats, now_ms: u64::from(now) * 1000 });
                        assert!(nat.remove(&v, End { reason: EndReason::Expired, fast_path_seen: None, log }));
                    }
                    for p in 0..pods {
                        // Pods start their flows spread over the period.
                        if (now + p) % every != 0 {
                            continue;
                        }
                        let mut r = req(next_port[p as usize], 443, proto::TCP);
                        next_port[p as usize] = next_port[p as usize].wrapping_add(1).max(10_000);
                        r.pod = Ipv4Addr::new(192, 0, 2, 1 + p as u8);
                        let v = nat.create_outbound(&r, policy(&t), &t, &mut logged_ctx(&mut env, &ring, now)).unwrap();
                        flows += 1;
                        live.push_back((now + life, v));
                    }
                    for r in drain(&ring) {
                        records += 1;
                        bytes += ipfix(r.kind());
                    }
                    let reserved = match nat.existing_block_pool(E) {
                        Some(b) => u64::from(b.taken()) * u64::from(b.config().size),
                        None => nat.mappings.existing_pool(E, proto::TCP).map_or(0, |p| u64::from(p.in_use())),
                    };
                    peak = peak.max(reserved);
                }
                let used = nat.mappings.existing_pool(E, proto::TCP).map_or(0, |p| p.in_use());
                let reserved = match nat.existing_block_pool(E) {
                    Some(b) => u64::from(b.taken()) * u64::from(b.config().size),
                    None => u64::from(used),
                };
                let mode = blocks.map_or("per session".to_string(), |b| format!("blocks of {}", b.size));
                println!("| {name}: {pods} pods, a flow every {every} s each, {life} s per session, {secs} s | {mode} | {flows} | {records} | {bytes} | {used} | {reserved} | {peak} |");
            }
        }
    }
}
