//! Criterion benchmarks of the engine (issue "dataplane core"):
//! established-flow translation both ways with 1k, 1M and 10M live sessions
//! (in unstaged batches of 64 as the workers run them below 16,384
//! sessions, and in staged batches of 32),
//! new-flow creation, port allocation at 90 % occupancy, expiry work per tick
//! with 1M sessions, two threads sharing the table, and a fragmented datagram
//! in order and last fragment first (held, then set free), and a pod's
//! egress IP scored among a policy's IPs (paired pooling, a pod's first flow).
//!
//! `cargo bench -p egret-benches --bench engine` (all), or with a filter, e.g.
//! `cargo bench -p egret-benches --bench engine -- established`. Set
//! `EGRET_BENCH_SIZES=1000,1000000` to skip the 10M case (it needs ~3 GB and
//! a minute to populate).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::hint::black_box;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, RxMeta, Verdict};
use egret_dataplane::fixtures;
use egret_dataplane::nat::key::proto;
use egret_dataplane::nat::mapping::{MappingRequest, Mappings};
use egret_dataplane::nat::port_alloc::{PortRange, PortRng};
use egret_dataplane::tables::{paired_egress, MappingBehavior};

fn sizes() -> Vec<u64> {
    std::env::var("EGRET_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 1_000_000, 10_000_000])
}

fn established(c: &mut Criterion) {
    let mut g = c.benchmark_group("established");
    g.throughput(Throughput::Elements(1));
    g.sample_size(30);
    g.measurement_time(Duration::from_secs(5));
    for n in sizes() {
        let (engine, mut w, sh) = common::populated(n, MappingBehavior::EndpointIndependent);
        let (out, back) = common::frames(&engine, n, sh, 1 << 16, 9);
        g.bench_function(BenchmarkId::new("outbound", n), |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                black_box(common::run(&mut w, &out, fixtures::INSIDE, iters, 1));
                t.elapsed()
            })
        });
        g.bench_function(BenchmarkId::new("reply", n), |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                black_box(common::run(&mut w, &back, fixtures::OUTSIDE, iters, 1));
                t.elapsed()
            })
        });
        // The same frames in batches of 32, staged first (engine/batch.rs),
        // as the workers run them once the table holds 16k+ sessions.
        g.bench_function(BenchmarkId::new("outbound_staged", n), |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                black_box(common::run_staged(&mut w, &out, fixtures::INSIDE, iters, 1, 32));
                t.elapsed()
            })
        });
        g.bench_function(BenchmarkId::new("reply_staged", n), |b| {
            b.iter_custom(|iters| {
                let t = Instant::now();
                black_box(common::run_staged(&mut w, &back, fixtures::OUTSIDE, iters, 1, 32));
                t.elapsed()
            })
        });
        drop(w);
        drop(engine);
    }
    g.finish();
}

fn new_flow(c: &mut Criterion) {
    let mut g = c.benchmark_group("new_flow");
    g.throughput(Throughput::Elements(1));
    for mapping in [MappingBehavior::EndpointIndependent, MappingBehavior::EndpointDependent] {
        let name = match mapping {
            MappingBehavior::EndpointIndependent => "endpoint_independent",
            MappingBehavior::EndpointDependent => "endpoint_dependent",
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                // Fresh engine; frames of `iters` distinct new flows built outside the timing.
                let engine = Engine::new(&common::spec((iters as usize + 1024) * 2, mapping)).unwrap();
                engine.publish_fib(fixtures::topology());
                let mut w = engine.pipeline_seeded(PortRng::new(3));
                let sh = (4096, 1000, 1_000_000);
                let frames: Vec<Vec<u8>> = (0..iters)
                    .map(|i| {
                        let (pod, pp, remote, rp) = common::flow(i, sh.0, sh.1, sh.2);
                        fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18])).frame()
                    })
                    .collect();
                let t = Instant::now();
                let ok = common::run(&mut w, &frames, fixtures::INSIDE, iters, 1);
                let e = t.elapsed();
                assert_eq!(ok, iters, "every new flow is translated");
                e
            })
        });
    }
    g.finish();
}

fn port_allocation(c: &mut Criterion) {
    let mut g = c.benchmark_group("port_alloc");
    g.throughput(Throughput::Elements(1));
    let egress = Ipv4Addr::new(203, 0, 113, 10);
    let range = PortRange::default();
    let m = Mappings::new(true);
    let pool = m.pool(egress, proto::UDP, range, 1);
    let mut rng = PortRng::new(5);
    // Fill 90 % of the range with mappings of pods whose ports are all taken
    // already (so every allocation below is random, not preserved).
    let target = (range.len() as u64 * 9 / 10) as u32;
    let mut pod_port = 0u32;
    while pool.in_use() < target {
        let req = MappingRequest {
            egress,
            pod: Ipv4Addr::new(198, 18, 1, 1),
            pod_port: 1 + (pod_port % 30000) as u16,
            proto: proto::UDP,
        };
        pod_port += 1;
        let _ = m.acquire(&pool, MappingRequest { pod: Ipv4Addr::from(0xC612_0000 + pod_port), ..req }, 64, &mut rng);
    }
    let pod = Ipv4Addr::new(198, 19, 0, 1);
    g.bench_function("random_at_90pct_occupancy", |b| {
        let mut p = 0u16;
        b.iter(|| {
            p = p.wrapping_add(1);
            // Pod ports below the range: never preserved, always random probes.
            let req = MappingRequest { egress, pod, pod_port: 1 + (p % 30000), proto: proto::UDP };
            let a = m.acquire(&pool, req, 64, &mut rng);
            if let Some(a) = a {
                m.release(egress, pod, req.pod_port, proto::UDP, a.port());
            }
            black_box(a)
        })
    });
    g.finish();
}

fn expiry(c: &mut Criterion) {
    let mut g = c.benchmark_group("expiry");
    let n = 1_000_000;
    let (engine, mut w, _) = common::populated(n, MappingBehavior::EndpointIndependent);
    const BUDGET: u32 = 1024;
    g.throughput(Throughput::Elements(u64::from(BUDGET) * 2));
    g.bench_function("tick_1024_slots_of_1M_live", |b| {
        // Nothing expires at t = 10 s: the cost of visiting and checking.
        b.iter(|| black_box(w.tick(Timestamp::from_secs(10), BUDGET)))
    });
    drop(w);
    drop(engine);
    g.bench_function("tick_1024_slots_all_expiring", |b| {
        b.iter_custom(|iters| {
            let (engine, mut w, _) =
                common::populated(u64::from(BUDGET) * iters.min(1000), MappingBehavior::EndpointIndependent);
            let t = Instant::now();
            for _ in 0..iters {
                black_box(w.tick(Timestamp::from_secs(10_000), BUDGET));
            }
            let e = t.elapsed();
            drop(engine);
            e
        })
    });
    g.finish();
}

fn two_threads(c: &mut Criterion) {
    let mut g = c.benchmark_group("shared_table");
    g.throughput(Throughput::Elements(1));
    let n = 1_000_000;
    let (engine, w0, sh) = common::populated(n, MappingBehavior::EndpointIndependent);
    drop(w0);
    let (out, back) = common::frames(&engine, n, sh, 1 << 16, 11);
    let (out, back) = (Arc::new(out), Arc::new(back));
    g.bench_function("two_threads_outbound_and_reply_1M", |b| {
        b.iter_custom(|iters| {
            let half = iters / 2 + 1;
            let start = Arc::new(std::sync::Barrier::new(2));
            let hs: Vec<_> = [(out.clone(), fixtures::INSIDE), (back.clone(), fixtures::OUTSIDE)]
                .into_iter()
                .map(|(frames, ingress)| {
                    let mut w = engine.pipeline_seeded(PortRng::new(ingress.into()));
                    let start = start.clone();
                    std::thread::spawn(move || {
                        start.wait();
                        let t = Instant::now();
                        black_box(common::run(&mut w, &frames, ingress, half, 1));
                        t.elapsed()
                    })
                })
                .collect();
            // Aggregate rate: both threads' packets over the wall time of the slower one.
            hs.into_iter().map(|h| h.join().unwrap()).max().unwrap_or_default()
        })
    });
    g.finish();
}

/// A 3,000-byte UDP datagram of one established flow as three fragments, per
/// datagram: in order, and last fragment first (the two later ones held,
/// `HoldFragment`, then processed again after the first, as the worker loop
/// does). Distinct identifications; the engine's clock moves 3 s every 512
/// datagrams, so at most 512 of the fragment cache's 8,192 entries (2 s) live.
fn fragments(c: &mut Criterion) {
    let mut g = c.benchmark_group("fragments");
    g.throughput(Throughput::Elements(1));
    let payload = vec![7u8; 3000];
    let trains: Vec<Vec<Vec<u8>>> = (0..4096u16)
        .map(|id| {
            let mut p = fixtures::from_pod(
                fixtures::POD_A.into(),
                fixtures::SERVER.into(),
                fixtures::udp(40000, 9000, &payload),
            );
            p.ident = id;
            p.fragments(1200)
        })
        .collect();
    for last_first in [false, true] {
        g.bench_function(if last_first { "last_first" } else { "in_order" }, |b| {
            b.iter_custom(|iters| {
                let engine = Engine::new(&fixtures::base_spec()).unwrap();
                engine.publish_fib(fixtures::topology());
                let mut w = engine.pipeline_seeded(PortRng::new(3));
                w.set_hold_fragments(true);
                let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
                let mut bufs = [[0u8; 2048]; 3];
                let mut sent = 0u64;
                let t = Instant::now();
                for i in 0..iters {
                    let now = Timestamp::from_secs(1 + i / 512 * 3);
                    let train = &trains[(i % 4096) as usize];
                    for (k, f) in train.iter().enumerate() {
                        bufs[k][..f.len()].copy_from_slice(f);
                    }
                    let order: &[usize] = if last_first { &[2, 1, 0, 2, 1] } else { &[0, 1, 2] };
                    for &k in order {
                        let len = train[k].len();
                        if let Verdict::Forward { .. } = w.process(&mut bufs[k], len, meta, now) {
                            sent += 1;
                        }
                    }
                }
                let e = t.elapsed();
                // The fragment cache's 4-way buckets refuse a datagram when
                // five live ones hash alike (fragment_cache_full), rarely
                // with at most 512 live.
                assert!(sent * 1000 >= 3 * iters * 999, "{sent} of {} fragments left translated", 3 * iters);
                e
            })
        });
    }
    g.finish();
}

/// Paired pooling's score (`tables::paired_egress`): at 4 IPs what every
/// new flow pays (no memo at 4 or fewer), at [`common::EGRESS_IPS`] what a
/// pod's first new flow under a policy pays before the worker's memo knows
/// its egress IP (and again after each snapshot change).
fn egress_score(c: &mut Criterion) {
    let mut g = c.benchmark_group("egress_score");
    g.throughput(Throughput::Elements(1));
    for n in [4, common::EGRESS_IPS] {
        let ips: Vec<Ipv4Addr> = (0..n).map(|i| Ipv4Addr::new(203, 0, 113, 10 + i)).collect();
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            let mut pod = 0xC612_0000u32;
            b.iter(|| {
                pod = pod.wrapping_add(1);
                black_box(paired_egress(Ipv4Addr::from(black_box(pod)), &ips))
            })
        });
    }
    g.finish();
}

criterion_group!(benches, established, new_flow, port_allocation, expiry, two_threads, fragments, egress_score);
criterion_main!(benches);
