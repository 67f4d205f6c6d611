//! IPFIX messages (RFC 7011) carrying NAT events (RFC 8158): NAT44 session
//! create and delete (natEvent 4 and 5), and the same for IPv6 sessions
//! under the same codes (RFC 8158 has no NAT66 event).
//!
//! A message (RFC 7011 §3.1) is a 16-byte header (version 10, length,
//! export time in seconds, sequence number, observation domain) and sets:
//! a Template Set (set ID 2, §3.4.1) when templates are due, then Data
//! Sets whose set ID is their template's ID (§3.3.2). Over UDP, templates
//! are sent at the start, every `template_every` and after a send error
//! (§10.3: over UDP they are resent periodically; a collector such as
//! nfcapd drops data whose template it has not seen, silently). The
//! sequence number counts the data records sent before the message, per
//! observation domain (§3.1), so a message lost on the way shows at the
//! collector as a gap. A message never exceeds `mtu` bytes (§10.3: no IP
//! fragmentation).
//!
//! Templates (docs/adr/0034-translation-logs.md §4; IE/length):
//!
//! | id | natEvent | IEs |
//! |---|---|---|
//! | 256 | 4 | 323/8 230/1 8/4 225/4 4/1 7/2 227/2 12/4 226/4 11/2 228/2 |
//! | 257 | 5 | 256's, then 153/8 (the last packet) |
//! | 258, 259 | 4, 5 | 256 and 257 without 12, 226, 11, 228 (`logDestinations: false`) |
//! | 260, 261 | 4, 5 | IPv6: 323 230 27/16 281/16 4 7 227 28/16 282/16 11 228 (+153 on 261) |
//! | 266, 267 | 4, 5 | 260 and 261 without 28, 282, 11, 228 |
//! | 262, 268 | 12 | 323 230 225/4 (IPv4) or 281/16 (IPv6): the egress address whose ports ran out |
//! | 263, 269 | 13 | 323 230 466/4 (3) 473/4 8/4 (IPv4) or 27/16 (IPv6): the pod over its limit |
//! | 264 | 13 | 323 230 466/4 (1) 471/4: the session table is full |
//! | 265, 270 | 16, 17 | 323 230 8/4 225/4 (IPv4) or 27/16 281/16 (IPv6) 361/2 362/2 363/2 364/2: a pod's port block |
//!
//! A port block's record (ADR 0034 §6) carries portRangeStart and
//! portRangeEnd (its first and last port), portRangeStepSize 1 (a block
//! is contiguous) and portRangeNumPorts (its size). Debian bookworm's
//! nfdump 1.7.1 drops 361-364 in IPFIX (it maps them from 1.7.4): the
//! tests read these records with their own decoder.
//!
//! The remote is not translated (Egret rewrites only the pod's side), so
//! the post-NAT destination equals the destination.

use std::net::IpAddr;

use egret_dataplane::translog::{quota, LogKind};

use super::identity::PodIdentity;
use super::Event;

/// IPFIX's version number (RFC 7011 §3.1).
pub const VERSION: u16 = 10;
/// The message header's length.
pub const MESSAGE_HEADER_LEN: usize = 16;
/// A set header's length (§3.3.2).
pub const SET_HEADER_LEN: usize = 4;
/// The Template Set's ID (§3.3.2).
pub const TEMPLATE_SET_ID: u16 = 2;

/// natEvent values, RFC 8158 §4.3 ("Definition of NAT events", IANA's
/// registry).
pub mod nat_event {
    /// NAT44 session create.
    pub const NAT44_SESSION_CREATE: u8 = 4;
    /// NAT44 session delete.
    pub const NAT44_SESSION_DELETE: u8 = 5;
    /// NAT ports exhausted.
    pub const NAT_PORTS_EXHAUSTED: u8 = 12;
    /// Quota exceeded.
    pub const QUOTA_EXCEEDED: u8 = 13;
    /// Port block allocation.
    pub const PORT_BLOCK_ALLOCATION: u8 = 16;
    /// Port block de-allocation.
    pub const PORT_BLOCK_DEALLOCATION: u8 = 17;
}

/// Egret's own Information Elements (RFC 7011 §3.2: enterprise bit set,
/// the Private Enterprise Number after the length; ADR 0034 §4): the pod's
/// identity, three strings of variable length (§7: one length byte, or 255
/// and two length bytes from 255 on), UTF-8 as Kubernetes gives them.
/// Every session and port block record carries them; a pod the exporter
/// does not know (file mode, an address no pod holds) has three empty
/// strings, so each template keeps one layout.
pub mod egret_ie {
    /// podNamespace: `metadata.namespace`.
    pub const POD_NAMESPACE: u16 = 1;
    /// podName: `metadata.name`.
    pub const POD_NAME: u16 = 2;
    /// podUID: `metadata.uid`.
    pub const POD_UID: u16 = 3;
}

/// The enterprise bit of a Field Specifier's IE (RFC 7011 §3.2).
pub const ENTERPRISE_BIT: u16 = 0x8000;
/// The field length that means variable (RFC 7011 §7).
pub const VARIABLE_LENGTH: u16 = 0xffff;

/// Information Element identifiers (IANA's IPFIX registry).
pub mod ie {
    /// protocolIdentifier, unsigned8.
    pub const PROTOCOL: u16 = 4;
    /// sourceTransportPort, unsigned16.
    pub const SOURCE_PORT: u16 = 7;
    /// sourceIPv4Address.
    pub const SOURCE_IPV4: u16 = 8;
    /// destinationTransportPort, unsigned16.
    pub const DESTINATION_PORT: u16 = 11;
    /// destinationIPv4Address.
    pub const DESTINATION_IPV4: u16 = 12;
    /// sourceIPv6Address.
    pub const SOURCE_IPV6: u16 = 27;
    /// destinationIPv6Address.
    pub const DESTINATION_IPV6: u16 = 28;
    /// flowEndMilliseconds, dateTimeMilliseconds.
    pub const FLOW_END_MS: u16 = 153;
    /// postNATSourceIPv4Address.
    pub const POST_NAT_SOURCE_IPV4: u16 = 225;
    /// postNATDestinationIPv4Address.
    pub const POST_NAT_DESTINATION_IPV4: u16 = 226;
    /// postNAPTSourceTransportPort.
    pub const POST_NAPT_SOURCE_PORT: u16 = 227;
    /// postNAPTDestinationTransportPort.
    pub const POST_NAPT_DESTINATION_PORT: u16 = 228;
    /// natEvent, unsigned8.
    pub const NAT_EVENT: u16 = 230;
    /// postNATSourceIPv6Address.
    pub const POST_NAT_SOURCE_IPV6: u16 = 281;
    /// postNATDestinationIPv6Address.
    pub const POST_NAT_DESTINATION_IPV6: u16 = 282;
    /// observationTimeMilliseconds, dateTimeMilliseconds.
    pub const OBSERVATION_TIME_MS: u16 = 323;
    /// portRangeStart, unsigned16.
    pub const PORT_RANGE_START: u16 = 361;
    /// portRangeEnd, unsigned16.
    pub const PORT_RANGE_END: u16 = 362;
    /// portRangeStepSize, unsigned16.
    pub const PORT_RANGE_STEP_SIZE: u16 = 363;
    /// portRangeNumPorts, unsigned16.
    pub const PORT_RANGE_NUM_PORTS: u16 = 364;
    /// natQuotaExceededEvent, unsigned32.
    pub const NAT_QUOTA_EXCEEDED_EVENT: u16 = 466;
    /// maxSessionEntries, unsigned32.
    pub const MAX_SESSION_ENTRIES: u16 = 471;
    /// maxEntriesPerUser, unsigned32.
    pub const MAX_ENTRIES_PER_USER: u16 = 473;
}

/// The fields a template lists, in order: what each data record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    ObservationTime,
    NatEvent,
    PodAddress,
    EgressAddress,
    Protocol,
    PodPort,
    EgressPort,
    RemoteAddress,
    PostNatRemoteAddress,
    RemotePort,
    PostNatRemotePort,
    FlowEnd,
    QuotaEvent,
    MaxEntriesPerUser,
    MaxSessionEntries,
    PortRangeStart,
    PortRangeEnd,
    PortRangeStepSize,
    PortRangeNumPorts,
    PodNamespace,
    PodName,
    PodUid,
}

impl Field {
    /// Egret's enterprise IE of an identity field.
    fn enterprise_ie(self) -> Option<u16> {
        match self {
            Field::PodNamespace => Some(egret_ie::POD_NAMESPACE),
            Field::PodName => Some(egret_ie::POD_NAME),
            Field::PodUid => Some(egret_ie::POD_UID),
            _ => None,
        }
    }

    /// (IE, length) of the field in a template for `v6` addresses; a
    /// variable-length field's fixed part is 0 bytes here.
    fn spec(self, v6: bool) -> (u16, u16) {
        let addr = if v6 { 16 } else { 4 };
        match self {
            Field::ObservationTime => (ie::OBSERVATION_TIME_MS, 8),
            Field::NatEvent => (ie::NAT_EVENT, 1),
            Field::PodAddress => (if v6 { ie::SOURCE_IPV6 } else { ie::SOURCE_IPV4 }, addr),
            Field::EgressAddress => (if v6 { ie::POST_NAT_SOURCE_IPV6 } else { ie::POST_NAT_SOURCE_IPV4 }, addr),
            Field::Protocol => (ie::PROTOCOL, 1),
            Field::PodPort => (ie::SOURCE_PORT, 2),
            Field::EgressPort => (ie::POST_NAPT_SOURCE_PORT, 2),
            Field::RemoteAddress => (if v6 { ie::DESTINATION_IPV6 } else { ie::DESTINATION_IPV4 }, addr),
            Field::PostNatRemoteAddress => {
                (if v6 { ie::POST_NAT_DESTINATION_IPV6 } else { ie::POST_NAT_DESTINATION_IPV4 }, addr)
            }
            Field::RemotePort => (ie::DESTINATION_PORT, 2),
            Field::PostNatRemotePort => (ie::POST_NAPT_DESTINATION_PORT, 2),
            Field::FlowEnd => (ie::FLOW_END_MS, 8),
            Field::QuotaEvent => (ie::NAT_QUOTA_EXCEEDED_EVENT, 4),
            Field::MaxEntriesPerUser => (ie::MAX_ENTRIES_PER_USER, 4),
            Field::MaxSessionEntries => (ie::MAX_SESSION_ENTRIES, 4),
            Field::PortRangeStart => (ie::PORT_RANGE_START, 2),
            Field::PortRangeEnd => (ie::PORT_RANGE_END, 2),
            Field::PortRangeStepSize => (ie::PORT_RANGE_STEP_SIZE, 2),
            Field::PortRangeNumPorts => (ie::PORT_RANGE_NUM_PORTS, 2),
            Field::PodNamespace | Field::PodName | Field::PodUid => (0, 0),
        }
    }
}

const WITH_DESTINATION: &[Field] = &[
    Field::ObservationTime,
    Field::NatEvent,
    Field::PodAddress,
    Field::EgressAddress,
    Field::Protocol,
    Field::PodPort,
    Field::EgressPort,
    Field::RemoteAddress,
    Field::PostNatRemoteAddress,
    Field::RemotePort,
    Field::PostNatRemotePort,
];
const WITHOUT_DESTINATION: &[Field] = &[
    Field::ObservationTime,
    Field::NatEvent,
    Field::PodAddress,
    Field::EgressAddress,
    Field::Protocol,
    Field::PodPort,
    Field::EgressPort,
];

const PORTS_EXHAUSTED: &[Field] = &[Field::ObservationTime, Field::NatEvent, Field::EgressAddress];
const QUOTA_PER_USER: &[Field] =
    &[Field::ObservationTime, Field::NatEvent, Field::QuotaEvent, Field::MaxEntriesPerUser, Field::PodAddress];
const QUOTA_SESSIONS: &[Field] =
    &[Field::ObservationTime, Field::NatEvent, Field::QuotaEvent, Field::MaxSessionEntries];
const PORT_BLOCK: &[Field] = &[
    Field::ObservationTime,
    Field::NatEvent,
    Field::PodAddress,
    Field::EgressAddress,
    Field::PortRangeStart,
    Field::PortRangeEnd,
    Field::PortRangeStepSize,
    Field::PortRangeNumPorts,
];

const IDENTITY: &[Field] = &[Field::PodNamespace, Field::PodName, Field::PodUid];

/// One of the templates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Template {
    id: u16,
    v6: bool,
    base: &'static [Field],
    /// With flowEndMilliseconds after `base` (a session's delete).
    end: bool,
    /// With the pod's identity last (sessions and port blocks).
    identity: bool,
}

impl Template {
    /// The template of an event of `kind` (`quota`: its quota kind) with
    /// these addresses.
    fn of(kind: LogKind, v6: bool, destinations: bool, quota: Option<u8>) -> Template {
        let session = |id: u16, end: bool| Template {
            id: id + u16::from(end),
            v6,
            base: if destinations { WITH_DESTINATION } else { WITHOUT_DESTINATION },
            end,
            identity: true,
        };
        let session_id = match (v6, destinations) {
            (false, true) => 256,
            (false, false) => 258,
            (true, true) => 260,
            (true, false) => 266,
        };
        match kind {
            LogKind::SessionCreate => session(session_id, false),
            LogKind::SessionDelete => session(session_id, true),
            LogKind::PortsExhausted => {
                Template { id: if v6 { 268 } else { 262 }, v6, base: PORTS_EXHAUSTED, end: false, identity: false }
            }
            LogKind::QuotaExceeded if quota == Some(quota::MAX_SESSION_ENTRIES) => {
                Template { id: 264, v6: false, base: QUOTA_SESSIONS, end: false, identity: false }
            }
            LogKind::QuotaExceeded => {
                Template { id: if v6 { 269 } else { 263 }, v6, base: QUOTA_PER_USER, end: false, identity: false }
            }
            LogKind::BlockAllocate | LogKind::BlockFree => {
                Template { id: if v6 { 270 } else { 265 }, v6, base: PORT_BLOCK, end: false, identity: true }
            }
        }
    }

    fn fields(self) -> impl Iterator<Item = Field> {
        let identity: &'static [Field] = if self.identity { IDENTITY } else { &[] };
        self.base.iter().copied().chain(self.end.then_some(Field::FlowEnd)).chain(identity.iter().copied())
    }

    /// The template record's length (§3.4.1: ID, count, 4 bytes per field,
    /// 4 more for an enterprise field's PEN).
    fn record_len(self) -> usize {
        4 + self.fields().map(|f| if f.enterprise_ie().is_some() { 8 } else { 4 }).sum::<usize>()
    }

    /// A data record's length without its variable-length fields.
    fn fixed_len(self) -> usize {
        self.fields().map(|f| usize::from(f.spec(self.v6).1)).sum()
    }

    /// A data record's length with `identity` (empty strings when `None`).
    fn data_len(self, identity: Option<&PodIdentity>) -> usize {
        if !self.identity {
            return self.fixed_len();
        }
        let strings = identity.map_or([0; 3], |id| [id.namespace.len(), id.name.len(), id.uid.len()]);
        self.fixed_len() + strings.iter().map(|&n| string_len(n)).sum::<usize>()
    }

    fn write_template(self, pen: u32, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.id.to_be_bytes());
        out.extend_from_slice(&(self.fields().count() as u16).to_be_bytes());
        for f in self.fields() {
            match f.enterprise_ie() {
                Some(id) => {
                    out.extend_from_slice(&(ENTERPRISE_BIT | id).to_be_bytes());
                    out.extend_from_slice(&VARIABLE_LENGTH.to_be_bytes());
                    out.extend_from_slice(&pen.to_be_bytes());
                }
                None => {
                    let (id, len) = f.spec(self.v6);
                    out.extend_from_slice(&id.to_be_bytes());
                    out.extend_from_slice(&len.to_be_bytes());
                }
            }
        }
    }

    /// Writes `e`'s data record, with `identity` in the identity fields
    /// (empty strings when `None`).
    fn write_data(self, e: &Event, identity: Option<&PodIdentity>, out: &mut Vec<u8>) {
        let (remote, remote_port) = e.remote.unwrap_or((unspecified(self.v6), 0));
        for f in self.fields() {
            match f {
                Field::ObservationTime => out.extend_from_slice(&e.at_ms.to_be_bytes()),
                Field::NatEvent => out.push(match e.kind {
                    LogKind::SessionCreate => nat_event::NAT44_SESSION_CREATE,
                    LogKind::SessionDelete => nat_event::NAT44_SESSION_DELETE,
                    LogKind::PortsExhausted => nat_event::NAT_PORTS_EXHAUSTED,
                    LogKind::QuotaExceeded => nat_event::QUOTA_EXCEEDED,
                    LogKind::BlockAllocate => nat_event::PORT_BLOCK_ALLOCATION,
                    LogKind::BlockFree => nat_event::PORT_BLOCK_DEALLOCATION,
                }),
                Field::PodAddress => write_ip(e.pod, out),
                Field::EgressAddress => write_ip(e.egress, out),
                Field::Protocol => out.push(e.proto),
                Field::PodPort => out.extend_from_slice(&e.pod_port.to_be_bytes()),
                Field::EgressPort => out.extend_from_slice(&e.egress_port.to_be_bytes()),
                Field::RemoteAddress | Field::PostNatRemoteAddress => write_ip(remote, out),
                Field::RemotePort | Field::PostNatRemotePort => out.extend_from_slice(&remote_port.to_be_bytes()),
                Field::FlowEnd => out.extend_from_slice(&e.last_ms.unwrap_or(e.at_ms).to_be_bytes()),
                Field::QuotaEvent => out.extend_from_slice(&u32::from(e.quota.unwrap_or(0)).to_be_bytes()),
                Field::MaxEntriesPerUser | Field::MaxSessionEntries => {
                    out.extend_from_slice(&e.limit.unwrap_or(0).to_be_bytes())
                }
                Field::PortRangeStart => out.extend_from_slice(&e.egress_port.to_be_bytes()),
                Field::PortRangeEnd => out.extend_from_slice(&e.block.map_or(0, |b| b.0).to_be_bytes()),
                Field::PortRangeStepSize => out.extend_from_slice(&1u16.to_be_bytes()),
                Field::PortRangeNumPorts => out.extend_from_slice(&e.block.map_or(0, |b| b.1).to_be_bytes()),
                Field::PodNamespace => write_string(identity.map_or("", |id| &id.namespace), out),
                Field::PodName => write_string(identity.map_or("", |id| &id.name), out),
                Field::PodUid => write_string(identity.map_or("", |id| &id.uid), out),
            }
        }
    }
}

fn unspecified(v6: bool) -> IpAddr {
    if v6 {
        IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
    }
}

/// The encoded length of a string of `n` bytes (RFC 7011 §7: one length
/// byte below 255, else 255 and two length bytes).
fn string_len(n: usize) -> usize {
    if n < 255 {
        1 + n
    } else {
        3 + n
    }
}

/// A variable-length string (RFC 7011 §7). The caller keeps it below
/// 65,536 bytes (a record must fit a message).
fn write_string(v: &str, out: &mut Vec<u8>) {
    let n = v.len();
    if n < 255 {
        out.push(n as u8);
    } else {
        out.push(255);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    }
    out.extend_from_slice(v.as_bytes());
}

fn write_ip(ip: IpAddr, out: &mut Vec<u8>) {
    match ip {
        IpAddr::V4(a) => out.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => out.extend_from_slice(&a.octets()),
    }
}

/// One encoded message and the data records it carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The bytes to send in one datagram.
    pub bytes: Vec<u8>,
    /// Data records in it (what is lost if it is).
    pub records: u32,
}

/// An exporter's encoding state for one observation domain.
#[derive(Debug)]
pub struct Encoder {
    domain: u32,
    mtu: usize,
    template_every_ms: u64,
    destinations: bool,
    /// The Private Enterprise Number of Egret's own IEs (`enterpriseNumber`).
    pen: u32,
    /// Data records encoded so far (RFC 7011 §3.1's sequence number).
    sequence: u32,
    /// When templates were last sent (wall ms); `None`: due now.
    templates_sent_ms: Option<u64>,
}

/// The smallest `mtu` an encoder accepts: a message with every template
/// (536 bytes) and one IPv6 delete record of an unknown pod (97) fits.
/// Kubernetes' own limits (namespace 63 bytes, name 253, UID 36) keep a
/// record with an identity below 470 bytes, so it fits a message of its
/// own; a longer identity (not seen from a real API server) is written as
/// empty strings rather than lose the record.
pub const MIN_MTU: usize = 640;

impl Encoder {
    /// An encoder for observation domain `domain`, messages of at most
    /// `mtu` bytes (at least [`MIN_MTU`]), templates every
    /// `template_every_ms`, the remote's address and port in the records
    /// when `destinations`, the pod's identity under enterprise number
    /// `pen`.
    pub fn new(domain: u32, mtu: usize, template_every_ms: u64, destinations: bool, pen: u32) -> Encoder {
        Encoder {
            domain,
            mtu: mtu.max(MIN_MTU),
            template_every_ms,
            destinations,
            pen,
            sequence: 0,
            templates_sent_ms: None,
        }
    }

    /// Data records encoded so far (the next message's sequence number).
    pub fn sequence(&self) -> u32 {
        self.sequence
    }

    /// Sends the templates again with the next message (after a send error:
    /// the collector may have restarted).
    pub fn resend_templates(&mut self) {
        self.templates_sent_ms = None;
    }

    /// The templates in use, in the order they are sent.
    fn templates(&self) -> [Template; 11] {
        let d = self.destinations;
        [
            Template::of(LogKind::SessionCreate, false, d, None),
            Template::of(LogKind::SessionDelete, false, d, None),
            Template::of(LogKind::SessionCreate, true, d, None),
            Template::of(LogKind::SessionDelete, true, d, None),
            Template::of(LogKind::PortsExhausted, false, d, None),
            Template::of(LogKind::QuotaExceeded, false, d, Some(quota::MAX_ENTRIES_PER_USER)),
            Template::of(LogKind::QuotaExceeded, false, d, Some(quota::MAX_SESSION_ENTRIES)),
            Template::of(LogKind::PortsExhausted, true, d, None),
            Template::of(LogKind::QuotaExceeded, true, d, Some(quota::MAX_ENTRIES_PER_USER)),
            Template::of(LogKind::BlockAllocate, false, d, None),
            Template::of(LogKind::BlockAllocate, true, d, None),
        ]
    }

    fn templates_due(&self, now_ms: u64) -> bool {
        self.templates_sent_ms.is_none_or(|t| now_ms.saturating_sub(t) >= self.template_every_ms)
    }

    /// Encodes `events` (in order) into messages appended to `out`, the
    /// templates first when due; `now_ms` (Unix ms) is the export time.
    /// With no events, a message is made only when templates are due and
    /// `templates_alone` is set (the periodic refresh of an idle exporter).
    pub fn encode(&mut self, now_ms: u64, events: &[Event], templates_alone: bool, out: &mut Vec<Message>) {
        let mut msg = Vec::with_capacity(self.mtu);
        let mut records = 0u32;
        let mut set: Option<(Template, usize)> = None;
        let mut with_templates = self.templates_due(now_ms) && (templates_alone || !events.is_empty());
        let mut i = 0;
        loop {
            if msg.is_empty() {
                self.start_message(now_ms, &mut msg);
                if with_templates {
                    self.write_templates(&mut msg);
                    self.templates_sent_ms = Some(now_ms);
                    with_templates = false;
                }
            }
            let Some(e) = events.get(i) else { break };
            let t = Template::of(e.kind, e.pod.is_ipv6(), self.destinations, e.quota);
            let open = set.filter(|(open, _)| *open == t);
            // An identity too long for a message of its own goes as empty
            // strings (see MIN_MTU).
            let identity = e
                .identity
                .as_deref()
                .filter(|id| MESSAGE_HEADER_LEN + SET_HEADER_LEN + t.data_len(Some(id)) <= self.mtu);
            let need = t.data_len(identity) + if open.is_some() { 0 } else { SET_HEADER_LEN };
            if msg.len() + need > self.mtu {
                if records == 0 && msg.len() <= MESSAGE_HEADER_LEN {
                    // Cannot happen above MIN_MTU; never loop forever.
                    i += 1;
                    continue;
                }
                self.finish(&mut msg, &mut set, &mut records, out);
                continue;
            }
            if open.is_none() {
                close_set(&mut msg, &mut set);
                set = Some((t, msg.len()));
                msg.extend_from_slice(&t.id.to_be_bytes());
                msg.extend_from_slice(&[0, 0]);
            }
            t.write_data(e, identity, &mut msg);
            records += 1;
            i += 1;
        }
        if records > 0 || msg.len() > MESSAGE_HEADER_LEN {
            self.finish(&mut msg, &mut set, &mut records, out);
        }
    }

    fn start_message(&self, now_ms: u64, msg: &mut Vec<u8>) {
        msg.extend_from_slice(&VERSION.to_be_bytes());
        msg.extend_from_slice(&[0, 0]); // length, set by `finish`
        msg.extend_from_slice(&((now_ms / 1000) as u32).to_be_bytes());
        msg.extend_from_slice(&self.sequence.to_be_bytes());
        msg.extend_from_slice(&self.domain.to_be_bytes());
    }

    fn write_templates(&self, msg: &mut Vec<u8>) {
        let len = SET_HEADER_LEN + self.templates().iter().map(|t| t.record_len()).sum::<usize>();
        msg.extend_from_slice(&TEMPLATE_SET_ID.to_be_bytes());
        msg.extend_from_slice(&(len as u16).to_be_bytes());
        for t in self.templates() {
            t.write_template(self.pen, msg);
        }
    }

    fn finish(
        &mut self,
        msg: &mut Vec<u8>,
        set: &mut Option<(Template, usize)>,
        records: &mut u32,
        out: &mut Vec<Message>,
    ) {
        close_set(msg, set);
        let len = msg.len() as u16;
        msg[2..4].copy_from_slice(&len.to_be_bytes());
        self.sequence = self.sequence.wrapping_add(*records);
        out.push(Message { bytes: std::mem::take(msg), records: *records });
        *records = 0;
    }
}

/// Writes the open data set's length.
fn close_set(msg: &mut [u8], set: &mut Option<(Template, usize)>) {
    if let Some((_, start)) = set.take() {
        let len = (msg.len() - start) as u16;
        msg[start + 2..start + 4].copy_from_slice(&len.to_be_bytes());
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::Arc;

    use egret_dataplane::translog::EndReason;

    use super::*;

    /// 2026-12-01T12:17:39.263Z, Unix ms.
    const T: u64 = 1_796_127_459_263;
    /// RFC 5612's documentation PEN, 0x7ed9.
    const PEN: u32 = 32473;

    /// Hex bytes, whitespace and `|` ignored (a field per group).
    fn hex(s: &str) -> Vec<u8> {
        let digits: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
        (0..digits.len()).step_by(2).map(|i| u8::from_str_radix(&digits[i..i + 2], 16).unwrap()).collect()
    }

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

    /// RFC 7011 §3.4.1's Template Record layout (Template ID, Field Count,
    /// then IE/length pairs, enterprise bit clear) for 256, 257, 260, 261,
    /// 262, 263, 264, 268, 269, 265, 270, written out field by field from
    /// IANA's IE numbers (466 = 0x1d2, 471 = 0x1d7, 473 = 0x1d9, 281 =
    /// 0x119, 361-364 = 0x169-0x16c).
    const TEMPLATES_WITH_DESTINATIONS: &str = "
        0002 0208
        0100 000e | 0143 0008 | 00e6 0001 | 0008 0004 | 00e1 0004 | 0004 0001 | 0007 0002 | 00e3 0002
                  | 000c 0004 | 00e2 0004 | 000b 0002 | 00e4 0002
                  | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
        0101 000f | 0143 0008 | 00e6 0001 | 0008 0004 | 00e1 0004 | 0004 0001 | 0007 0002 | 00e3 0002
                  | 000c 0004 | 00e2 0004 | 000b 0002 | 00e4 0002 | 0099 0008
                  | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
        0104 000e | 0143 0008 | 00e6 0001 | 001b 0010 | 0119 0010 | 0004 0001 | 0007 0002 | 00e3 0002
                  | 001c 0010 | 011a 0010 | 000b 0002 | 00e4 0002
                  | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
        0105 000f | 0143 0008 | 00e6 0001 | 001b 0010 | 0119 0010 | 0004 0001 | 0007 0002 | 00e3 0002
                  | 001c 0010 | 011a 0010 | 000b 0002 | 00e4 0002 | 0099 0008
                  | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
        0106 0003 | 0143 0008 | 00e6 0001 | 00e1 0004
        0107 0005 | 0143 0008 | 00e6 0001 | 01d2 0004 | 01d9 0004 | 0008 0004
        0108 0004 | 0143 0008 | 00e6 0001 | 01d2 0004 | 01d7 0004
        010c 0003 | 0143 0008 | 00e6 0001 | 0119 0010
        010d 0005 | 0143 0008 | 00e6 0001 | 01d2 0004 | 01d9 0004 | 001b 0010
        0109 000b | 0143 0008 | 00e6 0001 | 0008 0004 | 00e1 0004 | 0169 0002 | 016a 0002 | 016b 0002 | 016c 0002
                  | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
        010e 000b | 0143 0008 | 00e6 0001 | 001b 0010 | 0119 0010 | 0169 0002 | 016a 0002 | 016b 0002 | 016c 0002
                  | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9";

    /// ADR 0034 §5's pod.
    fn example_pod() -> Arc<PodIdentity> {
        Arc::new(PodIdentity {
            namespace: "payments".into(),
            name: "api-7d9f8-abcde".into(),
            uid: "0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21".into(),
        })
    }

    /// The first message: header (§3.1), the Template Set, one Data Set of
    /// template 256 holding the create of ADR 0034's example session, its
    /// pod's identity in Egret's three enterprise IEs (RFC 7011 §7: a
    /// length byte, then the UTF-8 bytes).
    #[test]
    fn the_first_message_carries_the_templates_and_the_record() {
        let mut enc = Encoder::new(7, 1400, 60_000, true, PEN);
        let mut out = Vec::new();
        let mut e = event(LogKind::SessionCreate);
        e.identity = Some(example_pod());
        enc.encode(T, &[e], true, &mut out);
        assert_eq!(out.len(), 1);
        let want = [
            // version 10 | length 16 + 520 + 100 = 636 | export time 1796127459 s | sequence 0 | domain 7
            hex("000a 027c | 6b0ebae3 | 00000000 | 00000007"),
            hex(TEMPLATES_WITH_DESTINATIONS),
            // set 256, 4 + 96 bytes; 323: T | 230: 4 | 8: 10.244.1.7 | 225: 203.0.113.10 | 4: 6
            // | 7: 40001 | 227: 41522 | 12: 198.51.100.20 | 226: the same | 11: 443 | 228: 443
            hex("0100 0064 | 000001a2318a07bf | 04 | 0af40107 | cb00710a | 06 | 9c41 | a232 | c6336414 | c6336414 | 01bb | 01bb"),
            // podNamespace "payments" | podName "api-7d9f8-abcde" | podUID
            hex("08 7061796d656e7473 | 0f 6170692d37643966382d6162636465
                | 24 30623663336138652d316632642d346335622d396138652d376636643563346233613231"),
        ]
        .concat();
        assert_eq!(out[0].bytes, want);
        assert_eq!(out[0].records, 1);
        assert_eq!(enc.sequence(), 1);
    }

    /// Later messages: no templates until the refresh is due; the sequence
    /// number counts data records before the message (RFC 7011 §3.1).
    #[test]
    fn templates_come_again_after_their_period_and_sequence_numbers_count_records() {
        let mut enc = Encoder::new(7, 1400, 60_000, true, PEN);
        let mut out = Vec::new();
        let two = [event(LogKind::SessionCreate), event(LogKind::SessionCreate)];
        enc.encode(T, &two, true, &mut out);
        out.clear();
        enc.encode(T + 1_000, &[event(LogKind::SessionDelete)], true, &mut out);
        assert_eq!(out.len(), 1);
        let want = [
            // length 16 + 49 = 65 | export time 1796127460 | sequence 2 | domain 7
            hex("000a 0041 | 6b0ebae4 | 00000002 | 00000007"),
            // set 257, 4 + 45: ... and 153: the last packet, T - 2263 ms, then a pod
            // not known: three empty strings
            hex("0101 0031 | 000001a2318a07bf | 05 | 0af40107 | cb00710a | 06 | 9c41 | a232 | c6336414 | c6336414 | 01bb | 01bb | 000001a23189fee8 | 00 | 00 | 00"),
        ]
        .concat();
        assert_eq!(out[0].bytes, want);
        assert_eq!(enc.sequence(), 3);
        // Idle, before the period: nothing. After: templates alone.
        out.clear();
        enc.encode(T + 30_000, &[], true, &mut out);
        assert!(out.is_empty());
        enc.encode(T + 60_000, &[], true, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].records, 0);
        assert_eq!(&out[0].bytes[16..], hex(TEMPLATES_WITH_DESTINATIONS).as_slice());
        assert_eq!(&out[0].bytes[8..12], &3u32.to_be_bytes(), "templates do not count");
        // After a send error: with the next message.
        out.clear();
        enc.resend_templates();
        enc.encode(T + 61_000, &[event(LogKind::SessionCreate)], false, &mut out);
        assert_eq!(out[0].bytes[16..18], [0, 2]);
    }

    /// `logDestinations: false`: templates 258/259 (and 266/267) have no
    /// destination fields, and the records carry none.
    #[test]
    fn without_destinations_the_records_have_no_remote() {
        let mut enc = Encoder::new(7, 1400, 60_000, false, PEN);
        let mut out = Vec::new();
        enc.encode(T, &[event(LogKind::SessionCreate)], true, &mut out);
        let m = &out[0].bytes;
        let templates = hex("
            0002 01c8
            0102 000a | 0143 0008 | 00e6 0001 | 0008 0004 | 00e1 0004 | 0004 0001 | 0007 0002 | 00e3 0002
                      | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
            0103 000b | 0143 0008 | 00e6 0001 | 0008 0004 | 00e1 0004 | 0004 0001 | 0007 0002 | 00e3 0002 | 0099 0008
                      | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
            010a 000a | 0143 0008 | 00e6 0001 | 001b 0010 | 0119 0010 | 0004 0001 | 0007 0002 | 00e3 0002
                      | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
            010b 000b | 0143 0008 | 00e6 0001 | 001b 0010 | 0119 0010 | 0004 0001 | 0007 0002 | 00e3 0002 | 0099 0008
                      | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
            0106 0003 | 0143 0008 | 00e6 0001 | 00e1 0004
            0107 0005 | 0143 0008 | 00e6 0001 | 01d2 0004 | 01d9 0004 | 0008 0004
            0108 0004 | 0143 0008 | 00e6 0001 | 01d2 0004 | 01d7 0004
            010c 0003 | 0143 0008 | 00e6 0001 | 0119 0010
            010d 0005 | 0143 0008 | 00e6 0001 | 01d2 0004 | 01d9 0004 | 001b 0010
            0109 000b | 0143 0008 | 00e6 0001 | 0008 0004 | 00e1 0004 | 0169 0002 | 016a 0002 | 016b 0002 | 016c 0002
                      | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9
            010e 000b | 0143 0008 | 00e6 0001 | 001b 0010 | 0119 0010 | 0169 0002 | 016a 0002 | 016b 0002 | 016c 0002
                      | 8001 ffff 00007ed9 | 8002 ffff 00007ed9 | 8003 ffff 00007ed9");
        assert_eq!(&m[16..16 + templates.len()], templates.as_slice());
        let data = hex("0102 001d | 000001a2318a07bf | 04 | 0af40107 | cb00710a | 06 | 9c41 | a232 | 00 | 00 | 00");
        assert_eq!(&m[16 + templates.len()..], data.as_slice());
        assert!(!m.windows(4).any(|w| w == [198, 51, 100, 20]));
    }

    /// IPv6 sessions use 260/261 with 16-byte addresses.
    #[test]
    fn ipv6_records_use_their_own_templates() {
        let mut enc = Encoder::new(7, 1400, 60_000, true, PEN);
        enc.resend_templates();
        let mut e = event(LogKind::SessionCreate);
        e.pod = "2001:db8:18::10".parse().unwrap();
        e.egress = "2001:db8:113::10".parse().unwrap();
        e.remote = Some(("2001:db8:51::7".parse().unwrap(), 443));
        let mut out = Vec::new();
        enc.encode(T, &[event(LogKind::SessionCreate)], true, &mut out);
        out.clear();
        enc.encode(T, &[e], true, &mut out);
        let want = hex(
            "0104 0059 | 000001a2318a07bf | 04 | 20010db8001800000000000000000010 | 20010db8011300000000000000000010
            | 06 | 9c41 | a232 | 20010db8005100000000000000000007 | 20010db8005100000000000000000007 | 01bb | 01bb
            | 00 | 00 | 00",
        );
        assert_eq!(&out[0].bytes[16..], want.as_slice());
    }

    /// RFC 8158's refusal events: natEvent 12 with the egress address,
    /// 13 with the quota kind (natQuotaExceededEvent) and the limit.
    #[test]
    fn refusals_use_their_templates() {
        let mut enc = Encoder::new(7, 1400, 60_000, true, PEN);
        let mut out = Vec::new();
        enc.encode(T, &[event(LogKind::SessionCreate)], true, &mut out);
        let refusal = |kind, quota: Option<u8>, limit| Event {
            kind,
            at_ms: T,
            proto: 0,
            pod: Ipv4Addr::new(10, 244, 1, 7).into(),
            pod_port: 0,
            egress: Ipv4Addr::new(203, 0, 113, 10).into(),
            egress_port: 0,
            remote: None,
            last_ms: None,
            reason: None,
            flags: 0,
            quota,
            limit: Some(limit),
            block: None,
            identity: None,
        };
        out.clear();
        enc.encode(
            T,
            &[
                refusal(LogKind::PortsExhausted, None, 28232),
                refusal(LogKind::QuotaExceeded, Some(quota::MAX_ENTRIES_PER_USER), 64),
                refusal(LogKind::QuotaExceeded, Some(quota::MAX_SESSION_ENTRIES), 1_000_000),
            ],
            true,
            &mut out,
        );
        let want = hex("
            0106 0011 | 000001a2318a07bf | 0c | cb00710a
            0107 0019 | 000001a2318a07bf | 0d | 00000003 | 00000040 | 0af40107
            0108 0015 | 000001a2318a07bf | 0d | 00000001 | 000f4240");
        assert_eq!(&out[0].bytes[16..], want.as_slice());
        assert_eq!(out[0].records, 3);
    }

    /// No message exceeds the MTU; a batch is split, every record once, and
    /// the sequence numbers follow on.
    #[test]
    fn messages_stay_within_the_mtu() {
        let mut enc = Encoder::new(7, 700, 60_000, true, PEN);
        let events: Vec<Event> =
            (0..40).map(|i| event(if i % 3 == 0 { LogKind::SessionDelete } else { LogKind::SessionCreate })).collect();
        let mut out = Vec::new();
        enc.encode(T, &events, true, &mut out);
        assert!(out.len() > 1);
        let mut seq = 0u32;
        for m in &out {
            assert!(m.bytes.len() <= 700, "{}", m.bytes.len());
            assert_eq!(usize::from(u16::from_be_bytes([m.bytes[2], m.bytes[3]])), m.bytes.len());
            assert_eq!(u32::from_be_bytes([m.bytes[8], m.bytes[9], m.bytes[10], m.bytes[11]]), seq);
            seq += m.records;
        }
        assert_eq!(seq, 40);
        assert_eq!(enc.sequence(), 40);
    }

    /// A field's element: (enterprise number, IE), 0 for IANA's.
    type Element = (u32, u16);
    /// A data record's (element, bytes) pairs.
    type Fields = Vec<(Element, Vec<u8>)>;

    /// A minimal IPFIX reader (RFC 7011 §3): templates from Template Sets
    /// (a field with the enterprise bit has its PEN after the length,
    /// §3.2), then each data record as (element, bytes) pairs in template
    /// order, a variable-length field (length 65535) read by §7 (a length
    /// byte, or 255 and two length bytes). What the tests read port blocks
    /// (nfdump 1.7.1 drops 361-364) and the pod's identity with.
    fn decode(messages: &[Message]) -> Vec<(u16, Fields)> {
        let be16 = |b: &[u8], o: usize| u16::from_be_bytes([b[o], b[o + 1]]);
        let be32 = |b: &[u8], o: usize| u32::from_be_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let mut templates: std::collections::HashMap<u16, Vec<(Element, u16)>> = Default::default();
        let mut records = Vec::new();
        for m in messages {
            let b = &m.bytes;
            assert_eq!((be16(b, 0), usize::from(be16(b, 2))), (VERSION, b.len()));
            let mut at = MESSAGE_HEADER_LEN;
            while at < b.len() {
                let (id, len) = (be16(b, at), usize::from(be16(b, at + 2)));
                let set = &b[at + SET_HEADER_LEN..at + len];
                let mut o = 0;
                if id == TEMPLATE_SET_ID {
                    while o < set.len() {
                        let (tid, n) = (be16(set, o), be16(set, o + 2));
                        o += 4;
                        let mut fields = Vec::new();
                        for _ in 0..n {
                            let (ie, l) = (be16(set, o), be16(set, o + 2));
                            o += 4;
                            if ie & ENTERPRISE_BIT != 0 {
                                fields.push(((be32(set, o), ie & !ENTERPRISE_BIT), l));
                                o += 4;
                            } else {
                                fields.push(((0, ie), l));
                            }
                        }
                        templates.insert(tid, fields);
                    }
                } else {
                    let fields = &templates[&id];
                    // Padding (§3.3.1) is shorter than any record here.
                    while o + 4 < set.len() {
                        let mut r = Vec::new();
                        for (el, l) in fields {
                            let mut n = usize::from(*l);
                            if *l == VARIABLE_LENGTH {
                                n = usize::from(set[o]);
                                o += 1;
                                if n == 255 {
                                    n = usize::from(be16(set, o));
                                    o += 2;
                                }
                            }
                            r.push((*el, set[o..o + n].to_vec()));
                            o += n;
                        }
                        records.push((id, r));
                    }
                    assert_eq!(o, set.len(), "set {id}: records end where the set does");
                }
                at += len;
            }
        }
        records
    }

    /// An IANA element's bytes.
    fn get(r: &[(Element, Vec<u8>)], ie: u16) -> Vec<u8> {
        r.iter().find(|f| f.0 == (0, ie)).map(|f| f.1.clone()).unwrap()
    }

    /// The identity a record carries, as (namespace, name, uid), read from
    /// Egret's enterprise elements under `pen`.
    fn identity_of(r: &[(Element, Vec<u8>)], pen: u32) -> (String, String, String) {
        let s = |ie| String::from_utf8(r.iter().find(|f| f.0 == (pen, ie)).unwrap().1.clone()).unwrap();
        (s(egret_ie::POD_NAMESPACE), s(egret_ie::POD_NAME), s(egret_ie::POD_UID))
    }

    /// Every session and block record carries the pod's identity under
    /// the configured enterprise number, read back by the decoder; a pod
    /// not known has empty strings; a string of 255 bytes or more takes
    /// §7's three-byte length; an identity too long for a message of its
    /// own is written empty rather than lose the record; refusals have
    /// none.
    #[test]
    fn the_pods_identity_travels_in_enterprise_elements() {
        let pen = 4_200_000_001;
        let mut enc = Encoder::new(7, 1400, 60_000, true, pen);
        let long = Arc::new(PodIdentity { namespace: "ns".into(), name: "n".repeat(300), uid: "u".into() });
        let huge = Arc::new(PodIdentity { namespace: "x".repeat(1500), name: "n".into(), uid: "u".into() });
        let with = |mut e: Event, id: Option<&Arc<PodIdentity>>| {
            e.identity = id.cloned();
            e
        };
        let pod4: IpAddr = Ipv4Addr::new(10, 244, 1, 7).into();
        let egress4: IpAddr = Ipv4Addr::new(203, 0, 113, 10).into();
        let mut v6 = event(LogKind::SessionDelete);
        v6.pod = "2001:db8:18::10".parse().unwrap();
        v6.egress = "2001:db8:113::10".parse().unwrap();
        v6.remote = Some(("2001:db8:51::7".parse().unwrap(), 443));
        let mut quota_event = event(LogKind::QuotaExceeded);
        quota_event.quota = Some(quota::MAX_ENTRIES_PER_USER);
        let events = [
            with(event(LogKind::SessionCreate), Some(&example_pod())),
            with(event(LogKind::SessionDelete), None),
            with(v6, Some(&example_pod())),
            with(block(LogKind::BlockAllocate, pod4, egress4, 40960, 128), Some(&long)),
            with(event(LogKind::SessionCreate), Some(&huge)),
            with(quota_event, Some(&example_pod())),
        ];
        let mut out = Vec::new();
        enc.encode(T, &events, true, &mut out);
        let recs = decode(&out);
        let ids: Vec<u16> = recs.iter().map(|r| r.0).collect();
        assert_eq!(ids, [256, 257, 261, 265, 256, 263]);
        let example =
            ("payments".to_string(), "api-7d9f8-abcde".to_string(), "0b6c3a8e-1f2d-4c5b-9a8e-7f6d5c4b3a21".to_string());
        let empty = (String::new(), String::new(), String::new());
        assert_eq!(identity_of(&recs[0].1, pen), example);
        assert_eq!(get(&recs[0].1, ie::POST_NAPT_SOURCE_PORT), 41522u16.to_be_bytes());
        assert_eq!(identity_of(&recs[1].1, pen), empty);
        assert_eq!(get(&recs[1].1, ie::FLOW_END_MS), (T - 2_263).to_be_bytes());
        assert_eq!(identity_of(&recs[2].1, pen), example);
        assert_eq!(identity_of(&recs[3].1, pen), ("ns".into(), "n".repeat(300), "u".into()));
        assert!(out.iter().any(|m| m.bytes.windows(3).any(|w| w == [255, 1, 44])), "300 = 255, then 0x012c");
        assert_eq!(identity_of(&recs[4].1, pen), empty);
        assert_eq!(get(&recs[4].1, ie::SOURCE_IPV4), [10, 244, 1, 7]);
        assert!(recs[5].1.iter().all(|f| f.0 .0 == 0), "refusals carry no identity");
        assert!(out.iter().all(|m| m.bytes.len() <= 1400));
    }

    fn block(kind: LogKind, pod: IpAddr, egress: IpAddr, start: u16, size: u16) -> Event {
        Event {
            kind,
            at_ms: T,
            proto: 0,
            pod,
            pod_port: 0,
            egress,
            egress_port: start,
            remote: None,
            last_ms: None,
            reason: None,
            flags: 0,
            quota: None,
            limit: None,
            block: Some((start + size - 1, size)),
            identity: None,
        }
    }

    /// RFC 8158's port block events 16 and 17 (ADR 0034 §6): templates 265
    /// and 270, read back through the decoder above, and 265's bytes.
    #[test]
    fn port_blocks_carry_their_range() {
        let mut enc = Encoder::new(7, 1400, 60_000, true, PEN);
        let pod4: IpAddr = Ipv4Addr::new(10, 244, 1, 7).into();
        let egress4: IpAddr = Ipv4Addr::new(203, 0, 113, 10).into();
        let pod6: IpAddr = "2001:db8:18::10".parse().unwrap();
        let egress6: IpAddr = "2001:db8:113::10".parse().unwrap();
        let events = [
            block(LogKind::BlockAllocate, pod4, egress4, 40960, 128),
            event(LogKind::SessionCreate),
            block(LogKind::BlockFree, pod4, egress4, 40960, 128),
            block(LogKind::BlockAllocate, pod6, egress6, 1024, 8),
        ];
        let mut out = Vec::new();
        enc.encode(T, &events, true, &mut out);
        let recs = decode(&out);
        assert_eq!(recs.len(), 4);
        let (id, r) = &recs[0];
        assert_eq!(*id, 265);
        assert_eq!(get(r, ie::NAT_EVENT), [16]);
        assert_eq!(get(r, ie::SOURCE_IPV4), [10, 244, 1, 7]);
        assert_eq!(get(r, ie::POST_NAT_SOURCE_IPV4), [203, 0, 113, 10]);
        assert_eq!(get(r, ie::PORT_RANGE_START), 40960u16.to_be_bytes());
        assert_eq!(get(r, ie::PORT_RANGE_END), 41087u16.to_be_bytes());
        assert_eq!(get(r, ie::PORT_RANGE_STEP_SIZE), 1u16.to_be_bytes());
        assert_eq!(get(r, ie::PORT_RANGE_NUM_PORTS), 128u16.to_be_bytes());
        assert_eq!(get(r, ie::OBSERVATION_TIME_MS), T.to_be_bytes());
        assert_eq!(recs[1].0, 256);
        assert_eq!((recs[2].0, get(&recs[2].1, ie::NAT_EVENT)), (265, vec![17]));
        let (id, r) = &recs[3];
        assert_eq!((*id, get(r, ie::NAT_EVENT)), (270, vec![16]));
        assert_eq!(get(r, ie::SOURCE_IPV6), "2001:db8:18::10".parse::<std::net::Ipv6Addr>().unwrap().octets());
        assert_eq!(
            get(r, ie::POST_NAT_SOURCE_IPV6),
            "2001:db8:113::10".parse::<std::net::Ipv6Addr>().unwrap().octets()
        );
        assert_eq!((get(r, ie::PORT_RANGE_START), get(r, ie::PORT_RANGE_END)), (vec![4, 0], vec![4, 7]));
        // 265's data set, byte by byte: 323 | 230 | 8 | 225 | 361 | 362 | 363 | 364.
        out.clear();
        enc.encode(T, &events[2..3], true, &mut out);
        let want =
            hex("0109 0020 | 000001a2318a07bf | 11 | 0af40107 | cb00710a | a000 | a07f | 0001 | 0080 | 00 | 00 | 00");
        assert_eq!(&out[0].bytes[16..], want.as_slice());
    }
}
