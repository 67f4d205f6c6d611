//! Translation logs (issue 34, ADR 0034) end to end through real
//! collectors: scripted sessions made by the real engine (frames through a
//! worker's pipeline, as the fixture tests drive it), some ended by the
//! expiry sweep, exported by the control plane's exporter to Debian's
//! nfcapd (IPFIX) and to a UDP socket (syslog); nfdump must read back
//! exactly the expected records (every create and delete, addresses,
//! ports, times to the millisecond) and the socket exactly the expected
//! RFC 5424 lines, each naming its pod (`pod@PEN`). The exporter's local
//! journal then answers `egret who-had` through a real admin socket for
//! every scripted session: the right pod, address and port, create and
//! delete times, and "no session held it" after the delete.
//!
//! Engine time is placed on a fixed wall clock (2026-12-01T12:00:00Z at
//! engine 0), so every expected time is exact. Everything binds to
//! 127.0.0.1; nfcapd is stopped (SIGTERM flushes its file) and its
//! directory removed by its guard.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stderr)]

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use egret_controlplane::admin::{self, Request};
use egret_controlplane::config::{IpfixConfig, JournalConfig, SyslogConfig, SyslogTransport, TranslationLogsConfig};
use egret_controlplane::translog::identity::{PodIdentities, PodIdentity};
use egret_controlplane::translog::{Clocks, DropReason, Exporter, Sink};
use egret_controlplane::view::{
    Counters, GatewayView, PolicyRow, PortRow, SessionFilter, SessionRow, Status, WhoHadAnswer, WhoHadQuery,
};
use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, Pipeline, RxMeta, Verdict};
use egret_dataplane::fixtures::{
    self, base_spec, build, echo, from_outside, from_pod, tcp, topology, udp, E1, INSIDE, OUTSIDE, POD_A, POD_B, SERVER,
};
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::nat::tcp_state::flags::{FIN, SYN};
use egret_dataplane::translog::LogKind;
use egret_tests::nfcapd::Nfcapd;

/// Engine time 0 on the wall clock: 2026-12-01T12:00:00.000Z.
const W0: u64 = 1_796_126_400_000;

fn clocks(engine_ms: u64) -> Clocks {
    Clocks { wall_ms: W0 + engine_ms, engine_ms, scale: 1 }
}

fn send(w: &mut Pipeline, p: &build::Packet, ingress: u32, at_ms: u64) {
    let f = p.frame();
    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
    buf[..f.len()].copy_from_slice(&f);
    let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
    let v = w.process(&mut buf, f.len(), meta, Timestamp::from_millis(at_ms));
    assert!(matches!(v, Verdict::Forward { .. }), "{v:?} at {at_ms} ms");
}

/// One scripted session: who, and when it began and (if it ends) its last
/// packet's second.
#[derive(Debug, Clone, Copy)]
struct Scripted {
    pod: Ipv4Addr,
    pod_port: u16,
    remote_port: u16,
    proto: u8,
    created_ms: u64,
    /// The last packet's engine second, when the sweep ends it.
    ends: Option<u64>,
}

/// The sweep that ends sessions, engine ms.
const SWEEP_MS: u64 = 400_000;

/// Sessions created and packets sent, in time order.
fn script(w: &mut Pipeline) -> Vec<Scripted> {
    let a = IpAddr::V4(POD_A);
    let s = IpAddr::V4(SERVER);
    // UDP that stays alive: a packet at 200 s keeps it past the sweep at 400 s.
    send(w, &from_pod(a, s, udp(40000, 53, b"q")), INSIDE, 1_000);
    // UDP with a reply, last packet at 5.4 s: expires (300 s).
    send(w, &from_pod(a, s, udp(40001, 53, b"q")), INSIDE, 1_250);
    // TCP: handshake, then FIN both ways at 9 s: closed, expires (240 s).
    send(w, &from_pod(a, s, tcp(41000, 443, 1, None, SYN, b"")), INSIDE, 1_500);
    send(w, &from_outside(s, IpAddr::V4(E1), tcp(443, 41000, 9, Some(2), SYN, b"")), OUTSIDE, 1_600);
    // ICMP echo, id 7: expires (60 s).
    send(w, &from_pod(a, s, echo(true, 7, 1)), INSIDE, 2_500);
    // Another pod's UDP: expires.
    send(w, &from_pod(IpAddr::V4(POD_B), s, udp(40000, 123, b"t")), INSIDE, 3_042);
    send(w, &from_pod(a, s, udp(40001, 53, b"q")), INSIDE, 5_400);
    send(w, &from_pod(a, s, tcp(41000, 443, 2, Some(10), FIN, b"")), INSIDE, 9_000);
    send(w, &from_outside(s, IpAddr::V4(E1), tcp(443, 41000, 10, Some(3), FIN, b"")), OUTSIDE, 9_000);
    vec![
        Scripted { pod: POD_A, pod_port: 40000, remote_port: 53, proto: 17, created_ms: 1_000, ends: None },
        Scripted { pod: POD_A, pod_port: 40001, remote_port: 53, proto: 17, created_ms: 1_250, ends: Some(5) },
        Scripted { pod: POD_A, pod_port: 41000, remote_port: 443, proto: 6, created_ms: 1_500, ends: Some(9) },
        Scripted { pod: POD_A, pod_port: 7, remote_port: 0, proto: 1, created_ms: 2_500, ends: Some(2) },
        Scripted { pod: POD_B, pod_port: 40000, remote_port: 123, proto: 17, created_ms: 3_042, ends: Some(3) },
    ]
}

fn config(ipfix: SocketAddr, syslog: SocketAddr) -> TranslationLogsConfig {
    TranslationLogsConfig {
        ring_records: 1024,
        queue_events: 1024,
        log_destinations: true,
        enterprise_number: 32473,
        ipfix: Some(IpfixConfig {
            collector: ipfix,
            observation_domain: Some(34),
            template_refresh: Duration::from_secs(60),
            mtu: 1400,
        }),
        syslog: Some(SyslogConfig {
            collector: syslog,
            hostname: Some("gw-test".into()),
            transport: SyslogTransport::Udp,
        }),
        journal: None,
    }
}

/// The pods' identities as the controller would publish them.
fn identity(pod: Ipv4Addr) -> PodIdentity {
    let name = if pod == POD_A { "pod-a" } else { "pod-b" };
    PodIdentity { namespace: "team".into(), name: name.into(), uid: format!("uid-{name}") }
}

/// A gateway as the admin socket sees it, with only `who-had`: the real
/// journal, and the engine's table for sessions the journal has no end for.
struct JournalView {
    dir: PathBuf,
    engine: Engine,
    now: Clocks,
}

impl GatewayView for JournalView {
    fn status(&self) -> Status {
        Status::default()
    }
    fn counters(&self) -> Counters {
        Counters::default()
    }
    fn policies(&self) -> Vec<PolicyRow> {
        Vec::new()
    }
    fn ports(&self) -> Vec<PortRow> {
        Vec::new()
    }
    fn sessions(&self, _: &SessionFilter) -> Vec<SessionRow> {
        Vec::new()
    }
    fn who_had(&self, q: &WhoHadQuery) -> Result<WhoHadAnswer, String> {
        let nat = self.engine.nat4();
        let live = |e: &egret_controlplane::translog::Event| {
            nat.sessions
                .iter()
                .find(|v| {
                    IpAddr::V4(v.tuple.pod) == e.pod
                        && v.tuple.pod_port == e.pod_port
                        && v.tuple.egress_port == e.egress_port
                        && v.tuple.proto == e.proto
                })
                .map(|v| self.now.wall(u64::from(nat.last_seen(&v)) * 1000))
        };
        egret_controlplane::translog::who_had::answer(&self.dir, q, &live)
    }
}

/// Serves `view` on a real admin socket at `path` (mode 0600, peer
/// credentials checked) from a thread of its own.
fn serve_admin(path: &std::path::Path, view: JournalView) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let listener = {
        let _in = rt.enter();
        admin::bind(path).unwrap()
    };
    let view: Arc<dyn GatewayView> = Arc::new(view);
    std::thread::spawn(move || rt.block_on(admin::serve(listener, view)));
}

/// `YYYY-MM-DDThh:mm:ss.mmmZ` of a wall time in this test's range (one day
/// from W0), written here by hand rather than by the encoder under test.
fn stamp(wall_ms: u64) -> String {
    let since = wall_ms - W0;
    let (s, ms) = (since / 1000, since % 1000);
    let (h, m, sec) = (12 + s / 3600, s % 3600 / 60, s % 60);
    assert!(h < 24);
    format!("2026-12-01T{h:02}:{m:02}:{sec:02}.{ms:03}Z")
}

#[test]
fn nfdump_and_a_syslog_socket_read_back_exactly_the_scripted_sessions() {
    let mut collector = Nfcapd::start().expect("nfcapd");
    let syslog_rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    syslog_rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();

    let mut spec = base_spec();
    spec.nat.new_flows_per_second_per_source = 0;
    spec.nat.max_sessions = 1024;
    let engine = Engine::new(&spec).unwrap();
    engine.publish_fib(topology());
    assert!(engine.enable_translog(1024));
    let mut w = engine.pipeline_seeded(PortRng::new(7));
    let journal = std::env::temp_dir().join(format!("egret-translog-collector-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&journal);
    let mut cfg = config(collector.addr(), syslog_rx.local_addr().unwrap());
    cfg.journal = Some(JournalConfig { dir: journal.clone(), max_bytes: 1 << 20, max_age: Duration::from_secs(3600) });
    let ids = PodIdentities::default();
    ids.set([POD_A, POD_B].into_iter().map(|p| (IpAddr::V4(p), Arc::new(identity(p)))).collect());
    let mut exporter = Exporter::new(engine.clone(), &cfg, "node-x", ids).unwrap();

    let sessions = script(&mut w);
    // The egress port each session got, from the engine itself.
    let egress_port = |s: &Scripted| {
        engine
            .nat4()
            .sessions
            .iter()
            .find(|v| v.tuple.pod == s.pod && v.tuple.pod_port == s.pod_port && v.tuple.proto == s.proto)
            .map(|v| (v.tuple.egress, v.tuple.egress_port))
            .unwrap_or_else(|| panic!("no session for {s:?}"))
    };
    let ports: Vec<(Ipv4Addr, u16)> = sessions.iter().map(egress_port).collect();
    exporter.pass(&clocks(10_000));

    send(&mut w, &from_pod(IpAddr::V4(POD_A), IpAddr::V4(SERVER), udp(40000, 53, b"q")), INSIDE, 200_000);
    w.tick(Timestamp::from_millis(SWEEP_MS), 4096);
    assert_eq!(engine.nat4().sessions.len(), 1, "only the refreshed UDP session lives");
    exporter.pass(&clocks(SWEEP_MS + 100));

    let stats = exporter.stats().clone();
    assert_eq!((stats.records(LogKind::SessionCreate), stats.records(LogKind::SessionDelete)), (5, 4));
    for sink in Sink::ALL {
        assert_eq!(stats.sent(sink), 9, "{}", sink.name());
        for r in DropReason::ALL {
            assert_eq!(stats.dropped(sink, r), 0, "{} {}", sink.name(), r.name());
        }
    }
    // Give the collector its datagrams, then stop it: SIGTERM flushes.
    std::thread::sleep(Duration::from_millis(300));
    collector.stop().expect("nfcapd stops on SIGTERM");

    // IPFIX, through nfdump: every field of every record.
    let fmt = "%msec|%pr|%sa|%sp|%nsa|%nsp|%da|%dp|%te";
    let rows =
        |filter: &str| -> BTreeSet<Vec<String>> { collector.query(fmt, filter).expect("nfdump").into_iter().collect() };
    let row = |at: u64, s: &Scripted, (e, p): (Ipv4Addr, u16), end: Option<u64>| -> Vec<String> {
        let te = match end {
            Some(ms) => {
                let t = stamp(ms).replace('T', " ");
                t.trim_end_matches('Z').to_string()
            }
            None => "1970-01-01 00:00:00.000".into(),
        };
        // ICMP: the identifier is in the port fields (7 and 227, as RFC 8158
        // logs a query ID); nfdump 1.7.1 reads an ICMP record whose
        // destination port is 0 as if the source port held the ICMP type
        // and code, and prints it in %dp as type.code ("7.0" for id 7).
        let (sp, dp) = if s.proto == 1 {
            ("0".to_string(), format!("{}.0", s.pod_port))
        } else {
            (s.pod_port.to_string(), s.remote_port.to_string())
        };
        vec![
            at.to_string(),
            s.proto.to_string(),
            s.pod.to_string(),
            sp,
            e.to_string(),
            p.to_string(),
            SERVER.to_string(),
            dp,
            te,
        ]
    };
    let want_creates: BTreeSet<Vec<String>> =
        sessions.iter().zip(&ports).map(|(s, p)| row(W0 + s.created_ms, s, *p, None)).collect();
    let want_deletes: BTreeSet<Vec<String>> = sessions
        .iter()
        .zip(&ports)
        .filter_map(|(s, p)| s.ends.map(|last| row(W0 + SWEEP_MS, s, *p, Some(W0 + last * 1000))))
        .collect();
    let creates = rows("nat event 4");
    let deletes = rows("nat event 5");
    eprintln!("nfdump, nat event 4: {creates:#?}\nnfdump, nat event 5: {deletes:#?}");
    assert_eq!(creates, want_creates, "natEvent 4: one per session");
    assert_eq!(deletes, want_deletes, "natEvent 5: one per ended session");
    assert_eq!(rows("any").len(), 9, "nothing else");

    // The operator's question: who had E1:port? Exactly that session's two records.
    let (tcp, (e, p)) = (&sessions[2], ports[2]);
    let who = rows(&format!("src xip {e} and src xport {p} and proto tcp"));
    assert_eq!(who.len(), 2, "{who:#?}");
    assert!(who.iter().all(|r| r[2] == tcp.pod.to_string() && r[3] == tcp.pod_port.to_string()), "{who:#?}");

    let summary = collector.summary().expect("nfdump -I");
    assert!(summary.contains("Sequence failures: 0"), "{summary}");
    assert!(summary.contains("Flows: 9"), "{summary}");

    // Syslog: the same nine events, as RFC 5424 lines in VPP's format.
    let mut got = BTreeSet::new();
    let mut buf = [0u8; 2048];
    for _ in 0..9 {
        let n = egret_tests::client::udp_recv(&syslog_rx, &mut buf).expect("a syslog datagram");
        got.insert(String::from_utf8(buf[..n].to_vec()).unwrap());
    }
    syslog_rx.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    assert!(syslog_rx.recv(&mut buf).is_err(), "no tenth line");
    let pid = std::process::id();
    let line = |at: u64, msgid: &str, s: &Scripted, (e, p): (Ipv4Addr, u16)| {
        let id = identity(s.pod);
        format!(
            "<134>1 {} gw-test egret {pid} {msgid} [nsess SSUBIX=\"0\" SVLAN=\"0\" IATYP=\"IPv4\" ISADDR=\"{}\" \
             ISPORT=\"{}\" XATYP=\"IPv4\" XSADDR=\"{e}\" XSPORT=\"{p}\" PROTO=\"{}\" XDADDR=\"{SERVER}\" XDPORT=\"{}\"]\
             [pod@32473 ns=\"{}\" name=\"{}\" uid=\"{}\"]",
            stamp(at),
            s.pod,
            s.pod_port,
            s.proto,
            s.remote_port,
            id.namespace,
            id.name,
            id.uid
        )
    };
    let mut want = BTreeSet::new();
    for (s, p) in sessions.iter().zip(&ports) {
        want.insert(line(W0 + s.created_ms, "SADD", s, *p));
        if let Some(last) = s.ends {
            let why = if s.proto == 6 { "tcp-closed" } else { "expired" };
            want.insert(format!(
                "{}[end@32473 last=\"{}\" why=\"{why}\" adopted=\"0\"]",
                line(W0 + SWEEP_MS, "SDEL", s, *p),
                stamp(W0 + last * 1000)
            ));
        }
    }
    assert_eq!(got, want);

    // Who had each session's egress address and port, half way through its
    // life, asked through a real admin socket?
    let socket = journal.join("admin.sock");
    serve_admin(&socket, JournalView { dir: journal.clone(), engine: engine.clone(), now: clocks(SWEEP_MS + 100) });
    let ask = |(e, p): (Ipv4Addr, u16), at_ms: u64, proto: &str| -> WhoHadAnswer {
        let query = WhoHadQuery { egress: IpAddr::V4(e), port: p, at_ms, proto: Some(proto.into()), remote: None };
        serde_json::from_value(admin::call(&socket, &Request::WhoHad { query }).expect("who-had")).unwrap()
    };
    for (s, p) in sessions.iter().zip(&ports) {
        let proto = match s.proto {
            6 => "tcp",
            17 => "udp",
            _ => "icmp",
        };
        let a = ask(*p, W0 + (s.created_ms + SWEEP_MS) / 2, proto);
        assert_eq!(a.sessions.len(), 1, "{s:?}: {a:?}");
        let r = &a.sessions[0];
        assert_eq!((r.pod, r.pod_port), (IpAddr::V4(s.pod), s.pod_port), "{s:?}");
        assert_eq!((r.egress, r.egress_port), (IpAddr::V4(p.0), p.1));
        assert_eq!(r.remote, Some(SocketAddr::new(IpAddr::V4(SERVER), s.remote_port)));
        assert_eq!(r.pod_identity.as_ref(), Some(&identity(s.pod)));
        assert_eq!(r.created_ms, Some(W0 + s.created_ms));
        match s.ends {
            Some(last) => {
                assert_eq!((r.deleted_ms, r.last_ms, r.live), (Some(W0 + SWEEP_MS), Some(W0 + last * 1000), false));
                // After its delete nobody held it.
                let after = ask(*p, W0 + SWEEP_MS + 50, proto);
                assert!(after.sessions.is_empty() && !after.before_journal, "{s:?}: {after:?}");
            }
            None => {
                // The journal has no end: the live session, last packet at 200 s.
                assert_eq!((r.deleted_ms, r.last_ms, r.live), (None, Some(W0 + 200_000), true));
            }
        }
    }
    // Before the journal's first segment: ask the collector.
    let early = ask(ports[0], W0 + 500, "udp");
    assert!(early.sessions.is_empty() && early.before_journal, "{early:?}");
    assert_eq!(early.journal_starts_ms, Some(W0 + 10_000));
    std::fs::remove_dir_all(&journal).unwrap();
}

/// Refused new flows: no free port on E2 (natEvent 12, with the egress
/// address) and pod A over its session limit (13, with the pod), each once
/// however many packets were refused in that second. nfdump 1.7.1 keeps
/// the event, its time and the addresses; it drops 466/471/473 (the quota's
/// kind and limit), which syslog carries.
#[test]
fn refusals_reach_nfdump_and_syslog() {
    let mut collector = Nfcapd::start().expect("nfcapd");
    let syslog_rx = UdpSocket::bind("127.0.0.1:0").unwrap();
    syslog_rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut spec = base_spec();
    spec.nat.new_flows_per_second_per_source = 0;
    spec.nat.max_sessions = 1024;
    spec.nat.max_sessions_per_source = 3;
    spec.nat.max_ports_per_source = Some(100);
    for e in &mut spec.egress_ips {
        if e.ip == IpAddr::V4(fixtures::E2) {
            e.ports = Some(egret_dataplane::nat::port_alloc::PortRange { first: 50000, last: 50001 });
        }
    }
    let engine = Engine::new(&spec).unwrap();
    engine.publish_fib(topology());
    assert!(engine.enable_translog(1024));
    let mut w = engine.pipeline_seeded(PortRng::new(7));
    let mut exporter = Exporter::new(
        engine.clone(),
        &config(collector.addr(), syslog_rx.local_addr().unwrap()),
        "node-x",
        PodIdentities::default(),
    )
    .unwrap();

    let process = |w: &mut Pipeline, pod: Ipv4Addr, port: u16, at_ms: u64| {
        let p = from_pod(IpAddr::V4(pod), IpAddr::V4(SERVER), udp(port, 53, b"q"));
        let f = p.frame();
        let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
        buf[..f.len()].copy_from_slice(&f);
        let meta = RxMeta { ifindex: INSIDE, checksum: ChecksumHint::Unknown };
        matches!(w.process(&mut buf, f.len(), meta, Timestamp::from_millis(at_ms)), Verdict::Forward { .. })
    };
    let c_ok: Vec<bool> = (0..4).map(|i| process(&mut w, fixtures::POD_C, 41000 + i, 7_100 + u64::from(i))).collect();
    assert_eq!(c_ok, [true, true, false, false], "two ports on E2");
    let a_ok: Vec<bool> = (0..5).map(|i| process(&mut w, POD_A, 42000 + i, 8_200 + u64::from(i))).collect();
    assert_eq!(a_ok, [true, true, true, false, false], "three sessions per pod");
    exporter.pass(&clocks(9_000));
    std::thread::sleep(Duration::from_millis(300));
    collector.stop().expect("nfcapd stops on SIGTERM");

    let q = |filter: &str, fmt: &str| collector.query(fmt, filter).expect("nfdump");
    assert_eq!(q("nat event 12", "%msec|%nsa"), [vec![(W0 + 7_102).to_string(), fixtures::E2.to_string()]]);
    assert_eq!(q("nat event 13", "%msec|%sa"), [vec![(W0 + 8_203).to_string(), POD_A.to_string()]]);
    assert_eq!(q("nat event 4", "%msec").len(), 5);
    assert_eq!(q("any", "%msec").len(), 7, "nothing else");

    let mut lines = BTreeSet::new();
    let mut buf = [0u8; 2048];
    for _ in 0..7 {
        let n = egret_tests::client::udp_recv(&syslog_rx, &mut buf).expect("a syslog datagram");
        lines.insert(String::from_utf8(buf[..n].to_vec()).unwrap());
    }
    let pid = std::process::id();
    assert!(lines.contains(&format!(
        "<134>1 {} gw-test egret {pid} PEXH [pexh@32473 IATYP=\"IPv4\" ISADDR=\"{}\" XATYP=\"IPv4\" XSADDR=\"{}\" PORTS=\"2\"]",
        stamp(W0 + 7_102),
        fixtures::POD_C,
        fixtures::E2
    )), "{lines:#?}");
    assert!(lines.contains(&format!(
        "<134>1 {} gw-test egret {pid} QEXC [qexc@32473 IATYP=\"IPv4\" ISADDR=\"{POD_A}\" QUOTA=\"per-pod\" LIMIT=\"3\"]",
        stamp(W0 + 8_203)
    )), "{lines:#?}");
}
