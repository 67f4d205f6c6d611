//! Map operations on fixed-size keys and values without allocation, keeping
//! the kernel's errno (libbpf-rs folds `E2BIG`, "map full", into a generic
//! kind). Used for the fast path's session maps, where the daemon must tell
//! a full map (the session stays in userspace, counted) from a failure, and
//! where a lookup per expiry check should not allocate.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};

use libbpf_rs::{MapCore, MapHandle};

/// `EINVAL` unless `got` bytes are exactly the map's `want`: the kernel reads
/// (and, for a lookup, writes) the map's sizes from the pointers it is
/// given whatever the caller's buffers hold, so a shorter buffer would be
/// read or written past its end.
fn check_size(what: &str, got: usize, want: u32) -> io::Result<()> {
    if usize::try_from(want).ok() != Some(got) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{what} of {got} bytes for a map whose {what} is {want} bytes"),
        ));
    }
    Ok(())
}

/// `bpf_map_update_elem`: `flags` is `BPF_ANY`, `BPF_NOEXIST` or `BPF_EXIST`.
/// A key or value of another size than the map's is refused (`InvalidInput`)
/// before the kernel is asked.
pub(crate) fn update(map: &MapHandle, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
    check_size("key", key.len(), map.key_size())?;
    check_size("value", value.len(), map.value_size())?;
    // SAFETY: `key` and `value` are live slices for the call of exactly the
    // map's key and value sizes (checked above), so the kernel reads only
    // within them; the fd is the handle's, open while `map` is borrowed.
    let rc = unsafe {
        libbpf_sys::bpf_map_update_elem(
            map.as_fd().as_raw_fd(),
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

/// `bpf_map_lookup_elem` into `out`. Returns whether the key was present.
/// A key or `out` of another size than the map's is refused
/// (`InvalidInput`) before the kernel is asked.
pub(crate) fn lookup(map: &MapHandle, key: &[u8], out: &mut [u8]) -> io::Result<bool> {
    check_size("key", key.len(), map.key_size())?;
    check_size("value", out.len(), map.value_size())?;
    // SAFETY: as in `update`; `out` is a live, writable slice of exactly the
    // map's value size (checked above), the only memory the kernel writes.
    let rc = unsafe {
        libbpf_sys::bpf_map_lookup_elem(
            map.as_fd().as_raw_fd(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use libbpf_rs::MapType;

    fn array(value_size: u32) -> MapHandle {
        let opts = libbpf_sys::bpf_map_create_opts {
            sz: std::mem::size_of::<libbpf_sys::bpf_map_create_opts>() as libbpf_sys::size_t,
            ..Default::default()
        };
        MapHandle::create(MapType::Array, Some("egret_raw_test"), 4, value_size, 2, &opts).expect("array map (root)")
    }

    /// A buffer shorter or longer than the map's sizes is refused before
    /// the kernel is asked: the kernel would read or write the map's size
    /// from the pointer, past a short buffer's end. The short slices here
    /// are cut from longer arrays, so the test itself stays sound on code
    /// that lets the call through (and then fails on the `Ok`). Needs root.
    #[test]
    fn sizes_other_than_the_maps_are_refused() {
        let map = array(8);
        let key = 1u32.to_ne_bytes();
        let mut buf = [0u8; 16];
        let err = lookup(&map, &key, &mut buf[..4]).expect_err("a 4-byte buffer for 8-byte values");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        assert_eq!(buf, [0; 16], "the kernel wrote nothing");
        let err = update(&map, &key, &buf[..4], 0).expect_err("a 4-byte value for 8-byte values");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
        let err = update(&map, &[1, 0], &buf[..8], 0).expect_err("a 2-byte key for 4-byte keys");
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");

        // The right sizes work.
        update(&map, &key, &7u64.to_ne_bytes(), 0).expect("update");
        let mut out = [0u8; 8];
        assert!(lookup(&map, &key, &mut out).expect("lookup"));
        assert_eq!(u64::from_ne_bytes(out), 7);
    }
}
