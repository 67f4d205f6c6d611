//! Kubernetes mode: the control plane inside each gateway.
//!
//! | file | owns |
//! |---|---|
//! | `crd.rs` | the API: `EgressPolicy`, `EgressIPPool`, the Service annotation, condition types and reasons |
//! | `observe.rs` | Kubernetes objects -> plain observed-state structs |
//! | `desired.rs` | the pure function observed state -> this gateway's `TablesSpec`, candidacies, status |
//! | `pool.rs` | pool address sets and allocation |
//! | `lease.rs` | the per-egress-IP Lease state machine (time injected, no I/O) |
//! | `renewer.rs` | the task that renews held Leases, apart from the sync loop |
//! | `stalled_watch.rs` | watches that start over when the Lease watch lags this gateway's own writes |
//! | `valid_until.rs` | each address's deadline as the data plane was told it |
//! | `status_writer.rs` | who writes status, one write in flight per object, backoff |
//! | `uninstall.rs` | a stop told apart: restart, uninstall (DaemonSet gone), retirement (Node unselected) |
//! | `controller.rs` | watchers, the sync loop, Lease requests, status writes, Events: [`run`] |
//!
//! The daemon calls [`run`] with a client, [`K8sOptions`] and its
//! [`crate::sink::TablesSink`]; `run` returns when the shutdown future
//! completes (after fencing and releasing its Leases) or on a fatal error.

pub mod controller;
pub mod crd;
pub mod desired;
pub mod handed_over;
pub mod lease;
pub mod liveness;
pub mod liveness_requests;
#[cfg(test)]
mod liveness_sim;
pub mod observe;
pub mod pool;
pub mod renewer;
pub mod stalled_watch;
pub mod status_writer;
pub mod uninstall;
pub mod valid_until;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use egret_dataplane::tables::{NatSettings, SourceGuard};

use crate::view::ClusterReport;

pub use controller::{run, run_supervised};
pub use lease::{LeaseTiming, TimingError};

/// What the control plane needs from the gateway's configuration: the
/// `kubernetes:` section of the file (docs/config.md) plus the NAT settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct K8sOptions {
    /// This gateway's Node name (`kubernetes.nodeName`, default `$NODE_NAME`):
    /// its identity in Leases.
    pub node_name: String,
    /// Namespace of the egress-IP Leases (`kubernetes.leaseNamespace`,
    /// default `egret-system`).
    pub lease_namespace: String,
    /// `kubernetes.leaseDuration`, `renewDeadline`, `retryPeriod`.
    pub timing: LeaseTiming,
    /// Label selector of gateway Nodes (`kubernetes.gatewaySelector`,
    /// default `egret.dev/gateway=true`).
    pub gateway_selector: String,
    /// Periodic full pass even without changes (`kubernetes.resyncPeriod`,
    /// default 30 s).
    pub resync_period: Duration,
    /// The file's `nat:` section (its port range decides which Service ports
    /// collide with NAT; it is passed through to every TablesSpec).
    pub nat: NatSettings,
    /// `kubernetes.clusterPodCIDRs` on the file's interfaces (passed through
    /// to every TablesSpec: the fail-closed table's source guard).
    pub guard: SourceGuard,
    /// `kubernetes.ha` (None: no channel between gateways).
    pub ha: Option<crate::ha::HaOptions>,
    /// The nodes' tunnel port (`tunnel.port`, default 6082; None:
    /// `tunnel.enabled: false`): nodes in other subnets reach the gateways
    /// through it (docs/adr/0031).
    pub tunnel_port: Option<u16>,
    /// The gateway DaemonSet, once read: the owner of the Leases written
    /// (the garbage collector deletes them with it: [`uninstall`]).
    pub lease_owner: uninstall::OwnerSlot,
    /// Ownership follows one liveness Lease per gateway, and an egress IP's
    /// Lease is written only when it changes hands (ADR 0016,
    /// `kubernetes.ownership: liveness`, the default); false (`perIP`):
    /// every held IP's Lease is renewed every retryPeriod (ADR 0004).
    pub liveness: bool,
    /// Where each pass publishes the pods' identities by address, for the
    /// translation logs' exporter (translog/identity.rs).
    pub pod_identities: crate::translog::identity::PodIdentities,
    /// Port use near exhaustion, reported as Warning Events (crate::port_use;
    /// None: no data plane, no warnings).
    pub port_use: Option<crate::port_use::MonitorRef>,
}

impl K8sOptions {
    /// The defaults for gateway `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        K8sOptions {
            node_name: node_name.into(),
            lease_namespace: "egret-system".into(),
            timing: LeaseTiming::default(),
            gateway_selector: format!("{}=true", crd::GATEWAY_LABEL),
            resync_period: Duration::from_secs(30),
            nat: NatSettings::default(),
            guard: SourceGuard::default(),
            ha: None,
            tunnel_port: Some(egret_dataplane::wire::vxlan::DEFAULT_PORT),
            lease_owner: uninstall::OwnerSlot::default(),
            liveness: true,
            pod_identities: Default::default(),
            port_use: None,
        }
    }

    /// Checks the options before anything starts.
    pub fn validate(&self) -> Result<(), K8sError> {
        if self.node_name.is_empty() {
            return Err(K8sError::NoNodeName);
        }
        self.timing.validate()?;
        Ok(())
    }
}

/// The sync loop's liveness, for a watchdog outside its runtime
/// (daemon/mod.rs): the loop beats once per iteration, and iterates at
/// least once per `retryPeriod` while it is healthy. Before the first beat
/// nothing is held (the loop has not run a pass), so nothing is at stake.
///
/// It also carries the loop's last [`ClusterReport`] (what `egret status`
/// and the metrics show of Leases, peers and standbys).
#[derive(Debug)]
pub struct Heartbeat {
    base: Instant,
    /// Milliseconds after `base` of the last beat; 0: never.
    last_ms: AtomicU64,
    report: parking_lot::Mutex<Option<ClusterReport>>,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat { base: Instant::now(), last_ms: AtomicU64::new(0), report: parking_lot::Mutex::new(None) }
    }
}

impl Heartbeat {
    /// Replaces the report.
    pub fn publish(&self, report: ClusterReport) {
        *self.report.lock() = Some(report);
    }

    /// The last report, with its `last_pass_ms` brought up to now.
    pub fn report(&self) -> Option<ClusterReport> {
        let mut r = self.report.lock().clone()?;
        r.last_pass_ms = self.age(Instant::now()).map_or(0, |a| a.as_millis() as u64);
        Some(r)
    }

    /// Records a beat now.
    pub fn beat(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last_ms.store(ms.max(1), Ordering::Release);
    }

    /// How long ago the last beat was at `now`; `None` before the first.
    pub fn age(&self, now: Instant) -> Option<Duration> {
        match self.last_ms.load(Ordering::Acquire) {
            0 => None,
            ms => Some(now.saturating_duration_since(self.base + Duration::from_millis(ms))),
        }
    }
}

/// Why the Kubernetes control plane could not run.
#[derive(Debug, thiserror::Error)]
pub enum K8sError {
    /// No node name configured and `$NODE_NAME` unset.
    #[error("kubernetes.nodeName: empty (set it, or NODE_NAME from the downward API)")]
    NoNodeName,
    /// Unsafe Lease timing.
    #[error(transparent)]
    Timing(#[from] TimingError),
    /// The kubeconfig could not be read.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No in-cluster configuration and no kubeconfig.
    #[error("no Kubernetes client configuration (in-cluster or $KUBECONFIG): {0}")]
    Infer(#[source] kube::config::InferConfigError),
    /// The client could not be built.
    #[error("Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The channel between gateways could not start.
    #[error(transparent)]
    Ha(#[from] crate::ha::HaError),
}

/// A client from `kubernetes.kubeconfig` if set, else in-cluster, then
/// `$KUBECONFIG`, with kube-client's retry of 429/503/504 answers (up to 15
/// times from 5 ms). For the node agent (its one Node read at start in strict
/// mode has no retry of its own) and `egret drain` (one command); the gateway
/// uses [`gateway_client`].
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, K8sError> {
    kube::Client::try_from(config(kubeconfig).await?).map_err(K8sError::Client)
}

/// [`client`] without kube-client's retry layer, for the gateway
/// (docs/adr/0019-status-writes-bounded.md). That retry kept each request
/// hanging for minutes against an overloaded API server while the gateways
/// sent more (~105 PATCHes in flight after an outage), and every caller in
/// the gateway already retries on its own terms:
/// - watches: kube-runtime's backoff (`watch` in controller.rs);
/// - Lease requests: each bounded by `renewDeadline`, sent again every
///   `retryPeriod` by the renewer and the Lease state machine;
/// - status writes: status_writer.rs (one in flight per object, backoff);
/// - Events: best effort, sent once on a transition; one lost to a 429/503
///   costs a line in `kubectl get events`, not correctness (the Leases and
///   the status say the same);
/// - the Lease releases at shutdown: bounded by 2 s anyway; an unreleased
///   Lease expires and the others take over after `leaseDuration`.
///
/// The cloud provider's calls go through the AWS SDK (its own retry), not
/// this client.
pub async fn gateway_client(kubeconfig: Option<&Path>) -> Result<kube::Client, K8sError> {
    let mut config = config(kubeconfig).await?;
    config.default_retry = false;
    kube::Client::try_from(config).map_err(K8sError::Client)
}

async fn config(kubeconfig: Option<&Path>) -> Result<kube::Config, K8sError> {
    Ok(match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|source| K8sError::Kubeconfig { path: path.display().to_string(), source })?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|source| K8sError::Kubeconfig { path: path.display().to_string(), source })?
        }
        None => kube::Config::infer().await.map_err(K8sError::Infer)?,
    })
}
