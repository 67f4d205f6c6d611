//! Translation logs, the control plane's half (issue 34,
//! docs/adr/0034-translation-logs.md): the exporter that drains the
//! workers' rings (`egret_dataplane::translog`), turns engine times into
//! wall-clock times, and sends every session's creation and end to a
//! collector as IPFIX (`ipfix.rs`, RFC 7011 / RFC 8158) and as syslog
//! (`syslog.rs`, RFC 5424 in VPP's NAT format), over UDP.
//!
//! Nothing here can hold a worker up: the workers only push to their rings
//! (a full ring drops and counts `translog_ring_full`). The exporter's
//! thread (`egret-translog`) drains every ring every 10 ms, or every 5 ms
//! after a drain found a ring more than a quarter full, orders the batch by
//! time, and queues each event for each sink in a bounded queue
//! (`queueEvents`; full: the event is dropped, counted `queue_full`). Each
//! sink sends from its queue on a non-blocking socket. A failed send is
//! tried once more at once (a connected UDP socket reports an earlier
//! datagram's ICMP port unreachable at the next send, and a collector that
//! has come back must not lose that one), IPFIX sending its templates
//! first; a second failure, or a full socket buffer, drops what the
//! datagram held, counted `send_error`. The ICMP errors themselves are
//! counted per sink (`unreachable`): datagrams were lost, how many only
//! the collector can tell (IPFIX sequence gaps). A collector that is gone
//! costs counters and one extra send, never a wait.
//!
//! Syslog over TCP (`transport: tcp`, RFC 6587 octet counting) is
//! written by a thread of its own from a bounded queue (`tcp.rs`).
//!
//! Each event carries the pod's identity as the control plane knew it when
//! the record was drained (`identity.rs`, fed by the Kubernetes
//! controller), and goes to the local journal (`journal.rs`) that
//! `egret who-had` reads, written on this thread too.
//!
//! IPFIX carries the identity in three enterprise elements of Egret's
//! (`ipfix.rs`, ADR 0034 §4), syslog in its `pod@PEN` element.
//!
//! Not built yet (ADR 0034): an identity history per address (§3: the
//! identity is the one current at the drain), and the HA rules beyond "an
//! import logs nothing; the adopted session's end is flagged".

pub mod identity;
pub mod ipfix;
pub mod journal;
pub mod syslog;
pub mod tcp;
pub mod who_had;

use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egret_dataplane::clock::EngineClock;
use egret_dataplane::engine::Engine;
use egret_dataplane::translog::{EndReason, LogKind, LogRecord};

use crate::config::{SyslogTransport, TranslationLogsConfig};

/// One event as the sinks see it: wall-clock times, addresses as `IpAddr`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Creation or end.
    pub kind: LogKind,
    /// When the session was created or removed, Unix ms.
    pub at_ms: u64,
    /// The IP protocol.
    pub proto: u8,
    /// The pod's address.
    pub pod: IpAddr,
    /// The pod's port (ICMP: identifier).
    pub pod_port: u16,
    /// The egress address.
    pub egress: IpAddr,
    /// The egress port.
    pub egress_port: u16,
    /// The remote's address and port; `None` with `logDestinations: false`.
    pub remote: Option<(IpAddr, u16)>,
    /// An end: its last packet, Unix ms (a whole engine second: sessions
    /// stamp seconds).
    pub last_ms: Option<u64>,
    /// An end: why.
    pub reason: Option<EndReason>,
    /// `egret_dataplane::translog::log_flags`.
    pub flags: u8,
    /// A quota exceeded: which (RFC 8158's natQuotaExceededEvent,
    /// `egret_dataplane::translog::quota`).
    pub quota: Option<u8>,
    /// A refusal: the limit hit (ports in the range, sessions).
    pub limit: Option<u32>,
    /// A port block's record: its last port and its size (its first is
    /// `egress_port`; ADR 0034 §6).
    pub block: Option<(u16, u16)>,
    /// The pod's identity when the record was drained, if known.
    pub identity: Option<Arc<identity::PodIdentity>>,
}

/// Engine time and wall time read together, to place engine times on the
/// wall clock: `wall = wall_now - (engine_now - t) / scale`. Taken at each
/// drain, so a step of the wall clock moves only later events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clocks {
    /// Now, Unix ms.
    pub wall_ms: u64,
    /// Now, engine ms.
    pub engine_ms: u64,
    /// How much faster engine time runs (1, except under
    /// `EGRET_TEST_CLOCK_SCALE`).
    pub scale: u64,
}

impl Clocks {
    /// Both clocks now.
    pub fn now(clock: &EngineClock) -> Clocks {
        let engine_ms = clock.now().as_millis();
        let wall_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        Clocks { wall_ms, engine_ms, scale: clock.scale() }
    }

    /// The wall time (Unix ms) of engine ms `t`: within about a millisecond
    /// either way, for both clocks are read in whole milliseconds.
    pub fn wall(&self, t: u64) -> u64 {
        let scale = self.scale.max(1);
        if t <= self.engine_ms {
            self.wall_ms.saturating_sub((self.engine_ms - t) / scale)
        } else {
            self.wall_ms.saturating_add((t - self.engine_ms) / scale)
        }
    }
}

fn addr(bytes: &[u8; 16], v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(*bytes))
    } else {
        IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3]))
    }
}

impl Event {
    /// The event of a worker's record (`None` for a kind this build does
    /// not know); the remote is left out unless `destinations`.
    pub fn from_record(r: &LogRecord, clocks: &Clocks, destinations: bool) -> Option<Event> {
        let kind = r.kind()?;
        let v6 = r.is_v6();
        let delete = kind == LogKind::SessionDelete;
        let block = matches!(kind, LogKind::BlockAllocate | LogKind::BlockFree);
        Some(Event {
            kind,
            at_ms: clocks.wall(r.time_ms),
            proto: r.proto,
            pod: addr(&r.pod, v6),
            pod_port: r.pod_port,
            egress: addr(&r.egress, v6),
            egress_port: r.egress_port,
            remote: (destinations && !block).then(|| (addr(&r.remote, v6), r.remote_port)),
            last_ms: delete.then(|| clocks.wall(u64::from(r.value) * 1000)),
            reason: if delete { EndReason::from_u8(r.detail) } else { None },
            flags: r.flags,
            quota: (kind == LogKind::QuotaExceeded).then_some(r.detail),
            limit: matches!(kind, LogKind::PortsExhausted | LogKind::QuotaExceeded).then_some(r.value),
            block: block.then_some((r.remote_port, r.aux)),
            identity: None,
        })
    }
}

impl Event {
    /// Whether only the local journal keeps this event, the collectors
    /// never see it: a session's removal at an old holder that handed its
    /// egress IP over with a current copy (`handed-over`); the next holder
    /// logs the session's end (ADR 0034 §8).
    pub fn journal_only(&self) -> bool {
        self.reason == Some(EndReason::HandedOver)
    }
}

/// The sinks, for counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sink {
    /// IPFIX to `translationLogs.ipfix.collector`.
    Ipfix = 0,
    /// Syslog to `translationLogs.syslog.collector`.
    Syslog = 1,
    /// The local journal (`translationLogs.journal`).
    Journal = 2,
}

impl Sink {
    /// All, in order.
    pub const ALL: [Sink; 3] = [Sink::Ipfix, Sink::Syslog, Sink::Journal];

    /// The metric label.
    pub const fn name(self) -> &'static str {
        match self {
            Sink::Ipfix => "ipfix",
            Sink::Syslog => "syslog",
            Sink::Journal => "journal",
        }
    }
}

/// Why a sink lost an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// Its queue was full (the sink is slower than the workers).
    QueueFull = 0,
    /// Sending failed or would have blocked (the collector is gone, or the
    /// socket's buffer full).
    SendError = 1,
    /// Writing the journal failed (disk full, directory gone).
    WriteError = 2,
}

impl DropReason {
    /// All, in order.
    pub const ALL: [DropReason; 3] = [DropReason::QueueFull, DropReason::SendError, DropReason::WriteError];

    /// The metric label.
    pub const fn name(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::SendError => "send_error",
            DropReason::WriteError => "write_error",
        }
    }
}

/// The exporter's counters (`egret_translog_*`); the workers' own loss is
/// their `translog_ring_full` event.
#[derive(Debug, Default)]
pub struct Stats {
    records: [AtomicU64; LogKind::ALL.len()],
    ends: [AtomicU64; EndReason::ALL.len()],
    sent: [AtomicU64; 3],
    dropped: [[AtomicU64; 3]; 3],
    unreachable: [AtomicU64; 3],
    unresolved: AtomicU64,
    journal: AtomicBool,
    journal_bytes: AtomicU64,
    journal_oldest_ms: AtomicU64,
}

impl Stats {
    /// Records taken from the rings, by kind.
    pub fn records(&self, kind: LogKind) -> u64 {
        self.records[kind as usize - 1].load(Ordering::Relaxed)
    }

    /// Session deletes taken from the rings, by why the session ended.
    pub fn ends(&self, reason: EndReason) -> u64 {
        self.ends[reason as usize - 1].load(Ordering::Relaxed)
    }

    /// Events a sink sent.
    pub fn sent(&self, sink: Sink) -> u64 {
        self.sent[sink as usize].load(Ordering::Relaxed)
    }

    /// Events a sink lost, by reason.
    pub fn dropped(&self, sink: Sink, reason: DropReason) -> u64 {
        self.dropped[sink as usize][reason as usize].load(Ordering::Relaxed)
    }

    /// Sends that reported the collector unreachable (an ICMP error that an
    /// earlier datagram drew): datagrams were lost on the way, how many the
    /// exporter cannot tell (the collector's sequence gaps do, for IPFIX).
    pub fn unreachable(&self, sink: Sink) -> u64 {
        self.unreachable[sink as usize].load(Ordering::Relaxed)
    }

    /// The counters as `egret counters` and `/metrics` show them.
    pub fn counters(&self) -> crate::view::TranslogCounters {
        let kinds = LogKind::ALL;
        crate::view::TranslogCounters {
            enabled: true,
            records: kinds.iter().map(|k| (k.name().to_string(), self.records(*k))).collect(),
            session_ends: EndReason::ALL.iter().map(|r| (r.name().to_string(), self.ends(*r))).collect(),
            sent: Sink::ALL.iter().map(|s| (s.name().to_string(), self.sent(*s))).collect(),
            dropped: Sink::ALL
                .iter()
                .flat_map(|s| {
                    DropReason::ALL.iter().map(|r| (s.name().to_string(), r.name().to_string(), self.dropped(*s, *r)))
                })
                .collect(),
            unreachable: [Sink::Ipfix, Sink::Syslog]
                .iter()
                .map(|s| (s.name().to_string(), self.unreachable(*s)))
                .collect(),
            journal_bytes: self.journal.load(Ordering::Relaxed).then(|| self.journal_bytes.load(Ordering::Relaxed)),
            journal_oldest_ms: self.journal_oldest_ms(),
            identity_unresolved: self.unresolved(),
        }
    }

    /// Events whose pod no identity was published for (Kubernetes mode:
    /// an address no pod in the cluster held at the drain).
    pub fn unresolved(&self) -> u64 {
        self.unresolved.load(Ordering::Relaxed)
    }

    /// The journal's oldest segment's start, Unix ms (`None`: no journal,
    /// or no segment yet).
    pub fn journal_oldest_ms(&self) -> Option<u64> {
        let ms = self.journal_oldest_ms.load(Ordering::Relaxed);
        (self.journal.load(Ordering::Relaxed) && ms != 0).then_some(ms)
    }

    /// The journal's size and oldest segment, after a write.
    pub(crate) fn set_journal(&self, bytes: u64, oldest_ms: u64) {
        self.journal.store(true, Ordering::Relaxed);
        self.journal_bytes.store(bytes, Ordering::Relaxed);
        self.journal_oldest_ms.store(oldest_ms, Ordering::Relaxed);
    }

    /// A pass's records by kind, session ends by reason, and events
    /// without an identity.
    fn add_counts(&self, kinds: &[u64; LogKind::ALL.len()], ends: &[u64; EndReason::ALL.len()], unresolved: u64) {
        for (c, n) in self.records.iter().zip(kinds).chain(self.ends.iter().zip(ends)) {
            if *n != 0 {
                c.fetch_add(*n, Ordering::Relaxed);
            }
        }
        if unresolved != 0 {
            self.unresolved.fetch_add(unresolved, Ordering::Relaxed);
        }
    }

    pub(crate) fn add_sent(&self, sink: Sink, n: u64) {
        self.sent[sink as usize].fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn add_dropped(&self, sink: Sink, reason: DropReason, n: u64) {
        self.dropped[sink as usize][reason as usize].fetch_add(n, Ordering::Relaxed);
    }
}

/// A sink's bounded queue and non-blocking socket.
#[derive(Debug)]
struct Queue {
    sink: Sink,
    events: VecDeque<Event>,
    capacity: usize,
    socket: UdpSocket,
    collector: SocketAddr,
    /// Whether `socket` is connected to `collector` (a connect fails while
    /// there is no route to it; each send tries again).
    connected: std::cell::Cell<bool>,
}

impl Queue {
    /// A queue and its socket. No route to the collector yet is not an
    /// error: the sends fail, counted, until there is one.
    fn open(sink: Sink, collector: SocketAddr, capacity: usize) -> io::Result<Queue> {
        let local: SocketAddr =
            if collector.is_ipv4() { (Ipv4Addr::UNSPECIFIED, 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
        let socket = UdpSocket::bind(local)?;
        socket.set_nonblocking(true)?;
        let connected = match socket.connect(collector) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(sink = sink.name(), %collector, error = %e, "translation logs: the collector cannot be reached yet");
                false
            }
        };
        Ok(Queue { sink, events: VecDeque::new(), capacity, socket, collector, connected: connected.into() })
    }

    fn push(&mut self, e: &Event, stats: &Stats) {
        if self.events.len() >= self.capacity {
            stats.add_dropped(self.sink, DropReason::QueueFull, 1);
        } else {
            self.events.push_back(e.clone());
        }
    }

    /// Sends one datagram, never waiting; an ICMP error an earlier
    /// datagram drew is counted as the collector unreachable.
    fn try_send(&self, bytes: &[u8], stats: &Stats) -> io::Result<()> {
        if !self.connected.get() {
            self.socket.connect(self.collector)?;
            self.connected.set(true);
        }
        let r = self.socket.send(bytes).map(|_| ());
        if r.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused) {
            stats.unreachable[self.sink as usize].fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// Counts `events` sent, or lost to a send error.
    fn count(&self, sent: bool, events: u64, stats: &Stats) {
        if sent {
            stats.add_sent(self.sink, events);
        } else {
            stats.add_dropped(self.sink, DropReason::SendError, events);
        }
    }
}

/// Syslog's transport: datagrams sent by the exporter, or a TCP stream
/// written by a thread of its own.
#[derive(Debug)]
enum SyslogSink {
    Udp(Queue),
    Tcp(tcp::TcpSender),
}

/// Events a sink takes from its queue per pass.
const SEND_BATCH: usize = 4096;

/// The exporter: the engine's rings in, IPFIX and syslog out.
#[derive(Debug)]
pub struct Exporter {
    engine: Engine,
    destinations: bool,
    ipfix: Option<(Queue, ipfix::Encoder)>,
    syslog: Option<(SyslogSink, syslog::Lines)>,
    journal: Option<journal::Journal>,
    identities: identity::PodIdentities,
    stats: Arc<Stats>,
    batch: Vec<LogRecord>,
    events: Vec<Event>,
    messages: Vec<ipfix::Message>,
    /// The syslog line being formatted (UDP: a datagram's payload).
    line: Vec<u8>,
}

impl Exporter {
    /// An exporter of `engine`'s rings as `cfg` says, for the node
    /// `hostname` (syslog's HOSTNAME unless configured, and IPFIX's
    /// observation domain unless configured), the pods' identities read
    /// from `identities`. Opens the sinks' sockets (the journal's first
    /// segment is opened by the first write).
    pub fn new(
        engine: Engine,
        cfg: &TranslationLogsConfig,
        hostname: &str,
        identities: identity::PodIdentities,
    ) -> io::Result<Exporter> {
        let stats: Arc<Stats> = Arc::default();
        let ipfix = match &cfg.ipfix {
            Some(c) => {
                let domain = c.observation_domain.unwrap_or_else(|| observation_domain(hostname));
                let every_ms = c.template_refresh.as_millis() as u64;
                let enc = ipfix::Encoder::new(domain, c.mtu, every_ms, cfg.log_destinations, cfg.enterprise_number);
                Some((Queue::open(Sink::Ipfix, c.collector, cfg.queue_events)?, enc))
            }
            None => None,
        };
        let syslog = match &cfg.syslog {
            Some(c) => {
                let format = syslog::Format {
                    hostname: c.hostname.clone().unwrap_or_else(|| hostname.to_string()),
                    procid: std::process::id(),
                    pen: cfg.enterprise_number,
                    destinations: cfg.log_destinations,
                };
                let sink = match c.transport {
                    SyslogTransport::Udp => SyslogSink::Udp(Queue::open(Sink::Syslog, c.collector, cfg.queue_events)?),
                    SyslogTransport::Tcp => {
                        SyslogSink::Tcp(tcp::TcpSender::start(c.collector, cfg.queue_events, stats.clone())?)
                    }
                };
                Some((sink, syslog::Lines::new(format)))
            }
            None => None,
        };
        let journal =
            cfg.journal.as_ref().map(|j| journal::Journal::new(&j.dir, journal::Limits::new(j.max_bytes, j.max_age)));
        if journal.is_some() {
            stats.set_journal(0, 0);
        }
        Ok(Exporter {
            engine,
            destinations: cfg.log_destinations,
            ipfix,
            syslog,
            journal,
            identities,
            stats,
            batch: Vec::new(),
            events: Vec::new(),
            messages: Vec::new(),
            line: Vec::with_capacity(512),
        })
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<Stats> {
        &self.stats
    }

    /// One pass at `clocks`: drains every ring (at most its size each),
    /// orders the records by time, queues them for each sink and sends
    /// what the queues hold. Returns whether a ring was found more than a
    /// quarter full (the next pass should come sooner).
    pub fn pass(&mut self, clocks: &Clocks) -> bool {
        let mut busy = false;
        self.batch.clear();
        for ring in self.engine.translog_rings() {
            busy |= ring.len() > ring.capacity() / 4;
            for _ in 0..ring.capacity() {
                match ring.pop() {
                    Some(r) => self.batch.push(r),
                    None => break,
                }
            }
        }
        // Each ring is in time order; across workers they interleave.
        self.batch.sort_by_key(|r| r.time_ms);
        self.events.clear();
        // Resolved now, once per batch: the identity the pod has at the
        // drain, never rewritten later.
        let identities = if self.batch.is_empty() { None } else { self.identities.snapshot() };
        // Counted here, added to the shared counters once per pass.
        let mut kinds = [0u64; LogKind::ALL.len()];
        let mut ends = [0u64; EndReason::ALL.len()];
        let mut unresolved = 0;
        for r in &self.batch {
            if let Some(mut e) = Event::from_record(r, clocks, self.destinations) {
                kinds[e.kind as usize - 1] += 1;
                if let Some(reason) = e.reason {
                    ends[reason as usize - 1] += 1;
                }
                if let Some(m) = &identities {
                    e.identity = m.get(&e.pod).cloned();
                    unresolved += u64::from(e.identity.is_none());
                }
                self.events.push(e);
            }
        }
        self.stats.add_counts(&kinds, &ends, unresolved);
        if let Some(j) = &mut self.journal {
            j.append(&self.events, clocks.wall_ms, &self.stats);
        }
        // A hand-over's removals are the journal's only: the next holder
        // exports the sessions' ends (ADR 0034 §8, VPP's `is_ha`).
        for e in self.events.iter().filter(|e| !e.journal_only()) {
            if let Some((q, _)) = &mut self.ipfix {
                q.push(e, &self.stats);
            }
            match &mut self.syslog {
                Some((SyslogSink::Udp(q), _)) => q.push(e, &self.stats),
                Some((SyslogSink::Tcp(t), lines)) => t.push(lines, e, &self.stats),
                None => {}
            }
        }
        self.send_ipfix(clocks.wall_ms);
        self.send_syslog();
        busy
    }

    fn send_ipfix(&mut self, now_ms: u64) {
        let Some((q, enc)) = &mut self.ipfix else { return };
        loop {
            let n = q.events.len().min(SEND_BATCH);
            self.messages.clear();
            enc.encode(now_ms, &q.events.make_contiguous()[..n], true, &mut self.messages);
            q.events.drain(..n);
            for m in &self.messages {
                let mut sent = q.try_send(&m.bytes, &self.stats).is_ok();
                if !sent {
                    // A connected UDP socket reports an earlier datagram's
                    // ICMP port unreachable at the next send, which is then
                    // not sent: the collector may be back, without the
                    // templates. Send them, then this message, once more.
                    enc.resend_templates();
                    let mut templates = Vec::new();
                    enc.encode(now_ms, &[], true, &mut templates);
                    sent = templates.iter().all(|t| q.try_send(&t.bytes, &self.stats).is_ok())
                        && q.try_send(&m.bytes, &self.stats).is_ok();
                    if !sent {
                        enc.resend_templates();
                    }
                }
                q.count(sent, u64::from(m.records), &self.stats);
            }
            if q.events.is_empty() {
                break;
            }
        }
    }

    fn send_syslog(&mut self) {
        let (q, lines) = match &mut self.syslog {
            Some((SyslogSink::Udp(q), lines)) => (q, lines),
            Some((SyslogSink::Tcp(t), _)) => return t.flush(&self.stats),
            None => return,
        };
        let line = &mut self.line;
        while let Some(e) = q.events.pop_front() {
            line.clear();
            lines.write_line(&e, line);
            // Once more after an error: it may be an earlier datagram's.
            let sent = q.try_send(line, &self.stats).is_ok() || q.try_send(line, &self.stats).is_ok();
            q.count(sent, 1, &self.stats);
        }
    }
}

/// The default observation domain: a hash of the node's name (FNV-1a,
/// 32 bits), so that each gateway's records can be told apart.
pub fn observation_domain(node: &str) -> u32 {
    node.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// The exporter's period, and the shorter one after a busy drain.
const PERIOD: Duration = Duration::from_millis(10);
const BUSY_PERIOD: Duration = Duration::from_millis(5);

/// Runs `exporter` on its own thread (`egret-translog`) until `stop` is
/// set, then makes a last pass.
pub fn spawn(
    mut exporter: Exporter,
    clock: EngineClock,
    stop: Arc<AtomicBool>,
) -> io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new().name("egret-translog".into()).spawn(move || loop {
        let stopping = stop.load(Ordering::Acquire);
        let busy = exporter.pass(&Clocks::now(&clock));
        if stopping {
            return;
        }
        std::thread::sleep(if busy { BUSY_PERIOD } else { PERIOD });
    })
}

#[cfg(test)]
mod ha_tests;
#[cfg(test)]
mod tests;
