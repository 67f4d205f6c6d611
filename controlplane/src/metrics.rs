//! Prometheus metrics and the probes, served over HTTP/1.1 (hyper) on the
//! configured address (ADR 0024).
//!
//! `GET /metrics`: everything in [`crate::view`], encoded by
//! prometheus-client as OpenMetrics text ([`CONTENT_TYPE`]) from one
//! snapshot per scrape ([`render`]: a [`Collector`] over the snapshot, no
//! live metric objects). `GET /ready`: 200 once the XDP program is attached
//! and every worker runs, 503 before (and while stopping). `GET /healthz`:
//! the liveness probe. Anything else: 404; any other method: 405. One
//! request per connection (`connection: close`); the server holds at most
//! [`MAX_CONNECTIONS`] connections, each for at most [`CONNECTION_LIMIT`].

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE as CONTENT_TYPE_HEADER};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeCounterValue, EncodeGaugeValue, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::port_use::PortUse;
use crate::view::{BlockRow, ClusterReport, Counters, GatewayView, PolicyRow, PortRow, RingStats, Status};

/// The content type of `/metrics`: prometheus-client's text encoder writes
/// OpenMetrics 1.0 (Prometheus asks for it first in its `Accept` header).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Connections served at once; one over the cap is closed at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Connections one source address may hold at once (the kubelet's probes
/// and Prometheus each need one): a single client cannot take every slot
/// and fail the liveness probe, which would restart the gateway.
pub const MAX_CONNECTIONS_PER_SOURCE: usize = 8;
/// Time a client has to send its request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a connection may last in all (request, answer, a slow reader).
pub const CONNECTION_LIMIT: Duration = Duration::from_secs(10);

static SECONDS: Unit = Unit::Seconds;
static BYTES: Unit = Unit::Bytes;

/// The OpenMetrics text of one [`Collector`], `# EOF` included: the
/// collector is encoded once, so what it holds is one snapshot.
pub fn exposition(collector: impl Collector) -> String {
    let mut registry = Registry::with_prefix("egret");
    registry.register_collector(Box::new(collector));
    let mut out = String::with_capacity(32 * 1024);
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &registry) {
        // Writing to a String does not fail; an encoder refusing a value would.
        tracing::warn!(error = %e, "encoding the metrics failed");
    }
    out
}

/// Writes metric families, each declared (`# HELP`, `# TYPE`, `# UNIT`)
/// before its samples. Names are given without the registry's `egret_`
/// prefix, a counter's without the `_total` its samples get.
pub(crate) struct Families<'a>(pub(crate) DescriptorEncoder<'a>);

impl Families<'_> {
    fn family<'s>(
        &'s mut self,
        name: &'s str,
        help: &str,
        unit: Option<&'static Unit>,
        kind: MetricType,
    ) -> Result<Family<'s>, fmt::Error> {
        let encoder = self.0.encode_descriptor(name, help, unit, kind)?;
        Ok(Family { encoder, counter: kind == MetricType::Counter })
    }

    /// A gauge family.
    pub(crate) fn gauge<'s>(&'s mut self, name: &'s str, help: &str) -> Result<Family<'s>, fmt::Error> {
        self.family(name, help, None, MetricType::Gauge)
    }

    /// A counter family (`name` without `_total`).
    pub(crate) fn counter<'s>(&'s mut self, name: &'s str, help: &str) -> Result<Family<'s>, fmt::Error> {
        self.family(name, help, None, MetricType::Counter)
    }

    /// A gauge family in seconds (`name` without `_seconds`).
    pub(crate) fn seconds<'s>(&'s mut self, name: &'s str, help: &str) -> Result<Family<'s>, fmt::Error> {
        self.family(name, help, Some(&SECONDS), MetricType::Gauge)
    }

    /// A histogram family in seconds (`name` without `_seconds`).
    pub(crate) fn histogram_seconds<'s>(&'s mut self, name: &'s str, help: &str) -> Result<Family<'s>, fmt::Error> {
        self.family(name, help, Some(&SECONDS), MetricType::Histogram)
    }

    /// A family in bytes (`name` without `_bytes`).
    pub(crate) fn bytes<'s>(
        &'s mut self,
        name: &'s str,
        help: &str,
        kind: MetricType,
    ) -> Result<Family<'s>, fmt::Error> {
        self.family(name, help, Some(&BYTES), kind)
    }
}

/// One family's samples.
pub(crate) struct Family<'a> {
    encoder: MetricEncoder<'a>,
    counter: bool,
}

impl Family<'_> {
    /// One sample (no labels: `&[]`).
    pub(crate) fn sample<V: EncodeCounterValue + EncodeGaugeValue>(
        &mut self,
        labels: &[(&str, &str)],
        value: V,
    ) -> fmt::Result {
        let mut m = self.encoder.encode_family(&labels)?;
        if self.counter {
            m.encode_counter::<NoLabelSet, V, u64>(&value, None)
        } else {
            m.encode_gauge(&value)
        }
    }
}

impl Family<'_> {
    /// One histogram: per bucket (upper bound, observations in it and in no
    /// lower one), +Inf last.
    pub(crate) fn histogram(
        &mut self,
        labels: &[(&str, &str)],
        sum: f64,
        count: u64,
        buckets: &[(f64, u64)],
    ) -> fmt::Result {
        self.encoder.encode_family(&labels)?.encode_histogram::<NoLabelSet>(sum, count, buckets, None)
    }
}

/// Milliseconds as (float) seconds.
fn secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// One scrape's snapshot of the gateway.
#[derive(Debug)]
struct Snapshot {
    status: Status,
    counters: Counters,
    policies: Vec<PolicyRow>,
    ports: Vec<PortRow>,
    port_blocks: Vec<BlockRow>,
    port_use: Arc<PortUse>,
    admin_refused: u64,
}

impl Collector for Snapshot {
    fn encode(&self, encoder: DescriptorEncoder) -> fmt::Result {
        let mut o = Families(encoder);
        self.gateway(&mut o)?;
        if let Some(c) = &self.status.cluster {
            cluster(&mut o, c)?;
        }
        Ok(())
    }
}

/// The exposition text for one scrape of `view`.
pub fn render(view: &dyn GatewayView) -> String {
    exposition(Snapshot {
        status: view.status(),
        counters: view.counters(),
        policies: view.policies(),
        ports: view.ports(),
        port_blocks: view.port_blocks(),
        port_use: view.port_use(),
        admin_refused: crate::admin::refused_connections(),
    })
}

impl Snapshot {
    fn gateway(&self, o: &mut Families) -> fmt::Result {
        let (status, counters) = (&self.status, &self.counters);
        o.gauge("config_generation", "Generation of the configuration in use.")?.sample(&[], status.generation)?;
        o.gauge(
            "fib_generation",
            "Generation of the forwarding snapshot (grows with every route or neighbour change applied).",
        )?
        .sample(&[], status.fib_generation)?;
        o.counter("config_reloads", "Configuration reloads applied.")?.sample(&[], status.reloads)?;
        o.counter("config_reload_failures", "Configuration reloads rejected (the old configuration stays).")?
            .sample(&[], status.reload_failures)?;
        o.counter(
            "config_apply_failures",
            "Applies refused (too large for the XDP maps, fail-closed rules not installed, a map error): the gateway runs the configuration the logged error names.",
        )?
        .sample(&[], status.apply_failures)?;
        o.counter("fail_closed_errors", "Times the fail-closed nftables table could not be installed.")?
            .sample(&[], status.fail_closed_errors)?;
        o.counter(
            "fail_closed_repairs",
            "Times another program removed the fail-closed nftables table and the gateway put it back.",
        )?
        .sample(&[], status.fail_closed_repairs)?;
        o.gauge("ready", "1 once the XDP program is attached and every worker runs.")?
            .sample(&[], u64::from(status.ready))?;
        o.counter(
            "admin_connections_refused",
            "Admin-socket connections refused: the peer was neither root nor the daemon's user.",
        )?
        .sample(&[], self.admin_refused)?;

        let mut f = o.counter("policy_packets", "Translated packets per policy and direction.")?;
        for p in &self.policies {
            f.sample(&[("policy", &p.name), ("direction", "outbound")], p.packets_out)?;
            f.sample(&[("policy", &p.name), ("direction", "inbound")], p.packets_in)?;
        }
        let mut f =
            o.bytes("policy", "Translated bytes (Ethernet frames) per policy and direction.", MetricType::Counter)?;
        for p in &self.policies {
            f.sample(&[("policy", &p.name), ("direction", "outbound")], p.bytes_out)?;
            f.sample(&[("policy", &p.name), ("direction", "inbound")], p.bytes_in)?;
        }

        o.counter("frames_forwarded", "Frames rewritten and sent on.")?.sample(&[], counters.forwarded)?;
        o.counter("frames_answered", "ARP requests and neighbour solicitations answered.")?
            .sample(&[], counters.answered)?;
        o.counter(
            "frames_misdirected",
            "Frames the XDP program steered but the engine left to the kernel (should stay 0).",
        )?
        .sample(&[], counters.misdirected)?;
        o.counter("announcements", "Gratuitous ARP and unsolicited neighbour advertisements sent.")?
            .sample(&[], counters.announcements)?;
        let mut f = o.counter("drops", "Frames dropped by the engine, by reason.")?;
        for (r, n) in &counters.drops {
            f.sample(&[("reason", r)], *n)?;
        }
        let mut f = o.counter("events", "Engine events (sessions created/expired, ...), by name.")?;
        for (e, n) in &counters.events {
            f.sample(&[("event", e)], *n)?;
        }
        let mut f = o.counter("xdp_verdicts", "Frames the XDP steering program judged, by reason.")?;
        for (r, n) in &counters.xdp {
            f.sample(&[("reason", r)], *n)?;
        }

        let fp = &counters.fast_path;
        o.gauge("fastpath_enabled", "1 when established flows are translated in XDP (xdp.fastPath).")?
            .sample(&[], u64::from(fp.enabled))?;
        let mut f = o.gauge("fastpath_sessions", "Sessions installed in the XDP fast path per address family.")?;
        f.sample(&[("family", "ipv4")], fp.sessions_v4)?;
        f.sample(&[("family", "ipv6")], fp.sessions_v6)?;
        let mut f = o.gauge(
            "fastpath_capacity",
            "Sessions the XDP fast path can hold per address family (xdp.fastPathSessions).",
        )?;
        f.sample(&[("family", "ipv4")], fp.capacity_v4)?;
        f.sample(&[("family", "ipv6")], fp.capacity_v6)?;
        o.gauge("fastpath_next_hops", "Next-hop table entries in use.")?.sample(&[], fp.next_hops)?;
        let mut f = o.counter(
            "fastpath_packets",
            "Frames the fast path looked at, by outcome: hit (translated in XDP), miss, skip_* (not its shape), punt_* (to the engine).",
        )?;
        for (r, n) in &fp.packets {
            f.sample(&[("outcome", r)], *n)?;
        }
        let mut f = o.counter("fastpath_offloads", "Session installations, by outcome (installed, refused_*, ...).")?;
        for (r, n) in &fp.offloads {
            f.sample(&[("outcome", r)], *n)?;
        }
        let mut f = o.counter("fastpath_removals", "Installed sessions taken out of the kernel, by cause.")?;
        for (r, n) in &fp.removals {
            f.sample(&[("cause", r)], *n)?;
        }
        o.counter("fastpath_next_hop_updates", "Next-hop entries rewritten after neighbour changes.")?
            .sample(&[], fp.next_hop_updates)?;
        o.counter("fastpath_rerouted", "Session directions moved to another next hop after route changes.")?
            .sample(&[], fp.rerouted)?;

        let tl = &counters.translog;
        o.gauge("translog_enabled", "1 when translation logs are on (translationLogs:).")?
            .sample(&[], u64::from(tl.enabled))?;
        let mut f = o.counter(
            "translog_records",
            "Translation log records taken from the workers' rings, by kind (a full ring's losses are the event translog_ring_full).",
        )?;
        for (k, n) in &tl.records {
            f.sample(&[("kind", k)], *n)?;
        }
        let mut f = o.counter(
            "translog_session_ends",
            "Session deletes among translog_records, by why the session ended (expired, tcp-closed, evicted, invalidated; handed-over: journal only, the next holder logs the end; not-adopted: a take-over's import refused a session the previous holder had logged).",
        )?;
        for (r, n) in &tl.session_ends {
            f.sample(&[("reason", r)], *n)?;
        }
        let mut f = o.counter("translog_sent", "Translation log events sent, by sink (ipfix, syslog, journal).")?;
        for (s, n) in &tl.sent {
            f.sample(&[("sink", s)], *n)?;
        }
        let mut f = o.counter(
            "translog_dropped",
            "Translation log events lost in the exporter, by sink and reason (queue_full, send_error, write_error).",
        )?;
        for (s, r, n) in &tl.dropped {
            f.sample(&[("sink", s), ("reason", r)], *n)?;
        }
        let mut f = o.counter(
            "translog_unreachable",
            "Translation log sends that reported the collector unreachable (an ICMP error an earlier datagram drew), by sink: datagrams were lost.",
        )?;
        for (s, n) in &tl.unreachable {
            f.sample(&[("sink", s)], *n)?;
        }
        o.counter(
            "translog_identity_unresolved",
            "Translation log events whose pod address no pod held at the drain (Kubernetes mode; no identity in the record).",
        )?
        .sample(&[], tl.identity_unresolved)?;
        let mut f = o.gauge(
            "translog_journal_bytes",
            "The translation logs' local journal: its segments together, bytes (absent: no journal).",
        )?;
        if let Some(b) = tl.journal_bytes {
            f.sample(&[], b)?;
        }
        let mut f = o.seconds(
            "translog_journal_oldest_timestamp",
            "The start of the journal's oldest segment, Unix seconds: egret who-had answers from then on.",
        )?;
        if let Some(ms) = tl.journal_oldest_ms {
            f.sample(&[], ms / 1000)?;
        }

        let mut f = o.gauge("sessions", "Live sessions per address family.")?;
        f.sample(&[("family", "ipv4")], status.sessions.0)?;
        f.sample(&[("family", "ipv6")], status.sessions.1)?;
        let mut f = o.gauge("sessions_capacity", "Session table capacity per address family.")?;
        f.sample(&[("family", "ipv4")], status.session_capacity.0)?;
        f.sample(&[("family", "ipv6")], status.session_capacity.1)?;

        type PortField = fn(&PortRow) -> u64;
        let ports: [(&str, MetricType, &str, PortField); 3] = [
            (
                "ports_in_use",
                MetricType::Gauge,
                "External ports (or ICMP identifiers) in use per egress IP and protocol.",
                |p| p.in_use,
            ),
            ("ports_capacity", MetricType::Gauge, "Size of the external port range per egress IP and protocol.", |p| {
                p.capacity
            }),
            (
                "ports_exhausted",
                MetricType::Counter,
                "Allocations that found no free port, per egress IP and protocol.",
                |p| p.exhausted,
            ),
        ];
        for (name, kind, help, get) in ports {
            let mut f = o.family(name, help, None, kind)?;
            for p in &self.ports {
                let ip = p.egress_ip.to_string();
                f.sample(&[("egress_ip", &ip), ("proto", &p.proto)], get(p))?;
            }
        }

        port_blocks(o, &self.port_blocks)?;
        port_use(o, &self.port_use)?;

        type RingField = fn(&RingStats) -> u64;
        let rings: [(&str, &str, RingField); 10] = [
            ("xsk_rx_frames", "Frames received from the RX ring.", |r| r.rx),
            ("xsk_tx_frames", "Frames queued on the TX ring.", |r| r.tx),
            ("xsk_tx_ring_full", "Transmits that met a full TX ring.", |r| r.tx_ring_full),
            ("xsk_fill_ring_empty", "Fill-ring refills that found no free frame.", |r| r.fill_ring_empty),
            ("xsk_kernel_rx_dropped", "Kernel XDP_STATISTICS rx_dropped.", |r| r.kernel_rx_dropped),
            ("xsk_kernel_rx_invalid_descs", "Kernel XDP_STATISTICS rx_invalid_descs.", |r| r.kernel_rx_invalid_descs),
            ("xsk_kernel_tx_invalid_descs", "Kernel XDP_STATISTICS tx_invalid_descs.", |r| r.kernel_tx_invalid_descs),
            ("xsk_kernel_rx_ring_full", "Kernel XDP_STATISTICS rx_ring_full.", |r| r.kernel_rx_ring_full),
            ("xsk_kernel_rx_fill_ring_empty_descs", "Kernel XDP_STATISTICS rx_fill_ring_empty_descs.", |r| {
                r.kernel_rx_fill_ring_empty_descs
            }),
            ("xsk_kernel_tx_ring_empty_descs", "Kernel XDP_STATISTICS tx_ring_empty_descs.", |r| {
                r.kernel_tx_ring_empty_descs
            }),
        ];
        for (name, help, get) in rings {
            let mut f = o.counter(name, help)?;
            for r in &counters.rings {
                let (w, q) = (r.worker.to_string(), r.queue.to_string());
                f.sample(&[("worker", &w), ("interface", &r.interface), ("queue", &q)], get(r))?;
            }
        }
        Ok(())
    }
}

/// Port blocks per egress IP (ADR 0034 §6): one series each, labelled by
/// the block size so a change of configuration starts new series.
fn port_blocks(o: &mut Families, rows: &[BlockRow]) -> fmt::Result {
    type BlockField = fn(&BlockRow) -> u64;
    let families: [(&str, MetricType, &str, BlockField); 5] = [
        ("port_blocks_in_use", MetricType::Gauge, "Port blocks held by pods, per egress IP in block mode.", |b| {
            b.in_use
        }),
        ("port_blocks_capacity", MetricType::Gauge, "Port blocks in the egress IP's range.", |b| b.capacity),
        ("port_blocks_pods", MetricType::Gauge, "Pods holding at least one port block, per egress IP.", |b| b.pods),
        (
            "port_blocks_exhausted",
            MetricType::Counter,
            "Allocations that found no free port block, per egress IP (natEvent 12).",
            |b| b.exhausted,
        ),
        (
            "port_blocks_pod_limit",
            MetricType::Counter,
            "Allocations refused because the pod held portBlocks.maxPerPod blocks, all full (natEvent 13).",
            |b| b.pod_limit,
        ),
    ];
    // An IP's pool retired by a change of its range (ADR 0042) has the
    // current pool's labels when the block size stayed: one series of both,
    // their blocks, pods and refusals added, the larger capacity (the
    // current range's, as a rule; a pod holding blocks in both counts twice).
    let mut series: BTreeMap<(IpAddr, u16), [u64; 5]> = BTreeMap::new();
    for b in rows {
        let sum = series.entry((b.egress_ip, b.block_size)).or_default();
        for (v, (name, _, _, get)) in sum.iter_mut().zip(&families) {
            *v = if *name == "port_blocks_capacity" { (*v).max(get(b)) } else { *v + get(b) };
        }
    }
    for (i, (name, kind, help, _)) in families.iter().enumerate() {
        let mut f = o.family(name, help, None, *kind)?;
        for ((ip, size), values) in &series {
            let (ip, size) = (ip.to_string(), size.to_string());
            f.sample(&[("egress_ip", &ip), ("block_size", &size)], values[i])?;
        }
    }
    Ok(())
}

/// Port use per destination and pod (crate::port_use, ADR 0035): the last
/// walk's top N, so the label sets are bounded and replaced every walk.
fn port_use(o: &mut Families, u: &PortUse) -> fmt::Result {
    let mut f = o.gauge(
        "ports_in_use_by_destination",
        "Endpoint-dependent mapping: ports in use towards a remote address:port, per egress IP and protocol, for the destinations using most (metrics.portUseTop); each has the whole egret_ports_capacity.",
    )?;
    for p in &u.pools {
        let ip = p.egress_ip.to_string();
        for d in &p.destinations {
            f.sample(&[("egress_ip", &ip), ("proto", &p.proto), ("remote", &d.remote.to_string())], d.in_use)?;
        }
    }
    let mut f = o.gauge(
        "ports_in_use_by_pod",
        "Ports a pod holds per egress IP and protocol (towards remote in endpoint-dependent mapping, empty otherwise), for the pods holding most (metrics.portUseTop); their limit is egret_ports_pod_quota.",
    )?;
    for p in &u.pools {
        let ip = p.egress_ip.to_string();
        for pod in &p.pods {
            let remote = pod.remote.map(|r| r.to_string()).unwrap_or_default();
            f.sample(
                &[("egress_ip", &ip), ("proto", &p.proto), ("pod", &pod.pod.to_string()), ("remote", &remote)],
                pod.in_use,
            )?;
        }
    }
    let mut f = o.gauge(
        "ports_pod_quota",
        "Ports one pod may hold per egress IP and protocol (per remote in endpoint-dependent mapping): nat.maxPortsPerSource or a quarter of the range.",
    )?;
    for p in &u.pools {
        if let Some(q) = p.pod_quota {
            f.sample(&[("egress_ip", &p.egress_ip.to_string()), ("proto", &p.proto)], q)?;
        }
    }
    o.seconds("port_use_walk", "How long the last count of port use per destination and pod took.")?
        .sample(&[], u.walk_micros as f64 / 1e6)?;
    o.counter(
        "port_use_warnings",
        "Port-use warning levels reached (80 %, 95 % of a range towards a destination or of a pod's quota), each also a log line and in Kubernetes a Warning Event.",
    )?
    .sample(&[], u.warnings)?;
    Ok(())
}

/// Kubernetes mode: Leases, peers, standbys (issue 16 §6).
fn cluster(o: &mut Families, c: &ClusterReport) -> fmt::Result {
    let mut f = o.gauge("lease_held", "1 while this gateway serves the egress IP under its Lease.")?;
    for l in &c.leases {
        f.sample(&[("egress_ip", &l.ip.to_string())], u64::from(l.held_here))?;
    }
    let mut f = o.seconds(
        "lease_valid_for",
        "How long this gateway may still serve the IP without another renewal or failsafe acknowledgment.",
    )?;
    for l in c.leases.iter().filter(|l| l.held_here) {
        f.sample(&[("egress_ip", &l.ip.to_string())], secs(l.valid_for_ms.unwrap_or(0)))?;
    }
    let mut f = o.gauge(
        "lease_renew_failing",
        "1 while the IP's renewals fail for want of an API server (kept by the failsafe if every peer agrees).",
    )?;
    for l in c.leases.iter().filter(|l| l.held_here) {
        f.sample(&[("egress_ip", &l.ip.to_string())], u64::from(l.renew_failing))?;
    }
    let mut f = o.gauge(
        "cloud_address_assigned",
        "1 while the cloud address the gateway holds a Lease for is on its interface (only then is it translated to).",
    )?;
    for l in c.leases.iter().filter(|l| l.cloud.is_some() || (l.held_here && l.public_ip.is_some())) {
        // An IPv6 cloud address has no public address: an empty label.
        let (ip, public) = (l.ip.to_string(), l.public_ip.map(|p| p.to_string()).unwrap_or_default());
        let assigned = l.cloud.as_deref().is_some_and(|s| s.starts_with("assigned"));
        f.sample(&[("egress_ip", &ip), ("public_ip", &public)], u64::from(assigned))?;
    }
    let mut f = o.gauge(
        "cloud_source_dest_check",
        "1 while the provider's source/destination check is on for the gateway's interface (it must be off).",
    )?;
    for i in &c.cloud_interfaces {
        let Some(iface) = &i.interface else { continue };
        f.sample(&[("subnet", &i.subnet), ("interface", iface)], u64::from(i.source_dest_check))?;
    }
    let mut f = o.gauge(
        "cloud_node_address_associated",
        "1 while a worker Node's public address (a PerNode cloud pool) is associated with its interface; written by the status writer.",
    )?;
    for n in &c.cloud_nodes {
        let associated = n.private_ip.is_some() && n.error.is_none();
        f.sample(&[("node", &n.node), ("public_ip", &n.public_ip.to_string())], u64::from(associated))?;
    }
    let mut f = o.gauge("standby_in_sync", "1 while the standby of a held IP holds its latest session copy.")?;
    for l in c.leases.iter().filter(|l| l.held_here) {
        let (ip, sb) = (l.ip.to_string(), l.standby.clone().unwrap_or_default());
        f.sample(&[("egress_ip", &ip), ("standby", &sb)], u64::from(l.standby_in_sync == Some(true)))?;
    }
    let mut f =
        o.gauge("shadow_sessions", "Sessions copied from another gateway for an IP this gateway stands by for.")?;
    for x in &c.shadows {
        f.sample(&[("egress_ip", &x.ip.to_string()), ("holder", &x.holder)], x.sessions)?;
    }
    let mut f = o.gauge("peer_up", "1 while the channel to the peer gateway is up.")?;
    for p in &c.peers {
        f.sample(&[("peer", &p.name)], u64::from(p.state == "up"))?;
    }
    let mut f = o.gauge(
        "peer_key",
        "1 for the key (by id) the channel to the peer runs or last ran under: a key roll is done when every peer shows the new one.",
    )?;
    for p in &c.peers {
        if let Some(k) = &p.key {
            f.sample(&[("peer", &p.name), ("key", k)], 1u64)?;
        }
    }
    let mut f = o.gauge(
        "channel_key",
        "1 for each key this gateway holds for the channel, by id; role is primary or accepted.",
    )?;
    for (i, k) in c.channel_keys.iter().enumerate() {
        f.sample(&[("key", k), ("role", if i == 0 { "primary" } else { "accepted" })], 1u64)?;
    }
    let mut f = o.bytes("peer_queue", "Bytes queued on the channel to the peer.", MetricType::Gauge)?;
    for p in &c.peers {
        f.sample(&[("peer", &p.name)], p.queue_bytes)?;
    }
    o.seconds("control_plane_last_pass_age", "Since the Kubernetes sync loop last ran a pass.")?
        .sample(&[], secs(c.last_pass_ms))?;
    let k = &c.counters;
    let counters: [(&str, &str, u64); 19] = [
        ("lease_takeovers", "Egress IPs this gateway took (created or acquired a Lease).", k.takeovers),
        (
            "lease_fenced",
            "Egress IPs this gateway stopped serving (deadline, foreign record, not eligible, stop).",
            k.fenced,
        ),
        (
            "lease_resumed",
            "Egress IPs fenced by their deadline, kept dormant with their sessions, and served again once their Lease was ours again.",
            k.resumed,
        ),
        ("lease_api_errors", "Lease requests that failed for want of an API server.", k.lease_api_errors),
        (
            "cloud_drift_repairs",
            "Cloud addresses whose assignment to this gateway's interface the provider's view showed gone (moved by someone else, or lost), and that were assigned again.",
            k.cloud_drift_repairs,
        ),
        ("lease_conflicts", "Lease requests refused because another gateway changed the Lease first.", k.lease_conflicts),
        (
            "watch_restarts",
            "Times every watch started over because the Lease watch had not shown this gateway's own renewal within renewDeadline (a stalled watch connection).",
            k.watch_restarts,
        ),
        (
            "failsafe_confirmed",
            "Held IPs kept through an API outage because every other eligible gateway agreed.",
            k.failsafe_confirmed,
        ),
        ("failsafe_refused", "Held IPs a peer refused to vouch for.", k.failsafe_refused),
        ("failsafe_promises", "Failsafe requests of other gateways this gateway accepted.", k.promises_given),
        (
            "peers_gone",
            "Peers whose process was proven dead (a signed FIN without goodbye, a signed RST not followed by the same process's return, or a new incarnation).",
            k.peers_gone,
        ),
        (
            "peer_resets_survived",
            "Channels reset without goodbye whose peer came back as the same process (an abort on a node, ss -K): not taken for deaths.",
            k.peer_resets_survived,
        ),
        (
            "early_takeovers_allowed",
            "IPs freed before their Lease expired because their holder died.",
            k.early_takeovers_allowed,
        ),
        ("sessions_imported", "Sessions of a previous holder installed on take-over.", k.sessions_imported),
        ("sessions_not_imported", "Sessions of a previous holder that could not be installed.", k.sessions_not_imported),
        ("sync_records", "Session records sent to standbys.", k.sync_records_sent),
        ("sync_full_copies", "Full session copies sent to standbys.", k.sync_full_copies),
        (
            "sync_journal_overflows",
            "Session changes lost to a full journal (each forces full copies).",
            k.sync_journal_overflows,
        ),
        (
            "sync_sends_refused",
            "Frames the peer channel refused (queue full; each forces a full copy).",
            k.sync_sends_refused,
        ),
    ];
    for (name, help, v) in counters {
        o.counter(name, help)?.sample(&[], v)?;
    }
    let l = &k.lease_renew_latency;
    o.histogram_seconds(
        "lease_renew_duration",
        "How long Lease renewals took to be answered or to fail; one answered later than renewDeadline - retryPeriod lets the IP's deadline pass first.",
    )?
    .histogram(&[], l.sum_micros as f64 / 1e6, l.count(), &l.per_bucket())?;
    if let Some(l) = &c.liveness {
        liveness(o, l)?;
    }
    Ok(())
}

/// `kubernetes.ownership: liveness`: this gateway's liveness Lease.
fn liveness(o: &mut Families, l: &crate::view::LivenessRow) -> fmt::Result {
    o.gauge("liveness_epoch", "The epoch of this gateway's liveness Lease, which its egress IPs' Leases carry.")?
        .sample(&[("lease", &l.lease)], l.epoch)?;
    o.seconds(
        "liveness_valid_for",
        "How long every egress IP of this gateway stays valid without another successful liveness renewal (0: not valid: nothing is served or taken).",
    )?
    .sample(&[], secs(l.valid_for_ms.unwrap_or(0)))?;
    o.counter(
        "liveness_lost",
        "Times this gateway's liveness Lease was expired by a peer or deleted (each takes a new epoch, and each IP's Lease is rewritten before it is served again).",
    )?
    .sample(&[], l.lost)?;
    o.counter("liveness_expired", "Other gateways' liveness Leases this gateway expired before taking their IPs.")?
        .sample(&[], l.expired)?;
    Ok(())
}

/// A plain-text HTTP handler: path -> (status code, content type, body).
pub type Handler = Arc<dyn Fn(&str) -> (u16, &'static str, String) + Send + Sync>;

/// The answer to `GET path` (the query left out); `ready` is `Err(why)`
/// while the gateway is not ready (`/ready` answers 503 with why), `alive`
/// while its control plane is dead (`/healthz`: the liveness probe).
pub fn respond<R: fmt::Display, A: fmt::Display>(
    view: &dyn GatewayView,
    ready: Result<(), R>,
    alive: Result<(), A>,
    path: &str,
) -> (u16, &'static str, String) {
    match path {
        "/metrics" => (200, CONTENT_TYPE, render(view)),
        "/ready" => match ready {
            Ok(()) => (200, "text/plain", "ready\n".into()),
            Err(why) => (503, "text/plain", format!("not ready: {why}\n")),
        },
        "/healthz" => match alive {
            Ok(()) => (200, "text/plain", "ok\n".into()),
            Err(why) => (503, "text/plain", format!("not alive: {why}\n")),
        },
        _ => (404, "text/plain", "try /metrics, /ready or /healthz\n".into()),
    }
}

/// Serves `listener` until the task is dropped.
pub async fn serve<R: fmt::Display + 'static, A: fmt::Display + 'static>(
    listener: TcpListener,
    view: Arc<dyn GatewayView>,
    ready: Arc<dyn Fn() -> Result<(), R> + Send + Sync>,
    alive: Arc<dyn Fn() -> Result<(), A> + Send + Sync>,
) {
    serve_fn(listener, Arc::new(move |path: &str| respond(view.as_ref(), ready(), alive(), path))).await;
}

/// Serves `GET` requests with `handler` until the task is dropped (also the
/// node agent's `/metrics`, `/ready`, `/healthz`).
pub async fn serve_fn(listener: TcpListener, handler: Handler) {
    serve_limited(listener, handler, Limits::DEFAULT).await;
}

/// What one client may hold of the server.
#[derive(Clone, Copy, Debug)]
struct Limits {
    /// Connections at once.
    connections: usize,
    /// Connections at once from one source address.
    per_source: usize,
    /// Time to send the request head.
    header_read: Duration,
    /// Time a connection may last in all.
    connection: Duration,
}

impl Limits {
    const DEFAULT: Limits = Limits {
        connections: MAX_CONNECTIONS,
        per_source: MAX_CONNECTIONS_PER_SOURCE,
        header_read: HEADER_READ_TIMEOUT,
        connection: CONNECTION_LIMIT,
    };
}

/// The response to one request: `handler`'s answer to a GET, 405 to
/// anything else.
fn answer(handler: &Handler, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (code, content_type, body) = if req.method() == Method::GET {
        handler(req.uri().path())
    } else {
        (405, "text/plain", "GET only\n".to_string())
    };
    let mut res = Response::new(Full::new(Bytes::from(body)));
    *res.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    res.headers_mut().insert(CONTENT_TYPE_HEADER, HeaderValue::from_static(content_type));
    res
}

/// The connections each source address holds; a [`SourceSlot`] counts one.
type Sources = Arc<parking_lot::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// One connection of a source address, given back on drop.
struct SourceSlot(Sources, std::net::IpAddr);

impl SourceSlot {
    fn take(sources: &Sources, ip: std::net::IpAddr, cap: usize) -> Option<SourceSlot> {
        let mut held = sources.lock();
        let n = held.entry(ip).or_insert(0);
        if *n >= cap {
            return None;
        }
        *n += 1;
        Some(SourceSlot(sources.clone(), ip))
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut held = self.0.lock();
        if let Some(n) = held.get_mut(&self.1) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.1);
            }
        }
    }
}

async fn serve_limited(listener: TcpListener, handler: Handler, limits: Limits) {
    let slots = Arc::new(Semaphore::new(limits.connections));
    let sources: Sources = Arc::default();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(limits.header_read).keep_alive(false);
    loop {
        let Ok((stream, peer)) = listener.accept().await else {
            // Out of file descriptors, most likely: let some close.
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        // Over either cap: closed at once, unread.
        let Some(source) = SourceSlot::take(&sources, peer.ip(), limits.per_source) else { continue };
        let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
        let handler = handler.clone();
        let conn = http.serve_connection(
            TokioIo::new(stream),
            hyper::service::service_fn(move |req: Request<Incoming>| {
                let res = answer(&handler, &req);
                async move { Ok::<_, Infallible>(res) }
            }),
        );
        tokio::spawn(async move {
            // An error is the client's (gone, too slow, not HTTP): nothing to do.
            let _ = tokio::time::timeout(limits.connection, conn).await;
            drop((slot, source));
        });
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::collections::HashMap;
    use std::net::SocketAddr;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;
    use crate::admin::tests::Fake;
    use crate::view::{
        CloudInterfaceRow, CloudNodeRow, ClusterCounters, LeaseRow, LivenessRow, PeerRow, SessionFilter, SessionRow,
        ShadowRow,
    };

    /// [`Fake`] in Kubernetes mode.
    struct Clustered;

    impl GatewayView for Clustered {
        fn status(&self) -> Status {
            let lease = |ip: &str, here: bool| LeaseRow {
                ip: ip.parse().unwrap(),
                holder: Some(if here { "gw-a" } else { "gw-b" }.into()),
                held_here: here,
                dormant_here: false,
                valid_for_ms: here.then_some(2500),
                candidates: vec!["gw-a".into(), "gw-b".into()],
                renew_failing: false,
                standby: here.then(|| "gw-b".into()),
                standby_in_sync: here.then_some(true),
                public_ip: None,
                cloud: None,
            };
            let mut cloud = lease("10.0.1.20", true);
            cloud.public_ip = Some("198.51.100.20".parse().unwrap());
            cloud.cloud = Some("assigned to eni-0a".into());
            let cluster = ClusterReport {
                node: "gw-a".into(),
                first_pass: true,
                last_pass_ms: 1200,
                ha: true,
                end_authenticated: true,
                channel_keys: vec!["0a1b2c3d".into(), "4e5f6071".into()],
                leases: vec![lease("203.0.113.10", true), lease("203.0.113.11", false), cloud],
                peers: vec![PeerRow {
                    name: "gw-b".into(),
                    state: "up".into(),
                    queue_bytes: 64,
                    key: Some("0a1b2c3d".into()),
                    ..Default::default()
                }],
                shadows: vec![ShadowRow {
                    ip: "203.0.113.11".parse().unwrap(),
                    holder: "gw-b".into(),
                    sessions: 9,
                    in_sync: true,
                    age_ms: 10,
                }],
                standby_pending: vec![],
                cloud_interfaces: vec![CloudInterfaceRow {
                    subnet: "subnet-1".into(),
                    interface: Some("eni-0a".into()),
                    source_dest_check: false,
                    error: None,
                }],
                cloud_nodes: vec![
                    CloudNodeRow {
                        node: "w1".into(),
                        public_ip: "198.51.100.30".parse().unwrap(),
                        private_ip: Some("10.0.7.33".parse().unwrap()),
                        interface: Some("eni-0w1".into()),
                        error: None,
                    },
                    CloudNodeRow {
                        node: "w2".into(),
                        public_ip: "198.51.100.31".parse().unwrap(),
                        private_ip: None,
                        interface: None,
                        error: Some("1 attempt(s): AssociateAddress: RequestLimitExceeded: slow down".into()),
                    },
                ],
                liveness: Some(LivenessRow {
                    lease: "egret-gw-gw-a".into(),
                    epoch: 4,
                    valid_for_ms: Some(1500),
                    lost: 1,
                    expired: 2,
                }),
                counters: ClusterCounters {
                    takeovers: 3,
                    resumed: 1,
                    lease_renew_latency: {
                        let mut l = crate::view::Latencies::default();
                        l.record(std::time::Duration::from_millis(20));
                        l.record(std::time::Duration::from_millis(1600));
                        l
                    },
                    ..Default::default()
                },
            };
            Status { cluster: Some(cluster), ..Fake.status() }
        }
        fn counters(&self) -> Counters {
            Fake.counters()
        }
        fn policies(&self) -> Vec<PolicyRow> {
            Fake.policies()
        }
        fn ports(&self) -> Vec<PortRow> {
            Fake.ports()
        }
        fn sessions(&self, filter: &SessionFilter) -> Vec<SessionRow> {
            Fake.sessions(filter)
        }
        fn port_blocks(&self) -> Vec<BlockRow> {
            let current = BlockRow {
                egress_ip: "203.0.113.11".parse().unwrap(),
                configured: true,
                block_size: 128,
                max_per_pod: 4,
                capacity: 200,
                in_use: 14,
                pods: 7,
                exhausted: 2,
                pod_limit: 5,
            };
            // The pool a change of range retired (ADR 0042): the same labels.
            let retired = BlockRow {
                configured: false,
                capacity: 220,
                in_use: 3,
                pods: 2,
                exhausted: 0,
                pod_limit: 0,
                ..current
            };
            vec![current, retired]
        }
        fn port_use(&self) -> Arc<PortUse> {
            use crate::port_use::{DestinationUse, PodUse, PoolUse};
            let remote = "198.51.100.7:443".parse().unwrap();
            Arc::new(PortUse {
                pools: vec![PoolUse {
                    egress_ip: "203.0.113.10".parse().unwrap(),
                    proto: "tcp".into(),
                    endpoint_dependent: true,
                    in_use: 30000,
                    capacity: 28232,
                    pod_quota: Some(7058),
                    destinations: vec![DestinationUse { remote, in_use: 25000 }],
                    pods: vec![PodUse { pod: "10.244.1.5".parse().unwrap(), remote: Some(remote), in_use: 7000 }],
                }],
                entries: 12,
                walk_micros: 1500,
                warnings: 2,
            })
        }
    }

    /// Checks the exposition's shape and returns its families (name ->
    /// type): it ends with `# EOF`, every family has HELP and TYPE once,
    /// and every sample follows its family's declaration (a counter's
    /// samples are the family's name with `_total`).
    fn families(text: &str) -> HashMap<String, String> {
        assert!(text.ends_with("\n# EOF\n"), "no # EOF at the end:\n{text}");
        let mut declared: HashMap<String, String> = HashMap::new();
        let mut helped = std::collections::HashSet::new();
        for l in text.lines() {
            if let Some(rest) = l.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap();
                assert!(!help.is_empty(), "{name} has no help");
                assert!(helped.insert(name.to_string()), "{name} has two HELP lines");
            } else if let Some(rest) = l.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(helped.contains(name), "{name}: TYPE before HELP");
                assert!(declared.insert(name.to_string(), kind.to_string()).is_none(), "{name} declared twice");
            } else if let Some(rest) = l.strip_prefix("# UNIT ") {
                let (name, unit) = rest.split_once(' ').unwrap();
                assert!(declared.contains_key(name) && name.ends_with(&format!("_{unit}")), "{l}");
            } else if l != "# EOF" {
                let name = l.split(['{', ' ']).next().unwrap();
                let of_kind = |suffix: &str, kind: &str| {
                    name.strip_suffix(suffix).filter(|f| declared.get(*f).is_some_and(|k| k == kind))
                };
                let family = match declared.get(name).map(String::as_str) {
                    Some("gauge") => name,
                    _ => of_kind("_total", "counter")
                        .or_else(|| ["_sum", "_count", "_bucket"].iter().find_map(|s| of_kind(s, "histogram")))
                        .unwrap_or(""),
                };
                assert!(!family.is_empty(), "{name} has no TYPE line before it:\n{text}");
                let value = l.rsplit(' ').next().unwrap();
                assert!(value.parse::<f64>().is_ok(), "{l}: not a number");
            }
        }
        declared
    }

    #[test]
    fn exposition_has_every_family_with_labels() {
        let text = render(&Clustered);
        for line in [
            "egret_config_generation 7",
            "egret_fib_generation 3",
            "egret_config_reloads_total 3",
            "egret_config_reload_failures_total 2",
            "egret_config_apply_failures_total 5",
            "egret_fail_closed_errors_total 1",
            "egret_fail_closed_repairs_total 0",
            "egret_ready 1",
            "egret_policy_packets_total{policy=\"team-a\",direction=\"outbound\"} 10",
            "egret_policy_bytes_total{policy=\"team-a\",direction=\"inbound\"} 900",
            "egret_frames_forwarded_total 20",
            "egret_frames_misdirected_total 1",
            "egret_drops_total{reason=\"ports_exhausted\"} 3",
            "egret_drops_total{reason=\"no_route\"} 0",
            "egret_events_total{event=\"session_created_outbound\"} 4",
            "egret_xdp_verdicts_total{reason=\"redirect_steered_source\"} 11",
            "egret_fastpath_enabled 1",
            "egret_fastpath_sessions{family=\"ipv4\"} 3",
            "egret_fastpath_capacity{family=\"ipv4\"} 4096",
            "egret_fastpath_capacity{family=\"ipv6\"} 0",
            "egret_fastpath_packets_total{outcome=\"hit\"} 500",
            "egret_fastpath_offloads_total{outcome=\"refused_map_full\"} 1",
            "egret_fastpath_removals_total{cause=\"fenced\"} 2",
            "egret_fastpath_next_hop_updates_total 1",
            "egret_sessions{family=\"ipv4\"} 4",
            "egret_sessions{family=\"ipv6\"} 1",
            "egret_sessions_capacity{family=\"ipv4\"} 1048576",
            "egret_sessions_capacity{family=\"ipv6\"} 65536",
            "egret_ports_in_use{egress_ip=\"203.0.113.10\",proto=\"udp\"} 4",
            "egret_ports_capacity{egress_ip=\"203.0.113.10\",proto=\"udp\"} 28232",
            "egret_ports_exhausted_total{egress_ip=\"203.0.113.10\",proto=\"udp\"} 3",
            r#"egret_ports_in_use_by_destination{egress_ip="203.0.113.10",proto="tcp",remote="198.51.100.7:443"} 25000"#,
            r#"egret_ports_in_use_by_pod{egress_ip="203.0.113.10",proto="tcp",pod="10.244.1.5",remote="198.51.100.7:443"} 7000"#,
            r#"egret_ports_pod_quota{egress_ip="203.0.113.10",proto="tcp"} 7058"#,
            "egret_port_use_walk_seconds 0.0015",
            "egret_port_use_warnings_total 2",
            "egret_xsk_rx_frames_total{worker=\"0\",interface=\"eth1\",queue=\"0\"} 21",
            "egret_xsk_kernel_rx_ring_full_total{worker=\"0\",interface=\"eth1\",queue=\"0\"} 5",
            // Kubernetes mode.
            "egret_lease_held{egress_ip=\"203.0.113.10\"} 1",
            "egret_lease_held{egress_ip=\"203.0.113.11\"} 0",
            "egret_lease_valid_for_seconds{egress_ip=\"203.0.113.10\"} 2.5",
            "egret_lease_renew_failing{egress_ip=\"203.0.113.10\"} 0",
            "egret_cloud_address_assigned{egress_ip=\"10.0.1.20\",public_ip=\"198.51.100.20\"} 1",
            "egret_cloud_source_dest_check{subnet=\"subnet-1\",interface=\"eni-0a\"} 0",
            "egret_cloud_node_address_associated{node=\"w1\",public_ip=\"198.51.100.30\"} 1",
            "egret_cloud_node_address_associated{node=\"w2\",public_ip=\"198.51.100.31\"} 0",
            "egret_standby_in_sync{egress_ip=\"203.0.113.10\",standby=\"gw-b\"} 1",
            "egret_shadow_sessions{egress_ip=\"203.0.113.11\",holder=\"gw-b\"} 9",
            "egret_peer_up{peer=\"gw-b\"} 1",
            "egret_peer_queue_bytes{peer=\"gw-b\"} 64",
            "egret_peer_key{peer=\"gw-b\",key=\"0a1b2c3d\"} 1",
            "egret_channel_key{key=\"0a1b2c3d\",role=\"primary\"} 1",
            "egret_channel_key{key=\"4e5f6071\",role=\"accepted\"} 1",
            "egret_control_plane_last_pass_age_seconds 1.2",
            "egret_lease_takeovers_total 3",
            "egret_lease_resumed_total 1",
            "egret_sync_sends_refused_total 0",
            // A histogram: cumulative buckets, a renewal of 1.6 s above the
            // 1.5 s bound, the sum in seconds.
            "egret_lease_renew_duration_seconds_bucket{le=\"0.025\"} 1",
            "egret_lease_renew_duration_seconds_bucket{le=\"1.5\"} 1",
            "egret_lease_renew_duration_seconds_bucket{le=\"2.0\"} 2",
            "egret_lease_renew_duration_seconds_bucket{le=\"+Inf\"} 2",
            "egret_lease_renew_duration_seconds_count 2",
            "egret_lease_renew_duration_seconds_sum 1.62",
            // With liveness Leases.
            "egret_liveness_epoch{lease=\"egret-gw-gw-a\"} 4",
            "egret_liveness_valid_for_seconds 1.5",
            "egret_liveness_lost_total 1",
            "egret_liveness_expired_total 2",
            "egret_translog_journal_bytes 4096",
            "egret_translog_identity_unresolved_total 3",
            "egret_translog_journal_oldest_timestamp_seconds 1796126400",
            r#"egret_translog_sent_total{sink="ipfix"} 9"#,
            r#"egret_translog_session_ends_total{reason="not-adopted"} 1"#,
            r#"egret_port_blocks_in_use{egress_ip="203.0.113.11",block_size="128"} 17"#,
            r#"egret_port_blocks_capacity{egress_ip="203.0.113.11",block_size="128"} 220"#,
            r#"egret_port_blocks_pods{egress_ip="203.0.113.11",block_size="128"} 9"#,
            r#"egret_port_blocks_exhausted_total{egress_ip="203.0.113.11",block_size="128"} 2"#,
            r#"egret_port_blocks_pod_limit_total{egress_ip="203.0.113.11",block_size="128"} 5"#,
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
        // Every family, declared once before its samples, with its type.
        let declared = families(&text);
        let gauges = [
            "config_generation",
            "fib_generation",
            "ready",
            "fastpath_enabled",
            "fastpath_sessions",
            "fastpath_capacity",
            "fastpath_next_hops",
            "translog_enabled",
            "translog_journal_bytes",
            "translog_journal_oldest_timestamp_seconds",
            "sessions",
            "sessions_capacity",
            "ports_in_use",
            "ports_capacity",
            "ports_in_use_by_destination",
            "ports_in_use_by_pod",
            "ports_pod_quota",
            "port_blocks_in_use",
            "port_blocks_capacity",
            "port_blocks_pods",
            "port_use_walk_seconds",
            "lease_held",
            "lease_valid_for_seconds",
            "lease_renew_failing",
            "cloud_address_assigned",
            "cloud_source_dest_check",
            "cloud_node_address_associated",
            "standby_in_sync",
            "shadow_sessions",
            "peer_up",
            "peer_queue_bytes",
            "peer_key",
            "channel_key",
            "control_plane_last_pass_age_seconds",
            "liveness_epoch",
            "liveness_valid_for_seconds",
        ];
        let counters = [
            "config_reloads",
            "config_reload_failures",
            "config_apply_failures",
            "fail_closed_errors",
            "fail_closed_repairs",
            "admin_connections_refused",
            "policy_packets",
            "policy_bytes",
            "frames_forwarded",
            "frames_answered",
            "frames_misdirected",
            "announcements",
            "drops",
            "events",
            "xdp_verdicts",
            "fastpath_packets",
            "fastpath_offloads",
            "fastpath_removals",
            "fastpath_next_hop_updates",
            "fastpath_rerouted",
            "translog_records",
            "translog_session_ends",
            "translog_sent",
            "translog_dropped",
            "translog_unreachable",
            "translog_identity_unresolved",
            "ports_exhausted",
            "port_blocks_exhausted",
            "port_blocks_pod_limit",
            "port_use_warnings",
            "xsk_rx_frames",
            "xsk_tx_frames",
            "xsk_tx_ring_full",
            "xsk_fill_ring_empty",
            "xsk_kernel_rx_dropped",
            "xsk_kernel_rx_invalid_descs",
            "xsk_kernel_tx_invalid_descs",
            "xsk_kernel_rx_ring_full",
            "xsk_kernel_rx_fill_ring_empty_descs",
            "xsk_kernel_tx_ring_empty_descs",
            "lease_takeovers",
            "lease_fenced",
            "lease_resumed",
            "lease_api_errors",
            "cloud_drift_repairs",
            "lease_conflicts",
            "watch_restarts",
            "failsafe_confirmed",
            "failsafe_refused",
            "failsafe_promises",
            "peers_gone",
            "peer_resets_survived",
            "early_takeovers_allowed",
            "sessions_imported",
            "sessions_not_imported",
            "sync_records",
            "sync_full_copies",
            "sync_journal_overflows",
            "sync_sends_refused",
            "liveness_lost",
            "liveness_expired",
        ];
        let mut want: HashMap<String, String> = HashMap::new();
        want.extend(gauges.iter().map(|n| (format!("egret_{n}"), "gauge".to_string())));
        want.extend(counters.iter().map(|n| (format!("egret_{n}"), "counter".to_string())));
        want.insert("egret_lease_renew_duration_seconds".into(), "histogram".into());
        assert_eq!(declared, want, "{text}");
        // Units: seconds and bytes, as OpenMetrics writes them.
        for unit in [
            "# UNIT egret_lease_valid_for_seconds seconds",
            "# UNIT egret_control_plane_last_pass_age_seconds seconds",
            "# UNIT egret_policy_bytes bytes",
            "# UNIT egret_peer_queue_bytes bytes",
            "# UNIT egret_liveness_valid_for_seconds seconds",
        ] {
            assert!(text.lines().any(|l| l == unit), "missing {unit:?}");
        }
        // Without a cluster: no cluster family, the same shape.
        let file_mode = families(&render(&Fake));
        assert!(!file_mode.contains_key("egret_lease_held") && file_mode.contains_key("egret_drops"));
        assert_eq!(file_mode.len(), gauges.len() + counters.len() - 14 - 22);
    }

    #[test]
    fn routes() {
        use crate::daemon::{NotAlive, NotReady};
        use crate::netlink::NextHopsNotReady;
        const READY: Result<(), NotReady> = Ok(());
        const ALIVE: Result<(), NotAlive> = Ok(());
        assert_eq!(respond(&Fake, READY, ALIVE, "/ready"), (200, "text/plain", "ready\n".into()));
        let unresolved = NextHopsNotReady::Unresolved { next_hops: vec!["203.0.113.1 on eth0".into()] };
        let not = respond(&Fake, Err(NotReady::from(unresolved)), ALIVE, "/ready");
        assert_eq!(
            not,
            (
                503,
                "text/plain",
                "not ready: next hop(s) of routes in use not resolved yet: 203.0.113.1 on eth0\n".into()
            )
        );
        let pending = NotReady::StandbyPending { ips: vec!["203.0.113.10".parse().unwrap()] };
        let not = respond(&Fake, Err(pending), ALIVE, "/ready");
        assert_eq!(not.2, "not ready: waiting for the session copies this gateway stands by for: [203.0.113.10]\n");
        assert_eq!(respond(&Fake, READY, ALIVE, "/healthz"), (200, "text/plain", "ok\n".into()));
        let dead = NotAlive { silent: Duration::from_millis(9000) };
        let h = respond(&Fake, READY, Err(dead), "/healthz");
        assert_eq!(h, (503, "text/plain", "not alive: the Kubernetes sync loop has not run for 9000 ms\n".into()));
        let (code, ty, body) = respond(&Fake, READY, ALIVE, "/metrics");
        assert_eq!((code, ty), (200, CONTENT_TYPE));
        assert!(body.starts_with("# HELP egret_") && body.ends_with("# EOF\n"), "{body}");
        assert_eq!(respond(&Fake, READY, ALIVE, "/x").0, 404);
    }

    /// Sends `request` on a new connection to `addr` and reads until the
    /// server closes it (empty if it closed or reset the connection first).
    async fn exchange(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(request.as_bytes()).await;
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
        assert!(read.is_ok(), "{request:?}: the server kept the connection open");
        String::from_utf8_lossy(&out).into_owned()
    }

    fn get(path: &str) -> String {
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")
    }

    #[tokio::test]
    async fn http_over_hyper() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(serve(
            listener,
            Arc::new(Fake),
            Arc::new(|| Err(crate::daemon::NotReady::NotAttached)),
            Arc::new(|| Ok::<(), crate::daemon::NotAlive>(())),
        ));
        // A request without `Connection: close` is answered and closed all
        // the same (one request per connection).
        let m = exchange(addr, &get("/metrics?x=1")).await;
        let (head, body) = m.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        let head = head.to_lowercase();
        assert!(head.contains(&format!("content-type: {CONTENT_TYPE}")), "{head}");
        assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        assert!(body.contains("\negret_config_generation 7\n") && body.ends_with("# EOF\n"), "{body}");
        let r = exchange(addr, &get("/ready")).await;
        assert!(
            r.starts_with("HTTP/1.1 503 Service Unavailable\r\n")
                && r.ends_with("\r\n\r\nnot ready: the XDP program is not attached\n")
        );
        let h = exchange(addr, &get("/healthz")).await;
        assert!(h.starts_with("HTTP/1.1 200 OK\r\n") && h.ends_with("\r\n\r\nok\n"), "{h}");
        let n = exchange(addr, &get("/nothing")).await;
        assert!(n.starts_with("HTTP/1.1 404 Not Found\r\n") && n.ends_with("try /metrics, /ready or /healthz\n"));
        let p = exchange(addr, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").await;
        assert!(p.starts_with("HTTP/1.1 405 Method Not Allowed\r\n") && p.ends_with("GET only\n"), "{p}");
        // HTTP/1.1 only: an HTTP/2 preface is not served.
        let h2 = exchange(addr, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await;
        assert!(!h2.starts_with("HTTP/1.1 200"), "{h2}");
        server.abort();
    }

    fn answer_ready() -> Handler {
        Arc::new(|path: &str| match path {
            "/ready" => (200, "text/plain", "ready\n".to_string()),
            _ => (404, "text/plain", String::new()),
        })
    }

    /// Idle connections fill the cap: one more is closed unanswered; the
    /// header timeout closes the idle ones, and the server answers again.
    #[tokio::test]
    async fn connections_are_capped_and_idle_ones_time_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            connections: 3,
            per_source: 10,
            header_read: Duration::from_secs(2),
            connection: Duration::from_secs(60),
        };
        let server = tokio::spawn(serve_limited(listener, answer_ready(), limits));
        let mut idle = Vec::new();
        for _ in 0..limits.connections {
            idle.push(TcpStream::connect(addr).await.unwrap());
        }
        let t0 = std::time::Instant::now();
        let over = exchange(addr, &get("/ready")).await;
        assert_eq!(over, "", "a connection over the cap is closed unanswered");
        assert!(t0.elapsed() < limits.header_read, "closed at once, not when the idle ones left");
        // The header timeout frees the slots (hyper may say 408 first).
        for mut s in idle {
            let mut out = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
            assert!(read.is_ok(), "an idle connection outlived the header timeout");
            let out = String::from_utf8_lossy(&out);
            assert!(out.is_empty() || out.starts_with("HTTP/1.1 408"), "{out}");
        }
        let elapsed = t0.elapsed();
        assert!(elapsed >= limits.header_read - Duration::from_millis(100), "closed after {elapsed:?}");
        let ok = exchange(addr, &get("/ready")).await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n") && ok.ends_with("\r\n\r\nready\n"), "{ok}");
        server.abort();
    }

    /// One source address holding its share of connections does not keep
    /// another (the kubelet's probe) out; its own next one is closed.
    #[tokio::test]
    async fn one_source_cannot_take_every_slot() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            connections: 10,
            per_source: 2,
            header_read: Duration::from_secs(30),
            connection: Duration::from_secs(60),
        };
        let server = tokio::spawn(serve_limited(listener, answer_ready(), limits));
        let from = |ip: &str| {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(format!("{ip}:0").parse().unwrap()).unwrap();
            s.connect(addr)
        };
        let _idle = [from("127.0.0.2").await.unwrap(), from("127.0.0.2").await.unwrap()];
        let mut third = from("127.0.0.2").await.unwrap();
        third.write_all(get("/ready").as_bytes()).await.unwrap();
        let mut out = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), third.read_to_end(&mut out)).await;
        assert!(
            read.is_ok() && out.is_empty(),
            "the source's third connection answered: {:?}",
            String::from_utf8_lossy(&out)
        );
        let ok = exchange(addr, &get("/ready")).await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "another source kept out: {ok}");
        server.abort();
    }

    /// A connection is closed at the time limit, even one still within the
    /// header timeout (a client trickling its request).
    #[tokio::test]
    async fn connections_have_a_time_limit() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = Limits {
            connections: 2,
            per_source: 2,
            header_read: Duration::from_secs(60),
            connection: Duration::from_millis(500),
        };
        let server = tokio::spawn(serve_limited(listener, answer_ready(), limits));
        let mut s = TcpStream::connect(addr).await.unwrap();
        let t0 = std::time::Instant::now();
        let mut closed = false;
        for b in get("/ready").bytes().take(10) {
            if s.write_all(&[b]).await.is_err() {
                closed = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !closed {
            let mut out = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
            assert!(read.is_ok(), "a trickling client held its connection past the limit");
        }
        let elapsed = t0.elapsed();
        assert!(elapsed >= limits.connection && elapsed < Duration::from_secs(5), "closed after {elapsed:?}");
        let ok = exchange(addr, &get("/ready")).await;
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        server.abort();
    }
}
