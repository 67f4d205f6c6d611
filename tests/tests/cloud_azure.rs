//! The Azure provider (`egret_controlplane::cloud::azure::AzureCloud`, on
//! azure_core's pipeline) against the ARM emulator (`tests/emulators/azure`,
//! one per test, over HTTPS with a test CA), which checks NIC updates as ARM
//! does (a public IP or private address another NIC holds is refused, also
//! while that NIC's update runs), serves stale reads, faults and throttling,
//! and records every request and where each address is routed now.
//!
//! Where the emulator differs from Azure is in its README ("Where the
//! emulator differs from Azure").
//!
//! Needs python3 (3.11), curl and openssl; skipped with a message when one
//! is missing, unless `EGRET_REQUIRE_AZURE_EMULATOR=1` (CI).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use azure_core::credentials::{AccessToken, TokenCredential, TokenRequestOptions};
use egret_controlplane::cloud::azure::{self, AzureCloud, Bounds};
use egret_controlplane::cloud::{Cloud, Discovered, PoolSelector, PublicAddress, HELD_ELSEWHERE};
use egret_tests::azure_emulator::{AzureEmulator, RESOURCE_GROUP, SUBSCRIPTION};
use serde_json::{json, Value};

const POOL_TAG: &str = "egret.dev-pool";
const TOKEN: &str = "egret-test-token";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A bearer token that never expires (the emulator does not verify tokens,
/// only, when told, which ones it accepts).
#[derive(Debug)]
struct StaticToken(&'static str);

#[async_trait::async_trait]
impl TokenCredential for StaticToken {
    async fn get_token(&self, _: &[&str], _: Option<TokenRequestOptions<'_>>) -> azure_core::Result<AccessToken> {
        Ok(AccessToken::new(
            self.0.to_owned(),
            azure_core::time::OffsetDateTime::now_utc() + azure_core::time::Duration::hours(1),
        ))
    }
}

/// The emulator started for `test`, or `None` when the test is skipped.
fn emulator_or_skip(test: &str) -> Option<AzureEmulator> {
    match AzureEmulator::available_or_skip(test) {
        Ok(true) => Some(AzureEmulator::start().expect("start the ARM emulator")),
        Ok(false) => None,
        Err(e) => panic!("{e}"),
    }
}

fn cloud_with(emu: &AzureEmulator, token: &'static str, bounds: Bounds) -> AzureCloud {
    AzureCloud::new(Arc::new(StaticToken(token)), emu.endpoint(), Some(&emu.ca_pem().unwrap()), bounds).unwrap()
}

fn cloud(emu: &AzureEmulator) -> AzureCloud {
    cloud_with(emu, TOKEN, Bounds::default())
}

fn selector(subnet_id: &str, tags: &[(&str, &str)]) -> PoolSelector {
    PoolSelector {
        provider: egret_controlplane::cloud::Provider::Azure,
        tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
        subnet_id: subnet_id.to_owned(),
        ipv6: false,
    }
}

fn public_ips(d: &Discovered) -> BTreeSet<IpAddr> {
    d.public.iter().map(|p| p.public_ip).collect()
}

fn header<'a>(request: &'a Value, name: &str) -> Option<&'a str> {
    request["headers"].as_object()?.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).and_then(|(_, v)| v.as_str())
}

/// The IP configurations of a PUT body, by name.
fn put_ipconfigs(request: &Value) -> BTreeMap<String, Value> {
    request["body"]["properties"]["ipConfigurations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap().to_owned(), c["properties"].clone()))
        .collect()
}

/// The names of the NICs PUT since the requests were last cleared, in order.
fn put_nic_names(emu: &AzureEmulator) -> Vec<String> {
    emu.calls("PUT", "")
        .unwrap()
        .iter()
        .map(|r| r["path"].as_str().unwrap().rsplit('/').next().unwrap().to_owned())
        .collect()
}

fn same(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_by_tags_and_used_addresses() {
    let Some(emu) = emulator_or_skip("discovery_by_tags_and_used_addresses") else { return };
    let net = emu.network().unwrap();
    let gw_a = emu.vm("gw-a", "gateways", None, true, &[]).unwrap();
    let gw_b = emu.vm("gw-b", "gateways", None, true, &[("held", "198.18.1.200")]).unwrap();
    // A VM in the other subnet: its addresses are not this subnet's.
    let elsewhere = emu.vm("elsewhere", "other", None, false, &[]).unwrap();
    let prod = [(POOL_TAG, "prod"), ("team", "payments")];
    let in_pool_1 = emu.public_ip("egress-1", "203.0.113.10", &prod).unwrap();
    // Tag names compare without case on Azure; values exactly.
    let in_pool_2 =
        emu.public_ip("egress-2", "203.0.113.11", &[("EGRET.DEV-POOL", "prod"), ("Team", "payments")]).unwrap();
    let half_tagged = emu.public_ip("half", "203.0.113.12", &[(POOL_TAG, "prod")]).unwrap();
    let other_pool = emu.public_ip("staging", "203.0.113.13", &[(POOL_TAG, "staging"), ("team", "payments")]).unwrap();
    let wrong_case = emu.public_ip("case", "203.0.113.14", &[(POOL_TAG, "PROD"), ("team", "payments")]).unwrap();
    let untagged = emu.public_ip("untagged", "203.0.113.15", &[]).unwrap();
    // One page per item: every list is followed through its nextLinks.
    emu.configure(&json!({"pageSize": 1})).unwrap();

    let cloud = cloud(&emu);
    let pool = selector(&net.subnet_id, &prod);
    let found = cloud.discover(&pool).await.unwrap();
    assert_eq!(public_ips(&found), BTreeSet::from([in_pool_1.ip, in_pool_2.ip]));
    for excluded in [&half_tagged, &other_pool, &wrong_case, &untagged] {
        assert!(!public_ips(&found).contains(&excluded.ip), "{excluded:?} is not in the pool");
    }
    let by_id: BTreeMap<_, _> = found.public.iter().map(|p| (p.allocation_id.to_ascii_lowercase(), p)).collect();
    let one = by_id[&in_pool_1.id.to_ascii_lowercase()];
    assert_eq!(
        (one.public_ip, one.interface_id.as_deref(), one.private_ip),
        (in_pool_1.ip, None, None),
        "not associated yet"
    );
    assert_eq!(found.subnet_cidr, "198.18.1.0/24".parse().unwrap());
    for used in [gw_a.primary_ip, gw_b.primary_ip, ip("198.18.1.200")] {
        assert!(found.used.contains(&used), "{used} is in use: {:?}", found.used);
    }
    assert!(!found.used.contains(&elsewhere.primary_ip), "another subnet's address");
    for reserved in ["198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3", "198.18.1.255"] {
        assert!(found.used.contains(&ip(reserved)), "{reserved} is reserved by Azure");
    }
    assert!(!found.used.contains(&ip("198.18.1.100")), "a free address");
    // Pages were followed: the public IP list took one request per item.
    let lists = emu
        .calls("GET", &format!("/subscriptions/{SUBSCRIPTION}/providers/Microsoft.Network/publicIPAddresses"))
        .unwrap();
    assert!(lists.len() >= 6, "{} pages", lists.len());
    assert!(lists.iter().skip(1).all(|r| r["query"]["$skiptoken"].is_string()), "{lists:?}");

    // An association shows in the next discovery, with its private address.
    let gateways = BTreeSet::from([gw_a.provider_id.clone()]);
    cloud.assign(&gw_a.nic_id, ip("198.18.1.100"), Some(one), &gateways).await.unwrap();
    let after = cloud.discover(&pool).await.unwrap();
    let one = after.public.iter().find(|p| p.public_ip == in_pool_1.ip).unwrap();
    assert!(same(one.interface_id.as_deref().unwrap(), &gw_a.nic_id), "{one:?}");
    assert_eq!(one.private_ip, Some(ip("198.18.1.100")));
    assert!(after.used.contains(&ip("198.18.1.100")), "the assigned address is in use");

    // A pool with no tags would select every address; a subnet that is not
    // an ARM subnet ID names itself. Neither is worth retrying.
    let e = cloud.discover(&selector(&net.subnet_id, &[])).await.unwrap_err();
    assert!(!e.retryable, "{e}");
    let e = cloud.discover(&selector("subnet-0abc", &prod)).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("subnet-0abc"), "{e}");
    emu.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interface_from_provider_id() {
    let Some(emu) = emulator_or_skip("interface_from_provider_id") else { return };
    let net = emu.network().unwrap();
    let checked = emu.vm("checked", "gateways", Some("198.18.1.10"), false, &[]).unwrap();
    let forwarding = emu.vm("forwarding", "gateways", Some("198.18.1.11"), true, &[("extra", "198.18.1.150")]).unwrap();
    let elsewhere = emu.vm("elsewhere", "other", None, true, &[]).unwrap();
    // A VM whose primary NIC is in the other subnet and whose second NIC is
    // in the gateways' subnet: the second is the one.
    emu.seed(&json!({
        "networkInterfaces": [
            {"resourceGroup": RESOURCE_GROUP, "name": "two-0", "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/other", "primary": true}]},
            {"resourceGroup": RESOURCE_GROUP, "name": "two-1", "enableIPForwarding": true,
             "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/gateways", "privateIPAddress": "198.18.1.20", "primary": true}]}],
        "virtualMachines": [{"resourceGroup": RESOURCE_GROUP, "name": "two", "networkInterfaces": ["two-0", "two-1"]}],
    }))
    .unwrap();
    let cloud = cloud(&emu);

    let i = cloud.interface(&checked.provider_id, &net.subnet_id).await.unwrap();
    assert!(same(&i.instance_id, &checked.vm_id) && same(&i.interface_id, &checked.nic_id), "{i:?}");
    assert_eq!((i.primary_ip, i.secondary_ips.len()), (ip("198.18.1.10"), 0));
    assert!(i.source_dest_check, "IP forwarding off: Azure drops what is not addressed to the NIC");

    let i = cloud.interface(&forwarding.provider_id, &net.subnet_id).await.unwrap();
    assert_eq!(i.secondary_ips, BTreeSet::from([ip("198.18.1.150")]));
    assert!(!i.source_dest_check);
    // The subnet ID compares without case, as ARM IDs do.
    let i = cloud.interface(&forwarding.provider_id, &net.subnet_id.to_uppercase()).await.unwrap();
    assert!(same(&i.interface_id, &forwarding.nic_id));

    let two = format!("azure:///subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.Compute/virtualMachines/two");
    let i = cloud.interface(&two, &net.subnet_id).await.unwrap();
    assert!(i.interface_id.ends_with("/networkInterfaces/two-1"), "{i:?}");
    assert_eq!(i.primary_ip, ip("198.18.1.20"));

    // No NIC in the subnet: named, and not worth retrying.
    let e = cloud.interface(&elsewhere.provider_id, &net.subnet_id).await.unwrap_err();
    assert!(!e.retryable, "{e}");
    assert!(e.message.contains(&elsewhere.vm_id) && e.message.contains(&net.subnet_id), "{e}");
    // A VM that does not exist.
    let gone = two.replace("/two", "/gone");
    let e = cloud.interface(&gone, &net.subnet_id).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("virtualMachines/gone"), "{e}");
    // Not an Azure VM's provider ID: refused before any call.
    emu.clear_requests().unwrap();
    for bad in [
        "aws:///us-east-1a/i-0abc".to_owned(),
        format!("azure:///subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/0"),
    ] {
        let e = cloud.interface(&bad, &net.subnet_id).await.unwrap_err();
        assert!(!e.retryable && e.message.contains(&bad), "{e}");
    }
    assert!(emu.requests().unwrap().is_empty(), "no ARM call for a provider ID that is not a VM's");
    emu.stop().unwrap();
}

/// Two gateways, one egress address: the take-over by A, the idempotent
/// repeat, the move to B (two NIC updates: A's without the IP
/// configuration, waited for, then B's with it), the routing truth
/// following, and releases that are idempotent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assign_moves_the_address_between_gateways_and_release_gives_it_up() {
    let Some(emu) = emulator_or_skip("assign_moves_the_address_between_gateways_and_release_gives_it_up") else {
        return;
    };
    let net = emu.network().unwrap();
    let gw_a = emu.vm("gw-a", "gateways", None, true, &[]).unwrap();
    let gw_b = emu.vm("gw-b", "gateways", None, true, &[]).unwrap();
    let pip = emu.public_ip("egress-1", "203.0.113.10", &[(POOL_TAG, "prod")]).unwrap();
    let cloud = cloud(&emu);
    let gateways = BTreeSet::from([gw_a.provider_id.clone(), gw_b.provider_id.clone()]);
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    assert_eq!(public.len(), 1);
    let public: &PublicAddress = &public[0];
    let private = ip("198.18.1.100");

    // Take-over by A.
    emu.clear_requests().unwrap();
    cloud.assign(&gw_a.nic_id, private, Some(public), &gateways).await.unwrap();
    let (nic, shown) = emu.private_route(private).unwrap().expect("routed");
    assert!(same(&nic, &gw_a.nic_id));
    assert_eq!(shown.as_deref(), Some("203.0.113.10"));
    let (nic, to) = emu.public_route(pip.ip).unwrap().expect("associated");
    assert!(same(&nic, &gw_a.nic_id) && to == "198.18.1.100", "{nic} {to}");
    let puts = emu.calls("PUT", &format!("/networkInterfaces/{}", gw_a.nic_name)).unwrap();
    assert_eq!(puts.len(), 1);
    let configs = put_ipconfigs(&puts[0]);
    let ours = &configs["egret-198-18-1-100"];
    assert_eq!(ours["privateIPAddress"], json!("198.18.1.100"));
    assert_eq!(ours["privateIPAllocationMethod"], json!("Static"));
    assert!(same(ours["publicIPAddress"]["id"].as_str().unwrap(), &pip.id));
    assert!(same(ours["subnet"]["id"].as_str().unwrap(), &net.subnet_id));
    assert!(configs["ipconfig1"]["primary"] == json!(true), "the primary goes back as it was");
    assert!(header(&puts[0], "If-Match").is_some_and(|e| e.starts_with("W/\"")), "{:?}", puts[0]["headers"]);
    assert_eq!(azure::ipconfig_name(private), "egret-198-18-1-100");

    // Idempotent, and always a PUT (a Get may be stale): a second PUT.
    cloud.assign(&gw_a.nic_id, private, Some(public), &gateways).await.unwrap();
    assert_eq!(emu.calls("PUT", &format!("/networkInterfaces/{}", gw_a.nic_name)).unwrap().len(), 2);
    assert!(same(&emu.private_route(private).unwrap().unwrap().0, &gw_a.nic_id));

    // Failover: B takes it, with the stale discovery copy (which says "not
    // associated"): A's NIC is updated first, B's once that completed
    // (the emulator refuses B's otherwise, PublicIPAddressInUse).
    emu.clear_requests().unwrap();
    cloud.assign(&gw_b.nic_id, private, Some(public), &gateways).await.unwrap();
    let (nic, to) = emu.public_route(pip.ip).unwrap().expect("associated");
    assert!(same(&nic, &gw_b.nic_id) && to == "198.18.1.100", "{nic} {to}");
    assert!(same(&emu.private_route(private).unwrap().unwrap().0, &gw_b.nic_id));
    let log = emu.requests().unwrap();
    let puts: Vec<&Value> = log.iter().filter(|r| r["method"] == json!("PUT")).collect();
    assert_eq!(puts.len(), 2, "two NIC updates: {puts:?}");
    assert!(
        puts[0]["path"].as_str().unwrap().ends_with(&gw_a.nic_name)
            && puts[1]["path"].as_str().unwrap().ends_with(&gw_b.nic_name)
    );
    assert!(!put_ipconfigs(puts[0]).contains_key("egret-198-18-1-100"), "A's update removes it");
    assert!(put_ipconfigs(puts[1]).contains_key("egret-198-18-1-100"), "B's adds it");
    assert!(puts.iter().all(|r| r["status"] == json!(200)), "neither refused: {puts:?}");
    let (first, second) = (puts[0]["seq"].as_u64().unwrap(), puts[1]["seq"].as_u64().unwrap());
    assert!(
        log.iter().any(|r| r["path"].as_str().unwrap().contains("/operations/")
            && (first..second).contains(&r["seq"].as_u64().unwrap())),
        "A's operation polled before B's update: {log:?}"
    );

    // Release: A no longer holds it (nothing to do, no update); B gives it
    // up; again, and for an address never there, and for a NIC that does
    // not exist: success each time.
    emu.clear_requests().unwrap();
    cloud.release(&gw_a.nic_id, private).await.unwrap();
    assert!(emu.calls("PUT", "").unwrap().is_empty(), "nothing to release on A");
    cloud.release(&gw_b.nic_id, private).await.unwrap();
    assert_eq!(emu.private_route(private).unwrap(), None);
    assert_eq!(emu.public_route(pip.ip).unwrap(), None, "the public IP is free with it");
    cloud.release(&gw_b.nic_id, private).await.unwrap();
    cloud.release(&gw_b.nic_id, ip("198.18.1.99")).await.unwrap();
    let missing = gw_b.nic_id.replace("gw-b-nic", "no-such-nic");
    cloud.release(&missing, private).await.unwrap();
    assert_eq!(emu.calls("PUT", "").unwrap().len(), 1, "one update: B's release");

    // Without a public address only the private address moves.
    cloud.assign(&gw_a.nic_id, ip("198.18.1.101"), None, &gateways).await.unwrap();
    assert_eq!(emu.private_route(ip("198.18.1.101")).unwrap().map(|r| r.1), Some(None));
    emu.stop().unwrap();
}

/// ARM reads may lag (the emulator's `staleness`): a Get that still shows
/// the address on A's NIC must not make A's take-over skip its update. The
/// update is made with the etag the read gave, so ARM refuses it (412,
/// retryable) instead of applying it over a NIC it no longer matches; once
/// reads catch up the retry moves the address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_overs_update_whatever_a_stale_read_says() {
    let Some(emu) = emulator_or_skip("take_overs_update_whatever_a_stale_read_says") else { return };
    let net = emu.network().unwrap();
    let gw_a = emu.vm("gw-a", "gateways", None, true, &[]).unwrap();
    let gw_b = emu.vm("gw-b", "gateways", None, true, &[]).unwrap();
    emu.public_ip("egress-1", "203.0.113.10", &[(POOL_TAG, "prod")]).unwrap();
    let cloud = cloud(&emu);
    let gateways = BTreeSet::from([gw_a.provider_id.clone(), gw_b.provider_id.clone()]);
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    let public = &public[0];
    let private = ip("198.18.1.100");
    let lag = 4.0;
    emu.configure(&json!({"staleness": lag})).unwrap();

    cloud.assign(&gw_a.nic_id, private, Some(public), &gateways).await.unwrap();
    // Reads catch up with A's take-over, then B takes it.
    tokio::time::sleep(Duration::from_secs_f64(lag + 0.5)).await;
    cloud.assign(&gw_b.nic_id, private, Some(public), &gateways).await.unwrap();
    assert!(same(&emu.private_route(private).unwrap().unwrap().0, &gw_b.nic_id));

    // A takes it back while reads still show it on A, as before B's move.
    emu.clear_requests().unwrap();
    let e = cloud.assign(&gw_a.nic_id, private, Some(public), &gateways).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("PreconditionFailed", true), "{e}");
    let puts = emu.calls("PUT", "").unwrap();
    assert_eq!(puts.len(), 1, "the update is made, not skipped: {puts:?}");
    assert!(puts[0]["path"].as_str().unwrap().ends_with(&gw_a.nic_name) && puts[0]["status"] == json!(412));
    assert!(same(&emu.private_route(private).unwrap().unwrap().0, &gw_b.nic_id), "refused: still B's");

    // The caller's retry, once reads caught up: B's NIC, then A's.
    tokio::time::sleep(Duration::from_secs_f64(lag + 0.5)).await;
    emu.clear_requests().unwrap();
    cloud.assign(&gw_a.nic_id, private, Some(public), &gateways).await.unwrap();
    let order = put_nic_names(&emu);
    assert_eq!(order, [gw_b.nic_name.clone(), gw_a.nic_name.clone()]);
    assert!(same(&emu.private_route(private).unwrap().unwrap().0, &gw_a.nic_id));
    emu.stop().unwrap();
}

/// An address on a NIC of a VM that is not a gateway Node, on a NIC of no
/// VM, or a NIC's primary address is someone else's: refused for good,
/// before any update, naming the holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_held_by_a_nic_that_is_not_a_gateways_is_refused() {
    let Some(emu) = emulator_or_skip("an_address_held_by_a_nic_that_is_not_a_gateways_is_refused") else { return };
    let net = emu.network().unwrap();
    let gw = emu.vm("gw", "gateways", None, true, &[]).unwrap();
    let other = emu.vm("other", "gateways", None, false, &[("theirs", "198.18.1.100")]).unwrap();
    emu.seed(&json!({"networkInterfaces": [{"resourceGroup": RESOURCE_GROUP, "name": "loose",
        "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/gateways", "privateIPAddress": "198.18.1.101", "primary": true},
                             {"name": "theirs", "privateIPAddress": "198.18.1.102"}]}]}))
    .unwrap();
    emu.public_ip("egress-1", "203.0.113.10", &[(POOL_TAG, "prod")]).unwrap();
    let cloud = cloud(&emu);
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    let mut gateways = BTreeSet::from([gw.provider_id.clone()]);

    emu.clear_requests().unwrap();
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.100"), Some(&public[0]), &gateways).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), (HELD_ELSEWHERE, false), "{e}");
    assert!(e.message.contains(&other.nic_id) && e.message.contains(&other.vm_id), "{e}");
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.102"), Some(&public[0]), &gateways).await.unwrap_err();
    assert!(e.code == HELD_ELSEWHERE && e.message.contains("/loose") && e.message.contains("no VM"), "{e}");
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.101"), None, &gateways).await.unwrap_err();
    assert_eq!(e.code, HELD_ELSEWHERE, "a primary address: {e}");
    assert!(emu.calls("PUT", "").unwrap().is_empty(), "no update was made");
    assert!(same(&emu.private_route(ip("198.18.1.100")).unwrap().unwrap().0, &other.nic_id));

    // A gateway's own primary address is not an egress address either.
    let e = cloud.assign(&gw.nic_id, gw.primary_ip, None, &gateways).await.unwrap_err();
    assert_eq!(e.code, HELD_ELSEWHERE, "{e}");

    // Once that VM is a gateway Node, the address is taken from it.
    gateways.insert(other.provider_id.clone());
    cloud.assign(&gw.nic_id, ip("198.18.1.100"), Some(&public[0]), &gateways).await.unwrap();
    assert!(same(&emu.private_route(ip("198.18.1.100")).unwrap().unwrap().0, &gw.nic_id));
    emu.stop().unwrap();
}

/// A `PerNode` cloud pool's worker Nodes (ADR 0033), in another subnet than
/// the gateways: each Node's primary NIC gets a Dynamic IP configuration
/// whose address Azure chooses in that subnet, the pool's public IP is
/// associated with it, moves to another Node's, and is released with it. A
/// private address another VM holds (another Node's included) is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_nodes_address_is_a_dynamic_ip_configuration_of_its_own_subnet() {
    let Some(emu) = emulator_or_skip("a_worker_nodes_address_is_a_dynamic_ip_configuration_of_its_own_subnet") else {
        return;
    };
    let net = emu.network().unwrap();
    emu.vm("gw", "gateways", None, true, &[]).unwrap();
    let worker_a = emu.vm("worker-a", "other", None, false, &[]).unwrap();
    let worker_b = emu.vm("worker-b", "other", None, false, &[]).unwrap();
    let outsider = emu.vm("outsider", "other", None, false, &[("theirs", "198.18.2.50")]).unwrap();
    // A worker whose primary NIC is in the workers' subnet and whose second
    // is in the gateways': the primary is the Node's, whatever the subnets.
    emu.seed(&json!({
        "networkInterfaces": [
            {"resourceGroup": RESOURCE_GROUP, "name": "two-0", "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/other", "primary": true}]},
            {"resourceGroup": RESOURCE_GROUP, "name": "two-1", "ipConfigurations": [{"name": "ipconfig1", "subnet": "vnet/gateways", "primary": true}]}],
        "virtualMachines": [{"resourceGroup": RESOURCE_GROUP, "name": "two", "networkInterfaces": ["two-0", "two-1"]}],
    }))
    .unwrap();
    let pip = emu.public_ip("node-egress", "203.0.113.30", &[(POOL_TAG, "nodes")]).unwrap();
    let cloud = cloud(&emu);
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "nodes")])).await.unwrap().public;
    let public = &public[0];
    let workers: ipnet::IpNet = egret_tests::azure_emulator::OTHER_SUBNET_CIDR.parse().unwrap();
    let only = |vm: &egret_tests::azure_emulator::Vm| BTreeSet::from([vm.provider_id.clone()]);

    // The Node's primary NIC, in the workers' subnet.
    let a = cloud.primary_interface(&worker_a.provider_id).await.unwrap();
    assert!(same(&a.interface_id, &worker_a.nic_id) && same(&a.instance_id, &worker_a.vm_id), "{a:?}");
    assert_eq!((a.primary_ip, a.secondary_ips.len()), (worker_a.primary_ip, 0));
    assert!(workers.contains(&a.primary_ip));
    let two = format!("azure:///subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/Microsoft.Compute/virtualMachines/two");
    let i = cloud.primary_interface(&two).await.unwrap();
    assert!(i.interface_id.ends_with("/networkInterfaces/two-0") && workers.contains(&i.primary_ip), "{i:?}");
    let e = cloud.primary_interface(&two.replace("/two", "/gone")).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("virtualMachines/gone"), "{e}");

    // A new address, chosen by Azure in the Node's subnet, none in use before.
    let used_before: BTreeSet<String> =
        emu.routing().unwrap()["privateIPAddresses"].as_object().unwrap().keys().cloned().collect();
    emu.clear_requests().unwrap();
    let a_ip = cloud.add_address(&a.interface_id).await.unwrap();
    assert!(workers.contains(&a_ip) && !used_before.contains(&a_ip.to_string()), "{a_ip} in {used_before:?}");
    assert_eq!(
        emu.private_route(a_ip).unwrap().map(|(nic, _)| nic.to_ascii_lowercase()),
        Some(worker_a.nic_id.to_ascii_lowercase())
    );
    let puts = emu.calls("PUT", "").unwrap();
    assert_eq!(puts.len(), 1, "{puts:?}");
    let added = &put_ipconfigs(&puts[0])["egret-node-1"];
    assert_eq!(added["privateIPAllocationMethod"], json!("Dynamic"));
    assert!(added.get("privateIPAddress").is_none(), "Azure chooses: {added}");
    assert!(same(added["subnet"]["id"].as_str().unwrap(), &net.other_subnet_id), "the primary's subnet: {added}");
    assert!(header(&puts[0], "If-Match").is_some(), "{:?}", puts[0]["headers"]);
    assert_eq!(cloud.primary_interface(&worker_a.provider_id).await.unwrap().secondary_ips, BTreeSet::from([a_ip]));

    // The pool's public IP on it, with only the Node itself to take from.
    cloud.assign(&a.interface_id, a_ip, Some(public), &only(&worker_a)).await.unwrap();
    let (nic, to) = emu.public_route(pip.ip).unwrap().expect("associated");
    assert!(same(&nic, &worker_a.nic_id) && to == a_ip.to_string(), "{nic} {to}");
    let put = emu.calls("PUT", &format!("/networkInterfaces/{}", worker_a.nic_name)).unwrap().pop().unwrap();
    let kept = &put_ipconfigs(&put)["egret-node-1"];
    assert_eq!(
        (kept["privateIPAddress"].as_str(), kept["privateIPAllocationMethod"].as_str()),
        (Some(a_ip.to_string().as_str()), Some("Static"))
    );
    assert!(same(kept["publicIPAddress"]["id"].as_str().unwrap(), &pip.id));
    assert!(cloud.verify(&a.interface_id, a_ip, Some(public)).await.unwrap());

    // Another Node: its own address, then the public IP moves to it (A's NIC
    // cleared first, waited for; A keeps its IP configuration).
    let b = cloud.primary_interface(&worker_b.provider_id).await.unwrap();
    let b_ip = cloud.add_address(&b.interface_id).await.unwrap();
    assert!(workers.contains(&b_ip) && b_ip != a_ip, "{b_ip}");
    emu.clear_requests().unwrap();
    cloud.assign(&b.interface_id, b_ip, Some(public), &only(&worker_b)).await.unwrap();
    let (nic, to) = emu.public_route(pip.ip).unwrap().expect("associated");
    assert!(same(&nic, &worker_b.nic_id) && to == b_ip.to_string(), "{nic} {to}");
    let order = put_nic_names(&emu);
    assert_eq!(order, [worker_a.nic_name.clone(), worker_b.nic_name.clone()]);
    assert_eq!(
        emu.private_route(a_ip).unwrap().map(|(_, public)| public),
        Some(None),
        "A keeps its address, not the IP"
    );
    assert!(!cloud.verify(&a.interface_id, a_ip, Some(public)).await.unwrap());
    assert!(cloud.verify(&b.interface_id, b_ip, Some(public)).await.unwrap());

    // A private address another VM holds is not a Node's to take: another
    // Node's, or any other VM's. Refused before any update.
    emu.clear_requests().unwrap();
    for (held, by) in [(b_ip, &worker_b), (ip("198.18.2.50"), &outsider)] {
        let e = cloud.assign(&a.interface_id, held, Some(public), &only(&worker_a)).await.unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), (HELD_ELSEWHERE, false), "{e}");
        assert!(e.message.contains(&by.nic_id) && e.message.contains(&by.vm_id), "{e}");
    }
    assert!(emu.calls("PUT", "").unwrap().is_empty(), "no update was made");
    assert!(same(&emu.public_route(pip.ip).unwrap().unwrap().0, &worker_b.nic_id));

    // A second address on the same NIC (the Node in a second pool): its own
    // IP configuration and address.
    let second = cloud.add_address(&a.interface_id).await.unwrap();
    assert!(workers.contains(&second) && ![a_ip, b_ip].contains(&second), "{second}");
    let put = emu.calls("PUT", &format!("/networkInterfaces/{}", worker_a.nic_name)).unwrap().pop().unwrap();
    assert!(put_ipconfigs(&put).contains_key("egret-node-2"), "{put}");
    cloud.release(&a.interface_id, second).await.unwrap();
    assert_eq!(emu.private_route(second).unwrap(), None);
    assert!(emu.private_route(a_ip).unwrap().is_some(), "the first stays");

    // Release removes the IP configuration: the address and the association
    // end with it.
    cloud.release(&b.interface_id, b_ip).await.unwrap();
    assert_eq!(emu.private_route(b_ip).unwrap(), None);
    assert_eq!(emu.public_route(pip.ip).unwrap(), None);
    assert!(!cloud.verify(&b.interface_id, b_ip, Some(public)).await.unwrap());
    cloud.release(&a.interface_id, a_ip).await.unwrap();
    assert_eq!(emu.private_route(a_ip).unwrap(), None);
    let left = cloud.primary_interface(&worker_a.provider_id).await.unwrap();
    assert!(left.secondary_ips.is_empty() && left.primary_ip == worker_a.primary_ip, "{left:?}");

    // A NIC that does not exist gets no address; not worth retrying.
    let e = cloud.add_address(&worker_a.nic_id.replace("worker-a-nic", "gone")).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("/gone"), "{e}");
    emu.stop().unwrap();
}

/// A refresh's check: the NIC has the address with the public IP; drift
/// (removed, or the public IP moved, by someone else) reads as `false`, a
/// failed read as an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reads_drift_from_the_providers_view() {
    let Some(emu) = emulator_or_skip("verify_reads_drift_from_the_providers_view") else { return };
    let net = emu.network().unwrap();
    let gw_a = emu.vm("gw-a", "gateways", None, true, &[]).unwrap();
    let gw_b = emu.vm("gw-b", "gateways", None, true, &[]).unwrap();
    emu.public_ip("egress-1", "203.0.113.10", &[(POOL_TAG, "prod")]).unwrap();
    let cloud = cloud(&emu);
    let gateways = BTreeSet::from([gw_a.provider_id.clone(), gw_b.provider_id.clone()]);
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    let public = &public[0];
    let private = ip("198.18.1.100");

    cloud.assign(&gw_a.nic_id, private, Some(public), &gateways).await.unwrap();
    assert!(cloud.verify(&gw_a.nic_id, private, Some(public)).await.unwrap());
    assert!(cloud.verify(&gw_a.nic_id, private, None).await.unwrap());
    assert!(!cloud.verify(&gw_b.nic_id, private, None).await.unwrap());

    // Someone else clears the association (a NIC update of their own).
    someone_else_updates(&emu, &gw_a.nic_name, |configs| {
        for c in configs.iter_mut() {
            c["properties"].as_object_mut().unwrap().remove("publicIPAddress");
        }
    })
    .await;
    assert!(!cloud.verify(&gw_a.nic_id, private, Some(public)).await.unwrap(), "the public IP drifted");
    assert!(cloud.verify(&gw_a.nic_id, private, None).await.unwrap(), "the private address did not");
    // ... and removes the IP configuration.
    someone_else_updates(&emu, &gw_a.nic_name, |configs| configs.retain(|c| c["properties"]["primary"] == json!(true)))
        .await;
    assert!(!cloud.verify(&gw_a.nic_id, private, None).await.unwrap());
    // A NIC that does not exist holds nothing.
    assert!(!cloud.verify(&gw_a.nic_id.replace("gw-a-nic", "gone"), private, None).await.unwrap());

    // A failed read is an error, not a verdict.
    emu.fault(
        &json!({"method": "GET", "path": "*/networkInterfaces/gw-a-nic", "status": 503, "code": "ServiceUnavailable"}),
    )
    .unwrap();
    let e = cloud.verify(&gw_a.nic_id, private, None).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("ServiceUnavailable", true), "{e}");
    emu.stop().unwrap();
}

/// A NIC update made around Egret (as another tool would): Get, edit the IP
/// configurations, PUT, wait for the routing truth to change.
async fn someone_else_updates(emu: &AzureEmulator, nic: &str, edit: impl FnOnce(&mut Vec<Value>)) {
    let path = AzureEmulator::arm_path("Microsoft.Network/networkInterfaces", nic, "2024-05-01");
    let (status, mut body) = emu.call("GET", &path, None, Some("someone-else")).unwrap();
    assert_eq!(status, 200, "{body}");
    edit(body["properties"]["ipConfigurations"].as_array_mut().unwrap());
    let before = emu.routing().unwrap();
    let (status, reply) = emu.call("PUT", &path, Some(&body), Some("someone-else")).unwrap();
    assert_eq!(status, 200, "{reply}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while emu.routing().unwrap() == before {
        assert!(Instant::now() < deadline, "the update never completed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_classified() {
    let Some(emu) = emulator_or_skip("api_errors_are_classified") else { return };
    let net = emu.network().unwrap();
    let gw = emu.vm("gw", "gateways", None, true, &[]).unwrap();
    emu.public_ip("egress-1", "203.0.113.10", &[(POOL_TAG, "prod")]).unwrap();
    let pool = selector(&net.subnet_id, &[(POOL_TAG, "prod")]);
    let gateways = BTreeSet::from([gw.provider_id.clone()]);
    let fast = Bounds { request: Duration::from_secs(2), update: Duration::from_secs(4), ..Bounds::default() };
    let cloud = cloud_with(&emu, TOKEN, fast);
    let found = cloud.discover(&pool).await.unwrap();
    let public = &found.public[0];
    let list_all = format!("/subscriptions/{SUBSCRIPTION}/providers/Microsoft.Network/publicIPAddresses");

    // ARM's throttling: retryable, Retry-After reported, one attempt only
    // (no retry inside the call: the next call gets the real answer).
    emu.configure(&json!({"readBucket": 1, "readRefill": 0.2})).unwrap();
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("SubscriptionRequestsThrottled", true), "{e}");
    assert!(e.message.contains("Retry-After: "), "{e}");
    assert_eq!(emu.calls("GET", "").unwrap().iter().filter(|r| r["status"] == json!(429)).count(), 1, "one attempt");
    emu.configure(&json!({"readBucket": 250, "readRefill": 25})).unwrap();
    assert_eq!(cloud.discover(&pool).await.unwrap().public.len(), 1);

    // A 429 armed on one call, with its Retry-After.
    emu.fault(&json!({"method": "GET", "path": list_all, "status": 429, "code": "SubscriptionRequestsThrottled", "retryAfter": 7})).unwrap();
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.operation, e.retryable), ("PublicIPAddresses_ListAll", true), "{e}");
    assert!(e.message.contains("Retry-After: 7"), "{e}");

    // A resource provider's 5xx: retryable, named.
    emu.fault(&json!({"method": "GET", "path": "*/subnets/gateways", "status": 500, "code": "InternalServerError", "message": "boom"})).unwrap();
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("Subnets_Get", "InternalServerError", true), "{e}");

    // A NIC locked by another update, and a 409 conflict: retryable.
    for (status, code) in [(429, "RetryableErrorDueToAnotherOperation"), (409, "AnotherOperationInProgress")] {
        emu.fault(&json!({"method": "PUT", "path": "*/networkInterfaces/gw-nic", "status": status, "code": code}))
            .unwrap();
        let e = cloud.assign(&gw.nic_id, ip("198.18.1.100"), Some(public), &gateways).await.unwrap_err();
        assert_eq!(
            (e.operation, e.code.as_str(), e.retryable),
            ("NetworkInterfaces_CreateOrUpdate", code, true),
            "{e}"
        );
    }
    // An update accepted and then failed: its operation's code.
    emu.fault(&json!({"method": "PUT", "path": "*/networkInterfaces/gw-nic", "asyncError": {"code": "InvalidResourceReference", "message": "no"}})).unwrap();
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.100"), Some(public), &gateways).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("InvalidResourceReference", false), "{e}");
    emu.fault(&json!({"method": "PUT", "path": "*/networkInterfaces/gw-nic", "asyncError": {"code": "InternalServerError", "message": "later"}})).unwrap();
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.100"), Some(public), &gateways).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("InternalServerError", true), "{e}");
    // The caller's retry completes it.
    cloud.assign(&gw.nic_id, ip("198.18.1.100"), Some(public), &gateways).await.unwrap();
    // A release refused while the NIC still holds the address is an error,
    // retryable for a 412 (the NIC changed since it was read).
    emu.fault(
        &json!({"method": "PUT", "path": "*/networkInterfaces/gw-nic", "status": 412, "code": "PreconditionFailed"}),
    )
    .unwrap();
    let e = cloud.release(&gw.nic_id, ip("198.18.1.100")).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("PreconditionFailed", true), "{e}");
    assert!(same(&emu.private_route(ip("198.18.1.100")).unwrap().unwrap().0, &gw.nic_id));

    // An update whose operation outlasts the bound: a retryable timeout
    // within it, not a hang.
    emu.configure(&json!({"asyncDelay": 60})).unwrap();
    let t0 = Instant::now();
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.101"), None, &gateways).await.unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("assign", "timeout", true), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    // Meanwhile the NIC is locked: the next attempt is told so, retryably.
    let e = cloud.assign(&gw.nic_id, ip("198.18.1.101"), None, &gateways).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("RetryableErrorDueToAnotherOperation", true), "{e}");

    // A stalled request ends in a retryable timeout within the request bound.
    emu.fault(&json!({"method": "GET", "path": "*/virtualMachines/gw", "stall": 30})).unwrap();
    let t0 = Instant::now();
    let e = cloud.interface(&gw.provider_id, &net.subnet_id).await.unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("VirtualMachines_Get", "timeout", true), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(6), "{:?}", t0.elapsed());

    // Not allowed: a token ARM refuses. Not retryable.
    emu.configure(&json!({"tokens": ["only-this-one"]})).unwrap();
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("InvalidAuthenticationToken", false), "{e}");
    assert_eq!(cloud_with(&emu, "only-this-one", fast).discover(&pool).await.unwrap().public.len(), 1);

    // Nothing listening: a retryable connection error.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("https://{}", dead.local_addr().unwrap());
    drop(dead);
    let cloud = AzureCloud::new(Arc::new(StaticToken(TOKEN)), &dead_url, Some(&emu.ca_pem().unwrap()), fast).unwrap();
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), ("connect", true), "{e:?}");
    emu.stop().unwrap();
}

/// Set in the child process of [`load_reads_the_environment`].
const CHILD_ENV: &str = "EGRET_CLOUD_AZURE_CHILD";

/// `AzureCloud::load` takes the endpoint and CA from Egret's variables and
/// the credential from azure_identity's managed-identity chain (here its
/// App Service form, `IDENTITY_ENDPOINT` and `IDENTITY_HEADER`, pointed at
/// a token endpoint this test serves on loopback: IMDS itself is not
/// reachable from a test). The child process (this binary again) gets the
/// environment, so no test changes its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reads_the_environment() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(emu) = emulator_or_skip("load_reads_the_environment") else { return };
    let net = emu.network().unwrap();
    let pip = emu.public_ip("from-env", "203.0.113.20", &[(POOL_TAG, "from-env")]).unwrap();
    let token = "token-from-managed-identity";
    emu.configure(&json!({"tokens": [token]})).unwrap();
    let identity = token_endpoint(token).await;
    let exe = std::env::current_exe().unwrap();
    let out = tokio::process::Command::new(exe)
        .args(["--exact", "load_from_environment_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("EGRET_CHILD_SUBNET", &net.subnet_id)
        .env("EGRET_CHILD_PUBLIC_IP", pip.ip.to_string())
        .env(azure::ENDPOINT_ENV, emu.endpoint())
        .env(azure::CA_FILE_ENV, emu.ca_path())
        .env("IDENTITY_ENDPOINT", format!("http://{identity}/token"))
        .env("IDENTITY_HEADER", "egret-test-secret")
        .env_remove("AZURE_FEDERATED_TOKEN_FILE")
        .env_remove("AZURE_CLIENT_ID")
        .env_remove("IDENTITY_SERVER_THUMBPRINT")
        .env_remove("IMDS_ENDPOINT")
        .env_remove("MSI_ENDPOINT")
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
    emu.stop().unwrap();
}

/// The child half of [`load_reads_the_environment`]; passes trivially when
/// run on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_from_environment_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let cloud = AzureCloud::load();
    let subnet = std::env::var("EGRET_CHILD_SUBNET").unwrap();
    let want: IpAddr = std::env::var("EGRET_CHILD_PUBLIC_IP").unwrap().parse().unwrap();
    let found = cloud.discover(&selector(&subnet, &[(POOL_TAG, "from-env")])).await.unwrap();
    assert_eq!(public_ips(&found), BTreeSet::from([want]));
}

/// An App Service-style managed-identity token endpoint on loopback that
/// hands out `token` to a request carrying the secret header.
async fn token_endpoint(token: &'static str) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let request = String::from_utf8_lossy(&got).to_ascii_lowercase();
                let body = if request.contains("x-identity-header: egret-test-secret") {
                    let expires =
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() + 3600;
                    json!({"access_token": token, "expires_on": expires.to_string(), "token_type": "Bearer",
                           "resource": "https://management.azure.com"})
                    .to_string()
                } else {
                    String::new()
                };
                let status = if body.is_empty() { "400 Bad Request" } else { "200 OK" };
                let reply = format!(
                    "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    addr
}
