//! The HA join (ADR 0034 §8) through the exporter, from the real engine's
//! records: an old holder's `handed-over` removals reach its journal only,
//! never IPFIX or syslog, and who-had names them; a taker's `not-adopted`
//! deletes reach every sink, and who-had answers them without a create.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::time::Duration;

use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{Engine, Pipeline};
use egret_dataplane::fixtures::E1;
use egret_dataplane::tables::TablesSpec;

use super::tests::spec;
use super::*;
use crate::config::JournalConfig;

/// `n` new flows from POD_A's ports 40000.. at `at_ms`.
fn new_flows(w: &mut Pipeline, n: u16, at_ms: u64) {
    super::tests::new_flows(w, 40000, n, at_ms);
}

fn engine(spec: &TablesSpec) -> (Engine, Pipeline) {
    super::tests::engine_over(spec, 1024)
}

struct Sinks {
    ipfix: UdpSocket,
    syslog: UdpSocket,
    journal: PathBuf,
}

impl Sinks {
    fn new(name: &str) -> Sinks {
        let journal = std::env::temp_dir().join(format!("egret-ha-journal-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&journal);
        let s = Sinks {
            ipfix: UdpSocket::bind("127.0.0.1:0").unwrap(),
            syslog: UdpSocket::bind("127.0.0.1:0").unwrap(),
            journal,
        };
        for u in [&s.ipfix, &s.syslog] {
            u.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        }
        s
    }

    fn config(&self) -> TranslationLogsConfig {
        TranslationLogsConfig {
            journal: Some(JournalConfig {
                dir: self.journal.clone(),
                max_bytes: 1 << 20,
                max_age: Duration::from_secs(3600),
            }),
            ..super::tests::config(
                Some(self.ipfix.local_addr().unwrap()),
                Some(self.syslog.local_addr().unwrap()),
                1024,
            )
        }
    }

    fn syslog_lines(&self) -> Vec<String> {
        let mut buf = [0u8; 2048];
        std::iter::from_fn(|| self.syslog.recv(&mut buf).ok().map(|n| String::from_utf8(buf[..n].to_vec()).unwrap()))
            .collect()
    }
}

impl Drop for Sinks {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.journal);
    }
}

fn journal_events(dir: &Path) -> Vec<Event> {
    journal::segments(dir)
        .unwrap()
        .iter()
        .flat_map(|s| journal::records(&std::fs::read(&s.path).unwrap()).collect::<Vec<_>>())
        .collect()
}

const WALL: u64 = 1_796_127_459_263;

#[test]
fn handed_over_ends_stay_in_the_journal_and_who_had_names_them() {
    let sinks = Sinks::new("handed");
    let (e, mut w) = engine(&spec());
    let mut x = Exporter::new(e.clone(), &sinks.config(), "gw-a", Default::default()).unwrap();
    new_flows(&mut w, 2, 2_000);
    x.pass(&Clocks { wall_ms: WALL, engine_ms: 2_500, scale: 1 });
    // E1 handed over: the controller's tables without it, listing it.
    let mut gone = spec();
    gone.egress_ips.retain(|x| x.ip != IpAddr::V4(E1));
    gone.handed_over = vec![IpAddr::V4(E1)];
    e.publish(&gone).unwrap();
    w.tick(Timestamp::from_millis(4_000), 1024);
    x.pass(&Clocks { wall_ms: WALL + 2_000, engine_ms: 4_500, scale: 1 });

    assert_eq!(x.stats().records(LogKind::SessionDelete), 2);
    assert_eq!(x.stats().ends(EndReason::HandedOver), 2);
    assert_eq!(x.stats().ends(EndReason::NotAdopted), 0);
    assert_eq!(x.stats().sent(Sink::Journal), 4, "two creates, two ends");
    assert_eq!(x.stats().sent(Sink::Ipfix), 2, "the creates only");
    assert_eq!(x.stats().sent(Sink::Syslog), 2, "the creates only");
    let lines = sinks.syslog_lines();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(lines.iter().all(|l| !l.contains("handed-over")), "{lines:?}");
    let events = journal_events(&sinks.journal);
    let reasons: Vec<Option<EndReason>> = events.iter().map(|e| e.reason).collect();
    assert_eq!(reasons, [None, None, Some(EndReason::HandedOver), Some(EndReason::HandedOver)]);

    let first = &events[0];
    let q = super::tests::udp_query(first.egress, first.egress_port, first.at_ms + 100);
    let a = who_had::answer(&sinks.journal, &q, &|_| None).unwrap();
    assert_eq!(a.sessions.len(), 1, "{a:?}");
    let r = &a.sessions[0];
    assert_eq!((r.pod_port, r.created_ms, r.reason.as_deref()), (40000, Some(first.at_ms), Some("handed-over")));
    assert_eq!(r.deleted_ms, Some(events[2].at_ms));
}

#[test]
fn not_adopted_ends_reach_every_sink_from_the_taker() {
    // The holder's two sessions; the taker admits one session per pod.
    let (a, mut wa) = engine(&spec());
    new_flows(&mut wa, 2, 2_000);
    let records = a.export_sessions(IpAddr::V4(E1), 3);
    let mut taker = spec();
    taker.nat.max_sessions_per_source = 1;
    let sinks = Sinks::new("notadopted");
    let (b, _wb) = engine(&taker);
    let mut x = Exporter::new(b.clone(), &sinks.config(), "gw-b", Default::default()).unwrap();
    let report = b.import_sessions(&records, &b.tables(), 10);
    assert_eq!((report.installed, report.refused.len()), (1, 1));
    assert_eq!(b.log_not_adopted(&report, &b.tables(), 10_000), 1);
    x.pass(&Clocks { wall_ms: WALL, engine_ms: 10_500, scale: 1 });

    let ends = x.stats().counters().session_ends;
    assert!(ends.contains(&("not-adopted".to_string(), 1)), "{ends:?}");
    assert_eq!(ends.iter().map(|(_, n)| n).sum::<u64>(), 1, "{ends:?}");
    assert_eq!(x.stats().sent(Sink::Ipfix), 1);
    assert_eq!(x.stats().sent(Sink::Syslog), 1);
    assert_eq!(x.stats().sent(Sink::Journal), 1);
    let refused = &report.refused[0].record;
    let lines = sinks.syslog_lines();
    assert_eq!(lines.len(), 1);
    assert!(lines[0].contains("why=\"not-adopted\""), "{}", lines[0]);
    assert!(lines[0].contains(&format!("ISPORT=\"{}\"", refused.pod_port)), "{}", lines[0]);
    // The IPFIX message holds one natEvent 5 (the encoder's map; the k8s
    // test reads it back through nfdump).
    let mut buf = [0u8; 2048];
    assert!(sinks.ipfix.recv(&mut buf).is_ok());

    let events = journal_events(&sinks.journal);
    assert_eq!(events.len(), 1);
    let d = &events[0];
    assert_eq!((d.kind, d.reason), (LogKind::SessionDelete, Some(EndReason::NotAdopted)));
    assert_eq!((d.egress, d.egress_port, d.pod_port), (refused.egress, refused.egress_port, refused.pod_port));
    let q = super::tests::udp_query(d.egress, d.egress_port, d.at_ms - 100);
    let a = who_had::answer(&sinks.journal, &q, &|_| None).unwrap();
    assert_eq!(a.sessions.len(), 1, "{a:?}");
    let r = &a.sessions[0];
    assert_eq!((r.created_ms, r.reason.as_deref(), r.adopted), (None, Some("not-adopted"), false));
}
