//! A worker's cache of resolved next hops by destination address.

use std::net::IpAddr;

use crate::fib::{Fib, Mac, NeighborUse, NextHop};

/// Entries of a worker's next-hop cache (direct-mapped).
const NEXT_HOP_CACHE: usize = 1024;

/// A worker's cache of resolved next hops by destination address, valid for
/// one forwarding snapshot (its generation): the route and neighbour lookups
/// cost more than the whole NAT fast path, and a flow's destination does not
/// change between packets.
/// (key, FIB generation, output interface, source MAC, next hop MAC, the
/// next hop's [`NeighborUse`] slot).
type CachedHop = (u128, u64, u32, Mac, Mac, u32);

pub(super) struct NextHopCache {
    entries: Box<[CachedHop]>,
}

impl NextHopCache {
    pub(super) fn new() -> Self {
        NextHopCache { entries: vec![(0, u64::MAX, 0, [0; 6], [0; 6], 0); NEXT_HOP_CACHE].into_boxed_slice() }
    }

    #[inline]
    fn key(ip: IpAddr) -> u128 {
        match ip {
            // IPv4 keys are tagged so they cannot equal an IPv6 key.
            IpAddr::V4(a) => u128::from(u32::from(a)) | (1 << 127),
            IpAddr::V6(a) => u128::from(a) & !(1 << 127) | (u128::from(a) >> 127 << 126),
        }
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
        let key = Self::key(dst);
        let i = Self::slot(key);
        if let Some(e) = self.entries.get(i) {
            if e.0 == key && e.1 == fib.generation() {
                uses.touch(e.5, secs);
                return NextHop::Resolved { oif: e.2, src_mac: e.3, dst_mac: e.4 };
            }
        }
        let (hop, via) = fib.next_hop_via(dst);
        if let (NextHop::Resolved { oif, src_mac, dst_mac }, Some((_, addr))) = (hop, via) {
            let used = NeighborUse::slot(oif, addr);
            uses.touch(used, secs);
            if let Some(e) = self.entries.get_mut(i) {
                *e = (key, fib.generation(), oif, src_mac, dst_mac, used);
            }
        }
        hop
    }
}
