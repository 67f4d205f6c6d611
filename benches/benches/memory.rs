//! Memory per session, measured: a counting global allocator reports the
//! bytes the engine holds after creating N sessions, minus what it held
//! before. Also prints the resident-set growth, and what a standby gateway
//! holds per replicated session (nat/sync.rs records in a `HashMap`).
//!
//! `cargo bench -p egret-benches --bench memory` (N = 1,000,000; set
//! `EGRET_BENCH_SESSIONS` to change it).

#![allow(unsafe_code)] // the counting allocator below, and nothing else
#![allow(clippy::print_stdout)] // the measurement is the output

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicIsize, Ordering};

use egret_dataplane::nat::sync::{SessionKeyRecord, SessionRecord};
use egret_dataplane::tables::MappingBehavior;

struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: delegates every call to the system allocator unchanged; the only
// addition is a relaxed counter of live bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` was allocated by `System` with layout `l`.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        // SAFETY: `p` was allocated by `System` with layout `l`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|x| x.parse::<u64>().ok()))
        .map_or(0, |pages| pages * 4096)
}

fn main() {
    // `cargo bench` passes --bench; ignore arguments.
    let n: u64 = std::env::var("EGRET_BENCH_SESSIONS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
        let before = LIVE.load(Ordering::Relaxed);
        let rss0 = rss_bytes();
        let (engine, w, sh) = common::populated(n, mapping);
        let after = LIVE.load(Ordering::Relaxed);
        let rss1 = rss_bytes();
        let per = (after - before) as f64 / n as f64;
        println!(
            "memory {mapping:?}: {n} sessions ({} pods x {} ports x {} remotes, {} mappings): {:.1} bytes/session allocated, {:.1} bytes/session RSS growth",
            sh.0,
            sh.1,
            sh.2,
            engine.nat4().mappings.len(),
            per,
            (rss1.saturating_sub(rss0)) as f64 / n as f64,
        );
        if mapping == MappingBehavior::EndpointIndependent {
            standby_map(&engine, n);
        }
        drop(w);
        drop(engine);
    }
}

/// What a standby gateway holds per replicated session (issue 16 §2): the
/// records of every session, exported as for a full resync, in the map the
/// control plane keeps them in, `HashMap<SessionKeyRecord, SessionRecord>`.
fn standby_map(engine: &egret_dataplane::engine::Engine, n: u64) {
    let t = std::time::Instant::now();
    let records: Vec<SessionRecord> = (0..common::EGRESS_IPS)
        .flat_map(|i| engine.export_sessions(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10 + i)), 0))
        .collect();
    let export = t.elapsed();
    assert_eq!(records.len() as u64, n);
    let before = LIVE.load(Ordering::Relaxed);
    let map: HashMap<SessionKeyRecord, SessionRecord> = records.iter().map(|r| (r.key(), *r)).collect();
    let after = LIVE.load(Ordering::Relaxed);
    println!(
        "standby map: {} records in HashMap<SessionKeyRecord, SessionRecord> (key {} + value {} bytes, capacity {}): {:.1} bytes/record allocated; export of {n} sessions took {:?}",
        map.len(),
        std::mem::size_of::<SessionKeyRecord>(),
        std::mem::size_of::<SessionRecord>(),
        map.capacity(),
        (after - before) as f64 / map.len() as f64,
        export,
    );
}
