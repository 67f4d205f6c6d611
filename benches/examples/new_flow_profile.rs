//! Profiling aid: N new IPv4 UDP flows through a fresh engine, the same
//! population as the criterion `new_flow` bench (`perf record` or
//! `valgrind --tool=callgrind` this, not the criterion run).
//!
//! `new_flow_profile N [eim|edm] [journal] [warm] [staged]`.
//!
//! `warm`: the steady state of a gateway whose sessions come and go. N other
//! flows are made and expired by the sweep first, so the session map, the
//! slab, the mappings and the port pools are at their size when the N
//! measured flows come (none of them grows or is made on a flow's way); a
//! fresh engine (the default) pays that growth inside the measured flows.
//!
//! `staged`: the measured flows come in batches of 32, staged first as a
//! worker stages a ring's batch once its table outgrows the caches
//! (`common::run_staged`; engine/batch.rs); unstaged, frame by frame.
#![allow(clippy::print_stdout, clippy::expect_used)]

#[path = "../benches/common/mod.rs"]
mod common;
use std::time::Instant;

use egret_dataplane::fixtures;
use egret_dataplane::nat::port_alloc::PortRng;
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
    let (warm, staged) = (opt("warm"), opt("staged"));
    let mut w = engine.pipeline_seeded(PortRng::new(3));
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
        assert_eq!(common::run(&mut w, &frames(n), fixtures::INSIDE, n, now), n, "warm-up flows forwarded");
        now += 100_000;
        while !engine.nat4().sessions.is_empty() {
            w.tick(egret_dataplane::clock::Timestamp::from_secs(now), 4096);
        }
    }
    let frames = frames(0);
    let (t, cpu) = (Instant::now(), on_cpu_ns());
    let ok = measured_flows(&mut w, &frames, now, staged);
    let (e, cpu) = (t.elapsed(), on_cpu_ns() - cpu);
    let state = format!("{}{}", if warm { ", warm tables" } else { "" }, if staged { ", staged 32" } else { "" });
    println!(
        "{n} new flows ({mapping:?}{state}): {:.0} ns/flow on this thread's CPU, {:.0} ns/flow wall ({ok} forwarded)",
        cpu as f64 / n as f64,
        e.as_nanos() as f64 / n as f64
    );
}

/// The measured flows, on their own for callgrind
/// (`--toggle-collect=*measured_flows*` counts these, not the warm-up's).
#[inline(never)]
fn measured_flows(w: &mut egret_dataplane::engine::Pipeline, frames: &[Vec<u8>], now: u64, staged: bool) -> u64 {
    let n = frames.len() as u64;
    if staged {
        common::run_staged(w, frames, fixtures::INSIDE, n, now, STAGED_BATCH)
    } else {
        common::run(w, frames, fixtures::INSIDE, n, now)
    }
}

/// The batch `staged` uses: the size the established path's runs settled on
/// (docs/benchmarks.md, "Batches staged").
const STAGED_BATCH: usize = 32;

/// This thread's time on a CPU so far (`/proc/thread-self/schedstat`).
fn on_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    s.split_whitespace().next().and_then(|x| x.parse().ok()).expect("schedstat's first field")
}
