//! A worker's exact-match flow cache in front of the shared session map.
//!
//! Like Open vSwitch's EMC (the per-thread exact match cache in front of its
//! classifier): a direct-mapped array, owned by one worker, indexed by a hash
//! of a packet's [`FlowKey`], holding the [`SessionRef`] the shared map gave
//! for a key of that hash last time. A hit skips the map (its hashing, its
//! shard lock and its probe) and goes straight to the slot, where
//! [`SessionTable::lookup_at`] makes the same check the map lookup makes: the
//! slot must be live and derive this very key in the ref's direction. So an
//! entry never needs invalidating, and it need not hold the key: another key
//! of the same hash, a session removed, or its slot reused by another session
//! all turn the entry into a miss, and the caller falls back to the map.
//!
//! Four bytes an entry: the cache's memory is what each packet's first
//! random access touches, so it is kept dense (2^17 entries = 512 KiB, about
//! a quarter of a core's L2 here) rather than exact.
//!
//! [`SessionTable::lookup_at`]: super::session::SessionTable::lookup_at

use std::hash::Hasher;

use super::key::{FlowKey, NatAddr};
use super::session::SessionRef;

/// A folded-multiply hasher for cache indices (not DoS-resistant: a flooded
/// entry only costs its owner a map lookup, never a wrong session).
#[derive(Default)]
struct IndexHasher(u64);

const K: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xD6E8_FEB8_6659_FD93;

impl Hasher for IndexHasher {
    #[inline]
    fn finish(&self) -> u64 {
        // One more folded multiply: the last word written reaches every bit.
        let m = u128::from(self.0) * u128::from(K2);
        (m as u64) ^ ((m >> 64) as u64)
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    #[inline]
    fn write_u64(&mut self, v: u64) {
        // A folded multiply: every input bit reaches the high bits.
        let m = u128::from(self.0 ^ v) * u128::from(K);
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }

    #[inline]
    fn write_u128(&mut self, v: u128) {
        self.write_u64(v as u64);
        self.write_u64((v >> 64) as u64);
    }
}

/// A direct-mapped cache of `hash(FlowKey) -> SessionRef` for one worker.
#[derive(Debug)]
pub struct FlowCache<A> {
    entries: Box<[SessionRef]>,
    shift: u32,
    _family: std::marker::PhantomData<A>,
}

/// An entry that points at no slot (beyond any table's capacity): a miss.
const EMPTY: u32 = (1 << 31) - 1;

impl<A: NatAddr> FlowCache<A> {
    /// A cache of `2^bits` entries (`bits` in 1..=24), all empty.
    pub fn new(bits: u32) -> Self {
        let bits = bits.clamp(1, 24);
        let empty = SessionRef::new(EMPTY, false);
        FlowCache {
            entries: vec![empty; 1 << bits].into_boxed_slice(),
            shift: 64 - bits,
            _family: std::marker::PhantomData,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache has no entries (never).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    #[inline(always)]
    fn slot(&self, key: &FlowKey<A>) -> usize {
        let mut h = IndexHasher::default();
        A::hash_key(key, &mut h);
        // The high bits of a multiplicative hash are the well-mixed ones.
        (h.finish() >> self.shift) as usize
    }

    /// The ref last stored for a key of `key`'s hash: a candidate, to be
    /// checked against its slot (`SessionTable::lookup_at`).
    #[inline(always)]
    pub fn get(&self, key: &FlowKey<A>) -> Option<SessionRef> {
        self.entries.get(self.slot(key)).copied().filter(|r| r.index() != EMPTY)
    }

    /// The entry `key` reads, for a batch's first stage: its line is
    /// prefetched, and [`get_at`](Self::get_at) reads it later.
    #[inline]
    pub fn prefetch(&self, key: &FlowKey<A>) -> usize {
        let i = self.slot(key);
        if let Some(e) = self.entries.get(i) {
            crate::prefetch::read(e);
        }
        i
    }

    /// The candidate at entry `i` (from [`prefetch`](Self::prefetch)).
    #[inline]
    pub fn get_at(&self, i: usize) -> Option<SessionRef> {
        self.entries.get(i).copied().filter(|r| r.index() != EMPTY)
    }

    /// Remembers the ref the map gave for `key` (replacing whatever shared
    /// its entry).
    #[inline]
    pub fn put(&mut self, key: &FlowKey<A>, r: SessionRef) {
        let i = self.slot(key);
        if let Some(e) = self.entries.get_mut(i) {
            *e = r;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::nat::key::proto;

    #[test]
    fn remembers_and_replaces() {
        let mut c = FlowCache::<Ipv4Addr>::new(4);
        assert_eq!(c.len(), 16);
        let k = FlowKey::new(Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 51, 100, 1), 1024, 9, proto::UDP);
        assert_eq!(c.get(&k), None);
        c.put(&k, SessionRef::new(7, true));
        assert_eq!(c.get(&k), Some(SessionRef::new(7, true)));
        c.put(&k, SessionRef::new(9, false));
        assert_eq!(c.get(&k), Some(SessionRef::new(9, false)));
        // A key of another entry reads nothing; one sharing the entry reads
        // its ref (a candidate the slot check turns away).
        let others: Vec<_> = (0..64u16)
            .map(|p| {
                FlowKey::new(Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 51, 100, 1), 2000 + p, 9, proto::UDP)
            })
            .collect();
        let shared = others.iter().filter(|o| c.slot(o) == c.slot(&k)).count();
        let hits = others.iter().filter(|o| c.get(o).is_some()).count();
        assert_eq!(hits, shared);
        assert!(hits < 64);
    }

    #[test]
    fn keys_spread_over_the_entries() {
        // 4096 keys into 1024 entries: a fair hash leaves ~2% (e^-4) empty.
        let c6 = FlowCache::<Ipv6Addr>::new(10);
        let mut seen = vec![false; c6.len()];
        for port in 0..4096u16 {
            let k = FlowKey::new(Ipv6Addr::LOCALHOST, Ipv6Addr::UNSPECIFIED, port, 443, proto::TCP);
            seen[c6.slot(&k)] = true;
        }
        let used = seen.iter().filter(|s| **s).count();
        assert!(used > 980, "IPv6: {used} of 1024 entries used");
        // The benchmark's shape: 200 addresses x ports.
        let c4 = FlowCache::<Ipv4Addr>::new(10);
        let mut seen = vec![false; c4.len()];
        for i in 0..4096u32 {
            let src = Ipv4Addr::from(0xC612_0100 + i % 200);
            let k = FlowKey::new(src, Ipv4Addr::new(198, 51, 100, 1), 1024 + (i / 200) as u16, 9, proto::UDP);
            seen[c4.slot(&k)] = true;
        }
        let used = seen.iter().filter(|s| **s).count();
        assert!(used > 980, "IPv4: {used} of 1024 entries used");
    }
}
