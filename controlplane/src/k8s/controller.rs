//! The sync loop: watchers feed reflector stores; on any change, on a timer
//! due for the Lease state machine, and on a periodic full pass, one *pass*
//! runs:
//!
//! 1. observed state from the stores (plus the IPs the Lease state machine
//!    says this gateway holds at `now`) -> [`desired`];
//! 2. IPs whose renew deadline passed, or that this gateway no longer
//!    competes for, are fenced and `desired` recomputed without them;
//! 3. the TablesSpec goes to [`TablesSink::apply`] when it changed (always a
//!    whole spec); IPs that are new in it are announced (gratuitous ARP /
//!    unsolicited NA) once it is applied;
//! 4. only then the Lease actions are sent (each in its own task, bounded by
//!    the renew deadline, results fed back into the state machine), so a
//!    Lease is never released before its IP left the tables;
//! 5. statuses that differ from what the objects show are written, and
//!    Events for take-overs and Service problems are sent.
//!
//! Status is written by one gateway at a time (the first by name among the
//! gateways holding a live Lease, or the first eligible gateway by name when
//! no Lease looks live), so N gateways do not write N times; each object has
//! at most one write in flight, the newest status replaces one waiting, and
//! failures back off (status_writer.rs). Policy status is written with
//! server-side apply; pool status (the allocation record) with a merge patch
//! on the observed `resourceVersion`, so two writers cannot both allocate.
//!
//! If the API server is unreachable the stores keep their last contents, the
//! pass keeps running on its timer, renewals fail, and each IP is fenced as
//! its own deadline passes; everything else in the tables stays.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use egret_dataplane::tables::TablesSpec;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{Namespace, Node, ObjectReference, Pod, Service};
use k8s_openapi::api::events::v1::Event as KubeEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, PartialObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::DefaultBackoff;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Resource, ResourceExt};
use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::crd::{
    reason, EgressIPPool, EgressIPPoolStatus, EgressPolicy, EgressPolicyStatus, LEASE_IP_ANNOTATION, LEASE_LABEL,
    LEASE_LABEL_VALUE, LEASE_NEXT_HOP_ANNOTATION,
};
use super::desired::{desired, Desired, LocalConfig, NodeCloudObserved, Observed, Owner};
use super::lease::{lease_name, Action, Failure, LeaseManager, LeaseRecord, Taken};
use super::lease::{HaFields, FAILSAFE_ANNOTATION, INCARNATION_ANNOTATION, STANDBY_ANNOTATION};
use super::liveness::{LivenessAction, OwnOutcome, EPOCH_ANNOTATION, RECORD_DURATION_SECS};
use super::liveness_requests::send_liveness_request;
use super::renewer::{RenewInput, RenewTask, Renewer};
use super::stalled_watch::{newest_version, watch_shows, Restartable};
use super::status_writer::{StatusWriter, Written};
use super::valid_until::ValidUntil;
use super::{observe, Heartbeat, K8sError, K8sOptions};
use crate::sink::TablesSink;

/// The field manager of Egret's writes.
pub const FIELD_MANAGER: &str = "egret-gateway";
/// The reporting controller of Egret's Events.
pub const REPORTING_CONTROLLER: &str = "egret.dev/gateway";
/// How long a graceful shutdown waits for its Lease releases.
const RELEASE_WAIT: Duration = Duration::from_secs(2);
/// How long readiness waits for this gateway's standby copies after its
/// first pass (a rolling update goes on to the next gateway once it is ready).
const STANDBY_READY_WAIT: Duration = Duration::from_secs(20);
/// How long readiness, after the first pass, waits for the peer channel to a
/// holder that is not up yet before it stops counting that holder's IPs.
const CHANNEL_UP_WAIT: Duration = Duration::from_secs(5);
/// How long a graceful stop waits for the standbys' session copies.
const HANDOVER_SYNC_WAIT: Duration = Duration::from_secs(2);
/// How long an uninstalling or retiring gateway waits for the cloud to
/// release its addresses (the chart's grace period is 10 s: hand-over 2 s,
/// Lease releases 2 s, this; the DaemonSet is read meanwhile).
const CLOUD_RELEASE_WAIT: Duration = Duration::from_secs(3);

struct Stores {
    pods: Store<Pod>,
    namespaces: Store<Namespace>,
    services: Store<Service>,
    policies: Store<EgressPolicy>,
    pools: Store<EgressIPPool>,
    nodes: Store<Node>,
    all_nodes: Store<Node>,
    leases: Store<Lease>,
}

pub(crate) fn watch<K>(api: Api<K>, cfg: watcher::Config, notify: Arc<Notify>, tasks: &mut JoinSet<()>) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    watch_with(api, cfg, DefaultBackoff::default(), notify, &Arc::new(Notify::new()), tasks)
}

/// [`watch`] with the backoff after errors chosen by the caller, started
/// over whenever `restart` is notified (stalled_watch.rs).
fn watch_with<K, B>(
    api: Api<K>,
    cfg: watcher::Config,
    backoff: B,
    notify: Arc<Notify>,
    restart: &Arc<Notify>,
    tasks: &mut JoinSet<()>,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    B: kube::runtime::utils::Backoff + Send + 'static,
{
    let (reader, writer) = reflector::store();
    let kind = K::kind(&K::DynamicType::default()).to_string();
    let stream = Restartable::new(api, cfg, restart.clone())
        .map_ok(|ev| {
            ev.modify(|o| {
                o.managed_fields_mut().clear();
            })
        })
        .backoff(backoff)
        .reflect(writer);
    drive(kind, stream, notify, tasks);
    reader
}

/// The backoff after an error of the Lease watch and the gateway Nodes'
/// watch: 200 ms doubling to 2 s, not kube-runtime's default 800 ms to 30 s
/// (kind to a struggling API server, but after a 20 s outage a standby could
/// re-list the Leases 25 s late and take a dead holder's IP that much later,
/// and a drained gateway saw its drain as late). Both lists are a few
/// objects: one namespace's Leases, the Nodes labelled gateway.
#[derive(Debug, Clone, Default)]
struct LeaseBackoff {
    next: Option<Duration>,
}

impl Iterator for LeaseBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let d = self.next.map_or(Duration::from_millis(200), |d| (d * 2).min(Duration::from_secs(2)));
        self.next = Some(d);
        Some(d)
    }
}

impl kube::runtime::utils::Backoff for LeaseBackoff {
    fn reset(&mut self) {
        self.next = None;
    }
}

/// Every Node's metadata only (names and labels: `PerNode` policies'
/// targets), so a large cluster's Node objects are not held whole.
pub(crate) fn watch_node_metadata(
    api: Api<PartialObjectMeta<Node>>,
    cfg: watcher::Config,
    notify: Arc<Notify>,
    tasks: &mut JoinSet<()>,
) -> Store<PartialObjectMeta<Node>> {
    watch_node_metadata_restarting(api, cfg, notify, &Arc::new(Notify::new()), tasks)
}

/// [`watch_node_metadata`], started over whenever `restart` is notified.
fn watch_node_metadata_restarting(
    api: Api<PartialObjectMeta<Node>>,
    cfg: watcher::Config,
    notify: Arc<Notify>,
    restart: &Arc<Notify>,
    tasks: &mut JoinSet<()>,
) -> Store<PartialObjectMeta<Node>> {
    let (reader, writer) = reflector::store();
    let stream = Restartable::new(api, cfg, restart.clone())
        .map_ok(|ev| {
            ev.modify(|o| {
                o.metadata.managed_fields = None;
            })
        })
        .default_backoff()
        .reflect(writer);
    drive("Node metadata".to_string(), stream, notify, tasks);
    reader
}

/// Every Node, trimmed as it arrives to its name, labels and InternalIPs
/// ([`observe::trim_node`]): `PerNode` policies' targets, and the outer
/// sources the nodes' tunnel accepts (docs/adr/0031). The metadata-only
/// watch this replaces carried no addresses; the list is of whole Nodes,
/// the memory of what is kept.
fn watch_nodes_trimmed(
    api: Api<Node>,
    cfg: watcher::Config,
    notify: Arc<Notify>,
    restart: &Arc<Notify>,
    tasks: &mut JoinSet<()>,
) -> Store<Node> {
    let (reader, writer) = reflector::store();
    let stream = Restartable::new(api, cfg, restart.clone())
        .map_ok(|ev| ev.modify(observe::trim_node))
        .default_backoff()
        .reflect(writer);
    drive("Node".to_string(), stream, notify, tasks);
    reader
}

/// Runs a reflector stream, waking the loop on every event and logging
/// failures once per outage.
fn drive<T, E: std::fmt::Display>(
    kind: String,
    stream: impl futures::Stream<Item = Result<T, E>> + Send + 'static,
    notify: Arc<Notify>,
    tasks: &mut JoinSet<()>,
) {
    tasks.spawn(async move {
        let mut stream = std::pin::pin!(stream);
        let mut failing = false;
        while let Some(item) = stream.next().await {
            match item {
                Ok(_) => {
                    if failing {
                        tracing::info!(kind, "watch recovered");
                        failing = false;
                    }
                    notify.notify_one();
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(kind, error = %e, "watch failed; keeping the last state and retrying");
                        failing = true;
                    }
                }
            }
        }
    });
}

impl Stores {
    fn start(
        client: &kube::Client,
        opts: &K8sOptions,
        notify: &Arc<Notify>,
        restart: &Arc<Notify>,
        tasks: &mut JoinSet<()>,
    ) -> Self {
        let all = watcher::Config::default();
        let slow = DefaultBackoff::default;
        Stores {
            pods: watch_with(Api::all(client.clone()), all.clone(), slow(), notify.clone(), restart, tasks),
            namespaces: watch_with(Api::all(client.clone()), all.clone(), slow(), notify.clone(), restart, tasks),
            services: watch_with(Api::all(client.clone()), all.clone(), slow(), notify.clone(), restart, tasks),
            policies: watch_with(Api::all(client.clone()), all.clone(), slow(), notify.clone(), restart, tasks),
            pools: watch_with(Api::all(client.clone()), all.clone(), slow(), notify.clone(), restart, tasks),
            nodes: watch_with(
                Api::all(client.clone()),
                all.clone().labels(&opts.gateway_selector),
                LeaseBackoff::default(),
                notify.clone(),
                restart,
                tasks,
            ),
            all_nodes: watch_nodes_trimmed(Api::all(client.clone()), all.clone(), notify.clone(), restart, tasks),
            leases: watch_with(
                Api::namespaced(client.clone(), &opts.lease_namespace),
                all.labels(&format!("{LEASE_LABEL}={LEASE_LABEL_VALUE}")),
                LeaseBackoff::default(),
                notify.clone(),
                restart,
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
            self.nodes.wait_until_ready(),
            self.all_nodes.wait_until_ready(),
            self.leases.wait_until_ready(),
        );
    }

    /// The state as observed. Drained gateways are not eligible for
    /// anything, except `keep` (this gateway while its hand-over runs).
    /// Also returns the egress IPs' Leases and the gateways' liveness
    /// Leases.
    fn observed(&self, keep: Option<&str>) -> (Observed, BTreeMap<IpAddr, LeaseRecord>, BTreeMap<String, LeaseRecord>) {
        let all = self.leases.state();
        let leases: BTreeMap<IpAddr, LeaseRecord> =
            all.iter().filter_map(|l| observe::lease_ip(l).map(|ip| (ip, observe::lease_record(l)))).collect();
        let liveness: BTreeMap<String, LeaseRecord> =
            all.iter().filter_map(|l| observe::liveness_gateway(l).map(|n| (n, observe::lease_record(l)))).collect();
        let obs = Observed {
            namespaces: self.namespaces.state().iter().map(|n| observe::namespace(n)).collect(),
            pods: observe::pods(self.pods.state().iter().map(|p| &**p)),
            services: self.services.state().iter().filter_map(|s| observe::service(s)).collect(),
            policies: self.policies.state().iter().map(|p| observe::policy(p)).collect(),
            pools: self.pools.state().iter().map(|p| observe::ip_pool(p)).collect(),
            gateways: self
                .nodes
                .state()
                .iter()
                .filter(|n| !observe::draining(n) || Some(n.name_any().as_str()) == keep)
                .map(|n| observe::node(n))
                .collect(),
            nodes: self.all_nodes.state().iter().map(|n| observe::node(n)).collect(),
            leases: leases.iter().map(|(ip, r)| (*ip, observe::lease_info(r, &liveness))).collect(),
            held: BTreeSet::new(),
            cloud: BTreeMap::new(),
            node_cloud: BTreeMap::new(),
        };
        (obs, leases, liveness)
    }
}

/// The outcome of one Lease request.
pub(super) struct LeaseResult {
    pub(super) ip: IpAddr,
    pub(super) action: Action,
    pub(super) sent: Instant,
    pub(super) result: Result<Option<LeaseRecord>, Failure>,
    /// After a conflict: the Lease as the API server has it now (the watch
    /// may lag, e.g. a renewal whose answer was lost applied anyway).
    pub(super) fresh: Option<LeaseRecord>,
}

pub(super) fn failure(e: kube::Error) -> Failure {
    match &e {
        kube::Error::Api(s) if s.is_conflict() || s.is_already_exists() => Failure::Conflict,
        kube::Error::Api(s) if s.is_not_found() => Failure::NotFound,
        _ => Failure::Other(e.to_string()),
    }
}

/// The Lease object this gateway writes for `ip`.
fn lease_object(
    opts: &K8sOptions,
    ip: IpAddr,
    input: &RenewInput,
    prev: Option<&LeaseRecord>,
    action: &Action,
    wall: Timestamp,
) -> Lease {
    let holder = Some(opts.node_name.as_str());
    let mut annotations = BTreeMap::from([(LEASE_IP_ANNOTATION.to_string(), ip.to_string())]);
    if let Some(n) = input.next_hop {
        annotations.insert(LEASE_NEXT_HOP_ANNOTATION.to_string(), n.to_string());
    }
    if let Some(e) = input.epoch {
        annotations.insert(EPOCH_ANNOTATION.to_string(), e.to_string());
    }
    if let Some(h) = &input.ha {
        annotations.insert(FAILSAFE_ANNOTATION.to_string(), h.failsafe_peers.join(","));
        annotations.insert(INCARNATION_ANNOTATION.to_string(), h.incarnation.to_string());
        if let Some(s) = &h.standby {
            annotations.insert(STANDBY_ANNOTATION.to_string(), s.clone());
        }
    }
    let (rv, transitions, acquire) = match action {
        Action::Create => (None, 0, Some(wall)),
        Action::Acquire { resource_version, transitions, keep_acquire_time, .. } => (
            Some(resource_version.clone()),
            *transitions,
            if *keep_acquire_time { prev.and_then(|p| p.acquire_time).or(Some(wall)) } else { Some(wall) },
        ),
        Action::Renew { resource_version }
        | Action::Release { resource_version }
        | Action::Delete { resource_version } => {
            (Some(resource_version.clone()), prev.map_or(0, |p| p.transitions), prev.and_then(|p| p.acquire_time))
        }
        // Not this IP's Lease: send_lease_request writes the holder's
        // liveness Lease instead (liveness_requests.rs).
        Action::Expire(_) => (None, 0, None),
    };
    // A record under an epoch is never renewed: gateways of earlier
    // versions must not count it as expired (liveness::RECORD_DURATION_SECS).
    let duration = match input.epoch {
        Some(_) => Some(RECORD_DURATION_SECS),
        None => i32::try_from(opts.timing.lease_duration.as_secs()).ok(),
    };
    let releasing = matches!(action, Action::Release { .. });
    Lease {
        metadata: ObjectMeta {
            name: Some(lease_name(ip)),
            namespace: Some(opts.lease_namespace.clone()),
            resource_version: rv,
            labels: Some(BTreeMap::from([(LEASE_LABEL.to_string(), LEASE_LABEL_VALUE.to_string())])),
            annotations: Some(annotations),
            owner_references: Some(
                opts.lease_owner.merged(&opts.lease_namespace, prev.map(|p| p.owners.as_slice()).unwrap_or_default()),
            )
            .filter(|o| !o.is_empty()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: if releasing { None } else { holder.map(str::to_string) },
            lease_duration_seconds: duration,
            acquire_time: if releasing { None } else { acquire.map(MicroTime) },
            renew_time: if releasing { None } else { Some(MicroTime(wall)) },
            lease_transitions: Some(transitions),
            ..Default::default()
        }),
    }
}

/// Sends one Lease action and, after a conflict, reads the Lease as the
/// API server has it now.
/// An [`Action::Expire`] writes the liveness Lease of the gateway it names
/// instead, `prev` being that Lease as last seen.
pub(super) async fn send_lease_request(
    api: Api<Lease>,
    opts: K8sOptions,
    ip: IpAddr,
    input: RenewInput,
    prev: Option<LeaseRecord>,
    action: Action,
) -> LeaseResult {
    if let Action::Expire(la) = &action {
        let r = send_liveness_request(api, opts, la.clone(), prev).await;
        return LeaseResult { ip, action, sent: r.sent, result: r.result, fresh: r.fresh };
    }
    let sent = Instant::now();
    let result = send_lease_action(api.clone(), opts.clone(), ip, &input, prev, action.clone()).await;
    let fresh = match result {
        Err(Failure::Conflict) => {
            let get = tokio::time::timeout(opts.timing.retry_period, api.get(&lease_name(ip))).await;
            get.ok().and_then(Result::ok).map(|l| observe::lease_record(&l))
        }
        _ => None,
    };
    LeaseResult { ip, action, sent, result, fresh }
}

async fn send_lease_action(
    api: Api<Lease>,
    opts: K8sOptions,
    ip: IpAddr,
    input: &RenewInput,
    prev: Option<LeaseRecord>,
    action: Action,
) -> Result<Option<LeaseRecord>, Failure> {
    let name = lease_name(ip);
    let obj = lease_object(&opts, ip, input, prev.as_ref(), &action, Timestamp::now());
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    let call = async {
        match &action {
            Action::Create => api.create(&pp, &obj).await.map(|l| Some(observe::lease_record(&l))),
            Action::Acquire { .. } | Action::Renew { .. } | Action::Release { .. } => {
                api.replace(&name, &pp, &obj).await.map(|l| Some(observe::lease_record(&l)))
            }
            Action::Expire(_) => Ok(None),
            Action::Delete { resource_version } => {
                let dp = DeleteParams {
                    preconditions: Some(Preconditions { resource_version: Some(resource_version.clone()), uid: None }),
                    ..Default::default()
                };
                api.delete(&name, &dp).await.map(|_| None)
            }
        }
    };
    match tokio::time::timeout(opts.timing.renew_deadline, call).await {
        Ok(r) => r.map_err(failure),
        Err(_) => Err(Failure::Other(format!("no answer within {:?}", opts.timing.renew_deadline))),
    }
}

/// An `events.k8s.io/v1` Event about `regarding` (Events are sent only on
/// transitions, so there is no series bookkeeping).
fn event(
    regarding: &ObjectReference,
    instance: &str,
    type_: &'static str,
    reason: &str,
    action: &str,
    note: String,
    wall: Timestamp,
) -> KubeEvent {
    let base = regarding.name.clone().unwrap_or_else(|| "egret".into());
    KubeEvent {
        metadata: ObjectMeta {
            name: Some(format!("{base}.{:x}", wall.as_nanosecond())),
            namespace: Some(regarding.namespace.clone().unwrap_or_else(|| "default".into())),
            ..Default::default()
        },
        event_time: Some(MicroTime(wall)),
        action: Some(action.into()),
        reason: Some(reason.into()),
        note: Some(note.chars().take(1000).collect()),
        regarding: Some(regarding.clone()),
        reporting_controller: Some(REPORTING_CONTROLLER.into()),
        reporting_instance: Some(instance.chars().take(128).collect()),
        type_: Some(type_.into()),
        ..Default::default()
    }
}

/// Creates `ev`. Events about cluster-scoped objects go to `default`; API
/// servers before 1.22 accept them only in `kube-system`, so a refusal there
/// is retried in `kube-system`.
async fn publish_event(client: kube::Client, mut ev: KubeEvent) -> Result<(), kube::Error> {
    let ns = ev.metadata.namespace.clone().unwrap_or_default();
    let api: Api<KubeEvent> = Api::namespaced(client.clone(), &ns);
    match api.create(&PostParams::default(), &ev).await {
        Err(kube::Error::Api(s)) if s.is_invalid() && ev.regarding.as_ref().is_some_and(|r| r.namespace.is_none()) => {
            ev.metadata.namespace = Some("kube-system".into());
            Api::<KubeEvent>::namespaced(client, "kube-system").create(&PostParams::default(), &ev).await.map(drop)
        }
        r => r.map(drop),
    }
}

/// Releases our Lease of `ip` on shutdown. A renewal still in flight may
/// have changed it since `rec`: on a conflict, re-read and retry while the
/// Lease still names us.
/// The released Lease keeps naming the standby that holds the sessions
/// (`ha`), for operators.
/// What a released Lease says about the hand-over: the standby of now (not
/// the one of the last pass: a standby replaced since has dropped its copy)
/// and only when it acknowledged a complete copy (the others then defer to
/// it, `LeaseManager::set_standby_view`); otherwise none, and the
/// candidates take it by rank.
fn released_fields(ha: Option<&crate::ha::Ha>, ip: IpAddr, fields: Option<HaFields>) -> Option<HaFields> {
    fields.map(|mut f| {
        f.standby = ha.and_then(|h| h.synced_standby(ip));
        f
    })
}

async fn release(api: Api<Lease>, opts: K8sOptions, ip: IpAddr, mut rec: LeaseRecord, ha: Option<HaFields>) {
    for _ in 0..4 {
        let action = Action::Release { resource_version: rec.resource_version.clone() };
        let input = RenewInput { ha: ha.clone(), ..Default::default() };
        match send_lease_action(api.clone(), opts.clone(), ip, &input, Some(rec.clone()), action).await {
            Err(Failure::Conflict) => match api.get(&lease_name(ip)).await {
                Ok(l) if observe::lease_record(&l).holder.as_deref() == Some(opts.node_name.as_str()) => {
                    rec = observe::lease_record(&l);
                }
                _ => return,
            },
            _ => return,
        }
    }
}

/// Writes an EgressPolicy's status by server-side apply (forced: the status
/// is Egret's alone; one gateway writes at a time).
fn policy_status_write(client: &kube::Client) -> super::status_writer::WriteFn {
    let api: Api<EgressPolicy> = Api::all(client.clone());
    Arc::new(move |name: String, value: serde_json::Value| {
        let api = api.clone();
        Box::pin(async move {
            let pp = PatchParams::apply(FIELD_MANAGER).force();
            match api.patch_status(&name, &pp, &Patch::Apply(&value)).await {
                Ok(_) => Written::Ok,
                Err(e) => Written::Failed(e.to_string()),
            }
        })
    })
}

/// Writes an EgressIPPool's status by a merge patch on the observed
/// `resourceVersion` (the value carries it): a conflict means another writer
/// allocated meanwhile, recomputed next pass.
fn pool_status_write(client: &kube::Client) -> super::status_writer::WriteFn {
    let api: Api<EgressIPPool> = Api::all(client.clone());
    Arc::new(move |name: String, value: serde_json::Value| {
        let api = api.clone();
        Box::pin(async move {
            let pp = PatchParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
            match api.patch_status(&name, &pp, &Patch::Merge(&value)).await {
                Ok(_) => Written::Ok,
                Err(kube::Error::Api(s)) if s.is_conflict() => Written::Stale,
                Err(e) => Written::Failed(e.to_string()),
            }
        })
    })
}

/// A status with conditions (EgressPolicy's, EgressIPPool's).
trait WithConditions: Clone + PartialEq {
    fn conditions_mut(&mut self) -> &mut Vec<Condition>;
    fn conditions(&self) -> &[Condition];
}

impl WithConditions for EgressPolicyStatus {
    fn conditions_mut(&mut self) -> &mut Vec<Condition> {
        &mut self.conditions
    }
    fn conditions(&self) -> &[Condition] {
        &self.conditions
    }
}

impl WithConditions for EgressIPPoolStatus {
    fn conditions_mut(&mut self) -> &mut Vec<Condition> {
        &mut self.conditions
    }
    fn conditions(&self) -> &[Condition] {
        &self.conditions
    }
}

/// One object's desired status `st`, given what the object shows
/// (`stored`): settled in its writer when they match (written and watched:
/// the object carries the transition times from now on), else handed to the
/// writer as `value(st)`, keeping the transition times last sent under
/// `key` while the watch lags.
fn hand_over<S: WithConditions>(
    (writes, conditions_sent): (&mut StatusWriter, &mut HashMap<String, Vec<Condition>>),
    key: &str,
    name: &str,
    stored: Option<&S>,
    st: &S,
    value: impl FnOnce(&S) -> serde_json::Value,
) {
    let mut st = st.clone();
    if let Some(sent) = conditions_sent.get(key) {
        let shown = stored.map(S::conditions).unwrap_or(&[]);
        super::desired::keep_transition_times(st.conditions_mut(), shown, sent);
    }
    if stored == Some(&st) {
        writes.settle(name);
        conditions_sent.remove(key);
        return;
    }
    conditions_sent.insert(key.to_string(), st.conditions().to_vec());
    writes.submit(name, value(&st));
}

/// The loop's state between passes.
struct SyncLoop {
    client: kube::Client,
    opts: K8sOptions,
    sink: Arc<dyn TablesSink>,
    stores: Stores,
    mgr: Arc<Mutex<LeaseManager>>,
    /// The peer channel's side of this gateway (None: `kubernetes.ha` not configured).
    ha: Option<crate::ha::Ha>,
    local: LocalConfig,
    leases: Api<Lease>,
    results: mpsc::UnboundedSender<LeaseResult>,
    writes: JoinSet<()>,
    last_applied: Option<TablesSpec>,
    last_apply_error: Option<String>,
    /// The IPs handed over with a current copy (published with the tables).
    hand_overs: super::handed_over::HandOvers,
    last: Desired,
    /// Status writes, one slot per object (status_writer.rs).
    policy_writes: StatusWriter,
    pool_writes: StatusWriter,
    /// The conditions last handed to the writers, by `policy/NAME` and
    /// `pool/NAME`: their transition times hold while the watch lags.
    conditions_sent: HashMap<String, Vec<Condition>>,
    problems_reported: BTreeSet<(String, String, &'static str)>,
    /// Cloud addresses whose refusal was reported (an Event each time one
    /// is newly refused).
    refusals_reported: BTreeSet<IpAddr>,
    /// What the data plane was told about each address's valid-until
    /// (shared with the renewer).
    valid_until: Arc<Mutex<ValidUntil>>,
    /// The renewals: their inputs, which fail (the failsafe asks the peers
    /// for those), and the task sending them.
    renewer: Renewer,
    renew_task: Option<RenewTask>,
    /// Counted for the report.
    counters: crate::view::ClusterCounters,
    /// Where the report goes.
    heartbeat: Arc<Heartbeat>,
    /// When the first pass ran (readiness waits a bounded time for standby copies).
    first_pass_at: Option<Instant>,
    /// When this gateway's drain began.
    drain_since: Option<Instant>,
    /// A pass is due then (a drain waiting for its standbys).
    drain_wake: Option<Instant>,
    /// Cloud pools' discovery and this gateway's cloud addresses.
    clouds: crate::cloud::task::Clouds,
    /// Notified to start every watch over (stalled_watch.rs).
    watch_restart: Arc<Notify>,
    /// When the watches last started over.
    watches_restarted_at: Option<Instant>,
}

fn announced(spec: &TablesSpec) -> BTreeSet<IpAddr> {
    spec.egress_ips
        .iter()
        .filter(|e| e.answer_neighbor)
        .map(|e| e.ip)
        .chain(spec.neighbor_addresses.iter().copied())
        .collect()
}

impl SyncLoop {
    /// The drain of this gateway (`egret.dev/drain` on its Node): `None`
    /// while not drained; `Some(started)` while its standbys get their
    /// copies; once they hold them (or after [`HANDOVER_SYNC_WAIT`]) it stops
    /// competing, so its IPs are fenced, then released.
    fn drain_step(&mut self, now: Instant) -> bool {
        let me = self.opts.node_name.clone();
        let drained = self.stores.nodes.state().iter().any(|n| n.name_any() == me && observe::draining(n));
        if !drained {
            if self.drain_since.take().is_some() {
                tracing::info!("drain lifted: competing for egress IPs again");
            }
            return false;
        }
        let held: Vec<IpAddr> = self.mgr.lock().held(now).into_iter().collect();
        let since = *self.drain_since.get_or_insert_with(|| {
            tracing::info!(ips = ?held, "drained: handing the egress IPs over once the standbys hold their sessions");
            if let Some(ha) = &self.ha {
                ha.request_full_copies(&held);
            }
            now
        });
        let synced = self.ha.as_ref().is_none_or(|ha| held.iter().all(|ip| ha.in_sync(*ip)));
        let done = synced || now >= since + HANDOVER_SYNC_WAIT;
        if !done {
            self.drain_wake = Some(now + Duration::from_millis(50));
        }
        done
    }

    async fn pass(&mut self, now: Instant) {
        let handing_over = !self.drain_step(now) && self.drain_since.is_some();
        let me = self.opts.node_name.clone();
        let (mut obs, leases, liveness) = self.stores.observed(handing_over.then_some(me.as_str()));
        self.opts.pod_identities.set(observe::pod_identities(self.stores.pods.state().iter().map(|p| &**p)));
        for (ip, rec) in &leases {
            self.mgr.lock().observe(*ip, Some(rec.clone()), now);
        }
        self.check_lease_watch(&leases, &liveness, now);
        let own = self.mgr.lock().observe_liveness_all(&liveness, now);
        if own == Some(OwnOutcome::Lost) {
            self.liveness_lost();
        }
        let in_use_prev: BTreeSet<IpAddr> = self.last.ips.keys().copied().collect();
        for ip in in_use_prev.iter().filter(|ip| !leases.contains_key(ip)) {
            self.mgr.lock().observe(*ip, None, now);
        }
        self.held(&mut obs, now);
        obs.cloud = self.clouds.discovered();
        let wall = Timestamp::now();
        let writer = self.is_status_writer(&obs, wall);
        if writer {
            obs.node_cloud = self.node_cloud();
        }
        let mut d = desired(&obs, &self.local, wall);
        let me = self.opts.node_name.clone();
        self.withdraw_refused(&mut d);
        self.report_refusals();
        self.report_port_use(&d);
        let competing: BTreeSet<IpAddr> = d.competing(&me).map(|(ip, _)| ip).collect();
        // Before the fence: a drained or fenced IP stops being held here,
        // and its replication as it leaves decides its hand-over.
        self.observe_hand_overs();
        let fenced = self.mgr.lock().fence(now, &competing);
        self.counters.fenced += fenced.len() as u64;
        // The data plane stops serving fenced IPs now, whether or not the
        // tables below can be applied.
        self.push_valid_until();
        if !fenced.is_empty() {
            let dormant = self.mgr.lock().dormant();
            tracing::warn!(
                ips = ?fenced,
                dormant = ?dormant,
                "fenced: no valid Lease any more (renew deadline passed or no longer eligible); a dormant IP keeps its sessions and takes its Lease back"
            );
            self.held(&mut obs, now);
            d = desired(&obs, &self.local, wall);
            self.withdraw_refused(&mut d);
        }
        for ip in d.ips.keys().filter(|ip| !leases.contains_key(ip)) {
            self.mgr.lock().observe(*ip, None, now);
        }
        let pairs: Vec<(IpAddr, IpAddr)> = d.ips.iter().filter_map(|(ip, a)| a.next_hop.map(|nh| (*ip, nh))).collect();
        self.push_valid_until_with(&pairs);
        let applied = self.apply(&d.tables).await;

        // Only now, with the fenced IPs out of the tables: Lease requests.
        // If the apply failed, nothing is given up (LeaseManager::plan).
        let candidates: BTreeMap<IpAddr, Vec<String>> =
            d.ips.iter().map(|(ip, a)| (*ip, a.candidates.clone())).collect();
        let in_use: BTreeSet<IpAddr> = candidates.keys().copied().collect();
        let watched: BTreeSet<IpAddr> = leases.keys().copied().collect();
        self.mgr.lock().forget_unused(&in_use, &watched);
        let standbys = self.ha.as_ref().map(crate::ha::Ha::standbys).unwrap_or_default();
        // The epoch the records are written under and the plan that sends
        // them come from one look at the manager: the renewer's task takes
        // the liveness Lease on another thread, and a plan made just after
        // it, with the epoch read just before it (0), created records under
        // epoch 0, which every other gateway reads as void (its liveness
        // Lease names epoch 1) and took at once (k8s_failover, 1 run in 7).
        let (inputs, actions) = {
            let mut mgr = self.mgr.lock();
            let epoch = mgr.liveness().map(|l| l.epoch());
            let inputs: BTreeMap<IpAddr, RenewInput> = d
                .ips
                .iter()
                .map(|(ip, a)| {
                    let ha = self.ha.as_ref().map(|ha| HaFields {
                        failsafe_peers: a.candidates.iter().filter(|n| **n != me).cloned().collect(),
                        incarnation: ha.incarnation(),
                        standby: standbys.get(ip).cloned(),
                    });
                    (*ip, RenewInput { next_hop: a.next_hop, ha, epoch })
                })
                .collect();
            let fields = inputs.iter().filter_map(|(ip, i)| Some((*ip, i.ha.clone()?))).collect();
            mgr.set_record_fields(fields);
            mgr.set_record_owner(
                self.opts.lease_owner.for_namespace(&self.opts.lease_namespace).as_ref().map(super::lease::Owner::from),
            );
            // Renewals are the renewer's (renewer.rs); everything else is sent here.
            let actions = mgr.plan(now, &candidates, applied);
            (inputs, actions)
        };
        *self.renewer.inputs.lock() = inputs.clone();
        for (ip, action) in actions {
            let api = self.leases.clone();
            let opts = self.opts.clone();
            let mut input = inputs.get(&ip).cloned().unwrap_or_default();
            if matches!(action, Action::Release { .. }) {
                input.ha = released_fields(self.ha.as_ref(), ip, input.ha);
            }
            let prev = match &action {
                Action::Expire(LivenessAction::Expire { holder, .. }) => {
                    self.mgr.lock().liveness().and_then(|l| l.seen(holder)).cloned()
                }
                _ => self.mgr.lock().record(ip).cloned(),
            };
            let tx = self.results.clone();
            tokio::spawn(async move {
                let r = send_lease_request(api, opts, ip, input, prev, action).await;
                let _ = tx.send(r);
            });
        }

        if let Some(ha) = &self.ha {
            let view = self.ha_view(&d, &leases, now);
            ha.failsafe_round(&view);
            ha.update(view);
        }
        self.first_pass_at.get_or_insert(now);
        self.heartbeat.publish(self.report(&d, &leases, now));

        // The worker Nodes' cloud addresses are the status writer's to make.
        self.clouds.update_nodes(writer.then(|| d.node_cloud.clone()));
        if writer {
            self.write_status(&d);
            self.report_service_problems(&d);
        } else {
            self.policy_writes.settle_all();
            self.pool_writes.settle_all();
            self.conditions_sent.clear();
        }
        self.last = d;
    }

    /// The IPs this gateway may translate to: those it holds a Lease for,
    /// less the cloud addresses the provider has not given to its interface
    /// yet (the cloud task is told which to move here, and which to give up).
    fn held(&self, obs: &mut Observed, now: Instant) {
        let mgr = self.mgr.lock();
        obs.held = mgr.held(now).union(&mgr.dormant()).copied().collect();
        drop(mgr);
        let targets = crate::cloud::targets(&obs.pools);
        let want = targets.iter().filter(|(ip, _)| obs.held.contains(ip)).map(|(ip, t)| (*ip, t.clone())).collect();
        let me = self.opts.node_name.as_str();
        let nodes = self.stores.nodes.state();
        let provider_id_of = |n: &Node| n.spec.as_ref().and_then(|s| s.provider_id.clone());
        let provider_id = nodes.iter().find(|n| n.name_any() == me).and_then(|n| provider_id_of(n));
        // The gateway Nodes' instances: the only interfaces an address is taken from.
        let gateways = nodes.iter().filter_map(|n| provider_id_of(n)).collect();
        self.clouds.update(provider_id, gateways, crate::cloud::selectors(&obs.pools), want);
        let assigned = self.clouds.assigned();
        obs.held.retain(|ip| !targets.contains_key(ip) || assigned.contains(ip));
    }

    /// The worker Nodes' cloud addresses as the cloud task has them:
    /// associated, or its last failure.
    fn node_cloud(&self) -> NodeCloudObserved {
        let mut out: NodeCloudObserved = self.clouds.node_failures().into_iter().map(|(k, e)| (k, Err(e))).collect();
        out.extend(self.clouds.node_addresses().into_iter().map(|(k, a)| (k, Ok(a))));
        out
    }

    /// Cloud addresses the provider refused this gateway for good (no
    /// interface in the subnet, not allowed...): it stops being a candidate
    /// for them, so it gives their Leases up and others take them.
    fn withdraw_refused(&self, d: &mut Desired) {
        let me = self.opts.node_name.as_str();
        for ip in self.clouds.refused() {
            if let Some(a) = d.ips.get_mut(&ip) {
                a.candidates.retain(|c| c != me);
            }
        }
    }

    /// A Warning Event on the owner of each cloud address newly refused to
    /// this gateway for good, with the provider's words.
    fn report_refusals(&mut self) {
        let refusals = self.clouds.refusals();
        // Still refused and reported: not again; newly refused: reported
        // once its owner is known.
        self.refusals_reported.retain(|ip| refusals.contains_key(ip));
        for (ip, why) in &refusals {
            if self.refusals_reported.contains(ip) {
                continue;
            }
            let Some(owner) = self.last.ips.get(ip).map(|a| a.owner.clone()) else { continue };
            let Some(reference) = self.owner_ref(&owner) else { continue };
            self.refusals_reported.insert(*ip);
            let note = format!(
                "the cloud provider refused egress IP {ip} to gateway {}: {why}; it stops competing for it for {} s",
                self.opts.node_name,
                crate::cloud::task::REFUSED_FOR.as_secs()
            );
            self.publish(reference, "Warning", reason::CLOUD_ADDRESS_REFUSED, "AssignCloudAddress", note);
        }
    }

    /// Applies `spec` unless it is already in place; returns whether the
    /// data plane now runs it. The apply, the sessions of IPs just taken
    /// over and their announcement run on a blocking thread (an `nft` run
    /// may take seconds, 1.2 M sessions 0.8-1.9 s): the runtime's thread
    /// stays free for the renewer, the channel and Lease requests.
    async fn apply(&mut self, spec: &TablesSpec) -> bool {
        self.observe_hand_overs();
        let mut spec = spec.clone();
        let before_ips = self.last_applied.as_ref().map(|s| s.egress_ips.iter().map(|e| e.ip).collect());
        self.hand_overs.mark(&before_ips.unwrap_or_default(), &mut spec);
        let spec = &spec;
        if self.last_applied.as_ref() == Some(spec) {
            return true;
        }
        let before = self.last_applied.as_ref().map(announced).unwrap_or_default();
        let new: Vec<IpAddr> = announced(spec).difference(&before).copied().collect();
        let sink = self.sink.clone();
        let activator = self.ha.as_ref().map(crate::ha::Ha::activator);
        let job = spec.clone();
        let done = tokio::task::spawn_blocking(move || {
            sink.apply(&job)?;
            if !new.is_empty() {
                // Sessions of the previous holder first: nothing reaches
                // this gateway for these addresses before the announcement.
                if let Some(a) = &activator {
                    a.activate(&new);
                }
                sink.announce(&new);
            }
            Ok(())
        })
        .await;
        let result = match done {
            Ok(r) => r,
            Err(e) => Err(crate::sink::ApplyError::Rejected(format!("the apply's thread failed: {e}"))),
        };
        match result {
            Ok(()) => {
                tracing::info!(
                    policies = spec.policies.len(),
                    egress_ips = ?spec.egress_ips.iter().map(|e| e.ip).collect::<Vec<_>>(),
                    "tables applied"
                );
                self.last_applied = Some(spec.clone());
                self.last_apply_error = None;
                true
            }
            Err(e) => {
                let msg = e.to_string();
                if self.last_apply_error.as_deref() != Some(msg.as_str()) {
                    tracing::error!(error = %msg, "tables not applied");
                }
                self.last_apply_error = Some(msg);
                false
            }
        }
    }

    /// Notes whether each IP held now has a current copy at its standby
    /// (`handed_over.rs`).
    fn observe_hand_overs(&mut self) {
        let Some(ha) = &self.ha else { return };
        let held = self.mgr.lock().held(Instant::now());
        self.hand_overs.observe(&held, |ip| ha.in_sync(ip));
    }

    /// What the channel task needs after this pass: the peers and their
    /// addresses, the IPs held here with their other candidates, the IPs
    /// whose renewals fail, every Lease's holder.
    fn ha_view(&self, d: &Desired, leases: &BTreeMap<IpAddr, LeaseRecord>, now: Instant) -> crate::ha::View {
        let me = self.opts.node_name.as_str();
        let port = self.opts.ha.as_ref().map_or(crate::ha::DEFAULT_PORT, |h| h.port);
        let peers = self
            .stores
            .nodes
            .state()
            .iter()
            .filter(|n| n.name_any() != me)
            .filter_map(|n| observe::ha_address(n).map(|a| (n.name_any(), std::net::SocketAddr::new(a, port))))
            .collect();
        // Not the dormant IPs: someone may have taken one meanwhile, and
        // its standby must not take our copy for theirs. Their standby
        // keeps the last copy (an IP that leaves `held` keeps its shadow,
        // `Replicator::set_standbys`); a resumed one is copied afresh.
        let held_now = self.mgr.lock().held(now);
        let held = held_now
            .iter()
            .map(|ip| {
                let others = d.ips.get(ip).map(|a| a.candidates.iter().filter(|c| *c != me).cloned().collect());
                (*ip, others.unwrap_or_default())
            })
            .collect();
        crate::ha::View {
            peers,
            held,
            failing: held_now
                .iter()
                .filter(|ip| self.renewer.book.lock().failing(**ip, now, self.opts.timing.retry_period))
                .copied()
                .collect(),
            holders: leases.iter().map(|(ip, r)| (*ip, r.holder.clone().filter(|h| !h.is_empty()))).collect(),
            retry_period: self.opts.timing.retry_period,
        }
    }

    /// What `egret status` and the metrics show (issue 16 §6).
    fn report(&self, d: &Desired, leases: &BTreeMap<IpAddr, LeaseRecord>, now: Instant) -> crate::view::ClusterReport {
        use crate::view::{ClusterReport, LeaseRow, PeerRow, ShadowRow};
        let me = self.opts.node_name.as_str();
        let ha = self.ha.as_ref().map(|h| (h.status(), h.counters().clone()));
        let mgr = self.mgr.lock();
        let held = mgr.held(now);
        let dormant = mgr.dormant();
        let mut rows = Vec::new();
        let cloud = self.clouds.report();
        let targets =
            crate::cloud::targets(&self.stores.pools.state().iter().map(|p| observe::ip_pool(p)).collect::<Vec<_>>());
        for (ip, a) in &d.ips {
            let holder = leases.get(ip).and_then(|r| r.holder.clone()).filter(|h| !h.is_empty());
            let replica = ha.as_ref().and_then(|(s, _)| s.replicas.iter().find(|r| r.ip == *ip));
            rows.push(LeaseRow {
                ip: *ip,
                holder,
                held_here: held.contains(ip),
                dormant_here: dormant.contains(ip),
                valid_for_ms: mgr.deadline(*ip).map(|t| t.saturating_duration_since(now).as_millis() as u64),
                candidates: a.candidates.clone(),
                renew_failing: self.renewer.book.lock().failed(*ip),
                standby: replica.map(|r| r.standby.clone()),
                standby_in_sync: replica.map(|r| r.in_sync),
                public_ip: targets.get(ip).and_then(|t| t.public.as_ref().map(|p| p.public_ip)),
                cloud: cloud.addresses.iter().find(|(i, _, _)| i == ip).map(|(_, _, s)| match s {
                    crate::cloud::task::AddressState::Assigned { interface_id } => {
                        format!("assigned to {interface_id}")
                    }
                    crate::cloud::task::AddressState::Pending { error: None, .. } => "assigning".to_string(),
                    crate::cloud::task::AddressState::Pending { attempts, error: Some(e) } => {
                        format!("not assigned ({attempts} attempts): {e}")
                    }
                }),
            });
        }
        let liveness = mgr.liveness().map(|l| crate::view::LivenessRow {
            lease: super::liveness::liveness_lease_name(me),
            epoch: l.epoch(),
            valid_for_ms: l
                .base(now)
                .map(|b| (b + l.timing().renew_deadline).saturating_duration_since(now).as_millis() as u64),
            lost: l.lost,
            expired: l.expired,
        });
        drop(mgr);
        let mut report = ClusterReport {
            liveness,
            node: me.to_string(),
            first_pass: true,
            last_pass_ms: 0,
            ha: ha.is_some(),
            leases: rows,
            cloud_interfaces: cloud
                .interfaces
                .into_iter()
                .map(|(subnet, r)| match r {
                    Ok(i) => crate::view::CloudInterfaceRow {
                        subnet,
                        interface: Some(i.interface_id),
                        source_dest_check: i.source_dest_check,
                        error: None,
                    },
                    Err(e) => {
                        crate::view::CloudInterfaceRow { subnet, error: Some(e.to_string()), ..Default::default() }
                    }
                })
                .collect(),
            cloud_nodes: cloud
                .nodes
                .into_iter()
                .map(|((node, public_ip), r)| match r {
                    Ok(at) => crate::view::CloudNodeRow {
                        node,
                        public_ip,
                        private_ip: Some(at.private_ip),
                        interface: Some(at.interface_id),
                        error: None,
                    },
                    Err(error) => {
                        crate::view::CloudNodeRow { node, public_ip, private_ip: None, interface: None, error }
                    }
                })
                .collect(),
            counters: {
                let mut k = self.counters.clone();
                let book = self.renewer.book.lock();
                k.lease_api_errors += book.api_errors;
                k.cloud_drift_repairs = cloud.drift_repairs;
                k.lease_conflicts += book.conflicts;
                k.lease_renew_latency = book.latency.clone();
                k
            },
            ..Default::default()
        };
        if let Some((s, c)) = ha {
            use std::sync::atomic::Ordering::Relaxed;
            report.end_authenticated = s.end_authenticated;
            report.channel_keys = s.keys.iter().map(ToString::to_string).collect();
            report.peers = s
                .peers
                .iter()
                .map(|p| PeerRow {
                    name: p.name.clone(),
                    addr: p.addr.to_string(),
                    state: format!("{:?}", p.state).to_lowercase(),
                    incarnation: p.incarnation,
                    since_ms: p.since.elapsed().as_millis() as u64,
                    last_end: p.last_end.as_ref().map(|e| e.to_string()),
                    queue_bytes: p.queue_bytes as u64,
                    key: p.key.map(|k| k.to_string()),
                })
                .collect();
            report.shadows = s
                .shadows
                .iter()
                .map(|x| ShadowRow {
                    ip: x.ip,
                    holder: x.holder.clone(),
                    sessions: x.sessions as u64,
                    in_sync: x.in_sync,
                    age_ms: x.age.as_millis() as u64,
                })
                .collect();
            // The IPs whose first standby is this gateway, held by a peer
            // that is up, without a complete copy here yet. Just after this
            // process started, a holder whose channel is not up yet counts
            // too (for CHANNEL_UP_WAIT): ready before the channel came up,
            // a rolling update stopped the holder next, and it handed its
            // IP to this gateway without the sessions (CI run of 56e51aa).
            let up: BTreeSet<&str> =
                s.peers.iter().filter(|p| p.incarnation.is_some()).map(|p| p.name.as_str()).collect();
            let connecting = self.first_pass_at.is_none_or(|t| now < t + CHANNEL_UP_WAIT);
            let peer = |h: &str| s.peers.iter().any(|p| p.name == h);
            for row in &report.leases {
                let Some(h) = row.holder.as_deref().filter(|h| *h != me) else { continue };
                let counted = up.contains(h) || (connecting && peer(h));
                if !counted {
                    continue;
                }
                let first =
                    row.candidates.iter().find(|c| c.as_str() != h && up.contains(c.as_str()) || c.as_str() == me);
                if first.map(String::as_str) == Some(me) && !s.shadows.iter().any(|x| x.ip == row.ip && x.in_sync) {
                    report.standby_pending.push(row.ip);
                }
            }
            let k = &mut report.counters;
            k.failsafe_confirmed = s.failsafe_confirmed;
            k.failsafe_refused = s.failsafe_refused;
            k.promises_given = c.promises_given.load(Relaxed);
            k.peers_gone = c.peers_gone.load(Relaxed);
            k.peer_resets_survived = c.peer_resets_survived.load(Relaxed);
            k.early_takeovers_allowed = c.early_takeovers_allowed.load(Relaxed);
            k.sessions_imported = c.sessions_imported.load(Relaxed);
            k.sessions_not_imported = c.sessions_not_imported.load(Relaxed);
            k.sync_records_sent = s.records_sent;
            k.sync_full_copies = s.full_copies;
            k.sync_journal_overflows = s.journal_overflows;
            k.sync_sends_refused = c.sends_refused.load(Relaxed);
        }
        // Readiness waits for standby copies at most this long after the first pass.
        if self.first_pass_at.is_some_and(|t| now >= t + STANDBY_READY_WAIT) {
            report.standby_pending.clear();
        }
        report
    }

    /// Starts every watch over when the Lease watch has not shown, within
    /// renewDeadline, a renewal the API server answered (stalled_watch.rs),
    /// at most once per leaseDuration.
    fn check_lease_watch(
        &mut self,
        leases: &BTreeMap<IpAddr, LeaseRecord>,
        liveness: &BTreeMap<String, LeaseRecord>,
        now: Instant,
    ) {
        let Some(probe) = self.renewer.book.lock().probe.clone() else { return };
        let seen = newest_version(leases.values().chain(liveness.values()));
        let t = self.opts.timing;
        match watch_shows(&probe, seen, now, t.renew_deadline) {
            None => {}
            Some(true) => self.renewer.book.lock().probe = None,
            Some(false) if self.watches_restarted_at.is_some_and(|at| now < at + t.lease_duration) => {}
            Some(false) => {
                tracing::warn!(
                    lease_version = probe.resource_version,
                    shown = ?seen,
                    ms = now.saturating_duration_since(probe.answered).as_millis() as u64,
                    "the Lease watch has not shown this gateway's own renewal: starting every watch over (a fresh list on a new connection)"
                );
                self.counters.watch_restarts += 1;
                self.watches_restarted_at = Some(now);
                self.renewer.book.lock().probe = None;
                self.watch_restart.notify_waiters();
            }
        }
    }

    /// A peer expired this gateway's liveness Lease (or it was deleted):
    /// a new epoch is taken, and no IP is served again before its record
    /// is rewritten under it.
    fn liveness_lost(&self) {
        let epoch = self.mgr.lock().liveness().map(|l| l.epoch());
        tracing::warn!(
            epoch,
            "liveness Lease lost (expired by a peer, or deleted): a new epoch; each egress IP is served again once its Lease is rewritten"
        );
    }

    fn on_result(&mut self, r: LeaseResult) {
        let now = Instant::now();
        if let Err(f) = &r.result {
            tracing::debug!(ip = %r.ip, action = ?r.action, failure = ?f, "lease request failed");
        }
        match &r.result {
            Err(Failure::Other(_)) => self.counters.lease_api_errors += 1,
            Err(Failure::Conflict) => self.counters.lease_conflicts += 1,
            _ => {}
        }
        let was_dormant = self.mgr.lock().is_dormant(r.ip);
        let taken = self.mgr.lock().on_result(r.ip, &r.action, r.sent, r.result, now);
        if let Action::Expire(LivenessAction::Expire { holder, .. }) = &r.action {
            // The holder's liveness Lease as the API server has it.
            if let Some(fresh) = r.fresh {
                self.mgr.lock().observe_liveness(holder, Some(fresh), now);
            }
            return;
        }
        if let Some(fresh) = r.fresh {
            // Newer than what the watch showed: a record naming someone else
            // fences at once (observe), one naming us gives the next renewal
            // the right resourceVersion.
            self.mgr.lock().observe(r.ip, Some(fresh), now);
        }
        // Before any tables holding a newly taken IP are applied.
        self.push_valid_until();
        if was_dormant && self.mgr.lock().held(now).contains(&r.ip) {
            // Served again with every session it kept; the neighbours are
            // told again in case someone served it meanwhile.
            self.counters.resumed += 1;
            tracing::info!(ip = %r.ip, "dormant egress IP served again: its Lease is ours once more, its sessions were kept");
            self.sink.announce(&[r.ip]);
        }
        if let Some(taken) = taken {
            self.counters.takeovers += 1;
            self.event_taken(&taken);
        }
    }

    /// Tells the data plane each address's deadline ([`ValidUntil::push`])
    /// with the next hops of the last tables.
    fn push_valid_until(&mut self) {
        self.valid_until.lock().push(&self.mgr, None);
    }

    /// [`Self::push_valid_until`] with the (egress IP, next hop) pairs of
    /// the tables about to be applied.
    fn push_valid_until_with(&mut self, next_hops: &[(IpAddr, IpAddr)]) {
        self.valid_until.lock().push(&self.mgr, Some(next_hops));
    }

    /// Whether this gateway writes status ([`super::status_writer::is_writer`]):
    /// among the gateway Nodes that are not drained.
    fn is_status_writer(&self, obs: &Observed, wall: Timestamp) -> bool {
        let nodes = self.stores.nodes.state();
        let eligible = nodes.iter().filter(|n| !observe::draining(n)).filter_map(|n| n.metadata.name.as_deref());
        super::status_writer::is_writer(&self.opts.node_name, obs.leases.values(), eligible, wall)
    }

    /// Hands every status that differs from what its object shows to the
    /// writers; settles those that match.
    fn write_status(&mut self, d: &Desired) {
        let policies = self.stores.policies.state();
        self.policy_writes.retain(|name| policies.iter().any(|p| p.name_any() == name));
        for p in &policies {
            let name = p.name_any();
            let Some(st) = d.policy_status.get(&name) else { continue };
            let value = |st: &EgressPolicyStatus| json!({ "apiVersion": EgressPolicy::api_version(&()), "kind": EgressPolicy::kind(&()), "status": st });
            let slot = (&mut self.policy_writes, &mut self.conditions_sent);
            hand_over(slot, &format!("policy/{name}"), &name, p.status.as_ref(), st, value);
        }
        let pools = self.stores.pools.state();
        self.pool_writes.retain(|name| pools.iter().any(|p| p.name_any() == name));
        for p in &pools {
            let name = p.name_any();
            let Some(st) = d.pool_status.get(&name) else { continue };
            let value = |st: &EgressIPPoolStatus| json!({ "metadata": { "resourceVersion": p.resource_version() }, "status": st });
            let slot = (&mut self.pool_writes, &mut self.conditions_sent);
            hand_over(slot, &format!("pool/{name}"), &name, p.status.as_ref(), st, value);
        }
        self.conditions_sent.retain(|key, _| match key.split_once('/') {
            Some(("policy", n)) => policies.iter().any(|p| p.name_any() == n),
            Some(("pool", n)) => pools.iter().any(|p| p.name_any() == n),
            _ => false,
        });
    }

    /// A Warning Event for each port-use level newly reached on this
    /// gateway (crate::port_use: once per crossing, re-armed below the
    /// hysteresis), on the owner of the egress IP (its policy or Service)
    /// and, for a pod near its quota, on the pod. The Events are sent by
    /// tasks: the pass does not wait for them.
    fn report_port_use(&mut self, d: &Desired) {
        let Some(monitor) = self.opts.port_use.clone() else { return };
        let crossings = monitor.0.take_crossings();
        if crossings.is_empty() {
            return;
        }
        let events = crate::port_use::events(
            &crossings,
            &self.opts.node_name,
            |ip| d.ips.get(&ip).and_then(|a| self.owner_ref(&a.owner)),
            |ip| self.pod_ref(ip),
        );
        for (reference, reason, note) in events {
            self.publish(reference, "Warning", reason, "AllocatePort", note);
        }
    }

    /// The running pod holding `ip`, from the watch (a finished pod may
    /// still show an address a new one holds).
    fn pod_ref(&self, ip: IpAddr) -> Option<ObjectReference> {
        let text = ip.to_string();
        self.stores
            .pods
            .state()
            .iter()
            .find(|p| {
                p.status.as_ref().is_some_and(|s| {
                    !matches!(s.phase.as_deref(), Some("Succeeded" | "Failed"))
                        && (s.pod_ip.as_deref() == Some(text.as_str())
                            || s.pod_ips.as_deref().unwrap_or_default().iter().any(|i| i.ip == text))
                })
            })
            .map(|p| p.object_ref(&()))
    }

    fn publish(&mut self, reference: ObjectReference, type_: &'static str, reason: &str, action: &str, note: String) {
        let client = self.client.clone();
        let ev = event(&reference, &self.opts.node_name, type_, reason, action, note, Timestamp::now());
        self.writes.spawn(async move {
            if let Err(e) = publish_event(client, ev).await {
                tracing::warn!(error = %e, "event not sent");
            }
        });
    }

    fn owner_ref(&self, owner: &Owner) -> Option<ObjectReference> {
        match owner {
            Owner::Policy(name) => {
                self.stores.policies.state().iter().find(|p| p.name_any() == *name).map(|p| p.object_ref(&()))
            }
            Owner::Service { namespace, name } => self
                .stores
                .services
                .state()
                .iter()
                .find(|s| s.name_any() == *name && s.namespace().as_deref() == Some(namespace.as_str()))
                .map(|s| s.object_ref(&())),
        }
    }

    fn event_taken(&mut self, taken: &Taken) {
        let Some(a) = self.last.ips.get(&taken.ip).cloned() else { return };
        let Some(reference) = self.owner_ref(&a.owner) else { return };
        let me = self.opts.node_name.clone();
        let (reason, note) = match &taken.previous {
            Some(prev) if *prev != me => (
                reason::EGRESS_IP_FAILOVER,
                format!("egress IP {} moved from gateway {prev} (its Lease expired) to {me}", taken.ip),
            ),
            _ => (reason::EGRESS_IP_ASSIGNED, format!("egress IP {} is now held by gateway {me}", taken.ip)),
        };
        tracing::info!(ip = %taken.ip, previous = ?taken.previous, "took egress IP");
        self.publish(reference, "Normal", reason, "TakeLease", note);
    }

    fn report_service_problems(&mut self, d: &Desired) {
        let now: BTreeSet<(String, String, &'static str)> =
            d.service_problems.iter().map(|p| (p.namespace.clone(), p.name.clone(), p.reason)).collect();
        for p in &d.service_problems {
            let key = (p.namespace.clone(), p.name.clone(), p.reason);
            if self.problems_reported.contains(&key) {
                continue;
            }
            let owner = Owner::Service { namespace: p.namespace.clone(), name: p.name.clone() };
            if let Some(reference) = self.owner_ref(&owner) {
                self.publish(reference, "Warning", p.reason, "Validate", p.message.clone());
            }
        }
        self.problems_reported = now;
    }

    /// Graceful stop: everything out of the tables, then the Leases released
    /// so the others take over at once instead of after expiry.
    async fn shutdown(&mut self) {
        let held: Vec<IpAddr> = self.mgr.lock().held(Instant::now()).into_iter().collect();
        if let Some(ha) = &self.ha {
            // Hand over with the sessions: each standby gets a full copy
            // first (bounded).
            let t0 = Instant::now();
            // Nothing renews while this waits (the loop has ended): stay
            // well inside the deadline of the last renewal (sent less than
            // a retry period ago, valid for renewDeadline).
            let wait = HANDOVER_SYNC_WAIT
                .min(self.opts.timing.renew_deadline.saturating_sub(self.opts.timing.retry_period * 2));
            let missing = ha.flush(&held, wait).await;
            tracing::info!(ips = ?held, not_in_sync = ?missing, ms = t0.elapsed().as_millis() as u64, "hand-over: standbys synchronised");
        }
        // The copies just flushed: IPs leaving in sync are handed over.
        self.observe_hand_overs();
        // No renewal may re-hold what is fenced below.
        drop(self.renew_task.take());
        let now = Instant::now();
        let mut spec = self.last_applied.clone().unwrap_or_default();
        spec.egress_ips.clear();
        spec.neighbor_addresses.clear();
        self.mgr.lock().fence(now, &BTreeSet::new());
        self.push_valid_until();
        if !self.apply(&spec).await {
            // The data plane may still serve them: let the Leases expire
            // instead (the others take over after leaseDuration).
            tracing::error!(ips = ?held, "tables without the egress IPs not applied; Leases left to expire");
            return;
        }
        let mut releases = JoinSet::new();
        for ip in held {
            // The manager's record: our last renewal's answer is newer than the watch's.
            let Some(rec) = self.mgr.lock().record(ip).cloned() else { continue };
            if rec.holder.as_deref() != Some(self.opts.node_name.as_str()) {
                continue;
            }
            let (api, opts) = (self.leases.clone(), self.opts.clone());
            let ha = self.renewer.inputs.lock().get(&ip).and_then(|i| i.ha.clone());
            let ha = released_fields(self.ha.as_ref(), ip, ha);
            releases.spawn(release(api, opts, ip, rec, ha));
        }
        let _ = tokio::time::timeout(RELEASE_WAIT, async { while releases.join_next().await.is_some() {} }).await;
    }
}

/// Runs the Kubernetes control plane of this gateway until `shutdown`
/// completes: watches the cluster, competes for egress-IP Leases, publishes
/// every change of this gateway's tables through `sink`, writes status and
/// Events. On shutdown it removes its egress IPs from the tables and releases
/// their Leases (bounded by one second). Returns an error only for invalid
/// options; API errors are retried forever.
pub async fn run(
    client: kube::Client,
    opts: K8sOptions,
    sink: Arc<dyn TablesSink>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), K8sError> {
    run_supervised(client, opts, sink, shutdown, Arc::default(), None).await.map(drop)
}

/// [`run`], beating `heartbeat` once per iteration of the sync loop, for a
/// watchdog that ends the process when the loop stops (daemon/mod.rs).
pub async fn run_supervised(
    client: kube::Client,
    opts: K8sOptions,
    sink: Arc<dyn TablesSink>,
    shutdown: impl Future<Output = ()>,
    heartbeat: Arc<Heartbeat>,
    ending: Option<super::uninstall::Watch>,
) -> Result<Option<super::uninstall::Ending>, K8sError> {
    opts.validate()?;
    let notify = Arc::new(Notify::new());
    if let Some(m) = &opts.port_use {
        m.0.deliver_to(notify.clone());
    }
    let mut watchers = JoinSet::new();
    let watch_restart = Arc::new(Notify::new());
    let stores = Stores::start(&client, &opts, &notify, &watch_restart, &mut watchers);
    let mgr = Arc::new(Mutex::new(LeaseManager::new(opts.node_name.clone(), opts.timing)));
    // The channel runs before the cluster's state is loaded: a gateway
    // restarted while the API server is down still answers its peers'
    // failsafe requests (from the peer cache).
    let ha = match &opts.ha {
        None => None,
        Some(h) => Some(
            crate::ha::Ha::start(&opts.node_name, h, mgr.clone(), sink.sessions(), notify.clone())
                .await
                .map_err(K8sError::Ha)?,
        ),
    };
    let mut shutdown = std::pin::pin!(shutdown);
    tokio::select! {
        _ = stores.ready() => {}
        _ = &mut shutdown => {
            watchers.abort_all();
            if let Some(ha) = ha {
                ha.shutdown("stopping").await;
            }
            return Ok(match ending {
                Some(w) => Some(w.ending().await),
                None => None,
            });
        }
    }
    if opts.liveness {
        mgr.lock().use_liveness(Instant::now());
        tracing::info!(node = %opts.node_name, "ownership by liveness Lease (ADR 0016)");
    }
    tracing::info!(node = %opts.node_name, "Kubernetes state loaded; control plane running");
    let (tx, mut rx) = mpsc::unbounded_channel();
    let valid_until = Arc::new(Mutex::new(ValidUntil::new(sink.clone())));
    let renewer = Renewer::new(&mgr);
    let renew_task = RenewTask(tokio::spawn(renewer.clone().run(
        mgr.clone(),
        Api::namespaced(client.clone(), &opts.lease_namespace),
        opts.clone(),
        valid_until.clone(),
        notify.clone(),
    )));
    let policy_writes = StatusWriter::new("EgressPolicy", policy_status_write(&client));
    let pool_writes = StatusWriter::new("EgressIPPool", pool_status_write(&client));
    let mut sync = SyncLoop {
        leases: Api::namespaced(client.clone(), &opts.lease_namespace),
        mgr,
        ha,
        valid_until,
        renewer,
        renew_task: Some(renew_task),
        counters: Default::default(),
        heartbeat: heartbeat.clone(),
        first_pass_at: None,
        drain_since: None,
        drain_wake: None,
        watch_restart,
        watches_restarted_at: None,
        // The cloud's view is read again (discovery, interfaces, drift)
        // once per `kubernetes.resyncPeriod`, like the cluster's.
        clouds: crate::cloud::task::Clouds::start(crate::cloud::providers(), opts.resync_period, notify.clone()),
        local: LocalConfig {
            node_name: opts.node_name.clone(),
            nat: opts.nat,
            guard: opts.guard.clone(),
            tunnel_port: opts.tunnel_port,
            role: super::desired::Role::Gateway,
        },
        client,
        sink,
        stores,
        results: tx,
        writes: JoinSet::new(),
        last_applied: None,
        hand_overs: Default::default(),
        last_apply_error: None,
        last: Desired::default(),
        policy_writes,
        pool_writes,
        conditions_sent: HashMap::new(),
        problems_reported: BTreeSet::new(),
        refusals_reported: BTreeSet::new(),
        opts,
    };
    let mut next_full = Instant::now() + sync.opts.resync_period;
    let mut judged = None;
    let mut ending = ending;
    loop {
        let now = Instant::now();
        sync.pass(now).await;
        let took = now.elapsed();
        if took >= sync.opts.timing.retry_period {
            tracing::debug!(ms = took.as_millis() as u64, "sync pass longer than a retry period");
        }
        if sync.ha.as_ref().is_some_and(crate::ha::Ha::stopped) {
            tracing::error!("the peer channel's task stopped; stopping the control plane");
            break;
        }
        heartbeat.beat();
        if now >= next_full {
            next_full = now + sync.opts.resync_period;
        }
        while sync.writes.try_join_next().is_some() {}
        let mut wake = sync.mgr.lock().next_wake(now).min(next_full);
        if let Some(w) = sync.drain_wake.take() {
            wake = wake.min(w);
        }
        let renewer_ended = async {
            match sync.renew_task.as_mut() {
                Some(t) => (&mut t.0).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = &mut shutdown => {
                // The DaemonSet is read while the IPs are handed over
                // (the pod's grace period holds both).
                judged = ending.take().map(|w| tokio::spawn(w.ending()));
                break;
            }
            r = renewer_ended => {
                // Renewals stopped: every deadline will pass. Stop as on a
                // fatal error (the supervisor fences everything at once).
                tracing::error!(result = ?r, "the Lease renewer stopped; stopping the control plane");
                sync.renew_task = None;
                break;
            }
            _ = tokio::time::sleep_until(wake) => {}
            Some(r) = rx.recv() => {
                sync.on_result(r);
                while let Ok(r) = rx.try_recv() {
                    sync.on_result(r);
                }
            }
            _ = notify.notified() => {}
        }
    }
    sync.shutdown().await;
    watchers.abort_all();
    sync.writes.abort_all();
    if let Some(ha) = sync.ha.take() {
        ha.shutdown("stopping").await;
    }
    // Judged only on a stop that was asked for: a control plane that died
    // keeps the node as it is.
    let Some(judged) = judged else { return Ok(None) };
    let ending =
        judged.await.unwrap_or_else(|e| super::uninstall::Ending::Restart(format!("the DaemonSet's read failed: {e}")));
    if ending.cleans_up() {
        // The addresses were handed over above; the cloud's assignments of
        // them to this gateway's interface go too (an uninstall leaves
        // nothing assigned; a retired gateway's successors assign their own).
        let left = sync.clouds.release_all(CLOUD_RELEASE_WAIT).await;
        if left > 0 {
            tracing::warn!(
                left,
                "stopping for good: cloud addresses not released in time; the next holder's assignment takes them"
            );
        }
    }
    Ok(Some(ending))
}
