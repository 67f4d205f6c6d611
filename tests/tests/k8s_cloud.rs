//! The cloud lab: the Kubernetes lab's two gateways (`egret_tests::k8slab`)
//! with an AWS Elastic IP pool, against moto's EC2 API (a real emulator of
//! the API, run inside the lab's control namespace next to the API server).
//!
//! - The EC2 side: a VPC and a subnet of the lab's shared segment
//!   (203.0.113.0/24), one instance per gateway whose primary interface has
//!   the gateway's own address, source/destination check off, two Elastic
//!   IPs tagged `egret.dev/pool=lab` and one untagged.
//! - The Kubernetes side: gateway Nodes with `spec.providerID`
//!   (`aws:///us-east-1a/i-...`), an `EgressIPPool` with
//!   `cloud.aws {tags, subnetId}` restricted to 203.0.113.40-47, and the
//!   policy `db` taking one address from it.
//! - The VPC's routing is the one part emulated (moto has no data plane):
//!   a thread reads the Elastic IP's association from moto and pins the
//!   private address's neighbour entry, on the node router and the upstream
//!   router, to the MAC of the gateway whose interface moto names. So only
//!   the gateway the cloud API gave the address to receives its traffic, as
//!   in a VPC; ARP answers play no part (the entries are permanent).
//!
//! - The gateways call EC2 through the fault proxy (`egret_tests::faultproxy`)
//!   next to moto: API errors are injected at the control plane's level,
//!   and every request is recorded (what moto ignores is asserted there).
//!
//! Checked: discovery and pairing (the tagged addresses only, recorded in
//! the pool's status), the Elastic IP associated with the holder's
//! interface before the address is translated to, the pod leaving with the
//! private address that stands for the Elastic IP (the server sees it); a
//! drain of the holder while EC2 throttles two AssociateAddress calls (the
//! other gateway retries and serves the address once it is associated;
//! the drained one releases the private address); the Elastic IP moved to
//! the other gateway behind Egret's back (the holder's next refresh
//! associates it again); a SIGKILL of the holder moves the Lease, the
//! association and the traffic to the other gateway (time measured from
//! the kill to the first new connection seen with the address); the
//! Elastic IP in use retagged out of the pool (the policy moves to the
//! pool's other address and Elastic IP, the first private address is
//! released); no packet
//! with the pod's own address upstream at any time; an uninstall (the
//! gateways' DaemonSet deleted, then the last gateway stopped) releases the
//! private address from its interface.
//!
//! Where moto differs from AWS (docs/kubernetes.md, "Running on AWS"):
//! AssociateAddress ignores `PrivateIpAddress` (the association names the
//! interface's primary address), and AssignPrivateIpAddresses ignores
//! `AllowReassignment` (the old interface keeps the address). So this test
//! reads the association's *interface*, which moto does move, and never
//! the private address moto reports for it; the requests the fault proxy
//! recorded show what the gateways asked for. (Because moto's association
//! names the primary address, the gateways' refresh finds it drifted each
//! time and associates it again: harmless, and counted.)

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_ec2::types::{AttributeBooleanValue, Tag};
use egret_controlplane::k8s::crd::EgressIPPool;
use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture};
use egret_tests::faultproxy::{param, Fault, FaultProxy};
use egret_tests::gateway::Gateway;
use egret_tests::k8slab::{Gw, K8sLab, KPod, CONTROL};
use egret_tests::moto::Moto;
use egret_tests::netns::NetNs;
use egret_tests::plan;
use egret_tests::probe;
use k8s_common::*;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

const NAME: &str = "k8s_cloud_elastic_ip_moves_with_its_lease";
/// The private address the pool's first Elastic IP is paired with: the
/// lowest of the pool's range (the gateways' own .21/.22 are outside it).
const PRIVATE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// The private address the pool's second Elastic IP is paired with.
const SECOND: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 41);
const SUBNET_CIDR: &str = "203.0.113.0/24";
const ZONE: &str = "us-east-1a";
/// The gateways' `kubernetes.resyncPeriod`: how often they ask EC2 again.
const RESYNC: Duration = Duration::from_secs(5);

#[test]
fn k8s_cloud_elastic_ip_moves_with_its_lease() {
    match Moto::available_or_skip(NAME) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    run_in_k8s_lab("k8s-cloud", NAME, &Gw::PAIR, scenario);
}

/// What moto was seeded with.
struct Vpc {
    subnet: String,
    instance: BTreeMap<Gw, String>,
    interface: BTreeMap<Gw, String>,
    /// The tagged Elastic IPs (public address, allocation id), and the untagged one.
    tagged: Vec<(IpAddr, String)>,
    untagged: IpAddr,
}

async fn seed(ec2: &aws_sdk_ec2::Client) -> Vpc {
    let vpc = ec2.create_vpc().cidr_block(SUBNET_CIDR).send().await.expect("CreateVpc");
    let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).unwrap().to_string();
    let subnet = ec2
        .create_subnet()
        .vpc_id(&vpc_id)
        .cidr_block(SUBNET_CIDR)
        .availability_zone(ZONE)
        .send()
        .await
        .expect("CreateSubnet");
    let subnet = subnet.subnet().and_then(|s| s.subnet_id()).unwrap().to_string();
    let images = ec2.describe_images().send().await.expect("DescribeImages");
    let image = images.images().first().and_then(|i| i.image_id()).expect("moto has images").to_string();
    let (mut instance, mut interface) = (BTreeMap::new(), BTreeMap::new());
    for g in Gw::PAIR {
        let r = ec2
            .run_instances()
            .image_id(&image)
            .min_count(1)
            .max_count(1)
            .subnet_id(&subnet)
            .private_ip_address(g.lan_addr().to_string())
            .send()
            .await
            .expect("RunInstances");
        let i = &r.instances()[0];
        let eni = i.network_interfaces()[0].network_interface_id().unwrap().to_string();
        ec2.modify_network_interface_attribute()
            .network_interface_id(&eni)
            .source_dest_check(AttributeBooleanValue::builder().value(false).build())
            .send()
            .await
            .expect("ModifyNetworkInterfaceAttribute");
        instance.insert(g, i.instance_id().unwrap().to_string());
        interface.insert(g, eni);
    }
    let mut eips = Vec::new();
    for _ in 0..3 {
        let a =
            ec2.allocate_address().domain(aws_sdk_ec2::types::DomainType::Vpc).send().await.expect("AllocateAddress");
        eips.push((a.public_ip().unwrap().parse::<IpAddr>().unwrap(), a.allocation_id().unwrap().to_string()));
    }
    for (_, alloc) in &eips[..2] {
        ec2.create_tags()
            .resources(alloc)
            .tags(Tag::builder().key("egret.dev/pool").value("lab").build())
            .send()
            .await
            .expect("CreateTags");
    }
    let untagged = eips[2].0;
    eips.truncate(2);
    eips.sort();
    Vpc { subnet, instance, interface, tagged: eips, untagged }
}

/// The interface moto associates `allocation` with, if any.
async fn associated_interface(ec2: &aws_sdk_ec2::Client, allocation: &str) -> Option<String> {
    let r = ec2.describe_addresses().allocation_ids(allocation).send().await.ok()?;
    r.addresses().first().and_then(|a| a.network_interface_id()).map(str::to_string)
}

/// The private addresses moto has on interface `eni`.
async fn interface_addresses(ec2: &aws_sdk_ec2::Client, eni: &str) -> Vec<String> {
    let r = ec2.describe_network_interfaces().network_interface_ids(eni).send().await.expect("describe the interface");
    let i = r.network_interfaces().first().expect("the interface");
    i.private_ip_addresses().iter().filter_map(|a| a.private_ip_address().map(str::to_string)).collect()
}

/// The emulated VPC routing: `PRIVATE`'s neighbour entry on the node router
/// and the upstream router follows the Elastic IP's association. Records
/// when each move happened.
struct VpcRouting {
    stop: Arc<AtomicBool>,
    moves: Arc<Mutex<Vec<(Instant, Ipv4Addr, Gw)>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl VpcRouting {
    /// Follows each Elastic IP of `follow` (allocation, the private address it stands for).
    fn start(
        lab: &K8sLab,
        endpoint: String,
        follow: Vec<(String, Ipv4Addr)>,
        by_interface: BTreeMap<String, Gw>,
    ) -> VpcRouting {
        let stop = Arc::new(AtomicBool::new(false));
        let moves = Arc::new(Mutex::new(Vec::new()));
        let node = NetNs::existing(lab.node().name()).expect("the node router's namespace");
        let up = NetNs::existing(lab.upstream().name()).expect("the upstream router's namespace");
        let (s, m) = (stop.clone(), moves.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let ec2 = egret_tests::moto::client_for(&endpoint);
            let mut current: BTreeMap<Ipv4Addr, Gw> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                for (allocation, private) in &follow {
                    let now =
                        rt.block_on(associated_interface(&ec2, allocation)).and_then(|i| by_interface.get(&i).copied());
                    if let Some(g) = now.filter(|g| current.get(private) != Some(g)) {
                        let mac = g.mac().iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":");
                        let cmd = format!("neigh replace {private} lladdr {mac} dev lan0 nud permanent");
                        node.ip_batch(std::slice::from_ref(&cmd)).expect("pin the node router's neighbour");
                        up.ip_batch(&[cmd]).expect("pin the upstream router's neighbour");
                        m.lock().unwrap().push((Instant::now(), *private, g));
                        current.insert(*private, g);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        VpcRouting { stop, moves, thread: Some(thread) }
    }

    /// The moves of [`PRIVATE`]'s Elastic IP.
    fn moves(&self) -> Vec<(Instant, Gw)> {
        self.moves_of(PRIVATE)
    }

    fn moves_of(&self, private: Ipv4Addr) -> Vec<(Instant, Gw)> {
        self.moves.lock().unwrap().iter().filter(|(_, p, _)| *p == private).map(|(t, _, g)| (*t, *g)).collect()
    }
}

impl Drop for VpcRouting {
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
    rt: &'a tokio::runtime::Runtime,
    client: &'a kube::Client,
    lab: &'a K8sLab,
    ec2: &'a aws_sdk_ec2::Client,
    vpc: &'a Vpc,
    routing: &'a VpcRouting,
}

fn scenario(lab: &K8sLab, server: &ApiServer) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    // moto next to the API server: the gateways reach both over their
    // management link.
    let moto = Moto::start_in(lab.control(), IpAddr::V4(CONTROL)).expect("start moto in the control namespace");
    let ec2 = moto.client();
    // The gateways call EC2 through a fault proxy next to moto, where API
    // errors are injected and every request is recorded. It runs on a
    // runtime of its own (the scenario's is driven only now and then).
    let proxy_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let listener = lab
        .control()
        .run_in(|| std::net::TcpListener::bind((CONTROL, 0)))
        .expect("enter the control namespace")
        .expect("bind the fault proxy");
    let proxy = {
        let _in_runtime = proxy_rt.enter();
        FaultProxy::start_on(listener, moto.addr()).expect("start the fault proxy")
    };
    let vpc = rt.block_on(seed(&ec2));
    println!(
        "k8s-cloud: moto at {}: subnet {}, tagged {:?}, untagged {}",
        moto.endpoint(),
        vpc.subnet,
        vpc.tagged,
        vpc.untagged
    );

    lab.route_pod_via(KPod::Db, PRIVATE, 111).expect("route db via the private address");
    let token = rt.block_on(setup_cluster(&client, &vpc));
    let kubeconfig = lab.dir().join("gateway.kubeconfig");
    write_token_kubeconfig(server.kubeconfig_path(), "egret-gateway", &token, &kubeconfig);

    let by_interface: BTreeMap<String, Gw> = vpc.interface.iter().map(|(g, i)| (i.clone(), *g)).collect();
    let first = vpc.tagged[0].clone();
    let routing = VpcRouting::start(
        lab,
        moto.endpoint().to_string(),
        vec![(first.1.clone(), PRIVATE), (vpc.tagged[1].1.clone(), SECOND)],
        by_interface.clone(),
    );
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
        cfg.env = moto.gateway_env();
        for (k, v) in &mut cfg.env {
            if k == "AWS_ENDPOINT_URL_EC2" {
                *v = proxy.url();
            }
        }
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
        let p = rt.block_on(pools.get("eips")).expect("get the pool");
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
    let want: Vec<(String, String)> = vec![
        (vpc.tagged[0].0.to_string(), "203.0.113.40".into()),
        (vpc.tagged[1].0.to_string(), "203.0.113.41".into()),
    ];
    assert_eq!(paired, want, "each tagged Elastic IP paired with the lowest free private addresses");
    println!("k8s-cloud: pairing recorded {} ms after the gateways were ready: {paired:?}", t0.elapsed().as_millis());

    // 2. The pod leaves with the private address; the Elastic IP is on the holder's interface.
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let (seen, took) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE}: {e}"));
    let holder = rt
        .block_on(lease_holder_name(&client, IpAddr::V4(PRIVATE)))
        .and_then(|h| Gw::by_node_name(&h))
        .expect("the private address's Lease has a holder");
    let assoc = rt.block_on(associated_interface(&ec2, &first.1));
    assert_eq!(assoc.as_deref(), Some(vpc.interface[&holder].as_str()), "the Elastic IP is on the holder's interface");
    println!(
        "k8s-cloud: steady state: db leaves as {seen} through {} after {} ms",
        holder.node_name(),
        took.as_millis()
    );
    let status = gws.get_mut(&holder).unwrap().admin().status().expect("egret status");
    let row = status["cluster"]["leases"]
        .as_array()
        .and_then(|v| v.iter().find(|l| l["ip"] == PRIVATE.to_string()).cloned())
        .expect("a Lease row for the private address");
    assert_eq!(row["public_ip"], first.0.to_string(), "egret status shows the public address: {row}");
    assert_eq!(row["cloud"], format!("assigned to {}", vpc.interface[&holder]), "egret status: {row}");

    // 3. A drain with EC2 throttling the take-over, then drift repaired.
    let cx = Cx { rt: &rt, client: &client, lab, ec2: &ec2, vpc: &vpc, routing: &routing };
    let holder = drain_with_api_errors(&cx, &proxy, holder);
    repair_drift(&cx, &mut gws, &first.1, holder);

    // 4. SIGKILL of the holder: the Lease, the association and the traffic move.
    let other = if holder == Gw::One { Gw::Two } else { Gw::One };
    // With the channel up and the standby's copy complete (a SIGKILL in
    // the first few hundred ms after the start would be proven only by the
    // Lease's expiry: a different measurement).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !gws[&holder].log_text().contains("the standby holds a complete copy") {
        assert!(Instant::now() < deadline, "{}'s standby has a copy", holder.node_name());
        std::thread::sleep(Duration::from_millis(50));
    }
    let moves_before = routing.moves().len();
    let kill = Instant::now();
    gws.get_mut(&holder).unwrap().kill().expect("SIGKILL the holder");
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE} after the failover: {e}"));
    let outage = kill.elapsed();
    let moved = routing.moves();
    let (moved_at, to) = *moved.get(moves_before).expect("the association moved");
    assert_eq!(to, other, "the Elastic IP moved to the surviving gateway");
    let new_holder = rt.block_on(lease_holder_name(&client, IpAddr::V4(PRIVATE)));
    assert_eq!(new_holder.as_deref(), Some(other.node_name()));
    println!(
        "k8s-cloud: failover: SIGKILL of {} -> association on {} after {} ms -> db leaves as {seen} after {} ms",
        holder.node_name(),
        other.node_name(),
        moved_at.duration_since(kill).as_millis(),
        outage.as_millis()
    );

    // 5. The Elastic IP in use retagged out of the pool: the policy moves to
    // the pool's other address, and the first private address is released.
    retag_out_of_the_pool(&cx, &first.1, other);

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
    // stopped) leaves the private address assigned to no gateway interface.
    let on_other = || rt.block_on(interface_addresses(&ec2, &vpc.interface[&other]));
    assert!(on_other().contains(&SECOND.to_string()), "{} holds {SECOND}: {:?}", other.node_name(), on_other());
    rt.block_on(delete_daemonset(&client, "egret-gateway"));
    let t = Instant::now();
    gws.get_mut(&other).unwrap().terminate().expect("SIGTERM the last gateway");
    let left = on_other();
    assert!(!left.contains(&SECOND.to_string()), "uninstalled: {SECOND} released from {}: {left:?}", other.node_name());
    println!(
        "k8s-cloud: uninstall: {SECOND} released from {} in {} ms",
        vpc.interface[&other],
        t.elapsed().as_millis()
    );
    drop(routing);
    for (_, gw) in gws {
        drop(gw);
    }
    drop(proxy);
    moto.stop().expect("stop moto");
}

/// Drains `holder` (`egret.dev/drain=true`) while EC2 throttles the first
/// two AssociateAddress calls: the other gateway takes the Lease, retries
/// with backoff, and serves the address only once the association is its;
/// the drained gateway releases the private address from its interface
/// (moto ignores `AllowReassignment`, so only that release removes it).
/// Returns the new holder (the drain is lifted again).
fn drain_with_api_errors(cx: &Cx<'_>, proxy: &FaultProxy, holder: Gw) -> Gw {
    let Cx { rt, client, lab, ec2, vpc, routing } = *cx;
    let other = if holder == Gw::One { Gw::Two } else { Gw::One };
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let drain = |on: bool| {
        let value = if on { json!("true") } else { serde_json::Value::Null };
        let patch = json!({"metadata": {"annotations": {"egret.dev/drain": value}}});
        rt.block_on(nodes.patch(holder.node_name(), &PatchParams::default(), &Patch::Merge(&patch))).expect("drain");
    };
    proxy.arm("AssociateAddress", Fault::throttled(), 2);
    let moves_before = routing.moves().len();
    let t = Instant::now();
    drain(true);
    // The association moves (after the throttled attempts), then the pod
    // leaves with the address through the new holder.
    let deadline = t + Duration::from_secs(60);
    let moved_at = loop {
        if let Some((at, g)) = routing.moves().get(moves_before) {
            assert_eq!(*g, other, "the Elastic IP moved to {}", other.node_name());
            break *at;
        }
        assert!(Instant::now() < deadline, "the Elastic IP never moved after the drain");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, PRIVATE.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {PRIVATE} after the drain: {e}"));
    let took = t.elapsed();
    assert_eq!(proxy.faults_served("AssociateAddress"), 2, "the take-over met the throttling");
    let new_holder = rt.block_on(lease_holder_name(client, IpAddr::V4(PRIVATE)));
    assert_eq!(new_holder.as_deref(), Some(other.node_name()));
    // The drained gateway gives the private address up.
    let deadline = Instant::now() + Duration::from_secs(20);
    while rt.block_on(interface_addresses(ec2, &vpc.interface[&holder])).contains(&PRIVATE.to_string()) {
        assert!(Instant::now() < deadline, "the drained {} never released {PRIVATE}", holder.node_name());
        std::thread::sleep(Duration::from_millis(100));
    }
    // What the take-over asked EC2 for (moto ignores both parameters).
    let last = proxy.requests("AssociateAddress").pop().expect("AssociateAddress requests");
    assert_eq!(param(&last, "PrivateIpAddress"), Some(PRIVATE.to_string().as_str()), "{last:?}");
    assert_eq!(param(&last, "NetworkInterfaceId"), Some(vpc.interface[&other].as_str()), "{last:?}");
    let assign = proxy.requests("AssignPrivateIpAddresses").pop().expect("AssignPrivateIpAddresses requests");
    assert_eq!(param(&assign, "AllowReassignment"), Some("true"), "{assign:?}");
    println!(
        "k8s-cloud: drain of {} with 2 AssociateAddress calls throttled: association on {} after {} ms, db leaves as {seen} after {} ms",
        holder.node_name(),
        other.node_name(),
        moved_at.duration_since(t).as_millis(),
        took.as_millis()
    );
    drain(false);
    other
}

/// The Elastic IP the policy uses loses the pool's tag: the next discovery
/// drops it from the pairing, the policy takes the pool's other address
/// (whose Elastic IP the holder associates), and the first private address
/// is released from the holder's interface. The lab's node router is then
/// pointed at the new address (what the node agent does on a worker), and
/// the pod leaves with it.
fn retag_out_of_the_pool(cx: &Cx<'_>, allocation: &str, holder: Gw) {
    let Cx { rt, client, lab, ec2, vpc, routing } = *cx;
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let t = Instant::now();
    rt.block_on(egret_tests::moto::set_tags(ec2, allocation, &[("egret.dev/pool", "retired")]))
        .expect("retag the Elastic IP");
    let pools: Api<EgressIPPool> = Api::all(client.clone());
    let policies: Api<egret_controlplane::k8s::crd::EgressPolicy> = Api::all(client.clone());
    let deadline = t + RESYNC * 4;
    let second_public = vpc.tagged[1].0.to_string();
    loop {
        let pool = rt.block_on(pools.get("eips")).expect("get the pool");
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
    // The first private address leaves the holder's interface.
    while rt.block_on(interface_addresses(ec2, &vpc.interface[&holder])).contains(&PRIVATE.to_string()) {
        assert!(Instant::now() < deadline, "{PRIVATE} never released after the retag");
        std::thread::sleep(Duration::from_millis(100));
    }
    let released = t.elapsed();
    lab.node()
        .ip_batch(&[format!("route replace default via {SECOND} dev lan0 table 111")])
        .expect("point the node router at the new address");
    let (seen, _) = probe::wait_source(lab.pod(KPod::Db), http, SECOND.into(), Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("db never left with {SECOND} after the retag: {e}"));
    let on = routing.moves_of(SECOND).last().map(|m| m.1);
    assert_eq!(on, Some(holder), "the second Elastic IP is on {}'s interface", holder.node_name());
    println!(
        "k8s-cloud: retag: the policy on {SECOND} ({second_public}) after {} ms, {PRIVATE} released after {} ms; db leaves as {seen}",
        moved.as_millis(),
        released.as_millis()
    );
}

/// Someone moves the Elastic IP to the other gateway's interface behind
/// Egret's back: the holder's next refresh finds the drift and associates
/// it again, and the pod leaves with the address again.
fn repair_drift(cx: &Cx<'_>, gws: &mut BTreeMap<Gw, Gateway>, allocation: &str, holder: Gw) {
    let Cx { rt, lab, ec2, vpc, routing, .. } = *cx;
    let other = if holder == Gw::One { Gw::Two } else { Gw::One };
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let moves_before = routing.moves().len();
    rt.block_on(
        ec2.associate_address()
            .allocation_id(allocation)
            .network_interface_id(&vpc.interface[&other])
            .allow_reassociation(true)
            .send(),
    )
    .expect("move the Elastic IP behind Egret's back");
    let t = Instant::now();
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
    let status = gws.get_mut(&holder).unwrap().admin().status().expect("egret status");
    let repairs = status["cluster"]["counters"]["cloud_drift_repairs"].as_u64().unwrap_or(0);
    assert!(repairs >= 1, "the holder counts its drift repairs: {}", status["cluster"]["counters"]);
    println!(
        "k8s-cloud: drift: the Elastic IP moved to {} behind Egret's back, back on {} after {} ms (refresh every {} s); db leaves as {seen}",
        other.node_name(),
        holder.node_name(),
        back.duration_since(t).as_millis(),
        RESYNC.as_secs()
    );
}

/// CRDs, the namespace and RBAC, gateway Nodes with their providerIDs, the
/// pods, the cloud pool and the policy taking one address from it. Returns
/// a token of the gateways' ServiceAccount.
async fn setup_cluster(client: &kube::Client, vpc: &Vpc) -> String {
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
            "spec": {"providerID": format!("aws:///{ZONE}/{}", vpc.instance[&g])},
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
        "metadata": {"name": "eips"},
        "spec": {
            "addresses": ["203.0.113.40-203.0.113.47"],
            "cloud": {"aws": {"tags": {"egret.dev/pool": "lab"}, "subnetId": vpc.subnet}},
        },
    }))
    .unwrap();
    Api::<EgressIPPool>::all(client.clone()).create(&PostParams::default(), &pool).await.expect("create the pool");
    let policy: egret_controlplane::k8s::crd::EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1",
        "kind": "EgressPolicy",
        "metadata": {"name": "db"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "namespaceSelector": {"matchLabels": {"team": "a"}},
            "destinations": ["0.0.0.0/0"],
            "pool": {"name": "eips", "count": 1},
        },
    }))
    .unwrap();
    Api::<egret_controlplane::k8s::crd::EgressPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .expect("create the policy");
    service_account_token(client, "egret-gateway").await
}
