//! HA: the sessions a standby gateway needs, and their import at a
//! take-over. The active side journals session changes (nat/sync.rs) and
//! drains them for its standby, or exports a whole egress IP's sessions
//! for a full resync; the standby imports them before it announces the IP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use super::Engine;
use crate::nat::key::{NatAddr, SessionTuple};
use crate::nat::rewrite;
use crate::nat::session::session_flags;
use crate::nat::sync::{ImportReport, SessionRecord, SyncEvent, REFUSED_LISTED_MAX};
use crate::stats::WorkerStats;
use crate::tables::Tables;
use crate::translog::{log_flags, EndReason, LogKind, LogRecord, LogRing};

/// Records below which a take-over's import stays on one thread (spawning
/// costs more than it saves).
pub const IMPORT_PARALLEL_MIN: usize = 16_384;

/// Threads an import uses at most (the workers' cores are busy with traffic
/// meanwhile; docs/benchmarks.md, "Take-over").
pub const IMPORT_THREADS_MAX: usize = 8;

impl Engine {
    /// Starts journaling session changes of both families for a standby
    /// gateway, `capacity` changes per family (nat/sync.rs). Once: a later
    /// call changes nothing and returns `false`.
    pub fn enable_sync_journal(&self, capacity: usize) -> bool {
        let a = self.shared.nat4.enable_sync_journal(capacity);
        let b = self.shared.nat6.enable_sync_journal(capacity);
        a && b
    }

    /// Session changes the journal dropped because it was full, both
    /// families, since it was enabled. When it grows, a standby missed
    /// changes: send it a full [`export_sessions`](Self::export_sessions).
    pub fn sync_overflows(&self) -> u64 {
        self.shared.nat4.sync_overflows() + self.shared.nat6.sync_overflows()
    }

    /// Takes up to `max` journaled changes and returns them as they stand
    /// at `now` (engine seconds, the workers' clock): see
    /// [`NatTable::drain_sync`]. Each family gets at least half of `max`
    /// when it has that many (a flood of one cannot starve the other); the
    /// order within a family is kept, and the families' keys never meet.
    pub fn drain_sync_events(&self, max: usize, now: u32) -> Vec<SyncEvent> {
        let mut out = Vec::new();
        let first = self.shared.nat4.drain_sync(max / 2, now, &mut out);
        let second = self.shared.nat6.drain_sync(max - first, now, &mut out);
        self.shared.nat4.drain_sync(max - first - second, now, &mut out);
        out
    }

    /// Every live session on `egress` at `now` (engine seconds), for a full
    /// resync of a standby. Walks the whole table: call it from the control
    /// plane, not per packet.
    pub fn export_sessions(&self, egress: IpAddr, now: u32) -> Vec<SessionRecord> {
        let mut out = Vec::new();
        match egress {
            IpAddr::V4(a) => self.shared.nat4.export(a, now, &mut out),
            IpAddr::V6(a) => self.shared.nat6.export(a, now, &mut out),
        }
        out
    }

    /// Installs sessions a standby received for an egress IP it takes over,
    /// checked against `tables` (the snapshot just published that holds the
    /// IP; see [`NatTable::import`]), at `now` (engine seconds). The IP is
    /// announced only after this returns, so its time adds to a failover: a
    /// large import is split over the machine's cores
    /// ([`Engine::import_sessions_on`]).
    pub fn import_sessions(&self, records: &[SessionRecord], tables: &Tables, now: u32) -> ImportReport {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        self.import_sessions_on(records, tables, now, cores.min(IMPORT_THREADS_MAX))
    }

    /// [`Engine::import_sessions`] on at most `threads` threads (one when
    /// there are fewer than [`IMPORT_PARALLEL_MIN`] records). The tables
    /// are concurrent (workers create sessions while an import runs), so
    /// chunks of one import do not need an order: two records of one
    /// endpoint-independent mapping meet in `claim_exact`, which holds the
    /// mapping's index entry. A thread that cannot be started leaves its
    /// chunk to the caller's thread.
    pub fn import_sessions_on(
        &self,
        records: &[SessionRecord],
        tables: &Tables,
        now: u32,
        threads: usize,
    ) -> ImportReport {
        let threads = threads.max(1);
        if threads == 1 || records.len() < IMPORT_PARALLEL_MIN {
            return self.import_chunk(records, tables, now);
        }
        let chunk = records.len().div_ceil(threads);
        std::thread::scope(|s| {
            let mut report = ImportReport::default();
            let mut running = Vec::new();
            for part in records.chunks(chunk) {
                match std::thread::Builder::new()
                    .name("egret-import".into())
                    .spawn_scoped(s, move || self.import_chunk(part, tables, now))
                {
                    Ok(h) => running.push(h),
                    Err(_) => report.add(&self.import_chunk(part, tables, now)),
                }
            }
            for h in running {
                match h.join() {
                    Ok(r) => report.add(&r),
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            }
            report
        })
    }

    /// Logs the end of each session `report`'s import refused (reason
    /// `not-adopted`, ADR 0034 §8: the previous holder exported its
    /// create, and no one else will log its end), at `now_ms` (engine ms),
    /// its last packet the record's idle time before. Nothing while
    /// translation logs are off, nor for egress IPs whose port blocks are
    /// the log (`logSessions: false`). The records go to a ring of the
    /// imports' own, drained with the workers'. Returns how many were
    /// pushed (a full ring drops and counts, as a worker's does).
    pub fn log_not_adopted(&self, report: &ImportReport, tables: &Tables, now_ms: u64) -> usize {
        let Some(&records) = self.shared.translog.get() else { return 0 };
        if report.refused.is_empty() {
            return 0;
        }
        let (ring, stats) = self.shared.import_log.get_or_init(|| {
            // Room for a few IPs' worth of refusals between two drains.
            let ring = Arc::new(LogRing::new(records.max(4 * REFUSED_LISTED_MAX)));
            let stats = Arc::new(WorkerStats::default());
            self.shared.workers.lock().push(stats.clone());
            self.shared.translog_rings.lock().push(ring.clone());
            (ring, stats)
        });
        let now_s = (now_ms / 1000) as u32;
        let mut pushed = 0;
        for x in &report.refused {
            let r = &x.record;
            let unlogged = tables.egress(r.egress).and_then(|e| e.blocks).is_some_and(|b| !b.log_sessions);
            let record = match r.egress {
                IpAddr::V4(_) => r.tuple::<Ipv4Addr>().map(|t| not_adopted(&t, r, now_ms, now_s)),
                IpAddr::V6(_) => r.tuple::<Ipv6Addr>().map(|t| not_adopted(&t, r, now_ms, now_s)),
            };
            if let (Some(record), false) = (record, unlogged) {
                ring.push(record, stats);
                pushed += 1;
            }
        }
        pushed
    }

    fn import_chunk(&self, records: &[SessionRecord], tables: &Tables, now: u32) -> ImportReport {
        let d4 = |t: &SessionTuple<Ipv4Addr>| rewrite::outbound_deltas(t);
        let d6 = |t: &SessionTuple<Ipv6Addr>| rewrite::outbound_deltas(t);
        let mut report = self.shared.nat4.import(records.iter().filter(|r| r.egress.is_ipv4()), tables, now, &d4);
        report.add(&self.shared.nat6.import(records.iter().filter(|r| r.egress.is_ipv6()), tables, now, &d6));
        report
    }
}

/// The delete record of a refused import's session.
fn not_adopted<A: NatAddr>(t: &SessionTuple<A>, r: &SessionRecord, now_ms: u64, now_s: u32) -> LogRecord {
    let flags = if r.flags & session_flags::INBOUND_CREATED != 0 { log_flags::INBOUND_CREATED } else { 0 };
    let mut rec = LogRecord::session(LogKind::SessionDelete, t, now_ms, flags);
    rec.value = now_s.saturating_sub(r.idle_secs);
    rec.detail = EndReason::NotAdopted as u8;
    rec
}
