//! A drain hands an egress IP over to its standby at once, with either
//! ownership design (`kubernetes.ownership`: perIP, liveness): three gateway
//! control planes against a real API server with the peer channel on and
//! fake sinks; the holder of one IP is drained (`egret.dev/drain=true`) and
//! the time until another gateway serves the IP is printed (lines
//! `k8s-drain:`). Before the drain the holder's standby is stopped, and
//! the IP's Lease must name the new standby (with liveness Leases nothing
//! renews it: it is rewritten when its annotations change). Asserted: one owner throughout, and that the IP was taken
//! from a released Lease before that Lease could have expired (a take-over
//! that waited out a leaseDuration is the regression this test exists for).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use egret_controlplane::ha::{auth::SharedKey, HaOptions};
use egret_controlplane::k8s::crd::EgressPolicy;
use egret_controlplane::k8s::desired::rank_gateways;
use egret_controlplane::k8s::lease::{lease_name, STANDBY_ANNOTATION};
use egret_controlplane::k8s::K8sOptions;
use egret_tests::apiserver::ApiServer;
use k8s_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::time::Instant;

const NAMES: [&str; 3] = ["gw-1", "gw-2", "gw-3"];

static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn a_drain_hands_over_at_once_owned_per_ip() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    with_api_server("a_drain_hands_over_at_once_owned_per_ip", |s, rt| rt.block_on(scenario(s, false)));
}

#[test]
fn a_drain_hands_over_at_once_owned_by_liveness() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    with_api_server("a_drain_hands_over_at_once_owned_by_liveness", |s, rt| rt.block_on(scenario(s, true)));
}

/// The standby the IP's Lease names.
async fn record_standby(leases: &Api<Lease>, ip: IpAddr) -> Option<String> {
    let list = leases.list(&Default::default()).await.ok()?;
    let l = list.items.into_iter().find(|l| l.metadata.name.as_deref() == Some(lease_name(ip).as_str()))?;
    l.metadata.annotations?.get(STANDBY_ANNOTATION).filter(|s| !s.is_empty()).cloned()
}

fn addr(i: usize) -> IpAddr {
    format!("127.0.0.{}", 21 + i).parse().unwrap()
}

async fn scenario(server: &ApiServer, liveness: bool) {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
    let mode = if liveness { "liveness" } else { "perIP" };
    let key = std::env::temp_dir().join(format!("egret-drain-{}-{mode}.key", std::process::id()));
    std::fs::write(&key, random_ha_key()).unwrap();
    let client = server.client().await.expect("client");
    let gateways: Vec<(&str, IpAddr)> = NAMES.iter().enumerate().map(|(i, n)| (*n, addr(i))).collect();
    ha_cluster(&client, &gateways).await;
    let ip: IpAddr = "198.51.100.10".parse().unwrap();
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "team-a"},
        "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}, "destinations": ["0.0.0.0/0"], "egressIPs": [{"ip": ip.to_string()}]}
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy).await.expect("policy");
    let port = 42000 + (std::process::id() % 10000) as u16 + u16::from(liveness);
    let mut gws: Vec<Gateway> = NAMES
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let mut opts = K8sOptions::new(*n);
            opts.liveness = liveness;
            opts.ha = Some(HaOptions {
                listen: SocketAddr::new(addr(i), port),
                port,
                keys: Arc::new(SharedKey::from_file(&key).expect("key").into()),
                key_files: None,
                liveness: Duration::from_secs(1),
                resync_period: Duration::from_secs(30),
                peer_cache: None,
                lone_failsafe: Duration::from_secs(300),
            });
            Gateway::start_with(client.clone(), opts)
        })
        .collect();
    let first = NAMES.iter().position(|n| *n == rank_gateways(ip, &NAMES)[0]).unwrap();
    let leases: Api<Lease> = Api::all(client.clone());
    wait_for_or_show_leases(&client, "the preferred gateway to hold the IP", WAIT, || {
        let ok = gws[first].sink.held().contains(&ip);
        async move { ok.then_some(()) }
    })
    .await;
    // Channels up, a standby named, and the IP's Lease saying so (with
    // liveness Leases nothing renews it: it is rewritten when what it
    // says of the peer channel changes).
    let standby = wait_for_or_show_leases(&client, "the IP's Lease to name a standby", WAIT, || {
        let leases = leases.clone();
        async move { record_standby(&leases, ip).await }
    })
    .await;
    let s = NAMES.iter().position(|n| *n == standby).expect("the standby is a gateway");
    assert_ne!(s, first, "the holder names another gateway its standby");
    // The standby stops: the holder picks the other one, and its Lease
    // must name it.
    gws[s].stop().await;
    let other = (0..3).find(|k| *k != first && *k != s).unwrap();
    wait_for_or_show_leases(&client, "the IP's Lease to name the new standby", WAIT, || {
        let leases = leases.clone();
        async move { (record_standby(&leases, ip).await.as_deref() == Some(NAMES[other])).then_some(()) }
    })
    .await;
    if liveness {
        // Written per change, not per period.
        let version = |l: Lease| l.metadata.resource_version;
        let before = leases.list(&Default::default()).await.expect("leases");
        let name = lease_name(ip);
        let of = |list: kube::api::ObjectList<Lease>| {
            list.items.into_iter().find(|l| l.metadata.name.as_deref() == Some(name.as_str())).and_then(version)
        };
        let before = of(before);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = of(leases.list(&Default::default()).await.expect("leases"));
        assert_eq!(before, after, "liveness: the IP's Lease was rewritten while nothing it says changed");
    }
    let t_drain = Instant::now();
    let nodes: Api<Node> = Api::all(client.clone());
    let patch = json!({"metadata": {"annotations": {"egret.dev/drain": "true"}}});
    nodes.patch(NAMES[first], &PatchParams::default(), &Patch::Merge(&patch)).await.expect("drain");
    let next = wait_for_or_show_leases(&client, "another gateway to serve the IP", WAIT, || {
        let k = (0..3).find(|k| *k != first && gws[*k].sink.held().contains(&ip));
        async move { k }
    })
    .await;
    let took = t_drain.elapsed();
    let released = gws[first].sink.removed_at(ip).expect("the drained gateway removed the IP");
    let taken = gws[next].sink.added_after(ip, t_drain).expect("taken");
    println!(
        "k8s-drain: {mode}: {} drained; it fenced the IP {} ms later, {} served it {} ms after the drain",
        NAMES[first],
        (released - t_drain).as_millis(),
        NAMES[next],
        took.as_millis()
    );
    // ADR 0034 §8: an IP is listed as handed over (its removals then
    // `handed-over`, journal only) only when its standby held a current
    // copy as it left the tables. These gateways have no data plane (no
    // session store): no copy is ever sent, none is current, so the drained
    // gateway's tables must not list it (k8s_ha_translog has the case with
    // a copy); the taker's list nothing either.
    let applied = |g: &Gateway| {
        g.sink.log.lock().unwrap().iter().rev().find_map(|(_, e)| match e {
            SinkEvent::Apply(spec) => Some(spec.clone()),
            _ => None,
        })
    };
    let old = applied(&gws[first]).expect("the drained gateway applied tables");
    assert!(!old.egress_ips.iter().any(|e| e.ip == ip));
    assert!(old.handed_over.is_empty(), "{mode}: handed over without a copy: {:?}", old.handed_over);
    let new = applied(&gws[next]).expect("the taker applied tables");
    assert!(new.handed_over.is_empty(), "{mode}: the taker handed nothing over: {:?}", new.handed_over);
    let now = Instant::now();
    let sinks: Vec<(&str, &FakeSink, Instant)> = gws.iter().zip(NAMES).map(|(g, n)| (n, &*g.sink, now)).collect();
    assert_never_shared(ip, &sinks);
    let d = K8sOptions::new("x").timing.lease_duration;
    assert!(
        taken < released + d,
        "{mode}: the IP was taken {} ms after its release: a leaseDuration waited out",
        (taken - released).as_millis()
    );
    let _ = std::fs::remove_file(&key);
    for g in &mut gws {
        g.stop().await;
    }
}
