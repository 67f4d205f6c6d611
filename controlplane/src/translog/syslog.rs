//! Syslog messages (RFC 5424) in VPP's NAT format, one per event, for UDP
//! (RFC 5426: one message per datagram).
//!
//! VPP's element (`nat_syslog_nat44_sess` in
//! `src/plugins/nat/nat44-ed/nat44_ed.c`) is kept exactly, so that parsers
//! written for VPP read Egret's lines: PRI `<134>` (facility local0,
//! severity informational), MSGID `SADD` / `SDEL`, SD-ID `nsess` with
//! `SSUBIX`, `SVLAN`, `IATYP`, `ISADDR`, `ISPORT`, `XATYP`, `XSADDR`,
//! `XSPORT`, `PROTO`, then `XDADDR`, `XDPORT` (left out with
//! `logDestinations: false`). An end adds Egret's own element
//! `[end@PEN last=... why=... adopted=...]` (RFC 5424 §6.3.2: an SD-ID
//! that IANA did not register carries an enterprise number). When the
//! exporter knows the pod, creates and ends carry its identity as
//! `[pod@PEN ns=... name=... uid=...]` (ADR 0034 §5), between `nsess`
//! and `end`; unknown (file mode, an address no pod holds), the element
//! is left out rather than written empty. Refusals have MSGIDs of Egret's
//! own, `PEXH` (`[pexh@PEN IATYP ISADDR XATYP XSADDR PORTS]`: no free port
//! on the egress address, PORTS the range's size) and `QEXC` (`[qexc@PEN
//! IATYP ISADDR QUOTA LIMIT]`, QUOTA `per-pod` or `sessions`). Port
//! blocks (ADR 0034 §6) are `PBADD` and `PBDEL` with `[pblk@PEN IATYP
//! ISADDR XATYP XSADDR PSTART PEND]` (VPP's parameter names for the
//! addresses, the block's first and last port), then the pod's identity
//! as for sessions.
//!
//! ```text
//! <134>1 2026-12-01T12:17:39.263Z gw-a egret 4242 SDEL [nsess SSUBIX="0" SVLAN="0" IATYP="IPv4" ISADDR="10.244.1.7" ISPORT="40001" XATYP="IPv4" XSADDR="203.0.113.10" XSPORT="41522" PROTO="6" XDADDR="198.51.100.20" XDPORT="443"][end@32473 last="2026-12-01T12:17:37.000Z" why="expired" adopted="0"]
//! ```

use std::fmt::Write as _;
use std::net::IpAddr;

use egret_dataplane::translog::{log_flags, quota, LogKind};

use super::Event;

/// PRI: facility local0 (16) * 8 + severity informational (6) (RFC 5424 §6.2.1).
pub const PRI: u8 = 134;
/// APP-NAME.
pub const APP_NAME: &str = "egret";

/// What every line of one exporter shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Format {
    /// HOSTNAME (RFC 5424 §6.2.4): the node's name, printable US-ASCII.
    pub hostname: String,
    /// PROCID: the daemon's pid.
    pub procid: u32,
    /// The enterprise number of Egret's own SD-IDs (`end@PEN`).
    pub pen: u32,
    /// Whether `XDADDR` / `XDPORT` are written.
    pub destinations: bool,
}

impl Format {
    /// The message for `e`, without a trailing newline (RFC 5426: one per
    /// datagram).
    pub fn line(&self, e: &Event) -> String {
        let mut s = String::with_capacity(320);
        let msgid = match e.kind {
            LogKind::SessionCreate => "SADD",
            LogKind::SessionDelete => "SDEL",
            LogKind::PortsExhausted => "PEXH",
            LogKind::QuotaExceeded => "QEXC",
            LogKind::BlockAllocate => "PBADD",
            LogKind::BlockFree => "PBDEL",
        };
        let hostname = if self.hostname.is_empty() { "-" } else { self.hostname.as_str() };
        let _ = write!(s, "<{PRI}>1 {} {hostname} {APP_NAME} {} {msgid} ", rfc3339_ms(e.at_ms), self.procid);
        let limit = e.limit.unwrap_or(0);
        match e.kind {
            LogKind::PortsExhausted => {
                let _ = write!(
                    s,
                    "[pexh@{} IATYP=\"{}\" ISADDR=\"{}\" XATYP=\"{}\" XSADDR=\"{}\" PORTS=\"{limit}\"]",
                    self.pen,
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
                    self.pen,
                    family(e.pod),
                    e.pod
                );
                return s;
            }
            LogKind::BlockAllocate | LogKind::BlockFree => {
                let _ = write!(
                    s,
                    "[pblk@{} IATYP=\"{}\" ISADDR=\"{}\" XATYP=\"{}\" XSADDR=\"{}\" PSTART=\"{}\" PEND=\"{}\"]",
                    self.pen,
                    family(e.pod),
                    e.pod,
                    family(e.egress),
                    e.egress,
                    e.egress_port,
                    e.block.map_or(e.egress_port, |b| b.0)
                );
                self.identity(e, &mut s);
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
        if let (true, Some((addr, port))) = (self.destinations, e.remote) {
            let _ = write!(s, " XDADDR=\"{addr}\" XDPORT=\"{port}\"");
        }
        s.push(']');
        self.identity(e, &mut s);
        if e.kind == LogKind::SessionDelete {
            let last = rfc3339_ms(e.last_ms.unwrap_or(e.at_ms));
            let why = e.reason.map_or("unknown", |r| r.name());
            let adopted = u8::from(e.flags & log_flags::ADOPTED != 0);
            let _ = write!(
                s,
                "[end@{} last=\"{}\" why=\"{}\" adopted=\"{adopted}\"]",
                self.pen,
                escape(&last),
                escape(why)
            );
        }
        s
    }

    /// The pod's `[pod@PEN ...]` element, when known.
    fn identity(&self, e: &Event, s: &mut String) {
        if let Some(id) = &e.identity {
            let _ = write!(
                s,
                "[pod@{} ns=\"{}\" name=\"{}\" uid=\"{}\"]",
                self.pen,
                escape(&id.namespace),
                escape(&id.name),
                escape(&id.uid)
            );
        }
    }
}

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// A PARAM-VALUE escaped per RFC 5424 §6.3.3: `"`, `\` and `]` take a
/// backslash.
pub fn escape(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['"', '\\', ']']) {
        return std::borrow::Cow::Borrowed(v);
    }
    let mut s = String::with_capacity(v.len() + 4);
    for c in v.chars() {
        if matches!(c, '"' | '\\' | ']') {
            s.push('\\');
        }
        s.push(c);
    }
    std::borrow::Cow::Owned(s)
}

/// Unix ms as RFC 3339 UTC with milliseconds (RFC 5424 §6.2.3's
/// TIMESTAMP): `2026-12-01T12:17:39.263Z`.
pub fn rfc3339_ms(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem % 3600 / 60, rem % 60, unix_ms % 1000)
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use egret_dataplane::translog::EndReason;

    use super::*;

    /// 2026-12-01T12:17:39.263Z.
    const T: u64 = 1_796_127_459_263;

    fn event(kind: LogKind) -> Event {
        Event {
            kind,
            at_ms: T,
            proto: 6,
            pod: Ipv4Addr::new(10, 244, 1, 7).into(),
            pod_port: 40001,
            egress: Ipv4Addr::new(203, 0, 113, 10).into(),
            egress_port: 41522,
            remote: Some((Ipv4Addr::new(198, 51, 100, 20).into(), 443)),
            last_ms: (kind == LogKind::SessionDelete).then_some(T - 2_263),
            reason: (kind == LogKind::SessionDelete).then_some(EndReason::Expired),
            flags: 0,
            quota: None,
            limit: None,
            block: None,
            identity: None,
        }
    }

    fn format(destinations: bool) -> Format {
        Format { hostname: "gw-a".into(), procid: 4242, pen: 32473, destinations }
    }

    #[test]
    fn timestamps_are_rfc3339_utc_with_milliseconds() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(T), "2026-12-01T12:17:39.263Z");
        // RFC 3339 §5.8's example instant, 1985-04-12T23:20:50.52Z.
        assert_eq!(rfc3339_ms(482_196_050_520), "1985-04-12T23:20:50.520Z");
        // A leap day, and the last millisecond of a year.
        assert_eq!(rfc3339_ms(1_709_164_800_000), "2024-02-29T00:00:00.000Z");
        assert_eq!(rfc3339_ms(1_767_225_599_999), "2025-12-31T23:59:59.999Z");
    }

    /// The lines of ADR 0034 §5, VPP's element byte for byte.
    #[test]
    fn lines_are_vpps_nsess_element() {
        assert_eq!(
            format(true).line(&event(LogKind::SessionCreate)),
            "<134>1 2026-12-01T12:17:39.263Z gw-a egret 4242 SADD [nsess SSUBIX=\"0\" SVLAN=\"0\" IATYP=\"IPv4\" \
             ISADDR=\"10.244.1.7\" ISPORT=\"40001\" XATYP=\"IPv4\" XSADDR=\"203.0.113.10\" XSPORT=\"41522\" PROTO=\"6\" \
             XDADDR=\"198.51.100.20\" XDPORT=\"443\"]"
        );
        assert_eq!(
            format(true).line(&event(LogKind::SessionDelete)),
            "<134>1 2026-12-01T12:17:39.263Z gw-a egret 4242 SDEL [nsess SSUBIX=\"0\" SVLAN=\"0\" IATYP=\"IPv4\" \
             ISADDR=\"10.244.1.7\" ISPORT=\"40001\" XATYP=\"IPv4\" XSADDR=\"203.0.113.10\" XSPORT=\"41522\" PROTO=\"6\" \
             XDADDR=\"198.51.100.20\" XDPORT=\"443\"][end@32473 last=\"2026-12-01T12:17:37.000Z\" why=\"expired\" \
             adopted=\"0\"]"
        );
    }

    #[test]
    fn destinations_can_be_left_out_and_ipv6_is_named() {
        let mut e = event(LogKind::SessionCreate);
        e.pod = "2001:db8:18::10".parse().unwrap();
        e.egress = "2001:db8:113::10".parse().unwrap();
        let l = format(false).line(&e);
        assert!(!l.contains("XDADDR") && !l.contains("XDPORT"), "{l}");
        assert!(l.contains("IATYP=\"IPv6\" ISADDR=\"2001:db8:18::10\""), "{l}");
        assert!(l.contains("XATYP=\"IPv6\" XSADDR=\"2001:db8:113::10\""), "{l}");
        let mut d = event(LogKind::SessionDelete);
        d.flags = log_flags::ADOPTED;
        d.reason = Some(EndReason::TcpClosed);
        assert!(format(true).line(&d).ends_with("why=\"tcp-closed\" adopted=\"1\"]"));
    }

    /// ADR 0034 §5's line: the pod's element between `nsess` and `end`,
    /// escaped; left out when the pod is not known.
    #[test]
    fn the_pods_identity_is_its_own_element() {
        let mut d = event(LogKind::SessionDelete);
        d.identity = Some(std::sync::Arc::new(crate::translog::identity::PodIdentity {
            namespace: "payments".into(),
            name: "api-7d9f8-abcde".into(),
            uid: "0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21".into(),
        }));
        assert_eq!(
            format(true).line(&d),
            "<134>1 2026-12-01T12:17:39.263Z gw-a egret 4242 SDEL [nsess SSUBIX=\"0\" SVLAN=\"0\" IATYP=\"IPv4\" \
             ISADDR=\"10.244.1.7\" ISPORT=\"40001\" XATYP=\"IPv4\" XSADDR=\"203.0.113.10\" XSPORT=\"41522\" PROTO=\"6\" \
             XDADDR=\"198.51.100.20\" XDPORT=\"443\"][pod@32473 ns=\"payments\" name=\"api-7d9f8-abcde\" \
             uid=\"0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21\"][end@32473 last=\"2026-12-01T12:17:37.000Z\" why=\"expired\" \
             adopted=\"0\"]"
        );
        let mut c = event(LogKind::SessionCreate);
        c.identity = d.identity.clone();
        assert!(format(true).line(&c).ends_with(
            "[pod@32473 ns=\"payments\" name=\"api-7d9f8-abcde\" uid=\"0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21\"]"
        ));
        assert!(!format(true).line(&event(LogKind::SessionCreate)).contains("pod@"), "unknown: no element");
    }

    /// RFC 5424 §6.3.3: `"`, `\` and `]` inside a PARAM-VALUE are escaped;
    /// nothing else is.
    #[test]
    fn param_values_are_escaped() {
        assert_eq!(escape("plain-value_1.2"), "plain-value_1.2");
        assert_eq!(escape(r#"a"b\c]d"#), r#"a\"b\\c\]d"#);
        assert_eq!(escape("[x="), "[x=");
        assert!(matches!(escape("x"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn refusals_have_their_own_elements() {
        let mut e = event(LogKind::PortsExhausted);
        e.limit = Some(28232);
        assert_eq!(
            format(true).line(&e),
            "<134>1 2026-12-01T12:17:39.263Z gw-a egret 4242 PEXH [pexh@32473 IATYP=\"IPv4\" ISADDR=\"10.244.1.7\" \
             XATYP=\"IPv4\" XSADDR=\"203.0.113.10\" PORTS=\"28232\"]"
        );
        let mut q = event(LogKind::QuotaExceeded);
        (q.quota, q.limit) = (Some(quota::MAX_ENTRIES_PER_USER), Some(64));
        assert!(format(true)
            .line(&q)
            .ends_with("QEXC [qexc@32473 IATYP=\"IPv4\" ISADDR=\"10.244.1.7\" QUOTA=\"per-pod\" LIMIT=\"64\"]"));
        q.quota = Some(quota::MAX_SESSION_ENTRIES);
        assert!(format(true).line(&q).contains("QUOTA=\"sessions\""));
    }

    #[test]
    fn port_blocks_have_their_element() {
        let mut e = event(LogKind::BlockAllocate);
        (e.proto, e.pod_port, e.remote, e.egress_port, e.block) = (0, 0, None, 40960, Some((41087, 128)));
        assert_eq!(
            format(true).line(&e),
            "<134>1 2026-12-01T12:17:39.263Z gw-a egret 4242 PBADD [pblk@32473 IATYP=\"IPv4\" ISADDR=\"10.244.1.7\" \
             XATYP=\"IPv4\" XSADDR=\"203.0.113.10\" PSTART=\"40960\" PEND=\"41087\"]"
        );
        e.kind = LogKind::BlockFree;
        e.identity = Some(std::sync::Arc::new(crate::translog::identity::PodIdentity {
            namespace: "payments".into(),
            name: "api".into(),
            uid: "u1".into(),
        }));
        assert!(format(false).line(&e).ends_with(
            "PBDEL [pblk@32473 IATYP=\"IPv4\" ISADDR=\"10.244.1.7\" XATYP=\"IPv4\" XSADDR=\"203.0.113.10\" \
             PSTART=\"40960\" PEND=\"41087\"][pod@32473 ns=\"payments\" name=\"api\" uid=\"u1\"]"
        ));
    }

    #[test]
    fn an_empty_hostname_is_the_nil_value() {
        let f = Format { hostname: String::new(), ..format(true) };
        assert!(f
            .line(&event(LogKind::SessionCreate))
            .starts_with("<134>1 2026-12-01T12:17:39.263Z - egret 4242 SADD "));
    }
}
