//! The node's policy-routing rules and tables over rtnetlink (no `ip`).
//!
//! What belongs to Egret is marked, so a restart can find it and `egret
//! node cleanup` can remove exactly it: rules carry the protocol number
//! [`RTPROT_EGRET`] (`FRA_PROTOCOL`, Linux 4.17+) and sit at the agent's
//! priority; routes carry the same protocol (`rtm_protocol`) in the agent's
//! table range. `ip rule show` / `ip route show table all` print it as
//! `proto 233`.
//!
//! A next hop behind a router (`tunnel.rs`) is reached through Egret's own
//! VXLAN device (RFC 7348, collect_md) [`DEVICE`] (`egret-vxlan`): VXLAN
//! rather than Geneve because minimal kernels, this project's included,
//! are built without Geneve. This module creates, repairs and removes the
//! device, and writes and reads back the encapsulated routes through it
//! (`RTA_ENCAP_TYPE`, `RTA_ENCAP`, `RTA_METRICS`, `RTNH_F_ONLINK`).

use std::io;
use std::net::IpAddr;

use egret_dataplane::wire::vxlan::EGRET_VNI;
use ipnet::IpNet;
use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST};
use netlink_packet_route::address::{
    AddressAttribute, AddressHeaderFlags, AddressMessage, AddressProtocol, AddressScope,
};
use netlink_packet_route::link::{
    AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo,
    LinkMessage,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteIp6Tunnel, RouteIp6TunnelFlags, RouteIpTunnel, RouteLwEnCapType,
    RouteLwTunnelEncap, RouteMessage, RouteMetric, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

use super::plan::{Encap, Route};
use super::reconcile::{KernelRule, KernelView, Op, RuleShape, TableRange};
use super::tunnel::{Lookup, DEVICE};
use crate::netlink::Requests;

mod device;

/// The protocol number on Egret's rules and routes.
pub const RTPROT_EGRET: u8 = 233;

/// What failed talking to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// The socket could not be opened.
    #[error(transparent)]
    Socket(#[from] crate::netlink::NetlinkError),
    /// A dump failed.
    #[error("dumping {what}: {source}")]
    Dump {
        /// Rules or routes.
        what: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// `egret-vxlan` exists and is not Egret's (another kind of device): it
    /// is left alone and next hops behind a router get no path.
    #[error("link {DEVICE}: {0}")]
    Device(String),
    /// A change was refused.
    #[error("{op}: {source}")]
    Change {
        /// The operation, as `ip` would print it.
        op: String,
        /// Why.
        #[source]
        source: io::Error,
    },
}

fn family(ip: IpAddr) -> AddressFamily {
    if ip.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    }
}

fn route_address(ip: IpAddr) -> RouteAddress {
    match ip {
        IpAddr::V4(a) => RouteAddress::Inet(a),
        IpAddr::V6(a) => RouteAddress::Inet6(a),
    }
}

fn address_of(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(a) => Some(IpAddr::V4(*a)),
        RouteAddress::Inet6(a) => Some(IpAddr::V6(*a)),
        _ => None,
    }
}

fn host_len(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

/// The route message for `route` in `table`; an encapsulated route leaves
/// through `tunnel` (`egret-vxlan`'s index; `None` when deleting, where the
/// kernel matches without it).
fn route_message(table: u32, route: &Route, tunnel: Option<u32>) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(route.dst.addr());
    m.header.destination_prefix_length = route.dst.prefix_len();
    m.header.protocol = RouteProtocol::Other(RTPROT_EGRET);
    m.header.scope = RouteScope::Universe;
    m.header.kind = if route.via.is_some() { RouteType::Unicast } else { RouteType::Throw };
    m.attributes.push(RouteAttribute::Table(table));
    if route.dst.prefix_len() > 0 {
        m.attributes.push(RouteAttribute::Destination(route_address(route.dst.addr())));
    }
    if let Some(via) = route.via {
        m.attributes.push(RouteAttribute::Gateway(route_address(via)));
    }
    if let (Some(_), Some(e)) = (route.via, route.encap) {
        // `onlink`: the next hop is not on egret-vxlan's (absent) subnet; the
        // device is NOARP, so its neighbour is NUD_NOARP and needs no
        // resolution (arp_constructor / ndisc_constructor).
        m.header.flags = RouteFlags::Onlink;
        if let Some(oif) = tunnel {
            m.attributes.push(RouteAttribute::Oif(oif));
        }
        // Forwarding honours the route's MTU (ip_dst_mtu_maybe_forward,
        // include/net/ip.h): an oversized packet gets Fragmentation Needed /
        // Packet Too Big from this node.
        m.attributes.push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(e.mtu)]));
        let id = u64::from(EGRET_VNI);
        match (e.src, e.dst) {
            (IpAddr::V4(src), IpAddr::V4(dst)) => {
                m.attributes.push(RouteAttribute::EncapType(RouteLwEnCapType::Ip));
                m.attributes.push(RouteAttribute::Encap(vec![
                    RouteLwTunnelEncap::Ip(RouteIpTunnel::Id(id)),
                    RouteLwTunnelEncap::Ip(RouteIpTunnel::Source(src)),
                    RouteLwTunnelEncap::Ip(RouteIpTunnel::Destination(dst)),
                    RouteLwTunnelEncap::Ip(RouteIpTunnel::Ttl(e.ttl)),
                ]));
            }
            (src, dst) => {
                let v6 = |a: IpAddr| match a {
                    IpAddr::V6(a) => a,
                    IpAddr::V4(a) => a.to_ipv6_mapped(),
                };
                m.attributes.push(RouteAttribute::EncapType(RouteLwEnCapType::Ip6));
                m.attributes.push(RouteAttribute::Encap(vec![
                    RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Id(id)),
                    RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Source(v6(src))),
                    RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Destination(v6(dst))),
                    RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Hoplimit(e.ttl)),
                    // A UDP checksum over IPv6: a collect_md VXLAN device
                    // computes it only for a route with this flag
                    // (TUNNEL_CSUM; vxlan_xmit_one passes !udp_sum as
                    // udp_tunnel6_xmit_skb's nocheck, and the device's own
                    // IFLA_VXLAN_UDP_ZERO_CSUM6_TX is not consulted in
                    // metadata mode). A zero checksum over IPv6 is allowed
                    // only under RFC 6936's conditions (RFC 8200 section
                    // 8.1), and a receiving stack drops it. IPv4 keeps a
                    // zero checksum, which RFC 7348 section 5 allows.
                    RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Flags(RouteIp6TunnelFlags::Checksum)),
                ]));
            }
        }
    }
    m
}

/// The encapsulation of a route in a dump. Missing fields read as
/// unspecified / 0, so such a route never equals a wanted one and is
/// replaced.
fn parse_encap(m: &RouteMessage) -> Option<Encap> {
    let unspecified = if m.header.address_family == AddressFamily::Inet6 {
        IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
    };
    let mut e = Encap { src: unspecified, dst: unspecified, mtu: 0, ttl: 0 };
    let mut found = false;
    for a in &m.attributes {
        match a {
            RouteAttribute::Encap(list) => {
                found = true;
                for x in list {
                    match x {
                        RouteLwTunnelEncap::Ip(RouteIpTunnel::Source(a)) => e.src = IpAddr::V4(*a),
                        RouteLwTunnelEncap::Ip(RouteIpTunnel::Destination(a)) => e.dst = IpAddr::V4(*a),
                        RouteLwTunnelEncap::Ip(RouteIpTunnel::Ttl(t)) => e.ttl = *t,
                        RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Source(a)) => e.src = IpAddr::V6(*a),
                        RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Destination(a)) => e.dst = IpAddr::V6(*a),
                        RouteLwTunnelEncap::Ip6(RouteIp6Tunnel::Hoplimit(t)) => e.ttl = *t,
                        _ => {}
                    }
                }
            }
            RouteAttribute::Metrics(ms) => {
                for x in ms {
                    if let RouteMetric::Mtu(v) = x {
                        e.mtu = *v;
                    }
                }
            }
            _ => {}
        }
    }
    found.then_some(e)
}

fn rule_message(r: &KernelRule) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = family(r.pod);
    m.header.src_len = host_len(r.pod);
    m.header.action = RuleAction::ToTable;
    m.attributes.push(RuleAttribute::Source(r.pod));
    m.attributes.push(RuleAttribute::Table(r.table));
    m.attributes.push(RuleAttribute::Priority(r.priority));
    if r.fwmask != 0 {
        m.attributes.push(RuleAttribute::FwMark(r.fwmark));
        m.attributes.push(RuleAttribute::FwMask(r.fwmask));
    }
    m.attributes.push(RuleAttribute::Protocol(RouteProtocol::Other(RTPROT_EGRET)));
    m
}

/// An Egret rule in a dump (any priority), or `None`.
pub fn parse_rule(m: &RuleMessage) -> Option<KernelRule> {
    let mut source = None;
    let mut table = u32::from(m.header.table);
    let (mut priority, mut fwmark, mut fwmask) = (0, 0, None);
    let mut ours = false;
    for a in &m.attributes {
        match a {
            RuleAttribute::Source(ip) => source = Some(*ip),
            RuleAttribute::Table(t) => table = *t,
            RuleAttribute::Priority(p) => priority = *p,
            RuleAttribute::FwMark(v) => fwmark = *v,
            RuleAttribute::FwMask(v) => fwmask = Some(*v),
            RuleAttribute::Protocol(RouteProtocol::Other(p)) => ours = *p == RTPROT_EGRET,
            _ => {}
        }
    }
    let pod = source?;
    // A fwmark without a mask matches all 32 bits (`ip rule ... fwmark M`).
    let fwmask = match fwmask {
        Some(mask) => mask,
        None if fwmark != 0 => u32::MAX,
        None => 0,
    };
    (ours && m.header.src_len == host_len(pod) && m.header.action == RuleAction::ToTable).then_some(KernelRule {
        pod,
        table,
        priority,
        fwmark,
        fwmask,
    })
}

/// An Egret route in `range` from a dump: (table, route), or `None`.
pub fn parse_route(m: &RouteMessage, range: TableRange) -> Option<(u32, Route)> {
    if m.header.protocol != RouteProtocol::Other(RTPROT_EGRET) {
        return None;
    }
    let mut table = u32::from(m.header.table);
    let mut dst = None;
    let mut via = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(d) => dst = address_of(d),
            RouteAttribute::Gateway(g) => via = address_of(g),
            _ => {}
        }
    }
    if !range.contains(table) {
        return None;
    }
    let dst = match (dst, m.header.address_family) {
        (Some(d), _) => d,
        (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        (None, AddressFamily::Inet6) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        _ => return None,
    };
    let dst = IpNet::new(dst, m.header.destination_prefix_length).ok()?;
    let via = match m.header.kind {
        RouteType::Throw => None,
        RouteType::Unicast => Some(via?),
        _ => return None,
    };
    let encap = via.and(parse_encap(m));
    Some((table, Route { dst, via, encap }))
}

/// A route message's table.
fn table_of(m: &RouteMessage) -> Option<u32> {
    let attr = m.attributes.iter().find_map(|a| if let RouteAttribute::Table(t) = a { Some(*t) } else { None });
    Some(attr.unwrap_or(u32::from(m.header.table)))
}

/// The rtnetlink side of the agent.
pub struct Kernel {
    requests: Requests,
    range: TableRange,
    /// `egret-vxlan`'s index, once [`Kernel::ensure_tunnel`] found or made it.
    tunnel: Option<u32>,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel").field("range", &self.range).finish()
    }
}

fn describe(op: &Op, shape: RuleShape) -> String {
    let rule = |verb: &str, r: &KernelRule| {
        let mark = if r.fwmask == 0 { String::new() } else { format!(" fwmark {:#x}/{:#x}", r.fwmark, r.fwmask) };
        format!("rule {verb} from {}{mark} lookup {} priority {}", r.pod, r.table, r.priority)
    };
    match op {
        Op::AddRoute { table, route } => format!("route add {route} table {table}"),
        Op::DelRoute { table, route } => format!("route del {route} table {table}"),
        Op::AddRule { pod, table } => rule("add", &shape.rule(*pod, *table)),
        Op::DelRule(r) => rule("del", r),
    }
}

impl Kernel {
    /// Opens an rtnetlink socket in the current network namespace.
    pub fn open(range: TableRange) -> Result<Self, KernelError> {
        Ok(Kernel { requests: Requests::open()?, range, tunnel: None })
    }

    /// Egret's rules (any priority) and its tables in the range.
    pub async fn view(&mut self) -> Result<KernelView, KernelError> {
        let dump = NLM_F_REQUEST | NLM_F_DUMP;
        let mut view = KernelView::default();
        let rules = self
            .requests
            .call(RouteNetlinkMessage::GetRule(RuleMessage::default()), dump)
            .await
            .map_err(|source| KernelError::Dump { what: "rules", source })?;
        for m in rules {
            if let RouteNetlinkMessage::NewRule(r) = m {
                view.rules.extend(parse_rule(&r));
            }
        }
        for fam in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut q = RouteMessage::default();
            q.header.address_family = fam;
            let routes = self
                .requests
                .call(RouteNetlinkMessage::GetRoute(q), dump)
                .await
                .map_err(|source| KernelError::Dump { what: "routes", source })?;
            for m in routes {
                if let RouteNetlinkMessage::NewRoute(r) = m {
                    if let Some((t, route)) = parse_route(&r, self.range) {
                        view.tables.entry(t).or_default().insert(route);
                    } else if let Some(t) = table_of(&r).filter(|t| self.range.contains(*t)) {
                        view.foreign.insert(t);
                    }
                }
            }
        }
        view.rules.sort();
        Ok(view)
    }

    /// Applies one operation. Adding what exists and deleting what is gone
    /// succeed (the kernel is already as wanted).
    /// New rules get `shape`.
    pub async fn apply(&mut self, op: &Op, shape: RuleShape) -> Result<(), KernelError> {
        let add = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;
        let del = NLM_F_REQUEST | NLM_F_ACK;
        let (msg, flags) = match op {
            Op::AddRoute { table, route } => {
                if route.encap.is_some() && self.tunnel.is_none() {
                    return Err(KernelError::Device(format!(
                        "missing: cannot add {route} table {table} (the device could not be made)"
                    )));
                }
                (RouteNetlinkMessage::NewRoute(route_message(*table, route, self.tunnel)), add)
            }
            Op::DelRoute { table, route } => (RouteNetlinkMessage::DelRoute(route_message(*table, route, None)), del),
            Op::AddRule { pod, table } => (RouteNetlinkMessage::NewRule(rule_message(&shape.rule(*pod, *table))), add),
            Op::DelRule(r) => (RouteNetlinkMessage::DelRule(rule_message(r)), del),
        };
        match self.requests.call(msg, flags).await {
            Ok(_) => Ok(()),
            Err(e) if flags & NLM_F_CREATE != 0 && e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            Err(e) if flags & NLM_F_CREATE == 0 && matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => {
                Ok(())
            }
            Err(source) => Err(KernelError::Change { op: describe(op, shape), source }),
        }
    }

    /// Egret's own addresses (`PerNode` policies; marked with protocol
    /// [`RTPROT_EGRET`], `IFA_PROTO`): (interface index, address).
    pub async fn addresses(&mut self) -> Result<Vec<(u32, IpAddr)>, KernelError> {
        let dump = NLM_F_REQUEST | NLM_F_DUMP;
        let msgs = self
            .requests
            .call(RouteNetlinkMessage::GetAddress(AddressMessage::default()), dump)
            .await
            .map_err(|source| KernelError::Dump { what: "addresses", source })?;
        let mut out = Vec::new();
        for m in msgs {
            let RouteNetlinkMessage::NewAddress(a) = m else { continue };
            let ours = a.attributes.contains(&AddressAttribute::Protocol(AddressProtocol::Other(RTPROT_EGRET)));
            let ip = a.attributes.iter().find_map(|x| match x {
                AddressAttribute::Local(ip) => Some(*ip),
                AddressAttribute::Address(ip) if a.header.family == AddressFamily::Inet6 => Some(*ip),
                _ => None,
            });
            if let (true, Some(ip)) = (ours, ip) {
                out.push((a.header.index, ip));
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// The interface of the main table's default route of `ip`'s family.
    pub async fn default_interface(&mut self, ip: IpAddr) -> Result<Option<u32>, KernelError> {
        let mut q = RouteMessage::default();
        q.header.address_family = family(ip);
        let routes = self
            .requests
            .call(RouteNetlinkMessage::GetRoute(q), NLM_F_REQUEST | NLM_F_DUMP)
            .await
            .map_err(|source| KernelError::Dump { what: "routes", source })?;
        for m in routes {
            let RouteNetlinkMessage::NewRoute(r) = m else { continue };
            let table =
                r.attributes.iter().find_map(|a| if let RouteAttribute::Table(t) = a { Some(*t) } else { None });
            let main = table.unwrap_or(u32::from(r.header.table)) == 254;
            if main && r.header.destination_prefix_length == 0 && r.header.kind == RouteType::Unicast {
                if let Some(oif) =
                    r.attributes.iter().find_map(|a| if let RouteAttribute::Oif(o) = a { Some(*o) } else { None })
                {
                    return Ok(Some(oif));
                }
            }
        }
        Ok(None)
    }

    /// Adds (`add`) or removes one of Egret's own addresses, as a host
    /// address (/32, /128; no DAD) on interface `index`.
    pub async fn address(&mut self, add: bool, index: u32, ip: IpAddr) -> Result<(), KernelError> {
        let mut m = AddressMessage::default();
        m.header.family = family(ip);
        m.header.prefix_len = host_len(ip);
        m.header.index = index;
        m.header.scope = AddressScope::Universe;
        if ip.is_ipv6() {
            m.header.flags = AddressHeaderFlags::Nodad;
        }
        m.attributes.push(AddressAttribute::Local(ip));
        m.attributes.push(AddressAttribute::Address(ip));
        m.attributes.push(AddressAttribute::Protocol(AddressProtocol::Other(RTPROT_EGRET)));
        let (msg, flags) = if add {
            (RouteNetlinkMessage::NewAddress(m), NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL)
        } else {
            (RouteNetlinkMessage::DelAddress(m), NLM_F_REQUEST | NLM_F_ACK)
        };
        let op = format!("address {} {ip}/{} dev #{index}", if add { "add" } else { "del" }, host_len(ip));
        match self.requests.call(msg, flags).await {
            Ok(_) => Ok(()),
            Err(e) if add && e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            Err(e) if !add && matches!(e.raw_os_error(), Some(libc::EADDRNOTAVAIL | libc::ENOENT)) => Ok(()),
            Err(source) => Err(KernelError::Change { op, source }),
        }
    }

    /// Removes every Egret rule (any priority), route (in the range) and address.
    pub async fn remove_all(&mut self) -> Result<usize, KernelError> {
        let view = self.view().await?;
        let mut n = 0;
        for (index, ip) in self.addresses().await? {
            self.address(false, index, ip).await?;
            n += 1;
        }
        for r in &view.rules {
            self.apply(&Op::DelRule(*r), RuleShape { priority: r.priority, mark: r.fwmark }).await?;
            n += 1;
        }
        for (t, routes) in &view.tables {
            for route in routes {
                self.apply(&Op::DelRoute { table: *t, route: *route }, RuleShape { priority: 0, mark: 0 }).await?;
                n += 1;
            }
        }
        if self.remove_tunnel().await? {
            n += 1;
        }
        Ok(n)
    }

    /// The node's own route to `hop` (`ip route get HOP`: the lookup the
    /// outer packets take, through the host's own rules; Egret's rules
    /// match only pod sources), with the underlay MTU: the route's `mtu`
    /// metric (or a learned path MTU), else its interface's.
    pub async fn route_to(&mut self, hop: IpAddr) -> Result<Lookup, KernelError> {
        let mut q = RouteMessage::default();
        q.header.address_family = family(hop);
        q.header.destination_prefix_length = host_len(hop);
        q.attributes.push(RouteAttribute::Destination(route_address(hop)));
        let reply = match self.requests.call(RouteNetlinkMessage::GetRoute(q), NLM_F_REQUEST).await {
            Ok(r) => r,
            // ENETUNREACH, EHOSTUNREACH (unreachable), EACCES (prohibit),
            // EINVAL (blackhole): the kernel has no usable route.
            Err(e) => return Ok(Lookup::NoRoute(e.to_string())),
        };
        let Some(r) =
            reply.into_iter().find_map(|m| if let RouteNetlinkMessage::NewRoute(r) = m { Some(r) } else { None })
        else {
            return Ok(Lookup::NoRoute("the kernel answered without a route".into()));
        };
        let (mut gateway, mut oif, mut mtu) = (None, None, None);
        for a in &r.attributes {
            match a {
                RouteAttribute::Gateway(g) => gateway = address_of(g),
                RouteAttribute::Oif(o) => oif = Some(*o),
                RouteAttribute::Metrics(ms) => {
                    mtu = ms.iter().find_map(|x| if let RouteMetric::Mtu(v) = x { Some(*v) } else { None })
                }
                _ => {}
            }
        }
        let local = r.header.kind == RouteType::Local;
        if !local && r.header.kind != RouteType::Unicast {
            return Ok(Lookup::NoRoute(format!("route type {:?}", r.header.kind)));
        }
        let Some(oif) = oif else {
            return Ok(Lookup::NoRoute("the route has no interface".into()));
        };
        let mtu = match mtu.filter(|m| *m > 0) {
            Some(m) => m,
            None => self.link_mtu(oif).await?,
        };
        let through_tunnel = self.tunnel_index().await? == Some(oif);
        Ok(Lookup::Route { gateway, oif, mtu, through_tunnel, local })
    }

    async fn link(&mut self, index: u32, name: Option<&str>) -> Result<Option<LinkMessage>, KernelError> {
        let mut q = LinkMessage::default();
        q.header.index = index;
        if let Some(n) = name {
            q.attributes.push(LinkAttribute::IfName(n.to_string()));
        }
        match self.requests.call(RouteNetlinkMessage::GetLink(q), NLM_F_REQUEST).await {
            Ok(r) => {
                Ok(r.into_iter().find_map(|m| if let RouteNetlinkMessage::NewLink(l) = m { Some(l) } else { None }))
            }
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(None),
            Err(source) => Err(KernelError::Dump { what: "link", source }),
        }
    }

    async fn link_mtu(&mut self, index: u32) -> Result<u32, KernelError> {
        let l = self.link(index, None).await?;
        let mtu = l.and_then(|l| {
            l.attributes.iter().find_map(|a| if let LinkAttribute::Mtu(m) = a { Some(*m) } else { None })
        });
        mtu.ok_or_else(|| KernelError::Dump {
            what: "link",
            source: io::Error::other(format!("interface #{index} has no MTU")),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const RANGE: TableRange = TableRange { first: 1_000_000, count: 100 };

    pub(super) fn wire_round_trip(msg: RouteNetlinkMessage) -> RouteNetlinkMessage {
        use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload};
        let mut nl = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::InnerMessage(msg));
        nl.finalize();
        let mut buf = vec![0u8; nl.buffer_len()];
        nl.serialize(&mut buf);
        let mut got = crate::netlink::decode(&buf);
        assert_eq!(got.len(), 1);
        match got.remove(0).payload {
            NetlinkPayload::InnerMessage(m) => m,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn messages_round_trip_through_the_parsers() {
        let routes = [
            Route { dst: "0.0.0.0/0".parse().unwrap(), via: Some("203.0.113.10".parse().unwrap()), encap: None },
            Route { dst: "198.18.0.0/16".parse().unwrap(), via: None, encap: None },
            Route { dst: "::/0".parse().unwrap(), via: Some("2001:db8:113::10".parse().unwrap()), encap: None },
            Route {
                dst: "0.0.0.0/0".parse().unwrap(),
                via: Some("203.0.113.10".parse().unwrap()),
                encap: Some(Encap {
                    src: "192.0.2.7".parse().unwrap(),
                    dst: "203.0.113.10".parse().unwrap(),
                    mtu: 1450,
                    ttl: 64,
                }),
            },
            Route {
                dst: "::/0".parse().unwrap(),
                via: Some("2001:db8:113::10".parse().unwrap()),
                encap: Some(Encap {
                    src: "2001:db8:2::7".parse().unwrap(),
                    dst: "2001:db8:113::10".parse().unwrap(),
                    mtu: 1430,
                    ttl: 64,
                }),
            },
        ];
        for r in routes {
            let m = route_message(1_000_007, &r, Some(9));
            assert_eq!(parse_route(&m, RANGE), Some((1_000_007, r)), "{r}");
            // Through the wire format, as a dump brings it back.
            let back = wire_round_trip(RouteNetlinkMessage::NewRoute(m.clone()));
            let RouteNetlinkMessage::NewRoute(back) = back else { panic!("{back:?}") };
            assert_eq!(parse_route(&back, RANGE), Some((1_000_007, r)), "{r} through the wire");
            if let Some(e) = r.encap {
                assert!(back.header.flags.contains(RouteFlags::Onlink), "{r}: onlink");
                assert!(back.attributes.contains(&RouteAttribute::Oif(9)), "{r}: dev egret-vxlan");
                let kind = if e.dst.is_ipv4() { RouteLwEnCapType::Ip } else { RouteLwEnCapType::Ip6 };
                assert!(back.attributes.contains(&RouteAttribute::EncapType(kind)), "{r}");
                // A changed TTL, MTU or outer source reads back unequal: repaired.
                for (what, changed) in [
                    ("ttl", Encap { ttl: 0, ..e }),
                    ("mtu", Encap { mtu: 1400, ..e }),
                    ("src", Encap { src: e.dst, ..e }),
                ] {
                    let other = route_message(1_000_007, &Route { encap: Some(changed), ..r }, Some(9));
                    assert_ne!(parse_route(&other, RANGE), Some((1_000_007, r)), "{r}: {what}");
                }
                // Without the encapsulation it is the on-link route, unequal too.
                assert_ne!(
                    parse_route(&route_message(1_000_007, &Route { encap: None, ..r }, Some(9)), RANGE),
                    Some((1_000_007, r))
                );
            } else {
                assert!(!back.header.flags.contains(RouteFlags::Onlink), "{r}: on-link routes are unchanged");
                assert!(
                    !back.attributes.iter().any(|a| matches!(a, RouteAttribute::Oif(_) | RouteAttribute::Metrics(_))),
                    "{r}"
                );
            }
            assert_eq!(parse_route(&m, TableRange { first: 1, count: 10 }), None, "outside the range");
            let mut foreign = m.clone();
            foreign.header.protocol = RouteProtocol::Static;
            assert_eq!(parse_route(&foreign, RANGE), None, "not ours");
        }
        let pod: IpAddr = "198.18.0.10".parse().unwrap();
        for mark in [0, 0x1000] {
            let rule = RuleShape { priority: 100, mark }.rule(pod, 1_000_007);
            assert_eq!(parse_rule(&rule_message(&rule)), Some(rule), "{rule:?}");
        }
        let m = rule_message(&RuleShape { priority: 100, mark: 0x1000 }.rule(pod, 1_000_007));
        let mut foreign = m.clone();
        foreign.attributes.retain(|a| !matches!(a, RuleAttribute::Protocol(_)));
        assert_eq!(parse_rule(&foreign), None, "a rule without Egret's protocol is someone else's");
    }
}
