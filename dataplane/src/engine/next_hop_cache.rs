//! A worker's cache of resolved next hops by destination address.

use std::net::IpAddr;

use crate::fib::{Fib, Mac, NeighborUse, NextHop};

/// Entries of a worker's next-hop cache (direct-mapped).
const NEXT_HOP_CACHE: usize = 1024;

/// A worker's cache of resolved next hops by destination address, valid for
/// one forwarding snapshot (its generation): the route and neighbour lookups
/// cost more than the whole NAT fast path, and a flow's destination does not
/// change between packets.
/// (address, [`NextHopCache::tag`], output interface, the frame's new
/// first 12 bytes: the next hop's MAC then the interface's, the next hop's
/// [`NeighborUse`] slot).
type CachedHop = (u128, u64, u32, [u8; 12], u32);

pub(super) struct NextHopCache {
    entries: Box<[CachedHop]>,
}

impl NextHopCache {
    pub(super) fn new() -> Self {
        // An empty entry: an odd tag (IPv4) with an address no IPv4
        // address has (they are below 2^32), so no lookup ever takes it.
        NextHopCache { entries: vec![(u128::MAX, u64::MAX, 0, [0; 12], 0); NEXT_HOP_CACHE].into_boxed_slice() }
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
                uses.touch(e.4, secs);
                let (dst_mac, src_mac) = split(&e.3);
                return NextHop::Resolved { oif: e.2, src_mac, dst_mac };
            }
        }
        self.miss(fib, uses, dst, i, (key, tag), secs)
    }

    /// As [`Self::lookup`] for a resolved hop only (`None` for any other):
    /// its interface and the frame's new first 12 bytes (the next hop's
    /// MAC, then the interface's) as the entry keeps them, written by the
    /// established path in one copy. Two MACs handed over apart went
    /// through the stack twice: 15 instructions an established IPv4
    /// packet, 23 IPv6 (docs/benchmarks.md, "The frame's new MACs in one
    /// copy").
    #[inline(always)]
    pub(super) fn resolved(
        &mut self,
        fib: &Fib,
        uses: &NeighborUse,
        dst: IpAddr,
        secs: u32,
    ) -> Option<(u32, [u8; 12])> {
        let (key, family) = Self::key(dst);
        let (i, tag) = (Self::slot(key), Self::tag(fib, family));
        if let Some(e) = self.entries.get(i) {
            if e.0 == key && e.1 == tag {
                uses.touch(e.4, secs);
                return Some((e.2, e.3));
            }
        }
        match self.miss(fib, uses, dst, i, (key, tag), secs) {
            NextHop::Resolved { oif, src_mac, dst_mac } => Some((oif, join(dst_mac, src_mac))),
            _ => None,
        }
    }

    /// A miss: the FIB's answer for `dst`, put in entry `i` when resolved
    /// (out of line: a worker's hops are nearly all in its cache).
    #[cold]
    #[inline(never)]
    fn miss(
        &mut self,
        fib: &Fib,
        uses: &NeighborUse,
        dst: IpAddr,
        i: usize,
        (key, tag): (u128, u64),
        secs: u32,
    ) -> NextHop {
        let (hop, via) = fib.next_hop_via(dst);
        if let (NextHop::Resolved { oif, src_mac, dst_mac }, Some((_, addr))) = (hop, via) {
            let used = NeighborUse::slot(oif, addr);
            uses.touch(used, secs);
            if let Some(e) = self.entries.get_mut(i) {
                *e = (key, tag, oif, join(dst_mac, src_mac), used);
            }
        }
        hop
    }
}

/// Two MACs as an Ethernet header's first 12 bytes: `a` (the destination)
/// then `b` (the source).
fn join(a: Mac, b: Mac) -> [u8; 12] {
    let mut o = [0; 12];
    o[..6].copy_from_slice(&a);
    o[6..].copy_from_slice(&b);
    o
}

/// [`join`] undone: (destination, source).
#[inline(always)]
fn split(m: &[u8; 12]) -> (Mac, Mac) {
    let mut a = [0; 6];
    let mut b = [0; 6];
    a.copy_from_slice(&m[..6]);
    b.copy_from_slice(&m[6..]);
    (a, b)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fib::{Interface, Route};

    /// The hop `cache` gives `dst`: (interface, next hop MAC).
    fn hop(cache: &mut NextHopCache, fib: &Fib, dst: IpAddr) -> (u32, Mac) {
        match cache.lookup(fib, &NeighborUse::default(), dst, 1) {
            NextHop::Resolved { oif, dst_mac, .. } => (oif, dst_mac),
            other => panic!("{dst}: {other:?}"),
        }
    }

    #[test]
    fn an_address_keeps_its_own_hop_across_families_top_bits_and_generations() {
        // On-link prefixes, each on its own interface: three IPv6 ones whose
        // addresses differ only in their top two bits (a ULA pod range,
        // fd00::/8, among them), ::/2 (whose ::1 is the number of the IPv4
        // 0.0.0.1) and IPv4's default.
        let mut fib = Fib::new();
        let nets: [(&str, u8, u32); 5] =
            [("7d00::", 8, 2), ("bd00::", 8, 3), ("fd00::", 8, 4), ("::", 2, 6), ("0.0.0.0", 0, 5)];
        for (i, (net, len, ifindex)) in nets.iter().enumerate() {
            let mac = [2, 0, 0, 0, 0, *ifindex as u8];
            fib.add_interface(Interface { ifindex: *ifindex, name: format!("if{i}"), mac, mtu: 1500 });
            fib.add_route(net.parse().unwrap(), *len, Route { oif: *ifindex, gateway: None });
        }
        let dsts: [(IpAddr, u32); 5] = [
            ("7d00::5".parse().unwrap(), 2),
            ("bd00::5".parse().unwrap(), 3),
            ("fd00::5".parse().unwrap(), 4),
            ("::1".parse().unwrap(), 6),
            ("0.0.0.1".parse().unwrap(), 5),
        ];
        for (dst, ifindex) in dsts {
            fib.add_neighbor(ifindex, dst, [2, 0, 0, 0, 1, ifindex as u8]);
        }
        fib.set_generation(1);
        let mut cache = NextHopCache::new();
        for round in 0..2 {
            for (dst, ifindex) in dsts {
                assert_eq!(
                    hop(&mut cache, &fib, dst),
                    (ifindex, [2, 0, 0, 0, 1, ifindex as u8]),
                    "{dst}, round {round}"
                );
            }
        }
        // A new snapshot moves 0.0.0.1's neighbour: the cached hop is not
        // the answer any more.
        let mut next = fib.clone();
        next.add_neighbor(5, dsts[4].0, [2, 0, 0, 0, 2, 5]);
        next.set_generation(2);
        assert_eq!(hop(&mut cache, &next, dsts[4].0), (5, [2, 0, 0, 0, 2, 5]), "the new snapshot's MAC");
    }

    #[test]
    fn resolved_gives_the_frames_new_macs_as_lookup_does_and_nothing_for_an_unresolved_hop() {
        let mut fib = Fib::new();
        let own = [2, 0, 0, 0, 0, 7];
        fib.add_interface(Interface { ifindex: 7, name: "if7".into(), mac: own, mtu: 1500 });
        fib.add_route("0.0.0.0".parse().unwrap(), 0, Route { oif: 7, gateway: None });
        let (known, unknown): (IpAddr, IpAddr) = ("198.18.0.1".parse().unwrap(), "198.18.0.2".parse().unwrap());
        let theirs = [2, 0, 0, 0, 1, 7];
        fib.add_neighbor(7, known, theirs);
        fib.set_generation(1);
        let uses = NeighborUse::default();
        // From an empty cache (the miss fills it), then from the entry.
        for (round, mut cache) in [NextHopCache::new(), NextHopCache::new()].into_iter().enumerate() {
            if round == 1 {
                let _ = cache.lookup(&fib, &uses, known, 1);
            }
            let mut head = [0u8; 12];
            head[..6].copy_from_slice(&theirs);
            head[6..].copy_from_slice(&own);
            assert_eq!(cache.resolved(&fib, &uses, known, 1), Some((7, head)), "round {round}");
            assert_eq!(cache.resolved(&fib, &uses, known, 1), Some((7, head)), "round {round}, from the entry");
            assert_eq!(
                cache.lookup(&fib, &uses, known, 1),
                NextHop::Resolved { oif: 7, src_mac: own, dst_mac: theirs },
                "round {round}: lookup reads the entry resolved filled"
            );
            assert_eq!(cache.resolved(&fib, &uses, unknown, 1), None, "no neighbour: not resolved");
            assert!(matches!(cache.lookup(&fib, &uses, unknown, 1), NextHop::Unresolved { oif: 7, .. }));
        }
    }

    #[test]
    fn an_empty_cache_answers_nothing_from_its_empty_entries() {
        // The empty entries' tag is the tag of an IPv4 lookup at generation
        // 2^63 - 1; their address is no IPv4 address's.
        let mut fib = Fib::new();
        fib.set_generation((1 << 63) - 1);
        let mut cache = NextHopCache::new();
        for dst in ["0.0.0.0", "255.255.255.255", "::"] {
            let dst: IpAddr = dst.parse().unwrap();
            assert!(!matches!(cache.lookup(&fib, &NeighborUse::default(), dst, 1), NextHop::Resolved { .. }), "{dst}");
        }
    }
}
