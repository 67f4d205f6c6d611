//! Asking ahead for the lines a `DashMap` insert or lookup will touch.
//!
//! A new flow writes to several randomly placed lines (the session map's
//! two keys, the mapping, the per-source counts, the port's owner cell),
//! each behind a lock. A locked instruction waits for the stores before it,
//! so each of those misses is paid one after the other (docs/benchmarks.md,
//! "A new flow: where the work goes"). Asking for all of them first, while
//! nothing is locked, lets the memory fetch them at once (ADR 0036).
//!
//! [`ShardHints::bucket`] computes where `key` would be probed first: the
//! shard from the map's hash, then the shard's table's control group and
//! data bucket at `hash & mask` (hashbrown's layout: the data lies below the
//! control bytes, bucket `i` at `data_end - (i + 1)`). The table's address
//! and size are read under the shard's read lock only now and then (a call
//! in [`REFRESH_EVERY`], by its hash, and the shard's first), and remembered
//! in relaxed atomics beside the map; the other calls read those, with no
//! locked instruction. A `try_read` and its release are two locked
//! instructions, each waiting for the stores before it, and they write the
//! shard lock's line, which every worker making flows shares: three maps
//! cost a new flow six of them. The prefetches are hints, so an address
//! remembered before the table grew, or two fields from two different
//! looks, cost a wasted fetch, never a wrong answer: a prefetch cannot
//! fault, and the address is never dereferenced.

use std::hash::{BuildHasher, Hash};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};

use dashmap::DashMap;

use crate::prefetch;

/// One call in this many (chosen by the key's hash) reads a shard's table
/// under its lock and remembers it; a table that grew is seen after about
/// this many new keys of its shard.
pub const REFRESH_EVERY: usize = 64;

/// Where the tables of one `DashMap`'s shards were last seen, for
/// [`ShardHints::bucket`]. Made with the map it serves ([`Self::new`]).
#[derive(Debug)]
pub struct ShardHints {
    /// Per shard: the table's data end (an address) and bucket mask, 0
    /// until first seen.
    shards: Box<[ShardHint]>,
    /// The size of one bucket (key and value), in bytes.
    bucket_size: usize,
}

#[derive(Debug, Default)]
struct ShardHint {
    end: AtomicUsize,
    mask: AtomicUsize,
}

impl ShardHints {
    /// Hints for `map`'s shards, none seen yet.
    pub fn new<K: Hash + Eq, V, S: BuildHasher + Clone>(map: &DashMap<K, V, S>) -> Self {
        let bucket_size = map.shards().first().map_or(0, |s| elem_size(s.read().data_end()));
        ShardHints { shards: map.shards().iter().map(|_| ShardHint::default()).collect(), bucket_size }
    }

    /// Asks for the control group and the first data bucket `key` probes
    /// in `map` (the map these hints were made for).
    #[inline]
    pub fn bucket<K: Hash + Eq, V, S: BuildHasher + Clone>(&self, map: &DashMap<K, V, S>, key: &K) {
        if let Some((ctrl, data)) = self.lines(map, map.hash_usize(key)) {
            prefetch::addr(std::ptr::without_provenance(ctrl));
            prefetch::addr(std::ptr::without_provenance(data));
        }
    }

    /// The addresses of the control byte and the data bucket a key of
    /// `hash` probes first, by the hint of its shard (refreshed first when
    /// none was seen, or when `hash` is one in [`REFRESH_EVERY`]).
    #[inline]
    fn lines<K: Hash + Eq, V, S: BuildHasher + Clone>(
        &self,
        map: &DashMap<K, V, S>,
        hash: usize,
    ) -> Option<(usize, usize)> {
        let i = map.determine_shard(hash);
        let hint = self.shards.get(i)?;
        let (mut end, mut mask) = (hint.end.load(Ordering::Relaxed), hint.mask.load(Ordering::Relaxed));
        if end == 0 || hash.is_multiple_of(REFRESH_EVERY) {
            (end, mask) = look(map, i)?;
            hint.remember(end, mask);
        }
        let pos = hash & mask;
        Some((end.wrapping_add(pos), end.wrapping_sub((pos + 1).wrapping_mul(self.bucket_size))))
    }

    /// What shard `i`'s hint holds: (data end, mask).
    #[cfg(test)]
    fn seen(&self, i: usize) -> (usize, usize) {
        (self.shards[i].end.load(Ordering::Relaxed), self.shards[i].mask.load(Ordering::Relaxed))
    }
}

impl ShardHint {
    /// Stores what a look found, writing the shared line only when it
    /// changed (a table's address moves only when it grows).
    fn remember(&self, end: usize, mask: usize) {
        if self.end.load(Ordering::Relaxed) != end {
            self.end.store(end, Ordering::Relaxed);
        }
        if self.mask.load(Ordering::Relaxed) != mask {
            self.mask.store(mask, Ordering::Relaxed);
        }
    }
}

/// Shard `i`'s table now: its data end's address and its bucket mask,
/// under the shard's read lock (`try_read`: a shard a writer holds is
/// skipped).
fn look<K: Hash + Eq, V, S: BuildHasher + Clone>(map: &DashMap<K, V, S>, i: usize) -> Option<(usize, usize)> {
    let table = map.shards().get(i)?.try_read()?;
    Some((table.data_end().as_ptr().addr(), table.buckets() - 1))
}

fn elem_size<T>(_: NonNull<T>) -> usize {
    std::mem::size_of::<T>()
}

/// The address of data bucket `i` of a table whose data ends at `end`.
#[cfg(test)]
fn data_at<T>(end: NonNull<T>, i: usize) -> *const u8 {
    end.as_ptr().wrapping_sub(i + 1).cast::<u8>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_probe_of_a_key_is_the_bucket_it_lands_in() {
        // The layout assumption: with room to spare, a key sits in the bucket
        // its hash points at (or the same group), which is what is fetched.
        let map: DashMap<u64, u64, ahash::RandomState> =
            DashMap::with_hasher_and_shard_amount(ahash::RandomState::new(), 4);
        for k in 0..64u64 {
            map.insert(k, k);
        }
        let hints = ShardHints::new(&map);
        let mut near = 0;
        for k in 0..64u64 {
            let hash = map.hash_usize(&k);
            let shard = map.shards()[map.determine_shard(hash)].read();
            let pos = hash & (shard.buckets() - 1);
            let found = shard.find(hash as u64, |(kk, _)| *kk == k).map(|b| b.as_ptr().cast::<u8>().cast_const());
            let guess = data_at(shard.data_end(), pos);
            let size = elem_size(shard.data_end());
            let idx = found.map(|p| (guess as usize).abs_diff(p as usize) / size);
            assert!(idx.is_some(), "key {k} is in the map");
            if idx.is_some_and(|d| d < 16) {
                near += 1;
            }
            let ctrl = shard.data_end().as_ptr().cast::<u8>().wrapping_add(pos);
            drop(shard);
            assert_eq!(hints.lines(&map, hash), Some((ctrl.addr(), guess.addr())), "key {k}: the hint's lines");
            hints.bucket(&map, &k);
        }
        assert!(near >= 60, "{near} of 64 keys within a group of their first probe");
    }

    #[test]
    fn a_hint_is_read_without_the_lock_and_sees_a_grown_table_on_a_refresh() {
        let map: DashMap<u64, u64, ahash::RandomState> =
            DashMap::with_hasher_and_shard_amount(ahash::RandomState::new(), 2);
        map.insert(0, 0);
        let hints = ShardHints::new(&map);
        // Keys by shard and by whether their hash refreshes the hint.
        let m = &map;
        let keys = |shard: usize, refreshing: bool| {
            (1u64..).filter(move |k| {
                let h = m.hash_usize(k);
                m.determine_shard(h) == shard && h.is_multiple_of(REFRESH_EVERY) == refreshing
            })
        };
        let plain = keys(0, false).next().unwrap_or_default();
        hints.bucket(&map, &plain);
        let first = look(&map, 0).unwrap_or_default();
        assert_eq!(hints.seen(0), first, "the shard's first call looks");
        assert_eq!(hints.seen(1), (0, 0), "the other shard is not looked at");
        for k in 1_000_000..1_010_000u64 {
            map.insert(k, k);
        }
        let grown = look(&map, 0).unwrap_or_default();
        assert_ne!(grown, first, "the table grew");
        hints.bucket(&map, &plain);
        assert_eq!(hints.seen(0), first, "a plain call reads only the hint, without the lock");
        let refreshing = keys(0, true).next().unwrap_or_default();
        let writer = map.shards()[0].write();
        hints.bucket(&map, &refreshing);
        assert_eq!(hints.seen(0), first, "a shard a writer holds is not waited for");
        drop(writer);
        hints.bucket(&map, &refreshing);
        assert_eq!(hints.seen(0), grown, "a refreshing call looks again");
    }
}
