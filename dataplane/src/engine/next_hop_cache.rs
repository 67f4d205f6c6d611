//! A worker's cache of resolved next hops by destination address.

use std::net::IpAddr;

use crate::fib::{Fib, Mac, NeighborUse, NextHop};

/// Entries of a worker's next-hop cache (direct-mapped).
const NEXT_HOP_CACHE: usize = 1024;

/// A worker's cache of resolved next hops by destination address, valid for
/// one forwarding snapshot (its generation): the route and neighbour lookups
/// cost more than the whole NAT fast path, and a flow's destination does not
/// change between packets.
/// (address, [`NextHopCache::tag`], output interface, source MAC, next hop
/// MAC, the next hop's [`NeighborUse`] slot).
type CachedHop = (u128, u64, u32, Mac, Mac, u32);

pub(super) struct NextHopCache {
    entries: Box<[CachedHop]>,
}

impl NextHopCache {
    pub(super) fn new() -> Self {
        // An empty entry's tag, u64::MAX, is no generation's (below 2^63).
        NextHopCache { entries: vec![(0, u64::MAX, 0, [0; 6], [0; 6], 0); NEXT_HOP_CACHE].into_boxed_slice() }
    }

    /// The address as 128 bits, and its family (1: IPv4).
    #[inline]
    fn key(ip: IpAddr) -> (u128, u64) {
        match ip {
            IpAddr::V4(a) => (u128::from(u32::from(a)), 1),
            IpAddr::V6(a) => (u128::from(a), 0),
        }
    }

    /// What an entry must carry besides the address to answer: the FIB's
    /// generation and the address's family, so that an IPv4 address and
    /// the IPv6 address of the same number never take each other's hop.
    /// (The family once went into the address's top bit, which made IPv6
    /// addresses differing only in their top two bits one key.)
    #[inline]
    fn tag(fib: &Fib, family: u64) -> u64 {
        fib.generation() << 1 | family
    }

    #[inline]
    fn slot(key: u128) -> usize {
        let h = (key as u64 ^ (key >> 64) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (h >> 54) as usize % NEXT_HOP_CACHE
    }

    /// The next hop towards `dst`; a resolved one is stamped as used at
    /// `secs` in `uses` (the daemon keeps its kernel entry alive).
    #[inline(always)]
    pub(super) fn lookup(&mut self, fib: &Fib, uses: &NeighborUse, dst: IpAddr, secs: u32) -> NextHop {
        let (key, family) = Self::key(dst);
        let (i, tag) = (Self::slot(key), Self::tag(fib, family));
        if let Some(e) = self.entries.get(i) {
            if e.0 == key && e.1 == tag {
                uses.touch(e.5, secs);
                return NextHop::Resolved { oif: e.2, src_mac: e.3, dst_mac: e.4 };
            }
        }
        let (hop, via) = fib.next_hop_via(dst);
        if let (NextHop::Resolved { oif, src_mac, dst_mac }, Some((_, addr))) = (hop, via) {
            let used = NeighborUse::slot(oif, addr);
            uses.touch(used, secs);
            if let Some(e) = self.entries.get_mut(i) {
                *e = (key, tag, oif, src_mac, dst_mac, used);
            }
        }
        hop
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fib::{Interface, Route};

    #[test]
    fn addresses_that_differ_in_their_top_bits_keep_their_own_hops() {
        // Three on-link IPv6 prefixes whose addresses differ only in the
        // top two bits, each on its own interface, and an IPv4 one.
        let mut fib = Fib::new();
        let nets: [(&str, u32); 4] = [("4000::", 2), ("8000::", 3), ("c000::", 4), ("0.0.0.0", 5)];
        for (i, (net, ifindex)) in nets.iter().enumerate() {
            let mac = [2, 0, 0, 0, 0, *ifindex as u8];
            fib.add_interface(Interface { ifindex: *ifindex, name: format!("if{i}"), mac, mtu: 1500 });
            let len = if net.contains(':') { 2 } else { 0 };
            fib.add_route(net.parse().unwrap(), len, Route { oif: *ifindex, gateway: None });
        }
        let dsts: [(IpAddr, u32); 4] = [
            ("4000::1".parse().unwrap(), 2),
            ("8000::1".parse().unwrap(), 3),
            ("c000::1".parse().unwrap(), 4),
            ("0.0.0.1".parse().unwrap(), 5),
        ];
        for (dst, ifindex) in dsts {
            fib.add_neighbor(ifindex, dst, [2, 0, 0, 0, 1, ifindex as u8]);
        }
        let (mut cache, uses) = (NextHopCache::new(), NeighborUse::default());
        for round in 0..2 {
            for (dst, ifindex) in dsts {
                match cache.lookup(&fib, &uses, dst, 1) {
                    NextHop::Resolved { oif, dst_mac, .. } => {
                        assert_eq!((oif, dst_mac[5]), (ifindex, ifindex as u8), "{dst}, round {round}")
                    }
                    other => panic!("{dst}, round {round}: {other:?}"),
                }
            }
        }
    }
}
