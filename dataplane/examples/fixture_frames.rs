//! Writes every frame of the scenario fixture table into a directory, one
//! file per frame, prefixed with the byte the fuzz target reads as its control
//! byte (ingress interface): the fuzzer's seed corpus of real packets. Each
//! whole datagram longer than 64 bytes is written a second time with bit 6
//! set (the differential target feeds it as a fragment train, last first),
//! and each frame from the pods' side once more as the fixture's tunnel node
//! sends it (`fixtures::tunnelled`: VXLAN to the egress IP of its family).
//!
//! `cargo run -p egret-dataplane --features fixtures --example fixture_frames -- DIR`

use std::path::PathBuf;

use egret_dataplane::fixtures;

fn main() -> std::io::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "dataplane/fuzz/corpus/engine".into()));
    std::fs::create_dir_all(&dir)?;
    let mut n = 0;
    for s in fixtures::scenarios() {
        for (i, st) in s.steps.iter().enumerate() {
            let mut bytes = vec![if st.ingress == fixtures::INSIDE { 0u8 } else { 1u8 }];
            bytes.extend_from_slice(&st.frame);
            if fixtures::build::refragment(&st.frame, 32, 1).is_some() {
                let mut train = bytes.clone();
                train[0] |= 0x40;
                std::fs::write(dir.join(format!("{}-{i:02}-reversed", s.name)), train)?;
                n += 1;
            }
            std::fs::write(dir.join(format!("{}-{i:02}", s.name)), bytes)?;
            n += 1;
            if st.ingress == fixtures::INSIDE {
                if let Some(t) = fixtures::tunnelled(&st.frame, i as u16) {
                    let mut bytes = vec![0u8];
                    bytes.extend_from_slice(&t);
                    std::fs::write(dir.join(format!("{}-{i:02}-tunnelled", s.name)), bytes)?;
                    n += 1;
                }
            }
        }
    }
    eprintln!("wrote {n} seed frames to {}", dir.display());
    Ok(())
}
