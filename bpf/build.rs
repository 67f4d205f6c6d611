//! Builds the XDP steering program (`src/bpf/steer.bpf.c`) with clang through
//! libbpf-cargo, keeps the object for the loader (`OUT_DIR/steer.bpf.o`) and
//! generates the skeleton (`OUT_DIR/steer.skel.rs`), whose BTF-derived types
//! the layout tests in `src/maps.rs` compare with the Rust twins. A second
//! object, `OUT_DIR/steer_fib.bpf.o`, is the fast path's measurement variant
//! (`-DEGRET_FP_FIB_LOOKUP`: next hops from `bpf_fib_lookup`), used only by
//! tests (docs/adr/0005-xdp-fast-path.md); `steer_fib_apache.bpf.o` is the
//! same with the gateway's licence string, which the kernel must refuse.

use std::env;
use std::error::Error;
use std::fs;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const SOURCE: &str = "src/bpf/steer.bpf.c";

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("cargo did not set OUT_DIR")?);

    // Rebuild when any C source or header changes, not only the entry point.
    println!("cargo:rerun-if-changed=src/bpf");
    for entry in fs::read_dir("src/bpf")? {
        println!("cargo:rerun-if-changed={}", entry?.path().display());
    }

    // Debian keeps <asm/types.h> under the multiarch directory
    // (x86_64-linux-gnu, aarch64-linux-gnu).
    let multiarch = format!("-I/usr/include/{}-linux-gnu", env::var("CARGO_CFG_TARGET_ARCH")?);
    let args = [multiarch.as_str(), "-Wall", "-Wextra", "-Wno-unused-parameter"];
    SkeletonBuilder::new()
        .source(SOURCE)
        .obj(out_dir.join("steer.bpf.o"))
        .clang_args(args)
        .build_and_generate(out_dir.join("steer.skel.rs"))
        .map_err(|e| format!("building {SOURCE} failed (needs clang, libelf-dev, zlib1g-dev): {e:#}"))?;
    SkeletonBuilder::new()
        .source(SOURCE)
        .obj(out_dir.join("steer_fib.bpf.o"))
        .clang_args(args.iter().copied().chain(["-DEGRET_FP_FIB_LOOKUP"]))
        .build()
        .map_err(|e| format!("building {SOURCE} (fib lookup variant) failed: {e:#}"))?;
    SkeletonBuilder::new()
        .source(SOURCE)
        .obj(out_dir.join("steer_fib_apache.bpf.o"))
        .clang_args(args.iter().copied().chain(["-DEGRET_FP_FIB_LOOKUP", "-DEGRET_FP_FIB_APACHE_LICENSE"]))
        .build()
        .map_err(|e| format!("building {SOURCE} (fib lookup variant, Apache licence string) failed: {e:#}"))?;
    Ok(())
}
