//! Issue 28 §2 at the control-plane level: nothing a pass does may delay
//! the Lease renewals. Two gateway control planes against a real API
//! server, talking over the real peer channel (loopback 127.0.0.21-22,
//! TCP-MD5, a key file), each with a fake data plane whose session store
//! exports `EGRET_TAKEOVER_SESSIONS` records (default 200,000; the full size
//! of the issue is `EGRET_TAKEOVER_SESSIONS=1200000`) and whose import takes
//! [`IMPORT`]: what installing 1.2 M sessions took on this 2-core machine
//! under load (0.8-1.9 s quiet, docs/benchmarks.md "Take-over"), and more
//! than `renewDeadline`.
//!
//! gw-1 holds X, gw-2 holds Y and stands by for X. gw-1's control plane is
//! killed; gw-2 takes X over, receives gw-1's copy through the channel and
//! imports it. Asserted from the fake data plane's timeline:
//! - every record of the copy reached the import;
//! - Y's valid-until never lapsed, X's never lapsed once gw-2 held it
//!   (each extension came before the previous deadline): the renewals went
//!   on while the import ran;
//! - neither IP left gw-2's tables after the import (no fence).
//!
//! Before the renewer (renewer.rs), the import ran inside the sync loop's
//! pass and renewals were planned after it: Y's deadline passed during the
//! import and the next pass fenced both IPs.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egret_controlplane::ha::{auth::SharedKey, HaOptions, SessionStore};
use egret_controlplane::k8s::crd::EgressPolicy;
use egret_controlplane::k8s::desired::rank_gateways;
use egret_controlplane::k8s::lease::LeaseTiming;
use egret_dataplane::nat::sync::{ImportReport, SessionRecord, SyncEvent};
use egret_tests::apiserver::ApiServer;
use k8s_common::*;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::time::Instant;

const NAMES: [&str; 2] = ["gw-1", "gw-2"];
/// The default Lease timing.
const D: Duration = Duration::from_secs(4);
const R: Duration = Duration::from_secs(2);
const P: Duration = Duration::from_millis(500);
/// How long the fake import takes.
const IMPORT: Duration = Duration::from_secs(3);

#[test]
fn renewals_go_on_while_a_take_over_imports_its_sessions() {
    with_api_server("renewals_go_on_while_a_take_over_imports_its_sessions", |server, rt| {
        rt.block_on(scenario(server));
    });
}

/// Exports `sessions` records for any IP; imports by sleeping [`IMPORT`].
struct SlowStore {
    sessions: usize,
    exports: AtomicUsize,
    /// (start, end, records) of each import.
    imports: Mutex<Vec<(std::time::Instant, std::time::Instant, usize)>>,
}

impl SessionStore for SlowStore {
    fn drain(&self, _max: usize) -> Vec<SyncEvent> {
        Vec::new()
    }

    fn overflows(&self) -> u64 {
        0
    }

    fn export(&self, ip: IpAddr) -> Vec<SessionRecord> {
        self.exports.fetch_add(1, Ordering::Relaxed);
        (0..self.sessions)
            .map(|i| {
                let i = u32::try_from(i).unwrap();
                SessionRecord {
                    proto: 17,
                    pod: IpAddr::V4(Ipv4Addr::new(198, 18, (i >> 16) as u8, 11)),
                    pod_port: 1024 + (i % 60_000) as u16,
                    remote: IpAddr::V4(Ipv4Addr::new(198, 19, (i >> 8) as u8, i as u8)),
                    remote_port: 53,
                    egress: ip,
                    egress_port: 1024 + (i % 60_000) as u16,
                    tcp: 0,
                    tcp_track: 0,
                    flags: 0,
                    idle_secs: 1,
                }
            })
            .collect()
    }

    fn import(&self, records: &[SessionRecord]) -> ImportReport {
        let t0 = std::time::Instant::now();
        std::thread::sleep(IMPORT);
        self.imports.lock().unwrap().push((t0, std::time::Instant::now(), records.len()));
        ImportReport { installed: records.len() as u64, ..Default::default() }
    }
}

fn addr(i: usize) -> IpAddr {
    format!("127.0.0.{}", 21 + i).parse().unwrap()
}

fn ha_port() -> u16 {
    20000 + (std::process::id() % 20000) as u16
}

/// An IP whose first-ranked gateway is `NAMES[k]`.
fn preferred_by(k: usize) -> IpAddr {
    (10..200u8)
        .map(|i| IpAddr::V4(Ipv4Addr::new(198, 51, 100, i)))
        .find(|ip| rank_gateways(*ip, &NAMES)[0] == NAMES[k])
        .unwrap()
}

fn start(client: kube::Client, i: usize, key: &std::path::Path, store: Arc<SlowStore>) -> Gateway {
    let mut opts = k8s_common::options(NAMES[i]);
    opts.lease_namespace = "egret-system".into();
    opts.timing = LeaseTiming { lease_duration: D, renew_deadline: R, retry_period: P };
    opts.ha = Some(HaOptions {
        listen: SocketAddr::new(addr(i), ha_port()),
        port: ha_port(),
        keys: Arc::new(SharedKey::from_file(key).expect("key").into()),
        key_files: None,
        liveness: Duration::from_secs(2),
        resync_period: Duration::from_secs(30),
        peer_cache: None,
        lone_failsafe: Duration::from_secs(300),
    });
    let sink = FakeSink { store: StoreSlot(Some(store)), ..FakeSink::default() };
    Gateway::start_with_sink(client, opts, sink)
}

/// The gaps in `ip`'s valid-until over [from, to]: each instant at which
/// the last deadline set before it had passed (a lapse), as
/// (lapsed at, extended at).
fn lapses(sink: &FakeSink, ip: IpAddr, from: std::time::Instant, to: std::time::Instant) -> Vec<(Duration, Duration)> {
    sink.lapses(ip, Instant::from_std(to))
        .into_iter()
        .map(|(l0, l1)| (l0.into_std().max(from), l1.into_std().min(to)))
        .filter(|(l0, l1)| l0 < l1)
        .map(|(l0, l1)| (l0 - from, l1 - from))
        .collect()
}

async fn scenario(server: &ApiServer) {
    let sessions: usize =
        std::env::var("EGRET_TAKEOVER_SESSIONS").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(200_000);
    let key = std::env::temp_dir().join(format!("egret-slow-takeover-{}.key", std::process::id()));
    std::fs::write(&key, (0..48u8).map(|i| i.wrapping_mul(29).wrapping_add(7)).collect::<Vec<u8>>()).unwrap();
    let client = server.client().await.expect("client");
    let gateways: Vec<(&str, IpAddr)> = NAMES.iter().enumerate().map(|(i, n)| (*n, addr(i))).collect();
    ha_cluster(&client, &gateways).await;
    let (x, y) = (preferred_by(0), preferred_by(1));
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "team-a"},
        "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}, "destinations": ["0.0.0.0/0"],
                 "egressIPs": [{"ip": x.to_string()}, {"ip": y.to_string()}]}
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy).await.expect("policy");

    let stores: Vec<Arc<SlowStore>> = (0..2)
        .map(|_| Arc::new(SlowStore { sessions, exports: AtomicUsize::new(0), imports: Mutex::default() }))
        .collect();
    let mut gws: Vec<Gateway> = (0..2).map(|i| start(client.clone(), i, &key, stores[i].clone())).collect();
    wait_for("gw-1 to hold X and gw-2 Y", WAIT, || {
        let ok = gws[0].sink.held().contains(&x) && gws[1].sink.held().contains(&y);
        async move { ok.then_some(()) }
    })
    .await;
    // gw-1 copies X's sessions to gw-2 when their channel comes up.
    wait_for("gw-1 to export X's sessions for its standby", WAIT, || {
        let ok = stores[0].exports.load(Ordering::Relaxed) > 0;
        async move { ok.then_some(()) }
    })
    .await;
    // The copy crosses the channel (100 MB/s) and the standby acknowledges it.
    tokio::time::sleep(Duration::from_secs(3) + Duration::from_millis(sessions as u64 / 200)).await;

    let t_kill = std::time::Instant::now();
    gws[0].kill();
    wait_for("gw-2 to import X's sessions", WAIT + IMPORT, || {
        let done = !stores[1].imports.lock().unwrap().is_empty();
        async move { done.then_some(()) }
    })
    .await;
    let (i0, i1, n) = stores[1].imports.lock().unwrap()[0];
    // Two renew deadlines past the import's end.
    tokio::time::sleep(R * 2).await;
    let t_end = std::time::Instant::now();
    let g2 = &gws[1].sink;
    println!(
        "k8s-slow-takeover: gw-2 imported {n} of {sessions} records from {} ms to {} ms after the kill",
        (i0 - t_kill).as_millis(),
        (i1 - t_kill).as_millis()
    );
    assert_eq!(n, sessions, "every record of gw-1's copy reached gw-2's import");
    assert!(i1 - i0 >= IMPORT, "the import took its time");
    let y_lapses = lapses(g2, y, t_kill, t_end);
    let x_held_from = g2
        .valid_until
        .lock()
        .unwrap()
        .iter()
        .find(|(at, v)| {
            let at = at.into_std();
            at > t_kill && v.iter().any(|(a, t)| *a == x && t.is_some_and(|t| t > at))
        })
        .map(|(at, _)| at.into_std())
        .expect("gw-2 was given a deadline for X");
    let x_lapses = lapses(g2, x, x_held_from.max(t_kill), t_end);
    println!(
        "k8s-slow-takeover: valid-until lapses (ms after the kill / after gw-2 held X): Y {y_lapses:?}, X {x_lapses:?}"
    );
    assert!(y_lapses.is_empty(), "Y's deadline passed while gw-2 imported X's sessions: {y_lapses:?}");
    assert!(x_lapses.is_empty(), "X's deadline passed while gw-2 imported its sessions: {x_lapses:?}");
    let now = Instant::now();
    for ip in [x, y] {
        let gaps: Vec<_> =
            g2.intervals(ip, now).windows(2).map(|w| (w[0].1, w[1].0)).filter(|(end, _)| end.into_std() > i1).collect();
        assert!(gaps.is_empty(), "{ip} left gw-2's tables after the import (fenced)");
        assert!(g2.held().contains(&ip), "gw-2 serves {ip} at the end");
    }
    gws[1].stop().await;
    let _ = std::fs::remove_file(&key);
}
