//! The lab itself, without Egret: every pod reaches the server through the
//! gateway's kernel, untranslated (so any translation seen in the other
//! tests is Egret's doing), in both cablings. Also checks that nothing
//! answers ARP for the egress IPs while Egret is not running.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use std::time::{Duration, Instant};

use egret_tests::capture::Capture;
use egret_tests::client;
use egret_dataplane::fixtures::build::arp_request;
use egret_tests::frames::{parse_arp, RawLink};
use egret_tests::lab::{Arm, Lab, LabOptions};
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
