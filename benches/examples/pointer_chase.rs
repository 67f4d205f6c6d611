//! Memory latency probe behind docs/adr/0006-fast-path-session-table.md: a
//! pointer chase through one 64-byte line per step, in random order. Run it
//! pinned to the gateway core:
//!
//! ```sh
//! cargo build --release -p egret-benches --example pointer_chase
//! taskset -c 1 target/release/examples/pointer_chase [huge]
//! taskset -c 1 target/release/examples/pointer_chase table
//! ```
//!
//! - Without an argument (or with `huge`): every line of working sets from 1
//!   to 256 MiB, with 4 KiB pages (or transparent huge pages asked for).
//! - `table`: the fast path's situation, a few thousand hot lines scattered
//!   over a 16 or 64 MiB table, in three kinds of memory: a `BPF_F_MMAPABLE`
//!   array map like `fp_sessions_v4` (the kernel allocates it with vmalloc,
//!   4 KiB pages), anonymous memory with huge pages refused, and with them
//!   asked for. Needs root (the map).
#![allow(clippy::print_stdout, unsafe_code)]

use std::time::Instant;

const LINE: usize = 64;
const STEPS: usize = 4_000_000;

/// An anonymous private mapping of `bytes`, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    bytes: usize,
}

impl Mapping {
    fn new(bytes: usize, huge: bool) -> Option<Self> {
        Self::anonymous(bytes, if huge { libc::MADV_HUGEPAGE } else { 0 })
    }

    /// Anonymous memory with `advice` (0 for none), every page touched.
    fn anonymous(bytes: usize, advice: libc::c_int) -> Option<Self> {
        // SAFETY: a fresh anonymous mapping at an address the kernel picks;
        // nothing existing is replaced. Checked before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        if advice != 0 {
            // SAFETY: advice on exactly the mapping just created.
            unsafe { libc::madvise(p, bytes, advice) };
        }
        Some(Self { ptr: p.cast(), bytes })
    }

    /// A `BPF_F_MMAPABLE` array map of 64-byte values, `bytes` long, mapped
    /// shared. The map's fd is closed once mapped: the mapping keeps the map.
    fn bpf_array(bytes: usize) -> Option<Self> {
        // union bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size,
        // max_entries, map_flags (include/uapi/linux/bpf.h).
        const BPF_MAP_CREATE: libc::c_long = 0;
        const BPF_MAP_TYPE_ARRAY: u32 = 2;
        const BPF_F_MMAPABLE: u32 = 1 << 10;
        let mut attr = [0u32; 32];
        attr[..5].copy_from_slice(&[
            BPF_MAP_TYPE_ARRAY,
            4,
            LINE as u32,
            u32::try_from(bytes / LINE).ok()?,
            BPF_F_MMAPABLE,
        ]);
        // SAFETY: bpf(2) reads `size_of_val(&attr)` bytes of the zeroed
        // attribute block, which lives across the call.
        let fd =
            unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, attr.as_mut_ptr(), std::mem::size_of_val(&attr)) };
        let fd = libc::c_int::try_from(fd).ok().filter(|fd| *fd >= 0)?;
        // SAFETY: maps the whole value area of the map just created (its
        // size is a whole number of pages); checked before use.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        // SAFETY: closes the fd created above; the mapping holds the map.
        unsafe { libc::close(fd) };
        (p != libc::MAP_FAILED).then(|| Self { ptr: p.cast(), bytes })
    }

    /// The mapping as lines of `usize` words (zeroed by the kernel).
    fn words(&mut self) -> &mut [usize] {
        // SAFETY: the mapping is `bytes` long, page-aligned, readable and
        // writable, exclusively borrowed through `self`, and lives until drop.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<usize>(), self.bytes / 8) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `new` mapped; no borrow outlives self.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

/// A random permutation of `0..n` (xorshift Fisher-Yates, fixed seed).
fn shuffled(n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    order
}

/// Links `lines` (line numbers) into one cycle through the mapping and
/// returns the mean ns per step of a chase around it.
fn chase(m: &mut Mapping, lines: &[usize]) -> f64 {
    let words_per_line = LINE / 8;
    let w = m.words();
    for (i, l) in lines.iter().enumerate() {
        w[l * words_per_line] = lines[(i + 1) % lines.len()] * words_per_line;
    }
    let mut at = lines[0] * words_per_line;
    for _ in 0..lines.len() {
        at = w[at];
    }
    let t = Instant::now();
    for _ in 0..STEPS {
        at = w[at];
    }
    let ns = t.elapsed().as_nanos() as f64 / STEPS as f64;
    std::hint::black_box(at);
    ns
}

/// `table` mode: hot lines scattered over a table, per kind of memory.
fn table() {
    for mib in [16usize, 64] {
        let bytes = mib << 20;
        let all = shuffled(bytes / LINE);
        let kinds: [(&str, Option<Mapping>); 3] = [
            ("BPF array map", Mapping::bpf_array(bytes)),
            ("4 KiB pages", Mapping::anonymous(bytes, libc::MADV_NOHUGEPAGE)),
            ("huge pages asked", Mapping::anonymous(bytes, libc::MADV_HUGEPAGE)),
        ];
        for (kind, m) in kinds {
            let Some(mut m) = m else {
                println!("{mib:>3} MiB table, {kind}: not available (root needed for the map)");
                continue;
            };
            for hot in [4_000usize, 12_500, 50_000] {
                let ns = chase(&mut m, &all[..hot]);
                println!("{mib:>3} MiB table, {kind:<16} {hot:>6} hot lines: {ns:6.1} ns per line");
            }
        }
    }
}

fn main() {
    let arg = std::env::args().nth(1);
    if arg.as_deref() == Some("table") {
        return table();
    }
    let huge = arg.as_deref() == Some("huge");
    for mib in [1usize, 2, 3, 4, 8, 16, 64, 256] {
        let bytes = mib << 20;
        let lines = bytes / LINE;
        let Some(mut m) = Mapping::new(bytes, huge) else {
            println!("{mib:>4} MiB: mmap failed");
            continue;
        };
        let ns = chase(&mut m, &shuffled(lines));
        println!("{mib:>4} MiB: {ns:6.1} ns per line{}", if huge { ", huge pages asked" } else { "" });
    }
}
