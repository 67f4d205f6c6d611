//! Answers ARP requests (RFC 826) and IPv6 Neighbor Solicitations (RFC 4861)
//! for the addresses this gateway owns, by rewriting the received frame in
//! place into the reply; and builds the announcements sent when an address
//! is taken over: gratuitous ARP (RFC 5227 2.3) and unsolicited Neighbor
//! Advertisements (RFC 4861 7.2.6).
//!
//! It also answers ICMP echo requests (RFC 792, RFC 4443 4.1) for the
//! egress IPs ([`answer_echo_v4`], [`answer_echo_v6`]): a common health
//! check, and the kernel, which does not own those addresses, cannot.
//!
//! Replies keep the request's VLAN tag. They are sent back out of the
//! receiving interface (`engine::Verdict::Answer`). Whether an address is
//! owned is the caller's question (`owns`), asked only for requests that
//! target an address.

use std::net::{Ipv4Addr, Ipv6Addr};

use crate::wire::ethernet::{self, Frame};
use crate::wire::icmpv6::{self, ndp};
use crate::wire::{arp, icmpv4, ipv4, ipv6, Error, EtherType, EthernetAddress, IpProtocol, Layer};

/// What the responder did with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeighOutcome {
    /// The buffer now holds the reply, `len` bytes long, to send back out of
    /// the receiving interface.
    Answered {
        /// Length of the reply frame.
        len: usize,
    },
    /// Not a request for an address we own (another EtherType, another
    /// message, another target, a reply, an announcement): left untouched.
    NotOurs,
    /// A request that fails validation; left untouched.
    Malformed(Error),
}

/// Length of the IPv6 part of a Neighbor Advertisement with a target
/// link-layer address option: 40 + 24 + 8.
const NA_IPV6_LEN: usize = ipv6::HEADER_LEN + ndp::HEADER_LEN + ndp::LL_ADDR_OPTION_LEN;

/// ff02::1, all nodes (RFC 4291 2.7.1).
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

macro_rules! malformed {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return NeighOutcome::Malformed(e),
        }
    };
}

/// Turns an ARP request for an owned IPv4 address into the reply, in place
/// (RFC 826, "packet reception"): Ethernet destination = the requester,
/// source = `our_mac`; operation reply; sender = (`our_mac`, the owned
/// address); target = the requester's addresses. An ARP probe (sender IP
/// 0.0.0.0, RFC 5227 2.1.1) is answered the same way, which defends the
/// address. Requests for other addresses, replies and announcements
/// (sender IP = target IP) are [`NeighOutcome::NotOurs`].
///
/// `frame[..len]` is the received frame; the reply is `l3_offset + 28`
/// bytes (42, or 46 with a VLAN tag), which never exceeds the request.
pub fn answer_arp(
    frame: &mut [u8],
    len: usize,
    our_mac: EthernetAddress,
    owns: impl Fn(Ipv4Addr) -> bool,
) -> NeighOutcome {
    let have = frame.len();
    let Some(frame) = frame.get_mut(..len) else {
        return NeighOutcome::Malformed(Error::Truncated { layer: Layer::Ethernet, need: len, have });
    };
    let l2 = malformed!(ethernet::l2_info(frame));
    if l2.ethertype != EtherType::ARP {
        return NeighOutcome::NotOurs;
    }
    let l3 = l2.l3_offset;
    let (requester_mac, requester_ip, target_ip) = {
        let request = malformed!(arp::Packet::new_checked(&frame[l3..]));
        if request.operation() != arp::Operation::REQUEST {
            return NeighOutcome::NotOurs;
        }
        let (sender_ip, target_ip) = (request.sender_protocol_addr(), request.target_protocol_addr());
        if sender_ip == target_ip || !owns(target_ip) {
            return NeighOutcome::NotOurs;
        }
        let sender_mac = request.sender_hardware_addr();
        if !sender_mac.is_unicast() {
            return NeighOutcome::Malformed(Error::ArpSenderNotUnicast { mac: sender_mac });
        }
        (sender_mac, sender_ip, target_ip)
    };
    let mut eth = Frame::new_unchecked(&mut frame[..]);
    eth.set_dst_addr(requester_mac);
    eth.set_src_addr(our_mac);
    let reply_len = l3 + arp::PACKET_LEN;
    let mut reply = arp::Packet::new_unchecked(&mut frame[l3..reply_len]);
    reply.set_operation(arp::Operation::REPLY);
    reply.set_sender_hardware_addr(our_mac);
    reply.set_sender_protocol_addr(target_ip);
    reply.set_target_hardware_addr(requester_mac);
    reply.set_target_protocol_addr(requester_ip);
    NeighOutcome::Answered { len: reply_len }
}

/// Turns a Neighbor Solicitation for an owned IPv6 address into the Neighbor
/// Advertisement, in the same buffer.
///
/// `buf[..len]` is the received frame; `buf.len()` is the frame buffer's
/// capacity: the advertisement (86 bytes, 90 with a VLAN tag) may be longer
/// than the solicitation, and [`Error::BufferTooSmall`] is returned if it
/// does not fit.
///
/// Validation (RFC 4861 7.1.1): hop limit 255, ICMPv6 code 0, a valid
/// checksum, a target that is not multicast, no option of length 0; from the
/// unspecified source (Duplicate Address Detection) the destination must be
/// a solicited-node address and there must be no source link-layer address
/// option. Fragmented solicitations are not answered (RFC 6980). Only
/// solicitations whose target is owned are validated; any other is
/// [`NeighOutcome::NotOurs`] without further checks.
///
/// The advertisement (RFC 4861 7.2.4): IPv6 source = the target, hop limit
/// 255, Override set, Router clear (the gateway owns the address; it does
/// not advertise itself as a router for it), a target link-layer address
/// option with `our_mac`. To a solicitation from an address: Solicited set,
/// sent to that address and to the link-layer address of its source
/// link-layer option, or else the frame's Ethernet source. To a DAD
/// solicitation (source `::`): Solicited clear, sent to ff02::1
/// (33:33:00:00:00:01).
pub fn answer_neighbor_solicit(
    buf: &mut [u8],
    len: usize,
    our_mac: EthernetAddress,
    owns: impl Fn(&Ipv6Addr) -> bool,
) -> NeighOutcome {
    let capacity = buf.len();
    let Some(frame) = buf.get(..len) else {
        return NeighOutcome::Malformed(Error::Truncated { layer: Layer::Ethernet, need: len, have: capacity });
    };
    let l2 = malformed!(ethernet::l2_info(frame));
    if l2.ethertype != EtherType::IPV6 {
        return NeighOutcome::NotOurs;
    }
    let ip = malformed!(ipv6::Packet::new_checked(&frame[l2.l3_offset..]));
    let upper = malformed!(ipv6::walk_extensions(&ip));
    if upper.protocol != IpProtocol::ICMPV6 || upper.fragment.is_some() {
        return NeighOutcome::NotOurs;
    }
    let message = ip.upper_layer(upper.l4_offset);
    let icmp = malformed!(icmpv6::Packet::new_checked(message));
    if icmp.msg_type() != icmpv6::MsgType::NEIGHBOR_SOLICIT {
        return NeighOutcome::NotOurs;
    }
    let ns = malformed!(ndp::Packet::new_checked(message));
    let target = ns.target_addr();
    if !owns(&target) {
        return NeighOutcome::NotOurs;
    }

    // RFC 4861 7.1.1: validation of Neighbor Solicitations.
    if ip.hop_limit() != 255 {
        return NeighOutcome::Malformed(Error::NdpBadHopLimit { hop_limit: ip.hop_limit() });
    }
    if icmp.code() != 0 {
        return NeighOutcome::Malformed(Error::NdpBadCode { code: icmp.code() });
    }
    let (src, dst) = (ip.src_addr(), ip.dst_addr());
    if !icmp.verify_checksum(&src, &dst) {
        return NeighOutcome::Malformed(Error::BadChecksum { layer: Layer::Icmpv6, checksum: icmp.checksum() });
    }
    if target.is_multicast() {
        return NeighOutcome::Malformed(Error::NdpMulticastTarget { target });
    }
    let mut source_ll = None;
    for option in ns.options() {
        let option = malformed!(option);
        if option.option_type == ndp::OPT_SOURCE_LL_ADDR && source_ll.is_none() {
            source_ll = option.link_layer_addr();
        }
    }
    let (dst_mac, dst_ip, flags) = if src.is_unspecified() {
        if !is_solicited_node(&dst) {
            return NeighOutcome::Malformed(Error::NdpDadNotToSolicitedNode { dst });
        }
        if source_ll.is_some() {
            return NeighOutcome::Malformed(Error::NdpSourceLinkAddrFromUnspecified);
        }
        // RFC 4861 7.2.4: to the all-nodes address, Solicited clear.
        (EthernetAddress::from_ipv6_multicast(&ALL_NODES), ALL_NODES, ndp::FLAG_OVERRIDE)
    } else {
        let mac = source_ll.unwrap_or_else(|| Frame::new_unchecked(frame).src_addr());
        (mac, src, ndp::FLAG_SOLICITED | ndp::FLAG_OVERRIDE)
    };

    let l3 = l2.l3_offset;
    let reply_len = l3 + NA_IPV6_LEN;
    if capacity < reply_len {
        return NeighOutcome::Malformed(Error::BufferTooSmall { need: reply_len, have: capacity });
    }
    // The Ethernet header (and VLAN tag, EtherType) stays; only the MACs change.
    let mut eth = Frame::new_unchecked(&mut buf[..]);
    eth.set_dst_addr(dst_mac);
    eth.set_src_addr(our_mac);
    write_neighbor_advert(&mut buf[l3..reply_len], &target, &dst_ip, flags, our_mac);
    NeighOutcome::Answered { len: reply_len }
}

/// Hop limit / TTL of echo replies (RFC 1700's default TTL, as Linux).
const ECHO_REPLY_TTL: u8 = 64;

/// Swaps the Ethernet source and destination: a reply goes back to the
/// link-layer sender of the request.
fn swap_macs(frame: &mut [u8]) {
    let mut f = Frame::new_unchecked(frame);
    let (src, dst) = (f.src_addr(), f.dst_addr());
    f.set_dst_addr(src);
    f.set_src_addr(dst);
}

/// Turns an ICMP echo request (RFC 792 "Echo or Echo Reply Message") for an
/// owned address into the reply, in place: the IPv4 addresses swapped (the
/// header and its options kept), TTL 64, type 0, the data echoed, both
/// checksums recomputed; the MACs swapped. `l3`, `l4` and `end` are the
/// request's IP header, ICMP header and datagram end offsets as dissected.
/// A request with a bad ICMP checksum, or from a source no reply may go to
/// (multicast, broadcast, unspecified; RFC 1122 3.2.2.6), is
/// [`NeighOutcome::Malformed`] / [`NeighOutcome::NotOurs`] and left as is.
pub fn answer_echo_v4(frame: &mut [u8], l3: usize, l4: usize, end: usize) -> NeighOutcome {
    let have = frame.len();
    if l4 + icmpv4::HEADER_LEN > end || end > have || l3 + 20 > l4 {
        return NeighOutcome::Malformed(Error::Truncated { layer: Layer::Icmpv4, need: l4 + icmpv4::HEADER_LEN, have });
    }
    {
        let icmp = icmpv4::Packet::new_unchecked(&frame[l4..end]);
        if icmp.msg_type() != icmpv4::MsgType::ECHO_REQUEST {
            return NeighOutcome::NotOurs;
        }
        if !icmp.verify_checksum() {
            return NeighOutcome::Malformed(Error::BadChecksum { layer: Layer::Icmpv4, checksum: icmp.checksum() });
        }
    }
    let mut ip = ipv4::Packet::new_unchecked(&mut frame[l3..l4]);
    let (src, dst) = (ip.src_addr(), ip.dst_addr());
    if src.is_multicast() || src.is_broadcast() || src.is_unspecified() {
        return NeighOutcome::NotOurs;
    }
    ip.set_src_addr(dst);
    ip.set_dst_addr(src);
    ip.set_ttl(ECHO_REPLY_TTL);
    ip.fill_checksum();
    let mut icmp = icmpv4::Packet::new_unchecked(&mut frame[l4..end]);
    icmp.set_msg_type(icmpv4::MsgType::ECHO_REPLY);
    icmp.set_code(0);
    icmp.fill_checksum();
    swap_macs(frame);
    NeighOutcome::Answered { len: end }
}

/// The ICMPv6 counterpart (RFC 4443 4.2): addresses swapped, hop limit 64,
/// type 129, checksum over the new pseudo-header. Only a request whose
/// ICMPv6 header follows the fixed header is answered (a reply must not
/// carry the request's routing or options headers back); others are
/// [`NeighOutcome::NotOurs`].
pub fn answer_echo_v6(frame: &mut [u8], l3: usize, l4: usize, end: usize) -> NeighOutcome {
    let have = frame.len();
    if l4 != l3 + ipv6::HEADER_LEN {
        return NeighOutcome::NotOurs;
    }
    if l4 + icmpv6::HEADER_LEN > end || end > have {
        return NeighOutcome::Malformed(Error::Truncated { layer: Layer::Icmpv6, need: l4 + icmpv6::HEADER_LEN, have });
    }
    let (src, dst) = {
        let ip = ipv6::Packet::new_unchecked(&frame[l3..l4]);
        (ip.src_addr(), ip.dst_addr())
    };
    {
        let icmp = icmpv6::Packet::new_unchecked(&frame[l4..end]);
        if icmp.msg_type() != icmpv6::MsgType::ECHO_REQUEST {
            return NeighOutcome::NotOurs;
        }
        if !icmp.verify_checksum(&src, &dst) {
            return NeighOutcome::Malformed(Error::BadChecksum { layer: Layer::Icmpv6, checksum: icmp.checksum() });
        }
    }
    if src.is_multicast() || src.is_unspecified() {
        return NeighOutcome::NotOurs;
    }
    {
        let mut ip = ipv6::Packet::new_unchecked(&mut frame[l3..l4]);
        ip.set_src_addr(&dst);
        ip.set_dst_addr(&src);
        ip.set_hop_limit(ECHO_REPLY_TTL);
    }
    let mut icmp = icmpv6::Packet::new_unchecked(&mut frame[l4..end]);
    icmp.set_msg_type(icmpv6::MsgType::ECHO_REPLY);
    icmp.set_code(0);
    icmp.fill_checksum(&dst, &src);
    swap_macs(frame);
    NeighOutcome::Answered { len: end }
}

/// Writes a broadcast gratuitous ARP announcement for `ip` into `buf`
/// (RFC 5227 2.3 "ARP Announcement": a request with sender and target
/// protocol address both `ip`, target hardware address zero) and returns
/// its length: 42, or 46 with a VLAN tag.
pub fn gratuitous_arp(
    buf: &mut [u8],
    mac: EthernetAddress,
    ip: Ipv4Addr,
    vlan_tci: Option<u16>,
) -> crate::wire::Result<usize> {
    let need = l2_len(vlan_tci) + arp::PACKET_LEN;
    if buf.len() < need {
        return Err(Error::BufferTooSmall { need, have: buf.len() });
    }
    let l3 = ethernet::write_header(buf, EthernetAddress::BROADCAST, mac, vlan_tci, EtherType::ARP)?;
    let mut a = arp::Packet::new_unchecked(&mut buf[l3..need]);
    a.set_ethernet_ipv4();
    a.set_operation(arp::Operation::REQUEST);
    a.set_sender_hardware_addr(mac);
    a.set_sender_protocol_addr(ip);
    a.set_target_hardware_addr(EthernetAddress::ZERO);
    a.set_target_protocol_addr(ip);
    Ok(need)
}

/// Writes an unsolicited Neighbor Advertisement for `ip` into `buf` (RFC
/// 4861 7.2.6): from `ip` to ff02::1, Override set, Solicited and Router
/// clear, with a target link-layer address option; returns its length: 86,
/// or 90 with a VLAN tag.
pub fn unsolicited_na(
    buf: &mut [u8],
    mac: EthernetAddress,
    ip: Ipv6Addr,
    vlan_tci: Option<u16>,
) -> crate::wire::Result<usize> {
    let need = l2_len(vlan_tci) + NA_IPV6_LEN;
    if buf.len() < need {
        return Err(Error::BufferTooSmall { need, have: buf.len() });
    }
    let dst_mac = EthernetAddress::from_ipv6_multicast(&ALL_NODES);
    let l3 = ethernet::write_header(buf, dst_mac, mac, vlan_tci, EtherType::IPV6)?;
    write_neighbor_advert(&mut buf[l3..need], &ip, &ALL_NODES, ndp::FLAG_OVERRIDE, mac);
    Ok(need)
}

fn l2_len(vlan_tci: Option<u16>) -> usize {
    if vlan_tci.is_some() {
        ethernet::VLAN_HEADER_LEN
    } else {
        ethernet::HEADER_LEN
    }
}

/// Writes the IPv6 header and a Neighbor Advertisement for `target` with a
/// target link-layer address option into `out`, exactly [`NA_IPV6_LEN`] bytes.
fn write_neighbor_advert(out: &mut [u8], target: &Ipv6Addr, dst: &Ipv6Addr, flags: u8, mac: EthernetAddress) {
    let na_len = NA_IPV6_LEN - ipv6::HEADER_LEN;
    let mut ip = ipv6::Packet::new_unchecked(&mut out[..]);
    ip.set_version_tc_flow(0, 0);
    ip.set_payload_len(na_len as u16);
    ip.set_next_header(IpProtocol::ICMPV6);
    ip.set_hop_limit(255);
    ip.set_src_addr(target);
    ip.set_dst_addr(dst);
    let message = &mut out[ipv6::HEADER_LEN..NA_IPV6_LEN];
    let mut icmp = icmpv6::Packet::new_unchecked(&mut message[..]);
    icmp.set_msg_type(icmpv6::MsgType::NEIGHBOR_ADVERT);
    icmp.set_code(0);
    let mut na = ndp::Packet::new_unchecked(&mut message[..]);
    na.set_flags(flags);
    na.set_target_addr(target);
    let option = &mut na.options_mut()[..ndp::LL_ADDR_OPTION_LEN];
    option[0] = ndp::OPT_TARGET_LL_ADDR;
    option[1] = 1;
    option[2..].copy_from_slice(&mac.0);
    icmpv6::Packet::new_unchecked(&mut message[..]).fill_checksum(target, dst);
}

/// ff02::1:ffXX:XXXX (RFC 4291 2.7.1).
fn is_solicited_node(addr: &Ipv6Addr) -> bool {
    const PREFIX: [u8; 13] = [0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0xff];
    addr.octets()[..13] == PREFIX
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testdata::{self, hex, vlan_tag};
    use proptest::prelude::*;

    const MAC_A: EthernetAddress = EthernetAddress([2, 0, 0, 0, 0x0a, 0x01]);
    const MAC_R: EthernetAddress = EthernetAddress([2, 0, 0, 0, 0x0a, 0xfe]);

    fn v6(s: &str) -> Ipv6Addr {
        s.parse().unwrap()
    }

    /// The frame in a 2048-byte buffer, as in the UMEM.
    fn umem(frame: &[u8]) -> Vec<u8> {
        let mut buf = vec![0u8; 2048];
        buf[..frame.len()].copy_from_slice(frame);
        buf
    }

    /// Recomputes the ICMPv6 checksum of an untagged test frame after a test
    /// edited it (so that the edit, not the checksum, is what fails).
    fn fix_icmpv6_checksum(frame: &mut [u8]) {
        let ip = ipv6::Packet::new_checked(&frame[14..]).unwrap();
        let (src, dst, end) = (ip.src_addr(), ip.dst_addr(), ip.total_len());
        icmpv6::Packet::new_checked(&mut frame[14 + 40..14 + end]).unwrap().fill_checksum(&src, &dst);
    }

    /// Checks an NA frame with etherparse, independently of our code.
    fn etherparse_valid_na(frame: &[u8]) -> etherparse::Icmpv6Type {
        let sliced = etherparse::SlicedPacket::from_ethernet(frame).unwrap();
        let Some(etherparse::NetSlice::Ipv6(ip)) = sliced.net else { panic!("not IPv6") };
        let Some(etherparse::TransportSlice::Icmpv6(icmp)) = sliced.transport else { panic!("not ICMPv6") };
        assert!(icmp.is_checksum_valid(ip.header().source(), ip.header().destination()));
        assert_eq!(ip.header().hop_limit(), 255);
        icmp.icmp_type()
    }

    #[test]
    fn arp_request_becomes_the_reply_linux_sent() {
        let mut buf = umem(&hex(testdata::ARP_REQUEST));
        let out = answer_arp(&mut buf, 42, MAC_R, |ip| ip == Ipv4Addr::new(192, 0, 2, 254));
        assert_eq!(out, NeighOutcome::Answered { len: 42 });
        assert_eq!(&buf[..42], &hex(testdata::ARP_REPLY_LINUX)[..]);

        let mut buf = umem(&hex(testdata::ARP_REQUEST_FROM_ROUTER));
        let out = answer_arp(&mut buf, 42, MAC_A, |ip| ip == Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(out, NeighOutcome::Answered { len: 42 });
        assert_eq!(&buf[..42], &hex(testdata::ARP_REPLY_TO_ROUTER)[..]);
    }

    #[test]
    fn padded_and_tagged_requests() {
        let padded = hex(testdata::ARP_REQUEST_PADDED);
        let mut buf = padded.clone();
        let out = answer_arp(&mut buf, 58, MAC_R, |ip| ip == Ipv4Addr::new(192, 0, 2, 254));
        assert_eq!(out, NeighOutcome::Answered { len: 42 });
        assert_eq!(&buf[..42], &hex(testdata::ARP_REPLY_LINUX)[..]);

        let tagged = vlan_tag(&hex(testdata::ARP_REQUEST), 0x8100, 0x2064);
        let mut buf = umem(&tagged);
        let out = answer_arp(&mut buf, tagged.len(), MAC_R, |_| true);
        assert_eq!(out, NeighOutcome::Answered { len: 46 });
        assert_eq!(&buf[..46], &vlan_tag(&hex(testdata::ARP_REPLY_LINUX), 0x8100, 0x2064)[..]);
    }

    #[test]
    fn arp_not_ours() {
        let req = hex(testdata::ARP_REQUEST);
        let mut buf = req.clone();
        assert_eq!(answer_arp(&mut buf, 42, MAC_R, |_| false), NeighOutcome::NotOurs);
        assert_eq!(buf, req, "untouched");
        // A reply, even about an owned address.
        let mut buf = hex(testdata::ARP_REPLY_LINUX);
        assert_eq!(answer_arp(&mut buf, 42, MAC_R, |_| true), NeighOutcome::NotOurs);
        // A gratuitous announcement by another host of an address we "own".
        let mut buf = hex(testdata::ARP_GRATUITOUS);
        assert_eq!(answer_arp(&mut buf, 58, MAC_R, |_| true), NeighOutcome::NotOurs);
        // Not ARP at all.
        let mut buf = hex(testdata::ICMP_ECHO_REQUEST);
        assert_eq!(answer_arp(&mut buf, 98, MAC_R, |_| true), NeighOutcome::NotOurs);
    }

    #[test]
    fn arp_malformed() {
        let req = hex(testdata::ARP_REQUEST);
        let mut buf = req.clone();
        assert_eq!(
            answer_arp(&mut buf, 41, MAC_R, |_| true),
            NeighOutcome::Malformed(Error::Truncated { layer: Layer::Arp, need: 28, have: 27 })
        );
        assert_eq!(
            answer_arp(&mut buf, 43, MAC_R, |_| true),
            NeighOutcome::Malformed(Error::Truncated { layer: Layer::Ethernet, need: 43, have: 42 })
        );
        let mut bad = req.clone();
        bad[14 + 4] = 8; // hlen 8
        assert_eq!(
            answer_arp(&mut bad, 42, MAC_R, |_| true),
            NeighOutcome::Malformed(Error::UnsupportedArpHardware { htype: 1, ptype: 0x0800, hlen: 8, plen: 4 })
        );
        let mut bcast_sender = req.clone();
        bcast_sender[14 + 8..14 + 14].copy_from_slice(&[0xff; 6]);
        assert_eq!(
            answer_arp(&mut bcast_sender, 42, MAC_R, |_| true),
            NeighOutcome::Malformed(Error::ArpSenderNotUnicast { mac: EthernetAddress::BROADCAST })
        );
        let mut qinq = vlan_tag(&vlan_tag(&req, 0x8100, 1), 0x88a8, 2);
        let n = qinq.len();
        assert_eq!(
            answer_arp(&mut qinq, n, MAC_R, |_| true),
            NeighOutcome::Malformed(Error::StackedVlan { tpid: 0x8100 })
        );
    }

    #[test]
    fn arp_probe_is_answered() {
        // RFC 5227 probe: sender IP 0.0.0.0. The reply goes to the prober's MAC
        // with target IP 0.0.0.0, which tells it the address is taken.
        let mut probe = hex(testdata::ARP_REQUEST);
        probe[14 + 14..14 + 18].copy_from_slice(&[0, 0, 0, 0]);
        let out = answer_arp(&mut probe, 42, MAC_R, |ip| ip == Ipv4Addr::new(192, 0, 2, 254));
        assert_eq!(out, NeighOutcome::Answered { len: 42 });
        let mut expected = hex(testdata::ARP_REPLY_LINUX);
        expected[14 + 24..14 + 28].copy_from_slice(&[0, 0, 0, 0]);
        assert_eq!(&probe[..42], &expected[..]);
    }

    #[test]
    fn ns_becomes_the_na_linux_sent() {
        let ns = hex(testdata::NS_LINK_LOCAL);
        let mut buf = umem(&ns);
        let target = v6("2001:db8:a::77");
        let out = answer_neighbor_solicit(&mut buf, ns.len(), MAC_A, |t| *t == target);
        assert_eq!(out, NeighOutcome::Answered { len: 86 });
        assert_eq!(&buf[..86], &hex(testdata::NA_LINUX)[..]);
        assert_eq!(
            etherparse_valid_na(&buf[..86]),
            etherparse::Icmpv6Type::NeighborAdvertisement(etherparse::icmpv6::NeighborAdvertisementHeader {
                router: false,
                solicited: true,
                r#override: true,
            })
        );
    }

    #[test]
    fn ns_from_global_address() {
        let ns = hex(testdata::NS_GLOBAL);
        let mut buf = umem(&ns);
        let out = answer_neighbor_solicit(&mut buf, ns.len(), MAC_R, |t| *t == v6("2001:db8:a::fe"));
        assert_eq!(out, NeighOutcome::Answered { len: 86 });
        etherparse_valid_na(&buf[..86]);
        // Same as the Linux router's NA but without the Router flag.
        let mut expected = hex(testdata::NA_ROUTER_LINUX);
        expected[14 + 40 + 4] = 0x60;
        fix_icmpv6_checksum(&mut expected);
        assert_eq!(&buf[..86], &expected[..]);
        // The checksum differs from Linux's 0xfd5e by the R bit (0x8000) in
        // ones' complement arithmetic: 0xfd5e + 0x8000 = 0x7d5f.
        assert_eq!(&buf[56..58], &[0x7d, 0x5f]);
    }

    #[test]
    fn dad_ns_gets_an_na_to_all_nodes() {
        let ns = hex(testdata::NS_DAD);
        let mut buf = umem(&ns);
        let out = answer_neighbor_solicit(&mut buf, ns.len(), MAC_A, |t| *t == v6("2001:db8:a::77"));
        assert_eq!(out, NeighOutcome::Answered { len: 86 });
        // Hand-assembled; checksum 0xee2a computed separately (python).
        let expected = hex("333300000001 020000000a01 86dd \
             60000000 0020 3a ff 20010db8000a00000000000000000077 ff020000000000000000000000000001 \
             8800 ee2a 20000000 20010db8000a00000000000000000077 0201 020000000a01");
        assert_eq!(&buf[..86], &expected[..]);
        etherparse_valid_na(&buf[..86]);
    }

    #[test]
    fn tagged_ns_keeps_the_tag() {
        let ns = vlan_tag(&hex(testdata::NS_LINK_LOCAL), 0x8100, 0x0064);
        let mut buf = umem(&ns);
        let out = answer_neighbor_solicit(&mut buf, ns.len(), MAC_A, |_| true);
        assert_eq!(out, NeighOutcome::Answered { len: 90 });
        assert_eq!(&buf[..90], &vlan_tag(&hex(testdata::NA_LINUX), 0x8100, 0x0064)[..]);
        etherparse_valid_na(&buf[..90]);
    }

    #[test]
    fn ns_without_options_grows_and_needs_room() {
        // NS_GLOBAL without its SLLAO: 78 bytes; the NA is 86.
        let mut ns = hex(testdata::NS_GLOBAL)[..78].to_vec();
        ns[14 + 4..14 + 6].copy_from_slice(&24u16.to_be_bytes());
        fix_icmpv6_checksum(&mut ns);
        let mut exact = ns.clone();
        assert_eq!(
            answer_neighbor_solicit(&mut exact, 78, MAC_R, |_| true),
            NeighOutcome::Malformed(Error::BufferTooSmall { need: 86, have: 78 })
        );
        assert_eq!(exact, ns, "untouched");
        let mut buf = umem(&ns);
        assert_eq!(answer_neighbor_solicit(&mut buf, 78, MAC_R, |_| true), NeighOutcome::Answered { len: 86 });
        // No SLLAO: the NA goes to the frame's Ethernet source.
        assert_eq!(&buf[..6], &MAC_A.0);
        etherparse_valid_na(&buf[..86]);
    }

    #[test]
    fn ns_validation() {
        let ns = hex(testdata::NS_GLOBAL);
        let check = |frame: &[u8]| {
            let mut buf = umem(frame);
            answer_neighbor_solicit(&mut buf, frame.len(), MAC_R, |_| true)
        };
        let mut hop = ns.clone();
        hop[14 + 7] = 64;
        assert_eq!(check(&hop), NeighOutcome::Malformed(Error::NdpBadHopLimit { hop_limit: 64 }));
        let mut code = ns.clone();
        code[14 + 41] = 1;
        fix_icmpv6_checksum(&mut code);
        assert_eq!(check(&code), NeighOutcome::Malformed(Error::NdpBadCode { code: 1 }));
        let mut sum = ns.clone();
        sum[14 + 43] ^= 1;
        assert_eq!(check(&sum), NeighOutcome::Malformed(Error::BadChecksum { layer: Layer::Icmpv6, checksum: 0x101a }));
        let mut mcast = ns.clone();
        mcast[14 + 48..14 + 64].copy_from_slice(&v6("ff02::1").octets());
        fix_icmpv6_checksum(&mut mcast);
        assert_eq!(check(&mcast), NeighOutcome::Malformed(Error::NdpMulticastTarget { target: v6("ff02::1") }));
        let mut zero_opt = ns.clone();
        zero_opt[14 + 65] = 0;
        fix_icmpv6_checksum(&mut zero_opt);
        assert_eq!(
            check(&zero_opt),
            NeighOutcome::Malformed(Error::NdpOptionZeroLength { option_type: 1, offset: 24 })
        );
        // DAD (source ::) with a source link-layer address option.
        let mut dad_sllao = ns.clone();
        dad_sllao[14 + 8..14 + 24].copy_from_slice(&[0; 16]);
        fix_icmpv6_checksum(&mut dad_sllao);
        assert_eq!(check(&dad_sllao), NeighOutcome::Malformed(Error::NdpSourceLinkAddrFromUnspecified));
        // DAD sent to a unicast address.
        let mut dad_unicast = hex(testdata::NS_DAD);
        dad_unicast[14 + 24..14 + 40].copy_from_slice(&v6("2001:db8:a::77").octets());
        fix_icmpv6_checksum(&mut dad_unicast);
        assert_eq!(
            check(&dad_unicast),
            NeighOutcome::Malformed(Error::NdpDadNotToSolicitedNode { dst: v6("2001:db8:a::77") })
        );
        // Truncated inside the NS.
        assert_eq!(
            check(&ns[..14 + 40 + 20]),
            NeighOutcome::Malformed(Error::Truncated { layer: Layer::Ipv6, need: 72, have: 60 })
        );
    }

    #[test]
    fn ns_not_ours() {
        let check = |frame: &[u8], owns: &dyn Fn(&Ipv6Addr) -> bool| {
            let mut buf = umem(frame);
            let out = answer_neighbor_solicit(&mut buf, frame.len(), MAC_R, owns);
            assert_eq!(&buf[..frame.len()], frame, "untouched");
            out
        };
        assert_eq!(check(&hex(testdata::NS_GLOBAL), &|_| false), NeighOutcome::NotOurs);
        assert_eq!(check(&hex(testdata::NA_LINUX), &|_| true), NeighOutcome::NotOurs);
        assert_eq!(check(&hex(testdata::ICMPV6_ECHO_REQUEST), &|_| true), NeighOutcome::NotOurs);
        assert_eq!(check(&hex(testdata::MLD_REPORT_HBH), &|_| true), NeighOutcome::NotOurs);
        assert_eq!(check(&hex(testdata::ARP_REQUEST), &|_| true), NeighOutcome::NotOurs);
        assert_eq!(check(&hex(testdata::IPV6_FRAG_FIRST), &|_| true), NeighOutcome::NotOurs);
    }

    #[test]
    fn gratuitous_arp_bytes() {
        let mut buf = [0u8; 64];
        let ip = Ipv4Addr::new(203, 0, 113, 5);
        assert_eq!(gratuitous_arp(&mut buf, MAC_R, ip, None), Ok(42));
        let expected = hex("ffffffffffff 020000000afe 0806 0001 0800 06 04 0001 \
             020000000afe cb007105 000000000000 cb007105");
        assert_eq!(&buf[..42], &expected[..]);
        assert_eq!(gratuitous_arp(&mut buf, MAC_R, ip, Some(0x0064)), Ok(46));
        assert_eq!(&buf[..46], &vlan_tag(&expected, 0x8100, 0x0064)[..]);
        assert_eq!(
            gratuitous_arp(&mut buf[..45], MAC_R, ip, Some(1)),
            Err(Error::BufferTooSmall { need: 46, have: 45 })
        );
        // Other hosts see it as an announcement: our own responder ignores it.
        assert_eq!(gratuitous_arp(&mut buf, MAC_R, ip, None), Ok(42));
        assert_eq!(answer_arp(&mut buf, 42, MAC_A, |_| true), NeighOutcome::NotOurs);
    }

    #[test]
    fn unsolicited_na_bytes() {
        let mut buf = [0u8; 128];
        let ip = v6("2001:db8:a::77");
        assert_eq!(unsolicited_na(&mut buf, MAC_A, ip, None), Ok(86));
        // Hand-assembled; checksum 0xee2a computed separately
        // (python); the same bytes as the DAD answer for this address.
        let expected = hex("333300000001 020000000a01 86dd \
             60000000 0020 3a ff 20010db8000a00000000000000000077 ff020000000000000000000000000001 \
             8800 ee2a 20000000 20010db8000a00000000000000000077 0201 020000000a01");
        assert_eq!(&buf[..86], &expected[..]);
        etherparse_valid_na(&buf[..86]);
        assert_eq!(unsolicited_na(&mut buf, MAC_A, ip, Some(0x0064)), Ok(90));
        assert_eq!(&buf[..90], &vlan_tag(&expected, 0x8100, 0x0064)[..]);
        assert_eq!(unsolicited_na(&mut buf[..85], MAC_A, ip, None), Err(Error::BufferTooSmall { need: 86, have: 85 }));
    }

    proptest! {
        #[test]
        fn arbitrary_frames_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 0..120),
                                        ethertype in prop::sample::select(vec![0x0806u16, 0x86dd, 0x8100]),
                                        len in 0usize..130, capacity in 0usize..130) {
            if bytes.len() >= 14 {
                bytes[12..14].copy_from_slice(&ethertype.to_be_bytes());
            }
            let mut buf = bytes.clone();
            buf.resize(capacity.max(bytes.len()), 0);
            let cap = buf.len();
            if let NeighOutcome::Answered { len } = answer_arp(&mut buf, len, MAC_R, |_| true) {
                prop_assert!(len <= cap);
            }
            if let NeighOutcome::Answered { len } = answer_neighbor_solicit(&mut buf, len, MAC_R, |_| true) {
                prop_assert!(len <= cap);
            }
        }

        #[test]
        fn edited_ns_frames_never_panic(at in 0usize..86, value in any::<u8>(), len in 0usize..86,
                                        fix in any::<bool>()) {
            let mut ns = hex(testdata::NS_GLOBAL);
            ns[at] = value;
            if fix && ipv6::Packet::new_checked(&ns[14..]).is_ok_and(|p| (48..=72).contains(&p.total_len())) {
                fix_icmpv6_checksum(&mut ns);
            }
            let mut buf = umem(&ns);
            if let NeighOutcome::Answered { len } = answer_neighbor_solicit(&mut buf, len.max(at), MAC_R, |_| true) {
                prop_assert!(len == 86 || len == 90);
                etherparse_valid_na(&buf[..len]);
            }
        }
    }
}
