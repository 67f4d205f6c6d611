//! The forwarding snapshot: interfaces, routes and neighbours, as the kernel
//! knows them.
//!
//! Egret does not invent L2 next hops: the daemon reads interfaces, routes and
//! neighbour entries over rtnetlink, keeps them current as the kernel
//! announces changes, and publishes a new [`Fib`] (arc-swap, like the
//! configuration). A translated frame's destination is looked up here: the
//! longest matching route gives the output interface and the next hop (the
//! route's gateway, or the destination itself when on-link), and the
//! neighbour table gives its MAC address. An unresolved next hop is reported
//! so the daemon can ask the kernel to resolve it; the frame is never sent to
//! a guessed address: the worker queues it until the MAC arrives (a few
//! frames per next hop, as the kernel's `unres_qlen`; worker.rs) or, where
//! nothing can hold it, drops it counted (`neighbor_unresolved`).
//!
//! The kernel never sees the traffic Egret forwards, so it would let the
//! neighbour entries Egret uses go stale and, past `gc_thresh1` entries,
//! garbage-collect them. [`NeighborUse`] is where the workers stamp the next
//! hops they send to (a relaxed store at most once a second per next hop);
//! the daemon reads the stamps and confirms those entries to the kernel
//! (netlink.rs), as the kernel's own output path would.
//!
//! A route through an interface Egret does not drive (a *kernel link*: an
//! overlay's tunnel device such as flannel's `flannel.1`, Calico's
//! `vxlan.calico` or `tunl0`) gives [`NextHop::Kernel`]: the engine hands a
//! translated packet to a pod there to the gateway's kernel, whose own
//! encapsulation carries it (docs/adr/0008-overlay-return-through-the-kernel.md);
//! anything else on such a route is dropped as `no_route`. The kernel links'
//! MTUs are kept so that the engine's MTU check covers that path too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU32, Ordering};

use ahash::AHashMap;

use crate::lpm::{Lpm, Prefix};

/// A MAC address.
pub type Mac = [u8; 6];

/// An interface the gateway forwards on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    /// Kernel interface index.
    pub ifindex: u32,
    /// Name, for listings.
    pub name: String,
    /// Its MAC address (source of frames sent on it, and of ARP/NDP answers).
    pub mac: Mac,
    /// Its MTU.
    pub mtu: u32,
}

/// A route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    /// Output interface.
    pub oif: u32,
    /// Gateway, or `None` when the destination is on-link.
    pub gateway: Option<IpAddr>,
}

/// Where a frame goes next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NextHop {
    /// Send on `oif` from `src_mac` to `dst_mac`.
    Resolved {
        /// Output interface.
        oif: u32,
        /// The interface's MAC.
        src_mac: Mac,
        /// The next hop's MAC.
        dst_mac: Mac,
    },
    /// The next hop's MAC is not known yet.
    Unresolved {
        /// Output interface.
        oif: u32,
        /// The next hop's address.
        addr: IpAddr,
    },
    /// The route leaves through `oif`, a link the gateway's kernel has
    /// and Egret does not drive (an overlay's tunnel device): only the
    /// kernel can send there.
    Kernel {
        /// Output interface (the kernel's).
        oif: u32,
    },
    /// No route, or a route through an interface nobody told the Fib about.
    NoRoute,
}

/// The forwarding snapshot.
#[derive(Clone, Debug, Default)]
pub struct Fib {
    generation: u64,
    interfaces: AHashMap<u32, Interface>,
    /// Links Egret does not drive, by index: their MTUs.
    kernel_links: AHashMap<u32, u32>,
    routes_v4: Lpm<Ipv4Addr, Route>,
    routes_v6: Lpm<Ipv6Addr, Route>,
    neighbors: AHashMap<(u32, IpAddr), Mac>,
    /// The gateway's own addresses, by interface: the source of the ICMP
    /// errors it originates as a router (RFC 1812 4.3.2.4).
    addresses: Vec<(u32, IpAddr)>,
    /// Every address of the node, on any interface (driven or not).
    local_addresses: Vec<IpAddr>,
    /// The smallest MTU of any interface, driven or kernel link (0 with
    /// none): a datagram no larger needs no per-interface MTU lookup.
    min_mtu: u32,
}

impl Fib {
    /// An empty snapshot.
    pub fn new() -> Self {
        Self::default()
    }

    /// The snapshot's generation (set by the engine when it is published;
    /// workers' next-hop caches are valid for one generation).
    #[inline]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Sets the generation (the engine does, on publish).
    pub fn set_generation(&mut self, g: u64) {
        self.generation = g;
    }

    /// Adds or replaces an interface.
    pub fn add_interface(&mut self, iface: Interface) -> &mut Self {
        self.kernel_links.remove(&iface.ifindex);
        self.interfaces.insert(iface.ifindex, iface);
        self.update_min_mtu();
        self
    }

    /// Adds or replaces a link the gateway's kernel has and Egret does not
    /// drive (ignored for a driven interface): routes through it give
    /// [`NextHop::Kernel`].
    pub fn add_kernel_link(&mut self, ifindex: u32, mtu: u32) -> &mut Self {
        if !self.interfaces.contains_key(&ifindex) {
            self.kernel_links.insert(ifindex, mtu);
            self.update_min_mtu();
        }
        self
    }

    fn update_min_mtu(&mut self) {
        let driven = self.interfaces.values().map(|i| i.mtu);
        self.min_mtu = driven.chain(self.kernel_links.values().copied()).min().unwrap_or(0);
    }

    /// Adds an address of the node (any interface; see
    /// [`Fib::local_addresses`]).
    pub fn add_local_address(&mut self, addr: IpAddr) -> &mut Self {
        if !self.local_addresses.contains(&addr) {
            self.local_addresses.push(addr);
        }
        self
    }

    /// Every address of the node, on any interface: the control plane makes
    /// them every policy's exceptions ([`crate::tables::TablesSpec::local_addresses`]).
    pub fn local_addresses(&self) -> &[IpAddr] {
        &self.local_addresses
    }

    /// Adds one of the gateway's own addresses on interface `ifindex`.
    pub fn add_address(&mut self, ifindex: u32, addr: IpAddr) -> &mut Self {
        if !self.addresses.contains(&(ifindex, addr)) {
            self.addresses.push((ifindex, addr));
        }
        self
    }

    /// The smallest interface MTU (0 with no interface): datagrams up to
    /// this size fit every link, whatever the route.
    #[inline]
    pub fn min_mtu(&self) -> u32 {
        self.min_mtu
    }

    /// The MTU of interface `ifindex`, if it is one Egret drives.
    #[inline]
    pub fn mtu(&self, ifindex: u32) -> Option<u32> {
        self.interfaces.get(&ifindex).map(|i| i.mtu)
    }

    /// The MTU of kernel link `ifindex` (one Egret does not drive), if known.
    #[inline]
    pub fn kernel_link_mtu(&self, ifindex: u32) -> Option<u32> {
        self.kernel_links.get(&ifindex).copied()
    }

    /// The address a packet the gateway originates towards `dst` leaves
    /// from, as a router picks it (RFC 1812 4.3.2.4): an address of the
    /// same family on the route's output interface, the lowest for a stable
    /// choice; IPv6 prefers a global address over a link-local one.
    pub fn source_for(&self, dst: IpAddr) -> Option<IpAddr> {
        let oif = self.route(dst)?.oif;
        let link_local = |a: &IpAddr| matches!(a, IpAddr::V6(v) if v.segments()[0] & 0xffc0 == 0xfe80);
        self.addresses
            .iter()
            .filter(|(i, a)| *i == oif && a.is_ipv4() == dst.is_ipv4() && !a.is_loopback())
            .map(|(_, a)| *a)
            .min_by_key(|a| (link_local(a), *a))
    }

    /// Adds or replaces a route.
    pub fn add_route(&mut self, dst: IpAddr, prefix_len: u8, route: Route) -> &mut Self {
        match dst {
            IpAddr::V4(a) => {
                self.routes_v4.insert(Prefix::new(a, prefix_len), route);
            }
            IpAddr::V6(a) => {
                self.routes_v6.insert(Prefix::new(a, prefix_len), route);
            }
        }
        self
    }

    /// Adds or replaces a neighbour entry.
    pub fn add_neighbor(&mut self, ifindex: u32, addr: IpAddr, mac: Mac) -> &mut Self {
        self.neighbors.insert((ifindex, addr), mac);
        self
    }

    /// Removes a neighbour entry.
    pub fn remove_neighbor(&mut self, ifindex: u32, addr: IpAddr) -> &mut Self {
        self.neighbors.remove(&(ifindex, addr));
        self
    }

    /// The interface with this index.
    #[inline]
    pub fn interface(&self, ifindex: u32) -> Option<&Interface> {
        self.interfaces.get(&ifindex)
    }

    /// Every interface.
    pub fn interfaces(&self) -> impl Iterator<Item = &Interface> {
        self.interfaces.values()
    }

    /// The route to `dst`.
    #[inline]
    pub fn route(&self, dst: IpAddr) -> Option<Route> {
        match dst {
            IpAddr::V4(a) => self.routes_v4.lookup(a).map(|(_, r)| *r),
            IpAddr::V6(a) => self.routes_v6.lookup(a).map(|(_, r)| *r),
        }
    }

    /// The neighbour's MAC.
    #[inline]
    pub fn neighbor(&self, ifindex: u32, addr: IpAddr) -> Option<Mac> {
        self.neighbors.get(&(ifindex, addr)).copied()
    }

    /// Where a frame to `dst` goes next.
    #[inline]
    pub fn next_hop(&self, dst: IpAddr) -> NextHop {
        self.next_hop_via(dst).0
    }

    /// [`next_hop`](Self::next_hop), with the (interface, neighbour address)
    /// it goes through when there is a route.
    #[inline]
    pub fn next_hop_via(&self, dst: IpAddr) -> (NextHop, Option<(u32, IpAddr)>) {
        let Some(route) = self.route(dst) else { return (NextHop::NoRoute, None) };
        let Some(iface) = self.interfaces.get(&route.oif) else {
            if self.kernel_links.contains_key(&route.oif) {
                return (NextHop::Kernel { oif: route.oif }, None);
            }
            return (NextHop::NoRoute, None);
        };
        let via = route.gateway.unwrap_or(dst);
        let hop = match self.neighbors.get(&(route.oif, via)) {
            Some(mac) => NextHop::Resolved { oif: route.oif, src_mac: iface.mac, dst_mac: *mac },
            None => NextHop::Unresolved { oif: route.oif, addr: via },
        };
        (hop, Some((route.oif, via)))
    }

    /// Every neighbour entry: ((interface, address), MAC).
    pub fn neighbors(&self) -> impl Iterator<Item = ((u32, IpAddr), Mac)> + '_ {
        self.neighbors.iter().map(|(k, m)| (*k, *m))
    }

    /// Every route: (destination, prefix length, route). The XDP fast path's
    /// offload manager compares these between snapshots to find out when its
    /// installed next hops must be re-resolved.
    pub fn routes(&self) -> impl Iterator<Item = (IpAddr, u8, Route)> + '_ {
        let v4 = self.routes_v4.iter().map(|(p, r)| (IpAddr::V4(p.addr), p.len, *r));
        let v6 = self.routes_v6.iter().map(|(p, r)| (IpAddr::V6(p.addr), p.len, *r));
        v4.chain(v6)
    }

    /// Gateways of routes through interfaces Egret drives that have no
    /// neighbour entry: (interface, gateway), sorted.
    pub fn unresolved_gateways(&self) -> Vec<(u32, IpAddr)> {
        let mut v: Vec<(u32, IpAddr)> = self
            .routes()
            .filter(|(_, _, r)| self.interfaces.contains_key(&r.oif))
            .filter_map(|(_, _, r)| r.gateway.map(|g| (r.oif, g)))
            .filter(|k| !self.neighbors.contains_key(k))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// Number of routes and neighbours (for metrics).
    pub fn sizes(&self) -> (usize, usize) {
        (self.routes_v4.len() + self.routes_v6.len(), self.neighbors.len())
    }
}

/// Slots of the [`NeighborUse`] table (direct-mapped; 16 KiB).
pub const NEIGHBOR_USE_SLOTS: usize = 4096;

/// When each next hop was last sent to, in engine seconds, shared by every
/// worker and the daemon and kept across forwarding snapshots.
///
/// Direct-mapped by (interface, address): two next hops that share a slot
/// both look used when either is, which only keeps one more kernel entry
/// alive. A slot holds the second of its last use (never 0, so a slot never
/// written reads as unused); a worker stores only when the second changed,
/// so a busy next hop costs one relaxed load per frame and one store a
/// second. The reader tells use from the stamp changing between two looks,
/// so it needs no clock of its own.
#[derive(Debug)]
pub struct NeighborUse {
    slots: Box<[AtomicU32]>,
}

impl Default for NeighborUse {
    fn default() -> Self {
        Self { slots: (0..NEIGHBOR_USE_SLOTS).map(|_| AtomicU32::new(0)).collect() }
    }
}

impl NeighborUse {
    /// The slot of (interface, address).
    #[inline]
    pub fn slot(ifindex: u32, addr: IpAddr) -> u32 {
        let a = match addr {
            IpAddr::V4(a) => u128::from(u32::from(a)),
            IpAddr::V6(a) => u128::from(a) ^ (1 << 127),
        };
        let h = (a as u64 ^ (a >> 64) as u64 ^ u64::from(ifindex) << 32).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 52) as u32 % NEIGHBOR_USE_SLOTS as u32
    }

    /// Stamps `slot` as used at `secs`.
    #[inline]
    pub fn touch(&self, slot: u32, secs: u32) {
        if let Some(s) = self.slots.get(slot as usize) {
            let v = secs.max(1);
            if s.load(Ordering::Relaxed) != v {
                s.store(v, Ordering::Relaxed);
            }
        }
    }

    /// The stamp of (interface, address): 0 if never used.
    pub fn stamp(&self, ifindex: u32, addr: IpAddr) -> u32 {
        self.slots.get(Self::slot(ifindex, addr) as usize).map_or(0, |s| s.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fib() -> Fib {
        let mut f = Fib::new();
        f.add_interface(Interface { ifindex: 2, name: "eth0".into(), mac: [2, 0, 0, 0, 0, 1], mtu: 1500 })
            .add_route("0.0.0.0".parse().unwrap(), 0, Route { oif: 2, gateway: Some("203.0.113.1".parse().unwrap()) })
            .add_route("192.0.2.0".parse().unwrap(), 24, Route { oif: 2, gateway: None })
            .add_route("198.18.0.0".parse().unwrap(), 15, Route { oif: 9, gateway: None })
            .add_neighbor(2, "203.0.113.1".parse().unwrap(), [2, 0, 0, 0, 0, 0xfe]);
        f
    }

    #[test]
    fn routes_then_neighbors() {
        let f = fib();
        assert_eq!(
            f.next_hop("198.51.100.7".parse().unwrap()),
            NextHop::Resolved { oif: 2, src_mac: [2, 0, 0, 0, 0, 1], dst_mac: [2, 0, 0, 0, 0, 0xfe] }
        );
        assert_eq!(
            f.next_hop("192.0.2.5".parse().unwrap()),
            NextHop::Unresolved { oif: 2, addr: "192.0.2.5".parse().unwrap() },
            "on-link destination without a neighbour entry"
        );
        assert_eq!(f.next_hop("198.18.0.1".parse().unwrap()), NextHop::NoRoute, "interface not driven");
        assert_eq!(f.next_hop("2001:db8::1".parse().unwrap()), NextHop::NoRoute);
        assert!(f.unresolved_gateways().is_empty(), "the only gateway is resolved");
        let mut g = f.clone();
        g.remove_neighbor(2, "203.0.113.1".parse().unwrap());
        assert_eq!(g.unresolved_gateways(), vec![(2, "203.0.113.1".parse().unwrap())]);
    }

    /// A route through a link the kernel has and Egret does not drive (an
    /// overlay's tunnel) is the kernel's; its MTU lowers the smallest MTU;
    /// a link that becomes driven is no longer the kernel's.
    #[test]
    fn routes_through_kernel_links_are_the_kernels() {
        let mut f = fib();
        let pod: IpAddr = "198.18.1.5".parse().unwrap();
        assert_eq!(f.next_hop(pod), NextHop::NoRoute, "link 9 unknown");
        f.add_kernel_link(9, 1450);
        assert_eq!(f.next_hop_via(pod), (NextHop::Kernel { oif: 9 }, None));
        assert_eq!((f.min_mtu(), f.mtu(9), f.kernel_link_mtu(9)), (1450, None, Some(1450)));
        f.add_kernel_link(2, 1400);
        assert_eq!((f.kernel_link_mtu(2), f.min_mtu()), (None, 1450), "a driven interface is never a kernel link");
        f.add_interface(Interface { ifindex: 9, name: "eth9".into(), mac: [2, 0, 0, 0, 0, 9], mtu: 1500 });
        assert_eq!(f.next_hop(pod), NextHop::Unresolved { oif: 9, addr: pod });
        assert_eq!((f.kernel_link_mtu(9), f.min_mtu()), (None, 1500));
    }

    #[test]
    fn neighbor_changes_are_seen() {
        let mut f = fib();
        f.add_neighbor(2, "203.0.113.1".parse().unwrap(), [2, 0, 0, 0, 0, 0xaa]);
        assert!(matches!(
            f.next_hop("198.51.100.7".parse().unwrap()),
            NextHop::Resolved { dst_mac: [2, 0, 0, 0, 0, 0xaa], .. }
        ));
        f.remove_neighbor(2, "203.0.113.1".parse().unwrap());
        assert!(matches!(f.next_hop("198.51.100.7".parse().unwrap()), NextHop::Unresolved { .. }));
    }

    #[test]
    fn next_hop_via_names_the_neighbour() {
        let f = fib();
        let gw: IpAddr = "203.0.113.1".parse().unwrap();
        assert_eq!(f.next_hop_via("198.51.100.7".parse().unwrap()).1, Some((2, gw)));
        let onlink: IpAddr = "192.0.2.5".parse().unwrap();
        assert_eq!(f.next_hop_via(onlink).1, Some((2, onlink)));
        assert_eq!(f.next_hop_via("198.18.0.1".parse().unwrap()), (NextHop::NoRoute, None));
    }

    #[test]
    fn neighbor_use_stamps_change_only_with_use() {
        let u = NeighborUse::default();
        let gw: IpAddr = "203.0.113.1".parse().unwrap();
        assert_eq!(u.stamp(2, gw), 0, "never used");
        u.touch(NeighborUse::slot(2, gw), 0);
        assert_eq!(u.stamp(2, gw), 1, "second 0 is stored as 1: a used slot never reads 0");
        u.touch(NeighborUse::slot(2, gw), 7);
        assert_eq!(u.stamp(2, gw), 7);
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert!(NeighborUse::slot(2, v6) < NEIGHBOR_USE_SLOTS as u32);
        u.touch(u32::MAX, 9); // out of range: ignored, no panic
    }
}
