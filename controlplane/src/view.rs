//! What the outside can see of a running gateway: plain, serialisable
//! snapshots, and the [`GatewayView`] trait that produces them.
//!
//! The admin socket ([`crate::admin`]) and the Prometheus endpoint
//! ([`crate::metrics`]) render only these types, so both are tested against
//! a fake view; the daemon implements the trait over the engine, the BPF
//! maps and the workers.

use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// An interface the gateway drives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InterfaceStatus {
    /// Name.
    pub name: String,
    /// Kernel index.
    pub ifindex: u32,
    /// inside | outside | both.
    pub role: String,
    /// MAC, as `aa:bb:..`.
    pub mac: String,
    /// native | generic.
    pub xdp_mode: String,
    /// Whether the XDP program is attached.
    pub attached: bool,
    /// RX queues served.
    pub queues: u32,
}

/// A worker thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStatus {
    /// Its number (= its RX queue).
    pub id: u32,
    /// Its thread name.
    pub thread: String,
    /// Whether its loop runs.
    pub running: bool,
    /// The CPU it is pinned to.
    pub cpu: Option<usize>,
}

/// An address the gateway holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnedIp {
    /// The address.
    pub ip: IpAddr,
    /// NAT port range "first-last" ("" for a neighbour-only address).
    pub ports: String,
    /// Whether ARP/NDP is answered.
    pub answer_neighbor: bool,
    /// Whether it is translated for (an egress IP).
    pub egress: bool,
    /// Whether it is served now: false while its deadline has passed but
    /// it stays in the tables (a dormant egress IP, fenced with its
    /// sessions kept until its Lease is ours again).
    #[serde(default = "served_by_default")]
    pub served: bool,
}

fn served_by_default() -> bool {
    true
}

/// `egret status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    /// The configuration file.
    pub config_file: String,
    /// The engine's configuration generation.
    pub generation: u64,
    /// Seconds since start.
    pub uptime_secs: u64,
    /// Attached and every worker running.
    pub ready: bool,
    /// Interfaces.
    pub interfaces: Vec<InterfaceStatus>,
    /// Workers.
    pub workers: Vec<WorkerStatus>,
    /// Owned addresses.
    pub owned: Vec<OwnedIp>,
    /// Policies the engine left out, and why.
    pub policy_errors: Vec<String>,
    /// Settings changed on reload that wait for a restart.
    pub restart_pending: Vec<String>,
    /// Successful reloads.
    pub reloads: u64,
    /// Reloads rejected (bad file).
    pub reload_failures: u64,
    /// Applies the gateway refused, from any source (daemon/sink.rs: too
    /// large for the XDP maps, fail-closed rules not installed, a map error).
    #[serde(default)]
    pub apply_failures: u64,
    /// Times the fail-closed nftables table could not be installed.
    #[serde(default)]
    pub fail_closed_errors: u64,
    /// Times another program removed the fail-closed table and the gateway
    /// put it back.
    #[serde(default)]
    pub fail_closed_repairs: u64,
    /// Kubernetes mode: Leases, peers, standbys (None in file mode).
    #[serde(default)]
    pub cluster: Option<ClusterReport>,
    /// Live sessions: (IPv4, IPv6).
    pub sessions: (u64, u64),
    /// Session table capacity: (IPv4, IPv6).
    pub session_capacity: (u64, u64),
    /// Routes and neighbours in the forwarding snapshot.
    pub fib_routes: u64,
    /// Neighbours in the forwarding snapshot.
    pub fib_neighbors: u64,
    /// The forwarding snapshot's generation: it grows with every route or
    /// neighbour change the daemon has applied (a change is in effect in the
    /// workers once this moved).
    #[serde(default)]
    pub fib_generation: u64,
}

/// Per-socket ring counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingStats {
    /// Worker.
    pub worker: u32,
    /// Interface name.
    pub interface: String,
    /// Queue.
    pub queue: u32,
    /// Frames received.
    pub rx: u64,
    /// Frames queued for transmit.
    pub tx: u64,
    /// Transmits that met a full TX ring.
    pub tx_ring_full: u64,
    /// Refills that found no free frame.
    pub fill_ring_empty: u64,
    /// Kernel `XDP_STATISTICS`: rx_dropped.
    pub kernel_rx_dropped: u64,
    /// rx_invalid_descs.
    pub kernel_rx_invalid_descs: u64,
    /// tx_invalid_descs.
    pub kernel_tx_invalid_descs: u64,
    /// rx_ring_full.
    pub kernel_rx_ring_full: u64,
    /// rx_fill_ring_empty_descs.
    pub kernel_rx_fill_ring_empty_descs: u64,
    /// tx_ring_empty_descs.
    pub kernel_tx_ring_empty_descs: u64,
}

/// `egret counters`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// Frames forwarded.
    pub forwarded: u64,
    /// Frames answered (ARP/NDP).
    pub answered: u64,
    /// Frames the engine returned `Pass` for: the XDP program steered them
    /// but the engine says they are the kernel's (should stay ~0).
    pub misdirected: u64,
    /// Drops by reason name (every reason, zeros included).
    pub drops: Vec<(String, u64)>,
    /// Events by name.
    pub events: Vec<(String, u64)>,
    /// XDP verdicts by reason name.
    pub xdp: Vec<(String, u64)>,
    /// Per-socket ring counters.
    pub rings: Vec<RingStats>,
    /// Gratuitous ARP / unsolicited NA frames sent.
    pub announcements: u64,
    /// The XDP fast path (docs/fast-path.md).
    #[serde(default)]
    pub fast_path: FastPathCounters,
    /// The translation log exporter (`translationLogs:`; the workers' own
    /// loss is the event `translog_ring_full`).
    #[serde(default)]
    pub translog: TranslogCounters,
}

/// The translation log exporter's counters (`egret_translog_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TranslogCounters {
    /// Whether translation logs are on.
    pub enabled: bool,
    /// Records taken from the workers' rings, by kind
    /// (`session_create`, `session_delete`).
    pub records: Vec<(String, u64)>,
    /// Session deletes among `records`, by why the session ended
    /// (`expired`, `tcp-closed`, `evicted`, `invalidated`, `handed-over`,
    /// `not-adopted`).
    #[serde(default)]
    pub session_ends: Vec<(String, u64)>,
    /// Events sent, by sink (`ipfix`, `syslog`, `journal`).
    pub sent: Vec<(String, u64)>,
    /// Events lost in the exporter, by sink and reason (`queue_full`,
    /// `send_error`).
    pub dropped: Vec<(String, String, u64)>,
    /// Sends that reported the collector unreachable (ICMP), by sink.
    #[serde(default)]
    pub unreachable: Vec<(String, u64)>,
    /// The journal's segments together, bytes (`None`: no journal).
    #[serde(default)]
    pub journal_bytes: Option<u64>,
    /// The journal's oldest segment's start, Unix ms (`None`: no journal,
    /// or nothing written yet).
    #[serde(default)]
    pub journal_oldest_ms: Option<u64>,
    /// Events whose pod had no known identity (Kubernetes mode only).
    #[serde(default)]
    pub identity_unresolved: u64,
}

/// The XDP fast path's counters (`egret counters`, `egret_fastpath_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FastPathCounters {
    /// Whether the fast path is on (`xdp.fastPath`).
    pub enabled: bool,
    /// IPv4 sessions installed in the kernel now.
    pub sessions_v4: u64,
    /// IPv6 sessions installed in the kernel now.
    pub sessions_v6: u64,
    /// IPv4 sessions the kernel's table can hold (`xdp.fastPathSessions`).
    #[serde(default)]
    pub capacity_v4: u64,
    /// IPv6 sessions the kernel's table can hold; 0: IPv6 stays in the workers.
    #[serde(default)]
    pub capacity_v6: u64,
    /// Next-hop table entries in use.
    pub next_hops: u64,
    /// Frames, by outcome: `hit` (translated in XDP), `miss`, `skip_*` (not
    /// a shape the fast path translates), `punt_*` (a session matched, the
    /// engine handles the packet).
    pub packets: Vec<(String, u64)>,
    /// Installation attempts by outcome: `installed`, `refused_*`,
    /// `not_eligible`, `lost_race`, `errors`.
    pub offloads: Vec<(String, u64)>,
    /// Installed sessions taken out, by cause: `removed` (with the session),
    /// `fenced` (before a configuration change), `withdrawn` (route gone).
    pub removals: Vec<(String, u64)>,
    /// Next-hop entries rewritten (neighbour or interface changes).
    pub next_hop_updates: u64,
    /// Session directions moved to another next hop (route changes).
    pub rerouted: u64,
}

/// `egret policies`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRow {
    /// Name.
    pub name: String,
    /// Sources.
    pub sources: Vec<String>,
    /// Destinations.
    pub destinations: Vec<String>,
    /// Exceptions.
    pub except: Vec<String>,
    /// Egress IPs.
    pub egress_ips: Vec<IpAddr>,
    /// Packets pod -> outside.
    pub packets_out: u64,
    /// Bytes pod -> outside.
    pub bytes_out: u64,
    /// Packets outside -> pod.
    pub packets_in: u64,
    /// Bytes outside -> pod.
    pub bytes_in: u64,
}

/// `egret ports`: one (egress IP, protocol).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortRow {
    /// The egress IP.
    pub egress_ip: IpAddr,
    /// tcp | udp | icmp.
    pub proto: String,
    /// Ports (or identifiers) in use.
    pub in_use: u64,
    /// Size of the range.
    pub capacity: u64,
    /// Allocations that found no free port.
    pub exhausted: u64,
}

/// `egret port-blocks`: one egress IP's port blocks (ADR 0034 §6).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRow {
    /// The egress IP.
    pub egress_ip: IpAddr,
    /// Whether the published tables have it in block mode now; `false`:
    /// it left block mode (or changed its blocks) and these blocks are
    /// still held by sessions that began before.
    pub configured: bool,
    /// Ports per block.
    pub block_size: u16,
    /// Blocks one pod may hold.
    pub max_per_pod: u16,
    /// Blocks in the egress IP's range.
    pub capacity: u64,
    /// Blocks held now.
    pub in_use: u64,
    /// Pods holding at least one block.
    pub pods: u64,
    /// Allocations that found no free block.
    pub exhausted: u64,
    /// Allocations refused because the pod held `max_per_pod` blocks, all full.
    pub pod_limit: u64,
}

/// `egret sessions`: one session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRow {
    /// tcp | udp | icmp.
    pub proto: String,
    /// Pod address.
    pub pod: IpAddr,
    /// Pod port (ICMP identifier).
    pub pod_port: u16,
    /// Egress address.
    pub egress: IpAddr,
    /// Egress port.
    pub egress_port: u16,
    /// Remote address.
    pub remote: IpAddr,
    /// Remote port.
    pub remote_port: u16,
    /// Seconds since the last packet.
    pub idle_secs: u64,
    /// TCP phase, "" for others.
    pub state: String,
    /// Installed in the XDP fast path: its packets bypass the workers (the
    /// idle time then counts from the last packet a worker saw).
    #[serde(default)]
    pub offloaded: bool,
}

/// Which sessions to list.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionFilter {
    /// Only this egress IP.
    pub egress_ip: Option<IpAddr>,
    /// Only this pod.
    pub pod: Option<IpAddr>,
    /// Only this protocol (tcp, udp, icmp).
    pub proto: Option<String>,
    /// At most this many.
    pub limit: Option<usize>,
}

impl SessionFilter {
    /// Whether `s` passes.
    pub fn matches(&self, s: &SessionRow) -> bool {
        self.egress_ip.is_none_or(|e| e == s.egress)
            && self.pod.is_none_or(|p| p == s.pod)
            && self.proto.as_deref().is_none_or(|p| p == s.proto)
    }
}

/// A running gateway, as the admin socket and metrics see it.
/// The Kubernetes control plane as `egret status` and the metrics show it
/// (issue 16 §6): every egress IP's Lease, the peers, the standbys.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterReport {
    /// This gateway's Node name.
    pub node: String,
    /// Whether the first pass over the cluster's state ran.
    pub first_pass: bool,
    /// Milliseconds since the sync loop last ran a pass.
    pub last_pass_ms: u64,
    /// Whether the channel between gateways runs.
    pub ha: bool,
    /// Whether a crashed peer can be told from a silent one (TCP-MD5).
    pub end_authenticated: bool,
    /// The channel's keys by id, the primary first (a roll: docs/operations.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub channel_keys: Vec<String>,
    /// Every egress IP in use.
    pub leases: Vec<LeaseRow>,
    /// The channel's peers.
    pub peers: Vec<PeerRow>,
    /// IPs this gateway stands by for.
    pub shadows: Vec<ShadowRow>,
    /// IPs held elsewhere for which this gateway is the first standby but
    /// holds no complete copy yet (readiness waits for them, bounded).
    pub standby_pending: Vec<IpAddr>,
    /// Cloud pools: this gateway's interfaces.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cloud_interfaces: Vec<CloudInterfaceRow>,
    /// `PerNode` cloud pools: the worker Nodes' addresses this gateway
    /// makes (only the status writer has any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cloud_nodes: Vec<CloudNodeRow>,
    /// This gateway's liveness Lease (None: each IP's Lease is renewed,
    /// `kubernetes.ownership: perIP`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<LivenessRow>,
    /// Counters.
    pub counters: ClusterCounters,
}

/// This gateway's liveness Lease (`kubernetes.ownership: liveness`, ADR
/// 0016): one Lease renewed for all the egress IPs it holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LivenessRow {
    /// The Lease's name (`egret-gw-<node>`).
    pub lease: String,
    /// The epoch its IP records carry (0: none taken yet).
    pub epoch: u64,
    /// How long every IP of the epoch stays valid without another
    /// successful renewal (None: not valid; nothing is served or taken).
    pub valid_for_ms: Option<u64>,
    /// Times a peer expired it or it was deleted (each costs a new epoch
    /// and a rewrite of every IP's record).
    pub lost: u64,
    /// Other gateways' liveness Leases this gateway expired before taking
    /// their IPs.
    pub expired: u64,
}

/// One egress IP's Lease as this gateway sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRow {
    /// The IP.
    pub ip: IpAddr,
    /// The holder named by the Lease (None: released or absent).
    pub holder: Option<String>,
    /// Whether this gateway serves it now.
    pub held_here: bool,
    /// Fenced by its deadline here with its sessions kept, its Lease still
    /// naming this gateway (being taken back; ADR 0018).
    #[serde(default)]
    pub dormant_here: bool,
    /// Milliseconds this gateway may still serve it without another renewal.
    pub valid_for_ms: Option<u64>,
    /// Its eligible gateways, most preferred first.
    pub candidates: Vec<String>,
    /// Held here: its renewals fail (API server unreachable): kept by failsafe.
    pub renew_failing: bool,
    /// Held here: its standby.
    pub standby: Option<String>,
    /// Held here: whether the standby holds its latest copy.
    pub standby_in_sync: Option<bool>,
    /// A cloud pool's address: its public address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ip: Option<IpAddr>,
    /// Held here, a cloud pool's address: `assigned to eni-...`, or why not
    /// yet (it is not translated to until it is assigned).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud: Option<String>,
}

/// This gateway's network interface in a cloud pool's subnet.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloudInterfaceRow {
    /// The subnet.
    pub subnet: String,
    /// The interface (`eni-...`), if found.
    pub interface: Option<String>,
    /// Whether the provider's source/destination check is on (it must be off).
    pub source_dest_check: bool,
    /// Why the interface is not known.
    pub error: Option<String>,
}

/// A worker Node's cloud address (a `PerNode` cloud pool).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloudNodeRow {
    /// The Node.
    pub node: String,
    /// Its public address.
    pub public_ip: IpAddr,
    /// The private address the public one is associated with (the Node's
    /// pods are translated to it), once associated.
    pub private_ip: Option<IpAddr>,
    /// The Node's interface holding it, once associated.
    pub interface: Option<String>,
    /// Why it is not associated yet (None with no `private_ip`: being made).
    pub error: Option<String>,
}

/// One peer on the channel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerRow {
    /// Node name.
    pub name: String,
    /// Its channel address.
    pub addr: String,
    /// Connection state.
    pub state: String,
    /// Its process incarnation while up.
    pub incarnation: Option<u64>,
    /// Milliseconds in this state.
    pub since_ms: u64,
    /// How its last connection ended.
    pub last_end: Option<String>,
    /// Bytes queued to it.
    pub queue_bytes: u64,
    /// The key its current or last connection ran under (`egret_peer_key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

/// One shadow copy held for another gateway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowRow {
    /// The IP.
    pub ip: IpAddr,
    /// Its holder.
    pub holder: String,
    /// Sessions copied.
    pub sessions: u64,
    /// Whether a complete copy arrived.
    pub in_sync: bool,
    /// Milliseconds since the last message.
    pub age_ms: u64,
}

/// Counters of the Kubernetes control plane and the channel.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterCounters {
    /// IPs taken over (create or acquire).
    pub takeovers: u64,
    /// IPs fenced (deadline passed, foreign record, not eligible, stop).
    pub fenced: u64,
    /// Dormant IPs served again with the sessions they kept (fenced by
    /// their deadline, then their Lease taken back before anyone else).
    #[serde(default)]
    pub resumed: u64,
    /// Lease requests that failed for want of an API server.
    pub lease_api_errors: u64,
    /// Lease requests refused by a conflict.
    pub lease_conflicts: u64,
    /// Times every watch started over because the Lease watch had not
    /// shown this gateway's own renewal within renewDeadline.
    #[serde(default)]
    pub watch_restarts: u64,
    /// Failsafe: IPs kept by every other gateway's acceptance.
    pub failsafe_confirmed: u64,
    /// Failsafe: IPs some peer refused.
    pub failsafe_refused: u64,
    /// Failsafe requests this gateway accepted (promises given).
    pub promises_given: u64,
    /// Peers proven dead.
    pub peers_gone: u64,
    /// Channel resets whose peer came back as the same process.
    pub peer_resets_survived: u64,
    /// IPs freed early because their holder died.
    pub early_takeovers_allowed: u64,
    /// Shadow sessions installed on take-over.
    pub sessions_imported: u64,
    /// Shadow sessions that could not be installed.
    pub sessions_not_imported: u64,
    /// Session records sent to standbys.
    pub sync_records_sent: u64,
    /// Full copies sent.
    pub sync_full_copies: u64,
    /// Journal overflows (each forces full copies).
    pub sync_journal_overflows: u64,
    /// Frames the channel refused (queue full).
    pub sync_sends_refused: u64,
    /// Cloud assignments found drifted from this gateway's interface and
    /// made again.
    #[serde(default)]
    pub cloud_drift_repairs: u64,
    /// How long Lease renewals took to be answered (or to fail).
    #[serde(default)]
    pub lease_renew_latency: Latencies,
}

/// Upper bounds, in seconds, of [`Latencies`]' buckets; a last bucket,
/// +Inf, follows. With the default timing a renewal answered after 1.5 s
/// (`renewDeadline` - `retryPeriod`) lets the deadline pass before it
/// lands, unless the failsafe peers confirm.
pub const LATENCY_BOUNDS: [f64; 9] = [0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 5.0];

/// A latency histogram with the buckets of [`LATENCY_BOUNDS`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Latencies {
    /// Per bucket (each bound, then +Inf), the observations in it and in
    /// no lower one; empty until the first observation.
    pub buckets: Vec<u64>,
    /// The sum of the observations, microseconds.
    pub sum_micros: u64,
}

impl Latencies {
    /// Counts one observation.
    pub fn record(&mut self, d: std::time::Duration) {
        if self.buckets.is_empty() {
            self.buckets = vec![0; LATENCY_BOUNDS.len() + 1];
        }
        let secs = d.as_secs_f64();
        let i = LATENCY_BOUNDS.iter().position(|b| secs <= *b).unwrap_or(LATENCY_BOUNDS.len());
        self.buckets[i] += 1;
        self.sum_micros = self.sum_micros.saturating_add(d.as_micros() as u64);
    }

    /// The observations.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// (upper bound, observations in the bucket) per bucket, +Inf last.
    pub fn per_bucket(&self) -> Vec<(f64, u64)> {
        LATENCY_BOUNDS
            .iter()
            .copied()
            .chain([f64::INFINITY])
            .enumerate()
            .map(|(i, b)| (b, self.buckets.get(i).copied().unwrap_or(0)))
            .collect()
    }
}

pub trait GatewayView: Send + Sync + 'static {
    /// `egret status`.
    fn status(&self) -> Status;
    /// `egret counters`.
    fn counters(&self) -> Counters;
    /// `egret policies`.
    fn policies(&self) -> Vec<PolicyRow>;
    /// `egret ports`.
    fn ports(&self) -> Vec<PortRow>;
    /// `egret sessions`.
    fn sessions(&self, filter: &SessionFilter) -> Vec<SessionRow>;
    /// `egret port-blocks`: the egress IPs with port blocks.
    fn port_blocks(&self) -> Vec<BlockRow> {
        Vec::new()
    }
    /// `egret port-use`: the last count of port use per destination and
    /// pod (crate::port_use).
    fn port_use(&self) -> std::sync::Arc<crate::port_use::PortUse> {
        std::sync::Arc::default()
    }
    /// `egret who-had`: from the translation logs' journal, and the live
    /// sessions for those the journal has no end for.
    fn who_had(&self, _q: &WhoHadQuery) -> Result<WhoHadAnswer, String> {
        Err("this gateway keeps no translation log journal (translationLogs.journal): ask the collector".into())
    }
}

/// `egret who-had ADDR:PORT --at T`'s question.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhoHadQuery {
    /// The egress address.
    pub egress: IpAddr,
    /// The egress port (ICMP: the identifier).
    pub port: u16,
    /// When, Unix ms.
    pub at_ms: u64,
    /// Only this protocol (tcp, udp, icmp).
    #[serde(default)]
    pub proto: Option<String>,
    /// Only sessions towards this remote.
    #[serde(default)]
    pub remote: Option<std::net::SocketAddr>,
}

/// `egret who-had`'s answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhoHadAnswer {
    /// The question's time, Unix ms.
    pub at_ms: u64,
    /// The journal's oldest segment's start, Unix ms (`None`: empty).
    pub journal_starts_ms: Option<u64>,
    /// The time asked about is before the journal starts (or the journal
    /// is empty) and nothing was found: ask the collector.
    pub before_journal: bool,
    /// The sessions that held the address and port at that time.
    pub sessions: Vec<WhoHadRow>,
    /// When no session record matched: the port blocks that held it
    /// (pods in block mode log blocks, not sessions; ADR 0034 §6).
    #[serde(default)]
    pub blocks: Vec<WhoHadBlockRow>,
}

/// One port block that held the address and port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhoHadBlockRow {
    /// The pod's address.
    pub pod: IpAddr,
    /// The egress address.
    pub egress: IpAddr,
    /// The block's first port.
    pub first_port: u16,
    /// The block's last port.
    pub last_port: u16,
    /// The pod's identity when the block was taken, if known.
    pub pod_identity: Option<crate::translog::identity::PodIdentity>,
    /// Taken, Unix ms; `None`: not in this gateway's journal.
    pub allocated_ms: Option<u64>,
    /// Freed, Unix ms; `None`: no release in the journal (still held, or
    /// its release was lost).
    pub freed_ms: Option<u64>,
}

/// One session that held the address and port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WhoHadRow {
    /// tcp | udp | icmp.
    pub proto: String,
    /// The pod's address.
    pub pod: IpAddr,
    /// The pod's port (ICMP: identifier).
    pub pod_port: u16,
    /// The egress address.
    pub egress: IpAddr,
    /// The egress port.
    pub egress_port: u16,
    /// The remote, unless `logDestinations: false`.
    pub remote: Option<std::net::SocketAddr>,
    /// The pod's identity when the session was created, if known.
    pub pod_identity: Option<crate::translog::identity::PodIdentity>,
    /// Created, Unix ms; `None`: not in this gateway's journal (adopted
    /// from a peer: ask its journal or the collector).
    pub created_ms: Option<u64>,
    /// Its last packet, Unix ms (whole seconds): the delete's, or the live
    /// session's.
    pub last_ms: Option<u64>,
    /// Removed, Unix ms; `None`: no delete in the journal.
    pub deleted_ms: Option<u64>,
    /// Why it ended (expired, tcp-closed, evicted, invalidated).
    pub reason: Option<String>,
    /// Still in the session table now.
    pub live: bool,
    /// Adopted from a peer gateway (its delete is this gateway's).
    pub adopted: bool,
}

/// The name of an IP protocol number in listings.
pub fn proto_name(p: u8) -> &'static str {
    match p {
        6 => "tcp",
        17 => "udp",
        1 | 58 => "icmp",
        _ => "other",
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn mac_string(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}
