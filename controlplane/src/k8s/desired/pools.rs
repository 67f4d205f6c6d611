//! Pools: parsed, their recorded allocations, and the policies' requests
//! that follow from those.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::sources::{parse_selector, Source};
use super::{Observed, Owner, PoolInfo};
use crate::cloud::{cloud_spec, CloudError, Discovered};
use crate::k8s::crd::{reason, Cause, PoolCloudSpec};
use crate::k8s::pool::Pool;

/// A pool parsed, or why it cannot be used.
pub(super) type ParsedPool = Result<Pool, Cause>;

/// Every pool by name, with what parsing it gave.
pub(super) type Pools<'a> = BTreeMap<&'a str, (&'a PoolInfo, ParsedPool)>;

/// The allocations recorded in the pools' status (not `PerNode` ones):
/// (pool, policy) -> addresses.
pub(super) type RecordedAllocations<'a> = BTreeMap<(&'a str, &'a str), Vec<IpAddr>>;

/// Phase "pools: parse": every pool, parsed (a cloud pool from its recorded
/// pairing).
pub(super) fn parse_pools(obs: &Observed) -> Pools<'_> {
    obs.pools
        .iter()
        .map(|p| {
            let parsed = match &p.spec.cloud {
                Some(cloud) => cloud_pool(p, cloud, obs.cloud.get(&p.name)),
                None => Pool::parse(&p.spec.addresses, &p.spec.next_hops)
                    .map_err(|e| Cause::new(reason::INVALID_ADDRESS, format!("spec.{e}"))),
            }
            .and_then(|pool| {
                parse_selector("spec.gatewaySelector", &p.spec.gateway_selector)
                    .map(|_| pool)
                    .map_err(|e| Cause::new(reason::INVALID_SPEC, e.to_string()))
            });
            (p.name.as_str(), (p, parsed))
        })
        .collect()
}

/// The allocations recorded in `pools`' status, by (pool, policy).
pub(super) fn recorded_allocations(pools: &[PoolInfo]) -> RecordedAllocations<'_> {
    pools
        .iter()
        .flat_map(|p| {
            p.status.iter().flat_map(|s| s.allocations.iter()).filter(|a| a.node.is_none()).map(move |a| {
                let ips = a.ips.iter().filter_map(|i| i.parse().ok()).collect();
                ((p.name.as_str(), a.policy.as_str()), ips)
            })
        })
        .collect()
}

/// Phase "recorded pool allocations become requests": each valid policy
/// naming a pool requests its recorded addresses (and takes the pool's
/// gateway selector), or is told why the pool cannot serve it.
pub(super) fn request_recorded(sources: &mut [Source], pools: &Pools<'_>, recorded: &RecordedAllocations<'_>) {
    // Cloud pools: the first policy naming each (oldest first), and whether
    // it is PerNode. A cloud pool serves one kind: a gateway policy's
    // address is a private address of the gateways' subnet paired with a
    // public one, a Node's is the public one associated on its own interface.
    let mut cloud_users: BTreeMap<String, (String, bool)> = BTreeMap::new();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        let (Some((pool_name, count)), Owner::Policy(name)) = (s.pool.clone(), s.owner.clone()) else { continue };
        match pools.get(pool_name.as_str()) {
            None => s.problem(reason::POOL_NOT_FOUND, format!("EgressIPPool {pool_name} does not exist")),
            Some((_, Err(Cause { message: m, .. }))) => {
                s.problem(reason::POOL_NOT_USABLE, format!("EgressIPPool {pool_name} cannot be used: {m}"))
            }
            Some((info, Ok(_))) if info.spec.cloud.is_some() && other_kind(&mut cloud_users, &pool_name, &name, s.per_node.is_some()).is_some() => {
                let (first, per_node) = &cloud_users[&pool_name];
                let kind = |p: bool| if p { "PerNode" } else { "gateway" };
                s.problem(
                    reason::POOL_NOT_USABLE,
                    format!(
                        "EgressIPPool {pool_name} is a cloud pool serving {} policy {first}: a cloud pool serves either PerNode policies or gateway policies; use another pool",
                        kind(*per_node)
                    ),
                )
            }
            Some((info, Ok(_))) if s.per_node.is_some() && cloud_ipv6(info) => s.problem(
                reason::POOL_NOT_USABLE,
                format!(
                    "EgressIPPool {pool_name} is an IPv6 cloud pool: its addresses move with gateways' Leases; a PerNode policy needs a pool of public addresses found by tag"
                ),
            ),
            Some((_, Ok(_))) if s.per_node.is_some() => {}
            Some((info, Ok(pool))) => {
                if let Some(ips) = recorded.get(&(pool_name.as_str(), name.as_str())) {
                    s.requested = ips
                        .iter()
                        .filter(|ip| pool.addresses.contains(**ip))
                        .take(count)
                        .map(|ip| (*ip, pool.next_hop_of(*ip)))
                        .collect();
                }
                if s.gateway_selector.is_none() {
                    s.gateway_selector = parse_selector("", &info.spec.gateway_selector).ok().flatten();
                } else if let Ok(Some(pool_sel)) = parse_selector("", &info.spec.gateway_selector) {
                    if let Some(sel) = s.gateway_selector.as_mut() {
                        sel.extend(pool_sel);
                    }
                }
            }
        }
    }
}

/// Records `policy` as a user of cloud pool `pool` if it is the first;
/// returns the first user when it is of the other kind.
fn other_kind<'m>(
    users: &'m mut BTreeMap<String, (String, bool)>,
    pool: &str,
    policy: &str,
    per_node: bool,
) -> Option<&'m (String, bool)> {
    let first = users.entry(pool.to_string()).or_insert_with(|| (policy.to_string(), per_node));
    (first.1 != per_node).then_some(&*first)
}

/// Whether a pool is an IPv6 cloud pool (a valid spec).
fn cloud_ipv6(info: &PoolInfo) -> bool {
    info.spec.cloud.as_ref().and_then(|c| cloud_spec(c, &info.spec.addresses).ok()).is_some_and(|(sel, _)| sel.ipv6)
}

/// A cloud pool: its addresses are the private halves of the pairing
/// recorded in its status (the one every gateway agrees on), usable while
/// the provider cannot be asked. Without a recorded pairing it cannot be
/// used yet, and says why.
fn cloud_pool(p: &PoolInfo, cloud: &PoolCloudSpec, found: Option<&Result<Discovered, CloudError>>) -> ParsedPool {
    if !p.spec.next_hops.is_empty() {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            "spec.nextHops: not used with spec.cloud (the provider routes the addresses)",
        ));
    }
    let (sel, _) = cloud_spec(cloud, &p.spec.addresses)?;
    if sel.ipv6 {
        // Its own addresses move with their Leases: usable at once (an
        // address outside the subnet's IPv6 range is refused by the
        // provider, and the pool's CloudSynced says so).
        return Pool::parse(&p.spec.addresses, &[])
            .map_err(|e| Cause::new(reason::INVALID_ADDRESS, format!("spec.{e}")));
    }
    let recorded: Vec<String> = p
        .status
        .iter()
        .flat_map(|st| st.cloud_addresses.iter())
        .filter(|a| a.private_ip.parse::<IpAddr>().is_ok())
        .map(|a| a.private_ip.clone())
        .collect();
    if !recorded.is_empty() {
        return Pool::parse(&recorded, &[])
            .map_err(|e| Cause::new(reason::INVALID_ADDRESS, format!("status.cloudAddresses: {e}")));
    }
    let tags = sel.tags.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ");
    Err(match found {
        None => Cause::new(reason::CLOUD_DISCOVERING, "waiting for the first answer from the cloud provider"),
        Some(Err(e)) => Cause::new(reason::CLOUD_API_ERROR, format!("the cloud provider failed: {e}")),
        Some(Ok(f)) if f.public.is_empty() => {
            Cause::new(reason::NO_CLOUD_ADDRESSES, format!("no Elastic IP carries the tags {tags}"))
        }
        Some(Ok(_)) => Cause::new(reason::CLOUD_DISCOVERING, "Elastic IPs found; their pairing is not recorded yet"),
    })
}
