//! The lab's address plan: the scenario fixture table's addresses and MACs
//! (`egret_dataplane::fixtures`), plus what the fixtures leave implicit (the
//! gateway's own addresses, the pods' first hop, the server's link). Only
//! TEST-NET and benchmark ranges. docs/lab.md draws it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

pub use egret_dataplane::fixtures::{
    E1, E2, E6, EXCLUDED, GW_IN, GW_OUT, NODE, NODE6, NODE_MAC, POD6, POD_A, POD_B, POD_C, POD_U, SERVER, SERVER6,
    STRANGER, UPSTREAM, UPSTREAM6, UP_MAC,
};

/// The gateway's inside address (towards the node router).
pub const GW_INSIDE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
/// The gateway's inside IPv6 address.
pub const GW_INSIDE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 2);
/// The gateway's outside address (towards the upstream router).
pub const GW_OUTSIDE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 2);
/// The gateway's outside IPv6 address.
pub const GW_OUTSIDE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 2);
/// The upstream router's address on the server link.
pub const UPSTREAM_SRV: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// The upstream router's IPv6 address on the server link.
pub const UPSTREAM_SRV6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x51, 0, 0, 0, 0, 1);
/// A spare egress IP (the reload test moves policy "a" to it).
pub const E3: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 12);
/// An address on the outside link nobody owns (ARP must stay unanswered).
pub const NOT_OWNED: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 99);

/// The server's TCP port answering HTTP (it tells the client what it saw).
pub const HTTP_PORT: u16 = 80;
/// The server's TCP line-echo and UDP echo port.
pub const ECHO_PORT: u16 = 7;
/// The egress IPs' default NAT port range (docs/config.md `nat.ports`).
pub const NAT_PORTS: (u16, u16) = (32768, 60999);
/// A port outside the NAT range: inbound there belongs to the kernel.
pub const SERVICE_PORT: u16 = 8080;

/// The lab's pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pod {
    /// 198.18.0.10, policy "a" (egress E1).
    A,
    /// 198.18.0.11, policy "a" (egress E1).
    B,
    /// 198.18.1.10, policy "c" (egress E2, towards 198.51.100.0/24).
    C,
    /// 198.18.2.10, no policy: the kernel forwards it untouched.
    U,
    /// 2001:db8:18::10, policy "a" (egress E6).
    V6,
}

impl Pod {
    /// Every pod.
    pub const ALL: [Pod; 5] = [Pod::A, Pod::B, Pod::C, Pod::U, Pod::V6];

    /// Short name (namespace suffix `pod-<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Pod::A => "a",
            Pod::B => "b",
            Pod::C => "c",
            Pod::U => "u",
            Pod::V6 => "v6",
        }
    }

    /// The pod's address.
    pub fn addr(self) -> IpAddr {
        match self {
            Pod::A => POD_A.into(),
            Pod::B => POD_B.into(),
            Pod::C => POD_C.into(),
            Pod::U => POD_U.into(),
            Pod::V6 => POD6.into(),
        }
    }

    /// Its prefix length on the node's pod bridge.
    pub fn prefix_len(self) -> u8 {
        if self == Pod::V6 {
            64
        } else {
            24
        }
    }

    /// Its first hop: the node router's address on the pod bridge.
    pub fn first_hop(self) -> IpAddr {
        match self {
            Pod::A | Pod::B => Ipv4Addr::new(198, 18, 0, 1).into(),
            Pod::C => Ipv4Addr::new(198, 18, 1, 1).into(),
            Pod::U => Ipv4Addr::new(198, 18, 2, 1).into(),
            Pod::V6 => Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, 0, 1).into(),
        }
    }

    /// The egress IP the lab's default configuration gives its traffic to
    /// the server, or `None` if the kernel forwards it untouched.
    pub fn egress(self) -> Option<IpAddr> {
        match self {
            Pod::A | Pod::B => Some(E1.into()),
            Pod::C => Some(E2.into()),
            Pod::U => None,
            Pod::V6 => Some(E6.into()),
        }
    }

    /// The server address of the pod's family.
    pub fn server(self) -> IpAddr {
        if self == Pod::V6 {
            SERVER6.into()
        } else {
            SERVER.into()
        }
    }

    /// The server's UDP/TCP echo endpoint in the pod's family.
    pub fn echo_endpoint(self) -> SocketAddr {
        SocketAddr::new(self.server(), ECHO_PORT)
    }

    /// The server's HTTP endpoint in the pod's family.
    pub fn http_endpoint(self) -> SocketAddr {
        SocketAddr::new(self.server(), HTTP_PORT)
    }
}

/// The node router's addresses on the pod bridge, with prefix lengths.
pub const NODE_POD_BRIDGE: [(&str, u8); 4] =
    [("198.18.0.1", 24), ("198.18.1.1", 24), ("198.18.2.1", 24), ("2001:db8:18::1", 64)];

/// The server's addresses (SERVER, EXCLUDED, STRANGER share one host).
pub fn server_addrs() -> [IpAddr; 4] {
    [SERVER.into(), EXCLUDED.into(), STRANGER.into(), SERVER6.into()]
}
