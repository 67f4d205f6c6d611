//! Map operations on fixed-size keys and values without allocation, keeping
//! the kernel's errno (libbpf-rs folds `E2BIG`, "map full", into a generic
//! kind). Used for the fast path's session maps, where the daemon must tell
//! a full map (the session stays in userspace, counted) from a failure, and
//! where a lookup per expiry check should not allocate.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `bpf_map_update_elem`: `flags` is `BPF_ANY`, `BPF_NOEXIST` or `BPF_EXIST`.
/// The caller passes a key and a value of exactly the map's sizes.
pub(crate) fn update(fd: BorrowedFd<'_>, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
    // SAFETY: `key` and `value` are live slices for the call and, as the
    // callers guarantee, exactly the map's key and value sizes, so the
    // kernel reads only within them; `fd` is a borrowed, open map fd.
    let rc = unsafe {
        libbpf_sys::bpf_map_update_elem(
            fd.as_raw_fd(),
            key.as_ptr().cast::<c_void>(),
            value.as_ptr().cast::<c_void>(),
            flags,
        )
    };
    if rc < 0 {
        return Err(io::Error::from_raw_os_error(-rc));
    }
    Ok(())
}

/// `bpf_map_lookup_elem` into `out` (exactly the value size). Returns
/// whether the key was present.
pub(crate) fn lookup(fd: BorrowedFd<'_>, key: &[u8], out: &mut [u8]) -> io::Result<bool> {
    // SAFETY: as in `update`; `out` is a live, writable slice of exactly the
    // map's value size, the only memory the kernel writes.
    let rc = unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            fd.as_raw_fd(),
            key.as_ptr().cast::<c_void>(),
            out.as_mut_ptr().cast::<c_void>(),
        )
    };
    match rc {
        0 => Ok(true),
        e if -e == libc::ENOENT => Ok(false),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

/// The kernel's CLOCK_MONOTONIC in nanoseconds: the clock of
/// `bpf_ktime_get_ns` and `bpf_ktime_get_coarse_ns`, whose stamps the fast
/// path leaves in its entries.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call; CLOCK_MONOTONIC
    // is always available on Linux, so the call cannot fail.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// A `BPF_F_MMAPABLE` array map's values, mapped shared into this process
/// and seen as 64-bit words. Every access goes through the atomics: the
/// program reads and writes the same memory concurrently.
#[derive(Debug)]
pub(crate) struct MappedArray {
    ptr: std::ptr::NonNull<std::sync::atomic::AtomicU64>,
    bytes: usize,
}

// SAFETY: the mapping is process-wide shared memory accessed only through
// `AtomicU64`s (which are Sync); the pointer is not tied to a thread.
unsafe impl Send for MappedArray {}
// SAFETY: as above: `&MappedArray` only hands out `&[AtomicU64]`.
unsafe impl Sync for MappedArray {}

impl MappedArray {
    /// Maps `bytes` (a whole number of pages, the map's value size times its
    /// entries) of the array map `fd`, read-write.
    pub(crate) fn map(fd: BorrowedFd<'_>, bytes: usize) -> io::Result<Self> {
        if bytes == 0 || !bytes.is_multiple_of(4096) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh shared mapping chosen by the kernel (no address
        // hint, so nothing existing is replaced) of an open map fd; the
        // result is checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = std::ptr::NonNull::new(p.cast::<std::sync::atomic::AtomicU64>())
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EFAULT))?;
        Ok(Self { ptr, bytes })
    }
}

impl AsRef<[std::sync::atomic::AtomicU64]> for MappedArray {
    fn as_ref(&self) -> &[std::sync::atomic::AtomicU64] {
        // SAFETY: the mapping is `bytes` long, page-aligned (so aligned for
        // AtomicU64), lives until `drop`, and is only ever accessed through
        // atomics, which makes concurrent writes by the kernel sound.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes / 8) }
    }
}

impl Drop for MappedArray {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `map` created; no reference
        // into it outlives `self` (they borrow it).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast::<c_void>(), self.bytes);
        }
    }
}
