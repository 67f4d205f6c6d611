//! Slices that the kernel may back with 2 MiB transparent huge pages.
//!
//! A million sessions' slots are 48 MB read at random: with 4 KiB pages
//! each slot a packet reads is also a TLB miss and a page walk whose
//! entries miss the caches too. [`HugeSlice`] allocates a slice of one
//! 2 MiB page on a 2 MiB boundary and asks for a huge page
//! (`madvise(MADV_HUGEPAGE)`) before its first touch, so one TLB entry covers 43,690 IPv4 slots instead of 85
//! (docs/benchmarks.md, "Session slots on huge pages"; ADR 0038).
//!
//! Where the kernel's THP mode is `madvise` (this machine's) only memory
//! asked for this way gets huge pages. `always` (Debian 12's kernel) would
//! give them unasked, but only to a 2 MiB-aligned range whose whole mapping
//! exists at its first touch, which a slice allocated and filled at once
//! rarely is (khugepaged may merge some later). `never`, or a kernel without THP, ignores the request and the
//! slice is an ordinary one. The memory is the global allocator's (counted
//! by whatever counts it), only aligned and advised.

use std::alloc::{self, Layout};
use std::ops::Deref;
use std::ptr::NonNull;

/// The huge page size this asks for (x86-64 and arm64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// As many `T`s as one huge page holds ([`HugeSlice::PER_PAGE`]), in one
/// 2 MiB-aligned allocation of 2 MiB asked to be one huge page (the session
/// slab's chunk: 43,690 IPv4 slots, 2,097,120 of the 2,097,152 bytes).
/// Dereferences to `[T]`; never grows.
pub struct HugeSlice<T> {
    ptr: NonNull<T>,
    /// Whether `madvise` accepted the request (`false` where the kernel
    /// refused it: no THP).
    advised: bool,
}

// SAFETY: a `HugeSlice<T>` owns its `T`s as a `Box<[T]>` does; sending or
// sharing it sends or shares them, which `T`'s own `Send`/`Sync` allow.
#[allow(unsafe_code)]
unsafe impl<T: Send> Send for HugeSlice<T> {}
// SAFETY: as above; `&HugeSlice<T>` only gives out `&[T]`.
#[allow(unsafe_code)]
unsafe impl<T: Sync> Sync for HugeSlice<T> {}

/// The one allocation every `HugeSlice` makes.
const PAGE: Layout = match Layout::from_size_align(HUGE_PAGE, HUGE_PAGE) {
    Ok(l) => l,
    Err(_) => panic!("2 MiB is a valid size and alignment"),
};

impl<T> HugeSlice<T> {
    /// How many `T`s one huge page holds (a compile-time error for a `T`
    /// of size zero, larger than a page, or aligned beyond one).
    pub const PER_PAGE: usize = {
        assert!(size_of::<T>() > 0 && size_of::<T>() <= HUGE_PAGE && align_of::<T>() <= HUGE_PAGE);
        HUGE_PAGE / size_of::<T>()
    };

    /// A page of `T`s, element `i` made by `init(i)`. Allocation failure
    /// ends the process, as it does for `Box` and `Vec`.
    pub fn page(mut init: impl FnMut(usize) -> T) -> Self {
        #[allow(unsafe_code)]
        // SAFETY: `PAGE` has a non-zero size.
        let raw = unsafe { alloc::alloc(PAGE) };
        let Some(ptr) = NonNull::new(raw.cast::<T>()) else { alloc::handle_alloc_error(PAGE) };
        // Before the first write: the page is faulted in as a huge one.
        let advised = advise_huge(raw, HUGE_PAGE);
        for i in 0..Self::PER_PAGE {
            #[allow(unsafe_code)]
            // SAFETY: `i < PER_PAGE`: inside the page.
            let at = unsafe { ptr.add(i) };
            #[allow(unsafe_code)]
            // SAFETY: `at` is inside the page, at `T`'s alignment (the
            // page's is larger); each element is written once, before any
            // is read.
            unsafe {
                at.write(init(i));
            }
        }
        HugeSlice { ptr, advised }
    }

    /// Whether the kernel accepted the request for a huge page (tests; the
    /// page itself is its to give: /proc/self/smaps).
    pub fn advised(&self) -> bool {
        self.advised
    }
}

/// `madvise(MADV_HUGEPAGE)` over `len` bytes at `p` (huge-page aligned).
fn advise_huge(p: *mut u8, len: usize) -> bool {
    #[allow(unsafe_code)]
    // SAFETY: `p..p + len` is one live allocation of ours; MADV_HUGEPAGE
    // changes only how its pages are backed, never their contents.
    let rc = unsafe { libc::madvise(p.cast::<libc::c_void>(), len, libc::MADV_HUGEPAGE) };
    rc == 0
}

impl<T> Deref for HugeSlice<T> {
    type Target = [T];

    #[inline(always)]
    fn deref(&self) -> &[T] {
        #[allow(unsafe_code)]
        // SAFETY: `ptr` holds `PER_PAGE` initialised `T`s, owned by `self`.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr(), Self::PER_PAGE)
        }
    }
}

impl<T> Drop for HugeSlice<T> {
    fn drop(&mut self) {
        let elements = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), Self::PER_PAGE);
        #[allow(unsafe_code)]
        // SAFETY: the elements were initialised in `page` and are dropped
        // once, here.
        unsafe {
            std::ptr::drop_in_place(elements);
        }
        #[allow(unsafe_code)]
        // SAFETY: the memory was allocated in `page` with `PAGE`.
        unsafe {
            alloc::dealloc(self.ptr.as_ptr().cast::<u8>(), PAGE);
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for HugeSlice<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeSlice")
            .field("len", &Self::PER_PAGE)
            .field("advised", &self.advised)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// The `VmFlags` line of the mapping in /proc/self/smaps that holds `p`.
    fn vm_flags(p: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((a, b)) = range.split_once('-') {
                    if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                        inside = (a..b).contains(&p);
                        continue;
                    }
                }
            }
            if inside && line.starts_with("VmFlags:") {
                return Some(line.to_string());
            }
        }
        None
    }

    #[test]
    fn a_page_is_aligned_and_advised() {
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        let s = HugeSlice::page(|i| i as u64);
        assert_eq!(s.len(), HUGE_PAGE / 8);
        assert!(s.iter().enumerate().all(|(i, &v)| v == i as u64), "every element as made");
        assert_eq!(s.as_ptr() as usize % HUGE_PAGE, 0, "on a huge-page boundary");
        if !thp.contains("[never]") && !thp.is_empty() {
            assert!(s.advised(), "madvise(MADV_HUGEPAGE) accepted (THP: {thp:?})");
            // The kernel marks the mapping `hg` (VM_HUGEPAGE).
            let flags = vm_flags(s.as_ptr() as usize).expect("the slice's mapping in /proc/self/smaps");
            assert!(flags.split_whitespace().any(|f| f == "hg"), "{flags}");
        }
    }

    #[test]
    fn every_element_is_dropped_once() {
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        struct Counted([u64; 6]);
        impl Drop for Counted {
            fn drop(&mut self) {
                DROPS.fetch_add(1, Ordering::Relaxed);
            }
        }
        let s = HugeSlice::page(|i| Counted([i as u64; 6]));
        assert_eq!((HugeSlice::<Counted>::PER_PAGE, s.len()), (43_690, 43_690), "48-byte elements, as IPv4 slots");
        assert_eq!(s[43_689].0[5], 43_689);
        drop(s);
        assert_eq!(DROPS.load(Ordering::Relaxed), 43_690);
    }
}
