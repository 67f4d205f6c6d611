//! Virtual reassembly for fragments (VPP's approach, RFC 4787 REQ-14 asks
//! NATs to support fragments).
//!
//! Only a datagram's first fragment carries the transport ports, so it alone
//! can be matched to a session. When it is translated, the translation (the
//! new source and destination addresses) is remembered under the fragment
//! identity (source, destination, identification, protocol) of the original
//! datagram; later fragments of the same datagram look it up and get the same
//! address rewrite. Fragments are never reassembled: a non-first fragment
//! that arrives before its first fragment (or after the entry expired) is
//! held by the worker loop, unchanged, and processed again until its
//! first's translation is here, or dropped after a timeout (the engine's
//! `Verdict::HoldFragment`, worker.rs; ADR 0020).
//!
//! The cache is bounded: a fixed number of buckets of [`WAYS`] entries each. A
//! new datagram that finds its bucket full of unexpired entries is refused
//! (counted as `fragment_cache_full`) rather than evicting a datagram in
//! flight.

use std::hash::Hash;

use parking_lot::Mutex;

use super::key::NatAddr;
use crate::stats::Direction;

/// Entries per bucket.
pub const WAYS: usize = 4;

/// The identity of a fragmented datagram as it arrived (before translation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragKey<A> {
    /// Source address.
    pub src: A,
    /// Destination address.
    pub dst: A,
    /// IPv4 identification (16 bits) or IPv6 fragment header identification.
    pub ident: u32,
    /// Transport protocol.
    pub proto: u8,
}

/// How the datagram's fragments are translated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FragTranslation<A> {
    /// Source address after translation.
    pub new_src: A,
    /// Destination address after translation.
    pub new_dst: A,
    /// Which way the datagram goes.
    pub direction: Direction,
    /// Per-policy counter slot.
    pub policy_slot: u16,
}

type Bucket<A> = Mutex<[Option<Entry<A>>; WAYS]>;

#[derive(Clone, Copy, Debug)]
struct Entry<A> {
    key: FragKey<A>,
    translation: FragTranslation<A>,
    /// The last whole second in which the entry is live: `now` counts whole
    /// seconds, so an entry inserted at second S lives through S + timeout,
    /// at least `timeout` seconds and less than one more. (Expiring it at
    /// S + timeout instead would give it between timeout - 1 and timeout
    /// seconds: one second with the default 2.)
    expires: u32,
}

/// The bounded fragment cache of one address family.
#[derive(Debug)]
pub struct FragmentCache<A: NatAddr> {
    buckets: Box<[Bucket<A>]>,
    hasher: ahash::RandomState,
    timeout: u32,
}

/// The cache had no room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheFull;

impl<A: NatAddr> FragmentCache<A> {
    /// A cache of about `capacity` datagrams whose entries live at least
    /// `timeout_secs` (and less than one second more).
    pub fn new(capacity: usize, timeout_secs: u32) -> Self {
        let buckets = capacity.div_ceil(WAYS).max(1);
        FragmentCache {
            buckets: (0..buckets).map(|_| Mutex::new([None; WAYS])).collect(),
            hasher: ahash::RandomState::new(),
            timeout: timeout_secs.max(1),
        }
    }

    fn bucket(&self, key: &FragKey<A>) -> &Bucket<A> {
        let h = self.hasher.hash_one(key) as usize;
        &self.buckets[h % self.buckets.len()]
    }

    /// Remembers the translation of a datagram whose first fragment was just translated.
    pub fn insert(&self, key: FragKey<A>, translation: FragTranslation<A>, now: u32) -> Result<(), CacheFull> {
        let mut b = self.bucket(&key).lock();
        let expires = now.saturating_add(self.timeout);
        let slot = b
            .iter()
            .position(|e| e.is_some_and(|e| e.key == key))
            .or_else(|| b.iter().position(|e| e.is_none_or(|e| e.expires < now)));
        match slot {
            Some(i) => {
                b[i] = Some(Entry { key, translation, expires });
                Ok(())
            }
            None => Err(CacheFull),
        }
    }

    /// The translation for a later fragment of `key`, if its first fragment was seen.
    pub fn lookup(&self, key: &FragKey<A>, now: u32) -> Option<FragTranslation<A>> {
        let b = self.bucket(key).lock();
        b.iter().flatten().find(|e| e.key == *key && e.expires >= now).map(|e| e.translation)
    }

    /// Entries not yet expired (for metrics).
    pub fn live(&self, now: u32) -> usize {
        self.buckets.iter().map(|b| b.lock().iter().flatten().filter(|e| e.expires >= now).count()).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn key(id: u32) -> FragKey<Ipv4Addr> {
        FragKey { src: Ipv4Addr::new(192, 0, 2, 1), dst: Ipv4Addr::new(203, 0, 113, 1), ident: id, proto: 17 }
    }

    fn tr() -> FragTranslation<Ipv4Addr> {
        FragTranslation {
            new_src: Ipv4Addr::new(198, 51, 100, 1),
            new_dst: Ipv4Addr::new(203, 0, 113, 1),
            direction: Direction::Outbound,
            policy_slot: 0,
        }
    }

    #[test]
    fn later_fragments_find_the_first_until_expiry() {
        let c = FragmentCache::new(16, 2);
        assert_eq!(c.lookup(&key(1), 10), None);
        c.insert(key(1), tr(), 10).unwrap();
        assert_eq!(c.lookup(&key(1), 11), Some(tr()));
        assert_eq!(c.lookup(&key(2), 11), None);
        // Inserted late in second 10, looked up early in second 12: 1 s
        // may have passed, or 2.999 s; it must still be there.
        assert_eq!(c.lookup(&key(1), 12), Some(tr()), "live for at least the whole 2 s");
        assert_eq!(c.lookup(&key(1), 13), None, "expired after at most 3 s");
    }

    #[test]
    fn bounded_and_refuses_when_full() {
        let c = FragmentCache::new(4, 5); // one bucket of four ways
        for i in 0..4 {
            c.insert(key(i), tr(), 0).unwrap();
        }
        assert_eq!(c.insert(key(99), tr(), 1), Err(CacheFull));
        assert_eq!(c.live(1), 4);
        // Re-inserting a known datagram is fine, and expired entries make room.
        c.insert(key(2), tr(), 1).unwrap();
        assert_eq!(c.insert(key(99), tr(), 5), Err(CacheFull), "the first three live through second 5");
        c.insert(key(99), tr(), 6).unwrap();
        assert_eq!(c.lookup(&key(99), 7), Some(tr()));
    }
}
