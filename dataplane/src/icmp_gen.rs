//! ICMP errors the gateway originates, as a router does, about a datagram it
//! will not forward: Time Exceeded when the TTL or hop limit runs out (RFC 792,
//! RFC 1812 5.3.1; RFC 4443 3.3), Fragmentation Needed when an IPv4 datagram
//! is larger than the egress link's MTU (RFC 792, RFC 1191 with the next-hop
//! MTU; RFC 1812 5.2.7.1), Packet Too Big for IPv6 (RFC 4443 3.2, RFC 8201).
//!
//! The error is written in place over the frame that caused it: the
//! Ethernet (and VLAN) header stays for the caller to re-address, the
//! offending datagram moves behind a new IP and ICMP header and is cut to
//! what the message may quote (RFC 1812 4.3.2.3: an IPv4 error no longer
//! than 576 bytes; RFC 4443 2.4(c): an ICMPv6 error within the minimum MTU,
//! 1280). The caller routes it back to the datagram's source.
//!
//! Never about (RFC 1812 4.3.2.7, RFC 4443 2.4(e)): an ICMP error, a later
//! fragment, a datagram whose source is not a unicast address. Those are
//! dropped silently (still counted by the caller).
//!
//! [`RateLimit`] is the token bucket of RFC 1812 4.3.2.8 and RFC 4443 2.4(f):
//! one per worker, refilled at [`ICMP_ERRORS_PER_SEC`] up to a burst of
//! [`ICMP_ERRORS_BURST`] (Linux's `icmp_msgs_per_sec` and `icmp_msgs_burst`
//! defaults), so a flood of expiring or oversize packets costs at most that
//! many replies a second per worker.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::clock::Timestamp;
use crate::nat::key::proto;
use crate::wire::checksum;
use crate::wire::{icmpv4, icmpv6};

/// Errors per second each worker may originate.
pub const ICMP_ERRORS_PER_SEC: u32 = 1000;
/// How many errors a worker may originate at once after a quiet spell.
pub const ICMP_ERRORS_BURST: u32 = 50;

/// The largest IPv4 ICMP error (RFC 1812 4.3.2.3).
const MAX_V4_ERROR: usize = 576;
/// The largest ICMPv6 error (RFC 4443 2.4(c): the IPv6 minimum MTU).
const MAX_V6_ERROR: usize = 1280;
/// ICMP header (type, code, checksum, 4 bytes of rest) of both families.
const ICMP_HEADER: usize = 8;
/// TTL / hop limit of originated errors.
const HOP_LIMIT: u8 = 64;

/// Which error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// TTL or hop limit exceeded in transit (code 0).
    TimeExceeded,
    /// Larger than the next hop's MTU: Fragmentation Needed (IPv4, type 3
    /// code 4) or Packet Too Big (IPv6), carrying the MTU.
    TooBig {
        /// The egress link's MTU.
        mtu: u32,
    },
}

/// A token bucket for originated errors (see the module doc).
#[derive(Clone, Debug)]
pub struct RateLimit {
    /// Tokens, in thousandths (one token per `1000 / rate` ms).
    milli_tokens: u64,
    /// When the bucket was last refilled.
    last: Timestamp,
    per_sec: u32,
    burst: u32,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self::new(ICMP_ERRORS_PER_SEC, ICMP_ERRORS_BURST)
    }
}

impl RateLimit {
    /// A full bucket of `burst` tokens refilled at `per_sec`.
    pub fn new(per_sec: u32, burst: u32) -> Self {
        RateLimit { milli_tokens: u64::from(burst) * 1000, last: Timestamp::ZERO, per_sec, burst }
    }

    /// Takes a token if there is one at `now`.
    pub fn allow(&mut self, now: Timestamp) -> bool {
        let elapsed = now.as_millis().saturating_sub(self.last.as_millis());
        if elapsed > 0 {
            let refill = elapsed.saturating_mul(u64::from(self.per_sec));
            self.milli_tokens = self.milli_tokens.saturating_add(refill).min(u64::from(self.burst) * 1000);
            self.last = now;
        }
        if self.milli_tokens >= 1000 {
            self.milli_tokens -= 1000;
            true
        } else {
            false
        }
    }
}

/// Whether an error may be sent about a datagram of `protocol` whose
/// transport header starts with `first_byte` (its ICMP type, if ICMP).
fn about_an_error(protocol: u8, first_byte: Option<u8>) -> bool {
    match (protocol, first_byte) {
        (proto::ICMP, Some(t)) => icmpv4::is_error(t),
        (proto::ICMPV6, Some(t)) => icmpv6::is_error(t),
        _ => false,
    }
}

/// Writes, in place, the IPv4 error `kind` about the datagram at
/// `buf[l3..end]` (header length `ihl`), from `src` to the datagram's
/// source. Returns the new frame length, or `None` when no error may be
/// sent about this datagram (see the module doc) or `buf` is too small.
pub fn write_v4(buf: &mut [u8], l3: usize, end: usize, src: Ipv4Addr, kind: ErrorKind) -> Option<usize> {
    let ip = buf.get(l3..end)?;
    if ip.len() < 20 || ip[0] >> 4 != 4 {
        return None;
    }
    let ihl = usize::from(ip[0] & 0x0f) * 4;
    let dst = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let offset = u16::from_be_bytes([ip[6], ip[7]]) & 0x1fff;
    if offset != 0 || about_an_error(ip[9], ip.get(ihl).copied()) {
        return None;
    }
    if dst.is_unspecified() || dst.is_broadcast() || dst.is_multicast() || dst.is_loopback() {
        return None;
    }
    let quote = ip.len().min(MAX_V4_ERROR - 20 - ICMP_HEADER);
    let icmp_at = l3 + 20;
    let total = 20 + ICMP_HEADER + quote;
    if buf.len() < l3 + total {
        return None;
    }
    buf.copy_within(l3..l3 + quote, icmp_at + ICMP_HEADER);
    let (ty, code, rest) = match kind {
        ErrorKind::TimeExceeded => (icmpv4::MsgType::TIME_EXCEEDED, 0, [0; 4]),
        ErrorKind::TooBig { mtu } => {
            let m = u16::try_from(mtu).unwrap_or(u16::MAX).to_be_bytes();
            (icmpv4::MsgType::DEST_UNREACHABLE, icmpv4::CODE_FRAG_NEEDED, [0, 0, m[0], m[1]])
        }
    };
    let icmp = &mut buf[icmp_at..icmp_at + ICMP_HEADER + quote];
    icmp[..4].copy_from_slice(&[ty, code, 0, 0]);
    icmp[4..8].copy_from_slice(&rest);
    icmpv4::Packet::new_unchecked(&mut *icmp).fill_checksum();
    // The IPv4 header: no options, not fragmented, TTL 64, protocol ICMP.
    let h = &mut buf[l3..l3 + 20];
    h.copy_from_slice(&[0x45, 0, 0, 0, 0, 0, 0, 0, HOP_LIMIT, proto::ICMP, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    h[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let c = checksum::finish(checksum::sum(h, 0));
    h[10..12].copy_from_slice(&c.to_be_bytes());
    set_ethertype(buf, l3, 0x0800);
    Some(l3 + total)
}

/// Writes, in place, the ICMPv6 error `kind` about the datagram at
/// `buf[l3..end]` whose upper layer is `protocol` at `l4` (`None` for a
/// later fragment), from `src` to the datagram's source. As
/// [`write_v4`] otherwise.
pub fn write_v6(
    buf: &mut [u8],
    l3: usize,
    l4: Option<usize>,
    end: usize,
    protocol: u8,
    src: Ipv6Addr,
    kind: ErrorKind,
) -> Option<usize> {
    let ip = buf.get(l3..end)?;
    if ip.len() < 40 || ip[0] >> 4 != 6 {
        return None;
    }
    let l4 = l4?;
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?);
    if about_an_error(protocol, buf.get(l4).copied()) {
        return None;
    }
    if dst.is_unspecified() || dst.is_multicast() || dst.is_loopback() {
        return None;
    }
    let quote = ip.len().min(MAX_V6_ERROR - 40 - ICMP_HEADER);
    let icmp_at = l3 + 40;
    let total = 40 + ICMP_HEADER + quote;
    if buf.len() < l3 + total {
        return None;
    }
    buf.copy_within(l3..l3 + quote, icmp_at + ICMP_HEADER);
    let (ty, rest) = match kind {
        ErrorKind::TimeExceeded => (icmpv6::MsgType::TIME_EXCEEDED, [0; 4]),
        ErrorKind::TooBig { mtu } => (icmpv6::MsgType::PACKET_TOO_BIG, mtu.to_be_bytes()),
    };
    let icmp = &mut buf[icmp_at..icmp_at + ICMP_HEADER + quote];
    icmp[..4].copy_from_slice(&[ty, 0, 0, 0]);
    icmp[4..8].copy_from_slice(&rest);
    icmpv6::Packet::new_unchecked(&mut *icmp).fill_checksum(&src, &dst);
    let h = &mut buf[l3..l3 + 40];
    h[..4].copy_from_slice(&[0x60, 0, 0, 0]);
    h[4..6].copy_from_slice(&((ICMP_HEADER + quote) as u16).to_be_bytes());
    h[6] = proto::ICMPV6;
    h[7] = HOP_LIMIT;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    set_ethertype(buf, l3, 0x86dd);
    Some(l3 + total)
}

/// The EtherType just before the IP header (after any VLAN tag).
fn set_ethertype(buf: &mut [u8], l3: usize, ethertype: u16) {
    if let Some(t) = l3.checked_sub(2).and_then(|at| buf.get_mut(at..l3)) {
        t.copy_from_slice(&ethertype.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{Icmpv4Type, Icmpv6Type, PacketHeaders};

    const POD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
    const SERVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
    const GW: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);

    fn udp4(len: usize, df: bool, ttl: u8) -> Vec<u8> {
        let mut v = Vec::new();
        let b = etherparse::PacketBuilder::ethernet2([2; 6], [4; 6])
            .ipv4(POD.octets(), SERVER.octets(), ttl)
            .udp(40000, 9000);
        b.write(&mut v, &vec![0xab; len]).unwrap();
        if !df {
            v[20] &= !0x40;
            let c = {
                v[24] = 0;
                v[25] = 0;
                checksum::finish(checksum::sum(&v[14..34], 0))
            };
            v[24..26].copy_from_slice(&c.to_be_bytes());
        }
        v
    }

    #[test]
    fn frag_needed_quotes_the_datagram_within_576_bytes() {
        let f = udp4(1400, true, 64);
        let mut buf = f.clone();
        buf.resize(2048, 0);
        let n = write_v4(&mut buf, 14, f.len(), GW, ErrorKind::TooBig { mtu: 1280 }).unwrap();
        assert_eq!(n, 14 + 576);
        let h = PacketHeaders::from_ethernet_slice(&buf[..n]).unwrap();
        let Some(etherparse::NetHeaders::Ipv4(ip, _)) = h.net else { panic!("ipv4") };
        assert_eq!((ip.source, ip.destination, ip.time_to_live), (GW.octets(), POD.octets(), 64));
        assert_eq!(ip.header_checksum, ip.calc_header_checksum());
        let Some(etherparse::TransportHeader::Icmpv4(icmp)) = h.transport else { panic!("icmp") };
        assert_eq!(
            icmp.icmp_type,
            Icmpv4Type::DestinationUnreachable(etherparse::icmpv4::DestUnreachableHeader::FragmentationNeeded {
                next_hop_mtu: 1280
            })
        );
        assert!(icmpv4::Packet::new_unchecked(&buf[34..n]).verify_checksum());
        // The quote starts with the original IP header, unchanged.
        assert_eq!(&buf[42..62], &f[14..34]);
    }

    #[test]
    fn time_exceeded_quotes_a_small_datagram_whole() {
        let f = udp4(20, true, 1);
        let mut buf = f.clone();
        buf.resize(2048, 0);
        let n = write_v4(&mut buf, 14, f.len(), GW, ErrorKind::TimeExceeded).unwrap();
        assert_eq!(n, 14 + 20 + 8 + (f.len() - 14));
        assert_eq!(&buf[42..n], &f[14..]);
        assert_eq!((buf[34], buf[35]), (11, 0));
        assert!(icmpv4::Packet::new_unchecked(&buf[34..n]).verify_checksum());
    }

    #[test]
    fn never_about_errors_later_fragments_or_a_small_buffer() {
        let mut f = udp4(20, true, 1);
        f[23] = proto::ICMP;
        f[34] = icmpv4::MsgType::DEST_UNREACHABLE;
        let len = f.len();
        f.resize(2048, 0);
        assert_eq!(write_v4(&mut f, 14, len, GW, ErrorKind::TimeExceeded), None, "an error about an error");
        let mut f = udp4(20, false, 1);
        f[21] = 9; // fragment offset 9
        let len = f.len();
        f.resize(2048, 0);
        assert_eq!(write_v4(&mut f, 14, len, GW, ErrorKind::TimeExceeded), None, "a later fragment");
        let mut f = udp4(20, true, 1);
        let len = f.len();
        assert_eq!(write_v4(&mut f, 14, len, GW, ErrorKind::TimeExceeded), None, "no room for the header");
    }

    #[test]
    fn packet_too_big_v6() {
        let pod: Ipv6Addr = "2001:db8:18::10".parse().unwrap();
        let server: Ipv6Addr = "2001:db8:51::7".parse().unwrap();
        let gw: Ipv6Addr = "2001:db8:2::2".parse().unwrap();
        let mut f = Vec::new();
        etherparse::PacketBuilder::ethernet2([2; 6], [4; 6])
            .ipv6(pod.octets(), server.octets(), 64)
            .udp(40000, 9000)
            .write(&mut f, &[0xab; 1400])
            .unwrap();
        let len = f.len();
        f.resize(2048, 0);
        let n = write_v6(&mut f, 14, Some(54), len, proto::UDP, gw, ErrorKind::TooBig { mtu: 1280 }).unwrap();
        assert_eq!(n, 14 + 1280);
        let h = PacketHeaders::from_ethernet_slice(&f[..n]).unwrap();
        let Some(etherparse::TransportHeader::Icmpv6(icmp)) = h.transport else { panic!("icmpv6") };
        assert_eq!(icmp.icmp_type, Icmpv6Type::PacketTooBig { mtu: 1280 });
        assert!(icmpv6::Packet::new_unchecked(&f[54..n]).verify_checksum(&gw, &pod));
        assert_eq!(write_v6(&mut f, 14, None, len, proto::UDP, gw, ErrorKind::TimeExceeded), None, "later fragment");
    }

    #[test]
    fn rate_limit_is_a_token_bucket() {
        let mut r = RateLimit::new(10, 3);
        let t = Timestamp::from_secs(5);
        assert_eq!((0..5).filter(|_| r.allow(t)).count(), 3, "the burst");
        assert!(!r.allow(t.plus(std::time::Duration::from_millis(99))), "a tenth of a token short");
        assert!(r.allow(t.plus(std::time::Duration::from_millis(100))), "one token per 100 ms");
        assert!(!r.allow(t.plus(std::time::Duration::from_millis(100))));
        let later = t.plus(std::time::Duration::from_secs(60));
        assert_eq!((0..5).filter(|_| r.allow(later)).count(), 3, "refilled to the burst, not beyond");
    }
}
