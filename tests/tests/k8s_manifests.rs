//! Every deployment manifest against the real API server, with server-side
//! dry run (server-side apply, `dryRun=All`): the generated CRDs, the plain
//! manifests in `deploy/manifests/`, and the Helm chart's templates rendered
//! with its default values. `helm` is not available here, so the chart is
//! rendered by a small renderer that knows exactly the template constructs
//! the chart uses (`.Values`/`.Release`/`.Chart` lookups, `toYaml`, `quote`,
//! `nindent`) and fails on anything else.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::path::{Path, PathBuf};

use egret_tests::apiserver::ApiServer;
use kube::discovery::Discovery;
use serde::Deserialize;
use serde_yaml::Value;

const NAMESPACE: &str = "egret-system";

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
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
        .fold(root, |v, key| v.get(key).unwrap_or_else(|| panic!("no value at {path}")))
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        other => panic!("not a scalar: {other:?}"),
    }
}

fn indent(text: &str, n: usize) -> String {
    let pad = " ".repeat(n);
    text.trim_end_matches('\n')
        .lines()
        .map(|l| if l.is_empty() { String::new() } else { format!("{pad}{l}") })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Renders the chart's template constructs with `values`.
fn render(template: &str, values: &Value, chart: &Value) -> String {
    let mut out = String::new();
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        let (before, after) = rest.split_at(start);
        let end = after.find("}}").expect("unclosed action");
        let mut action = &after[2..end];
        rest = &after[end + 2..];
        out.push_str(before);
        if let Some(a) = action.strip_prefix('-') {
            action = a;
            let trimmed = out.trim_end().len();
            out.truncate(trimmed);
        }
        if let Some(a) = action.strip_suffix('-') {
            action = a;
            rest = rest.trim_start();
        }
        let mut stages = action.split('|').map(str::trim);
        let head = stages.next().unwrap();
        let (to_yaml, path) = match head.strip_prefix("toYaml ") {
            Some(p) => (true, p.trim()),
            None => (false, head),
        };
        let value = if let Some(p) = path.strip_prefix(".Values.") {
            lookup(values, p).clone()
        } else if path == ".Release.Namespace" {
            Value::String(NAMESPACE.into())
        } else if path == ".Release.Name" {
            Value::String("egret".into())
        } else if let Some(p) = path.strip_prefix(".Chart.") {
            let key = format!("{}{}", p[..1].to_lowercase(), &p[1..]);
            lookup(chart, &key).clone()
        } else {
            panic!("unsupported template expression {path:?}");
        };
        let mut text = if to_yaml { serde_yaml::to_string(&value).unwrap() } else { scalar(&value) };
        for f in stages {
            let mut parts = f.split_whitespace();
            match (parts.next(), parts.next()) {
                (Some("quote"), None) => text = format!("{text:?}"),
                (Some("nindent"), Some(n)) => text = format!("\n{}", indent(&text, n.parse().unwrap())),
                (Some("indent"), Some(n)) => text = indent(&text, n.parse().unwrap()),
                _ => panic!("unsupported template function {f:?}"),
            }
        }
        out.push_str(&text);
    }
    out.push_str(rest);
    out
}

#[test]
fn every_manifest_passes_server_side_dry_run() {
    match ApiServer::available_or_skip("every_manifest_passes_server_side_dry_run") {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    let server = ApiServer::start().expect("start kube-apiserver + etcd");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let client = server.client().await.expect("client");
        // The CRDs and the namespace for real (namespaced objects need their namespace).
        k8s_common::install_crds(&client).await;
        k8s_common::namespace(&client, NAMESPACE, serde_json::json!({})).await;
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
        let chart_dir = deploy().join("helm/egret");
        let values: Value =
            serde_yaml::from_str(&std::fs::read_to_string(chart_dir.join("values.yaml")).unwrap()).unwrap();
        let chart: Value =
            serde_yaml::from_str(&std::fs::read_to_string(chart_dir.join("Chart.yaml")).unwrap()).unwrap();
        let mut kinds = Vec::new();
        for file in yaml_files(&chart_dir.join("templates")) {
            let rendered = render(&std::fs::read_to_string(&file).unwrap(), &values, &chart);
            for obj in k8s_common::documents(&rendered) {
                k8s_common::apply_object(&client, &discovery, &format!("{} (rendered)", file.display()), &obj, true)
                    .await;
                kinds.push(obj.types.clone().unwrap().kind);
                count += 1;
            }
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
                "Role",
                "RoleBinding",
                "ServiceAccount",
                "ServiceAccount"
            ]
        );
        assert_eq!(
            count,
            4 + 12 + 11,
            "CRDs twice, 11 manifests + the namespace (gateway and node agent), 11 rendered templates"
        );
    });
    drop(rt);
    server.stop().expect("stop");
}

#[test]
fn the_renderer_handles_the_charts_constructs() {
    let values: Value = serde_yaml::from_str("a:\n  b: x\nm:\n  k: v\n  l: [1, 2]\ns: |\n  one\n  two\n").unwrap();
    let chart: Value = serde_yaml::from_str("appVersion: \"1.2\"").unwrap();
    assert_eq!(render("n: {{ .Values.a.b }}", &values, &chart), "n: x");
    assert_eq!(render("v: {{ .Chart.AppVersion | quote }}", &values, &chart), "v: \"1.2\"");
    assert_eq!(
        render("m:\n  {{- toYaml .Values.m | nindent 2 }}\n", &values, &chart),
        "m:\n  k: v\n  l:\n  - 1\n  - 2\n"
    );
    assert_eq!(render("c: |\n    {{- .Values.s | nindent 4 }}", &values, &chart), "c: |\n    one\n    two");
    assert_eq!(render("ns: {{ .Release.Namespace }}", &values, &chart), "ns: egret-system");
}

/// The DaemonSets of `deploy/manifests/` and of the rendered chart: each object's
/// path (for messages) and its pod template's spec.
fn daemonset_pod_specs() -> Vec<(String, Value)> {
    let chart_dir = deploy().join("helm/egret");
    let values: Value = serde_yaml::from_str(&std::fs::read_to_string(chart_dir.join("values.yaml")).unwrap()).unwrap();
    let chart: Value = serde_yaml::from_str(&std::fs::read_to_string(chart_dir.join("Chart.yaml")).unwrap()).unwrap();
    let mut texts = Vec::new();
    for file in yaml_files(&deploy().join("manifests")) {
        texts.push((file.display().to_string(), std::fs::read_to_string(&file).unwrap()));
    }
    for file in yaml_files(&chart_dir.join("templates")) {
        let rendered = render(&std::fs::read_to_string(&file).unwrap(), &values, &chart);
        texts.push((format!("{} (rendered)", file.display()), rendered));
    }
    let mut specs = Vec::new();
    for (name, text) in texts {
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v = Value::deserialize(doc).unwrap();
            if v.get("kind").and_then(Value::as_str) == Some("DaemonSet") {
                specs.push((name.clone(), lookup(&v, "spec.template.spec").clone()));
            }
        }
    }
    specs
}

#[test]
fn every_daemonset_runs_under_the_runtime_default_seccomp_profile() {
    let specs = daemonset_pod_specs();
    assert_eq!(specs.len(), 4, "the gateway's and the node agent's, in deploy/manifests and in the chart: {specs:?}");
    for (name, spec) in specs {
        let profile = spec.get("securityContext").and_then(|s| s.get("seccompProfile")).and_then(|p| p.get("type"));
        assert_eq!(
            profile.and_then(Value::as_str),
            Some("RuntimeDefault"),
            "{name}: the pod's securityContext.seccompProfile.type must be RuntimeDefault"
        );
        // No container may override it with a weaker profile.
        for c in spec.get("containers").and_then(Value::as_sequence).into_iter().flatten() {
            let own = c.get("securityContext").and_then(|s| s.get("seccompProfile")).and_then(|p| p.get("type"));
            assert!(
                own.is_none() || own.and_then(Value::as_str) == Some("RuntimeDefault"),
                "{name}: container {:?} overrides the seccomp profile with {own:?}",
                c.get("name")
            );
        }
    }
}

/// The gateway configuration the manifests and the chart ship is one the
/// daemon accepts (`egret check-config`'s loader), with the source guard set.
#[test]
fn the_shipped_gateway_configuration_loads() {
    let manifest: Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy().join("manifests/20-configmap.yaml")).unwrap()).unwrap();
    let values: Value =
        serde_yaml::from_str(&std::fs::read_to_string(deploy().join("helm/egret/values.yaml")).unwrap()).unwrap();
    let dir = std::env::temp_dir().join(format!("egret-shipped-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shipped = scalar(&manifest["data"]["gateway.yaml"]);
    for (name, text) in [("manifest", shipped), ("chart", scalar(lookup(&values, "config")))] {
        let path = dir.join(format!("{name}.yaml"));
        std::fs::write(&path, text).unwrap();
        let cfg = egret_controlplane::config::load(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
        let k = cfg.kubernetes.unwrap_or_else(|| panic!("{name}: Kubernetes mode"));
        assert!(!k.cluster_pod_cidrs.is_empty(), "{name}: clusterPodCIDRs is set");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
