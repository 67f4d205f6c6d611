//! The AWS provider (`egret_controlplane::cloud::aws::AwsCloud`, the real
//! SDK) against a real EC2 API emulator: moto's server on loopback, one per
//! test, with a fault proxy in front of it where errors are injected.
//!
//! Where moto differs from AWS's documented behaviour the test says so and
//! asserts only what moto implements; docs/kubernetes.md ("Running on AWS")
//! has the table.
//!
//! Needs moto (`tests/moto/install.sh`); skipped with a message when it is
//! missing, unless `EGRET_REQUIRE_MOTO=1` (CI).

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use egret_controlplane::cloud::aws::AwsCloud;
use egret_controlplane::cloud::{Cloud, PoolSelector, Provider, PublicAddress, HELD_ELSEWHERE};
use egret_tests::faultproxy::{param, Fault, FaultProxy};
use egret_tests::moto::{self, Moto};

const POOL_TAG: &str = "egret.dev/pool";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// moto started for `test`, or `None` when the test is skipped.
fn moto_or_skip(test: &str) -> Option<Moto> {
    match Moto::available_or_skip(test) {
        Ok(true) => Some(Moto::start().expect("start moto")),
        Ok(false) => None,
        Err(e) => panic!("{e}"),
    }
}

fn selector(subnet_id: &str, tags: &[(&str, &str)]) -> PoolSelector {
    PoolSelector {
        provider: Provider::Aws,
        tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>(),
        subnet_id: subnet_id.to_owned(),
        ipv6: false,
    }
}

/// Two gateway instances in the seeded subnet, and the provider talking to
/// moto through a fault proxy.
struct Pair {
    gw_a: moto::Instance,
    gw_b: moto::Instance,
    proxy: FaultProxy,
    cloud: AwsCloud,
    gateways: BTreeSet<String>,
}

async fn pair(moto: &Moto, ec2: &aws_sdk_ec2::Client, net: &moto::Network) -> Pair {
    let gw_a = moto::run_instance(ec2, net, &net.subnet_id, false).await.unwrap();
    let gw_b = moto::run_instance(ec2, net, &net.subnet_id, false).await.unwrap();
    let proxy = FaultProxy::start(moto.addr()).await.unwrap();
    let cloud = AwsCloud::from_conf(Moto::sdk_config(&proxy.url()));
    let gateways = BTreeSet::from([gw_a.provider_id.clone(), gw_b.provider_id.clone()]);
    Pair { gw_a, gw_b, proxy, cloud, gateways }
}

fn public_ips(d: &egret_controlplane::cloud::Discovered) -> BTreeSet<IpAddr> {
    d.public.iter().map(|p| p.public_ip).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_by_tags_and_used_addresses() {
    let Some(moto) = moto_or_skip("discovery_by_tags_and_used_addresses") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let gw_a = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    let gw_b = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    moto::add_secondary(&ec2, &gw_b.eni_id, ip("198.18.1.200")).await.unwrap();
    // An instance in the other subnet: its addresses are not this subnet's.
    let elsewhere = moto::run_instance(&ec2, &net, &net.other_subnet_id, true).await.unwrap();

    let prod = [(POOL_TAG, "prod"), ("team", "payments")];
    let in_pool_1 = moto::allocate_eip(&ec2, &prod).await.unwrap();
    let in_pool_2 = moto::allocate_eip(&ec2, &prod).await.unwrap();
    // One of the two tags only: the pool's tags are ANDed.
    let half_tagged = moto::allocate_eip(&ec2, &[(POOL_TAG, "prod")]).await.unwrap();
    let other_pool = moto::allocate_eip(&ec2, &[(POOL_TAG, "staging"), ("team", "payments")]).await.unwrap();
    let untagged = moto::allocate_eip(&ec2, &[]).await.unwrap();

    let cloud = AwsCloud::from_conf(Moto::sdk_config(moto.endpoint()));
    let pool = selector(&net.subnet_id, &prod);
    let found = cloud.discover(&pool).await.unwrap();

    assert_eq!(public_ips(&found), BTreeSet::from([in_pool_1.public_ip, in_pool_2.public_ip]));
    for excluded in [&half_tagged, &other_pool, &untagged] {
        assert!(!public_ips(&found).contains(&excluded.public_ip), "{excluded:?} is not in the pool");
    }
    let by_alloc: BTreeMap<_, _> = found.public.iter().map(|p| (p.allocation_id.clone(), p)).collect();
    assert_eq!(by_alloc[&in_pool_1.allocation_id].public_ip, in_pool_1.public_ip);
    assert_eq!(by_alloc[&in_pool_1.allocation_id].interface_id, None, "not associated yet");
    assert_eq!(found.subnet_cidr, "198.18.1.0/24".parse().unwrap());
    for used in [gw_a.primary_ip, gw_b.primary_ip, ip("198.18.1.200")] {
        assert!(found.used.contains(&used), "{used} is in use: {:?}", found.used);
    }
    assert!(!found.used.contains(&elsewhere.primary_ip), "another subnet's address");
    // AWS's reserved addresses of the subnet.
    for reserved in ["198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3", "198.18.1.255"] {
        assert!(found.used.contains(&ip(reserved)), "{reserved} is reserved by AWS");
    }

    // A retagged address leaves the pool on the next discovery.
    moto::set_tags(&ec2, &in_pool_2.allocation_id, &[(POOL_TAG, "retired")]).await.unwrap();
    let again = cloud.discover(&pool).await.unwrap();
    assert_eq!(public_ips(&again), BTreeSet::from([in_pool_1.public_ip]));

    // An association shows in the next discovery.
    let public = by_alloc[&in_pool_1.allocation_id].clone();
    cloud
        .assign(&gw_a.eni_id, ip("198.18.1.100"), Some(&public), &BTreeSet::from([gw_a.provider_id.clone()]))
        .await
        .unwrap();
    let after = cloud.discover(&pool).await.unwrap();
    assert_eq!(after.public[0].interface_id.as_deref(), Some(gw_a.eni_id.as_str()));
    assert!(after.used.contains(&ip("198.18.1.100")), "the assigned address is in use");
    // A pool with no tags would select every address of the account.
    let e = cloud.discover(&selector(&net.subnet_id, &[])).await.unwrap_err();
    assert!(!e.retryable, "{e}");
    moto.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interface_from_provider_id() {
    let Some(moto) = moto_or_skip("interface_from_provider_id") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let checked = moto::run_instance(&ec2, &net, &net.subnet_id, true).await.unwrap();
    let unchecked = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    moto::add_secondary(&ec2, &unchecked.eni_id, ip("198.18.1.150")).await.unwrap();
    let elsewhere = moto::run_instance(&ec2, &net, &net.other_subnet_id, false).await.unwrap();
    let cloud = AwsCloud::from_conf(Moto::sdk_config(moto.endpoint()));

    let i = cloud.interface(&checked.provider_id, &net.subnet_id).await.unwrap();
    assert_eq!(i.instance_id, checked.instance_id);
    assert_eq!(i.interface_id, checked.eni_id);
    assert_eq!(i.primary_ip, checked.primary_ip);
    assert!(i.secondary_ips.is_empty());
    assert!(i.source_dest_check, "left on: a gateway there would drop forwarded traffic");

    // The form without the empty third slash is accepted too.
    let short = unchecked.provider_id.replacen("aws:///", "aws://", 1);
    let i = cloud.interface(&short, &net.subnet_id).await.unwrap();
    assert_eq!(i.interface_id, unchecked.eni_id);
    assert_eq!(i.secondary_ips, BTreeSet::from([ip("198.18.1.150")]));
    assert!(!i.source_dest_check);

    // No interface in the subnet: named, and not worth retrying.
    let e = cloud.interface(&elsewhere.provider_id, &net.subnet_id).await.unwrap_err();
    assert!(!e.retryable, "{e}");
    assert!(e.message.contains(&elsewhere.instance_id) && e.message.contains(&net.subnet_id), "{e}");
    // Not an AWS provider ID.
    let e = cloud.interface("gce://project/zone/name", &net.subnet_id).await.unwrap_err();
    assert!(!e.retryable && e.message.contains("gce://project/zone/name"), "{e}");
    moto.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn assign_moves_the_address_between_gateways_and_release_gives_it_up() {
    let Some(moto) = moto_or_skip("assign_moves_the_address_between_gateways_and_release_gives_it_up") else {
        return;
    };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let gw_a = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    let gw_b = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    let eip = moto::allocate_eip(&ec2, &[(POOL_TAG, "prod")]).await.unwrap();
    let cloud = AwsCloud::from_conf(Moto::sdk_config(moto.endpoint()));
    let gateways = BTreeSet::from([gw_a.provider_id.clone(), gw_b.provider_id.clone()]);
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    assert_eq!(public.len(), 1);
    let public: &PublicAddress = &public[0];
    let private = ip("198.18.1.100");

    // Take-over by A.
    cloud.assign(&gw_a.eni_id, private, Some(public), &gateways).await.unwrap();
    assert!(moto::eni_addresses(&ec2, &gw_a.eni_id).await.unwrap().contains(&private));
    let (eni, _private_shown) = moto::association(&ec2, &eip.allocation_id).await.unwrap().expect("associated");
    assert_eq!(eni, gw_a.eni_id);
    // AWS associates the EIP with the PrivateIpAddress given (198.18.1.100);
    // moto ignores PrivateIpAddress and shows the ENI's primary address, so
    // the private address is not asserted here.

    // Idempotent: the same call again changes nothing and does not fail.
    cloud.assign(&gw_a.eni_id, private, Some(public), &gateways).await.unwrap();
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(gw_a.eni_id.clone()));
    assert_eq!(moto::eni_addresses(&ec2, &gw_a.eni_id).await.unwrap().iter().filter(|a| **a == private).count(), 1);

    // Failover: B takes the address (with the stale discovery copy, which
    // still says "not associated": assign makes its calls whatever the
    // state).
    cloud.assign(&gw_b.eni_id, private, Some(public), &gateways).await.unwrap();
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(gw_b.eni_id.clone()));
    assert!(moto::eni_addresses(&ec2, &gw_b.eni_id).await.unwrap().contains(&private));
    // AWS (AllowReassignment=true) moves the private address off A's ENI;
    // moto ignores AllowReassignment and leaves it on A too, so A's side is
    // not asserted here. A's own release below removes it either way.

    // Release: A gives up what it still holds; a second release, and a
    // release of an address that was never there, succeed (release looks
    // at the ENI first; moto would answer success anyway, AWS documents no
    // answer for it).
    cloud.release(&gw_a.eni_id, private).await.unwrap();
    assert!(!moto::eni_addresses(&ec2, &gw_a.eni_id).await.unwrap().contains(&private));
    cloud.release(&gw_a.eni_id, private).await.unwrap();
    cloud.release(&gw_a.eni_id, ip("198.18.1.99")).await.unwrap();
    // An interface that is gone holds nothing.
    cloud.release("eni-0123456789abcdef0", private).await.unwrap();
    // B still holds it and the address is still associated with B.
    assert!(moto::eni_addresses(&ec2, &gw_b.eni_id).await.unwrap().contains(&private));
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(gw_b.eni_id.clone()));

    // Without a public address (an IPv6 or private-only pool) only the
    // private address moves.
    cloud.assign(&gw_a.eni_id, ip("198.18.1.101"), None, &gateways).await.unwrap();
    assert!(moto::eni_addresses(&ec2, &gw_a.eni_id).await.unwrap().contains(&ip("198.18.1.101")));
    moto.stop().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_errors_are_classified() {
    let Some(moto) = moto_or_skip("api_errors_are_classified") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let gw = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    moto::allocate_eip(&ec2, &[(POOL_TAG, "prod")]).await.unwrap();
    let proxy = FaultProxy::start(moto.addr()).await.unwrap();
    let cloud = AwsCloud::from_conf(Moto::sdk_config(&proxy.url()));
    let pool = selector(&net.subnet_id, &[(POOL_TAG, "prod")]);
    let gateways = BTreeSet::from([gw.provider_id.clone()]);

    // Through the proxy, unarmed: the real answers.
    let found = cloud.discover(&pool).await.unwrap();
    assert_eq!(found.public.len(), 1);
    assert!(proxy.forwarded("DescribeAddresses") >= 1);

    // Throttling: retryable, and one attempt only (the SDK does not retry:
    // the next call gets the real answer).
    proxy.arm("DescribeAddresses", Fault::throttled(), 1);
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("DescribeAddresses", "RequestLimitExceeded", true), "{e}");
    assert_eq!(proxy.faults_served("DescribeAddresses"), 1);
    assert_eq!(cloud.discover(&pool).await.unwrap().public.len(), 1);

    // A 500 with EC2's server-error code: retryable.
    proxy.arm(
        "DescribeSubnets",
        Fault::Error { status: 500, code: "InternalError".into(), message: "An internal error has occurred".into() },
        1,
    );
    let e = cloud.discover(&pool).await.unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("DescribeSubnets", "InternalError", true), "{e}");

    // Not allowed: not retryable, and the call is named.
    proxy.arm("AssociateAddress", Fault::unauthorized(), 1);
    let e = cloud.assign(&gw.eni_id, ip("198.18.1.100"), Some(&found.public[0]), &gateways).await.unwrap_err();
    assert_eq!(
        (e.operation, e.code.as_str(), e.retryable),
        ("AssociateAddress", "UnauthorizedOperation", false),
        "{e}"
    );
    // A retry after the fault (as the caller's backoff would) completes it:
    // the private address assigned by the failed attempt is not assigned twice.
    cloud.assign(&gw.eni_id, ip("198.18.1.100"), Some(&found.public[0]), &gateways).await.unwrap();
    assert_eq!(moto::association(&ec2, &found.public[0].allocation_id).await.unwrap().map(|a| a.0), Some(gw.eni_id));

    // A stalled call ends in a retryable timeout within the bounded
    // operation timeout, not a hang (the stall is far longer).
    proxy.arm("DescribeInstances", Fault::Stall(Duration::from_secs(60)), 1);
    let e = tokio::time::timeout(Duration::from_secs(45), cloud.interface(&gw.provider_id, &net.subnet_id))
        .await
        .expect("the SDK's operation timeout ends the call")
        .unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("DescribeInstances", "timeout", true), "{e}");

    // Nothing listening: a retryable connection error.
    drop(proxy);
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let cloud = AwsCloud::from_conf(Moto::sdk_config(&dead_url));
    let e = cloud.discover(&pool).await.unwrap_err();
    assert!(e.retryable && (e.code == "connect" || e.code == "dispatch"), "{e:?}");
    moto.stop().unwrap();
}

/// EC2 is eventually consistent: a Describe may answer with the state from
/// before a change. A take-over must make both calls whatever a Describe
/// says (a gateway taking an address back that a stale read still shows on
/// its interface), and the calls carry what AWS needs and moto ignores
/// (`PrivateIpAddress`, `AllowReassignment`, `AllowReassociation`): the
/// fault proxy records them, and serves the stale answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn take_overs_make_both_calls_whatever_a_stale_describe_says() {
    let Some(moto) = moto_or_skip("take_overs_make_both_calls_whatever_a_stale_describe_says") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let eip = moto::allocate_eip(&ec2, &[(POOL_TAG, "prod")]).await.unwrap();
    let Pair { gw_a, gw_b, proxy, cloud, gateways } = pair(&moto, &ec2, &net).await;
    let through_proxy = moto::client_for(&proxy.url());
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    let public = &public[0];
    let private = ip("198.18.1.100");

    cloud.assign(&gw_a.eni_id, private, Some(public), &gateways).await.unwrap();
    // A read through the proxy, remembered: the association is A's.
    assert_eq!(
        moto::association(&through_proxy, &eip.allocation_id).await.unwrap().map(|a| a.0),
        Some(gw_a.eni_id.clone())
    );
    cloud.assign(&gw_b.eni_id, private, Some(public), &gateways).await.unwrap();

    // From now on every Describe answers as it did before B's take-over.
    proxy.arm("DescribeAddresses", Fault::Stale, usize::MAX);
    proxy.arm("DescribeNetworkInterfaces", Fault::Stale, usize::MAX);
    assert_eq!(
        moto::association(&through_proxy, &eip.allocation_id).await.unwrap().map(|a| a.0),
        Some(gw_a.eni_id.clone()),
        "the proxy serves the stale answer"
    );
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(gw_b.eni_id.clone()));

    // A takes the address back while the reads say it never left: both
    // calls are made all the same, and the association moves.
    let before = (proxy.requests("AssignPrivateIpAddresses").len(), proxy.requests("AssociateAddress").len());
    cloud.assign(&gw_a.eni_id, private, Some(public), &gateways).await.unwrap();
    let after = (proxy.requests("AssignPrivateIpAddresses").len(), proxy.requests("AssociateAddress").len());
    assert_eq!(after, (before.0 + 1, before.1 + 1));
    proxy.disarm_all();
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(gw_a.eni_id.clone()));

    // What every call asked for (moto ignores these; AWS needs them).
    let assigns = proxy.requests("AssignPrivateIpAddresses");
    assert_eq!(assigns.len(), 3);
    for r in &assigns {
        assert_eq!(param(r, "PrivateIpAddress.1"), Some("198.18.1.100"), "{r:?}");
        assert_eq!(param(r, "AllowReassignment"), Some("true"), "{r:?}");
    }
    let associations = proxy.requests("AssociateAddress");
    assert_eq!(associations.len(), 3);
    for r in &associations {
        assert_eq!(param(r, "PrivateIpAddress"), Some("198.18.1.100"), "{r:?}");
        assert_eq!(param(r, "AllowReassociation"), Some("true"), "{r:?}");
        assert_eq!(param(r, "AllocationId"), Some(eip.allocation_id.as_str()), "{r:?}");
    }
    let to: Vec<&str> = associations.iter().filter_map(|r| param(r, "NetworkInterfaceId")).collect();
    assert_eq!(to, [gw_a.eni_id.as_str(), gw_b.eni_id.as_str(), gw_a.eni_id.as_str()]);
    moto.stop().unwrap();
}

/// `AllowReassignment` takes a private address from whichever interface
/// holds it: an interface of an instance that is not a gateway Node (or of
/// none) is someone else's, and the assignment is refused for good, before
/// any mutating call, naming the interface.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_on_an_interface_that_is_not_a_gateways_is_refused() {
    let Some(moto) = moto_or_skip("an_address_on_an_interface_that_is_not_a_gateways_is_refused") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let gw = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    let other = moto::run_instance(&ec2, &net, &net.subnet_id, true).await.unwrap();
    moto::allocate_eip(&ec2, &[(POOL_TAG, "prod")]).await.unwrap();
    let private = ip("198.18.1.100");
    moto::add_secondary(&ec2, &other.eni_id, private).await.unwrap();
    let proxy = FaultProxy::start(moto.addr()).await.unwrap();
    let cloud = AwsCloud::from_conf(Moto::sdk_config(&proxy.url()));
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    let mut gateways = BTreeSet::from([gw.provider_id.clone()]);

    let e = cloud.assign(&gw.eni_id, private, Some(&public[0]), &gateways).await.unwrap_err();
    assert_eq!((e.code.as_str(), e.retryable), (HELD_ELSEWHERE, false), "{e}");
    assert!(e.message.contains(&other.eni_id) && e.message.contains(&other.instance_id), "{e}");
    assert!(proxy.requests("AssignPrivateIpAddresses").is_empty() && proxy.requests("AssociateAddress").is_empty());
    assert!(moto::eni_addresses(&ec2, &other.eni_id).await.unwrap().contains(&private));
    // The primary address of a gateway is refused too (EC2 cannot move it).
    let e = cloud.assign(&gw.eni_id, other.primary_ip, None, &gateways).await.unwrap_err();
    assert_eq!(e.code, HELD_ELSEWHERE, "{e}");

    // Once that instance is a gateway Node, the address is taken from it.
    gateways.insert(other.provider_id.clone());
    cloud.assign(&gw.eni_id, private, Some(&public[0]), &gateways).await.unwrap();
    assert!(moto::eni_addresses(&ec2, &gw.eni_id).await.unwrap().contains(&private));
    moto.stop().unwrap();
}

/// A refresh's check: the interface has the address, and the public
/// address is associated with it; drift (moved by someone else, or removed)
/// reads as `false`, a failed read as an error (no evidence either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_reads_drift_from_the_providers_view() {
    let Some(moto) = moto_or_skip("verify_reads_drift_from_the_providers_view") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let eip = moto::allocate_eip(&ec2, &[(POOL_TAG, "prod")]).await.unwrap();
    let Pair { gw_a, gw_b, proxy, cloud, gateways } = pair(&moto, &ec2, &net).await;
    let public = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "prod")])).await.unwrap().public;
    let public = &public[0];
    let private = ip("198.18.1.100");

    cloud.assign(&gw_a.eni_id, private, None, &gateways).await.unwrap();
    assert!(cloud.verify(&gw_a.eni_id, private, None).await.unwrap());
    assert!(!cloud.verify(&gw_b.eni_id, private, None).await.unwrap());
    // Removed by someone else: drift.
    ec2.unassign_private_ip_addresses()
        .network_interface_id(&gw_a.eni_id)
        .private_ip_addresses(private.to_string())
        .send()
        .await
        .unwrap();
    assert!(!cloud.verify(&gw_a.eni_id, private, None).await.unwrap());

    // The public address moved to another interface by someone else: drift.
    cloud.assign(&gw_a.eni_id, private, Some(public), &gateways).await.unwrap();
    ec2.associate_address()
        .allocation_id(&eip.allocation_id)
        .network_interface_id(&gw_b.eni_id)
        .allow_reassociation(true)
        .send()
        .await
        .unwrap();
    assert!(!cloud.verify(&gw_a.eni_id, private, Some(public)).await.unwrap());

    // A failed read is an error, not a verdict.
    proxy.arm("DescribeNetworkInterfaces", Fault::throttled(), 1);
    let e = cloud.verify(&gw_a.eni_id, private, None).await.unwrap_err();
    assert!(e.retryable, "{e}");
    moto.stop().unwrap();
}

/// An IPv6 pool has no Elastic IPs: its own addresses (of the subnet's IPv6
/// range) move with their Leases. IPv6 has no reassignment flag, so a move
/// unassigns the address from the other gateway's ENI first; an address on
/// an ENI that is not a gateway's is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_address_moves_between_gateways_without_an_elastic_ip() {
    let Some(moto) = moto_or_skip("an_ipv6_address_moves_between_gateways_without_an_elastic_ip") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    moto::add_subnet_ipv6(&ec2, &net.subnet_id, "2001:db8:1::/64").await.unwrap();
    let other = moto::run_instance(&ec2, &net, &net.subnet_id, true).await.unwrap();
    let Pair { gw_a, gw_b, proxy, cloud, gateways } = pair(&moto, &ec2, &net).await;
    let pool = PoolSelector { ipv6: true, tags: BTreeMap::new(), ..selector(&net.subnet_id, &[]) };
    let addr = ip("2001:db8:1::100");

    let found = cloud.discover(&pool).await.unwrap();
    assert_eq!(found.subnet_cidr, "2001:db8:1::/64".parse().unwrap());
    assert!(found.public.is_empty() && proxy.requests("DescribeAddresses").is_empty(), "no Elastic IPs are asked for");

    cloud.assign(&gw_a.eni_id, addr, None, &gateways).await.unwrap();
    assert!(cloud.verify(&gw_a.eni_id, addr, None).await.unwrap());
    assert!(cloud.discover(&pool).await.unwrap().used.contains(&addr), "an assigned address is in use");

    // The move: off A's ENI, onto B's.
    cloud.assign(&gw_b.eni_id, addr, None, &gateways).await.unwrap();
    let unassigned = proxy.requests("UnassignIpv6Addresses");
    assert_eq!(unassigned.len(), 1, "{unassigned:?}");
    assert_eq!(param(&unassigned[0], "NetworkInterfaceId"), Some(gw_a.eni_id.as_str()));
    assert_eq!(param(&unassigned[0], "Ipv6Addresses.1"), Some("2001:db8:1::100"));
    let assigned = proxy.requests("AssignIpv6Addresses");
    assert_eq!(param(&assigned[1], "NetworkInterfaceId"), Some(gw_b.eni_id.as_str()));
    assert!(!cloud.verify(&gw_a.eni_id, addr, None).await.unwrap());
    assert!(cloud.verify(&gw_b.eni_id, addr, None).await.unwrap());
    // Again (a take-over on a stale read): the call is made, nothing breaks.
    cloud.assign(&gw_b.eni_id, addr, None, &gateways).await.unwrap();
    assert_eq!(proxy.requests("AssignIpv6Addresses").len(), 3);
    assert!(cloud.verify(&gw_b.eni_id, addr, None).await.unwrap());

    // An address on an instance that is not a gateway: refused, nothing called.
    let foreign = ip("2001:db8:1::200");
    moto::add_ipv6(&ec2, &other.eni_id, foreign).await.unwrap();
    let e = cloud.assign(&gw_a.eni_id, foreign, None, &gateways).await.unwrap_err();
    assert_eq!((e.operation, e.code.as_str(), e.retryable), ("AssignIpv6Addresses", HELD_ELSEWHERE, false), "{e}");
    assert_eq!(proxy.requests("AssignIpv6Addresses").len(), 3);

    // Release, twice.
    cloud.release(&gw_b.eni_id, addr).await.unwrap();
    assert!(!cloud.verify(&gw_b.eni_id, addr, None).await.unwrap());
    cloud.release(&gw_b.eni_id, addr).await.unwrap();
    assert_eq!(proxy.requests("UnassignIpv6Addresses").len(), 2, "the second release looked and called nothing");
    moto.stop().unwrap();
}

/// Set in the child process of [`load_reads_the_standard_environment`].
const CHILD_ENV: &str = "EGRET_CLOUD_AWS_CHILD";

/// `AwsCloud::load` takes credentials, region and endpoint from the standard
/// environment (`AWS_ACCESS_KEY_ID`, `AWS_REGION`, `AWS_ENDPOINT_URL_EC2`).
/// The environment is given to a child process running
/// [`load_from_environment_child`] (this binary again), so no test changes
/// the environment of a running process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_reads_the_standard_environment() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let Some(moto) = moto_or_skip("load_reads_the_standard_environment") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let eip = moto::allocate_eip(&ec2, &[(POOL_TAG, "from-env")]).await.unwrap();
    let exe = std::env::current_exe().unwrap();
    let out = tokio::process::Command::new(exe)
        .args(["--exact", "load_from_environment_child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .env("EGRET_CHILD_SUBNET", &net.subnet_id)
        .env("EGRET_CHILD_PUBLIC_IP", eip.public_ip.to_string())
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing")
        .env("AWS_REGION", moto::REGION)
        .env("AWS_ENDPOINT_URL_EC2", moto.endpoint())
        // Nothing else from the machine: no profile files, no IMDS.
        .env("AWS_CONFIG_FILE", "/nonexistent/egret-aws-config")
        .env("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/egret-aws-credentials")
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_ENDPOINT_URL")
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
    moto.stop().unwrap();
}

/// The child half of [`load_reads_the_standard_environment`]; passes
/// trivially when run on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_from_environment_child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let cloud = AwsCloud::load(None, None).await;
    let subnet = std::env::var("EGRET_CHILD_SUBNET").unwrap();
    let want: IpAddr = std::env::var("EGRET_CHILD_PUBLIC_IP").unwrap().parse().unwrap();
    let found = cloud.discover(&selector(&subnet, &[(POOL_TAG, "from-env")])).await.unwrap();
    assert_eq!(public_ips(&found), BTreeSet::from([want]));
    // The constructor's arguments override the environment: a region and an
    // endpoint where nothing listens fail, retryably, within the bound.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let cloud = AwsCloud::load(Some("eu-west-1".into()), Some(dead_url)).await;
    let e = cloud.discover(&selector(&subnet, &[(POOL_TAG, "from-env")])).await.unwrap_err();
    assert!(e.retryable, "{e:?}");
}

/// `cloud.add_address(eni)`, asked again while moto hands out an address
/// another interface of the subnet holds (`others`): moto 5.2.5's
/// AssignPrivateIpAddresses by count picks a random address of the subnet
/// and checks it only against the interface's own addresses
/// (moto/ec2/models/elastic_network_interfaces.py,
/// `assign_private_ip_addresses`), so about one run in a hundred was given
/// a worker's primary address, which `assign` then rightly refused. EC2
/// never hands out an address in use. The duplicate is released first.
async fn add_address_ec2_would_give(
    cloud: &AwsCloud,
    ec2: &aws_sdk_ec2::Client,
    eni: &str,
    others: &[&str],
) -> std::net::IpAddr {
    for _ in 0..20 {
        let address = cloud.add_address(eni).await.unwrap();
        let mut held = false;
        for other in others {
            held |= moto::eni_addresses(ec2, other).await.unwrap().contains(&address);
        }
        if !held {
            return address;
        }
        cloud.release(eni, address).await.unwrap();
    }
    panic!("moto gave {eni} an address another interface holds 20 times");
}

/// A `PerNode` cloud pool's calls (ADR 0033) for a worker instance in
/// another subnet than the gateways: its primary ENI found, a secondary
/// address EC2 chooses added to it, the Elastic IP associated with that
/// address, checked, moved to a second worker, and released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_node_gets_an_address_ec2_chooses_on_its_own_interface() {
    let Some(moto) = moto_or_skip("a_worker_node_gets_an_address_ec2_chooses_on_its_own_interface") else { return };
    let ec2 = moto.client();
    let net = moto::create_network(&ec2).await.unwrap();
    let w1 = moto::run_instance(&ec2, &net, &net.other_subnet_id, true).await.unwrap();
    let w2 = moto::run_instance(&ec2, &net, &net.other_subnet_id, true).await.unwrap();
    let gw = moto::run_instance(&ec2, &net, &net.subnet_id, false).await.unwrap();
    let eip = moto::allocate_eip(&ec2, &[(POOL_TAG, "nodes")]).await.unwrap();
    let proxy = FaultProxy::start(moto.addr()).await.unwrap();
    let cloud = AwsCloud::from_conf(Moto::sdk_config(&proxy.url()));
    let found = cloud.discover(&selector(&net.subnet_id, &[(POOL_TAG, "nodes")])).await.unwrap();
    let public = found.public[0].clone();

    // The primary ENI, whatever its subnet (the gateways' is not asked).
    let i = cloud.primary_interface(&w1.provider_id).await.unwrap();
    assert_eq!((i.interface_id.as_str(), i.primary_ip), (w1.eni_id.as_str(), w1.primary_ip));

    // A new address EC2 chooses, in the worker's subnet, on its ENI, and
    // asked for by count (never by address: the CNI may take addresses of
    // the same subnet meanwhile).
    let private = add_address_ec2_would_give(&cloud, &ec2, &i.interface_id, &[&w2.eni_id, &gw.eni_id]).await;
    let other_subnet: ipnet::IpNet = moto::OTHER_SUBNET_CIDR.parse().unwrap();
    assert!(other_subnet.contains(&private) && private != w1.primary_ip, "{private}");
    assert!(moto::eni_addresses(&ec2, &w1.eni_id).await.unwrap().contains(&private));
    let req = proxy.requests("AssignPrivateIpAddresses").pop().unwrap();
    assert_eq!(param(&req, "SecondaryPrivateIpAddressCount"), Some("1"));
    assert_eq!(param(&req, "PrivateIpAddress.1"), None);

    // Associated with only the worker's own instance managed.
    let own = BTreeSet::from([w1.provider_id.clone()]);
    cloud.assign(&w1.eni_id, private, Some(&public), &own).await.unwrap();
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(w1.eni_id.clone()));
    let req = proxy.requests("AssociateAddress").pop().unwrap();
    assert_eq!(param(&req, "PrivateIpAddress"), Some(private.to_string().as_str()));
    // verify is not asserted true here: moto shows every association on the
    // ENI's primary address (it ignores PrivateIpAddress), so it reads as
    // drift under moto (docs/kubernetes.md, the moto table).

    // A second worker is given the Elastic IP: it moves (it is the pool's);
    // w1's private address stays w1's until released, and w2 may not take it.
    let i2 = cloud.primary_interface(&w2.provider_id).await.unwrap();
    let private2 = add_address_ec2_would_give(&cloud, &ec2, &i2.interface_id, &[&w1.eni_id, &gw.eni_id]).await;
    assert_ne!(private2, private);
    let own2 = BTreeSet::from([w2.provider_id.clone()]);
    cloud.assign(&w2.eni_id, private2, Some(&public), &own2).await.unwrap();
    assert_eq!(moto::association(&ec2, &eip.allocation_id).await.unwrap().map(|a| a.0), Some(w2.eni_id.clone()));
    let e = cloud.assign(&w2.eni_id, private, Some(&public), &own2).await.unwrap_err();
    assert_eq!(e.code, HELD_ELSEWHERE, "{e}");
    assert!(e.message.contains(&w1.instance_id), "{e}");

    // w1 leaves: its address is released; the gateway's ENI was never touched.
    cloud.release(&w1.eni_id, private).await.unwrap();
    assert!(!moto::eni_addresses(&ec2, &w1.eni_id).await.unwrap().contains(&private));
    assert!(!cloud.verify(&w1.eni_id, private, Some(&public)).await.unwrap());
    assert_eq!(moto::eni_addresses(&ec2, &gw.eni_id).await.unwrap(), vec![gw.primary_ip]);
    moto.stop().unwrap();
}
