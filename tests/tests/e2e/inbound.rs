//! Inbound from outside: unsolicited traffic to an egress IP's NAT ports is
//! dropped and counted; other ports of an egress IP the kernel also serves
//! (`kernelService`, a VIP) belong to the kernel, those of any other egress
//! IP are dropped, and echo requests to it are answered by the gateway; ARP
//! is answered for owned egress IPs and only for them; a pod's address
//! arriving on the outside interface is dropped, never translated.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::time::Duration;

use egret_dataplane::fixtures::build::{arp_reply, arp_request};
use egret_dataplane::stats::{DropReason, Event};
use egret_tests::client;
use egret_tests::error::LabError;
use egret_tests::frames::{parse_arp, RawLink};
use egret_tests::gateway::EgressIp;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

both_tiers!(unsolicited_inbound_dropped_service_port_reaches_kernel, unsolicited_inbound);

fn unsolicited_inbound(name: &str, tier: Tier) {
    // E1 is also served by the kernel here (as a Service VIP would be).
    let Some(mut h) =
        crate::start_in(name, tier, LabOptions::for_test(), |cfg| cfg.kernel_service_ips.push(plan::E1.into()))
    else {
        return;
    };
    let no_mapping = DropReason::InboundNoMapping.name();
    let filtered = DropReason::InboundFiltered.name();
    let srv = h.lab.server_ns();

    // An established flow (in XDP with the fast path on). Its mapping
    // E1:port filters by address and port (nat.filtering's default): a
    // datagram from another port of the server matches no fast-path entry
    // and the engine drops it.
    let (_, mapped) = crate::established_flows(&h, Pod::A, 2);
    let before = h.counters().unwrap();
    let other = client::udp_socket_from(srv, 7777, mapped).unwrap();
    other.send(b"unsolicited, other port").unwrap();
    h.wait_counters(Duration::from_secs(3), "inbound_filtered +1", |c| c.get(filtered) == before.get(filtered) + 1)
        .unwrap();
    let c = h.counters().unwrap();
    assert_eq!(c.fast_path_hits(), before.fast_path_hits(), "not translated in XDP");
    assert_eq!(c.get(Event::SessionCreatedInbound.name()), before.get(Event::SessionCreatedInbound.name()));

    // UDP to E1:40000, a NAT port nobody mapped: dropped in XDP (rule 4a),
    // counted, unanswered; the workers never see it.
    let unmapped = "drop_unmapped_nat_port";
    let s = client::udp_socket(srv, SocketAddr::new(plan::E1.into(), 40000)).unwrap();
    s.send(b"unsolicited").unwrap();
    h.wait_counters(Duration::from_secs(3), "drop_unmapped_nat_port +1 (UDP)", |c| {
        c.get(unmapped) == before.get(unmapped) + 1
    })
    .unwrap();
    // Nothing answers it.
    client::udp_expect_silence(&s, Duration::from_millis(300)).unwrap();

    // A TCP SYN to E1:45000: dropped (no RST, so the connect times out).
    let mid = h.counters().unwrap();
    let r = client::tcp_connect(srv, SocketAddr::new(plan::E1.into(), 45000), Duration::from_millis(700));
    match r {
        Ok(c) => panic!("a TCP connection to an unmapped NAT port: {c:?}"),
        // Dropped, so the connect times out; an RST would be "refused".
        Err(LabError::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "the SYN is dropped unanswered: {source}")
        }
        Err(e) => panic!("TCP connect to an unmapped NAT port: {e}"),
    }
    let after = h
        .wait_counters(Duration::from_secs(3), "drop_unmapped_nat_port +1 (TCP SYN)", |c| {
            c.get(unmapped) > mid.get(unmapped)
        })
        .unwrap();
    assert_eq!(after.get(no_mapping), before.get(no_mapping), "the workers saw no unmapped-port frame");
    assert_eq!(after.get(Event::SessionCreatedInbound.name()), before.get(Event::SessionCreatedInbound.name()));

    // Port 8080 is outside the NAT range (32768-60999): the frame goes to the
    // gateway's kernel (E1 is `kernelService`). Give the kernel the address
    // (a Service VIP that is also an egress IP) and listen there.
    let gw = h.lab.gateway_ns();
    gw.ip(&["addr", "add", &format!("{}/32", plan::E1), "dev", "lo"]).unwrap();
    let listener =
        gw.run_in(|| TcpListener::bind(SocketAddr::new(plan::E1.into(), plan::SERVICE_PORT))).unwrap().unwrap();
    let pass_before = h.counters().unwrap();
    let mut c = client::tcp_connect(srv, SocketAddr::new(plan::E1.into(), plan::SERVICE_PORT), Duration::from_secs(3))
        .expect("a TCP connection to E1:8080 reaches the gateway's kernel");
    let (mut conn, peer) = listener.accept().unwrap();
    assert_eq!(peer.ip(), IpAddr::from(plan::SERVER), "the kernel saw the outside client untranslated");
    c.write_all(b"ping\n").unwrap();
    let mut got = [0u8; 5];
    conn.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"ping\n");
    conn.write_all(b"pong\n").unwrap();
    c.read_exact(&mut got).unwrap();
    assert_eq!(&got, b"pong\n");
    // No listener on 8081: the kernel answers with a RST (connection refused).
    let e = client::tcp_connect(srv, SocketAddr::new(plan::E1.into(), 8081), Duration::from_secs(3)).unwrap_err();
    assert!(format!("{e}").contains("refused"), "RST from the gateway's kernel, got: {e}");
    let end = h.counters().unwrap();
    assert_eq!(end.fast_path_hits(), before.fast_path_hits(), "nothing inbound here was translated in XDP");
    assert!(
        end.get("pass_service_port") >= pass_before.get("pass_service_port") + 2,
        "XDP counted the service-port frames: {:?}",
        end.delta(&pass_before)
    );
    assert_eq!(end.get(no_mapping), after.get(no_mapping), "service-port traffic is not a NAT drop");
    drop(c);
    drop(conn);
    h.finish(&[]).unwrap();
}

#[test]
fn arp_answered_for_owned_egress_ips_only() {
    let name = "arp_answered_for_owned_egress_ips_only";
    // E3 is held but announced by someone else (answerNeighbor: false).
    let Some(mut h) = crate::start(name, LabOptions::for_test(), |cfg| {
        cfg.egress_ips.push(EgressIp { ip: plan::E3.into(), ports: None, answer_neighbor: false });
    }) else {
        return;
    };
    let answered = Event::NeighborAnswered.name();
    let before = h.counters().unwrap();
    let up = RawLink::open(h.lab.upstream(), "gw").unwrap();
    let ask = |target: std::net::Ipv4Addr| {
        up.send(&arp_request(plan::UP_MAC, plan::UPSTREAM.octets(), target.octets())).unwrap();
        up.recv_matching(Duration::from_millis(500), |f| parse_arp(f).is_some_and(|a| a.op == 2 && a.spa == target))
            .unwrap()
    };
    for owned in [plan::E1, plan::E2] {
        let reply = ask(owned).unwrap_or_else(|| panic!("no ARP reply for owned {owned}"));
        // Byte for byte the fixture table's answer (scenario "neighbors").
        assert_eq!(reply, arp_reply(plan::GW_OUT, owned.octets(), plan::UP_MAC, plan::UPSTREAM.octets()), "{owned}");
    }
    for not in [plan::E3, plan::NOT_OWNED] {
        assert_eq!(ask(not), None, "{not} must not be answered");
    }
    // The gateway's own address is the kernel's to answer, and it does.
    let own = ask(plan::GW_OUTSIDE).expect("the kernel answers for 203.0.113.2");
    assert_eq!(parse_arp(&own).unwrap().sha, plan::GW_OUT);

    // On the inside link too (fixture "neighbors", second step).
    let node = RawLink::open(h.lab.node(), "gw").unwrap();
    node.send(&arp_request(plan::NODE_MAC, plan::NODE.octets(), plan::E2.octets())).unwrap();
    let reply = node
        .recv_matching(Duration::from_millis(500), |f| parse_arp(f).is_some_and(|a| a.op == 2 && a.spa == plan::E2))
        .unwrap();
    assert_eq!(reply, Some(arp_reply(plan::GW_IN, plan::E2.octets(), plan::NODE_MAC, plan::NODE.octets())));

    let after = h
        .wait_counters(Duration::from_secs(2), "neighbor_answered +3", |c| c.get(answered) >= before.get(answered) + 3)
        .unwrap();
    assert_eq!(after.get(answered) - before.get(answered), 3, "exactly the three owned requests were answered");
    h.finish(&[]).unwrap();
}

/// An egress IP the kernel does not serve (no `kernelService`): an echo
/// request is answered by the gateway (byte for byte the fixture table's
/// answer), a TCP SYN to a port outside the NAT range is dropped in XDP and
/// counted, never handed to a kernel that does not own the address.
#[test]
fn egress_ip_answers_echo_and_drops_what_it_does_not_serve() {
    use egret_dataplane::fixtures::build::Packet;
    use egret_dataplane::fixtures::{echo, from_outside};
    let name = "egress_ip_answers_echo_and_drops_what_it_does_not_serve";
    let Some(mut h) = crate::start(name, LabOptions::for_test(), |_| {}) else { return };
    let before = h.counters().unwrap();
    let up = RawLink::open(h.lab.upstream(), "gw").unwrap();
    let request = Packet {
        eth_src: plan::UP_MAC,
        eth_dst: plan::GW_OUT,
        ..from_outside(plan::UPSTREAM.into(), plan::E1.into(), echo(true, 0x4567, 9))
    };
    let mut want = request.clone();
    (want.eth_src, want.eth_dst, want.src, want.dst, want.ttl) =
        (plan::GW_OUT, plan::UP_MAC, plan::E1.into(), plan::UPSTREAM.into(), 64);
    want.transport = echo(false, 0x4567, 9);
    let want = want.frame();
    up.send(&request.frame()).unwrap();
    let got = up
        .recv_matching(Duration::from_secs(1), |f| {
            f.len() >= 34 && f[6..12] == plan::GW_OUT && f[12..14] == [8, 0] && f[26..30] == plan::E1.octets()
        })
        .unwrap();
    assert_eq!(got.as_deref().map(|f| &f[..want.len()]), Some(&want[..]), "the echo reply from E1");

    // TCP to E1:8080: no kernel serves it; dropped, so the connect times out.
    let srv = h.lab.server_ns();
    match client::tcp_connect(srv, SocketAddr::new(plan::E1.into(), plan::SERVICE_PORT), Duration::from_millis(700)) {
        Ok(c) => panic!("a TCP connection to a port E1 does not serve: {c:?}"),
        Err(LabError::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::TimedOut, "the SYN is dropped unanswered: {source}")
        }
        Err(e) => panic!("TCP connect to E1:8080: {e}"),
    }
    let after = h
        .wait_counters(Duration::from_secs(3), "echo answered, SYN dropped", |c| {
            c.get(Event::EchoAnswered.name()) > before.get(Event::EchoAnswered.name())
                && c.get("drop_unserved_to_egress") > before.get("drop_unserved_to_egress")
        })
        .unwrap();
    assert_eq!(after.get("pass_service_port"), before.get("pass_service_port"), "nothing went to the kernel");
    h.finish(&[]).unwrap();
}

/// Sends three UDP datagrams from the upstream router with pod A's address
/// as source (`port` to the server's echo port, carrying `payload`), and
/// returns the first IPv4 UDP datagram with that payload the gateway sends
/// back upstream to the server within 500 ms: a spoofed datagram forwarded.
fn spoof_pod_a_from_outside(up: &RawLink, port: u16, payload: &[u8]) -> Option<Vec<u8>> {
    use egret_dataplane::fixtures::build::Packet;
    use egret_dataplane::fixtures::{from_outside, udp};
    let spoofed = Packet {
        eth_src: plan::UP_MAC,
        eth_dst: plan::GW_OUT,
        ..from_outside(plan::POD_A.into(), plan::SERVER.into(), udp(port, plan::ECHO_PORT, payload))
    };
    for _ in 0..3 {
        up.send(&spoofed.frame()).unwrap();
    }
    up.recv_matching(Duration::from_millis(500), |f| {
        f.len() >= 34
            && f[6..12] == plan::GW_OUT
            && f[12..14] == [8, 0]
            && f[23] == 17
            && f[30..34] == plan::SERVER.octets()
            && f.windows(payload.len()).any(|w| w == payload)
    })
    .unwrap()
}

/// Anti-spoofing (two-arm): a selected pod's address arriving on the
/// outside interface is dropped in XDP and counted, not translated to the
/// pod's egress IP.
#[test]
fn a_pods_address_from_outside_is_dropped_not_translated() {
    let name = "a_pods_address_from_outside_is_dropped_not_translated";
    let Some(mut h) = crate::start(name, LabOptions::for_test(), |_| {}) else { return };
    let before = h.counters().unwrap();
    let up = RawLink::open(h.lab.upstream(), "gw").unwrap();
    // Nothing leaves towards the upstream router as E1 (or as the pod).
    let leaked = spoof_pod_a_from_outside(&up, 41000, b"spoofed");
    assert_eq!(leaked, None, "a spoofed pod datagram was forwarded");
    let after = h
        .wait_counters(Duration::from_secs(3), "drop_steered_on_outside +3", |c| {
            c.get("drop_steered_on_outside") >= before.get("drop_steered_on_outside") + 3
        })
        .unwrap();
    let created = Event::SessionCreatedOutbound.name();
    assert_eq!(after.get(created), before.get(created), "no session was created for the spoofed source");
    h.finish(&[]).unwrap();
}

/// Anti-spoofing on the fast path (two-arm): a frame from outside carrying
/// exactly an offloaded session's outbound 5-tuple is not translated by
/// XDP. The session's outbound next hop is on the outside link, which the
/// offload manager marks NEXT_HOP_NOT_BACK, so the hit is punted
/// (`punt_wrong_link`) and the steering rules drop it by the interface's
/// role; the pod's own flow goes on through XDP.
#[test]
fn an_offloaded_pods_5_tuple_from_outside_is_not_translated() {
    let name = "an_offloaded_pods_5_tuple_from_outside_is_not_translated";
    let Some(mut h) = crate::start_in(name, Tier::FastPath, LabOptions::for_test(), |_| {}) else { return };
    let installed = |c: &egret_tests::gateway::Counters| c.get_path("fast_path.offloads.installed");
    let before = h.counters().unwrap();
    let sock = client::udp_socket(h.lab.pod(Pod::A), Pod::A.echo_endpoint()).unwrap();
    let (first, _) = client::udp_exchange(&sock, "first", 3, Duration::from_secs(1)).unwrap();
    h.wait_counters(Duration::from_secs(3), "installed", |c| installed(c) > installed(&before)).unwrap();
    let pod_port = sock.local_addr().unwrap().port();

    let mid = h.counters().unwrap();
    let up = RawLink::open(h.lab.upstream(), "gw").unwrap();
    let leaked = spoof_pod_a_from_outside(&up, pod_port, b"spoofed-5-tuple");
    assert_eq!(leaked, None, "XDP translated a frame from outside carrying the pod's 5-tuple");
    h.wait_counters(Duration::from_secs(3), "punt_wrong_link and drop_steered_on_outside +3", |c| {
        c.get("punt_wrong_link") >= mid.get("punt_wrong_link") + 3
            && c.get("drop_steered_on_outside") >= mid.get("drop_steered_on_outside") + 3
    })
    .unwrap();

    // The pod's own datagrams still leave through XDP, in the same session.
    let (again, _) = client::udp_exchange(&sock, "after", 3, Duration::from_secs(1)).unwrap();
    assert_eq!(again.seen, first.seen, "the same session (same external port)");
    let after = h.counters().unwrap();
    assert!(after.fast_path_hits() > mid.fast_path_hits(), "the pod's flow is still translated in XDP");
    h.finish(&[]).unwrap();
}
