//! Truncated and malformed frames, injected from the node router towards
//! the gateway's inside interface with a raw socket (the fixture table's
//! "malformed" frames plus garbage), are each counted under a named reason,
//! and the gateway keeps forwarding.
//!
//! Where a frame ends up depends on how far the XDP program can read it:
//! a steered source with a readable IPv4 header goes to the engine, which
//! counts a `DropReason`; a frame whose IP header itself is unreadable is
//! passed to the kernel under the XDP verdict `pass_malformed` (the kernel
//! drops it); a frame that is not IP at all is `pass_not_ip`
//! (bpf/src/maps.rs `VerdictReason`).

use std::net::SocketAddr;
use std::time::Duration;

use egret_dataplane::fixtures::{self, Expect};
use egret_dataplane::stats::DropReason;
use egret_tests::capture::Frame;
use egret_tests::client;
use egret_tests::frames::RawLink;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

/// A frame to inject, and the counter it must move.
type Case = (&'static str, Vec<u8>, &'static str);

/// The fixture table's frames and where each should be counted here; and
/// the fixture's good frame with its expected translation.
fn cases() -> (Vec<Case>, Vec<u8>, Vec<u8>) {
    let scenario =
        fixtures::scenarios().into_iter().find(|s| s.name == "malformed").expect("fixture scenario malformed");
    let mut cases = Vec::new();
    let mut good = None;
    for st in &scenario.steps {
        match &st.expect {
            Expect::Drop(reason) => {
                let xdp_reads_ip = st.frame.len() >= 14 + 20 && (st.frame[14] & 0x0f) >= 5;
                if st.frame.len() < 14 {
                    // Shorter than an Ethernet header: a raw socket cannot send it.
                    continue;
                }
                let at = if xdp_reads_ip { reason.name() } else { "pass_malformed" };
                cases.push((st.what, st.frame.clone(), at));
            }
            Expect::Forward { frame, .. } => good = Some((st.frame.clone(), frame.clone())),
            _ => {}
        }
    }
    let mut garbage = vec![0u8; 60];
    garbage[..6].copy_from_slice(&plan::GW_IN);
    garbage[6..12].copy_from_slice(&plan::NODE_MAC);
    garbage[12..14].copy_from_slice(&[0x88, 0xb5]); // local experimental ethertype
    for (i, b) in garbage[14..].iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37) ^ 0x5a;
    }
    cases.push(("garbage, not IP", garbage, "pass_not_ip"));
    let mut junk_ip = vec![0u8; 14];
    junk_ip[..6].copy_from_slice(&plan::GW_IN);
    junk_ip[6..12].copy_from_slice(&plan::NODE_MAC);
    junk_ip[12..14].copy_from_slice(&[0x08, 0x00]);
    junk_ip.extend_from_slice(&[0x9f; 40]); // version 9
    cases.push(("garbage after an IPv4 ethertype", junk_ip, "pass_malformed"));
    let (good_in, good_out) = good.expect("fixture malformed has a good frame");
    (cases, good_in, good_out)
}

both_tiers!(malformed_frames_counted_gateway_keeps_forwarding, malformed_counted);

fn malformed_counted(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    let (cases, good_in, good_out) = cases();
    let node = RawLink::open(h.lab.node(), "gw").unwrap();
    let tracked: Vec<&str> =
        DropReason::ALL.iter().map(|r| r.name()).chain(["pass_malformed", "pass_not_ip"]).collect();
    for (what, frame, counter) in &cases {
        let before = h.counters().unwrap();
        node.send(frame).unwrap();
        let after = h
            .wait_counters(Duration::from_secs(2), &format!("{what}: {counter} +1"), |c| {
                c.get(counter) > before.get(counter)
            })
            .unwrap();
        // Exactly one named reason moved, by one.
        let moved: Vec<(&str, u64)> = tracked
            .iter()
            .filter_map(|n| {
                let d = after.get(n) - before.get(n);
                (d > 0).then_some((*n, d))
            })
            .collect();
        assert_eq!(moved, vec![(*counter, 1)], "{what}");
        eprintln!("{name}: {what:<40} -> {counter}");
    }

    // The fixture's good frame, injected the same way, leaves translated
    // byte for byte as the fixture table expects.
    let sent_at = h.capture.as_ref().unwrap().caught_up(Duration::from_secs(10)).unwrap().len();
    node.send(&good_in).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let frames: Vec<Frame> = h.capture.as_ref().unwrap().snapshot().split_off(sent_at);
        if frames.iter().any(|f| f.data == good_out) {
            break;
        }
        if std::time::Instant::now() > deadline {
            let udp: Vec<String> = frames.iter().map(|f| format!("{:02x?}", f.data)).collect();
            panic!("the good frame did not leave as {good_out:02x?}; saw {udp:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    // And real traffic still flows.
    let r =
        client::udp_echo(h.lab.pod(Pod::A), SocketAddr::new(plan::SERVER.into(), plan::ECHO_PORT), "after").unwrap();
    assert_eq!(r.seen.ip(), std::net::IpAddr::from(plan::E1));
    crate::established_flows(&h, Pod::A, 3);
    h.finish(&[]).unwrap();
}
