//! A selected pod's traffic to the gateway node's own addresses is the
//! kernel's: the daemon makes every address rtnetlink reports on the node
//! every policy's exception (`TablesSpec::local_addresses`), so a TCP
//! connection and a UDP datagram from pod A (policy "a" selects it for every
//! destination, the gateway's addresses included) reach listeners on the
//! gateway's inside and outside addresses with the pod's own address as
//! their source, while the same pod's traffic to the server is translated.
//! This is what a pod's reply to a connection the gateway's kube-proxy
//! masqueraded to its node address (a LoadBalancer VIP's inbound traffic)
//! relies on.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::time::Duration;

use egret_dataplane::stats::Event;
use egret_tests::client;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

both_tiers!(a_selected_pods_traffic_to_the_gateway_node_is_not_translated, to_the_gateway_node);

fn to_the_gateway_node(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else {
        return;
    };
    let pod = h.lab.pod(Pod::A);
    let gw = h.lab.gateway_ns();
    // Translated to the server: the policy does select this pod.
    let (tcp, _) = crate::established_flows(&h, Pod::A, 2);
    assert_eq!(tcp.ip(), IpAddr::from(plan::E1), "pod A's traffic to the server is translated");
    let created = Event::SessionCreatedOutbound.name();
    let before = h.counters().unwrap();

    for addr in [plan::GW_INSIDE, plan::GW_OUTSIDE] {
        let at = SocketAddr::new(addr.into(), plan::SERVICE_PORT);
        assert!(
            h.gw.current.selects(Pod::A.addr(), at.ip()),
            "the test means something only if policy \"a\" selects {addr} for pod A"
        );
        let listener = gw.run_in(|| TcpListener::bind(at)).unwrap().unwrap();
        let mut c = client::tcp_connect(pod, at, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("pod A's TCP connection to the gateway's {addr} reaches its kernel: {e}"));
        let (mut conn, peer) = listener.accept().unwrap();
        assert_eq!(peer.ip(), Pod::A.addr(), "the gateway's kernel saw pod A untranslated at {addr}");
        c.write_all(b"ping\n").unwrap();
        let mut got = [0u8; 5];
        conn.read_exact(&mut got).unwrap();
        conn.write_all(b"pong\n").unwrap();
        c.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong\n");

        let udp = gw.run_in(|| UdpSocket::bind(at)).unwrap().unwrap();
        udp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let s = client::udp_socket(pod, at).unwrap();
        s.send(b"to the node").unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = client::udp_recv_from(&udp, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"to the node");
        assert_eq!(from.ip(), Pod::A.addr(), "UDP to {addr} arrives untranslated");
    }
    let after = h.counters().unwrap();
    assert_eq!(after.get(created), before.get(created), "no session was made for traffic to the gateway node");
    h.finish(&[]).unwrap();
}
