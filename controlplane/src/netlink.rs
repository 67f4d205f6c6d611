//! L2 next hops from the kernel over rtnetlink (RFC 3549; `rtnetlink(7)`).
//!
//! The kernel owns routing and neighbour resolution; Egret mirrors it:
//!
//! - At start, [`Watcher`] subscribes to link, neighbour and IPv4/IPv6 route
//!   events (subscribing *before* dumping, so no change between the dump and
//!   the subscription is lost), dumps links, routes and neighbours into a
//!   [`KernelState`], and publishes a [`Fib`] built from it.
//! - Every change event updates the state; a new `Fib` is published once the
//!   events stop for [`DEBOUNCE`] (a route flap or a neighbour storm costs
//!   one publication, not hundreds). If the kernel drops events (`ENOBUFS`
//!   on an overrun socket), the whole state is dumped again.
//! - Next hops the workers could not resolve (`Engine::drain_resolve_requests`)
//!   are handed to the kernel as `RTM_NEWNEIGH` with `NTF_USE` and
//!   `NLM_F_CREATE`: the kernel creates the entry if needed and starts
//!   resolution exactly as if it had a packet for that neighbour
//!   (`neigh_event_send`: ARP request or neighbour solicitation), and the
//!   resulting `RTM_NEWNEIGH` event brings the MAC into the next `Fib`.
//!   Requests for one next hop are sent at most once per [`RESOLVE_INTERVAL`].
//!   The entry is created in state `NUD_NONE`, never `NUD_PERMANENT`, so the
//!   kernel's garbage collector still owns it. Route gateways on driven
//!   interfaces are resolved the same way at start, when routes change, and
//!   again once per [`KEEPALIVE_INTERVAL`] while they are not resolved (an
//!   entry the kernel marked FAILED stays so until something asks again).
//!   Until the gateways of the routes the `Fib` uses are resolved,
//!   [`NextHopStatus`] says which are not, and `/ready` answers 503 with it.
//! - Keeping entries alive: the kernel never sees the frames Egret forwards,
//!   so on its own it would let the entries Egret uses go STALE and, once
//!   the table holds more than `gc_thresh1` entries, its periodic GC deletes
//!   STALE entries unused for `gc_stale_time` (net/core/neighbour.c,
//!   `neigh_periodic_work`: `refcnt == 1`, not in a timer, `used` too old).
//!   Every [`KEEPALIVE_INTERVAL`] the watcher reads the workers' use stamps
//!   (`Fib`'s `NeighborUse`) and, for each neighbour used since the last
//!   look, sends the same `RTM_NEWNEIGH` with `NTF_USE`: the kernel runs
//!   `neigh_event_send` as for a packet of its own, which sets `used` (so
//!   the periodic GC keeps it) and moves a STALE entry to DELAY and then
//!   PROBE (unicast probes, back to REACHABLE on the answer; `updated`
//!   refreshed, and an entry in a timer is never collected). The MAC stays
//!   usable in STALE, DELAY and PROBE, so forwarding goes on while the
//!   kernel re-probes; only FAILED or a deletion takes it away.
//!
//! Only the main table (254) and unicast routes are mirrored; of several
//! routes to one prefix the lowest metric wins; of a multipath route the
//! first next hop is used. Only *driven* interfaces (the ones the gateway
//! serves with AF_XDP) appear in the `Fib` as interfaces; every other link
//! is a *kernel link* (its index and MTU only), so a route through it gives
//! `NextHop::Kernel`: an overlay's tunnel device (`flannel.1`,
//! `vxlan.calico`, `tunl0`), to which the engine hands translated packets
//! to pods through the kernel, as `fib.rs` documents.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_dataplane::engine::ResolveRequest;
use egret_dataplane::fib::{Fib, Interface, Mac, NeighborUse, Route};
use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::protocols::NETLINK_ROUTE;
use netlink_sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket};
use tokio::sync::watch;

/// How long events must pause before a new `Fib` is published.
pub const DEBOUNCE: Duration = Duration::from_millis(20);
/// The least time between two resolution requests for one next hop.
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(1);
/// How often the engine's resolution requests are collected.
pub const DRAIN_INTERVAL: Duration = Duration::from_millis(50);
/// How often neighbours in use are confirmed to the kernel (well within
/// its `delay_first_probe_time`, 5 s by default, so a used entry cycles
/// REACHABLE -> DELAY -> PROBE -> REACHABLE instead of resting in STALE).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);

// rtnetlink multicast groups (uapi linux/rtnetlink.h, the legacy RTMGRP_* bits).
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_NEIGH: u32 = 0x4;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

/// What failed talking to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// Opening or binding a netlink socket failed.
    #[error("rtnetlink socket: {op} failed: {source}")]
    Socket {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
    /// A dump request failed.
    #[error("rtnetlink dump of {what} failed: {source}")]
    Dump {
        /// links, routes or neighbours.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The kernel refused a request.
    #[error("rtnetlink {what} refused: {source}")]
    Refused {
        /// The request.
        what: String,
        /// The kernel's errno.
        source: io::Error,
    },
}

/// A link as the kernel reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Index.
    pub ifindex: u32,
    /// Name.
    pub name: String,
    /// MAC address (all zero when the link has none).
    pub mac: Mac,
    /// MTU.
    pub mtu: u32,
    /// RX queues (`IFLA_NUM_RX_QUEUES`).
    pub rx_queues: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct RouteKey {
    dst: IpAddr,
    len: u8,
    metric: u32,
}

/// The kernel's links, main-table unicast routes and resolved neighbours.
#[derive(Debug, Default, Clone)]
pub struct KernelState {
    links: HashMap<u32, Link>,
    routes: HashMap<RouteKey, Route>,
    neighbours: HashMap<(u32, IpAddr), Mac>,
    /// The interfaces' own addresses: the source of the ICMP errors the
    /// engine originates (Time Exceeded, Fragmentation Needed).
    addresses: std::collections::BTreeSet<(u32, IpAddr)>,
}

/// Whether a neighbour state carries a usable link-layer address.
fn usable(state: NeighbourState) -> bool {
    matches!(
        state,
        NeighbourState::Reachable
            | NeighbourState::Stale
            | NeighbourState::Delay
            | NeighbourState::Probe
            | NeighbourState::Permanent
            | NeighbourState::Noarp
    )
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(a) => Some(IpAddr::V4(*a)),
        RouteAddress::Inet6(a) => Some(IpAddr::V6(*a)),
        _ => None,
    }
}

impl KernelState {
    /// The link called `name`.
    pub fn link_by_name(&self, name: &str) -> Option<&Link> {
        self.links.values().find(|l| l.name == name)
    }

    /// Every link.
    pub fn links(&self) -> impl Iterator<Item = &Link> {
        self.links.values()
    }

    /// Every address of the node, on any interface.
    pub fn local_addresses(&self) -> Vec<IpAddr> {
        self.addresses.iter().map(|(_, ip)| *ip).collect()
    }

    /// Applies one rtnetlink message; returns whether anything changed.
    pub fn apply(&mut self, msg: &RouteNetlinkMessage) -> bool {
        match msg {
            RouteNetlinkMessage::NewLink(m) => self.new_link(m),
            RouteNetlinkMessage::DelLink(m) => self.links.remove(&m.header.index).is_some(),
            RouteNetlinkMessage::NewRoute(m) => match Self::route(m) {
                Some((k, r)) => self.routes.insert(k, r) != Some(r),
                None => {
                    // A route that is no longer unicast/main under the same key.
                    Self::route_key(m).is_some_and(|k| self.routes.remove(&k).is_some())
                }
            },
            RouteNetlinkMessage::DelRoute(m) => Self::route_key(m).is_some_and(|k| self.routes.remove(&k).is_some()),
            RouteNetlinkMessage::NewNeighbour(m) => self.new_neighbour(m),
            RouteNetlinkMessage::DelNeighbour(m) => {
                Self::neighbour_key(m).is_some_and(|k| self.neighbours.remove(&k).is_some())
            }
            RouteNetlinkMessage::NewAddress(m) => Self::address(m).is_some_and(|k| self.addresses.insert(k)),
            RouteNetlinkMessage::DelAddress(m) => Self::address(m).is_some_and(|k| self.addresses.remove(&k)),
            _ => false,
        }
    }

    /// An address message's (interface, address): `IFA_LOCAL` (IPv4: the
    /// local end; `IFA_ADDRESS` is the peer's on point-to-point links),
    /// else `IFA_ADDRESS` (IPv6 has only that).
    fn address(m: &AddressMessage) -> Option<(u32, IpAddr)> {
        let local = m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        });
        let address = m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        Some((m.header.index, local.or(address)?))
    }

    fn new_link(&mut self, m: &LinkMessage) -> bool {
        let mut link = Link { ifindex: m.header.index, name: String::new(), mac: [0; 6], mtu: 0, rx_queues: 1 };
        for a in &m.attributes {
            match a {
                LinkAttribute::IfName(n) => link.name.clone_from(n),
                LinkAttribute::Address(b) if b.len() == 6 => link.mac.copy_from_slice(b),
                LinkAttribute::Mtu(mtu) => link.mtu = *mtu,
                LinkAttribute::NumRxQueues(n) => link.rx_queues = *n,
                _ => {}
            }
        }
        if link.name.is_empty() {
            // A partial update (no name): keep what we had.
            return false;
        }
        self.links.insert(link.ifindex, link.clone()) != Some(link)
    }

    fn route_key(m: &RouteMessage) -> Option<RouteKey> {
        let mut dst = match m.header.address_family {
            AddressFamily::Inet => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            _ => return None,
        };
        let mut metric = 0;
        for a in &m.attributes {
            match a {
                RouteAttribute::Destination(d) => dst = route_ip(d)?,
                RouteAttribute::Priority(p) => metric = *p,
                _ => {}
            }
        }
        Some(RouteKey { dst, len: m.header.destination_prefix_length, metric })
    }

    fn route(m: &RouteMessage) -> Option<(RouteKey, Route)> {
        let key = Self::route_key(m)?;
        let mut table = u32::from(m.header.table);
        let (mut oif, mut gateway) = (None, None);
        for a in &m.attributes {
            match a {
                RouteAttribute::Table(t) => table = *t,
                RouteAttribute::Oif(o) => oif = Some(*o),
                RouteAttribute::Gateway(g) => gateway = route_ip(g),
                RouteAttribute::MultiPath(hops) if oif.is_none() => {
                    if let Some(h) = hops.first() {
                        oif = Some(h.interface_index);
                        gateway = h.attributes.iter().find_map(|a| match a {
                            RouteAttribute::Gateway(g) => route_ip(g),
                            _ => None,
                        });
                    }
                }
                _ => {}
            }
        }
        if table != u32::from(RouteHeader::RT_TABLE_MAIN) || m.header.kind != RouteType::Unicast {
            return None;
        }
        Some((key, Route { oif: oif?, gateway }))
    }

    fn neighbour_key(m: &NeighbourMessage) -> Option<(u32, IpAddr)> {
        m.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => Some((m.header.ifindex, IpAddr::V4(*a))),
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(a)) => Some((m.header.ifindex, IpAddr::V6(*a))),
            _ => None,
        })
    }

    fn new_neighbour(&mut self, m: &NeighbourMessage) -> bool {
        let Some(key) = Self::neighbour_key(m) else { return false };
        let mac = m.attributes.iter().find_map(|a| match a {
            NeighbourAttribute::LinkLayerAddress(b) if b.len() == 6 => {
                let mut mac = [0u8; 6];
                mac.copy_from_slice(b);
                Some(mac)
            }
            _ => None,
        });
        match mac {
            Some(mac) if usable(m.header.state) => self.neighbours.insert(key, mac) != Some(mac),
            _ => self.neighbours.remove(&key).is_some(),
        }
    }

    /// The forwarding snapshot: the driven interfaces (by name), every
    /// mirrored route (lowest metric per prefix) and neighbour.
    pub fn fib(&self, driven: &[String]) -> Fib {
        let mut fib = Fib::new();
        for l in self.links.values() {
            if driven.contains(&l.name) {
                fib.add_interface(Interface { ifindex: l.ifindex, name: l.name.clone(), mac: l.mac, mtu: l.mtu });
            } else {
                fib.add_kernel_link(l.ifindex, l.mtu);
            }
        }
        let mut best: HashMap<(IpAddr, u8), (u32, Route)> = HashMap::new();
        for (k, r) in &self.routes {
            let e = best.entry((k.dst, k.len)).or_insert((k.metric, *r));
            if k.metric < e.0 {
                *e = (k.metric, *r);
            }
        }
        for ((dst, len), (_, r)) in best {
            fib.add_route(dst, len, r);
        }
        for ((ifindex, ip), mac) in &self.neighbours {
            fib.add_neighbor(*ifindex, *ip, *mac);
        }
        for (ifindex, ip) in &self.addresses {
            if fib.interface(*ifindex).is_some() {
                fib.add_address(*ifindex, *ip);
            }
            fib.add_local_address(*ip);
        }
        fib
    }

    /// Gateways of routes through driven interfaces that have no neighbour entry.
    pub fn unresolved_gateways(&self, driven: &[String]) -> Vec<ResolveRequest> {
        let driven: Vec<u32> = self.links.values().filter(|l| driven.contains(&l.name)).map(|l| l.ifindex).collect();
        let mut v: Vec<ResolveRequest> = self
            .routes
            .values()
            .filter(|r| driven.contains(&r.oif))
            .filter_map(|r| r.gateway.map(|g| ResolveRequest { ifindex: r.oif, addr: g }))
            .filter(|q| !self.neighbours.contains_key(&(q.ifindex, q.addr)))
            .collect();
        v.sort_by_key(|q| (q.ifindex, q.addr));
        v.dedup();
        v
    }

    /// (routes, neighbours, links) counts.
    pub fn sizes(&self) -> (usize, usize, usize) {
        (self.routes.len(), self.neighbours.len(), self.links.len())
    }
}

/// Counters of the watcher, for metrics and `egret status`.
#[derive(Debug, Default)]
pub struct NetlinkStats {
    /// Forwarding snapshots published.
    pub fib_published: AtomicU64,
    /// rtnetlink events applied.
    pub events: AtomicU64,
    /// Full resynchronisations after the kernel dropped events.
    pub resyncs: AtomicU64,
    /// Resolution requests sent to the kernel.
    pub resolve_sent: AtomicU64,
    /// Resolution requests the kernel refused.
    pub resolve_errors: AtomicU64,
    /// Neighbours in use confirmed to the kernel (`NTF_USE`).
    pub keepalive_sent: AtomicU64,
}

/// Whether the next hops of the routes in use are resolved, for `/ready`.
#[derive(Debug, Default)]
pub struct NextHopStatus {
    published: std::sync::atomic::AtomicBool,
    unresolved: parking_lot::Mutex<Vec<String>>,
}

/// Why the forwarding snapshot is not ready (`/ready`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NextHopsNotReady {
    /// Nothing was read from the kernel yet.
    #[error("no forwarding snapshot yet")]
    NoSnapshot,
    /// Gateways of routes in use without a MAC (`ADDR on IFACE`).
    #[error("next hop(s) of routes in use not resolved yet: {}", next_hops.join(", "))]
    Unresolved {
        /// Each as `ADDR on IFACE`.
        next_hops: Vec<String>,
    },
}

impl NextHopStatus {
    /// `None` once a forwarding snapshot was published and every gateway
    /// of its routes has a MAC; otherwise why not.
    pub fn not_ready(&self) -> Option<NextHopsNotReady> {
        if !self.published.load(Ordering::Acquire) {
            return Some(NextHopsNotReady::NoSnapshot);
        }
        let u = self.unresolved.lock();
        if u.is_empty() {
            return None;
        }
        Some(NextHopsNotReady::Unresolved { next_hops: u.clone() })
    }

    fn update(&self, fib: &Fib) {
        let mut v: Vec<String> = fib
            .unresolved_gateways()
            .into_iter()
            .map(|(ifindex, addr)| match fib.interface(ifindex) {
                Some(i) => format!("{addr} on {}", i.name),
                None => format!("{addr} on ifindex {ifindex}"),
            })
            .collect();
        v.sort();
        *self.unresolved.lock() = v;
        self.published.store(true, Ordering::Release);
    }
}

/// The neighbours to confirm to the kernel: those on driven interfaces
/// whose use stamp changed since the last look (`last`, updated; entries
/// of neighbours gone are dropped).
fn confirmations(
    state: &KernelState,
    driven: &[u32],
    uses: &NeighborUse,
    last: &mut HashMap<(u32, IpAddr), u32>,
) -> Vec<ResolveRequest> {
    let mut out = Vec::new();
    for &(ifindex, addr) in state.neighbours.keys() {
        if !driven.contains(&ifindex) {
            continue;
        }
        let stamp = uses.stamp(ifindex, addr);
        let before = last.insert((ifindex, addr), stamp);
        if stamp != 0 && before.is_some_and(|b| b != stamp) {
            out.push(ResolveRequest { ifindex, addr });
        }
    }
    last.retain(|k, _| state.neighbours.contains_key(k));
    out.sort_by_key(|q| (q.ifindex, q.addr));
    out
}

fn encode(msg: RouteNetlinkMessage, flags: u16, seq: u32) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    header.sequence_number = seq;
    let mut nl = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
    nl.finalize();
    let mut buf = vec![0u8; nl.buffer_len()];
    nl.serialize(&mut buf);
    buf
}

/// Every netlink message in one datagram (malformed tails are skipped).
pub(crate) fn decode(buf: &[u8]) -> Vec<NetlinkMessage<RouteNetlinkMessage>> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        if len < 16 || off + len > buf.len() {
            break;
        }
        if let Ok(m) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf[off..off + len]) {
            out.push(m);
        }
        off += (len + 3) & !3;
    }
    out
}

/// A request/response rtnetlink socket (dumps and neighbour requests; the
/// node agent's rules and routes).
pub(crate) struct Requests {
    socket: TokioSocket,
    seq: u32,
}

impl Requests {
    pub(crate) fn open() -> Result<Self, NetlinkError> {
        let mut socket =
            TokioSocket::new(NETLINK_ROUTE).map_err(|source| NetlinkError::Socket { op: "socket", source })?;
        socket.socket_mut().bind_auto().map_err(|source| NetlinkError::Socket { op: "bind", source })?;
        socket
            .socket_mut()
            .connect(&SocketAddr::new(0, 0))
            .map_err(|source| NetlinkError::Socket { op: "connect", source })?;
        Ok(Self { socket, seq: 1 })
    }

    /// Sends `msg` and collects replies until DONE or an ACK/error for it.
    pub(crate) async fn call(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        self.socket.send(&encode(msg, flags, seq)).await?;
        let mut out = Vec::new();
        loop {
            let (buf, _) = self.socket.recv_from_full().await?;
            for m in decode(&buf) {
                if m.header.sequence_number != seq {
                    continue;
                }
                match m.payload {
                    NetlinkPayload::InnerMessage(inner) => out.push(inner),
                    NetlinkPayload::Done(_) => return Ok(out),
                    NetlinkPayload::Error(e) => {
                        return match e.code {
                            None => Ok(out),
                            Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
                        };
                    }
                    _ => {}
                }
            }
            if flags & NLM_F_DUMP == 0 && flags & NLM_F_ACK == 0 {
                return Ok(out);
            }
        }
    }

    async fn dump(&mut self) -> Result<KernelState, NetlinkError> {
        let mut state = KernelState::default();
        let flags = NLM_F_REQUEST | NLM_F_DUMP;
        let dumps: [(&'static str, RouteNetlinkMessage); 4] = [
            ("links", RouteNetlinkMessage::GetLink(LinkMessage::default())),
            ("routes", RouteNetlinkMessage::GetRoute(RouteMessage::default())),
            ("neighbours", RouteNetlinkMessage::GetNeighbour(NeighbourMessage::default())),
            ("addresses", RouteNetlinkMessage::GetAddress(AddressMessage::default())),
        ];
        for (what, msg) in dumps {
            for m in self.call(msg, flags).await.map_err(|source| NetlinkError::Dump { what, source })? {
                state.apply(&m);
            }
        }
        Ok(state)
    }

    /// Asks the kernel to resolve `q` (see the module doc).
    async fn resolve(&mut self, q: ResolveRequest) -> Result<(), NetlinkError> {
        let mut m = NeighbourMessage::default();
        m.header.family = match q.addr {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        m.header.ifindex = q.ifindex;
        m.header.state = NeighbourState::None;
        m.header.flags = NeighbourFlags::Use;
        m.attributes.push(NeighbourAttribute::Destination(match q.addr {
            IpAddr::V4(a) => NeighbourAddress::Inet(a),
            IpAddr::V6(a) => NeighbourAddress::Inet6(a),
        }));
        self.call(RouteNetlinkMessage::NewNeighbour(m), NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK)
            .await
            .map(drop)
            .map_err(|source| NetlinkError::Refused {
                what: format!("resolution of {} on ifindex {}", q.addr, q.ifindex),
                source,
            })
    }
}

/// Mirrors the kernel's forwarding state into the engine.
#[derive(Debug)]
pub struct Watcher {
    driven: Vec<String>,
    stats: Arc<NetlinkStats>,
}

impl Watcher {
    /// A watcher for the interfaces called `driven`.
    pub fn new(driven: Vec<String>) -> Self {
        Self { driven, stats: Arc::default() }
    }

    /// Its counters.
    pub fn stats(&self) -> Arc<NetlinkStats> {
        self.stats.clone()
    }

    /// Subscribes, dumps and returns the first state; then [`Watcher::run`]
    /// keeps it current.
    pub async fn start(self) -> Result<Running, NetlinkError> {
        let mut events =
            TokioSocket::new(NETLINK_ROUTE).map_err(|source| NetlinkError::Socket { op: "socket", source })?;
        let groups = RTMGRP_LINK
            | RTMGRP_NEIGH
            | RTMGRP_IPV4_ROUTE
            | RTMGRP_IPV6_ROUTE
            | RTMGRP_IPV4_IFADDR
            | RTMGRP_IPV6_IFADDR;
        events
            .socket_mut()
            .bind(&SocketAddr::new(0, groups))
            .map_err(|source| NetlinkError::Socket { op: "bind to the link/neighbour/route groups", source })?;
        // Best effort: a larger buffer makes an overrun (and a resync) rarer.
        let _ = events.socket_mut().set_rx_buf_sz(4 << 20);
        let mut requests = Requests::open()?;
        let state = requests.dump().await?;
        Ok(Running { watcher: self, events, requests, state, uses: None, status: Arc::default() })
    }
}

/// A started watcher.
pub struct Running {
    watcher: Watcher,
    events: TokioSocket,
    requests: Requests,
    state: KernelState,
    uses: Option<Arc<NeighborUse>>,
    status: Arc<NextHopStatus>,
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running").field("sizes", &self.state.sizes()).finish_non_exhaustive()
    }
}

impl Running {
    /// The state as dumped.
    pub fn state(&self) -> &KernelState {
        &self.state
    }

    /// Keep the kernel's entries of the neighbours stamped in `uses` alive
    /// (see the module doc).
    pub fn keep_alive(&mut self, uses: Arc<NeighborUse>) {
        self.uses = Some(uses);
    }

    /// Whether the routes' next hops are resolved (for `/ready`).
    pub fn next_hop_status(&self) -> Arc<NextHopStatus> {
        self.status.clone()
    }

    fn publish_fib(&self, driven: &[String], publish: &impl Fn(Fib)) {
        let fib = self.state.fib(driven);
        self.status.update(&fib);
        publish(fib);
        self.watcher.stats.fib_published.fetch_add(1, Ordering::Relaxed);
    }

    /// Publishes a `Fib` now and on every (debounced) change through
    /// `publish`; resolves what `drain` returns; stops when `stop` changes.
    pub async fn run(
        mut self,
        publish: impl Fn(Fib) + Send,
        drain: impl Fn() -> Vec<ResolveRequest> + Send,
        mut stop: watch::Receiver<bool>,
    ) {
        let driven = self.watcher.driven.clone();
        let stats = self.watcher.stats.clone();
        self.publish_fib(&driven, &publish);
        let mut last_sent: HashMap<ResolveRequest, Instant> = HashMap::new();
        let first = self.state.unresolved_gateways(&driven);
        self.resolve_all(first, &mut last_sent).await;

        let mut dirty_since: Option<Instant> = None;
        let mut drain_tick = tokio::time::interval(DRAIN_INTERVAL);
        drain_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut keepalive_tick = tokio::time::interval(KEEPALIVE_INTERVAL);
        keepalive_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stamps: HashMap<(u32, IpAddr), u32> = HashMap::new();
        loop {
            let deadline = dirty_since.map(|t| tokio::time::Instant::from_std(t + DEBOUNCE));
            tokio::select! {
                r = self.events.recv_from_full() => match r {
                    Ok((buf, _)) => {
                        let mut changed = false;
                        for m in decode(&buf) {
                            if let NetlinkPayload::InnerMessage(inner) = m.payload {
                                stats.events.fetch_add(1, Ordering::Relaxed);
                                changed |= self.state.apply(&inner);
                            }
                        }
                        if changed {
                            dirty_since = Some(Instant::now());
                        }
                    }
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                        tracing::warn!("rtnetlink events were lost (ENOBUFS); dumping the kernel's state again");
                        stats.resyncs.fetch_add(1, Ordering::Relaxed);
                        match self.requests.dump().await {
                            Ok(s) => {
                                self.state = s;
                                dirty_since = Some(Instant::now());
                            }
                            Err(e) => tracing::error!(error = %e, "rtnetlink resync failed; keeping the old state"),
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "rtnetlink event socket failed; next hops are no longer updated");
                        let _ = stop.changed().await;
                        return;
                    }
                },
                () = async {
                    match deadline {
                        Some(d) => tokio::time::sleep_until(d).await,
                        None => std::future::pending().await,
                    }
                } => {
                    dirty_since = None;
                    self.publish_fib(&driven, &publish);
                    let (routes, neighbours, links) = self.state.sizes();
                    tracing::debug!(routes, neighbours, links, "forwarding snapshot published");
                    let gw = self.state.unresolved_gateways(&driven);
                    self.resolve_all(gw, &mut last_sent).await;
                }
                _ = drain_tick.tick() => {
                    let wanted = drain();
                    if !wanted.is_empty() {
                        self.resolve_all(wanted, &mut last_sent).await;
                    }
                    let now = Instant::now();
                    last_sent.retain(|_, t| now.duration_since(*t) < RESOLVE_INTERVAL);
                }
                _ = keepalive_tick.tick() => {
                    // The gateways of the routes in use that are still not
                    // resolved, again (once a tick): an entry the kernel gave
                    // up on (FAILED) changes nothing mirrored here, so no
                    // event would ask for it again.
                    let gw = self.state.unresolved_gateways(&driven);
                    if !gw.is_empty() {
                        self.resolve_all(gw, &mut last_sent).await;
                    }
                    let Some(uses) = self.uses.clone() else { continue };
                    let ifindexes: Vec<u32> =
                        self.state.links.values().filter(|l| driven.contains(&l.name)).map(|l| l.ifindex).collect();
                    for q in confirmations(&self.state, &ifindexes, &uses, &mut stamps) {
                        stats.keepalive_sent.fetch_add(1, Ordering::Relaxed);
                        if let Err(e) = self.requests.resolve(q).await {
                            stats.resolve_errors.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(error = %e, "confirming a neighbour in use was refused");
                        }
                    }
                }
                _ = stop.changed() => return,
            }
        }
    }

    async fn resolve_all(&mut self, wanted: Vec<ResolveRequest>, last_sent: &mut HashMap<ResolveRequest, Instant>) {
        let now = Instant::now();
        for q in wanted {
            if last_sent.get(&q).is_some_and(|t| now.duration_since(*t) < RESOLVE_INTERVAL) {
                continue;
            }
            last_sent.insert(q, now);
            self.watcher.stats.resolve_sent.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = self.requests.resolve(q).await {
                self.watcher.stats.resolve_errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(error = %e, "next hop resolution refused");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use egret_dataplane::fib::NextHop;

    fn link(index: u32, name: &str, mac: Mac) -> RouteNetlinkMessage {
        let mut m = LinkMessage::default();
        m.header.index = index;
        m.attributes =
            vec![LinkAttribute::IfName(name.into()), LinkAttribute::Address(mac.to_vec()), LinkAttribute::Mtu(1500)];
        RouteNetlinkMessage::NewLink(m)
    }

    fn route(dst: Ipv4Addr, len: u8, oif: u32, gw: Option<Ipv4Addr>, metric: u32) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.address_family = AddressFamily::Inet;
        m.header.destination_prefix_length = len;
        m.header.table = RouteHeader::RT_TABLE_MAIN;
        m.header.kind = RouteType::Unicast;
        if len > 0 {
            m.attributes.push(RouteAttribute::Destination(RouteAddress::Inet(dst)));
        }
        m.attributes.push(RouteAttribute::Oif(oif));
        m.attributes.push(RouteAttribute::Priority(metric));
        if let Some(g) = gw {
            m.attributes.push(RouteAttribute::Gateway(RouteAddress::Inet(g)));
        }
        m
    }

    fn neigh(ifindex: u32, ip: Ipv4Addr, mac: Option<Mac>, state: NeighbourState) -> NeighbourMessage {
        let mut m = NeighbourMessage::default();
        m.header.family = AddressFamily::Inet;
        m.header.ifindex = ifindex;
        m.header.state = state;
        m.attributes.push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        if let Some(mac) = mac {
            m.attributes.push(NeighbourAttribute::LinkLayerAddress(mac.to_vec()));
        }
        m
    }

    #[test]
    fn state_follows_messages_and_builds_the_fib() {
        let mut s = KernelState::default();
        let gw = Ipv4Addr::new(203, 0, 113, 1);
        assert!(s.apply(&link(2, "eth0", [2, 0, 0, 0, 0, 1])));
        assert!(!s.apply(&link(2, "eth0", [2, 0, 0, 0, 0, 1])), "same link again is no change");
        assert!(s.apply(&link(3, "lo2", [0; 6])));
        assert!(s.apply(&RouteNetlinkMessage::NewRoute(route(Ipv4Addr::UNSPECIFIED, 0, 2, Some(gw), 100))));
        // A worse default route via another interface loses on metric.
        assert!(s.apply(&RouteNetlinkMessage::NewRoute(route(Ipv4Addr::UNSPECIFIED, 0, 3, None, 200))));
        let mut local = route(Ipv4Addr::new(203, 0, 113, 5), 32, 2, None, 0);
        local.header.kind = RouteType::Local;
        local.header.table = 255;
        assert!(!s.apply(&RouteNetlinkMessage::NewRoute(local)), "local table ignored");
        let driven = vec!["eth0".to_string()];
        assert_eq!(s.unresolved_gateways(&driven), vec![ResolveRequest { ifindex: 2, addr: IpAddr::V4(gw) }]);
        let dst: IpAddr = "198.51.100.7".parse().unwrap();
        assert_eq!(s.fib(&driven).next_hop(dst), NextHop::Unresolved { oif: 2, addr: IpAddr::V4(gw) });

        assert!(!s.apply(&RouteNetlinkMessage::NewNeighbour(neigh(2, gw, None, NeighbourState::Incomplete))));
        assert!(s.apply(&RouteNetlinkMessage::NewNeighbour(neigh(
            2,
            gw,
            Some([2, 0, 0, 0, 0, 0xfe]),
            NeighbourState::Reachable
        ))));
        assert_eq!(
            s.fib(&driven).next_hop(dst),
            NextHop::Resolved { oif: 2, src_mac: [2, 0, 0, 0, 0, 1], dst_mac: [2, 0, 0, 0, 0, 0xfe] }
        );
        assert!(s.unresolved_gateways(&driven).is_empty());
        // FAILED removes the MAC.
        assert!(s.apply(&RouteNetlinkMessage::NewNeighbour(neigh(
            2,
            gw,
            Some([2, 0, 0, 0, 0, 0xfe]),
            NeighbourState::Failed
        ))));
        assert!(matches!(s.fib(&driven).next_hop(dst), NextHop::Unresolved { .. }));
        // Removing the better route leaves the one through a link Egret
        // does not drive: the kernel's (an overlay's tunnel, say).
        assert!(s.apply(&RouteNetlinkMessage::DelRoute(route(Ipv4Addr::UNSPECIFIED, 0, 2, Some(gw), 100))));
        assert_eq!(s.fib(&driven).next_hop(dst), NextHop::Kernel { oif: 3 });
        assert_eq!(s.fib(&driven).kernel_link_mtu(3), Some(1500));
        // Through a link the state never heard of: no route.
        assert!(s.apply(&RouteNetlinkMessage::NewRoute(route(Ipv4Addr::UNSPECIFIED, 0, 7, None, 50))));
        assert_eq!(s.fib(&driven).next_hop(dst), NextHop::NoRoute);
    }

    /// Interface addresses reach the Fib (driven interfaces only), as the
    /// source of the ICMP errors the engine originates: IPv4's local end
    /// (`IFA_LOCAL`), IPv6's `IFA_ADDRESS`; a removed address goes.
    #[test]
    fn addresses_of_driven_interfaces_reach_the_fib() {
        use netlink_packet_route::address::AddressMessage;
        let addr = |index: u32, attrs: Vec<AddressAttribute>| {
            let mut m = AddressMessage::default();
            m.header.index = index;
            m.attributes = attrs;
            m
        };
        let mut s = KernelState::default();
        let driven = vec!["eth0".to_string()];
        assert!(s.apply(&link(2, "eth0", [2, 0, 0, 0, 0, 1])));
        assert!(s.apply(&link(3, "lo2", [0; 6])));
        assert!(s.apply(&RouteNetlinkMessage::NewRoute(route(Ipv4Addr::new(192, 0, 2, 0), 24, 2, None, 0))));
        let v4 = addr(
            2,
            vec![
                AddressAttribute::Address(Ipv4Addr::new(192, 0, 2, 99).into()),
                AddressAttribute::Local(Ipv4Addr::new(192, 0, 2, 2).into()),
            ],
        );
        assert!(s.apply(&RouteNetlinkMessage::NewAddress(v4.clone())));
        assert!(!s.apply(&RouteNetlinkMessage::NewAddress(v4.clone())), "no change");
        let other = addr(3, vec![AddressAttribute::Local(Ipv4Addr::new(198, 51, 100, 1).into())]);
        assert!(s.apply(&RouteNetlinkMessage::NewAddress(other)));
        let v6: std::net::Ipv6Addr = "2001:db8:2::2".parse().unwrap();
        assert!(s.apply(&RouteNetlinkMessage::NewAddress(addr(2, vec![AddressAttribute::Address(v6.into())]))));
        let fib = s.fib(&driven);
        let pod = IpAddr::V4(Ipv4Addr::new(192, 0, 2, 10));
        assert_eq!(fib.source_for(pod), Some(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 2))));
        assert!(s.apply(&RouteNetlinkMessage::DelAddress(v4)));
        assert_eq!(s.fib(&driven).source_for(pod), None, "removed; lo2's address is not on the route");
    }

    #[test]
    fn neighbours_in_use_are_confirmed_once_per_use() {
        let mut s = KernelState::default();
        let (a, b) = (Ipv4Addr::new(203, 0, 113, 1), Ipv4Addr::new(203, 0, 113, 9));
        for ip in [a, b] {
            s.apply(&RouteNetlinkMessage::NewNeighbour(neigh(2, ip, Some([2, 0, 0, 0, 0, 9]), NeighbourState::Stale)));
        }
        s.apply(&RouteNetlinkMessage::NewNeighbour(neigh(7, a, Some([2, 0, 0, 0, 0, 7]), NeighbourState::Stale)));
        let uses = NeighborUse::default();
        let mut last = HashMap::new();
        let q = |ip: Ipv4Addr| ResolveRequest { ifindex: 2, addr: IpAddr::V4(ip) };
        assert!(confirmations(&s, &[2], &uses, &mut last).is_empty(), "nothing used");
        uses.touch(NeighborUse::slot(2, IpAddr::V4(a)), 10);
        // On an interface Egret does not drive: never confirmed.
        uses.touch(NeighborUse::slot(7, IpAddr::V4(a)), 10);
        assert_eq!(confirmations(&s, &[2], &uses, &mut last), vec![q(a)], "used since the last look");
        assert!(confirmations(&s, &[2], &uses, &mut last).is_empty(), "not used again: not confirmed");
        uses.touch(NeighborUse::slot(2, IpAddr::V4(a)), 11);
        uses.touch(NeighborUse::slot(2, IpAddr::V4(b)), 11);
        assert_eq!(confirmations(&s, &[2], &uses, &mut last), vec![q(a), q(b)]);
        // A neighbour the kernel deleted is forgotten.
        s.apply(&RouteNetlinkMessage::DelNeighbour(neigh(2, b, None, NeighbourState::None)));
        confirmations(&s, &[2], &uses, &mut last);
        assert!(!last.contains_key(&(2, IpAddr::V4(b))));
    }

    #[test]
    fn next_hop_status_names_unresolved_gateways() {
        let st = NextHopStatus::default();
        assert_eq!(st.not_ready(), Some(NextHopsNotReady::NoSnapshot));
        assert_eq!(NextHopsNotReady::NoSnapshot.to_string(), "no forwarding snapshot yet");
        let mut s = KernelState::default();
        let gw = Ipv4Addr::new(203, 0, 113, 1);
        s.apply(&link(2, "eth0", [2, 0, 0, 0, 0, 1]));
        s.apply(&RouteNetlinkMessage::NewRoute(route(Ipv4Addr::UNSPECIFIED, 0, 2, Some(gw), 100)));
        let driven = vec!["eth0".to_string()];
        st.update(&s.fib(&driven));
        assert_eq!(
            st.not_ready().map(|n| n.to_string()).as_deref(),
            Some("next hop(s) of routes in use not resolved yet: 203.0.113.1 on eth0")
        );
        s.apply(&RouteNetlinkMessage::NewNeighbour(neigh(
            2,
            gw,
            Some([2, 0, 0, 0, 0, 0xfe]),
            NeighbourState::Reachable,
        )));
        st.update(&s.fib(&driven));
        assert_eq!(st.not_ready(), None);
    }

    #[test]
    fn requests_encode_and_decode() {
        let bytes = encode(link(7, "x", [1, 2, 3, 4, 5, 6]), NLM_F_REQUEST, 42);
        let mut two = bytes.clone();
        two.extend_from_slice(&bytes);
        let msgs = decode(&two);
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].header.sequence_number, 42);
        assert!(
            matches!(&msgs[1].payload, NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) if l.header.index == 7)
        );
        assert!(decode(&bytes[..10]).is_empty());
    }
}
