//! The lab topology: network namespaces joined by veth pairs, with the
//! fixture table's addresses and MACs (see [`crate::plan`] and docs/lab.md).
//!
//! ```text
//!  pod-a 198.18.0.10  pod-b .0.11  pod-c .1.10  pod-u .2.10  pod-v6 2001:db8:18::10
//!      \________________|______________|___________|___________/
//!                    bridge "pods" (198.18.{0,1,2}.1, 2001:db8:18::1)
//!                    node router            gw 192.0.2.1 / 2001:db8:2::1  NODE_MAC
//!                                            |
//!   two-arm:                  inside 192.0.2.2 / 2001:db8:2::2      GW_IN
//!                             gateway (Egret; kernel forwards the rest)
//!                             outside 203.0.113.2 / 2001:db8:113::2 GW_OUT
//!                                            |
//!                             gw 203.0.113.1 / 2001:db8:113::1    UP_MAC
//!                    upstream router   (egress IPs are on-link: Egret answers ARP/NDP)
//!                             srv 198.51.100.1 / 2001:db8:51::1     (MTU optional, e.g. 1400)
//!                                            |
//!                    server eth0 198.51.100.7, .200, .99, 2001:db8:51::7
//! ```
//!
//! One-arm puts node, gateway and upstream on one bridge (namespace `lan`);
//! the gateway's single interface `lan0` holds both its inside and outside
//! addresses and Egret runs it with role `both`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{LabError, Result};
use crate::netns::{self, NetNs};
use crate::plan::{self, Pod};
use crate::server::Server;
use crate::sysctl;

/// How the gateway is cabled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arm {
    /// An inside and an outside interface (the default).
    Two,
    /// One interface towards a LAN shared by the node and upstream routers.
    One,
}

/// How to build a lab.
#[derive(Clone, Debug)]
pub struct LabOptions {
    /// Namespace name prefix; every namespace is `<prefix>-<role>`.
    pub prefix: String,
    /// Two-arm or one-arm.
    pub arm: Arm,
    /// MTU of the upstream router's interface towards the server (the
    /// server's side stays at 1500), to make the path send ICMP
    /// fragmentation-needed.
    pub server_link_mtu: Option<u32>,
    /// Start the external server as threads of this process.
    pub server: bool,
    /// Directory for the gateway's config, admin socket and logs; removed
    /// on drop when the lab created it.
    pub dir: Option<PathBuf>,
    /// TX checksum offload on the lab's veths (the kernel's default, on):
    /// local senders then hand TCP/UDP on with partial checksums (the
    /// pseudo-header sum only), which the gateway must complete. Off, every
    /// veth completes checksums before sending, so frames reach the gateway
    /// as they would from a wire: what the XDP fast path translates (it
    /// punts partial checksums to the engine, docs/fast-path.md).
    pub tx_checksum_offload: bool,
}

/// The prefix of test labs' namespaces: `eglab<pid>x<n>`.
pub const TEST_PREFIX: &str = "eglab";

impl LabOptions {
    /// Options for a test: a unique prefix (`eglab<pid>x<n>`), two-arm, the
    /// server in process.
    pub fn for_test() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        Self {
            prefix: format!("{TEST_PREFIX}{}x{n}", std::process::id()),
            arm: Arm::Two,
            server_link_mtu: None,
            server: true,
            dir: None,
            tx_checksum_offload: true,
        }
    }
}

/// Deletes test-lab namespaces (`eglab<pid>x...`) whose process is gone (a test
/// run killed before its guards ran).
pub fn remove_stale_test_labs() {
    for name in netns::list() {
        let Some(rest) = name.strip_prefix(TEST_PREFIX) else { continue };
        let Some((pid, _)) = rest.split_once('x') else { continue };
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if !Path::new(&format!("/proc/{pid}")).exists() {
            NetNs::delete_all_with_prefix(&name);
        }
    }
}

fn mac(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// A running lab. Dropping it stops the server, ends every process started
/// in its namespaces (the gateway too) and deletes the namespaces.
#[derive(Debug)]
pub struct Lab {
    server: Option<Server>,
    opts: LabOptions,
    pods: BTreeMap<Pod, NetNs>,
    node: NetNs,
    gw: NetNs,
    up: NetNs,
    srv: NetNs,
    lan: Option<NetNs>,
    dir: PathBuf,
    own_dir: bool,
}

impl Lab {
    /// Builds the topology (and starts the server if asked). On error every
    /// namespace made so far is deleted.
    pub fn build(opts: LabOptions) -> Result<Self> {
        if opts.prefix.starts_with(TEST_PREFIX) {
            remove_stale_test_labs();
        }
        let p = &opts.prefix;
        let ns = |role: &str| NetNs::create(&format!("{p}-{role}"));
        let mut pods = BTreeMap::new();
        for pod in Pod::ALL {
            pods.insert(pod, ns(&format!("pod-{}", pod.name()))?);
        }
        let node = ns("node")?;
        let gw = ns("gw")?;
        let up = ns("up")?;
        let srv = ns("srv")?;
        let lan = if opts.arm == Arm::One { Some(ns("lan")?) } else { None };
        let (dir, own_dir) = match &opts.dir {
            Some(d) => (d.clone(), false),
            None => (std::env::temp_dir().join(format!("egret-lab-{p}")), true),
        };
        std::fs::create_dir_all(&dir).map_err(|e| LabError::io(format!("create {}", dir.display()), e))?;
        let mut lab = Self { server: None, opts, pods, node, gw, up, srv, lan, dir, own_dir };
        lab.wire()?;
        lab.set_offloads()?;
        lab.resolve_gateway_neighbors()?;
        if lab.opts.server {
            lab.server = Some(Server::start(&lab.srv, None)?);
        }
        Ok(lab)
    }

    fn wire(&self) -> Result<()> {
        // Sysctls first: `default.*` applies to interfaces created afterwards.
        // Forwarding without the reverse-path filter (redirects stay on,
        // but for the gateway's: below).
        let router = [
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ];
        for ns in self.pods.values() {
            sysctl::set(ns, &[&sysctl::COMMON, &sysctl::POD])?;
        }
        for ns in [&self.node, &self.gw, &self.up] {
            sysctl::set(ns, &[&sysctl::COMMON, &router])?;
        }
        // A one-arm gateway forwards the unselected pods' traffic out of the
        // interface it came in on: no ICMP redirects for that.
        sysctl::set(&self.gw, &[&["net.ipv4.conf.all.send_redirects=0", "net.ipv4.conf.default.send_redirects=0"]])?;
        sysctl::set(&self.srv, &[&sysctl::COMMON])?;
        if let Some(lan) = &self.lan {
            sysctl::set(lan, &[&sysctl::COMMON])?;
        }

        // Node router: the pod bridge and one veth per pod.
        let mut node =
            vec!["link add pods type bridge mcast_snooping 0".to_string(), "link set dev pods up".to_string()];
        for (a, len) in plan::NODE_POD_BRIDGE {
            node.push(format!("addr add {a}/{len} dev pods nodad"));
        }
        for (pod, ns) in &self.pods {
            let dev = format!("p-{}", pod.name());
            node.push(format!("link add {dev} type veth peer name eth0 netns {}", ns.name()));
            node.push(format!("link set dev {dev} master pods"));
            node.push(format!("link set dev {dev} up"));
        }
        let node_uplink = match &self.lan {
            None => format!(
                "link add gw address {} type veth peer name inside address {} netns {}",
                mac(plan::NODE_MAC),
                mac(plan::GW_IN),
                self.gw.name()
            ),
            Some(lan) => {
                format!("link add gw address {} type veth peer name p-node netns {}", mac(plan::NODE_MAC), lan.name())
            }
        };
        node.push(node_uplink);
        node.extend([
            format!("addr add {}/24 dev gw", plan::NODE),
            format!("addr add {}/64 dev gw nodad", plan::NODE6),
            "link set dev gw up".into(),
            format!("route add default via {}", plan::GW_INSIDE),
            format!("route add ::/0 via {}", plan::GW_INSIDE6),
        ]);
        self.node.ip_batch(&node)?;

        for (pod, ns) in &self.pods {
            let nodad = if pod.addr().is_ipv6() { " nodad" } else { "" };
            let default = if pod.addr().is_ipv6() { "::/0" } else { "default" };
            ns.ip_batch(&[
                format!("addr add {}/{} dev eth0{nodad}", pod.addr(), pod.prefix_len()),
                "link set dev eth0 up".into(),
                format!("route add {default} via {}", pod.first_hop()),
            ])?;
        }

        // Gateway.
        let mut gw = Vec::new();
        match &self.lan {
            None => {
                gw.push(format!(
                    "link add outside address {} type veth peer name gw address {} netns {}",
                    mac(plan::GW_OUT),
                    mac(plan::UP_MAC),
                    self.up.name()
                ));
                gw.extend([
                    format!("addr add {}/24 dev inside", plan::GW_INSIDE),
                    format!("addr add {}/64 dev inside nodad", plan::GW_INSIDE6),
                    format!("addr add {}/24 dev outside", plan::GW_OUTSIDE),
                    format!("addr add {}/64 dev outside nodad", plan::GW_OUTSIDE6),
                    "link set dev inside up".into(),
                    "link set dev outside up".into(),
                ]);
            }
            Some(lan) => {
                gw.push(format!(
                    "link add lan0 address {} type veth peer name p-gw netns {}",
                    mac(plan::GW_IN),
                    lan.name()
                ));
                gw.extend([
                    format!("addr add {}/24 dev lan0", plan::GW_INSIDE),
                    format!("addr add {}/64 dev lan0 nodad", plan::GW_INSIDE6),
                    format!("addr add {}/24 dev lan0", plan::GW_OUTSIDE),
                    format!("addr add {}/64 dev lan0 nodad", plan::GW_OUTSIDE6),
                    "link set dev lan0 up".into(),
                ]);
            }
        }
        gw.extend([
            format!("route add 198.18.0.0/16 via {}", plan::NODE),
            format!("route add 2001:db8:18::/48 via {}", plan::NODE6),
            format!("route add default via {}", plan::UPSTREAM),
            format!("route add ::/0 via {}", plan::UPSTREAM6),
        ]);
        self.gw.ip_batch(&gw)?;

        if let Some(lan) = &self.lan {
            // The upstream's port on the LAN.
            self.up.ip_batch(&[format!(
                "link add gw address {} type veth peer name p-up netns {}",
                mac(plan::UP_MAC),
                lan.name()
            )])?;
            lan.ip_batch(&[
                "link add lan type bridge mcast_snooping 0".into(),
                "link set dev lan up".into(),
                "link set dev p-node master lan".into(),
                "link set dev p-gw master lan".into(),
                "link set dev p-up master lan".into(),
                "link set dev p-node up".into(),
                "link set dev p-gw up".into(),
                "link set dev p-up up".into(),
            ])?;
        }

        // Upstream router: egress IPs are on-link on `gw` (Egret answers
        // ARP/NDP for them); the pods' prefixes route to the gateway.
        let mtu = self.opts.server_link_mtu.map(|m| format!(" mtu {m}")).unwrap_or_default();
        self.up.ip_batch(&[
            format!("addr add {}/24 dev gw", plan::UPSTREAM),
            format!("addr add {}/64 dev gw nodad", plan::UPSTREAM6),
            "link set dev gw up".into(),
            format!("link add srv{mtu} type veth peer name eth0 netns {}", self.srv.name()),
            format!("addr add {}/24 dev srv", plan::UPSTREAM_SRV),
            format!("addr add {}/64 dev srv nodad", plan::UPSTREAM_SRV6),
            "link set dev srv up".into(),
            format!("route add 198.18.0.0/16 via {}", plan::GW_OUTSIDE),
            format!("route add 192.0.2.0/24 via {}", plan::GW_OUTSIDE),
            format!("route add 2001:db8:18::/48 via {}", plan::GW_OUTSIDE6),
            format!("route add 2001:db8:2::/64 via {}", plan::GW_OUTSIDE6),
        ])?;

        let mut srv = Vec::new();
        for a in plan::server_addrs() {
            let len = if a.is_ipv6() { "64 dev eth0 nodad" } else { "24 dev eth0" };
            srv.push(format!("addr add {a}/{len}"));
        }
        srv.extend([
            "link set dev eth0 up".into(),
            format!("route add default via {}", plan::UPSTREAM_SRV),
            format!("route add ::/0 via {}", plan::UPSTREAM_SRV6),
        ]);
        self.srv.ip_batch(&srv)?;
        Ok(())
    }

    /// Veth features. The routers' ports facing the gateway get an XDP
    /// program that passes everything: a veth delivers the frames its peer
    /// sends with XDP_TX (the one-arm fast path) only when it has one, and
    /// those sent with XDP_REDIRECT only with one or with GRO on
    /// (docs/fast-path.md), as a real NIC always does. Without
    /// `tx_checksum_offload`, TX checksum offload goes off on every veth.
    fn set_offloads(&self) -> Result<()> {
        let peers: Vec<(&NetNs, &str)> = match &self.lan {
            None => vec![(&self.node, "gw"), (&self.up, "gw")],
            Some(lan) => vec![(lan, "p-gw")],
        };
        for (ns, dev) in peers {
            let ifindex = ns.ifindex(dev)?;
            ns.run_in(|| crate::sys::attach_xdp_pass(ifindex))?
                .map_err(|e| LabError::io(format!("XDP pass program on {dev} in {}", ns.name()), e))?;
        }
        if !self.opts.tx_checksum_offload {
            for ns in self.namespaces() {
                let links = ns.ip(&["-o", "link", "show", "type", "veth"])?;
                for dev in links.lines().filter_map(|l| l.split(": ").nth(1)) {
                    let dev = dev.split('@').next().unwrap_or(dev);
                    ns.exec(&["ethtool", "-K", dev, "tx", "off"])?;
                }
            }
        }
        Ok(())
    }

    /// Has the gateway's kernel resolve its next hops (node and upstream
    /// routers, both families) now, as a router that has been up for a while
    /// would have. Egret takes next hops from the kernel and drops a frame
    /// whose next hop is unresolved (counted `neighbor_unresolved`, with a
    /// resolution request); resolving first keeps each test's first packet
    /// from being that frame.
    fn resolve_gateway_neighbors(&self) -> Result<()> {
        let hops: [IpAddr; 4] = [plan::NODE.into(), plan::UPSTREAM.into(), plan::NODE6.into(), plan::UPSTREAM6.into()];
        self.gw.run_in(|| {
            for hop in hops {
                // Any datagram makes the kernel resolve the next hop; the
                // router answers port unreachable, which is ignored.
                if let Ok(s) = std::net::UdpSocket::bind(if hop.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }) {
                    let _ = s.send_to(b"resolve", std::net::SocketAddr::new(hop, 9));
                }
            }
        })?;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let table = self.gw.ip(&["neigh", "show"])?;
            let resolved = |hop: &IpAddr| {
                table
                    .lines()
                    .any(|l| l.starts_with(&format!("{hop} ")) && l.contains("lladdr") && !l.contains("FAILED"))
            };
            if hops.iter().all(resolved) {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(LabError::Timeout {
                    what: format!("the gateway's kernel to resolve {hops:?}; neighbours:\n{table}"),
                    after: std::time::Duration::from_secs(5),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// The options the lab was built with.
    pub fn options(&self) -> &LabOptions {
        &self.opts
    }

    /// The lab's directory (gateway config, admin socket, logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A pod's namespace.
    pub fn pod(&self, pod: Pod) -> &NetNs {
        // Every pod is inserted by `build`.
        &self.pods[&pod]
    }

    /// The node router's namespace.
    pub fn node(&self) -> &NetNs {
        &self.node
    }

    /// The gateway's namespace.
    pub fn gateway_ns(&self) -> &NetNs {
        &self.gw
    }

    /// The upstream router's namespace.
    pub fn upstream(&self) -> &NetNs {
        &self.up
    }

    /// The external server's namespace.
    pub fn server_ns(&self) -> &NetNs {
        &self.srv
    }

    /// The in-process server, if the lab started one.
    pub fn server(&self) -> Option<&Server> {
        self.server.as_ref()
    }

    /// The gateway's interfaces and their Egret roles.
    pub fn gateway_interfaces(&self) -> Vec<(&'static str, &'static str)> {
        match self.opts.arm {
            Arm::Two => vec![("inside", "inside"), ("outside", "outside")],
            Arm::One => vec![("lan0", "both")],
        }
    }

    /// The gateway's interface facing the upstream router.
    pub fn gateway_outside_dev(&self) -> &'static str {
        match self.opts.arm {
            Arm::Two => "outside",
            Arm::One => "lan0",
        }
    }

    /// The gateway's interface facing the node router.
    pub fn gateway_inside_dev(&self) -> &'static str {
        match self.opts.arm {
            Arm::Two => "inside",
            Arm::One => "lan0",
        }
    }

    /// The MAC the gateway sends from towards the upstream router.
    pub fn gateway_outside_mac(&self) -> [u8; 6] {
        match self.opts.arm {
            Arm::Two => plan::GW_OUT,
            Arm::One => plan::GW_IN,
        }
    }

    /// The MAC the node router sends the pods' traffic to.
    pub fn gateway_inside_mac(&self) -> [u8; 6] {
        plan::GW_IN
    }

    /// Every namespace of the lab.
    pub fn namespaces(&self) -> Vec<&NetNs> {
        let mut v: Vec<&NetNs> = self.pods.values().collect();
        v.extend([&self.node, &self.gw, &self.up, &self.srv]);
        v.extend(self.lan.iter());
        v
    }

    /// Leaves the namespaces (and the directory) in place when dropped: the
    /// CLI's `up` hands them to a later `down`.
    pub fn persist(mut self) {
        for ns in self.pods.values_mut() {
            ns.disown();
        }
        for ns in [&mut self.node, &mut self.gw, &mut self.up, &mut self.srv] {
            ns.disown();
        }
        if let Some(lan) = &mut self.lan {
            lan.disown();
        }
        self.own_dir = false;
    }

    /// A namespace of this lab by role name (`pod-a`, `node`, `gw`, ...).
    pub fn ns_by_role(&self, role: &str) -> Option<&NetNs> {
        let want = format!("{}-{role}", self.opts.prefix);
        self.namespaces().into_iter().find(|n| n.name() == want)
    }

    /// The address a pod's traffic to `dst` should leave with under the
    /// lab's default policies (docs/lab.md): "a" selects A, B and the IPv6
    /// pod towards everything but 198.51.100.128/25; "c" selects C towards
    /// 198.51.100.0/24. Anything else keeps the pod's own address.
    pub fn expected_source(pod: Pod, dst: IpAddr) -> IpAddr {
        let net = |s: &str| s.parse::<ipnet::IpNet>().ok();
        let inside = |s: &str| net(s).is_some_and(|n| n.contains(&dst));
        let selected = match pod {
            Pod::A | Pod::B | Pod::V6 => !inside("198.51.100.128/25"),
            Pod::C => inside("198.51.100.0/24"),
            Pod::U => false,
        };
        match pod.egress() {
            Some(e) if selected => e,
            _ => pod.addr(),
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        // Stop the server's threads before the namespaces go.
        self.server.take();
        if self.own_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
        // The namespaces' guards (fields) end their processes and delete them.
    }
}
