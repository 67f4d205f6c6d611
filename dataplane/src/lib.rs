//! Egret's dataplane: everything a gateway does to a frame.
//!
//! The engine is a pure library: one entry point takes one Ethernet frame in
//! place and returns a verdict. Time is passed in, so every test is
//! deterministic. The AF_XDP I/O and the worker loop drive the same code as the
//! tests, the fuzzer and the benchmarks.
#![deny(unsafe_code)]

pub mod xsk;
pub mod worker;
