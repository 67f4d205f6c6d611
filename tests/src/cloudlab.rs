//! The cloud labs' per-cloud parts (`tests/tests/k8s_cloud.rs`,
//! `tests/tests/k8s_cloud_nodes.rs`), behind one small adapter so that each
//! lab is written once and run against AWS (moto), Azure (the ARM emulator)
//! and GCP (the Compute emulator). docs/lab.md, "The cloud labs on three
//! clouds".
//!
//! A [`CloudLab`] is one cloud API running in the lab's control namespace,
//! seeded for one [`Layout`]: the two-gateway Kubernetes lab, or the
//! worker-node lab. It knows
//!
//! - what the Nodes' `spec.providerID`s are and what the pool's
//!   `spec.cloud` (and `spec.addresses`) hold;
//! - what the gateway processes need in their environment to reach the
//!   cloud through the provider's **real** credential chain: AWS the SDK's
//!   environment credentials; Azure `azure_identity`'s workload identity
//!   (a service account token in `AZURE_FEDERATED_TOKEN_FILE`, exchanged at
//!   the emulator's Entra ID token endpoint named by `AZURE_AUTHORITY_HOST`);
//!   GCP application default credentials falling back to the metadata server
//!   that `GCE_METADATA_HOST` names (the emulator's). The Azure and GCP
//!   emulators then accept only the tokens they issued;
//! - where the cloud delivers each address **now**, read from the cloud
//!   API (moto's associations and interfaces, the emulators' routing
//!   truth), never from Egret's status: what the labs' emulated routing
//!   follows;
//! - how to inject API errors into a take-over, move an address behind
//!   Egret's back and retag one out of the pool, each as that cloud allows.
//!
//! Where the providers differ, the adapter states the documented
//! behaviour: on GCP the egress IP is the external address itself (the
//! pairing is the identity, [`Pair::public`] equals [`Pair::egress`]); on
//! Azure a move updates the old NIC first, then the new one.

// The adapter's methods are the labs' own steps and checks: a cloud call
// that fails, or a state that is not what the lab expects, is the lab's
// failure, reported where it happens (as in `tests/tests/`).
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::azure_emulator::{self, AzureEmulator};
use crate::faultproxy::{param, Fault, FaultProxy};
use crate::gcp_emulator::{self, GcpEmulator};
use crate::moto::Moto;
use crate::netns::NetNs;
use crate::requirement::Unavailable;

/// The clouds a lab runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    Aws,
    Azure,
    Gcp,
}

impl Provider {
    /// `aws`, `azure`, `gcp` (the pool's `spec.cloud` key).
    pub fn name(self) -> &'static str {
        match self {
            Provider::Aws => "aws",
            Provider::Azure => "azure",
            Provider::Gcp => "gcp",
        }
    }

    /// `Ok(true)` when this cloud's API can run here, `Ok(false)` (after
    /// printing why) when `test` should be skipped, `Err` when the
    /// provider's `EGRET_REQUIRE_*` variable demands it.
    pub fn available_or_skip(self, test: &str) -> Result<bool, Unavailable> {
        match self {
            Provider::Aws => Moto::available_or_skip(test),
            Provider::Azure => AzureEmulator::available_or_skip(test),
            Provider::Gcp => GcpEmulator::available_or_skip(test),
        }
    }

    /// Starts this cloud's API in `control` (the lab's control namespace,
    /// which the calling thread must be in), listening on `address`, and
    /// seeds it for `layout`.
    pub fn start(self, control: &NetNs, address: Ipv4Addr, layout: Layout) -> Arc<dyn CloudLab> {
        match self {
            Provider::Aws => Arc::new(AwsLab::start(control, address, layout)),
            Provider::Azure => Arc::new(AzureLab::start(control, address, layout)),
            Provider::Gcp => Arc::new(GcpLab::start(control, address, layout)),
        }
    }
}

/// A machine of the lab as its cloud knows it: its Node's name and its own
/// address on its network.
#[derive(Clone, Debug)]
pub struct Machine {
    pub node: String,
    pub addr: Ipv4Addr,
}

/// What the cloud is seeded for.
#[derive(Clone, Debug)]
pub enum Layout {
    /// The Kubernetes lab: the gateways in one subnet, the lab's segment
    /// 203.0.113.0/24, at their own addresses; two tagged (labelled) public
    /// addresses and one untagged. Egress IPs [`GATEWAY_EGRESS`].
    Gateways(Vec<Machine>),
    /// The worker-node lab: the workers in a subnet of their own,
    /// [`WORKER_SUBNET`] (the gateways' subnet, [`GATEWAY_SUBNET`], has no
    /// instance: discovery reads it); two tagged public addresses.
    Workers(Vec<Machine>),
}

/// The gateway lab's egress IPs, the pool's first two: what pods are
/// translated to (AWS and Azure: private addresses paired with the public
/// ones; GCP: the external addresses themselves).
pub const GATEWAY_EGRESS: [Ipv4Addr; 2] = [Ipv4Addr::new(203, 0, 113, 40), Ipv4Addr::new(203, 0, 113, 41)];
/// The gateway lab's subnet (the segment).
pub const GATEWAY_LAB_SUBNET: &str = "203.0.113.0/24";
/// The gateway lab pool's private range (AWS and Azure).
pub const GATEWAY_POOL_RANGE: &str = "203.0.113.40-203.0.113.47";
/// The worker-node lab: the gateways' subnet (the pool's; discovery reads it).
pub const GATEWAY_SUBNET: &str = "198.19.64.0/24";
/// The worker-node lab: the workers' subnet, where AWS and Azure choose
/// their private addresses.
pub const WORKER_SUBNET: &str = "198.19.128.0/17";
/// The worker-node lab on GCP: the labelled external addresses (only
/// routed on the lab's upstream router, towards the worker GCP delivers
/// each to).
pub const GCP_NODE_ADDRESSES: [Ipv4Addr; 2] = [Ipv4Addr::new(198, 19, 250, 10), Ipv4Addr::new(198, 19, 250, 11)];

/// The tag (label) the lab's pools select by, per layout.
fn pool_tag(layout: &Layout) -> (&'static str, &'static str) {
    match layout {
        Layout::Gateways(_) => ("egret-pool", "lab"),
        Layout::Workers(_) => ("egret-pool", "nodes"),
    }
}

/// The pool's spec on AWS and Azure, whose pools select public addresses by
/// `tags` in a subnet (`subnetId`); a gateway pool also lists the private
/// range its egress IPs come from.
fn tagged_pool_spec(layout: &Layout, cloud: &str, subnet_id: &str) -> Value {
    let (k, v) = pool_tag(layout);
    let cloud = json!({cloud: {"tags": {k: v}, "subnetId": subnet_id}});
    match layout {
        Layout::Gateways(_) => json!({"cloud": cloud, "addresses": [GATEWAY_POOL_RANGE]}),
        Layout::Workers(_) => json!({"cloud": cloud}),
    }
}

/// The audience of the service account token AKS's workload identity
/// webhook projects (`azure.workload.identity/...`; Azure's documentation,
/// "Service account token volume projection": `api://AzureADTokenExchange`).
pub const AZURE_TOKEN_AUDIENCE: &str = "api://AzureADTokenExchange";

/// A public address of the pool and the egress IP pods are translated to
/// for it (the same address on GCP).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Pair {
    pub public: String,
    pub egress: Ipv4Addr,
}

/// One cloud API in a lab, seeded for a [`Layout`]. Every method may be
/// called from any thread in the lab's control namespace.
pub trait CloudLab: Send + Sync {
    fn provider(&self) -> Provider;

    /// The Node's `spec.providerID` for machine `node`.
    fn provider_id(&self, node: &str) -> String;

    /// The pool's `spec` (its `cloud` section, and `addresses` where the
    /// cloud pairs privately).
    fn pool_spec(&self) -> Value;

    /// What the gateway processes need in their environment: the endpoint
    /// and the credential chain's variables. `token` is a Kubernetes service
    /// account token for [`AZURE_TOKEN_AUDIENCE`] (what AKS projects into a
    /// gateway Pod; only Azure uses it), `dir` a directory to keep files in.
    fn gateway_env(&self, dir: &Path, token: &str) -> Vec<(String, String)>;

    /// The gateway layout's expected pairing, by egress IP.
    fn pairs(&self) -> Vec<Pair>;

    /// Where the cloud delivers each address now (egress IP or worker
    /// address -> the Node of the machine), per the cloud API's own state.
    fn delivered(&self) -> BTreeMap<Ipv4Addr, String>;

    /// Whether machine `node` still holds `addr` in the cloud: AWS an
    /// address of its ENI, Azure an IP configuration of its NIC, GCP a
    /// forwarding rule targeting it.
    fn held_by(&self, node: &str, addr: Ipv4Addr) -> bool;

    /// A piece of the interface ID Egret names for `node` (`egret status`,
    /// `status.allocations[].interfaceId`): the ENI, the NIC's name, the
    /// target instance's name.
    fn interface_mark(&self, node: &str) -> String;

    /// The public addresses the cloud associates with `node` now.
    fn publics_on(&self, node: &str) -> Vec<String>;

    /// Makes the next `times` calls that move an address onto `node` fail
    /// with the cloud's throttling answer: AWS AssociateAddress
    /// (`RequestLimitExceeded`, through the fault proxy), Azure a PUT of the
    /// node's NIC (429 `SubscriptionRequestsThrottled`), GCP a forwarding
    /// rule's insert or setTarget (403 `rateLimitExceeded`).
    fn throttle_moves_onto(&self, node: &str, times: usize);

    /// How many calls the throttling answered.
    fn throttled(&self) -> usize;

    /// Asserts what the take-over onto `node` asked the cloud for.
    fn check_takeover_requests(&self, node: &str, egress: Ipv4Addr);

    /// A mark in the cloud's request log, for [`CloudLab::failover_moves`].
    fn log_mark(&self) -> usize;

    /// The calls that moved `egress` from `from` to `to` since `mark`, in
    /// order, each checked against the provider's documented way: AWS
    /// AssignPrivateIpAddresses and AssociateAddress onto `to`'s ENI; Azure
    /// `from`'s NIC updated without the IP configuration, and only then
    /// `to`'s with it (no reassociation); GCP one `setTarget` (or an insert)
    /// to `to`'s target instance. A line for the lab's output.
    fn failover_moves(&self, mark: usize, from: &str, to: &str, egress: Ipv4Addr) -> String;

    /// Moves `egress` to machine `to` behind Egret's back, as an operator
    /// would with the cloud's own API.
    fn move_behind_back(&self, egress: Ipv4Addr, to: &str);

    /// Retags (relabels) the public address `public` out of the pool.
    fn retag_out(&self, public: &str);

    /// Asserts that the gateways reached the cloud through the credential
    /// chain (tokens issued and accepted; no call refused for its token).
    fn check_credentials(&self);

    /// Stops the cloud API, once every other holder let go (the API is
    /// stopped on drop anyway; this reports a failure to stop it).
    fn stop(self: Arc<Self>);
}

/// Runs `f` until it answers `Some`, or panics with `what` after `timeout`.
fn wait_until<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn dashed(a: Ipv4Addr) -> String {
    a.to_string().replace('.', "-")
}

/// A current-thread runtime driven by a thread of its own: any thread (the
/// lab's routing thread as well as the scenario's) runs futures on it with
/// [`Driver::block_on`], and tasks spawned on it (the fault proxy) keep
/// running between those calls. Its threads are in the namespace of the
/// thread that made it.
struct Driver {
    handle: tokio::runtime::Handle,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Driver {
    fn start() -> Self {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        let handle = rt.handle().clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            rt.block_on(async move {
                while !s.load(std::sync::atomic::Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        });
        Driver { handle, stop, thread: Some(thread) }
    }

    fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.handle.block_on(f)
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------------------ AWS ---

/// moto, with the gateways calling EC2 through a fault proxy.
struct AwsLab {
    moto: Option<Moto>,
    proxy: FaultProxy,
    ec2: aws_sdk_ec2::Client,
    layout: Layout,
    subnet: String,
    /// node -> (instance, primary ENI)
    machines: BTreeMap<String, (String, String)>,
    /// The tagged Elastic IPs (public, allocation), sorted by public address.
    tagged: Vec<(String, String)>,
    /// Last: the fault proxy runs on it.
    rt: Driver,
}

const AWS_ZONE: &str = "us-east-1a";

impl AwsLab {
    fn start(control: &NetNs, address: Ipv4Addr, layout: Layout) -> Self {
        let rt = Driver::start();
        let moto = Moto::start_in(control, IpAddr::V4(address)).expect("start moto in the control namespace");
        let listener = std::net::TcpListener::bind((address, 0)).expect("bind the fault proxy");
        let proxy = {
            let _in = rt.handle.enter();
            FaultProxy::start_on(listener, moto.addr()).expect("start the fault proxy")
        };
        let ec2 = crate::moto::client_for(moto.endpoint());
        let (subnet, machines, tagged) = rt.block_on(Self::seed(&ec2, &layout));
        AwsLab { rt, moto: Some(moto), proxy, ec2, layout, subnet, machines, tagged }
    }

    async fn seed(
        ec2: &aws_sdk_ec2::Client,
        layout: &Layout,
    ) -> (String, BTreeMap<String, (String, String)>, Vec<(String, String)>) {
        use aws_sdk_ec2::types::{AttributeBooleanValue, DomainType, Tag};
        let (vpc_cidr, subnets, machines, gateways, extra) = match layout {
            Layout::Gateways(m) => (GATEWAY_LAB_SUBNET, vec![GATEWAY_LAB_SUBNET], m, true, 1),
            Layout::Workers(m) => ("198.19.0.0/16", vec![GATEWAY_SUBNET, WORKER_SUBNET], m, false, 0),
        };
        let vpc = ec2.create_vpc().cidr_block(vpc_cidr).send().await.expect("CreateVpc");
        let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).unwrap().to_string();
        let mut ids = Vec::new();
        for cidr in subnets {
            let s = ec2
                .create_subnet()
                .vpc_id(&vpc_id)
                .cidr_block(cidr)
                .availability_zone(AWS_ZONE)
                .send()
                .await
                .expect("CreateSubnet");
            ids.push(s.subnet().and_then(|s| s.subnet_id()).unwrap().to_string());
        }
        let images = ec2.describe_images().send().await.expect("DescribeImages");
        let image = images.images().first().and_then(|i| i.image_id()).expect("moto has images").to_string();
        let mut made = BTreeMap::new();
        for m in machines {
            let mut run = ec2.run_instances().image_id(&image).min_count(1).max_count(1).subnet_id(ids.last().unwrap());
            if gateways {
                run = run.private_ip_address(m.addr.to_string());
            }
            let r = run.send().await.expect("RunInstances");
            let i = &r.instances()[0];
            let eni = i.network_interfaces()[0].network_interface_id().unwrap().to_string();
            if gateways {
                ec2.modify_network_interface_attribute()
                    .network_interface_id(&eni)
                    .source_dest_check(AttributeBooleanValue::builder().value(false).build())
                    .send()
                    .await
                    .expect("ModifyNetworkInterfaceAttribute");
            }
            made.insert(m.node.clone(), (i.instance_id().unwrap().to_string(), eni));
        }
        let (k, v) = pool_tag(layout);
        let mut tagged = Vec::new();
        for n in 0..2 + extra {
            let a = ec2.allocate_address().domain(DomainType::Vpc).send().await.expect("AllocateAddress");
            let pair = (a.public_ip().unwrap().to_string(), a.allocation_id().unwrap().to_string());
            if n < 2 {
                ec2.create_tags()
                    .resources(&pair.1)
                    .tags(Tag::builder().key(k).value(v).build())
                    .send()
                    .await
                    .expect("CreateTags");
                tagged.push(pair);
            }
        }
        tagged.sort_by_key(|(p, _)| p.parse::<IpAddr>().unwrap());
        (ids.swap_remove(0), made, tagged)
    }

    fn eni(&self, node: &str) -> &str {
        &self.machines[node].1
    }

    fn node_of_eni(&self, eni: &str) -> Option<String> {
        self.machines.iter().find(|(_, (_, e))| e == eni).map(|(n, _)| n.clone())
    }

    fn associated_eni(&self, allocation: &str) -> Option<String> {
        let r = self.rt.block_on(self.ec2.describe_addresses().allocation_ids(allocation).send()).ok()?;
        r.addresses().first().and_then(|a| a.network_interface_id()).map(str::to_string)
    }

    /// The private addresses moto has on `eni`, the primary one first.
    fn eni_addresses(&self, eni: &str) -> Vec<(Ipv4Addr, bool)> {
        let r = self
            .rt
            .block_on(self.ec2.describe_network_interfaces().network_interface_ids(eni).send())
            .expect("describe the interface");
        let i = r.network_interfaces().first().expect("the interface");
        i.private_ip_addresses()
            .iter()
            .filter_map(|a| Some((a.private_ip_address()?.parse().ok()?, a.primary() == Some(true))))
            .collect()
    }
}

impl CloudLab for AwsLab {
    fn provider(&self) -> Provider {
        Provider::Aws
    }

    fn provider_id(&self, node: &str) -> String {
        format!("aws:///{AWS_ZONE}/{}", self.machines[node].0)
    }

    fn pool_spec(&self) -> Value {
        tagged_pool_spec(&self.layout, "aws", &self.subnet)
    }

    fn gateway_env(&self, _dir: &Path, _token: &str) -> Vec<(String, String)> {
        // The SDK's standard chain, from its environment provider.
        let mut env = self.moto.as_ref().expect("moto runs").gateway_env();
        for (k, v) in &mut env {
            if k == "AWS_ENDPOINT_URL_EC2" {
                *v = self.proxy.url();
            }
        }
        env
    }

    fn pairs(&self) -> Vec<Pair> {
        // Each tagged Elastic IP paired with the lowest free private
        // addresses of the pool's range, in the order of the public ones.
        self.tagged
            .iter()
            .zip(GATEWAY_EGRESS)
            .map(|((public, _), egress)| Pair { public: public.clone(), egress })
            .collect()
    }

    fn delivered(&self) -> BTreeMap<Ipv4Addr, String> {
        match &self.layout {
            // moto keeps a reassigned private address on the old ENI too
            // (it ignores AllowReassignment), so the delivery follows the
            // Elastic IP's association, which it does move.
            Layout::Gateways(_) => self
                .tagged
                .iter()
                .zip(GATEWAY_EGRESS)
                .filter_map(|((_, alloc), egress)| Some((egress, self.node_of_eni(&self.associated_eni(alloc)?)?)))
                .collect(),
            Layout::Workers(_) => self
                .machines
                .iter()
                .flat_map(|(node, (_, eni))| {
                    self.eni_addresses(eni).into_iter().filter(|(_, p)| !p).map(|(a, _)| (a, node.clone()))
                })
                .collect(),
        }
    }

    fn held_by(&self, node: &str, addr: Ipv4Addr) -> bool {
        self.eni_addresses(self.eni(node)).iter().any(|(a, _)| *a == addr)
    }

    fn interface_mark(&self, node: &str) -> String {
        self.eni(node).to_string()
    }

    fn publics_on(&self, node: &str) -> Vec<String> {
        let eni = self.eni(node).to_string();
        self.tagged
            .iter()
            .filter(|(_, alloc)| self.associated_eni(alloc) == Some(eni.clone()))
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn throttle_moves_onto(&self, _node: &str, times: usize) {
        self.proxy.arm("AssociateAddress", Fault::throttled(), times);
    }

    fn throttled(&self) -> usize {
        self.proxy.faults_served("AssociateAddress")
    }

    fn check_takeover_requests(&self, node: &str, egress: Ipv4Addr) {
        // moto ignores both parameters: what the take-over asked for.
        let last = self.proxy.requests("AssociateAddress").pop().expect("AssociateAddress requests");
        assert_eq!(param(&last, "PrivateIpAddress"), Some(egress.to_string().as_str()), "{last:?}");
        assert_eq!(param(&last, "NetworkInterfaceId"), Some(self.eni(node)), "{last:?}");
        let assign = self.proxy.requests("AssignPrivateIpAddresses").pop().expect("AssignPrivateIpAddresses requests");
        assert_eq!(param(&assign, "AllowReassignment"), Some("true"), "{assign:?}");
    }

    fn log_mark(&self) -> usize {
        self.proxy.requests("AssociateAddress").len()
    }

    fn failover_moves(&self, mark: usize, _from: &str, to: &str, egress: Ipv4Addr) -> String {
        let assoc = self.proxy.requests("AssociateAddress");
        let moved: Vec<_> = assoc[mark.min(assoc.len())..]
            .iter()
            .filter(|r| param(r, "NetworkInterfaceId") == Some(self.eni(to)))
            .collect();
        let last = moved.last().expect("AssociateAddress onto the new holder's ENI");
        assert_eq!(param(last, "PrivateIpAddress"), Some(egress.to_string().as_str()), "{last:?}");
        assert_eq!(param(last, "AllowReassociation"), Some("true"), "{last:?}");
        format!(
            "AssignPrivateIpAddresses and AssociateAddress onto {} ({} AssociateAddress)",
            self.eni(to),
            moved.len()
        )
    }

    fn move_behind_back(&self, egress: Ipv4Addr, to: &str) {
        let i = GATEWAY_EGRESS.iter().position(|e| *e == egress).expect("a gateway egress IP");
        self.rt
            .block_on(
                self.ec2
                    .associate_address()
                    .allocation_id(&self.tagged[i].1)
                    .network_interface_id(self.eni(to))
                    .allow_reassociation(true)
                    .send(),
            )
            .expect("move the Elastic IP behind Egret's back");
    }

    fn retag_out(&self, public: &str) {
        let alloc = &self.tagged.iter().find(|(p, _)| p == public).expect("a tagged Elastic IP").1;
        self.rt
            .block_on(crate::moto::set_tags(&self.ec2, alloc, &[("egret-pool", "retired")]))
            .expect("retag the Elastic IP");
    }

    fn check_credentials(&self) {
        // Static keys from the environment (moto accepts any): nothing to
        // prove beyond the calls having been made.
        assert!(self.proxy.forwarded("DescribeAddresses") > 0, "the gateways called EC2");
    }

    fn stop(self: Arc<Self>) {
        if let Ok(mut me) = Arc::try_unwrap(self) {
            if let Some(m) = me.moto.take() {
                m.stop().expect("stop moto");
            }
        }
    }
}

// ---------------------------------------------------------------- Azure ---

/// The ARM emulator (HTTPS, with its Entra ID token endpoint), which accepts
/// only the tokens it issued.
struct AzureLab {
    emu: AzureEmulator,
    layout: Layout,
    subnet_id: String,
    /// node -> (VM id, NIC id, NIC name)
    machines: BTreeMap<String, (String, String, String)>,
    /// The tagged public IPs (address, id), sorted by address.
    tagged: Vec<(String, String)>,
}

/// The lab's own calls to ARM (moving, reading) use this token.
const LAB_TOKEN: &str = "egret-lab-admin";
const AZURE_TENANT: &str = "00000000-0000-4000-8000-0000000000e7";
const AZURE_CLIENT: &str = "00000000-0000-4000-8000-0000000000c1";
const AZURE_API: &str = "2024-05-01";

impl AzureLab {
    fn start(control: &NetNs, address: Ipv4Addr, layout: Layout) -> Self {
        let emu = AzureEmulator::start_in(control, IpAddr::V4(address)).expect("start the ARM emulator in the lab");
        let rg = azure_emulator::RESOURCE_GROUP;
        let (subnets, machines, publics, gateways) = match &layout {
            Layout::Gateways(m) => (
                vec![("gateways", GATEWAY_LAB_SUBNET)],
                m,
                vec![("198.51.100.210", true), ("198.51.100.211", true), ("198.51.100.212", false)],
                true,
            ),
            Layout::Workers(m) => (
                vec![("gateways", GATEWAY_SUBNET), ("workers", WORKER_SUBNET)],
                m,
                vec![("198.51.100.220", true), ("198.51.100.221", true)],
                false,
            ),
        };
        let subnet_of_machines = subnets.last().unwrap().0;
        let subnet_specs: Vec<Value> = subnets.iter().map(|(n, p)| json!({"name": n, "addressPrefix": p})).collect();
        let (k, v) = pool_tag(&layout);
        let pips: Vec<Value> = publics
            .iter()
            .enumerate()
            .map(|(i, (ip, tagged))| {
                let tags = if *tagged { json!({k: v}) } else { json!({}) };
                json!({"resourceGroup": rg, "name": format!("pip-{}", i + 1), "ipAddress": ip, "tags": tags})
            })
            .collect();
        let nics: Vec<Value> = machines
            .iter()
            .map(|m| {
                json!({"resourceGroup": rg, "name": format!("{}-nic", m.node), "enableIPForwarding": gateways,
                       "ipConfigurations": [{"name": "ipconfig1", "subnet": format!("vnet/{subnet_of_machines}"),
                                             "privateIPAddress": m.addr.to_string(), "primary": true}]})
            })
            .collect();
        let vms: Vec<Value> = machines
            .iter()
            .map(|m| json!({"resourceGroup": rg, "name": m.node, "networkInterfaces": [format!("{}-nic", m.node)]}))
            .collect();
        let made = emu
            .seed(&json!({
                "virtualNetworks": [{"resourceGroup": rg, "name": "vnet", "subnets": subnet_specs}],
                "publicIPAddresses": pips,
                "networkInterfaces": nics,
                "virtualMachines": vms,
            }))
            .expect("seed the ARM emulator");
        let id = |kind: &str, name: &str| {
            made[kind][name].as_str().unwrap_or_else(|| panic!("{kind} {name}: {made}")).to_string()
        };
        let subnet_id = id("subnets", "vnet/gateways");
        let machines = machines
            .iter()
            .map(|m| {
                let nic = format!("{}-nic", m.node);
                (m.node.clone(), (id("virtualMachines", &m.node), id("networkInterfaces", &nic), nic))
            })
            .collect();
        let mut tagged: Vec<(String, String)> = publics
            .iter()
            .enumerate()
            .filter(|(_, (_, t))| *t)
            .map(|(i, (ip, _))| (ip.to_string(), id("publicIPAddresses", &format!("pip-{}", i + 1))))
            .collect();
        tagged.sort_by_key(|(p, _)| p.parse::<IpAddr>().unwrap());
        // Only tokens the Entra ID endpoint issued (and the lab's own).
        emu.configure(&json!({"requireIssuedTokens": true, "tokens": [LAB_TOKEN]})).expect("configure the emulator");
        AzureLab { emu, layout, subnet_id, machines, tagged }
    }

    fn nic_id(&self, node: &str) -> &str {
        &self.machines[node].1
    }

    fn node_of_nic(&self, nic: &str) -> Option<String> {
        self.machines.iter().find(|(_, (_, id, _))| id.eq_ignore_ascii_case(nic)).map(|(n, _)| n.clone())
    }

    fn nic_path(&self, node: &str) -> String {
        format!("{}?api-version={AZURE_API}", self.nic_id(node))
    }

    /// A NIC PUT of the lab's own, waited for (its operation's end shows in
    /// the routing truth through `done`).
    fn put_nic(&self, node: &str, nic: &Value, done: impl Fn(&Value) -> bool) {
        let (status, body) =
            self.emu.call("PUT", &self.nic_path(node), Some(nic), Some(LAB_TOKEN)).expect("PUT the NIC");
        assert!(status == 200 || status == 201, "PUT {node}'s NIC: {status} {body}");
        wait_until(&format!("{node}'s NIC updated"), Duration::from_secs(20), || {
            done(&self.emu.routing().expect("the routing truth")).then_some(())
        });
    }

    fn get_nic(&self, node: &str) -> Value {
        let (status, body) = self.emu.call("GET", &self.nic_path(node), None, Some(LAB_TOKEN)).expect("GET the NIC");
        assert_eq!(status, 200, "GET {node}'s NIC: {body}");
        body
    }
}

impl CloudLab for AzureLab {
    fn provider(&self) -> Provider {
        Provider::Azure
    }

    fn provider_id(&self, node: &str) -> String {
        // cloud-provider-azure's form: azure:// and the VM's resource ID.
        format!("azure://{}", self.machines[node].0)
    }

    fn pool_spec(&self) -> Value {
        tagged_pool_spec(&self.layout, "azure", &self.subnet_id)
    }

    fn gateway_env(&self, dir: &Path, token: &str) -> Vec<(String, String)> {
        // What AKS's workload identity webhook gives a labelled Pod, with
        // the authority host and ARM pointed at the emulator.
        let file = dir.join("azure-identity-token");
        std::fs::write(&file, token).expect("write the federated token");
        let endpoint = self.emu.endpoint().to_string();
        [
            ("AZURE_FEDERATED_TOKEN_FILE", file.display().to_string()),
            ("AZURE_CLIENT_ID", AZURE_CLIENT.to_string()),
            ("AZURE_TENANT_ID", AZURE_TENANT.to_string()),
            ("AZURE_AUTHORITY_HOST", endpoint.clone()),
            // controlplane/src/cloud/azure.rs, ENDPOINT_ENV and CA_FILE_ENV.
            ("EGRET_AZURE_ARM_ENDPOINT", endpoint),
            ("EGRET_AZURE_ARM_CA_FILE", self.emu.ca_path().display().to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    fn pairs(&self) -> Vec<Pair> {
        self.tagged
            .iter()
            .zip(GATEWAY_EGRESS)
            .map(|((public, _), egress)| Pair { public: public.clone(), egress })
            .collect()
    }

    fn delivered(&self) -> BTreeMap<Ipv4Addr, String> {
        // Azure delivers a private address to the NIC whose IP
        // configuration holds it (the routing truth, committed state).
        let r = self.emu.routing().expect("the routing truth");
        r["privateIPAddresses"]
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(_, p)| p["primary"] != json!(true))
            .filter_map(|(a, p)| Some((a.parse().ok()?, self.node_of_nic(p["networkInterface"].as_str()?)?)))
            .collect()
    }

    fn held_by(&self, node: &str, addr: Ipv4Addr) -> bool {
        self.emu
            .private_route(IpAddr::V4(addr))
            .expect("the routing truth")
            .is_some_and(|(nic, _)| nic.eq_ignore_ascii_case(self.nic_id(node)))
    }

    fn interface_mark(&self, node: &str) -> String {
        self.machines[node].2.clone()
    }

    fn publics_on(&self, node: &str) -> Vec<String> {
        self.tagged
            .iter()
            .filter(|(p, _)| {
                self.emu
                    .public_route(p.parse().unwrap())
                    .expect("the routing truth")
                    .is_some_and(|(nic, _)| nic.eq_ignore_ascii_case(self.nic_id(node)))
            })
            .map(|(p, _)| p.clone())
            .collect()
    }

    fn throttle_moves_onto(&self, node: &str, times: usize) {
        self.emu
            .fault(&json!({
                "method": "PUT",
                "path": format!("*/networkinterfaces/{}", self.machines[node].2),
                "status": 429,
                "code": "SubscriptionRequestsThrottled",
                "message": "Number of 'write' requests for subscription exceeded (injected by the lab).",
                "retryAfter": 0,
                "times": times,
            }))
            .expect("arm the throttling");
    }

    fn throttled(&self) -> usize {
        self.emu
            .requests()
            .expect("the request log")
            .iter()
            .filter(|r| r["method"] == "PUT" && r["error"] == "SubscriptionRequestsThrottled")
            .count()
    }

    fn check_takeover_requests(&self, node: &str, egress: Ipv4Addr) {
        // The take-over's own NIC update: conditional on the etag it read,
        // adding the IP configuration with the private address and the
        // public IP.
        let puts = self.emu.calls("PUT", &format!("/networkInterfaces/{}", self.machines[node].2)).expect("the log");
        let last = puts.iter().rev().find(|r| r["status"] == 200).expect("a NIC update accepted");
        assert!(
            last["headers"].as_object().is_some_and(|h| h.keys().any(|k| k.eq_ignore_ascii_case("if-match"))),
            "If-Match sent: {last}"
        );
        let configs = last["body"]["properties"]["ipConfigurations"].as_array().cloned().unwrap_or_default();
        let ours = configs
            .iter()
            .find(|c| c["properties"]["privateIPAddress"] == egress.to_string())
            .unwrap_or_else(|| panic!("the update adds {egress}: {last}"));
        assert!(ours["properties"]["publicIPAddress"]["id"].is_string(), "with its public IP: {ours}");
    }

    fn log_mark(&self) -> usize {
        self.emu.requests().expect("the request log").len()
    }

    fn failover_moves(&self, mark: usize, from: &str, to: &str, egress: Ipv4Addr) -> String {
        // The accepted NIC updates since the mark, in order.
        let log = self.emu.requests().expect("the request log");
        let puts: Vec<(String, bool)> = log[mark.min(log.len())..]
            .iter()
            .filter(|r| r["method"] == "PUT" && (r["status"] == 200 || r["status"] == 201))
            .map(|r| {
                let nic = r["path"].as_str().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_string();
                let configs = r["body"]["properties"]["ipConfigurations"].as_array().cloned().unwrap_or_default();
                let has = configs.iter().any(|c| c["properties"]["privateIPAddress"] == egress.to_string());
                (nic, has)
            })
            .collect();
        let (from_nic, to_nic) = (&self.machines[from].2, &self.machines[to].2);
        let cleared = puts.iter().position(|(n, has)| n.eq_ignore_ascii_case(from_nic) && !has);
        let set = puts.iter().position(|(n, has)| n.eq_ignore_ascii_case(to_nic) && *has);
        match (cleared, set) {
            (Some(c), Some(s)) => assert!(c < s, "{from_nic} cleared before {to_nic} set: {puts:?}"),
            _ => panic!("a move is two NIC updates, the old NIC's first: {puts:?}"),
        }
        format!("{from_nic} updated without {egress}, then {to_nic} with it ({} accepted NIC updates)", puts.len())
    }

    fn move_behind_back(&self, egress: Ipv4Addr, to: &str) {
        // Azure has no reassociation: the holder's NIC loses the IP
        // configuration first, then `to`'s NIC gets it.
        let (nic, _) =
            self.emu.private_route(IpAddr::V4(egress)).expect("the routing truth").expect("someone holds it");
        let holder = self.node_of_nic(&nic).expect("a lab machine holds it");
        let mut old = self.get_nic(&holder);
        let configs = old["properties"]["ipConfigurations"].as_array().cloned().unwrap_or_default();
        let moved = configs
            .iter()
            .find(|c| c["properties"]["privateIPAddress"] == egress.to_string())
            .cloned()
            .expect("its IP configuration");
        old["properties"]["ipConfigurations"] =
            json!(configs.into_iter().filter(|c| c["name"] != moved["name"]).collect::<Vec<_>>());
        self.put_nic(&holder, &old, |r| r["privateIPAddresses"].get(egress.to_string()).is_none());
        let mut new = self.get_nic(to);
        let mut config = json!({"name": format!("by-hand-{}", dashed(egress)), "properties": {
            "privateIPAddress": egress.to_string(), "privateIPAllocationMethod": "Static",
            "subnet": moved["properties"]["subnet"].clone(),
            "publicIPAddress": moved["properties"]["publicIPAddress"].clone()}});
        if config["properties"]["publicIPAddress"].is_null() {
            config["properties"].as_object_mut().unwrap().remove("publicIPAddress");
        }
        new["properties"]["ipConfigurations"].as_array_mut().expect("IP configurations").push(config);
        let nic_id = self.nic_id(to).to_string();
        self.put_nic(to, &new, move |r| {
            r["privateIPAddresses"][egress.to_string()]["networkInterface"]
                .as_str()
                .is_some_and(|n| n.eq_ignore_ascii_case(&nic_id))
        });
    }

    fn retag_out(&self, public: &str) {
        let id = &self.tagged.iter().find(|(p, _)| p == public).expect("a tagged public IP").1;
        self.emu.set_tags(id, &[("egret-pool", "retired")]).expect("retag the public IP");
    }

    fn check_credentials(&self) {
        let tokens = self.emu.token_requests().expect("the token log");
        assert!(!tokens.is_empty(), "the gateways asked Entra ID for tokens");
        for t in &tokens {
            assert_eq!(t["status"], 200, "token request: {t}");
            assert_eq!((t["tenant"].as_str(), t["clientId"].as_str()), (Some(AZURE_TENANT), Some(AZURE_CLIENT)), "{t}");
            assert_eq!(t["scope"].as_str(), Some(format!("{}/.default", self.emu.endpoint()).as_str()), "{t}");
        }
        let refused: Vec<Value> =
            self.emu.requests().expect("the log").into_iter().filter(|r| r["status"] == 401).collect();
        assert!(refused.is_empty(), "ARM calls refused for their token: {refused:?}");
        println!(
            "cloudlab: azure: {} Entra ID token requests (workload identity), every ARM call carried an issued token",
            tokens.len()
        );
    }

    fn stop(self: Arc<Self>) {
        if let Ok(me) = Arc::try_unwrap(self) {
            me.emu.stop().expect("stop the ARM emulator");
        }
    }
}

// ------------------------------------------------------------------ GCP ---

/// The Compute emulator with its metadata server, which accepts only the
/// tokens its metadata server issued.
struct GcpLab {
    rt: Driver,
    emu: GcpEmulator,
    layout: Layout,
    /// node -> instance name
    machines: BTreeMap<String, String>,
    /// The labelled addresses (address, name).
    labelled: Vec<(Ipv4Addr, String)>,
}

const GCP_REGION: &str = "us-central1";
const GCP_ZONE: &str = "us-central1-a";

impl GcpLab {
    fn start(control: &NetNs, address: Ipv4Addr, layout: Layout) -> Self {
        let rt = Driver::start();
        let emu = GcpEmulator::start_in(control, IpAddr::V4(address)).expect("start the Compute emulator in the lab");
        // The subnetworks (name, range), the machines, the external
        // addresses (and whether each carries the pool's label).
        let (subnets, machines, addresses) = match &layout {
            Layout::Gateways(m) => (
                vec![("gateways", GATEWAY_LAB_SUBNET)],
                m,
                vec![(GATEWAY_EGRESS[0], true), (GATEWAY_EGRESS[1], true), (Ipv4Addr::new(203, 0, 113, 50), false)],
            ),
            Layout::Workers(m) => (
                vec![("gateways", GATEWAY_SUBNET), ("workers", WORKER_SUBNET)],
                m,
                GCP_NODE_ADDRESSES.iter().map(|a| (*a, true)).collect::<Vec<(Ipv4Addr, bool)>>(),
            ),
        };
        let subnet_of_machines = subnets.last().unwrap().0;
        let (k, v) = pool_tag(&layout);
        let seed = json!({
            "project": gcp_emulator::PROJECT,
            "regions": {GCP_REGION: [GCP_ZONE]},
            "networks": ["lab"],
            "subnetworks": subnets.iter().map(|(n, r)| json!({"name": n, "region": GCP_REGION, "network": "lab", "ipCidrRange": r})).collect::<Vec<_>>(),
            "instances": machines.iter().map(|m| json!({"name": m.node, "zone": GCP_ZONE, "canIpForward": true, "status": "RUNNING",
                "networkInterfaces": [{"subnetwork": subnet_of_machines, "networkIP": m.addr.to_string()}]})).collect::<Vec<_>>(),
            "addresses": addresses.iter().map(|(a, labelled)| json!({"name": format!("egress-{}", dashed(*a)), "region": GCP_REGION,
                "address": a.to_string(), "labels": if *labelled { json!({k: v}) } else { json!({}) }})).collect::<Vec<_>>(),
        });
        rt.block_on(emu.reset(Some(&seed))).expect("seed the Compute emulator");
        // Only the metadata server's tokens (and the lab's own).
        rt.block_on(emu.configure(&json!({"requireIssuedTokens": true, "tokens": [LAB_TOKEN]})))
            .expect("configure the emulator");
        let labelled =
            addresses.iter().filter(|(_, l)| *l).map(|(a, _)| (*a, format!("egress-{}", dashed(*a)))).collect();
        let machines = machines.iter().map(|m| (m.node.clone(), m.node.clone())).collect();
        GcpLab { rt, emu, layout, machines, labelled }
    }

    /// The target instance Egret makes for `node` (ADR 0014, ADR 0033):
    /// `egret-<instance>` for a gateway, `egret-node-<instance>` for a worker.
    fn target_instance(&self, node: &str) -> String {
        match self.layout {
            Layout::Gateways(_) => format!("egret-{}", self.machines[node]),
            Layout::Workers(_) => format!("egret-node-{}", self.machines[node]),
        }
    }

    fn routing(&self) -> Vec<Value> {
        let r = self.rt.block_on(self.emu.routing()).expect("the routing truth");
        r["addresses"].as_array().cloned().unwrap_or_default()
    }

    fn node_of_instance(&self, name: &str) -> Option<String> {
        self.machines.iter().find(|(_, i)| *i == name).map(|(n, _)| n.clone())
    }
}

impl CloudLab for GcpLab {
    fn provider(&self) -> Provider {
        Provider::Gcp
    }

    fn provider_id(&self, node: &str) -> String {
        // cloud-provider-gcp's form: gce://PROJECT/ZONE/NAME.
        format!("gce://{}/{GCP_ZONE}/{}", gcp_emulator::PROJECT, self.machines[node])
    }

    fn pool_spec(&self) -> Value {
        // No spec.addresses on GCP: the external addresses are the egress IPs.
        let (k, v) = pool_tag(&self.layout);
        let subnetwork = format!("projects/{}/regions/{GCP_REGION}/subnetworks/gateways", gcp_emulator::PROJECT);
        json!({"cloud": {"gcp": {"labels": {k: v}, "subnetwork": subnetwork}}})
    }

    fn gateway_env(&self, dir: &Path, _token: &str) -> Vec<(String, String)> {
        // Application default credentials find no file (no
        // GOOGLE_APPLICATION_CREDENTIALS, an empty HOME), so they fall back
        // to the metadata server, which GCE_METADATA_HOST names.
        let home = dir.join("gcp-home");
        std::fs::create_dir_all(&home).expect("an empty HOME");
        let host = self.emu.addr().to_string();
        vec![
            ("GCE_METADATA_HOST".into(), host),
            ("HOME".into(), home.display().to_string()),
            // controlplane/src/cloud/gcp.rs, ENDPOINT_ENV.
            ("EGRET_GCP_COMPUTE_ENDPOINT".into(), self.emu.endpoint().to_string()),
        ]
    }

    fn pairs(&self) -> Vec<Pair> {
        self.labelled.iter().map(|(a, _)| Pair { public: a.to_string(), egress: *a }).collect()
    }

    fn delivered(&self) -> BTreeMap<Ipv4Addr, String> {
        self.routing()
            .iter()
            .filter_map(|e| {
                let node = self.node_of_instance(e["instance"]["name"].as_str()?)?;
                Some((e["address"].as_str()?.parse().ok()?, node))
            })
            .collect()
    }

    fn held_by(&self, node: &str, addr: Ipv4Addr) -> bool {
        self.delivered().get(&addr).is_some_and(|n| n == node)
    }

    fn interface_mark(&self, node: &str) -> String {
        self.target_instance(node)
    }

    fn publics_on(&self, node: &str) -> Vec<String> {
        self.delivered().into_iter().filter(|(_, n)| n == node).map(|(a, _)| a.to_string()).collect()
    }

    fn throttle_moves_onto(&self, _node: &str, times: usize) {
        // A take-over is one forwarding-rule call: setTarget, or insert when
        // the old holder's release deleted the rule first.
        let fault = json!({"method": "POST", "path": "/forwardingRules(/[^/]+/setTarget)?$", "status": 403,
                           "reason": "rateLimitExceeded", "times": times});
        self.rt.block_on(self.emu.arm(&fault)).expect("arm the throttling");
    }

    fn throttled(&self) -> usize {
        let log = self.rt.block_on(self.emu.requests(0)).expect("the request log");
        log.iter()
            .filter(|r| matches!(r["api"].as_str(), Some("forwardingRules.insert" | "forwardingRules.setTarget")))
            .filter(|r| r["status"] == 403)
            .count()
    }

    fn check_takeover_requests(&self, node: &str, egress: Ipv4Addr) {
        // The last accepted move names this gateway's target instance.
        let log = self.rt.block_on(self.emu.requests(0)).expect("the request log");
        let last = log
            .iter()
            .rev()
            .find(|r| {
                matches!(r["api"].as_str(), Some("forwardingRules.insert" | "forwardingRules.setTarget"))
                    && r["status"] == 200
            })
            .expect("a forwarding rule moved");
        let target = last["body"]["target"].as_str().unwrap_or_default();
        assert!(target.ends_with(&format!("/targetInstances/{}", self.target_instance(node))), "{last}");
        let deleted = log.iter().any(|r| r["api"] == "forwardingRules.delete" && r["status"] == 200);
        println!(
            "cloudlab: gcp: the take-over's move: {} (the rule {} by a release before)",
            last["api"].as_str().unwrap_or_default(),
            if deleted { "was deleted" } else { "was not deleted" }
        );
        if last["api"] == "forwardingRules.insert" {
            // The address by IP, or by its resource's URL.
            let named = last["body"]["IPAddress"].as_str().unwrap_or_default();
            let name = self.labelled.iter().find(|(a, _)| *a == egress).map(|(_, n)| n.as_str()).unwrap_or("?");
            assert!(named == egress.to_string() || named.ends_with(&format!("/addresses/{name}")), "{last}");
        } else {
            assert!(last["path"].as_str().unwrap_or_default().contains(&format!("egret-{}", dashed(egress))), "{last}");
        }
    }

    fn log_mark(&self) -> usize {
        let log = self.rt.block_on(self.emu.requests(0)).expect("the request log");
        log.last().and_then(|r| r["seq"].as_u64()).map_or(0, |s| s as usize + 1)
    }

    fn failover_moves(&self, mark: usize, _from: &str, to: &str, egress: Ipv4Addr) -> String {
        let log = self.rt.block_on(self.emu.requests(mark as u64)).expect("the request log");
        let moves: Vec<&Value> = log
            .iter()
            .filter(|r| matches!(r["api"].as_str(), Some("forwardingRules.insert" | "forwardingRules.setTarget")))
            .filter(|r| r["status"] == 200)
            .collect();
        assert_eq!(moves.len(), 1, "one call moves {egress}: {moves:?}");
        let target = moves[0]["body"]["target"].as_str().unwrap_or_default();
        assert!(target.ends_with(&format!("/targetInstances/{}", self.target_instance(to))), "{}", moves[0]);
        format!("one {} to {}", moves[0]["api"].as_str().unwrap_or_default(), self.target_instance(to))
    }

    fn move_behind_back(&self, egress: Ipv4Addr, to: &str) {
        let path = format!(
            "/compute/v1/projects/{}/regions/{GCP_REGION}/forwardingRules/egret-{}/setTarget",
            gcp_emulator::PROJECT,
            dashed(egress)
        );
        let target =
            format!("projects/{}/zones/{GCP_ZONE}/targetInstances/{}", gcp_emulator::PROJECT, self.target_instance(to));
        let a = self
            .rt
            .block_on(self.emu.request_as("POST", &path, Some(&json!({"target": target})), Some(LAB_TOKEN)))
            .expect("setTarget");
        assert_eq!(a.status, 200, "setTarget behind Egret's back: {}", a.body);
        wait_until("the rule retargeted by hand", Duration::from_secs(20), || {
            (self.delivered().get(&egress).map(String::as_str) == Some(to)).then_some(())
        });
    }

    fn retag_out(&self, public: &str) {
        let name = &self.labelled.iter().find(|(a, _)| a.to_string() == public).expect("a labelled address").1;
        self.rt
            .block_on(self.emu.set_labels(GCP_REGION, name, &json!({"egret-pool": "retired"})))
            .expect("relabel the address");
    }

    fn check_credentials(&self) {
        let log = self.rt.block_on(self.emu.requests(0)).expect("the request log");
        let tokens = log.iter().filter(|r| r["api"] == "metadata.token" && r["status"] == 200).count();
        assert!(tokens > 0, "the gateways asked the metadata server for tokens");
        let refused: Vec<&Value> = log.iter().filter(|r| r["status"] == 401).collect();
        assert!(refused.is_empty(), "Compute calls refused for their token: {refused:?}");
        println!("cloudlab: gcp: {tokens} metadata-server token requests, every Compute call carried an issued token");
    }

    fn stop(self: Arc<Self>) {
        if let Ok(GcpLab { rt, emu, .. }) = Arc::try_unwrap(self) {
            emu.stop().expect("stop the Compute emulator");
            drop(rt);
        }
    }
}
