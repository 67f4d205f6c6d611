//! Session sync between gateways (issue 16 §2): the records a holder sends
//! its standby, their wire encoding, and the change journal the workers feed.
//!
//! The control plane replicates each egress IP's sessions from the gateway
//! holding it to the next candidate, incrementally (the journal, drained
//! every few milliseconds) with a periodic full resync (an export of every
//! session on the IP), the scheme of conntrackd's FTFW and VPP's NAT HA
//! (docs/architecture.md, "Session sync"). The standby keeps the records
//! aside and installs them with exactly their egress ports when it takes
//! the IP over ([`NatTable::import`](super::table::NatTable::import)).
//!
//! - [`SessionRecord`] / [`SessionKeyRecord`]: one session, or the key of one
//!   that ended, independent of the address family. A record carries how
//!   long the session has been idle, never a timestamp: the engines' clocks
//!   start when each process starts.
//! - Encoding: a fixed layout per record, big-endian, led by a version byte
//!   and a kind byte; 36 bytes for an IPv4 session, 72 for IPv6, 21/57 for a
//!   removal. Decoding never panics: malformed input is an error naming what
//!   is wrong.
//! - [`SyncJournal`]: a bounded lock-free queue of what changed. Workers push
//!   and never wait; a full queue counts an overflow, which tells the
//!   control plane that the standby missed something and needs a full
//!   resync. Events name a slot (creation, or a TCP phase change) or a
//!   tuple (removal); the slot is
//!   read when the control plane drains it, so it sees the session as it is
//!   then.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam::queue::ArrayQueue;

use super::key::{proto, NatAddr, SessionTuple};
use super::session::session_flags;

/// The encoding's version (the first byte of every record).
pub const VERSION: u8 = 1;

/// Kind bit: the addresses are IPv6.
const KIND_V6: u8 = 0x1;
/// Kind bit: a removal (key only), not a session.
const KIND_REMOVE: u8 = 0x2;
/// Flags a record may carry.
const KNOWN_FLAGS: u16 = session_flags::INBOUND_CREATED | session_flags::HAS_MAPPING | session_flags::HAIRPIN;

/// Version, kind, protocol.
const HEADER: usize = 3;
/// TCP bits, tracking word, flags, idle seconds.
const SESSION_TAIL: usize = 1 + 8 + 2 + 4;

/// Encoded size of a removal record of the family with `addr_len`-byte addresses.
const fn key_len(addr_len: usize) -> usize {
    HEADER + 3 * addr_len + 3 * 2
}

/// Encoded size of an IPv4 session record.
pub const SESSION_RECORD_V4_LEN: usize = key_len(4) + SESSION_TAIL;
/// Encoded size of an IPv6 session record.
pub const SESSION_RECORD_V6_LEN: usize = key_len(16) + SESSION_TAIL;
/// Encoded size of an IPv4 removal record.
pub const KEY_RECORD_V4_LEN: usize = key_len(4);
/// Encoded size of an IPv6 removal record.
pub const KEY_RECORD_V6_LEN: usize = key_len(16);

/// One session as a holder sends it to its standby.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionRecord {
    /// The protocol.
    pub proto: u8,
    /// The pod.
    pub pod: IpAddr,
    /// The pod's port (ICMP: identifier).
    pub pod_port: u16,
    /// The remote end.
    pub remote: IpAddr,
    /// The remote's port (ICMP: 0).
    pub remote_port: u16,
    /// The egress IP.
    pub egress: IpAddr,
    /// The external port (ICMP: identifier) the session uses on `egress`.
    pub egress_port: u16,
    /// TCP seen bits (`tcp_state::seen`).
    pub tcp: u8,
    /// TCP tracking word (`tcp_state::track`: the pod's latest
    /// acknowledgment and window, both window scales).
    pub tcp_track: u64,
    /// Session flags ([`session_flags`]).
    pub flags: u16,
    /// Seconds since the session's last packet on the sender (its clock
    /// and the receiver's differ: ages travel, never timestamps).
    pub idle_secs: u32,
}

/// The key of a session that ended: its outbound key and external port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionKeyRecord {
    /// The protocol.
    pub proto: u8,
    /// The pod.
    pub pod: IpAddr,
    /// The pod's port.
    pub pod_port: u16,
    /// The remote end.
    pub remote: IpAddr,
    /// The remote's port.
    pub remote_port: u16,
    /// The egress IP.
    pub egress: IpAddr,
    /// The external port.
    pub egress_port: u16,
}

/// What changed, as the control plane drains it from the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncEvent {
    /// A session was created (or imported), as it is when drained.
    Upsert(SessionRecord),
    /// A session ended; no live session holds its outbound key when drained.
    Remove(SessionKeyRecord),
}

/// Why a buffer is not a valid record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SyncDecodeError {
    /// The buffer ends inside the record.
    #[error("session sync record truncated: {need} bytes needed, {have} available")]
    Truncated {
        /// Bytes the record needs.
        need: usize,
        /// Bytes the buffer holds.
        have: usize,
    },
    /// The record was written by an encoding this build does not read.
    #[error("session sync record version {0} is not supported (this build reads version {VERSION})")]
    Version(u8),
    /// The kind byte has bits no version-1 record sets.
    #[error("session sync record kind {0:#04x} is unknown")]
    Kind(u8),
    /// A protocol the NAT does not translate in that family.
    #[error("session sync record for IP protocol {proto} over IPv{family} is not supported")]
    Protocol {
        /// The protocol byte.
        proto: u8,
        /// 4 or 6.
        family: u8,
    },
    /// Flag bits no session carries.
    #[error("session sync record has unknown session flags {0:#06x}")]
    Flags(u16),
    /// A removal where a session was expected, or the reverse.
    #[error("session sync record is a {found}, expected a {expected}")]
    WrongKind {
        /// What the caller asked for.
        expected: &'static str,
        /// What the buffer holds.
        found: &'static str,
    },
}

/// A family-generic view of the seven key fields, shared by both records.
struct Key {
    proto: u8,
    pod: IpAddr,
    pod_port: u16,
    remote: IpAddr,
    remote_port: u16,
    egress: IpAddr,
    egress_port: u16,
}

fn v6_of(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    }
}

fn v4_of(ip: IpAddr) -> Ipv4Addr {
    match ip {
        IpAddr::V4(a) => a,
        // Unreachable for records made by the engine (one family per
        // tuple): encoded as IPv6 below, so this is never called for them.
        IpAddr::V6(a) => a.to_ipv4_mapped().unwrap_or(Ipv4Addr::UNSPECIFIED),
    }
}

impl Key {
    /// Writes the header and the key fields. The family is IPv4 only when all
    /// three addresses are (a record mixing families, which the engine never
    /// makes, is written as IPv6 with its IPv4 addresses mapped, and is then
    /// rejected on import as no policy holds it).
    fn encode(&self, removal: bool, out: &mut Vec<u8>) {
        let v6 = [self.pod, self.remote, self.egress].iter().any(IpAddr::is_ipv6);
        let kind = if v6 { KIND_V6 } else { 0 } | if removal { KIND_REMOVE } else { 0 };
        out.extend_from_slice(&[VERSION, kind, self.proto]);
        for a in [self.pod, self.remote, self.egress] {
            if v6 {
                out.extend_from_slice(&v6_of(a).octets());
            } else {
                out.extend_from_slice(&v4_of(a).octets());
            }
        }
        for p in [self.pod_port, self.remote_port, self.egress_port] {
            out.extend_from_slice(&p.to_be_bytes());
        }
    }

    /// Reads the header and the key fields: the key, whether it is a
    /// removal, and the bytes read.
    fn decode(buf: &[u8]) -> Result<(Key, bool, usize), SyncDecodeError> {
        let header = buf.get(..HEADER).ok_or(SyncDecodeError::Truncated { need: HEADER, have: buf.len() })?;
        let (version, kind, proto) = (header[0], header[1], header[2]);
        if version != VERSION {
            return Err(SyncDecodeError::Version(version));
        }
        if kind & !(KIND_V6 | KIND_REMOVE) != 0 {
            return Err(SyncDecodeError::Kind(kind));
        }
        let v6 = kind & KIND_V6 != 0;
        let removal = kind & KIND_REMOVE != 0;
        let alen = if v6 { 16 } else { 4 };
        let need = key_len(alen) + if removal { 0 } else { SESSION_TAIL };
        if buf.len() < need {
            return Err(SyncDecodeError::Truncated { need, have: buf.len() });
        }
        let allowed = match proto {
            proto::TCP | proto::UDP => true,
            proto::ICMP => !v6,
            proto::ICMPV6 => v6,
            _ => false,
        };
        if !allowed {
            return Err(SyncDecodeError::Protocol { proto, family: if v6 { 6 } else { 4 } });
        }
        let addr = |i: usize| -> IpAddr {
            let b = &buf[HEADER + i * alen..HEADER + (i + 1) * alen];
            if v6 {
                let mut o = [0u8; 16];
                o.copy_from_slice(b);
                IpAddr::V6(Ipv6Addr::from(o))
            } else {
                IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3]))
            }
        };
        let ports = HEADER + 3 * alen;
        let port = |i: usize| u16::from_be_bytes([buf[ports + 2 * i], buf[ports + 2 * i + 1]]);
        let key = Key {
            proto,
            pod: addr(0),
            remote: addr(1),
            egress: addr(2),
            pod_port: port(0),
            remote_port: port(1),
            egress_port: port(2),
        };
        Ok((key, removal, key_len(alen)))
    }
}

impl SessionRecord {
    /// The record of `tuple` with the given state.
    pub fn from_tuple<A: NatAddr>(
        tuple: &SessionTuple<A>,
        tcp: u8,
        tcp_track: u64,
        flags: u16,
        idle_secs: u32,
    ) -> Self {
        SessionRecord {
            proto: tuple.proto,
            pod: tuple.pod.ip(),
            pod_port: tuple.pod_port,
            remote: tuple.remote.ip(),
            remote_port: tuple.remote_port,
            egress: tuple.egress.ip(),
            egress_port: tuple.egress_port,
            tcp,
            tcp_track,
            flags,
            idle_secs,
        }
    }

    /// The session's tuple in family `A`, or `None` when an address is of
    /// the other family.
    pub fn tuple<A: NatAddr>(&self) -> Option<SessionTuple<A>> {
        self.key().tuple()
    }

    /// The key of this session (what a removal names, and what a standby
    /// indexes its records by).
    pub fn key(&self) -> SessionKeyRecord {
        SessionKeyRecord {
            proto: self.proto,
            pod: self.pod,
            pod_port: self.pod_port,
            remote: self.remote,
            remote_port: self.remote_port,
            egress: self.egress,
            egress_port: self.egress_port,
        }
    }

    /// Appends the encoded record to `out`
    /// ([`SESSION_RECORD_V4_LEN`] or [`SESSION_RECORD_V6_LEN`] bytes).
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.key().as_key().encode(false, out);
        out.push(self.tcp);
        out.extend_from_slice(&self.tcp_track.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.idle_secs.to_be_bytes());
    }

    /// Decodes one session record from the start of `buf`: the record and
    /// the bytes it took.
    pub fn decode(buf: &[u8]) -> Result<(SessionRecord, usize), SyncDecodeError> {
        match SyncEvent::decode(buf)? {
            (SyncEvent::Upsert(r), n) => Ok((r, n)),
            (SyncEvent::Remove(_), _) => Err(SyncDecodeError::WrongKind { expected: "session", found: "removal" }),
        }
    }
}

impl SessionKeyRecord {
    fn as_key(&self) -> Key {
        Key {
            proto: self.proto,
            pod: self.pod,
            pod_port: self.pod_port,
            remote: self.remote,
            remote_port: self.remote_port,
            egress: self.egress,
            egress_port: self.egress_port,
        }
    }

    /// The key of `tuple`.
    pub fn from_tuple<A: NatAddr>(t: &SessionTuple<A>) -> Self {
        SessionKeyRecord {
            proto: t.proto,
            pod: t.pod.ip(),
            pod_port: t.pod_port,
            remote: t.remote.ip(),
            remote_port: t.remote_port,
            egress: t.egress.ip(),
            egress_port: t.egress_port,
        }
    }

    /// The tuple in family `A`, or `None` when an address is of the other family.
    pub fn tuple<A: NatAddr>(&self) -> Option<SessionTuple<A>> {
        Some(SessionTuple {
            pod: A::from_ip(self.pod)?,
            remote: A::from_ip(self.remote)?,
            egress: A::from_ip(self.egress)?,
            pod_port: self.pod_port,
            remote_port: self.remote_port,
            egress_port: self.egress_port,
            proto: self.proto,
        })
    }

    /// Appends the encoded removal to `out`
    /// ([`KEY_RECORD_V4_LEN`] or [`KEY_RECORD_V6_LEN`] bytes).
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.as_key().encode(true, out);
    }

    /// Decodes one removal record from the start of `buf`.
    pub fn decode(buf: &[u8]) -> Result<(SessionKeyRecord, usize), SyncDecodeError> {
        match SyncEvent::decode(buf)? {
            (SyncEvent::Remove(k), n) => Ok((k, n)),
            (SyncEvent::Upsert(_), _) => Err(SyncDecodeError::WrongKind { expected: "removal", found: "session" }),
        }
    }
}

impl SyncEvent {
    /// Appends the encoded event to `out` (a session or a removal record).
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            SyncEvent::Upsert(r) => r.encode(out),
            SyncEvent::Remove(k) => k.encode(out),
        }
    }

    /// Decodes one record, of either kind, from the start of `buf`: the
    /// event and the bytes it took (a stream of records is decoded by
    /// advancing past them).
    pub fn decode(buf: &[u8]) -> Result<(SyncEvent, usize), SyncDecodeError> {
        let (k, removal, mut at) = Key::decode(buf)?;
        let key = SessionKeyRecord {
            proto: k.proto,
            pod: k.pod,
            pod_port: k.pod_port,
            remote: k.remote,
            remote_port: k.remote_port,
            egress: k.egress,
            egress_port: k.egress_port,
        };
        if removal {
            return Ok((SyncEvent::Remove(key), at));
        }
        // Key::decode checked that the tail is there.
        let tail = &buf[at..at + SESSION_TAIL];
        let tcp = tail[0];
        let mut w = [0u8; 8];
        w.copy_from_slice(&tail[1..9]);
        let flags = u16::from_be_bytes([tail[9], tail[10]]);
        if flags & !KNOWN_FLAGS != 0 {
            return Err(SyncDecodeError::Flags(flags));
        }
        let idle_secs = u32::from_be_bytes([tail[11], tail[12], tail[13], tail[14]]);
        at += SESSION_TAIL;
        let r = SessionRecord {
            proto: key.proto,
            pod: key.pod,
            pod_port: key.pod_port,
            remote: key.remote,
            remote_port: key.remote_port,
            egress: key.egress,
            egress_port: key.egress_port,
            tcp,
            tcp_track: u64::from_be_bytes(w),
            flags,
            idle_secs,
        };
        Ok((SyncEvent::Upsert(r), at))
    }

    /// The key of the session the event is about.
    pub fn key(&self) -> SessionKeyRecord {
        match self {
            SyncEvent::Upsert(r) => r.key(),
            SyncEvent::Remove(k) => *k,
        }
    }
}

/// What a worker records in the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JournalEntry<A> {
    /// Slot `index` holds incarnation `seq` of a session that was created,
    /// imported, or changed in a way the standby must know (a TCP phase).
    Live {
        /// Slot index.
        index: u32,
        /// The slot's `seq` after the insert.
        seq: u32,
    },
    /// The session with this tuple ended.
    Removed(SessionTuple<A>),
}

/// A bounded queue of session changes (one per address family). Pushing
/// never blocks: when the queue is full the change is dropped and counted.
#[derive(Debug)]
pub struct SyncJournal<A> {
    queue: ArrayQueue<JournalEntry<A>>,
    overflows: AtomicU64,
}

impl<A> SyncJournal<A> {
    /// A journal holding at most `capacity` changes (at least one).
    pub fn new(capacity: usize) -> Self {
        SyncJournal { queue: ArrayQueue::new(capacity.max(1)), overflows: AtomicU64::new(0) }
    }

    /// Records a change, or counts an overflow when the queue is full.
    #[inline]
    pub(crate) fn push(&self, e: JournalEntry<A>) {
        if self.queue.push(e).is_err() {
            self.overflows.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The oldest change, if any.
    pub(crate) fn pop(&self) -> Option<JournalEntry<A>> {
        self.queue.pop()
    }

    /// Changes dropped because the queue was full, since creation.
    pub fn overflows(&self) -> u64 {
        self.overflows.load(Ordering::Relaxed)
    }

    /// Changes waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no change is waiting.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The queue's capacity.
    pub fn capacity(&self) -> usize {
        self.queue.capacity()
    }
}

/// Why [`NatTable::import`](super::table::NatTable::import) refused a
/// record (the count it joins in [`ImportReport`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImportRefusal {
    /// [`ImportReport::invalid`].
    Invalid,
    /// [`ImportReport::expired`].
    Expired,
    /// [`ImportReport::conflicts`].
    Conflict,
    /// [`ImportReport::table_full`].
    TableFull,
    /// [`ImportReport::over_source_limit`].
    OverSourceLimit,
}

/// A record the import refused, kept so the importing gateway can log
/// the session's end (`not-adopted`, ADR 0034 §8): the previous holder
/// exported its create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefusedImport {
    /// The record as received.
    pub record: SessionRecord,
    /// Why it was refused.
    pub why: ImportRefusal,
}

/// Refused records an [`ImportReport`] lists at most; more are counted in
/// [`ImportReport::refused_unlisted`] (a flood of bad records must not
/// grow memory without bound). About 0.4 MB.
pub const REFUSED_LISTED_MAX: usize = 4096;

/// What [`NatTable::import`](super::table::NatTable::import) did with a batch of records.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImportReport {
    /// Installed as live sessions with their egress ports.
    pub installed: u64,
    /// The same session (outbound key and external port) already lives here.
    pub already_present: u64,
    /// Another session holds the outbound key, the inbound key or the port
    /// (or the pod port's mapping is on another port): not installed.
    pub conflicts: u64,
    /// The current tables do not hold the record (its egress IP, its port
    /// range or its policy), or its family is not this table's.
    pub invalid: u64,
    /// Idle past its timeout by the time it arrived: not installed.
    pub expired: u64,
    /// The session table was full (nothing is evicted for an import).
    pub table_full: u64,
    /// The pod was at its session limit or its port quota.
    pub over_source_limit: u64,
    /// The refused records (every count above but `installed` and
    /// `already_present`), the first [`REFUSED_LISTED_MAX`].
    pub refused: Vec<RefusedImport>,
    /// Refused records past [`REFUSED_LISTED_MAX`]: counted, not listed.
    pub refused_unlisted: u64,
}

impl ImportReport {
    /// Counts `record` as refused for `why`, and lists it while the list
    /// has room.
    pub fn refuse(&mut self, record: &SessionRecord, why: ImportRefusal) {
        *match why {
            ImportRefusal::Invalid => &mut self.invalid,
            ImportRefusal::Expired => &mut self.expired,
            ImportRefusal::Conflict => &mut self.conflicts,
            ImportRefusal::TableFull => &mut self.table_full,
            ImportRefusal::OverSourceLimit => &mut self.over_source_limit,
        } += 1;
        if self.refused.len() < REFUSED_LISTED_MAX {
            self.refused.push(RefusedImport { record: *record, why });
        } else {
            self.refused_unlisted += 1;
        }
    }

    /// Adds `other`'s counts and refused records to this one (the list
    /// kept within [`REFUSED_LISTED_MAX`]).
    pub fn add(&mut self, other: &ImportReport) {
        let room = REFUSED_LISTED_MAX.saturating_sub(self.refused.len());
        self.refused.extend(other.refused.iter().take(room).cloned());
        self.refused_unlisted += other.refused_unlisted + other.refused.len().saturating_sub(room) as u64;
        self.installed += other.installed;
        self.already_present += other.already_present;
        self.conflicts += other.conflicts;
        self.invalid += other.invalid;
        self.expired += other.expired;
        self.table_full += other.table_full;
        self.over_source_limit += other.over_source_limit;
    }

    /// The counts alone, the list left out (for comparisons and logs).
    pub fn counts(&self) -> ImportReport {
        ImportReport { refused: Vec::new(), ..self.clone() }
    }

    /// Records the batch held that were not installed nor already present.
    pub fn rejected(&self) -> u64 {
        self.conflicts + self.invalid + self.expired + self.table_full + self.over_source_limit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A flood of refusals: the list stops at its bound, the rest counted;
    /// merging reports keeps the bound.
    #[test]
    fn refused_records_are_listed_up_to_the_bound_and_counted_past_it() {
        let r = v4();
        let mut a = ImportReport::default();
        for _ in 0..REFUSED_LISTED_MAX + 5 {
            a.refuse(&r, ImportRefusal::Expired);
        }
        assert_eq!(
            (a.expired, a.refused.len(), a.refused_unlisted),
            (REFUSED_LISTED_MAX as u64 + 5, REFUSED_LISTED_MAX, 5)
        );
        let mut b = ImportReport::default();
        b.refuse(&r, ImportRefusal::Conflict);
        b.refuse(&r, ImportRefusal::Invalid);
        b.refuse(&r, ImportRefusal::TableFull);
        b.refuse(&r, ImportRefusal::OverSourceLimit);
        assert_eq!(b.rejected(), 4);
        assert_eq!(
            b.refused.iter().map(|x| x.why).collect::<Vec<_>>(),
            [ImportRefusal::Conflict, ImportRefusal::Invalid, ImportRefusal::TableFull, ImportRefusal::OverSourceLimit]
        );
        let mut sum = b.clone();
        sum.add(&a);
        assert_eq!((sum.refused.len(), sum.refused_unlisted), (REFUSED_LISTED_MAX, 9));
        assert_eq!(sum.rejected(), REFUSED_LISTED_MAX as u64 + 9);
        assert_eq!(&sum.refused[..4], &b.refused[..]);
    }

    fn v4() -> SessionRecord {
        SessionRecord {
            proto: proto::TCP,
            pod: "198.18.0.10".parse().unwrap(),
            pod_port: 41000,
            remote: "198.51.100.7".parse().unwrap(),
            remote_port: 443,
            egress: "203.0.113.10".parse().unwrap(),
            egress_port: 61234,
            tcp: 0x0f,
            tcp_track: 0x0102_0304_0506_0708,
            flags: session_flags::HAS_MAPPING | session_flags::INBOUND_CREATED,
            idle_secs: 0xdead_beef,
        }
    }

    fn v6() -> SessionRecord {
        SessionRecord {
            proto: proto::UDP,
            pod: "2001:db8:18::10".parse().unwrap(),
            remote: "2001:db8:51::7".parse().unwrap(),
            egress: "2001:db8:113::10".parse().unwrap(),
            tcp: 0,
            tcp_track: 0,
            flags: session_flags::HAS_MAPPING,
            ..v4()
        }
    }

    #[test]
    fn records_round_trip_at_their_stated_sizes() {
        for (r, len, klen) in
            [(v4(), SESSION_RECORD_V4_LEN, KEY_RECORD_V4_LEN), (v6(), SESSION_RECORD_V6_LEN, KEY_RECORD_V6_LEN)]
        {
            let mut b = Vec::new();
            r.encode(&mut b);
            assert_eq!(b.len(), len);
            assert_eq!(SessionRecord::decode(&b), Ok((r, len)));
            let mut k = Vec::new();
            r.key().encode(&mut k);
            assert_eq!(k.len(), klen);
            assert_eq!(SessionKeyRecord::decode(&k), Ok((r.key(), klen)));
            assert_eq!(
                SessionRecord::decode(&k),
                Err(SyncDecodeError::WrongKind { expected: "session", found: "removal" })
            );
        }
        assert_eq!(
            (SESSION_RECORD_V4_LEN, SESSION_RECORD_V6_LEN, KEY_RECORD_V4_LEN, KEY_RECORD_V6_LEN),
            (36, 72, 21, 57)
        );
    }

    #[test]
    fn a_stream_of_mixed_records_decodes_in_order() {
        let events = [
            SyncEvent::Upsert(v4()),
            SyncEvent::Remove(v6().key()),
            SyncEvent::Upsert(v6()),
            SyncEvent::Remove(v4().key()),
        ];
        let mut b = Vec::new();
        for e in &events {
            e.encode(&mut b);
        }
        let mut at = 0;
        let mut got = Vec::new();
        while at < b.len() {
            let (e, n) = SyncEvent::decode(&b[at..]).unwrap();
            got.push(e);
            at += n;
        }
        assert_eq!(got, events);
    }

    #[test]
    fn malformed_records_are_errors_naming_the_fault() {
        let mut b = Vec::new();
        v4().encode(&mut b);
        assert_eq!(SyncEvent::decode(&[]), Err(SyncDecodeError::Truncated { need: 3, have: 0 }));
        assert_eq!(SyncEvent::decode(&b[..35]), Err(SyncDecodeError::Truncated { need: 36, have: 35 }));
        let mut bad = b.clone();
        bad[0] = 2;
        assert_eq!(SyncEvent::decode(&bad), Err(SyncDecodeError::Version(2)));
        bad = b.clone();
        bad[1] = 0x10;
        assert_eq!(SyncEvent::decode(&bad), Err(SyncDecodeError::Kind(0x10)));
        bad = b.clone();
        bad[2] = proto::ICMPV6;
        assert_eq!(SyncEvent::decode(&bad), Err(SyncDecodeError::Protocol { proto: 58, family: 4 }));
        bad = b.clone();
        bad[30] = 0x80; // the flags' high byte
        assert_eq!(SyncEvent::decode(&bad), Err(SyncDecodeError::Flags(0x8003)));
        // The v6 kind bit on a v4-sized record: truncated, not misread.
        bad = b.clone();
        bad[1] = KIND_V6;
        assert_eq!(SyncEvent::decode(&bad), Err(SyncDecodeError::Truncated { need: 72, have: 36 }));
        assert!(SyncDecodeError::Flags(0x8003).to_string().contains("flags"));
    }

    /// Every prefix and thousands of random mutations of valid records
    /// decode to a record or an error, never a panic, and a successful
    /// decode never claims more bytes than it was given.
    #[test]
    fn garbage_never_panics() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let mut valid = Vec::new();
        for e in [SyncEvent::Upsert(v4()), SyncEvent::Upsert(v6()), SyncEvent::Remove(v4().key())] {
            let mut b = Vec::new();
            e.encode(&mut b);
            valid.push(b);
        }
        for b in &valid {
            for cut in 0..b.len() {
                assert!(matches!(SyncEvent::decode(&b[..cut]), Err(SyncDecodeError::Truncated { .. })), "cut {cut}");
            }
        }
        let mut decoded = 0;
        for i in 0..20_000 {
            let mut b = valid[i % valid.len()].clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % b.len();
                b[at] = next() as u8;
            }
            b.truncate(b.len() - (next() as usize % 3) * (i % 2));
            if let Ok((_, n)) = SyncEvent::decode(&b) {
                assert!(n <= b.len());
                decoded += 1;
            }
        }
        for _ in 0..20_000 {
            let len = (next() % 100) as usize;
            let b: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if let Ok((_, n)) = SyncEvent::decode(&b) {
                assert!(n <= b.len());
            }
        }
        assert!(decoded > 0, "some mutations leave a valid record");
    }

    #[test]
    fn the_journal_counts_what_did_not_fit_and_never_waits() {
        let j: SyncJournal<Ipv4Addr> = SyncJournal::new(2);
        for i in 0..5 {
            j.push(JournalEntry::Live { index: i, seq: 2 });
        }
        assert_eq!((j.len(), j.overflows()), (2, 3));
        assert_eq!(j.pop(), Some(JournalEntry::Live { index: 0, seq: 2 }), "oldest first");
    }
}
