//! The gateway's cloud task: asks the provider what each cloud pool has,
//! and moves each private/public address pair with its Lease.
//!
//! The sync loop tells it, every pass, the cloud pools and the cloud
//! addresses this gateway holds a Lease for ([`Clouds::update`]); it keeps a
//! held address out of the tables until the provider has given it to this
//! gateway's interface ([`Clouds::assigned`]), so no packet is ever
//! translated to an address the VPC delivers elsewhere. Calls are one
//! bounded attempt each (the provider's timeout); failures back off from
//! 200 ms to 10 s per address and per pool, and are reported, never
//! retried in a tight loop. An address the gateway gives up is released
//! (a later holder's reassignment takes it anyway; the release only tidies).
//!
//! The provider's API is eventually consistent and other hands may move an
//! address: every assigned address is checked against the provider's view
//! once per resync ([`Cloud::verify`]) and assigned again when it drifted
//! (counted in [`CloudReport::drift_repairs`]); until the new assignment
//! succeeds the address is not translated to.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::node_addresses::{NodeAddresses, NodeKey, NodeWants};
use super::{Cloud, CloudError, Discovered, Interface, NodeAddress, PoolSelector, Provider, PublicAddress};

const BACKOFF_MIN: Duration = Duration::from_millis(200);
pub(super) const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Releases are tidying: tried this many times, then left to the next holder.
pub(super) const RELEASE_ATTEMPTS: u32 = 5;
/// How long a gateway stops competing for an address the provider refused
/// it for good (no interface in the subnet, no `providerID`, not allowed,
/// the interface full): another gateway serves it meanwhile.
pub const REFUSED_FOR: Duration = Duration::from_secs(60);

/// A held cloud address: where it must go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// Whose address it is.
    pub provider: Provider,
    /// The pool's subnet (this gateway's interface there receives it).
    pub subnet_id: String,
    /// The public address associated with it (None: an IPv6 address,
    /// global itself).
    pub public: Option<PublicAddress>,
}

/// Makes a provider, once a cloud pool needs it (AWS's credential and
/// region chain may probe the instance metadata service: not before).
pub type Factory = Box<dyn Fn(Provider) -> BoxFuture<'static, Arc<dyn Cloud>> + Send + Sync>;

/// The providers made so far.
type Providers = BTreeMap<Provider, Arc<dyn Cloud>>;

/// What one address's assignment is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AddressState {
    /// On this gateway's interface, with its public address.
    Assigned { interface_id: String },
    /// Being assigned (or waiting to retry: `error` is the last failure).
    Pending { attempts: u32, error: Option<String> },
}

#[derive(Default)]
struct State {
    node_provider_id: Option<String>,
    /// Every gateway Node's `spec.providerID` (an address is taken only
    /// from their interfaces).
    gateways: BTreeSet<String>,
    pools: BTreeMap<String, PoolSelector>,
    want: BTreeMap<IpAddr, Target>,
    discovered: BTreeMap<String, Result<Discovered, CloudError>>,
    next_discovery: BTreeMap<String, Instant>,
    discovery_failures: BTreeMap<String, u32>,
    interfaces: BTreeMap<String, Result<Interface, CloudError>>,
    next_interface: BTreeMap<String, Instant>,
    addresses: BTreeMap<IpAddr, AddressState>,
    next_try: BTreeMap<IpAddr, Instant>,
    /// Given up while assigned: (interface, attempts so far).
    releasing: BTreeMap<IpAddr, (String, u32)>,
    /// Whose each address ever wanted is (its release needs it after it
    /// left `want`).
    provider_of: BTreeMap<IpAddr, Provider>,
    /// Interfaces whose source/destination check was reported on.
    check_reported: BTreeSet<String>,
    /// Addresses the provider refused for good, until then.
    refused: BTreeMap<IpAddr, Instant>,
    /// When each assigned address is next checked against the provider.
    next_verify: BTreeMap<IpAddr, Instant>,
    /// Assignments found drifted and made again.
    drift_repairs: u64,
}

/// The sync loop's handle on the cloud task.
#[derive(Clone)]
pub struct Clouds {
    state: Arc<Mutex<State>>,
    /// The worker Nodes' addresses (`PerNode` cloud pools), made by the
    /// status writer's task.
    nodes: Arc<NodeAddresses>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for Clouds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.state.lock();
        f.debug_struct("Clouds").field("pools", &st.pools.keys()).field("addresses", &st.addresses).finish()
    }
}

/// What the report shows of the cloud task.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CloudReport {
    /// Per held cloud address: its public address (if any) and state.
    pub addresses: Vec<(IpAddr, Option<IpAddr>, AddressState)>,
    /// Per subnet: this gateway's interface, or why it is not known.
    pub interfaces: Vec<(String, Result<Interface, CloudError>)>,
    /// Assignments the provider's view showed drifted (moved by someone
    /// else, or lost), made again, since the start.
    pub drift_repairs: u64,
    /// The status writer's worker Node addresses (`PerNode` cloud pools):
    /// where each is associated, or why not yet (None: being made).
    pub nodes: Vec<(NodeKey, Result<NodeAddress, Option<String>>)>,
}

impl Clouds {
    /// Starts the task; `changed` is notified whenever something the sync
    /// loop reads changed (a discovery, an assignment). Each pool, interface
    /// and assignment is asked about again once per `resync` (retagged or
    /// new public addresses, and drift, are noticed within this time).
    pub fn start(factory: Factory, resync: Duration, changed: Arc<Notify>) -> Clouds {
        let c = Clouds { state: Arc::default(), nodes: Arc::default(), wake: Arc::new(Notify::new()) };
        let task = c.clone();
        tokio::spawn(async move { task.run(factory, resync, changed).await });
        c
    }

    /// The sync loop's pass: this gateway's `spec.providerID`, every
    /// gateway Node's, the cloud pools, and the cloud addresses it holds a
    /// Lease for.
    pub fn update(
        &self,
        provider_id: Option<String>,
        gateways: BTreeSet<String>,
        pools: BTreeMap<String, PoolSelector>,
        want: BTreeMap<IpAddr, Target>,
    ) {
        let mut st = self.state.lock();
        st.gateways = gateways;
        let changed = st.node_provider_id != provider_id || st.pools != pools || st.want != want;
        // An address given up is no longer this gateway's from now on, even
        // if the task is busy: should its Lease come back before the task
        // has released it, it is assigned again (another holder may have
        // taken it meanwhile), never served on the old assignment's word.
        let gone: Vec<IpAddr> = st.addresses.keys().filter(|ip| !want.contains_key(ip)).copied().collect();
        for ip in gone {
            if let Some(AddressState::Assigned { interface_id }) = st.addresses.remove(&ip) {
                st.releasing.insert(ip, (interface_id, 0));
            }
        }
        for (ip, t) in &want {
            st.provider_of.insert(*ip, t.provider);
        }
        st.node_provider_id = provider_id;
        st.pools = pools;
        st.want = want;
        drop(st);
        if changed {
            self.wake.notify_one();
        }
    }

    /// The status writer's pass over the worker Nodes' addresses of
    /// `PerNode` cloud pools; `None` when this gateway does not write
    /// status (it forgets them, releasing nothing).
    pub fn update_nodes(&self, wants: Option<NodeWants>) {
        if self.nodes.update(wants) {
            self.wake.notify_one();
        }
    }

    /// The worker Nodes' addresses associated now.
    pub fn node_addresses(&self) -> BTreeMap<NodeKey, NodeAddress> {
        self.nodes.assigned()
    }

    /// Why each worker Node's address is not associated yet.
    pub fn node_failures(&self) -> BTreeMap<NodeKey, CloudError> {
        self.nodes.failures()
    }

    /// Gives up every address (the gateway stops for good) and waits at most
    /// `wait` for their releases; returns how many are still to release.
    pub async fn release_all(&self, wait: Duration) -> usize {
        let (provider_id, gateways, pools) = {
            let st = self.state.lock();
            (st.node_provider_id.clone(), st.gateways.clone(), st.pools.clone())
        };
        self.update(provider_id, gateways, pools, BTreeMap::new());
        self.wake.notify_one();
        let deadline = Instant::now() + wait;
        loop {
            let left = self.state.lock().releasing.len();
            if left == 0 || Instant::now() >= deadline {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The held cloud addresses that are on this gateway's interface now.
    pub fn assigned(&self) -> BTreeSet<IpAddr> {
        let st = self.state.lock();
        st.addresses
            .iter()
            .filter(|(ip, s)| matches!(s, AddressState::Assigned { .. }) && st.want.contains_key(ip))
            .map(|(ip, _)| *ip)
            .collect()
    }

    /// Addresses this gateway cannot serve now (the provider refused them
    /// for good, [`REFUSED_FOR`]): the sync loop stops competing for them,
    /// so their Leases go to gateways that can.
    pub fn refused(&self) -> BTreeSet<IpAddr> {
        let now = Instant::now();
        self.state.lock().refused.iter().filter(|(_, until)| **until > now).map(|(ip, _)| *ip).collect()
    }

    /// [`Clouds::refused`] with the provider's words for each (an Event's note).
    pub fn refusals(&self) -> BTreeMap<IpAddr, String> {
        let now = Instant::now();
        let st = self.state.lock();
        st.refused
            .iter()
            .filter(|(_, until)| **until > now)
            .map(|(ip, _)| {
                let why = match st.addresses.get(ip) {
                    Some(AddressState::Pending { error: Some(e), .. }) => e.clone(),
                    _ => "refused by the cloud provider".to_string(),
                };
                (*ip, why)
            })
            .collect()
    }

    /// The provider's last answer per pool.
    pub fn discovered(&self) -> BTreeMap<String, Result<Discovered, CloudError>> {
        self.state.lock().discovered.clone()
    }

    /// For `egret status` and the metrics.
    pub fn report(&self) -> CloudReport {
        let st = self.state.lock();
        CloudReport {
            addresses: st
                .want
                .iter()
                .map(|(ip, t)| {
                    let s = st.addresses.get(ip).cloned().unwrap_or(AddressState::Pending { attempts: 0, error: None });
                    (*ip, t.public.as_ref().map(|p| p.public_ip), s)
                })
                .collect(),
            interfaces: st.interfaces.iter().map(|(subnet, r)| (subnet.clone(), r.clone())).collect(),
            drift_repairs: st.drift_repairs + self.nodes.drift_repairs(),
            nodes: self.nodes.report(),
        }
    }

    async fn run(self, factory: Factory, resync: Duration, changed: Arc<Notify>) {
        let mut clouds: Providers = BTreeMap::new();
        loop {
            let needed: BTreeSet<Provider> = {
                let st = self.state.lock();
                st.pools
                    .values()
                    .map(|p| p.provider)
                    .chain(st.want.values().map(|t| t.provider))
                    .chain(st.releasing.keys().filter_map(|ip| st.provider_of.get(ip).copied()))
                    .chain(self.nodes.providers())
                    .collect()
            };
            for p in &needed {
                if !clouds.contains_key(p) {
                    let cloud = factory(*p).await;
                    clouds.insert(*p, cloud);
                }
            }
            let next = if needed.is_empty() { None } else { self.step(&clouds, resync, &changed).await };
            let sleep = next.map_or(Duration::from_secs(3600), |t| t.saturating_duration_since(Instant::now()));
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }

    /// One round: whatever is due. Returns when the next thing is due.
    async fn step(&self, clouds: &Providers, resync: Duration, changed: &Notify) -> Option<Instant> {
        let now = Instant::now();
        let (provider_id, pools, want) = {
            let st = self.state.lock();
            (st.node_provider_id.clone(), st.pools.clone(), st.want.clone())
        };
        // This gateway's interface in each subnet that a pool or a held address uses.
        let subnets: BTreeSet<(Provider, String)> = pools
            .values()
            .map(|p| (p.provider, p.subnet_id.clone()))
            .chain(want.values().map(|t| (t.provider, t.subnet_id.clone())))
            .collect();
        let mut dirty = self.find_interfaces(clouds, provider_id.as_deref(), &subnets, now, resync).await;
        // Held addresses first (a take-over waits for them).
        dirty |= self.assign_held(clouds, &want, now, resync).await;
        dirty |= self.verify_assigned(clouds, &want, now, resync).await;
        self.release_given_up(clouds, &want, now).await;
        dirty |= self.discover_pools(clouds, &pools, now, resync).await;
        let (nodes_dirty, nodes_next) = self.nodes.step(clouds, now, resync).await;
        if dirty || nodes_dirty {
            changed.notify_one();
        }
        let subnets = subnets.into_iter().map(|(_, s)| s).collect();
        let next = self.next_due(&subnets, &pools, &want, now);
        next.into_iter().chain(nodes_next).min()
    }

    /// This gateway's interface in each subnet, asked again once per resync
    /// (or [`BACKOFF_MAX`] after a failure). Returns whether any changed.
    async fn find_interfaces(
        &self,
        clouds: &Providers,
        provider_id: Option<&str>,
        subnets: &BTreeSet<(Provider, String)>,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let mut dirty = false;
        for (provider, subnet) in subnets {
            let Some(cloud) = clouds.get(provider) else { continue };
            if self.state.lock().next_interface.get(subnet).is_some_and(|t| *t > now) {
                continue;
            }
            let r = match provider_id {
                None => Err(CloudError {
                    operation: "Node.spec.providerID",
                    code: "Missing".into(),
                    message: "this gateway's Node has no spec.providerID; the cloud's interface cannot be found".into(),
                    retryable: false,
                }),
                Some(id) => cloud.interface(id, subnet).await,
            };
            let mut st = self.state.lock();
            match &r {
                Ok(i) if i.source_dest_check => {
                    if st.check_reported.insert(i.interface_id.clone()) {
                        tracing::warn!(
                            interface = %i.interface_id, instance = %i.instance_id,
                            provider = %provider,
                            "the provider's anti-spoofing check is on (AWS: source/destination check; Azure: IP forwarding off; GCP: canIpForward false): the network drops the pods' traffic this gateway receives; turn it off (docs/kubernetes.md)"
                        );
                    }
                }
                Ok(i) => {
                    st.check_reported.remove(&i.interface_id);
                }
                Err(e) => tracing::warn!(subnet = %subnet, error = %e, "this gateway's interface not found"),
            }
            let again = if r.is_ok() { resync } else { BACKOFF_MAX };
            st.next_interface.insert(subnet.clone(), now + again);
            if st.interfaces.get(subnet) != Some(&r) {
                dirty = true;
            }
            st.interfaces.insert(subnet.clone(), r);
        }
        dirty
    }

    /// Assigns the held addresses not on this gateway's interface yet.
    /// Returns whether any became assigned or refused.
    async fn assign_held(
        &self,
        clouds: &Providers,
        want: &BTreeMap<IpAddr, Target>,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let mut dirty = false;
        for (ip, target) in want {
            let Some(cloud) = clouds.get(&target.provider) else { continue };
            let (due, interface, attempts, gateways) = {
                let st = self.state.lock();
                let due = !matches!(st.addresses.get(ip), Some(AddressState::Assigned { .. }))
                    && st.next_try.get(ip).is_none_or(|t| *t <= now);
                let attempts = match st.addresses.get(ip) {
                    Some(AddressState::Pending { attempts, .. }) => *attempts,
                    _ => 0,
                };
                (due, st.interfaces.get(&target.subnet_id).cloned(), attempts, st.gateways.clone())
            };
            if !due {
                continue;
            }
            let r = match interface {
                Some(Ok(i)) => {
                    cloud.assign(&i.interface_id, *ip, target.public.as_ref(), &gateways).await.map(|()| i.interface_id)
                }
                Some(Err(e)) => Err(e),
                None => continue,
            };
            dirty |= self.record_assignment(*ip, target, r, attempts, now, resync);
        }
        dirty
    }

    /// Records an assignment's outcome. Returns whether the address became
    /// assigned or refused (the sync loop must look again).
    fn record_assignment(
        &self,
        ip: IpAddr,
        target: &Target,
        r: Result<String, CloudError>,
        attempts: u32,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let mut st = self.state.lock();
        if !st.want.contains_key(&ip) {
            // Given up while the call ran: released next round.
            if let Ok(interface_id) = r {
                st.releasing.insert(ip, (interface_id, 0));
            }
            return false;
        }
        match r {
            Ok(interface_id) => {
                tracing::info!(ip = %ip, public = ?target.public.as_ref().map(|p| p.public_ip), interface = %interface_id, "cloud address assigned");
                st.releasing.remove(&ip);
                st.next_try.remove(&ip);
                st.next_verify.insert(ip, now + resync);
                st.addresses.insert(ip, AddressState::Assigned { interface_id });
                true
            }
            Err(e) if !e.retryable => {
                tracing::warn!(
                    ip = %ip, error = %e,
                    "cloud address refused for good: not translating to it, and not competing for it for {} s",
                    REFUSED_FOR.as_secs()
                );
                st.refused.insert(ip, now + REFUSED_FOR);
                st.next_try.insert(ip, now + BACKOFF_MAX);
                st.addresses.insert(ip, AddressState::Pending { attempts: attempts + 1, error: Some(e.to_string()) });
                true
            }
            Err(e) => {
                tracing::warn!(ip = %ip, error = %e, attempt = attempts + 1, "cloud address not assigned; not translating to it");
                st.next_try.insert(ip, now + backoff(attempts + 1));
                let was_assigned = matches!(st.addresses.get(&ip), Some(AddressState::Assigned { .. }));
                st.addresses.insert(ip, AddressState::Pending { attempts: attempts + 1, error: Some(e.to_string()) });
                was_assigned
            }
        }
    }

    /// Checks each assigned address against the provider's view once per
    /// resync, and assigns it again where it drifted (fail closed: if that
    /// fails, it is no longer translated to). A failed check changes
    /// nothing: it is no evidence of drift. Returns whether any changed.
    async fn verify_assigned(
        &self,
        clouds: &Providers,
        want: &BTreeMap<IpAddr, Target>,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let mut dirty = false;
        for (ip, target) in want {
            let Some(cloud) = clouds.get(&target.provider) else { continue };
            let (interface_id, gateways) = {
                let st = self.state.lock();
                let Some(AddressState::Assigned { interface_id }) = st.addresses.get(ip) else { continue };
                if st.next_verify.get(ip).is_some_and(|t| *t > now) {
                    continue;
                }
                (interface_id.clone(), st.gateways.clone())
            };
            match cloud.verify(&interface_id, *ip, target.public.as_ref()).await {
                Ok(true) => {
                    self.state.lock().next_verify.insert(*ip, now + resync);
                }
                Ok(false) => {
                    tracing::warn!(ip = %ip, public = ?target.public.as_ref().map(|p| p.public_ip), interface = %interface_id,
                        "cloud address drifted from this gateway's interface; assigning it again");
                    self.state.lock().drift_repairs += 1;
                    let r = cloud
                        .assign(&interface_id, *ip, target.public.as_ref(), &gateways)
                        .await
                        .map(|()| interface_id);
                    dirty |= self.record_assignment(*ip, target, r, 0, now, resync);
                }
                Err(e) => {
                    tracing::warn!(ip = %ip, error = %e, "cloud address not verified; checked again later");
                    self.state.lock().next_verify.insert(*ip, now + BACKOFF_MAX);
                }
            }
        }
        dirty
    }

    /// Releases the addresses given up (out of the tables already).
    async fn release_given_up(&self, clouds: &Providers, want: &BTreeMap<IpAddr, Target>, now: Instant) {
        {
            let mut st = self.state.lock();
            let gone: Vec<IpAddr> = st.addresses.keys().filter(|ip| !want.contains_key(ip)).copied().collect();
            for ip in gone {
                st.next_try.remove(&ip);
                if let Some(AddressState::Assigned { interface_id }) = st.addresses.remove(&ip) {
                    st.releasing.insert(ip, (interface_id, 0));
                }
            }
        }
        let releasing: Vec<(IpAddr, String, u32, Provider)> = {
            let st = self.state.lock();
            st.releasing
                .iter()
                .filter(|(ip, _)| !want.contains_key(ip) && st.next_try.get(ip).is_none_or(|t| *t <= now))
                .filter_map(|(ip, (i, n))| Some((*ip, i.clone(), *n, *st.provider_of.get(ip)?)))
                .collect()
        };
        for (ip, interface_id, n, provider) in releasing {
            let Some(cloud) = clouds.get(&provider) else { continue };
            let r = cloud.release(&interface_id, ip).await;
            let mut st = self.state.lock();
            match r {
                Ok(()) => {
                    tracing::info!(ip = %ip, interface = %interface_id, "cloud address released");
                    st.releasing.remove(&ip);
                }
                Err(e) if e.retryable && n + 1 < RELEASE_ATTEMPTS => {
                    st.releasing.insert(ip, (interface_id, n + 1));
                    st.next_try.insert(ip, now + backoff(n + 1));
                }
                Err(e) => {
                    tracing::warn!(ip = %ip, error = %e, "cloud address not released; the next holder's assignment takes it");
                    st.releasing.remove(&ip);
                }
            }
        }
    }

    /// Asks the provider what each pool has, once per resync (backing off
    /// after failures). Returns whether any answer changed.
    async fn discover_pools(
        &self,
        clouds: &Providers,
        pools: &BTreeMap<String, PoolSelector>,
        now: Instant,
        resync: Duration,
    ) -> bool {
        let mut dirty = false;
        for (name, sel) in pools {
            let Some(cloud) = clouds.get(&sel.provider) else { continue };
            if self.state.lock().next_discovery.get(name).is_some_and(|t| *t > now) {
                continue;
            }
            let r = cloud.discover(sel).await;
            let mut st = self.state.lock();
            let again = match &r {
                Ok(_) => {
                    st.discovery_failures.remove(name);
                    resync
                }
                Err(e) => {
                    let n = st.discovery_failures.entry(name.clone()).or_default();
                    *n += 1;
                    tracing::warn!(pool = %name, error = %e, attempt = *n, "cloud discovery failed");
                    backoff(*n)
                }
            };
            st.next_discovery.insert(name.clone(), now + again);
            // A failure replaces the last answer here; desired() keeps the
            // recorded pairing meanwhile (the status shows the error, the
            // addresses stay).
            if st.discovered.get(name) != Some(&r) {
                dirty = true;
                st.discovered.insert(name.clone(), r);
            }
        }
        let mut st = self.state.lock();
        st.discovered.retain(|name, _| pools.contains_key(name));
        st.next_discovery.retain(|name, _| pools.contains_key(name));
        dirty
    }

    /// Drops the deadlines of what is no longer in use (a stale one would
    /// spin) and returns the earliest of the others.
    fn next_due(
        &self,
        subnets: &BTreeSet<String>,
        pools: &BTreeMap<String, PoolSelector>,
        want: &BTreeMap<IpAddr, Target>,
        now: Instant,
    ) -> Option<Instant> {
        let mut st = self.state.lock();
        st.interfaces.retain(|subnet, _| subnets.contains(subnet));
        st.next_interface.retain(|subnet, _| subnets.contains(subnet));
        st.next_discovery.retain(|name, _| pools.contains_key(name));
        let releasing: BTreeSet<IpAddr> = st.releasing.keys().copied().collect();
        let assigned: BTreeSet<IpAddr> = st
            .addresses
            .iter()
            .filter(|(_, s)| matches!(s, AddressState::Assigned { .. }))
            .map(|(ip, _)| *ip)
            .collect();
        st.next_try.retain(|ip, _| (want.contains_key(ip) && !assigned.contains(ip)) || releasing.contains(ip));
        st.next_verify.retain(|ip, _| want.contains_key(ip) && assigned.contains(ip));
        st.refused.retain(|_, until| *until > now);
        st.next_discovery
            .values()
            .chain(st.next_interface.values())
            .chain(st.next_try.values())
            .chain(st.next_verify.values())
            .copied()
            .min()
    }
}

/// 200 ms, 400 ms, ... up to 10 s.
pub(super) fn backoff(attempt: u32) -> Duration {
    BACKOFF_MIN.saturating_mul(1 << attempt.saturating_sub(1).min(6)).min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    //! The task's own logic, with a scripted provider (the provider itself
    //! is tested against moto: tests/tests/cloud_aws.rs, k8s_cloud.rs).
    use super::super::scripted::{scripted, Script};
    use super::*;

    /// `kubernetes.resyncPeriod`'s default.
    const DEFAULT_RESYNC: Duration = Duration::from_secs(30);

    fn target() -> Target {
        Target {
            provider: Provider::Aws,
            subnet_id: "subnet-1".into(),
            public: Some(PublicAddress {
                public_ip: "192.0.2.7".parse().unwrap(),
                allocation_id: "eipalloc-1".into(),
                private_ip: None,
                interface_id: None,
            }),
        }
    }

    fn gateways() -> BTreeSet<String> {
        ["aws:///z/i-1".to_string(), "aws:///z/i-2".to_string()].into()
    }

    async fn settle(c: &Clouds, want: impl Fn(&Clouds) -> bool) {
        for _ in 0..200 {
            if want(c) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the cloud task never got there: {c:?}");
    }

    #[tokio::test]
    async fn an_address_is_translated_to_only_once_assigned_and_released_when_given_up() {
        let script = Arc::new(Mutex::new(Script { assign_failures: 2, ..Default::default() }));
        let factory = scripted(&script);
        let changed = Arc::new(Notify::new());
        let c = Clouds::start(factory, DEFAULT_RESYNC, changed.clone());
        let ip: IpAddr = "198.18.1.40".parse().unwrap();
        let pools = BTreeMap::from([(
            "p".to_string(),
            PoolSelector {
                provider: Provider::Aws,
                tags: [("k".into(), "v".into())].into(),
                subnet_id: "subnet-1".into(),
                ipv6: false,
            },
        )]);
        c.update(Some("aws:///z/i-1".into()), gateways(), pools.clone(), BTreeMap::from([(ip, target())]));
        // Two throttled attempts: not assigned, so not translated to.
        settle(&c, |c| matches!(c.report().addresses.first(), Some((_, _, AddressState::Pending { attempts: 2, .. }))))
            .await;
        assert!(c.assigned().is_empty());
        // The third attempt (after the backoff) succeeds.
        settle(&c, |c| c.assigned().contains(&ip)).await;
        // Given up: out of `assigned` at once, then released.
        c.update(Some("aws:///z/i-1".into()), gateways(), pools, BTreeMap::new());
        assert!(c.assigned().is_empty());
        settle(&c, |_| script.lock().calls.iter().any(|l| l == "release eni-1 198.18.1.40")).await;
        let calls = script.lock().calls.clone();
        let assigns = calls.iter().filter(|l| l.starts_with("assign")).count();
        assert_eq!(assigns, 3, "{calls:?}");
        assert_eq!(calls[0], "interface aws:///z/i-1 subnet-1", "{calls:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn stopping_for_good_releases_every_assigned_address() {
        let script = Arc::new(Mutex::new(Script::default()));
        let factory = scripted(&script);
        let c = Clouds::start(factory, DEFAULT_RESYNC, Arc::new(Notify::new()));
        let ips: Vec<IpAddr> = ["198.18.1.40", "198.18.1.41"].iter().map(|s| s.parse().unwrap()).collect();
        let pools = BTreeMap::from([(
            "p".to_string(),
            PoolSelector {
                provider: Provider::Aws,
                tags: [("k".into(), "v".into())].into(),
                subnet_id: "subnet-1".into(),
                ipv6: false,
            },
        )]);
        c.update(Some("aws:///z/i-1".into()), gateways(), pools, ips.iter().map(|ip| (*ip, target())).collect());
        settle(&c, |c| c.assigned().len() == 2).await;
        assert_eq!(c.release_all(Duration::from_secs(3)).await, 0, "nothing left to release");
        let calls = script.lock().calls.clone();
        for ip in &ips {
            assert!(calls.contains(&format!("release eni-1 {ip}")), "{ip}: {calls:?}");
        }
        assert!(c.assigned().is_empty());
    }

    #[tokio::test]
    async fn an_address_refused_for_good_is_withdrawn_and_a_lost_lease_forgets_the_assignment() {
        let script = Arc::new(Mutex::new(Script { assign_refused: true, ..Default::default() }));
        let factory = scripted(&script);
        let c = Clouds::start(factory, DEFAULT_RESYNC, Arc::new(Notify::new()));
        let ip: IpAddr = "198.18.1.40".parse().unwrap();
        let want = || BTreeMap::from([(ip, target())]);
        c.update(Some("aws:///z/i-1".into()), gateways(), BTreeMap::new(), want());
        settle(&c, |c| c.refused().contains(&ip)).await;
        assert!(c.assigned().is_empty());

        // Allowed now: assigned; then the Lease goes and comes back before
        // the task runs again: not served on the old assignment's word.
        script.lock().assign_refused = false;
        c.state.lock().next_try.clear();
        c.wake.notify_one();
        settle(&c, |c| c.assigned().contains(&ip)).await;
        c.update(Some("aws:///z/i-1".into()), gateways(), BTreeMap::new(), BTreeMap::new());
        c.update(Some("aws:///z/i-1".into()), gateways(), BTreeMap::new(), want());
        assert!(c.assigned().is_empty(), "a Lease lost and won back needs a new assignment");
        settle(&c, |c| c.assigned().contains(&ip)).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_drifted_assignment_is_made_again_and_counted() {
        let script = Arc::new(Mutex::new(Script::default()));
        let factory = scripted(&script);
        let resync = Duration::from_secs(30);
        let c = Clouds::start(factory, resync, Arc::new(Notify::new()));
        let ip: IpAddr = "198.18.1.40".parse().unwrap();
        c.update(Some("aws:///z/i-1".into()), gateways(), BTreeMap::new(), BTreeMap::from([(ip, target())]));
        settle(&c, |c| c.assigned().contains(&ip)).await;
        let count = |what: &str| script.lock().calls.iter().filter(|l| l.starts_with(what)).count();
        assert_eq!((count("assign"), count("verify")), (1, 0), "no check before a resync is due");

        // One resync later the provider's view is checked: in place, nothing made.
        tokio::time::sleep(resync + Duration::from_secs(1)).await;
        settle(&c, |_| count("verify") == 1).await;
        assert_eq!(count("assign"), 1);
        assert_eq!(c.report().drift_repairs, 0);

        // Then it drifted (someone moved it): assigned again, with the
        // gateways' providerIDs, still served, and counted.
        script.lock().drifts = 1;
        tokio::time::sleep(resync + Duration::from_secs(1)).await;
        settle(&c, |_| count("assign") == 2).await;
        assert_eq!(c.report().drift_repairs, 1);
        assert!(c.assigned().contains(&ip));
        let last = script.lock().calls.iter().rev().find(|l| l.starts_with("assign")).cloned().unwrap();
        assert_eq!(last, r#"assign eni-1 198.18.1.40 {"aws:///z/i-1", "aws:///z/i-2"}"#);
    }

    #[tokio::test(start_paused = true)]
    async fn a_drifted_assignment_that_cannot_be_made_again_is_no_longer_served() {
        let script = Arc::new(Mutex::new(Script::default()));
        let factory = scripted(&script);
        let resync = Duration::from_secs(30);
        let c = Clouds::start(factory, resync, Arc::new(Notify::new()));
        let ip: IpAddr = "198.18.1.40".parse().unwrap();
        c.update(Some("aws:///z/i-1".into()), gateways(), BTreeMap::new(), BTreeMap::from([(ip, target())]));
        settle(&c, |c| c.assigned().contains(&ip)).await;
        {
            let mut s = script.lock();
            s.drifts = 1;
            s.assign_failures = u32::MAX;
        }
        tokio::time::sleep(resync + Duration::from_secs(1)).await;
        settle(&c, |c| !c.assigned().contains(&ip)).await;
        // Once the provider takes the call again: served again.
        script.lock().assign_failures = 0;
        settle(&c, |c| c.assigned().contains(&ip)).await;
        assert_eq!(c.report().drift_repairs, 1);
    }
}
