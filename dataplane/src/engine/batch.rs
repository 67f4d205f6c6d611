//! Staging a batch of frames (as VPP's graph nodes do): before any frame of
//! a batch is processed, the lines each will wait for are requested, so the
//! waits overlap instead of being paid one frame after another.
//!
//! 1. [`Pipeline::prefetch_flow`] for every frame: read the IPv4 5-tuple,
//!    prefetch the worker's flow-cache entry for it.
//! 2. [`Pipeline::prefetch_session`] for every frame: read that entry and
//!    prefetch the session slot it names; an empty entry (a flow this
//!    worker has not seen) has the session index's lines for the key
//!    prefetched instead, where `process` will ask.
//! 3. [`Pipeline::prefetch_lookup`] for every frame whose entry named a
//!    slot: read the slot (its line asked for in stage 2) and, when it
//!    holds another flow (an entry shared with another flow, or a new flow
//!    whose entry still names an ended session), prefetch the session
//!    map's lines for the key.
//! 4. [`Pipeline::process`] for every frame, as without staging.
//!
//! Stages 1 to 3 change nothing and decide nothing: a frame they cannot
//! read, or an entry that is stale, only goes unprefetched, and `process`
//! judges it in full. With few sessions everything is in cache and the
//! stages are pure overhead: [`Pipeline::staging_pays`] says when to use them.

use std::net::Ipv4Addr;

use super::Pipeline;
use crate::nat::flow_cache::Probe;
use crate::nat::key::{proto, FlowKey};
use crate::wire::ethernet;

/// What stage 1 found for a frame: the flow-cache entry to read in stage 2
/// and the key the later stages look for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Staged(Option<(Probe, FlowKey<Ipv4Addr>)>);

/// What a stage asked the memory for (its tests check that each frame's
/// lines are the ones `process` will read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Asked {
    /// Nothing: no key, or nothing more to ask.
    Nothing,
    /// The session slot the flow-cache entry names.
    Slot,
    /// The session index's lines for the key.
    MapLines,
}

/// Below this many IPv4 sessions the session slots fit in the caches and
/// staging costs more than it saves (docs/benchmarks.md, "Batches staged").
pub const STAGING_MIN_SESSIONS: usize = 16 * 1024;

impl Pipeline {
    /// Whether staging a batch is worth its cost now (enough sessions that
    /// their slots miss the caches).
    #[inline]
    pub fn staging_pays(&self) -> bool {
        self.shared.nat4.sessions.len() >= STAGING_MIN_SESSIONS
    }

    /// Stage 1: prefetches the flow-cache entry of an untagged IPv4 TCP or
    /// UDP frame (no options, not a fragment); anything else is left to
    /// `process` unstaged.
    #[inline]
    pub fn prefetch_flow(&self, frame: &[u8]) -> Staged {
        Staged(flow_key_v4(frame).map(|key| (self.flows.v4.prefetch(&key), key)))
    }

    /// Stage 2: prefetches the session slot the entry found in stage 1
    /// names; for an empty entry, the session index's lines of the key.
    #[inline]
    pub fn prefetch_session(&self, staged: Staged) -> Asked {
        let Some((i, key)) = staged.0 else { return Asked::Nothing };
        let sessions = &self.shared.nat4.sessions;
        match self.flows.v4.get_at(i) {
            Some(r) => {
                sessions.prefetch(r);
                Asked::Slot
            }
            None => {
                sessions.prefetch_key(&key);
                Asked::MapLines
            }
        }
    }

    /// Stage 3: for an entry that named a slot, whether the slot holds the
    /// frame's flow; when it does not, the session index's lines of the key
    /// are prefetched, as `process` will ask the index.
    #[inline]
    pub fn prefetch_lookup(&self, staged: Staged) -> Asked {
        let Some((i, key)) = staged.0 else { return Asked::Nothing };
        let sessions = &self.shared.nat4.sessions;
        match self.flows.v4.get_at(i) {
            Some(r) if sessions.lookup_at(&key, r).is_none() => {
                sessions.prefetch_key(&key);
                Asked::MapLines
            }
            _ => Asked::Nothing,
        }
    }
}

/// The 5-tuple of an untagged IPv4 TCP/UDP frame with a 20-byte header
/// and no fragmentation, read with one length check. Only a hint: the
/// pipeline validates everything again.
#[inline]
fn flow_key_v4(frame: &[u8]) -> Option<FlowKey<Ipv4Addr>> {
    const L3: usize = ethernet::HEADER_LEN;
    const L4: usize = L3 + crate::wire::ipv4::MIN_HEADER_LEN;
    let h: &[u8; L4 + 4] = frame.get(..L4 + 4)?.try_into().ok()?;
    if h[12] != 0x08 || h[13] != 0x00 || h[L3] != 0x45 || h[L3 + 6] & 0x3f != 0 || h[L3 + 7] != 0 {
        return None;
    }
    let p = h[L3 + 9];
    if p != proto::UDP && p != proto::TCP {
        return None;
    }
    let src = Ipv4Addr::new(h[L3 + 12], h[L3 + 13], h[L3 + 14], h[L3 + 15]);
    let dst = Ipv4Addr::new(h[L3 + 16], h[L3 + 17], h[L3 + 18], h[L3 + 19]);
    let sport = u16::from_be_bytes([h[L4], h[L4 + 1]]);
    let dport = u16::from_be_bytes([h[L4 + 2], h[L4 + 3]]);
    Some(FlowKey::new(src, dst, sport, dport, p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Timestamp;
    use crate::engine::{ChecksumHint, Engine, RxMeta, Verdict};
    use crate::fixtures;

    #[test]
    fn reads_the_tuple_the_pipeline_keys_on() {
        let pod = fixtures::POD_A;
        let f = fixtures::from_pod(pod.into(), fixtures::SERVER.into(), fixtures::udp(40000, 53, b"q")).frame();
        let key = flow_key_v4(&f).expect("an IPv4 UDP frame");
        assert_eq!(key, FlowKey::new(pod, fixtures::SERVER, 40000, 53, proto::UDP));
        // Not staged: ARP, IPv6, a fragment, a truncated frame.
        let mut frag = f.clone();
        frag[ethernet::HEADER_LEN + 6] = 0x20;
        assert_eq!(flow_key_v4(&frag), None);
        assert_eq!(flow_key_v4(&f[..30]), None);
        let v6 = fixtures::from_pod(fixtures::POD6.into(), fixtures::SERVER6.into(), fixtures::udp(1, 2, b"")).frame();
        assert_eq!(flow_key_v4(&v6), None);
    }

    #[test]
    fn each_stage_asks_for_the_lines_process_reads() {
        let engine = Engine::new(&fixtures::base_spec()).unwrap();
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline();
        let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
        let flow =
            |port| fixtures::from_pod(fixtures::POD_A.into(), fixtures::SERVER.into(), fixtures::udp(port, 53, b"q"));
        let f = flow(40000).frame();
        let stages = |w: &Pipeline, f: &[u8]| {
            let s = w.prefetch_flow(f);
            (w.prefetch_session(s), w.prefetch_lookup(s))
        };
        // A flow this worker has not seen: its entry is empty, the index is asked.
        assert_eq!(stages(&w, &f), (Asked::MapLines, Asked::Nothing));
        // Made, then its next packet found in the index: the entry names it.
        for _ in 0..2 {
            let mut f = flow(40000).frame();
            let len = f.len();
            assert!(matches!(w.process(&mut f, len, meta, Timestamp::from_secs(1)), Verdict::Forward { .. }));
        }
        // Established: the entry names its slot, which holds it.
        assert_eq!(stages(&w, &f), (Asked::Slot, Asked::Nothing));
        // Its session ended: the entry still names the slot, which no longer
        // holds the flow, so the index is asked as well.
        let mut later = 1;
        while !engine.nat4().sessions.is_empty() {
            later += 100_000;
            w.tick(Timestamp::from_secs(later), 4096);
        }
        assert_eq!(stages(&w, &f), (Asked::Slot, Asked::MapLines));
        // Not an IPv4 TCP/UDP frame: nothing staged.
        let v6 = fixtures::from_pod(fixtures::POD6.into(), fixtures::SERVER6.into(), fixtures::udp(1, 2, b"")).frame();
        assert_eq!(stages(&w, &v6), (Asked::Nothing, Asked::Nothing));
    }

    #[test]
    fn staging_changes_no_verdict() {
        // The same frames, staged and unstaged, give the same verdicts and bytes.
        let spec = fixtures::base_spec();
        let run = |staged: bool| {
            let engine = Engine::new(&spec).unwrap();
            engine.publish_fib(fixtures::topology());
            let mut w = engine.pipeline();
            let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
            let mut out = Vec::new();
            for round in 0..3u64 {
                let mut frames: Vec<Vec<u8>> = (0..16u16)
                    .map(|p| {
                        fixtures::from_pod(
                            fixtures::POD_A.into(),
                            fixtures::SERVER.into(),
                            fixtures::udp(40000 + p, 53, b"q"),
                        )
                        .frame()
                    })
                    .collect();
                if staged {
                    let s: Vec<Staged> = frames.iter().map(|f| w.prefetch_flow(f)).collect();
                    assert_eq!(s.iter().filter(|s| s.0.is_some()).count(), 16);
                    for s in &s {
                        assert_ne!(w.prefetch_session(*s), Asked::Nothing);
                    }
                    for s in &s {
                        w.prefetch_lookup(*s);
                    }
                }
                for f in &mut frames {
                    let len = f.len();
                    let v = w.process(f, len, meta, Timestamp::from_secs(1 + round));
                    out.push((format!("{v:?}"), f.clone()));
                }
            }
            out
        };
        let (a, b) = (run(false), run(true));
        assert!(a.iter().all(|(v, _)| v.starts_with("Forward")), "{:?}", a[0].0);
        assert_eq!(a, b);
    }
}
