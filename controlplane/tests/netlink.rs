//! The rtnetlink watcher in a network namespace (root): the first `Fib`
//! mirrors links and routes, a route change is published, a route gateway is
//! resolved proactively, and a resolution request from the engine is
//! resolved by the kernel and shows up as a neighbour.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::net::IpAddr;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{ip, mac, netns, veth};
use egret_controlplane::netlink::Watcher;
use egret_dataplane::engine::ResolveRequest;
use egret_dataplane::fib::{Fib, NextHop};

fn addr(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Waits for a published Fib that satisfies `want`.
fn wait_for(rx: &mpsc::Receiver<Fib>, what: &str, want: impl Fn(&Fib) -> bool) -> Fib {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(f) if want(&f) => return f,
            Ok(_) => {}
            Err(_) => panic!("no Fib with {what} within 5 s"),
        }
    }
}

#[test]
fn watcher_mirrors_the_kernel_and_resolves_next_hops() {
    let ns = netns("egnl", &["gw", "peer"]);
    let (gw, peer) = (ns.name(0).to_string(), ns.name(1).to_string());
    veth(&gw, "gw0", "192.0.2.1/24", &peer, "peer0", "192.0.2.2/24");
    ip(&["-n", &peer, "addr", "add", "192.0.2.3/24", "dev", "peer0"]);
    ip(&["-n", &peer, "addr", "add", "192.0.2.4/24", "dev", "peer0"]);
    ip(&["-n", &gw, "route", "add", "198.51.100.0/24", "via", "192.0.2.2"]);
    let gw_mac = mac(&gw, "gw0");
    let peer_mac = mac(&peer, "peer0");
    let gw_if = common::ifindex(&gw, "gw0");

    let (tx, rx) = mpsc::channel::<Fib>();
    let requests: Arc<Mutex<Vec<ResolveRequest>>> = Arc::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let thread = {
        let (gw, requests) = (gw.clone(), requests.clone());
        std::thread::spawn(move || {
            egret_dataplane::netns::enter_named(&gw).unwrap();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                let running = Watcher::new(vec!["gw0".into()]).start().await.unwrap();
                running
                    .run(
                        move |f| {
                            let _ = tx.send(f);
                        },
                        move || std::mem::take(&mut *requests.lock().unwrap()),
                        stop_rx,
                    )
                    .await;
            });
        })
    };

    // The first snapshot: the driven interface with its MAC and the route.
    let first = rx.recv_timeout(Duration::from_secs(5)).expect("first Fib");
    let iface = first.interface(gw_if).expect("gw0 in the Fib");
    assert_eq!((iface.name.as_str(), iface.mac, iface.mtu), ("gw0", gw_mac, 1500));
    assert_eq!(first.interfaces().count(), 1, "only driven interfaces");
    assert_eq!(
        first.next_hop(addr("198.51.100.7")),
        NextHop::Unresolved { oif: gw_if, addr: addr("192.0.2.2") },
        "the gateway is not resolved yet"
    );

    // The route's gateway is resolved proactively.
    wait_for(&rx, "the gateway resolved", |f| {
        f.next_hop(addr("198.51.100.7")) == NextHop::Resolved { oif: gw_if, src_mac: gw_mac, dst_mac: peer_mac }
    });

    // A route change is published.
    ip(&["-n", &gw, "route", "add", "203.0.113.0/24", "via", "192.0.2.3"]);
    wait_for(&rx, "the new route", |f| {
        f.route(addr("203.0.113.9")).is_some_and(|r| r.gateway == Some(addr("192.0.2.3")))
    });

    // A resolution request from the engine for an on-link host.
    assert!(matches!(first.next_hop(addr("192.0.2.4")), NextHop::Unresolved { .. }));
    requests.lock().unwrap().push(ResolveRequest { ifindex: gw_if, addr: addr("192.0.2.4") });
    wait_for(&rx, "192.0.2.4 resolved", |f| {
        f.next_hop(addr("192.0.2.4")) == NextHop::Resolved { oif: gw_if, src_mac: gw_mac, dst_mac: peer_mac }
    });
    let entry = ip(&["-n", &gw, "neigh", "show", "192.0.2.4", "dev", "gw0"]);
    assert!(entry.contains("REACHABLE") && !entry.contains("PERMANENT"), "{entry}");

    // A neighbour change made by someone else, and its removal.
    ip(&["-n", &gw, "neigh", "replace", "192.0.2.9", "lladdr", "02:00:00:00:00:09", "dev", "gw0", "nud", "permanent"]);
    wait_for(&rx, "the static neighbour", |f| f.neighbor(gw_if, addr("192.0.2.9")) == Some([2, 0, 0, 0, 0, 9]));
    ip(&["-n", &gw, "neigh", "del", "192.0.2.9", "dev", "gw0"]);
    wait_for(&rx, "the static neighbour gone", |f| f.neighbor(gw_if, addr("192.0.2.9")).is_none());

    stop_tx.send(true).unwrap();
    thread.join().unwrap();
}
