//! Flow keys, generic over the address family.
//!
//! A [`FlowKey`] is a packet's own 5-tuple as it appears on the wire, so one
//! key type serves both directions: an outbound packet is looked up by
//! (pod, remote, pod port, remote port) and a reply by (remote, egress,
//! remote port, egress port). Ports are kept in network byte order and every
//! field has alignment 1, so an IPv4 key is 13 bytes and an IPv6 key 37: the
//! session table's memory per entry stays small (see docs/benchmarks.md).
//!
//! For ICMP echo (RFC 5508 3.1) the identifier plays the port: a request is
//! keyed with the identifier as source port and 0 as destination port, a reply
//! with 0 as source port and the identifier as destination port.

use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::lpm::LpmAddr;

/// IP protocol numbers Egret translates.
pub mod proto {
    /// ICMP for IPv4.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
}

/// An IP address family Egret translates within (NAT44 or NAT66).
pub trait NatAddr: LpmAddr + Hash + Ord {
    /// Address length in bytes.
    const LEN: usize;
    /// The ICMP protocol number of this family.
    const ICMP_PROTO: u8;
    /// Whether this is IPv6.
    const IS_V6: bool;
    /// Atomic words holding a packed [`SessionTuple`] in a session slot.
    type AtomicWords: Default + AsRef<[std::sync::atomic::AtomicU64]> + Send + Sync + std::fmt::Debug;
    /// The plain form of `AtomicWords`.
    type Words: Default + Copy + AsRef<[u64]> + AsMut<[u64]> + PartialEq + std::fmt::Debug;
    /// Reads an address from the first `LEN` bytes of `b` (callers check the length).
    fn read(b: &[u8]) -> Self;
    /// Writes the address into the first `LEN` bytes of `out`.
    fn write(&self, out: &mut [u8]);
    /// Hashes a key with as few hasher calls as possible.
    fn hash_key<H: Hasher>(key: &FlowKey<Self>, h: &mut H);
    /// Packs a session tuple and a 32-bit meta word into words.
    fn pack(t: &SessionTuple<Self>, meta: u32) -> Self::Words;
    /// Unpacks a session tuple and its meta word.
    fn unpack(w: &Self::Words) -> (SessionTuple<Self>, u32);
    /// The address as a generic `IpAddr`.
    fn ip(&self) -> IpAddr {
        self.to_ip()
    }
    /// Extracts this family's address from a generic one.
    fn from_ip(ip: IpAddr) -> Option<Self>;
}

/// A packet's 5-tuple (ports in network byte order).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FlowKey<A> {
    /// Source address.
    pub src: A,
    /// Destination address.
    pub dst: A,
    sport: [u8; 2],
    dport: [u8; 2],
    /// IP protocol.
    pub proto: u8,
}

impl<A: NatAddr> FlowKey<A> {
    /// A key from host-order ports.
    #[inline]
    pub fn new(src: A, dst: A, sport: u16, dport: u16, proto: u8) -> Self {
        FlowKey { src, dst, sport: sport.to_be_bytes(), dport: dport.to_be_bytes(), proto }
    }

    /// Source port (or ICMP identifier of a request).
    #[inline]
    pub fn sport(&self) -> u16 {
        u16::from_be_bytes(self.sport)
    }

    /// Destination port (or ICMP identifier of a reply).
    #[inline]
    pub fn dport(&self) -> u16 {
        u16::from_be_bytes(self.dport)
    }
}

impl<A: NatAddr> Hash for FlowKey<A> {
    #[inline]
    fn hash<H: Hasher>(&self, h: &mut H) {
        A::hash_key(self, h)
    }
}

/// Everything that identifies a session: the pod's end, the remote end and
/// the external (egress) end. Both directions' keys derive from it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct SessionTuple<A> {
    /// The pod (inside) address.
    pub pod: A,
    /// The remote (outside) address.
    pub remote: A,
    /// The egress (external) address the pod appears as.
    pub egress: A,
    /// The pod's port (ICMP: the request identifier).
    pub pod_port: u16,
    /// The remote port (ICMP: 0).
    pub remote_port: u16,
    /// The external port (ICMP: the translated identifier).
    pub egress_port: u16,
    /// IP protocol.
    pub proto: u8,
}

impl<A: NatAddr> SessionTuple<A> {
    /// The key of packets from the pod (before translation).
    #[inline]
    pub fn outbound_key(&self) -> FlowKey<A> {
        FlowKey::new(self.pod, self.remote, self.pod_port, self.remote_port, self.proto)
    }

    /// The key of packets from the remote (before translation).
    #[inline]
    pub fn inbound_key(&self) -> FlowKey<A> {
        FlowKey::new(self.remote, self.egress, self.remote_port, self.egress_port, self.proto)
    }
}

impl NatAddr for Ipv4Addr {
    const LEN: usize = 4;
    const ICMP_PROTO: u8 = proto::ICMP;
    const IS_V6: bool = false;
    type AtomicWords = [std::sync::atomic::AtomicU64; 3];
    type Words = [u64; 3];

    #[inline]
    fn read(b: &[u8]) -> Self {
        let mut o = [0u8; 4];
        o.copy_from_slice(&b[..4]);
        Ipv4Addr::from(o)
    }

    #[inline]
    fn write(&self, out: &mut [u8]) {
        out[..4].copy_from_slice(&self.octets());
    }

    #[inline]
    fn hash_key<H: Hasher>(k: &FlowKey<Self>, h: &mut H) {
        let a = (u64::from(u32::from(k.src)) << 32) | u64::from(u32::from(k.dst));
        let b = (u64::from(u16::from_ne_bytes(k.sport)) << 24)
            | (u64::from(u16::from_ne_bytes(k.dport)) << 8)
            | u64::from(k.proto);
        h.write_u128((u128::from(a) << 64) | u128::from(b));
    }

    fn pack(t: &SessionTuple<Self>, meta: u32) -> [u64; 3] {
        [
            (u64::from(u32::from(t.pod)) << 32) | u64::from(u32::from(t.remote)),
            (u64::from(u32::from(t.egress)) << 32) | (u64::from(t.pod_port) << 16) | u64::from(t.remote_port),
            (u64::from(meta) << 24) | (u64::from(t.egress_port) << 8) | u64::from(t.proto),
        ]
    }

    fn unpack(w: &[u64; 3]) -> (SessionTuple<Self>, u32) {
        let t = SessionTuple {
            pod: Ipv4Addr::from((w[0] >> 32) as u32),
            remote: Ipv4Addr::from(w[0] as u32),
            egress: Ipv4Addr::from((w[1] >> 32) as u32),
            pod_port: (w[1] >> 16) as u16,
            remote_port: w[1] as u16,
            egress_port: (w[2] >> 8) as u16,
            proto: w[2] as u8,
        };
        (t, (w[2] >> 24) as u32)
    }

    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        }
    }
}

impl NatAddr for Ipv6Addr {
    const LEN: usize = 16;
    const ICMP_PROTO: u8 = proto::ICMPV6;
    const IS_V6: bool = true;
    type AtomicWords = [std::sync::atomic::AtomicU64; 8];
    type Words = [u64; 8];

    #[inline]
    fn read(b: &[u8]) -> Self {
        let mut o = [0u8; 16];
        o.copy_from_slice(&b[..16]);
        Ipv6Addr::from(o)
    }

    #[inline]
    fn write(&self, out: &mut [u8]) {
        out[..16].copy_from_slice(&self.octets());
    }

    #[inline]
    fn hash_key<H: Hasher>(k: &FlowKey<Self>, h: &mut H) {
        h.write_u128(u128::from(k.src));
        h.write_u128(u128::from(k.dst));
        let b = (u64::from(u16::from_ne_bytes(k.sport)) << 24)
            | (u64::from(u16::from_ne_bytes(k.dport)) << 8)
            | u64::from(k.proto);
        h.write_u64(b);
    }

    // An address is kept as its octets read as two native-endian words:
    // no byte swap either way (a `u128` of the address would cost two
    // swaps per address, and an established packet unpacks three).
    fn pack(t: &SessionTuple<Self>, meta: u32) -> [u64; 8] {
        let [p0, p1] = split_ne(t.pod);
        let [r0, r1] = split_ne(t.remote);
        let [e0, e1] = split_ne(t.egress);
        [
            p0,
            p1,
            r0,
            r1,
            e0,
            e1,
            (u64::from(t.pod_port) << 40)
                | (u64::from(t.remote_port) << 24)
                | (u64::from(t.egress_port) << 8)
                | u64::from(t.proto),
            u64::from(meta),
        ]
    }

    fn unpack(w: &[u64; 8]) -> (SessionTuple<Self>, u32) {
        let join = |a: u64, b: u64| {
            let mut o = [0u8; 16];
            o[..8].copy_from_slice(&a.to_ne_bytes());
            o[8..].copy_from_slice(&b.to_ne_bytes());
            Ipv6Addr::from(o)
        };
        let t = SessionTuple {
            pod: join(w[0], w[1]),
            remote: join(w[2], w[3]),
            egress: join(w[4], w[5]),
            pod_port: (w[6] >> 40) as u16,
            remote_port: (w[6] >> 24) as u16,
            egress_port: (w[6] >> 8) as u16,
            proto: w[6] as u8,
        };
        (t, w[7] as u32)
    }

    fn from_ip(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(a) => Some(a),
            IpAddr::V4(_) => None,
        }
    }
}

/// An IPv6 address's octets as two native-endian words (the session slot's
/// form, [`NatAddr::pack`]).
#[inline]
fn split_ne(a: Ipv6Addr) -> [u64; 2] {
    let o = a.octets();
    let mut w = [[0u8; 8]; 2];
    w[0].copy_from_slice(&o[..8]);
    w[1].copy_from_slice(&o[8..]);
    [u64::from_ne_bytes(w[0]), u64::from_ne_bytes(w[1])]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_compact() {
        assert_eq!(std::mem::size_of::<FlowKey<Ipv4Addr>>(), 13);
        assert_eq!(std::mem::size_of::<FlowKey<Ipv6Addr>>(), 37);
        assert_eq!(std::mem::align_of::<FlowKey<Ipv4Addr>>(), 1);
    }

    #[test]
    fn tuple_keys_match_packets_both_ways() {
        let t = SessionTuple {
            pod: Ipv4Addr::new(192, 0, 2, 10),
            remote: Ipv4Addr::new(203, 0, 113, 5),
            egress: Ipv4Addr::new(198, 51, 100, 1),
            pod_port: 40000,
            remote_port: 443,
            egress_port: 50000,
            proto: proto::TCP,
        };
        let o = t.outbound_key();
        assert_eq!((o.src, o.dst, o.sport(), o.dport()), (t.pod, t.remote, 40000, 443));
        let i = t.inbound_key();
        assert_eq!((i.src, i.dst, i.sport(), i.dport()), (t.remote, t.egress, 443, 50000));
    }

    #[test]
    fn packing_round_trips() {
        let t4 = SessionTuple {
            pod: Ipv4Addr::new(192, 0, 2, 10),
            remote: Ipv4Addr::new(203, 0, 113, 5),
            egress: Ipv4Addr::new(198, 51, 100, 1),
            pod_port: 65535,
            remote_port: 1,
            egress_port: 32768,
            proto: proto::UDP,
        };
        assert_eq!(Ipv4Addr::unpack(&Ipv4Addr::pack(&t4, 0xdead_beef)), (t4, 0xdead_beef));
        let t6 = SessionTuple {
            pod: "2001:db8:1::10".parse::<Ipv6Addr>().unwrap(),
            remote: "2001:db8:ffff::5".parse().unwrap(),
            egress: "2001:db8:e::1".parse().unwrap(),
            pod_port: 7,
            remote_port: 65535,
            egress_port: 60999,
            proto: proto::ICMPV6,
        };
        assert_eq!(Ipv6Addr::unpack(&Ipv6Addr::pack(&t6, 0x1234_5678)), (t6, 0x1234_5678));
    }

    #[test]
    fn distinct_keys_hash_differently() {
        let s = ahash::RandomState::with_seeds(1, 2, 3, 4);
        let a = FlowKey::new(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(203, 0, 113, 1), 1, 2, 6);
        let b = FlowKey::new(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(203, 0, 113, 1), 2, 1, 6);
        assert_ne!(s.hash_one(a), s.hash_one(b));
        assert_eq!(s.hash_one(a), s.hash_one(a));
    }
}
