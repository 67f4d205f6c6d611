//! Zero-copy views over packet bytes, and the Internet checksum.
//!
//! Every header type is a `Packet<T: AsRef<[u8]>>` (or `Frame<T>`) wrapping a
//! byte buffer, in the style of smoltcp's `wire` module:
//!
//! - `new_unchecked(buf)` wraps without looking; `new_checked(buf)` wraps and
//!   calls `check_len()`.
//! - **The contract:** once `check_len()` has succeeded, no accessor of that
//!   view can panic, including those that follow length fields found in the
//!   packet (IPv4 IHL and total length, IPv6 payload length, TCP data offset,
//!   UDP length): `check_len()` validates every one of them against the
//!   buffer. A setter documented as "invalidates `check_len`" voids it.
//! - Getters exist for `T: AsRef<[u8]>`; setters only for
//!   `T: AsRef<[u8]> + AsMut<[u8]>`, so a frame in the UMEM is rewritten in place.
//! - Field offsets are named constants in a private `mod field` per header.
//! - `payload()` stops at the length the header announces, not at the end of
//!   the buffer: an Ethernet frame may carry padding after the IP datagram.
//!
//! Errors are [`Error`], one variant per thing that can be wrong, each with a
//! short snake_case [`Error::reason`] used by the engine's drop counters.
//!
//! Specifications implemented here:
//!
//! | module | RFC |
//! |---|---|
//! | [`ethernet`] | IEEE 802.3 framing, IEEE 802.1Q tags |
//! | [`arp`] | RFC 826 (ARP), RFC 5227 (announcements) |
//! | [`ipv4`] | RFC 791 (IPv4) |
//! | [`ipv6`] | RFC 8200 (IPv6 and its extension headers), RFC 4302 (AH length) |
//! | [`tcp`] | RFC 9293 (TCP, obsoletes RFC 793), RFC 3168 (ECE/CWR) |
//! | [`udp`] | RFC 768 (UDP) |
//! | [`vxlan`] | RFC 7348 (VXLAN) |
//! | [`icmpv4`] | RFC 792 (ICMP), RFC 1191 (next-hop MTU) |
//! | [`icmpv6`] | RFC 4443 (ICMPv6), RFC 4861 (Neighbor Discovery) |
//! | [`checksum`] | RFC 1071 (computing the checksum), RFC 1624 (incremental update) |

use std::fmt;

pub mod arp;
pub mod checksum;
pub mod ethernet;
pub mod icmpv4;
pub mod icmpv6;
pub mod ipv4;
pub mod ipv6;
pub mod tcp;
pub mod udp;
pub mod vxlan;

#[cfg(test)]
pub(crate) mod testdata;

pub use ethernet::{EtherType, EthernetAddress};

/// The result type of every fallible function in [`wire`](self).
pub type Result<T> = std::result::Result<T, Error>;

/// The header (or message) an [`Error`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Layer {
    /// The Ethernet header.
    Ethernet,
    /// An 802.1Q VLAN tag.
    Vlan,
    /// An ARP packet.
    Arp,
    /// The IPv4 header or datagram.
    Ipv4,
    /// The fixed IPv6 header or the datagram.
    Ipv6,
    /// An IPv6 extension header.
    Ipv6Extension,
    /// The TCP header or segment.
    Tcp,
    /// The UDP header or datagram.
    Udp,
    /// An ICMPv4 message.
    Icmpv4,
    /// An ICMPv6 message.
    Icmpv6,
    /// A Neighbor Discovery message or option.
    Ndp,
    /// A VXLAN header (RFC 7348).
    Vxlan,
}

impl Layer {
    /// The layer's name in snake_case.
    pub const fn name(self) -> &'static str {
        match self {
            Layer::Ethernet => "ethernet",
            Layer::Vlan => "vlan",
            Layer::Arp => "arp",
            Layer::Ipv4 => "ipv4",
            Layer::Ipv6 => "ipv6",
            Layer::Ipv6Extension => "ipv6_extension",
            Layer::Tcp => "tcp",
            Layer::Udp => "udp",
            Layer::Icmpv4 => "icmpv4",
            Layer::Icmpv6 => "icmpv6",
            Layer::Ndp => "ndp",
            Layer::Vxlan => "vxlan",
        }
    }
}

impl fmt::Display for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Everything that can be wrong with a packet, or with a buffer a packet is
/// built into. Each variant carries the values that made it wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The bytes end before the header (or the length it announces) does.
    #[error("truncated {layer}: need {need} bytes, have {have}")]
    Truncated {
        /// Which header was cut.
        layer: Layer,
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// The IP version nibble is not the one the view is for.
    #[error("bad IP version: expected {expected}, found {found}")]
    BadVersion {
        /// 4 or 6.
        expected: u8,
        /// The version nibble found.
        found: u8,
    },
    /// IPv4 IHL below 5 (RFC 791 3.1: the minimum header is 5 words).
    #[error("bad IPv4 header length: IHL {ihl} (minimum 5)")]
    BadHeaderLength {
        /// The IHL field, in 32-bit words.
        ihl: u8,
    },
    /// IPv4 total length smaller than the header length.
    #[error("bad IPv4 total length {total_len}: header alone is {header_len} bytes")]
    BadTotalLength {
        /// The total length field.
        total_len: u16,
        /// The header length from IHL.
        header_len: usize,
    },
    /// UDP length field below 8 or beyond the bytes the IP layer carries.
    #[error("bad UDP length {length}: {available} bytes available")]
    BadUdpLength {
        /// The UDP length field.
        length: u16,
        /// Bytes available for the datagram.
        available: usize,
    },
    /// TCP data offset below 5 words or beyond the segment.
    #[error("bad TCP data offset {data_offset} words: {available} bytes available")]
    BadTcpDataOffset {
        /// The data offset field, in 32-bit words.
        data_offset: u8,
        /// Bytes available for the segment.
        available: usize,
    },
    /// More IPv6 extension headers than [`ipv6::MAX_EXTENSION_HEADERS`].
    #[error("more than {limit} IPv6 extension headers")]
    TooManyExtensionHeaders {
        /// The limit.
        limit: usize,
    },
    /// A Hop-by-Hop Options header anywhere but right after the IPv6 header
    /// (RFC 8200 4.1).
    #[error("IPv6 Hop-by-Hop Options header at offset {offset}, not first")]
    MisplacedHopByHop {
        /// Its offset from the start of the IPv6 header.
        offset: usize,
    },
    /// A second Fragment header in one IPv6 datagram.
    #[error("second IPv6 Fragment header at offset {offset}")]
    DuplicateFragmentHeader {
        /// Its offset from the start of the IPv6 header.
        offset: usize,
    },
    /// Two stacked VLAN tags (QinQ); only zero or one tag is handled.
    #[error("stacked VLAN tags: inner TPID {tpid:#06x}")]
    StackedVlan {
        /// The inner tag's TPID.
        tpid: u16,
    },
    /// ARP for anything but Ethernet (htype 1, hlen 6) / IPv4 (ptype 0x0800, plen 4).
    #[error("unsupported ARP: htype {htype}, ptype {ptype:#06x}, hlen {hlen}, plen {plen}")]
    UnsupportedArpHardware {
        /// Hardware type.
        htype: u16,
        /// Protocol type.
        ptype: u16,
        /// Hardware address length.
        hlen: u8,
        /// Protocol address length.
        plen: u8,
    },
    /// An ARP request whose sender hardware address is not unicast.
    #[error("ARP sender hardware address {mac} is not unicast")]
    ArpSenderNotUnicast {
        /// The sender hardware address.
        mac: EthernetAddress,
    },
    /// An NDP option with length 0 (RFC 4861 4.6: such a packet is discarded).
    #[error("NDP option type {option_type} at offset {offset} has length 0")]
    NdpOptionZeroLength {
        /// The option type.
        option_type: u8,
        /// Offset of the option in the ICMPv6 message.
        offset: usize,
    },
    /// A Neighbor Discovery message with an IPv6 hop limit other than 255
    /// (RFC 4861 7.1.1).
    #[error("NDP message with hop limit {hop_limit}, not 255")]
    NdpBadHopLimit {
        /// The hop limit found.
        hop_limit: u8,
    },
    /// A Neighbor Discovery message with an ICMPv6 code other than 0.
    #[error("NDP message with ICMPv6 code {code}, not 0")]
    NdpBadCode {
        /// The code found.
        code: u8,
    },
    /// A Neighbor Solicitation for a multicast target (RFC 4861 7.1.1).
    #[error("NDP target {target} is multicast")]
    NdpMulticastTarget {
        /// The target address.
        target: std::net::Ipv6Addr,
    },
    /// A Neighbor Solicitation from `::` with a source link-layer address
    /// option (RFC 4861 7.1.1).
    #[error("NDP solicitation from the unspecified address carries a source link-layer address")]
    NdpSourceLinkAddrFromUnspecified,
    /// A Neighbor Solicitation from `::` not sent to a solicited-node
    /// multicast address (RFC 4861 7.1.1).
    #[error("NDP solicitation from the unspecified address sent to {dst}, not a solicited-node address")]
    NdpDadNotToSolicitedNode {
        /// The IPv6 destination.
        dst: std::net::Ipv6Addr,
    },
    /// A checksum that does not verify.
    #[error("bad {layer} checksum {checksum:#06x}")]
    BadChecksum {
        /// Whose checksum.
        layer: Layer,
        /// The checksum field found.
        checksum: u16,
    },
    /// VXLAN flags other than the I bit alone: an extension's (GBP's G,
    /// GPE's P) or the VNI marked invalid. Egret's nodes send 0x08.
    #[error("VXLAN flags {flags:#04x}, not 0x08")]
    VxlanFlags {
        /// The flags byte found.
        flags: u8,
    },
    /// A VXLAN VNI other than Egret's.
    #[error("VXLAN VNI {vni}, not Egret's")]
    VxlanVni {
        /// The VNI found.
        vni: u32,
    },
    /// The buffer a packet is to be built in is too small.
    #[error("buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
}

impl Error {
    /// A short snake_case name for drop counters (`ipv4_truncated`,
    /// `bad_udp_length`, ...). Stable: metrics are named after it.
    pub const fn reason(&self) -> &'static str {
        match self {
            Error::Truncated { layer, .. } => match layer {
                Layer::Ethernet => "ethernet_truncated",
                Layer::Vlan => "vlan_truncated",
                Layer::Arp => "arp_truncated",
                Layer::Ipv4 => "ipv4_truncated",
                Layer::Ipv6 => "ipv6_truncated",
                Layer::Ipv6Extension => "ipv6_extension_truncated",
                Layer::Tcp => "tcp_truncated",
                Layer::Udp => "udp_truncated",
                Layer::Icmpv4 => "icmpv4_truncated",
                Layer::Icmpv6 => "icmpv6_truncated",
                Layer::Ndp => "ndp_truncated",
                Layer::Vxlan => "vxlan_truncated",
            },
            Error::BadVersion { .. } => "bad_ip_version",
            Error::BadHeaderLength { .. } => "bad_ipv4_header_length",
            Error::BadTotalLength { .. } => "bad_ipv4_total_length",
            Error::BadUdpLength { .. } => "bad_udp_length",
            Error::BadTcpDataOffset { .. } => "bad_tcp_data_offset",
            Error::TooManyExtensionHeaders { .. } => "ipv6_too_many_extension_headers",
            Error::MisplacedHopByHop { .. } => "ipv6_misplaced_hop_by_hop",
            Error::DuplicateFragmentHeader { .. } => "ipv6_duplicate_fragment_header",
            Error::StackedVlan { .. } => "stacked_vlan",
            Error::UnsupportedArpHardware { .. } => "unsupported_arp_hardware",
            Error::ArpSenderNotUnicast { .. } => "arp_sender_not_unicast",
            Error::NdpOptionZeroLength { .. } => "ndp_option_zero_length",
            Error::NdpBadHopLimit { .. } => "ndp_bad_hop_limit",
            Error::NdpBadCode { .. } => "ndp_bad_code",
            Error::NdpMulticastTarget { .. } => "ndp_multicast_target",
            Error::NdpSourceLinkAddrFromUnspecified => "ndp_sllao_from_unspecified",
            Error::NdpDadNotToSolicitedNode { .. } => "ndp_dad_not_to_solicited_node",
            Error::BadChecksum { layer, .. } => match layer {
                Layer::Ipv4 => "bad_ipv4_checksum",
                Layer::Tcp => "bad_tcp_checksum",
                Layer::Udp => "bad_udp_checksum",
                Layer::Icmpv4 => "bad_icmpv4_checksum",
                Layer::Icmpv6 | Layer::Ndp => "bad_icmpv6_checksum",
                Layer::Ethernet | Layer::Vlan | Layer::Arp | Layer::Ipv6 | Layer::Ipv6Extension | Layer::Vxlan => {
                    "bad_checksum"
                }
            },
            Error::VxlanFlags { .. } => "vxlan_bad_flags",
            Error::VxlanVni { .. } => "vxlan_wrong_vni",
            Error::BufferTooSmall { .. } => "buffer_too_small",
        }
    }
}

/// IP protocol numbers / IPv6 next-header values (IANA "Assigned Internet
/// Protocol Numbers"). A namespace for `u8` constants.
#[derive(Debug)]
pub enum IpProtocol {}

impl IpProtocol {
    /// IPv6 Hop-by-Hop Options (RFC 8200 4.3).
    pub const HOP_BY_HOP: u8 = 0;
    /// ICMP for IPv4 (RFC 792).
    pub const ICMP: u8 = 1;
    /// TCP (RFC 9293).
    pub const TCP: u8 = 6;
    /// UDP (RFC 768).
    pub const UDP: u8 = 17;
    /// IPv6 Routing header (RFC 8200 4.4).
    pub const IPV6_ROUTING: u8 = 43;
    /// IPv6 Fragment header (RFC 8200 4.5).
    pub const IPV6_FRAGMENT: u8 = 44;
    /// Encapsulating Security Payload (RFC 4303).
    pub const ESP: u8 = 50;
    /// Authentication Header (RFC 4302).
    pub const AH: u8 = 51;
    /// ICMP for IPv6 (RFC 4443).
    pub const ICMPV6: u8 = 58;
    /// IPv6 No Next Header (RFC 8200 4.7).
    pub const IPV6_NO_NEXT_HEADER: u8 = 59;
    /// IPv6 Destination Options (RFC 8200 4.6).
    pub const IPV6_DEST_OPTIONS: u8 = 60;
}

// Byte helpers shared by the views. They index with bounds checks; the views
// call them only at offsets their `check_len` has validated.

#[inline]
fn read_u16(data: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([data[at], data[at + 1]])
}

#[inline]
fn read_u32(data: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]])
}

#[inline]
fn write_u16(data: &mut [u8], at: usize, value: u16) {
    data[at..at + 2].copy_from_slice(&value.to_be_bytes());
}

#[inline]
fn write_u32(data: &mut [u8], at: usize, value: u32) {
    data[at..at + 4].copy_from_slice(&value.to_be_bytes());
}

#[inline]
fn read_array<const N: usize>(data: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&data[at..at + N]);
    out
}

#[inline]
fn truncated(layer: Layer, need: usize, have: usize) -> Error {
    Error::Truncated { layer, need, have }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_snake_case_and_distinct_per_kind() {
        let samples = [
            truncated(Layer::Ipv4, 20, 3),
            Error::BadVersion { expected: 4, found: 6 },
            Error::BadHeaderLength { ihl: 4 },
            Error::BadTotalLength { total_len: 10, header_len: 20 },
            Error::BadUdpLength { length: 4, available: 8 },
            Error::BadTcpDataOffset { data_offset: 4, available: 20 },
            Error::TooManyExtensionHeaders { limit: 8 },
            Error::StackedVlan { tpid: 0x8100 },
            Error::BufferTooSmall { need: 90, have: 60 },
        ];
        let reasons: Vec<_> = samples.iter().map(Error::reason).collect();
        assert_eq!(
            reasons,
            [
                "ipv4_truncated",
                "bad_ip_version",
                "bad_ipv4_header_length",
                "bad_ipv4_total_length",
                "bad_udp_length",
                "bad_tcp_data_offset",
                "ipv6_too_many_extension_headers",
                "stacked_vlan",
                "buffer_too_small",
            ]
        );
        for r in reasons {
            assert!(r.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'), "{r}");
        }
        assert_eq!(truncated(Layer::Tcp, 20, 3).to_string(), "truncated tcp: need 20 bytes, have 3");
    }
}
