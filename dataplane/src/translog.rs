//! Translation logs, the workers' half (issue 34, docs/adr/0034-translation-logs.md):
//! the fixed-size record of a session's creation or end, and the bounded
//! ring each worker appends it to.
//!
//! The NAT table pushes one [`LogRecord`] when a worker's insert succeeds
//! (`NatTable::insert_marked`) and one when a removal succeeds
//! (`NatTable::remove`, given an [`End`](crate::nat::table::End)); the
//! pipeline pushes one when a new flow is refused (ports exhausted, a
//! quota), at most once a second per (reason, pod) on each worker. A session
//! imported at a take-over logs nothing (`NatTable::import` passes no ring).
//! The record holds no pointers and no strings: addresses, ports, the
//! engine time in ms and, for an end, the last packet's engine second (the
//! fast path's stamp folded in). The control plane drains the rings,
//! resolves the times and the pod's identity and encodes (IPFIX, syslog);
//! nothing of that runs on a worker.
//!
//! Each worker owns one [`LogRing`] (a crossbeam `ArrayQueue`, one producer,
//! one consumer): a push is a store and an uncontended atomic. A full ring
//! drops the record and counts it (`translog_ring_full`): a worker never
//! waits for the exporter. With logging off there is no ring, and the cost
//! is the `Option` check.

use std::sync::atomic::{AtomicU64, Ordering};

use crossbeam::queue::ArrayQueue;

use crate::nat::key::{NatAddr, SessionTuple};
use crate::stats::{Event, WorkerStats};

/// A record's size: fixed, asserted below (ADR 0034 §1).
pub const RECORD_LEN: usize = 72;

/// What a record says happened (`LogRecord::kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum LogKind {
    /// A session was created (RFC 8158 natEvent 4, NAT44 session create).
    SessionCreate = 1,
    /// A session ended (natEvent 5, NAT44 session delete).
    SessionDelete = 2,
    /// A new flow found no free port on its egress IP (natEvent 12, NAT
    /// ports exhausted).
    PortsExhausted = 3,
    /// A new flow was refused by a limit (natEvent 13, quota exceeded;
    /// `detail` is RFC 8158's natQuotaExceededEvent, `value` the limit).
    QuotaExceeded = 4,
    /// A pod took a block of ports on an egress IP (natEvent 16, port
    /// block allocation; the block's first port in `egress_port`, its last
    /// in `remote_port`, its size in `aux`; ADR 0034 §6).
    BlockAllocate = 5,
    /// A pod's block was freed, its last session gone (natEvent 17, port
    /// block de-allocation; the same fields).
    BlockFree = 6,
}

impl LogKind {
    /// Every kind, in the order of their bytes (1, 2, ...).
    pub const ALL: [LogKind; 6] = [
        LogKind::SessionCreate,
        LogKind::SessionDelete,
        LogKind::PortsExhausted,
        LogKind::QuotaExceeded,
        LogKind::BlockAllocate,
        LogKind::BlockFree,
    ];

    /// The kind of a record's `kind` byte.
    pub fn from_u8(b: u8) -> Option<LogKind> {
        match b {
            1 => Some(LogKind::SessionCreate),
            2 => Some(LogKind::SessionDelete),
            3 => Some(LogKind::PortsExhausted),
            4 => Some(LogKind::QuotaExceeded),
            5 => Some(LogKind::BlockAllocate),
            6 => Some(LogKind::BlockFree),
            _ => None,
        }
    }

    /// The snake_case name used in metrics.
    pub const fn name(self) -> &'static str {
        match self {
            LogKind::SessionCreate => "session_create",
            LogKind::SessionDelete => "session_delete",
            LogKind::PortsExhausted => "ports_exhausted",
            LogKind::QuotaExceeded => "quota_exceeded",
            LogKind::BlockAllocate => "block_allocate",
            LogKind::BlockFree => "block_free",
        }
    }
}

/// Why a session ended (`LogRecord::detail` of a delete).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum EndReason {
    /// Idle past its timeout.
    Expired = 1,
    /// A TCP session closed (FIN both ways, or RST) and past its
    /// transitory timeout.
    TcpClosed = 2,
    /// Evicted to make room in a full table.
    Evicted = 3,
    /// Its policy, egress IP or port range no longer holds (a reload, or
    /// the egress IP moved away).
    Invalidated = 4,
    /// Removed by revalidation at an old holder that handed the session's
    /// egress IP over with a current copy (ADR 0034 §8): the next holder
    /// imported the session and logs its end. Written to the local journal
    /// only, never exported (VPP's `is_ha`).
    HandedOver = 5,
    /// A session the previous holder sent at a take-over that the import
    /// refused (invalid here, expired, a conflict, the table full, the pod
    /// over its limit): logged by the importing gateway, since the holder
    /// exported its create.
    NotAdopted = 6,
}

impl EndReason {
    /// All, in `detail` order.
    pub const ALL: [EndReason; 6] = [
        EndReason::Expired,
        EndReason::TcpClosed,
        EndReason::Evicted,
        EndReason::Invalidated,
        EndReason::HandedOver,
        EndReason::NotAdopted,
    ];

    /// The reason of a record's `detail` byte.
    pub fn from_u8(b: u8) -> Option<EndReason> {
        match b {
            1 => Some(EndReason::Expired),
            2 => Some(EndReason::TcpClosed),
            3 => Some(EndReason::Evicted),
            4 => Some(EndReason::Invalidated),
            5 => Some(EndReason::HandedOver),
            6 => Some(EndReason::NotAdopted),
            _ => None,
        }
    }

    /// The word syslog's `why` carries.
    pub const fn name(self) -> &'static str {
        match self {
            EndReason::Expired => "expired",
            EndReason::TcpClosed => "tcp-closed",
            EndReason::Evicted => "evicted",
            EndReason::Invalidated => "invalidated",
            EndReason::HandedOver => "handed-over",
            EndReason::NotAdopted => "not-adopted",
        }
    }
}

/// RFC 8158's natQuotaExceededEvent values a refusal's `detail` takes.
pub mod quota {
    /// Maximum session entries (the session table is full).
    pub const MAX_SESSION_ENTRIES: u8 = 1;
    /// Maximum entries per user (the pod's session limit or port quota).
    pub const MAX_ENTRIES_PER_USER: u8 = 3;
}

/// `LogRecord::flags` bits.
pub mod log_flags {
    /// The addresses are IPv6 (else IPv4, in the first 4 bytes).
    pub const IPV6: u8 = 0x1;
    /// The session was created by an inbound packet.
    pub const INBOUND_CREATED: u8 = 0x2;
    /// The session was installed in the XDP fast path when it ended.
    pub const OFFLOADED: u8 = 0x4;
    /// The session was adopted from another gateway at a take-over.
    pub const ADOPTED: u8 = 0x8;
}

/// One event, as a worker appends it to its ring. `#[repr(C)]`, 72 bytes,
/// no padding (ADR 0034 §1).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogRecord {
    /// Engine time of the event (creation or removal), ms.
    pub time_ms: u64,
    /// A delete: the last packet's engine second, the fast path's stamp
    /// folded in. 0 for a create.
    pub value: u32,
    /// [`LogKind`].
    pub kind: u8,
    /// The IP protocol.
    pub proto: u8,
    /// A delete: [`EndReason`].
    pub detail: u8,
    /// [`log_flags`].
    pub flags: u8,
    /// The pod's address (IPv4: the first 4 bytes).
    pub pod: [u8; 16],
    /// The egress address.
    pub egress: [u8; 16],
    /// The remote's address.
    pub remote: [u8; 16],
    /// The pod's port (ICMP: identifier).
    pub pod_port: u16,
    /// The egress port.
    pub egress_port: u16,
    /// The remote's port.
    pub remote_port: u16,
    /// A block record: the block's size (ADR 0034 §6); else 0.
    pub aux: u16,
}

const _: () = assert!(std::mem::size_of::<LogRecord>() == RECORD_LEN);
const _: () = assert!(std::mem::align_of::<LogRecord>() == 8);

impl LogRecord {
    /// The record of `kind` for the session `t` at `time_ms`.
    #[inline]
    pub fn session<A: NatAddr>(kind: LogKind, t: &SessionTuple<A>, time_ms: u64, flags: u8) -> LogRecord {
        let mut r = LogRecord {
            time_ms,
            kind: kind as u8,
            proto: t.proto,
            flags: flags | if A::IS_V6 { log_flags::IPV6 } else { 0 },
            pod_port: t.pod_port,
            egress_port: t.egress_port,
            remote_port: t.remote_port,
            ..LogRecord::default()
        };
        t.pod.write(&mut r.pod);
        t.egress.write(&mut r.egress);
        t.remote.write(&mut r.remote);
        r
    }

    /// A refusal of `pod`'s new flow at `time_ms`: ports exhausted on
    /// `egress`, or a quota (`detail`, [`quota`]) whose limit is `limit`.
    #[inline]
    pub fn refusal<A: NatAddr>(
        kind: LogKind,
        pod: &A,
        egress: Option<&A>,
        time_ms: u64,
        detail: u8,
        limit: u32,
    ) -> LogRecord {
        let mut r = LogRecord {
            time_ms,
            value: limit,
            kind: kind as u8,
            detail,
            flags: if A::IS_V6 { log_flags::IPV6 } else { 0 },
            ..LogRecord::default()
        };
        pod.write(&mut r.pod);
        if let Some(e) = egress {
            e.write(&mut r.egress);
        }
        r
    }

    /// A block of `pod` on `egress` at `time_ms`: ports `start..=end`
    /// (`kind` [`LogKind::BlockAllocate`] or [`LogKind::BlockFree`]).
    #[inline]
    pub fn block<A: NatAddr>(
        kind: LogKind,
        pod: &A,
        egress: &A,
        start: u16,
        end: u16,
        size: u16,
        time_ms: u64,
    ) -> LogRecord {
        let mut r = LogRecord {
            time_ms,
            kind: kind as u8,
            flags: if A::IS_V6 { log_flags::IPV6 } else { 0 },
            egress_port: start,
            remote_port: end,
            aux: size,
            ..LogRecord::default()
        };
        pod.write(&mut r.pod);
        egress.write(&mut r.egress);
        r
    }

    /// The kind, if the byte is one.
    pub fn kind(&self) -> Option<LogKind> {
        LogKind::from_u8(self.kind)
    }

    /// Whether the addresses are IPv6.
    pub fn is_v6(&self) -> bool {
        self.flags & log_flags::IPV6 != 0
    }
}

/// Refusals remembered per worker, to log each (reason, pod) at most once
/// a second (ADR 0034 §2: a flood of refused packets must not crowd
/// sessions out of the ring).
const REFUSAL_SLOTS: usize = 256;

/// A worker's ring of records: bounded, never blocking.
#[derive(Debug)]
pub struct LogRing {
    queue: ArrayQueue<LogRecord>,
    /// Per slot: the last refusal logged there, (key hash << 32) | engine
    /// second. Written only by the ring's worker.
    refusals: Box<[AtomicU64]>,
}

impl LogRing {
    /// A ring of `capacity` records (at least 1).
    pub fn new(capacity: usize) -> LogRing {
        LogRing {
            queue: ArrayQueue::new(capacity.max(1)),
            refusals: (0..REFUSAL_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Whether a refusal of `key` (a hash of its reason and pod) may be
    /// logged in engine second `second`: not if the same key was logged in
    /// that second (or one sharing its slot and hash half was). Only the
    /// ring's worker calls it.
    #[inline]
    pub fn admit_refusal(&self, key: u64, second: u32) -> bool {
        let slot = &self.refusals[(key as usize) % REFUSAL_SLOTS];
        let want = ((key >> 32) << 32) | u64::from(second);
        if slot.load(Ordering::Relaxed) == want {
            return false;
        }
        slot.store(want, Ordering::Relaxed);
        true
    }

    /// Appends `r`, or drops it and counts `translog_ring_full` in `stats`
    /// (the worker's own counters) when the ring is full.
    #[inline]
    pub fn push(&self, r: LogRecord, stats: &WorkerStats) {
        if self.queue.push(r).is_err() {
            stats.event(Event::TranslogRingFull);
        }
    }

    /// Takes the oldest record.
    #[inline]
    pub fn pop(&self) -> Option<LogRecord> {
        self.queue.pop()
    }

    /// Records waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no record waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The ring's size.
    pub fn capacity(&self) -> usize {
        self.queue.capacity()
    }
}

/// Where a worker's NAT operations log: its ring, the time of the frame or
/// tick being processed, its counters. `None` in its place means logging
/// is off (the only cost then).
#[derive(Clone, Copy, Debug)]
pub struct LogTo<'a> {
    /// The worker's ring.
    pub ring: &'a LogRing,
    /// The worker's counters (`translog_ring_full`).
    pub stats: &'a WorkerStats,
    /// Now, engine ms.
    pub now_ms: u64,
}

impl LogTo<'_> {
    /// Appends `r` (or counts its loss).
    #[inline]
    pub fn push(&self, r: LogRecord) {
        self.ring.push(r, self.stats);
    }
}

#[cfg(test)]
mod tests {
    use std::mem::offset_of;
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;
    use crate::nat::key::proto;

    #[test]
    fn every_kind_is_listed_in_byte_order() {
        for (i, k) in LogKind::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i + 1, "{k:?}: counters index by kind - 1");
            assert_eq!(LogKind::from_u8(*k as u8), Some(*k));
        }
        assert_eq!(LogKind::from_u8(LogKind::ALL.len() as u8 + 1), None);
    }

    #[test]
    fn every_end_reason_reads_back_from_its_byte() {
        let names: Vec<&str> = (0..=7u8)
            .filter_map(EndReason::from_u8)
            .map(|r| {
                assert_eq!(EndReason::from_u8(r as u8), Some(r));
                r.name()
            })
            .collect();
        assert_eq!(names, ["expired", "tcp-closed", "evicted", "invalidated", "handed-over", "not-adopted"]);
    }

    #[test]
    fn the_record_is_72_bytes_with_the_adr_offsets() {
        assert_eq!(std::mem::size_of::<LogRecord>(), 72);
        assert_eq!(offset_of!(LogRecord, time_ms), 0);
        assert_eq!(offset_of!(LogRecord, value), 8);
        assert_eq!(offset_of!(LogRecord, kind), 12);
        assert_eq!(offset_of!(LogRecord, proto), 13);
        assert_eq!(offset_of!(LogRecord, detail), 14);
        assert_eq!(offset_of!(LogRecord, flags), 15);
        assert_eq!(offset_of!(LogRecord, pod), 16);
        assert_eq!(offset_of!(LogRecord, egress), 32);
        assert_eq!(offset_of!(LogRecord, remote), 48);
        assert_eq!(offset_of!(LogRecord, pod_port), 64);
        assert_eq!(offset_of!(LogRecord, egress_port), 66);
        assert_eq!(offset_of!(LogRecord, remote_port), 68);
        assert_eq!(offset_of!(LogRecord, aux), 70);
    }

    #[test]
    fn a_session_record_carries_the_tuple() {
        let t = SessionTuple {
            pod: Ipv4Addr::new(10, 244, 1, 7),
            remote: Ipv4Addr::new(198, 51, 100, 20),
            egress: Ipv4Addr::new(203, 0, 113, 10),
            pod_port: 40001,
            remote_port: 443,
            egress_port: 41522,
            proto: proto::TCP,
        };
        let r = LogRecord::session(LogKind::SessionCreate, &t, 1234, 0);
        assert_eq!(r.kind(), Some(LogKind::SessionCreate));
        assert_eq!((r.time_ms, r.proto, r.flags), (1234, 6, 0));
        assert_eq!(&r.pod[..4], &[10, 244, 1, 7]);
        assert_eq!(&r.pod[4..], &[0; 12]);
        assert_eq!(&r.egress[..4], &[203, 0, 113, 10]);
        assert_eq!(&r.remote[..4], &[198, 51, 100, 20]);
        assert_eq!((r.pod_port, r.egress_port, r.remote_port), (40001, 41522, 443));

        let a: Ipv6Addr = "2001:db8::7".parse().unwrap();
        let t6 = SessionTuple { pod: a, remote: a, egress: a, pod_port: 1, remote_port: 2, egress_port: 3, proto: 17 };
        let r6 = LogRecord::session(LogKind::SessionDelete, &t6, 0, log_flags::ADOPTED);
        assert!(r6.is_v6());
        assert_eq!(r6.flags, log_flags::IPV6 | log_flags::ADOPTED);
        assert_eq!(r6.pod, a.octets());
    }

    #[test]
    fn refusals_are_admitted_once_a_second_per_key() {
        let ring = LogRing::new(4);
        let (a, b) = (0x1234_5678_0000_0001_u64, 0x9abc_def0_0000_0002_u64);
        assert!(ring.admit_refusal(a, 10));
        assert!(!ring.admit_refusal(a, 10));
        assert!(ring.admit_refusal(b, 10), "another key, another slot");
        assert!(ring.admit_refusal(a, 11), "the next second");
        let r = LogRecord::refusal(
            LogKind::QuotaExceeded,
            &Ipv4Addr::new(10, 0, 0, 1),
            None,
            5,
            quota::MAX_ENTRIES_PER_USER,
            64,
        );
        assert_eq!(
            (r.kind(), r.detail, r.value, &r.pod[..4], r.egress),
            (Some(LogKind::QuotaExceeded), 3, 64, &[10, 0, 0, 1][..], [0; 16])
        );
    }

    #[test]
    fn a_full_ring_drops_and_counts() {
        let ring = LogRing::new(2);
        let stats = WorkerStats::default();
        for i in 0..5 {
            ring.push(LogRecord { time_ms: i, ..LogRecord::default() }, &stats);
        }
        assert_eq!(stats.snapshot().event(Event::TranslogRingFull), 3);
        assert_eq!(ring.pop().map(|r| r.time_ms), Some(0));
        assert_eq!(ring.pop().map(|r| r.time_ms), Some(1));
        assert!(ring.pop().is_none());
    }
}
