//! The GCP provider (`egret_controlplane::cloud::gcp::GcpCloud`, the official
//! Compute client) against the Compute Engine emulator
//! (`tests/emulators/gcp/`), one per test, on loopback over plain HTTP with
//! anonymous credentials (the client's builder takes no CA).
//!
//! The emulator applies a mutation only when its operation is `DONE`, keeps
//! a log of every request (what the provider asked for), a routing truth
//! (where GCP would deliver each address now), faults (errors, stalls,
//! operations that end with an error) and stale reads; its README says
//! where it differs from Google Cloud.
//!
//! Needs Python 3.11 and curl (`gcp-emulator.sh check`); skipped with a
//! message when they are missing, unless `EGRET_REQUIRE_GCP_EMULATOR=1` (CI).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_controlplane::cloud::gcp::{self, GcpCloud};
use egret_controlplane::cloud::{Cloud, Discovered, PoolSelector, PublicAddress, HELD_ELSEWHERE};
use egret_tests::gcp_emulator::{GcpEmulator, PROJECT};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const REGION: &str = "us-central1";
const ZONE_A: &str = "us-central1-a";
const ZONE_B: &str = "us-central1-b";
const LINK: &str = "https://www.googleapis.com/compute/v1/";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn subnet() -> String {
    format!("projects/{PROJECT}/regions/{REGION}/subnetworks/gateways")
}

fn provider_id(zone: &str, name: &str) -> String {
    format!("gce://{PROJECT}/{zone}/{name}")
}

fn target_link(zone: &str, name: &str) -> String {
    format!("{LINK}projects/{PROJECT}/zones/{zone}/targetInstances/{name}")
}

fn rule_path(address: &str) -> String {
    format!("/compute/v1/projects/{PROJECT}/regions/{REGION}/forwardingRules/egret-{}", address.replace('.', "-"))
}

fn prod() -> PoolSelector {
    selector(&subnet(), &[("egret-pool", "prod"), ("team", "payments")])
}

fn selector(subnet_id: &str, labels: &[(&str, &str)]) -> PoolSelector {
    PoolSelector {
        provider: egret_controlplane::cloud::Provider::Gcp,
        tags: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
        subnet_id: subnet_id.to_owned(),
        ipv6: false,
    }
}

fn public_ips(d: &Discovered) -> BTreeSet<IpAddr> {
    d.public.iter().map(|p| p.public_ip).collect()
}

/// A reserved external address as discovery reports it, without asking.
fn public(name: &str, address: &str) -> PublicAddress {
    PublicAddress {
        public_ip: ip(address),
        allocation_id: format!("{LINK}projects/{PROJECT}/regions/{REGION}/addresses/{name}"),
        private_ip: None,
        interface_id: None,
    }
}

/// The tests' project: two gateways in different zones of the subnetwork
/// `gateways`, instances that are not gateways, an instance with its
/// interface in `gateways` as nic1, one with none there, and labelled
/// addresses (two in the pool `egret-pool=prod,team=payments`; one with
/// half the labels; another pool's; an unlabelled one; an INTERNAL one and
/// another region's with the pool's labels).
fn lab() -> Value {
    let nic = |subnet: &str, ip: &str| json!({"subnetwork": subnet, "networkIP": ip});
    let pool = json!({"egret-pool": "prod", "team": "payments"});
    json!({
        "project": PROJECT,
        "regions": {REGION: [ZONE_A, ZONE_B], "europe-west4": ["europe-west4-a"]},
        "networks": ["lab", "side"],
        "subnetworks": [
            {"name": "gateways", "region": REGION, "network": "lab", "ipCidrRange": "198.18.1.0/24"},
            {"name": "side", "region": REGION, "network": "side", "ipCidrRange": "198.18.2.0/24"},
            {"name": "eu", "region": "europe-west4", "network": "lab", "ipCidrRange": "198.18.3.0/24"},
        ],
        "instances": [
            {"name": "gw-a", "zone": ZONE_A, "canIpForward": true, "networkInterfaces": [nic("gateways", "198.18.1.10")]},
            {"name": "gw-b", "zone": ZONE_B, "canIpForward": true, "networkInterfaces": [nic("gateways", "198.18.1.11")]},
            {"name": "plain", "zone": ZONE_A, "canIpForward": false, "networkInterfaces": [nic("gateways", "198.18.1.12")]},
            {"name": "two-nics", "zone": ZONE_B, "canIpForward": true,
             "networkInterfaces": [nic("side", "198.18.2.10"), nic("gateways", "198.18.1.13")]},
            {"name": "elsewhere", "zone": ZONE_A, "networkInterfaces": [nic("side", "198.18.2.11")]},
            {"name": "outsider", "zone": ZONE_A, "canIpForward": true, "networkInterfaces": [nic("gateways", "198.18.1.20")]},
        ],
        "addresses": [
            {"name": "egress-1", "region": REGION, "address": "203.0.113.10", "labels": pool},
            {"name": "egress-2", "region": REGION, "address": "203.0.113.11", "labels": pool},
            {"name": "half", "region": REGION, "address": "203.0.113.12", "labels": {"egret-pool": "prod"}},
            {"name": "staging", "region": REGION, "address": "203.0.113.13",
             "labels": {"egret-pool": "staging", "team": "payments"}},
            {"name": "unlabelled", "region": REGION, "address": "203.0.113.14"},
            {"name": "internal", "region": REGION, "address": "198.18.1.50", "addressType": "INTERNAL",
             "subnetwork": "gateways", "labels": pool},
            {"name": "eu", "region": "europe-west4", "address": "203.0.113.15", "labels": pool},
        ],
    })
}

/// `seed` with more resources of each kind appended.
fn with(mut seed: Value, more: Value) -> Value {
    for (k, v) in more.as_object().unwrap() {
        match seed.get_mut(k).and_then(Value::as_array_mut) {
            Some(list) => list.extend(v.as_array().unwrap().iter().cloned()),
            None => {
                seed[k] = v.clone();
            }
        }
    }
    seed
}

/// A forwarding rule of ours (as Egret names it) for `address`, to `ti`.
fn our_rule(address: &str, zone: &str, ti: &str) -> Value {
    json!({"name": format!("egret-{}", address.replace('.', "-")), "region": REGION, "IPAddress": address,
           "IPProtocol": "L3_DEFAULT", "allPorts": true, "target": format!("zones/{zone}/targetInstances/{ti}")})
}

/// The emulator started (with the tests' lab) for `test`, or `None` when
/// the test is skipped.
async fn emulator_or_skip(test: &str, seed: Value) -> Option<GcpEmulator> {
    match GcpEmulator::available_or_skip(test) {
        Ok(true) => {
            let emu = GcpEmulator::start().expect("start the GCP emulator");
            emu.reset(Some(&seed)).await.unwrap();
            Some(emu)
        }
        Ok(false) => None,
        Err(e) => panic!("{e}"),
    }
}

async fn cloud(endpoint: &str) -> GcpCloud {
    GcpCloud::new(Some(endpoint.to_owned()), google_cloud_auth::credentials::anonymous::Builder::new().build())
        .await
        .unwrap()
}

fn gateways(names: &[(&str, &str)]) -> BTreeSet<String> {
    names.iter().map(|(zone, name)| provider_id(zone, name)).collect()
}

/// Waits until `f` holds (the emulator's hand-made changes complete with
/// their operation).
async fn until<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < Duration::from_secs(10), "waited 10 s for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_by_labels_external_only() {
    let seed = with(
        lab(),
        json!({
            "targetInstances": [{"name": "egret-gw-a", "zone": ZONE_A, "instance": "gw-a"}],
            "forwardingRules": [our_rule("203.0.113.10", ZONE_A, "egret-gw-a")],
        }),
    );
    let Some(emu) = emulator_or_skip("discovery_by_labels_external_only", seed).await else { return };
    let cloud = cloud(emu.endpoint()).await;

    let found = cloud.discover(&prod()).await.unwrap();
    // Both labels (ANDed), EXTERNAL, this region: not the half-labelled,
    // the other pool's, the unlabelled, the INTERNAL or the European one.
    assert_eq!(public_ips(&found), BTreeSet::from([ip("203.0.113.10"), ip("203.0.113.11")]));
    let by_ip: BTreeMap<IpAddr, &PublicAddress> = found.public.iter().map(|p| (p.public_ip, p)).collect();
    let forwarded = by_ip[&ip("203.0.113.10")];
    assert_eq!(forwarded.allocation_id, format!("{LINK}projects/{PROJECT}/regions/{REGION}/addresses/egress-1"));
    assert_eq!(forwarded.private_ip, Some(ip("203.0.113.10")), "forwarded by our rule: paired with itself");
    assert_eq!(forwarded.interface_id.as_deref(), Some(target_link(ZONE_A, "egret-gw-a").as_str()));
    let free = by_ip[&ip("203.0.113.11")];
    assert_eq!((free.private_ip, free.interface_id.as_deref()), (None, None), "no rule uses it");
    assert_eq!(found.subnet_cidr, "198.18.1.0/24".parse().unwrap());
    // Only GCP's reserved addresses: there are no private ones to avoid.
    let reserved: BTreeSet<IpAddr> =
        ["198.18.1.0", "198.18.1.1", "198.18.1.254", "198.18.1.255"].iter().map(|s| ip(s)).collect();
    assert_eq!(found.used, reserved);

    // What was asked: the labels as one filter, quoted; a rule read only
    // for the address our rule uses.
    let lists = emu.calls("addresses.list").await.unwrap();
    assert_eq!(lists.len(), 1);
    assert_eq!(lists[0]["query"]["filter"], r#"(labels.egret-pool = "prod") (labels.team = "payments")"#);
    let gets = emu.calls("forwardingRules.get").await.unwrap();
    assert_eq!(gets.len(), 1, "{gets:?}");
    assert!(gets[0]["path"].as_str().unwrap().ends_with("/forwardingRules/egret-203-0-113-10"));

    // The subnetwork's full link is accepted too.
    let full = selector(&format!("{LINK}{}", subnet()), &[("egret-pool", "prod"), ("team", "payments")]);
    assert_eq!(cloud.discover(&full).await.unwrap(), found);

    // A relabelled address leaves the pool on the next discovery.
    emu.seed(&json!({"addresses": [{"name": "egress-2", "region": REGION, "address": "203.0.113.11",
                                    "labels": {"egret-pool": "retired", "team": "payments"}}]}))
        .await
        .unwrap();
    assert_eq!(public_ips(&cloud.discover(&prod()).await.unwrap()), BTreeSet::from([ip("203.0.113.10")]));

    // One label selects more.
    let wide = cloud.discover(&selector(&subnet(), &[("team", "payments")])).await.unwrap();
    assert_eq!(public_ips(&wide), BTreeSet::from([ip("203.0.113.10"), ip("203.0.113.11"), ip("203.0.113.13")]));

    // No labels would select every address; a key GCP cannot have; a
    // subnetwork that is not a path; one that does not exist.
    for (pool, code) in [
        (selector(&subnet(), &[]), "InvalidLabels"),
        (selector(&subnet(), &[("Egret-Pool", "prod")]), "InvalidLabels"),
        (selector("subnet-0abc", &[("egret-pool", "prod")]), "InvalidSubnet"),
    ] {
        let e = cloud.discover(&pool).await.unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), (code, false), "{e}");
    }
    let missing = selector(&format!("projects/{PROJECT}/regions/{REGION}/subnetworks/nope"), &[("egret-pool", "prod")]);
    let e = cloud.discover(&missing).await.unwrap_err();
    assert_eq!((e.operation, e.retryable), ("subnetworks.get", false), "{e}");
    emu.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interface_from_provider_id_makes_the_target_instance_once() {
    let seed = with(
        lab(),
        json!({
            "instances": [{"name": "gw-c", "zone": ZONE_A, "canIpForward": true,
                           "networkInterfaces": [{"subnetwork": "gateways", "networkIP": "198.18.1.14"}]}],
            // A target instance with gw-c's name that forwards elsewhere.
            "targetInstances": [{"name": "egret-gw-c", "zone": ZONE_A, "instance": "outsider"}],
        }),
    );
    let Some(emu) = emulator_or_skip("interface_from_provider_id_makes_the_target_instance_once", seed).await else {
        return;
    };
    let cloud = cloud(emu.endpoint()).await;

    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    assert_eq!(a.instance_id, format!("{LINK}projects/{PROJECT}/zones/{ZONE_A}/instances/gw-a"));
    assert_eq!(a.interface_id, target_link(ZONE_A, "egret-gw-a"));
    assert_eq!(a.primary_ip, ip("198.18.1.10"));
    assert!(a.secondary_ips.is_empty());
    assert!(!a.source_dest_check, "canIpForward is on");
    let inserts = emu.calls("targetInstances.insert").await.unwrap();
    assert_eq!(inserts.len(), 1);
    assert_eq!(inserts[0]["body"]["name"], "egret-gw-a");
    assert_eq!(inserts[0]["body"]["natPolicy"], "NO_NAT");
    let state = emu.state().await.unwrap();
    let ti = state["targetInstances"].as_array().unwrap().iter().find(|t| t["name"] == "egret-gw-a").cloned();
    assert_eq!(ti.expect("created")["instance"], a.instance_id.as_str());

    // Asked again: the same, and no second insert.
    assert_eq!(cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap(), a);
    assert_eq!(emu.calls("targetInstances.insert").await.unwrap().len(), 1);

    // canIpForward off (the default): the check is on.
    let plain = cloud.interface(&provider_id(ZONE_A, "plain"), &subnet()).await.unwrap();
    assert!(plain.source_dest_check);
    assert_eq!(plain.primary_ip, ip("198.18.1.12"));

    // The interface in the subnetwork is nic1: its own target instance,
    // receiving on that interface's network.
    let two = cloud.interface(&provider_id(ZONE_B, "two-nics"), &subnet()).await.unwrap();
    assert_eq!(two.interface_id, target_link(ZONE_B, "egret-two-nics-nic1"));
    assert_eq!(two.primary_ip, ip("198.18.1.13"));
    let inserts = emu.calls("targetInstances.insert").await.unwrap();
    assert_eq!(inserts.last().unwrap()["body"]["network"], format!("{LINK}projects/{PROJECT}/global/networks/lab"));

    // The addresses forwarded to it are its "secondary" addresses.
    let gws = gateways(&[(ZONE_A, "gw-a"), (ZONE_B, "gw-b")]);
    cloud.assign(&a.interface_id, ip("203.0.113.10"), Some(&public("egress-1", "203.0.113.10")), &gws).await.unwrap();
    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    assert_eq!(a.secondary_ips, BTreeSet::from([ip("203.0.113.10")]));
    let b = cloud.interface(&provider_id(ZONE_B, "gw-b"), &subnet()).await.unwrap();
    assert!(b.secondary_ips.is_empty());

    // No interface in the subnetwork: named, not worth retrying.
    let e = cloud.interface(&provider_id(ZONE_A, "elsewhere"), &subnet()).await.unwrap_err();
    assert!(!e.retryable, "{e}");
    assert!(e.message.contains("instances/elsewhere") && e.message.contains(&subnet()), "{e}");
    // No such instance; not a GCE providerID.
    let e = cloud.interface(&provider_id(ZONE_A, "nope"), &subnet()).await.unwrap_err();
    assert_eq!((e.operation, e.retryable), ("instances.get", false), "{e}");
    let e = cloud.interface("aws:///us-east-1a/i-0abc", &subnet()).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("aws:///us-east-1a/i-0abc"), "{e}");
    // Its name is taken by a target instance of another instance.
    let e = cloud.interface(&provider_id(ZONE_A, "gw-c"), &subnet()).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("TargetInstanceConflict", false), "{e}");
    assert!(e.message.contains("instances/outsider"), "{e}");
    emu.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assign_moves_the_address_between_gateways_and_release_gives_it_up() {
    let Some(emu) = emulator_or_skip("assign_moves_the_address_between_gateways_and_release_gives_it_up", lab()).await
    else {
        return;
    };
    // Slow operations: an assign that returned before DONE would leave the
    // routing truth where it was.
    emu.configure(&json!({"operationDelay": 1.0})).await.unwrap();
    let cloud = cloud(emu.endpoint()).await;
    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    let b = cloud.interface(&provider_id(ZONE_B, "gw-b"), &subnet()).await.unwrap();
    let gws = gateways(&[(ZONE_A, "gw-a"), (ZONE_B, "gw-b")]);
    let found = cloud.discover(&prod()).await.unwrap();
    let egress = found.public.iter().find(|p| p.public_ip == ip("203.0.113.10")).unwrap().clone();
    let addr = ip("203.0.113.10");

    // Take-over by A: the rule is made, and the call waits for its DONE.
    emu.clear_requests().await.unwrap();
    let t0 = Instant::now();
    cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap();
    let took = t0.elapsed();
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-a"));
    assert!(took >= Duration::from_secs(1) && took < Duration::from_secs(6), "took {took:?}");
    let inserts = emu.calls("forwardingRules.insert").await.unwrap();
    assert_eq!(inserts.len(), 1);
    let body = &inserts[0]["body"];
    assert_eq!(body["name"], "egret-203-0-113-10");
    assert_eq!(body["IPAddress"], egress.allocation_id.as_str());
    assert_eq!(body["IPProtocol"], "L3_DEFAULT");
    assert_eq!(body["allPorts"], true);
    assert_eq!(body["loadBalancingScheme"], "EXTERNAL");
    assert_eq!(body["networkTier"], "PREMIUM");
    assert_eq!(body["target"], a.interface_id.as_str());
    assert!(!emu.calls("regionOperations.get").await.unwrap().is_empty(), "the operation was polled");
    assert!(cloud.verify(&a.interface_id, addr, Some(&egress)).await.unwrap());
    assert!(!cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());

    // Failover: B takes it with one setTarget, again waited for.
    cloud.assign(&b.interface_id, addr, Some(&egress), &gws).await.unwrap();
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-b"));
    let moves = emu.calls("forwardingRules.setTarget").await.unwrap();
    assert_eq!(moves.len(), 1);
    assert_eq!(moves[0]["body"]["target"], b.interface_id.as_str());
    assert!(moves[0]["path"].as_str().unwrap().ends_with("/forwardingRules/egret-203-0-113-10/setTarget"));
    assert_eq!(emu.calls("forwardingRules.insert").await.unwrap().len(), 1, "no second rule");

    // A's late release leaves B's rule alone.
    cloud.release(&a.interface_id, addr).await.unwrap();
    assert!(emu.calls("forwardingRules.delete").await.unwrap().is_empty());
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-b"));

    // Idempotent, and the call is always made.
    cloud.assign(&b.interface_id, addr, Some(&egress), &gws).await.unwrap();
    assert_eq!(emu.calls("forwardingRules.setTarget").await.unwrap().len(), 2);
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-b"));

    // B's release deletes the rule (waited for); again, nothing to do.
    cloud.release(&b.interface_id, addr).await.unwrap();
    assert_eq!(emu.calls("forwardingRules.delete").await.unwrap().len(), 1);
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap(), None);
    let state = emu.state().await.unwrap();
    assert!(state["forwardingRules"].as_array().unwrap().is_empty(), "{}", state["forwardingRules"]);
    cloud.release(&b.interface_id, addr).await.unwrap();
    assert_eq!(emu.calls("forwardingRules.delete").await.unwrap().len(), 1);
    assert!(!cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());

    // Without the discovered address (no allocation link): found by a
    // filter on the address.
    cloud.assign(&a.interface_id, ip("203.0.113.11"), None, &gws).await.unwrap();
    assert_eq!(emu.routed_to("203.0.113.11").await.unwrap().as_deref(), Some("gw-a"));
    let lists = emu.calls("addresses.list").await.unwrap();
    assert_eq!(lists.last().unwrap()["query"]["filter"], r#"(address = "203.0.113.11")"#);
    emu.stop().unwrap();
}

/// Compute's reads may be stale: a take-over must call whatever a read says.
/// The emulator serves reads of addresses and forwarding rules as they were
/// 30 s ago (`staleness`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_overs_call_whatever_a_stale_read_says() {
    let seed = with(
        lab(),
        json!({
            "targetInstances": [{"name": "egret-gw-a", "zone": ZONE_A, "instance": "gw-a"},
                                {"name": "egret-gw-b", "zone": ZONE_B, "instance": "gw-b"}],
            "forwardingRules": [our_rule("203.0.113.10", ZONE_A, "egret-gw-a")],
        }),
    );
    let Some(emu) = emulator_or_skip("take_overs_call_whatever_a_stale_read_says", seed).await else { return };
    emu.configure(&json!({"staleness": 30.0})).await.unwrap();
    let cloud = cloud(emu.endpoint()).await;
    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    let b = cloud.interface(&provider_id(ZONE_B, "gw-b"), &subnet()).await.unwrap();
    let gws = gateways(&[(ZONE_A, "gw-a"), (ZONE_B, "gw-b")]);
    let egress = public("egress-1", "203.0.113.10");
    let addr = ip("203.0.113.10");

    cloud.assign(&b.interface_id, addr, Some(&egress), &gws).await.unwrap();
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-b"));
    // The reads still say A.
    let read = emu.request("GET", &rule_path("203.0.113.10"), None).await.unwrap();
    assert_eq!(read.body["target"], a.interface_id.as_str(), "the emulator serves the stale rule");

    // A takes it back while the reads say it never left: setTarget all the same.
    emu.clear_requests().await.unwrap();
    cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap();
    let moves = emu.calls("forwardingRules.setTarget").await.unwrap();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(moves[0]["body"]["target"], a.interface_id.as_str());
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-a"));

    // A rule made moments ago reads as missing: the insert finds it
    // (409 alreadyExists) and the move is a setTarget.
    let other = public("egress-2", "203.0.113.11");
    cloud.assign(&a.interface_id, ip("203.0.113.11"), Some(&other), &gws).await.unwrap();
    emu.clear_requests().await.unwrap();
    cloud.assign(&b.interface_id, ip("203.0.113.11"), Some(&other), &gws).await.unwrap();
    let statuses: Vec<(String, i64)> = emu
        .mutations()
        .await
        .unwrap()
        .iter()
        .map(|r| (r["api"].as_str().unwrap_or_default().to_owned(), r["status"].as_i64().unwrap_or_default()))
        .collect();
    assert_eq!(
        statuses,
        [("forwardingRules.insert".to_owned(), 409), ("forwardingRules.setTarget".to_owned(), 200)],
        "the stale read made it try an insert first"
    );
    assert_eq!(emu.routed_to("203.0.113.11").await.unwrap().as_deref(), Some("gw-b"));
    emu.stop().unwrap();
}

/// An address that something other than Egret's rule uses (an access
/// config, another forwarding rule), or whose rule forwards to an instance
/// that is not a gateway Node, is someone else's: refused for good, before
/// any mutating call, naming the user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_used_by_something_else_is_refused() {
    let mut seed = with(
        lab(),
        json!({
            "targetInstances": [{"name": "lb-ti", "zone": ZONE_A, "instance": "outsider"},
                                {"name": "egret-outsider", "zone": ZONE_A, "instance": "outsider"}],
            "forwardingRules": [
                {"name": "lb-rule", "region": REGION, "IPAddress": "203.0.113.12", "IPProtocol": "TCP",
                 "portRange": "443", "target": "zones/us-central1-a/targetInstances/lb-ti"},
                our_rule("203.0.113.13", ZONE_A, "egret-outsider"),
            ],
        }),
    );
    // plain holds 203.0.113.11 as its access config.
    seed["instances"][2]["networkInterfaces"][0]["accessConfigs"] = json!([{"natIP": "203.0.113.11"}]);
    let Some(emu) = emulator_or_skip("an_address_used_by_something_else_is_refused", seed).await else { return };
    let cloud = cloud(emu.endpoint()).await;
    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    let mut gws = gateways(&[(ZONE_A, "gw-a"), (ZONE_B, "gw-b")]);
    emu.clear_requests().await.unwrap();

    for (name, address, names) in [
        ("egress-2", "203.0.113.11", "instances/plain"),
        ("half", "203.0.113.12", "forwardingRules/lb-rule"),
        ("staging", "203.0.113.13", "instances/outsider"),
    ] {
        let e = cloud.assign(&a.interface_id, ip(address), Some(&public(name, address)), &gws).await.unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), (HELD_ELSEWHERE, false), "{address}: {e}");
        assert!(e.message.contains(names), "{address}: {e}");
    }
    assert!(emu.mutations().await.unwrap().is_empty(), "no mutating call: {:?}", emu.mutations().await.unwrap());
    assert_eq!(emu.routed_to("203.0.113.13").await.unwrap().as_deref(), Some("outsider"));

    // Once that instance is a gateway Node, its rule is taken.
    gws.insert(provider_id(ZONE_A, "outsider"));
    cloud.assign(&a.interface_id, ip("203.0.113.13"), Some(&public("staging", "203.0.113.13")), &gws).await.unwrap();
    assert_eq!(emu.routed_to("203.0.113.13").await.unwrap().as_deref(), Some("gw-a"));
    emu.stop().unwrap();
}

/// A `PerNode` cloud pool's worker Nodes (ADR 0033), in another subnetwork
/// than the gateways: each Node's address is the pool's external address
/// itself, forwarded to the Node's own target instance (`egret-node-<name>`,
/// on `nic0`); no private address is added. The address moves from one
/// Node to another with one `setTarget`, and a release deletes the rule. An
/// address someone else uses (an access config, a rule to a target instance
/// that is neither a gateway's nor a Node's) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_nodes_address_is_forwarded_to_its_own_target_instance() {
    let worker = |name: &str, zone: &str, ip: &str| json!({"name": name, "zone": zone, "networkInterfaces": [{"subnetwork": "workers", "networkIP": ip}]});
    let mut seed = with(
        lab(),
        json!({
            "subnetworks": [{"name": "workers", "region": REGION, "network": "lab", "ipCidrRange": "198.18.4.0/24"}],
            "instances": [worker("worker-a", ZONE_A, "198.18.4.10"), worker("worker-b", ZONE_B, "198.18.4.11")],
            "targetInstances": [{"name": "egret-outsider", "zone": ZONE_A, "instance": "outsider"}],
            "forwardingRules": [our_rule("203.0.113.13", ZONE_A, "egret-outsider")],
        }),
    );
    // plain holds 203.0.113.11 as its access config.
    seed["instances"][2]["networkInterfaces"][0]["accessConfigs"] = json!([{"natIP": "203.0.113.11"}]);
    let Some(emu) = emulator_or_skip("a_worker_nodes_address_is_forwarded_to_its_own_target_instance", seed).await
    else {
        return;
    };
    let cloud = cloud(emu.endpoint()).await;
    let egress = public("egress-1", "203.0.113.10");
    let addr = ip("203.0.113.10");

    // The Node's nic0 and its own target instance, made once.
    let a = cloud.primary_interface(&provider_id(ZONE_A, "worker-a")).await.unwrap();
    assert_eq!(a.interface_id, target_link(ZONE_A, "egret-node-worker-a"));
    assert_eq!(a.instance_id, format!("{LINK}projects/{PROJECT}/zones/{ZONE_A}/instances/worker-a"));
    assert_eq!((a.primary_ip, a.secondary_ips.len()), (ip("198.18.4.10"), 0));
    let inserts = emu.calls("targetInstances.insert").await.unwrap();
    assert_eq!(inserts.len(), 1);
    assert_eq!(inserts[0]["body"]["name"], "egret-node-worker-a");
    assert_eq!(inserts[0]["body"]["instance"], a.instance_id.as_str());
    assert!(inserts[0]["body"]["description"].as_str().unwrap().contains("PerNode"), "{}", inserts[0]["body"]);
    assert_eq!(cloud.primary_interface(&provider_id(ZONE_A, "worker-a")).await.unwrap(), a);
    assert_eq!(emu.calls("targetInstances.insert").await.unwrap().len(), 1, "made once");
    // nic0, even where another interface is in the gateways' subnetwork.
    let two = cloud.primary_interface(&provider_id(ZONE_B, "two-nics")).await.unwrap();
    assert_eq!((two.interface_id, two.primary_ip), (target_link(ZONE_B, "egret-node-two-nics"), ip("198.18.2.10")));
    let e = cloud.primary_interface(&provider_id(ZONE_A, "nope")).await.unwrap_err();
    assert_eq!((e.operation, e.retryable), ("instances.get", false), "{e}");

    // No private address to add: refused for good, without a call.
    emu.clear_requests().await.unwrap();
    let e = cloud.add_address(&a.interface_id).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("NotApplicable", false), "{e}");
    assert!(emu.requests(0).await.unwrap().is_empty());

    // The address forwarded to the Node, with only the Node to take from.
    cloud.assign(&a.interface_id, addr, Some(&egress), &gateways(&[(ZONE_A, "worker-a")])).await.unwrap();
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("worker-a"));
    let inserts = emu.calls("forwardingRules.insert").await.unwrap();
    assert_eq!(inserts.len(), 1);
    assert_eq!(inserts[0]["body"]["target"], a.interface_id.as_str());
    assert!(cloud.verify(&a.interface_id, addr, Some(&egress)).await.unwrap());
    let a_now = cloud.primary_interface(&provider_id(ZONE_A, "worker-a")).await.unwrap();
    assert_eq!(a_now.secondary_ips, BTreeSet::from([addr]));

    // Another Node (another zone) takes it from the first: one setTarget.
    let b = cloud.primary_interface(&provider_id(ZONE_B, "worker-b")).await.unwrap();
    emu.clear_requests().await.unwrap();
    cloud.assign(&b.interface_id, addr, Some(&egress), &gateways(&[(ZONE_B, "worker-b")])).await.unwrap();
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("worker-b"));
    let moves = emu.calls("forwardingRules.setTarget").await.unwrap();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(moves[0]["body"]["target"], b.interface_id.as_str());
    assert!(!cloud.verify(&a.interface_id, addr, Some(&egress)).await.unwrap());
    assert!(cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());

    // Someone else's: an access config, and a rule to a gateway-style target
    // instance of an instance that is not a gateway. Refused before any
    // mutating call, naming the user.
    emu.clear_requests().await.unwrap();
    let only_a = gateways(&[(ZONE_A, "worker-a")]);
    for (name, address, names) in
        [("egress-2", "203.0.113.11", "instances/plain"), ("staging", "203.0.113.13", "instances/outsider")]
    {
        let e = cloud.assign(&a.interface_id, ip(address), Some(&public(name, address)), &only_a).await.unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), (HELD_ELSEWHERE, false), "{address}: {e}");
        assert!(e.message.contains(names), "{address}: {e}");
    }
    assert!(emu.mutations().await.unwrap().is_empty(), "{:?}", emu.mutations().await.unwrap());
    assert_eq!(emu.routed_to("203.0.113.13").await.unwrap().as_deref(), Some("outsider"));

    // A's late release leaves B's rule alone; B's deletes it. The Node's
    // target instance stays, for its next address.
    cloud.release(&a.interface_id, addr).await.unwrap();
    assert!(emu.calls("forwardingRules.delete").await.unwrap().is_empty());
    cloud.release(&b.interface_id, addr).await.unwrap();
    assert_eq!(emu.calls("forwardingRules.delete").await.unwrap().len(), 1);
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap(), None);
    assert!(!cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());
    let state = emu.state().await.unwrap();
    let names: BTreeSet<&str> =
        state["targetInstances"].as_array().unwrap().iter().filter_map(|t| t["name"].as_str()).collect();
    assert!(names.contains("egret-node-worker-b"), "{names:?}");

    // A gateway takes an address from a Node's target instance, as AWS and
    // Azure take a public address from any association.
    cloud.assign(&a.interface_id, addr, Some(&egress), &only_a).await.unwrap();
    let gw = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    cloud
        .assign(&gw.interface_id, addr, Some(&egress), &gateways(&[(ZONE_A, "gw-a"), (ZONE_B, "gw-b")]))
        .await
        .unwrap();
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-a"));
    emu.stop().unwrap();
}

/// A refresh's check: the rule exists and forwards to this gateway; drift
/// (retargeted or deleted by hand) reads as `false`, a failed read as an
/// error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reads_drift_from_the_providers_view() {
    let Some(emu) = emulator_or_skip("verify_reads_drift_from_the_providers_view", lab()).await else { return };
    let cloud = cloud(emu.endpoint()).await;
    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    let b = cloud.interface(&provider_id(ZONE_B, "gw-b"), &subnet()).await.unwrap();
    let gws = gateways(&[(ZONE_A, "gw-a"), (ZONE_B, "gw-b")]);
    let egress = public("egress-1", "203.0.113.10");
    let addr = ip("203.0.113.10");

    cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap();
    assert!(cloud.verify(&a.interface_id, addr, Some(&egress)).await.unwrap());
    assert!(!cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());
    assert!(!cloud.verify(&a.interface_id, ip("203.0.113.11"), None).await.unwrap(), "no rule");

    // Retargeted by hand.
    let set = emu
        .request("POST", &format!("{}/setTarget", rule_path("203.0.113.10")), Some(&json!({"target": b.interface_id})))
        .await
        .unwrap();
    assert_eq!(set.status, 200, "{:?}", set.body);
    until("the hand-made move", || async { emu.routed_to("203.0.113.10").await.unwrap().as_deref() == Some("gw-b") })
        .await;
    assert!(!cloud.verify(&a.interface_id, addr, Some(&egress)).await.unwrap());
    assert!(cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());

    // Deleted by hand.
    let del = emu.request("DELETE", &rule_path("203.0.113.10"), None).await.unwrap();
    assert_eq!(del.status, 200, "{:?}", del.body);
    until("the hand-made delete", || async { emu.routed_to("203.0.113.10").await.unwrap().is_none() }).await;
    assert!(!cloud.verify(&b.interface_id, addr, Some(&egress)).await.unwrap());

    // A failed read is an error, not a verdict.
    emu.arm(&json!({"api": "forwardingRules.get", "status": 503})).await.unwrap();
    let e = cloud.verify(&a.interface_id, addr, Some(&egress)).await.unwrap_err();
    assert_eq!((e.operation, e.retryable), ("forwardingRules.get", true), "{e}");
    emu.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_classified() {
    let Some(emu) = emulator_or_skip("api_errors_are_classified", lab()).await else { return };
    let cloud = cloud(emu.endpoint()).await;
    let a = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap();
    let gws = gateways(&[(ZONE_A, "gw-a")]);
    let egress = public("egress-1", "203.0.113.10");
    let addr = ip("203.0.113.10");
    let check = |e: &egret_controlplane::cloud::CloudError, op: &str, code: &str, retryable: bool| {
        assert_eq!((e.operation, e.code.as_str(), e.retryable), (op, code, retryable), "{e:?}");
    };

    // Throttled (403 rateLimitExceeded): retryable, and one attempt only
    // (the client does not retry: the next call gets the real answer).
    // The message does not say why: the reason (errors[].reason) does.
    emu.arm(&json!({"api": "addresses.list", "status": 403, "message": "Slow down."})).await.unwrap();
    let e = cloud.discover(&prod()).await.unwrap_err();
    check(&e, "addresses.list", "rateLimitExceeded", true);
    assert_eq!(cloud.discover(&prod()).await.unwrap().public.len(), 2);
    assert_eq!(emu.calls("addresses.list").await.unwrap().len(), 2, "one request per call");
    // The emulator's own rate quota, as Compute words it.
    emu.configure(&json!({"quota": {"read": 1, "window": 3600}})).await.unwrap();
    let e = cloud.discover(&prod()).await.unwrap_err();
    check(&e, "subnetworks.get", "rateLimitExceeded", true);
    assert!(e.message.contains("per minute"), "{e}");
    emu.configure(&json!({"quota": {"read": 0, "mutation": 0}})).await.unwrap();
    // The same status denied for want of permission: for good.
    emu.arm(&json!({"api": "subnetworks.get", "status": 403, "reason": "forbidden",
                    "message": "Required 'compute.subnetworks.get' permission for 'projects/egret-lab/regions/us-central1/subnetworks/gateways'"}))
        .await
        .unwrap();
    let e = cloud.discover(&prod()).await.unwrap_err();
    check(&e, "subnetworks.get", "forbidden", false);
    // Compute's side: retryable.
    emu.arm(&json!({"api": "subnetworks.get", "status": 503})).await.unwrap();
    check(&cloud.discover(&prod()).await.unwrap_err(), "subnetworks.get", "backendError", true);
    emu.arm(&json!({"api": "instances.get", "status": 500})).await.unwrap();
    let e = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap_err();
    check(&e, "instances.get", "backendError", true);
    emu.arm(&json!({"api": "targetInstances.get", "status": 429})).await.unwrap();
    let e = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap_err();
    check(&e, "targetInstances.get", "rateLimitExceeded", true);
    // A bad request: for good.
    emu.arm(&json!({"api": "forwardingRules.insert", "status": 400})).await.unwrap();
    check(
        &cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap_err(),
        "forwardingRules.insert",
        "invalid",
        false,
    );
    cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap();
    // A stale fingerprint (412 conditionNotMet): retryable.
    emu.arm(&json!({"api": "forwardingRules.setTarget", "status": 412})).await.unwrap();
    let e = cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap_err();
    check(&e, "forwardingRules.setTarget", "conditionNotMet", true);

    // Operations that end DONE with an error change nothing and fail the call.
    emu.arm(&json!({"api": "forwardingRules.setTarget", "operationError":
        {"code": "IP_IN_USE_BY_ANOTHER_RESOURCE", "message": "IP '203.0.113.10' is already being used by another resource.", "httpStatus": 400}}))
        .await
        .unwrap();
    let e = cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap_err();
    check(&e, "forwardingRules.setTarget", "IP_IN_USE_BY_ANOTHER_RESOURCE", false);
    assert!(e.message.contains("already being used"), "{e}");
    emu.arm(&json!({"api": "forwardingRules.delete", "operationError":
        {"code": "RATE_LIMIT_EXCEEDED", "message": "Rate Limit Exceeded", "httpStatus": 403}}))
        .await
        .unwrap();
    check(
        &cloud.release(&a.interface_id, addr).await.unwrap_err(),
        "forwardingRules.delete",
        "RATE_LIMIT_EXCEEDED",
        true,
    );
    assert_eq!(emu.routed_to("203.0.113.10").await.unwrap().as_deref(), Some("gw-a"), "nothing changed");

    // A stalled request ends at the attempt's bound, retryably.
    emu.arm(&json!({"api": "instances.get", "stall": 60})).await.unwrap();
    let t0 = Instant::now();
    let e = cloud.interface(&provider_id(ZONE_A, "gw-a"), &subnet()).await.unwrap_err();
    check(&e, "instances.get", "timeout", true);
    assert!(t0.elapsed() < gcp::ATTEMPT_TIMEOUT + Duration::from_secs(3), "{:?}", t0.elapsed());
    // A stalled poll of the operation: the mutation's call names it.
    emu.arm(&json!({"api": "regionOperations.get", "stall": 60})).await.unwrap();
    let e = cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap_err();
    check(&e, "forwardingRules.setTarget", "timeout", true);
    emu.disarm_all().await.unwrap();
    // An operation that never gets DONE: the call's bound.
    emu.configure(&json!({"operationDelay": 600})).await.unwrap();
    let t0 = Instant::now();
    let e = cloud.assign(&a.interface_id, addr, Some(&egress), &gws).await.unwrap_err();
    let took = t0.elapsed();
    check(&e, "forwardingRules.setTarget", "timeout", true);
    assert!(
        took >= gcp::CALL_TIMEOUT - Duration::from_secs(1) && took < gcp::CALL_TIMEOUT + Duration::from_secs(3),
        "{took:?}"
    );
    emu.configure(&json!({"operationDelay": 0.2})).await.unwrap();

    // Nothing listening: a retryable connection error.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let e = self::cloud(&dead_url).await.discover(&prod()).await.unwrap_err();
    check(&e, "addresses.list", "connect", true);
    emu.stop().unwrap();
}

/// Set in the child process of [`load_uses_the_default_credentials_and_the_endpoint_variable`].
const CHILD_ENV: &str = "EGRET_CLOUD_GCP_CHILD";

/// `GcpCloud::load` takes the endpoint from `EGRET_GCP_COMPUTE_ENDPOINT`
/// and its credentials from the client's default chain: with no credential
/// file, the metadata server (here a fake one named by `GCE_METADATA_HOST`,
/// as workload identity answers on GKE), whose token it sends as a Bearer
/// token. The environment is given to a child process running
/// [`load_from_environment_child`] (this binary again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_uses_the_default_credentials_and_the_endpoint_variable() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(emu) = emulator_or_skip("load_uses_the_default_credentials_and_the_endpoint_variable", lab()).await else {
        return;
    };
    emu.configure(&json!({"allowAnonymous": false})).await.unwrap();
    let (metadata, tokens) = fake_metadata_server().await;
    let home = std::env::temp_dir().join(format!("egret-gcp-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = tokio::process::Command::new(exe)
        .args(["--exact", "load_from_environment_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env(gcp::ENDPOINT_ENV, emu.endpoint())
        .env("GCE_METADATA_HOST", metadata.to_string())
        // No credential file, no gcloud configuration: the metadata server.
        .env("HOME", &home)
        .env_remove("GOOGLE_APPLICATION_CREDENTIALS")
        .env_remove("CLOUDSDK_CONFIG")
        .env_remove("GOOGLE_CLOUD_UNIVERSE_DOMAIN")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(tokens.load(Ordering::SeqCst) >= 1, "the token came from the metadata server");
    let lists = emu.calls("addresses.list").await.unwrap();
    assert!(
        !lists.is_empty() && lists.iter().all(|r| r["authorization"] == "bearer" && r["status"] == 200),
        "{lists:?}"
    );
    let _ = std::fs::remove_dir_all(&home);
    emu.stop().unwrap();
}

/// The child half of [`load_uses_the_default_credentials_and_the_endpoint_variable`];
/// passes trivially when run on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_from_environment_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let cloud = GcpCloud::load().await.unwrap();
    let found = cloud.discover(&prod()).await.unwrap();
    assert_eq!(public_ips(&found), BTreeSet::from([ip("203.0.113.10"), ip("203.0.113.11")]));
}

/// A metadata server that answers the default service account's token
/// request (`Metadata-Flavor: Google` required), on a free port: its
/// address, and how many tokens it gave.
async fn fake_metadata_server() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let tokens = Arc::new(AtomicUsize::new(0));
    let count = tokens.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else { return };
            let count = count.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
                let path = head.split_whitespace().nth(1).unwrap_or_default().to_owned();
                let (status, body) = if path.starts_with("/computemetadata/v1/instance/service-accounts/default/token")
                    && head.contains("metadata-flavor: google")
                {
                    count.fetch_add(1, Ordering::SeqCst);
                    ("200 OK", r#"{"access_token":"egret-test-token","expires_in":3600,"token_type":"Bearer"}"#)
                } else {
                    ("404 Not Found", "{}")
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nMetadata-Flavor: Google\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    (addr, tokens)
}
