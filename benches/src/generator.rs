//! The traffic generator: one thread in the generator's namespace, pinned to
//! the generator's core, sending the run's flows out of the generator's veth
//! as fast as it can (or at a given rate) until told to stop.
//!
//! Two engines, chosen by the caller:
//! - `xdp` (default, the faster here): the kernel runs `xdp/gen.bpf.c` in
//!   `BPF_PROG_TEST_RUN` live-frame mode; each run rewrites a page-pool frame
//!   into the next flow's frame and `XDP_TX`es it, so frames reach the
//!   gateway's veth as XDP frames (no skb), as from a NIC's RX ring.
//! - `af-packet`: prebuilt frames sent with `sendmmsg` on an AF_PACKET socket
//!   with `PACKET_QDISC_BYPASS` (frames reach the gateway as skbs).
//!
//! With [`GenSpec::encap`] (the VXLAN modes, issue 30) every frame is a
//! pod's frame inside a worker node's tunnel frame (`frame.rs`,
//! [`VxlanSpec`]); the XDP engine then runs `xdp_gen_vxlan`.
//!
//! With TCP frames (`--proto tcp`, issue 32) every frame is a data segment
//! whose sequence number follows from its place in its flow
//! ([`FlowSet::segment_of_frame`]); [`send_syns`] sends each flow's SYN
//! once, for the handshake before a window.
//!
//! `sent` counts frames handed to the generator's veth: the offered load.
//! Frames the gateway's veth cannot queue (its ring is full) are lost there
//! and show as loss, as a NIC's RX overruns would.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::frame::{wire_frame, wire_segment, FlowSet, FrameSpec, Proto, VxlanSpec};
use crate::sys::PacketSender;
use crate::topology::NetnsError;
use crate::xdp::{self, XdpError};

/// Which generator engine to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// XDP live frames (BPF_PROG_TEST_RUN, XDP_TX).
    Xdp,
    /// AF_PACKET, PACKET_QDISC_BYPASS, sendmmsg.
    AfPacket,
}

/// What failed in the generator thread.
#[derive(Debug, thiserror::Error)]
pub enum GenError {
    #[error(transparent)]
    Xdp(#[from] XdpError),
    #[error("placing the generator on CPU {cpu} failed: {source}")]
    Pin { cpu: usize, source: std::io::Error },
    #[error("AF_PACKET {op} failed: {source}")]
    Packet { op: &'static str, source: std::io::Error },
    #[error("the generator thread panicked")]
    Panicked,
}

/// Where and what to send.
#[derive(Debug, Clone)]
pub struct GenSpec {
    pub engine: Engine,
    pub netns: String,
    pub dev: String,
    pub cpu: usize,
    pub frame: FrameSpec,
    /// Wrap every frame as a worker node in another subnet sends it
    /// (issue 30's VXLAN modes); `frame` is then the pod's inner frame.
    pub encap: Option<VxlanSpec>,
    pub flows: FlowSet,
    /// Flow counter to start from (new-flow mode: skip tuples used before).
    pub first_flow: u64,
    /// Frames per second, `None` for as fast as possible.
    pub rate: Option<u64>,
    /// Nice value for the generator thread (the machine is shared).
    pub nice: Option<i32>,
}

/// A running generator.
#[derive(Debug)]
pub struct Running {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    /// The XDP engine's exact counter (the thread only learns its count
    /// when a test run returns).
    counter: Option<xdp::GenCounter>,
    thread: Option<JoinHandle<Result<(), GenError>>>,
}

/// Frames per live-frame test run. Each run of more than one frame costs
/// about 20 ms of fixed overhead here (page-pool setup and teardown), so
/// runs are long; the generator checks its stop flag between runs (about
/// once a second at 1 Mpps). `EGRET_TPUT_CHUNK` overrides it (experiments).
const XDP_CHUNK: u32 = 1 << 20;
const PACKET_BATCH: usize = 256;
/// SYNs per `sendmmsg` (and per pacing step): a few, so that no burst fills
/// the gateway's 256-frame ring.
const SYN_BATCH: usize = 32;

impl Running {
    /// Start the generator thread; returns once it is sending (or failed to
    /// set up).
    pub fn start(spec: GenSpec) -> Result<Self, GenError> {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Option<xdp::GenCounter>, GenError>>();
        let (s, n) = (Arc::clone(&stop), Arc::clone(&sent));
        let thread = std::thread::Builder::new()
            .name("egret-tput-gen".into())
            .spawn(move || generate(spec, &s, &n, ready_tx))
            .map_err(|source| GenError::Packet { op: "spawn", source })?;
        let mut this = Self { stop, sent, counter: None, thread: Some(thread) };
        match ready_rx.recv() {
            Ok(Ok(counter)) => {
                this.counter = counter;
                Ok(this)
            }
            Ok(Err(e)) => {
                let _ = this.finish();
                Err(e)
            }
            Err(_) => Err(this.finish().err().unwrap_or(GenError::Panicked)),
        }
    }

    /// Frames sent so far.
    pub fn sent(&self) -> Result<u64, GenError> {
        match &self.counter {
            Some(c) => Ok(c.read()?),
            None => Ok(self.sent.load(Ordering::Relaxed)),
        }
    }

    /// Stop and join; returns the total sent.
    pub fn finish(&mut self) -> Result<u64, GenError> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().map_err(|_| GenError::Panicked)??;
        }
        self.sent()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// Sleep while ahead of `rate`.
fn pace(rate: Option<u64>, started: Instant, sent: u64, stop: &AtomicBool) {
    let Some(rate) = rate.filter(|r| *r > 0) else { return };
    loop {
        let due = started.elapsed().as_secs_f64() * rate as f64;
        if (sent as f64) <= due || stop.load(Ordering::Relaxed) {
            return;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

fn generate(
    spec: GenSpec,
    stop: &AtomicBool,
    sent: &AtomicU64,
    ready: std::sync::mpsc::Sender<Result<Option<xdp::GenCounter>, GenError>>,
) -> Result<(), GenError> {
    let setup = || -> Result<u32, GenError> {
        egret_dataplane::netns::enter_named(&spec.netns)
            .map_err(|source| XdpError::Netns(NetnsError { ns: spec.netns.clone(), source }))?;
        egret_dataplane::xsk::sched::pin_current_thread(spec.cpu)
            .map_err(|source| GenError::Pin { cpu: spec.cpu, source })?;
        if let Some(n) = spec.nice {
            crate::sys::set_nice(crate::sys::gettid(), n).map_err(|source| GenError::Pin { cpu: spec.cpu, source })?;
        }
        Ok(xdp::ifindex(&spec.netns, &spec.dev)?)
    };
    let ifindex = match setup() {
        Ok(i) => i,
        Err(e) => {
            let _ = ready.send(Err(e));
            return Ok(());
        }
    };
    let started = Instant::now();
    match spec.engine {
        Engine::Xdp => {
            let mut g = match xdp::Generator::load_with(&spec.frame, spec.encap.as_ref(), &spec.flows).and_then(|g| {
                g.set_next(spec.first_flow)?;
                Ok(g)
            }) {
                Ok(g) => g,
                Err(e) => {
                    let _ = ready.send(Err(e.into()));
                    return Ok(());
                }
            };
            let max_chunk: u32 =
                std::env::var("EGRET_TPUT_CHUNK").ok().and_then(|v| v.parse().ok()).unwrap_or(XDP_CHUNK);
            // With a rate, runs of 50 ms worth of frames: pacing is bursty
            // (the af-packet engine paces per 256 frames).
            let chunk = spec.rate.map_or(max_chunk, |r| (r / 20).clamp(1, u64::from(XDP_CHUNK)) as u32);
            // The first run proves the setup; report readiness after it.
            let counter = g.transmit(ifindex, 1).and_then(|()| g.counter());
            match counter {
                Ok(c) => {
                    let _ = ready.send(Ok(Some(c)));
                }
                Err(e) => {
                    let _ = ready.send(Err(e.into()));
                    return Ok(());
                }
            }
            let mut total = 1u64;
            while !stop.load(Ordering::Relaxed) {
                match g.transmit(ifindex, chunk) {
                    // A signal cut the run short (seen once in many hours:
                    // BPF_PROG_TEST_RUN checks signal_pending); the counter
                    // in the map has what was sent, so just go on.
                    Ok(()) | Err(XdpError::Interrupted) => {}
                    Err(e) => return Err(e.into()),
                }
                total = g.produced().unwrap_or(total + u64::from(chunk));
                sent.store(total, Ordering::Relaxed);
                pace(spec.rate, started, total, stop);
            }
        }
        Engine::AfPacket => {
            let mut tx = match PacketSender::open(ifindex, PACKET_BATCH) {
                Ok(t) => t,
                Err(source) => {
                    let _ = ready.send(Err(GenError::Packet { op: "socket", source }));
                    return Ok(());
                }
            };
            // Fixed UDP flow sets are prebuilt once (at most 1M frames);
            // new-flow mode and TCP (whose every segment differs) build each
            // batch as they go.
            let build = |(ip, port)| wire_frame(&spec.frame, spec.encap.as_ref(), ip, port);
            let tcp = spec.frame.proto == Proto::Tcp;
            let fixed: Vec<Vec<u8>> = if spec.flows.is_fresh_per_frame() || tcp {
                Vec::new()
            } else {
                (0..spec.flows.flows.min(1 << 20)).map(|k| build(spec.flows.flow(k))).collect()
            };
            let mut batch = vec![Vec::new(); PACKET_BATCH];
            let mut k = spec.first_flow;
            let mut total = 0u64;
            let _ = ready.send(Ok(None));
            while !stop.load(Ordering::Relaxed) {
                for f in batch.iter_mut() {
                    let flow = spec.flows.flow_of_frame(k);
                    if tcp {
                        let (ip, port) = spec.flows.flow(flow);
                        *f = wire_segment(&spec.frame, spec.encap.as_ref(), ip, port, spec.flows.segment_of_frame(k));
                    } else if fixed.is_empty() {
                        *f = build(spec.flows.flow(flow));
                    } else {
                        f.clone_from(&fixed[(flow % fixed.len() as u64) as usize]);
                    }
                    k += 1;
                }
                let mut off = 0;
                while off < batch.len() && !stop.load(Ordering::Relaxed) {
                    match tx.send(&batch[off..]) {
                        Ok(n) => off += n,
                        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {}
                        Err(source) => return Err(GenError::Packet { op: "sendmmsg", source }),
                    }
                }
                total += off as u64;
                sent.store(total, Ordering::Relaxed);
                pace(spec.rate, started, total, stop);
            }
        }
    }
    Ok(())
}

/// Send every flow of `flows` its TCP SYN ([`FrameSpec::build_syn`]) once,
/// from `dev` in namespace `netns` with AF_PACKET, at most `rate` frames per
/// second (even pacing: the gateway's ring is 256 frames). Returns the
/// number sent.
pub fn send_syns(netns: &str, dev: &str, frame: &FrameSpec, flows: &FlowSet, rate: u64) -> Result<u64, GenError> {
    let netns_error = |source| GenError::Xdp(XdpError::Netns(NetnsError { ns: netns.to_owned(), source }));
    let syns: Vec<[u8; crate::frame::FRAME_LEN]> = (0..flows.flows)
        .map(|k| {
            let (ip, port) = flows.flow(k);
            frame.build_syn(ip, port)
        })
        .collect();
    egret_dataplane::netns::run_in(netns, || -> Result<u64, GenError> {
        let ifindex = xdp::ifindex(netns, dev)?;
        let mut tx =
            PacketSender::open(ifindex, PACKET_BATCH).map_err(|source| GenError::Packet { op: "socket", source })?;
        let started = Instant::now();
        let stop = AtomicBool::new(false);
        let mut sent = 0u64;
        for batch in syns.chunks(SYN_BATCH) {
            let mut off = 0;
            while off < batch.len() {
                if crate::sys::stop_requested() {
                    return Ok(sent);
                }
                match tx.send(&batch[off..]) {
                    Ok(n) => off += n,
                    Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {}
                    Err(source) => return Err(GenError::Packet { op: "sendmmsg", source }),
                }
            }
            sent += off as u64;
            pace(Some(rate), started, sent, &stop);
        }
        Ok(sent)
    })
    .map_err(netns_error)?
}
