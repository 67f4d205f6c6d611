//! Egret's dataplane: everything a gateway does to a frame.
//!
//! The engine is a pure library: one entry point, [`engine::Pipeline::process`],
//! takes one Ethernet frame in place and returns an [`engine::Verdict`]. Time
//! is passed in, so every test is deterministic. The AF_XDP I/O and the
//! worker loop drive the same code as the tests, the fuzzer and the
//! benchmarks.
//!
//! Where things live:
//! - [`wire`]: zero-copy views over packet bytes and checksums.
//! - [`dissect`]: reads a frame once into offsets and fields.
//! - [`policy`], [`lpm`]: which sources and destinations a policy selects.
//! - [`tables`]: the configuration snapshot the control plane publishes.
//! - [`fib`]: interfaces, routes and neighbours from the kernel.
//! - [`icmp_gen`]: ICMP errors the gateway originates as a router (Time
//!   Exceeded, Fragmentation Needed, Packet Too Big), rate-limited.
//! - [`nat`]: sessions (both directions), mappings and port allocation, TCP
//!   state, expiry, fragments, ICMP errors, the rewrite itself.
//! - [`neigh_responder`]: ARP and NDP answers for owned addresses.
//! - [`engine`]: the per-frame pipeline and its verdicts.
//! - [`kernel_tx`]: translated packets to pods behind an overlay's tunnel,
//!   handed to the gateway's kernel (raw sockets).
//! - [`stats`]: named drop reasons and per-worker counters.
//! - [`translog`]: translation log records (a session's creation and end)
//!   and the per-worker rings the control plane drains (ADR 0034).
//! - [`xsk`]: AF_XDP sockets, rings and UMEM (the crate's unsafe code, with
//!   [`netns`]'s `setns` and `if_nametoindex` calls).
//! - [`netns`]: entering a named network namespace; with `fixtures`, the
//!   guard that creates namespaces for tests and benchmarks.
//! - [`prefetch`]: the cache-line hint a batch uses (VPP-style staging).
//! - [`spin_lock`]: the mutex of the new-flow path's short sections (ADRs 0045, 0046).
//! - [`worker`]: the worker loop that moves frames between AF_XDP and a
//!   [`worker::FrameHandler`].
//! - [`handler`]: the daemon's frame handler, [`handler::EngineHandler`]: the
//!   engine's verdicts turned into the worker loop's actions, the expiry
//!   sweep's pace, announcements, and the hand-off to the kernel.
//! - [`clock`]: engine time, and the daemon's [`clock::EngineClock`].
#![deny(unsafe_code)]

pub mod clock;
pub mod dissect;
pub mod engine;
pub mod fib;
#[cfg(any(test, feature = "fixtures"))]
#[allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]
pub mod fixtures;
pub mod handler;
pub mod huge_pages;
pub mod icmp_gen;
pub mod ingress;
pub mod kernel_tx;
pub mod lpm;
pub mod nat;
pub mod neigh_responder;
pub mod netns;
pub mod ownership;
pub mod policy;
pub mod prefetch;
pub mod spin_lock;
pub mod stats;
pub mod tables;
pub mod translog;
pub mod tunnel;
pub mod wire;
pub mod worker;
pub mod xsk;
