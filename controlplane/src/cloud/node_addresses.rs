//! Worker Nodes' cloud addresses: `PerNode` policies naming a cloud pool
//! (ADR 0033).
//!
//! Each selected worker Node is given one of the pool's public addresses.
//! The elected status writer (a gateway: the Nodes' agents hold no cloud
//! credentials) makes the provider's calls for it, in the cloud task's
//! loop, and the pool's status records the outcome, which `egret node` on
//! that Node reads:
//!
//! 1. the Node's primary interface ([`Cloud::primary_interface`], from its
//!    `spec.providerID`, whatever its subnet);
//! 2. a secondary private address on it, chosen by the provider
//!    ([`Cloud::add_address`]), unless the record or a partly made
//!    assignment already names one (GCP: the public address itself);
//! 3. the public address associated with it ([`Cloud::assign`], the same
//!    always-made idempotent calls as a gateway's take-over);
//! 4. once per resync, [`Cloud::verify`], and the assignment made again on
//!    drift;
//! 5. a Node that leaves (deleted, or no longer selected) has its address
//!    released ([`Cloud::release`], which also ends the association).
//!
//! Only an address whose association succeeded is reported
//! ([`NodeAddresses::assigned`]) and so recorded: a Node never translates
//! to a private address the public one does not stand for. A gateway that
//! stops writing status forgets everything without releasing: the next
//! writer takes over from the record.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::task::{backoff, BACKOFF_MAX, RELEASE_ATTEMPTS};
use super::{Cloud, CloudError, NodeAddress, Provider, PublicAddress, HELD_ELSEWHERE};

/// A worker Node's public address: (Node name, public address).
pub type NodeKey = (String, IpAddr);

/// Where a worker Node's public address must go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeTarget {
    /// Whose address it is.
    pub provider: Provider,
    /// The Node's `spec.providerID`.
    pub provider_id: String,
    /// The public address.
    pub public: PublicAddress,
    /// What the pool's status records for this Node (the memory a restart
    /// or a new status writer starts from).
    pub recorded: Option<NodeAddress>,
}

/// What the status writer asks for in one pass.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeWants {
    /// The addresses the selected Nodes must have.
    pub want: BTreeMap<NodeKey, NodeTarget>,
    /// Every Node address the pools' status records now (with its
    /// provider): one no longer wanted is released.
    pub recorded: BTreeMap<NodeKey, (Provider, NodeAddress)>,
}

#[derive(Default)]
struct NodeState {
    wants: NodeWants,
    /// Associated: what the status may record.
    done: BTreeMap<NodeKey, NodeAddress>,
    /// A private address added, its association not made yet.
    partial: BTreeMap<NodeKey, NodeAddress>,
    /// Addresses whose recorded private address must not be used again
    /// (someone else holds it now).
    abandoned: BTreeSet<NodeKey>,
    /// The last failure and the attempts so far, per address being made.
    failures: BTreeMap<NodeKey, (u32, CloudError)>,
    /// When each address is next tried (not done) or checked (done).
    next: BTreeMap<NodeKey, Instant>,
    /// Addresses to release: (where, whose, attempts so far).
    releasing: BTreeMap<NodeKey, (NodeAddress, Provider, u32)>,
    drift_repairs: u64,
}

/// The worker Nodes' addresses the cloud task makes (one per gateway; only
/// the status writer's has anything to do).
#[derive(Default)]
pub struct NodeAddresses {
    state: Mutex<NodeState>,
}

impl std::fmt::Debug for NodeAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock();
        f.debug_struct("NodeAddresses").field("done", &st.done).field("releasing", &st.releasing).finish()
    }
}

impl NodeAddresses {
    /// The status writer's pass (`Some`), or this gateway does not write
    /// status (`None`: everything is forgotten, nothing released). Returns
    /// whether the task has something new to do.
    pub fn update(&self, wants: Option<NodeWants>) -> bool {
        let mut st = self.state.lock();
        let Some(wants) = wants else {
            let busy = !st.wants.want.is_empty() || !st.releasing.is_empty();
            *st = NodeState::default();
            return busy;
        };
        if st.wants == wants {
            return false;
        }
        // Gone from the wants: released, whatever made it (a record, this
        // task, or a partly made assignment).
        let st = &mut *st;
        let left: Vec<NodeKey> = st
            .done
            .keys()
            .chain(st.partial.keys())
            .chain(wants.recorded.keys())
            .filter(|k| !wants.want.contains_key(*k))
            .cloned()
            .collect();
        for key in left {
            let at = st.done.remove(&key).or_else(|| st.partial.remove(&key));
            let provider = st.wants.want.get(&key).map(|t| t.provider);
            let recorded = wants.recorded.get(&key).cloned();
            let (addr, provider) = match (at, provider, recorded) {
                (Some(a), Some(p), _) => (a, p),
                (Some(a), None, Some((p, _))) => (a, p),
                (None, _, Some((p, a))) => (a, p),
                _ => continue,
            };
            st.releasing.entry(key.clone()).or_insert((addr, provider, 0));
            st.failures.remove(&key);
            st.next.remove(&key);
            st.abandoned.remove(&key);
        }
        // Wanted again before the release ran: made again instead.
        st.releasing.retain(|k, _| !wants.want.contains_key(k));
        let releasing = &st.releasing;
        let keep = |k: &NodeKey| wants.want.contains_key(k) || releasing.contains_key(k);
        st.next.retain(|k, _| keep(k));
        st.failures.retain(|k, _| wants.want.contains_key(k));
        st.abandoned.retain(|k| wants.want.contains_key(k));
        st.wants = wants;
        true
    }

    /// The Node addresses associated now, for the pools' status.
    pub fn assigned(&self) -> BTreeMap<NodeKey, NodeAddress> {
        self.state.lock().done.clone()
    }

    /// The last failure of each address not associated yet.
    pub fn failures(&self) -> BTreeMap<NodeKey, CloudError> {
        self.state.lock().failures.iter().map(|(k, (_, e))| (k.clone(), e.clone())).collect()
    }

    /// Every wanted Node address: where it is associated, or why not yet
    /// (None: being made).
    pub fn report(&self) -> Vec<(NodeKey, Result<NodeAddress, Option<String>>)> {
        let st = self.state.lock();
        st.wants
            .want
            .keys()
            .map(|k| {
                let state = match st.done.get(k) {
                    Some(at) => Ok(at.clone()),
                    None => Err(st.failures.get(k).map(|(n, e)| format!("{n} attempt(s): {e}"))),
                };
                (k.clone(), state)
            })
            .collect()
    }

    /// Drifted associations made again, since the start.
    pub fn drift_repairs(&self) -> u64 {
        self.state.lock().drift_repairs
    }

    /// The providers the wants and releases need.
    pub fn providers(&self) -> BTreeSet<Provider> {
        let st = self.state.lock();
        st.wants.want.values().map(|t| t.provider).chain(st.releasing.values().map(|(_, p, _)| *p)).collect()
    }

    /// One round of whatever is due. Returns whether an address became
    /// associated or was lost (the status must be written again), and when
    /// the next thing is due.
    pub async fn step(
        &self,
        clouds: &BTreeMap<Provider, std::sync::Arc<dyn Cloud>>,
        now: Instant,
        resync: Duration,
    ) -> (bool, Option<Instant>) {
        let wants = self.state.lock().wants.clone();
        let mut dirty = false;
        for (key, target) in &wants.want {
            let Some(cloud) = clouds.get(&target.provider) else { continue };
            let (done, due) = {
                let st = self.state.lock();
                (st.done.get(key).cloned(), st.next.get(key).is_none_or(|t| *t <= now))
            };
            if !due {
                continue;
            }
            dirty |= match done {
                Some(at) => self.check(cloud.as_ref(), key, target, at, now, resync).await,
                None => self.make(cloud.as_ref(), key, target, now, resync).await,
            };
        }
        self.release_left(clouds, now).await;
        let st = self.state.lock();
        (dirty, st.next.values().copied().min())
    }

    /// Makes one Node's address: interface, private address, association.
    /// Returns whether it became associated.
    async fn make(
        &self,
        cloud: &dyn Cloud,
        key: &NodeKey,
        target: &NodeTarget,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let r = self.private_address(cloud, key, target).await;
        let r = match r {
            Ok(at) => {
                cloud.assign(&at.interface_id, at.private_ip, Some(&target.public), &only(target)).await.map(|()| at)
            }
            Err(e) => Err(e),
        };
        self.record(key, target, r, now, resync)
    }

    /// The private address for `key`: the one partly made, else the
    /// recorded one, else the public one's current association on the
    /// Node's interface, else a new one from the provider.
    async fn private_address(
        &self,
        cloud: &dyn Cloud,
        key: &NodeKey,
        target: &NodeTarget,
    ) -> Result<NodeAddress, CloudError> {
        {
            let st = self.state.lock();
            if let Some(at) = st.partial.get(key) {
                return Ok(at.clone());
            }
            if let Some(at) = target.recorded.as_ref().filter(|_| !st.abandoned.contains(key)) {
                return Ok(at.clone());
            }
        }
        let interface = cloud.primary_interface(&target.provider_id).await?;
        let at = if !target.provider.pairs_privately() {
            NodeAddress { interface_id: interface.interface_id, private_ip: target.public.public_ip }
        } else if let Some(ip) = target
            .public
            .private_ip
            .filter(|_| target.public.interface_id.as_deref() == Some(interface.interface_id.as_str()))
            .filter(|ip| interface.secondary_ips.contains(ip))
        {
            // Associated there already (a record lost with a restart).
            NodeAddress { interface_id: interface.interface_id, private_ip: ip }
        } else {
            let ip = cloud.add_address(&interface.interface_id).await?;
            tracing::info!(node = %key.0, public = %key.1, private = %ip, interface = %interface.interface_id,
                "secondary address added to the Node's interface");
            NodeAddress { interface_id: interface.interface_id, private_ip: ip }
        };
        self.state.lock().partial.insert(key.clone(), at.clone());
        Ok(at)
    }

    /// Checks an associated address against the provider's view, and makes
    /// it again where it drifted. Returns whether it was lost.
    async fn check(
        &self,
        cloud: &dyn Cloud,
        key: &NodeKey,
        target: &NodeTarget,
        at: NodeAddress,
        now: Instant,
        resync: Duration,
    ) -> bool {
        match cloud.verify(&at.interface_id, at.private_ip, Some(&target.public)).await {
            Ok(true) => {
                self.state.lock().next.insert(key.clone(), now + resync);
                false
            }
            Ok(false) => {
                tracing::warn!(node = %key.0, public = %key.1, private = %at.private_ip,
                    "a Node's cloud address drifted; associating it again");
                self.state.lock().drift_repairs += 1;
                let r = cloud
                    .assign(&at.interface_id, at.private_ip, Some(&target.public), &only(target))
                    .await
                    .map(|()| at);
                self.record(key, target, r, now, resync)
            }
            Err(e) => {
                tracing::warn!(node = %key.0, public = %key.1, error = %e, "a Node's cloud address not verified; checked again later");
                self.state.lock().next.insert(key.clone(), now + BACKOFF_MAX);
                false
            }
        }
    }

    /// Records an attempt's outcome. Returns whether the address became
    /// associated or stopped being (the status changes).
    fn record(
        &self,
        key: &NodeKey,
        target: &NodeTarget,
        r: Result<NodeAddress, CloudError>,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let mut st = self.state.lock();
        if !st.wants.want.contains_key(key) {
            // Left while the call ran: released next round.
            if let Ok(at) = r {
                st.releasing.insert(key.clone(), (at, target.provider, 0));
            }
            return false;
        }
        match r {
            Ok(at) => {
                tracing::info!(node = %key.0, public = %key.1, private = %at.private_ip, interface = %at.interface_id,
                    "a Node's cloud address associated");
                st.partial.remove(key);
                st.failures.remove(key);
                st.next.insert(key.clone(), now + resync);
                st.done.insert(key.clone(), at).is_none()
            }
            Err(e) => {
                let attempts = st.failures.get(key).map_or(0, |(n, _)| *n) + 1;
                tracing::warn!(node = %key.0, public = %key.1, error = %e, attempt = attempts,
                    "a Node's cloud address not associated");
                if e.code == HELD_ELSEWHERE {
                    // Its private address is someone else's now: a new one next time.
                    st.partial.remove(key);
                    st.abandoned.insert(key.clone());
                }
                let again = if e.retryable || e.code == HELD_ELSEWHERE { backoff(attempts) } else { BACKOFF_MAX };
                st.next.insert(key.clone(), now + again);
                st.failures.insert(key.clone(), (attempts, e));
                st.done.remove(key).is_some()
            }
        }
    }

    /// Releases the addresses of the Nodes that left.
    async fn release_left(&self, clouds: &BTreeMap<Provider, std::sync::Arc<dyn Cloud>>, now: Instant) {
        let due: Vec<(NodeKey, NodeAddress, Provider, u32)> = {
            let st = self.state.lock();
            st.releasing
                .iter()
                .filter(|(k, _)| st.next.get(*k).is_none_or(|t| *t <= now))
                .map(|(k, (a, p, n))| (k.clone(), a.clone(), *p, *n))
                .collect()
        };
        for (key, at, provider, n) in due {
            let Some(cloud) = clouds.get(&provider) else { continue };
            let r = cloud.release(&at.interface_id, at.private_ip).await;
            let mut st = self.state.lock();
            match r {
                Ok(()) => {
                    tracing::info!(node = %key.0, public = %key.1, private = %at.private_ip, "a Node's cloud address released");
                    st.releasing.remove(&key);
                    st.next.remove(&key);
                }
                Err(e) if e.retryable && n + 1 < RELEASE_ATTEMPTS => {
                    st.releasing.insert(key.clone(), (at, provider, n + 1));
                    st.next.insert(key, now + backoff(n + 1));
                }
                Err(e) => {
                    tracing::warn!(node = %key.0, public = %key.1, error = %e,
                        "a Node's cloud address not released; its public address moves with its next association");
                    st.releasing.remove(&key);
                    st.next.remove(&key);
                }
            }
        }
    }
}

/// The only instance a worker Node's address may be taken from: its own. A
/// private address on any other interface is someone else's now (the CNI
/// may have given it to a pod): refused, and a new one is added.
fn only(target: &NodeTarget) -> BTreeSet<String> {
    BTreeSet::from([target.provider_id.clone()])
}

#[cfg(test)]
mod tests {
    //! The node-address task's logic, with a scripted provider (the
    //! providers themselves: tests/tests/cloud_*.rs).
    use std::sync::Arc;

    use tokio::sync::Notify;

    use super::super::scripted::{scripted, Script};
    use super::super::task::Clouds;
    use super::*;

    const RESYNC: Duration = Duration::from_secs(30);

    fn public(ip: &str) -> PublicAddress {
        PublicAddress {
            public_ip: ip.parse().unwrap(),
            allocation_id: "eipalloc-1".into(),
            private_ip: None,
            interface_id: None,
        }
    }

    fn want(node: &str, ip: &str, recorded: Option<NodeAddress>) -> (NodeKey, NodeTarget) {
        let t = NodeTarget {
            provider: Provider::Aws,
            provider_id: format!("aws:///z/i-{node}"),
            public: public(ip),
            recorded,
        };
        ((node.to_string(), ip.parse().unwrap()), t)
    }

    async fn settle(c: &Clouds, what: impl Fn(&Clouds) -> bool) {
        for _ in 0..400 {
            if what(c) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the node-address task never got there: {:?}", c.node_addresses());
    }

    fn calls(script: &Arc<Mutex<Script>>, what: &str) -> Vec<String> {
        script.lock().calls.iter().filter(|l| l.starts_with(what)).cloned().collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_gets_a_provider_chosen_address_associated_only_with_its_own_instance_then_released() {
        let script = Arc::new(Mutex::new(Script { assign_failures: 1, ..Default::default() }));
        let c = Clouds::start(scripted(&script), RESYNC, Arc::new(Notify::new()));
        let (key, target) = want("w1", "192.0.2.200", None);
        c.update_nodes(Some(NodeWants { want: [(key.clone(), target)].into(), ..Default::default() }));
        settle(&c, |c| c.node_addresses().contains_key(&key)).await;
        let at = c.node_addresses()[&key].clone();
        assert_eq!(at, NodeAddress { interface_id: "eni-i-w1".into(), private_ip: "198.18.1.100".parse().unwrap() });
        // One address added, though the first association was throttled:
        // the retry reuses it; and only w1's own instance may lose it.
        assert_eq!(calls(&script, "add_address"), vec!["add_address eni-i-w1 198.18.1.100"]);
        assert_eq!(calls(&script, "assign"), vec![r#"assign eni-i-w1 198.18.1.100 {"aws:///z/i-w1"}"#; 2],);

        // Checked once per resync; drift is repaired and counted.
        script.lock().drifts = 1;
        tokio::time::sleep(RESYNC + Duration::from_secs(1)).await;
        settle(&c, |_| calls(&script, "assign").len() == 3).await;
        assert_eq!(c.report().drift_repairs, 1);

        // The Node leaves: its address is released, and forgotten.
        let recorded = [(key.clone(), (Provider::Aws, at))].into();
        c.update_nodes(Some(NodeWants { want: BTreeMap::new(), recorded }));
        settle(&c, |_| !calls(&script, "release").is_empty()).await;
        assert_eq!(calls(&script, "release"), vec!["release eni-i-w1 198.18.1.100"]);
        assert!(c.node_addresses().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_recorded_address_is_reused_and_one_someone_else_took_is_replaced() {
        let script = Arc::new(Mutex::new(Script::default()));
        let c = Clouds::start(scripted(&script), RESYNC, Arc::new(Notify::new()));
        let recorded = NodeAddress { interface_id: "eni-i-w1".into(), private_ip: "198.18.1.33".parse().unwrap() };
        let (key, target) = want("w1", "192.0.2.200", Some(recorded.clone()));
        c.update_nodes(Some(NodeWants { want: [(key.clone(), target.clone())].into(), ..Default::default() }));
        settle(&c, |c| c.node_addresses().get(&key) == Some(&recorded)).await;
        assert!(calls(&script, "add_address").is_empty(), "the record is the memory");

        // Another writer later finds the recorded address on someone else's
        // interface: refused, then a new one is added and associated.
        let c2 = Clouds::start(scripted(&script), RESYNC, Arc::new(Notify::new()));
        script.lock().held_elsewhere.insert(recorded.private_ip);
        c2.update_nodes(Some(NodeWants { want: [(key.clone(), target)].into(), ..Default::default() }));
        settle(&c2, |c| c.node_addresses().get(&key).is_some_and(|a| a.private_ip != recorded.private_ip)).await;
        assert_eq!(calls(&script, "add_address"), vec!["add_address eni-i-w1 198.18.1.100"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_gateway_that_stops_writing_status_forgets_without_releasing() {
        let script = Arc::new(Mutex::new(Script::default()));
        let c = Clouds::start(scripted(&script), RESYNC, Arc::new(Notify::new()));
        let (key, target) = want("w1", "192.0.2.200", None);
        c.update_nodes(Some(NodeWants { want: [(key.clone(), target)].into(), ..Default::default() }));
        settle(&c, |c| c.node_addresses().contains_key(&key)).await;
        c.update_nodes(None);
        tokio::time::sleep(RESYNC * 3).await;
        assert!(c.node_addresses().is_empty());
        assert!(calls(&script, "release").is_empty(), "the next writer takes over from the record");
    }

    #[tokio::test(start_paused = true)]
    async fn on_gcp_the_node_address_is_the_external_address_itself() {
        let script = Arc::new(Mutex::new(Script::default()));
        let c = Clouds::start(scripted(&script), RESYNC, Arc::new(Notify::new()));
        let (key, mut target) = want("w1", "192.0.2.200", None);
        target.provider = Provider::Gcp;
        c.update_nodes(Some(NodeWants { want: [(key.clone(), target)].into(), ..Default::default() }));
        settle(&c, |c| c.node_addresses().contains_key(&key)).await;
        assert_eq!(c.node_addresses()[&key].private_ip, key.1);
        assert!(calls(&script, "add_address").is_empty());
    }
}
