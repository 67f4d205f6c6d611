//! The straight-line path of established sessions: the case that makes up
//! nearly all traffic, decided without side effects and then translated
//! and forwarded in one pass ([`Ctx::established_v4`],
//! [`Ctx::established_v6`]). Anything it does not take goes down the full
//! pipeline (pipeline.rs).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use super::pipeline::Ctx;
use super::{ChecksumHint, RxMeta, Verdict};
use crate::nat::key::{proto, FlowKey};
use crate::nat::rewrite;
use crate::nat::session::session_flags;
use crate::nat::table::NatTable;
use crate::nat::tcp_state;
use crate::stats::Direction;
use crate::wire::checksum;
use crate::wire::{ethernet, ipv6, tcp, udp};

impl Ctx<'_> {
    /// The established path found no session for the frame's flow: the
    /// full pipeline is told not to ask the map again ([`Ctx::missed`]).
    #[cold]
    fn no_session(&mut self) -> Option<Verdict> {
        self.missed = true;
        None
    }

    /// The common case in one straight pass: an untagged IPv4 frame without
    /// options, not fragmented, TCP or UDP with a complete checksum, of an
    /// established session that needs no attention (not expired, checked
    /// against the current configuration, not hairpinning, not a TCP SYN,
    /// FIN or RST), with TTL to spare and a resolved next hop.
    ///
    /// It decides before it changes anything: for any other frame it returns
    /// `None` having had no effect but filling the worker's caches, and the
    /// full pipeline ([`Ctx::ip`]) handles the frame from the start. When it
    /// does take a frame it performs the very steps the full pipeline
    /// performs for it, in the same order and with the same arithmetic
    /// ([`Ctx::account`], the address and port writes and RFC 1624 updates
    /// of `rewrite::translate`, then the TTL and MACs of [`Ctx::forward`]),
    /// so the bytes and counters are identical; the fixture and property
    /// tests run through both.
    #[inline]
    pub(super) fn established_v4(&mut self, buf: &mut [u8], len: usize, meta: RxMeta) -> Option<Verdict> {
        const L3: usize = ethernet::HEADER_LEN;
        const L4: usize = L3 + crate::wire::ipv4::MIN_HEADER_LEN;
        // Ethernet, IPv4 and the 8 transport bytes every TCP/UDP header has.
        let frame = buf.get_mut(..len)?;
        let h: &[u8; L4 + 8] = frame.get(..L4 + 8)?.try_into().ok()?;
        if h[12] != 0x08 || h[13] != 0x00 || h[14] != 0x45 {
            return None;
        }
        let end = L3 + usize::from(u16::from_be_bytes([h[16], h[17]]));
        // A fragment (MF or an offset), or a length the frame does not hold.
        if end < L4 + 8 || end > len || h[20] & 0x3f != 0 || h[21] != 0 {
            return None;
        }
        let proto = h[23];
        let l4_len = end - L4;
        let (tcp_flags, csum_at) = match proto {
            proto::UDP => {
                let ulen = usize::from(u16::from_be_bytes([h[L4 + 4], h[L4 + 5]]));
                if ulen < 8 || ulen > l4_len {
                    return None;
                }
                (0, L4 + crate::wire::udp::CHECKSUM_OFFSET)
            }
            proto::TCP => {
                let t = frame.get(L4..L4 + 20)?;
                let hl = usize::from(t[12] >> 4) * 4;
                if hl < 20 || hl > l4_len {
                    return None;
                }
                (t[13], L4 + crate::wire::tcp::CHECKSUM_OFFSET)
            }
            _ => return None,
        };
        // The header checksum (RFC 1071): five 32-bit words summed, then
        // folded; valid when the folded sum is 0xffff.
        let words = (0..5).map(|i| {
            let at = L3 + 4 * i;
            u64::from(u32::from_be_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]))
        });
        let sum = words.sum::<u64>();
        let sum = (sum & 0xffff_ffff) + (sum >> 32);
        if checksum::fold(checksum::add(sum as u32, (sum >> 32) as u32)) != 0xffff {
            return None;
        }
        let src = Ipv4Addr::new(h[26], h[27], h[28], h[29]);
        let dst = Ipv4Addr::new(h[30], h[31], h[32], h[33]);
        let sport = u16::from_be_bytes([h[L4], h[L4 + 1]]);
        let dport = u16::from_be_bytes([h[L4 + 2], h[L4 + 3]]);
        let ttl = h[22];
        let csum = u16::from_be_bytes([*frame.get(csum_at)?, *frame.get(csum_at + 1)?]);
        // A checksum the sender left partial is completed by the full path.
        let partial = match meta.checksum {
            ChecksumHint::Complete => false,
            ChecksumHint::Partial => true,
            ChecksumHint::Unknown => {
                csum != 0 && checksum::is_partial(csum, checksum::pseudo_header_v4(src, dst, proto, l4_len as u32))
            }
        };
        if partial || ttl <= 1 || (proto == proto::TCP && tcp_state::is_control(tcp_flags)) {
            return None;
        }

        let tables = self.tables;
        let nat = &self.shared.nat4;
        let secs = self.secs;
        let key = FlowKey::new(src, dst, sport, dport, proto);
        let Some((r, view)) = self.lookup(nat, &key) else { return self.no_session() };
        // What `NatTable::check` would act on, and hairpinning.
        if NatTable::is_expired(&view, secs, &tables.nat)
            || view.generation != tables.generation_tag()
            || view.flags & session_flags::HAIRPIN != 0
        {
            return None;
        }
        let dir = if r.is_inbound() { Direction::Inbound } else { Direction::Outbound };
        // Anti-spoofing: a pod's packet only from where pods' traffic comes.
        if dir == Direction::Outbound
            && self.ingress.restricts()
            && !self.decapsulated
            && self.ingress.admits_pods(meta.ifindex, &h[6..12]).is_err()
        {
            return None;
        }
        let t = &view.tuple;
        let new_dst = match dir {
            Direction::Outbound => dst,
            Direction::Inbound => t.pod,
        };
        let uses = &self.shared.neighbor_use;
        let (oif, macs) = self.next_hops.resolved(self.fib, uses, IpAddr::V4(new_dst), secs)?;
        // Larger than the egress link's MTU: the full pipeline answers it.
        let ip_len = (end - L3) as u32;
        if ip_len > self.fib.min_mtu() && self.fib.mtu(oif).is_none_or(|m| ip_len > m) {
            return None;
        }

        // The TCP header's fields for state tracking, read only for TCP
        // (a UDP packet carries no `Segment` through the checks above).
        let seg = if proto == proto::TCP { tcp_state::segment(buf.get(L4..L4 + 20)?) } else { None };

        // Commit: from here on, exactly the full pipeline's steps.
        self.account(nat, &view, dir, tcp_flags, seg.as_ref(), secs, len);
        let (l3d, l4d) = rewrite::deltas_for(view.deltas, dir);
        let frame = buf.get_mut(..len)?;
        let (addr_at, addr, port_at, port) = match dir {
            Direction::Outbound => (L3 + 12, t.egress, L4, t.egress_port),
            Direction::Inbound => (L3 + 16, t.pod, L4 + 2, t.pod_port),
        };
        frame.get_mut(addr_at..addr_at + 4)?.copy_from_slice(&addr.octets());
        frame.get_mut(port_at..port_at + 2)?.copy_from_slice(&port.to_be_bytes());
        let new_csum = if proto == proto::UDP { checksum::apply_udp(csum, l4d) } else { l4d.apply(csum) };
        frame.get_mut(csum_at..csum_at + 2)?.copy_from_slice(&new_csum.to_be_bytes());
        // The IP header: the address delta, then the TTL's (RFC 1624 eqn.
        // 3), in one fold: the field `translate` and `forward` leave with
        // one update each (`Delta::apply_then`).
        let ip: &mut [u8; 20] = frame.get_mut(L3..L4)?.try_into().ok()?;
        let hc = l3d.apply_then(checksum::TTL_DECREMENT, u16::from_be_bytes([ip[10], ip[11]]));
        ip[8] = ttl - 1;
        ip[10..12].copy_from_slice(&hc.to_be_bytes());
        frame.get_mut(0..12)?.copy_from_slice(&macs);
        Some(Verdict::Forward { ifindex: oif, len })
    }
}

impl Ctx<'_> {
    /// [`Ctx::established_v4`] for IPv6: an untagged frame whose fixed
    /// header is followed directly by TCP or UDP (no extension header, so
    /// not a fragment), with a complete checksum (a UDP checksum of zero,
    /// which RFC 8200 forbids, is left to the full pipeline to drop), of an
    /// established session that needs no attention, with hop limit to
    /// spare and a resolved next hop. IPv6 has no header checksum: the
    /// address's change is in the transport checksum's delta (nat/rewrite.rs),
    /// and the hop limit is decremented alone. Same contract: nothing is
    /// changed unless the frame is taken, and a taken frame's bytes and
    /// counters are the full pipeline's.
    ///
    /// The decision after the lookup repeats [`Ctx::established_v4`]'s
    /// lines on purpose: drawn into one generic helper it cost the IPv4
    /// path 16 to 25 more instructions a packet (the session's view
    /// passed through it; docs/benchmarks.md, "IPv6's straight-line
    /// path"). The tests below hold both copies to the full pipeline's
    /// bytes and counters (ADR 0041 lists what they do not cover).
    #[inline(never)]
    pub(super) fn established_v6(&mut self, buf: &mut [u8], len: usize, meta: RxMeta) -> Option<Verdict> {
        const L3: usize = ethernet::HEADER_LEN;
        const L4: usize = L3 + ipv6::HEADER_LEN;
        let frame = buf.get_mut(..len)?;
        let h: &[u8; L4 + 8] = frame.get(..L4 + 8)?.try_into().ok()?;
        if h[12] != 0x86 || h[13] != 0xdd || h[L3] >> 4 != 6 {
            return None;
        }
        let end = L4 + usize::from(u16::from_be_bytes([h[L3 + 4], h[L3 + 5]]));
        if end < L4 + 8 || end > len {
            return None;
        }
        let proto = h[L3 + 6];
        let l4_len = end - L4;
        let (tcp_flags, csum_at) = match proto {
            proto::UDP => {
                let ulen = usize::from(u16::from_be_bytes([h[L4 + 4], h[L4 + 5]]));
                if ulen < 8 || ulen > l4_len {
                    return None;
                }
                (0, L4 + udp::CHECKSUM_OFFSET)
            }
            proto::TCP => {
                let t = frame.get(L4..L4 + 20)?;
                let hl = usize::from(t[12] >> 4) * 4;
                if hl < 20 || hl > l4_len {
                    return None;
                }
                (t[13], L4 + tcp::CHECKSUM_OFFSET)
            }
            _ => return None,
        };
        let addr =
            |at: usize| -> Option<Ipv6Addr> { Some(Ipv6Addr::from(<[u8; 16]>::try_from(h.get(at..at + 16)?).ok()?)) };
        let (src, dst) = (addr(L3 + 8)?, addr(L3 + 24)?);
        let sport = u16::from_be_bytes([h[L4], h[L4 + 1]]);
        let dport = u16::from_be_bytes([h[L4 + 2], h[L4 + 3]]);
        let hop_limit = h[L3 + 7];
        let csum = u16::from_be_bytes([*frame.get(csum_at)?, *frame.get(csum_at + 1)?]);
        if proto == proto::UDP && csum == 0 {
            return None;
        }
        let partial = match meta.checksum {
            ChecksumHint::Complete => false,
            ChecksumHint::Partial => true,
            ChecksumHint::Unknown => {
                csum != 0 && checksum::is_partial(csum, checksum::pseudo_header_v6(&src, &dst, proto, l4_len as u32))
            }
        };
        if partial || hop_limit <= 1 || (proto == proto::TCP && tcp_state::is_control(tcp_flags)) {
            return None;
        }

        let tables = self.tables;
        let nat = &self.shared.nat6;
        let secs = self.secs;
        let key = FlowKey::new(src, dst, sport, dport, proto);
        let Some((r, view)) = self.lookup(nat, &key) else { return self.no_session() };
        if NatTable::is_expired(&view, secs, &tables.nat)
            || view.generation != tables.generation_tag()
            || view.flags & session_flags::HAIRPIN != 0
        {
            return None;
        }
        let dir = if r.is_inbound() { Direction::Inbound } else { Direction::Outbound };
        if dir == Direction::Outbound
            && self.ingress.restricts()
            && !self.decapsulated
            && self.ingress.admits_pods(meta.ifindex, &h[6..12]).is_err()
        {
            return None;
        }
        let t = &view.tuple;
        let new_dst = match dir {
            Direction::Outbound => dst,
            Direction::Inbound => t.pod,
        };
        let uses = &self.shared.neighbor_use;
        let (oif, macs) = self.next_hops.resolved(self.fib, uses, IpAddr::V6(new_dst), secs)?;
        let ip_len = (end - L3) as u32;
        if ip_len > self.fib.min_mtu() && self.fib.mtu(oif).is_none_or(|m| ip_len > m) {
            return None;
        }
        let seg = if proto == proto::TCP { tcp_state::segment(buf.get(L4..L4 + 20)?) } else { None };

        // Commit: from here on, exactly the full pipeline's steps.
        self.account(nat, &view, dir, tcp_flags, seg.as_ref(), secs, len);
        let (_, l4d) = rewrite::deltas_for(view.deltas, dir);
        let frame = buf.get_mut(..len)?;
        let (addr_at, addr, port_at, port) = match dir {
            Direction::Outbound => (L3 + 8, t.egress, L4, t.egress_port),
            Direction::Inbound => (L3 + 24, t.pod, L4 + 2, t.pod_port),
        };
        frame.get_mut(addr_at..addr_at + 16)?.copy_from_slice(&addr.octets());
        frame.get_mut(port_at..port_at + 2)?.copy_from_slice(&port.to_be_bytes());
        let new_csum = if proto == proto::UDP { checksum::apply_udp(csum, l4d) } else { l4d.apply(csum) };
        frame.get_mut(csum_at..csum_at + 2)?.copy_from_slice(&new_csum.to_be_bytes());
        *frame.get_mut(L3 + 7)? = hop_limit - 1;
        frame.get_mut(0..12)?.copy_from_slice(&macs);
        Some(Verdict::Forward { ifindex: oif, len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Timestamp;
    use crate::engine::{Engine, Path};
    use crate::fixtures;
    use crate::nat::port_alloc::PortRng;

    /// Every fixture scenario twice, with and without the established
    /// path: the same verdict, the same bytes out, the same counters after
    /// every step. Each scenario's frames are then sent once more (most of
    /// their flows now established), so the path has plenty to take.
    #[test]
    fn established_path_changes_nothing_but_speed() {
        let (mut taken, mut taken_v6) = (0, 0);
        for s in fixtures::scenarios() {
            let mut runs = Vec::new();
            for path in [Path::EstablishedFirst, Path::FullOnly] {
                let engine = Engine::new(&s.spec).expect("fixture config");
                engine.publish_fib(fixtures::topology());
                let mut w = engine.pipeline_on(PortRng::new(0x5eed), path);
                let mut out = Vec::new();
                for st in s.steps.iter().chain(&s.steps) {
                    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
                    buf[..st.frame.len()].copy_from_slice(&st.frame);
                    let meta = RxMeta { ifindex: st.ingress, checksum: ChecksumHint::Unknown };
                    let before = w.established_taken;
                    let v = w.process(&mut buf, st.frame.len(), meta, Timestamp::from_secs(st.at));
                    if st.frame.get(12..14) == Some(&[0x86, 0xdd]) {
                        taken_v6 += w.established_taken - before;
                    }
                    out.push((v, buf, engine.stats(), engine.nat4().sessions.len(), engine.nat6().sessions.len()));
                }
                if path == Path::FullOnly {
                    assert_eq!(w.established_taken, 0, "{}: a full-only worker took the established path", s.name);
                }
                taken += w.established_taken;
                runs.push(out);
            }
            let n = s.steps.len();
            for (i, (a, b)) in runs[0].iter().zip(&runs[1]).enumerate() {
                assert!(a == b, "{} step {i} ({}): {:?} vs {:?}", s.name, s.steps[i % n].what, a.0, b.0);
            }
        }
        assert!(taken >= 25, "the established path took only {taken} fixture frames");
        assert!(taken_v6 >= 3, "the established path took only {taken_v6} IPv6 fixture frames");
    }

    /// Frames of an established IPv6 flow that the straight-line path must
    /// leave to the full pipeline: a hop limit of 1 (an ICMPv6 error is
    /// owed), a zero UDP checksum (RFC 8200: dropped as malformed), a
    /// payload length the frame does not hold, an extension header first.
    /// Both paths give the same verdicts, bytes and counters, and the
    /// straight-line path takes only the flow's plain frames.
    #[test]
    fn ipv6_frames_it_must_not_take_go_the_full_pipelines_way() {
        const L3: usize = ethernet::HEADER_LEN;
        const L4: usize = L3 + ipv6::HEADER_LEN;
        let flow = || {
            fixtures::from_pod(fixtures::POD6.into(), fixtures::SERVER6.into(), fixtures::udp(40000, 53, b"q")).frame()
        };
        let edit = |at: usize, byte: u8| {
            let mut f = flow();
            f[at] = byte;
            f
        };
        let mut zero_csum = flow();
        zero_csum[L4 + 6..L4 + 8].copy_from_slice(&[0, 0]);
        let frames = [flow(), flow(), edit(L3 + 7, 1), zero_csum, edit(L3 + 4, 0xff), edit(L3 + 6, 60), flow()];
        let run = |path| {
            let engine = Engine::new(&fixtures::base_spec()).expect("fixture config");
            engine.publish_fib(fixtures::topology());
            let mut w = engine.pipeline_on(PortRng::new(7), path);
            let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Unknown };
            let out: Vec<_> = frames
                .iter()
                .map(|f| {
                    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
                    buf[..f.len()].copy_from_slice(f);
                    let v = w.process(&mut buf, f.len(), meta, Timestamp::from_secs(1));
                    (v, buf)
                })
                .collect();
            (out, engine.stats(), w.established_taken)
        };
        let (straight, full) = (run(Path::EstablishedFirst), run(Path::FullOnly));
        assert!(straight.0 == full.0, "verdicts or bytes differ: {:?} vs {:?}", straight.0, full.0);
        assert!(straight.1 == full.1, "counters differ");
        // The flow's second and last plain frames; the first made the session.
        assert_eq!(straight.2, 2);
        assert!(matches!(full.0[3].0, Verdict::Drop(_)), "a zero UDP checksum over IPv6 is dropped");
    }

    /// An IPv6 TCP connection and a UDP flow both ways, a datagram larger
    /// than the link's MTU, and the flows again after their sessions
    /// expired, through both paths: the same verdicts, bytes and counters
    /// after every frame, and the straight-line path takes the plain
    /// frames of both directions and both protocols (the fixtures' IPv6
    /// frames are UDP, and their one TCP frame is a SYN).
    #[test]
    fn ipv6_tcp_and_udp_both_ways_match_the_full_pipeline() {
        use crate::wire::tcp::{ACK, SYN};
        let (pod, server) = (fixtures::POD6, fixtures::SERVER6);
        let out = |t| (fixtures::INSIDE, fixtures::from_pod(pod.into(), server.into(), t).frame());
        let back = |t| (fixtures::OUTSIDE, fixtures::from_outside(server.into(), fixtures::E6.into(), t).frame());
        let run = |path| {
            let engine = Engine::new(&fixtures::base_spec()).expect("fixture config");
            engine.publish_fib(fixtures::topology());
            let mut w = engine.pipeline_on(PortRng::new(7), path);
            let mut outs = Vec::new();
            let (mut taken_out, mut taken_back) = (0, 0);
            let mut send = |w: &mut crate::engine::Pipeline, (ingress, f): (u32, Vec<u8>), at: u64| {
                let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
                buf[..f.len()].copy_from_slice(&f);
                let before = w.established_taken;
                let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
                let v = w.process(&mut buf, f.len(), meta, Timestamp::from_secs(at));
                let took = w.established_taken - before;
                if ingress == fixtures::INSIDE {
                    taken_out += took;
                } else {
                    taken_back += took;
                }
                outs.push((v, buf, engine.stats()));
            };
            let egress_port = |key| engine.nat6().sessions.lookup(&key).map_or(0, |(_, v)| v.tuple.egress_port);
            for at in [1, 100_000] {
                // A connection: SYN, SYN-ACK, then data each way.
                send(&mut w, out(fixtures::tcp(40000, 443, 1, None, SYN, b"")), at);
                let p = egress_port(FlowKey::new(pod, server, 40000, 443, proto::TCP));
                send(&mut w, back(fixtures::tcp(443, p, 9, Some(2), SYN | ACK, b"")), at);
                for _ in 0..2 {
                    send(&mut w, out(fixtures::tcp(40000, 443, 2, Some(10), ACK, b"data")), at);
                    send(&mut w, back(fixtures::tcp(443, p, 10, Some(6), ACK, b"data")), at);
                }
                // A UDP flow each way, then one datagram over the MTU.
                send(&mut w, out(fixtures::udp(40001, 53, b"q")), at);
                let p = egress_port(FlowKey::new(pod, server, 40001, 53, proto::UDP));
                send(&mut w, back(fixtures::udp(53, p, b"a")), at);
                send(&mut w, out(fixtures::udp(40001, 53, b"q")), at);
                send(&mut w, out(fixtures::udp(40001, 53, &[0u8; 1500])), at);
            }
            (outs, taken_out, taken_back)
        };
        let (straight, full) = (run(Path::EstablishedFirst), run(Path::FullOnly));
        assert_eq!(straight.0.len(), full.0.len());
        for (i, (a, b)) in straight.0.iter().zip(&full.0).enumerate() {
            assert!(a == b, "frame {i}: {:?} vs {:?}", a.0, b.0);
        }
        // Each round: two TCP data frames and one UDP datagram out, two TCP
        // data frames and the UDP reply back (the second round's sessions
        // are new ones: the first round's expired at 100,000 s).
        assert_eq!((straight.1, straight.2), (6, 6));
    }
}
