//! Smoke test of the real control plane used by Egret's Kubernetes integration tests:
//! starts kube-apiserver + etcd on 127.0.0.1 (`egret_tests::apiserver`), exercises every
//! API the control plane relies on (namespaces, a v1 CRD with a status subresource, a
//! custom object with server-side apply and a watch, a coordination.k8s.io/v1 Lease with
//! optimistic concurrency, a LoadBalancer Service's status), cuts the API server off and
//! brings it back, then checks that stopping leaves no process behind.
//!
//! Skipped (with a message) when not root or when the API server is not built; with
//! `EGRET_REQUIRE_APISERVER=1` (CI) that is a failure instead.

// Test code: a failed expectation is the test's failure report.
#![allow(clippy::expect_used, clippy::panic)]

use std::time::Duration;

use egret_tests::apiserver::{processes_of, ApiServer};
use futures_util::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use serde_json::json;

const NS: &str = "egret-smoke";
const GROUP: &str = "smoke.egret.test";
const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "current_thread")]
async fn control_plane_smoke() {
    match ApiServer::available_or_skip("control_plane_smoke") {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    let server = ApiServer::start().expect("start kube-apiserver + etcd");
    let state = server.state_dir().map(ToOwned::to_owned);
    let client = server.client().await.expect("client from the generated kubeconfig");

    namespace(&client).await;
    let objects = custom_resource(&client).await;
    custom_object_apply_status_and_watch(&objects).await;
    lease_conflict(&client).await;
    load_balancer_status(&client).await;
    if state.is_some() {
        cut_off_and_back(&server, &client).await;
    }

    server.stop().expect("stop");
    if let Some(state) = state {
        assert_eq!(processes_of(&state), vec![], "processes left after stop");
        assert!(!state.exists(), "state directory {} left after stop", state.display());
    }
}

async fn namespace(client: &kube::Client) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({ "metadata": { "name": NS } })).expect("namespace json");
    let created = namespaces.create(&PostParams::default(), &ns).await.expect("create namespace");
    assert_eq!(created.metadata.name.as_deref(), Some(NS));
    let phase = created.status.and_then(|s| s.phase);
    assert_eq!(phase.as_deref(), Some("Active"));
}

/// Creates the CRD `widgets.smoke.egret.test` (namespaced, v1, status subresource), waits
/// until it is Established, and returns an API for its objects in [`NS`].
async fn custom_resource(client: &kube::Client) -> Api<DynamicObject> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": { "name": format!("widgets.{GROUP}") },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": { "plural": "widgets", "singular": "widget", "kind": "Widget" },
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "subresources": { "status": {} },
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": {
                        "spec": { "type": "object", "properties": { "ip": { "type": "string" } } },
                        "status": { "type": "object", "properties": { "owner": { "type": "string" } } }
                    }
                }}
            }]
        }
    }))
    .expect("crd json");
    crds.create(&PostParams::default(), &crd).await.expect("create CRD");

    let name = format!("widgets.{GROUP}");
    let established = tokio::time::timeout(WAIT, async {
        loop {
            let crd = crds.get(&name).await.expect("get CRD");
            let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
            if conditions.iter().any(|c| c.type_ == "Established" && c.status == "True") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(established.is_ok(), "CRD {name} not Established within {WAIT:?}");

    let gvk = GroupVersionKind::gvk(GROUP, "v1", "Widget");
    Api::namespaced_with(client.clone(), NS, &ApiResource::from_gvk_with_plural(&gvk, "widgets"))
}

fn widget(ip: &str) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": format!("{GROUP}/v1"),
        "kind": "Widget",
        "metadata": { "name": "w1", "namespace": NS },
        "spec": { "ip": ip }
    }))
    .expect("widget json")
}

async fn next_change(
    stream: &mut (impl futures_util::Stream<Item = kube::Result<WatchEvent<DynamicObject>>> + Unpin),
) -> WatchEvent<DynamicObject> {
    loop {
        let event = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("watch event within the deadline")
            .expect("watch stream ended")
            .expect("watch event");
        if !matches!(event, WatchEvent::Bookmark(_)) {
            return event;
        }
    }
}

async fn custom_object_apply_status_and_watch(widgets: &Api<DynamicObject>) {
    let created = widgets.create(&PostParams::default(), &widget("192.0.2.10")).await.expect("create widget");
    let rv = created.metadata.resource_version.clone().expect("resourceVersion");
    let mut events =
        widgets.watch(&WatchParams::default().fields("metadata.name=w1"), &rv).await.expect("watch widgets").boxed();

    // Server-side apply changes the spec.
    let ssa = PatchParams::apply("egret-smoke").force();
    widgets.patch("w1", &ssa, &Patch::Apply(widget("192.0.2.11"))).await.expect("server-side apply");
    match next_change(&mut events).await {
        WatchEvent::Modified(obj) => {
            assert_eq!(obj.data["spec"]["ip"], json!("192.0.2.11"));
            assert_eq!(obj.data.get("status"), None);
        }
        other => panic!("expected Modified after apply, got {other:?}"),
    }

    // The status subresource changes status only ...
    let status = json!({ "status": { "owner": "node-a" }, "spec": { "ip": "198.51.100.99" } });
    widgets.patch_status("w1", &PatchParams::default(), &Patch::Merge(&status)).await.expect("patch status");
    match next_change(&mut events).await {
        WatchEvent::Modified(obj) => {
            assert_eq!(obj.data["status"]["owner"], json!("node-a"));
            assert_eq!(obj.data["spec"]["ip"], json!("192.0.2.11"), "status patch changed spec");
        }
        other => panic!("expected Modified after status patch, got {other:?}"),
    }
    // ... and the main resource ignores status.
    let main = json!({ "status": { "owner": "intruder" } });
    let after = widgets.patch("w1", &PatchParams::default(), &Patch::Merge(&main)).await.expect("patch main");
    assert_eq!(after.data["status"]["owner"], json!("node-a"));
}

fn lease(holder: &str, resource_version: Option<String>) -> Lease {
    serde_json::from_value(json!({
        "metadata": { "name": "egress-192-0-2-10", "namespace": NS, "resourceVersion": resource_version },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": 15,
            "renewTime": "2025-01-01T00:00:00.000000Z"
        }
    }))
    .expect("lease json")
}

async fn lease_conflict(client: &kube::Client) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    let pp = PostParams::default();
    let created = leases.create(&pp, &lease("node-a", None)).await.expect("create lease");
    let stale = created.metadata.resource_version.clone();

    let taken = leases
        .replace("egress-192-0-2-10", &pp, &lease("node-b", stale.clone()))
        .await
        .expect("replace with current rv");
    assert_ne!(taken.metadata.resource_version, stale);

    let err = leases
        .replace("egress-192-0-2-10", &pp, &lease("node-c", stale))
        .await
        .expect_err("a replace with a stale resourceVersion must fail");
    match err {
        kube::Error::Api(status) => {
            assert_eq!(status.code, 409, "{status:?}");
            assert!(status.is_conflict(), "{status:?}");
        }
        other => panic!("expected a 409 Conflict, got {other}"),
    }
    let now = leases.get("egress-192-0-2-10").await.expect("get lease");
    assert_eq!(now.spec.and_then(|s| s.holder_identity).as_deref(), Some("node-b"));
}

async fn load_balancer_status(client: &kube::Client) {
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let svc: Service = serde_json::from_value(json!({
        "metadata": { "name": "egress-gw", "namespace": NS },
        "spec": { "type": "LoadBalancer", "ports": [{ "name": "http", "port": 80, "protocol": "TCP" }] }
    }))
    .expect("service json");
    let created = services.create(&PostParams::default(), &svc).await.expect("create service");
    let cluster_ip = created.spec.and_then(|s| s.cluster_ip).expect("clusterIP allocated");
    assert!(cluster_ip.starts_with("192.0.2."), "clusterIP {cluster_ip} outside the 192.0.2.0/24 service range");

    let status = json!({ "status": { "loadBalancer": { "ingress": [{ "ip": "203.0.113.7" }] } } });
    services
        .patch_status("egress-gw", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("patch service status");
    let got = services.get("egress-gw").await.expect("get service");
    let ingress = got.status.and_then(|s| s.load_balancer).and_then(|lb| lb.ingress).unwrap_or_default();
    assert_eq!(ingress.len(), 1);
    assert_eq!(ingress[0].ip.as_deref(), Some("203.0.113.7"));
}

/// Kills the API server: requests fail; restarts it: the same client works again and
/// the data survived in etcd.
async fn cut_off_and_back(server: &ApiServer, client: &kube::Client) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    server.kill_apiserver().await.expect("kill apiserver");
    let cut = tokio::time::timeout(WAIT, leases.get("egress-192-0-2-10")).await.expect("request gives up");
    assert!(cut.is_err(), "request succeeded with the API server killed: {cut:?}");

    server.restart_apiserver().await.expect("restart apiserver");
    let back = leases.get("egress-192-0-2-10").await.expect("get lease after restart");
    assert_eq!(back.spec.and_then(|s| s.holder_identity).as_deref(), Some("node-b"));
}
