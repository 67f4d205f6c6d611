//! End-to-end tests: each builds its own lab (unique namespaces, deleted on
//! drop), runs the real `egret` daemon in it and checks what the external
//! server sees, what comes back to the pods, the gateway's counters, and a
//! capture of the outside link. They need root and are skipped (with a
//! message) without it. docs/lab.md lists what each one proves.
//!
//! Flow tests run in both tiers ([`Tier`]): `<test>::fast_path` with the XDP
//! fast path on (and the harness requires that it translated frames) and
//! `<test>::userspace` with it off; [`both_tiers!`] makes the pair.
//!
//! The daemon binary is built on first use with this test's profile (see
//! `egret_tests::gateway::egret_binary`), or taken from `$EGRET_BIN`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

/// `both_tiers!(name, body)`: a module `name` with tests `fast_path` and
/// `userspace`, each calling `body(test_name, tier)`.
macro_rules! both_tiers {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn fast_path() {
                super::$body(concat!(stringify!($name), "-fast_path"), egret_tests::harness::Tier::FastPath);
            }

            #[test]
            fn userspace() {
                super::$body(concat!(stringify!($name), "-userspace"), egret_tests::harness::Tier::Userspace);
            }
        }
    };
}

mod fastpath;
mod flood;
mod flows;
mod fragments;
mod inbound;
mod ipv6;
mod local;
mod malformed;
mod neighbors;
mod overlay;
mod pmtu;
mod port_blocks;
mod reload;
mod restart;
mod rst;
mod traffic;
mod translog;

use egret_tests::gateway::GatewayConfig;
use egret_tests::harness::{Harness, Tier};
use egret_tests::lab::LabOptions;

/// Starts a harness for `name`, or returns `None` (test skipped) when not root.
pub fn start(name: &str, opts: LabOptions, tweak: impl FnOnce(&mut GatewayConfig)) -> Option<Harness> {
    if !egret_tests::lab_available(name) {
        return None;
    }
    Some(Harness::start(name, opts, tweak).unwrap_or_else(|e| panic!("{name}: lab/gateway setup failed: {e}")))
}

/// [`start`] in `tier`.
pub fn start_in(name: &str, tier: Tier, opts: LabOptions, tweak: impl FnOnce(&mut GatewayConfig)) -> Option<Harness> {
    if !egret_tests::lab_available(name) {
        return None;
    }
    Some(
        Harness::start_in(name, tier, opts, tweak)
            .unwrap_or_else(|e| panic!("{name} [{}]: lab/gateway setup failed: {e}", tier.name())),
    )
}

/// Established flows of `pod` in `h`'s tier: a TCP line-echo connection and
/// a UDP socket, each exchanging `rounds` times after it is confirmed, with
/// the same external address every time. With the fast path on, waits until
/// both sessions are installed in the kernel and requires every later round
/// to have been translated there (both directions: at least two hits a
/// round); with it off, requires that nothing was. Returns the external
/// addresses (TCP, UDP).
pub fn established_flows(h: &Harness, pod: egret_tests::plan::Pod, rounds: usize) -> (SocketAddr, SocketAddr) {
    use egret_tests::client::{self, TcpSession};
    let ns = h.lab.pod(pod);
    let installed = |c: &egret_tests::gateway::Counters| c.get_path("fast_path.offloads.installed");
    let before = h.counters().unwrap();
    let mut tcp = TcpSession::connect(ns, pod.echo_endpoint()).unwrap();
    let first = tcp.line(&format!("{}-tcp-first", pod.name())).unwrap();
    let udp = client::udp_socket(ns, pod.echo_endpoint()).unwrap();
    let (ufirst, _) =
        client::udp_exchange(&udp, &format!("{}-udp-first", pod.name()), 3, Duration::from_secs(1)).unwrap();
    let fast = h.tier == Some(Tier::FastPath);
    if fast {
        h.wait_counters(Duration::from_secs(3), "both sessions installed in the fast path", |c| {
            installed(c) >= installed(&before) + 2
        })
        .unwrap();
    }
    // `egret sessions` says which path each session takes.
    let offloaded =
        h.gw.admin()
            .sessions_json(1000)
            .unwrap()
            .iter()
            .filter(|r| r["pod"].as_str() == Some(&pod.addr().to_string()) && r["offloaded"].as_bool() == Some(true))
            .count();
    if fast {
        assert!(offloaded >= 2, "{pod:?}: `egret sessions` shows {offloaded} sessions in XDP");
    } else {
        assert_eq!(offloaded, 0, "{pod:?}: fast path off, yet sessions shown in XDP");
    }
    let mid = h.counters().unwrap();
    for i in 0..rounds {
        let r = tcp.line(&format!("{}-tcp-{i}", pod.name())).unwrap();
        assert_eq!(r.seen, first.seen, "{pod:?}: TCP round {i} keeps its translation");
        let (r, _) = client::udp_exchange(&udp, &format!("{}-udp-{i}", pod.name()), 3, Duration::from_secs(1)).unwrap();
        assert_eq!(r.seen, ufirst.seen, "{pod:?}: UDP round {i} keeps its translation");
    }
    let end = h.counters().unwrap();
    let hits = end.fast_path_hits() - mid.fast_path_hits();
    if fast {
        assert!(
            hits >= 4 * rounds as u64,
            "{pod:?}: {rounds} TCP and UDP round trips on installed sessions made only {hits} fast-path hits; {:?}",
            end.delta(&mid)
        );
    } else {
        assert_eq!(end.fast_path_hits(), 0, "fast path off: nothing translated in XDP");
    }
    (first.seen, ufirst.seen)
}

use std::net::SocketAddr;
use std::time::Duration;
