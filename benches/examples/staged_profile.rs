//! Batches staged or not, interleaved in one process: established outbound
//! and reply frames over N sessions, ns per packet frame by frame (every
//! frame a batch of its own), in unstaged batches of 64, and staged in
//! batches of each size (issue 32; docs/benchmarks.md "Batches staged"). Times are the
//! thread's own CPU time, so a busy machine's other work is not counted
//! (its effect on the caches still is).
//!
//! `staged_profile SESSIONS ROUNDS ITERS [v6] [tunnel]` (defaults 1000000
//! 5 4000000; `v6`: the same population in IPv6, common::Family;
//! `tunnel`: the outbound frames come through the VXLAN tunnel from a
//! worker node in another subnet, the replies as always).
#![allow(clippy::print_stdout, clippy::expect_used)]

#[path = "../benches/common/mod.rs"]
mod common;

use std::net::{Ipv4Addr, Ipv6Addr};

use egret_dataplane::fixtures;
use egret_dataplane::tables::MappingBehavior;

fn main() {
    let arg = |i: usize, d: u64| std::env::args().nth(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (n, rounds, iters) = (arg(1, 1_000_000), arg(2, 5), arg(3, 4_000_000));
    let flag = |name: &str| std::env::args().skip(4).any(|a| a == name);
    let (v6, tunnel) = (flag("v6"), flag("tunnel"));
    let edit = |spec: &mut _| {
        if tunnel {
            common::with_tunnel(spec);
        }
    };
    let eim = MappingBehavior::EndpointIndependent;
    let (_engine, mut w, _, (mut out, back)) = if v6 {
        let (engine, w, sh) = common::populated_with::<Ipv6Addr>(n, eim, edit);
        let frames = common::frames_in::<Ipv6Addr>(&engine, n, sh, 1 << 16, 9);
        (engine, w, sh, frames)
    } else {
        let (engine, w, sh) = common::populated_with::<Ipv4Addr>(n, eim, edit);
        let frames = common::frames(&engine, n, sh, 1 << 16, 9);
        (engine, w, sh, frames)
    };
    if tunnel {
        out = common::through_tunnel(&out);
    }
    // usize::MAX: frame by frame; 0: unstaged batches of common::BATCH.
    let batches = [usize::MAX, 0usize, 8, 16, 32, 64];
    let mut ns = vec![vec![Vec::new(); batches.len()]; 2];
    for _ in 0..rounds {
        for (d, (frames, ingress)) in [(&out, fixtures::INSIDE), (&back, fixtures::OUTSIDE)].into_iter().enumerate() {
            for (b, &batch) in batches.iter().enumerate() {
                let t = on_cpu_ns();
                let ok = match batch {
                    usize::MAX => common::run_frame_by_frame(&mut w, frames, ingress, iters, 1),
                    0 => common::run(&mut w, frames, ingress, iters, 1),
                    _ => common::run_staged(&mut w, frames, ingress, iters, 1, batch),
                };
                assert_eq!(ok, iters, "every frame forwarded");
                ns[d][b].push((on_cpu_ns() - t) as f64 / iters as f64);
            }
        }
    }
    println!(
        "{n} {}sessions{}, {rounds} rounds of {iters} packets; ns of this thread's CPU time per packet, median (min-max)",
        if v6 { "IPv6 " } else { "" },
        if tunnel { ", outbound through the tunnel" } else { "" }
    );
    for (d, name) in ["outbound", "reply"].iter().enumerate() {
        for (b, &batch) in batches.iter().enumerate() {
            let mut v = ns[d][b].clone();
            v.sort_by(f64::total_cmp);
            let label = match batch {
                usize::MAX => "one by one".to_string(),
                0 => "unstaged".to_string(),
                _ => format!("staged {batch}"),
            };
            println!("{name:9} {label:11} {:6.1} ({:.1}-{:.1})", v[v.len() / 2], v[0], v[v.len() - 1]);
        }
    }
}

/// This thread's time on a CPU so far (`/proc/thread-self/schedstat`):
/// time the machine gave to others is not counted, as wall time would.
fn on_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    s.split_whitespace().next().and_then(|x| x.parse().ok()).expect("schedstat's first field")
}
