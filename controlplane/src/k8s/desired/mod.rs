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
//!
//! [`desired`] is the composition of its phases, in this order, one
//! function each: `pools` (parse the pools, their recorded allocations, and
//! the requests those make), `sources` (policies and Services, oldest
//! first), `per_node` (`PerNode` records and target Nodes), `claims` (who
//! gets each address), `allocations` (new pool allocations), `selection`
//! (pods, candidates, tables) and `status` (policies, pools, Services).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use egret_dataplane::tables::{hrw_score, NatSettings, SourceGuard, TablesSpec};
use k8s_openapi::jiff::Timestamp;

use super::crd::{EgressIPPoolSpec, EgressIPPoolStatus, EgressPolicySpec, EgressPolicyStatus};

mod allocations;
mod claims;
mod per_node;
mod pools;
mod selection;
mod sources;
mod status;
#[cfg(test)]
mod tests;

/// The cloud pool spec check lives in [`crate::cloud`] (over the CRD
/// types); re-exported under its old path.
pub use crate::cloud::cloud_spec;
pub use status::keep_transition_times;

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
    /// `status.addresses` of type InternalIP: the outer sources the
    /// gateways accept in the nodes' tunnel (docs/adr/0031).
    pub internal_ips: Vec<IpAddr>,
    /// `spec.providerID` (a cloud's instance: `PerNode` cloud pools).
    pub provider_id: Option<String>,
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
    /// `PerNode` cloud pools: the worker Nodes' addresses the status
    /// writer's cloud task associated (Ok), or its last failure (Err), by
    /// (Node, public address). Empty elsewhere: the record decides.
    pub node_cloud: NodeCloudObserved,
}

/// [`Observed::node_cloud`].
pub type NodeCloudObserved =
    BTreeMap<crate::cloud::node_addresses::NodeKey, Result<crate::cloud::NodeAddress, crate::cloud::CloudError>>;

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
    /// The nodes' tunnel port (`tunnel.port`; None: `tunnel.enabled:
    /// false`): every Node's InternalIPs may send into it.
    pub tunnel_port: Option<u16>,
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
    /// [`reason::SERVICE_PORT_IN_NAT_RANGE`](super::crd::reason::SERVICE_PORT_IN_NAT_RANGE)).
    pub egress: bool,
    /// Eligible gateways, most preferred first (rendezvous hashing).
    pub candidates: Vec<String>,
    /// Port blocks on it (its policy's or pool's `portBlocks`); `None`:
    /// the gateway's `nat.portBlocks`.
    pub port_blocks: Option<egret_dataplane::nat::port_blocks::PortBlocks>,
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
    /// `PerNode` cloud pools: the worker Nodes' addresses the status
    /// writer's cloud task must make, check and release.
    pub node_cloud: crate::cloud::node_addresses::NodeWants,
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

impl crate::cloud::PoolView for PoolInfo {
    fn pool_name(&self) -> &str {
        &self.name
    }
    fn pool_spec(&self) -> &EgressIPPoolSpec {
        &self.spec
    }
    fn pool_status(&self) -> Option<&EgressIPPoolStatus> {
        self.status.as_ref()
    }
}

/// Observed state -> desired tables, candidacies and status: the phases in
/// order, each in its own function (see the submodules).
pub fn desired(obs: &Observed, local: &LocalConfig, now: Timestamp) -> Desired {
    let pools = pools::parse_pools(obs);
    let sources::SourceList { mut sources, mut service_problems } = sources::sources(obs, &local.nat);
    let recorded = pools::recorded_allocations(&obs.pools);
    let recorded_nodes = per_node::recorded_node_allocations(&obs.pools);
    let targets = per_node::per_node_targets(obs);
    pools::request_recorded(&mut sources, &pools, &recorded);
    let claims::Claims { mut claimed, conflicts } = claims::claim(&mut sources, &pools, &recorded_nodes, &targets);
    service_problems.extend(conflicts);
    let allocations::NewAllocations { allocations, exhausted } =
        allocations::allocate(&mut sources, &pools, &targets, &obs.node_cloud, &mut claimed);
    let node_cloud = per_node::node_cloud_wants(obs, &sources, &pools);
    let selection::Selection { ips, per_node, policies, selected_pods } = selection::select(obs, local, &mut sources);
    let tables = selection::tables(obs, local, &ips, policies);
    let public_ips = status::public_ips(obs);
    let policy_status = status::policy_statuses(obs, &sources, &selected_pods, &ips, &public_ips, now);
    let cloud_recorded = status::cloud_recorded(&pools);
    let pool_status = status::pool_statuses(obs, &pools, allocations, &exhausted, &cloud_recorded, now);
    let services = status::service_reports(&sources, &selected_pods, &ips);
    service_problems.extend(services.problems);
    service_problems.sort();
    Desired {
        tables,
        ips,
        policy_status,
        pool_status,
        service_problems,
        service_pods: services.pods,
        per_node,
        node_cloud,
    }
}
