//! The node agent's kernel layer with next hops behind a router (root):
//! docs/adr/0031-workers-in-any-subnet.md.
//!
//! Namespaces: `pod` -- `node` -- `router` -- `gw`. The node reaches the
//! gateway's next hop N (203.0.113.40, 2001:db8:113::40, on `gw`) only through
//! the router, in another subnet. The test runs the agent's own functions in
//! `node` (paths, device, steering, reconcile, apply), which make the real
//! `egret-vxlan` (VXLAN, RFC 7348, collect_md: the tunnel is VXLAN because
//! kernels like this project's are built without Geneve), then sends a
//! datagram from the pod and receives it in `gw` on a UDP socket bound to
//! N's tunnel port: it left the node as UDP to N port 6082 with the node's
//! address as the outer source, crossed a router (so its TTL was set), and
//! carries a VXLAN header of Egret's VNI around the pod's own packet. It also
//! checks the device's configuration (and that a wrong one is replaced, a
//! foreign one left alone, a taken port reported), an on-link N (today's
//! route, the device gone), an unreachable N (no path, the pod not steered),
//! idempotence (the kernel's encapsulated routes read back equal) and the
//! clean-up. Addresses: TEST-NET and 198.18.0.0/15 only, inside namespaces
//! the test creates and deletes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::Duration;

use common::{in_ns, ip, netns};
use egret_controlplane::node::kernel::Kernel;
use egret_controlplane::node::plan::{Plan, Route, RouteSet};
use egret_controlplane::node::reconcile::{reconcile, RuleShape, TableRange};
use egret_controlplane::node::tunnel::{self, Path, Steering, TunnelMode, TunnelOptions};
use egret_dataplane::netns::run_in;
use egret_dataplane::wire::vxlan::{self, DEFAULT_PORT, EGRET_VNI};

const RANGE: TableRange = TableRange { first: 1_000_000, count: 100 };
/// Rules without a mark: every packet from the pod (the agent's nftables
/// table, which sets the mark, is not part of this test).
const SHAPE: RuleShape = RuleShape { priority: 100, mark: 0 };

const POD4: &str = "198.18.1.10";
const POD6: &str = "2001:db8:18:1::10";
const NODE4: &str = "192.0.2.7";
const NODE6: &str = "2001:db8:2::7";
const N4: &str = "203.0.113.40";
const N6: &str = "2001:db8:113::40";

fn a(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A veth pair with IPv4 and IPv6 addresses (IPv6 without duplicate
/// address detection, usable at once).
fn link(ns_a: &str, dev_a: &str, addrs_a: [&str; 2], ns_b: &str, dev_b: &str, addrs_b: [&str; 2]) {
    ip(&["link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b]);
    for (ns, dev, addrs) in [(ns_a, dev_a, addrs_a), (ns_b, dev_b, addrs_b)] {
        ip(&["-n", ns, "addr", "add", addrs[0], "dev", dev]);
        ip(&["-n", ns, "addr", "add", addrs[1], "dev", dev, "nodad"]);
        ip(&["-n", ns, "link", "set", dev, "up"]);
    }
}

fn sysctl(ns: &str, key: &str) {
    let out = in_ns(ns, &["sysctl", "-qw", key]);
    assert!(out.status.success(), "sysctl {key} in {ns}: {}", String::from_utf8_lossy(&out.stderr));
}

/// The pods' plan: everything outside the cluster via `hop4` / `hop6`.
fn plan(hop4: &str, hop6: &str) -> Plan {
    let route = |dst: &str, via: Option<&str>| Route { dst: dst.parse().unwrap(), via: via.map(a), encap: None };
    let mut p = Plan::default();
    p.pods.insert(a(POD4), RouteSet::from([route("0.0.0.0/0", Some(hop4)), route("198.18.0.0/16", None)]));
    p.pods.insert(a(POD6), RouteSet::from([route("::/0", Some(hop6)), route("2001:db8:18::/48", None)]));
    p.next_hops = BTreeSet::from([a(hop4), a(hop6)]);
    p
}

/// One pass of the agent's kernel side, as `agent.rs` runs it (without
/// nftables): paths, device, steering, reconcile, apply, device retired.
/// Returns the paths, the steering, how many operations were applied and
/// the device's error, if any.
async fn pass(
    k: &mut Kernel,
    plan: &Plan,
    opts: &TunnelOptions,
) -> (BTreeMap<IpAddr, Path>, Steering, usize, Option<String>) {
    let node_ips = [a(NODE4), a(NODE6)];
    let mut paths = tunnel::paths(k, &plan.next_hops, &node_ips, opts).await.unwrap();
    let device_error = tunnel::ensure_device(k, &mut paths, opts).await;
    let steering = tunnel::steer(plan, &paths);
    let before = k.view().await.unwrap();
    let changes = reconcile(&before, &steering.plan, RANGE, SHAPE).unwrap();
    for op in &changes.ops {
        k.apply(op, SHAPE).await.unwrap_or_else(|e| panic!("{op:?}: {e}"));
    }
    tunnel::retire_device(k, &paths).await.unwrap();
    (paths, steering, changes.ops.len(), device_error)
}

/// Runs one pass in `ns` on a fresh runtime and kernel handle.
fn pass_with(ns: &str, plan: &Plan, opts: TunnelOptions) -> (BTreeMap<IpAddr, Path>, Steering, usize, Option<String>) {
    let plan = plan.clone();
    run_in(ns, move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let mut k = Kernel::open(RANGE).unwrap();
            pass(&mut k, &plan, &opts).await
        })
    })
    .unwrap()
}

/// [`pass_with`], the device not refused.
fn pass_in(ns: &str, plan: &Plan, opts: TunnelOptions) -> (BTreeMap<IpAddr, Path>, Steering, usize) {
    let (paths, steering, ops, err) = pass_with(ns, plan, opts);
    assert_eq!(err, None, "the device");
    (paths, steering, ops)
}

/// [`pass_with`] where the device must be refused: every next hop's path is
/// none for that reason, no pod is steered. Returns the error.
fn refused(ns: &str, plan: &Plan) -> String {
    let (paths, steering, _, err) = pass_with(ns, plan, TunnelOptions::default());
    let err = err.expect("the device is refused");
    for (hop, path) in &paths {
        assert!(path.reason().unwrap().contains("the tunnel device was refused"), "{hop}: {path:?}");
    }
    assert_eq!(steering.unsteered, BTreeSet::from([a(POD4), a(POD6)]));
    assert_eq!(pod_table(ns, POD4), None, "no rule");
    assert_eq!(pod_table(ns, POD6), None, "no rule");
    err
}

/// `ip -d -j link show DEV` in `ns`.
fn link_json(ns: &str, dev: &str) -> serde_json::Value {
    let link: serde_json::Value = serde_json::from_str(&ip(&["-n", ns, "-d", "-j", "link", "show", dev])).unwrap();
    link[0].clone()
}

/// The table `ip rule` sends `pod` to, and its routes as `ip` prints them.
fn pod_table(ns: &str, pod: &str) -> Option<String> {
    let fam = if pod.contains(':') { "-6" } else { "-4" };
    let rules = ip(&[fam, "-n", ns, "rule", "show"]);
    let line = rules.lines().find(|l| l.contains(&format!("from {pod} ")))?;
    let table = line.split_whitespace().skip_while(|w| *w != "lookup").nth(1)?.to_string();
    Some(ip(&[fam, "-n", ns, "route", "show", "table", &table]))
}

/// Sends one datagram from the pod to `dst` and returns what the UDP socket
/// bound to N's tunnel port in `gw` received, with its outer source.
fn through_the_tunnel(pod_ns: &str, gw_ns: &str, n: &str, dst: &str) -> Option<(SocketAddr, Vec<u8>)> {
    let listen = SocketAddr::new(a(n), DEFAULT_PORT);
    let sock = run_in(gw_ns, move || UdpSocket::bind(listen)).unwrap().unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let dst = SocketAddr::new(a(dst), 9);
    run_in(pod_ns, move || {
        let local: SocketAddr = if dst.is_ipv4() { "0.0.0.0:0".parse().unwrap() } else { "[::]:0".parse().unwrap() };
        let s = UdpSocket::bind(local).unwrap();
        // Several: the first may wait on the pod's neighbour resolution.
        for _ in 0..3 {
            s.send_to(b"egret tunnel test", dst).unwrap();
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .unwrap();
    let mut buf = vec![0u8; 2048];
    let (n, from) = sock.recv_from(&mut buf).ok()?;
    buf.truncate(n);
    Some((from, buf))
}

/// Checks a received payload: a VXLAN header (RFC 7348 section 5: flags
/// with only the I bit, 0x08; 24 reserved bits; the VNI, Egret's 1; 8
/// reserved bits) around the pod's packet in an Ethernet frame.
fn check_inner(payload: &[u8], pod: &str, dst: &str) {
    assert!(payload.len() > 8 + 14 + 40, "{payload:?}");
    assert_eq!(payload[0], 0x08, "VXLAN flags: the I bit alone");
    assert_eq!(payload[1..4], [0, 0, 0], "reserved");
    assert_eq!(u32::from_be_bytes([0, payload[4], payload[5], payload[6]]), 1, "VNI 1, the route's id");
    assert_eq!(payload[7], 0, "reserved");
    let v = vxlan::Packet::new_checked(payload).unwrap();
    v.check_egret(EGRET_VNI).unwrap_or_else(|e| panic!("not Egret's VXLAN header: {e:?}"));
    let frame = v.payload();
    assert_eq!(frame.len(), payload.len() - 8);
    let ethertype = u16::from_be_bytes([frame[12], frame[13]]);
    let ip = &frame[14..];
    let (src, to): (IpAddr, IpAddr) = match ethertype {
        0x0800 => (
            IpAddr::from(<[u8; 4]>::try_from(&ip[12..16]).unwrap()),
            IpAddr::from(<[u8; 4]>::try_from(&ip[16..20]).unwrap()),
        ),
        0x86dd => (
            IpAddr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap()),
            IpAddr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap()),
        ),
        other => panic!("inner ethertype {other:#x}"),
    };
    assert_eq!((src, to), (a(pod), a(dst)), "the pod's own packet, its source kept");
}

#[test]
fn a_node_in_another_subnet_reaches_its_gateway_through_vxlan() {
    let ns = netns("egtun", &["pod", "node", "router", "gw"]);
    let (pod, node, router, gw) = (ns.name(0), ns.name(1), ns.name(2), ns.name(3));
    link(
        pod,
        "pod0",
        ["198.18.1.10/24", "2001:db8:18:1::10/64"],
        node,
        "nodep",
        ["198.18.1.1/24", "2001:db8:18:1::1/64"],
    );
    link(node, "node0", ["192.0.2.7/24", "2001:db8:2::7/64"], router, "rtr0", ["192.0.2.1/24", "2001:db8:2::1/64"]);
    link(
        router,
        "rtr1",
        ["203.0.113.1/25", "2001:db8:113::1/64"],
        gw,
        "gw0",
        ["203.0.113.40/25", "2001:db8:113::40/64"],
    );
    ip(&["-n", pod, "route", "add", "default", "via", "198.18.1.1"]);
    ip(&["-n", pod, "-6", "route", "add", "default", "via", "2001:db8:18:1::1"]);
    ip(&["-n", node, "route", "add", "default", "via", "192.0.2.1"]);
    ip(&["-n", node, "-6", "route", "add", "default", "via", "2001:db8:2::1"]);
    // Nothing reaches 203.0.113.128/25 and 2001:db8:5113::/48 from the node.
    ip(&["-n", node, "route", "add", "unreachable", "203.0.113.128/25"]);
    ip(&["-n", node, "-6", "route", "add", "unreachable", "2001:db8:5113::/48"]);
    ip(&["-n", gw, "route", "add", "default", "via", "203.0.113.1"]);
    ip(&["-n", gw, "-6", "route", "add", "default", "via", "2001:db8:113::1"]);
    for n in [node, router] {
        sysctl(n, "net.ipv4.ip_forward=1");
        sysctl(n, "net.ipv6.conf.all.forwarding=1");
    }

    let p = plan(N4, N6);
    let dev = tunnel::DEVICE;
    let port = DEFAULT_PORT.to_string();

    // 0. What stands in the device's way: no path, the pods not steered,
    // and the error says why. A device of another kind with Egret's name
    // is left alone, by the pass and by the clean-up.
    ip(&["-n", node, "link", "add", dev, "type", "bridge"]);
    let err = refused(node, &p);
    assert!(err.contains("exists and is a bridge device, not Egret's vxlan"), "{err}");
    let removed = run_in(node, || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async { Kernel::open(RANGE).unwrap().remove_all().await.unwrap() })
    })
    .unwrap();
    assert_eq!(removed, 0);
    assert_eq!(link_json(node, dev)["linkinfo"]["info_kind"], "bridge", "not Egret's: kept");
    ip(&["-n", node, "link", "del", dev]);
    // Another metadata-collecting VXLAN device on the tunnel's port (one
    // per port): the port is named.
    ip(&["-n", node, "link", "add", "cni-vx", "type", "vxlan", "external", "dstport", &port]);
    let err = refused(node, &p);
    assert!(
        err.contains(&format!("UDP port {DEFAULT_PORT} is taken by another metadata-collecting VXLAN device"))
            && err.contains("--tunnel-port")
            && err.contains("8472"),
        "{err}"
    );
    ip(&["-n", node, "link", "del", "cni-vx"]);
    // A flannel-style device (a VNI, no metadata) up on the port holds its
    // socket: Egret's device is made but cannot go up, and is removed.
    ip(&["-n", node, "link", "add", "cni-vx", "type", "vxlan", "id", "1", "dstport", &port, "dev", "node0"]);
    ip(&["-n", node, "link", "set", "cni-vx", "up"]);
    let err = refused(node, &p);
    assert!(err.contains(&format!("UDP port {DEFAULT_PORT} is taken by a UDP socket")), "{err}");
    let gone = std::process::Command::new("ip").args(["-n", node, "link", "show", dev]).output().unwrap();
    assert!(!gone.status.success(), "the device that could not go up is removed");
    ip(&["-n", node, "link", "del", "cni-vx"]);
    // Egret's own name, configured otherwise (another port, learning): the
    // pass below replaces it.
    ip(&["-n", node, "link", "add", dev, "type", "vxlan", "external", "dstport", "7000", "learning"]);
    let stale = common::ifindex(node, dev);

    // 1. N behind the router: the tunnel.
    let (paths, steering, ops, err) = pass_with(node, &p, TunnelOptions::default());
    assert_eq!(err, None);
    assert_eq!(paths[&a(N4)], Path::Vxlan { src: a(NODE4), mtu: 1450 }, "{paths:?}");
    assert_eq!(paths[&a(N6)], Path::Vxlan { src: a(NODE6), mtu: 1430 }, "{paths:?}");
    assert!(steering.unsteered.is_empty() && ops > 0);

    // The device: vxlan, collect_md, the port, no learning, no VNI, remote,
    // local address or lower link of its own, NOARP, up, the smallest MTU,
    // no IPv6 address generation and no address at all.
    let check_device = || {
        let d = link_json(node, dev);
        let info = &d["linkinfo"]["info_data"];
        assert_eq!(d["linkinfo"]["info_kind"], "vxlan", "{d}");
        assert_eq!(info["external"], true, "collect_md: {d}");
        assert_eq!(info["port"], DEFAULT_PORT, "{d}");
        assert_eq!(info["learning"], false, "{d}");
        assert_eq!(info["id"], 0, "{d}");
        for absent in ["remote", "remote6", "group", "group6", "local", "local6", "link"] {
            assert!(info.get(absent).is_none(), "{absent}: {d}");
        }
        assert!(d.get("link").is_none(), "no lower device: {d}");
        let flags: Vec<&str> = d["flags"].as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
        assert!(flags.contains(&"NOARP") && flags.contains(&"UP"), "{flags:?}");
        assert_eq!(d["mtu"], 1430, "the smaller of the IPv4 (1450) and IPv6 (1430) route MTUs: {d}");
        assert_eq!(d["inet6_addr_gen_mode"], "none", "{d}");
        let addrs = ip(&["-n", node, "addr", "show", "dev", dev]);
        assert!(!addrs.contains("inet"), "no address, no link-local: {addrs}");
        common::ifindex(node, dev)
    };
    let index = check_device();
    assert_ne!(index, stale, "the misconfigured device was replaced");

    // The pods' tables hold the encapsulated routes, TTL set.
    let t4 = pod_table(node, POD4).expect("a rule for the IPv4 pod");
    assert!(
        t4.contains("encap ip id 1 src 192.0.2.7 dst 203.0.113.40 ttl 64")
            && t4.contains(&format!("via 203.0.113.40 dev {dev} proto 233 onlink mtu 1450")),
        "{t4}"
    );
    let t6 = pod_table(node, POD6).expect("a rule for the IPv6 pod");
    assert!(
        t6.contains("encap ip6 id 1 src 2001:db8:2::7 dst 2001:db8:113::40 hoplimit 64")
            && t6.contains(&format!("via 2001:db8:113::40 dev {dev} proto 233"))
            && t6.contains("onlink")
            && t6.contains("mtu 1430"),
        "{t6}"
    );

    // Read back equal: the next pass changes nothing.
    let (_, _, ops, _) = pass_with(node, &p, TunnelOptions::default());
    assert_eq!(ops, 0, "the kernel's encapsulated routes read back as written");
    assert_eq!(check_device(), index, "the device kept");

    // A pod's packets leave the node as UDP to N:6082 from the node's
    // address, cross the router, and carry Egret's VXLAN header. (IPv6: the
    // receiving socket drops a zero UDP checksum, so the outer checksum is
    // checked too.)
    for (pod_ip, n, node_ip, dst) in [(POD4, N4, NODE4, "198.51.100.77"), (POD6, N6, NODE6, "2001:db8:5177::77")] {
        let (from, payload) = through_the_tunnel(pod, gw, n, dst)
            .unwrap_or_else(|| panic!("nothing from {pod_ip} reached {n}:{DEFAULT_PORT} through the router"));
        assert_eq!(from.ip(), a(node_ip), "outer source");
        check_inner(&payload, pod_ip, dst);
    }

    // Learning switched on in place: the next pass replaces the device and
    // puts its routes back.
    ip(&["-n", node, "link", "set", "dev", dev, "type", "vxlan", "learning"]);
    assert_eq!(link_json(node, dev)["linkinfo"]["info_data"]["learning"], true);
    let (_, steering, ops, err) = pass_with(node, &p, TunnelOptions::default());
    assert_eq!(err, None);
    assert!(steering.unsteered.is_empty() && ops > 0, "{ops}");
    let index = check_device();
    assert!(pod_table(node, POD4).unwrap().contains(&format!("dev {dev}")));
    assert!(pod_table(node, POD6).unwrap().contains(&format!("dev {dev}")));
    let (_, _, ops, _) = pass_with(node, &p, TunnelOptions::default());
    assert_eq!(ops, 0);
    assert_eq!(common::ifindex(node, dev), index);

    // A smaller underlay (--tunnel-mtu) is repaired into the routes.
    let small = TunnelOptions { mtu: Some(1400), ..Default::default() };
    let (paths, _, ops, _) = pass_with(node, &p, small);
    assert_eq!(paths[&a(N4)], Path::Vxlan { src: a(NODE4), mtu: 1350 });
    assert!(ops > 0);
    assert!(pod_table(node, POD4).unwrap().contains("mtu 1350"));
    assert_eq!(link_json(node, dev)["mtu"], 1330, "the device follows the smallest route MTU");

    // 2. N on the node's link (the router's own address): today's route,
    // and the device goes.
    let onlink = plan("192.0.2.1", "2001:db8:2::1");
    let (paths, steering, _) = pass_in(node, &onlink, TunnelOptions::default());
    assert_eq!(paths.values().cloned().collect::<Vec<_>>(), vec![Path::OnLink, Path::OnLink]);
    assert!(steering.unsteered.is_empty());
    assert_eq!(
        pod_table(node, POD4).unwrap(),
        "default via 192.0.2.1 dev node0 proto 233 \nthrow 198.18.0.0/16 proto 233 \n"
    );
    let t6 = pod_table(node, POD6).unwrap();
    assert!(t6.lines().any(|l| l == "default via 2001:db8:2::1 dev node0 proto 233 metric 1024 pref medium"), "{t6}");
    assert!(!t6.contains("encap") && !t6.contains("onlink"), "{t6}");
    let gone = std::process::Command::new("ip").args(["-n", node, "link", "show", tunnel::DEVICE]).output().unwrap();
    assert!(!gone.status.success(), "no next hop needs the device: removed");

    // --tunnel=always encapsulates an on-link N too.
    let always = TunnelOptions { mode: TunnelMode::Always, ..Default::default() };
    // (IPv4 only: the kernel refuses an IPv6 `onlink` gateway that a more
    // specific main-table route puts on another device,
    // ip6_route_check_nh_onlink, and N's subnet is on node0 here.)
    let (paths, _, _, _) = pass_with(node, &plan("192.0.2.1", N6), always);
    assert!(paths.values().all(|p| matches!(p, Path::Vxlan { .. })), "{paths:?}");
    assert!(pod_table(node, POD4).unwrap().contains(&format!("dev {dev}")));

    // 3. N unreachable: no path, the pod not steered (no rule).
    let none = plan("203.0.113.200", "2001:db8:5113::40");
    let (paths, steering, _) = pass_in(node, &none, TunnelOptions::default());
    for (hop, p) in &paths {
        assert_eq!(p.kind(), "none", "{hop}: {p:?}");
        assert!(p.reason().unwrap().starts_with(&format!("no route to {hop}")), "{p:?}");
    }
    assert_eq!(steering.unsteered, BTreeSet::from([a(POD4), a(POD6)]));
    assert_eq!(pod_table(node, POD4), None, "no rule");
    assert_eq!(pod_table(node, POD6), None, "no rule");

    // --tunnel=never: N behind the router gets no path.
    let (paths, _, _) = pass_in(node, &p, TunnelOptions { mode: TunnelMode::Never, ..Default::default() });
    assert!(paths[&a(N4)].reason().unwrap().contains("--tunnel=never"), "{paths:?}");

    // 4. The clean-up removes the device with the rules and routes.
    pass_with(node, &p, TunnelOptions::default());
    assert!(pod_table(node, POD4).unwrap().contains(dev));
    let removed = run_in(node, || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async { Kernel::open(RANGE).unwrap().remove_all().await.unwrap() })
    })
    .unwrap();
    assert!(removed >= 4, "rules and routes (and the device): {removed}");
    let gone = std::process::Command::new("ip").args(["-n", node, "link", "show", tunnel::DEVICE]).output().unwrap();
    assert!(!gone.status.success(), "egret node cleanup removes the device");
    assert_eq!(pod_table(node, POD4), None);
}
