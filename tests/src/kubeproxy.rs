//! The real kube-proxy inside a lab namespace, and the EndpointSlices it
//! proxies to.
//!
//! **kube-proxy.** The binary is kube-proxy 1.20.2, built by
//! `tests/k8s/build-apiserver.sh` from the same Debian `kubernetes` source as
//! the API server and cached beside it (`$EGRET_CACHE/kube-apiserver-1.20.2/
//! kube-proxy`; `EGRET_KUBE_PROXY` names another). [`KubeProxy::start`] runs
//! it under `ip netns exec` in a gateway's or worker's namespace, as a
//! cluster's DaemonSet runs it on the host network: iptables mode, the Node's
//! name (`--hostname-override`, which decides which endpoints are local), the
//! Node's address as `--bind-address` (so it takes the address family from
//! it without reading Node status), `--cluster-cidr` (which traffic is
//! masqueraded), and what a network namespace needs:
//!
//! - `--conntrack-max-per-core=0` and the two conntrack TCP timeouts `0`:
//!   kube-proxy leaves the conntrack table's size (a machine-wide setting
//!   only the initial namespace may write) and timeouts alone;
//! - metrics on `127.0.0.1:10249` and health on `127.0.0.1:10256` of the
//!   namespace's own loopback; nothing listens elsewhere but what kube-proxy
//!   opens for the cluster inside its namespace (NodePort and
//!   healthCheckNodePort sockets), as on a node;
//! - `--oom-score-adj=0`: lowering it needs CAP_SYS_RESOURCE, which root
//!   lacks on this machine kind (docs: MACHINE-NOTES).
//!
//! **The kubelet's chains.** kube-proxy 1.20 jumps to `KUBE-MARK-DROP` but
//! only makes sure the chain exists; the rule in it, and the filter chain
//! that drops what it marks, are the kubelet's (1.20's `syncNetworkUtil`,
//! `pkg/kubelet/kubelet_network_linux.go`). No kubelet runs in the labs, so
//! [`install_kubelet_chains`] writes exactly those rules into a Node's
//! namespace before its kube-proxy starts: `KUBE-MARK-DROP` (`--or-mark
//! 0x8000`), `KUBE-FIREWALL` (drops packets with that mark, and outside
//! packets to 127.0.0.0/8) jumped to from `INPUT` and `OUTPUT` (not from
//! `FORWARD`: a forwarded packet marked for drop is not dropped there),
//! `KUBE-MARK-MASQ` and `KUBE-POSTROUTING` (masquerade what is marked
//! `0x4000`). Without them, kube-proxy's "drop" jumps to an empty chain and
//! falls through.
//!
//! It runs the iptables, ip6tables and conntrack commands of the machine
//! (Debian's iptables-nft, the lab's own rules use the same backend). The
//! handle kills it when dropped; [`KubeProxy::wait_synced`] returns once its
//! first full sync wrote the `KUBE-SERVICES` chain, [`KubeProxy::wait_nat`]
//! once a rule of a given Service is in place.
//!
//! It authenticates as the ServiceAccount `kube-system/kube-proxy` bound to
//! the bootstrap ClusterRole `system:node-proxier`, as kubeadm installs it
//! ([`proxier_kubeconfig`]): the lab's kube-proxy has exactly a cluster's
//! kube-proxy's privileges.
//!
//! **EndpointSlices.** kube-proxy 1.20 reads `discovery.k8s.io/v1beta1`
//! EndpointSlices, not Endpoints (the `EndpointSliceProxying` gate is beta
//! and on by default in 1.20; `cmd/kube-proxy/app/server.go` builds its
//! endpoint watch from `Discovery().V1beta1().EndpointSlices()`). No
//! controller-manager runs in the labs (the API-server harness runs etcd and
//! kube-apiserver only), so **the test writes each Service's EndpointSlices
//! itself, as 1.20's endpoint-slice controller would**
//! ([`publish_endpoint_slices`]): from the Service, the Pods its selector
//! matches and their Nodes, with the controller's labels
//! (`kubernetes.io/service-name`, `endpointslice.kubernetes.io/managed-by:
//! endpointslice-controller.k8s.io`, the Service's own labels), its owner
//! reference, one slice per address type of the Service's `ipFamilies`, the
//! Service's ports with their names and protocols (target ports resolved
//! against the Pod), and per endpoint the Pod's addresses of that family,
//! `conditions.ready` (the Pod's Ready condition, unless the Service
//! publishes not-ready addresses), `topology` (`kubernetes.io/hostname` from
//! `spec.nodeName`, the Node's zone and region labels) and `targetRef`;
//! `nodeName` is left out, as 1.20 does with its alpha
//! `EndpointSliceNodeName` gate off (`pkg/controller/endpointslice/
//! utils.go`). Why not run the controller-manager: it is another 120 MB
//! binary and several minutes of build, and it brings controllers the labs
//! must not have (node lifecycle would taint and evict the Nodes no kubelet
//! renews; garbage collection, the endpoints controller racing the test's
//! Pods). What kube-proxy sees is the same either way: the objects, not who
//! wrote them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Api, DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{json, Value};

use crate::apiserver::REQUIRE_ENV;
use crate::error::LabError;
use crate::netns::{self, NetNs};
use crate::requirement::{Requirement, Unavailable};

/// Set to a path: the kube-proxy binary to run instead of the cached build.
pub const BINARY_ENV: &str = "EGRET_KUBE_PROXY";

/// The endpoint-slice controller's name in `endpointslice.kubernetes.io/managed-by`.
pub const MANAGED_BY: &str = "endpointslice-controller.k8s.io";

/// Where kube-proxy serves metrics and health, inside its namespace.
pub const METRICS: &str = "127.0.0.1:10249";
/// See [`METRICS`].
pub const HEALTHZ: &str = "127.0.0.1:10256";

/// What went wrong with kube-proxy or the objects it reads.
#[derive(Debug, thiserror::Error)]
pub enum KubeProxyError {
    /// Starting or inspecting it in its namespace failed.
    #[error(transparent)]
    Lab(#[from] LabError),
    /// It exited.
    #[error("kube-proxy in {ns} exited ({status}); log {log}:\n{tail}")]
    Exited {
        /// Its namespace.
        ns: String,
        /// Its exit status.
        status: String,
        /// Its log file.
        log: String,
        /// The log's last lines.
        tail: String,
    },
    /// An API request failed.
    #[error("{what}: {source}")]
    Api {
        /// The request.
        what: String,
        /// Why.
        source: kube::Error,
    },
    /// An object was not what the controller would work from.
    #[error("{0}")]
    Object(String),
}

type Result<T> = std::result::Result<T, KubeProxyError>;

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> KubeProxyError {
    let what = what.into();
    move |source| KubeProxyError::Api { what, source }
}

/// The kube-proxy binary: [`BINARY_ENV`], or the build cache's.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os(BINARY_ENV) {
        return PathBuf::from(p);
    }
    let cache = std::env::var_os("EGRET_CACHE").map_or_else(|| PathBuf::from("/var/cache/egret"), PathBuf::from);
    cache.join("kube-apiserver-1.20.2/kube-proxy")
}

/// Whether kube-proxy can run here: root (namespaces, iptables) and the
/// built binary.
pub fn availability() -> std::result::Result<(), Unavailable> {
    if !crate::sys::is_root() {
        return Err(Unavailable("not root; kube-proxy runs in the lab's namespaces as root".into()));
    }
    let bin = binary();
    match std::fs::metadata(&bin) {
        Ok(m) if m.is_file() => Ok(()),
        _ => Err(Unavailable(format!("no kube-proxy at {}: run tests/k8s/build-apiserver.sh", bin.display()))),
    }
}

/// `Ok(true)` when the test may go on, `Ok(false)` (after saying why on
/// stderr) when it should return as skipped, `Err` when
/// `EGRET_REQUIRE_APISERVER=1` and kube-proxy cannot run (it is built with
/// the API server: [`crate::requirement`]'s rule).
pub fn available_or_skip(test: &str) -> std::result::Result<bool, Unavailable> {
    NEEDS.available_or_skip(test, availability())
}

/// What the kube-proxy tests need: the API server's variable, as one
/// build makes both.
pub const NEEDS: Requirement = Requirement { what: "kube-proxy", require_env: REQUIRE_ENV };

/// How one kube-proxy runs.
#[derive(Clone, Debug)]
pub struct KubeProxyConfig {
    /// Its Node's name (`--hostname-override`).
    pub node_name: String,
    /// Its Node's address (`--bind-address`; its family is the proxier's).
    pub node_ip: IpAddr,
    /// The cluster's pod CIDR(s), comma-separated (`--cluster-cidr`).
    pub cluster_cidr: String,
    /// Its kubeconfig.
    pub kubeconfig: PathBuf,
    /// `iptables` (or `ipvs`).
    pub mode: String,
    /// More flags.
    pub extra: Vec<String>,
}

impl KubeProxyConfig {
    /// iptables mode for Node `node_name` at `node_ip`.
    pub fn iptables(node_name: &str, node_ip: IpAddr, cluster_cidr: &str, kubeconfig: &Path) -> Self {
        Self {
            node_name: node_name.into(),
            node_ip,
            cluster_cidr: cluster_cidr.into(),
            kubeconfig: kubeconfig.into(),
            mode: "iptables".into(),
            extra: Vec::new(),
        }
    }
}

/// A kube-proxy running in a lab namespace; dropping it kills it.
#[derive(Debug)]
pub struct KubeProxy {
    child: Option<Child>,
    ns: NetNs,
    node: String,
    log: PathBuf,
    started: Instant,
}

impl KubeProxy {
    /// Starts kube-proxy in `ns` (its log `<dir>/kube-proxy-<node>.log`);
    /// does not wait for it.
    pub fn start(ns: &NetNs, dir: &Path, cfg: &KubeProxyConfig) -> Result<Self> {
        require_commands(ns)?;
        let bin = binary();
        let log = dir.join(format!("kube-proxy-{}.log", cfg.node_name));
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns.name()])
            .arg(&bin)
            .arg(format!("--kubeconfig={}", cfg.kubeconfig.display()))
            .arg(format!("--proxy-mode={}", cfg.mode))
            .arg(format!("--hostname-override={}", cfg.node_name))
            .arg(format!("--bind-address={}", cfg.node_ip))
            .arg(format!("--cluster-cidr={}", cfg.cluster_cidr))
            .args([
                "--conntrack-max-per-core=0",
                "--conntrack-tcp-timeout-established=0",
                "--conntrack-tcp-timeout-close-wait=0",
                "--oom-score-adj=0",
                "--v=2",
            ])
            .arg(format!("--metrics-bind-address={METRICS}"))
            .arg(format!("--healthz-bind-address={HEALTHZ}"))
            .args(&cfg.extra);
        let child = netns::spawn_logged(&mut cmd, &log)?;
        Ok(Self {
            child: Some(child),
            ns: NetNs::existing(ns.name())?,
            node: cfg.node_name.clone(),
            log,
            started: Instant::now(),
        })
    }

    /// Its Node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The process id (`ip netns exec` execs kube-proxy itself).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = text.lines().collect();
        v[v.len().saturating_sub(lines)..].join("\n")
    }

    fn check_running(&mut self) -> Result<()> {
        let Some(c) = self.child.as_mut() else {
            return Err(KubeProxyError::Object(format!("kube-proxy for {} was killed", self.node)));
        };
        match c.try_wait() {
            Ok(Some(status)) => Err(KubeProxyError::Exited {
                ns: self.ns.name().into(),
                status: status.to_string(),
                log: self.log.display().to_string(),
                tail: self.log_tail(30),
            }),
            _ => Ok(()),
        }
    }

    /// `iptables-save -t nat` in its namespace (`ip6tables-save` with `v6`).
    pub fn nat_rules(&self, v6: bool) -> Result<String> {
        let program = if v6 { "ip6tables-save" } else { "iptables-save" };
        Ok(run_in(&self.ns, program, &["-t", "nat"])?)
    }

    /// `iptables -t <table> -L <chain> -v -n -x` (packet counters) in its namespace.
    pub fn chain_counters(&self, table: &str, chain: &str) -> Result<String> {
        Ok(run_in(&self.ns, "iptables", &["-t", table, "-L", chain, "-v", "-n", "-x"])?)
    }

    /// Waits until kube-proxy's first sync has written the `KUBE-SERVICES`
    /// chain of the nat table; returns how long after its start that was.
    pub fn wait_synced(&mut self, timeout: Duration) -> Result<Duration> {
        self.wait_nat(":KUBE-SERVICES ", timeout)
    }

    /// Waits until its nat table (IPv4) holds a line containing `needle`
    /// (a Service's comment, say `"team-a/web:tcp loadbalancer IP"`);
    /// returns how long after its start that was. Fails early if it exits.
    pub fn wait_nat(&mut self, needle: &str, timeout: Duration) -> Result<Duration> {
        let deadline = Instant::now() + timeout;
        loop {
            self.check_running()?;
            if self.nat_rules(false).map(|r| r.contains(needle)).unwrap_or(false) {
                return Ok(self.started.elapsed());
            }
            if Instant::now() > deadline {
                return Err(LabError::Timeout {
                    what: format!(
                        "kube-proxy in {} to write {needle:?}; log {}:\n{}",
                        self.ns.name(),
                        self.log.display(),
                        self.log_tail(30)
                    ),
                    after: timeout,
                }
                .into());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("---- kube-proxy log ({}) ----\n{}\n----", self.log.display(), self.log_tail(30));
        }
    }
}

/// The kubelet's iptables rules of the Node (IPv4), in `ns`: what kubelet
/// 1.20's `syncNetworkUtil` ensures, in its order, with its default bits
/// (drop `0x8000`, masquerade `0x4000`). Run once per namespace, before
/// kube-proxy starts (see the module doc).
pub fn install_kubelet_chains(ns: &NetNs) -> crate::Result<()> {
    let (drop_mark, masq_mark) = ("0x008000", "0x004000");
    let rules: [Vec<&str>; 14] = [
        vec!["-t", "nat", "-N", "KUBE-MARK-DROP"],
        vec!["-t", "nat", "-A", "KUBE-MARK-DROP", "-j", "MARK", "--or-mark", drop_mark],
        vec!["-t", "filter", "-N", "KUBE-FIREWALL"],
        commented(
            "filter -A KUBE-FIREWALL",
            "kubernetes firewall for dropping marked packets",
            &["-m", "mark", "--mark", "0x008000/0x008000", "-j", "DROP"],
        ),
        commented(
            "filter -A KUBE-FIREWALL",
            "block incoming localnet connections",
            &[
                "--dst",
                "127.0.0.0/8",
                "!",
                "--src",
                "127.0.0.0/8",
                "-m",
                "conntrack",
                "!",
                "--ctstate",
                "RELATED,ESTABLISHED,DNAT",
                "-j",
                "DROP",
            ],
        ),
        vec!["-t", "filter", "-I", "OUTPUT", "-j", "KUBE-FIREWALL"],
        vec!["-t", "filter", "-I", "INPUT", "-j", "KUBE-FIREWALL"],
        vec!["-t", "nat", "-N", "KUBE-MARK-MASQ"],
        vec!["-t", "nat", "-N", "KUBE-POSTROUTING"],
        vec!["-t", "nat", "-A", "KUBE-MARK-MASQ", "-j", "MARK", "--or-mark", masq_mark],
        commented("nat -I POSTROUTING", "kubernetes postrouting rules", &["-j", "KUBE-POSTROUTING"]),
        vec!["-t", "nat", "-A", "KUBE-POSTROUTING", "-m", "mark", "!", "--mark", "0x004000/0x004000", "-j", "RETURN"],
        vec!["-t", "nat", "-A", "KUBE-POSTROUTING", "-j", "MARK", "--xor-mark", masq_mark],
        commented(
            "nat -A KUBE-POSTROUTING",
            "kubernetes service traffic requiring SNAT",
            &["-j", "MASQUERADE", "--random-fully"],
        ),
    ];
    for r in &rules {
        run_in(ns, "iptables", r)?;
    }
    Ok(())
}

/// The arguments of an iptables rule with a comment, as the kubelet writes
/// it: `-t <table> <op> <chain> -m comment --comment <comment> <rest>`
/// (`where_` is `<table> <op> <chain>`).
fn commented(where_: &'static str, comment: &'static str, rest: &[&'static str]) -> Vec<&'static str> {
    let mut r = vec!["-t"];
    r.extend(where_.split(' '));
    r.extend(["-m", "comment", "--comment", comment]);
    r.extend(rest);
    r
}

/// The commands kube-proxy runs (iptables mode): missing, it would fail
/// with a log line far from the cause; here the test fails naming the
/// package (`tests/tools.txt`).
fn require_commands(ns: &NetNs) -> crate::Result<()> {
    ns.exec(&["iptables-save", "--version"])?;
    ns.exec(&["iptables-restore", "--version"])?;
    ns.exec(&["ip6tables-save", "--version"])?;
    ns.exec(&["ip6tables-restore", "--version"])?;
    ns.exec(&["conntrack", "--version"])?;
    Ok(())
}

fn run_in(ns: &NetNs, program: &str, args: &[&str]) -> crate::Result<String> {
    let mut cmd = ns.command(program);
    cmd.args(args);
    netns::run(&mut cmd)
}

/// Creates the ServiceAccount `kube-system/kube-proxy` bound to the
/// ClusterRole `system:node-proxier` (kubeadm's binding
/// `kubeadm:node-proxier`), asks for a token of it (TokenRequest) and writes
/// a kubeconfig to `out` with the admin kubeconfig's server and CA and that
/// token. Idempotent: an existing account or binding is kept.
pub async fn proxier_kubeconfig(client: &kube::Client, admin_kubeconfig: &Path, out: &Path) -> Result<()> {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::ServiceAccount;
    use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "kube-system");
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "kube-proxy"}}))
        .map_err(|e| KubeProxyError::Object(format!("ServiceAccount: {e}")))?;
    create_or_keep(sas.create(&PostParams::default(), &sa).await, "create ServiceAccount kube-system/kube-proxy")?;
    let crbs: Api<ClusterRoleBinding> = Api::all(client.clone());
    let crb: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "kubeadm:node-proxier"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:node-proxier"},
        "subjects": [{"kind": "ServiceAccount", "name": "kube-proxy", "namespace": "kube-system"}]
    }))
    .map_err(|e| KubeProxyError::Object(format!("ClusterRoleBinding: {e}")))?;
    create_or_keep(crbs.create(&PostParams::default(), &crb).await, "create ClusterRoleBinding kubeadm:node-proxier")?;
    let req = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"audiences": []}});
    let tr: TokenRequest = sas
        .create_subresource("token", "kube-proxy", &PostParams::default(), &req)
        .await
        .map_err(api("TokenRequest for kube-system/kube-proxy"))?;
    let token = tr
        .status
        .and_then(|s| s.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| KubeProxyError::Object("TokenRequest answered without a token".into()))?;
    let text = std::fs::read_to_string(admin_kubeconfig)
        .map_err(|e| LabError::io(format!("read {}", admin_kubeconfig.display()), e))?;
    let field = |key: &str| -> Result<String> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(key).map(|v| v.trim().to_string()))
            .ok_or_else(|| KubeProxyError::Object(format!("{}: no {key}", admin_kubeconfig.display())))
    };
    let (server, ca) = (field("server:")?, field("certificate-authority-data:")?);
    let kc = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
         users:\n- name: kube-proxy\n  user:\n    token: {token}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: kube-proxy\n\
         current-context: lab\n"
    );
    std::fs::write(out, kc).map_err(|e| LabError::io(format!("write {}", out.display()), e))?;
    Ok(())
}

fn create_or_keep<T>(r: std::result::Result<T, kube::Error>, what: &str) -> Result<()> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(source) => Err(KubeProxyError::Api { what: what.into(), source }),
    }
}

/// `discovery.k8s.io/v1beta1` EndpointSlice, the version kube-proxy 1.20 reads.
pub fn endpoint_slice_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("discovery.k8s.io", "v1beta1", "EndpointSlice"),
        "endpointslices",
    )
}

/// Whether the endpoint-slice controller lists the Pod at all (1.20's
/// `endpointutil.ShouldPodBeInEndpoints`): it has an address and has not
/// ended for good under its restart policy.
fn pod_in_slices(pod: &Pod) -> bool {
    let status = pod.status.clone().unwrap_or_default();
    let phase = status.phase.unwrap_or_default();
    let has_ip = status.pod_ip.is_some_and(|ip| !ip.is_empty()) || status.pod_ips.is_some_and(|ips| !ips.is_empty());
    let ended = match pod.spec.as_ref().and_then(|s| s.restart_policy.as_deref()) {
        Some("Never") => phase == "Failed" || phase == "Succeeded",
        Some("OnFailure") => phase == "Succeeded",
        _ => false,
    };
    has_ip && !ended
}

/// The Pod's Ready condition (`podutil.IsPodReady`).
fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The Pod's addresses of one family (`getEndpointAddresses`).
fn pod_addresses(pod: &Pod, v6: bool) -> Vec<String> {
    let status = pod.status.clone().unwrap_or_default();
    let mut ips: Vec<String> = status.pod_ips.unwrap_or_default().into_iter().map(|p| p.ip).collect();
    if ips.is_empty() {
        ips.extend(status.pod_ip);
    }
    ips.into_iter().filter(|ip| ip.parse::<IpAddr>().is_ok_and(|a| a.is_ipv6() == v6)).collect()
}

/// The Service's ports as the Pod serves them (`getEndpointPorts` with
/// `podutil.FindPort`): a named target port is looked up among the Pod's
/// container ports of the same protocol; a port the Pod does not have is
/// left out.
fn endpoint_ports(svc: &Service, pod: &Pod) -> Vec<Value> {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let mut out = Vec::new();
    for p in svc.spec.as_ref().and_then(|s| s.ports.clone()).unwrap_or_default() {
        let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".into());
        let number = match &p.target_port {
            None => Some(p.port),
            Some(IntOrString::Int(n)) => Some(*n),
            Some(IntOrString::String(name)) => pod
                .spec
                .iter()
                .flat_map(|s| s.containers.iter())
                .flat_map(|c| c.ports.iter().flatten())
                .find(|cp| cp.name.as_deref() == Some(name) && cp.protocol.as_deref().unwrap_or("TCP") == protocol)
                .map(|cp| cp.container_port),
        };
        let Some(number) = number else { continue };
        let mut port = json!({"name": p.name.clone().unwrap_or_default(), "port": number, "protocol": protocol});
        if let Some(ap) = &p.app_protocol {
            port["appProtocol"] = json!(ap);
        }
        out.push(port);
    }
    out
}

/// Writes the EndpointSlices of Service `namespace/name` as 1.20's
/// endpoint-slice controller would (the module doc says what that is),
/// replacing what an earlier call wrote; returns them. A Service without a
/// selector gets none (the controller leaves those to whoever manages
/// them).
pub async fn publish_endpoint_slices(client: &kube::Client, namespace: &str, name: &str) -> Result<Vec<DynamicObject>> {
    let svc: Service = Api::<Service>::namespaced(client.clone(), namespace)
        .get(name)
        .await
        .map_err(api(format!("get Service {namespace}/{name}")))?;
    let spec = svc.spec.clone().unwrap_or_default();
    let Some(selector) = spec.selector.clone().filter(|s| !s.is_empty()) else {
        return Ok(Vec::new());
    };
    let selector: Vec<String> = selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let pods = Api::<Pod>::namespaced(client.clone(), namespace)
        .list(&ListParams::default().labels(&selector.join(",")))
        .await
        .map_err(api(format!("list the Pods of Service {namespace}/{name}")))?;
    let mut nodes: BTreeMap<String, Option<Node>> = BTreeMap::new();
    for node in pods.items.iter().filter_map(|p| p.spec.as_ref()?.node_name.clone()) {
        if let std::collections::btree_map::Entry::Vacant(e) = nodes.entry(node) {
            let n = Api::<Node>::all(client.clone())
                .get_opt(e.key())
                .await
                .map_err(api(format!("get Node {}", e.key())))?;
            e.insert(n);
        }
    }
    // The address types: the Service's ipFamilies, else its ClusterIP's
    // family, else (headless, no family) both (getAddressTypesForService).
    let mut families: Vec<bool> = spec.ip_families.clone().unwrap_or_default().iter().map(|f| f == "IPv6").collect();
    if families.is_empty() {
        match spec.cluster_ip.as_deref().and_then(|ip| ip.parse::<IpAddr>().ok()) {
            Some(ip) => families.push(ip.is_ipv6()),
            None => families.extend([false, true]),
        }
    }
    families.dedup();
    let publish_not_ready = spec.publish_not_ready_addresses.unwrap_or(false);
    // The controller's labels: the Service's own (less the reserved ones),
    // then its two, and the headless marker for a Service without ClusterIP.
    let reserved =
        ["kubernetes.io/service-name", "endpointslice.kubernetes.io/managed-by", "service.kubernetes.io/headless"];
    let mut labels: BTreeMap<String, String> = svc
        .metadata
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .filter(|(k, _)| !reserved.contains(&k.as_str()))
        .collect();
    if spec.cluster_ip.as_deref().is_none_or(|ip| ip.is_empty() || ip == "None") {
        labels.insert("service.kubernetes.io/headless".into(), String::new());
    }
    labels.insert("kubernetes.io/service-name".into(), name.into());
    labels.insert("endpointslice.kubernetes.io/managed-by".into(), MANAGED_BY.into());
    let uid = svc
        .metadata
        .uid
        .clone()
        .ok_or_else(|| KubeProxyError::Object(format!("Service {namespace}/{name} has no uid")))?;
    let owner = json!({"apiVersion": "v1", "kind": "Service", "name": name, "uid": uid, "controller": true, "blockOwnerDeletion": true});

    let ar = endpoint_slice_resource();
    let slices: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    let mine = ListParams::default()
        .labels(&format!("kubernetes.io/service-name={name},endpointslice.kubernetes.io/managed-by={MANAGED_BY}"));
    let existing = slices.list(&mine).await.map_err(api(format!("list the EndpointSlices of {namespace}/{name}")))?;
    let mut written = Vec::new();
    // Slices of an address type the Service no longer has.
    let types: Vec<&str> = families.iter().map(|v6| if *v6 { "IPv6" } else { "IPv4" }).collect();
    for old in existing.items.iter().filter(|s| !types.iter().any(|t| s.data["addressType"] == *t)) {
        let n = old.metadata.name.clone().unwrap_or_default();
        slices.delete(&n, &Default::default()).await.map_err(api(format!("delete EndpointSlice {n}")))?;
    }
    for v6 in families {
        let address_type = if v6 { "IPv6" } else { "IPv4" };
        // Endpoints grouped by their port set: one slice per group.
        let mut groups: BTreeMap<String, (Vec<Value>, Vec<Value>)> = BTreeMap::new();
        for pod in pods.items.iter().filter(|p| pod_in_slices(p)) {
            let addresses = pod_addresses(pod, v6);
            if addresses.is_empty() {
                continue;
            }
            let ports = endpoint_ports(&svc, pod);
            let serving = pod_ready(pod);
            let terminating = pod.metadata.deletion_timestamp.is_some();
            let mut topology = serde_json::Map::new();
            let node_name = pod.spec.as_ref().and_then(|s| s.node_name.clone());
            if let Some(n) = &node_name {
                topology.insert("kubernetes.io/hostname".into(), json!(n));
                let node_labels = nodes.get(n).and_then(|n| n.as_ref()?.metadata.labels.clone()).unwrap_or_default();
                for key in ["topology.kubernetes.io/zone", "topology.kubernetes.io/region"] {
                    if let Some(v) = node_labels.get(key).filter(|v| !v.is_empty()) {
                        topology.insert(key.into(), json!(v));
                    }
                }
            }
            let endpoint = json!({
                "addresses": addresses,
                "conditions": {"ready": publish_not_ready || (serving && !terminating)},
                "topology": topology,
                "targetRef": {
                    "kind": "Pod",
                    "namespace": pod.metadata.namespace,
                    "name": pod.metadata.name,
                    "uid": pod.metadata.uid,
                    "resourceVersion": pod.metadata.resource_version,
                }
            });
            let key = serde_json::to_string(&ports).unwrap_or_default();
            groups.entry(key).or_insert_with(|| (ports, Vec::new())).1.push(endpoint);
        }
        let mut reuse: Vec<&DynamicObject> =
            existing.items.iter().filter(|s| s.data["addressType"] == address_type).collect();
        for (_, (ports, endpoints)) in groups {
            let mut obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": ar.api_version, "kind": ar.kind,
                "metadata": {"namespace": namespace, "labels": labels, "ownerReferences": [owner]},
                "addressType": address_type,
                "ports": ports,
                "endpoints": endpoints,
            }))
            .map_err(|e| KubeProxyError::Object(format!("EndpointSlice: {e}")))?;
            let done = match reuse.pop() {
                Some(old) => {
                    obj.metadata.name = old.metadata.name.clone();
                    obj.metadata.resource_version = old.metadata.resource_version.clone();
                    let n = old.metadata.name.clone().unwrap_or_default();
                    slices
                        .replace(&n, &PostParams::default(), &obj)
                        .await
                        .map_err(api(format!("replace EndpointSlice {n}")))?
                }
                None => {
                    obj.metadata.generate_name = Some(format!("{name}-"));
                    slices
                        .create(&PostParams::default(), &obj)
                        .await
                        .map_err(api(format!("create an EndpointSlice for {namespace}/{name}")))?
                }
            };
            written.push(done);
        }
        // Slices of this type no group needs any more.
        for old in reuse {
            let n = old.metadata.name.clone().unwrap_or_default();
            slices.delete(&n, &Default::default()).await.map_err(api(format!("delete EndpointSlice {n}")))?;
        }
    }
    Ok(written)
}
