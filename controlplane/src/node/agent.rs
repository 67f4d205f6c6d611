//! The agent's loop: watchers feed reflector stores; on a change (after a
//! short debounce), after a failed pass (in 1 s) and every resync period,
//! one *pass* runs:
//!
//! 1. observed state (this node's pods only, the policies, pools, Services
//!    and namespaces) -> [`desired`] (the gateways' own function) -> the
//!    compiled tables -> [`plan`];
//! 2. the kernel's current rules and tables are read, and each next hop's
//!    path decided from the node's route to it (`tunnel.rs`: on-link,
//!    through `egret-vxlan`, or none, whose pods are not steered);
//! 3. the nftables table is installed with the union of what is and what
//!    will be steered, so a pod's first packet routed to a gateway already
//!    keeps its source (a masqueraded first packet would pin the connection
//!    to the node's address in conntrack);
//! 4. `egret-vxlan` is made right when a next hop needs it;
//!    [`reconcile`]'s operations are applied in order; an operation that
//!    fails is reported and retried next pass, and a pod whose new table
//!    could not be filled keeps its old rule;
//! 5. `egret-vxlan` is removed when no next hop needs it; the kernel is read
//!    again and the nftables table is installed with
//!    exactly what is steered now (strict mode: a pod counts as classified
//!    once its rule is in place);
//! 6. the status file and metrics are updated.
//!
//! A pass that failed in the kernel is retried after 1 s, doubling up to the
//! resync period; a policy the gateways leave out (an invalid spec) is
//! reported in the status and not retried.
//!
//! Nothing is programmed before the watches have synced. A stopping agent
//! leaves the kernel as it is (a restarted agent finds its rules and keeps
//! them; `egret node cleanup` removes them) unless its DaemonSet is deleted
//! or no longer selects the Node: then it removes everything it put there
//! ([`crate::k8s::uninstall`]).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use egret_dataplane::tables::{NatSettings, PolicySlots, SpecError, Tables};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::Store;
use kube::runtime::watcher;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::health;
use super::kernel::Kernel;
use super::nft::{self, Sets, Strict};
use super::plan::{plan, Plan};
use super::reconcile::{reconcile, KernelView, Op, RuleShape};
use super::repair::{self, NextHops, RepairCounters};
use super::status::{self, NextHopRow, NodeStatus, UseRow};
use super::tunnel::{self, Path};
use super::{NodeError, NodeOptions};
use crate::k8s::controller::{watch, watch_node_metadata};
use crate::k8s::crd::{EgressIPPool, EgressPolicy};
use crate::k8s::desired::{desired, LocalConfig, Observed, Role};
use crate::k8s::observe;
use crate::k8s::uninstall::Watch as Ending;

/// How long changes must pause before a pass.
const DEBOUNCE: Duration = Duration::from_millis(20);
/// How soon a pass that failed somewhere is retried.
const RETRY: Duration = Duration::from_secs(1);

struct Stores {
    pods: Store<Pod>,
    namespaces: Store<Namespace>,
    services: Store<Service>,
    policies: Store<EgressPolicy>,
    pools: Store<EgressIPPool>,
    /// This Node's metadata (its labels decide `PerNode` policies).
    node: Store<PartialObjectMeta<Node>>,
}

impl Stores {
    fn start(client: &kube::Client, node: &str, notify: &Arc<Notify>, tasks: &mut JoinSet<()>) -> Self {
        let all = watcher::Config::default();
        Stores {
            pods: watch(
                Api::all(client.clone()),
                all.clone().fields(&format!("spec.nodeName={node}")),
                notify.clone(),
                tasks,
            ),
            namespaces: watch(Api::all(client.clone()), all.clone(), notify.clone(), tasks),
            services: watch(Api::all(client.clone()), all.clone(), notify.clone(), tasks),
            policies: watch(Api::all(client.clone()), all.clone(), notify.clone(), tasks),
            pools: watch(Api::all(client.clone()), all.clone(), notify.clone(), tasks),
            node: watch_node_metadata(
                Api::all(client.clone()),
                all.fields(&format!("metadata.name={node}")),
                notify.clone(),
                tasks,
            ),
        }
    }

    async fn ready(&self) {
        let _ = futures::join!(
            self.pods.wait_until_ready(),
            self.namespaces.wait_until_ready(),
            self.services.wait_until_ready(),
            self.policies.wait_until_ready(),
            self.pools.wait_until_ready(),
            self.node.wait_until_ready(),
        );
    }

    fn observed(&self) -> Observed {
        Observed {
            namespaces: self.namespaces.state().iter().map(|n| observe::namespace(n)).collect(),
            pods: observe::pods(self.pods.state().iter().map(|p| &**p)),
            services: self.services.state().iter().filter_map(|s| observe::service(s)).collect(),
            policies: self.policies.state().iter().map(|p| observe::policy(p)).collect(),
            pools: self.pools.state().iter().map(|p| observe::ip_pool(p)).collect(),
            nodes: self.node.state().iter().map(|n| observe::node_meta(&n.metadata)).collect(),
            ..Default::default()
        }
    }
}

/// What one pass computed from the cluster.
#[derive(Debug, Default)]
pub struct Computed {
    /// The plan.
    pub plan: Plan,
    /// Every local pod address.
    pub local: BTreeSet<IpAddr>,
    /// Egress IP -> next hop (itself when it has no companion).
    pub next_hop: BTreeMap<IpAddr, IpAddr>,
    /// Policies the gateways leave out, and why.
    pub errors: Vec<String>,
}

/// Why a pass could not compute the node's plan.
#[derive(Debug, thiserror::Error)]
pub enum ComputeError {
    /// The desired tables were refused as a whole (their global settings,
    /// e.g. `nat.ports` from `--nat-ports`; the error names the field and
    /// the value).
    #[error("compiling the policies: {0}")]
    Compile(#[source] SpecError),
}

/// Why a pass stopped before it could apply the plan (what it could not
/// apply after that is in its list of errors, and retried).
#[derive(Debug, thiserror::Error)]
enum PassError {
    /// The plan.
    #[error(transparent)]
    Compute(#[from] ComputeError),
    /// Reading the kernel's addresses, rules or routes.
    #[error(transparent)]
    Kernel(#[from] super::kernel::KernelError),
    /// Installing the nftables table for the union of the old and new
    /// steered pods.
    #[error(transparent)]
    Nft(#[from] nft::NftError),
}

/// Observed state -> the node's plan (pure: the same as the gateways'
/// [`desired`], restricted to this node's pods).
pub fn compute(obs: &Observed, opts: &NodeOptions, slots: &PolicySlots) -> Result<Computed, ComputeError> {
    let local_cfg = LocalConfig {
        node_name: opts.node_name.clone(),
        nat: NatSettings { ports: opts.nat_ports, ..NatSettings::default() },
        guard: Default::default(),
        tunnel_port: None,
        role: Role::Node,
    };
    let d = desired(obs, &local_cfg, Timestamp::now());
    let tables = Tables::compile(&d.tables, 1, slots).map_err(ComputeError::Compile)?;
    let companions: BTreeMap<IpAddr, IpAddr> =
        d.ips.iter().filter_map(|(ip, a)| a.next_hop.map(|n| (*ip, n))).collect();
    let local: BTreeSet<IpAddr> = obs.pods.iter().flat_map(|p| p.ips.iter().copied()).collect();
    let pods: Vec<IpAddr> = local.iter().copied().collect();
    let per_node: BTreeSet<String> = d.per_node.keys().cloned().collect();
    let plan = plan(&tables, &pods, &companions, &opts.cluster_cidrs, &per_node);
    let next_hop = d.ips.iter().map(|(ip, a)| (*ip, a.next_hop.unwrap_or(*ip))).collect();
    let errors = tables.errors.iter().map(|e| e.to_string()).collect();
    Ok(Computed { plan, local, next_hop, errors })
}

/// The nftables sets for a kernel state: steered pods are those with a
/// rule; strict mode's classified pods are the unselected local pods plus
/// the steered ones whose rule is in place.
fn sets(
    view: &KernelView,
    extra: Option<&Plan>,
    c: &Computed,
    strict: Option<&Strict>,
    steer_mark: u32,
    tunnel: bool,
) -> Sets {
    let mut steered: BTreeSet<IpAddr> = view.rules.iter().map(|r| r.pod).collect();
    let mut next_hops: BTreeSet<IpAddr> = view.tables.values().flatten().filter_map(|r| r.via).collect();
    if let Some(p) = extra {
        steered.extend(p.pods.keys());
        next_hops.extend(p.next_hops.iter());
    }
    let strict = strict.map(|s| {
        let ruled: BTreeSet<IpAddr> = view.rules.iter().map(|r| r.pod).collect();
        let known = c.local.iter().filter(|ip| !c.plan.pods.contains_key(ip) || ruled.contains(ip)).copied().collect();
        Strict { known, ..s.clone() }
    });
    Sets { steer_mark, steered, next_hops, strict, snat: c.plan.snat.clone(), tunnel }
}

/// Applies `ops`, skipping what depends on a failed operation: a table
/// whose routes could not all be added is emptied again and no rule points
/// to it (the pod keeps its old rule, whose table is then not emptied).
/// Returns (applied, errors).
async fn apply_ops(
    kernel: &mut Kernel,
    ops: &[Op],
    kernel_before: &KernelView,
    shape: RuleShape,
) -> (u64, Vec<String>) {
    let mut failed_tables = BTreeSet::new();
    let mut skipped_pods = BTreeSet::new();
    let mut kept_tables = BTreeSet::new();
    let mut added: BTreeMap<u32, Vec<super::plan::Route>> = BTreeMap::new();
    let mut applied = 0;
    let mut errors = Vec::new();
    for op in ops {
        let skip = match op {
            Op::AddRoute { table, .. } => failed_tables.contains(table),
            Op::AddRule { pod, table } if failed_tables.contains(table) => {
                skipped_pods.insert(*pod);
                kept_tables.extend(kernel_before.rules.iter().filter(|r| r.pod == *pod).map(|r| r.table));
                true
            }
            Op::AddRule { .. } => false,
            Op::DelRule(r) => skipped_pods.contains(&r.pod),
            Op::DelRoute { table, .. } => kept_tables.contains(table),
        };
        if skip {
            continue;
        }
        match kernel.apply(op, shape).await {
            Ok(()) => {
                applied += 1;
                if let Op::AddRoute { table, route } = op {
                    added.entry(*table).or_default().push(*route);
                }
            }
            Err(e) => {
                errors.push(e.to_string());
                if let Op::AddRule { pod, .. } = op {
                    // The pod keeps its old rule and table.
                    skipped_pods.insert(*pod);
                    kept_tables.extend(kernel_before.rules.iter().filter(|r| r.pod == *pod).map(|r| r.table));
                }
                if let Op::AddRoute { table, .. } = op {
                    failed_tables.insert(*table);
                    // Leave no partial table behind.
                    for route in added.remove(table).unwrap_or_default() {
                        if let Err(e) = kernel.apply(&Op::DelRoute { table: *table, route }, shape).await {
                            errors.push(e.to_string());
                        }
                    }
                }
            }
        }
    }
    (applied, errors)
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// The agent's state between passes.
struct Agent {
    opts: NodeOptions,
    kernel: Kernel,
    slots: PolicySlots,
    strict: Option<Strict>,
    status: Arc<Mutex<NodeStatus>>,
    /// The Node's InternalIPs (the tunnel's outer sources), and when they
    /// were read.
    node_ips: NodeIps,
    /// Each next hop's path at the last pass (a change is logged once).
    paths: BTreeMap<IpAddr, Path>,
    /// The next hops in use, shared with the repair task.
    hops: NextHops,
}

/// The Node's InternalIPs, read at start and again every resync period
/// (they rarely change; a read per pass would load the API server).
struct NodeIps {
    client: kube::Client,
    node: String,
    ips: Vec<IpAddr>,
    read: Option<std::time::Instant>,
}

impl NodeIps {
    async fn get(&mut self, every: Duration) -> &[IpAddr] {
        if self.read.is_none_or(|t| t.elapsed() >= every) {
            match node_internal_ips(&self.client, &self.node).await {
                Ok(ips) => {
                    if ips != self.ips {
                        tracing::info!(node = %self.node, ?ips, "the Node's InternalIPs (the tunnel's outer sources)");
                    }
                    self.ips = ips;
                    self.read = Some(std::time::Instant::now());
                }
                // Kept as they were; tried again next pass.
                Err(e) => tracing::warn!(error = %e, "reading the Node's InternalIPs"),
            }
        }
        &self.ips
    }
}

/// What one pass decided about paths.
#[derive(Debug, Default)]
struct PassPaths {
    paths: BTreeMap<IpAddr, Path>,
    unsteered: BTreeSet<IpAddr>,
    per_hop: BTreeMap<IpAddr, usize>,
}

impl Agent {
    /// One pass; returns whether everything was applied.
    async fn pass(&mut self, obs: &Observed) -> bool {
        let mut errors = Vec::new();
        let mut changes = 0;
        let outcome = self.pass_inner(obs, &mut errors, &mut changes).await;
        // Kernel and nft failures decide the retry; a policy the gateways
        // leave out is reported, not retried.
        let ok = outcome.is_ok() && errors.is_empty();
        let mut s = self.status.lock();
        s.syncs += 1;
        s.changes_total += changes;
        s.errors_total += errors.len() as u64 + u64::from(outcome.is_err());
        s.programmed |= ok;
        s.last_sync = Some(Timestamp::now().to_string());
        s.last_sync_unix = now_unix();
        match outcome {
            Ok((c, view, p)) => {
                s.pods_unsteered = p.unsteered.len();
                s.next_hops = p
                    .paths
                    .iter()
                    .map(|(hop, path)| NextHopRow {
                        next_hop: *hop,
                        path: path.kind().to_string(),
                        reason: path.reason().map(str::to_string),
                        source: if let Path::Vxlan { src, .. } = path { Some(*src) } else { None },
                        mtu: if let Path::Vxlan { mtu, .. } = path { Some(*mtu) } else { None },
                        pods_unsteered: p.per_hop.get(hop).copied().unwrap_or(0),
                    })
                    .collect();
                s.pods_local = c.local.len();
                s.pods_steered = view.rules.iter().map(|r| r.pod).collect::<BTreeSet<_>>().len();
                s.rules = view.rules.len();
                s.tables = view.tables.len();
                s.uses = c
                    .plan
                    .pods_per_use()
                    .into_iter()
                    .map(|(u, pods)| UseRow {
                        policy: u.policy.clone(),
                        egress_ip: u.egress_ip,
                        next_hop: c.next_hop.get(&u.egress_ip).copied().unwrap_or(u.egress_ip),
                        pods,
                    })
                    .collect();
                errors.extend(c.errors);
            }
            Err(e) => errors.push(e.to_string()),
        }
        for e in &errors {
            tracing::warn!(error = %e, "node agent pass");
        }
        s.last_sync_ok = ok;
        s.errors = errors;
        if let Err(e) = status::write(&self.opts.status_file, &s) {
            tracing::warn!(file = %self.opts.status_file.display(), error = %e, "writing the status file");
        }
        ok
    }

    async fn pass_inner(
        &mut self,
        obs: &Observed,
        errors: &mut Vec<String>,
        changes: &mut u64,
    ) -> Result<(Computed, KernelView, PassPaths), PassError> {
        let c = compute(obs, &self.opts, &self.slots)?;
        // PerNode addresses first: SNAT to an address the node does not
        // hold yet would lose the replies.
        let held = self.kernel.addresses().await?;
        for ip in c.plan.node_addresses.iter().filter(|ip| !held.iter().any(|(_, h)| h == *ip)) {
            match self.kernel.default_interface(*ip).await? {
                Some(index) => match self.kernel.address(true, index, *ip).await {
                    Ok(()) => *changes += 1,
                    Err(e) => errors.push(e.to_string()),
                },
                None => errors
                    .push(format!("per-node address {ip}: no default route of its family to choose the interface")),
            }
        }
        let before = self.kernel.view().await?;
        // Each next hop's path, from the node's routing now.
        *self.hops.lock() = c.plan.next_hops.clone();
        let topts = self.opts.tunnel;
        let node_ips = self.node_ips.get(self.opts.resync_period).await.to_vec();
        let mut paths = tunnel::paths(&mut self.kernel, &c.plan.next_hops, &node_ips, &topts).await?;
        let had_device = self.kernel.tunnel_index().await?.is_some();
        // Keep sources for the union first; without it, change nothing.
        // nft runs up to its timeout: off the runtime's other tasks (the
        // watchers keep reading meanwhile). The tunnel's chains (the drop
        // of what arrives on egret-vxlan) are in before the device is up.
        let mark = self.opts.steer_mark;
        let wanted = tunnel::steer(&c.plan, &paths);
        let use_tunnel = tunnel::device_mtu(&paths).is_some();
        let union = sets(&before, Some(&wanted.plan), &c, self.strict.as_ref(), mark, use_tunnel || had_device);
        tokio::task::block_in_place(|| nft::install(&union))?;
        if let Some(e) = tunnel::ensure_device(&mut self.kernel, &mut paths, &topts).await {
            errors.push(e);
        }
        let steering = tunnel::steer(&c.plan, &paths);
        self.log_paths(&paths);
        let shape = RuleShape { priority: self.opts.rule_priority, mark };
        match reconcile(&before, &steering.plan, self.opts.tables, shape) {
            Ok(ch) => {
                let (applied, errs) = apply_ops(&mut self.kernel, &ch.ops, &before, shape).await;
                *changes += applied;
                errors.extend(errs);
            }
            Err(e) => errors.push(e.to_string()),
        }
        match tunnel::retire_device(&mut self.kernel, &paths).await {
            Ok(true) => {
                *changes += 1;
                tracing::info!(device = tunnel::DEVICE, "no next hop needs the tunnel any more: device removed");
            }
            Ok(false) => {}
            Err(e) => errors.push(e.to_string()),
        }
        let after = self.kernel.view().await?;
        let in_use = self.kernel.tunnel_index().await?.is_some();
        let now = sets(&after, None, &c, self.strict.as_ref(), mark, in_use);
        if let Err(e) = tokio::task::block_in_place(|| nft::install(&now)) {
            errors.push(e.to_string());
        } else {
            // Addresses no PerNode policy uses any more, once nothing SNATs to them.
            for (index, ip) in held.iter().filter(|(_, ip)| !c.plan.node_addresses.contains(ip)) {
                match self.kernel.address(false, *index, *ip).await {
                    Ok(()) => *changes += 1,
                    Err(e) => errors.push(e.to_string()),
                }
            }
        }
        let per_hop = tunnel::unsteered_per_hop(&c.plan, &paths);
        Ok((c, after, PassPaths { paths, unsteered: steering.unsteered, per_hop }))
    }

    /// Logs each next hop whose path changed since the last pass, once.
    fn log_paths(&mut self, paths: &BTreeMap<IpAddr, Path>) {
        for (hop, path) in paths {
            if self.paths.get(hop) == Some(path) {
                continue;
            }
            match path {
                Path::None(why) => tracing::warn!(
                    next_hop = %hop,
                    reason = %why,
                    "next hop has no path: pods using it are not steered (egret node status)"
                ),
                Path::OnLink => tracing::info!(next_hop = %hop, "next hop on a link: on-link route"),
                Path::Vxlan { src, mtu } => tracing::info!(
                    next_hop = %hop, source = %src, mtu, device = tunnel::DEVICE,
                    "next hop behind a router: encapsulated route"
                ),
            }
        }
        self.paths = paths.clone();
    }
}

/// The Node's InternalIPs (`status.addresses`): the outer sources of the
/// tunnel, which the gateways check against every Node's.
async fn node_internal_ips(client: &kube::Client, node: &str) -> Result<Vec<IpAddr>, NodeError> {
    let n = Api::<Node>::all(client.clone())
        .get(node)
        .await
        .map_err(|e| NodeError::Node { node: node.to_string(), message: e.to_string() })?;
    let mut out: Vec<IpAddr> = n
        .status
        .and_then(|s| s.addresses)
        .unwrap_or_default()
        .into_iter()
        .filter(|a| a.type_ == "InternalIP")
        .filter_map(|a| a.address.trim().parse().ok())
        .collect();
    out.dedup();
    Ok(out)
}

/// The node's pod CIDRs from its Node object (strict mode; empty when the
/// CNI does not use them).
async fn node_pod_cidrs(client: &kube::Client, node: &str) -> Result<Vec<ipnet::IpNet>, NodeError> {
    let err = |message: String| NodeError::Node { node: node.to_string(), message };
    let n = Api::<Node>::all(client.clone()).get(node).await.map_err(|e| err(e.to_string()))?;
    let spec = n.spec.unwrap_or_default();
    let mut cidrs: Vec<String> = spec.pod_cidrs.unwrap_or_default();
    cidrs.extend(spec.pod_cidr);
    let mut out: Vec<ipnet::IpNet> = Vec::new();
    for c in cidrs {
        let net = c.parse().map_err(|_| err(format!("spec.podCIDRs: {c:?} is not a CIDR")))?;
        if !out.contains(&net) {
            out.push(net);
        }
    }
    Ok(out)
}

/// A local pod whose address lies in none of the cluster CIDRs, named with
/// the value: the CIDRs are wrong for this cluster (the agent would steer
/// traffic to that pod's peers to the gateways), so the agent refuses to
/// start rather than guess. Host-network pods are not looked at.
fn outside_cluster(pods: &[crate::k8s::desired::PodInfo], cidrs: &[ipnet::IpNet]) -> Option<String> {
    let (p, ip) =
        pods.iter().find_map(|p| p.ips.iter().find(|ip| !cidrs.iter().any(|c| c.contains(*ip))).map(|ip| (p, ip)))?;
    let list: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
    Some(format!(
        "--cluster-cidr {}: pod {}/{} on this node has address {ip}, in none of them (give every pod and Service CIDR of the cluster: the chart's cluster.podCIDRs and cluster.serviceCIDRs)",
        list.join(","),
        p.namespace,
        p.name
    ))
}

/// When the last pass finished (since the watches synced, before the first
/// one): what `/healthz` judges the loop by ([`health`]).
type PassDone = Arc<Mutex<Option<std::time::Instant>>>;

async fn serve_metrics(listener: TcpListener, status: Arc<Mutex<NodeStatus>>, pass_done: PassDone, resync: Duration) {
    let handler = move |path: &str| -> (u16, &'static str, String) {
        let s = status.lock().clone();
        let probe = health::Probe {
            synced: s.synced,
            programmed: s.programmed,
            since_pass: pass_done.lock().map(|t| t.elapsed()),
            resync,
        };
        let answer = |r: Result<(), health::ProbeFailure>, ok: &str| match r {
            Ok(()) => (200, "text/plain", format!("{ok}\n")),
            Err(why) => (503, "text/plain", format!("not {ok}: {why}\n")),
        };
        match path {
            "/metrics" => (200, crate::metrics::CONTENT_TYPE, status::metrics(&s)),
            "/ready" => answer(probe.ready(), "ready"),
            "/healthz" => answer(probe.alive(), "ok"),
            _ => (404, "text/plain", "try /metrics, /ready or /healthz\n".into()),
        }
    };
    crate::metrics::serve_fn(listener, Arc::new(handler)).await;
}

/// Runs the agent until `shutdown` completes.
pub async fn run(opts: NodeOptions, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
    opts.validate()?;
    let client = crate::k8s::client(opts.kubeconfig.as_deref()).await?;
    let status = Arc::new(Mutex::new(NodeStatus {
        node: opts.node_name.clone(),
        pid: std::process::id(),
        strict: opts.strict,
        ..Default::default()
    }));
    let mut tasks = JoinSet::new();
    let pass_done = PassDone::default();
    if let Some(addr) = opts.metrics_listen {
        let listener = TcpListener::bind(addr).await.map_err(|source| NodeError::Listen { addr, source })?;
        tasks.spawn(serve_metrics(listener, status.clone(), pass_done.clone(), opts.resync_period));
    }
    let strict = if opts.strict {
        let local = if opts.pod_cidrs.is_empty() {
            let from_node = node_pod_cidrs(&client, &opts.node_name).await?;
            if from_node.is_empty() {
                // Calico's IPAM and the cloud VPC CNIs leave spec.podCIDRs
                // empty: any cluster address may be a pod of this node.
                tracing::info!(
                    "strict mode: the Node has no spec.podCIDRs (Calico IPAM, a VPC CNI): guarding the cluster CIDRs (--cluster-cidr) instead"
                );
                opts.cluster_cidrs.clone()
            } else {
                from_node
            }
        } else {
            opts.pod_cidrs.clone()
        };
        tracing::info!(pod_cidrs = ?local, "strict mode: unclassified local pods cannot leave the cluster");
        Some(Strict { local, cluster: opts.cluster_cidrs.clone(), known: BTreeSet::new() })
    } else {
        None
    };
    let kernel = Kernel::open(opts.tables)?;
    let ending = Ending::start(client.clone(), opts.pod.clone(), &opts.node_name);
    let notify = Arc::new(Notify::new());
    let repairs = Arc::new(RepairCounters::default());
    let hops: NextHops = Arc::default();
    let repair_task = match repair::start(notify.clone(), repairs.clone(), hops.clone()) {
        Ok(task) => Some(tokio::spawn(task)),
        Err(e) => {
            tracing::warn!(error = %e, "no kernel notifications: what the host removes is repaired at the resync only");
            None
        }
    };
    let stores = Stores::start(&client, &opts.node_name, &notify, &mut tasks);
    let mut shutdown = std::pin::pin!(shutdown);
    tracing::info!(node = %opts.node_name, "waiting for the watches to sync");
    tokio::select! {
        _ = stores.ready() => {}
        _ = &mut shutdown => {
            tasks.abort_all();
            if let Some(t) = repair_task {
                t.abort();
            }
            return stop(kernel, ending).await;
        }
    }
    if let Some(why) = outside_cluster(&stores.observed().pods, &opts.cluster_cidrs) {
        tasks.abort_all();
        if let Some(t) = repair_task {
            t.abort();
        }
        return Err(NodeError::Options(why));
    }
    status.lock().synced = true;
    *pass_done.lock() = Some(std::time::Instant::now());
    tracing::info!("watches synced; reconciling");
    let resync = opts.resync_period;
    let node_ips = NodeIps { client: client.clone(), node: opts.node_name.clone(), ips: Vec::new(), read: None };
    let mut agent =
        Agent { opts, kernel, slots: PolicySlots::default(), strict, status, node_ips, paths: BTreeMap::new(), hops };
    let mut failures: u32 = 0;
    loop {
        // Before the pass: it writes the status file.
        agent.status.lock().repair_wakes = repairs.wakes.load(std::sync::atomic::Ordering::Relaxed);
        let ok = agent.pass(&stores.observed()).await;
        *pass_done.lock() = Some(std::time::Instant::now());
        // A watch or the metrics server that ended (a panic: they retry
        // everything else) leaves the agent blind or unprobed.
        if let Some(ended) = tasks.try_join_next() {
            let what = match ended {
                Err(e) if e.is_panic() => "a watch or the metrics server panicked".to_owned(),
                _ => "a watch or the metrics server".to_owned(),
            };
            tracing::error!("{what}; exiting");
            tasks.abort_all();
            if let Some(t) = &repair_task {
                t.abort();
            }
            return Err(NodeError::TaskEnded(what));
        }
        // After a failure: 1 s, doubling up to the resync period.
        failures = if ok { 0 } else { failures.saturating_add(1) };
        let wait = if ok { resync } else { RETRY.saturating_mul(1 << (failures - 1).min(5)).min(resync) };
        tokio::select! {
            _ = notify.notified() => tokio::time::sleep(DEBOUNCE).await,
            _ = tokio::time::sleep(wait) => {}
            _ = &mut shutdown => break,
        }
    }
    tasks.abort_all();
    if let Some(t) = repair_task {
        t.abort();
    }
    stop(agent.kernel, ending).await
}

/// The last step: a restart keeps the kernel as it is (the next agent finds
/// its rules); an uninstall or a retirement removes everything the agent
/// put on the node, as `egret node cleanup` does.
async fn stop(mut kernel: Kernel, ending: Ending) -> Result<(), NodeError> {
    let ending = ending.ending().await;
    if !ending.cleans_up() {
        tracing::info!(why = ending.reason(), "stopping; the kernel keeps its rules (egret node cleanup removes them)");
        return Ok(());
    }
    tracing::info!(why = ending.reason(), "stopping for good: removing Egret's rules, routes, addresses and tables");
    let n = kernel.remove_all().await?;
    tokio::task::spawn_blocking(nft::remove)
        .await
        .map_err(|e| NodeError::TaskEnded(format!("the nftables clean-up: {e}")))??;
    tracing::info!(removed = n, "node cleaned up: nothing of Egret's is left");
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::k8s::desired::PodInfo;

    fn pod(name: &str, ips: &[&str]) -> PodInfo {
        PodInfo {
            namespace: "team-a".into(),
            name: name.into(),
            labels: Default::default(),
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn a_local_pod_outside_the_cluster_cidrs_is_named_with_the_value() {
        let cidrs: Vec<ipnet::IpNet> =
            ["198.18.0.0/16", "2001:db8:18::/48"].iter().map(|s| s.parse().unwrap()).collect();
        let inside = [pod("a", &["198.18.1.10", "2001:db8:18:1::a"])];
        assert_eq!(outside_cluster(&inside, &cidrs), None);
        let outside = [pod("a", &["198.18.1.10"]), pod("b", &["198.19.0.7"])];
        assert_eq!(
            outside_cluster(&outside, &cidrs).unwrap(),
            "--cluster-cidr 198.18.0.0/16,2001:db8:18::/48: pod team-a/b on this node has address 198.19.0.7, in none of them \
             (give every pod and Service CIDR of the cluster: the chart's cluster.podCIDRs and cluster.serviceCIDRs)"
        );
    }

    #[test]
    fn tables_that_do_not_compile_are_named_with_the_field_and_the_value() {
        let mut opts = NodeOptions::new("w1");
        opts.nat_ports = egret_dataplane::nat::port_alloc::PortRange { first: 2000, last: 1000 };
        let e = compute(&Observed::default(), &opts, &PolicySlots::default()).unwrap_err();
        assert!(matches!(e, ComputeError::Compile(SpecError::InvalidPortRange { .. })), "{e:?}");
        assert_eq!(
            e.to_string(),
            "compiling the policies: nat.ports: invalid port range 2000-1000 (need 1 <= first <= last)"
        );
    }
}
