//! A mutex for the new-flow path's short sections: the session index's
//! stripes, the session slab's free list, the port pools' owner cells and
//! the shards of the new-flow maps (nat/shard_map.rs).
//!
//! Each of those sections is a handful of instructions that never blocks,
//! and a new flow takes seven of them (an expired session about as many). With
//! `parking_lot::Mutex`, taking and giving back each costs two locked
//! instructions: its unlock is a `lock cmpxchg` too, as it must see whether
//! a thread parked meanwhile. A locked instruction on x86 waits for every
//! store before it. [`RawSpinLock`] gives a lock back with a plain release
//! store (a `mov` on x86), which waits for nothing: on this machine a
//! lock and unlock pair costs 6 ns against `parking_lot`'s 15 (ADR 0045).
//!
//! The price is that a waiter never sleeps. It spins a little
//! ([`SPINS`]), then yields its CPU until the lock is free, so a holder
//! that was preempted (a busy gateway) gets to run and finish. That is fit
//! only for sections as short as these; anything that may block or take
//! long keeps `parking_lot`.

use std::sync::atomic::{AtomicBool, Ordering};

/// How many times a waiter spins before it starts yielding its CPU.
pub const SPINS: u32 = 64;

/// The raw lock: one byte, free or held.
#[derive(Debug)]
pub struct RawSpinLock(AtomicBool);

/// A mutex over `T` with [`RawSpinLock`].
pub type SpinMutex<T> = lock_api::Mutex<RawSpinLock, T>;

#[allow(unsafe_code)]
// SAFETY: the lock is held by at most one owner: `try_lock` succeeds only
// by moving the flag from free to held (Acquire, so the section sees what
// the last holder wrote), `lock` only through `try_lock`, and `unlock`
// (called only by the holder, as `lock_api` guarantees) frees it with
// Release, so the next holder sees this section's writes.
unsafe impl lock_api::RawMutex for RawSpinLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: Self = RawSpinLock(AtomicBool::new(false));
    type GuardMarker = lock_api::GuardSend;

    #[inline]
    fn lock(&self) {
        if !self.try_lock() {
            self.lock_contended();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        self.0.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok()
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.0.store(false, Ordering::Release);
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl RawSpinLock {
    /// Waits until the lock is free (reading it, not writing it, so the
    /// holder's line is not taken away), then tries again.
    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0;
        loop {
            while self.0.load(Ordering::Relaxed) {
                if spins < SPINS {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if lock_api::RawMutex::try_lock(self) {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn one_holder_at_a_time_and_its_writes_seen_by_the_next() {
        // Four threads add to a counter that is read and written in two
        // steps: without mutual exclusion updates are lost.
        let m = Arc::new(SpinMutex::new((0u64, 0u64)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = Arc::clone(&m);
                std::thread::spawn(move || {
                    for _ in 0..100_000 {
                        let mut g = m.lock();
                        let v = g.0;
                        std::hint::black_box(&mut *g);
                        g.0 = v + 1;
                        g.1 += 2;
                    }
                })
            })
            .collect();
        for t in threads {
            assert!(t.join().is_ok(), "a thread panicked");
        }
        assert_eq!(*m.lock(), (400_000, 800_000));
    }

    #[test]
    fn try_lock_fails_while_held_and_a_waiter_gets_the_lock_once_freed() {
        let m = Arc::new(SpinMutex::new(0u32));
        let g = m.lock();
        assert!(m.try_lock().is_none(), "held");
        assert!(m.is_locked());
        let waiter = {
            let m = Arc::clone(&m);
            std::thread::spawn(move || *m.lock() += 1)
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished(), "the waiter waits while the lock is held");
        drop(g);
        assert!(waiter.join().is_ok(), "the waiter panicked");
        assert_eq!(*m.lock(), 1);
        assert!(!m.is_locked());
    }
}
