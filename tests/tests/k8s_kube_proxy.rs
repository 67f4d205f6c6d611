//! The Service-VIP mode with the real kube-proxy (issue 27, part 2), in the
//! worker-node lab (`egret_tests::nodelab`, docs/lab.md): kube-proxy 1.20.2
//! in iptables mode (`egret_tests::kubeproxy`) runs in both gateways and
//! both workers against the lab's API server, as a cluster runs it; the
//! gateways run `egret gateway`, the workers `egret node`, as in
//! `k8s_node.rs`.
//!
//! The cluster: LoadBalancer Service `team-a/web` annotated
//! `egret.dev/egress: "true"`, ingress IP [`VIP`] (an address of the
//! segment: the gateways' and nodes' next hop for it is itself), TCP port
//! [`TCP_PORT`], selecting the pod `w1-sel` on `w1` (198.18.1.10, label
//! `app=web`), whose outbound traffic therefore leaves with the VIP. A
//! LoadBalancer Service cannot mix protocols in 1.20 (the
//! `MixedProtocolLBService` gate is alpha and off), so UDP port
//! [`UDP_PORT`] is a second LoadBalancer Service `web-udp` sharing the VIP,
//! not annotated, as MetalLB users share one address between a TCP and a UDP
//! Service (`allow-shared-ip`); the gateway passes every port of a Service
//! VIP outside its NAT range to its kernel, so kube-proxy serves both. The
//! test writes both Services' EndpointSlices as the endpoint-slice
//! controller would (no controller-manager runs; the module doc of
//! `egret_tests::kubeproxy` says exactly what is written and why). The pod
//! runs a TCP server (HTTP and line echo, answering with the source it saw)
//! and a UDP echo.
//!
//! Scenarios, IPv4 (kube-proxy 1.20 serves IPv6 Services only single-stack
//! or with the alpha `IPv6DualStack` gate on the API server, kube-proxy and
//! the controller-manager; the lab's API server has one IPv4 Service range,
//! so IPv6 is not run):
//!
//! 1. an outside client (in `srv`, from [`CLIENT`]) connects to VIP:port
//!    (`externalTrafficPolicy: Cluster`), TCP and UDP: it gets its answers,
//!    from the VIP; at the same time the pod's own new connections to the
//!    server leave with the VIP (two streams of new connections, 100 ms
//!    apart each);
//! 2. NodePort from outside to each worker's segment address (w1 has the
//!    endpoint, w2 forwards to it), TCP and UDP;
//! 3. the ClusterIP from each worker's host network, TCP and UDP;
//! 4. a connection from the API server's address (192.0.2.1, `control`) to
//!    the pod, as a webhook call would be;
//! 5. SIGKILL of the VIP's gateway during an inbound and an outbound TCP
//!    connection, an inbound and an outbound UDP flow and two streams of new
//!    connections: what survives, measured;
//! 6. `externalTrafficPolicy: Local`: the VIP's traffic reaches only the
//!    gateway holding it (Egret is the VIP's only announcer), whose
//!    kube-proxy has no local endpoint (selected pods do not run on gateway
//!    Nodes), so it marks it for drop (`KUBE-MARK-DROP`); the kubelet's
//!    `KUBE-FIREWALL` drops marked packets in `INPUT` and `OUTPUT` only, so
//!    the gateway's kernel routes it towards the VIP itself, which nobody
//!    answers ARP for to its holder: the client gets no answer (the ARP
//!    requests are counted). The health check node port says why (503 on
//!    the gateways and `w2`, 200 on `w1`: a load balancer would send to `w1`
//!    only, which Egret's announcement of the VIP rules out), and the pod's
//!    own outbound traffic still leaves with the VIP;
//! 7. throughout, captures on the upstream router's link and on both
//!    gateways' bridge ports: no frame with a pod address leaves, no node or
//!    gateway address is the source where the VIP is expected (only a
//!    NodePort's or health check's answers come from a node), every frame
//!    from the VIP to the outside is either a Service port's answer or a
//!    translated outbound connection to the server, and no gateway sends a
//!    frame from the VIP into the cluster (a reply Egret translated).
//!
//! Each check is recorded and printed (`k8s-kube-proxy: ok|FAIL ...`); the
//! test fails at the end with every failed check, so one run shows all of
//! them. Measured figures are printed on lines starting `k8s-kube-proxy:`.
//! Skipped (with a message) when not root, or the API server or kube-proxy is
//! not built; `EGRET_REQUIRE_APISERVER=1` makes that a failure.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture, Frame};
use egret_tests::client::{parse_saw, TcpSession};
use egret_tests::gateway::Gateway;
use egret_tests::kubeproxy::{self, KubeProxy, KubeProxyConfig};
use egret_tests::netns::NetNs;
use egret_tests::nodelab::{Agent, NodeGw, NodeLab, Worker, CLUSTER_POD_CIDR};
use egret_tests::plan;
use egret_tests::probe::{Attempt, Prober};
use k8s_common::*;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use serde_json::json;
use socket2::{Domain, Protocol, Socket, Type};

const NAME: &str = "k8s_kube_proxy_service_vip_serves_inbound_and_outbound";
const TAG: &str = "k8s-kube-proxy";
/// The Service's VIP: its `status.loadBalancer.ingress` IP and the pod's egress IP.
const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// The Services' ports (below the gateways' NAT range, 32768-60999).
const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 8081;
/// The outside client's address (a second address of the `srv` namespace;
/// the server itself answers on 198.51.100.7).
const CLIENT: Ipv4Addr = plan::STRANGER;
/// The namespace of the lab's workloads.
const NS: &str = "team-a";
/// The selected pod.
const POD: &str = "w1-sel";

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

#[test]
fn k8s_kube_proxy_service_vip_serves_inbound_and_outbound() {
    match kubeproxy::available_or_skip(NAME) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    run_in_a_lab(
        TAG,
        NAME,
        || NodeLab::build(&NodeLab::test_prefix()).expect("build the worker-node lab"),
        NodeLab::control,
        scenario,
    );
}

// ------------------------------------------------------------- checks ---

/// Every check's outcome, printed as it is made; [`Checks::finish`] fails
/// the test with all the failed ones.
#[derive(Default)]
struct Checks {
    failed: Vec<String>,
    passed: usize,
}

impl Checks {
    fn check(&mut self, ok: bool, what: impl AsRef<str>) -> bool {
        if ok {
            self.passed += 1;
            println!("{TAG}: ok   {}", what.as_ref());
        } else {
            println!("{TAG}: FAIL {}", what.as_ref());
            self.failed.push(what.as_ref().to_string());
        }
        ok
    }

    fn finish(self) {
        println!("{TAG}: {} checks passed, {} failed", self.passed, self.failed.len());
        assert!(self.failed.is_empty(), "{} checks failed:\n  {}", self.failed.len(), self.failed.join("\n  "));
    }
}

// --------------------------------------------------- the pod's servers ---

/// The selected pod's servers, in its namespace: TCP [`TCP_PORT`] (a first
/// line `GET ...` gets one HTTP answer `saw <source> GET <path>` and the
/// connection closes, as the lab's server answers the probers; any other
/// line gets `saw <source> <line>` and the connection stays open) and UDP
/// [`UDP_PORT`] (`saw <source> <payload>`). Every source it saw is kept.
struct PodServer {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<SocketAddr>>>,
    threads: Vec<JoinHandle<()>>,
}

impl PodServer {
    fn start(ns: &NetNs) -> PodServer {
        let (tcp, udp) = ns
            .run_in(|| {
                let s = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP)).unwrap();
                s.set_reuse_address(true).unwrap();
                s.bind(&SocketAddr::from(([0, 0, 0, 0], TCP_PORT)).into()).unwrap();
                s.listen(128).unwrap();
                s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                let u = UdpSocket::bind(("0.0.0.0", UDP_PORT)).unwrap();
                u.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
                (TcpListener::from(s), u)
            })
            .expect("the pod's sockets");
        let stop = Arc::new(AtomicBool::new(false));
        let seen: Arc<Mutex<Vec<SocketAddr>>> = Arc::default();
        let mut threads = Vec::new();
        {
            let (stop, seen) = (stop.clone(), seen.clone());
            threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Ok((conn, peer)) = tcp.accept() else { continue };
                    seen.lock().unwrap().push(peer);
                    let stop = stop.clone();
                    std::thread::spawn(move || serve_tcp(conn, peer, &stop));
                }
            }));
        }
        {
            let (stop, seen) = (stop.clone(), seen.clone());
            threads.push(std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::Relaxed) {
                    let Ok((n, from)) = udp.recv_from(&mut buf) else { continue };
                    seen.lock().unwrap().push(from);
                    let reply = format!("saw {from} {}", String::from_utf8_lossy(&buf[..n]));
                    let _ = udp.send_to(reply.as_bytes(), from);
                }
            }));
        }
        PodServer { stop, seen, threads }
    }

    /// The sources seen so far.
    fn seen(&self) -> Vec<SocketAddr> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn serve_tcp(mut conn: TcpStream, peer: SocketAddr, stop: &AtomicBool) {
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let mut pending = Vec::new();
    let mut chunk = [0u8; 4096];
    let idle = Instant::now();
    while !stop.load(Ordering::Relaxed) && idle.elapsed() < Duration::from_secs(600) {
        match conn.read(&mut chunk) {
            Ok(0) => return,
            Ok(n) => pending.extend_from_slice(&chunk[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(_) => return,
        }
        if pending.starts_with(b"GET ") {
            let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
            let head = String::from_utf8_lossy(&pending[..end]).into_owned();
            let path = head.split_whitespace().nth(1).unwrap_or("?").to_string();
            let body = format!("saw {peer} GET {path}\n");
            let reply = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(reply.as_bytes());
            let _ = conn.shutdown(std::net::Shutdown::Write);
            return;
        }
        while let Some(i) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line[..i]).trim_end_matches('\r').to_string();
            if conn.write_all(format!("saw {peer} {line}\n").as_bytes()).is_err() {
                return;
            }
        }
    }
}

// ------------------------------------------------------------ clients ---

/// A TCP connection from `src` in `ns` to `to`.
fn tcp_from(ns: &NetNs, src: IpAddr, to: SocketAddr, timeout: Duration) -> Result<TcpStream, String> {
    let s = ns
        .run_in(|| -> std::io::Result<TcpStream> {
            let s = Socket::new(Domain::for_address(to), Type::STREAM, Some(Protocol::TCP))?;
            s.bind(&SocketAddr::new(src, 0).into())?;
            s.connect_timeout(&to.into(), timeout)?;
            Ok(TcpStream::from(s))
        })
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("connect {src} -> {to}: {e}"))?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
    Ok(s)
}

/// One HTTP request from `src` in `ns` to `to`: the source the pod saw.
fn http_from(ns: &NetNs, src: IpAddr, to: SocketAddr) -> Result<SocketAddr, String> {
    let mut s = tcp_from(ns, src, to, Duration::from_secs(3))?;
    s.write_all(format!("GET /k8s-kube-proxy HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("send to {to}: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| format!("read from {to}: {e}"))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    parse_saw(body).map(|(seen, _)| seen).ok_or_else(|| format!("unexpected answer from {to}: {text:?}"))
}

/// [`http_from`] retried every 200 ms for up to `within` (a kube-proxy rule
/// or a neighbour entry may still be on its way).
fn http_until(ns: &NetNs, src: IpAddr, to: SocketAddr, within: Duration) -> Result<SocketAddr, String> {
    let t = Instant::now();
    loop {
        match http_from(ns, src, to) {
            Ok(s) => return Ok(s),
            Err(e) if t.elapsed() >= within => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

/// A UDP socket in `ns` on `src:port` (0: any), not connected: answers are
/// read with their source.
fn udp_from(ns: &NetNs, src: IpAddr, port: u16) -> UdpSocket {
    ns.run_in(|| UdpSocket::bind(SocketAddr::new(src, port))).expect("enter the namespace").expect("bind UDP")
}

/// Sends `token` to `to` up to `tries` times, `wait` apart, until an answer
/// carrying it comes: (the answer's source address, the source the pod saw).
fn udp_ask(
    s: &UdpSocket,
    to: SocketAddr,
    token: &str,
    tries: u32,
    wait: Duration,
) -> Result<(SocketAddr, SocketAddr), String> {
    let mut buf = [0u8; 2048];
    for _ in 0..tries {
        s.send_to(token.as_bytes(), to).map_err(|e| format!("send to {to}: {e}"))?;
        let deadline = Instant::now() + wait;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            s.set_read_timeout(Some(left.max(Duration::from_millis(1)))).map_err(|e| e.to_string())?;
            match s.recv_from(&mut buf) {
                Ok((n, from)) => {
                    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
                    if let Some((seen, rest)) = parse_saw(&text) {
                        if rest == token {
                            return Ok((from, seen));
                        }
                    }
                }
                Err(_) => break,
            }
        }
    }
    Err(format!("no answer from {to} to {token:?} after {tries} tries"))
}

/// An outside UDP exchange from [`CLIENT`] to `to`: the answer must come
/// from `to` itself.
fn udp_outside(srv: &NetNs, to: SocketAddr, token: &str) -> Result<(SocketAddr, SocketAddr), String> {
    let s = udp_from(srv, IpAddr::V4(CLIENT), 0);
    udp_ask(&s, to, token, 5, Duration::from_millis(600))
}

/// A long-lived line-echo connection (the pod's or the server's).
struct Lines {
    stream: TcpStream,
    pending: Vec<u8>,
}

impl Lines {
    fn new(stream: TcpStream) -> Lines {
        Lines { stream, pending: Vec::new() }
    }

    /// Sends a line; the source the other end saw, or what went wrong.
    fn line(&mut self, text: &str) -> Result<SocketAddr, String> {
        self.stream.write_all(format!("{text}\n").as_bytes()).map_err(|e| format!("send: {e}"))?;
        let mut chunk = [0u8; 1024];
        loop {
            if let Some(i) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=i).collect();
                let line = String::from_utf8_lossy(&line).into_owned();
                return parse_saw(&line).map(|(s, _)| s).ok_or_else(|| format!("unexpected {line:?}"));
            }
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err("connection closed".into()),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(format!("read: {e}")),
            }
        }
    }
}

/// One datagram of a [`UdpFlow`]: when it was sent, and its answer's source
/// with the source the far end saw.
type Sent = (Instant, Option<(SocketAddr, SocketAddr)>);

/// A UDP flow: one socket, one datagram every 100 ms, each answer recorded.
struct UdpFlow {
    stop: Arc<AtomicBool>,
    log: Arc<Mutex<Vec<Sent>>>,
    thread: Option<JoinHandle<()>>,
}

impl UdpFlow {
    fn start(ns: &NetNs, src: IpAddr, port: u16, to: SocketAddr, name: &'static str) -> UdpFlow {
        let s = udp_from(ns, src, port);
        let stop = Arc::new(AtomicBool::new(false));
        let log: Arc<Mutex<Vec<_>>> = Arc::default();
        let (stop2, log2) = (stop.clone(), log.clone());
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop2.load(Ordering::Relaxed) {
                let t = Instant::now();
                let answer = udp_ask(&s, to, &format!("{name}-{n}"), 1, Duration::from_millis(100)).ok();
                log2.lock().unwrap().push((t, answer));
                n += 1;
                if let Some(left) = Duration::from_millis(100).checked_sub(t.elapsed()) {
                    std::thread::sleep(left);
                }
            }
        });
        UdpFlow { stop, log, thread: Some(thread) }
    }

    fn stop(mut self) -> Vec<Sent> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.log.lock().unwrap().clone()
    }
}

impl Drop for UdpFlow {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The gap around `at` in a series of (time, success): the last success
/// before it and the first success after it, relative to `at`, and how many
/// failed in between.
fn gap(series: &[(Instant, bool)], at: Instant) -> (Option<Duration>, Option<Duration>, usize) {
    let last_ok = series.iter().filter(|(t, ok)| *ok && *t < at).map(|(t, _)| at - *t).min();
    let first_fail_after = series.iter().find(|(t, ok)| !*ok && *t >= at).map(|(t, _)| *t);
    let back = match first_fail_after {
        Some(f) => series.iter().find(|(t, ok)| *ok && *t > f).map(|(t, _)| *t - at),
        None => Some(Duration::ZERO),
    };
    let lost = series.iter().filter(|(t, ok)| !*ok && *t >= at).count();
    (last_ok, back, lost)
}

fn attempts_series(a: &[Attempt]) -> Vec<(Instant, bool)> {
    a.iter().map(|a| (a.started, a.outcome.is_ok())).collect()
}

// ------------------------------------------------------------ cluster ---

/// The namespace of the lab called `role` (the worker-node lab names them
/// `<prefix>-<role>`; it hands out only some).
fn lab_ns(lab: &NodeLab, role: &str) -> NetNs {
    let prefix = lab.upstream().name().strip_suffix("-up").expect("the lab's naming");
    NetNs::existing(&format!("{prefix}-{role}")).expect("a lab namespace")
}

/// CRDs, Egret's namespace and RBAC (both manifests), the Nodes, the Pods
/// (Running and Ready, with both addresses), the two Services with the VIP.
async fn setup_cluster(client: &kube::Client) {
    for name in node_lab_cluster(client, NS, |pod| if pod == POD { "web" } else { "other" }).await {
        // Ready, as the kubelet reports a pod whose containers are up:
        // the endpoint-slice controller publishes it as ready.
        let ready = json!({"status": {"conditions": [
            {"type": "Ready", "status": "True"}, {"type": "ContainersReady", "status": "True"}
        ]}});
        Api::<k8s_openapi::api::core::v1::Pod>::namespaced(client.clone(), NS)
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&ready))
            .await
            .expect("pod ready");
    }
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    for (name, port, protocol, egress) in [("web", TCP_PORT, "TCP", true), ("web-udp", UDP_PORT, "UDP", false)] {
        let mut annotations = json!({"metallb.universe.tf/allow-shared-ip": "web"});
        if egress {
            annotations["egret.dev/egress"] = json!("true");
        }
        let s: Service = serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": annotations, "labels": {"app": "web"}},
            "spec": {
                "type": "LoadBalancer",
                "selector": {"app": "web"},
                "externalTrafficPolicy": "Cluster",
                "ports": [{"name": protocol.to_lowercase(), "port": port, "targetPort": port, "protocol": protocol}]
            }
        }))
        .unwrap();
        services.create(&PostParams::default(), &s).await.expect("create service");
        let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": VIP.to_string()}]}}});
        services.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("service status");
        let slices = kubeproxy::publish_endpoint_slices(client, NS, name).await.expect("endpoint slices");
        assert_eq!(slices.len(), 1, "one IPv4 slice for {name}: {slices:?}");
    }
}

/// A Service's ClusterIP, its port's nodePort and (Local) healthCheckNodePort.
fn service_ports(rt: &tokio::runtime::Runtime, client: &kube::Client, name: &str) -> (Ipv4Addr, u16, Option<u16>) {
    let s = rt.block_on(Api::<Service>::namespaced(client.clone(), NS).get(name)).expect("get service");
    let spec = s.spec.expect("spec");
    let ip = spec.cluster_ip.expect("clusterIP").parse().expect("an IPv4 ClusterIP");
    let np = spec.ports.expect("ports")[0].node_port.expect("nodePort") as u16;
    (ip, np, spec.health_check_node_port.map(|p| p as u16))
}

struct Ctx {
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    gws: BTreeMap<NodeGw, Gateway>,
    _agents: BTreeMap<Worker, Agent>,
    proxies: BTreeMap<String, KubeProxy>,
}

/// The cluster, kube-proxy everywhere (synced and serving the Services),
/// both gateways and both agents.
fn bring_up(lab: &NodeLab, server: &ApiServer) -> Ctx {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    rt.block_on(setup_cluster(&client));
    let (gw_kc, node_kc) = rt.block_on(egret_kubeconfigs(&client, server.kubeconfig_path(), lab.dir()));
    let proxy_kc = lab.dir().join("kube-proxy.kubeconfig");
    rt.block_on(kubeproxy::proxier_kubeconfig(&client, server.kubeconfig_path(), &proxy_kc))
        .expect("kube-proxy's kubeconfig");

    // kube-proxy on every Node, as its DaemonSet runs.
    let t = Instant::now();
    let mut proxies = BTreeMap::new();
    let nodes: Vec<(&NetNs, &str, Ipv4Addr)> = NodeGw::ALL
        .iter()
        .map(|g| (lab.gateway_ns(*g), g.node_name(), g.lan_addr()))
        .chain(Worker::ALL.iter().map(|w| (lab.worker(*w), w.node_name(), w.lan_addr())))
        .collect();
    for (ns, name, ip) in nodes {
        kubeproxy::install_kubelet_chains(ns).expect("the kubelet's iptables chains");
        let cfg = KubeProxyConfig::iptables(name, IpAddr::V4(ip), CLUSTER_POD_CIDR, &proxy_kc);
        proxies.insert(name.to_string(), KubeProxy::start(ns, lab.dir(), &cfg).expect("start kube-proxy"));
    }
    let needle = format!("\"{NS}/web:tcp loadbalancer IP\"");
    for p in proxies.values_mut() {
        let synced = p.wait_synced(Duration::from_secs(60)).expect("kube-proxy synced");
        let serving = p.wait_nat(&needle, Duration::from_secs(30)).expect("kube-proxy serves the Service");
        println!(
            "{TAG}: kube-proxy on {}: KUBE-SERVICES after {} ms, the VIP's rule after {} ms",
            p.node(),
            ms(synced),
            ms(serving)
        );
    }
    println!("{TAG}: four kube-proxies synced {} ms after the first started", ms(t.elapsed()));

    let gws = start_node_lab_gateways(lab, &gw_kc);
    let agents = Worker::ALL.iter().map(|w| (*w, start_synced_agent(lab, *w, &node_kc, &[]))).collect();
    Ctx { rt, client, gws, _agents: agents, proxies }
}

fn holder(ctx: &Ctx) -> Option<NodeGw> {
    ctx.rt.block_on(lease_holder_name(&ctx.client, IpAddr::V4(VIP))).and_then(|h| NodeGw::by_node_name(&h))
}

/// The pod's sessions at a gateway whose pod port is one of the Services'
/// ports: a reply Egret took for new outbound traffic.
fn reply_sessions(gw: &Gateway) -> Vec<String> {
    let pod = Worker::One.pod_addr(10).to_string();
    gw.admin()
        .sessions_json(10_000)
        .unwrap_or_default()
        .into_iter()
        .filter(|s| {
            s["pod"].as_str() == Some(pod.as_str())
                && s["pod_port"].as_u64().is_some_and(|p| p == u64::from(TCP_PORT) || p == u64::from(UDP_PORT))
        })
        .map(|s| s.to_string())
        .collect()
}

// ----------------------------------------------------------- scenario ---

fn scenario(lab: &NodeLab, server: &ApiServer) {
    let srv = lab_ns(lab, "srv");
    let lan = lab_ns(lab, "lan");
    // Captures from before anything runs: everything the upstream router
    // receives from the segment, and everything each gateway sends.
    let up_cap = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");
    let gw_caps: Vec<(NodeGw, Capture)> = NodeGw::ALL
        .iter()
        .map(|g| (*g, Capture::start(&lan, &format!("p-g{}", if *g == NodeGw::One { 1 } else { 2 })).expect("capture")))
        .collect();
    let mut ctx = bring_up(lab, server);
    let mut checks = Checks::default();
    let pod_ns = lab.pod(POD);
    let pod_server = PodServer::start(pod_ns);
    let (tcp_cluster_ip, tcp_node_port, _) = service_ports(&ctx.rt, &ctx.client, "web");
    let (udp_cluster_ip, udp_node_port, _) = service_ports(&ctx.rt, &ctx.client, "web-udp");
    println!(
        "{TAG}: web {tcp_cluster_ip}:{TCP_PORT}/TCP nodePort {tcp_node_port}; web-udp {udp_cluster_ip}:{UDP_PORT}/UDP nodePort {udp_node_port}; VIP {VIP}"
    );
    let vip_tcp = SocketAddr::new(VIP.into(), TCP_PORT);
    let vip_udp = SocketAddr::new(VIP.into(), UDP_PORT);
    let client_ip = IpAddr::V4(CLIENT);

    // 0. The pod's own traffic leaves with the VIP.
    let out = egret_tests::probe::wait_source(pod_ns, NodeLab::http(), VIP.into(), Duration::from_secs(30));
    checks.check(out.is_ok(), format!("{POD}'s own connections leave with the VIP {VIP}: {out:?}"));
    let holder0 = holder(&ctx).expect("the VIP has a holder");
    println!("{TAG}: the VIP is held by {}", holder0.node_name());

    // 1. Inbound to the VIP, Cluster policy, with outbound at the same time.
    let inbound = Prober::start(&srv, vip_tcp, Duration::from_millis(100)).expect("inbound prober");
    let outbound = Prober::start(pod_ns, NodeLab::http(), Duration::from_millis(100)).expect("outbound prober");
    let t1 = Instant::now();
    let tcp = http_until(&srv, client_ip, vip_tcp, Duration::from_secs(5));
    let tcp_took = t1.elapsed();
    let udp = udp_outside(&srv, vip_udp, "vip-udp");
    std::thread::sleep(Duration::from_secs(3));
    let (ins, outs) = (inbound.stop(), outbound.stop());
    checks.check(
        tcp.is_ok(),
        format!("outside TCP {CLIENT} -> {vip_tcp} is answered (the pod saw {tcp:?}, {} ms)", ms(tcp_took)),
    );
    checks.check(
        matches!(udp, Ok((from, _)) if from == vip_udp),
        format!("outside UDP {CLIENT} -> {vip_udp} is answered from the VIP: {udp:?}"),
    );
    let ins_ok = ins.iter().filter(|a| a.outcome.is_ok()).count();
    let outs_vip = outs.iter().filter(|a| a.seen().is_some_and(|s| s.ip() == IpAddr::V4(VIP))).count();
    let outs_other: Vec<String> =
        outs.iter().filter_map(|a| a.seen()).filter(|s| s.ip() != IpAddr::V4(VIP)).map(|s| s.to_string()).collect();
    println!(
        "{TAG}: at the same time: {ins_ok}/{} new inbound connections to the VIP answered, {outs_vip}/{} new outbound connections seen as the VIP",
        ins.len(),
        outs.len()
    );
    checks.check(
        ins.len() >= 10 && ins_ok == ins.len(),
        format!("every new inbound connection to the VIP is answered ({ins_ok}/{})", ins.len()),
    );
    checks.check(
        outs.len() >= 10 && outs_vip == outs.len() && outs_other.is_empty(),
        format!("every new outbound connection leaves with the VIP while inbound runs ({outs_vip}/{}; other sources {outs_other:?})", outs.len()),
    );
    let pod_saw: Vec<IpAddr> = {
        let mut v: Vec<IpAddr> = pod_server.seen().iter().map(SocketAddr::ip).collect();
        v.sort();
        v.dedup();
        v
    };
    println!("{TAG}: the pod saw inbound connections from {pod_saw:?} (kube-proxy's masquerade on the gateway)");
    let bad = reply_sessions(&ctx.gws[&holder0]);
    checks.check(
        bad.is_empty(),
        format!("no session at {} has the pod's Service port inside: {bad:?}", holder0.node_name()),
    );
    if !bad.is_empty() || tcp.is_err() {
        print_state(lab, &ctx, holder0);
    }

    // 2. NodePort from outside, to each worker's segment address.
    for w in Worker::ALL {
        let to = SocketAddr::new(w.lan_addr().into(), tcp_node_port);
        let r = http_until(&srv, client_ip, to, Duration::from_secs(3));
        checks.check(r.is_ok(), format!("NodePort TCP {CLIENT} -> {to} ({}) is answered: {r:?}", w.node_name()));
        let to = SocketAddr::new(w.lan_addr().into(), udp_node_port);
        let r = udp_outside(&srv, to, &format!("np-{}", w.node_name()));
        checks.check(
            matches!(r, Ok((from, _)) if from == to),
            format!("NodePort UDP {CLIENT} -> {to} ({}) is answered from it: {r:?}", w.node_name()),
        );
    }

    // 3. The ClusterIP from each worker's host network.
    for w in Worker::ALL {
        let ns = lab.worker(w);
        let to = SocketAddr::new(tcp_cluster_ip.into(), TCP_PORT);
        let r = http_until(ns, IpAddr::V4(Ipv4Addr::UNSPECIFIED), to, Duration::from_secs(3));
        checks.check(r.is_ok(), format!("ClusterIP TCP from {}'s host network -> {to}: {r:?}", w.node_name()));
        let to = SocketAddr::new(udp_cluster_ip.into(), UDP_PORT);
        let s = udp_from(ns, IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0);
        let r = udp_ask(&s, to, &format!("cip-{}", w.node_name()), 5, Duration::from_millis(600));
        checks.check(
            matches!(r, Ok((from, _)) if from == to),
            format!("ClusterIP UDP from {}'s host network -> {to} is answered from it: {r:?}", w.node_name()),
        );
    }

    // 4. The API server's address calls the pod (a webhook): the control
    // namespace reaches w1's pods through w1's management address.
    lab.control()
        .ip(&["route", "add", &Worker::One.pod_cidr(), "via", &Worker::One.mgmt_addr().to_string()])
        .expect("route to w1's pods");
    let to = SocketAddr::new(Worker::One.pod_addr(10).into(), TCP_PORT);
    let r = http_until(lab.control(), IpAddr::V4(egret_tests::nodelab::CONTROL), to, Duration::from_secs(3));
    checks.check(
        matches!(r, Ok(s) if s.ip() == IpAddr::V4(egret_tests::nodelab::CONTROL)),
        format!("a webhook call from {} to {to} is answered (the pod saw {r:?})", egret_tests::nodelab::CONTROL),
    );

    // 5. Failover during inbound and outbound flows.
    failover(lab, &mut ctx, &srv, &mut checks);

    // 6. externalTrafficPolicy: Local.
    local_policy(lab, &mut ctx, &srv, &gw_caps, &mut checks);

    // 7. No gateway took a reply for outbound traffic; the captures.
    for (g, gw) in &ctx.gws {
        let bad = reply_sessions(gw);
        checks.check(
            bad.is_empty(),
            format!("at the end, no session at {} has the pod's Service port inside: {bad:?}", g.node_name()),
        );
    }
    drop(pod_server);
    check_captures(up_cap, gw_caps, &[tcp_node_port, udp_node_port], &ctx, &mut checks);
    drop(ctx);
    checks.finish();
}

/// What the gateways and the node did with the inbound flows (printed when
/// a check about them failed).
fn print_state(lab: &NodeLab, ctx: &Ctx, holder: NodeGw) {
    fn show<E: std::fmt::Display>(r: Result<String, E>) -> String {
        r.unwrap_or_else(|e| format!("({e})"))
    }
    let gw = &ctx.gws[&holder];
    let g = holder.node_name();
    match gw.counters() {
        Ok(c) => {
            let nonzero: BTreeMap<&String, &u64> = c.0.iter().filter(|(_, v)| **v > 0).collect();
            println!("{TAG}: {g} counters: {nonzero:?}");
        }
        Err(e) => println!("{TAG}: {g} counters: ({e})"),
    }
    let sessions = show(gw.sessions());
    println!("{TAG}: {g} sessions (first 5):\n{}", sessions.lines().take(6).collect::<Vec<_>>().join("\n"));
    let w1 = lab.worker(Worker::One);
    println!("{TAG}: w1 ip rule:\n{}", show(w1.ip(&["rule"])));
    println!("{TAG}: w1 inet egret_node:\n{}", show(w1.exec(&["nft", "list", "table", "inet", "egret_node"])));
    let gns = lab.gateway_ns(holder);
    println!(
        "{TAG}: {g} inet egret_failclosed:\n{}",
        show(gns.exec(&["nft", "list", "table", "inet", "egret_failclosed"]))
    );
    if let Some(p) = ctx.proxies.get(g) {
        println!("{TAG}: {g} KUBE-SERVICES:\n{}", show(p.chain_counters("nat", "KUBE-SERVICES")));
    }
    let ct = show(gns.exec(&["conntrack", "-L"]));
    let vip = format!("dst={VIP} ");
    let ct: Vec<&str> = ct.lines().filter(|l| l.contains(&vip)).take(5).collect();
    println!("{TAG}: {g} conntrack, connections to the VIP (first 5):\n{}", ct.join("\n"));
}

/// SIGKILL of the VIP's holder while an inbound and an outbound TCP
/// connection, an inbound and an outbound UDP flow and two streams of new
/// connections run: what survives.
fn failover(lab: &NodeLab, ctx: &mut Ctx, srv: &NetNs, checks: &mut Checks) {
    let pod_ns = lab.pod(POD);
    let vip_tcp = SocketAddr::new(VIP.into(), TCP_PORT);
    let vip_udp = SocketAddr::new(VIP.into(), UDP_PORT);
    let echo = SocketAddr::new(plan::SERVER.into(), plan::ECHO_PORT);
    let holder = holder(ctx).expect("the VIP has a holder");
    let mut kept_in = tcp_from(srv, IpAddr::V4(CLIENT), vip_tcp, Duration::from_secs(3)).map(Lines::new);
    let kept_in_before = kept_in.as_mut().map_err(|e| e.clone()).and_then(|l| l.line("in-before"));
    let mut kept_out = TcpSession::connect(pod_ns, echo);
    let kept_out_before =
        kept_out.as_mut().map_err(|e| e.to_string()).and_then(|s| s.line("out-before").map_err(|e| e.to_string()));
    let udp_in = UdpFlow::start(srv, IpAddr::V4(CLIENT), 41_234, vip_udp, "udp-in");
    let udp_out = UdpFlow::start(pod_ns, IpAddr::V4(Ipv4Addr::UNSPECIFIED), 41_235, echo, "udp-out");
    let inbound = Prober::start(srv, vip_tcp, Duration::from_millis(200)).expect("inbound prober");
    let outbound = Prober::start(pod_ns, NodeLab::http(), Duration::from_millis(200)).expect("outbound prober");
    std::thread::sleep(Duration::from_secs(2));
    println!("{TAG}: failover: before the kill: kept inbound {kept_in_before:?}, kept outbound {kept_out_before:?}");

    let kill = Instant::now();
    ctx.gws.get_mut(&holder).unwrap().kill().expect("kill the VIP's holder");
    // Until both streams of new connections are back (or 45 s), then 2 s more.
    let deadline = kill + Duration::from_secs(45);
    loop {
        let i = inbound.wait_for(kill + Duration::from_secs(1), Duration::ZERO, |a| a.outcome.is_ok());
        let o = outbound.wait_for(kill + Duration::from_secs(1), Duration::ZERO, |a| {
            a.seen().is_some_and(|s| s.ip() == IpAddr::V4(VIP))
        });
        if (i.is_some() && o.is_some()) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));
    let kept_in_after = kept_in.as_mut().map_err(|e| e.clone()).and_then(|l| l.line("in-after"));
    let kept_out_after =
        kept_out.as_mut().map_err(|e| e.to_string()).and_then(|s| s.line("out-after").map_err(|e| e.to_string()));
    let (ins, outs) = (inbound.stop(), outbound.stop());
    let (uin, uout) = (udp_in.stop(), udp_out.stop());
    let new_holder = self::holder(ctx);
    println!(
        "{TAG}: failover: SIGKILL of {} (egret only: its kernel, conntrack and kube-proxy stay); the VIP is now held by {:?}",
        holder.node_name(),
        new_holder.map(NodeGw::node_name)
    );
    let report = |what: &str, series: &[(Instant, bool)]| {
        let (last, back, lost) = gap(series, kill);
        println!(
            "{TAG}: failover: {what}: last answer {} ms before the kill, answers again {} after it, {lost} of {} lost",
            last.map_or("-".into(), |d| ms(d).to_string()),
            back.map_or("never".into(), |d| format!("{} ms", ms(d))),
            series.iter().filter(|(t, _)| *t >= kill).count(),
        );
        back
    };
    let in_back = report("new inbound TCP connections to the VIP (every 200 ms)", &attempts_series(&ins));
    let out_series: Vec<(Instant, bool)> =
        outs.iter().map(|a| (a.started, a.seen().is_some_and(|s| s.ip() == IpAddr::V4(VIP)))).collect();
    let out_back = report("new outbound TCP connections as the VIP (every 200 ms)", &out_series);
    let uin_series: Vec<(Instant, bool)> =
        uin.iter().map(|(t, a)| (*t, a.is_some_and(|(from, _)| from == vip_udp))).collect();
    let uin_back = report("the inbound UDP flow to the VIP (every 100 ms)", &uin_series);
    let uout_series: Vec<(Instant, bool)> =
        uout.iter().map(|(t, a)| (*t, a.is_some_and(|(_, seen)| seen.ip() == IpAddr::V4(VIP)))).collect();
    let uout_back = report("the outbound UDP flow as the VIP (every 100 ms)", &uout_series);
    let uout_ports: Vec<u16> = {
        let mut v: Vec<u16> = uout.iter().filter_map(|(_, a)| a.map(|(_, seen)| seen.port())).collect();
        v.dedup();
        v
    };
    let wrong_in: Vec<String> = uin
        .iter()
        .filter_map(|(_, a)| *a)
        .filter(|(from, _)| *from != vip_udp)
        .map(|(from, _)| from.to_string())
        .collect();
    println!(
        "{TAG}: failover: kept inbound TCP connection after: {kept_in_after:?}; kept outbound TCP connection after: {kept_out_after:?}; the outbound UDP flow's source ports at the server {uout_ports:?}"
    );
    checks.check(new_holder.is_some_and(|h| h != holder), format!("the other gateway took the VIP ({new_holder:?})"));
    checks.check(in_back.is_some(), "new inbound connections to the VIP are answered again after the failover");
    checks.check(out_back.is_some(), "new outbound connections leave with the VIP again after the failover");
    checks.check(uin_back.is_some(), "the inbound UDP flow is answered again after the failover");
    checks.check(uout_back.is_some(), "the outbound UDP flow is answered again after the failover");
    checks.check(
        wrong_in.is_empty(),
        format!("every answer of the inbound UDP flow came from the VIP: others {wrong_in:?}"),
    );
    checks.check(
        matches!(&kept_out_after, Ok(r) if r.seen.ip() == IpAddr::V4(VIP)),
        format!("the outbound TCP connection carries on through the other gateway: {kept_out_after:?}"),
    );
    // An inbound TCP connection lives in the holder's conntrack (kube-proxy's
    // DNAT and masquerade); the other gateway's kernel has no entry for it,
    // so it is not expected to survive: recorded, not asserted.
    println!(
        "{TAG}: failover: the inbound TCP connection {} the failover",
        if kept_in_after.is_ok() { "survived" } else { "did not survive" }
    );
}

/// `externalTrafficPolicy: Local` on both Services: the VIP's traffic
/// reaches the gateway holding it, whose kube-proxy has no local endpoint.
fn local_policy(lab: &NodeLab, ctx: &mut Ctx, srv: &NetNs, caps: &[(NodeGw, Capture)], checks: &mut Checks) {
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), NS);
    for name in ["web", "web-udp"] {
        let patch = json!({"spec": {"externalTrafficPolicy": "Local"}});
        ctx.rt.block_on(services.patch(name, &PatchParams::default(), &Patch::Merge(&patch))).expect("Local");
    }
    let holder = holder(ctx).expect("the VIP has a holder");
    let needle = format!("\"{NS}/web:tcp has no local endpoints\"");
    let mut waited = Vec::new();
    for p in ctx.proxies.values_mut() {
        waited.push((p.node().to_string(), p.wait_nat("KUBE-XLB-", Duration::from_secs(30)).is_ok()));
    }
    let gw_proxy = &ctx.proxies[holder.node_name()];
    let rules = gw_proxy.nat_rules(false).unwrap_or_default();
    checks.check(
        rules.contains(&needle),
        format!("kube-proxy on {} drops the VIP's traffic: {needle} ({waited:?})", holder.node_name()),
    );
    let arp_of = |g: NodeGw| {
        caps.iter().find(|(c, _)| *c == g).map_or((0, 0), |(_, c)| {
            arp_for_vip(&c.caught_up(Duration::from_secs(10)).expect("the capture catches up"), g)
        })
    };
    let drops_before = mark_drop_packets(&ctx.proxies[holder.node_name()]);
    let (asked_before, answered_before) = arp_of(holder);
    let vip_tcp = SocketAddr::new(VIP.into(), TCP_PORT);
    let tcp = http_from(srv, IpAddr::V4(CLIENT), vip_tcp);
    let udp = udp_outside(srv, SocketAddr::new(VIP.into(), UDP_PORT), "local-udp");
    let drops = mark_drop_packets(&ctx.proxies[holder.node_name()]).saturating_sub(drops_before);
    let (asked, answered) = arp_of(holder);
    println!(
        "{TAG}: Local: TCP to the VIP {tcp:?}; UDP {udp:?}; on {}: KUBE-MARK-DROP marked {drops} packets; its kernel then routed them towards the VIP itself and asked ARP for it {} times, answered {} times (the kubelet's KUBE-FIREWALL drops marked packets in INPUT and OUTPUT only, not FORWARD)",
        holder.node_name(),
        asked - asked_before,
        answered - answered_before
    );
    checks.check(tcp.is_err() && udp.is_err(), "Local: the outside client gets no answer from the VIP");
    checks.check(
        drops > 0,
        format!(
            "Local: kube-proxy on {} has no local endpoint and marks them for drop ({drops} packets)",
            holder.node_name()
        ),
    );
    // The health check node port a load balancer would ask: no endpoint on
    // the gateways, one on w1.
    let (_, _, hc) = service_ports(&ctx.rt, &ctx.client, "web");
    let hc = hc.expect("a healthCheckNodePort for Local");
    for (name, addr, want) in [
        ("gw-1", NodeGw::One.lan_addr(), 503),
        ("gw-2", NodeGw::Two.lan_addr(), 503),
        ("w1", Worker::One.lan_addr(), 200),
        ("w2", Worker::Two.lan_addr(), 503),
    ] {
        let got = egret_tests::gateway::http_status(srv, SocketAddr::new(addr.into(), hc), "/").ok();
        checks.check(
            got == Some(want),
            format!("Local: health check node port {addr}:{hc} ({name}) says {got:?}, want {want}"),
        );
    }
    let out = egret_tests::probe::wait_source(lab.pod(POD), NodeLab::http(), VIP.into(), Duration::from_secs(10));
    checks.check(out.is_ok(), format!("Local: {POD}'s own connections still leave with the VIP: {out:?}"));
    // The gateways say so on the Service: a Warning Event.
    let events: Api<Event> = Api::namespaced(ctx.client.clone(), NS);
    let warned = ctx.rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let list = events.list(&ListParams::default()).await.map(|l| l.items).unwrap_or_default();
            let found = list.iter().find(|e| {
                e.reason.as_deref() == Some("ExternalTrafficPolicyLocal")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web")
            });
            if let Some(e) = found {
                return Ok(e.note.clone().unwrap_or_default());
            }
            if Instant::now() > deadline {
                return Err(format!("no ExternalTrafficPolicyLocal Event for {NS}/web in 30 s"));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    checks.check(warned.is_ok(), format!("Local: a Warning Event on {NS}/web says why: {warned:?}"));
}

/// ARP requests for the VIP that gateway `g` sent, and ARP replies for the
/// VIP that others sent it.
fn arp_for_vip(frames: &[Frame], g: NodeGw) -> (usize, usize) {
    let arp = |d: &[u8], op: u8| d.len() >= 42 && d[12..14] == [0x08, 0x06] && d[20..22] == [0, op];
    let asked =
        frames.iter().filter(|f| arp(&f.data, 1) && f.data[6..12] == g.mac() && f.data[38..42] == VIP.octets()).count();
    let answered = frames
        .iter()
        .filter(|f| {
            arp(&f.data, 2) && f.data[0..6] == g.mac() && f.data[6..12] != g.mac() && f.data[28..32] == VIP.octets()
        })
        .count();
    (asked, answered)
}

fn mark_drop_packets(p: &KubeProxy) -> u64 {
    let text = p.chain_counters("nat", "KUBE-MARK-DROP").unwrap_or_else(|e| {
        println!("{TAG}: KUBE-MARK-DROP counters on {}: {e}", p.node());
        String::new()
    });
    text.lines().filter_map(|l| l.split_whitespace().next()?.parse::<u64>().ok()).sum()
}

/// The transport ports of an IPv4 TCP or UDP frame.
fn ports(f: &Frame) -> Option<(u16, u16)> {
    let d = &f.data;
    let mut off = 14;
    if d.get(12..14)? == [0x81, 0x00] {
        off += 4;
    }
    if d.get(off - 2..off)? != [0x08, 0x00] {
        return None;
    }
    let ihl = usize::from(d.get(off)? & 0x0f) * 4;
    let proto = *d.get(off + 9)?;
    if proto != 6 && proto != 17 {
        return None;
    }
    let l4 = off + ihl;
    Some((u16::from_be_bytes([*d.get(l4)?, *d.get(l4 + 1)?]), u16::from_be_bytes([*d.get(l4 + 2)?, *d.get(l4 + 3)?])))
}

/// The captures' verdicts (the module doc, item 7).
fn check_captures(up: Capture, gws: Vec<(NodeGw, Capture)>, node_ports: &[u16], ctx: &Ctx, checks: &mut Checks) {
    let frames = up.stop().expect("stop the capture");
    let pods: ipnet::IpNet = CLUSTER_POD_CIDR.parse().unwrap();
    let outside: ipnet::IpNet = "198.51.100.0/24".parse().unwrap();
    let nodes: Vec<IpAddr> = NodeGw::ALL
        .iter()
        .map(|g| IpAddr::V4(g.lan_addr()))
        .chain(Worker::ALL.iter().map(|w| IpAddr::V4(w.lan_addr())))
        .collect();
    let hc: Vec<u16> = ["web", "web-udp"].iter().filter_map(|n| service_ports(&ctx.rt, &ctx.client, n).2).collect();
    let server_ports = [plan::HTTP_PORT, plan::ECHO_PORT];
    let (mut pod_leaks, mut node_leaks, mut translated, mut vip_answers, mut vip_out) = (vec![], vec![], vec![], 0, 0);
    for f in &frames {
        let Some(ip) = capture::ip_info(&f.data) else { continue };
        if ip.eth_src == plan::UP_MAC || !outside.contains(&ip.dst) {
            continue;
        }
        let what = || format!("{:?}: {} -> {} proto {} ports {:?}", f.at, ip.src, ip.dst, ip.proto, ports(f));
        if pods.contains(&ip.src) {
            pod_leaks.push(what());
        } else if nodes.contains(&ip.src) {
            let ok = ports(f).is_some_and(|(sp, _)| node_ports.contains(&sp) || hc.contains(&sp));
            if !ok && ip.proto != 1 {
                node_leaks.push(what());
            }
        } else if ip.src == IpAddr::V4(VIP) {
            match ports(f) {
                Some((sp, _)) if sp == TCP_PORT || sp == UDP_PORT => vip_answers += 1,
                Some((_, dp)) if server_ports.contains(&dp) => vip_out += 1,
                _ => translated.push(what()),
            }
        }
    }
    println!(
        "{TAG}: upstream capture: {} frames; to the outside from the VIP: {vip_answers} Service answers, {vip_out} translated outbound",
        frames.len()
    );
    let first = |v: &Vec<String>| v.iter().take(5).cloned().collect::<Vec<_>>();
    checks.check(
        pod_leaks.is_empty(),
        format!("no pod address upstream: {} frames {:?}", pod_leaks.len(), first(&pod_leaks)),
    );
    checks.check(
        node_leaks.is_empty(),
        format!(
            "no node address upstream but NodePort and health-check answers: {} frames {:?}",
            node_leaks.len(),
            first(&node_leaks)
        ),
    );
    checks.check(
        translated.is_empty(),
        format!(
            "every frame from the VIP upstream is a Service answer or outbound to the server: {} others {:?}",
            translated.len(),
            first(&translated)
        ),
    );
    let inside: Vec<ipnet::IpNet> =
        ["203.0.113.0/24", "192.0.2.0/24", CLUSTER_POD_CIDR].iter().map(|n| n.parse().unwrap()).collect();
    for (g, cap) in gws {
        let frames = cap.stop().expect("stop the capture");
        let back: Vec<String> = frames
            .iter()
            .filter_map(|f| Some((f, capture::ip_info(&f.data)?)))
            .filter(|(_, ip)| {
                ip.eth_src == g.mac() && ip.src == IpAddr::V4(VIP) && inside.iter().any(|n| n.contains(&ip.dst))
            })
            .map(|(f, ip)| format!("{:?}: {} -> {} proto {} ports {:?}", f.at, ip.src, ip.dst, ip.proto, ports(f)))
            .collect();
        checks.check(
            back.is_empty(),
            format!(
                "{} sent no frame from the VIP into the cluster (a translated reply): {} frames {:?}",
                g.node_name(),
                back.len(),
                first(&back)
            ),
        );
    }
}
