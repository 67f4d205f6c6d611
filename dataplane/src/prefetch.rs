//! A cache-line prefetch hint: the one CPU instruction a batch uses to ask
//! for the lines its later frames will touch while it works on earlier ones
//! (as VPP's graph nodes do). A hint only: it never faults, reads nothing
//! into the program, and is dropped by the CPU when it has no room.

/// Asks for the cache line holding `*r` (no-op where the target has no
/// stable prefetch instruction).
#[inline(always)]
pub fn read<T>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: PREFETCHT0 is a hint: it accesses no memory architecturally
    // and cannot fault, and `r` is a valid reference anyway.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(std::ptr::from_ref(r).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}

/// Asks for the cache line holding the byte at `p`, any address (a table's
/// bucket computed ahead of the lock that will write it; a stale or
/// dangling address costs a wasted fetch, never a fault).
#[inline(always)]
pub fn addr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    #[allow(unsafe_code)]
    // SAFETY: PREFETCHT0 is a hint: it accesses no memory architecturally
    // and cannot fault, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}
