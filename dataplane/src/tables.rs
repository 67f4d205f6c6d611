//! The configuration snapshot the control plane publishes to the workers.
//!
//! The control plane (YAML file or Kubernetes) builds a plain, serialisable
//! [`TablesSpec`]; [`Tables::compile`] validates it and builds the lookup
//! structures; the engine swaps the new [`Tables`] in atomically (arc-swap),
//! so workers never take a lock to read configuration. A bad policy is
//! reported and left out; the other policies keep working. Bad global
//! settings reject the whole snapshot with an error naming the field and the
//! value.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ahash::{AHashMap, AHashSet};
use ipnet::IpNet;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::lpm::{LpmAddr, Prefix};
use crate::nat::key::NatAddr;
use crate::nat::port_alloc::PortRange;
use crate::nat::port_blocks::PortBlocks;
use crate::policy::{Classifier, Decision, PolicyId, PolicyRules};
use crate::stats::POLICY_COUNTER_SLOTS;
use crate::tunnel::Tunnel;

/// Endpoint mapping behaviour (RFC 4787 4.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MappingBehavior {
    /// One external (IP, port) per (pod, pod port), whatever the destination
    /// (RFC 4787 REQ-1). An egress IP then holds at most one mapping per port
    /// and protocol: about 28,000 concurrent pod ports per egress IP with the
    /// default range.
    #[default]
    EndpointIndependent,
    /// One external port may serve different destinations at once (the
    /// session's 5-tuple is what must be unique). Scales to far more sessions
    /// per egress IP, at the cost of RFC 4787 REQ-1: peer-to-peer traversal
    /// and protocols that tell a third party their mapped address break.
    EndpointDependent,
}

/// Inbound filtering behaviour (RFC 4787 5).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FilteringBehavior {
    /// A packet from outside passes only if the pod sent to that exact
    /// (address, port) before (RFC 4787 REQ-8's secure default).
    #[default]
    AddressAndPortDependent,
    /// Any outside endpoint may reach a mapped port (RFC 4787 REQ-8's
    /// transparency option). Needs endpoint-independent mapping.
    EndpointIndependent,
}

/// Idle timeouts in seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct Timeouts {
    /// UDP mapping (RFC 4787 REQ-5: at least 120; default 300).
    pub udp: u32,
    /// TCP established (RFC 5382 REQ-5: at least 7440 = 2 h 4 min).
    pub tcp_established: u32,
    /// TCP transitory: handshake, closing, reset (RFC 5382 REQ-5: 240 = 4 min).
    pub tcp_transitory: u32,
    /// ICMP query (RFC 5508 REQ-1: at least 60).
    pub icmp: u32,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { udp: 300, tcp_established: 7440, tcp_transitory: 240, icmp: 60 }
    }
}

/// Fragment handling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct FragmentSettings {
    /// Datagrams remembered at once (per address family).
    pub cache_entries: usize,
    /// How long a datagram's first-fragment translation is kept, in seconds.
    pub timeout: u32,
}

impl Default for FragmentSettings {
    fn default() -> Self {
        FragmentSettings { cache_entries: 8192, timeout: 2 }
    }
}

/// NAT behaviour and limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct NatSettings {
    /// Mapping behaviour.
    pub mapping: MappingBehavior,
    /// Filtering behaviour.
    pub filtering: FilteringBehavior,
    /// Default external port range of every egress IP.
    pub ports: PortRange,
    /// Bounded attempts of the port allocation's try-insert.
    pub port_alloc_attempts: u32,
    /// Session table capacity (per address family).
    pub max_sessions: usize,
    /// Sessions one source address may hold.
    pub max_sessions_per_source: u32,
    /// External ports one source address may hold per egress IP and
    /// protocol (mappings, or sessions in endpoint-dependent mode). `None`:
    /// a quarter of the egress IP's range ([`NatSettings::ports_per_source`]).
    pub max_ports_per_source: Option<u32>,
    /// New sessions one source address may create a second, per worker
    /// (token bucket, nat/flow_rate.rs); 0: no limit.
    pub new_flows_per_second_per_source: u32,
    /// The bucket's depth: new sessions one source may create at once.
    pub new_flow_burst_per_source: u32,
    /// Idle timeouts.
    pub timeouts: Timeouts,
    /// Fragments.
    pub fragments: FragmentSettings,
    /// Whether a pod may reach another pod's mapping through the egress IP (RFC 4787 REQ-9).
    pub hairpinning: bool,
    /// Whether a TCP segment without SYN may create a session (keeps
    /// connections across a gateway failover).
    pub tcp_loose_pickup: bool,
    /// Whether inbound UDP refreshes a mapping (RFC 4787 REQ-6 makes it optional).
    pub udp_inbound_refresh: bool,
    /// Port blocks for every egress IP that has none of its own
    /// ([`EgressIpSpec::port_blocks`]); `None`: one port at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_blocks: Option<PortBlocks>,
}

impl Default for NatSettings {
    fn default() -> Self {
        NatSettings {
            mapping: MappingBehavior::default(),
            filtering: FilteringBehavior::default(),
            ports: PortRange::default(),
            port_alloc_attempts: 64,
            max_sessions: 1 << 20,
            max_sessions_per_source: 65_536,
            max_ports_per_source: None,
            new_flows_per_second_per_source: 2_000,
            new_flow_burst_per_source: 4_000,
            timeouts: Timeouts::default(),
            fragments: FragmentSettings::default(),
            hairpinning: true,
            tcp_loose_pickup: true,
            udp_inbound_refresh: false,
            port_blocks: None,
        }
    }
}

impl NatSettings {
    /// The per-source port quota on an egress IP whose range is `range`:
    /// `maxPortsPerSource` if set, else a quarter of the range (at least
    /// one), so a single pod leaves three quarters of an egress IP's ports
    /// to the others.
    pub fn ports_per_source(&self, range: PortRange) -> u32 {
        self.max_ports_per_source.unwrap_or_else(|| (range.len() / 4).max(1))
    }
}

/// One policy as configured.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySpec {
    /// Unique name.
    pub name: String,
    /// Selected sources (pod IPs or CIDRs).
    pub sources: Vec<IpNet>,
    /// Selected destinations.
    pub destinations: Vec<IpNet>,
    /// Destinations excluded from `destinations`.
    #[serde(default)]
    pub except: Vec<IpNet>,
    /// The egress IPs, in a stable order (paired pooling hashes over them).
    pub egress_ips: Vec<IpAddr>,
}

impl PolicySpec {
    /// The address families ("IPv4", "IPv6") whose packets the policy
    /// selects (sources and destinations of the family) but has no egress
    /// IP for: they are dropped as `no_egress_ip_for_family`.
    pub fn families_without_egress_ip(&self) -> Vec<&'static str> {
        let has = |v4: bool, list: &[IpNet]| list.iter().any(|n| matches!(n, IpNet::V4(_)) == v4);
        [(true, "IPv4"), (false, "IPv6")]
            .into_iter()
            .filter(|(v4, _)| has(*v4, &self.sources) && has(*v4, &self.destinations))
            .filter(|(v4, _)| !self.egress_ips.iter().any(|ip| ip.is_ipv4() == *v4))
            .map(|(_, name)| name)
            .collect()
    }
}

/// An egress IP this gateway holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressIpSpec {
    /// The address.
    pub ip: IpAddr,
    /// Its external port range, if not the default.
    #[serde(default)]
    pub ports: Option<PortRange>,
    /// Whether this gateway answers ARP/NDP for it (false when another
    /// mechanism, such as the kernel or a load balancer, announces it).
    #[serde(default = "yes")]
    pub answer_neighbor: bool,
    /// Port blocks (ADR 0034 §6): each pod's sessions on this egress IP
    /// take ports from blocks of its own. `None`: one port at a time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_blocks: Option<PortBlocks>,
}

fn yes() -> bool {
    true
}

/// Everything the dataplane needs to know from the control plane.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct TablesSpec {
    /// Policies.
    pub policies: Vec<PolicySpec>,
    /// The egress IPs this gateway holds now.
    pub egress_ips: Vec<EgressIpSpec>,
    /// Further addresses to answer ARP/NDP for (companion next hops).
    pub neighbor_addresses: Vec<IpAddr>,
    /// NAT behaviour and limits.
    pub nat: NatSettings,
    /// Egress IPs that are also a Service's VIP (Kubernetes, the
    /// `egret.dev/egress` annotation): their ports outside the NAT range,
    /// ICMP queries and other protocols are the kernel's (Service ingress).
    /// Other egress IPs serve only NAT ports, ICMP errors and echo (answered
    /// by the workers) and drop the rest: the kernel does not own them.
    pub service_addresses: Vec<IpAddr>,
    /// Sources that reach this gateway only to be translated (Kubernetes:
    /// the cluster's pod CIDRs, which worker-node agents route here only for
    /// selected pods). Their forwarded traffic that Egret does not translate
    /// is dropped by the kernel's fail-closed table instead of leaving with
    /// a pod's own address: a pod the node agent already steers but this
    /// gateway does not know yet, or one no longer selected.
    pub guard: SourceGuard,
    /// The gateway node's own addresses (the daemon fills them in from the
    /// kernel, less the egress IPs it holds). A selected source's traffic
    /// to them is the kernel's, never translated: every policy excludes
    /// them. That is the kubelet, node-local services, and a pod's replies
    /// to connections this node's kube-proxy masqueraded to its own address
    /// (a LoadBalancer VIP's or NodePort's inbound traffic).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub local_addresses: Vec<IpAddr>,
    /// Frames from worker nodes in other subnets, through Egret's Geneve
    /// tunnel (docs/adr/0031-workers-in-any-subnet.md). None: off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<TunnelSpec>,
    /// Egress IPs this gateway no longer holds and handed over with a
    /// current session copy (Kubernetes with `kubernetes.ha`; set by the
    /// controller, `k8s/handed_over.rs`): revalidation records the
    /// removals of their sessions as `handed-over`, the local journal's
    /// only (docs/adr/0034-translation-logs.md §8).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handed_over: Vec<IpAddr>,
}

/// [`TablesSpec::tunnel`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TunnelSpec {
    /// The UDP port the nodes send to (`tunnel.port`).
    pub port: u16,
    /// The only outer sources accepted: every Node's InternalIPs
    /// (Kubernetes), or `tunnel.nodeAddresses` (the file).
    pub nodes: Vec<IpAddr>,
}

/// [`TablesSpec::guard`]: empty means off.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct SourceGuard {
    /// Interfaces where the guarded sources arrive (the gateway's own: pods
    /// on the gateway node itself come in through the CNI's devices and are
    /// not affected).
    pub interfaces: Vec<String>,
    /// Guarded source prefixes.
    pub sources: Vec<IpNet>,
}

/// A whole-snapshot error: the snapshot is rejected.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A port range is empty or starts at 0.
    #[error("{field}: invalid port range {first}-{last} (need 1 <= first <= last)")]
    InvalidPortRange {
        /// The field.
        field: String,
        /// First port.
        first: u16,
        /// Last port.
        last: u16,
    },
    /// A timeout is below its RFC minimum.
    #[error("{field}: {value} s is below the minimum of {min} s ({rfc})")]
    TimeoutTooShort {
        /// The field.
        field: &'static str,
        /// The value.
        value: u32,
        /// The minimum.
        min: u32,
        /// Which requirement.
        rfc: &'static str,
    },
    /// A number out of its allowed range.
    #[error("{field}: {value} is out of range ({allowed})")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value.
        value: u64,
        /// The allowed range.
        allowed: &'static str,
    },
    /// Endpoint-independent filtering needs endpoint-independent mapping.
    #[error("nat.filtering: endpoint-independent filtering needs nat.mapping: endpoint-independent")]
    FilteringNeedsEim,
    /// The tunnel's port lies in a range of NAT ports: replies to sessions
    /// mapped to it would be taken for the tunnel's frames.
    #[error("tunnel.port: {port} lies in {field} {first}-{last}; choose a port outside every NAT port range")]
    TunnelPortInNatRange {
        /// The tunnel's port.
        port: u16,
        /// The range's field.
        field: String,
        /// First port of the range.
        first: u16,
        /// Last port of the range.
        last: u16,
    },
    /// A block mode that does not fit the egress IP's range.
    #[error("{field}: {value} is invalid: need {need}")]
    InvalidPortBlocks {
        /// The field (`egressIPs[0].portBlocks.size`, ...).
        field: String,
        /// The value.
        value: u32,
        /// What it must be.
        need: String,
    },
    /// The same egress IP twice.
    #[error("egressIPs[{index}].ip: {ip} is listed twice")]
    DuplicateEgressIp {
        /// Index.
        index: usize,
        /// The address.
        ip: IpAddr,
    },
}

/// A policy left out of the snapshot, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("policies[{index}] ({name}): {field}: {message}")]
pub struct PolicyError {
    /// Position in the spec.
    pub index: usize,
    /// The policy's name.
    pub name: String,
    /// The field at fault.
    pub field: &'static str,
    /// What is wrong, with the value.
    pub message: String,
}

/// A compiled policy.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Its index.
    pub id: PolicyId,
    /// Its name.
    pub name: String,
    /// Its per-policy counter slot.
    pub counter_slot: u16,
    /// IPv4 egress IPs in configured order.
    pub egress_v4: Vec<Ipv4Addr>,
    /// IPv6 egress IPs in configured order.
    pub egress_v6: Vec<Ipv6Addr>,
    /// The spec it came from.
    pub spec: PolicySpec,
}

/// Paired pooling (RFC 4787 REQ-2): the egress IP of `pod` among `ips`, by
/// rendezvous (highest random weight) hashing, so a pod always gets the same
/// egress IP and adding or removing one IP moves only the pods that had it.
/// The score is `splitmix64(fnv1a64(pod octets ++ egress octets))`; anything
/// that routes pods to gateways (a node agent) must compute the same.
pub fn paired_egress<A: NatAddr>(pod: A, ips: &[A]) -> Option<A> {
    // The pod's octets open every string scored: hash them once and carry
    // the state on with each egress IP's (FNV-1a is a running state), the
    // same scores as `hrw_score(pod ++ egress)` for half the work. A new
    // flow pays this for every IP of its policy (paired_egress_matches_the_score).
    let mut octets = [0u8; 16];
    pod.write(&mut octets);
    let prefix = fnv1a(FNV_OFFSET, &octets[..A::LEN]);
    // The egress IPs of a pool mostly share all but their last octet (a
    // /24's, a /120's): the state after the head an IP shares with the one
    // before it is carried over, and only its last octet is hashed anew,
    // the same scores for less work (paired_egress_matches_the_score).
    // Heads are below 2^120: `u128::MAX` is no IP's.
    let (mut head, mut after_head) = (u128::MAX, 0);
    highest_scored(ips, |ip| {
        let bits = ip.sort_key();
        if bits >> 8 != head {
            ip.write(&mut octets);
            (head, after_head) = (bits >> 8, fnv1a(prefix, &octets[..A::LEN - 1]));
        }
        splitmix64(fnv1a(after_head, &[bits as u8]))
    })
}

/// The item of the highest `score`, ties to the higher item (paired
/// pooling's rule, which the node agent follows by calling
/// [`paired_egress`] too).
#[inline(always)]
fn highest_scored<T: Ord + Copy>(items: &[T], mut score: impl FnMut(&T) -> u64) -> Option<T> {
    let (first, rest) = items.split_first()?;
    let (mut best, mut best_score) = (first, score(first));
    for item in rest {
        let s = score(item);
        // A higher score is rare after the first few items (about ln n
        // times over n), an equal one rarer still: the items themselves
        // are compared only then, not on every one.
        if s >= best_score && (s > best_score || item > best) {
            (best, best_score) = (item, s);
        }
    }
    Some(*best)
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The splitmix64 finaliser.
fn splitmix64(mut h: u64) -> u64 {
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The rendezvous score of a byte string: `splitmix64(fnv1a64(bytes))`.
pub fn hrw_score(bytes: &[u8]) -> u64 {
    splitmix64(fnv1a(FNV_OFFSET, bytes))
}

impl Policy {
    /// The egress IP for `pod` of family `A` (paired pooling).
    pub fn egress_for<A: NatAddr + PolicyFamily>(&self, pod: A) -> Option<A> {
        paired_egress(pod, A::egress_list(self))
    }
}

/// A worker's memo of paired pooling (RFC 4787 REQ-2): the egress IP
/// [`paired_egress`] chose for a pod under a policy of one snapshot, so a
/// pod's next new flows do not score every egress IP again (64 of them cost
/// about 1,850 instructions here). Two-way set-associative, the set chosen
/// by a multiplicative hash of the pod's address, so that no layout of pod
/// addresses (a /24 or a /64 per node, a Calico block) folds many pods onto
/// few entries (ADR 0037's amendment); cleared when the snapshot changes
/// (its generation); only for policies of more than
/// [`EgressMemo::MIN_IPS`] egress IPs, below which scoring costs less than
/// the memo's line. The same answers as [`Policy::egress_for`]
/// (egress_memo_agrees_with_the_score).
#[derive(Debug)]
pub struct EgressMemo<A> {
    /// The snapshot the entries were made under.
    generation: u64,
    /// Empty until a policy first needs it; each set's first entry is its
    /// most recently used.
    sets: Vec<[MemoEntry<A>; 2]>,
}

/// An [`EgressMemo`] entry's policy when it holds none.
const NO_POLICY: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct MemoEntry<A> {
    /// The policy's index ([`NO_POLICY`]: none).
    policy: u32,
    pod: A,
    egress: A,
}

impl<A: NatAddr + PolicyFamily> Default for EgressMemo<A> {
    fn default() -> Self {
        EgressMemo { generation: 0, sets: Vec::new() }
    }
}

impl<A: NatAddr + PolicyFamily> EgressMemo<A> {
    /// Policies with more egress IPs than this use the memo.
    pub const MIN_IPS: usize = 4;
    /// Sets: 2^12 of two entries (96 KiB for IPv4, 288 KiB for IPv6, made
    /// on first use): 4,096 pods in turn miss 2 % of the time.
    const SET_BITS: u32 = 12;

    /// The egress IP of `pod` under `policy` of `tables` (as
    /// [`Policy::egress_for`]).
    #[inline]
    pub fn egress_for(&mut self, tables: &Tables, policy: &Policy, pod: A) -> Option<A> {
        let ips = A::egress_list(policy);
        if ips.len() <= Self::MIN_IPS {
            return paired_egress(pod, ips);
        }
        if self.generation != tables.generation || self.sets.is_empty() {
            self.reset(tables.generation);
        }
        let set = &mut self.sets[Self::set(pod)];
        let holds = |e: &MemoEntry<A>| e.policy == policy.id.0 && e.pod == pod;
        if holds(&set[0]) {
            return Some(set[0].egress);
        }
        if holds(&set[1]) {
            set.swap(0, 1);
            return Some(set[0].egress);
        }
        let egress = paired_egress(pod, ips)?;
        set[1] = set[0];
        set[0] = MemoEntry { policy: policy.id.0, pod, egress };
        Some(egress)
    }

    #[cold]
    fn reset(&mut self, generation: u64) {
        self.generation = generation;
        let empty = MemoEntry { policy: NO_POLICY, pod: A::from_bits_zero(), egress: A::from_bits_zero() };
        self.sets.clear();
        self.sets.resize(1 << Self::SET_BITS, [empty; 2]);
    }

    /// The pod's set: each 64-bit half of its address multiplied by an
    /// odd constant (Fibonacci hashing), the top bits of the two products
    /// XORed.
    #[inline]
    fn set(pod: A) -> usize {
        let k = pod.sort_key();
        let h = (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ ((k >> 64) as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
        (h >> (64 - Self::SET_BITS)) as usize
    }

    /// Whether the memo holds `pod`'s egress IP under `policy` (tests).
    #[cfg(test)]
    fn remembers(&self, policy: &Policy, pod: A) -> bool {
        self.sets.get(Self::set(pod)).is_some_and(|set| set.iter().any(|e| e.policy == policy.id.0 && e.pod == pod))
    }
}

/// Per-family access to a policy's egress list and the snapshot's classifier.
pub trait PolicyFamily: NatAddr {
    /// The policy's egress IPs of this family.
    fn egress_list(p: &Policy) -> &[Self];
    /// The snapshot's classifier of this family.
    fn classifier(t: &Tables) -> &Classifier<Self>;
}

impl PolicyFamily for Ipv4Addr {
    fn egress_list(p: &Policy) -> &[Self] {
        &p.egress_v4
    }
    fn classifier(t: &Tables) -> &Classifier<Self> {
        &t.classify_v4
    }
}

impl PolicyFamily for Ipv6Addr {
    fn egress_list(p: &Policy) -> &[Self] {
        &p.egress_v6
    }
    fn classifier(t: &Tables) -> &Classifier<Self> {
        &t.classify_v6
    }
}

/// An egress IP as compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EgressEntry {
    /// Its external port range.
    pub ports: PortRange,
    /// Whether this gateway answers ARP/NDP for it.
    pub answer_neighbor: bool,
    /// Also a Service VIP: what Egret does not serve is the kernel's
    /// (`TablesSpec::service_addresses`).
    pub kernel_service: bool,
    /// Port blocks, when in block mode (nat/port_blocks.rs).
    pub blocks: Option<PortBlocks>,
}

/// Stable per-policy counter slots: a policy name keeps its slot for the life
/// of the process, so per-policy counters stay monotonic across reloads.
#[derive(Debug, Default)]
pub struct PolicySlots {
    slots: Mutex<HashMap<String, u16>>,
}

impl PolicySlots {
    /// The slot of `name`, assigned on first use; past the limit every new
    /// name shares the last slot.
    pub fn slot(&self, name: &str) -> u16 {
        let mut m = self.slots.lock();
        if let Some(s) = m.get(name) {
            return *s;
        }
        let s = m.len().min(POLICY_COUNTER_SLOTS - 1) as u16;
        m.insert(name.to_string(), s);
        s
    }

    /// Every (name, slot) assigned so far.
    pub fn all(&self) -> Vec<(String, u16)> {
        self.slots.lock().iter().map(|(k, v)| (k.clone(), *v)).collect()
    }
}

/// The compiled snapshot.
#[derive(Debug, Default)]
pub struct Tables {
    /// Increases with every published snapshot.
    pub generation: u64,
    /// NAT behaviour and limits.
    pub nat: NatSettings,
    /// Policies by [`PolicyId`].
    pub policies: Vec<Policy>,
    /// IPv4 classification.
    pub classify_v4: Classifier<Ipv4Addr>,
    /// IPv6 classification.
    pub classify_v6: Classifier<Ipv6Addr>,
    egress: AHashMap<IpAddr, EgressEntry>,
    neighbor: AHashSet<IpAddr>,
    /// Policies left out, and why.
    pub errors: Vec<PolicyError>,
    /// The nodes' tunnel, when accepted.
    tunnel: Option<Tunnel>,
    /// The spec this was compiled from.
    pub spec: TablesSpec,
}

/// The tunnel of `spec`, its port checked against every NAT port range.
fn compile_tunnel(spec: &TablesSpec) -> Result<Option<Tunnel>, SpecError> {
    let Some(t) = &spec.tunnel else { return Ok(None) };
    if t.port == 0 {
        return Err(SpecError::OutOfRange { field: "tunnel.port", value: 0, allowed: "1-65535" });
    }
    let ranges = std::iter::once(("nat.ports".to_string(), spec.nat.ports)).chain(
        spec.egress_ips.iter().enumerate().filter_map(|(i, e)| e.ports.map(|r| (format!("egressIPs[{i}].ports"), r))),
    );
    for (field, r) in ranges {
        if (r.first..=r.last).contains(&t.port) {
            return Err(SpecError::TunnelPortInNatRange { port: t.port, field, first: r.first, last: r.last });
        }
    }
    Ok(Some(Tunnel::new(t.port, t.nodes.iter().copied())))
}

fn validate_range(field: String, r: PortRange) -> Result<(), SpecError> {
    if r.first == 0 || r.first > r.last {
        return Err(SpecError::InvalidPortRange { field, first: r.first, last: r.last });
    }
    Ok(())
}

/// Validates the global settings of a spec.
pub fn validate_settings(nat: &NatSettings) -> Result<(), SpecError> {
    validate_range("nat.ports".into(), nat.ports)?;
    let t = &nat.timeouts;
    let checks: [(&'static str, u32, u32, &'static str); 4] = [
        ("nat.timeouts.udp", t.udp, 120, "RFC 4787 REQ-5"),
        ("nat.timeouts.tcpEstablished", t.tcp_established, 7440, "RFC 5382 REQ-5"),
        ("nat.timeouts.tcpTransitory", t.tcp_transitory, 240, "RFC 5382 REQ-5"),
        ("nat.timeouts.icmp", t.icmp, 60, "RFC 5508 REQ-1"),
    ];
    for (field, value, min, rfc) in checks {
        if value < min {
            return Err(SpecError::TimeoutTooShort { field, value, min, rfc });
        }
    }
    if !(1..=1024).contains(&nat.port_alloc_attempts) {
        return Err(SpecError::OutOfRange {
            field: "nat.portAllocAttempts",
            value: u64::from(nat.port_alloc_attempts),
            allowed: "1-1024",
        });
    }
    if nat.max_sessions == 0 || nat.max_sessions > (1 << 31) - 1 {
        return Err(SpecError::OutOfRange {
            field: "nat.maxSessions",
            value: nat.max_sessions as u64,
            allowed: "1-2147483647",
        });
    }
    if nat.max_sessions_per_source == 0 {
        return Err(SpecError::OutOfRange { field: "nat.maxSessionsPerSource", value: 0, allowed: ">= 1" });
    }
    if let Some(q) = nat.max_ports_per_source.filter(|q| !(1..=65_536).contains(q)) {
        return Err(SpecError::OutOfRange { field: "nat.maxPortsPerSource", value: u64::from(q), allowed: "1-65536" });
    }
    if nat.new_flows_per_second_per_source > 10_000_000 {
        return Err(SpecError::OutOfRange {
            field: "nat.newFlowsPerSecondPerSource",
            value: u64::from(nat.new_flows_per_second_per_source),
            allowed: "0-10000000",
        });
    }
    if !(1..=10_000_000).contains(&nat.new_flow_burst_per_source) {
        return Err(SpecError::OutOfRange {
            field: "nat.newFlowBurstPerSource",
            value: u64::from(nat.new_flow_burst_per_source),
            allowed: "1-10000000",
        });
    }
    if nat.fragments.cache_entries == 0 || nat.fragments.cache_entries > 1 << 24 {
        return Err(SpecError::OutOfRange {
            field: "nat.fragments.cacheEntries",
            value: nat.fragments.cache_entries as u64,
            allowed: "1-16777216",
        });
    }
    if nat.fragments.timeout == 0 || nat.fragments.timeout > 60 {
        return Err(SpecError::OutOfRange {
            field: "nat.fragments.timeout",
            value: u64::from(nat.fragments.timeout),
            allowed: "1-60",
        });
    }
    if nat.filtering == FilteringBehavior::EndpointIndependent && nat.mapping != MappingBehavior::EndpointIndependent {
        return Err(SpecError::FilteringNeedsEim);
    }
    Ok(())
}

fn prefixes<A: LpmAddr>(nets: &[IpNet], pick: impl Fn(&IpNet) -> Option<(A, u8)>) -> Vec<Prefix<A>> {
    nets.iter().filter_map(|n| pick(n).map(|(a, l)| Prefix::new(a, l))).collect()
}

fn v4(n: &IpNet) -> Option<(Ipv4Addr, u8)> {
    match n {
        IpNet::V4(n) => Some((n.network(), n.prefix_len())),
        IpNet::V6(_) => None,
    }
}

fn v6(n: &IpNet) -> Option<(Ipv6Addr, u8)> {
    match n {
        IpNet::V6(n) => Some((n.network(), n.prefix_len())),
        IpNet::V4(_) => None,
    }
}

impl Tables {
    /// Validates and compiles a spec. Invalid policies are reported in
    /// `errors` and left out; invalid global settings reject the snapshot.
    pub fn compile(spec: &TablesSpec, generation: u64, slots: &PolicySlots) -> Result<Tables, SpecError> {
        validate_settings(&spec.nat)?;
        let mut egress = AHashMap::default();
        let mut neighbor = AHashSet::default();
        for (index, e) in spec.egress_ips.iter().enumerate() {
            let ports = e.ports.unwrap_or(spec.nat.ports);
            validate_range(format!("egressIPs[{index}].ports"), ports)?;
            let kernel_service = spec.service_addresses.contains(&e.ip);
            let blocks = e.port_blocks.or(spec.nat.port_blocks);
            if let Some(b) = blocks {
                b.validate(ports).map_err(|x| SpecError::InvalidPortBlocks {
                    field: if e.port_blocks.is_some() {
                        format!("egressIPs[{index}].portBlocks.{}", x.field)
                    } else {
                        format!(
                            "nat.portBlocks.{} (for egressIPs[{index}], ports {}-{})",
                            x.field, ports.first, ports.last
                        )
                    },
                    value: x.value,
                    need: x.need,
                })?;
            }
            let entry = EgressEntry { ports, answer_neighbor: e.answer_neighbor, kernel_service, blocks };
            if egress.insert(e.ip, entry).is_some() {
                return Err(SpecError::DuplicateEgressIp { index, ip: e.ip });
            }
            if e.answer_neighbor {
                neighbor.insert(e.ip);
            }
        }
        neighbor.extend(spec.neighbor_addresses.iter().copied());
        let tunnel = compile_tunnel(spec)?;

        let mut errors = Vec::new();
        let mut policies: Vec<Policy> = Vec::new();
        let mut order: Vec<usize> = (0..spec.policies.len()).collect();
        order.sort_by(|a, b| spec.policies[*a].name.cmp(&spec.policies[*b].name));
        let mut seen_names = AHashSet::default();
        for index in order {
            let p = &spec.policies[index];
            let err =
                |field: &'static str, message: String| PolicyError { index, name: p.name.clone(), field, message };
            if p.name.is_empty() {
                errors.push(err("name", "must not be empty".into()));
                continue;
            }
            if !seen_names.insert(p.name.clone()) {
                errors.push(err("name", format!("{:?} is used by another policy", p.name)));
                continue;
            }
            if p.sources.is_empty() {
                errors.push(err("sources", "must list at least one CIDR".into()));
                continue;
            }
            if p.destinations.is_empty() {
                errors.push(err("destinations", "must list at least one CIDR".into()));
                continue;
            }
            let egress_v4: Vec<Ipv4Addr> = p.egress_ips.iter().filter_map(|ip| Ipv4Addr::from_ip(*ip)).collect();
            let egress_v6: Vec<Ipv6Addr> = p.egress_ips.iter().filter_map(|ip| Ipv6Addr::from_ip(*ip)).collect();
            if egress_v4.is_empty() && egress_v6.is_empty() {
                errors.push(err("egressIPs", "must list at least one egress IP".into()));
                continue;
            }
            if let Some(s) = p.sources.iter().find(|s| s.addr().is_ipv4() && egress_v4.is_empty()) {
                errors.push(err("egressIPs", format!("no IPv4 egress IP for the IPv4 source {s}")));
                continue;
            }
            if let Some(s) = p.sources.iter().find(|s| s.addr().is_ipv6() && egress_v6.is_empty()) {
                errors.push(err("egressIPs", format!("no IPv6 egress IP for the IPv6 source {s}")));
                continue;
            }
            let mut dup = egress_v4.clone();
            dup.sort();
            dup.dedup();
            let mut dup6 = egress_v6.clone();
            dup6.sort();
            dup6.dedup();
            if dup.len() != egress_v4.len() || dup6.len() != egress_v6.len() {
                errors.push(err("egressIPs", "lists an address twice".into()));
                continue;
            }
            policies.push(Policy {
                id: PolicyId(policies.len() as u32),
                name: p.name.clone(),
                counter_slot: slots.slot(&p.name),
                egress_v4,
                egress_v6,
                spec: p.clone(),
            });
        }
        errors.sort_by_key(|e| e.index);

        // The node's own addresses are every policy's exceptions.
        let local: Vec<IpNet> = spec.local_addresses.iter().map(|a| IpNet::from(*a)).collect();
        let except = |p: &Policy| p.spec.except.iter().chain(&local).copied().collect::<Vec<IpNet>>();
        let rules_v4: Vec<PolicyRules<Ipv4Addr>> = policies
            .iter()
            .map(|p| PolicyRules {
                id: p.id,
                sources: prefixes(&p.spec.sources, v4),
                destinations: prefixes(&p.spec.destinations, v4),
                except: prefixes(&except(p), v4),
            })
            .filter(|r| !r.sources.is_empty())
            .collect();
        let rules_v6: Vec<PolicyRules<Ipv6Addr>> = policies
            .iter()
            .map(|p| PolicyRules {
                id: p.id,
                sources: prefixes(&p.spec.sources, v6),
                destinations: prefixes(&p.spec.destinations, v6),
                except: prefixes(&except(p), v6),
            })
            .filter(|r| !r.sources.is_empty())
            .collect();

        Ok(Tables {
            generation,
            nat: spec.nat,
            policies,
            classify_v4: Classifier::build(&rules_v4),
            classify_v6: Classifier::build(&rules_v6),
            egress,
            neighbor,
            errors,
            tunnel,
            spec: spec.clone(),
        })
    }

    /// The nodes' tunnel, when this gateway accepts it.
    #[inline]
    pub fn tunnel(&self) -> Option<&Tunnel> {
        self.tunnel.as_ref()
    }

    /// The egress IP entry if this gateway holds `ip`.
    #[inline]
    pub fn egress(&self, ip: IpAddr) -> Option<&EgressEntry> {
        self.egress.get(&ip)
    }

    /// Whether this gateway translates for `ip`.
    #[inline]
    pub fn owns_egress(&self, ip: IpAddr) -> bool {
        self.egress.contains_key(&ip)
    }

    /// Whether this gateway answers ARP/NDP for `ip`.
    #[inline]
    pub fn answers_neighbor(&self, ip: IpAddr) -> bool {
        self.neighbor.contains(&ip)
    }

    /// Every egress IP this gateway holds, with its entry.
    pub fn egress_ips(&self) -> impl Iterator<Item = (IpAddr, EgressEntry)> + '_ {
        self.egress.iter().map(|(k, v)| (*k, *v))
    }

    /// Every address this gateway answers ARP/NDP for.
    pub fn neighbor_addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.neighbor.iter().copied()
    }

    /// The policy with this id.
    #[inline]
    pub fn policy(&self, id: PolicyId) -> Option<&Policy> {
        self.policies.get(id.0 as usize)
    }

    /// Classifies (src, dst) in family `A`.
    #[inline]
    pub fn classify<A: PolicyFamily>(&self, src: A, dst: A) -> Decision {
        A::classifier(self).classify(src, dst)
    }

    /// The session-table generation tag (low 16 bits of the generation).
    #[inline]
    pub fn generation_tag(&self) -> u16 {
        self.generation as u16
    }

    /// Whether this gateway handed `ip` over with a current session copy
    /// ([`TablesSpec::handed_over`]). Asked only when a session is found
    /// invalid or expired, never per packet.
    pub fn handed_over(&self, ip: IpAddr) -> bool {
        self.spec.handed_over.contains(&ip)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_policy_names_the_family_it_selects_without_an_egress_ip() {
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let mut p = PolicySpec {
            name: "mixed".into(),
            sources: vec![net("198.18.0.0/16"), net("2001:db8:18::/48")],
            destinations: vec![net("0.0.0.0/0"), net("::/0")],
            except: Vec::new(),
            egress_ips: vec!["203.0.113.10".parse().unwrap()],
        };
        assert_eq!(p.families_without_egress_ip(), vec!["IPv6"]);
        p.destinations = vec![net("0.0.0.0/0")];
        assert!(p.families_without_egress_ip().is_empty(), "IPv6 destinations not selected: left to the kernel");
        p.destinations.push(net("::/0"));
        p.egress_ips.push("2001:db8:113::10".parse().unwrap());
        assert!(p.families_without_egress_ip().is_empty(), "one egress IP of each family");
    }

    use super::*;

    fn policy(name: &str, src: &str, dst: &str, egress: &[&str]) -> PolicySpec {
        PolicySpec {
            name: name.into(),
            sources: vec![src.parse().unwrap()],
            destinations: vec![dst.parse().unwrap()],
            except: vec![],
            egress_ips: egress.iter().map(|e| e.parse().unwrap()).collect(),
        }
    }

    fn spec(policies: Vec<PolicySpec>) -> TablesSpec {
        TablesSpec {
            policies,
            egress_ips: vec![EgressIpSpec {
                ip: "198.51.100.1".parse().unwrap(),
                ports: None,
                answer_neighbor: true,
                port_blocks: None,
            }],
            ..Default::default()
        }
    }

    /// The node's own addresses are the kernel's: a selected pod's frame to
    /// one of them is passed, never translated, in both families; other
    /// destinations are steered as before.
    #[test]
    fn the_nodes_own_addresses_are_every_policys_exceptions() {
        let mut s = spec(vec![
            policy("v4", "192.0.2.0/24", "0.0.0.0/0", &["198.51.100.1"]),
            policy("v6", "2001:db8::/64", "::/0", &["2001:db8:ff::1"]),
        ]);
        s.egress_ips.push(EgressIpSpec {
            ip: "2001:db8:ff::1".parse().unwrap(),
            ports: None,
            answer_neighbor: true,
            port_blocks: None,
        });
        let pod: Ipv4Addr = "192.0.2.10".parse().unwrap();
        let pod6: Ipv6Addr = "2001:db8::10".parse().unwrap();
        let node: Ipv4Addr = "203.0.113.21".parse().unwrap();
        let node6: Ipv6Addr = "2001:db8:113::21".parse().unwrap();
        let t = Tables::compile(&s, 1, &PolicySlots::default()).unwrap();
        assert!(matches!(t.classify(pod, node), Decision::Steer(_)), "without them: translated");
        s.local_addresses = vec![node.into(), node6.into()];
        let t = Tables::compile(&s, 1, &PolicySlots::default()).unwrap();
        assert_eq!(t.classify(pod, node), Decision::Excluded);
        assert_eq!(t.classify(pod6, node6), Decision::Excluded);
        assert!(matches!(t.classify(pod, "203.0.113.22".parse::<Ipv4Addr>().unwrap()), Decision::Steer(_)));
        assert!(matches!(t.classify(pod6, "2001:db8:113::22".parse::<Ipv6Addr>().unwrap()), Decision::Steer(_)));
    }

    #[test]
    fn a_bad_policy_is_reported_and_the_others_work() {
        let s = spec(vec![
            policy("good", "192.0.2.0/24", "0.0.0.0/0", &["198.51.100.1"]),
            policy("no-egress", "192.0.2.0/24", "0.0.0.0/0", &[]),
            policy("v6-without-v6-egress", "2001:db8::/64", "::/0", &["198.51.100.1"]),
            policy("good", "192.0.2.0/25", "0.0.0.0/0", &["198.51.100.1"]),
        ]);
        let t = Tables::compile(&s, 1, &PolicySlots::default()).unwrap();
        assert_eq!(t.policies.len(), 1);
        let msgs: Vec<String> = t.errors.iter().map(|e| e.to_string()).collect();
        assert_eq!(msgs.len(), 3, "{msgs:?}");
        assert!(msgs[0].contains("policies[1] (no-egress): egressIPs"), "{msgs:?}");
        assert!(msgs[1].contains("no IPv6 egress IP for the IPv6 source 2001:db8::/64"), "{msgs:?}");
        assert!(msgs[2].contains("policies[3] (good): name"), "{msgs:?}");
        assert_eq!(
            t.classify("192.0.2.9".parse::<Ipv4Addr>().unwrap(), "203.0.113.1".parse().unwrap()),
            Decision::Steer(PolicyId(0))
        );
    }

    #[test]
    fn global_errors_name_field_and_value() {
        let mut s = spec(vec![]);
        s.nat.timeouts.udp = 30;
        assert_eq!(
            Tables::compile(&s, 1, &PolicySlots::default()).unwrap_err().to_string(),
            "nat.timeouts.udp: 30 s is below the minimum of 120 s (RFC 4787 REQ-5)"
        );
        // Port blocks: the egress IP's own, else `nat.portBlocks`, checked
        // against the IP's range.
        let mut s = spec(vec![]);
        let blocks = PortBlocks { size: 64, max_per_pod: 2, log_sessions: false };
        s.nat.port_blocks = Some(blocks);
        let t = Tables::compile(&s, 1, &PolicySlots::default()).unwrap();
        assert_eq!(t.egress("198.51.100.1".parse().unwrap()).unwrap().blocks, Some(blocks));
        s.egress_ips[0].port_blocks = Some(PortBlocks { size: 12, ..blocks });
        assert_eq!(
            Tables::compile(&s, 1, &PolicySlots::default()).unwrap_err().to_string(),
            "egressIPs[0].portBlocks.size: 12 is invalid: need a power of two, at least 8"
        );
        s.egress_ips[0].port_blocks = None;
        s.egress_ips[0].ports = Some(PortRange { first: 1000, last: 1050 });
        assert_eq!(
            Tables::compile(&s, 1, &PolicySlots::default()).unwrap_err().to_string(),
            "nat.portBlocks.size (for egressIPs[0], ports 1000-1050): 64 is invalid: need no larger than the port \
             range 1000-1050, with one block aligned to its size inside it"
        );
        let mut s = spec(vec![]);
        s.egress_ips[0].ports = Some(PortRange { first: 2000, last: 1000 });
        assert_eq!(
            Tables::compile(&s, 1, &PolicySlots::default()).unwrap_err().to_string(),
            "egressIPs[0].ports: invalid port range 2000-1000 (need 1 <= first <= last)"
        );
        let mut s = spec(vec![]);
        s.nat.filtering = FilteringBehavior::EndpointIndependent;
        s.nat.mapping = MappingBehavior::EndpointDependent;
        assert_eq!(Tables::compile(&s, 1, &PolicySlots::default()).unwrap_err(), SpecError::FilteringNeedsEim);
        let mut s = spec(vec![]);
        s.egress_ips.push(s.egress_ips[0]);
        assert!(matches!(
            Tables::compile(&s, 1, &PolicySlots::default()),
            Err(SpecError::DuplicateEgressIp { index: 1, .. })
        ));
    }

    #[test]
    fn paired_egress_matches_the_score() {
        // The definition the node agent relies on: the highest
        // `hrw_score(pod ++ egress)`, ties to the higher address.
        fn naive<A: NatAddr>(pod: A, ips: &[A]) -> Option<A> {
            ips.iter().copied().max_by_key(|ip| {
                let mut b = [0u8; 32];
                pod.write(&mut b);
                ip.write(&mut b[A::LEN..]);
                (hrw_score(&b[..2 * A::LEN]), *ip)
            })
        }
        // Pinned: the score is a wire contract between gateways and nodes.
        assert_eq!(hrw_score(&[198, 18, 0, 1, 203, 0, 113, 10]), SCORE_PINNED);
        let v4: Vec<Ipv4Addr> = (0..64).map(|i| Ipv4Addr::new(203, 0, 113, 10 + i)).collect();
        let v6: Vec<Ipv6Addr> = (0..16u16).map(|i| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0x10 + i)).collect();
        let mixed: Vec<Ipv4Addr> = (0..12u8)
            .map(|i| {
                [Ipv4Addr::new(203, 0, 113, i), Ipv4Addr::new(198, 51, 100, i), Ipv4Addr::new(203, 0, 112, 255)]
                    [i as usize % 3]
            })
            .collect();
        let mixed6: Vec<Ipv6Addr> =
            (0..8u16).map(|i| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, i % 2, 0x10 + i)).collect();
        for i in 0..2000u32 {
            let pod = Ipv4Addr::from(0xC612_0000 + i * 7919);
            for n in [1, 2, 3, 64] {
                assert_eq!(paired_egress(pod, &v4[..n]), naive(pod, &v4[..n]), "{pod} over {n}");
            }
            let pod6 = Ipv6Addr::from(0x2001_0db8_0000_0000_0000_0000_0000_0000u128 + u128::from(i) * 104_729);
            assert_eq!(paired_egress(pod6, &v6), naive(pod6, &v6), "{pod6}");
            // Heads that change from one IP to the next, and come back.
            for ips in [&mixed[..], &mixed[1..], &mixed[..3]] {
                assert_eq!(paired_egress(pod, ips), naive(pod, ips), "{pod} over {ips:?}");
            }
            assert_eq!(paired_egress(pod6, &mixed6), naive(pod6, &mixed6), "{pod6}");
        }
    }

    #[test]
    fn a_tie_goes_to_the_higher_address() {
        // Scores of 64 bits never tie in practice, so the rule is checked
        // with a score that ties on purpose.
        let ips = [Ipv4Addr::new(203, 0, 113, 12), Ipv4Addr::new(203, 0, 113, 14), Ipv4Addr::new(203, 0, 113, 13)];
        assert_eq!(highest_scored(&ips, |_| 7), Some(ips[1]));
        assert_eq!(highest_scored(&ips, |ip| u64::from(ip.octets()[3] == 12)), Some(ips[0]));
        let score = |ip: &Ipv4Addr| u64::from(ip.octets()[3] != 14);
        assert_eq!(highest_scored(&ips, score), Some(ips[2]), "the higher of the two tied on the top score");
        assert_eq!(highest_scored::<Ipv4Addr>(&[], |_| 0), None);
    }

    #[test]
    fn egress_memo_agrees_with_the_score() {
        let ips = |n: u8, first: u8| -> Vec<String> { (0..n).map(|i| format!("203.0.113.{}", first + i)).collect() };
        fn as_str(v: &[String]) -> Vec<&str> {
            v.iter().map(String::as_str).collect()
        }
        let (many, few, moved) = (ips(64, 10), ips(3, 100), ips(63, 11));
        let slots = PolicySlots::default();
        let compile = |a: &[String], generation| {
            let v = spec(vec![
                policy("many", "198.18.0.0/16", "0.0.0.0/0", &as_str(a)),
                policy("few", "198.19.0.0/16", "0.0.0.0/0", &as_str(&few)),
                policy(
                    "v6",
                    "2001:db8:18::/48",
                    "::/0",
                    &["2001:db8::10", "2001:db8::11", "2001:db8::12", "2001:db8::13", "2001:db8::14", "2001:db8::15"],
                ),
            ]);
            Tables::compile(&v, generation, &slots).unwrap()
        };
        let (t1, t2) = (compile(&many, 1), compile(&moved, 2));
        assert_eq!((t1.policies.len(), t2.policies.len()), (3, 3), "every policy compiled");
        let (mut m4, mut m6) = (EgressMemo::<Ipv4Addr>::default(), EgressMemo::<Ipv6Addr>::default());
        // Pods 4,096 apart share an entry; each is asked twice, in turns.
        for t in [&t1, &t2, &t1] {
            for round in 0..2 {
                for i in 0..3000u32 {
                    let k = if round == 0 { i } else { (i * 4096) % 65_536 + i / 16 };
                    for (p, pod) in [(0, 0xC612_0000 + k), (1, 0xC613_0000 + k)] {
                        let (pod, policy) = (Ipv4Addr::from(pod), &t.policies[p]);
                        assert_eq!(m4.egress_for(t, policy, pod), policy.egress_for(pod), "{pod} {}", policy.name);
                    }
                    let pod6 = Ipv6Addr::from(0x2001_0db8_0018_0000_0000_0000_0000_0000u128 + u128::from(k) * 4096);
                    assert_eq!(m6.egress_for(t, &t.policies[2], pod6), t.policies[2].egress_for(pod6), "{pod6}");
                }
            }
        }
        // An IPv4 pod under the IPv6-only policy: none, as unmemoed.
        assert_eq!(m4.egress_for(&t1, &t1.policies[2], Ipv4Addr::new(198, 18, 0, 1)), None);
    }

    /// The memo's sets hold the pod layouts of real clusters: a /24 per
    /// node with pods from .2 (host-local IPAM), a /64 or an /80 per node
    /// (IPv6), Calico's blocks of 64, and a run of consecutive addresses.
    /// Its first version, direct-mapped by a fold of the address, put
    /// pods of nodes 16 apart in one entry: these layouts missed 49 to
    /// 100 % of the time.
    #[test]
    fn egress_memo_holds_the_pod_layouts_of_real_clusters() {
        /// A layout's name, and pod `p`'s address in it.
        type Layout<A> = (&'static str, fn(u32) -> A);
        let ips: Vec<String> = (0..8).map(|i| format!("203.0.113.{}", 10 + i)).collect();
        let ips6: Vec<String> = (0..8).map(|i| format!("2001:db8::{:x}", 0x10 + i)).collect();
        let (ips, ips6): (Vec<&str>, Vec<&str>) =
            (ips.iter().map(String::as_str).collect(), ips6.iter().map(String::as_str).collect());
        let v = spec(vec![policy("v4", "0.0.0.0/0", "0.0.0.0/0", &ips), policy("v6", "::/0", "::/0", &ips6)]);
        let t = Tables::compile(&v, 1, &PolicySlots::default()).unwrap();
        let (p4, p6) = (&t.policies[0], &t.policies[1]);
        // 1,000 pods: 31 nodes of 32, as a gateway sees a mid-sized cluster.
        let v4_layouts: [Layout<Ipv4Addr>; 2] = [
            ("a /24 per node", |p| Ipv4Addr::new(10, 244, (p / 32) as u8, (2 + p % 32) as u8)),
            ("consecutive", |p| Ipv4Addr::from(0xC612_0001 + p)),
        ];
        for (name, pod) in v4_layouts {
            let mut m = EgressMemo::<Ipv4Addr>::default();
            (0..1000).for_each(|p| assert_eq!(m.egress_for(&t, p4, pod(p)), p4.egress_for(pod(p))));
            let held = (0..1000).filter(|p| m.remembers(p4, pod(*p))).count();
            assert!(held >= 950, "{name}: {held} of 1,000 pods remembered");
        }
        let v6_layouts: [Layout<Ipv6Addr>; 4] = [
            ("a /64 per node", |p| Ipv6Addr::new(0xfd00, 0x10, 0x244, (p / 32) as u16, 0, 0, 0, (2 + p % 32) as u16)),
            ("an /80 per node", |p| Ipv6Addr::new(0xfd00, 0x10, 0x244, 0, (p / 32) as u16, 0, 0, (2 + p % 32) as u16)),
            ("Calico blocks of 64", |p| {
                Ipv6Addr::from(
                    0xfd00_0010_0244_0000_a1b2_c3d4_e5f6_0000u128 + u128::from(p / 64) * 64 + u128::from(p % 64),
                )
            }),
            ("IPv4's octets in IPv6", |p| {
                Ipv6Addr::new(0x2001, 0xdb8, 0x18, 0, 0, 0, (p >> 8) as u16, (p & 0xff) as u16)
            }),
        ];
        for (name, pod) in v6_layouts {
            let mut m = EgressMemo::<Ipv6Addr>::default();
            (0..1000).for_each(|p| assert_eq!(m.egress_for(&t, p6, pod(p)), p6.egress_for(pod(p))));
            let held = (0..1000).filter(|p| m.remembers(p6, pod(*p))).count();
            assert!(held >= 950, "{name}: {held} of 1,000 pods remembered");
        }
    }

    const SCORE_PINNED: u64 = 0x28a7_1b04_8b76_0dbd;

    #[test]
    fn paired_pooling_is_stable_and_spreads() {
        let ips: Vec<Ipv4Addr> = (1..=4).map(|i| Ipv4Addr::new(198, 51, 100, i)).collect();
        let mut counts = [0usize; 4];
        for i in 0..1000u32 {
            let pod = Ipv4Addr::from(0xC000_0200 + i);
            let e = paired_egress(pod, &ips).unwrap();
            assert_eq!(paired_egress(pod, &ips), Some(e), "same pod, same IP");
            counts[usize::from(e.octets()[3] - 1)] += 1;
            // Removing another IP does not move this pod.
            let other: Vec<Ipv4Addr> = ips.iter().copied().filter(|x| *x == e || x.octets()[3] != 4).collect();
            if e.octets()[3] != 4 {
                assert_eq!(paired_egress(pod, &other), Some(e));
            }
        }
        assert!(counts.iter().all(|c| *c > 150), "{counts:?}");
        assert_eq!(paired_egress::<Ipv4Addr>(Ipv4Addr::LOCALHOST, &[]), None);
    }

    #[test]
    fn counter_slots_survive_recompiles() {
        let slots = PolicySlots::default();
        let a = Tables::compile(&spec(vec![policy("b", "192.0.2.0/24", "0.0.0.0/0", &["198.51.100.1"])]), 1, &slots)
            .unwrap();
        let b = Tables::compile(
            &spec(vec![
                policy("a", "192.0.2.0/25", "0.0.0.0/0", &["198.51.100.1"]),
                policy("b", "192.0.2.0/24", "0.0.0.0/0", &["198.51.100.1"]),
            ]),
            2,
            &slots,
        )
        .unwrap();
        assert_eq!(a.policies[0].counter_slot, b.policies[1].counter_slot);
        assert_ne!(b.policies[0].counter_slot, b.policies[1].counter_slot);
    }

    #[test]
    fn spec_round_trips_through_json() {
        let s = spec(vec![policy("p", "192.0.2.0/24", "0.0.0.0/0", &["198.51.100.1"])]);
        let j = serde_json::to_string(&s).unwrap();
        assert!(j.contains("\"egressIps\"") || j.contains("\"egressIPs\""), "{j}");
        let back: TablesSpec = serde_json::from_str(&j).unwrap();
        assert_eq!(back, s);
    }
}
