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
//!       else take up to min(batch, room) frames, handler.handle() each,
//!            Transmit -> stage on the chosen port's TX ring (same UMEM: no copy)
//!            Drop     -> frame back to the pool
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

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::xsk::{sched, sys, Frame, TxRefused, XskPorts};

pub use crate::xsk::PortId;

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
}

/// The per-frame logic the worker drives.
pub trait FrameHandler {
    /// `buf` is the whole UMEM frame (capacity), the frame occupies buf[..len].
    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, now: Instant) -> Action;
    /// Called once per loop iteration (after a batch or a poll timeout) for periodic work.
    fn tick(&mut self, _now: Instant) {}
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
}

impl Default for WorkerConfig {
    fn default() -> Self {
        Self {
            batch_size: 64,
            poll_timeout: Duration::from_millis(100),
            drain_timeout: Duration::from_millis(1),
            cpu: None,
            realtime_priority: None,
            kernel_stats_interval: Duration::from_secs(1),
        }
    }
}

/// Worker counters: written by the worker thread only, read by anyone.
#[derive(Debug, Default)]
pub struct WorkerStats {
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

/// A plain copy of [`WorkerStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerStatsSnapshot {
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

impl WorkerStats {
    /// Read every counter.
    pub fn snapshot(&self) -> WorkerStatsSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        WorkerStatsSnapshot {
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
    stats: Arc<WorkerStats>,
    batch: Vec<Frame>,
    pollfds: Vec<libc::pollfd>,
    queues: Vec<u32>,
    last_kernel_stats: Option<Instant>,
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
        Ok(Self {
            ports,
            handler,
            config,
            stop,
            stats: Arc::default(),
            batch: Vec::with_capacity(config.batch_size),
            pollfds,
            queues,
            last_kernel_stats: None,
        })
    }

    /// The worker's counters, shareable with other threads.
    pub fn stats(&self) -> Arc<WorkerStats> {
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
            self.handle_batch(port, now);
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
        let (mut tx, mut dropped) = (0u64, 0u64);
        bump(&self.stats.rx_frames, self.batch.len() as u64);
        for frame in self.batch.drain(..) {
            let len = frame.len();
            let action = self.handler.handle(self.ports.frame_mut(&frame), len, rx, now);
            match action {
                Action::Drop => {
                    self.ports.recycle(frame);
                    dropped += 1;
                }
                Action::Transmit { port: out, len } => match self.ports.transmit(out, frame, len) {
                    Ok(()) => tx += 1,
                    Err((frame, why)) => {
                        self.ports.recycle(frame);
                        let c = match why {
                            TxRefused::NoSuchPort => &self.stats.bad_port,
                            TxRefused::BadLength => &self.stats.bad_length,
                            TxRefused::RingFull | TxRefused::NoFreeFrame => &self.stats.tx_refused_full,
                        };
                        bump(c, 1);
                    }
                },
            }
        }
        bump(&self.stats.tx_frames, tx);
        bump(&self.stats.dropped, dropped);
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
        let timeout = if draining { self.config.drain_timeout } else { self.config.poll_timeout };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        bump(&self.stats.idle_polls, 1);
        sys::poll(&mut self.pollfds, ms).map(drop).map_err(|source| WorkerError::Poll { sockets: n, source })
    }
}
