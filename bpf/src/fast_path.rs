//! The Rust twins of the fast path's map layouts (`src/bpf/egret_maps.h`,
//! the `fp_*` structs) and of its reasons (`src/bpf/fast_path_reason.h`).
//!
//! The fast path (rule 0 of the program, `src/bpf/fast_path.h`) translates
//! the packets of sessions the daemon installed: one [`FpKeyV4`]/[`FpKeyV6`]
//! -> [`FpEntryV4`]/[`FpEntryV6`] entry per direction, and a next-hop table
//! of [`FpNextHop`] the entries point into. The layouts are checked against
//! the compiled object's BTF and the reasons against the header, as
//! `maps.rs` does for the steering maps.

use std::net::{Ipv4Addr, Ipv6Addr};

/// Policy counter slots in `fp_policy_traffic` (C `EGRET_POLICY_SLOTS`; the
/// engine's `stats::POLICY_COUNTER_SLOTS`).
pub const POLICY_SLOTS: u32 = 1024;

/// `fp_entry_*.direction`: pod to remote (C `EGRET_DIR_OUTBOUND`).
pub const DIR_OUTBOUND: u8 = 0;
/// `fp_entry_*.direction`: remote to pod (C `EGRET_DIR_INBOUND`).
pub const DIR_INBOUND: u8 = 1;

/// `fp_next_hop.valid` for a usable next hop.
pub const NEXT_HOP_VALID: u32 = 1;

/// `fp_next_hop.flags`: a frame that arrived on the next hop's own
/// interface is punted, never sent back out of it (C
/// `EGRET_NEXT_HOP_NOT_BACK`; a two-arm gateway's outside link).
pub const NEXT_HOP_NOT_BACK: u32 = 1;

/// What a session key or entry takes an address from: `Ipv4Addr` (`N` = 4),
/// `Ipv6Addr` (16), or the octets themselves.
pub trait Octets<const N: usize>: Copy {
    /// The address in network order.
    fn octets(self) -> [u8; N];
}

impl Octets<4> for Ipv4Addr {
    fn octets(self) -> [u8; 4] {
        Ipv4Addr::octets(&self)
    }
}

impl Octets<16> for Ipv6Addr {
    fn octets(self) -> [u8; 16] {
        Ipv6Addr::octets(&self)
    }
}

impl<const N: usize> Octets<N> for [u8; N] {
    fn octets(self) -> [u8; N] {
        self
    }
}

/// Key of a session-table slot: a packet's 5-tuple as it arrives, with
/// `N`-byte addresses (C `struct fp_key_v4` for [`FpKeyV4`], `fp_key_v6` for
/// [`FpKeyV6`]). Addresses and ports are kept in network order, as in the
/// frame.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FpKey<const N: usize> {
    /// Source address, network order.
    pub src: [u8; N],
    /// Destination address, network order.
    pub dst: [u8; N],
    /// Source port, network order.
    pub sport: [u8; 2],
    /// Destination port, network order.
    pub dport: [u8; 2],
    /// IP protocol (6 or 17).
    pub proto: u8,
    /// Explicit padding, zero.
    pub pad: [u8; 3],
}

/// An IPv4 key (`fp_sessions_v4`).
pub type FpKeyV4 = FpKey<4>;
/// An IPv6 key (`fp_sessions_v6`).
pub type FpKeyV6 = FpKey<16>;

impl<const N: usize> Default for FpKey<N> {
    fn default() -> Self {
        Self { src: [0; N], dst: [0; N], sport: [0; 2], dport: [0; 2], proto: 0, pad: [0; 3] }
    }
}

impl<const N: usize> FpKey<N> {
    /// Size of the key as the kernel stores it.
    pub const LEN: usize = 2 * N + 8;

    /// The key of a packet `src:sport -> dst:dport` (host-order ports);
    /// `src` and `dst` are `Ipv4Addr`/`Ipv6Addr` or their octets.
    pub fn new(src: impl Octets<N>, dst: impl Octets<N>, sport: u16, dport: u16, proto: u8) -> Self {
        Self {
            src: src.octets(),
            dst: dst.octets(),
            sport: sport.to_be_bytes(),
            dport: dport.to_be_bytes(),
            proto,
            pad: [0; 3],
        }
    }

    /// Writes the kernel's bytes for this key into the front of `out` (at
    /// least [`Self::LEN`] long) and returns them.
    pub fn write_to<'b>(&self, out: &'b mut [u8]) -> &'b [u8] {
        let b = &mut out[..Self::LEN];
        b[..N].copy_from_slice(&self.src);
        b[N..2 * N].copy_from_slice(&self.dst);
        b[2 * N..2 * N + 2].copy_from_slice(&self.sport);
        b[2 * N + 2..2 * N + 4].copy_from_slice(&self.dport);
        b[2 * N + 4] = self.proto;
        b[2 * N + 5..].fill(0);
        b
    }

    /// The kernel's bytes for this key.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; Self::LEN];
        self.write_to(&mut b);
        b
    }
}

/// The part of an entry both families share, after the addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FpRewrite {
    /// Source port after translation, host order.
    pub new_sport: u16,
    /// Destination port after translation, host order.
    pub new_dport: u16,
    /// IPv4 header checksum delta (RFC 1624 form, host order; 0 for IPv6).
    pub l3_delta: u16,
    /// Transport checksum delta.
    pub l4_delta: u16,
    /// Index into `fp_next_hops`.
    pub next_hop: u32,
    /// Policy counter slot (below [`POLICY_SLOTS`]).
    pub policy_slot: u16,
    /// [`DIR_OUTBOUND`] or [`DIR_INBOUND`].
    pub direction: u8,
}

/// Entry of a session-table slot: one direction's rewrite, with `N`-byte
/// addresses (C `struct fp_entry_v4` for [`FpEntryV4`], `fp_entry_v6` for
/// [`FpEntryV6`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FpEntry<const N: usize> {
    /// Source address after translation.
    pub new_src: [u8; N],
    /// Destination address after translation.
    pub new_dst: [u8; N],
    /// Source port after translation, network order.
    pub new_sport: [u8; 2],
    /// Destination port after translation, network order.
    pub new_dport: [u8; 2],
    /// IPv4 header checksum delta, host order (0 for IPv6: no header checksum).
    pub l3_delta: u16,
    /// Transport checksum delta, host order.
    pub l4_delta: u16,
    /// Index into `fp_next_hops`.
    pub next_hop: u32,
    /// Policy counter slot.
    pub policy_slot: u16,
    /// `DIR_*`.
    pub direction: u8,
    /// Reserved, zero.
    pub flags: u8,
    /// CLOCK_MONOTONIC nanoseconds of the entry's last packet, written at
    /// most once a second by the program; 0 = none yet.
    pub last_seen_ns: u64,
}

/// An IPv4 entry.
pub type FpEntryV4 = FpEntry<4>;
/// An IPv6 entry.
pub type FpEntryV6 = FpEntry<16>;

impl<const N: usize> Default for FpEntry<N> {
    fn default() -> Self {
        Self::new([0; N], [0; N], &FpRewrite::default())
    }
}

impl<const N: usize> FpEntry<N> {
    /// Size of the entry as the kernel stores it.
    pub const LEN: usize = 2 * N + 24;

    /// An entry translating to `new_src -> new_dst` with `r`, never seen.
    pub fn new(new_src: impl Octets<N>, new_dst: impl Octets<N>, r: &FpRewrite) -> Self {
        Self {
            new_src: new_src.octets(),
            new_dst: new_dst.octets(),
            new_sport: r.new_sport.to_be_bytes(),
            new_dport: r.new_dport.to_be_bytes(),
            l3_delta: r.l3_delta,
            l4_delta: r.l4_delta,
            next_hop: r.next_hop,
            policy_slot: r.policy_slot,
            direction: r.direction,
            flags: 0,
            last_seen_ns: 0,
        }
    }

    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; Self::LEN];
        self.write_to(&mut b);
        b
    }

    /// Writes the kernel's bytes for this value into the front of `out` (at
    /// least [`Self::LEN`] long) and returns them.
    pub fn write_to<'b>(&self, out: &'b mut [u8]) -> &'b [u8] {
        let b = &mut out[..Self::LEN];
        b[..N].copy_from_slice(&self.new_src);
        b[N..2 * N].copy_from_slice(&self.new_dst);
        let t = &mut b[2 * N..];
        t[0..2].copy_from_slice(&self.new_sport);
        t[2..4].copy_from_slice(&self.new_dport);
        t[4..6].copy_from_slice(&self.l3_delta.to_ne_bytes());
        t[6..8].copy_from_slice(&self.l4_delta.to_ne_bytes());
        t[8..12].copy_from_slice(&self.next_hop.to_ne_bytes());
        t[12..14].copy_from_slice(&self.policy_slot.to_ne_bytes());
        t[14] = self.direction;
        t[15] = self.flags;
        t[16..24].copy_from_slice(&self.last_seen_ns.to_ne_bytes());
        b
    }

    /// Reads a value as the kernel stores it; `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != Self::LEN {
            return None;
        }
        let mut e = Self::default();
        e.new_src.copy_from_slice(&b[..N]);
        e.new_dst.copy_from_slice(&b[N..2 * N]);
        let t = &b[2 * N..];
        e.new_sport.copy_from_slice(&t[0..2]);
        e.new_dport.copy_from_slice(&t[2..4]);
        e.l3_delta = u16::from_ne_bytes([t[4], t[5]]);
        e.l4_delta = u16::from_ne_bytes([t[6], t[7]]);
        e.next_hop = u32::from_ne_bytes([t[8], t[9], t[10], t[11]]);
        e.policy_slot = u16::from_ne_bytes([t[12], t[13]]);
        e.direction = t[14];
        e.flags = t[15];
        let mut w = [0u8; 8];
        w.copy_from_slice(&t[16..24]);
        e.last_seen_ns = u64::from_ne_bytes(w);
        Some(e)
    }
}

/// Value of `fp_next_hops` (C `struct fp_next_hop`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FpNextHop {
    /// Output interface.
    pub ifindex: u32,
    /// The next hop's MAC.
    pub dst_mac: [u8; 6],
    /// The output interface's MAC.
    pub src_mac: [u8; 6],
    /// [`NEXT_HOP_VALID`] when usable; anything else makes the program punt.
    pub valid: u32,
    /// The output link's MTU: a larger IP datagram is punted to the engine,
    /// which answers Fragmentation Needed / Packet Too Big. 0: not checked.
    pub mtu: u32,
    /// [`NEXT_HOP_NOT_BACK`], or 0.
    pub flags: u32,
}

/// Size of [`FpNextHop`] as the kernel stores it.
pub const FP_NEXT_HOP_LEN: usize = 28;

impl FpNextHop {
    /// A resolved next hop.
    pub fn resolved(ifindex: u32, src_mac: [u8; 6], dst_mac: [u8; 6]) -> Self {
        Self { ifindex, dst_mac, src_mac, valid: NEXT_HOP_VALID, mtu: 0, flags: 0 }
    }

    /// This next hop with its link's MTU checked by the program.
    pub fn with_mtu(self, mtu: u32) -> Self {
        Self { mtu, ..self }
    }

    /// This next hop, which the program never uses for a frame that arrived
    /// on its own interface when `not_back` ([`NEXT_HOP_NOT_BACK`]).
    pub fn not_back(self, not_back: bool) -> Self {
        Self { flags: if not_back { NEXT_HOP_NOT_BACK } else { 0 }, ..self }
    }

    /// A next hop the program must not use (unresolved, or no route).
    pub fn invalid(ifindex: u32) -> Self {
        Self { ifindex, dst_mac: [0; 6], src_mac: [0; 6], valid: 0, mtu: 0, flags: 0 }
    }

    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; FP_NEXT_HOP_LEN] {
        let mut b = [0u8; FP_NEXT_HOP_LEN];
        b[0..4].copy_from_slice(&self.ifindex.to_ne_bytes());
        b[4..10].copy_from_slice(&self.dst_mac);
        b[10..16].copy_from_slice(&self.src_mac);
        b[16..20].copy_from_slice(&self.valid.to_ne_bytes());
        b[20..24].copy_from_slice(&self.mtu.to_ne_bytes());
        b[24..28].copy_from_slice(&self.flags.to_ne_bytes());
        b
    }

    /// Reads a value as the kernel stores it; `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        if b.len() != FP_NEXT_HOP_LEN {
            return None;
        }
        let mut n = Self { ifindex: u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), ..Self::default() };
        n.dst_mac.copy_from_slice(&b[4..10]);
        n.src_mac.copy_from_slice(&b[10..16]);
        n.valid = u32::from_ne_bytes([b[16], b[17], b[18], b[19]]);
        n.mtu = u32::from_ne_bytes([b[20], b[21], b[22], b[23]]);
        n.flags = u32::from_ne_bytes([b[24], b[25], b[26], b[27]]);
        Some(n)
    }
}

/// Value of `fp_config` (C `struct fp_config`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FpConfig {
    /// 1: the program runs the fast path; 0: it skips it.
    pub enabled: u32,
    /// `fp_sessions_v4` slots minus one (a power of two minus one).
    pub mask_v4: u32,
    /// `fp_sessions_v6` slots minus one.
    pub mask_v6: u32,
    /// Zero.
    pub pad: u32,
    /// The session tables' hash seed (`session_table::hash`).
    pub seed: u64,
    /// No entry is translated at or after this (CLOCK_MONOTONIC, read with
    /// the coarse clock); `maps::VALID_FOREVER`: no deadline.
    pub valid_until_ns: u64,
}

impl FpConfig {
    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[24..32].copy_from_slice(&self.valid_until_ns.to_ne_bytes());
        b[0..4].copy_from_slice(&self.enabled.to_ne_bytes());
        b[4..8].copy_from_slice(&self.mask_v4.to_ne_bytes());
        b[8..12].copy_from_slice(&self.mask_v6.to_ne_bytes());
        b[16..24].copy_from_slice(&self.seed.to_ne_bytes());
        b
    }
}

/// Value of `fp_policy_traffic` (C `struct fp_traffic`), one per CPU.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FpTraffic {
    /// Packets.
    pub packets: u64,
    /// Bytes (whole frames, as the engine counts them).
    pub bytes: u64,
}

macro_rules! fast_path_reasons {
    ($( $(#[$doc:meta])* $variant:ident = $value:literal, $c:literal, $name:literal; )*) => {
        /// What the fast path did with an IP frame it did not translate: one
        /// counter slot per reason in `fp_counters`. Mirrors
        /// `enum egret_fp_reason` (`src/bpf/fast_path_reason.h`).
        #[repr(u32)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum FastPathReason {
            $( $(#[$doc])* $variant = $value, )*
        }

        impl FastPathReason {
            /// Every reason, in counter-index order.
            pub const ALL: &'static [FastPathReason] = &[$(FastPathReason::$variant,)*];

            /// The counter index (the C enum value).
            pub fn index(self) -> u32 {
                self as u32
            }

            /// The metric label, e.g. `punt_ttl`.
            pub fn name(self) -> &'static str {
                match self { $( Self::$variant => $name, )* }
            }

            /// The C enumerator, e.g. `EGRET_FP_PUNT_TTL`.
            pub fn c_name(self) -> &'static str {
                match self { $( Self::$variant => $c, )* }
            }
        }
    };
}

fast_path_reasons! {
    /// Looked up, no session entry.
    Miss = 0, "EGRET_FP_MISS", "miss";
    /// An 802.1Q tag.
    SkipVlan = 1, "EGRET_FP_SKIP_VLAN", "skip_vlan";
    /// IPv4 options.
    SkipIpOptions = 2, "EGRET_FP_SKIP_IP_OPTIONS", "skip_ip_options";
    /// A fragment.
    SkipFragment = 3, "EGRET_FP_SKIP_FRAGMENT", "skip_fragment";
    /// IPv6 extension headers.
    SkipIpv6Ext = 4, "EGRET_FP_SKIP_IPV6_EXT", "skip_ipv6_ext";
    /// Neither TCP nor UDP.
    SkipNotTcpUdp = 5, "EGRET_FP_SKIP_NOT_TCP_UDP", "skip_not_tcp_udp";
    /// A hit the engine would count as malformed.
    PuntMalformed = 6, "EGRET_FP_PUNT_MALFORMED", "punt_malformed";
    /// A hit with TCP SYN, FIN or RST.
    PuntTcpControl = 7, "EGRET_FP_PUNT_TCP_CONTROL", "punt_tcp_control";
    /// A hit with TTL or hop limit <= 1.
    PuntTtl = 8, "EGRET_FP_PUNT_TTL", "punt_ttl";
    /// A hit whose transport checksum is partial.
    PuntPartialChecksum = 9, "EGRET_FP_PUNT_PARTIAL_CHECKSUM", "punt_partial_checksum";
    /// A hit whose next hop is not usable.
    PuntNextHop = 10, "EGRET_FP_PUNT_NEXT_HOP", "punt_next_hop";
    /// A hit at or after `fp_config.valid_until_ns` (an owned address's valid-until).
    PuntExpired = 11, "EGRET_FP_PUNT_EXPIRED", "punt_expired";
    /// A hit that arrived on its next hop's own interface, marked
    /// [`NEXT_HOP_NOT_BACK`] (a frame from outside with a pod's 5-tuple).
    PuntWrongLink = 12, "EGRET_FP_PUNT_WRONG_LINK", "punt_wrong_link";
}

/// Number of reasons, the size of `fp_counters` (`EGRET_FP_COUNT`).
pub const FAST_PATH_REASON_COUNT: u32 = 13;

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::*;
    use crate::maps::skel::types as c;

    #[test]
    fn layouts_match_the_programs_btf() {
        same_layout!(
            FpKeyV4,
            c::fp_key_v4,
            [(src, src), (dst, dst), (sport, sport), (dport, dport), (proto, proto), (pad, pad)]
        );
        same_layout!(
            FpKeyV6,
            c::fp_key_v6,
            [(src, src), (dst, dst), (sport, sport), (dport, dport), (proto, proto), (pad, pad)]
        );
        macro_rules! entry_layout {
            ($rust:ty, $c:ty) => {
                same_layout!(
                    $rust,
                    $c,
                    [
                        (new_src, new_src),
                        (new_dst, new_dst),
                        (new_sport, new_sport),
                        (new_dport, new_dport),
                        (l3_delta, l3_delta),
                        (l4_delta, l4_delta),
                        (next_hop, next_hop),
                        (policy_slot, policy_slot),
                        (direction, direction),
                        (flags, flags),
                        (last_seen_ns, last_seen_ns),
                    ]
                )
            };
        }
        entry_layout!(FpEntryV4, c::fp_entry_v4);
        entry_layout!(FpEntryV6, c::fp_entry_v6);
        same_layout!(
            FpNextHop,
            c::fp_next_hop,
            [(ifindex, ifindex), (dst_mac, dst_mac), (src_mac, src_mac), (valid, valid), (mtu, mtu), (flags, flags)]
        );
        same_layout!(
            FpConfig,
            c::fp_config,
            [(enabled, enabled), (mask_v4, mask_v4), (mask_v6, mask_v6), (pad, pad), (seed, seed)]
        );
        same_layout!(FpTraffic, c::fp_traffic, [(packets, packets), (bytes, bytes)]);
        assert_eq!(size_of::<FpEntryV4>(), FpEntryV4::LEN);
        assert_eq!(size_of::<FpEntryV6>(), FpEntryV6::LEN);
        assert_eq!(size_of::<FpKeyV4>(), FpKeyV4::LEN);
        assert_eq!(size_of::<FpKeyV6>(), FpKeyV6::LEN);
        assert_eq!(size_of::<FpNextHop>(), FP_NEXT_HOP_LEN);
    }

    #[test]
    fn bytes_put_fields_where_c_reads_them() {
        let r = FpRewrite {
            new_sport: 0x0102,
            new_dport: 0x0304,
            l3_delta: 0x0506,
            l4_delta: 0x0708,
            next_hop: 0x090a_0b0c,
            policy_slot: 0x0d0e,
            direction: DIR_INBOUND,
        };
        let mut e = FpEntryV4::new(Ipv4Addr::new(203, 0, 113, 10), Ipv4Addr::new(198, 51, 100, 7), &r);
        e.last_seen_ns = 0x1112_1314_1516_1718;
        let b = e.to_bytes();
        assert_eq!(&b[offset_of!(FpEntryV4, new_src)..][..4], &[203, 0, 113, 10]);
        assert_eq!(&b[offset_of!(FpEntryV4, new_sport)..][..2], &[1, 2], "ports in network order");
        assert_eq!(&b[offset_of!(FpEntryV4, l4_delta)..][..2], &0x0708u16.to_ne_bytes());
        assert_eq!(&b[offset_of!(FpEntryV4, next_hop)..][..4], &0x090a_0b0cu32.to_ne_bytes());
        assert_eq!(b[offset_of!(FpEntryV4, direction)], DIR_INBOUND);
        assert_eq!(&b[offset_of!(FpEntryV4, last_seen_ns)..][..8], &0x1112_1314_1516_1718u64.to_ne_bytes());
        assert_eq!(FpEntryV4::from_bytes(&b), Some(e));

        let e6 = FpEntryV6::new("2001:db8::1".parse().unwrap_or(Ipv6Addr::UNSPECIFIED), Ipv6Addr::LOCALHOST, &r);
        let b6 = e6.to_bytes();
        assert_eq!(&b6[offset_of!(FpEntryV6, new_dport)..][..2], &[3, 4]);
        assert_eq!(&b6[offset_of!(FpEntryV6, policy_slot)..][..2], &0x0d0eu16.to_ne_bytes());
        assert_eq!(FpEntryV6::from_bytes(&b6), Some(e6));

        let k = FpKeyV4::new(Ipv4Addr::new(1, 2, 3, 4), Ipv4Addr::new(5, 6, 7, 8), 0x1234, 0x5678, 17);
        assert_eq!(k.to_bytes(), [1, 2, 3, 4, 5, 6, 7, 8, 0x12, 0x34, 0x56, 0x78, 17, 0, 0, 0]);
        let n = FpNextHop::resolved(7, [1; 6], [2; 6]).with_mtu(1400);
        let nb = n.to_bytes();
        assert_eq!(&nb[offset_of!(FpNextHop, mtu)..][..4], &1400u32.to_ne_bytes());
        assert_eq!(&nb[offset_of!(FpNextHop, dst_mac)..][..6], &[2; 6]);
        assert_eq!(&nb[offset_of!(FpNextHop, src_mac)..][..6], &[1; 6]);
        assert_eq!(FpNextHop::from_bytes(&nb), Some(n));
    }

    /// The session tables' slots: `session_table`'s word layout is the C
    /// struct's, and its constants are the header's.
    #[test]
    fn session_table_slots_match_the_programs_btf_and_header() {
        use crate::session_table::{PROBES, SHAPE_V4, SHAPE_V6};
        macro_rules! slot {
            ($c:ty, $shape:expr) => {{
                let s = $shape;
                assert_eq!(size_of::<$c>(), s.slot_words * 8, "size of {}", stringify!($c));
                assert_eq!(offset_of!($c, seq), 0);
                assert_eq!(offset_of!($c, live), 4);
                assert_eq!(offset_of!($c, key), 8);
                assert_eq!(offset_of!($c, entry), 8 + s.key_words * 8);
                assert_eq!(
                    offset_of!($c, tcp_seen),
                    8 + (s.key_words + s.entry_words) * 8,
                    "tcp_seen follows the entry"
                );
                assert_eq!(size_of::<$c>() % 64, 0, "whole cache lines");
            }};
        }
        slot!(c::fp_slot_v4, SHAPE_V4);
        slot!(c::fp_slot_v6, SHAPE_V6);
        assert_eq!(size_of::<FpKeyV4>(), SHAPE_V4.key_words * 8);
        assert_eq!(size_of::<FpKeyV6>(), SHAPE_V6.key_words * 8);
        assert_eq!(FpEntryV4::LEN, SHAPE_V4.entry_words * 8);
        assert_eq!(FpEntryV6::LEN, SHAPE_V6.entry_words * 8);
        assert_eq!(offset_of!(FpEntryV4, last_seen_ns), FpEntryV4::LEN - 8, "the stamp is the entry's last word");
        assert_eq!(offset_of!(FpEntryV6, last_seen_ns), FpEntryV6::LEN - 8);

        let maps = include_str!("bpf/egret_maps.h");
        let probes = maps.lines().find_map(|l| l.trim().strip_prefix("#define EGRET_FP_PROBES ")).unwrap_or_default();
        assert_eq!(probes.trim().parse::<u32>().ok(), Some(PROBES));
        let fast = include_str!("bpf/fast_path.h");
        let mul = fast.lines().find_map(|l| l.trim().strip_prefix("#define EGRET_FP_HASH_MUL ")).unwrap_or_default();
        assert_eq!(mul.trim(), "0x9e3779b97f4a7c15ULL");
    }

    #[test]
    fn policy_slots_match_the_header() {
        let header = include_str!("bpf/egret_maps.h");
        let line =
            header.lines().find_map(|l| l.trim().strip_prefix("#define EGRET_POLICY_SLOTS ")).unwrap_or_default();
        assert_eq!(line.trim().trim_end_matches('u').parse::<u32>().ok(), Some(POLICY_SLOTS));
    }

    /// The enum in fast_path_reason.h, read mechanically.
    #[test]
    fn reasons_match_the_header() {
        let header = include_str!("bpf/fast_path_reason.h");
        let mut from_c = Vec::new();
        for line in header.lines() {
            let line = line.trim();
            let Some(rest) = line.strip_prefix("EGRET_FP_") else { continue };
            let Some((name, value)) = rest.split_once(" = ") else { continue };
            let value: u32 = value.trim_end_matches(',').parse().unwrap_or(u32::MAX);
            from_c.push((format!("EGRET_FP_{name}"), value));
        }
        let count = from_c.iter().find(|(n, _)| n == "EGRET_FP_COUNT").map(|(_, v)| *v);
        assert_eq!(count, Some(FAST_PATH_REASON_COUNT));
        let from_c: Vec<_> = from_c.into_iter().filter(|(n, _)| n != "EGRET_FP_COUNT").collect();
        let from_rust: Vec<_> = FastPathReason::ALL.iter().map(|r| (r.c_name().to_string(), r.index())).collect();
        assert_eq!(from_c, from_rust);
        for (i, r) in FastPathReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i as u32);
            assert_eq!(r.name(), r.c_name().trim_start_matches("EGRET_FP_").to_ascii_lowercase());
        }
    }
}
