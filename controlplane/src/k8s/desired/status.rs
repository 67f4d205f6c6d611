//! Status: of every `EgressPolicy` and `EgressIPPool` (conditions keep
//! their transition time while their status holds), and of annotated
//! Services (selected pods, problems).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;

use super::pools::Pools;
use super::sources::Source;
use super::{IpAssignment, LeaseInfo, Observed, Owner, PoolInfo, ServiceProblem};
use crate::cloud::cloud_spec;
use crate::k8s::crd::{
    self, condition, reason, Cause, EgressIPPoolStatus, EgressIPStatus, EgressPolicyStatus, PoolAllocation,
    PoolCloudSpec,
};
use crate::k8s::pool::Pool;

/// Truncates to whole seconds: `Time` is serialised with second precision,
/// so a value with a fraction would never compare equal to what was written.
fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// Keeps `prev`'s transition time when the status did not change.
fn condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
    prev: &[Condition],
    now: Timestamp,
) -> Condition {
    let status = if ok { "True" } else { "False" };
    let since = prev
        .iter()
        .find(|c| c.type_ == type_ && c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or(Time(whole_seconds(now)));
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: generation,
        last_transition_time: since,
    }
}

/// Keeps the transition times of the status last handed to the writer
/// (`written`) where the object (`stored`) does not show a condition's
/// status yet: the watch lags the write, and [`condition`] stamped such a
/// condition with the current second, so the same status would differ every
/// second and be written again and again. A condition's `lastTransitionTime`
/// changes only when its status does (the API conventions).
pub fn keep_transition_times(conditions: &mut [Condition], stored: &[Condition], written: &[Condition]) {
    let same = |a: &Condition, b: &Condition| a.type_ == b.type_ && a.status == b.status;
    for c in conditions.iter_mut() {
        if stored.iter().any(|s| same(s, c)) {
            continue;
        }
        if let Some(w) = written.iter().find(|w| same(w, c)) {
            c.last_transition_time = w.last_transition_time.clone();
        }
    }
}

/// Whether a Lease is held by someone and not yet expired by `now`.
fn live_holder(l: &LeaseInfo, now: Timestamp) -> Option<&str> {
    let holder = l.holder.as_deref().filter(|h| !h.is_empty())?;
    let renewed = l.renew_time.or(l.acquire_time)?;
    let expiry = renewed.checked_add(l.duration).ok()?;
    (expiry >= now).then_some(holder)
}

/// An object's conditions in the making: its generation, and its conditions
/// as last written (whose transition times are kept).
struct Stamp<'a> {
    generation: Option<i64>,
    prev: &'a [Condition],
    now: Timestamp,
}

impl Stamp<'_> {
    /// A condition of the object (see [`condition`]).
    fn cond(&self, type_: &str, ok: bool, reason: &str, message: String) -> Condition {
        condition(type_, ok, reason, message, self.generation, self.prev, self.now)
    }
}

/// Cloud pools' private addresses -> their public addresses (recorded).
pub(super) type PublicIps = BTreeMap<IpAddr, String>;

/// Phase "cloud pools' private addresses -> their public addresses".
pub(super) fn public_ips(obs: &Observed) -> PublicIps {
    let cloud_pools = || obs.pools.iter().filter(|p| p.spec.cloud.is_some()).flat_map(|p| p.status.iter());
    let paired = cloud_pools()
        .flat_map(|st| st.cloud_addresses.iter())
        .filter_map(|a| Some((a.private_ip.parse().ok()?, a.public_ip.clone())));
    // PerNode: a Node's private address stands for its allocation's public one.
    let per_node = cloud_pools()
        .flat_map(|st| st.allocations.iter())
        .filter(|a| a.node.is_some())
        .filter_map(|a| Some((a.private_ip.as_deref()?.parse().ok()?, a.ips.first()?.clone())));
    paired.chain(per_node).collect()
}

/// Phase "status of every policy", by name.
pub(super) fn policy_statuses(
    obs: &Observed,
    sources: &[Source],
    selected_pods: &BTreeMap<Owner, usize>,
    ips: &BTreeMap<IpAddr, IpAssignment>,
    public_ips: &PublicIps,
    now: Timestamp,
) -> BTreeMap<String, EgressPolicyStatus> {
    let mut out = BTreeMap::new();
    for p in &obs.policies {
        let Some(s) = sources.iter().find(|s| s.owner == Owner::Policy(p.name.clone())) else { continue };
        let prev = p.status.as_ref().map(|st| st.conditions.as_slice()).unwrap_or(&[]);
        let stamp = Stamp { generation: p.generation, prev, now };
        let mut st = EgressPolicyStatus { observed_generation: p.generation, ..Default::default() };
        if let Some(Cause { reason: r, message: m }) = &s.invalid {
            st.conditions = vec![
                stamp.cond(condition::READY, false, r, m.clone()),
                stamp.cond(condition::IP_ASSIGNED, false, r, m.clone()),
                stamp.cond(condition::GATEWAY_ASSIGNED, false, r, m.clone()),
            ];
            st.gateway_list = "-".into();
        } else {
            st.selected_pods = i32::try_from(selected_pods.get(&s.owner).copied().unwrap_or(0)).unwrap_or(i32::MAX);
            if s.per_node.is_some() {
                per_node_policy_status(&mut st, s, public_ips, &stamp);
            } else {
                gateway_policy_status(&mut st, s, &obs.leases, ips, public_ips, &stamp);
            }
        }
        out.insert(p.name.clone(), st);
    }
    out
}

/// A valid `PerNode` policy's addresses (by Node) and conditions.
fn per_node_policy_status(st: &mut EgressPolicyStatus, s: &Source, public_ips: &PublicIps, stamp: &Stamp<'_>) {
    let mut by_node = Vec::new();
    for (node, ips) in &s.node_grants {
        for ip in ips {
            st.egress_ips.push(EgressIPStatus {
                ip: ip.to_string(),
                public_ip: public_ips.get(ip).cloned(),
                node: Some(node.clone()),
                ..Default::default()
            });
            by_node.push(format!("{ip} on {node}"));
        }
    }
    st.egress_ip_list = st.egress_ips.iter().map(|e| e.ip.as_str()).collect::<Vec<_>>().join(",");
    st.gateway_list = "-".into();
    let ip_cond = match &s.ip_problem {
        Some(Cause { reason: r, message: m }) => stamp.cond(condition::IP_ASSIGNED, false, r, m.clone()),
        None => stamp.cond(
            condition::IP_ASSIGNED,
            true,
            reason::ASSIGNED,
            format!("{} Node address(es): {}", by_node.len(), by_node.join(", ")),
        ),
    };
    let gw_cond = stamp.cond(
        condition::GATEWAY_ASSIGNED,
        true,
        reason::PER_NODE,
        "no gateway: each Node SNATs its selected pods to its own address".into(),
    );
    let ready = if ip_cond.status != "True" {
        stamp.cond(condition::READY, false, &ip_cond.reason, ip_cond.message.clone())
    } else {
        stamp.cond(
            condition::READY,
            true,
            reason::ENFORCED,
            format!("{} selected pod(s) leave with their Node's address ({})", st.selected_pods, by_node.join(", ")),
        )
    };
    st.conditions = vec![ready, ip_cond, gw_cond];
}

/// A valid policy's (gateway-held) egress IPs, their holders, and its
/// conditions.
fn gateway_policy_status(
    st: &mut EgressPolicyStatus,
    s: &Source,
    leases: &BTreeMap<IpAddr, LeaseInfo>,
    ips: &BTreeMap<IpAddr, IpAssignment>,
    public_ips: &PublicIps,
    stamp: &Stamp<'_>,
) {
    let now = stamp.now;
    let mut awaiting = Vec::new();
    let mut no_gateway = Vec::new();
    let mut held_by = Vec::new();
    for (ip, nh) in &s.granted {
        let lease = leases.get(ip);
        let holder = lease.and_then(|l| live_holder(l, now)).map(str::to_string);
        let since = holder.as_ref().and_then(|_| lease.and_then(|l| l.acquire_time)).map(|t| Time(whole_seconds(t)));
        match &holder {
            Some(h) => held_by.push(format!("{ip} on {h}")),
            None if ips.get(ip).is_some_and(|a| a.candidates.is_empty()) => no_gateway.push(ip.to_string()),
            None => awaiting.push(ip.to_string()),
        }
        st.egress_ips.push(EgressIPStatus {
            ip: ip.to_string(),
            next_hop: nh.map(|n| n.to_string()),
            gateway: holder,
            since,
            node: None,
            public_ip: public_ips.get(ip).cloned(),
        });
    }
    st.egress_ip_list = st.egress_ips.iter().map(|e| e.ip.as_str()).collect::<Vec<_>>().join(",");
    st.gateway_list = if st.egress_ips.is_empty() {
        "-".into()
    } else {
        st.egress_ips.iter().map(|e| e.gateway.as_deref().unwrap_or("-")).collect::<Vec<_>>().join(",")
    };
    let ip_cond = match &s.ip_problem {
        Some(Cause { reason: r, message: m }) => stamp.cond(condition::IP_ASSIGNED, false, r, m.clone()),
        None => stamp.cond(condition::IP_ASSIGNED, true, reason::ASSIGNED, format!("egress IPs {}", st.egress_ip_list)),
    };
    let gw_cond = if !no_gateway.is_empty() {
        stamp.cond(
            condition::GATEWAY_ASSIGNED,
            false,
            reason::NO_ELIGIBLE_GATEWAY,
            format!(
                "no gateway Node can carry {}: label gateway Nodes {}=true and check spec.gatewaySelector (and the pool's)",
                no_gateway.join(", "),
                crd::GATEWAY_LABEL
            ),
        )
    } else if !awaiting.is_empty() {
        stamp.cond(
            condition::GATEWAY_ASSIGNED,
            false,
            reason::AWAITING_LEASE,
            format!(
                "waiting for an eligible gateway to take the Lease of {}: is egret running on the gateway Nodes?",
                awaiting.join(", ")
            ),
        )
    } else if s.granted.is_empty() {
        stamp.cond(condition::GATEWAY_ASSIGNED, false, reason::NO_EGRESS_IP, "no egress IP to hold".into())
    } else {
        stamp.cond(condition::GATEWAY_ASSIGNED, true, reason::HELD, held_by.join(", "))
    };
    let ready = if ip_cond.status != "True" {
        stamp.cond(condition::READY, false, &ip_cond.reason, ip_cond.message.clone())
    } else if gw_cond.status != "True" {
        stamp.cond(condition::READY, false, &gw_cond.reason, gw_cond.message.clone())
    } else {
        stamp.cond(
            condition::READY,
            true,
            reason::ENFORCED,
            format!("{} selected pod(s) leave with {}", st.selected_pods, held_by.join(", ")),
        )
    };
    st.conditions = vec![ready, ip_cond, gw_cond];
}

/// Cloud pools' recorded private addresses: (pool, subnet, address), in
/// pool name order.
pub(super) type CloudRecorded<'a> = Vec<(&'a str, String, IpAddr)>;

/// Phase "cloud pools' recorded private addresses" (of the valid cloud
/// pools).
pub(super) fn cloud_recorded<'a>(pools: &Pools<'a>) -> CloudRecorded<'a> {
    pools
        .iter()
        .filter_map(|(name, (info, _))| {
            let sel = cloud_spec(info.spec.cloud.as_ref()?, &info.spec.addresses).ok()?.0;
            Some(
                info.status
                    .iter()
                    .flat_map(|s| s.cloud_addresses.iter())
                    .filter_map(move |a| Some((*name, sel.subnet_id.clone(), a.private_ip.parse().ok()?))),
            )
        })
        .flatten()
        .collect()
}

/// Phase "status of every pool", by name: its size and allocations (taken
/// from `allocations`), `Ready`, and for a cloud pool its pairing and
/// `CloudSynced`.
pub(super) fn pool_statuses(
    obs: &Observed,
    pools: &Pools<'_>,
    mut allocations: BTreeMap<String, Vec<PoolAllocation>>,
    exhausted: &BTreeMap<String, Vec<String>>,
    cloud_recorded: &CloudRecorded<'_>,
    now: Timestamp,
) -> BTreeMap<String, EgressIPPoolStatus> {
    let mut out = BTreeMap::new();
    // Those the pools paired so far in this pass (subnet, address).
    let mut cloud_proposed: Vec<(String, IpAddr)> = Vec::new();
    for (name, (info, parsed)) in pools {
        let prev = info.status.as_ref().map(|st| st.conditions.as_slice()).unwrap_or(&[]);
        let stamp = Stamp { generation: info.generation, prev, now };
        let mut st = EgressIPPoolStatus { observed_generation: info.generation, ..Default::default() };
        let ready = match parsed {
            Err(Cause { reason: r, message: m }) => stamp.cond(condition::READY, false, r, m.clone()),
            Ok(pool) => {
                pool_ready(&mut st, pool, allocations.remove(*name).unwrap_or_default(), exhausted.get(*name), &stamp)
            }
        };
        st.conditions = vec![ready];
        if let Some(cloud) = &info.spec.cloud {
            let synced = cloud_synced(&mut st, (name, info, cloud), obs, cloud_recorded, &mut cloud_proposed, &stamp);
            st.conditions.push(synced);
        }
        out.insert(name.to_string(), st);
    }
    out
}

/// A usable pool's size, allocations and `Ready`.
fn pool_ready(
    st: &mut EgressIPPoolStatus,
    pool: &Pool,
    allocations: Vec<PoolAllocation>,
    exhausted: Option<&Vec<String>>,
    stamp: &Stamp<'_>,
) -> Condition {
    st.size = i64::try_from(pool.addresses.len()).unwrap_or(i64::MAX).min(i64::from(i32::MAX));
    st.allocations = allocations;
    st.allocated = st.allocations.iter().map(|a| a.ips.len() as i64).sum();
    match exhausted {
        Some(who) => stamp.cond(
            condition::READY,
            false,
            reason::POOL_EXHAUSTED,
            format!("not enough free addresses for EgressPolicy {}: add addresses", who.join(", ")),
        ),
        None => stamp.cond(
            condition::READY,
            true,
            reason::VALID,
            format!("{} of {} addresses allocated", st.allocated, st.size),
        ),
    }
}

/// A cloud pool's pairing (the recorded one, or a new one from the
/// provider's last answer) and its `CloudSynced`. Pools of one subnet share
/// its addresses: those paired before this one in this pass
/// (`cloud_proposed`, which this one extends) count as proposed, the later
/// ones by their records.
fn cloud_synced(
    st: &mut EgressIPPoolStatus,
    (name, info, cloud): (&str, &PoolInfo, &PoolCloudSpec),
    obs: &Observed,
    cloud_recorded: &CloudRecorded<'_>,
    cloud_proposed: &mut Vec<(String, IpAddr)>,
    stamp: &Stamp<'_>,
) -> Condition {
    let recorded = info.status.as_ref().map(|s| s.cloud_addresses.as_slice()).unwrap_or(&[]);
    st.cloud_addresses = recorded.to_vec();
    let synced = |ok: bool, r: &str, m: String| stamp.cond(condition::CLOUD_SYNCED, ok, r, m);
    match (cloud_spec(cloud, &info.spec.addresses), obs.cloud.get(name)) {
        (Err(Cause { reason: r, message: m }), _) => synced(false, r, m),
        (Ok(_), None) => synced(false, reason::CLOUD_DISCOVERING, "the cloud provider has not answered yet".into()),
        (Ok(_), Some(Err(e))) => synced(
            false,
            reason::CLOUD_API_ERROR,
            format!("{e}; the recorded pairing ({} addresses) stays in use", recorded.len()),
        ),
        (Ok((sel, allowed)), Some(Ok(found))) if sel.ipv6 => {
            let outside: Vec<String> = allowed
                .ranges()
                .filter(|(first, last)| !found.subnet_cidr.contains(first) || !found.subnet_cidr.contains(last))
                .map(|(first, last)| if first == last { first.to_string() } else { format!("{first}-{last}") })
                .collect();
            if outside.is_empty() {
                synced(
                    true,
                    reason::VALID,
                    format!("IPv6 addresses of {} ({}): each moves with its Lease", sel.subnet_id, found.subnet_cidr),
                )
            } else {
                synced(
                    false,
                    reason::INVALID_ADDRESS,
                    format!(
                        "spec.addresses: {} outside the subnet's IPv6 range {}",
                        outside.join(", "),
                        found.subnet_cidr
                    ),
                )
            }
        }
        (Ok((sel, allowed)), Some(Ok(found))) => {
            let others: BTreeSet<IpAddr> = cloud_recorded
                .iter()
                .filter(|(pool, subnet, _)| *pool > name && *subnet == sel.subnet_id)
                .map(|(_, _, ip)| *ip)
                .chain(cloud_proposed.iter().filter(|(s, _)| *s == sel.subnet_id).map(|(_, ip)| *ip))
                .collect();
            let pairing = if sel.provider.pairs_privately() {
                crate::cloud::pairing::pair(recorded, found, Some(&allowed), &others)
            } else {
                crate::cloud::pairing::identity(found)
            };
            cloud_proposed.extend(
                pairing.addresses.iter().filter_map(|a| Some((sel.subnet_id.clone(), a.private_ip.parse().ok()?))),
            );
            st.cloud_addresses = pairing.addresses;
            if pairing.unpaired.is_empty() {
                synced(true, reason::VALID, format!("{} public addresses paired", st.cloud_addresses.len()))
            } else {
                let list = pairing.unpaired.iter().map(IpAddr::to_string).collect::<Vec<_>>().join(", ");
                synced(
                    false,
                    reason::NO_PRIVATE_ADDRESS,
                    format!("no free private address in the subnet (or spec.addresses) for {list}"),
                )
            }
        }
    }
}

/// What the annotated Services get reported: their selected pods, and
/// those whose VIPs no gateway can carry.
#[derive(Debug, Default)]
pub(super) struct ServiceReport {
    /// Selected pods by (namespace, name).
    pub(super) pods: BTreeMap<(String, String), usize>,
    /// Services no gateway Node can carry.
    pub(super) problems: Vec<ServiceProblem>,
}

/// Phase "services": each annotated Service's selected pods, and a problem
/// for a valid one none of whose VIPs has a candidate gateway.
pub(super) fn service_reports(
    sources: &[Source],
    selected_pods: &BTreeMap<Owner, usize>,
    ips: &BTreeMap<IpAddr, IpAssignment>,
) -> ServiceReport {
    let mut out = ServiceReport::default();
    for s in sources {
        if let Owner::Service { namespace, name } = &s.owner {
            out.pods.insert((namespace.clone(), name.clone()), selected_pods.get(&s.owner).copied().unwrap_or(0));
            if s.invalid.is_none()
                && !s.granted.is_empty()
                && s.granted.iter().all(|(ip, _)| ips.get(ip).is_some_and(|a| a.candidates.is_empty()))
            {
                out.problems.push(ServiceProblem {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    reason: reason::NO_ELIGIBLE_GATEWAY,
                    message: format!(
                        "no gateway Node can carry the VIP of Service {namespace}/{name}: label gateway Nodes {}=true",
                        crd::GATEWAY_LABEL
                    ),
                });
            }
        }
    }
    out
}
