//! Every deployment manifest against the real API server, with server-side
//! dry run (server-side apply, `dryRun=All`): the generated CRDs, the plain
//! manifests in `deploy/manifests/`, and the Helm chart rendered by Helm's
//! own template engine (Go's `text/template` with sprig and Helm's functions:
//! `tests/helm-render/`, built and cached by its `build.sh`) for the default
//! release (`egret` in `egret-system`) and for another (`edge` in
//! `egret-alt`). Without the API server, the rendering tests still run.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use egret_tests::apiserver::ApiServer;
use egret_tests::kubelet::expand;
use kube::discovery::Discovery;
use serde_json::Value;

const NAMESPACE: &str = "egret-system";
/// The other release the chart must install as.
const ALT_RELEASE: &str = "edge";
const ALT_NAMESPACE: &str = "egret-alt";
/// A digest for `image.digest` (any 64 hex digits).
const DIGEST: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

fn chart_dir() -> PathBuf {
    deploy().join("helm/egret")
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "yaml") && !p.file_name().unwrap().to_string_lossy().starts_with('_')
        })
        .collect();
    v.sort();
    v
}

fn lookup<'a>(root: &'a Value, path: &str) -> &'a Value {
    path.split('.')
        .filter(|s| !s.is_empty())
        .fold(root, |v, key| v.get(key).unwrap_or_else(|| panic!("no value at {path} in {root:?}")))
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

// ------------------------------------------------------------ renderer ---

/// The renderer's binary: `tests/helm-render/build.sh` builds it once (Go 1.19
/// and sprig from Debian's packages) and caches it under `$EGRET_CACHE`.
fn renderer() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("helm-render/build.sh");
        let out = Command::new("bash")
            .arg(&script)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} failed (run it as root: it installs Debian's golang-1.19-go and sprig):\n{}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        PathBuf::from(stdout.lines().last().unwrap_or_else(|| panic!("{} printed no path", script.display())))
    })
}

/// Runs the renderer on `chart` (`helm template RELEASE CHART --namespace NS ARGS...`).
fn try_render_chart(chart: &Path, release: &str, namespace: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(renderer())
        .arg(format!("--namespace={namespace}"))
        .args(args)
        .arg(release)
        .arg(chart)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", renderer().display()));
    if out.status.success() {
        Ok(String::from_utf8(out.stdout).unwrap())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Egret's chart rendered, as its documents.
fn render(release: &str, namespace: &str, args: &[&str]) -> Vec<Value> {
    let text = try_render_chart(&chart_dir(), release, namespace, args)
        .unwrap_or_else(|e| panic!("rendering the chart as {release} in {namespace} {args:?}: {e}"));
    docs(&text)
}

fn docs(text: &str) -> Vec<Value> {
    k8s_common::yaml_documents(text)
}

fn kind(v: &Value) -> &str {
    v.get("kind").and_then(Value::as_str).unwrap_or_default()
}

fn name(v: &Value) -> String {
    scalar(lookup(v, "metadata.name"))
}

fn component(v: &Value) -> Option<&str> {
    v.get("metadata")?.get("labels")?.get("app.kubernetes.io/component")?.as_str()
}

/// The one object of `kind` whose component label is `comp`.
fn one<'a>(docs: &'a [Value], kind_: &str, comp: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| kind(d) == kind_ && component(d) == Some(comp)).collect();
    assert_eq!(found.len(), 1, "one {kind_} of component {comp}: {found:?}");
    found[0]
}

fn pod_spec(ds: &Value) -> &Value {
    lookup(ds, "spec.template.spec")
}

fn container(ds: &Value) -> &Value {
    &lookup(ds, "spec.template.spec.containers")[0]
}

/// The ConfigMap's gateway.yaml, loaded with the daemon's own loader.
fn load_gateway_config(docs: &[Value], what: &str) -> egret_controlplane::config::GatewayConfig {
    let cm = one(docs, "ConfigMap", "gateway");
    let text = scalar(&lookup(cm, "data")["gateway.yaml"]);
    egret_controlplane::config::load_str(&format!("{what} gateway.yaml"), &text)
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// A temporary directory, removed when dropped (also when a test fails).
struct TempDir(PathBuf);

impl TempDir {
    fn new(what: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("egret-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// --------------------------------------------------------------- tests ---

#[test]
fn every_manifest_passes_server_side_dry_run() {
    // Rendered first: a renderer or chart failure shows even without an API server.
    let default = render("egret", NAMESPACE, &[]);
    let alt = render(
        ALT_RELEASE,
        ALT_NAMESPACE,
        &[
            "--set",
            &format!("image.digest={DIGEST}"),
            "--set",
            "imagePullSecrets[0].name=regcred",
            "--set",
            "metrics.serviceMonitor.enabled=true",
        ],
    );
    // Helm's longest release name (53): the names are cut to fit (a Service's
    // name is a DNS label of at most 63 characters).
    let long_release = "r".repeat(53);
    let long = render(&long_release, ALT_NAMESPACE, &[]);
    match ApiServer::available_or_skip("every_manifest_passes_server_side_dry_run") {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    let server = ApiServer::start().expect("start kube-apiserver + etcd");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let client = server.client().await.expect("client");
        // The CRDs and the namespaces for real (namespaced objects need their namespace).
        k8s_common::install_crds(&client).await;
        k8s_common::namespace(&client, NAMESPACE, serde_json::json!({})).await;
        k8s_common::namespace(&client, ALT_NAMESPACE, serde_json::json!({})).await;
        let discovery = Discovery::new(client.clone()).run().await.expect("discovery");

        let mut count = 0;
        for dir in ["crds", "manifests", "helm/egret/crds"] {
            for file in yaml_files(&deploy().join(dir)) {
                let text = std::fs::read_to_string(&file).unwrap();
                for obj in k8s_common::documents(&text) {
                    k8s_common::apply_object(&client, &discovery, &file.display().to_string(), &obj, true).await;
                    count += 1;
                }
            }
        }
        assert_eq!(count, 4 + 17, "CRDs twice, 16 manifests + the namespace");
        for (what, objects) in [
            ("chart (egret in egret-system)", &default),
            ("chart (edge in egret-alt)", &alt),
            ("chart (a 53-character release name in egret-alt)", &long),
        ] {
            let mut kinds = Vec::new();
            for v in objects.iter() {
                // The ServiceMonitor's CRD (prometheus-operator's) is not on this
                // API server: it is checked by rendering only (below).
                if kind(v) == "ServiceMonitor" {
                    continue;
                }
                let obj: kube::api::DynamicObject = serde_json::from_value(v.clone()).unwrap();
                k8s_common::apply_object(&client, &discovery, what, &obj, true).await;
                kinds.push(kind(v).to_string());
            }
            kinds.sort();
            assert_eq!(
                kinds,
                [
                    "ClusterRole",
                    "ClusterRole",
                    "ClusterRoleBinding",
                    "ClusterRoleBinding",
                    "ConfigMap",
                    "DaemonSet",
                    "DaemonSet",
                    // The Leases; the DaemonSets (uninstall told from a restart).
                    "Role",
                    "Role",
                    "RoleBinding",
                    "RoleBinding",
                    // The peer channel's key (ha.enabled, no ha.existingSecret).
                    "Secret",
                    "Service",
                    "Service",
                    "ServiceAccount",
                    "ServiceAccount"
                ],
                "{what}"
            );
        }
    });
    drop(rt);
    server.stop().expect("stop");
}

/// Every object of a release is named after it and lives in its namespace,
/// and every reference between them (ServiceAccount, ConfigMap, Roles,
/// Services' and the ServiceMonitor's selectors) finds its object.
#[test]
fn the_chart_installs_under_any_release_name_and_namespace() {
    for (release, ns, prefix) in [("egret", NAMESPACE, "egret-"), (ALT_RELEASE, ALT_NAMESPACE, "edge-egret-")] {
        let docs = render(release, ns, &["--set", "metrics.serviceMonitor.enabled=true"]);
        let names = |k: &str| docs.iter().filter(|d| kind(d) == k).map(name).collect::<Vec<_>>();
        for d in &docs {
            let n = name(d);
            assert!(n.starts_with(prefix), "{release}: {} {n} is not named after the release", kind(d));
            let cluster_scoped = matches!(kind(d), "ClusterRole" | "ClusterRoleBinding");
            let own_ns = d.get("metadata").and_then(|m| m.get("namespace")).and_then(Value::as_str);
            assert_eq!(own_ns, (!cluster_scoped).then_some(ns), "{release}: {} {n}'s namespace", kind(d));
            assert_eq!(lookup(d, "metadata.labels")["app.kubernetes.io/instance"].as_str(), Some(release));
        }
        for comp in ["gateway", "node"] {
            let ds = one(&docs, "DaemonSet", comp);
            let sa = scalar(lookup(pod_spec(ds), "serviceAccountName"));
            assert!(names("ServiceAccount").contains(&sa), "{release}: {comp} runs as {sa}, which is not rendered");
            let binding = one(&docs, "ClusterRoleBinding", comp);
            assert!(names("ClusterRole").contains(&scalar(lookup(binding, "roleRef.name"))));
            assert_eq!(lookup(binding, "subjects")[0]["name"].as_str(), Some(sa.as_str()));
            assert_eq!(lookup(binding, "subjects")[0]["namespace"].as_str(), Some(ns));
            // The pod template carries the selector's labels; the metrics Service selects them.
            let selector = lookup(ds, "spec.selector.matchLabels").as_object().unwrap();
            let labels = lookup(ds, "spec.template.metadata.labels").as_object().unwrap();
            let svc = one(&docs, "Service", comp);
            for (k, v) in selector.iter().chain(lookup(svc, "spec.selector").as_object().unwrap()) {
                assert_eq!(labels.get(k), Some(v), "{release}: {comp}'s pods lack {k:?}={v:?}");
            }
            // The ServiceMonitor selects both Services.
            let sm = docs.iter().find(|d| kind(d) == "ServiceMonitor").expect("the ServiceMonitor when enabled");
            let svc_labels = lookup(svc, "metadata.labels").as_object().unwrap();
            for (k, v) in lookup(sm, "spec.selector.matchLabels").as_object().unwrap() {
                assert_eq!(svc_labels.get(k), Some(v), "{release}: the ServiceMonitor misses {comp}'s Service");
            }
            assert_eq!(scalar(&lookup(sm, "spec.endpoints")[0]["port"]), "metrics");
        }
        let gw = one(&docs, "DaemonSet", "gateway");
        let cm = pod_spec(gw)["volumes"].as_array().unwrap().iter().find_map(|v| v.get("configMap")).unwrap();
        assert_eq!(scalar(&cm["name"]), name(one(&docs, "ConfigMap", "gateway")));
        let leases =
            docs.iter().find(|d| kind(d) == "Role" && scalar(&lookup(d, "rules")[0]["resources"][0]) == "leases");
        let leases = name(leases.unwrap());
        let rb = docs.iter().find(|d| kind(d) == "RoleBinding" && scalar(lookup(d, "roleRef.name")) == leases).unwrap();
        assert_eq!(scalar(&lookup(rb, "subjects")[0]["name"]), scalar(lookup(pod_spec(gw), "serviceAccountName")));
    }
    // Off by default: the ServiceMonitor's CRD may not exist.
    assert!(!render("egret", NAMESPACE, &[]).iter().any(|d| kind(d) == "ServiceMonitor"));
}

/// The gateways' Leases are in the release namespace, where their Role grants
/// them; the configuration is one the daemon loads; and a values file may not
/// move them elsewhere.
#[test]
fn the_lease_namespace_is_the_release_namespace() {
    for (release, ns) in [("egret", NAMESPACE), (ALT_RELEASE, ALT_NAMESPACE)] {
        let docs = render(release, ns, &[]);
        let cfg = load_gateway_config(&docs, release);
        let k = cfg.kubernetes.unwrap_or_else(|| panic!("{release}: Kubernetes mode"));
        assert_eq!(k.lease_namespace, ns, "{release}: the Leases' namespace");
        assert!(!k.cluster_pod_cidrs.is_empty(), "{release}: clusterPodCIDRs is set");
        let role = docs
            .iter()
            .find(|d| kind(d) == "Role" && scalar(&lookup(d, "rules")[0]["resources"][0]) == "leases")
            .unwrap_or_else(|| panic!("{release}: a Role for the Leases"));
        assert_eq!(scalar(lookup(role, "metadata.namespace")), ns);
    }
    let err = try_render_chart(
        &chart_dir(),
        ALT_RELEASE,
        ALT_NAMESPACE,
        &["--set", "config.kubernetes.leaseNamespace=egret-system"],
    )
    .expect_err("a leaseNamespace other than the release's is refused");
    assert!(err.contains("must be the release namespace (egret-alt)"), "{err}");
}

/// A values file as docs/kubernetes.md shows it: a list (interfaces)
/// replaces the chart's, a map (kubernetes) is merged with it.
#[test]
fn a_values_file_replaces_lists_and_merges_maps() {
    let tmp = TempDir::new("chart-values");
    let file = tmp.0.join("my-values.yaml");
    std::fs::write(
        &file,
        "cluster:\n  podCIDRs: [10.244.0.0/16]\n  serviceCIDRs: [10.96.0.0/12]\n\
         config:\n  interfaces:\n    - name: ens5\n      role: both\n  kubernetes:\n    retryPeriod: 400ms\n",
    )
    .unwrap();
    let docs = render(ALT_RELEASE, ALT_NAMESPACE, &["-f", file.to_str().unwrap()]);
    let cfg = load_gateway_config(&docs, "with my-values.yaml");
    let names: Vec<&str> = cfg.interfaces.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["ens5"]);
    let k = cfg.kubernetes.expect("Kubernetes mode");
    assert_eq!(k.lease_namespace, ALT_NAMESPACE);
    // The chart's values equal the loader's defaults: look at the file itself.
    let text = scalar(&lookup(one(&docs, "ConfigMap", "gateway"), "data")["gateway.yaml"]);
    let file = k8s_common::yaml(&text);
    assert_eq!(file["kubernetes"]["leaseDuration"].as_str(), Some("4s"), "the chart's leaseDuration stays: {text}");
    assert_eq!(file["kubernetes"]["retryPeriod"].as_str(), Some("400ms"), "the file's retryPeriod wins: {text}");
}

/// The cluster's settings are named once (`cluster.*`) and both DaemonSets
/// take them: the pod CIDRs (the gateways' source guard, the agent's
/// `--cluster-cidr` with the Service CIDRs), the gateway label (the
/// gateways' DaemonSet and selector, the agent's anti-affinity), the NAT
/// ports (the gateways' file, the agent's `--nat-ports`). The old places
/// are refused with a message naming the new one.
#[test]
fn the_clusters_settings_are_named_once() {
    let set = [
        "--set",
        "cluster.podCIDRs={10.1.0.0/16,fd00:10::/56}",
        "--set",
        "cluster.serviceCIDRs={10.2.0.0/16}",
        "--set",
        "cluster.gatewayLabel.key=example.com/egress",
        "--set",
        "cluster.gatewayLabel.value=yes",
        "--set",
        "config.nat.ports=40000-49999",
        "--set",
        "nodeSelector.zone=a",
    ];
    let docs = render("egret", NAMESPACE, &set);
    let cfg = load_gateway_config(&docs, "cluster values");
    let k = cfg.kubernetes.expect("Kubernetes mode");
    let cidrs: Vec<String> = k.cluster_pod_cidrs.iter().map(|c| c.to_string()).collect();
    assert_eq!(cidrs, ["10.1.0.0/16", "fd00:10::/56"]);
    assert_eq!(k.gateway_selector, "example.com/egress=yes");
    let gw = one(&docs, "DaemonSet", "gateway");
    let selector = lookup(pod_spec(gw), "nodeSelector");
    assert_eq!(scalar(&selector["example.com/egress"]), "yes", "{selector:?}");
    assert_eq!(scalar(&selector["zone"]), "a", "nodeSelector adds to the label: {selector:?}");
    let node = one(&docs, "DaemonSet", "node");
    let args: Vec<String> = lookup(container(node), "args").as_array().unwrap().iter().map(scalar).collect();
    assert!(args.contains(&"--cluster-cidr=10.1.0.0/16,fd00:10::/56,10.2.0.0/16".to_string()), "{args:?}");
    assert!(args.contains(&"--nat-ports=40000-49999".to_string()), "{args:?}");
    let term = &lookup(
        pod_spec(node),
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
    )[0]["matchExpressions"][0];
    assert_eq!(scalar(&term["key"]), "example.com/egress");
    assert_eq!(scalar(&term["operator"]), "NotIn");
    assert_eq!(scalar(&term["values"][0]), "yes");
    for (old, names) in [
        ("config.kubernetes.clusterPodCIDRs={10.9.0.0/16}", "cluster.podCIDRs"),
        ("config.kubernetes.gatewaySelector=a=b", "cluster.gatewayLabel"),
        ("node.clusterCIDRs=10.9.0.0/16", "cluster.podCIDRs and cluster.serviceCIDRs"),
        ("cluster.podCIDRs=10.9.0.0/16", "cluster.podCIDRs: 10.9.0.0/16: a non-empty list"),
        ("cluster.podCIDRs=null", "cluster.podCIDRs"),
        ("cluster.podCIDRs={}", "a non-empty list"),
    ] {
        let err = try_render_chart(&chart_dir(), "egret", NAMESPACE, &["--set", old]).expect_err(old);
        assert!(err.contains(names), "{old}: {err}");
    }
}

fn checksum(docs: &[Value]) -> String {
    let ds = one(docs, "DaemonSet", "gateway");
    scalar(&lookup(ds, "spec.template.metadata.annotations")["checksum/config"])
}

/// A configuration change changes the gateway pods' template (so it rolls
/// them); a change elsewhere does not.
#[test]
fn a_configuration_change_changes_the_checksum_annotation() {
    let base = checksum(&render("egret", NAMESPACE, &[]));
    assert_eq!(base.len(), 64, "a sha256: {base}");
    let changed = checksum(&render("egret", NAMESPACE, &["--set", "config.kubernetes.leaseDuration=6s"]));
    assert_ne!(base, changed, "config.kubernetes.leaseDuration changed");
    let elsewhere = checksum(&render("egret", NAMESPACE, &["--set", "resources.limits.memory=2Gi"]));
    assert_eq!(base, elsewhere, "only the resources changed");
}

#[test]
fn the_image_digest_and_pull_secrets_appear_when_set() {
    let plain = render("egret", NAMESPACE, &[]);
    let pinned = render(
        "egret",
        NAMESPACE,
        &["--set", &format!("image.digest={DIGEST}"), "--set", "imagePullSecrets[0].name=regcred"],
    );
    for comp in ["gateway", "node"] {
        let ds = one(&plain, "DaemonSet", comp);
        assert_eq!(scalar(&container(ds)["image"]), "egret:0.1.0", "{comp}: the tag defaults to appVersion");
        assert!(pod_spec(ds).get("imagePullSecrets").is_none(), "{comp}");
        let ds = one(&pinned, "DaemonSet", comp);
        assert_eq!(scalar(&container(ds)["image"]), format!("egret@{DIGEST}"), "{comp}");
        let secrets = &pod_spec(ds)["imagePullSecrets"];
        assert_eq!(secrets.as_array().map(Vec::len), Some(1), "{comp}: {secrets:?}");
        assert_eq!(scalar(&secrets[0]["name"]), "regcred", "{comp}");
    }
}

/// The DaemonSets of `deploy/manifests/` and of the rendered chart: each
/// object's source (for messages) and the object.
fn daemonsets() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for file in yaml_files(&deploy().join("manifests")) {
        for v in docs(&std::fs::read_to_string(&file).unwrap()) {
            if kind(&v) == "DaemonSet" {
                out.push((file.display().to_string(), v));
            }
        }
    }
    for v in render("egret", NAMESPACE, &[]) {
        if kind(&v) == "DaemonSet" {
            out.push(("the chart".to_string(), v));
        }
    }
    out
}

/// The chart's DaemonSets run with exactly the privileges of
/// `deploy/manifests/`, whose gateway tests/tests/container_image.rs runs
/// under a real runtime: the same containers' securityContext (capabilities,
/// read-only root, no privilege escalation), the same pod securityContext,
/// host network, per component.
#[test]
fn the_charts_privileges_are_the_manifests() {
    let all = daemonsets();
    for comp in ["gateway", "node"] {
        let pick = |chart: bool| {
            all.iter()
                .filter(|(what, _)| (what == "the chart") == chart)
                .map(|(_, v)| v)
                .find(|v| component(v) == Some(comp))
                .unwrap_or_else(|| panic!("no {comp} DaemonSet (chart: {chart})"))
        };
        let (m, c) = (pick(false), pick(true));
        for key in ["securityContext", "hostNetwork"] {
            assert_eq!(pod_spec(m).get(key), pod_spec(c).get(key), "{comp}: the pod's {key}");
        }
        assert_eq!(
            container(m).get("securityContext"),
            container(c).get("securityContext"),
            "{comp}: the container's securityContext"
        );
    }
}

/// Both host-network DaemonSets serve metrics and probes on the Node's
/// address (the downward API's status.hostIP), never on loopback, where
/// Prometheus cannot reach a host-network pod; both have a liveness probe.
#[test]
fn metrics_listen_on_the_nodes_address_with_probes_and_a_service() {
    let ds = daemonsets();
    assert_eq!(ds.len(), 4, "the gateway's and the node agent's, in deploy/manifests and in the chart");
    for (src, d) in &ds {
        let c = container(d);
        let what = format!("{src}: {}", name(d));
        assert_eq!(pod_spec(d)["hostNetwork"].as_bool(), Some(true), "{what}");
        let host_ip = c["env"].as_array().unwrap().iter().find(|e| e["name"].as_str() == Some("HOST_IP"));
        let field = host_ip.map(|e| scalar(lookup(e, "valueFrom.fieldRef.fieldPath")));
        assert_eq!(field.as_deref(), Some("status.hostIP"), "{what}: env HOST_IP");
        let port = c["ports"].as_array().unwrap().iter().find(|p| p["name"].as_str() == Some("metrics")).unwrap();
        let port = scalar(&port["containerPort"]);
        let args: Vec<String> = c["args"].as_array().unwrap().iter().map(scalar).collect();
        assert!(
            args.contains(&format!("--metrics-listen=$(HOST_IP):{port}")),
            "{what}: --metrics-listen=$(HOST_IP):{port} in {args:?}"
        );
        for probe in ["livenessProbe", "readinessProbe"] {
            let get = c.get(probe).and_then(|p| p.get("httpGet")).unwrap_or_else(|| panic!("{what}: no {probe}"));
            assert!(get.get("host").is_none(), "{what}: {probe} has a host: {get:?}");
            assert_eq!(scalar(&get["port"]), "metrics", "{what}: {probe}");
        }
    }
    // The headless Services select the pods on that port, in both.
    let manifest = docs(&std::fs::read_to_string(deploy().join("manifests/60-metrics.yaml")).unwrap());
    let chart = render("egret", NAMESPACE, &[]);
    for svcs in [&manifest, &chart] {
        for comp in ["gateway", "node"] {
            let s = one(svcs, "Service", comp);
            assert_eq!(scalar(lookup(s, "spec.clusterIP")), "None");
            assert_eq!(scalar(&lookup(s, "spec.ports")[0]["targetPort"]), "metrics");
        }
    }
}

/// The alert rules and the dashboard (`files/`) reach a cluster only when
/// asked for, and then verbatim: the PrometheusRule's groups are
/// `files/alerts.yaml`'s (which promtool and k8s_monitoring test), the
/// dashboard ConfigMap holds `files/dashboard.json` under Grafana's sidecar
/// label, and the ServiceMonitor names the jobs the rules expect.
#[test]
fn the_chart_ships_the_alerts_and_the_dashboard_on_request() {
    let off = render("egret", NAMESPACE, &[]);
    for k in ["PrometheusRule", "ServiceMonitor"] {
        assert!(off.iter().all(|d| kind(d) != k), "{k} rendered by default");
    }
    assert!(!off.iter().any(|d| name(d).ends_with("-dashboard")), "the dashboard ConfigMap rendered by default");
    let on = render(
        "egret",
        NAMESPACE,
        &[
            "--set=metrics.prometheusRule.enabled=true",
            "--set=metrics.grafanaDashboard.enabled=true",
            "--set=metrics.serviceMonitor.enabled=true",
        ],
    );
    let files = chart_dir().join("files");
    let rule: Vec<&Value> = on.iter().filter(|d| kind(d) == "PrometheusRule").collect();
    assert_eq!(rule.len(), 1, "one PrometheusRule");
    let shipped = k8s_common::yaml(&std::fs::read_to_string(files.join("alerts.yaml")).unwrap());
    assert_eq!(rule[0]["spec"]["groups"], shipped["groups"], "the PrometheusRule's groups are files/alerts.yaml's");
    let board: Vec<&Value> = on.iter().filter(|d| kind(d) == "ConfigMap" && name(d).ends_with("-dashboard")).collect();
    assert_eq!(board.len(), 1, "one dashboard ConfigMap");
    assert_eq!(scalar(&lookup(board[0], "metadata.labels")["grafana_dashboard"]), "1");
    let json: Value = serde_json::from_str(board[0]["data"]["egret.json"].as_str().unwrap()).unwrap();
    let file: Value = serde_json::from_str(&std::fs::read_to_string(files.join("dashboard.json")).unwrap()).unwrap();
    assert_eq!(json, file, "the ConfigMap's dashboard is files/dashboard.json");
    let sm: Vec<&Value> = on.iter().filter(|d| kind(d) == "ServiceMonitor").collect();
    let relabel = &sm[0]["spec"]["endpoints"][0]["relabelings"];
    assert!(
        relabel.as_array().unwrap().iter().any(|r| r["targetLabel"] == "job" && r["replacement"] == "egret-$1"),
        "the ServiceMonitor names the jobs egret-gateway / egret-node: {relabel:?}"
    );
}

#[test]
fn every_daemonset_runs_under_the_runtime_default_seccomp_profile() {
    let ds = daemonsets();
    assert_eq!(ds.len(), 4, "the gateway's and the node agent's, in deploy/manifests and in the chart: {ds:?}");
    for (src, d) in ds {
        let spec = pod_spec(&d);
        let what = format!("{src}: {}", name(&d));
        let profile = spec.get("securityContext").and_then(|s| s.get("seccompProfile")).and_then(|p| p.get("type"));
        assert_eq!(
            profile.and_then(Value::as_str),
            Some("RuntimeDefault"),
            "{what}: the pod's securityContext.seccompProfile.type must be RuntimeDefault"
        );
        // No container may override it with a weaker profile.
        for c in spec.get("containers").and_then(Value::as_array).into_iter().flatten() {
            let own = c.get("securityContext").and_then(|s| s.get("seccompProfile")).and_then(|p| p.get("type"));
            assert!(
                own.is_none() || own.and_then(Value::as_str) == Some("RuntimeDefault"),
                "{what}: container {:?} overrides the seccomp profile with {own:?}",
                c.get("name")
            );
        }
    }
}

/// The gateway configuration the manifests ship is one the daemon accepts
/// (`egret check-config`'s loader), with the source guard set by the
/// cluster's settings the DaemonSet passes as flags (the chart's:
/// [`the_lease_namespace_is_the_release_namespace`]).
#[test]
fn the_shipped_gateway_configuration_loads() {
    let manifest = docs(&std::fs::read_to_string(deploy().join("manifests/20-configmap.yaml")).unwrap());
    let cfg = load_gateway_config(&manifest, "deploy/manifests/20-configmap.yaml");
    let k = cfg.kubernetes.expect("Kubernetes mode");
    assert!(k.cluster_pod_cidrs.is_empty(), "clusterPodCIDRs is egret-cluster's, not the file's");
    assert_eq!(k.lease_namespace, NAMESPACE);
    let cluster = cluster_settings(&manifest);
    let (first, last) = cluster["nat-ports"].split_once('-').expect("nat-ports: FIRST-LAST");
    let overrides = egret_controlplane::config::Overrides {
        cluster_pod_cidrs: Some(cluster["pod-cidrs"].split(',').map(|c| c.parse().unwrap()).collect()),
        gateway_selector: Some(cluster["gateway-label"].clone()),
        nat_ports: Some(egret_dataplane::nat::port_alloc::PortRange {
            first: first.parse().unwrap(),
            last: last.parse().unwrap(),
        }),
        tunnel_port: Some(cluster["tunnel-port"].parse().expect("tunnel-port: a UDP port")),
    };
    let text = scalar(&lookup(one(&manifest, "ConfigMap", "gateway"), "data")["gateway.yaml"]);
    let cfg = egret_controlplane::config::load_str_with("gateway.yaml", &text, &overrides).unwrap();
    let k = cfg.kubernetes.expect("Kubernetes mode");
    assert!(!k.cluster_pod_cidrs.is_empty(), "clusterPodCIDRs is set");
    assert!(cfg.warnings.is_empty(), "{:?}", cfg.warnings);
}

/// The renderer behaves as Helm's engine on the constructs charts use,
/// checked on a small chart of its own.
#[test]
fn the_renderer_is_helms_engine() {
    let tmp = TempDir::new("helm-render-test");
    let dir = &tmp.0;
    std::fs::create_dir_all(dir.join("templates")).unwrap();
    std::fs::create_dir_all(dir.join("files")).unwrap();
    let write = |p: &str, s: &str| std::fs::write(dir.join(p), s).unwrap();
    write("Chart.yaml", "apiVersion: v2\nname: probe\nversion: 1.2.3\nappVersion: \"4.5\"\n");
    write(
        "values.yaml",
        "port: 9469\nflag: false\nlist: [a, b]\nnested:\n  keep: 1\n  drop: 2\nmsg: \"{{ .Release.Name }}-x\"\n",
    );
    write("files/note.txt", "from a file\n");
    write("templates/_helpers.tpl", "{{- define \"probe.name\" -}}{{ .Release.Name }}-{{ .Chart.Name }}{{- end }}\n");
    write(
        "templates/a.yaml",
        "name: {{ include \"probe.name\" . | upper }}\n\
         ns: {{ .Release.Namespace }}\n\
         app: {{ .Chart.AppVersion | quote }}\n\
         svc: {{ .Release.Service }} {{ .Release.IsInstall }}\n\
         port: {{ .Values.port }}\n\
         flag: {{ .Values.flag }}\n\
         missing: [{{ .Values.nothing }}]\n\
         tpl: {{ tpl .Values.msg . }}\n\
         tmpl: {{ .Template.Name }} {{ .Template.BasePath }}\n\
         file: {{ .Files.Get \"files/note.txt\" | trim }}\n\
         lookup: {{ lookup \"v1\" \"Pod\" \"ns\" \"x\" | len }}\n\
         has: {{ .Capabilities.APIVersions.Has \"apps/v1\" }} {{ .Capabilities.APIVersions.Has \"monitoring.coreos.com/v1\" }}\n\
         sum: {{ \"x\" | sha256sum | trunc 8 }}\n\
         json: '{{ toJson .Values.list }} {{ (fromYaml \"k: v\").k }}'\n\
         nested:\n  {{- toYaml .Values.nested | nindent 2 }}\n",
    );
    write("templates/cond.yaml", "{{- if .Values.flag }}\nkind: Never\n{{- end }}\n");
    write("templates/NOTES.txt", "{{ .Release.Name }} installed\n");
    let out = try_render_chart(
        dir,
        "rel",
        "space",
        &[
            "--set",
            "flag=true,nested.drop=null",
            "--set-string",
            "list[1]=007",
            "--api-versions",
            "monitoring.coreos.com/v1",
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let v = docs(&out);
    assert_eq!(v.len(), 2, "a.yaml and cond.yaml (flag set), not NOTES.txt: {out}");
    let a = &v[0];
    let field = |k: &str| scalar(&a[k]);
    assert!(out.starts_with("---\n# Source: probe/templates/a.yaml\n"), "{out}");
    assert_eq!(field("name"), "REL-PROBE");
    assert_eq!(field("ns"), "space");
    assert_eq!(field("app"), "4.5");
    assert_eq!(field("svc"), "Helm true");
    assert_eq!(field("port"), "9469", "a float64 from values.yaml prints as Helm prints it");
    assert_eq!(field("flag"), "true", "--set types booleans");
    assert_eq!(a["missing"], Value::Array(vec![]), "a missing value renders empty, not <no value>");
    assert_eq!(field("tpl"), "rel-x");
    assert_eq!(field("tmpl"), "probe/templates/a.yaml probe/templates");
    assert_eq!(field("file"), "from a file");
    assert_eq!(field("lookup"), "0", "lookup finds nothing without a cluster");
    assert_eq!(field("has"), "true true");
    assert_eq!(field("sum"), "2d711642");
    // A --set list replaces the default list, as in Helm.
    assert_eq!(field("json"), "[null,\"007\"] v", "--set-string keeps 007 a string");
    assert_eq!(a["nested"], k8s_common::yaml("keep: 1"), "null deletes a default");
    // required fails naming the value, as in Helm.
    write("templates/req.yaml", "x: {{ required \"set .Values.must\" .Values.must }}\n");
    let err = try_render_chart(dir, "rel", "space", &[]).expect_err("required");
    assert!(err.contains("set .Values.must"), "{err}");
    assert!(!err.contains("HELM_ERR"), "{err}");
}

// ------------------------------------------------- kubernetes.ha (issue 16) ---

/// Every document of `deploy/manifests/`.
fn manifest_docs() -> Vec<Value> {
    yaml_files(&deploy().join("manifests")).iter().flat_map(|f| docs(&std::fs::read_to_string(f).unwrap())).collect()
}

/// The gateway pod's volume mounted at `dir` (mount, volume), if any.
fn mount_at<'a>(ds: &'a Value, dir: &Path) -> Option<(&'a Value, &'a Value)> {
    let m = lookup(container(ds), "volumeMounts")
        .as_array()
        .unwrap()
        .iter()
        .find(|m| Path::new(&scalar(&m["mountPath"])) == dir)?;
    let volumes = lookup(pod_spec(ds), "volumes").as_array().unwrap();
    let v = volumes.iter().find(|v| v["name"] == m["name"]).unwrap_or_else(|| panic!("no volume for {m:?}"));
    Some((m, v))
}

/// The gateway container's port named `ha`, if any.
fn ha_port(ds: &Value) -> Option<String> {
    let ports = container(ds).get("ports")?.as_array()?;
    ports.iter().find(|p| p["name"].as_str() == Some("ha")).map(|p| {
        assert_eq!(p["protocol"].as_str(), Some("TCP"));
        scalar(&p["containerPort"])
    })
}

/// The gateway's `kubernetes.ha`, read by the daemon's own loader, is wired to
/// the pod: its key file is `key` in a read-only mount of the Secret
/// `secret` (mode 0400), the port is the container's port `ha`, and the peer
/// cache is on a writable volume that outlives the container; the keys a roll
/// adds (`next`, then `previous`) are accepted from the same Secret, so a
/// roll is edits of that Secret and no restart (docs/operations.md). (The key
/// file itself is not read by the loader: only the daemon's start does.)
fn assert_ha_wired(docs: &[Value], what: &str, secret: &str) -> egret_controlplane::config::HaConfig {
    let cfg = load_gateway_config(docs, what);
    let ha = cfg.kubernetes.expect("Kubernetes mode").ha.unwrap_or_else(|| panic!("{what}: no kubernetes.ha"));
    let ds = one(docs, "DaemonSet", "gateway");
    assert_eq!(ha.key_file.file_name().and_then(|n| n.to_str()), Some("key"), "{what}: keyFile {:?}", ha.key_file);
    let (m, v) = mount_at(ds, ha.key_file.parent().unwrap())
        .unwrap_or_else(|| panic!("{what}: nothing mounted at {:?}", ha.key_file.parent()));
    assert_eq!(m["readOnly"].as_bool(), Some(true), "{what}: the key's mount is read-only");
    assert_eq!(v["secret"]["secretName"].as_str(), Some(secret), "{what}: the key's volume {v:?}");
    assert_eq!(scalar(&v["secret"]["defaultMode"]), "256", "{what}: the key is mode 0400");
    assert!(v["secret"].get("items").is_none(), "{what}: the Secret's key \"key\" is the file \"key\"");
    let dir = ha.key_file.parent().unwrap();
    assert_eq!(ha.accept_key_files, vec![dir.join("next"), dir.join("previous")], "{what}: acceptKeyFiles");
    assert_eq!(ha_port(ds), Some(ha.port.to_string()), "{what}: the container's port ha");
    let cache = ha.peer_cache.clone().unwrap_or_else(|| panic!("{what}: no peerCache"));
    let (m, v) =
        mount_at(ds, cache.parent().unwrap()).unwrap_or_else(|| panic!("{what}: peerCache {cache:?} not on a volume"));
    assert_ne!(m["readOnly"].as_bool(), Some(true), "{what}: the peer cache's volume is writable");
    assert!(v.get("hostPath").is_some() || v.get("emptyDir").is_some(), "{what}: the peer cache's volume {v:?}");
    ha
}

#[test]
fn the_manifests_wire_the_peer_channel_to_the_secret_egret_ha() {
    let docs = manifest_docs();
    let ha = assert_ha_wired(&docs, "deploy/manifests", "egret-ha");
    assert_eq!(ha.port, 4720);
    assert_eq!(ha.address, None, "the address is $HOST_IP, which differs per gateway");
    // The Secret is the user's (its key is never shipped).
    assert!(!docs.iter().any(|d| kind(d) == "Secret"), "deploy/manifests ship no Secret");
    let ds = one(&docs, "DaemonSet", "gateway");
    let host_ip =
        lookup(container(ds), "env").as_array().unwrap().iter().find(|e| e["name"].as_str() == Some("HOST_IP"));
    assert_eq!(host_ip.map(|e| scalar(lookup(e, "valueFrom.fieldRef.fieldPath"))).as_deref(), Some("status.hostIP"));
}

#[test]
fn the_chart_wires_the_peer_channel_to_its_secret() {
    for (release, ns) in [("egret", NAMESPACE), (ALT_RELEASE, ALT_NAMESPACE)] {
        let docs = render(release, ns, &["--set", "ha.liveness=2s", "--set", "ha.resyncPeriod=1m"]);
        let secret = one(&docs, "Secret", "gateway");
        let name = scalar(lookup(secret, "metadata.name"));
        assert_eq!(scalar(lookup(secret, "metadata.namespace")), ns);
        let key = scalar(lookup(secret, "data.key"));
        let bytes = base64_decode(&key);
        assert!(bytes.len() >= 48, "{release}: the chart's key is {} bytes", bytes.len());
        let ha = assert_ha_wired(&docs, &format!("the chart as {release}"), &name);
        assert_eq!((ha.port, ha.liveness, ha.resync_period), (4720, Duration::from_secs(2), Duration::from_secs(60)));
    }
    // The default release's names are the manifests'.
    assert_eq!(scalar(lookup(one(&render("egret", NAMESPACE, &[]), "Secret", "gateway"), "metadata.name")), "egret-ha");
    // An existing Secret: used, none created; another port follows.
    let docs = render(ALT_RELEASE, ALT_NAMESPACE, &["--set", "ha.existingSecret=mine", "--set", "ha.port=4800"]);
    assert!(!docs.iter().any(|d| kind(d) == "Secret"), "ha.existingSecret: the chart creates no Secret");
    assert_eq!(assert_ha_wired(&docs, "the chart with ha.existingSecret", "mine").port, 4800);
    // kubernetes.ha is the chart's, from ha.*.
    let err =
        try_render_chart(&chart_dir(), "egret", NAMESPACE, &["--set", "config.kubernetes.ha.port=1"]).unwrap_err();
    assert!(err.contains("config.kubernetes.ha: leave it out"), "{err}");
}

#[test]
fn ha_disabled_renders_no_channel() {
    let docs = render("egret", NAMESPACE, &["--set", "ha.enabled=false"]);
    let cfg = load_gateway_config(&docs, "the chart with ha.enabled=false");
    assert_eq!(cfg.kubernetes.expect("Kubernetes mode").ha, None);
    let ds = one(&docs, "DaemonSet", "gateway");
    assert_eq!(ha_port(ds), None);
    assert!(mount_at(ds, Path::new("/etc/egret-ha")).is_none());
    assert!(!lookup(pod_spec(ds), "volumes").as_array().unwrap().iter().any(|v| v.get("secret").is_some()));
    assert!(!docs.iter().any(|d| kind(d) == "Secret"));
}

#[test]
fn the_aws_values_set_the_region_and_the_irsa_role() {
    let env_names = |docs: &[Value]| -> Vec<String> {
        let c = container(one(docs, "DaemonSet", "gateway"));
        lookup(c, "env").as_array().unwrap().iter().map(|e| scalar(lookup(e, "name"))).collect()
    };
    let sa = |docs: &[Value]| -> Value {
        docs.iter()
            .find(|d| kind(d) == "ServiceAccount" && component(d) == Some("gateway"))
            .expect("the gateways' ServiceAccount")
            .clone()
    };
    let plain = render("egret", NAMESPACE, &[]);
    assert!(!env_names(&plain).contains(&"AWS_REGION".to_string()));
    assert!(sa(&plain).get("metadata").and_then(|m| m.get("annotations")).is_none());
    let role = "arn:aws:iam::111122223333:role/egret-gateway";
    let docs = render("egret", NAMESPACE, &["--set", "aws.region=eu-west-1", "--set", &format!("aws.roleArn={role}")]);
    let c = container(one(&docs, "DaemonSet", "gateway"));
    let region =
        lookup(c, "env").as_array().unwrap().iter().find(|e| scalar(lookup(e, "name")) == "AWS_REGION").cloned();
    assert_eq!(region.map(|e| scalar(lookup(&e, "value"))), Some("eu-west-1".to_string()));
    let annotations = sa(&docs).get("metadata").and_then(|m| m.get("annotations")).cloned().expect("annotations");
    assert_eq!(annotations.get("eks.amazonaws.com/role-arn").map(scalar).as_deref(), Some(role));
}

/// `config.translationLogs` keeps a journal unless it says otherwise
/// (`egret who-had` reads it): the container's root filesystem is
/// read-only, so the chart mounts the journal's directory from the Node,
/// where `journal.dir` says, and nothing when the logs or the journal are
/// off. The rendered file is one `egret check-config` accepts.
#[test]
fn the_translation_logs_journal_is_on_the_node() {
    let journal = |docs: &[Value]| -> Option<(String, String)> {
        let ds = one(docs, "DaemonSet", "gateway");
        let volume = lookup(ds, "spec.template.spec.volumes")
            .as_array()
            .unwrap()
            .iter()
            .find(|v| scalar(lookup(v, "name")) == "translog-journal")
            .cloned()?;
        let mount = lookup(container(ds), "volumeMounts")
            .as_array()
            .unwrap()
            .iter()
            .find(|m| scalar(lookup(m, "name")) == "translog-journal")
            .cloned()
            .expect("the journal's volume is mounted");
        assert_eq!(scalar(lookup(&volume, "hostPath.type")), "DirectoryOrCreate");
        Some((scalar(lookup(&volume, "hostPath.path")), scalar(lookup(&mount, "mountPath"))))
    };
    assert_eq!(journal(&render("egret", NAMESPACE, &[])), None, "no translation logs, no journal");
    let ipfix = "config.translationLogs.ipfix.collector=192.0.2.50:4739";
    let default = render("egret", NAMESPACE, &["--set", ipfix]);
    let at = |p: &str| Some((p.to_string(), p.to_string()));
    assert_eq!(journal(&default), at("/var/lib/egret/translog"));
    let elsewhere = render(
        "egret",
        NAMESPACE,
        &["--set", ipfix, "--set", "config.translationLogs.journal.dir=/var/log/egret/journal"],
    );
    assert_eq!(journal(&elsewhere), at("/var/log/egret/journal"));
    for off in ["config.translationLogs.journal.enabled=false", "config.translationLogs.enabled=false"] {
        assert_eq!(journal(&render("egret", NAMESPACE, &["--set", ipfix, "--set", off])), None, "{off}");
    }
    // The gateway's file as the chart writes it: the real parser takes it.
    let egret = egret_tests::gateway::egret_binary().unwrap_or_else(|e| panic!("{e}"));
    let tmp = TempDir::new("translog-journal");
    let file = tmp.0.join("gateway.yaml");
    std::fs::write(&file, scalar(&lookup(one(&elsewhere, "ConfigMap", "gateway"), "data")["gateway.yaml"])).unwrap();
    let out = Command::new(&egret).arg("check-config").arg(&file).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "egret check-config: {text}");
    assert!(text.contains("/var/log/egret/journal"), "check-config names the journal's directory: {text}");
}

/// `azure.workloadIdentityClientId` annotates the gateways' ServiceAccount
/// and labels their Pods for AKS's workload identity webhook;
/// `gcp.credentialsSecret` mounts a service account key and points
/// GOOGLE_APPLICATION_CREDENTIALS at it. Neither is set by default.
#[test]
fn the_azure_and_gcp_values_set_their_credential_chains() {
    let sa_annotations = |docs: &[Value]| -> Option<Value> {
        let sa = docs.iter().find(|d| kind(d) == "ServiceAccount" && component(d) == Some("gateway")).unwrap();
        sa.get("metadata").and_then(|m| m.get("annotations")).cloned()
    };
    let pod_labels = |docs: &[Value]| -> Value {
        lookup(one(docs, "DaemonSet", "gateway"), "spec.template.metadata.labels").clone()
    };
    let env_value = |docs: &[Value], name: &str| -> Option<String> {
        let c = container(one(docs, "DaemonSet", "gateway"));
        let e = lookup(c, "env").as_array().unwrap().iter().find(|e| scalar(lookup(e, "name")) == name).cloned();
        e.map(|e| scalar(lookup(&e, "value")))
    };
    let plain = render("egret", NAMESPACE, &[]);
    assert!(sa_annotations(&plain).is_none());
    assert!(pod_labels(&plain).get("azure.workload.identity/use").is_none());
    assert_eq!(env_value(&plain, "GOOGLE_APPLICATION_CREDENTIALS"), None);

    let client_id = "00000000-0000-4000-8000-0000000000c1";
    let docs = render(
        "egret",
        NAMESPACE,
        &[
            "--set",
            &format!("azure.workloadIdentityClientId={client_id}"),
            "--set",
            "gcp.credentialsSecret=egret-gcp-key",
        ],
    );
    let a = sa_annotations(&docs).expect("annotations");
    assert_eq!(a.get("azure.workload.identity/client-id").map(scalar).as_deref(), Some(client_id));
    assert_eq!(pod_labels(&docs).get("azure.workload.identity/use").map(scalar).as_deref(), Some("true"));
    assert_eq!(env_value(&docs, "GOOGLE_APPLICATION_CREDENTIALS").as_deref(), Some("/etc/egret-gcp/key.json"));
    let ds = one(&docs, "DaemonSet", "gateway");
    let volume = lookup(ds, "spec.template.spec.volumes")
        .as_array()
        .unwrap()
        .iter()
        .find(|v| scalar(lookup(v, "name")) == "gcp-key")
        .cloned()
        .expect("the key's volume");
    assert_eq!(scalar(lookup(&volume, "secret.secretName")), "egret-gcp-key");
    let mounted = lookup(container(ds), "volumeMounts")
        .as_array()
        .unwrap()
        .iter()
        .any(|m| scalar(lookup(m, "name")) == "gcp-key" && scalar(lookup(m, "mountPath")) == "/etc/egret-gcp");
    assert!(mounted, "the key is mounted where the variable points");
    // Both together with AWS's role: one annotations map holds all.
    let role = "arn:aws:iam::111122223333:role/egret-gateway";
    let docs = render(
        "egret",
        NAMESPACE,
        &["--set", &format!("aws.roleArn={role}"), "--set", &format!("azure.workloadIdentityClientId={client_id}")],
    );
    let a = sa_annotations(&docs).expect("annotations");
    assert_eq!(a.get("eks.amazonaws.com/role-arn").map(scalar).as_deref(), Some(role));
    assert_eq!(a.get("azure.workload.identity/client-id").map(scalar).as_deref(), Some(client_id));
}

/// `extraCA.configMap` mounts the private CA and points the SDK at it and
/// at the image's bundle (the way container_image.rs tests from the image);
/// without it nothing of the kind is set (the image's bundle alone).
#[test]
fn the_extra_ca_value_adds_the_private_ca_and_keeps_the_bundle() {
    let env_of = |docs: &[Value]| -> Vec<(String, String)> {
        let c = container(one(docs, "DaemonSet", "gateway"));
        lookup(c, "env")
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e.get("value").is_some())
            .map(|e| (scalar(lookup(e, "name")), scalar(lookup(e, "value"))))
            .collect()
    };
    let plain = render("egret", NAMESPACE, &[]);
    assert!(env_of(&plain).iter().all(|(k, _)| !k.starts_with("SSL_CERT")), "{:?}", env_of(&plain));
    let docs = render("egret", NAMESPACE, &["--set", "extraCA.configMap=corp-ca"]);
    let env = env_of(&docs);
    let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    assert_eq!(get("SSL_CERT_FILE").as_deref(), Some("/etc/ssl/certs/ca-certificates.crt"));
    assert_eq!(get("SSL_CERT_DIR").as_deref(), Some("/etc/egret-ca"));
    let ds = one(&docs, "DaemonSet", "gateway");
    let c = container(ds);
    let mount = lookup(c, "volumeMounts")
        .as_array()
        .unwrap()
        .iter()
        .find(|m| scalar(lookup(m, "mountPath")) == "/etc/egret-ca")
        .cloned()
        .expect("a mount at /etc/egret-ca");
    assert_eq!(scalar(lookup(&mount, "readOnly")), "true");
    let name = scalar(lookup(&mount, "name"));
    let volume = lookup(ds, "spec.template.spec.volumes")
        .as_array()
        .unwrap()
        .iter()
        .find(|v| scalar(lookup(v, "name")) == name)
        .cloned()
        .expect("the mount's volume");
    assert_eq!(scalar(lookup(&volume, "configMap.name")), "corp-ca");
}

/// The renderer's `lookup` always finds nothing (as `helm template`), so an
/// upgrade is rendered with the chart's `lookup` call replaced by the Secret
/// it would find: the key in the cluster is kept, not replaced by a new
/// random one (which would split the gateways of a rolling upgrade).
#[test]
fn an_upgrade_keeps_the_key_in_the_cluster() {
    const CALL: &str = r#"lookup "v1" "Secret" .Release.Namespace $name"#;
    let old = "b2xkLWtleS1vbGQta2V5LW9sZC1rZXktb2xkLWtleS1vbGQta2V5LW9sZC1rZXk=";
    let tmp = TempDir::new("helm-upgrade");
    let chart = tmp.0.join("egret");
    copy_dir(&chart_dir(), &chart);
    let file = chart.join("templates/ha-secret.yaml");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains(CALL), "templates/ha-secret.yaml no longer calls {CALL}");
    let key_of = |text: &str| {
        std::fs::write(&file, text).unwrap();
        let out = try_render_chart(&chart, "egret", NAMESPACE, &[]).unwrap();
        scalar(lookup(one(&docs(&out), "Secret", "gateway"), "data.key"))
    };
    let found = format!(r#"dict "data" (dict "key" "{old}")"#);
    assert_eq!(key_of(&text.replace(CALL, &found)), old, "an upgrade keeps the key");
    // A Secret without the key (edited by hand) gets a new one, as does an install.
    let fresh = key_of(&text.replace(CALL, r#"dict "data" (dict "other" "eA==")"#));
    assert_ne!(fresh, old);
    assert!(base64_decode(&fresh).len() >= 48);
    assert_ne!(key_of(&text), key_of(&text), "an install draws a random key");
}

/// Standard base64 (RFC 4648 §4), padded, as a Secret's data.
fn base64_decode(s: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.trim().bytes().filter(|&c| c != b'=') {
        let v = ALPHABET.iter().position(|&a| a == c).unwrap_or_else(|| panic!("not base64: {s:?}"));
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// A stopping pod tells an uninstall from a restart by its DaemonSet
/// (controlplane/src/k8s/uninstall.rs): both DaemonSets name their own Pod
/// from the downward API, both service accounts may read it and the
/// DaemonSets of their namespace, in the chart and the plain manifests.
#[test]
fn both_daemonsets_can_tell_an_uninstall_from_a_restart() {
    for (what, docs) in [("chart", render("egret", NAMESPACE, &[])), ("manifests", manifest_docs())] {
        let daemonsets: Vec<&Value> = docs.iter().filter(|d| kind(d) == "DaemonSet").collect();
        assert_eq!(daemonsets.len(), 2, "{what}");
        let mut accounts = Vec::new();
        for ds in daemonsets {
            let env = container(ds)["env"].as_array().unwrap();
            for (var, field) in [("POD_NAME", "metadata.name"), ("POD_NAMESPACE", "metadata.namespace")] {
                let e = env.iter().find(|e| scalar(&e["name"]) == var);
                let e = e.unwrap_or_else(|| panic!("{what}: {} has no {var}", name(ds)));
                assert_eq!(scalar(lookup(e, "valueFrom.fieldRef.fieldPath")), field, "{what}: {var}");
            }
            accounts.push(scalar(lookup(pod_spec(ds), "serviceAccountName")));
        }
        let role = docs
            .iter()
            .find(|d| kind(d) == "Role" && scalar(&lookup(d, "rules")[0]["resources"][0]) == "daemonsets")
            .unwrap_or_else(|| panic!("{what}: a Role reading DaemonSets"));
        let verbs: Vec<String> = lookup(role, "rules")[0]["verbs"].as_array().unwrap().iter().map(scalar).collect();
        assert_eq!(verbs, ["get", "list", "watch"], "{what}");
        let rb = docs.iter().find(|d| kind(d) == "RoleBinding" && scalar(lookup(d, "roleRef.name")) == name(role));
        let bound: Vec<String> =
            lookup(rb.unwrap(), "subjects").as_array().unwrap().iter().map(|s| scalar(&s["name"])).collect();
        for a in &accounts {
            assert!(bound.contains(a), "{what}: {a} reads its DaemonSet: bound {bound:?}");
        }
        let node_role = docs
            .iter()
            .find(|d| kind(d) == "ClusterRole" && (component(d) == Some("node") || name(d).ends_with("node")));
        let node_rules = lookup(node_role.unwrap(), "rules").as_array().unwrap().clone();
        assert!(
            node_rules.iter().any(|r| r["resources"].as_array().unwrap().iter().any(|x| scalar(x) == "pods")
                && r["verbs"].as_array().unwrap().iter().any(|v| scalar(v) == "get")),
            "{what}: the node agent reads its own Pod"
        );
    }
}

// ------------------------------------ the cluster's settings (issue 29 §3) ---

/// The ConfigMap of `deploy/manifests/` holding the cluster's settings,
/// which both DaemonSets read (the chart's `cluster.*` values).
const CLUSTER_CONFIGMAP: &str = "egret-cluster";

/// Its keys, and for each the DaemonSets (by component) that take it.
const CLUSTER_KEYS: [(&str, &[&str]); 5] = [
    ("gateway-label", &["gateway"]),
    ("nat-ports", &["gateway", "node"]),
    ("pod-cidrs", &["gateway", "node"]),
    ("service-cidrs", &["node"]),
    ("tunnel-port", &["gateway", "node"]),
];

/// `egret-cluster`'s data.
fn cluster_settings(docs: &[Value]) -> std::collections::BTreeMap<String, String> {
    let cm = docs
        .iter()
        .find(|d| kind(d) == "ConfigMap" && name(d) == CLUSTER_CONFIGMAP)
        .unwrap_or_else(|| panic!("no ConfigMap {CLUSTER_CONFIGMAP} in deploy/manifests"));
    let data = lookup(cm, "data").as_object().unwrap_or_else(|| panic!("{CLUSTER_CONFIGMAP} has no data"));
    data.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or_else(|| panic!("{k}: {v:?}")).to_string())).collect()
}

/// Every string of `v` (scalars and mapping keys), with its path.
fn strings_in(v: &Value, path: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::String(s) => out.push((path.to_string(), s.clone())),
        Value::Array(a) => a.iter().enumerate().for_each(|(i, x)| strings_in(x, &format!("{path}[{i}]"), out)),
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                out.push((format!("{p} (key)"), k.clone()));
                strings_in(x, &p, out);
            }
        }
        _ => {}
    }
}

/// Where `literal` is written in `docs`: "Kind name: path" of each string
/// that contains it (an embedded file, such as gateway.yaml, counts).
fn places_of(docs: &[Value], literal: &str) -> Vec<String> {
    let mut out = Vec::new();
    for d in docs {
        let mut strings = Vec::new();
        strings_in(d, "", &mut strings);
        for (path, s) in strings {
            if s.contains(literal) {
                out.push(format!("{} {}: {path}", kind(d), name(d)));
            }
        }
    }
    out
}

/// The address the downward API gives as `status.hostIP` below.
const HOST_IP: &str = "192.0.2.10";

/// The arguments the kubelet starts `ds`'s container with: its env filled
/// (literal values; the downward API's fields; a ConfigMap's key, from the
/// ConfigMaps among `docs`; a missing ConfigMap or key fails, as the pod
/// would with CreateContainerConfigError), then `$(VAR)` expanded in args.
fn kubelet_args(docs: &[Value], ds: &Value) -> Vec<String> {
    let what = name(ds);
    let env: Vec<(String, String)> = container(ds)["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let var = scalar(&e["name"]);
            let value = if let Some(v) = e.get("value") {
                scalar(v)
            } else if let Some(f) = e["valueFrom"].get("fieldRef") {
                match scalar(&f["fieldPath"]).as_str() {
                    "spec.nodeName" => "node-1".to_string(),
                    "metadata.name" => format!("{what}-x1"),
                    "metadata.namespace" => scalar(lookup(ds, "metadata.namespace")),
                    "status.hostIP" => HOST_IP.to_string(),
                    other => panic!("{what}: env {var}: a field this test does not know ({other})"),
                }
            } else if let Some(r) = e["valueFrom"].get("configMapKeyRef") {
                let (cm, key) = (scalar(&r["name"]), scalar(&r["key"]));
                let found = docs.iter().find(|d| {
                    kind(d) == "ConfigMap" && name(d) == cm && d["metadata"]["namespace"] == ds["metadata"]["namespace"]
                });
                let found = found.unwrap_or_else(|| panic!("{what}: env {var}: no ConfigMap {cm} in its namespace"));
                scalar(found["data"].get(&key).unwrap_or_else(|| panic!("{what}: env {var}: {cm} has no key {key}")))
            } else {
                panic!("{what}: env {var}: a source this test does not know: {e:?}")
            };
            (var, value)
        })
        .collect();
    container(ds)["args"].as_array().unwrap().iter().map(|a| expand(&scalar(a), &env)).collect()
}

/// The plain manifests write each of the cluster's settings once, in the
/// ConfigMap egret-cluster, and both DaemonSets take them from there (env
/// `valueFrom.configMapKeyRef`, `$(VAR)` in their args), as the chart takes
/// them from `cluster.*`: a pod CIDR, a Service CIDR or the port range
/// written anywhere else (a DaemonSet's args, the gateway's file) is a
/// second place to forget. The gateway label is the one exception
/// Kubernetes imposes: a DaemonSet's nodeSelector and affinity cannot come
/// from a ConfigMap, so it is also written there (and as the taint the
/// gateway tolerates), and there it must be egret-cluster's.
#[test]
fn the_plain_manifests_name_each_cluster_setting_once() {
    let docs = manifest_docs();
    let cluster = cluster_settings(&docs);
    let keys: Vec<&str> = cluster.keys().map(String::as_str).collect();
    assert_eq!(keys, CLUSTER_KEYS.map(|(k, _)| k), "{CLUSTER_CONFIGMAP}'s keys");
    let at = |key: &str| format!("ConfigMap {CLUSTER_CONFIGMAP}: data.{key}");
    for key in ["pod-cidrs", "service-cidrs", "nat-ports", "tunnel-port"] {
        for literal in cluster[key].split(',') {
            assert!(!literal.trim().is_empty(), "{key}: {:?} has an empty item", cluster[key]);
            assert_eq!(places_of(&docs, literal), [at(key)], "{key}: {literal} is written in more than one place");
        }
    }
    // The gateway label.
    let label = &cluster["gateway-label"];
    let (lkey, lvalue) = label.split_once('=').unwrap_or_else(|| panic!("gateway-label: {label:?} is not KEY=VALUE"));
    let gw = one(&docs, "DaemonSet", "gateway");
    let node = one(&docs, "DaemonSet", "node");
    assert_eq!(
        places_of(&docs, lkey),
        [
            at("gateway-label"),
            format!("DaemonSet egret-gateway: spec.template.spec.nodeSelector.{lkey} (key)"),
            "DaemonSet egret-gateway: spec.template.spec.tolerations[0].key".to_string(),
            "DaemonSet egret-node: spec.template.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution\
             .nodeSelectorTerms[0].matchExpressions[0].key"
                .to_string(),
        ],
        "the gateway label {lkey} is written only where Kubernetes cannot take it from {CLUSTER_CONFIGMAP}"
    );
    assert_eq!(
        lookup(pod_spec(gw), "nodeSelector").get(lkey).map(scalar).as_deref(),
        Some(lvalue),
        "the gateways run on the Nodes labelled {label}"
    );
    let term = &lookup(
        pod_spec(node),
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms",
    )[0]["matchExpressions"][0];
    assert_eq!(
        (scalar(&term["key"]), scalar(&term["operator"]), term["values"].clone()),
        (lkey.to_string(), "NotIn".to_string(), serde_json::json!([lvalue])),
        "the agent stays off the Nodes labelled {label}"
    );
    // Both DaemonSets take the settings from the ConfigMap and use them.
    for (comp, ds) in [("gateway", gw), ("node", node)] {
        let env = container(ds)["env"].as_array().unwrap();
        let args: Vec<String> = container(ds)["args"].as_array().unwrap().iter().map(scalar).collect();
        for (key, takers) in CLUSTER_KEYS.iter().filter(|(_, t)| t.contains(&comp)) {
            let var = env
                .iter()
                .find(|e| {
                    let r = &e["valueFrom"]["configMapKeyRef"];
                    r["name"] == CLUSTER_CONFIGMAP && r["key"] == *key
                })
                .map(|e| scalar(&e["name"]))
                .unwrap_or_else(|| panic!("{comp}: no env from {CLUSTER_CONFIGMAP}'s {key} (taken by {takers:?})"));
            assert!(args.iter().any(|a| a.contains(&format!("$({var})"))), "{comp}: $({var}) ({key}) not in {args:?}");
        }
    }
}

/// The settings reach both processes as the chart's do: with egret-cluster's
/// values as shipped and with others, the kubelet's expansion of each
/// DaemonSet's args gives the node agent the chart's arguments for the same
/// `cluster.*` values, and the gateway, whose flags replace its file's
/// values, the chart's configuration (what `egret check-config` says of
/// the file with the DaemonSet's flags, the real parser of the real binary).
#[test]
fn the_cluster_settings_reach_both_processes_as_the_charts_do() {
    let shipped = cluster_settings(&manifest_docs());
    let other: std::collections::BTreeMap<String, String> = [
        ("gateway-label", "example.com/egress=yes"),
        ("nat-ports", "40000-49999"),
        ("pod-cidrs", "10.1.0.0/16,fd00:10::/56"),
        ("service-cidrs", "10.2.0.0/16,fd00:20::/108"),
        ("tunnel-port", "7000"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    let egret = egret_tests::gateway::egret_binary().unwrap_or_else(|e| panic!("{e}"));
    let tmp = TempDir::new("cluster-settings");
    for values in [shipped, other] {
        let mut manifests = manifest_docs();
        for d in manifests.iter_mut().filter(|d| kind(d) == "ConfigMap" && name(d) == CLUSTER_CONFIGMAP) {
            for (k, v) in &values {
                d["data"][k] = Value::String(v.clone());
            }
        }
        let (lkey, lvalue) = values["gateway-label"].split_once('=').unwrap();
        let list = |k: &str| format!("{{{}}}", values[k]);
        let chart = render(
            "egret",
            NAMESPACE,
            &[
                "--set",
                &format!("cluster.podCIDRs={}", list("pod-cidrs")),
                "--set",
                &format!("cluster.serviceCIDRs={}", list("service-cidrs")),
                "--set",
                &format!("cluster.gatewayLabel.key={lkey}"),
                "--set-string",
                &format!("cluster.gatewayLabel.value={lvalue}"),
                "--set",
                &format!("config.nat.ports={}", values["nat-ports"]),
                "--set",
                &format!("config.tunnel.port={}", values["tunnel-port"]),
            ],
        );
        // The node agent: the chart's arguments (which leave --strict at its default).
        let m = kubelet_args(&manifests, one(&manifests, "DaemonSet", "node"));
        let c = kubelet_args(&chart, one(&chart, "DaemonSet", "node"));
        let all_cidrs = format!("{},{}", values["pod-cidrs"], values["service-cidrs"]);
        for want in [
            format!("--cluster-cidr={all_cidrs}"),
            format!("--nat-ports={}", values["nat-ports"]),
            format!("--tunnel-port={}", values["tunnel-port"]),
        ] {
            assert!(m.contains(&want), "the manifests' agent: {want} not in {m:?}");
        }
        for a in &m {
            assert!(c.contains(a), "the manifests' agent has {a}, the chart's {c:?}");
        }
        let extra: Vec<&String> = c.iter().filter(|a| !m.contains(a)).collect();
        assert_eq!(extra, ["--strict=false"], "the chart's agent arguments the manifests' lacks");
        // The gateway: its file with its flags, as check-config reads them.
        let mut said = Vec::new();
        for (what, docs) in [("manifests", &manifests), ("chart", &chart)] {
            let args = kubelet_args(docs, one(docs, "DaemonSet", "gateway"));
            assert_eq!(args[0], "gateway", "{what}: {args:?}");
            assert_eq!(args.iter().filter(|a| a.starts_with("--config")).count(), 1, "{what}: {args:?}");
            let file = tmp.0.join(format!("{what}.yaml"));
            let text = scalar(&lookup(one(docs, "ConfigMap", "gateway"), "data")["gateway.yaml"]);
            std::fs::write(&file, text).unwrap();
            let flags: Vec<&String> = args[1..].iter().filter(|a| *a != "--config=/etc/egret/gateway.yaml").collect();
            assert_eq!(flags.len(), args.len() - 2, "{what}: --config=/etc/egret/gateway.yaml in {args:?}");
            let out = Command::new(&egret).arg("check-config").arg(&file).args(&flags).output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(
                out.status.success(),
                "{what}: egret check-config {flags:?}: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(!text.contains("warning"), "{what}: {text}");
            let lines: Vec<String> = text
                .lines()
                .filter(|l| l.starts_with("gateway Nodes: ") || l.starts_with("nat ports ") || l.starts_with("tunnel "))
                .map(str::to_string)
                .collect();
            assert_eq!(
                lines,
                [
                    format!("nat ports {}", values["nat-ports"]),
                    format!("tunnel port {}: from every Node's InternalIPs", values["tunnel-port"]),
                    format!("gateway Nodes: {}; cluster pod CIDRs: {}", values["gateway-label"], values["pod-cidrs"]),
                ],
                "{what}: {text}"
            );
            said.push(lines);
        }
        assert_eq!(said[0], said[1]);
    }
}
