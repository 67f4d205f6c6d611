#![allow(clippy::unwrap_used, clippy::expect_used)]
use super::*;
use crate::k8s::crd::{AwsPoolSpec, CloudAddressStatus, EgressIPSpec, PoolCloudSpec, PoolRef};
// What the tests used from the single file's imports.
use crate::k8s::crd::{condition, reason, PoolAllocation};
use egret_dataplane::tables::{EgressIpSpec, PolicySpec};
use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use serde_json::json;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn labels(kv: &[(&str, &str)]) -> Labels {
    kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn t(secs: i64) -> Timestamp {
    Timestamp::from_second(1_700_000_000 + secs).unwrap()
}

fn selector(v: serde_json::Value) -> Option<LabelSelector> {
    Some(serde_json::from_value(v).unwrap())
}

fn pod(ns: &str, name: &str, l: &[(&str, &str)], ips: &[&str]) -> PodInfo {
    PodInfo { namespace: ns.into(), name: name.into(), labels: labels(l), ips: ips.iter().map(|s| ip(s)).collect() }
}

fn explicit(ips: &[&str]) -> Vec<EgressIPSpec> {
    ips.iter().map(|s| EgressIPSpec { ip: s.to_string(), next_hop: None }).collect()
}

fn policy(name: &str, age: i64, spec: EgressPolicySpec) -> PolicyInfo {
    PolicyInfo { name: name.into(), created: Some(t(age)), generation: Some(1), spec, status: None }
}

fn team_policy(name: &str, age: i64, ips: &[&str]) -> PolicyInfo {
    policy(
        name,
        age,
        EgressPolicySpec {
            namespace_selector: selector(json!({"matchLabels": {"team": "a"}})),
            pod_selector: selector(
                json!({"matchExpressions": [{"key": "app", "operator": "In", "values": ["web", "api"]}]}),
            ),
            destinations: vec!["0.0.0.0/0".into()],
            except: vec!["198.51.100.128/25".into()],
            egress_ips: explicit(ips),
            ..Default::default()
        },
    )
}

fn gw(name: &str, l: &[(&str, &str)]) -> NodeInfo {
    NodeInfo { name: name.into(), labels: labels(l), internal_ips: vec![], provider_id: None }
}

fn lease(holder: &str, acquired: i64, renewed: i64) -> LeaseInfo {
    LeaseInfo {
        holder: Some(holder.into()),
        acquire_time: Some(t(acquired)),
        renew_time: Some(t(renewed)),
        duration: Duration::from_secs(4),
    }
}

/// Two namespaces, four pods, two gateways.
fn cluster() -> Observed {
    Observed {
        namespaces: [("team-a".to_string(), labels(&[("team", "a")])), ("other".to_string(), labels(&[]))].into(),
        pods: vec![
            pod("team-a", "web-1", &[("app", "web")], &["198.18.0.11", "2001:db8:18::11"]),
            pod("team-a", "api-1", &[("app", "api")], &["198.18.0.12"]),
            pod("team-a", "db-1", &[("app", "db")], &["198.18.0.13"]),
            pod("other", "web-9", &[("app", "web")], &["198.18.0.99"]),
        ],
        gateways: vec![gw("gw-1", &[("zone", "x")]), gw("gw-2", &[("zone", "y")])],
        ..Default::default()
    }
}

fn local() -> LocalConfig {
    LocalConfig {
        node_name: "gw-1".into(),
        nat: NatSettings::default(),
        guard: SourceGuard::default(),
        tunnel_port: None,
        role: Role::Gateway,
    }
}

fn cond<'a>(st: &'a EgressPolicyStatus, type_: &str) -> &'a Condition {
    st.conditions.iter().find(|c| c.type_ == type_).expect("condition present")
}

#[test]
fn a_policy_selects_pods_and_this_gateway_serves_only_the_ips_it_holds() {
    let mut obs = cluster();
    obs.policies.push(team_policy("team-a", 0, &["198.51.100.11", "198.51.100.10"]));
    obs.leases.insert(ip("198.51.100.10"), lease("gw-1", 5, 100));
    obs.leases.insert(ip("198.51.100.11"), lease("gw-2", 7, 100));
    obs.held = [ip("198.51.100.10")].into();
    let d = desired(&obs, &local(), t(101));

    assert_eq!(
        d.tables.policies,
        vec![PolicySpec {
            name: "egresspolicy/team-a".into(),
            // web-1's IPv6 address is left out: the policy has no IPv6 egress IP.
            sources: vec![net("198.18.0.11/32"), net("198.18.0.12/32")],
            destinations: vec![net("0.0.0.0/0")],
            except: vec![net("198.51.100.128/25")],
            egress_ips: vec![ip("198.51.100.10"), ip("198.51.100.11")],
        }]
    );
    assert_eq!(
        d.tables.egress_ips,
        vec![EgressIpSpec { ip: ip("198.51.100.10"), ports: None, answer_neighbor: true, port_blocks: None }]
    );
    assert_eq!(d.tables.neighbor_addresses, Vec::<IpAddr>::new());
    assert_eq!(d.tables.nat, NatSettings::default());

    let st = &d.policy_status["team-a"];
    assert_eq!(st.selected_pods, 2);
    assert_eq!(st.egress_ip_list, "198.51.100.10,198.51.100.11");
    assert_eq!(st.gateway_list, "gw-1,gw-2");
    assert_eq!(st.egress_ips[0].since, Some(Time(t(5))));
    let ready = cond(st, condition::READY);
    assert_eq!((ready.status.as_str(), ready.reason.as_str()), ("True", reason::ENFORCED));
    assert_eq!(ready.message, "2 selected pod(s) leave with 198.51.100.10 on gw-1, 198.51.100.11 on gw-2");
    assert_eq!(ready.last_transition_time, Time(t(101)));
    assert_eq!(ready.observed_generation, Some(1));
    // Both gateways are candidates for both IPs, ranked by rendezvous hashing.
    for (addr, a) in &d.ips {
        assert_eq!(a.candidates, rank_gateways(*addr, &["gw-2", "gw-1"]));
        assert_eq!(a.owner, Owner::Policy("team-a".into()));
    }
    assert_eq!(d.competing("gw-1").count(), 2);
}

#[test]
fn rendezvous_ranking_is_order_independent_and_spreads() {
    let nodes = ["gw-1", "gw-2", "gw-3"];
    let mut first = BTreeMap::<String, usize>::new();
    for i in 0..300u32 {
        let a = IpAddr::from(std::net::Ipv4Addr::from(0xC633_6400 + i));
        let r = rank_gateways(a, &nodes);
        assert_eq!(r, rank_gateways(a, &["gw-3", "gw-1", "gw-2"]));
        assert_eq!(r.len(), 3);
        *first.entry(r[0].clone()).or_default() += 1;
        // Removing a node that was not first does not change the first.
        let without: Vec<&str> = nodes.iter().copied().filter(|n| *n == r[0] || *n != "gw-3").collect();
        assert_eq!(rank_gateways(a, &without)[0], r[0]);
    }
    assert!(first.values().all(|c| *c > 60), "{first:?}");
}

/// Invalid objects get a condition naming the problem; the valid policy
/// beside them stays in the tables with its IP.
#[test]
fn invalid_policies_get_a_condition_and_never_stop_the_others() {
    let base = || team_policy("x", 10, &["198.51.100.50"]);
    let with = |f: &dyn Fn(&mut EgressPolicySpec)| {
        let mut p = base();
        f(&mut p.spec);
        p
    };
    let cases: Vec<(&str, PolicyInfo, &str, &str)> = vec![
        (
            "bad destination",
            with(&|s| s.destinations = vec!["10.0.0.0/33".into()]),
            reason::INVALID_SPEC,
            "spec.destinations[0]: \"10.0.0.0/33\" is not a CIDR",
        ),
        (
            "bad except",
            with(&|s| s.except = vec!["nope".into()]),
            reason::INVALID_SPEC,
            "spec.except[0]: \"nope\" is not a CIDR",
        ),
        (
            "no destinations",
            with(&|s| s.destinations = vec![]),
            reason::INVALID_SPEC,
            "spec.destinations: must list at least one CIDR (0.0.0.0/0 for every IPv4 destination)",
        ),
        (
            "bad egress IP",
            with(&|s| s.egress_ips = explicit(&["198.51.100.300"])),
            reason::INVALID_SPEC,
            "spec.egressIPs[0].ip: \"198.51.100.300\" is not an IP address",
        ),
        (
            "bad next hop",
            with(&|s| s.egress_ips[0].next_hop = Some("x".into())),
            reason::INVALID_SPEC,
            "spec.egressIPs[0].nextHop: \"x\" is not an IP address",
        ),
        (
            "twice",
            with(&|s| s.egress_ips = explicit(&["198.51.100.50", "198.51.100.50"])),
            reason::INVALID_SPEC,
            "spec.egressIPs[1].ip: 198.51.100.50 is listed twice",
        ),
        (
            "no IP",
            with(&|s| s.egress_ips = vec![]),
            reason::NO_EGRESS_IP,
            "set spec.egressIPs or spec.pool: the policy has no egress IP",
        ),
        (
            "both",
            with(&|s| s.pool = Some(PoolRef { name: "p".into(), count: None })),
            reason::NO_EGRESS_IP,
            "set either spec.egressIPs or spec.pool, not both",
        ),
        (
            "bad selector",
            with(&|s| s.pod_selector = selector(json!({"matchExpressions": [{"key": "app", "operator": "Near"}]}))),
            reason::INVALID_SPEC,
            "spec.podSelector: failed to parse value as expression: Invalid expression operator",
        ),
        (
            "conflict",
            team_policy("x", 10, &["198.51.100.10"]),
            reason::IP_CONFLICT,
            "198.51.100.10 is already used by EgressPolicy good (the older object keeps it)",
        ),
        (
            "pool missing",
            with(&|s| {
                s.egress_ips = vec![];
                s.pool = Some(PoolRef { name: "nowhere".into(), count: None });
            }),
            reason::POOL_NOT_FOUND,
            "EgressIPPool nowhere does not exist",
        ),
    ];
    for (what, bad, want_reason, want_message) in cases {
        let mut obs = cluster();
        obs.policies = vec![team_policy("good", 0, &["198.51.100.10"]), bad];
        obs.held = [ip("198.51.100.10"), ip("198.51.100.50")].into();
        obs.leases.insert(ip("198.51.100.10"), lease("gw-1", 0, 1));
        let d = desired(&obs, &local(), t(1));
        let names: Vec<&str> = d.tables.policies.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, vec!["egresspolicy/good"], "{what}");
        assert_eq!(d.tables.egress_ips.iter().map(|e| e.ip).collect::<Vec<_>>(), vec![ip("198.51.100.10")], "{what}");
        let ready = cond(&d.policy_status["x"], condition::READY);
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str(), ready.message.as_str()),
            ("False", want_reason, want_message),
            "{what}"
        );
        assert_eq!(cond(&d.policy_status["good"], condition::READY).status, "True", "{what}");
    }
}

#[test]
fn a_conflict_costs_only_the_contested_ip_and_the_older_object_wins() {
    let mut obs = cluster();
    // Listed young-first: order in the list must not matter, age does.
    obs.policies =
        vec![team_policy("young", 50, &["198.51.100.10", "198.51.100.11"]), team_policy("old", 1, &["198.51.100.10"])];
    let d = desired(&obs, &local(), t(60));
    assert_eq!(d.ips[&ip("198.51.100.10")].owner, Owner::Policy("old".into()));
    assert_eq!(d.ips[&ip("198.51.100.11")].owner, Owner::Policy("young".into()));
    let young = &d.policy_status["young"];
    assert_eq!(young.egress_ip_list, "198.51.100.11");
    let ipc = cond(young, condition::IP_ASSIGNED);
    assert_eq!((ipc.status.as_str(), ipc.reason.as_str()), ("False", reason::IP_CONFLICT));
    let yp = d.tables.policies.iter().find(|p| p.name == "egresspolicy/young").unwrap();
    assert_eq!(yp.egress_ips, vec![ip("198.51.100.11")]);
}

#[test]
fn pool_allocation_is_proposed_then_used_once_recorded_and_released_with_the_policy() {
    let mut obs = cluster();
    obs.pools.push(PoolInfo {
        name: "pool-a".into(),
        generation: Some(3),
        spec: EgressIPPoolSpec {
            addresses: vec!["198.51.100.8/30".into()],
            gateway_selector: selector(json!({"matchLabels": {"zone": "y"}})),
            ..Default::default()
        },
        status: None,
    });
    let mut p = team_policy("pooled", 0, &[]);
    p.spec.pool = Some(PoolRef { name: "pool-a".into(), count: Some(2) });
    obs.policies.push(p);
    obs.policies.push(team_policy("explicit", 5, &["198.51.100.9"]));

    // Round 1: proposed in the pool's status, not used yet.
    let d = desired(&obs, &local(), t(10));
    let ps = &d.pool_status["pool-a"];
    assert_eq!(
        ps.allocations,
        vec![PoolAllocation {
            policy: "pooled".into(),
            ips: vec!["198.51.100.10".into()],
            node: None,
            ..Default::default()
        }]
    );
    assert_eq!(ps.size, 2, "198.51.100.9-10: network and broadcast skipped");
    let c = cond(&d.policy_status["pooled"], condition::IP_ASSIGNED);
    assert_eq!(c.reason, reason::POOL_EXHAUSTED, "one of the two is taken by the explicit policy");
    assert_eq!(c.message, "EgressIPPool pool-a has 1 free address(es), the policy asks for 2: add addresses to the pool or lower spec.pool.count");
    assert!(d.tables.policies.iter().all(|p| p.name != "egresspolicy/pooled"));

    // With count 1: pending, then recorded -> used, with the pool's gateway selector.
    obs.policies[0].spec.pool = Some(PoolRef { name: "pool-a".into(), count: Some(1) });
    let d = desired(&obs, &local(), t(10));
    assert_eq!(cond(&d.policy_status["pooled"], condition::IP_ASSIGNED).reason, reason::ALLOCATION_PENDING);
    assert_eq!(cond(&d.pool_status["pool-a"].clone().into_status_for_test(), condition::READY).status, "True");
    obs.pools[0].status = Some(d.pool_status["pool-a"].clone());
    let d = desired(&obs, &local(), t(11));
    assert_eq!(cond(&d.policy_status["pooled"], condition::IP_ASSIGNED).reason, reason::ASSIGNED);
    let a = &d.ips[&ip("198.51.100.10")];
    assert_eq!(a.candidates, vec!["gw-2".to_string()], "pool gatewaySelector zone=y");
    assert_eq!(d.pool_status["pool-a"].allocated, 1);

    // The policy goes: its allocation is dropped from the proposal.
    obs.policies.remove(0);
    let d = desired(&obs, &local(), t(12));
    assert_eq!(d.pool_status["pool-a"].allocations, vec![]);
    assert!(!d.ips.contains_key(&ip("198.51.100.10")));
}

#[test]
fn port_blocks_come_from_the_policy_else_its_pool_and_bad_ones_are_named() {
    use egret_dataplane::nat::port_blocks::PortBlocks;
    let blocks = |size: u32| Some(crate::k8s::crd::PortBlocksSpec { size: Some(size), ..Default::default() });
    let mut obs = cluster();
    obs.pools.push(PoolInfo {
        name: "pool-a".into(),
        spec: EgressIPPoolSpec {
            addresses: vec!["198.51.100.8/30".into()],
            port_blocks: blocks(64),
            ..Default::default()
        },
        ..Default::default()
    });
    let mut pooled = team_policy("pooled", 0, &[]);
    pooled.spec.pool = Some(PoolRef { name: "pool-a".into(), count: Some(1) });
    obs.policies.push(pooled);
    let mut own = team_policy("own", 5, &["198.51.100.20"]);
    own.spec.port_blocks = blocks(256);
    obs.policies.push(own);
    obs.policies.push(team_policy("plain", 6, &["198.51.100.21"]));
    let d = desired(&obs, &local(), t(10));
    obs.pools[0].status = Some(d.pool_status["pool-a"].clone());
    let from_pool = ip(&d.pool_status["pool-a"].allocations[0].ips[0]);
    for a in [from_pool, ip("198.51.100.20"), ip("198.51.100.21")] {
        obs.leases.insert(a, lease("gw-1", 5, 100));
    }
    obs.held = [from_pool, ip("198.51.100.20"), ip("198.51.100.21")].into();
    let d = desired(&obs, &local(), t(11));
    let got: Vec<(IpAddr, Option<u16>)> =
        d.tables.egress_ips.iter().map(|e| (e.ip, e.port_blocks.map(|b| b.size))).collect();
    assert_eq!(got, [(from_pool, Some(64)), (ip("198.51.100.20"), Some(256)), (ip("198.51.100.21"), None)]);
    assert_eq!(
        d.tables.egress_ips[1].port_blocks,
        Some(PortBlocks { size: 256, max_per_pod: 8, log_sessions: false }),
        "defaults as in the file"
    );
    // A size that is no power of two: the policy is invalid, and says why.
    obs.policies[1].spec.port_blocks = blocks(100);
    let d = desired(&obs, &local(), t(12));
    let c = cond(&d.policy_status["own"], condition::READY);
    assert!(c.message.contains("spec.portBlocks.size: 100: must be a power of two, at least 8"), "{}", c.message);
    assert!(d.tables.policies.iter().all(|p| p.name != "egresspolicy/own"));
    obs.pools[0].spec.port_blocks = blocks(4);
    let d = desired(&obs, &local(), t(12));
    let c = cond(&d.policy_status["pooled"], condition::READY);
    assert!(c.message.contains("EgressIPPool pool-a: spec.portBlocks.size: 4"), "{}", c.message);
}

#[test]
fn per_node_policies_get_one_address_per_node_and_family_recorded_in_the_pool() {
    let mut obs = cluster();
    obs.nodes = vec![gw("gw-1", &[]), gw("w1", &[("pool", "x")]), gw("w2", &[("pool", "x")]), gw("w3", &[])];
    obs.pools.push(PoolInfo {
        name: "nodes".into(),
        generation: Some(1),
        spec: EgressIPPoolSpec {
            addresses: vec!["203.0.113.50-203.0.113.52".into(), "2001:db8:113::50-2001:db8:113::51".into()],
            ..Default::default()
        },
        status: None,
    });
    let mut p = team_policy("per-node", 0, &[]);
    p.spec.mode = Some(super::super::crd::PolicyMode::PerNode);
    p.spec.pool = Some(PoolRef { name: "nodes".into(), count: None });
    p.spec.node_selector = selector(json!({"matchLabels": {"pool": "x"}}));
    obs.policies.push(p);

    // Round 1: one address per family proposed for each selected Node
    // (the gateway gw-1 and the unlabelled w3 get none); nothing used yet.
    let d = desired(&obs, &local(), t(10));
    let alloc = |node: &str, ips: &[&str]| PoolAllocation {
        policy: "per-node".into(),
        ips: ips.iter().map(|s| s.to_string()).collect(),
        node: Some(node.into()),
        ..Default::default()
    };
    assert_eq!(
        d.pool_status["nodes"].allocations,
        vec![alloc("w1", &["203.0.113.50", "2001:db8:113::50"]), alloc("w2", &["203.0.113.51", "2001:db8:113::51"])]
    );
    assert_eq!(cond(&d.policy_status["per-node"], condition::IP_ASSIGNED).reason, reason::ALLOCATION_PENDING);
    assert!(d.tables.policies.iter().all(|p| p.name != "egresspolicy/per-node"), "never in a gateway's tables");
    assert!(d.ips.is_empty(), "no Lease for a per-node address");

    // Recorded: granted, stable, and only the node agent's tables hold it,
    // with that Node's own addresses.
    obs.pools[0].status = Some(d.pool_status["nodes"].clone());
    let d = desired(&obs, &local(), t(11));
    assert_eq!(d.pool_status["nodes"].allocations, obs.pools[0].status.as_ref().unwrap().allocations);
    let st = &d.policy_status["per-node"];
    assert_eq!(cond(st, condition::READY).status, "True", "{st:?}");
    assert_eq!(cond(st, condition::GATEWAY_ASSIGNED).reason, reason::PER_NODE);
    assert_eq!(st.egress_ips.iter().filter(|e| e.node.as_deref() == Some("w2")).count(), 2);
    assert_eq!(d.per_node["egresspolicy/per-node"]["w1"], vec![ip("203.0.113.50"), ip("2001:db8:113::50")]);
    assert!(d.tables.policies.iter().all(|p| p.name != "egresspolicy/per-node"));
    let agent = LocalConfig { node_name: "w2".into(), role: Role::Node, ..local() };
    let d = desired(&obs, &agent, t(11));
    let spec = d.tables.policies.iter().find(|p| p.name == "egresspolicy/per-node").expect("in w2's tables");
    assert_eq!(spec.egress_ips, vec![ip("203.0.113.51"), ip("2001:db8:113::51")]);

    // A third selected Node finds the IPv4 range exhausted after one more.
    obs.nodes[3].labels = labels(&[("pool", "x")]);
    obs.nodes.push(gw("w4", &[("pool", "x")]));
    let d = desired(&obs, &local(), t(12));
    assert_eq!(cond(&d.policy_status["per-node"], condition::IP_ASSIGNED).reason, reason::POOL_EXHAUSTED);
    assert_eq!(d.per_node["egresspolicy/per-node"]["w1"], vec![ip("203.0.113.50"), ip("2001:db8:113::50")]);

    // Mistakes are named.
    let mut bad = team_policy("bad", 1, &["203.0.113.9"]);
    bad.spec.mode = Some(super::super::crd::PolicyMode::PerNode);
    obs.policies = vec![bad];
    let d = desired(&obs, &local(), t(13));
    assert!(cond(&d.policy_status["bad"], condition::READY).message.contains("remove spec.egressIPs"));
}

impl EgressIPPoolStatus {
    fn into_status_for_test(self) -> EgressPolicyStatus {
        EgressPolicyStatus { conditions: self.conditions, ..Default::default() }
    }
}

#[test]
fn unusable_pools_say_why() {
    let cases: Vec<(EgressIPPoolSpec, &str, &str)> = vec![
        (
            EgressIPPoolSpec { addresses: vec!["198.51.100.0/24".into(), "x".into()], ..Default::default() },
            reason::INVALID_ADDRESS,
            "spec.addresses[1]: \"x\" is not a CIDR, a first-last range or an address",
        ),
        (
            EgressIPPoolSpec { cloud: Some(PoolCloudSpec::default()), ..Default::default() },
            reason::CLOUD_NOT_SUPPORTED,
            "spec.cloud: names no provider; set spec.cloud.aws, spec.cloud.azure or spec.cloud.gcp",
        ),
        (
            EgressIPPoolSpec {
                cloud: Some(PoolCloudSpec {
                    gcp: gcp_pool(&[("pool", "prod")], "projects/p/regions/r/subnetworks/s").gcp,
                    ..aws_pool(&[("egret.dev/pool", "prod")], "subnet-0a1b")
                }),
                ..Default::default()
            },
            reason::INVALID_SPEC,
            "spec.cloud: names 2 providers (aws, gcp); a pool's addresses come from one",
        ),
        (
            EgressIPPoolSpec { cloud: Some(azure_pool(&[("pool", "prod")], "subnet-0a1b")), ..Default::default() },
            reason::INVALID_SPEC,
            "spec.cloud.azure.subnetId: \"subnet-0a1b\" is not a subnet's resource ID (/subscriptions/S/resourceGroups/RG/providers/Microsoft.Network/virtualNetworks/V/subnets/N)",
        ),
        (
            EgressIPPoolSpec { cloud: Some(azure_pool(&[], AZURE_SUBNET)), ..Default::default() },
            reason::INVALID_SPEC,
            "spec.cloud.azure.tags: empty; name the tags that mark this pool's public addresses (an empty set would take every address of the account)",
        ),
        (
            EgressIPPoolSpec { cloud: Some(gcp_pool(&[("Pool", "prod")], "projects/p/regions/r/subnetworks/s")), ..Default::default() },
            reason::INVALID_SPEC,
            "spec.cloud.gcp.labels: \"Pool\": \"prod\" is not a GCP label (a key starts with a lowercase letter; keys and values are at most 63 lowercase letters, digits, '_' and '-')",
        ),
        (
            EgressIPPoolSpec { cloud: Some(gcp_pool(&[("pool", "prod")], "regions/r/subnetworks/s")), ..Default::default() },
            reason::INVALID_SPEC,
            "spec.cloud.gcp.subnetwork: \"regions/r/subnetworks/s\" is not a subnetwork (projects/P/regions/R/subnetworks/S)",
        ),
        (
            EgressIPPoolSpec {
                addresses: vec!["203.0.113.0/28".into()],
                cloud: Some(gcp_pool(&[("pool", "prod")], "projects/p/regions/r/subnetworks/s")),
                ..Default::default()
            },
            reason::INVALID_SPEC,
            "spec.addresses: [\"203.0.113.0/28\"] with spec.cloud.gcp: a GCP pool's egress IPs are its labelled external addresses themselves; remove spec.addresses",
        ),
        (
            EgressIPPoolSpec { cloud: Some(azure_pool(&[("pool", "prod")], AZURE_SUBNET)), ..Default::default() },
            reason::CLOUD_DISCOVERING,
            "waiting for the first answer from the cloud provider",
        ),
        (
            EgressIPPoolSpec { cloud: Some(aws_pool(&[], "subnet-0a1b")), ..Default::default() },
            reason::INVALID_SPEC,
            "spec.cloud.aws.tags: empty; name the tags that mark this pool's public addresses (an empty set would take every address of the account)",
        ),
        (
            EgressIPPoolSpec { cloud: Some(aws_pool(&[("egret.dev/pool", "prod")], "vpc-0a1b")), ..Default::default() },
            reason::INVALID_SPEC,
            "spec.cloud.aws.subnetId: \"vpc-0a1b\" is not a subnet ID (subnet-0123abcd)",
        ),
        (
            EgressIPPoolSpec {
                addresses: vec!["2001:db8::/64".into()],
                cloud: Some(aws_pool(&[("egret.dev/pool", "prod")], "subnet-0a1b")),
                ..Default::default()
            },
            reason::INVALID_SPEC,
            "spec.cloud.aws.tags: set with IPv6 spec.addresses: an IPv6 pool has no Elastic IPs (its addresses are global); remove the tags",
        ),
        (
            EgressIPPoolSpec {
                addresses: vec!["2001:db8::/64".into(), "203.0.113.40".into()],
                cloud: Some(aws_pool(&[("egret.dev/pool", "prod")], "subnet-0a1b")),
                ..Default::default()
            },
            reason::INVALID_ADDRESS,
            "spec.addresses: IPv6 with spec.cloud.aws: an AWS pool is either IPv4 (Elastic IPs) or IPv6 (the subnet's addresses): make two pools",
        ),
        (
            EgressIPPoolSpec {
                addresses: vec!["2001:db8::/64".into()],
                cloud: Some(azure_pool(&[("pool", "prod")], AZURE_SUBNET)),
                ..Default::default()
            },
            reason::INVALID_ADDRESS,
            "spec.addresses: IPv6 with spec.cloud.azure: IPv6 cloud pools are built for AWS only; an IPv6 pool without a cloud section serves addresses the network routes to the gateways",
        ),
        (
            EgressIPPoolSpec { cloud: Some(aws_pool(&[("egret.dev/pool", "prod")], "subnet-0a1b")), ..Default::default() },
            reason::CLOUD_DISCOVERING,
            "waiting for the first answer from the cloud provider",
        ),
    ];
    for (spec, want_reason, want_message) in cases {
        let mut obs = cluster();
        obs.pools.push(PoolInfo { name: "p".into(), spec, ..Default::default() });
        let mut pol = team_policy("pooled", 0, &[]);
        pol.spec.pool = Some(PoolRef { name: "p".into(), count: None });
        obs.policies.push(pol);
        let d = desired(&obs, &local(), t(1));
        let pc = &d.pool_status["p"].conditions[0];
        assert_eq!((pc.reason.as_str(), pc.message.as_str()), (want_reason, want_message));
        let c = cond(&d.policy_status["pooled"], condition::IP_ASSIGNED);
        assert_eq!(c.reason, reason::POOL_NOT_USABLE);
        assert_eq!(c.message, format!("EgressIPPool p cannot be used: {want_message}"));
    }
}

fn aws_pool(tags: &[(&str, &str)], subnet: &str) -> PoolCloudSpec {
    PoolCloudSpec {
        aws: Some(AwsPoolSpec {
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            subnet_id: subnet.into(),
        }),
        ..Default::default()
    }
}

const AZURE_SUBNET: &str =
    "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/rg/providers/Microsoft.Network/virtualNetworks/v/subnets/gw";

fn azure_pool(tags: &[(&str, &str)], subnet: &str) -> PoolCloudSpec {
    PoolCloudSpec {
        azure: Some(crate::k8s::crd::AzurePoolSpec {
            tags: tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            subnet_id: subnet.into(),
        }),
        ..Default::default()
    }
}

fn gcp_pool(labels: &[(&str, &str)], subnetwork: &str) -> PoolCloudSpec {
    PoolCloudSpec {
        gcp: Some(crate::k8s::crd::GcpPoolSpec {
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            subnetwork: subnetwork.into(),
        }),
        ..Default::default()
    }
}

/// An AWS IPv6 pool: no Elastic IPs, its own addresses move with their
/// Leases; usable at once; CloudSynced checks them against the subnet's
/// IPv6 range; the allocated addresses are cloud targets with no public
/// address.
#[test]
fn an_aws_ipv6_pool_serves_its_own_addresses_and_moves_them() {
    use crate::cloud::Discovered;
    let mut obs = cluster();
    obs.pools.push(PoolInfo {
        name: "v6".into(),
        generation: Some(1),
        spec: EgressIPPoolSpec {
            addresses: vec!["2001:db8:1::100-2001:db8:1::10f".into()],
            cloud: Some(aws_pool(&[], "subnet-0a1b")),
            ..Default::default()
        },
        status: None,
    });
    let mut pol = team_policy("pooled", 0, &[]);
    pol.spec.pool = Some(PoolRef { name: "v6".into(), count: Some(1) });
    obs.policies.push(pol);
    let d = desired(&obs, &local(), t(10));
    let ps = d.pool_status["v6"].clone();
    assert_eq!(ps.allocations[0].ips, vec!["2001:db8:1::100".to_string()]);
    assert!(ps.cloud_addresses.is_empty());
    assert_eq!(cond(&ps.clone().into_status_for_test(), condition::CLOUD_SYNCED).reason, reason::CLOUD_DISCOVERING);
    obs.pools[0].status = Some(ps);
    let targets = crate::cloud::targets(&obs.pools);
    let t6 = &targets[&ip("2001:db8:1::100")];
    assert_eq!(
        (t6.provider, t6.subnet_id.as_str(), t6.public.is_none()),
        (crate::cloud::Provider::Aws, "subnet-0a1b", true)
    );
    assert_eq!(targets.len(), 1, "only allocated addresses are moved");

    // The subnet's IPv6 range holds the pool: synced; it does not: said so.
    let found =
        |cidr: &str| Discovered { public: vec![], subnet_cidr: cidr.parse().unwrap(), used: Default::default() };
    obs.cloud.insert("v6".into(), Ok(found("2001:db8:1::/64")));
    let c =
        cond(&desired(&obs, &local(), t(11)).pool_status["v6"].clone().into_status_for_test(), condition::CLOUD_SYNCED)
            .clone();
    assert_eq!(c.reason, reason::VALID, "{}", c.message);
    obs.cloud.insert("v6".into(), Ok(found("2001:db8:2::/64")));
    let c =
        cond(&desired(&obs, &local(), t(12)).pool_status["v6"].clone().into_status_for_test(), condition::CLOUD_SYNCED)
            .clone();
    assert_eq!(
        (c.reason.as_str(), c.message.as_str()),
        (
            reason::INVALID_ADDRESS,
            "spec.addresses: 2001:db8:1::100-2001:db8:1::10f outside the subnet's IPv6 range 2001:db8:2::/64"
        )
    );
}

/// GCP's protocol forwarding delivers the external address itself: a GCP
/// pool's egress IPs are its labelled addresses, each "paired" with itself,
/// whatever the subnet holds.
#[test]
fn a_gcp_pool_serves_its_external_addresses_themselves() {
    use crate::cloud::{Discovered, PublicAddress};
    let mut obs = cluster();
    obs.pools.push(PoolInfo {
        name: "ext".into(),
        generation: Some(1),
        spec: EgressIPPoolSpec {
            cloud: Some(gcp_pool(&[("pool", "prod")], "projects/p/regions/r/subnetworks/gw")),
            ..Default::default()
        },
        status: None,
    });
    let mut pol = team_policy("pooled", 0, &[]);
    pol.spec.pool = Some(PoolRef { name: "ext".into(), count: Some(1) });
    obs.policies.push(pol);
    let addr = |p: &str, name: &str| PublicAddress {
        public_ip: ip(p),
        allocation_id: format!("projects/p/regions/r/addresses/{name}"),
        private_ip: None,
        interface_id: None,
    };
    let found = Discovered {
        public: vec![addr("198.51.100.9", "b"), addr("198.51.100.7", "a")],
        subnet_cidr: "198.18.1.0/24".parse().unwrap(),
        used: [ip("198.18.1.2")].into(),
    };
    obs.cloud.insert("ext".into(), Ok(found));
    let d = desired(&obs, &local(), t(10));
    let ps = &d.pool_status["ext"];
    let pairs: Vec<(&str, &str)> =
        ps.cloud_addresses.iter().map(|a| (a.public_ip.as_str(), a.private_ip.as_str())).collect();
    assert_eq!(pairs, [("198.51.100.7", "198.51.100.7"), ("198.51.100.9", "198.51.100.9")]);
    assert_eq!(cond(&ps.clone().into_status_for_test(), condition::CLOUD_SYNCED).reason, reason::VALID);
    obs.pools[0].status = Some(ps.clone());
    let d = desired(&obs, &local(), t(11));
    obs.pools[0].status = Some(d.pool_status["ext"].clone());
    let d = desired(&obs, &local(), t(12));
    let e = &d.policy_status["pooled"].egress_ips[0];
    assert_eq!((e.ip.as_str(), e.public_ip.as_deref()), ("198.51.100.7", Some("198.51.100.7")));
    assert!(d.ips.contains_key(&ip("198.51.100.7")), "{:?}", d.ips.keys());
}

#[test]
fn a_cloud_pool_pairs_what_the_provider_found_and_serves_the_recorded_pairing() {
    use crate::cloud::{CloudError, Discovered, PublicAddress};
    let eip = |p: &str, a: &str| PublicAddress {
        public_ip: ip(p),
        allocation_id: a.into(),
        private_ip: None,
        interface_id: None,
    };
    let rec = |p: &str, a: &str, private: &str| CloudAddressStatus {
        public_ip: p.into(),
        allocation_id: a.into(),
        private_ip: private.into(),
    };
    let mut obs = cluster();
    obs.pools.push(PoolInfo {
        name: "eips".into(),
        generation: Some(1),
        spec: EgressIPPoolSpec {
            addresses: vec!["203.0.113.40-203.0.113.47".into()],
            cloud: Some(aws_pool(&[("egret.dev/pool", "prod")], "subnet-0a1b")),
            ..Default::default()
        },
        status: None,
    });
    let mut pol = team_policy("pooled", 0, &[]);
    pol.spec.pool = Some(PoolRef { name: "eips".into(), count: Some(1) });
    obs.policies.push(pol);
    let found = Discovered {
        public: vec![eip("192.0.2.200", "eipalloc-1")],
        subnet_cidr: "203.0.113.0/24".parse().unwrap(),
        used: [ip("203.0.113.21"), ip("203.0.113.40")].into(),
    };
    obs.cloud.insert("eips".into(), Ok(found.clone()));

    // Round 1: the pairing is proposed (.40 is in use: .41); nothing is
    // allocated from it before it is recorded.
    let d = desired(&obs, &local(), t(10));
    let ps = &d.pool_status["eips"];
    assert_eq!(ps.cloud_addresses, vec![rec("192.0.2.200", "eipalloc-1", "203.0.113.41")]);
    assert_eq!(cond(&ps.clone().into_status_for_test(), condition::READY).reason, reason::CLOUD_DISCOVERING);
    assert!(d.ips.is_empty());

    // Round 2: recorded; the policy gets the private address.
    obs.pools[0].status = Some(ps.clone());
    let d = desired(&obs, &local(), t(11));
    assert_eq!(d.pool_status["eips"].allocations[0].ips, vec!["203.0.113.41".to_string()]);
    obs.pools[0].status = Some(d.pool_status["eips"].clone());
    let d = desired(&obs, &local(), t(12));
    assert!(d.ips.contains_key(&ip("203.0.113.41")), "{:?}", d.ips.keys());
    let e = &d.policy_status["pooled"].egress_ips[0];
    assert_eq!((e.ip.as_str(), e.public_ip.as_deref()), ("203.0.113.41", Some("192.0.2.200")));

    // The provider fails: the recorded pairing stays in use, and says so.
    obs.cloud.insert(
        "eips".into(),
        Err(CloudError {
            operation: "DescribeAddresses",
            code: "RequestLimitExceeded".into(),
            message: "slow down".into(),
            retryable: true,
        }),
    );
    let d = desired(&obs, &local(), t(13));
    assert!(d.ips.contains_key(&ip("203.0.113.41")));
    let synced = d.pool_status["eips"].conditions.iter().find(|c| c.type_ == condition::CLOUD_SYNCED).unwrap();
    assert_eq!(synced.reason, reason::CLOUD_API_ERROR);
    assert!(synced.message.contains("RequestLimitExceeded"), "{}", synced.message);

    // The Elastic IP is retagged out of the pool: its pairing goes, and
    // with it the allocation, once the status is written.
    obs.cloud.insert("eips".into(), Ok(Discovered { public: vec![], ..found }));
    let d = desired(&obs, &local(), t(14));
    assert!(d.pool_status["eips"].cloud_addresses.is_empty());
    obs.pools[0].status = Some(d.pool_status["eips"].clone());
    let d = desired(&obs, &local(), t(15));
    assert!(d.ips.is_empty());
    let st = d.pool_status["eips"].clone().into_status_for_test();
    let ready = cond(&st, condition::READY);
    assert_eq!(
        (ready.reason.as_str(), ready.message.as_str()),
        (reason::NO_CLOUD_ADDRESSES, "no Elastic IP carries the tags egret.dev/pool=prod")
    );
}

#[test]
fn two_cloud_pools_of_one_subnet_never_pair_the_same_private_address() {
    use crate::cloud::{Discovered, PublicAddress};
    let mut obs = cluster();
    for (name, tag) in [("a", "x"), ("b", "y")] {
        obs.pools.push(PoolInfo {
            name: name.into(),
            generation: Some(1),
            spec: EgressIPPoolSpec {
                cloud: Some(aws_pool(&[("egret.dev/pool", tag)], "subnet-0a1b")),
                ..Default::default()
            },
            status: None,
        });
        let public = PublicAddress {
            public_ip: ip(if name == "a" { "192.0.2.201" } else { "192.0.2.202" }),
            allocation_id: format!("eipalloc-{name}"),
            private_ip: None,
            interface_id: None,
        };
        obs.cloud.insert(
            name.into(),
            Ok(Discovered { public: vec![public], subnet_cidr: "203.0.113.0/24".parse().unwrap(), used: [].into() }),
        );
    }
    let d = desired(&obs, &local(), t(10));
    let private = |p: &str| d.pool_status[p].cloud_addresses[0].private_ip.clone();
    assert_eq!((private("a").as_str(), private("b").as_str()), ("203.0.113.4", "203.0.113.5"));
    // Recorded: both stay.
    for p in &mut obs.pools {
        p.status = Some(d.pool_status[&p.name].clone());
    }
    let d2 = desired(&obs, &local(), t(11));
    assert_eq!(d2.pool_status["a"].cloud_addresses, d.pool_status["a"].cloud_addresses);
    assert_eq!(d2.pool_status["b"].cloud_addresses, d.pool_status["b"].cloud_addresses);
}

fn service(ns: &str, name: &str, ports: &[u16], ingress: &[&str]) -> ServiceInfo {
    ServiceInfo {
        namespace: ns.into(),
        name: name.into(),
        created: Some(t(0)),
        load_balancer: true,
        selector: labels(&[("app", "web")]),
        ports: ports.iter().map(|p| ServicePortInfo { port: *p, protocol: "TCP".into() }).collect(),
        ingress_ips: ingress.iter().map(|s| ip(s)).collect(),
        external_traffic_local: false,
    }
}

#[test]
fn a_load_balancer_vip_becomes_its_pods_egress_ip() {
    let mut obs = cluster();
    obs.services.push(service("team-a", "web", &[443, 80], &["198.51.100.20"]));
    obs.held = [ip("198.51.100.20")].into();
    let d = desired(&obs, &local(), t(1));
    assert_eq!(
        d.tables.policies,
        vec![PolicySpec {
            name: "service/team-a/web".into(),
            sources: vec![net("198.18.0.11/32")],
            destinations: vec![net("0.0.0.0/0"), net("::/0")],
            except: vec![],
            egress_ips: vec![ip("198.51.100.20")],
        }]
    );
    // The VIP keeps the default NAT range: ports 443 and 80 are outside it,
    // so ingress to them passes to the kernel (kube-proxy / the CNI).
    assert_eq!(
        d.tables.egress_ips,
        vec![EgressIpSpec { ip: ip("198.51.100.20"), ports: None, answer_neighbor: true, port_blocks: None }]
    );
    // Marked as a Service VIP: the XDP program passes its other ports
    // (OWNED_KERNEL_SERVICE) instead of dropping them.
    assert_eq!(d.tables.service_addresses, vec![ip("198.51.100.20")]);
    assert_eq!(d.service_problems, vec![]);
    assert_eq!(d.service_pods[&("team-a".to_string(), "web".to_string())], 1);
}

#[test]
fn service_problems_are_reported_and_a_clashing_vip_is_only_announced() {
    let mut obs = cluster();
    obs.services.push(service("team-a", "pending", &[443], &[]));
    obs.services.push(service("team-a", "clash", &[443, 40000], &["198.51.100.21"]));
    let mut not_lb = service("team-a", "cluster-ip", &[443], &["198.51.100.22"]);
    not_lb.load_balancer = false;
    obs.services.push(not_lb);
    let mut local_policy = service("team-a", "local", &[443], &["198.51.100.23"]);
    local_policy.external_traffic_local = true;
    obs.services.push(local_policy);
    obs.held = [ip("198.51.100.21"), ip("198.51.100.23")].into();
    let d = desired(&obs, &local(), t(1));
    let got: Vec<(&str, &str)> = d.service_problems.iter().map(|p| (p.name.as_str(), p.reason)).collect();
    assert_eq!(
        got,
        vec![
            ("clash", reason::SERVICE_PORT_IN_NAT_RANGE),
            ("cluster-ip", reason::NOT_LOAD_BALANCER),
            ("local", reason::EXTERNAL_TRAFFIC_POLICY_LOCAL),
            ("pending", reason::NO_INGRESS_IP)
        ]
    );
    // A Local Service's VIP is still its pods' egress IP (a warning only).
    assert!(d.ips[&ip("198.51.100.23")].egress);
    assert!(d.tables.egress_ips.iter().any(|e| e.ip == ip("198.51.100.23")));
    obs.services.retain(|s| s.name != "local");
    obs.held.remove(&ip("198.51.100.23"));
    let d = desired(&obs, &local(), t(1));
    let clash = &d.service_problems[0];
    assert_eq!(
        clash.message,
        "Service team-a/clash port 40000/TCP lies in the gateway's NAT port range 32768-60999: its VIP is announced but not used as an egress IP; use Service ports below 32768 or move nat.ports"
    );
    assert_eq!(d.tables.policies, vec![]);
    assert_eq!(d.tables.egress_ips, vec![]);
    assert_eq!(d.tables.neighbor_addresses, vec![ip("198.51.100.21")], "announced for ingress only");
    assert!(!d.ips[&ip("198.51.100.21")].egress);
    assert_eq!(d.ips.len(), 1);
}

#[test]
fn a_service_vip_and_a_policy_ip_conflict_by_age() {
    let mut obs = cluster();
    let mut svc = service("team-a", "web", &[443], &["198.51.100.10"]);
    svc.created = Some(t(100));
    obs.services.push(svc);
    obs.policies.push(team_policy("old", 1, &["198.51.100.10"]));
    let d = desired(&obs, &local(), t(200));
    assert_eq!(d.ips[&ip("198.51.100.10")].owner, Owner::Policy("old".into()));
    assert_eq!(d.service_problems.len(), 1);
    assert_eq!(d.service_problems[0].reason, reason::IP_CONFLICT);
    assert_eq!(
        d.service_problems[0].message,
        "Service team-a/web: 198.51.100.10 is already used by EgressPolicy old (the older object keeps it)"
    );
}

#[test]
fn gateway_conditions_follow_candidates_and_leases() {
    let mut obs = cluster();
    let mut p = team_policy("nogw", 0, &["198.51.100.30"]);
    p.spec.gateway_selector = selector(json!({"matchLabels": {"zone": "nowhere"}}));
    obs.policies.push(p);
    let mut q = team_policy("zoned", 1, &["198.51.100.31"]);
    q.spec.gateway_selector = selector(json!({"matchLabels": {"zone": "x"}}));
    obs.policies.push(q);
    // An expired Lease (renewed at 0, 4 s, now 10): no live holder.
    obs.leases.insert(ip("198.51.100.31"), lease("gw-1", 0, 0));
    let d = desired(&obs, &local(), t(10));
    assert_eq!(d.ips[&ip("198.51.100.30")].candidates, Vec::<String>::new());
    assert_eq!(d.ips[&ip("198.51.100.31")].candidates, vec!["gw-1".to_string()]);
    let g = cond(&d.policy_status["nogw"], condition::GATEWAY_ASSIGNED);
    assert_eq!((g.status.as_str(), g.reason.as_str()), ("False", reason::NO_ELIGIBLE_GATEWAY));
    let r = cond(&d.policy_status["zoned"], condition::READY);
    assert_eq!((r.status.as_str(), r.reason.as_str()), ("False", reason::AWAITING_LEASE));
    assert_eq!(d.policy_status["zoned"].gateway_list, "-");
    assert_eq!(d.competing("gw-2").count(), 0);
    // Still in the tables: pods are translated as soon as someone holds it.
    assert_eq!(d.tables.policies.len(), 2);
}

#[test]
fn companion_next_hops_move_with_their_egress_ip() {
    let mut obs = cluster();
    let mut p = team_policy("public", 0, &[]);
    p.spec.egress_ips = vec![
        EgressIPSpec { ip: "203.0.113.10".into(), next_hop: Some("192.0.2.100".into()) },
        EgressIPSpec { ip: "203.0.113.11".into(), next_hop: Some("192.0.2.101".into()) },
    ];
    obs.policies.push(p);
    let mut q = team_policy("thief", 5, &[]);
    q.spec.egress_ips = vec![EgressIPSpec { ip: "203.0.113.12".into(), next_hop: Some("192.0.2.100".into()) }];
    obs.policies.push(q);
    obs.held = [ip("203.0.113.11")].into();
    let d = desired(&obs, &local(), t(1));
    assert_eq!(d.tables.egress_ips.iter().map(|e| e.ip).collect::<Vec<_>>(), vec![ip("203.0.113.11")]);
    assert_eq!(d.tables.neighbor_addresses, vec![ip("192.0.2.101")]);
    assert_eq!(d.ips[&ip("203.0.113.10")].next_hop, Some(ip("192.0.2.100")));
    assert_eq!(d.policy_status["public"].egress_ips[0].next_hop.as_deref(), Some("192.0.2.100"));
    assert_eq!(
        cond(&d.policy_status["thief"], condition::IP_ASSIGNED).message,
        "next hop 192.0.2.100 of 203.0.113.12 is already used by EgressPolicy public (the older object keeps it)"
    );
}

#[test]
fn transition_times_survive_unchanged_conditions() {
    let mut obs = cluster();
    obs.policies.push(team_policy("team-a", 0, &["198.51.100.10"]));
    obs.leases.insert(ip("198.51.100.10"), lease("gw-2", 5, 100));
    let first = desired(&obs, &local(), t(101));
    obs.policies[0].status = Some(first.policy_status["team-a"].clone());
    obs.leases.insert(ip("198.51.100.10"), lease("gw-2", 5, 103));
    let second = desired(&obs, &local(), t(104));
    assert_eq!(first.policy_status, second.policy_status, "same status: nothing to write");
    // A change of status moves the transition time.
    obs.leases.clear();
    let third = desired(&obs, &local(), t(110));
    let r = cond(&third.policy_status["team-a"], condition::READY);
    assert_eq!((r.status.as_str(), r.last_transition_time.clone()), ("False", Time(t(110))));
}

#[test]
fn a_status_written_but_not_yet_watched_keeps_its_transition_time() {
    let mut obs = cluster();
    obs.policies.push(team_policy("team-a", 0, &["198.51.100.10"]));
    obs.leases.insert(ip("198.51.100.10"), lease("gw-2", 5, 100));
    let ready = desired(&obs, &local(), t(101));
    obs.policies[0].status = Some(ready.policy_status["team-a"].clone());
    // The Lease lapses; the False status is written at 110 but the
    // object still shows True (the watch lags, or the API server is
    // down): each pass restamps False with its own second...
    obs.leases.clear();
    let written = desired(&obs, &local(), t(110)).policy_status["team-a"].clone();
    let mut later = desired(&obs, &local(), t(111)).policy_status["team-a"].clone();
    assert_ne!(later, written);
    // ...unless the written status's times are kept: then it compares
    // equal and is not sent again.
    let stored = obs.policies[0].status.as_ref().unwrap().conditions.clone();
    keep_transition_times(&mut later.conditions, &stored, &written.conditions);
    assert_eq!(later, written);
    assert_eq!(cond(&later, condition::READY).last_transition_time, Time(t(110)));
    // A condition the object shows with the same status keeps the
    // object's time; one whose status changes again gets the new second.
    let mut w = written.conditions.clone();
    w.iter_mut().for_each(|c| c.status = "Unknown".into());
    let mut again = desired(&obs, &local(), t(120)).policy_status["team-a"].clone();
    keep_transition_times(&mut again.conditions, &stored, &w);
    assert_eq!(cond(&again, condition::READY).last_transition_time, Time(t(120)));
    obs.leases.insert(ip("198.51.100.10"), lease("gw-2", 5, 125));
    let mut back = desired(&obs, &local(), t(126)).policy_status["team-a"].clone();
    keep_transition_times(&mut back.conditions, &stored, &written.conditions);
    assert_eq!(back, ready.policy_status["team-a"], "True again: the object's True since 101");
}

#[test]
fn ipv6_policies_take_ipv6_pod_addresses() {
    let mut obs = cluster();
    obs.policies.push(team_policy("dual", 0, &["198.51.100.10", "2001:db8:e::10"]));
    let d = desired(&obs, &local(), t(1));
    assert_eq!(
        d.tables.policies[0].sources,
        vec![net("198.18.0.11/32"), net("198.18.0.12/32"), net("2001:db8:18::11/128")]
    );
    assert_eq!(d.tables.policies[0].egress_ips, vec![ip("198.51.100.10"), ip("2001:db8:e::10")]);
}

#[test]
fn the_tables_compile_in_the_dataplane() {
    let mut obs = cluster();
    obs.policies.push(team_policy("team-a", 0, &["198.51.100.10"]));
    obs.services.push(service("team-a", "web", &[443], &["198.51.100.20"]));
    obs.held = [ip("198.51.100.10"), ip("198.51.100.20")].into();
    let d = desired(&obs, &local(), t(1));
    let tables = egret_dataplane::tables::Tables::compile(&d.tables, 1, &Default::default()).unwrap();
    assert_eq!(tables.errors, vec![]);
    assert_eq!(tables.policies.len(), 2);
    assert!(tables.owns_egress(ip("198.51.100.20")));
}

/// The nodes' tunnel accepts every Node's InternalIPs, both families,
/// each once, and is absent when `tunnel.enabled: false`.
#[test]
fn the_tunnel_accepts_every_nodes_internal_ips() {
    let mut obs = cluster();
    let node = |name: &str, ips: &[&str]| NodeInfo {
        name: name.into(),
        labels: labels(&[]),
        internal_ips: ips.iter().map(|s| ip(s)).collect(),
        provider_id: None,
    };
    obs.nodes = vec![
        node("w1", &["192.0.2.31", "2001:db8:2::31"]),
        node("w2", &["198.51.100.32"]),
        node("gw-1", &["192.0.2.11"]),
        node("no-address-yet", &[]),
    ];
    let on = LocalConfig { tunnel_port: Some(6082), ..local() };
    let tunnel = desired(&obs, &on, t(1)).tables.tunnel.expect("tunnel on");
    assert_eq!(tunnel.port, 6082);
    assert_eq!(
        tunnel.nodes,
        ["192.0.2.11", "192.0.2.31", "198.51.100.32", "2001:db8:2::31"].iter().map(|s| ip(s)).collect::<Vec<_>>()
    );
    assert_eq!(desired(&obs, &local(), t(1)).tables.tunnel, None);
}

/// What the gateways keep of a Node: name, labels, InternalIPs.
#[test]
fn nodes_are_trimmed_to_name_labels_internal_ips_and_provider_id() {
    use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeSpec, NodeStatus, NodeSystemInfo};
    let mut n = Node::default();
    n.metadata.name = Some("w1".into());
    n.metadata.labels = Some([("zone".to_string(), "a".to_string())].into());
    n.metadata.annotations = Some([("big".to_string(), "x".repeat(4096))].into());
    n.spec = Some(NodeSpec {
        provider_id: Some("aws:///us-east-1a/i-0abc".into()),
        pod_cidr: Some("10.244.1.0/24".into()),
        ..Default::default()
    });
    let addr = |t: &str, a: &str| NodeAddress { type_: t.into(), address: a.into() };
    n.status = Some(NodeStatus {
        addresses: Some(vec![
            addr("InternalIP", "192.0.2.31"),
            addr("Hostname", "w1"),
            addr("ExternalIP", "203.0.113.9"),
        ]),
        node_info: Some(NodeSystemInfo { kernel_version: "6.18".into(), ..Default::default() }),
        ..Default::default()
    });
    crate::k8s::observe::trim_node(&mut n);
    let info = crate::k8s::observe::node(&n);
    assert_eq!((info.name.as_str(), info.internal_ips), ("w1", vec![ip("192.0.2.31")]));
    assert_eq!(info.labels, labels(&[("zone", "a")]));
    assert_eq!(info.provider_id.as_deref(), Some("aws:///us-east-1a/i-0abc"));
    assert_eq!(n.spec.as_ref().and_then(|s| s.pod_cidr.as_deref()), None);
    assert_eq!(n.metadata.annotations, None);
    assert_eq!(n.status.and_then(|s| s.node_info), None);
}

/// A `PerNode` policy on a cloud pool (ADR 0033): each selected Node is
/// allocated a public address; the status writer's task is asked to
/// associate it once recorded; the record gains the private address only
/// once associated, and only then does the Node translate to it.
#[test]
fn a_per_node_cloud_pool_gives_each_node_a_public_address_on_its_own_interface() {
    use crate::cloud::{CloudError, NodeAddress, Provider};
    let rec = |p: &str, a: &str, private: &str| CloudAddressStatus {
        public_ip: p.into(),
        allocation_id: a.into(),
        private_ip: private.into(),
    };
    let mut obs = cluster();
    let node = |name: &str, l: &[(&str, &str)], provider_id: &str| NodeInfo {
        provider_id: Some(provider_id.into()),
        ..gw(name, l)
    };
    obs.nodes = vec![
        node("gw-1", &[], "aws:///z/i-gw1"),
        node("w1", &[("egress", "static")], "aws:///z/i-w1"),
        node("w2", &[("egress", "static")], "aws:///z/i-w2"),
        node("w3", &[], "aws:///z/i-w3"),
    ];
    obs.pools.push(PoolInfo {
        name: "eips".into(),
        generation: Some(1),
        spec: EgressIPPoolSpec {
            cloud: Some(aws_pool(&[("egret.dev/pool", "nodes")], "subnet-0a1b")),
            ..Default::default()
        },
        status: Some(EgressIPPoolStatus {
            cloud_addresses: vec![
                rec("192.0.2.200", "eipalloc-1", "203.0.113.41"),
                rec("192.0.2.201", "eipalloc-2", "203.0.113.42"),
            ],
            ..Default::default()
        }),
    });
    let mut p = team_policy("static-nodes", 0, &[]);
    p.spec.mode = Some(super::super::crd::PolicyMode::PerNode);
    p.spec.pool = Some(PoolRef { name: "eips".into(), count: None });
    p.spec.node_selector = selector(json!({"matchLabels": {"egress": "static"}}));
    obs.policies.push(p);

    // Round 1: a public address proposed per selected Node; nothing to
    // associate before it is recorded.
    let d = desired(&obs, &local(), t(10));
    let allocs = &d.pool_status["eips"].allocations;
    let by_node: Vec<(&str, &str)> = allocs.iter().map(|a| (a.node.as_deref().unwrap(), a.ips[0].as_str())).collect();
    assert_eq!(by_node, vec![("w1", "192.0.2.200"), ("w2", "192.0.2.201")]);
    assert!(allocs.iter().all(|a| a.private_ip.is_none()));
    assert!(d.node_cloud.want.is_empty());

    // Round 2: recorded; the writer's task is asked for both, with each
    // Node's providerID and the Elastic IP's allocation; the policy waits.
    obs.pools[0].status.as_mut().unwrap().allocations = allocs.clone();
    let d = desired(&obs, &local(), t(11));
    let key = ("w1".to_string(), ip("192.0.2.200"));
    let want = &d.node_cloud.want[&key];
    assert_eq!((want.provider, want.provider_id.as_str()), (Provider::Aws, "aws:///z/i-w1"));
    assert_eq!(want.public.allocation_id, "eipalloc-1");
    assert_eq!(want.recorded, None);
    assert_eq!(d.node_cloud.want.len(), 2);
    let c = cond(&d.policy_status["static-nodes"], condition::IP_ASSIGNED);
    assert_eq!(c.reason, reason::ALLOCATION_PENDING, "{c:?}");
    assert!(
        c.message.contains("waiting for the cloud provider to associate 192.0.2.200 with Node w1"),
        "{}",
        c.message
    );
    assert!(d.per_node["egresspolicy/static-nodes"].is_empty(), "nothing to translate to yet");

    // The task associated w1's (w2's failed): the status records w1's
    // private address, and says why w2 waits.
    let at = NodeAddress { interface_id: "eni-w1".into(), private_ip: ip("10.1.7.33") };
    obs.node_cloud.insert(key.clone(), Ok(at.clone()));
    let fail = CloudError {
        operation: "AssociateAddress",
        code: "RequestLimitExceeded".into(),
        message: "slow down".into(),
        retryable: true,
    };
    obs.node_cloud.insert(("w2".to_string(), ip("192.0.2.201")), Err(fail));
    let d = desired(&obs, &local(), t(12));
    let w1 = d.pool_status["eips"].allocations.iter().find(|a| a.node.as_deref() == Some("w1")).unwrap();
    assert_eq!((w1.private_ip.as_deref(), w1.interface_id.as_deref()), (Some("10.1.7.33"), Some("eni-w1")));
    let c = cond(&d.policy_status["static-nodes"], condition::IP_ASSIGNED);
    assert_eq!(c.reason, reason::CLOUD_API_ERROR);
    assert!(c.message.contains("192.0.2.201 with Node w2: AssociateAddress: RequestLimitExceeded"), "{}", c.message);

    // Recorded: w1's agent translates its pods to the private address, and
    // the policy's status names the public one.
    obs.pools[0].status.as_mut().unwrap().allocations = d.pool_status["eips"].allocations.clone();
    obs.node_cloud.clear();
    let d = desired(&obs, &local(), t(13));
    assert_eq!(d.per_node["egresspolicy/static-nodes"]["w1"], vec![ip("10.1.7.33")]);
    assert_eq!(d.node_cloud.want[&key].recorded, Some(at.clone()));
    let e = d.policy_status["static-nodes"].egress_ips.iter().find(|e| e.node.as_deref() == Some("w1")).unwrap();
    assert_eq!((e.ip.as_str(), e.public_ip.as_deref()), ("10.1.7.33", Some("192.0.2.200")));
    let agent = LocalConfig { node_name: "w1".into(), role: Role::Node, ..local() };
    let da = desired(&obs, &agent, t(13));
    let spec = da.tables.policies.iter().find(|p| p.name == "egresspolicy/static-nodes").expect("in w1's tables");
    assert_eq!(spec.egress_ips, vec![ip("10.1.7.33")]);

    // w1 leaves the selection: no longer wanted, so the task releases the
    // recorded association; the allocation goes from the status.
    obs.nodes[1].labels = labels(&[]);
    let d = desired(&obs, &local(), t(14));
    assert!(!d.node_cloud.want.contains_key(&key));
    assert_eq!(d.node_cloud.recorded[&key], (Provider::Aws, at));
    assert!(d.pool_status["eips"].allocations.iter().all(|a| a.node.as_deref() != Some("w1")));

    // A gateway policy naming the same cloud pool is refused, naming the
    // PerNode policy that uses it.
    let mut g = team_policy("gateway-pooled", 5, &[]);
    g.spec.pool = Some(PoolRef { name: "eips".into(), count: Some(1) });
    obs.policies.push(g);
    let d = desired(&obs, &local(), t(15));
    let c = cond(&d.policy_status["gateway-pooled"], condition::IP_ASSIGNED);
    assert_eq!(c.reason, reason::POOL_NOT_USABLE);
    assert!(c.message.contains("serving PerNode policy static-nodes"), "{}", c.message);
}
