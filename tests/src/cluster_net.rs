//! What every Kubernetes lab's network has, whatever its nodes: the node
//! segment (bridge `lan` in namespace `lan`, where each node's `lan0`
//! plugs in), the management segment (bridge `mgmt` in namespace
//! `control`, with [`CONTROL`], where the API server runs and each node's
//! `mgmt` plugs in), the upstream router `up` and the external server
//! `srv` behind it, and a work directory. The Kubernetes lab
//! ([`crate::k8slab`]) and the worker-node lab ([`crate::nodelab`]) each
//! hold one and add their own nodes.

use std::path::PathBuf;

use crate::error::{LabError, Result};
use crate::k8slab::{mac, CONTROL};
use crate::netns::NetNs;
use crate::sysctl;

/// The shared part of a Kubernetes lab's network. Its namespaces are
/// deleted when it is dropped (their guards); the work directory is the
/// owning lab's to remove, after its processes stopped.
#[derive(Debug)]
pub struct ClusterNet {
    /// The node segment's bridge.
    pub lan: NetNs,
    /// The upstream router.
    pub up: NetNs,
    /// The external server.
    pub srv: NetNs,
    /// The management segment's bridge and the API server.
    pub control: NetNs,
    /// The lab's work directory.
    pub dir: PathBuf,
}

impl ClusterNet {
    /// Creates `{prefix}-lan`, `-up`, `-srv` and `-control`, and the work
    /// directory `egret-{kind}-{prefix}` under the temporary directory.
    pub fn create(prefix: &str, kind: &str) -> Result<Self> {
        let ns = |role: &str| NetNs::create(&format!("{prefix}-{role}"));
        let (lan, up, srv, control) = (ns("lan")?, ns("up")?, ns("srv")?, ns("control")?);
        let dir = std::env::temp_dir().join(format!("egret-{kind}-{prefix}"));
        std::fs::create_dir_all(&dir).map_err(|e| LabError::io(format!("create {}", dir.display()), e))?;
        Ok(Self { lan, up, srv, control, dir })
    }

    /// The sysctls of its own namespaces (`up` a router with `router`,
    /// lists of [`sysctl`]), and both bridges.
    pub fn wire_bridges(&self, router: &[&[&str]]) -> Result<()> {
        sysctl::set(&self.up, &[&[&sysctl::COMMON[..]], router].concat())?;
        for ns in [&self.lan, &self.srv, &self.control] {
            sysctl::set(ns, &[&sysctl::COMMON])?;
        }
        self.lan.ip_batch(&["link add lan type bridge mcast_snooping 0".into(), "link set dev lan up".into()])?;
        self.control.ip_batch(&[
            "link add mgmt type bridge mcast_snooping 0".into(),
            format!("addr add {CONTROL}/24 dev mgmt"),
            "link set dev mgmt up".into(),
        ])
    }

    /// Plugs `ns`'s new `lan0` (with MAC `m`, or the kernel's) into the
    /// node segment as bridge port `port`.
    pub fn lan_port(&self, ns: &NetNs, port: &str, m: Option<[u8; 6]>) -> Result<()> {
        let addr = m.map(|m| format!("address {} ", mac(m))).unwrap_or_default();
        ns.ip_batch(&[format!("link add lan0 {addr}type veth peer name {port} netns {}", self.lan.name())])?;
        self.lan.ip_batch(&[format!("link set dev {port} master lan"), format!("link set dev {port} up")])
    }

    /// Plugs `ns`'s new `mgmt` into the management segment as bridge port
    /// `port`, with `addr`/24, up.
    pub fn mgmt_port(&self, ns: &NetNs, port: &str, addr: std::net::Ipv4Addr) -> Result<()> {
        ns.ip_batch(&[format!("link add mgmt type veth peer name {port} netns {}", self.control.name())])?;
        self.control.ip_batch(&[format!("link set dev {port} master mgmt"), format!("link set dev {port} up")])?;
        ns.ip_batch(&[format!("addr add {addr}/24 dev mgmt"), "link set dev mgmt up".into()])
    }
}
