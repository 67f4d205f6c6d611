//! The worker-node lab: two worker Nodes running `egret node` (each behind a
//! CNI-style masquerade), two gateways in Kubernetes mode, the external
//! server, and a real API server (docs/lab.md, "The worker-node lab").
//!
//! ```text
//!  w1 pods: sel 198.18.1.10 (app=db)  uns 198.18.1.12     w2 pods: sel 198.18.2.10  uns 198.18.2.12
//!        bridge "pods" 198.18.1.1/24                             bridge "pods" 198.18.2.1/24
//!  ns w1  lan0 203.0.113.5   mgmt 192.0.2.31               ns w2  lan0 203.0.113.6   mgmt 192.0.2.32
//!     flannel's POSTROUTING masquerade (iptables-nft)         kindnet's nft masquerade (srcnat - 10)
//!     and ip-masq-agent's (iptables-nft)                      and Calico's natOutgoing shape (iptables-nft)
//!     main: default via 203.0.113.1, 198.18.2.0/24 via w2    main: default via 203.0.113.1, 198.18.1.0/24 via w1
//!     `egret node` writes: ip rule from <selected pod> lookup <T>; T: default via <egress IP>, throw cluster CIDRs
//!        |
//!  ns lan: bridge "lan", one segment 203.0.113.0/24 (nodes' link = upstream link)
//!        +-- gw-1 lan0 203.0.113.21, gw-2 lan0 203.0.113.22 (one-arm; 198.18.N.0/24 via wN: native routing)
//!        +-- up   lan0 203.0.113.1  srv 198.51.100.1 --- ns srv (the server)   <- captured
//!
//!  ns control: bridge "mgmt" 192.0.2.1/24: etcd + kube-apiserver; gw-1 .11, gw-2 .12, w1 .31, w2 .32
//! ```
//!
//! The masquerade rules are the shapes those CNIs install (WAVE2 notes and
//! their sources: flannel `pkg/trafficmngr/iptables`, kindnet
//! `pkg/masq/masq.go`, ip-masq-agent, Calico `felix/rules/nat.go` with its
//! IPAM-pool ipsets written as the pool CIDR): without the agent, every pod
//! leaves with its node's address.
//!
//! **The CNI variant** ([`NodeLab::build_with_plugins`]): `w1`'s pods are
//! made by the CNI project's reference plugins (Debian's
//! `containernetworking-plugins`, [`crate::cni`]) run through the CNI
//! protocol as a container runtime runs them: bridge `cni0` (198.18.1.1/24,
//! 2001:db8:18:1::1/64, `isGateway`, `ipMasq`, `hairpinMode`), host-local
//! IPAM over `w1`'s pod CIDRs, `portmap` chained after it. `w1` then has no
//! bridge `pods` and none of the hand-written rules above: its masquerade
//! (`CNI-<id>` chains), hairpin and port-mapping rules (`CNI-HOSTPORT-*`)
//! are the plugins' own. `w1-sel` (the first address host-local hands out,
//! 198.18.1.2) has `hostPort` [`HOST_PORT`] -> [`CONTAINER_PORT`]/TCP,
//! `w1-uns` gets the next. `w2` is as above.
//!
//! **The routed variant** ([`NodeLab::build_routed`], issue 30, ADR 0031):
//! the workers sit in subnets of their own behind a router `rt`; the
//! gateways, the upstream router and the egress IPs stay on the segment,
//! now subnet G. A node reaches an egress IP only through `rt`, so `egret
//! node` steers into its VXLAN tunnel (`egret-vxlan`, ADR 0031) towards
//! it. Pod CIDRs stay natively routed (`rt` and the gateways route
//! `198.18.N.0/24` towards `wN`): replies go back without a tunnel. The
//! workers keep their pods, bridge, masquerade rules and management link
//! as above.
//!
//! ```text
//!  ns w1 (pods as above)                    ns w2 (pods as above)
//!   lan0 198.19.1.10 2001:db8:19:1::10       lan0 198.19.2.10 2001:db8:19:2::10
//!   default via 198.19.1.1                   default via 198.19.2.1
//!        | subnet A 198.19.1.0/24                 | subnet B 198.19.2.0/24
//!        +---- a1 --- ns rt (router) --- a2 -----+
//!                      lan0 203.0.113.2 2001:db8:113::2: default via up;
//!                      198.18.N.0/24 (2001:db8:18:N::/64) via wN
//!                        |
//!  ns lan: bridge "lan", subnet G 203.0.113.0/24 (port p-rt: what rt sends into G)
//!        +-- gw-1 .21, gw-2 .22 (one-arm; pods and subnets A, B via rt .2)
//!        +-- up .1 (+ .77, an address no Node has; subnets A, B via rt) --- ns srv
//!  egress IPs .40 / 2001:db8:113::40 (subnet G)
//!  ns control: bridge "mgmt" as above (w1 .31, w2 .32, gw-1 .11, gw-2 .12)
//! ```

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::cluster_net::ClusterNet;
use crate::cni;
use crate::error::{LabError, Result};
use crate::gateway::egret_binary;
use crate::k8slab::{mac, resolve_neighbors, wire_upstream_and_server};
use crate::lab::{remove_stale_test_labs, TEST_PREFIX};
use crate::netns::{self, NetNs};
use crate::plan;
use crate::server::Server;
use crate::sysctl;

/// The upstream router on the segment.
pub const UPSTREAM: Ipv4Addr = plan::UPSTREAM;
/// The control namespace's address (the API server's).
pub const CONTROL: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The API server's Service CIDR.
pub const SERVICE_CIDR: &str = "198.19.0.0/24";
/// Every pod of the cluster.
pub const CLUSTER_POD_CIDR: &str = "198.18.0.0/16";
/// Every pod of the cluster, IPv6.
pub const CLUSTER_POD_CIDR6: &str = "2001:db8:18::/48";
/// The upstream router on the segment, IPv6.
pub const UPSTREAM6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 1);
/// The CNI variant: the worker whose pods the plugins make.
pub const PLUGIN_WORKER: Worker = Worker::One;
/// The CNI variant: the network's name (the configuration list's `name`).
pub const CNI_NETWORK: &str = "egret-lab";
/// The CNI variant: the bridge plugin's bridge.
pub const CNI_BRIDGE: &str = "cni0";
/// The CNI variant: the Kubernetes namespace of the lab's pods (`K8S_POD_NAMESPACE`).
pub const POD_NAMESPACE: &str = "team-a";
/// The CNI variant: `w1-sel`'s `hostPort` (TCP) ...
pub const HOST_PORT: u16 = 30080;
/// ... and the pod's port it maps to.
pub const CONTAINER_PORT: u16 = 8080;

/// The routed variant: the router's address in subnet G (the segment).
pub const ROUTER_G: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// The routed variant: the router's MAC in subnet G.
pub const ROUTER_G_MAC: [u8; 6] = [0x02, 0xe9, 0, 0, 0x03, 0x01];
/// The routed variant: an address in subnet G that no Node has (on the
/// upstream router's `lan0`), a forger's.
pub const STRANGER_G: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 77);

/// The routed variant: the router's IPv6 address in subnet G.
pub fn router_g6() -> Ipv6Addr {
    segment6(2)
}

/// The routed variant: [`STRANGER_G`]'s IPv6 twin.
pub fn stranger_g6() -> Ipv6Addr {
    segment6(0x77)
}

/// Whether this kernel makes a metadata-collecting VXLAN device on UDP
/// port 6082, as `egret node` does on a routed worker (ADR 0031, built as
/// VXLAN: d130dcc): tried in a scratch namespace, deleted after. `Err` says
/// why not (a kernel built without `CONFIG_VXLAN` answers "Unknown device
/// type").
pub fn tunnel_available() -> std::result::Result<(), String> {
    let ns = NetNs::create(&format!("{TEST_PREFIX}{}xt", std::process::id())).map_err(|e| e.to_string())?;
    ns.ip(&["link", "add", "egret-probe", "type", "vxlan", "external", "dstport", "6082", "nolearning"])
        .map(|_| ())
        .map_err(|e| format!("this kernel ({}) makes no VXLAN device (CONFIG_VXLAN): {e}", kernel_release()))
}

/// `uname -r`'s answer, from /proc.
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Where the workers sit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Subnets {
    /// On the gateways' segment (the worker-node lab).
    Shared,
    /// Each in a subnet of its own behind router `rt` (the routed variant).
    Routed,
}

/// The segment's IPv6 address with interface identifier `host`.
pub fn segment6(host: u16) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, host)
}

/// How the nodes reach each other's pods (and the gateways reach the pods).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Pod CIDRs routed via their node on the shared segment (Calico BGP,
    /// cloud VPC CNIs).
    Native,
    /// flannel's vxlan backend: device `flannel.1` (VNI 1, UDP 8472) on every
    /// node and gateway; per remote node a route `podCIDR via podCIDR.0 dev
    /// flannel.1 onlink`, a permanent neighbour `podCIDR.0 -> its VTEP MAC`
    /// and an FDB entry `VTEP MAC -> its segment address`. The gateways'
    /// replies to pods then leave through a tunnel Egret does not drive.
    /// IPv4 only (flannel's IPv6 uses a second device); IPv6 stays native.
    Vxlan,
}

/// flannel's device, VNI and port.
pub const VXLAN_DEVICE: &str = "flannel.1";

/// A host of the overlay: (segment address, VTEP MAC, pod CIDR's first three octets).
fn vtep_hosts() -> Vec<(Ipv4Addr, [u8; 6], [u8; 3])> {
    let mut v: Vec<(Ipv4Addr, [u8; 6], [u8; 3])> =
        Worker::ALL.iter().map(|w| (w.lan_addr(), [0x02, 0xf1, 0, 0, 0, w.n()], [198, 18, w.n()])).collect();
    v.extend(NodeGw::ALL.iter().map(|g| (g.lan_addr(), [0x02, 0xf1, 0, 0, 0, 20 + g.n()], [198, 18, 20 + g.n()])));
    v
}

/// A worker Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Worker {
    /// `w1`: flannel's and ip-masq-agent's masquerade.
    One,
    /// `w2`: kindnet's and Calico's masquerade.
    Two,
}

impl Worker {
    /// Both.
    pub const ALL: [Worker; 2] = [Worker::One, Worker::Two];

    fn n(self) -> u8 {
        match self {
            Worker::One => 1,
            Worker::Two => 2,
        }
    }

    /// The Node name.
    pub fn node_name(self) -> &'static str {
        match self {
            Worker::One => "w1",
            Worker::Two => "w2",
        }
    }

    /// The other one.
    pub fn other(self) -> Worker {
        match self {
            Worker::One => Worker::Two,
            Worker::Two => Worker::One,
        }
    }

    /// Its address on the segment (what its masquerade rewrites to).
    pub fn lan_addr(self) -> Ipv4Addr {
        Ipv4Addr::new(203, 0, 113, 4 + self.n())
    }

    /// Its IPv6 address on the segment.
    pub fn lan_addr6(self) -> Ipv6Addr {
        segment6(4 + u16::from(self.n()))
    }

    /// Its IPv6 pod prefix (a /64).
    pub fn pod_cidr6(self) -> String {
        format!("2001:db8:18:{}::/64", self.n())
    }

    /// An IPv6 pod address on it.
    pub fn pod_addr6(self, host: u8) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x18, u16::from(self.n()), 0, 0, 0, u16::from(host))
    }

    /// Its management address (it reaches the API server there).
    pub fn mgmt_addr(self) -> Ipv4Addr {
        Ipv4Addr::new(192, 0, 2, 30 + self.n())
    }

    /// The routed variant: its address in its own subnet (198.19.N.10/24).
    pub fn routed_addr(self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.n(), 10)
    }

    /// The routed variant: its IPv6 address in its own subnet.
    pub fn routed_addr6(self) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x19, u16::from(self.n()), 0, 0, 0, 0x10)
    }

    /// The routed variant: the router's address in its subnet (its default route).
    pub fn routed_gateway(self) -> Ipv4Addr {
        Ipv4Addr::new(198, 19, self.n(), 1)
    }

    /// The routed variant: the router's IPv6 address in its subnet.
    pub fn routed_gateway6(self) -> Ipv6Addr {
        Ipv6Addr::new(0x2001, 0xdb8, 0x19, u16::from(self.n()), 0, 0, 0, 1)
    }

    /// The routed variant: its subnet.
    pub fn routed_subnet(self) -> String {
        format!("198.19.{}.0/24", self.n())
    }

    /// The routed variant: its IPv6 subnet.
    pub fn routed_subnet6(self) -> String {
        format!("2001:db8:19:{}::/64", self.n())
    }

    /// Its pod CIDR (`spec.podCIDRs`).
    pub fn pod_cidr(self) -> String {
        format!("198.18.{}.0/24", self.n())
    }

    /// Its pod bridge's address (the pods' default gateway).
    pub fn pod_gateway(self) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.n(), 1)
    }

    /// A pod address on it.
    pub fn pod_addr(self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(198, 18, self.n(), host)
    }
}

/// One of the two gateways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NodeGw {
    /// `gw-1`.
    One,
    /// `gw-2`.
    Two,
}

impl NodeGw {
    /// Both.
    pub const ALL: [NodeGw; 2] = [NodeGw::One, NodeGw::Two];

    fn n(self) -> u8 {
        match self {
            NodeGw::One => 1,
            NodeGw::Two => 2,
        }
    }

    /// The Node name.
    pub fn node_name(self) -> &'static str {
        match self {
            NodeGw::One => "gw-1",
            NodeGw::Two => "gw-2",
        }
    }

    /// The gateway called `name`.
    pub fn by_node_name(name: &str) -> Option<NodeGw> {
        NodeGw::ALL.into_iter().find(|g| g.node_name() == name)
    }

    /// Its address on the segment.
    pub fn lan_addr(self) -> Ipv4Addr {
        Ipv4Addr::new(203, 0, 113, 20 + self.n())
    }

    /// Its IPv6 address on the segment.
    pub fn lan_addr6(self) -> Ipv6Addr {
        segment6(20 + u16::from(self.n()))
    }

    /// Its MAC on the segment.
    pub fn mac(self) -> [u8; 6] {
        [0x02, 0xe9, 0, 0, 0x02, self.n()]
    }

    pub fn mgmt_addr(self) -> Ipv4Addr {
        Ipv4Addr::new(192, 0, 2, 10 + self.n())
    }
}

/// A pod of the lab with its own namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LabPod {
    /// Its node.
    pub worker: Worker,
    /// Its name (also the namespace's role).
    pub name: String,
    /// Its address.
    pub addr: Ipv4Addr,
}

/// A running `egret node` in a worker's namespace. Dropping it kills it.
#[derive(Debug)]
pub struct Agent {
    child: Option<Child>,
    /// Its status file.
    pub status_file: PathBuf,
    /// Its log.
    pub log: PathBuf,
}

impl Agent {
    /// The pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM (as the kubelet stops a pod), then waits at most `timeout`
    /// for the exit; SIGKILL after that.
    pub fn terminate(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let pid = self.pid().ok_or_else(|| LabError::Gateway("egret node is not running".into()))?;
        netns::run(Command::new("kill").arg("-TERM").arg(pid.to_string()))?;
        self.wait_exit(timeout)
    }

    /// Waits at most `timeout` for the process to exit by itself; SIGKILL
    /// after that.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let mut c = self.child.take().ok_or_else(|| LabError::Gateway("egret node is not running".into()))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = c.try_wait().map_err(|e| LabError::io("wait for egret node", e))? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return Err(LabError::Gateway(format!("egret node still running after {timeout:?}")));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The status file as JSON (`egret node status --json`'s content).
    pub fn status(&self) -> Option<serde_json::Value> {
        std::fs::read(&self.status_file).ok().and_then(|b| serde_json::from_slice(&b).ok())
    }

    /// Waits until this process has written a status with at least one
    /// pass after `after_syncs` passes.
    pub fn wait_synced(&self, after_syncs: u64, timeout: Duration) -> Result<serde_json::Value> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.status() {
                let mine = s["pid"].as_u64() == self.pid().map(u64::from);
                if mine && s["syncs"].as_u64().unwrap_or(0) > after_syncs {
                    return Ok(s);
                }
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(LabError::Timeout {
                    what: format!("egret node to sync ({}); log:\n{log}", self.status_file.display()),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The CNI variant's state: the worker whose pods the plugins make, the
/// configuration list, and each lab pod's attachment.
#[derive(Debug)]
struct Plugins {
    worker: Worker,
    list: cni::NetworkList,
    attachments: BTreeMap<String, cni::Attachment>,
}

/// A running worker-node lab; dropping it ends every process in its
/// namespaces and deletes them.
#[derive(Debug)]
pub struct NodeLab {
    server: Option<Server>,
    prefix: String,
    pods: BTreeMap<String, (LabPod, NetNs)>,
    workers: BTreeMap<Worker, NetNs>,
    gws: BTreeMap<NodeGw, NetNs>,
    net: ClusterNet,
    backend: Backend,
    plugins: Option<Plugins>,
    subnets: Subnets,
    /// The routed variant's router.
    router: Option<NetNs>,
}

/// `iptables` or `ip6tables` (Debian's iptables-nft) with `rule`'s words.
fn iptables(ns: &NetNs, program: &str, rule: &str) -> Result<()> {
    let mut cmd = if program == "ip6tables" { ns.command("ip6tables") } else { ns.command("iptables") };
    cmd.args(rule.split_whitespace());
    netns::run(&mut cmd).map(|_| ())
}

/// A router's sysctls here: IPv6 forwarding too (this lab is dual-stack).
const ROUTER: [&[&str]; 2] = [&sysctl::ROUTER, &sysctl::FORWARD6];

impl NodeLab {
    /// A unique namespace prefix: `eglab<pid>xn<n>`.
    pub fn test_prefix() -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        format!("{TEST_PREFIX}{}xn{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
    }

    /// Builds the topology with the CNI masquerade rules and starts the
    /// external server; the pods are `wN-sel` (198.18.N.10) and `wN-uns`
    /// (198.18.N.12) on each worker, and `w2-new` (198.18.2.20). Native
    /// routing; [`NodeLab::build_with`] for the overlay.
    pub fn build(prefix: &str) -> Result<Self> {
        Self::build_with(prefix, Backend::Native)
    }

    /// [`NodeLab::build`] with the pods reached through `backend`.
    pub fn build_with(prefix: &str, backend: Backend) -> Result<Self> {
        Self::build_inner(prefix, backend, None, Subnets::Shared)
    }

    /// The routed variant (see the module doc): the workers in subnets of
    /// their own behind router `rt`, the gateways in subnet G. Native
    /// routing of the pod CIDRs.
    pub fn build_routed(prefix: &str) -> Result<Self> {
        Self::build_inner(prefix, Backend::Native, None, Subnets::Routed)
    }

    /// The CNI variant (see the module doc): [`NodeLab::build`] with
    /// [`PLUGIN_WORKER`]'s pods made by the CNI plugins. Fails naming the
    /// package when the plugins are not installed.
    pub fn build_with_plugins(prefix: &str) -> Result<Self> {
        cni::require_plugins()?;
        Self::build_inner(prefix, Backend::Native, Some(PLUGIN_WORKER), Subnets::Shared)
    }

    fn build_inner(prefix: &str, backend: Backend, plugin_worker: Option<Worker>, subnets: Subnets) -> Result<Self> {
        if subnets == Subnets::Routed && (backend != Backend::Native || plugin_worker.is_some()) {
            return Err(LabError::Gateway("the routed worker-node lab is built with native routing only".into()));
        }
        remove_stale_test_labs();
        let ns = |role: &str| NetNs::create(&format!("{prefix}-{role}"));
        let mut workers = BTreeMap::new();
        for w in Worker::ALL {
            workers.insert(w, ns(w.node_name())?);
        }
        let mut gws = BTreeMap::new();
        for g in NodeGw::ALL {
            gws.insert(g, ns(&format!("g{}", g.n()))?);
        }
        let router = if subnets == Subnets::Routed { Some(ns("rt")?) } else { None };
        let net = ClusterNet::create(prefix, "nodelab")?;
        let mut lab = Self {
            server: None,
            prefix: prefix.to_string(),
            pods: BTreeMap::new(),
            workers,
            gws,
            net,
            backend,
            plugins: None,
            subnets,
            router,
        };
        if let Some(worker) = plugin_worker {
            lab.plugins = Some(lab.plugin_network(worker)?);
        }
        if subnets == Subnets::Routed {
            lab.wire_routed()?;
        } else {
            lab.wire()?;
        }
        if backend == Backend::Vxlan {
            lab.overlay()?;
        }
        for w in Worker::ALL {
            if lab.by_plugins(w) {
                lab.add_plugin_pod(
                    w,
                    &format!("{}-sel", w.node_name()),
                    &[cni::PortMapping::tcp(HOST_PORT, CONTAINER_PORT)],
                )?;
                lab.add_plugin_pod(w, &format!("{}-uns", w.node_name()), &[])?;
                continue;
            }
            lab.add_pod(w, &format!("{}-sel", w.node_name()), w.pod_addr(10))?;
            lab.add_pod(w, &format!("{}-uns", w.node_name()), w.pod_addr(12))?;
        }
        // A pod the API server does not know yet (strict mode's test).
        lab.add_pod(Worker::Two, "w2-new", Worker::Two.pod_addr(20))?;
        lab.masquerade()?;
        let gws: Vec<&NetNs> = lab.gws.values().collect();
        if let Some(rt) = &lab.router {
            // The gateways' next hops (the upstream router, `rt` towards the
            // pods), and `rt`'s (the workers, the upstream router).
            let hops = [IpAddr::V4(UPSTREAM), IpAddr::V4(ROUTER_G), IpAddr::V6(UPSTREAM6), IpAddr::V6(router_g6())];
            resolve_neighbors(&gws, &hops)?;
            let mut hops: Vec<IpAddr> = Worker::ALL.map(|w| IpAddr::V4(w.routed_addr())).to_vec();
            hops.extend(Worker::ALL.map(|w| IpAddr::V6(w.routed_addr6())));
            hops.extend([IpAddr::V4(UPSTREAM), IpAddr::V6(UPSTREAM6)]);
            resolve_neighbors(&[rt], &hops)?;
        } else {
            let mut hops: Vec<IpAddr> =
                [UPSTREAM].into_iter().chain(Worker::ALL.map(Worker::lan_addr)).map(IpAddr::V4).collect();
            hops.extend([UPSTREAM6].into_iter().chain(Worker::ALL.map(Worker::lan_addr6)).map(IpAddr::V6));
            resolve_neighbors(&gws, &hops)?;
        }
        lab.server = Some(Server::start(&lab.net.srv, None)?);
        Ok(lab)
    }

    fn wire(&self) -> Result<()> {
        for ns in self.workers.values().chain(self.gws.values()) {
            sysctl::set(ns, &[&[&sysctl::COMMON[..]], &ROUTER[..]].concat())?;
        }
        self.net.wire_bridges(&ROUTER)?;
        for (w, ns) in &self.workers {
            self.net.lan_port(ns, &format!("p-{}", w.node_name()), None)?;
            self.net.mgmt_port(ns, &format!("m-{}", w.node_name()), w.mgmt_addr())?;
            // The CNI variant's worker: its bridge is the bridge plugin's.
            if !self.by_plugins(*w) {
                ns.ip_batch(&[
                    "link add pods type bridge mcast_snooping 0".into(),
                    "link set dev pods up".into(),
                    format!("addr add {}/24 dev pods", w.pod_gateway()),
                    format!("addr add {}/64 dev pods nodad", w.pod_addr6(1)),
                ])?;
            }
            ns.ip_batch(&[
                format!("addr add {}/24 dev lan0", w.lan_addr()),
                format!("addr add {}/64 dev lan0 nodad", w.lan_addr6()),
                "link set dev lan0 up".into(),
                format!("route add default via {UPSTREAM}"),
                format!("route add ::/0 via {UPSTREAM6}"),
                // Native routing: the other node's pods via that node.
                format!("route add {} via {}", w.other().pod_cidr6(), w.other().lan_addr6()),
            ])?;
            if self.backend == Backend::Native {
                ns.ip_batch(&[format!("route add {} via {}", w.other().pod_cidr(), w.other().lan_addr())])?;
            }
        }
        for (g, ns) in &self.gws {
            self.net.lan_port(ns, &format!("p-g{}", g.n()), Some(g.mac()))?;
            self.net.mgmt_port(ns, &format!("m-g{}", g.n()), g.mgmt_addr())?;
            let mut cmds = vec![
                format!("addr add {}/24 dev lan0", g.lan_addr()),
                format!("addr add {}/64 dev lan0 nodad", g.lan_addr6()),
                "link set dev lan0 up".into(),
                format!("route add default via {UPSTREAM}"),
                format!("route add ::/0 via {UPSTREAM6}"),
            ];
            for w in Worker::ALL {
                if self.backend == Backend::Native {
                    cmds.push(format!("route add {} via {}", w.pod_cidr(), w.lan_addr()));
                }
                cmds.push(format!("route add {} via {}", w.pod_cidr6(), w.lan_addr6()));
            }
            ns.ip_batch(&cmds)?;
        }
        self.net.lan_port(&self.net.up, "p-up", Some(plan::UP_MAC))?;
        wire_upstream_and_server(
            &self.net.up,
            &self.net.srv,
            &[format!("addr add {UPSTREAM}/24 dev lan0"), format!("addr add {UPSTREAM6}/64 dev lan0 nodad")],
        )
    }

    /// The routed variant's links and routes (module doc).
    fn wire_routed(&self) -> Result<()> {
        let Some(rt) = &self.router else {
            return Err(LabError::Gateway("the routed lab has no router".into()));
        };
        for ns in self.workers.values().chain(self.gws.values()).chain([rt]) {
            sysctl::set(ns, &[&[&sysctl::COMMON[..]], &ROUTER[..]].concat())?;
        }
        self.net.wire_bridges(&ROUTER)?;
        // The router: one link per worker subnet, one into subnet G.
        self.net.lan_port(rt, "p-rt", Some(ROUTER_G_MAC))?;
        let mut cmds = vec![
            format!("addr add {ROUTER_G}/24 dev lan0"),
            format!("addr add {}/64 dev lan0 nodad", router_g6()),
            "link set dev lan0 up".into(),
        ];
        for (w, ns) in &self.workers {
            let leg = format!("a{}", w.n());
            rt.ip_batch(&[format!("link add {leg} type veth peer name lan0 netns {}", ns.name())])?;
            cmds.extend([
                format!("addr add {}/24 dev {leg}", w.routed_gateway()),
                format!("addr add {}/64 dev {leg} nodad", w.routed_gateway6()),
                format!("link set dev {leg} up"),
            ]);
        }
        cmds.extend([format!("route add default via {UPSTREAM}"), format!("route add ::/0 via {UPSTREAM6}")]);
        for w in Worker::ALL {
            // Native routing: each node's pods via that node.
            cmds.push(format!("route add {} via {}", w.pod_cidr(), w.routed_addr()));
            cmds.push(format!("route add {} via {}", w.pod_cidr6(), w.routed_addr6()));
        }
        rt.ip_batch(&cmds)?;
        for (w, ns) in &self.workers {
            self.net.mgmt_port(ns, &format!("m-{}", w.node_name()), w.mgmt_addr())?;
            ns.ip_batch(&[
                "link add pods type bridge mcast_snooping 0".into(),
                "link set dev pods up".into(),
                format!("addr add {}/24 dev pods", w.pod_gateway()),
                format!("addr add {}/64 dev pods nodad", w.pod_addr6(1)),
                format!("addr add {}/24 dev lan0", w.routed_addr()),
                format!("addr add {}/64 dev lan0 nodad", w.routed_addr6()),
                "link set dev lan0 up".into(),
                // Everything, the other node's pods and the gateways' egress
                // IPs included, through the router.
                format!("route add default via {}", w.routed_gateway()),
                format!("route add ::/0 via {}", w.routed_gateway6()),
            ])?;
        }
        for (g, ns) in &self.gws {
            self.net.lan_port(ns, &format!("p-g{}", g.n()), Some(g.mac()))?;
            self.net.mgmt_port(ns, &format!("m-g{}", g.n()), g.mgmt_addr())?;
            let mut cmds = vec![
                format!("addr add {}/24 dev lan0", g.lan_addr()),
                format!("addr add {}/64 dev lan0 nodad", g.lan_addr6()),
                "link set dev lan0 up".into(),
                format!("route add default via {UPSTREAM}"),
                format!("route add ::/0 via {UPSTREAM6}"),
            ];
            for w in Worker::ALL {
                cmds.push(format!("route add {} via {ROUTER_G}", w.pod_cidr()));
                cmds.push(format!("route add {} via {}", w.pod_cidr6(), router_g6()));
                cmds.push(format!("route add {} via {ROUTER_G}", w.routed_subnet()));
                cmds.push(format!("route add {} via {}", w.routed_subnet6(), router_g6()));
            }
            ns.ip_batch(&cmds)?;
        }
        self.net.lan_port(&self.net.up, "p-up", Some(plan::UP_MAC))?;
        let mut up = vec![
            format!("addr add {UPSTREAM}/24 dev lan0"),
            format!("addr add {UPSTREAM6}/64 dev lan0 nodad"),
            format!("addr add {STRANGER_G}/24 dev lan0"),
            format!("addr add {}/64 dev lan0 nodad", stranger_g6()),
        ];
        // The nodes' own addresses (what their masquerade leaves with) are
        // behind the router; their pods are not routed here.
        for w in Worker::ALL {
            up.push(format!("route add {} via {ROUTER_G}", w.routed_subnet()));
            up.push(format!("route add {} via {}", w.routed_subnet6(), router_g6()));
        }
        wire_upstream_and_server(&self.net.up, &self.net.srv, &up)
    }

    /// flannel's vxlan backend on every worker and gateway ([`Backend::Vxlan`]).
    fn overlay(&self) -> Result<()> {
        let hosts = vtep_hosts();
        let namespaces: Vec<&NetNs> = self.workers.values().chain(self.gws.values()).collect();
        for (i, ns) in namespaces.iter().enumerate() {
            let (local, vtep, net) = hosts[i];
            let mut cmds = vec![
                format!("link add {VXLAN_DEVICE} type vxlan id 1 local {local} dev lan0 dstport 8472 nolearning"),
                format!("link set dev {VXLAN_DEVICE} address {}", mac(vtep)),
                format!("addr add {}.{}.{}.0/32 dev {VXLAN_DEVICE}", net[0], net[1], net[2]),
                format!("link set dev {VXLAN_DEVICE} up"),
            ];
            for (j, (_, rvtep, rnet)) in hosts.iter().enumerate() {
                if i == j {
                    continue;
                }
                let gw = format!("{}.{}.{}.0", rnet[0], rnet[1], rnet[2]);
                cmds.push(format!("route add {gw}/24 via {gw} dev {VXLAN_DEVICE} onlink"));
                cmds.push(format!("neigh add {gw} lladdr {} dev {VXLAN_DEVICE} nud permanent", mac(*rvtep)));
            }
            ns.ip_batch(&cmds)?;
            for (j, (remote, rvtep, _)) in hosts.iter().enumerate() {
                if i != j {
                    let mut cmd = ns.command("bridge");
                    cmd.args(["fdb", "append", &mac(*rvtep), "dev", VXLAN_DEVICE, "dst", &remote.to_string()]);
                    netns::run(&mut cmd)?;
                }
            }
        }
        Ok(())
    }

    /// Packets sent and received on `dev` in `ns` (`/sys/class/net/<dev>/statistics`).
    pub fn link_packets(ns: &NetNs, dev: &str) -> Result<(u64, u64)> {
        let read = |what: &str| -> Result<u64> {
            let path = format!("/sys/class/net/{dev}/statistics/{what}");
            let out = ns.exec(&["cat", &path])?;
            out.trim().parse().map_err(|_| LabError::Gateway(format!("{path}: {out:?}")))
        };
        Ok((read("tx_packets")?, read("rx_packets")?))
    }

    /// Adds a pod namespace on `worker`'s bridge.
    fn add_pod(&mut self, worker: Worker, name: &str, addr: Ipv4Addr) -> Result<()> {
        let host = addr.octets()[3];
        let ns = NetNs::create(&format!("{}-{name}", self.prefix))?;
        sysctl::set(&ns, &[&sysctl::COMMON, &sysctl::POD])?;
        let w = &self.workers[&worker];
        let dev = format!("v{}", self.pods.len());
        w.ip_batch(&[
            format!("link add {dev} type veth peer name eth0 netns {}", ns.name()),
            format!("link set dev {dev} master pods"),
            format!("link set dev {dev} up"),
        ])?;
        ns.ip_batch(&[
            format!("addr add {addr}/24 dev eth0"),
            format!("addr add {}/64 dev eth0 nodad", worker.pod_addr6(host)),
            "link set dev eth0 up".into(),
            format!("route add default via {}", worker.pod_gateway()),
            format!("route add ::/0 via {}", worker.pod_addr6(1)),
        ])?;
        self.pods.insert(name.to_string(), (LabPod { worker, name: name.to_string(), addr }, ns));
        Ok(())
    }

    /// The CNIs' masquerade rules (see the module doc); none on the CNI
    /// variant's worker, whose rules are the plugins'.
    fn masquerade(&self) -> Result<()> {
        if !self.by_plugins(Worker::One) {
            self.masquerade_w1()?;
        }
        if !self.by_plugins(Worker::Two) {
            self.masquerade_w2()?;
        }
        Ok(())
    }

    /// flannel's and ip-masq-agent's rules on `w1`.
    fn masquerade_w1(&self) -> Result<()> {
        let w1 = &self.workers[&Worker::One];
        let cluster = CLUSTER_POD_CIDR;
        let pod1 = Worker::One.pod_cidr();
        // flannel (iptables backend), exactly its chain.
        for rule in [
            "-t nat -N FLANNEL-POSTRTG".to_string(),
            "-t nat -A POSTROUTING -m comment --comment flanneld-masq -j FLANNEL-POSTRTG".into(),
            "-t nat -A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 -j RETURN".into(),
            format!("-t nat -A FLANNEL-POSTRTG -s {pod1} -d {cluster} -j RETURN"),
            format!("-t nat -A FLANNEL-POSTRTG -s {cluster} -d {pod1} -j RETURN"),
            format!("-t nat -A FLANNEL-POSTRTG ! -s {cluster} -d {pod1} -j RETURN"),
            format!("-t nat -A FLANNEL-POSTRTG -s {cluster} ! -d 224.0.0.0/4 -j MASQUERADE --random-fully"),
            format!("-t nat -A FLANNEL-POSTRTG ! -s {cluster} -d {cluster} -j MASQUERADE --random-fully"),
            // ip-masq-agent after it.
            "-t nat -N IP-MASQ-AGENT".into(),
            "-t nat -A POSTROUTING -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT".into(),
            "-t nat -A IP-MASQ-AGENT -d 169.254.0.0/16 -j RETURN".into(),
            format!("-t nat -A IP-MASQ-AGENT -d {cluster} -j RETURN"),
            "-t nat -A IP-MASQ-AGENT -j MASQUERADE --random-fully".into(),
        ] {
            iptables(w1, "iptables", &rule)?;
        }
        // flannel's IPv6 chain (ip6tables), the same shape.
        let (cluster6, pod6) = (CLUSTER_POD_CIDR6, Worker::One.pod_cidr6());
        for rule in [
            "-t nat -N FLANNEL-POSTRTG".to_string(),
            "-t nat -A POSTROUTING -m comment --comment flanneld-masq -j FLANNEL-POSTRTG".into(),
            format!("-t nat -A FLANNEL-POSTRTG -s {pod6} -d {cluster6} -j RETURN"),
            format!("-t nat -A FLANNEL-POSTRTG -s {cluster6} -d {pod6} -j RETURN"),
            format!("-t nat -A FLANNEL-POSTRTG -s {cluster6} ! -d ff00::/8 -j MASQUERADE --random-fully"),
        ] {
            iptables(w1, "ip6tables", &rule)?;
        }
        Ok(())
    }

    /// kindnet's and Calico's rules on `w2`.
    fn masquerade_w2(&self) -> Result<()> {
        let cluster = CLUSTER_POD_CIDR;
        let w2 = &self.workers[&Worker::Two];
        // kindnet: its own nft table at srcnat - 10 (runs before iptables).
        let kindnet = format!(
            "table inet kindnet-ipmasq {{\n  set noMasqV4 {{\n    type ipv4_addr\n    flags interval\n    elements = {{ {cluster} }}\n  }}\n  set noMasqV6 {{\n    type ipv6_addr\n    flags interval\n    elements = {{ {CLUSTER_POD_CIDR6} }}\n  }}\n  chain postrouting {{\n    type nat hook postrouting priority srcnat - 10; policy accept;\n    ct state established,related accept\n    fib daddr type local accept\n    ip daddr @noMasqV4 accept\n    ip6 daddr @noMasqV6 accept\n    masquerade\n  }}\n}}\n"
        );
        let mut cmd = w2.command("nft");
        cmd.args(["-f", "-"]).stdin(Stdio::piped()).stdout(Stdio::null()).stderr(Stdio::piped());
        let line = netns::describe(&cmd);
        let mut child = cmd.spawn().map_err(|source| LabError::spawn(&cmd, line.clone(), source))?;
        if let Some(mut stdin) = child.stdin.take() {
            use std::io::Write as _;
            stdin.write_all(kindnet.as_bytes()).map_err(|e| LabError::io("nft stdin", e))?;
        }
        let out = child.wait_with_output().map_err(|e| LabError::io("nft", e))?;
        if !out.status.success() {
            return Err(LabError::Gateway(format!("{line}: {}", String::from_utf8_lossy(&out.stderr))));
        }
        // Calico's natOutgoing (cali-nat-outgoing, inserted at the top of
        // POSTROUTING), its IPAM-pool ipsets written as the pool CIDR.
        for rule in [
            "-t nat -N cali-nat-outgoing".to_string(),
            "-t nat -I POSTROUTING 1 -j cali-nat-outgoing".into(),
            format!("-t nat -A cali-nat-outgoing -s {cluster} ! -d {cluster} -j MASQUERADE --random-fully"),
        ] {
            iptables(w2, "iptables", &rule)?;
        }
        Ok(())
    }

    /// Whether `worker`'s pods are made by the CNI plugins.
    fn by_plugins(&self, worker: Worker) -> bool {
        self.plugins.as_ref().is_some_and(|p| p.worker == worker)
    }

    /// The CNI variant's configuration list for `worker` (written where a
    /// runtime reads it, `<dir>/cni/net.d/10-egret-lab.conflist`), checked
    /// with each plugin's `VERSION`.
    fn plugin_network(&self, worker: Worker) -> Result<Plugins> {
        let cni_dir = self.net.dir.join("cni");
        let conf_dir = cni_dir.join("net.d");
        std::fs::create_dir_all(&conf_dir).map_err(|e| LabError::io(format!("create {}", conf_dir.display()), e))?;
        let text = cni::lab_conflist(
            CNI_NETWORK,
            CNI_BRIDGE,
            &worker.pod_cidr(),
            &worker.pod_cidr6(),
            &cni_dir.join("networks"),
        );
        let file = conf_dir.join(format!("10-{CNI_NETWORK}.conflist"));
        std::fs::write(&file, &text).map_err(|e| LabError::io(format!("write {}", file.display()), e))?;
        let list = cni::NetworkList::parse(&text, &cni_dir)?;
        list.validate(&self.workers[&worker])?;
        Ok(Plugins { worker, list, attachments: BTreeMap::new() })
    }

    /// Adds a pod on `worker` as a runtime does: its namespace (the
    /// sandbox's), then the configuration list's ADD with the pod's
    /// `hostPort`s; the pod's address is the one host-local handed out.
    fn add_plugin_pod(&mut self, worker: Worker, name: &str, ports: &[cni::PortMapping]) -> Result<()> {
        let ns = NetNs::create(&format!("{}-{name}", self.prefix))?;
        sysctl::set(&ns, &[&sysctl::COMMON, &sysctl::POD])?;
        let Some(plugins) = self.plugins.as_mut() else {
            return Err(LabError::Gateway(format!("{name}: the lab has no CNI network")));
        };
        let rt = cni::RuntimeConf::for_pod(POD_NAMESPACE, name, &ns, ports);
        let attachment = plugins.list.add(&self.workers[&worker], &rt)?;
        let addr = attachment.result.ipv4().ok_or_else(|| LabError::Unexpected {
            from: format!("CNI ADD of {name}"),
            got: attachment.result.0.to_string(),
        })?;
        plugins.attachments.insert(name.to_string(), attachment);
        self.pods.insert(name.to_string(), (LabPod { worker, name: name.to_string(), addr }, ns));
        Ok(())
    }

    /// The CNI variant: the worker whose pods the plugins make and the
    /// configuration list (None in the other labs).
    pub fn plugins(&self) -> Option<(Worker, &cni::NetworkList)> {
        self.plugins.as_ref().map(|p| (p.worker, &p.list))
    }

    /// The CNI variant: pod `name`'s attachment (its ADD's arguments and result).
    pub fn attachment(&self, name: &str) -> Option<&cni::Attachment> {
        self.plugins.as_ref()?.attachments.get(name)
    }

    /// The external server's namespace (a client outside the cluster).
    pub fn server_ns(&self) -> &NetNs {
        &self.net.srv
    }

    /// Starts `egret node` in `worker`'s namespace with `extra` flags (the
    /// lab's `--cluster-cidr` and metrics on loopback unless `extra` gives
    /// `--cluster-cidr` or `--metrics-listen`).
    pub fn start_agent(&self, worker: Worker, kubeconfig: &Path, extra: &[&str]) -> Result<Agent> {
        let bin = egret_binary()?;
        let name = worker.node_name();
        let status_file = self.net.dir.join(format!("{name}-node.json"));
        let log = self.net.dir.join(format!("{name}-node.log"));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.workers[&worker].name()])
            .arg(&bin)
            .args(["node", "--node-name", name, "--kubeconfig"])
            .arg(kubeconfig)
            .args(if extra.contains(&"--cluster-cidr") {
                vec![]
            } else {
                vec!["--cluster-cidr".to_string(), format!("{CLUSTER_POD_CIDR},{CLUSTER_POD_CIDR6},{SERVICE_CIDR}")]
            })
            .args(if extra.contains(&"--metrics-listen") { vec![] } else { vec!["--metrics-listen", "127.0.0.1:9465"] })
            .arg("--status-file")
            .arg(&status_file)
            .args(extra)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            .env("NO_COLOR", "1");
        let child = netns::spawn_logged(&mut cmd, &log)?;
        Ok(Agent { child: Some(child), status_file, log })
    }

    /// Runs `egret node cleanup` in `worker`'s namespace.
    pub fn cleanup_agent(&self, worker: Worker) -> Result<String> {
        let bin = egret_binary()?;
        let bin = bin.to_string_lossy();
        self.workers[&worker].exec(&[&bin, "node", "cleanup"])
    }

    /// Egret's rules in `worker`'s kernel (`ip rule` lines with proto 233)
    /// and its routes (`ip route show table all` lines with proto 233),
    /// sorted: a snapshot to compare.
    pub fn steering(&self, worker: Worker) -> Result<(Vec<String>, Vec<String>)> {
        let ns = &self.workers[&worker];
        let ours = |args: &[&str]| -> Result<Vec<String>> {
            Ok(ns.ip(args)?.lines().filter(|l| l.contains("proto 233")).map(str::to_string).collect())
        };
        let mut rules = ours(&["-4", "rule", "show"])?;
        rules.extend(ours(&["-6", "rule", "show"])?);
        let mut routes = ours(&["-4", "route", "show", "table", "all"])?;
        routes.extend(ours(&["-6", "route", "show", "table", "all"])?);
        rules.sort();
        routes.sort();
        Ok((rules, routes))
    }

    /// The IPv4 pods whose source Egret steers (`ip rule` `from` addresses).
    pub fn steered_pods(&self, worker: Worker) -> Result<Vec<Ipv4Addr>> {
        let (rules, _) = self.steering(worker)?;
        Ok(rules
            .iter()
            .filter_map(|l| l.split_whitespace().skip_while(|w| *w != "from").nth(1)?.parse().ok())
            .collect())
    }

    /// `nft list table inet egret_node` and `... egret_node_guard` in
    /// `worker`'s namespace, one after the other ("" if both are absent).
    pub fn node_table(&self, worker: Worker) -> String {
        ["egret_node", "egret_node_guard"]
            .iter()
            .map(|t| self.workers[&worker].exec(&["nft", "list", "table", "inet", t]).unwrap_or_default())
            .collect()
    }

    /// The lab's directory.
    pub fn dir(&self) -> &Path {
        &self.net.dir
    }

    /// A pod's namespace by name.
    pub fn pod(&self, name: &str) -> &NetNs {
        &self.pods[name].1
    }

    /// A pod's address by name.
    pub fn pod_addr(&self, name: &str) -> Ipv4Addr {
        self.pods[name].0.addr
    }

    /// A worker's namespace.
    pub fn worker(&self, w: Worker) -> &NetNs {
        &self.workers[&w]
    }

    /// A gateway's namespace.
    pub fn gateway_ns(&self, g: NodeGw) -> &NetNs {
        &self.gws[&g]
    }

    /// Where the workers sit.
    pub fn subnets(&self) -> Subnets {
        self.subnets
    }

    /// `w`'s own address (its Node's InternalIP, what its masquerade
    /// leaves with): on the segment, or in its subnet in the routed variant.
    pub fn node_addr(&self, w: Worker) -> Ipv4Addr {
        match self.subnets {
            Subnets::Shared => w.lan_addr(),
            Subnets::Routed => w.routed_addr(),
        }
    }

    /// [`NodeLab::node_addr`] over IPv6.
    pub fn node_addr6(&self, w: Worker) -> Ipv6Addr {
        match self.subnets {
            Subnets::Shared => w.lan_addr6(),
            Subnets::Routed => w.routed_addr6(),
        }
    }

    /// The routed variant's router (None in the other labs).
    pub fn router(&self) -> Option<&NetNs> {
        self.router.as_ref()
    }

    /// The node segment's bridge namespace (subnet G in the routed variant).
    pub fn lan(&self) -> &NetNs {
        &self.net.lan
    }

    /// The upstream router's namespace.
    pub fn upstream(&self) -> &NetNs {
        &self.net.up
    }

    /// The control namespace.
    pub fn control(&self) -> &NetNs {
        &self.net.control
    }

    /// The external server.
    pub fn server(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// The external server's HTTP address.
    pub fn http() -> SocketAddr {
        SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT)
    }

    /// The external server's IPv6 HTTP address.
    pub fn http6() -> SocketAddr {
        SocketAddr::new(plan::SERVER6.into(), plan::HTTP_PORT)
    }
}

impl Drop for NodeLab {
    fn drop(&mut self) {
        self.server.take();
        let _ = std::fs::remove_dir_all(&self.net.dir);
    }
}
