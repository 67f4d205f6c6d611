//! TCP headers (RFC 9293 section 3.1, which obsoletes RFC 793; ECE and CWR
//! from RFC 3168).
//!
//! The buffer is the whole segment, i.e. the IP payload (which ends at the IP
//! length). `check_len` validates the data offset (5..=15 words, within the
//! segment).

use super::checksum;
use super::{read_u16, read_u32, truncated, write_u16, write_u32, Error, Layer, Result};

/// FIN flag bit of [`Packet::flags`].
pub const FIN: u8 = 0x01;
/// SYN flag bit.
pub const SYN: u8 = 0x02;
/// RST flag bit.
pub const RST: u8 = 0x04;
/// PSH flag bit.
pub const PSH: u8 = 0x08;
/// ACK flag bit.
pub const ACK: u8 = 0x10;
/// URG flag bit.
pub const URG: u8 = 0x20;
/// ECE flag bit (RFC 3168).
pub const ECE: u8 = 0x40;
/// CWR flag bit (RFC 3168).
pub const CWR: u8 = 0x80;

/// A read/write view of a TCP segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    pub const SRC_PORT: usize = 0;
    pub const DST_PORT: usize = 2;
    pub const SEQ: usize = 4;
    pub const ACK: usize = 8;
    pub const DATA_OFFSET: usize = 12;
    pub const FLAGS: usize = 13;
    pub const WINDOW: usize = 14;
    pub const CHECKSUM: usize = 16;
    pub const URGENT: usize = 18;
    pub const OPTIONS: usize = 20;
}

/// Length of a TCP header without options.
pub const MIN_HEADER_LEN: usize = field::OPTIONS;
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

    /// Ensures no accessor can panic: 20 bytes, and a data offset of at
    /// least 5 words that lies within the segment.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < MIN_HEADER_LEN {
            return Err(truncated(Layer::Tcp, MIN_HEADER_LEN, have));
        }
        let header_len = self.header_len();
        if header_len < MIN_HEADER_LEN || header_len > have {
            return Err(Error::BadTcpDataOffset { data_offset: self.data_offset(), available: have });
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

    /// Sequence number.
    #[inline]
    pub fn seq_number(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::SEQ)
    }

    /// Acknowledgment number (named so to leave `ack()` to the flag).
    #[inline]
    pub fn ack_number(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::ACK)
    }

    /// Data offset in 32-bit words.
    #[inline]
    pub fn data_offset(&self) -> u8 {
        self.buffer.as_ref()[field::DATA_OFFSET] >> 4
    }

    /// Header length in bytes (data offset * 4), options included.
    #[inline]
    pub fn header_len(&self) -> usize {
        usize::from(self.data_offset()) * 4
    }

    /// The eight flag bits (FIN = bit 0 ... CWR = bit 7; see the constants).
    #[inline]
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// FIN.
    #[inline]
    pub fn fin(&self) -> bool {
        self.flags() & FIN != 0
    }

    /// SYN.
    #[inline]
    pub fn syn(&self) -> bool {
        self.flags() & SYN != 0
    }

    /// RST.
    #[inline]
    pub fn rst(&self) -> bool {
        self.flags() & RST != 0
    }

    /// PSH.
    #[inline]
    pub fn psh(&self) -> bool {
        self.flags() & PSH != 0
    }

    /// ACK flag.
    #[inline]
    pub fn ack(&self) -> bool {
        self.flags() & ACK != 0
    }

    /// URG.
    #[inline]
    pub fn urg(&self) -> bool {
        self.flags() & URG != 0
    }

    /// ECE.
    #[inline]
    pub fn ece(&self) -> bool {
        self.flags() & ECE != 0
    }

    /// CWR.
    #[inline]
    pub fn cwr(&self) -> bool {
        self.flags() & CWR != 0
    }

    /// Window.
    #[inline]
    pub fn window(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::WINDOW)
    }

    /// Checksum field.
    #[inline]
    pub fn checksum(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::CHECKSUM)
    }

    /// Urgent pointer.
    #[inline]
    pub fn urgent(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::URGENT)
    }

    /// The options bytes.
    #[inline]
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[field::OPTIONS..self.header_len()]
    }

    /// The data after the header.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }

    /// The checksum verifies over the whole buffer with the given
    /// pseudo-header sum.
    #[inline]
    pub fn verify_checksum(&self, pseudo_sum: u32) -> bool {
        checksum::fold(checksum::sum(self.buffer.as_ref(), pseudo_sum)) == 0xffff
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

    /// Sets the sequence number (the checksum is not updated).
    #[inline]
    pub fn set_seq_number(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), field::SEQ, value);
    }

    /// Sets the acknowledgment number (the checksum is not updated).
    #[inline]
    pub fn set_ack_number(&mut self, value: u32) {
        write_u32(self.buffer.as_mut(), field::ACK, value);
    }

    /// Sets the checksum field.
    #[inline]
    pub fn set_checksum(&mut self, value: u16) {
        write_u16(self.buffer.as_mut(), field::CHECKSUM, value);
    }

    /// Computes the checksum over the whole buffer with the given
    /// pseudo-header sum and writes it.
    #[inline]
    pub fn fill_checksum(&mut self, pseudo_sum: u32) {
        self.set_checksum(0);
        let c = checksum::finish(checksum::sum(self.buffer.as_ref(), pseudo_sum));
        self.set_checksum(c);
    }

    /// The options bytes, mutable.
    #[inline]
    pub fn options_mut(&mut self) -> &mut [u8] {
        let end = self.header_len();
        &mut self.buffer.as_mut()[field::OPTIONS..end]
    }

    /// The data after the header, mutable.
    #[inline]
    pub fn payload_mut(&mut self) -> &mut [u8] {
        let start = self.header_len();
        &mut self.buffer.as_mut()[start..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex};
    use crate::wire::{ipv4, ipv6};
    use proptest::prelude::*;
    use std::net::Ipv4Addr;

    fn exercise<T: AsRef<[u8]>>(p: &Packet<T>) -> u64 {
        u64::from(p.src_port())
            + u64::from(p.dst_port())
            + u64::from(p.seq_number())
            + u64::from(p.ack_number())
            + u64::from(p.data_offset())
            + p.header_len() as u64
            + u64::from(p.flags())
            + u64::from(p.fin() as u8 + p.syn() as u8 + p.rst() as u8 + p.psh() as u8)
            + u64::from(p.ack() as u8 + p.urg() as u8 + p.ece() as u8 + p.cwr() as u8)
            + u64::from(p.window())
            + u64::from(p.checksum())
            + u64::from(p.urgent())
            + p.options().len() as u64
            + p.payload().len() as u64
            + u64::from(p.verify_checksum(0))
            + u64::from(p.is_checksum_partial(0))
    }

    #[test]
    fn captured_syn_with_options() {
        let f = hex(testdata::TCP4_SYN);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!((p.src_port(), p.dst_port()), (37762, 8080));
        assert_eq!(p.seq_number(), 1_955_736_839);
        assert_eq!(p.ack_number(), 0);
        assert_eq!(p.data_offset(), 10);
        assert_eq!(p.header_len(), 40);
        assert_eq!(p.flags(), SYN);
        assert!(p.syn() && !p.ack() && !p.fin() && !p.rst());
        assert_eq!(p.window(), 64480);
        assert_eq!(p.checksum(), 0x6c00);
        assert_eq!(p.urgent(), 0);
        // MSS 1240, SACK permitted, timestamps, NOP, window scale 10.
        assert_eq!(&p.options()[..4], &[2, 4, 0x04, 0xd8]);
        assert_eq!(&p.options()[16..], &[1, 3, 3, 10]);
        assert!(p.payload().is_empty());
        assert!(p.verify_checksum(ip.pseudo_header_sum()));
        assert!(!p.is_checksum_partial(ip.pseudo_header_sum()));
    }

    #[test]
    fn captured_rst_and_v6() {
        let f = hex(testdata::TCP4_RST);
        let ip = ipv4::Packet::new_checked(&f[14..]).unwrap();
        let p = Packet::new_checked(ip.payload()).unwrap();
        assert_eq!(p.flags(), RST | ACK);
        assert!(p.rst() && p.ack());
        assert_eq!(p.ack_number(), 1_955_736_840);
        assert!(p.verify_checksum(ip.pseudo_header_sum()));

        let f = hex(testdata::TCP6_SYN);
        let ip = ipv6::Packet::new_checked(&f[14..]).unwrap();
        let upper = ipv6::walk_extensions(&ip).unwrap();
        let p = Packet::new_checked(ip.upper_layer(upper.l4_offset)).unwrap();
        assert_eq!((p.src_port(), p.dst_port(), p.checksum()), (47300, 8080, 0x863c));
        assert!(p.verify_checksum(ip.pseudo_header_sum(&upper)));

        let f = hex(testdata::TCP6_RST);
        let ip = ipv6::Packet::new_checked(&f[14..]).unwrap();
        let upper = ipv6::walk_extensions(&ip).unwrap();
        let p = Packet::new_checked(ip.upper_layer(upper.l4_offset)).unwrap();
        assert_eq!((p.flags(), p.checksum(), p.ack_number()), (RST | ACK, 0x8d13, 218_620_375));
        assert!(p.verify_checksum(ip.pseudo_header_sum(&upper)));
    }

    #[test]
    fn captured_partial_checksum() {
        let f = hex(testdata::TCP4_SYN_PARTIAL);
        let mut ip_bytes = f[14..].to_vec();
        let mut ip = ipv4::Packet::new_checked(&mut ip_bytes[..]).unwrap();
        let pseudo = ip.pseudo_header_sum();
        let mut p = Packet::new_checked(ip.payload_mut()).unwrap();
        assert_eq!(p.checksum(), 0xec65);
        assert!(p.is_checksum_partial(pseudo));
        assert!(!p.verify_checksum(pseudo));
        p.fill_checksum(pseudo);
        assert_eq!(p.checksum(), 0x4a67, "the value tcpdump expects");
        assert!(p.verify_checksum(pseudo));
    }

    #[test]
    fn bad_data_offset() {
        let f = hex(testdata::TCP4_SYN);
        let mut seg = f[34..].to_vec();
        seg[12] = 0x40;
        assert_eq!(Packet::new_checked(&seg[..]), Err(Error::BadTcpDataOffset { data_offset: 4, available: 40 }));
        seg[12] = 0xb0; // 44 bytes of header in a 40-byte segment
        assert_eq!(Packet::new_checked(&seg[..]).unwrap_err().reason(), "bad_tcp_data_offset");
    }

    #[test]
    fn every_prefix() {
        let f = hex(testdata::TCP4_SYN);
        let seg = &f[34..];
        for len in 0..=seg.len() {
            match Packet::new_checked(&seg[..len]) {
                Ok(p) => {
                    assert_eq!(len, 40);
                    exercise(&p);
                }
                Err(Error::Truncated { need: 20, have, .. }) => assert_eq!(have, len),
                Err(Error::BadTcpDataOffset { data_offset: 10, available }) => {
                    assert_eq!(available, len);
                    assert!((20..40).contains(&len));
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn port_rewrite_with_delta_matches_etherparse() {
        let f = hex(testdata::TCP4_SYN);
        let mut ip_bytes = f[14..].to_vec();
        let mut ip = ipv4::Packet::new_checked(&mut ip_bytes[..]).unwrap();
        let new_src = Ipv4Addr::new(203, 0, 113, 10);
        let addr_delta = checksum::Delta::between_ipv4(ip.src_addr(), new_src);
        ip.set_src_addr(new_src);
        let mut p = Packet::new_checked(ip.payload_mut()).unwrap();
        let d = addr_delta.add(checksum::Delta::between_u16(p.src_port(), 40000));
        p.set_src_port(40000);
        p.set_checksum(d.apply(p.checksum()));
        let c = p.checksum();
        let (h, payload) = etherparse::TcpHeader::from_slice(&ip_bytes[20..]).unwrap();
        assert_eq!(h.calc_checksum_ipv4_raw([203, 0, 113, 10], [198, 51, 100, 2], payload).unwrap(), c);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                exercise(&p);
            }
        }

        #[test]
        fn nat_rewrite_incremental_equals_full(
            src in any::<u32>(), dst in any::<u32>(), new_src in any::<u32>(),
            sport in any::<u16>(), dport in any::<u16>(), new_sport in any::<u16>(),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
            flags in any::<u8>(),
        ) {
            let (src, dst, new_src) = (Ipv4Addr::from(src), Ipv4Addr::from(dst), Ipv4Addr::from(new_src));
            let mut seg = vec![0u8; 20];
            seg[12] = 0x50;
            seg[13] = flags;
            seg.extend_from_slice(&payload);
            let len = seg.len() as u32;
            let mut p = Packet::new_checked(&mut seg[..]).unwrap();
            p.set_src_port(sport);
            p.set_dst_port(dport);
            p.fill_checksum(checksum::pseudo_header_v4(src, dst, 6, len));
            let before = p.checksum();
            let d = checksum::Delta::between_ipv4(src, new_src)
                .add(checksum::Delta::between_u16(sport, new_sport));
            p.set_src_port(new_sport);
            let incremental = d.apply(before);
            let new_pseudo = checksum::pseudo_header_v4(new_src, dst, 6, len);
            p.fill_checksum(new_pseudo);
            prop_assert_eq!(incremental, p.checksum());
            // And etherparse agrees with the full computation.
            let (h, pl) = etherparse::TcpHeader::from_slice(&seg).unwrap();
            prop_assert_eq!(h.calc_checksum_ipv4_raw(new_src.octets(), dst.octets(), pl).unwrap(), incremental);
        }
    }
}
