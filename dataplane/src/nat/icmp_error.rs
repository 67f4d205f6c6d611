//! ICMP error translation (RFC 5508 4.2, RFC 7857 2.9).
//!
//! An ICMP error (destination unreachable, including fragmentation needed and
//! IPv6 packet too big; time exceeded; parameter problem) carries the header
//! of the packet that caused it. The NAT matches the error to a session by
//! that embedded header, and translates:
//! - the outer header: inbound, the destination (egress IP -> pod); outbound,
//!   the source (pod or an inside router -> egress IP, so no inside address
//!   leaves);
//! - the embedded header: its addresses and ports the other way round, with
//!   its IP header checksum and, when the embedded bytes include it, its
//!   transport checksum (UDP's zero checksum stays zero);
//! - the ICMP checksum, recomputed over the whole message after the original
//!   was verified (an error is rare, the message is small, and a full
//!   computation also covers ICMPv6's pseudo-header).
//!
//! An error is never allowed to create, refresh or remove a session (RFC 5508
//! REQ-4 and REQ-10): it only reads one. Errors about errors are not matched.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::key::{proto, FlowKey, NatAddr, SessionTuple};
use super::rewrite::IpFamily;
use super::session::SessionView;
use super::table::NatTable;
use crate::dissect::IpPacket;
use crate::stats::{Direction, DropReason, WorkerStats};
use crate::tables::Tables;
use crate::wire::checksum::{self, Delta};
use crate::wire::{icmpv4, icmpv6};

/// Length of the ICMP error header before the embedded packet (both families).
const ERROR_HEADER_LEN: usize = 8;

/// The embedded packet's header, read leniently (it is usually truncated).
#[derive(Clone, Copy, Debug)]
pub struct Embedded<A> {
    /// Offset of the embedded IP header in the frame.
    pub l3: usize,
    /// Offset of its transport header.
    pub l4: usize,
    /// Source address.
    pub src: A,
    /// Destination address.
    pub dst: A,
    /// Protocol.
    pub proto: u8,
    /// Source port or echo identifier.
    pub sport: u16,
    /// Destination port (0 for echo).
    pub dport: u16,
    /// An echo request.
    pub echo: bool,
}

/// What [`translate`] did.
#[derive(Clone, Copy, Debug)]
pub struct Translated<A> {
    /// The matched session.
    pub session: SessionView<A>,
    /// The direction the error travels.
    pub direction: Direction,
}

/// Family-specific parts of ICMP error handling.
pub trait IcmpFamily: IpFamily {
    /// Reads the embedded header at `at` (the embedded IP header's offset).
    fn embedded(buf: &[u8], at: usize, end: usize) -> Option<Embedded<Self>>;
    /// The embedded header's (source, destination) when a whole fixed IP
    /// header of this family is there, whatever follows it (the XDP
    /// program's rule 5b reads the same bytes).
    fn embedded_addrs(buf: &[u8], at: usize, end: usize) -> Option<(Self, Self)>;
    /// Verifies the outer ICMP checksum.
    fn verify(icmp: &[u8], src: &Self, dst: &Self) -> bool;
    /// Recomputes the outer ICMP checksum.
    fn fill(icmp: &mut [u8], src: &Self, dst: &Self);
    /// Writes the embedded header's source or destination address.
    fn write_addr(buf: &mut [u8], at: usize, a: &Self);
    /// Offsets of the source and destination address in an IP header.
    const SRC: usize;
    /// See `SRC`.
    const DST: usize;
    /// Offset of the header checksum, if the family has one.
    const HEADER_CHECKSUM: Option<usize>;
}

#[inline]
fn read16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

#[inline]
fn write16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

fn ports(buf: &[u8], l4: usize, end: usize, protocol: u8, echo_request: u8) -> Option<(u16, u16, bool)> {
    if end < l4 + 8 {
        return None;
    }
    match protocol {
        proto::TCP | proto::UDP => Some((read16(buf, l4), read16(buf, l4 + 2), false)),
        proto::ICMP | proto::ICMPV6 if buf[l4] == echo_request => Some((read16(buf, l4 + 4), 0, true)),
        _ => None,
    }
}

impl IcmpFamily for Ipv4Addr {
    const SRC: usize = 12;
    const DST: usize = 16;
    const HEADER_CHECKSUM: Option<usize> = Some(10);

    fn embedded(buf: &[u8], at: usize, end: usize) -> Option<Embedded<Self>> {
        if end < at + 20 || buf[at] >> 4 != 4 {
            return None;
        }
        let ihl = usize::from(buf[at] & 0x0f) * 4;
        if ihl < 20 {
            return None;
        }
        let l4 = at + ihl;
        let protocol = buf[at + 9];
        let (sport, dport, echo) = ports(buf, l4, end, protocol, icmpv4::MsgType::ECHO_REQUEST)?;
        Some(Embedded {
            l3: at,
            l4,
            src: Ipv4Addr::read(&buf[at + 12..]),
            dst: Ipv4Addr::read(&buf[at + 16..]),
            proto: protocol,
            sport,
            dport,
            echo,
        })
    }

    fn embedded_addrs(buf: &[u8], at: usize, end: usize) -> Option<(Self, Self)> {
        let h = buf.get(at..at + 20).filter(|_| at + 20 <= end)?;
        if h[0] >> 4 != 4 || h[0] & 0x0f < 5 {
            return None;
        }
        Some((Ipv4Addr::read(&h[12..]), Ipv4Addr::read(&h[16..])))
    }

    fn verify(icmp: &[u8], _src: &Self, _dst: &Self) -> bool {
        icmpv4::Packet::new_unchecked(icmp).verify_checksum()
    }

    fn fill(icmp: &mut [u8], _src: &Self, _dst: &Self) {
        icmpv4::Packet::new_unchecked(icmp).fill_checksum();
    }

    fn write_addr(buf: &mut [u8], at: usize, a: &Self) {
        a.write(&mut buf[at..]);
    }
}

impl IcmpFamily for Ipv6Addr {
    const SRC: usize = 8;
    const DST: usize = 24;
    const HEADER_CHECKSUM: Option<usize> = None;

    fn embedded(buf: &[u8], at: usize, end: usize) -> Option<Embedded<Self>> {
        if end < at + 40 || buf[at] >> 4 != 6 {
            return None;
        }
        // Embedded extension headers are not walked: the transport header
        // must follow the fixed header (true of what Egret translates).
        let l4 = at + 40;
        let protocol = buf[at + 6];
        let (sport, dport, echo) = ports(buf, l4, end, protocol, icmpv6::MsgType::ECHO_REQUEST)?;
        Some(Embedded {
            l3: at,
            l4,
            src: Ipv6Addr::read(&buf[at + 8..]),
            dst: Ipv6Addr::read(&buf[at + 24..]),
            proto: protocol,
            sport,
            dport,
            echo,
        })
    }

    fn embedded_addrs(buf: &[u8], at: usize, end: usize) -> Option<(Self, Self)> {
        let h = buf.get(at..at + 40).filter(|_| at + 40 <= end)?;
        if h[0] >> 4 != 6 {
            return None;
        }
        Some((Ipv6Addr::read(&h[8..]), Ipv6Addr::read(&h[24..])))
    }

    fn verify(icmp: &[u8], src: &Self, dst: &Self) -> bool {
        icmpv6::Packet::new_unchecked(icmp).verify_checksum(src, dst)
    }

    fn fill(icmp: &mut [u8], src: &Self, dst: &Self) {
        icmpv6::Packet::new_unchecked(icmp).fill_checksum(src, dst);
    }

    fn write_addr(buf: &mut [u8], at: usize, a: &Self) {
        a.write(&mut buf[at..]);
    }
}

/// Whether an error is about a packet a steered source received (embedded
/// destination -> embedded source steers: the error travels out as the
/// session's outbound direction, RFC 5508 section 4.2), or one it sent that
/// is being reported somewhere other than to it (embedded source ->
/// destination steers, the outer destination is not the embedded source).
/// Such an error is Egret's even when its outer addresses are not (an
/// unselected inside router's): translated by its session, or dropped,
/// never passed to the kernel, which would forward the pod's address. The
/// XDP program steers the same errors (its rule 5b).
pub fn about_steered_source<A: IcmpFamily>(buf: &[u8], at: usize, p: &IpPacket<A>, tables: &Tables) -> bool {
    use crate::policy::Decision;
    let Some((src, dst)) = A::embedded_addrs(buf, at, p.end) else { return false };
    matches!(tables.classify(dst, src), Decision::Steer(_))
        || (src != p.dst && matches!(tables.classify(src, dst), Decision::Steer(_)))
}

/// Translates an ICMP error by its embedded header. `Err(None)` means the
/// error does not concern Egret (pass it to the kernel).
pub fn translate<A: IcmpFamily>(
    buf: &mut [u8],
    p: &mut IpPacket<A>,
    nat: &NatTable<A>,
    tables: &Tables,
    now: u32,
    stats: &WorkerStats,
) -> Result<Translated<A>, Option<DropReason>> {
    let at = p.l4 + ERROR_HEADER_LEN;
    let ours = tables.owns_egress(p.dst.ip())
        || !matches!(tables.classify(p.src, p.dst), crate::policy::Decision::Unselected)
        || about_steered_source(buf, at, p, tables);
    let unmatched = |r: DropReason| if ours { Err(Some(r)) } else { Err(None) };
    let Some(e) = A::embedded(buf, at, p.end) else { return unmatched(DropReason::IcmpErrorTruncated) };
    // Inbound: the embedded packet is one we sent out (egress -> remote); its
    // session's inbound key is the embedded tuple reversed. Outbound: the
    // embedded packet is one the pod received (remote -> pod); its session's
    // outbound key is the embedded tuple reversed.
    let key = if e.echo {
        FlowKey::new(e.dst, e.src, 0, e.sport, e.proto)
    } else {
        FlowKey::new(e.dst, e.src, e.dport, e.sport, e.proto)
    };
    let Some((r, view)) = nat.sessions.lookup(&key) else { return unmatched(DropReason::IcmpErrorUnmatched) };
    let direction = if r.is_inbound() { Direction::Inbound } else { Direction::Outbound };
    if e.echo && direction == Direction::Outbound {
        return unmatched(DropReason::IcmpErrorUnmatched);
    }
    if direction == Direction::Inbound && e.src != p.dst {
        return unmatched(DropReason::IcmpErrorUnmatched);
    }
    // Outbound, the error is about a packet the pod received: it comes from
    // the pod itself or from an inside router on the way (an unselected
    // address). Another selected source speaking for the pod (to reset its
    // flows or shrink their path MTU at the remote) is dropped.
    if direction == Direction::Outbound
        && p.src != view.tuple.pod
        && !matches!(tables.classify(p.src, p.dst), crate::policy::Decision::Unselected)
    {
        return Err(Some(DropReason::IcmpErrorSpoofed));
    }
    if NatTable::is_expired(&view, now, &tables.nat) || !NatTable::still_valid(&view, tables) {
        let _ = stats;
        return unmatched(DropReason::IcmpErrorUnmatched);
    }
    if !A::verify(&buf[p.l4..p.end], &p.src, &p.dst) {
        return Err(Some(DropReason::BadIcmpChecksum));
    }
    let t: SessionTuple<A> = view.tuple;
    // (outer address field, embedded address field, embedded port field, old/new address, old/new port)
    let (outer_at, inner_addr_at, inner_port_at, old_a, new_a, old_port, new_port) = match direction {
        Direction::Inbound => {
            (A::DST, e.l3 + A::SRC, if e.echo { e.l4 + 4 } else { e.l4 }, t.egress, t.pod, t.egress_port, t.pod_port)
        }
        Direction::Outbound => (A::SRC, e.l3 + A::DST, e.l4 + 2, t.pod, t.egress, t.pod_port, t.egress_port),
    };
    // Outer header.
    let outer_old = match direction {
        Direction::Inbound => p.dst,
        Direction::Outbound => p.src,
    };
    A::write_addr(buf, p.l3 + outer_at, &new_a);
    A::apply_header_delta(&mut buf[p.l3..], A::addr_delta(&outer_old, &new_a));
    match direction {
        Direction::Inbound => p.dst = new_a,
        Direction::Outbound => p.src = new_a,
    }
    // Embedded IP header.
    let addr_delta = A::addr_delta(&old_a, &new_a);
    A::write_addr(buf, inner_addr_at, &new_a);
    if let Some(c) = A::HEADER_CHECKSUM {
        let at = e.l3 + c;
        let v = addr_delta.apply(read16(buf, at));
        write16(buf, at, v);
    }
    // Embedded transport header.
    write16(buf, inner_port_at, new_port);
    let port_delta = Delta::between_u16(old_port, new_port);
    let l4_delta = if e.proto == proto::ICMP { port_delta } else { addr_delta.add(port_delta) };
    let csum_at = match e.proto {
        proto::TCP => Some(e.l4 + 16),
        proto::UDP => Some(e.l4 + 6),
        _ => Some(e.l4 + 2),
    };
    if let Some(at) = csum_at.filter(|at| at + 2 <= p.end) {
        let old = read16(buf, at);
        let v = if e.proto == proto::UDP { checksum::apply_udp(old, l4_delta) } else { l4_delta.apply(old) };
        write16(buf, at, v);
    }
    // The ICMP checksum over the whole (rewritten) message.
    A::fill(&mut buf[p.l4..p.end], &p.src, &p.dst);
    Ok(Translated { session: view, direction })
}
