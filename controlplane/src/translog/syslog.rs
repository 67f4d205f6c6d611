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
        let mut s = String::with_capacity(384);
        self.write_line(e, &mut s);
        s
    }

    /// Appends the message for `e` to `s`. The exporter formats every
    /// event through this into buffers it reuses: the digits and addresses
    /// are written by hand, not through `fmt`, since at a gateway's full
    /// new-flow rate the lines are most of what syslog costs
    /// (docs/benchmarks.md, "Translation logs").
    pub fn write_line(&self, e: &Event, s: &mut String) {
        let msgid = msgid(e.kind);
        let hostname = if self.hostname.is_empty() { "-" } else { self.hostname.as_str() };
        s.push('<');
        push_u64(s, u64::from(PRI));
        s.push_str(">1 ");
        push_rfc3339_ms(s, e.at_ms);
        s.push(' ');
        s.push_str(hostname);
        s.push(' ');
        s.push_str(APP_NAME);
        s.push(' ');
        push_u64(s, u64::from(self.procid));
        s.push(' ');
        s.push_str(msgid);
        s.push(' ');
        let limit = u64::from(e.limit.unwrap_or(0));
        match e.kind {
            LogKind::PortsExhausted => {
                self.open_element(s, "pexh");
                param_addr(s, "IATYP", "ISADDR", e.pod);
                param_addr(s, "XATYP", "XSADDR", e.egress);
                param_u64(s, "PORTS", limit);
                s.push(']');
                return;
            }
            LogKind::QuotaExceeded => {
                let quota = if e.quota == Some(quota::MAX_SESSION_ENTRIES) { "sessions" } else { "per-pod" };
                self.open_element(s, "qexc");
                param_addr(s, "IATYP", "ISADDR", e.pod);
                param_str(s, "QUOTA", quota);
                param_u64(s, "LIMIT", limit);
                s.push(']');
                return;
            }
            LogKind::BlockAllocate | LogKind::BlockFree => {
                self.open_element(s, "pblk");
                param_addr(s, "IATYP", "ISADDR", e.pod);
                param_addr(s, "XATYP", "XSADDR", e.egress);
                param_u64(s, "PSTART", u64::from(e.egress_port));
                param_u64(s, "PEND", u64::from(e.block.map_or(e.egress_port, |b| b.0)));
                s.push(']');
                self.identity(e, s);
                return;
            }
            LogKind::SessionCreate | LogKind::SessionDelete => {}
        }
        s.push_str("[nsess");
        param_str(s, "SSUBIX", "0");
        param_str(s, "SVLAN", "0");
        param_addr(s, "IATYP", "ISADDR", e.pod);
        param_u64(s, "ISPORT", u64::from(e.pod_port));
        param_addr(s, "XATYP", "XSADDR", e.egress);
        param_u64(s, "XSPORT", u64::from(e.egress_port));
        param_u64(s, "PROTO", u64::from(e.proto));
        if let (true, Some((addr, port))) = (self.destinations, e.remote) {
            param_ip(s, "XDADDR", addr);
            param_u64(s, "XDPORT", u64::from(port));
        }
        s.push(']');
        self.identity(e, s);
        if e.kind == LogKind::SessionDelete {
            self.open_element(s, "end");
            s.push_str(" last=\"");
            push_rfc3339_ms(s, e.last_ms.unwrap_or(e.at_ms));
            s.push('"');
            param_str(s, "why", &escape(e.reason.map_or("unknown", |r| r.name())));
            param_u64(s, "adopted", u64::from(e.flags & log_flags::ADOPTED != 0));
            s.push(']');
        }
    }

    /// The pod's `[pod@PEN ...]` element, when known.
    fn identity(&self, e: &Event, s: &mut String) {
        if let Some(id) = &e.identity {
            self.open_element(s, "pod");
            param_str(s, "ns", &escape(&id.namespace));
            param_str(s, "name", &escape(&id.name));
            param_str(s, "uid", &escape(&id.uid));
            s.push(']');
        }
    }

    /// `[NAME@PEN`: an element of Egret's own (RFC 5424 §6.3.2).
    fn open_element(&self, s: &mut String, name: &str) {
        s.push('[');
        s.push_str(name);
        s.push('@');
        push_u64(s, u64::from(self.pen));
    }
}

/// ` NAME="VALUE"` (the value already escaped).
fn param_str(s: &mut String, name: &str, value: &str) {
    s.push(' ');
    s.push_str(name);
    s.push_str("=\"");
    s.push_str(value);
    s.push('"');
}

fn param_u64(s: &mut String, name: &str, value: u64) {
    s.push(' ');
    s.push_str(name);
    s.push_str("=\"");
    push_u64(s, value);
    s.push('"');
}

fn param_ip(s: &mut String, name: &str, ip: IpAddr) {
    s.push(' ');
    s.push_str(name);
    s.push_str("=\"");
    push_ip(s, ip);
    s.push('"');
}

/// ` TYPE="IPv4" NAME="addr"`, VPP's pair.
fn param_addr(s: &mut String, typ: &str, name: &str, ip: IpAddr) {
    param_str(s, typ, family(ip));
    param_ip(s, name, ip);
}

/// A kind's MSGID (RFC 5424 §6.2.7): VPP's for sessions, Egret's own
/// for the rest.
fn msgid(kind: LogKind) -> &'static str {
    match kind {
        LogKind::SessionCreate => "SADD",
        LogKind::SessionDelete => "SDEL",
        LogKind::PortsExhausted => "PEXH",
        LogKind::QuotaExceeded => "QEXC",
        LogKind::BlockAllocate => "PBADD",
        LogKind::BlockFree => "PBDEL",
    }
}

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// `n`'s decimal digits, written into the end of `buf`.
pub(super) fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buf[i..]
}

/// Appends `n` in decimal.
fn push_u64(s: &mut String, n: u64) {
    for &d in decimal(n, &mut [0; 20]) {
        s.push(char::from(d));
    }
}

/// Appends `n` in decimal, zero-padded to `width` digits (wider if it
/// needs more).
fn push_padded(s: &mut String, n: u64, width: usize) {
    let mut w = 1;
    let mut m = n / 10;
    while m > 0 {
        w += 1;
        m /= 10;
    }
    for _ in w..width {
        s.push('0');
    }
    push_u64(s, n);
}

/// Appends an address as `Display` writes it: dotted quad by hand, IPv6
/// (RFC 5952's compressed form) through `fmt`.
fn push_ip(s: &mut String, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => {
            let [a, b, c, d] = a.octets();
            push_u64(s, u64::from(a));
            s.push('.');
            push_u64(s, u64::from(b));
            s.push('.');
            push_u64(s, u64::from(c));
            s.push('.');
            push_u64(s, u64::from(d));
        }
        IpAddr::V6(a) => {
            let _ = write!(s, "{a}");
        }
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
    let mut s = String::with_capacity(24);
    push_rfc3339_ms(&mut s, unix_ms);
    s
}

fn push_rfc3339_ms(s: &mut String, unix_ms: u64) {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    push_padded(s, y.max(0) as u64, 4);
    s.push('-');
    push_padded(s, u64::from(m), 2);
    s.push('-');
    push_padded(s, u64::from(d), 2);
    s.push('T');
    push_padded(s, rem / 3600, 2);
    s.push(':');
    push_padded(s, rem % 3600 / 60, 2);
    s.push(':');
    push_padded(s, rem % 60, 2);
    s.push('.');
    push_padded(s, unix_ms % 1000, 3);
    s.push('Z');
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

    /// The hand-written digits and addresses read as `Display` writes them.
    #[test]
    fn numbers_and_addresses_are_written_as_display_writes_them() {
        for n in [0u64, 7, 9, 10, 99, 100, 443, 65_535, 4_294_967_295, u64::MAX] {
            let mut s = String::new();
            push_u64(&mut s, n);
            assert_eq!(s, n.to_string());
            for width in [2, 3, 4] {
                let mut p = String::new();
                push_padded(&mut p, n, width);
                assert_eq!(p, format!("{n:0width$}"));
            }
        }
        let mut x: u32 = 0x9e37_79b9;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let ip = IpAddr::from(std::net::Ipv4Addr::from(x));
            let mut s = String::new();
            push_ip(&mut s, ip);
            assert_eq!(s, ip.to_string());
        }
        for ip in ["0.0.0.0", "255.255.255.255", "10.0.0.1", "2001:db8::1", "::ffff:192.0.2.1", "::"] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut s = String::new();
            push_ip(&mut s, ip);
            assert_eq!(s, ip.to_string());
        }
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

/// The formatter through `fmt` that `Format::write_line` replaced
/// (5824aa8), kept as the reference its lines must equal and as the
/// baseline of the cost measurement.
#[cfg(test)]
mod reference {
    use super::*;

    pub fn line(f: &Format, e: &Event) -> String {
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
            let _ =
                write!(s, "[end@{} last=\"{}\" why=\"{}\" adopted=\"{adopted}\"]", f.pen, escape(&last), escape(why));
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
}

/// Events of every kind, family and shape, from a seed: the reference's
/// comparison and the cost measurement share them.
#[cfg(test)]
fn sample_events(n: u32, seed: u32) -> Vec<Event> {
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

#[cfg(test)]
mod equal_to_reference {
    use super::*;

    #[test]
    fn hand_written_lines_equal_the_fmt_reference() {
        for destinations in [true, false] {
            for hostname in ["gw-a", ""] {
                let f = Format { hostname: hostname.into(), procid: 4242, pen: 32473, destinations };
                for e in sample_events(20_000, 0x1234_5678) {
                    assert_eq!(f.line(&e), reference::line(&f, &e), "{e:?}");
                }
            }
        }
    }
}

/// What a line costs the exporter's thread, framed for TCP, against the
/// `fmt` reference (docs/benchmarks.md, "Translation logs"): `cargo test
/// --release -p egret-controlplane --lib syslog_cost -- --ignored
/// --nocapture`. A measurement, not a test: it asserts nothing about speed.
#[cfg(test)]
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
        let mut line = String::new();
        for round in 0..3 {
            let t = Instant::now();
            let mut bytes = 0usize;
            for chunk in events.chunks(1024) {
                let mut batch = super::super::tcp::Batch::default();
                for e in chunk {
                    line.clear();
                    f.write_line(e, &mut line);
                    batch.push(&line);
                }
                bytes += batch.bytes().len();
            }
            let by_hand = t.elapsed().as_nanos() as f64 / events.len() as f64;
            let t = Instant::now();
            let mut reference_bytes = 0usize;
            for e in &events {
                let l = reference::line(&f, e);
                reference_bytes += format!("{} {l}", l.len()).len();
            }
            let reference = t.elapsed().as_nanos() as f64 / events.len() as f64;
            assert_eq!(bytes, reference_bytes);
            println!(
                "round {round}: {by_hand:.0} ns per framed line by hand, {reference:.0} through fmt (5824aa8's), {:.0} bytes per line",
                bytes as f64 / events.len() as f64
            );
        }
    }
}
