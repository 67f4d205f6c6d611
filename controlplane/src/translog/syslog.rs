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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::net::IpAddr;
use std::sync::Arc;

use egret_dataplane::translog::{log_flags, quota, LogKind};

use super::identity::PodIdentity;
use super::Event;

#[cfg(test)]
mod reference;

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
    /// datagram). One line at a time, without the caches [`Lines`] keeps:
    /// for tests and one-off lines.
    pub fn line(&self, e: &Event) -> String {
        Lines::new(self.clone()).line(e)
    }
}

/// Identities cached at most; the cache starts again when full (pods
/// come and go; the controller's map gives each identity one `Arc` until
/// the pod changes).
const POD_ELEMENTS_MAX: usize = 4096;

/// An exporter's line writer: a [`Format`] with what every line shares
/// written once, and caches. At a gateway's full new-flow rate the lines
/// are most of what syslog costs (docs/benchmarks.md, "Translation
/// logs"), so nothing here goes through `fmt`:
///
/// - `" HOSTNAME egret PROCID "` and `@PEN` are written once, at the start;
/// - a timestamp's `YYYY-MM-DDTHH:MM:SS.` is formatted once per second
///   (events come in time order), then only the milliseconds;
/// - each identity's `[pod@PEN ...]` element is escaped and written once
///   per identity (its `Arc`, kept alive by the cache so that its address
///   cannot be reused), not once per event;
/// - digits and dotted quads are written through tables.
#[derive(Debug)]
pub struct Lines {
    format: Format,
    /// `" HOSTNAME egret PROCID "`.
    middle: Vec<u8>,
    /// `@PEN`.
    at_pen: Vec<u8>,
    /// The event's time and an end's last packet, each by the second.
    at: SecondText,
    last: SecondText,
    /// `[pod@PEN ns="..." name="..." uid="..."]`, escaped, by identity.
    pods: HashMap<usize, (Arc<PodIdentity>, Vec<u8>), BuildHasherDefault<AddressHasher>>,
}

impl Lines {
    /// A writer of `format`'s lines.
    pub fn new(format: Format) -> Lines {
        let hostname = if format.hostname.is_empty() { "-" } else { format.hostname.as_str() };
        let mut middle = Vec::with_capacity(hostname.len() + APP_NAME.len() + 14);
        middle.push(b' ');
        middle.extend_from_slice(hostname.as_bytes());
        middle.push(b' ');
        middle.extend_from_slice(APP_NAME.as_bytes());
        middle.push(b' ');
        push_u64(&mut middle, u64::from(format.procid));
        middle.push(b' ');
        let mut at_pen = vec![b'@'];
        push_u64(&mut at_pen, u64::from(format.pen));
        Lines {
            format,
            middle,
            at_pen,
            at: SecondText::default(),
            last: SecondText::default(),
            pods: HashMap::default(),
        }
    }

    /// The message for `e`, as a `String`.
    pub fn line(&mut self, e: &Event) -> String {
        let mut s = Vec::with_capacity(384);
        self.write_line(e, &mut s);
        // UTF-8 always (ASCII, and the identity's own strings): lossy never replaces.
        String::from_utf8_lossy(&s).into_owned()
    }

    /// Appends the message for `e` to `s` (a buffer the exporter reuses).
    pub fn write_line(&mut self, e: &Event, s: &mut Vec<u8>) {
        s.extend_from_slice(b"<134>1 ");
        self.at.write(s, e.at_ms);
        s.extend_from_slice(&self.middle);
        s.extend_from_slice(msgid(e.kind).as_bytes());
        s.push(b' ');
        let limit = u64::from(e.limit.unwrap_or(0));
        match e.kind {
            LogKind::PortsExhausted => {
                self.open_element(s, b"[pexh");
                param_addr(s, b" IATYP=\"", b" ISADDR=\"", e.pod);
                param_addr(s, b" XATYP=\"", b" XSADDR=\"", e.egress);
                param_u64(s, b" PORTS=\"", limit);
                s.push(b']');
            }
            LogKind::QuotaExceeded => {
                let quota: &[u8] = if e.quota == Some(quota::MAX_SESSION_ENTRIES) { b"sessions" } else { b"per-pod" };
                self.open_element(s, b"[qexc");
                param_addr(s, b" IATYP=\"", b" ISADDR=\"", e.pod);
                param_bytes(s, b" QUOTA=\"", quota);
                param_u64(s, b" LIMIT=\"", limit);
                s.push(b']');
            }
            LogKind::BlockAllocate | LogKind::BlockFree => {
                self.open_element(s, b"[pblk");
                param_addr(s, b" IATYP=\"", b" ISADDR=\"", e.pod);
                param_addr(s, b" XATYP=\"", b" XSADDR=\"", e.egress);
                param_u64(s, b" PSTART=\"", u64::from(e.egress_port));
                param_u64(s, b" PEND=\"", u64::from(e.block.map_or(e.egress_port, |b| b.0)));
                s.push(b']');
                self.identity(e, s);
            }
            LogKind::SessionCreate | LogKind::SessionDelete => self.session(e, s),
        }
    }

    /// VPP's `nsess`, the pod's element and, for an end, `end@PEN`.
    fn session(&mut self, e: &Event, s: &mut Vec<u8>) {
        s.extend_from_slice(b"[nsess SSUBIX=\"0\" SVLAN=\"0\"");
        param_addr(s, b" IATYP=\"", b" ISADDR=\"", e.pod);
        param_u64(s, b" ISPORT=\"", u64::from(e.pod_port));
        param_addr(s, b" XATYP=\"", b" XSADDR=\"", e.egress);
        param_u64(s, b" XSPORT=\"", u64::from(e.egress_port));
        param_u64(s, b" PROTO=\"", u64::from(e.proto));
        if let (true, Some((addr, port))) = (self.format.destinations, e.remote) {
            s.extend_from_slice(b" XDADDR=\"");
            push_ip(s, addr);
            s.push(b'"');
            param_u64(s, b" XDPORT=\"", u64::from(port));
        }
        s.push(b']');
        self.identity(e, s);
        if e.kind == LogKind::SessionDelete {
            self.open_element(s, b"[end");
            s.extend_from_slice(b" last=\"");
            self.last.write(s, e.last_ms.unwrap_or(e.at_ms));
            s.push(b'"');
            // Reason names need no escape (tested for every reason).
            param_bytes(s, b" why=\"", e.reason.map_or("unknown", |r| r.name()).as_bytes());
            param_bytes(s, b" adopted=\"", if e.flags & log_flags::ADOPTED != 0 { b"1" } else { b"0" });
            s.push(b']');
        }
    }

    /// The pod's `[pod@PEN ...]` element, when known, from the cache.
    fn identity(&mut self, e: &Event, s: &mut Vec<u8>) {
        let Some(id) = &e.identity else { return };
        let key = Arc::as_ptr(id) as usize;
        if let Some((_, element)) = self.pods.get(&key) {
            s.extend_from_slice(element);
            return;
        }
        if self.pods.len() >= POD_ELEMENTS_MAX {
            self.pods.clear();
        }
        let mut element = Vec::with_capacity(id.namespace.len() + id.name.len() + id.uid.len() + 40);
        self.open_element(&mut element, b"[pod");
        param_bytes(&mut element, b" ns=\"", escape(&id.namespace).as_bytes());
        param_bytes(&mut element, b" name=\"", escape(&id.name).as_bytes());
        param_bytes(&mut element, b" uid=\"", escape(&id.uid).as_bytes());
        element.push(b']');
        s.extend_from_slice(&element);
        self.pods.insert(key, (id.clone(), element));
    }

    /// `[NAME@PEN`: an element of Egret's own (RFC 5424 §6.3.2); `open`
    /// holds `[NAME`.
    fn open_element(&self, s: &mut Vec<u8>, open: &[u8]) {
        s.extend_from_slice(open);
        s.extend_from_slice(&self.at_pen);
    }
}

/// Hashes an address (the identity cache's key): one multiply.
#[derive(Debug, Default)]
pub struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// A timestamp's text up to the second, for the last second written.
#[derive(Debug, Default)]
struct SecondText {
    second: Option<u64>,
    /// `YYYY-MM-DDTHH:MM:SS.`
    text: Vec<u8>,
}

impl SecondText {
    /// Appends `unix_ms` as RFC 3339 UTC with milliseconds.
    fn write(&mut self, s: &mut Vec<u8>, unix_ms: u64) {
        let second = unix_ms / 1000;
        if self.second != Some(second) {
            self.text.clear();
            push_date_time(&mut self.text, second);
            self.text.push(b'.');
            self.second = Some(second);
        }
        s.extend_from_slice(&self.text);
        let ms = unix_ms % 1000;
        s.extend_from_slice(&[b'0' + (ms / 100) as u8, b'0' + (ms / 10 % 10) as u8, b'0' + (ms % 10) as u8, b'Z']);
    }
}

/// ` NAME="VALUE"`: `open` holds ` NAME="`, `value` is escaped already.
fn param_bytes(s: &mut Vec<u8>, open: &[u8], value: &[u8]) {
    s.extend_from_slice(open);
    s.extend_from_slice(value);
    s.push(b'"');
}

fn param_u64(s: &mut Vec<u8>, open: &[u8], value: u64) {
    s.extend_from_slice(open);
    push_u64(s, value);
    s.push(b'"');
}

/// ` TYPE="IPv4" NAME="addr"`, VPP's pair; `typ` and `name` hold
/// ` TYPE="` and ` NAME="`.
fn param_addr(s: &mut Vec<u8>, typ: &[u8], name: &[u8], ip: IpAddr) {
    param_bytes(s, typ, family(ip).as_bytes());
    s.extend_from_slice(name);
    push_ip(s, ip);
    s.push(b'"');
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
fn push_u64(s: &mut Vec<u8>, n: u64) {
    s.extend_from_slice(decimal(n, &mut [0; 20]));
}

/// Appends `n` in decimal, zero-padded to `width` digits (wider if it
/// needs more).
fn push_padded(s: &mut Vec<u8>, n: u64, width: usize) {
    let mut buf = [0; 20];
    let digits = decimal(n, &mut buf);
    for _ in digits.len()..width {
        s.push(b'0');
    }
    s.extend_from_slice(digits);
}

/// Each byte's decimal digits (up to 3) and their count: a dotted quad is
/// four look-ups.
static OCTETS: [([u8; 3], u8); 256] = octet_table();

const fn octet_table() -> [([u8; 3], u8); 256] {
    let mut t = [([0u8; 3], 0u8); 256];
    let mut i = 0;
    while i < 256 {
        let (h, d, u) = ((i / 100) as u8, (i / 10 % 10) as u8, (i % 10) as u8);
        t[i] = if i >= 100 {
            ([b'0' + h, b'0' + d, b'0' + u], 3)
        } else if i >= 10 {
            ([b'0' + d, b'0' + u, 0], 2)
        } else {
            ([b'0' + u, 0, 0], 1)
        };
        i += 1;
    }
    t
}

/// Appends an address as `Display` writes it: dotted quad through
/// [`OCTETS`], IPv6 (RFC 5952's compressed form) through `fmt`.
fn push_ip(s: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => {
            let [a, b, c, d] = a.octets();
            for (i, o) in [a, b, c, d].into_iter().enumerate() {
                if i > 0 {
                    s.push(b'.');
                }
                let (digits, n) = &OCTETS[usize::from(o)];
                s.extend_from_slice(&digits[..usize::from(*n)]);
            }
        }
        IpAddr::V6(a) => {
            use std::io::Write as _;
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
    let mut s = Vec::with_capacity(24);
    SecondText::default().write(&mut s, unix_ms);
    String::from_utf8_lossy(&s).into_owned() // ASCII digits and separators
}

/// `YYYY-MM-DDTHH:MM:SS` of a Unix second.
fn push_date_time(s: &mut Vec<u8>, secs: u64) {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    push_padded(s, y.max(0) as u64, 4);
    s.push(b'-');
    push_padded(s, u64::from(m), 2);
    s.push(b'-');
    push_padded(s, u64::from(d), 2);
    s.push(b'T');
    push_padded(s, rem / 3600, 2);
    s.push(b':');
    push_padded(s, rem % 3600 / 60, 2);
    s.push(b':');
    push_padded(s, rem % 60, 2);
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
            let mut s = Vec::new();
            push_u64(&mut s, n);
            assert_eq!(s, n.to_string().as_bytes());
            for width in [2, 3, 4] {
                let mut p = Vec::new();
                push_padded(&mut p, n, width);
                assert_eq!(p, format!("{n:0width$}").as_bytes());
            }
        }
        let mut x: u32 = 0x9e37_79b9;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let ip = IpAddr::from(std::net::Ipv4Addr::from(x));
            let mut s = Vec::new();
            push_ip(&mut s, ip);
            assert_eq!(s, ip.to_string().as_bytes());
        }
        for ip in ["0.0.0.0", "255.255.255.255", "10.0.0.1", "2001:db8::1", "::ffff:192.0.2.1", "::"] {
            let ip: IpAddr = ip.parse().unwrap();
            let mut s = Vec::new();
            push_ip(&mut s, ip);
            assert_eq!(s, ip.to_string().as_bytes());
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
