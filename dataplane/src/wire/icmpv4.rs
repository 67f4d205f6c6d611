//! ICMP for IPv4 (RFC 792): the 8-byte header, echo identifier and sequence,
//! the next-hop MTU of "fragmentation needed" (RFC 1191 section 4), and the
//! invoking datagram that error messages embed.
//!
//! The buffer is the IP payload; the checksum covers all of it (no
//! pseudo-header).

use super::checksum;
use super::{read_u16, truncated, write_u16, Layer, Result};

/// ICMPv4 message types. A namespace for `u8` constants.
#[derive(Debug)]
pub enum MsgType {}

impl MsgType {
    /// Echo Reply.
    pub const ECHO_REPLY: u8 = 0;
    /// Destination Unreachable.
    pub const DEST_UNREACHABLE: u8 = 3;
    /// Source Quench (deprecated by RFC 6633, still an error message).
    pub const SOURCE_QUENCH: u8 = 4;
    /// Redirect.
    pub const REDIRECT: u8 = 5;
    /// Echo Request.
    pub const ECHO_REQUEST: u8 = 8;
    /// Time Exceeded.
    pub const TIME_EXCEEDED: u8 = 11;
    /// Parameter Problem.
    pub const PARAM_PROBLEM: u8 = 12;
}

/// Destination Unreachable code 4: fragmentation needed and DF set.
pub const CODE_FRAG_NEEDED: u8 = 4;

/// True for the message types that carry an invoking datagram (RFC 792; the
/// list RFC 5508 section 7 uses for NAT): Destination Unreachable, Source
/// Quench, Redirect, Time Exceeded and Parameter Problem.
#[inline]
pub fn is_error(msg_type: u8) -> bool {
    matches!(
        msg_type,
        MsgType::DEST_UNREACHABLE
            | MsgType::SOURCE_QUENCH
            | MsgType::REDIRECT
            | MsgType::TIME_EXCEEDED
            | MsgType::PARAM_PROBLEM
    )
}

/// A read/write view of an ICMPv4 message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const TYPE: usize = 0;
    pub const CODE: usize = 1;
    pub const CHECKSUM: usize = 2;
    pub const ECHO_IDENT: usize = 4;
    pub const ECHO_SEQ: usize = 6;
    pub const NEXT_HOP_MTU: usize = 6;
    pub const BODY: usize = 8;
}

/// Length of the ICMP header (type, code, checksum and the 4-byte rest).
pub const HEADER_LEN: usize = field::BODY;
/// Offset of the checksum field.
pub const CHECKSUM_OFFSET: usize = field::CHECKSUM;
/// Offset of the echo identifier.
pub const ECHO_IDENT_OFFSET: usize = field::ECHO_IDENT;

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

    /// Ensures no accessor can panic: the 8-byte header is there.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(Layer::Icmpv4, HEADER_LEN, have));
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Message type (see [`MsgType`]).
    #[inline]
    pub fn msg_type(&self) -> u8 {
        self.buffer.as_ref()[field::TYPE]
    }

    /// Code.
    #[inline]
    pub fn code(&self) -> u8 {
        self.buffer.as_ref()[field::CODE]
    }

    /// Checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// Echo identifier (bytes 4..6; meaningful for echo request/reply).
    #[inline]
    pub fn echo_ident(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::ECHO_IDENT)
    }

    /// Echo sequence number (bytes 6..8; meaningful for echo request/reply).
    #[inline]
    pub fn echo_seq(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::ECHO_SEQ)
    }

    /// The next-hop MTU of a Destination Unreachable / fragmentation needed
    /// message (RFC 1191 4); `None` for any other type or code. May be 0
    /// from a router older than RFC 1191.
    #[inline]
    pub fn next_hop_mtu(&self) -> Option<u16> {
        (self.msg_type() == MsgType::DEST_UNREACHABLE && self.code() == CODE_FRAG_NEEDED)
            .then(|| read_u16(self.buffer.as_ref(), field::NEXT_HOP_MTU))
    }

    /// The bytes after the 8-byte header: for an error message, the invoking
    /// datagram's IP header and at least 8 bytes of its payload (RFC 792;
    /// RFC 1812 4.3.2.3 lets routers send more). It may be cut anywhere:
    /// parse it with care (its IP total length will exceed it).
    #[inline]
    pub fn embedded(&self) -> &[u8] {
        &self.buffer.as_ref()[field::BODY..]
    }

    /// The bytes after the 8-byte header (echo data, or the embedded datagram).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        self.embedded()
    }

    /// The checksum verifies over the whole message.
    #[inline]
    pub fn verify_checksum(&self) -> bool {
        checksum::fold(checksum::sum(self.buffer.as_ref(), 0)) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the message type.
    #[inline]
    pub fn set_msg_type(&mut self, value: u8) {
        self.buffer.as_mut()[field::TYPE] = value;
    }

    /// Sets the code.
    #[inline]
    pub fn set_code(&mut self, value: u8) {
        self.buffer.as_mut()[field::CODE] = value;
    }

    /// Sets the checksum field.
    #[inline]
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM, value);
    }

    /// Sets the echo identifier (the checksum is not updated).
    #[inline]
    pub fn set_echo_ident(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::ECHO_IDENT, value);
    }

    /// Sets the echo sequence number (the checksum is not updated).
    #[inline]
    pub fn set_echo_seq(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::ECHO_SEQ, value);
    }

    /// Computes the checksum over the whole message and writes it.
    #[inline]
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let c = checksum::finish(checksum::sum(self.buffer.as_ref(), 0));
        self.set_checksum(c);
    }

    /// The embedded datagram, mutable.
    #[inline]
    pub fn embedded_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::BODY..]
    }

    /// The bytes after the 8-byte header, mutable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        self.embedded_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex};
    use crate::wire::{ipv4, udp, Error, IpProtocol};
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> usize {
        usize::from(p.msg_type())
            + usize::from(p.code())
            + usize::from(p.checksum())
            + usize::from(p.echo_ident())
            + usize::from(p.echo_seq())
            + usize::from(p.next_hop_mtu().unwrap_or(0))
            + p.embedded().len()
            + p.payload().len()
            + usize::from(p.verify_checksum())
    }

    #[test]
    fn captured_echo_request() {
        let f = hex(testdata::ICMP_ECHO_REQUEST);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!((p.msg_type(), p.code()), (MsgType::ECHO_REQUEST, 0));
        assert_eq!((p.echo_ident(), p.echo_seq()), (7160, 1));
        assert_eq!(p.checksum(), 0xaef2);
        assert!(p.verify_checksum());
        assert_eq!(p.next_hop_mtu(), None);
        assert_eq!(p.payload().len(), 56);
        assert!(!is_error(p.msg_type()));
    }

    #[test]
    fn captured_frag_needed_with_embedded_header() {
        let f = hex(testdata::ICMP_FRAG_NEEDED);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        assert_eq!(ip.src_addr(), Ipv4Addr::new(192, 0, 2, 254));
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!((p.msg_type(), p.code()), (MsgType::DEST_UNREACHABLE, CODE_FRAG_NEEDED));
        assert!(is_error(p.msg_type()));
        assert_eq!(p.next_hop_mtu(), Some(1280));
        assert!(p.verify_checksum());
        // Linux quotes as much as fits in 576 bytes: the embedded datagram is
        // cut, so its total length exceeds what is there.
        let inner = p.embedded();
        assert_eq!(inner.len(), 576 - 20 - 8);
        assert_eq!(
            ipv4::Packet::new_checked(inner),
            Err(Error::Truncated { layer: Layer::Ipv4, need: 1428, have: 548 })
        );
        let inner_ip = ipv4::Packet::new_unchecked(inner);
        assert_eq!(inner_ip.header_len(), 20);
        assert_eq!(inner_ip.src_addr(), Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(inner_ip.dst_addr(), Ipv4Addr::new(198, 51, 100, 2));
        assert!(inner_ip.dont_frag());
        let inner_icmp = Packet::new_checked(&inner[20..]).unwrap();
        assert_eq!((inner_icmp.msg_type(), inner_icmp.echo_ident()), (8, 7165));
    }

    #[test]
    fn captured_port_unreachable_and_time_exceeded() {
        let f = hex(testdata::ICMP_PORT_UNREACHABLE);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!((p.msg_type(), p.code()), (3, 3));
        assert_eq!(p.next_hop_mtu(), None);
        let inner = ipv4::Packet::new_checked(p.embedded()).unwrap();
        assert_eq!(inner.protocol(), IpProtocol::UDP);
        let inner_udp = udp::Packet::new_checked(inner.payload()).unwrap();
        assert_eq!((inner_udp.src_port(), inner_udp.dst_port()), (47745, 33434));

        let f = hex(testdata::ICMP_TIME_EXCEEDED);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!(p.msg_type(), MsgType::TIME_EXCEEDED);
        assert!(is_error(p.msg_type()));
        let inner = ipv4::Packet::new_checked(p.embedded()).unwrap();
        assert_eq!(inner.ttl(), 1);
    }

    #[test]
    fn rewrite_embedded_header_and_fix_checksums() {
        // What the engine does to an ICMP error for a translated flow: rewrite
        // the embedded source and port, then fix the inner IP checksum and the
        // ICMP checksum (full recompute vs incremental must agree).
        let f = hex(testdata::ICMP_PORT_UNREACHABLE);
        let mut ip_bytes = f[14..].to_vec();
        let mut ip = ipv4::Packet::new_checked(&mut ip_bytes[..]).unwrap();
        let mut icmp = Packet::new_checked(ip.payload_mut()).unwrap();
        let old_csum = icmp.checksum();
        let old_body = icmp.embedded().to_vec();
        {
            let mut inner = ipv4::Packet::new_checked(icmp.embedded_mut()).unwrap();
            inner.set_src_addr(Ipv4Addr::new(10, 0, 0, 5));
            inner.fill_checksum();
            let mut u = udp::Packet::new_checked(inner.payload_mut()).unwrap();
            u.set_src_port(5555);
        }
        let incremental = checksum::update(old_csum, &old_body, icmp.embedded());
        icmp.fill_checksum();
        assert_eq!(incremental, icmp.checksum());
        assert!(icmp.verify_checksum());
    }

    #[test]
    fn every_prefix_and_setters() {
        let f = hex(testdata::ICMP_ECHO_REQUEST);
        let msg = &f[34..];
        for len in 0..=msg.len() {
            match Packet::new_checked(&msg[..len]) {
                Ok(p) => {
                    assert!(len >= 8);
                    assert_eq!(p.embedded().len(), len - 8);
                    exercise(&p);
                }
                Err(e) => {
                    assert!(len < 8);
                    assert_eq!(e, Error::Truncated { layer: Layer::Icmpv4, need: 8, have: len });
                }
            }
        }
        let mut m = msg.to_vec();
        let mut p = Packet::new_checked(&mut m[..]).unwrap();
        p.set_msg_type(MsgType::ECHO_REPLY);
        p.set_code(0);
        p.set_echo_ident(0x4242);
        p.set_echo_seq(9);
        p.payload_mut()[0] = 0xaa;
        p.fill_checksum();
        assert!(p.verify_checksum());
        assert_eq!(&m[..8], &[0, 0, m[2], m[3], 0x42, 0x42, 0, 9]);
        assert_eq!(m[8], 0xaa);
        let h = etherparse::Icmpv4Slice::from_slice(&m).unwrap();
        assert_eq!(h.icmp_type().calc_checksum(h.payload()), u16::from_be_bytes([m[2], m[3]]));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
        }

        #[test]
        fn echo_ident_rewrite_incremental(ident in any::<u16>(), new_ident in any::<u16>(),
                                          data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let mut m = vec![8, 0, 0, 0, 0, 0, 0, 1];
            m.extend_from_slice(&data);
            let mut p = Packet::new_checked(&mut m[..]).unwrap();
            p.set_echo_ident(ident);
            p.fill_checksum();
            let c = checksum::Delta::between_u16(ident, new_ident).apply(p.checksum());
            p.set_echo_ident(new_ident);
            p.fill_checksum();
            prop_assert_eq!(c, p.checksum());
        }
    }
}
