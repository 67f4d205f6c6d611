//! IPv4 headers (RFC 791 section 3.1), options included, and the header
//! checksum (RFC 791, computed as in RFC 1071).
//!
//! `check_len` validates version, IHL (5..=15 words) and the total length
//! against the buffer; `payload()` ends at the total length, so Ethernet
//! padding after the datagram is never taken for payload.

use std::net::Ipv4Addr;

use super::checksum;
use super::{read_array, read_u16, truncated, write_u16, Error, Layer, Result};

/// A read/write view of an IPv4 datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const VER_IHL: usize = 0;
    pub const DSCP_ECN: usize = 1;
    pub const TOTAL_LEN: usize = 2;
    pub const IDENT: usize = 4;
    pub const FLAGS_FRAG: usize = 6;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: usize = 10;
    pub const SRC: usize = 12;
    pub const DST: usize = 16;
    pub const OPTIONS: usize = 20;
}

/// Length of an IPv4 header without options.
pub const MIN_HEADER_LEN: usize = field::OPTIONS;
/// Offset of the header checksum field.
pub const CHECKSUM_OFFSET: usize = field::CHECKSUM;
/// Offset of the source address (the destination follows it).
pub const SRC_ADDR_OFFSET: usize = field::SRC;
/// Offset of the destination address.
pub const DST_ADDR_OFFSET: usize = field::DST;

const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const FRAG_OFFSET_MASK: u16 = 0x1fff;

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

    /// Ensures no accessor can panic: version 4, IHL >= 5, the header within
    /// the buffer, header length <= total length <= buffer length.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < MIN_HEADER_LEN {
            return Err(truncated(Layer::Ipv4, MIN_HEADER_LEN, have));
        }
        if self.version() != 4 {
            return Err(Error::BadVersion { expected: 4, found: self.version() });
        }
        let header_len = self.header_len();
        if header_len < MIN_HEADER_LEN {
            return Err(Error::BadHeaderLength { ihl: self.buffer.as_ref()[field::VER_IHL] & 0x0f });
        }
        if header_len > have {
            return Err(truncated(Layer::Ipv4, header_len, have));
        }
        let total_len = self.total_len();
        if usize::from(total_len) < header_len {
            return Err(Error::BadTotalLength { total_len, header_len });
        }
        if usize::from(total_len) > have {
            return Err(truncated(Layer::Ipv4, usize::from(total_len), have));
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Version (4 after `check_len`).
    #[inline]
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }

    /// Header length in bytes (IHL * 4), 20..=60 after `check_len`.
    #[inline]
    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::VER_IHL] & 0x0f) * 4
    }

    /// The DSCP and ECN byte (formerly TOS).
    #[inline]
    pub fn dscp_ecn(&self) -> u8 {
        self.buffer.as_ref()[field::DSCP_ECN]
    }

    /// Total length of the datagram, header included.
    #[inline]
    pub fn total_len(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::TOTAL_LEN)
    }

    /// Identification.
    #[inline]
    pub fn ident(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::IDENT)
    }

    /// Don't Fragment.
    #[inline]
    pub fn dont_frag(&self) -> bool {
        read_u16(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_DF != 0
    }

    /// More Fragments.
    #[inline]
    pub fn more_frags(&self) -> bool {
        read_u16(self.buffer.as_ref(), field::FLAGS_FRAG) & FLAG_MF != 0
    }

    /// Fragment offset in bytes (the field counts 8-byte units).
    #[inline]
    pub fn frag_offset(&self) -> u16 {
        (read_u16(self.buffer.as_ref(), field::FLAGS_FRAG) & FRAG_OFFSET_MASK) * 8
    }

    /// Part of a fragmented datagram: MF set or a non-zero offset.
    #[inline]
    pub fn is_fragment(&self) -> bool {
        self.more_frags() || self.frag_offset() != 0
    }

    /// The first fragment of a fragmented datagram (offset 0, MF set): it
    /// carries the L4 header. An unfragmented datagram is not a fragment, so
    /// this is false for it; `frag_offset() == 0` tells whether the payload
    /// starts with the L4 header in both cases.
    #[inline]
    pub fn is_first_fragment(&self) -> bool {
        self.more_frags() && self.frag_offset() == 0
    }

    /// Time to live.
    #[inline]
    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }

    /// Protocol (see [`IpProtocol`](super::IpProtocol)).
    #[inline]
    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }

    /// Header checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// Source address.
    #[inline]
    pub fn src_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(read_array::<4>(self.buffer.as_ref(), field::SRC))
    }

    /// Destination address.
    #[inline]
    pub fn dst_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(read_array::<4>(self.buffer.as_ref(), field::DST))
    }

    /// The options bytes (empty when IHL is 5).
    #[inline]
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[field::OPTIONS..self.header_len()]
    }

    /// The bytes after the header, up to the total length.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..usize::from(self.total_len())]
    }

    /// The header checksum verifies (RFC 1071 4.1: the sum over the header,
    /// checksum included, is all ones).
    #[inline]
    pub fn verify_checksum(&self) -> bool {
        checksum::fold(checksum::sum(&self.buffer.as_ref()[..self.header_len()], 0)) == 0xffff
    }

    /// The TCP/UDP pseudo-header sum of this datagram, with the payload
    /// length as the L4 length (right for an unfragmented datagram).
    #[inline]
    pub fn pseudo_header_sum(&self) -> u32 {
        let l4_len = usize::from(self.total_len()).saturating_sub(self.header_len());
        checksum::pseudo_header_v4(self.src_addr(), self.dst_addr(), self.protocol(), l4_len as u32)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the source address (the checksum is not updated).
    #[inline]
    pub fn set_src_addr(&mut self, addr: Ipv4Addr) {
        self.buffer.as_mut()[field::SRC..field::SRC + 4].copy_from_slice(&addr.octets());
    }

    /// Sets the destination address (the checksum is not updated).
    #[inline]
    pub fn set_dst_addr(&mut self, addr: Ipv4Addr) {
        self.buffer.as_mut()[field::DST..field::DST + 4].copy_from_slice(&addr.octets());
    }

    /// Sets the time to live (the checksum is not updated).
    #[inline]
    pub fn set_ttl(&mut self, ttl: u8) {
        self.buffer.as_mut()[field::TTL] = ttl;
    }

    /// Sets the identification (the checksum is not updated).
    #[inline]
    pub fn set_ident(&mut self, ident: u16) {
        write_u16(self.buffer.as_mut(), field::IDENT, ident);
    }

    /// Sets the header checksum field.
    #[inline]
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM, value);
    }

    /// Computes the header checksum and writes it.
    #[inline]
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let header_len = self.header_len();
        let c = checksum::finish(checksum::sum(&self.buffer.as_ref()[..header_len], 0));
        self.set_checksum(c);
    }

    /// The options bytes, mutable.
    #[inline]
    pub fn options_mut(&mut self) -> &mut [u8] {
        let header_len = self.header_len();
        &mut self.buffer.as_mut()[field::OPTIONS..header_len]
    }

    /// The bytes after the header, up to the total length, mutable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let range = self.header_len()..usize::from(self.total_len());
        &mut self.buffer.as_mut()[range]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex};
    use crate::wire::IpProtocol;
    use proptest::prelude::*;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> usize {
        let mut n = usize::from(p.version())
            + p.header_len()
            + usize::from(p.dscp_ecn())
            + usize::from(p.total_len())
            + usize::from(p.ident())
            + usize::from(p.dont_frag())
            + usize::from(p.more_frags())
            + usize::from(p.frag_offset())
            + usize::from(p.is_fragment())
            + usize::from(p.is_first_fragment())
            + usize::from(p.ttl())
            + usize::from(p.protocol())
            + usize::from(p.checksum())
            + usize::from(p.src_addr().octets()[0])
            + usize::from(p.dst_addr().octets()[0])
            + p.options().len()
            + p.payload().len()
            + usize::from(p.verify_checksum());
        n += p.pseudo_header_sum() as usize;
        n
    }

    #[test]
    fn captured_echo_request() {
        let f = hex(testdata::ICMP_ECHO_REQUEST);
        let p = Packet::new_checked(&f[14..]).unwrap();
        assert_eq!(p.version(), 4);
        assert_eq!(p.header_len(), 20);
        assert_eq!(p.total_len(), 84);
        assert_eq!(p.ident(), 0x1155);
        assert!(p.dont_frag());
        assert!(!p.is_fragment());
        assert!(!p.is_first_fragment());
        assert_eq!(p.ttl(), 64);
        assert_eq!(p.protocol(), IpProtocol::ICMP);
        assert_eq!(p.checksum(), 0xa454);
        assert!(p.verify_checksum());
        assert_eq!(p.src_addr(), Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(p.dst_addr(), Ipv4Addr::new(192, 0, 2, 254));
        assert!(p.options().is_empty());
        assert_eq!(p.payload().len(), 64);
        assert_eq!(&p.payload()[..4], &[0x08, 0x00, 0xae, 0xf2]);
    }

    #[test]
    fn captured_options_record_route() {
        let f = hex(testdata::IPV4_RR_OPTIONS_REQUEST);
        let p = Packet::new_checked(&f[14..]).unwrap();
        assert_eq!(p.header_len(), 60);
        assert_eq!(p.total_len(), 124);
        assert!(p.verify_checksum());
        // NOP, then Record Route: type 7, length 39, pointer 8, 192.0.2.1.
        assert_eq!(&p.options()[..8], &[0x01, 0x07, 0x27, 0x08, 192, 0, 2, 1]);
        assert_eq!(p.options().len(), 40);
        assert_eq!(p.payload().len(), 64);
        assert_eq!(p.payload()[0], 8, "ICMP echo request after the options");
        let r = hex(testdata::IPV4_RR_OPTIONS_REPLY);
        let q = Packet::new_checked(&r[14..]).unwrap();
        assert_eq!(q.ttl(), 63);
        assert_eq!(&q.options()[..4], &[0x07, 0x27, 0x18, 192]);
        assert!(q.verify_checksum());
    }

    #[test]
    fn captured_fragments() {
        let first = hex(testdata::IPV4_FRAG_FIRST);
        let p = Packet::new_checked(&first[14..]).unwrap();
        assert_eq!((p.ident(), p.frag_offset(), p.more_frags()), (33309, 0, true));
        assert!(p.is_fragment() && p.is_first_fragment());
        assert_eq!(p.payload().len(), 1480);

        let middle = hex(testdata::IPV4_FRAG_MIDDLE);
        let p = Packet::new_checked(&middle[14..]).unwrap();
        assert_eq!((p.ident(), p.frag_offset(), p.more_frags()), (33309, 1480, true));
        assert!(p.is_fragment() && !p.is_first_fragment());

        let last = hex(testdata::IPV4_FRAG_LAST);
        let p = Packet::new_checked(&last[14..]).unwrap();
        assert_eq!((p.ident(), p.frag_offset(), p.more_frags()), (33309, 2960, false));
        assert!(p.is_fragment() && !p.is_first_fragment());
        assert!(!p.dont_frag());
        assert_eq!(p.payload().len(), 48);
        assert!(p.verify_checksum());
    }

    #[test]
    fn padding_is_not_payload() {
        // A 60-byte minimum frame around a 40-byte TCP RST: 6 bytes of padding.
        let mut f = hex(testdata::TCP4_RST);
        assert_eq!(f.len(), 54);
        f.extend_from_slice(&[0xee; 6]);
        let p = Packet::new_checked(&f[14..]).unwrap();
        assert_eq!(p.total_len(), 40);
        assert_eq!(p.payload().len(), 20);
        assert!(!p.payload().contains(&0xee));
    }

    #[test]
    fn bad_headers() {
        let f = hex(testdata::ICMP_ECHO_REQUEST);
        let ip = &f[14..];
        let mut v6 = ip.to_vec();
        v6[0] = 0x65;
        assert_eq!(Packet::new_checked(&v6[..]), Err(Error::BadVersion { expected: 4, found: 6 }));
        let mut ihl4 = ip.to_vec();
        ihl4[0] = 0x44;
        assert_eq!(Packet::new_checked(&ihl4[..]), Err(Error::BadHeaderLength { ihl: 4 }));
        let mut ihl15 = ip.to_vec();
        ihl15[0] = 0x4f; // 60-byte header in an 84-byte datagram: fine
        assert_eq!(Packet::new_checked(&ihl15[..]).unwrap().payload().len(), 24);
        let mut short_total = ip.to_vec();
        short_total[2..4].copy_from_slice(&19u16.to_be_bytes());
        assert_eq!(Packet::new_checked(&short_total[..]), Err(Error::BadTotalLength { total_len: 19, header_len: 20 }));
        let mut long_total = ip.to_vec();
        long_total[2..4].copy_from_slice(&85u16.to_be_bytes());
        assert_eq!(
            Packet::new_checked(&long_total[..]),
            Err(Error::Truncated { layer: Layer::Ipv4, need: 85, have: 84 })
        );
    }

    #[test]
    fn every_prefix_of_an_options_packet() {
        let f = hex(testdata::IPV4_RR_OPTIONS_REQUEST);
        let ip = &f[14..];
        for len in 0..=ip.len() {
            match Packet::new_checked(&ip[..len]) {
                Ok(p) => {
                    assert_eq!(len, 124);
                    exercise(&p);
                }
                Err(Error::Truncated { layer: Layer::Ipv4, need, have }) => {
                    assert_eq!(have, len);
                    let expected = if len < 20 {
                        20
                    } else if len < 60 {
                        60
                    } else {
                        124
                    };
                    assert_eq!(need, expected);
                }
                Err(e) => panic!("unexpected {e}"),
            }
        }
    }

    #[test]
    fn setters_and_fill_checksum() {
        let f = hex(testdata::ICMP_ECHO_REQUEST);
        let mut ip = f[14..].to_vec();
        let mut p = Packet::new_checked(&mut ip[..]).unwrap();
        p.set_src_addr(Ipv4Addr::new(203, 0, 113, 7));
        p.set_dst_addr(Ipv4Addr::new(198, 51, 100, 9));
        p.set_ttl(63);
        p.set_ident(0xbeef);
        assert!(!p.verify_checksum());
        p.fill_checksum();
        assert!(p.verify_checksum());
        assert_eq!(p.src_addr(), Ipv4Addr::new(203, 0, 113, 7));
        assert_eq!(p.dst_addr(), Ipv4Addr::new(198, 51, 100, 9));
        // Independent check with etherparse.
        let (h, _) = etherparse::Ipv4Header::from_slice(&ip).unwrap();
        assert_eq!(h.header_checksum, h.calc_header_checksum());
        assert_eq!(h.identification, 0xbeef);
        assert_eq!(h.time_to_live, 63);
        let mut p = Packet::new_checked(&mut ip[..]).unwrap();
        p.payload_mut()[0] = 0;
        assert_eq!(p.payload()[0], 0);
        assert!(p.options_mut().is_empty());
    }

    #[test]
    fn incremental_ttl_and_address_update_matches_fill() {
        let f = hex(testdata::IPV4_RR_OPTIONS_REQUEST);
        let mut ip = f[14..].to_vec();
        let old_hdr = ip[..60].to_vec();
        let mut p = Packet::new_checked(&mut ip[..]).unwrap();
        let new_src = Ipv4Addr::new(203, 0, 113, 1);
        let d = checksum::Delta::between_ipv4(p.src_addr(), new_src)
            .add(checksum::Delta::between(&old_hdr[8..10], &[63, old_hdr[9]]));
        p.set_src_addr(new_src);
        p.set_ttl(63);
        let c = d.apply(p.checksum());
        p.fill_checksum();
        assert_eq!(c, p.checksum());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..100)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
        }

        #[test]
        fn plausible_headers_never_panic(ihl in 0u8..16, total in 0u16..120,
                                         rest in proptest::collection::vec(any::<u8>(), 0..100)) {
            let mut bytes = vec![0x40 | ihl, 0];
            bytes.extend_from_slice(&total.to_be_bytes());
            bytes.extend_from_slice(&rest);
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
                prop_assert!(p.payload().len() + p.header_len() == usize::from(total));
            }
        }
    }
}
