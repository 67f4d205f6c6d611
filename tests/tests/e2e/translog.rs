//! Translation logs from the real daemon (issue 34, ADR 0034): a gateway
//! with `translationLogs:` exports to Debian's nfcapd and to a syslog
//! socket, both on the gateway namespace's loopback. Pod A opens a UDP flow
//! and a TCP connection (pod C a UDP flow through the other egress IP),
//! exchanges, goes quiet for 1.5 s, exchanges once more, then closes; the
//! sessions expire (engine time runs 60 times faster). nfdump must then
//! read exactly one create and one delete per flow, with the addresses and
//! ports the server saw, creation inside the test's window, and each
//! delete's last packet (flowEndMilliseconds) at the flow's last exchange:
//! in the fast-path tier those packets were translated in XDP, so that is
//! the fast path's stamp, not the workers'. The syslog socket must get the
//! same events in RFC 5424 form.

use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egret_tests::client::{self, Reply, TcpSession};
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::nfcapd::Nfcapd;
use egret_tests::plan::Pod;

both_tiers!(translation_logs_reach_the_collectors, translation_logs);

const IPFIX_PORT: u16 = 4739;
const SYSLOG_PORT: u16 = 5514;
const SCALE: u32 = 60;

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// One flow as the test saw it.
#[derive(Debug)]
struct Flow {
    proto: u8,
    /// The server it talks to.
    to: SocketAddr,
    /// The pod's side, and the external side the server saw.
    first: Reply,
    /// Wall ms of its first and of its last exchange.
    opened_ms: u64,
    last_ms: u64,
}

fn translation_logs(name: &str, tier: Tier) {
    // The journal in a directory of the test's own (the default is the
    // host's /var/lib/egret/translog).
    let journal = std::env::temp_dir().join(format!("egret-e2e-journal-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&journal);
    let extra = format!(
        "translationLogs:\n  ipfix: {{collector: \"127.0.0.1:{IPFIX_PORT}\", templateRefresh: 5s}}\n  \
         syslog: {{collector: \"127.0.0.1:{SYSLOG_PORT}\", hostname: gw-lab}}\n  \
         journal: {{dir: \"{}\"}}\n",
        journal.display()
    );
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |cfg| {
        cfg.extra += &extra;
        cfg.clock_scale = Some(SCALE);
    }) else {
        return;
    };
    // The collectors, on the gateway's loopback (a fresh namespace: the ports are free).
    let mut collector = Nfcapd::start_in(h.lab.gateway_ns(), IPFIX_PORT).expect("nfcapd in the gateway namespace");
    let syslog = h.lab.gateway_ns().run_in(|| UdpSocket::bind(("127.0.0.1", SYSLOG_PORT))).unwrap().unwrap();
    syslog.set_read_timeout(Some(Duration::from_millis(200))).unwrap();

    let before = h.counters().unwrap();
    let t0 = wall_ms();
    let a = h.lab.pod(Pod::A);
    let c = h.lab.pod(Pod::C);
    let udp_a = client::udp_socket(a, Pod::A.echo_endpoint()).unwrap();
    let udp_c = client::udp_socket(c, Pod::C.echo_endpoint()).unwrap();
    let exchange = |s: &UdpSocket, token: &str| client::udp_exchange(s, token, 3, Duration::from_secs(1)).unwrap().0;
    let mut tcp = TcpSession::connect(a, Pod::A.echo_endpoint()).unwrap();
    let mut flows = vec![
        Flow { proto: 17, to: Pod::A.echo_endpoint(), first: exchange(&udp_a, "a-udp-0"), opened_ms: t0, last_ms: 0 },
        Flow { proto: 6, to: Pod::A.echo_endpoint(), first: tcp.line("a-tcp-0").unwrap(), opened_ms: t0, last_ms: 0 },
        Flow { proto: 17, to: Pod::C.echo_endpoint(), first: exchange(&udp_c, "c-udp-0"), opened_ms: t0, last_ms: 0 },
    ];
    let t1 = wall_ms();
    // A few rounds (confirmed: the fast path installs the sessions), then
    // quiet, then the last round.
    for i in 1..4 {
        assert_eq!(exchange(&udp_a, &format!("a-udp-{i}")).seen, flows[0].first.seen);
        assert_eq!(tcp.line(&format!("a-tcp-{i}")).unwrap().seen, flows[1].first.seen);
        assert_eq!(exchange(&udp_c, &format!("c-udp-{i}")).seen, flows[2].first.seen);
    }
    if tier == Tier::FastPath {
        h.wait_counters(Duration::from_secs(3), "the three sessions installed in the fast path", |k| {
            k.get_path("fast_path.offloads.installed") >= before.get_path("fast_path.offloads.installed") + 3
        })
        .unwrap();
    }
    std::thread::sleep(Duration::from_millis(1500));
    let hits_before = h.fast_path_hits().unwrap();
    assert_eq!(exchange(&udp_a, "a-udp-last").seen, flows[0].first.seen);
    flows[0].last_ms = wall_ms();
    assert_eq!(tcp.line("a-tcp-last").unwrap().seen, flows[1].first.seen);
    assert_eq!(exchange(&udp_c, "c-udp-last").seen, flows[2].first.seen);
    flows[2].last_ms = wall_ms();
    if tier == Tier::FastPath {
        let hits = h.fast_path_hits().unwrap() - hits_before;
        assert!(hits >= 6, "the last round went through XDP: {hits} hits");
    }
    drop(tcp); // FIN both ways: the TCP session closes (transitory timeout)
    flows[1].last_ms = wall_ms();

    // UDP 300 s and TCP transitory 240 s of engine time: 5 s and 4 s here.
    let expired = |k: &egret_tests::gateway::Counters| k.get("session_expired") - before.get("session_expired");
    h.wait_counters(Duration::from_secs(30), "the three sessions expired", |k| expired(k) >= 3).unwrap();
    std::thread::sleep(Duration::from_millis(500)); // the exporter's 10 ms period, with margin
    let done = wall_ms();
    let after = h.counters().unwrap();
    collector.stop().expect("nfcapd stops on SIGTERM");

    // Every flow: one create, one delete, nothing else for its key.
    let fmt = "%msec|%pr|%sa|%sp|%nsa|%nsp|%da|%dp|%te";
    let mut records = BTreeMap::new();
    for f in &flows {
        let (pod, ext) = (f.first.local, f.first.seen);
        let key = format!("proto {} and src ip {} and src port {}", f.proto, pod.ip(), pod.port());
        let creates = collector.query(fmt, &format!("nat event 4 and {key}")).unwrap();
        let deletes = collector.query(fmt, &format!("nat event 5 and {key}")).unwrap();
        assert_eq!((creates.len(), deletes.len()), (1, 1), "{key}: {creates:?} {deletes:?}");
        for r in creates.iter().chain(&deletes) {
            assert_eq!(r[4], ext.ip().to_string(), "{key}: the egress address the server saw");
            assert_eq!(r[5], ext.port().to_string(), "{key}: the egress port the server saw");
            assert_eq!(r[6], f.to.ip().to_string(), "{key}: the destination");
            assert_eq!(r[7], f.to.port().to_string(), "{key}: the destination port");
        }
        let created: u64 = creates[0][0].parse().unwrap();
        assert!((f.opened_ms - 50..=t1 + 50).contains(&created), "{key}: created at {created}, test {t0}..{t1}");
        let removed: u64 = deletes[0][0].parse().unwrap();
        assert!((f.last_ms..=done).contains(&removed), "{key}: removed at {removed}, last packet {}", f.last_ms);
        records.insert(key, (creates, deletes));
    }
    // flowEndMilliseconds: %te as "YYYY-MM-DD hh:mm:ss.mmm" (UTC): the last
    // packet, to the engine second (1/60 s here) and the fast path's stamp
    // granularity (a second, reported at its end).
    for f in &flows {
        let pod = f.first.local;
        let key = format!("proto {} and src ip {} and src port {}", f.proto, pod.ip(), pod.port());
        let te = &records[&key].1[0][8];
        let last = parse_utc_ms(te).unwrap_or_else(|| panic!("{key}: %te {te:?}"));
        assert!(
            last + 1_000 >= f.last_ms && last <= f.last_ms + 1_500,
            "{key}: last packet logged at {te} ({last}), the test's last exchange at {}",
            f.last_ms
        );
    }
    let summary = collector.summary().unwrap();
    assert!(summary.contains("Sequence failures: 0"), "{summary}");

    // Syslog: the same six events.
    let mut lines = Vec::new();
    let mut buf = [0u8; 2048];
    while let Ok(n) = client::udp_recv(&syslog, &mut buf) {
        lines.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    for f in &flows {
        let (pod, ext) = (f.first.local, f.first.seen);
        let mine = |msgid: &str| {
            lines
                .iter()
                .filter(|l| {
                    l.contains(" gw-lab egret ")
                        && l.contains(&format!(" {msgid} [nsess "))
                        && l.contains(&format!("ISADDR=\"{}\" ISPORT=\"{}\"", pod.ip(), pod.port()))
                        && l.contains(&format!(
                            "XSADDR=\"{}\" XSPORT=\"{}\" PROTO=\"{}\"",
                            ext.ip(),
                            ext.port(),
                            f.proto
                        ))
                })
                .count()
        };
        assert_eq!((mine("SADD"), mine("SDEL")), (1, 1), "{pod} {}: {lines:#?}", f.proto);
    }
    for sink in ["ipfix", "syslog"] {
        assert!(after.get_path(&format!("translog.sent.{sink}")) >= 6, "{sink}: {after:?}");
    }
    // The daemon's own journal, through its admin socket: `egret who-had`
    // names each flow's pod address and port while the session lived, and
    // nobody after its delete.
    for f in &flows {
        let (pod, ext) = (f.first.local, f.first.seen);
        let key = format!("proto {} and src ip {} and src port {}", f.proto, pod.ip(), pod.port());
        let (created, removed): (u64, u64) =
            (records[&key].0[0][0].parse().unwrap(), records[&key].1[0][0].parse().unwrap());
        let proto = if f.proto == 6 { "tcp" } else { "udp" };
        let during = who_had(&h, ext, proto, (created + removed) / 2);
        let rows = during["sessions"].as_array().unwrap_or_else(|| panic!("{key}: {during}"));
        assert_eq!(rows.len(), 1, "{key}: one session held {ext}: {during}");
        let row = &rows[0];
        assert_eq!(row["pod"].as_str(), Some(pod.ip().to_string().as_str()), "{key}: {row}");
        assert_eq!(row["pod_port"].as_u64(), Some(u64::from(pod.port())), "{key}: {row}");
        assert_eq!(row["remote"].as_str(), Some(f.to.to_string().as_str()), "{key}: {row}");
        assert_eq!(
            (row["created_ms"].as_u64(), row["deleted_ms"].as_u64()),
            (Some(created), Some(removed)),
            "{key}: {row}"
        );
        assert_eq!(row["live"].as_bool(), Some(false), "{key}: {row}");
        let after = who_had(&h, ext, proto, removed + 1);
        assert_eq!(after["sessions"].as_array().map(Vec::len), Some(0), "{key}: nobody after the delete: {after}");
    }
    let early = who_had(&h, flows[0].first.seen, "udp", t0 - 3_600_000);
    assert_eq!(early["before_journal"].as_bool(), Some(true), "an hour before: ask the collector: {early}");
    eprintln!("{name}: {} syslog lines; nfdump records {records:#?}", lines.len());
    h.finish(&[]).unwrap();
    std::fs::remove_dir_all(&journal).unwrap();
}

/// `2026-12-01 12:00:02.000` (UTC) as Unix ms.
/// `egret who-had ADDR:PORT --at T --proto P --json` against the daemon.
fn who_had(h: &egret_tests::harness::Harness, at: SocketAddr, proto: &str, at_ms: u64) -> serde_json::Value {
    let secs = i64::try_from(at_ms / 1000).unwrap();
    let at_time = k8s_openapi::jiff::Timestamp::new(secs, i32::try_from(at_ms % 1000).unwrap() * 1_000_000).unwrap();
    let out =
        h.gw.admin()
            .cli(&["who-had", &at.to_string(), "--at", &at_time.to_string(), "--proto", proto, "--json"])
            .unwrap_or_else(|e| panic!("egret who-had {at} at {at_time}: {e}"));
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("who-had's JSON: {e}: {out}"))
}

fn parse_utc_ms(s: &str) -> Option<u64> {
    let (date, time) = s.split_once(' ')?;
    let d: Vec<i64> = date.split('-').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let (hms, ms) = time.split_once('.')?;
    let t: Vec<i64> = hms.split(':').map(|x| x.parse().ok()).collect::<Option<_>>()?;
    let (y, m, day) = (d[0], d[1], d[2]);
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + t[0] * 3600 + t[1] * 60 + t[2];
    Some(secs as u64 * 1000 + ms.parse::<u64>().ok()?)
}

#[test]
fn utc_stamps_parse() {
    assert_eq!(parse_utc_ms("2026-12-01 12:00:02.000"), Some(1_796_126_402_000));
    assert_eq!(parse_utc_ms("1970-01-01 00:00:00.001"), Some(1));
}
