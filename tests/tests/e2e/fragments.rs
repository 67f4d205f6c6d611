//! Fragments out of order (RFC 4787 REQ-14: a NAT must accept fragments in
//! and out of order): a 3,000-byte UDP datagram cut into fragments at
//! offsets 0, 1200 and 2400 is sent last first, from a pod to the server and
//! from the server back to the pod's mapping, in both families. The gateway
//! holds the later fragments until the first decides (worker.rs), then
//! translates them all; the receiving kernel reassembles the datagram. A
//! flood of orphan fragments from the outside just before does not stop a
//! pod's.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use egret_dataplane::fixtures::{self, build::Packet};
use egret_dataplane::stats::{DropReason, Event};
use egret_tests::client;
use egret_tests::harness::{Harness, Tier};
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};
use egret_tests::server::Proto;

both_tiers!(fragments_out_of_order_cross_both_ways, fragments_out_of_order);

fn fragments_out_of_order(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    // Established flows beside them (in XDP with the fast path on, which
    // leaves every fragment to the workers).
    crate::established_flows(&h, Pod::A, 2);

    // A flood of orphan fragments to the egress IP from the outside: the
    // program lets at most its budget through, the workers hold at most
    // their bound, displacing only the flood's own (held apart from pods'),
    // and a pod's reordered datagrams cross right after it.
    let flooded = h.counters().unwrap();
    let orphans: Vec<Vec<u8>> = (0..2000u16)
        .map(|i| datagram(plan::SERVER.into(), plan::E1.into(), 9, 45_000, &[0u8; 3000], 0x9000 + i).remove(1))
        .collect();
    client::send_ip_packets(h.lab.server_ns(), plan::E1.into(), &orphans).unwrap();
    reordered_both_ways(&h, Pod::A, 41_000);
    let c = h.counters().unwrap();
    let d = |n: &str| c.get(n) - flooded.get(n);
    assert!(d(DropReason::FragmentHoldOverflow.name()) >= 100, "the flood displaced its own: {:?}", c.delta(&flooded));
    assert!(d(Event::FragmentHeldSent.name()) >= 4, "pod A's fragments were sent: {:?}", c.delta(&flooded));
    eprintln!(
        "{name}: 2,000 orphan fragments: {} reached the workers, {} dropped in XDP, {} displaced in the hold",
        d("redirect_fragment_to_egress"),
        d("drop_fragment_rate"),
        d(DropReason::FragmentHoldOverflow.name())
    );
    // The flood's held fragments time out (1 s).
    std::thread::sleep(Duration::from_millis(1500));

    let before = h.counters().unwrap();
    for (pod, port) in [(Pod::A, 41_002), (Pod::V6, 41_006)] {
        reordered_both_ways(&h, pod, port);
    }
    let c = h.counters().unwrap();
    let d = |n: &str| c.get(n) - before.get(n);
    // Two directions, two families, two later fragments each: every one
    // was held and then sent; none was dropped (the flood's are gone).
    assert!(d(Event::FragmentHeld.name()) >= 8, "fragment_held: {:?}", c.delta(&before));
    assert_eq!(d(Event::FragmentHeldSent.name()), d(Event::FragmentHeld.name()), "{:?}", c.delta(&before));
    for r in [DropReason::FragmentUnmatched, DropReason::FragmentHoldTimeout, DropReason::FragmentHoldOverflow] {
        assert_eq!(d(r.name()), 0, "{}: {:?}", r.name(), c.delta(&before));
    }
    assert_eq!(d("drop_fragment"), 0, "XDP dropped a fragment: {:?}", c.delta(&before));
    h.finish(&[]).unwrap();
}

/// From `pod` (its socket on `port`): a datagram to the server's echo port
/// and one from it to the pod's mapping, each as three fragments sent last
/// first.
fn reordered_both_ways(h: &Harness, pod: Pod, port: u16) {
    let ns = h.lab.pod(pod);
    let egress = pod.egress().expect("a selected pod");
    let s = client::udp_socket_from(ns, port, pod.echo_endpoint()).unwrap();
    // The mapping the server sees.
    let (r, _) = client::udp_exchange(&s, &format!("map-{}", pod.name()), 3, Duration::from_secs(1)).unwrap();
    assert_eq!(r.seen.ip(), egress);
    let mapped = r.seen.port();

    // Out: the server reassembles a datagram from the egress IP's mapping.
    let token = format!("out-{}-{port}-{}", pod.name(), "o".repeat(2980));
    let out = datagram(pod.addr(), pod.server(), port, plan::ECHO_PORT, token.as_bytes(), ident(port, 0));
    client::send_ip_packets(ns, pod.server(), &last_first(&out)).unwrap();
    let seen = h
        .lab
        .server()
        .unwrap()
        .wait_for(Duration::from_secs(5), |x| x.proto == Proto::Udp && x.token == token)
        .unwrap_or_else(|| panic!("{}: the server never reassembled the reordered datagram", pod.name()));
    assert_eq!(seen.src, SocketAddr::new(egress, mapped), "{}: it left as the egress IP's mapping", pod.name());

    // Back: the pod's socket receives the datagram the server's side sent
    // to the mapping, last fragment first.
    let payload: Vec<u8> = (0..3000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let back = datagram(pod.server(), egress, plan::ECHO_PORT, mapped, &payload, ident(port, 1));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    // The echo of the datagram sent out may still be on its way: read past it.
    client::send_ip_packets(h.lab.server_ns(), egress, &last_first(&back)).unwrap();
    let mut buf = vec![0u8; 65536];
    loop {
        let n = client::udp_recv(&s, &mut buf)
            .unwrap_or_else(|e| panic!("{}: the reordered datagram never reached the pod: {e}", pod.name()));
        if buf[..n] == payload[..] {
            break;
        }
    }
}

/// A UDP datagram from `src`:`sport` to `dst`:`dport` with identification
/// `ident`, as fragments of 1,200 transport bytes (IP packets, no Ethernet).
fn datagram(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, payload: &[u8], ident: u16) -> Vec<Vec<u8>> {
    let mut p: Packet = fixtures::from_pod(src, dst, fixtures::udp(sport, dport, payload));
    p.ident = ident;
    p.fragments(1200).into_iter().map(|f| f[14..].to_vec()).collect()
}

/// A datagram's identification, unique per test datagram: a sender must not
/// reuse one for the same source, destination and protocol while an earlier
/// datagram's fragments may live (RFC 6864 section 4.1). A reused one is the
/// earlier datagram to every fragment cache: the XDP program steers its later
/// fragments by the earlier first fragment's decision, and the workers
/// translate them with the earlier translation while it lives (1-2 s), so
/// none is held, and whether it is depends on the clock.
fn ident(port: u16, direction: u16) -> u16 {
    0x4000 + (port - 41_000) * 2 + direction
}

fn last_first(fragments: &[Vec<u8>]) -> Vec<Vec<u8>> {
    assert_eq!(fragments.len(), 3, "three fragments");
    fragments.iter().rev().cloned().collect()
}
