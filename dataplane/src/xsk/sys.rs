//! The AF_XDP kernel ABI (`include/uapi/linux/if_xdp.h`) and thin syscall
//! wrappers over `libc`.
//!
//! Everything here mirrors the uapi header of Linux 6.18 field for field; the
//! layouts are checked by size assertions below. Each wrapper turns `-1`/errno
//! into an `io::Error` and nothing else: policy (what to retry, what to count)
//! lives in the callers.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// `SOL_XDP`: the socket-option level of AF_XDP sockets.
pub const SOL_XDP: libc::c_int = 283;
/// `AF_XDP` address family.
pub const AF_XDP: libc::c_int = 44;

// Bind flags (`struct sockaddr_xdp.sxdp_flags`).
/// Share the UMEM of the socket named in `sxdp_shared_umem_fd`.
pub const XDP_SHARED_UMEM: u16 = 1 << 0;
/// Force copy mode.
pub const XDP_COPY: u16 = 1 << 1;
/// Force zero-copy mode.
pub const XDP_ZEROCOPY: u16 = 1 << 2;
/// The kernel sets `XDP_RING_NEED_WAKEUP` in a ring's flags when it needs a
/// syscall to make progress.
pub const XDP_USE_NEED_WAKEUP: u16 = 1 << 3;

/// Ring flag: the kernel is waiting for a wakeup (`sendto`/`poll`).
pub const XDP_RING_NEED_WAKEUP: u32 = 1 << 0;

// Socket options.
pub const XDP_MMAP_OFFSETS: libc::c_int = 1;
pub const XDP_RX_RING: libc::c_int = 2;
pub const XDP_TX_RING: libc::c_int = 3;
pub const XDP_UMEM_REG: libc::c_int = 4;
pub const XDP_UMEM_FILL_RING: libc::c_int = 5;
pub const XDP_UMEM_COMPLETION_RING: libc::c_int = 6;
pub const XDP_STATISTICS: libc::c_int = 7;
/// Linux 6.17+ (`net: xsk: introduce XDP_MAX_TX_SKB_BUDGET setsockopt`): how
/// many TX descriptors one `sendto` turns into skbs in copy mode (default 32,
/// allowed range `[32, tx ring size]`). Older kernels answer `ENOPROTOOPT`.
pub const XDP_MAX_TX_SKB_BUDGET: libc::c_int = 9;

// mmap page offsets selecting which ring to map.
pub const XDP_PGOFF_RX_RING: libc::off_t = 0;
pub const XDP_PGOFF_TX_RING: libc::off_t = 0x8000_0000;
pub const XDP_UMEM_PGOFF_FILL_RING: libc::off_t = 0x1_0000_0000;
pub const XDP_UMEM_PGOFF_COMPLETION_RING: libc::off_t = 0x1_8000_0000;

/// `struct sockaddr_xdp`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct SockaddrXdp {
    pub family: u16,
    pub flags: u16,
    pub ifindex: u32,
    pub queue_id: u32,
    pub shared_umem_fd: u32,
}

/// `struct xdp_umem_reg` (the 6.18 layout; older kernels read a prefix).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XdpUmemReg {
    pub addr: u64,
    pub len: u64,
    pub chunk_size: u32,
    pub headroom: u32,
    pub flags: u32,
    pub tx_metadata_len: u32,
}

/// `struct xdp_ring_offset`: where a ring's fields live in its mapping.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XdpRingOffset {
    pub producer: u64,
    pub consumer: u64,
    pub desc: u64,
    pub flags: u64,
}

/// `struct xdp_mmap_offsets`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct XdpMmapOffsets {
    pub rx: XdpRingOffset,
    pub tx: XdpRingOffset,
    pub fr: XdpRingOffset,
    pub cr: XdpRingOffset,
}

/// `struct xdp_desc`: one RX or TX descriptor.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpDesc {
    /// Offset of the frame's first byte in the UMEM.
    pub addr: u64,
    pub len: u32,
    pub options: u32,
}

/// `struct xdp_statistics` (6 counters since Linux 5.9; older kernels fill
/// the first three).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct XdpStatistics {
    /// Dropped for reasons other than invalid descriptors.
    pub rx_dropped: u64,
    /// Dropped because of invalid descriptors.
    pub rx_invalid_descs: u64,
    /// TX descriptors the kernel rejected.
    pub tx_invalid_descs: u64,
    /// Dropped because the RX ring was full.
    pub rx_ring_full: u64,
    /// Times the kernel found the fill ring empty.
    pub rx_fill_ring_empty_descs: u64,
    /// Times the kernel found the TX ring empty when asked to send.
    pub tx_ring_empty_descs: u64,
}

const _: () = assert!(size_of::<SockaddrXdp>() == 16);
const _: () = assert!(size_of::<XdpUmemReg>() == 32);
const _: () = assert!(size_of::<XdpRingOffset>() == 32);
const _: () = assert!(size_of::<XdpMmapOffsets>() == 128);
const _: () = assert!(size_of::<XdpDesc>() == 16);
const _: () = assert!(size_of::<XdpStatistics>() == 48);

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `socket(AF_XDP, SOCK_RAW | SOCK_CLOEXEC, 0)`.
pub fn xdp_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers; the result is checked below.
    let fd = cvt(unsafe { libc::socket(AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: `fd` was just returned by socket(2), is valid and owned by no
    // one else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Plain old data: the types a socket option may be read into or written
/// from. Sealed: only this module implements it, for the uapi structs above
/// and plain integers, whose layouts the size assertions above pin.
///
/// # Safety
///
/// An implementor must be `#[repr(C)]` (or a primitive integer) made only
/// of integers, with no padding, so that every bit pattern the kernel
/// writes is a valid value and every byte the kernel reads is initialised.
///
/// A type with invalid bit patterns cannot be read from the kernel:
///
/// ```compile_fail
/// # use std::os::fd::AsFd;
/// # let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let mut flag = false; // only 0 and 1 are valid `bool`s
/// egret_dataplane::xsk::sys::get_opt(sock.as_fd(), 0, &mut flag);
/// ```
///
/// ```
/// # use std::os::fd::AsFd;
/// # let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
/// let mut st = egret_dataplane::xsk::sys::XdpStatistics::default();
/// // Not an AF_XDP socket: the kernel refuses, but the call is well-typed.
/// assert!(egret_dataplane::xsk::sys::get_opt(sock.as_fd(), egret_dataplane::xsk::sys::XDP_STATISTICS, &mut st).is_err());
/// ```
pub unsafe trait Pod: Copy + sealed::Sealed {}

mod sealed {
    /// Keeps [`super::Pod`] implemented only here.
    pub trait Sealed {}
}

macro_rules! pod {
    ($($t:ty),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        // SAFETY: a primitive integer or a `#[repr(C)]` struct of `u16`,
        // `u32` and `u64` fields laid out without padding (its size equals
        // the sum of its fields, asserted above), so every bit pattern is a
        // valid value and no byte is uninitialised.
        unsafe impl Pod for $t {}
    )*};
}
pod!(u32, i32, u64, SockaddrXdp, XdpUmemReg, XdpRingOffset, XdpMmapOffsets, XdpDesc, XdpStatistics);

/// `setsockopt(fd, SOL_XDP, opt, &value, sizeof value)` for a plain-data value.
pub fn set_opt<T: Pod>(fd: BorrowedFd<'_>, opt: libc::c_int, value: &T) -> io::Result<()> {
    let len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` points to `len` readable, initialised bytes (`T: Pod`
    // has no padding) for the duration of the call; the kernel copies them
    // and keeps no pointer.
    cvt(unsafe { libc::setsockopt(fd.as_raw_fd(), SOL_XDP, opt, (value as *const T).cast(), len) }).map(drop)
}

/// `getsockopt(fd, SOL_XDP, opt, &mut value, &len)`; returns how many bytes
/// the kernel wrote (it may know a shorter, older layout; the rest of
/// `value` keeps what the caller put there).
pub fn get_opt<T: Pod>(fd: BorrowedFd<'_>, opt: libc::c_int, value: &mut T) -> io::Result<usize> {
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `value` points to `len` writable bytes of a `Pod` type, for
    // which every bit pattern the kernel may write is a valid value, and
    // `len` is a valid in/out length: the kernel writes at most `len` bytes.
    cvt(unsafe { libc::getsockopt(fd.as_raw_fd(), SOL_XDP, opt, (value as *mut T).cast(), &mut len) })?;
    Ok(len as usize)
}

/// `bind(fd, sockaddr_xdp)`.
pub fn bind(fd: BorrowedFd<'_>, addr: &SockaddrXdp) -> io::Result<()> {
    // SAFETY: `addr` is a valid `sockaddr_xdp` of the given length; the
    // kernel copies it.
    cvt(unsafe {
        libc::bind(fd.as_raw_fd(), (addr as *const SockaddrXdp).cast(), size_of::<SockaddrXdp>() as libc::socklen_t)
    })
    .map(drop)
}

/// The TX kick: `sendto(fd, NULL, 0, MSG_DONTWAIT, NULL, 0)`. In copy mode
/// this is what transmits (at most the socket's TX skb budget per call).
pub fn kick_tx(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: a zero-length send with null buffer and address is the
    // documented AF_XDP wakeup; the kernel dereferences neither.
    let ret = unsafe { libc::sendto(fd.as_raw_fd(), std::ptr::null(), 0, libc::MSG_DONTWAIT, std::ptr::null(), 0) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// The RX/fill wakeup: `recvfrom(fd, NULL, 0, MSG_DONTWAIT, NULL, NULL)`.
/// Needed only by zero-copy drivers that set `XDP_RING_NEED_WAKEUP` on the
/// fill ring; a no-op in copy mode.
pub fn kick_rx(fd: BorrowedFd<'_>) -> io::Result<()> {
    // SAFETY: as for `kick_tx`: zero length, null buffer and address.
    let ret = unsafe {
        libc::recvfrom(
            fd.as_raw_fd(),
            std::ptr::null_mut(),
            0,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// `poll(fds, timeout_ms)`; `EINTR` counts as a timeout (returns 0).
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: libc::c_int) -> io::Result<usize> {
    // SAFETY: `fds` is a valid, exclusively borrowed array of `fds.len()`
    // pollfd structs for the duration of the call.
    let ret = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if ret < 0 {
        let err = io::Error::last_os_error();
        if err.kind() == io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(err);
    }
    Ok(ret as usize)
}

/// An anonymous or file-backed shared mapping, unmapped on drop.
#[derive(Debug)]
pub struct Mmap {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; moving the owner
// to another thread moves the right to touch it. Concurrent access rules are
// enforced by the types built on top (rings, UMEM), not by `Mmap`.
unsafe impl Send for Mmap {}

impl Mmap {
    /// A private anonymous mapping of `len` bytes, prefaulted (the UMEM).
    pub fn anonymous(len: usize) -> io::Result<Self> {
        // SAFETY: a fresh anonymous mapping aliases nothing; the result is
        // checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        Self::from_raw(ptr, len)
    }

    /// A shared mapping of one of an AF_XDP socket's rings.
    pub fn ring(fd: BorrowedFd<'_>, len: usize, pgoff: libc::off_t) -> io::Result<Self> {
        // SAFETY: mapping a kernel ring creates new memory that aliases no
        // Rust object; the result is checked for MAP_FAILED.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                pgoff,
            )
        };
        Self::from_raw(ptr, len)
    }

    fn from_raw(ptr: *mut libc::c_void, len: usize) -> io::Result<Self> {
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        match std::ptr::NonNull::new(ptr.cast::<u8>()) {
            Some(ptr) => Ok(Self { ptr, len }),
            None => Err(io::Error::from(io::ErrorKind::InvalidData)),
        }
    }

    /// Base address of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: mmap refuses length 0).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for Mmap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` describe a mapping this value created and
        // owns; every reference into it borrows from its owner, so none
        // outlives this call.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}
