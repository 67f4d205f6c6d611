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

use egret_dataplane::tables::{hrw_score, EgressIpSpec, NatSettings, PolicySpec, SourceGuard, TablesSpec};
use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use k8s_openapi::jiff::Timestamp;
use kube::core::{Selector, SelectorExt};

use super::crd::{
    condition, reason, EgressIPPoolSpec, EgressIPPoolStatus, EgressIPStatus, EgressPolicySpec, EgressPolicyStatus,
    PoolAllocation,
};
use super::pool::{AddressSet, Pool};

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
    /// `spec.externalTrafficPolicy == Local`.
    pub external_traffic_local: bool,
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
    /// Every Node (the targets of `PerNode` policies; the node agent sees
    /// only its own).
    pub nodes: Vec<NodeInfo>,
    /// Egress-IP Leases by IP.
    pub leases: BTreeMap<IpAddr, LeaseInfo>,
    /// The egress IPs this gateway holds by a valid Lease (by its own clock),
    /// from the Lease state machine. For a cloud pool's address: only once
    /// the provider gave it to this gateway's interface too.
    pub held: BTreeSet<IpAddr>,
    /// Cloud pools: the provider's last answer, by pool name (the status
    /// writer pairs it; absent: not asked yet, or not this process's job).
    pub cloud: BTreeMap<String, Result<crate::cloud::Discovered, crate::cloud::CloudError>>,
}

/// This gateway's own settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LocalConfig {
    /// This gateway's Node name.
    pub node_name: String,
    /// NAT settings from the gateway's file (their port range decides which
    /// Service ports collide).
    pub nat: NatSettings,
    /// The source guard (`kubernetes.clusterPodCIDRs`), passed through.
    pub guard: SourceGuard,
    /// Who computes: a gateway, or the node agent of `node_name`.
    pub role: Role,
}

/// Who runs [`desired`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Role {
    /// A gateway: `PerNode` policies are not in its tables.
    #[default]
    Gateway,
    /// The node agent of `LocalConfig::node_name`: its tables also hold the
    /// `PerNode` policies, with this Node's own address as their egress IP.
    Node,
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
    /// `PerNode` policies (their table names) -> Node -> its recorded address.
    pub per_node: BTreeMap<String, BTreeMap<String, Vec<IpAddr>>>,
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
        .map(|(i, s)| {
            s.trim().parse::<IpNet>().map(|n| n.trunc()).map_err(|_| format!("{field}[{i}]: {s:?} is not a CIDR"))
        })
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
    /// `PerNode`: `Some(nodeSelector)`; its granted address per Node.
    per_node: Option<Option<Selector>>,
    node_grants: BTreeMap<String, Vec<IpAddr>>,
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
        per_node: None,
        node_grants: BTreeMap::new(),
    };
    let parsed = (|| -> Result<(), (&'static str, String)> {
        let inv = |m: String| (reason::INVALID_SPEC, m);
        s.pod_selector = parse_selector("spec.podSelector", &p.spec.pod_selector).map_err(inv)?;
        s.namespace_selector = parse_selector("spec.namespaceSelector", &p.spec.namespace_selector).map_err(inv)?;
        s.gateway_selector = parse_selector("spec.gatewaySelector", &p.spec.gateway_selector).map_err(inv)?;
        s.destinations = parse_cidrs("spec.destinations", &p.spec.destinations).map_err(inv)?;
        if s.destinations.is_empty() {
            return Err(inv(
                "spec.destinations: must list at least one CIDR (0.0.0.0/0 for every IPv4 destination)".into()
            ));
        }
        s.except = parse_cidrs("spec.except", &p.spec.except).map_err(inv)?;
        if p.spec.mode == Some(super::crd::PolicyMode::PerNode) {
            if !p.spec.egress_ips.is_empty() || p.spec.gateway_selector.is_some() {
                return Err(inv(
                    "spec.mode: PerNode takes its addresses from spec.pool, one per Node: remove spec.egressIPs and spec.gatewaySelector".into(),
                ));
            }
            let Some(pool) = &p.spec.pool else {
                return Err((reason::NO_EGRESS_IP, "spec.mode: PerNode needs spec.pool (one address per Node)".into()));
            };
            s.per_node = Some(parse_selector("spec.nodeSelector", &p.spec.node_selector).map_err(inv)?);
            s.pool = Some((pool.name.clone(), 1));
            return Ok(());
        }
        if p.spec.node_selector.is_some() {
            return Err(inv("spec.nodeSelector: only for spec.mode: PerNode".into()));
        }
        match (&p.spec.pool, p.spec.egress_ips.is_empty()) {
            (Some(_), false) => {
                return Err((reason::NO_EGRESS_IP, "set either spec.egressIPs or spec.pool, not both".into()));
            }
            (None, true) => {
                return Err((
                    reason::NO_EGRESS_IP,
                    "set spec.egressIPs or spec.pool: the policy has no egress IP".into(),
                ));
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
        per_node: None,
        node_grants: BTreeMap::new(),
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
    if svc.external_traffic_local {
        // Egress works; inbound does not: the gateway holding the VIP runs
        // none of the Service's endpoints, and kube-proxy there has no local
        // endpoint to send `Local` traffic to (k8s_kube_proxy measures it).
        let m = format!(
            "Service {}/{} has externalTrafficPolicy: Local: its VIP is held by an Egret gateway, which runs none of its endpoints, so kube-proxy there drops the VIP's inbound traffic (its pods still leave with the VIP); use externalTrafficPolicy: Cluster",
            svc.namespace, svc.name
        );
        return (s, Some(problem(reason::EXTERNAL_TRAFFIC_POLICY_LOCAL, m)));
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

/// The /32s and /128s of `pods` in the families `egress_ips` cover, sorted.
fn pod_sources(pods: &[&PodInfo], egress_ips: &[IpAddr]) -> Vec<IpNet> {
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
    srcs
}

/// A pool parsed, or why it cannot be used (reason, message).
type ParsedPool = Result<Pool, (&'static str, String)>;

/// A cloud pool's spec, checked: the provider's selector and the private
/// range (empty: the whole subnet).
pub fn cloud_spec(
    spec: &crate::k8s::crd::PoolCloudSpec,
    addresses: &[String],
) -> Result<(crate::cloud::PoolSelector, AddressSet), (&'static str, String)> {
    let Some(aws) = &spec.aws else {
        return Err((reason::CLOUD_NOT_SUPPORTED, "spec.cloud: names no provider; set spec.cloud.aws".to_string()));
    };
    if aws.tags.is_empty() {
        return Err((
            reason::INVALID_SPEC,
            "spec.cloud.aws.tags: empty; name the tags that mark this pool's Elastic IPs (an empty set would take every Elastic IP of the account)".to_string(),
        ));
    }
    if let Some((k, _)) = aws.tags.iter().find(|(k, _)| k.is_empty()) {
        return Err((reason::INVALID_SPEC, format!("spec.cloud.aws.tags: the key {k:?} is empty")));
    }
    let subnet = aws.subnet_id.as_str();
    if !subnet.starts_with("subnet-")
        || subnet.len() <= "subnet-".len()
        || !subnet[7..].bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err((
            reason::INVALID_SPEC,
            format!("spec.cloud.aws.subnetId: {subnet:?} is not a subnet ID (subnet-0123abcd)"),
        ));
    }
    let allowed =
        AddressSet::parse("addresses", addresses).map_err(|e| (reason::INVALID_ADDRESS, format!("spec.{e}")))?;
    if allowed.families().1 {
        return Err((
            reason::INVALID_ADDRESS,
            "spec.addresses: IPv6 with spec.cloud.aws: Elastic IPs are IPv4; an IPv6 pool needs no cloud section"
                .to_string(),
        ));
    }
    Ok((crate::cloud::PoolSelector { tags: aws.tags.clone(), subnet_id: aws.subnet_id.clone() }, allowed))
}

/// A cloud pool: its addresses are the private halves of the pairing
/// recorded in its status (the one every gateway agrees on), usable while
/// the provider cannot be asked. Without a recorded pairing it cannot be
/// used yet, and says why.
fn cloud_pool(
    p: &PoolInfo,
    cloud: &crate::k8s::crd::PoolCloudSpec,
    found: Option<&Result<crate::cloud::Discovered, crate::cloud::CloudError>>,
) -> ParsedPool {
    if !p.spec.next_hops.is_empty() {
        return Err((
            reason::INVALID_SPEC,
            "spec.nextHops: not used with spec.cloud (the provider routes the addresses)".to_string(),
        ));
    }
    let (sel, _) = cloud_spec(cloud, &p.spec.addresses)?;
    let recorded: Vec<String> = p
        .status
        .iter()
        .flat_map(|st| st.cloud_addresses.iter())
        .filter(|a| a.private_ip.parse::<IpAddr>().is_ok())
        .map(|a| a.private_ip.clone())
        .collect();
    if !recorded.is_empty() {
        return Pool::parse(&recorded, &[])
            .map_err(|e| (reason::INVALID_ADDRESS, format!("status.cloudAddresses: {e}")));
    }
    let tags = sel.tags.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ");
    Err(match found {
        None => (reason::CLOUD_DISCOVERING, "waiting for the first answer from the cloud provider".to_string()),
        Some(Err(e)) => (reason::CLOUD_API_ERROR, format!("the cloud provider failed: {e}")),
        Some(Ok(f)) if f.public.is_empty() => {
            (reason::NO_CLOUD_ADDRESSES, format!("no Elastic IP carries the tags {tags}"))
        }
        Some(Ok(_)) => (reason::CLOUD_DISCOVERING, "Elastic IPs found; their pairing is not recorded yet".to_string()),
    })
}

/// Observed state -> desired tables, candidacies and status.
pub fn desired(obs: &Observed, local: &LocalConfig, now: Timestamp) -> Desired {
    let mut out = Desired::default();

    // Pools: parse.
    let pools: BTreeMap<&str, (&PoolInfo, ParsedPool)> = obs
        .pools
        .iter()
        .map(|p| {
            let parsed = match &p.spec.cloud {
                Some(cloud) => cloud_pool(p, cloud, obs.cloud.get(&p.name)),
                None => Pool::parse(&p.spec.addresses, &p.spec.next_hops)
                    .map_err(|e| (reason::INVALID_ADDRESS, format!("spec.{e}"))),
            }
            .and_then(|pool| {
                parse_selector("spec.gatewaySelector", &p.spec.gateway_selector)
                    .map(|_| pool)
                    .map_err(|m| (reason::INVALID_SPEC, m))
            });
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
            p.status.iter().flat_map(|s| s.allocations.iter()).filter(|a| a.node.is_none()).map(move |a| {
                let ips = a.ips.iter().filter_map(|i| i.parse().ok()).collect();
                ((p.name.as_str(), a.policy.as_str()), ips)
            })
        })
        .collect();
    // PerNode allocations: (pool, policy) -> Node -> address.
    let mut recorded_nodes: BTreeMap<(&str, &str), BTreeMap<&str, Vec<IpAddr>>> = BTreeMap::new();
    for p in &obs.pools {
        for a in p.status.iter().flat_map(|s| s.allocations.iter()) {
            if let Some(node) = &a.node {
                let ips = a.ips.iter().filter_map(|i| i.parse().ok()).collect();
                recorded_nodes.entry((p.name.as_str(), a.policy.as_str())).or_default().insert(node.as_str(), ips);
            }
        }
    }
    // PerNode targets: Nodes that are not gateways, by name.
    let gateway_names: BTreeSet<&str> = obs.gateways.iter().map(|g| g.name.as_str()).collect();
    let targets = |sel: &Option<Selector>| -> Vec<String> {
        let mut v: Vec<String> = obs
            .nodes
            .iter()
            .filter(|n| !gateway_names.contains(n.name.as_str()) && selects(sel, &n.labels))
            .map(|n| n.name.clone())
            .collect();
        v.sort();
        v
    };
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        let (Some((pool_name, count)), Owner::Policy(name)) = (s.pool.clone(), s.owner.clone()) else { continue };
        match pools.get(pool_name.as_str()) {
            None => s.problem(reason::POOL_NOT_FOUND, format!("EgressIPPool {pool_name} does not exist")),
            Some((_, Err((_, m)))) => {
                s.problem(reason::POOL_NOT_USABLE, format!("EgressIPPool {pool_name} cannot be used: {m}"))
            }
            Some((info, Ok(_))) if s.per_node.is_some() && info.spec.cloud.is_some() => s.problem(
                reason::POOL_NOT_USABLE,
                format!(
                    "EgressIPPool {pool_name} is a cloud pool: a PerNode policy's addresses have no Lease, so no gateway would move them to its interface; use a pool of addresses"
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
        if let (Some(sel), Some((pool_name, _)), Owner::Policy(name)) = (&s.per_node, &s.pool, &s.owner) {
            if let (Some(rec), Some((_, Ok(pool)))) =
                (recorded_nodes.get(&(pool_name.as_str(), name.as_str())), pools.get(pool_name.as_str()))
            {
                for node in targets(sel) {
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
        if let Some(sel) = &s.per_node {
            let mut new = Vec::new();
            let mut short = false;
            let (has_v4, has_v6) = pool.addresses.families();
            for node in targets(sel) {
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
                    allocations.entry(pool_name.clone()).or_default().push(PoolAllocation {
                        policy: name.clone(),
                        ips: ips.iter().map(|i| i.to_string()).collect(),
                        node: Some(node),
                    });
                }
            }
            if short {
                exhausted.entry(pool_name.clone()).or_default().push(name.clone());
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
            continue;
        }
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
            allocations.entry(pool_name).or_default().push(PoolAllocation {
                policy: name,
                ips: ips.iter().map(|i| i.to_string()).collect(),
                node: None,
            });
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
                Some((ns, sel)) => {
                    p.namespace == *ns && !sel.is_empty() && sel.iter().all(|(k, v)| p.labels.get(k) == Some(v))
                }
                None => {
                    let ns_labels = obs.namespaces.get(&p.namespace).cloned().unwrap_or_default();
                    selects(&s.namespace_selector, &ns_labels) && selects(&s.pod_selector, &p.labels)
                }
            })
            .collect();
        selected_pods.insert(s.owner.clone(), pods.len());
        if s.per_node.is_some() {
            out.per_node.insert(s.owner.table_name(), s.node_grants.clone());
            // Only the node agent puts it in its tables, with its own address.
            let own = s.node_grants.get(&local.node_name).cloned().unwrap_or_default();
            if local.role == Role::Node && !own.is_empty() {
                let srcs = pod_sources(&pods, &own);
                if !srcs.is_empty() {
                    policies.push(PolicySpec {
                        name: s.owner.table_name(),
                        sources: srcs,
                        destinations: s.destinations.clone(),
                        except: s.except.clone(),
                        egress_ips: own,
                    });
                }
            }
            continue;
        }
        for (ip, nh) in &s.granted {
            let eligible: Vec<&str> = gateway_names
                .iter()
                .filter(|n| selects(&s.gateway_selector, &n.labels))
                .map(|n| n.name.as_str())
                .collect();
            out.ips.insert(
                *ip,
                IpAssignment {
                    owner: s.owner.clone(),
                    next_hop: *nh,
                    egress: s.egress,
                    candidates: rank_gateways(*ip, &eligible),
                },
            );
        }
        let egress_ips: Vec<IpAddr> = s.granted.iter().map(|(ip, _)| *ip).collect();
        if !s.egress || egress_ips.is_empty() {
            continue;
        }
        let srcs = pod_sources(&pods, &egress_ips);
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
    let mut service_addresses = Vec::new();
    for ip in &obs.held {
        let Some(a) = out.ips.get(ip) else { continue };
        if a.egress {
            egress_ips.push(EgressIpSpec { ip: *ip, ports: None, answer_neighbor: true });
            // A Service's VIP: its Service ports stay the kernel's.
            if matches!(a.owner, Owner::Service { .. }) {
                service_addresses.push(*ip);
            }
        } else {
            neighbor_addresses.push(*ip);
        }
        neighbor_addresses.extend(a.next_hop);
    }
    neighbor_addresses.sort();
    out.tables = TablesSpec {
        policies,
        egress_ips,
        neighbor_addresses,
        nat: local.nat,
        service_addresses,
        guard: local.guard.clone(),
        // The daemon's sink adds the node's addresses (from the kernel).
        local_addresses: Vec::new(),
    };

    // Cloud pools' private addresses -> their public addresses (recorded).
    let public_ips: BTreeMap<IpAddr, String> = obs
        .pools
        .iter()
        .filter(|p| p.spec.cloud.is_some())
        .flat_map(|p| p.status.iter().flat_map(|st| st.cloud_addresses.iter()))
        .filter_map(|a| Some((a.private_ip.parse().ok()?, a.public_ip.clone())))
        .collect();
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
        if s.per_node.is_some() {
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
                Some((r, m)) => cond(condition::IP_ASSIGNED, false, r, m.clone()),
                None => cond(
                    condition::IP_ASSIGNED,
                    true,
                    reason::ASSIGNED,
                    format!("{} Node address(es): {}", by_node.len(), by_node.join(", ")),
                ),
            };
            let gw_cond = cond(
                condition::GATEWAY_ASSIGNED,
                true,
                reason::PER_NODE,
                "no gateway: each Node SNATs its selected pods to its own address".into(),
            );
            let ready = if ip_cond.status != "True" {
                cond(condition::READY, false, &ip_cond.reason, ip_cond.message.clone())
            } else {
                cond(
                    condition::READY,
                    true,
                    reason::ENFORCED,
                    format!(
                        "{} selected pod(s) leave with their Node's address ({})",
                        st.selected_pods,
                        by_node.join(", ")
                    ),
                )
            };
            st.conditions = vec![ready, ip_cond, gw_cond];
            out.policy_status.insert(p.name.clone(), st);
            continue;
        }
        let mut awaiting = Vec::new();
        let mut no_gateway = Vec::new();
        let mut held_by = Vec::new();
        for (ip, nh) in &s.granted {
            let lease = obs.leases.get(ip);
            let holder = lease.and_then(|l| live_holder(l, now)).map(str::to_string);
            let since =
                holder.as_ref().and_then(|_| lease.and_then(|l| l.acquire_time)).map(|t| Time(whole_seconds(t)));
            match &holder {
                Some(h) => held_by.push(format!("{ip} on {h}")),
                None if out.ips.get(ip).is_some_and(|a| a.candidates.is_empty()) => no_gateway.push(ip.to_string()),
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
                format!(
                    "waiting for an eligible gateway to take the Lease of {}: is egret running on the gateway Nodes?",
                    awaiting.join(", ")
                ),
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

    // Cloud pools' recorded private addresses (pool, subnet, address), and
    // those the pools paired so far in this pass (subnet, address).
    let cloud_recorded: Vec<(&str, String, IpAddr)> = pools
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
        .collect();
    let mut cloud_proposed: Vec<(String, IpAddr)> = Vec::new();
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
        if let Some(cloud) = &info.spec.cloud {
            let recorded = info.status.as_ref().map(|s| s.cloud_addresses.as_slice()).unwrap_or(&[]);
            st.cloud_addresses = recorded.to_vec();
            let synced =
                |ok: bool, r: &str, m: String| condition(condition::CLOUD_SYNCED, ok, r, m, info.generation, prev, now);
            let c = match (cloud_spec(cloud, &info.spec.addresses), obs.cloud.get(*name)) {
                (Err((r, m)), _) => synced(false, r, m),
                (Ok(_), None) => {
                    synced(false, reason::CLOUD_DISCOVERING, "the cloud provider has not answered yet".into())
                }
                (Ok(_), Some(Err(e))) => synced(
                    false,
                    reason::CLOUD_API_ERROR,
                    format!("{e}; the recorded pairing ({} addresses) stays in use", recorded.len()),
                ),
                (Ok((sel, allowed)), Some(Ok(found))) => {
                    // Pools of one subnet share its addresses: those paired
                    // before this one in this pass count as proposed, the
                    // later ones by their records.
                    let others: BTreeSet<IpAddr> = cloud_recorded
                        .iter()
                        .filter(|(pool, subnet, _)| pool > name && *subnet == sel.subnet_id)
                        .map(|(_, _, ip)| *ip)
                        .chain(cloud_proposed.iter().filter(|(s, _)| *s == sel.subnet_id).map(|(_, ip)| *ip))
                        .collect();
                    let pairing = crate::cloud::pairing::pair(recorded, found, Some(&allowed), &others);
                    cloud_proposed.extend(
                        pairing
                            .addresses
                            .iter()
                            .filter_map(|a| Some((sel.subnet_id.clone(), a.private_ip.parse().ok()?))),
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
            };
            st.conditions.push(c);
        }
        out.pool_status.insert(name.to_string(), st);
    }

    for s in &sources {
        if let Owner::Service { namespace, name } = &s.owner {
            out.service_pods
                .insert((namespace.clone(), name.clone()), selected_pods.get(&s.owner).copied().unwrap_or(0));
            if s.invalid.is_none()
                && !s.granted.is_empty()
                && s.granted.iter().all(|(ip, _)| out.ips.get(ip).is_some_and(|a| a.candidates.is_empty()))
            {
                out.service_problems.push(ServiceProblem {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    reason: reason::NO_ELIGIBLE_GATEWAY,
                    message: format!(
                        "no gateway Node can carry the VIP of Service {namespace}/{name}: label gateway Nodes {}=true",
                        super::crd::GATEWAY_LABEL
                    ),
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::k8s::crd::{AwsPoolSpec, CloudAddressStatus, EgressIPSpec, PoolCloudSpec, PoolRef};
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
        NodeInfo { name: name.into(), labels: labels(l) }
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
            vec![EgressIpSpec { ip: ip("198.51.100.10"), ports: None, answer_neighbor: true }]
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
            assert_eq!(
                d.tables.egress_ips.iter().map(|e| e.ip).collect::<Vec<_>>(),
                vec![ip("198.51.100.10")],
                "{what}"
            );
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
        obs.policies = vec![
            team_policy("young", 50, &["198.51.100.10", "198.51.100.11"]),
            team_policy("old", 1, &["198.51.100.10"]),
        ];
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
            vec![PoolAllocation { policy: "pooled".into(), ips: vec!["198.51.100.10".into()], node: None }]
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
        };
        assert_eq!(
            d.pool_status["nodes"].allocations,
            vec![
                alloc("w1", &["203.0.113.50", "2001:db8:113::50"]),
                alloc("w2", &["203.0.113.51", "2001:db8:113::51"])
            ]
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
                EgressIPPoolSpec { cloud: Some(PoolCloudSpec { aws: None }), ..Default::default() },
                reason::CLOUD_NOT_SUPPORTED,
                "spec.cloud: names no provider; set spec.cloud.aws",
            ),
            (
                EgressIPPoolSpec { cloud: Some(aws_pool(&[], "subnet-0a1b")), ..Default::default() },
                reason::INVALID_SPEC,
                "spec.cloud.aws.tags: empty; name the tags that mark this pool's Elastic IPs (an empty set would take every Elastic IP of the account)",
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
                reason::INVALID_ADDRESS,
                "spec.addresses: IPv6 with spec.cloud.aws: Elastic IPs are IPv4; an IPv6 pool needs no cloud section",
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
        }
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
                Ok(Discovered {
                    public: vec![public],
                    subnet_cidr: "203.0.113.0/24".parse().unwrap(),
                    used: [].into(),
                }),
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
            vec![EgressIpSpec { ip: ip("198.51.100.20"), ports: None, answer_neighbor: true }]
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
}
