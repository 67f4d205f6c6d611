//! The per-frame pipeline: one frame in, a verdict out.
//!
//! A [`Pipeline`] is one worker thread's handle on the [`Engine`](super::Engine)'s shared
//! state, with its caches (snapshots, next hops, flows), its counters and
//! its port generator. [`Pipeline::process`] takes a frame through the steps
//! listed in the module above (engine/mod.rs): the established path
//! (established.rs) first unless the worker was made with
//! [`Path::FullOnly`], then dissection, neighbour answers, fragments, ICMP
//! errors, the session lookup and the slow path ([`Ctx::slow_path`]),
//! hairpinning, and forwarding to the next hop ([`Ctx::forward`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use arc_swap::{ArcSwap, Cache};

use super::next_hop_cache::NextHopCache;
use super::{
    ChecksumHint, Family, FlowCaches, Path, Release, ResolveRequest, RxMeta, Shared, Verdict, ECHO_ANSWERS_PER_SEC,
    MIN_FRAME,
};
use crate::clock::Timestamp;
use crate::dissect::{self, Frag, IpPacket, Parsed, L4};
use crate::fib::{Fib, NeighborUse, NextHop};
use crate::icmp_gen::{self, ErrorKind};
use crate::ingress::Ingress;
use crate::nat::flow_rate::FlowRate;
use crate::nat::fragments::{FragKey, FragTranslation};
use crate::nat::icmp_error;
use crate::nat::key::{proto, FlowKey, NatAddr, SessionTuple};
use crate::nat::port_alloc::PortRng;
use crate::nat::rewrite;
use crate::nat::session::{offload, session_flags, SessionRef, SessionView};
use crate::nat::table::{CreateCtx, DeltaFnBox, NatTable, OutboundRequest};
use crate::nat::tcp_state;
use crate::neigh_responder::{self, NeighOutcome};
use crate::policy::Decision;
use crate::stats::{Direction, DropReason, Event, WorkerStats};
use crate::tables::{FilteringBehavior, Policy, PolicyFamily, Tables};
use crate::translog::{quota, LogKind, LogRecord, LogRing, LogTo};
use crate::tunnel::{self, Decap};
use crate::wire::checksum;
use crate::wire::ethernet::{self, EthernetAddress};

/// One worker's handle on the engine.
pub struct Pipeline {
    pub(super) shared: Arc<Shared>,
    pub(super) tables: Cache<Arc<ArcSwap<Tables>>, Arc<Tables>>,
    fib: Cache<Arc<ArcSwap<Fib>>, Arc<Fib>>,
    ingress: Cache<Arc<ArcSwap<Ingress>>, Arc<Ingress>>,
    stats: Arc<WorkerStats>,
    rng: PortRng,
    next_hops: NextHopCache,
    pub(super) flows: FlowCaches,
    hold_unresolved: bool,
    hold_fragments: bool,
    /// New sessions per source (nat/flow_rate.rs).
    flow_rate: FlowRate,
    /// Whether frames try the established path first.
    path: Path,
    /// The worker's translation log ring, when logging is on (translog.rs).
    log: Option<Arc<LogRing>>,
    /// Frames the established path took (its tests check it is exercised).
    #[cfg(test)]
    pub(super) established_taken: u64,
}

impl std::fmt::Debug for Pipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipeline").finish_non_exhaustive()
    }
}

/// Everything a batch's processing borrows ([`Pipeline::batch`]): the
/// snapshots are read through the worker's caches, so the fast path
/// clones no `Arc`. What one frame sets here for itself ([`Ctx::missed`],
/// [`Ctx::decapsulated`]) is reset before the next ([`Batch::process`]).
pub(super) struct Ctx<'a> {
    pub(super) shared: &'a Shared,
    pub(super) tables: &'a Tables,
    pub(super) fib: &'a Fib,
    pub(super) ingress: &'a Ingress,
    pub(super) stats: &'a WorkerStats,
    pub(super) rng: &'a mut PortRng,
    pub(super) next_hops: &'a mut NextHopCache,
    pub(super) flows: &'a mut FlowCaches,
    /// The frame's time (engine seconds), for next-hop use stamps.
    pub(super) secs: u32,
    /// Whether an unresolved next hop gives [`Verdict::Hold`].
    pub(super) hold_unresolved: bool,
    /// Whether a later fragment before its first gives [`Verdict::HoldFragment`].
    pub(super) hold_fragments: bool,
    /// The worker's new-flow limiter.
    pub(super) flow_rate: &'a mut FlowRate,
    /// The frame's time, for the new-flow limiter.
    pub(super) now: Timestamp,
    /// The frame came out of the tunnel ([`crate::tunnel`]): its sender
    /// was checked against the Nodes' addresses instead of `podSourceMacs`,
    /// and it is translated or dropped, never passed.
    pub(super) decapsulated: bool,
    /// The established path looked this frame's flow up and the session
    /// index had no session for it: the full pipeline does not ask the map
    /// again for the same key (a new flow's second miss, about 130
    /// instructions). Set only by [`Ctx::established_v4`] and
    /// [`Ctx::established_v6`], whose key is the one [`Ctx::ip`] builds for
    /// the frames they look up (TCP or UDP, neither fragmented nor with
    /// IPv4 options or IPv6 extension headers).
    pub(super) missed: bool,
    /// Whether frames try the established path first.
    pub(super) path: Path,
    /// The worker's translation log ring, when logging is on (borrowed
    /// as the `Option` itself: one pointer copied per frame, looked into
    /// only where a session is made or removed).
    pub(super) log: &'a Option<Arc<LogRing>>,
    /// Frames the established path took (tests).
    #[cfg(test)]
    pub(super) established_taken: &'a mut u64,
}

/// A batch of frames through one worker's pipeline, all at one time
/// ([`Pipeline::batch`]): what one frame's processing borrows is gathered
/// once for the batch (VPP's graph nodes likewise take a vector of
/// packets per dispatch).
pub struct Batch<'a> {
    ctx: Ctx<'a>,
}

impl std::fmt::Debug for Batch<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch").field("now", &self.ctx.now).finish_non_exhaustive()
    }
}

impl Batch<'_> {
    /// Processes one frame of the batch in place, as [`Pipeline::process`]
    /// at the batch's time. `buf` is the whole frame buffer (its capacity),
    /// the frame is `buf[..len]`.
    #[inline]
    pub fn process(&mut self, buf: &mut [u8], len: usize, meta: RxMeta) -> Verdict {
        let ctx = &mut self.ctx;
        // What one frame learns is not the next one's.
        ctx.missed = false;
        ctx.decapsulated = false;
        let (shared, stats, now) = (ctx.shared, ctx.stats, ctx.now);
        // The data plane's own fence (ownership.rs): one load and compare
        // while every owned address is valid; otherwise nothing is received
        // for, answered for or sent from an expired address, even if the
        // tables (or a frame that waited in the ring) say otherwise. Asked
        // for every frame, not once a batch: the control plane may shorten
        // a valid-until while the batch is open.
        let fenced = !shared.ownership.all_valid(now);
        let v = if fenced && shared.ownership.frame_expired(&buf[..len.min(buf.len())], now) {
            Verdict::Drop(DropReason::OwnershipExpired)
        } else {
            match ctx.process(buf, len, meta, now) {
                Verdict::Forward { len: out, .. }
                | Verdict::Answer { len: out }
                | Verdict::ToKernel { end: out, .. }
                    if fenced && shared.ownership.frame_expired(&buf[..out.min(buf.len())], now) =>
                {
                    Verdict::Drop(DropReason::OwnershipExpired)
                }
                v => v,
            }
        };
        match v {
            Verdict::Forward { .. } => stats.forwarded.inc(),
            Verdict::Answer { .. } => stats.answered.inc(),
            Verdict::Pass => stats.passed.inc(),
            Verdict::Drop(r) => stats.dropped(r),
            // Counted by the holder: queued, then sent or dropped; or by
            // whoever hands the packet to the kernel.
            Verdict::Hold { .. } | Verdict::HoldFragment { .. } | Verdict::ToKernel { .. } => {}
        }
        v
    }

    /// The worker's counters.
    pub fn stats(&self) -> &WorkerStats {
        self.ctx.stats
    }
}

impl Pipeline {
    /// A worker on `shared`, counting into `stats` (already registered
    /// with the engine): [`Engine::worker_on`](super::Engine::worker_on).
    pub(super) fn new(shared: Arc<Shared>, stats: Arc<WorkerStats>, rng: PortRng, path: Path) -> Pipeline {
        // Keyed by the worker's seed without advancing its generator.
        let flow_rate = FlowRate::new(rng.clone().next_u64());
        let log = shared.translog.get().map(|&records| {
            let ring = Arc::new(LogRing::new(records));
            shared.translog_rings.lock().push(ring.clone());
            ring
        });
        let flows = FlowCaches::new(&shared);
        Pipeline {
            tables: Cache::new(shared.tables.clone()),
            fib: Cache::new(shared.fib.clone()),
            ingress: Cache::new(shared.ingress.clone()),
            shared,
            stats,
            rng,
            next_hops: NextHopCache::new(),
            flows,
            hold_unresolved: false,
            hold_fragments: false,
            flow_rate,
            path,
            log,
            #[cfg(test)]
            established_taken: 0,
        }
    }

    /// This worker's counters.
    pub fn stats(&self) -> &Arc<WorkerStats> {
        &self.stats
    }

    /// Processes one frame in place. `buf` is the whole frame buffer (its
    /// capacity), the frame is `buf[..len]`. A batch of one: a worker with
    /// several frames at the same time opens a [`Batch`] instead.
    #[inline]
    pub fn process(&mut self, buf: &mut [u8], len: usize, meta: RxMeta, now: Timestamp) -> Verdict {
        self.batch(now).process(buf, len, meta)
    }

    /// Opens a batch of frames processed at `now`: the snapshots (tables,
    /// forwarding, ingress) are loaded and the worker's state borrowed once
    /// for the batch instead of once per frame. A snapshot published while
    /// the batch is open is seen by the next batch, as a frame already
    /// being processed never saw it either.
    #[inline]
    pub fn batch(&mut self, now: Timestamp) -> Batch<'_> {
        let Pipeline {
            shared,
            tables,
            fib,
            ingress,
            stats,
            rng,
            next_hops,
            flows,
            hold_unresolved,
            hold_fragments,
            flow_rate,
            path,
            log,
            #[cfg(test)]
            established_taken,
        } = self;
        Batch {
            ctx: Ctx {
                shared,
                tables: tables.load(),
                fib: fib.load(),
                ingress: ingress.load(),
                stats,
                rng,
                next_hops,
                flows,
                secs: now.secs(),
                hold_unresolved: *hold_unresolved,
                hold_fragments: *hold_fragments,
                flow_rate,
                now,
                decapsulated: false,
                missed: false,
                path: *path,
                log,
                #[cfg(test)]
                established_taken,
            },
        }
    }

    /// Whether a frame to an unresolved next hop is given back as
    /// [`Verdict::Hold`] (the worker loop can keep it) instead of dropped.
    pub fn set_hold_unresolved(&mut self, on: bool) {
        self.hold_unresolved = on;
    }

    /// Whether a later fragment that arrives before its datagram's first
    /// fragment is given back as [`Verdict::HoldFragment`] (the worker loop
    /// keeps it and processes it again) instead of dropped.
    pub fn set_hold_fragments(&mut self, on: bool) {
        self.hold_fragments = on;
    }

    /// A held frame ([`Verdict::Hold`]) once more: when its next hop on
    /// `ifindex` has a MAC in the forwarding snapshot now, the MACs are
    /// written and it is forwarded (counted `forwarded` and
    /// `neighbor_queue_sent`); the data plane's fence is checked again, as
    /// the frame may have waited across a valid-until.
    pub fn release_held(
        &mut self,
        buf: &mut [u8],
        len: usize,
        ifindex: u32,
        next_hop: IpAddr,
        now: Timestamp,
    ) -> Release {
        let fib = self.fib.load();
        let Some(iface) = fib.interface(ifindex) else {
            self.stats.dropped(DropReason::NoRoute);
            return Release::Drop(DropReason::NoRoute);
        };
        let Some(mac) = fib.neighbor(ifindex, next_hop) else { return Release::Wait };
        if len < MIN_FRAME || len > buf.len() {
            self.stats.dropped(DropReason::MalformedEthernet);
            return Release::Drop(DropReason::MalformedEthernet);
        }
        if self.shared.ownership.frame_expired(&buf[..len], now) {
            self.stats.dropped(DropReason::OwnershipExpired);
            return Release::Drop(DropReason::OwnershipExpired);
        }
        let mut f = ethernet::Frame::new_unchecked(&mut buf[..len]);
        f.set_dst_addr(EthernetAddress(mac));
        f.set_src_addr(EthernetAddress(iface.mac));
        self.shared.neighbor_use.touch(NeighborUse::slot(ifindex, next_hop), now.secs());
        self.stats.forwarded.inc();
        self.stats.event(Event::NeighborQueueSent);
        Release::Forward { ifindex, len }
    }

    /// Periodic work: sweeps `budget` session slots of each family (expiry,
    /// revalidation after a reload). Bounded, so it can run between batches.
    pub fn tick(&mut self, now: Timestamp, budget: u32) -> u32 {
        let tables = self.tables.load();
        self.flows.pools_v4.let_go(tables.generation);
        self.flows.pools_v6.let_go(tables.generation);
        let s = now.secs();
        let log = self.log.as_deref().map(|ring| LogTo { ring, stats: &self.stats, now_ms: now.as_millis() });
        self.shared.nat4.sweep(budget, s, tables, &self.stats, log)
            + self.shared.nat6.sweep(budget, s, tables, &self.stats, log)
    }

    /// This worker's translation log ring, when logging is on.
    pub fn translog_ring(&self) -> Option<&Arc<LogRing>> {
        self.log.as_ref()
    }
}

/// Logs a refused new flow of `pod` (ADR 0034 §2: ports exhausted is
/// natEvent 12; the pod's session limit or port quota and a full table
/// are 13), at most once a second per (reason, pod) on this worker.
#[cold]
fn log_refusal<A: NatAddr + PolicyFamily>(l: LogTo<'_>, reason: DropReason, pod: &A, policy: &Policy, tables: &Tables) {
    let nat = &tables.nat;
    let egress = policy.egress_for(*pod);
    let entry = egress.and_then(|e| tables.egress(e.ip()));
    let ports = entry.map(|e| e.ports);
    let (kind, detail, limit) = match reason {
        DropReason::PortsExhausted => (LogKind::PortsExhausted, 0, ports.map_or(0, |p| p.len())),
        DropReason::SourcePortQuota => {
            // In block mode the pod's blocks bound it too (nat/port_blocks.rs).
            let quota = entry.map_or(0, |e| {
                let q = nat.ports_per_source(e.ports);
                e.blocks.map_or(q, |b| q.min(u32::from(b.size) * u32::from(b.max_per_pod)))
            });
            (LogKind::QuotaExceeded, quota::MAX_ENTRIES_PER_USER, quota)
        }
        DropReason::SourceSessionLimit => {
            (LogKind::QuotaExceeded, quota::MAX_ENTRIES_PER_USER, nat.max_sessions_per_source)
        }
        DropReason::SessionTableFull => {
            (LogKind::QuotaExceeded, quota::MAX_SESSION_ENTRIES, u32::try_from(nat.max_sessions).unwrap_or(u32::MAX))
        }
        _ => return,
    };
    let mut b = [0u8; 16];
    pod.write(&mut b);
    // FNV-1a over the reason and the pod.
    let key = b.iter().fold(0xcbf2_9ce4_8422_2325_u64 ^ reason as u64, |h, x| {
        (h ^ u64::from(*x)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    if l.ring.admit_refusal(key, (l.now_ms / 1000) as u32) {
        l.push(LogRecord::refusal(kind, pod, egress.as_ref(), l.now_ms, detail, limit));
    }
}

impl<'a> Ctx<'a> {
    /// Where this frame's NAT operations log (`None`: logging is off).
    #[inline]
    fn log_to(&self) -> Option<LogTo<'a>> {
        self.log.as_deref().map(|ring| LogTo { ring, stats: self.stats, now_ms: self.now.as_millis() })
    }
}

impl Ctx<'_> {
    fn process(&mut self, buf: &mut [u8], len: usize, meta: RxMeta, now: Timestamp) -> Verdict {
        if len < MIN_FRAME || len > buf.len() {
            return Verdict::Drop(DropReason::MalformedEthernet);
        }
        if !self.decapsulated {
            match tunnel::decapsulate(self.tables, self.ingress, &buf[..len], meta.ifindex) {
                Decap::NotTunnel => {}
                Decap::Drop(r) => return Verdict::Drop(r),
                Decap::Inner { start, end } => return self.inner(buf, start, end, meta, now),
            }
        }
        self.frame(buf, len, meta, now)
    }

    /// The inner frame of a tunnel frame, `buf[start..end]`, through the
    /// pipeline; what it gives is moved to the start of `buf` (a copy of
    /// one frame, on the workers' path only: the XDP program strips the
    /// outer headers itself for established flows), and what would have
    /// been passed or answered is dropped.
    fn inner(&mut self, buf: &mut [u8], start: usize, end: usize, meta: RxMeta, now: Timestamp) -> Verdict {
        self.stats.event(Event::Decapsulated);
        self.decapsulated = true;
        let v = self.process(&mut buf[start..], end - start, meta, now);
        self.decapsulated = false;
        match v {
            Verdict::Forward { ifindex, len } => {
                buf.copy_within(start..start + len, 0);
                Verdict::Forward { ifindex, len }
            }
            Verdict::Hold { ifindex, next_hop, len } => {
                buf.copy_within(start..start + len, 0);
                Verdict::Hold { ifindex, next_hop, len }
            }
            Verdict::ToKernel { l3, end } => Verdict::ToKernel { l3: start + l3, end: start + end },
            Verdict::Pass | Verdict::Answer { .. } => Verdict::Drop(DropReason::DecapNotSteered),
            // A held fragment is kept unchanged, outer headers and all, and
            // decapsulated again when it is processed again.
            Verdict::HoldFragment { .. } | Verdict::Drop(_) => v,
        }
    }

    fn frame(&mut self, buf: &mut [u8], len: usize, meta: RxMeta, now: Timestamp) -> Verdict {
        if self.path == Path::EstablishedFirst {
            // IPv6's path is out of line and asked second: an IPv4 frame
            // the straight-line path takes pays nothing for it.
            let taken = match self.established_v4(buf, len, meta) {
                None if buf.get(12..14) == Some(&[0x86, 0xdd]) => self.established_v6(buf, len, meta),
                taken => taken,
            };
            if let Some(v) = taken {
                #[cfg(test)]
                {
                    *self.established_taken += 1;
                }
                return v;
            }
        }
        self.dissected(buf, len, meta, now)
    }

    /// The full pipeline for a frame the established path did not take.
    /// Never inlined into [`frame`](Self::frame): its stack frame and
    /// register pressure would be the established path's too (the values
    /// that path keeps live were spilled around it; docs/benchmarks.md,
    /// "The established path's instructions").
    #[inline(never)]
    fn dissected(&mut self, buf: &mut [u8], len: usize, meta: RxMeta, now: Timestamp) -> Verdict {
        let parsed = match dissect::dissect(&buf[..len]) {
            Ok(p) => p,
            Err(r) => return Verdict::Drop(r),
        };
        match parsed {
            Parsed::V4(p) => self.ip::<Ipv4Addr>(buf, len, p, meta, now),
            Parsed::V6(p) => {
                if p.l4info == L4::NeighborSolicit {
                    return self.neighbor_solicit(buf, len, meta);
                }
                self.ip::<Ipv6Addr>(buf, len, p, meta, now)
            }
            Parsed::Arp => self.arp(buf, len, meta),
            Parsed::Other(_) => Verdict::Pass,
        }
    }

    fn our_mac(&self, ifindex: u32) -> Option<EthernetAddress> {
        self.fib.interface(ifindex).map(|i| EthernetAddress(i.mac))
    }

    fn arp(&mut self, buf: &mut [u8], len: usize, meta: RxMeta) -> Verdict {
        let Some(mac) = self.our_mac(meta.ifindex) else { return Verdict::Pass };
        let tables = self.tables;
        match neigh_responder::answer_arp(buf, len, mac, |ip| tables.answers_neighbor(IpAddr::V4(ip))) {
            NeighOutcome::Answered { len } => {
                self.stats.event(Event::NeighborAnswered);
                Verdict::Answer { len }
            }
            NeighOutcome::NotOurs => Verdict::Pass,
            NeighOutcome::Malformed(_) => Verdict::Drop(DropReason::MalformedArp),
        }
    }

    fn neighbor_solicit(&mut self, buf: &mut [u8], len: usize, meta: RxMeta) -> Verdict {
        let Some(mac) = self.our_mac(meta.ifindex) else { return Verdict::Pass };
        let tables = self.tables;
        match neigh_responder::answer_neighbor_solicit(buf, len, mac, |ip| tables.answers_neighbor(IpAddr::V6(*ip))) {
            NeighOutcome::Answered { len } => {
                self.stats.event(Event::NeighborAnswered);
                Verdict::Answer { len }
            }
            NeighOutcome::NotOurs => Verdict::Pass,
            NeighOutcome::Malformed(_) => Verdict::Drop(DropReason::MalformedNeighborSolicit),
        }
    }

    #[inline]
    fn ip<A: Family>(
        &mut self,
        buf: &mut [u8],
        len: usize,
        mut p: IpPacket<A>,
        meta: RxMeta,
        now: Timestamp,
    ) -> Verdict {
        let tables = self.tables;
        let nat = A::nat(self.shared);
        let secs = now.secs();
        // Anti-spoofing (ingress.rs): whether this frame may be a pod's,
        // checked wherever it would be translated as one.
        let admitted = self.admits_pods(buf, meta);

        // Later fragments carry no ports: the first fragment's translation.
        if let Frag::Later { ident, key_proto } = p.frag {
            if let (Err(r), Decision::Steer(_)) = (admitted, tables.classify(p.src, p.dst)) {
                return Verdict::Drop(r);
            }
            let fk = FragKey { src: p.src, dst: p.dst, ident, proto: key_proto };
            return self.later_fragment(buf, len, &mut p, &fk, nat, secs);
        }
        if let L4::IcmpError { .. } = p.l4info {
            return match icmp_error::translate(buf, &mut p, nat, tables, secs, self.stats) {
                // An error leaving as a session's outbound direction is a
                // pod's (or an inside router's about a pod's flow).
                Ok(t) if t.direction == Direction::Outbound && admitted.is_err() => {
                    Verdict::Drop(admitted.err().unwrap_or(DropReason::SteeredOnOutside))
                }
                Ok(t) => {
                    self.stats.event(Event::IcmpErrorTranslated);
                    self.stats.traffic(t.session.policy_slot, t.direction, len);
                    self.forward(buf, len, &p, t.direction == Direction::Inbound)
                }
                Err(Some(r)) => Verdict::Drop(r),
                Err(None) => Verdict::Pass,
            };
        }
        // Echo requests to an egress IP that is not a Service VIP: answered
        // here (the kernel does not own the address), rate-limited.
        if let L4::Echo { request: true, .. } = p.l4info {
            if tables.egress(p.dst.ip()).is_some_and(|e| !e.kernel_service)
                && !matches!(tables.classify(p.src, p.dst), Decision::Steer(_))
            {
                return self.answer_echo(buf, &p, now);
            }
        }
        let Some(key) = p.flow_key() else {
            // No ports: never let a selected source out untranslated.
            return match tables.classify(p.src, p.dst) {
                Decision::Steer(_) if admitted.is_err() => {
                    Verdict::Drop(admitted.err().unwrap_or(DropReason::SteeredOnOutside))
                }
                Decision::Steer(_) if p.proto == A::ICMP_PROTO => Verdict::Drop(DropReason::UnsupportedIcmpType),
                Decision::Steer(_) => Verdict::Drop(DropReason::UnsupportedProtocol),
                // The kernel does not own an egress IP that is not a VIP.
                _ if tables.egress(p.dst.ip()).is_some_and(|e| !e.kernel_service) => {
                    Verdict::Drop(DropReason::UnservedToEgress)
                }
                _ => Verdict::Pass,
            };
        };
        let partial = match checksum_state(buf, &p, meta) {
            ChecksumState::Partial => true,
            ChecksumState::LookedPartial => {
                self.stats.event(Event::ChecksumLookedPartial);
                false
            }
            ChecksumState::Complete => false,
        };
        let tcp_flags = match p.l4info {
            L4::Ports { tcp_flags, .. } if p.proto == proto::TCP => tcp_flags,
            _ => 0,
        };
        // The TCP header's sequence numbers, window and (SYN) window scale,
        // for the RST window check (nat/tcp_state.rs).
        let seg = match p.l4info {
            L4::Ports { .. } if p.proto == proto::TCP => buf.get(p.l4..p.end).and_then(tcp_state::segment),
            _ => None,
        };

        // Fast path: one lookup, whichever direction (none when the
        // established path already found no session for this key).
        let log = self.log_to();
        let looked_up = if self.missed { None } else { self.lookup(nat, &key) };
        let hit = looked_up.filter(|(_, v)| nat.check(v, tables, secs, self.stats, log));
        let (view, dir) = match hit {
            Some((r, v)) => (v, if r.is_inbound() { Direction::Inbound } else { Direction::Outbound }),
            None => match self.slow_path(&p, key, tcp_flags, nat, secs, admitted) {
                Ok((v, dir)) => {
                    self.remember_created(&key, &v, dir);
                    (v, dir)
                }
                Err(v) => return v,
            },
        };
        if let (Direction::Outbound, Err(r)) = (dir, admitted) {
            return Verdict::Drop(r);
        }
        if let Some(v) = self.undeliverable(buf, &p, &view, dir, now) {
            return v;
        }
        self.account(nat, &view, dir, tcp_flags, seg.as_ref(), secs, len);
        let orig = (p.src, p.dst);
        // Whether the packet, once translated, goes to a pod.
        let mut to_pod = dir == Direction::Inbound;
        rewrite::translate(buf, &mut p, dir, &view.tuple, view.deltas, partial);
        if partial {
            self.stats.event(Event::PartialChecksumCompleted);
        }

        // Hairpinning: a pod's packet to an egress IP and port this gateway
        // holds arrives there as an inbound packet (RFC 4787 REQ-9).
        if dir == Direction::Outbound && view.flags & session_flags::HAIRPIN != 0 && tables.owns_egress(p.dst.ip()) {
            if !tables.nat.hairpinning {
                return Verdict::Drop(DropReason::InboundFiltered);
            }
            let Some(key2) = p.flow_key() else { return Verdict::Drop(DropReason::InboundNoMapping) };
            let hit2 = nat
                .sessions
                .lookup(&key2)
                .filter(|(r, v)| r.is_inbound() && nat.check(v, tables, secs, self.stats, log));
            let view2 = match hit2 {
                Some((_, v)) => v,
                None => match self.create_inbound(&key2, tcp_flags, nat, secs) {
                    Ok(v) => v,
                    Err(r) => return Verdict::Drop(r),
                },
            };
            self.account(nat, &view2, Direction::Inbound, tcp_flags, seg.as_ref(), secs, len);
            rewrite::translate(buf, &mut p, Direction::Inbound, &view2.tuple, view2.deltas, false);
            self.stats.event(Event::Hairpinned);
            to_pod = true;
        }

        if let Frag::First { ident, key_proto } = p.frag {
            let fk = FragKey { src: orig.0, dst: orig.1, ident, proto: key_proto };
            let tr = FragTranslation { new_src: p.src, new_dst: p.dst, direction: dir, policy_slot: view.policy_slot };
            if nat.fragments.insert(fk, tr, secs).is_err() {
                return Verdict::Drop(DropReason::FragmentCacheFull);
            }
        }
        self.forward(buf, len, &p, to_pod)
    }

    /// The session index's answer for `key`, through the worker's flow cache:
    /// a remembered ref is re-checked against its slot (a freed or reused
    /// slot is a miss, see nat/flow_cache.rs), else the index is asked and its
    /// answer remembered.
    #[inline(always)]
    pub(super) fn lookup<A: Family>(
        &mut self,
        nat: &NatTable<A>,
        key: &FlowKey<A>,
    ) -> Option<(SessionRef, SessionView<A>)> {
        let cache = A::flow_cache(self.flows);
        if let Some(hit) = cache.get(key).and_then(|r| nat.sessions.lookup_at(key, r)) {
            return Some(hit);
        }
        // Only the ref comes back from the index (a view returned through
        // memory would have every hit's view written there too).
        let r = nat.sessions.lookup_ref(key)?;
        let hit = nat.sessions.lookup_at(key, r)?;
        cache.put(key, r);
        Some(hit)
    }

    /// Puts a session just made for the frame's `key` (or found made by
    /// another worker) into the worker's flow cache, so that the flow's
    /// next packet here (a TCP handshake's ACK, a UDP flow's second
    /// datagram) finds its slot without asking the shared map. Its entry
    /// was read by the miss a moment ago: the write costs no fetch.
    #[inline]
    fn remember_created<A: Family>(&mut self, key: &FlowKey<A>, view: &SessionView<A>, dir: Direction) {
        A::flow_cache(self.flows).put(key, SessionRef::new(view.index, dir == Direction::Inbound));
    }

    /// Refreshes the session and tracks TCP state; counts the packet.
    ///
    /// `seg` is the TCP header of a TCP packet. The pod's acknowledgments
    /// and both SYNs' window-scale options are recorded for the RST window
    /// check; an inbound RST the pod would not accept (nat/tcp_state.rs
    /// `rst_acceptable`) is counted as `tcp_rst_out_of_window` and leaves
    /// the session as it was: no refresh, no state change, no offload
    /// change (the caller still translates and forwards it).
    ///
    /// The calls that want the view itself (`tcp_track`, `sync_changed`,
    /// `request_offload`, not inlined here) are each handed a copy made where
    /// they are called (`&{ *view }`), never `view`: a reference to the
    /// caller's view would have it written to memory whole for every
    /// packet, in case one of those rare calls comes (29 instructions an
    /// established packet, docs/benchmarks.md, "The session's view kept in
    /// registers").
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    pub(super) fn account<A: Family>(
        &self,
        nat: &NatTable<A>,
        view: &SessionView<A>,
        dir: Direction,
        tcp_flags: u8,
        seg: Option<&tcp_state::Segment>,
        secs: u32,
        len: usize,
    ) {
        if let (proto::TCP, Some(seg)) = (view.tuple.proto, seg) {
            use tcp_state::flags::{ACK, RST, SYN};
            if dir == Direction::Inbound
                && seg.flags & RST != 0
                && nat.tcp_track(&{ *view }).is_some_and(|t| !tcp_state::rst_acceptable(t, seg.seq))
            {
                self.stats.event(Event::TcpRstOutOfWindow);
                self.stats.traffic(view.policy_slot, dir, len);
                return;
            }
            if seg.flags & SYN != 0 || (dir == Direction::Outbound && seg.flags & ACK != 0) {
                let _ = nat.sessions.update_tcp_track(view.index, view.seq, |t| tcp_state::track_segment(t, dir, seg));
            }
        }
        let refresh = match (dir, view.tuple.proto) {
            (Direction::Outbound, _) => true,
            (Direction::Inbound, proto::UDP) => self.tables.nat.udp_inbound_refresh,
            (Direction::Inbound, _) => true,
        };
        // Within the second the view already shows, a touch would find
        // nothing to write: the slot is not looked up again.
        if refresh && view.last_seen != secs {
            nat.sessions.touch(view.index, view.seq, secs);
        }
        let mut tcp = view.tcp;
        if view.tuple.proto == proto::TCP && tcp_state::is_control(tcp_flags) {
            // A session removed since `view` was read keeps its bits (and
            // its slot's next tenant keeps its own).
            tcp =
                nat.sessions.update_tcp(view.index, view.seq, |s| tcp_state::update(s, dir, tcp_flags)).unwrap_or(tcp);
            // A standby must learn that the connection is established (or
            // closing): session sync journals the phase change.
            if tcp_state::phase(tcp) != tcp_state::phase(view.tcp) {
                nat.sync_changed(&{ *view });
            }
        }
        self.stats.traffic(view.policy_slot, dir, len);
        if view.offload & offload::BUSY == 0 && view.flags & session_flags::HAIRPIN == 0 && nat.offload_enabled() {
            let confirmed = match view.tuple.proto {
                // After the handshake (RFC 7857: both SYNs seen), on a plain
                // segment, and never once a FIN or RST was seen.
                proto::TCP => {
                    use tcp_state::seen;
                    let both_syns = tcp & (seen::SYN_OUT | seen::SYN_IN) == seen::SYN_OUT | seen::SYN_IN;
                    let picked_up = tcp & seen::PICKED_UP != 0 && dir == Direction::Inbound;
                    !tcp_state::is_control(tcp_flags)
                        && (both_syns || picked_up)
                        && tcp & (seen::FIN_OUT | seen::FIN_IN | seen::RST) == 0
                }
                // UDP and ICMP echo: once the remote has answered (or had
                // answered when an earlier request found the queue full).
                _ => dir == Direction::Inbound || view.offload & offload::CONFIRMED != 0,
            };
            if confirmed {
                nat.request_offload(&{ *view });
                self.stats.event(Event::OffloadRequested);
            }
        }
    }

    fn slow_path<A: Family>(
        &mut self,
        p: &IpPacket<A>,
        key: FlowKey<A>,
        tcp_flags: u8,
        nat: &NatTable<A>,
        secs: u32,
        admitted: Result<(), DropReason>,
    ) -> Result<(SessionView<A>, Direction), Verdict> {
        let tables = self.tables;
        match tables.classify(p.src, p.dst) {
            Decision::Steer(id) => {
                // Anti-spoofing before anything is created for the source.
                admitted.map_err(Verdict::Drop)?;
                let Some(policy) = tables.policy(id) else { return Err(Verdict::Pass) };
                match p.l4info {
                    L4::Echo { request: false, .. } => return Err(Verdict::Drop(DropReason::UnsupportedIcmpType)),
                    L4::Ports { .. }
                        if p.proto == proto::TCP
                            && tcp_flags & tcp_state::flags::SYN == 0
                            && !tables.nat.tcp_loose_pickup =>
                    {
                        return Err(Verdict::Drop(DropReason::TcpNoSession));
                    }
                    _ => {}
                }
                // A new flow: within the source's rate (existing sessions
                // never get here).
                if !self.admit_new_flow(&p.src) {
                    return Err(Verdict::Drop(DropReason::NewFlowRateLimited));
                }
                let req = OutboundRequest {
                    pod: p.src,
                    pod_port: key.sport(),
                    remote: p.dst,
                    remote_port: key.dport(),
                    proto: p.proto,
                    tcp_flags,
                };
                let log = self.log_to();
                let (egress_memo, pools) = A::creation_memos(self.flows);
                let egress = egress_memo.egress_for(tables, policy, req.pod);
                let deltas = |t: &SessionTuple<A>| rewrite::outbound_deltas(t);
                let mut ctx = CreateCtx {
                    tcp_flags,
                    log,
                    pools: Some(pools),
                    ..CreateCtx::new(secs, self.rng, self.stats, DeltaFnBox(&deltas))
                };
                let created = match egress {
                    Some(egress) => nat.create_outbound_on(&req, policy, egress, tables, &mut ctx),
                    None => Err(DropReason::NoEgressIpForFamily),
                };
                if let (Err(reason), Some(l)) = (&created, log) {
                    log_refusal(l, *reason, &req.pod, policy, tables);
                }
                created.map(|v| (v, Direction::Outbound)).map_err(Verdict::Drop)
            }
            _ if tables.owns_egress(p.dst.ip()) => {
                // What Egret does not serve: a Service VIP's is the kernel's
                // (Service ingress); another egress IP's is dropped, the
                // kernel does not own the address (the XDP program's rule 4).
                let unserved = if tables.egress(p.dst.ip()).is_some_and(|e| e.kernel_service) {
                    Verdict::Pass
                } else {
                    Verdict::Drop(DropReason::UnservedToEgress)
                };
                match p.l4info {
                    L4::Ports { dport, .. } => {
                        let in_range = tables.egress(p.dst.ip()).is_some_and(|e| e.ports.contains(dport));
                        if !in_range {
                            return Err(unserved);
                        }
                    }
                    L4::Echo { request: true, .. } => return Err(unserved),
                    L4::Echo { request: false, .. } => return Err(Verdict::Drop(DropReason::InboundNoMapping)),
                    _ => return Err(unserved),
                }
                // A remote source opening sessions through endpoint-independent
                // mappings is limited like a pod; what would be dropped anyway
                // (unmapped port, filtered) keeps its own counter.
                if tables.nat.new_flows_per_second_per_source != 0
                    && tables.nat.filtering == FilteringBehavior::EndpointIndependent
                    && nat.mappings.existing_pool(key.dst, key.proto).is_some_and(|p| p.owner(key.dport()).is_some())
                    && !self.admit_new_flow(&key.src)
                {
                    return Err(Verdict::Drop(DropReason::NewFlowRateLimited));
                }
                self.create_inbound(&key, tcp_flags, nat, secs).map(|v| (v, Direction::Inbound)).map_err(Verdict::Drop)
            }
            _ => Err(Verdict::Pass),
        }
    }

    /// Whether `source` may create one more session now
    /// (`nat.newFlowsPerSecondPerSource`, nat/flow_rate.rs).
    #[inline]
    fn admit_new_flow<A: std::hash::Hash>(&mut self, source: &A) -> bool {
        let nat = &self.tables.nat;
        self.flow_rate.admit(source, nat.new_flows_per_second_per_source, nat.new_flow_burst_per_source, self.now)
    }

    /// Anti-spoofing: whether the frame in `buf` may be a pod's, by its
    /// receiving interface and link-layer sender (ingress.rs).
    #[inline]
    fn admits_pods(&self, buf: &[u8], meta: RxMeta) -> Result<(), DropReason> {
        if !self.ingress.restricts() || self.decapsulated {
            return Ok(());
        }
        self.ingress.admits_pods(meta.ifindex, buf.get(6..12).unwrap_or(&[]))
    }

    /// Answers an echo request to an egress IP in place, within
    /// [`ECHO_ANSWERS_PER_SEC`] (all workers together, as Linux's
    /// `icmp_msgs_per_sec`).
    fn answer_echo<A: Family>(&mut self, buf: &mut [u8], p: &IpPacket<A>, now: Timestamp) -> Verdict {
        use std::sync::atomic::Ordering;
        let second = u64::from(now.secs());
        let window = &self.shared.echo_window;
        let mut cur = window.load(Ordering::Relaxed);
        loop {
            let next = match (cur >> 32, cur & 0xffff_ffff) {
                (s, n) if s == second && n >= u64::from(ECHO_ANSWERS_PER_SEC) => {
                    return Verdict::Drop(DropReason::EchoRateLimited);
                }
                (s, _) if s == second => cur + 1,
                _ => (second << 32) | 1,
            };
            match window.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break,
                Err(seen) => cur = seen,
            }
        }
        let outcome = if A::ICMP_PROTO == proto::ICMP {
            neigh_responder::answer_echo_v4(buf, p.l3, p.l4, p.end)
        } else {
            neigh_responder::answer_echo_v6(buf, p.l3, p.l4, p.end)
        };
        match outcome {
            NeighOutcome::Answered { len } => {
                self.stats.event(Event::EchoAnswered);
                Verdict::Answer { len }
            }
            NeighOutcome::Malformed(_) => Verdict::Drop(DropReason::BadIcmpChecksum),
            NeighOutcome::NotOurs => Verdict::Drop(DropReason::UnservedToEgress),
        }
    }

    fn create_inbound<A: Family>(
        &mut self,
        key: &FlowKey<A>,
        tcp_flags: u8,
        nat: &NatTable<A>,
        secs: u32,
    ) -> Result<SessionView<A>, DropReason> {
        if self.tables.nat.filtering != FilteringBehavior::EndpointIndependent {
            // Still say whether the port is mapped at all (two counters).
            let mapped = nat.mappings.existing_pool(key.dst, key.proto).is_some_and(|p| p.owner(key.dport()).is_some());
            return Err(if mapped { DropReason::InboundFiltered } else { DropReason::InboundNoMapping });
        }
        let deltas = |t: &SessionTuple<A>| rewrite::outbound_deltas(t);
        let log = self.log_to();
        let mut ctx = CreateCtx { tcp_flags, log, ..CreateCtx::new(secs, self.rng, self.stats, DeltaFnBox(&deltas)) };
        nat.create_inbound(key, self.tables, &mut ctx)
    }

    fn later_fragment<A: Family>(
        &mut self,
        buf: &mut [u8],
        len: usize,
        p: &mut IpPacket<A>,
        fk: &FragKey<A>,
        nat: &NatTable<A>,
        secs: u32,
    ) -> Verdict {
        match nat.fragments.lookup(fk, secs) {
            Some(tr) => {
                rewrite::translate_addresses(buf, p, tr.new_src, tr.new_dst);
                self.stats.event(Event::FragmentTranslated);
                self.stats.traffic(tr.policy_slot, tr.direction, len);
                self.forward(buf, len, p, tr.direction == Direction::Inbound)
            }
            None => {
                let from_outside = self.tables.owns_egress(p.dst.ip());
                let ours = from_outside || matches!(self.tables.classify(p.src, p.dst), Decision::Steer(_));
                if !ours {
                    Verdict::Pass
                } else if self.hold_fragments {
                    // Its first fragment may still come (out of order).
                    Verdict::HoldFragment {
                        src: p.src.ip(),
                        dst: p.dst.ip(),
                        ident: fk.ident,
                        proto: fk.proto,
                        from_outside,
                    }
                } else {
                    Verdict::Drop(DropReason::FragmentUnmatched)
                }
            }
        }
    }

    /// TTL, then the L2 next hop. `to_pod`: the packet is a translated one
    /// going to a pod, which may leave through a link Egret does not drive
    /// (an overlay's tunnel), handed to the kernel ([`Verdict::ToKernel`]).
    #[inline]
    fn forward<A: Family>(&mut self, buf: &mut [u8], len: usize, p: &IpPacket<A>, to_pod: bool) -> Verdict {
        if p.hop_limit <= 1 {
            return Verdict::Drop(DropReason::TtlExceeded);
        }
        // What `undeliverable` did not see (later fragments, ICMP errors,
        // hairpinned packets) is dropped without an error when too large.
        if self.egress_mtu(p.end - p.l3, p.dst.ip(), to_pod).is_some() {
            return Verdict::Drop(DropReason::MtuExceeded);
        }
        A::decrement_hop_limit(&mut buf[p.l3..]);
        // To the kernel, the kernel routes it as it routes its own
        // packets: it does not decrement the TTL of a packet it sends (done
        // above, as the router this gateway is) and refuses one larger
        // than the link's MTU (checked above too, with the kernel link's
        // MTU, so the sender gets the error a router owes it).
        self.via_next_hop(buf, len, p.dst.ip(), to_pod.then_some((p.l3, p.end)))
    }

    /// The egress link's MTU when a datagram of `ip_len` bytes to `to` is
    /// larger than it (`None` when it fits or the route is unknown: the
    /// next-hop lookup then says why). `to_pod`: a translated packet to a
    /// pod, for which a kernel link (an overlay's tunnel) is a way out too.
    #[inline]
    fn egress_mtu(&self, ip_len: usize, to: IpAddr, to_pod: bool) -> Option<u32> {
        let ip_len = u32::try_from(ip_len).unwrap_or(u32::MAX);
        if ip_len <= self.fib.min_mtu() {
            return None;
        }
        let oif = self.fib.route(to)?.oif;
        let mtu = self.fib.mtu(oif).or_else(|| to_pod.then(|| self.fib.kernel_link_mtu(oif)).flatten())?;
        (ip_len > mtu).then_some(mtu)
    }

    /// A router's checks before it forwards a session's datagram, on the
    /// datagram as its sender wrote it (so the error quotes what the sender
    /// can match): the TTL or hop limit (RFC 1812 5.3.1, RFC 4443 3.3) and
    /// the egress link's MTU (RFC 1191, RFC 1812 5.2.7.1; RFC 4443 3.2,
    /// RFC 8201). A datagram that fails one is dropped and counted, and an
    /// ICMP error goes back to its sender, rate-limited (icmp_gen.rs):
    /// outbound, to the pod from the gateway's address on the way back
    /// (RFC 1812 4.3.2.4); inbound, to the remote from the egress IP it
    /// wrote to.
    ///
    /// IPv4 without DF over the MTU is not fragmented (one frame in, one
    /// out): it gets Fragmentation Needed as well, which Linux and other
    /// hosts apply whatever the DF bit (they fragment at the source from
    /// then on); counted `mtu_exceeded` like the rest.
    fn undeliverable<A: Family>(
        &mut self,
        buf: &mut [u8],
        p: &IpPacket<A>,
        view: &SessionView<A>,
        dir: Direction,
        now: Timestamp,
    ) -> Option<Verdict> {
        let kind = if p.hop_limit <= 1 {
            ErrorKind::TimeExceeded
        } else if view.flags & session_flags::HAIRPIN != 0 {
            return None;
        } else {
            let to = match dir {
                Direction::Outbound => p.dst.ip(),
                Direction::Inbound => view.tuple.pod.ip(),
            };
            ErrorKind::TooBig { mtu: self.egress_mtu(p.end - p.l3, to, dir == Direction::Inbound)? }
        };
        let reason = match kind {
            ErrorKind::TimeExceeded => DropReason::TtlExceeded,
            ErrorKind::TooBig { .. } => DropReason::MtuExceeded,
        };
        let from = match dir {
            Direction::Outbound => self.fib.source_for(p.src.ip()),
            Direction::Inbound => Some(p.dst.ip()),
        };
        let Some(from) = from else { return Some(Verdict::Drop(reason)) };
        if !self.shared.icmp_errors.lock().allow(now) {
            self.stats.event(Event::IcmpErrorRateLimited);
            return Some(Verdict::Drop(reason));
        }
        let written = match from {
            IpAddr::V4(s) => icmp_gen::write_v4(buf, p.l3, p.end, s, kind),
            IpAddr::V6(s) => {
                let l4 = (!matches!(p.frag, Frag::Later { .. })).then_some(p.l4);
                icmp_gen::write_v6(buf, p.l3, l4, p.end, p.proto, s, kind)
            }
        };
        let Some(len) = written else { return Some(Verdict::Drop(reason)) };
        // The datagram is dropped (counted here); the error is sent (and
        // counted as forwarded).
        self.stats.dropped(reason);
        self.stats.event(Event::IcmpErrorSent);
        Some(self.via_next_hop(buf, len, p.src.ip(), None))
    }

    /// The L2 next hop of a frame to `dst`, whose IP part is ready to send.
    /// `kernel`: the IP packet's bounds in the frame when it may be handed
    /// to the kernel (a translated packet to a pod), for a route through a
    /// link Egret does not drive.
    fn via_next_hop(&mut self, buf: &mut [u8], len: usize, dst: IpAddr, kernel: Option<(usize, usize)>) -> Verdict {
        match self.next_hops.lookup(self.fib, &self.shared.neighbor_use, dst, self.secs) {
            NextHop::Resolved { oif, src_mac, dst_mac } => {
                let mut f = ethernet::Frame::new_unchecked(&mut buf[..len]);
                f.set_dst_addr(EthernetAddress(dst_mac));
                f.set_src_addr(EthernetAddress(src_mac));
                Verdict::Forward { ifindex: oif, len }
            }
            NextHop::Unresolved { oif, addr } => {
                let _ = self.shared.resolve.push(ResolveRequest { ifindex: oif, addr });
                if self.hold_unresolved {
                    Verdict::Hold { ifindex: oif, next_hop: addr, len }
                } else {
                    Verdict::Drop(DropReason::NeighborUnresolved)
                }
            }
            NextHop::Kernel { .. } => match kernel {
                Some((l3, end)) => Verdict::ToKernel { l3, end },
                // Only a translated packet to a pod may go that way.
                None => Verdict::Drop(DropReason::NoRoute),
            },
            NextHop::NoRoute => Verdict::Drop(DropReason::NoRoute),
        }
    }
}

/// What a frame's transport checksum holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChecksumState {
    /// A full checksum: translated with an incremental update.
    Complete,
    /// Only the pseudo-header sum (a local or veth sender's offload): the
    /// translation completes it over the segment.
    Partial,
    /// A full checksum that happens to equal its pseudo-header sum (about 1
    /// frame in 65536, `wire::checksum::is_partial`), told apart by summing
    /// the segment: complete, and counted `checksum_looked_partial`. The
    /// fast path punts such frames as `punt_partial_checksum`; this is how
    /// the counters show a punt was not a partial checksum.
    LookedPartial,
}

/// Whether the transport checksum is complete or holds only a pseudo-header
/// sum. A field that looks partial is checked against the segment, a pass
/// over it that only such frames pay.
#[inline]
fn checksum_state<A: Family>(buf: &[u8], p: &IpPacket<A>, meta: RxMeta) -> ChecksumState {
    if p.frag != Frag::None || (p.proto != proto::TCP && p.proto != proto::UDP) {
        return ChecksumState::Complete;
    }
    match meta.checksum {
        ChecksumHint::Complete => ChecksumState::Complete,
        ChecksumHint::Partial => ChecksumState::Partial,
        ChecksumHint::Unknown => match p.l4info {
            L4::Ports { csum, .. } => {
                let pseudo = A::pseudo_sum(&p.src, &p.dst, p.proto, p.l4_len());
                if csum == 0 || !checksum::is_partial(csum, pseudo) {
                    ChecksumState::Complete
                } else if buf.get(p.l4..p.end).is_some_and(|l4| checksum::fold(checksum::sum(l4, pseudo)) == 0xffff) {
                    ChecksumState::LookedPartial
                } else {
                    ChecksumState::Partial
                }
            }
            _ => ChecksumState::Complete,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::Engine;
    use crate::fixtures;
    use crate::ownership::Ownership;

    /// Issue 14 item 6: with every owned address (egress IPs, answered next
    /// hops) past its valid-until, no fixture frame is translated from or
    /// to one, nor answered for one: each such frame is dropped and counted
    /// as `ownership_expired`. Without a valid-until the same frames are
    /// forwarded and answered (the reference run), so the check is live.
    #[test]
    fn nothing_is_sent_or_answered_for_an_address_past_its_valid_until() {
        use std::net::IpAddr;
        let (mut refused, mut would_have_sent) = (0u64, 0u64);
        for s in fixtures::scenarios() {
            let owned: Vec<IpAddr> =
                s.spec.egress_ips.iter().map(|e| e.ip).chain(s.spec.neighbor_addresses.iter().copied()).collect();
            let judge = Ownership::default();
            judge.expire(&owned);
            // Also with the pods behind an overlay's tunnel, where their
            // replies (and hairpinned packets, from an egress IP) go to the
            // kernel (ADR 0008).
            for (expired, fib) in [
                (false, fixtures::topology()),
                (true, fixtures::topology()),
                (false, fixtures::overlay_topology()),
                (true, fixtures::overlay_topology()),
            ] {
                let engine = Engine::new(&s.spec).expect("fixture config");
                engine.publish_fib(fib);
                if expired {
                    engine.ownership().expire(&owned);
                }
                let mut w = engine.pipeline_seeded(PortRng::new(0x5eed));
                for st in &s.steps {
                    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
                    buf[..st.frame.len()].copy_from_slice(&st.frame);
                    let meta = RxMeta { ifindex: st.ingress, checksum: ChecksumHint::Unknown };
                    let now = Timestamp::from_secs(st.at);
                    let received_owned = judge.frame_expired(&st.frame, now);
                    let v = w.process(&mut buf, st.frame.len(), meta, now);
                    let sent_owned = match v {
                        Verdict::Forward { len, .. } | Verdict::Answer { len } | Verdict::ToKernel { end: len, .. } => {
                            judge.frame_expired(&buf[..len], now)
                        }
                        _ => false,
                    };
                    if expired {
                        assert!(!sent_owned, "{} ({}): sent {v:?} for an expired address", s.name, st.what);
                        if received_owned {
                            assert_eq!(v, Verdict::Drop(DropReason::OwnershipExpired), "{} ({})", s.name, st.what);
                        }
                    } else if sent_owned {
                        would_have_sent += 1;
                    }
                }
                if expired {
                    refused += engine.stats().dropped(DropReason::OwnershipExpired);
                }
            }
        }
        assert!(would_have_sent >= 20, "the fixtures send only {would_have_sent} frames for owned addresses");
        assert!(refused >= would_have_sent, "{refused} drops counted for {would_have_sent} frames");
    }

    /// A frame processed at or after its egress IP's valid-until is dropped,
    /// one processed before it goes: the engine judges by the time it
    /// processes the frame (a frame that waited in a ring across the
    /// deadline is judged late), not by when it arrived.
    #[test]
    fn the_valid_until_is_judged_at_processing_time() {
        // The first fixture frame a fresh engine translates to or from an egress IP.
        let first = |s: &fixtures::Scenario, st: &fixtures::Step| {
            let e = Engine::new(&s.spec).unwrap();
            e.publish_fib(fixtures::topology());
            let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
            buf[..st.frame.len()].copy_from_slice(&st.frame);
            let meta = RxMeta { ifindex: st.ingress, checksum: ChecksumHint::Unknown };
            let Verdict::Forward { len, .. } =
                e.pipeline_seeded(PortRng::new(1)).process(&mut buf, st.frame.len(), meta, Timestamp::ZERO)
            else {
                return None;
            };
            s.spec.egress_ips.iter().map(|e| e.ip).find(|ip| {
                let judge = Ownership::default();
                judge.expire(&[*ip]);
                judge.frame_expired(&buf[..len], Timestamp::ZERO)
            })
        };
        let scenarios = fixtures::scenarios();
        let (s, step, egress) = scenarios
            .iter()
            .find_map(|s| s.steps.iter().find_map(|st| first(s, st).map(|ip| (s, st, ip))))
            .expect("a fixture frame translated from or to an egress IP");
        let engine = Engine::new(&s.spec).expect("fixture config");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(0x5eed));
        engine.ownership().set([(egress, Some(Timestamp::from_millis(10_000)))]);
        let run = |w: &mut Pipeline, at: Timestamp| {
            let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
            buf[..step.frame.len()].copy_from_slice(&step.frame);
            w.process(&mut buf, step.frame.len(), RxMeta { ifindex: step.ingress, checksum: ChecksumHint::Unknown }, at)
        };
        assert!(matches!(run(&mut w, Timestamp::from_millis(9_999)), Verdict::Forward { .. }));
        assert_eq!(run(&mut w, Timestamp::from_millis(10_000)), Verdict::Drop(DropReason::OwnershipExpired));
        // Renewed: served again.
        engine.ownership().set([(egress, Some(Timestamp::from_millis(20_000)))]);
        assert!(matches!(run(&mut w, Timestamp::from_millis(10_001)), Verdict::Forward { .. }));
    }

    /// An outbound ICMP error about pod A's session is translated when pod
    /// A or an inside router (unselected) sends it, and dropped when another
    /// selected pod does. Before, pod B's error left with the egress IP.
    #[test]
    fn an_outbound_icmp_error_must_come_from_the_sessions_pod_or_a_router() {
        let (engine, mut w) = router(1500);
        let out = fixtures::from_pod(
            IpAddr::V4(fixtures::POD_A),
            IpAddr::V4(fixtures::SERVER),
            fixtures::udp(40000, 5353, b"q"),
        );
        let (v, _) = send(&mut w, &out.frame(), fixtures::INSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. }), "{v:?}");
        // What pod A received (the reply, translated back).
        let received = fixtures::from_outside(
            IpAddr::V4(fixtures::SERVER),
            IpAddr::V4(fixtures::POD_A),
            fixtures::udp(5353, 40000, b"r"),
        );
        let unreachable = |from: Ipv4Addr| {
            fixtures::from_pod(
                IpAddr::V4(from),
                IpAddr::V4(fixtures::SERVER),
                crate::fixtures::build::Transport::IcmpError {
                    msg_type: 3,
                    code: 3,
                    rest: [0; 4],
                    embedded: Box::new(received.clone()),
                    keep: 28,
                },
            )
        };
        let (v, _) = send(&mut w, &unreachable(fixtures::POD_B).frame(), fixtures::INSIDE, 0);
        assert_eq!(v, Verdict::Drop(DropReason::IcmpErrorSpoofed), "another pod");
        for from in [fixtures::POD_A, fixtures::NODE] {
            let (v, out) = send(&mut w, &unreachable(from).frame(), fixtures::INSIDE, 0);
            assert!(matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. }), "from {from}: {v:?}");
            assert_eq!(&out[14 + 12..14 + 16], &fixtures::E1.octets(), "from {from}: leaves as the egress IP");
        }
        assert_eq!(engine.stats().dropped(DropReason::IcmpErrorSpoofed), 1);
    }

    /// The gateway's inside addresses, the source of the errors it sends pods.
    const GW_INSIDE4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
    const GW_INSIDE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 2);

    /// The fixture gateway with its inside addresses and an outside link of
    /// `outside_mtu`.
    fn router(outside_mtu: u32) -> (Engine, Pipeline) {
        let mut fib = fixtures::topology();
        fib.add_interface(crate::fib::Interface {
            ifindex: fixtures::OUTSIDE,
            name: "outside".into(),
            mac: fixtures::GW_OUT,
            mtu: outside_mtu,
        })
        .add_address(fixtures::INSIDE, IpAddr::V4(GW_INSIDE4))
        .add_address(fixtures::INSIDE, IpAddr::V6(GW_INSIDE6))
        .add_route(
            IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0)),
            64,
            crate::fib::Route { oif: fixtures::INSIDE, gateway: None },
        );
        let engine = Engine::new(&fixtures::base_spec()).expect("fixture config");
        engine.publish_fib(fib);
        let w = engine.pipeline_seeded(PortRng::new(7));
        (engine, w)
    }

    fn send(w: &mut Pipeline, frame: &[u8], ingress: u32, at: u64) -> (Verdict, Vec<u8>) {
        let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
        buf[..frame.len()].copy_from_slice(frame);
        let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
        let v = w.process(&mut buf, frame.len(), meta, Timestamp::from_millis(at));
        let len = match v {
            Verdict::Forward { len, .. } | Verdict::Answer { len } => len,
            _ => 0,
        };
        buf.truncate(len);
        (v, buf)
    }

    /// The ICMP error in `frame`: (source, destination, type, code, the 4
    /// bytes after the checksum, the quoted datagram), its checksums checked.
    fn icmp_error(frame: &[u8]) -> (IpAddr, IpAddr, u8, u8, [u8; 4], Vec<u8>) {
        let h = etherparse::SlicedPacket::from_ethernet(frame).expect("a frame");
        let (src, dst, icmp) = match h.net.expect("ip") {
            etherparse::InternetSlice::Ipv4(ip) => (
                IpAddr::V4(ip.header().source_addr()),
                IpAddr::V4(ip.header().destination_addr()),
                ip.payload().payload,
            ),
            etherparse::InternetSlice::Ipv6(ip) => (
                IpAddr::V6(ip.header().source_addr()),
                IpAddr::V6(ip.header().destination_addr()),
                ip.payload().payload,
            ),
            other => panic!("{other:?}"),
        };
        let valid = match (src, dst) {
            (IpAddr::V6(s), IpAddr::V6(d)) => crate::wire::icmpv6::Packet::new_unchecked(icmp).verify_checksum(&s, &d),
            _ => {
                let h = &frame[14..34];
                checksum::fold(checksum::sum(h, 0)) == 0xffff
                    && crate::wire::icmpv4::Packet::new_unchecked(icmp).verify_checksum()
            }
        };
        assert!(valid, "checksums");
        (src, dst, icmp[0], icmp[1], icmp[4..8].try_into().unwrap(), icmp[8..].to_vec())
    }

    /// Traceroute through the gateway: TTL 1 gets Time Exceeded from the
    /// gateway's inside address, quoting the pod's datagram untranslated;
    /// TTL 2 goes out with TTL 1. Before, TTL 1 was dropped in silence.
    #[test]
    fn ttl_one_gets_time_exceeded_from_the_inside_address() {
        let (engine, mut w) = router(1500);
        let mut probe = fixtures::from_pod(
            IpAddr::V4(fixtures::POD_A),
            IpAddr::V4(fixtures::SERVER),
            fixtures::udp(40000, 33434, b"probe"),
        );
        probe.ttl = 1;
        let (v, out) = send(&mut w, &probe.frame(), fixtures::INSIDE, 0);
        assert_eq!(v, Verdict::Forward { ifindex: fixtures::INSIDE, len: out.len() });
        assert_eq!(&out[..6], &fixtures::NODE_MAC, "back through the node router");
        let (src, dst, ty, code, _, quoted) = icmp_error(&out);
        assert_eq!((src, dst, ty, code), (IpAddr::V4(GW_INSIDE4), IpAddr::V4(fixtures::POD_A), 11, 0));
        assert_eq!(quoted, probe.ip_bytes(), "the pod's datagram as it sent it");
        let s = engine.stats();
        assert_eq!((s.dropped(DropReason::TtlExceeded), s.event(Event::IcmpErrorSent)), (1, 1));

        probe.ttl = 2;
        let (v, out) = send(&mut w, &probe.frame(), fixtures::INSIDE, 0);
        assert_eq!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, len: out.len() });
        assert_eq!(out[14 + 8], 1, "TTL decremented");
        assert_eq!(&out[14 + 12..14 + 16], &fixtures::E1.octets(), "translated");
    }

    /// A DF datagram larger than the outside link's MTU gets Fragmentation
    /// Needed with that MTU (RFC 1191), also once the flow is established
    /// (the straight pass must not send it); a datagram that fits goes out.
    /// IPv6 gets Packet Too Big. Before, both left and died on the link.
    #[test]
    fn oversize_datagrams_get_frag_needed_or_packet_too_big() {
        let (engine, mut w) = router(1280);
        let pod = |len: usize| {
            fixtures::from_pod(
                IpAddr::V4(fixtures::POD_A),
                IpAddr::V4(fixtures::SERVER),
                fixtures::udp(40000, 9000, &vec![7; len]),
            )
        };
        let (v, _) = send(&mut w, &pod(100).frame(), fixtures::INSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. }), "{v:?}");
        let reply = fixtures::from_outside(
            IpAddr::V4(fixtures::SERVER),
            IpAddr::V4(fixtures::E1),
            fixtures::udp(9000, 40000, b"ok"),
        );
        let (v, _) = send(&mut w, &reply.frame(), fixtures::OUTSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::INSIDE, .. }), "{v:?}");

        // 20 + 8 + 1252 = 1280 fits; one byte more does not.
        let (v, _) = send(&mut w, &pod(1252).frame(), fixtures::INSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. }), "{v:?}");
        let big = pod(1422);
        let (v, out) = send(&mut w, &big.frame(), fixtures::INSIDE, 0);
        assert_eq!(v, Verdict::Forward { ifindex: fixtures::INSIDE, len: out.len() });
        let (src, dst, ty, code, rest, quoted) = icmp_error(&out);
        assert_eq!((src, dst, ty, code), (IpAddr::V4(GW_INSIDE4), IpAddr::V4(fixtures::POD_A), 3, 4));
        assert_eq!(u16::from_be_bytes([rest[2], rest[3]]), 1280, "next-hop MTU");
        assert_eq!(out.len(), 14 + 576, "at most 576 bytes (RFC 1812 4.3.2.3)");
        assert_eq!(&quoted[..], &big.ip_bytes()[..quoted.len()]);
        assert_eq!(engine.stats().dropped(DropReason::MtuExceeded), 1);

        let big6 = fixtures::from_pod(
            IpAddr::V6(fixtures::POD6),
            IpAddr::V6(fixtures::SERVER6),
            fixtures::udp(40000, 9000, &[7; 1300]),
        );
        let (v, out) = send(&mut w, &big6.frame(), fixtures::INSIDE, 0);
        assert_eq!(v, Verdict::Forward { ifindex: fixtures::INSIDE, len: out.len() });
        let (src, dst, ty, code, rest, _) = icmp_error(&out);
        assert_eq!((src, dst, ty, code), (IpAddr::V6(GW_INSIDE6), IpAddr::V6(fixtures::POD6), 2, 0));
        assert_eq!(u32::from_be_bytes(rest), 1280);
        assert_eq!(engine.stats().dropped(DropReason::MtuExceeded), 2);
    }

    /// Originated errors are rate-limited: a burst of 50, then 1000 a second.
    #[test]
    fn originated_errors_are_rate_limited() {
        let (engine, mut w) = router(1500);
        let mut probe = fixtures::from_pod(
            IpAddr::V4(fixtures::POD_A),
            IpAddr::V4(fixtures::SERVER),
            fixtures::udp(40000, 33434, b"probe"),
        );
        probe.ttl = 1;
        let sent = (0..80)
            .filter(|_| matches!(send(&mut w, &probe.frame(), fixtures::INSIDE, 0).0, Verdict::Forward { .. }))
            .count();
        assert_eq!(sent, icmp_gen::ICMP_ERRORS_BURST as usize);
        let s = engine.stats();
        assert_eq!(s.event(Event::IcmpErrorRateLimited), 80 - sent as u64);
        assert_eq!(s.dropped(DropReason::TtlExceeded), 80, "every probe dropped and counted");
        // 10 ms later: 10 more tokens.
        let later = (0..20)
            .filter(|_| matches!(send(&mut w, &probe.frame(), fixtures::INSIDE, 10).0, Verdict::Forward { .. }))
            .count();
        assert_eq!(later, 10);
    }

    /// A full UDP checksum that equals its pseudo-header sum (the mark of a
    /// partial one) is found complete over the segment and counted
    /// `checksum_looked_partial`; a partial one is completed and counted
    /// `partial_checksum_completed`. Both leave with a correct checksum.
    #[test]
    fn a_full_checksum_that_looks_partial_is_told_apart() {
        use crate::fixtures::build::{Csum, Transport};
        use std::net::IpAddr;
        let (engine, mut w) = router(1500);
        let datagram = |payload: Vec<u8>, csum| {
            fixtures::from_pod(
                IpAddr::V4(fixtures::POD_A),
                IpAddr::V4(fixtures::SERVER),
                Transport::Udp { sport: 40000, dport: 53, payload, csum },
            )
        };
        const CSUM_AT: usize = ethernet::HEADER_LEN + 20 + 6;
        let pseudo = checksum::fold(checksum::pseudo_header_v4(fixtures::POD_A, fixtures::SERVER, proto::UDP, 8 + 6));
        // The first two payload bytes chosen so that the full checksum is the pseudo-header sum.
        let lookalike = (0..=u16::MAX)
            .map(|x| datagram([x.to_be_bytes().as_slice(), b"look"].concat(), Csum::Full).frame())
            .find(|f| u16::from_be_bytes([f[CSUM_AT], f[CSUM_AT + 1]]) == pseudo)
            .expect("some payload word gives it");
        let partial = datagram(b"partial".to_vec(), Csum::Partial).frame();
        for (frame, looked, completed) in [(&lookalike, 1, 0), (&partial, 1, 1)] {
            let (v, out) = send(&mut w, frame, fixtures::INSIDE, 0);
            assert!(matches!(v, Verdict::Forward { .. }), "{v:?}");
            let h = etherparse::SlicedPacket::from_ethernet(&out).expect("a frame");
            let (Some(etherparse::NetSlice::Ipv4(ip)), Some(etherparse::TransportSlice::Udp(udp))) =
                (h.net, h.transport)
            else {
                panic!("not UDP over IPv4: {out:02x?}");
            };
            let src = ip.header().source_addr();
            assert_eq!(src, fixtures::E1);
            let sum = checksum::sum(
                udp.slice(),
                checksum::pseudo_header_v4(src, fixtures::SERVER, proto::UDP, udp.slice().len() as u32),
            );
            assert_eq!(checksum::fold(sum), 0xffff, "the checksum leaves correct");
            let s = engine.stats();
            assert_eq!(s.event(Event::ChecksumLookedPartial), looked);
            assert_eq!(s.event(Event::PartialChecksumCompleted), completed);
        }
    }

    /// An IPv6 datagram with a Destination Options header after its Fragment
    /// header: the first fragment reaches UDP behind the options, later
    /// fragments stop at the Fragment header (Next Header 60). Both must key
    /// the fragment cache alike (the Fragment header's Next Header), or every
    /// later fragment is dropped as unmatched.
    #[test]
    fn ipv6_fragments_with_headers_after_the_fragment_header_match() {
        use std::net::IpAddr;
        const FRAG: usize = ethernet::HEADER_LEN + 40;
        let payload: Vec<u8> = (0..2000u32).map(|i| i as u8).collect();
        let mut dgram = fixtures::from_pod(
            IpAddr::V6(fixtures::POD6),
            IpAddr::V6(fixtures::SERVER6),
            fixtures::udp(40000, 9000, &payload),
        );
        dgram.ident = 0x0606;
        let mut frames = dgram.fragments(1000);
        for (i, f) in frames.iter_mut().enumerate() {
            f[FRAG] = 60;
            if i == 0 {
                // Next Header UDP, length 0 (8 bytes), one PadN option.
                f.splice(FRAG + 8..FRAG + 8, [17, 0, 1, 4, 0, 0, 0, 0]);
                let plen = u16::from_be_bytes([f[ethernet::HEADER_LEN + 4], f[ethernet::HEADER_LEN + 5]]) + 8;
                f[ethernet::HEADER_LEN + 4..ethernet::HEADER_LEN + 6].copy_from_slice(&plen.to_be_bytes());
            }
        }
        let engine = Engine::new(&fixtures::base_spec()).expect("fixture config");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(1));
        for (i, f) in frames.iter().enumerate() {
            let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
            buf[..f.len()].copy_from_slice(f);
            let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
            let v = w.process(&mut buf, f.len(), meta, Timestamp::from_secs(0));
            assert_eq!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, len: f.len() }, "fragment {i}");
            let src = Ipv6Addr::from(<[u8; 16]>::try_from(&buf[ethernet::HEADER_LEN + 8..][..16]).unwrap());
            assert_eq!(src, fixtures::E6, "fragment {i} leaves with the egress IP");
        }
        assert!(frames.len() >= 3, "a first and at least two later fragments");
        assert_eq!(engine.stats().event(Event::FragmentTranslated), frames.len() as u64 - 1);
    }

    /// A source creating sessions beyond `nat.newFlowsPerSecondPerSource`
    /// (past its burst) is dropped as `new_flow_rate_limited`, while
    /// another pod still creates flows, the source's established flows go
    /// on, and its tokens come back with time. Before, every flow was
    /// created (the counter did not exist).
    #[test]
    fn new_flows_are_limited_per_source_and_refill_with_time() {
        let mut spec = fixtures::base_spec();
        spec.nat.new_flows_per_second_per_source = 10;
        spec.nat.new_flow_burst_per_source = 3;
        let engine = Engine::new(&spec).expect("fixture config");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(7));
        let flow = |pod: Ipv4Addr, sport: u16| {
            fixtures::from_pod(IpAddr::V4(pod), IpAddr::V4(fixtures::SERVER), fixtures::udp(sport, 53, b"q")).frame()
        };
        let forwarded = |v: Verdict| matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. });
        for sport in 40000..40003 {
            let (v, _) = send(&mut w, &flow(fixtures::POD_A, sport), fixtures::INSIDE, 1000);
            assert!(forwarded(v), "within the burst: {v:?}");
        }
        let (v, _) = send(&mut w, &flow(fixtures::POD_A, 40003), fixtures::INSIDE, 1000);
        assert_eq!(v, Verdict::Drop(DropReason::NewFlowRateLimited), "past the burst");
        // Another pod is not limited by pod A's bucket.
        let (v, _) = send(&mut w, &flow(fixtures::POD_B, 40000), fixtures::INSIDE, 1000);
        assert!(forwarded(v), "another pod: {v:?}");
        // Pod A's established flows are never limited.
        for _ in 0..20 {
            let (v, _) = send(&mut w, &flow(fixtures::POD_A, 40000), fixtures::INSIDE, 1000);
            assert!(forwarded(v), "an established flow: {v:?}");
        }
        // 10 a second: one token 100 ms later, not before.
        let (v, _) = send(&mut w, &flow(fixtures::POD_A, 40003), fixtures::INSIDE, 1099);
        assert_eq!(v, Verdict::Drop(DropReason::NewFlowRateLimited));
        let (v, _) = send(&mut w, &flow(fixtures::POD_A, 40003), fixtures::INSIDE, 1100);
        assert!(forwarded(v), "refilled: {v:?}");
        let (v, _) = send(&mut w, &flow(fixtures::POD_A, 40004), fixtures::INSIDE, 1100);
        assert_eq!(v, Verdict::Drop(DropReason::NewFlowRateLimited));
        assert_eq!(engine.stats().dropped(DropReason::NewFlowRateLimited), 3);
    }

    /// A session made for a frame goes into the worker's flow cache under
    /// the frame's key, outbound and inbound alike: the flow's next packet
    /// on this worker finds its slot without the shared map. Before, the
    /// cache learnt a flow only from its second packet's map lookup.
    #[test]
    fn a_new_session_is_remembered_by_the_worker_that_made_it() {
        use crate::nat::key::proto;
        let mut spec = fixtures::base_spec();
        spec.nat.filtering = FilteringBehavior::EndpointIndependent;
        let engine = Engine::new(&spec).expect("fixture config");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(7));
        let out = FlowKey::new(fixtures::POD_A, fixtures::SERVER, 40000, 53, proto::UDP);
        assert_eq!(w.flows.v4.get(&out), None, "nothing cached before the flow");
        let frame =
            fixtures::from_pod(IpAddr::V4(out.src), IpAddr::V4(out.dst), fixtures::udp(40000, 53, b"q")).frame();
        let (v, _) = send(&mut w, &frame, fixtures::INSIDE, 1000);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. }), "{v:?}");
        let (r, view) = engine.nat4().sessions.lookup(&out).expect("the session was made");
        assert_eq!(w.flows.v4.get(&out), Some(r), "the outbound key is cached as the map has it");

        // An unsolicited packet from another remote to the mapping's
        // port: endpoint-independent filtering makes an inbound session.
        let other = Ipv4Addr::new(198, 18, 7, 7);
        let inbound = FlowKey::new(other, view.tuple.egress, 5353, view.tuple.egress_port, proto::UDP);
        let frame = fixtures::from_outside(
            IpAddr::V4(other),
            IpAddr::V4(view.tuple.egress),
            fixtures::udp(5353, view.tuple.egress_port, b"a"),
        )
        .frame();
        let (v, _) = send(&mut w, &frame, fixtures::OUTSIDE, 1000);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::INSIDE, .. }), "{v:?}");
        let (r, _) = engine.nat4().sessions.lookup(&inbound).expect("the inbound session was made");
        assert!(r.is_inbound());
        assert_eq!(w.flows.v4.get(&inbound), Some(r), "the inbound key is cached as the map has it");
    }

    /// `nat.newFlowsPerSecondPerSource: 0` turns the limit off: many new
    /// flows from one pod at one instant are all created.
    #[test]
    fn a_zero_new_flow_rate_is_no_limit() {
        let mut spec = fixtures::base_spec();
        spec.nat.new_flows_per_second_per_source = 0;
        spec.nat.new_flow_burst_per_source = 1;
        let engine = Engine::new(&spec).expect("fixture config");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(7));
        for sport in 40000..40100 {
            let f = fixtures::from_pod(
                IpAddr::V4(fixtures::POD_A),
                IpAddr::V4(fixtures::SERVER),
                fixtures::udp(sport, 53, b"q"),
            );
            let (v, _) = send(&mut w, &f.frame(), fixtures::INSIDE, 0);
            assert!(matches!(v, Verdict::Forward { .. }), "flow {sport}: {v:?}");
        }
        assert_eq!(engine.stats().dropped(DropReason::NewFlowRateLimited), 0);
    }

    /// With endpoint-independent filtering, a remote source opening new
    /// sessions through a pod's mapping is limited like a pod; another
    /// remote still gets through, and a port no mapping uses keeps its own
    /// counter (`inbound_no_mapping`). Before, every session was created.
    #[test]
    fn remote_sources_are_limited_through_endpoint_independent_mappings() {
        let mut spec = fixtures::base_spec();
        spec.nat.filtering = FilteringBehavior::EndpointIndependent;
        spec.nat.new_flows_per_second_per_source = 10;
        spec.nat.new_flow_burst_per_source = 2;
        let engine = Engine::new(&spec).expect("fixture config");
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(7));
        let out = fixtures::from_pod(
            IpAddr::V4(fixtures::POD_A),
            IpAddr::V4(fixtures::SERVER),
            fixtures::udp(40000, 53, b"q"),
        );
        let (v, sent) = send(&mut w, &out.frame(), fixtures::INSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::OUTSIDE, .. }), "{v:?}");
        let mapped = u16::from_be_bytes([sent[14 + 20], sent[14 + 21]]);
        let inbound = |from: Ipv4Addr, sport: u16, dport: u16| {
            fixtures::from_outside(IpAddr::V4(from), IpAddr::V4(fixtures::E1), fixtures::udp(sport, dport, b"x"))
                .frame()
        };
        let remote2 = Ipv4Addr::new(198, 51, 100, 98);
        for sport in 1000..1002 {
            let (v, _) = send(&mut w, &inbound(fixtures::STRANGER, sport, mapped), fixtures::OUTSIDE, 0);
            assert!(matches!(v, Verdict::Forward { ifindex: fixtures::INSIDE, .. }), "within the burst: {v:?}");
        }
        let (v, _) = send(&mut w, &inbound(fixtures::STRANGER, 1002, mapped), fixtures::OUTSIDE, 0);
        assert_eq!(v, Verdict::Drop(DropReason::NewFlowRateLimited));
        let (v, _) = send(&mut w, &inbound(remote2, 1000, mapped), fixtures::OUTSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::INSIDE, .. }), "another remote: {v:?}");
        // An established inbound session is not limited.
        let (v, _) = send(&mut w, &inbound(fixtures::STRANGER, 1000, mapped), fixtures::OUTSIDE, 0);
        assert!(matches!(v, Verdict::Forward { ifindex: fixtures::INSIDE, .. }), "established: {v:?}");
        let unmapped = if mapped == 50_000 { 50_001 } else { 50_000 };
        let (v, _) = send(&mut w, &inbound(fixtures::STRANGER, 1003, unmapped), fixtures::OUTSIDE, 0);
        assert_eq!(v, Verdict::Drop(DropReason::InboundNoMapping));
        assert_eq!(engine.stats().dropped(DropReason::NewFlowRateLimited), 1);
    }

    /// A worker's new flows take the egress IP paired pooling gives, also
    /// when the worker remembers it (a policy of more than four egress IPs:
    /// `EgressMemo`), and after a publish that changes the policy's list
    /// the remembered answers are not used: each pod's next flow leaves
    /// from its egress IP under the new list.
    #[test]
    fn new_flows_leave_from_the_paired_egress_ip_across_a_publish() {
        use crate::tables::{paired_egress, EgressIpSpec, PolicySpec, TablesSpec};
        let ips: Vec<Ipv4Addr> = (0..12).map(|i| Ipv4Addr::new(203, 0, 113, 10 + i)).collect();
        let spec = |list: &[Ipv4Addr]| {
            let mut s = TablesSpec {
                policies: vec![PolicySpec {
                    name: "many".into(),
                    sources: vec!["198.18.0.0/15".parse().unwrap()],
                    destinations: vec!["0.0.0.0/0".parse().unwrap()],
                    except: vec![],
                    egress_ips: list.iter().map(|ip| IpAddr::V4(*ip)).collect(),
                }],
                egress_ips: ips
                    .iter()
                    .map(|ip| EgressIpSpec {
                        ip: IpAddr::V4(*ip),
                        ports: None,
                        answer_neighbor: true,
                        port_blocks: None,
                    })
                    .collect(),
                ..Default::default()
            };
            s.nat.new_flows_per_second_per_source = 0;
            s
        };
        let engine = Engine::new(&spec(&ips[..8])).unwrap();
        engine.publish_fib(fixtures::topology());
        let mut w = engine.pipeline_seeded(PortRng::new(7));
        let mut port = 20_000u16;
        let mut send = |w: &mut super::super::Pipeline, pod: Ipv4Addr| -> Ipv4Addr {
            port += 1;
            let remote = Ipv4Addr::new(198, 51, 100, 1);
            let frame = fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(port, 53, &[0u8; 8])).frame();
            let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
            buf[..frame.len()].copy_from_slice(&frame);
            let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
            let v = w.process(&mut buf, frame.len(), meta, Timestamp::from_secs(1));
            assert!(matches!(v, Verdict::Forward { .. }), "{pod}: {v:?}");
            Ipv4Addr::new(buf[26], buf[27], buf[28], buf[29])
        };
        let pods: Vec<Ipv4Addr> = (1..=200u32).map(|i| Ipv4Addr::from(0xC612_0000 + i)).collect();
        let mut moved = 0;
        for (list, round) in [(&ips[..8], 0), (&ips[4..], 1), (&ips[..8], 2)] {
            if round > 0 {
                engine.publish(&spec(list)).unwrap();
            }
            for _ in 0..2 {
                for pod in &pods {
                    let want = paired_egress(*pod, list).unwrap();
                    assert_eq!(send(&mut w, *pod), want, "{pod}, list {round}");
                    if round == 1 && paired_egress(*pod, &ips[..8]) != Some(want) {
                        moved += 1;
                    }
                }
            }
        }
        assert!(moved > 50, "the publish moved only {moved} pods' flows: the check is not live");
    }

    /// A batch gives each frame what a batch of its own gives it: the same
    /// verdicts and bytes, for new flows, established ones, pings, IPv6,
    /// frames through the tunnel beside plain ones, and TCP control segments of established flows right after a new
    /// flow in the same batch (the established path looked the new flow up
    /// and missed: the control segment, which that path declines, must
    /// still be looked up by the full pipeline).
    #[test]
    fn a_batch_gives_each_frame_what_a_batch_of_its_own_gives_it() {
        let v4 = |t| fixtures::from_pod(fixtures::POD_A.into(), fixtures::SERVER.into(), t).frame();
        let v6 = |t| fixtures::from_pod(fixtures::POD6.into(), fixtures::SERVER6.into(), t).frame();
        let tunnelled = |f: Vec<u8>| fixtures::tunnelled(&f, 1).expect("an IP frame");
        let rounds: Vec<Vec<Vec<u8>>> = vec![
            vec![v4(fixtures::tcp(40000, 443, 1, None, 0x02, b"")), v4(fixtures::udp(40001, 53, b"q"))],
            vec![
                v4(fixtures::udp(40002, 53, b"q")),
                v4(fixtures::tcp(40000, 443, 2, Some(9), 0x11, b"")),
                v4(fixtures::udp(40001, 53, b"q")),
                v4(fixtures::echo(true, 7, 1)),
                v6(fixtures::udp(40003, 53, b"q")),
                v6(fixtures::udp(40003, 53, b"q")),
                // Through the tunnel, twice, then plainly: each frame is
                // decapsulated, or not, on its own.
                tunnelled(v4(fixtures::udp(40005, 53, b"q"))),
                tunnelled(v6(fixtures::udp(40006, 53, b"q"))),
                v4(fixtures::udp(40007, 53, b"q")),
                tunnelled(v4(fixtures::udp(40005, 53, b"q"))),
            ],
            vec![v4(fixtures::udp(40004, 53, b"q")), v4(fixtures::tcp(40000, 443, 3, Some(9), 0x14, b""))],
        ];
        let run = |batched: bool| {
            let engine = Engine::new(&fixtures::base_spec()).expect("fixture config");
            engine.publish_fib(fixtures::topology());
            let mut w = engine.pipeline_seeded(PortRng::new(3));
            let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
            let mut out = Vec::new();
            for (r, frames) in rounds.iter().enumerate() {
                let now = Timestamp::from_secs(1 + r as u64);
                let mut bufs: Vec<Vec<u8>> = frames
                    .iter()
                    .map(|f| {
                        let mut b = vec![0u8; fixtures::FRAME_BUFFER];
                        b[..f.len()].copy_from_slice(f);
                        b
                    })
                    .collect();
                if batched {
                    let mut batch = w.batch(now);
                    for (buf, f) in bufs.iter_mut().zip(frames) {
                        out.push((batch.process(buf, f.len(), meta), buf.clone()));
                    }
                } else {
                    for (buf, f) in bufs.iter_mut().zip(frames) {
                        out.push((w.process(buf, f.len(), meta, now), buf.clone()));
                    }
                }
            }
            (out, engine.stats().forwarded)
        };
        let (alone, forwarded) = run(false);
        assert!(alone.iter().all(|(v, _)| matches!(v, Verdict::Forward { .. })), "{alone:?}");
        assert_eq!(forwarded, alone.len() as u64);
        let (together, _) = run(true);
        for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
            assert_eq!(a, t, "frame {i}");
        }
    }
}
