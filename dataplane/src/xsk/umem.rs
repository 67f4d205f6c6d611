//! The UMEM (the packet memory a worker's AF_XDP sockets share) and its frame
//! allocator.
//!
//! Frame size: 2048 bytes by default. In aligned mode the kernel requires a
//! power of two between 2048 and the page size, so the choice is 2048 or 4096.
//! The kernel puts received data `XDP_PACKET_HEADROOM` (256) bytes into the
//! frame, leaving 1792 bytes: a 1500-byte MTU frame with a VLAN tag (1518)
//! fits with room to spare, and 2048 halves the memory per frame, so the same
//! 16 MiB holds 8192 frames (deeper rings, fewer drops under bursts).
//! Gateways with MTUs up to ~3800 configure 4096; jumbo frames (9000) need
//! multi-buffer AF_XDP, which Egret does not use.

use super::sys::{Mmap, XdpUmemReg};
use super::XskError;

/// Default frame (chunk) size.
pub const DEFAULT_FRAME_SIZE: u32 = 2048;
/// Default number of frames per worker UMEM (16 MiB at 2048 bytes).
pub const DEFAULT_FRAME_COUNT: u32 = 8192;
/// Bytes the kernel leaves before received data in each frame (copy and
/// zero-copy alike): `XDP_PACKET_HEADROOM`.
pub const XDP_PACKET_HEADROOM: u32 = 256;

/// UMEM geometry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UmemConfig {
    /// 2048 or 4096.
    pub frame_size: u32,
    /// Number of frames; the UMEM is `frame_size * frame_count` bytes.
    pub frame_count: u32,
}

impl Default for UmemConfig {
    fn default() -> Self {
        Self { frame_size: DEFAULT_FRAME_SIZE, frame_count: DEFAULT_FRAME_COUNT }
    }
}

impl UmemConfig {
    /// Check the geometry the kernel will accept.
    pub fn validate(&self) -> Result<(), XskError> {
        if self.frame_size != 2048 && self.frame_size != 4096 {
            return Err(XskError::InvalidFrameSize { frame_size: self.frame_size });
        }
        if self.frame_count == 0 {
            return Err(XskError::InvalidFrameCount { frame_count: self.frame_count });
        }
        Ok(())
    }
}

/// The packet memory: one anonymous mapping split into equal frames.
#[derive(Debug)]
pub struct Umem {
    area: Mmap,
    frame_size: u32,
    /// log2 of `frame_size` (a power of two, checked by `UmemConfig::validate`):
    /// frame arithmetic per packet is shifts and masks, not divisions.
    frame_shift: u32,
    frame_count: u32,
}

impl Umem {
    /// Map (and prefault) the UMEM.
    pub fn new(config: &UmemConfig) -> Result<Self, XskError> {
        config.validate()?;
        let len = config.frame_size as usize * config.frame_count as usize;
        let area = Mmap::anonymous(len).map_err(|source| XskError::UmemMap { len, source })?;
        Ok(Self {
            area,
            frame_size: config.frame_size,
            frame_shift: config.frame_size.trailing_zeros(),
            frame_count: config.frame_count,
        })
    }

    /// The registration the kernel needs (`XDP_UMEM_REG`).
    pub fn registration(&self) -> XdpUmemReg {
        XdpUmemReg {
            addr: self.area.as_ptr() as u64,
            len: self.area.len() as u64,
            chunk_size: self.frame_size,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        }
    }

    /// Frame size in bytes.
    pub fn frame_size(&self) -> u32 {
        self.frame_size
    }

    /// Number of frames.
    pub fn frame_count(&self) -> u32 {
        self.frame_count
    }

    /// Whether `[addr, addr + len)` lies inside one frame of this UMEM (what
    /// the kernel's aligned-mode descriptor check requires, too).
    #[inline]
    pub fn contains(&self, addr: u64, len: u32) -> bool {
        let end = addr.checked_add(u64::from(len.max(1)) - 1);
        match end {
            Some(end) => end < self.area.len() as u64 && addr >> self.frame_shift == end >> self.frame_shift,
            None => false,
        }
    }

    /// The bytes from `addr` to the end of its frame.
    ///
    /// The caller must own the frame (it came off the RX ring and was not
    /// handed back to the kernel since): `XskPorts` enforces this through
    /// `Frame`, which only the RX path creates. Returns `None` if `addr` is
    /// outside the UMEM.
    #[inline]
    pub(super) fn frame_from(&mut self, addr: u64) -> Option<&mut [u8]> {
        if !self.contains(addr, 1) {
            return None;
        }
        let fs = u64::from(self.frame_size);
        let cap = (fs - (addr & (fs - 1))) as usize;
        // SAFETY: `addr` < the mapping's length (checked by `contains`), so
        // the pointer stays inside the mapping.
        let start = unsafe { self.area.as_ptr().add(addr as usize) };
        // SAFETY: `[start, start + cap)` lies inside the mapping (`cap` stops
        // at the frame end). The frame is owned by userspace (see above), so
        // the kernel does not touch it, and the `&mut self` borrow makes this
        // the only slice into it.
        Some(unsafe { std::slice::from_raw_parts_mut(start, cap) })
    }
}

/// The free list of frames not lent to the kernel nor held by the worker.
///
/// A stack of frame base addresses plus an ownership bitmap, so a frame
/// returned twice (or an address outside the UMEM) is refused and counted
/// instead of being handed to the kernel twice. No allocation after `new`.
#[derive(Debug)]
pub struct FramePool {
    free: Vec<u64>,
    in_pool: Vec<u64>,
    frame_size: u32,
    /// log2 of `frame_size` when it is a power of two (every UMEM's is).
    frame_shift: Option<u32>,
    frame_count: u32,
    bad_release: u64,
}

impl FramePool {
    /// A pool owning every frame of a UMEM of `frame_count` frames.
    pub fn new(frame_size: u32, frame_count: u32) -> Self {
        let mut free: Vec<u64> = Vec::with_capacity(frame_count as usize);
        // Reversed so the first allocations hand out the lowest addresses.
        free.extend((0..u64::from(frame_count)).rev().map(|i| i * u64::from(frame_size)));
        let words = (frame_count as usize).div_ceil(64);
        let mut in_pool = vec![u64::MAX; words];
        let tail = frame_count as usize % 64;
        if tail != 0 {
            if let Some(last) = in_pool.last_mut() {
                *last = (1u64 << tail) - 1;
            }
        }
        let frame_shift = frame_size.is_power_of_two().then(|| frame_size.trailing_zeros());
        Self { free, in_pool, frame_size, frame_shift, frame_count, bad_release: 0 }
    }

    /// The index of the frame holding `addr`.
    #[inline]
    fn index_of(&self, addr: u64) -> u64 {
        match self.frame_shift {
            Some(shift) => addr >> shift,
            None => addr / u64::from(self.frame_size.max(1)),
        }
    }

    /// Take a frame (its base address), if any is free.
    #[inline]
    pub fn alloc(&mut self) -> Option<u64> {
        let addr = self.free.pop()?;
        let idx = self.index_of(addr) as usize;
        if let Some(w) = self.in_pool.get_mut(idx / 64) {
            *w &= !(1u64 << (idx % 64));
        }
        Some(addr)
    }

    /// Give a frame back; any address inside the frame will do. Returns
    /// `false` (and counts it) for a frame already in the pool or an address
    /// outside the UMEM.
    #[inline]
    pub fn release(&mut self, addr: u64) -> bool {
        let idx = self.index_of(addr);
        if idx >= u64::from(self.frame_count) {
            self.bad_release += 1;
            return false;
        }
        let idx = idx as usize;
        let bit = 1u64 << (idx % 64);
        match self.in_pool.get_mut(idx / 64) {
            Some(w) if *w & bit == 0 => {
                *w |= bit;
                self.free.push(idx as u64 * u64::from(self.frame_size));
                true
            }
            _ => {
                self.bad_release += 1;
                false
            }
        }
    }

    /// Frames currently free.
    pub fn len(&self) -> usize {
        self.free.len()
    }

    /// Whether no frame is free.
    pub fn is_empty(&self) -> bool {
        self.free.is_empty()
    }

    /// Total frames (free or lent).
    pub fn capacity(&self) -> u32 {
        self.frame_count
    }

    /// Releases refused (double frees, foreign addresses).
    pub fn bad_releases(&self) -> u64 {
        self.bad_release
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_hands_out_every_frame_once() {
        let mut pool = FramePool::new(2048, 5);
        let got: Vec<u64> = std::iter::from_fn(|| pool.alloc()).collect();
        assert_eq!(got, vec![0, 2048, 4096, 6144, 8192]);
        assert!(pool.alloc().is_none());
        assert!(pool.is_empty());
    }

    #[test]
    fn release_normalises_to_the_frame_base() {
        let mut pool = FramePool::new(2048, 4);
        let a = pool.alloc().expect("frame");
        let b = pool.alloc().expect("frame");
        assert_eq!((a, b), (0, 2048));
        // The kernel returns TX addresses with the headroom offset in them.
        assert!(pool.release(b + 256));
        assert_eq!(pool.alloc(), Some(2048));
    }

    #[test]
    fn double_free_and_foreign_addresses_are_refused_and_counted() {
        let mut pool = FramePool::new(4096, 70);
        let a = pool.alloc().expect("frame");
        assert!(pool.release(a));
        assert!(!pool.release(a + 100), "already in the pool");
        assert!(!pool.release(70 * 4096), "one past the last frame");
        assert!(!pool.release(u64::MAX));
        assert_eq!(pool.bad_releases(), 3);
        assert_eq!(pool.len(), 70);
        // A frame never allocated (still in the pool, in the bitmap's second
        // word) is refused too.
        assert!(!pool.release(69 * 4096));
    }

    #[test]
    fn pool_round_trip_keeps_the_count() {
        let mut pool = FramePool::new(2048, 130);
        let mut held = Vec::new();
        for round in 0..3 {
            while let Some(a) = pool.alloc() {
                held.push(a);
            }
            assert_eq!(held.len(), 130, "round {round}");
            for a in held.drain(..) {
                assert!(pool.release(a + 1));
            }
            assert_eq!(pool.len(), 130);
        }
        assert_eq!(pool.bad_releases(), 0);
    }

    #[test]
    fn umem_geometry_is_checked() {
        assert!(UmemConfig { frame_size: 1024, frame_count: 8 }.validate().is_err());
        assert!(UmemConfig { frame_size: 3000, frame_count: 8 }.validate().is_err());
        assert!(UmemConfig { frame_size: 8192, frame_count: 8 }.validate().is_err());
        assert!(UmemConfig { frame_size: 2048, frame_count: 0 }.validate().is_err());
        assert!(UmemConfig::default().validate().is_ok());
    }

    #[test]
    fn frame_slices_stop_at_the_frame_end() {
        let mut umem = Umem::new(&UmemConfig { frame_size: 2048, frame_count: 4 }).expect("umem");
        assert!(umem.contains(2048 + 256, 1792));
        assert!(!umem.contains(2048 + 256, 1793), "crosses into the next frame");
        assert!(!umem.contains(4 * 2048, 1), "past the end");
        assert!(!umem.contains(u64::MAX, 2));
        let buf = umem.frame_from(2048 + 256).expect("in range");
        assert_eq!(buf.len(), 1792);
        buf[0] = 0xab;
        buf[1791] = 0xcd;
        let again = umem.frame_from(2048).expect("in range");
        assert_eq!((again.len(), again[256], again[2047]), (2048, 0xab, 0xcd));
        assert!(umem.frame_from(4 * 2048).is_none());
    }
}
