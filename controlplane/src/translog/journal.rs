//! The local journal (ADR 0034 §7, as amended): every resolved event
//! appended to segment files under `translationLogs.journal.dir`, and the
//! query behind `egret who-had`.
//!
//! **On disk.** A segment is a file `seg-<start ms>.tlj`, named by the wall
//! time (Unix ms) it was opened at, so names sort by time. It starts with
//! the 8-byte magic [`MAGIC`] and holds records, appended and never
//! rewritten. A record is [`FIXED`] bytes (little-endian, the layout is in
//! [`encode`]) then the pod's identity as `namespace\0name\0uid` (empty
//! when unknown), its length in the fixed part. Each record starts with a
//! marker, so a reader stops at a torn tail (a crash mid-write) instead of
//! misreading it. The writer never appends to a segment it did not open: a
//! restart opens a new one.
//!
//! **Segments close** at `segment_bytes` (16 MiB, or an eighth of
//! `maxBytes` when that is smaller) or `segment_age` (10 minutes, or an
//! eighth of `maxAge`). A segment's records span from its start to the
//! next segment's start.
//!
//! **Retention.** When a segment closes (and at the first write), the
//! oldest segments are removed while all of them together exceed
//! `maxBytes`, and so is every segment whose successor started more than
//! `maxAge` ago (all its records are older than that).
//!
//! **Errors.** The writer runs on the exporter's thread, never a
//! worker's. A failed write drops the events it held, counted as
//! `egret_translog_dropped_total{sink="journal",reason="write_error"}`;
//! the segment is then closed and the next pass opens a new one.
//!
//! **The query** ([`who_had`]) reads the segments in order, keeps the
//! session records on the asked egress address and port, and pairs them
//! per session key (protocol, pod address and port, egress address and
//! port, remote): the latest create at or before T, then the first delete
//! after it. No index is kept: a scan of 1 GiB takes about a second, and
//! the query runs on the admin socket's thread, never on the exporter's.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use egret_dataplane::translog::{log_flags, EndReason, LogKind};

use super::identity::PodIdentity;
use super::{DropReason, Event, Sink, Stats};

/// A segment's first bytes.
pub const MAGIC: &[u8; 8] = b"EGRETJ1\n";
/// A record's first two bytes.
const MARKER: [u8; 2] = [0xE7, 0x4A];
/// A record's fixed part, bytes.
pub const FIXED: usize = 88;
/// A segment file's name: `seg-` + start ms + this.
const SUFFIX: &str = ".tlj";
/// Largest segment (ADR 0034 §7).
pub const SEGMENT_BYTES: u64 = 16 << 20;
/// Oldest a segment gets before it closes (ADR 0034 §7).
pub const SEGMENT_AGE: Duration = Duration::from_secs(600);

/// How the journal is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// All segments together, bytes (`maxBytes`).
    pub max_bytes: u64,
    /// Oldest record kept (`maxAge`).
    pub max_age: Duration,
    /// A segment closes at this size.
    pub segment_bytes: u64,
    /// A segment closes at this age.
    pub segment_age: Duration,
}

impl Limits {
    /// The limits of `maxBytes` and `maxAge`: segments of 16 MiB and
    /// 10 minutes, smaller when an eighth of the limit is (so that
    /// retention removes an eighth at a time, not everything).
    pub fn new(max_bytes: u64, max_age: Duration) -> Limits {
        Limits {
            max_bytes,
            max_age,
            segment_bytes: SEGMENT_BYTES.min(max_bytes / 8).max(FIXED as u64 * 16),
            segment_age: SEGMENT_AGE.min(max_age / 8).max(Duration::from_secs(1)),
        }
    }
}

/// The segment being written.
#[derive(Debug)]
struct Open {
    file: File,
    start_ms: u64,
    bytes: u64,
}

/// The writer, owned by the exporter.
#[derive(Debug)]
pub struct Journal {
    dir: PathBuf,
    limits: Limits,
    open: Option<Open>,
    buf: Vec<u8>,
    /// When an error was last logged (one warning a minute at most).
    warned_ms: Option<u64>,
    /// The closed segments' bytes, and the oldest segment's start (as of
    /// the last retention).
    closed_bytes: u64,
    oldest_ms: u64,
}

/// A segment on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Its file.
    pub path: PathBuf,
    /// When it was opened, Unix ms.
    pub start_ms: u64,
    /// Its size, bytes.
    pub bytes: u64,
}

/// The segments in `dir`, oldest first (none if it does not exist).
pub fn segments(dir: &Path) -> io::Result<Vec<Segment>> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let Some(start_ms) =
            name.to_str().and_then(|n| n.strip_prefix("seg-")?.strip_suffix(SUFFIX)?.parse::<u64>().ok())
        else {
            continue;
        };
        let bytes = entry.metadata()?.len();
        out.push(Segment { path: entry.path(), start_ms, bytes });
    }
    out.sort_by_key(|s| s.start_ms);
    Ok(out)
}

impl Journal {
    /// A journal in `dir`; nothing is opened until the first write.
    pub fn new(dir: impl Into<PathBuf>, limits: Limits) -> Journal {
        Journal { dir: dir.into(), limits, open: None, buf: Vec::new(), warned_ms: None, closed_bytes: 0, oldest_ms: 0 }
    }

    /// Appends `events` (in time order) at wall time `now_ms`. Never
    /// fails: a failed write drops them, counted.
    pub fn append(&mut self, events: &[Event], now_ms: u64, stats: &Stats) {
        if events.is_empty() {
            return;
        }
        self.buf.clear();
        for e in events {
            encode(e, &mut self.buf);
        }
        match self.write(now_ms) {
            Ok(()) => {
                stats.add_sent(Sink::Journal, events.len() as u64);
                let open = self.open.as_ref().map_or(0, |o| o.bytes);
                stats.set_journal(self.closed_bytes + open, self.oldest_ms);
            }
            Err(e) => {
                stats.add_dropped(Sink::Journal, DropReason::WriteError, events.len() as u64);
                self.open = None;
                if self.warned_ms.is_none_or(|w| now_ms >= w + 60_000) {
                    self.warned_ms = Some(now_ms);
                    tracing::warn!(dir = %self.dir.display(), error = %e, "translation logs: writing the journal failed; events dropped");
                }
            }
        }
    }

    fn write(&mut self, now_ms: u64) -> io::Result<()> {
        let roll = self.open.as_ref().is_none_or(|o| {
            o.bytes >= self.limits.segment_bytes
                || now_ms.saturating_sub(o.start_ms) >= self.limits.segment_age.as_millis() as u64
        });
        if roll {
            self.open = None;
            self.roll(now_ms)?;
        }
        let open = self.open.as_mut().ok_or_else(|| io::Error::other("no open segment"))?;
        open.file.write_all(&self.buf)?;
        open.bytes += self.buf.len() as u64;
        Ok(())
    }

    /// Opens a new segment at `now_ms`, then applies retention.
    fn roll(&mut self, now_ms: u64) -> io::Result<()> {
        // Who talked to whom: the owner's only.
        fs::DirBuilder::new().recursive(true).mode(0o700).create(&self.dir)?;
        let existing = segments(&self.dir)?;
        // Names must sort by time and never collide.
        let start_ms = existing.last().map_or(now_ms, |s| now_ms.max(s.start_ms + 1));
        let path = self.dir.join(format!("seg-{start_ms:016}{SUFFIX}"));
        let mut file = OpenOptions::new().create_new(true).append(true).mode(0o600).open(&path)?;
        file.write_all(MAGIC)?;
        self.open = Some(Open { file, start_ms, bytes: MAGIC.len() as u64 });
        // A segment that cannot be removed must not stop the writing (nor
        // open a new segment per pass): it is logged, and tried again at
        // the next roll.
        if let Err(e) = self.retain(now_ms) {
            if self.warned_ms.is_none_or(|w| now_ms >= w + 60_000) {
                self.warned_ms = Some(now_ms);
                tracing::warn!(dir = %self.dir.display(), error = %e, "translation logs: removing old journal segments failed");
            }
        }
        Ok(())
    }

    /// Removes the oldest segments beyond `maxBytes`, and those whose
    /// records are all older than `maxAge`. The open segment stays.
    fn retain(&mut self, now_ms: u64) -> io::Result<()> {
        let all = segments(&self.dir)?;
        let current = self.open.as_ref().map(|o| o.start_ms);
        let mut total: u64 = all.iter().map(|s| s.bytes).sum();
        let cutoff = now_ms.saturating_sub(self.limits.max_age.as_millis() as u64);
        for (i, s) in all.iter().enumerate() {
            if Some(s.start_ms) == current {
                break;
            }
            let ended_ms = all.get(i + 1).map_or(now_ms, |n| n.start_ms);
            if total > self.limits.max_bytes || ended_ms < cutoff {
                match fs::remove_file(&s.path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
                total -= s.bytes;
            }
        }
        let kept = segments(&self.dir)?;
        self.closed_bytes = kept.iter().filter(|s| Some(s.start_ms) != current).map(|s| s.bytes).sum();
        self.oldest_ms = kept.first().map_or(0, |s| s.start_ms);
        Ok(())
    }
}

fn put_addr(out: &mut Vec<u8>, a: IpAddr) {
    match a {
        IpAddr::V4(v4) => {
            out.extend_from_slice(&v4.octets());
            out.extend_from_slice(&[0; 12]);
        }
        IpAddr::V6(v6) => out.extend_from_slice(&v6.octets()),
    }
}

/// Appends `e`'s record to `out`:
///
/// | offset | field |
/// |---|---|
/// | 0 | marker `E7 4A` |
/// | 2 | identity length, u16 |
/// | 4 | kind, proto, end reason (0: none), flags (`log_flags`) |
/// | 8 | time, Unix ms, u64 |
/// | 16 | last packet, Unix ms, u64 (`u64::MAX`: none) |
/// | 24 | pod port, egress port, remote port, u16 each |
/// | 30 | families and presence: 1 pod v6, 2 egress v6, 4 remote v6, 8 remote given, 16 limit given, 32 block given |
/// | 31 | quota (0: none) |
/// | 32 | limit, u32 |
/// | 36 | a port block's last port and size, u16 each (its first is the egress port); else 0 |
/// | 40, 56, 72 | pod, egress, remote: 16 bytes each, IPv4 in the first 4 |
/// | 88 | identity: `namespace\0name\0uid` |
pub fn encode(e: &Event, out: &mut Vec<u8>) {
    let ident = e.identity.as_ref().map(|i| format!("{}\0{}\0{}", i.namespace, i.name, i.uid)).unwrap_or_default();
    // Kubernetes names and UIDs are far shorter; cut rather than fail.
    let ident = &ident.as_bytes()[..ident.len().min(u16::MAX as usize)];
    out.extend_from_slice(&MARKER);
    out.extend_from_slice(&(ident.len() as u16).to_le_bytes());
    out.extend_from_slice(&[e.kind as u8, e.proto, e.reason.map_or(0, |r| r as u8), e.flags]);
    out.extend_from_slice(&e.at_ms.to_le_bytes());
    out.extend_from_slice(&e.last_ms.unwrap_or(u64::MAX).to_le_bytes());
    let (remote, remote_port) = e.remote.unwrap_or((IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
    out.extend_from_slice(&e.pod_port.to_le_bytes());
    out.extend_from_slice(&e.egress_port.to_le_bytes());
    out.extend_from_slice(&remote_port.to_le_bytes());
    let bits = u8::from(e.pod.is_ipv6())
        | u8::from(e.egress.is_ipv6()) << 1
        | u8::from(remote.is_ipv6()) << 2
        | u8::from(e.remote.is_some()) << 3
        | u8::from(e.limit.is_some()) << 4
        | u8::from(e.block.is_some()) << 5;
    out.extend_from_slice(&[bits, e.quota.unwrap_or(0)]);
    out.extend_from_slice(&e.limit.unwrap_or(0).to_le_bytes());
    let (block_end, block_size) = e.block.unwrap_or((0, 0));
    out.extend_from_slice(&block_end.to_le_bytes());
    out.extend_from_slice(&block_size.to_le_bytes());
    put_addr(out, e.pod);
    put_addr(out, e.egress);
    put_addr(out, remote);
    out.extend_from_slice(ident);
}

fn get_addr(b: &[u8], v6: bool) -> IpAddr {
    let a: [u8; 16] = b[..16].try_into().unwrap_or([0; 16]);
    if v6 {
        IpAddr::V6(Ipv6Addr::from(a))
    } else {
        IpAddr::V4(Ipv4Addr::new(a[0], a[1], a[2], a[3]))
    }
}

/// The record at the start of `b` and its length; `None` at a torn or
/// foreign tail.
pub fn decode(b: &[u8]) -> Option<(Event, usize)> {
    if b.len() < FIXED || b[..2] != MARKER {
        return None;
    }
    let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    let ident_len = usize::from(u16_at(2));
    if b.len() < FIXED + ident_len {
        return None;
    }
    let kind = LogKind::from_u8(b[4])?;
    let bits = b[30];
    let identity = match ident_len {
        0 => None,
        n => {
            let s = std::str::from_utf8(&b[FIXED..FIXED + n]).ok()?;
            let mut parts = s.splitn(3, '\0');
            Some(Arc::new(PodIdentity {
                namespace: parts.next().unwrap_or_default().to_string(),
                name: parts.next().unwrap_or_default().to_string(),
                uid: parts.next().unwrap_or_default().to_string(),
            }))
        }
    };
    let last = u64_at(16);
    let e = Event {
        kind,
        at_ms: u64_at(8),
        proto: b[5],
        pod: get_addr(&b[40..], bits & 1 != 0),
        pod_port: u16_at(24),
        egress: get_addr(&b[56..], bits & 2 != 0),
        egress_port: u16_at(26),
        remote: (bits & 8 != 0).then(|| (get_addr(&b[72..], bits & 4 != 0), u16_at(28))),
        last_ms: (last != u64::MAX).then_some(last),
        reason: EndReason::from_u8(b[6]),
        flags: b[7],
        quota: (b[31] != 0).then_some(b[31]),
        limit: (bits & 16 != 0).then(|| u32::from_le_bytes([b[32], b[33], b[34], b[35]])),
        block: (bits & 32 != 0).then(|| (u16_at(36), u16_at(38))),
        identity,
    };
    Some((e, FIXED + ident_len))
}

/// Every record of one segment's bytes, in order, up to a torn tail.
pub fn records(bytes: &[u8]) -> impl Iterator<Item = Event> + '_ {
    let mut rest = bytes.strip_prefix(MAGIC.as_slice()).unwrap_or(&[]);
    std::iter::from_fn(move || {
        let (e, n) = decode(rest)?;
        rest = &rest[n..];
        Some(e)
    })
}

/// What `egret who-had` asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Query {
    /// The egress address.
    pub egress: IpAddr,
    /// The egress port (ICMP: the identifier).
    pub egress_port: u16,
    /// When, Unix ms.
    pub at_ms: u64,
    /// Only this protocol number.
    pub proto: Option<u8>,
    /// Only sessions towards this remote.
    pub remote: Option<(IpAddr, u16)>,
}

impl Query {
    fn matches(&self, e: &Event) -> bool {
        matches!(e.kind, LogKind::SessionCreate | LogKind::SessionDelete)
            && e.egress == self.egress
            && e.egress_port == self.egress_port
            && self.proto.is_none_or(|p| p == e.proto)
            && self.remote.is_none_or(|r| e.remote == Some(r))
    }

    /// A port block's record whose block holds the asked port (every
    /// protocol, every remote: a block is the pod's in all of them).
    fn matches_block(&self, e: &Event) -> bool {
        matches!(e.kind, LogKind::BlockAllocate | LogKind::BlockFree)
            && e.egress == self.egress
            && e.block.is_some_and(|(end, _)| (e.egress_port..=end).contains(&self.egress_port))
    }
}

/// One session that held the address and port at T, from the journal: at
/// least one of its create and its delete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// Its create; `None`: not in this journal (the session was adopted
    /// from a peer, whose journal has it, or its segment was removed).
    pub create: Option<Event>,
    /// Its delete, after T; `None`: none in the journal (still live, or
    /// its delete was lost).
    pub delete: Option<Event>,
}

impl Held {
    /// The create, else the delete (they share the session's key).
    pub fn event(&self) -> Option<&Event> {
        self.create.as_ref().or(self.delete.as_ref())
    }
}

/// One port block that held the address and port at T (ADR 0034 §6):
/// at least one of its allocation and its release.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldBlock {
    /// Its allocation; `None`: not in this journal (adopted from a peer,
    /// or its segment was removed).
    pub allocate: Option<Event>,
    /// Its release, after T; `None`: none in the journal (still held, or
    /// its release was lost).
    pub free: Option<Event>,
}

impl HeldBlock {
    /// The allocation, else the release.
    pub fn event(&self) -> Option<&Event> {
        self.allocate.as_ref().or(self.free.as_ref())
    }
}

/// The journal's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The oldest segment's start, Unix ms (`None`: the journal is empty).
    pub starts_ms: Option<u64>,
    /// The sessions that held it at T.
    pub held: Vec<Held>,
    /// The port blocks that held it at T (pods in block mode log no
    /// sessions).
    pub blocks: Vec<HeldBlock>,
}

/// The session key records pair on (ADR 0034 §8).
type Key = (u8, IpAddr, u16, IpAddr, u16, Option<(IpAddr, u16)>);

fn key(e: &Event) -> Key {
    (e.proto, e.pod, e.pod_port, e.egress, e.egress_port, e.remote)
}

/// Answers `q` from the journal in `dir`.
pub fn who_had(dir: &Path, q: &Query) -> io::Result<Found> {
    let segs = segments(dir)?;
    let mut per_key: BTreeMap<Key, Vec<Event>> = BTreeMap::new();
    let mut per_block: BTreeMap<(IpAddr, IpAddr, u16), Vec<Event>> = BTreeMap::new();
    for s in &segs {
        let bytes = match fs::read(&s.path) {
            Ok(b) => b,
            // Removed by retention since it was listed.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for e in records(&bytes) {
            if q.matches(&e) {
                per_key.entry(key(&e)).or_default().push(e);
            } else if q.matches_block(&e) {
                per_block.entry((e.pod, e.egress, e.egress_port)).or_default().push(e);
            }
        }
    }
    let held = per_key.into_values().filter_map(|events| pair(events, q.at_ms)).collect();
    let blocks = per_block
        .into_values()
        .filter_map(|events| {
            let h = pair_as(events, q.at_ms, LogKind::BlockAllocate, LogKind::BlockFree)?;
            Some(HeldBlock { allocate: h.create, free: h.delete })
        })
        .collect();
    Ok(Found { starts_ms: segs.first().map(|s| s.start_ms), held, blocks })
}

/// One key's events: the latest create at or before `at_ms`, and the first
/// delete after it; `None` when the delete came at or before `at_ms` too.
///
/// Without a create at or before `at_ms`: when the key's first event in
/// the journal is a delete after `at_ms`, the session held the port at
/// `at_ms` with its create elsewhere (adopted from a peer, or in a removed
/// segment), and is answered without it. Any other key was free.
fn pair(events: Vec<Event>, at_ms: u64) -> Option<Held> {
    pair_as(events, at_ms, LogKind::SessionCreate, LogKind::SessionDelete)
}

/// [`pair`] for events whose beginning is `begin` and end `end` (a
/// session's create and delete, a block's allocation and release).
fn pair_as(mut events: Vec<Event>, at_ms: u64, begin: LogKind, end: LogKind) -> Option<Held> {
    events.sort_by_key(|e| e.at_ms);
    let Some(i) = events.iter().rposition(|e| e.kind == begin && e.at_ms <= at_ms) else {
        let first = events.first().filter(|e| e.kind == end && e.at_ms > at_ms)?;
        return Some(Held { create: None, delete: Some(first.clone()) });
    };
    let delete = events[i + 1..].iter().find(|e| e.kind == end).cloned();
    if delete.as_ref().is_some_and(|d| d.at_ms <= at_ms) {
        return None;
    }
    Some(Held { create: Some(events.swap_remove(i)), delete })
}

/// Whether `flags` marks a session adopted from a peer.
pub fn adopted(flags: u8) -> bool {
    flags & log_flags::ADOPTED != 0
}

#[cfg(test)]
mod tests;
