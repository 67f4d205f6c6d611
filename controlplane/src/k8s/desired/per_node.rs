//! `PerNode` policies: one address per Node (and family) from a pool,
//! recorded in the pool's status like any allocation.
//!
//! A cloud pool (ADR 0033) gives each Node one of its public addresses; the
//! status writer's cloud task associates it with a private address on the
//! Node's own interface ([`crate::cloud::node_addresses`]) and the record
//! gains that address, which the Node's pods are then translated to. Until
//! then the Node has the public address allocated but nothing granted.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kube::core::Selector;

use super::allocations::NewAllocations;
use super::claims::Claimed;
use super::pools::Pools;
use super::sources::{selects, Source};
use super::{NodeInfo, Observed, Owner, PoolInfo};
use crate::cloud::node_addresses::{NodeTarget, NodeWants};
use crate::cloud::{cloud_spec, NodeAddress, Provider, PublicAddress};
use crate::k8s::crd::{reason, PoolAllocation};
use crate::k8s::pool::Pool;

/// One Node's recorded allocation of a `PerNode` policy.
#[derive(Clone, Debug, Default)]
pub(super) struct NodeRecord {
    /// Its addresses (a cloud pool's: the public address).
    pub(super) ips: Vec<IpAddr>,
    /// A cloud pool's: where the provider associated it, once it did.
    pub(super) cloud: Option<NodeAddress>,
}

/// The `PerNode` allocations recorded in the pools' status:
/// (pool, policy) -> Node -> its record.
pub(super) type RecordedNodeAllocations<'a> = BTreeMap<(&'a str, &'a str), BTreeMap<&'a str, NodeRecord>>;

/// The worker Nodes' cloud addresses as the status writer's task last saw
/// them ([`Observed::node_cloud`]).
pub(super) type NodeCloud = super::NodeCloudObserved;

/// The Nodes `PerNode` policies can target: every Node that is not a gateway.
pub(super) struct PerNodeTargets<'a> {
    /// Gateway Nodes by name (never targets).
    gateways: BTreeSet<&'a str>,
    /// Every Node.
    nodes: &'a [NodeInfo],
}

impl PerNodeTargets<'_> {
    /// The target Nodes `sel` selects, by name.
    pub(super) fn selected(&self, sel: &Option<Selector>) -> Vec<String> {
        let mut v: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| !self.gateways.contains(n.name.as_str()) && selects(sel, &n.labels))
            .map(|n| n.name.clone())
            .collect();
        v.sort();
        v
    }
}

/// Phase "PerNode allocations": the recorded ones, by (pool, policy), then
/// Node.
pub(super) fn recorded_node_allocations(pools: &[PoolInfo]) -> RecordedNodeAllocations<'_> {
    let mut recorded_nodes: RecordedNodeAllocations<'_> = BTreeMap::new();
    for p in pools {
        for a in p.status.iter().flat_map(|s| s.allocations.iter()) {
            if let Some(node) = &a.node {
                let ips = a.ips.iter().filter_map(|i| i.parse().ok()).collect();
                let record = NodeRecord { ips, cloud: recorded_cloud(a) };
                recorded_nodes.entry((p.name.as_str(), a.policy.as_str())).or_default().insert(node.as_str(), record);
            }
        }
    }
    recorded_nodes
}

/// A cloud pool's recorded Node allocation: where its public address is
/// associated (both fields parse), or nothing.
fn recorded_cloud(a: &PoolAllocation) -> Option<NodeAddress> {
    Some(NodeAddress { interface_id: a.interface_id.clone()?, private_ip: a.private_ip.as_deref()?.parse().ok()? })
}

/// The addresses a `PerNode` policy takes from `pool`: a cloud pool's
/// public addresses (the recorded pairing's), else the pool's own.
pub(super) fn node_pool<'p>(info: &PoolInfo, pool: &'p Pool) -> Option<Cow<'p, Pool>> {
    if info.spec.cloud.is_none() {
        return Some(Cow::Borrowed(pool));
    }
    let public: Vec<String> =
        info.status.iter().flat_map(|st| st.cloud_addresses.iter()).map(|a| a.public_ip.clone()).collect();
    Pool::parse(&public, &[]).ok().map(Cow::Owned)
}

/// Phase "PerNode targets": Nodes that are not gateways.
pub(super) fn per_node_targets(obs: &Observed) -> PerNodeTargets<'_> {
    PerNodeTargets { gateways: obs.gateways.iter().map(|g| g.name.as_str()).collect(), nodes: &obs.nodes }
}

/// A `PerNode` policy's recorded addresses, claimed Node by Node (at most
/// one per family, only those still in the pool) into its `node_grants`.
/// Returns the conflicts (an address an older object holds).
pub(super) fn claim_node_addresses(
    s: &mut Source,
    pools: &Pools<'_>,
    recorded_nodes: &RecordedNodeAllocations<'_>,
    targets: &PerNodeTargets<'_>,
    claimed: &mut Claimed,
) -> Vec<String> {
    let mut conflicts = Vec::new();
    if let (Some(sel), Some((pool_name, _)), Owner::Policy(name)) = (&s.per_node, &s.pool, &s.owner) {
        if let (Some(rec), Some((info, Ok(pool)))) =
            (recorded_nodes.get(&(pool_name.as_str(), name.as_str())), pools.get(pool_name.as_str()))
        {
            let Some(pool) = node_pool(info, pool) else { return conflicts };
            let cloud = info.spec.cloud.is_some();
            for node in targets.selected(sel) {
                let Some(record) = rec.get(node.as_str()) else { continue };
                // At most one recorded address per family.
                let mut seen = (false, false);
                for ip in record.ips.iter().filter(|ip| pool.addresses.contains(**ip)) {
                    let fam = if ip.is_ipv4() { &mut seen.0 } else { &mut seen.1 };
                    if std::mem::replace(fam, true) {
                        continue;
                    }
                    if let Some(o) = claimed.get(ip).filter(|o| **o != s.owner) {
                        conflicts.push(format!("{ip} (for Node {node}) is already used by {o}"));
                        continue;
                    }
                    claimed.insert(*ip, s.owner.clone());
                    s.node_claims.entry(node.clone()).or_default().push(*ip);
                    // A cloud pool's Node translates to the private address
                    // its public one stands for, once the provider made it.
                    let granted = if cloud { record.cloud.as_ref().map(|c| c.private_ip) } else { Some(*ip) };
                    if let Some(g) = granted {
                        s.node_grants.entry(node.clone()).or_default().push(g);
                    }
                    if let Some(c) = record.cloud.as_ref().filter(|_| cloud) {
                        s.node_cloud.insert((node.clone(), *ip), c.clone());
                    }
                }
            }
            s.node_grants.values_mut().for_each(|v| v.sort());
        }
    }
    conflicts
}

/// A `PerNode` policy's new allocations: for each target Node, an address
/// of each family the pool has that the Node has not been granted yet
/// (proposed in the pool's status, used once recorded). Nothing for a
/// source that is not `PerNode`.
pub(super) fn allocate_for_nodes(
    s: &mut Source,
    (pool_name, name, info, pool): (&str, &str, &PoolInfo, &Pool),
    targets: &PerNodeTargets<'_>,
    node_cloud: &NodeCloud,
    claimed: &mut Claimed,
    out: &mut NewAllocations,
) {
    let Some(sel) = &s.per_node else { return };
    let Some(pool) = node_pool(info, pool) else { return };
    let cloud = info.spec.cloud.is_some();
    let nodes = targets.selected(sel);
    let mut new = Vec::new();
    let mut unassociated = Vec::new();
    let mut short = false;
    let (has_v4, has_v6) = pool.addresses.families();
    for node in nodes {
        // One address per family the pool has.
        let mut ips = s.node_claims.get(&node).cloned().unwrap_or_default();
        for v6 in [false, true].into_iter().filter(|v6| if *v6 { has_v6 } else { has_v4 }) {
            if ips.iter().any(|ip| ip.is_ipv6() == v6) {
                continue;
            }
            let taken: BTreeSet<IpAddr> = claimed.keys().copied().collect();
            match pool.addresses.allocate_one(v6, &taken) {
                Some(ip) => {
                    claimed.insert(ip, s.owner.clone());
                    new.push(format!("{ip} for Node {node}"));
                    ips.push(ip);
                }
                None => short = true,
            }
        }
        ips.sort();
        if ips.is_empty() {
            continue;
        }
        let mut record = PoolAllocation {
            policy: name.to_string(),
            ips: ips.iter().map(|i| i.to_string()).collect(),
            node: Some(node.clone()),
            ..Default::default()
        };
        if cloud {
            match cloud_address(s, &node, &ips, node_cloud) {
                Ok(at) => {
                    record.private_ip = Some(at.private_ip.to_string());
                    record.interface_id = Some(at.interface_id);
                }
                Err(why) => unassociated.push(why),
            }
        }
        out.allocations.entry(pool_name.to_string()).or_default().push(record);
    }
    if short {
        out.exhausted.entry(pool_name.to_string()).or_default().push(name.to_string());
        s.problem(
            reason::POOL_EXHAUSTED,
            format!("EgressIPPool {pool_name} has no free address for some selected Nodes: add addresses to the pool"),
        );
    } else if !new.is_empty() {
        s.problem(
            reason::ALLOCATION_PENDING,
            format!(
                "allocated {} from EgressIPPool {pool_name}; waiting for the allocation to be recorded in its status",
                new.join(", ")
            ),
        );
    } else if !unassociated.is_empty() {
        let failed = unassociated.iter().any(|(_, e)| e.is_some());
        let words: Vec<String> = unassociated
            .into_iter()
            .map(|(what, e)| match e {
                Some(e) => format!("{what}: {e}"),
                None => what,
            })
            .collect();
        let (r, verb) = if failed {
            (reason::CLOUD_API_ERROR, "the cloud provider has not associated")
        } else {
            (reason::ALLOCATION_PENDING, "waiting for the cloud provider to associate")
        };
        s.problem(r, format!("{verb} {} (EgressIPPool {pool_name})", words.join("; ")));
    }
}

/// Where a cloud pool's public address for `node` is associated: the
/// status writer's task's answer, else the record (kept through a
/// retryable failure: the provider still has it; dropped when the private
/// address is someone else's now). Err: why not yet, and the failure.
fn cloud_address(
    s: &Source,
    node: &str,
    ips: &[IpAddr],
    node_cloud: &NodeCloud,
) -> Result<NodeAddress, (String, Option<String>)> {
    let public = ips.iter().copied().find(IpAddr::is_ipv4).unwrap_or(ips[0]);
    let key = (node.to_string(), public);
    let recorded = s.node_cloud.get(&key);
    match (node_cloud.get(&key), recorded) {
        (Some(Ok(at)), _) => Ok(at.clone()),
        (Some(Err(e)), Some(at)) if e.code != crate::cloud::HELD_ELSEWHERE => Ok(at.clone()),
        (None, Some(at)) => Ok(at.clone()),
        (Some(Err(e)), _) => Err((format!("{public} with Node {node}"), Some(e.to_string()))),
        (None, None) => Err((format!("{public} with Node {node}"), None)),
    }
}

/// What the status writer's cloud task must do for the worker Nodes of
/// `PerNode` cloud pools: the recorded allocations (a new one is made once
/// recorded, so every gateway agrees on it), and every address recorded as
/// associated (one no longer wanted is released).
pub(super) fn node_cloud_wants(obs: &Observed, sources: &[Source], pools: &Pools<'_>) -> NodeWants {
    let mut out = NodeWants::default();
    let provider_ids: BTreeMap<&str, &str> =
        obs.nodes.iter().filter_map(|n| Some((n.name.as_str(), n.provider_id.as_deref()?))).collect();
    for p in &obs.pools {
        let Some(provider) = cloud_provider(p) else { continue };
        for a in p.status.iter().flat_map(|st| st.allocations.iter()) {
            let (Some(node), Some(at), Some(public)) =
                (&a.node, recorded_cloud(a), a.ips.first().and_then(|i| i.parse().ok()))
            else {
                continue;
            };
            out.recorded.insert((node.clone(), public), (provider, at));
        }
    }
    for s in sources.iter().filter(|s| s.invalid.is_none() && s.per_node.is_some()) {
        let Some((pool_name, _)) = &s.pool else { continue };
        let Some((info, Ok(_))) = pools.get(pool_name.as_str()) else { continue };
        let Some(provider) = cloud_provider(info) else { continue };
        for (node, ips) in &s.node_claims {
            for public in ips.iter().filter(|ip| ip.is_ipv4()) {
                let key = (node.clone(), *public);
                out.want.insert(
                    key.clone(),
                    NodeTarget {
                        provider,
                        provider_id: provider_ids.get(node.as_str()).map(|p| p.to_string()).unwrap_or_default(),
                        public: public_address(obs, info, *public),
                        recorded: s.node_cloud.get(&key).cloned(),
                    },
                );
            }
        }
    }
    out
}

/// A cloud pool's provider (a valid spec), or None.
fn cloud_provider(p: &PoolInfo) -> Option<Provider> {
    let cloud = p.spec.cloud.as_ref()?;
    cloud_spec(cloud, &p.spec.addresses).ok().map(|(sel, _)| sel.provider)
}

/// The public address `ip` of a cloud pool: discovery's view of it (with
/// its current association) when there is one, else the recorded pairing's.
fn public_address(obs: &Observed, info: &PoolInfo, ip: IpAddr) -> PublicAddress {
    if let Some(Ok(found)) = obs.cloud.get(&info.name) {
        if let Some(p) = found.public.iter().find(|p| p.public_ip == ip) {
            return p.clone();
        }
    }
    let allocation_id = info
        .status
        .iter()
        .flat_map(|st| st.cloud_addresses.iter())
        .find(|a| a.public_ip.parse() == Ok(ip))
        .map(|a| a.allocation_id.clone())
        .unwrap_or_default();
    PublicAddress { public_ip: ip, allocation_id, private_ip: None, interface_id: None }
}
