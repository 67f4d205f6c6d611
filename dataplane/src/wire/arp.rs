//! ARP packets for Ethernet and IPv4 only (RFC 826): hardware type 1,
//! protocol type 0x0800, address lengths 6 and 4. Anything else is
//! [`Error::UnsupportedArpHardware`].

use std::net::Ipv4Addr;

use super::{read_array, read_u16, truncated, write_u16, Error, EthernetAddress, Layer, Result};

/// ARP operation codes (RFC 826). A namespace for `u16` constants.
#[derive(Debug)]
pub enum Operation {}

impl Operation {
    /// ares_op$REQUEST.
    pub const REQUEST: u16 = 1;
    /// ares_op$REPLY.
    pub const REPLY: u16 = 2;
}

/// Hardware type Ethernet.
pub const HTYPE_ETHERNET: u16 = 1;
/// Protocol type IPv4.
pub const PTYPE_IPV4: u16 = 0x0800;

/// A read/write view of an Ethernet/IPv4 ARP packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const HTYPE: usize = 0;
    pub const PTYPE: usize = 2;
    pub const HLEN: usize = 4;
    pub const PLEN: usize = 5;
    pub const OPER: usize = 6;
    pub const SHA: usize = 8;
    pub const SPA: usize = 14;
    pub const THA: usize = 18;
    pub const TPA: usize = 24;
    pub const END: usize = 28;
}

/// Length of an Ethernet/IPv4 ARP packet.
pub const PACKET_LEN: usize = field::END;

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

    /// Ensures no accessor can panic (the buffer holds 28 bytes; more, such
    /// as Ethernet padding, is ignored) and that this is Ethernet/IPv4 ARP.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < PACKET_LEN {
            return Err(truncated(Layer::Arp, PACKET_LEN, have));
        }
        let (htype, ptype) = (self.hardware_type(), self.protocol_type());
        let (hlen, plen) = (self.hardware_len(), self.protocol_len());
        if htype != HTYPE_ETHERNET || ptype != PTYPE_IPV4 || hlen != 6 || plen != 4 {
            return Err(Error::UnsupportedArpHardware { htype, ptype, hlen, plen });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Hardware type.
    #[inline]
    pub fn hardware_type(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::HTYPE)
    }

    /// Protocol type.
    #[inline]
    pub fn protocol_type(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::PTYPE)
    }

    /// Hardware address length.
    #[inline]
    pub fn hardware_len(&self) -> u8 {
        self.buffer.as_ref()[field::HLEN]
    }

    /// Protocol address length.
    #[inline]
    pub fn protocol_len(&self) -> u8 {
        self.buffer.as_ref()[field::PLEN]
    }

    /// Operation ([`Operation::REQUEST`], [`Operation::REPLY`], or other).
    #[inline]
    pub fn operation(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::OPER)
    }

    /// Sender hardware address.
    #[inline]
    pub fn sender_hardware_addr(&self) -> EthernetAddress {
        EthernetAddress(read_array(self.buffer.as_ref(), field::SHA))
    }

    /// Sender protocol address.
    #[inline]
    pub fn sender_protocol_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(read_array::<4>(self.buffer.as_ref(), field::SPA))
    }

    /// Target hardware address.
    #[inline]
    pub fn target_hardware_addr(&self) -> EthernetAddress {
        EthernetAddress(read_array(self.buffer.as_ref(), field::THA))
    }

    /// Target protocol address.
    #[inline]
    pub fn target_protocol_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(read_array::<4>(self.buffer.as_ref(), field::TPA))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    /// Writes htype 1, ptype 0x0800, hlen 6, plen 4.
    #[inline]
    pub fn set_ethernet_ipv4(&mut self) {
        let data = self.buffer.as_mut();
        write_u16(data, field::HTYPE, HTYPE_ETHERNET);
        write_u16(data, field::PTYPE, PTYPE_IPV4);
        data[field::HLEN] = 6;
        data[field::PLEN] = 4;
    }

    /// Sets the operation.
    #[inline]
    pub fn set_operation(&mut self, op: u16) {
        write_u16(self.buffer.as_mut(), field::OPER, op);
    }

    /// Sets the sender hardware address.
    #[inline]
    pub fn set_sender_hardware_addr(&mut self, addr: EthernetAddress) {
        self.buffer.as_mut()[field::SHA..field::SHA + 6].copy_from_slice(&addr.0);
    }

    /// Sets the sender protocol address.
    #[inline]
    pub fn set_sender_protocol_addr(&mut self, addr: Ipv4Addr) {
        self.buffer.as_mut()[field::SPA..field::SPA + 4].copy_from_slice(&addr.octets());
    }

    /// Sets the target hardware address.
    #[inline]
    pub fn set_target_hardware_addr(&mut self, addr: EthernetAddress) {
        self.buffer.as_mut()[field::THA..field::THA + 6].copy_from_slice(&addr.0);
    }

    /// Sets the target protocol address.
    #[inline]
    pub fn set_target_protocol_addr(&mut self, addr: Ipv4Addr) {
        self.buffer.as_mut()[field::TPA..field::TPA + 4].copy_from_slice(&addr.octets());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex};
    use proptest::prelude::*;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> u64 {
        u64::from(p.hardware_type())
            + u64::from(p.protocol_type())
            + u64::from(p.hardware_len())
            + u64::from(p.protocol_len())
            + u64::from(p.operation())
            + u64::from(p.sender_hardware_addr().0[5])
            + u64::from(p.sender_protocol_addr().to_bits())
            + u64::from(p.target_hardware_addr().0[5])
            + u64::from(p.target_protocol_addr().to_bits())
    }

    #[test]
    fn captured_request_and_reply() {
        let req = hex(testdata::ARP_REQUEST);
        let p = Packet::new_checked(&req[14..]).unwrap();
        assert_eq!(p.operation(), Operation::REQUEST);
        assert_eq!(p.sender_hardware_addr(), EthernetAddress([2, 0, 0, 0, 0x0a, 0x01]));
        assert_eq!(p.sender_protocol_addr(), Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(p.target_hardware_addr(), EthernetAddress::ZERO);
        assert_eq!(p.target_protocol_addr(), Ipv4Addr::new(192, 0, 2, 254));

        let rep = hex(testdata::ARP_REPLY_LINUX);
        let r = Packet::new_checked(&rep[14..]).unwrap();
        assert_eq!(r.operation(), Operation::REPLY);
        assert_eq!(r.sender_hardware_addr(), EthernetAddress([2, 0, 0, 0, 0x0a, 0xfe]));
        assert_eq!(r.sender_protocol_addr(), Ipv4Addr::new(192, 0, 2, 254));
        assert_eq!(r.target_protocol_addr(), Ipv4Addr::new(192, 0, 2, 1));

        // Padding after the 28 bytes is ignored.
        let padded = hex(testdata::ARP_REQUEST_PADDED);
        assert_eq!(padded.len(), 58);
        let pp = Packet::new_checked(&padded[14..]).unwrap();
        assert_eq!(pp.target_protocol_addr(), Ipv4Addr::new(192, 0, 2, 254));
    }

    #[test]
    fn setters_build_the_captured_reply() {
        let mut buf = [0u8; 28];
        let mut p = Packet::new_unchecked(&mut buf[..]);
        p.set_ethernet_ipv4();
        p.set_operation(Operation::REPLY);
        p.set_sender_hardware_addr(EthernetAddress([2, 0, 0, 0, 0x0a, 0xfe]));
        p.set_sender_protocol_addr(Ipv4Addr::new(192, 0, 2, 254));
        p.set_target_hardware_addr(EthernetAddress([2, 0, 0, 0, 0x0a, 0x01]));
        p.set_target_protocol_addr(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(&buf[..], &hex(testdata::ARP_REPLY_LINUX)[14..]);
    }

    #[test]
    fn non_ethernet_ipv4_is_rejected() {
        let mut req = hex(testdata::ARP_REQUEST);
        req[14 + 1] = 6; // htype 6 (IEEE 802)
        assert_eq!(
            Packet::new_checked(&req[14..]),
            Err(Error::UnsupportedArpHardware { htype: 6, ptype: 0x0800, hlen: 6, plen: 4 })
        );
        let mut req = hex(testdata::ARP_REQUEST);
        req[14 + 5] = 16; // plen 16
        assert_eq!(Packet::new_checked(&req[14..]).unwrap_err().reason(), "unsupported_arp_hardware");
    }

    #[test]
    fn every_prefix() {
        let req = hex(testdata::ARP_REQUEST);
        let arp = &req[14..];
        for len in 0..=arp.len() {
            match Packet::new_checked(&arp[..len]) {
                Ok(p) => {
                    assert_eq!(len, 28);
                    exercise(&p);
                }
                Err(e) => assert_eq!(e, Error::Truncated { layer: Layer::Arp, need: 28, have: len }),
            }
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
        }

        #[test]
        fn wellformed_headers_parse(rest in proptest::collection::vec(any::<u8>(), 22..40)) {
            let mut bytes = vec![0, 1, 8, 0, 6, 4];
            bytes.extend_from_slice(&rest);
            let p = Packet::new_checked(&bytes[..]).unwrap();
            prop_assert_eq!(p.operation(), u16::from_be_bytes([rest[0], rest[1]]));
        }
    }
}
