//! Inbound from outside: unsolicited traffic to an egress IP's NAT ports is
//! dropped and counted; other ports of the egress IP belong to the kernel;
//! ARP is answered for owned egress IPs and only for them.

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
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
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

    // UDP to E1:40000, a NAT port nobody mapped: dropped, counted, unanswered.
    let s = client::udp_socket(srv, SocketAddr::new(plan::E1.into(), 40000)).unwrap();
    s.send(b"unsolicited").unwrap();
    h.wait_counters(Duration::from_secs(3), "inbound_no_mapping +1 (UDP)", |c| {
        c.get(no_mapping) == before.get(no_mapping) + 1
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
        .wait_counters(Duration::from_secs(3), "inbound_no_mapping +1 (TCP SYN)", |c| {
            c.get(no_mapping) > mid.get(no_mapping)
        })
        .unwrap();
    assert_eq!(after.get(Event::SessionCreatedInbound.name()), before.get(Event::SessionCreatedInbound.name()));

    // Port 8080 is outside the NAT range (32768-60999): the frame goes to the
    // gateway's kernel. Give the kernel the address (a Service VIP that is
    // also an egress IP) and listen there.
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
