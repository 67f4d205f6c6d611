//! Pod identity for translation logs (ADR 0034 §3): which pod (namespace,
//! name, UID) holds an address, as the control plane last observed it.
//!
//! Under Kubernetes the controller replaces the map after every pass over
//! the cluster's state (`k8s/controller.rs`, from the same pod cache and
//! the same one-pod-per-address rule as the policies, `observe::pods`).
//! The exporter reads it when it takes records from the workers' rings, so
//! each event carries the identity its pod had then: an address given to
//! another pod later never rewrites what was logged. Nothing here is read
//! by a worker. From the YAML file there is no identity: the map stays
//! empty and the fields are left out.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

/// A pod's identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodIdentity {
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`.
    pub uid: String,
}

/// Address → identity, one map per pass.
pub type IdentityMap = HashMap<IpAddr, Arc<PodIdentity>>;

/// Address → identity, shared between the controller (writer, once per
/// pass) and the exporter (reader, once per event). Cheap to clone: one
/// `Arc`. Compares by pointer (it is a slot, not a value).
#[derive(Clone, Debug, Default)]
pub struct PodIdentities(Arc<RwLock<Option<Arc<IdentityMap>>>>);

impl PartialEq for PodIdentities {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for PodIdentities {}

impl PodIdentities {
    /// Replaces the map (unchanged contents keep the old one, so readers
    /// holding it see no difference).
    pub fn set(&self, map: IdentityMap) {
        if self.0.read().as_deref() != Some(&map) {
            *self.0.write() = Some(Arc::new(map));
        }
    }

    /// The current map, for a batch of look-ups without the lock; `None`
    /// until one is published (file mode: never).
    pub fn snapshot(&self) -> Option<Arc<IdentityMap>> {
        self.0.read().clone()
    }

    /// The pod holding `ip` now, if known.
    pub fn get(&self, ip: IpAddr) -> Option<Arc<PodIdentity>> {
        self.0.read().as_ref()?.get(&ip).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> Arc<PodIdentity> {
        Arc::new(PodIdentity { namespace: "ns".into(), name: name.into(), uid: format!("uid-{name}") })
    }

    #[test]
    fn a_snapshot_keeps_the_identity_it_was_taken_with() {
        let ids = PodIdentities::default();
        let ip: IpAddr = "10.244.1.7".parse().unwrap();
        assert_eq!(ids.get(ip), None);
        assert!(ids.snapshot().is_none(), "nothing published: no identities at all");
        ids.set(HashMap::from([(ip, id("a"))]));
        let before = ids.snapshot().unwrap();
        // The address goes to another pod.
        ids.set(HashMap::from([(ip, id("b"))]));
        assert_eq!(before.get(&ip).unwrap().name, "a");
        assert_eq!(ids.get(ip).unwrap().name, "b");
        assert_eq!(ids.clone(), ids);
        assert_ne!(ids, PodIdentities::default());
    }
}
