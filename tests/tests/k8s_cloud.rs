//! The cloud lab: the Kubernetes lab's two gateways (`egret_tests::k8slab`)
//! with a cloud pool, run once per cloud against its API in the lab's
//! control namespace, next to the API server (`egret_tests::cloudlab`):
//! AWS against moto's EC2 API, Azure against the ARM emulator
//! (`tests/emulators/azure`), GCP against the Compute emulator
//! (`tests/emulators/gcp`).
//!
//! - The cloud side: the gateways' instances (VMs) in a subnet of the lab's
//!   shared segment (203.0.113.0/24) at the gateways' own addresses,
//!   forwarding allowed (AWS: source/destination check off; Azure: IP
//!   forwarding; GCP: `canIpForward`), two public addresses tagged
//!   (labelled) `egret-pool=lab` and one not.
//! - The Kubernetes side: gateway Nodes with their `spec.providerID`, an
//!   `EgressIPPool` whose `spec.cloud` names the cloud (AWS and Azure: the
//!   private range 203.0.113.40-47), and the policy `db` taking one
//!   address from it.
//! - The gateways reach the cloud through the provider's real credential
//!   chain (AWS: the SDK's environment credentials; Azure: workload
//!   identity, a service account token exchanged at the emulator's Entra ID
//!   endpoint; GCP: the metadata server the emulator serves).
//! - The cloud's routing is the one part emulated: a thread reads from the
//!   cloud API which machine each egress IP is delivered to (AWS: the
//!   Elastic IP's association; Azure: the NIC holding the private address;
//!   GCP: the instance the forwarding rule's target instance names) and pins
//!   the egress IP's neighbour entry, on the node router and the upstream
//!   router, to that gateway's MAC. So only the gateway the cloud API gave
//!   the address to receives its traffic; ARP answers play no part once an
//!   address is pinned, and the steps wait for the pin before they use one.
//!
//! Checked: discovery and pairing (the tagged addresses only, recorded in
//! the pool's status; on GCP the pairing is the identity: the egress IP is
//! the external address), the address delivered to the holder before it is
//! translated to, the pod leaving with the egress IP (the server sees it);
//! a drain of the holder while the cloud throttles the take-over's move
//! twice (AWS: AssociateAddress; Azure: the new holder's NIC update; GCP:
//! the forwarding rule's insert or setTarget); the address moved to the
//! other gateway behind Egret's back (the holder's next refresh moves it
//! back); a SIGKILL of the holder moves the Lease, the address and the
//! traffic to the other gateway; the public address in use retagged out of
//! the pool (the policy moves to the pool's other address, the first is
//! released); no packet with the pod's own address upstream at any time; an
//! uninstall releases the last address; the credential chain was used.
//!
//! Where moto differs from AWS (docs/kubernetes.md, "Running on AWS"):
//! AssociateAddress ignores `PrivateIpAddress`, and AssignPrivateIpAddresses
//! ignores `AllowReassignment` (the old interface keeps the address). So
//! the AWS routing follows the association's *interface*, which moto does
//! move; the requests the fault proxy recorded show what the gateways asked
//! for. (Because moto's association names the primary address, the
//! gateways' refresh finds it drifted each time and associates it again:
//! harmless, and counted.)

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use egret_controlplane::k8s::crd::{EgressIPPool, EgressPolicy};
use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture};
use egret_tests::cloudlab::{CloudLab, Layout, Machine, Pair, Provider, AZURE_TOKEN_AUDIENCE, GATEWAY_EGRESS};
use egret_tests::gateway::Gateway;
use egret_tests::k8slab::{Gw, K8sLab, KPod, CONTROL};
use egret_tests::netns::NetNs;
use egret_tests::plan;
use egret_tests::probe;
use k8s_common::*;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

/// The egress IP the policy takes first: the pool's lowest.
const PRIVATE: Ipv4Addr = GATEWAY_EGRESS[0];
/// The pool's other egress IP.
const SECOND: Ipv4Addr = GATEWAY_EGRESS[1];
/// The gateways' `kubernetes.resyncPeriod`: how often they ask the cloud again.
const RESYNC: Duration = Duration::from_secs(5);

#[test]
fn k8s_cloud_aws_elastic_ip_moves_with_its_lease() {
    cloud_lab(Provider::Aws, "k8s_cloud_aws_elastic_ip_moves_with_its_lease");
}

#[test]
fn k8s_cloud_azure_public_ip_moves_with_its_lease() {
    cloud_lab(Provider::Azure, "k8s_cloud_azure_public_ip_moves_with_its_lease");
}

#[test]
fn k8s_cloud_gcp_external_address_moves_with_its_lease() {
    cloud_lab(Provider::Gcp, "k8s_cloud_gcp_external_address_moves_with_its_lease");
}

fn cloud_lab(provider: Provider, name: &'static str) {
    match provider.available_or_skip(name) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    let tag = format!("k8s-cloud-{}", provider.name());
    run_in_k8s_lab(&tag.clone(), name, &Gw::PAIR, move |lab, server| scenario(provider, &tag, lab, server));
}

/// The emulated routing: each egress IP's neighbour entry on the node
/// router and the upstream router follows the machine the cloud API
/// delivers it to. Records when each move happened.
struct CloudRouting {
    stop: Arc<AtomicBool>,
    moves: Arc<Mutex<Vec<(Instant, Ipv4Addr, Gw)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CloudRouting {
    fn start(lab: &K8sLab, cloud: Arc<dyn CloudLab>) -> CloudRouting {
        let stop = Arc::new(AtomicBool::new(false));
        let moves = Arc::new(Mutex::new(Vec::new()));
        let node = NetNs::existing(lab.node().name()).expect("the node router's namespace");
        let up = NetNs::existing(lab.upstream().name()).expect("the upstream router's namespace");
        let (s, m) = (stop.clone(), moves.clone());
        let thread = std::thread::spawn(move || {
            let mut current: BTreeMap<Ipv4Addr, Gw> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                for (egress, node_name) in cloud.delivered() {
                    let Some(g) = Gw::by_node_name(&node_name) else { continue };
                    if current.get(&egress) == Some(&g) {
                        continue;
                    }
                    let mac = g.mac().iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
                    let cmd = format!("neigh replace {egress} lladdr {mac} dev lan0 nud permanent");
                    node.ip_batch(std::slice::from_ref(&cmd)).expect("pin the node router's neighbour");
                    up.ip_batch(&[cmd]).expect("pin the upstream router's neighbour");
                    m.lock().unwrap().push((Instant::now(), egress, g));
                    current.insert(egress, g);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        CloudRouting { stop, moves, thread: Some(thread) }
    }

    /// The moves of [`PRIVATE`].
    fn moves(&self) -> Vec<(Instant, Gw)> {
        self.moves_of(PRIVATE)
    }

    fn moves_of(&self, egress: Ipv4Addr) -> Vec<(Instant, Gw)> {
        self.moves.lock().unwrap().iter().filter(|(_, p, _)| *p == egress).map(|(t, _, g)| (*t, *g)).collect()
    }
}

impl Drop for CloudRouting {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the scenario's steps share.
#[derive(Clone, Copy)]
struct Cx<'a> {
    tag: &'a str,
    rt: &'a tokio::runtime::Runtime,
    client: &'a kube::Client,
    lab: &'a K8sLab,
    cloud: &'a dyn CloudLab,
    pairs: &'a [Pair],
    routing: &'a CloudRouting,
}

fn other_than(g: Gw) -> Gw {
    if g == Gw::One {
        Gw::Two
    } else {
        Gw::One
    }
}

fn scenario(provider: Provider, tag: &str, lab: &K8sLab, server: &ApiServer) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    // The cloud's API next to the API server: the gateways reach both over
    // their management link.
    let machines = Gw::PAIR.iter().map(|g| Machine { node: g.node_name().into(), addr: g.lan_addr() }).collect();
    let cloud = provider.start(lab.control(), CONTROL, Layout::Gateways(machines));
    let pairs = cloud.pairs();
    println!("{tag}: the cloud seeded: pairs {pairs:?}");

    lab.route_pod_via(KPod::Db, PRIVATE, 111).expect("route db via the egress IP");
    let token = rt.block_on(setup_cluster(&client, cloud.as_ref()));
    let kubeconfig = lab.dir().join("gateway.kubeconfig");
    write_token_kubeconfig(server.kubeconfig_path(), "egret-gateway", &token, &kubeconfig);
    // What AKS's workload identity webhook projects into a gateway Pod.
    let federated = rt.block_on(service_account_token_for(&client, "egret-gateway", &[AZURE_TOKEN_AUDIENCE]));
    let env = cloud.gateway_env(lab.dir(), &federated);

    let routing = CloudRouting::start(lab, cloud.clone());
    let capture = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");

    // The channel between the gateways, as deployed by default: a SIGKILL
    // is then proven at once and the cloud calls are most of a failover.
    let key = lab.dir().join("ha.key");
    write_ha_key(&key);
    let mut gws = BTreeMap::new();
    // Run as Pods of a DaemonSet, so an uninstall is told from a restart.
    let names: Vec<&str> = Gw::PAIR.iter().map(|g| g.node_name()).collect();
    rt.block_on(daemonset_with_pods(&client, "egret-gateway", json!({"egret.dev/gateway": "true"}), &names));
    for g in Gw::PAIR {
        // A refresh every 5 s: discovery and the drift check within the test's patience.
        let extra = format!("{}  resyncPeriod: {}s\n", ha_section(lab, g, &key, 4720), RESYNC.as_secs());
        let mut cfg = lab_gateway_config(g, &kubeconfig, extra);
        cfg.env = env.clone();
        cfg.env.push(("POD_NAME".into(), daemonset_pod_name("egret-gateway", g.node_name())));
        cfg.env.push(("POD_NAMESPACE".into(), "egret-system".into()));
        gws.insert(g, Gateway::spawn_in(lab.gateway_ns(g), lab.dir(), g.node_name(), &cfg).expect("start egret"));
    }
    for gw in gws.values_mut() {
        gw.wait_ready(Duration::from_secs(60)).expect("egret ready");
    }

    // 1. Discovery and pairing: the tagged addresses only, in the pool's status.
    let pools: Api<EgressIPPool> = Api::all(client.clone());
    let t0 = Instant::now();
    let paired = loop {
        let p = rt.block_on(pools.get("cloud")).expect("get the pool");
        let pairs: Vec<(String, String)> = p
            .status
            .iter()
            .flat_map(|s| s.cloud_addresses.iter())
            .map(|a| (a.public_ip.clone(), a.private_ip.clone()))
            .collect();
        if pairs.len() == 2 {
            break pairs;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "no pairing recorded: {:?}", p.status);
        std::thread::sleep(Duration::from_millis(200));
    };
    let want: Vec<(String, String)> = pairs.iter().map(|p| (p.public.clone(), p.egress.to_string())).collect();
    assert_eq!(paired, want, "each tagged public address paired (GCP: with itself)");
    println!("{tag}: pairing recorded {} ms after the gateways were ready: {paired:?}", t0.elapsed().as_millis());

    // 2. The pod leaves with the egress IP; the cloud delivers it to the holder.
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let (seen, took) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE}: {e}"));
    let holder = rt
        .block_on(lease_holder_name(&client, IpAddr::V4(PRIVATE)))
        .and_then(|h| Gw::by_node_name(&h))
        .expect("the egress IP's Lease has a holder");
    assert_eq!(
        cloud.delivered().get(&PRIVATE).map(String::as_str),
        Some(holder.node_name()),
        "the cloud delivers {PRIVATE} to the holder"
    );
    assert_eq!(
        cloud.publics_on(holder.node_name()),
        vec![pairs[0].public.clone()],
        "the public address is on the holder"
    );
    println!("{tag}: steady state: db leaves as {seen} through {} after {} ms", holder.node_name(), took.as_millis());
    let status = gws.get_mut(&holder).unwrap().admin().status().expect("egret status");
    let row = status["cluster"]["leases"]
        .as_array()
        .and_then(|v| v.iter().find(|l| l["ip"] == PRIVATE.to_string()).cloned())
        .expect("a Lease row for the egress IP");
    assert_eq!(row["public_ip"], pairs[0].public, "egret status shows the public address: {row}");
    let cloud_col = row["cloud"].as_str().unwrap_or_default();
    let mark = cloud.interface_mark(holder.node_name());
    assert!(
        cloud_col.starts_with("assigned to ") && cloud_col.to_ascii_lowercase().contains(&mark.to_ascii_lowercase()),
        "egret status names {mark}: {row}"
    );

    // 3. A drain with the cloud throttling the take-over, then drift repaired.
    let cx = Cx { tag, rt: &rt, client: &client, lab, cloud: cloud.as_ref(), pairs: &pairs, routing: &routing };
    let holder = drain_with_api_errors(&cx, holder);
    repair_drift(&cx, &mut gws, holder);

    // 4. SIGKILL of the holder: the Lease, the address and the traffic move.
    let other = other_than(holder);
    // With the channel up and the standby's copy complete (a SIGKILL in
    // the first few hundred ms after the start would be proven only by the
    // Lease's expiry: a different measurement).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !gws[&holder].log_text().contains("the standby holds a complete copy") {
        assert!(Instant::now() < deadline, "{}'s standby has a copy", holder.node_name());
        std::thread::sleep(Duration::from_millis(50));
    }
    let moves_before = routing.moves().len();
    let mark = cloud.log_mark();
    let kill = Instant::now();
    gws.get_mut(&holder).unwrap().kill().expect("SIGKILL the holder");
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE} after the failover: {e}"));
    let outage = kill.elapsed();
    let moved = routing.moves();
    let (moved_at, to) = *moved.get(moves_before).expect("the address moved");
    assert_eq!(to, other, "the address moved to the surviving gateway");
    let new_holder = rt.block_on(lease_holder_name(&client, IpAddr::V4(PRIVATE)));
    assert_eq!(new_holder.as_deref(), Some(other.node_name()));
    let calls = cloud.failover_moves(mark, holder.node_name(), other.node_name(), PRIVATE);
    println!(
        "{tag}: failover: SIGKILL of {} -> delivered to {} after {} ms -> db leaves as {seen} after {} ms; the cloud calls: {calls}",
        holder.node_name(),
        other.node_name(),
        moved_at.duration_since(kill).as_millis(),
        outage.as_millis()
    );

    // 5. The public address in use retagged out of the pool: the policy
    // moves to the pool's other address, and the first is released.
    retag_out_of_the_pool(&cx, other);

    // 6. Never the pod's own address upstream.
    let frames = capture.stop().expect("stop the capture");
    // A frame from the node router to a gateway that the bridge floods past
    // the upstream router is not a leak; one to the upstream router, or one
    // a gateway sent, is.
    let gw_macs = [Gw::One.mac(), Gw::Two.mac()];
    let leaked: Vec<String> = frames
        .iter()
        .filter_map(|f| capture::ip_info(&f.data).map(|i| (f, i)))
        .filter(|(f, i)| {
            i.src == IpAddr::V4(KPod::Db.addr()) && (f.data[..6] == plan::UP_MAC || gw_macs.contains(&i.eth_src))
        })
        .map(|(f, i)| format!("at {:?}: {} -> {}", f.at, i.src, i.dst))
        .collect();
    assert!(leaked.is_empty(), "the pod's own address reached the upstream link: {leaked:?}");

    // 7. An uninstall (the DaemonSet deleted, then the last gateway
    // stopped) leaves the address held by no gateway.
    assert!(cloud.held_by(other.node_name(), SECOND), "{} holds {SECOND}", other.node_name());
    rt.block_on(delete_daemonset(&client, "egret-gateway"));
    let t = Instant::now();
    gws.get_mut(&other).unwrap().terminate().expect("SIGTERM the last gateway");
    assert!(!cloud.held_by(other.node_name(), SECOND), "uninstalled: {SECOND} released from {}", other.node_name());
    println!("{tag}: uninstall: {SECOND} released from {} in {} ms", other.node_name(), t.elapsed().as_millis());
    cloud.check_credentials();
    drop(routing);
    for (_, gw) in gws {
        drop(gw);
    }
    cloud.stop();
}

/// Drains `holder` (`egret.dev/drain=true`) while the cloud throttles the
/// first two calls that move the address onto the other gateway: the other
/// gateway takes the Lease, retries with backoff, and serves the address
/// only once the cloud delivers it there; the drained gateway gives the
/// address up. Returns the new holder (the drain is lifted again).
fn drain_with_api_errors(cx: &Cx<'_>, holder: Gw) -> Gw {
    let Cx { tag, rt, client, lab, cloud, routing, .. } = *cx;
    let other = other_than(holder);
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let drain = |on: bool| {
        let value = if on { json!("true") } else { serde_json::Value::Null };
        let patch = json!({"metadata": {"annotations": {"egret.dev/drain": value}}});
        rt.block_on(nodes.patch(holder.node_name(), &PatchParams::default(), &Patch::Merge(&patch))).expect("drain");
    };
    cloud.throttle_moves_onto(other.node_name(), 2);
    let moves_before = routing.moves().len();
    let t = Instant::now();
    drain(true);
    // The address moves (after the throttled attempts), then the pod
    // leaves with it through the new holder.
    let deadline = t + Duration::from_secs(60);
    let moved_at = loop {
        if let Some((at, g)) = routing.moves().get(moves_before) {
            assert_eq!(*g, other, "the address moved to {}", other.node_name());
            break *at;
        }
        assert!(Instant::now() < deadline, "the address never moved after the drain");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE} after the drain: {e}"));
    let took = t.elapsed();
    assert_eq!(cloud.throttled(), 2, "the take-over met the throttling");
    let new_holder = rt.block_on(lease_holder_name(client, IpAddr::V4(PRIVATE)));
    assert_eq!(new_holder.as_deref(), Some(other.node_name()));
    // The drained gateway gives the address up (on AWS only that release
    // removes it: moto ignores AllowReassignment).
    let deadline = Instant::now() + Duration::from_secs(20);
    while cloud.held_by(holder.node_name(), PRIVATE) {
        assert!(Instant::now() < deadline, "the drained {} never released {PRIVATE}", holder.node_name());
        std::thread::sleep(Duration::from_millis(100));
    }
    cloud.check_takeover_requests(other.node_name(), PRIVATE);
    println!(
        "{tag}: drain of {} with 2 moves throttled: delivered to {} after {} ms, db leaves as {seen} after {} ms",
        holder.node_name(),
        other.node_name(),
        moved_at.duration_since(t).as_millis(),
        took.as_millis()
    );
    drain(false);
    other
}

/// The public address the policy uses loses the pool's tag: the next
/// discovery drops it from the pairing, the policy takes the pool's other
/// address (which the holder then gets from the cloud), and the first is
/// released. The lab's node router is then pointed at the new address
/// (what the node agent does on a worker), and the pod leaves with it.
fn retag_out_of_the_pool(cx: &Cx<'_>, holder: Gw) {
    let Cx { tag, rt, client, lab, cloud, pairs, routing } = *cx;
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let t = Instant::now();
    cloud.retag_out(&pairs[0].public);
    let pools: Api<EgressIPPool> = Api::all(client.clone());
    let policies: Api<EgressPolicy> = Api::all(client.clone());
    let deadline = t + RESYNC * 4;
    let second_public = pairs[1].public.clone();
    loop {
        let pool = rt.block_on(pools.get("cloud")).expect("get the pool");
        let paired: Vec<String> =
            pool.status.iter().flat_map(|s| s.cloud_addresses.iter()).map(|a| a.public_ip.clone()).collect();
        let policy = rt.block_on(policies.get("db")).expect("get the policy");
        let ips: Vec<(String, Option<String>)> = policy
            .status
            .iter()
            .flat_map(|s| s.egress_ips.iter())
            .map(|e| (e.ip.clone(), e.public_ip.clone()))
            .collect();
        if paired == [second_public.clone()] && ips == [(SECOND.to_string(), Some(second_public.clone()))] {
            break;
        }
        assert!(Instant::now() < deadline, "after the retag: pool {paired:?}, policy {ips:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let moved = t.elapsed();
    // The first address leaves the holder.
    while cloud.held_by(holder.node_name(), PRIVATE) {
        assert!(Instant::now() < deadline, "{PRIVATE} never released after the retag");
        std::thread::sleep(Duration::from_millis(100));
    }
    let released = t.elapsed();
    // The cloud delivers the second address to the holder: the routing
    // thread sees it on its next look at the cloud, and pins it. That is
    // waited for before the node router uses the address. Read at once
    // after the pod's traffic, it raced: an address not pinned yet is
    // resolved by ARP, which the holder's dataplane answers once it owns
    // the address, so on a busy machine the pod left with it while the
    // thread's calls to the cloud were still under way (CI, stop 58).
    let on = loop {
        let on = routing.moves_of(SECOND).last().map(|m| m.1);
        if on.is_some() || Instant::now() >= deadline {
            break on;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(on, Some(holder), "the second address is delivered to {}", holder.node_name());
    lab.node()
        .ip_batch(&[format!("route replace default via {SECOND} dev lan0 table 111")])
        .expect("point the node router at the new address");
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, SECOND.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {SECOND} after the retag: {e}"));
    println!(
        "{tag}: retag: the policy on {SECOND} ({second_public}) after {} ms, {PRIVATE} released after {} ms; db leaves as {seen}",
        moved.as_millis(),
        released.as_millis()
    );
}

/// Someone moves the address to the other gateway behind Egret's back:
/// the holder's next refresh finds the drift and moves it back, and the
/// pod leaves with the address again.
fn repair_drift(cx: &Cx<'_>, gws: &mut BTreeMap<Gw, Gateway>, holder: Gw) {
    let Cx { tag, lab, cloud, routing, .. } = *cx;
    let other = other_than(holder);
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let moves_before = routing.moves().len();
    let t = Instant::now();
    cloud.move_behind_back(PRIVATE, other.node_name());
    let deadline = t + RESYNC * 4;
    let back = loop {
        let moved = routing.moves();
        if let Some((at, _)) = moved[moves_before..].iter().skip_while(|(_, g)| *g != other).find(|(_, g)| *g == holder)
        {
            break *at;
        }
        assert!(Instant::now() < deadline, "the drift was never repaired: moves {:?}", &moved[moves_before..]);
        std::thread::sleep(Duration::from_millis(50));
    };
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE} after the drift: {e}"));
    // `egret status` shows the sync loop's last report: the repair's count
    // appears with the pass after it (the pod may leave again before).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = gws.get_mut(&holder).unwrap().admin().status().expect("egret status");
        let repairs = status["cluster"]["counters"]["cloud_drift_repairs"].as_u64().unwrap_or(0);
        if repairs >= 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the holder counts its drift repairs: {}", status["cluster"]["counters"]);
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "{tag}: drift: the address moved to {} behind Egret's back (by {} ms), back on {} after {} ms (refresh every {} s); db leaves as {seen}",
        other.node_name(),
        moves_of_other(routing, moves_before, other).map_or(0, |at| at.duration_since(t).as_millis()),
        holder.node_name(),
        back.duration_since(t).as_millis(),
        RESYNC.as_secs()
    );
}

fn moves_of_other(routing: &CloudRouting, from: usize, other: Gw) -> Option<Instant> {
    routing.moves()[from..].iter().find(|(_, g)| *g == other).map(|(t, _)| *t)
}

/// CRDs, the namespace and RBAC, gateway Nodes with their providerIDs, the
/// pods, the cloud pool and the policy taking one address from it. Returns
/// a token of the gateways' ServiceAccount.
async fn setup_cluster(client: &kube::Client, cloud: &dyn CloudLab) -> String {
    install_egret(client).await;
    namespace(client, "team-a", json!({"team": "a"})).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for g in Gw::PAIR {
        let n = serde_json::from_value(json!({
            // The channel's address (no kubelet fills in the InternalIP).
            "metadata": {
                "name": g.node_name(),
                "labels": {"egret.dev/gateway": "true"},
                "annotations": {"egret.dev/ha-address": g.mgmt_addr().to_string()},
            },
            "spec": {"providerID": cloud.provider_id(g.node_name())},
        }))
        .unwrap();
        nodes.create(&PostParams::default(), &n).await.expect("create the gateway Node");
    }
    for p in KPod::ALL {
        pod(client, "team-a", &format!("{}-1", p.name()), json!({"app": p.name()}), &p.addr().to_string()).await;
    }
    let pool: EgressIPPool = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1",
        "kind": "EgressIPPool",
        "metadata": {"name": "cloud"},
        "spec": cloud.pool_spec(),
    }))
    .unwrap();
    Api::<EgressIPPool>::all(client.clone()).create(&PostParams::default(), &pool).await.expect("create the pool");
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1",
        "kind": "EgressPolicy",
        "metadata": {"name": "db"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "namespaceSelector": {"matchLabels": {"team": "a"}},
            "destinations": ["0.0.0.0/0"],
            "pool": {"name": "cloud", "count": 1},
        },
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy).await.expect("create the policy");
    service_account_token(client, "egret-gateway").await
}
