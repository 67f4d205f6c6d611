//! The benchmark's frames: 64-byte (on the wire) Ethernet/IPv4/UDP or
//! Ethernet/IPv4/TCP frames with correct checksums, and the flow sets that
//! spread them over source addresses and ports of the pod range.
//!
//! A frame is 60 bytes as handed to the kernel (the NIC would add the 4-byte
//! FCS): Ethernet II (14), IPv4 without options (20, RFC 791 section 3.1),
//! UDP (8, RFC 768) and 18 bytes of payload. Checksums follow RFC 1071
//! (one's complement sum of 16-bit words); the UDP checksum covers the
//! RFC 768 pseudo-header, and a computed zero is sent as 0xffff.
//!
//! A TCP frame (`--proto tcp`, issue 32) has the same 60 bytes: Ethernet,
//! IPv4, a TCP header without options (20, RFC 9293 3.1) with ACK set and 6
//! bytes of payload, the segment of a bulk transfer. Its sequence number
//! advances by the payload per segment of the flow ([`tcp_seq`]); the
//! acknowledgment number is the sink's SYN-ACK's sequence number plus one.
//! The handshake's SYN ([`FrameSpec::build_syn`]) is 54 bytes of headers
//! padded to 60 (IPv4 total length 40), as a NIC pads a short frame.
//!
//! The XDP generator (`xdp/gen.bpf.c`) rewrites a template into flow `k`'s
//! frame in the kernel; [`GenChecksumBase`] are the partial sums it starts
//! from and [`GenChecksumBase::apply`] is the same arithmetic in Rust, which
//! the tests compare against [`FrameSpec::build`].

use std::net::Ipv4Addr;

/// Frame length without the FCS (64 bytes on the wire).
pub const FRAME_LEN: usize = 60;
/// Ethernet header length.
pub const ETH_LEN: usize = 14;
/// IPv4 header length (no options).
pub const IPV4_LEN: usize = 20;
/// Offset of the UDP header.
pub const UDP_OFF: usize = ETH_LEN + IPV4_LEN;
/// UDP header plus payload.
pub const UDP_LEN: usize = FRAME_LEN - UDP_OFF;

const ETHERTYPE_IPV4: u16 = 0x0800;
const IPPROTO_UDP: u8 = 17;
/// IPv4's protocol number for TCP.
pub const IPPROTO_TCP: u8 = 6;
const TTL: u8 = 64;
const PAYLOAD: &[u8; FRAME_LEN - UDP_OFF - 8] = b"egret-throughput!\n";
/// TCP header without options.
pub const TCP_HDR_LEN: usize = 20;
/// A data segment's payload (the 60-byte frame's rest).
pub const TCP_PAYLOAD: &[u8; FRAME_LEN - UDP_OFF - TCP_HDR_LEN] = b"egret\n";
/// The pods' initial sequence number (every flow's: flows differ in their
/// addresses and ports, which is all a NAT and conntrack key on).
pub const TCP_POD_ISN: u32 = 0x4567_0000;
/// The sink's initial sequence number (its SYN-ACK's); `xdp/sink.bpf.c`
/// has the same constant.
pub const TCP_SINK_ISN: u32 = 0x7e57_0000;
/// The window both sides advertise (no window scaling: the SYNs carry no
/// options).
pub const TCP_WINDOW: u16 = 65_535;
/// A flow's sequence number goes back to its first data byte after this
/// many segments (48 KiB of payload): the sink never acknowledges, so the
/// pod may not send past the sink's 64 KiB window (conntrack checks it,
/// `tcp_in_window`); an older sequence number within the window is a
/// retransmission, which every stateful path accepts.
pub const TCP_SEQ_WRAP: u64 = 8192;
/// TCP flags (RFC 9293 3.1).
pub mod tcp_flags {
    pub const SYN: u8 = 0x02;
    pub const ACK: u8 = 0x10;
}

/// The transport of a run's frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Proto {
    /// 64-byte UDP datagrams.
    #[default]
    Udp,
    /// 64-byte TCP data segments of established connections.
    Tcp,
}

impl Proto {
    /// IPv4's protocol number.
    pub fn number(self) -> u8 {
        match self {
            Proto::Udp => IPPROTO_UDP,
            Proto::Tcp => IPPROTO_TCP,
        }
    }

    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Proto::Udp => "udp",
            Proto::Tcp => "tcp",
        }
    }
}

/// The sequence number of segment `segment` (0, 1, ...) of a flow: the
/// first data byte after the SYN, advancing by the payload per segment,
/// wrapping after [`TCP_SEQ_WRAP`] segments.
pub fn tcp_seq(segment: u64) -> u32 {
    TCP_POD_ISN.wrapping_add(1).wrapping_add(TCP_PAYLOAD.len() as u32 * (segment % TCP_SEQ_WRAP) as u32)
}

/// RFC 1071 one's complement sum of big-endian 16-bit words, unfolded. An odd
/// trailing byte is padded with zero (section 4.1).
pub fn ones_complement_sum(bytes: &[u8]) -> u32 {
    let mut chunks = bytes.chunks_exact(2);
    let mut sum: u32 = 0;
    for c in &mut chunks {
        sum = sum.wrapping_add(u32::from(u16::from_be_bytes([c[0], c[1]])));
    }
    if let [last] = chunks.remainder() {
        sum = sum.wrapping_add(u32::from(*last) << 8);
    }
    sum
}

/// Fold a 32-bit one's complement sum to 16 bits (RFC 1071 section 4.1).
pub fn fold(mut sum: u32) -> u16 {
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// The IPv4 header checksum of `header` (whose checksum field is included
/// as it stands: zero it first to compute, keep it to verify; a correct
/// header then yields 0).
pub fn ipv4_header_checksum(header: &[u8]) -> u16 {
    !fold(ones_complement_sum(header))
}

/// Sum of the RFC 768 pseudo-header for UDP over IPv4.
fn pseudo_header_sum(src: Ipv4Addr, dst: Ipv4Addr, udp_len: u16) -> u32 {
    pseudo_header_sum_for(IPPROTO_UDP, src, dst, udp_len)
}

/// Sum of the pseudo-header of UDP (RFC 768) or TCP (RFC 9293 3.1) over
/// IPv4: source, destination, protocol and the transport length.
fn pseudo_header_sum_for(proto: u8, src: Ipv4Addr, dst: Ipv4Addr, len: u16) -> u32 {
    ones_complement_sum(&src.octets()) + ones_complement_sum(&dst.octets()) + u32::from(proto) + u32::from(len)
}

/// The TCP checksum of `segment` (header and payload, checksum field
/// included as it stands) over IPv4 from `src` to `dst`: the value to store
/// when the field is zero, 0 when a stored one is correct.
pub fn tcp_checksum(src: Ipv4Addr, dst: Ipv4Addr, segment: &[u8]) -> u16 {
    let len = u16::try_from(segment.len()).unwrap_or(u16::MAX);
    !fold(pseudo_header_sum_for(IPPROTO_TCP, src, dst, len) + ones_complement_sum(segment))
}

/// The UDP checksum of `udp` (header and payload, checksum field included
/// as it stands) over IPv4 from `src` to `dst`. Zeroed field: the value to
/// store (zero already mapped to 0xffff). Field kept: 0 when correct.
pub fn udp_checksum(src: Ipv4Addr, dst: Ipv4Addr, udp: &[u8]) -> u16 {
    let len = u16::try_from(udp.len()).unwrap_or(u16::MAX);
    let c = !fold(pseudo_header_sum(src, dst, len) + ones_complement_sum(udp));
    if c == 0 && udp.get(6..8) == Some(&[0, 0]) {
        0xffff
    } else {
        c
    }
}

/// Whether a frame built here (or translated by a NAT) carries correct IPv4
/// and UDP (or TCP) checksums. `None` if it is not an IPv4/UDP or IPv4/TCP
/// frame of our shape.
pub fn checksums_ok(frame: &[u8]) -> Option<(bool, bool)> {
    if frame.len() < FRAME_LEN || frame[12..14] != ETHERTYPE_IPV4.to_be_bytes() || frame[ETH_LEN] != 0x45 {
        return None;
    }
    let ip = &frame[ETH_LEN..UDP_OFF];
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    if ip[9] == IPPROTO_TCP {
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        let tcp = frame.get(UDP_OFF..ETH_LEN + total.max(IPV4_LEN))?;
        return Some((ipv4_header_checksum(ip) == 0, tcp.len() >= TCP_HDR_LEN && tcp_checksum(src, dst, tcp) == 0));
    }
    if ip[9] != IPPROTO_UDP {
        return None;
    }
    let udp_len = usize::from(u16::from_be_bytes([frame[UDP_OFF + 4], frame[UDP_OFF + 5]]));
    let udp = frame.get(UDP_OFF..UDP_OFF + udp_len)?;
    let ip_ok = ipv4_header_checksum(ip) == 0;
    let udp_ok =
        udp[6..8] != [0, 0] && fold(pseudo_header_sum(src, dst, udp_len as u16) + ones_complement_sum(udp)) == 0xffff;
    Some((ip_ok, udp_ok))
}

/// The fixed parts of every frame of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameSpec {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
    pub dst_ip: Ipv4Addr,
    pub dst_port: u16,
    pub proto: Proto,
}

impl FrameSpec {
    /// Flow `(src_ip, src_port)`'s frame, checksums filled in (for TCP its
    /// first data segment).
    pub fn build(&self, src_ip: Ipv4Addr, src_port: u16) -> [u8; FRAME_LEN] {
        self.build_segment(src_ip, src_port, 0)
    }

    /// Flow `(src_ip, src_port)`'s frame number `segment` (0, 1, ...):
    /// UDP frames are all alike; a TCP segment carries [`tcp_seq`]`(segment)`.
    pub fn build_segment(&self, src_ip: Ipv4Addr, src_port: u16, segment: u64) -> [u8; FRAME_LEN] {
        match self.proto {
            Proto::Udp => self.build_udp(src_ip, src_port),
            Proto::Tcp => self.build_tcp(src_ip, src_port, tcp_seq(segment), tcp_flags::ACK),
        }
    }

    /// The flow's SYN (TCP): sequence number [`TCP_POD_ISN`], no options, no
    /// payload; the frame padded to 60 bytes with zeros.
    pub fn build_syn(&self, src_ip: Ipv4Addr, src_port: u16) -> [u8; FRAME_LEN] {
        self.build_tcp(src_ip, src_port, TCP_POD_ISN, tcp_flags::SYN)
    }

    /// The IPv4 header for `src_ip` carrying `l4_len` bytes of `proto`.
    fn ipv4_header(&self, f: &mut [u8; FRAME_LEN], src_ip: Ipv4Addr, proto: u8, l4_len: usize) {
        f[0..6].copy_from_slice(&self.dst_mac);
        f[6..12].copy_from_slice(&self.src_mac);
        f[12..14].copy_from_slice(&ETHERTYPE_IPV4.to_be_bytes());
        let ip = &mut f[ETH_LEN..UDP_OFF];
        ip[0] = 0x45; // version 4, IHL 5
        ip[1] = 0; // DSCP/ECN
        ip[2..4].copy_from_slice(&((IPV4_LEN + l4_len) as u16).to_be_bytes());
        ip[4..6].copy_from_slice(&0u16.to_be_bytes()); // identification
        ip[6..8].copy_from_slice(&0x4000u16.to_be_bytes()); // DF, offset 0
        ip[8] = TTL;
        ip[9] = proto;
        ip[10..12].fill(0);
        ip[12..16].copy_from_slice(&src_ip.octets());
        ip[16..20].copy_from_slice(&self.dst_ip.octets());
        let c = ipv4_header_checksum(ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
    }

    /// A TCP frame: a data segment (ACK, [`TCP_PAYLOAD`]) or, with SYN in
    /// `flags`, the handshake's SYN (no payload, ack 0).
    fn build_tcp(&self, src_ip: Ipv4Addr, src_port: u16, seq: u32, flags: u8) -> [u8; FRAME_LEN] {
        let mut f = [0u8; FRAME_LEN];
        let syn = flags & tcp_flags::SYN != 0;
        let len = if syn { TCP_HDR_LEN } else { TCP_HDR_LEN + TCP_PAYLOAD.len() };
        self.ipv4_header(&mut f, src_ip, IPPROTO_TCP, len);
        let tcp = &mut f[UDP_OFF..UDP_OFF + len];
        tcp[0..2].copy_from_slice(&src_port.to_be_bytes());
        tcp[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
        tcp[4..8].copy_from_slice(&seq.to_be_bytes());
        let ack = if syn { 0 } else { TCP_SINK_ISN.wrapping_add(1) };
        tcp[8..12].copy_from_slice(&ack.to_be_bytes());
        tcp[12] = ((TCP_HDR_LEN / 4) as u8) << 4; // data offset, no options
        tcp[13] = flags;
        tcp[14..16].copy_from_slice(&TCP_WINDOW.to_be_bytes());
        if !syn {
            tcp[TCP_HDR_LEN..].copy_from_slice(TCP_PAYLOAD);
        }
        let c = tcp_checksum(src_ip, self.dst_ip, tcp);
        tcp[16..18].copy_from_slice(&c.to_be_bytes());
        f
    }

    fn build_udp(&self, src_ip: Ipv4Addr, src_port: u16) -> [u8; FRAME_LEN] {
        let mut f = [0u8; FRAME_LEN];
        self.ipv4_header(&mut f, src_ip, IPPROTO_UDP, UDP_LEN);
        let udp = &mut f[UDP_OFF..];
        udp[0..2].copy_from_slice(&src_port.to_be_bytes());
        udp[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
        udp[4..6].copy_from_slice(&(UDP_LEN as u16).to_be_bytes());
        udp[8..].copy_from_slice(PAYLOAD);
        let c = udp_checksum(src_ip, self.dst_ip, udp);
        udp[6..8].copy_from_slice(&c.to_be_bytes());
        f
    }
}

/// The tunnel's UDP port unless `--tunnel-port` says otherwise (ADR 0031's
/// proposal, Egret's default).
pub const TUNNEL_PORT: u16 = 6082;
/// The tunnel header's length: VXLAN (RFC 7348) and
/// VXLAN (RFC 7348) alike. The header's bytes are Egret's own
/// (`egret_dataplane::tunnel::encapsulate`).
pub const TUNNEL_HEADER_LEN: usize = 8;
/// Outer headers of a node's tunnelled frame over IPv4 (ADR 0031): Ethernet
/// (14), IPv4 (20), UDP (8), the tunnel header (8).
pub const VXLAN_OVERHEAD: usize = ETH_LEN + IPV4_LEN + 8 + TUNNEL_HEADER_LEN;
/// A node's encapsulated benchmark frame: the outer headers and the pod's
/// 60-byte frame.
pub const VXLAN_FRAME_LEN: usize = VXLAN_OVERHEAD + FRAME_LEN;

/// The outer UDP source port of flow `(src_ip, src_port)`: a hash of the
/// two (MurmurHash3's 32-bit finaliser) scaled onto 1-65535, as a node's
/// kernel hashes the inner flow into it (`udp_flow_src_port`).
/// `bench_outer_port` in `xdp/bench_common.h` is the same arithmetic.
pub fn outer_src_port(src_ip: Ipv4Addr, src_port: u16) -> u16 {
    let mut h = u32::from(src_ip) ^ u32::from(src_port).wrapping_mul(0x9e37_79b1);
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    ((u64::from(h) * 65_535) >> 32) as u16 + 1
}

/// How a node wraps the pods' frames for the gateway (issue 30): outer
/// Ethernet from the router to the gateway's inside interface, IPv4 from
/// the node to the next hop (an address the gateway owns), UDP to the
/// tunnel port with the flow's hashed source port and a zero checksum (a
/// node's lightweight-tunnel route without `csum` sends none over IPv4),
/// VXLAN with Egret's VNI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VxlanSpec {
    pub outer_src_mac: [u8; 6],
    pub outer_dst_mac: [u8; 6],
    pub node: Ipv4Addr,
    pub next_hop: Ipv4Addr,
    pub port: u16,
}

impl VxlanSpec {
    /// The node's frame carrying `inner` (a pod's frame of flow
    /// `(src_ip, src_port)`), built with Egret's own encapsulation
    /// (`egret_dataplane::tunnel::encapsulate`) and the outer UDP checksum
    /// then cleared.
    pub fn wrap(&self, inner: &[u8], src_ip: Ipv4Addr, src_port: u16) -> Vec<u8> {
        let mut f = egret_dataplane::tunnel::encapsulate(
            inner,
            (self.outer_src_mac, self.outer_dst_mac),
            self.node.into(),
            self.next_hop.into(),
            outer_src_port(src_ip, src_port),
            self.port,
        )
        .unwrap_or_default();
        if let Some(c) = f.get_mut(UDP_OFF + 6..UDP_OFF + 8) {
            c.fill(0);
        }
        f
    }
}

/// Flow `(src_ip, src_port)`'s frame as the generator sends it: `spec`'s
/// frame, wrapped by `encap` when given.
pub fn wire_frame(spec: &FrameSpec, encap: Option<&VxlanSpec>, src_ip: Ipv4Addr, src_port: u16) -> Vec<u8> {
    wire_segment(spec, encap, src_ip, src_port, 0)
}

/// The same for the flow's frame number `segment` (TCP: its sequence
/// number, [`FrameSpec::build_segment`]).
pub fn wire_segment(
    spec: &FrameSpec,
    encap: Option<&VxlanSpec>,
    src_ip: Ipv4Addr,
    src_port: u16,
    segment: u64,
) -> Vec<u8> {
    let inner = spec.build_segment(src_ip, src_port, segment);
    match encap {
        Some(e) => e.wrap(&inner, src_ip, src_port),
        None => inner.to_vec(),
    }
}

/// How a run's flows are laid out: flow `k` has source address
/// `base_ip + k mod ips` and source port `base_port + (k / ips) mod ports`.
/// Frame `n` belongs to flow `n / train`: `train` frames of one flow in a
/// row (1, the default, sends the flows round-robin).
/// `flows == 0` means every frame is a new flow (new-connection mode): `k`
/// is then the frame counter itself, unique for `ips * ports` frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowSet {
    pub flows: u64,
    pub ips: u32,
    pub ports: u32,
    pub base_ip: Ipv4Addr,
    pub base_port: u16,
    pub train: u32,
}

/// First pod address used as a flow source (the generator's own interface
/// is 198.18.0.1).
pub const POD_BASE: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 0);
/// Most distinct source addresses a fixed flow set uses.
pub const MAX_FLOW_IPS: u32 = 200;
/// First source port.
pub const BASE_PORT: u16 = 1024;

impl FlowSet {
    /// `flows` flows over up to [`MAX_FLOW_IPS`] addresses, as many ports
    /// each as needed (50,000 flows: 200 addresses x 250 ports).
    pub fn fixed(flows: u32) -> Self {
        let flows = flows.max(1);
        let ips = flows.min(MAX_FLOW_IPS);
        Self {
            flows: u64::from(flows),
            ips,
            ports: flows.div_ceil(ips),
            base_ip: POD_BASE,
            base_port: BASE_PORT,
            train: 1,
        }
    }

    /// The same flows, `train` frames of each in a row (at least 1).
    pub fn with_train(self, train: u32) -> Self {
        Self { train: train.max(1), ..self }
    }

    /// A new flow per frame: 198.18.1.0 onwards over 16,384 addresses
    /// (198.18.1.0-198.18.64.255, inside 198.18.0.0/16) times ports
    /// 1024-65535: about a billion frames before a tuple repeats.
    pub fn new_flows() -> Self {
        Self {
            flows: 0,
            ips: 16_384,
            ports: 65_536 - u32::from(BASE_PORT),
            base_ip: POD_BASE,
            base_port: BASE_PORT,
            train: 1,
        }
    }

    /// Flow `k`'s source address and port (`k` is reduced mod `flows` when
    /// the set is fixed).
    pub fn flow(&self, k: u64) -> (Ipv4Addr, u16) {
        let k = if self.flows == 0 { k } else { k % self.flows };
        let ips = u64::from(self.ips.max(1));
        let ports = u64::from(self.ports.max(1));
        let ip = u32::from(self.base_ip).wrapping_add((k % ips) as u32);
        let port = u64::from(self.base_port) + (k / ips) % ports;
        (Ipv4Addr::from(ip), port as u16)
    }

    /// The flow of frame `n` (`n / train`).
    pub fn flow_of_frame(&self, n: u64) -> u64 {
        n / u64::from(self.train.max(1))
    }

    /// Which of its flow's frames frame `n` is (0, 1, ...): the passes over
    /// the flow set before it times the train, plus its place in its train.
    /// A TCP segment's sequence number follows from it ([`tcp_seq`]).
    /// Always 0 in new-flow mode.
    pub fn segment_of_frame(&self, n: u64) -> u64 {
        if self.flows == 0 {
            return 0;
        }
        let train = u64::from(self.train.max(1));
        (n / (train * self.flows)) * train + n % train
    }

    /// The same flows with source ports from `base_port` (TCP runs give
    /// each window connections of its own).
    pub fn with_base_port(self, base_port: u16) -> Self {
        Self { base_port, ..self }
    }

    /// Whether every frame is a new flow.
    pub fn is_fresh_per_frame(&self) -> bool {
        self.flows == 0
    }
}

/// The partial checksums `xdp/gen.bpf.c` starts from: every 16-bit word of
/// the IPv4 header but the source address and the checksum, and of the
/// transport's pseudo-header, header and payload but the source address,
/// the source port, the checksum and (TCP) the sequence number. Layout
/// mirrors `struct gen_flows`'s sum fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenChecksumBase {
    pub ip_sum: u32,
    /// UDP's or TCP's (`l4_sum` in the C struct).
    pub udp_sum: u32,
    pub proto: Proto,
}

impl GenChecksumBase {
    /// The partial sums of `spec`'s frames.
    pub fn of(spec: &FrameSpec) -> Self {
        // A frame with source 0.0.0.0 port 0 (sequence number 0) and zeroed
        // checksums holds exactly the words that do not vary.
        let mut f = match spec.proto {
            Proto::Udp => spec.build_udp(Ipv4Addr::UNSPECIFIED, 0),
            Proto::Tcp => spec.build_tcp(Ipv4Addr::UNSPECIFIED, 0, 0, tcp_flags::ACK),
        };
        f[ETH_LEN + 10..ETH_LEN + 12].fill(0);
        let check = match spec.proto {
            Proto::Udp => UDP_OFF + 6,
            Proto::Tcp => UDP_OFF + 16,
        };
        f[check..check + 2].fill(0);
        let ip_sum = ones_complement_sum(&f[ETH_LEN..UDP_OFF]);
        let udp_sum = pseudo_header_sum_for(spec.proto.number(), Ipv4Addr::UNSPECIFIED, spec.dst_ip, UDP_LEN as u16)
            + ones_complement_sum(&f[UDP_OFF..]);
        Self { ip_sum, udp_sum, proto: spec.proto }
    }

    /// What the XDP generator writes for source `(ip, port)`: the IPv4 and
    /// UDP checksums (the same arithmetic as `gen.bpf.c`).
    pub fn apply(&self, ip: Ipv4Addr, port: u16) -> (u16, u16) {
        self.apply_segment(ip, port, 0)
    }

    /// The same for TCP segment `seq` (ignored for UDP): the IPv4 and TCP
    /// checksums (TCP has no "no checksum" value: a computed zero stays).
    pub fn apply_segment(&self, ip: Ipv4Addr, port: u16, seq: u32) -> (u16, u16) {
        let src = u32::from(ip);
        let words = (src >> 16) + (src & 0xffff);
        let ip_c = !fold(self.ip_sum + words);
        match self.proto {
            Proto::Udp => {
                let udp_c = !fold(self.udp_sum + words + u32::from(port));
                (ip_c, if udp_c == 0 { 0xffff } else { udp_c })
            }
            Proto::Tcp => (ip_c, !fold(self.udp_sum + words + u32::from(port) + (seq >> 16) + (seq & 0xffff))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> FrameSpec {
        FrameSpec {
            src_mac: [0x02, 0, 0, 0, 0, 0x01],
            dst_mac: [0x02, 0, 0, 0, 0, 0x02],
            dst_ip: Ipv4Addr::new(198, 51, 100, 1),
            dst_port: 9,
            proto: Proto::Udp,
        }
    }

    fn tcp_spec() -> FrameSpec {
        FrameSpec { proto: Proto::Tcp, ..spec() }
    }

    #[test]
    fn tcp_segments_are_exact_and_checked_independently() {
        let (ip, port) = (Ipv4Addr::new(198, 18, 1, 7), 4242);
        let f = tcp_spec().build_segment(ip, port, 3);
        #[rustfmt::skip]
        let head: [u8; 54] = [
            0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00,
            0x45, 0x00, 0x00, 46, 0x00, 0x00, 0x40, 0x00, 64, 6, f[24], f[25],
            198, 18, 1, 7, 198, 51, 100, 1,
            0x10, 0x92, 0x00, 0x09, 0x45, 0x67, 0x00, 0x01 + 18, 0x7e, 0x57, 0x00, 0x01,
            0x50, 0x10, 0xff, 0xff, f[50], f[51], 0, 0,
        ];
        assert_eq!(f[..54], head);
        assert_eq!(&f[54..], TCP_PAYLOAD);
        // An independent parser agrees on every header and both checksums.
        let (_, rest) = etherparse::Ethernet2Header::from_slice(&f).expect("ethernet");
        let (iph, rest) = etherparse::Ipv4Header::from_slice(rest).expect("ipv4");
        assert_eq!(iph.header_checksum, iph.calc_header_checksum());
        let (tcph, payload) = etherparse::TcpHeader::from_slice(rest).expect("tcp");
        assert!(tcph.ack && !tcph.syn && !tcph.fin && !tcph.rst);
        assert_eq!((tcph.sequence_number, tcph.acknowledgment_number), (TCP_POD_ISN + 1 + 18, TCP_SINK_ISN + 1));
        assert_eq!(tcph.checksum, tcph.calc_checksum_ipv4(&iph, payload).expect("checksum"));
        assert_eq!(checksums_ok(&f), Some((true, true)));
        let mut bad = f;
        bad[59] ^= 1;
        assert_eq!(checksums_ok(&bad), Some((true, false)));

        // The SYN: no payload, ack 0, padded to 60 bytes.
        let syn = tcp_spec().build_syn(ip, port);
        let (_, rest) = etherparse::Ethernet2Header::from_slice(&syn).expect("ethernet");
        let (iph, rest) = etherparse::Ipv4Header::from_slice(rest).expect("ipv4");
        assert_eq!(iph.total_len, 40);
        let (tcph, _) = etherparse::TcpHeader::from_slice(rest).expect("tcp");
        assert!(tcph.syn && !tcph.ack);
        assert_eq!((tcph.sequence_number, tcph.acknowledgment_number, tcph.window_size), (TCP_POD_ISN, 0, 65_535));
        assert_eq!(tcph.checksum, tcph.calc_checksum_ipv4(&iph, &[]).expect("checksum"));
        assert_eq!(syn[54..], [0; 6]);
        assert_eq!(checksums_ok(&syn), Some((true, true)));
    }

    #[test]
    fn tcp_sequence_numbers_follow_each_flows_segments() {
        assert_eq!(tcp_seq(0), TCP_POD_ISN + 1);
        assert_eq!(tcp_seq(1), TCP_POD_ISN + 7);
        assert_eq!(tcp_seq(TCP_SEQ_WRAP - 1), TCP_POD_ISN + 1 + 6 * 8191);
        assert_eq!(tcp_seq(TCP_SEQ_WRAP), tcp_seq(0), "wraps inside the sink's window");
        assert!(6 * TCP_SEQ_WRAP < u64::from(TCP_WINDOW));
        // Trains of 4 over 3 flows: frames 0-3 are flow 0's segments 0-3,
        // 4-7 flow 1's, 8-11 flow 2's, then flow 0's segments 4-7.
        let set = FlowSet::fixed(3).with_train(4);
        let seen: Vec<(u64, u64)> = (0..16).map(|n| (set.flow_of_frame(n) % 3, set.segment_of_frame(n))).collect();
        assert_eq!(
            seen,
            [
                (0, 0),
                (0, 1),
                (0, 2),
                (0, 3),
                (1, 0),
                (1, 1),
                (1, 2),
                (1, 3),
                (2, 0),
                (2, 1),
                (2, 2),
                (2, 3),
                (0, 4),
                (0, 5),
                (0, 6),
                (0, 7)
            ]
        );
        // Round-robin: each pass is one segment further.
        let rr = FlowSet::fixed(5);
        assert_eq!((0..11).map(|n| rr.segment_of_frame(n)).collect::<Vec<_>>(), [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2]);
        assert_eq!(FlowSet::new_flows().segment_of_frame(123), 0);
        // Every flow's segments come in order, one after another.
        let set = FlowSet::fixed(7).with_train(3);
        let mut next = [0u64; 7];
        for n in 0..500 {
            let k = (set.flow_of_frame(n) % 7) as usize;
            assert_eq!(set.segment_of_frame(n), next[k], "frame {n}");
            next[k] += 1;
        }
        assert_eq!(FlowSet::fixed(4000).with_base_port(2000).flow(200), (Ipv4Addr::new(198, 18, 1, 0), 2001));
    }

    #[test]
    fn tcp_generator_arithmetic_reproduces_the_builder() {
        let s = tcp_spec();
        let base = GenChecksumBase::of(&s);
        let set = FlowSet::fixed(50_000);
        for (k, seg) in (0..50_000).step_by(97).zip(0..).chain([(0, 0), (199, 8191), (49_999, 8192)]) {
            let (ip, port) = set.flow(k);
            let f = s.build_segment(ip, port, seg);
            let (ip_c, tcp_c) = base.apply_segment(ip, port, tcp_seq(seg));
            assert_eq!(ip_c.to_be_bytes(), f[ETH_LEN + 10..ETH_LEN + 12], "flow {k}");
            assert_eq!(tcp_c.to_be_bytes(), f[UDP_OFF + 16..UDP_OFF + 18], "flow {k} segment {seg}");
        }
    }

    #[test]
    fn rfc1071_example_sum() {
        // RFC 1071 section 3: the words 0001 f203 f4f5 f6f7 sum to 2ddf0,
        // which folds to ddf2.
        let bytes = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(ones_complement_sum(&bytes), 0x2ddf0);
        assert_eq!(fold(0x2ddf0), 0xddf2);
        // Odd length: the last byte is the high byte of a padded word.
        assert_eq!(ones_complement_sum(&[0x12, 0x34, 0x56]), 0x1234 + 0x5600);
    }

    #[test]
    fn frame_bytes_are_exact() {
        let f = spec().build(Ipv4Addr::new(198, 18, 1, 7), 4242);
        assert_eq!(f.len(), 60);
        #[rustfmt::skip]
        let head: [u8; 42] = [
            0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01, 0x08, 0x00,
            0x45, 0x00, 0x00, 46, 0x00, 0x00, 0x40, 0x00, 64, 17, f[24], f[25],
            198, 18, 1, 7, 198, 51, 100, 1,
            0x10, 0x92, 0x00, 0x09, 0x00, 26, f[40], f[41],
        ];
        assert_eq!(f[..42], head);
        assert_eq!(&f[42..], PAYLOAD);
    }

    #[test]
    fn checksums_match_an_independent_implementation() {
        let s = spec();
        for (ip, port) in [
            (Ipv4Addr::new(198, 18, 1, 0), 1024),
            (Ipv4Addr::new(198, 18, 1, 199), 1273),
            (Ipv4Addr::new(198, 19, 255, 255), 65535),
            (Ipv4Addr::new(198, 18, 0, 0), 0),
        ] {
            let f = s.build(ip, port);
            let (eth, rest) = etherparse::Ethernet2Header::from_slice(&f).expect("ethernet");
            assert_eq!(eth.ether_type, etherparse::EtherType::IPV4);
            let (iph, rest) = etherparse::Ipv4Header::from_slice(rest).expect("ipv4");
            assert_eq!(iph.header_checksum, iph.calc_header_checksum(), "{ip}");
            let (udph, payload) = etherparse::UdpHeader::from_slice(rest).expect("udp");
            assert_eq!(udph.checksum, udph.calc_checksum_ipv4(&iph, payload).expect("udp sum"), "{ip}:{port}");
            assert_eq!(payload, PAYLOAD);
            assert_eq!(checksums_ok(&f), Some((true, true)));
        }
    }

    #[test]
    fn corrupted_frames_fail_verification() {
        let mut f = spec().build(Ipv4Addr::new(198, 18, 1, 1), 2000);
        f[ETH_LEN + 8] -= 1; // TTL, not patched
        assert_eq!(checksums_ok(&f), Some((false, true)));
        let mut f = spec().build(Ipv4Addr::new(198, 18, 1, 1), 2000);
        f[UDP_OFF] ^= 0x01; // source port
        assert_eq!(checksums_ok(&f), Some((true, false)));
        let mut f = spec().build(Ipv4Addr::new(198, 18, 1, 1), 2000);
        f[UDP_OFF + 6..UDP_OFF + 8].fill(0); // "no checksum" is not ours
        assert_eq!(checksums_ok(&f), Some((true, false)));
        f[12] = 0x86;
        assert_eq!(checksums_ok(&f), None);
    }

    #[test]
    fn generator_arithmetic_reproduces_the_builder() {
        let s = spec();
        let base = GenChecksumBase::of(&s);
        let set = FlowSet::fixed(50_000);
        for k in (0..50_000).step_by(97).chain([0, 199, 200, 49_999]) {
            let (ip, port) = set.flow(k);
            let f = s.build(ip, port);
            let (ip_c, udp_c) = base.apply(ip, port);
            assert_eq!(ip_c.to_be_bytes(), f[ETH_LEN + 10..ETH_LEN + 12], "flow {k}");
            assert_eq!(udp_c.to_be_bytes(), f[UDP_OFF + 6..UDP_OFF + 8], "flow {k}");
        }
    }

    #[test]
    fn udp_zero_checksum_is_sent_as_all_ones() {
        // Find a source port whose checksum computes to zero, then check both
        // the builder and the generator arithmetic send 0xffff (RFC 768).
        let s = spec();
        let ip = Ipv4Addr::new(198, 18, 1, 5);
        let base = GenChecksumBase::of(&s);
        let port = (0..=u16::MAX)
            .find(|&p| !fold(base.udp_sum + (u32::from(ip) >> 16) + (u32::from(ip) & 0xffff) + u32::from(p)) == 0)
            .expect("some port sums to zero");
        let f = s.build(ip, port);
        assert_eq!(f[UDP_OFF + 6..UDP_OFF + 8], [0xff, 0xff]);
        assert_eq!(base.apply(ip, port).1, 0xffff);
        assert_eq!(checksums_ok(&f), Some((true, true)));
    }

    fn vxlan() -> VxlanSpec {
        VxlanSpec {
            outer_src_mac: [0x02, 0, 0, 0, 0, 0x01],
            outer_dst_mac: [0x02, 0, 0, 0, 0, 0x02],
            node: Ipv4Addr::new(192, 0, 2, 31),
            next_hop: Ipv4Addr::new(203, 0, 113, 10),
            port: 6082,
        }
    }

    #[test]
    fn vxlan_frames_are_what_a_node_sends() {
        let (ip, port) = (Ipv4Addr::new(198, 18, 1, 7), 4242);
        let inner = spec().build(ip, port);
        let f = wire_frame(&spec(), Some(&vxlan()), ip, port);
        assert_eq!(f.len(), VXLAN_FRAME_LEN);
        assert_eq!(VXLAN_FRAME_LEN, 110);
        // Outer Ethernet, IPv4 (checked by an independent parser), UDP with
        // no checksum, the VXLAN header (flags 0x08, VNI 1).
        let (eth, rest) = etherparse::Ethernet2Header::from_slice(&f).expect("ethernet");
        assert_eq!((eth.source, eth.destination), ([0x02, 0, 0, 0, 0, 0x01], [0x02, 0, 0, 0, 0, 0x02]));
        let (iph, rest) = etherparse::Ipv4Header::from_slice(rest).expect("ipv4");
        assert_eq!(iph.header_checksum, iph.calc_header_checksum());
        assert_eq!((iph.source, iph.destination), ([192, 0, 2, 31], [203, 0, 113, 10]));
        assert_eq!(usize::from(iph.total_len), VXLAN_FRAME_LEN - ETH_LEN);
        let (udph, payload) = etherparse::UdpHeader::from_slice(rest).expect("udp");
        assert_eq!(udph.source_port, outer_src_port(ip, port));
        assert_eq!((udph.destination_port, udph.checksum), (6082, 0));
        assert_eq!(usize::from(udph.length), 8 + 8 + FRAME_LEN);
        // The tunnel header as Egret's own encapsulation writes it.
        assert_eq!(payload[..8], [0x08, 0, 0, 0, 0, 0, 1, 0]);
        let egret = egret_dataplane::tunnel::encapsulate(
            &inner,
            ([0x02, 0, 0, 0, 0, 0x01], [0x02, 0, 0, 0, 0, 0x02]),
            Ipv4Addr::new(192, 0, 2, 31).into(),
            Ipv4Addr::new(203, 0, 113, 10).into(),
            outer_src_port(ip, port),
            6082,
        )
        .expect("one family");
        assert_eq!(payload[..8], egret[VXLAN_OVERHEAD - 8..VXLAN_OVERHEAD]);
        assert_eq!(payload[8..], inner);
        // Everything but the outer UDP checksum is Egret's frame.
        assert_eq!(f[..UDP_OFF + 6], egret[..UDP_OFF + 6]);
        assert_eq!(f[UDP_OFF + 8..], egret[UDP_OFF + 8..]);
        assert_eq!(f[VXLAN_OVERHEAD..], inner);
        // Without encapsulation: the plain frame.
        assert_eq!(wire_frame(&spec(), None, ip, port), inner.to_vec());
    }

    #[test]
    fn outer_source_ports_vary_per_flow() {
        let set = FlowSet::fixed(50_000);
        let ports: std::collections::HashSet<u16> =
            (0..50_000).map(|k| set.flow(k)).map(|(ip, p)| outer_src_port(ip, p)).collect();
        // A hash onto 65,535 values: collisions as a kernel's would have,
        // never port 0, and most flows on a port of their own.
        assert!(!ports.contains(&0));
        assert!(ports.len() > 30_000, "{} distinct ports for 50,000 flows", ports.len());
        let one = set.flow(0);
        assert_eq!(outer_src_port(one.0, one.1), outer_src_port(one.0, one.1));
    }

    #[test]
    fn flow_sets_spread_and_repeat_as_documented() {
        let one = FlowSet::fixed(1);
        assert_eq!(one.flow(0), (Ipv4Addr::new(198, 18, 1, 0), 1024));
        assert_eq!(one.flow(12345), one.flow(0));

        let many = FlowSet::fixed(50_000);
        assert_eq!((many.ips, many.ports), (200, 250));
        assert_eq!(many.flow(1), (Ipv4Addr::new(198, 18, 1, 1), 1024));
        assert_eq!(many.flow(200), (Ipv4Addr::new(198, 18, 1, 0), 1025));
        assert_eq!(many.flow(49_999), (Ipv4Addr::new(198, 18, 1, 199), 1273));
        assert_eq!(many.flow(50_000), many.flow(0));
        let distinct: std::collections::HashSet<_> = (0..50_000).map(|k| many.flow(k)).collect();
        assert_eq!(distinct.len(), 50_000);

        assert_eq!(many.flow_of_frame(7), 7, "round-robin by default");
        let trains = many.with_train(8);
        assert_eq!(
            (0..20).map(|n| trains.flow_of_frame(n)).collect::<Vec<_>>(),
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]
        );
        assert_eq!(many.with_train(0).train, 1);

        let fresh = FlowSet::new_flows();
        assert!(fresh.is_fresh_per_frame());
        assert_eq!(fresh.flow(16_384), (Ipv4Addr::new(198, 18, 1, 0), 1025));
        assert_eq!(fresh.flow(16_383), (Ipv4Addr::new(198, 18, 64, 255), 1024));
        let distinct: std::collections::HashSet<_> = (0..200_000).map(|k| fresh.flow(k)).collect();
        assert_eq!(distinct.len(), 200_000);
    }
}
