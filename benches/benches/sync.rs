//! What session sync costs the holder (issue 16 §2): new-flow throughput
//! with the change journal off and on, the journal drained (and every event
//! encoded, as the control plane would before sending it) by a thread
//! waking every millisecond.
//!
//! `cargo bench -p egret-benches --bench sync --locked`: the criterion group
//! `sync_journal/{off,on}`, then interleaved rounds (journal off; on and
//! drained every millisecond; on and drained only after the timing, which
//! is the workers' own cost without a drainer competing for the cores; in
//! a rotating order, fresh engine each) that print each round's rates and
//! the median ratios: the figures docs/benchmarks.md records (the machine
//! is shared, so only ratios from one run are compared). Set
//! `EGRET_SYNC_ROUNDS` / `EGRET_SYNC_FLOWS` / `EGRET_SYNC_DRAIN_MS` to change
//! the rounds (default 10), the new flows per round (default 200,000) and
//! the drainer's period (default 1 ms).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use egret_benches::report::Spread;
use egret_dataplane::engine::{Engine, Pipeline};
use egret_dataplane::fixtures;
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::nat::sync::{SESSION_RECORD_V4_LEN, SESSION_RECORD_V6_LEN};
use egret_dataplane::tables::MappingBehavior;

/// Journal entries per family: what a holder would configure for ~1 ms of
/// new flows at several million a second.
const JOURNAL: usize = 1 << 16;

/// A fresh engine with room for `flows` new flows, its worker, and the
/// frames of `flows` distinct new UDP flows (built outside the timing).
fn setup(flows: u64) -> (Engine, Pipeline, Vec<Vec<u8>>) {
    let engine = Engine::new(&common::spec((flows as usize + 1024) * 2, MappingBehavior::EndpointIndependent)).unwrap();
    engine.publish_fib(fixtures::topology());
    let w = engine.pipeline_seeded(PortRng::new(3));
    let frames = (0..flows)
        .map(|i| {
            let (pod, pp, remote, rp) = common::flow(i, 4096, 1000, 1_000_000);
            fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18])).frame()
        })
        .collect();
    (engine, w, frames)
}

/// The control plane's side: drains the journal every millisecond and
/// encodes what it took.
struct Drainer {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(u64, u64, u64)>,
}

/// How often the drainer wakes: `EGRET_SYNC_DRAIN_MS`, default 1 ms.
fn drain_every() -> Duration {
    Duration::from_millis(std::env::var("EGRET_SYNC_DRAIN_MS").ok().and_then(|s| s.parse().ok()).unwrap_or(1))
}

/// This thread's time on a CPU so far, in ns (`/proc/thread-self/schedstat`).
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|t| egret_benches::cpu::parse_schedstat(&t).ok())
        .map_or(0, |s| s.run_ns)
}

impl Drainer {
    fn start(engine: &Engine) -> Drainer {
        let stop = Arc::new(AtomicBool::new(false));
        let (e, s) = (engine.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let (mut events, mut bytes) = (0u64, 0u64);
            let mut wire = Vec::with_capacity(1 << 20);
            loop {
                let stopping = s.load(Ordering::Acquire);
                loop {
                    let batch = e.drain_sync_events(4096, 1);
                    if batch.is_empty() {
                        break;
                    }
                    for ev in &batch {
                        ev.encode(&mut wire);
                    }
                    events += batch.len() as u64;
                    bytes += wire.len() as u64;
                    wire.clear();
                }
                if stopping {
                    return (events, bytes, thread_cpu_ns());
                }
                std::thread::sleep(drain_every());
            }
        });
        Drainer { stop, thread }
    }

    /// Stops after a last drain: (events, encoded bytes, the thread's CPU ns).
    fn finish(self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap()
    }
}

/// How a round runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// No journal.
    Off,
    /// Journal on, drained every millisecond by another thread.
    Drained,
    /// Journal on and large enough for the round, drained after the timing:
    /// the workers' own cost, without the drainer competing for the cores.
    Queued,
}

/// What the drainer did in a round.
#[derive(Clone, Copy, Debug, Default)]
struct Drained {
    events: u64,
    bytes: u64,
    overflows: u64,
    cpu_ns: u64,
}

/// One timed run of `flows` new flows. Returns the worker's time and, with
/// the journal, what the drainer did.
fn round(flows: u64, mode: Mode) -> (Duration, Option<Drained>) {
    let (engine, mut w, frames) = setup(flows);
    let drainer = match mode {
        Mode::Off => None,
        Mode::Drained => {
            assert!(engine.enable_sync_journal(JOURNAL));
            Some(Drainer::start(&engine))
        }
        Mode::Queued => {
            assert!(engine.enable_sync_journal(flows as usize));
            None
        }
    };
    let t = Instant::now();
    let ok = common::run(&mut w, &frames, fixtures::INSIDE, flows, 1);
    let elapsed = t.elapsed();
    assert_eq!(ok, flows, "every new flow is translated");
    let drained = match (mode, drainer) {
        (Mode::Off, _) => None,
        (_, d) => {
            let (events, bytes, cpu_ns) = d.unwrap_or_else(|| Drainer::start(&engine)).finish();
            Some(Drained { events, bytes, overflows: engine.sync_overflows(), cpu_ns })
        }
    };
    (elapsed, drained)
}

fn journal(c: &mut Criterion) {
    let mut g = c.benchmark_group("sync_journal");
    g.throughput(Throughput::Elements(1));
    for (name, mode) in [("off", Mode::Off), ("on", Mode::Drained)] {
        g.bench_function(name, |b| b.iter_custom(|iters| round(iters, mode).0));
    }
    g.finish();
}

/// The three modes in a rotating order (off, drained, queued; then
/// drained, queued, off; ...) so that drift in the machine's load hits all
/// alike.
fn interleaved() {
    let env = |k: &str, d: u64| std::env::var(k).ok().and_then(|s| s.parse().ok()).unwrap_or(d);
    let rounds = env("EGRET_SYNC_ROUNDS", 10);
    let flows = env("EGRET_SYNC_FLOWS", 200_000);
    println!(
        "\nsession sync journal, interleaved: {rounds} rounds of {flows} new IPv4 UDP flows each, drained every {:?}",
        drain_every()
    );
    println!("round  off (flows/s)  drained (flows/s)  queued (flows/s)  drained/off  queued/off  events  bytes/event  overflows  drainer ns/event");
    let modes = [Mode::Off, Mode::Drained, Mode::Queued];
    let (mut offs, mut drs, mut qs, mut rd, mut rq) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut drainer, mut at_once) = (Vec::new(), Vec::new());
    for r in 0..rounds as usize {
        let mut rate = [0.0f64; 3];
        let mut seen = Drained::default();
        let mut batch = Drained::default();
        for k in 0..3 {
            let m = (r + k) % 3;
            let (t, d) = round(flows, modes[m]);
            rate[m] = flows as f64 / t.as_secs_f64();
            match modes[m] {
                Mode::Drained => seen = d.unwrap_or_default(),
                Mode::Queued => batch = d.unwrap_or_default(),
                Mode::Off => {}
            }
        }
        let Drained { events, bytes, overflows, cpu_ns } = seen;
        let per_event = cpu_ns as f64 / events.max(1) as f64;
        drainer.push(per_event);
        at_once.push(batch.cpu_ns as f64 / batch.events.max(1) as f64);
        println!(
            "{r:>5}  {:>13.0}  {:>17.0}  {:>16.0}  {:>11.3}  {:>10.3}  {events:>6}  {:>11.1}  {overflows:>9}  {per_event:>16.0}",
            rate[0],
            rate[1],
            rate[2],
            rate[1] / rate[0],
            rate[2] / rate[0],
            bytes as f64 / events.max(1) as f64
        );
        offs.push(rate[0]);
        drs.push(rate[1]);
        qs.push(rate[2]);
        rd.push(rate[1] / rate[0]);
        rq.push(rate[2] / rate[0]);
    }
    let (rd, rq) = (Spread::of(&rd), Spread::of(&rq));
    println!(
        "median flows/s: off {:.0}, drained {:.0}, queued {:.0}; median ratio drained/off {}, queued/off {}",
        Spread::of(&offs).median,
        Spread::of(&drs).median,
        Spread::of(&qs).median,
        rd.three_places(),
        rq.three_places(),
    );
    println!(
        "drainer (drain, read the slot, encode): median {:.0} ns of CPU per event while the round runs (wake-ups included), {:.0} ns draining a queued round at once",
        Spread::of(&drainer).median,
        Spread::of(&at_once).median
    );
    println!("encoded session record: IPv4 {SESSION_RECORD_V4_LEN} bytes, IPv6 {SESSION_RECORD_V6_LEN} bytes");
}

criterion_group!(benches, journal);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    interleaved();
}
