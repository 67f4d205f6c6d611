//! The lab itself, without Egret: every pod reaches the server through the
//! gateway's kernel, untranslated (so any translation seen in the other
//! tests is Egret's doing), in both cablings. Also checks that nothing
//! answers ARP for the egress IPs while Egret is not running, and that the
//! capture the tests read frames from keeps up with the wire.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use std::time::{Duration, Instant};

use egret_dataplane::fixtures::build::arp_request;
use egret_tests::capture::{self, Capture};
use egret_tests::client;
use egret_tests::frames::{parse_arp, RawLink};
use egret_tests::gateway::GatewayConfig;
use egret_tests::lab::{Arm, Lab, LabOptions};
use egret_tests::netns::NetNs;
use egret_tests::plan::{self, Pod};

fn kernel_path(arm: Arm) {
    let t = Instant::now();
    let lab = Lab::build(LabOptions { arm, ..LabOptions::for_test() }).unwrap();
    println!("lab built in {:?}", t.elapsed());
    let cap = Capture::start(lab.upstream(), "gw").unwrap();
    for pod in Pod::ALL {
        let ns = lab.pod(pod);
        let udp = client::udp_echo(ns, pod.echo_endpoint(), &format!("udp-{}", pod.name())).unwrap();
        assert_eq!(udp.seen.ip(), pod.addr(), "{pod:?} UDP");
        assert_eq!(udp.seen.port(), udp.local.port(), "{pod:?} UDP port");
        let http = client::http(ns, pod.http_endpoint(), "/hello", 0).unwrap();
        assert_eq!(http.seen, http.local, "{pod:?} HTTP");
        assert_eq!(http.rest, "GET /hello received=0");
        let token = format!("ping-{}", pod.name());
        let pong = client::ping(ns, pod.server(), &token, Duration::from_secs(3)).unwrap();
        assert_eq!(pong.from, pod.server());
        let seen = lab.server().unwrap().wait_icmp(&token, Duration::from_secs(2)).unwrap();
        assert_eq!(seen.src.ip(), pod.addr(), "{pod:?} ICMP");
    }
    // Nobody answers ARP for an egress IP without Egret.
    let up = RawLink::open(lab.upstream(), "gw").unwrap();
    up.send(&arp_request(plan::UP_MAC, plan::UPSTREAM.octets(), plan::E1.octets())).unwrap();
    let answer = up
        .recv_matching(Duration::from_millis(300), |f| parse_arp(f).is_some_and(|a| a.op == 2 && a.spa == plan::E1))
        .unwrap();
    assert_eq!(answer, None);
    let frames = cap.stop().unwrap();
    assert!(frames.len() > 10, "capture saw {} frames", frames.len());
    // The leak check the e2e tests rely on can fail: without Egret, every
    // selected pod's traffic is a leak under the default configuration, and
    // the unselected pod's is not.
    let cfg = GatewayConfig::lab_default(&lab);
    let leaks = capture::leaks(&frames, lab.gateway_outside_mac(), |s, d| cfg.selects(s, d));
    for pod in [Pod::A, Pod::B, Pod::C, Pod::V6] {
        let from = format!(": {} -> ", pod.addr());
        assert!(leaks.iter().any(|l| l.contains(&from)), "{pod:?}'s untranslated traffic is flagged: {leaks:?}");
    }
    assert!(!leaks.iter().any(|l| l.contains(&format!(": {} -> ", plan::POD_U))), "pod U is not a leak");
    println!("{arm:?}: {} frames on the outside link, total {:?}", frames.len(), t.elapsed());
}

#[test]
fn kernel_path_two_arm() {
    if egret_tests::lab_available("kernel_path_two_arm") {
        kernel_path(Arm::Two);
    }
}

#[test]
fn kernel_path_one_arm() {
    if egret_tests::lab_available("kernel_path_one_arm") {
        kernel_path(Arm::One);
    }
}

/// The lab with the kernel's own SNAT (nftables) in place of Egret, as a
/// reference: the path-MTU topology behaves as the Egret test expects (the
/// upstream router sends fragmentation-needed, a NAT that translates it
/// lets the pod learn the MTU 1400, fragment UDP and upload over TCP). If
/// this passes and `e2e::pmtu` fails, the difference is Egret's.
#[test]
fn reference_kernel_snat_pmtu() {
    if !egret_tests::lab_available("reference_kernel_snat_pmtu") {
        return;
    }
    let lab = Lab::build(LabOptions { server_link_mtu: Some(1400), ..LabOptions::for_test() }).unwrap();
    let gw = lab.gateway_ns();
    for e in [plan::E1, plan::E2] {
        gw.ip(&["addr", "add", &format!("{e}/32"), "dev", "lo"]).unwrap();
    }
    let rules = format!(
        "table ip nat {{\n chain post {{\n  type nat hook postrouting priority 100;\n  \
         ip saddr 198.18.0.0/24 ip daddr != 198.51.100.128/25 oifname \"outside\" snat to {}\n  \
         ip saddr 198.18.1.0/24 ip daddr 198.51.100.0/24 oifname \"outside\" snat to {}\n }}\n}}\n",
        plan::E1,
        plan::E2
    );
    let file = lab.dir().join("reference.nft");
    std::fs::write(&file, rules).unwrap();
    gw.exec(&["nft", "-f", &file.to_string_lossy()]).unwrap();

    let a = lab.pod(Pod::A);
    let server = std::net::IpAddr::from(plan::SERVER);
    let s = client::udp_socket(a, Pod::A.echo_endpoint()).unwrap();
    s.send("B".repeat(1472).as_bytes()).unwrap();
    let t = Instant::now();
    while client::cached_pmtu(a, server).unwrap().is_none() {
        assert!(t.elapsed() < Duration::from_secs(5), "no PMTU learned");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(client::cached_pmtu(a, server).unwrap(), Some(1400));
    let token = "C".repeat(1472);
    let e = s.send(token.as_bytes()).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EMSGSIZE));
    s.send(token.as_bytes()).unwrap();
    let seen = lab
        .server()
        .unwrap()
        .wait_for(Duration::from_secs(3), |x| x.token == token)
        .expect("fragmented datagram reassembled at the server");
    assert_eq!(seen.src.ip(), std::net::IpAddr::from(plan::E1));
    let r = client::http(lab.pod(Pod::C), Pod::C.http_endpoint(), "/upload", 2 << 20).unwrap();
    assert_eq!(r.seen.ip(), std::net::IpAddr::from(plan::E2));
    assert_eq!(r.rest, format!("POST /upload received={}", 2 << 20));
}

/// The capture the tests read frames from, held behind the wire on purpose:
/// [`Capture::caught_up`] waits until every frame already on the wire is
/// read (not returning while the thread is held), and each frame's `at` is
/// when the kernel received it, not when the lagging thread read it.
#[test]
fn a_lagging_capture_catches_up_and_keeps_the_wires_times() {
    if !egret_tests::lab_available("a_lagging_capture_catches_up_and_keeps_the_wires_times") {
        return;
    }
    let ns = NetNs::create(&format!("{}{}xcap", egret_tests::lab::TEST_PREFIX, std::process::id())).unwrap();
    ns.ip_batch(&[
        "link add cap0 type veth peer name cap1".into(),
        "link set cap0 up".into(),
        "link set cap1 up".into(),
    ])
    .unwrap();
    let cap = Capture::start(&ns, "cap1").unwrap();
    let tx = RawLink::open(&ns, "cap0").unwrap();
    // An EtherType nobody answers, told apart by its first payload byte.
    let frame = |n: u8| {
        let mut f = vec![0x02, 0, 0, 0, 0, 0x01, 0x02, 0, 0, 0, 0, 0x02, 0x88, 0xb5];
        f.extend([n; 46]);
        f
    };
    let of = |frames: &[capture::Frame], n: u8| frames.iter().find(|f| f.data == frame(n)).map(|f| f.at);

    cap.hold_reading(true).unwrap();
    let sent_first = cap.started().elapsed();
    tx.send(&frame(1)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    tx.send(&frame(2)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(cap.caught_up(Duration::from_millis(200)).is_err(), "a held capture does not claim to have caught up");
    assert_eq!(of(&cap.snapshot(), 1), None, "the held thread read nothing");
    let released = cap.started().elapsed();
    cap.hold_reading(false).unwrap();
    let frames = cap.caught_up(Duration::from_secs(5)).unwrap();
    let (first, second) = (of(&frames, 1).expect("the first frame"), of(&frames, 2).expect("the second frame"));
    println!("sent at {sent_first:?}, released at {released:?}: stamped {first:?} and {second:?}");
    // Stamps taken at the read would be both at the release, 600 ms after
    // the first send. The bounds leave room for a busy machine's delays in
    // the kernel's own receive path.
    assert!(first >= sent_first, "the first frame is stamped after it was sent");
    assert!(second >= first + Duration::from_millis(100), "the frames' spacing on the wire: {:?}", second - first);
    assert!(second + Duration::from_millis(200) < released, "stamped when sent, not when read");
}
