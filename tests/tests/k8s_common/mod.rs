//! Shared helpers of the Kubernetes integration tests (`k8s_*.rs`): a fake
//! `TablesSink` that records every applied spec with its time, cluster
//! fixtures (namespaces, Nodes, Pods with a patched IP, LoadBalancer Services
//! with a patched ingress IP), the CRDs from `deploy/crds/`, gateway control
//! planes run as tasks, a TCP proxy that can cut one gateway off from the
//! API server, and the worker-node lab's Egret (kubeconfigs, both gateways,
//! synced agents) with its check that no pod address left.

// `SinkEvent::Apply` holds a whole TablesSpec (248 bytes since it carries the
// node's local addresses); a test log, not a hot path.
#![allow(dead_code, clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::large_enum_variant)]

use std::collections::BTreeSet;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use egret_controlplane::ha::SessionStore;
use egret_controlplane::k8s::{run, K8sOptions};
use egret_controlplane::sink::{ApplyError, TablesSink};
use egret_dataplane::tables::TablesSpec;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub const WAIT: Duration = Duration::from_secs(30);

/// One `apply` or `announce` the fake sink received.
#[derive(Clone, Debug)]
pub enum SinkEvent {
    Apply(TablesSpec),
    Announce(Vec<IpAddr>),
}

/// One `set_valid_until` call: when, and each address's new valid-until.
pub type ValidUntilCall = (Instant, Vec<(IpAddr, Option<std::time::Instant>)>);

/// Records what a gateway's control plane asked of its dataplane.
#[derive(Debug, Default)]
pub struct FakeSink {
    pub log: Mutex<Vec<(Instant, SinkEvent)>>,
    /// Every `set_valid_until` call: when, and what it set.
    pub valid_until: Mutex<Vec<ValidUntilCall>>,
    /// The sessions session sync reads and installs (None: no data plane).
    pub store: StoreSlot,
}

/// A [`SessionStore`] for a [`FakeSink`].
#[derive(Default)]
pub struct StoreSlot(pub Option<Arc<dyn SessionStore>>);

impl std::fmt::Debug for StoreSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "StoreSlot(Some)" } else { "StoreSlot(None)" })
    }
}

impl TablesSink for FakeSink {
    fn apply(&self, spec: &TablesSpec) -> Result<(), ApplyError> {
        self.log.lock().unwrap().push((Instant::now(), SinkEvent::Apply(spec.clone())));
        Ok(())
    }

    fn announce(&self, ips: &[IpAddr]) {
        self.log.lock().unwrap().push((Instant::now(), SinkEvent::Announce(ips.to_vec())));
    }

    fn set_valid_until(&self, deadlines: &[(IpAddr, Option<std::time::Instant>)]) {
        self.valid_until.lock().unwrap().push((Instant::now(), deadlines.to_vec()));
    }

    fn sessions(&self) -> Option<Arc<dyn SessionStore>> {
        self.store.0.clone()
    }
}

impl FakeSink {
    /// The valid-until the data plane would have for `ip` now (None: none
    /// set or no limit).
    pub fn valid_until_of(&self, ip: IpAddr) -> Option<std::time::Instant> {
        self.valid_until
            .lock()
            .unwrap()
            .iter()
            .rev()
            .find_map(|(_, v)| v.iter().find(|(a, _)| *a == ip).map(|(_, t)| *t))?
    }
}

impl FakeSink {
    /// The last applied spec.
    pub fn last(&self) -> Option<TablesSpec> {
        self.log.lock().unwrap().iter().rev().find_map(|(_, e)| match e {
            SinkEvent::Apply(s) => Some(s.clone()),
            SinkEvent::Announce(_) => None,
        })
    }

    /// The egress IPs served now: in the last applied spec and not past
    /// their valid-until (a dormant IP, fenced by its deadline with its
    /// sessions kept, is in the tables but not served).
    pub fn held(&self) -> BTreeSet<IpAddr> {
        let now = std::time::Instant::now();
        self.last()
            .map(|s| s.egress_ips.iter().map(|e| e.ip).collect::<BTreeSet<_>>())
            .unwrap_or_default()
            .into_iter()
            .filter(|ip| self.valid_until_of(*ip).is_none_or(|t| t > now))
            .collect()
    }

    /// The egress IPs in the last applied spec, served or dormant.
    pub fn in_tables(&self) -> BTreeSet<IpAddr> {
        self.last().map(|s| s.egress_ips.iter().map(|e| e.ip).collect()).unwrap_or_default()
    }

    /// Every announced address.
    pub fn announced(&self) -> BTreeSet<IpAddr> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(_, e)| match e {
                SinkEvent::Announce(v) => Some(v.clone()),
                SinkEvent::Apply(_) => None,
            })
            .flatten()
            .collect()
    }

    /// The intervals during which `ip` was served: in the applied egress
    /// IPs and not past its valid-until, as the data plane judges it (an
    /// open interval ends at `until`).
    pub fn intervals(&self, ip: IpAddr, until: Instant) -> Vec<(Instant, Instant)> {
        let lapses = self.lapses(ip, until);
        let mut out = Vec::new();
        for (a0, a1) in self.table_intervals(ip, until) {
            let mut from = a0;
            for (l0, l1) in lapses.iter().filter(|(l0, l1)| *l1 > a0 && *l0 < a1) {
                if *l0 > from {
                    out.push((from, *l0));
                }
                from = from.max(*l1);
            }
            if from < a1 {
                out.push((from, a1));
            }
        }
        out
    }

    /// The intervals during which the valid-until told for `ip` had passed:
    /// from a deadline until the next call (no call yet: valid, as the real
    /// sink's maps are; an open interval ends at `until`).
    pub fn lapses(&self, ip: IpAddr, until: Instant) -> Vec<(Instant, Instant)> {
        let calls: Vec<(Instant, Option<Instant>)> = self
            .valid_until
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(t, v)| v.iter().find(|(a, _)| *a == ip).map(|(_, d)| (*t, d.map(Instant::from_std))))
            .collect();
        let mut out = Vec::new();
        for (i, (t, d)) in calls.iter().enumerate() {
            let next = calls.get(i + 1).map_or(until, |(n, _)| *n);
            if let Some(lapsed) = d.map(|d| d.max(*t)).filter(|l| *l < next) {
                out.push((lapsed, next));
            }
        }
        out
    }

    /// The intervals during which `ip` was in the applied egress IPs,
    /// served or not (an open interval ends at `until`).
    pub fn table_intervals(&self, ip: IpAddr, until: Instant) -> Vec<(Instant, Instant)> {
        let mut out = Vec::new();
        let mut start: Option<Instant> = None;
        for (t, e) in self.log.lock().unwrap().iter() {
            let SinkEvent::Apply(s) = e else { continue };
            let has = s.egress_ips.iter().any(|e| e.ip == ip);
            match (has, start) {
                (true, None) => start = Some(*t),
                (false, Some(s0)) => {
                    out.push((s0, *t));
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(s0) = start {
            out.push((s0, until));
        }
        out
    }

    /// When `ip` last left the applied egress IPs.
    pub fn removed_at(&self, ip: IpAddr) -> Option<Instant> {
        let iv = self.intervals(ip, Instant::now() + Duration::from_secs(3600));
        iv.iter().rev().find(|(_, e)| *e < Instant::now() + Duration::from_secs(1800)).map(|(_, e)| *e)
    }

    /// When `ip` first entered the applied egress IPs at or after `after`.
    pub fn added_after(&self, ip: IpAddr, after: Instant) -> Option<Instant> {
        self.intervals(ip, Instant::now()).iter().map(|(s, _)| *s).find(|s| *s >= after)
    }
}

/// Asserts that no two sinks had `ip` at the same time. Each sink's last
/// interval ends at its `until` (the kill of a crashed gateway: its
/// dataplane is gone with it).
pub fn assert_never_shared(ip: IpAddr, sinks: &[(&str, &FakeSink, Instant)]) {
    for (i, (na, a, ua)) in sinks.iter().enumerate() {
        for (nb, b, ub) in sinks.iter().skip(i + 1) {
            for (a0, a1) in a.intervals(ip, *ua) {
                for (b0, b1) in b.intervals(ip, *ub) {
                    assert!(a1 <= b0 || b1 <= a0, "{ip} held by {na} {a0:?}..{a1:?} and {nb} {b0:?}..{b1:?} at once");
                }
            }
        }
    }
}

/// Runs `scenario` against a fresh API server (kube-apiserver + etcd) on a
/// two-thread runtime, then stops the server; skipped (with a message) when
/// the server cannot run here, unless `EGRET_REQUIRE_APISERVER=1`.
pub fn with_api_server(
    test: &str,
    scenario: impl FnOnce(&egret_tests::apiserver::ApiServer, &tokio::runtime::Runtime),
) {
    use egret_tests::apiserver::ApiServer;
    match ApiServer::available_or_skip(test) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    // The gateways' logs, with RUST_LOG set (a failure's explanation).
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
    let server = ApiServer::start().expect("start kube-apiserver + etcd");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    scenario(&server, &rt);
    drop(rt);
    server.stop().expect("stop");
}

/// Runs `scenario` in a lab (built by `build`, a real API server in its
/// control namespace, entered for the scenario), one lab at a time per test
/// binary: each lab's scenarios measure failovers that two labs sharing two
/// cores would blur. Skipped (or failed, with `EGRET_REQUIRE_APISERVER=1`)
/// as the API server's harness says. `tag` prefixes the printed lines.
pub fn run_in_a_lab<L: Sync>(
    tag: &str,
    name: &str,
    build: impl FnOnce() -> L,
    control: impl Fn(&L) -> &egret_tests::netns::NetNs,
    scenario: impl FnOnce(&L, &egret_tests::apiserver::ApiServer) + Send,
) {
    use egret_tests::apiserver::ApiServer;
    use egret_tests::k8slab::{CONTROL, SERVICE_CIDR};
    static ONE_LAB: std::sync::Mutex<()> = std::sync::Mutex::new(());
    match ApiServer::lab_available_or_skip(name) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    // A failed scenario poisons the lock; the next one still runs.
    let _one = ONE_LAB.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let t0 = std::time::Instant::now();
    let lab = build();
    let server = ApiServer::start_in(control(&lab).name(), IpAddr::V4(CONTROL), SERVICE_CIDR)
        .expect("kube-apiserver in the lab");
    println!("{tag}: lab and API server up after {} ms", t0.elapsed().as_millis());
    control(&lab).run_in(|| scenario(&lab, &server)).expect("enter the control namespace");
    server.stop().expect("stop the API server");
    println!("{tag}: {name}: {} ms", t0.elapsed().as_millis());
}

/// [`run_in_a_lab`] for the Kubernetes lab of `gateways`.
pub fn run_in_k8s_lab(
    tag: &str,
    name: &str,
    gateways: &[egret_tests::k8slab::Gw],
    scenario: impl FnOnce(&egret_tests::k8slab::K8sLab, &egret_tests::apiserver::ApiServer) + Send,
) {
    use egret_tests::k8slab::K8sLab;
    run_in_a_lab(
        tag,
        name,
        || K8sLab::build_with(&K8sLab::test_prefix(), gateways).expect("build the lab"),
        K8sLab::control,
        scenario,
    );
}

/// Gateway `g` of the Kubernetes lab in Kubernetes mode with the default
/// Lease timing, `extra` appended to its `kubernetes:` section.
pub fn lab_gateway_config(
    g: egret_tests::k8slab::Gw,
    kubeconfig: &std::path::Path,
    extra: String,
) -> egret_tests::gateway::GatewayConfig {
    use egret_tests::gateway::{GatewayConfig, KubernetesSection};
    GatewayConfig::kubernetes(
        &egret_tests::k8slab::K8sLab::gateway_interfaces(),
        KubernetesSection {
            node_name: g.node_name().into(),
            kubeconfig: kubeconfig.to_path_buf(),
            timing: None,
            cluster_pod_cidrs: vec![],
            extra,
        },
    )
}

/// The EgressPolicy `db` of the labs: pods labelled `app=db` in namespaces
/// labelled `team=a` leave through `egress_ip`.
pub async fn db_policy(client: &kube::Client, egress_ip: std::net::Ipv4Addr) {
    create_db_policy(client, &["0.0.0.0/0"], &[egress_ip.into()]).await;
}

/// The EgressPolicy `db` of the worker-node labs: [`db_policy`] for both
/// families, `egress_ip` for IPv4 and `egress_ip6` for IPv6.
pub async fn db_policy_dual_stack(
    client: &kube::Client,
    egress_ip: std::net::Ipv4Addr,
    egress_ip6: std::net::Ipv6Addr,
) {
    create_db_policy(client, &["0.0.0.0/0", "::/0"], &[egress_ip.into(), egress_ip6.into()]).await;
}

async fn create_db_policy(client: &kube::Client, destinations: &[&str], egress_ips: &[IpAddr]) {
    let ips: Vec<serde_json::Value> = egress_ips.iter().map(|ip| json!({"ip": ip.to_string()})).collect();
    let policy: egret_controlplane::k8s::crd::EgressPolicy = serde_json::from_value(json!({
        "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
        "metadata": {"name": "db"},
        "spec": {
            "namespaceSelector": {"matchLabels": {"team": "a"}},
            "podSelector": {"matchLabels": {"app": "db"}},
            "destinations": destinations,
            "egressIPs": ips
        }
    }))
    .unwrap();
    Api::<egret_controlplane::k8s::crd::EgressPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .expect("policy");
}

/// Polls `f` every 50 ms until it returns `Some`, or panics after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    match poll_until(timeout, f).await {
        Some(v) => v,
        None => panic!("timed out after {timeout:?} waiting for {what}"),
    }
}

/// `f`'s first answer within `timeout`, asked every 50 ms (None: none).
async fn poll_until<T, F, Fut>(timeout: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`wait_for`], printing every Lease (holder, epoch, annotations) before
/// it fails: what each gateway's records said is what a failure in CI
/// leaves to go on.
pub async fn wait_for_or_show_leases<T, F, Fut>(client: &kube::Client, what: &str, timeout: Duration, f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    if let Some(v) = poll_until(timeout, f).await {
        return v;
    }
    show_leases(client).await;
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// Prints every Lease as the API server has it: what a failure in an
/// election needs explained.
pub async fn show_leases(client: &kube::Client) {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = Api::all(client.clone());
    for l in leases.list(&Default::default()).await.map(|l| l.items).unwrap_or_default() {
        let spec = l.spec.unwrap_or_default();
        println!(
            "lease {}: holder {:?}, transitions {:?}, acquired {:?}, renewed {:?}, version {:?}, annotations {:?}",
            l.metadata.name.unwrap_or_default(),
            spec.holder_identity,
            spec.lease_transitions,
            spec.acquire_time.map(|t| t.0.to_string()),
            spec.renew_time.map(|t| t.0.to_string()),
            l.metadata.resource_version,
            l.metadata.annotations.unwrap_or_default()
        );
    }
}

/// Installs the generated CRDs from `deploy/crds/` and waits until they are Established.
pub async fn install_crds(client: &kube::Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/crds");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("deploy/crds") {
        let path = entry.expect("dir entry").path();
        let text = std::fs::read_to_string(&path).expect("read CRD");
        let crd: CustomResourceDefinition = serde_json::from_value(yaml(&text)).expect("CRD yaml");
        names.push(crd.metadata.name.clone().expect("CRD name"));
        crds.create(&PostParams::default(), &crd).await.unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    }
    for name in names {
        wait_for(&format!("CRD {name} Established"), WAIT, || {
            let crds = crds.clone();
            let name = name.clone();
            async move {
                let crd = crds.get(&name).await.ok()?;
                let ok = crd.status?.conditions?.iter().any(|c| c.type_ == "Established" && c.status == "True");
                ok.then_some(())
            }
        })
        .await;
    }
}

pub async fn namespace(client: &kube::Client, name: &str, labels: serde_json::Value) {
    let api: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    api.create(&PostParams::default(), &ns).await.expect("create namespace");
}

pub async fn node(client: &kube::Client, name: &str, labels: serde_json::Value) {
    let api: Api<Node> = Api::all(client.clone());
    let n: Node = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap();
    api.create(&PostParams::default(), &n).await.expect("create node");
}

/// A Pod with its IP patched in (no kubelet runs).
pub async fn pod(client: &kube::Client, ns: &str, name: &str, labels: serde_json::Value, ip: &str) {
    pod_on(client, ns, name, labels, &[ip], None).await;
}

/// [`pod`] with addresses `ips` (the first is `podIP`), scheduled to
/// `node` (`spec.nodeName`) when given.
pub async fn pod_on(
    client: &kube::Client,
    ns: &str,
    name: &str,
    labels: serde_json::Value,
    ips: &[&str],
    node: Option<&str>,
) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let mut spec = json!({"containers": [{"name": "app", "image": "example.invalid/app:1"}]});
    if let Some(n) = node {
        spec["nodeName"] = json!(n);
    }
    let p: Pod = serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}, "spec": spec})).unwrap();
    api.create(&PostParams::default(), &p).await.expect("create pod");
    let podips: Vec<serde_json::Value> = ips.iter().map(|ip| json!({"ip": ip})).collect();
    let status = json!({"status": {"phase": "Running", "podIP": ips[0], "podIPs": podips}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("patch pod status");
}

/// An annotated LoadBalancer Service with its ingress IP patched in.
pub async fn lb_service(
    client: &kube::Client,
    ns: &str,
    name: &str,
    selector: serde_json::Value,
    ports: &[u16],
    vip: &str,
) {
    let api: Api<Service> = Api::namespaced(client.clone(), ns);
    let ports: Vec<serde_json::Value> =
        ports.iter().map(|p| json!({"name": format!("p{p}"), "port": p, "protocol": "TCP"})).collect();
    let s: Service = serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"egret.dev/egress": "true"}},
        "spec": {"type": "LoadBalancer", "selector": selector, "ports": ports}
    }))
    .unwrap();
    api.create(&PostParams::default(), &s).await.expect("create service");
    let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": vip}]}}});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.expect("patch service status");
}

/// A gateway control plane running as a task.
pub struct Gateway {
    pub name: String,
    pub sink: Arc<FakeSink>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

/// The defaults for gateway `name`, with the ownership design that
/// `EGRET_OWNERSHIP` names (`perIP` or `liveness`; unset, the default:
/// liveness, ADR 0016), as the labs that start the binary take it
/// (`egret_tests::gateway`).
pub fn options(name: &str) -> K8sOptions {
    let mut opts = K8sOptions::new(name);
    match std::env::var("EGRET_OWNERSHIP").as_deref() {
        Err(_) => {}
        Ok("perIP") => opts.liveness = false,
        Ok("liveness") => opts.liveness = true,
        Ok(other) => panic!("EGRET_OWNERSHIP={other:?} is neither perIP nor liveness"),
    }
    opts
}

impl Gateway {
    pub fn start(client: kube::Client, name: &str, lease_ns: &str) -> Gateway {
        let mut opts = options(name);
        opts.lease_namespace = lease_ns.into();
        Gateway::start_with(client, opts)
    }

    /// A gateway with these options (its name is `opts.node_name`).
    pub fn start_with(client: kube::Client, opts: K8sOptions) -> Gateway {
        Gateway::start_with_sink(client, opts, FakeSink::default())
    }

    /// A gateway with these options and this sink (a session store, say).
    pub fn start_with_sink(client: kube::Client, opts: K8sOptions, sink: FakeSink) -> Gateway {
        let sink = Arc::new(sink);
        let name = opts.node_name.clone();
        let (tx, rx) = oneshot::channel::<()>();
        let s: Arc<dyn TablesSink> = sink.clone();
        let task = tokio::spawn(async move {
            let shutdown = async move {
                let _ = rx.await;
            };
            run(client, opts, s, shutdown).await.expect("control plane");
        });
        Gateway { name, sink, stop: Some(tx), task: Some(task) }
    }

    /// Crash: the task is dropped where it stands (no release).
    pub fn kill(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }

    /// Graceful stop: fences and releases its Leases.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(WAIT, t).await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A TCP proxy in front of the API server; `cut` severs every connection
/// and refuses new ones; `stall` freezes every connection open at the time
/// (below).
pub struct Proxy {
    pub port: u16,
    accept: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// Connections accepted before the last `stall` are stalled.
    stalls: Arc<std::sync::atomic::AtomicU64>,
}

impl Proxy {
    pub async fn start(upstream: std::net::SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy addr").port();
        let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let stalls: Arc<std::sync::atomic::AtomicU64> = Arc::default();
        let (c2, s2) = (conns.clone(), stalls.clone());
        let accept = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let stalls = s2.clone();
                let h = tokio::spawn(async move {
                    if let Ok(out) = tokio::net::TcpStream::connect(upstream).await {
                        pump(inbound, out, stalls).await;
                    }
                });
                c2.lock().unwrap().push(h);
            }
        });
        Proxy { port, accept, conns, stalls }
    }

    pub fn cut(&self) {
        self.accept.abort();
        for h in self.conns.lock().unwrap().drain(..) {
            h.abort();
        }
    }

    /// Every connection open now stops carrying the server's data while
    /// staying open (a watch goes silent, as after a partition while the
    /// server's retransmissions back off), and is closed if the client
    /// sends on it (a pooled connection reused for a request fails at once,
    /// as a request on a fresh connection would not). New connections are
    /// carried as before.
    pub fn stall(&self) {
        self.stalls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Carries bytes both ways until either side closes, stalling once
/// `stalls` moves past its value at the start ([`Proxy::stall`]).
async fn pump(
    mut inbound: tokio::net::TcpStream,
    mut out: tokio::net::TcpStream,
    stalls: Arc<std::sync::atomic::AtomicU64>,
) {
    use std::sync::atomic::Ordering::SeqCst;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let born = stalls.load(SeqCst);
    let stalled = || stalls.load(SeqCst) > born;
    let (mut ir, mut iw) = inbound.split();
    let (mut or, mut ow) = out.split();
    let (mut up, mut down) = (vec![0u8; 16384], vec![0u8; 16384]);
    let mut holding = false;
    loop {
        tokio::select! {
            n = ir.read(&mut up) => match n {
                Ok(n) if n > 0 && !stalled() => {
                    if ow.write_all(&up[..n]).await.is_err() {
                        return;
                    }
                }
                _ => return,
            },
            n = or.read(&mut down), if !holding => match n {
                Ok(n) if n > 0 => {
                    if stalled() {
                        holding = true;
                    } else if iw.write_all(&down[..n]).await.is_err() {
                        return;
                    }
                }
                _ => return,
            },
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
}

/// A client that reaches the API server through `proxy_port` instead.
pub async fn client_via(kubeconfig: &std::path::Path, proxy_port: u16) -> (kube::Client, std::net::SocketAddr) {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let mut cfg =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await.expect("config");
    let host = cfg.cluster_url.host().expect("host").to_string();
    let port = cfg.cluster_url.port_u16().expect("port");
    let upstream: std::net::SocketAddr = format!("{host}:{port}").parse().expect("upstream address");
    cfg.cluster_url = format!("https://{host}:{proxy_port}").parse().expect("proxy url");
    (kube::Client::try_from(cfg).expect("client"), upstream)
}

/// The API server's address from a kubeconfig.
pub async fn upstream(kubeconfig: &std::path::Path) -> std::net::SocketAddr {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let cfg =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await.expect("config");
    let host = cfg.cluster_url.host().expect("host").to_string();
    let port = cfg.cluster_url.port_u16().expect("port");
    format!("{host}:{port}").parse().expect("upstream address")
}

/// The harness's kubectl, if it was built.
pub fn kubectl() -> Option<std::path::PathBuf> {
    let p = std::path::PathBuf::from(std::env::var("EGRET_CACHE").unwrap_or_else(|_| "/var/cache/egret".into()))
        .join("kube-apiserver-1.20.2/kubectl");
    p.exists().then_some(p)
}

/// How Kubernetes' clients read YAML: kubectl and Helm parse it with
/// sigs.k8s.io/yaml (go-yaml v2, YAML 1.1), where a plain `yes`, `on` or
/// `y` is a boolean and a leading 0 makes an octal number (`0400` is 256).
/// serde-saphyr's defaults take the 1.1 booleans; the octal is asked for.
pub fn yaml_options() -> serde_saphyr::Options {
    serde_saphyr::options! { legacy_octal_numbers: true }
}

/// One YAML document as the JSON value the API server would receive.
pub fn yaml(text: &str) -> serde_json::Value {
    serde_saphyr::from_str_with_options(text, yaml_options()).unwrap_or_else(|e| panic!("{e}:\n{text}"))
}

/// Every document of a YAML stream (`---`-separated), empty ones (only
/// comments, or nothing) left out, as JSON values.
pub fn yaml_documents(text: &str) -> Vec<serde_json::Value> {
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple_with_options(text, yaml_options()).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

/// The YAML documents of a manifest file as dynamic objects.
pub fn documents(text: &str) -> Vec<kube::api::DynamicObject> {
    yaml_documents(text)
        .into_iter()
        .map(|d| serde_json::from_value::<kube::api::DynamicObject>(d.clone()).unwrap_or_else(|e| panic!("{e}:\n{d}")))
        .collect()
}

/// Server-side applies `obj` (for real, or as a dry run).
pub async fn apply_object(
    client: &kube::Client,
    discovery: &kube::discovery::Discovery,
    source: &str,
    obj: &kube::api::DynamicObject,
    dry_run: bool,
) {
    use kube::discovery::Scope;
    let types = obj.types.as_ref().unwrap_or_else(|| panic!("{source}: object without apiVersion/kind"));
    let gvk = kube::core::GroupVersionKind::try_from(types).unwrap();
    let (ar, caps) = discovery.resolve_gvk(&gvk).unwrap_or_else(|| panic!("{source}: unknown kind {gvk:?}"));
    let name = obj.metadata.name.clone().unwrap_or_else(|| panic!("{source}: no name"));
    let api: Api<kube::api::DynamicObject> = match caps.scope {
        Scope::Namespaced => {
            let ns = obj.metadata.namespace.clone().unwrap_or_else(|| panic!("{source}: {name} has no namespace"));
            Api::namespaced_with(client.clone(), &ns, &ar)
        }
        Scope::Cluster => Api::all_with(client.clone(), &ar),
    };
    let mut pp = PatchParams::apply("egret-manifest-test");
    if dry_run {
        pp = pp.dry_run();
    }
    api.patch(&name, &pp, &Patch::Apply(obj)).await.unwrap_or_else(|e| panic!("{source}: {} {name}: {e}", gvk.kind));
}

/// Applies `deploy/manifests/10-rbac.yaml` for real and returns a client
/// that authenticates as its ServiceAccount (a token from the TokenRequest
/// API), so the control plane runs with exactly the deployed privileges.
pub async fn gateway_service_account_client(admin: &kube::Client, kubeconfig: &std::path::Path) -> kube::Client {
    let discovery = kube::discovery::Discovery::new(admin.clone()).run().await.expect("discovery");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/manifests/10-rbac.yaml");
    for obj in documents(&std::fs::read_to_string(&path).expect("rbac manifest")) {
        apply_object(admin, &discovery, "10-rbac.yaml", &obj, false).await;
    }
    let token = service_account_token(admin, "egret-gateway").await;
    let kc = kube::config::Kubeconfig::read_from(kubeconfig).expect("kubeconfig");
    let mut cfg =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default()).await.expect("config");
    cfg.auth_info = serde_json::from_value(json!({"token": token})).expect("auth info");
    kube::Client::try_from(cfg).expect("service account client")
}

/// A token of ServiceAccount `egret-system/<name>` (TokenRequest API).
pub async fn service_account_token(client: &kube::Client, name: &str) -> String {
    service_account_token_for(client, name, &[]).await
}

/// [`service_account_token`] for `audiences` (what a projected token volume
/// asks for: AKS's workload identity projects one for
/// `api://AzureADTokenExchange`).
pub async fn service_account_token_for(client: &kube::Client, name: &str, audiences: &[&str]) -> String {
    use k8s_openapi::api::authentication::v1::TokenRequest;
    use k8s_openapi::api::core::v1::ServiceAccount;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "egret-system");
    let req =
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"audiences": audiences}});
    let tr: TokenRequest =
        sas.create_subresource("token", name, &PostParams::default(), &req).await.expect("token request");
    tr.status.expect("token status").token.expect("token")
}

/// A kubeconfig for `user`: the admin kubeconfig's API server and CA with
/// `token` (the deployed privileges, no more).
pub fn write_token_kubeconfig(admin: &std::path::Path, user: &str, token: &str, out: &std::path::Path) {
    let text = std::fs::read_to_string(admin).expect("admin kubeconfig");
    let v = yaml(&text);
    let cluster = &v["clusters"][0]["cluster"];
    let server = cluster["server"].as_str().expect("server");
    let ca = cluster["certificate-authority-data"].as_str().expect("CA data");
    let kc = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: {server}\n    certificate-authority-data: {ca}\n\
         users:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: {user}\n\
         current-context: lab\n"
    );
    std::fs::write(out, kc).expect("write the kubeconfig");
}

/// The holder of `ip`'s Lease in `egret-system`, waiting up to 10 s for one.
pub async fn lease_holder_name(client: &kube::Client, ip: std::net::IpAddr) -> Option<String> {
    use k8s_openapi::api::coordination::v1::Lease;
    let api: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
    let name = egret_controlplane::k8s::lease::lease_name(ip);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(l) = api.get(&name).await {
            if let Some(h) = l.spec.and_then(|s| s.holder_identity).filter(|h| !h.is_empty()) {
                return Some(h);
            }
        }
        if tokio::time::Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The cluster of the control-plane HA tests: the CRDs, namespaces
/// `egret-system` and `team-a` (label team=a), one gateway Node per
/// (name, channel address) with its `egret.dev/ha-address`, and pod `web-1`
/// (198.18.0.11) in team-a.
pub async fn ha_cluster(client: &kube::Client, gateways: &[(&str, IpAddr)]) {
    install_crds(client).await;
    namespace(client, "egret-system", json!({})).await;
    namespace(client, "team-a", json!({"team": "a"})).await;
    let nodes: Api<Node> = Api::all(client.clone());
    for (name, addr) in gateways {
        let obj: Node = serde_json::from_value(json!({"metadata": {
            "name": name, "labels": {"egret.dev/gateway": "true"},
            "annotations": {"egret.dev/ha-address": addr.to_string()}}}))
        .unwrap();
        nodes.create(&PostParams::default(), &obj).await.expect("node");
    }
    pod(client, "team-a", "web-1", json!({"app": "web"}), "198.18.0.11").await;
}

/// The Lease of `ip` as the API server has it now: holder, acquireTime,
/// renewTime, leaseDurationSeconds.
pub async fn lease_spec(
    client: &kube::Client,
    ip: std::net::IpAddr,
) -> Option<k8s_openapi::api::coordination::v1::LeaseSpec> {
    use k8s_openapi::api::coordination::v1::Lease;
    let api: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
    api.get(&egret_controlplane::k8s::lease::lease_name(ip)).await.ok().and_then(|l| l.spec)
}

/// What keeps a holder's claim on an IP alive, read before an event: the
/// last renewal seen and the lease duration, in milliseconds. A take-over
/// acquired before `renewed_ms + duration_ms` could not have waited for an
/// expiry (the holder's last renewal is no earlier than the one seen), so
/// it took a release or a proof of death.
#[derive(Clone, Debug)]
pub struct Lapse {
    pub holder: String,
    pub renewed_ms: i64,
    pub duration_ms: i64,
    /// Read from the holder's liveness Lease (the IP's record lasts for ever).
    pub liveness: bool,
}

/// The [`Lapse`] of `ip`'s holder: the IP's own Lease under per-IP Leases;
/// under liveness Leases, whose per-IP records carry
/// `RECORD_DURATION_SECS` (i32::MAX), the holder's liveness Lease, since a
/// comparison with the record's duration could never fail. None when a
/// Lease cannot be read or names nobody.
pub async fn holder_lapse(client: &kube::Client, ip: std::net::IpAddr) -> Option<Lapse> {
    use egret_controlplane::k8s::liveness::{liveness_lease_name, RECORD_DURATION_SECS};
    use k8s_openapi::api::coordination::v1::Lease;
    let record = lease_spec(client, ip).await?;
    let holder = record.holder_identity.clone().filter(|h| !h.is_empty())?;
    let liveness = record.lease_duration_seconds == Some(RECORD_DURATION_SECS);
    let spec = if liveness {
        let api: Api<Lease> = Api::namespaced(client.clone(), "egret-system");
        api.get(&liveness_lease_name(&holder)).await.ok()?.spec?
    } else {
        record
    };
    Some(Lapse {
        holder,
        renewed_ms: spec.renew_time?.0.as_millisecond(),
        duration_ms: i64::from(spec.lease_duration_seconds?) * 1000,
        liveness,
    })
}

/// 32 random bytes: a channel key.
pub fn random_ha_key() -> [u8; 32] {
    use std::io::Read;
    let mut key = [0u8; 32];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut key)).expect("random key");
    key
}

/// 32 random bytes, mode 0600: the gateways' shared channel key.
pub fn write_ha_key(path: &std::path::Path) {
    write_ha_key_bytes(path, &random_ha_key());
}

/// `key`, mode 0600, at `path`.
pub fn write_ha_key_bytes(path: &std::path::Path, key: &[u8]) {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)
        .expect("create the HA key file");
    std::io::Write::write_all(&mut f, key).expect("write the HA key");
}

/// Gateway `g`'s `kubernetes.ha` line in a lab: the channel on its
/// management address, the shared key, the keys a roll adds (`next` and
/// `previous` beside it, as the chart has them), a peer cache in the lab's
/// directory.
pub fn ha_section(
    lab: &egret_tests::k8slab::K8sLab,
    g: egret_tests::k8slab::Gw,
    key: &std::path::Path,
    port: u16,
) -> String {
    format!(
        "  ha: {{port: {port}, address: {}, keyFile: {}, acceptKeyFiles: [{}, {}], peerCache: {}}}\n",
        g.mgmt_addr(),
        key.display(),
        key.with_file_name("next").display(),
        key.with_file_name("previous").display(),
        lab.dir().join(format!("peers-{}", g.node_name())).display()
    )
}

/// Egret's CRDs, and the deployed namespace and RBAC (`deploy/manifests`
/// 00 and 10), as an operator installs them.
/// The HA labs' cluster (k8s_ha, k8s_ha_translog): CRDs and RBAC, the
/// three gateway Nodes with their channel addresses (there is no kubelet
/// to fill in a Node's InternalIP), the lab's Pods in `team-a`, and the
/// EgressPolicy for `db` on `eip`. Returns a token of the gateways'
/// ServiceAccount.
pub async fn ha_lab_cluster(client: &kube::Client, eip: std::net::Ipv4Addr) -> String {
    use egret_tests::k8slab::{Gw, KPod};
    install_egret(client).await;
    namespace(client, "team-a", json!({"team": "a"})).await;
    for g in Gw::ALL {
        let nodes: Api<Node> = Api::all(client.clone());
        let n: Node = serde_json::from_value(json!({"metadata": {
            "name": g.node_name(), "labels": {"egret.dev/gateway": "true"},
            "annotations": {"egret.dev/ha-address": g.mgmt_addr().to_string()}}}))
        .unwrap();
        nodes.create(&PostParams::default(), &n).await.expect("create node");
    }
    for p in KPod::ALL {
        pod(client, "team-a", &format!("{}-1", p.name()), json!({"app": p.name()}), &p.addr().to_string()).await;
    }
    db_policy(client, eip).await;
    service_account_token(client, "egret-gateway").await
}

pub async fn install_egret(client: &kube::Client) {
    install_egret_manifests(client, &["00-namespace.yaml", "10-rbac.yaml"]).await;
}

/// [`install_egret`] and the worker-node agent's RBAC (`40-node-rbac.yaml`).
pub async fn install_egret_with_node_rbac(client: &kube::Client) {
    install_egret_manifests(client, &["00-namespace.yaml", "10-rbac.yaml", "40-node-rbac.yaml"]).await;
}

/// Egret's CRDs and the `deploy/manifests` files named, in order.
async fn install_egret_manifests(client: &kube::Client, files: &[&str]) {
    install_crds(client).await;
    let discovery = kube::discovery::Discovery::new(client.clone()).run().await.expect("discovery");
    let manifests = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/manifests");
    for file in files {
        let text = std::fs::read_to_string(manifests.join(file)).expect("manifest");
        for obj in documents(&text) {
            apply_object(client, &discovery, file, &obj, false).await;
        }
    }
}

// ------------------------------------------------- the worker-node lab ---

/// The worker-node lab's cluster objects: Egret with the agent's RBAC
/// ([`install_egret_with_node_rbac`]), namespace `ns` (`team=a`), the
/// gateway Nodes (`egret.dev/gateway`), each worker Node with its IPv4 pod
/// CIDR and on it the pods `<node>-sel` (`.10`) and `<node>-uns` (`.12`)
/// with both addresses, labelled `app=<app(pod name)>`. Returns the pods'
/// names.
pub async fn node_lab_cluster(client: &kube::Client, ns: &str, app: impl Fn(&str) -> &'static str) -> Vec<String> {
    use egret_tests::nodelab::{NodeGw, Worker};
    install_egret_with_node_rbac(client).await;
    namespace(client, ns, json!({"team": "a"})).await;
    for g in NodeGw::ALL {
        node(client, g.node_name(), json!({"egret.dev/gateway": "true"})).await;
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let mut pods = Vec::new();
    for w in Worker::ALL {
        let n = serde_json::from_value(json!({
            "metadata": {"name": w.node_name()},
            "spec": {"podCIDR": w.pod_cidr(), "podCIDRs": [w.pod_cidr()]}
        }))
        .unwrap();
        nodes.create(&PostParams::default(), &n).await.expect("worker node");
        for (suffix, host) in [("sel", 10), ("uns", 12)] {
            let name = format!("{}-{suffix}", w.node_name());
            let (ip, ip6) = (w.pod_addr(host).to_string(), w.pod_addr6(host).to_string());
            pod_on(client, ns, &name, json!({"app": app(&name)}), &[&ip, &ip6], Some(w.node_name())).await;
            pods.push(name);
        }
    }
    pods
}

/// Kubeconfigs for Egret's two ServiceAccounts in the directory `dir`, with
/// tokens from the TokenRequest API and the admin kubeconfig's server and
/// CA: (`gateway.kubeconfig` as `egret-gateway`, `node.kubeconfig` as
/// `egret-node`).
pub async fn egret_kubeconfigs(
    client: &kube::Client,
    admin: &std::path::Path,
    dir: &std::path::Path,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let gw_kc = dir.join("gateway.kubeconfig");
    let node_kc = dir.join("node.kubeconfig");
    let token = service_account_token(client, "egret-gateway").await;
    write_token_kubeconfig(admin, "egret-gateway", &token, &gw_kc);
    let token = service_account_token(client, "egret-node").await;
    write_token_kubeconfig(admin, "egret-node", &token, &node_kc);
    (gw_kc, node_kc)
}

/// Both gateways of the worker-node lab, `egret gateway` in Kubernetes mode
/// on `lan0` with the cluster's pod CIDRs, ready.
pub fn start_node_lab_gateways(
    lab: &egret_tests::nodelab::NodeLab,
    kubeconfig: &std::path::Path,
) -> std::collections::BTreeMap<egret_tests::nodelab::NodeGw, egret_tests::gateway::Gateway> {
    start_node_lab_gateways_with(lab, kubeconfig, |_| {})
}

/// [`start_node_lab_gateways`], each configuration changed by `tune` first.
pub fn start_node_lab_gateways_with(
    lab: &egret_tests::nodelab::NodeLab,
    kubeconfig: &std::path::Path,
    tune: impl Fn(&mut egret_tests::gateway::GatewayConfig),
) -> std::collections::BTreeMap<egret_tests::nodelab::NodeGw, egret_tests::gateway::Gateway> {
    use egret_tests::gateway::{Gateway, GatewayConfig, KubernetesSection};
    use egret_tests::nodelab::{NodeGw, CLUSTER_POD_CIDR, CLUSTER_POD_CIDR6};
    let mut gws = std::collections::BTreeMap::new();
    for g in NodeGw::ALL {
        let mut cfg = GatewayConfig::kubernetes(
            &[("lan0", "both")],
            KubernetesSection {
                node_name: g.node_name().into(),
                kubeconfig: kubeconfig.to_path_buf(),
                timing: None,
                // A pod the agent steers before this gateway knows it is
                // dropped here, never forwarded with its own address.
                cluster_pod_cidrs: vec![CLUSTER_POD_CIDR.into(), CLUSTER_POD_CIDR6.into()],
                extra: String::new(),
            },
        );
        tune(&mut cfg);
        gws.insert(g, Gateway::spawn_in(lab.gateway_ns(g), lab.dir(), g.node_name(), &cfg).expect("start egret"));
    }
    for gw in gws.values_mut() {
        gw.wait_ready(Duration::from_secs(60)).expect("egret gateway ready");
    }
    gws
}

/// `egret node` on worker `w` with `extra` flags, synced.
pub fn start_synced_agent(
    lab: &egret_tests::nodelab::NodeLab,
    w: egret_tests::nodelab::Worker,
    kubeconfig: &std::path::Path,
    extra: &[&str],
) -> egret_tests::nodelab::Agent {
    let a = lab.start_agent(w, kubeconfig, extra).expect("start egret node");
    a.wait_synced(0, Duration::from_secs(30)).expect("egret node synced");
    a
}

/// The worker-node lab's cluster pod CIDRs, both families.
pub fn lab_pod_cidrs() -> [ipnet::IpNet; 2] {
    use egret_tests::nodelab::{CLUSTER_POD_CIDR, CLUSTER_POD_CIDR6};
    [CLUSTER_POD_CIDR.parse().unwrap(), CLUSTER_POD_CIDR6.parse().unwrap()]
}

/// The frames of `frames` whose IP source is a pod's (the worker-node
/// lab's cluster pod CIDRs, either family), as `src -> dst proto P`.
pub fn pod_sourced(frames: &[egret_tests::capture::Frame]) -> Vec<String> {
    let pods = lab_pod_cidrs();
    frames
        .iter()
        .filter_map(|f| egret_tests::capture::ip_info(&f.data))
        .filter(|i| pods.iter().any(|p| p.contains(&i.src)))
        .map(|i| format!("{} -> {} proto {}", i.src, i.dst, i.proto))
        .collect()
}

/// No frame of `frames` (the upstream link's) and no connection at the
/// worker-node lab's server had a pod's address (either family).
pub fn assert_no_pod_address_left(lab: &egret_tests::nodelab::NodeLab, frames: &[egret_tests::capture::Frame]) {
    let leaked = pod_sourced(frames);
    let pods = lab_pod_cidrs();
    assert!(
        leaked.is_empty(),
        "{} frames on the upstream link had a pod's address: {:?}",
        leaked.len(),
        &leaked[..leaked.len().min(5)]
    );
    let seen: Vec<String> = lab
        .server()
        .map(|s| s.seen())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| pods.iter().any(|p| p.contains(&s.src.ip())))
        .map(|s| s.to_string())
        .collect();
    assert!(seen.is_empty(), "the server saw pod addresses: {seen:?}");
}

/// A DaemonSet `name` in `egret-system` selecting Nodes by `node_selector`,
/// and its Pods (`<name>-<node>`) on `nodes`, as the DaemonSet controller
/// would make them (there is no controller manager in these labs: the
/// objects are written directly). A Pod of that name left from an earlier
/// DaemonSet is replaced. Returns the DaemonSet's uid. The processes the
/// test runs as these Pods get `POD_NAME`/`POD_NAMESPACE` (or `--pod-name`)
/// from [`daemonset_pod_name`].
pub async fn daemonset_with_pods(
    client: &kube::Client,
    name: &str,
    node_selector: serde_json::Value,
    nodes: &[&str],
) -> String {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use kube::api::DeleteParams;
    let ns = "egret-system";
    let dss: Api<DaemonSet> = Api::namespaced(client.clone(), ns);
    let ds: DaemonSet = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "nodeSelector": node_selector,
                "containers": [{"name": "egret", "image": "egret:lab"}]}}}
    }))
    .unwrap();
    let uid = dss.create(&PostParams::default(), &ds).await.expect("create the DaemonSet").metadata.uid.unwrap();
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    for node in nodes {
        let pod_name = daemonset_pod_name(name, node);
        let _ = pods.delete(&pod_name, &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await;
        for _ in 0..50 {
            if pods.get_opt(&pod_name).await.unwrap().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": pod_name, "labels": {"app": name}, "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": uid,
                "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"nodeName": node, "containers": [{"name": "egret", "image": "egret:lab"}]}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.expect("create the DaemonSet's Pod");
    }
    uid
}

/// The name [`daemonset_with_pods`] gives the Pod of DaemonSet `ds` on `node`.
pub fn daemonset_pod_name(ds: &str, node: &str) -> String {
    format!("{ds}-{node}")
}

/// Deletes DaemonSet `name` in `egret-system` as `helm uninstall` and
/// `kubectl delete -f` do (background propagation).
pub async fn delete_daemonset(client: &kube::Client, name: &str) {
    let dss: Api<k8s_openapi::api::apps::v1::DaemonSet> = Api::namespaced(client.clone(), "egret-system");
    dss.delete(name, &kube::api::DeleteParams::background()).await.expect("delete the DaemonSet");
}
