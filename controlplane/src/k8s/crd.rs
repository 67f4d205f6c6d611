//! Egret's Kubernetes API: the `EgressPolicy` and `EgressIPPool` custom
//! resources (group `egret.dev`, version `v1alpha1`, both cluster-scoped),
//! and the annotation that turns a LoadBalancer Service's VIP into its pods'
//! egress IP.
//!
//! The CRDs in `deploy/crds/` are generated from these types by
//! `egret-crdgen` (never edited by hand); a test checks they match.
//!
//! Status is written by the gateways (see `controller.rs`): conditions
//! `Ready`, `IPAssigned` and `GatewayAssigned` with reasons from
//! [`reason`], per egress IP the gateway that holds it and since when (from
//! its Lease), and the number of selected pods. Condition types and reasons
//! follow the API conventions: CamelCase reasons, messages a person can act on.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The API group of Egret's resources.
pub const GROUP: &str = "egret.dev";
/// The API version of Egret's resources.
pub const VERSION: &str = "v1alpha1";
/// The annotation that makes a LoadBalancer Service's ingress IP the egress
/// IP of the pods its selector matches (value `"true"`).
pub const SERVICE_EGRESS_ANNOTATION: &str = "egret.dev/egress";
/// Label on gateway Nodes (default gateway node selector `egret.dev/gateway=true`).
pub const GATEWAY_LABEL: &str = "egret.dev/gateway";
/// Label on the Leases Egret manages (value [`LEASE_LABEL_VALUE`]).
pub const LEASE_LABEL: &str = "egret.dev/lease";
/// Value of [`LEASE_LABEL`] on egress-IP Leases.
pub const LEASE_LABEL_VALUE: &str = "egress-ip";
/// Annotation on a Lease naming the egress IP it covers.
pub const LEASE_IP_ANNOTATION: &str = "egret.dev/egress-ip";
/// Annotation on a Lease naming the companion next hop that moves with it.
pub const LEASE_NEXT_HOP_ANNOTATION: &str = "egret.dev/next-hop";

/// Condition types.
pub mod condition {
    /// The policy is enforced: valid, every egress IP assigned and held by a gateway.
    pub const READY: &str = "Ready";
    /// Every egress IP the policy asks for is valid and its own.
    pub const IP_ASSIGNED: &str = "IPAssigned";
    /// Every egress IP is held by a gateway (a valid Lease); `PerNode`
    /// policies: True with reason `PerNode` (no gateway is involved).
    pub const GATEWAY_ASSIGNED: &str = "GatewayAssigned";
    /// Cloud pools: the pairing matches what the provider has (tagged public
    /// addresses, each with a private address).
    pub const CLOUD_SYNCED: &str = "CloudSynced";
}

/// Condition reasons (CamelCase, as the API conventions ask).
pub mod reason {
    /// Ready: the policy is in the gateways' tables.
    pub const ENFORCED: &str = "Enforced";
    /// A selector, CIDR or address in the spec does not parse.
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// IPAssigned: every IP is assigned.
    pub const ASSIGNED: &str = "Assigned";
    /// An egress IP is already used by an older object.
    pub const IP_CONFLICT: &str = "IPConflict";
    /// Neither `egressIPs` nor `pool` (or both) is set.
    pub const NO_EGRESS_IP: &str = "NoEgressIP";
    /// The named pool does not exist.
    pub const POOL_NOT_FOUND: &str = "PoolNotFound";
    /// The named pool exists but cannot be used (invalid, or cloud pools).
    pub const POOL_NOT_USABLE: &str = "PoolNotUsable";
    /// The pool has fewer free addresses than the policy asks for.
    pub const POOL_EXHAUSTED: &str = "PoolExhausted";
    /// Addresses were allocated and are being recorded in the pool's status.
    pub const ALLOCATION_PENDING: &str = "AllocationPending";
    /// GatewayAssigned: every IP is held.
    pub const HELD: &str = "Held";
    /// No gateway Node matches the selectors.
    pub const NO_ELIGIBLE_GATEWAY: &str = "NoEligibleGateway";
    /// Eligible gateways exist but none holds the IP's Lease yet.
    pub const AWAITING_LEASE: &str = "AwaitingLease";
    /// Pool Ready: its addresses parse.
    pub const VALID: &str = "Valid";
    /// Pool: an address entry does not parse.
    pub const INVALID_ADDRESS: &str = "InvalidAddress";
    /// Pool: the `cloud` section names no provider this gateway supports.
    pub const CLOUD_NOT_SUPPORTED: &str = "CloudNotSupported";
    /// Cloud pool: the provider has not been asked yet (or not answered).
    pub const CLOUD_DISCOVERING: &str = "CloudDiscovering";
    /// Cloud pool: the provider's API failed (the message names the call).
    pub const CLOUD_API_ERROR: &str = "CloudAPIError";
    /// Cloud pool: no public address carries the pool's tags.
    pub const NO_CLOUD_ADDRESSES: &str = "NoCloudAddresses";
    /// Cloud pool: a public address found no free private address to pair with.
    pub const NO_PRIVATE_ADDRESS: &str = "NoPrivateAddress";
    /// Service: the annotated Service has no `status.loadBalancer.ingress` IP yet.
    pub const NO_INGRESS_IP: &str = "NoIngressIP";
    /// Service: a Service port lies in the NAT port range.
    pub const SERVICE_PORT_IN_NAT_RANGE: &str = "ServicePortInNatRange";
    /// Service: not of type LoadBalancer.
    pub const NOT_LOAD_BALANCER: &str = "NotLoadBalancer";
    /// Service: `externalTrafficPolicy: Local` (the gateway holding the VIP
    /// runs no endpoint, so its inbound traffic is dropped there).
    pub const EXTERNAL_TRAFFIC_POLICY_LOCAL: &str = "ExternalTrafficPolicyLocal";
    /// Event: a gateway took an egress IP nobody held.
    pub const EGRESS_IP_ASSIGNED: &str = "EgressIPAssigned";
    /// Event: a gateway took an egress IP another gateway held.
    pub const EGRESS_IP_FAILOVER: &str = "EgressIPFailover";
    /// Event: the cloud provider refused a gateway an egress IP for good (its
    /// private address is on an interface that is not a gateway's, the call
    /// is not allowed, the interface is full...): the gateway stops
    /// competing for it, and it is translated to by no gateway that cannot
    /// get it.
    pub const CLOUD_ADDRESS_REFUSED: &str = "CloudAddressRefused";
    /// GatewayAssigned of a `PerNode` policy: each Node SNATs its own pods.
    pub const PER_NODE: &str = "PerNode";
}

/// Why a condition is not True: its CamelCase reason (one of [`reason`])
/// and a message naming the field and the value to fix (empty for a reason
/// that says it all, such as `NotLoadBalancer`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct Cause {
    /// The condition's reason.
    pub reason: &'static str,
    /// The condition's message.
    pub message: String,
}

impl Cause {
    /// `reason` with `message`.
    pub fn new(reason: &'static str, message: impl Into<String>) -> Cause {
        Cause { reason, message: message.into() }
    }
}

/// An egress IP named in a policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressIPSpec {
    /// The address the selected pods' traffic leaves with.
    pub ip: String,
    /// A companion next hop on the worker nodes' link, for an egress IP that
    /// is not on that link (a public IP on another subnet). The gateway that
    /// holds the egress IP also answers ARP/NDP for this address; nodes route
    /// the selected pods via it. Omit when the egress IP is on the nodes'
    /// link: it is then its own next hop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_hop: Option<String>,
}

/// Port blocks (ADR 0034 §6): each selected pod's sessions on an egress
/// IP take ports from blocks of its own, and the translation logs record
/// each block once instead of each session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PortBlocksSpec {
    /// Ports per block: a power of two, at least 8, with one block aligned
    /// to its size inside the NAT port range (default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 8, max = 32768))]
    pub size: Option<u32>,
    /// Blocks one pod may hold on one egress IP (default 8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 32))]
    pub max_per_pod: Option<u32>,
    /// Log each session too, not only the blocks (default false).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_sessions: Option<bool>,
}

/// Egress IPs allocated from a pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolRef {
    /// The `EgressIPPool`'s name.
    pub name: String,
    /// How many addresses to allocate (default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub count: Option<u32>,
}

/// Which pods leave with which egress IPs, for which destinations, through
/// which gateways.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "egret.dev",
    version = "v1alpha1",
    kind = "EgressPolicy",
    plural = "egresspolicies",
    shortname = "egp",
    category = "egret",
    status = "EgressPolicyStatus",
    doc = "Gives the pods it selects a fixed egress IP: their traffic to `destinations` leaves through the gateway that holds the IP.",
    printcolumn = r#"{"name":"Egress IPs","type":"string","jsonPath":".status.egressIPList","description":"The policy's egress IPs"}"#,
    printcolumn = r#"{"name":"Gateways","type":"string","jsonPath":".status.gatewayList","description":"The gateway holding each egress IP, in the same order"}"#,
    printcolumn = r#"{"name":"Pods","type":"integer","jsonPath":".status.selectedPods","description":"Selected pods"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct EgressPolicySpec {
    /// Pods to select (within the namespaces `namespaceSelector` selects).
    /// Absent or empty: every pod of those namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// Namespaces whose pods may be selected. Absent or empty: all namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Destination CIDRs the policy applies to (`0.0.0.0/0` for everything IPv4).
    pub destinations: Vec<String>,
    /// Destination CIDRs excluded from `destinations` (longest prefix wins).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub except: Vec<String>,
    /// Explicit egress IPs. Set this or `pool`, not both. Each selected pod
    /// keeps one of them (paired pooling by rendezvous hashing).
    #[serde(default, rename = "egressIPs", skip_serializing_if = "Vec::is_empty")]
    pub egress_ips: Vec<EgressIPSpec>,
    /// Egress IPs allocated from an `EgressIPPool`. Set this or `egressIPs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolRef>,
    /// Gateway Nodes that may carry this policy's egress IPs (among the Nodes
    /// labelled as gateways). Absent or empty: every gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_selector: Option<LabelSelector>,
    /// `Gateway` (default): the selected pods leave through the gateway
    /// holding an egress IP. `PerNode`: each Node `nodeSelector` selects gets
    /// one address from `pool` (recorded in the pool's status), which its
    /// `egret node` adds to the Node and SNATs that Node's selected pods to;
    /// no gateway is involved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<PolicyMode>,
    /// `PerNode`: the Nodes that get an address. Absent or empty: every Node
    /// that is not a gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<LabelSelector>,
    /// Port blocks on this policy's egress IPs (ADR 0034 §6). Absent: the
    /// pool's `portBlocks`, else the gateway's `nat.portBlocks`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_blocks: Option<PortBlocksSpec>,
}

/// How a policy's pods leave.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PolicyMode {
    /// Through the gateways (egress IPs with Leases).
    #[default]
    Gateway,
    /// With an address of their own Node, SNATed by the Node.
    PerNode,
}

/// Where one egress IP is.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressIPStatus {
    /// The egress IP.
    pub ip: String,
    /// Its companion next hop, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_hop: Option<String>,
    /// The gateway Node that holds it (its Lease's holder), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    /// Since when that gateway holds it (the Lease's acquireTime).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<Time>,
    /// `PerNode` policies: the Node this address belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// A cloud pool's address: the public address (Elastic IP) that the
    /// far end sees for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_ip: Option<String>,
}

/// What the gateways report about an `EgressPolicy`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressPolicyStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `IPAssigned`, `GatewayAssigned`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Each egress IP, its gateway and since when.
    #[serde(default, rename = "egressIPs")]
    pub egress_ips: Vec<EgressIPStatus>,
    /// The egress IPs, comma-separated (for `kubectl get`).
    #[serde(default, rename = "egressIPList", skip_serializing_if = "String::is_empty")]
    pub egress_ip_list: String,
    /// The gateways holding them, comma-separated, `-` for none (for `kubectl get`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub gateway_list: String,
    /// How many running pods the selectors match (pods with an IP, not hostNetwork).
    #[serde(default)]
    pub selected_pods: i32,
}

/// Public addresses from a cloud provider (docs/kubernetes.md, "Running on
/// AWS"). Exactly one provider is set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolCloudSpec {
    /// AWS: Elastic IPs found by tag, each paired with a secondary private
    /// address of the gateways' subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aws: Option<AwsPoolSpec>,
    /// Azure: public IP addresses found by tag, each paired with a private
    /// address of the gateways' subnet (a secondary IP configuration on the
    /// holder's NIC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub azure: Option<AzurePoolSpec>,
    /// GCP: static external addresses found by label, delivered to the
    /// holder by protocol forwarding (the egress IP is the external address
    /// itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gcp: Option<GcpPoolSpec>,
}

/// An Azure pool: the public IP addresses carrying all of `tags`, paired
/// with private addresses of `subnetId` (restricted to the pool's
/// `addresses` when set).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AzurePoolSpec {
    /// Tags a public IP address must carry, all of them.
    pub tags: std::collections::BTreeMap<String, String>,
    /// The ARM id of the gateways' subnet
    /// (`/subscriptions/S/resourceGroups/RG/providers/Microsoft.Network/virtualNetworks/V/subnets/N`).
    pub subnet_id: String,
}

/// A GCP pool: the regional static external addresses carrying all of
/// `labels`, in the region of `subnetwork`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GcpPoolSpec {
    /// Labels an address must carry, all of them.
    pub labels: std::collections::BTreeMap<String, String>,
    /// The gateways' subnetwork (`projects/P/regions/R/subnetworks/S`).
    pub subnetwork: String,
}

/// An AWS pool: the Elastic IPs carrying all of `tags`, paired with private
/// addresses of `subnetId` (restricted to the pool's `addresses` when set).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AwsPoolSpec {
    /// Tags an Elastic IP must carry, all of them (e.g. `egret.dev/pool: prod`).
    pub tags: std::collections::BTreeMap<String, String>,
    /// The subnet of the gateways' network interfaces (`subnet-...`); the
    /// private addresses are taken from it.
    pub subnet_id: String,
}

/// One public address of a cloud pool and the private address that stands
/// for it (the egress IP in the tables, the Lease's name).
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CloudAddressStatus {
    /// The public address (the Elastic IP).
    pub public_ip: String,
    /// The provider's handle (`eipalloc-...`).
    pub allocation_id: String,
    /// The private address paired with it.
    pub private_ip: String,
}

/// Addresses policies can take egress IPs from.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "egret.dev",
    version = "v1alpha1",
    kind = "EgressIPPool",
    plural = "egressippools",
    shortname = "eipp",
    category = "egret",
    status = "EgressIPPoolStatus",
    doc = "Addresses that EgressPolicies naming this pool get their egress IPs from.",
    printcolumn = r#"{"name":"Size","type":"integer","jsonPath":".status.size"}"#,
    printcolumn = r#"{"name":"Allocated","type":"integer","jsonPath":".status.allocated"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct EgressIPPoolSpec {
    /// With `cloud`: the private addresses of the subnet the public ones may
    /// be paired with (absent: the whole subnet). Otherwise the pool itself:
    /// CIDRs (`198.51.100.0/28`), ranges (`198.51.100.10-198.51.100.20`) or
    /// single addresses. In a CIDR of IPv4 /30 or wider the network and
    /// broadcast addresses are skipped; in an IPv6 CIDR wider than /127 the
    /// subnet-router anycast address is.
    #[serde(default)]
    pub addresses: Vec<String>,
    /// Companion next hops, paired by position with `addresses` (the n-th
    /// allocatable address gets the n-th next hop). Leave empty when the
    /// addresses are on the worker nodes' link.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub next_hops: Vec<String>,
    /// Gateway Nodes that may carry this pool's addresses (ANDed with each
    /// policy's own `gatewaySelector`). Absent or empty: every gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_selector: Option<LabelSelector>,
    /// Public addresses from a cloud provider instead of `addresses`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cloud: Option<PoolCloudSpec>,
    /// Port blocks on the addresses policies get from this pool (ADR 0034
    /// §6), unless a policy sets its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port_blocks: Option<PortBlocksSpec>,
}

/// Addresses allocated to one policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolAllocation {
    /// The `EgressPolicy` name.
    pub policy: String,
    /// Its addresses, ascending.
    pub ips: Vec<String>,
    /// `PerNode` policies: the Node the address is for (one allocation per Node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// `PerNode` policies on a cloud pool, once the provider has associated
    /// the public address (`ips`) with the Node: the private address on the
    /// Node's interface it stands for, which the Node's pods are translated
    /// to (GCP: the public address itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_ip: Option<String>,
    /// With `privateIp`: the Node's interface that holds it (AWS: `eni-...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface_id: Option<String>,
}

/// What the gateways report about an `EgressIPPool`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EgressIPPoolStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Allocations by policy name (the record all gateways share).
    #[serde(default)]
    pub allocations: Vec<PoolAllocation>,
    /// Allocatable addresses (saturates at 2^31-1).
    #[serde(default)]
    pub size: i64,
    /// Allocated addresses.
    #[serde(default)]
    pub allocated: i64,
    /// Cloud pools: each public address and its private address, by public
    /// address (the pairing every gateway and node agent uses).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cloud_addresses: Vec<CloudAddressStatus>,
}

/// File name and YAML of every CRD, as `egret-crdgen` writes them into
/// `deploy/crds/` and `deploy/helm/egret/crds/`.
pub fn crd_files() -> Result<Vec<(String, String)>, serde_saphyr::SerializeError> {
    use kube::CustomResourceExt;
    let crds = [EgressPolicy::crd(), EgressIPPool::crd()];
    crds.iter()
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            // Long descriptions stay on one line (no folded `>` scalars):
            // the files keep the layout serde_yaml gave them.
            let body = serde_saphyr::to_string_with_options(
                crd,
                serde_saphyr::ser_options! { folded_wrap_chars: usize::MAX },
            )?;
            Ok((
                format!("{name}.yaml"),
                format!("# Generated by egret-crdgen from controlplane/src/k8s/crd.rs; do not edit.\n---\n{body}"),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn crds_are_cluster_scoped_with_status_and_columns() {
        let crd = EgressPolicy::crd();
        assert_eq!(crd.metadata.name.as_deref(), Some("egresspolicies.egret.dev"));
        assert_eq!(crd.spec.scope, "Cluster");
        let v = &crd.spec.versions[0];
        assert_eq!(v.name, VERSION);
        assert!(v.subresources.as_ref().unwrap().status.is_some());
        let cols: Vec<&str> = v.additional_printer_columns.as_ref().unwrap().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(cols, vec!["Egress IPs", "Gateways", "Pods", "Ready", "Reason", "Age"]);
        assert_eq!(EgressIPPool::crd().spec.scope, "Cluster");
        let json = serde_json::to_string(&crd).unwrap();
        assert!(json.contains("\"egressIPs\""), "field names follow the API conventions");
    }

    /// `deploy/` must hold exactly what the generator writes: run
    /// `cargo run -p egret-controlplane --bin egret-crdgen -- deploy` after
    /// changing the types.
    #[test]
    fn deployed_crds_match_the_types() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("deploy");
        for (file, body) in crd_files().unwrap() {
            for dir in ["crds", "helm/egret/crds"] {
                let path = root.join(dir).join(&file);
                let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
                assert!(
                    on_disk == body,
                    "{} is stale: run `cargo run -p egret-controlplane --bin egret-crdgen -- deploy`",
                    path.display()
                );
            }
        }
    }

    /// The YAML the generator writes reads back as the CRDs it was written
    /// from, value for value (as JSON, what the API server stores).
    #[test]
    fn the_crd_files_read_back_as_the_crds() {
        let crds = [EgressPolicy::crd(), EgressIPPool::crd()];
        let files = crd_files().unwrap();
        assert_eq!(files.len(), crds.len());
        for (crd, (file, body)) in crds.iter().zip(&files) {
            let read: serde_json::Value = serde_saphyr::from_str(body).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(read, serde_json::to_value(crd).unwrap(), "{file}");
            let typed: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition =
                serde_json::from_value(read).unwrap();
            assert_eq!(&typed, crd, "{file}");
        }
    }
}
