//! Static public IPs on worker nodes (a `PerNode` policy naming an AWS
//! cloud pool, ADR 0033) in the worker-node lab (`egret_tests::nodelab`):
//! two worker Nodes running the real `egret node`, two gateways running the
//! real `egret gateway` in Kubernetes mode against moto's EC2 API (in the
//! lab's control namespace, next to the real kube-apiserver).
//!
//! - The EC2 side: a VPC with the gateways' subnet and the workers' subnet
//!   (198.19.128.0/17: not the lab segment, as workers in other subnets
//!   than the gateways are, ADR 0031), one instance per worker (its Node's
//!   `spec.providerID`), two Elastic IPs tagged `egret.dev/pool=nodes`.
//! - The VPC's delivery is the one part emulated (moto has no data plane):
//!   a thread reads each worker ENI's secondary addresses from moto and
//!   routes each, on the upstream router, to that worker's link address.
//!   So a private address reaches a worker only while EC2 has it on that
//!   worker's interface.
//!
//! Checked:
//! 1. each worker gets its own private address, chosen by EC2 on its own
//!    ENI, recorded in the pool's status with the Elastic IP associated
//!    with that ENI; its selected pod leaves with it (the server sees it);
//!    the status writer's `egret status` and `/metrics`
//!    (`egret_cloud_node_address_associated`) list both;
//! 2. both gateways SIGKILLed (a control-plane outage): the pods keep
//!    leaving with their addresses; restarted, the new status writer takes
//!    over from the record (no address added again);
//! 3. w2 leaves the policy's node selection: its address is released from
//!    its ENI, its record dropped, and its pod leaves as the CNI sends it;
//! 4. the policy deleted: w1's address is released too;
//!
//! and throughout, no packet with a pod's own address upstream.
//!
//! moto answers AssignPrivateIpAddresses with every address of the ENI and
//! ignores AssociateAddress's `PrivateIpAddress` (its association names the
//! ENI's primary address): the association's *interface* is asserted, never
//! its private address, as in `k8s_cloud`.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_ec2::types::Tag;
use egret_controlplane::k8s::crd::{EgressIPPool, EgressPolicy, PoolAllocation};
use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture};
use egret_tests::gateway::{http_get_in, Gateway, METRICS};
use egret_tests::moto::Moto;
use egret_tests::netns::NetNs;
use egret_tests::nodelab::{Backend, NodeGw, NodeLab, Worker, CONTROL};
use egret_tests::probe;
use k8s_common::*;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

const NAME: &str = "k8s_cloud_nodes_get_static_public_ips";
const ZONE: &str = "us-east-1a";
const VPC_CIDR: &str = "198.19.0.0/16";
/// The gateways' subnet (the pool's `subnetId`: discovery reads it).
const GATEWAY_SUBNET: &str = "198.19.64.0/24";
/// The workers' subnet: where EC2 chooses their private addresses.
const WORKER_SUBNET: &str = "198.19.128.0/17";
const TAG: (&str, &str) = ("egret.dev/pool", "nodes");
/// The gateways' `kubernetes.resyncPeriod`.
const RESYNC: Duration = Duration::from_secs(5);

#[test]
fn k8s_cloud_nodes_get_static_public_ips() {
    match Moto::available_or_skip(NAME) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    run_in_a_lab(
        "k8s-cloud-nodes",
        NAME,
        || NodeLab::build_with(&NodeLab::test_prefix(), Backend::Native).expect("build the worker-node lab"),
        NodeLab::control,
        scenario,
    );
}

/// What moto was seeded with.
struct Vpc {
    gateway_subnet: String,
    /// Each worker's instance and primary ENI.
    instance: BTreeMap<Worker, String>,
    interface: BTreeMap<Worker, String>,
    /// The tagged Elastic IPs' allocation ids.
    allocations: Vec<String>,
}

async fn seed(ec2: &aws_sdk_ec2::Client) -> Vpc {
    let vpc = ec2.create_vpc().cidr_block(VPC_CIDR).send().await.expect("CreateVpc");
    let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).unwrap().to_string();
    let mut subnets = Vec::new();
    for cidr in [GATEWAY_SUBNET, WORKER_SUBNET] {
        let s = ec2
            .create_subnet()
            .vpc_id(&vpc_id)
            .cidr_block(cidr)
            .availability_zone(ZONE)
            .send()
            .await
            .expect("CreateSubnet");
        subnets.push(s.subnet().and_then(|s| s.subnet_id()).unwrap().to_string());
    }
    let images = ec2.describe_images().send().await.expect("DescribeImages");
    let image = images.images().first().and_then(|i| i.image_id()).expect("moto has images").to_string();
    let (mut instance, mut interface) = (BTreeMap::new(), BTreeMap::new());
    for w in Worker::ALL {
        let r = ec2
            .run_instances()
            .image_id(&image)
            .min_count(1)
            .max_count(1)
            .subnet_id(&subnets[1])
            .send()
            .await
            .expect("RunInstances");
        let i = &r.instances()[0];
        instance.insert(w, i.instance_id().unwrap().to_string());
        interface.insert(w, i.network_interfaces()[0].network_interface_id().unwrap().to_string());
    }
    let mut allocations = Vec::new();
    for _ in 0..2 {
        let a =
            ec2.allocate_address().domain(aws_sdk_ec2::types::DomainType::Vpc).send().await.expect("AllocateAddress");
        let id = a.allocation_id().unwrap().to_string();
        ec2.create_tags()
            .resources(&id)
            .tags(Tag::builder().key(TAG.0).value(TAG.1).build())
            .send()
            .await
            .expect("CreateTags");
        allocations.push(id);
    }
    Vpc { gateway_subnet: subnets.swap_remove(0), instance, interface, allocations }
}

/// The secondary private addresses moto has on interface `eni`.
async fn secondaries(ec2: &aws_sdk_ec2::Client, eni: &str) -> BTreeSet<Ipv4Addr> {
    let r = ec2.describe_network_interfaces().network_interface_ids(eni).send().await.expect("describe the interface");
    let i = r.network_interfaces().first().expect("the interface");
    i.private_ip_addresses()
        .iter()
        .filter(|a| a.primary() != Some(true))
        .filter_map(|a| a.private_ip_address()?.parse().ok())
        .collect()
}

/// The interface moto associates `allocation` with, if any.
async fn associated_interface(ec2: &aws_sdk_ec2::Client, allocation: &str) -> Option<String> {
    let r = ec2.describe_addresses().allocation_ids(allocation).send().await.ok()?;
    r.addresses().first().and_then(|a| a.network_interface_id()).map(str::to_string)
}

/// The emulated VPC delivery: each worker ENI's secondary addresses routed,
/// on the upstream router, to that worker's link address (and unrouted once
/// EC2 no longer has them there).
struct VpcDelivery {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl VpcDelivery {
    fn start(lab: &NodeLab, endpoint: String, interface: BTreeMap<Worker, String>) -> VpcDelivery {
        let stop = Arc::new(AtomicBool::new(false));
        let up = NetNs::existing(lab.upstream().name()).expect("the upstream router's namespace");
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let ec2 = egret_tests::moto::client_for(&endpoint);
            let mut routed: BTreeMap<Ipv4Addr, Worker> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                let mut now = BTreeMap::new();
                for (w, eni) in &interface {
                    now.extend(rt.block_on(secondaries(&ec2, eni)).into_iter().map(|a| (a, *w)));
                }
                let mut cmds = Vec::new();
                for (a, w) in now.iter().filter(|(a, w)| routed.get(*a) != Some(*w)) {
                    cmds.push(format!("route replace {a}/32 via {} dev lan0", w.lan_addr()));
                }
                for a in routed.keys().filter(|a| !now.contains_key(*a)) {
                    cmds.push(format!("route del {a}/32"));
                }
                if !cmds.is_empty() {
                    up.ip_batch(&cmds).expect("route the workers' private addresses on the upstream router");
                    routed = now;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        VpcDelivery { stop, thread: Some(thread) }
    }
}

impl Drop for VpcDelivery {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Both gateways, calling moto, refreshing every [`RESYNC`].
fn start_gateways(lab: &NodeLab, kubeconfig: &std::path::Path, moto: &Moto) -> BTreeMap<NodeGw, Gateway> {
    start_node_lab_gateways_with(lab, kubeconfig, |cfg| {
        if let Some(k) = cfg.kubernetes.as_mut() {
            k.extra = format!("  resyncPeriod: {}s\n", RESYNC.as_secs());
        }
        cfg.env = moto.gateway_env();
    })
}

/// The pool's `PerNode` allocations once `done` holds for them.
fn wait_allocations(
    rt: &tokio::runtime::Runtime,
    client: &kube::Client,
    what: &str,
    done: impl Fn(&[PoolAllocation]) -> bool,
) -> Vec<PoolAllocation> {
    let pools: Api<EgressIPPool> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let p = rt.block_on(pools.get("node-eips")).expect("get the pool");
        let a: Vec<PoolAllocation> =
            p.status.map(|s| s.allocations).unwrap_or_default().into_iter().filter(|a| a.node.is_some()).collect();
        if done(&a) {
            return a;
        }
        assert!(Instant::now() < deadline, "{what}: {a:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Each worker's recorded private address (once every selected worker has one).
fn private_of(allocations: &[PoolAllocation], w: Worker) -> Option<Ipv4Addr> {
    let a = allocations.iter().find(|a| a.node.as_deref() == Some(w.node_name()))?;
    a.private_ip.as_deref()?.parse().ok()
}

fn scenario(lab: &NodeLab, server: &ApiServer) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    let moto = Moto::start_in(lab.control(), IpAddr::V4(CONTROL)).expect("start moto in the control namespace");
    let ec2 = moto.client();
    let vpc = rt.block_on(seed(&ec2));
    rt.block_on(setup_cluster(&client, &vpc));
    let (gw_kc, node_kc) = rt.block_on(egret_kubeconfigs(&client, server.kubeconfig_path(), lab.dir()));
    let delivery = VpcDelivery::start(lab, moto.endpoint().to_string(), vpc.interface.clone());
    let capture = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");
    let mut gws = start_gateways(lab, &gw_kc, &moto);
    let t = Instant::now();
    let agents: Vec<_> = Worker::ALL.iter().map(|w| start_synced_agent(lab, *w, &node_kc, &[])).collect();

    // 1. Each worker's own address, chosen by EC2 on its own ENI.
    let a = wait_allocations(&rt, &client, "each worker's address associated and recorded", |a| {
        Worker::ALL.iter().all(|w| private_of(a, *w).is_some())
    });
    let recorded = t.elapsed();
    let worker_subnet: ipnet::IpNet = WORKER_SUBNET.parse().unwrap();
    let mut private = BTreeMap::new();
    for w in Worker::ALL {
        let p = private_of(&a, w).unwrap();
        assert!(worker_subnet.contains(&IpAddr::V4(p)), "{p} is in the workers' subnet");
        let on_eni = rt.block_on(secondaries(&ec2, &vpc.interface[&w]));
        assert_eq!(on_eni, BTreeSet::from([p]), "EC2 has {p} on {}'s ENI, and nothing else added", w.node_name());
        let alloc = a.iter().find(|x| x.node.as_deref() == Some(w.node_name())).unwrap();
        assert_eq!(alloc.interface_id.as_deref(), Some(vpc.interface[&w].as_str()));
        let eip = vpc
            .allocations
            .iter()
            .find(|id| rt.block_on(associated_interface(&ec2, id)).as_deref() == Some(vpc.interface[&w].as_str()));
        assert!(eip.is_some(), "an Elastic IP of the pool is associated with {}'s ENI", w.node_name());
        let name = format!("{}-uns", w.node_name());
        let (_, took) = probe::wait_source(lab.pod(&name), NodeLab::http(), p.into(), Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{name} never left as {p}: {e}"));
        println!(
            "k8s-cloud-nodes: {name} leaves as {p} (associated and recorded {} ms after the gateways were ready; the pod's first connection as it {} ms after that)",
            recorded.as_millis(),
            took.as_millis()
        );
        private.insert(w, p);
    }
    assert_ne!(private[&Worker::One], private[&Worker::Two]);
    // `egret status` on the status writer (and only there) lists them.
    let mut listing = Vec::new();
    for (g, gw) in gws.iter_mut() {
        let status = gw.admin().status().expect("egret status");
        let rows = status["cluster"]["cloud_nodes"].as_array().cloned().unwrap_or_default();
        if !rows.is_empty() {
            listing.push((g.node_name(), rows));
        }
    }
    assert_eq!(listing.len(), 1, "one status writer lists the workers' addresses: {listing:?}");
    let writer = NodeGw::by_node_name(listing[0].0).unwrap();
    let (_, metrics) = http_get_in(lab.gateway_ns(writer), METRICS.parse().unwrap(), "/metrics").expect("/metrics");
    for w in Worker::ALL {
        let row = listing[0].1.iter().find(|r| r["node"] == w.node_name()).expect("a row per worker");
        assert_eq!(row["private_ip"], private[&w].to_string(), "{row}");
        assert_eq!(row["interface"], vpc.interface[&w].as_str(), "{row}");
        let sample = format!(
            "egret_cloud_node_address_associated{{node=\"{}\",public_ip=\"{}\"}} 1",
            w.node_name(),
            row["public_ip"].as_str().unwrap()
        );
        assert!(metrics.lines().any(|l| l == sample), "{sample} in the writer's /metrics");
    }

    // 2. A control-plane outage leaves the workers' egress alone; the
    // restarted gateways take over from the record.
    for gw in gws.values_mut() {
        gw.kill().expect("SIGKILL a gateway");
    }
    for w in Worker::ALL {
        let name = format!("{}-uns", w.node_name());
        let seen = probe::once(lab.pod(&name), NodeLab::http()).unwrap().map(|s| s.ip());
        assert_eq!(seen, Ok(IpAddr::V4(private[&w])), "{name} with both gateways down");
    }
    drop(gws);
    let gws = start_gateways(lab, &gw_kc, &moto);
    std::thread::sleep(RESYNC * 2);
    for w in Worker::ALL {
        let on_eni = rt.block_on(secondaries(&ec2, &vpc.interface[&w]));
        assert_eq!(on_eni, BTreeSet::from([private[&w]]), "nothing added again after the restart");
    }
    let a = wait_allocations(&rt, &client, "the record kept", |a| a.len() == 2);
    assert_eq!(Worker::ALL.map(|w| private_of(&a, w)), Worker::ALL.map(|w| Some(private[&w])));
    println!("k8s-cloud-nodes: both gateways SIGKILLed and restarted: the workers kept their addresses");

    // 3. w2 leaves the node selection: released from its ENI, record dropped.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let label = json!({"metadata": {"labels": {"egress": "static"}}});
    rt.block_on(nodes.patch(Worker::One.node_name(), &PatchParams::default(), &Patch::Merge(&label))).unwrap();
    let policies: Api<EgressPolicy> = Api::all(client.clone());
    let only_w1 = json!({"spec": {"nodeSelector": {"matchLabels": {"egress": "static"}}}});
    let t = Instant::now();
    rt.block_on(policies.patch("static-per-node", &PatchParams::default(), &Patch::Merge(&only_w1))).unwrap();
    wait_allocations(&rt, &client, "w2's record dropped", |a| a.len() == 1);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !rt.block_on(secondaries(&ec2, &vpc.interface[&Worker::Two])).is_empty() {
        assert!(Instant::now() < deadline, "w2's private address released from its ENI");
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("k8s-cloud-nodes: w2 deselected: its address released {} ms later", t.elapsed().as_millis());
    let (_, _) =
        probe::wait_source(lab.pod("w2-uns"), NodeLab::http(), Worker::Two.lan_addr().into(), Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("w2-uns leaves as its node (the CNI's masquerade): {e}"));
    assert_eq!(
        probe::once(lab.pod("w1-uns"), NodeLab::http()).unwrap().map(|s| s.ip()),
        Ok(IpAddr::V4(private[&Worker::One]))
    );

    // 4. The policy deleted: w1's address is released too.
    rt.block_on(policies.delete("static-per-node", &DeleteParams::default())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !rt.block_on(secondaries(&ec2, &vpc.interface[&Worker::One])).is_empty() {
        assert!(Instant::now() < deadline, "w1's private address released once the policy is gone");
        std::thread::sleep(Duration::from_millis(100));
    }

    // Never a pod's own address upstream.
    let frames = capture.stop().expect("stop the capture");
    let pods: BTreeSet<IpAddr> =
        Worker::ALL.iter().flat_map(|w| [w.pod_addr(10), w.pod_addr(12)]).map(IpAddr::V4).collect();
    let leaked: Vec<String> = frames
        .iter()
        .filter_map(|f| capture::ip_info(&f.data))
        .filter(|i| pods.contains(&i.src))
        .map(|i| format!("{} -> {}", i.src, i.dst))
        .collect();
    assert!(leaked.is_empty(), "a pod's own address reached the upstream link: {leaked:?}");
    drop(agents);
    drop(gws);
    drop(delivery);
    moto.stop().expect("stop moto");
}

/// The cluster of the worker-node lab, the workers' `spec.providerID`s, the
/// cloud pool and the `PerNode` policy selecting the `app=other` pods.
async fn setup_cluster(client: &kube::Client, vpc: &Vpc) {
    node_lab_cluster(client, "team-a", |pod| if pod.ends_with("-sel") { "db" } else { "other" }).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for w in Worker::ALL {
        let id = json!({"spec": {"providerID": format!("aws:///{ZONE}/{}", vpc.instance[&w])}});
        nodes.patch(w.node_name(), &PatchParams::default(), &Patch::Merge(&id)).await.expect("set the providerID");
    }
    let pool: EgressIPPool = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressIPPool",
        "metadata": {"name": "node-eips"},
        "spec": {"cloud": {"aws": {"tags": {TAG.0: TAG.1}, "subnetId": vpc.gateway_subnet}}},
    }))
    .unwrap();
    Api::<EgressIPPool>::all(client.clone()).create(&Default::default(), &pool).await.expect("create the pool");
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "static-per-node"},
        "spec": {
            "mode": "PerNode",
            "podSelector": {"matchLabels": {"app": "other"}},
            "destinations": ["0.0.0.0/0"],
            "pool": {"name": "node-eips"}
        }
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&Default::default(), &policy).await.expect("create the policy");
}
