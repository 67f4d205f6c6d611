//! Egret's alert rules and Grafana dashboard (the chart's
//! `deploy/helm/egret/files/`) against a real Prometheus (Debian's
//! `prometheus`) scraping real gateways and node agents.
//!
//! `alert_rules_pass_promtool`: `promtool check rules` and `promtool test
//! rules` on the shipped files (each alert fires on its series in time and
//! stays quiet on healthy ones).
//!
//! `k8s_monitoring_...`: the worker-node lab (two gateways in Kubernetes
//! mode with the HA channel, two agents, a real kube-apiserver) with a
//! Prometheus in the control namespace. Prometheus finds every target
//! through the chart's discovery settings: the metrics Services of
//! `deploy/manifests/60-metrics.yaml` (their Endpoints written as the
//! endpoints controller would, the lab having none) and the scrape job of
//! `files/scrape-config.yaml`, whose relabelling it applies; it evaluates
//! `files/alerts.yaml` itself. Debian's Prometheus is built without
//! Kubernetes service discovery, so the job's `kubernetes_sd_configs` is
//! replaced by `file_sd` over what an emulator of that discovery
//! ([`kubernetes_sd_emulation`]) reads from the API server.
//! Then:
//! 1. every target is up under the jobs the rules name, Prometheus evaluates
//!    every shipped rule, and on the healthy lab no alert is active;
//! 2. the lab is driven into each condition the alerts are for, and
//!    Prometheus shows the alert active (pending or firing) with the labels
//!    that condition names: ports near exhaustion and exhausted (a 10-port
//!    range; then, with traffic through the gateway, every series
//!    `files/alerts_test.yaml` feeds promtool is checked to exist in the lab
//!    under the same name and label names, so the unit tests test the series
//!    Egret exports, and every query of `files/dashboard.json` to return
//!    data), an egress IP no gateway may hold (a policy whose
//!    `gatewaySelector` matches none), the node agents failing to steer
//!    pods (a policy whose IP is on no node's link),
//!    the failsafe (the API server refused to both gateways), a gateway
//!    down and its peer's channel down (SIGKILL).
//!
//! Skipped (with a message) when not root or the API server is not built;
//! `EGRET_REQUIRE_APISERVER=1` makes that a failure.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use egret_controlplane::k8s::crd::EgressPolicy;
use egret_tests::apiserver::ApiServer;
use egret_tests::gateway::{Gateway, GatewayConfig, KubernetesSection};
use egret_tests::nodelab::{Backend, NodeGw, NodeLab, Worker, CLUSTER_POD_CIDR, CLUSTER_POD_CIDR6, CONTROL};
use egret_tests::prometheus::{promtool, Prometheus};
use egret_tests::{probe, tools};
use k8s_common::*;
use k8s_openapi::api::core::v1::Endpoints;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};

const NAME: &str = "k8s_monitoring_alerts_and_dashboard_on_a_real_prometheus";
/// The `db` policy's egress IP (on the gateways' segment).
const EIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// An egress IP on no node's link: the agents cannot route to it.
const UNREACHABLE: &str = "198.51.100.200";
/// An egress IP whose policy selects no gateway.
const NO_GATEWAY: &str = "203.0.113.41";
/// The NAT port range: 10 ports, so a few connections near exhaustion (and
/// no per-pod cap below it: `maxPortsPerSource` above the range).
const PORTS: (u16, u16) = (40000, 40009);
const GATEWAY_METRICS_PORT: u16 = 9469;
const NODE_METRICS_PORT: u16 = 9465;
const CHANNEL_PORT: u16 = 4720;
/// Prometheus' API, on the control namespace's loopback.
const PROMETHEUS: &str = "127.0.0.1:19090";
/// How long an alert may take to become active once its condition holds:
/// a scrape (1 s), a rule evaluation (1 s), the agents' and gateways' own
/// passes, on a busy two-core machine.
const ALERT_WAIT: Duration = Duration::from_secs(60);

fn files() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/helm/egret/files")
}

#[test]
fn alert_rules_pass_promtool() {
    if let Err(e) = tools::require("promtool") {
        panic!("{e}");
    }
    let dir = files();
    let out =
        promtool(&["check", "rules", dir.join("alerts.yaml").to_str().unwrap()]).unwrap_or_else(|e| panic!("{e}"));
    println!("{out}");
    let out =
        promtool(&["test", "rules", dir.join("alerts_test.yaml").to_str().unwrap()]).unwrap_or_else(|e| panic!("{e}"));
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert of the rules has a unit test that expects it to fire.
    let tested: BTreeSet<String> = expected_alerts(&std::fs::read_to_string(dir.join("alerts_test.yaml")).unwrap());
    let defined = alert_names(&std::fs::read_to_string(dir.join("alerts.yaml")).unwrap());
    assert_eq!(defined, tested, "alerts.yaml's alerts and those alerts_test.yaml expects to fire");
}

#[test]
fn k8s_monitoring_alerts_and_dashboard_on_a_real_prometheus() {
    if let Err(e) = tools::require("prometheus") {
        panic!("{e}");
    }
    run_in_a_lab(
        "k8s-monitoring",
        NAME,
        || NodeLab::build_with(&NodeLab::test_prefix(), Backend::Native).expect("build the worker-node lab"),
        NodeLab::control,
        scenario,
    );
}

/// The alert names of a rules file (`- alert: X` lines).
fn alert_names(rules: &str) -> BTreeSet<String> {
    rules.lines().filter_map(|l| l.trim().strip_prefix("- alert: ")).map(|s| s.trim().to_string()).collect()
}

/// The alerts a promtool test file expects to fire (`alertname: X` followed
/// by `exp_alerts:`).
fn expected_alerts(tests: &str) -> BTreeSet<String> {
    let lines: Vec<&str> = tests.lines().collect();
    lines
        .windows(2)
        .filter(|w| w[1].trim() == "exp_alerts:")
        .filter_map(|w| w[0].trim().strip_prefix("alertname: "))
        .map(|s| s.trim().to_string())
        .collect()
}

/// The input series of a promtool test file: (metric name, label names).
fn input_series(tests: &str) -> BTreeSet<(String, BTreeSet<String>)> {
    tests
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- series: "))
        .map(|s| {
            let s = s.trim().trim_matches('\'');
            let (name, labels) = s.split_once('{').unwrap_or((s, "}"));
            let labels = labels.trim_end_matches('}');
            let names = labels
                .split(',')
                .filter(|kv| !kv.is_empty())
                .map(|kv| kv.split_once('=').unwrap_or_else(|| panic!("series {s}: label {kv}")).0.trim().to_string())
                .collect();
            (name.to_string(), names)
        })
        .collect()
}

/// Egret's CRDs, RBAC and namespace, the lab's Nodes and pods, the `db`
/// policy, and the metrics Services of `deploy/manifests/60-metrics.yaml`
/// with their Endpoints: each process's management address.
async fn setup_cluster(client: &kube::Client) {
    node_lab_cluster(client, "team-a", |pod| if pod.ends_with("-sel") { "db" } else { "other" }).await;
    db_policy(client, EIP).await;
    // The peer channel's address of each gateway (as the DaemonSet's
    // start-up annotates its Node).
    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(client.clone());
    for g in NodeGw::ALL {
        let patch = json!({"metadata": {"annotations": {"egret.dev/ha-address": g.mgmt_addr().to_string()}}});
        nodes
            .patch(g.node_name(), &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("annotate the gateway Node");
    }
    let discovery = kube::discovery::Discovery::new(client.clone()).run().await.expect("discovery");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/manifests/60-metrics.yaml");
    for obj in documents(&std::fs::read_to_string(&path).unwrap()) {
        apply_object(client, &discovery, "60-metrics.yaml", &obj, false).await;
    }
    let gateways: Vec<(&str, Ipv4Addr)> = NodeGw::ALL.iter().map(|g| (g.node_name(), g.mgmt_addr())).collect();
    let workers: Vec<(&str, Ipv4Addr)> = Worker::ALL.iter().map(|w| (w.node_name(), w.mgmt_addr())).collect();
    for (service, port, members) in
        [("egret-gateway-metrics", GATEWAY_METRICS_PORT, gateways), ("egret-node-metrics", NODE_METRICS_PORT, workers)]
    {
        let addresses: Vec<Value> =
            members.iter().map(|(node, ip)| json!({"ip": ip.to_string(), "nodeName": node})).collect();
        let ep: Endpoints = serde_json::from_value(json!({
            "metadata": {"name": service, "namespace": "egret-system"},
            "subsets": [{"addresses": addresses, "ports": [{"name": "metrics", "port": port, "protocol": "TCP"}]}]
        }))
        .unwrap();
        Api::<Endpoints>::namespaced(client.clone(), "egret-system")
            .create(&PostParams::default(), &ep)
            .await
            .expect("metrics Endpoints");
    }
}

/// Both gateways in Kubernetes mode with the HA channel and metrics on
/// their management addresses, and a 10-port NAT range.
fn start_gateways(lab: &NodeLab, kubeconfig: &Path, key: &Path) -> BTreeMap<NodeGw, Gateway> {
    let mut gws = BTreeMap::new();
    for g in NodeGw::ALL {
        let ha = format!(
            "  ha: {{port: {CHANNEL_PORT}, address: {}, keyFile: {}, peerCache: {}}}\n",
            g.mgmt_addr(),
            key.display(),
            lab.dir().join(format!("peers-{}", g.node_name())).display()
        );
        let mut cfg = GatewayConfig::kubernetes(
            &[("lan0", "both")],
            KubernetesSection {
                node_name: g.node_name().into(),
                kubeconfig: kubeconfig.to_path_buf(),
                timing: None,
                cluster_pod_cidrs: vec![CLUSTER_POD_CIDR.into(), CLUSTER_POD_CIDR6.into()],
                extra: ha,
            },
        );
        cfg.extra = format!("nat:\n  ports: {}-{}\n  maxPortsPerSource: 1000\n", PORTS.0, PORTS.1);
        let metrics = SocketAddr::new(IpAddr::V4(g.mgmt_addr()), GATEWAY_METRICS_PORT);
        let gw = Gateway::spawn_in_at(lab.gateway_ns(g), lab.dir(), g.node_name(), &cfg, metrics)
            .expect("start egret gateway");
        gws.insert(g, gw);
    }
    for gw in gws.values_mut() {
        gw.wait_ready(Duration::from_secs(30)).expect("egret gateway ready");
    }
    gws
}

/// Prometheus' configuration: 1 s scrapes and evaluations, the shipped
/// rules, and the shipped scrape job with its Kubernetes service discovery
/// replaced by `file_sd` over `targets` (Debian's Prometheus is built
/// without Kubernetes discovery: [`kubernetes_sd_emulation`] writes what it
/// would find). The job's relabelling is the shipped one, applied by the
/// real Prometheus.
fn prometheus_config(targets: &Path) -> String {
    let job = std::fs::read_to_string(files().join("scrape-config.yaml")).unwrap();
    let (start, end) = (job.find("  kubernetes_sd_configs:\n").unwrap(), job.find("  relabel_configs:\n").unwrap());
    assert!(job[start..end].contains("- role: endpoints\n"), "scrape-config.yaml's discovery: {}", &job[start..end]);
    let job = format!(
        "{}  file_sd_configs:\n    - files: [{}]\n      refresh_interval: 1s\n{}",
        &job[..start],
        targets.display(),
        &job[end..]
    );
    let job: String = job.lines().map(|l| format!("  {l}\n")).collect();
    format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n{job}",
        files().join("alerts.yaml").display()
    )
}

/// A Prometheus label name for a Kubernetes label (Prometheus'
/// `strutil.SanitizeLabelName`: anything but `[a-zA-Z0-9_]` becomes `_`).
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
}

/// An emulator of Prometheus' Kubernetes service discovery, `role:
/// endpoints`, for namespace `ns`: every port of every address of every
/// Endpoints object with a Service of its name, read from the real API
/// server, as a `file_sd` target group with the meta labels that discovery
/// sets (`__meta_kubernetes_namespace`, `_service_name`, `_service_label_*`,
/// `_service_labelpresent_*`, `_endpoints_name`, `_endpoint_port_name`,
/// `_endpoint_port_protocol`, `_endpoint_ready`, `_endpoint_node_name`;
/// Prometheus' `discovery/kubernetes/endpoints.go`). Pods are not read: the
/// shipped relabelling uses none of their labels.
async fn kubernetes_sd_emulation(client: &kube::Client, ns: &str) -> Value {
    use k8s_openapi::api::core::v1::Service;
    let services = Api::<Service>::namespaced(client.clone(), ns).list(&Default::default()).await.expect("Services");
    let endpoints =
        Api::<Endpoints>::namespaced(client.clone(), ns).list(&Default::default()).await.expect("Endpoints");
    let mut groups = Vec::new();
    for ep in &endpoints.items {
        let name = ep.metadata.name.clone().unwrap_or_default();
        let Some(svc) = services.items.iter().find(|s| s.metadata.name.as_deref() == Some(name.as_str())) else {
            continue;
        };
        let mut base = serde_json::Map::new();
        base.insert("__meta_kubernetes_namespace".into(), json!(ns));
        base.insert("__meta_kubernetes_endpoints_name".into(), json!(name));
        base.insert("__meta_kubernetes_service_name".into(), json!(name));
        for (k, v) in svc.metadata.labels.iter().flatten() {
            base.insert(format!("__meta_kubernetes_service_label_{}", sanitize(k)), json!(v));
            base.insert(format!("__meta_kubernetes_service_labelpresent_{}", sanitize(k)), json!("true"));
        }
        for subset in ep.subsets.iter().flatten() {
            for addr in subset.addresses.iter().flatten() {
                for port in subset.ports.iter().flatten() {
                    let mut labels = base.clone();
                    labels.insert(
                        "__meta_kubernetes_endpoint_port_name".into(),
                        json!(port.name.clone().unwrap_or_default()),
                    );
                    labels.insert(
                        "__meta_kubernetes_endpoint_port_protocol".into(),
                        json!(port.protocol.clone().unwrap_or_else(|| "TCP".into())),
                    );
                    labels.insert("__meta_kubernetes_endpoint_ready".into(), json!("true"));
                    if let Some(node) = &addr.node_name {
                        labels.insert("__meta_kubernetes_endpoint_node_name".into(), json!(node));
                    }
                    groups.push(json!({"targets": [format!("{}:{}", addr.ip, port.port)], "labels": labels}));
                }
            }
        }
    }
    Value::Array(groups)
}

/// Polls `f` every 500 ms until it returns `Some`, or panics after
/// `timeout` with `what` and the last state `f` left in `last`.
fn poll<T>(what: &str, timeout: Duration, mut f: impl FnMut(&mut String) -> Option<T>) -> T {
    let t = Instant::now();
    let mut last = String::new();
    loop {
        if let Some(v) = f(&mut last) {
            println!("k8s-monitoring: {what} after {} ms", t.elapsed().as_millis());
            return v;
        }
        assert!(t.elapsed() < timeout, "{what}: not within {timeout:?}; last: {last}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The active alerts named `name` (pending or firing).
fn active(prom: &Prometheus, name: &str) -> Vec<Value> {
    prom.alerts().unwrap().into_iter().filter(|a| a["labels"]["alertname"] == name).collect()
}

/// Waits until alert `name` is active with every label of `labels`.
fn wait_alert(prom: &Prometheus, name: &str, labels: &[(&str, &str)]) -> Value {
    poll(&format!("alert {name} {labels:?} active"), ALERT_WAIT, |last| {
        let all = active(prom, name);
        *last = format!("{all:?}");
        all.into_iter().find(|a| labels.iter().all(|(k, v)| a["labels"][*k] == *v))
    })
}

fn instance(addr: Ipv4Addr, port: u16) -> String {
    format!("{addr}:{port}")
}

fn scenario(lab: &NodeLab, server: &ApiServer) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    rt.block_on(setup_cluster(&client));
    let (gw_kc, node_kc) = rt.block_on(egret_kubeconfigs(&client, server.kubeconfig_path(), lab.dir()));
    let key = lab.dir().join("ha.key");
    write_ha_key(&key);
    let mut gws = start_gateways(lab, &gw_kc, &key);
    let mut agents = BTreeMap::new();
    for w in Worker::ALL {
        let listen = format!("{}:{NODE_METRICS_PORT}", w.mgmt_addr());
        agents.insert(w, start_synced_agent(lab, w, &node_kc, &["--metrics-listen", &listen]));
    }
    let targets = lab.dir().join("egret-targets.json");
    let groups = rt.block_on(kubernetes_sd_emulation(&client, "egret-system"));
    std::fs::write(&targets, serde_json::to_string_pretty(&groups).unwrap()).unwrap();
    let prom = Prometheus::start(lab.dir(), &prometheus_config(&targets), PROMETHEUS.parse().unwrap())
        .expect("start prometheus");

    discovered(&prom);
    let holder = healthy(&prom, &rt, &client);
    ports(lab, &prom, holder);
    series_of_the_unit_tests(&prom);
    dashboard_queries(&prom);
    unreachable_ip(&prom, &rt, &client);
    failsafe(lab, &prom);
    gateway_down(&prom, &mut gws, holder);
    drop(prom);
    drop(agents);
}

/// Every gateway and agent is a target, found through the Services, under
/// the jobs the rules name, and up.
fn discovered(prom: &Prometheus) {
    let mut want: BTreeSet<(String, String)> = NodeGw::ALL
        .iter()
        .map(|g| ("egret-gateway".to_string(), instance(g.mgmt_addr(), GATEWAY_METRICS_PORT)))
        .collect();
    want.extend(Worker::ALL.iter().map(|w| ("egret-node".to_string(), instance(w.mgmt_addr(), NODE_METRICS_PORT))));
    poll("every gateway and agent scraped through the metrics Services", ALERT_WAIT, |last| {
        let targets = prom.targets().unwrap();
        let up: BTreeSet<(String, String)> = targets
            .iter()
            .filter(|t| t["health"] == "up")
            .map(|t| {
                (
                    t["labels"]["job"].as_str().unwrap_or_default().to_string(),
                    t["labels"]["instance"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        *last = format!("{targets:?}");
        (up == want).then_some(())
    });
    // The relabelling named each target's Node.
    let nodes: BTreeSet<String> =
        prom.query("up").unwrap().iter().filter_map(|s| s["metric"]["node"].as_str().map(str::to_string)).collect();
    let want_nodes: BTreeSet<String> = NodeGw::ALL
        .iter()
        .map(|g| g.node_name().to_string())
        .chain(Worker::ALL.iter().map(|w| w.node_name().to_string()))
        .collect();
    assert_eq!(nodes, want_nodes, "the node label of the targets");
}

/// Waits until the egress IP has a holder, its standby a copy and the
/// agents steer; then no alert is active. Returns the holder.
fn healthy(prom: &Prometheus, rt: &tokio::runtime::Runtime, client: &kube::Client) -> NodeGw {
    let holder = poll("the egress IP held", ALERT_WAIT, |_| {
        rt.block_on(lease_holder_name(client, IpAddr::V4(EIP))).and_then(|h| NodeGw::by_node_name(&h))
    });
    let eip = EIP.to_string();
    poll("the holder's standby in sync, in Prometheus", ALERT_WAIT, |last| {
        let r = prom.query(&format!("egret_standby_in_sync{{egress_ip=\"{eip}\"}} == 1")).unwrap();
        *last = format!(
            "{:?} {:?} {:?}",
            prom.query("egret_standby_in_sync").unwrap(),
            prom.query("egret_peer_up").unwrap(),
            prom.query("egret_lease_held").unwrap()
        );
        (!r.is_empty()).then_some(())
    });
    // Prometheus evaluates every shipped rule (else "no alert" proves nothing).
    let loaded: BTreeSet<String> = prom.api("rules", &[("type", "alert")]).unwrap()["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().unwrap().iter().map(|r| r["name"].as_str().unwrap().to_string()))
        .collect();
    let shipped = alert_names(&std::fs::read_to_string(files().join("alerts.yaml")).unwrap());
    assert_eq!(loaded, shipped, "the rules Prometheus evaluates");
    poll("no alert active on the healthy lab", ALERT_WAIT, |last| {
        let all = prom.alerts().unwrap();
        *last = format!("{all:?}");
        all.is_empty().then_some(())
    });
    holder
}

/// Every series the promtool unit tests feed the rules exists here with
/// the same name and label names (or some of them) (the only ones the lab
/// cannot make: a cloud pool's `egret_cloud_address_assigned`, checked in
/// k8s_cloud's moto lab through `egret status`,
/// `egret_cloud_node_address_associated`, checked in k8s_cloud_nodes'
/// moto lab on the status writer's `/metrics`, and the port blocks'
/// series, read from a gateway in block mode by e2e's `port_blocks`).
fn series_of_the_unit_tests(prom: &Prometheus) {
    let tests = std::fs::read_to_string(files().join("alerts_test.yaml")).unwrap();
    for (name, labels) in input_series(&tests) {
        if name == "egret_cloud_address_assigned" || name == "egret_cloud_node_address_associated" {
            continue;
        }
        if name == "egret_ports_in_use_by_destination" {
            continue; // Only with endpoint-dependent mapping; the lab's is independent.
        }
        if name.starts_with("egret_port_blocks_") {
            continue; // Only in block mode, which the lab's policies are not in: e2e's port_blocks reads them.
        }
        // The port-use series come with the gateway's next count of port
        // use (`metrics.portUseRefresh`, 10 s) after the traffic.
        let counted = name.starts_with("egret_ports_in_use_by_") || name == "egret_ports_pod_quota";
        let deadline = Instant::now() + if counted { Duration::from_secs(25) } else { Duration::ZERO };
        let got = loop {
            let got = prom.query(&name).unwrap();
            if !got.is_empty() || Instant::now() >= deadline {
                break got;
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        let sets: Vec<BTreeSet<String>> = got
            .iter()
            .map(|s| s["metric"].as_object().unwrap().keys().filter(|k| *k != "__name__").cloned().collect())
            .collect();
        // Every label of the unit test's series is one the lab's has (a
        // label Egret writes empty, as `standby` without a standby, is
        // absent in Prometheus, so a unit test may leave one out; and the
        // scrape job adds `node`).
        let matches = sets.iter().any(|s| labels.is_subset(s));
        assert!(matches, "alerts_test.yaml's {name}{labels:?}: the lab's series have the labels {sets:?}");
    }
}

/// Every query of the dashboard returns data (its `$__rate_interval` as
/// Grafana would set it for 1 s scrapes: four intervals, at least 1 m).
fn dashboard_queries(prom: &Prometheus) {
    let board: Value = serde_json::from_str(&std::fs::read_to_string(files().join("dashboard.json")).unwrap()).unwrap();
    let mut exprs = Vec::new();
    for p in board["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            exprs.push((p["title"].as_str().unwrap().to_string(), t["expr"].as_str().unwrap().to_string()));
        }
    }
    assert!(exprs.len() >= 20, "the dashboard's queries: {exprs:?}");
    // Rates need two samples in their window.
    std::thread::sleep(Duration::from_secs(3));
    for (title, expr) in exprs {
        if expr.contains("egret_cloud_address_assigned") {
            continue; // Only with a cloud pool (see series_of_the_unit_tests).
        }
        let q = expr.replace("$__rate_interval", "1m");
        let r = prom.query(&q).unwrap_or_else(|e| panic!("dashboard panel {title:?}: {q}: {e}"));
        assert!(!r.is_empty(), "dashboard panel {title:?}: {q} returned no data");
    }
}

/// Connections from the selected pod use the egress IP's 10 ports:
/// at 9 the ports-near-exhaustion alert is active, past 10 the exhausted one.
fn ports(lab: &NodeLab, prom: &Prometheus, holder: NodeGw) {
    let pod = lab.pod(&format!("{}-sel", Worker::One.node_name()));
    let mut used = BTreeSet::new();
    while used.len() < 9 {
        let seen =
            probe::once(pod, NodeLab::http()).unwrap().unwrap_or_else(|e| panic!("connection {}: {e}", used.len()));
        assert_eq!(seen.ip(), IpAddr::V4(EIP), "the selected pod's source at the server");
        assert!((PORTS.0..=PORTS.1).contains(&seen.port()), "port {} outside the range", seen.port());
        used.insert(seen.port());
    }
    let labels = [
        ("egress_ip", EIP.to_string()),
        ("proto", "tcp".to_string()),
        ("instance", instance(holder.mgmt_addr(), GATEWAY_METRICS_PORT)),
    ];
    let labels: Vec<(&str, &str)> = labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
    wait_alert(prom, "EgretPortsNearExhaustion", &labels);
    // The 10th port, then none: connections are refused by the allocator.
    let mut refused = 0;
    for _ in 0..3 {
        match probe::once(pod, NodeLab::http()).unwrap() {
            Ok(seen) => assert!(used.insert(seen.port()), "port {} used twice", seen.port()),
            Err(_) => refused += 1,
        }
    }
    assert!(refused >= 2, "connections past the 10 ports: {refused} refused of 3");
    let a = wait_alert(prom, "EgretPortsExhausted", &labels);
    assert_eq!(a["state"], "firing", "EgretPortsExhausted has no `for`: {a:?}");
}

/// A policy whose `gatewaySelector` matches no gateway: the no-holder
/// alert for its IP. A policy whose egress IP is on no node's link: both
/// agents, which cannot route its pods there, failing.
fn unreachable_ip(prom: &Prometheus, rt: &tokio::runtime::Runtime, client: &kube::Client) {
    for spec in [
        json!({"podSelector": {"matchLabels": {"app": "none"}}, "destinations": ["0.0.0.0/0"],
               "egressIPs": [{"ip": NO_GATEWAY}], "gatewaySelector": {"matchLabels": {"zone": "nowhere"}}}),
        json!({"podSelector": {"matchLabels": {"app": "other"}}, "destinations": ["0.0.0.0/0"],
               "egressIPs": [{"ip": UNREACHABLE}]}),
    ] {
        let name = if spec["gatewaySelector"].is_null() { "unreachable" } else { "no-gateway" };
        let policy: EgressPolicy = serde_json::from_value(json!({
            "apiVersion": "egret.dev/v1alpha1", "kind": "EgressPolicy",
            "metadata": {"name": name}, "spec": spec
        }))
        .unwrap();
        rt.block_on(Api::<EgressPolicy>::all(client.clone()).create(&PostParams::default(), &policy)).expect("policy");
    }
    wait_alert(prom, "EgretEgressIPWithoutHolder", &[("egress_ip", NO_GATEWAY)]);
    for w in Worker::ALL {
        wait_alert(prom, "EgretNodeSteeringFailing", &[("instance", &instance(w.mgmt_addr(), NODE_METRICS_PORT))]);
    }
}

/// The API server refused to both gateways (their kernels reset their
/// connections to the control namespace, but for the answers to
/// Prometheus' scrapes): each holder's IP is kept by the failsafe, and the alert
/// says so; then the API server is let through again.
fn failsafe(lab: &NodeLab, prom: &Prometheus) {
    let block = format!(
        "table inet egret_test_block {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    ip daddr {CONTROL} tcp sport != {GATEWAY_METRICS_PORT} reject with tcp reset\n  }}\n}}\n"
    );
    let file = lab.dir().join("block-api-server.nft");
    std::fs::write(&file, block).unwrap();
    for g in NodeGw::ALL {
        lab.gateway_ns(g).exec(&["nft", "-f", file.to_str().unwrap()]).expect("block the API server");
    }
    let eip = EIP.to_string();
    wait_alert(prom, "EgretFailsafeActive", &[("egress_ip", &eip)]);
    for g in NodeGw::ALL {
        lab.gateway_ns(g)
            .exec(&["nft", "delete", "table", "inet", "egret_test_block"])
            .expect("let the API server through");
    }
    poll("the failsafe alert gone with the API server back", ALERT_WAIT, |last| {
        let a = active(prom, "EgretFailsafeActive");
        *last = format!("{a:?}");
        a.is_empty().then_some(())
    });
}

/// SIGKILL of the gateway that is not the holder: its target down, the
/// holder's channel to it down. (The holder's IP has no standby left:
/// EgretStandbyOutOfSync is for a standby that exists and lags.)
fn gateway_down(prom: &Prometheus, gws: &mut BTreeMap<NodeGw, Gateway>, holder: NodeGw) {
    let other = NodeGw::ALL.into_iter().find(|g| *g != holder).unwrap();
    gws.get_mut(&other).unwrap().kill().expect("SIGKILL the gateway");
    let dead = instance(other.mgmt_addr(), GATEWAY_METRICS_PORT);
    let live = instance(holder.mgmt_addr(), GATEWAY_METRICS_PORT);
    wait_alert(prom, "EgretGatewayDown", &[("instance", &dead)]);
    wait_alert(prom, "EgretPeerDown", &[("instance", &live), ("peer", other.node_name())]);
}
