//! The Kubernetes lab (`egret_tests::k8slab`, docs/lab.md): a real
//! kube-apiserver + etcd inside the lab's control namespace, two gateway
//! namespaces running the real `egret gateway` in Kubernetes mode (nodes
//! `gw-1`, `gw-2`, one-arm on the shared segment, default Lease timing), and
//! a node router whose per-pod routes stay static throughout:
//!
//! - a LoadBalancer Service annotated `egret.dev/egress: "true"` with ingress
//!   IP 203.0.113.10 (the VIP) selects pod `web`; the node router sends that
//!   pod's traffic to the VIP itself as next hop;
//! - an EgressPolicy with an explicit egress IP (chosen so that the *other*
//!   gateway is its rendezvous-preferred holder) selects pod `db`, routed the
//!   same way via its egress IP;
//! - pod `other` is selected by nothing.
//!
//! Phases: steady state (each IP leaves from its preferred gateway, exactly
//! one gateway answers ARP for it); SIGKILL of the VIP's holder (new
//! connections leave with the same VIP through the other gateway; the time
//! is measured from the kill to the first new connection that succeeds, and
//! the Lease take-over from the Lease object and the log; the policy's IP on
//! the surviving gateway is not disturbed); the killed gateway restarts (no
//! pre-emption); the API server is killed (new connections keep working
//! until the holder's renew deadline, then the holder fences: no ARP answer,
//! nothing leaves with the VIP, the pods' packets are dropped and counted,
//! not forwarded); the API server restarts (one holder again). During the
//! whole test a capture on the upstream router's link and the server's
//! journal must show no packet with a selected pod's address.
//!
//! Measured times are printed (`--nocapture`, lines starting `k8s-lab:`);
//! docs/kubernetes.md records them. Skipped (with a message) when not root or
//! the API server is not built; `EGRET_REQUIRE_APISERVER=1` makes that a
//! failure.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant, SystemTime};

use egret_controlplane::k8s::desired::rank_gateways;
use egret_controlplane::k8s::lease::lease_name;
use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture, Frame};
use egret_tests::client::{self, TcpSession};
use egret_tests::gateway::{log_events, Gateway};
use egret_tests::k8slab::{Gw, K8sLab, KPod};
use egret_tests::plan;
use egret_tests::probe::{self, Attempt, Prober};
use k8s_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde_json::json;

const NAME: &str = "k8s_lab_service_vip_failover_and_api_outage";
const RESTART: &str = "k8s_lab_holder_crash_and_immediate_restart";
const FROZEN: &str = "k8s_lab_frozen_holder_sends_nothing_for_its_ip_after_its_deadline";
/// The default renew deadline: the holder's valid-until is its last
/// renewal's send time + this.
const RENEW_DEADLINE: Duration = Duration::from_secs(2);
/// The Service's VIP (its `status.loadBalancer.ingress` IP).
const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The default Lease timing (docs/kubernetes.md): duration, renew deadline, retry.
const D: Duration = Duration::from_secs(4);
const R: Duration = Duration::from_secs(2);
const P: Duration = Duration::from_millis(500);
/// New connections per second per probed pod: one every PROBE_EVERY.
const PROBE_EVERY: Duration = Duration::from_millis(100);

/// The other gateway of the two-gateway lab.
fn other_gw(g: Gw) -> Gw {
    match g {
        Gw::One => Gw::Two,
        _ => Gw::One,
    }
}

fn http() -> SocketAddr {
    SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT)
}

fn echo() -> SocketAddr {
    SocketAddr::new(plan::SERVER.into(), plan::ECHO_PORT)
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// `b - a` in milliseconds, negative when `b` is earlier.
fn wall_ms(a: SystemTime, b: SystemTime) -> i64 {
    match b.duration_since(a) {
        Ok(d) => d.as_millis() as i64,
        Err(e) => -(e.duration().as_millis() as i64),
    }
}

#[test]
fn k8s_lab_service_vip_failover_and_api_outage() {
    run_in_lab(NAME, failover_and_api_outage);
}

/// A gateway restarted right after a crash starts with its file's empty
/// tables, its XDP program passing everything, while the node router still
/// resolves the egress IP to its MAC. Until its control plane has loaded the
/// cluster (~0.1-0.3 s) only the crashed process's fail-closed nftables table
/// stands between the selected pods and the upstream link: the daemon keeps
/// it until the cluster's first tables are applied (failclosed::Hold). Before
/// that fix this test saw 5 frames of one new TCP connection leave with the
/// pod's address 268-270 ms after the kill.
#[test]
fn k8s_lab_holder_crash_and_immediate_restart() {
    run_in_lab(RESTART, crash_and_immediate_restart);
}

/// Issue 14 item 6, the frozen process: the VIP's holder is stopped
/// (SIGSTOP) for longer than `leaseDuration` while the web pod sends UDP
/// and ARP requests for the VIP arrive, the other gateway takes the VIP,
/// then the holder resumes (SIGCONT). From the capture on the shared link:
/// after the holder's deadline (its last renewal, sent before the stop, +
/// `renewDeadline`) no frame with the VIP as source and no ARP reply for the
/// VIP leaves the frozen holder, neither during the freeze (XDP, its fast
/// path) nor when it drains what queued (the workers). Before the data
/// plane's own deadline, 4 of 4 rounds saw about 150 stale ARP replies and
/// 275-388 datagrams from the VIP within 8 ms of the resume.
#[test]
fn k8s_lab_frozen_holder_sends_nothing_for_its_ip_after_its_deadline() {
    run_in_lab(FROZEN, frozen_holder);
}

/// Builds the lab and its API server, runs `scenario` inside the control
/// namespace (the test's own API client must reach 192.0.2.1, and nothing
/// listens outside the lab's namespaces), stops everything.
///
fn run_in_lab(name: &str, scenario: fn(&K8sLab, &ApiServer)) {
    run_in_k8s_lab("k8s-lab", name, &Gw::PAIR, scenario);
}

/// An egress IP for the policy whose rendezvous-preferred gateway is not the
/// VIP's, so each gateway holds one IP in the steady state.
fn policy_ip(vip_holder: &str) -> Ipv4Addr {
    (11..=40u8)
        .map(|i| Ipv4Addr::new(203, 0, 113, i))
        .filter(|ip| ![Gw::One.lan_addr(), Gw::Two.lan_addr()].contains(ip))
        .find(|ip| rank_gateways(IpAddr::V4(*ip), &["gw-1", "gw-2"])[0] != vip_holder)
        .expect("an IP preferred by the other gateway")
}

struct Gateways {
    gws: Vec<(Gw, Gateway)>,
}

impl Gateways {
    fn get(&mut self, g: Gw) -> &mut Gateway {
        &mut self.gws.iter_mut().find(|(x, _)| *x == g).unwrap().1
    }
}

/// Keeps the gateways' logs as artifacts when the test fails (the lab's
/// directory goes with the lab).
struct KeepLogs<'a>(&'a K8sLab, &'static str);

impl Drop for KeepLogs<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            save_artifacts(self.1, self.0, &[]);
        }
    }
}

/// What every scenario starts from: the cluster objects, both gateways
/// running, a capture on the upstream link.
struct Ctx {
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    preferred_vip: Gw,
    eip: Ipv4Addr,
    capture: Option<Capture>,
    cap_t0: Instant,
    gws: Gateways,
}

fn bring_up(lab: &K8sLab, server: &ApiServer) -> Ctx {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    let preferred_vip = Gw::by_node_name(&rank_gateways(IpAddr::V4(VIP), &["gw-1", "gw-2"])[0]).unwrap();
    let eip = policy_ip(preferred_vip.node_name());
    println!(
        "k8s-lab: VIP {VIP} prefers {}; EgressPolicy IP {eip} prefers {}",
        preferred_vip.node_name(),
        other_gw(preferred_vip).node_name()
    );

    // Static node routing: each selected pod's egress IP is its next hop.
    lab.route_pod_via(KPod::Web, VIP, 110).expect("route web via the VIP");
    lab.route_pod_via(KPod::Db, eip, 111).expect("route db via the policy's IP");

    // The cluster: CRDs, RBAC, gateway Nodes, Pods, the Service, the policy.
    let token = rt.block_on(setup_cluster(&client, eip));
    let kubeconfig = lab.dir().join("gateway.kubeconfig");
    write_token_kubeconfig(server.kubeconfig_path(), "egret-gateway", &token, &kubeconfig);

    // Capture the upstream link from before the gateways start.
    let capture = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");
    let cap_t0 = capture.started();

    let mut gws = Gateways { gws: Vec::new() };
    for g in Gw::PAIR {
        let cfg = lab_gateway_config(g, &kubeconfig, String::new());
        let gw = Gateway::spawn_in(lab.gateway_ns(g), lab.dir(), g.node_name(), &cfg).expect("start egret");
        gws.gws.push((g, gw));
    }
    for g in Gw::PAIR {
        gws.get(g).wait_ready(Duration::from_secs(30)).expect("egret ready");
    }

    Ctx { rt, client, preferred_vip, eip, capture: Some(capture), cap_t0, gws }
}

/// Waits for the steady state: each selected pod leaves with its egress IP,
/// each IP held by its preferred gateway, which alone answers ARP for it.
fn steady_state(lab: &K8sLab, ctx: &mut Ctx) -> Gw {
    let (rt, client, eip, preferred_vip) = (&ctx.rt, &ctx.client, ctx.eip, ctx.preferred_vip);
    let gws = &mut ctx.gws;
    let t_started = Instant::now();
    // 1. Steady state.
    let web = wait_source(lab, KPod::Web, VIP, Duration::from_secs(30));
    let db = wait_source(lab, KPod::Db, eip, Duration::from_secs(30));
    println!(
        "k8s-lab: steady state: web leaves as {web}, db as {db}, {} ms after the gateways were ready",
        ms(t_started.elapsed())
    );
    let other = probe::once(lab.pod(KPod::Other), http()).unwrap().expect("the unselected pod reaches the server");
    assert_eq!(other.ip(), IpAddr::V4(KPod::Other.addr()), "an unselected pod keeps its own address");
    let vip_holder = lease_holder(rt, client, VIP).expect("the VIP's Lease has a holder");
    let eip_holder = lease_holder(rt, client, eip).expect("the policy IP's Lease has a holder");
    assert_preferred_or_started_late(rt, client, gws, VIP, vip_holder, preferred_vip);
    assert_preferred_or_started_late(rt, client, gws, eip, eip_holder, other_gw(preferred_vip));
    assert_one_arp_answer(lab, VIP, vip_holder);
    assert_one_arp_answer(lab, eip, eip_holder);
    let nobody = lab.arp_who_has(plan::NOT_OWNED, Duration::from_millis(300)).unwrap();
    assert!(nobody.is_empty(), "nobody answers for a free address: {nobody:?}");
    // Each gateway serves what its Leases name: one IP each, or both on
    // one when the other started late (above).
    for g in [vip_holder, other_gw(vip_holder)] {
        let want: Vec<Ipv4Addr> =
            [(VIP, vip_holder), (eip, eip_holder)].iter().filter(|(_, h)| *h == g).map(|(ip, _)| *ip).collect();
        assert_owned(gws.get(g), &want);
    }
    vip_holder
}

fn failover_and_api_outage(lab: &K8sLab, server: &ApiServer) {
    let _keep = KeepLogs(lab, NAME);
    let mut ctx = bring_up(lab, server);
    let vip_holder = steady_state(lab, &mut ctx);
    let Ctx { rt, client, eip, capture, cap_t0, gws, .. } = &mut ctx;
    let (rt, client, eip, cap_t0) = (&*rt, &*client, *eip, *cap_t0);
    let capture = capture.take().unwrap();

    // 2. SIGKILL the VIP's holder while both pods open new connections,
    // with one TCP connection from web already established through it.
    let survivor = other_gw(vip_holder);
    // On a loaded machine the VIP's preferred gateway may have started late
    // and the other one hold both IPs (steady_state): the policy's IP then
    // fails over with the VIP, and is checked for that instead.
    let eip_with_vip = lease_holder(rt, client, eip) == Some(vip_holder);
    let mut kept = TcpSession::connect(lab.pod(KPod::Web), echo()).expect("a TCP connection from web to the echo port");
    let kept_before = kept.line("before the kill").expect("a line over the connection through the VIP's holder");
    assert_eq!(kept_before.seen.ip(), IpAddr::V4(VIP), "the kept connection leaves with the VIP");
    let kept_udp = client::udp_socket(lab.pod(KPod::Web), echo()).expect("a UDP socket from web to the echo port");
    let (udp_before, _) = client::udp_exchange(&kept_udp, "udp before the kill", 3, Duration::from_secs(1))
        .expect("UDP echo via the holder");
    assert_eq!(udp_before.seen.ip(), IpAddr::V4(VIP), "the kept UDP flow leaves with the VIP");
    let web_probe = Prober::start(lab.pod(KPod::Web), http(), PROBE_EVERY).unwrap();
    let db_probe = Prober::start(lab.pod(KPod::Db), http(), PROBE_EVERY).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    // From when the process is gone (SIGKILL sent and the process reaped).
    gws.get(vip_holder).kill().expect("SIGKILL the VIP's holder");
    let (wall_kill, t_kill) = (SystemTime::now(), Instant::now());
    let first = web_probe.wait_for(t_kill, Duration::from_secs(20), |a| a.seen().is_some()).unwrap_or_else(|| {
        panic!("no new connection from web succeeded within 20 s of the kill: {:?}", tail(&web_probe))
    });
    std::thread::sleep(Duration::from_secs(1));
    let failover = first.finished - t_kill;
    let attempts = web_probe.attempts();
    let after: Vec<&Attempt> = attempts.iter().filter(|a| a.started >= t_kill).collect();
    let lost = after.iter().filter(|a| a.started < first.started && a.seen().is_none()).count();
    println!(
        "k8s-lab: SIGKILL of {}: first new connection through {} succeeded {} ms after the kill (started at +{} ms); {lost} attempts failed in between",
        vip_holder.node_name(),
        survivor.node_name(),
        ms(failover),
        ms(first.started - t_kill)
    );
    for a in after.iter().filter(|a| a.seen().is_some()) {
        assert_eq!(a.seen().unwrap().ip(), IpAddr::V4(VIP), "new connections leave with the same VIP");
    }
    assert!(
        after.iter().filter(|a| a.started >= first.started && a.seen().is_none()).count() <= 1,
        "once through, new connections keep working: {:?}",
        after.iter().filter(|a| a.started >= first.started).map(|a| &a.outcome).collect::<Vec<_>>()
    );
    // Nobody could take the VIP before its Lease could expire (the holder
    // renewed at most P before the kill), and the survivor took it within
    // the documented bound.
    assert!(
        first.started >= t_kill + D - P - Duration::from_millis(300),
        "a connection succeeded at +{} ms: before the Lease could expire",
        ms(first.started - t_kill)
    );
    // The documented bound (docs/kubernetes.md), a speed: asserted in the
    // documented run only (`EGRET_HA_EXPECT_TIMES=1`); the wait above is
    // the liveness limit.
    if egret_tests::expect_times() {
        assert!(failover <= D + 2 * P + Duration::from_secs(2), "failover took {} ms", ms(failover));
    }
    // The connection opened through the killed gateway carries on through
    // the survivor: its next segment is picked up mid-stream (tcpLoosePickup)
    // and keeps its port (preserved: the pod's port lies in nat.ports), so
    // the server sees the same connection, else it would answer with a RST.
    let t_line = Instant::now();
    let kept_after = kept.line("after the failover").unwrap_or_else(|e| {
        panic!("the TCP connection opened before the kill (via {}) broke in the failover: {e}", kept_before.seen)
    });
    let line_ms = ms(t_line.elapsed());
    // The answer is the check: the server reports the address it accepted
    // the connection from, which cannot change; a segment from another
    // port would have been reset instead.
    assert_eq!(kept_after.seen, kept_before.seen, "the kept connection's source, as the server saw it");
    // A UDP flow has no connection to break, but its peer (a QUIC or
    // WireGuard server, a partner's allow-list keyed on address and port)
    // must see the same source: the new holder's session keeps the port.
    let (udp_after, _) = client::udp_exchange(&kept_udp, "udp after the failover", 3, Duration::from_secs(1))
        .expect("UDP echo via the survivor");
    assert_eq!(udp_after.seen, udp_before.seen, "the UDP flow's source before and after the failover");
    println!(
        "k8s-lab: a TCP connection established through {} before the kill carried on through {}: server saw {}, the line answered in {} ms; a UDP flow kept its source {}",
        vip_holder.node_name(),
        survivor.node_name(),
        kept_after.seen,
        line_ms,
        udp_after.seen
    );
    let lease = get_lease(rt, client, VIP);
    let spec = lease.spec.clone().unwrap_or_default();
    assert_eq!(spec.holder_identity.as_deref(), Some(survivor.node_name()), "the survivor holds the VIP's Lease");
    let acquired = SystemTime::from(spec.acquire_time.expect("acquireTime").0);
    let took = log_events(&gws.get(survivor).log_text(), "took egress IP")
        .into_iter()
        .filter(|(t, l)| *t >= wall_kill && l.contains(&format!("ip={VIP}")))
        .map(|(t, _)| t)
        .next()
        .expect("the survivor logged the take-over");
    println!(
        "k8s-lab: Lease take-over: acquireTime {} ms after the kill (log: 'took egress IP' at +{} ms); first new connection +{} ms",
        wall_kill_ms(wall_kill, acquired),
        wall_kill_ms(wall_kill, took),
        ms(failover)
    );
    assert!(wall_ms(wall_kill, acquired) >= (D - P - Duration::from_millis(300)).as_millis() as i64);
    assert_one_arp_answer(lab, VIP, survivor);
    let neigh = lab.node_neighbor(VIP).unwrap().unwrap_or_default();
    println!("k8s-lab: node router's neighbour entry for the VIP after the failover: {neigh}");
    let db_attempts = db_probe.attempts();
    if eip_with_vip {
        // Both IPs were on the killed gateway: the policy's IP moved too.
        println!(
            "k8s-lab: the policy's IP was on the killed gateway too (the other started late): it failed over as well"
        );
        assert_eq!(lease_holder(rt, client, eip), Some(survivor), "the survivor holds the policy's IP's Lease");
        assert!(
            db_attempts.iter().any(|a| a.started >= t_kill && a.seen().is_some()),
            "db's new connections never went through again after the failover"
        );
    } else {
        // The policy's IP was on the survivor all along: undisturbed.
        let db_failed: Vec<&Attempt> =
            db_attempts.iter().filter(|a| a.started >= t_kill - Duration::from_secs(1) && a.seen().is_none()).collect();
        assert!(
            db_failed.is_empty(),
            "the policy's IP on the other gateway was disturbed by the failover: {db_failed:?}"
        );
    }
    assert!(db_attempts.iter().filter_map(Attempt::seen).all(|s| s.ip() == IpAddr::V4(eip)));

    // 3. The killed gateway comes back: no pre-emption.
    gws.get(vip_holder).restart().expect("restart the killed gateway");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(lease_holder(rt, client, VIP), Some(survivor), "a held VIP does not move to a returning gateway");
    assert_one_arp_answer(lab, VIP, survivor);
    assert_owned(gws.get(vip_holder), &[]);

    // 4. The API server dies.
    let before = gws.get(survivor).counters().expect("counters");
    // Times below count from the kill's start: the holder's last renewal
    // may have been sent up to P before it, and the kill itself (SIGKILL
    // and reap) takes from 10 ms to several hundred on a loaded machine.
    let (wall_api0, t_api0) = (SystemTime::now(), Instant::now());
    server.kill_apiserver_blocking().expect("kill the API server");
    let (wall_api, t_api) = (SystemTime::now(), Instant::now());
    println!("k8s-lab: API server killed ({} ms to kill and reap)", ms(t_api - t_api0));
    std::thread::sleep(R + Duration::from_secs(2));
    let fenced = log_events(&gws.get(survivor).log_text(), "fenced")
        .into_iter()
        .find(|(t, l)| *t >= wall_api0 && l.contains(&VIP.to_string()))
        .map(|(t, _)| t)
        .expect("the holder logged fencing the VIP");
    let fence_ms = wall_ms(wall_api0, fenced);
    let kill_ms = ms(t_api - t_api0) as i64;
    let fence_at = t_api0 + Duration::from_millis(fence_ms.max(0) as u64);
    // Enough attempts after the fence for "none succeeded" to mean something
    // (on a loaded machine each failed attempt takes longer).
    let wait_until = Instant::now() + Duration::from_secs(10);
    while web_probe.attempts().iter().filter(|a| a.started > fence_at + Duration::from_millis(250)).count() < 10
        && Instant::now() < wait_until
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    let attempts = web_probe.attempts();
    let outage: Vec<&Attempt> = attempts.iter().filter(|a| a.started >= t_api0).collect();
    let last_ok = outage.iter().filter(|a| a.seen().is_some()).map(|a| a.started).max();
    let first_fail = outage.iter().filter(|a| a.seen().is_none()).map(|a| a.started).min();
    let served = last_ok.map(|t| t - t_api0).unwrap_or_default();
    println!(
        "k8s-lab: API server down: new connections still served until +{} ms, first failed at +{} ms; holder fenced the VIP at +{fence_ms} ms (log)",
        ms(served),
        first_fail.map(|t| ms(t - t_api0)).unwrap_or(0)
    );
    // docs/kubernetes.md: kept until the renew deadline after the last
    // successful renewal (sent at most P before the kill started, at the
    // latest when the server died), then fenced.
    assert!(fence_ms >= (R - P - Duration::from_millis(200)).as_millis() as i64, "fenced at +{fence_ms} ms: too early");
    assert!(
        fence_ms <= (R + Duration::from_millis(500)).as_millis() as i64 + kill_ms,
        "fenced at +{fence_ms} ms: after its deadline (the kill took {kill_ms} ms)"
    );
    assert!(served >= Duration::from_secs(1), "forwarding stopped {} ms into the outage", ms(served));
    assert!(
        outage.iter().filter(|a| a.started > fence_at + Duration::from_millis(250)).all(|a| a.seen().is_none()),
        "a new connection succeeded after the holder fenced the VIP"
    );
    let after_fence = outage.iter().filter(|a| a.started > fence_at + Duration::from_millis(250)).count();
    assert!(after_fence >= 10, "the probe kept trying after the fence ({after_fence})");
    let arp = lab.arp_who_has(VIP, Duration::from_millis(300)).unwrap();
    assert!(arp.is_empty(), "nobody answers ARP for a fenced VIP: {arp:?}");
    for g in Gw::PAIR {
        assert_owned(gws.get(g), &[]);
        let took =
            log_events(&gws.get(g).log_text(), "took egress IP").into_iter().filter(|(t, _)| *t >= wall_api).count();
        assert_eq!(took, 0, "{} took an IP without the API server", g.node_name());
    }
    let delta = gws.get(survivor).counters().expect("counters").delta(&before);
    // Dormant (issue 28 §2): the VIP stays in its tables with its sessions,
    // past its deadline, so the pods' packets are dropped as
    // `ownership_expired` (out of the tables they would be
    // `egress_ip_not_owned`).
    let not_served: u64 = delta
        .iter()
        .filter(|(k, _)| k.ends_with("egress_ip_not_owned") || k.ends_with("ownership_expired"))
        .map(|(_, v)| *v)
        .sum();
    println!("k8s-lab: fenced holder's counters during the outage: {delta:?}");
    assert!(
        not_served >= 5,
        "the fenced holder drops the pods' packets (ownership_expired or egress_ip_not_owned: {not_served})"
    );
    // The translated flow stops on the wire too.
    let frames = capture.caught_up(Duration::from_secs(10)).expect("the capture catches up");
    let vip_after = frames
        .iter()
        .filter(|f| cap_t0 + f.at > fence_at + Duration::from_millis(250))
        .filter_map(|f| capture::ip_info(&f.data))
        .filter(|i| i.src == IpAddr::V4(VIP))
        .count();
    assert_eq!(vip_after, 0, "nothing leaves with the VIP after the fence");

    // 5. The API server is back: one holder again.
    server.restart_apiserver_blocking().expect("restart the API server");
    let t_back = Instant::now();
    let again = web_probe
        .wait_for(t_back, Duration::from_secs(30), |a| a.seen().is_some())
        .expect("new connections work again after the API server is back");
    let holder = lease_holder(rt, client, VIP).expect("the VIP has a holder again");
    let db_again = db_probe
        .wait_for(t_back, Duration::from_secs(30), |a| a.seen().is_some())
        .expect("the policy's pod gets through again");
    println!(
        "k8s-lab: API server back ({} ms down); first new connection {} ms after it was ready, VIP held by {}",
        ms(t_back - t_api),
        ms(again.finished - t_back),
        holder.node_name()
    );
    assert_eq!(again.seen().unwrap().ip(), IpAddr::V4(VIP));
    assert_eq!(db_again.seen().unwrap().ip(), IpAddr::V4(eip));
    assert_one_arp_answer(lab, VIP, holder);
    let web_all = web_probe.stop();
    let db_all = db_probe.stop();

    let frames = capture.stop().expect("stop the capture");
    assert_no_leaks(NAME, lab, &frames);
    let by_gw = |g: Gw| {
        frames
            .iter()
            .filter_map(|f| capture::ip_info(&f.data))
            .filter(|i| i.eth_src == g.mac() && i.src == IpAddr::V4(VIP))
            .count()
    };
    println!(
        "k8s-lab: {} frames on the upstream link; VIP frames from gw-1 {}, gw-2 {}; web attempts {} ({} ok), db attempts {} ({} ok)",
        frames.len(),
        by_gw(Gw::One),
        by_gw(Gw::Two),
        web_all.len(),
        web_all.iter().filter(|a| a.seen().is_some()).count(),
        db_all.len(),
        db_all.iter().filter(|a| a.seen().is_some()).count()
    );
    for g in Gw::PAIR {
        let gw = gws.get(g);
        let _ = gw.terminate();
    }
}

/// The VIP's holder crashes and its DaemonSet restarts it at once, before
/// its Lease expired: the node router still sends the pods' traffic to it.
/// Nothing may leave with a pod address at any moment, and new connections
/// must leave with the VIP again.
fn crash_and_immediate_restart(lab: &K8sLab, server: &ApiServer) {
    let _keep = KeepLogs(lab, RESTART);
    let mut ctx = bring_up(lab, server);
    let holder = steady_state(lab, &mut ctx);
    let web_probe = Prober::start(lab.pod(KPod::Web), http(), PROBE_EVERY).unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let gw = ctx.gws.get(holder);
    gw.kill().expect("SIGKILL the VIP's holder");
    let (wall_kill, t_kill) = (SystemTime::now(), Instant::now());
    gw.restart().expect("restart it at once");
    let t_ready = Instant::now();
    let first = web_probe
        .wait_for(t_kill, Duration::from_secs(20), |a| a.seen().is_some())
        .unwrap_or_else(|| panic!("no new connection succeeded within 20 s of the restart: {:?}", tail(&web_probe)));
    std::thread::sleep(Duration::from_secs(1));
    let attempts = web_probe.stop();
    let now_holder = lease_holder(&ctx.rt, &ctx.client, VIP).expect("the VIP has a holder");
    let acquired =
        get_lease(&ctx.rt, &ctx.client, VIP).spec.and_then(|s| s.acquire_time).map(|t| SystemTime::from(t.0));
    let took = log_events(&ctx.gws.get(now_holder).log_text(), "took egress IP")
        .into_iter()
        .find(|(t, l)| *t >= wall_kill && l.contains(&format!("ip={VIP}")))
        .map(|(t, _)| wall_ms(wall_kill, t));
    let loaded = log_events(&ctx.gws.get(holder).log_text(), "Kubernetes state loaded")
        .into_iter()
        .find(|(t, _)| *t >= wall_kill)
        .map(|(t, _)| wall_ms(wall_kill, t));
    println!(
        "k8s-lab: {} killed and restarted (ready {} ms after the kill, Kubernetes state loaded at +{:?} ms); VIP now held by {} (acquireTime +{:?} ms, 'took egress IP' +{:?} ms); first new connection +{} ms",
        holder.node_name(),
        ms(t_ready - t_kill),
        loaded,
        now_holder.node_name(),
        acquired.map(|a| wall_ms(wall_kill, a)),
        took,
        ms(first.finished - t_kill)
    );
    let frames = ctx.capture.take().unwrap().stop().expect("stop the capture");
    let leaked = leaks(&frames);
    let since_kill = |f: &Frame| (ctx.cap_t0 + f.at).saturating_duration_since(t_kill).as_millis();
    let untranslated: Vec<&Attempt> =
        attempts.iter().filter(|a| a.seen().is_some_and(|s| s.ip() != IpAddr::V4(VIP))).collect();
    println!(
        "k8s-lab: after the restart: {} frames left with a pod address (from +{:?} to +{:?} ms after the kill); {} new connections reached the server untranslated (started +{:?} ms)",
        leaked.len(),
        leaked.first().map(|(f, _)| since_kill(f)),
        leaked.last().map(|(f, _)| since_kill(f)),
        untranslated.len(),
        untranslated.iter().map(|a| a.started.saturating_duration_since(t_kill).as_millis()).collect::<Vec<_>>()
    );
    assert_no_leaks(RESTART, lab, &frames);
    for a in attempts.iter().filter_map(Attempt::seen) {
        assert_eq!(a.ip(), IpAddr::V4(VIP), "web leaves with the VIP or not at all");
    }
    for g in Gw::PAIR {
        let _ = ctx.gws.get(g).terminate();
    }
}

fn frozen_holder(lab: &K8sLab, server: &ApiServer) {
    let _keep = KeepLogs(lab, FROZEN);
    let mut ctx = bring_up(lab, server);
    let holder = steady_state(lab, &mut ctx);
    let (cap_t0, mac) = (ctx.cap_t0, holder.mac());
    // The web pod sends a datagram every 5 ms throughout (replies ignored),
    // so the frozen holder's rings fill while it is stopped.
    let sock = client::udp_socket(lab.pod(KPod::Web), echo()).expect("a UDP socket from web");
    let sending = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = sending.clone();
    let sender = std::thread::spawn(move || {
        let mut n = 0u64;
        while flag.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = sock.send(format!("frozen {n}").as_bytes());
            n += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        n
    });
    std::thread::sleep(Duration::from_secs(1));
    let pid = ctx.gws.get(holder).pid().expect("the holder's pid");
    let signal = |sig: &str| {
        let ok = std::process::Command::new("kill").args([sig, &pid.to_string()]).status().expect("kill").success();
        assert!(ok, "kill {sig} {pid}");
    };
    signal("-STOP");
    let t_stop = Instant::now();
    // Asked for the VIP during the freeze, before and after the deadline.
    let mut asked = 0;
    while t_stop.elapsed() < D + Duration::from_secs(4) {
        let _ = lab.arp_who_has(VIP, Duration::from_millis(200));
        asked += 1;
        std::thread::sleep(Duration::from_millis(300));
    }
    let taken_by = lease_holder(&ctx.rt, &ctx.client, VIP);
    signal("-CONT");
    let t_cont = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    sending.store(false, std::sync::atomic::Ordering::Relaxed);
    let sent = sender.join().unwrap();
    let frames = ctx.capture.take().unwrap().stop().expect("stop the capture");
    // The holder's valid-until is before t_stop + renewDeadline.
    let deadline = t_stop + RENEW_DEADLINE;
    let at = |f: &Frame| cap_t0 + f.at;
    let from_holder = |f: &&Frame| f.data.len() >= 14 && f.data[6..12] == mac;
    let vip_source: Vec<&Frame> = frames
        .iter()
        .filter(from_holder)
        .filter(|f| capture::ip_info(&f.data).is_some_and(|i| i.src == IpAddr::V4(VIP)))
        .collect();
    let arp_replies: Vec<&Frame> = frames
        .iter()
        .filter(from_holder)
        .filter(|f| {
            let d = &f.data;
            d.len() >= 42 && d[12..14] == [0x08, 0x06] && d[20..22] == [0, 2] && d[28..32] == VIP.octets()
        })
        .collect();
    let late = |v: &[&Frame]| v.iter().filter(|f| at(f) >= deadline).count();
    let span = |v: &[&Frame]| {
        v.iter()
            .filter(|f| at(f) >= deadline)
            .map(|f| at(f).saturating_duration_since(t_cont).as_millis() as i128)
            .collect::<Vec<_>>()
    };
    println!(
        "k8s-lab: {} stopped {} ms (VIP then held by {:?}); {sent} datagrams sent, {asked} ARP probes; from the frozen holder: {} frames with the VIP as source ({} after its deadline), {} ARP replies for the VIP ({} after its deadline; ms after the resume: {:?})",
        holder.node_name(),
        ms(t_cont - t_stop),
        taken_by.map(|g| g.node_name()),
        vip_source.len(),
        late(&vip_source),
        arp_replies.len(),
        late(&arp_replies),
        span(&arp_replies),
    );
    // Issue 28 §5: "nothing late" must not come from capturing nothing:
    // someone took the VIP over, and the capture saw the holder send for it
    // before its deadline.
    assert_eq!(taken_by, Some(other_gw(holder)), "the other gateway took the VIP during the freeze");
    let early = |v: &[&Frame]| v.iter().filter(|f| at(f) < deadline).count();
    assert!(
        early(&vip_source) > 0,
        "the capture saw no frame with the VIP as source from the holder before its deadline"
    );
    assert_eq!(
        late(&vip_source),
        0,
        "frames with the VIP as source left the frozen holder after its deadline (ms after the resume: {:?})",
        span(&vip_source)
    );
    assert_eq!(late(&arp_replies), 0, "ARP replies for the VIP left the frozen holder after its deadline");
    let c = ctx.gws.get(holder).counters().expect("the resumed holder's counters");
    println!(
        "k8s-lab: the resumed holder counted: ownership_expired {}, drop_neigh_expired {}, drop_egress_expired {}, punt_expired {}",
        c.get("ownership_expired"),
        c.get("drop_neigh_expired"),
        c.get("drop_egress_expired"),
        c.get("punt_expired")
    );
    assert_no_leaks(FROZEN, lab, &frames);
    for g in Gw::PAIR {
        let _ = ctx.gws.get(g).terminate();
    }
}

/// Nothing ever left with a selected pod's address: no such frame reached
/// the upstream router or came from a gateway, and the server never saw one.
fn assert_no_leaks(name: &str, lab: &K8sLab, frames: &[Frame]) {
    let leaked = leaks(frames);
    let journal_leaks: Vec<String> = lab
        .server()
        .map(|s| s.seen())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| SELECTED.contains(&s.src.ip()))
        .map(|s| s.to_string())
        .collect();
    if !leaked.is_empty() || !journal_leaks.is_empty() {
        save_artifacts(name, lab, frames);
    }
    let shown: Vec<String> = leaked.iter().take(5).map(|(f, text)| format!("at {:?}: {text}", f.at)).collect();
    assert!(leaked.is_empty(), "{} frames left with a selected pod's address: {shown:?}", leaked.len());
    assert!(journal_leaks.is_empty(), "the server saw selected pods' own addresses: {journal_leaks:?}");
}

/// The selected pods' addresses.
const SELECTED: [IpAddr; 2] = [IpAddr::V4(Ipv4Addr::new(198, 18, 0, 10)), IpAddr::V4(Ipv4Addr::new(198, 18, 0, 11))];

/// Frames that carry a selected pod's address and either reached the
/// upstream router or came from a gateway (a frame from the node router to a
/// gateway that the bridge floods past the upstream router is not a leak).
fn leaks(frames: &[Frame]) -> Vec<(&Frame, String)> {
    let gw_macs = [Gw::One.mac(), Gw::Two.mac()];
    frames
        .iter()
        .filter_map(|f| capture::ip_info(&f.data).map(|i| (f, i)))
        .filter(|(f, i)| SELECTED.contains(&i.src) && (f.data[..6] == plan::UP_MAC || gw_macs.contains(&i.eth_src)))
        .map(|(f, i)| (f, format!("{} -> {} proto {} from {:02x?}", i.src, i.dst, i.proto, i.eth_src)))
        .collect()
}

fn wall_kill_ms(kill: SystemTime, t: SystemTime) -> i64 {
    wall_ms(kill, t)
}

/// Retries new connections from `pod` until the server sees `want` as their source.
fn wait_source(lab: &K8sLab, pod: KPod, want: Ipv4Addr, timeout: Duration) -> SocketAddr {
    probe::wait_source(lab.pod(pod), http(), want.into(), timeout).unwrap_or_else(|e| panic!("{}: {e}", pod.name())).0
}

fn tail(p: &Prober) -> Vec<String> {
    let v = p.attempts();
    v[v.len().saturating_sub(5)..].iter().map(|a| format!("{} {:?}", a.seq, a.outcome)).collect()
}

fn assert_one_arp_answer(lab: &K8sLab, ip: Ipv4Addr, holder: Gw) {
    let replies = lab.arp_who_has(ip, Duration::from_millis(300)).unwrap();
    let macs: Vec<[u8; 6]> = replies.iter().map(|a| a.sha).collect();
    assert_eq!(macs, vec![holder.mac()], "exactly {} answers ARP for {ip}", holder.node_name());
}

/// The addresses `gw` serves now (a dormant one, past its deadline with
/// its sessions kept, is not served).
fn assert_owned(gw: &mut Gateway, want: &[Ipv4Addr]) {
    let status = gw.admin().status().expect("egret status");
    let mut owned: Vec<String> = status["owned"]
        .as_array()
        .map(|v| {
            v.iter()
                .filter(|o| o["served"].as_bool() != Some(false))
                .filter_map(|o| o["ip"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    owned.sort();
    let mut want: Vec<String> = want.iter().map(Ipv4Addr::to_string).collect();
    want.sort();
    assert_eq!(owned, want, "owned addresses of {}", gw.config_path().display());
}

fn get_lease(rt: &tokio::runtime::Runtime, client: &kube::Client, ip: Ipv4Addr) -> Lease {
    let api: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
    rt.block_on(api.get(&lease_name(IpAddr::V4(ip)))).expect("get Lease")
}

/// The IP is held by its rendezvous-preferred gateway, or by the other one
/// because the preferred one started too late: the other takes a free Lease
/// after deferring one retry period to it, and nobody pre-empts a holder,
/// so on a loaded machine whose preferred gateway starts seconds later the
/// other one rightly keeps it. Then the Lease must have been acquired before
/// the preferred gateway was running (its "gateway running" line) plus a
/// retry period and a second of slack: had it been running, it would have
/// taken the IP first.
fn assert_preferred_or_started_late(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    gws: &mut Gateways,
    ip: Ipv4Addr,
    holder: Gw,
    preferred: Gw,
) {
    if holder == preferred {
        return;
    }
    let spec = rt.block_on(lease_spec(client, IpAddr::V4(ip))).expect("the IP's Lease");
    let acquired = SystemTime::from(spec.acquire_time.expect("acquireTime").0);
    let log = gws.get(preferred).log_text();
    let running = log_events(&log, "gateway running").first().map(|(t, _)| *t).unwrap_or_else(|| {
        panic!(
            "{ip}: held by {}, not its preferred {}, which never logged `gateway running`",
            holder.node_name(),
            preferred.node_name()
        )
    });
    let slack = P + Duration::from_secs(1);
    println!(
        "k8s-lab: {ip} is held by {}, not its preferred {}: acquired {} ms after {} was running (it started late)",
        holder.node_name(),
        preferred.node_name(),
        acquired
            .duration_since(running)
            .map(|d| d.as_millis() as i128)
            .unwrap_or_else(|e| -(e.duration().as_millis() as i128)),
        preferred.node_name()
    );
    assert!(
        acquired < running + slack,
        "{ip} is held by {}, but its preferred {} was running {} ms before it was acquired: it should have taken it",
        holder.node_name(),
        preferred.node_name(),
        acquired.duration_since(running).unwrap_or_default().as_millis()
    );
}

fn lease_holder(rt: &tokio::runtime::Runtime, client: &kube::Client, ip: Ipv4Addr) -> Option<Gw> {
    rt.block_on(lease_holder_name(client, IpAddr::V4(ip))).and_then(|h| Gw::by_node_name(&h))
}

/// CRDs, the deployed namespace and RBAC, gateway Nodes, Pods with their lab
/// addresses, the annotated Service with the VIP, the EgressPolicy. Returns
/// a token of the gateways' ServiceAccount.
async fn setup_cluster(client: &kube::Client, eip: Ipv4Addr) -> String {
    install_egret(client).await;
    namespace(client, "team-a", json!({"team": "a"})).await;
    for g in Gw::PAIR {
        node(client, g.node_name(), json!({"egret.dev/gateway": "true"})).await;
    }
    for p in KPod::ALL {
        pod(client, "team-a", &format!("{}-1", p.name()), json!({"app": p.name()}), &p.addr().to_string()).await;
    }
    lb_service(client, "team-a", "web", json!({"app": "web"}), &[443], &VIP.to_string()).await;
    db_policy(client, eip).await;
    service_account_token(client, "egret-gateway").await
}

fn save_artifacts(name: &str, lab: &K8sLab, frames: &[Frame]) {
    let dir = std::env::var_os("EGRET_E2E_ARTIFACTS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("egret-e2e-artifacts"));
    let _ = std::fs::create_dir_all(&dir);
    if !frames.is_empty() {
        let _ = capture::write_pcap(&dir.join(format!("{name}.pcap")), frames);
    }
    for g in Gw::PAIR {
        let _ = std::fs::copy(
            lab.dir().join(format!("{}.log", g.node_name())),
            dir.join(format!("{name}.{}.log", g.node_name())),
        );
    }
    eprintln!("{name}: artifacts in {}", dir.display());
}
