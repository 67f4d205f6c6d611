//! A worker's exact-match flow cache in front of the shared session index.
//!
//! Like Open vSwitch's EMC (the per-thread exact match cache in front of its
//! classifier): an array owned by one worker, in pairs of entries chosen by
//! a hash of a packet's [`FlowKey`], each holding a [`SessionRef`] the
//! shared index gave for a key of that pair. A hit skips the index (its hashing, its
//! probe of its bucket) and goes straight to the slot, where
//! [`SessionTable::lookup_at`] makes the same check the index lookup makes: the
//! slot must be live and derive this very key in the ref's direction. So an
//! entry never needs invalidating, and it need not hold the key: another key
//! of the same hash, a session removed, or its slot reused by another session
//! all turn the entry into a miss, and the caller falls back to the index.
//!
//! Four bytes an entry: the cache's memory is what each packet's first
//! random access touches, so it is kept dense (2^17 entries = 512 KiB, about
//! a quarter of a core's L2 here) rather than exact.
//!
//! The bits of an entry the table's slot indices do not need hold a tag:
//! more bits of the key's hash. A key whose tag differs from both entries'
//! of its pair is a miss without a slot being read, and the tag tells which
//! of the two is the key's (two-way set-associative, as a CPU's caches are:
//! two flows whose hashes meet both stay). On a busy gateway every entry holds
//! some earlier flow's ref, so without the tag each new flow read one
//! random slot (a line from memory at a million sessions) only to find
//! another flow there. With the default 2^20 sessions the tag is 10 bits
//! (a new flow still reads a stranger's slot about once in 512: two
//! entries of 1,024 tags), at 10 M sessions 7 bits.
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

/// A two-way set-associative cache of `hash(FlowKey) -> SessionRef` for
/// one worker: a key's two candidate entries are side by side in one
/// line, told apart by their tags, so two flows whose hashes meet both
/// stay (a direct-mapped cache kept one: with 65,536 flows sent
/// round-robin, 61 % of packets hit a direct-mapped 2^17 entries and 74 %
/// these pairs, in a simulation; docs/benchmarks.md).
#[derive(Debug)]
pub struct FlowCache<A> {
    /// A [`SessionRef`]'s bits (bit 31 inbound, the slot index in the low
    /// bits) with the key's tag in the bits between.
    pairs: Box<[[u32; 2]]>,
    shift: u32,
    /// The bits of an entry that hold the tag.
    tag_mask: u32,
    /// The bits of an entry that are the ref.
    ref_mask: u32,
    _family: std::marker::PhantomData<A>,
}

/// Which pair of entries is a key's and the tag it must hold: what a batch's first
/// stage computes once ([`FlowCache::prefetch`]) for the later stages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    at: usize,
    tag: u32,
}

const INBOUND: u32 = 1 << 31;

impl<A: NatAddr> FlowCache<A> {
    /// A cache of `2^bits` entries (`bits` in 2..=24), all empty, in front
    /// of a session table of `capacity` slots (which fixes how many bits
    /// of an entry are the index, and so how many are left for the tag).
    pub fn new(bits: u32, capacity: usize) -> Self {
        let bits = bits.clamp(2, 24);
        // Enough bits that the all-ones index, an empty entry's, is no
        // slot's (its check against the table finds nothing).
        let index_bits = (usize::BITS - capacity.leading_zeros()).clamp(1, 31);
        let index_mask = (1u32 << index_bits) - 1;
        FlowCache {
            pairs: vec![[index_mask; 2]; 1 << (bits - 1)].into_boxed_slice(),
            // The top bits choose a pair.
            shift: 64 - (bits - 1),
            tag_mask: !INBOUND & !index_mask,
            ref_mask: INBOUND | index_mask,
            _family: std::marker::PhantomData,
        }
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.pairs.len() * 2
    }

    /// Whether the cache has no entries (never).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Bits of an entry that hold the tag.
    pub fn tag_bits(&self) -> u32 {
        self.tag_mask.count_ones()
    }

    #[inline(always)]
    fn probe(&self, key: &FlowKey<A>) -> Probe {
        let mut h = IndexHasher::default();
        A::hash_key(key, &mut h);
        let h = h.finish();
        // The high bits of a multiplicative hash are the well-mixed ones:
        // the entry from the top; the tag from the low word, which the
        // fold mixed with the product's high half, and which no entry
        // position reaches (at most 24 bits from the top).
        Probe { at: (h >> self.shift) as usize, tag: (h as u32) & self.tag_mask }
    }

    /// The ref of the pair's entry whose tag is the probe's (the first
    /// entry, the newer, before the second). An empty entry (tag zero,
    /// index all ones) reads as a ref to no slot, which the check against
    /// the table turns away like any stranger's.
    #[inline(always)]
    fn read(&self, p: Probe) -> Option<SessionRef> {
        let pair = self.pairs.get(p.at)?;
        let ours = |e: u32| (e ^ p.tag) & self.tag_mask == 0;
        let e = if ours(pair[0]) {
            pair[0]
        } else if ours(pair[1]) {
            pair[1]
        } else {
            return None;
        };
        Some(SessionRef::from_bits(e & self.ref_mask))
    }

    /// The ref last stored for a key of `key`'s entry and tag: a
    /// candidate, to be checked against its slot (`SessionTable::lookup_at`).
    #[inline(always)]
    pub fn get(&self, key: &FlowKey<A>) -> Option<SessionRef> {
        self.read(self.probe(key))
    }

    /// The entry `key` reads, for a batch's first stage: its line is
    /// prefetched, and [`get_at`](Self::get_at) reads it later.
    #[inline]
    pub fn prefetch(&self, key: &FlowKey<A>) -> Probe {
        let p = self.probe(key);
        if let Some(e) = self.pairs.get(p.at) {
            crate::prefetch::read(e);
        }
        p
    }

    /// The candidate of a probe (from [`prefetch`](Self::prefetch)).
    #[inline]
    pub fn get_at(&self, p: Probe) -> Option<SessionRef> {
        self.read(p)
    }

    /// Remembers the ref the index gave for `key` as the pair's first
    /// entry; the first moves to second unless it was the key's own (the
    /// older of the pair's two is forgotten).
    #[inline]
    pub fn put(&mut self, key: &FlowKey<A>, r: SessionRef) {
        let p = self.probe(key);
        let new = (r.bits() & self.ref_mask) | p.tag;
        let tag_mask = self.tag_mask;
        let Some(pair) = self.pairs.get_mut(p.at) else { return };
        if (pair[0] ^ p.tag) & tag_mask != 0 {
            pair[1] = pair[0];
        }
        pair[0] = new;
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::nat::key::proto;

    #[test]
    fn remembers_and_replaces() {
        let mut c = FlowCache::<Ipv4Addr>::new(4, 1 << 20);
        assert_eq!(c.len(), 16);
        assert_eq!(c.tag_bits(), 10, "2^20 slots need 21 bits (all ones is empty)");
        let k = FlowKey::new(Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 51, 100, 1), 1024, 9, proto::UDP);
        assert_eq!(c.get(&k), None);
        c.put(&k, SessionRef::new(7, true));
        assert_eq!(c.get(&k), Some(SessionRef::new(7, true)));
        c.put(&k, SessionRef::new(9, false));
        assert_eq!(c.get(&k), Some(SessionRef::new(9, false)));
        // The highest slot index is remembered too.
        c.put(&k, SessionRef::new((1 << 20) - 1, true));
        assert_eq!(c.get(&k), Some(SessionRef::new((1 << 20) - 1, true)));
        // An empty entry that a key's tag matches (tag zero) names no slot.
        let empty = FlowCache::<Ipv4Addr>::new(4, 1 << 20);
        let zero =
            (0..u16::MAX).map(|p| FlowKey::new(k.src, k.dst, p, 9, proto::UDP)).find(|k| empty.probe(k).tag == 0);
        let r = empty.get(&zero.expect("one key in 1,024 has tag zero")).expect("a candidate");
        assert_eq!(r, SessionRef::new((1 << 21) - 1, false), "beyond any slot of 2^20");
    }

    /// A key that shares another's pair but not its tag reads nothing,
    /// so its slot is never read; without tag bits (a table of 2^31 - 1
    /// slots) it reads the other key's ref, a candidate the slot check
    /// turns away.
    #[test]
    fn a_key_of_another_tag_misses_before_its_slot_is_read() {
        let key = |p: u16| FlowKey::new(Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 51, 100, 1), p, 9, proto::UDP);
        for (capacity, tag_bits) in [(1usize << 20, 10), ((1 << 31) - 1, 0)] {
            let mut c = FlowCache::<Ipv4Addr>::new(4, capacity);
            assert_eq!(c.tag_bits(), tag_bits);
            c.put(&key(1024), SessionRef::new(7, false));
            let at = c.probe(&key(1024)).at;
            let sharing: Vec<u16> = (2000..6000).filter(|&p| c.probe(&key(p)).at == at).collect();
            assert!(sharing.len() > 100, "keys sharing the pair: {}", sharing.len());
            let read = sharing.iter().filter(|&&p| c.get(&key(p)).is_some()).count();
            if tag_bits == 0 {
                assert_eq!(read, sharing.len(), "no tag: every key of the pair reads the ref");
            } else {
                // 1 in 1,024 may share the tag too.
                assert!(read <= sharing.len() / 100, "{read} of {} keys of the pair read the ref", sharing.len());
            }
        }
    }

    #[test]
    fn keys_spread_over_the_pairs() {
        // 4096 keys into 512 pairs: a fair hash leaves ~0.03% (e^-8) empty.
        let c6 = FlowCache::<Ipv6Addr>::new(10, 1 << 20);
        let mut seen = vec![false; c6.len() / 2];
        for port in 0..4096u16 {
            let k = FlowKey::new(Ipv6Addr::LOCALHOST, Ipv6Addr::UNSPECIFIED, port, 443, proto::TCP);
            seen[c6.probe(&k).at] = true;
        }
        let used = seen.iter().filter(|s| **s).count();
        assert!(used > 505, "IPv6: {used} of 512 pairs used");
        // The benchmark's shape: 200 addresses x ports.
        let c4 = FlowCache::<Ipv4Addr>::new(10, 1 << 20);
        let mut seen = vec![false; c4.len() / 2];
        for i in 0..4096u32 {
            let src = Ipv4Addr::from(0xC612_0100 + i % 200);
            let k = FlowKey::new(src, Ipv4Addr::new(198, 51, 100, 1), 1024 + (i / 200) as u16, 9, proto::UDP);
            seen[c4.probe(&k).at] = true;
        }
        let used = seen.iter().filter(|s| **s).count();
        assert!(used > 505, "IPv4: {used} of 512 pairs used");
    }

    /// Two flows whose keys choose the same pair are both remembered; a
    /// third forgets the one put longest ago.
    #[test]
    fn a_pair_keeps_two_flows_and_forgets_the_older() {
        let mut c = FlowCache::<Ipv4Addr>::new(4, 1 << 20);
        let key = |p: u16| FlowKey::new(Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 51, 100, 1), p, 9, proto::UDP);
        let at = c.probe(&key(1)).at;
        let tag = c.probe(&key(1)).tag;
        let mut same_pair = (2..u16::MAX).filter(|&p| c.probe(&key(p)).at == at && c.probe(&key(p)).tag != tag);
        let (a, b, d) = (key(1), key(same_pair.next().unwrap()), key(same_pair.next().unwrap()));
        c.put(&a, SessionRef::new(1, false));
        c.put(&b, SessionRef::new(2, false));
        assert_eq!(c.get(&a), Some(SessionRef::new(1, false)), "the first stays beside the second");
        assert_eq!(c.get(&b), Some(SessionRef::new(2, false)));
        // The first flow again: the second kept beside it.
        c.put(&a, SessionRef::new(3, true));
        assert_eq!((c.get(&a), c.get(&b)), (Some(SessionRef::new(3, true)), Some(SessionRef::new(2, false))));
        // Put again, the first is the newer: a third forgets the second.
        c.put(&d, SessionRef::new(4, false));
        assert_eq!(c.get(&d), Some(SessionRef::new(4, false)));
        assert_eq!(c.get(&a), Some(SessionRef::new(3, true)), "the newer stays");
        assert_eq!(c.get(&b), None, "the one put longest ago is forgotten");
        // A key put again while it is the first entry keeps the second.
        c.put(&d, SessionRef::new(5, false));
        assert_eq!((c.get(&d), c.get(&a)), (Some(SessionRef::new(5, false)), Some(SessionRef::new(3, true))));
    }
}
