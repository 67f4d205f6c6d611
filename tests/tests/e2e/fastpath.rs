//! The XDP fast path under change (docs/fast-path.md): established flows
//! keep working when the upstream router's MAC changes; an offloaded session
//! lives as long as its packets keep coming, although the workers never see
//! them, and expires on time once they stop; a reload that removes a policy
//! or an egress IP stops its offloaded flows before it completes; checksums
//! arriving at the server are right with TX checksum offload on and off; a
//! family given no fast-path sessions stays in the workers.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use egret_dataplane::fixtures::UP_MAC;
use egret_dataplane::stats::Event;
use egret_dataplane::wire::checksum;
use egret_tests::capture::{Capture, Frame};
use egret_tests::client::{self, TcpSession};
use egret_tests::gateway::{Counters, EgressIp};
use egret_tests::harness::{Harness, Tier};
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

fn installed(c: &Counters) -> u64 {
    c.get_path("fast_path.offloads.installed")
}

/// A TCP line-echo connection and a UDP socket of `pod`, each confirmed
/// and (fast path on) installed in the kernel.
fn live_flows(h: &Harness, pod: Pod) -> (TcpSession, SocketAddr, std::net::UdpSocket, SocketAddr) {
    let before = h.counters().unwrap();
    let ns = h.lab.pod(pod);
    let mut tcp = TcpSession::connect(ns, pod.echo_endpoint()).unwrap();
    let t = tcp.line("first").unwrap().seen;
    let udp = client::udp_socket(ns, pod.echo_endpoint()).unwrap();
    let (u, _) = client::udp_exchange(&udp, "first", 3, Duration::from_secs(1)).unwrap();
    if h.tier == Some(Tier::FastPath) {
        h.wait_counters(Duration::from_secs(3), "both sessions installed", |c| installed(c) >= installed(&before) + 2)
            .unwrap();
    }
    (tcp, t, udp, u.seen)
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

both_tiers!(established_flows_survive_a_next_hop_mac_change, next_hop_mac_change);

/// The upstream router's interface gets a new MAC (a replaced router, a
/// VRRP failover) and the gateway's kernel learns it: the fast path's
/// next-hop table follows, so established TCP and UDP flows carry on in
/// XDP, sent to the new MAC (the old one is no longer accepted there).
fn next_hop_mac_change(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    let (mut tcp, t0, udp, u0) = live_flows(&h, Pod::A);
    let before = h.counters().unwrap();

    let fib_generation = |h: &Harness| h.gw.admin().status().unwrap()["fib_generation"].as_u64().unwrap();
    let fib_before = fib_generation(&h);
    let new_mac = [0x02, 0xe9, 0, 0, 0, 0xfd];
    assert_ne!(new_mac, UP_MAC);
    h.lab.upstream().ip(&["link", "set", "dev", "gw", "address", &mac_str(new_mac)]).unwrap();
    for hop in [plan::UPSTREAM.to_string(), plan::UPSTREAM6.to_string()] {
        h.lab
            .gateway_ns()
            .ip(&["neigh", "replace", &hop, "lladdr", &mac_str(new_mac), "dev", "outside", "nud", "reachable"])
            .unwrap();
    }
    // Both tiers: the workers forward with the new snapshot once the
    // daemon has applied the neighbour change (debounced, ~20 ms); until
    // then frames go to the old MAC, as a kernel's would until its
    // neighbour entry changes.
    let deadline = Instant::now() + Duration::from_secs(3);
    while fib_generation(&h) == fib_before {
        assert!(Instant::now() < deadline, "the daemon never applied the neighbour change");
        std::thread::sleep(Duration::from_millis(20));
    }
    if tier == Tier::FastPath {
        h.wait_counters(Duration::from_secs(3), "next-hop table rewritten", |c| {
            c.get_path("fast_path.next_hop_updates") > before.get_path("fast_path.next_hop_updates")
        })
        .unwrap();
    }
    let mid = h.counters().unwrap();
    for i in 0..5 {
        assert_eq!(tcp.line(&format!("after-{i}")).unwrap().seen, t0, "TCP keeps its translation");
        let (r, _) = client::udp_exchange(&udp, &format!("after-{i}"), 3, Duration::from_secs(1)).unwrap();
        assert_eq!(r.seen, u0, "UDP keeps its translation");
    }
    let end = h.counters().unwrap();
    if tier == Tier::FastPath {
        let hits = end.fast_path_hits() - mid.fast_path_hits();
        assert!(hits >= 20, "after the change the flows stayed in XDP: {hits} hits; {:?}", end.delta(&mid));
        assert_eq!(installed(&end), installed(&before), "no re-installation was needed");
    }
    // Every IPv4 frame the gateway sent upstream with the exchanges after
    // the change went to the new MAC. The frames are told by their payload,
    // not by their place in the capture, and the capture is let catch up
    // with the wire first: on a busy machine its thread lags (CI saw none of
    // them yet when it looked at once, while the pcap written moments later
    // held them all).
    let sent: Vec<Frame> = h
        .capture
        .as_ref()
        .unwrap()
        .caught_up(Duration::from_secs(10))
        .unwrap()
        .into_iter()
        .filter(|f| f.data.len() > 14 && f.data[6..12] == plan::GW_OUT && f.data[12..14] == [8, 0])
        .filter(|f| f.data.windows(6).any(|w| w == b"after-"))
        .collect();
    assert!(sent.len() >= 10, "frames sent upstream with the exchanges after the change: {}", sent.len());
    for f in &sent {
        assert_eq!(f.data[0..6], new_mac, "a frame to the old MAC after the change");
    }
    h.finish(&[]).unwrap();
}

/// The UDP timeout of the expiry test: RFC 4787 REQ-5's minimum (the
/// configuration refuses less), 120 s of engine time...
const UDP_TIMEOUT_ENGINE_SECS: u32 = 120;
/// ...run 40 times faster than real time (`EGRET_TEST_CLOCK_SCALE`): 3 s.
const CLOCK_SCALE: u32 = 40;
const SHORT_UDP_TIMEOUT: u64 = (UDP_TIMEOUT_ENGINE_SECS / CLOCK_SCALE) as u64;

/// An offloaded UDP session whose packets all take the fast path lives
/// while they keep coming (the workers see none of them; expiry reads the
/// kernel's stamps), and expires on time once they stop: not before the
/// timeout, and within the timeout plus the stamp granularity (1 s real
/// time) and one sweep period (5 s real time).
#[test]
fn offloaded_session_expires_on_time() {
    let name = "offloaded_session_expires_on_time";
    let Some(mut h) = crate::start_in(name, Tier::FastPath, LabOptions::for_test(), |cfg| {
        cfg.extra = format!("nat:\n  timeouts: {{udp: {UDP_TIMEOUT_ENGINE_SECS}}}\n");
        cfg.clock_scale = Some(CLOCK_SCALE);
    }) else {
        return;
    };
    let expired = Event::SessionExpired.name();
    let before = h.counters().unwrap();
    let udp = client::udp_socket(h.lab.pod(Pod::A), Pod::A.echo_endpoint()).unwrap();
    let (first, _) = client::udp_exchange(&udp, "first", 3, Duration::from_secs(1)).unwrap();
    h.wait_counters(Duration::from_secs(3), "installed", |c| installed(c) > installed(&before)).unwrap();

    // Keep it busy for more than twice the timeout, every 0.5 s.
    let mid = h.counters().unwrap();
    let busy = Instant::now();
    let mut rounds = 0u64;
    let mut last = Instant::now();
    while busy.elapsed() < Duration::from_secs(2 * SHORT_UDP_TIMEOUT + 2) {
        let (r, _) = client::udp_exchange(&udp, &format!("busy-{rounds}"), 3, Duration::from_secs(1)).unwrap();
        last = Instant::now();
        assert_eq!(r.seen, first.seen, "round {rounds}: the same session (same external port)");
        rounds += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let c = h.counters().unwrap();
    assert_eq!(c.get(expired), before.get(expired), "expired while its packets kept coming through XDP");
    let hits = c.fast_path_hits() - mid.fast_path_hits();
    assert!(hits >= 2 * rounds, "{rounds} round trips, {hits} fast-path hits: the workers saw some");

    // Quiet: it expires, on time.
    let after = h
        .wait_counters(Duration::from_secs(SHORT_UDP_TIMEOUT + 10), "session expired", |c| {
            c.get(expired) > before.get(expired)
        })
        .unwrap();
    let quiet = last.elapsed();
    assert!(
        quiet >= Duration::from_secs(SHORT_UDP_TIMEOUT),
        "expired {quiet:?} after its last packet, before the {SHORT_UDP_TIMEOUT} s timeout"
    );
    assert!(
        quiet <= Duration::from_secs(SHORT_UDP_TIMEOUT + 1 + 5 + 1),
        "expired only {quiet:?} after its last packet"
    );
    assert_eq!(after.get(expired) - before.get(expired), 1);
    let removed = after.get_path("fast_path.removals.removed") - before.get_path("fast_path.removals.removed");
    assert_eq!(removed, 1, "its kernel entries went with it");
    assert_eq!(after.get_path("fast_path.sessions_v4"), 0);
    eprintln!("{name}: {rounds} round trips over {:?} in XDP, expired {quiet:?} after the last", busy.elapsed());

    // The next datagram is a new session.
    let (r, _) = client::udp_exchange(&udp, "again", 3, Duration::from_secs(1)).unwrap();
    assert_eq!(r.seen.ip(), first.seen.ip());
    let c = h.counters().unwrap();
    assert_eq!(
        c.get(Event::SessionCreatedOutbound.name()) - after.get(Event::SessionCreatedOutbound.name()),
        1,
        "a new session"
    );
    h.finish(&[]).unwrap();
}

/// What a reload takes away from policy "c" (pod C, egress E2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Removal {
    /// The policy itself.
    Policy,
    /// Its egress IP (the policy moves to E3).
    EgressIp,
}

both_tiers!(reload_removing_a_policy_stops_its_offloaded_flows, remove_policy);
both_tiers!(reload_removing_an_egress_ip_stops_its_offloaded_flows, remove_egress_ip);

fn remove_policy(name: &str, tier: Tier) {
    reload_stops_flows(name, tier, Removal::Policy);
}

fn remove_egress_ip(name: &str, tier: Tier) {
    reload_stops_flows(name, tier, Removal::EgressIp);
}

/// IPv4 source of an Ethernet frame, if it is IPv4.
fn ipv4_src(f: &[u8]) -> Option<IpAddr> {
    (f.len() >= 34 && f[12..14] == [8, 0]).then(|| IpAddr::from([f[26], f[27], f[28], f[29]]))
}

/// Pod C's offloaded TCP and UDP flows through E2; a reload removes the
/// policy or E2. Once the reload has completed (`egret status`: reloads
/// +1), no packet is translated in XDP any more and none leaves as E2.
fn reload_stops_flows(name: &str, tier: Tier, removal: Removal) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |cfg| {
        cfg.egress_ips.push(EgressIp { ip: plan::E3.into(), ports: None, answer_neighbor: true });
    }) else {
        return;
    };
    let e2 = IpAddr::from(plan::E2);
    let (mut tcp, t0, udp, u0) = live_flows(&h, Pod::C);
    assert_eq!((t0.ip(), u0.ip()), (e2, e2));
    let before = h.counters().unwrap();
    for i in 0..3 {
        tcp.line(&format!("before-{i}")).unwrap();
        client::udp_exchange(&udp, &format!("before-{i}"), 3, Duration::from_secs(1)).unwrap();
    }
    if tier == Tier::FastPath {
        // Twelve packets: three lines and three datagrams, each way. On
        // failure the counters that moved say where the others went.
        let after = h.counters().unwrap();
        assert!(
            after.fast_path_hits() >= before.fast_path_hits() + 12,
            "the flows are in XDP before the reload; counters that moved: {:?}",
            after.delta(&before)
        );
    }

    let mut cfg = h.gw.current.clone();
    match removal {
        Removal::Policy => cfg.policies.retain(|p| p.name != "c"),
        Removal::EgressIp => {
            cfg.egress_ips.retain(|e| e.ip != e2);
            cfg.policy_mut("c").unwrap().egress_ips = vec![plan::E3.into()];
        }
    }
    let reloads = |h: &Harness| h.gw.admin().status().unwrap()["reloads"].as_u64().unwrap_or(0);
    let r0 = reloads(&h);
    let before = h.counters().unwrap();
    h.gw.reload(&cfg).unwrap();
    let t = Instant::now();
    while reloads(&h) == r0 {
        assert!(t.elapsed() < Duration::from_secs(5), "the reload never completed");
        std::thread::sleep(Duration::from_millis(20));
    }
    let done = h.counters().unwrap();
    let mark = h.capture.as_ref().unwrap().caught_up(Duration::from_secs(10)).unwrap().len();
    if tier == Tier::FastPath {
        let fenced = done.get_path("fast_path.removals.fenced") - before.get_path("fast_path.removals.fenced");
        assert_eq!(fenced, 2, "both sessions were taken out of the kernel by the reload");
    }

    // The flows' next packets: the UDP socket again, and a TCP line (whose
    // answer, if any, does not matter).
    let after_udp = client::udp_exchange(&udp, "after", 2, Duration::from_millis(700));
    let _ = tcp.line("after");
    std::thread::sleep(Duration::from_millis(300));
    let end = h.counters().unwrap();
    assert_eq!(end.fast_path_hits(), done.fast_path_hits(), "nothing translated in XDP after the reload completed");
    let frames: Vec<Frame> = h.capture.as_ref().unwrap().caught_up(Duration::from_secs(10)).unwrap().split_off(mark);
    let as_e2 = frames.iter().filter(|f| ipv4_src(&f.data) == Some(e2)).count();
    assert_eq!(as_e2, 0, "{as_e2} frames left as E2 after the reload completed");
    match (removal, after_udp) {
        // Unselected now: the kernel forwards it untouched.
        (Removal::Policy, Ok((r, _))) => assert_eq!(r.seen.ip(), IpAddr::from(plan::POD_C)),
        // Translated again, to the policy's new egress IP.
        (Removal::EgressIp, Ok((r, _))) => assert_eq!(r.seen.ip(), IpAddr::from(plan::E3)),
        (_, Err(e)) => panic!("{removal:?}: the flow's next datagram got no answer: {e}"),
    }
    // Leak check under the new configuration only: after a policy's
    // removal its pods' traffic legitimately leaves untranslated.
    h.expect_fast_path_hits = tier == Tier::FastPath;
    h.finish(&[]).unwrap();
}

/// Whether an IPv4/IPv6 TCP/UDP frame's checksums verify: `None` when it is
/// not such a frame.
fn checksums_ok(f: &[u8]) -> Option<bool> {
    let et = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    let (proto, l4, pseudo, ip_ok) = match et {
        0x0800 => {
            let ip = f.get(14..34)?;
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
            let l4 = f.get(14 + ihl..14 + total)?;
            let (src, dst) = ([ip[12], ip[13], ip[14], ip[15]].into(), [ip[16], ip[17], ip[18], ip[19]].into());
            let ip_ok = checksum::fold(checksum::sum(f.get(14..14 + ihl)?, 0)) == 0xffff;
            (ip[9], l4, checksum::pseudo_header_v4(src, dst, ip[9], l4.len() as u32), ip_ok)
        }
        0x86dd => {
            let ip = f.get(14..54)?;
            let len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            let l4 = f.get(54..54 + len)?;
            let src: [u8; 16] = ip[8..24].try_into().ok()?;
            let dst: [u8; 16] = ip[24..40].try_into().ok()?;
            (ip[6], l4, checksum::pseudo_header_v6(&src.into(), &dst.into(), ip[6], l4.len() as u32), true)
        }
        _ => return None,
    };
    if proto != 6 && proto != 17 {
        return None;
    }
    if proto == 17 && et == 0x0800 && l4.get(6..8) == Some(&[0, 0]) {
        return Some(ip_ok); // RFC 768: no checksum
    }
    Some(ip_ok && checksum::fold(checksum::sum(l4, pseudo)) == 0xffff)
}

/// Checksums at the server (a capture of what arrives on its link, and its
/// kernel's InCsumErrors) for translated TCP and UDP of both families, with
/// the fast path on and the lab's TX checksum offload `offload`.
fn checksums_at_the_server(name: &str, offload: bool) {
    let opts = LabOptions { tx_checksum_offload: offload, ..LabOptions::for_test() };
    let Some(mut h) = crate::start(name, opts, |cfg| cfg.fast_path = true) else { return };
    let cap = Capture::start(h.lab.server_ns(), "eth0").unwrap();
    let before = h.counters().unwrap();
    for pod in [Pod::A, Pod::C, Pod::V6] {
        let (mut tcp, _, udp, _) = live_flows(&h, pod);
        for i in 0..5 {
            tcp.line(&format!("sum-{i}-{}", "x".repeat(100 * i))).unwrap();
            client::udp_exchange(&udp, &format!("sum-{i}-{}", "y".repeat(150 * i)), 3, Duration::from_secs(1)).unwrap();
        }
        let r = client::http(h.lab.pod(pod), pod.http_endpoint(), "/upload", 256 << 10).unwrap();
        assert_eq!(r.rest, format!("POST /upload received={}", 256 << 10));
    }
    let frames = cap.stop().unwrap();
    let egress: [IpAddr; 3] = [plan::E1.into(), plan::E2.into(), plan::E6.into()];
    let mut checked = 0;
    for f in &frames {
        let src = match u16::from_be_bytes([f.data[12], f.data[13]]) {
            0x0800 => ipv4_src(&f.data),
            0x86dd if f.data.len() >= 38 => {
                let b: [u8; 16] = f.data[22..38].try_into().unwrap();
                Some(IpAddr::from(b))
            }
            _ => None,
        };
        if !src.is_some_and(|s| egress.contains(&s)) {
            continue;
        }
        if let Some(ok) = checksums_ok(&f.data) {
            assert!(ok, "bad checksum at the server: {:02x?}", f.data);
            checked += 1;
        }
    }
    let snmp = h.lab.server_ns().exec(&["cat", "/proc/net/snmp"]).unwrap();
    let csum_errors = |proto: &str| -> u64 {
        let mut lines = snmp.lines().filter(|l| l.starts_with(&format!("{proto}:")));
        let (names, values) = (lines.next().unwrap_or_default(), lines.next().unwrap_or_default());
        names
            .split_whitespace()
            .zip(values.split_whitespace())
            .find(|(n, _)| *n == "InCsumErrors")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0)
    };
    assert_eq!((csum_errors("Tcp"), csum_errors("Udp")), (0, 0), "the server's kernel saw bad checksums");
    let after = h.counters().unwrap();
    let hits = after.fast_path_hits() - before.fast_path_hits();
    let partial = after.get_path("fast_path.packets.punt_partial_checksum")
        - before.get_path("fast_path.packets.punt_partial_checksum");
    let completed = after.get("partial_checksum_completed") - before.get("partial_checksum_completed");
    let looked = after.get("checksum_looked_partial") - before.get("checksum_looked_partial");
    if offload {
        // Partial checksums (pseudo-header only) cannot be completed in XDP
        // without the payload: the engine completes them.
        assert!(partial > 0 && completed > 0, "partial checksums punted and completed: {:?}", after.delta(&before));
    } else {
        assert!(hits > 100, "full checksums are translated in XDP: {hits} hits");
        // No frame is partial; a full checksum equal to its pseudo-header
        // sum (about 1 in 65536) is punted as one, and the engine finds it
        // complete: every punt is such a frame.
        assert_eq!(completed, 0, "no partial checksum on a lab without TX offload: {:?}", after.delta(&before));
        assert!(partial <= looked, "{partial} punted as partial, {looked} found complete: {:?}", after.delta(&before));
    }
    eprintln!(
        "{name}: {checked} frames checked at the server, {hits} fast-path hits, {partial} partial punted, {looked} of them complete"
    );
    assert!(checked > 100, "only {checked} translated frames reached the server");
    h.expect_fast_path_hits = false;
    h.finish(&[]).unwrap();
}

#[test]
fn checksums_right_at_the_server_tx_offload_on() {
    checksums_at_the_server("checksums_right_at_the_server_tx_offload_on", true);
}

#[test]
fn checksums_right_at_the_server_tx_offload_off() {
    checksums_at_the_server("checksums_right_at_the_server_tx_offload_off", false);
}

/// `xdp.fastPathSessions: {ipv4: 1024, ipv6: 0}`: IPv4 sessions are
/// installed in XDP, IPv6 ones are never offered to it and stay in the
/// workers (still leaving as E6), and the counters show each family's
/// capacity.
#[test]
fn a_family_given_no_fast_path_sessions_stays_in_the_workers() {
    let name = "a_family_given_no_fast_path_sessions_stays_in_the_workers";
    let Some(mut h) = crate::start_in(name, Tier::FastPath, LabOptions::for_test(), |cfg| {
        cfg.fast_path_sessions = Some("{ipv4: 1024, ipv6: 0}".into());
    }) else {
        return;
    };
    let c = h.counters().unwrap();
    assert_eq!((c.get_path("fast_path.capacity_v4"), c.get_path("fast_path.capacity_v6")), (1024, 0));
    let (mut tcp4, t4, udp4, u4) = live_flows(&h, Pod::A);
    assert_eq!((Some(t4.ip()), Some(u4.ip())), (Pod::A.egress(), Pod::A.egress()));
    let hits = h.counters().unwrap().fast_path_hits();
    assert_eq!(tcp4.line("v4-tcp-again").unwrap().seen, t4);
    assert_eq!(client::udp_exchange(&udp4, "v4-udp-again", 3, Duration::from_secs(1)).unwrap().0.seen, u4);
    assert!(h.counters().unwrap().fast_path_hits() >= hits + 4, "the IPv4 flows are translated in XDP");

    let before = h.counters().unwrap();
    let e6 = IpAddr::from(plan::E6);
    let ns = h.lab.pod(Pod::V6);
    let mut tcp = TcpSession::connect(ns, Pod::V6.echo_endpoint()).unwrap();
    let udp = client::udp_socket(ns, Pod::V6.echo_endpoint()).unwrap();
    for i in 0..5 {
        assert_eq!(tcp.line(&format!("v6-tcp-{i}")).unwrap().seen.ip(), e6);
        let (r, _) = client::udp_exchange(&udp, &format!("v6-udp-{i}"), 3, Duration::from_secs(1)).unwrap();
        assert_eq!(r.seen.ip(), e6);
    }
    let after = h.counters().unwrap();
    assert_eq!(installed(&after), installed(&before), "no IPv6 session installed");
    let offered = |c: &Counters| c.get_path("fast_path.offloads.refused_map_full");
    assert_eq!(offered(&after), offered(&before), "IPv6 sessions are not even offered");
    assert_eq!(after.get_path("fast_path.sessions_v6"), 0);
    assert_eq!(after.get_path("fast_path.sessions_v4"), 2);
    let rows = h.gw.admin().sessions_json(1000).unwrap();
    let v6: Vec<_> = rows.iter().filter(|r| r["pod"].as_str() == Some(&Pod::V6.addr().to_string())).collect();
    assert!(v6.len() >= 2, "{rows:?}");
    assert!(v6.iter().all(|r| r["offloaded"].as_bool() == Some(false)), "{v6:?}");
    h.finish(&[]).unwrap();
}
