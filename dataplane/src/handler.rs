//! The worker's frame handler: the AF_XDP worker loop ([`crate::worker`])
//! on one side, the engine ([`crate::engine`]) on the other. A frame goes
//! from the RX ring through [`EngineHandler::handle`] to the engine's
//! verdict and back to the loop as an [`Action`]; this table is the whole
//! translation.
//!
//! A batch of frames ([`EngineHandler::handle_batch`]) goes through one
//! engine [`Batch`]: the snapshots are loaded once for it, and, when the
//! session table is large enough that staging pays, up to [`STAGE_MAX`]
//! frames at a time are staged first (engine/batch.rs).
//!
//! | engine verdict | worker action |
//! |---|---|
//! | `Forward { ifindex }` | transmit on the port bound to `ifindex` (no such port: drop, counted `no_port`) |
//! | `Answer` | transmit on the receiving port |
//! | `Pass` | drop, counted `misdirected`: the XDP program steered a frame the engine says is the kernel's |
//! | `Drop(reason)` | drop (the engine counted the reason) |
//! | `ToKernel { l3, end }` | the IP packet is sent on a raw socket ([`crate::kernel_tx`]), counted `to_kernel`; refused by the kernel: counted `kernel_send_failed`. The frame goes back to the pool |
//! | `Hold { ifindex, next_hop }` | held by the worker until the next hop resolves (`neighbor_queued`; then `neighbor_queue_sent`, or `neighbor_queue_overflow` / `neighbor_queue_timeout`) |
//! | `HoldFragment { .. }` | held by the worker, unchanged, and processed again until its first fragment's translation is known (`fragment_held`; then `fragment_held_sent`, or `fragment_hold_overflow` / `fragment_hold_timeout`) |
//!
//! `tick` runs the engine's bounded expiry sweep every [`SWEEP_EVERY`];
//! `inject` sends pending announcements (gratuitous ARP, unsolicited NA).

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::{EngineClock, Timestamp};
use crate::engine::{Batch, Engine, Pipeline, Release, RxMeta, Staged, Verdict};
use crate::kernel_tx::KernelTx;
use crate::neigh_responder::{gratuitous_arp, unsolicited_na};
use crate::stats::WorkerStats;
use crate::stats::{DropReason, Event};
use crate::wire::ethernet::EthernetAddress;
use crate::worker::{Action, Datagram, FrameHandler, Frames, HoldEvent, HoldKey, Injector, PortId, RxInfo};

/// How often the expiry sweep runs.
pub const SWEEP_EVERY: Duration = Duration::from_millis(50);
/// The sweep visits the whole session table about this often.
pub const SWEEP_PERIOD: Duration = Duration::from_secs(5);
/// Frames staged together at most: a batch is staged and handled in
/// pieces of this many (the prefetched lines of more would be evicted
/// before their frames are handled).
pub const STAGE_MAX: usize = 64;

/// Counters the handler owns (single writer: its worker).
#[derive(Debug, Default)]
pub struct HandlerStats {
    /// `Pass` verdicts.
    pub misdirected: AtomicU64,
    /// `Forward` to an interface this worker has no port on.
    pub no_port: AtomicU64,
    /// Announcements sent.
    pub announced: AtomicU64,
}

/// An announcement waiting for a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Announcement {
    /// Interface to send on.
    pub ifindex: u32,
    /// The address announced.
    pub ip: IpAddr,
    /// Not before.
    pub due: Instant,
}

/// Announcements shared between the control plane and worker 0.
pub type AnnounceQueue = Arc<Mutex<Vec<Announcement>>>;

/// The handler of one worker.
pub struct EngineHandler {
    pipeline: Pipeline,
    engine: Engine,
    out: Out,
    clock: EngineClock,
    last_sweep: Instant,
    sweep_budget: u32,
    announce: Option<AnnounceQueue>,
    /// A batch's first look ([`EngineHandler::stage`]).
    staged: [Staged; STAGE_MAX],
}

/// Where verdicts become actions: the worker's ports, the raw sockets to
/// the kernel, the handler's counters.
struct Out {
    /// ifindex of each port, in `PortId` order.
    ports: Vec<u32>,
    stats: Arc<HandlerStats>,
    kernel: KernelTx,
}

impl std::fmt::Debug for EngineHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandler").field("ports", &self.out.ports).finish_non_exhaustive()
    }
}

impl EngineHandler {
    /// A handler for ports bound to `ports` (ifindexes in port order); only
    /// the handler given `announce` sends announcements; `kernel` takes the
    /// translated packets to pods behind links Egret does not drive.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: &Engine,
        ports: Vec<u32>,
        clock: EngineClock,
        workers: u32,
        stats: Arc<HandlerStats>,
        announce: Option<AnnounceQueue>,
        kernel: KernelTx,
    ) -> Self {
        let capacity = engine.nat4().sessions.capacity() as u64;
        let sweeps = (SWEEP_PERIOD.as_millis() / SWEEP_EVERY.as_millis()).max(1) as u64;
        // Each worker sweeps its share of the table.
        let budget = (capacity / sweeps / u64::from(workers.max(1))).clamp(64, 1 << 20) as u32;
        let mut pipeline = engine.pipeline();
        // Frames to a next hop being resolved wait in the worker (worker.rs).
        pipeline.set_hold_unresolved(true);
        // So do later fragments that arrive before their first (worker.rs).
        pipeline.set_hold_fragments(true);
        Self {
            pipeline,
            engine: engine.clone(),
            out: Out { ports, stats, kernel },
            clock,
            last_sweep: clock.epoch(),
            sweep_budget: budget,
            announce,
            staged: [Staged::default(); STAGE_MAX],
        }
    }

    fn now(&self, now: Instant) -> Timestamp {
        self.clock.at(now)
    }

    /// Stages the next `n` frames of `frames` (engine/batch.rs): their
    /// flow-cache entries, then their session slots, then the index lines
    /// of those whose slot holds another flow.
    fn stage(&mut self, frames: &mut Frames<'_>, n: usize) {
        let Self { pipeline, staged, .. } = self;
        for (i, s) in staged.iter_mut().enumerate().take(n) {
            *s = frames.peek(i).map_or_else(Staged::default, |f| pipeline.prefetch_flow(f));
        }
        for s in staged.iter().take(n) {
            pipeline.prefetch_session(*s);
        }
        for s in staged.iter().take(n) {
            pipeline.prefetch_lookup(*s);
        }
    }

    /// A held later fragment, processed again as received: it waits while
    /// its first fragment's translation is unknown; otherwise it goes where
    /// the engine says (usually translated by the fragment cache).
    fn release_fragment(&mut self, d: Datagram, buf: &mut [u8], len: usize, ts: Timestamp) -> Option<Action> {
        let Some(port) = self.out.port_of(d.ifindex) else {
            bump(&self.out.stats.no_port);
            return Some(Action::Drop);
        };
        let verdict = self.pipeline.process(buf, len, RxMeta { ifindex: d.ifindex, checksum: Default::default() }, ts);
        if let Verdict::HoldFragment { .. } = verdict {
            return None;
        }
        if let Verdict::Forward { .. } | Verdict::ToKernel { .. } | Verdict::Hold { .. } = verdict {
            self.pipeline.stats().event(Event::FragmentHeldSent);
        }
        Some(self.out.act(verdict, buf, len, port, d.ifindex, self.pipeline.stats()))
    }
}

impl Out {
    fn port_of(&self, ifindex: u32) -> Option<PortId> {
        self.ports.iter().position(|i| *i == ifindex).map(|p| PortId(p as u16))
    }

    /// What the worker does with a frame the engine gave `verdict` (the
    /// module's table); `port` and `ifindex`: where it was received;
    /// `counters`: the worker's engine counters.
    fn act(
        &self,
        verdict: Verdict,
        buf: &[u8],
        len: usize,
        port: PortId,
        ifindex: u32,
        counters: &WorkerStats,
    ) -> Action {
        match verdict {
            Verdict::Forward { ifindex, len } => match self.port_of(ifindex) {
                Some(port) => Action::Transmit { port, len },
                None => {
                    bump(&self.stats.no_port);
                    Action::Drop
                }
            },
            Verdict::Answer { len } => Action::Transmit { port, len },
            Verdict::Pass => {
                bump(&self.stats.misdirected);
                Action::Drop
            }
            Verdict::Drop(_) => Action::Drop,
            Verdict::ToKernel { l3, end } => {
                let sent = buf.get(l3..end).map(|packet| self.kernel.send(packet));
                if let Some(Ok(())) = sent {
                    counters.event(Event::ToKernel);
                    Action::Consumed
                } else {
                    counters.dropped(DropReason::KernelSendFailed);
                    Action::Drop
                }
            }
            Verdict::Hold { ifindex, next_hop, len } => match self.port_of(ifindex) {
                Some(_) => Action::Hold { key: HoldKey::NextHop(ifindex, next_hop), len },
                None => {
                    bump(&self.stats.no_port);
                    Action::Drop
                }
            },
            Verdict::HoldFragment { src, dst, ident, proto, from_outside } => {
                let key = HoldKey::Datagram(Datagram { ifindex, src, dst, ident, proto, from_outside });
                Action::Hold { key, len }
            }
        }
    }
}

fn bump(c: &AtomicU64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
}

impl FrameHandler for EngineHandler {
    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, now: Instant) -> Action {
        let ifindex = self.out.ports.get(rx.port.index()).copied().unwrap_or(0);
        let ts = self.now(now);
        let verdict = self.pipeline.process(buf, len, RxMeta { ifindex, checksum: Default::default() }, ts);
        self.out.act(verdict, buf, len, rx.port, ifindex, self.pipeline.stats())
    }

    /// The batch through one engine [`Batch`], staged first in pieces of
    /// [`STAGE_MAX`] frames when staging pays.
    fn handle_batch(&mut self, frames: &mut Frames<'_>) {
        let rx = frames.rx();
        let ifindex = self.out.ports.get(rx.port.index()).copied().unwrap_or(0);
        let meta = RxMeta { ifindex, checksum: Default::default() };
        let ts = self.now(frames.now());
        let stages = self.pipeline.staging_pays();
        while !frames.is_empty() {
            let n = if stages { frames.len().min(STAGE_MAX) } else { frames.len() };
            if stages {
                self.stage(frames, n);
            }
            let mut batch: Batch<'_> = self.pipeline.batch(ts);
            let out = &self.out;
            frames.handle(n, |buf, len| {
                let verdict = batch.process(buf, len, meta);
                out.act(verdict, buf, len, rx.port, ifindex, batch.stats())
            });
        }
    }

    fn release(&mut self, key: HoldKey, buf: &mut [u8], len: usize, now: Instant) -> Option<Action> {
        let ts = self.now(now);
        let (ifindex, next_hop) = match key {
            HoldKey::NextHop(ifindex, next_hop) => (ifindex, next_hop),
            HoldKey::Datagram(d) => return self.release_fragment(d, buf, len, ts),
        };
        match self.pipeline.release_held(buf, len, ifindex, next_hop, ts) {
            Release::Wait => None,
            Release::Forward { ifindex, len } => match self.out.port_of(ifindex) {
                Some(port) => Some(Action::Transmit { port, len }),
                None => {
                    bump(&self.out.stats.no_port);
                    Some(Action::Drop)
                }
            },
            Release::Drop(_) => Some(Action::Drop),
        }
    }

    fn held(&mut self, key: HoldKey, event: HoldEvent) {
        let stats = self.pipeline.stats();
        match (key, event) {
            (HoldKey::NextHop(..), HoldEvent::Queued) => stats.event(Event::NeighborQueued),
            (HoldKey::NextHop(..), HoldEvent::Overflow) => stats.dropped(DropReason::NeighborQueueOverflow),
            (HoldKey::NextHop(..), HoldEvent::Expired) => stats.dropped(DropReason::NeighborQueueTimeout),
            (HoldKey::Datagram(_), HoldEvent::Queued) => stats.event(Event::FragmentHeld),
            (HoldKey::Datagram(_), HoldEvent::Overflow) => stats.dropped(DropReason::FragmentHoldOverflow),
            (HoldKey::Datagram(_), HoldEvent::Expired) => stats.dropped(DropReason::FragmentHoldTimeout),
        }
    }
    fn tick(&mut self, now: Instant) {
        if now.saturating_duration_since(self.last_sweep) >= SWEEP_EVERY {
            self.last_sweep = now;
            let ts = self.now(now);
            self.pipeline.tick(ts, self.sweep_budget);
        }
    }

    fn inject(&mut self, tx: &mut Injector<'_>) {
        let Some(queue) = &self.announce else { return };
        let due: Vec<Announcement> = {
            let Some(mut q) = queue.try_lock() else { return };
            if q.is_empty() {
                return;
            }
            let now = Instant::now();
            let (due, later): (Vec<_>, Vec<_>) = q.drain(..).partition(|a| a.due <= now);
            *q = later;
            due
        };
        let fib = self.engine.fib();
        for a in due {
            let (Some(port), Some(iface)) = (self.out.port_of(a.ifindex), fib.interface(a.ifindex)) else { continue };
            let mac = EthernetAddress(iface.mac);
            let sent = tx.send(port, |buf| match a.ip {
                IpAddr::V4(ip) => gratuitous_arp(buf, mac, ip, None).unwrap_or(0),
                IpAddr::V6(ip) => unsolicited_na(buf, mac, ip, None).unwrap_or(0),
            });
            if sent {
                bump(&self.out.stats.announced);
            }
        }
    }
}
