//! Profiling aid: N new IPv4 UDP flows through a fresh engine, the same
//! population as the criterion `new_flow` bench (`perf record` or
//! `valgrind --tool=callgrind` this, not the criterion run).
//!
//! `new_flow_profile N [eim|edm] [journal] [port-map] [warm] [second] [staged] [workers=K]`.
//!
//! `port-map`: the mapped-port filter connected, as on every gateway whose
//! XDP program loaded (`controlplane/src/daemon/port_map.rs`): a port's
//! bit is set when its first session is made and cleared after its last
//! (ADR 0048: by the port's owner cell in endpoint-independent mode, by the
//! NAT's count per port in endpoint-dependent mode). The bits here are
//! [`BitsOnly`], an in-memory bitmap written with the same atomic as
//! `egret_bpf::MappedPorts`, not the program's map (no BPF map is loaded),
//! and one bitmap for every egress IP. Endpoint-independent pools keep
//! their place and write through it, as on a gateway (a generation check,
//! then the bit: ADR 0048, amended); endpoint-dependent mode's count per port goes
//! through `set`, which here skips `MappedPorts`'s (address, protocol)
//! slot lookup.
//!
//! `warm`: the steady state of a gateway whose sessions come and go. N other
//! flows are made and expired by the sweep first, so the session map, the
//! slab, the mappings and the port pools are at their size when the N
//! measured flows come (none of them grows or is made on a flow's way); a
//! fresh engine (the default) pays that growth inside the measured flows.
//! The warm-up flows send two packets each, so the worker's flow cache is
//! full of their (expired) refs, as a busy gateway's is of its flows'.
//!
//! `second`: each measured flow sends a second packet, [`SECOND_AFTER`]
//! frames after its first (a TCP handshake's ACK, a UDP flow's next
//! datagram, while the worker serves other flows meanwhile); the time is
//! per flow, both packets.
//!
//! `staged`: the measured flows come in batches of 32, staged first as a
//! worker stages a ring's batch once its table outgrows the caches
//! (`common::run_staged`; engine/batch.rs); unstaged, in batches of 64
//! (`common::run`).
//!
//! `workers=K`: K workers (pipelines of one engine, each on a thread of its
//! own) make the N flows together, each a contiguous K-th of them, started
//! at once; as on a gateway whose NIC spreads a pod's flows over every
//! worker, they share the session table, the mappings and the pools. Each
//! worker's CPU time per flow, set against one worker's, is what the shared
//! lines and locks cost when two cores write them (run it as
//! `taskset -c 0,1`); the warm-up is split the same way.
#![allow(clippy::print_stdout, clippy::expect_used)]

#[path = "../benches/common/mod.rs"]
mod common;
use std::net::Ipv4Addr;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use egret_dataplane::fixtures;
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::nat::table::{PortBitsAt, PortMapHook};
use egret_dataplane::tables::MappingBehavior;

fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(100_000);
    let mapping = match std::env::args().nth(2).as_deref() {
        Some("edm") => MappingBehavior::EndpointDependent,
        _ => MappingBehavior::EndpointIndependent,
    };
    let engine = egret_dataplane::engine::Engine::new(&common::spec((n as usize + 1024) * 2, mapping)).expect("spec");
    engine.publish_fib(fixtures::topology());
    let opt = |name: &str| std::env::args().skip(3).any(|a| a == name);
    // `journal`: the HA sync journal on, as on a gateway with a standby.
    if opt("journal") {
        assert!(engine.enable_sync_journal(1 << 20), "journal enabled");
    }
    if opt("port-map") {
        let bits: Arc<dyn PortMapHook<Ipv4Addr>> = Arc::new(BitsOnly {
            words: (0..PORT_WORDS).map(|_| AtomicU64::new(0)).collect(),
            generation: AtomicU32::new(0),
        });
        assert!(engine.nat4().set_port_map_hook(bits), "port map connected");
    }
    let (warm, staged) = (opt("warm"), opt("staged"));
    let workers: usize = std::env::args()
        .skip(3)
        .find_map(|a| a.strip_prefix("workers=").map(|k| k.parse().expect("workers=K, K a number")))
        .unwrap_or(1)
        .max(1);
    let mut ws: Vec<_> = (0..workers).map(|k| engine.pipeline_seeded(PortRng::new(3 + k as u64))).collect();
    let frames = |from: u64| -> Vec<Vec<u8>> {
        (from..from + n)
            .map(|i| {
                let (pod, pp, remote, rp) = common::flow(i, 4096, 1000, 1_000_000);
                fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18])).frame()
            })
            .collect()
    };
    let mut now = 1;
    if warm {
        // Each warm-up flow sends twice, so that the worker's flow cache
        // holds their refs as a busy gateway's holds its established
        // flows' (a new flow's probe then meets an earlier flow's entry).
        let warm_up = frames(n);
        for (w, share) in ws.iter_mut().zip(warm_up.chunks(warm_up.len().div_ceil(workers))) {
            let sent = 2 * share.len() as u64;
            assert_eq!(common::run(w, share, fixtures::INSIDE, sent, now), sent, "warm-up flows forwarded");
        }
        now += 100_000;
        while !engine.nat4().sessions.is_empty() {
            ws[0].tick(egret_dataplane::clock::Timestamp::from_secs(now), 4096);
        }
    }
    let second = opt("second");
    let frames = if second { with_second_packets(frames(0)) } else { frames(0) };
    // The measured frames in one buffer, in order, as a worker's ring
    // hands them over: built one by one, each was a heap block of its
    // own wherever the warm-up's frees had left room, and reading them
    // cost 3 % to 8 % of the run depending on the build (perf, 2026-12-04;
    // docs/benchmarks.md, "A random port drawn ahead").
    let packed = frames.concat();
    let mut rest = packed.as_slice();
    let frames: Vec<&[u8]> = frames
        .iter()
        .map(|f| {
            let (one, after) = rest.split_at(f.len());
            rest = after;
            one
        })
        .collect();
    let state = format!(
        "{}{}{}",
        if warm { ", warm tables" } else { "" },
        if second { ", a second packet each" } else { "" },
        if staged { ", staged 32" } else { "" }
    );
    if workers == 1 {
        let (t, cpu) = (Instant::now(), on_cpu_ns());
        let ok = measured_flows(&mut ws[0], &frames, now, staged);
        let (e, cpu) = (t.elapsed(), on_cpu_ns() - cpu);
        println!(
            "{n} new flows ({mapping:?}{state}): {:.0} ns/flow on this thread's CPU, {:.0} ns/flow wall ({ok} forwarded)",
            cpu as f64 / n as f64,
            e.as_nanos() as f64 / n as f64
        );
        return;
    }
    let start = std::sync::Barrier::new(workers);
    let runs: Vec<(f64, u64, std::time::Duration)> = std::thread::scope(|s| {
        let threads: Vec<_> = ws
            .iter_mut()
            .zip(frames.chunks(frames.len().div_ceil(workers)))
            .map(|(w, share)| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let (t, cpu) = (Instant::now(), on_cpu_ns());
                    let ok = measured_flows(w, share, now, staged);
                    ((on_cpu_ns() - cpu) as f64 / share.len() as f64, ok, t.elapsed())
                })
            })
            .collect();
        threads.into_iter().map(|h| h.join().expect("a worker")).collect()
    });
    let per_flow: Vec<String> = runs.iter().map(|(ns, _, _)| format!("{ns:.0}")).collect();
    let ok: u64 = runs.iter().map(|(_, ok, _)| ok).sum();
    let wall = runs.iter().map(|(_, _, e)| *e).max().unwrap_or_default();
    println!(
        "{n} new flows ({mapping:?}{state}), {workers} workers: {} ns/flow on each worker's CPU, {:.0} ns/flow wall for all ({ok} forwarded)",
        per_flow.join(" / "),
        wall.as_nanos() as f64 / n as f64
    );
}

/// The measured flows, on their own for callgrind
/// (`--toggle-collect=*measured_flows*` counts these, not the warm-up's).
#[inline(never)]
fn measured_flows(w: &mut egret_dataplane::engine::Pipeline, frames: &[&[u8]], now: u64, staged: bool) -> u64 {
    let n = frames.len() as u64;
    if staged {
        common::run_staged(w, frames, fixtures::INSIDE, n, now, STAGED_BATCH)
    } else {
        common::run(w, frames, fixtures::INSIDE, n, now)
    }
}

/// Words of [`BitsOnly`]'s bitmap: a bit per port, every (egress IP,
/// protocol) on the same 65,536 bits (the bench's 16 egress IPs share them:
/// a stand-in for the write, not a filter).
const PORT_WORDS: usize = 1 << 10;

/// `port-map`'s hook: what `egret_bpf::MappedPorts` does for a pool that
/// keeps its place (`PortMapHook::locate`): the place's generation checked,
/// then an atomic or / and on the port's word, into memory of its own.
struct BitsOnly {
    words: Box<[AtomicU64]>,
    generation: AtomicU32,
}

impl BitsOnly {
    fn write(&self, port: u16, mapped: bool) {
        let (word, bit) = (&self.words[usize::from(port >> 6)], 1u64 << (port & 63));
        if mapped {
            word.fetch_or(bit, Ordering::Release);
        } else {
            word.fetch_and(!bit, Ordering::Release);
        }
    }
}

impl PortMapHook<Ipv4Addr> for BitsOnly {
    fn track(&self, _egress: Ipv4Addr, _proto: u8) {}

    fn set(&self, _egress: Ipv4Addr, _proto: u8, port: u16, mapped: bool) {
        self.write(port, mapped);
    }

    fn forget(&self, _egress: Ipv4Addr) {}

    fn locate(&self, _egress: Ipv4Addr, _proto: u8) -> Option<PortBitsAt> {
        NonZeroU64::new(u64::from(self.generation.load(Ordering::Acquire)) + 1).map(PortBitsAt)
    }

    fn set_at(&self, at: PortBitsAt, port: u16, mapped: bool) -> bool {
        if at.0.get() != u64::from(self.generation.load(Ordering::Acquire)) + 1 {
            return false;
        }
        self.write(port, mapped);
        true
    }
}

/// How many frames after a flow's first packet `second` sends its second.
const SECOND_AFTER: usize = 64;

/// Each flow's frame twice: the second copy [`SECOND_AFTER`] frames after
/// the first (the last flows' second packets at the end).
fn with_second_packets(firsts: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut out = Vec::with_capacity(firsts.len() * 2);
    for (i, f) in firsts.iter().enumerate() {
        out.push(f.clone());
        if i >= SECOND_AFTER {
            out.push(firsts[i - SECOND_AFTER].clone());
        }
    }
    out.extend(firsts[firsts.len().saturating_sub(SECOND_AFTER)..].iter().cloned());
    out
}

/// The batch `staged` uses: the size the established path's runs settled on
/// (docs/benchmarks.md, "Batches staged").
const STAGED_BATCH: usize = 32;

/// This thread's time on a CPU so far (`/proc/thread-self/schedstat`).
fn on_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    s.split_whitespace().next().and_then(|x| x.parse().ok()).expect("schedstat's first field")
}
