//! The worker loop: one thread per RX queue, driving that queue's AF_XDP
//! sockets (one per interface, all sharing one UMEM) through a
//! [`FrameHandler`] (the NAT engine, or a test handler).
//!
//! One iteration:
//!
//! ```text
//!  reclaim completions (every port) -> frames back to the pool
//!  for each port: room = min free TX slots over all ports
//!       room == 0 -> hold RX (backpressure: frames wait in the RX ring)
//!       else take up to min(batch, room) frames, lend them to
//!            handler.handle_batch() (worker/frames.rs), which says for each:
//!            Transmit -> stage on the chosen port's TX ring (same UMEM: no copy)
//!            Drop     -> frame back to the pool
//!            Consumed -> frame back to the pool (its packet went to the kernel)
//!            Hold     -> once the batch is handled, the frame waits in the
//!                        hold queue of its next hop (or its datagram)
//!  held frames: past the timeout -> pool (counted); then, oldest first per
//!       next hop and within TX room, handler.release() each: sent, dropped,
//!       or left waiting (that next hop's later frames wait behind it)
//!  flush TX on every port: publish, sendto() kick while TX is not empty
//!  top up every fill ring to its target from the pool (short: counted)
//!  handler.tick(now); sample XDP_STATISTICS every `kernel_stats_interval`
//!  nothing moved -> block in poll() (short timeout while TX is draining)
//! ```
//!
//! Taking at most as many frames as every TX ring can take means a transmit
//! never meets a full ring: backpressure holds frames in the kernel's RX
//! ring instead (where overflow is the kernel's counted `rx_ring_full` drop).
//! No allocation and no logging per packet; counters are single-writer
//! atomics readable from any thread.
//!
//! ## Frames waiting for a next hop
//!
//! A frame whose next hop has no MAC yet is not dropped: like the kernel,
//! which queues packets on an incomplete neighbour (`neigh_event_send`,
//! `unres_qlen_bytes` per neighbour, the oldest dropped when full and
//! counted `unres_discards`), the worker keeps it in a [`HoldQueue`]: FIFO
//! per next hop, bounded per next hop and per worker (each waiting frame is
//! a UMEM frame the fill rings do without), and released after
//! [`WorkerConfig::hold_timeout`] (the kernel gives up after about 3 s of
//! probes, `mcast_solicit` x `retrans_time`). While frames wait the worker
//! polls at most every [`HOLD_POLL`], so a resolution is seen within that.
//!
//! ## Fragments waiting for their first fragment
//!
//! A datagram's later fragments carry no ports: only its first fragment can
//! be matched to a session (nat/fragments.rs). One that arrives before its
//! first fragment (RFC 4787 REQ-14: a NAT must accept fragments out of
//! order) is held the same way, keyed by the datagram, in one of two
//! queues: fragments from the outside and fragments from pods, so that a
//! flood of orphan fragments sent to an egress IP cannot displace a pod's
//! held fragments. Each is bounded per datagram, per source and in all, the
//! oldest displaced first, and a fragment whose first fragment has not come
//! within [`WorkerConfig::fragment_hold_timeout`] is dropped. The handler is
//! offered the held fragments at most every [`FRAGMENT_RETRY`] (its first
//! fragment may reach another worker: the translation is found in the shared
//! fragment cache).

use std::collections::VecDeque;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::xsk::{sched, sys, Frame, TxRefused, XskPorts};

mod frames;

pub use crate::xsk::PortId;
pub use frames::Frames;

/// Where a frame came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RxInfo {
    /// Index of the interface among the worker's ports.
    pub port: PortId,
    /// The RX queue (the same for every port of a worker).
    pub queue: u32,
}

/// What to do with a handled frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Send `buf[..len]` out of `port`.
    Transmit { port: PortId, len: usize },
    /// Return the frame to the pool.
    Drop,
    /// The handler used the frame's contents itself (handed them to the
    /// kernel): return it to the pool, not counted as dropped.
    Consumed,
    /// Keep `buf[..len]` until its next hop `key` resolves
    /// ([`FrameHandler::release`]), or it times out.
    Hold { key: HoldKey, len: usize },
}

/// What a held frame waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldKey {
    /// A next hop's link-layer address: (interface index, next-hop address).
    NextHop(u32, IpAddr),
    /// The first fragment of a datagram whose later fragment this is.
    Datagram(Datagram),
}

impl HoldKey {
    /// The sender whose frames one per-source bound covers (none for next hops).
    fn source(&self) -> Option<IpAddr> {
        match self {
            HoldKey::NextHop(..) => None,
            HoldKey::Datagram(d) => Some(d.src),
        }
    }
}

/// A fragmented datagram as it arrived: its fragment identity (RFC 791's
/// source, destination, protocol and identification; RFC 8200's source,
/// destination and identification) and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Datagram {
    /// The receiving interface.
    pub ifindex: u32,
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IPv4 identification or the IPv6 fragment header's.
    pub ident: u32,
    /// Transport protocol.
    pub proto: u8,
    /// Sent from the outside (to an egress IP), not by a pod.
    pub from_outside: bool,
}

/// What happened to frames in the hold queue, for the handler to count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldEvent {
    /// A frame was queued.
    Queued,
    /// A frame was dropped to make room (the oldest of its next hop, or of
    /// the worker when every queue together is full).
    Overflow,
    /// A frame waited longer than the timeout and was dropped.
    Expired,
}

/// The per-frame logic the worker drives.
pub trait FrameHandler {
    /// `buf` is the whole UMEM frame (capacity), the frame occupies buf[..len].
    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, now: Instant) -> Action;
    /// Called once per loop iteration (after a batch or a poll timeout) for periodic work.
    fn tick(&mut self, _now: Instant) {}
    /// A frame held with [`Action::Hold`] for `key`, offered again: write
    /// what it lacked (the MACs) and say what to do with it now, as for a
    /// received frame, or `None` to keep it (and the frames behind it)
    /// waiting. A next hop's frame held again ([`Action::Hold`]) goes back
    /// to the pool instead. The default drops it.
    fn release(&mut self, _key: HoldKey, _buf: &mut [u8], _len: usize, _now: Instant) -> Option<Action> {
        Some(Action::Drop)
    }
    /// Counts what happened to a frame held for `key`.
    fn held(&mut self, _key: HoldKey, _event: HoldEvent) {}
    /// A batch of received frames, in order: each is to be handled
    /// ([`Frames::handle`]) as by [`handle`](Self::handle). A handler that
    /// can do a batch's set-up once (the engine's [`crate::engine::Batch`])
    /// or look at frames ahead ([`Frames::peek`], to stage them) does it
    /// here. Frames left unhandled go to [`handle`](Self::handle) one by
    /// one, as the default sends them all.
    fn handle_batch(&mut self, frames: &mut Frames<'_>) {
        let (rx, now) = (frames.rx(), frames.now());
        frames.handle(usize::MAX, |buf, len| self.handle(buf, len, rx, now));
    }
    /// Frames to send that were not received (gratuitous ARP, unsolicited
    /// neighbour advertisements). Called once per iteration before TX is
    /// flushed; the default sends nothing.
    fn inject(&mut self, _tx: &mut Injector<'_>) {}
}

/// Lets a [`FrameHandler`] send new frames on the worker's ports.
#[derive(Debug)]
pub struct Injector<'a> {
    ports: &'a mut XskPorts,
    sent: u64,
    refused: u64,
}

impl Injector<'_> {
    /// Number of ports.
    pub fn ports(&self) -> usize {
        self.ports.len()
    }

    /// The interface index of `port`.
    pub fn ifindex(&self, port: PortId) -> Option<u32> {
        self.ports.socket(port).map(|s| s.ifindex())
    }

    /// Writes a new frame with `write` (which returns its length) and stages
    /// it on `port`. Returns false, counted, when there is no such port, no
    /// TX room, no free frame, or the length is 0 or too long.
    pub fn send(&mut self, port: PortId, write: impl FnOnce(&mut [u8]) -> usize) -> bool {
        match self.ports.transmit_new(port, write) {
            Ok(()) => {
                self.sent += 1;
                true
            }
            Err(_) => {
                self.refused += 1;
                false
            }
        }
    }
}

/// Worker tuning and thread placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerConfig {
    /// Frames taken from one RX ring per iteration (at most 64 is typical).
    pub batch_size: usize,
    /// How long to block in poll() when idle.
    pub poll_timeout: Duration,
    /// How long to block when idle but TX is still draining (copy-mode TX
    /// only moves on kicks, so the loop must come back soon).
    pub drain_timeout: Duration,
    /// Pin the worker thread to this CPU.
    pub cpu: Option<usize>,
    /// Run the worker `SCHED_FIFO` at this priority (50 in production).
    pub realtime_priority: Option<i32>,
    /// How often to sample the kernel's `XDP_STATISTICS`.
    pub kernel_stats_interval: Duration,
    /// Frames held per unresolved next hop (the oldest goes when full).
    pub hold_per_next_hop: usize,
    /// Frames held by the worker in all (at most an eighth of its UMEM).
    pub hold_total: usize,
    /// How long a frame may wait for its next hop.
    pub hold_timeout: Duration,
    /// Later fragments held per datagram, waiting for its first fragment.
    pub fragment_hold_per_datagram: usize,
    /// Fragments held per source address.
    pub fragment_hold_per_source: usize,
    /// Fragments held in all, in each of the two queues (from the outside,
    /// from pods); together at most a sixteenth of the worker's UMEM.
    pub fragment_hold_total: usize,
    /// How long a later fragment may wait for its first fragment.
    pub fragment_hold_timeout: Duration,
}

/// The longest the worker blocks in poll() while frames are held.
pub const HOLD_POLL: Duration = Duration::from_millis(5);

/// Held fragments are offered to the handler at most this often (each offer
/// processes every held fragment again: parsed, then looked up in
/// the fragment cache).
pub const FRAGMENT_RETRY: Duration = Duration::from_millis(1);

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            batch_size: 64,
            poll_timeout: Duration::from_millis(100),
            drain_timeout: Duration::from_millis(1),
            cpu: None,
            realtime_priority: None,
            kernel_stats_interval: Duration::from_secs(1),
            hold_per_next_hop: 32,
            hold_total: 256,
            hold_timeout: Duration::from_secs(3),
            // A 9,000-byte datagram is 7 fragments at a 1,500-byte MTU.
            fragment_hold_per_datagram: 16,
            fragment_hold_per_source: 32,
            fragment_hold_total: 128,
            // Reordering takes micro- to milliseconds; a first fragment
            // later than this was lost (VPP's virtual reassembly gives up
            // after 100 ms, Linux's full reassembly after 30 s).
            fragment_hold_timeout: Duration::from_secs(1),
        }
    }
}

/// A held item, its frame length and when it was held.
type Held<T> = (T, usize, Instant);

/// Held frames: FIFO per key, at most `per_key` per key, `per_source` per
/// sending address (datagram keys) and `total` in all; the oldest is
/// displaced when a bound is reached (of the key, of the source, of all).
/// Generic over the item so it is tested without a UMEM.
#[derive(Debug)]
pub struct HoldQueue<T> {
    per_key: usize,
    per_source: usize,
    total: usize,
    timeout: Duration,
    /// Few keys at a time (next hops being resolved): a vector.
    queues: Vec<(HoldKey, VecDeque<Held<T>>)>,
    len: usize,
}

impl<T> HoldQueue<T> {
    /// A queue holding at most `per_key` items per key and `total` in all,
    /// each for at most `timeout`.
    pub fn new(per_key: usize, total: usize, timeout: Duration) -> Self {
        Self { per_key, per_source: usize::MAX, total, timeout, queues: Vec::new(), len: 0 }
    }

    /// The same, with at most `per_source` items of keys with one source.
    pub fn with_per_source(mut self, per_source: usize) -> Self {
        self.per_source = per_source;
        self
    }

    /// The index of the queue whose head is the oldest among those `which` selects.
    fn oldest(&self, which: impl Fn(&HoldKey) -> bool) -> Option<usize> {
        self.queues
            .iter()
            .enumerate()
            .filter(|(_, (k, _))| which(k))
            .filter_map(|(i, (_, q))| q.front().map(|f| (f.2, i)))
            .min()
            .map(|(_, i)| i)
    }

    /// Items held for keys of `source`.
    fn of_source(&self, source: IpAddr) -> usize {
        self.queues.iter().filter(|(k, _)| k.source() == Some(source)).map(|(_, q)| q.len()).sum()
    }

    /// Items held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Holds `item` (a frame of `len` bytes) for `key`. Returns the item
    /// displaced to make room, if any: the oldest of `key` when its queue is
    /// full, else the oldest of all when every queue together is full, or
    /// `item` itself when nothing may be held.
    pub fn push(&mut self, key: HoldKey, item: T, len: usize, now: Instant) -> Option<T> {
        if self.per_key == 0 || self.total == 0 {
            return Some(item);
        }
        let mut displaced = None;
        let at = match self.queues.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.queues.push((key, VecDeque::new()));
                self.queues.len() - 1
            }
        };
        let source = key.source();
        let victim = if self.queues.get(at).is_some_and(|(_, q)| q.len() >= self.per_key) {
            Some(at)
        } else if source.is_some_and(|s| self.of_source(s) >= self.per_source) {
            // The oldest head of this source's queues.
            self.oldest(|k| k.source() == source)
        } else if self.len >= self.total {
            // The oldest head of all queues.
            self.oldest(|_| true)
        } else {
            None
        };
        if let Some(i) = victim {
            displaced = self.queues.get_mut(i).and_then(|(_, q)| q.pop_front()).map(|(t, _, _)| t);
        }
        if displaced.is_some() {
            self.len -= 1;
        }
        if let Some((_, q)) = self.queues.get_mut(at) {
            q.push_back((item, len, now));
            self.len += 1;
        }
        self.queues.retain(|(_, q)| !q.is_empty());
        displaced
    }

    /// Removes every item held longer than the timeout, handing each to `gone`.
    pub fn expire(&mut self, now: Instant, mut gone: impl FnMut(HoldKey, T)) {
        if self.len == 0 {
            return;
        }
        for (key, q) in &mut self.queues {
            while q.front().is_some_and(|f| now.saturating_duration_since(f.2) >= self.timeout) {
                if let Some((t, _, _)) = q.pop_front() {
                    self.len -= 1;
                    gone(*key, t);
                }
            }
        }
        self.queues.retain(|(_, q)| !q.is_empty());
    }

    /// Offers items oldest first, key by key, to `offer`, at most `budget`
    /// of them: `Ok(())` takes the item, `Err(item)` puts it back and
    /// leaves that key's later items waiting behind it. Returns how many
    /// were taken.
    pub fn release(&mut self, budget: usize, mut offer: impl FnMut(HoldKey, T, usize) -> Result<(), T>) -> usize {
        let mut taken = 0;
        for (key, q) in &mut self.queues {
            while taken < budget {
                let Some((t, len, since)) = q.pop_front() else { break };
                match offer(*key, t, len) {
                    Ok(()) => {
                        taken += 1;
                        self.len -= 1;
                    }
                    Err(t) => {
                        q.push_front((t, len, since));
                        break;
                    }
                }
            }
        }
        self.queues.retain(|(_, q)| !q.is_empty());
        taken
    }

    /// Removes everything held, handing each item to `gone`.
    pub fn clear(&mut self, mut gone: impl FnMut(T)) {
        for (_, q) in self.queues.drain(..) {
            q.into_iter().for_each(|(t, _, _)| gone(t));
        }
        self.len = 0;
    }
}

/// Worker counters: written by the worker thread only, read by anyone.
#[derive(Debug, Default)]
pub struct LoopStats {
    /// Loop iterations.
    pub iterations: AtomicU64,
    /// Times the worker blocked in poll().
    pub idle_polls: AtomicU64,
    /// Frames handed to the handler.
    pub rx_frames: AtomicU64,
    /// Frames queued for TX.
    pub tx_frames: AtomicU64,
    /// Frames the handler dropped.
    pub dropped: AtomicU64,
    /// Transmit actions naming a port the worker does not have.
    pub bad_port: AtomicU64,
    /// Transmit actions with length 0 or beyond the frame's capacity.
    pub bad_length: AtomicU64,
    /// Transmits that met a full TX ring (should stay 0: RX is sized to fit).
    pub tx_refused_full: AtomicU64,
    /// Times RX was held back because a TX ring had no room.
    pub backpressure: AtomicU64,
    /// Frames the handler injected ([`FrameHandler::inject`]).
    pub injected: AtomicU64,
    /// Injections refused (no room, no free frame, bad port or length).
    pub inject_refused: AtomicU64,
}

/// A plain copy of [`LoopStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopStatsSnapshot {
    pub iterations: u64,
    pub idle_polls: u64,
    pub rx_frames: u64,
    pub tx_frames: u64,
    pub dropped: u64,
    pub bad_port: u64,
    pub bad_length: u64,
    pub tx_refused_full: u64,
    pub backpressure: u64,
    pub injected: u64,
    pub inject_refused: u64,
}

impl LoopStats {
    /// Read every counter.
    pub fn snapshot(&self) -> LoopStatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LoopStatsSnapshot {
            iterations: l(&self.iterations),
            idle_polls: l(&self.idle_polls),
            rx_frames: l(&self.rx_frames),
            tx_frames: l(&self.tx_frames),
            dropped: l(&self.dropped),
            bad_port: l(&self.bad_port),
            bad_length: l(&self.bad_length),
            tx_refused_full: l(&self.tx_refused_full),
            backpressure: l(&self.backpressure),
            injected: l(&self.injected),
            inject_refused: l(&self.inject_refused),
        }
    }
}

#[inline]
fn bump(c: &AtomicU64, n: u64) {
    // Single writer: a relaxed load and store, no locked instruction.
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Stages `frame` on `port`'s TX ring; a refusal returns it to the pool,
/// counted. Whether it was staged.
fn transmit(ports: &mut XskPorts, stats: &LoopStats, port: PortId, frame: Frame, len: usize) -> bool {
    match ports.transmit(port, frame, len) {
        Ok(()) => true,
        Err((frame, why)) => {
            ports.recycle(frame);
            let c = match why {
                TxRefused::NoSuchPort => &stats.bad_port,
                TxRefused::BadLength => &stats.bad_length,
                TxRefused::RingFull | TxRefused::NoFreeFrame => &stats.tx_refused_full,
            };
            bump(c, 1);
            false
        }
    }
}

/// Holds `frame` for `key` in its queue: next hops in `held`, fragments in
/// `fragments` (from pods, from the outside); a displaced frame goes back to
/// the pool. Both counted by the handler.
#[allow(clippy::too_many_arguments)]
fn hold<H: FrameHandler>(
    held: &mut HoldQueue<Frame>,
    fragments: &mut [HoldQueue<Frame>; 2],
    ports: &mut XskPorts,
    handler: &mut H,
    key: HoldKey,
    frame: Frame,
    len: usize,
    now: Instant,
) {
    let queue = match key {
        HoldKey::NextHop(..) => held,
        HoldKey::Datagram(d) => &mut fragments[usize::from(d.from_outside)],
    };
    if let Some(old) = queue.push(key, frame, len, now) {
        ports.recycle(old);
        handler.held(key, HoldEvent::Overflow);
    }
    handler.held(key, HoldEvent::Queued);
}

/// What stopped a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("poll() on {sockets} AF_XDP sockets failed: {source}")]
    Poll { sockets: usize, source: io::Error },
    #[error("worker batch size {batch_size} must be 1..=4096")]
    BatchSize { batch_size: usize },
}

/// One worker: its ports, its handler, its stop flag.
#[derive(Debug)]
pub struct Worker<H> {
    ports: XskPorts,
    handler: H,
    config: WorkerConfig,
    stop: Arc<AtomicBool>,
    stats: Arc<LoopStats>,
    batch: Vec<Frame>,
    /// A batch's frames to hold, queued once the handler returns (frames.rs).
    to_hold: Vec<(HoldKey, Frame, usize)>,
    pollfds: Vec<libc::pollfd>,
    queues: Vec<u32>,
    last_kernel_stats: Option<Instant>,
    held: HoldQueue<Frame>,
    /// Later fragments waiting for their first: from pods, from the outside.
    fragments: [HoldQueue<Frame>; 2],
    fragments_offered: Option<Instant>,
}

impl<H: FrameHandler> Worker<H> {
    /// A worker over `ports`; it runs until `stop` is set.
    pub fn new(ports: XskPorts, handler: H, config: WorkerConfig, stop: Arc<AtomicBool>) -> Result<Self, WorkerError> {
        if config.batch_size == 0 || config.batch_size > 4096 {
            return Err(WorkerError::BatchSize { batch_size: config.batch_size });
        }
        let pollfds = ports
            .sockets()
            .map(|s| libc::pollfd { fd: std::os::fd::AsRawFd::as_raw_fd(s), events: 0, revents: 0 })
            .collect();
        let queues = ports.sockets().map(|s| s.queue()).collect();
        // Held frames are UMEM frames the fill rings do without: at most an eighth.
        let hold_total = config.hold_total.min(ports.frames_total() as usize / 8);
        let held = HoldQueue::new(config.hold_per_next_hop, hold_total, config.hold_timeout);
        let fragment_total = config.fragment_hold_total.min(ports.frames_total() as usize / 32);
        let fragments = [(); 2].map(|_| {
            HoldQueue::new(config.fragment_hold_per_datagram, fragment_total, config.fragment_hold_timeout)
                .with_per_source(config.fragment_hold_per_source)
        });
        Ok(Self {
            ports,
            handler,
            config,
            stop,
            stats: Arc::default(),
            batch: Vec::with_capacity(config.batch_size),
            to_hold: Vec::with_capacity(config.batch_size),
            pollfds,
            queues,
            last_kernel_stats: None,
            held,
            fragments,
            fragments_offered: None,
        })
    }

    /// The worker's counters, shareable with other threads.
    pub fn stats(&self) -> Arc<LoopStats> {
        Arc::clone(&self.stats)
    }

    /// The ports (socket fds, per-socket counters).
    pub fn ports(&self) -> &XskPorts {
        &self.ports
    }

    /// The handler.
    pub fn handler(&self) -> &H {
        &self.handler
    }

    /// Take the worker apart (after `run` returned).
    pub fn into_parts(self) -> (XskPorts, H) {
        (self.ports, self.handler)
    }

    /// Apply the configured CPU pinning and real-time priority to the calling
    /// thread. Best effort: a refusal is logged and the worker runs anyway.
    pub fn place_thread(&self) {
        if let Some(cpu) = self.config.cpu {
            if let Err(e) = sched::pin_current_thread(cpu) {
                tracing::warn!(cpu, error = %e, "could not pin the worker thread; running unpinned");
            }
        }
        if let Some(prio) = self.config.realtime_priority {
            if let Err(e) = sched::set_fifo_priority(prio) {
                tracing::warn!(
                    priority = prio,
                    error = %e,
                    "SCHED_FIFO refused; the worker and NAPI will take turns and copy-mode throughput drops"
                );
            }
        }
    }

    /// Place the thread, then loop until the stop flag is set.
    pub fn run(&mut self) -> Result<(), WorkerError> {
        self.place_thread();
        while !self.stop.load(Ordering::Acquire) {
            let now = Instant::now();
            let moved = self.run_once(now);
            if !moved {
                self.wait()?;
            }
        }
        // Leave the counters and the pool current for whoever inspects them.
        let ports = &mut self.ports;
        self.held.clear(|f| ports.recycle(f));
        for q in &mut self.fragments {
            q.clear(|f| ports.recycle(f));
        }
        for p in 0..self.ports.len() {
            self.ports.reclaim(PortId(p as u16));
        }
        self.ports.refresh_kernel_stats();
        Ok(())
    }

    /// One iteration without blocking; returns whether any frame moved
    /// (received, or completed by the kernel).
    pub fn run_once(&mut self, now: Instant) -> bool {
        bump(&self.stats.iterations, 1);
        let n = self.ports.len();
        let mut moved = false;

        for p in 0..n {
            moved |= self.ports.reclaim(PortId(p as u16)) > 0;
        }

        let batch = self.config.batch_size as u32;
        for p in 0..n {
            let port = PortId(p as u16);
            // Every frame may go out of any port: take no more than the
            // fullest TX ring can still accept.
            let mut room = batch;
            for q in 0..n {
                room = room.min(self.ports.tx_room(PortId(q as u16), batch));
            }
            if room == 0 {
                if self.ports.rx_ready(port) > 0 {
                    bump(&self.stats.backpressure, 1);
                }
                continue;
            }
            let got = self.ports.rx_burst(port, room as usize, &mut self.batch);
            if got == 0 {
                continue;
            }
            moved = true;
            // The clock is read after the frames were taken from the ring:
            // a batch that waited across a stall (a stopped process) is
            // judged at the time it is processed, not the time the loop
            // began (ownership valid-until, dataplane/src/ownership.rs).
            self.handle_batch(port, Instant::now());
        }

        if self.fragments.iter().any(|q| !q.is_empty()) {
            moved |= self.release_fragments(Instant::now()) > 0;
        }
        if !self.held.is_empty() {
            moved |= self.release_held(Instant::now()) > 0;
        }

        let mut injector = Injector { ports: &mut self.ports, sent: 0, refused: 0 };
        self.handler.inject(&mut injector);
        let (sent, refused) = (injector.sent, injector.refused);
        if sent + refused > 0 {
            bump(&self.stats.injected, sent);
            bump(&self.stats.inject_refused, refused);
            moved |= sent > 0;
        }

        for p in 0..n {
            self.ports.flush_tx(PortId(p as u16));
        }
        for p in 0..n {
            self.ports.refill(PortId(p as u16));
        }

        self.handler.tick(now);
        let due = self.last_kernel_stats.is_none_or(|t| now.duration_since(t) >= self.config.kernel_stats_interval);
        if due {
            self.ports.refresh_kernel_stats();
            self.last_kernel_stats = Some(now);
        }
        moved
    }

    fn handle_batch(&mut self, port: PortId, now: Instant) {
        let rx = RxInfo { port, queue: self.queues.get(port.index()).copied().unwrap_or(0) };
        bump(&self.stats.rx_frames, self.batch.len() as u64);
        let Self { batch, ports, handler, held, fragments, stats, to_hold, .. } = self;
        let mut frames = Frames { ports, frames: batch.drain(..), rx, now, stats, to_hold, tx: 0, dropped: 0 };
        handler.handle_batch(&mut frames);
        frames.finish(handler);
        for (key, frame, len) in to_hold.drain(..) {
            hold(held, fragments, ports, handler, key, frame, len, now);
        }
    }

    /// Held frames: those past the timeout go back to the pool, then each
    /// next hop's are offered to the handler oldest first, within the room
    /// every TX ring has. Returns how many were sent or dropped.
    fn release_held(&mut self, now: Instant) -> usize {
        let Self { held, ports, handler, stats, .. } = self;
        held.expire(now, |key, f| {
            ports.recycle(f);
            handler.held(key, HoldEvent::Expired);
        });
        let n = ports.len();
        let mut room = self.config.batch_size as u32;
        for q in 0..n {
            room = room.min(ports.tx_room(PortId(q as u16), room));
        }
        let mut tx = 0u64;
        let gone = held.release(room as usize, |key, frame, len| {
            match handler.release(key, ports.frame_mut(&frame), len, now) {
                None => Err(frame),
                // A next hop's frame is not held again for another.
                Some(Action::Drop | Action::Consumed | Action::Hold { .. }) => {
                    ports.recycle(frame);
                    Ok(())
                }
                Some(Action::Transmit { port, len }) => {
                    tx += u64::from(transmit(ports, stats, port, frame, len));
                    Ok(())
                }
            }
        });
        bump(&stats.tx_frames, tx);
        gone
    }

    /// Held fragments, at most every [`FRAGMENT_RETRY`] (not every loop
    /// iteration: under a flood of orphans the queues stay full): those past
    /// the timeout go back to the pool; then each is offered to the handler,
    /// which sends it once its datagram's first fragment has been translated
    /// (by any worker), or says to wait. Returns how many left the queues.
    fn release_fragments(&mut self, now: Instant) -> usize {
        if self.fragments_offered.is_some_and(|t| now.saturating_duration_since(t) < FRAGMENT_RETRY) {
            return 0;
        }
        self.fragments_offered = Some(now);
        let Self { held, fragments, ports, handler, stats, .. } = self;
        for q in fragments.iter_mut() {
            q.expire(now, |key, f| {
                ports.recycle(f);
                handler.held(key, HoldEvent::Expired);
            });
        }
        let mut room = self.config.batch_size as u32;
        for q in 0..ports.len() {
            room = room.min(ports.tx_room(PortId(q as u16), room));
        }
        let (mut tx, mut gone) = (0u64, 0usize);
        let mut rehold = Vec::new();
        for q in fragments.iter_mut() {
            let budget = (room as usize).saturating_sub(gone);
            gone +=
                q.release(budget, |key, frame, len| match handler.release(key, ports.frame_mut(&frame), len, now) {
                    None => Err(frame),
                    Some(Action::Drop | Action::Consumed) => {
                        ports.recycle(frame);
                        Ok(())
                    }
                    Some(Action::Hold { key, len }) => {
                        rehold.push((key, frame, len));
                        Ok(())
                    }
                    Some(Action::Transmit { port, len }) => {
                        tx += u64::from(transmit(ports, stats, port, frame, len));
                        Ok(())
                    }
                });
        }
        for (key, frame, len) in rehold {
            hold(held, fragments, ports, handler, key, frame, len, now);
        }
        bump(&stats.tx_frames, tx);
        gone
    }

    /// Block until a socket has frames (or TX room, while draining), the
    /// timeout passes, or a signal arrives.
    fn wait(&mut self) -> Result<(), WorkerError> {
        let n = self.pollfds.len();
        let mut draining = false;
        let mut room = u32::MAX;
        for p in 0..n {
            let port = PortId(p as u16);
            draining |= self.ports.tx_outstanding(port) > 0;
            room = room.min(self.ports.tx_room(port, 1));
        }
        for (p, pfd) in self.pollfds.iter_mut().enumerate() {
            // With TX room, wait for frames. Without (backpressure), wait for
            // a full TX ring to become writable (poll() also drives copy-mode
            // TX); asking for POLLOUT on a ring with room would return at
            // once and spin.
            pfd.events = if room > 0 {
                libc::POLLIN
            } else if self.ports.tx_room(PortId(p as u16), 1) == 0 {
                libc::POLLOUT
            } else {
                0
            };
            pfd.revents = 0;
        }
        let mut timeout = if draining { self.config.drain_timeout } else { self.config.poll_timeout };
        if !self.held.is_empty() || self.fragments.iter().any(|q| !q.is_empty()) {
            // Come back soon for a resolution, a first fragment or a timeout.
            timeout = timeout.min(HOLD_POLL);
        }
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        bump(&self.stats.idle_polls, 1);
        sys::poll(&mut self.pollfds, ms).map(drop).map_err(|source| WorkerError::Poll { sockets: n, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(last: u8) -> HoldKey {
        HoldKey::NextHop(2, IpAddr::from([203, 0, 113, last]))
    }

    fn datagram(src: u8, ident: u32) -> HoldKey {
        HoldKey::Datagram(Datagram {
            ifindex: 3,
            src: IpAddr::from([198, 51, 100, src]),
            dst: IpAddr::from([203, 0, 113, 10]),
            ident,
            proto: 17,
            from_outside: true,
        })
    }

    fn taken(q: &mut HoldQueue<u32>, budget: usize, ready: &[HoldKey]) -> Vec<u32> {
        let mut out = Vec::new();
        q.release(budget, |k, t, _| {
            if ready.contains(&k) {
                out.push(t);
                Ok(())
            } else {
                Err(t)
            }
        });
        out
    }

    #[test]
    fn hold_queue_keeps_order_per_next_hop_and_waits_for_resolution() {
        let t0 = Instant::now();
        let mut q = HoldQueue::new(4, 16, Duration::from_secs(3));
        for (i, k) in [(1, key(1)), (2, key(2)), (3, key(1)), (4, key(2)), (5, key(1))] {
            assert_eq!(q.push(k, i, 60, t0), None);
        }
        assert_eq!(q.len(), 5);
        assert!(taken(&mut q, 64, &[]).is_empty(), "nothing resolved: everything waits");
        assert_eq!(taken(&mut q, 64, &[key(1)]), vec![1, 3, 5], "one next hop resolved: its frames, in order");
        assert_eq!(q.len(), 2);
        assert_eq!(taken(&mut q, 1, &[key(2)]), vec![2], "within the TX budget");
        assert_eq!(taken(&mut q, 64, &[key(2)]), vec![4]);
        assert!(q.is_empty());
    }

    #[test]
    fn hold_queue_is_bounded_per_next_hop_and_in_all_dropping_the_oldest() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut q = HoldQueue::new(2, 3, Duration::from_secs(3));
        assert_eq!(q.push(key(1), 1, 60, ms(0)), None);
        assert_eq!(q.push(key(1), 2, 60, ms(1)), None);
        assert_eq!(q.push(key(1), 3, 60, ms(2)), Some(1), "next hop full: its oldest goes");
        assert_eq!(q.push(key(2), 4, 60, ms(3)), None);
        assert_eq!(q.len(), 3);
        assert_eq!(q.push(key(3), 5, 60, ms(4)), Some(2), "worker full: the oldest of all goes");
        assert_eq!(q.len(), 3);
        assert_eq!(taken(&mut q, 64, &[key(1), key(2), key(3)]), vec![3, 4, 5]);
        let mut none = HoldQueue::new(0, 8, Duration::from_secs(3));
        assert_eq!(none.push(key(1), 9, 60, t0), Some(9), "holding off: the frame is handed back");
    }

    #[test]
    fn hold_queue_bounds_each_source_so_one_sender_displaces_only_its_own() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut q = HoldQueue::new(2, 6, Duration::from_secs(1)).with_per_source(3);
        assert_eq!(q.push(datagram(1, 1), 1, 60, ms(0)), None, "another sender's fragment, held first");
        for (i, ident) in [(2, 10), (3, 11), (4, 12)] {
            assert_eq!(q.push(datagram(9, ident), i, 60, ms(i as u64)), None);
        }
        // Sender 9 is at its bound: its own oldest goes, not sender 1's older one.
        assert_eq!(q.push(datagram(9, 13), 5, 60, ms(5)), Some(2));
        assert_eq!(q.push(datagram(9, 14), 6, 60, ms(6)), Some(3));
        assert_eq!(q.len(), 4);
        let all = [datagram(1, 1), datagram(9, 12), datagram(9, 13), datagram(9, 14)];
        assert_eq!(taken(&mut q, 64, &all[..1]), vec![1], "sender 1's fragment survived the flood");
        // Per datagram: the oldest of that datagram goes.
        let mut d = HoldQueue::new(2, 8, Duration::from_secs(1)).with_per_source(8);
        d.push(datagram(1, 7), 1, 60, ms(0));
        d.push(datagram(1, 7), 2, 60, ms(1));
        assert_eq!(d.push(datagram(1, 7), 3, 60, ms(2)), Some(1));
        // Next hops have no source bound.
        let mut n = HoldQueue::new(8, 8, Duration::from_secs(1)).with_per_source(1);
        assert_eq!(n.push(key(1), 1, 60, ms(0)), None);
        assert_eq!(n.push(key(1), 2, 60, ms(1)), None);
    }

    #[test]
    fn hold_queue_releases_frames_past_the_timeout() {
        let t0 = Instant::now();
        let mut q = HoldQueue::new(8, 8, Duration::from_secs(3));
        q.push(key(1), 1, 60, t0);
        q.push(key(2), 2, 60, t0 + Duration::from_secs(1));
        q.push(key(1), 3, 60, t0 + Duration::from_secs(2));
        let mut gone = Vec::new();
        q.expire(t0 + Duration::from_millis(2999), |_, t| gone.push(t));
        assert!(gone.is_empty());
        q.expire(t0 + Duration::from_secs(3), |_, t| gone.push(t));
        assert_eq!(gone, vec![1]);
        q.expire(t0 + Duration::from_secs(10), |_, t| gone.push(t));
        gone.sort_unstable();
        assert_eq!(gone, vec![1, 2, 3]);
        assert!(q.is_empty());
        q.push(key(1), 4, 60, t0);
        let mut cleared = Vec::new();
        q.clear(|t| cleared.push(t));
        assert_eq!((cleared, q.len()), (vec![4], 0));
    }
}
