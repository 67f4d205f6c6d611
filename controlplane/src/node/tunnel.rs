//! The path to each next hop: on-link, through Egret's VXLAN device, or
//! none (docs/adr/0031-workers-in-any-subnet.md).
//!
//! The tunnel is VXLAN (RFC 7348) in metadata mode, not Geneve: the ADR's
//! amendment. Minimal cloud and VM kernels (Firecracker-style builds, the
//! project's own machines and CI among them) are built without Geneve
//! (`CONFIG_GENEVE` unset) while VXLAN is in every kernel a CNI runs on
//! (flannel and Docker's overlay need it).
//!
//! A next hop N (an egress IP or its companion next hop) is reachable with
//! today's `via N` route only when N is on one of the node's links. A node in
//! another subnet, as in every multi-zone cloud cluster, reaches it through a
//! router: the kernel refuses `via N` there ("Nexthop has invalid gateway").
//! Each pass therefore asks the kernel for its own route to N (`ip route get
//! N`, RTM_GETROUTE) and decides, per next hop, with [`decide`] (pure):
//!
//! - a route without a gateway: N is on a link; the on-link route, byte for
//!   byte as before;
//! - a route through a router: `via N dev egret-vxlan onlink` with a
//!   lightweight-tunnel encapsulation whose outer destination is N itself, so
//!   a failover (N moves with its Lease) changes nothing on the node;
//! - no route, or no InternalIP of N's family on the Node (the outer source
//!   the gateways check): none. The pod is not steered; it is counted and
//!   reported (status, metrics, a log line per change), never silently left
//!   going out with its node's address.
//!
//! [`steer`] then rewrites the plan: routes get their path, and a pod with a
//! next hop that has no path loses its table (and in strict mode stays
//! unclassified, so its traffic to outside the cluster is dropped, as when
//! the kernel refused its routes before).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::str::FromStr;

use egret_dataplane::wire::vxlan::{DEFAULT_PORT, OVERHEAD_V4, OVERHEAD_V6};

use super::plan::{Encap, Plan};

/// Egret's VXLAN device (kind `vxlan`, collect_md) on every node that
/// needs it.
pub const DEVICE: &str = "egret-vxlan";

/// The outer TTL / hop limit of encapsulated packets, set on every route.
/// A metadata-collecting (collect_md) VXLAN device takes the route's TTL
/// and falls back to the outer route's hop limit only when it is 0
/// (`vxlan_xmit_one`, drivers/net/vxlan/vxlan_core.c); writing it keeps the
/// outer TTL independent of the node's sysctls and of the device's driver
/// (other drivers send a 0 as it is, which the first router drops). 64 is
/// Linux's default `ip_default_ttl` (RFC 1700's recommendation).
pub const TUNNEL_TTL: u8 = 64;

/// The smallest route MTU the agent sets: IPv4's minimum (RFC 791, 68) and
/// IPv6's (RFC 8200 section 5, 1280; below it the kernel drops the device's
/// IPv6 state, `addrconf_notify` on NETDEV_CHANGEMTU).
const MIN_MTU_V4: u32 = 68;
const MIN_MTU_V6: u32 = 1280;

/// `--tunnel`: when next hops are reached through `egret-vxlan`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TunnelMode {
    /// Per next hop, from the node's route to it (the default).
    #[default]
    Auto,
    /// Never: a next hop behind a router gets no path (diagnosis).
    Never,
    /// Every next hop with a route, on-link ones too (benchmarks).
    Always,
}

impl FromStr for TunnelMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" | "auto" => Ok(TunnelMode::Auto),
            "never" => Ok(TunnelMode::Never),
            "always" => Ok(TunnelMode::Always),
            other => Err(format!("--tunnel: {other:?} is not auto, never or always")),
        }
    }
}

impl std::fmt::Display for TunnelMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TunnelMode::Auto => "auto",
            TunnelMode::Never => "never",
            TunnelMode::Always => "always",
        })
    }
}

/// The agent's tunnel settings (`--tunnel`, `--tunnel-port`, `--tunnel-mtu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TunnelOptions {
    /// When to encapsulate.
    pub mode: TunnelMode,
    /// The UDP destination port (the gateways' `tunnel-port`, ConfigMap
    /// `egret-cluster`; they must agree). It must differ from any other
    /// VXLAN device's port on the node, the CNI's above all (flannel and
    /// Cilium use 8472, Linux's default; the IANA port is 4789): the kernel
    /// keeps one metadata-collecting VXLAN device per port and one socket.
    pub port: u16,
    /// The underlay MTU towards every next hop, replacing what the node's
    /// routes say (a path with a smaller MTU between subnets).
    pub mtu: Option<u32>,
}

impl Default for TunnelOptions {
    fn default() -> Self {
        TunnelOptions { mode: TunnelMode::Auto, port: DEFAULT_PORT, mtu: None }
    }
}

/// What the node's routing says about one next hop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The kernel's route to it.
    Route {
        /// The route's gateway (a router), `None` when the next hop is on
        /// one of the node's links.
        gateway: Option<IpAddr>,
        /// The interface it leaves through.
        oif: u32,
        /// The underlay MTU: the route's `mtu` metric, else the interface's.
        mtu: u32,
        /// Whether the route leaves through `egret-vxlan` itself.
        through_tunnel: bool,
        /// Whether the next hop is one of the node's own addresses.
        local: bool,
    },
    /// No route (the kernel's answer, e.g. "Network is unreachable").
    NoRoute(String),
}

/// A next hop's path.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Path {
    /// `via N`: N is on a link.
    OnLink,
    /// `via N dev egret-vxlan onlink ... encap ip src SRC dst N`.
    Vxlan {
        /// The outer source: the Node's InternalIP of N's family.
        src: IpAddr,
        /// The route MTU (underlay minus the tunnel's overhead).
        mtu: u32,
    },
    /// Not steered; why.
    None(String),
}

impl Path {
    /// `onlink`, `vxlan` or `none` (status and metrics).
    pub fn kind(&self) -> &'static str {
        match self {
            Path::OnLink => "onlink",
            Path::Vxlan { .. } => "vxlan",
            Path::None(_) => "none",
        }
    }

    /// Why there is no path (`None` otherwise).
    pub fn reason(&self) -> Option<&str> {
        match self {
            Path::None(why) => Some(why),
            _ => None,
        }
    }
}

/// Every path kind, in metrics order.
pub const PATH_KINDS: [&str; 3] = ["onlink", "vxlan", "none"];

/// The encapsulation's overhead for `hop`'s family (outer IP, UDP, the
/// 8-byte VXLAN header, inner Ethernet: `wire::vxlan`).
pub fn overhead(hop: IpAddr) -> u32 {
    u32::from(if hop.is_ipv4() { OVERHEAD_V4 } else { OVERHEAD_V6 })
}

/// The path to `hop` (pure): from the node's route to it, the Node's
/// InternalIPs and the settings.
pub fn decide(hop: IpAddr, lookup: &Lookup, node_ips: &[IpAddr], opts: &TunnelOptions) -> Path {
    let (gateway, underlay) = match lookup {
        Lookup::NoRoute(why) => return Path::None(format!("no route to {hop}: {why}")),
        Lookup::Route { local: true, .. } => {
            return Path::None(format!("{hop} is one of this node's own addresses"));
        }
        Lookup::Route { through_tunnel: true, .. } => {
            return Path::None(format!("the node's route to {hop} leaves through {DEVICE} itself"));
        }
        Lookup::Route { gateway, mtu, .. } => (*gateway, *mtu),
    };
    let encapsulate = match opts.mode {
        TunnelMode::Auto => gateway.is_some(),
        TunnelMode::Always => true,
        TunnelMode::Never => {
            if let Some(g) = gateway {
                return Path::None(format!("{hop} is reached through router {g} and --tunnel=never"));
            }
            false
        }
    };
    if !encapsulate {
        return Path::OnLink;
    }
    let Some(src) = node_ips.iter().copied().find(|a| a.is_ipv4() == hop.is_ipv4()) else {
        let fam = if hop.is_ipv4() { "IPv4" } else { "IPv6" };
        return Path::None(format!(
            "{hop} needs the tunnel (via {}) and the Node has no {fam} InternalIP for the outer source",
            gateway.map_or_else(|| "--tunnel=always".to_string(), |g| g.to_string())
        ));
    };
    let underlay = opts.mtu.unwrap_or(underlay);
    let min = if hop.is_ipv4() { MIN_MTU_V4 } else { MIN_MTU_V6 };
    match underlay.checked_sub(overhead(hop)).filter(|m| *m >= min) {
        Some(mtu) => Path::Vxlan { src, mtu },
        None => Path::None(format!(
            "underlay MTU {underlay} towards {hop}{} leaves less than {min} after the tunnel's {} bytes",
            if opts.mtu.is_some() { " (--tunnel-mtu)" } else { "" },
            overhead(hop)
        )),
    }
}

/// The MTU `egret-vxlan` gets: the smallest encapsulated route's, or `None`
/// when no next hop needs the device.
pub fn device_mtu(paths: &BTreeMap<IpAddr, Path>) -> Option<u32> {
    paths.values().filter_map(|p| if let Path::Vxlan { mtu, .. } = p { Some(*mtu) } else { None }).min()
}

/// A plan with its paths applied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Steering {
    /// What the kernel gets: pods whose every next hop has a path, their
    /// routes on that path.
    pub plan: Plan,
    /// Selected pod addresses not steered: a next hop of theirs has no path.
    pub unsteered: BTreeSet<IpAddr>,
}

/// Applies `paths` to `plan`. A next hop missing from `paths` has no path.
/// A pod with any next hop without a path is not steered at all: a
/// partial table would send some of its destinations out with the node's
/// address and still count the pod as steered.
pub fn steer(plan: &Plan, paths: &BTreeMap<IpAddr, Path>) -> Steering {
    let mut out = Steering { plan: plan.clone(), unsteered: BTreeSet::new() };
    out.plan.pods.clear();
    out.plan.next_hops.clear();
    'pods: for (pod, routes) in &plan.pods {
        let mut set = super::plan::RouteSet::new();
        for r in routes {
            let mut r = *r;
            if let Some(hop) = r.via {
                match paths.get(&hop) {
                    Some(Path::OnLink) => {}
                    Some(Path::Vxlan { src, mtu }) => {
                        r.encap = Some(Encap { src: *src, dst: hop, mtu: *mtu, ttl: TUNNEL_TTL });
                    }
                    Some(Path::None(_)) | None => {
                        out.unsteered.insert(*pod);
                        continue 'pods;
                    }
                }
            }
            set.insert(r);
        }
        out.plan.next_hops.extend(set.iter().filter_map(|r| r.via));
        out.plan.pods.insert(*pod, set);
    }
    out
}

/// Selected pod addresses per next hop without a path (status).
pub fn unsteered_per_hop(plan: &Plan, paths: &BTreeMap<IpAddr, Path>) -> BTreeMap<IpAddr, usize> {
    let mut out = BTreeMap::new();
    for routes in plan.pods.values() {
        let hops: BTreeSet<IpAddr> = routes.iter().filter_map(|r| r.via).collect();
        for h in hops.into_iter().filter(|h| !matches!(paths.get(h), Some(Path::OnLink | Path::Vxlan { .. }))) {
            *out.entry(h).or_insert(0) += 1;
        }
    }
    out
}

/// Each next hop's path, from the node's routing now (`Kernel::route_to`).
pub async fn paths(
    kernel: &mut super::kernel::Kernel,
    hops: &BTreeSet<IpAddr>,
    node_ips: &[IpAddr],
    opts: &TunnelOptions,
) -> Result<BTreeMap<IpAddr, Path>, super::kernel::KernelError> {
    let mut out = BTreeMap::new();
    for hop in hops {
        let lookup = kernel.route_to(*hop).await?;
        out.insert(*hop, decide(*hop, &lookup, node_ips, opts));
    }
    Ok(out)
}

/// Makes `egret-vxlan` right when some path needs it. If it cannot be made,
/// those paths become none (their pods are then not steered) and the error
/// is returned for the pass's list. The device is removed by
/// [`retire_device`] once no path needs it.
pub async fn ensure_device(
    kernel: &mut super::kernel::Kernel,
    paths: &mut BTreeMap<IpAddr, Path>,
    opts: &TunnelOptions,
) -> Option<String> {
    let mtu = device_mtu(paths)?;
    match kernel.ensure_tunnel(opts.port, mtu).await {
        Ok(_) => None,
        Err(e) => {
            let why = e.to_string();
            for p in paths.values_mut().filter(|p| matches!(p, Path::Vxlan { .. })) {
                *p = Path::None(format!("the tunnel device was refused: {why}"));
            }
            Some(why)
        }
    }
}

/// Removes `egret-vxlan` when no path needs it (after the pass removed the
/// routes through it). A node whose next hops are all on its links then
/// holds no device and no UDP socket on the tunnel port (the device listens
/// on it: whatever arrives there is decapsulated, then dropped by the
/// agent's nftables table), exactly as before the tunnel existed.
pub async fn retire_device(
    kernel: &mut super::kernel::Kernel,
    paths: &BTreeMap<IpAddr, Path>,
) -> Result<bool, super::kernel::KernelError> {
    if device_mtu(paths).is_some() {
        return Ok(false);
    }
    kernel.remove_tunnel().await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::node::plan::{Route, RouteSet};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn route(gateway: Option<&str>, mtu: u32) -> Lookup {
        Lookup::Route { gateway: gateway.map(ip), oif: 2, mtu, through_tunnel: false, local: false }
    }
    fn opts(mode: TunnelMode) -> TunnelOptions {
        TunnelOptions { mode, ..Default::default() }
    }

    #[test]
    fn the_path_follows_the_route_the_addresses_and_the_flag() {
        let node = [ip("192.0.2.7"), ip("2001:db8:2::7")];
        let v4_only = [ip("192.0.2.7")];
        let (n4, n6) = (ip("203.0.113.40"), ip("2001:db8:113::40"));
        let auto = opts(TunnelMode::Auto);
        // On a link: today's route.
        assert_eq!(decide(n4, &route(None, 1500), &node, &auto), Path::OnLink);
        assert_eq!(decide(n6, &route(None, 1500), &node, &auto), Path::OnLink);
        // Through a router: the tunnel, MTU minus 50 / 70.
        assert_eq!(
            decide(n4, &route(Some("192.0.2.1"), 1500), &node, &auto),
            Path::Vxlan { src: ip("192.0.2.7"), mtu: 1450 }
        );
        assert_eq!(
            decide(n6, &route(Some("fe80::1"), 9001), &node, &auto),
            Path::Vxlan { src: ip("2001:db8:2::7"), mtu: 8931 }
        );
        // --tunnel-mtu replaces the route's.
        let small = TunnelOptions { mtu: Some(1400), ..auto };
        assert_eq!(
            decide(n4, &route(Some("192.0.2.1"), 9001), &node, &small),
            Path::Vxlan { src: ip("192.0.2.7"), mtu: 1350 }
        );
        // No InternalIP of the family, no route, a local address, a loop.
        let p = decide(n6, &route(Some("fe80::1"), 1500), &v4_only, &auto);
        assert!(p.reason().unwrap().contains("no IPv6 InternalIP"), "{p:?}");
        let p = decide(n4, &Lookup::NoRoute("Network is unreachable".into()), &node, &auto);
        assert_eq!(p.reason().unwrap(), "no route to 203.0.113.40: Network is unreachable");
        let local = Lookup::Route { gateway: None, oif: 1, mtu: 65536, through_tunnel: false, local: true };
        assert_eq!(decide(n4, &local, &node, &auto).kind(), "none");
        let looped = Lookup::Route { gateway: None, oif: 9, mtu: 1450, through_tunnel: true, local: false };
        assert!(decide(n4, &looped, &node, &auto).reason().unwrap().contains("egret-vxlan itself"));
        // Too small an underlay for IPv6 after the overhead.
        let p = decide(n6, &route(Some("fe80::1"), 1300), &node, &auto);
        assert!(p.reason().unwrap().contains("less than 1280"), "{p:?}");
        // never: behind a router there is no path; on a link, on-link.
        let never = opts(TunnelMode::Never);
        assert!(decide(n4, &route(Some("192.0.2.1"), 1500), &node, &never)
            .reason()
            .unwrap()
            .contains("--tunnel=never"));
        assert_eq!(decide(n4, &route(None, 1500), &node, &never), Path::OnLink);
        // always: on-link next hops are encapsulated too; no route is none.
        let always = opts(TunnelMode::Always);
        assert_eq!(decide(n4, &route(None, 1500), &node, &always), Path::Vxlan { src: ip("192.0.2.7"), mtu: 1450 });
        assert_eq!(decide(n4, &Lookup::NoRoute("x".into()), &node, &always).kind(), "none");
    }

    #[test]
    fn the_flag_parses_and_names_itself() {
        assert_eq!("auto".parse::<TunnelMode>(), Ok(TunnelMode::Auto));
        assert_eq!("".parse::<TunnelMode>(), Ok(TunnelMode::Auto));
        assert_eq!(" always".parse::<TunnelMode>(), Ok(TunnelMode::Always));
        assert_eq!("never".parse::<TunnelMode>(), Ok(TunnelMode::Never));
        assert_eq!("on".parse::<TunnelMode>().unwrap_err(), "--tunnel: \"on\" is not auto, never or always");
    }

    #[test]
    fn steering_applies_paths_and_a_pod_without_a_path_is_not_steered() {
        let net = |s: &str| s.parse().unwrap();
        let via = |d: &str, h: &str| Route { dst: net(d), via: Some(ip(h)), encap: None };
        let throw = |d: &str| Route { dst: net(d), via: None, encap: None };
        let mut plan = Plan::default();
        plan.pods.insert(ip("198.18.0.10"), RouteSet::from([via("0.0.0.0/0", "203.0.113.40"), throw("198.18.0.0/16")]));
        plan.pods.insert(ip("198.18.0.11"), RouteSet::from([via("0.0.0.0/0", "203.0.113.41"), throw("198.18.0.0/16")]));
        plan.pods.insert(
            ip("198.18.0.12"),
            RouteSet::from([via("0.0.0.0/0", "203.0.113.40"), via("198.51.100.0/24", "203.0.113.42")]),
        );
        plan.next_hops = ["203.0.113.40", "203.0.113.41", "203.0.113.42"].iter().map(|s| ip(s)).collect();
        let paths = BTreeMap::from([
            (ip("203.0.113.40"), Path::Vxlan { src: ip("192.0.2.7"), mtu: 1450 }),
            (ip("203.0.113.41"), Path::OnLink),
            (ip("203.0.113.42"), Path::None("no route".into())),
        ]);
        let s = steer(&plan, &paths);
        let encap = Encap { src: ip("192.0.2.7"), dst: ip("203.0.113.40"), mtu: 1450, ttl: TUNNEL_TTL };
        assert_eq!(
            s.plan.pods[&ip("198.18.0.10")],
            RouteSet::from([Route { encap: Some(encap), ..via("0.0.0.0/0", "203.0.113.40") }, throw("198.18.0.0/16")])
        );
        assert_eq!(s.plan.pods[&ip("198.18.0.11")], plan.pods[&ip("198.18.0.11")], "on-link: unchanged");
        assert!(!s.plan.pods.contains_key(&ip("198.18.0.12")), "a next hop without a path: not steered at all");
        assert_eq!(s.unsteered, BTreeSet::from([ip("198.18.0.12")]));
        assert_eq!(s.plan.next_hops, BTreeSet::from([ip("203.0.113.40"), ip("203.0.113.41")]));
        assert_eq!(unsteered_per_hop(&plan, &paths), BTreeMap::from([(ip("203.0.113.42"), 1)]));
        assert_eq!(device_mtu(&paths), Some(1450));
        assert_eq!(device_mtu(&BTreeMap::from([(ip("203.0.113.41"), Path::OnLink)])), None);
    }
}
