//! One AF_XDP socket bound to one (interface, queue), with its four rings and
//! its counters.
//!
//! Setup order (Documentation/networking/af_xdp.rst): create the socket;
//! register the UMEM on the first socket of a worker (`XDP_UMEM_REG`); size
//! the fill and completion rings (every socket has its own: in shared-UMEM
//! mode the kernel needs one pair per (device, queue)); size RX and TX; read
//! the mmap offsets and map the rings; bind. Sockets after the first bind
//! with `XDP_SHARED_UMEM` and no other flag (the kernel refuses mode flags on
//! a shared bind: the mode is the UMEM owner's).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::ring::{ConsRing, ProdRing};
use super::sys::{self, XdpDesc, XdpMmapOffsets, XdpStatistics};
use super::umem::Umem;
use super::XskError;

/// How to bind the first socket of a UMEM (the others inherit it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BindMode {
    /// Let the kernel pick: zero-copy where the driver supports it, else copy.
    #[default]
    Auto,
    /// Force copy mode (veth, or drivers with broken zero-copy).
    Copy,
    /// Force zero-copy; binding fails where the driver lacks it.
    ZeroCopy,
}

/// Ring sizes and socket options (all sizes are powers of two).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SocketConfig {
    pub rx_size: u32,
    pub tx_size: u32,
    pub fill_size: u32,
    pub comp_size: u32,
    pub mode: BindMode,
    /// Ask the kernel to flag when it needs a wakeup syscall, instead of
    /// kicking on every TX batch.
    pub need_wakeup: bool,
    /// `XDP_MAX_TX_SKB_BUDGET` to request (copy mode, Linux 6.17+); clamped to
    /// `[32, tx_size]`, skipped when `tx_size < 32`, ignored by kernels that
    /// lack the option.
    pub tx_skb_budget: Option<u32>,
}

impl Default for SocketConfig {
    fn default() -> Self {
        Self {
            rx_size: 2048,
            tx_size: 2048,
            fill_size: 2048,
            comp_size: 2048,
            mode: BindMode::Auto,
            need_wakeup: true,
            tx_skb_budget: Some(256),
        }
    }
}

impl SocketConfig {
    fn validate(&self) -> Result<(), XskError> {
        for (ring, size) in
            [("rx", self.rx_size), ("tx", self.tx_size), ("fill", self.fill_size), ("completion", self.comp_size)]
        {
            if size == 0 || !size.is_power_of_two() {
                return Err(XskError::InvalidRingSize { ring, size });
            }
        }
        Ok(())
    }
}

/// Per-socket counters. One writer (the worker that owns the socket), any
/// number of readers; plain relaxed loads and stores, no read-modify-write.
#[derive(Debug, Default)]
pub struct XskCounters {
    /// Frames taken off the RX ring.
    pub rx_frames: AtomicU64,
    pub rx_bytes: AtomicU64,
    /// Frames queued on the TX ring.
    pub tx_frames: AtomicU64,
    pub tx_bytes: AtomicU64,
    /// Frames the kernel reported sent (completion ring).
    pub tx_completed: AtomicU64,
    /// Times a TX attempt found the ring full (the worker then holds RX).
    pub tx_ring_full: AtomicU64,
    /// Refills that wanted frames for the fill ring and found the pool empty.
    pub frame_pool_empty: AtomicU64,
    /// `sendto` TX kicks.
    pub tx_kicks: AtomicU64,
    /// Kicks answered `EAGAIN`/`EBUSY`/`ENOBUFS` (budget used up or transient:
    /// the worker kicks again).
    pub tx_kick_again: AtomicU64,
    /// Kicks that failed otherwise (e.g. `ENETDOWN`).
    pub tx_kick_errors: AtomicU64,
    /// `recvfrom` fill-ring wakeups (zero-copy drivers only).
    pub rx_wakeups: AtomicU64,
    /// RX descriptors pointing outside the UMEM (dropped; a kernel bug).
    pub rx_bad_desc: AtomicU64,
    /// The kernel's `XDP_STATISTICS`, as last sampled by the worker.
    pub kernel_rx_dropped: AtomicU64,
    pub kernel_rx_invalid_descs: AtomicU64,
    pub kernel_tx_invalid_descs: AtomicU64,
    pub kernel_rx_ring_full: AtomicU64,
    pub kernel_rx_fill_ring_empty_descs: AtomicU64,
    pub kernel_tx_ring_empty_descs: AtomicU64,
}

/// Add for a single writer: a relaxed load and store, no locked instruction.
#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// A plain copy of [`XskCounters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XskCountersSnapshot {
    pub rx_frames: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub tx_bytes: u64,
    pub tx_completed: u64,
    pub tx_ring_full: u64,
    pub frame_pool_empty: u64,
    pub tx_kicks: u64,
    pub tx_kick_again: u64,
    pub tx_kick_errors: u64,
    pub rx_wakeups: u64,
    pub rx_bad_desc: u64,
    pub kernel: XdpStatistics,
}

impl XskCounters {
    /// Read every counter (each individually consistent).
    pub fn snapshot(&self) -> XskCountersSnapshot {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        XskCountersSnapshot {
            rx_frames: l(&self.rx_frames),
            rx_bytes: l(&self.rx_bytes),
            tx_frames: l(&self.tx_frames),
            tx_bytes: l(&self.tx_bytes),
            tx_completed: l(&self.tx_completed),
            tx_ring_full: l(&self.tx_ring_full),
            frame_pool_empty: l(&self.frame_pool_empty),
            tx_kicks: l(&self.tx_kicks),
            tx_kick_again: l(&self.tx_kick_again),
            tx_kick_errors: l(&self.tx_kick_errors),
            rx_wakeups: l(&self.rx_wakeups),
            rx_bad_desc: l(&self.rx_bad_desc),
            kernel: XdpStatistics {
                rx_dropped: l(&self.kernel_rx_dropped),
                rx_invalid_descs: l(&self.kernel_rx_invalid_descs),
                tx_invalid_descs: l(&self.kernel_tx_invalid_descs),
                rx_ring_full: l(&self.kernel_rx_ring_full),
                rx_fill_ring_empty_descs: l(&self.kernel_rx_fill_ring_empty_descs),
                tx_ring_empty_descs: l(&self.kernel_tx_ring_empty_descs),
            },
        }
    }
}

/// An AF_XDP socket bound to (ifindex, queue).
#[derive(Debug)]
pub struct XskSocket {
    // Rings first: unmapped before the socket closes.
    pub(super) rx: ConsRing<XdpDesc>,
    pub(super) tx: ProdRing<XdpDesc>,
    pub(super) fill: ProdRing<u64>,
    pub(super) comp: ConsRing<u64>,
    fd: OwnedFd,
    ifindex: u32,
    queue: u32,
    tx_skb_budget: Option<u32>,
    need_wakeup: bool,
    pub(super) counters: Arc<XskCounters>,
}

impl XskSocket {
    /// Create, configure, map and bind a socket. With `shared_with`, share
    /// that (already bound) socket's UMEM; otherwise register `umem` here.
    pub(super) fn open(
        umem: &Umem,
        shared_with: Option<BorrowedFd<'_>>,
        ifindex: u32,
        queue: u32,
        config: &SocketConfig,
    ) -> Result<Self, XskError> {
        config.validate()?;
        let sockerr = |op: &'static str| move |source: io::Error| XskError::Socket { op, ifindex, queue, source };
        let fd = sys::xdp_socket().map_err(sockerr("socket(AF_XDP)"))?;
        let b = fd.as_fd();
        let setopt = |option: &'static str, opt: libc::c_int, value: u32| {
            sys::set_opt(b, opt, &value).map_err(|source| XskError::SetOption { option, value, ifindex, queue, source })
        };
        if shared_with.is_none() {
            let reg = umem.registration();
            sys::set_opt(b, sys::XDP_UMEM_REG, &reg).map_err(|source| XskError::UmemRegister {
                len: reg.len,
                frame_size: reg.chunk_size,
                source,
            })?;
        }
        setopt("XDP_UMEM_FILL_RING", sys::XDP_UMEM_FILL_RING, config.fill_size)?;
        setopt("XDP_UMEM_COMPLETION_RING", sys::XDP_UMEM_COMPLETION_RING, config.comp_size)?;
        setopt("XDP_RX_RING", sys::XDP_RX_RING, config.rx_size)?;
        setopt("XDP_TX_RING", sys::XDP_TX_RING, config.tx_size)?;

        let mut off = XdpMmapOffsets::default();
        sys::get_opt(b, sys::XDP_MMAP_OFFSETS, &mut off).map_err(sockerr("getsockopt(XDP_MMAP_OFFSETS)"))?;
        let maperr = |ring: &'static str| move |source: io::Error| XskError::RingMap { ring, ifindex, queue, source };
        let rx = ConsRing::map(b, &off.rx, config.rx_size, sys::XDP_PGOFF_RX_RING).map_err(maperr("rx"))?;
        let tx = ProdRing::map(b, &off.tx, config.tx_size, sys::XDP_PGOFF_TX_RING).map_err(maperr("tx"))?;
        let fill =
            ProdRing::map(b, &off.fr, config.fill_size, sys::XDP_UMEM_PGOFF_FILL_RING).map_err(maperr("fill"))?;
        let comp = ConsRing::map(b, &off.cr, config.comp_size, sys::XDP_UMEM_PGOFF_COMPLETION_RING)
            .map_err(maperr("completion"))?;

        let tx_skb_budget = config.tx_skb_budget.and_then(|want| set_tx_skb_budget(b, want, config.tx_size));

        let mut addr = sys::SockaddrXdp { family: sys::AF_XDP as u16, ifindex, queue_id: queue, ..Default::default() };
        match shared_with {
            Some(owner) => {
                addr.flags = sys::XDP_SHARED_UMEM;
                addr.shared_umem_fd = owner.as_raw_fd() as u32;
            }
            None => {
                addr.flags = match config.mode {
                    BindMode::Auto => 0,
                    BindMode::Copy => sys::XDP_COPY,
                    BindMode::ZeroCopy => sys::XDP_ZEROCOPY,
                };
                if config.need_wakeup {
                    addr.flags |= sys::XDP_USE_NEED_WAKEUP;
                }
            }
        }
        sys::bind(b, &addr).map_err(|source| XskError::Bind { ifindex, queue, flags: addr.flags, source })?;

        Ok(Self {
            rx,
            tx,
            fill,
            comp,
            fd,
            ifindex,
            queue,
            tx_skb_budget,
            need_wakeup: config.need_wakeup,
            counters: Arc::default(),
        })
    }

    /// The interface this socket is bound to.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// The queue this socket is bound to.
    pub fn queue(&self) -> u32 {
        self.queue
    }

    /// The TX skb budget the kernel accepted, if any.
    pub fn tx_skb_budget(&self) -> Option<u32> {
        self.tx_skb_budget
    }

    /// The counters, shareable with other threads.
    pub fn counters(&self) -> &Arc<XskCounters> {
        &self.counters
    }

    /// Read the kernel's `XDP_STATISTICS` now.
    pub fn kernel_stats(&self) -> io::Result<XdpStatistics> {
        let mut st = XdpStatistics::default();
        sys::get_opt(self.fd.as_fd(), sys::XDP_STATISTICS, &mut st)?;
        Ok(st)
    }

    /// Sample the kernel's statistics into the shared counters.
    pub fn refresh_kernel_stats(&self) -> io::Result<()> {
        let st = self.kernel_stats()?;
        let c = &self.counters;
        let s = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        s(&c.kernel_rx_dropped, st.rx_dropped);
        s(&c.kernel_rx_invalid_descs, st.rx_invalid_descs);
        s(&c.kernel_tx_invalid_descs, st.tx_invalid_descs);
        s(&c.kernel_rx_ring_full, st.rx_ring_full);
        s(&c.kernel_rx_fill_ring_empty_descs, st.rx_fill_ring_empty_descs);
        s(&c.kernel_tx_ring_empty_descs, st.tx_ring_empty_descs);
        Ok(())
    }

    /// Commit staged TX descriptors and kick the kernel if it wants a
    /// wakeup (always, when need-wakeup is off) and TX is not empty.
    pub(super) fn flush_tx(&mut self) {
        self.tx.commit();
        // Without need-wakeup the flag is never set, and copy-mode TX only
        // runs inside a syscall: kick whenever TX holds entries.
        if self.need_wakeup && !self.tx.needs_wakeup() {
            return;
        }
        if self.tx.outstanding() == 0 {
            return;
        }
        bump(&self.counters.tx_kicks, 1);
        if let Err(e) = sys::kick_tx(self.fd.as_fd()) {
            match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EBUSY | libc::ENOBUFS) => bump(&self.counters.tx_kick_again, 1),
                _ => bump(&self.counters.tx_kick_errors, 1),
            }
        }
    }

    /// Wake the driver for RX if the fill ring asks for it (zero-copy).
    pub(super) fn wake_rx_if_needed(&mut self) {
        if self.fill.needs_wakeup() {
            bump(&self.counters.rx_wakeups, 1);
            // Errors here are not actionable: the next poll() wakes it too.
            let _ = sys::kick_rx(self.fd.as_fd());
        }
    }
}

impl AsFd for XskSocket {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for XskSocket {
    /// The socket's fd, for the XSKMAP and for poll().
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Best effort `XDP_MAX_TX_SKB_BUDGET`; returns the budget set, `None` when
/// the kernel lacks the option or the TX ring is smaller than the minimum 32.
fn set_tx_skb_budget(fd: BorrowedFd<'_>, want: u32, tx_size: u32) -> Option<u32> {
    const MIN: u32 = 32;
    if tx_size < MIN {
        return None;
    }
    let budget = want.clamp(MIN, tx_size);
    match sys::set_opt(fd, sys::XDP_MAX_TX_SKB_BUDGET, &budget) {
        Ok(()) => Some(budget),
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => None,
        Err(e) => {
            tracing::warn!(budget, error = %e, "XDP_MAX_TX_SKB_BUDGET refused; keeping the kernel default");
            None
        }
    }
}
