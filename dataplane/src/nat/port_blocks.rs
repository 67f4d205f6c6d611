//! Port blocks (RFC 7422's idea, allocated dynamically; ADR 0034 §6).
//!
//! On an egress IP in block mode a pod's first session takes a free
//! aligned block of `size` ports; its later sessions try ports inside its
//! blocks first, then take another block, up to `maxPerPod` blocks.
//! Inside a block, ports go out in turn from a random offset (a cursor in
//! the block's cell, try-insert as before): a block still filling gives a
//! never-used port at the first try, and once it has wrapped, the port of
//! its oldest session, the likeliest to have ended. The randomness RFC
//! 6056 asks of a port is then the block's and its offset's: a block of
//! 128 ports leaves an off-path attacker 7 bits fewer to guess, as any
//! block allocation does (RFC 7422 §5). A block is freed when the last session
//! using it ends. One translation-log record per block allocation and one
//! per release replace one per session (RFC 8158 natEvent 16 and 17).
//!
//! A block holds its numbers in every protocol: its owner cell lives here,
//! per egress IP, and counts the pod's sessions of any protocol inside it.
//! Within a block, each port is still claimed per protocol by the usual
//! reverse table (the [`PortPool`](super::port_alloc::PortPool)'s owner
//! cells, or the session table's inbound key in endpoint-dependent mode).
//!
//! Blocks are aligned to their size (a power of two): block `b` is ports
//! `b * size ..= b * size + size - 1`, and only the blocks that lie
//! wholly inside the egress IP's range are used, so up to `size - 1` ports
//! at each end of an unaligned range are not.
//!
//! No two locks are ever held at once: a block's cell and the pod's list
//! of blocks are updated one after the other, so a pod's list may for an
//! instant name a block it is losing; [`BlockPool::join`] is the check
//! that counts.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};

use dashmap::DashMap;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::key::NatAddr;
use super::port_alloc::{PortRange, PortRng};
use super::session::session_flags;
use crate::translog::{LogKind, LogRecord, LogTo};

/// The smallest block: a pod with fewer ports would need a record per few
/// sessions anyway.
pub const MIN_BLOCK_SIZE: u16 = 8;
/// The most blocks one pod may hold on one egress IP (its list of blocks
/// is a fixed array: no allocation per flow). Larger needs take larger blocks.
pub const MAX_BLOCKS_PER_POD: u16 = 32;

/// Ports of its blocks a pod's allocation tries, each block's cursor
/// first, before it takes another block.
const SCAN_BUDGET: u32 = 256;

/// An egress IP's block mode, as configured (`portBlocks:`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PortBlocks {
    /// Ports per block: a power of two, at least [`MIN_BLOCK_SIZE`].
    pub size: u16,
    /// Blocks one pod may hold on the egress IP, 1 to [`MAX_BLOCKS_PER_POD`].
    pub max_per_pod: u16,
    /// Whether the sessions of pods in block mode are logged one by one
    /// too (ADR 0034 §6: off, the block records are the log).
    #[serde(default)]
    pub log_sessions: bool,
}

/// What is wrong with a [`PortBlocks`]: the field (`size`, `maxPerPod`)
/// and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlocksInvalid {
    /// The field, as configured.
    pub field: &'static str,
    /// Its value.
    pub value: u32,
    /// What it must be.
    pub need: String,
}

impl PortBlocks {
    /// Checks the block mode against the egress IP's `range`.
    pub fn validate(&self, range: PortRange) -> Result<(), BlocksInvalid> {
        let size = self.size;
        if !size.is_power_of_two() || size < MIN_BLOCK_SIZE {
            return Err(BlocksInvalid {
                field: "size",
                value: u32::from(size),
                need: format!("a power of two, at least {MIN_BLOCK_SIZE}"),
            });
        }
        if self.blocks_in(range).1 == 0 {
            return Err(BlocksInvalid {
                field: "size",
                value: u32::from(size),
                need: format!(
                    "no larger than the port range {}-{}, with one block aligned to its size inside it",
                    range.first, range.last
                ),
            });
        }
        if !(1..=MAX_BLOCKS_PER_POD).contains(&self.max_per_pod) {
            return Err(BlocksInvalid {
                field: "maxPerPod",
                value: u32::from(self.max_per_pod),
                need: format!("1-{MAX_BLOCKS_PER_POD}"),
            });
        }
        Ok(())
    }

    /// The first block number and how many aligned blocks lie wholly in `range`.
    pub fn blocks_in(&self, range: PortRange) -> (u32, u32) {
        let size = u32::from(self.size.max(1));
        let first = u32::from(range.first).div_ceil(size);
        let end = (u32::from(range.last) + 1) / size;
        (first, end.saturating_sub(first))
    }
}

/// Why no block was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockRefusal {
    /// The pod holds `maxPerPod` blocks and found no free port in them.
    PodLimit,
    /// No block of the egress IP is free.
    Exhausted,
}

/// Why [`BlockPool::claim_exact`] could not mark a port's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockClaimError {
    /// The port is in no block (outside the aligned blocks of the range).
    Outside,
    /// Another pod holds the block.
    Taken,
    /// The pod already holds `maxPerPod` blocks.
    PodLimit,
}

#[derive(Clone, Copy, Debug)]
struct Cell<A> {
    pod: A,
    /// Sessions (of any protocol) using a port of the block, plus an
    /// allocation in progress.
    sessions: u32,
    taken: bool,
    /// The offset in the block of the next port to offer its pod: ports
    /// go out in turn from a random offset, so a pod's next session finds
    /// a port never used, or, once the block has wrapped, the one its
    /// oldest session had (the likeliest to have ended).
    next: u16,
}

/// The blocks one pod holds: block numbers, a fixed array.
#[derive(Clone, Copy, Debug)]
struct Held {
    n: u8,
    blocks: [u16; MAX_BLOCKS_PER_POD as usize],
}

impl Held {
    const EMPTY: Held = Held { n: 0, blocks: [0; MAX_BLOCKS_PER_POD as usize] };

    fn as_slice(&self) -> &[u16] {
        &self.blocks[..usize::from(self.n)]
    }
}

/// The blocks of one egress IP in block mode, for as long as a session
/// holds one of them. A change of `logSessions` or `maxPerPod` applies to
/// it in place; a change of its geometry (the block size or the IP's
/// range) makes a new pool of the next [`BlockPool::epoch`], and this one
/// lives on, retired, until its last block is freed (ADR 0042).
#[derive(Debug)]
pub struct BlockPool<A: NatAddr> {
    egress: A,
    size: u16,
    max_per_pod: AtomicU16,
    log_sessions: AtomicBool,
    range: PortRange,
    epoch: u16,
    /// The tables' generation its configuration is of.
    generation: AtomicU64,
    shift: u32,
    first: u32,
    cells: Box<[Mutex<Cell<A>>]>,
    held: DashMap<A, Held, ahash::RandomState>,
    taken: AtomicU32,
    exhausted: AtomicU64,
    pod_limit: AtomicU64,
}

/// How many pools of one egress IP a session tells apart: its pool's
/// [`BlockPool::epoch`] travels in its flags ([`session_flags::BLOCK_EPOCH`]).
pub const EPOCHS: u16 = 16;

impl<A: NatAddr> BlockPool<A> {
    /// The blocks of `egress` over `range` (`cfg` validated against it).
    pub fn new(egress: A, cfg: PortBlocks, range: PortRange) -> Self {
        Self::made(egress, cfg, range, 0, 0)
    }

    /// [`BlockPool::new`] of `epoch` (below [`EPOCHS`]), for the tables
    /// of `generation`.
    pub fn made(egress: A, cfg: PortBlocks, range: PortRange, epoch: u16, generation: u64) -> Self {
        let (first, count) = cfg.blocks_in(range);
        BlockPool {
            egress,
            size: cfg.size,
            max_per_pod: AtomicU16::new(cfg.max_per_pod),
            log_sessions: AtomicBool::new(cfg.log_sessions),
            range,
            epoch: epoch % EPOCHS,
            generation: AtomicU64::new(generation),
            shift: u32::from(cfg.size.max(1)).trailing_zeros(),
            first,
            cells: (0..count)
                .map(|_| Mutex::new(Cell { pod: A::from_bits_zero(), sessions: 0, taken: false, next: 0 }))
                .collect(),
            held: DashMap::with_hasher(ahash::RandomState::new()),
            taken: AtomicU32::new(0),
            exhausted: AtomicU64::new(0),
            pod_limit: AtomicU64::new(0),
        }
    }

    /// Whether `cfg` over `range` lays the blocks out as this pool does
    /// (the same size and range): then it applies in place
    /// ([`BlockPool::set_config`]).
    pub fn same_geometry(&self, cfg: PortBlocks, range: PortRange) -> bool {
        cfg.size == self.size && range == self.range
    }

    /// Applies `cfg`'s `maxPerPod` and `logSessions` (its geometry is
    /// this pool's), of the tables of `generation`. A lower `maxPerPod`
    /// takes no block away: it refuses new ones.
    pub fn set_config(&self, cfg: PortBlocks, generation: u64) {
        self.max_per_pod.store(cfg.max_per_pod, Ordering::Relaxed);
        self.log_sessions.store(cfg.log_sessions, Ordering::Relaxed);
        self.generation.store(generation, Ordering::Relaxed);
    }

    /// The tables' generation its configuration is of.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// Which pool of its egress IP this is (modulo [`EPOCHS`]).
    pub fn epoch(&self) -> u16 {
        self.epoch
    }

    /// The session flags naming this pool ([`session_flags::BLOCK_EPOCH`]).
    pub fn epoch_flags(&self) -> u16 {
        self.epoch << session_flags::BLOCK_EPOCH.trailing_zeros()
    }

    /// Whether a session with `flags` took its port here.
    pub fn holds_session(&self, flags: u16) -> bool {
        flags & session_flags::BLOCK_EPOCH == self.epoch_flags()
    }

    fn max_per_pod(&self) -> u16 {
        self.max_per_pod.load(Ordering::Relaxed)
    }

    /// The egress IP whose blocks these are.
    pub fn egress(&self) -> A {
        self.egress
    }

    /// The configuration it applies.
    pub fn config(&self) -> PortBlocks {
        PortBlocks {
            size: self.size,
            max_per_pod: self.max_per_pod(),
            log_sessions: self.log_sessions.load(Ordering::Relaxed),
        }
    }

    /// The range it was made over.
    pub fn range(&self) -> PortRange {
        self.range
    }

    /// Blocks in all.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// Whether it has no block (never, once validated).
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// Blocks held now.
    pub fn taken(&self) -> u32 {
        self.taken.load(Ordering::Relaxed)
    }

    /// Pods holding at least one block now.
    pub fn pods(&self) -> usize {
        self.held.len()
    }

    /// How many times no block was free.
    pub fn exhausted(&self) -> u64 {
        self.exhausted.load(Ordering::Relaxed)
    }

    /// How many times a pod at `maxPerPod` found no free port in its blocks.
    pub fn pod_limit_hits(&self) -> u64 {
        self.pod_limit.load(Ordering::Relaxed)
    }

    /// First and last port of block number `b`.
    pub fn bounds(&self, b: u16) -> (u16, u16) {
        let start = u32::from(b) << self.shift;
        (start as u16, (start + u32::from(self.size) - 1) as u16)
    }

    /// The block number of `port` and its cell, when `port` is in a block.
    fn cell(&self, port: u16) -> Option<(u16, &Mutex<Cell<A>>)> {
        let b = u32::from(port) >> self.shift;
        let cell = self.cells.get(b.checked_sub(self.first)? as usize)?;
        Some((b as u16, cell))
    }

    /// The blocks `pod` holds, as first ports, in the order taken.
    pub fn blocks_of(&self, pod: A) -> Vec<u16> {
        self.held.get(&pod).map_or_else(Vec::new, |h| h.as_slice().iter().map(|b| self.bounds(*b).0).collect())
    }

    /// Sessions counted in the block of `port`, and its holder.
    pub fn holder(&self, port: u16) -> Option<(A, u32)> {
        let (_, cell) = self.cell(port)?;
        let c = *cell.lock();
        c.taken.then_some((c.pod, c.sessions))
    }

    /// Counts one more session of `pod` in the block of `port`, if `pod`
    /// holds it.
    pub fn join(&self, pod: A, port: u16) -> bool {
        let Some((_, cell)) = self.cell(port) else { return false };
        let mut c = cell.lock();
        if c.taken && c.pod == pod {
            c.sessions = c.sessions.saturating_add(1);
            return true;
        }
        false
    }

    /// Counts one session of `pod` fewer in the block of `port`; the last
    /// one frees the block and, with `log`, pushes its release record.
    /// Returns whether the block was freed.
    pub fn leave(&self, pod: A, port: u16, log: Option<LogTo<'_>>) -> bool {
        let Some((b, cell)) = self.cell(port) else { return false };
        {
            let mut c = cell.lock();
            if !c.taken || c.pod != pod || c.sessions == 0 {
                return false;
            }
            c.sessions -= 1;
            if c.sessions != 0 {
                return false;
            }
            c.taken = false;
        }
        self.taken.fetch_sub(1, Ordering::Relaxed);
        if let dashmap::Entry::Occupied(mut o) = self.held.entry(pod) {
            let h = o.get_mut();
            if let Some(i) = h.as_slice().iter().position(|x| *x == b) {
                h.blocks.copy_within(i + 1..usize::from(h.n), i);
                h.n -= 1;
            }
            if h.n == 0 {
                o.remove();
            }
        }
        self.log(LogKind::BlockFree, pod, b, log);
        true
    }

    fn log(&self, kind: LogKind, pod: A, b: u16, log: Option<LogTo<'_>>) {
        if let Some(l) = log {
            let (start, end) = self.bounds(b);
            l.push(LogRecord::block(kind, &pod, &self.egress, start, end, self.size, l.now_ms));
        }
    }

    /// Counts one more session of `pod` in its block `b` and gives it the
    /// block's next port (its cursor moves on), if `pod` holds `b`.
    fn join_next(&self, pod: A, b: u16) -> Option<u16> {
        let mut c = self.cells.get((u32::from(b).checked_sub(self.first))? as usize)?.lock();
        if !(c.taken && c.pod == pod) {
            return None;
        }
        c.sessions = c.sessions.saturating_add(1);
        let off = c.next;
        c.next = (off + 1) & (self.size - 1);
        Some(self.bounds(b).0 + off)
    }

    /// Takes the free block of cell `i` for `pod`, counting one session
    /// (the allocation in progress), its cursor at `next`, unless the pod
    /// is at its limit.
    fn take(&self, pod: A, i: usize, next: u16, log: Option<LogTo<'_>>) -> Result<Option<u16>, BlockRefusal> {
        {
            let mut c = self.cells[i].lock();
            if c.taken {
                return Ok(None);
            }
            *c = Cell { pod, sessions: 1, taken: true, next };
        }
        let b = (self.first + i as u32) as u16;
        let mut h = self.held.entry(pod).or_insert(Held::EMPTY);
        if u16::from(h.n) >= self.max_per_pod() {
            drop(h);
            // Another worker took the pod's last block meanwhile: give this one back.
            self.cells[i].lock().taken = false;
            return Err(BlockRefusal::PodLimit);
        }
        let n = usize::from(h.n);
        h.blocks[n] = b;
        h.n += 1;
        drop(h);
        self.taken.fetch_add(1, Ordering::Relaxed);
        self.log(LogKind::BlockAllocate, pod, b, log);
        Ok(Some(b))
    }

    /// Finds a port for a new session of `pod`: each of its blocks' next
    /// port (newest block first), then up to 256 ports of its blocks in
    /// turn, then a new block's ports (at most `attempts` of them, from a
    /// random offset). `try_port` claims a port (try-insert) and says what
    /// it made. On success the session is counted in its block (the
    /// caller gives it back with [`BlockPool::leave`] if the session is
    /// not made after all). A new block is logged when taken, and freed
    /// (and logged) again if none of its ports could be claimed.
    pub fn allocate<T>(
        &self,
        pod: A,
        attempts: u32,
        rng: &mut PortRng,
        log: Option<LogTo<'_>>,
        mut try_port: impl FnMut(u16) -> Option<T>,
    ) -> Result<T, BlockRefusal> {
        let held = self.held.get(&pod).map_or(Held::EMPTY, |h| *h);
        if held.n != 0 {
            if let Some(t) = self.in_held(pod, &held, log, &mut try_port) {
                return Ok(t);
            }
            if u16::from(held.n) >= self.max_per_pod() {
                self.pod_limit.fetch_add(1, Ordering::Relaxed);
                return Err(BlockRefusal::PodLimit);
            }
        }
        self.in_new_block(pod, attempts, rng, log, try_port)
    }

    /// A port in the blocks `pod` holds: one try at each block's cursor,
    /// newest block first (a block still filling answers at once), then
    /// the blocks' ports in turn, at most [`SCAN_BUDGET`] of them, before
    /// the caller takes another block.
    fn in_held<T>(
        &self,
        pod: A,
        held: &Held,
        log: Option<LogTo<'_>>,
        try_port: &mut impl FnMut(u16) -> Option<T>,
    ) -> Option<T> {
        let mut tries = held
            .as_slice()
            .iter()
            .rev()
            .map(|b| (*b, 1))
            .chain(held.as_slice().iter().rev().map(|b| (*b, u32::from(self.size))));
        let mut budget = SCAN_BUDGET;
        tries.find_map(|(b, n)| {
            for _ in 0..n.min(budget) {
                budget -= 1;
                // Not the pod's any more (freed meanwhile): its next block.
                let port = self.join_next(pod, b)?;
                if let Some(t) = try_port(port) {
                    return Some(t);
                }
                self.leave(pod, port, log);
            }
            None
        })
    }

    /// A port in a free block, taken for `pod` from a random one on:
    /// `attempts` of its ports from a random offset.
    fn in_new_block<T>(
        &self,
        pod: A,
        attempts: u32,
        rng: &mut PortRng,
        log: Option<LogTo<'_>>,
        mut try_port: impl FnMut(u16) -> Option<T>,
    ) -> Result<T, BlockRefusal> {
        let n = self.cells.len();
        let start = (((rng.next_u64() >> 32) * n as u64) >> 32) as usize;
        let size = self.size;
        let off = (rng.next_u64() >> 32) as u16 & (size - 1);
        for k in 0..n {
            let i = (start + k) % n;
            if self.cells[i].lock().taken {
                continue;
            }
            // The cursor past the first try, which usually succeeds.
            let b = match self.take(pod, i, (off + 1) & (size - 1), log) {
                Ok(Some(b)) => b,
                Ok(None) => continue,
                Err(e) => {
                    self.pod_limit.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            };
            let first = self.bounds(b).0;
            for j in 0..attempts.min(u32::from(size)) as u16 {
                let port = first + ((off + j) & (size - 1));
                if let Some(t) = try_port(port) {
                    return Ok(t);
                }
            }
            self.leave(pod, first, log);
            break;
        }
        self.exhausted.fetch_add(1, Ordering::Relaxed);
        Err(BlockRefusal::Exhausted)
    }

    /// Counts a session imported with exactly `port` (a take-over,
    /// nat/sync.rs): joins the pod's block, or takes the block for the pod
    /// when it is free (logging nothing: the old holder logged the
    /// allocation; the release is logged here).
    pub fn claim_exact(&self, pod: A, port: u16) -> Result<(), BlockClaimError> {
        let Some((b, _)) = self.cell(port) else { return Err(BlockClaimError::Outside) };
        loop {
            if self.join(pod, port) {
                return Ok(());
            }
            match self.take(pod, (u32::from(b) - self.first) as usize, 0, None) {
                // Taken for the pod, its one session counted.
                Ok(Some(_)) => return Ok(()),
                Ok(None) => {
                    if self.holder(port).is_some_and(|(p, _)| p != pod) {
                        return Err(BlockClaimError::Taken);
                    }
                    // Freed or taken by the pod meanwhile: once more.
                }
                Err(_) => return Err(BlockClaimError::PodLimit),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::stats::WorkerStats;
    use crate::translog::LogRing;

    const E: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
    const POD: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
    const POD2: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);

    fn cfg(size: u16, max_per_pod: u16) -> PortBlocks {
        PortBlocks { size, max_per_pod, log_sessions: false }
    }

    #[test]
    fn validation_names_the_field_and_the_value() {
        let r = PortRange::default();
        assert_eq!(cfg(128, 8).validate(r), Ok(()));
        assert_eq!(cfg(100, 8).validate(r).unwrap_err().field, "size");
        assert_eq!(cfg(4, 8).validate(r).unwrap_err().value, 4);
        let small = PortRange { first: 1000, last: 1100 };
        assert_eq!(cfg(128, 8).validate(small).unwrap_err().field, "size", "no aligned block of 128 in 1000-1100");
        assert_eq!(cfg(64, 8).validate(small), Ok(()), "1024-1087 fits");
        assert_eq!(cfg(64, 0).validate(small).unwrap_err().field, "maxPerPod");
        assert_eq!(cfg(64, 33).validate(small).unwrap_err().value, 33);
    }

    #[test]
    fn blocks_are_aligned_and_inside_the_range() {
        // 32768-60999: 220 whole blocks of 128, the last ending at 60927.
        assert_eq!(cfg(128, 1).blocks_in(PortRange::default()), (256, 220));
        let p = BlockPool::new(E, cfg(128, 1), PortRange::default());
        assert_eq!(p.len(), 220);
        assert_eq!(p.bounds(256), (32768, 32895));
        assert_eq!(p.bounds(475), (60800, 60927));
        let mut rng = PortRng::new(3);
        for pod in 0..220u32 {
            let pod = Ipv4Addr::from(0x0a00_0000 + pod);
            let port = p.allocate(pod, 4, &mut rng, None, Some).unwrap();
            let start = p.blocks_of(pod)[0];
            assert_eq!(start % 128, 0, "aligned");
            assert!((start..=start + 127).contains(&port));
            assert!(PortRange::default().contains(start) && PortRange::default().contains(start + 127));
        }
        assert_eq!(p.allocate(POD, 4, &mut rng, None, Some), Err(BlockRefusal::Exhausted));
        assert_eq!((p.taken(), p.exhausted()), (220, 1));
    }

    #[test]
    fn later_sessions_use_the_pods_block_then_a_new_one_up_to_the_limit() {
        let p = BlockPool::new(E, cfg(8, 2), PortRange { first: 1024, last: 2047 });
        let mut rng = PortRng::new(9);
        let mut used = std::collections::HashSet::new();
        // Claiming a port succeeds once per port (one protocol's reverse table).
        let mut claim = |port: u16| used.insert(port).then_some(port);
        let mut ports = Vec::new();
        for _ in 0..16 {
            ports.push(p.allocate(POD, 64, &mut rng, None, &mut claim).unwrap());
        }
        let blocks = p.blocks_of(POD);
        assert_eq!(blocks.len(), 2, "8 ports each: two blocks for 16 sessions");
        assert!(ports.iter().all(|x| blocks.iter().any(|b| (*b..*b + 8).contains(x))));
        assert_eq!(p.allocate(POD, 64, &mut rng, None, &mut claim), Err(BlockRefusal::PodLimit));
        assert_eq!(p.pod_limit_hits(), 1);
        // Another pod is not refused: it takes a block of its own.
        let other = p.allocate(POD2, 64, &mut rng, None, &mut claim).unwrap();
        assert!(!blocks.iter().any(|b| (*b..*b + 8).contains(&other)));
        assert_eq!(p.taken(), 3);
    }

    #[test]
    fn the_last_session_frees_the_block_and_logs_both_ends() {
        let p = BlockPool::new(E, cfg(16, 4), PortRange { first: 1024, last: 2047 });
        let ring = LogRing::new(16);
        let stats = WorkerStats::default();
        let log = Some(LogTo { ring: &ring, stats: &stats, now_ms: 7 });
        let mut rng = PortRng::new(1);
        let a = p.allocate(POD, 8, &mut rng, log, Some).unwrap();
        let b = p.allocate(POD, 8, &mut rng, log, |x| (x != a).then_some(x)).unwrap();
        assert_eq!(p.blocks_of(POD).len(), 1);
        let start = p.blocks_of(POD)[0];
        assert_eq!(p.holder(a), Some((POD, 2)));
        let r = ring.pop().unwrap();
        assert_eq!(r.kind(), Some(LogKind::BlockAllocate));
        assert_eq!((r.egress_port, r.remote_port, r.aux, r.time_ms), (start, start + 15, 16, 7));
        assert_eq!((&r.pod[..4], &r.egress[..4]), (&[192, 0, 2, 10][..], &[198, 51, 100, 1][..]));
        assert!(ring.pop().is_none(), "one record for two sessions");
        assert!(!p.leave(POD2, a, log), "not the holder");
        assert!(!p.leave(POD, a, log));
        assert!(p.leave(POD, b, log), "the last session");
        assert!(!p.leave(POD, b, log), "already free");
        let r = ring.pop().unwrap();
        assert_eq!((r.kind(), r.egress_port, r.remote_port), (Some(LogKind::BlockFree), start, start + 15));
        assert_eq!((p.taken(), p.blocks_of(POD).len(), p.holder(a)), (0, 0, None));
        // The freed block can go to another pod.
        assert!(p.claim_exact(POD2, a).is_ok());
        assert_eq!(p.holder(a), Some((POD2, 1)));
    }

    #[test]
    fn a_block_gives_its_ports_in_turn_and_its_oldest_port_again_first() {
        let p = BlockPool::new(E, cfg(16, 1), PortRange { first: 1024, last: 2047 });
        let mut rng = PortRng::new(4);
        let used = std::cell::RefCell::new(std::collections::HashSet::new());
        let tries = std::cell::Cell::new(0u32);
        let claim = |port: u16| {
            tries.set(tries.get() + 1);
            used.borrow_mut().insert(port).then_some(port)
        };
        let ports: Vec<u16> = (0..16).map(|_| p.allocate(POD, 8, &mut rng, None, claim).unwrap()).collect();
        assert_eq!(tries.get(), 16, "one try per session while the block fills");
        let start = p.blocks_of(POD)[0];
        for w in ports.windows(2) {
            assert_eq!(w[1], start + ((w[0] - start + 1) % 16), "in turn: {ports:?}");
        }
        // The oldest session ends: its port is the next one tried.
        let oldest = ports[0];
        used.borrow_mut().remove(&oldest);
        assert!(!p.leave(POD, oldest, None));
        tries.set(0);
        assert_eq!(p.allocate(POD, 8, &mut rng, None, claim), Ok(oldest));
        assert_eq!(tries.get(), 1);
        // Full, one block at most: every port tried once more, then refused.
        tries.set(0);
        assert_eq!(p.allocate(POD, 8, &mut rng, None, claim), Err(BlockRefusal::PodLimit));
        assert_eq!(tries.get(), 17, "the cursor, then the block's 16 ports");
        assert_eq!(p.holder(start), Some((POD, 16)), "the refused tries counted nothing");
    }

    #[test]
    fn the_last_free_port_of_a_block_is_found_before_another_block_is_taken() {
        let p = BlockPool::new(E, cfg(128, 4), PortRange { first: 1024, last: 4095 });
        let mut rng = PortRng::new(2);
        let first = p.allocate(POD, 64, &mut rng, None, Some).unwrap();
        let start = p.blocks_of(POD)[0];
        // Every port of the block taken but one: the scan finds it.
        let last_free = start + 77;
        let port = p.allocate(POD, 4, &mut rng, None, |x| (x == last_free && x != first).then_some(x)).unwrap();
        assert_eq!(port, last_free);
        assert_eq!(p.blocks_of(POD), vec![start], "no second block");
    }

    #[test]
    fn a_new_block_whose_ports_are_all_taken_is_given_back() {
        let p = BlockPool::new(E, cfg(8, 2), PortRange { first: 1024, last: 1031 });
        let mut rng = PortRng::new(1);
        assert_eq!(p.allocate(POD, 64, &mut rng, None, |_| None::<u16>), Err(BlockRefusal::Exhausted));
        assert_eq!((p.taken(), p.blocks_of(POD).len()), (0, 0));
        assert!(p.allocate(POD2, 64, &mut rng, None, Some).is_ok());
    }

    #[test]
    fn an_imported_session_marks_its_block_as_the_pods() {
        let p = BlockPool::new(E, cfg(8, 1), PortRange { first: 1024, last: 2047 });
        assert_eq!(p.claim_exact(POD, 1030), Ok(()));
        assert_eq!(p.blocks_of(POD), vec![1024]);
        assert_eq!(p.claim_exact(POD, 1025), Ok(()), "the same block");
        assert_eq!(p.holder(1024), Some((POD, 2)));
        assert_eq!(p.claim_exact(POD2, 1027), Err(BlockClaimError::Taken));
        assert_eq!(p.claim_exact(POD, 1040), Err(BlockClaimError::PodLimit), "one block per pod");
        assert_eq!(p.claim_exact(POD, 80), Err(BlockClaimError::Outside));
        // A new session of the pod lands in the imported block.
        let mut rng = PortRng::new(5);
        let port = p.allocate(POD, 64, &mut rng, None, |x| (x != 1030 && x != 1025).then_some(x)).unwrap();
        assert!((1024..1032).contains(&port));
        assert!(!p.leave(POD, 1030, None) && !p.leave(POD, 1025, None) && p.leave(POD, port, None));
        assert_eq!(p.taken(), 0);
    }
}
