//! The admin protocol and its rendering against a fake gateway.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::IpAddr;

use super::*;
use crate::view::{InterfaceStatus, OwnedIp, RingStats, WorkerStatus};

/// A gateway with fixed state, shared with the metrics tests.
pub(crate) struct Fake;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn sessions() -> Vec<SessionRow> {
    let s = |proto: &str, pod: &str, pp, eg: &str, ep, state: &str| SessionRow {
        proto: proto.into(),
        pod: ip(pod),
        pod_port: pp,
        egress: ip(eg),
        egress_port: ep,
        remote: ip("198.51.100.1"),
        remote_port: 53,
        idle_secs: 3,
        state: state.into(),
        offloaded: state == "established",
    };
    vec![
        s("udp", "198.18.0.7", 40000, "203.0.113.10", 40000, ""),
        s("tcp", "198.18.0.7", 40001, "203.0.113.10", 40001, "established"),
        s("udp", "198.18.0.8", 40000, "203.0.113.10", 51234, ""),
        s("udp", "198.18.0.9", 1000, "203.0.113.11", 1000, ""),
    ]
}

impl GatewayView for Fake {
    fn status(&self) -> Status {
        Status {
            cluster: None,
            config_file: "/etc/egret/gw.yaml".into(),
            generation: 7,
            uptime_secs: 12,
            ready: true,
            interfaces: vec![InterfaceStatus {
                name: "eth1".into(),
                ifindex: 3,
                role: "both".into(),
                mac: "02:00:00:00:00:01".into(),
                xdp_mode: "native".into(),
                attached: true,
                queues: 1,
            }],
            workers: vec![WorkerStatus { id: 0, thread: "egret-worker-0".into(), running: true, cpu: Some(1) }],
            owned: vec![OwnedIp {
                ip: ip("203.0.113.10"),
                ports: "32768-60999".into(),
                answer_neighbor: true,
                egress: true,
                served: true,
            }],
            policy_errors: vec![],
            restart_pending: vec!["workers".into()],
            reloads: 3,
            reload_failures: 2,
            apply_failures: 5,
            fail_closed_errors: 1,
            fail_closed_repairs: 0,
            sessions: (4, 1),
            session_capacity: (1 << 20, 1 << 16),
            fib_routes: 2,
            fib_neighbors: 1,
            fib_generation: 3,
        }
    }

    fn counters(&self) -> Counters {
        use egret_dataplane::stats::{DropReason, Event};
        Counters {
            forwarded: 20,
            answered: 1,
            misdirected: 1,
            drops: DropReason::ALL
                .iter()
                .map(|r| (r.name().to_string(), if *r == DropReason::PortsExhausted { 3 } else { 0 }))
                .collect(),
            events: Event::ALL
                .iter()
                .map(|e| (e.name().to_string(), if *e == Event::SessionCreatedOutbound { 4 } else { 0 }))
                .collect(),
            xdp: vec![("redirect_steered_source".into(), 11), ("pass_not_ip".into(), 0)],
            rings: vec![RingStats {
                worker: 0,
                interface: "eth1".into(),
                queue: 0,
                rx: 21,
                tx: 20,
                kernel_rx_ring_full: 5,
                ..Default::default()
            }],
            announcements: 2,
            fast_path: crate::view::FastPathCounters {
                enabled: true,
                sessions_v4: 3,
                sessions_v6: 0,
                capacity_v4: 4096,
                capacity_v6: 0,
                next_hops: 2,
                packets: vec![("hit".into(), 500), ("miss".into(), 7), ("punt_ttl".into(), 0)],
                offloads: vec![("installed".into(), 3), ("refused_map_full".into(), 1)],
                removals: vec![("removed".into(), 0), ("fenced".into(), 2)],
                next_hop_updates: 1,
                rerouted: 0,
            },
            translog: crate::view::TranslogCounters {
                enabled: true,
                records: vec![("session_create".into(), 5), ("session_delete".into(), 4)],
                session_ends: vec![("expired".into(), 3), ("not-adopted".into(), 1)],
                sent: vec![("ipfix".into(), 9), ("syslog".into(), 8)],
                dropped: vec![("syslog".into(), "send_error".into(), 1)],
                unreachable: vec![("ipfix".into(), 0), ("syslog".into(), 2)],
                journal_bytes: Some(4096),
                journal_oldest_ms: Some(1_796_126_400_000),
                identity_unresolved: 3,
            },
        }
    }

    fn policies(&self) -> Vec<PolicyRow> {
        vec![PolicyRow {
            name: "team-a".into(),
            sources: vec!["198.18.0.0/24".into()],
            destinations: vec!["0.0.0.0/0".into()],
            except: vec![],
            egress_ips: vec![ip("203.0.113.10")],
            packets_out: 10,
            bytes_out: 1000,
            packets_in: 9,
            bytes_in: 900,
        }]
    }

    fn ports(&self) -> Vec<PortRow> {
        vec![PortRow { egress_ip: ip("203.0.113.10"), proto: "udp".into(), in_use: 4, capacity: 28232, exhausted: 3 }]
    }

    fn sessions(&self, filter: &SessionFilter) -> Vec<SessionRow> {
        sessions().into_iter().filter(|s| filter.matches(s)).take(filter.limit.unwrap_or(usize::MAX)).collect()
    }
}

#[test]
fn requests_have_a_stable_wire_form() {
    assert_eq!(serde_json::to_string(&Request::Status).unwrap(), r#"{"command":"status"}"#);
    let r = Request::Sessions {
        filter: SessionFilter {
            pod: Some(ip("198.18.0.7")),
            proto: Some("udp".into()),
            limit: Some(5),
            egress_ip: None,
        },
    };
    let wire = serde_json::to_string(&r).unwrap();
    assert_eq!(
        wire,
        r#"{"command":"sessions","filter":{"egress_ip":null,"pod":"198.18.0.7","proto":"udp","limit":5}}"#
    );
    assert_eq!(serde_json::from_str::<Request>(&wire).unwrap(), r);
    assert_eq!(
        serde_json::from_str::<Request>(r#"{"command":"sessions"}"#).unwrap(),
        Request::Sessions { filter: SessionFilter::default() }
    );
}

#[test]
fn answers_filter_and_refuse() {
    let Response::Ok(v) = answer(&Fake, r#"{"command":"sessions","filter":{"pod":"198.18.0.7","proto":"udp"}}"#) else {
        panic!("refused")
    };
    let rows: Vec<SessionRow> = serde_json::from_value(v).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].pod_port, rows[0].egress_port), (40000, 40000));
    let Response::Ok(v) = answer(&Fake, r#"{"command":"sessions","filter":{"egress_ip":"203.0.113.10","limit":2}}"#)
    else {
        panic!("refused")
    };
    assert_eq!(serde_json::from_value::<Vec<SessionRow>>(v).unwrap().len(), 2);
    assert_eq!(
        answer(&Fake, r#"{"command":"reboot"}"#),
        Response::Error(
            "bad request: unknown variant `reboot`, expected one of `status`, `counters`, `policies`, `ports`, `port-use`, `port-blocks`, `sessions`, `who-had` at line 1 column 19"
                .into()
        )
    );
    let Response::Ok(v) = answer(&Fake, "{\"command\":\"status\"}\n") else { panic!("refused") };
    assert_eq!(serde_json::from_value::<Status>(v).unwrap(), Fake.status());
}

#[test]
fn tables_for_people() {
    assert_eq!(
        render::ports(&Fake.ports()),
        "EGRESS IP     PROTO  IN USE  CAPACITY  USED  EXHAUSTED\n203.0.113.10  udp    4       28232     0.0%  3\n"
    );
    assert_eq!(
        render::sessions(&Fake.sessions(&SessionFilter { pod: Some(ip("198.18.0.7")), ..Default::default() })),
        "PROTO  POD               EGRESS              REMOTE           IDLE  STATE        PATH\n\
         udp    198.18.0.7:40000  203.0.113.10:40000  198.51.100.1:53  3     -            workers\n\
         tcp    198.18.0.7:40001  203.0.113.10:40001  198.51.100.1:53  3     established  xdp\n"
    );
    let c = render::counters(&Fake.counters());
    assert!(c.starts_with("forwarded 20  answered 1  misdirected 1  announcements 2\n"), "{c}");
    assert!(c.contains("\nports_exhausted  3\n"), "only non-zero drops: {c}");
    assert!(!c.contains("no_route"), "{c}");
    assert!(c.contains("fast path on: 3 of 4096 IPv4 + 0 of 0 IPv6 sessions in the kernel, 2 next hops"), "{c}");
    assert!(c.contains("\nhit        500\n") && !c.contains("punt_ttl"), "{c}");
    assert!(c.contains("\nrefused_map_full  1\n") && c.contains("\nfenced   2\n"), "{c}");
    let s = render::status(&Fake.status());
    assert!(s.contains("generation  7\n") && s.contains("restart     needed for: workers\n"), "{s}");
    assert!(s.contains("eth1       3        both  02:00:00:00:00:01  native  1\n"), "{s}");
    assert!(s.contains("203.0.113.10  egress  32768-60999  yes              yes\n"), "{s}");
    let u = crate::port_use::PortUse {
        pools: vec![
            crate::port_use::PoolUse {
                egress_ip: ip("203.0.113.10"),
                proto: "tcp".into(),
                endpoint_dependent: true,
                in_use: 30000,
                capacity: 28232,
                pod_quota: Some(7058),
                destinations: vec![crate::port_use::DestinationUse {
                    remote: "198.51.100.7:443".parse().unwrap(),
                    in_use: 25000,
                }],
                pods: vec![crate::port_use::PodUse {
                    pod: ip("198.18.0.7"),
                    remote: Some("198.51.100.7:443".parse().unwrap()),
                    in_use: 7000,
                }],
            },
            crate::port_use::PoolUse {
                egress_ip: ip("203.0.113.10"),
                proto: "udp".into(),
                endpoint_dependent: false,
                in_use: 4,
                capacity: 28232,
                pod_quota: None,
                destinations: vec![],
                pods: vec![crate::port_use::PodUse { pod: ip("198.18.0.7"), remote: None, in_use: 4 }],
            },
        ],
        entries: 3,
        walk_micros: 1500,
        warnings: 2,
    };
    assert_eq!(
        render::port_use(&u),
        "counted in 1.5 ms over 3 entries; 2 warnings since start\n\
         EGRESS IP     PROTO  WHAT         WHO                             IN USE  LIMIT  USED\n\
         203.0.113.10  tcp    destination  198.51.100.7:443                25000   28232  88.6%\n\
         203.0.113.10  tcp    pod          198.18.0.7 -> 198.51.100.7:443  7000    7058   99.2%\n\
         203.0.113.10  udp    egress IP    -                               4       28232  0.0%\n\
         203.0.113.10  udp    pod          198.18.0.7                      4       -      -\n"
    );
    let p = render::policies(&Fake.policies());
    assert!(p.contains("team-a  198.18.0.0/24  0.0.0.0/0     -       203.0.113.10  10/1000         9/900\n"), "{p}");
}

#[tokio::test(flavor = "current_thread")]
async fn over_a_real_unix_socket() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/egret.sock");
    let listener = bind(&path).unwrap();
    let server = tokio::spawn(serve(listener, std::sync::Arc::new(Fake)));
    let p = path.clone();
    let got = tokio::task::spawn_blocking(move || call(&p, &Request::Ports)).await.unwrap().unwrap();
    assert_eq!(serde_json::from_value::<Vec<PortRow>>(got).unwrap(), Fake.ports());
    // Rebinding over a stale socket file works (a daemon restarted after a crash).
    server.abort();
    let _ = server.await;
    assert!(bind(&path).is_ok());
    let missing = call(&dir.path().join("none.sock"), &Request::Status).unwrap_err();
    assert!(missing.to_string().contains("none.sock: No such file or directory"), "{missing}");
}

#[test]
fn admits_root_and_the_daemons_own_user_only() {
    // (peer uid, daemon uid, admitted)
    let cases =
        [(0, 0, true), (0, 1000, true), (1000, 1000, true), (1000, 0, false), (65534, 0, false), (1001, 1000, false)];
    for (peer, daemon, ok) in cases {
        assert_eq!(admit(peer, daemon).is_ok(), ok, "peer {peer}, daemon {daemon}");
    }
    assert_eq!(admit(65534, 0).unwrap_err().to_string(), "peer uid 65534 is neither root nor the daemon's uid 0");
}

/// A private directory for one test's socket, removed afterwards.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("egret-admin-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_socket_is_created_0600_and_replaces_a_stale_one() {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let dir = TempDir::new("mode");
    let path = dir.0.join("run/egret.sock");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"stale").unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let listener = rt.block_on(async { bind(&path) }).unwrap();
    let meta = std::fs::symlink_metadata(&path).unwrap();
    assert!(meta.file_type().is_socket(), "{} is not a socket", path.display());
    assert_eq!(meta.mode() & 0o7777, SOCKET_MODE, "mode {:o}", meta.mode() & 0o7777);
    assert_eq!(listener.owner_uid(), meta.uid());
    // Nothing is left behind beside it (the staging directory is gone).
    let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left, ["egret.sock"]);
    // And it serves its owner.
    let view: Arc<dyn GatewayView> = Arc::new(Fake);
    rt.block_on(async {
        let task = tokio::spawn(serve(listener, view));
        let p = path.clone();
        let v = tokio::task::spawn_blocking(move || call(&p, &Request::Status)).await.unwrap().unwrap();
        assert_eq!(v["generation"], 7);
        task.abort();
    });
}

/// A peer of another user is refused by its credentials even when the
/// file's mode would let it connect. Needs root (to run the client as
/// `nobody`) and `setpriv` and `socat` (tests/install-deps.sh).
#[test]
fn a_peer_of_another_user_is_refused_and_counted() {
    use std::os::unix::fs::PermissionsExt;
    use std::process::{Command, Stdio};
    if !crate::test_support::is_root() {
        crate::test_support::skip("a_peer_of_another_user_is_refused_and_counted", "needs root");
        return;
    }
    let dir = TempDir::new("peer");
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.0.join("egret.sock");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let listener = rt.block_on(async { bind(&path) }).unwrap();
    assert_eq!(listener.owner_uid(), 0);
    // Open the file to everyone: only the credential check stands between.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let view: Arc<dyn GatewayView> = Arc::new(Fake);
    let before = refused_connections();
    let out = rt.block_on(async {
        let task = tokio::spawn(serve(listener, view));
        let p = path.clone();
        let out = tokio::task::spawn_blocking(move || {
            let mut child = Command::new("setpriv")
                .args(["--reuid=65534", "--regid=65534", "--clear-groups", "socat", "-t", "5", "-"])
                .arg(format!("UNIX-CONNECT:{}", p.display()))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("spawning setpriv (util-linux) failed: {e}: run tests/install-deps.sh"));
            child.stdin.take().unwrap().write_all(b"{\"command\":\"status\"}\n").unwrap();
            child.wait_with_output().unwrap()
        })
        .await
        .unwrap();
        task.abort();
        out
    });
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "setpriv socat: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        answer.trim(),
        r#"{"error":"refused: peer uid 65534 is neither root nor the daemon's uid 0"}"#,
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(refused_connections() > before, "the refusal was not counted");
}

/// `egret status` in Kubernetes mode says how IPs are owned, and with
/// liveness Leases how long this gateway's stays valid.
#[test]
fn status_names_the_ownership() {
    use crate::view::{ClusterReport, LivenessRow};
    let with = |liveness: Option<LivenessRow>| {
        let cluster = ClusterReport { node: "gw-a".into(), liveness, ..Default::default() };
        render::status(&Status { cluster: Some(cluster), ..Fake.status() })
    };
    let per_ip = with(None);
    assert!(per_ip.contains("\nownership: perIP (each egress IP's Lease renewed)\n"), "{per_ip}");
    let row = LivenessRow { lease: "egret-gw-gw-a".into(), epoch: 4, valid_for_ms: Some(1500), lost: 1, expired: 2 };
    let live = with(Some(row.clone()));
    assert!(
        live.contains("\nownership: liveness Lease egret-gw-gw-a, epoch 4, valid for 1500 ms; lost 1 times, expired 2 peers' Leases\n"),
        "{live}"
    );
    let lapsed = with(Some(LivenessRow { valid_for_ms: None, ..row }));
    assert!(lapsed.contains("epoch 4, NOT VALID (nothing served or taken until it is renewed);"), "{lapsed}");
}

#[test]
fn counters_show_what_the_journal_covers() {
    let text = render::counters(&Fake.counters());
    assert!(text.contains("journal: 4096 bytes; egret who-had answers from 2026-12-01T12:00:00.000Z\n"), "{text}");
}

#[test]
fn who_had_on_the_wire_and_for_people() {
    let query = WhoHadQuery {
        egress: ip("203.0.113.10"),
        port: 41522,
        at_ms: 1_796_133_787_000,
        proto: Some("tcp".into()),
        remote: None,
    };
    let r = Request::WhoHad { query: query.clone() };
    let wire = serde_json::to_string(&r).unwrap();
    assert_eq!(
        wire,
        r#"{"command":"who-had","query":{"egress":"203.0.113.10","port":41522,"at_ms":1796133787000,"proto":"tcp","remote":null}}"#
    );
    assert_eq!(serde_json::from_str::<Request>(&wire).unwrap(), r);
    // A gateway without a journal says so, as an error.
    let Response::Error(e) = answer(&Fake, &wire) else { panic!("answered") };
    assert!(e.contains("no translation log journal"), "{e}");

    let row = |pod: &str, deleted: Option<u64>, live: bool| crate::view::WhoHadRow {
        proto: "tcp".into(),
        pod: ip(pod),
        pod_port: 40001,
        egress: ip("203.0.113.10"),
        egress_port: 41522,
        remote: Some("198.51.100.20:443".parse().unwrap()),
        pod_identity: Some(crate::translog::identity::PodIdentity {
            namespace: "payments".into(),
            name: "api-7d9f8-abcde".into(),
            uid: "0b6c3a8e".into(),
        }),
        created_ms: Some(1_796_133_780_000),
        last_ms: Some(1_796_133_790_000),
        deleted_ms: deleted,
        reason: deleted.map(|_| "expired".into()),
        live,
        adopted: false,
    };
    let a = WhoHadAnswer {
        at_ms: query.at_ms,
        journal_starts_ms: Some(1_796_100_000_000),
        before_journal: false,
        sessions: vec![row("10.244.1.7", Some(1_796_133_910_000), false), row("10.244.1.8", None, true)],
        blocks: vec![],
    };
    assert_eq!(
        render::who_had(&query, &a),
        "203.0.113.10:41522/tcp at 2026-12-01T14:03:07.000Z:\n\
         POD                       UID       PROTO  POD ADDRESS       REMOTE             CREATED                   LAST PACKET               DELETED\n\
         payments/api-7d9f8-abcde  0b6c3a8e  tcp    10.244.1.7:40001  198.51.100.20:443  2026-12-01T14:03:00.000Z  2026-12-01T14:03:10.000Z  2026-12-01T14:05:10.000Z (expired)\n\
         payments/api-7d9f8-abcde  0b6c3a8e  tcp    10.244.1.8:40001  198.51.100.20:443  2026-12-01T14:03:00.000Z  2026-12-01T14:03:10.000Z  live\n"
    );
    let mut adopted = row("10.244.1.9", Some(1_796_133_910_000), false);
    (adopted.created_ms, adopted.adopted) = (None, true);
    let text = render::who_had(&query, &WhoHadAnswer { sessions: vec![adopted], ..a.clone() });
    assert!(
        text.contains("10.244.1.9:40001  198.51.100.20:443  adopted (peer's journal)  2026-12-01T14:03:10.000Z"),
        "{text}"
    );
    let none = WhoHadAnswer { sessions: vec![], ..a.clone() };
    assert_eq!(
        render::who_had(&query, &none),
        "203.0.113.10:41522/tcp at 2026-12-01T14:03:07.000Z: no session held it\n"
    );
    let early = WhoHadAnswer { before_journal: true, ..none.clone() };
    assert_eq!(
        render::who_had(&query, &early),
        "203.0.113.10:41522/tcp at 2026-12-01T14:03:07.000Z: the journal starts at 2026-12-01T04:40:00.000Z: ask the collector\n"
    );
    let empty = WhoHadAnswer { journal_starts_ms: None, ..early };
    assert!(render::who_had(&query, &empty).ends_with("the journal is empty: ask the collector\n"));
    // A pod in block mode: no session record, its block answers.
    let block = crate::view::WhoHadBlockRow {
        pod: ip("10.244.1.7"),
        egress: ip("203.0.113.10"),
        first_port: 41472,
        last_port: 41599,
        pod_identity: row("10.244.1.7", None, false).pod_identity,
        allocated_ms: Some(1_796_133_780_000),
        freed_ms: Some(1_796_133_910_000),
    };
    let blocks =
        WhoHadAnswer { blocks: vec![block.clone(), crate::view::WhoHadBlockRow { freed_ms: None, ..block }], ..none };
    assert_eq!(
        render::who_had(&query, &blocks),
        "203.0.113.10:41522/tcp at 2026-12-01T14:03:07.000Z: no session record; held by a port block:\n\
         the block 41472..41599 on 203.0.113.10 was held by pod payments/api-7d9f8-abcde (10.244.1.7, uid 0b6c3a8e) \
         from 2026-12-01T14:03:00.000Z to 2026-12-01T14:05:10.000Z\n\
         the block 41472..41599 on 203.0.113.10 was held by pod payments/api-7d9f8-abcde (10.244.1.7, uid 0b6c3a8e) \
         from 2026-12-01T14:03:00.000Z to now, or a release not recorded\n"
    );
    let json = serde_json::to_string(&blocks).unwrap();
    assert_eq!(serde_json::from_str::<WhoHadAnswer>(&json).unwrap(), blocks);
    // An answer from a gateway before blocks has no `blocks`: read as none.
    let old = json.replace(&format!(",\"blocks\":{}", serde_json::to_string(&blocks.blocks).unwrap()), "");
    assert!(serde_json::from_str::<WhoHadAnswer>(&old).unwrap().blocks.is_empty());
}
