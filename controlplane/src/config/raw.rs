//! The YAML file as written: serde types with `deny_unknown_fields`, every
//! optional field an `Option` (so the checker knows what was given), and
//! addresses, CIDRs, port ranges and durations as strings (so errors can
//! quote them). Field names follow `docs/config.md`.

use serde::Deserialize;

/// The whole file.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// `interfaces:`.
    #[serde(default)]
    pub interfaces: Vec<Interface>,
    /// `xdp:`.
    #[serde(default)]
    pub xdp: Xdp,
    /// `workers:`.
    #[serde(default)]
    pub workers: Workers,
    /// `egressIPs:`.
    #[serde(default, rename = "egressIPs")]
    pub egress_ips: Option<Vec<EgressIp>>,
    /// `neighborAddresses:`.
    #[serde(default)]
    pub neighbor_addresses: Option<Vec<String>>,
    /// `policies:`.
    #[serde(default)]
    pub policies: Option<Vec<Policy>>,
    /// `nat:`.
    #[serde(default)]
    pub nat: Nat,
    /// `admin:`.
    #[serde(default)]
    pub admin: Admin,
    /// `metrics:`.
    #[serde(default)]
    pub metrics: Metrics,
    /// `kubernetes:`.
    #[serde(default)]
    pub kubernetes: Option<Kubernetes>,
    /// `tunnel:`.
    #[serde(default)]
    pub tunnel: Option<Tunnel>,
    /// `translationLogs:`.
    #[serde(default)]
    pub translation_logs: Option<TranslationLogs>,
}

/// `translationLogs:` (docs/config.md, docs/adr/0034-translation-logs.md).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TranslationLogs {
    /// Default: true when the section is given.
    pub enabled: Option<bool>,
    /// Records per worker ring.
    pub ring_records: Option<u64>,
    /// Events per sink queue.
    pub queue_events: Option<u64>,
    /// Whether records carry the remote's address and port.
    pub log_destinations: Option<bool>,
    /// The enterprise number of Egret's own syslog SD-IDs and IPFIX
    /// elements, as written (checked by the validation, which names it).
    pub enterprise_number: Option<Scalar>,
    /// `ipfix:`.
    pub ipfix: Option<TranslationLogsIpfix>,
    /// `syslog:`.
    pub syslog: Option<TranslationLogsSyslog>,
    /// `journal:`.
    pub journal: Option<TranslationLogsJournal>,
}

/// `translationLogs.journal:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TranslationLogsJournal {
    /// Default: true.
    pub enabled: Option<bool>,
    /// A directory.
    pub dir: Option<String>,
    /// Bytes.
    pub max_bytes: Option<u64>,
    /// A duration.
    pub max_age: Option<String>,
}

/// `translationLogs.ipfix:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TranslationLogsIpfix {
    /// address:port.
    pub collector: Option<String>,
    /// The observation domain ID.
    pub observation_domain: Option<u32>,
    /// A duration.
    pub template_refresh: Option<String>,
    /// Largest message, bytes.
    pub mtu: Option<u64>,
}

/// `translationLogs.syslog:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TranslationLogsSyslog {
    /// address:port.
    pub collector: Option<String>,
    /// HOSTNAME.
    pub hostname: Option<String>,
    /// udp | tcp.
    pub transport: Option<String>,
}

/// `tunnel:` (docs/config.md: nodes in other subnets, docs/adr/0031).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Tunnel {
    /// Default: true in Kubernetes mode, true when the section is given.
    pub enabled: Option<bool>,
    /// The UDP port (default 6082).
    pub port: Option<u16>,
    /// Without Kubernetes: the nodes that may send.
    pub node_addresses: Option<Vec<String>>,
}

/// `interfaces[i]`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Interface {
    /// Interface name.
    #[serde(default)]
    pub name: Option<String>,
    /// `true`: the interface of the default route, instead of a name
    /// (`config/default_route.rs`).
    #[serde(default)]
    pub default_route: Option<bool>,
    /// inside | outside | both.
    pub role: Option<String>,
    /// "all" or a count.
    pub queues: Option<Queues>,
    /// Link-layer senders allowed to hand pods' traffic over on this
    /// interface (anti-spoofing; typically the node routers' MACs).
    pub pod_source_macs: Option<Vec<String>>,
}

/// `queues: all` or `queues: 2`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Queues {
    /// A count.
    Count(u64),
    /// A word ("all").
    Word(String),
}

/// `xdp:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Xdp {
    /// native | generic.
    pub mode: Option<String>,
    /// Fast path in XDP.
    pub fast_path: Option<bool>,
    /// Offloaded sessions: one count for each family, or one per family.
    pub fast_path_sessions: Option<FastPathSessions>,
}

/// `fastPathSessions: 262144` or `fastPathSessions: {ipv4: 262144, ipv6: 0}`.
/// Deserialized by hand: an untagged enum's error would name neither the
/// bad value nor the unknown key.
#[derive(Debug)]
pub enum FastPathSessions {
    /// The same count for both families.
    Each(u64),
    /// A count per family.
    PerFamily(FamilySessions),
}

/// `fastPathSessions: {ipv4: ..., ipv6: ...}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FamilySessions {
    /// IPv4 sessions.
    pub ipv4: Option<u64>,
    /// IPv6 sessions.
    pub ipv6: Option<u64>,
}

/// `workers:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Workers {
    /// CPUs to pin to.
    pub cpus: Option<Vec<usize>>,
    /// SCHED_FIFO priority.
    pub realtime_priority: Option<u32>,
    /// UMEM frame size.
    pub frame_size: Option<u32>,
    /// UMEM frames per worker.
    pub frames: Option<u32>,
    /// Ring size.
    pub ring_size: Option<u32>,
    /// RX batch.
    pub batch: Option<u32>,
}

/// `egressIPs[i]`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EgressIp {
    /// The address.
    pub ip: String,
    /// "first-last".
    pub ports: Option<String>,
    /// Answer ARP/NDP.
    pub answer_neighbor: Option<bool>,
    /// The kernel also serves the address (ports outside the NAT range).
    pub kernel_service: Option<bool>,
    /// Port blocks on this address (ADR 0034 §6).
    pub port_blocks: Option<RawPortBlocks>,
}

/// `portBlocks:` (`nat.portBlocks`, `egressIPs[i].portBlocks`).
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawPortBlocks {
    /// Ports per block.
    pub size: Option<u32>,
    /// Blocks per pod.
    pub max_per_pod: Option<u32>,
    /// Log sessions too.
    pub log_sessions: Option<bool>,
}

/// `policies[i]`.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Policy {
    /// Unique name.
    pub name: String,
    /// Source CIDRs.
    pub sources: Vec<String>,
    /// Destination CIDRs.
    pub destinations: Vec<String>,
    /// Excluded destinations.
    pub except: Option<Vec<String>>,
    /// Egress IPs.
    #[serde(rename = "egressIPs")]
    pub egress_ips: Vec<String>,
}

/// `nat:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Nat {
    /// endpoint-independent | endpoint-dependent.
    pub mapping: Option<String>,
    /// address-and-port-dependent | endpoint-independent.
    pub filtering: Option<String>,
    /// "first-last".
    pub ports: Option<String>,
    /// Port allocation attempts.
    pub port_alloc_attempts: Option<u32>,
    /// Session table capacity.
    pub max_sessions: Option<u64>,
    /// Sessions per source.
    pub max_sessions_per_source: Option<u32>,
    /// Ports per source, per egress IP and protocol (default: a quarter of the range).
    pub max_ports_per_source: Option<u32>,
    /// New sessions per source a second, per worker (0: no limit).
    pub new_flows_per_second_per_source: Option<u32>,
    /// New sessions per source at once (the bucket's depth).
    pub new_flow_burst_per_source: Option<u32>,
    /// Idle timeouts.
    pub timeouts: Option<RawTimeouts>,
    /// Fragments.
    pub fragments: Option<RawFragments>,
    /// Hairpinning.
    pub hairpinning: Option<bool>,
    /// TCP loose pick-up.
    pub tcp_loose_pickup: Option<bool>,
    /// Inbound UDP refreshes.
    pub udp_inbound_refresh: Option<bool>,
    /// Port blocks for every egress IP without its own.
    pub port_blocks: Option<RawPortBlocks>,
}

/// `nat.timeouts`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawTimeouts {
    /// UDP.
    pub udp: Option<u32>,
    /// TCP established.
    pub tcp_established: Option<u32>,
    /// TCP transitory.
    pub tcp_transitory: Option<u32>,
    /// ICMP.
    pub icmp: Option<u32>,
}

/// `nat.fragments`.
#[derive(Debug, Default, Clone, Copy, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RawFragments {
    /// Cache entries.
    pub cache_entries: Option<u64>,
    /// Timeout in seconds.
    pub timeout: Option<u32>,
}

/// `admin:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Admin {
    /// Unix socket path.
    pub socket: Option<String>,
}

/// `metrics:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Metrics {
    /// address:port.
    pub listen: Option<String>,
    /// Destinations and pods shown per egress IP and protocol.
    pub port_use_top: Option<u64>,
    /// How often port use is counted (a duration).
    pub port_use_refresh: Option<String>,
}

/// `kubernetes:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Kubernetes {
    /// Node name.
    pub node_name: Option<String>,
    /// Lease namespace.
    pub lease_namespace: Option<String>,
    /// e.g. "4s".
    pub lease_duration: Option<String>,
    /// e.g. "2s".
    pub renew_deadline: Option<String>,
    /// e.g. "500ms".
    pub retry_period: Option<String>,
    /// Kubeconfig path.
    pub kubeconfig: Option<String>,
    /// Label selector of gateway Nodes, e.g. "egret.dev/gateway=true".
    pub gateway_selector: Option<String>,
    /// Periodic full pass, e.g. "30s".
    pub resync_period: Option<String>,
    /// How egress IPs are owned: "liveness" (one liveness Lease per
    /// gateway, ADR 0016; the default) or "perIP" (each held IP's Lease
    /// renewed, ADR 0004).
    pub ownership: Option<String>,
    /// The cluster's pod CIDRs (the source guard).
    #[serde(rename = "clusterPodCIDRs")]
    pub cluster_pod_cidrs: Option<Vec<String>>,
    /// `kubernetes.ha:` the channel between gateways.
    pub ha: Option<Ha>,
}

/// `kubernetes.ha:`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Ha {
    /// TCP port of the channel on every gateway.
    pub port: Option<u16>,
    /// This gateway's address on the node network (default: `$HOST_IP`).
    pub address: Option<String>,
    /// File holding the shared key (at least 32 bytes).
    pub key_file: Option<String>,
    /// Files of keys also accepted while a new key rolls out (absent files
    /// are no key).
    pub accept_key_files: Option<Vec<String>>,
    /// A silent peer is considered unreachable after this, e.g. "1s".
    pub liveness: Option<String>,
    /// Full resynchronisation of every standby, e.g. "30s".
    pub resync_period: Option<String>,
    /// File keeping the last known peers across restarts.
    pub peer_cache: Option<String>,
    /// How long a holder no other gateway may vouch for keeps an IP
    /// through an API outage, e.g. "5m".
    pub lone_failsafe: Option<String>,
}

impl<'de> Deserialize<'de> for FastPathSessions {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Counts;
        impl<'de> serde::de::Visitor<'de> for Counts {
            type Value = FastPathSessions;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a session count, or {ipv4: count, ipv6: count}")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Self::Value, E> {
                Ok(FastPathSessions::Each(n))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Self::Value, E> {
                u64::try_from(n)
                    .map(FastPathSessions::Each)
                    .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(n), &self))
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, m: M) -> Result<Self::Value, M::Error> {
                FamilySessions::deserialize(serde::de::value::MapAccessDeserializer::new(m))
                    .map(FastPathSessions::PerFamily)
            }
        }
        d.deserialize_any(Counts)
    }
}

/// A scalar as written, for a field whose validation names the value
/// whatever it is (a number too large, negative, or not a number at all).
#[derive(Debug, Clone, PartialEq)]
pub struct Scalar(pub String);

impl Scalar {
    /// The value as a `u64`, if it is one.
    pub fn as_u64(&self) -> Option<u64> {
        self.0.parse().ok()
    }
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Text;
        impl<'de> serde::de::Visitor<'de> for Text {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a number")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Scalar, E> {
                Ok(Scalar(n.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Scalar, E> {
                Ok(Scalar(n.to_string()))
            }
            fn visit_u128<E: serde::de::Error>(self, n: u128) -> Result<Scalar, E> {
                Ok(Scalar(n.to_string()))
            }
            fn visit_i128<E: serde::de::Error>(self, n: i128) -> Result<Scalar, E> {
                Ok(Scalar(n.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Scalar, E> {
                Ok(Scalar(n.to_string()))
            }
            fn visit_bool<E: serde::de::Error>(self, b: bool) -> Result<Scalar, E> {
                Ok(Scalar(b.to_string()))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
        }
        d.deserialize_any(Text)
    }
}
