//! ICMP for IPv6 (RFC 4443): the 8-byte header, echo identifier and
//! sequence, the MTU of Packet Too Big, the invoking packet that error
//! messages embed, and in [`ndp`] the Neighbor Solicitation / Advertisement
//! messages of RFC 4861.
//!
//! The buffer is the upper-layer part of the IPv6 datagram (from
//! [`ipv6::Packet::upper_layer`](super::ipv6::Packet::upper_layer)); the
//! checksum covers it and the IPv6 pseudo-header (RFC 4443 2.3).

use std::net::Ipv6Addr;

use super::checksum;
use super::{read_u16, read_u32, truncated, write_u16, IpProtocol, Layer, Result};

/// ICMPv6 message types. A namespace for `u8` constants.
#[derive(Debug)]
pub enum MsgType {}

impl MsgType {
    /// Destination Unreachable (RFC 4443 3.1).
    pub const DEST_UNREACHABLE: u8 = 1;
    /// Packet Too Big (RFC 4443 3.2).
    pub const PACKET_TOO_BIG: u8 = 2;
    /// Time Exceeded (RFC 4443 3.3).
    pub const TIME_EXCEEDED: u8 = 3;
    /// Parameter Problem (RFC 4443 3.4).
    pub const PARAM_PROBLEM: u8 = 4;
    /// Echo Request (RFC 4443 4.1).
    pub const ECHO_REQUEST: u8 = 128;
    /// Echo Reply (RFC 4443 4.2).
    pub const ECHO_REPLY: u8 = 129;
    /// Router Solicitation (RFC 4861 4.1).
    pub const ROUTER_SOLICIT: u8 = 133;
    /// Router Advertisement (RFC 4861 4.2).
    pub const ROUTER_ADVERT: u8 = 134;
    /// Neighbor Solicitation (RFC 4861 4.3).
    pub const NEIGHBOR_SOLICIT: u8 = 135;
    /// Neighbor Advertisement (RFC 4861 4.4).
    pub const NEIGHBOR_ADVERT: u8 = 136;
    /// Redirect (RFC 4861 4.5).
    pub const REDIRECT: u8 = 137;
}

/// True for error messages: types 0..=127 (RFC 4443 2.1). They embed as much
/// of the invoking packet as fits in the minimum MTU.
#[inline]
pub fn is_error(msg_type: u8) -> bool {
    msg_type < 128
}

/// A read/write view of an ICMPv6 message.
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
    pub const MTU: usize = 4;
    pub const POINTER: usize = 4;
    pub const BODY: usize = 8;
}

/// Length of the ICMPv6 header (type, code, checksum and the 4-byte rest).
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
            return Err(truncated(Layer::Icmpv6, HEADER_LEN, have));
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

    /// The MTU of a Packet Too Big message (RFC 4443 3.2); `None` for any
    /// other type.
    #[inline]
    pub fn mtu(&self) -> Option<u32> {
        (self.msg_type() == MsgType::PACKET_TOO_BIG).then(|| read_u32(self.buffer.as_ref(), field::MTU))
    }

    /// The pointer of a Parameter Problem message (RFC 4443 3.4): the offset
    /// in the invoking packet where the problem is; `None` for other types.
    #[inline]
    pub fn pointer(&self) -> Option<u32> {
        (self.msg_type() == MsgType::PARAM_PROBLEM).then(|| read_u32(self.buffer.as_ref(), field::POINTER))
    }

    /// The bytes after the 8-byte header: for an error message, as much of
    /// the invoking packet as fits in 1280 bytes (RFC 4443 2.4 (c)). It may
    /// be cut anywhere: its IPv6 payload length will exceed it.
    #[inline]
    pub fn embedded(&self) -> &[u8] {
        &self.buffer.as_ref()[field::BODY..]
    }

    /// The bytes after the 8-byte header.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        self.embedded()
    }

    /// The checksum verifies with the pseudo-header of `src` and `dst`.
    #[inline]
    pub fn verify_checksum(&self, src: &Ipv6Addr, dst: &Ipv6Addr) -> bool {
        let data = self.buffer.as_ref();
        let pseudo = checksum::pseudo_header_v6(src, dst, IpProtocol::ICMPV6, data.len() as u32);
        checksum::fold(checksum::sum(data, pseudo)) == 0xffff
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

    /// Computes the checksum with the pseudo-header of `src` and `dst` and
    /// writes it.
    #[inline]
    pub fn fill_checksum(&mut self, src: &Ipv6Addr, dst: &Ipv6Addr) {
        self.set_checksum(0);
        let data = self.buffer.as_ref();
        let pseudo = checksum::pseudo_header_v6(src, dst, IpProtocol::ICMPV6, data.len() as u32);
        let c = checksum::finish(checksum::sum(data, pseudo));
        self.set_checksum(c);
    }

    /// The embedded packet, mutable.
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

/// Neighbor Solicitation and Advertisement (RFC 4861 4.3, 4.4) and their
/// options (RFC 4861 4.6).
pub mod ndp {
    use std::net::Ipv6Addr;

    use super::super::{read_array, truncated, write_u32, Error, EthernetAddress, Layer, Result};
    use super::field as icmp_field;
    use super::read_u16;

    /// NA flag: the sender is a router.
    pub const FLAG_ROUTER: u8 = 0x80;
    /// NA flag: sent in response to a Neighbor Solicitation.
    pub const FLAG_SOLICITED: u8 = 0x40;
    /// NA flag: override an existing cache entry.
    pub const FLAG_OVERRIDE: u8 = 0x20;

    /// Option type: Source Link-Layer Address.
    pub const OPT_SOURCE_LL_ADDR: u8 = 1;
    /// Option type: Target Link-Layer Address.
    pub const OPT_TARGET_LL_ADDR: u8 = 2;

    /// A read/write view of a Neighbor Solicitation or Advertisement: both
    /// are type, code, checksum, 4 bytes (NA flags / reserved), a target
    /// address, then options.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Packet<T: AsRef<[u8]>> {
        buffer: T,
    }

    mod field {
        pub const FLAGS: usize = 4;
        pub const TARGET: usize = 8;
        pub const OPTIONS: usize = 24;
    }

    /// Length of an NS/NA without options.
    pub const HEADER_LEN: usize = field::OPTIONS;
    /// Length of a link-layer address option for Ethernet (RFC 4861 4.6.1).
    pub const LL_ADDR_OPTION_LEN: usize = 8;

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

        /// Ensures no accessor can panic: the 24 bytes before the options
        /// are there. (Options are checked as they are iterated.)
        pub fn check_len(&self) -> Result<()> {
            let have = self.buffer.as_ref().len();
            if have < HEADER_LEN {
                return Err(truncated(Layer::Ndp, HEADER_LEN, have));
            }
            Ok(())
        }

        /// The wrapped buffer.
        pub fn into_inner(self) -> T {
            self.buffer
        }

        /// ICMPv6 type (135 or 136 for the messages this view is for).
        #[inline]
        pub fn msg_type(&self) -> u8 {
            self.buffer.as_ref()[icmp_field::TYPE]
        }

        /// ICMPv6 code (0 in a valid message).
        #[inline]
        pub fn code(&self) -> u8 {
            self.buffer.as_ref()[icmp_field::CODE]
        }

        /// Checksum field.
        #[inline]
        pub fn checksum(&self) -> u16 {
            read_u16(self.buffer.as_ref(), icmp_field::CHECKSUM)
        }

        /// The NA flag bits (first byte after the checksum; 0 in an NS).
        #[inline]
        pub fn flags(&self) -> u8 {
            self.buffer.as_ref()[field::FLAGS]
        }

        /// NA Router flag.
        #[inline]
        pub fn router_flag(&self) -> bool {
            self.flags() & FLAG_ROUTER != 0
        }

        /// NA Solicited flag.
        #[inline]
        pub fn solicited_flag(&self) -> bool {
            self.flags() & FLAG_SOLICITED != 0
        }

        /// NA Override flag.
        #[inline]
        pub fn override_flag(&self) -> bool {
            self.flags() & FLAG_OVERRIDE != 0
        }

        /// Target address.
        #[inline]
        pub fn target_addr(&self) -> Ipv6Addr {
            Ipv6Addr::from(read_array::<16>(self.buffer.as_ref(), field::TARGET))
        }

        /// The options, as (type, body) pairs; see [`Options`].
        #[inline]
        pub fn options(&self) -> Options<'_> {
            Options { data: &self.buffer.as_ref()[field::OPTIONS..], offset: 0, failed: false }
        }

        /// The first Source Link-Layer Address option, if any. Fails if any
        /// option before it (or it) is malformed.
        pub fn source_link_addr(&self) -> Result<Option<EthernetAddress>> {
            self.first_link_addr(OPT_SOURCE_LL_ADDR)
        }

        /// The first Target Link-Layer Address option, if any.
        pub fn target_link_addr(&self) -> Result<Option<EthernetAddress>> {
            self.first_link_addr(OPT_TARGET_LL_ADDR)
        }

        fn first_link_addr(&self, option_type: u8) -> Result<Option<EthernetAddress>> {
            for option in self.options() {
                let option = option?;
                if option.option_type == option_type {
                    return Ok(option.link_layer_addr());
                }
            }
            Ok(None)
        }
    }

    impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
        /// Writes the NA flags and zeroes the reserved bits after them.
        #[inline]
        pub fn set_flags(&mut self, flags: u8) {
            write_u32(self.buffer.as_mut(), field::FLAGS, u32::from(flags) << 24);
        }

        /// Sets the target address.
        #[inline]
        pub fn set_target_addr(&mut self, addr: &Ipv6Addr) {
            self.buffer.as_mut()[field::TARGET..field::TARGET + 16].copy_from_slice(&addr.octets());
        }

        /// The options bytes, mutable.
        #[inline]
        pub fn options_mut(&mut self) -> &mut [u8] {
            &mut self.buffer.as_mut()[field::OPTIONS..]
        }
    }

    /// Writes a link-layer address option for Ethernet (type, length 1 =
    /// 8 bytes, MAC) at the start of `buf`.
    pub fn write_link_addr_option(buf: &mut [u8], option_type: u8, mac: EthernetAddress) -> Result<usize> {
        let Some(out) = buf.get_mut(..LL_ADDR_OPTION_LEN) else {
            return Err(Error::BufferTooSmall { need: LL_ADDR_OPTION_LEN, have: buf.len() });
        };
        out[0] = option_type;
        out[1] = 1;
        out[2..8].copy_from_slice(&mac.0);
        Ok(LL_ADDR_OPTION_LEN)
    }

    /// One NDP option.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct NdpOption<'a> {
        /// Option type.
        pub option_type: u8,
        /// The option's bytes after the type and length bytes.
        pub body: &'a [u8],
    }

    impl NdpOption<'_> {
        /// The MAC of a source/target link-layer address option (the first
        /// six bytes of the body); `None` for other types.
        pub fn link_layer_addr(&self) -> Option<EthernetAddress> {
            if self.option_type != OPT_SOURCE_LL_ADDR && self.option_type != OPT_TARGET_LL_ADDR {
                return None;
            }
            let mac = self.body.get(..6)?;
            let mut out = [0u8; 6];
            out.copy_from_slice(mac);
            Some(EthernetAddress(out))
        }
    }

    /// Iterator over NDP options: yields `Ok(NdpOption)` for each, and stops
    /// after yielding one error: an option of length 0 (RFC 4861 4.6: "nodes
    /// MUST silently discard an ND packet that contains an option with
    /// length zero") or one that runs past the message.
    #[derive(Debug, Clone)]
    pub struct Options<'a> {
        data: &'a [u8],
        offset: usize,
        failed: bool,
    }

    impl<'a> Iterator for Options<'a> {
        type Item = Result<NdpOption<'a>>;

        fn next(&mut self) -> Option<Self::Item> {
            if self.failed || self.offset >= self.data.len() {
                return None;
            }
            let rest = &self.data[self.offset..];
            let at = HEADER_LEN + self.offset;
            if rest.len() < 2 {
                self.failed = true;
                return Some(Err(truncated(Layer::Ndp, at + 2, at + rest.len())));
            }
            let (option_type, units) = (rest[0], usize::from(rest[1]));
            if units == 0 {
                self.failed = true;
                return Some(Err(Error::NdpOptionZeroLength { option_type, offset: at }));
            }
            let len = units * 8;
            let Some(option) = rest.get(..len) else {
                self.failed = true;
                return Some(Err(truncated(Layer::Ndp, at + len, at + rest.len())));
            };
            self.offset += len;
            Some(Ok(NdpOption { option_type, body: &option[2..] }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ndp;
    use super::*;
    use crate::wire::testdata::{self, hex};
    use crate::wire::{ipv6, udp, Error, EthernetAddress};
    use proptest::prelude::*;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> usize {
        let a = Ipv6Addr::LOCALHOST;
        usize::from(p.msg_type())
            + usize::from(p.code())
            + usize::from(p.checksum())
            + usize::from(p.echo_ident())
            + usize::from(p.echo_seq())
            + p.mtu().unwrap_or(0) as usize
            + p.pointer().unwrap_or(0) as usize
            + p.embedded().len()
            + p.payload().len()
            + usize::from(p.verify_checksum(&a, &a))
    }

    fn exercise_ndp<T: AsRef<[u8]>>(p: &ndp::Packet<T>) -> usize {
        let mut n = usize::from(p.msg_type())
            + usize::from(p.code())
            + usize::from(p.checksum())
            + usize::from(p.flags())
            + usize::from(p.router_flag())
            + usize::from(p.solicited_flag())
            + usize::from(p.override_flag())
            + usize::from(p.target_addr().octets()[15]);
        for o in p.options() {
            match o {
                Ok(o) => {
                    n += usize::from(o.option_type)
                        + o.body.len()
                        + o.link_layer_addr().map_or(0, |m| usize::from(m.0[5]))
                }
                Err(_) => n += 1,
            }
        }
        n += p.source_link_addr().map_or(0, |m| m.map_or(1, |m| usize::from(m.0[0])));
        n + p.target_link_addr().map_or(0, |m| m.map_or(1, |m| usize::from(m.0[0])))
    }

    fn icmp_of(frame: &[u8]) -> (Vec<u8>, Ipv6Addr, Ipv6Addr) {
        let ip = ipv6::Packet::new_checked(&frame[14..]).unwrap();
        let upper = ipv6::walk_extensions(&ip).unwrap();
        assert_eq!(upper.protocol, IpProtocol::ICMPV6);
        (ip.upper_layer(upper.l4_offset).to_vec(), ip.src_addr(), ip.dst_addr())
    }

    #[test]
    fn captured_echo_request() {
        let (m, src, dst) = icmp_of(&hex(testdata::ICMPV6_ECHO_REQUEST));
        let p = Packet::new_checked(&m[..]).unwrap();
        assert_eq!((p.msg_type(), p.code()), (MsgType::ECHO_REQUEST, 0));
        assert_eq!((p.echo_ident(), p.echo_seq()), (7161, 1));
        assert!(p.verify_checksum(&src, &dst));
        let other: Ipv6Addr = "2001:db8:a::2".parse().unwrap();
        assert!(!p.verify_checksum(&other, &dst));
        assert!(!is_error(p.msg_type()));
        assert_eq!(p.mtu(), None);
    }

    #[test]
    fn captured_packet_too_big() {
        let (m, src, dst) = icmp_of(&hex(testdata::ICMPV6_PACKET_TOO_BIG));
        let p = Packet::new_checked(&m[..]).unwrap();
        assert_eq!(p.msg_type(), MsgType::PACKET_TOO_BIG);
        assert!(is_error(p.msg_type()));
        assert_eq!(p.mtu(), Some(1280));
        assert!(p.verify_checksum(&src, &dst));
        // The embedded packet is the first fragment, cut to fit 1280 bytes.
        let inner = p.embedded();
        assert_eq!(inner.len(), 1280 - 40 - 8);
        let inner_ip = ipv6::Packet::new_unchecked(inner);
        assert_eq!(ipv6::Packet::new_checked(inner).unwrap_err().reason(), "ipv6_truncated");
        assert_eq!(inner_ip.src_addr(), "2001:db8:a::1".parse::<Ipv6Addr>().unwrap());
        assert_eq!(inner_ip.dst_addr(), "2001:db8:b::2".parse::<Ipv6Addr>().unwrap());
        assert_eq!(inner_ip.next_header(), IpProtocol::IPV6_FRAGMENT);
    }

    #[test]
    fn captured_port_unreachable() {
        let (m, src, dst) = icmp_of(&hex(testdata::ICMPV6_PORT_UNREACHABLE));
        let p = Packet::new_checked(&m[..]).unwrap();
        assert_eq!((p.msg_type(), p.code()), (MsgType::DEST_UNREACHABLE, 4));
        assert!(p.verify_checksum(&src, &dst));
        let inner = ipv6::Packet::new_checked(p.embedded()).unwrap();
        let upper = ipv6::walk_extensions(&inner).unwrap();
        let u = udp::Packet::new_checked(inner.upper_layer(upper.l4_offset)).unwrap();
        assert_eq!((u.src_port(), u.dst_port()), (53046, 33434));
        assert_eq!(u.payload(), b"egret-udp6");
    }

    #[test]
    fn captured_neighbor_solicitation() {
        let (m, src, dst) = icmp_of(&hex(testdata::NS_GLOBAL));
        let p = Packet::new_checked(&m[..]).unwrap();
        assert_eq!(p.msg_type(), MsgType::NEIGHBOR_SOLICIT);
        assert!(p.verify_checksum(&src, &dst));
        let ns = ndp::Packet::new_checked(&m[..]).unwrap();
        assert_eq!(ns.target_addr(), "2001:db8:a::fe".parse::<Ipv6Addr>().unwrap());
        assert_eq!(ns.flags(), 0);
        let opts: Vec<_> = ns.options().collect();
        assert_eq!(opts, [Ok(ndp::NdpOption { option_type: 1, body: &[2, 0, 0, 0, 0x0a, 0x01][..] })]);
        assert_eq!(ns.source_link_addr(), Ok(Some(EthernetAddress([2, 0, 0, 0, 0x0a, 0x01]))));
        assert_eq!(ns.target_link_addr(), Ok(None));
    }

    #[test]
    fn captured_neighbor_advertisement() {
        let (m, src, dst) = icmp_of(&hex(testdata::NA_ROUTER_LINUX));
        let na = ndp::Packet::new_checked(&m[..]).unwrap();
        assert_eq!(na.msg_type(), MsgType::NEIGHBOR_ADVERT);
        assert!(na.router_flag() && na.solicited_flag() && na.override_flag());
        assert_eq!(na.target_link_addr(), Ok(Some(EthernetAddress([2, 0, 0, 0, 0x0a, 0xfe]))));
        assert!(Packet::new_checked(&m[..]).unwrap().verify_checksum(&src, &dst));
        let (m, _, _) = icmp_of(&hex(testdata::NA_LINUX));
        let na = ndp::Packet::new_checked(&m[..]).unwrap();
        assert_eq!(na.flags(), ndp::FLAG_SOLICITED | ndp::FLAG_OVERRIDE);
    }

    #[test]
    fn captured_dad_with_nonce_option() {
        let (m, src, _) = icmp_of(&hex(testdata::NS_DAD));
        assert!(src.is_unspecified());
        let ns = ndp::Packet::new_checked(&m[..]).unwrap();
        let opts: Vec<_> = ns.options().map(|o| o.unwrap().option_type).collect();
        assert_eq!(opts, [14], "RFC 7527 nonce");
        assert_eq!(ns.source_link_addr(), Ok(None));
    }

    #[test]
    fn malformed_options() {
        let (mut m, _, _) = icmp_of(&hex(testdata::NS_GLOBAL));
        m[25] = 0; // SLLAO length 0
        let ns = ndp::Packet::new_checked(&m[..]).unwrap();
        let all: Vec<_> = ns.options().collect();
        assert_eq!(all, [Err(Error::NdpOptionZeroLength { option_type: 1, offset: 24 })]);
        assert_eq!(ns.source_link_addr(), Err(Error::NdpOptionZeroLength { option_type: 1, offset: 24 }));
        m[25] = 2; // 16 bytes claimed, 8 there
        let ns = ndp::Packet::new_checked(&m[..]).unwrap();
        assert_eq!(ns.options().collect::<Vec<_>>(), [Err(Error::Truncated { layer: Layer::Ndp, need: 40, have: 32 })]);
        let mut odd = m[..24].to_vec();
        odd.push(1);
        let ns = ndp::Packet::new_checked(&odd[..]).unwrap();
        assert_eq!(ns.options().collect::<Vec<_>>(), [Err(Error::Truncated { layer: Layer::Ndp, need: 26, have: 25 })]);
    }

    #[test]
    fn every_prefix() {
        let (m, _, _) = icmp_of(&hex(testdata::NS_GLOBAL));
        for len in 0..=m.len() {
            match Packet::new_checked(&m[..len]) {
                Ok(p) => {
                    assert!(len >= 8);
                    exercise(&p);
                }
                Err(e) => assert_eq!(e, Error::Truncated { layer: Layer::Icmpv6, need: 8, have: len }),
            }
            match ndp::Packet::new_checked(&m[..len]) {
                Ok(p) => {
                    assert!(len >= 24);
                    exercise_ndp(&p);
                    let complete = p.options().all(|o| o.is_ok());
                    assert_eq!(complete, len == 24 || len == 32, "len {len}");
                }
                Err(e) => assert_eq!(e, Error::Truncated { layer: Layer::Ndp, need: 24, have: len }),
            }
        }
    }

    #[test]
    fn setters() {
        let mut m = vec![0u8; 32];
        let a: Ipv6Addr = "2001:db8:a::77".parse().unwrap();
        let b: Ipv6Addr = "fe80::ff:fe00:afe".parse().unwrap();
        {
            let mut p = Packet::new_checked(&mut m[..]).unwrap();
            p.set_msg_type(MsgType::NEIGHBOR_ADVERT);
            p.set_code(0);
        }
        {
            let mut na = ndp::Packet::new_checked(&mut m[..]).unwrap();
            na.set_flags(ndp::FLAG_SOLICITED | ndp::FLAG_OVERRIDE);
            na.set_target_addr(&a);
            ndp::write_link_addr_option(
                na.options_mut(),
                ndp::OPT_TARGET_LL_ADDR,
                EthernetAddress([2, 0, 0, 0, 0x0a, 0x01]),
            )
            .unwrap();
        }
        Packet::new_checked(&mut m[..]).unwrap().fill_checksum(&a, &b);
        // Byte for byte what Linux sent.
        let (linux, _, _) = icmp_of(&hex(testdata::NA_LINUX));
        assert_eq!(m, linux);
        assert_eq!(
            ndp::write_link_addr_option(&mut [0u8; 7], 1, EthernetAddress::ZERO),
            Err(Error::BufferTooSmall { need: 8, have: 7 })
        );
        let mut e = vec![128, 0, 0, 0, 0, 0, 0, 0, 1, 2];
        let mut p = Packet::new_checked(&mut e[..]).unwrap();
        p.set_echo_ident(0x1234);
        p.set_echo_seq(0x5678);
        p.payload_mut()[0] = 0xff;
        p.fill_checksum(&a, &b);
        assert!(p.verify_checksum(&a, &b));
        let s = etherparse::Icmpv6Slice::from_slice(&e).unwrap();
        assert!(s.is_checksum_valid(a.octets(), b.octets()));
        assert_eq!(&e[4..9], &[0x12, 0x34, 0x56, 0x78, 0xff]);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
            if let Ok(p) = ndp::Packet::new_checked(&bytes[..]) {
                exercise_ndp(&p);
            }
        }
    }
}
