//! Workers in any subnet (issue 30, ADR 0031) in the routed worker-node lab
//! (`NodeLab::build_routed`, drawn in `tests/src/nodelab.rs`): `w1` and `w2`
//! each in a subnet of their own behind router `rt`, the two gateways, the
//! upstream router and the egress IPs in a third (subnet G), a real
//! kube-apiserver whose Node objects carry their InternalIPs (both
//! families). `egret node` cannot route a selected pod `via` the egress IP
//! on a link it does not have, so it sends it into its tunnel (ADR 0031,
//! built as VXLAN since d130dcc: this machine kind's kernel has no Geneve;
//! `egret-vxlan`, UDP 6082, VNI 1); the gateway holding the egress IP checks
//! the outer source against the Nodes' InternalIPs, decapsulates in XDP and
//! translates. Replies go back natively (the pod CIDRs are routed).
//!
//! Checked, IPv4 and IPv6:
//! 1. selected pods on `w1` and `w2` leave with the egress IP, unselected
//!    pods with their node's address (the CNI's masquerade);
//! 2. each worker's kernel holds an encapsulated route (`encap ip ... dst
//!    <egress IP>`, `dev egret-vxlan`), and `egret node status` and the
//!    status file say path `vxlan` for the next hop;
//! 3. the frames the router sends into subnet G: steered traffic only as
//!    UDP to port 6082 from the node's InternalIP to the egress IP, VNI 1,
//!    one outer source port per flow and distinct ones across flows; no
//!    frame with a pod's address outside the tunnel;
//! 4. forged tunnel frames from outside (the server's address) and from an
//!    address in subnet G that no Node has, each a well-formed VXLAN frame
//!    to the egress IP whose inner packet is a selected pod's: none is
//!    translated (the server never sees their tokens) and the gateways'
//!    decapsulation drop counters (`/metrics`) rose by at least their
//!    number; the same frame sent from a Node's InternalIP (the positive
//!    control) is translated;
//! 5. SIGKILL of the egress IP's holder: the other gateway takes it over,
//!    the selected pods leave with it again, and the workers' `ip rule`,
//!    `ip -d route show table all` and `ip -d link show egret-vxlan` are the
//!    same, byte for byte, before and after;
//! 6. a 4 MiB TCP upload and download between `w1-sel` (MTU 1500) and the
//!    server, each family, complete through the tunnel, with no outer
//!    fragment in subnet G; the MSS the node clamps in the tunnelled SYN and
//!    the Fragmentation Needed / Packet Too Big the node sends the pod are
//!    printed (at least one of the two must be seen).
//!
//! Throughout, a capture on the upstream router's link and the server's
//! journal show no pod address. Figures on lines starting `k8s-node-routed:`.
//! Skipped (with a message) when not root or the API server is not built;
//! `EGRET_REQUIRE_APISERVER=1` makes that a failure. Skipped too when the
//! kernel makes no VXLAN device (built without `CONFIG_VXLAN`), a failure
//! under `EGRET_REQUIRE_PRIVILEGES=1`.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{Capture, Frame};
use egret_tests::gateway::{http_get_in, METRICS};
use egret_tests::netns::NetNs;
use egret_tests::nodelab::{stranger_g6, tunnel_available, Agent, NodeGw, NodeLab, Worker, STRANGER_G};
use egret_tests::plan;
use k8s_common::*;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

const NAME: &str = "k8s_node_routed_workers_reach_the_gateways_through_the_tunnel";
/// The policy's egress IP, in subnet G (no worker has a link there).
const EIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// Its IPv6 egress IP.
const EIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 0x40);
/// Egret's tunnel port and VNI (ADR 0031; the defaults), and the VXLAN
/// flags its nodes send (I: the VNI is valid).
const TUNNEL_PORT: u16 = 6082;
const VNI: u32 = 1;
const FLAGS_VNI_VALID: u8 = 0x08;
/// The tunnel device on the nodes.
const DEVICE: &str = "egret-vxlan";
/// The MTU test's transfer, each way.
const TRANSFER: usize = 4 << 20;
/// Forged frames per (sender, family).
const FORGED: usize = 5;

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

#[test]
fn k8s_node_routed_workers_reach_the_gateways_through_the_tunnel() {
    // The nodes' tunnel is the kernel's: without its VXLAN driver nothing
    // here can be steered (skipped, or failed under EGRET_REQUIRE_PRIVILEGES=1).
    if egret_tests::sys::is_root() {
        if let Err(why) = tunnel_available() {
            egret_tests::skip(NAME, &why);
            return;
        }
    }
    run_in_a_lab(
        "k8s-node-routed",
        NAME,
        || NodeLab::build_routed(&NodeLab::test_prefix()).expect("build the routed worker-node lab"),
        NodeLab::control,
        scenario,
    );
}

// ------------------------------------------------------------ cluster ---

/// The worker-node lab's objects (Egret and its RBAC, `team-a`, the Nodes,
/// the pods), every Node's `status.addresses` (InternalIP of each family,
/// Hostname), and the dual-stack EgressPolicy `db`.
async fn setup_cluster(lab: &NodeLab, client: &kube::Client) {
    node_lab_cluster(client, "team-a", |pod| if pod.ends_with("-sel") { "db" } else { "other" }).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let mut addrs: Vec<(&str, IpAddr, IpAddr)> = Worker::ALL
        .iter()
        .map(|w| (w.node_name(), IpAddr::V4(lab.node_addr(*w)), IpAddr::V6(lab.node_addr6(*w))))
        .collect();
    addrs.extend(NodeGw::ALL.iter().map(|g| (g.node_name(), IpAddr::V4(g.lan_addr()), IpAddr::V6(g.lan_addr6()))));
    for (name, v4, v6) in addrs {
        let status = json!({"status": {"addresses": [
            {"type": "InternalIP", "address": v4.to_string()},
            {"type": "InternalIP", "address": v6.to_string()},
            {"type": "Hostname", "address": name},
        ]}});
        nodes.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("Node addresses");
    }
    db_policy_dual_stack(client, EIP, EIP6).await;
}

// ------------------------------------------------------------- probes ---

/// One new connection from pod `name` to the server's HTTP address of
/// `v6`'s family: the source the server saw; retried for up to 10 s while
/// it fails to connect (a fresh neighbour table, a first lost SYN).
fn source_of(lab: &NodeLab, name: &str, v6: bool) -> Result<IpAddr, String> {
    let to = if v6 { NodeLab::http6() } else { NodeLab::http() };
    let t = Instant::now();
    loop {
        match egret_tests::probe::once(lab.pod(name), to).unwrap() {
            Ok(s) => return Ok(s.ip()),
            Err(e) if t.elapsed() > Duration::from_secs(10) => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// New connections from pod `name` until the server sees `want` (any other
/// source seen fails, with the agents' status and the end of their logs):
/// how long it took.
fn wait_source(
    lab: &NodeLab,
    agents: &BTreeMap<Worker, Agent>,
    name: &str,
    want: IpAddr,
    timeout: Duration,
) -> Duration {
    let to = if want.is_ipv6() { NodeLab::http6() } else { NodeLab::http() };
    match egret_tests::probe::wait_source(lab.pod(name), to, want, timeout) {
        Ok((_, took)) => took,
        Err(e) => {
            for (w, a) in agents {
                let log = std::fs::read_to_string(&a.log).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                println!("---- {} status: {:?}", w.node_name(), a.status());
                println!(
                    "---- {} log (end):\n{}",
                    w.node_name(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
            panic!("{name}: {e}")
        }
    }
}

// -------------------------------------------------------------- frames ---

/// A tunnel (VXLAN) frame as the router sent it into subnet G.
#[derive(Clone, Debug)]
struct Tunnelled {
    outer_src: IpAddr,
    outer_dst: IpAddr,
    outer_sport: u16,
    outer_dport: u16,
    flags: u8,
    vni: u32,
    /// The outer IP packet's length.
    outer_len: usize,
    inner: Option<Inner>,
}

/// The inner packet of a tunnel frame.
#[derive(Clone, Debug)]
struct Inner {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    sport: u16,
    dport: u16,
    /// A TCP SYN's MSS option.
    syn_mss: Option<u16>,
}

/// An IP packet's addresses, protocol, header length and total length;
/// whether it is an IPv4 fragment or carries an IPv6 fragment header.
struct IpHead {
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    hlen: usize,
    len: usize,
    fragment: bool,
}

fn ip_head(ethertype: u16, p: &[u8]) -> Option<IpHead> {
    match ethertype {
        0x0800 if p.len() >= 20 && p[0] >> 4 == 4 => {
            let a = |o: usize| IpAddr::V4(Ipv4Addr::new(p[o], p[o + 1], p[o + 2], p[o + 3]));
            let flags_off = u16::from_be_bytes([p[6], p[7]]);
            Some(IpHead {
                src: a(12),
                dst: a(16),
                proto: p[9],
                hlen: usize::from(p[0] & 0x0f) * 4,
                len: usize::from(u16::from_be_bytes([p[2], p[3]])),
                fragment: flags_off & 0x3fff != 0,
            })
        }
        0x86dd if p.len() >= 40 => {
            let a = |o: usize| IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&p[o..o + 16]).unwrap()));
            Some(IpHead {
                src: a(8),
                dst: a(24),
                proto: p[6],
                hlen: 40,
                len: 40 + usize::from(u16::from_be_bytes([p[4], p[5]])),
                fragment: p[6] == 44,
            })
        }
        _ => None,
    }
}

/// Whether `f` (from its Ethernet header) is an IP packet that is an outer
/// fragment (IPv4 MF or offset; an IPv6 fragment header).
fn is_fragment(f: &[u8]) -> bool {
    f.len() > 14 && ip_head(u16::from_be_bytes([f[12], f[13]]), &f[14..]).is_some_and(|h| h.fragment)
}

/// The TCP SYN's MSS option in the TCP header `t`.
fn syn_mss(t: &[u8]) -> Option<u16> {
    if t.len() < 20 || t[13] & 0x02 == 0 {
        return None;
    }
    let end = (usize::from(t[12] >> 4) * 4).min(t.len());
    let mut i = 20;
    while i < end {
        match t[i] {
            0 => return None,
            1 => i += 1,
            kind => {
                let len = usize::from(*t.get(i + 1)?);
                if kind == 2 && len == 4 {
                    return Some(u16::from_be_bytes([*t.get(i + 2)?, *t.get(i + 3)?]));
                }
                i += len.max(2);
            }
        }
    }
    None
}

/// `f` as a tunnel frame: UDP to [`TUNNEL_PORT`] (None otherwise).
fn tunnelled(f: &[u8]) -> Option<Tunnelled> {
    let outer = ip_head(u16::from_be_bytes([*f.get(12)?, *f.get(13)?]), f.get(14..)?)?;
    if outer.proto != 17 || outer.fragment {
        return None;
    }
    let udp = f.get(14 + outer.hlen..)?;
    let (sport, dport) = (u16::from_be_bytes([udp[0], udp[1]]), u16::from_be_bytes([*udp.get(2)?, *udp.get(3)?]));
    if dport != TUNNEL_PORT {
        return None;
    }
    let vxlan = udp.get(8..)?;
    let (flags, vni) = (*vxlan.first()?, u32::from_be_bytes([0, *vxlan.get(4)?, vxlan[5], vxlan[6]]));
    let inner_eth = vxlan.get(8..)?;
    let inner = (|| {
        let h = ip_head(u16::from_be_bytes([*inner_eth.get(12)?, inner_eth[13]]), inner_eth.get(14..)?)?;
        let l4 = inner_eth.get(14 + h.hlen..)?;
        let ports = |o: usize| u16::from_be_bytes([l4[o], l4[o + 1]]);
        let (sport, dport) = if matches!(h.proto, 6 | 17) && l4.len() >= 4 { (ports(0), ports(2)) } else { (0, 0) };
        let syn_mss = if h.proto == 6 { syn_mss(l4) } else { None };
        Some(Inner { src: h.src, dst: h.dst, proto: h.proto, sport, dport, syn_mss })
    })();
    Some(Tunnelled {
        outer_src: outer.src,
        outer_dst: outer.dst,
        outer_sport: sport,
        outer_dport: dport,
        flags,
        vni,
        outer_len: outer.len,
        inner,
    })
}

/// The internet checksum of `chunks` laid end to end (each of even length
/// but the last).
fn checksum(chunks: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for c in chunks {
        for pair in c.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    }
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// A VXLAN payload (what a node's `egret-vxlan` puts after the outer UDP
/// header) carrying an Ethernet frame (MACs `mac`) with a UDP datagram
/// `src:sport -> dst:7` whose payload is `token`.
fn vxlan_payload(mac: [u8; 6], src: IpAddr, sport: u16, dst: IpAddr, token: &str) -> Vec<u8> {
    let mut udp = Vec::new();
    udp.extend_from_slice(&sport.to_be_bytes());
    udp.extend_from_slice(&plan::ECHO_PORT.to_be_bytes());
    udp.extend_from_slice(&((8 + token.len()) as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(token.as_bytes());
    let ulen = (udp.len() as u16).to_be_bytes();
    let (ethertype, ip) = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let pseudo = [&s.octets()[..], &d.octets()[..], &[0, 17], &ulen[..]].concat();
            let c = checksum(&[&pseudo, &udp]);
            udp[6..8].copy_from_slice(&(if c == 0 { 0xffff } else { c }).to_be_bytes());
            let mut h = vec![0x45, 0, 0, 0, 0x12, 0x34, 0x40, 0, 64, 17, 0, 0];
            h[2..4].copy_from_slice(&((20 + udp.len()) as u16).to_be_bytes());
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            let c = checksum(&[&h]);
            h[10..12].copy_from_slice(&c.to_be_bytes());
            (0x0800u16, [h, udp].concat())
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let pseudo = [&s.octets()[..], &d.octets()[..], &[0, 0], &ulen[..], &[0, 0, 0, 17]].concat();
            let c = checksum(&[&pseudo, &udp]);
            udp[6..8].copy_from_slice(&(if c == 0 { 0xffff } else { c }).to_be_bytes());
            let mut h = vec![0x60, 0, 0, 0];
            h.extend_from_slice(&ulen);
            h.extend_from_slice(&[17, 64]);
            h.extend_from_slice(&s.octets());
            h.extend_from_slice(&d.octets());
            (0x86ddu16, [h, udp].concat())
        }
        _ => panic!("mixed families {src} -> {dst}"),
    };
    let mut out = vec![FLAGS_VNI_VALID, 0, 0, 0];
    out.extend_from_slice(&(VNI << 8).to_be_bytes());
    out.extend_from_slice(&mac);
    out.extend_from_slice(&mac);
    out.extend_from_slice(&ethertype.to_be_bytes());
    out.extend_from_slice(&ip);
    out
}

/// Sends `payload` from `from` (an address of `ns`) to `to`'s tunnel port.
fn send_udp(ns: &NetNs, from: IpAddr, to: IpAddr, payload: &[u8]) {
    ns.run_in(|| {
        let s = UdpSocket::bind(SocketAddr::new(from, 0)).expect("bind the sender");
        s.send_to(payload, SocketAddr::new(to, TUNNEL_PORT)).expect("send");
    })
    .expect("enter the sender's namespace");
}

/// The MAC of `egret-vxlan` on `ns` (what the node writes as the inner
/// Ethernet addresses), or a made-up one when it has no such device.
fn device_mac(ns: &NetNs) -> [u8; 6] {
    let out = ns.ip(&["-o", "link", "show", "dev", DEVICE]).unwrap_or_default();
    let text = out.split("link/ether ").nth(1).and_then(|r| r.split_whitespace().next()).unwrap_or("");
    let bytes: Vec<u8> = text.split(':').filter_map(|b| u8::from_str_radix(b, 16).ok()).collect();
    <[u8; 6]>::try_from(bytes).unwrap_or([0x02, 0, 0, 0, 0x99, 0x01])
}

// ----------------------------------------------------- kernel and status ---

/// What the failover must leave untouched on a worker: `ip rule` and `ip -d
/// route show table all` of both families, `ip -d link show egret-vxlan`.
fn kernel_snapshot(ns: &NetNs) -> BTreeMap<&'static str, String> {
    let mut m = BTreeMap::new();
    m.insert("ip -4 rule", ns.ip(&["-4", "rule", "show"]).unwrap());
    m.insert("ip -6 rule", ns.ip(&["-6", "rule", "show"]).unwrap());
    m.insert("ip -4 -d route show table all", ns.ip(&["-4", "-d", "route", "show", "table", "all"]).unwrap());
    m.insert("ip -6 -d route show table all", ns.ip(&["-6", "-d", "route", "show", "table", "all"]).unwrap());
    m.insert(
        "ip -d link show egret-vxlan",
        ns.ip(&["-d", "link", "show", "dev", DEVICE]).unwrap_or_else(|e| e.to_string()),
    );
    m
}

/// Every JSON object in `v` (depth first).
fn objects(v: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
    match v {
        serde_json::Value::Object(o) => {
            out.push(v.clone());
            o.values().for_each(|x| objects(x, out));
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| objects(x, out)),
        _ => {}
    }
}

/// The status file's record of next hop `hop` with path `path`: an object
/// holding both as string values, or `hop` as a key whose value is `path`
/// or holds it.
fn hop_with_path(status: &serde_json::Value, hop: IpAddr, path: &str) -> Option<serde_json::Value> {
    let hop = hop.to_string();
    let mut all = Vec::new();
    objects(status, &mut all);
    all.into_iter().find_map(|o| {
        let map = o.as_object()?;
        let vals: Vec<&str> = map.values().filter_map(|v| v.as_str()).collect();
        if vals.contains(&hop.as_str()) && vals.contains(&path) {
            return Some(o.clone());
        }
        let v = map.get(&hop)?;
        let inner: Vec<&str> =
            v.as_object().map(|m| m.values().filter_map(|x| x.as_str()).collect()).unwrap_or_default();
        (v.as_str() == Some(path) || inner.contains(&path)).then(|| serde_json::json!({ hop.clone(): v }))
    })
}

/// The encapsulated route lines of `worker` towards `hop`.
fn encap_routes(ns: &NetNs, hop: IpAddr) -> Vec<String> {
    let fam = if hop.is_ipv6() { "-6" } else { "-4" };
    let kind = if hop.is_ipv6() { "encap ip6 " } else { "encap ip " };
    ns.ip(&[fam, "-d", "route", "show", "table", "all"])
        .unwrap()
        .lines()
        .filter(|l| l.contains(kind) && l.contains(&format!("dst {hop} ")) && l.contains(&format!("dev {DEVICE} ")))
        .map(|l| l.trim().to_string())
        .collect()
}

// ------------------------------------------------------------- metrics ---

/// The samples of `g`'s `/metrics` whose line mentions decapsulation drops:
/// (sample name with labels, value).
fn decap_drops(lab: &NodeLab, g: NodeGw) -> BTreeMap<String, u64> {
    let (code, text) =
        http_get_in(lab.gateway_ns(g), METRICS.parse().unwrap(), "/metrics").expect("the gateway's /metrics");
    assert_eq!(code, 200, "{}: /metrics", g.node_name());
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains("decap") && l.contains("drop"))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse::<f64>().ok()? as u64))
        })
        .collect()
}

/// What grew from `before` to `after`.
fn grew(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v.saturating_sub(before.get(k).copied().unwrap_or(0));
            (d > 0).then(|| (k.clone(), d))
        })
        .collect()
}

// ------------------------------------------------------------ transfers ---

/// A 4 MiB upload (HTTP POST) from pod `pod` to the server: the source and
/// the byte count the server reported.
fn upload(ns: &NetNs, to: SocketAddr) -> Result<(String, usize), String> {
    ns.run_in(|| -> Result<(String, usize), String> {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5)).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        s.set_write_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        let head =
            format!("POST /upload HTTP/1.1\r\nHost: {to}\r\nContent-Length: {TRANSFER}\r\nConnection: close\r\n\r\n");
        s.write_all(head.as_bytes()).map_err(|e| format!("send: {e}"))?;
        let chunk = vec![b'x'; 64 * 1024];
        for _ in 0..TRANSFER / chunk.len() {
            s.write_all(&chunk).map_err(|e| format!("send: {e}"))?;
        }
        let mut text = String::new();
        s.read_to_string(&mut text).map_err(|e| format!("read: {e}"))?;
        let line = text.split_once("\r\n\r\n").map(|(_, b)| b.trim()).unwrap_or_default();
        let src = line.split_whitespace().nth(1).unwrap_or_default().to_string();
        let got = line.rsplit("received=").next().and_then(|n| n.trim().parse().ok()).unwrap_or(0);
        Ok((src, got))
    })
    .expect("enter the pod")
}

/// A 4 MiB download (`GET /download/<n>`) to pod `pod`: the source the
/// server saw and the bytes received after its first line.
fn download(ns: &NetNs, to: SocketAddr) -> Result<(String, usize), String> {
    ns.run_in(|| -> Result<(String, usize), String> {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5)).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        s.write_all(format!("GET /download/{TRANSFER} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n").as_bytes())
            .map_err(|e| format!("send: {e}"))?;
        let mut all = Vec::new();
        s.read_to_end(&mut all).map_err(|e| format!("read after {} bytes: {e}", all.len()))?;
        let body = all.windows(4).position(|w| w == b"\r\n\r\n").map(|i| &all[i + 4..]).unwrap_or_default();
        let nl = body.iter().position(|b| *b == b'\n').unwrap_or(body.len());
        let line = String::from_utf8_lossy(&body[..nl]).to_string();
        let src = line.split_whitespace().nth(1).unwrap_or_default().to_string();
        Ok((src, body.len().saturating_sub(nl + 1)))
    })
    .expect("enter the pod")
}

/// ICMP Fragmentation Needed / ICMPv6 Packet Too Big in `frames` (those
/// arriving at a pod): their MTU values.
fn too_big(frames: &[Frame]) -> Vec<(IpAddr, u32)> {
    frames
        .iter()
        .filter_map(|f| {
            let h = ip_head(u16::from_be_bytes([*f.data.get(12)?, *f.data.get(13)?]), f.data.get(14..)?)?;
            let icmp = f.data.get(14 + h.hlen..)?;
            match (h.proto, icmp.first()?, icmp.get(1)?) {
                (1, 3, 4) => Some((h.src, u32::from(u16::from_be_bytes([*icmp.get(6)?, *icmp.get(7)?])))),
                (58, 2, 0) => Some((h.src, u32::from_be_bytes(icmp.get(4..8)?.try_into().ok()?))),
                _ => None,
            }
        })
        .collect()
}

// ------------------------------------------------------------ scenario ---

fn scenario(lab: &NodeLab, server: &ApiServer) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    rt.block_on(setup_cluster(lab, &client));
    let (gw_kc, node_kc) = rt.block_on(egret_kubeconfigs(&client, server.kubeconfig_path(), lab.dir()));
    let upstream = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");
    let into_g = Capture::start(lab.lan(), "p-rt").expect("capture what the router sends into subnet G");
    let mut gws = start_node_lab_gateways(lab, &gw_kc);
    let agents: BTreeMap<Worker, Agent> =
        Worker::ALL.iter().map(|w| (*w, start_synced_agent(lab, *w, &node_kc, &[]))).collect();

    // 1. Selected pods leave with the egress IPs, unselected ones with
    //    their node's addresses.
    for w in Worker::ALL {
        let n = w.node_name();
        let took = wait_source(lab, &agents, &format!("{n}-sel"), IpAddr::V4(EIP), Duration::from_secs(30));
        println!("k8s-node-routed: {n}-sel leaves as {EIP} ({} ms after the agents synced)", ms(took));
        let took = wait_source(lab, &agents, &format!("{n}-sel"), IpAddr::V6(EIP6), Duration::from_secs(30));
        println!("k8s-node-routed: {n}-sel leaves as {EIP6} ({} ms later)", ms(took));
        assert_eq!(source_of(lab, &format!("{n}-uns"), false), Ok(IpAddr::V4(lab.node_addr(w))), "{n}-uns over IPv4");
        assert_eq!(source_of(lab, &format!("{n}-uns"), true), Ok(IpAddr::V6(lab.node_addr6(w))), "{n}-uns over IPv6");
    }

    // 2. The encapsulated routes, and the path the agents report.
    for w in Worker::ALL {
        let n = w.node_name();
        let ns = lab.worker(w);
        for hop in [IpAddr::V4(EIP), IpAddr::V6(EIP6)] {
            let routes = encap_routes(ns, hop);
            let table = ns.ip(&[if hop.is_ipv6() { "-6" } else { "-4" }, "-d", "route", "show", "table", "all"]);
            assert!(!routes.is_empty(), "{n}: no route `encap ... dst {hop}` on dev {DEVICE}:\n{table:?}");
            for r in &routes {
                println!("k8s-node-routed: {n}: {r}");
            }
        }
        let link = ns.ip(&["-d", "link", "show", "dev", DEVICE]).unwrap_or_else(|e| panic!("{n}: no {DEVICE}: {e}"));
        assert!(link.contains("vxlan external") && link.contains(&format!("dstport {TUNNEL_PORT}")), "{n}: {link}");
        let st = agents[&w].wait_synced(0, Duration::from_secs(10)).expect("the agent's status");
        for hop in [IpAddr::V4(EIP), IpAddr::V6(EIP6)] {
            let rec = hop_with_path(&st, hop, "vxlan");
            assert!(rec.is_some(), "{n}: the status file has no next hop {hop} with path vxlan: {st}");
            println!("k8s-node-routed: {n}: status {}", rec.unwrap());
        }
        let cli = std::process::Command::new(egret_tests::gateway::egret_binary().unwrap())
            .args(["node", "status", "--status-file"])
            .arg(&agents[&w].status_file)
            .output()
            .expect("egret node status");
        let text = String::from_utf8_lossy(&cli.stdout);
        assert!(
            text.lines().any(|l| l.contains(&EIP.to_string()) && l.contains("vxlan")),
            "{n}: `egret node status` names no path vxlan for {EIP}:\n{text}"
        );
    }

    // 3. Several flows from each selected pod, then what reached subnet G.
    for w in Worker::ALL {
        for v6 in [false, true] {
            for _ in 0..6 {
                let want = if v6 { IpAddr::V6(EIP6) } else { IpAddr::V4(EIP) };
                assert_eq!(source_of(lab, &format!("{}-sel", w.node_name()), v6), Ok(want));
            }
        }
    }
    let frames = into_g.stop().expect("stop the subnet G capture");
    tunnel_frames(lab, &frames);

    // 4. Forged tunnel frames.
    forged(lab);

    // 5. SIGKILL of the holder: the nodes' kernels do not change.
    let before: Vec<_> = Worker::ALL.iter().map(|w| kernel_snapshot(lab.worker(*w))).collect();
    let holder = rt
        .block_on(lease_holder_name(&client, IpAddr::V4(EIP)))
        .and_then(|h| NodeGw::by_node_name(&h))
        .expect("the egress IP has a holder");
    let kill = Instant::now();
    gws.get_mut(&holder).unwrap().kill().expect("kill the holder");
    for w in Worker::ALL {
        let n = w.node_name();
        wait_source(lab, &agents, &format!("{n}-sel"), IpAddr::V4(EIP), Duration::from_secs(45));
        println!(
            "k8s-node-routed: after SIGKILL of {}: {n}-sel leaves as {EIP} again {} ms after the kill",
            holder.node_name(),
            ms(kill.elapsed())
        );
        wait_source(lab, &agents, &format!("{n}-sel"), IpAddr::V6(EIP6), Duration::from_secs(45));
    }
    let new = rt.block_on(lease_holder_name(&client, IpAddr::V4(EIP))).and_then(|h| NodeGw::by_node_name(&h));
    assert!(new.is_some_and(|g| g != holder), "the other gateway holds {EIP}: {new:?}");
    let after: Vec<_> = Worker::ALL.iter().map(|w| kernel_snapshot(lab.worker(*w))).collect();
    for (i, w) in Worker::ALL.iter().enumerate() {
        for (what, text) in &before[i] {
            assert_eq!(&after[i][what], text, "{}: `{what}` changed across the failover", w.node_name());
        }
    }
    println!(
        "k8s-node-routed: failover: {} took {EIP}; rules, routes and {DEVICE} on both workers unchanged",
        new.unwrap().node_name()
    );

    // 6. MTU: 4 MiB each way from a pod with MTU 1500.
    mtu(lab);

    for (w, a) in &agents {
        let st = a.status().expect("status");
        println!("k8s-node-routed: {}: {} passes, lastSyncOk {}", w.node_name(), st["syncs"], st["lastSyncOk"]);
    }
    let frames = upstream.stop().expect("stop the upstream capture");
    show_pod_frames(&frames);
    assert_no_pod_address_left(lab, &frames);
    println!("k8s-node-routed: no pod address in {} frames on the upstream link or at the server", frames.len());
    drop(agents);
    drop(gws);
}

/// Prints each frame of `frames` (the upstream link's) with a pod's source
/// address, with who sent it (by source MAC) and what it carries: what a
/// failure of the check after it leaves to go on.
fn show_pod_frames(frames: &[Frame]) {
    let pods: [ipnet::IpNet; 2] = [
        egret_tests::nodelab::CLUSTER_POD_CIDR.parse().unwrap(),
        egret_tests::nodelab::CLUSTER_POD_CIDR6.parse().unwrap(),
    ];
    let who = |m: [u8; 6]| {
        NodeGw::ALL.iter().find(|g| g.mac() == m).map(|g| g.node_name().to_string()).unwrap_or_else(|| {
            if m == egret_tests::nodelab::ROUTER_G_MAC {
                "rt".into()
            } else {
                format!("{m:02x?}")
            }
        })
    };
    for f in frames {
        let Some(i) = egret_tests::capture::ip_info(&f.data) else { continue };
        if pods.iter().any(|p| p.contains(&i.src)) {
            let hdr = if i.src.is_ipv4() { 14 + 20 } else { 14 + 40 };
            let l4: Vec<String> = f.data.iter().skip(hdr).take(36).map(|b| format!("{b:02x}")).collect();
            println!(
                "k8s-node-routed: upstream link at {:?}: from {}: {} -> {} proto {} ({} bytes; L4 {})",
                f.at,
                who(i.eth_src),
                i.src,
                i.dst,
                i.proto,
                f.data.len(),
                l4.join("")
            );
        }
    }
}

/// Phase 3: the tunnel frames the router sent into subnet G.
fn tunnel_frames(lab: &NodeLab, frames: &[Frame]) {
    let bare = pod_sourced(frames);
    assert!(
        bare.is_empty(),
        "{} frames in subnet G carried a pod's address outside the tunnel: {:?}",
        bare.len(),
        &bare[..bare.len().min(5)]
    );
    let tun: Vec<Tunnelled> = frames.iter().filter_map(|f| tunnelled(&f.data)).collect();
    for w in Worker::ALL {
        let n = w.node_name();
        let node: [IpAddr; 2] = [lab.node_addr(w).into(), lab.node_addr6(w).into()];
        let mine: Vec<&Tunnelled> = tun
            .iter()
            .filter(|t| {
                t.inner
                    .as_ref()
                    .is_some_and(|i| i.src == IpAddr::V4(w.pod_addr(10)) || i.src == IpAddr::V6(w.pod_addr6(10)))
            })
            .collect();
        assert!(!mine.is_empty(), "no tunnel frame from {n}-sel reached subnet G ({} frames captured)", frames.len());
        for t in &mine {
            assert!(node.contains(&t.outer_src), "{n}-sel's frame from {} (not {n}'s InternalIP): {t:?}", t.outer_src);
            assert!([IpAddr::V4(EIP), IpAddr::V6(EIP6)].contains(&t.outer_dst), "{n}: outer destination {t:?}");
            assert_eq!((t.outer_dport, t.flags, t.vni), (TUNNEL_PORT, FLAGS_VNI_VALID, VNI), "{n}: {t:?}");
        }
        // One outer source port per flow, distinct across flows.
        let mut ports: BTreeMap<(IpAddr, u16, IpAddr, u16, u8), BTreeSet<u16>> = BTreeMap::new();
        for t in &mine {
            let i = t.inner.as_ref().unwrap();
            ports.entry((i.src, i.sport, i.dst, i.dport, i.proto)).or_default().insert(t.outer_sport);
        }
        let split: Vec<_> = ports.iter().filter(|(_, p)| p.len() > 1).collect();
        assert!(split.is_empty(), "{n}: a flow's frames left with several outer source ports: {split:?}");
        let distinct: BTreeSet<u16> = ports.values().flatten().copied().collect();
        assert!(ports.len() >= 12, "{n}: at least 12 flows tunnelled: {}", ports.len());
        assert!(
            distinct.len() * 10 >= ports.len() * 9,
            "{n}: {} flows shared {} outer source ports: {ports:?}",
            ports.len(),
            distinct.len()
        );
        println!(
            "k8s-node-routed: {n}: {} tunnel frames from {} and {} to port {TUNNEL_PORT} VNI {VNI}, {} flows, {} distinct outer source ports",
            mine.len(),
            node[0],
            node[1],
            ports.len(),
            distinct.len()
        );
    }
}

/// Phase 4: forged tunnel frames are dropped and counted, never translated;
/// the same frame from a Node's InternalIP is translated.
fn forged(lab: &NodeLab) {
    let w1 = Worker::One;
    let mac = device_mac(lab.worker(w1));
    let before: Vec<_> = NodeGw::ALL.iter().map(|g| decap_drops(lab, *g)).collect();
    let senders: [(&str, &NetNs, IpAddr, IpAddr); 2] = [
        ("outside", lab.server_ns(), plan::SERVER.into(), plan::SERVER6.into()),
        ("subnet-g", lab.upstream(), STRANGER_G.into(), stranger_g6().into()),
    ];
    let mut sport = 41000;
    for (what, ns, from4, from6) in &senders {
        for (from, pod, eip, srv) in [
            (*from4, IpAddr::V4(w1.pod_addr(10)), IpAddr::V4(EIP), IpAddr::V4(plan::SERVER)),
            (*from6, IpAddr::V6(w1.pod_addr6(10)), IpAddr::V6(EIP6), IpAddr::V6(plan::SERVER6)),
        ] {
            for i in 0..FORGED {
                sport += 1;
                let token = format!("forged-{what}-{i}-{sport}");
                send_udp(ns, from, eip, &vxlan_payload(mac, pod, sport, srv, &token));
            }
        }
    }
    // The positive control: the same frame from w1's InternalIP. The pod
    // holds the inner source port, so the echo the gateway translates back
    // reaches a socket (and proves the native way back) instead of drawing
    // a port unreachable: w1's conntrack never saw the datagram go out, so
    // the pod's answer would be a reply to an inbound connection, which the
    // agent leaves to the default path (node/nft.rs) with the pod's address.
    let server = lab.server().expect("the server");
    for (from, pod, eip, srv) in [
        (IpAddr::V4(lab.node_addr(w1)), IpAddr::V4(w1.pod_addr(10)), IpAddr::V4(EIP), IpAddr::V4(plan::SERVER)),
        (IpAddr::V6(lab.node_addr6(w1)), IpAddr::V6(w1.pod_addr6(10)), IpAddr::V6(EIP6), IpAddr::V6(plan::SERVER6)),
    ] {
        sport += 1;
        let token = format!("control-{sport}");
        let at_pod = lab
            .pod("w1-sel")
            .run_in(|| UdpSocket::bind(SocketAddr::new(pod, sport)))
            .expect("enter the pod")
            .expect("bind the control's port in the pod");
        at_pod.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let t = Instant::now();
        let seen = loop {
            send_udp(lab.worker(w1), from, eip, &vxlan_payload(mac, pod, sport, srv, &token));
            if let Some(s) = server.wait_for(Duration::from_millis(500), |s| s.token == token) {
                break s;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "the control frame from {from} was never translated");
        };
        assert_eq!(seen.src.ip(), eip, "the control frame from {from} left as {seen}");
        let mut buf = [0u8; 512];
        let echo = loop {
            if let Ok((n, _)) = at_pod.recv_from(&mut buf) {
                break String::from_utf8_lossy(&buf[..n]).to_string();
            }
            assert!(t.elapsed() < Duration::from_secs(15), "the control's echo never reached the pod");
        };
        assert!(echo.starts_with(&format!("saw {}", SocketAddr::new(eip, seen.src.port()))), "echo {echo:?}");
        println!(
            "k8s-node-routed: forged: the control frame from {from} (a Node) left as {}; its echo reached the pod",
            seen.src
        );
    }
    let expected = senders.len() * 2 * FORGED;
    let deadline = Instant::now() + Duration::from_secs(10);
    let (total, unknown, deltas) = loop {
        let deltas: BTreeMap<String, u64> = NodeGw::ALL
            .iter()
            .enumerate()
            .flat_map(|(i, g)| {
                grew(&before[i], &decap_drops(lab, *g))
                    .into_iter()
                    .map(move |(k, v)| (format!("{}: {k}", g.node_name()), v))
            })
            .collect();
        let total: u64 = deltas.values().sum();
        let unknown: u64 = deltas.iter().filter(|(k, _)| k.contains("unknown_node")).map(|(_, v)| v).sum();
        if total as usize >= expected || Instant::now() > deadline {
            break (total, unknown, deltas);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let leaked: Vec<String> =
        server.seen().iter().filter(|s| s.token.starts_with("forged-")).map(|s| s.to_string()).collect();
    assert!(leaked.is_empty(), "forged tunnel frames were translated: {leaked:?}");
    println!("k8s-node-routed: forged: {expected} frames sent, decapsulation drops grew by {total} ({unknown} as unknown node): {deltas:?}");
    assert!(
        total as usize >= expected,
        "the gateways' decapsulation drop counters grew by {total}, not {expected}: {deltas:?}"
    );
}

/// Phase 6: 4 MiB each way between `w1-sel` (MTU 1500) and the server.
fn mtu(lab: &NodeLab) {
    let pod = lab.pod("w1-sel");
    let mtu = pod.ip(&["-o", "link", "show", "dev", "eth0"]).unwrap();
    assert!(mtu.contains("mtu 1500 "), "the pod's MTU: {mtu}");
    let at_pod = Capture::start(pod, "eth0").expect("capture at the pod");
    let into_g = Capture::start(lab.lan(), "p-rt").expect("capture into subnet G");
    for (v6, to, eip) in [(false, NodeLab::http(), IpAddr::V4(EIP)), (true, NodeLab::http6(), IpAddr::V6(EIP6))] {
        let t = Instant::now();
        let up = upload(pod, to);
        let up_ms = ms(t.elapsed());
        let t = Instant::now();
        let down = download(pod, to);
        let down_ms = ms(t.elapsed());
        println!(
            "k8s-node-routed: mtu: IPv{}: upload {up:?} in {up_ms} ms, download {down:?} in {down_ms} ms",
            if v6 { 6 } else { 4 }
        );
        let (src, n) = up.unwrap_or_else(|e| panic!("the IPv{} upload failed: {e}", if v6 { 6 } else { 4 }));
        assert!(src.parse::<SocketAddr>().is_ok_and(|s| s.ip() == eip), "the upload left as {src}, not {eip}");
        assert_eq!(n, TRANSFER, "the server received {n} of {TRANSFER} bytes");
        let (src, n) = down.unwrap_or_else(|e| panic!("the IPv{} download failed: {e}", if v6 { 6 } else { 4 }));
        assert!(src.parse::<SocketAddr>().is_ok_and(|s| s.ip() == eip), "the download was served to {src}, not {eip}");
        assert_eq!(n, TRANSFER, "the pod received {n} of {TRANSFER} bytes");
    }
    let frames = into_g.stop().expect("stop the capture");
    let at_pod = at_pod.stop().expect("stop the capture");
    let fragments = frames.iter().filter(|f| is_fragment(&f.data)).count();
    let tun: Vec<Tunnelled> = frames.iter().filter_map(|f| tunnelled(&f.data)).collect();
    let largest = |v6: bool| tun.iter().filter(|t| t.outer_src.is_ipv6() == v6).map(|t| t.outer_len).max().unwrap_or(0);
    let mss = |v6: bool| -> Vec<u16> {
        tun.iter()
            .filter_map(|t| t.inner.as_ref())
            .filter(|i| i.src.is_ipv6() == v6 && i.dport == plan::HTTP_PORT)
            .filter_map(|i| i.syn_mss)
            .collect()
    };
    let icmp = too_big(&at_pod);
    println!(
        "k8s-node-routed: mtu: in subnet G: {} tunnel frames, largest outer packet {} (IPv4) / {} (IPv6) bytes (veth carries GSO packets whole), {fragments} outer fragments; SYN MSS in the tunnel {:?} (IPv4) / {:?} (IPv6); at the pod: {} Fragmentation Needed / Packet Too Big {:?}",
        tun.len(),
        largest(false),
        largest(true),
        mss(false),
        mss(true),
        icmp.len(),
        icmp.iter().collect::<BTreeSet<_>>()
    );
    assert_eq!(fragments, 0, "outer fragments in subnet G (the gateways drop them)");
    for v6 in [false, true] {
        let clamped = mss(v6).iter().any(|m| *m <= if v6 { 1500 - 70 - 60 } else { 1500 - 50 - 40 });
        let told = icmp.iter().any(|(src, m)| src.is_ipv6() == v6 && *m > 0 && *m < 1500);
        assert!(
            clamped || told,
            "IPv{}: neither a clamped MSS in the tunnel nor an ICMP too-big to the pod",
            if v6 { 6 } else { 4 }
        );
    }
}

/// The test's own frame code, without a lab: what [`vxlan_payload`]
/// writes (with checksums that verify) is what [`tunnelled`] reads back,
/// and a SYN's MSS and an outer fragment are told.
#[test]
fn tunnel_frames_built_and_read_back() {
    let mac = [2, 0, 0, 0, 0, 1];
    for (outer_src, outer_dst, pod, srv) in [
        (
            IpAddr::V4(Worker::One.routed_addr()),
            IpAddr::V4(EIP),
            IpAddr::V4(Worker::One.pod_addr(10)),
            IpAddr::V4(plan::SERVER),
        ),
        (
            IpAddr::V6(Worker::One.routed_addr6()),
            IpAddr::V6(EIP6),
            IpAddr::V6(Worker::One.pod_addr6(10)),
            IpAddr::V6(plan::SERVER6),
        ),
    ] {
        let payload = vxlan_payload(mac, pod, 40001, srv, "token");
        // The inner IP packet's checksums sum to zero.
        let inner = &payload[8 + 14..];
        let (hlen, pseudo) = match (pod, srv) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                assert_eq!(checksum(&[&inner[..20]]), 0, "IPv4 header checksum");
                let len = (inner.len() as u16 - 20).to_be_bytes();
                (20, [&s.octets()[..], &d.octets()[..], &[0, 17], &len[..]].concat())
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let len = (inner.len() as u16 - 40).to_be_bytes();
                (40, [&s.octets()[..], &d.octets()[..], &[0, 0], &len[..], &[0, 0, 0, 17]].concat())
            }
            _ => unreachable!(),
        };
        assert_eq!(checksum(&[&pseudo, &inner[hlen..]]), 0, "UDP checksum");
        // Wrapped as a node sends it: Ethernet, outer IP, UDP to the port.
        let mut udp = 50000u16.to_be_bytes().to_vec();
        udp.extend_from_slice(&TUNNEL_PORT.to_be_bytes());
        udp.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
        udp.extend_from_slice(&[0, 0]);
        udp.extend_from_slice(&payload);
        let (ethertype, ip) = match (outer_src, outer_dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                let mut h = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, 17, 0, 0];
                h[2..4].copy_from_slice(&((20 + udp.len()) as u16).to_be_bytes());
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                (0x0800u16, h)
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                let mut h = vec![0x60, 0, 0, 0];
                h.extend_from_slice(&(udp.len() as u16).to_be_bytes());
                h.extend_from_slice(&[17, 64]);
                h.extend_from_slice(&s.octets());
                h.extend_from_slice(&d.octets());
                (0x86dd, h)
            }
            _ => unreachable!(),
        };
        let frame = [&[0u8; 12][..], &ethertype.to_be_bytes(), &ip, &udp].concat();
        let t = tunnelled(&frame).expect("a tunnel frame");
        assert_eq!(
            (t.outer_src, t.outer_dst, t.outer_sport, t.outer_dport, t.flags, t.vni),
            (outer_src, outer_dst, 50000, TUNNEL_PORT, FLAGS_VNI_VALID, VNI)
        );
        assert_eq!(t.outer_len, ip.len() + udp.len());
        let i = t.inner.expect("the inner packet");
        assert_eq!((i.src, i.dst, i.proto, i.sport, i.dport, i.syn_mss), (pod, srv, 17, 40001, plan::ECHO_PORT, None));
        assert!(!is_fragment(&frame));
        if ethertype == 0x0800 {
            let mut frag = frame.clone();
            frag[14 + 6] |= 0x20; // MF
            assert!(is_fragment(&frag) && tunnelled(&frag).is_none());
        }
    }
    // A SYN with NOP, NOP, MSS 1410 (after a window scale).
    let mut tcp = vec![0u8; 32];
    tcp[12] = 8 << 4;
    tcp[13] = 0x02;
    tcp[20..32].copy_from_slice(&[1, 1, 3, 3, 7, 2, 4, 0x05, 0x82, 0, 0, 0]);
    assert_eq!(syn_mss(&tcp), Some(1410));
    tcp[13] = 0x10;
    assert_eq!(syn_mss(&tcp), None, "not a SYN");
}
