//! Geneve headers (RFC 8926), as `egret node` sends them to a gateway from
//! a node in another subnet (docs/adr/0031-workers-in-any-subnet.md).
//!
//! The buffer is the UDP payload. Egret's nodes send version 0, no
//! options, neither O (control) nor C (critical) set, protocol type
//! Transparent Ethernet Bridging (0x6558: an Ethernet frame follows) and
//! VNI [`EGRET_VNI`]. [`Packet::check_egret`] refuses anything else, each
//! refusal under its own [`Error`] (RFC 8926 section 3.4: a tunnel endpoint
//! that does not understand a critical option drops the packet; Egret
//! understands none, and its nodes send none).

use super::{read_u16, read_u32, truncated, Error, Layer, Result};

/// Length of the fixed Geneve header (RFC 8926 section 3.4).
pub const HEADER_LEN: usize = 8;

/// The UDP destination port Egret's nodes and gateways use unless the
/// cluster sets another (`tunnel-port` in ConfigMap `egret-cluster`). Not
/// 6081, IANA's Geneve port: the kernel allows one metadata-collecting
/// Geneve device per port, and Antrea's and Cilium's take 6081 on nodes.
pub const DEFAULT_PORT: u16 = 6082;

/// The Virtual Network Identifier of Egret's tunnel.
pub const EGRET_VNI: u32 = 1;

/// Protocol Type of an Ethernet payload (Transparent Ethernet Bridging).
pub const PROTOCOL_ETHERNET: u16 = 0x6558;

/// Bytes the tunnel adds before the inner IP header, over IPv4: outer IPv4
/// (20), UDP (8), Geneve (8) and the inner Ethernet header (14).
pub const OVERHEAD_V4: u16 = 50;
/// The same over IPv6 (outer header 40).
pub const OVERHEAD_V6: u16 = 70;

mod field {
    pub const VER_OPT_LEN: usize = 0;
    pub const FLAGS: usize = 1;
    pub const PROTOCOL: usize = 2;
    pub const VNI: usize = 4;
}

/// A read view of a Geneve header and what follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

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

    /// Ensures no accessor can panic: the fixed header and the options it
    /// announces are in the buffer.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(Layer::Geneve, HEADER_LEN, have));
        }
        let need = self.header_len();
        if have < need {
            return Err(truncated(Layer::Geneve, need, have));
        }
        Ok(())
    }

    /// Checks what Egret's nodes send, after [`check_len`](Self::check_len):
    /// version 0, no options, O and C clear, an Ethernet payload, `vni`.
    pub fn check_egret(&self, vni: u32) -> Result<()> {
        if self.version() != 0 {
            return Err(Error::GeneveVersion { version: self.version() });
        }
        if self.options_len() != 0 || self.critical() {
            return Err(Error::GeneveOptions { len: self.options_len(), critical: self.critical() });
        }
        if self.control() {
            return Err(Error::GeneveControl);
        }
        if self.protocol() != PROTOCOL_ETHERNET {
            return Err(Error::GeneveProtocol { protocol: self.protocol() });
        }
        if self.vni() != vni {
            return Err(Error::GeneveVni { vni: self.vni() });
        }
        Ok(())
    }

    /// The version (2 bits).
    #[inline]
    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_OPT_LEN] >> 6
    }

    /// Length of the options in bytes (the field counts 4-byte words).
    #[inline]
    pub fn options_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[field::VER_OPT_LEN] & 0x3f) * 4
    }

    /// The fixed header and the options.
    #[inline]
    pub fn header_len(&self) -> usize {
        HEADER_LEN + self.options_len()
    }

    /// O: a control packet, not data to forward.
    #[inline]
    pub fn control(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x80 != 0
    }

    /// C: critical options are present.
    #[inline]
    pub fn critical(&self) -> bool {
        self.buffer.as_ref()[field::FLAGS] & 0x40 != 0
    }

    /// Protocol Type of the payload (an EtherType).
    #[inline]
    pub fn protocol(&self) -> u16 {
        read_u16(self.buffer.as_ref(), field::PROTOCOL)
    }

    /// The 24-bit Virtual Network Identifier.
    #[inline]
    pub fn vni(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::VNI) >> 8
    }

    /// What follows the header and its options (the inner frame).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

/// Writes the fixed header Egret's nodes send: version 0, no options, no
/// flags, an Ethernet payload, `vni`. `buffer` must hold [`HEADER_LEN`].
pub fn emit(buffer: &mut [u8], vni: u32) {
    buffer[..HEADER_LEN].copy_from_slice(&[0, 0, 0x65, 0x58, 0, 0, 0, 0]);
    buffer[field::VNI..field::VNI + 4].copy_from_slice(&(vni << 8).to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(first: [u8; 8]) -> Vec<u8> {
        let mut v = first.to_vec();
        v.extend_from_slice(&[0xaa; 14]);
        v
    }

    #[test]
    fn what_the_nodes_send_is_accepted() {
        let mut b = vec![0u8; 22];
        emit(&mut b, EGRET_VNI);
        let p = Packet::new_checked(&b[..]).unwrap();
        assert_eq!(p.check_egret(EGRET_VNI), Ok(()));
        assert_eq!((p.version(), p.options_len(), p.protocol(), p.vni()), (0, 0, PROTOCOL_ETHERNET, 1));
        assert_eq!(p.payload().len(), 14);
    }

    #[test]
    fn each_departure_is_refused_under_its_own_error() {
        let cases: [([u8; 8], Error); 6] = [
            ([0x40, 0, 0x65, 0x58, 0, 0, 1, 0], Error::GeneveVersion { version: 1 }),
            ([0x01, 0, 0x65, 0x58, 0, 0, 1, 0], Error::GeneveOptions { len: 4, critical: false }),
            ([0, 0x40, 0x65, 0x58, 0, 0, 1, 0], Error::GeneveOptions { len: 0, critical: true }),
            ([0, 0x80, 0x65, 0x58, 0, 0, 1, 0], Error::GeneveControl),
            ([0, 0, 0x08, 0x00, 0, 0, 1, 0], Error::GeneveProtocol { protocol: 0x0800 }),
            ([0, 0, 0x65, 0x58, 0, 0, 2, 0], Error::GeneveVni { vni: 2 }),
        ];
        for (first, want) in cases {
            let b = header(first);
            assert_eq!(Packet::new_checked(&b[..]).unwrap().check_egret(EGRET_VNI), Err(want), "{first:02x?}");
        }
    }

    #[test]
    fn truncation_is_refused_before_any_field_is_read() {
        for len in 0..HEADER_LEN {
            assert_eq!(
                Packet::new_checked(&[0u8; 8][..len]).unwrap_err(),
                Error::Truncated { layer: Layer::Geneve, need: 8, have: len }
            );
        }
        // Options announced past the end: 63 words.
        assert_eq!(
            Packet::new_checked(&[0x3f, 0, 0x65, 0x58, 0, 0, 1, 0][..]).unwrap_err(),
            Error::Truncated { layer: Layer::Geneve, need: 8 + 252, have: 8 }
        );
    }
}
