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

/// `bpf_map_delete_elem`. Returns whether the key was present.
pub(crate) fn delete(fd: BorrowedFd<'_>, key: &[u8]) -> io::Result<bool> {
    // SAFETY: as in `update`: `key` is a live slice of the map's key size.
    let rc = unsafe { libbpf_sys::bpf_map_delete_elem(fd.as_raw_fd(), key.as_ptr().cast::<c_void>()) };
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
