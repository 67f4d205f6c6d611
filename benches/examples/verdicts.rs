//! Profiling aid: populates N sessions, then processes established outbound
//! frames in a loop for a few seconds (`perf record` this, not the criterion run).
#![allow(clippy::print_stdout)]

#[path = "../benches/common/mod.rs"]
mod common;
use std::time::Instant;

use egret_dataplane::fixtures;
use egret_dataplane::tables::MappingBehavior;
fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(1000);
    let (engine, mut w, sh) = common::populated(n, MappingBehavior::EndpointIndependent);
    let (out, _back) = common::frames(&engine, n, sh, 1 << 16, 9);
    let iters: u64 = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(20_000_000);
    let t = Instant::now();
    let ok = common::run(&mut w, &out, fixtures::INSIDE, iters, 1);
    let e = t.elapsed();
    println!("{n} sessions: {:.1} ns/packet ({ok} forwarded)", e.as_nanos() as f64 / iters as f64);
}
