//! The Rust twins of the steering program's map keys and values
//! (`src/bpf/egret_maps.h`) and of its verdict reasons (`src/bpf/verdict.h`).
//!
//! Every type is `#[repr(C)]` with explicit padding and no `bool`; each one
//! turns itself into the exact bytes the kernel stores with `to_bytes()`
//! (native endianness for host-order fields, network order where the C side
//! says `__be32` or holds addresses). The tests at the bottom compare size and
//! field offsets with the types libbpf-cargo generates from the compiled
//! object's BTF, and the reason enum with the numbering in `verdict.h`, so the
//! two sides cannot drift silently.

use std::net::{Ipv4Addr, Ipv6Addr};

/// `owned_addr.flags`: this gateway translates for the address (`OWNED_NAT`).
pub const OWNED_NAT: u32 = 1;
/// `owned_addr.flags`: this gateway answers ARP/NDP for it (`OWNED_NEIGH`).
pub const OWNED_NEIGH: u32 = 2;
/// `owned_addr.flags`: the address is also a Service VIP (Kubernetes): its
/// ports outside the NAT range, ICMP queries and other protocols are the
/// kernel's (`OWNED_KERNEL_SERVICE`). Without it they are dropped.
pub const OWNED_KERNEL_SERVICE: u32 = 4;

/// `if_role.role`: one-arm, pods and the outside on one link (`EGRET_ROLE_BOTH`).
pub const ROLE_BOTH: u32 = 0;
/// `if_role.role`: towards the pods (`EGRET_ROLE_INSIDE`).
pub const ROLE_INSIDE: u32 = 1;
/// `if_role.role`: towards the outside; never carries pods' traffic (`EGRET_ROLE_OUTSIDE`).
pub const ROLE_OUTSIDE: u32 = 2;
/// `if_role.flags`: pods' traffic only from the senders in `pod_macs` (`EGRET_IF_CHECK_SRC_MAC`).
pub const IF_CHECK_SRC_MAC: u32 = 1;

/// Value of `if_roles` (C `struct if_role`); the key is the ifindex, host order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IfRole {
    /// `ROLE_*`.
    pub role: u32,
    /// `IF_*`.
    pub flags: u32,
}

impl IfRole {
    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0..4].copy_from_slice(&self.role.to_ne_bytes());
        b[4..8].copy_from_slice(&self.flags.to_ne_bytes());
        b
    }
}

/// Key of `pod_macs` (C `struct pod_mac_key`): a link-layer sender allowed
/// to hand pods' traffic to the gateway on one interface.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PodMacKey {
    /// The interface, host order.
    pub ifindex: u32,
    /// The sender's MAC.
    pub mac: [u8; 6],
    /// Zero.
    pub pad: [u8; 2],
}

impl PodMacKey {
    /// The kernel's bytes for this key.
    pub fn to_bytes(&self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[0..4].copy_from_slice(&self.ifindex.to_ne_bytes());
        b[4..10].copy_from_slice(&self.mac);
        b
    }
}

/// `policy_rule.action`: leave the destination to the kernel (`POLICY_EXCLUDE`).
pub const POLICY_EXCLUDE: u32 = 0;
/// `policy_rule.action`: redirect to userspace (`POLICY_STEER`).
pub const POLICY_STEER: u32 = 1;

/// `frag_key.family` for IPv4.
pub const FAMILY_V4: u8 = 4;
/// `frag_key.family` for IPv6.
pub const FAMILY_V6: u8 = 6;

/// Queues of one interface slot in `xsks_map` (C `EGRET_XSK_QUEUES_PER_SLOT`):
/// the key of (slot, queue) is `slot * XSK_QUEUES_PER_SLOT + queue`.
pub const XSK_QUEUES_PER_SLOT: u32 = 256;

/// Value of `xsk_slots` (C `struct xsk_slot`); the key is the ifindex, host order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct XskSlot {
    /// The interface's slot in `xsks_map`.
    pub slot: u32,
}

impl XskSlot {
    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 4] {
        self.slot.to_ne_bytes()
    }
}

/// `owned_addr.valid_until_ns` / `fp_config.valid_until_ns`: no deadline
/// (C `EGRET_VALID_FOREVER`; file mode, where no Lease exists).
pub const VALID_FOREVER: u64 = u64::MAX;

/// Value of `owned_v4` / `owned_v6` (C `struct owned_addr`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnedAddr {
    /// First port of the NAT range, host order, inclusive.
    pub nat_port_lo: u16,
    /// Last port of the NAT range, host order, inclusive.
    pub nat_port_hi: u16,
    /// `OWNED_NAT` and/or `OWNED_NEIGH`.
    pub flags: u32,
    /// The address is served (answered for, translated to) only while the
    /// kernel's CLOCK_MONOTONIC (`bpf_ktime_get_ns`) is below this;
    /// [`VALID_FOREVER`]: no deadline (ADR 0004).
    pub valid_until_ns: u64,
}

impl Default for OwnedAddr {
    fn default() -> Self {
        Self { nat_port_lo: 0, nat_port_hi: 0, flags: 0, valid_until_ns: VALID_FOREVER }
    }
}

impl OwnedAddr {
    /// An egress address: translated for on `lo..=hi`, answered for.
    pub fn egress(nat_port_lo: u16, nat_port_hi: u16) -> Self {
        Self { nat_port_lo, nat_port_hi, flags: OWNED_NAT | OWNED_NEIGH, valid_until_ns: VALID_FOREVER }
    }

    /// A companion address (a next hop) that is only answered for.
    pub fn neighbour_only() -> Self {
        Self { nat_port_lo: 0, nat_port_hi: 0, flags: OWNED_NEIGH, valid_until_ns: VALID_FOREVER }
    }

    /// This value served only before `valid_until_ns` (CLOCK_MONOTONIC).
    pub fn valid_until(self, valid_until_ns: u64) -> Self {
        Self { valid_until_ns, ..self }
    }

    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..2].copy_from_slice(&self.nat_port_lo.to_ne_bytes());
        b[2..4].copy_from_slice(&self.nat_port_hi.to_ne_bytes());
        b[4..8].copy_from_slice(&self.flags.to_ne_bytes());
        b[8..16].copy_from_slice(&self.valid_until_ns.to_ne_bytes());
        b
    }

    /// Reads a value as the kernel stores it; `None` if the length is wrong.
    pub fn from_bytes(b: &[u8]) -> Option<Self> {
        let b: &[u8; 16] = b.try_into().ok()?;
        let mut until = [0u8; 8];
        until.copy_from_slice(&b[8..16]);
        Some(Self {
            nat_port_lo: u16::from_ne_bytes([b[0], b[1]]),
            nat_port_hi: u16::from_ne_bytes([b[2], b[3]]),
            flags: u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
            valid_until_ns: u64::from_ne_bytes(until),
        })
    }
}

/// Key of `owned_v6` (C `struct egret_in6`): an address in network order.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct In6Key {
    /// The address bytes, network order.
    pub addr: [u8; 16],
}

impl From<Ipv6Addr> for In6Key {
    fn from(addr: Ipv6Addr) -> Self {
        Self { addr: addr.octets() }
    }
}

/// Key of `owned_v4`: the C side uses a bare `__u32` holding the address in
/// network order, i.e. the address octets.
pub fn owned_v4_key(addr: Ipv4Addr) -> [u8; 4] {
    addr.octets()
}

/// Key of `policy_src_v4` (C `struct policy_src_v4_key`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicySrcV4Key {
    /// Source prefix length, 0..=32.
    pub prefixlen: u32,
    /// Source address, network order.
    pub addr: [u8; 4],
}

impl PolicySrcV4Key {
    /// The kernel's bytes for this key.
    pub fn to_bytes(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0..4].copy_from_slice(&self.prefixlen.to_ne_bytes());
        b[4..8].copy_from_slice(&self.addr);
        b
    }
}

/// Key of `policy_src_v6` (C `struct policy_src_v6_key`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicySrcV6Key {
    /// Source prefix length, 0..=128.
    pub prefixlen: u32,
    /// Source address, network order.
    pub addr: [u8; 16],
}

impl PolicySrcV6Key {
    /// The kernel's bytes for this key.
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[0..4].copy_from_slice(&self.prefixlen.to_ne_bytes());
        b[4..20].copy_from_slice(&self.addr);
        b
    }
}

/// Value of `policy_src_v4` / `policy_src_v6` (C `struct policy_class`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicyClass {
    /// The class the source prefix belongs to, host order.
    pub class_id: u32,
}

impl PolicyClass {
    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 4] {
        self.class_id.to_ne_bytes()
    }
}

/// Key of `policy_dst_v4` (C `struct policy_dst_v4_key`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicyDstV4Key {
    /// 32 (the class, matched exactly) + destination prefix length.
    pub prefixlen: u32,
    /// The class id in network order (C `__be32`): the trie compares bytes.
    pub class_id_be: [u8; 4],
    /// Destination address, network order.
    pub addr: [u8; 4],
}

impl PolicyDstV4Key {
    /// The key for destination prefix `addr/len` within class `class_id`.
    pub fn new(class_id: u32, addr: Ipv4Addr, len: u8) -> Self {
        Self { prefixlen: 32 + u32::from(len), class_id_be: class_id.to_be_bytes(), addr: addr.octets() }
    }

    /// The kernel's bytes for this key.
    pub fn to_bytes(&self) -> [u8; 12] {
        let mut b = [0u8; 12];
        b[0..4].copy_from_slice(&self.prefixlen.to_ne_bytes());
        b[4..8].copy_from_slice(&self.class_id_be);
        b[8..12].copy_from_slice(&self.addr);
        b
    }
}

/// Key of `policy_dst_v6` (C `struct policy_dst_v6_key`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicyDstV6Key {
    /// 32 (the class, matched exactly) + destination prefix length.
    pub prefixlen: u32,
    /// The class id in network order (C `__be32`).
    pub class_id_be: [u8; 4],
    /// Destination address, network order.
    pub addr: [u8; 16],
}

impl PolicyDstV6Key {
    /// The key for destination prefix `addr/len` within class `class_id`.
    pub fn new(class_id: u32, addr: Ipv6Addr, len: u8) -> Self {
        Self { prefixlen: 32 + u32::from(len), class_id_be: class_id.to_be_bytes(), addr: addr.octets() }
    }

    /// The kernel's bytes for this key.
    pub fn to_bytes(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0..4].copy_from_slice(&self.prefixlen.to_ne_bytes());
        b[4..8].copy_from_slice(&self.class_id_be);
        b[8..24].copy_from_slice(&self.addr);
        b
    }
}

/// Value of `policy_dst_v4` / `policy_dst_v6` (C `struct policy_rule`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct PolicyRule {
    /// `POLICY_EXCLUDE` or `POLICY_STEER`.
    pub action: u32,
    /// The policy that made the rule (for userspace; XDP does not read it).
    pub policy_id: u32,
}

impl PolicyRule {
    /// The kernel's bytes for this value.
    pub fn to_bytes(&self) -> [u8; 8] {
        let mut b = [0u8; 8];
        b[0..4].copy_from_slice(&self.action.to_ne_bytes());
        b[4..8].copy_from_slice(&self.policy_id.to_ne_bytes());
        b
    }
}

/// Key of `frag_decisions` (C `struct frag_key`): one IP datagram.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FragKey {
    /// Source address; IPv4 uses the first 4 bytes, the rest is zero.
    pub src: [u8; 16],
    /// Destination address; IPv4 uses the first 4 bytes.
    pub dst: [u8; 16],
    /// Identification, host order (IPv4's 16 bits widened).
    pub id: u32,
    /// Upper-layer protocol.
    pub proto: u8,
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// Explicit padding, zero.
    pub pad: [u8; 2],
}

/// Key of `nat_port_slots` (C `struct nat_port_key`): an egress address
/// and a protocol whose mapped ports `nat_port_bits` holds.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NatPortKey {
    /// The address; IPv4 uses the first 4 bytes, the rest is zero.
    pub addr: [u8; 16],
    /// `FAMILY_V4` or `FAMILY_V6`.
    pub family: u8,
    /// TCP (6) or UDP (17).
    pub proto: u8,
    /// Explicit padding, zero.
    pub pad: [u8; 2],
}

impl NatPortKey {
    /// The key of (`addr`, `proto`).
    pub fn new(addr: std::net::IpAddr, proto: u8) -> Self {
        let mut k = NatPortKey { proto, ..Default::default() };
        match addr {
            std::net::IpAddr::V4(a) => {
                k.addr[..4].copy_from_slice(&a.octets());
                k.family = FAMILY_V4;
            }
            std::net::IpAddr::V6(a) => {
                k.addr = a.octets();
                k.family = FAMILY_V6;
            }
        }
        k
    }

    /// The C layout's bytes.
    pub fn to_bytes(&self) -> [u8; 20] {
        let mut b = [0u8; 20];
        b[..16].copy_from_slice(&self.addr);
        b[16] = self.family;
        b[17] = self.proto;
        b
    }
}

/// Value of `nat_port_slots` (C `struct nat_port_slot`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NatPortSlot {
    /// The slot in `nat_port_bits`, below [`NAT_PORT_SLOTS`].
    pub slot: u32,
}

/// 64-bit words of `nat_port_bits` per slot (`EGRET_NAT_PORT_WORDS`).
pub const NAT_PORT_WORDS: u32 = 1024;
/// Slots of `nat_port_bits`: (egress address, protocol) pairs tracked
/// (`EGRET_NAT_PORT_SLOTS`).
pub const NAT_PORT_SLOTS: u32 = 256;

/// Value of `frag_decisions` (C `struct frag_decision`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FragDecision {
    /// The `VerdictReason` the first fragment was given.
    pub reason: u32,
}

/// What the XDP program returned (`enum xdp_action`, linux/bpf.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum XdpAction {
    /// `XDP_ABORTED` (0): a program error.
    Aborted,
    /// `XDP_DROP` (1).
    Drop,
    /// `XDP_PASS` (2): to the kernel's stack.
    Pass,
    /// `XDP_TX` (3): back out of the receiving interface (fast path, one-arm).
    Tx,
    /// `XDP_REDIRECT` (4): to the queue's AF_XDP socket, or (fast path) to
    /// another interface.
    Redirect,
    /// Any other value.
    Other(u32),
}

impl From<u32> for XdpAction {
    fn from(v: u32) -> Self {
        match v {
            0 => Self::Aborted,
            1 => Self::Drop,
            2 => Self::Pass,
            3 => Self::Tx,
            4 => Self::Redirect,
            other => Self::Other(other),
        }
    }
}

macro_rules! verdict_reasons {
    ($( $(#[$doc:meta])* $variant:ident = $value:literal, $c:literal, $name:literal, $action:ident; )*) => {
        /// Why the steering program returned its action: one counter slot per
        /// reason in `verdict_counters`. Mirrors `enum egret_verdict_reason`
        /// (`src/bpf/verdict.h`); the numbering is stable.
        #[repr(u32)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum VerdictReason {
            $( $(#[$doc])* $variant = $value, )*
        }

        impl VerdictReason {
            /// Every reason, in counter-index order.
            pub const ALL: &'static [VerdictReason] = &[$(VerdictReason::$variant,)*];

            /// The reason at counter index `index`, if any.
            pub fn from_index(index: u32) -> Option<Self> {
                match index {
                    $( $value => Some(Self::$variant), )*
                    _ => None,
                }
            }

            /// The counter index (the C enum value).
            pub fn index(self) -> u32 {
                self as u32
            }

            /// The metric label, e.g. `pass_not_ip`.
            pub fn name(self) -> &'static str {
                match self { $( Self::$variant => $name, )* }
            }

            /// The C enumerator, e.g. `EGRET_PASS_NOT_IP`.
            pub fn c_name(self) -> &'static str {
                match self { $( Self::$variant => $c, )* }
            }

            /// The XDP action a frame counted under this reason received.
            pub fn action(self) -> XdpAction {
                match self { $( Self::$variant => XdpAction::$action, )* }
            }
        }
    };
}

verdict_reasons! {
    /// Not IPv4/IPv6/ARP after at most one 802.1Q tag (rule 1).
    PassNotIp = 0, "EGRET_PASS_NOT_IP", "pass_not_ip", Pass;
    /// A header the rules needed was truncated or invalid.
    PassMalformed = 1, "EGRET_PASS_MALFORMED", "pass_malformed", Pass;
    /// ARP that is not an Ethernet/IPv4 request (rule 2).
    PassArpOther = 2, "EGRET_PASS_ARP_OTHER", "pass_arp_other", Pass;
    /// ARP request for a target not owned with `OWNED_NEIGH` (rule 2).
    PassArpNotOwned = 3, "EGRET_PASS_ARP_NOT_OWNED", "pass_arp_not_owned", Pass;
    /// ARP request for an owned target (rule 2).
    RedirectArpOwned = 4, "EGRET_REDIRECT_ARP_OWNED", "redirect_arp_owned", Redirect;
    /// Neighbor Solicitation for a target not owned (rule 3).
    PassNsNotOwned = 5, "EGRET_PASS_NS_NOT_OWNED", "pass_ns_not_owned", Pass;
    /// Neighbor Solicitation for an owned target (rule 3).
    RedirectNsOwned = 6, "EGRET_REDIRECT_NS_OWNED", "redirect_ns_owned", Redirect;
    /// Other Neighbor Discovery messages (rule 3).
    PassNdpOther = 7, "EGRET_PASS_NDP_OTHER", "pass_ndp_other", Pass;
    /// IPv6 with more extension headers than the program walks.
    PassIpv6ExtLimit = 8, "EGRET_PASS_IPV6_EXT_LIMIT", "pass_ipv6_ext_limit", Pass;
    /// TCP/UDP to an egress address, port in its NAT range (rule 4).
    RedirectNatPort = 9, "EGRET_REDIRECT_NAT_PORT", "redirect_nat_port", Redirect;
    /// TCP/UDP to an egress address, port outside its NAT range (rule 4).
    PassServicePort = 10, "EGRET_PASS_SERVICE_PORT", "pass_service_port", Pass;
    /// ICMP error or echo reply to an egress address (rule 4).
    RedirectIcmpToEgress = 11, "EGRET_REDIRECT_ICMP_TO_EGRESS", "redirect_icmp_to_egress", Redirect;
    /// Echo request or other ICMP query to an egress address (rule 4).
    PassIcmpQueryToEgress = 12, "EGRET_PASS_ICMP_QUERY_TO_EGRESS", "pass_icmp_query_to_egress", Pass;
    /// Another protocol to an egress address (rule 4).
    PassOtherProtoToEgress = 13, "EGRET_PASS_OTHER_PROTO_TO_EGRESS", "pass_other_proto_to_egress", Pass;
    /// Policy says steer (rule 5).
    RedirectSteeredSource = 14, "EGRET_REDIRECT_STEERED_SOURCE", "redirect_steered_source", Redirect;
    /// Policy says exclude (rule 5).
    PassExcludedDestination = 15, "EGRET_PASS_EXCLUDED_DESTINATION", "pass_excluded_destination", Pass;
    /// Source classified, no rule for the destination (rule 5).
    PassUnmatchedDestination = 16, "EGRET_PASS_UNMATCHED_DESTINATION", "pass_unmatched_destination", Pass;
    /// No policy selects the source (rule 5).
    PassUnselectedSource = 17, "EGRET_PASS_UNSELECTED_SOURCE", "pass_unselected_source", Pass;
    /// Later fragment following a stored redirect (rule 6).
    RedirectFragment = 18, "EGRET_REDIRECT_FRAGMENT", "redirect_fragment", Redirect;
    /// Later fragment following a stored pass (rule 6).
    PassFragment = 19, "EGRET_PASS_FRAGMENT", "pass_fragment", Pass;
    /// Later fragment, nothing stored, steered by policy (rule 6).
    RedirectFragmentSteeredSource = 20, "EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE", "redirect_fragment_steered_source", Redirect;
    /// Later fragment, nothing stored, not steered (rule 6).
    PassFragmentUnknown = 21, "EGRET_PASS_FRAGMENT_UNKNOWN", "pass_fragment_unknown", Pass;
    /// ARP/NS to redirect but no socket on the queue: left to the kernel (rule 7).
    PassNoSocketNeigh = 22, "EGRET_PASS_NO_SOCKET_NEIGH", "pass_no_socket_neigh", Pass;
    /// Inbound to the NAT but no socket on the queue (rule 7).
    DropNoSocketToEgress = 23, "EGRET_DROP_NO_SOCKET_TO_EGRESS", "drop_no_socket_to_egress", Drop;
    /// From a steered source but no socket on the queue: never leaked (rule 7).
    DropNoSocketSteered = 24, "EGRET_DROP_NO_SOCKET_STEERED", "drop_no_socket_steered", Drop;
    /// Translated by the fast path, sent back out of the receiving interface (rule 0).
    TxFastPath = 25, "EGRET_TX_FAST_PATH", "tx_fast_path", Tx;
    /// Translated by the fast path, redirected to another interface (rule 0).
    RedirectFastPath = 26, "EGRET_REDIRECT_FAST_PATH", "redirect_fast_path", Redirect;
    /// Rule 5a: a steered source on an outside interface (anti-spoofing).
    DropSteeredOnOutside = 27, "EGRET_DROP_STEERED_ON_OUTSIDE", "drop_steered_on_outside", Drop;
    /// Rule 5a: a steered source from a link-layer sender not in `pod_macs`.
    DropSteeredFromUnknownMac = 28, "EGRET_DROP_STEERED_FROM_UNKNOWN_MAC", "drop_steered_from_unknown_mac", Drop;
    /// Rule 5b: an ICMP error about a steered source's packet.
    RedirectIcmpErrorEmbedded = 29, "EGRET_REDIRECT_ICMP_ERROR_EMBEDDED", "redirect_icmp_error_embedded", Redirect;
    /// Rule 4: echo request to an egress address that is not a Service VIP.
    RedirectEchoToEgress = 30, "EGRET_REDIRECT_ECHO_TO_EGRESS", "redirect_echo_to_egress", Redirect;
    /// Rule 4: anything else Egret does not serve, to a non-VIP egress address.
    DropUnservedToEgress = 31, "EGRET_DROP_UNSERVED_TO_EGRESS", "drop_unserved_to_egress", Drop;
    /// Rule 6: a later fragment of a dropped datagram.
    DropFragment = 32, "EGRET_DROP_FRAGMENT", "drop_fragment", Drop;
    /// Rule 4: TCP/UDP to a NAT port no session maps (`nat_port_bits`).
    DropUnmappedNatPort = 33, "EGRET_DROP_UNMAPPED_NAT_PORT", "drop_unmapped_nat_port", Drop;
    /// Rules 2/3: ARP/NS for an owned target past its valid-until.
    DropNeighExpired = 34, "EGRET_DROP_NEIGH_EXPIRED", "drop_neigh_expired", Drop;
    /// Rule 4: to an owned egress address past its valid-until.
    DropEgressExpired = 35, "EGRET_DROP_EGRESS_EXPIRED", "drop_egress_expired", Drop;
    /// Rule 6: a later fragment to an egress address before its first: the workers hold it.
    RedirectFragmentToEgress = 36, "EGRET_REDIRECT_FRAGMENT_TO_EGRESS", "redirect_fragment_to_egress", Redirect;
    /// Rule 6: the same beyond the CPU's budget of orphan fragments.
    DropFragmentRate = 37, "EGRET_DROP_FRAGMENT_RATE", "drop_fragment_rate", Drop;
    /// Rule 0d: a node's VXLAN frame whose inner packet goes to the workers, whole.
    RedirectDecap = 38, "EGRET_REDIRECT_DECAP", "redirect_decap", Redirect;
    /// Rule 0d: a tunnel frame on an outside interface.
    DropDecapOutside = 39, "EGRET_DROP_DECAP_OUTSIDE", "drop_decap_outside", Drop;
    /// Rule 0d: a tunnel frame whose outer source is no Node's address (`node_addrs_v4/v6`).
    DropDecapUnknownNode = 40, "EGRET_DROP_DECAP_UNKNOWN_NODE", "drop_decap_unknown_node", Drop;
    /// Rule 0d: an outer IPv4 first fragment of a tunnel datagram.
    DropDecapFragment = 41, "EGRET_DROP_DECAP_FRAGMENT", "drop_decap_fragment", Drop;
    /// Rule 0d: outer lengths, the VXLAN header or the inner IP header not Egret's.
    DropDecapMalformed = 42, "EGRET_DROP_DECAP_MALFORMED", "drop_decap_malformed", Drop;
    /// Rule 0d: the inner frame is not untagged Ethernet carrying IPv4/IPv6.
    DropDecapNotIp = 43, "EGRET_DROP_DECAP_NOT_IP", "drop_decap_not_ip", Drop;
    /// Rule 0d: the inner packet is neither steered (rule 5/5b) nor to an egress address.
    DropDecapNotSteered = 44, "EGRET_DROP_DECAP_NOT_STEERED", "drop_decap_not_steered", Drop;
    /// Rule 0d: a tunnel frame, its program missing from `decap_prog` (or the tunnel switched off meanwhile).
    DropDecapUnavailable = 45, "EGRET_DROP_DECAP_UNAVAILABLE", "drop_decap_unavailable", Drop;
}

/// Number of reasons, the size of `verdict_counters` (`EGRET_VERDICT_COUNT`).
pub const VERDICT_COUNT: u32 = 46;

#[cfg(test)]
#[allow(unsafe_code, clippy::undocumented_unsafe_blocks, clippy::multiple_unsafe_ops_per_block)]
#[allow(clippy::all, clippy::pedantic, missing_debug_implementations, unused)]
pub(crate) mod skel {
    // Generated by build.rs from the compiled object; used only for its
    // BTF-derived `types` module.
    include!(concat!(env!("OUT_DIR"), "/steer.skel.rs"));
}

#[cfg(test)]
mod tests {
    use std::mem::{offset_of, size_of};

    use super::skel::types as c;
    use super::*;

    #[test]
    fn layouts_match_the_programs_btf() {
        same_layout!(
            OwnedAddr,
            c::owned_addr,
            [(nat_port_lo, nat_port_lo), (nat_port_hi, nat_port_hi), (flags, flags)]
        );
        same_layout!(In6Key, c::egret_in6, [(addr, addr)]);
        same_layout!(PolicySrcV4Key, c::policy_src_v4_key, [(prefixlen, prefixlen), (addr, addr)]);
        same_layout!(PolicySrcV6Key, c::policy_src_v6_key, [(prefixlen, prefixlen), (addr, addr)]);
        same_layout!(PolicyClass, c::policy_class, [(class_id, class_id)]);
        same_layout!(
            PolicyDstV4Key,
            c::policy_dst_v4_key,
            [(prefixlen, prefixlen), (class_id_be, class_id), (addr, addr)]
        );
        same_layout!(
            PolicyDstV6Key,
            c::policy_dst_v6_key,
            [(prefixlen, prefixlen), (class_id_be, class_id), (addr, addr)]
        );
        same_layout!(PolicyRule, c::policy_rule, [(action, action), (policy_id, policy_id)]);
        same_layout!(
            FragKey,
            c::frag_key,
            [(src, src), (dst, dst), (id, id), (proto, proto), (family, family), (pad, pad)]
        );
        same_layout!(FragDecision, c::frag_decision, [(reason, reason)]);
        same_layout!(NatPortKey, c::nat_port_key, [(addr, addr), (family, family), (proto, proto), (pad, pad)]);
        same_layout!(NatPortSlot, c::nat_port_slot, [(slot, slot)]);
        same_layout!(XskSlot, c::xsk_slot, [(slot, slot)]);
        same_layout!(IfRole, c::if_role, [(role, role), (flags, flags)]);
        same_layout!(PodMacKey, c::pod_mac_key, [(ifindex, ifindex), (mac, mac), (pad, pad)]);
    }

    #[test]
    fn to_bytes_lengths_match_the_layouts() {
        assert_eq!(OwnedAddr::default().to_bytes().len(), size_of::<OwnedAddr>());
        assert_eq!(PolicySrcV4Key::default().to_bytes().len(), size_of::<PolicySrcV4Key>());
        assert_eq!(PolicySrcV6Key::default().to_bytes().len(), size_of::<PolicySrcV6Key>());
        assert_eq!(PolicyClass::default().to_bytes().len(), size_of::<PolicyClass>());
        assert_eq!(PolicyDstV4Key::default().to_bytes().len(), size_of::<PolicyDstV4Key>());
        assert_eq!(PolicyDstV6Key::default().to_bytes().len(), size_of::<PolicyDstV6Key>());
        assert_eq!(PolicyRule::default().to_bytes().len(), size_of::<PolicyRule>());
    }

    #[test]
    fn to_bytes_puts_fields_where_c_reads_them() {
        let o = OwnedAddr {
            nat_port_lo: 0x0102,
            nat_port_hi: 0x0304,
            flags: 0x0506_0708,
            valid_until_ns: 0x1122_3344_5566_7788,
        };
        let b = o.to_bytes();
        assert_eq!(&b[offset_of!(OwnedAddr, nat_port_hi)..][..2], &0x0304u16.to_ne_bytes());
        assert_eq!(&b[offset_of!(OwnedAddr, flags)..][..4], &0x0506_0708u32.to_ne_bytes());
        assert_eq!(&b[offset_of!(OwnedAddr, valid_until_ns)..][..8], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(OwnedAddr::from_bytes(&b), Some(o));
        assert_eq!(OwnedAddr::from_bytes(&b[..15]), None);
        assert_eq!(OwnedAddr::default().valid_until_ns, VALID_FOREVER, "no deadline unless one is set");

        let k = PolicyDstV4Key::new(0x0a0b_0c0d, Ipv4Addr::new(192, 0, 2, 0), 24);
        assert_eq!(k.to_bytes(), [56, 0, 0, 0, 0x0a, 0x0b, 0x0c, 0x0d, 192, 0, 2, 0]);
        let k6 = PolicyDstV6Key::new(7, "2001:db8::".parse().unwrap_or(Ipv6Addr::UNSPECIFIED), 32);
        assert_eq!(&k6.to_bytes()[..12], &[64, 0, 0, 0, 0, 0, 0, 7, 0x20, 0x01, 0x0d, 0xb8]);
    }

    /// The XSKMAP stride in egret_maps.h, read mechanically.
    #[test]
    fn xsk_stride_matches_egret_maps_h() {
        let header = include_str!("bpf/egret_maps.h");
        let line = header
            .lines()
            .find_map(|l| l.trim().strip_prefix("#define EGRET_XSK_QUEUES_PER_SLOT "))
            .expect("EGRET_XSK_QUEUES_PER_SLOT is defined");
        let value: u32 = line.trim().trim_end_matches('u').parse().expect("numeric define");
        assert_eq!(value, XSK_QUEUES_PER_SLOT);
    }

    /// The enum in verdict.h, read mechanically, against `VerdictReason`.
    #[test]
    fn verdict_reasons_match_verdict_h() {
        let header = include_str!("bpf/verdict.h");
        let mut from_c = Vec::new();
        for line in header.lines() {
            let line = line.trim();
            let Some(rest) = line.strip_prefix("EGRET_") else { continue };
            let Some((name, value)) = rest.split_once(" = ") else { continue };
            let value: u32 = value.trim_end_matches(',').parse().expect("numeric enumerator");
            from_c.push((format!("EGRET_{name}"), value));
        }
        let count = from_c.iter().find(|(n, _)| n == "EGRET_VERDICT_COUNT").map(|(_, v)| *v);
        assert_eq!(count, Some(VERDICT_COUNT));
        let from_c: Vec<_> = from_c.into_iter().filter(|(n, _)| n != "EGRET_VERDICT_COUNT").collect();
        let from_rust: Vec<_> = VerdictReason::ALL.iter().map(|r| (r.c_name().to_string(), r.index())).collect();
        assert_eq!(from_c, from_rust);
        assert_eq!(VerdictReason::ALL.len() as u32, VERDICT_COUNT);
        for (i, r) in VerdictReason::ALL.iter().enumerate() {
            assert_eq!(r.index(), i as u32, "{r:?} is out of order");
            assert_eq!(VerdictReason::from_index(i as u32), Some(*r));
            assert_eq!(r.name(), r.c_name().trim_start_matches("EGRET_").to_ascii_lowercase());
            let expected_action = match r.name().split('_').next() {
                Some("pass") => XdpAction::Pass,
                Some("redirect") => XdpAction::Redirect,
                Some("drop") => XdpAction::Drop,
                Some("tx") => XdpAction::Tx,
                other => panic!("reason {other:?} does not start with an action"),
            };
            assert_eq!(r.action(), expected_action);
        }
        assert_eq!(VerdictReason::from_index(VERDICT_COUNT), None);
    }
}
