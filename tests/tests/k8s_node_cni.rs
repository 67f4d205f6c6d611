//! The worker-node agent over real CNI plugins: the worker-node lab's CNI
//! variant (`NodeLab::build_with_plugins`), where `w1`'s pods are made by
//! Debian's `containernetworking-plugins` (bridge `cni0` with `ipMasq`,
//! host-local IPAM, portmap) run through the CNI protocol as a container
//! runtime runs them (`egret_tests::cni`), so that every masquerade, hairpin
//! and port-mapping rule on the node is the plugins' own. The real
//! `egret node` runs on `w1` with the deployed RBAC, two gateways in
//! Kubernetes mode, a real kube-apiserver.
//!
//! 1. The plugins' rules are there (a `CNI-<id>` chain with `MASQUERADE`
//!    per pod, `CNI-HOSTPORT-DNAT` for `w1-sel`'s `hostPort`, portmap's
//!    hairpin mark and masquerade) and nothing hand-written; CHECK passes.
//! 2. Before the agent, the paths a pod has on such a node are measured:
//!    each pod's outbound source (the plugin's masquerade: the node's
//!    address), the `hostPort` from outside (the pod sees the client's own
//!    address), the hairpin (a pod to the `hostPort` through the node: seen
//!    as `cni0`'s address, portmap's masquerade), and a pod to another pod on
//!    the same bridge (seen with its own address). IPv4 and IPv6.
//! 3. With the agent and the policy: `w1-sel` leaves with the egress IPs,
//!    past the plugin's masquerade (whose rule then matches none of its
//!    connections); every other path is as before the agent; the replies of
//!    the `hostPort` connections leave `w1` for the upstream router
//!    directly, none through a gateway; the agent changed no iptables rule.
//!    (The agent's first steering bit, 0x2000, was portmap's
//!    `markMasqBit`: this test caught a selected pod's traffic to a pod on
//!    its bridge arriving from the bridge's address.)
//! 4. A pod added under the agent (ADD with a `hostPort`, its Pod object
//!    written): it is steered and its `hostPort` answers; DEL removes what
//!    ADD made (iptables rules of both families, the veth, the pod's
//!    interface, host-local's allocation), a second DEL succeeds, and the
//!    agent drops its rule once the Pod object is gone.
//!
//! Throughout, a capture on the upstream link and the server's journal must
//! show no pod address. Lines starting `k8s-node-cni:` carry the figures.
//! Skipped (with a message) when not root or the API server is not built;
//! `EGRET_REQUIRE_APISERVER=1` makes that a failure. A missing plugin is a
//! failure naming its package (tests/install-deps.sh installs it).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture, Frame};
use egret_tests::cni::{self, Attachment, PortMapping, RuntimeConf};
use egret_tests::netns::NetNs;
use egret_tests::nodelab::{
    NodeGw, NodeLab, Worker, CNI_BRIDGE, CNI_NETWORK, CONTAINER_PORT, HOST_PORT, POD_NAMESPACE,
};
use egret_tests::{client, probe};
use k8s_common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use socket2::{Domain, Protocol, Socket, Type};

const NAME: &str = "k8s_node_agent_over_the_cni_reference_plugins";
/// The policy's egress IPs (on the segment: their own next hops).
const EIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
const EIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 0x40);
/// The pod added and deleted under the agent, and its `hostPort`.
const TMP: &str = "w1-tmp";
const TMP_HOST_PORT: u16 = 30081;
fn ms(d: Duration) -> u128 {
    d.as_millis()
}

#[test]
fn k8s_node_agent_over_the_cni_reference_plugins() {
    run_in_a_lab(
        "k8s-node-cni",
        NAME,
        || NodeLab::build_with_plugins(&NodeLab::test_prefix()).expect("build the worker-node lab's CNI variant"),
        NodeLab::control,
        scenario,
    );
}

// ------------------------------------------------------------ servers ---

/// A TCP server in a pod on [`CONTAINER_PORT`] (both families) that answers
/// any request with `saw <peer> <first line>` over HTTP, as the external
/// server does (`client::http` reads it). Dropping it stops it.
struct Whoami {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Whoami {
    fn start(ns: &NetNs, port: u16) -> Whoami {
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        for any in [IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V6(Ipv6Addr::UNSPECIFIED)] {
            let addr = SocketAddr::new(any, port);
            let l: TcpListener = ns
                .run_in(|| {
                    let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)).unwrap();
                    if any.is_ipv6() {
                        s.set_only_v6(true).unwrap();
                    }
                    s.set_reuse_address(true).unwrap();
                    s.bind(&addr.into()).unwrap_or_else(|e| panic!("bind {addr} in {}: {e}", ns.name()));
                    s.listen(128).unwrap();
                    // SO_RCVTIMEO bounds accept(), so the loop sees `stop`.
                    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                    TcpListener::from(s)
                })
                .expect("enter the pod's namespace");
            let stop = stop.clone();
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok((c, peer)) = l.accept() {
                        answer(c, peer);
                    }
                }
            }));
        }
        Whoami { stop, threads }
    }
}

fn answer(mut c: TcpStream, peer: SocketAddr) {
    let _ = c.set_read_timeout(Some(Duration::from_secs(5)));
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => req.extend_from_slice(&buf[..n]),
        }
    }
    let first = String::from_utf8_lossy(&req).lines().next().unwrap_or_default().to_string();
    let _ = c.write_all(format!("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nsaw {peer} {first}\n").as_bytes());
}

impl Drop for Whoami {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ----------------------------------------------------------- the paths ---

/// What a request from `from` to `to` was seen as by the server there,
/// retried for up to 15 s (neighbour discovery, a busy machine); an error
/// says what the last try saw.
fn seen_by(from: &NetNs, to: SocketAddr, path: &str) -> Result<client::Reply, String> {
    let t = Instant::now();
    loop {
        match client::http(from, to, path, 0) {
            Ok(r) => return Ok(r),
            Err(e) if t.elapsed() > Duration::from_secs(15) => return Err(format!("{} -> {to}: {e}", from.name())),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// The source address `from` was seen with at `to`.
fn source(from: &NetNs, to: SocketAddr, path: &str) -> IpAddr {
    seen_by(from, to, path).unwrap_or_else(|e| panic!("{e}")).seen.ip()
}

/// Every path measured, by name: the address the other end saw (for the
/// `hostPort` from outside: `client` when the pod saw the client's own
/// address).
fn paths(lab: &NodeLab, w: Worker) -> Vec<(String, String)> {
    let sel = lab.attachment("w1-sel").unwrap().result.clone();
    let uns = lab.attachment("w1-uns").unwrap().result.clone();
    let http4 = NodeLab::http();
    let http6 = NodeLab::http6();
    let node4 = SocketAddr::new(w.lan_addr().into(), HOST_PORT);
    let node6 = SocketAddr::new(w.lan_addr6().into(), HOST_PORT);
    let mut out = Vec::new();
    let mut put = |name: &str, v: String| out.push((name.to_string(), v));
    for pod in ["w1-sel", "w1-uns"] {
        put(&format!("{pod} -> server (v4)"), source(lab.pod(pod), http4, "/out").to_string());
        put(&format!("{pod} -> server (v6)"), source(lab.pod(pod), http6, "/out").to_string());
    }
    for (fam, to) in [("v4", node4), ("v6", node6)] {
        let r = seen_by(lab.server_ns(), to, "/hostport").unwrap_or_else(|e| panic!("hostPort from outside: {e}"));
        let v = if r.seen.ip() == r.local.ip() { "client".to_string() } else { r.seen.ip().to_string() };
        put(&format!("server -> node:{HOST_PORT} ({fam})"), v);
        for pod in ["w1-sel", "w1-uns"] {
            put(&format!("{pod} -> node:{HOST_PORT} ({fam})"), source(lab.pod(pod), to, "/hairpin").to_string());
        }
    }
    let uns4 = SocketAddr::new(uns.ipv4().unwrap().into(), CONTAINER_PORT);
    let uns6 = SocketAddr::new(uns.ipv6().unwrap().into(), CONTAINER_PORT);
    let seen4 = source(lab.pod("w1-sel"), uns4, "/pod");
    let seen6 = source(lab.pod("w1-sel"), uns6, "/pod");
    let own = |a: IpAddr| if sel.addresses().contains(&a) { "its own address".to_string() } else { a.to_string() };
    put("w1-sel -> w1-uns (v4)", own(seen4));
    put("w1-sel -> w1-uns (v6)", own(seen6));
    out
}

/// The paths of `after` that differ from `before` other than `w1-sel`'s
/// own way out (the egress IPs), each described.
fn changed(before: &[(String, String)], after: &[(String, String)]) -> Vec<String> {
    let mut differ = Vec::new();
    for ((name, b), (_, a)) in before.iter().zip(after) {
        let want = match name.as_str() {
            "w1-sel -> server (v4)" => EIP.to_string(),
            "w1-sel -> server (v6)" => EIP6.to_string(),
            _ => b.clone(),
        };
        if *a != want {
            differ.push(format!("{name}: {a} (expected {want}; before the agent {b})"));
        }
    }
    differ
}

// -------------------------------------------------------- the node ---

/// The packet mark the agent's nftables table sets on a steered pod's
/// packets (`meta mark set meta mark | M`), or `none`.
fn steering_mark(lab: &NodeLab, w: Worker) -> String {
    lab.node_table(w)
        .split("meta mark | ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|m| u32::from_str_radix(m.trim_start_matches("0x"), 16).ok())
        .map_or_else(|| "none".into(), |m| format!("{m:#x}"))
}

/// `iptables-save` (or `ip6tables-save`) in `ns` without comments and
/// counters: the rules, to compare.
fn rules(ns: &NetNs, program: &str) -> String {
    let text = match program {
        "ip6tables-save" => ns.exec(&["ip6tables-save"]),
        _ => ns.exec(&["iptables-save"]),
    }
    .expect("iptables-save");
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .map(|l| match l.strip_prefix(':') {
            // ":CHAIN POLICY [packets:bytes]" loses its counters.
            Some(_) => l.rsplit_once(" [").map_or(l, |(head, _)| head).to_string(),
            None => l.to_string(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Packets matched by the rules of chain `chain` that contain `what`
/// (`iptables-save -c` of the nat table).
fn nat_packets(ns: &NetNs, v6: bool, chain: &str, what: &str) -> u64 {
    let text = if v6 {
        ns.exec(&["ip6tables-save", "-c", "-t", "nat"])
    } else {
        ns.exec(&["iptables-save", "-c", "-t", "nat"])
    }
    .expect("iptables-save -c");
    text.lines()
        .filter(|l| l.contains(&format!("-A {chain} ")) && l.contains(what))
        .filter_map(|l| l.strip_prefix('[')?.split(':').next()?.parse::<u64>().ok())
        .sum()
}

/// The chain the bridge plugin made for `pod` (`-A POSTROUTING -s <pod> ... -j CNI-...`).
fn pod_chain(nat: &str, pod: IpAddr) -> Option<String> {
    let len = if pod.is_ipv4() { 32 } else { 128 };
    nat.lines()
        .find(|l| l.starts_with("-A POSTROUTING") && l.contains(&format!("-s {pod}/{len} ")))?
        .split("-j ")
        .nth(1)
        .map(|c| c.trim().to_string())
}

/// What ADD makes on the node and the pod, to compare before and after:
/// both families' iptables rules, the node's links, host-local's
/// allocations.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    rules4: String,
    rules6: String,
    links: BTreeSet<String>,
    allocations: BTreeSet<String>,
}

fn snapshot(lab: &NodeLab, node: &NetNs) -> Snapshot {
    let links = node
        .ip(&["-o", "link", "show"])
        .unwrap()
        .lines()
        .filter_map(|l| l.split(':').nth(1).map(|n| n.trim().split('@').next().unwrap_or_default().to_string()))
        .collect();
    let dir = lab.dir().join("cni").join("networks").join(CNI_NETWORK);
    let allocations = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok()?.file_name().into_string().ok()).filter(|n| n.parse::<IpAddr>().is_ok()).collect()
        })
        .unwrap_or_default();
    Snapshot { rules4: rules(node, "iptables-save"), rules6: rules(node, "ip6tables-save"), links, allocations }
}

/// The MAC address of `dev` in `ns`.
fn mac_of(ns: &NetNs, dev: &str) -> [u8; 6] {
    let text = ns.exec(&["cat", &format!("/sys/class/net/{dev}/address")]).expect("read a MAC address");
    let b: Vec<u8> = text.trim().split(':').map(|h| u8::from_str_radix(h, 16).unwrap()).collect();
    b.try_into().unwrap()
}

/// The TCP source port of an untagged IPv4 or IPv6 (no extension header) frame.
fn tcp_sport(f: &[u8]) -> Option<u16> {
    let ethertype = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    let l4 = match ethertype {
        0x0800 if *f.get(23)? == 6 => 14 + usize::from(f[14] & 0x0f) * 4,
        0x86dd if *f.get(20)? == 6 => 14 + 40,
        _ => return None,
    };
    Some(u16::from_be_bytes([*f.get(l4)?, *f.get(l4 + 1)?]))
}

/// The frames that arrived at the upstream router from `src` (an address of
/// the node) with TCP source port `port`, by Ethernet sender.
fn replies_by_sender(frames: &[Frame], src: &[IpAddr], port: u16) -> Vec<[u8; 6]> {
    frames
        .iter()
        .filter_map(|f| {
            let ip = capture::ip_info(&f.data)?;
            (src.contains(&ip.src) && ip.proto == 6 && tcp_sport(&f.data) == Some(port)).then_some(ip.eth_src)
        })
        .collect()
}

/// CNI CHECK of pod `name`. portmap 1.1.1 (Debian bookworm's) fails CHECK
/// for a dual-stack pod with a `hostPort`: it looks for the pod's IPv4 DNAT
/// rules in the IPv6 table ("could not check ipv6 dnat"); that failure is
/// printed, any other fails the test.
fn check(list: &cni::NetworkList, node: &NetNs, name: &str, att: &Attachment) {
    let ports = att.rt.capability_args.contains_key("portMappings");
    match list.check(node, &att.rt) {
        Ok(()) => println!("k8s-node-cni: CNI CHECK {name}: passes"),
        Err(e) if ports && e.to_string().contains("could not check ipv6 dnat") => {
            println!("k8s-node-cni: CNI CHECK {name}: portmap's known dual-stack failure: {e}")
        }
        Err(e) => panic!("CNI CHECK {name}: {e}"),
    }
}

// ---------------------------------------------------------- the cluster ---

/// The pod's Pod object, as the kubelet leaves it: scheduled to `node`, its
/// container's ports (with the `hostPort`), its IPs from the ADD result.
async fn cni_pod(client: &kube::Client, name: &str, app: &str, node: &str, att: &Attachment, host_port: Option<u16>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), POD_NAMESPACE);
    let mut container = json!({"name": "app", "image": "example.invalid/app:1"});
    if let Some(hp) = host_port {
        container["ports"] = json!([{"containerPort": CONTAINER_PORT, "hostPort": hp, "protocol": "TCP"}]);
    }
    let p: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [container]}
    }))
    .unwrap();
    api.create(&PostParams::default(), &p).await.expect("create pod");
    let ips: Vec<serde_json::Value> = att.result.addresses().iter().map(|a| json!({"ip": a.to_string()})).collect();
    let status = json!({"status": {"phase": "Running", "podIP": ips[0]["ip"], "podIPs": ips}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("patch pod status");
}

/// CRDs, the deployed namespace and RBAC (gateway and node), the Nodes
/// (`w1` with both pod CIDRs), `w1`'s pods, the EgressPolicy `db`.
async fn setup_cluster(client: &kube::Client, lab: &NodeLab, w: Worker) {
    install_egret_with_node_rbac(client).await;
    namespace(client, POD_NAMESPACE, json!({"team": "a"})).await;
    for g in NodeGw::ALL {
        node(client, g.node_name(), json!({"egret.dev/gateway": "true"})).await;
    }
    let n = serde_json::from_value(json!({
        "metadata": {"name": w.node_name()},
        "spec": {"podCIDR": w.pod_cidr(), "podCIDRs": [w.pod_cidr(), w.pod_cidr6()]}
    }))
    .unwrap();
    Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .create(&PostParams::default(), &n)
        .await
        .expect("worker node");
    cni_pod(client, "w1-sel", "db", w.node_name(), lab.attachment("w1-sel").unwrap(), Some(HOST_PORT)).await;
    cni_pod(client, "w1-uns", "other", w.node_name(), lab.attachment("w1-uns").unwrap(), None).await;
    db_policy_dual_stack(client, EIP, EIP6).await;
}

// ----------------------------------------------------------- scenario ---

fn scenario(lab: &NodeLab, server: &ApiServer) {
    let (w, list) = lab.plugins().expect("the lab's CNI variant");
    let node = lab.worker(w);
    let sel = lab.attachment("w1-sel").unwrap().clone();
    let uns = lab.attachment("w1-uns").unwrap().clone();
    let (sel4, sel6) = (sel.result.ipv4().unwrap(), sel.result.ipv6().unwrap());
    println!(
        "k8s-node-cni: CNI ADD (bridge, host-local, portmap): w1-sel {sel4} {sel6} in {} ms, w1-uns {} {} in {} ms",
        ms(sel.took),
        uns.result.ipv4().unwrap(),
        uns.result.ipv6().unwrap(),
        ms(uns.took)
    );
    let capture = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");

    // 1. The plugins' own rules, nothing hand-written; CHECK passes.
    let (nat4, nat6) = (rules(node, "iptables-save"), rules(node, "ip6tables-save"));
    for (nat, a) in [(&nat4, IpAddr::V4(sel4)), (&nat6, IpAddr::V6(sel6))] {
        let chain = pod_chain(nat, a).unwrap_or_else(|| panic!("the bridge plugin's chain for {a}:\n{nat}"));
        assert!(chain.starts_with("CNI-"), "{chain}");
        assert!(nat.contains(&format!("-A {chain} ")) && nat.contains("-j MASQUERADE"), "{nat}");
    }
    for a in uns.result.addresses() {
        assert!(pod_chain(if a.is_ipv4() { &nat4 } else { &nat6 }, a).is_some(), "w1-uns's chain for {a}");
    }
    assert!(nat4.contains(&format!("--dport {HOST_PORT} -j DNAT --to-destination {sel4}:{CONTAINER_PORT}")), "{nat4}");
    assert!(
        nat6.contains(&format!("--dport {HOST_PORT} -j DNAT --to-destination [{sel6}]:{CONTAINER_PORT}")),
        "{nat6}"
    );
    let portmap_mark = nat4
        .lines()
        .find(|l| l.starts_with("-A CNI-HOSTPORT-MASQ") && l.contains("-j MASQUERADE"))
        .and_then(|l| l.split("--mark ").nth(1)?.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| panic!("portmap's masquerade of marked packets:\n{nat4}"));
    for hand_written in ["FLANNEL-POSTRTG", "IP-MASQ-AGENT", "cali-nat-outgoing"] {
        assert!(!nat4.contains(hand_written), "no hand-written rule on {}: {hand_written}", w.node_name());
    }
    let bridge = node.ip(&["-o", "addr", "show", "dev", CNI_BRIDGE]).expect("the bridge plugin's bridge");
    assert!(bridge.contains(&format!("{}/24", w.pod_gateway())), "{bridge}");
    for (name, att) in [("w1-sel", &sel), ("w1-uns", &uns)] {
        check(list, node, name, att);
    }
    println!(
        "k8s-node-cni: the plugins' rules on {}: a CNI-<id> chain with MASQUERADE per pod and family, \
         CNI-HOSTPORT-DNAT {HOST_PORT} -> {sel4}:{CONTAINER_PORT}, portmap's masquerade mark {portmap_mark}",
        w.node_name()
    );

    // 2. The paths before the agent.
    let _sel_server = Whoami::start(lab.pod("w1-sel"), CONTAINER_PORT);
    let _uns_server = Whoami::start(lab.pod("w1-uns"), CONTAINER_PORT);
    let before = paths(lab, w);
    for (name, seen) in &before {
        println!("k8s-node-cni: before the agent: {name}: {seen}");
    }
    let expect = |name: &str, want: String| {
        let got = &before.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(got, &want, "before the agent, {name}");
    };
    expect("w1-sel -> server (v4)", w.lan_addr().to_string());
    expect("w1-sel -> server (v6)", w.lan_addr6().to_string());
    expect(&format!("server -> node:{HOST_PORT} (v4)"), "client".into());
    expect(&format!("w1-sel -> node:{HOST_PORT} (v4)"), w.pod_gateway().to_string());
    expect("w1-sel -> w1-uns (v4)", "its own address".into());

    // 3. The cluster, the gateways, the agent.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    rt.block_on(setup_cluster(&client, lab, w));
    let (gw_kc, node_kc) = rt.block_on(egret_kubeconfigs(&client, server.kubeconfig_path(), lab.dir()));
    let gws = start_node_lab_gateways(lab, &gw_kc);
    let agent = start_synced_agent(lab, w, &node_kc, &[]);
    let agent_started = capture.caught_up(Duration::from_secs(10)).expect("the capture catches up").len();
    let took = probe::wait_source(lab.pod("w1-sel"), NodeLab::http(), EIP.into(), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("w1-sel: {e}"))
        .1;
    println!("k8s-node-cni: w1-sel leaves as {EIP} {} ms after the agent synced", ms(took));
    assert_eq!(lab.steered_pods(w).unwrap(), vec![sel4], "the agent steers w1-sel alone");
    let steer_mark = steering_mark(lab, w);

    // The plugin's masquerade of w1-sel matches none of its steered connections.
    let chain4 = pod_chain(&nat4, sel4.into()).unwrap();
    let masq0 = nat_packets(node, false, &chain4, "-j MASQUERADE");
    for i in 0..5 {
        assert_eq!(source(lab.pod("w1-sel"), NodeLab::http(), &format!("/steered/{i}")), IpAddr::V4(EIP));
    }
    let masq1 = nat_packets(node, false, &chain4, "-j MASQUERADE");
    println!(
        "k8s-node-cni: the bridge plugin's MASQUERADE for w1-sel ({chain4}): {masq0} packets before the agent, \
         +{} over 5 steered connections",
        masq1 - masq0
    );
    assert!(masq0 > 0, "the counter counts: w1-sel's connections before the agent were masqueraded there");
    assert_eq!(masq1, masq0, "the bridge plugin's MASQUERADE for {sel4} fired for steered connections");

    // Every path as before, but w1-sel's own way out.
    let after = paths(lab, w);
    for (name, a) in &after {
        println!("k8s-node-cni: with the agent: {name}: {a}");
    }
    let differ = changed(&before, &after);

    // The hostPort's replies left w1 for the upstream router, not a gateway.
    let frames = capture.caught_up(Duration::from_secs(10)).expect("the capture catches up");
    let node_mac = mac_of(node, "lan0");
    let senders = replies_by_sender(&frames[agent_started..], &[w.lan_addr().into(), w.lan_addr6().into()], HOST_PORT);
    let via_gateway = senders.iter().filter(|m| NodeGw::ALL.iter().any(|g| g.mac() == **m)).count();
    let direct = senders.iter().filter(|m| **m == node_mac).count();
    println!(
        "k8s-node-cni: hostPort replies at the upstream router with the agent: {direct} frames from {} directly, \
         {via_gateway} through a gateway",
        w.node_name()
    );
    let replies_direct = direct > 0 && via_gateway == 0;
    assert_eq!(rules(node, "iptables-save"), nat4, "the agent changed no iptables rule (IPv4)");
    assert_eq!(rules(node, "ip6tables-save"), nat6, "the agent changed no iptables rule (IPv6)");

    // 4. A pod added and deleted under the agent.
    let sandbox_name = lab.pod("w1-sel").name().replace("w1-sel", TMP);
    let sandbox = NetNs::create(&sandbox_name).expect("the new pod's namespace");
    for key in ["net.ipv6.conf.all.accept_dad", "net.ipv6.conf.default.accept_dad"] {
        sandbox.sysctl(key, "0").unwrap();
    }
    let empty = snapshot(lab, node);
    let rt_tmp = RuntimeConf::for_pod(POD_NAMESPACE, TMP, &sandbox, &[PortMapping::tcp(TMP_HOST_PORT, CONTAINER_PORT)]);
    let tmp = list.add(node, &rt_tmp).expect("CNI ADD of the new pod");
    check(list, node, TMP, &tmp);
    let tmp4 = tmp.result.ipv4().unwrap();
    let added = snapshot(lab, node);
    assert!(added.allocations.contains(&tmp4.to_string()), "host-local recorded {tmp4}: {added:?}");
    assert!(added.rules4.contains(&format!("--dport {TMP_HOST_PORT} -j DNAT")), "{}", added.rules4);
    let _tmp_server = Whoami::start(&sandbox, CONTAINER_PORT);
    let written = Instant::now();
    rt.block_on(cni_pod(&client, TMP, "db", w.node_name(), &tmp, Some(TMP_HOST_PORT)));
    // Until the agent has its rule, the pod is masqueraded as its node; then
    // it leaves as the egress IP, never as itself. A connection whose one
    // SYN (the probe waits 900 ms, below the first retransmission) is lost
    // while the switch happens fails without leaking: the agent may steer
    // the pod before its gateway's tables name it (a separate watch), and
    // the gateway drops what it does not translate. Counted, not fatal; a
    // client's retransmission gets through.
    let mut lost = Vec::new();
    loop {
        match probe::once(&sandbox, NodeLab::http()).unwrap() {
            Ok(a) if a.ip() == IpAddr::V4(EIP) => break,
            Ok(a) => assert_eq!(a.ip(), IpAddr::V4(w.lan_addr()), "{TMP} before the agent's rule"),
            Err(e) => lost.push(format!("+{} ms: {e}", ms(written.elapsed()))),
        }
        assert!(written.elapsed() < Duration::from_secs(30), "{TMP} never left as {EIP}; failed attempts: {lost:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "k8s-node-cni: {TMP} ({tmp4}, ADD in {} ms) leaves as {EIP} {} ms after its Pod object was written; \
         {} attempts failed on the way: {lost:?}",
        ms(tmp.took),
        ms(written.elapsed()),
        lost.len()
    );
    let r = seen_by(lab.server_ns(), SocketAddr::new(w.lan_addr().into(), TMP_HOST_PORT), "/tmp").unwrap();
    assert_eq!(r.seen.ip(), r.local.ip(), "{TMP}'s hostPort from outside");
    let del_took = list.del(node, &rt_tmp).expect("CNI DEL");
    let deleted = snapshot(lab, node);
    assert_eq!(deleted, empty, "DEL removes what ADD made");
    let left = sandbox.ip(&["-o", "link", "show"]).unwrap();
    assert_eq!(left.lines().count(), 1, "only lo is left in the pod's namespace: {left}");
    list.del(node, &rt_tmp).expect("a second DEL succeeds");
    let refused = client::tcp_connect(
        lab.server_ns(),
        SocketAddr::new(w.lan_addr().into(), TMP_HOST_PORT),
        Duration::from_secs(2),
    );
    assert!(refused.is_err(), "the deleted pod's hostPort no longer answers");
    let api: Api<Pod> = Api::namespaced(client.clone(), POD_NAMESPACE);
    rt.block_on(api.delete(TMP, &DeleteParams::default().grace_period(0))).expect("delete the Pod object");
    let deadline = Instant::now() + Duration::from_secs(30);
    while lab.steered_pods(w).unwrap() != vec![sel4] {
        assert!(Instant::now() < deadline, "the agent drops the deleted pod's rule: {:?}", lab.steered_pods(w));
        std::thread::sleep(Duration::from_millis(50));
    }
    println!(
        "k8s-node-cni: {TMP}: DEL in {} ms removed its rules (both families), veth, eth0 and allocation; a second DEL succeeded",
        ms(del_took)
    );
    drop(sandbox);

    drop(agent);
    for mut gw in gws.into_values() {
        let _ = gw.kill();
    }
    let frames = capture.stop().expect("stop the capture");
    assert_no_pod_address_left(lab, &frames);

    // What depends on the agent's packet mark, last, so everything else ran.
    assert!(
        replies_direct,
        "of the hostPort's reply frames at the upstream router, {direct} came from {} and {via_gateway} through \
         a gateway: replies to connections that reached the pod from outside were steered (the agent's \
         steering mark: {steer_mark})",
        w.node_name()
    );
    assert!(
        differ.is_empty(),
        "with the agent (its steering mark {steer_mark}; portmap's masquerade mark {portmap_mark}), paths \
         changed:\n{}",
        differ.join("\n")
    );
}
