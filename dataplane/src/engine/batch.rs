//! Staging a batch of frames (as VPP's graph nodes do): before any frame of
//! a batch is processed, the lines each will wait for are requested, so the
//! waits overlap instead of being paid one frame after another.
//!
//! 1. [`Pipeline::prefetch_flow`] for every frame: read the 5-tuple of an
//!    IPv4 or IPv6 TCP or UDP frame (of a tunnel frame's inner frame),
//!    prefetch the worker's flow-cache entry for it.
//! 2. [`Pipeline::prefetch_session`] for every frame: read that entry and
//!    prefetch the session slot it names; an empty entry (a flow this
//!    worker has not seen) has the session index's lines for the key
//!    prefetched instead, where `process` will ask.
//! 3. [`Pipeline::prefetch_lookup`] for every IPv4 frame whose entry named
//!    a slot: read the slot (its line asked for in stage 2) and, when it
//!    holds another flow (an entry shared with another flow, or a new flow
//!    whose entry still names an ended session), prefetch the session
//!    map's lines for the key. (An IPv6 frame keeps no key to compare:
//!    the `Flow` type says why.)
//! 4. [`Batch::process`](super::Batch::process) for every frame, in one
//!    [`Pipeline::batch`], as without staging.
//!
//! Stages 1 to 3 change nothing and decide nothing: a frame they cannot
//! read, or an entry that is stale, only goes unprefetched, and `process`
//! judges it in full. With few sessions everything is in cache and the
//! stages are pure overhead: [`Pipeline::staging_pays`] says when to use them.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::Pipeline;
use crate::nat::flow_cache::{FlowCache, Probe};
use crate::nat::key::{proto, FlowKey, NatAddr};
use crate::nat::session::SessionTable;
use crate::nat::session_index::Place;
use crate::tunnel;
use crate::wire::{ethernet, ipv6};

/// What stage 1 found for a frame: the flow-cache entry to read in stage 2
/// and the key the later stages look for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Staged(Flow);

/// A staged frame's flow, by family. An IPv6 flow keeps its key's place
/// in the session index rather than the key (16 bytes, not 37), so that a
/// staged frame stays as small as an IPv4 one: a larger `Staged` cost the
/// IPv4 batches 1.2x (docs/benchmarks.md, "IPv6 staged"). Without the key,
/// stage 3 cannot tell a stale entry's slot from the flow's own, so for
/// IPv6 it asks nothing: the rare stale entry pays its index miss in
/// `process`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Flow {
    /// Not staged: `process` judges the frame in full.
    #[default]
    None,
    V4(Probe, FlowKey<Ipv4Addr>),
    V6(Probe, Place),
}

impl Staged {
    /// Whether stage 1 found a flow to stage.
    pub fn is_flow(&self) -> bool {
        self.0 != Flow::None
    }
}

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

/// Below this many sessions (both families) the session slots fit in the
/// caches and staging costs more than it saves (docs/benchmarks.md,
/// "Batches staged").
pub const STAGING_MIN_SESSIONS: usize = 16 * 1024;

impl Pipeline {
    /// Whether staging a batch is worth its cost now (enough sessions that
    /// their slots miss the caches).
    #[inline]
    pub fn staging_pays(&self) -> bool {
        self.shared.nat4.sessions.len() + self.shared.nat6.sessions.len() >= STAGING_MIN_SESSIONS
    }

    /// Stage 1: prefetches the flow-cache entry of an untagged IPv4 TCP or
    /// UDP frame (no options, not a fragment), or of an untagged IPv6 one
    /// (TCP or UDP right after the fixed header); anything else is left to
    /// `process` unstaged. A frame from the tunnel ([`tunnel`]) is
    /// staged by its inner frame, the one `process` looks up.
    #[inline]
    pub fn prefetch_flow(&mut self, frame: &[u8]) -> Staged {
        let frame = match self.tables.load().tunnel() {
            Some(t) => tunnel_inner(frame, t.port).unwrap_or(frame),
            None => frame,
        };
        Staged(match frame.get(12..14) {
            Some([0x08, 0x00]) => flow_key_v4(frame).map_or(Flow::None, |k| Flow::V4(self.flows.v4.prefetch(&k), k)),
            Some([0x86, 0xdd]) => flow_key_v6(frame)
                .map_or(Flow::None, |k| Flow::V6(self.flows.v6.prefetch(&k), self.shared.nat6.sessions.place(&k))),
            _ => Flow::None,
        })
    }

    /// Stage 2: prefetches the session slot the entry found in stage 1
    /// names; for an empty entry, the session index's lines of the key.
    #[inline]
    pub fn prefetch_session(&self, staged: Staged) -> Asked {
        match staged.0 {
            Flow::V4(p, key) => {
                let sessions = &self.shared.nat4.sessions;
                prefetch_session(&self.flows.v4, sessions, p, || sessions.prefetch_key(&key))
            }
            Flow::V6(p, place) => {
                let sessions = &self.shared.nat6.sessions;
                prefetch_session(&self.flows.v6, sessions, p, || sessions.prefetch_place(place))
            }
            Flow::None => Asked::Nothing,
        }
    }

    /// Stage 3: for an entry that named a slot, whether the slot holds the
    /// frame's flow; when it does not, the session index's lines of the key
    /// are prefetched, as `process` will ask the index.
    #[inline]
    pub fn prefetch_lookup(&self, staged: Staged) -> Asked {
        let Flow::V4(p, key) = staged.0 else { return Asked::Nothing };
        let sessions = &self.shared.nat4.sessions;
        match self.flows.v4.get_at(p) {
            Some(r) if sessions.lookup_at(&key, r).is_none() => {
                sessions.prefetch_key(&key);
                Asked::MapLines
            }
            _ => Asked::Nothing,
        }
    }
}

/// Stage 2 in one family: the slot the entry names, or (`index_lines`)
/// the index's lines of the key.
#[inline(always)]
fn prefetch_session<A: NatAddr>(
    cache: &FlowCache<A>,
    sessions: &SessionTable<A>,
    p: Probe,
    index_lines: impl FnOnce(),
) -> Asked {
    match cache.get_at(p) {
        Some(r) => {
            sessions.prefetch(r);
            Asked::Slot
        }
        None => {
            index_lines();
            Asked::MapLines
        }
    }
}

/// The inner frame of `frame` if it is UDP to the tunnel's `port` with a
/// VXLAN header ([`tunnel::glance`]). Only a hint, as the keys are:
/// [`tunnel::decapsulate`] judges the frame in `process`.
#[inline]
fn tunnel_inner(frame: &[u8], port: u16) -> Option<&[u8]> {
    match tunnel::glance(frame, port) {
        tunnel::Glance::ToPort(l4) => frame.get(l4 + crate::wire::udp::HEADER_LEN + crate::wire::vxlan::HEADER_LEN..),
        _ => None,
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

/// The 5-tuple of an untagged IPv6 frame whose fixed header is followed
/// directly by TCP or UDP (no extension header, so no fragment), read with
/// one length check. Only a hint, as for IPv4.
#[inline]
fn flow_key_v6(frame: &[u8]) -> Option<FlowKey<Ipv6Addr>> {
    const L3: usize = ethernet::HEADER_LEN;
    const L4: usize = L3 + ipv6::HEADER_LEN;
    let h: &[u8; L4 + 4] = frame.get(..L4 + 4)?.try_into().ok()?;
    if h[12] != 0x86 || h[13] != 0xdd || h[L3] >> 4 != 6 {
        return None;
    }
    let p = h[L3 + 6];
    if p != proto::UDP && p != proto::TCP {
        return None;
    }
    let addr =
        |at: usize| -> Option<Ipv6Addr> { Some(Ipv6Addr::from(<[u8; 16]>::try_from(h.get(at..at + 16)?).ok()?)) };
    let sport = u16::from_be_bytes([h[L4], h[L4 + 1]]);
    let dport = u16::from_be_bytes([h[L4 + 2], h[L4 + 3]]);
    Some(FlowKey::new(addr(L3 + 8)?, addr(L3 + 24)?, sport, dport, p))
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
        // Not staged: a fragment, a truncated frame, the other family.
        let mut frag = f.clone();
        frag[ethernet::HEADER_LEN + 6] = 0x20;
        assert_eq!(flow_key_v4(&frag), None);
        assert_eq!(flow_key_v4(&f[..30]), None);
        assert_eq!(flow_key_v6(&f), None);
        let v6 = |t| fixtures::from_pod(fixtures::POD6.into(), fixtures::SERVER6.into(), t).frame();
        let f6 = v6(fixtures::tcp(40000, 443, 1, None, 0x02, b""));
        let key6 = flow_key_v6(&f6).expect("an IPv6 TCP frame");
        assert_eq!(key6, FlowKey::new(fixtures::POD6, fixtures::SERVER6, 40000, 443, proto::TCP));
        assert_eq!(flow_key_v4(&f6), None);
        // What stage 1 keeps of it: its flow-cache entry and its place in
        // the IPv6 session index (where stage 2 asks when the entry is empty).
        let engine = Engine::new(&fixtures::base_spec()).unwrap();
        let mut w = engine.pipeline();
        let place = engine.nat6().sessions.place(&key6);
        assert_eq!(w.prefetch_flow(&f6), Staged(Flow::V6(w.flows.v6.prefetch(&key6), place)));
        // Not staged: an extension header first (a fragment header here),
        // ICMPv6, a truncated frame.
        let mut ext = f6.clone();
        ext[ethernet::HEADER_LEN + 6] = 44;
        assert_eq!(flow_key_v6(&ext), None);
        assert_eq!(flow_key_v6(&v6(fixtures::echo(true, 1, 1))), None);
        assert_eq!(flow_key_v6(&f6[..ethernet::HEADER_LEN + ipv6::HEADER_LEN + 3]), None);
    }

    /// The lines each stage asks for, through a flow's life: `flow(port)`
    /// builds its frames, `sessions` counts the family's sessions, `stale`
    /// is what stage 3 asks for once the flow's entry names an ended
    /// session.
    fn stages_follow_a_flow(flow: impl Fn(u16) -> Vec<u8>, sessions: impl Fn(&Engine) -> usize, stale: Asked) {
        let engine = Engine::new(&fixtures::base_spec()).unwrap();
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline();
        let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
        let f = flow(40000);
        let stages = |w: &mut Pipeline, f: &[u8]| {
            let s = w.prefetch_flow(f);
            (w.prefetch_session(s), w.prefetch_lookup(s))
        };
        // A flow this worker has not seen: its entry is empty, the index is asked.
        assert_eq!(stages(&mut w, &f), (Asked::MapLines, Asked::Nothing));
        // Made, then its next packet found in the index: the entry names it.
        for _ in 0..2 {
            let mut f = flow(40000);
            let len = f.len();
            assert!(matches!(w.process(&mut f, len, meta, Timestamp::from_secs(1)), Verdict::Forward { .. }));
        }
        assert_eq!(sessions(&engine), 1);
        // Established: the entry names its slot, which holds it.
        assert_eq!(stages(&mut w, &f), (Asked::Slot, Asked::Nothing));
        // Its session ended: the entry still names the slot, which no longer
        // holds the flow, so (IPv4) the index is asked as well.
        let mut later = 1;
        while sessions(&engine) > 0 {
            later += 100_000;
            w.tick(Timestamp::from_secs(later), 4096);
        }
        assert_eq!(stages(&mut w, &f), (Asked::Slot, stale));
        // Not a TCP/UDP frame: nothing staged.
        let ping = fixtures::from_pod(fixtures::POD_A.into(), fixtures::SERVER.into(), fixtures::echo(true, 1, 1));
        assert_eq!(stages(&mut w, &ping.frame()), (Asked::Nothing, Asked::Nothing));
    }

    fn udp4(port: u16) -> Vec<u8> {
        fixtures::from_pod(fixtures::POD_A.into(), fixtures::SERVER.into(), fixtures::udp(port, 53, b"q")).frame()
    }

    fn udp6(port: u16) -> Vec<u8> {
        fixtures::from_pod(fixtures::POD6.into(), fixtures::SERVER6.into(), fixtures::udp(port, 53, b"q")).frame()
    }

    #[test]
    fn each_stage_asks_for_the_lines_process_reads() {
        stages_follow_a_flow(udp4, |e| e.nat4().sessions.len(), Asked::MapLines);
    }

    #[test]
    fn an_ipv6_flow_is_staged_as_an_ipv4_one() {
        stages_follow_a_flow(udp6, |e| e.nat6().sessions.len(), Asked::Nothing);
    }

    /// A frame from the tunnel is staged by the flow of its inner frame,
    /// the one `process` looks up, in both families.
    #[test]
    fn a_tunnelled_flow_is_staged_by_its_inner_frame() {
        let tunnelled = |f: Vec<u8>| fixtures::tunnelled(&f, 1).expect("an IP frame");
        stages_follow_a_flow(|port| tunnelled(udp4(port)), |e| e.nat4().sessions.len(), Asked::MapLines);
        stages_follow_a_flow(|port| tunnelled(udp6(port)), |e| e.nat6().sessions.len(), Asked::Nothing);
        let engine = Engine::new(&fixtures::base_spec()).unwrap();
        let mut w = engine.pipeline();
        for f in [udp4(40000), udp6(40000)] {
            let inner = w.prefetch_flow(&f);
            assert!(inner.is_flow());
            assert_eq!(w.prefetch_flow(&tunnelled(f.clone())), inner);
        }
        // UDP to another port, or without a tunnel configured: the outer
        // frame's own flow.
        let f = tunnelled(udp4(40000));
        let mut other = f.clone();
        let dport = ethernet::HEADER_LEN + crate::wire::ipv4::MIN_HEADER_LEN + 2;
        other[dport..dport + 2].copy_from_slice(&4790u16.to_be_bytes());
        assert_eq!(
            w.prefetch_flow(&other),
            Staged(Flow::V4(w.flows.v4.prefetch(&outer_key(&other)), outer_key(&other)))
        );
        let spec = crate::tables::TablesSpec { tunnel: None, ..fixtures::base_spec() };
        let engine = Engine::new(&spec).unwrap();
        let mut w = engine.pipeline();
        assert_eq!(w.prefetch_flow(&f), Staged(Flow::V4(w.flows.v4.prefetch(&outer_key(&f)), outer_key(&f))));
    }

    fn outer_key(f: &[u8]) -> FlowKey<Ipv4Addr> {
        flow_key_v4(f).expect("an IPv4 UDP frame")
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
                // Both families, interleaved, some through the tunnel.
                let mut frames: Vec<Vec<u8>> = (0..16u16)
                    .map(|p| {
                        let (pod, server) = if p % 2 == 0 {
                            (fixtures::POD_A.into(), fixtures::SERVER.into())
                        } else {
                            (fixtures::POD6.into(), fixtures::SERVER6.into())
                        };
                        let f = fixtures::from_pod(pod, server, fixtures::udp(40000 + p, 53, b"q")).frame();
                        // Every fourth pair through the tunnel.
                        if p % 8 >= 6 {
                            fixtures::tunnelled(&f, p).expect("an IP frame")
                        } else {
                            f
                        }
                    })
                    .collect();
                if staged {
                    let s: Vec<Staged> = frames.iter().map(|f| w.prefetch_flow(f)).collect();
                    assert_eq!(s.iter().filter(|s| s.is_flow()).count(), 16);
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
