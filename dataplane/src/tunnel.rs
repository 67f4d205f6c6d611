//! Frames that worker nodes in other subnets send through Egret's VXLAN
//! tunnel (docs/adr/0031-workers-in-any-subnet.md).
//!
//! A node whose route to its next hop N crosses a router encapsulates its
//! selected pods' packets: outer IP from the Node's InternalIP to N (an
//! egress IP, or its companion next hop), UDP to the tunnel port, VXLAN
//! ([`crate::wire::vxlan`]), then the pod's Ethernet frame. The XDP
//! program checks the same things first (its tunnel rule) and either
//! translates the inner packet itself (a fast-path hit) or hands the whole
//! frame to a worker, which calls [`decapsulate`] and runs the pipeline on
//! the inner frame.
//!
//! Once a frame is recognised as the tunnel's (UDP to the tunnel port of an
//! address this gateway translates for), it is Egret's: it is translated
//! or dropped under a named reason, never passed to the kernel, never
//! answered. Only Nodes of the cluster may send it ([`Tunnel::nodes`]: the
//! gateways load every Node's InternalIPs), never on an outside interface;
//! that check replaces the `podSourceMacs` check for the inner frame, whose
//! outer link-layer sender is a router.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ahash::AHashSet;

use crate::ingress::{Ingress, IngressRole};
use crate::stats::DropReason;
use crate::tables::Tables;
use crate::wire::{checksum, ethernet, ipv4, ipv6, udp, vxlan, EtherType, IpProtocol};

/// The tunnel's settings and the addresses allowed to send into it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tunnel {
    /// The UDP destination port (`tunnel.port`).
    pub port: u16,
    /// The VXLAN VNI.
    pub vni: u32,
    /// Every Node's InternalIPs: the only outer sources accepted.
    pub nodes: AHashSet<IpAddr>,
}

impl Tunnel {
    /// Egret's VNI on `port`, accepting `nodes`.
    pub fn new(port: u16, nodes: impl IntoIterator<Item = IpAddr>) -> Self {
        Tunnel { port, vni: vxlan::EGRET_VNI, nodes: nodes.into_iter().collect() }
    }
}

/// What [`decapsulate`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decap {
    /// Not the tunnel's: the frame goes through the pipeline as it is.
    NotTunnel,
    /// The inner Ethernet frame is `buf[start..end]`.
    Inner {
        /// Where the inner Ethernet header starts.
        start: usize,
        /// Where the inner frame ends (the received frame's end: a trailer
        /// after the outer datagram stays the inner frame's, as in XDP).
        end: usize,
    },
    /// The tunnel's, refused.
    Drop(DropReason),
}

/// The outer headers of a frame that may be the tunnel's.
struct Outer {
    src: IpAddr,
    dst: IpAddr,
    /// An outer first fragment (MF set; later ones are not the tunnel's).
    fragment: bool,
    /// Where the UDP header starts, and where the IP packet ends.
    l4: usize,
    end: usize,
}

/// What a frame's raw bytes say about it being UDP to a port, before any
/// parse ([`glance`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Glance {
    /// An untagged IPv4 (no options) or IPv6 (UDP right after the fixed
    /// header) datagram to the port; its UDP header starts here.
    ToPort(usize),
    /// An untagged IPv4 or IPv6 frame that is not: never the tunnel's.
    Not,
    /// Not an untagged IP frame (a VLAN tag, ARP, ...): [`outer`] judges.
    Unknown,
}

/// Whether an untagged IP frame is UDP to `port`, read on the raw bytes
/// at fixed offsets. Every frame of a gateway with a tunnel configured
/// asks (replies included), so the frames that are not the tunnel's skip
/// [`outer`]'s parse; `Not` only where `outer` and the port test would
/// refuse the frame too (`glance_agrees_with_the_parse`). The batch's
/// staging asks it for the inner frame of a tunnel frame.
#[inline]
pub(crate) fn glance(frame: &[u8], port: u16) -> Glance {
    const V4: usize = ethernet::HEADER_LEN + ipv4::MIN_HEADER_LEN;
    const V6: usize = ethernet::HEADER_LEN + ipv6::HEADER_LEN;
    let l4 = match frame.get(12..14) {
        Some([0x08, 0x00]) => match frame.get(14..24) {
            Some(h) if h[0] == 0x45 && h[9] == IpProtocol::UDP => V4,
            _ => return Glance::Not,
        },
        Some([0x86, 0xdd]) => match frame.get(20) {
            Some(&IpProtocol::UDP) => V6,
            _ => return Glance::Not,
        },
        _ => return Glance::Unknown,
    };
    match frame.get(l4 + 2..l4 + 4) {
        Some(p) if u16::from_be_bytes([p[0], p[1]]) == port => Glance::ToPort(l4),
        _ => Glance::Not,
    }
}

/// Reads the outer Ethernet, IP (IPv4 without options, IPv6 with UDP as its
/// next header: what the XDP rule matches) and finds the UDP header. `None`
/// when the frame cannot be the tunnel's.
fn outer(frame: &[u8]) -> Option<Outer> {
    let l2 = ethernet::l2_info(frame).ok()?;
    let l3 = frame.get(l2.l3_offset..)?;
    match l2.ethertype {
        EtherType::IPV4 => {
            let ip = ipv4::Packet::new_unchecked(l3);
            let hdr = l3.get(..ipv4::MIN_HEADER_LEN)?;
            // A later fragment carries no UDP header: what sits where the
            // port would be is payload (the XDP program's rule 6 judges it).
            if hdr[0] != 0x45 || ip.protocol() != IpProtocol::UDP || ip.frag_offset() != 0 {
                return None;
            }
            let end = l2.l3_offset + usize::from(ip.total_len());
            Some(Outer {
                src: IpAddr::V4(ip.src_addr()),
                dst: IpAddr::V4(ip.dst_addr()),
                fragment: ip.is_fragment(),
                l4: l2.l3_offset + ipv4::MIN_HEADER_LEN,
                end,
            })
        }
        EtherType::IPV6 => {
            let ip = ipv6::Packet::new_unchecked(l3);
            if l3.len() < ipv6::HEADER_LEN || ip.version() != 6 || ip.next_header() != IpProtocol::UDP {
                return None;
            }
            Some(Outer {
                src: IpAddr::V6(ip.src_addr()),
                dst: IpAddr::V6(ip.dst_addr()),
                fragment: false,
                l4: l2.l3_offset + ipv6::HEADER_LEN,
                end: l2.l3_offset + ipv6::HEADER_LEN + usize::from(ip.payload_len()),
            })
        }
        _ => None,
    }
}

/// Whether `frame` (received on `ifindex`) is the tunnel's and, if so,
/// where its inner frame is or why it is refused. Without a tunnel in the
/// tables nothing is the tunnel's.
#[inline]
pub fn decapsulate(tables: &Tables, ingress: &Ingress, frame: &[u8], ifindex: u32) -> Decap {
    let Some(tunnel) = tables.tunnel() else { return Decap::NotTunnel };
    if glance(frame, tunnel.port) == Glance::Not {
        return Decap::NotTunnel;
    }
    let Some(o) = outer(frame) else { return Decap::NotTunnel };
    let Some(port) = frame.get(o.l4 + 2..o.l4 + 4) else { return Decap::NotTunnel };
    if u16::from_be_bytes([port[0], port[1]]) != tunnel.port || !tables.owns_egress(o.dst) {
        return Decap::NotTunnel;
    }
    // From here on the frame is Egret's: translated or dropped.
    if ingress.interfaces().iter().any(|i| i.ifindex == ifindex && i.role == IngressRole::Outside) {
        return Decap::Drop(DropReason::DecapOnOutside);
    }
    if !tunnel.nodes.contains(&o.src) {
        return Decap::Drop(DropReason::DecapUnknownNode);
    }
    if o.fragment {
        return Decap::Drop(DropReason::DecapFragment);
    }
    let Some(datagram) = frame.get(o.l4..o.end) else { return Decap::Drop(DropReason::DecapMalformed) };
    // The datagram is the whole IP payload, as the nodes' kernel builds it.
    let u = match udp::Packet::new_checked(datagram) {
        Ok(u) if usize::from(u.length()) == datagram.len() => u,
        _ => return Decap::Drop(DropReason::DecapMalformed),
    };
    let g = match vxlan::Packet::new_checked(u.payload()) {
        Ok(g) if g.check_egret(tunnel.vni).is_ok() => g,
        _ => return Decap::Drop(DropReason::DecapMalformed),
    };
    let start = o.l4 + udp::HEADER_LEN + vxlan::HEADER_LEN;
    match ethernet::l2_info(g.payload()) {
        Ok(l2) if l2.vlan_tci.is_none() && (l2.ethertype == EtherType::IPV4 || l2.ethertype == EtherType::IPV6) => {
            // To the received frame's end: bytes after the outer datagram
            // (a trailer) stay the inner frame's trailer, as the XDP program
            // leaves them when it moves the frame's head.
            Decap::Inner { start, end: frame.len() }
        }
        _ => Decap::Drop(DropReason::DecapNotIp),
    }
}

/// Builds what a node sends for `inner` (an Ethernet frame): outer
/// Ethernet from `macs.0` to `macs.1`, outer IP from `node` to `next_hop`,
/// UDP from `src_port` to `tunnel_port`, VXLAN with Egret's VNI. `None`
/// when the two addresses are of different families. Tests, fixtures and
/// benchmarks use it; the nodes' kernel builds the real thing.
pub fn encapsulate(
    inner: &[u8],
    macs: ([u8; 6], [u8; 6]),
    node: IpAddr,
    next_hop: IpAddr,
    src_port: u16,
    tunnel_port: u16,
) -> Option<Vec<u8>> {
    let udp_len = udp::HEADER_LEN + vxlan::HEADER_LEN + inner.len();
    let mut f = Vec::with_capacity(ethernet::HEADER_LEN + ipv6::HEADER_LEN + udp_len);
    f.extend_from_slice(&macs.1);
    f.extend_from_slice(&macs.0);
    let sum = match (node, next_hop) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            f.extend_from_slice(&EtherType::IPV4.to_be_bytes());
            f.extend_from_slice(&ipv4_header(s, d, udp_len));
            checksum::pseudo_header_v4(s, d, IpProtocol::UDP, udp_len as u32)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            f.extend_from_slice(&EtherType::IPV6.to_be_bytes());
            f.extend_from_slice(&ipv6_header(s, d, udp_len));
            checksum::pseudo_header_v6(&s, &d, IpProtocol::UDP, udp_len as u32)
        }
        _ => return None,
    };
    let l4 = f.len();
    f.extend_from_slice(&src_port.to_be_bytes());
    f.extend_from_slice(&tunnel_port.to_be_bytes());
    f.extend_from_slice(&(udp_len as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    let mut g = [0u8; vxlan::HEADER_LEN];
    vxlan::emit(&mut g, vxlan::EGRET_VNI);
    f.extend_from_slice(&g);
    f.extend_from_slice(inner);
    udp::Packet::new_unchecked(&mut f[l4..]).fill_checksum(sum);
    Some(f)
}

fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr, payload: usize) -> [u8; 20] {
    let mut h = [0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((20 + payload) as u16).to_be_bytes());
    h[6] = 0x40; // DF, as the nodes' kernel sets it on a route with an MTU
    h[8] = 64;
    h[9] = IpProtocol::UDP;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let mut p = ipv4::Packet::new_unchecked(&mut h[..]);
    p.fill_checksum();
    h
}

fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, payload: usize) -> [u8; 40] {
    let mut h = [0u8; 40];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(payload as u16).to_be_bytes());
    h[6] = IpProtocol::UDP;
    h[7] = 64;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{self, build::Packet};
    use crate::wire::vxlan::DEFAULT_PORT;

    /// What `decapsulate` decided before the glance: the UDP header of a
    /// datagram to `port` as `outer` parses it.
    fn parsed(frame: &[u8], port: u16) -> Option<usize> {
        let o = outer(frame)?;
        let p = frame.get(o.l4 + 2..o.l4 + 4)?;
        (u16::from_be_bytes([p[0], p[1]]) == port).then_some(o.l4)
    }

    /// The glance turns a frame away only where the parse would, and finds
    /// the tunnel's frames where the parse does, for frames of every kind
    /// and every truncation of them.
    #[test]
    fn glance_agrees_with_the_parse() {
        let (v4, v6) = (IpAddr::V4(fixtures::POD_A), IpAddr::V6(fixtures::POD6));
        let (s4, s6) = (IpAddr::V4(fixtures::SERVER), IpAddr::V6(fixtures::SERVER6));
        let udp4 = fixtures::from_pod(v4, s4, fixtures::udp(40000, DEFAULT_PORT, b"q"));
        let tagged = Packet { vlan: Some(7), ..udp4.clone() };
        let options = Packet { options: vec![1, 1, 1, 0], ..udp4.clone() };
        let mut frames = vec![
            udp4.frame(),
            tagged.frame(),
            options.frame(),
            fixtures::from_pod(v6, s6, fixtures::udp(40000, DEFAULT_PORT, b"q")).frame(),
            fixtures::from_pod(v4, s4, fixtures::tcp(40000, DEFAULT_PORT, 1, None, 0x02, b"")).frame(),
            fixtures::from_pod(v6, s6, fixtures::echo(true, 1, 1)).frame(),
        ];
        let plain = frames.clone();
        let tunnelled: Vec<Vec<u8>> = plain.iter().filter_map(|f| fixtures::tunnelled(f, 1)).collect();
        // Every tunnel frame (outer headers untagged, both families) is
        // found, at the parse's UDP header.
        for f in &tunnelled {
            assert_eq!(glance(f, DEFAULT_PORT), Glance::ToPort(parsed(f, DEFAULT_PORT).expect("the tunnel's")));
        }
        // The port is the one asked about: the same frames sent to another
        // tunnel port are found for that port only.
        let mut other_port = Vec::new();
        for f in &tunnelled {
            let mut g = f.clone();
            let l4 = parsed(f, DEFAULT_PORT).expect("the tunnel's");
            g[l4 + 2..l4 + 4].copy_from_slice(&4789u16.to_be_bytes());
            assert_eq!(glance(&g, 4789), Glance::ToPort(l4));
            assert_eq!(glance(&g, DEFAULT_PORT), Glance::Not);
            other_port.push(g);
        }
        // An outer first fragment (MF set, offset 0) is found: `decapsulate`
        // drops it under its own reason, so the glance must not turn it away.
        let mut first = tunnelled[0].clone();
        first[20] = 0x20;
        assert_eq!(glance(&first, DEFAULT_PORT), Glance::ToPort(parsed(&first, DEFAULT_PORT).expect("parsed")));
        frames.extend(other_port);
        frames.push(first);
        // An IPv4 later fragment, and an IPv6 fragment header, to the port.
        let outer_v6 = |f: &&Vec<u8>| f[12..14] == [0x86, 0xdd];
        let mut later = tunnelled[0].clone();
        later[20] = 0x01;
        let mut fragment6 = tunnelled.iter().find(outer_v6).expect("an IPv6 tunnel frame").clone();
        fragment6[20] = IpProtocol::IPV6_FRAGMENT;
        frames.extend(tunnelled);
        frames.extend([later, fragment6]);
        for f in &frames {
            for len in 0..=f.len() {
                let f = &f[..len];
                for port in [DEFAULT_PORT, 4789] {
                    match glance(f, port) {
                        Glance::Not => assert_eq!(parsed(f, port), None, "{f:02x?}"),
                        Glance::ToPort(l4) => assert!(parsed(f, port).is_none_or(|p| p == l4), "{f:02x?}"),
                        Glance::Unknown => assert!(!matches!(f.get(12..14), Some([0x08, 0x00] | [0x86, 0xdd]))),
                    }
                }
            }
        }
    }
}
