//! `egret who-had`'s answer (ADR 0034 §7): the journal's pairs
//! (`journal::who_had`) turned into rows, each session without a delete
//! looked up in the live session table.

use std::net::SocketAddr;
use std::path::Path;

use egret_dataplane::translog::log_flags;

use super::journal::{self, Held, HeldBlock, Query};
use super::{Clocks, Event};
use crate::view::{proto_name, SessionRow, WhoHadAnswer, WhoHadBlockRow, WhoHadQuery, WhoHadRow};

/// The protocol number of `--proto NAME` for an egress address of this
/// family.
pub fn proto_number(name: &str, v6: bool) -> Result<u8, String> {
    match name {
        "tcp" => Ok(6),
        "udp" => Ok(17),
        "icmp" if v6 => Ok(58),
        "icmp" => Ok(1),
        other => Err(format!("proto: \"{other}\": must be tcp, udp or icmp")),
    }
}

/// The question of `egret who-had ADDR:PORT --at TIME [--proto P]
/// [--remote ADDR:PORT]`; a malformed value is named with its flag.
pub fn query(target: &str, at: &str, proto: Option<&str>, remote: Option<&str>) -> Result<WhoHadQuery, String> {
    let addr_port = |flag: &str, v: &str| {
        v.trim().parse::<SocketAddr>().map_err(|_| {
            format!("{flag}: \"{v}\": not an address:port (e.g. \"203.0.113.10:41522\", \"[2001:db8::10]:41522\")")
        })
    };
    let egress = addr_port("ADDR:PORT", target)?;
    let at_ms = at
        .trim()
        .parse::<k8s_openapi::jiff::Timestamp>()
        .ok()
        .and_then(|t| u64::try_from(t.as_millisecond()).ok())
        .ok_or_else(|| format!("--at: \"{at}\": not an RFC 3339 time (e.g. \"2026-12-01T14:03:07Z\")"))?;
    if let Some(p) = proto {
        proto_number(p, egress.is_ipv6()).map_err(|e| format!("--{e}"))?;
    }
    let remote = remote.map(|r| addr_port("--remote", r)).transpose()?;
    Ok(WhoHadQuery { egress: egress.ip(), port: egress.port(), at_ms, proto: proto.map(str::to_string), remote })
}

/// The last packet (Unix ms) of the live session `e` is, among `rows`
/// (`egret sessions`' rows on its egress address, read at `clocks`).
pub fn live_in(rows: &[SessionRow], clocks: &Clocks, e: &Event) -> Option<u64> {
    rows.iter()
        .find(|r| {
            r.proto == proto_name(e.proto)
                && (r.pod, r.pod_port, r.egress, r.egress_port) == (e.pod, e.pod_port, e.egress, e.egress_port)
                && e.remote.is_none_or(|rem| rem == (r.remote, r.remote_port))
        })
        .map(|r| clocks.wall_ms.saturating_sub(r.idle_secs * 1000 / clocks.scale.max(1)))
}

/// Answers `q` from the journal in `dir`. `live` says, for a session the
/// journal has no delete for, whether the session table still holds it and
/// its last packet (Unix ms).
pub fn answer(dir: &Path, q: &WhoHadQuery, live: &dyn Fn(&Event) -> Option<u64>) -> Result<WhoHadAnswer, String> {
    let proto = q.proto.as_deref().map(|p| proto_number(p, q.egress.is_ipv6())).transpose()?;
    let query = Query {
        egress: q.egress,
        egress_port: q.port,
        at_ms: q.at_ms,
        proto,
        remote: q.remote.map(|r| (r.ip(), r.port())),
    };
    let found = journal::who_had(dir, &query)
        .map_err(|e| format!("reading the translation log journal in {}: {e}", dir.display()))?;
    let sessions: Vec<WhoHadRow> = found.held.into_iter().filter_map(|h| row(h, live)).collect();
    // A block answers only when no session record does (a pod in block
    // mode with `logSessions` has both; its sessions are the finer answer).
    let blocks: Vec<WhoHadBlockRow> =
        if sessions.is_empty() { found.blocks.into_iter().filter_map(block_row).collect() } else { Vec::new() };
    let before_journal = sessions.is_empty() && blocks.is_empty() && found.starts_ms.is_none_or(|s| q.at_ms < s);
    Ok(WhoHadAnswer { at_ms: q.at_ms, journal_starts_ms: found.starts_ms, before_journal, sessions, blocks })
}

fn block_row(h: HeldBlock) -> Option<WhoHadBlockRow> {
    let e = h.event()?;
    let identity = h.allocate.as_ref().and_then(|a| a.identity.clone()).or_else(|| e.identity.clone());
    Some(WhoHadBlockRow {
        pod: e.pod,
        egress: e.egress,
        first_port: e.egress_port,
        last_port: e.block.map_or(e.egress_port, |b| b.0),
        pod_identity: identity.as_deref().cloned(),
        allocated_ms: h.allocate.as_ref().map(|a| a.at_ms),
        freed_ms: h.free.as_ref().map(|f| f.at_ms),
    })
}

fn row(h: Held, live: &dyn Fn(&Event) -> Option<u64>) -> Option<WhoHadRow> {
    let c = h.event()?.clone();
    let Held { create, delete } = h;
    let live_last = if delete.is_none() { live(&c) } else { None };
    let adopted = delete.as_ref().is_some_and(|d| journal::adopted(d.flags));
    // The identity at the create; without one here, the delete's (the
    // address's holder when the delete was drained).
    let identity = create.as_ref().and_then(|c| c.identity.clone()).or_else(|| c.identity.clone());
    Some(WhoHadRow {
        proto: proto_name(c.proto).into(),
        pod: c.pod,
        pod_port: c.pod_port,
        egress: c.egress,
        egress_port: c.egress_port,
        remote: c.remote.map(|(a, p)| SocketAddr::new(a, p)),
        pod_identity: identity.as_deref().cloned(),
        created_ms: create.as_ref().map(|c| c.at_ms),
        last_ms: delete.as_ref().and_then(|d| d.last_ms).or(live_last),
        deleted_ms: delete.as_ref().map(|d| d.at_ms),
        reason: delete.as_ref().and_then(|d| d.reason).map(|r| r.name().to_string()),
        live: live_last.is_some(),
        adopted: adopted || c.flags & log_flags::ADOPTED != 0,
    })
}
