//! UDP headers (RFC 768).
//!
//! The buffer is the IP payload. `check_len` validates the length field
//! (8 ..= buffer length); `payload()` ends at it. Over IPv4 a checksum field
//! of 0 means "no checksum" and a computed 0 is sent as 0xFFFF (RFC 768);
//! over IPv6 the checksum is mandatory (RFC 8200 8.1).

use super::checksum;
use super::{read_u16, truncated, write_u16, Error, Layer, Result};

/// A read/write view of a UDP datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const SRC_PORT: usize = 0;
    pub const DST_PORT: usize = 2;
    pub const LENGTH: usize = 4;
    pub const CHECKSUM: usize = 6;
    pub const PAYLOAD: usize = 8;
}

/// Length of the UDP header.
pub const HEADER_LEN: usize = field::PAYLOAD;
/// Offset of the checksum field.
pub const CHECKSUM_OFFSET: usize = field::CHECKSUM;

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

    /// Ensures no accessor can panic: 8 bytes, and a length field between 8
    /// and the buffer length.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(Layer::Udp, HEADER_LEN, have));
        }
        let length = self.length();
        if usize::from(length) < HEADER_LEN || usize::from(length) > have {
            return Err(Error::BadUdpLength { length, available: have });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Source port.
    #[inline]
    pub fn src_port(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::SRC_PORT)
    }

    /// Destination port.
    #[inline]
    pub fn dst_port(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::DST_PORT)
    }

    /// Length field: header plus data.
    #[inline]
    pub fn length(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::LENGTH)
    }

    /// Checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// The data, up to the length field.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PAYLOAD..usize::from(self.length())]
    }

    /// The checksum verifies over the datagram (up to the length field)
    /// with the given pseudo-header sum. A zero field is not special-cased:
    /// over IPv4 test `checksum() == 0` ("no checksum") first.
    #[inline]
    pub fn verify_checksum(&self, pseudo_sum: u32) -> bool {
        let datagram = &self.buffer.as_ref()[..usize::from(self.length())];
        checksum::fold(checksum::sum(datagram, pseudo_sum)) == 0xffff
    }

    /// The checksum field holds only the pseudo-header sum (TX offload not
    /// completed); see [`checksum::is_partial`].
    #[inline]
    pub fn is_checksum_partial(&self, pseudo_sum: u32) -> bool {
        checksum::is_partial(self.checksum(), pseudo_sum)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Sets the source port (the checksum is not updated).
    #[inline]
    pub fn set_src_port(&mut self, port: u16) {
        write_u16(self.buffer.as_mut(), field::SRC_PORT, port);
    }

    /// Sets the destination port (the checksum is not updated).
    #[inline]
    pub fn set_dst_port(&mut self, port: u16) {
        write_u16(self.buffer.as_mut(), field::DST_PORT, port);
    }

    /// Sets the length field. Invalidates `check_len`: the caller makes sure
    /// it is between 8 and the buffer length.
    #[inline]
    pub fn set_length(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::LENGTH, value);
    }

    /// Sets the checksum field.
    #[inline]
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM, value);
    }

    /// Computes the checksum with the given pseudo-header sum and writes it;
    /// a computed 0 is written as 0xFFFF (RFC 768).
    #[inline]
    pub fn fill_checksum(&mut self, pseudo_sum: u32) {
        self.set_checksum(0);
        let len = usize::from(self.length());
        let c = checksum::finish(checksum::sum(&self.buffer.as_ref()[..len], pseudo_sum));
        self.set_checksum(if c == 0 { 0xffff } else { c });
    }

    /// The data, up to the length field, mutable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let len = usize::from(self.length());
        &mut self.buffer.as_mut()[field::PAYLOAD..len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex};
    use crate::wire::{ipv4, ipv6};
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> usize {
        usize::from(p.src_port())
            + usize::from(p.dst_port())
            + usize::from(p.length())
            + usize::from(p.checksum())
            + p.payload().len()
            + usize::from(p.verify_checksum(0))
            + usize::from(p.is_checksum_partial(0))
    }

    #[test]
    fn captured_v4_and_v6() {
        let f = hex(testdata::UDP4);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!((p.src_port(), p.dst_port(), p.length()), (47745, 33434, 17));
        assert_eq!(p.checksum(), 0xa519);
        assert_eq!(p.payload(), b"egret-udp");
        assert!(p.verify_checksum(ip.pseudo_header_sum()));

        let f = hex(testdata::UDP6);
        let ip = ipv6::Packet::new_checked(&f[14..]).unwrap();
        let upper = ipv6::walk_extensions(&ip).unwrap();
        let p = Packet::new_checked(ip.upper_layer(upper.l4_offset)).unwrap();
        assert_eq!((p.src_port(), p.dst_port(), p.length()), (53046, 33434, 18));
        assert_eq!(p.payload(), b"egret-udp6");
        assert!(p.verify_checksum(ip.pseudo_header_sum(&upper)));
    }

    #[test]
    fn captured_partial_v6() {
        let f = hex(testdata::UDP6_PARTIAL);
        let mut ip_bytes = f[14..].to_vec();
        let mut ip = ipv6::Packet::new_checked(&mut ip_bytes[..]).unwrap();
        let upper = ipv6::walk_extensions(&ip).unwrap();
        let pseudo = ip.pseudo_header_sum(&upper);
        let mut p = Packet::new_checked(ip.upper_layer_mut(upper.l4_offset)).unwrap();
        assert_eq!(p.checksum(), 0x5c25);
        assert!(p.is_checksum_partial(pseudo));
        p.fill_checksum(pseudo);
        assert_eq!(p.checksum(), 0xd29f, "the value tcpdump expects");
    }

    #[test]
    fn length_field_is_validated_and_bounds_the_payload() {
        let f = hex(testdata::UDP4);
        let mut d = f[34..].to_vec();
        d.extend_from_slice(&[0xee; 4]); // trailing bytes beyond the UDP length
        let p = Packet::new_checked(&d[..]).unwrap();
        assert_eq!(p.payload(), b"egret-udp");
        d[4..6].copy_from_slice(&7u16.to_be_bytes());
        assert_eq!(Packet::new_checked(&d[..]), Err(Error::BadUdpLength { length: 7, available: 21 }));
        d[4..6].copy_from_slice(&22u16.to_be_bytes());
        assert_eq!(Packet::new_checked(&d[..]), Err(Error::BadUdpLength { length: 22, available: 21 }));
    }

    #[test]
    fn every_prefix() {
        let f = hex(testdata::UDP4);
        let d = &f[34..];
        for len in 0..=d.len() {
            match Packet::new_checked(&d[..len]) {
                Ok(p) => {
                    assert_eq!(len, 17);
                    exercise(&p);
                }
                Err(Error::Truncated { need: 8, have, .. }) => assert_eq!(have, len),
                Err(Error::BadUdpLength { length: 17, available }) => assert_eq!(available, len),
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn fill_maps_zero_to_ffff() {
        // Find a payload word that makes the computed checksum 0.
        let (src, dst) = (Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(198, 51, 100, 2));
        let mut d = vec![0x30, 0x39, 0x00, 0x35, 0x00, 0x0a, 0x00, 0x00, 0x00, 0x00];
        let pseudo = checksum::pseudo_header_v4(src, dst, 17, 10);
        let s = checksum::fold(checksum::sum(&d, pseudo));
        d[8..10].copy_from_slice(&(0xffff - s).to_be_bytes());
        let mut p = Packet::new_checked(&mut d[..]).unwrap();
        p.fill_checksum(pseudo);
        assert_eq!(p.checksum(), 0xffff);
        assert!(p.verify_checksum(pseudo));
        // And the incremental path agrees: from a port change that lands on 0.
        let d2 = checksum::Delta::between_u16(12345, 12346);
        let before = d2.negate().apply(0xffff);
        assert_eq!(checksum::apply_udp(before, d2), 0xffff);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
        }

        #[test]
        fn nat_rewrite_incremental_equals_full_udp(
            src in any::<u32>(), dst in any::<u32>(), new_dst in any::<u32>(),
            dport in any::<u16>(), new_dport in any::<u16>(),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let (src, dst, new_dst) = (Ipv4Addr::from(src), Ipv4Addr::from(dst), Ipv4Addr::from(new_dst));
            let mut d = vec![0x30, 0x39, 0, 0, 0, 0, 0, 0];
            d.extend_from_slice(&payload);
            let len = d.len() as u16;
            let mut p = Packet::new_unchecked(&mut d[..]);
            p.set_length(len);
            p.set_dst_port(dport);
            p.fill_checksum(checksum::pseudo_header_v4(src, dst, 17, u32::from(len)));
            let before = p.checksum();
            let delta = checksum::Delta::between_ipv4(dst, new_dst)
                .add(checksum::Delta::between_u16(dport, new_dport));
            p.set_dst_port(new_dport);
            let incremental = checksum::apply_udp(before, delta);
            p.fill_checksum(checksum::pseudo_header_v4(src, new_dst, 17, u32::from(len)));
            prop_assert_eq!(incremental, p.checksum());
            let (h, pl) = etherparse::UdpHeader::from_slice(&d).unwrap();
            prop_assert_eq!(h.calc_checksum_ipv4_raw(src.octets(), new_dst.octets(), pl).unwrap(), incremental);
            // A datagram sent without checksum keeps none.
            prop_assert_eq!(checksum::apply_udp(0, delta), 0);
        }
    }
}
