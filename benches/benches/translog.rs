//! What translation logs cost the workers (issue 34, ADR 0034: at most 10%
//! of the new-flow rate): new flows with logging off and on, and the expiry
//! sweep that ends them (each session pushes one record at creation and one
//! at its end).
//!
//! `cargo bench -p egret-benches --bench translog --locked`: the criterion
//! group `translog_new_flow/{off,on}`, then interleaved rounds (logging
//! off; on with a ring large enough for the round and drained after the
//! timing, the workers' own cost; on with the default 65,536-record ring
//! drained every 10 ms by another thread, as the exporter does), in a
//! rotating order, a fresh engine each, printing each round's rates and the
//! median ratios: the figures docs/benchmarks.md records (the machine is
//! shared: compare only ratios from one run). Each round then times the
//! sweep that expires every session, off and on (ns per session ended).
//! `EGRET_TRANSLOG_ROUNDS` / `EGRET_TRANSLOG_FLOWS` change the rounds
//! (default 10) and the new flows per round (default 200,000).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use egret_benches::report::Spread;
use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{Engine, Pipeline};
use egret_dataplane::fixtures;
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::tables::MappingBehavior;

/// The default ring (`translationLogs.ringRecords`).
const RING: usize = 65_536;
/// The exporter's period.
const DRAIN_EVERY: Duration = Duration::from_millis(10);

/// How a round runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// No logging.
    Off,
    /// Logging on, a ring holding the whole round, drained after the timing.
    Queued,
    /// Logging on, the default ring, drained every 10 ms by another thread.
    Drained,
}

/// A fresh engine with room for `flows` new flows, its worker (logging as
/// `mode` says), and the frames of `flows` distinct new UDP flows.
fn setup(flows: u64, mode: Mode) -> (Engine, Pipeline, Vec<Vec<u8>>) {
    let engine = Engine::new(&common::spec((flows as usize + 1024) * 2, MappingBehavior::EndpointIndependent)).unwrap();
    engine.publish_fib(fixtures::topology());
    match mode {
        Mode::Off => {}
        Mode::Queued => assert!(engine.enable_translog(flows as usize * 2 + 16)),
        Mode::Drained => assert!(engine.enable_translog(RING)),
    }
    let w = engine.pipeline_seeded(PortRng::new(3));
    let frames = (0..flows)
        .map(|i| {
            let (pod, pp, remote, rp) = common::flow(i, 4096, 1000, 1_000_000);
            fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18])).frame()
        })
        .collect();
    (engine, w, frames)
}

/// The exporter's drain, without the encoding (that runs off the workers).
struct Drainer {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<u64>,
}

impl Drainer {
    fn start(engine: &Engine) -> Drainer {
        let stop = Arc::new(AtomicBool::new(false));
        let (e, s) = (engine.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            loop {
                let stopping = s.load(Ordering::Acquire);
                for ring in e.translog_rings() {
                    while let Some(r) = ring.pop() {
                        n += u64::from(r.kind != 0);
                    }
                }
                if stopping {
                    return n;
                }
                std::thread::sleep(DRAIN_EVERY);
            }
        });
        Drainer { stop, thread }
    }

    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap()
    }
}

/// What one round measured.
#[derive(Clone, Copy, Debug, Default)]
struct Round {
    /// Creating the flows.
    create: Duration,
    /// The sweep that ended them all.
    expire: Duration,
    /// Records lost to a full ring (`translog_ring_full`).
    lost: u64,
}

/// One timed run of `flows` new flows, then the sweep that expires them.
fn round(flows: u64, mode: Mode) -> Round {
    let (engine, mut w, frames) = setup(flows, mode);
    let drainer = (mode == Mode::Drained).then(|| Drainer::start(&engine));
    let t = Instant::now();
    let ok = common::run(&mut w, &frames, fixtures::INSIDE, flows, 1);
    let create = t.elapsed();
    assert_eq!(ok, flows, "every new flow is translated");
    // Idle past the UDP timeout: the sweep ends every session.
    let t = Instant::now();
    while !engine.nat4().sessions.is_empty() {
        w.tick(Timestamp::from_secs(10_000), 65_536);
    }
    let expire = t.elapsed();
    if let Some(d) = drainer {
        d.finish();
    }
    let lost = engine.stats().event(egret_dataplane::stats::Event::TranslogRingFull);
    if mode == Mode::Queued {
        let queued: usize = engine.translog_rings().iter().map(|r| r.len()).sum();
        assert_eq!(queued as u64, 2 * flows, "one create and one delete per session");
    }
    Round { create, expire, lost }
}

fn new_flow(c: &mut Criterion) {
    let mut g = c.benchmark_group("translog_new_flow");
    g.throughput(Throughput::Elements(1));
    for (name, mode) in [("off", Mode::Off), ("on", Mode::Queued)] {
        g.bench_function(name, |b| b.iter_custom(|iters| round(iters, mode).create));
    }
    g.finish();
}

/// The three modes in a rotating order, so that drift in the machine's load
/// hits all alike.
fn interleaved() {
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|s| s.parse().ok()).unwrap_or(d);
    let rounds = env("EGRET_TRANSLOG_ROUNDS", 10);
    let flows = env("EGRET_TRANSLOG_FLOWS", 200_000);
    println!("\ntranslation logs, interleaved: {rounds} rounds of {flows} new IPv4 UDP flows each, then their expiry");
    println!(
        "round  off (flows/s)  on (flows/s)  on+drain (flows/s)  on/off  on+drain/off  expiry off (ns/session)  expiry on (ns/session)  lost (on+drain)"
    );
    let modes = [Mode::Off, Mode::Queued, Mode::Drained];
    let (mut r_on, mut r_dr, mut e_off, mut e_on) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut offs, mut ons, mut drs) = (Vec::new(), Vec::new(), Vec::new());
    for r in 0..rounds as usize {
        let mut got = [Round::default(); 3];
        for k in 0..3 {
            let m = (r + k) % 3;
            got[m] = round(flows, modes[m]);
        }
        let rate = |x: &Round| flows as f64 / x.create.as_secs_f64();
        let per = |x: &Round| x.expire.as_nanos() as f64 / flows as f64;
        println!(
            "{r:>5}  {:>13.0}  {:>12.0}  {:>18.0}  {:>6.3}  {:>12.3}  {:>23.0}  {:>22.0}  {:>15}",
            rate(&got[0]),
            rate(&got[1]),
            rate(&got[2]),
            rate(&got[1]) / rate(&got[0]),
            rate(&got[2]) / rate(&got[0]),
            per(&got[0]),
            per(&got[1]),
            got[2].lost
        );
        offs.push(rate(&got[0]));
        ons.push(rate(&got[1]));
        drs.push(rate(&got[2]));
        r_on.push(rate(&got[1]) / rate(&got[0]));
        r_dr.push(rate(&got[2]) / rate(&got[0]));
        e_off.push(per(&got[0]));
        e_on.push(per(&got[1]));
    }
    let (r_on, r_dr) = (Spread::of(&r_on), Spread::of(&r_dr));
    println!(
        "median flows/s: off {:.0}, on {:.0}, on+drain {:.0}; median ratio on/off {}, on+drain/off {}",
        Spread::of(&offs).median,
        Spread::of(&ons).median,
        Spread::of(&drs).median,
        r_on.three_places(),
        r_dr.three_places(),
    );
    println!(
        "median expiry sweep: off {:.0} ns per session ended, on {:.0} ns",
        Spread::of(&e_off).median,
        Spread::of(&e_on).median
    );
    println!(
        "record {} bytes; a ring of {RING} records holds {} KiB (crossbeam adds an 8-byte stamp per slot)",
        std::mem::size_of::<egret_dataplane::translog::LogRecord>(),
        RING * (std::mem::size_of::<egret_dataplane::translog::LogRecord>() + 8) / 1024
    );
}

criterion_group!(benches, new_flow);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    interleaved();
}
