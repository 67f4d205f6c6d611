//! IPv6: the fixed header (RFC 8200 section 3) and the walk over extension
//! headers to the upper-layer header (RFC 8200 section 4).
//!
//! `check_len` validates the version and the payload length against the
//! buffer; `payload()` ends at the payload length (Ethernet padding excluded).
//! [`walk_extensions`] finds the upper-layer protocol, where it starts and the
//! Fragment header, if any.

use std::net::Ipv6Addr;

use super::checksum;
use super::{read_array, read_u16, read_u32, truncated, write_u16, write_u32, Error, IpProtocol, Layer, Result};

/// A read/write view of an IPv6 datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const VER_TC_FLOW: usize = 0;
    pub const PAYLOAD_LEN: usize = 4;
    pub const NEXT_HEADER: usize = 6;
    pub const HOP_LIMIT: usize = 7;
    pub const SRC: usize = 8;
    pub const DST: usize = 24;
    pub const PAYLOAD: usize = 40;

    // Inside extension headers (offsets from the extension header's start).
    pub const EXT_NEXT_HEADER: usize = 0;
    pub const EXT_LEN: usize = 1;
    pub const FRAG_OFFSET_FLAGS: usize = 2;
    pub const FRAG_IDENT: usize = 4;
    pub const FRAG_LEN: usize = 8;
}

/// Length of the fixed IPv6 header.
pub const HEADER_LEN: usize = field::PAYLOAD;
/// Offset of the source address (the destination follows it).
pub const SRC_ADDR_OFFSET: usize = field::SRC;
/// Offset of the destination address.
pub const DST_ADDR_OFFSET: usize = field::DST;
/// The most extension headers [`walk_extensions`] follows before giving up.
pub const MAX_EXTENSION_HEADERS: usize = 8;

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Packet<T> {
        Packet { buffer }
    }

    /// Wraps a buffer after [`check_len`](Self::check_len).
    pub fn new_checked(buffer: T) -> Result<Packet<T>> {
        let packet = Self::new_unchecked(buffer);
        packet.check_len()?;
        Ok(packet)
    }

    /// Ensures no accessor can panic: version 6, and the fixed header plus the
    /// payload length fit in the buffer. (Jumbograms, RFC 2675, are not
    /// carried by Ethernet; a payload length of 0 is an empty payload.)
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(Layer::Ipv6, HEADER_LEN, have));
        }
        if self.version() != 6 {
            return Err(Error::BadVersion { expected: 6, found: self.version() });
        }
        let total = self.total_len();
        if total > have {
            return Err(truncated(Layer::Ipv6, total, have));
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Version (6 after `check_len`).
    #[inline]
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_TC_FLOW] >> 4
    }

    /// Traffic class.
    #[inline]
    pub fn traffic_class(&self) -> u8 {
        (read_u16(self.buffer.as_ref(), field::VER_TC_FLOW) >> 4) as u8
    }

    /// Flow label (20 bits).
    #[inline]
    pub fn flow_label(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::VER_TC_FLOW) & 0x000f_ffff
    }

    /// Payload length: the bytes after the fixed header, extension headers included.
    #[inline]
    pub fn payload_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::PAYLOAD_LEN)
    }

    /// Fixed header plus payload length.
    #[inline]
    pub fn total_len(&self) -> usize {
        HEADER_LEN + usize::from(self.payload_len())
    }

    /// Next header of the fixed header.
    #[inline]
    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[field::NEXT_HEADER]
    }

    /// Hop limit.
    #[inline]
    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[field::HOP_LIMIT]
    }

    /// Source address.
    #[inline]
    pub fn src_addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(read_array::<16>(self.buffer.as_ref(), field::SRC))
    }

    /// Destination address.
    #[inline]
    pub fn dst_addr(&self) -> Ipv6Addr {
        Ipv6Addr::from(read_array::<16>(self.buffer.as_ref(), field::DST))
    }

    /// The payload (extension headers included), up to the payload length.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..self.total_len()]
    }

    /// The bytes from `l4_offset` (counted from the start of the IPv6
    /// header, as in [`Ipv6Upper::l4_offset`]) to the end of the payload;
    /// empty if `l4_offset` is past it.
    #[inline]
    pub fn upper_layer(&self, l4_offset: usize) -> &[u8] {
        self.buffer.as_ref().get(l4_offset..self.total_len()).unwrap_or(&[])
    }

    /// The pseudo-header sum (RFC 8200 8.1) for the upper layer found by
    /// [`walk_extensions`]: its protocol and its length.
    #[inline]
    pub fn pseudo_header_sum(&self, upper: &Ipv6Upper) -> u32 {
        let l4_len = self.total_len().saturating_sub(upper.l4_offset) as u32;
        checksum::pseudo_header_v6(&self.src_addr(), &self.dst_addr(), upper.protocol, l4_len)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Writes version 6, the traffic class and the flow label.
    #[inline]
    pub fn set_version_tc_flow(&mut self, traffic_class: u8, flow_label: u32) {
        let word = 6 << 28 | u32::from(traffic_class) << 20 | (flow_label & 0x000f_ffff);
        write_u32(self.buffer.as_mut(), field::VER_TC_FLOW, word);
    }

    /// Sets the payload length. Invalidates `check_len`: the caller makes
    /// sure the buffer holds that many bytes after the header.
    #[inline]
    pub fn set_payload_len(&mut self, len: u16) {
        write_u16(self.buffer.as_mut(), field::PAYLOAD_LEN, len);
    }

    /// Sets the next header of the fixed header.
    #[inline]
    pub fn set_next_header(&mut self, value: u8) {
        self.buffer.as_mut()[field::NEXT_HEADER] = value;
    }

    /// Sets the hop limit.
    #[inline]
    pub fn set_hop_limit(&mut self, value: u8) {
        self.buffer.as_mut()[field::HOP_LIMIT] = value;
    }

    /// Sets the source address.
    #[inline]
    pub fn set_src_addr(&mut self, addr: &Ipv6Addr) {
        self.buffer.as_mut()[field::SRC..field::SRC + 16].copy_from_slice(&addr.octets());
    }

    /// Sets the destination address.
    #[inline]
    pub fn set_dst_addr(&mut self, addr: &Ipv6Addr) {
        self.buffer.as_mut()[field::DST..field::DST + 16].copy_from_slice(&addr.octets());
    }

    /// The payload, mutable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let end = self.total_len();
        &mut self.buffer.as_mut()[HEADER_LEN..end]
    }

    /// [`upper_layer`](Packet::upper_layer), mutable.
    #[inline]
    pub fn upper_layer_mut(&mut self, l4_offset: usize) -> &mut [u8] {
        let end = self.total_len();
        self.buffer.as_mut().get_mut(l4_offset..end).unwrap_or(&mut [])
    }
}

/// An IPv6 Fragment header (RFC 8200 4.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Fragment {
    /// Fragment offset in bytes.
    pub offset_bytes: u16,
    /// The M flag: more fragments follow.
    pub more: bool,
    /// Identification.
    pub ident: u32,
    /// Where the Fragment header starts, from the start of the IPv6 header.
    pub header_offset: usize,
    /// The Fragment header's Next Header: the same in every fragment of a
    /// datagram (RFC 8200 4.5), unlike the upper-layer protocol, which only
    /// the first fragment reaches when extension headers follow.
    pub next_header: u8,
}

impl Ipv6Fragment {
    /// Offset 0: this fragment starts with the rest of the header chain and
    /// the upper-layer header. True for an atomic fragment (offset 0, M
    /// clear, RFC 6946), which is a whole datagram.
    pub fn is_first(&self) -> bool {
        self.offset_bytes == 0
    }

    /// Offset 0 and M clear: a whole datagram in a Fragment header (RFC 6946).
    pub fn is_atomic(&self) -> bool {
        self.offset_bytes == 0 && !self.more
    }
}

/// Where the upper layer of an IPv6 datagram is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ipv6Upper {
    /// The upper-layer protocol: TCP, UDP, ICMPv6, or whatever next header
    /// ended the walk (No Next Header 59, ESP 50, an unknown value...).
    pub protocol: u8,
    /// Where the upper-layer header starts, from the start of the IPv6
    /// header. For a non-first fragment (`fragment` with a non-zero offset)
    /// it points right after the Fragment header, and **there is no L4 header
    /// there**: those bytes continue the fragmentable part of the datagram
    /// at `offset_bytes`; `protocol` is the Fragment header's next header.
    pub l4_offset: usize,
    /// The Fragment header, if the datagram has one.
    pub fragment: Option<Ipv6Fragment>,
}

/// Walks the extension headers of a checked packet (RFC 8200 4.1) up to the
/// upper-layer header.
///
/// Follows Hop-by-Hop Options (0, only as the first header), Routing (43),
/// Fragment (44), Destination Options (60) and AH (51, length in 4-byte units
/// plus 2, RFC 4302 2.2); any other next header ends the walk and is returned
/// as the protocol. At most [`MAX_EXTENSION_HEADERS`] are followed. A non-first
/// fragment ends the walk after its Fragment header (see [`Ipv6Upper`]).
/// Every header must fit within the payload length.
pub fn walk_extensions<T: AsRef<[u8]>>(packet: &Packet<T>) -> Result<Ipv6Upper> {
    let data = packet.buffer.as_ref();
    let end = packet.total_len().min(data.len());
    let mut next = packet.next_header();
    let mut offset = HEADER_LEN;
    let mut fragment: Option<Ipv6Fragment> = None;
    let mut count = 0;
    loop {
        let fixed_len = match next {
            IpProtocol::HOP_BY_HOP | IpProtocol::IPV6_ROUTING | IpProtocol::IPV6_DEST_OPTIONS | IpProtocol::AH => 2,
            IpProtocol::IPV6_FRAGMENT => field::FRAG_LEN,
            protocol => return Ok(Ipv6Upper { protocol, l4_offset: offset, fragment }),
        };
        if count == MAX_EXTENSION_HEADERS {
            return Err(Error::TooManyExtensionHeaders { limit: MAX_EXTENSION_HEADERS });
        }
        count += 1;
        if next == IpProtocol::HOP_BY_HOP && offset != HEADER_LEN {
            return Err(Error::MisplacedHopByHop { offset });
        }
        if end < offset + fixed_len {
            return Err(truncated(Layer::Ipv6Extension, offset + fixed_len, end));
        }
        let header_len = match next {
            IpProtocol::IPV6_FRAGMENT => field::FRAG_LEN,
            IpProtocol::AH => (usize::from(data[offset + field::EXT_LEN]) + 2) * 4,
            _ => (usize::from(data[offset + field::EXT_LEN]) + 1) * 8,
        };
        if end < offset + header_len {
            return Err(truncated(Layer::Ipv6Extension, offset + header_len, end));
        }
        let following = data[offset + field::EXT_NEXT_HEADER];
        if next == IpProtocol::IPV6_FRAGMENT {
            if fragment.is_some() {
                return Err(Error::DuplicateFragmentHeader { offset });
            }
            let off_flags = read_u16(data, offset + field::FRAG_OFFSET_FLAGS);
            let frag = Ipv6Fragment {
                offset_bytes: off_flags & 0xfff8,
                more: off_flags & 0x0001 != 0,
                ident: read_u32(data, offset + field::FRAG_IDENT),
                header_offset: offset,
                next_header: following,
            };
            fragment = Some(frag);
            if !frag.is_first() {
                return Ok(Ipv6Upper { protocol: following, l4_offset: offset + header_len, fragment });
            }
        }
        next = following;
        offset += header_len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex};
    use proptest::prelude::*;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> usize {
        let mut n = usize::from(p.version())
            + usize::from(p.traffic_class())
            + p.flow_label() as usize
            + usize::from(p.payload_len())
            + p.total_len()
            + usize::from(p.next_header())
            + usize::from(p.hop_limit())
            + usize::from(p.src_addr().octets()[15])
            + usize::from(p.dst_addr().octets()[15])
            + p.payload().len();
        if let Ok(upper) = walk_extensions(p) {
            assert!(upper.l4_offset <= p.total_len());
            n += p.upper_layer(upper.l4_offset).len() + p.pseudo_header_sum(&upper) as usize;
        }
        n + p.upper_layer(usize::MAX).len()
    }

    /// Inserts an 8-byte Hop-by-Hop header (PadN) right after the fixed
    /// header of a captured frame, fixing next header and payload length.
    fn with_hop_by_hop(frame: &[u8]) -> Vec<u8> {
        let mut out = frame[..14 + 40].to_vec();
        let first_next = out[14 + 6];
        out[14 + 6] = 0;
        let plen = u16::from_be_bytes([out[14 + 4], out[14 + 5]]) + 8;
        out[14 + 4..14 + 6].copy_from_slice(&plen.to_be_bytes());
        out.extend_from_slice(&[first_next, 0, 1, 4, 0, 0, 0, 0]);
        out.extend_from_slice(&frame[14 + 40..]);
        out
    }

    #[test]
    fn captured_echo_request() {
        let f = hex(testdata::ICMPV6_ECHO_REQUEST);
        let p = Packet::new_checked(&f[14..]).unwrap();
        assert_eq!(p.version(), 6);
        assert_eq!(p.traffic_class(), 0);
        assert_eq!(p.flow_label(), 0xdc49e);
        assert_eq!(p.payload_len(), 64);
        assert_eq!(p.next_header(), IpProtocol::ICMPV6);
        assert_eq!(p.hop_limit(), 64);
        assert_eq!(p.src_addr(), "2001:db8:a::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!(p.dst_addr(), "2001:db8:a::fe".parse::<Ipv6Addr>().unwrap());
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper, Ipv6Upper { protocol: IpProtocol::ICMPV6, l4_offset: 40, fragment: None });
        assert_eq!(p.upper_layer(upper.l4_offset)[0], 128);
    }

    #[test]
    fn captured_hop_by_hop() {
        // MLDv2 report: HBH with Router Alert, then ICMPv6.
        let f = hex(testdata::MLD_REPORT_HBH);
        let p = Packet::new_checked(&f[14..]).unwrap();
        assert_eq!(p.next_header(), IpProtocol::HOP_BY_HOP);
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper.protocol, IpProtocol::ICMPV6);
        assert_eq!(upper.l4_offset, 48);
        assert_eq!(upper.fragment, None);
        assert_eq!(p.upper_layer(48)[0], 143, "MLDv2 report type");
    }

    #[test]
    fn captured_fragments() {
        let first = hex(testdata::IPV6_FRAG_FIRST);
        let p = Packet::new_checked(&first[14..]).unwrap();
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper.protocol, IpProtocol::ICMPV6);
        assert_eq!(upper.l4_offset, 48);
        assert_eq!(
            upper.fragment,
            Some(Ipv6Fragment {
                offset_bytes: 0,
                more: true,
                ident: 0xcd6fea87,
                header_offset: 40,
                next_header: IpProtocol::ICMPV6
            })
        );
        assert_eq!(p.upper_layer(48)[0], 128, "echo request header in the first fragment");

        let last = hex(testdata::IPV6_FRAG_LAST);
        let p = Packet::new_checked(&last[14..]).unwrap();
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper.protocol, IpProtocol::ICMPV6);
        assert_eq!(upper.l4_offset, 48);
        let frag = upper.fragment.unwrap();
        assert_eq!((frag.offset_bytes, frag.more, frag.ident), (1232, false, 0xcd6fea87));
        assert!(!frag.is_first());
        assert_eq!(p.upper_layer(48).len(), 176);
    }

    #[test]
    fn hop_by_hop_then_fragment() {
        let f = with_hop_by_hop(&hex(testdata::IPV6_FRAG_FIRST));
        let p = Packet::new_checked(&f[14..]).unwrap();
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper.protocol, IpProtocol::ICMPV6);
        assert_eq!(upper.l4_offset, 56);
        assert_eq!(upper.fragment.unwrap().header_offset, 48);
        assert_eq!(p.upper_layer(56)[0], 128);

        let f = with_hop_by_hop(&hex(testdata::IPV6_FRAG_LAST));
        let p = Packet::new_checked(&f[14..]).unwrap();
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper.l4_offset, 56);
        assert_eq!(upper.fragment.unwrap().offset_bytes, 1232);
    }

    /// A datagram with the given chain of (next header, bytes) extension headers.
    fn chain(headers: &[(u8, Vec<u8>)], upper: u8, payload: &[u8]) -> Vec<u8> {
        let mut body = Vec::new();
        for (i, (_, bytes)) in headers.iter().enumerate() {
            let mut h = bytes.clone();
            h[0] = headers.get(i + 1).map_or(upper, |n| n.0);
            body.extend_from_slice(&h);
        }
        body.extend_from_slice(payload);
        let mut ip = vec![0x60, 0, 0, 0];
        ip.extend_from_slice(&(body.len() as u16).to_be_bytes());
        ip.push(headers.first().map_or(upper, |h| h.0));
        ip.push(64);
        ip.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
        ip.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        ip.extend_from_slice(&body);
        ip
    }

    #[test]
    fn all_extension_kinds_and_limits() {
        let hbh = (0u8, vec![0, 0, 1, 4, 0, 0, 0, 0]);
        let dst16 = (60u8, vec![0, 1, 1, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let routing = (43u8, vec![0, 0, 4, 0, 0, 0, 0, 0]);
        let ah = (51u8, vec![0, 4, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let frag0 = (44u8, vec![0, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef]);
        let udp = [0x30, 0x39, 0x00, 0x35, 0x00, 0x08, 0x00, 0x00];
        let ip = chain(&[hbh.clone(), dst16.clone(), routing.clone(), ah.clone(), frag0.clone()], 17, &udp);
        let p = Packet::new_checked(&ip[..]).unwrap();
        let upper = walk_extensions(&p).unwrap();
        assert_eq!(upper.protocol, 17);
        assert_eq!(upper.l4_offset, 40 + 8 + 16 + 8 + 24 + 8);
        assert_eq!(
            upper.fragment,
            Some(Ipv6Fragment { offset_bytes: 0, more: false, ident: 0xdeadbeef, header_offset: 96, next_header: 17 })
        );
        assert!(upper.fragment.unwrap().is_atomic());
        assert_eq!(p.upper_layer(upper.l4_offset), &udp);

        // Eight extension headers are followed; nine are too many.
        let eight: Vec<_> = std::iter::repeat_n(dst16.clone(), 8).collect();
        let p8 = chain(&eight, 59, &[]);
        let upper = walk_extensions(&Packet::new_checked(&p8[..]).unwrap()).unwrap();
        assert_eq!((upper.protocol, upper.l4_offset), (59, 40 + 8 * 16));
        let nine: Vec<_> = std::iter::repeat_n(dst16.clone(), 9).collect();
        let p9 = chain(&nine, 59, &[]);
        assert_eq!(
            walk_extensions(&Packet::new_checked(&p9[..]).unwrap()),
            Err(Error::TooManyExtensionHeaders { limit: 8 })
        );

        // Hop-by-Hop anywhere but first.
        let bad = chain(&[dst16.clone(), hbh.clone()], 6, &[]);
        assert_eq!(
            walk_extensions(&Packet::new_checked(&bad[..]).unwrap()),
            Err(Error::MisplacedHopByHop { offset: 56 })
        );
        // Two Fragment headers.
        let two = chain(&[frag0.clone(), frag0.clone()], 6, &[]);
        assert_eq!(
            walk_extensions(&Packet::new_checked(&two[..]).unwrap()),
            Err(Error::DuplicateFragmentHeader { offset: 48 })
        );
        // ESP ends the walk.
        let esp = chain(std::slice::from_ref(&hbh), IpProtocol::ESP, &[0; 16]);
        let upper = walk_extensions(&Packet::new_checked(&esp[..]).unwrap()).unwrap();
        assert_eq!((upper.protocol, upper.l4_offset), (50, 48));
        // A non-first fragment stops the walk even if "next" is an extension.
        let frag_later = (44u8, vec![0, 0, 0x05, 0x01, 0, 0, 0, 7]);
        let nf = chain(&[frag_later], 60, &[1, 2, 3, 4, 5, 6, 7, 8]);
        let upper = walk_extensions(&Packet::new_checked(&nf[..]).unwrap()).unwrap();
        assert_eq!(upper.protocol, 60);
        assert_eq!(upper.l4_offset, 48);
        let f = upper.fragment.unwrap();
        assert_eq!((f.offset_bytes, f.more, f.ident), (0x0500, true, 7));
    }

    #[test]
    fn extension_past_payload_length_is_truncated() {
        let dst16 = (60u8, vec![0, 1, 1, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let mut ip = chain(&[dst16], 6, &[]);
        // Claim only 8 bytes of payload, pad the buffer so check_len passes.
        ip[4..6].copy_from_slice(&8u16.to_be_bytes());
        ip.extend_from_slice(&[0; 20]);
        let p = Packet::new_checked(&ip[..]).unwrap();
        assert_eq!(walk_extensions(&p), Err(Error::Truncated { layer: Layer::Ipv6Extension, need: 56, have: 48 }));
    }

    #[test]
    fn every_prefix_of_a_fragment_with_hop_by_hop() {
        let f = with_hop_by_hop(&hex(testdata::IPV6_FRAG_LAST));
        let ip = &f[14..];
        for len in 0..=ip.len() {
            match Packet::new_checked(&ip[..len]) {
                Ok(p) => {
                    assert_eq!(len, ip.len());
                    exercise(&p);
                }
                Err(Error::Truncated { layer: Layer::Ipv6, need, have }) => {
                    assert_eq!(have, len);
                    assert_eq!(need, if len < 40 { 40 } else { ip.len() });
                }
                Err(e) => panic!("{e}"),
            }
        }
        let mut v4 = ip.to_vec();
        v4[0] = 0x45;
        assert_eq!(Packet::new_checked(&v4[..]), Err(Error::BadVersion { expected: 6, found: 4 }));
    }

    #[test]
    fn setters() {
        let mut buf = [0u8; 48];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_version_tc_flow(0xb8, 0x12345);
        p.set_payload_len(8);
        p.set_next_header(59);
        p.set_hop_limit(255);
        let a: Ipv6Addr = "2001:db8::1".parse().unwrap();
        let b: Ipv6Addr = "ff02::1".parse().unwrap();
        p.set_src_addr(&a);
        p.set_dst_addr(&b);
        p.payload_mut()[0] = 9;
        p.upper_layer_mut(47)[0] = 7;
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert_eq!((p.traffic_class(), p.flow_label()), (0xb8, 0x12345));
        assert_eq!((p.payload_len(), p.next_header(), p.hop_limit()), (8, 59, 255));
        assert_eq!((p.src_addr(), p.dst_addr()), (a, b));
        assert_eq!(&buf[..4], &[0x6b, 0x81, 0x23, 0x45]);
        assert_eq!((buf[40], buf[47]), (9, 7));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
        }

        #[test]
        fn arbitrary_extension_chains_never_panic(
            next in prop::sample::select(vec![0u8, 43, 44, 51, 60, 6, 17, 58, 59]),
            plen in 0u16..160,
            body in proptest::collection::vec(
                prop_oneof![Just(0u8), Just(44), Just(60), Just(51), Just(43), any::<u8>()], 0..160),
        ) {
            let mut ip = vec![0x60, 0, 0, 0];
            ip.extend_from_slice(&plen.to_be_bytes());
            ip.extend_from_slice(&[next, 64]);
            ip.extend_from_slice(&[0; 32]);
            ip.extend_from_slice(&body);
            if let Ok(p) = Packet::new_checked(&ip[..]) {
                exercise(&p);
            }
        }
    }
}
