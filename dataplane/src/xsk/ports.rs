//! A worker's AF_XDP ports: one UMEM and its frame pool, shared by one socket
//! per (interface, queue) the worker serves.
//!
//! A two-arm gateway worker has two ports (inside and outside interface, same
//! queue index); a one-arm worker has one. Because every socket shares the
//! UMEM, a frame received on one port is transmitted on another by moving its
//! descriptor: no copy.
//!
//! Frame ownership is tracked by type: a [`Frame`] is created only by
//! [`XskPorts::rx_burst`] and is consumed by [`XskPorts::transmit`] or
//! [`XskPorts::recycle`]. While a `Frame` exists its memory belongs to
//! userspace, which is what makes [`XskPorts::frame_mut`] sound.

use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::Arc;

use super::socket::{bump, SocketConfig, XskCounters, XskSocket};
use super::sys::XdpDesc;
use super::umem::{FramePool, Umem, UmemConfig};
use super::XskError;

/// Index of a port among a worker's ports (the order they were opened in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortId(pub u16);

impl PortId {
    /// The index as `usize`.
    #[inline]
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// The most ports one worker serves (two-arm needs two).
pub const MAX_PORTS: usize = 8;

/// One (interface, queue) to open a socket on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortSpec {
    pub ifindex: u32,
    pub queue: u32,
}

/// Everything needed to open a worker's ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct XskConfig {
    pub umem: UmemConfig,
    pub socket: SocketConfig,
}

/// A received frame owned by userspace until transmitted or recycled.
#[derive(Debug, PartialEq, Eq)]
pub struct Frame {
    addr: u64,
    len: u32,
    port: PortId,
}

impl Frame {
    /// Frame length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len as usize
    }

    /// Whether the frame is empty (never, for frames from the kernel).
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The port it was received on.
    #[inline]
    pub fn port(&self) -> PortId {
        self.port
    }
}

/// Why [`XskPorts::transmit`] handed a frame back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxRefused {
    /// No such port.
    NoSuchPort,
    /// Length 0 or beyond the frame's capacity.
    BadLength,
    /// The port's TX ring is full.
    RingFull,
    /// No free frame in the pool for a new frame ([`XskPorts::transmit_new`]).
    NoFreeFrame,
}

/// One UMEM, its frame pool and the sockets sharing it.
#[derive(Debug)]
pub struct XskPorts {
    // Field order is drop order: sockets (rings, fds) before the UMEM.
    sockets: Vec<XskSocket>,
    pool: FramePool,
    umem: Umem,
    /// Scratch for ring transfers (allocated once).
    desc_buf: Vec<XdpDesc>,
    addr_buf: Vec<u64>,
    /// Frames each fill ring is topped up to (see [`fill_target`]).
    fill_target: u32,
}

/// How many frames to keep on each fill ring: at most half the UMEM spread
/// over the ports, at most the ring's size.
///
/// The other half stays free for frames in flight (RX ring, the handler, TX
/// ring, completions). Filling every fill ring to its size instead parks
/// frames on rings that receive little (the outside port of a two-arm
/// gateway whose traffic flows inside -> outside holds a full ring of them
/// forever) and leaves the busy port's fill ring to run dry under load: the
/// kernel then drops frames after running XDP on them, work wasted on the
/// gateway's core.
pub fn fill_target(frame_count: u32, fill_size: u32, ports: usize) -> u32 {
    let share = frame_count / (2 * ports.max(1) as u32);
    share.clamp(1, fill_size.max(1))
}

impl XskPorts {
    /// Map a UMEM and open one socket per spec, the first registering the
    /// UMEM and the others sharing it. Fill rings start at their
    /// [`fill_target`].
    pub fn open(config: &XskConfig, ports: &[PortSpec]) -> Result<Self, XskError> {
        if ports.is_empty() || ports.len() > MAX_PORTS {
            return Err(XskError::PortCount { count: ports.len(), max: MAX_PORTS });
        }
        let umem = Umem::new(&config.umem)?;
        let mut sockets: Vec<XskSocket> = Vec::with_capacity(ports.len());
        for p in ports {
            let owner = sockets.first().map(|s| s.as_fd());
            let sock = XskSocket::open(&umem, owner, p.ifindex, p.queue, &config.socket)?;
            sockets.push(sock);
        }
        let pool = FramePool::new(umem.frame_size(), umem.frame_count());
        let batch = config.socket.rx_size.max(config.socket.comp_size) as usize;
        let fill_target = fill_target(umem.frame_count(), config.socket.fill_size, sockets.len());
        let mut this = Self {
            sockets,
            pool,
            umem,
            desc_buf: vec![XdpDesc::default(); batch],
            addr_buf: vec![0; batch],
            fill_target,
        };
        for i in 0..this.sockets.len() {
            this.refill(PortId(i as u16));
        }
        Ok(this)
    }

    /// Number of ports.
    pub fn len(&self) -> usize {
        self.sockets.len()
    }

    /// Whether there are no ports (never, after `open`).
    pub fn is_empty(&self) -> bool {
        self.sockets.is_empty()
    }

    /// A port's socket (for its fd, counters and kernel statistics).
    pub fn socket(&self, port: PortId) -> Option<&XskSocket> {
        self.sockets.get(port.index())
    }

    /// The raw fd of a port's socket, for the XSKMAP.
    pub fn raw_fd(&self, port: PortId) -> Option<RawFd> {
        self.socket(port).map(|s| s.as_raw_fd())
    }

    /// A port's counters, shareable with other threads.
    pub fn counters(&self, port: PortId) -> Option<Arc<XskCounters>> {
        self.socket(port).map(|s| Arc::clone(s.counters()))
    }

    /// The UMEM's frame size.
    pub fn frame_size(&self) -> u32 {
        self.umem.frame_size()
    }

    /// Frames in the pool (neither lent to the kernel nor held as `Frame`s).
    pub fn frames_free(&self) -> usize {
        self.pool.len()
    }

    /// Total frames of the UMEM.
    pub fn frames_total(&self) -> u32 {
        self.pool.capacity()
    }

    /// Releases the pool refused (double frees): must stay 0.
    pub fn frame_pool_bad_releases(&self) -> u64 {
        self.pool.bad_releases()
    }

    /// Move completed TX frames of `port` back to the pool; returns how many.
    pub fn reclaim(&mut self, port: PortId) -> usize {
        let Some(sock) = self.sockets.get_mut(port.index()) else { return 0 };
        let mut total = 0;
        loop {
            let n = sock.comp.pop_into(&mut self.addr_buf);
            for &addr in &self.addr_buf[..n] {
                self.pool.release(addr);
            }
            total += n;
            if n < self.addr_buf.len() {
                break;
            }
        }
        bump(&sock.counters.tx_completed, total as u64);
        total
    }

    /// Top up `port`'s fill ring from the pool to its [`fill_target`];
    /// returns frames given. An empty pool while the ring is below its
    /// target is counted (`frame_pool_empty`).
    pub fn refill(&mut self, port: PortId) -> usize {
        let Some(sock) = self.sockets.get_mut(port.index()) else { return 0 };
        let size = sock.fill.size();
        let lent = size - sock.fill.free(size);
        let room = self.fill_target.min(size).saturating_sub(lent);
        if room == 0 {
            return 0;
        }
        let mut given = 0;
        while given < room {
            let Some(addr) = self.pool.alloc() else { break };
            if !sock.fill.push(addr) {
                // Cannot happen (room was checked); keep the frame.
                self.pool.release(addr);
                break;
            }
            given += 1;
        }
        if given == 0 {
            bump(&sock.counters.frame_pool_empty, 1);
            return 0;
        }
        sock.fill.commit();
        sock.wake_rx_if_needed();
        given as usize
    }

    /// Received frames waiting on `port`'s RX ring (reloads the index when
    /// the cached view shows none).
    pub fn rx_ready(&mut self, port: PortId) -> u32 {
        self.sockets.get_mut(port.index()).map_or(0, |s| s.rx.available(1))
    }

    /// Take up to `max` received frames off `port`'s RX ring into `out`
    /// (appending, at most its spare capacity: this never allocates). Their ring slots are released at once; the frames stay
    /// the caller's until transmitted or recycled.
    pub fn rx_burst(&mut self, port: PortId, max: usize, out: &mut Vec<Frame>) -> usize {
        let Some(sock) = self.sockets.get_mut(port.index()) else { return 0 };
        let max = max.min(self.desc_buf.len()).min(out.capacity() - out.len());
        let n = sock.rx.pop_into(&mut self.desc_buf[..max]);
        let mut bytes = 0u64;
        let mut good = 0u64;
        for d in &self.desc_buf[..n] {
            if d.len == 0 || !self.umem.contains(d.addr, d.len) {
                bump(&sock.counters.rx_bad_desc, 1);
                // Return what can be identified; a wild address is dropped.
                self.pool.release(d.addr);
                continue;
            }
            bytes += u64::from(d.len);
            good += 1;
            out.push(Frame { addr: d.addr, len: d.len, port });
        }
        bump(&sock.counters.rx_frames, good);
        bump(&sock.counters.rx_bytes, bytes);
        good as usize
    }

    /// The frame's buffer: from its first byte to the end of its UMEM frame
    /// (the frame occupies `[..frame.len()]`).
    #[inline]
    pub fn frame_mut(&mut self, frame: &Frame) -> &mut [u8] {
        // A `Frame` is only built from a descriptor that `contains` accepted.
        self.umem.frame_from(frame.addr).unwrap_or_default()
    }

    /// Free TX slots on `port` (not counting staged ones), reloading the
    /// kernel's index only when the cached view shows fewer than `want`.
    pub fn tx_room(&mut self, port: PortId, want: u32) -> u32 {
        self.sockets.get_mut(port.index()).map_or(0, |s| s.tx.free(want))
    }

    /// Stage `frame` (now `len` bytes long) for TX on `port`; sent at the
    /// next [`flush_tx`](Self::flush_tx). On refusal the frame comes back.
    #[inline]
    pub fn transmit(&mut self, port: PortId, frame: Frame, len: usize) -> Result<(), (Frame, TxRefused)> {
        let Some(sock) = self.sockets.get_mut(port.index()) else {
            return Err((frame, TxRefused::NoSuchPort));
        };
        let len32 = match u32::try_from(len) {
            Ok(l) if l > 0 && self.umem.contains(frame.addr, l) => l,
            _ => return Err((frame, TxRefused::BadLength)),
        };
        if !sock.tx.push(XdpDesc { addr: frame.addr, len: len32, options: 0 }) {
            bump(&sock.counters.tx_ring_full, 1);
            return Err((frame, TxRefused::RingFull));
        }
        bump(&sock.counters.tx_frames, 1);
        bump(&sock.counters.tx_bytes, u64::from(len32));
        Ok(())
    }

    /// Stage a frame that did not come off an RX ring (an announcement such
    /// as a gratuitous ARP): take a free frame from the pool, let `write`
    /// fill it from its start and return the length, and stage it for TX on
    /// `port`. On refusal the frame goes back to the pool.
    pub fn transmit_new(&mut self, port: PortId, write: impl FnOnce(&mut [u8]) -> usize) -> Result<(), TxRefused> {
        if port.index() >= self.sockets.len() {
            return Err(TxRefused::NoSuchPort);
        }
        if self.tx_room(port, 1) == 0 {
            return Err(TxRefused::RingFull);
        }
        let Some(addr) = self.pool.alloc() else { return Err(TxRefused::NoFreeFrame) };
        // The frame came from the pool: userspace owns it, as `frame_from` requires.
        let len = write(self.umem.frame_from(addr).unwrap_or_default());
        let frame = Frame { addr, len: 0, port };
        self.transmit(port, frame, len).map_err(|(frame, why)| {
            self.pool.release(frame.addr);
            why
        })
    }

    /// Return a frame to the pool (a dropped packet).
    #[inline]
    pub fn recycle(&mut self, frame: Frame) {
        self.pool.release(frame.addr);
    }

    /// Publish staged TX descriptors on `port` and kick if needed.
    pub fn flush_tx(&mut self, port: PortId) {
        if let Some(s) = self.sockets.get_mut(port.index()) {
            s.flush_tx();
        }
    }

    /// TX descriptors published on `port` that the kernel has not consumed.
    pub fn tx_outstanding(&mut self, port: PortId) -> u32 {
        self.sockets.get_mut(port.index()).map_or(0, |s| s.tx.outstanding())
    }

    /// Frames each fill ring is topped up to.
    pub fn fill_target(&self) -> u32 {
        self.fill_target
    }

    /// Size of `port`'s TX ring.
    pub fn tx_ring_size(&self, port: PortId) -> u32 {
        self.socket(port).map_or(0, |s| s.tx.size())
    }

    /// Sample every socket's `XDP_STATISTICS` into its counters.
    pub fn refresh_kernel_stats(&self) {
        for s in &self.sockets {
            // A failure leaves the previous sample; nothing to do per call.
            let _ = s.refresh_kernel_stats();
        }
    }

    /// The sockets, in port order.
    pub fn sockets(&self) -> impl Iterator<Item = &XskSocket> {
        self.sockets.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::fill_target;

    #[test]
    fn fill_rings_get_half_the_umem_between_them() {
        // The daemon's defaults, two-arm: 4096 frames, rings of 2048.
        assert_eq!(fill_target(4096, 2048, 2), 1024);
        // One-arm: half the UMEM, which is the whole ring here.
        assert_eq!(fill_target(4096, 2048, 1), 2048);
        // Never more than the ring holds.
        assert_eq!(fill_target(8192, 2048, 1), 2048);
        assert_eq!(fill_target(96, 64, 1), 48);
        // Degenerate geometries still give every ring a frame.
        assert_eq!(fill_target(1, 64, 8), 1);
        assert_eq!(fill_target(4096, 2048, 0), 2048);
    }
}
