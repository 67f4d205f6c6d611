//! The four single-producer/single-consumer rings an AF_XDP socket shares
//! with the kernel: fill and TX (we produce), RX and completion (we consume).
//!
//! Memory ordering follows the protocol in the kernel's `net/xdp/xsk_queue.h`
//! (after `Documentation/core-api/circular-buffers.rst`):
//!
//! ```text
//!  producer                          consumer
//!  if (LOAD ->consumer) {   (A)      LOAD.acq ->producer   (C)
//!     STORE $data                    LOAD $data
//!     STORE.rel ->producer  (B)      STORE.rel ->consumer  (D)
//!  }
//!  (A) pairs with (D), (B) pairs with (C).
//! ```
//!
//! On our side of a ring: as producer, the consumer load is an acquire (our A,
//! pairing with the kernel's D, so the kernel's reads of the slots are done
//! before we overwrite them) and the producer store is a release (our B,
//! pairing with the kernel's C, so our slot writes are visible before the
//! index). As consumer, the producer load is an acquire (our C, pairing with
//! the kernel's B) and the consumer store a release (our D, pairing with the
//! kernel's A). Indices are free-running `u32`s that wrap; slot = index & mask.

use std::io;
use std::marker::PhantomData;
use std::mem::size_of;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use super::sys::{Mmap, XdpRingOffset, XDP_RING_NEED_WAKEUP};

/// Entries in flight between `prod` and `cons`, never more than `size`
/// (a value above `size` can only come from a confused peer; clamping keeps
/// the arithmetic from ever handing out a slot twice).
#[inline]
pub fn ring_used(prod: u32, cons: u32, size: u32) -> u32 {
    prod.wrapping_sub(cons).min(size)
}

/// Free slots a producer at `prod` sees with the consumer at `cons`.
#[inline]
pub fn ring_free(prod: u32, cons: u32, size: u32) -> u32 {
    size - ring_used(prod, cons, size)
}

/// The slot a free-running index lands in (`size` is a power of two).
#[inline]
pub fn ring_slot(idx: u32, mask: u32) -> usize {
    (idx & mask) as usize
}

/// The shared part of a mapped ring: the mapping and validated pointers into
/// it.
#[derive(Debug)]
struct RingMap<T> {
    producer: NonNull<AtomicU32>,
    consumer: NonNull<AtomicU32>,
    flags: NonNull<AtomicU32>,
    descs: NonNull<T>,
    size: u32,
    mask: u32,
    // Declared last: the pointers above point into it.
    _map: Mmap,
    _marker: PhantomData<T>,
}

// SAFETY: the ring's memory is owned by `_map` and moves with it; the kernel
// side is synchronised through the atomics, and `&mut` access to the ring
// structs keeps our side single-threaded.
unsafe impl<T: Send> Send for RingMap<T> {}

impl<T: Copy> RingMap<T> {
    fn map(fd: BorrowedFd<'_>, off: &XdpRingOffset, size: u32, pgoff: libc::off_t) -> io::Result<Self> {
        if size == 0 || !size.is_power_of_two() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let desc_off = usize::try_from(off.desc).map_err(|_| io::ErrorKind::InvalidData)?;
        let len = desc_off.checked_add(size as usize * size_of::<T>()).ok_or(io::ErrorKind::InvalidData)?;
        Self::from_mmap(Mmap::ring(fd, len, pgoff)?, off, size)
    }

    /// Wrap a mapping laid out as `off` describes (the kernel's ring, or an
    /// anonymous stand-in in tests).
    fn from_mmap(map: Mmap, off: &XdpRingOffset, size: u32) -> io::Result<Self> {
        if size == 0 || !size.is_power_of_two() {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        let len = map.len();
        // Every offset the kernel gave must land inside the mapping, aligned.
        let field = |off: u64, width: usize, align: usize| -> io::Result<NonNull<u8>> {
            let off = usize::try_from(off).map_err(|_| io::ErrorKind::InvalidData)?;
            if off % align != 0 || off.checked_add(width).is_none_or(|end| end > len) {
                return Err(io::Error::from(io::ErrorKind::InvalidData));
            }
            // SAFETY: `off + width <= len`, so the pointer stays inside the
            // mapping of `len` bytes that `map` owns.
            let p = unsafe { map.as_ptr().add(off) };
            NonNull::new(p).ok_or_else(|| io::Error::from(io::ErrorKind::InvalidData))
        };
        let producer = field(off.producer, 4, 4)?.cast();
        let consumer = field(off.consumer, 4, 4)?.cast();
        let flags = field(off.flags, 4, 4)?.cast();
        let descs = field(off.desc, size as usize * size_of::<T>(), std::mem::align_of::<T>())?.cast();
        Ok(Self { producer, consumer, flags, descs, size, mask: size - 1, _map: map, _marker: PhantomData })
    }

    #[inline]
    fn producer(&self) -> &AtomicU32 {
        // SAFETY: validated in `map`: in bounds, 4-aligned, alive as long as
        // `self._map`. The kernel updates it only with 32-bit atomic stores
        // (smp_store_release/WRITE_ONCE), so an `AtomicU32` view is sound.
        unsafe { self.producer.as_ref() }
    }

    #[inline]
    fn consumer(&self) -> &AtomicU32 {
        // SAFETY: as for `producer`.
        unsafe { self.consumer.as_ref() }
    }

    #[inline]
    fn flags(&self) -> &AtomicU32 {
        // SAFETY: as for `producer`; the kernel sets/clears it with WRITE_ONCE.
        unsafe { self.flags.as_ref() }
    }

    #[inline]
    fn slot_ptr(&self, idx: u32) -> *mut T {
        // SAFETY: `ring_slot` < `size`, and `descs` points to `size` elements
        // inside the mapping (validated in `map`).
        unsafe { self.descs.as_ptr().add(ring_slot(idx, self.mask)) }
    }
}

/// A ring we produce into: fill (frame addresses) or TX (descriptors).
#[derive(Debug)]
pub struct ProdRing<T> {
    ring: RingMap<T>,
    /// Our producer index including published entries.
    prod: u32,
    /// Entries written since the last `commit`.
    staged: u32,
    /// The kernel's consumer index as last loaded.
    cached_cons: u32,
}

impl<T: Copy> ProdRing<T> {
    /// Map a producer ring of `size` entries.
    pub fn map(fd: BorrowedFd<'_>, off: &XdpRingOffset, size: u32, pgoff: libc::off_t) -> io::Result<Self> {
        Ok(Self::new(RingMap::map(fd, off, size, pgoff)?))
    }

    fn new(ring: RingMap<T>) -> Self {
        // Fresh rings start at 0/0, but read them rather than assume.
        let prod = ring.producer().load(Ordering::Relaxed);
        let cached_cons = ring.consumer().load(Ordering::Acquire);
        Self { ring, prod, staged: 0, cached_cons }
    }

    /// Ring size in entries.
    pub fn size(&self) -> u32 {
        self.ring.size
    }

    /// Free slots, not counting staged entries, reloading the kernel's
    /// consumer index only when the cached one shows fewer than `want`.
    pub fn free(&mut self, want: u32) -> u32 {
        let head = self.prod.wrapping_add(self.staged);
        let free = ring_free(head, self.cached_cons, self.ring.size);
        if free >= want {
            return free;
        }
        // (A): acquire, pairs with the kernel's release store of the consumer
        // index (D): its reads of the slots we are about to reuse are done.
        self.cached_cons = self.ring.consumer().load(Ordering::Acquire);
        ring_free(head, self.cached_cons, self.ring.size)
    }

    /// Write one entry into the next free slot (published by `commit`).
    /// Returns `false`, writing nothing, when the ring is full.
    #[inline]
    pub fn push(&mut self, value: T) -> bool {
        if self.free(1) == 0 {
            return false;
        }
        let idx = self.prod.wrapping_add(self.staged);
        let slot = self.ring.slot_ptr(idx);
        // SAFETY: `free(1) > 0` proves the kernel consumed this slot (the
        // acquire in `free` ordered its reads before us) and it is not yet
        // published, so nobody else reads or writes it now.
        unsafe { slot.write(value) };
        self.staged += 1;
        true
    }

    /// Publish every staged entry to the kernel.
    #[inline]
    pub fn commit(&mut self) {
        if self.staged == 0 {
            return;
        }
        self.prod = self.prod.wrapping_add(self.staged);
        self.staged = 0;
        // (B): release, pairs with the kernel's acquire load of the producer
        // index (C): our slot writes are visible before the new index.
        self.ring.producer().store(self.prod, Ordering::Release);
    }

    /// Entries published but not yet consumed by the kernel (reloads the
    /// consumer index).
    pub fn outstanding(&mut self) -> u32 {
        self.cached_cons = self.ring.consumer().load(Ordering::Acquire);
        ring_used(self.prod, self.cached_cons, self.ring.size)
    }

    /// Whether the kernel asked for a wakeup syscall (`XDP_USE_NEED_WAKEUP`).
    #[inline]
    pub fn needs_wakeup(&self) -> bool {
        // A hint read with no data attached to it: relaxed is enough (libxdp
        // reads it with a plain load).
        self.ring.flags().load(Ordering::Relaxed) & XDP_RING_NEED_WAKEUP != 0
    }
}

/// A ring we consume from: RX (descriptors) or completion (frame addresses).
#[derive(Debug)]
pub struct ConsRing<T> {
    ring: RingMap<T>,
    /// Our consumer index.
    cons: u32,
    /// The kernel's producer index as last loaded.
    cached_prod: u32,
}

impl<T: Copy> ConsRing<T> {
    /// Map a consumer ring of `size` entries.
    pub fn map(fd: BorrowedFd<'_>, off: &XdpRingOffset, size: u32, pgoff: libc::off_t) -> io::Result<Self> {
        Ok(Self::new(RingMap::map(fd, off, size, pgoff)?))
    }

    fn new(ring: RingMap<T>) -> Self {
        let cons = ring.consumer().load(Ordering::Relaxed);
        let cached_prod = ring.producer().load(Ordering::Acquire);
        Self { ring, cons, cached_prod }
    }

    /// Ring size in entries.
    pub fn size(&self) -> u32 {
        self.ring.size
    }

    /// Entries ready to read, reloading the kernel's producer index when the
    /// cached one shows fewer than `want`.
    pub fn available(&mut self, want: u32) -> u32 {
        let avail = ring_used(self.cached_prod, self.cons, self.ring.size);
        if avail >= want {
            return avail;
        }
        // (C): acquire, pairs with the kernel's release store of the producer
        // index (B): the entries up to it are written before we read them.
        self.cached_prod = self.ring.producer().load(Ordering::Acquire);
        ring_used(self.cached_prod, self.cons, self.ring.size)
    }

    /// Copy up to `out.len()` entries out and release their slots to the
    /// kernel at once. Returns how many were copied.
    #[inline]
    pub fn pop_into(&mut self, out: &mut [T]) -> usize {
        let want = u32::try_from(out.len()).unwrap_or(u32::MAX);
        let n = self.available(want).min(want);
        for (i, o) in out.iter_mut().take(n as usize).enumerate() {
            let slot = self.ring.slot_ptr(self.cons.wrapping_add(i as u32));
            // SAFETY: slot `cons + i` is below the producer index loaded with
            // acquire in `available`, so the kernel finished writing it, and
            // it stays ours until the release below.
            *o = unsafe { slot.read() };
        }
        if n > 0 {
            self.cons = self.cons.wrapping_add(n);
            // (D): release, pairs with the kernel's load of the consumer
            // index (A): our reads are done before it may reuse the slots.
            self.ring.consumer().store(self.cons, Ordering::Release);
        }
        n as usize
    }

    /// Whether the kernel asked for a wakeup syscall.
    pub fn needs_wakeup(&self) -> bool {
        self.ring.flags().load(Ordering::Relaxed) & XDP_RING_NEED_WAKEUP != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn used_and_free_without_wrap() {
        assert_eq!(ring_used(10, 4, 8), 6);
        assert_eq!(ring_free(10, 4, 8), 2);
        assert_eq!(ring_used(7, 7, 8), 0);
        assert_eq!(ring_free(7, 7, 8), 8);
        assert_eq!(ring_free(15, 7, 8), 0);
    }

    #[test]
    fn used_and_free_across_u32_wrap() {
        // Producer wrapped past u32::MAX, consumer did not yet.
        let cons = u32::MAX - 2; // ...FD
        let prod = cons.wrapping_add(5); // 2
        assert_eq!(prod, 2);
        assert_eq!(ring_used(prod, cons, 8), 5);
        assert_eq!(ring_free(prod, cons, 8), 3);
        // Full ring exactly across the wrap.
        assert_eq!(ring_used(cons.wrapping_add(8), cons, 8), 8);
        assert_eq!(ring_free(cons.wrapping_add(8), cons, 8), 0);
        // Both at u32::MAX.
        assert_eq!(ring_used(u32::MAX, u32::MAX, 8), 0);
    }

    #[test]
    fn confused_indices_are_clamped_not_overflowed() {
        // Consumer ahead of producer (never legal): clamp to "full", so a
        // producer stops instead of overwriting live slots.
        assert_eq!(ring_used(3, 5, 8), 8);
        assert_eq!(ring_free(3, 5, 8), 0);
    }

    /// A ring laid out like the kernel's (producer, consumer, flags, then
    /// descriptors) over anonymous memory, with both indices preset to
    /// `start`; the test plays the kernel through `RingMap`'s atomics.
    fn fake_ring<T: Copy>(size: u32, start: u32) -> RingMap<T> {
        let off = XdpRingOffset { producer: 0, consumer: 64, flags: 128, desc: 192 };
        let len = 192 + size as usize * size_of::<T>();
        let map = Mmap::anonymous(len).expect("anonymous mmap");
        let ring = RingMap::<T>::from_mmap(map, &off, size).expect("ring layout");
        ring.producer().store(start, Ordering::Relaxed);
        ring.consumer().store(start, Ordering::Relaxed);
        ring
    }

    #[test]
    fn producer_ring_wraps_at_u32_max() {
        let mut ring = ProdRing::new(fake_ring::<u64>(4, u32::MAX - 1));
        assert_eq!(ring.free(4), 4);
        for v in [10, 11, 12, 13] {
            assert!(ring.push(v));
        }
        assert!(!ring.push(14), "a full ring refuses, it does not overwrite");
        ring.commit();
        assert_eq!(ring.ring.producer().load(Ordering::Relaxed), 2, "index wrapped past u32::MAX");
        // Slots were written in index order across the wrap: MAX-1 -> 2, MAX -> 3, 0 -> 0, 1 -> 1.
        fn slot(ring: &ProdRing<u64>, i: u32) -> u64 {
            // SAFETY: test-only read of a published slot; no kernel is
            // attached to this memory.
            unsafe { ring.ring.slot_ptr(i).read() }
        }
        let r = &ring;
        assert_eq!([slot(r, u32::MAX - 1), slot(r, u32::MAX), slot(r, 0), slot(r, 1)], [10, 11, 12, 13]);
        assert_eq!(ring.outstanding(), 4);
        // The "kernel" consumes three entries.
        ring.ring.consumer().store(1, Ordering::Release);
        assert_eq!(ring.free(1), 3);
        assert_eq!(ring.outstanding(), 1);
        assert!(ring.push(20));
        ring.commit();
        assert_eq!(ring.ring.producer().load(Ordering::Relaxed), 3);
        assert_eq!(slot(&ring, 2), 20);
    }

    #[test]
    fn consumer_ring_wraps_at_u32_max() {
        let mut ring = ConsRing::new(fake_ring::<u64>(4, u32::MAX - 2));
        let mut out = [0u64; 8];
        assert_eq!(ring.pop_into(&mut out), 0);
        // The "kernel" produces 4 entries starting at MAX-2.
        for (i, v) in [1u64, 2, 3, 4].iter().enumerate() {
            let idx = (u32::MAX - 2).wrapping_add(i as u32);
            // SAFETY: test-only write of an unpublished slot.
            unsafe { ring.ring.slot_ptr(idx).write(*v) };
        }
        ring.ring.producer().store(1, Ordering::Release);
        assert_eq!(ring.available(1), 4);
        assert_eq!(ring.pop_into(&mut out[..3]), 3);
        assert_eq!(out[..3], [1, 2, 3]);
        assert_eq!(ring.ring.consumer().load(Ordering::Relaxed), 0, "consumer index wrapped to 0");
        assert_eq!(ring.pop_into(&mut out), 1);
        assert_eq!(out[0], 4);
        assert_eq!(ring.ring.consumer().load(Ordering::Relaxed), 1);
        assert_eq!(ring.pop_into(&mut out), 0);
    }

    #[test]
    fn need_wakeup_flag_is_read_from_the_flags_word() {
        let ring = ProdRing::new(fake_ring::<u64>(4, 0));
        assert!(!ring.needs_wakeup());
        ring.ring.flags().store(XDP_RING_NEED_WAKEUP, Ordering::Relaxed);
        assert!(ring.needs_wakeup());
    }

    #[test]
    fn bad_layouts_are_refused() {
        let off = XdpRingOffset { producer: 0, consumer: 64, flags: 128, desc: 192 };
        let map = Mmap::anonymous(192 + 4 * 8).expect("mmap");
        assert!(RingMap::<u64>::from_mmap(map, &off, 8).is_err(), "descriptors past the end");
        let map = Mmap::anonymous(4096).expect("mmap");
        assert!(RingMap::<u64>::from_mmap(map, &off, 6).is_err(), "size not a power of two");
        let map = Mmap::anonymous(4096).expect("mmap");
        let skew = XdpRingOffset { consumer: 66, ..off };
        assert!(RingMap::<u64>::from_mmap(map, &skew, 4).is_err(), "misaligned index");
    }

    #[test]
    fn slots_wrap_with_the_mask() {
        let mask = 7;
        assert_eq!(ring_slot(u32::MAX, mask), 7);
        assert_eq!(ring_slot(u32::MAX.wrapping_add(1), mask), 0);
        assert_eq!(ring_slot(13, mask), 5);
        // Eight consecutive indices across the wrap cover all eight slots once.
        let start = u32::MAX - 3;
        let mut seen: Vec<usize> = (0..8).map(|i| ring_slot(start.wrapping_add(i), mask)).collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![0, 1, 2, 3, 4, 5, 6, 7]);
    }
}
