//! Asking ahead for the lines a `DashMap` insert or lookup will touch.
//!
//! A new flow writes to several randomly placed lines (the session map's
//! two keys, the mapping, the per-source counts, the port's owner cell),
//! each behind a lock. A locked instruction waits for the stores before it,
//! so each of those misses is paid one after the other (docs/benchmarks.md,
//! "A new flow: where the work goes"). Asking for all of them first, while
//! nothing is locked, lets the memory fetch them at once (ADR 0036).
//!
//! [`bucket`] computes where `key` would be probed first: the shard from the
//! map's hash, then the shard's table's control group and data bucket at
//! `hash & mask` (hashbrown's layout: the data lies below the control bytes,
//! bucket `i` at `data_end - (i + 1)`). The shard is read-locked only to read
//! the table's address and size (`try_read`: a shard a writer holds is
//! skipped); the prefetches are hints, so a table that grows meanwhile costs
//! a wasted fetch, never a wrong answer.

use std::hash::{BuildHasher, Hash};
use std::ptr::NonNull;

use dashmap::DashMap;

use crate::prefetch;

/// Asks for the control group and the first data bucket `key` probes in `map`.
#[inline]
pub fn bucket<K: Hash + Eq, V, S: BuildHasher + Clone>(map: &DashMap<K, V, S>, key: &K) {
    let hash = map.hash_usize(key);
    let Some(shard) = map.shards().get(map.determine_shard(hash)) else { return };
    let Some(table) = shard.try_read() else { return };
    let pos = hash & (table.buckets() - 1);
    let end = table.data_end();
    drop(table);
    prefetch::addr(end.as_ptr().cast::<u8>().wrapping_add(pos));
    prefetch::addr(data_at(end, pos));
}

/// The address of data bucket `i` of a table whose data ends at `end`.
fn data_at<T>(end: NonNull<T>, i: usize) -> *const u8 {
    end.as_ptr().wrapping_sub(i + 1).cast::<u8>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn elem_size<T>(_: NonNull<T>) -> usize {
        std::mem::size_of::<T>()
    }

    #[test]
    fn the_first_probe_of_a_key_is_the_bucket_it_lands_in() {
        // The layout assumption: with room to spare, a key sits in the bucket
        // its hash points at (or the same group), which is what is fetched.
        let map: DashMap<u64, u64, ahash::RandomState> =
            DashMap::with_hasher_and_shard_amount(ahash::RandomState::new(), 4);
        for k in 0..64u64 {
            map.insert(k, k);
        }
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
            bucket(&map, &k);
        }
        assert!(near >= 60, "{near} of 64 keys within a group of their first probe");
    }
}
