//! Rule 0d's configuration: the VXLAN tunnel Egret's nodes in other
//! subnets send their selected pods' frames through
//! (docs/adr/0031-workers-in-any-subnet.md), and the Nodes' addresses it
//! accepts them from. Written through
//! [`SteeringProgram::set_tunnel`](crate::SteeringProgram::set_tunnel) and
//! [`SteeringProgram::sync_node_addrs`](crate::SteeringProgram::sync_node_addrs).

/// The largest VNI: the field has 24 bits (RFC 8926 section 3.4).
pub const MAX_VNI: u32 = (1 << 24) - 1;

/// What the gateway decapsulates: VXLAN to UDP port `port` with VNI `vni`
/// (the engine's `wire::vxlan::DEFAULT_PORT` and `EGRET_VNI` unless the
/// cluster sets others).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tunnel {
    /// UDP destination port, host order; not 0.
    pub port: u16,
    /// Virtual Network Identifier, at most [`MAX_VNI`].
    pub vni: u32,
}

/// Value of `tunnel_config` (C `struct tunnel_config`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TunnelConfig {
    /// UDP destination port, network order (C `__be16`).
    pub port_be: [u8; 2],
    /// 0: off, the program decapsulates nothing.
    pub enabled: u16,
    /// Host order.
    pub vni: u32,
}

impl TunnelConfig {
    /// The value for `tunnel` (`None`: off, all zero).
    pub fn new(tunnel: Option<Tunnel>) -> Self {
        match tunnel {
            None => Self::default(),
            Some(t) => Self { port_be: t.port.to_be_bytes(), enabled: 1, vni: t.vni },
        }
    }

    /// The tunnel this value turns on, if any.
    pub fn tunnel(&self) -> Option<Tunnel> {
        (self.enabled != 0).then(|| Tunnel { port: u16::from_be_bytes(self.port_be), vni: self.vni })
    }

    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0..2].copy_from_slice(&self.port_be);
        b[2..4].copy_from_slice(&self.enabled.to_ne_bytes());
        b[4..8].copy_from_slice(&self.vni.to_ne_bytes());
        b
    }

    /// Reads a value as the kernel stores it; `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let b: &[u8; 8] = b.try_into().ok()?;
        Some(Self {
            port_be: [b[0], b[1]],
            enabled: u16::from_ne_bytes([b[2], b[3]]),
            vni: u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
        })
    }
}

/// What [`SteeringProgram::sync_node_addrs`](crate::SteeringProgram::sync_node_addrs)
/// changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeAddrSync {
    /// Addresses written that were not in the maps.
    pub added: usize,
    /// Addresses deleted that were no longer wanted.
    pub removed: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::maps::skel::types as c;

    #[test]
    fn layout_matches_the_programs_btf() {
        same_layout!(TunnelConfig, c::tunnel_config, [(port_be, port), (enabled, enabled), (vni, vni)]);
    }

    #[test]
    fn bytes_round_trip_and_put_the_port_in_network_order() {
        let t = TunnelConfig::new(Some(Tunnel { port: 6082, vni: 0x01_0203 }));
        let b = t.to_bytes();
        assert_eq!(&b[0..2], &[0x17, 0xc2]);
        assert_eq!(TunnelConfig::from_bytes(&b), Some(t));
        assert_eq!(t.tunnel(), Some(Tunnel { port: 6082, vni: 0x01_0203 }));
        assert_eq!(TunnelConfig::new(None).to_bytes(), [0; 8], "off is all zero, as loaded");
        assert_eq!(TunnelConfig::new(None).tunnel(), None);
        assert_eq!(TunnelConfig::from_bytes(&b[..7]), None);
    }
}
