//! Is this stop an uninstall? A stopping gateway or node agent must tell
//! three endings apart:
//!
//! - **a restart** (a rolling update, `kubectl delete pod`, a crash): keep
//!   everything in the kernel, so the next process finds it in place and no
//!   selected pod leaves with its node's address meanwhile;
//! - **an uninstall** (`helm uninstall`, `kubectl delete -f`): its DaemonSet
//!   is gone, being deleted, or replaced by another of the same name;
//! - **a retirement**: the DaemonSet stays but no longer selects this Node
//!   (the documented way to retire a gateway is to remove its label).
//!
//! On the last two the process removes what it put on the node. The
//! decision needs the DaemonSet, but `helm uninstall` deletes the
//! ServiceAccount and the RBAC right after the DaemonSet, so a read at
//! SIGTERM can be refused. The process therefore watches its DaemonSet and
//! its Node (two single-object watches) from the start, and at SIGTERM
//! reads the DaemonSet once more, briefly; a refused or failed read leaves
//! the watched state to decide. Anything unknown (not in a pod, the Pod or
//! the DaemonSet never read, the Node neither read nor watched) is a
//! restart: it keeps the node closed rather than open.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use super::controller::{watch, watch_node_metadata};

/// How long the read at SIGTERM may take (the pod's grace period is 10 s
/// for the gateway, which reads while it hands its IPs over, and 5 s for
/// the agent, whose clean-up follows in about 0.1 s).
const FINAL_READ: Duration = Duration::from_secs(2);
/// The first Pod read is retried at this pace until it answers.
const POD_RETRY: Duration = Duration::from_secs(5);

/// How this process ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Keep what is in the kernel: another process of the DaemonSet follows.
    Restart(String),
    /// The DaemonSet is gone: remove everything, cluster objects included.
    Uninstall(String),
    /// The DaemonSet no longer runs here: remove what is on this node.
    Retired(String),
}

impl Ending {
    /// Uninstall or retirement: the node's state goes.
    pub fn cleans_up(&self) -> bool {
        !matches!(self, Ending::Restart(_))
    }

    /// Why, for the log.
    pub fn reason(&self) -> &str {
        match self {
            Ending::Restart(r) | Ending::Uninstall(r) | Ending::Retired(r) => r,
        }
    }
}

/// This process's Pod, from the downward API (`POD_NAMESPACE`, `POD_NAME`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodIdentity {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl PodIdentity {
    /// Both names, or `None` outside a pod (or when either is empty).
    pub fn new(namespace: Option<String>, name: Option<String>) -> Option<Self> {
        match (namespace, name) {
            (Some(ns), Some(n)) if !ns.is_empty() && !n.is_empty() => Some(PodIdentity { namespace: ns, name: n }),
            _ => None,
        }
    }

    /// From `$POD_NAMESPACE` and `$POD_NAME`.
    pub fn from_env() -> Option<Self> {
        Self::new(std::env::var("POD_NAMESPACE").ok(), std::env::var("POD_NAME").ok())
    }
}

/// The DaemonSet that owns this process's Pod, once read, as its watch
/// has it now: the gateway names it as an owner of the Leases it writes, so
/// that Kubernetes' garbage collector deletes them with the DaemonSet. An
/// owner must be in the same namespace: Leases elsewhere get none from
/// this gateway. The uid is the live object's (a DaemonSet deleted and
/// created again that adopted this Pod is the new one).
#[derive(Clone, Default)]
pub struct OwnerSlot(Arc<OnceLock<(String, String, Store<DaemonSet>)>>);

impl OwnerSlot {
    /// The owner reference, for an object in `namespace`, while the
    /// DaemonSet exists and is not being deleted.
    pub fn for_namespace(&self, namespace: &str) -> Option<OwnerReference> {
        let (ns, name, store) = self.0.get().filter(|(ns, _, _)| ns == namespace)?;
        let ds = store.get(&ObjectRef::new(name).within(ns))?;
        if ds.metadata.deletion_timestamp.is_some() {
            return None;
        }
        Some(OwnerReference {
            api_version: "apps/v1".into(),
            kind: "DaemonSet".into(),
            name: name.clone(),
            uid: ds.metadata.uid.clone()?,
            ..Default::default()
        })
    }

    /// `previous` owners of an object in `namespace` with this DaemonSet's
    /// entry added or brought up to date: other owners are kept (another
    /// gateway DaemonSet in the namespace; the object goes when all are
    /// gone), and nothing is dropped while this one is not known.
    pub fn merged(&self, namespace: &str, previous: &[super::lease::Owner]) -> Vec<OwnerReference> {
        let mut out: Vec<OwnerReference> = previous.iter().map(Into::into).collect();
        if let Some(mine) = self.for_namespace(namespace) {
            out.retain(|o| !(o.kind == mine.kind && o.api_version == mine.api_version && o.name == mine.name));
            out.push(mine);
        }
        out
    }
}

impl PartialEq for OwnerSlot {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for OwnerSlot {}

impl std::fmt::Debug for OwnerSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("OwnerSlot").field(&self.0.get().map(|(ns, name, _)| format!("{ns}/{name}"))).finish()
    }
}

struct Known {
    /// The DaemonSet's name (the Pod's controlling `apps/v1` owner).
    daemonset: String,
    daemonsets: Store<DaemonSet>,
    node: Store<PartialObjectMeta<Node>>,
}

/// Watches this process's DaemonSet and Node; [`Watch::ending`] decides.
pub struct Watch {
    pod: Option<PodIdentity>,
    node: String,
    client: kube::Client,
    known: Arc<Mutex<Option<Known>>>,
    owner: OwnerSlot,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch").field("pod", &self.pod).field("node", &self.node).finish_non_exhaustive()
    }
}

impl Watch {
    /// Starts reading the Pod's owner and watching it and `node`. Returns at
    /// once; nothing here delays the start.
    pub fn start(client: kube::Client, pod: Option<PodIdentity>, node: &str) -> Self {
        let known = Arc::new(Mutex::new(None));
        let owner = OwnerSlot::default();
        let mut tasks = JoinSet::new();
        match &pod {
            None => tracing::info!(
                "not in a pod (no POD_NAMESPACE and POD_NAME): a stop never cleans up; `egret node cleanup` and `egret cleanup` do"
            ),
            Some(p) => {
                tasks.spawn(follow(client.clone(), p.clone(), node.to_owned(), known.clone(), owner.clone()));
            }
        }
        Watch { pod, node: node.to_owned(), client, known, owner, tasks }
    }

    /// The Pod's DaemonSet, filled in once read.
    pub fn owner(&self) -> OwnerSlot {
        self.owner.clone()
    }

    /// How this stop ends: one more read of the DaemonSet and the Node
    /// (bounded), then the watched state.
    pub async fn ending(mut self) -> Ending {
        let Some(pod) = self.pod.take() else {
            return Ending::Restart("not in a pod".into());
        };
        let (name, daemonsets, nodes) = {
            let k = self.known.lock();
            match &*k {
                None => {
                    return Ending::Restart(format!(
                        "the DaemonSet of Pod {}/{} was never read: kept as it is",
                        pod.namespace, pod.name
                    ))
                }
                Some(k) => (k.daemonset.clone(), k.daemonsets.clone(), k.node.clone()),
            }
        };
        let ds_api: Api<DaemonSet> = Api::namespaced(self.client.clone(), &pod.namespace);
        let node_api: Api<PartialObjectMeta<Node>> = Api::all(self.client.clone());
        let (ds_read, node_read) = tokio::join!(
            tokio::time::timeout(FINAL_READ, ds_api.get_opt(&name)),
            tokio::time::timeout(FINAL_READ, node_api.get_metadata_opt(&self.node)),
        );
        self.tasks.abort_all();
        let ds = match ds_read {
            Ok(Ok(ds)) => ds,
            other => {
                tracing::info!(read = ?other.map(drop).map_err(|_| "timed out"), "the DaemonSet not read at the stop; its watch decides");
                daemonsets.get(&ObjectRef::new(&name).within(&pod.namespace)).map(|d| (*d).clone())
            }
        };
        let node = match node_read {
            Ok(Ok(Some(n))) => NodeSeen::Labels(n.metadata.labels.unwrap_or_default()),
            Ok(Ok(None)) => NodeSeen::Gone,
            _ => match nodes.get(&ObjectRef::new(&self.node)) {
                Some(n) => NodeSeen::Labels(n.metadata.labels.clone().unwrap_or_default()),
                // Listed, but not there now: deleted since; still, without
                // a read that says so, the safe answer.
                None => NodeSeen::Unknown,
            },
        };
        judge(&pod.namespace, &name, ds.as_ref(), &self.node, &node)
    }
}

/// The Node as last known.
#[derive(Debug)]
enum NodeSeen {
    Labels(BTreeMap<String, String>),
    /// A read at the stop found none.
    Gone,
    /// Neither read nor watched.
    Unknown,
}

/// Reads the Pod's owner (retrying), then keeps the DaemonSet and the Node
/// watched.
async fn follow(
    client: kube::Client,
    pod: PodIdentity,
    node: String,
    known: Arc<Mutex<Option<Known>>>,
    slot: OwnerSlot,
) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &pod.namespace);
    let daemonset = loop {
        match pods.get(&pod.name).await {
            Ok(p) => match owner_of(&p) {
                Some(o) => break o,
                None => {
                    tracing::info!(pod = %pod.name, "the Pod has no apps/v1 DaemonSet owner: a stop never cleans up");
                    return;
                }
            },
            Err(e) => {
                tracing::warn!(pod = %pod.name, error = %e, "reading this Pod's owner (for uninstall); retrying");
                tokio::time::sleep(POD_RETRY).await;
            }
        }
    };
    let mut tasks = JoinSet::new();
    let quiet = Arc::new(Notify::new());
    let one = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
    let daemonsets = watch(Api::namespaced(client.clone(), &pod.namespace), one(&daemonset), quiet.clone(), &mut tasks);
    let nodes = watch_node_metadata(Api::all(client), one(&node), quiet, &mut tasks);
    // Both listed once: from here an absent DaemonSet was deleted.
    let (ds_ready, node_ready) = futures::join!(daemonsets.wait_until_ready(), nodes.wait_until_ready());
    if ds_ready.is_err() || node_ready.is_err() {
        return;
    }
    let _ = slot.0.set((pod.namespace.clone(), daemonset.clone(), daemonsets.clone()));
    tracing::info!(daemonset = %daemonset, "uninstall is told from a restart by this DaemonSet");
    *known.lock() = Some(Known { daemonset, daemonsets, node: nodes });
    while tasks.join_next().await.is_some() {}
}

fn owner_of(pod: &Pod) -> Option<String> {
    pod.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| r.api_version == "apps/v1" && r.kind == "DaemonSet" && r.controller == Some(true))
        .map(|r| r.name.clone())
}

/// The decision, from what is known of the DaemonSet and the Node. The
/// DaemonSet's uid is not compared: one deleted and created again that
/// selects this Node (`kubectl replace --force`, a quick reinstall, an
/// orphaning delete and re-apply) runs a pod here again, which finds the
/// node as this one leaves it.
fn judge(namespace: &str, name: &str, ds: Option<&DaemonSet>, node: &str, seen: &NodeSeen) -> Ending {
    let Some(ds) = ds else {
        return Ending::Uninstall(format!("DaemonSet {namespace}/{name} is deleted"));
    };
    if ds.metadata.deletion_timestamp.is_some() {
        return Ending::Uninstall(format!("DaemonSet {namespace}/{name} is being deleted"));
    }
    let labels = match seen {
        NodeSeen::Labels(l) => l,
        NodeSeen::Gone => return Ending::Retired(format!("Node {node} is deleted")),
        NodeSeen::Unknown => return Ending::Restart(format!("Node {node} not known at the stop: kept as it is")),
    };
    match unselected_by(ds, labels) {
        Some(why) => Ending::Retired(format!("DaemonSet {namespace}/{name} no longer selects Node {node}: {why}")),
        None => Ending::Restart(format!("DaemonSet {namespace}/{name} still runs on Node {node}")),
    }
}

/// Why the DaemonSet's pod template does not select a Node with `labels`
/// (its `nodeSelector`, then its required node affinity's
/// `matchExpressions`), or `None` when it does.
fn unselected_by(ds: &DaemonSet, labels: &BTreeMap<String, String>) -> Option<String> {
    let spec = ds.spec.template.spec.as_ref()?;
    for (k, v) in spec.node_selector.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Some(format!("nodeSelector {k}={v}"));
        }
    }
    let terms = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref())
        .map(|s| &s.node_selector_terms);
    match terms {
        // Terms are ORed; the requirements of one are ANDed. A term with
        // only matchFields (by name) is not judged here: it is taken as met
        // (a restart keeps the node); an empty term matches nothing.
        Some(terms) if !terms.is_empty() => {
            let met = terms.iter().any(|t| {
                let exprs = t.match_expressions.as_deref().unwrap_or_default();
                let fields = t.match_fields.as_deref().unwrap_or_default();
                (!exprs.is_empty() || !fields.is_empty()) && exprs.iter().all(|r| requirement_met(r, labels))
            });
            (!met).then(|| "its required node affinity".to_owned())
        }
        _ => None,
    }
}

fn requirement_met(r: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(&r.key);
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => !value.is_some_and(|v| values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(|v| number(v)), values.first().and_then(|v| number(v))), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(|v| number(v)), values.first().and_then(|v| number(v))), (Some(a), Some(b)) if a < b)
        }
        // An operator this version does not know: as the scheduler would
        // refuse the term, so does this.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use serde_json::json;

    fn ds(extra: serde_json::Value) -> DaemonSet {
        let mut v = json!({
            "metadata": {"name": "egret-node", "namespace": "egret-system", "uid": "u1"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}},
                "spec": {"containers": [{"name": "c"}]}}}
        });
        if let Some(spec) = extra.get("spec") {
            v["spec"]["template"]["spec"].as_object_mut().unwrap().extend(spec.as_object().unwrap().clone());
        }
        if let Some(meta) = extra.get("metadata") {
            v["metadata"].as_object_mut().unwrap().extend(meta.as_object().unwrap().clone());
        }
        serde_json::from_value(v).unwrap()
    }

    fn labels(l: &[(&str, &str)]) -> NodeSeen {
        NodeSeen::Labels(l.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
    }

    fn judged(d: Option<&DaemonSet>, seen: &NodeSeen) -> Ending {
        judge("egret-system", "egret-node", d, "w1", seen)
    }

    #[test]
    fn a_daemonset_that_still_runs_here_is_a_restart() {
        let l = labels(&[("egret.dev/gateway", "true")]);
        let d = ds(json!({"spec": {"nodeSelector": {"egret.dev/gateway": "true"}}}));
        assert!(matches!(judged(Some(&d), &l), Ending::Restart(_)));
        assert!(matches!(judged(Some(&ds(json!({}))), &l), Ending::Restart(_)));
        // Deleted and created again (another uid), selecting this Node: its
        // pod comes back here, so this is a restart too.
        let again = ds(json!({"metadata": {"uid": "u2"}}));
        assert!(matches!(judged(Some(&again), &l), Ending::Restart(_)));
    }

    #[test]
    fn a_deleted_or_deleting_daemonset_is_an_uninstall() {
        let l = labels(&[]);
        let e = judged(None, &l);
        assert_eq!(e, Ending::Uninstall("DaemonSet egret-system/egret-node is deleted".into()));
        assert!(e.cleans_up());
        let deleting = ds(json!({"metadata": {"deletionTimestamp": "2026-11-29T00:00:00Z"}}));
        assert!(judged(Some(&deleting), &l).reason().contains("being deleted"));
        // Deleted whatever is known of the Node.
        assert!(judged(None, &NodeSeen::Unknown).cleans_up());
    }

    #[test]
    fn a_node_the_daemonset_no_longer_selects_is_retired() {
        let d = ds(json!({"spec": {"nodeSelector": {"egret.dev/gateway": "true"}}}));
        let e = judged(Some(&d), &labels(&[("egret.dev/gateway", "false")]));
        assert_eq!(
            e,
            Ending::Retired(
                "DaemonSet egret-system/egret-node no longer selects Node w1: nodeSelector egret.dev/gateway=true"
                    .into()
            )
        );
        assert!(matches!(judged(Some(&d), &NodeSeen::Gone), Ending::Retired(r) if r.contains("Node w1 is deleted")));
    }

    #[test]
    fn a_node_neither_read_nor_watched_is_a_restart() {
        let d = ds(json!({"spec": {"nodeSelector": {"egret.dev/gateway": "true"}}}));
        assert!(!judged(Some(&d), &NodeSeen::Unknown).cleans_up());
    }

    #[test]
    fn required_node_affinity_is_judged_as_the_scheduler_would() {
        let d = ds(json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]},
                                  {"key": "retired", "operator": "DoesNotExist"}]},
            {"matchExpressions": [{"key": "cpus", "operator": "Gt", "values": ["8"]}]}
        ]}}}}}));
        let restart = |l: &[(&str, &str)]| !judged(Some(&d), &labels(l)).cleans_up();
        assert!(restart(&[("zone", "a")]));
        assert!(!restart(&[("zone", "a"), ("retired", "yes")]));
        assert!(!restart(&[("zone", "c")]));
        assert!(restart(&[("zone", "c"), ("cpus", "16")]));
        assert!(!restart(&[("cpus", "4")]));
        assert!(!restart(&[("cpus", "many")]));
        let empty_term = ds(json!({"spec": {"affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}}}));
        assert!(judged(Some(&empty_term), &labels(&[("zone", "a")])).cleans_up(), "an empty term matches nothing");
    }

    #[test]
    fn outside_a_pod_there_is_no_identity() {
        assert_eq!(PodIdentity::new(None, Some("p".into())), None);
        assert_eq!(PodIdentity::new(Some("ns".into()), Some(String::new())), None);
        assert!(PodIdentity::new(Some("ns".into()), Some("p".into())).is_some());
    }

    #[test]
    fn the_pods_owner_is_its_controlling_apps_v1_daemonset() {
        let p: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": "w1", "uid": "n"},
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "egret-node", "uid": "u1", "controller": true}
        ]}}))
        .unwrap();
        assert_eq!(owner_of(&p).as_deref(), Some("egret-node"));
        let bare: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}})).unwrap();
        assert!(owner_of(&bare).is_none());
        // OpenKruise's Advanced DaemonSet is not the apps/v1 one.
        let kruise: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "ownerReferences": [
            {"apiVersion": "apps.kruise.io/v1alpha1", "kind": "DaemonSet", "name": "egret-node", "uid": "k", "controller": true}
        ]}}))
        .unwrap();
        assert!(owner_of(&kruise).is_none());
    }

    #[test]
    fn an_unknown_owner_keeps_the_leases_owners() {
        let other = super::super::lease::Owner {
            api_version: "apps/v1".into(),
            kind: "DaemonSet".into(),
            name: "egret-gateway-b".into(),
            uid: "b".into(),
            ..Default::default()
        };
        let slot = OwnerSlot::default();
        let kept = slot.merged("egret-system", std::slice::from_ref(&other));
        assert_eq!(kept.len(), 1);
        assert_eq!(kept[0].name, "egret-gateway-b");
    }
}
