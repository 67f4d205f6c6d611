//! Claims, oldest first: egress IPs and next hops share one namespace, and
//! an address goes to the oldest source asking for it.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::per_node::{claim_node_addresses, PerNodeTargets, RecordedNodeAllocations};
use super::pools::Pools;
use super::sources::Source;
use super::{Owner, ServiceProblem};
use crate::k8s::crd::reason;

/// Every address claimed so far (egress IPs and next hops), by its owner.
pub(super) type Claimed = BTreeMap<IpAddr, Owner>;

/// What the claims gave: the addresses taken, and the conflicts of annotated
/// Services (reported as Events).
pub(super) struct Claims {
    /// Addresses taken, by owner.
    pub(super) claimed: Claimed,
    /// Conflicts of annotated Services.
    pub(super) conflicts: Vec<ServiceProblem>,
}

/// Phase "claims, oldest first": each valid source, in order, takes the
/// addresses it requested (and a `PerNode` policy its recorded Node
/// addresses) that no older source took; the others are its conflicts.
pub(super) fn claim(
    sources: &mut [Source],
    pools: &Pools<'_>,
    recorded_nodes: &RecordedNodeAllocations<'_>,
    targets: &PerNodeTargets<'_>,
) -> Claims {
    let mut claimed: Claimed = BTreeMap::new();
    let mut service_conflicts = Vec::new();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        let mut granted = Vec::new();
        let mut conflicts = Vec::new();
        for (ip, nh) in &s.requested {
            let other_ip = claimed.get(ip).filter(|o| **o != s.owner);
            let other_nh = nh.and_then(|n| claimed.get(&n).filter(|o| **o != s.owner).map(|o| (n, o)));
            match (other_ip, other_nh) {
                (Some(o), _) => conflicts.push(format!("{ip} is already used by {o}")),
                (None, Some((n, o))) => conflicts.push(format!("next hop {n} of {ip} is already used by {o}")),
                (None, None) => granted.push((*ip, *nh)),
            }
        }
        for (ip, nh) in &granted {
            claimed.insert(*ip, s.owner.clone());
            if let Some(n) = nh {
                claimed.insert(*n, s.owner.clone());
            }
        }
        conflicts.extend(claim_node_addresses(s, pools, recorded_nodes, targets, &mut claimed));
        if !conflicts.is_empty() {
            let message = format!("{} (the older object keeps it)", conflicts.join("; "));
            if let Owner::Service { namespace, name } = &s.owner {
                service_conflicts.push(ServiceProblem {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    reason: reason::IP_CONFLICT,
                    message: format!("Service {namespace}/{name}: {message}"),
                });
            }
            s.problem(reason::IP_CONFLICT, message);
        }
        s.granted = granted;
    }
    Claims { claimed, conflicts: service_conflicts }
}
