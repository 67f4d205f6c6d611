//! End-to-end tests: each builds its own lab (unique namespaces, deleted on
//! drop), runs the real `egret` daemon in it and checks what the external
//! server sees, what comes back to the pods, the gateway's counters, and a
//! capture of the outside link. They need root and are skipped (with a
//! message) without it. docs/lab.md lists what each one proves.
//!
//! The daemon binary is built on first use with this test's profile (see
//! `egret_tests::gateway::egret_binary`), or taken from `$EGRET_BIN`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

mod flows;
mod inbound;
mod ipv6;
mod malformed;
mod pmtu;
mod reload;
mod restart;
mod traffic;

use egret_tests::gateway::GatewayConfig;
use egret_tests::harness::Harness;
use egret_tests::lab::LabOptions;

/// Starts a harness for `name`, or returns `None` (test skipped) when not root.
pub fn start(name: &str, opts: LabOptions, tweak: impl FnOnce(&mut GatewayConfig)) -> Option<Harness> {
    if !egret_tests::lab_available(name) {
        return None;
    }
    Some(Harness::start(name, opts, tweak).unwrap_or_else(|e| panic!("{name}: lab/gateway setup failed: {e}")))
}
