//! Static public IPs on worker nodes (a `PerNode` policy naming a cloud
//! pool, ADR 0033) in the worker-node lab (`egret_tests::nodelab`), run
//! once per cloud (`egret_tests::cloudlab`): two worker Nodes running the
//! real `egret node`, two gateways running the real `egret gateway` in
//! Kubernetes mode against the cloud's API in the lab's control namespace
//! (AWS: moto; Azure: the ARM emulator; GCP: the Compute emulator), next to
//! the real kube-apiserver, through the providers' real credential chains.
//!
//! - The cloud side: the gateways' subnet (the pool's: discovery reads it)
//!   and the workers' subnet (198.19.128.0/17: not the lab segment, as
//!   workers in other subnets than the gateways are, ADR 0031), one instance
//!   (VM) per worker (its Node's `spec.providerID`), two public addresses
//!   tagged (labelled) `egret-pool=nodes`.
//! - The cloud's delivery is the one part emulated: a thread reads from the
//!   cloud API which worker each address is delivered to (AWS: a secondary
//!   address of the worker's ENI; Azure: a secondary IP configuration of its
//!   NIC; GCP: the external address whose forwarding rule targets the
//!   worker's target instance) and routes each, on the upstream router, to
//!   that worker's link address. So an address reaches a worker only while
//!   the cloud has it there.
//!
//! Checked:
//! 1. each worker gets its own address, on its own instance, recorded in
//!    the pool's status with a public address of the pool associated there
//!    (AWS and Azure: a private address the cloud chose in the workers'
//!    subnet, behind the public one; GCP: the external address itself,
//!    ADR 0033); its selected pod leaves with it (the server sees it);
//!    the status writer's `egret status` and `/metrics`
//!    (`egret_cloud_node_address_associated`) list both;
//! 2. both gateways SIGKILLed (a control-plane outage): the pods keep
//!    leaving with their addresses; restarted, the new status writer takes
//!    over from the record (no address added again);
//! 3. w2 leaves the policy's node selection: its address is released, its
//!    record dropped, and its pod leaves as the CNI sends it;
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

use egret_controlplane::k8s::crd::{EgressIPPool, EgressPolicy, PoolAllocation};
use egret_tests::apiserver::ApiServer;
use egret_tests::capture::{self, Capture};
use egret_tests::cloudlab::{CloudLab, Layout, Machine, Provider, AZURE_TOKEN_AUDIENCE, WORKER_SUBNET};
use egret_tests::gateway::{http_get_in, Gateway, METRICS};
use egret_tests::netns::NetNs;
use egret_tests::nodelab::{Backend, NodeGw, NodeLab, Worker, CONTROL};
use egret_tests::probe;
use k8s_common::*;
use kube::api::{Api, DeleteParams, Patch, PatchParams};
use serde_json::json;

/// The gateways' `kubernetes.resyncPeriod`.
const RESYNC: Duration = Duration::from_secs(5);

#[test]
fn k8s_cloud_nodes_aws_get_static_public_ips() {
    cloud_nodes_lab(Provider::Aws, "k8s_cloud_nodes_aws_get_static_public_ips");
}

#[test]
fn k8s_cloud_nodes_azure_get_static_public_ips() {
    cloud_nodes_lab(Provider::Azure, "k8s_cloud_nodes_azure_get_static_public_ips");
}

#[test]
fn k8s_cloud_nodes_gcp_get_static_external_addresses() {
    cloud_nodes_lab(Provider::Gcp, "k8s_cloud_nodes_gcp_get_static_external_addresses");
}

fn cloud_nodes_lab(provider: Provider, name: &'static str) {
    match provider.available_or_skip(name) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    let tag = format!("k8s-cloud-nodes-{}", provider.name());
    run_in_a_lab(
        &tag.clone(),
        name,
        || NodeLab::build_with(&NodeLab::test_prefix(), Backend::Native).expect("build the worker-node lab"),
        NodeLab::control,
        move |lab, server| scenario(provider, &tag, lab, server),
    );
}

/// The worker that a machine of the cloud is.
fn worker(node: &str) -> Option<Worker> {
    Worker::ALL.into_iter().find(|w| w.node_name() == node)
}

/// The emulated delivery: each address the cloud delivers to a worker is
/// routed, on the upstream router, to that worker's link address (and
/// unrouted once the cloud no longer delivers it there).
struct CloudDelivery {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl CloudDelivery {
    fn start(lab: &NodeLab, cloud: Arc<dyn CloudLab>) -> CloudDelivery {
        let stop = Arc::new(AtomicBool::new(false));
        let up = NetNs::existing(lab.upstream().name()).expect("the upstream router's namespace");
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut routed: BTreeMap<Ipv4Addr, Worker> = BTreeMap::new();
            while !s.load(Ordering::Relaxed) {
                let now: BTreeMap<Ipv4Addr, Worker> =
                    cloud.delivered().into_iter().filter_map(|(a, n)| Some((a, worker(&n)?))).collect();
                let mut cmds = Vec::new();
                for (a, w) in now.iter().filter(|(a, w)| routed.get(*a) != Some(*w)) {
                    cmds.push(format!("route replace {a}/32 via {} dev lan0", w.lan_addr()));
                }
                for a in routed.keys().filter(|a| !now.contains_key(*a)) {
                    cmds.push(format!("route del {a}/32"));
                }
                if !cmds.is_empty() {
                    up.ip_batch(&cmds).expect("route the workers' addresses on the upstream router");
                    routed = now;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        CloudDelivery { stop, thread: Some(thread) }
    }
}

impl Drop for CloudDelivery {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the cloud delivers to worker `w` now.
fn delivered_to(cloud: &dyn CloudLab, w: Worker) -> BTreeSet<Ipv4Addr> {
    cloud.delivered().into_iter().filter(|(_, n)| n == w.node_name()).map(|(a, _)| a).collect()
}

/// Both gateways, calling the cloud, refreshing every [`RESYNC`].
fn start_gateways(lab: &NodeLab, kubeconfig: &std::path::Path, env: &[(String, String)]) -> BTreeMap<NodeGw, Gateway> {
    start_node_lab_gateways_with(lab, kubeconfig, |cfg| {
        if let Some(k) = cfg.kubernetes.as_mut() {
            k.extra = format!("  resyncPeriod: {}s\n", RESYNC.as_secs());
        }
        cfg.env = env.to_vec();
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
        let p = rt.block_on(pools.get("node-cloud")).expect("get the pool");
        let a: Vec<PoolAllocation> =
            p.status.map(|s| s.allocations).unwrap_or_default().into_iter().filter(|a| a.node.is_some()).collect();
        if done(&a) {
            return a;
        }
        assert!(Instant::now() < deadline, "{what}: {a:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Each worker's recorded address (once every selected worker has one).
fn private_of(allocations: &[PoolAllocation], w: Worker) -> Option<Ipv4Addr> {
    let a = allocations.iter().find(|a| a.node.as_deref() == Some(w.node_name()))?;
    a.private_ip.as_deref()?.parse().ok()
}

/// Waits until pod `name` leaves as `p`: its agent applies the record a
/// moment after it is written (the pod leaves as the CNI sends it until
/// then, as before any record). The time taken.
fn leaves_as(lab: &NodeLab, name: &str, p: Ipv4Addr) -> Duration {
    let t = Instant::now();
    loop {
        match probe::wait_source(lab.pod(name), NodeLab::http(), p.into(), Duration::from_secs(30)) {
            Ok((_, _)) => return t.elapsed(),
            Err(e) if t.elapsed() < Duration::from_secs(30) && e.contains(" left as ") => {
                std::thread::sleep(Duration::from_millis(100))
            }
            Err(e) => panic!("{name} never left as {p}: {e}"),
        }
    }
}

/// Waits until the cloud delivers nothing to `w` any more; the time taken.
fn wait_released(cloud: &dyn CloudLab, w: Worker, what: &str) -> Duration {
    let t = Instant::now();
    while !delivered_to(cloud, w).is_empty() {
        assert!(t.elapsed() < Duration::from_secs(30), "{what}: {:?}", delivered_to(cloud, w));
        std::thread::sleep(Duration::from_millis(50));
    }
    t.elapsed()
}

fn scenario(provider: Provider, tag: &str, lab: &NodeLab, server: &ApiServer) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    let machines = Worker::ALL
        .iter()
        .enumerate()
        .map(|(i, w)| Machine { node: w.node_name().into(), addr: Ipv4Addr::new(198, 19, 128, 10 + i as u8) })
        .collect();
    let cloud = provider.start(lab.control(), CONTROL, Layout::Workers(machines));
    rt.block_on(setup_cluster(&client, cloud.as_ref()));
    let (gw_kc, node_kc) = rt.block_on(egret_kubeconfigs(&client, server.kubeconfig_path(), lab.dir()));
    let federated = rt.block_on(service_account_token_for(&client, "egret-gateway", &[AZURE_TOKEN_AUDIENCE]));
    let env = cloud.gateway_env(lab.dir(), &federated);
    let delivery = CloudDelivery::start(lab, cloud.clone());
    let capture = Capture::start(lab.upstream(), "lan0").expect("capture the upstream link");
    let mut gws = start_gateways(lab, &gw_kc, &env);
    let t = Instant::now();
    let agents: Vec<_> = Worker::ALL.iter().map(|w| start_synced_agent(lab, *w, &node_kc, &[])).collect();

    // 1. Each worker's own address, on its own instance.
    let a = wait_allocations(&rt, &client, "each worker's address associated and recorded", |a| {
        Worker::ALL.iter().all(|w| private_of(a, *w).is_some())
    });
    let recorded = t.elapsed();
    let worker_subnet: ipnet::IpNet = WORKER_SUBNET.parse().unwrap();
    let mut private = BTreeMap::new();
    for w in Worker::ALL {
        let p = private_of(&a, w).unwrap();
        if provider == Provider::Gcp {
            // The external address itself (protocol forwarding).
            let a = a.iter().find(|x| x.node.as_deref() == Some(w.node_name())).unwrap();
            assert_eq!(a.ips, vec![p.to_string()], "GCP: the Node's address is the external one");
        } else {
            assert!(worker_subnet.contains(&IpAddr::V4(p)), "{p} is in the workers' subnet");
        }
        assert_eq!(
            delivered_to(cloud.as_ref(), w),
            BTreeSet::from([p]),
            "the cloud has {p} on {}, and nothing else",
            w.node_name()
        );
        let alloc = a.iter().find(|x| x.node.as_deref() == Some(w.node_name())).unwrap();
        let mark = cloud.interface_mark(w.node_name()).to_ascii_lowercase();
        let recorded_interface = alloc.interface_id.clone().unwrap_or_default().to_ascii_lowercase();
        assert!(recorded_interface.contains(&mark), "{}'s record names {mark}: {alloc:?}", w.node_name());
        assert_eq!(
            cloud.publics_on(w.node_name()).len(),
            1,
            "a public address of the pool is associated with {}",
            w.node_name()
        );
        let name = format!("{}-uns", w.node_name());
        let took = leaves_as(lab, &name, p);
        println!(
            "{tag}: {name} leaves as {p} (associated and recorded {} ms after the gateways were ready; the pod's first connection as it {} ms after that)",
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
        let mark = cloud.interface_mark(w.node_name()).to_ascii_lowercase();
        assert!(row["interface"].as_str().unwrap_or_default().to_ascii_lowercase().contains(&mark), "{row}");
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
    let gws = start_gateways(lab, &gw_kc, &env);
    std::thread::sleep(RESYNC * 2);
    for w in Worker::ALL {
        assert_eq!(
            delivered_to(cloud.as_ref(), w),
            BTreeSet::from([private[&w]]),
            "nothing added again after the restart"
        );
    }
    let a = wait_allocations(&rt, &client, "the record kept", |a| a.len() == 2);
    assert_eq!(Worker::ALL.map(|w| private_of(&a, w)), Worker::ALL.map(|w| Some(private[&w])));
    println!("{tag}: both gateways SIGKILLed and restarted: the workers kept their addresses");

    // 3. w2 leaves the node selection: released, record dropped.
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    let label = json!({"metadata": {"labels": {"egress": "static"}}});
    rt.block_on(nodes.patch(Worker::One.node_name(), &PatchParams::default(), &Patch::Merge(&label))).unwrap();
    let policies: Api<EgressPolicy> = Api::all(client.clone());
    let only_w1 = json!({"spec": {"nodeSelector": {"matchLabels": {"egress": "static"}}}});
    let t = Instant::now();
    rt.block_on(policies.patch("static-per-node", &PatchParams::default(), &Patch::Merge(&only_w1))).unwrap();
    wait_allocations(&rt, &client, "w2's record dropped", |a| a.len() == 1);
    wait_released(cloud.as_ref(), Worker::Two, "w2's address released");
    println!("{tag}: w2 deselected: its address released {} ms later", t.elapsed().as_millis());
    let (_, _) =
        probe::wait_source(lab.pod("w2-uns"), NodeLab::http(), Worker::Two.lan_addr().into(), Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("w2-uns leaves as its node (the CNI's masquerade): {e}"));
    assert_eq!(
        probe::once(lab.pod("w1-uns"), NodeLab::http()).unwrap().map(|s| s.ip()),
        Ok(IpAddr::V4(private[&Worker::One]))
    );

    // 4. The policy deleted: w1's address is released too.
    let t = Instant::now();
    rt.block_on(policies.delete("static-per-node", &DeleteParams::default())).unwrap();
    wait_released(cloud.as_ref(), Worker::One, "w1's address released once the policy is gone");
    println!("{tag}: the policy deleted: w1's address released {} ms later", t.elapsed().as_millis());

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
    cloud.check_credentials();
    drop(agents);
    drop(gws);
    drop(delivery);
    cloud.stop();
}

/// The cluster of the worker-node lab, the workers' `spec.providerID`s, the
/// cloud pool and the `PerNode` policy selecting the `app=other` pods.
async fn setup_cluster(client: &kube::Client, cloud: &dyn CloudLab) {
    node_lab_cluster(client, "team-a", |pod| if pod.ends_with("-sel") { "db" } else { "other" }).await;
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for w in Worker::ALL {
        let id = json!({"spec": {"providerID": cloud.provider_id(w.node_name())}});
        nodes.patch(w.node_name(), &PatchParams::default(), &Patch::Merge(&id)).await.expect("set the providerID");
    }
    let pool: EgressIPPool = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressIPPool",
        "metadata": {"name": "node-cloud"},
        "spec": cloud.pool_spec(),
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
            "pool": {"name": "node-cloud"}
        }
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&Default::default(), &policy).await.expect("create the policy");
}
