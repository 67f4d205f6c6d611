//! SIGHUP reload: moving policy "a" to another egress IP moves its new flows
//! there, while a live TCP connection of policy "c" (unchanged) keeps
//! working through the reload with the same external address and port.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use egret_tests::client::{self, TcpSession};
use egret_tests::gateway::EgressIp;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

both_tiers!(sighup_reload_moves_new_flows_keeps_live_tcp, reload_moves_new_flows);

fn reload_moves_new_flows(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |cfg| {
        cfg.egress_ips.push(EgressIp { ip: plan::E3.into(), ports: None, answer_neighbor: true });
    }) else {
        return;
    };
    let cfg0 = h.gw.current.clone();
    crate::established_flows(&h, Pod::C, 3);
    let mut live = TcpSession::connect(h.lab.pod(Pod::C), Pod::C.echo_endpoint()).unwrap();
    let first = live.line("before").unwrap();
    assert_eq!(first.seen.ip(), IpAddr::from(plan::E2));
    let r = client::udp_echo(h.lab.pod(Pod::A), Pod::A.echo_endpoint(), "a-before").unwrap();
    assert_eq!(r.seen.ip(), IpAddr::from(plan::E1));

    let mut cfg1 = cfg0.clone();
    cfg1.policy_mut("a").unwrap().egress_ips = vec![plan::E3.into(), plan::E6.into()];
    h.gw.reload(&cfg1).unwrap();
    let t = Instant::now();
    let moved = loop {
        // A new flow each time (a fresh socket).
        let r = client::udp_echo(h.lab.pod(Pod::A), Pod::A.echo_endpoint(), "a-after").unwrap();
        if r.seen.ip() == IpAddr::from(plan::E3) {
            break t.elapsed();
        }
        assert_eq!(r.seen.ip(), IpAddr::from(plan::E1), "before the reload applies, E1");
        assert!(t.elapsed() < Duration::from_secs(5), "policy a's new flows never moved to E3");
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("{name}: new flows on E3 {moved:?} after SIGHUP");
    let r = client::http(h.lab.pod(Pod::B), Pod::B.http_endpoint(), "/b-after", 0).unwrap();
    assert_eq!(r.seen.ip(), IpAddr::from(plan::E3), "pod B's new TCP flow too");

    // The live connection of the unchanged policy still works, with the same
    // translation (with the fast path on, in XDP: the reload did not fence it).
    let hits = h.fast_path_hits().unwrap();
    for i in 0..5 {
        let r = live.line(&format!("after-{i}")).unwrap();
        assert_eq!(r.seen, first.seen, "the live TCP connection keeps its external address and port");
        std::thread::sleep(Duration::from_millis(100));
    }
    if tier == Tier::FastPath {
        assert!(h.fast_path_hits().unwrap() >= hits + 10, "policy c's live connection stayed in the fast path");
    }
    h.finish(&[cfg0]).unwrap();
}
