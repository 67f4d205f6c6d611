//! Memory latency probe behind docs/adr/0006-fast-path-session-table.md: a
//! pointer chase through one 64-byte line per step, in random order, over
//! working sets from 1 to 256 MiB, with 4 KiB pages and (with `huge`) with
//! transparent huge pages asked for. Run it pinned to the gateway core:
//!
//! ```sh
//! cargo build --release -p egret-benches --example pointer_chase
//! taskset -c 1 target/release/examples/pointer_chase [huge]
//! ```
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
        if huge {
            // SAFETY: advice on exactly the mapping just created.
            unsafe { libc::madvise(p, bytes, libc::MADV_HUGEPAGE) };
        }
        Some(Self { ptr: p.cast(), bytes })
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

fn main() {
    let huge = std::env::args().nth(1).as_deref() == Some("huge");
    let words_per_line = LINE / 8;
    for mib in [1usize, 2, 3, 4, 8, 16, 64, 256] {
        let bytes = mib << 20;
        let lines = bytes / LINE;
        let Some(mut m) = Mapping::new(bytes, huge) else {
            println!("{mib:>4} MiB: mmap failed");
            continue;
        };
        // A random cyclic order of the lines (xorshift Fisher-Yates).
        let mut order: Vec<usize> = (0..lines).collect();
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in (1..lines).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            order.swap(i, (x % (i as u64 + 1)) as usize);
        }
        let w = m.words();
        for i in 0..lines {
            w[order[i] * words_per_line] = order[(i + 1) % lines] * words_per_line;
        }
        let mut at = order[0] * words_per_line;
        for _ in 0..lines {
            at = w[at];
        }
        let t = Instant::now();
        for _ in 0..STEPS {
            at = w[at];
        }
        let ns = t.elapsed().as_nanos() as f64 / STEPS as f64;
        println!("{mib:>4} MiB: {ns:6.1} ns per line{}  (end {at})", if huge { ", huge pages asked" } else { "" });
    }
}
