//! Two gateway control planes against a real API server, with fake sinks
//! whose timelines show when each gateway served which egress IP:
//!
//! 1. each egress IP has exactly one holder, its preferred one by rendezvous
//!    hashing unless that one missed its turn (taken only in the other's);
//! 2. a gateway cut off from the API server (a proxy severs its connections)
//!    removes its IPs at its renew deadline, keeps the rest of its tables,
//!    and the other gateway takes them only after that (the fencing margin);
//! 3. a crashed gateway (its task dropped) loses its IPs to the other within
//!    the stated failover time; its data plane, were it still running, had
//!    been told to stop serving them (valid-until) before the take-over;
//! 4. a gracefully stopped gateway hands its IPs over at once;
//! 5. with the API server killed, every gateway keeps its tables until each
//!    IP's deadline, then fences it; after a restart each IP has one holder.
//!
//! Never two gateways serve one IP at the same time, in any phase.
//! Measured times are printed (`--nocapture`); docs/kubernetes.md records them.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::time::Duration;

use egret_controlplane::k8s::crd::EgressPolicy;
use egret_controlplane::k8s::desired::rank_gateways;
use egret_tests::apiserver::ApiServer;
use k8s_common::*;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::time::Instant;

const D: Duration = Duration::from_secs(4);
const R: Duration = Duration::from_secs(2);
const P: Duration = Duration::from_millis(500);

#[test]
fn two_gateways_one_owner_fencing_and_failover() {
    with_api_server("two_gateways_one_owner_fencing_and_failover", |server, rt| rt.block_on(scenario(server)));
}

/// Two IPs preferring gw-1 and two preferring gw-2.
fn spread_ips() -> Vec<IpAddr> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 10..60u8 {
        let ip: IpAddr = format!("198.51.100.{i}").parse().unwrap();
        let first = rank_gateways(ip, &["gw-1", "gw-2"])[0].clone();
        if first == "gw-1" && a.len() < 2 {
            a.push(ip);
        } else if first == "gw-2" && b.len() < 2 {
            b.push(ip);
        }
    }
    let mut v: Vec<IpAddr> = a.into_iter().chain(b).collect();
    v.sort();
    v
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

async fn exactly_one_holder(what: &str, ips: &[IpAddr], gws: &[&Gateway]) -> Vec<BTreeSet<IpAddr>> {
    wait_for(what, WAIT, || {
        let held: Vec<BTreeSet<IpAddr>> = gws.iter().map(|g| g.sink.held()).collect();
        let ok = ips.iter().all(|ip| held.iter().filter(|h| h.contains(ip)).count() == 1);
        async move { ok.then_some(held) }
    })
    .await
}

fn now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock after 1970");
    i64::try_from(since.as_millis()).expect("ms fit")
}

/// gw-2's preferred IPs that gw-1 holds (`gw1_holds`) were taken in gw-1's
/// turn, never before: once gw-2's liveness Lease had been seen for the
/// renew deadline R without gw-2 creating their records, or, gw-2 never
/// seen, leaseDuration D after gw-1 started (lease.rs,
/// `better_candidates_turn`). Which of the two happens is a matter of
/// gw-2's speed on a busy machine (its start-up against R); the rule is
/// not. Read from the Leases: gw-2's liveness Lease was acquired no later
/// than gw-1 saw it, and gw-1 stamps the IP's record when it creates it.
async fn took_only_in_turn(
    client: &kube::Client,
    gw2_preferred: &BTreeSet<IpAddr>,
    gw1_holds: &BTreeSet<IpAddr>,
    gw1_started_ms: i64,
) {
    use egret_controlplane::k8s::liveness::liveness_lease_name;
    use k8s_openapi::api::coordination::v1::Lease;
    let leases: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
    let gw2_live_ms = leases
        .get(&liveness_lease_name("gw-2"))
        .await
        .ok()
        .and_then(|l| l.spec?.acquire_time)
        .map(|t| t.0.as_millisecond());
    // The Lease's stamps have microseconds; the test's clock reads ms.
    let slack = 5;
    for ip in gw2_preferred.intersection(gw1_holds) {
        let spec = lease_spec(client, *ip).await.expect("a Lease for every held IP");
        let acquired = spec.acquire_time.expect("acquireTime").0.as_millisecond();
        let seen_turn = gw2_live_ms.map(|l| l + ms(R) as i64);
        let unseen_turn = gw1_started_ms + ms(D) as i64;
        let turn = seen_turn.map_or(unseen_turn, |s| s.min(unseen_turn));
        println!(
            "{ip}: gw-2's own, taken by gw-1 {} ms after gw-1 started ({} ms after gw-2's liveness Lease): gw-2 was too slow for its turn",
            acquired - gw1_started_ms,
            gw2_live_ms.map_or("never".to_string(), |l| (acquired - l).to_string())
        );
        if acquired + slack < turn {
            show_leases(client).await;
            panic!("{ip}: gw-1 took gw-2's IP {} ms before its turn", turn - acquired);
        }
    }
}

async fn scenario(server: &ApiServer) {
    let client = server.client().await.expect("client");
    install_crds(&client).await;
    namespace(&client, "egret-system", json!({})).await;
    namespace(&client, "team-a", json!({"team": "a"})).await;
    node(&client, "gw-1", json!({"egret.dev/gateway": "true"})).await;
    node(&client, "gw-2", json!({"egret.dev/gateway": "true"})).await;
    pod(&client, "team-a", "web-1", json!({"app": "web"}), "198.18.0.11").await;
    let ips = spread_ips();
    let egress: Vec<serde_json::Value> = ips.iter().map(|ip| json!({"ip": ip.to_string()})).collect();
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "team-a"},
        "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}, "destinations": ["0.0.0.0/0"], "egressIPs": egress}
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy).await.expect("policy");

    // 1. Two gateways, gw-1 behind a proxy that can cut it off.
    let upstream = upstream(server.kubeconfig_path()).await;
    let proxy = Proxy::start(upstream).await;
    let (via_proxy, _) = client_via(server.kubeconfig_path(), proxy.port).await;
    // gw-1 first, alone until it holds its own share: the cut-off below
    // then always has IPs to fence.
    let gw1_started_ms = now_ms();
    let mut gw1 = Gateway::start(via_proxy, "gw-1", "egret-system");
    let preferred_by = |gw: &str| -> BTreeSet<IpAddr> {
        ips.iter().copied().filter(|ip| rank_gateways(*ip, &["gw-1", "gw-2"])[0] == gw).collect()
    };
    wait_for("gw-1 to hold its preferred IPs", WAIT, || {
        let ok = gw1.sink.held().is_superset(&preferred_by("gw-1"));
        async move { ok.then_some(()) }
    })
    .await;
    let mut gw2 = Gateway::start(server.client().await.expect("client"), "gw-2", "egret-system");
    let held = exactly_one_holder("one holder per IP", &ips, &[&gw1, &gw2]).await;
    println!("steady state: gw-1 holds {:?}, gw-2 holds {:?}", held[0], held[1]);
    took_only_in_turn(&client, &preferred_by("gw-2"), &held[0], gw1_started_ms).await;
    // Stay a while: renewals must not move anything.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(vec![gw1.sink.held(), gw2.sink.held()], held, "stable under renewals");

    // 2. Cut gw-1 off the API server.
    let gw1_ips: Vec<IpAddr> = held[0].iter().copied().collect();
    let t_cut = Instant::now();
    proxy.cut();
    exactly_one_holder("gw-2 to take gw-1's IPs", &ips, &[&gw1, &gw2]).await;
    wait_for("gw-2 to hold every IP", WAIT, || {
        let all = gw2.sink.held().len() == ips.len();
        async move { all.then_some(()) }
    })
    .await;
    for ip in &gw1_ips {
        let fenced = gw1.sink.removed_at(*ip).expect("gw-1 fenced");
        let taken = gw2.sink.added_after(*ip, t_cut).expect("gw-2 took it");
        println!(
            "cut-off {ip}: gw-1 fenced {} ms after the cut, gw-2 took it {} ms after the cut: margin {} ms",
            ms(fenced - t_cut),
            ms(taken - t_cut),
            ms(taken - fenced)
        );
        // Kept serving after losing the API server, and fenced by the renew
        // deadline of its last successful renewal (sent before the cut)...
        assert!(fenced - t_cut >= Duration::from_millis(500), "gw-1 kept {ip} while its Lease was valid");
        assert!(fenced - t_cut <= R + Duration::from_millis(500), "gw-1 fenced {ip} by its deadline");
        // ...and the other gateway took it only after the margin.
        assert!(
            taken > fenced + Duration::from_millis(1000),
            "{ip}: take-over {} ms after fencing",
            ms(taken - fenced)
        );
    }
    let last = gw1.sink.last().expect("gw-1 spec");
    assert_eq!(last.policies.len(), 1, "gw-1 keeps its policies while cut off");
    assert!(gw1.sink.held().is_empty(), "gw-1 serves nothing while cut off");
    // Dormant (issue 28 §2): cut off, gw-1 cannot see that gw-2 took them,
    // so it keeps them in its tables with their sessions, past their
    // deadline, served by nothing.
    assert_eq!(gw1.sink.in_tables(), gw1_ips.iter().copied().collect(), "gw-1 keeps its IPs dormant");
    let now = Instant::now();
    for ip in &ips {
        assert_never_shared(*ip, &[("gw-1", &gw1.sink, now), ("gw-2", &gw2.sink, now)]);
    }
    gw1.kill();
    drop(proxy);

    // 3. A fresh gw-1 joins (takes nothing: no preemption), then gw-2 crashes.
    let mut gw1b = Gateway::start(server.client().await.expect("client"), "gw-1", "egret-system");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(gw1b.sink.held(), BTreeSet::new(), "a held IP does not move to a newcomer");
    let t_kill = Instant::now();
    gw2.kill();
    wait_for("gw-1 to take every IP after the crash", WAIT, || {
        let all = gw1b.sink.held().len() == ips.len();
        async move { all.then_some(()) }
    })
    .await;
    let worst = ips.iter().map(|ip| gw1b.sink.added_after(*ip, t_kill).expect("taken") - t_kill).max().unwrap();
    println!("crash failover: every IP moved within {} ms of the kill", ms(worst));
    // Only gw-2's control-plane task died; its data plane (the sink) would
    // run on. It had been told to stop serving each IP at the renew
    // deadline of its last renewal (issue 14 item 6): before the kill + R,
    // and at least the fencing margin (less slack) before gw-1 took it.
    for ip in &ips {
        let until = gw2.sink.valid_until_of(*ip).expect("gw-2's data plane has a valid-until for every IP it held");
        let taken = gw1b.sink.added_after(*ip, t_kill).expect("taken").into_std();
        println!(
            "dead control plane: gw-2's data plane stops serving {ip} {} ms after the kill, {} ms before gw-1 takes it",
            ms(until.saturating_duration_since(t_kill.into_std())),
            ms(taken - until)
        );
        assert!(until <= t_kill.into_std() + R, "{ip}: valid until at most the renew deadline after the last renewal");
        assert!(until + Duration::from_millis(1000) <= taken, "{ip}: fenced by the data plane before the take-over");
    }
    if egret_tests::expect_times() {
        // The documented bound, a speed: in the documented run only.
        assert!(worst <= D + 2 * P + Duration::from_millis(2000), "failover took {} ms", ms(worst));
    }
    assert!(worst >= D - P - Duration::from_millis(200), "nobody took an IP before its Lease could expire");

    // 4. gw-2 back; gw-1 stops gracefully: release, not expiry.
    let mut gw2b = Gateway::start(server.client().await.expect("client"), "gw-2", "egret-system");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let client = server.client().await.expect("client");
    let mut lapse_before_stop = Vec::new();
    for ip in &ips {
        let lapse = holder_lapse(&client, *ip).await.expect("a Lease for every IP, and its holder's");
        assert_eq!(lapse.holder, "gw-1", "{ip}: gw-1 holds it before the stop");
        lapse_before_stop.push(lapse);
    }
    let t_stop = Instant::now();
    gw1b.stop().await;
    wait_for("gw-2 to take every IP after the graceful stop", WAIT, || {
        let all = gw2b.sink.held().len() == ips.len();
        async move { all.then_some(()) }
    })
    .await;
    let worst_graceful =
        ips.iter().map(|ip| gw2b.sink.added_after(*ip, t_stop).expect("taken") - t_stop).max().unwrap();
    println!("graceful handover: every IP moved within {} ms of the stop", ms(worst_graceful));
    // Released, not expired: gw-2 acquired each Lease before gw-1's claim
    // (its last renewal seen before the stop, of the IP's Lease or, with
    // liveness Leases, of gw-1's liveness Lease) could lapse, which only a
    // release allows. Proven from the Leases, not by a time bound; the time
    // is asserted in the documented run only.
    for (ip, lapse) in ips.iter().zip(&lapse_before_stop) {
        let spec = lease_spec(&client, *ip).await.expect("a Lease for every IP");
        assert_eq!(spec.holder_identity.as_deref(), Some("gw-2"), "{ip}: gw-2 holds it after the stop");
        let acquired = spec.acquire_time.expect("acquireTime").0.as_millisecond();
        let (renewed, duration) = (lapse.renewed_ms, lapse.duration_ms);
        let whose = if lapse.liveness { "gw-1's liveness Lease" } else { "the IP's Lease" };
        println!(
            "graceful handover: gw-2 acquired {ip} {} ms after the last renewal seen of {whose}",
            acquired - renewed
        );
        assert!(
            acquired < renewed + duration,
            "{ip}: acquired {} ms after the last renewal seen of {whose}, not before it could lapse ({duration} ms): released Leases are taken at once",
            acquired - renewed
        );
    }
    if egret_tests::expect_times() {
        assert!(worst_graceful < D - P, "released Leases are taken at once ({} ms)", ms(worst_graceful));
    }
    assert!(gw1b.sink.held().is_empty(), "the stopped gateway removed its IPs");

    // 5. The API server dies: gw-2 keeps everything until each deadline, then fences.
    let mut gw1c = Gateway::start(server.client().await.expect("client"), "gw-1", "egret-system");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t_dead = Instant::now();
    server.kill_apiserver().await.expect("kill apiserver");
    wait_for("gw-2 to fence everything", WAIT, || {
        let none = gw2b.sink.held().is_empty();
        async move { none.then_some(()) }
    })
    .await;
    for ip in &ips {
        let fenced = gw2b.sink.removed_at(*ip).expect("fenced");
        println!("API server down: gw-2 fenced {ip} {} ms after the kill", ms(fenced - t_dead));
        assert!(fenced - t_dead >= Duration::from_millis(500), "kept {ip} while its Lease was valid");
        assert!(fenced - t_dead <= R + Duration::from_millis(500), "fenced {ip} by its deadline");
    }
    assert_eq!(gw2b.sink.last().unwrap().policies.len(), 1, "policies stay while the API server is gone");
    assert!(gw1c.sink.held().is_empty(), "nobody can take an IP without the API server");
    let t_restart = Instant::now();
    server.restart_apiserver().await.expect("restart apiserver");
    let held = exactly_one_holder("one holder per IP after the restart", &ips, &[&gw1c, &gw2b]).await;
    println!(
        "API server back after {} ms down; every IP held again {} ms after the restart began: gw-1 {:?}, gw-2 {:?}",
        ms(t_restart - t_dead),
        ms(Instant::now() - t_restart),
        held[0],
        held[1]
    );
    let now = Instant::now();
    for ip in &ips {
        assert_never_shared(*ip, &[("gw-1", &gw1b.sink, now), ("gw-2 (crashed)", &gw2.sink, t_kill)]);
        assert_never_shared(*ip, &[("gw-1", &gw1b.sink, now), ("gw-2", &gw2b.sink, now)]);
        assert_never_shared(*ip, &[("gw-1", &gw1c.sink, now), ("gw-2", &gw2b.sink, now)]);
    }
    gw1c.stop().await;
    gw2b.stop().await;
}
