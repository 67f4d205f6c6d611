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
//! so the daemon can ask the kernel to resolve it; the frame is dropped and
//! counted (`neighbor_unresolved`), never sent to a guessed address.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

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
    /// No route, or a route through an interface Egret does not drive.
    NoRoute,
}

/// The forwarding snapshot.
#[derive(Clone, Debug, Default)]
pub struct Fib {
    generation: u64,
    interfaces: AHashMap<u32, Interface>,
    routes_v4: Lpm<Ipv4Addr, Route>,
    routes_v6: Lpm<Ipv6Addr, Route>,
    neighbors: AHashMap<(u32, IpAddr), Mac>,
    /// The gateway's own addresses, by interface: the source of the ICMP
    /// errors it originates as a router (RFC 1812 4.3.2.4).
    addresses: Vec<(u32, IpAddr)>,
    /// The smallest MTU of any interface (0 with none): a datagram no
    /// larger needs no per-interface MTU lookup.
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
        self.interfaces.insert(iface.ifindex, iface);
        self.min_mtu = self.interfaces.values().map(|i| i.mtu).min().unwrap_or(0);
        self
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

    /// The MTU of interface `ifindex`, if known.
    #[inline]
    pub fn mtu(&self, ifindex: u32) -> Option<u32> {
        self.interfaces.get(&ifindex).map(|i| i.mtu)
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
        let Some(route) = self.route(dst) else { return NextHop::NoRoute };
        let Some(iface) = self.interfaces.get(&route.oif) else { return NextHop::NoRoute };
        let via = route.gateway.unwrap_or(dst);
        match self.neighbors.get(&(route.oif, via)) {
            Some(mac) => NextHop::Resolved { oif: route.oif, src_mac: iface.mac, dst_mac: *mac },
            None => NextHop::Unresolved { oif: route.oif, addr: via },
        }
    }

    /// Every route: (destination, prefix length, route). The XDP fast path's
    /// offload manager compares these between snapshots to find out when its
    /// installed next hops must be re-resolved.
    pub fn routes(&self) -> impl Iterator<Item = (IpAddr, u8, Route)> + '_ {
        let v4 = self.routes_v4.iter().map(|(p, r)| (IpAddr::V4(p.addr), p.len, *r));
        let v6 = self.routes_v6.iter().map(|(p, r)| (IpAddr::V6(p.addr), p.len, *r));
        v4.chain(v6)
    }

    /// Number of routes and neighbours (for metrics).
    pub fn sizes(&self) -> (usize, usize) {
        (self.routes_v4.len() + self.routes_v6.len(), self.neighbors.len())
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
}
