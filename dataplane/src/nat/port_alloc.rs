//! External port allocation per (egress IP, protocol).
//!
//! Allocation is a try-insert (VPP, Cilium): candidates are tried in order
//! and the first one whose claim succeeds is taken. The candidates are the
//! pod's own port when it lies in the range (port preservation, RFC 4787
//! REQ-3 allows it and it keeps connections across a gateway failover), then
//! ports drawn uniformly at random from the range (RFC 6056 3.3.1,
//! Algorithm 1), for a bounded number of attempts. Running out is counted per
//! egress IP and the packet is dropped: the pod's own address never leaves.
//!
//! In endpoint-independent mode a [`PortPool`] is the reverse table: one
//! owner cell per port, holding the (pod, pod port) mapped to it and how many
//! sessions use the mapping. In endpoint-dependent mode the session table's
//! inbound key is the reverse table and the pool only keeps the counters.
//!
//! Per-source quota: a pool also counts what each pod holds and refuses a
//! pod that reached [`PortPool::source_quota`], so one pod cannot take every
//! port of an egress IP from the others (RFC 6888 REQ-4: a CGN must support
//! limiting the external ports assigned per subscriber). In
//! endpoint-independent mode a pod holds its mappings; in endpoint-dependent
//! mode a port is taken only towards one remote (address, port), so the
//! quota counts the pod's sessions towards each remote (address, port),
//! which is what it can exhaust for the others.

use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::key::NatAddr;
use super::shard_map::ShardMap;
use super::table::{PortBitsAt, PortMapHook};
use crate::spin_lock::SpinMutex;

/// An inclusive range of external ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PortRange {
    /// First port.
    pub first: u16,
    /// Last port (inclusive).
    pub last: u16,
}

impl Default for PortRange {
    /// 32768-60999: Linux's ephemeral range, clear of Service ports such as
    /// 80 and 443 on a VIP that is also an egress IP.
    fn default() -> Self {
        PortRange { first: 32768, last: 60999 }
    }
}

impl PortRange {
    /// Number of ports.
    pub fn len(&self) -> u32 {
        u32::from(self.last).saturating_sub(u32::from(self.first)) + 1
    }

    /// Whether the range is empty (never, once validated).
    pub fn is_empty(&self) -> bool {
        self.last < self.first
    }

    /// Whether `port` is inside.
    #[inline]
    pub fn contains(&self, port: u16) -> bool {
        port >= self.first && port <= self.last
    }
}

/// A small, fast PRNG for port selection (xorshift64*), one per worker.
/// Unpredictability against off-path attackers comes from the random seed.
#[derive(Clone, Debug)]
pub struct PortRng(u64);

impl PortRng {
    /// A generator from a seed (zero is replaced).
    pub fn new(seed: u64) -> Self {
        PortRng(if seed == 0 { 0x9E37_79B9_7F4A_7C15 } else { seed })
    }

    /// A generator seeded from the OS's randomness (via the std hasher keys) and the time.
    pub fn from_entropy() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
        PortRng::new(h.finish())
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A uniformly random port in `range` (Lemire's multiply-shift reduction).
    #[inline]
    pub fn port_in(&mut self, range: PortRange) -> u16 {
        let n = u64::from(range.len());
        let r = ((self.next_u64() >> 32) * n) >> 32;
        range.first.wrapping_add(r as u16)
    }
}

/// The candidate ports for a new mapping: the pod's port if in range, then
/// random ports, `attempts` in all.
pub fn candidates(pod_port: u16, range: PortRange, attempts: u32, rng: &mut PortRng) -> impl Iterator<Item = u16> + '_ {
    candidates_ahead(pod_port, range, attempts, None, rng)
}

/// A worker's next random port in one pool, drawn one allocation ahead so
/// that its owner cell is asked for long before the claim (ADR 0043): a new
/// flow's random candidate was a cell nobody had touched lately (the cells
/// are 16 bytes a port, 448 KiB per egress IP and protocol), and its miss
/// was waited for under the cell's lock, the largest wait of a new flow.
/// The port is as random as one drawn at the claim: the same generator,
/// one allocation earlier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PortAhead(Option<u16>);

impl PortAhead {
    /// The port drawn ahead, if any (its owner cell was asked for then).
    #[inline]
    pub fn port(&self) -> Option<u16> {
        self.0
    }

    /// The port drawn ahead if it is in `range` (a moved range drops it),
    /// or a fresh draw; either way the next allocation draws anew.
    #[inline]
    fn take_or_draw(&mut self, range: PortRange, rng: &mut PortRng) -> u16 {
        let drawn = self.usable(range);
        self.0 = None;
        drawn.unwrap_or_else(|| rng.port_in(range))
    }

    /// The first random candidate [`PortAhead::take_or_draw`] will give,
    /// without taking it (the generator's next draw is read from a copy):
    /// the port whose lines the creation's prefetch asks for.
    #[inline]
    pub fn peek(&self, range: PortRange, rng: &PortRng) -> u16 {
        self.usable(range).unwrap_or_else(|| rng.clone().port_in(range))
    }

    /// The port drawn ahead, if `range` holds it.
    #[inline]
    fn usable(&self, range: PortRange) -> Option<u16> {
        self.0.filter(|p| range.contains(*p))
    }

    /// Draws the next port once the last was used, and asks for its owner
    /// cell's line in `pool`.
    #[inline]
    pub fn refill<A: NatAddr>(&mut self, pool: &PortPool<A>, range: PortRange, rng: &mut PortRng) {
        if self.0.is_none() && !range.is_empty() {
            let p = rng.port_in(range);
            self.0 = Some(p);
            pool.prefetch_claim(p);
        }
    }
}

/// [`candidates`] whose first random port is the one `ahead` holds (when
/// given and in range); the ones after it are drawn as they are needed.
pub fn candidates_ahead<'a>(
    pod_port: u16,
    range: PortRange,
    attempts: u32,
    mut ahead: Option<&'a mut PortAhead>,
    rng: &'a mut PortRng,
) -> impl Iterator<Item = u16> + 'a {
    let first = range.contains(pod_port).then_some(pod_port);
    let randoms = attempts.saturating_sub(u32::from(first.is_some()));
    first.into_iter().chain((0..randoms).map(move |_| match ahead.as_deref_mut() {
        Some(a) => a.take_or_draw(range, rng),
        None => rng.port_in(range),
    }))
}

/// Who holds an external port in endpoint-independent mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Owner<A> {
    /// The pod.
    pub pod: A,
    /// The pod's port.
    pub pod_port: u16,
    /// Sessions using this mapping.
    pub refs: u32,
}

/// Shards of a pool's per-pod counters. The port-use walk locks one
/// shard at a time while it copies it (`for_each_source`), and a worker
/// admitting a pod of that shard waits meanwhile: more shards, shorter
/// waits. DashMap's default (four per core, 8 on a 2-core machine) made a
/// worker wait up to 12-23 ms for a copy of 1 M entries in a debug build;
/// with 64 a shard holds an eighth as many (docs/benchmarks.md, "Port
/// use", has both), for 8 KB per pool (a shard is a 128-byte cache-padded
/// lock and table; nat/shard_map.rs).
const SOURCE_SHARDS: usize = 64;

/// Ports per chunk of owner cells: a chunk is made when a port in it is
/// first claimed.
const CHUNK_BITS: u32 = 10;
const CHUNK: usize = 1 << CHUNK_BITS;

/// The owner cells of one chunk of ports.
type Chunk<A> = Box<[SpinMutex<Owner<A>>]>;

/// The ports of one (egress IP, protocol), for as long as a session holds
/// one of them.
///
/// The pool outlives a change of the egress IP's range (the range is only
/// where new ports are drawn, and what the port-use report divides by):
/// the sessions made before the change release into the pool they took
/// from, and a port they hold is never given to another pod. A new pool
/// in its place (as before) lost their claims: a port could be used
/// twice, and a mapping freed while in use (ADR 0042).
///
/// An owner cell is free when its reference count is 0 (no `Option`: a cell
/// is 16 bytes for IPv4). The cells cover every port, in chunks of 1,024
/// made on first use, so a range can move without moving them: the
/// reverse table of the default range costs 28 chunks, 448 KiB per egress
/// IP and protocol.
#[derive(Debug)]
pub struct PortPool<A: NatAddr> {
    /// The range's first port (high 16 bits) and last (low 16 bits).
    range: AtomicU32,
    /// The tables' generation the range was set for, and the lock its
    /// (rare) changes take: a worker still on an older snapshot never
    /// moves it back.
    range_generation: Mutex<u64>,
    /// `65536 / CHUNK` chunks in endpoint-independent mode, none otherwise.
    chunks: Box<[OnceLock<Chunk<A>>]>,
    in_use: AtomicU32,
    exhausted: AtomicU64,
    /// Ports each pod holds in this pool, keyed (pod, zero, 0) for
    /// mappings and (pod, remote, remote port) in endpoint-dependent mode.
    per_source: ShardMap<(A, A, u16), u32>,
    source_quota: AtomicU32,
    over_quota: AtomicU64,
    /// The mapped-port filter, once connected (endpoint-independent mode):
    /// a port's bit follows its owner cell, set when the cell is claimed
    /// and cleared when its last session releases it, under the cell's
    /// lock ([`PortMarks`]).
    marks: OnceLock<PortMarks<A>>,
}

/// Where a pool marks its ports mapped: the XDP program's bitmap of the
/// pool's (egress IP, protocol), through the NAT's port map hook.
///
/// In endpoint-independent mode every session holds its port's mapping, so
/// the owner cell's count is the port's count of sessions: the bit is set
/// at the cell's claim, before the session's insert, and cleared at its
/// last release, after the session's removal, both under the cell's lock,
/// so a release and a claim of one port cannot swap their writes. (The
/// NAT counts each port's sessions in a map of its own only in
/// endpoint-dependent mode, where a port has no owner cell.)
///
/// The pool keeps where the hook keeps its pair's bits
/// ([`PortMapHook::locate`]), so a mark is one check and one write, not a
/// lookup of the pair; a place gone stale (the filter forgot the IP) is
/// found again through [`PortMapHook::set`].
pub struct PortMarks<A> {
    hook: Arc<dyn PortMapHook<A>>,
    egress: A,
    proto: u8,
    /// The pair's [`PortBitsAt`], 0 until located (or when the hook has
    /// none: every mark then looks the pair up twice, `set` and `locate`,
    /// as for a pair the filter could not track because every slot was
    /// taken).
    at: AtomicU64,
}

impl<A: Copy> PortMarks<A> {
    /// Marks (`egress`, `proto`)'s ports through `hook`.
    pub fn new(hook: Arc<dyn PortMapHook<A>>, egress: A, proto: u8) -> Self {
        PortMarks { hook, egress, proto, at: AtomicU64::new(0) }
    }

    #[inline]
    fn set(&self, port: u16, mapped: bool) {
        // Acquire, with `relocated_set`'s Release: what the worker that
        // located the place saw of it (the slot's zeroing as the filter
        // tracked the pair) is seen before this worker writes through it.
        if let Some(at) = NonZeroU64::new(self.at.load(Ordering::Acquire)) {
            if self.hook.set_at(PortBitsAt(at), port, mapped) {
                return;
            }
        }
        self.relocated_set(port, mapped);
    }

    /// The first mark, or one after the filter forgot the pair: through
    /// the lookup, then the place kept for the next.
    #[cold]
    fn relocated_set(&self, port: u16, mapped: bool) {
        self.hook.set(self.egress, self.proto, port, mapped);
        let at = self.hook.locate(self.egress, self.proto);
        self.at.store(at.map_or(0, |at| at.0.get()), Ordering::Release);
    }
}

impl<A: std::fmt::Debug> std::fmt::Debug for PortMarks<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PortMarks").field("egress", &self.egress).field("proto", &self.proto).finish_non_exhaustive()
    }
}

fn packed(r: PortRange) -> u32 {
    u32::from(r.first) << 16 | u32::from(r.last)
}

impl<A: NatAddr> PortPool<A> {
    /// A pool over `range`; `with_owners` allocates the reverse table
    /// (endpoint-independent mode).
    pub fn new(range: PortRange, with_owners: bool) -> Self {
        let n = if with_owners { (1 << 16) / CHUNK } else { 0 };
        let pool = PortPool {
            range: AtomicU32::new(packed(range)),
            range_generation: Mutex::new(0),
            chunks: (0..n).map(|_| OnceLock::new()).collect(),
            in_use: AtomicU32::new(0),
            exhausted: AtomicU64::new(0),
            per_source: ShardMap::new(SOURCE_SHARDS),
            source_quota: AtomicU32::new(u32::MAX),
            over_quota: AtomicU64::new(0),
            marks: OnceLock::new(),
        };
        pool.make_cells(range);
        pool
    }

    /// Moves the range new ports are drawn from to `range`, the egress
    /// IP's `ports` in the tables of `generation`, unless the range was set
    /// for a later generation. What is claimed stays claimed.
    pub fn set_range(&self, range: PortRange, generation: u64) {
        let mut set_for = self.range_generation.lock();
        if generation < *set_for {
            return;
        }
        *set_for = generation;
        self.make_cells(range);
        self.range.store(packed(range), Ordering::Relaxed);
    }

    /// Makes the owner cells of `range` now, as the pool is made or its
    /// range moved, rather than at the first claims of a chunk (a new
    /// flow would pay for 1,024 cells).
    fn make_cells(&self, range: PortRange) {
        if self.chunks.is_empty() || range.is_empty() {
            return;
        }
        for c in usize::from(range.first) >> CHUNK_BITS..=usize::from(range.last) >> CHUNK_BITS {
            let _ = self.cell_made((c << CHUNK_BITS) as u16);
        }
    }

    /// Marks this pool's ports through `marks` from now on (once; a pool
    /// without owner cells keeps none), and marks every port held now
    /// ([`Self::remark`]). Whether the pool took them.
    pub fn connect_marks(&self, marks: PortMarks<A>) -> bool {
        let connected = self.set_marks(marks);
        if connected {
            self.remark();
        }
        connected
    }

    /// [`Self::connect_marks`] for a pool that holds nothing yet (one
    /// just made): no walk over its cells.
    pub fn set_marks(&self, marks: PortMarks<A>) -> bool {
        !self.chunks.is_empty() && self.marks.set(marks).is_ok()
    }

    /// Sets the bit of every port an owner cell holds, each under its
    /// cell's lock: after the filter forgot the egress IP and tracks it
    /// again while sessions still hold ports (their bits were dropped with
    /// it), or when the filter is connected to a pool in use. Off the
    /// workers' path: a walk over the made chunks' cells.
    pub fn remark(&self) {
        let Some(marks) = self.marks.get() else { return };
        for (c, chunk) in self.chunks.iter().enumerate() {
            let Some(cells) = chunk.get() else { continue };
            for (i, cell) in cells.iter().enumerate() {
                let o = cell.lock();
                if o.refs != 0 {
                    marks.set(((c << CHUNK_BITS) | i) as u16, true);
                }
            }
        }
    }

    /// Whether nothing is held: no port (or session) in use and no pod
    /// counted.
    pub fn is_idle(&self) -> bool {
        self.in_use() == 0 && self.per_source.is_empty()
    }

    /// Sets how many ports one pod may hold in this pool (the NAT sets it
    /// from `nat.maxPortsPerSource` before each allocation; a pool starts
    /// unlimited). Lowering it takes nothing away: it only refuses new ones.
    pub fn set_source_quota(&self, quota: u32) {
        if self.source_quota.load(Ordering::Relaxed) != quota {
            self.source_quota.store(quota, Ordering::Relaxed);
        }
    }

    /// The per-pod quota.
    pub fn source_quota(&self) -> u32 {
        self.source_quota.load(Ordering::Relaxed)
    }

    /// Counts one more mapping for `pod` if it is under its quota;
    /// otherwise counts the refusal and returns `false`.
    pub fn admit_source(&self, pod: A) -> bool {
        self.admit((pod, A::from_bits_zero(), 0))
    }

    /// Gives back one mapping counted by [`PortPool::admit_source`].
    pub fn release_source(&self, pod: A) {
        self.release_key((pod, A::from_bits_zero(), 0));
    }

    /// Mappings `pod` holds in this pool.
    pub fn source_ports(&self, pod: A) -> u32 {
        self.per_source.count((pod, A::from_bits_zero(), 0))
    }

    /// Endpoint-dependent mode: counts one more session of `pod` towards
    /// (remote, remote_port) if it is under its quota.
    pub fn admit_source_towards(&self, pod: A, remote: A, remote_port: u16) -> bool {
        self.admit((pod, remote, remote_port))
    }

    /// Gives back one session counted by [`PortPool::admit_source_towards`].
    pub fn release_source_towards(&self, pod: A, remote: A, remote_port: u16) {
        self.release_key((pod, remote, remote_port));
    }

    fn admit(&self, key: (A, A, u16)) -> bool {
        if self.per_source.count_up(key, self.source_quota()) {
            return true;
        }
        self.over_quota.fetch_add(1, Ordering::Relaxed);
        false
    }

    fn release_key(&self, key: (A, A, u16)) {
        self.per_source.count_down(key);
    }

    /// Visits what each pod holds in this pool: (pod, remote, remote port,
    /// count), remote zero and port 0 for endpoint-independent mappings.
    /// For the control plane's port-use report, off the workers' path: the
    /// walk locks one shard of the counters at a time, so a worker
    /// admitting a pod of that shard waits for that shard's walk.
    pub fn for_each_source(&self, mut f: impl FnMut(A, A, u16, u32)) {
        self.per_source.for_each(|&(pod, remote, remote_port), &n| f(pod, remote, remote_port, n));
    }

    /// How many times a pod was refused for being at its quota.
    pub fn over_quota(&self) -> u64 {
        self.over_quota.load(Ordering::Relaxed)
    }

    /// The range new ports are drawn from (the egress IP's range, as last
    /// set).
    pub fn range(&self) -> PortRange {
        let r = self.range.load(Ordering::Relaxed);
        PortRange { first: (r >> 16) as u16, last: r as u16 }
    }

    /// `port`'s owner cell, if its chunk was made.
    #[inline]
    fn cell(&self, port: u16) -> Option<&SpinMutex<Owner<A>>> {
        let chunk = self.chunks.get(usize::from(port) >> CHUNK_BITS)?.get()?;
        chunk.get(usize::from(port) & (CHUNK - 1))
    }

    /// `port`'s owner cell, its chunk made if need be (None in
    /// endpoint-dependent mode).
    fn cell_made(&self, port: u16) -> Option<&SpinMutex<Owner<A>>> {
        let chunk = self.chunks.get(usize::from(port) >> CHUNK_BITS)?.get_or_init(|| {
            (0..CHUNK).map(|_| SpinMutex::new(Owner { pod: A::from_bits_zero(), pod_port: 0, refs: 0 })).collect()
        });
        chunk.get(usize::from(port) & (CHUNK - 1))
    }

    /// Asks for the line of `port`'s owner cell.
    #[inline]
    pub fn prefetch_claim(&self, port: u16) {
        if let Some(cell) = self.cell(port) {
            crate::prefetch::read(cell);
        }
    }

    /// Asks for the line of the pod's count: its mappings (remote zero,
    /// port 0), or in endpoint-dependent mode its sessions towards
    /// (remote, remote_port) (nat/shard_map.rs).
    #[inline]
    pub fn prefetch_source(&self, pod: A, remote: A, remote_port: u16) {
        self.per_source.prefetch(&(pod, remote, remote_port));
    }

    /// Claims `port` for (pod, pod_port) if it is free. Try-insert. The
    /// caller draws `port` from the range its configuration gives (a
    /// worker on the snapshot before a change of range still uses the old
    /// one, and its session is then removed as no longer valid).
    pub fn try_claim(&self, port: u16, pod: A, pod_port: u16) -> bool {
        let Some(cell) = self.cell_made(port) else { return false };
        let mut o = cell.lock();
        if o.refs != 0 {
            return false;
        }
        *o = Owner { pod, pod_port, refs: 1 };
        if let Some(m) = self.marks.get() {
            m.set(port, true);
        }
        drop(o);
        self.in_use.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Adds a session to the mapping on `port` if (pod, pod_port) owns it.
    pub fn add_ref(&self, port: u16, pod: A, pod_port: u16) -> bool {
        let Some(cell) = self.cell(port) else { return false };
        let mut o = cell.lock();
        if o.refs != 0 && o.pod == pod && o.pod_port == pod_port {
            o.refs = o.refs.saturating_add(1);
            return true;
        }
        false
    }

    /// Drops a session from the mapping on `port`; frees the port when it was
    /// the last one (and gives it back to the pod's quota). Returns whether
    /// the port was freed.
    pub fn release(&self, port: u16, pod: A, pod_port: u16) -> bool {
        let Some(cell) = self.cell(port) else { return false };
        let mut o = cell.lock();
        if o.refs != 0 && o.pod == pod && o.pod_port == pod_port {
            o.refs -= 1;
            if o.refs == 0 {
                if let Some(m) = self.marks.get() {
                    m.set(port, false);
                }
                drop(o);
                self.in_use.fetch_sub(1, Ordering::Relaxed);
                self.release_source(pod);
                return true;
            }
        }
        false
    }

    /// Who owns `port`.
    pub fn owner(&self, port: u16) -> Option<Owner<A>> {
        let o = *self.cell(port)?.lock();
        (o.refs != 0).then_some(o)
    }

    /// Counts a port in use without an owner cell (endpoint-dependent mode).
    pub fn count_in_use(&self, delta: i32) {
        if delta >= 0 {
            self.in_use.fetch_add(delta as u32, Ordering::Relaxed);
        } else {
            let _ = self
                .in_use
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(delta.unsigned_abs())));
        }
    }

    /// Counts an exhaustion.
    pub fn count_exhausted(&self) {
        self.exhausted.fetch_add(1, Ordering::Relaxed);
    }

    /// Ports (mappings, or sessions in endpoint-dependent mode) in use.
    pub fn in_use(&self) -> u32 {
        self.in_use.load(Ordering::Relaxed)
    }

    /// How many times allocation found no free port.
    pub fn exhausted(&self) -> u64 {
        self.exhausted.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn random_ports_stay_in_range_and_cover_it() {
        let r = PortRange { first: 40000, last: 40009 };
        let mut rng = PortRng::new(7);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let p = rng.port_in(r);
            assert!(r.contains(p), "{p}");
            seen[usize::from(p - 40000)] = true;
        }
        assert!(seen.iter().all(|s| *s));
        let single = PortRange { first: 5, last: 5 };
        assert_eq!(rng.port_in(single), 5);
        let full = PortRange { first: 0, last: 65535 };
        assert_eq!(full.len(), 65536);
        let _ = rng.port_in(full);
    }

    #[test]
    fn candidates_preserve_the_pod_port_first() {
        let r = PortRange::default();
        let mut rng = PortRng::new(1);
        let c: Vec<u16> = candidates(40000, r, 4, &mut rng).collect();
        assert_eq!(c.len(), 4);
        assert_eq!(c[0], 40000);
        let c: Vec<u16> = candidates(80, r, 4, &mut rng).collect();
        assert_eq!(c.len(), 4);
        assert!(c.iter().all(|p| r.contains(*p)), "port 80 is outside the range and never used");
    }

    /// The port drawn ahead is the first random candidate and is used
    /// once; the pod's own port comes before it and leaves it; a range
    /// that moved away from it drops it; a refill draws only when it was
    /// used, from the same generator.
    #[test]
    fn a_port_drawn_ahead_is_the_first_random_candidate_once() {
        let r = PortRange { first: 40000, last: 40999 };
        let mut rng = PortRng::new(9);
        let mut ahead = PortAhead(Some(40500));
        let c: Vec<u16> = candidates_ahead(40001, r, 3, Some(&mut ahead), &mut rng).take(1).collect();
        assert_eq!(c, [40001], "the pod's port first");
        assert_eq!(ahead.port(), Some(40500), "not reached: kept");
        let mut twin = rng.clone();
        let c: Vec<u16> = candidates_ahead(40001, r, 4, Some(&mut ahead), &mut rng).collect();
        assert_eq!(c[..2], [40001, 40500]);
        assert_eq!(c[2..], [twin.port_in(r), twin.port_in(r)], "then fresh draws");
        assert_eq!(ahead.port(), None, "used");
        let pool = PortPool::<Ipv4Addr>::new(r, true);
        let mut twin = rng.clone();
        ahead.refill(&pool, r, &mut rng);
        assert_eq!(ahead.port(), Some(twin.port_in(r)), "drawn from the worker's generator");
        let drawn = ahead.port();
        ahead.refill(&pool, r, &mut rng);
        assert_eq!(ahead.port(), drawn, "a refill keeps an unused port");
        // The creation's prefetch asks for the port the claim will try.
        let mut twin = rng.clone();
        assert_eq!(ahead.peek(r, &rng), ahead.clone().take_or_draw(r, &mut twin));
        let mut empty = PortAhead::default();
        let peeked = empty.peek(r, &rng);
        assert_eq!(peeked, empty.take_or_draw(r, &mut rng.clone()), "nothing drawn: the generator's next");
        let moved = PortRange { first: 50000, last: 50009 };
        let c: Vec<u16> = candidates_ahead(80, moved, 1, Some(&mut ahead), &mut rng).collect();
        assert!(moved.contains(c[0]), "a port outside the moved range is never used: {c:?}");
        assert_eq!(ahead.port(), None);
    }

    #[test]
    fn owner_cells_are_small() {
        assert_eq!(std::mem::size_of::<SpinMutex<Owner<Ipv4Addr>>>(), 16);
    }

    #[test]
    fn claim_ref_release() {
        let pool = PortPool::new(PortRange { first: 100, last: 101 }, true);
        let a = Ipv4Addr::new(192, 0, 2, 1);
        let b = Ipv4Addr::new(192, 0, 2, 2);
        assert!(pool.try_claim(100, a, 5000));
        assert!(!pool.try_claim(100, b, 5000), "taken");
        assert!(pool.add_ref(100, a, 5000));
        assert!(!pool.add_ref(100, b, 5000), "not the owner");
        assert_eq!(pool.in_use(), 1);
        assert!(!pool.release(100, a, 5000), "one session still uses it");
        assert!(pool.release(100, a, 5000));
        assert_eq!(pool.in_use(), 0);
        assert!(pool.try_claim(100, b, 6000));
        assert_eq!(pool.owner(100), Some(Owner { pod: b, pod_port: 6000, refs: 1 }));
    }

    #[test]
    fn source_quota_counts_per_pod() {
        let pool: PortPool<Ipv4Addr> = PortPool::new(PortRange { first: 100, last: 199 }, true);
        let a = Ipv4Addr::new(192, 0, 2, 1);
        let b = Ipv4Addr::new(192, 0, 2, 2);
        pool.set_source_quota(2);
        assert!(pool.admit_source(a));
        assert!(pool.admit_source(a));
        assert!(!pool.admit_source(a), "a is at its quota");
        assert!(pool.admit_source(b), "b is not");
        assert_eq!((pool.source_ports(a), pool.source_ports(b), pool.over_quota()), (2, 1, 1));
        pool.release_source(a);
        assert!(pool.admit_source(a));
        // A freed mapping gives its port back to the owner's quota.
        pool.release_source(b);
        assert!(pool.admit_source(b) && pool.try_claim(150, b, 7));
        assert!(pool.release(150, b, 7));
        assert_eq!(pool.source_ports(b), 0);
    }

    /// The bits a [`PortMarks`] hook leaves, one per port.
    struct Bits([AtomicU64; 1024]);

    impl Bits {
        fn is_set(&self, port: u16) -> bool {
            self.0[usize::from(port >> 6)].load(Ordering::Relaxed) & (1 << (port & 63)) != 0
        }
    }

    impl PortMapHook<Ipv4Addr> for Bits {
        fn track(&self, _: Ipv4Addr, _: u8) {}
        fn set(&self, _: Ipv4Addr, _: u8, port: u16, mapped: bool) {
            let (w, b) = (&self.0[usize::from(port >> 6)], 1u64 << (port & 63));
            if mapped {
                w.fetch_or(b, Ordering::Relaxed);
            } else {
                w.fetch_and(!b, Ordering::Relaxed);
            }
        }
        fn forget(&self, _: Ipv4Addr) {}
    }

    /// Four threads claim and release eight ports as fast as they can: a
    /// port a thread holds has its bit set each time before it is
    /// released, and every port's bit ends as its owner cell says, because
    /// a claim's set and a last release's clear are made under the cell's
    /// lock. (Made outside it, a release's clear could land after the next
    /// claim's set.)
    #[test]
    fn a_ports_mark_follows_its_owner_cell_under_racing_claims() {
        let pool = Arc::new(PortPool::<Ipv4Addr>::new(PortRange { first: 40000, last: 40007 }, true));
        let bits = Arc::new(Bits(std::array::from_fn(|_| AtomicU64::new(0))));
        let hook: Arc<dyn PortMapHook<Ipv4Addr>> = bits.clone();
        assert!(pool.connect_marks(PortMarks::new(hook, Ipv4Addr::new(198, 51, 100, 1), 17)));
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let (pool, bits) = (&pool, &bits);
                s.spawn(move || {
                    let pod = Ipv4Addr::new(192, 0, 2, t + 1);
                    let mut rng = PortRng::new(u64::from(t) + 1);
                    let mut held = None;
                    for _ in 0..20_000 {
                        if let Some(p) = held.take() {
                            assert!(bits.is_set(p), "port {p} held without its bit");
                            pool.release(p, pod, 1000);
                        }
                        let p = rng.port_in(pool.range());
                        if pool.try_claim(p, pod, 1000) {
                            held = Some(p);
                        }
                    }
                });
            }
        });
        let mut held = 0;
        for port in 40000..=40007u16 {
            let set = bits.is_set(port);
            assert_eq!(set, pool.owner(port).is_some(), "port {port}");
            held += u32::from(set);
        }
        assert_eq!(held, pool.in_use());
    }

    /// A hook with a place to keep ([`PortMapHook::locate`]): its
    /// generation rises at each forget, as `egret_bpf::MappedPorts`'s
    /// slot's does; `lookups` counts the marks made through the lookup.
    struct Placed {
        bits: Bits,
        generation: AtomicU32,
        lookups: AtomicU32,
    }

    impl PortMapHook<Ipv4Addr> for Placed {
        fn track(&self, _: Ipv4Addr, _: u8) {}
        fn set(&self, egress: Ipv4Addr, proto: u8, port: u16, mapped: bool) {
            self.lookups.fetch_add(1, Ordering::Relaxed);
            self.bits.set(egress, proto, port, mapped);
        }
        fn forget(&self, _: Ipv4Addr) {
            self.generation.fetch_add(1, Ordering::Relaxed);
        }
        fn locate(&self, _: Ipv4Addr, _: u8) -> Option<PortBitsAt> {
            NonZeroU64::new(u64::from(self.generation.load(Ordering::Relaxed)) + 1).map(PortBitsAt)
        }
        fn set_at(&self, at: PortBitsAt, port: u16, mapped: bool) -> bool {
            if at.0.get() != u64::from(self.generation.load(Ordering::Relaxed)) + 1 {
                return false;
            }
            self.bits.set(Ipv4Addr::UNSPECIFIED, 0, port, mapped);
            true
        }
    }

    /// A pool looks its pair up once and marks through the kept place
    /// after; once the hook forgot the pair, the next mark looks it up
    /// again (and is made), and the marks after it use the new place.
    #[test]
    fn a_pool_marks_through_its_kept_place_until_it_goes_stale() {
        let pool = PortPool::<Ipv4Addr>::new(PortRange { first: 40000, last: 40007 }, true);
        let placed = Arc::new(Placed {
            bits: Bits(std::array::from_fn(|_| AtomicU64::new(0))),
            generation: AtomicU32::new(0),
            lookups: AtomicU32::new(0),
        });
        let hook: Arc<dyn PortMapHook<Ipv4Addr>> = placed.clone();
        assert!(pool.connect_marks(PortMarks::new(hook, Ipv4Addr::new(198, 51, 100, 1), 17)));
        let pod = Ipv4Addr::new(192, 0, 2, 1);
        for port in 40000..40003 {
            assert!(pool.try_claim(port, pod, port));
        }
        assert_eq!(placed.lookups.load(Ordering::Relaxed), 1, "the first mark only");
        assert!((40000..40003).all(|p| placed.bits.is_set(p)));

        placed.forget(Ipv4Addr::new(198, 51, 100, 1));
        assert!(pool.release(40000, pod, 40000));
        assert_eq!(placed.lookups.load(Ordering::Relaxed), 2, "a stale place is looked up again");
        assert!(!placed.bits.is_set(40000), "and the mark is made");
        assert!(pool.try_claim(40003, pod, 40003) && pool.release(40001, pod, 40001));
        assert_eq!(placed.lookups.load(Ordering::Relaxed), 2, "the new place kept");
        for port in 40000..=40007u16 {
            assert_eq!(placed.bits.is_set(port), pool.owner(port).is_some(), "port {port}");
        }
    }
}
