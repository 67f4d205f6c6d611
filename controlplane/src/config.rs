//! The gateway's YAML configuration file (`docs/config.md` is the contract).
//!
//! Two steps, so that every error names the file, the field and the value:
//!
//! 1. [`raw`]: serde types that mirror the YAML exactly
//!    (`deny_unknown_fields`), with addresses, CIDRs and port ranges kept as
//!    strings. YAML syntax errors, unknown fields and wrong types come from
//!    the YAML parser with their line and column.
//! 2. [`load_str`] checks every value, collecting *all* problems with their
//!    field path (`policies[1].sources[0]`) and the bad value, builds the
//!    engine's [`TablesSpec`] and runs [`Tables::compile`] on it, mapping its
//!    errors the same way. A YAML file is written by a person: a policy the
//!    engine would skip is an error here, not a silent omission.
//!
//! The result, [`GatewayConfig`], holds the typed settings and the
//! [`TablesSpec`] the daemon applies through its `TablesSink`.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use egret_bpf::XdpMode;
use egret_dataplane::nat::port_alloc::PortRange;
use egret_dataplane::nat::port_blocks::PortBlocks;
use egret_dataplane::tables::{
    EgressIpSpec, FilteringBehavior, FragmentSettings, MappingBehavior, NatSettings, PolicySlots, PolicySpec, Tables,
    TablesSpec, Timeouts, TunnelSpec,
};
use ipnet::IpNet;

pub mod default_route;
pub mod raw;

/// One problem with a configuration file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{file}: cannot read: {message}")]
    Read {
        /// The file.
        file: String,
        /// The OS error.
        message: String,
    },
    /// Not valid YAML, an unknown field, or a value of the wrong type.
    #[error("{file}:{line}:{column}: {message}")]
    Syntax {
        /// The file.
        file: String,
        /// 1-based line (0 when the parser gave none).
        line: u64,
        /// 1-based column (0 when the parser gave none).
        column: u64,
        /// The parser's message.
        message: String,
    },
    /// A field's value is wrong.
    #[error("{file}: {path}: {value:?}: {reason}")]
    Invalid {
        /// The file.
        file: String,
        /// The field, e.g. `policies[1].sources[0]`.
        path: String,
        /// The value as written.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A rule that spans fields (roles of interfaces, Kubernetes mode).
    #[error("{file}: {path}: {reason}")]
    Rule {
        /// The file.
        file: String,
        /// The field.
        path: String,
        /// The rule broken.
        reason: String,
    },
}

/// Every problem found in one file (at least one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl std::fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// What an interface is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Towards the pods' nodes.
    Inside,
    /// Towards the outside world.
    Outside,
    /// One-arm: both.
    Both,
}

/// Which RX queues to serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Queues {
    /// Every RX queue the interface has.
    All,
    /// The first N queues.
    Count(u32),
}

/// An interface to attach to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InterfaceConfig {
    /// Its name.
    pub name: String,
    /// Its role.
    pub role: Role,
    /// Which queues to serve.
    pub queues: Queues,
    /// When not empty, pods' traffic (a selected source) is accepted on
    /// this interface only from these link-layer senders (the node
    /// routers); any other sender's is dropped (anti-spoofing, see
    /// docs/config.md). Inside and both interfaces only.
    #[serde(serialize_with = "serialize_macs")]
    pub pod_source_macs: Vec<[u8; 6]>,
}

fn serialize_macs<S: serde::Serializer>(macs: &[[u8; 6]], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(macs.iter().map(format_mac))
}

/// `02:00:00:00:00:01`.
pub fn format_mac(m: &[u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// Parses `02:00:00:00:00:01` (or `-` separated): six hexadecimal octets.
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let parts: Vec<&str> = text.split([':', '-']).collect();
    if parts.len() != 6 {
        return None;
    }
    let mut mac = [0u8; 6];
    for (o, p) in mac.iter_mut().zip(parts) {
        if p.is_empty() || p.len() > 2 {
            return None;
        }
        *o = u8::from_str_radix(p, 16).ok()?;
    }
    Some(mac)
}

/// `xdp:`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XdpConfig {
    /// Native or generic attach.
    pub mode: XdpMode,
    /// Translate established flows in XDP (docs/fast-path.md).
    pub fast_path: bool,
    /// Sessions the fast path can hold per address family (its tables hold
    /// one entry per direction); beyond, sessions stay in userspace.
    pub fast_path_sessions: FastPathSessions,
}

/// `xdp.fastPathSessions`, per address family. 0 leaves a family's flows to
/// the workers (its table is the smallest, 64 slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FastPathSessions {
    /// IPv4 sessions.
    pub ipv4: u32,
    /// IPv6 sessions.
    pub ipv6: u32,
}

impl FastPathSessions {
    /// The same count for both families.
    pub const fn both(n: u32) -> Self {
        Self { ipv4: n, ipv6: n }
    }
}

impl XdpConfig {
    /// What the fast path's tables are sized for at load: the configured
    /// sessions, or none (the smallest tables) with the fast path off.
    pub fn table_sessions(&self) -> FastPathSessions {
        if self.fast_path {
            self.fast_path_sessions
        } else {
            FastPathSessions::both(0)
        }
    }
}

/// Default of `xdp.fastPathSessions` (each family).
pub const DEFAULT_FAST_PATH_SESSIONS: u32 = 262_144;
/// Largest `xdp.fastPathSessions`: four table slots per session and family
/// (64 bytes each for IPv4, 128 for IPv6) make this 3 GiB of tables.
pub const MAX_FAST_PATH_SESSIONS: u64 = 1 << 22;

/// `workers:`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct WorkersConfig {
    /// CPUs to pin workers to, in queue order (cycled); empty: unpinned.
    pub cpus: Vec<usize>,
    /// SCHED_FIFO priority; 0 = normal scheduling.
    pub realtime_priority: u8,
    /// UMEM frame size (2048 or 4096).
    pub frame_size: u32,
    /// UMEM frames per worker.
    pub frames: u32,
    /// Size of each of the four rings (a power of two).
    pub ring_size: u32,
    /// Frames per RX batch.
    pub batch: u32,
}

/// `translationLogs:` when on (docs/config.md; translog/,
/// docs/adr/0034-translation-logs.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TranslationLogsConfig {
    /// Records each worker's ring holds (`ringRecords`).
    pub ring_records: usize,
    /// Events each sink's queue holds (`queueEvents`).
    pub queue_events: usize,
    /// Whether records carry the remote's address and port (`logDestinations`).
    pub log_destinations: bool,
    /// The enterprise number of Egret's own syslog SD-IDs and IPFIX elements (`enterpriseNumber`).
    pub enterprise_number: u32,
    /// IPFIX, when configured.
    pub ipfix: Option<IpfixConfig>,
    /// Syslog, when configured.
    pub syslog: Option<SyslogConfig>,
    /// The local journal `egret who-had` reads; on unless
    /// `journal.enabled: false`.
    pub journal: Option<JournalConfig>,
}

/// `translationLogs.journal:` (translog/journal.rs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalConfig {
    /// Where the segments are written (`dir`).
    pub dir: PathBuf,
    /// All segments together, bytes (`maxBytes`).
    pub max_bytes: u64,
    /// The oldest record kept (`maxAge`).
    pub max_age: Duration,
}

/// Default `portBlocks.size` (ADR 0034 §6's example).
pub const DEFAULT_BLOCK_SIZE: u16 = 128;
/// Default `portBlocks.maxPerPod`.
pub const DEFAULT_BLOCKS_PER_POD: u16 = 8;

/// Default `translationLogs.journal.dir`.
pub const DEFAULT_JOURNAL_DIR: &str = "/var/lib/egret/translog";
/// Default `translationLogs.journal.maxBytes`: 1 GiB.
pub const DEFAULT_JOURNAL_MAX_BYTES: u64 = 1 << 30;
/// Default `translationLogs.journal.maxAge`: 24 h.
pub const DEFAULT_JOURNAL_MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// Smallest `maxBytes`: 1 MiB.
pub const MIN_JOURNAL_BYTES: u64 = 1 << 20;
/// Largest `maxAge`: 366 days.
pub const MAX_JOURNAL_AGE: Duration = Duration::from_secs(366 * 24 * 3600);

/// `translationLogs.ipfix:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IpfixConfig {
    /// Where messages go (UDP).
    pub collector: SocketAddr,
    /// The observation domain; `None`: a hash of the node's name.
    pub observation_domain: Option<u32>,
    /// How often templates are sent again.
    pub template_refresh: Duration,
    /// The largest message, bytes.
    pub mtu: usize,
}

/// `translationLogs.syslog:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyslogConfig {
    /// Where messages go.
    pub collector: SocketAddr,
    /// HOSTNAME; `None`: the node's name.
    pub hostname: Option<String>,
    /// UDP (RFC 5426) or TCP with octet counting (RFC 6587).
    pub transport: SyslogTransport,
}

/// `translationLogs.syslog.transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyslogTransport {
    /// A datagram per message (RFC 5426).
    Udp,
    /// A TCP stream, messages framed by their length (RFC 6587 §3.4.1).
    Tcp,
}

/// Default `translationLogs.ringRecords` (ADR 0034 §2: 32 ms of slack at
/// 1 M new flows per second per worker).
pub const DEFAULT_RING_RECORDS: u64 = 65_536;
/// Default `translationLogs.queueEvents`.
pub const DEFAULT_QUEUE_EVENTS: u64 = 262_144;
/// Largest `ringRecords` and `queueEvents`.
pub const MAX_TRANSLOG_QUEUE: u64 = 1 << 24;
/// RFC 5612's documentation enterprise number: the default until Egret has its own.
pub const DEFAULT_ENTERPRISE_NUMBER: u32 = 32_473;

/// `kubernetes:` (the Kubernetes control plane reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// This node's name (default `$NODE_NAME`).
    pub node_name: Option<String>,
    /// Namespace of the Leases.
    pub lease_namespace: String,
    /// Lease duration.
    pub lease_duration: Duration,
    /// How long the holder tries to renew before giving up.
    pub renew_deadline: Duration,
    /// Retry period.
    pub retry_period: Duration,
    /// Kubeconfig path, if not in-cluster / `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// Label selector of gateway Nodes.
    pub gateway_selector: String,
    /// Periodic full pass even without changes.
    pub resync_period: Duration,
    /// `kubernetes.ownership: liveness` (the default): one liveness Lease
    /// per gateway, an IP's Lease written only when it changes hands (ADR
    /// 0016); false (`perIP`, ADR 0004): every held IP's Lease renewed.
    pub liveness: bool,
    /// The cluster's pod CIDRs: forwarded traffic from them that arrives on
    /// the gateway's interfaces and is not translated is dropped
    /// (`TablesSpec::guard`).
    pub cluster_pod_cidrs: Vec<IpNet>,
    /// `kubernetes.ha` (None: no channel between gateways; no session sync,
    /// no fast take-over, no failsafe).
    pub ha: Option<HaConfig>,
}

/// `kubernetes.ha:` (docs/config.md, ADR 0012).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaConfig {
    /// TCP port of the channel, the same on every gateway.
    pub port: u16,
    /// This gateway's address on the node network (None: `$HOST_IP`).
    pub address: Option<std::net::IpAddr>,
    /// The shared key's file (the primary key).
    pub key_file: PathBuf,
    /// Files of keys also accepted while a new one rolls out
    /// (`crate::ha::keys`).
    pub accept_key_files: Vec<PathBuf>,
    /// How long a silent peer stays up.
    pub liveness: Duration,
    /// Full resynchronisation period of each standby.
    pub resync_period: Duration,
    /// Where the last known peers are kept across restarts.
    pub peer_cache: Option<PathBuf>,
    /// How long a holder that no other gateway can vouch for keeps an IP
    /// through an API outage; other gateways may take its Lease this long
    /// after it expired (the same on every gateway).
    pub lone_failsafe: Duration,
}

/// A validated configuration file.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    /// Where it was read from.
    pub file: String,
    /// Interfaces.
    pub interfaces: Vec<InterfaceConfig>,
    /// XDP settings.
    pub xdp: XdpConfig,
    /// Worker settings.
    pub workers: WorkersConfig,
    /// Policies, egress IPs, neighbour addresses and NAT settings.
    pub tables: TablesSpec,
    /// The admin socket's path.
    pub admin_socket: PathBuf,
    /// Where Prometheus metrics are served.
    pub metrics_listen: SocketAddr,
    /// `metrics.portUseTop`: destinations and pods shown per egress IP and
    /// protocol (crate::port_use).
    pub port_use_top: usize,
    /// `metrics.portUseRefresh`: how often port use is counted.
    pub port_use_refresh: Duration,
    /// Kubernetes mode, if configured.
    pub kubernetes: Option<KubernetesConfig>,
    /// Translation logs, when on (`translationLogs:`).
    pub translation_logs: Option<TranslationLogsConfig>,
    /// Things that are allowed but probably not meant.
    pub warnings: Vec<String>,
}

impl GatewayConfig {
    /// Settings that only take effect at start: the names of those that
    /// differ between `self` (running) and `new`.
    pub fn restart_only_changes(&self, new: &GatewayConfig) -> Vec<&'static str> {
        let mut v = Vec::new();
        if self.interfaces != new.interfaces {
            v.push("interfaces");
        }
        if self.xdp.mode != new.xdp.mode {
            v.push("xdp.mode");
        }
        if self.xdp.fast_path != new.xdp.fast_path {
            v.push("xdp.fastPath");
        }
        if self.xdp.fast_path_sessions != new.xdp.fast_path_sessions {
            v.push("xdp.fastPathSessions");
        }
        if self.workers != new.workers {
            v.push("workers");
        }
        if self.admin_socket != new.admin_socket {
            v.push("admin.socket");
        }
        if self.metrics_listen != new.metrics_listen {
            v.push("metrics.listen");
        }
        if (self.port_use_top, self.port_use_refresh) != (new.port_use_top, new.port_use_refresh) {
            v.push("metrics.portUse");
        }
        if self.kubernetes != new.kubernetes {
            v.push("kubernetes");
        }
        if self.translation_logs != new.translation_logs {
            v.push("translationLogs");
        }
        v
    }
}

/// Settings given on the command line that replace the file's: `egret
/// gateway` (and `egret check-config`) `--cluster-pod-cidr`,
/// `--gateway-selector`, `--nat-ports`. The plain manifests pass the
/// cluster's settings this way, from the ConfigMap the node agent reads too
/// (deploy/manifests/20-configmap.yaml), so that the file does not repeat
/// them. The values are already checked (the flags' parsers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `kubernetes.clusterPodCIDRs`.
    pub cluster_pod_cidrs: Option<Vec<IpNet>>,
    /// `kubernetes.gatewaySelector`.
    pub gateway_selector: Option<String>,
    /// `nat.ports`.
    pub nat_ports: Option<PortRange>,
    /// `tunnel.port`.
    pub tunnel_port: Option<u16>,
}

impl Overrides {
    /// Writes them over the file's values. The Kubernetes settings of a file
    /// without `kubernetes:` are left out with a warning: they describe the
    /// cluster of a gateway in Kubernetes mode.
    fn apply(&self, raw: &mut raw::Config, warnings: &mut Vec<String>) {
        if let Some(p) = self.nat_ports {
            raw.nat.ports = Some(format!("{}-{}", p.first, p.last));
        }
        match raw.kubernetes.as_mut() {
            Some(k) => {
                if let Some(c) = &self.cluster_pod_cidrs {
                    k.cluster_pod_cidrs = Some(c.iter().map(ToString::to_string).collect());
                }
                if let Some(s) = &self.gateway_selector {
                    k.gateway_selector = Some(s.clone());
                }
            }
            None => {
                let given: Vec<&str> = [
                    self.cluster_pod_cidrs.is_some().then_some("--cluster-pod-cidr"),
                    self.gateway_selector.is_some().then_some("--gateway-selector"),
                ]
                .into_iter()
                .flatten()
                .collect();
                if !given.is_empty() {
                    warnings.push(format!(
                        "{} ignored: the file has no kubernetes: section (not in Kubernetes mode)",
                        given.join(" and ")
                    ));
                }
            }
        }
        if let Some(p) = self.tunnel_port {
            if raw.kubernetes.is_some() || raw.tunnel.is_some() {
                raw.tunnel.get_or_insert_with(Default::default).port = Some(p);
            } else {
                warnings.push("--tunnel-port ignored: the file has no tunnel: section".into());
            }
        }
    }
}

/// The overrides [`load`] applies, set once per process by `egret gateway`
/// from its flags. The daemon loads its file through [`load`] at start and
/// at every `SIGHUP`, so the flags hold across reloads.
static OVERRIDES: std::sync::OnceLock<Overrides> = std::sync::OnceLock::new();

/// Sets the overrides every later [`load`] applies; false if already set.
pub fn set_overrides(o: Overrides) -> bool {
    OVERRIDES.set(o).is_ok()
}

/// Reads and validates `path`, with the overrides [`set_overrides`] gave.
pub fn load(path: &Path) -> Result<GatewayConfig, ConfigErrors> {
    load_with(path, OVERRIDES.get().unwrap_or(&Overrides::default()))
}

/// Reads and validates `path`, with `overrides`.
pub fn load_with(path: &Path, overrides: &Overrides) -> Result<GatewayConfig, ConfigErrors> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigErrors(vec![ConfigError::Read { file: file.clone(), message: e.to_string() }]))?;
    load_str_with(&file, &text, overrides)
}

/// Validates `text`, naming `file` in errors.
pub fn load_str(file: &str, text: &str) -> Result<GatewayConfig, ConfigErrors> {
    load_str_with(file, text, &Overrides::default())
}

/// Validates `text` with `overrides` written over it, naming `file` in errors.
pub fn load_str_with(file: &str, text: &str, overrides: &Overrides) -> Result<GatewayConfig, ConfigErrors> {
    let mut raw: raw::Config = serde_saphyr::from_str(text).map_err(|e| {
        let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
        let full = e.without_snippet().to_string();
        let suffix = format!(" at line {line}, column {column}");
        let message = full.strip_suffix(&suffix).unwrap_or(&full).to_string();
        ConfigErrors(vec![ConfigError::Syntax { file: file.to_string(), line, column, message }])
    })?;
    let mut warnings = Vec::new();
    overrides.apply(&mut raw, &mut warnings);
    Checker { file, errors: Vec::new(), warnings }.check(raw)
}

struct Checker<'a> {
    file: &'a str,
    errors: Vec<ConfigError>,
    warnings: Vec<String>,
}

const DEFAULT_SOCKET: &str = "/run/egret/egret.sock";
const DEFAULT_METRICS: &str = "127.0.0.1:9469";

impl Checker<'_> {
    fn invalid(&mut self, path: impl Into<String>, value: impl Into<String>, reason: impl Into<String>) {
        self.errors.push(ConfigError::Invalid {
            file: self.file.to_string(),
            path: path.into(),
            value: value.into(),
            reason: reason.into(),
        });
    }

    fn rule(&mut self, path: impl Into<String>, reason: impl Into<String>) {
        self.errors.push(ConfigError::Rule { file: self.file.to_string(), path: path.into(), reason: reason.into() });
    }

    fn ip(&mut self, path: String, s: &str) -> Option<IpAddr> {
        match s.trim().parse::<IpAddr>() {
            Ok(ip) => Some(ip),
            Err(_) => {
                self.invalid(path, s, "not an IP address");
                None
            }
        }
    }

    fn cidr(&mut self, path: String, s: &str) -> Option<IpNet> {
        let t = s.trim();
        if let Ok(n) = t.parse::<IpNet>() {
            if n.trunc() != n {
                self.invalid(path, s, format!("has host bits set (the network is {})", n.trunc()));
                return None;
            }
            return Some(n);
        }
        // A bare address is a host route.
        match t.parse::<IpAddr>() {
            Ok(ip) => Some(IpNet::from(ip)),
            Err(_) => {
                self.invalid(path, s, "not a CIDR (address/length) or an IP address");
                None
            }
        }
    }

    fn cidrs(&mut self, path: &str, list: &[String]) -> Vec<IpNet> {
        list.iter().enumerate().filter_map(|(i, s)| self.cidr(format!("{path}[{i}]"), s)).collect()
    }

    fn ports(&mut self, path: String, s: &str) -> Option<PortRange> {
        let parsed =
            s.split_once('-').and_then(|(a, b)| Some((a.trim().parse::<u16>().ok()?, b.trim().parse::<u16>().ok()?)));
        match parsed {
            Some((first, last)) if first >= 1 && first <= last => Some(PortRange { first, last }),
            Some(_) => {
                self.invalid(path, s, "port range must have 1 <= first <= last");
                None
            }
            None => {
                self.invalid(path, s, "not a port range \"first-last\" (e.g. \"32768-60999\")");
                None
            }
        }
    }

    fn duration(&mut self, path: &str, s: &str) -> Option<Duration> {
        let t = s.trim();
        let (num, unit) = t.find(|c: char| !c.is_ascii_digit()).map_or((t, ""), |i| t.split_at(i));
        let n: u64 = match num.parse() {
            Ok(n) => n,
            Err(_) => {
                self.invalid(path, s, "not a duration (e.g. \"4s\", \"500ms\")");
                return None;
            }
        };
        let d = match unit {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.saturating_mul(60)),
            _ => {
                self.invalid(path, s, "not a duration (e.g. \"4s\", \"500ms\")");
                return None;
            }
        };
        if d.is_zero() {
            self.invalid(path, s, "must be more than zero");
            return None;
        }
        Some(d)
    }

    fn check(mut self, raw: raw::Config) -> Result<GatewayConfig, ConfigErrors> {
        let interfaces = self.interfaces(&raw.interfaces);
        let xdp = XdpConfig {
            mode: match raw.xdp.mode.as_deref().unwrap_or("native") {
                "native" => XdpMode::Native,
                "generic" => XdpMode::Generic,
                other => {
                    self.invalid("xdp.mode", other, "must be native or generic");
                    XdpMode::Native
                }
            },
            fast_path: raw.xdp.fast_path.unwrap_or(true),
            fast_path_sessions: self.fast_path_sessions(raw.xdp.fast_path_sessions.as_ref()),
        };
        let workers = self.workers(&raw.workers);
        let nat = self.nat(&raw.nat);

        let k8s = raw.kubernetes.as_ref().map(|k| self.kubernetes(k));
        if k8s.is_some() {
            for (field, present) in [
                ("policies", raw.policies.is_some()),
                ("egressIPs", raw.egress_ips.is_some()),
                ("neighborAddresses", raw.neighbor_addresses.is_some()),
            ] {
                if present {
                    self.rule(field, "must not be set with kubernetes: (the cluster provides it)");
                }
            }
        } else if raw.policies.is_none() {
            self.rule("policies", "missing (required without kubernetes:)");
        }

        let egress_ips = self.egress_ips(raw.egress_ips.as_deref().unwrap_or_default(), nat.ports);
        let neighbor_addresses: Vec<IpAddr> = raw
            .neighbor_addresses
            .as_deref()
            .unwrap_or_default()
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.ip(format!("neighborAddresses[{i}]"), s))
            .collect();
        let policies = self.policies(raw.policies.as_deref().unwrap_or_default(), &egress_ips);

        let admin_socket = PathBuf::from(raw.admin.socket.as_deref().unwrap_or(DEFAULT_SOCKET));
        if !admin_socket.is_absolute() {
            self.invalid("admin.socket", admin_socket.display().to_string(), "must be an absolute path");
        }
        let listen = raw.metrics.listen.as_deref().unwrap_or(DEFAULT_METRICS);
        let metrics_listen = match listen.parse::<SocketAddr>() {
            Ok(a) => {
                if !a.ip().is_loopback() {
                    self.warnings.push(format!("metrics.listen: {a} is not a loopback address"));
                }
                a
            }
            Err(_) => {
                self.invalid("metrics.listen", listen, "not an address:port (e.g. \"127.0.0.1:9469\")");
                SocketAddr::from(([127, 0, 0, 1], 9469))
            }
        };

        let port_use_top = match raw.metrics.port_use_top {
            None => crate::port_use::DEFAULT_TOP,
            Some(n) if (1..=crate::port_use::MAX_TOP as u64).contains(&n) => n as usize,
            Some(n) => {
                self.invalid("metrics.portUseTop", n.to_string(), format!("must be 1 to {}", crate::port_use::MAX_TOP));
                crate::port_use::DEFAULT_TOP
            }
        };
        let port_use_refresh = match raw.metrics.port_use_refresh.as_deref() {
            None => crate::port_use::DEFAULT_REFRESH,
            Some(s) => match self.duration("metrics.portUseRefresh", s) {
                Some(d) if d >= Duration::from_secs(1) => d,
                Some(_) => {
                    self.invalid(
                        "metrics.portUseRefresh",
                        s,
                        "must be at least 1s (each refresh walks every pod's port counters)",
                    );
                    crate::port_use::DEFAULT_REFRESH
                }
                None => crate::port_use::DEFAULT_REFRESH,
            },
        };

        // `kernelService: true`: the kernel serves the address's other ports
        // (a VIP the host holds too, SSH); the others drop them.
        let service_addresses = raw
            .egress_ips
            .as_deref()
            .unwrap_or_default()
            .iter()
            .filter(|e| e.kernel_service == Some(true))
            .filter_map(|e| e.ip.parse().ok())
            .collect();
        let tunnel = self.tunnel(raw.tunnel.as_ref(), k8s.is_some());
        let translation_logs = raw.translation_logs.as_ref().and_then(|t| self.translation_logs(t));
        let tables = TablesSpec {
            policies,
            egress_ips,
            neighbor_addresses,
            nat,
            service_addresses,
            tunnel,
            ..Default::default()
        };
        if self.errors.is_empty() {
            self.compile(&tables);
        }
        if !self.errors.is_empty() {
            return Err(ConfigErrors(self.errors));
        }
        Ok(GatewayConfig {
            file: self.file.to_string(),
            interfaces,
            xdp,
            workers,
            tables,
            admin_socket,
            metrics_listen,
            port_use_top,
            port_use_refresh,
            kubernetes: k8s.flatten(),
            translation_logs,
            warnings: self.warnings,
        })
    }

    /// `tunnel:`: on by default in Kubernetes mode (the Nodes' InternalIPs
    /// are the senders), on in file mode when the section is given (its
    /// `nodeAddresses` are).
    fn tunnel(&mut self, raw: Option<&raw::Tunnel>, kubernetes: bool) -> Option<TunnelSpec> {
        let enabled = raw.map_or(kubernetes, |t| t.enabled.unwrap_or(true));
        let port = raw.and_then(|t| t.port).unwrap_or(egret_dataplane::wire::vxlan::DEFAULT_PORT);
        if port == 0 {
            self.invalid("tunnel.port", "0", "must be 1-65535");
        }
        let given = raw.and_then(|t| t.node_addresses.as_deref());
        let mut nodes = Vec::new();
        for (i, s) in given.unwrap_or_default().iter().enumerate() {
            let field = format!("tunnel.nodeAddresses[{i}]");
            match self.ip(field.clone(), s) {
                Some(ip) if nodes.contains(&ip) => self.invalid(field, s.as_str(), "listed twice"),
                Some(ip) => nodes.push(ip),
                None => {}
            }
        }
        match (kubernetes, given) {
            (true, Some(list)) => self.invalid(
                "tunnel.nodeAddresses",
                format!("{} addresses", list.len()),
                "must not be set with kubernetes: (the Nodes' InternalIPs are the senders)",
            ),
            (false, None) | (false, Some([])) if enabled => {
                self.rule("tunnel.nodeAddresses", "missing or empty: list the nodes that may send (or enabled: false)")
            }
            _ => {}
        }
        enabled.then_some(TunnelSpec { port, nodes })
    }

    /// `translationLogs:`: on when given unless `enabled: false`; at least
    /// one sink.
    fn translation_logs(&mut self, t: &raw::TranslationLogs) -> Option<TranslationLogsConfig> {
        let p = "translationLogs";
        let count = |this: &mut Self, field: &str, v: Option<u64>, default: u64, min: u64| -> usize {
            let n = v.unwrap_or(default);
            if !(min..=MAX_TRANSLOG_QUEUE).contains(&n) {
                this.invalid(format!("{p}.{field}"), n.to_string(), format!("must be {min}-{MAX_TRANSLOG_QUEUE}"));
            }
            n as usize
        };
        let ring_records = count(self, "ringRecords", t.ring_records, DEFAULT_RING_RECORDS, 1024);
        let queue_events = count(self, "queueEvents", t.queue_events, DEFAULT_QUEUE_EVENTS, 1);
        let enterprise_number = match &t.enterprise_number {
            None => DEFAULT_ENTERPRISE_NUMBER,
            Some(v) => match v.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|&n| n > 0) {
                Some(n) => n,
                None => {
                    self.invalid(
                        format!("{p}.enterpriseNumber"),
                        v.0.clone(),
                        "must be an IANA Private Enterprise Number (1-4294967295)",
                    );
                    DEFAULT_ENTERPRISE_NUMBER
                }
            },
        };
        let ipfix = t.ipfix.as_ref().map(|i| {
            let collector = self.collector(&format!("{p}.ipfix.collector"), i.collector.as_deref());
            let template_refresh = match i.template_refresh.as_deref() {
                None => Duration::from_secs(60),
                Some(s) => {
                    let d = self.duration(&format!("{p}.ipfix.templateRefresh"), s).unwrap_or(Duration::from_secs(60));
                    if d > Duration::from_secs(3600) {
                        self.invalid(format!("{p}.ipfix.templateRefresh"), s, "must be at most 60m");
                    }
                    d
                }
            };
            let mtu = i.mtu.unwrap_or(1400);
            let max_mtu = 65_507;
            if !(crate::translog::ipfix::MIN_MTU as u64..=max_mtu).contains(&mtu) {
                self.invalid(
                    format!("{p}.ipfix.mtu"),
                    mtu.to_string(),
                    format!("must be {}-{max_mtu} (bytes of a UDP payload)", crate::translog::ipfix::MIN_MTU),
                );
            }
            IpfixConfig { collector, observation_domain: i.observation_domain, template_refresh, mtu: mtu as usize }
        });
        let syslog = t.syslog.as_ref().map(|s| {
            let collector = self.collector(&format!("{p}.syslog.collector"), s.collector.as_deref());
            if let Some(h) = &s.hostname {
                // RFC 5424 §6.2.4: 1-255 printable US-ASCII characters.
                if h.is_empty() || h.len() > 255 || !h.bytes().all(|b| (33..=126).contains(&b)) {
                    self.invalid(
                        format!("{p}.syslog.hostname"),
                        h.as_str(),
                        "must be 1-255 printable US-ASCII characters, no space (RFC 5424 HOSTNAME)",
                    );
                }
            }
            let transport = match s.transport.as_deref().unwrap_or("udp") {
                "udp" => SyslogTransport::Udp,
                "tcp" => SyslogTransport::Tcp,
                other => {
                    self.invalid(format!("{p}.syslog.transport"), other, "must be udp or tcp");
                    SyslogTransport::Udp
                }
            };
            SyslogConfig { collector, hostname: s.hostname.clone(), transport }
        });
        let journal = self.journal(t.journal.as_ref());
        if !t.enabled.unwrap_or(true) {
            return None;
        }
        if ipfix.is_none() && syslog.is_none() && journal.is_none() {
            self.rule(p, "neither ipfix:, syslog: nor the journal is on: give a collector (or enabled: false)");
        }
        Some(TranslationLogsConfig {
            ring_records,
            queue_events,
            log_destinations: t.log_destinations.unwrap_or(true),
            enterprise_number,
            ipfix,
            syslog,
            journal,
        })
    }

    /// `translationLogs.journal:`: on unless `enabled: false`.
    fn journal(&mut self, j: Option<&raw::TranslationLogsJournal>) -> Option<JournalConfig> {
        let p = "translationLogs.journal";
        let default = raw::TranslationLogsJournal::default();
        let j = j.unwrap_or(&default);
        let dir = PathBuf::from(j.dir.as_deref().unwrap_or(DEFAULT_JOURNAL_DIR));
        if !dir.is_absolute() {
            self.invalid(format!("{p}.dir"), dir.display().to_string(), "must be an absolute path");
        }
        let max_bytes = j.max_bytes.unwrap_or(DEFAULT_JOURNAL_MAX_BYTES);
        if max_bytes < MIN_JOURNAL_BYTES {
            self.invalid(
                format!("{p}.maxBytes"),
                max_bytes.to_string(),
                format!("must be at least {MIN_JOURNAL_BYTES} (1 MiB)"),
            );
        }
        let max_age = match j.max_age.as_deref() {
            None => DEFAULT_JOURNAL_MAX_AGE,
            Some(s) => {
                // Hours and days too: retention is counted in them.
                let t = s.trim();
                let long = |suffix: char, secs: u64| {
                    t.strip_suffix(suffix)?.parse::<u64>().ok().map(|n| Duration::from_secs(n.saturating_mul(secs)))
                };
                let d = match long('h', 3600).or_else(|| long('d', 86_400)) {
                    Some(d) => d,
                    None => self.duration(&format!("{p}.maxAge"), s).unwrap_or(DEFAULT_JOURNAL_MAX_AGE),
                };
                if d < Duration::from_secs(60) || d > MAX_JOURNAL_AGE {
                    self.invalid(format!("{p}.maxAge"), s, "must be 1m-366d");
                }
                d
            }
        };
        j.enabled.unwrap_or(true).then_some(JournalConfig { dir, max_bytes, max_age })
    }

    /// A collector's `address:port`.
    fn collector(&mut self, path: &str, value: Option<&str>) -> SocketAddr {
        let unset = SocketAddr::from(([127, 0, 0, 1], 0));
        match value.map(|v| (v, v.trim().parse::<SocketAddr>())) {
            None => {
                self.invalid(path, "", "missing: the collector's address:port (e.g. \"192.0.2.50:4739\")");
                unset
            }
            Some((_, Ok(a))) if a.port() != 0 && !a.ip().is_unspecified() => a,
            Some((v, Ok(_))) => {
                self.invalid(path, v, "needs a port and an address that is not unspecified");
                unset
            }
            Some((v, Err(_))) => {
                self.invalid(path, v, "not an address:port (e.g. \"192.0.2.50:4739\", \"[2001:db8::50]:4739\")");
                unset
            }
        }
    }

    fn interfaces(&mut self, list: &[raw::Interface]) -> Vec<InterfaceConfig> {
        let mut out = Vec::new();
        let mut names = HashSet::new();
        for (i, r) in list.iter().enumerate() {
            let path = format!("interfaces[{i}]");
            let name = match (r.name.as_deref(), r.default_route.unwrap_or(false)) {
                (Some(n), true) => {
                    self.invalid(format!("{path}.name"), n, "give either name or defaultRoute: true, not both");
                    n.to_string()
                }
                // Resolved when the daemon loads the file (default_route.rs).
                (None, true) => default_route::DEFAULT_ROUTE.to_string(),
                (None, false) => {
                    self.invalid(format!("{path}.name"), "", "missing (or defaultRoute: true)");
                    String::new()
                }
                (Some(n), false) => {
                    if n.is_empty() || n.len() > 15 || n.contains(['/', ' ']) || n.starts_with('@') {
                        self.invalid(
                            format!("{path}.name"),
                            n,
                            "not an interface name (1-15 characters, no '/' or space, not starting with '@')",
                        );
                    }
                    n.to_string()
                }
            };
            if !name.is_empty() && !names.insert(name.clone()) {
                self.invalid(format!("{path}.name"), &name, "listed twice");
            }
            let role = match r.role.as_deref().unwrap_or("both") {
                "inside" => Role::Inside,
                "outside" => Role::Outside,
                "both" => Role::Both,
                other => {
                    self.invalid(format!("{path}.role"), other, "must be inside, outside or both");
                    continue;
                }
            };
            let queues = match &r.queues {
                None => Queues::All,
                Some(raw::Queues::Word(w)) if w == "all" => Queues::All,
                Some(raw::Queues::Word(w)) => match w.parse::<u32>() {
                    Ok(n) if (1..=256).contains(&n) => Queues::Count(n),
                    _ => {
                        self.invalid(format!("{path}.queues"), w, "must be \"all\" or a count 1-256");
                        continue;
                    }
                },
                Some(raw::Queues::Count(n)) if (1..=256).contains(n) => Queues::Count(*n as u32),
                Some(raw::Queues::Count(n)) => {
                    self.invalid(format!("{path}.queues"), n.to_string(), "must be \"all\" or a count 1-256");
                    continue;
                }
            };
            let mut pod_source_macs = Vec::new();
            for (j, text) in r.pod_source_macs.iter().flatten().enumerate() {
                let field = format!("{path}.podSourceMacs[{j}]");
                match parse_mac(text) {
                    None => self.invalid(field, text, "not a MAC address (six hex octets, e.g. 02:00:00:00:00:01)"),
                    Some(m) if m[0] & 1 == 1 || m == [0; 6] => {
                        self.invalid(field, text, "a multicast or zero MAC cannot be a sender")
                    }
                    Some(m) if pod_source_macs.contains(&m) => self.invalid(field, text, "listed twice"),
                    Some(m) => pod_source_macs.push(m),
                }
            }
            if !pod_source_macs.is_empty() && role == Role::Outside {
                self.invalid(
                    format!("{path}.podSourceMacs"),
                    format!("{} addresses", pod_source_macs.len()),
                    "an outside interface never carries pods' traffic; list the node routers' MACs on the inside (or both) interface",
                );
            }
            out.push(InterfaceConfig { name, role, queues, pod_source_macs });
        }
        let count = |role| out.iter().filter(|i| i.role == role).count();
        let (both, inside, outside) = (count(Role::Both), count(Role::Inside), count(Role::Outside));
        let shape_ok = (both == 1 && inside == 0 && outside == 0) || (both == 0 && inside == 1 && outside == 1);
        if list.is_empty() {
            self.rule("interfaces", "must list one interface (role both) or two (inside and outside)");
        } else if out.len() == list.len() && !shape_ok {
            self.rule(
                "interfaces",
                format!(
                    "must be one interface with role both (one-arm) or one inside and one outside (two-arm); got {both} both, {inside} inside, {outside} outside"
                ),
            );
        }
        out
    }

    /// `xdp.fastPathSessions`: one count (1 to the maximum) for both
    /// families, or `{ipv4, ipv6}` with 0 allowed for one of them.
    fn fast_path_sessions(&mut self, raw: Option<&raw::FastPathSessions>) -> FastPathSessions {
        const FIELD: &str = "xdp.fastPathSessions";
        let default = FastPathSessions::both(DEFAULT_FAST_PATH_SESSIONS);
        match raw {
            None => default,
            Some(raw::FastPathSessions::Each(n)) if (1..=MAX_FAST_PATH_SESSIONS).contains(n) => {
                FastPathSessions::both(*n as u32)
            }
            Some(raw::FastPathSessions::Each(n)) => {
                self.invalid(FIELD, n.to_string(), "must be between 1 and 4194304");
                default
            }
            Some(raw::FastPathSessions::PerFamily(f)) => {
                let mut family = |name: &str, n: Option<u64>| match n {
                    None => DEFAULT_FAST_PATH_SESSIONS,
                    Some(n) if n <= MAX_FAST_PATH_SESSIONS => n as u32,
                    Some(n) => {
                        self.invalid(format!("{FIELD}.{name}"), n.to_string(), "must be between 0 and 4194304");
                        DEFAULT_FAST_PATH_SESSIONS
                    }
                };
                let out = FastPathSessions { ipv4: family("ipv4", f.ipv4), ipv6: family("ipv6", f.ipv6) };
                if out.ipv4 == 0 && out.ipv6 == 0 {
                    self.invalid(
                        FIELD,
                        "{ipv4: 0, ipv6: 0}",
                        "at least one family needs sessions (xdp.fastPath: false turns the fast path off)",
                    );
                    return default;
                }
                out
            }
        }
    }

    fn workers(&mut self, w: &raw::Workers) -> WorkersConfig {
        let d = WorkersConfig {
            cpus: Vec::new(),
            realtime_priority: 50,
            frame_size: 2048,
            frames: 4096,
            ring_size: 2048,
            batch: 64,
        };
        let cpus = w.cpus.clone().unwrap_or_default();
        let realtime_priority = match w.realtime_priority {
            None => d.realtime_priority,
            Some(p) if p <= 99 => p as u8,
            Some(p) => {
                self.invalid("workers.realtimePriority", p.to_string(), "must be 0 (normal) to 99");
                d.realtime_priority
            }
        };
        let frame_size = match w.frame_size {
            None => d.frame_size,
            Some(f @ (2048 | 4096)) => f,
            Some(f) => {
                self.invalid("workers.frameSize", f.to_string(), "must be 2048 or 4096");
                d.frame_size
            }
        };
        let ring_size = match w.ring_size {
            None => d.ring_size,
            Some(r) if r.is_power_of_two() && (64..=16384).contains(&r) => r,
            Some(r) => {
                self.invalid("workers.ringSize", r.to_string(), "must be a power of two from 64 to 16384");
                d.ring_size
            }
        };
        let frames = match w.frames {
            None => d.frames.max(ring_size * 2),
            Some(f) if f >= ring_size * 2 && f <= 1 << 20 => f,
            Some(f) => {
                self.invalid(
                    "workers.frames",
                    f.to_string(),
                    format!("must be at least twice workers.ringSize ({}) and at most 1048576", ring_size * 2),
                );
                d.frames
            }
        };
        let batch = match w.batch {
            None => d.batch,
            Some(b) if (1..=ring_size).contains(&b) => b,
            Some(b) => {
                self.invalid("workers.batch", b.to_string(), format!("must be 1 to workers.ringSize ({ring_size})"));
                d.batch
            }
        };
        WorkersConfig { cpus, realtime_priority, frame_size, frames, ring_size, batch }
    }

    fn nat(&mut self, n: &raw::Nat) -> NatSettings {
        let d = NatSettings::default();
        let mapping = match n.mapping.as_deref() {
            None => d.mapping,
            Some("endpoint-independent") => MappingBehavior::EndpointIndependent,
            Some("endpoint-dependent") => MappingBehavior::EndpointDependent,
            Some(other) => {
                self.invalid("nat.mapping", other, "must be endpoint-independent or endpoint-dependent");
                d.mapping
            }
        };
        let filtering = match n.filtering.as_deref() {
            None => d.filtering,
            Some("address-and-port-dependent") => FilteringBehavior::AddressAndPortDependent,
            Some("endpoint-independent") => FilteringBehavior::EndpointIndependent,
            Some(other) => {
                self.invalid("nat.filtering", other, "must be address-and-port-dependent or endpoint-independent");
                d.filtering
            }
        };
        let ports = match n.ports.as_deref() {
            None => d.ports,
            Some(s) => self.ports("nat.ports".into(), s).unwrap_or(d.ports),
        };
        let t = n.timeouts.unwrap_or_default();
        let f = n.fragments.unwrap_or_default();
        NatSettings {
            mapping,
            filtering,
            ports,
            port_alloc_attempts: n.port_alloc_attempts.unwrap_or(d.port_alloc_attempts),
            max_sessions: n.max_sessions.unwrap_or(d.max_sessions as u64) as usize,
            max_sessions_per_source: n.max_sessions_per_source.unwrap_or(d.max_sessions_per_source),
            max_ports_per_source: n.max_ports_per_source.or(d.max_ports_per_source),
            new_flows_per_second_per_source: n
                .new_flows_per_second_per_source
                .unwrap_or(d.new_flows_per_second_per_source),
            new_flow_burst_per_source: n.new_flow_burst_per_source.unwrap_or(d.new_flow_burst_per_source),
            timeouts: Timeouts {
                udp: t.udp.unwrap_or(d.timeouts.udp),
                tcp_established: t.tcp_established.unwrap_or(d.timeouts.tcp_established),
                tcp_transitory: t.tcp_transitory.unwrap_or(d.timeouts.tcp_transitory),
                icmp: t.icmp.unwrap_or(d.timeouts.icmp),
            },
            fragments: FragmentSettings {
                cache_entries: f.cache_entries.unwrap_or(d.fragments.cache_entries as u64) as usize,
                timeout: f.timeout.unwrap_or(d.fragments.timeout),
            },
            hairpinning: n.hairpinning.unwrap_or(d.hairpinning),
            tcp_loose_pickup: n.tcp_loose_pickup.unwrap_or(d.tcp_loose_pickup),
            udp_inbound_refresh: n.udp_inbound_refresh.unwrap_or(d.udp_inbound_refresh),
            port_blocks: n.port_blocks.as_ref().and_then(|b| self.port_blocks("nat.portBlocks", b, ports)),
        }
    }

    /// `portBlocks:` at `path`, checked against the port range it
    /// divides (ADR 0034 §6): `size` a power of two from 8, with a block
    /// aligned to its size inside the range; `maxPerPod` 1-32. Defaults:
    /// 128 and 8.
    fn port_blocks(&mut self, path: &str, b: &raw::RawPortBlocks, range: PortRange) -> Option<PortBlocks> {
        let before = self.errors.len();
        let size = b.size.unwrap_or(u32::from(DEFAULT_BLOCK_SIZE));
        let max_per_pod = b.max_per_pod.unwrap_or(u32::from(DEFAULT_BLOCKS_PER_POD));
        let (Ok(size16), Ok(max16)) = (u16::try_from(size), u16::try_from(max_per_pod)) else {
            let (field, value) = if u16::try_from(size).is_err() { ("size", size) } else { ("maxPerPod", max_per_pod) };
            self.invalid(format!("{path}.{field}"), value.to_string(), "too large");
            return None;
        };
        let blocks = PortBlocks { size: size16, max_per_pod: max16, log_sessions: b.log_sessions.unwrap_or(false) };
        if let Err(e) = blocks.validate(range) {
            self.invalid(format!("{path}.{}", e.field), e.value.to_string(), format!("must be {}", e.need));
        }
        (self.errors.len() == before).then_some(blocks)
    }

    fn egress_ips(&mut self, list: &[raw::EgressIp], default_ports: PortRange) -> Vec<EgressIpSpec> {
        let mut out = Vec::new();
        for (i, e) in list.iter().enumerate() {
            let Some(ip) = self.ip(format!("egressIPs[{i}].ip"), &e.ip) else { continue };
            if ip.is_unspecified() || ip.is_multicast() || ip.is_loopback() {
                self.invalid(format!("egressIPs[{i}].ip"), &e.ip, "must be a unicast address");
                continue;
            }
            let ports = match e.ports.as_deref() {
                None => None,
                Some(s) => match self.ports(format!("egressIPs[{i}].ports"), s) {
                    Some(r) => Some(r),
                    None => continue,
                },
            };
            let range = ports.unwrap_or(default_ports);
            let port_blocks =
                e.port_blocks.as_ref().and_then(|b| self.port_blocks(&format!("egressIPs[{i}].portBlocks"), b, range));
            out.push(EgressIpSpec { ip, ports, answer_neighbor: e.answer_neighbor.unwrap_or(true), port_blocks });
        }
        out
    }

    fn policies(&mut self, list: &[raw::Policy], egress: &[EgressIpSpec]) -> Vec<PolicySpec> {
        let mut out = Vec::new();
        for (i, p) in list.iter().enumerate() {
            let path = format!("policies[{i}]");
            let before = self.errors.len();
            let sources = self.cidrs(&format!("{path}.sources"), &p.sources);
            let destinations = self.cidrs(&format!("{path}.destinations"), &p.destinations);
            let except = self.cidrs(&format!("{path}.except"), p.except.as_deref().unwrap_or_default());
            let egress_ips: Vec<IpAddr> = p
                .egress_ips
                .iter()
                .enumerate()
                .filter_map(|(j, s)| self.ip(format!("{path}.egressIPs[{j}]"), s))
                .collect();
            for (j, ip) in egress_ips.iter().enumerate() {
                if !egress.iter().any(|e| e.ip == *ip) {
                    self.warnings.push(format!(
                        "{path}.egressIPs[{j}]: {ip} is not in egressIPs: this gateway does not hold it, so the pods it is paired with are dropped (egress_ip_not_owned)"
                    ));
                }
            }
            if self.errors.len() == before {
                out.push(PolicySpec { name: p.name.clone(), sources, destinations, except, egress_ips });
            }
        }
        out
    }

    fn kubernetes(&mut self, k: &raw::Kubernetes) -> Option<KubernetesConfig> {
        let before = self.errors.len();
        let lease_duration = self.duration("kubernetes.leaseDuration", k.lease_duration.as_deref().unwrap_or("4s"));
        let renew_deadline = self.duration("kubernetes.renewDeadline", k.renew_deadline.as_deref().unwrap_or("2s"));
        let retry_period = self.duration("kubernetes.retryPeriod", k.retry_period.as_deref().unwrap_or("500ms"));
        let resync_period = self.duration("kubernetes.resyncPeriod", k.resync_period.as_deref().unwrap_or("30s"));
        let (Some(lease_duration), Some(renew_deadline), Some(retry_period), Some(resync_period)) =
            (lease_duration, renew_deadline, retry_period, resync_period)
        else {
            return None;
        };
        // Lease durations are whole seconds in the Lease object, and the
        // fencing margin (leaseDuration - renewDeadline) must leave time to
        // stop translating before another gateway may take over.
        if lease_duration.subsec_nanos() != 0 {
            self.rule(
                "kubernetes.leaseDuration",
                format!("{lease_duration:?} is not a whole number of seconds (Lease objects store seconds)"),
            );
        }
        if lease_duration.saturating_sub(renew_deadline) < Duration::from_millis(500) {
            self.rule(
                "kubernetes.renewDeadline",
                "must be at least 500ms shorter than kubernetes.leaseDuration (the fencing margin)",
            );
        }
        if renew_deadline >= lease_duration {
            self.rule("kubernetes.renewDeadline", "must be shorter than kubernetes.leaseDuration");
        }
        if retry_period >= renew_deadline {
            self.rule("kubernetes.retryPeriod", "must be shorter than kubernetes.renewDeadline");
        }
        let liveness = match k.ownership.as_deref().map(str::trim) {
            Some("perIP") => false,
            None | Some("liveness") => true,
            Some(other) => {
                self.rule("kubernetes.ownership", format!("{other:?} is neither \"perIP\" nor \"liveness\""));
                false
            }
        };
        let mut cluster_pod_cidrs = Vec::new();
        for (i, c) in k.cluster_pod_cidrs.iter().flatten().enumerate() {
            match c.trim().parse::<IpNet>() {
                Ok(n) => cluster_pod_cidrs.push(n.trunc()),
                Err(_) => self.rule(format!("kubernetes.clusterPodCIDRs[{i}]"), format!("{c:?} is not a CIDR")),
            }
        }
        let ha = k.ha.as_ref().and_then(|h| self.ha(h));
        if self.errors.len() != before {
            return None;
        }
        Some(KubernetesConfig {
            node_name: k.node_name.clone(),
            lease_namespace: k.lease_namespace.clone().unwrap_or_else(|| "egret-system".into()),
            lease_duration,
            renew_deadline,
            retry_period,
            kubeconfig: k.kubeconfig.as_ref().map(PathBuf::from),
            gateway_selector: k.gateway_selector.clone().unwrap_or_else(|| "egret.dev/gateway=true".into()),
            resync_period,
            liveness,
            cluster_pod_cidrs,
            ha,
        })
    }

    fn ha(&mut self, h: &raw::Ha) -> Option<HaConfig> {
        let before = self.errors.len();
        let liveness = self.duration("kubernetes.ha.liveness", h.liveness.as_deref().unwrap_or("2s"));
        let resync_period = self.duration("kubernetes.ha.resyncPeriod", h.resync_period.as_deref().unwrap_or("30s"));
        let lone_failsafe = self.duration("kubernetes.ha.loneFailsafe", h.lone_failsafe.as_deref().unwrap_or("5m"));
        let port = h.port.unwrap_or(crate::ha::DEFAULT_PORT);
        if port == 0 {
            self.rule("kubernetes.ha.port", "0 is not a port");
        }
        let address = h.address.as_ref().and_then(|a| self.ip("kubernetes.ha.address".to_string(), a));
        let key_file = match &h.key_file {
            Some(f) if !f.trim().is_empty() => Some(PathBuf::from(f)),
            _ => {
                self.rule("kubernetes.ha.keyFile", "missing: the channel between gateways needs a shared key file");
                None
            }
        };
        let mut accept_key_files = Vec::new();
        for (i, f) in h.accept_key_files.iter().flatten().enumerate() {
            let field = format!("kubernetes.ha.acceptKeyFiles[{i}]");
            if f.trim().is_empty() {
                self.rule(&field, "empty: name a file (one that does not exist yet is no key)");
            } else if key_file.as_deref() == Some(Path::new(f)) || accept_key_files.contains(&PathBuf::from(f)) {
                self.rule(&field, format!("{f:?} is named twice (keyFile and acceptKeyFiles list distinct files)"));
            } else {
                accept_key_files.push(PathBuf::from(f));
            }
        }
        if let Some(r) = resync_period {
            if r < Duration::from_secs(1) {
                self.rule(
                    "kubernetes.ha.resyncPeriod",
                    format!("{r:?} is below 1s (a full session copy per IP each period)"),
                );
            }
        }
        if let Some(l) = liveness {
            if l < Duration::from_millis(200) || l > Duration::from_secs(10) {
                self.rule("kubernetes.ha.liveness", format!("{l:?} is outside 200ms..10s"));
            }
        }
        if self.errors.len() != before {
            return None;
        }
        Some(HaConfig {
            port,
            address,
            key_file: key_file?,
            accept_key_files,
            liveness: liveness?,
            resync_period: resync_period?,
            peer_cache: h.peer_cache.as_ref().map(PathBuf::from),
            lone_failsafe: lone_failsafe?,
        })
    }

    /// The engine's own checks, named the same way.
    fn compile(&mut self, spec: &TablesSpec) {
        match Tables::compile(spec, 0, &PolicySlots::default()) {
            Err(e) => self.rule(spec_error_path(&e), spec_error_reason(&e)),
            Ok(t) => {
                for e in &t.errors {
                    let field = e.field;
                    self.rule(format!("policies[{}].{field}", e.index), format!("{} (policy {:?})", e.message, e.name));
                }
            }
        }
    }
}

/// Splits an engine `SpecError` ("field: message") into its field and message.
fn spec_error_path(e: &egret_dataplane::tables::SpecError) -> String {
    let s = e.to_string();
    s.split_once(": ").map_or_else(|| "nat".to_string(), |(p, _)| p.to_string())
}

fn spec_error_reason(e: &egret_dataplane::tables::SpecError) -> String {
    let s = e.to_string();
    s.split_once(": ").map_or(s.clone(), |(_, m)| m.to_string())
}

#[cfg(test)]
mod tests;
