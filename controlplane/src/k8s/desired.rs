//! Observed cluster state -> what this gateway should do: a pure function.
//!
//! The watchers (`controller.rs`) fill [`Observed`] with plain structs; the
//! Lease state machine (`lease.rs`) says which egress IPs this gateway holds
//! by a valid Lease right now ([`Observed::held`]). [`desired`] returns:
//!
//! - the whole [`TablesSpec`] of this gateway: every valid policy (its
//!   sources are the selected pods' IPs as /32 or /128, its egress IPs in
//!   ascending order so paired pooling agrees on every gateway and on the
//!   node agent), and only the egress IPs and companion next hops this
//!   gateway holds;
//! - every egress IP in use with its ranked candidate gateways (rendezvous
//!   hashing), so the Lease state machine knows what to compete for;
//! - the status of every `EgressPolicy` and `EgressIPPool`, the pools'
//!   allocations, and the problems of annotated Services (reported as Events).
//!
//! One object's fault (a bad CIDR, a conflicting IP, an exhausted pool, a
//! Service without an ingress IP) is reported on that object and never
//! affects the others. Conflicts go to the older object (creation time, then
//! kind, then name), so every gateway resolves them the same way.
//!
//! Pool allocations take two steps, so that every gateway uses the same
//! addresses: new allocations are proposed in the pool's status; a policy
//! uses only allocations already recorded there (reason `AllocationPending`
//! in between).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use egret_dataplane::tables::{hrw_score, EgressIpSpec, NatSettings, PolicySpec, TablesSpec};
use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use k8s_openapi::jiff::Timestamp;
use kube::core::{Selector, SelectorExt};

use super::crd::{
    condition, reason, EgressIPPoolSpec, EgressIPPoolStatus, EgressIPStatus, EgressPolicySpec,
    EgressPolicyStatus, PoolAllocation,
};
use super::pool::Pool;

/// Labels of an object.
pub type Labels = BTreeMap<String, String>;

/// A pod that can be selected: it has an IP, is not on the host network and
/// has not terminated (the watcher leaves the others out).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodInfo {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: Labels,
    /// `status.podIPs`.
    pub ips: Vec<IpAddr>,
}

/// A Service port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePortInfo {
    /// `port` (the one on the VIP).
    pub port: u16,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
}

/// A Service annotated `egret.dev/egress: "true"`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Creation time (older wins conflicts).
    pub created: Option<Timestamp>,
    /// `spec.type == LoadBalancer`.
    pub load_balancer: bool,
    /// `spec.selector`.
    pub selector: Labels,
    /// `spec.ports`.
    pub ports: Vec<ServicePortInfo>,
    /// `status.loadBalancer.ingress[].ip`.
    pub ingress_ips: Vec<IpAddr>,
}

/// An `EgressPolicy`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PolicyInfo {
    /// Name.
    pub name: String,
    /// Creation time.
    pub created: Option<Timestamp>,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// Spec.
    pub spec: EgressPolicySpec,
    /// Status as last written.
    pub status: Option<EgressPolicyStatus>,
}

/// An `EgressIPPool`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolInfo {
    /// Name.
    pub name: String,
    /// `metadata.generation`.
    pub generation: Option<i64>,
    /// Spec.
    pub spec: EgressIPPoolSpec,
    /// Status as last written (holds the allocation record).
    pub status: Option<EgressIPPoolStatus>,
}

/// A gateway Node (one that matches the gateway node selector).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// Name (the gateway's identity in Leases).
    pub name: String,
    /// Labels (for `gatewaySelector`s).
    pub labels: Labels,
}

/// An egress IP's Lease as last observed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseInfo {
    /// `holderIdentity`.
    pub holder: Option<String>,
    /// `acquireTime`.
    pub acquire_time: Option<Timestamp>,
    /// `renewTime`.
    pub renew_time: Option<Timestamp>,
    /// `leaseDurationSeconds`.
    pub duration: Duration,
}

/// Everything the watchers saw, as plain data.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    /// Namespace labels by name.
    pub namespaces: BTreeMap<String, Labels>,
    /// Selectable pods.
    pub pods: Vec<PodInfo>,
    /// Annotated Services.
    pub services: Vec<ServiceInfo>,
    /// Policies.
    pub policies: Vec<PolicyInfo>,
    /// Pools.
    pub pools: Vec<PoolInfo>,
    /// Gateway Nodes.
    pub gateways: Vec<NodeInfo>,
    /// Egress-IP Leases by IP.
    pub leases: BTreeMap<IpAddr, LeaseInfo>,
    /// The egress IPs this gateway holds by a valid Lease (by its own clock),
    /// from the Lease state machine.
    pub held: BTreeSet<IpAddr>,
}

/// This gateway's own settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalConfig {
    /// This gateway's Node name.
    pub node_name: String,
    /// NAT settings from the gateway's file (their port range decides which
    /// Service ports collide).
    pub nat: NatSettings,
}

/// Who uses an egress IP.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Owner {
    /// An `EgressPolicy` by name.
    Policy(String),
    /// An annotated Service.
    Service {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Owner::Policy(n) => write!(f, "EgressPolicy {n}"),
            Owner::Service { namespace, name } => write!(f, "Service {namespace}/{name}"),
        }
    }
}

impl Owner {
    /// The policy name in the dataplane's tables (and its metrics).
    pub fn table_name(&self) -> String {
        match self {
            Owner::Policy(n) => format!("egresspolicy/{n}"),
            Owner::Service { namespace, name } => format!("service/{namespace}/{name}"),
        }
    }
}

/// One egress IP in use somewhere in the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpAssignment {
    /// Who uses it.
    pub owner: Owner,
    /// Its companion next hop.
    pub next_hop: Option<IpAddr>,
    /// Whether pods leave with it (false: a Service VIP only announced, see
    /// [`reason::SERVICE_PORT_IN_NAT_RANGE`]).
    pub egress: bool,
    /// Eligible gateways, most preferred first (rendezvous hashing).
    pub candidates: Vec<String>,
}

/// A problem of an annotated Service (reported as a Warning Event).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServiceProblem {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// CamelCase reason.
    pub reason: &'static str,
    /// What to do about it.
    pub message: String,
}

/// What this gateway should do.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Desired {
    /// This gateway's tables.
    pub tables: TablesSpec,
    /// Every egress IP in use (valid and uncontested).
    pub ips: BTreeMap<IpAddr, IpAssignment>,
    /// Status of every policy by name.
    pub policy_status: BTreeMap<String, EgressPolicyStatus>,
    /// Status of every pool by name (with the allocation record).
    pub pool_status: BTreeMap<String, EgressIPPoolStatus>,
    /// Problems of annotated Services.
    pub service_problems: Vec<ServiceProblem>,
    /// Selected pods of each annotated Service, by (namespace, name).
    pub service_pods: BTreeMap<(String, String), usize>,
}

impl Desired {
    /// The egress IPs this gateway is a candidate for.
    pub fn competing<'a>(&'a self, node: &'a str) -> impl Iterator<Item = (IpAddr, &'a IpAssignment)> + 'a {
        self.ips.iter().filter(move |(_, a)| a.candidates.iter().any(|c| c == node)).map(|(ip, a)| (*ip, a))
    }
}

/// Rendezvous score of `node` for `ip`: [`hrw_score`] over the address's
/// octets followed by the node name's bytes. Highest wins.
pub fn gateway_score(ip: IpAddr, node: &str) -> u64 {
    let mut buf: Vec<u8> = match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    buf.extend_from_slice(node.as_bytes());
    hrw_score(&buf)
}

/// `nodes` ranked for `ip`, most preferred first (ties by name).
pub fn rank_gateways(ip: IpAddr, nodes: &[&str]) -> Vec<String> {
    let mut v: Vec<(u64, &str)> = nodes.iter().map(|n| (gateway_score(ip, n), *n)).collect();
    v.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    v.into_iter().map(|(_, n)| n.to_string()).collect()
}

/// A parsed selector; absent means "everything".
fn parse_selector(field: &str, s: &Option<LabelSelector>) -> Result<Option<Selector>, String> {
    match s {
        None => Ok(None),
        Some(sel) => Selector::try_from(sel.clone()).map(Some).map_err(|e| format!("{field}: {e}")),
    }
}

fn selects(sel: &Option<Selector>, labels: &Labels) -> bool {
    sel.as_ref().is_none_or(|s| s.matches(labels))
}

fn parse_cidrs(field: &str, v: &[String]) -> Result<Vec<IpNet>, String> {
    v.iter()
        .enumerate()
        .map(|(i, s)| s.trim().parse::<IpNet>().map(|n| n.trunc()).map_err(|_| format!("{field}[{i}]: {s:?} is not a CIDR")))
        .collect()
}

fn parse_ip(field: &str, s: &str) -> Result<IpAddr, String> {
    s.trim().parse().map_err(|_| format!("{field}: {s:?} is not an IP address"))
}

fn host_net(ip: IpAddr) -> IpNet {
    match ip {
        IpAddr::V4(_) => IpNet::new(ip, 32),
        IpAddr::V6(_) => IpNet::new(ip, 128),
    }
    .unwrap_or_else(|_| IpNet::from(ip))
}

/// Truncates to whole seconds: `Time` is serialised with second precision,
/// so a value with a fraction would never compare equal to what was written.
fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// What one source of egress (policy or Service) asks for, after parsing.
#[derive(Debug)]
struct Source {
    owner: Owner,
    created: Option<Timestamp>,
    /// Spec error: the source takes part in nothing.
    invalid: Option<(&'static str, String)>,
    /// Requested IPs (explicit or recorded pool allocation) with next hops.
    requested: Vec<(IpAddr, Option<IpAddr>)>,
    /// The IPs it won.
    granted: Vec<(IpAddr, Option<IpAddr>)>,
    /// Why IPs are missing (conflicts, pool trouble), first reason wins.
    ip_problem: Option<(&'static str, String)>,
    /// Whether pods leave with its IPs (false: Service VIP only announced).
    egress: bool,
    pool: Option<(String, usize)>,
    gateway_selector: Option<Selector>,
    pod_selector: Option<Selector>,
    namespace_selector: Option<Selector>,
    /// Service: its namespace and selector.
    service: Option<(String, Labels)>,
    destinations: Vec<IpNet>,
    except: Vec<IpNet>,
}

impl Source {
    fn problem(&mut self, r: &'static str, m: String) {
        if self.ip_problem.is_none() {
            self.ip_problem = Some((r, m));
        }
    }
}

fn policy_source(p: &PolicyInfo) -> Source {
    let mut s = Source {
        owner: Owner::Policy(p.name.clone()),
        created: p.created,
        invalid: None,
        requested: Vec::new(),
        granted: Vec::new(),
        ip_problem: None,
        egress: true,
        pool: None,
        gateway_selector: None,
        pod_selector: None,
        namespace_selector: None,
        service: None,
        destinations: Vec::new(),
        except: Vec::new(),
    };
    let parsed = (|| -> Result<(), (&'static str, String)> {
        let inv = |m: String| (reason::INVALID_SPEC, m);
        s.pod_selector = parse_selector("spec.podSelector", &p.spec.pod_selector).map_err(inv)?;
        s.namespace_selector = parse_selector("spec.namespaceSelector", &p.spec.namespace_selector).map_err(inv)?;
        s.gateway_selector = parse_selector("spec.gatewaySelector", &p.spec.gateway_selector).map_err(inv)?;
        s.destinations = parse_cidrs("spec.destinations", &p.spec.destinations).map_err(inv)?;
        if s.destinations.is_empty() {
            return Err(inv("spec.destinations: must list at least one CIDR (0.0.0.0/0 for every IPv4 destination)".into()));
        }
        s.except = parse_cidrs("spec.except", &p.spec.except).map_err(inv)?;
        match (&p.spec.pool, p.spec.egress_ips.is_empty()) {
            (Some(_), false) => {
                return Err((reason::NO_EGRESS_IP, "set either spec.egressIPs or spec.pool, not both".into()));
            }
            (None, true) => {
                return Err((reason::NO_EGRESS_IP, "set spec.egressIPs or spec.pool: the policy has no egress IP".into()));
            }
            (Some(pool), true) => {
                let count = pool.count.unwrap_or(1).max(1) as usize;
                s.pool = Some((pool.name.clone(), count));
            }
            (None, false) => {
                for (i, e) in p.spec.egress_ips.iter().enumerate() {
                    let ip = parse_ip(&format!("spec.egressIPs[{i}].ip"), &e.ip).map_err(inv)?;
                    let nh = match &e.next_hop {
                        Some(n) => Some(parse_ip(&format!("spec.egressIPs[{i}].nextHop"), n).map_err(inv)?),
                        None => None,
                    };
                    if s.requested.iter().any(|(x, _)| *x == ip) {
                        return Err(inv(format!("spec.egressIPs[{i}].ip: {ip} is listed twice")));
                    }
                    s.requested.push((ip, nh));
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = parsed {
        s.invalid = Some(e);
    }
    s
}

fn service_source(svc: &ServiceInfo, nat: &NatSettings) -> (Source, Option<ServiceProblem>) {
    let owner = Owner::Service { namespace: svc.namespace.clone(), name: svc.name.clone() };
    let mut s = Source {
        owner,
        created: svc.created,
        invalid: None,
        requested: svc.ingress_ips.iter().map(|ip| (*ip, None)).collect(),
        granted: Vec::new(),
        ip_problem: None,
        egress: true,
        pool: None,
        gateway_selector: None,
        pod_selector: None,
        namespace_selector: None,
        service: Some((svc.namespace.clone(), svc.selector.clone())),
        destinations: vec![IpNet::V4(Default::default()), IpNet::V6(Default::default())],
        except: Vec::new(),
    };
    let problem = |reason: &'static str, message: String| ServiceProblem {
        namespace: svc.namespace.clone(),
        name: svc.name.clone(),
        reason,
        message,
    };
    if !svc.load_balancer {
        s.invalid = Some((reason::NOT_LOAD_BALANCER, String::new()));
        let m = format!(
            "Service {}/{} is annotated {}=true but is not of type LoadBalancer: only a LoadBalancer VIP can be an egress IP",
            svc.namespace, svc.name, super::crd::SERVICE_EGRESS_ANNOTATION
        );
        return (s, Some(problem(reason::NOT_LOAD_BALANCER, m)));
    }
    if svc.ingress_ips.is_empty() {
        s.invalid = Some((reason::NO_INGRESS_IP, String::new()));
        let m = format!(
            "Service {}/{} has no status.loadBalancer.ingress IP yet: its pods get an egress IP once the load balancer assigns one",
            svc.namespace, svc.name
        );
        return (s, Some(problem(reason::NO_INGRESS_IP, m)));
    }
    let ranges = nat.ports;
    let clash: Vec<String> = svc
        .ports
        .iter()
        .filter(|p| (ranges.first..=ranges.last).contains(&p.port))
        .map(|p| format!("{}/{}", p.port, p.protocol))
        .collect();
    if !clash.is_empty() {
        // Announce the VIP (ingress keeps working) but do not translate with
        // it: replies to NAT ports and the Service port would be confused.
        s.egress = false;
        let m = format!(
            "Service {}/{} port {} lies in the gateway's NAT port range {}-{}: its VIP is announced but not used as an egress IP; use Service ports below {} or move nat.ports",
            svc.namespace,
            svc.name,
            clash.join(", "),
            ranges.first,
            ranges.last,
            ranges.first
        );
        return (s, Some(problem(reason::SERVICE_PORT_IN_NAT_RANGE, m)));
    }
    (s, None)
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

/// Whether a Lease is held by someone and not yet expired by `now`.
fn live_holder(l: &LeaseInfo, now: Timestamp) -> Option<&str> {
    let holder = l.holder.as_deref().filter(|h| !h.is_empty())?;
    let renewed = l.renew_time.or(l.acquire_time)?;
    let expiry = renewed.checked_add(l.duration).ok()?;
    (expiry >= now).then_some(holder)
}

/// A pool parsed, or why it cannot be used (reason, message).
type ParsedPool = Result<Pool, (&'static str, String)>;

/// Observed state -> desired tables, candidacies and status.
pub fn desired(obs: &Observed, local: &LocalConfig, now: Timestamp) -> Desired {
    let mut out = Desired::default();

    // Pools: parse.
    let pools: BTreeMap<&str, (&PoolInfo, ParsedPool)> = obs
        .pools
        .iter()
        .map(|p| {
            let parsed = if p.spec.cloud.is_some() {
                Err((reason::CLOUD_NOT_SUPPORTED, "spec.cloud: cloud elastic IPs are not supported yet; remove it to use spec.addresses".to_string()))
            } else {
                Pool::parse(&p.spec.addresses, &p.spec.next_hops)
                    .map_err(|e| (reason::INVALID_ADDRESS, format!("spec.{e}")))
                    .and_then(|pool| {
                        parse_selector("spec.gatewaySelector", &p.spec.gateway_selector)
                            .map(|_| pool)
                            .map_err(|m| (reason::INVALID_SPEC, m))
                    })
            };
            (p.name.as_str(), (p, parsed))
        })
        .collect();

    // Sources, oldest first.
    let mut sources: Vec<Source> = obs.policies.iter().map(policy_source).collect();
    for svc in &obs.services {
        let (s, problem) = service_source(svc, &local.nat);
        out.service_problems.extend(problem);
        sources.push(s);
    }
    sources.sort_by(|a, b| {
        let key = |s: &Source| (s.created.is_none(), s.created, s.owner.clone());
        key(a).cmp(&key(b))
    });

    // Recorded pool allocations become requests.
    let recorded: BTreeMap<(&str, &str), Vec<IpAddr>> = obs
        .pools
        .iter()
        .flat_map(|p| {
            p.status.iter().flat_map(|s| s.allocations.iter()).map(move |a| {
                let ips = a.ips.iter().filter_map(|i| i.parse().ok()).collect();
                ((p.name.as_str(), a.policy.as_str()), ips)
            })
        })
        .collect();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        let (Some((pool_name, count)), Owner::Policy(name)) = (s.pool.clone(), s.owner.clone()) else { continue };
        match pools.get(pool_name.as_str()) {
            None => s.problem(reason::POOL_NOT_FOUND, format!("EgressIPPool {pool_name} does not exist")),
            Some((_, Err((_, m)))) => s.problem(reason::POOL_NOT_USABLE, format!("EgressIPPool {pool_name} cannot be used: {m}")),
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

    // Claims, oldest first: egress IPs and next hops share one namespace.
    let mut claimed: BTreeMap<IpAddr, Owner> = BTreeMap::new();
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
        if !conflicts.is_empty() {
            let message = format!("{} (the older object keeps it)", conflicts.join("; "));
            if let Owner::Service { namespace, name } = &s.owner {
                out.service_problems.push(ServiceProblem {
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

    // New pool allocations (proposed in the pool's status, used once recorded).
    let mut allocations: BTreeMap<String, Vec<PoolAllocation>> = BTreeMap::new();
    let mut exhausted: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        let (Some((pool_name, count)), Owner::Policy(name)) = (s.pool.clone(), s.owner.clone()) else { continue };
        let Some((_, Ok(pool))) = pools.get(pool_name.as_str()) else { continue };
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
                exhausted.entry(pool_name.clone()).or_default().push(name.clone());
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
            allocations.entry(pool_name).or_default().push(PoolAllocation { policy: name, ips: ips.iter().map(|i| i.to_string()).collect() });
        }
    }

    // Selection, candidates, tables.
    let gateway_names: Vec<&NodeInfo> = obs.gateways.iter().collect();
    let mut policies = Vec::new();
    let mut selected_pods: BTreeMap<Owner, usize> = BTreeMap::new();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        s.granted.sort();
        let pods: Vec<&PodInfo> = obs
            .pods
            .iter()
            .filter(|p| match &s.service {
                Some((ns, sel)) => p.namespace == *ns && !sel.is_empty() && sel.iter().all(|(k, v)| p.labels.get(k) == Some(v)),
                None => {
                    let ns_labels = obs.namespaces.get(&p.namespace).cloned().unwrap_or_default();
                    selects(&s.namespace_selector, &ns_labels) && selects(&s.pod_selector, &p.labels)
                }
            })
            .collect();
        selected_pods.insert(s.owner.clone(), pods.len());
        for (ip, nh) in &s.granted {
            let eligible: Vec<&str> = gateway_names
                .iter()
                .filter(|n| selects(&s.gateway_selector, &n.labels))
                .map(|n| n.name.as_str())
                .collect();
            out.ips.insert(
                *ip,
                IpAssignment { owner: s.owner.clone(), next_hop: *nh, egress: s.egress, candidates: rank_gateways(*ip, &eligible) },
            );
        }
        let egress_ips: Vec<IpAddr> = s.granted.iter().map(|(ip, _)| *ip).collect();
        if !s.egress || egress_ips.is_empty() {
            continue;
        }
        let has_v4 = egress_ips.iter().any(IpAddr::is_ipv4);
        let has_v6 = egress_ips.iter().any(IpAddr::is_ipv6);
        let mut srcs: Vec<IpNet> = pods
            .iter()
            .flat_map(|p| p.ips.iter())
            .filter(|ip| if ip.is_ipv4() { has_v4 } else { has_v6 })
            .map(|ip| host_net(*ip))
            .collect();
        srcs.sort();
        srcs.dedup();
        if srcs.is_empty() {
            continue;
        }
        policies.push(PolicySpec {
            name: s.owner.table_name(),
            sources: srcs,
            destinations: s.destinations.clone(),
            except: s.except.clone(),
            egress_ips,
        });
    }
    policies.sort_by(|a, b| a.name.cmp(&b.name));

    let mut egress_ips = Vec::new();
    let mut neighbor_addresses = Vec::new();
    for ip in &obs.held {
        let Some(a) = out.ips.get(ip) else { continue };
        if a.egress {
            egress_ips.push(EgressIpSpec { ip: *ip, ports: None, answer_neighbor: true });
        } else {
            neighbor_addresses.push(*ip);
        }
        neighbor_addresses.extend(a.next_hop);
    }
    neighbor_addresses.sort();
    out.tables = TablesSpec { policies, egress_ips, neighbor_addresses, nat: local.nat };

    // Status of every policy.
    for p in &obs.policies {
        let Some(s) = sources.iter().find(|s| s.owner == Owner::Policy(p.name.clone())) else { continue };
        let prev = p.status.as_ref().map(|st| st.conditions.as_slice()).unwrap_or(&[]);
        let cond = |t: &str, ok: bool, r: &str, m: String| condition(t, ok, r, m, p.generation, prev, now);
        let mut st = EgressPolicyStatus { observed_generation: p.generation, ..Default::default() };
        if let Some((r, m)) = &s.invalid {
            st.conditions = vec![
                cond(condition::READY, false, r, m.clone()),
                cond(condition::IP_ASSIGNED, false, r, m.clone()),
                cond(condition::GATEWAY_ASSIGNED, false, r, m.clone()),
            ];
            st.gateway_list = "-".into();
            out.policy_status.insert(p.name.clone(), st);
            continue;
        }
        st.selected_pods = i32::try_from(selected_pods.get(&s.owner).copied().unwrap_or(0)).unwrap_or(i32::MAX);
        let mut awaiting = Vec::new();
        let mut no_gateway = Vec::new();
        let mut held_by = Vec::new();
        for (ip, nh) in &s.granted {
            let lease = obs.leases.get(ip);
            let holder = lease.and_then(|l| live_holder(l, now)).map(str::to_string);
            let since = holder.as_ref().and_then(|_| lease.and_then(|l| l.acquire_time)).map(|t| Time(whole_seconds(t)));
            match &holder {
                Some(h) => held_by.push(format!("{ip} on {h}")),
                None if out.ips.get(ip).is_some_and(|a| a.candidates.is_empty()) => no_gateway.push(ip.to_string()),
                None => awaiting.push(ip.to_string()),
            }
            st.egress_ips.push(EgressIPStatus { ip: ip.to_string(), next_hop: nh.map(|n| n.to_string()), gateway: holder, since });
        }
        st.egress_ip_list = st.egress_ips.iter().map(|e| e.ip.as_str()).collect::<Vec<_>>().join(",");
        st.gateway_list = if st.egress_ips.is_empty() {
            "-".into()
        } else {
            st.egress_ips.iter().map(|e| e.gateway.as_deref().unwrap_or("-")).collect::<Vec<_>>().join(",")
        };
        let ip_cond = match &s.ip_problem {
            Some((r, m)) => cond(condition::IP_ASSIGNED, false, r, m.clone()),
            None => cond(condition::IP_ASSIGNED, true, reason::ASSIGNED, format!("egress IPs {}", st.egress_ip_list)),
        };
        let gw_cond = if !no_gateway.is_empty() {
            cond(
                condition::GATEWAY_ASSIGNED,
                false,
                reason::NO_ELIGIBLE_GATEWAY,
                format!(
                    "no gateway Node can carry {}: label gateway Nodes {}=true and check spec.gatewaySelector (and the pool's)",
                    no_gateway.join(", "),
                    super::crd::GATEWAY_LABEL
                ),
            )
        } else if !awaiting.is_empty() {
            cond(
                condition::GATEWAY_ASSIGNED,
                false,
                reason::AWAITING_LEASE,
                format!("waiting for an eligible gateway to take the Lease of {}: is egret running on the gateway Nodes?", awaiting.join(", ")),
            )
        } else if s.granted.is_empty() {
            cond(condition::GATEWAY_ASSIGNED, false, reason::NO_EGRESS_IP, "no egress IP to hold".into())
        } else {
            cond(condition::GATEWAY_ASSIGNED, true, reason::HELD, held_by.join(", "))
        };
        let ready = if ip_cond.status != "True" {
            cond(condition::READY, false, &ip_cond.reason, ip_cond.message.clone())
        } else if gw_cond.status != "True" {
            cond(condition::READY, false, &gw_cond.reason, gw_cond.message.clone())
        } else {
            cond(
                condition::READY,
                true,
                reason::ENFORCED,
                format!("{} selected pod(s) leave with {}", st.selected_pods, held_by.join(", ")),
            )
        };
        st.conditions = vec![ready, ip_cond, gw_cond];
        out.policy_status.insert(p.name.clone(), st);
    }

    // Status of every pool.
    for (name, (info, parsed)) in &pools {
        let prev = info.status.as_ref().map(|st| st.conditions.as_slice()).unwrap_or(&[]);
        let mut st = EgressIPPoolStatus { observed_generation: info.generation, ..Default::default() };
        let ready = match parsed {
            Err((r, m)) => condition(condition::READY, false, r, m.clone(), info.generation, prev, now),
            Ok(pool) => {
                st.size = i64::try_from(pool.addresses.len()).unwrap_or(i64::MAX).min(i64::from(i32::MAX));
                st.allocations = allocations.remove(*name).unwrap_or_default();
                st.allocated = st.allocations.iter().map(|a| a.ips.len() as i64).sum();
                match exhausted.get(*name) {
                    Some(who) => condition(
                        condition::READY,
                        false,
                        reason::POOL_EXHAUSTED,
                        format!("not enough free addresses for EgressPolicy {}: add addresses", who.join(", ")),
                        info.generation,
                        prev,
                        now,
                    ),
                    None => condition(
                        condition::READY,
                        true,
                        reason::VALID,
                        format!("{} of {} addresses allocated", st.allocated, st.size),
                        info.generation,
                        prev,
                        now,
                    ),
                }
            }
        };
        st.conditions = vec![ready];
        out.pool_status.insert(name.to_string(), st);
    }

    for s in &sources {
        if let Owner::Service { namespace, name } = &s.owner {
            out.service_pods.insert((namespace.clone(), name.clone()), selected_pods.get(&s.owner).copied().unwrap_or(0));
            if s.invalid.is_none() && !s.granted.is_empty() && s.granted.iter().all(|(ip, _)| out.ips.get(ip).is_some_and(|a| a.candidates.is_empty())) {
                out.service_problems.push(ServiceProblem {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    reason: reason::NO_ELIGIBLE_GATEWAY,
                    message: format!("no gateway Node can carry the VIP of Service {namespace}/{name}: label gateway Nodes {}=true", super::crd::GATEWAY_LABEL),
                });
            }
        }
    }
    out.service_problems.sort();
    out
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}
