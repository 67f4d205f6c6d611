//! Path MTU discovery through the gateway: the upstream router's link to
//! the server has MTU 1400, so it answers oversized DF packets from an
//! egress IP with ICMP fragmentation-needed (RFC 792, RFC 1191). Egret must
//! translate the error back to the pod (matching its embedded header), so
//! the pod's kernel learns the path MTU, fragments UDP and shrinks TCP
//! segments, and a large upload completes.

use std::time::{Duration, Instant};

use egret_dataplane::stats::{DropReason, Event};
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

both_tiers!(gateway_link_mtu_sends_frag_needed, gateway_link_mtu);

/// Issue 14 item 12: the gateway's own outside link is narrower (MTU 1280)
/// than its inside one (1500). A DF datagram of 1500 bytes from a pod gets
/// Fragmentation Needed from the gateway itself, with the next-hop MTU, so
/// the pod learns a path MTU of 1280 (before, the gateway sent the frame
/// and the link dropped it in silence, every time); a TCP upload then
/// completes with PMTUD. Both tiers: a confirmed session's large packets
/// must be punted by the XDP fast path too.
fn gateway_link_mtu(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    h.lab.gateway_ns().ip_batch(&["link set dev outside mtu 1280".into()]).unwrap();
    h.lab.upstream().ip_batch(&["link set dev gw mtu 1280".into()]).unwrap();
    let before = h.counters().unwrap();
    let a = h.lab.pod(Pod::A);
    let server = std::net::IpAddr::from(plan::SERVER);

    // The daemon learns the new MTU over rtnetlink within moments; until
    // then a datagram may still leave and die on the link, so send again.
    let s = client::udp_socket(a, Pod::A.echo_endpoint()).unwrap();
    let big = "M".repeat(1472);
    let deadline = Instant::now() + Duration::from_secs(5);
    let mtu = loop {
        let _ = s.send(big.as_bytes());
        std::thread::sleep(Duration::from_millis(100));
        if let Some(m) = client::cached_pmtu(a, server).unwrap() {
            break m;
        }
        assert!(
            Instant::now() < deadline,
            "pod A never learned the path MTU; counters {:?}",
            h.counters().unwrap().delta(&before)
        );
    };
    assert_eq!(mtu, 1280, "the gateway's Fragmentation Needed carries its link's MTU");
    let c = h.counters().unwrap();
    for counter in [DropReason::MtuExceeded.name(), Event::IcmpErrorSent.name()] {
        assert!(c.get(counter) > before.get(counter), "{counter} counted: {:?}", c.delta(&before));
    }

    // TCP from pod C: 1460-byte segments at first, then what PMTUD learns
    // from the gateway.
    let c_pod = h.lab.pod(Pod::C);
    let r = client::http(c_pod, Pod::C.http_endpoint(), "/upload", 2 << 20).unwrap();
    assert_eq!(r.seen.ip(), std::net::IpAddr::from(plan::E2));
    assert_eq!(r.rest, format!("POST /upload received={}", 2 << 20));
    assert_eq!(client::cached_pmtu(c_pod, server).unwrap(), Some(1280), "pod C learned it from the gateway");
    h.finish(&[]).unwrap();
}

/// Issue 14 item 12: traceroute through the gateway. A probe with TTL 1
/// expires at the node router; with TTL 2 it reaches the gateway with TTL 1,
/// which answers Time Exceeded from its inside address (before, it dropped
/// the probe in silence: the hop showed as `*`); with TTL 3 the upstream
/// router answers, about the translated probe, and Egret translates its
/// error back to the pod.
#[test]
fn traceroute_shows_the_gateway_as_a_hop() {
    let name = "traceroute_shows_the_gateway_as_a_hop";
    let Some(mut h) = crate::start_in(name, Tier::Userspace, LabOptions::for_test(), |_| {}) else { return };
    let a = h.lab.pod(Pod::A);
    let hop = |ttl: u8| {
        let out = a
            .command("ping")
            .args(["-n", "-c", "1", "-W", "2", "-t", &ttl.to_string(), &plan::SERVER.to_string()])
            .output()
            .expect("ping (iputils-ping, tests/install-deps.sh)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let expect: [(u8, std::net::IpAddr); 3] =
        [(1, Pod::A.first_hop()), (2, plan::GW_INSIDE.into()), (3, plan::UPSTREAM.into())];
    for (ttl, from) in expect {
        let out = hop(ttl);
        assert!(
            out.contains(&format!("From {from} icmp_seq=1 Time to live exceeded")),
            "TTL {ttl}: expected Time Exceeded from {from}; ping said:\n{out}"
        );
    }
    let c = h.counters().unwrap();
    assert!(c.get(Event::IcmpErrorSent.name()) >= 1, "icmp_error_sent counted");
    h.finish(&[]).unwrap();
}
