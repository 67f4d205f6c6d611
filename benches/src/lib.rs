//! The end-to-end throughput benchmark (`egret-throughput`) and its parts:
//! frames and flows, the network-namespace topology, the benchmark's own XDP
//! programs (generator, redirect ceiling, sink), NAPI thread discovery, CPU
//! accounting from /proc, and the Egret daemon harness. The lead's criterion
//! benchmarks live in `benches/benches/`.
//!
//! | file | owns |
//! |---|---|
//! | `bench.rs` | modes, their setup/teardown and placement, the measurement window |
//! | `egret.rs` | the Egret daemon: config, start, readiness, stop |
//! | `report.rs` | medians, spreads, ratios, the table |
//! | `frame.rs` | 64-byte IPv4/UDP frames, RFC 1071 checksums, flow sets, the nodes' tunnel frames |
//! | `cpu.rs` | /proc parsers and per-window CPU use of watched threads and cores |
//! | `topology.rs` | namespaces, veths, addresses, the teardown guard |
//! | `generator.rs` | the generator thread (XDP live frames or AF_PACKET) |
//! | `xdp.rs` | loading and attaching `xdp/*.bpf.c` (generator, redirect, sink) |
//! | `napi.rs` | NAPI instances and their kthreads over netdev netlink |
//! | `sys.rs` | raw syscalls (the only unsafe code) |
#![deny(unsafe_code)]

pub mod bench;
pub mod collector;
pub mod cpu;
pub mod egret;
pub mod frame;
pub mod generator;
pub mod napi;
pub mod report;
pub mod sys;
pub mod topology;
pub mod xdp;
