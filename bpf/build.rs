//! Builds the XDP steering program (`src/bpf/steer.bpf.c`) with clang through
//! libbpf-cargo, keeps the object for the loader (`OUT_DIR/steer.bpf.o`) and
//! generates the skeleton (`OUT_DIR/steer.skel.rs`), whose BTF-derived types
//! the layout tests in `src/maps.rs` compare with the Rust twins.

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

    SkeletonBuilder::new()
        .source(SOURCE)
        .obj(out_dir.join("steer.bpf.o"))
        .clang_args([
            // Debian keeps <asm/types.h> under the multiarch directory.
            "-I/usr/include/x86_64-linux-gnu",
            "-Wall",
            "-Wextra",
            "-Wno-unused-parameter",
        ])
        .build_and_generate(out_dir.join("steer.skel.rs"))
        .map_err(|e| format!("building {SOURCE} failed (needs clang, libelf-dev, zlib1g-dev): {e:#}"))?;
    Ok(())
}
