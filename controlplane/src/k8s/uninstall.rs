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
//! the DaemonSet never read) is a restart: it keeps the node closed rather
//! than open.

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
/// for the gateway, 30 s for the agent, and the clean-up follows it).
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

/// The DaemonSet that owns this process's Pod, once read, with its
/// namespace: the gateway names it as the owner of the Leases it writes, so
/// that Kubernetes' garbage collector deletes them with the DaemonSet (an
/// owner must be in the same namespace: Leases elsewhere get none).
#[derive(Clone, Default)]
pub struct OwnerSlot(Arc<OnceLock<(String, OwnerReference)>>);

impl OwnerSlot {
    /// The owner, for an object in `namespace`.
    pub fn for_namespace(&self, namespace: &str) -> Option<&OwnerReference> {
        self.0.get().filter(|(ns, _)| ns == namespace).map(|(_, r)| r)
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
        f.debug_tuple("OwnerSlot").field(&self.0.get().map(|(ns, r)| format!("{ns}/{}", r.name))).finish()
    }
}

/// The DaemonSet that owns the Pod, as its ownerReference names it.
#[derive(Clone, Debug)]
struct Owner {
    name: String,
    uid: String,
}

struct Known {
    owner: Owner,
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

    /// How this stop ends: one more read of the DaemonSet (bounded), then
    /// the watched state.
    pub async fn ending(mut self) -> Ending {
        let Some(pod) = self.pod.take() else {
            return Ending::Restart("not in a pod".into());
        };
        let (owner, daemonsets, node) = {
            let k = self.known.lock();
            match &*k {
                None => {
                    return Ending::Restart(format!(
                        "the DaemonSet of Pod {}/{} was never read: kept as it is",
                        pod.namespace, pod.name
                    ))
                }
                Some(k) => (k.owner.clone(), k.daemonsets.clone(), k.node.clone()),
            }
        };
        let labels = node.get(&ObjectRef::new(&self.node)).map(|n| n.metadata.labels.clone().unwrap_or_default());
        let api: Api<DaemonSet> = Api::namespaced(self.client.clone(), &pod.namespace);
        let fresh = tokio::time::timeout(FINAL_READ, api.get_opt(&owner.name)).await;
        self.tasks.abort_all();
        let watched = || daemonsets.get(&ObjectRef::new(&owner.name).within(&pod.namespace)).map(|d| (*d).clone());
        let ds = match fresh {
            Ok(Ok(ds)) => ds,
            Ok(Err(e)) => {
                tracing::info!(error = %e, "the DaemonSet not read at the stop; its watch decides");
                watched()
            }
            Err(_) => {
                tracing::info!("the DaemonSet not read within 2 s at the stop; its watch decides");
                watched()
            }
        };
        judge(&pod.namespace, &owner.name, &owner.uid, ds.as_ref(), &self.node, labels.as_ref())
    }
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
    let owner = loop {
        match pods.get(&pod.name).await {
            Ok(p) => match owner_of(&p) {
                Some(o) => break o,
                None => {
                    tracing::info!(pod = %pod.name, "the Pod has no DaemonSet owner: a stop never cleans up");
                    return;
                }
            },
            Err(e) => {
                tracing::warn!(pod = %pod.name, error = %e, "reading this Pod's owner (for uninstall); retrying");
                tokio::time::sleep(POD_RETRY).await;
            }
        }
    };
    let _ = slot.0.set((
        pod.namespace.clone(),
        OwnerReference {
            api_version: "apps/v1".into(),
            kind: "DaemonSet".into(),
            name: owner.name.clone(),
            uid: owner.uid.clone(),
            ..Default::default()
        },
    ));
    let mut tasks = JoinSet::new();
    let quiet = Arc::new(Notify::new());
    let one = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
    let daemonsets =
        watch(Api::namespaced(client.clone(), &pod.namespace), one(&owner.name), quiet.clone(), &mut tasks);
    let nodes = watch_node_metadata(Api::all(client), one(&node), quiet, &mut tasks);
    // Listed once: from here an absent DaemonSet was deleted.
    daemonsets.wait_until_ready().await.ok();
    tracing::info!(daemonset = %owner.name, "uninstall is told from a restart by this DaemonSet");
    *known.lock() = Some(Known { owner, daemonsets, node: nodes });
    while tasks.join_next().await.is_some() {}
}

fn owner_of(pod: &Pod) -> Option<Owner> {
    pod.metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|r| r.kind == "DaemonSet" && r.controller == Some(true))
        .map(|r| Owner { name: r.name.clone(), uid: r.uid.clone() })
}

/// The decision, from what is known of the DaemonSet and the Node.
fn judge(
    namespace: &str,
    name: &str,
    uid: &str,
    ds: Option<&DaemonSet>,
    node: &str,
    labels: Option<&BTreeMap<String, String>>,
) -> Ending {
    let Some(ds) = ds else {
        return Ending::Uninstall(format!("DaemonSet {namespace}/{name} is deleted"));
    };
    if ds.metadata.uid.as_deref() != Some(uid) {
        return Ending::Uninstall(format!("DaemonSet {namespace}/{name} was deleted and created again"));
    }
    if ds.metadata.deletion_timestamp.is_some() {
        return Ending::Uninstall(format!("DaemonSet {namespace}/{name} is being deleted"));
    }
    let Some(labels) = labels else {
        return Ending::Retired(format!("Node {node} is deleted"));
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
        // only matchFields (by name) is not judged here: it is taken as met.
        Some(terms) if !terms.is_empty() => {
            let met = terms.iter().any(|t| t.match_expressions.iter().flatten().all(|r| requirement_met(r, labels)));
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

    fn labels(l: &[(&str, &str)]) -> BTreeMap<String, String> {
        l.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn judged(d: Option<&DaemonSet>, l: Option<&BTreeMap<String, String>>) -> Ending {
        judge("egret-system", "egret-node", "u1", d, "w1", l)
    }

    #[test]
    fn a_daemonset_that_still_runs_here_is_a_restart() {
        let l = labels(&[("egret.dev/gateway", "true")]);
        let d = ds(json!({"spec": {"nodeSelector": {"egret.dev/gateway": "true"}}}));
        assert!(matches!(judged(Some(&d), Some(&l)), Ending::Restart(_)));
        assert!(matches!(judged(Some(&ds(json!({}))), Some(&l)), Ending::Restart(_)));
    }

    #[test]
    fn a_deleted_replaced_or_deleting_daemonset_is_an_uninstall() {
        let l = labels(&[]);
        let e = judged(None, Some(&l));
        assert_eq!(e, Ending::Uninstall("DaemonSet egret-system/egret-node is deleted".into()));
        let other = ds(json!({"metadata": {"uid": "u2"}}));
        assert!(judged(Some(&other), Some(&l)).reason().contains("created again"));
        let deleting = ds(json!({"metadata": {"deletionTimestamp": "2026-11-29T00:00:00Z"}}));
        assert!(judged(Some(&deleting), Some(&l)).reason().contains("being deleted"));
        assert!(e.cleans_up());
    }

    #[test]
    fn a_node_the_daemonset_no_longer_selects_is_retired() {
        let d = ds(json!({"spec": {"nodeSelector": {"egret.dev/gateway": "true"}}}));
        let e = judged(Some(&d), Some(&labels(&[("egret.dev/gateway", "false")])));
        assert_eq!(
            e,
            Ending::Retired(
                "DaemonSet egret-system/egret-node no longer selects Node w1: nodeSelector egret.dev/gateway=true"
                    .into()
            )
        );
        assert!(matches!(judged(Some(&d), None), Ending::Retired(r) if r.contains("Node w1 is deleted")));
    }

    #[test]
    fn required_node_affinity_is_judged_as_the_scheduler_would() {
        let d = ds(json!({"spec": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]},
                                  {"key": "retired", "operator": "DoesNotExist"}]},
            {"matchExpressions": [{"key": "cpus", "operator": "Gt", "values": ["8"]}]}
        ]}}}}}));
        let restart = |l: &[(&str, &str)]| matches!(judged(Some(&d), Some(&labels(l))), Ending::Restart(_));
        assert!(restart(&[("zone", "a")]));
        assert!(!restart(&[("zone", "a"), ("retired", "yes")]));
        assert!(!restart(&[("zone", "c")]));
        assert!(restart(&[("zone", "c"), ("cpus", "16")]));
        assert!(!restart(&[("cpus", "4")]));
        assert!(!restart(&[("cpus", "many")]));
    }

    #[test]
    fn outside_a_pod_there_is_no_identity() {
        assert_eq!(PodIdentity::new(None, Some("p".into())), None);
        assert_eq!(PodIdentity::new(Some("ns".into()), Some(String::new())), None);
        assert!(PodIdentity::new(Some("ns".into()), Some("p".into())).is_some());
    }

    #[test]
    fn the_pods_owner_is_its_controlling_daemonset() {
        let p: Pod = serde_json::from_value(json!({"metadata": {"name": "p", "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": "w1", "uid": "n"},
            {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "egret-node", "uid": "u1", "controller": true}
        ]}}))
        .unwrap();
        let o = owner_of(&p).unwrap();
        assert_eq!((o.name.as_str(), o.uid.as_str()), ("egret-node", "u1"));
        let bare: Pod = serde_json::from_value(json!({"metadata": {"name": "p"}})).unwrap();
        assert!(owner_of(&bare).is_none());
    }
}
