//! IPv6: the IPv6 pod's UDP, TCP and ICMPv6 echo leave as the IPv6 egress IP
//! (E6), replies come back, and the upstream router resolved E6 through a
//! Neighbor Solicitation that Egret answered (RFC 4861 7.2.4), sent to E6's
//! solicited-node group, which the gateway joined on its outside link.

use std::net::IpAddr;
use std::time::Duration;

use egret_tests::client;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

both_tiers!(ipv6_udp_tcp_icmpv6_leave_as_e6, ipv6_udp_tcp_icmpv6);

fn ipv6_udp_tcp_icmpv6(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    let ns = h.lab.pod(Pod::V6);
    let e6 = IpAddr::from(plan::E6);

    let r = client::udp_echo(ns, Pod::V6.echo_endpoint(), "udp6").unwrap();
    assert_eq!(r.seen.ip(), e6, "UDP over IPv6 leaves as E6");
    let r = client::http(ns, Pod::V6.http_endpoint(), "/v6", 0).unwrap();
    assert_eq!(r.seen.ip(), e6, "TCP over IPv6 leaves as E6");
    assert_eq!(r.rest, "GET /v6 received=0");

    let pong = client::ping(ns, plan::SERVER6.into(), "icmp6-token", Duration::from_secs(3)).unwrap();
    assert_eq!(pong.from, IpAddr::from(plan::SERVER6), "the ICMPv6 echo reply came back");
    let seen = h.lab.server().unwrap().wait_icmp("icmp6-token", Duration::from_secs(2)).unwrap();
    assert_eq!(seen.src.ip(), e6, "ICMPv6 echo leaves as E6");

    let (tcp, udp) = crate::established_flows(&h, Pod::V6, 5);
    assert_eq!((tcp.ip(), udp.ip()), (e6, e6), "established IPv6 flows leave as E6");

    // The upstream router learned E6 at the gateway's outside MAC.
    let neigh = h.lab.upstream().ip(&["-6", "neigh", "show", &plan::E6.to_string()]).unwrap();
    let mac = plan::GW_OUT.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
    assert!(neigh.contains(&format!("lladdr {mac}")), "upstream neighbour entry for E6: {neigh:?}");
    // ...and the gateway joined E6's solicited-node group on its outside
    // interface, so that a NIC that filters multicast (virtio_net, real
    // NICs; veth does not) passes the solicitations to XDP.
    let groups = h.lab.gateway_ns().ip(&["-6", "maddr", "show", "dev", h.lab.gateway_outside_dev()]).unwrap();
    assert!(groups.contains("ff02::1:ff00:10"), "E6's solicited-node group on the outside link: {groups}");
    h.finish(&[]).unwrap();
}
