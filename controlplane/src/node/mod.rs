//! `egret node`: the worker-node agent that sends selected pods' traffic to
//! the gateway holding their egress IP (docs/kubernetes.md, "Worker nodes").
//!
//! | file | owns |
//! |---|---|
//! | `plan.rs` | the pure function: gateways' compiled tables + this node's pods -> each pod's route set |
//! | `reconcile.rs` | the pure function: kernel state + plan -> ordered rule/route operations |
//! | `kernel/` | rtnetlink: reading and changing Egret's rules and tables; `device.rs` the tunnel device |
//! | `nft.rs` | the `inet egret_node` table: the masquerade bypass and strict mode |
//! | `tunnel.rs` | the pure function: the node's route to a next hop -> its path (on-link, VXLAN (RFC 7348) through `egret-vxlan`, none) |
//! | `status.rs` | `egret node status`, the status file, `/metrics` |
//! | `agent.rs` | watchers and the reconcile loop: [`run`] |
//!
//! The agent reads (Pods on its Node, Namespaces, annotated Services,
//! EgressPolicies, EgressIPPools' recorded allocations) and computes, with
//! the gateways' own [`crate::k8s::desired::desired`] and the dataplane's
//! classifier, each local pod's egress IP and next hop; it writes nothing to
//! the API server. It programs the node's kernel and nothing else, and
//! nothing is reprogrammed on failover: the next hop (the egress IP, or its
//! companion next hop) moves with the IP's Lease.

pub mod agent;
pub mod health;
pub mod kernel;
pub mod nft;
pub mod plan;
pub mod reconcile;
pub mod repair;
pub mod status;
pub mod tunnel;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use egret_dataplane::nat::port_alloc::PortRange;
use ipnet::IpNet;

pub use agent::run;
use reconcile::TableRange;

/// The agent's settings (`egret node --help`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeOptions {
    /// This Node's name (`--node-name`, default `$NODE_NAME`).
    pub node_name: String,
    /// A kubeconfig; default in-cluster, then `$KUBECONFIG`.
    pub kubeconfig: Option<PathBuf>,
    /// The agent's own Pod (`--pod-name`, `--pod-namespace`): its DaemonSet
    /// tells an uninstall from a restart ([`crate::k8s::uninstall`]).
    pub pod: Option<crate::k8s::uninstall::PodIdentity>,
    /// The cluster's pod and Service CIDRs: never steered.
    pub cluster_cidrs: Vec<IpNet>,
    /// Strict mode: drop a local pod's traffic to outside the cluster until
    /// the agent has classified it.
    pub strict: bool,
    /// Strict mode's sources: this node's pod CIDRs (default: the Node's
    /// `spec.podCIDRs`, or the cluster CIDRs when the Node has none).
    pub pod_cidrs: Vec<IpNet>,
    /// The rules' priority.
    pub rule_priority: u32,
    /// The packet-mark bit of connections a steered pod originated: the
    /// rules match only it (`--steer-mark`, [`DEFAULT_STEER_MARK`]).
    pub steer_mark: u32,
    /// The tables the agent may use.
    pub tables: TableRange,
    /// The gateways' NAT port range (`nat.ports` in their file): it decides
    /// which annotated Services' VIPs are egress IPs, so it must match.
    pub nat_ports: PortRange,
    /// `/metrics`, `/ready`, `/healthz`.
    pub metrics_listen: Option<SocketAddr>,
    /// Where the status is written after every pass.
    pub status_file: PathBuf,
    /// A full pass at least this often.
    pub resync_period: Duration,
    /// Next hops behind a router (`--tunnel`, `--tunnel-port`,
    /// `--tunnel-mtu`; docs/adr/0031-workers-in-any-subnet.md).
    pub tunnel: tunnel::TunnelOptions,
}

/// The default rule priority: before the CNIs' own `from <pod>` rules (the
/// AWS VPC CNI's start at 512, Cilium's ENI mode uses 110-111) and far from
/// the main table's 32766. Egret's tables `throw` whatever they do not
/// steer, so an early rule sends nothing elsewhere.
pub const DEFAULT_RULE_PRIORITY: u32 = 100;
/// The default steering bit: bit 12. It sits in the nibble Cilium leaves
/// to Kubernetes (its mark layout: identity in the upper 16 and lowest 8
/// bits, its magic values in `0x0F00`, `0xF000` for Kubernetes), beside
/// kube-proxy's masquerade bit `0x4000` and drop bit `0x8000` (the
/// kubelet's `--iptables-masquerade-bit`/`--iptables-drop-bit` defaults)
/// and the CNI portmap plugin's `markMasqBit` 13 (`0x2000`: it masquerades
/// every packet carrying it, so a selected pod's traffic to a pod on its
/// bridge was masqueraded when Egret used that bit), outside Calico's
/// default `IptablesMarkMask` `0xffff0000`, the AWS VPC CNI's `0x80` and
/// Istio's marks (`0x539` and ambient's `0x100`-`0x220`, `0x40`).
/// [`DOCUMENTED_MARKS`] lists them; a test checks the default against each.
pub const DEFAULT_STEER_MARK: u32 = 0x1000;

/// Packet-mark bits other components of a cluster document using, with
/// where: the steering bit must stay clear of them (`--steer-mark` refuses
/// one that overlaps).
pub const DOCUMENTED_MARKS: &[(&str, u32)] = &[
    ("kube-proxy / kubelet masquerade bit (--iptables-masquerade-bit 14)", 0x4000),
    ("kube-proxy / kubelet drop bit (--iptables-drop-bit 15)", 0x8000),
    ("the CNI portmap plugin's markMasqBit (default 13)", 0x2000),
    ("Calico felix IptablesMarkMask (default)", 0xffff_0000),
    ("Cilium magic marks (MagicMarkHostMask)", 0x0f00),
    ("AWS VPC CNI connmark / fwmark", 0x80),
    ("Istio sidecar (0x539) and ambient (0x100, 0x200, 0x210, 0x220, 0x40)", 0x0539 | 0x0300 | 0x0030 | 0x0040),
];

/// The default first table number.
pub const DEFAULT_TABLE_FIRST: u32 = 1_000_000;
/// The default number of tables (distinct route sets) the agent may use.
pub const DEFAULT_TABLE_COUNT: u32 = 65_536;
/// The default status file.
pub const DEFAULT_STATUS_FILE: &str = "/run/egret/node.json";

impl NodeOptions {
    /// The defaults for `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        NodeOptions {
            node_name: node_name.into(),
            kubeconfig: None,
            pod: None,
            cluster_cidrs: Vec::new(),
            strict: false,
            pod_cidrs: Vec::new(),
            rule_priority: DEFAULT_RULE_PRIORITY,
            steer_mark: DEFAULT_STEER_MARK,
            tables: TableRange { first: DEFAULT_TABLE_FIRST, count: DEFAULT_TABLE_COUNT },
            nat_ports: PortRange::default(),
            metrics_listen: None,
            status_file: PathBuf::from(DEFAULT_STATUS_FILE),
            resync_period: Duration::from_secs(30),
            tunnel: tunnel::TunnelOptions::default(),
        }
    }

    /// Checks the settings before anything starts; the error names the
    /// flag and the value.
    pub fn validate(&self) -> Result<(), NodeError> {
        let bad = |m: String| Err(NodeError::Options(m));
        if self.node_name.is_empty() {
            return bad("--node-name: empty (set it, or NODE_NAME from the downward API)".into());
        }
        if self.cluster_cidrs.is_empty() {
            return bad(
                "--cluster-cidr: none given (list the cluster's pod CIDR and Service CIDR: traffic to them must never go to a gateway)"
                    .into(),
            );
        }
        if self.rule_priority == 0 || self.rule_priority >= 32766 {
            return bad(format!(
                "--rule-priority: {} must be between 1 and 32765 (0 is the local table's rule, 32766 the main table's)",
                self.rule_priority
            ));
        }
        if self.steer_mark.count_ones() != 1 {
            return bad(format!(
                "--steer-mark: {:#x} must be a single bit (one the cluster's other components leave alone; default {DEFAULT_STEER_MARK:#x})",
                self.steer_mark
            ));
        }
        if let Some((who, _)) = DOCUMENTED_MARKS.iter().find(|(_, m)| m & self.steer_mark != 0) {
            return bad(format!("--steer-mark: {:#x} is used by {who}", self.steer_mark));
        }
        let TableRange { first, count } = self.tables;
        let end = u64::from(first) + u64::from(count);
        if count == 0 || first == 0 || end > u64::from(u32::MAX) {
            return bad(format!("--table-first {first} --table-count {count}: the range must be non-empty, start above 0 and end below 2^32"));
        }
        if (252..=255).any(|reserved| TableRange { first, count }.contains(reserved)) {
            return bad(format!(
                "--table-first {first} --table-count {count}: the range includes a reserved table (252 compat, 253 default, 254 main, 255 local)"
            ));
        }
        if self.nat_ports.first == 0 || self.nat_ports.first > self.nat_ports.last {
            return bad(format!("--nat-ports: {}-{} is not a port range", self.nat_ports.first, self.nat_ports.last));
        }
        if self.tunnel.port == 0 {
            return bad("--tunnel-port: 0 is not a UDP port (the gateways' tunnel-port; default 6082)".into());
        }
        if let Some(m) = self.tunnel.mtu {
            // 68 + 50: the smallest IPv4 route MTU left after the tunnel;
            // IP_MAX_MTU (include/net/ip.h) above.
            if !(118..=65535).contains(&m) {
                return bad(format!(
                    "--tunnel-mtu: {m} must be between 118 and 65535 (the underlay MTU towards the gateways)"
                ));
            }
        }
        Ok(())
    }
}

/// Why the agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Bad settings.
    #[error("{0}")]
    Options(String),
    /// The Kubernetes client.
    #[error(transparent)]
    K8s(#[from] crate::k8s::K8sError),
    /// The kernel.
    #[error(transparent)]
    Kernel(#[from] kernel::KernelError),
    /// nftables.
    #[error(transparent)]
    Nft(#[from] nft::NftError),
    /// The metrics listener.
    #[error("--metrics-listen {addr}: {source}")]
    Listen {
        /// Address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A task the agent cannot work without ended (a watch, the metrics
    /// server): the agent exits so that it is restarted.
    #[error("{0} ended; exiting so that the agent is restarted (the kernel keeps its rules)")]
    TaskEnded(String),
    /// The Node object (strict mode reads its pod CIDRs).
    #[error("reading Node {node}: {message}")]
    Node {
        /// Name.
        node: String,
        /// Why.
        message: String,
    },
}

/// `egret node cleanup`: removes every rule and route Egret's agent put in
/// the kernel (in `tables`) and its tables `inet egret_node` and
/// `inet egret_node_guard`.
pub fn cleanup(tables: TableRange) -> Result<usize, NodeError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| NodeError::Kernel(kernel::KernelError::Dump { what: "runtime", source: e }))?;
    let n = rt.block_on(async {
        let mut k = kernel::Kernel::open(tables)?;
        k.remove_all().await
    })?;
    nft::remove()?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn bad_options_name_the_flag_and_the_value() {
        let mut o = NodeOptions::new("w1");
        o.cluster_cidrs = vec!["198.18.0.0/16".parse().unwrap()];
        o.validate().unwrap();
        type Change = Box<dyn Fn(&mut NodeOptions)>;
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|o| o.node_name.clear()), "--node-name"),
            (Box::new(|o| o.cluster_cidrs.clear()), "--cluster-cidr"),
            (Box::new(|o| o.rule_priority = 32766), "--rule-priority: 32766"),
            (Box::new(|o| o.steer_mark = 0x3000), "--steer-mark: 0x3000 must be a single bit"),
            (Box::new(|o| o.steer_mark = 0x2000), "--steer-mark: 0x2000 is used by the CNI portmap plugin"),
            (Box::new(|o| o.steer_mark = 0x4000), "--steer-mark: 0x4000 is used by kube-proxy"),
            (Box::new(|o| o.steer_mark = 0x1_0000), "--steer-mark: 0x10000 is used by Calico"),
            (Box::new(|o| o.tables = TableRange { first: 200, count: 100 }), "reserved table"),
            (Box::new(|o| o.tables = TableRange { first: u32::MAX, count: 2 }), "--table-first 4294967295"),
            (Box::new(|o| o.nat_ports = PortRange { first: 9, last: 1 }), "--nat-ports: 9-1"),
            (Box::new(|o| o.tunnel.port = 0), "--tunnel-port: 0"),
            (Box::new(|o| o.tunnel.mtu = Some(100)), "--tunnel-mtu: 100"),
        ];
        for (change, want) in cases {
            let mut bad = o.clone();
            change(&mut bad);
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e} should name {want}");
        }
    }

    /// The default bit is clear of every mark kube-proxy, Calico, Cilium,
    /// the AWS VPC CNI and Istio document, and of the agent's own
    /// conntrack mark.
    #[test]
    fn the_default_steering_bit_collides_with_no_documented_mark() {
        assert_eq!(DEFAULT_STEER_MARK.count_ones(), 1);
        for (who, mark) in DOCUMENTED_MARKS {
            assert_eq!(DEFAULT_STEER_MARK & mark, 0, "{DEFAULT_STEER_MARK:#x} overlaps {who} ({mark:#x})");
        }
        // Cilium's layout leaves 0xF000 to Kubernetes; kube-proxy takes the
        // top two bits of it.
        assert_eq!(DEFAULT_STEER_MARK & 0xf000, DEFAULT_STEER_MARK);
    }
}
