//! The formatter through `fmt` that [`Lines`](super::Lines) replaced,
//! kept as the reference its lines must equal and as the baseline of the
//! cost measurement; the sampled events both use.

use std::fmt::Write as _;

use super::*;

/// 5824aa8's line for `e`.
pub(super) fn line(f: &Format, e: &Event) -> String {
    let mut s = String::with_capacity(320);
    let msgid = msgid(e.kind);
    let hostname = if f.hostname.is_empty() { "-" } else { f.hostname.as_str() };
    let _ = write!(s, "<{PRI}>1 {} {hostname} {APP_NAME} {} {msgid} ", timestamp(e.at_ms), f.procid);
    let limit = e.limit.unwrap_or(0);
    match e.kind {
        LogKind::PortsExhausted => {
            let _ = write!(
                s,
                "[pexh@{} IATYP=\"{}\" ISADDR=\"{}\" XATYP=\"{}\" XSADDR=\"{}\" PORTS=\"{limit}\"]",
                f.pen,
                family(e.pod),
                e.pod,
                family(e.egress),
                e.egress
            );
            return s;
        }
        LogKind::QuotaExceeded => {
            let quota = if e.quota == Some(quota::MAX_SESSION_ENTRIES) { "sessions" } else { "per-pod" };
            let _ = write!(
                s,
                "[qexc@{} IATYP=\"{}\" ISADDR=\"{}\" QUOTA=\"{quota}\" LIMIT=\"{limit}\"]",
                f.pen,
                family(e.pod),
                e.pod
            );
            return s;
        }
        LogKind::BlockAllocate | LogKind::BlockFree => {
            let _ = write!(
                s,
                "[pblk@{} IATYP=\"{}\" ISADDR=\"{}\" XATYP=\"{}\" XSADDR=\"{}\" PSTART=\"{}\" PEND=\"{}\"]",
                f.pen,
                family(e.pod),
                e.pod,
                family(e.egress),
                e.egress,
                e.egress_port,
                e.block.map_or(e.egress_port, |b| b.0)
            );
            identity(f, e, &mut s);
            return s;
        }
        LogKind::SessionCreate | LogKind::SessionDelete => {}
    }
    let _ = write!(
        s,
        "[nsess SSUBIX=\"0\" SVLAN=\"0\" IATYP=\"{}\" ISADDR=\"{}\" ISPORT=\"{}\" XATYP=\"{}\" XSADDR=\"{}\" XSPORT=\"{}\" PROTO=\"{}\"",
        family(e.pod),
        e.pod,
        e.pod_port,
        family(e.egress),
        e.egress,
        e.egress_port,
        e.proto
    );
    if let (true, Some((addr, port))) = (f.destinations, e.remote) {
        let _ = write!(s, " XDADDR=\"{addr}\" XDPORT=\"{port}\"");
    }
    s.push(']');
    identity(f, e, &mut s);
    if e.kind == LogKind::SessionDelete {
        let last = timestamp(e.last_ms.unwrap_or(e.at_ms));
        let why = e.reason.map_or("unknown", |r| r.name());
        let adopted = u8::from(e.flags & log_flags::ADOPTED != 0);
        let _ = write!(s, "[end@{} last=\"{}\" why=\"{}\" adopted=\"{adopted}\"]", f.pen, escape(&last), escape(why));
    }
    s
}

/// 5824aa8's timestamp, through `format!`.
fn timestamp(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem % 3600 / 60, rem % 60, unix_ms % 1000)
}

fn identity(f: &Format, e: &Event, s: &mut String) {
    if let Some(id) = &e.identity {
        let _ = write!(
            s,
            "[pod@{} ns=\"{}\" name=\"{}\" uid=\"{}\"]",
            f.pen,
            escape(&id.namespace),
            escape(&id.name),
            escape(&id.uid)
        );
    }
}

/// Events of every kind, family and shape, from a seed: the reference's
/// comparison and the cost measurement share them.
pub(super) fn sample_events(n: u32, seed: u32) -> Vec<Event> {
    use egret_dataplane::translog::EndReason;
    use std::net::{Ipv4Addr, Ipv6Addr};
    let ids = [
        None,
        Some(std::sync::Arc::new(crate::translog::identity::PodIdentity {
            namespace: "payments".into(),
            name: "api-7d9f8-abcde".into(),
            uid: "0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21".into(),
        })),
        Some(std::sync::Arc::new(crate::translog::identity::PodIdentity {
            namespace: "odd\"ns]".into(),
            name: "back\\slash".into(),
            uid: String::new(),
        })),
    ];
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    (0..n)
        .map(|_| {
            let r = next();
            let kind = match r % 20 {
                14 => LogKind::PortsExhausted,
                15 => LogKind::QuotaExceeded,
                16 | 17 => LogKind::BlockAllocate,
                18 | 19 => LogKind::BlockFree,
                n if n % 2 == 0 => LogKind::SessionCreate,
                _ => LogKind::SessionDelete,
            };
            let v6 = r % 7 == 0;
            let addr = |v: u32| -> IpAddr {
                if v6 {
                    Ipv6Addr::from(u128::from(v) | 0x2001_0db8 << 96).into()
                } else {
                    Ipv4Addr::from(v).into()
                }
            };
            Event {
                kind,
                // Any second from 1970 to 2106, any millisecond.
                at_ms: u64::from(next()) * 1000 + u64::from(next() % 1000),
                proto: [6, 17, 1][(r % 3) as usize],
                pod: addr(next()),
                pod_port: next() as u16,
                egress: addr(next()),
                egress_port: next() as u16,
                remote: (r % 5 != 0).then(|| (addr(next()), next() as u16)),
                last_ms: (kind == LogKind::SessionDelete && r % 3 != 0).then_some(1_796_127_000_000),
                reason: (kind == LogKind::SessionDelete && r % 4 != 0).then_some(EndReason::Expired),
                flags: if r % 9 == 0 { log_flags::ADOPTED } else { 0 },
                quota: (kind == LogKind::QuotaExceeded).then_some(if r % 2 == 0 {
                    quota::MAX_SESSION_ENTRIES
                } else {
                    quota::MAX_ENTRIES_PER_USER
                }),
                limit: (r % 3 == 0).then_some(next() % 100_000),
                block: matches!(kind, LogKind::BlockAllocate | LogKind::BlockFree)
                    .then(|| (next() as u16, 1 << (r % 8)))
                    .filter(|_| r % 11 != 0),
                identity: ids[(next() % 3) as usize].clone(),
            }
        })
        .collect()
}

mod equal_to_reference {
    use egret_dataplane::translog::EndReason;

    use super::*;

    /// Through one `Lines`, as the exporter writes: first in the sample's
    /// order (every line a new second: the timestamp cache misses), then
    /// in time order a few ms apart (it hits, and seconds turn over), the
    /// identities' elements coming from their cache after the first.
    #[test]
    fn hand_written_lines_equal_the_fmt_reference() {
        for destinations in [true, false] {
            for hostname in ["gw-a", ""] {
                let f = Format { hostname: hostname.into(), procid: 4242, pen: 32473, destinations };
                let mut lines = Lines::new(f.clone());
                let mut events = sample_events(20_000, 0x1234_5678);
                for e in &events {
                    assert_eq!(lines.line(e), super::line(&f, e), "{e:?}");
                }
                for (i, e) in events.iter_mut().enumerate() {
                    e.at_ms = 1_796_127_459_263 + i as u64 / 3;
                    e.last_ms = e.last_ms.map(|_| e.at_ms - e.at_ms % 1000 - (i % 7) as u64 * 1000);
                }
                for e in &events {
                    assert_eq!(lines.line(e), super::line(&f, e), "{e:?}");
                }
            }
        }
    }

    /// `why` is written without the escape check: no reason's name needs it.
    #[test]
    fn no_end_reason_needs_an_escape() {
        let names: Vec<&str> = (0..=255).filter_map(EndReason::from_u8).map(|r| r.name()).collect();
        assert!(!names.is_empty());
        for n in names {
            assert!(matches!(escape(n), std::borrow::Cow::Borrowed(_)), "{n}");
        }
    }
}

/// What a line costs the exporter's thread, framed for TCP, against the
/// `fmt` reference (docs/benchmarks.md, "Translation logs"): `cargo test
/// --release -p egret-controlplane --lib syslog_cost -- --ignored
/// --nocapture`. A measurement, not a test: it asserts nothing about speed.
mod cost {
    use std::time::Instant;

    use super::*;

    #[test]
    #[ignore = "a measurement: run it with --release --ignored --nocapture"]
    fn syslog_cost() {
        let f = Format { hostname: "gw-a".into(), procid: 4242, pen: 32473, destinations: true };
        let mut events = sample_events(1_000_000, 0x9e37_79b9);
        let id = Some(std::sync::Arc::new(crate::translog::identity::PodIdentity {
            namespace: "payments".into(),
            name: "api-7d9f8-abcde".into(),
            uid: "0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21".into(),
        }));
        // Sessions with their pod's identity: the usual line.
        for e in &mut events {
            if e.kind != LogKind::SessionDelete {
                e.kind = LogKind::SessionCreate;
            }
            e.identity = id.clone();
        }
        // In time order, as the exporter drains them: 500 events per ms
        // (a gateway's full new-flow rate), ends 30 s after their second.
        let mut ordered = events.clone();
        for (i, e) in ordered.iter_mut().enumerate() {
            e.at_ms = 1_796_127_459_263 + i as u64 / 500;
            e.last_ms = e.last_ms.map(|_| e.at_ms - e.at_ms % 1000 - 30_000);
        }
        let mut line = Vec::new();
        let mut by_hand = |events: &[Event]| {
            let mut lines = Lines::new(f.clone());
            let t = Instant::now();
            let mut bytes = 0usize;
            for chunk in events.chunks(1024) {
                let mut batch = crate::translog::tcp::Batch::default();
                for e in chunk {
                    line.clear();
                    lines.write_line(e, &mut line);
                    batch.push(&line);
                }
                bytes += batch.bytes().len();
            }
            (t.elapsed().as_nanos() as f64 / events.len() as f64, bytes)
        };
        for round in 0..3 {
            let (in_order, _) = by_hand(&ordered);
            let (by_hand, bytes) = by_hand(&events);
            let t = Instant::now();
            let mut reference_bytes = 0usize;
            for e in &events {
                let l = super::line(&f, e);
                reference_bytes += format!("{} {l}", l.len()).len();
            }
            let reference = t.elapsed().as_nanos() as f64 / events.len() as f64;
            assert_eq!(bytes, reference_bytes);
            println!(
                "round {round}: {in_order:.0} ns per framed line by hand in time order, {by_hand:.0} with every line in a \
                 second of its own, {reference:.0} through fmt (5824aa8's), {:.0} bytes per line",
                bytes as f64 / events.len() as f64
            );
        }
    }
}
