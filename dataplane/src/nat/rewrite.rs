//! Applying a session's translation to a frame, in place.
//!
//! A session stores the checksum deltas of its outbound rewrite, computed
//! once when it is created (VPP's precomputed flows): the IP header delta
//! (the source address change; IPv6 has no header checksum) and the
//! transport delta (the pseudo-header address change plus the port or ICMP
//! identifier change; ICMPv4's checksum covers no pseudo-header). The inbound
//! rewrite is the exact inverse, so its deltas are the negation. Per packet
//! the fast path writes the new address and port and applies the deltas
//! (RFC 1624 eqn. 3): no checksum is recomputed over the payload.
//!
//! The two exceptions:
//! - UDP over IPv4 with checksum 0 (no checksum) stays 0 (RFC 768), and a
//!   computed 0 is sent as 0xFFFF.
//! - A frame whose TCP/UDP checksum field holds only the pseudo-header sum (a
//!   sender's TX offload, as veth peers do) gets its full checksum computed
//!   over the segment after the rewrite: an incremental update of a partial
//!   checksum would be neither partial nor complete. How the engine tells the
//!   two apart is documented at `engine::ChecksumHint`.
//!
//! The deltas and the new addresses and ports are all an XDP program needs to
//! do the same rewrite, so a session can be installed into a BPF map as is.

use std::net::{Ipv4Addr, Ipv6Addr};

use super::key::{proto, FlowKey, NatAddr, SessionTuple};
use crate::dissect::{IpPacket, L4};
use crate::stats::Direction;
use crate::tables::PolicyFamily;
use crate::wire::checksum::{self, Delta};
use crate::wire::{icmpv4, ipv4, ipv6, tcp, udp};

/// What differs between IPv4 and IPv6 when rewriting.
pub trait IpFamily: NatAddr + PolicyFamily {
    /// The checksum delta of replacing address `old` by `new`.
    fn addr_delta(old: &Self, new: &Self) -> Delta;
    /// Writes the source address of the IP header starting at `ip[0]`.
    fn set_src(ip: &mut [u8], a: &Self);
    /// Writes the destination address.
    fn set_dst(ip: &mut [u8], a: &Self);
    /// Applies a delta to the IP header checksum (nothing for IPv6).
    fn apply_header_delta(ip: &mut [u8], d: Delta);
    /// Decrements the TTL or hop limit and fixes the header checksum.
    fn decrement_hop_limit(ip: &mut [u8]);
    /// The pseudo-header sum.
    fn pseudo_sum(src: &Self, dst: &Self, protocol: u8, l4_len: usize) -> u32;
}

impl IpFamily for Ipv4Addr {
    #[inline]
    fn addr_delta(old: &Self, new: &Self) -> Delta {
        Delta::between_ipv4(*old, *new)
    }
    #[inline]
    fn set_src(ip: &mut [u8], a: &Self) {
        ipv4::Packet::new_unchecked(ip).set_src_addr(*a);
    }
    #[inline]
    fn set_dst(ip: &mut [u8], a: &Self) {
        ipv4::Packet::new_unchecked(ip).set_dst_addr(*a);
    }
    #[inline]
    fn apply_header_delta(ip: &mut [u8], d: Delta) {
        let mut p = ipv4::Packet::new_unchecked(ip);
        let c = d.apply(p.checksum());
        p.set_checksum(c);
    }
    #[inline]
    fn decrement_hop_limit(ip: &mut [u8]) {
        let mut p = ipv4::Packet::new_unchecked(ip);
        let ttl = p.ttl();
        // A TTL of 0 stays 0 and the checksum unchanged; any other drops by
        // one, which changes the checksum by the same constant whatever the
        // TTL and protocol (checksum::TTL_DECREMENT).
        if ttl == 0 {
            return;
        }
        p.set_ttl(ttl - 1);
        let c = checksum::TTL_DECREMENT.apply(p.checksum());
        p.set_checksum(c);
    }
    #[inline]
    fn pseudo_sum(src: &Self, dst: &Self, protocol: u8, l4_len: usize) -> u32 {
        checksum::pseudo_header_v4(*src, *dst, protocol, l4_len as u32)
    }
}

impl IpFamily for Ipv6Addr {
    #[inline]
    fn addr_delta(old: &Self, new: &Self) -> Delta {
        Delta::between_ipv6(old, new)
    }
    #[inline]
    fn set_src(ip: &mut [u8], a: &Self) {
        ipv6::Packet::new_unchecked(ip).set_src_addr(a);
    }
    #[inline]
    fn set_dst(ip: &mut [u8], a: &Self) {
        ipv6::Packet::new_unchecked(ip).set_dst_addr(a);
    }
    #[inline]
    fn apply_header_delta(_ip: &mut [u8], _d: Delta) {}
    #[inline]
    fn decrement_hop_limit(ip: &mut [u8]) {
        let mut p = ipv6::Packet::new_unchecked(ip);
        let h = p.hop_limit();
        p.set_hop_limit(h.saturating_sub(1));
    }
    #[inline]
    fn pseudo_sum(src: &Self, dst: &Self, protocol: u8, l4_len: usize) -> u32 {
        checksum::pseudo_header_v6(src, dst, protocol, l4_len as u32)
    }
}

/// The deltas of a session's outbound rewrite, packed as the session stores
/// them (IP header delta in the high 16 bits, transport delta in the low).
pub fn outbound_deltas<A: IpFamily>(t: &SessionTuple<A>) -> u32 {
    let addr = A::addr_delta(&t.pod, &t.egress);
    let port = Delta::between_u16(t.pod_port, t.egress_port);
    let l3 = if A::IS_V6 { Delta::NONE } else { addr };
    let l4 = if t.proto == proto::ICMP { port } else { addr.add(port) };
    (u32::from(l3.value()) << 16) | u32::from(l4.value())
}

/// One direction of a session in the form the XDP fast path installs into
/// its map: the packet's key before translation, the addresses and ports
/// after it, and the checksum deltas (RFC 1624) to apply to the IPv4 header
/// checksum and to the transport checksum. A UDP-over-IPv4 checksum of 0
/// stays 0 (RFC 768); TTL or hop limit is decremented separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectionRewrite<A> {
    /// The packet's 5-tuple as it arrives.
    pub key: FlowKey<A>,
    /// Source address after translation.
    pub new_src: A,
    /// Destination address after translation.
    pub new_dst: A,
    /// Source port after translation.
    pub new_sport: u16,
    /// Destination port after translation.
    pub new_dport: u16,
    /// Delta for the IPv4 header checksum (0 for IPv6).
    pub l3_delta: u16,
    /// Delta for the transport checksum.
    pub l4_delta: u16,
}

/// The rewrite of one direction of session `t` with stored `deltas`.
pub fn direction_rewrite<A: IpFamily>(t: &SessionTuple<A>, deltas: u32, dir: Direction) -> DirectionRewrite<A> {
    let (l3, l4) = deltas_for(deltas, dir);
    match dir {
        Direction::Outbound => DirectionRewrite {
            key: t.outbound_key(),
            new_src: t.egress,
            new_dst: t.remote,
            new_sport: t.egress_port,
            new_dport: t.remote_port,
            l3_delta: l3.value(),
            l4_delta: l4.value(),
        },
        Direction::Inbound => DirectionRewrite {
            key: t.inbound_key(),
            new_src: t.remote,
            new_dst: t.pod,
            new_sport: t.remote_port,
            new_dport: t.pod_port,
            l3_delta: l3.value(),
            l4_delta: l4.value(),
        },
    }
}

/// The (IP header, transport) deltas of a direction.
#[inline(always)]
pub fn deltas_for(packed: u32, dir: Direction) -> (Delta, Delta) {
    let l3 = Delta::from_value((packed >> 16) as u16);
    let l4 = Delta::from_value(packed as u16);
    match dir {
        Direction::Outbound => (l3, l4),
        Direction::Inbound => (l3.negate(), l4.negate()),
    }
}

/// Offset of the transport checksum field from the transport header.
#[inline]
pub fn l4_checksum_offset(protocol: u8) -> Option<usize> {
    match protocol {
        proto::TCP => Some(tcp::CHECKSUM_OFFSET),
        proto::UDP => Some(udp::CHECKSUM_OFFSET),
        proto::ICMP | proto::ICMPV6 => Some(icmpv4::CHECKSUM_OFFSET),
        _ => None,
    }
}

#[inline]
fn read16(buf: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([buf[at], buf[at + 1]])
}

#[inline]
fn write16(buf: &mut [u8], at: usize, v: u16) {
    buf[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

/// Rewrites the frame for one direction of session `t` and updates `p` to
/// the new addresses and ports. `partial` says the transport checksum holds
/// only a pseudo-header sum and must be completed.
#[inline]
pub fn translate<A: IpFamily>(
    buf: &mut [u8],
    p: &mut IpPacket<A>,
    dir: Direction,
    t: &SessionTuple<A>,
    deltas: u32,
    partial: bool,
) {
    let (l3d, l4d) = deltas_for(deltas, dir);
    let ip = p.l3;
    let l4 = p.l4;
    // Addresses.
    match dir {
        Direction::Outbound => {
            A::set_src(&mut buf[ip..], &t.egress);
            p.src = t.egress;
        }
        Direction::Inbound => {
            A::set_dst(&mut buf[ip..], &t.pod);
            p.dst = t.pod;
        }
    }
    A::apply_header_delta(&mut buf[ip..], l3d);
    // Ports or identifier.
    match &mut p.l4info {
        L4::Ports { sport, dport, csum, .. } => {
            match dir {
                Direction::Outbound => {
                    write16(buf, l4, t.egress_port);
                    *sport = t.egress_port;
                }
                Direction::Inbound => {
                    write16(buf, l4 + 2, t.pod_port);
                    *dport = t.pod_port;
                }
            }
            let at = l4 + if p.proto == proto::TCP { tcp::CHECKSUM_OFFSET } else { udp::CHECKSUM_OFFSET };
            let new = if partial {
                write16(buf, at, 0);
                let sum = checksum::sum(&buf[l4..p.end], A::pseudo_sum(&p.src, &p.dst, p.proto, p.end - l4));
                match checksum::finish(sum) {
                    0 if p.proto == proto::UDP => 0xFFFF,
                    c => c,
                }
            } else if p.proto == proto::UDP {
                checksum::apply_udp(read16(buf, at), l4d)
            } else {
                l4d.apply(read16(buf, at))
            };
            write16(buf, at, new);
            *csum = new;
        }
        L4::Echo { ident, .. } => {
            let new_id = match dir {
                Direction::Outbound => t.egress_port,
                Direction::Inbound => t.pod_port,
            };
            write16(buf, l4 + icmpv4::ECHO_IDENT_OFFSET, new_id);
            *ident = new_id;
            let at = l4 + icmpv4::CHECKSUM_OFFSET;
            let c = l4d.apply(read16(buf, at));
            write16(buf, at, c);
        }
        _ => {}
    }
}

/// Rewrites a later fragment's addresses (it has no transport header).
#[inline]
pub fn translate_addresses<A: IpFamily>(buf: &mut [u8], p: &mut IpPacket<A>, new_src: A, new_dst: A) {
    let d = A::addr_delta(&p.src, &new_src).add(A::addr_delta(&p.dst, &new_dst));
    A::set_src(&mut buf[p.l3..], &new_src);
    A::set_dst(&mut buf[p.l3..], &new_dst);
    A::apply_header_delta(&mut buf[p.l3..], d);
    p.src = new_src;
    p.dst = new_dst;
}
