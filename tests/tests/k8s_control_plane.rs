//! One gateway control plane against a real API server: the CRDs from
//! `deploy/crds/`, namespaces, Pods with patched IPs, an annotated
//! LoadBalancer Service with a patched ingress IP, explicit, pooled and
//! invalid EgressPolicies. Checks the exact TablesSpec the gateway applies,
//! the announcements, the Leases, the status it writes and its Events
//! (port use near exhaustion's too, from a monitor the test feeds).
//!
//! Skipped (with a message) when not root or the API server is not built;
//! `EGRET_REQUIRE_APISERVER=1` makes that a failure.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::net::IpAddr;
use std::sync::Arc;

use egret_controlplane::k8s::crd::{EgressIPPool, EgressPolicy};
use egret_controlplane::k8s::liveness::{liveness_lease_name, EPOCH_ANNOTATION, RECORD_DURATION_SECS};
use egret_controlplane::port_use::{DestinationUse, Monitor, MonitorRef, PodUse, PoolUse, PortUse};
use egret_dataplane::tables::{EgressIpSpec, PolicySpec};
use egret_tests::apiserver::ApiServer;
use k8s_common::*;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn one_gateway_tables_status_and_events() {
    with_api_server("one_gateway_tables_status_and_events", |server, rt| rt.block_on(scenario(server)));
}

async fn scenario(server: &ApiServer) {
    let client = server.client().await.expect("client");
    install_crds(&client).await;
    namespace(&client, "egret-system", json!({})).await;
    namespace(&client, "team-a", json!({"team": "a"})).await;
    namespace(&client, "other", json!({})).await;
    node(&client, "gw-1", json!({"egret.dev/gateway": "true", "zone": "x"})).await;
    node(&client, "worker-1", json!({})).await;
    pod(&client, "team-a", "web-1", json!({"app": "web"}), "198.18.0.11").await;
    pod(&client, "team-a", "web-2", json!({"app": "web"}), "198.18.0.12").await;
    pod(&client, "team-a", "db-1", json!({"app": "db"}), "198.18.0.13").await;
    pod(&client, "other", "web-9", json!({"app": "web"}), "198.18.0.99").await;
    lb_service(&client, "team-a", "web", json!({"app": "web"}), &[443], "198.51.100.20").await;
    lb_service(&client, "team-a", "clash", json!({"app": "db"}), &[40000], "198.51.100.21").await;

    let policies: Api<EgressPolicy> = Api::all(client.clone());
    let pools: Api<EgressIPPool> = Api::all(client.clone());
    let pp = PostParams::default();
    let create_policy = |v: serde_json::Value| {
        let policies = policies.clone();
        let pp = pp.clone();
        async move {
            let p: EgressPolicy = serde_json::from_value(v).expect("policy json");
            policies.create(&pp, &p).await.expect("create policy");
        }
    };
    create_policy(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "team-a-web"},
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": "a"}},
            "podSelector": {"matchLabels": {"app": "web"}},
            "destinations": ["0.0.0.0/0"],
            "except": ["198.51.100.128/25"],
            "egressIPs": [{"ip": "198.51.100.10"}, {"ip": "203.0.113.10", "nextHop": "192.0.2.100"}]
        }
    }))
    .await;
    create_policy(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "broken"},
        "spec": {"destinations": ["10.0.0.0/33"], "egressIPs": [{"ip": "198.51.100.30"}]}
    }))
    .await;
    let pool: EgressIPPool = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressIPPool",
        "metadata": {"name": "pool-a"},
        "spec": {"addresses": ["198.51.100.40-198.51.100.41"]}
    }))
    .unwrap();
    pools.create(&pp, &pool).await.expect("create pool");
    create_policy(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "db"},
        "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "destinations": ["203.0.113.0/24"], "pool": {"name": "pool-a"}}
    }))
    .await;

    // The gateway runs as the deployed ServiceAccount: the RBAC must suffice.
    let sa_client = gateway_service_account_client(&client, server.kubeconfig_path()).await;
    let monitor = Arc::new(Monitor::new(10));
    let mut opts = options("gw-1");
    opts.lease_namespace = "egret-system".into();
    opts.port_use = Some(MonitorRef(monitor.clone()));
    let gw = Gateway::start_with(sa_client, opts);
    let want_ips = [ip("198.51.100.10"), ip("198.51.100.20"), ip("198.51.100.40"), ip("203.0.113.10")];
    // The companion next hop and the Service VIP whose port is in the NAT
    // range (announced only) have Leases of their own, taken in the same
    // pass or a later one (liveness Leases: each record is its own request).
    let want_neighbors = [ip("192.0.2.100"), ip("198.51.100.21")];
    let spec = wait_for("gw-1 to hold every valid egress IP and neighbour address", WAIT, || {
        let s = gw.sink.last();
        async move {
            s.filter(|s| {
                s.egress_ips.iter().map(|e| e.ip).collect::<Vec<_>>() == want_ips
                    && s.neighbor_addresses == want_neighbors
            })
        }
    })
    .await;

    let net = |s: &str| s.parse().unwrap();
    assert_eq!(
        spec.policies,
        vec![
            PolicySpec {
                name: "egresspolicy/db".into(),
                sources: vec![net("198.18.0.13/32")],
                destinations: vec![net("203.0.113.0/24")],
                except: vec![],
                egress_ips: vec![ip("198.51.100.40")],
            },
            PolicySpec {
                name: "egresspolicy/team-a-web".into(),
                sources: vec![net("198.18.0.11/32"), net("198.18.0.12/32")],
                destinations: vec![net("0.0.0.0/0")],
                except: vec![net("198.51.100.128/25")],
                egress_ips: vec![ip("198.51.100.10"), ip("203.0.113.10")],
            },
            PolicySpec {
                name: "service/team-a/web".into(),
                sources: vec![net("198.18.0.11/32"), net("198.18.0.12/32")],
                destinations: vec![net("0.0.0.0/0"), net("::/0")],
                except: vec![],
                egress_ips: vec![ip("198.51.100.20")],
            },
        ]
    );
    assert!(spec
        .egress_ips
        .iter()
        .all(|e| *e == EgressIpSpec { ip: e.ip, ports: None, answer_neighbor: true, port_blocks: None }));
    // The control plane applies only once its watches are synced: its very
    // first apply already selects the pods of every policy with explicit IPs
    // and of the Service (the daemon keeps the kernel's fail-closed table
    // until that apply: failclosed::ReleaseOnApply). The pool's policy may
    // still await its allocation then.
    let first = gw
        .sink
        .log
        .lock()
        .unwrap()
        .iter()
        .find_map(|(_, e)| match e {
            SinkEvent::Apply(s) => Some(s.clone()),
            SinkEvent::Announce(_) => None,
        })
        .expect("a first apply");
    let named = |s: &egret_dataplane::tables::TablesSpec, n: &str| s.policies.iter().find(|p| p.name == n).cloned();
    for n in ["egresspolicy/team-a-web", "service/team-a/web"] {
        assert!(named(&spec, n).is_some(), "{n} in the final tables");
        assert_eq!(named(&first, n), named(&spec, n), "{n} in the first apply");
    }
    let announced = gw.sink.announced();
    for a in want_ips.iter().chain(want_neighbors.iter()) {
        assert!(announced.contains(a), "{a} announced: {announced:?}");
    }

    // Leases: one per IP, held by gw-1. With liveness Leases (the default,
    // ADR 0016) the IP's Lease is a record under gw-1's epoch that no time
    // expires, and gw-1's own Lease carries the duration; per IP (ADR 0004)
    // the IP's Lease carries it.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
    let l = leases.get("egret-ip4-203-0-113-10").await.expect("lease of 203.0.113.10");
    let spec_l = l.spec.unwrap();
    assert_eq!(spec_l.holder_identity.as_deref(), Some("gw-1"));
    let ann = l.metadata.annotations.unwrap();
    if options("gw-1").liveness {
        assert_eq!(spec_l.lease_duration_seconds, Some(RECORD_DURATION_SECS));
        let own = leases.get(&liveness_lease_name("gw-1")).await.expect("gw-1's liveness Lease");
        let own_spec = own.spec.unwrap();
        assert_eq!(own_spec.holder_identity.as_deref(), Some("gw-1"));
        assert_eq!(own_spec.lease_duration_seconds, Some(4));
        let epoch = own.metadata.annotations.unwrap_or_default().get(EPOCH_ANNOTATION).cloned();
        assert!(epoch.is_some(), "gw-1's liveness Lease carries its epoch");
        assert_eq!(ann.get(EPOCH_ANNOTATION), epoch.as_ref(), "the IP's record names gw-1's epoch");
    } else {
        assert_eq!(spec_l.lease_duration_seconds, Some(4));
    }
    assert_eq!(ann.get("egret.dev/egress-ip").map(String::as_str), Some("203.0.113.10"));
    assert_eq!(ann.get("egret.dev/next-hop").map(String::as_str), Some("192.0.2.100"));

    // Status written by the gateway.
    let st = wait_for("team-a-web Ready", WAIT, || {
        let policies = policies.clone();
        async move {
            let p = policies.get("team-a-web").await.ok()?;
            let st = p.status?;
            st.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True").then_some(st)
        }
    })
    .await;
    assert_eq!(st.selected_pods, 2);
    assert_eq!(st.egress_ip_list, "198.51.100.10,203.0.113.10");
    assert_eq!(st.gateway_list, "gw-1,gw-1");
    assert_eq!(st.egress_ips[1].next_hop.as_deref(), Some("192.0.2.100"));
    assert!(st.egress_ips.iter().all(|e| e.since.is_some()));
    let broken = wait_for("broken has a status", WAIT, || {
        let policies = policies.clone();
        async move { policies.get("broken").await.ok()?.status }
    })
    .await;
    let ready = broken.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("False", "InvalidSpec"));
    assert_eq!(ready.message, "spec.destinations[0]: \"10.0.0.0/33\" is not a CIDR");
    let pool_status = pools.get("pool-a").await.unwrap().status.expect("pool status");
    assert_eq!(pool_status.allocations.len(), 1);
    assert_eq!(pool_status.allocations[0].policy, "db");
    assert_eq!(pool_status.allocations[0].ips, vec!["198.51.100.40".to_string()]);
    assert_eq!((pool_status.size, pool_status.allocated), (2, 1));

    // Events: assignment (in "default" for the cluster-scoped policy) and the Service's problem.
    let events: Api<Event> = Api::all(client.clone());
    let got = wait_for("events", WAIT, || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await.ok()?;
            let reasons: Vec<(String, String)> = list
                .items
                .iter()
                .map(|e| {
                    (
                        e.regarding.as_ref().and_then(|r| r.name.clone()).unwrap_or_default(),
                        e.reason.clone().unwrap_or_default(),
                    )
                })
                .collect();
            let ok = reasons.contains(&("team-a-web".into(), "EgressIPAssigned".into()))
                && reasons.contains(&("clash".into(), "ServicePortInNatRange".into()));
            ok.then_some(reasons)
        }
    })
    .await;
    println!("events: {got:?}");

    // Port use near exhaustion (ADR 0035): the data plane's count, as the
    // daemon's walk hands it over, towards one destination and for web-1's
    // quota: a Warning Event on the egress IP's policy for each, and on
    // the pod for its quota; sent by the sync loop, which the monitor wakes.
    let remote = "203.0.113.99:443".parse().unwrap();
    let u = PortUse {
        pools: vec![PoolUse {
            egress_ip: ip("198.51.100.10"),
            proto: "tcp".into(),
            endpoint_dependent: true,
            in_use: 90,
            capacity: 100,
            pod_quota: Some(25),
            destinations: vec![DestinationUse { remote, in_use: 90 }],
            pods: vec![PodUse { pod: ip("198.18.0.11"), remote: Some(remote), in_use: 24 }],
        }],
        ..PortUse::default()
    };
    assert_eq!(monitor.update(u, std::time::Instant::now()).len(), 2);
    let got = wait_for("port-use events", WAIT, || {
        let events = events.clone();
        async move {
            let list = events.list(&ListParams::default()).await.ok()?;
            let warnings: Vec<(String, String, String)> = list
                .items
                .iter()
                .filter(|e| e.type_.as_deref() == Some("Warning"))
                .map(|e| {
                    (
                        e.regarding.as_ref().and_then(|r| r.name.clone()).unwrap_or_default(),
                        e.reason.clone().unwrap_or_default(),
                        e.note.clone().unwrap_or_default(),
                    )
                })
                .collect();
            let has = |name: &str, reason: &str| warnings.iter().any(|w| w.0 == name && w.1 == reason);
            let ok = has("team-a-web", "PortsNearExhaustion")
                && has("team-a-web", "PodPortQuotaNearExhaustion")
                && has("web-1", "PodPortQuotaNearExhaustion");
            ok.then_some(warnings)
        }
    })
    .await;
    let note = &got.iter().find(|w| w.1 == "PortsNearExhaustion").unwrap().2;
    assert!(
        note.contains(
            "egress IP 198.51.100.10 uses 90 of its 100 tcp ports towards 203.0.113.99:443 (>= 80%) on gateway gw-1"
        ),
        "{note}"
    );

    // What `kubectl get` shows (for docs/kubernetes.md), if the harness built kubectl.
    if let Some(kubectl) = kubectl() {
        for what in ["egresspolicies", "egressippools"] {
            let out = std::process::Command::new(&kubectl)
                .args(["--kubeconfig", &server.kubeconfig_path().display().to_string(), "get", what])
                .output()
                .expect("kubectl");
            println!(
                "$ kubectl get {what}\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(out.status.success());
        }
    }

    // A deleted policy leaves the tables and its Lease is released.
    policies.delete("team-a-web", &Default::default()).await.expect("delete policy");
    wait_for("team-a-web out of the tables", WAIT, || {
        let s = gw.sink.last();
        async move {
            s.filter(|s| {
                s.policies.iter().all(|p| p.name != "egresspolicy/team-a-web")
                    && !s.egress_ips.iter().any(|e| e.ip == ip("198.51.100.10"))
            })
        }
    })
    .await;
    wait_for("its Lease deleted", WAIT, || {
        let leases = leases.clone();
        async move { leases.get_opt("egret-ip4-198-51-100-10").await.ok()?.is_none().then_some(()) }
    })
    .await;
}
