//! The exporter: engine times on the wall clock, records to events, and a
//! pass through the real engine's rings to loopback sockets; a collector
//! that is gone costs counters, never a wait.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, UdpSocket};
use std::time::{Duration, Instant};

use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, Pipeline, RxMeta, Verdict};
use egret_dataplane::fixtures::{self, base_spec, from_pod, topology, udp, INSIDE, POD_A, SERVER};
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::translog::log_flags;

use super::*;
use crate::config::{IpfixConfig, SyslogConfig};

#[test]
fn engine_times_are_placed_on_the_wall_clock() {
    let c = Clocks { wall_ms: 1_000_000, engine_ms: 50_000, scale: 1 };
    assert_eq!(c.wall(50_000), 1_000_000);
    assert_eq!(c.wall(49_000), 999_000);
    assert_eq!(c.wall(50_250), 1_000_250, "a record pushed after the clocks were read");
    // Engine time running 20 times faster (tests): 20 s of it is 1 s.
    let fast = Clocks { scale: 20, ..c };
    assert_eq!(fast.wall(30_000), 999_000);
    assert_eq!(Clocks { wall_ms: 10, engine_ms: 1_000_000, scale: 1 }.wall(0), 0, "saturates");
}

#[test]
fn a_record_becomes_an_event_with_the_destination_only_when_asked() {
    let t = egret_dataplane::nat::key::SessionTuple {
        pod: Ipv4Addr::new(10, 244, 1, 7),
        remote: Ipv4Addr::new(198, 51, 100, 20),
        egress: Ipv4Addr::new(203, 0, 113, 10),
        pod_port: 40001,
        remote_port: 443,
        egress_port: 41522,
        proto: 6,
    };
    let mut r = LogRecord::session(LogKind::SessionDelete, &t, 9_500, log_flags::ADOPTED);
    r.value = 7;
    r.detail = EndReason::Evicted as u8;
    let c = Clocks { wall_ms: 1_796_127_459_263, engine_ms: 10_000, scale: 1 };
    let e = Event::from_record(&r, &c, true).unwrap();
    assert_eq!(e.at_ms, 1_796_127_458_763);
    assert_eq!(e.last_ms, Some(1_796_127_456_263));
    assert_eq!(e.reason, Some(EndReason::Evicted));
    assert_eq!((e.pod, e.pod_port), (IpAddr::from(t.pod), 40001));
    assert_eq!((e.egress, e.egress_port), (IpAddr::from(t.egress), 41522));
    assert_eq!(e.remote, Some((IpAddr::from(t.remote), 443)));
    assert_eq!(e.flags, log_flags::ADOPTED);
    assert_eq!(Event::from_record(&r, &c, false).unwrap().remote, None);
    assert!(Event::from_record(&LogRecord::default(), &c, true).is_none(), "kind 0 is no event");
}

/// The fixture table's spec without the new-flow rate limit.
pub(super) fn spec() -> egret_dataplane::tables::TablesSpec {
    let mut spec = base_spec();
    spec.nat.new_flows_per_second_per_source = 0;
    spec
}

/// An engine over `spec` with translation logs on (rings of `ring`), and a seeded worker.
pub(super) fn engine_over(spec: &egret_dataplane::tables::TablesSpec, ring: usize) -> (Engine, Pipeline) {
    let e = Engine::new(spec).unwrap();
    e.publish_fib(topology());
    assert!(e.enable_translog(ring));
    let w = e.pipeline_seeded(PortRng::new(1));
    (e, w)
}

fn engine_and_worker(ring: usize) -> (Engine, Pipeline) {
    engine_over(&spec(), ring)
}

/// `n` new UDP flows of POD_A from ports `first_port..` to SERVER:53, each forwarded.
pub(super) fn new_flows(w: &mut Pipeline, first_port: u16, n: u16, at_ms: u64) {
    for i in 0..n {
        let p = from_pod(IpAddr::V4(POD_A), IpAddr::V4(SERVER), udp(first_port + i, 53, b"q"));
        let f = p.frame();
        let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
        buf[..f.len()].copy_from_slice(&f);
        let meta = RxMeta { ifindex: INSIDE, checksum: ChecksumHint::Unknown };
        assert!(matches!(w.process(&mut buf, f.len(), meta, Timestamp::from_millis(at_ms)), Verdict::Forward { .. }));
    }
}

/// Who had UDP port `port` of `egress` at `at_ms`, any remote.
pub(super) fn udp_query(egress: IpAddr, port: u16, at_ms: u64) -> crate::view::WhoHadQuery {
    crate::view::WhoHadQuery { egress, port, at_ms, proto: Some("udp".into()), remote: None }
}

/// The exporter's configuration: IPFIX and syslog over UDP where given, no journal.
pub(super) fn config(
    ipfix: Option<std::net::SocketAddr>,
    syslog: Option<std::net::SocketAddr>,
    queue: usize,
) -> TranslationLogsConfig {
    TranslationLogsConfig {
        ring_records: 1024,
        queue_events: queue,
        log_destinations: true,
        enterprise_number: 32473,
        ipfix: ipfix.map(|collector| IpfixConfig {
            collector,
            observation_domain: Some(9),
            template_refresh: Duration::from_secs(60),
            mtu: 1400,
        }),
        syslog: syslog.map(|collector| SyslogConfig {
            collector,
            hostname: Some("gw-a".into()),
            transport: crate::config::SyslogTransport::Udp,
        }),
        journal: None,
    }
}

#[test]
fn a_pass_sends_every_event_to_both_sinks() {
    let ipfix_rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let syslog_rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    for s in [&ipfix_rx, &syslog_rx] {
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    }
    let (e, mut w) = engine_and_worker(1024);
    let cfg = config(Some(ipfix_rx.local_addr().unwrap()), Some(syslog_rx.local_addr().unwrap()), 1024);
    let mut x = Exporter::new(e.clone(), &cfg, "node-a", Default::default()).unwrap();
    new_flows(&mut w, 40000, 3, 2_000);
    let clocks = Clocks { wall_ms: 1_796_127_459_263, engine_ms: 2_500, scale: 1 };
    assert!(!x.pass(&clocks));
    assert_eq!(x.stats().records(LogKind::SessionCreate), 3);
    assert_eq!(x.stats().sent(Sink::Ipfix), 3);
    assert_eq!(x.stats().sent(Sink::Syslog), 3);

    let mut buf = [0u8; 2048];
    let n = ipfix_rx.recv(&mut buf).unwrap();
    assert_eq!(&buf[..2], &[0, 10], "IPFIX");
    assert_eq!(usize::from(u16::from_be_bytes([buf[2], buf[3]])), n);
    assert_eq!(&buf[12..16], &9u32.to_be_bytes(), "the configured domain");
    let lines: Vec<String> = (0..3)
        .map(|_| {
            let n = syslog_rx.recv(&mut buf).unwrap();
            String::from_utf8(buf[..n].to_vec()).unwrap()
        })
        .collect();
    for (i, l) in lines.iter().enumerate() {
        assert!(l.starts_with("<134>1 2026-12-01T12:17:38.763Z gw-a egret "), "{l}");
        assert!(l.contains(&format!("ISPORT=\"{}\"", 40000 + i)), "{l}");
    }
}

/// Nobody listens: the connected socket gets ICMP port unreachable and
/// later sends fail at once. Everything is counted; nothing waits.
#[test]
fn a_collector_that_is_gone_costs_counters_not_time() {
    let gone = {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    };
    let (e, mut w) = engine_and_worker(1024);
    let mut x = Exporter::new(e.clone(), &config(Some(gone), Some(gone), 1024), "node-a", Default::default()).unwrap();
    let started = Instant::now();
    for round in 0..20u16 {
        new_flows(&mut w, 40000 + round * 5, 5, u64::from(round) * 10);
        let clocks = Clocks { wall_ms: 1_796_127_459_263, engine_ms: 1_000, scale: 1 };
        x.pass(&clocks);
        if round == 0 {
            std::thread::sleep(Duration::from_millis(20)); // the ICMP error arrives
        }
    }
    assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    let s = x.stats();
    for sink in [Sink::Ipfix, Sink::Syslog] {
        assert_eq!(
            s.sent(sink) + s.dropped(sink, DropReason::SendError) + s.dropped(sink, DropReason::QueueFull),
            100,
            "{}: every event sent or counted lost",
            sink.name()
        );
        assert!(s.unreachable(sink) > 0, "{}: the ICMP errors are counted", sink.name());
    }
}

/// No route to the collector at start is not an error: the sends fail,
/// counted, until there is one.
#[test]
fn a_collector_without_a_route_is_not_a_start_error() {
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let q = Queue::open(Sink::Syslog, rx.local_addr().unwrap(), 4).unwrap();
    let stats = Stats::default();
    // As if the connect at start had failed: the next send connects first.
    q.connected.set(false);
    assert!(q.try_send(b"x", &stats).is_ok());
    assert!(q.connected.get());
    let mut buf = [0u8; 8];
    rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    assert_eq!(rx.recv(&mut buf).unwrap(), 1);
    // The documentation address range has no route in a namespace without
    // one; where the host has a default route, it connects: both are fine.
    let unrouted = Queue::open(Sink::Ipfix, "[2001:db8::1]:4739".parse().unwrap(), 4);
    assert!(unrouted.is_ok(), "{unrouted:?}");
}

#[test]
fn a_full_queue_drops_and_counts() {
    let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (e, mut w) = engine_and_worker(1024);
    let mut x =
        Exporter::new(e, &config(None, Some(rx.local_addr().unwrap()), 4), "node-a", Default::default()).unwrap();
    new_flows(&mut w, 40000, 10, 0);
    x.pass(&Clocks { wall_ms: 1_796_127_459_263, engine_ms: 0, scale: 1 });
    assert_eq!(x.stats().dropped(Sink::Syslog, DropReason::QueueFull), 6);
    assert_eq!(x.stats().sent(Sink::Syslog), 4);
}

#[test]
fn the_default_observation_domain_differs_per_node() {
    assert_eq!(observation_domain(""), 0x811c_9dc5);
    assert_ne!(observation_domain("gw-a"), observation_domain("gw-b"));
}

/// A collector that was down and comes back: the send that reports the old
/// ICMP error is tried again at once, templates first, so nfcapd-like
/// collectors (which drop data before its template) get everything.
#[test]
fn a_collector_that_comes_back_gets_the_templates_and_the_records() {
    let addr = {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap()
    };
    let (e, mut w) = engine_and_worker(1024);
    let mut x = Exporter::new(e, &config(Some(addr), Some(addr), 1024), "node-a", Default::default()).unwrap();
    let clocks = Clocks { wall_ms: 1_796_127_459_263, engine_ms: 0, scale: 1 };
    x.pass(&clocks); // templates to nobody: an ICMP port unreachable comes back
    std::thread::sleep(Duration::from_millis(50));
    let rx = UdpSocket::bind(addr).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    new_flows(&mut w, 40000, 2, 0);
    x.pass(&clocks);
    let mut buf = [0u8; 2048];
    let mut got = Vec::new();
    rx.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    while let Ok(n) = rx.recv(&mut buf) {
        got.push(buf[..n].to_vec());
    }
    let ipfix: Vec<&Vec<u8>> = got.iter().filter(|m| m.starts_with(&[0, 10])).collect();
    assert!(ipfix.len() >= 2, "{got:?}");
    assert_eq!(&ipfix[0][16..18], &[0, 2], "templates first");
    assert!(ipfix.iter().skip(1).any(|m| m[16..18] == [1, 0]), "then the records (set 256)");
    let syslog = got.iter().filter(|m| m.starts_with(b"<134>1 ")).count();
    assert_eq!(syslog, 2);
    assert_eq!(x.stats().sent(Sink::Ipfix), 2);
    assert_eq!(x.stats().sent(Sink::Syslog), 2);
    assert_eq!(x.stats().dropped(Sink::Ipfix, DropReason::SendError), 0);
}

fn tcp_config(collector: std::net::SocketAddr, queue: usize) -> TranslationLogsConfig {
    let mut c = config(None, Some(collector), queue);
    if let Some(s) = c.syslog.as_mut() {
        s.transport = crate::config::SyslogTransport::Tcp;
    }
    c
}

/// The exporter's connection, or a failure (not a hang) when it does not
/// come.
fn accept_within(listener: &std::net::TcpListener, limit: Duration) -> std::net::TcpStream {
    listener.set_nonblocking(true).unwrap();
    let deadline = std::time::Instant::now() + limit;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(std::time::Instant::now() < deadline, "the exporter did not connect within {limit:?}");
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
}

/// Reads octet-counted frames (RFC 6587 §3.4.1) until `n` arrived.
fn read_frames(stream: &mut std::net::TcpStream, n: usize) -> Vec<String> {
    use std::io::Read;
    stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut data = Vec::new();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while out.len() < n {
        let got = stream.read(&mut buf).unwrap();
        assert!(got > 0, "closed after {} frames", out.len());
        data.extend_from_slice(&buf[..got]);
        while let Some(sp) = data.iter().position(|b| *b == b' ') {
            let len: usize = std::str::from_utf8(&data[..sp]).unwrap().parse().unwrap();
            if data.len() < sp + 1 + len {
                break;
            }
            out.push(String::from_utf8(data[sp + 1..sp + 1 + len].to_vec()).unwrap());
            data.drain(..sp + 1 + len);
        }
    }
    out
}

#[test]
fn syslog_over_tcp_frames_each_message_by_its_length() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let (e, mut w) = engine_and_worker(1024);
    let mut x =
        Exporter::new(e, &tcp_config(listener.local_addr().unwrap(), 1024), "node-a", Default::default()).unwrap();
    new_flows(&mut w, 40000, 3, 0);
    x.pass(&Clocks { wall_ms: 1_796_127_459_263, engine_ms: 0, scale: 1 });
    let mut s = accept_within(&listener, Duration::from_secs(10));
    let frames = read_frames(&mut s, 3);
    for (i, f) in frames.iter().enumerate() {
        assert!(f.starts_with("<134>1 2026-12-01T12:17:39.263Z gw-a egret "), "{f}");
        assert!(f.contains(&format!("ISPORT=\"{}\"", 40000 + i)), "{f}");
    }
    drop(x); // the writer stops
}

/// The collector is not there yet: messages wait (queue bounded), the
/// writer retries, and they arrive once it listens; nothing waits on the
/// exporter's side.
#[test]
fn syslog_over_tcp_waits_for_a_collector_without_holding_the_exporter() {
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (e, mut w) = engine_and_worker(1024);
    let mut x = Exporter::new(e, &tcp_config(addr, 4), "node-a", Default::default()).unwrap();
    new_flows(&mut w, 40000, 10, 0);
    let t = std::time::Instant::now();
    x.pass(&Clocks { wall_ms: 1_796_127_459_263, engine_ms: 0, scale: 1 });
    assert!(t.elapsed() < Duration::from_millis(100), "{:?}", t.elapsed());
    std::thread::sleep(Duration::from_millis(300));
    let listener = std::net::TcpListener::bind(addr).unwrap();
    let mut s = accept_within(&listener, Duration::from_secs(10));
    // At most the queue (4) and the one batch the writer held meanwhile.
    let stats = x.stats().clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stats.sent(Sink::Syslog) + stats.dropped(Sink::Syslog, DropReason::QueueFull) < 10 {
        assert!(std::time::Instant::now() < deadline, "{:?}", stats.counters());
        std::thread::sleep(Duration::from_millis(20));
    }
    let sent = stats.sent(Sink::Syslog) as usize;
    assert!(sent >= 4, "{:?}", stats.counters());
    assert_eq!(read_frames(&mut s, sent).len(), sent);
    assert_eq!(sent as u64 + stats.dropped(Sink::Syslog, DropReason::QueueFull), 10);
    drop(x);
}

/// The journal gets every event with the identity its pod had at the
/// drain: the address given to another pod later names the new pod only
/// in later records; who-had answers from it.
#[test]
fn the_journal_keeps_the_identity_at_the_drain() {
    use crate::translog::identity::{PodIdentities, PodIdentity};
    use std::sync::Arc;
    let dir = std::env::temp_dir().join(format!("egret-exporter-journal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (e, mut w) = engine_and_worker(1024);
    let mut cfg = config(None, None, 1024);
    cfg.journal =
        Some(crate::config::JournalConfig { dir: dir.clone(), max_bytes: 1 << 20, max_age: Duration::from_secs(3600) });
    let ids = PodIdentities::default();
    let who = |name: &str| {
        Arc::new(PodIdentity { namespace: "payments".into(), name: name.into(), uid: format!("uid-{name}") })
    };
    ids.set([(IpAddr::V4(POD_A), who("api-a"))].into());
    let mut x = Exporter::new(e, &cfg, "node-a", ids.clone()).unwrap();
    new_flows(&mut w, 40000, 3, 2_000);
    x.pass(&Clocks { wall_ms: 1_796_127_459_263, engine_ms: 2_500, scale: 1 });
    ids.set([(IpAddr::V4(POD_A), who("api-b"))].into());
    new_flows(&mut w, 41000, 2, 3_000);
    // (A pass with nobody for the pod counts it unresolved: below.)
    x.pass(&Clocks { wall_ms: 1_796_127_460_263, engine_ms: 3_500, scale: 1 });
    assert_eq!(x.stats().sent(Sink::Journal), 5);
    assert_eq!(x.stats().unresolved(), 0);

    let events: Vec<Event> = journal::segments(&dir)
        .unwrap()
        .iter()
        .flat_map(|s| journal::records(&std::fs::read(&s.path).unwrap()).collect::<Vec<_>>())
        .collect();
    let names: Vec<(u16, &str)> =
        events.iter().map(|e| (e.pod_port, e.identity.as_ref().unwrap().name.as_str())).collect();
    assert_eq!(names, [(40000, "api-a"), (40001, "api-a"), (40002, "api-a"), (41000, "api-b"), (41001, "api-b")]);

    // Who had the first flow's egress port a moment after it was made?
    let first = &events[0];
    let q = udp_query(first.egress, first.egress_port, first.at_ms + 100);
    let a = who_had::answer(&dir, &q, &|_| Some(1_796_127_460_000)).unwrap();
    assert_eq!(a.sessions.len(), 1, "{a:?}");
    let r = &a.sessions[0];
    assert_eq!((r.pod, r.pod_port), (IpAddr::V4(POD_A), 40000));
    assert_eq!(r.pod_identity.as_ref().unwrap().uid, "uid-api-a");
    assert_eq!((r.live, r.last_ms, r.deleted_ms), (true, Some(1_796_127_460_000), None));
    assert_eq!(r.remote, Some(std::net::SocketAddr::new(IpAddr::V4(SERVER), 53)));
    assert!(!a.before_journal);
    // Before the journal: ask the collector.
    let early =
        who_had::answer(&dir, &crate::view::WhoHadQuery { at_ms: first.at_ms - 60_000, ..q.clone() }, &|_| None)
            .unwrap();
    assert!(early.sessions.is_empty() && early.before_journal);
    assert!(who_had::answer(&dir, &crate::view::WhoHadQuery { proto: Some("sctp".into()), ..q }, &|_| None)
        .unwrap_err()
        .contains("\"sctp\""));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A pod in block mode (ADR 0034 §6): its flows make one block record
/// in the journal and none per session, and who-had answers any port of
/// the block from it.
#[test]
fn block_mode_journals_the_block_and_who_had_answers_from_it() {
    use crate::translog::identity::{PodIdentities, PodIdentity};
    use egret_dataplane::nat::port_blocks::PortBlocks;
    use std::sync::Arc;
    let dir = std::env::temp_dir().join(format!("egret-translog-blocks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut spec = base_spec();
    spec.nat.new_flows_per_second_per_source = 0;
    for e in &mut spec.egress_ips {
        e.port_blocks = Some(PortBlocks { size: 64, max_per_pod: 2, log_sessions: false });
    }
    let e = Engine::new(&spec).unwrap();
    e.publish_fib(topology());
    assert!(e.enable_translog(1024));
    let mut w = e.pipeline_seeded(PortRng::new(1));
    let mut cfg = config(None, None, 1024);
    cfg.journal =
        Some(crate::config::JournalConfig { dir: dir.clone(), max_bytes: 1 << 20, max_age: Duration::from_secs(3600) });
    let ids = PodIdentities::default();
    let api = Arc::new(PodIdentity { namespace: "payments".into(), name: "api".into(), uid: "uid-api".into() });
    ids.set([(IpAddr::V4(POD_A), api)].into());
    let mut x = Exporter::new(e, &cfg, "node-a", ids).unwrap();
    new_flows(&mut w, 40000, 10, 2_000);
    x.pass(&Clocks { wall_ms: 1_796_127_459_263, engine_ms: 2_500, scale: 1 });
    let events: Vec<Event> = journal::segments(&dir)
        .unwrap()
        .iter()
        .flat_map(|s| journal::records(&std::fs::read(&s.path).unwrap()).collect::<Vec<_>>())
        .collect();
    assert_eq!(events.len(), 1, "one block, no session records: {events:?}");
    let b = &events[0];
    assert_eq!((b.kind, b.pod, b.remote), (LogKind::BlockAllocate, IpAddr::V4(POD_A), None));
    assert_eq!(b.egress_port % 64, 0);
    assert_eq!(b.block, Some((b.egress_port + 63, 64)));
    assert_eq!(x.stats().sent(Sink::Journal), 1);
    let q = udp_query(b.egress, b.egress_port + 17, b.at_ms + 100);
    let a = who_had::answer(&dir, &q, &|_| None).unwrap();
    assert!(a.sessions.is_empty() && !a.before_journal, "{a:?}");
    assert_eq!(a.blocks.len(), 1);
    let r = &a.blocks[0];
    assert_eq!((r.pod, r.first_port, r.last_port), (IpAddr::V4(POD_A), b.egress_port, b.egress_port + 63));
    assert_eq!((r.allocated_ms, r.freed_ms), (Some(b.at_ms), None));
    assert_eq!(r.pod_identity.as_ref().unwrap().name, "api");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn who_had_questions_name_a_bad_value() {
    let q =
        who_had::query("203.0.113.10:41522", "2026-12-01T14:03:07Z", Some("tcp"), Some("198.51.100.20:443")).unwrap();
    assert_eq!((q.egress, q.port, q.at_ms), ("203.0.113.10".parse().unwrap(), 41522, 1_796_133_787_000));
    assert_eq!(q.remote, Some("198.51.100.20:443".parse().unwrap()));
    let v6 = who_had::query("[2001:db8::10]:80", "2026-12-01T15:03:07.5+01:00", None, None).unwrap();
    assert_eq!(v6.at_ms, 1_796_133_787_500);
    let cases = [
        (("203.0.113.10", "2026-12-01T14:03:07Z", None, None), "ADDR:PORT: \"203.0.113.10\": not an address:port"),
        (("203.0.113.10:1", "yesterday", None, None), "--at: \"yesterday\": not an RFC 3339 time"),
        (("203.0.113.10:1", "2026-12-01T14:03:07Z", Some("gre"), None), "--proto: \"gre\": must be tcp, udp or icmp"),
        (("203.0.113.10:1", "2026-12-01T14:03:07Z", None, Some("x:y")), "--remote: \"x:y\": not an address:port"),
    ];
    for ((t, at, p, r), want) in cases {
        let e = who_had::query(t, at, p, r).unwrap_err();
        assert!(e.starts_with(want), "{e}");
    }
}

/// A session without a delete in the journal is looked up in the session
/// table: same protocol, pod, egress and remote; its last packet from its
/// idle time.
#[test]
fn a_live_session_is_found_by_its_whole_key() {
    let row = |remote_port: u16, idle_secs: u64| crate::view::SessionRow {
        proto: "udp".into(),
        pod: IpAddr::V4(POD_A),
        pod_port: 40000,
        egress: "203.0.113.10".parse().unwrap(),
        egress_port: 41522,
        remote: IpAddr::V4(SERVER),
        remote_port,
        idle_secs,
        state: String::new(),
        offloaded: false,
    };
    let rows = [row(123, 9), row(53, 4)];
    let e = Event {
        kind: LogKind::SessionCreate,
        at_ms: 0,
        proto: 17,
        pod: IpAddr::V4(POD_A),
        pod_port: 40000,
        egress: "203.0.113.10".parse().unwrap(),
        egress_port: 41522,
        remote: Some((IpAddr::V4(SERVER), 53)),
        last_ms: None,
        reason: None,
        flags: 0,
        quota: None,
        limit: None,
        block: None,
        identity: None,
    };
    let clocks = Clocks { wall_ms: 1_796_127_460_000, engine_ms: 60_000, scale: 1 };
    assert_eq!(who_had::live_in(&rows, &clocks, &e), Some(1_796_127_456_000), "the remote picks the row");
    let fast = Clocks { scale: 4, ..clocks };
    assert_eq!(who_had::live_in(&rows, &fast, &e), Some(1_796_127_459_000), "idle engine seconds, scaled");
    let no_remote = Event { remote: None, ..e.clone() };
    assert_eq!(who_had::live_in(&rows, &clocks, &no_remote), Some(1_796_127_451_000), "the first on the key");
    assert_eq!(who_had::live_in(&rows, &clocks, &Event { proto: 6, ..e.clone() }), None);
    assert_eq!(who_had::live_in(&rows, &clocks, &Event { pod_port: 40001, ..e.clone() }), None);
    assert_eq!(who_had::live_in(&rows, &clocks, &Event { egress_port: 41523, ..e }), None);
}

/// Identities published, but none for the pod: counted unresolved. None
/// published (file mode): nothing counted.
#[test]
fn events_without_an_identity_are_counted_only_when_identities_exist() {
    use crate::translog::identity::PodIdentities;
    let (e, mut w) = engine_and_worker(1024);
    let cfg = config(None, None, 1024);
    let ids = PodIdentities::default();
    let mut x = Exporter::new(e, &cfg, "node-a", ids.clone()).unwrap();
    new_flows(&mut w, 40000, 2, 2_000);
    x.pass(&Clocks { wall_ms: 1_796_127_459_263, engine_ms: 2_500, scale: 1 });
    assert_eq!(x.stats().unresolved(), 0, "file mode");
    ids.set(Default::default());
    new_flows(&mut w, 41000, 3, 3_000);
    x.pass(&Clocks { wall_ms: 1_796_127_460_263, engine_ms: 3_500, scale: 1 });
    assert_eq!(x.stats().unresolved(), 3);
    assert_eq!(x.stats().counters().identity_unresolved, 3);
}
