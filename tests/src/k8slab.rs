//! The Kubernetes lab: two (or three) gateway namespaces running the real
//! `egret gateway` in Kubernetes mode against a real kube-apiserver that runs
//! inside the lab (docs/lab.md, "The Kubernetes lab"). [`K8sLab::build`]
//! makes the two-gateway lab; [`K8sLab::build_with`] any set of gateways
//! (the high-availability tests use all three, `tests/tests/k8s_ha.rs`).
//!
//! ```text
//!  pod-web 198.18.0.10   pod-db 198.18.0.11   pod-other 198.18.0.12
//!        \___________________|____________________/
//!                     bridge "pods" 198.18.0.1/24
//!  ns node (node router)  lan0 203.0.113.5/24 NODE_MAC
//!     main table: default via 203.0.113.1 (unselected pods)
//!     ip rule from <selected pod> lookup <T>: default via <egress IP> dev lan0
//!        |
//!  ns lan: bridge "lan" (one L2 segment, 203.0.113.0/24: the nodes' link and
//!        |  the upstream link are the same, so an egress IP is its own next hop)
//!        +-- gw-1 lan0 203.0.113.21  02:e9:00:00:01:01  one-arm, role both, XDP + AF_XDP
//!        +-- gw-2 lan0 203.0.113.22  02:e9:00:00:01:02
//!        +-- gw-3 lan0 203.0.113.23  02:e9:00:00:01:03  (three-gateway lab only)
//!        +-- up   lan0 203.0.113.1   UP_MAC  <- every test captures here
//!                 srv  198.51.100.1 --- ns srv eth0 198.51.100.7 (the server)
//!
//!  ns control: bridge "mgmt" 192.0.2.1/24: etcd (its own 127.0.0.1) and
//!        |     kube-apiserver (192.0.2.1), see crate::apiserver
//!        +-- gw-1 mgmt 192.0.2.11/24
//!        +-- gw-2 mgmt 192.0.2.12/24
//!        +-- gw-3 mgmt 192.0.2.13/24  (three-gateway lab only)
//! ```
//!
//! The gateways reach the API server only over their management link; the
//! XDP program is attached to `lan0` only. Egress IPs (a Service VIP, a
//! policy's IP) are on-link in 203.0.113.0/24 for the node router and the
//! upstream router alike: both resolve them with ARP, and whichever gateway
//! holds the IP answers. The node router's per-pod `ip rule`s are static for
//! the whole test (issue 4: "the egress IP is its own next hop").

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::cluster_net::ClusterNet;
use crate::error::{LabError, Result};
use crate::frames::{self, Arp, RawLink};
use crate::lab::{remove_stale_test_labs, TEST_PREFIX};
use crate::netns::NetNs;
use crate::plan;
use crate::server::Server;
use crate::sysctl;

/// The shared segment's prefix (nodes' link = upstream link).
pub const LAN_PREFIX: u8 = 24;
/// The upstream router on the segment.
pub const UPSTREAM: Ipv4Addr = plan::UPSTREAM;
/// The node router on the segment.
pub const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 5);
/// The node router's MAC on the segment.
pub const NODE_MAC: [u8; 6] = plan::NODE_MAC;
/// The control namespace's address: the API server binds here.
pub const CONTROL: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The API server's Service range: only stored, never on a link (TEST-NET
/// benchmark range, away from every address above).
pub const SERVICE_CIDR: &str = "198.19.0.0/24";
/// The node router's address on the pods' bridge (their default gateway).
pub const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// The pods' prefix: stays inside the cluster (`throw` in the egress tables).
pub const POD_CIDR: &str = "198.18.0.0/16";

/// One of the lab's gateways.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Gw {
    /// Node `gw-1`.
    One,
    /// Node `gw-2`.
    Two,
    /// Node `gw-3` (only in a lab built with it, see [`K8sLab::build_with`]).
    Three,
}

impl Gw {
    /// Every gateway a lab can have.
    pub const ALL: [Gw; 3] = [Gw::One, Gw::Two, Gw::Three];
    /// The two-gateway lab's pair ([`K8sLab::build`]).
    pub const PAIR: [Gw; 2] = [Gw::One, Gw::Two];

    /// The Node name (the gateway's identity in Leases).
    pub fn node_name(self) -> &'static str {
        match self {
            Gw::One => "gw-1",
            Gw::Two => "gw-2",
            Gw::Three => "gw-3",
        }
    }

    /// The gateway whose Node is called `name`.
    pub fn by_node_name(name: &str) -> Option<Gw> {
        Gw::ALL.into_iter().find(|g| g.node_name() == name)
    }

    /// Its own address on the segment.
    pub fn lan_addr(self) -> Ipv4Addr {
        match self {
            Gw::One => Ipv4Addr::new(203, 0, 113, 21),
            Gw::Two => Ipv4Addr::new(203, 0, 113, 22),
            Gw::Three => Ipv4Addr::new(203, 0, 113, 23),
        }
    }

    /// Its MAC on the segment (what it answers ARP with).
    pub fn mac(self) -> [u8; 6] {
        match self {
            Gw::One => [0x02, 0xe9, 0, 0, 0x01, 0x01],
            Gw::Two => [0x02, 0xe9, 0, 0, 0x01, 0x02],
            Gw::Three => [0x02, 0xe9, 0, 0, 0x01, 0x03],
        }
    }

    /// Its address on the management link.
    pub fn mgmt_addr(self) -> Ipv4Addr {
        match self {
            Gw::One => Ipv4Addr::new(192, 0, 2, 11),
            Gw::Two => Ipv4Addr::new(192, 0, 2, 12),
            Gw::Three => Ipv4Addr::new(192, 0, 2, 13),
        }
    }

    /// Its namespace's role (`<prefix>-gw1`), and the name of its ports on
    /// the segment's bridge (`p-gw1`) and the management bridge (`m-gw1`).
    pub fn role(self) -> &'static str {
        match self {
            Gw::One => "gw1",
            Gw::Two => "gw2",
            Gw::Three => "gw3",
        }
    }
}

/// The lab's pods (the test creates a Pod object for each, with this IP).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KPod {
    /// 198.18.0.10: selected by the LoadBalancer Service (label `app=web`).
    Web,
    /// 198.18.0.11: selected by an EgressPolicy (label `app=db`).
    Db,
    /// 198.18.0.12: selected by nothing; the node router sends it upstream.
    Other,
}

impl KPod {
    /// Every pod.
    pub const ALL: [KPod; 3] = [KPod::Web, KPod::Db, KPod::Other];

    /// Its name (namespace role `pod-<name>`, the Pod object's `app` label).
    pub fn name(self) -> &'static str {
        match self {
            KPod::Web => "web",
            KPod::Db => "db",
            KPod::Other => "other",
        }
    }

    /// Its address.
    pub fn addr(self) -> Ipv4Addr {
        match self {
            KPod::Web => Ipv4Addr::new(198, 18, 0, 10),
            KPod::Db => Ipv4Addr::new(198, 18, 0, 11),
            KPod::Other => Ipv4Addr::new(198, 18, 0, 12),
        }
    }
}

/// A running Kubernetes lab. Dropping it stops the server, ends every
/// process in its namespaces (gateways, etcd, the API server) and deletes
/// them.
#[derive(Debug)]
pub struct K8sLab {
    server: Option<Server>,
    prefix: String,
    pods: BTreeMap<KPod, NetNs>,
    node: NetNs,
    gws: BTreeMap<Gw, NetNs>,
    net: ClusterNet,
}

/// `aa:bb:...` for `ip`.
pub(crate) fn mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The upstream router (`up`, whose `lan0` is already on the segment) and
/// the server behind it (`srv`, every address of [`plan::server_addrs`]):
/// `up_extra` runs in `up` once its `lan0` is up (its segment addresses,
/// routes back).
pub(crate) fn wire_upstream_and_server(up: &NetNs, srv: &NetNs, up_extra: &[String]) -> Result<()> {
    let mut cmds = vec!["link set dev lan0 up".to_string()];
    cmds.extend_from_slice(up_extra);
    cmds.extend([
        format!("link add srv type veth peer name eth0 netns {}", srv.name()),
        format!("addr add {}/24 dev srv", plan::UPSTREAM_SRV),
        format!("addr add {}/64 dev srv nodad", plan::UPSTREAM_SRV6),
        "link set dev srv up".into(),
    ]);
    up.ip_batch(&cmds)?;
    let mut s = Vec::new();
    for a in plan::server_addrs() {
        let len = if a.is_ipv6() { "64 dev eth0 nodad" } else { "24 dev eth0" };
        s.push(format!("addr add {a}/{len}"));
    }
    s.extend([
        "link set dev eth0 up".into(),
        format!("route add default via {}", plan::UPSTREAM_SRV),
        format!("route add ::/0 via {}", plan::UPSTREAM_SRV6),
    ]);
    srv.ip_batch(&s)
}

impl K8sLab {
    /// A unique namespace prefix for a test: `eglab<pid>xk<n>` (stale ones
    /// are removed like the other labs').
    pub fn test_prefix() -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        format!("{TEST_PREFIX}{}xk{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
    }

    /// Builds the two-gateway topology ([`Gw::PAIR`]) and starts the
    /// external server. On error every namespace made so far is deleted.
    pub fn build(prefix: &str) -> Result<Self> {
        Self::build_with(prefix, &Gw::PAIR)
    }

    /// Builds the topology with `gateways` (each once; `gw-3` only when
    /// asked for) and starts the external server. On error every namespace
    /// made so far is deleted.
    pub fn build_with(prefix: &str, gateways: &[Gw]) -> Result<Self> {
        remove_stale_test_labs();
        let ns = |role: &str| NetNs::create(&format!("{prefix}-{role}"));
        let mut pods = BTreeMap::new();
        for p in KPod::ALL {
            pods.insert(p, ns(&format!("pod-{}", p.name()))?);
        }
        let node = ns("node")?;
        let mut gws = BTreeMap::new();
        for &g in gateways {
            gws.insert(g, ns(g.role())?);
        }
        let net = ClusterNet::create(prefix, "k8slab")?;
        let mut lab = Self { server: None, prefix: prefix.to_string(), pods, node, gws, net };
        lab.wire()?;
        lab.resolve_gateway_neighbors()?;
        lab.server = Some(Server::start(&lab.net.srv, None)?);
        Ok(lab)
    }

    fn wire(&self) -> Result<()> {
        for ns in self.pods.values() {
            sysctl::set(ns, &[&sysctl::COMMON, &sysctl::POD])?;
        }
        // The gateways' kernels forward too (as a gateway node's does): that is
        // what makes the fail-closed rules matter when a daemon dies.
        for ns in self.gws.values().chain([&self.node]) {
            sysctl::set(ns, &[&sysctl::COMMON, &sysctl::ROUTER])?;
        }
        self.net.wire_bridges(&[&sysctl::ROUTER])?;

        // Node router.
        let mut node = vec!["link add pods type bridge mcast_snooping 0".to_string(), "link set dev pods up".into()];
        node.push(format!("addr add {POD_GATEWAY}/24 dev pods"));
        for (p, ns) in &self.pods {
            let dev = format!("p-{}", p.name());
            node.push(format!("link add {dev} type veth peer name eth0 netns {}", ns.name()));
            node.push(format!("link set dev {dev} master pods"));
            node.push(format!("link set dev {dev} up"));
        }
        self.node.ip_batch(&node)?;
        self.net.lan_port(&self.node, "p-node", Some(NODE_MAC))?;
        self.node.ip_batch(&[
            format!("addr add {NODE}/{LAN_PREFIX} dev lan0"),
            "link set dev lan0 up".into(),
            format!("route add default via {UPSTREAM}"),
        ])?;
        for (p, ns) in &self.pods {
            ns.ip_batch(&[
                format!("addr add {}/24 dev eth0", p.addr()),
                "link set dev eth0 up".into(),
                format!("route add default via {POD_GATEWAY}"),
            ])?;
        }

        // Gateways: lan0 on the segment, mgmt to the control namespace.
        for (g, ns) in &self.gws {
            self.net.lan_port(ns, &format!("p-{}", g.role()), Some(g.mac()))?;
            self.net.mgmt_port(ns, &format!("m-{}", g.role()), g.mgmt_addr())?;
            ns.ip_batch(&[
                format!("addr add {}/{LAN_PREFIX} dev lan0", g.lan_addr()),
                "link set dev lan0 up".into(),
                format!("route add default via {UPSTREAM}"),
                format!("route add {POD_CIDR} via {NODE}"),
            ])?;
        }

        // Upstream router and server.
        self.net.lan_port(&self.net.up, "p-up", Some(plan::UP_MAC))?;
        wire_upstream_and_server(
            &self.net.up,
            &self.net.srv,
            &[
                format!("addr add {UPSTREAM}/{LAN_PREFIX} dev lan0"),
                // Replies to unselected pods (translated ones go to the egress IP, on-link).
                format!("route add {POD_CIDR} via {NODE}"),
            ],
        )
    }

    /// Has each gateway's kernel resolve the upstream and node routers now,
    /// as on gateways that have been up for a while (see `Lab`): Egret drops
    /// a frame whose next hop is unresolved.
    fn resolve_gateway_neighbors(&self) -> Result<()> {
        let gws: Vec<&NetNs> = self.gws.values().collect();
        resolve_neighbors(&gws, &[UPSTREAM.into(), NODE.into()])
    }

    /// Sends `pod`'s traffic (except to [`POD_CIDR`]) to `next_hop` on the
    /// segment: `ip rule from <pod> lookup <table>`, `default via <next_hop>`
    /// in that table. docs/kubernetes.md, "Worker-node routing".
    pub fn route_pod_via(&self, pod: KPod, next_hop: Ipv4Addr, table: u32) -> Result<()> {
        self.node.ip_batch(&[
            format!("route add default via {next_hop} dev lan0 table {table}"),
            format!("route add throw {POD_CIDR} table {table}"),
            format!("rule add from {}/32 lookup {table} priority {table}", pod.addr()),
        ])
    }

    /// The namespace prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The lab's directory (gateway configs, kubeconfigs, logs).
    pub fn dir(&self) -> &Path {
        &self.net.dir
    }

    /// A pod's namespace.
    pub fn pod(&self, p: KPod) -> &NetNs {
        &self.pods[&p]
    }

    /// The node router's namespace.
    pub fn node(&self) -> &NetNs {
        &self.node
    }

    /// A gateway's namespace (panics for a gateway the lab was not built
    /// with, a test's mistake).
    pub fn gateway_ns(&self, g: Gw) -> &NetNs {
        &self.gws[&g]
    }

    /// The gateways this lab was built with, in order.
    pub fn gateways(&self) -> Vec<Gw> {
        self.gws.keys().copied().collect()
    }

    /// The segment's namespace (its bridge `lan`, a port `p-<role>` per
    /// gateway).
    pub fn lan(&self) -> &NetNs {
        &self.net.lan
    }

    /// The upstream router's namespace (capture its `lan0`).
    pub fn upstream(&self) -> &NetNs {
        &self.net.up
    }

    /// The external server's namespace (`srv`: every address of
    /// [`plan::server_addrs`]).
    pub fn server_ns(&self) -> &NetNs {
        &self.net.srv
    }

    /// The control namespace (etcd, the API server).
    pub fn control(&self) -> &NetNs {
        &self.net.control
    }

    /// The external server.
    pub fn server(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// The gateways' interfaces and roles in their files.
    pub fn gateway_interfaces() -> [(&'static str, &'static str); 1] {
        [("lan0", "both")]
    }

    /// Every ARP reply for `target` that reaches the node router within
    /// `wait` after it broadcasts one request from its segment interface
    /// (the replies are unicast to it). Exactly one gateway should answer
    /// for a held egress IP, none for a free one.
    pub fn arp_who_has(&self, target: Ipv4Addr, wait: Duration) -> Result<Vec<Arp>> {
        let link = RawLink::open(&self.node, "lan0")?;
        link.send(&frames::arp_request(NODE_MAC, NODE, target))?;
        let mut replies = Vec::new();
        let deadline = Instant::now() + wait;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let got = link.recv_matching(left, |f| {
                frames::parse_arp(f).is_some_and(|a| a.op == 2 && a.spa == target && a.tha == NODE_MAC)
            })?;
            match got.and_then(|f| frames::parse_arp(&f)) {
                Some(a) => replies.push(a),
                None => break,
            }
        }
        Ok(replies)
    }

    /// The node router's neighbour entry for `ip` (`ip neigh show`), if any.
    pub fn node_neighbor(&self, ip: Ipv4Addr) -> Result<Option<String>> {
        let out = self.node.ip(&["neigh", "show", &ip.to_string(), "dev", "lan0"])?;
        Ok(out.lines().next().map(str::to_string).filter(|l| !l.trim().is_empty()))
    }
}

/// Has each of `namespaces` resolve each of `hops` (a datagram to port 9
/// starts ARP) and waits up to 5 s until every neighbour entry has a MAC.
pub fn resolve_neighbors(namespaces: &[&NetNs], hops: &[IpAddr]) -> Result<()> {
    for ns in namespaces {
        ns.run_in(|| {
            for hop in hops {
                let any = if hop.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
                if let Ok(s) = std::net::UdpSocket::bind(any) {
                    let _ = s.send_to(b"resolve", SocketAddr::new(*hop, 9));
                }
            }
        })?;
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    for ns in namespaces {
        loop {
            let table = ns.ip(&["neigh", "show"])?;
            let resolved =
                |hop: &IpAddr| table.lines().any(|l| l.starts_with(&format!("{hop} ")) && l.contains("lladdr"));
            if hops.iter().all(resolved) {
                break;
            }
            if Instant::now() > deadline {
                return Err(LabError::Timeout {
                    what: format!("{} to resolve {hops:?}; neighbours:\n{table}", ns.name()),
                    after: Duration::from_secs(5),
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

impl Drop for K8sLab {
    fn drop(&mut self) {
        self.server.take();
        let _ = std::fs::remove_dir_all(&self.net.dir);
        // The namespaces' guards (fields) end their processes and delete them.
    }
}
