//! Reads a frame once and records where everything is.
//!
//! The engine's first step: Ethernet (one optional 802.1Q tag), then IPv4 or
//! IPv6 (options, extension headers, fragments), then the transport header
//! when the datagram carries one here (unfragmented or first fragment). The
//! result is a small value of offsets and fields; the translation steps write
//! into the frame through the wire views at those offsets. Every length was
//! checked by the wire views, so later accesses at these offsets cannot fail.
//! Anything malformed is a named [`DropReason`].

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::nat::key::{proto, FlowKey, NatAddr};
use crate::stats::DropReason;
use crate::wire::{checksum, ethernet, icmpv4, icmpv6, ipv4, ipv6, tcp, udp, EtherType};

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parsed {
    /// ARP (the neighbour responder handles it).
    Arp,
    /// IPv4.
    V4(IpPacket<Ipv4Addr>),
    /// IPv6.
    V6(IpPacket<Ipv6Addr>),
    /// Another EtherType.
    Other(u16),
}

/// Where a datagram is a fragment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frag {
    /// Not fragmented (an IPv6 atomic fragment counts as not fragmented).
    None,
    /// The first fragment: carries the transport header.
    First {
        /// The datagram's identification.
        ident: u32,
        /// The protocol of the datagram's fragment key, the same in every
        /// fragment: IPv4's Protocol field, IPv6's Fragment header Next
        /// Header (RFC 8200 4.5; not the upper layer, which only the first
        /// fragment reaches when extension headers follow the Fragment
        /// header).
        key_proto: u8,
    },
    /// A later fragment: no transport header.
    Later {
        /// The datagram's identification.
        ident: u32,
        /// As for [`Frag::First`].
        key_proto: u8,
    },
}

/// The transport part of a datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4 {
    /// TCP or UDP.
    Ports {
        /// Source port.
        sport: u16,
        /// Destination port.
        dport: u16,
        /// TCP flags (0 for UDP).
        tcp_flags: u8,
        /// The checksum field's value.
        csum: u16,
    },
    /// ICMP echo request or reply.
    Echo {
        /// Identifier.
        ident: u16,
        /// Request (true) or reply.
        request: bool,
    },
    /// An ICMP error message (its embedded header is read by `icmp_error`).
    IcmpError {
        /// ICMP type.
        msg_type: u8,
    },
    /// An IPv6 neighbour solicitation.
    NeighborSolicit,
    /// Another ICMP message.
    IcmpOther {
        /// ICMP type.
        msg_type: u8,
    },
    /// A later fragment, or a protocol without ports.
    Opaque,
}

/// An IP datagram inside a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpPacket<A> {
    /// Offset of the IP header in the frame.
    pub l3: usize,
    /// Offset of the transport header (or of a later fragment's data).
    pub l4: usize,
    /// End of the datagram in the frame (Ethernet padding excluded).
    pub end: usize,
    /// Source address.
    pub src: A,
    /// Destination address.
    pub dst: A,
    /// Transport protocol.
    pub proto: u8,
    /// TTL or hop limit.
    pub hop_limit: u8,
    /// Fragmentation.
    pub frag: Frag,
    /// The transport part.
    pub l4info: L4,
}

impl<A: NatAddr> IpPacket<A> {
    /// The packet's flow key, if it has one (ports or an echo identifier).
    #[inline]
    pub fn flow_key(&self) -> Option<FlowKey<A>> {
        match self.l4info {
            L4::Ports { sport, dport, .. } => Some(FlowKey::new(self.src, self.dst, sport, dport, self.proto)),
            L4::Echo { ident, request: true } => Some(FlowKey::new(self.src, self.dst, ident, 0, self.proto)),
            L4::Echo { ident, request: false } => Some(FlowKey::new(self.src, self.dst, 0, ident, self.proto)),
            _ => None,
        }
    }

    /// The transport bytes' length (for pseudo-header sums).
    #[inline]
    pub fn l4_len(&self) -> usize {
        self.end - self.l4
    }
}

/// Reads a frame.
#[inline]
pub fn dissect(frame: &[u8]) -> Result<Parsed, DropReason> {
    match common_case(frame) {
        Some(p) => Ok(p),
        None => dissect_any(frame),
    }
}

/// The frames a gateway sees nearly all the time, read in one straight pass:
/// untagged Ethernet, IPv4 without options or IPv6 without extension headers,
/// not fragmented, carrying TCP or UDP. Returns `None` for anything else
/// *and* for anything malformed, leaving the verdict (and the drop reason)
/// to [`dissect_any`]; whenever it returns `Some`, the value is the one
/// `dissect_any` returns for the frame (`common_case_agrees_with_the_full_walk`
/// checks this on every fixture and on mutated frames).
#[inline]
fn common_case(frame: &[u8]) -> Option<Parsed> {
    const L3: usize = ethernet::HEADER_LEN;
    let ethertype = u16::from_be_bytes([*frame.get(12)?, *frame.get(13)?]);
    match ethertype {
        EtherType::IPV4 => {
            let h: &[u8; ipv4::MIN_HEADER_LEN] = frame.get(L3..L3 + ipv4::MIN_HEADER_LEN)?.try_into().ok()?;
            // Version 4, IHL 5: no options.
            if h[0] != 0x45 {
                return None;
            }
            let end = L3 + usize::from(u16::from_be_bytes([h[2], h[3]]));
            // More-fragments or an offset: a fragment (RFC 791 3.1).
            if end < L3 + ipv4::MIN_HEADER_LEN || end > frame.len() || h[6] & 0x3f != 0 || h[7] != 0 {
                return None;
            }
            let proto = h[9];
            if proto != proto::TCP && proto != proto::UDP {
                return None;
            }
            if checksum::fold(checksum::sum(h, 0)) != 0xffff {
                return None;
            }
            let l4 = L3 + ipv4::MIN_HEADER_LEN;
            let l4info = transport::<Ipv4Addr>(frame.get(l4..end)?, proto).ok()?;
            let src = Ipv4Addr::new(h[12], h[13], h[14], h[15]);
            let dst = Ipv4Addr::new(h[16], h[17], h[18], h[19]);
            Some(Parsed::V4(IpPacket { l3: L3, l4, end, src, dst, proto, hop_limit: h[8], frag: Frag::None, l4info }))
        }
        EtherType::IPV6 => {
            let h: &[u8; ipv6::HEADER_LEN] = frame.get(L3..L3 + ipv6::HEADER_LEN)?.try_into().ok()?;
            let proto = h[6];
            if h[0] >> 4 != 6 || (proto != proto::TCP && proto != proto::UDP) {
                return None;
            }
            let l4 = L3 + ipv6::HEADER_LEN;
            let end = l4 + usize::from(u16::from_be_bytes([h[4], h[5]]));
            let l4info = transport::<Ipv6Addr>(frame.get(l4..end)?, proto).ok()?;
            let mut a = [0u8; 16];
            a.copy_from_slice(&h[8..24]);
            let src = Ipv6Addr::from(a);
            a.copy_from_slice(&h[24..40]);
            let dst = Ipv6Addr::from(a);
            Some(Parsed::V6(IpPacket { l3: L3, l4, end, src, dst, proto, hop_limit: h[7], frag: Frag::None, l4info }))
        }
        _ => None,
    }
}

/// Reads any frame: VLAN tags, IPv4 options, IPv6 extension headers,
/// fragments, ICMP, ARP; malformed frames get their named reason.
fn dissect_any(frame: &[u8]) -> Result<Parsed, DropReason> {
    let l2 = ethernet::l2_info(frame).map_err(|_| DropReason::MalformedEthernet)?;
    match l2.ethertype {
        EtherType::IPV4 => dissect_v4(frame, l2.l3_offset).map(Parsed::V4),
        EtherType::IPV6 => dissect_v6(frame, l2.l3_offset).map(Parsed::V6),
        EtherType::ARP => Ok(Parsed::Arp),
        other => Ok(Parsed::Other(other)),
    }
}

fn dissect_v4(frame: &[u8], l3: usize) -> Result<IpPacket<Ipv4Addr>, DropReason> {
    let ip = ipv4::Packet::new_checked(&frame[l3..]).map_err(|_| DropReason::MalformedIpv4)?;
    if !ip.verify_checksum() {
        return Err(DropReason::BadIpv4Checksum);
    }
    let l4 = l3 + ip.header_len();
    let end = l3 + usize::from(ip.total_len());
    let frag = if !ip.is_fragment() {
        Frag::None
    } else if ip.frag_offset() == 0 {
        Frag::First { ident: u32::from(ip.ident()), key_proto: ip.protocol() }
    } else {
        Frag::Later { ident: u32::from(ip.ident()), key_proto: ip.protocol() }
    };
    let mut p = IpPacket {
        l3,
        l4,
        end,
        src: ip.src_addr(),
        dst: ip.dst_addr(),
        proto: ip.protocol(),
        hop_limit: ip.ttl(),
        frag,
        l4info: L4::Opaque,
    };
    p.l4info = match frag {
        Frag::None => transport::<Ipv4Addr>(&frame[l4..end], p.proto)?,
        Frag::First { .. } => first_fragment_transport::<Ipv4Addr>(&frame[l4..end], p.proto)?,
        Frag::Later { .. } => L4::Opaque,
    };
    Ok(p)
}

fn dissect_v6(frame: &[u8], l3: usize) -> Result<IpPacket<Ipv6Addr>, DropReason> {
    let ip = ipv6::Packet::new_checked(&frame[l3..]).map_err(|_| DropReason::MalformedIpv6)?;
    let upper = ipv6::walk_extensions(&ip).map_err(|_| DropReason::MalformedIpv6)?;
    let end = l3 + ip.total_len();
    let l4 = l3 + upper.l4_offset;
    let frag = match upper.fragment {
        None => Frag::None,
        Some(f) if f.is_atomic() => Frag::None,
        Some(f) if f.is_first() => Frag::First { ident: f.ident, key_proto: f.next_header },
        Some(f) => Frag::Later { ident: f.ident, key_proto: f.next_header },
    };
    let mut p = IpPacket {
        l3,
        l4,
        end,
        src: ip.src_addr(),
        dst: ip.dst_addr(),
        proto: upper.protocol,
        hop_limit: ip.hop_limit(),
        frag,
        l4info: L4::Opaque,
    };
    if l4 <= end {
        p.l4info = match frag {
            Frag::None => transport::<Ipv6Addr>(&frame[l4..end], p.proto)?,
            Frag::First { .. } => first_fragment_transport::<Ipv6Addr>(&frame[l4..end], p.proto)?,
            Frag::Later { .. } => L4::Opaque,
        };
    }
    Ok(p)
}

/// Reads the transport header of a first fragment: its length fields
/// describe the whole datagram, not this fragment, so only the header itself
/// must be here (RFC 791 requires the first fragment to hold the whole
/// transport header; RFC 8200 4.5 the whole header chain).
pub fn first_fragment_transport<A: NatAddr>(l4: &[u8], protocol: u8) -> Result<L4, DropReason> {
    match protocol {
        proto::UDP => {
            if l4.len() < udp::HEADER_LEN {
                return Err(DropReason::MalformedUdp);
            }
            let u = udp::Packet::new_unchecked(l4);
            Ok(L4::Ports { sport: u.src_port(), dport: u.dst_port(), tcp_flags: 0, csum: u.checksum() })
        }
        proto::TCP => {
            let t = tcp::Packet::new_checked(l4).map_err(|_| DropReason::MalformedTcp)?;
            Ok(L4::Ports { sport: t.src_port(), dport: t.dst_port(), tcp_flags: t.flags(), csum: t.checksum() })
        }
        // An ICMP message is checksummed and read whole: fragmented ones are
        // only translated as echo by their header (8 bytes).
        p if p == A::ICMP_PROTO => {
            if l4.len() < 8 {
                return Err(DropReason::MalformedIcmp);
            }
            let echo_request = if A::IS_V6 { icmpv6::MsgType::ECHO_REQUEST } else { icmpv4::MsgType::ECHO_REQUEST };
            let echo_reply = if A::IS_V6 { icmpv6::MsgType::ECHO_REPLY } else { icmpv4::MsgType::ECHO_REPLY };
            let ident = u16::from_be_bytes([l4[4], l4[5]]);
            Ok(match l4[0] {
                t if t == echo_request => L4::Echo { ident, request: true },
                t if t == echo_reply => L4::Echo { ident, request: false },
                t => L4::IcmpOther { msg_type: t },
            })
        }
        _ => Ok(L4::Opaque),
    }
}

/// Reads a transport header (also used for the header embedded in an ICMP error).
pub fn transport<A: NatAddr>(l4: &[u8], protocol: u8) -> Result<L4, DropReason> {
    Ok(match protocol {
        proto::TCP => {
            let t = tcp::Packet::new_checked(l4).map_err(|_| DropReason::MalformedTcp)?;
            L4::Ports { sport: t.src_port(), dport: t.dst_port(), tcp_flags: t.flags(), csum: t.checksum() }
        }
        proto::UDP => {
            let u = udp::Packet::new_checked(l4).map_err(|_| DropReason::MalformedUdp)?;
            if A::IS_V6 && u.checksum() == 0 {
                // RFC 8200 8.1: a zero UDP checksum over IPv6 is invalid.
                return Err(DropReason::MalformedUdp);
            }
            L4::Ports { sport: u.src_port(), dport: u.dst_port(), tcp_flags: 0, csum: u.checksum() }
        }
        proto::ICMP if !A::IS_V6 => {
            let i = icmpv4::Packet::new_checked(l4).map_err(|_| DropReason::MalformedIcmp)?;
            match i.msg_type() {
                icmpv4::MsgType::ECHO_REQUEST => L4::Echo { ident: i.echo_ident(), request: true },
                icmpv4::MsgType::ECHO_REPLY => L4::Echo { ident: i.echo_ident(), request: false },
                t if icmpv4::is_error(t) => L4::IcmpError { msg_type: t },
                t => L4::IcmpOther { msg_type: t },
            }
        }
        proto::ICMPV6 if A::IS_V6 => {
            let i = icmpv6::Packet::new_checked(l4).map_err(|_| DropReason::MalformedIcmp)?;
            match i.msg_type() {
                icmpv6::MsgType::ECHO_REQUEST => L4::Echo { ident: i.echo_ident(), request: true },
                icmpv6::MsgType::ECHO_REPLY => L4::Echo { ident: i.echo_ident(), request: false },
                icmpv6::MsgType::NEIGHBOR_SOLICIT => L4::NeighborSolicit,
                t if icmpv6::is_error(t) => L4::IcmpError { msg_type: t },
                t => L4::IcmpOther { msg_type: t },
            }
        }
        _ => L4::Opaque,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures;

    /// Every frame of every fixture scenario, then each of them with every
    /// header byte (the first 80) flipped and cut at every length: wherever
    /// the one-pass reader answers, it answers exactly what the full walk does.
    #[test]
    fn common_case_agrees_with_the_full_walk() {
        let frames: Vec<Vec<u8>> =
            fixtures::scenarios().into_iter().flat_map(|s| s.steps.into_iter().map(|st| st.frame)).collect();
        let (mut taken, mut checked) = (0u32, 0u32);
        let mut check = |f: &[u8]| {
            checked += 1;
            if let Some(p) = common_case(f) {
                taken += 1;
                assert_eq!(Ok(p), dissect_any(f), "frame {}", fixtures::hex(f));
            }
        };
        for f in &frames {
            check(f);
            for i in 0..f.len().min(80) {
                for bit in [0x01u8, 0x10, 0x80, 0xff] {
                    let mut m = f.clone();
                    m[i] ^= bit;
                    check(&m);
                }
            }
            for cut in 0..f.len() {
                check(&f[..cut]);
            }
        }
        // The fixtures are mostly plain TCP/UDP: the fast reader must have
        // been the one answering for many of them.
        assert!(taken > 1000 && checked > 10_000, "taken {taken} of {checked}");
    }
}
