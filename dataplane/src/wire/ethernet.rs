//! Ethernet II frames, MAC addresses, and the L2 dissection the engine starts
//! with: zero or one IEEE 802.1Q tag, then the EtherType and where L3 begins.

use std::fmt;
use std::net::Ipv6Addr;

use super::{read_array, read_u16, truncated, write_u16, Error, Layer, Result};

/// A 48-bit IEEE MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct EthernetAddress(pub [u8; 6]);

impl EthernetAddress {
    /// ff:ff:ff:ff:ff:ff.
    pub const BROADCAST: EthernetAddress = EthernetAddress([0xff; 6]);
    /// 00:00:00:00:00:00.
    pub const ZERO: EthernetAddress = EthernetAddress([0; 6]);

    /// The address as bytes.
    pub const fn as_bytes(&self) -> &[u8; 6] {
        &self.0
    }

    /// ff:ff:ff:ff:ff:ff.
    pub fn is_broadcast(&self) -> bool {
        *self == Self::BROADCAST
    }

    /// The group bit (I/G, least significant bit of the first octet) is set;
    /// broadcast is multicast too.
    pub fn is_multicast(&self) -> bool {
        self.0[0] & 0x01 != 0
    }

    /// Neither multicast nor all zero.
    pub fn is_unicast(&self) -> bool {
        !self.is_multicast() && *self != Self::ZERO
    }

    /// The MAC an IPv6 multicast address maps to: 33:33 and the address's
    /// last 32 bits (RFC 2464 section 7).
    pub fn from_ipv6_multicast(addr: &Ipv6Addr) -> EthernetAddress {
        let o = addr.octets();
        EthernetAddress([0x33, 0x33, o[12], o[13], o[14], o[15]])
    }
}

impl fmt::Display for EthernetAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", b[0], b[1], b[2], b[3], b[4], b[5])
    }
}

/// EtherType values (IEEE 802 numbers). A namespace for `u16` constants.
#[derive(Debug)]
pub enum EtherType {}

impl EtherType {
    /// IPv4.
    pub const IPV4: u16 = 0x0800;
    /// ARP (RFC 826).
    pub const ARP: u16 = 0x0806;
    /// IEEE 802.1Q customer VLAN tag.
    pub const VLAN: u16 = 0x8100;
    /// IPv6.
    pub const IPV6: u16 = 0x86DD;
    /// IEEE 802.1ad service VLAN tag (the outer tag of QinQ).
    pub const QINQ: u16 = 0x88A8;
}

/// A read/write view of an Ethernet II header and what follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const DST: usize = 0;
    pub const SRC: usize = 6;
    pub const ETHERTYPE: usize = 12;
    pub const PAYLOAD: usize = 14;
    // Inside an 802.1Q tag, which starts at ETHERTYPE.
    pub const VLAN_TCI: usize = 14;
    pub const VLAN_ETHERTYPE: usize = 16;
    pub const VLAN_PAYLOAD: usize = 18;
}

/// Length of an untagged Ethernet header.
pub const HEADER_LEN: usize = field::PAYLOAD;
/// Length of an Ethernet header with one 802.1Q tag.
pub const VLAN_HEADER_LEN: usize = field::VLAN_PAYLOAD;

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wraps a buffer without checking it.
    pub const fn new_unchecked(buffer: T) -> Frame<T> {
        Frame { buffer }
    }

    /// Wraps a buffer after [`check_len`](Self::check_len).
    pub fn new_checked(buffer: T) -> Result<Frame<T>> {
        let frame = Self::new_unchecked(buffer);
        frame.check_len()?;
        Ok(frame)
    }

    /// Ensures no accessor can panic: the buffer holds the 14-byte header.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(Layer::Ethernet, HEADER_LEN, have));
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Destination address.
    #[inline]
    pub fn dst_addr(&self) -> EthernetAddress {
        EthernetAddress(read_array(self.buffer.as_ref(), field::DST))
    }

    /// Source address.
    #[inline]
    pub fn src_addr(&self) -> EthernetAddress {
        EthernetAddress(read_array(self.buffer.as_ref(), field::SRC))
    }

    /// The raw EtherType field (0x8100 when a VLAN tag follows; see [`l2_info`]).
    #[inline]
    pub fn ethertype(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::ETHERTYPE)
    }

    /// Everything after the 14-byte header (including a VLAN tag, if any).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PAYLOAD..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    /// Sets the destination address.
    #[inline]
    pub fn set_dst_addr(&mut self, addr: EthernetAddress) {
        self.buffer.as_mut()[field::DST..field::DST + 6].copy_from_slice(&addr.0);
    }

    /// Sets the source address.
    #[inline]
    pub fn set_src_addr(&mut self, addr: EthernetAddress) {
        self.buffer.as_mut()[field::SRC..field::SRC + 6].copy_from_slice(&addr.0);
    }

    /// Sets the raw EtherType field.
    #[inline]
    pub fn set_ethertype(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::ETHERTYPE, value);
    }

    /// Everything after the 14-byte header, mutable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::PAYLOAD..]
    }
}

/// What L2 says about a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct L2Info {
    /// The EtherType of the L3 payload (after the VLAN tag, if any).
    pub ethertype: u16,
    /// Where the L3 header starts: 14, or 18 with a VLAN tag.
    pub l3_offset: usize,
    /// The whole TCI (PCP, DEI, VID) of the VLAN tag, if the frame has one.
    pub vlan_tci: Option<u16>,
}

impl L2Info {
    /// The VLAN ID (low 12 bits of the TCI), if tagged.
    pub fn vlan_id(&self) -> Option<u16> {
        self.vlan_tci.map(|tci| tci & 0x0fff)
    }
}

/// Dissects the Ethernet header and zero or one 802.1Q (or 802.1ad) tag.
/// A second tag (QinQ) is [`Error::StackedVlan`]. An EtherType below 0x0600
/// (an 802.3 length field) is returned as is; the caller will not know it.
pub fn l2_info(frame: &[u8]) -> Result<L2Info> {
    if frame.len() < HEADER_LEN {
        return Err(truncated(Layer::Ethernet, HEADER_LEN, frame.len()));
    }
    let outer = read_u16(frame, field::ETHERTYPE);
    if outer != EtherType::VLAN && outer != EtherType::QINQ {
        return Ok(L2Info { ethertype: outer, l3_offset: HEADER_LEN, vlan_tci: None });
    }
    if frame.len() < VLAN_HEADER_LEN {
        return Err(truncated(Layer::Vlan, VLAN_HEADER_LEN, frame.len()));
    }
    let inner = read_u16(frame, field::VLAN_ETHERTYPE);
    if inner == EtherType::VLAN || inner == EtherType::QINQ {
        return Err(Error::StackedVlan { tpid: inner });
    }
    Ok(L2Info { ethertype: inner, l3_offset: VLAN_HEADER_LEN, vlan_tci: Some(read_u16(frame, field::VLAN_TCI)) })
}

/// Writes an Ethernet header (with an 802.1Q tag when `vlan_tci` is given)
/// at the start of `buf` and returns where L3 starts.
pub fn write_header(
    buf: &mut [u8],
    dst: EthernetAddress,
    src: EthernetAddress,
    vlan_tci: Option<u16>,
    ethertype: u16,
) -> Result<usize> {
    let need = if vlan_tci.is_some() { VLAN_HEADER_LEN } else { HEADER_LEN };
    if buf.len() < need {
        return Err(Error::BufferTooSmall { need, have: buf.len() });
    }
    buf[field::DST..field::DST + 6].copy_from_slice(&dst.0);
    buf[field::SRC..field::SRC + 6].copy_from_slice(&src.0);
    match vlan_tci {
        Some(tci) => {
            write_u16(buf, field::ETHERTYPE, EtherType::VLAN);
            write_u16(buf, field::VLAN_TCI, tci);
            write_u16(buf, field::VLAN_ETHERTYPE, ethertype);
        }
        None => write_u16(buf, field::ETHERTYPE, ethertype),
    }
    Ok(need)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex, vlan_tag as tag};
    use proptest::prelude::*;

    fn exercise<T: AsRef<[u8]>>(f: &Frame<T>) -> usize {
        f.dst_addr().0.len() + f.src_addr().0.len() + usize::from(f.ethertype()) + f.payload().len()
    }

    #[test]
    fn captured_arp_request() {
        let bytes = hex(testdata::ARP_REQUEST);
        let f = Frame::new_checked(&bytes[..]).unwrap();
        assert_eq!(f.dst_addr(), EthernetAddress::BROADCAST);
        assert_eq!(f.src_addr(), EthernetAddress([2, 0, 0, 0, 0x0a, 0x01]));
        assert_eq!(f.src_addr().to_string(), "02:00:00:00:0a:01");
        assert_eq!(f.ethertype(), EtherType::ARP);
        assert_eq!(f.payload().len(), 28);
        assert_eq!(l2_info(&bytes).unwrap(), L2Info { ethertype: EtherType::ARP, l3_offset: 14, vlan_tci: None });
    }

    #[test]
    fn vlan_tagged_frame() {
        // The captured echo request with a tag: PCP 5, VID 100 (0xa064).
        let bytes = tag(&hex(testdata::ICMP_ECHO_REQUEST), 0x8100, 0xa064);
        assert_eq!(&bytes[12..20], &[0x81, 0x00, 0xa0, 0x64, 0x08, 0x00, 0x45, 0x00]);
        let info = l2_info(&bytes).unwrap();
        assert_eq!(info.ethertype, EtherType::IPV4);
        assert_eq!(info.l3_offset, 18);
        assert_eq!(info.vlan_tci, Some(0xa064));
        assert_eq!(info.vlan_id(), Some(100));
        assert_eq!(bytes[info.l3_offset], 0x45);
        // An 802.1ad outer tag alone is one tag too.
        let ad = tag(&hex(testdata::ICMP_ECHO_REQUEST), 0x88a8, 7);
        assert_eq!(l2_info(&ad).unwrap().vlan_tci, Some(7));
    }

    #[test]
    fn qinq_is_rejected() {
        let inner = tag(&hex(testdata::ARP_REQUEST), 0x8100, 100);
        let double = tag(&inner, 0x88a8, 200);
        assert_eq!(l2_info(&double), Err(Error::StackedVlan { tpid: 0x8100 }));
        let double_q = tag(&inner, 0x8100, 200);
        assert_eq!(l2_info(&double_q), Err(Error::StackedVlan { tpid: 0x8100 }));
    }

    #[test]
    fn truncated_at_every_length() {
        let bytes = tag(&hex(testdata::ARP_REQUEST), 0x8100, 100);
        for len in 0..bytes.len() {
            let r = l2_info(&bytes[..len]);
            match len {
                0..=13 => assert_eq!(r, Err(Error::Truncated { layer: Layer::Ethernet, need: 14, have: len })),
                14..=17 => assert_eq!(r, Err(Error::Truncated { layer: Layer::Vlan, need: 18, have: len })),
                _ => assert_eq!(r.unwrap().l3_offset, 18),
            }
            match Frame::new_checked(&bytes[..len]) {
                Ok(f) => assert_eq!(exercise(&f), 12 + 0x8100 + len - 14),
                Err(e) => assert!(len < 14, "{e}"),
            }
        }
    }

    #[test]
    fn write_header_with_and_without_tag() {
        let mut buf = [0u8; 18];
        let mac = EthernetAddress([2, 0, 0, 0, 0, 1]);
        let l3 = write_header(&mut buf, EthernetAddress::BROADCAST, mac, Some(0x0064), 0x0806);
        assert_eq!(l3, Ok(18));
        assert_eq!(buf, [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 2, 0, 0, 0, 0, 1, 0x81, 0x00, 0x00, 0x64, 0x08, 0x06]);
        assert_eq!(
            write_header(&mut buf[..17], mac, mac, Some(1), 0x0800),
            Err(Error::BufferTooSmall { need: 18, have: 17 })
        );
        assert_eq!(write_header(&mut buf[..14], mac, mac, None, 0x86dd), Ok(14));
        assert_eq!(&buf[12..14], &[0x86, 0xdd]);
        let mut f = Frame::new_checked(&mut buf[..]).unwrap();
        f.set_dst_addr(EthernetAddress::ZERO);
        f.set_ethertype(0x0800);
        f.payload_mut()[0] = 0x45;
        assert_eq!(&buf[..15], &[0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 1, 0x08, 0x00, 0x45]);
    }

    #[test]
    fn mac_classes() {
        assert!(EthernetAddress::BROADCAST.is_multicast());
        assert!(!EthernetAddress::ZERO.is_unicast());
        assert!(EthernetAddress([2, 0, 0, 0, 0, 1]).is_unicast());
        assert!(EthernetAddress([0x33, 0x33, 0, 0, 0, 1]).is_multicast());
        let a: Ipv6Addr = "ff02::1:ff00:77".parse().unwrap();
        assert_eq!(EthernetAddress::from_ipv6_multicast(&a), EthernetAddress([0x33, 0x33, 0xff, 0x00, 0x00, 0x77]));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(f) = Frame::new_checked(&bytes[..]) {
                exercise(&f);
            }
            if let Ok(info) = l2_info(&bytes) {
                prop_assert!(info.l3_offset <= bytes.len());
            }
        }
    }
}
