//! The API requests of gateway liveness Leases (`liveness.rs` decides them):
//! this gateway's own create, acquire and renewals, and the expiry of
//! another gateway's Lease before one of its records is taken (ADR 0016).

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use tokio::time::Instant;

use super::controller::{failure, FIELD_MANAGER};
use super::crd::{LEASE_LABEL, LEASE_LABEL_VALUE};
use super::lease::{Failure, LeaseRecord};
use super::liveness::{
    liveness_lease_name, LivenessAction, EPOCH_ANNOTATION, EXPIRED_BY_ANNOTATION, GATEWAY_ANNOTATION,
};
use super::{observe, K8sOptions};

/// The outcome of one liveness request.
#[derive(Debug)]
pub struct LivenessResult {
    /// What was sent.
    pub action: LivenessAction,
    /// When.
    pub sent: Instant,
    /// The Lease written, or how it failed.
    pub result: Result<Option<LeaseRecord>, Failure>,
    /// After a conflict: the Lease as the API server has it now.
    pub fresh: Option<LeaseRecord>,
}

/// The gateway whose Lease `action` writes.
pub fn target<'a>(opts: &'a K8sOptions, action: &'a LivenessAction) -> &'a str {
    match action {
        LivenessAction::Expire { holder, .. } => holder,
        _ => &opts.node_name,
    }
}

/// The Lease object `action` writes; `prev` is the Lease as last seen.
pub fn liveness_object(
    opts: &K8sOptions,
    action: &LivenessAction,
    prev: Option<&LeaseRecord>,
    wall: Timestamp,
) -> Lease {
    let node = target(opts, action);
    let mut annotations = BTreeMap::from([(GATEWAY_ANNOTATION.to_string(), node.to_string())]);
    let owners = opts.lease_owner.merged(&opts.lease_namespace, prev.map(|p| p.owners.as_slice()).unwrap_or_default());
    let duration = i32::try_from(opts.timing.lease_duration.as_secs()).ok();
    let (rv, spec) = match action {
        LivenessAction::Create { epoch } => {
            annotations.insert(EPOCH_ANNOTATION.to_string(), epoch.to_string());
            (None, own_spec(opts, duration, Some(wall), wall, 0))
        }
        LivenessAction::Acquire { resource_version, epoch, transitions } => {
            annotations.insert(EPOCH_ANNOTATION.to_string(), epoch.to_string());
            (Some(resource_version.clone()), own_spec(opts, duration, Some(wall), wall, *transitions))
        }
        LivenessAction::Renew { resource_version } => {
            if let Some(e) = prev.and_then(|p| p.epoch) {
                annotations.insert(EPOCH_ANNOTATION.to_string(), e.to_string());
            }
            let acquired = prev.and_then(|p| p.acquire_time).or(Some(wall));
            let transitions = prev.map_or(0, |p| p.transitions);
            (Some(resource_version.clone()), own_spec(opts, duration, acquired, wall, transitions))
        }
        LivenessAction::Expire { resource_version, transitions, .. } => {
            // Its epoch stays (for operators); the cleared holder is what
            // voids its records.
            if let Some(e) = prev.and_then(|p| p.epoch) {
                annotations.insert(EPOCH_ANNOTATION.to_string(), e.to_string());
            }
            annotations.insert(EXPIRED_BY_ANNOTATION.to_string(), opts.node_name.clone());
            let spec = LeaseSpec {
                holder_identity: None,
                lease_duration_seconds: prev.and_then(|p| i32::try_from(p.duration.as_secs()).ok()).or(duration),
                acquire_time: None,
                renew_time: prev.and_then(|p| p.renew_time).map(MicroTime),
                lease_transitions: Some(*transitions),
                ..Default::default()
            };
            (Some(resource_version.clone()), spec)
        }
    };
    Lease {
        metadata: ObjectMeta {
            name: Some(liveness_lease_name(node)),
            namespace: Some(opts.lease_namespace.clone()),
            resource_version: rv,
            labels: Some(BTreeMap::from([(LEASE_LABEL.to_string(), LEASE_LABEL_VALUE.to_string())])),
            annotations: Some(annotations),
            owner_references: Some(owners).filter(|o| !o.is_empty()),
            ..Default::default()
        },
        spec: Some(spec),
    }
}

fn own_spec(
    opts: &K8sOptions,
    duration: Option<i32>,
    acquired: Option<Timestamp>,
    wall: Timestamp,
    transitions: i32,
) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(opts.node_name.clone()),
        lease_duration_seconds: duration,
        acquire_time: acquired.map(MicroTime),
        renew_time: Some(MicroTime(wall)),
        lease_transitions: Some(transitions),
        ..Default::default()
    }
}

/// Sends `action` (bounded by renewDeadline) and, after a conflict, reads
/// the Lease as the API server has it now (bounded by retryPeriod).
pub async fn send_liveness_request(
    api: Api<Lease>,
    opts: K8sOptions,
    action: LivenessAction,
    prev: Option<LeaseRecord>,
) -> LivenessResult {
    let sent = Instant::now();
    let result = send(&api, &opts, &action, prev.as_ref()).await;
    let fresh = match result {
        Err(Failure::Conflict) => {
            let name = liveness_lease_name(target(&opts, &action));
            let get = tokio::time::timeout(opts.timing.retry_period, api.get(&name)).await;
            get.ok().and_then(Result::ok).map(|l| observe::lease_record(&l))
        }
        _ => None,
    };
    LivenessResult { action, sent, result, fresh }
}

async fn send(
    api: &Api<Lease>,
    opts: &K8sOptions,
    action: &LivenessAction,
    prev: Option<&LeaseRecord>,
) -> Result<Option<LeaseRecord>, Failure> {
    let obj = liveness_object(opts, action, prev, Timestamp::now());
    let name = liveness_lease_name(target(opts, action));
    let pp = PostParams { field_manager: Some(FIELD_MANAGER.into()), ..Default::default() };
    let call = async {
        match action {
            LivenessAction::Create { .. } => api.create(&pp, &obj).await,
            _ => api.replace(&name, &pp, &obj).await,
        }
    };
    match tokio::time::timeout(opts.timing.renew_deadline, call).await {
        Ok(r) => r.map(|l| Some(observe::lease_record(&l))).map_err(failure),
        Err(_) => Err(Failure::Other(format!("no answer within {:?}", opts.timing.renew_deadline))),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn an_expiry_clears_the_holder_and_keeps_what_operators_read() {
        let opts = K8sOptions::new("gw-2");
        let prev = LeaseRecord {
            holder: Some("gw-1".into()),
            epoch: Some(41),
            duration: std::time::Duration::from_secs(4),
            resource_version: "7".into(),
            renew_time: Some(Timestamp::UNIX_EPOCH),
            ..Default::default()
        };
        let a = LivenessAction::Expire { holder: "gw-1".into(), resource_version: "7".into(), transitions: 3 };
        let l = liveness_object(&opts, &a, Some(&prev), Timestamp::now());
        assert_eq!(l.metadata.name.as_deref(), Some("egret-gw-gw-1"));
        assert_eq!(l.metadata.resource_version.as_deref(), Some("7"));
        let ann = l.metadata.annotations.unwrap();
        assert_eq!(ann.get(EPOCH_ANNOTATION).map(String::as_str), Some("41"));
        assert_eq!(ann.get(EXPIRED_BY_ANNOTATION).map(String::as_str), Some("gw-2"));
        assert_eq!(ann.get(GATEWAY_ANNOTATION).map(String::as_str), Some("gw-1"));
        let spec = l.spec.unwrap();
        assert_eq!(spec.holder_identity, None);
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(spec.renew_time.map(|t| t.0), Some(Timestamp::UNIX_EPOCH), "the last renewal stays");
    }

    #[test]
    fn our_own_writes_carry_the_epoch_and_the_duration() {
        let opts = K8sOptions::new("gw-1");
        let a = LivenessAction::Acquire { resource_version: "9".into(), epoch: 5, transitions: 2 };
        let l = liveness_object(&opts, &a, None, Timestamp::now());
        assert_eq!(l.metadata.annotations.as_ref().unwrap().get(EPOCH_ANNOTATION).map(String::as_str), Some("5"));
        let spec = l.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("gw-1"));
        assert_eq!(spec.lease_duration_seconds, Some(4));
        assert_eq!(spec.lease_transitions, Some(2));
    }
}
