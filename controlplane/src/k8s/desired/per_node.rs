//! `PerNode` policies: one address per Node (and family) from a pool,
//! recorded in the pool's status like any allocation.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kube::core::Selector;

use super::allocations::NewAllocations;
use super::claims::Claimed;
use super::pools::Pools;
use super::sources::{selects, Source};
use super::{NodeInfo, Observed, Owner, PoolInfo};
use crate::k8s::crd::{reason, PoolAllocation};
use crate::k8s::pool::Pool;

/// The `PerNode` allocations recorded in the pools' status:
/// (pool, policy) -> Node -> its addresses.
pub(super) type RecordedNodeAllocations<'a> = BTreeMap<(&'a str, &'a str), BTreeMap<&'a str, Vec<IpAddr>>>;

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
                recorded_nodes.entry((p.name.as_str(), a.policy.as_str())).or_default().insert(node.as_str(), ips);
            }
        }
    }
    recorded_nodes
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
        if let (Some(rec), Some((_, Ok(pool)))) =
            (recorded_nodes.get(&(pool_name.as_str(), name.as_str())), pools.get(pool_name.as_str()))
        {
            for node in targets.selected(sel) {
                // At most one recorded address per family.
                let mut seen = (false, false);
                for ip in rec.get(node.as_str()).into_iter().flatten().filter(|ip| pool.addresses.contains(**ip)) {
                    let fam = if ip.is_ipv4() { &mut seen.0 } else { &mut seen.1 };
                    if std::mem::replace(fam, true) {
                        continue;
                    }
                    match claimed.get(ip).filter(|o| **o != s.owner) {
                        Some(o) => conflicts.push(format!("{ip} (for Node {node}) is already used by {o}")),
                        None => {
                            claimed.insert(*ip, s.owner.clone());
                            s.node_grants.entry(node.clone()).or_default().push(*ip);
                        }
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
    (pool_name, name, pool): (&str, &str, &Pool),
    targets: &PerNodeTargets<'_>,
    claimed: &mut Claimed,
    out: &mut NewAllocations,
) {
    let Some(sel) = &s.per_node else { return };
    let nodes = targets.selected(sel);
    let mut new = Vec::new();
    let mut short = false;
    let (has_v4, has_v6) = pool.addresses.families();
    for node in nodes {
        // One address per family the pool has.
        let mut ips = s.node_grants.get(&node).cloned().unwrap_or_default();
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
        if !ips.is_empty() {
            out.allocations.entry(pool_name.to_string()).or_default().push(PoolAllocation {
                policy: name.to_string(),
                ips: ips.iter().map(|i| i.to_string()).collect(),
                node: Some(node),
            });
        }
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
    }
}
