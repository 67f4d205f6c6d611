//! Path MTU discovery through the gateway: the upstream router's link to
//! the server has MTU 1400, so it answers oversized DF packets from an
//! egress IP with ICMP fragmentation-needed (RFC 792, RFC 1191). Egret must
//! translate the error back to the pod (matching its embedded header), so
//! the pod's kernel learns the path MTU, fragments UDP and shrinks TCP
//! segments, and a large upload completes.

use std::time::{Duration, Instant};

use egret_dataplane::stats::Event;
use egret_tests::client;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};
use egret_tests::server::Proto;

both_tiers!(icmp_frag_needed_reaches_the_pod, frag_needed_reaches_the_pod);

fn frag_needed_reaches_the_pod(name: &str, tier: Tier) {
    let opts = LabOptions { server_link_mtu: Some(1400), ..LabOptions::for_test() };
    let Some(mut h) = crate::start_in(name, tier, opts, |_| {}) else { return };
    let translated = Event::IcmpErrorTranslated.name();
    let before = h.counters().unwrap();
    let a = h.lab.pod(Pod::A);
    let server = std::net::IpAddr::from(plan::SERVER);
    assert_eq!(client::cached_pmtu(a, server).unwrap(), None, "no PMTU cached before");

    // A 1500-byte datagram (1472 bytes of UDP payload): the pod's kernel sets
    // DF (IP_PMTUDISC_WANT, the default), the upstream router cannot forward
    // it and says so to E1.
    let s = client::udp_socket(a, Pod::A.echo_endpoint()).unwrap();
    let big = "B".repeat(1472);
    s.send(big.as_bytes()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    let mtu = loop {
        if let Some(m) = client::cached_pmtu(a, server).unwrap() {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "pod A never learned the path MTU; counters {:?}",
            h.counters().unwrap().delta(&before)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(mtu, 1400, "`ip route get {server}` in pod A shows the path's MTU");
    let c = h.counters().unwrap();
    assert!(c.get(translated) > before.get(translated), "icmp_error_translated counted: {:?}", c.delta(&before));

    // The ICMP error also reached the pod's connected socket: its next
    // send reports it (EMSGSIZE, RFC 1122 4.1.3.3). Then the pod fragments
    // the datagram itself; the fragments are translated (the first by its
    // ports, the rest through the fragment cache) and the server
    // reassembles a datagram from E1.
    let token = format!("C{}", "C".repeat(1471));
    let e = s.send(token.as_bytes()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE), "the socket's pending ICMP error: {e}");
    s.send(token.as_bytes()).unwrap();
    let seen = h
        .lab
        .server()
        .unwrap()
        .wait_for(Duration::from_secs(3), |x| x.proto == Proto::Udp && x.token == token)
        .expect("the server received the fragmented datagram");
    assert_eq!(seen.src.ip(), std::net::IpAddr::from(plan::E1));

    // TCP: pod C (egress E2, so the router's ICMP rate limit towards E1
    // does not delay it) uploads 2 MiB with 1460-byte segments at first.
    let c = h.lab.pod(Pod::C);
    let started = Instant::now();
    let r = client::http(c, Pod::C.http_endpoint(), "/upload", 2 << 20).unwrap();
    assert_eq!(r.seen.ip(), std::net::IpAddr::from(plan::E2));
    assert_eq!(r.rest, format!("POST /upload received={}", 2 << 20));
    assert_eq!(client::cached_pmtu(c, server).unwrap(), Some(1400), "pod C learned the path MTU too");
    eprintln!("{name}: 2 MiB upload through a 1400-byte path in {:?}", started.elapsed());
    h.finish(&[]).unwrap();
}
