//! Kubernetes objects -> the plain observed-state structs of `desired.rs`
//! and the Lease records of `lease.rs`. Pure conversions: what counts as a
//! selectable pod, an annotated Service, a gateway's Lease.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use kube::ResourceExt;

use super::crd::{EgressIPPool, EgressPolicy, LEASE_IP_ANNOTATION, SERVICE_EGRESS_ANNOTATION};
use super::desired::{LeaseInfo, NodeInfo, PodInfo, PolicyInfo, PoolInfo, ServiceInfo, ServicePortInfo};
use super::lease::LeaseRecord;

/// A pod that can be selected: it has an IP, does not share the node's
/// network (its IP is the node's: translating it would translate the node),
/// and its containers have not all ended (phase `Succeeded` or `Failed`).
///
/// A pod being deleted (`deletionTimestamp` set) stays selected: it drains
/// for up to its grace period, keeps sending, and its node keeps routing it
/// to the gateway, which would otherwise pass it with its own address. It
/// leaves the selection when it is gone from the API, when it reaches a
/// terminal phase (its containers have stopped, and the kubelet may then
/// release its IP), or when its IP is given to another pod ([`pods`]).
pub fn pod(p: &Pod) -> Option<PodInfo> {
    observed_pod(p).map(|(info, _)| info)
}

/// [`pod`], and whether the pod is being deleted.
fn observed_pod(p: &Pod) -> Option<(PodInfo, bool)> {
    let spec = p.spec.as_ref();
    if spec.and_then(|s| s.host_network).unwrap_or(false) {
        return None;
    }
    let status = p.status.as_ref()?;
    if matches!(status.phase.as_deref(), Some("Succeeded" | "Failed")) {
        return None;
    }
    let mut ips: Vec<IpAddr> = status
        .pod_ips
        .iter()
        .flatten()
        .filter_map(|i| i.ip.parse().ok())
        .chain(status.pod_ip.iter().filter_map(|i| i.parse().ok()))
        .collect();
    ips.sort();
    ips.dedup();
    if ips.is_empty() {
        return None;
    }
    let info =
        PodInfo { namespace: p.namespace().unwrap_or_default(), name: p.name_any(), labels: p.labels().clone(), ips };
    Some((info, p.metadata.deletion_timestamp.is_some()))
}

/// The selectable pods of a pod list ([`pod`]), each address claimed once:
/// an address a pod being deleted shares with a pod that is not (the CNI
/// gave it to a new pod) belongs to the new pod, and among pods being
/// deleted that share one, to the one created last. A pod being deleted
/// whose every address went to another pod is left out.
pub fn pods<'a>(list: impl IntoIterator<Item = &'a Pod>) -> Vec<PodInfo> {
    let created = |p: &Pod| p.metadata.creation_timestamp.as_ref().map(|t| t.0);
    let observed: Vec<(PodInfo, bool, &Pod)> =
        list.into_iter().filter_map(|p| observed_pod(p).map(|(info, deleting)| (info, deleting, p))).collect();
    let live: HashSet<IpAddr> = observed
        .iter()
        .filter(|(_, deleting, _)| !deleting)
        .flat_map(|(info, _, _)| info.ips.iter().copied())
        .collect();
    // Among pods being deleted, the latest creation time per address.
    let mut newest = HashMap::new();
    for (info, _, p) in observed.iter().filter(|(_, deleting, _)| *deleting) {
        for ip in &info.ips {
            let c = created(p);
            newest.entry(*ip).and_modify(|n| *n = std::cmp::max(*n, c)).or_insert(c);
        }
    }
    observed
        .into_iter()
        .filter_map(|(mut info, deleting, p)| {
            if deleting {
                info.ips.retain(|ip| !live.contains(ip) && newest.get(ip) == Some(&created(p)));
            }
            (!info.ips.is_empty()).then_some(info)
        })
        .collect()
}

/// The identity of the pod each address belongs to, by the same rule as
/// [`pods`] (an address reused by a new pod is the new pod's), for the
/// translation logs (translog/identity.rs).
pub fn pod_identities<'a>(list: impl IntoIterator<Item = &'a Pod> + Clone) -> crate::translog::identity::IdentityMap {
    let uids: HashMap<(String, String), String> = list
        .clone()
        .into_iter()
        .map(|p| ((p.namespace().unwrap_or_default(), p.name_any()), p.metadata.uid.clone().unwrap_or_default()))
        .collect();
    let mut out = HashMap::new();
    for info in pods(list) {
        let uid = uids.get(&(info.namespace.clone(), info.name.clone())).cloned().unwrap_or_default();
        let id = std::sync::Arc::new(crate::translog::identity::PodIdentity {
            namespace: info.namespace,
            name: info.name,
            uid,
        });
        for ip in info.ips {
            out.insert(ip, id.clone());
        }
    }
    out
}

/// A Service annotated `egret.dev/egress: "true"` (others: None).
pub fn service(s: &Service) -> Option<ServiceInfo> {
    if s.annotations().get(SERVICE_EGRESS_ANNOTATION).map(String::as_str) != Some("true") {
        return None;
    }
    let spec = s.spec.as_ref();
    let ingress_ips = s
        .status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|ing| ing.iter().filter_map(|i| i.ip.as_deref()).filter_map(|ip| ip.parse().ok()).collect())
        .unwrap_or_default();
    Some(ServiceInfo {
        namespace: s.namespace().unwrap_or_default(),
        name: s.name_any(),
        created: s.metadata.creation_timestamp.as_ref().map(|t| t.0),
        load_balancer: spec.and_then(|sp| sp.type_.as_deref()) == Some("LoadBalancer"),
        selector: spec.and_then(|sp| sp.selector.clone()).unwrap_or_default(),
        ports: spec
            .and_then(|sp| sp.ports.as_ref())
            .map(|ports| {
                ports
                    .iter()
                    .filter_map(|p| {
                        Some(ServicePortInfo {
                            port: u16::try_from(p.port).ok()?,
                            protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default(),
        ingress_ips,
        external_traffic_local: spec.and_then(|sp| sp.external_traffic_policy.as_deref()) == Some("Local"),
    })
}

/// A namespace's labels.
pub fn namespace(n: &Namespace) -> (String, BTreeMap<String, String>) {
    (n.name_any(), n.labels().clone())
}

/// A gateway Node.
pub fn node(n: &Node) -> NodeInfo {
    NodeInfo {
        name: n.name_any(),
        labels: n.labels().clone(),
        internal_ips: internal_ips(n),
        provider_id: n.spec.as_ref().and_then(|s| s.provider_id.clone()),
    }
}

/// Any Node, from its metadata (no addresses).
pub fn node_meta(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> NodeInfo {
    NodeInfo {
        name: m.name.clone().unwrap_or_default(),
        labels: m.labels.clone().unwrap_or_default(),
        internal_ips: vec![],
        provider_id: None,
    }
}

/// A Node's `status.addresses` of type InternalIP that parse.
pub fn internal_ips(n: &Node) -> Vec<IpAddr> {
    let addresses = n.status.as_ref().and_then(|s| s.addresses.as_ref());
    addresses.into_iter().flatten().filter(|a| a.type_ == "InternalIP").filter_map(|a| a.address.parse().ok()).collect()
}

/// What the gateways keep of every Node (`controller::watch_nodes`): its
/// name, labels, InternalIPs and `spec.providerID` (`PerNode` cloud pools).
/// A Node's images, conditions and the rest of its status run to
/// kilobytes; a large cluster's would be held whole.
pub fn trim_node(n: &mut Node) {
    let m = &mut n.metadata;
    m.managed_fields = None;
    m.annotations = None;
    m.owner_references = None;
    let provider_id = n.spec.take().and_then(|s| s.provider_id);
    n.spec = provider_id.map(|p| k8s_openapi::api::core::v1::NodeSpec { provider_id: Some(p), ..Default::default() });
    if let Some(s) = n.status.as_mut() {
        let addresses = s.addresses.take().map(|a| a.into_iter().filter(|a| a.type_ == "InternalIP").collect());
        *s = k8s_openapi::api::core::v1::NodeStatus { addresses, ..Default::default() };
    }
}

/// An `EgressPolicy`.
pub fn policy(p: &EgressPolicy) -> PolicyInfo {
    PolicyInfo {
        name: p.name_any(),
        created: p.metadata.creation_timestamp.as_ref().map(|t| t.0),
        generation: p.metadata.generation,
        spec: p.spec.clone(),
        status: p.status.clone(),
    }
}

/// An `EgressIPPool`.
pub fn ip_pool(p: &EgressIPPool) -> PoolInfo {
    PoolInfo { name: p.name_any(), generation: p.metadata.generation, spec: p.spec.clone(), status: p.status.clone() }
}

/// A gateway Node annotated `egret.dev/drain: "true"` hands its egress IPs
/// to the next candidates (after its standbys hold their session copies)
/// and takes none (`egret drain`).
pub const DRAIN_ANNOTATION: &str = "egret.dev/drain";

/// Whether a gateway Node is being drained.
pub fn draining(n: &k8s_openapi::api::core::v1::Node) -> bool {
    n.annotations().get(DRAIN_ANNOTATION).is_some_and(|v| v == "true")
}

/// The annotation overriding a gateway Node's channel address.
pub const HA_ADDRESS_ANNOTATION: &str = "egret.dev/ha-address";

/// A gateway Node's address on the node network for the peer channel: the
/// annotation [`HA_ADDRESS_ANNOTATION`] if set, else its first `InternalIP`.
pub fn ha_address(n: &k8s_openapi::api::core::v1::Node) -> Option<IpAddr> {
    if let Some(a) = n.annotations().get(HA_ADDRESS_ANNOTATION) {
        return a.trim().parse().ok();
    }
    n.status
        .as_ref()?
        .addresses
        .as_ref()?
        .iter()
        .filter(|a| a.type_ == "InternalIP")
        .find_map(|a| a.address.parse().ok())
}

/// The egress IP a Lease covers (from its annotation).
pub fn lease_ip(l: &Lease) -> Option<IpAddr> {
    l.annotations().get(LEASE_IP_ANNOTATION).and_then(|s| s.parse().ok())
}

/// The Lease as the state machine sees it.
pub fn lease_record(l: &Lease) -> LeaseRecord {
    let spec = l.spec.as_ref();
    LeaseRecord {
        holder: spec.and_then(|s| s.holder_identity.clone()),
        duration: Duration::from_secs(
            spec.and_then(|s| s.lease_duration_seconds).and_then(|d| u64::try_from(d).ok()).unwrap_or(0),
        ),
        resource_version: l.resource_version().unwrap_or_default(),
        transitions: spec.and_then(|s| s.lease_transitions).unwrap_or(0),
        acquire_time: spec.and_then(|s| s.acquire_time.as_ref()).map(|t| t.0),
        renew_time: spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0),
        incarnation: l.annotations().get(crate::k8s::lease::INCARNATION_ANNOTATION).and_then(|v| v.parse().ok()),
        standby: l.annotations().get(crate::k8s::lease::STANDBY_ANNOTATION).filter(|v| !v.is_empty()).cloned(),
        epoch: l.annotations().get(crate::k8s::liveness::EPOCH_ANNOTATION).and_then(|v| v.parse().ok()),
        failsafe: l
            .annotations()
            .get(crate::k8s::lease::FAILSAFE_ANNOTATION)
            .map(|v| v.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_string).collect()),
        owners: l.metadata.owner_references.iter().flatten().map(Into::into).collect(),
    }
}

/// The gateway a liveness Lease belongs to (None: not a liveness Lease).
pub fn liveness_gateway(l: &Lease) -> Option<String> {
    l.annotations().get(crate::k8s::liveness::GATEWAY_ANNOTATION).filter(|n| !n.is_empty()).cloned()
}

/// The Lease as the status computation sees it. A record written under an
/// epoch is never renewed: its holder's liveness Lease (`liveness`, per
/// gateway) says when it was last renewed, and a liveness Lease of another
/// epoch or nobody's says it is not held.
pub fn lease_info(r: &LeaseRecord, liveness: &BTreeMap<String, LeaseRecord>) -> LeaseInfo {
    let (renew_time, duration) = match (r.epoch, r.holder.as_deref()) {
        (Some(e), Some(h)) => match liveness.get(h) {
            Some(l) if l.holder.as_deref() == Some(h) && l.epoch == Some(e) => (l.renew_time, l.duration),
            _ => (None, r.duration),
        },
        _ => (r.renew_time, r.duration),
    };
    LeaseInfo { holder: r.holder.clone(), acquire_time: r.acquire_time, renew_time, duration }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    #[test]
    fn only_running_pod_network_pods_with_ips_count() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "a", "namespace": "team", "labels": {"app": "x"}},
            "status": {"phase": "Running", "podIP": "198.18.0.5", "podIPs": [{"ip": "198.18.0.5"}, {"ip": "2001:db8::5"}]}
        }))
        .unwrap();
        let info = pod(&p).unwrap();
        assert_eq!(info.ips, vec!["198.18.0.5".parse::<IpAddr>().unwrap(), "2001:db8::5".parse().unwrap()]);
        assert_eq!(info.labels.get("app").map(String::as_str), Some("x"));
        let host: Pod = serde_json::from_value(json!({
            "metadata": {"name": "h", "namespace": "team"},
            "spec": {"hostNetwork": true, "containers": []},
            "status": {"podIP": "192.0.2.10"}
        }))
        .unwrap();
        assert_eq!(pod(&host), None);
        let done: Pod = serde_json::from_value(json!({
            "metadata": {"name": "d", "namespace": "team"},
            "status": {"phase": "Succeeded", "podIP": "198.18.0.6"}
        }))
        .unwrap();
        assert_eq!(pod(&done), None);
        let pending: Pod = serde_json::from_value(
            json!({"metadata": {"name": "p", "namespace": "team"}, "status": {"phase": "Pending"}}),
        )
        .unwrap();
        assert_eq!(pod(&pending), None);
    }

    fn pod_json(name: &str, created: &str, deleting: bool, phase: &str, ips: &[&str]) -> Pod {
        let mut meta = json!({"name": name, "namespace": "team", "creationTimestamp": created});
        if deleting {
            meta["deletionTimestamp"] = json!("2026-11-24T12:00:00Z");
        }
        let ips: Vec<_> = ips.iter().map(|ip| json!({"ip": ip})).collect();
        let mut status = json!({"phase": phase, "podIPs": ips});
        if let Some(first) = ips.first() {
            status["podIP"] = first["ip"].clone();
        }
        serde_json::from_value(json!({"metadata": meta, "status": status})).unwrap()
    }

    /// Identities follow the same rule: a reused address names the new
    /// pod, with its own UID.
    #[test]
    fn pod_identities_name_the_pod_holding_each_address() {
        let mut old = pod_json("old", "2026-11-24T10:00:00Z", true, "Running", &["198.18.0.5", "fd00::5"]);
        old.metadata.uid = Some("uid-old".into());
        let mut new = pod_json("new", "2026-11-24T11:00:00Z", false, "Pending", &["198.18.0.5"]);
        new.metadata.uid = Some("uid-new".into());
        let ids = pod_identities([&old, &new]);
        let at = |ip: &str| ids.get(&ip.parse::<IpAddr>().unwrap()).map(|i| (i.name.as_str(), i.uid.as_str()));
        assert_eq!(at("198.18.0.5"), Some(("new", "uid-new")));
        assert_eq!(at("fd00::5"), Some(("old", "uid-old")));
        assert_eq!(ids[&"fd00::5".parse::<IpAddr>().unwrap()].namespace, "team");
        assert_eq!(at("198.18.0.6"), None);
    }

    /// A pod being deleted stays selected until it is gone, reaches a
    /// terminal phase, or its address goes to another pod (issue 14, item 2).
    #[test]
    fn terminating_pods_stay_selected_until_gone_or_reused() {
        const T1: &str = "2026-11-24T10:00:00Z";
        const T2: &str = "2026-11-24T11:00:00Z";
        #[allow(clippy::type_complexity)]
        let cases: &[(&str, Vec<Pod>, &[(&str, &[&str])])] = &[
            (
                "a pod draining (deletionTimestamp, still Running) stays selected",
                vec![pod_json("old", T1, true, "Running", &["198.18.0.5"])],
                &[("old", &["198.18.0.5"])],
            ),
            (
                "its address given to a new pod (Pending with an IP): the new pod's",
                vec![
                    pod_json("old", T1, true, "Running", &["198.18.0.5"]),
                    pod_json("new", T2, false, "Pending", &["198.18.0.5"]),
                ],
                &[("new", &["198.18.0.5"])],
            ),
            (
                "the new pod first in the list: the same",
                vec![
                    pod_json("new", T2, false, "Running", &["198.18.0.5"]),
                    pod_json("old", T1, true, "Running", &["198.18.0.5"]),
                ],
                &[("new", &["198.18.0.5"])],
            ),
            (
                "dual stack, only the IPv4 address reused: the old pod keeps its IPv6 address",
                vec![
                    pod_json("old", T1, true, "Running", &["198.18.0.5", "2001:db8::5"]),
                    pod_json("new", T2, false, "Running", &["198.18.0.5"]),
                ],
                &[("old", &["2001:db8::5"]), ("new", &["198.18.0.5"])],
            ),
            (
                "two pods being deleted on one address: the one created last",
                vec![
                    pod_json("older", T1, true, "Running", &["198.18.0.5"]),
                    pod_json("newer", T2, true, "Running", &["198.18.0.5"]),
                ],
                &[("newer", &["198.18.0.5"])],
            ),
            (
                "a pod being deleted whose containers ended (Succeeded) is left out",
                vec![pod_json("done", T1, true, "Succeeded", &["198.18.0.5"])],
                &[],
            ),
            (
                "Failed (e.g. evicted): left out, its address free for a new pod",
                vec![
                    pod_json("evicted", T1, false, "Failed", &["198.18.0.5"]),
                    pod_json("new", T2, false, "Running", &["198.18.0.5"]),
                ],
                &[("new", &["198.18.0.5"])],
            ),
            (
                "a deleted pod (gone from the API) is gone",
                vec![pod_json("other", T1, false, "Running", &["198.18.0.6"])],
                &[("other", &["198.18.0.6"])],
            ),
        ];
        for (what, list, want) in cases {
            let got: Vec<(String, Vec<IpAddr>)> = pods(list.iter()).into_iter().map(|p| (p.name, p.ips)).collect();
            let want: Vec<(String, Vec<IpAddr>)> =
                want.iter().map(|(n, ips)| (n.to_string(), ips.iter().map(|i| i.parse().unwrap()).collect())).collect();
            assert_eq!(got, want, "{what}");
        }
        // One pod at a time: a draining pod is selectable.
        assert!(pod(&pod_json("old", T1, true, "Running", &["198.18.0.5"])).is_some());
    }

    #[test]
    fn annotated_services_only() {
        let s: Service = serde_json::from_value(json!({
            "metadata": {"name": "web", "namespace": "team", "annotations": {"egret.dev/egress": "true"}},
            "spec": {"type": "LoadBalancer", "selector": {"app": "web"}, "ports": [{"port": 443, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}]},
            "status": {"loadBalancer": {"ingress": [{"ip": "198.51.100.20"}, {"hostname": "lb.example"}]}}
        }))
        .unwrap();
        let info = service(&s).unwrap();
        assert!(info.load_balancer);
        assert_eq!(info.ingress_ips, vec!["198.51.100.20".parse::<IpAddr>().unwrap()]);
        assert_eq!(
            info.ports,
            vec![
                ServicePortInfo { port: 443, protocol: "TCP".into() },
                ServicePortInfo { port: 53, protocol: "UDP".into() }
            ]
        );
        let plain: Service = serde_json::from_value(json!({"metadata": {"name": "x", "namespace": "team"}})).unwrap();
        assert_eq!(service(&plain), None);
    }
}
