//! Issue 16 §4 at the control-plane level: three gateway control planes
//! against a real API server, each behind its own proxy that can cut it off
//! and let it back, talking to each other over the real peer channel
//! (`egret_controlplane::ha`, loopback addresses 127.0.0.11-13, TCP-MD5
//! signed, authenticated with a key file), with fake sinks whose timelines
//! show when each gateway served which egress IP and until when its data
//! plane was allowed to (valid-until):
//!
//! 1. steady state: one holder per IP;
//! 2. the holder of an IP cut off from the API server only, for three Lease
//!    durations: it keeps the IP the whole time (every other eligible gateway
//!    acknowledged it over the channel; its valid-until never lapses), and
//!    nobody else takes it;
//! 3. the API server unreachable for everyone (`EGRET_FAILSAFE_OUTAGE_SECS`,
//!    default 20 s): nothing is fenced, nothing moves;
//!    3b. during such an outage gw-2 stops gracefully and starts again
//!    [`RESTART_GAP`] later (a peer restarting, away longer than
//!    renewDeadline): gw-1 and gw-3 keep their IPs, counting gw-2 as
//!    accepting on the promises it kept across its restart (written
//!    beside its peer cache, ADR 0013); gw-2's own IP stays unserved (it
//!    fenced it and nobody can take a Lease) until the API server is back;
//! 4. the holder's control plane stops dead (its API connection cut, its
//!    sync loop gone) while its channel stays up: no proof of death, so the
//!    next candidate waits for the Lease to expire, and takes the IP only
//!    the fencing margin after the holder's data plane stopped serving it;
//! 5. throughout: never two gateways serving one IP.
//!
//! Measured times are printed (`--nocapture`, lines `k8s-failsafe:`).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egret_controlplane::ha::{auth::SharedKey, HaOptions};
use egret_controlplane::k8s::crd::EgressPolicy;
use egret_controlplane::k8s::desired::rank_gateways;
use egret_controlplane::k8s::lease::LeaseTiming;
use egret_tests::apiserver::ApiServer;
use k8s_common::*;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio::time::Instant;

// Longer than the defaults, so a restart can be made longer than
// renewDeadline (no bridge: fenced) and still clearly inside what a kept
// promise bridges (leaseDuration - the 0.5 s fencing margin after the last
// acceptance). With leaseDuration 8 s the restarted gw-2 had 1.5 s to spare
// beside two CPU hogs here, and a loaded CI machine ran out of it (gw-3
// fenced its IP): 10 s leaves 3.5 s.
const D: Duration = Duration::from_secs(10);
const R: Duration = Duration::from_secs(4);
/// How long gw-2 stays away in step 3b (from its Goodbye to its new
/// process): more than R, and with a round and a reconnect well inside
/// D - 0.5 s.
const RESTART_GAP: Duration = Duration::from_secs(5);
const NAMES: [&str; 3] = ["gw-1", "gw-2", "gw-3"];

#[test]
fn three_gateways_keep_their_ips_through_api_outages() {
    with_api_server("three_gateways_keep_their_ips_through_api_outages", |server, rt| rt.block_on(scenario(server)));
}

/// A proxy in front of the API server that can be cut and restored.
struct Switch {
    listen: SocketAddr,
    upstream: SocketAddr,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Switch {
    async fn start(upstream: SocketAddr) -> Switch {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let listen = l.local_addr().unwrap();
        let mut s = Switch { listen, upstream, accept: None, conns: Arc::default() };
        s.serve(l);
        s
    }

    fn serve(&mut self, l: tokio::net::TcpListener) {
        let (up, conns) = (self.upstream, self.conns.clone());
        self.accept = Some(tokio::spawn(async move {
            while let Ok((mut inbound, _)) = l.accept().await {
                let h = tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(up).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                    }
                });
                conns.lock().unwrap().push(h);
            }
        }));
    }

    fn cut(&mut self) {
        if let Some(a) = self.accept.take() {
            a.abort();
        }
        for h in self.conns.lock().unwrap().drain(..) {
            h.abort();
        }
    }

    async fn restore(&mut self) {
        let mut tries = 0;
        let l = loop {
            match tokio::net::TcpListener::bind(self.listen).await {
                Ok(l) => break l,
                Err(e) if tries < 100 => {
                    tries += 1;
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("rebind {}: {e}", self.listen),
            }
        };
        self.serve(l);
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.cut();
    }
}

fn ha_port() -> u16 {
    40000 + (std::process::id() % 20000) as u16
}

fn addr(i: usize) -> IpAddr {
    format!("127.0.0.{}", 11 + i).parse().unwrap()
}

/// One IP preferred by each gateway.
fn one_ip_each() -> Vec<IpAddr> {
    let mut out: Vec<Option<IpAddr>> = vec![None; 3];
    for i in 10..200u8 {
        let ip: IpAddr = format!("198.51.100.{i}").parse().unwrap();
        let first = &rank_gateways(ip, &NAMES)[0];
        let k = NAMES.iter().position(|n| n == first).unwrap();
        if out[k].is_none() {
            out[k] = Some(ip);
        }
    }
    out.into_iter().map(|o| o.unwrap()).collect()
}

/// Each gateway's peer cache (its failsafe promises are kept beside it).
fn peer_cache(i: usize) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("egret-failsafe-{}-{}.peers", std::process::id(), NAMES[i]))
}

fn start(client: kube::Client, i: usize, key: &std::path::Path) -> Gateway {
    let mut opts = k8s_common::options(NAMES[i]);
    opts.lease_namespace = "egret-system".into();
    opts.timing = LeaseTiming { lease_duration: D, renew_deadline: R, retry_period: Duration::from_millis(500) };
    opts.ha = Some(HaOptions {
        listen: SocketAddr::new(addr(i), ha_port()),
        port: ha_port(),
        keys: Arc::new(SharedKey::from_file(key).expect("key").into()),
        key_files: None,
        liveness: Duration::from_secs(1),
        resync_period: Duration::from_secs(30),
        peer_cache: Some(peer_cache(i)),
        lone_failsafe: Duration::from_secs(300),
    });
    Gateway::start_with(client, opts)
}

/// Samples every 100 ms for `d`: each IP in `held` stays in its holder's
/// tables with a valid-until in the future, and in nobody else's.
async fn hold_steady(what: &str, d: Duration, gws: &[Gateway], held: &BTreeMap<IpAddr, usize>) {
    let end = Instant::now() + d;
    let mut samples = 0;
    // The least time left before a holder's valid-until, over the samples:
    // how close the step came to fencing.
    let mut least = Duration::MAX;
    while Instant::now() < end {
        let now_std = std::time::Instant::now();
        for (ip, k) in held {
            for (j, g) in gws.iter().enumerate() {
                let has = g.sink.held().contains(ip);
                if j == *k {
                    assert!(has, "{what}: {} dropped {ip} from its tables", NAMES[j]);
                    let vu = g.sink.valid_until_of(*ip).expect("a valid-until");
                    assert!(vu > now_std, "{what}: {}'s valid-until for {ip} lapsed", NAMES[j]);
                    least = least.min(vu - now_std);
                } else {
                    assert!(!has, "{what}: {} serves {ip} too", NAMES[j]);
                }
            }
        }
        samples += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "k8s-failsafe: {what}: {samples} samples over {} ms, every IP kept by its holder alone, at least {} ms before its valid-until",
        d.as_millis(),
        least.as_millis()
    );
}

async fn scenario(server: &ApiServer) {
    let _caches = PeerCaches;
    let key = std::env::temp_dir().join(format!("egret-failsafe-{}.key", std::process::id()));
    std::fs::write(&key, (0..48u8).map(|i| i.wrapping_mul(37).wrapping_add(11)).collect::<Vec<u8>>()).unwrap();
    let client = server.client().await.expect("client");
    let gateways: Vec<(&str, IpAddr)> = NAMES.iter().enumerate().map(|(i, n)| (*n, addr(i))).collect();
    ha_cluster(&client, &gateways).await;
    let ips = one_ip_each();
    let egress: Vec<serde_json::Value> = ips.iter().map(|ip| json!({"ip": ip.to_string()})).collect();
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "team-a"},
        "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}, "destinations": ["0.0.0.0/0"], "egressIPs": egress}
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy).await.expect("policy");

    let up = upstream(server.kubeconfig_path()).await;
    let mut switches = Vec::new();
    let mut gws = Vec::new();
    let t0 = Instant::now();
    for i in 0..3 {
        let sw = Switch::start(up).await;
        let (c, _) = client_via(server.kubeconfig_path(), sw.listen.port()).await;
        gws.push(start(c, i, &key));
        switches.push(sw);
    }
    // 1. Steady state: IP k held by gateway k.
    let held: BTreeMap<IpAddr, usize> = ips.iter().copied().zip(0..3).collect();
    wait_for("each gateway to hold its preferred IP", WAIT, || {
        let ok = held.iter().all(|(ip, k)| gws[*k].sink.held().contains(ip));
        async move { ok.then_some(()) }
    })
    .await;
    // Let the channels come up (every pair connected).
    tokio::time::sleep(Duration::from_secs(2)).await;
    hold_steady("steady state", Duration::from_secs(2), &gws, &held).await;

    // 2. gw-1 cut off from the API server only.
    switches[0].cut();
    hold_steady("gw-1 cut off from the API server only", 3 * D, &gws, &held).await;
    switches[0].restore().await;
    hold_steady("gw-1 back", Duration::from_secs(2), &gws, &held).await;

    // 3. The API server unreachable for everyone.
    let outage = std::env::var("EGRET_FAILSAFE_OUTAGE_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(20u64);
    for s in &mut switches {
        s.cut();
    }
    hold_steady("API server down for everyone", Duration::from_secs(outage), &gws, &held).await;
    for s in &mut switches {
        s.restore().await;
    }
    hold_steady("API server back", Duration::from_secs(3), &gws, &held).await;

    // 3b. A peer restarting during an outage: gw-2 stops gracefully and
    // starts again while nobody reaches the API server. Before its promises
    // outlived it, gw-1 and gw-3 fenced (absence counted as refusal).
    for s in &mut switches {
        s.cut();
    }
    hold_steady("API server down for everyone, before gw-2 restarts", Duration::from_secs(2), &gws, &held).await;
    let t_stop = Instant::now();
    gws[1].stop().await;
    tokio::time::sleep(RESTART_GAP).await;
    let (c, _) = client_via(server.kubeconfig_path(), switches[1].listen.port()).await;
    gws[1] = start(c, 1, &key);
    println!("k8s-failsafe: gw-2 stopped and started again in {} ms", t_stop.elapsed().as_millis());
    let others: BTreeMap<IpAddr, usize> = held.iter().filter(|(_, k)| **k != 1).map(|(ip, k)| (*ip, *k)).collect();
    hold_steady("gw-2 restarted during the outage", 2 * D, &gws, &others).await;
    for g in &gws {
        assert!(!g.sink.held().contains(&ips[1]), "{} serves gw-2's fenced IP without a Lease", g.name);
    }
    for s in &mut switches {
        s.restore().await;
    }
    // gw-2 takes its own record back, or (its Lease expired meanwhile by
    // the others' clocks) a listed peer takes it: either way, one owner.
    let k1 = wait_for("somebody to serve gw-2's IP again", WAIT, || {
        let k = gws.iter().position(|g| g.sink.held().contains(&ips[1]));
        async move { k }
    })
    .await;
    println!("k8s-failsafe: after the outage {} serves gw-2's IP", NAMES[k1]);
    let mut after = held.clone();
    after.insert(ips[1], k1);
    hold_steady("API server back after gw-2's restart", Duration::from_secs(2), &gws, &after).await;

    // 4. gw-1's sync loop dies with its API connection cut; its channel
    // tasks keep running (they are separate tasks), so its peers have no
    // proof that it died and must wait for its Lease to expire.
    let ip0 = ips[0];
    let t_cut = Instant::now();
    switches[0].cut();
    gws[0].kill();
    let next = rank_gateways(ip0, &NAMES).into_iter().find(|n| n != "gw-1").unwrap();
    let k = NAMES.iter().position(|n| *n == next).unwrap();
    wait_for("the next candidate to take gw-1's IP", WAIT, || {
        let ok = gws[k].sink.held().contains(&ip0);
        async move { ok.then_some(()) }
    })
    .await;
    let taken = gws[k].sink.added_after(ip0, t_cut).expect("taken");
    let vu = gws[0].sink.valid_until_of(ip0).expect("gw-1's valid-until");
    let vu_at = t_cut + vu.saturating_duration_since(t_cut.into_std());
    println!(
        "k8s-failsafe: gw-1 cut off from everything: its data plane may serve {ip0} until {} ms after the cut; {next} took it {} ms after the cut",
        (vu_at - t_cut).as_millis(),
        (taken - t_cut).as_millis()
    );
    assert!(taken >= vu_at + (D - R) - Duration::from_millis(50), "taken before gw-1's valid-until + margin");
    for ip in &ips {
        // gw-1's tables were never emptied (its loop died): what it could
        // serve ends at its data plane's valid-until.
        let sinks: Vec<(&str, &FakeSink, Instant)> = gws
            .iter()
            .zip(NAMES)
            .map(|(g, n)| (n, &*g.sink, if n == "gw-1" { vu_at } else { Instant::now() }))
            .collect();
        assert_never_shared(*ip, &sinks);
    }
    println!("k8s-failsafe: done in {} s", t0.elapsed().as_secs());
    let _ = std::fs::remove_file(&key);
    for g in &mut gws {
        g.stop().await;
    }
}

/// Removes the peer caches and kept promises, also when the test fails.
struct PeerCaches;

impl Drop for PeerCaches {
    fn drop(&mut self) {
        for i in 0..3 {
            let _ = std::fs::remove_file(peer_cache(i));
            let _ = std::fs::remove_file(egret_controlplane::ha::promises::path_for(&peer_cache(i)));
        }
    }
}
