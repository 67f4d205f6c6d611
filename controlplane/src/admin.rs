//! The admin socket: a unix stream socket (path from `admin.socket`) where
//! the CLI asks a running daemon about itself.
//!
//! Protocol: one JSON request line, one JSON response line, then the daemon
//! closes the connection. Requests are tagged by `command`:
//! `{"command":"sessions","filter":{"pod":"198.18.0.7","limit":10}}`.
//! Responses are `{"ok":<payload>}` or `{"error":"<text>"}`. The payload
//! types live in [`crate::view`]. Read-only: nothing here changes the
//! gateway (reloads are `SIGHUP`).
//!
//! Access: the socket file has mode 0600 from the moment its path exists
//! ([`bind`] creates it inside a private 0700 directory, sets the mode, then
//! renames it into place), and [`serve`] admits a connection only when the
//! peer's credentials (`SO_PEERCRED`) name root or the user the daemon runs
//! as ([`admit`]); any other peer gets an error line, a warning in the log
//! and a count in `egret_admin_connections_refused_total`.
//!
//! [`render`] turns payloads into the CLI's human-readable tables.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

use crate::view::{
    BlockRow, Counters, GatewayView, PolicyRow, PortRow, SessionFilter, SessionRow, Status, WhoHadAnswer, WhoHadQuery,
};

/// A request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "lowercase")]
pub enum Request {
    /// Status.
    Status,
    /// Counters.
    Counters,
    /// Policies.
    Policies,
    /// Port usage.
    Ports,
    /// Port use per destination and pod (the last count's top N).
    #[serde(rename = "port-use")]
    PortUse,
    /// Port blocks per egress IP in block mode.
    #[serde(rename = "port-blocks")]
    PortBlocks,
    /// Sessions.
    Sessions {
        /// Which.
        #[serde(default)]
        filter: SessionFilter,
    },
    /// Who had an egress address and port at a time (the journal).
    #[serde(rename = "who-had")]
    WhoHad {
        /// The question.
        query: WhoHadQuery,
    },
}

/// A response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Response {
    /// The payload.
    Ok(serde_json::Value),
    /// What went wrong.
    Error(String),
}

/// Longest request line accepted.
const MAX_REQUEST: usize = 64 * 1024;

/// Answers one request from `view`.
pub fn answer(view: &dyn GatewayView, line: &str) -> Response {
    let req: Request = match serde_json::from_str(line.trim()) {
        Ok(r) => r,
        Err(e) => return Response::Error(format!("bad request: {e}")),
    };
    let value = match req {
        Request::Status => serde_json::to_value(view.status()),
        Request::Counters => serde_json::to_value(view.counters()),
        Request::Policies => serde_json::to_value(view.policies()),
        Request::Ports => serde_json::to_value(view.ports()),
        Request::PortUse => serde_json::to_value(&*view.port_use()),
        Request::PortBlocks => serde_json::to_value(view.port_blocks()),
        Request::Sessions { filter } => serde_json::to_value(view.sessions(&filter)),
        Request::WhoHad { query } => match view.who_had(&query) {
            Ok(a) => serde_json::to_value(a),
            Err(e) => return Response::Error(e),
        },
    };
    match value {
        Ok(v) => Response::Ok(v),
        Err(e) => Response::Error(format!("encoding the answer failed: {e}")),
    }
}

/// What failed on the admin socket.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// Binding the socket failed.
    #[error("admin socket {path}: {op} failed: {source}")]
    Bind {
        /// The path.
        path: String,
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// Talking to the daemon failed.
    #[error("admin socket {path}: {source} (is `egret gateway` running?)")]
    Connect {
        /// The path.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The daemon's answer was not understood.
    #[error("admin socket {path}: bad answer: {message}")]
    Protocol {
        /// The path.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// The daemon answered with an error.
    #[error("the daemon refused: {0}")]
    Refused(String),
}

/// Mode of the socket file: read and write (connect) for its owner only.
pub const SOCKET_MODE: u32 = 0o600;

/// Connections refused because of their peer's credentials, since start
/// (exported as `egret_admin_connections_refused_total`).
static REFUSED: AtomicU64 = AtomicU64::new(0);

/// Connections refused by [`admit`] since the process started.
pub fn refused_connections() -> u64 {
    REFUSED.load(Ordering::Relaxed)
}

/// The bound admin socket, and the user that owns it (the daemon's).
#[derive(Debug)]
pub struct AdminListener {
    listener: UnixListener,
    owner_uid: u32,
}

impl AdminListener {
    /// The uid that owns the socket file: the user the daemon runs as.
    pub fn owner_uid(&self) -> u32 {
        self.owner_uid
    }
}

/// Why a peer was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Its uid is neither root nor the daemon's.
    #[error("peer uid {peer} is neither root nor the daemon's uid {daemon}")]
    Uid {
        /// The peer's uid.
        peer: u32,
        /// The daemon's uid.
        daemon: u32,
    },
    /// Its credentials could not be read (`SO_PEERCRED` failed).
    #[error("peer credentials unreadable: {0}")]
    Unknown(String),
}

/// Whether a peer with uid `peer` may use the admin socket of a daemon
/// running as `daemon`: root, or the daemon's own user.
pub fn admit(peer: u32, daemon: u32) -> Result<(), Refusal> {
    if peer == 0 || peer == daemon {
        Ok(())
    } else {
        Err(Refusal::Uid { peer, daemon })
    }
}

/// Binds `path` with mode [`SOCKET_MODE`] (replacing a stale socket file,
/// creating the directory).
///
/// No moment exists where the path accepts connections with a wider mode:
/// the socket is bound inside a fresh directory beside `path` created with
/// mode 0700 (the umask can only narrow that), given its mode there, then
/// renamed onto `path` (atomic, and replaces a stale socket in one step).
pub fn bind(path: &Path) -> Result<AdminListener, AdminError> {
    let p = path.display().to_string();
    let err = |op: &'static str| {
        let p = p.clone();
        move |source| AdminError::Bind { path: p, op, source }
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(err("mkdir"))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "admin".into());
    let staging = dir.join(format!(".{name}.{}.bind", std::process::id()));
    match std::fs::remove_dir_all(&staging) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(source) => return Err(AdminError::Bind { path: p, op: "removing a stale staging directory", source }),
    }
    std::fs::DirBuilder::new().mode(0o700).create(&staging).map_err(err("creating the private staging directory"))?;
    let bound = (|| {
        let tmp = staging.join("sock");
        let listener = UnixListener::bind(&tmp).map_err(err("bind"))?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(SOCKET_MODE)).map_err(err("chmod 0600"))?;
        let owner_uid = std::fs::metadata(&tmp).map_err(err("stat"))?.uid();
        std::fs::rename(&tmp, path).map_err(err("renaming into place"))?;
        Ok(AdminListener { listener, owner_uid })
    })();
    let _ = std::fs::remove_dir_all(&staging);
    bound
}

/// Serves `listener` until the task is dropped. Each connection's peer
/// credentials are checked first ([`admit`]).
pub async fn serve(listener: AdminListener, view: Arc<dyn GatewayView>) {
    let AdminListener { listener, owner_uid } = listener;
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "admin socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let verdict = match stream.peer_cred() {
            Ok(cred) => admit(cred.uid(), owner_uid).map_err(|r| (r, cred.pid())),
            Err(e) => Err((Refusal::Unknown(e.to_string()), None)),
        };
        let view = view.clone();
        tokio::spawn(async move {
            let (r, mut w) = stream.into_split();
            // The request line is read (bounded in size and time) also from a
            // peer about to be refused: a client that is still writing when
            // the daemon closes would see EPIPE instead of the reason.
            let mut line = String::new();
            let mut reader = tokio::io::BufReader::new(r).take(MAX_REQUEST as u64);
            let read = tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line)).await;
            let resp = match (verdict, read) {
                (Err((refusal, pid)), _) => {
                    REFUSED.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(reason = %refusal, peer_pid = ?pid, "admin socket: connection refused");
                    Response::Error(format!("refused: {refusal}"))
                }
                // Off the runtime's threads: who-had reads the journal.
                (Ok(()), Ok(Ok(n))) if n > 0 => tokio::task::spawn_blocking(move || answer(view.as_ref(), &line))
                    .await
                    .unwrap_or_else(|e| Response::Error(format!("answering failed: {e}"))),
                (Ok(()), _) => Response::Error("no request line".into()),
            };
            let mut out = serde_json::to_vec(&resp).unwrap_or_default();
            out.push(b'\n');
            let _ = w.write_all(&out).await;
            let _ = w.shutdown().await;
        });
    }
}

use tokio::io::AsyncReadExt as _;

/// Sends `req` to the daemon at `path` and returns the payload (CLI side, blocking).
pub fn call(path: &Path, req: &Request) -> Result<serde_json::Value, AdminError> {
    let p = path.display().to_string();
    let conn = |source| AdminError::Connect { path: p.clone(), source };
    let mut s = UnixStream::connect(path).map_err(conn)?;
    s.set_read_timeout(Some(Duration::from_secs(30))).map_err(conn)?;
    let mut line =
        serde_json::to_vec(req).map_err(|e| AdminError::Protocol { path: p.clone(), message: e.to_string() })?;
    line.push(b'\n');
    s.write_all(&line).map_err(conn)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer).map_err(conn)?;
    match serde_json::from_str::<Response>(&answer) {
        Ok(Response::Ok(v)) => Ok(v),
        Ok(Response::Error(e)) => Err(AdminError::Refused(e)),
        Err(e) => Err(AdminError::Protocol { path: p, message: e.to_string() }),
    }
}

/// Human-readable tables for the CLI.
pub mod render {
    use super::*;

    fn table(header: &[&str], rows: &[Vec<String>]) -> String {
        let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
        for r in rows {
            for (i, c) in r.iter().enumerate() {
                if let Some(w) = widths.get_mut(i) {
                    *w = (*w).max(c.len());
                }
            }
        }
        let mut out = String::new();
        let line = |cells: Vec<&str>, out: &mut String| {
            let mut l = String::new();
            for (i, c) in cells.iter().enumerate() {
                if i + 1 == cells.len() {
                    l.push_str(c);
                } else {
                    l.push_str(&format!("{c:<w$}  ", w = widths[i]));
                }
            }
            out.push_str(l.trim_end());
            out.push('\n');
        };
        line(header.to_vec(), &mut out);
        for r in rows {
            line(r.iter().map(String::as_str).collect(), &mut out);
        }
        out
    }

    /// `egret status`.
    pub fn status(s: &Status) -> String {
        let mut out = format!(
            "config      {}\ngeneration  {}\nuptime      {} s\nready       {}\nsessions    {} IPv4, {} IPv6 (capacity {} IPv4, {} IPv6)\nfib         {} routes, {} neighbours (generation {})\nreloads     {} ok, {} rejected\n",
            s.config_file,
            s.generation,
            s.uptime_secs,
            if s.ready { "yes" } else { "no" },
            s.sessions.0,
            s.sessions.1,
            s.session_capacity.0,
            s.session_capacity.1,
            s.fib_routes,
            s.fib_neighbors,
            s.fib_generation,
            s.reloads,
            s.reload_failures
        );
        if !s.restart_pending.is_empty() {
            out.push_str(&format!("restart     needed for: {}\n", s.restart_pending.join(", ")));
        }
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .interfaces
            .iter()
            .map(|i| {
                vec![
                    i.name.clone(),
                    i.ifindex.to_string(),
                    i.role.clone(),
                    i.mac.clone(),
                    format!("{}{}", i.xdp_mode, if i.attached { "" } else { " (detached)" }),
                    i.queues.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(&["INTERFACE", "IFINDEX", "ROLE", "MAC", "XDP", "QUEUES"], &rows));
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .workers
            .iter()
            .map(|w| {
                vec![
                    w.id.to_string(),
                    w.thread.clone(),
                    if w.running { "running".into() } else { "stopped".into() },
                    w.cpu.map_or("-".into(), |c| c.to_string()),
                ]
            })
            .collect();
        out.push_str(&table(&["WORKER", "THREAD", "STATE", "CPU"], &rows));
        out.push('\n');
        let rows: Vec<Vec<String>> = s
            .owned
            .iter()
            .map(|o| {
                vec![
                    o.ip.to_string(),
                    if o.egress { "egress".into() } else { "neighbor".into() },
                    if o.ports.is_empty() { "-".into() } else { o.ports.clone() },
                    if o.answer_neighbor { "yes".into() } else { "no".into() },
                    if o.served { "yes".into() } else { "no (dormant: sessions kept)".into() },
                ]
            })
            .collect();
        out.push_str(&table(&["ADDRESS", "KIND", "PORTS", "ANSWERS ARP/NDP", "SERVED"], &rows));
        if let Some(c) = &s.cluster {
            out.push_str(&cluster(c));
        }
        if !s.policy_errors.is_empty() {
            out.push_str("\npolicy errors:\n");
            for e in &s.policy_errors {
                out.push_str(&format!("  {e}\n"));
            }
        }
        out
    }

    /// Kubernetes mode: who holds which IP and why, the standbys, the peers.
    fn cluster(c: &crate::view::ClusterReport) -> String {
        let yn = |b: bool| if b { "yes".to_string() } else { "no".to_string() };
        let mut out = format!(
            "\nnode {}: last pass {} ms ago; channel between gateways: {}\n",
            c.node,
            c.last_pass_ms,
            if !c.ha {
                "off".to_string()
            } else if c.end_authenticated {
                "on (a crashed peer is told from a silent one)".to_string()
            } else {
                "on, WITHOUT TCP-MD5 (a crashed peer waits for its Lease)".to_string()
            }
        );
        let rows: Vec<Vec<String>> = c
            .leases
            .iter()
            .map(|l| {
                let state = match (l.held_here, l.renew_failing) {
                    (true, true) => "held (API unreachable: failsafe)".to_string(),
                    (true, false) => "held".to_string(),
                    (false, _) if l.dormant_here => {
                        "dormant here (fenced, sessions kept; taking the Lease back)".to_string()
                    }
                    (false, _) => match &l.holder {
                        Some(h) => format!("held by {h}"),
                        None => "free".to_string(),
                    },
                };
                let state = match &l.cloud {
                    Some(c) => format!("{state}; {c}"),
                    None => state,
                };
                vec![
                    match l.public_ip {
                        Some(p) => format!("{} ({p})", l.ip),
                        None => l.ip.to_string(),
                    },
                    state,
                    l.valid_for_ms.map_or("-".into(), |v| format!("{v} ms")),
                    l.candidates.join(","),
                    match (&l.standby, l.standby_in_sync) {
                        (Some(s), Some(sync)) => format!("{s} ({})", if sync { "in sync" } else { "syncing" }),
                        _ => "-".into(),
                    },
                ]
            })
            .collect();
        out.push_str(&match &c.liveness {
            None => "ownership: perIP (each egress IP's Lease renewed)\n".to_string(),
            Some(l) => format!(
                "ownership: liveness Lease {}, epoch {}, {}; lost {} times, expired {} peers' Leases\n",
                l.lease,
                l.epoch,
                l.valid_for_ms.map_or("NOT VALID (nothing served or taken until it is renewed)".into(), |v| format!(
                    "valid for {v} ms"
                )),
                l.lost,
                l.expired
            ),
        });
        out.push_str(&table(&["EGRESS IP", "LEASE", "VALID FOR", "CANDIDATES", "STANDBY"], &rows));
        if !c.cloud_interfaces.is_empty() {
            out.push('\n');
            let rows: Vec<Vec<String>> = c
                .cloud_interfaces
                .iter()
                .map(|i| {
                    vec![
                        i.subnet.clone(),
                        i.interface.clone().unwrap_or_else(|| "-".into()),
                        match (&i.error, i.source_dest_check) {
                            (Some(e), _) => e.clone(),
                            (None, true) => "source/destination check ON: traffic dropped; turn it off".into(),
                            (None, false) => "ok".into(),
                        },
                    ]
                })
                .collect();
            out.push_str(&table(&["SUBNET", "INTERFACE", "STATE"], &rows));
        }
        if !c.cloud_nodes.is_empty() {
            out.push('\n');
            let rows: Vec<Vec<String>> = c
                .cloud_nodes
                .iter()
                .map(|n| {
                    let state = match (&n.private_ip, &n.interface, &n.error) {
                        (Some(p), Some(i), _) => format!("associated with {p} on {i}"),
                        (_, _, Some(e)) => format!("not associated: {e}"),
                        _ => "associating".into(),
                    };
                    vec![n.node.clone(), n.public_ip.to_string(), state]
                })
                .collect();
            out.push_str(&table(&["NODE (PerNode)", "PUBLIC IP", "STATE"], &rows));
        }
        if c.ha {
            out.push('\n');
            if let Some((primary, accepted)) = c.channel_keys.split_first() {
                out.push_str(&format!(
                    "channel keys: primary {primary}{}\n",
                    if accepted.is_empty() {
                        String::new()
                    } else {
                        format!(", also accepted {}", accepted.join(", "))
                    }
                ));
            }
            let rows: Vec<Vec<String>> = c
                .peers
                .iter()
                .map(|p| {
                    vec![
                        p.name.clone(),
                        p.addr.clone(),
                        p.state.clone(),
                        format!("{} ms", p.since_ms),
                        p.key.clone().unwrap_or_else(|| "-".into()),
                        p.last_end.clone().unwrap_or_else(|| "-".into()),
                    ]
                })
                .collect();
            out.push_str(&table(&["PEER", "ADDRESS", "STATE", "SINCE", "KEY", "LAST END"], &rows));
            if !c.shadows.is_empty() {
                out.push('\n');
                let rows: Vec<Vec<String>> = c
                    .shadows
                    .iter()
                    .map(|x| {
                        vec![
                            x.ip.to_string(),
                            x.holder.clone(),
                            x.sessions.to_string(),
                            yn(x.in_sync),
                            format!("{} ms", x.age_ms),
                        ]
                    })
                    .collect();
                out.push_str(&table(&["STANDBY FOR", "HOLDER", "SESSIONS", "COMPLETE", "LAST MESSAGE"], &rows));
            }
        }
        out
    }

    /// `egret counters`: non-zero drops and events, every XDP verdict that
    /// moved, the fast path's outcomes, rings.
    pub fn counters(c: &Counters) -> String {
        let mut out = format!(
            "forwarded {}  answered {}  misdirected {}  announcements {}\n\n",
            c.forwarded, c.answered, c.misdirected, c.announcements
        );
        let nonzero = |v: &[(String, u64)]| -> Vec<Vec<String>> {
            v.iter().filter(|(_, n)| *n > 0).map(|(k, n)| vec![k.clone(), n.to_string()]).collect()
        };
        out.push_str(&table(&["DROP REASON", "FRAMES"], &nonzero(&c.drops)));
        out.push('\n');
        out.push_str(&table(&["EVENT", "COUNT"], &nonzero(&c.events)));
        out.push('\n');
        out.push_str(&table(&["XDP VERDICT", "FRAMES"], &nonzero(&c.xdp)));
        out.push('\n');
        let f = &c.fast_path;
        if f.enabled {
            out.push_str(&format!(
                "fast path on: {} of {} IPv4 + {} of {} IPv6 sessions in the kernel, {} next hops ({} updates, {} re-routed)\n\n",
                f.sessions_v4, f.capacity_v4, f.sessions_v6, f.capacity_v6, f.next_hops, f.next_hop_updates, f.rerouted
            ));
            out.push_str(&table(&["FAST PATH", "FRAMES"], &nonzero(&f.packets)));
            out.push('\n');
            out.push_str(&table(&["OFFLOAD", "SESSIONS"], &nonzero(&f.offloads)));
            out.push('\n');
            out.push_str(&table(&["REMOVAL", "SESSIONS"], &nonzero(&f.removals)));
            out.push('\n');
        } else {
            out.push_str("fast path off (xdp.fastPath: false)\n\n");
        }
        let t = &c.translog;
        if t.enabled {
            let sum = |v: &[(String, u64)]| v.iter().map(|(_, n)| n).sum::<u64>();
            let lost: u64 = t.dropped.iter().map(|(_, _, n)| n).sum();
            out.push_str(&format!(
                "translation logs on: {} records taken, {} events sent, {} lost in the exporter, {} sends found the collector unreachable\n",
                sum(&t.records),
                sum(&t.sent),
                lost,
                sum(&t.unreachable)
            ));
            if let Some(bytes) = t.journal_bytes {
                let since = t.journal_oldest_ms.map_or("nothing written yet".to_string(), |ms| {
                    format!("egret who-had answers from {}", crate::translog::syslog::rfc3339_ms(ms))
                });
                out.push_str(&format!("journal: {bytes} bytes; {since}\n"));
            }
            let rows: Vec<Vec<String>> = t
                .dropped
                .iter()
                .filter(|(_, _, n)| *n > 0)
                .map(|(s, r, n)| vec![s.clone(), r.clone(), n.to_string()])
                .collect();
            out.push_str(&table(&["SINK", "LOST", "EVENTS"], &rows));
            out.push('\n');
        }
        let rows: Vec<Vec<String>> = c
            .rings
            .iter()
            .map(|r| {
                vec![
                    r.worker.to_string(),
                    r.interface.clone(),
                    r.queue.to_string(),
                    r.rx.to_string(),
                    r.tx.to_string(),
                    r.tx_ring_full.to_string(),
                    r.fill_ring_empty.to_string(),
                    r.kernel_rx_dropped.to_string(),
                    r.kernel_rx_ring_full.to_string(),
                    r.kernel_rx_fill_ring_empty_descs.to_string(),
                ]
            })
            .collect();
        out.push_str(&table(
            &[
                "WORKER",
                "INTERFACE",
                "QUEUE",
                "RX",
                "TX",
                "TX_FULL",
                "POOL_EMPTY",
                "K_RX_DROP",
                "K_RX_FULL",
                "K_FILL_EMPTY",
            ],
            &rows,
        ));
        out
    }

    /// `egret policies`.
    pub fn policies(p: &[PolicyRow]) -> String {
        let rows: Vec<Vec<String>> = p
            .iter()
            .map(|p| {
                vec![
                    p.name.clone(),
                    p.sources.join(","),
                    p.destinations.join(","),
                    if p.except.is_empty() { "-".into() } else { p.except.join(",") },
                    p.egress_ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(","),
                    format!("{}/{}", p.packets_out, p.bytes_out),
                    format!("{}/{}", p.packets_in, p.bytes_in),
                ]
            })
            .collect();
        table(&["POLICY", "SOURCES", "DESTINATIONS", "EXCEPT", "EGRESS IPS", "OUT PKTS/BYTES", "IN PKTS/BYTES"], &rows)
    }

    /// `n` of `of` as a percentage with one decimal; `-` when `of` is 0.
    fn percent(n: u64, of: u64) -> String {
        if of == 0 {
            "-".to_string()
        } else {
            format!("{:.1}%", n as f64 * 100.0 / of as f64)
        }
    }

    /// `egret ports`.
    pub fn ports(p: &[PortRow]) -> String {
        let rows: Vec<Vec<String>> = p
            .iter()
            .map(|r| {
                vec![
                    r.egress_ip.to_string(),
                    r.proto.clone(),
                    r.in_use.to_string(),
                    r.capacity.to_string(),
                    percent(r.in_use, r.capacity),
                    r.exhausted.to_string(),
                ]
            })
            .collect();
        table(&["EGRESS IP", "PROTO", "IN USE", "CAPACITY", "USED", "EXHAUSTED"], &rows)
    }

    /// `egret port-blocks`.
    pub fn port_blocks(b: &[BlockRow]) -> String {
        let rows: Vec<Vec<String>> = b
            .iter()
            .map(|r| {
                vec![
                    r.egress_ip.to_string(),
                    if r.configured { format!("{}", r.block_size) } else { format!("{} (leaving)", r.block_size) },
                    r.max_per_pod.to_string(),
                    r.in_use.to_string(),
                    r.capacity.to_string(),
                    percent(r.in_use, r.capacity),
                    r.pods.to_string(),
                    r.exhausted.to_string(),
                    r.pod_limit.to_string(),
                ]
            })
            .collect();
        table(
            &[
                "EGRESS IP",
                "BLOCK SIZE",
                "MAX PER POD",
                "BLOCKS HELD",
                "BLOCKS",
                "USED",
                "PODS",
                "EXHAUSTED",
                "POD LIMIT",
            ],
            &rows,
        )
    }

    /// `egret port-use`: the last count's top destinations and pods per
    /// egress IP and protocol, against their limits.
    pub fn port_use(u: &crate::port_use::PortUse) -> String {
        let mut rows: Vec<Vec<String>> = Vec::new();
        for p in &u.pools {
            let mut row = |what: &str, who: String, n: u64, limit: Option<u64>| {
                rows.push(vec![
                    p.egress_ip.to_string(),
                    p.proto.clone(),
                    what.into(),
                    who,
                    n.to_string(),
                    limit.map_or("-".into(), |l| l.to_string()),
                    limit.map_or("-".into(), |l| percent(n, l)),
                ]);
            };
            if !p.endpoint_dependent {
                row("egress IP", "-".into(), p.in_use, Some(p.capacity));
            }
            for d in &p.destinations {
                row("destination", d.remote.to_string(), d.in_use, Some(p.capacity));
            }
            for pod in &p.pods {
                let who = match pod.remote {
                    Some(r) => format!("{} -> {r}", pod.pod),
                    None => pod.pod.to_string(),
                };
                row("pod", who, pod.in_use, p.pod_quota);
            }
        }
        let head = format!(
            "counted in {:.1} ms over {} entries; {} warnings since start\n",
            u.walk_micros as f64 / 1000.0,
            u.entries,
            u.warnings
        );
        head + &table(&["EGRESS IP", "PROTO", "WHAT", "WHO", "IN USE", "LIMIT", "USED"], &rows)
    }

    /// `egret sessions`.
    pub fn sessions(s: &[SessionRow]) -> String {
        let rows: Vec<Vec<String>> = s
            .iter()
            .map(|r| {
                let ep = |a: &std::net::IpAddr, p: u16| match a {
                    std::net::IpAddr::V6(_) => format!("[{a}]:{p}"),
                    std::net::IpAddr::V4(_) => format!("{a}:{p}"),
                };
                vec![
                    r.proto.clone(),
                    ep(&r.pod, r.pod_port),
                    ep(&r.egress, r.egress_port),
                    ep(&r.remote, r.remote_port),
                    r.idle_secs.to_string(),
                    if r.state.is_empty() { "-".into() } else { r.state.clone() },
                    if r.offloaded { "xdp".into() } else { "workers".into() },
                ]
            })
            .collect();
        table(&["PROTO", "POD", "EGRESS", "REMOTE", "IDLE", "STATE", "PATH"], &rows)
    }

    /// `egret who-had`: a table of the sessions that held the address and
    /// port, or why there is none.
    pub fn who_had(q: &WhoHadQuery, a: &WhoHadAnswer) -> String {
        let rfc3339 = crate::translog::syslog::rfc3339_ms;
        let ep = |a: std::net::IpAddr, p: u16| std::net::SocketAddr::new(a, p).to_string();
        let asked =
            format!("{}{}", ep(q.egress, q.port), q.proto.as_deref().map(|p| format!("/{p}")).unwrap_or_default());
        if a.sessions.is_empty() && !a.blocks.is_empty() {
            // "the block P..Q on IP was held by pod X from T1 to T2"
            let mut out = format!("{asked} at {}: no session record; held by a port block:\n", rfc3339(a.at_ms));
            for b in &a.blocks {
                let pod = b.pod_identity.as_ref().map_or_else(
                    || b.pod.to_string(),
                    |i| format!("{}/{} ({}, uid {})", i.namespace, i.name, b.pod, i.uid),
                );
                let from = b.allocated_ms.map_or("before the journal".to_string(), rfc3339);
                let to = b.freed_ms.map_or("now, or a release not recorded".to_string(), rfc3339);
                out.push_str(&format!(
                    "the block {}..{} on {} was held by pod {pod} from {from} to {to}\n",
                    b.first_port, b.last_port, b.egress
                ));
            }
            return out;
        }
        if a.sessions.is_empty() {
            return match (a.before_journal, a.journal_starts_ms) {
                (true, Some(s)) => format!(
                    "{asked} at {}: the journal starts at {}: ask the collector\n",
                    rfc3339(a.at_ms),
                    rfc3339(s)
                ),
                (true, None) => format!("{asked} at {}: the journal is empty: ask the collector\n", rfc3339(a.at_ms)),
                (false, _) => format!("{asked} at {}: no session held it\n", rfc3339(a.at_ms)),
            };
        }
        let rows: Vec<Vec<String>> = a
            .sessions
            .iter()
            .map(|r| {
                let pod = r.pod_identity.as_ref().map_or("-".to_string(), |i| format!("{}/{}", i.namespace, i.name));
                vec![
                    pod,
                    r.pod_identity.as_ref().map_or("-".to_string(), |i| i.uid.clone()),
                    r.proto.clone(),
                    ep(r.pod, r.pod_port),
                    r.remote.map_or("-".to_string(), |s| s.to_string()),
                    r.created_ms.map_or_else(
                        || match (r.adopted, r.reason.as_deref()) {
                            (true, _) => "adopted (peer's journal)".into(),
                            (false, Some("not-adopted")) => "peer's journal (not adopted)".into(),
                            _ => "not in the journal".into(),
                        },
                        rfc3339,
                    ),
                    r.last_ms.map_or("-".to_string(), rfc3339),
                    match (r.deleted_ms, r.live) {
                        // ADR 0034 §8: the next holder's journal has its end.
                        (Some(d), _) if r.reason.as_deref() == Some("handed-over") => {
                            format!("{} (handed-over: its end is the next holder's)", rfc3339(d))
                        }
                        (Some(d), _) => format!("{} ({})", rfc3339(d), r.reason.as_deref().unwrap_or("unknown")),
                        (None, true) => "live".into(),
                        (None, false) => "not recorded".into(),
                    },
                ]
            })
            .collect();
        format!(
            "{asked} at {}:\n{}",
            rfc3339(a.at_ms),
            table(&["POD", "UID", "PROTO", "POD ADDRESS", "REMOTE", "CREATED", "LAST PACKET", "DELETED"], &rows)
        )
    }
}

#[cfg(test)]
pub(crate) mod tests;
