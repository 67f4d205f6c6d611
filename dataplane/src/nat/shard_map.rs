//! The new-flow path's small shared maps: the pods' session counts, the
//! pods' counts in each port pool, the endpoint-independent mappings, and
//! in endpoint-dependent mode each port's sessions for the mapped-port
//! filter (ADR 0048).
//!
//! Each map is a few shards, a `hashbrown` table behind a
//! [`SpinMutex`] each (ADR 0046). A new flow writes to each of these maps
//! once, and a `DashMap` shard's write lock costs two locked instructions:
//! its unlock is a compare-exchange too. A spin lock gives the shard back
//! with a plain store. The key is hashed once per call, for both the
//! shard and the table.
//!
//! A new flow asks for the lines it will write before its first lock
//! (ADR 0036). [`ShardMap::prefetch`] computes where a key is probed
//! first without the lock: the shard from the key's hash, then the
//! table's control byte and data bucket at `hash & mask` (hashbrown's
//! layout: the data lies below the control bytes, bucket `i` at
//! `data_end - (i + 1)`). Each shard keeps its table's data end and mask
//! in relaxed atomics, written under the lock whenever a write moved them
//! (ADR 0044 kept such hints beside `DashMap`s, refreshed now and then;
//! here they are exact). A prefetch is a hint: an address read while the
//! table moves costs a wasted fetch, never a fault or a wrong answer, and
//! it is never dereferenced.
//!
//! A shard is held for the whole of one [`ShardMap::update`], so the
//! closure given to it must be short. The mappings' closure also takes
//! the pool's locks (its count, an owner cell) inside it, always in that
//! order, as the `DashMap` entry did before.

use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};

use crossbeam::utils::CachePadded;
use hashbrown::hash_map::RawEntryMut;
use hashbrown::HashMap;

use crate::prefetch;
use crate::spin_lock::SpinMutex;

/// The key's hash exactly as hashbrown computes it when it grows a table
/// (build a hasher, hash, finish). ahash's own `hash_one` takes a shortcut
/// for integer and string keys on a nightly compiler (its `specialize`
/// cfg), which would leave entries under a hash the table does not use.
#[inline]
#[allow(clippy::manual_hash_one)] // deliberately not ahash's specialised `hash_one`: see above
fn hash_of<K: Hash + ?Sized>(hasher: &ahash::RandomState, key: &K) -> u64 {
    let mut h = hasher.build_hasher();
    key.hash(&mut h);
    h.finish()
}

/// A concurrent map of `K` to `V` in a few spin-locked shards.
pub struct ShardMap<K, V> {
    shards: Box<[CachePadded<Shard<K, V>>]>,
    hasher: ahash::RandomState,
    /// The shard of a hash is its log2(shards) bits from bit 56 down, just
    /// below hashbrown's 7-bit tag: `(hash << 7) >> shift`.
    shift: u32,
}

struct Shard<K, V> {
    table: SpinMutex<HashMap<K, V, ahash::RandomState>>,
    /// The address of the table's data end: 0 until the shard's first
    /// write; after it, a table without buckets reports hashbrown's shared
    /// empty group, which a prefetch may ask for harmlessly.
    end: AtomicUsize,
    /// The table's buckets minus one.
    mask: AtomicUsize,
    /// The table's entries as its last writer left them, for
    /// [`ShardMap::len_estimate`].
    entries: AtomicUsize,
}

impl<K, V> std::fmt::Debug for ShardMap<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardMap").field("shards", &self.shards.len()).finish_non_exhaustive()
    }
}

/// One key's shard, locked, for [`ShardMap::update`]: the key's entry
/// read and written with the hash already computed.
pub struct Locked<'a, K, V> {
    table: &'a mut HashMap<K, V, ahash::RandomState>,
    hash: u64,
}

impl<K, V> std::fmt::Debug for Locked<'_, K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locked").field("entries", &self.table.len()).finish_non_exhaustive()
    }
}

impl<K: Hash + Eq, V> Locked<'_, K, V> {
    /// Debug builds check that `key` is the one the shard was opened
    /// for ([`ShardMap::update`]'s): under another key's hash an entry
    /// would be written where no lookup of its own finds it.
    #[inline]
    fn check(&self, key: &K) {
        debug_assert_eq!(hash_of(self.table.hasher(), key), self.hash, "a key other than the shard's");
    }

    /// The key's value.
    #[inline]
    pub fn get(&self, key: &K) -> Option<&V> {
        self.check(key);
        self.table.raw_entry().from_key_hashed_nocheck(self.hash, key).map(|(_, v)| v)
    }

    /// The key's value, to change.
    #[inline]
    pub fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.check(key);
        match self.table.raw_entry_mut().from_key_hashed_nocheck(self.hash, key) {
            RawEntryMut::Occupied(o) => Some(o.into_mut()),
            RawEntryMut::Vacant(_) => None,
        }
    }

    /// Sets the key's value.
    #[inline]
    pub fn insert(&mut self, key: K, value: V) {
        self.check(&key);
        match self.table.raw_entry_mut().from_key_hashed_nocheck(self.hash, &key) {
            RawEntryMut::Occupied(mut o) => {
                o.insert(value);
            }
            RawEntryMut::Vacant(v) => {
                v.insert_hashed_nocheck(self.hash, key, value);
            }
        }
    }

    /// Removes the key, returning its value.
    #[inline]
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.check(key);
        match self.table.raw_entry_mut().from_key_hashed_nocheck(self.hash, key) {
            RawEntryMut::Occupied(o) => Some(o.remove()),
            RawEntryMut::Vacant(_) => None,
        }
    }
}

impl<K: Hash + Eq, V> ShardMap<K, V> {
    /// A map of `shards` shards (a power of two, at least 2; rounded up).
    pub fn new(shards: usize) -> Self {
        let shards = shards.max(2).next_power_of_two();
        let hasher = ahash::RandomState::new();
        ShardMap {
            shards: (0..shards)
                .map(|_| {
                    CachePadded::new(Shard {
                        table: SpinMutex::new(HashMap::with_hasher(hasher.clone())),
                        end: AtomicUsize::new(0),
                        mask: AtomicUsize::new(0),
                        entries: AtomicUsize::new(0),
                    })
                })
                .collect(),
            hasher,
            shift: 64 - shards.trailing_zeros(),
        }
    }

    /// A map with as many shards as `DashMap` would make here (four a
    /// CPU, a power of two).
    pub fn with_default_shards() -> Self {
        Self::new(std::thread::available_parallelism().map_or(1, usize::from) * 4)
    }

    #[inline]
    fn shard(&self, hash: u64) -> &Shard<K, V> {
        // `shift` is at least 1 (two shards or more), so the index is below
        // the shard count.
        &self.shards[((hash << 7) >> self.shift) as usize]
    }

    /// Runs `f` on `key`'s shard, locked: the one way to read and write.
    #[inline]
    pub fn update<R>(&self, key: &K, f: impl FnOnce(&mut Locked<'_, K, V>) -> R) -> R {
        let hash = hash_of(&self.hasher, key);
        let shard = self.shard(hash);
        let mut table = shard.table.lock();
        let r = f(&mut Locked { table: &mut table, hash });
        shard.remember(&table);
        r
    }

    /// A copy of `key`'s value.
    #[inline]
    pub fn get_copied(&self, key: &K) -> Option<V>
    where
        V: Copy,
    {
        self.update(key, |l| l.get(key).copied())
    }

    /// Asks for the control byte and the data bucket `key` probes first,
    /// without the lock (the module's doc describes the layout).
    #[inline]
    pub fn prefetch(&self, key: &K) {
        let hash = hash_of(&self.hasher, key);
        let shard = self.shard(hash);
        let end = shard.end.load(Ordering::Relaxed);
        if end == 0 {
            return;
        }
        let pos = hash as usize & shard.mask.load(Ordering::Relaxed);
        prefetch::addr(std::ptr::without_provenance(end.wrapping_add(pos)));
        let data = end.wrapping_sub((pos + 1).wrapping_mul(std::mem::size_of::<(K, V)>()));
        prefetch::addr(std::ptr::without_provenance(data));
    }

    /// Entries, counting each shard in turn (not a snapshot).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.table.lock().len()).sum()
    }

    /// Entries as each shard's last writer left them, read without a
    /// lock: an estimate for decisions that tolerate one (the eviction's
    /// fair share per pod), where [`Self::len`] would take every shard's
    /// lock, and wait on every worker writing to one, for each call.
    pub fn len_estimate(&self) -> usize {
        self.shards.iter().map(|s| s.entries.load(Ordering::Relaxed)).sum()
    }

    /// Whether every shard is empty (each looked at in turn).
    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.table.lock().is_empty())
    }

    /// Calls `f` on every entry, one shard locked at a time.
    pub fn for_each(&self, mut f: impl FnMut(&K, &V)) {
        for s in self.shards.iter() {
            for (k, v) in s.table.lock().iter() {
                f(k, v);
            }
        }
    }
}

/// Counts per key (the pods' sessions, the pods' ports in a pool): a key
/// is in the map while its count is above 0.
impl<K: Hash + Eq + Copy> ShardMap<K, u32> {
    /// Adds one to `key`'s count unless it is at `limit`; whether it did.
    #[inline]
    pub fn count_up(&self, key: K, limit: u32) -> bool {
        self.update(&key, |l| match l.get_mut(&key) {
            Some(n) if *n >= limit => false,
            Some(n) => {
                *n += 1;
                true
            }
            None if limit == 0 => false,
            None => {
                l.insert(key, 1);
                true
            }
        })
    }

    /// Takes one from `key`'s count, removing the key at 0.
    #[inline]
    pub fn count_down(&self, key: K) {
        self.update(&key, |l| {
            if let Some(n) = l.get_mut(&key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    l.remove(&key);
                }
            }
        });
    }

    /// `key`'s count (0 when it has none).
    #[inline]
    pub fn count(&self, key: K) -> u32 {
        self.get_copied(&key).unwrap_or(0)
    }
}

impl<K, V> Shard<K, V> {
    /// Stores where the table's buckets lie now and how many entries it
    /// holds, writing only what changed.
    #[inline]
    fn remember(&self, table: &HashMap<K, V, ahash::RandomState>) {
        if self.entries.load(Ordering::Relaxed) != table.len() {
            self.entries.store(table.len(), Ordering::Relaxed);
        }
        let raw = table.raw_table();
        let (end, mask) = (raw.data_end().as_ptr().addr(), raw.buckets() - 1);
        if self.end.load(Ordering::Relaxed) != end {
            self.end.store(end, Ordering::Relaxed);
        }
        if self.mask.load(Ordering::Relaxed) != mask {
            self.mask.store(mask, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap as StdMap;
    use std::sync::Arc;

    use super::*;

    #[test]
    fn reads_and_writes_agree_with_a_plain_map() {
        let m: ShardMap<u32, u64> = ShardMap::new(4);
        let mut model = StdMap::new();
        let mut x = 0x9e37_79b9u32;
        for i in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let k = x % 3_000;
            match i % 4 {
                0 | 1 => {
                    m.update(&k, |l| l.insert(k, i));
                    model.insert(k, i);
                }
                2 => assert_eq!(m.update(&k, |l| l.remove(&k)), model.remove(&k), "remove {k}"),
                _ => {
                    m.update(&k, |l| {
                        if let Some(v) = l.get_mut(&k) {
                            *v += 1;
                        }
                    });
                    if let Some(v) = model.get_mut(&k) {
                        *v += 1;
                    }
                }
            }
        }
        assert_eq!(m.len(), model.len());
        assert_eq!(m.is_empty(), model.is_empty());
        let mut seen = 0;
        m.for_each(|k, v| {
            assert_eq!(model.get(k), Some(v), "key {k}");
            seen += 1;
        });
        assert_eq!(seen, model.len());
        for k in 0..3_000u32 {
            assert_eq!(m.get_copied(&k), model.get(&k).copied(), "key {k}");
        }
    }

    #[test]
    fn a_count_stops_at_its_limit_and_leaves_at_zero() {
        let m: ShardMap<u8, u32> = ShardMap::new(2);
        assert!(!m.count_up(1, 0), "a limit of 0 admits nothing");
        assert!(m.is_empty());
        assert!(m.count_up(1, 2));
        assert!(m.count_up(1, 2));
        assert!(!m.count_up(1, 2), "at its limit");
        assert_eq!(m.count(1), 2);
        m.count_down(1);
        assert_eq!(m.count(1), 1);
        m.count_down(1);
        assert_eq!(m.count(1), 0);
        assert!(m.is_empty(), "the key leaves at 0");
        m.count_down(1);
        assert!(m.is_empty(), "a count never held stays absent");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "a key other than the shard's")]
    fn a_key_other_than_the_shards_is_refused_in_debug_builds() {
        let m: ShardMap<u64, u32> = ShardMap::new(2);
        m.update(&1, |l| l.insert(2, 0));
    }

    #[test]
    fn the_estimate_is_the_count_once_writers_are_done() {
        let m: ShardMap<u64, u32> = ShardMap::new(4);
        assert_eq!(m.len_estimate(), 0);
        for k in 0..1_000u64 {
            assert!(m.count_up(k, 5));
        }
        assert!(m.count_up(7, 5), "a second count on a key adds no entry");
        assert_eq!((m.len(), m.len_estimate()), (1_000, 1_000));
        for k in 0..400u64 {
            m.count_down(k);
        }
        m.count_down(7);
        assert_eq!((m.len(), m.len_estimate()), (600, 600), "7 leaves at its second count down");
        m.update(&5_000, |l| l.insert(5_000, 1));
        m.update(&5_000, |l| l.remove(&5_000));
        assert_eq!(m.len_estimate(), 600, "a key in and out again");
    }

    #[test]
    fn keys_spread_over_every_shard() {
        let m: ShardMap<u64, ()> = ShardMap::new(8);
        for k in 0..4_096u64 {
            m.update(&k, |l| l.insert(k, ()));
        }
        for (i, s) in m.shards.iter().enumerate() {
            let n = s.table.lock().len();
            assert!((256..=768).contains(&n), "shard {i} holds {n} of 4,096 keys");
        }
    }

    #[test]
    fn the_prefetch_knows_where_a_grown_table_lies() {
        let m: ShardMap<u64, u64> = ShardMap::new(2);
        for k in 0..10_000u64 {
            m.update(&k, |l| l.insert(k, k));
        }
        for (i, s) in m.shards.iter().enumerate() {
            let t = s.table.lock();
            let raw = t.raw_table();
            let now = (raw.data_end().as_ptr().addr(), raw.buckets() - 1);
            let kept = (s.end.load(Ordering::Relaxed), s.mask.load(Ordering::Relaxed));
            assert_eq!(kept, now, "shard {i}: the table after its last write");
            assert!(now.1 >= 4_095, "shard {i} grew");
        }
        // A key's data bucket is where the prefetch asks: with room to
        // spare, a key sits within a group of its first probe.
        let mut near = 0;
        for k in 0..10_000u64 {
            let hash = hash_of(&m.hasher, &k);
            let s = m.shard(hash);
            let t = s.table.lock();
            let found = t.raw_table().find(hash, |(kk, _)| *kk == k).map(|b| b.as_ptr().addr());
            let end = s.end.load(Ordering::Relaxed);
            let pos = hash as usize & s.mask.load(Ordering::Relaxed);
            let guess = end - (pos + 1) * std::mem::size_of::<(u64, u64)>();
            let Some(found) = found else { panic!("key {k} is in the map") };
            if guess.abs_diff(found) / std::mem::size_of::<(u64, u64)>() < 16 {
                near += 1;
            }
            m.prefetch(&k);
        }
        assert!(near >= 9_000, "{near} of 10,000 keys within a group of their first probe");
    }

    #[test]
    fn concurrent_counts_lose_nothing() {
        let m = Arc::new(ShardMap::<u32, u32>::new(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = Arc::clone(&m);
                std::thread::spawn(move || {
                    for i in 0..40_000u32 {
                        let k = i % 64;
                        m.update(&k, |l| match l.get_mut(&k) {
                            Some(v) => *v += 1,
                            None => l.insert(k, 1),
                        });
                    }
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok(), "a thread panicked");
        }
        let mut total = 0;
        m.for_each(|_, v| total += *v);
        assert_eq!(total, 160_000);
    }
}
