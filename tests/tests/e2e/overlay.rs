//! The return path through an overlay (issue 15, "An overlay"): the
//! gateway and the node router are joined by a VXLAN overlay configured as
//! flannel's vxlan backend configures it (`flannel.1`, VNI 1, UDP 8472, no
//! learning; per remote node a route `podCIDR via podCIDR.0 dev flannel.1
//! onlink`, a permanent neighbour for podCIDR.0 and an FDB entry to the
//! node's underlay address). Pods A and B (198.18.0.0/24) sit behind the
//! tunnel; pod C (198.18.1.0/24) stays natively routed. The pods' traffic
//! still reaches the gateway over the node network (the node router's
//! default route), but the gateway's route back to pods A and B is the
//! tunnel, which Egret does not drive: translated replies are handed to
//! the gateway's kernel (`to_kernel`), which encapsulates them.
//!
//! The IPv6 pod sits behind `flannel-v6.1`, configured the same way.
//!
//! Checked: pod A's UDP exchanges and a TCP download leave with E1, the
//! IPv6 pod's UDP exchanges with E6, and get their replies back; the
//! replies crossed the gateway's tunnels (their TX counters grew by at
//! least as many packets as were handed over, `flannel-v6.1`'s by the IPv6
//! replies) and the node's; nothing was dropped as `no_route` or refused by the kernel;
//! with the fast path on, those sessions stay in the workers
//! (`refused_kernel_route`) while pod C's natively routed flows are still
//! translated in XDP; and no frame left with a pod's address.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use egret_tests::client;
use egret_tests::harness::Tier;
use egret_tests::lab::{Lab, LabOptions};
use egret_tests::netns::NetNs;
use egret_tests::plan::{self, Pod};

/// The node's VTEP MAC (flannel: the `backend-data` annotation's `VtepMAC`).
const NODE_VTEP_MAC: &str = "02:e9:00:00:01:0a";
/// The gateway's VTEP MAC.
const GW_VTEP_MAC: &str = "02:e9:00:00:01:02";
/// The node's pod CIDR (pods A and B) and the gateway node's own.
const NODE_POD_CIDR: (&str, &str) = ("198.18.0.0", "24");
const GW_POD_CIDR: (&str, &str) = ("198.19.0.0", "24");
/// IPv6: flannel's `flannel-v6.1` the same way (the IPv6 pod's /64).
const NODE_VTEP6_MAC: &str = "02:e9:00:00:01:1a";
const GW_VTEP6_MAC: &str = "02:e9:00:00:01:12";
const NODE_POD_CIDR6: (&str, &str) = ("2001:db8:18::", "64");
const GW_POD_CIDR6: (&str, &str) = ("2001:db8:19::", "64");
/// Bytes of the TCP download.
const DOWNLOAD: usize = 4 << 20;

/// One end of flannel's vxlan backend: device `dev`, its `.0` address,
/// and the remote node's route, neighbour and FDB entry.
#[allow(clippy::too_many_arguments)]
fn flannel_end(
    ns: &NetNs,
    dev: &str,
    underlay_dev: &str,
    local: &str,
    vtep_mac: &str,
    own_cidr: (&str, &str),
    remote: (&str, (&str, &str), &str),
) {
    let (remote_ip, (remote_net, remote_len), remote_mac) = remote;
    let host = if own_cidr.0.contains(':') { "128 nodad" } else { "32" };
    ns.ip_batch(&[
        format!(
            "link add {dev} address {vtep_mac} type vxlan id 1 local {local} dev {underlay_dev} dstport 8472 nolearning"
        ),
        format!("addr add {}/{host} dev {dev}", own_cidr.0),
        format!("link set dev {dev} up"),
        format!("route add {remote_net}/{remote_len} via {remote_net} dev {dev} onlink"),
        format!("neigh add {remote_net} lladdr {remote_mac} dev {dev} nud permanent"),
    ])
    .unwrap();
    ns.exec(&["bridge", "fdb", "append", remote_mac, "dev", dev, "dst", remote_ip, "self", "permanent"]).unwrap();
}

/// (TX packets, RX packets) of `dev` in `ns`.
fn link_packets(ns: &NetNs, dev: &str) -> (u64, u64) {
    let text = ns.ip(&["-s", "-j", "link", "show", "dev", dev]).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let stats = &v[0]["stats64"];
    (stats["tx"]["packets"].as_u64().unwrap(), stats["rx"]["packets"].as_u64().unwrap())
}

fn overlay_return(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    let routes = |h: &egret_tests::harness::Harness| h.gw.admin().status().unwrap()["fib_routes"].as_u64().unwrap();
    let routes_before = routes(&h);
    let gw_dev = h.lab.gateway_inside_dev();
    let (gw_ns, node_ns) = (h.lab.gateway_ns(), h.lab.node());
    let (gw4, node4) = (plan::GW_INSIDE.to_string(), plan::NODE.to_string());
    let (gw6, node6) = (plan::GW_INSIDE6.to_string(), plan::NODE6.to_string());
    let v4 = "flannel.1";
    let v6 = "flannel-v6.1";
    flannel_end(gw_ns, v4, gw_dev, &gw4, GW_VTEP_MAC, GW_POD_CIDR, (&node4, NODE_POD_CIDR, NODE_VTEP_MAC));
    flannel_end(node_ns, v4, "gw", &node4, NODE_VTEP_MAC, NODE_POD_CIDR, (&gw4, GW_POD_CIDR, GW_VTEP_MAC));
    // The kernel refuses an IPv6 onlink next hop that a route other than
    // the default one reaches through another device: the lab's /48
    // towards the node router covers 2001:db8:18:: (a real gateway has no
    // such route). Out of the way while the tunnel route goes in, then back.
    let lab48 = "2001:db8:18::/48";
    gw_ns.ip(&["-6", "route", "del", lab48]).unwrap();
    flannel_end(gw_ns, v6, gw_dev, &gw6, GW_VTEP6_MAC, GW_POD_CIDR6, (&node6, NODE_POD_CIDR6, NODE_VTEP6_MAC));
    gw_ns.ip(&["-6", "route", "add", lab48, "via", &node6]).unwrap();
    flannel_end(node_ns, v6, "gw", &node6, NODE_VTEP6_MAC, NODE_POD_CIDR6, (&gw6, GW_POD_CIDR6, GW_VTEP6_MAC));
    // flannel gives its pods the tunnel's MTU (the underlay's less 50).
    h.lab.pod(Pod::A).ip(&["link", "set", "dev", "eth0", "mtu", "1450"]).unwrap();
    // The daemon mirrors the kernel's routes (debounced): wait for the
    // tunnel route, so that no reply meets the old route.
    let deadline = Instant::now() + Duration::from_secs(3);
    while routes(&h) < routes_before + 2 {
        assert!(Instant::now() < deadline, "the daemon never saw the tunnel route");
        std::thread::sleep(Duration::from_millis(20));
    }
    let route = h.lab.gateway_ns().ip(&["route", "get", &plan::POD_A.to_string()]).unwrap();
    assert!(route.contains("dev flannel.1"), "the gateway's kernel routes pod A through the tunnel: {route}");
    let route = h.lab.gateway_ns().ip(&["-6", "route", "get", &plan::POD6.to_string()]).unwrap();
    assert!(route.contains("dev flannel-v6.1"), "and the IPv6 pod: {route}");

    let tunnel_packets = |h: &egret_tests::harness::Harness| {
        let (gw_tx, _) = link_packets(h.lab.gateway_ns(), v4);
        let (gw_tx6, _) = link_packets(h.lab.gateway_ns(), v6);
        let (_, node_rx) = link_packets(h.lab.node(), v4);
        let (_, node_rx6) = link_packets(h.lab.node(), v6);
        (gw_tx, gw_tx6, node_rx + node_rx6)
    };
    let before = h.counters().unwrap();
    let (gw_tx0, gw_tx60, node_rx0) = tunnel_packets(&h);

    // UDP: each reply comes back through the tunnel.
    let want = Lab::expected_source(Pod::A, Pod::A.server());
    assert_eq!(want, IpAddr::from(plan::E1), "pod A leaves with E1");
    let udp = client::udp_socket(h.lab.pod(Pod::A), Pod::A.echo_endpoint()).unwrap();
    for i in 0..20 {
        let (r, _) = client::udp_exchange(&udp, &format!("overlay-udp-{i}"), 3, Duration::from_secs(1)).unwrap();
        assert_eq!(r.seen.ip(), want, "UDP round {i}: source at the server");
    }
    // IPv6: the pod's UDP replies through flannel-v6.1.
    let udp6 = client::udp_socket(h.lab.pod(Pod::V6), Pod::V6.echo_endpoint()).unwrap();
    for i in 0..10 {
        let (r, _) = client::udp_exchange(&udp6, &format!("overlay-udp6-{i}"), 3, Duration::from_secs(1)).unwrap();
        assert_eq!(Some(r.seen.ip()), Pod::V6.egress(), "IPv6 UDP round {i}: source at the server");
    }
    let (_, gw_tx6_udp, _) = tunnel_packets(&h);
    assert!(gw_tx6_udp - gw_tx60 >= 10, "the IPv6 replies crossed flannel-v6.1 ({})", gw_tx6_udp - gw_tx60);
    // TCP: a download, whose data segments all take the tunnel.
    let (r, got) = client::download(h.lab.pod(Pod::A), Pod::A.http_endpoint(), DOWNLOAD).unwrap();
    assert_eq!(r.seen.ip(), want, "TCP source at the server");
    assert_eq!(got, DOWNLOAD, "the whole download arrived");
    // Pod C, natively routed, is untouched by the overlay: its established
    // flows are translated in XDP with the fast path on.
    let (tcp_c, udp_c) = crate::established_flows(&h, Pod::C, 5);
    assert_eq!((Some(tcp_c.ip()), Some(udp_c.ip())), (Pod::C.egress(), Pod::C.egress()));

    let after = h.counters().unwrap();
    let handed = after.get("to_kernel") - before.get("to_kernel");
    let (gw_tx1, gw_tx61, node_rx1) = tunnel_packets(&h);
    let delta = after.delta(&before);
    // 30 UDP replies, and 4 MiB in segments of at most 1410 bytes.
    assert!(handed >= 30 + (DOWNLOAD / 1410) as u64, "only {handed} packets handed to the kernel; {delta:?}");
    let sent = (gw_tx1 - gw_tx0) + (gw_tx61 - gw_tx60);
    assert!(sent >= handed, "the gateway's tunnels sent {sent} of {handed}");
    assert!(node_rx1 - node_rx0 >= handed, "the node's tunnels received {} of {handed}", node_rx1 - node_rx0);
    for reason in ["no_route", "kernel_send_failed", "neighbor_unresolved"] {
        assert_eq!(after.get(reason), before.get(reason), "{reason} drops: {delta:?}");
    }
    let kernel_route = |c: &egret_tests::gateway::Counters| c.get_path("fast_path.offloads.refused_kernel_route");
    if tier == Tier::FastPath {
        assert!(kernel_route(&after) > kernel_route(&before), "pod A's sessions are not offloaded: {delta:?}");
    }
    h.finish(&[]).unwrap();
}

both_tiers!(replies_to_pods_behind_a_vxlan_overlay_go_through_the_kernel, overlay_return);
