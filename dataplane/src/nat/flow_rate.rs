//! A worker's per-source limit on how fast new sessions are created
//! (`nat.newFlowsPerSecondPerSource`, `nat.newFlowBurstPerSource`), so one
//! pod, or one remote source opening endpoint-independent mappings, cannot
//! monopolise the slow path (policy lookup, port allocation, insertion).
//!
//! A token bucket per source address in a fixed array of [`BUCKETS`]
//! buckets indexed by a keyed hash of the address: bounded memory, no
//! allocation per packet. Sources whose hashes collide share a bucket (with
//! a few hundred sources per worker that is rare, and the key is random per
//! worker, so a remote cannot choose addresses that land on a given pod's
//! bucket). Only the creation of a session takes a token: packets of
//! existing sessions never reach it. Time is the engine's [`Timestamp`]
//! (clock.rs), so the limiter is deterministic under test.

use std::hash::Hash;

use crate::clock::Timestamp;

/// Buckets per worker (16 bytes each: 64 KiB).
pub const BUCKETS: usize = 4096;

/// One bucket: its tokens in thousandths of a flow, and when it was last
/// refilled (engine milliseconds).
#[derive(Clone, Copy, Debug)]
struct Bucket {
    milli_tokens: u64,
    last_ms: u64,
}

/// A worker's new-flow limiter.
pub struct FlowRate {
    hasher: ahash::RandomState,
    buckets: Box<[Bucket]>,
}

impl std::fmt::Debug for FlowRate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowRate").finish_non_exhaustive()
    }
}

impl FlowRate {
    /// A limiter whose bucket index is keyed by `seed`; every bucket starts full.
    pub fn new(seed: u64) -> Self {
        FlowRate {
            hasher: ahash::RandomState::with_seeds(seed, seed ^ 0x9E37_79B9_7F4A_7C15, !seed, seed.rotate_left(32)),
            // u64::MAX: capped to the burst on first use (full).
            buckets: vec![Bucket { milli_tokens: u64::MAX, last_ms: 0 }; BUCKETS].into_boxed_slice(),
        }
    }

    /// Whether `source` may create a session now, under `per_second` new
    /// flows a second with bursts of `burst` (`per_second` 0: no limit);
    /// takes a token if so.
    #[inline]
    pub fn admit<A: Hash>(&mut self, source: &A, per_second: u32, burst: u32, now: Timestamp) -> bool {
        if per_second == 0 {
            return true;
        }
        let i = (self.hasher.hash_one(source) as usize) & (BUCKETS - 1);
        let b = &mut self.buckets[i];
        let now_ms = now.as_millis();
        // A clock that steps back refills nothing.
        let elapsed = now_ms.saturating_sub(b.last_ms);
        b.last_ms = b.last_ms.max(now_ms);
        // per_second flows a second = per_second thousandths of a flow a millisecond.
        let cap = u64::from(burst).saturating_mul(1000);
        b.milli_tokens = b.milli_tokens.saturating_add(elapsed.saturating_mul(u64::from(per_second))).min(cap);
        if b.milli_tokens >= 1000 {
            b.milli_tokens -= 1000;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);

    #[test]
    fn burst_then_rate() {
        let mut r = FlowRate::new(1);
        let t0 = Timestamp::from_secs(10);
        assert_eq!((0..10).filter(|_| r.admit(&A, 5, 4, t0)).count(), 4, "the burst");
        // 5 a second: one token every 200 ms.
        assert!(!r.admit(&A, 5, 4, Timestamp::from_millis(10_199)));
        assert!(r.admit(&A, 5, 4, Timestamp::from_millis(10_200)));
        assert!(!r.admit(&A, 5, 4, Timestamp::from_millis(10_200)));
        // Refill stops at the burst.
        let later = Timestamp::from_secs(100);
        assert_eq!((0..10).filter(|_| r.admit(&A, 5, 4, later)).count(), 4);
        // A clock stepping back refills nothing and does not panic.
        assert!(!r.admit(&A, 5, 4, Timestamp::from_secs(1)));
    }

    #[test]
    fn zero_rate_is_off() {
        let mut r = FlowRate::new(1);
        assert!((0..100_000).all(|_| r.admit(&A, 0, 1, Timestamp::ZERO)));
    }
}
