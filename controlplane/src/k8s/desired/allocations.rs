//! New pool allocations: proposed in the pool's status, used once recorded
//! there (so that every gateway uses the same addresses).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use super::claims::Claimed;
use super::per_node::{allocate_for_nodes, NodeCloud, PerNodeTargets};
use super::pools::Pools;
use super::sources::Source;
use super::Owner;
use crate::k8s::crd::{reason, PoolAllocation};
use crate::k8s::pool::Pool;

/// The allocations to write into the pools' status, and who found a pool
/// short of addresses.
#[derive(Debug, Default)]
pub(super) struct NewAllocations {
    /// Pool name -> its allocations (recorded and new), in source order.
    pub(super) allocations: BTreeMap<String, Vec<PoolAllocation>>,
    /// Pool name -> the policies it has too few addresses for.
    pub(super) exhausted: BTreeMap<String, Vec<String>>,
}

/// Phase "new pool allocations": each valid policy naming a usable pool
/// keeps what it was granted and is allocated what it still lacks.
pub(super) fn allocate(
    sources: &mut [Source],
    pools: &Pools<'_>,
    targets: &PerNodeTargets<'_>,
    node_cloud: &NodeCloud,
    claimed: &mut Claimed,
) -> NewAllocations {
    let mut out = NewAllocations::default();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        let (Some((pool_name, count)), Owner::Policy(name)) = (s.pool.clone(), s.owner.clone()) else { continue };
        let Some((info, Ok(pool))) = pools.get(pool_name.as_str()) else { continue };
        if s.per_node.is_some() {
            allocate_for_nodes(s, (&pool_name, &name, info, pool), targets, node_cloud, claimed, &mut out);
            continue;
        }
        allocate_from_pool(s, (pool_name, name, pool), count, claimed, &mut out);
    }
    out
}

/// A policy's allocation from its pool: what it was granted, and up to
/// `count` in all from the free addresses (with their next hops).
fn allocate_from_pool(
    s: &mut Source,
    (pool_name, name, pool): (String, String, &Pool),
    count: usize,
    claimed: &mut Claimed,
    out: &mut NewAllocations,
) {
    let mut ips: Vec<IpAddr> = s.granted.iter().map(|(ip, _)| *ip).collect();
    if ips.len() < count {
        let taken: BTreeSet<IpAddr> = claimed.keys().copied().collect();
        let new = pool.addresses.allocate(count - ips.len(), &taken);
        for ip in &new {
            claimed.insert(*ip, s.owner.clone());
            if let Some(n) = pool.next_hop_of(*ip) {
                claimed.insert(n, s.owner.clone());
            }
        }
        if ips.len() + new.len() < count {
            out.exhausted.entry(pool_name.clone()).or_default().push(name.clone());
            s.problem(
                reason::POOL_EXHAUSTED,
                format!(
                    "EgressIPPool {pool_name} has {} free address(es), the policy asks for {count}: add addresses to the pool or lower spec.pool.count",
                    new.len()
                ),
            );
        } else if !new.is_empty() {
            s.problem(
                reason::ALLOCATION_PENDING,
                format!("allocated {} from EgressIPPool {pool_name}; waiting for the allocation to be recorded in its status", join(&new)),
            );
        }
        ips.extend(new);
    }
    ips.sort();
    if !ips.is_empty() {
        out.allocations.entry(pool_name).or_default().push(PoolAllocation {
            policy: name,
            ips: ips.iter().map(|i| i.to_string()).collect(),
            node: None,
            ..Default::default()
        });
    }
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}
