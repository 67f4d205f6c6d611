//! Fuzzes the engine's entry point with whole frames.
//!
//! The engine is set up as in the scenario fixtures (two policies, three
//! egress IPs, the fixture topology) and warmed with every fixture frame, so
//! mutated inputs hit live sessions, mappings and fragment entries. The first
//! input byte picks the receiving interface and a clock offset; the rest is
//! the frame. Any panic is a bug: no panic may be reachable from packet bytes.
#![no_main]

use std::sync::OnceLock;

use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, RxMeta};
use egret_dataplane::fixtures;
use egret_dataplane::nat::port_alloc::PortRng;
use libfuzzer_sys::fuzz_target;
use std::sync::Mutex;

static STATE: OnceLock<Mutex<(Engine, egret_dataplane::engine::Pipeline)>> = OnceLock::new();

fn state() -> &'static Mutex<(Engine, egret_dataplane::engine::Pipeline)> {
    STATE.get_or_init(|| {
        let engine = Engine::new(&fixtures::base_spec()).expect("fixture spec");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(7));
        for s in fixtures::scenarios() {
            for st in &s.steps {
                let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
                buf[..st.frame.len()].copy_from_slice(&st.frame);
                let meta = RxMeta { ifindex: st.ingress, checksum: ChecksumHint::Unknown };
                let _ = w.process(&mut buf, st.frame.len(), meta, Timestamp::from_secs(st.at));
            }
        }
        Mutex::new((engine, w))
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctl, frame)) = data.split_first() else { return };
    if frame.len() > fixtures::FRAME_BUFFER {
        return;
    }
    let ingress = if ctl & 1 == 0 { fixtures::INSIDE } else { fixtures::OUTSIDE };
    let checksum = match (ctl >> 1) & 3 {
        0 => ChecksumHint::Unknown,
        1 => ChecksumHint::Partial,
        _ => ChecksumHint::Complete,
    };
    let at = u64::from(ctl >> 3) * 7;
    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
    buf[..frame.len()].copy_from_slice(frame);
    let mut guard = match state().lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    };
    let (_, w) = &mut *guard;
    let _ = w.process(&mut buf, frame.len(), RxMeta { ifindex: ingress, checksum }, Timestamp::from_secs(at));
    if ctl == 0xff {
        let _ = w.tick(Timestamp::from_secs(at), 64);
    }
});
