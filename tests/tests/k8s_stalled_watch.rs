//! A stalled watch starts over (ADR 0030). After a partition a gateway's
//! watches can stay open and silent for seconds (the API server's
//! retransmissions back off) while its new requests get through: in
//! `k8s_ha` the cut gateway then missed a drain's release for 4.8 s. The
//! gateway sees the stall from its own renewals, which the Lease watch does
//! not show, and starts every watch over.
//!
//! Two gateway control planes against a real API server, with liveness
//! Leases (a gateway that holds nothing still renews its own Lease). gw-a
//! holds the IP; gw-b reaches the API server through a proxy that then
//! stalls every connection open at the time (`Proxy::stall`: the server's
//! data held, new connections carried). gw-a stops and releases the IP.
//! gw-b must take it from the release: gw-a's liveness Lease is never
//! expired. Without the restart gw-b sees nothing of the release; the only
//! way it takes the IP is by expiring gw-a's liveness Lease once it looks
//! unrenewed, which this test fails on.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::net::IpAddr;
use std::time::Duration;

use egret_controlplane::k8s::crd::EgressPolicy;
use egret_controlplane::k8s::liveness::{liveness_lease_name, EXPIRED_BY_ANNOTATION};
use egret_controlplane::k8s::K8sOptions;
use egret_tests::apiserver::ApiServer;
use k8s_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, PostParams};
use serde_json::json;
use tokio::time::Instant;

const IP: &str = "198.18.3.1";

#[test]
fn a_stalled_watch_starts_over_and_sees_the_release() {
    with_api_server("a_stalled_watch_starts_over_and_sees_the_release", |server, rt| rt.block_on(scenario(server)));
}

fn options(name: &str) -> K8sOptions {
    let mut opts = K8sOptions::new(name);
    opts.lease_namespace = "egret-system".into();
    opts.liveness = true;
    opts
}

/// Waits until `done` holds (a progress bound, not a speed target).
async fn until(what: &str, limit: Duration, done: impl Fn() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < limit, "{what}: not in {} s", limit.as_secs());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn scenario(server: &ApiServer) {
    let client = server.client().await.expect("client");
    let ip: IpAddr = IP.parse().unwrap();
    ha_cluster(&client, &[("gw-a", "127.0.0.21".parse().unwrap()), ("gw-b", "127.0.0.22".parse().unwrap())]).await;
    let policy: EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "one"},
        "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}}, "destinations": ["0.0.0.0/0"], "egressIPs": [{"ip": IP}]}
    }))
    .unwrap();
    Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy).await.expect("policy");

    let mut a = Gateway::start_with(client.clone(), options("gw-a"));
    until("gw-a serves the IP", Duration::from_secs(30), || a.sink.held().contains(&ip)).await;
    let kubeconfig = server.kubeconfig_path();
    let proxy = Proxy::start(upstream(kubeconfig).await).await;
    let (client_b, _) = client_via(kubeconfig, proxy.port).await;
    let mut b = Gateway::start_with(client_b, options("gw-b"));
    // gw-b running: its liveness Lease written, its watches up.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
    let t = Instant::now();
    loop {
        let own = leases.get_opt(&liveness_lease_name("gw-b")).await.expect("read gw-b's liveness Lease");
        if own.and_then(|l| l.spec?.holder_identity).as_deref() == Some("gw-b") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(30), "gw-b never wrote its liveness Lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(b.sink.held().is_empty(), "gw-b serves nothing while gw-a holds the IP");

    proxy.stall();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t_stop = Instant::now();
    a.stop().await;
    until("gw-b serves the IP", Duration::from_secs(60), || b.sink.held().contains(&ip)).await;
    let took = t_stop.elapsed();

    let a_live = leases.get(&liveness_lease_name("gw-a")).await.expect("gw-a's liveness Lease");
    let expired_by = a_live.metadata.annotations.as_ref().and_then(|m| m.get(EXPIRED_BY_ANNOTATION)).cloned();
    println!(
        "k8s-stalled-watch: gw-b served the IP {} ms after gw-a's stop began (gw-a's liveness Lease expired by: {expired_by:?})",
        took.as_millis()
    );
    assert_eq!(
        expired_by, None,
        "gw-b took the IP by expiring gw-a's liveness Lease: it never saw the release (its stalled watches did not start over)"
    );
    assert_eq!(
        a_live.spec.and_then(|s| s.holder_identity).as_deref(),
        Some("gw-a"),
        "gw-a's liveness Lease still names it"
    );
    b.stop().await;
}
