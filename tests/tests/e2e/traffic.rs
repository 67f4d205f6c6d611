//! TCP, UDP and ICMP echo from the pods leave with their policy's egress IP
//! (as the server sees it), replies come back to the right pod, two policies
//! use two egress IPs, an unselected pod and an excluded destination go
//! through the kernel untouched; in both cablings. No selected pod address
//! appears on the outside link.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use egret_dataplane::stats::{DropReason, Event};
use egret_tests::client;
use egret_tests::harness::Tier;
use egret_tests::lab::{Arm, Lab, LabOptions};
use egret_tests::plan::{self, Pod};

fn translate_everything(name: &str, arm: Arm, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions { arm, ..LabOptions::for_test() }, |_| {}) else { return };
    let before = h.counters().unwrap();

    // Pod A from a fixed port first: endpoint-independent mapping keeps the
    // pod's port when it is free (fixture udp_out_and_back).
    let s = client::udp_socket_from(h.lab.pod(Pod::A), 40000, Pod::A.echo_endpoint()).unwrap();
    let (r, _) = client::udp_exchange(&s, "fixed-port", 3, Duration::from_secs(1)).unwrap();
    assert_eq!(r.seen, SocketAddr::new(plan::E1.into(), 40000), "pod A's port 40000 is kept on E1");

    for pod in [Pod::A, Pod::B, Pod::C, Pod::U] {
        let ns = h.lab.pod(pod);
        let want = Lab::expected_source(pod, pod.server());
        let selected = pod.egress().is_some();

        let udp = client::udp_echo(ns, pod.echo_endpoint(), &format!("udp-{name}-{}", pod.name())).unwrap();
        assert_eq!(udp.seen.ip(), want, "{pod:?}: UDP source at the server");
        if !selected {
            assert_eq!(udp.seen, udp.local, "{pod:?}: untouched, port too");
        }

        let http = client::http(ns, pod.http_endpoint(), &format!("/{}", pod.name()), 0).unwrap();
        assert_eq!(http.seen.ip(), want, "{pod:?}: TCP source at the server");
        assert_eq!(http.rest, format!("GET /{} received=0", pod.name()), "{pod:?}: the HTTP answer came back whole");

        let token = format!("icmp-{name}-{}", pod.name());
        let pong = client::ping(ns, pod.server(), &token, Duration::from_secs(3)).unwrap();
        assert_eq!(pong.from, pod.server(), "{pod:?}: the echo reply came back to the pod");
        let seen = h.lab.server().unwrap().wait_icmp(&token, Duration::from_secs(2)).unwrap();
        assert_eq!(seen.src.ip(), want, "{pod:?}: ICMP source at the server");
    }

    // Replies reach the right pod even when two pods share an egress IP and
    // talk at once: each socket gets its own token back.
    let sa = client::udp_socket(h.lab.pod(Pod::A), Pod::A.echo_endpoint()).unwrap();
    let sb = client::udp_socket(h.lab.pod(Pod::B), Pod::B.echo_endpoint()).unwrap();
    sa.send(b"from-a").unwrap();
    sb.send(b"from-b").unwrap();
    let (rb, _) = client::udp_exchange(&sb, "from-b", 3, Duration::from_secs(1)).unwrap();
    let (ra, _) = client::udp_exchange(&sa, "from-a", 3, Duration::from_secs(1)).unwrap();
    assert_eq!((ra.seen.ip(), rb.seen.ip()), (plan::E1.into(), plan::E1.into()));
    assert_ne!(ra.seen.port(), rb.seen.port(), "two pods behind E1 got distinct ports");

    // An excluded destination (policy "a" except 198.51.100.128/25) is left
    // to the kernel: the server sees pod A itself.
    let excluded = SocketAddr::new(plan::EXCLUDED.into(), plan::ECHO_PORT);
    let r = client::udp_echo(h.lab.pod(Pod::A), excluded, "excluded").unwrap();
    assert_eq!(r.seen, r.local, "excluded destination: untouched");
    assert_eq!(r.seen.ip(), IpAddr::from(plan::POD_A));

    // Established flows: in XDP with the fast path on, in the workers without.
    for pod in [Pod::A, Pod::C] {
        let (tcp, udp) = crate::established_flows(&h, pod, 5);
        assert_eq!((Some(tcp.ip()), Some(udp.ip())), (pod.egress(), pod.egress()), "{pod:?}");
    }

    let after = h.counters().unwrap();
    let created = after.get(Event::SessionCreatedOutbound.name()) - before.get(Event::SessionCreatedOutbound.name());
    // A, B, C each: 1 UDP + 1 TCP + 1 ICMP, plus A's fixed port and the A/B pair.
    assert!(created >= 12, "sessions created: {created}; counters {:?}", after.delta(&before));
    for reason in [DropReason::InboundNoMapping, DropReason::NoRoute, DropReason::MalformedIpv4] {
        assert_eq!(after.get(reason.name()), before.get(reason.name()), "no {reason} drops in clean traffic");
    }
    let sessions = h.gw.sessions().unwrap();
    for needle in [plan::POD_A.to_string(), plan::E1.to_string(), plan::POD_C.to_string(), plan::E2.to_string()] {
        assert!(sessions.contains(&needle), "`egret sessions` mentions {needle}:\n{sessions}");
    }
    assert!(!sessions.contains(&plan::POD_U.to_string()), "the unselected pod has no session:\n{sessions}");
    // One-arm without podSourceMacs (the lab lists none): the daemon says
    // what that leaves open; two-arm restricts by role and says nothing.
    let warned = h.gw.log_text().contains("one-arm interface without podSourceMacs");
    assert_eq!(warned, arm == Arm::One, "the one-arm anti-spoofing warning:\n{}", h.gw.log_tail(30));
    h.finish(&[]).unwrap();
}

fn two_arm(name: &str, tier: Tier) {
    translate_everything(name, Arm::Two, tier);
}

fn one_arm(name: &str, tier: Tier) {
    translate_everything(name, Arm::One, tier);
}

both_tiers!(translates_tcp_udp_icmp_two_arm, two_arm);
both_tiers!(translates_tcp_udp_icmp_one_arm, one_arm);

/// A one-arm gateway whose file gives its interface as `defaultRoute: true`
/// (the chart's default): the daemon takes the default route's interface
/// (the lab's `lan0`) and translates as with the name written out.
#[test]
fn one_arm_on_the_default_routes_interface() {
    const NAME: &str = "one_arm_on_the_default_routes_interface";
    let opts = LabOptions { arm: Arm::One, ..LabOptions::for_test() };
    let Some(mut h) = crate::start_in(NAME, Tier::Userspace, opts, |cfg| {
        assert_eq!(cfg.interfaces.len(), 1, "one arm: {:?}", cfg.interfaces);
        cfg.interfaces[0].0 = String::new();
    }) else {
        return;
    };
    let status = h.gw.admin().status().unwrap();
    let names: Vec<&str> = status["interfaces"].as_array().unwrap().iter().filter_map(|i| i["name"].as_str()).collect();
    assert_eq!(names, ["lan0"], "defaultRoute is the default route's interface: {status}");
    for pod in [Pod::A, Pod::U] {
        let want = Lab::expected_source(pod, pod.server());
        let udp = client::udp_echo(h.lab.pod(pod), pod.echo_endpoint(), &format!("at-default-{}", pod.name())).unwrap();
        assert_eq!(udp.seen.ip(), want, "{pod:?}: UDP source at the server");
    }
    h.expect_fast_path_hits = false;
    h.finish(&[]).unwrap();
}
