//! Compiles the throughput benchmark's XDP programs (`xdp/*.bpf.c`: the
//! generator, the redirect ceiling, the sink counter and the kernel modes'
//! pass-everything program on gwout) with clang through
//! libbpf-cargo into `OUT_DIR/<name>.bpf.o`, which `src/xdp.rs` embeds and
//! loads with libbpf-rs.

use std::env;
use std::error::Error;
use std::path::PathBuf;

use libbpf_cargo::SkeletonBuilder;

const PROGRAMS: [&str; 4] = ["gen", "redirect", "sink", "pass"];

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("cargo did not set OUT_DIR")?);
    println!("cargo:rerun-if-changed=xdp/bench_common.h");
    // Debian keeps <asm/types.h> under the multiarch directory
    // (x86_64-linux-gnu, aarch64-linux-gnu).
    let multiarch = format!("-I/usr/include/{}-linux-gnu", env::var("CARGO_CFG_TARGET_ARCH")?);
    for name in PROGRAMS {
        let source = format!("xdp/{name}.bpf.c");
        println!("cargo:rerun-if-changed={source}");
        SkeletonBuilder::new()
            .source(&source)
            .obj(out_dir.join(format!("{name}.bpf.o")))
            .clang_args([multiarch.as_str(), "-Wall", "-Wextra", "-Wno-unused-parameter"])
            .build()
            .map_err(|e| format!("building {source} failed (needs clang, libelf-dev, zlib1g-dev): {e:#}"))?;
    }
    Ok(())
}
