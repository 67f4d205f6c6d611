//! VXLAN headers (RFC 7348), as `egret node` sends them to a gateway from
//! a node in another subnet (docs/adr/0031-workers-in-any-subnet.md).
//!
//! The buffer is the UDP payload: 8 bytes, flags (I, 0x08: the VNI is
//! valid), 24 reserved bits, the 24-bit VNI, 8 reserved bits, then the
//! pod's Ethernet frame. Egret's nodes send the flags 0x08 exactly and VNI
//! [`EGRET_VNI`]. [`Packet::check_egret`] refuses other flags (the I bit
//! clear, or an extension's: VXLAN-GBP's G bit 0x80, VXLAN-GPE's P bit
//! 0x04, whose payload need not be Ethernet) and another VNI, each under
//! its own [`Error`]; the reserved fields are ignored on receipt, as RFC
//! 7348 section 5 says.
//!
//! VXLAN, not Geneve (RFC 8926): every Linux kernel with overlay networking
//! has it (flannel and Docker's overlay use it), while Geneve is left out
//! of minimal VM kernels, this project's own test machines' included (ADR
//! 0031, "Amended").

use super::{read_u32, truncated, Error, Layer, Result};

/// Length of the VXLAN header.
pub const HEADER_LEN: usize = 8;

/// The UDP destination port Egret's nodes and gateways use unless the
/// cluster sets another (`tunnel-port` in ConfigMap `egret-cluster`). Not
/// 4789 (IANA's VXLAN port) nor 8472 (Linux's default, flannel's and
/// Cilium's): the kernel allows one metadata-collecting VXLAN device per
/// port, and a CNI's may hold those.
pub const DEFAULT_PORT: u16 = 6082;

/// The Virtual Network Identifier of Egret's tunnel.
pub const EGRET_VNI: u32 = 1;

/// The flags Egret's nodes send: I (the VNI is valid) and nothing else.
pub const FLAGS_VNI_VALID: u8 = 0x08;

/// Bytes the tunnel adds before the inner IP header, over IPv4: outer IPv4
/// (20), UDP (8), VXLAN (8) and the inner Ethernet header (14).
pub const OVERHEAD_V4: u16 = 50;
/// The same over IPv6 (outer header 40).
pub const OVERHEAD_V6: u16 = 70;

mod field {
    pub const FLAGS: usize = 0;
    pub const VNI: usize = 4;
}

/// A read view of a VXLAN header and what follows it.
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

    /// Ensures no accessor can panic: the 8-byte header is in the buffer.
    pub fn check_len(&self) -> Result<()> {
        let have = self.buffer.as_ref().len();
        if have < HEADER_LEN {
            return Err(truncated(Layer::Vxlan, HEADER_LEN, have));
        }
        Ok(())
    }

    /// Checks what Egret's nodes send, after [`check_len`](Self::check_len):
    /// the flags 0x08 exactly, `vni`.
    pub fn check_egret(&self, vni: u32) -> Result<()> {
        if self.flags() != FLAGS_VNI_VALID {
            return Err(Error::VxlanFlags { flags: self.flags() });
        }
        if self.vni() != vni {
            return Err(Error::VxlanVni { vni: self.vni() });
        }
        Ok(())
    }

    /// The flags byte.
    #[inline]
    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// The 24-bit Virtual Network Identifier.
    #[inline]
    pub fn vni(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::VNI) >> 8
    }

    /// What follows the header (the inner frame).
    #[inline]
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

/// Writes the header Egret's nodes send: the I flag, `vni`, reserved
/// fields zero. `buffer` must hold [`HEADER_LEN`].
pub fn emit(buffer: &mut [u8], vni: u32) {
    buffer[..HEADER_LEN].copy_from_slice(&[FLAGS_VNI_VALID, 0, 0, 0, 0, 0, 0, 0]);
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
        assert_eq!((p.flags(), p.vni()), (0x08, 1));
        assert_eq!(p.payload().len(), 14);
    }

    #[test]
    fn reserved_fields_are_ignored_on_receipt() {
        let b = header([0x08, 0xff, 0xff, 0xff, 0, 0, 1, 0xff]);
        assert_eq!(Packet::new_checked(&b[..]).unwrap().check_egret(EGRET_VNI), Ok(()));
    }

    #[test]
    fn other_flags_and_vnis_are_refused_under_their_own_errors() {
        let cases: [([u8; 8], Error); 4] = [
            ([0x00, 0, 0, 0, 0, 0, 1, 0], Error::VxlanFlags { flags: 0x00 }),
            ([0x88, 0, 0, 0, 0, 0, 1, 0], Error::VxlanFlags { flags: 0x88 }),
            ([0x0c, 0, 0, 0x03, 0, 0, 1, 0], Error::VxlanFlags { flags: 0x0c }),
            ([0x08, 0, 0, 0, 0, 0, 2, 0], Error::VxlanVni { vni: 2 }),
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
                Error::Truncated { layer: Layer::Vxlan, need: 8, have: len }
            );
        }
    }
}
