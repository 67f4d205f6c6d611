//! What a take-over costs the gateway taking an egress IP over (issue 16
//! §2 and §3): installing the previous holder's sessions from its standby
//! shadow (`Engine::import_sessions`), which the control plane does after
//! applying tables that hold the IP and before announcing it. That time
//! adds to the failover and is the window in which a pod's packet of a
//! flow not yet imported would make a new session (review finding 6).
//! Also the holder's side of a full copy: `Engine::export_sessions`.
//!
//! `cargo bench -p egret-benches --bench takeover --locked`: a holder
//! engine with N IPv4 UDP sessions over 64 egress IPs (N = 600,000; set
//! `EGRET_BENCH_SESSIONS`), exported, then imported into fresh engines of
//! the same configuration on one thread and as `Engine::import_sessions`
//! does (split over the cores), `EGRET_BENCH_ROUNDS` times (default 5) for
//! each mapping behaviour, in a rotating order; prints each round, the
//! medians and the median ratio (split / one thread).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use egret_benches::report::Spread;
use egret_dataplane::engine::Engine;
use egret_dataplane::fixtures;
use egret_dataplane::nat::sync::SessionRecord;
use egret_dataplane::tables::MappingBehavior;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Exports every egress IP's sessions from a populated holder: the records
/// and the time the exports took.
fn export(n: u64, mapping: MappingBehavior) -> (Vec<SessionRecord>, Duration) {
    let (holder, _w, _shape) = common::populated(n, mapping);
    let t = Instant::now();
    let records: Vec<SessionRecord> = (0..common::EGRESS_IPS)
        .flat_map(|i| holder.export_sessions(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10 + i)), 0))
        .collect();
    let took = t.elapsed();
    assert_eq!(records.len() as u64, n, "every session exported");
    (records, took)
}

/// Imports `records` into a fresh engine on `threads` threads (None: as
/// `Engine::import_sessions` does): the time, and a check that every record
/// was installed.
fn import(records: &[SessionRecord], mapping: MappingBehavior, threads: Option<usize>) -> Duration {
    let n = records.len();
    let engine = Engine::new(&common::spec((n + n / 8).max(1024), mapping)).unwrap();
    engine.publish_fib(fixtures::topology());
    let tables = engine.tables();
    let t = Instant::now();
    let report = match threads {
        Some(k) => engine.import_sessions_on(records, &tables, 0, k),
        None => engine.import_sessions(records, &tables, 0),
    };
    let took = t.elapsed();
    assert_eq!(report.installed, n as u64, "{report:?}");
    took
}

fn main() {
    let n = env("EGRET_BENCH_SESSIONS", 600_000);
    let rounds = env("EGRET_BENCH_ROUNDS", 5);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let modes = [
        ("endpoint-independent", MappingBehavior::EndpointIndependent),
        ("endpoint-dependent", MappingBehavior::EndpointDependent),
    ];
    // Per mode: export ms, import ms on one thread, import ms split, ratio.
    let mut exports = [Vec::new(), Vec::new()];
    let mut single = [Vec::new(), Vec::new()];
    let mut split = [Vec::new(), Vec::new()];
    let mut ratios = [Vec::new(), Vec::new()];
    for round in 0..rounds {
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for m in order {
            let (name, mapping) = modes[m];
            let (records, exported) = export(n, mapping);
            // Which import goes first rotates too.
            let (one, many) = if round % 2 == 0 {
                let one = import(&records, mapping, Some(1));
                (one, import(&records, mapping, None))
            } else {
                let many = import(&records, mapping, None);
                (import(&records, mapping, Some(1)), many)
            };
            println!(
                "round {round} {name}: {n} sessions exported in {exported:?}; imported on one thread in {one:?} \
                 ({:.2} M/s), split over {cores} cores in {many:?} ({:.2} M/s)",
                n as f64 / one.as_secs_f64() / 1e6,
                n as f64 / many.as_secs_f64() / 1e6
            );
            exports[m].push(exported.as_secs_f64() * 1e3);
            single[m].push(one.as_secs_f64() * 1e3);
            split[m].push(many.as_secs_f64() * 1e3);
            ratios[m].push(many.as_secs_f64() / one.as_secs_f64());
        }
    }
    for (m, (name, _)) in modes.iter().enumerate() {
        println!(
            "median {name}: export {:.1} ms, import one thread {:.1} ms, split {:.1} ms, ratio split/one {:.3} \
             ({n} sessions, {rounds} rounds, {cores} cores)",
            Spread::of(&exports[m]).median,
            Spread::of(&single[m]).median,
            Spread::of(&split[m]).median,
            Spread::of(&ratios[m]).median
        );
    }
}
