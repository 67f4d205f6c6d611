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

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{Cloud, CloudError, Discovered, Interface, PoolSelector, PublicAddress};

/// How often each pool is asked again (retagged or new public addresses
/// are noticed within this time).
pub const DEFAULT_RESYNC: Duration = Duration::from_secs(30);
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Releases are tidying: tried this many times, then left to the next holder.
const RELEASE_ATTEMPTS: u32 = 5;
/// How long a gateway stops competing for an address the provider refused
/// it for good (no interface in the subnet, no `providerID`, not allowed,
/// the interface full): another gateway serves it meanwhile.
pub const REFUSED_FOR: Duration = Duration::from_secs(60);

/// A held cloud address: where it must go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The pool's subnet (this gateway's interface there receives it).
    pub subnet_id: String,
    /// The public address associated with it.
    pub public: PublicAddress,
}

/// Makes the provider, once a cloud pool needs it (AWS's credential and
/// region chain may probe the instance metadata service: not before).
pub type Factory = Box<dyn Fn() -> BoxFuture<'static, Arc<dyn Cloud>> + Send + Sync>;

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
    /// Interfaces whose source/destination check was reported on.
    check_reported: BTreeSet<String>,
    /// Addresses the provider refused for good, until then.
    refused: BTreeMap<IpAddr, Instant>,
}

/// The sync loop's handle on the cloud task.
#[derive(Clone)]
pub struct Clouds {
    state: Arc<Mutex<State>>,
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
    /// Per held cloud address: its public address and state.
    pub addresses: Vec<(IpAddr, IpAddr, AddressState)>,
    /// Per subnet: this gateway's interface, or why it is not known.
    pub interfaces: Vec<(String, Result<Interface, CloudError>)>,
}

impl Clouds {
    /// Starts the task; `changed` is notified whenever something the sync
    /// loop reads changed (a discovery, an assignment).
    pub fn start(factory: Factory, resync: Duration, changed: Arc<Notify>) -> Clouds {
        let c = Clouds { state: Arc::default(), wake: Arc::new(Notify::new()) };
        let task = c.clone();
        tokio::spawn(async move { task.run(factory, resync, changed).await });
        c
    }

    /// The sync loop's pass: this gateway's `spec.providerID`, the cloud
    /// pools, and the cloud addresses it holds a Lease for.
    pub fn update(
        &self,
        provider_id: Option<String>,
        pools: BTreeMap<String, PoolSelector>,
        want: BTreeMap<IpAddr, Target>,
    ) {
        let mut st = self.state.lock();
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
        st.node_provider_id = provider_id;
        st.pools = pools;
        st.want = want;
        drop(st);
        if changed {
            self.wake.notify_one();
        }
    }

    /// Gives up every address (the gateway stops for good) and waits at most
    /// `wait` for their releases; returns how many are still to release.
    pub async fn release_all(&self, wait: Duration) -> usize {
        let (provider_id, pools) = {
            let st = self.state.lock();
            (st.node_provider_id.clone(), st.pools.clone())
        };
        self.update(provider_id, pools, BTreeMap::new());
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
                    (*ip, t.public.public_ip, s)
                })
                .collect(),
            interfaces: st.interfaces.iter().map(|(subnet, r)| (subnet.clone(), r.clone())).collect(),
        }
    }

    async fn run(self, factory: Factory, resync: Duration, changed: Arc<Notify>) {
        let mut cloud: Option<Arc<dyn Cloud>> = None;
        loop {
            let needed = {
                let st = self.state.lock();
                !st.pools.is_empty() || !st.want.is_empty() || !st.releasing.is_empty()
            };
            if needed && cloud.is_none() {
                cloud = Some(factory().await);
            }
            let next = match &cloud {
                Some(c) if needed => self.step(c.as_ref(), resync, &changed).await,
                _ => None,
            };
            let sleep = next.map_or(Duration::from_secs(3600), |t| t.saturating_duration_since(Instant::now()));
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep(sleep) => {}
            }
        }
    }

    /// One round: whatever is due. Returns when the next thing is due.
    async fn step(&self, cloud: &dyn Cloud, resync: Duration, changed: &Notify) -> Option<Instant> {
        let now = Instant::now();
        let (provider_id, pools, want) = {
            let st = self.state.lock();
            (st.node_provider_id.clone(), st.pools.clone(), st.want.clone())
        };
        let mut dirty = false;

        // This gateway's interface in each subnet that a pool or a held address uses.
        let subnets: BTreeSet<String> =
            pools.values().map(|p| p.subnet_id.clone()).chain(want.values().map(|t| t.subnet_id.clone())).collect();
        for subnet in &subnets {
            if self.state.lock().next_interface.get(subnet).is_some_and(|t| *t > now) {
                continue;
            }
            let r = match &provider_id {
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
                            "source/destination check is on: the VPC drops the pods' traffic this gateway receives; turn it off (docs/kubernetes.md, Running on AWS)"
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

        // Held addresses first (a take-over waits for them): assign those
        // not on this gateway's interface yet.
        for (ip, target) in &want {
            let due = {
                let st = self.state.lock();
                !matches!(st.addresses.get(ip), Some(AddressState::Assigned { .. }))
                    && st.next_try.get(ip).is_none_or(|t| *t <= now)
            };
            if !due {
                continue;
            }
            let interface = self.state.lock().interfaces.get(&target.subnet_id).cloned();
            let attempts = match self.state.lock().addresses.get(ip) {
                Some(AddressState::Pending { attempts, .. }) => *attempts,
                _ => 0,
            };
            let r = match interface {
                Some(Ok(i)) => cloud.assign(&i.interface_id, *ip, Some(&target.public)).await.map(|()| i.interface_id),
                Some(Err(e)) => Err(e),
                None => continue,
            };
            let mut st = self.state.lock();
            if !st.want.contains_key(ip) {
                // Given up while the call ran: released next round.
                if let Ok(interface_id) = r {
                    st.releasing.insert(*ip, (interface_id, 0));
                }
                continue;
            }
            match r {
                Ok(interface_id) => {
                    tracing::info!(ip = %ip, public = %target.public.public_ip, interface = %interface_id, "cloud address assigned");
                    st.releasing.remove(ip);
                    st.next_try.remove(ip);
                    st.addresses.insert(*ip, AddressState::Assigned { interface_id });
                    dirty = true;
                }
                Err(e) if !e.retryable => {
                    tracing::warn!(
                        ip = %ip, error = %e,
                        "cloud address refused for good: not translating to it, and not competing for it for {} s",
                        REFUSED_FOR.as_secs()
                    );
                    st.refused.insert(*ip, now + REFUSED_FOR);
                    st.next_try.insert(*ip, now + BACKOFF_MAX);
                    st.addresses
                        .insert(*ip, AddressState::Pending { attempts: attempts + 1, error: Some(e.to_string()) });
                    dirty = true;
                }
                Err(e) => {
                    tracing::warn!(ip = %ip, error = %e, attempt = attempts + 1, "cloud address not assigned; not translating to it");
                    st.next_try.insert(*ip, now + backoff(attempts + 1));
                    st.addresses
                        .insert(*ip, AddressState::Pending { attempts: attempts + 1, error: Some(e.to_string()) });
                }
            }
        }

        // Addresses given up: out of the tables already; release them.
        let gone: Vec<(IpAddr, AddressState)> = {
            let mut st = self.state.lock();
            let gone: Vec<IpAddr> = st.addresses.keys().filter(|ip| !want.contains_key(ip)).copied().collect();
            gone.into_iter().filter_map(|ip| st.addresses.remove(&ip).map(|s| (ip, s))).collect()
        };
        for (ip, s) in gone {
            self.state.lock().next_try.remove(&ip);
            if let AddressState::Assigned { interface_id } = s {
                self.state.lock().releasing.insert(ip, (interface_id, 0));
            }
        }
        let releasing: Vec<(IpAddr, String, u32)> = {
            let st = self.state.lock();
            st.releasing
                .iter()
                .filter(|(ip, _)| !want.contains_key(ip) && st.next_try.get(ip).is_none_or(|t| *t <= now))
                .map(|(ip, (i, n))| (*ip, i.clone(), *n))
                .collect()
        };
        for (ip, interface_id, n) in releasing {
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

        // Discovery, per pool.
        for (name, sel) in &pools {
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
        {
            let mut st = self.state.lock();
            st.discovered.retain(|name, _| pools.contains_key(name));
            st.next_discovery.retain(|name, _| pools.contains_key(name));
        }

        if dirty {
            changed.notify_one();
        }
        let mut st = self.state.lock();
        // Only what is still in use has a deadline (a stale one would spin).
        st.interfaces.retain(|subnet, _| subnets.contains(subnet));
        st.next_interface.retain(|subnet, _| subnets.contains(subnet));
        let releasing: BTreeSet<IpAddr> = st.releasing.keys().copied().collect();
        let assigned: BTreeSet<IpAddr> = st
            .addresses
            .iter()
            .filter(|(_, s)| matches!(s, AddressState::Assigned { .. }))
            .map(|(ip, _)| *ip)
            .collect();
        st.next_try.retain(|ip, _| (want.contains_key(ip) && !assigned.contains(ip)) || releasing.contains(ip));
        st.refused.retain(|_, until| *until > now);
        st.next_discovery.values().chain(st.next_interface.values()).chain(st.next_try.values()).copied().min()
    }
}

/// 200 ms, 400 ms, ... up to 10 s.
fn backoff(attempt: u32) -> Duration {
    BACKOFF_MIN.saturating_mul(1 << attempt.saturating_sub(1).min(6)).min(BACKOFF_MAX)
}

#[cfg(test)]
mod tests {
    //! The task's own logic, with a scripted provider (the provider itself
    //! is tested against moto: tests/tests/cloud_aws.rs, k8s_cloud.rs).
    use super::*;
    use ipnet::IpNet;

    #[derive(Default)]
    struct Script {
        /// Assign calls fail while this is above 0 (counting down).
        assign_failures: u32,
        /// Assign calls fail for good (not retryable).
        assign_refused: bool,
        calls: Vec<String>,
    }

    struct Scripted(Arc<Mutex<Script>>);

    fn err(op: &'static str) -> CloudError {
        CloudError { operation: op, code: "RequestLimitExceeded".into(), message: "slow down".into(), retryable: true }
    }

    impl Cloud for Scripted {
        fn name(&self) -> &'static str {
            "scripted"
        }
        fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
            self.0.lock().calls.push(format!("discover {}", pool.subnet_id));
            Box::pin(async {
                Ok(Discovered {
                    public: vec![],
                    subnet_cidr: "198.18.1.0/24".parse::<IpNet>().unwrap(),
                    used: BTreeSet::new(),
                })
            })
        }
        fn interface<'a>(
            &'a self,
            provider_id: &'a str,
            subnet: &'a str,
        ) -> BoxFuture<'a, Result<Interface, CloudError>> {
            self.0.lock().calls.push(format!("interface {provider_id} {subnet}"));
            Box::pin(async {
                Ok(Interface {
                    instance_id: "i-1".into(),
                    interface_id: "eni-1".into(),
                    primary_ip: "198.18.1.4".parse().unwrap(),
                    secondary_ips: BTreeSet::new(),
                    source_dest_check: false,
                })
            })
        }
        fn assign<'a>(
            &'a self,
            i: &'a str,
            p: IpAddr,
            _: Option<&'a PublicAddress>,
        ) -> BoxFuture<'a, Result<(), CloudError>> {
            let mut s = self.0.lock();
            s.calls.push(format!("assign {i} {p}"));
            let fail = s.assign_failures > 0;
            s.assign_failures = s.assign_failures.saturating_sub(1);
            let refused = s.assign_refused;
            Box::pin(async move {
                if refused {
                    Err(CloudError {
                        operation: "AssignPrivateIpAddresses",
                        code: "UnauthorizedOperation".into(),
                        message: "not allowed".into(),
                        retryable: false,
                    })
                } else if fail {
                    Err(err("AssignPrivateIpAddresses"))
                } else {
                    Ok(())
                }
            })
        }
        fn release<'a>(&'a self, i: &'a str, p: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
            self.0.lock().calls.push(format!("release {i} {p}"));
            Box::pin(async { Ok(()) })
        }
    }

    fn target() -> Target {
        Target {
            subnet_id: "subnet-1".into(),
            public: PublicAddress {
                public_ip: "192.0.2.7".parse().unwrap(),
                allocation_id: "eipalloc-1".into(),
                private_ip: None,
                interface_id: None,
            },
        }
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
        let s2 = script.clone();
        let factory: Factory = Box::new(move || {
            let s = s2.clone();
            Box::pin(async move { Arc::new(Scripted(s)) as Arc<dyn Cloud> })
        });
        let changed = Arc::new(Notify::new());
        let c = Clouds::start(factory, DEFAULT_RESYNC, changed.clone());
        let ip: IpAddr = "198.18.1.40".parse().unwrap();
        let pools = BTreeMap::from([(
            "p".to_string(),
            PoolSelector { tags: [("k".into(), "v".into())].into(), subnet_id: "subnet-1".into() },
        )]);
        c.update(Some("aws:///z/i-1".into()), pools.clone(), BTreeMap::from([(ip, target())]));
        // Two throttled attempts: not assigned, so not translated to.
        settle(&c, |c| matches!(c.report().addresses.first(), Some((_, _, AddressState::Pending { attempts: 2, .. }))))
            .await;
        assert!(c.assigned().is_empty());
        // The third attempt (after the backoff) succeeds.
        settle(&c, |c| c.assigned().contains(&ip)).await;
        // Given up: out of `assigned` at once, then released.
        c.update(Some("aws:///z/i-1".into()), pools, BTreeMap::new());
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
        let s2 = script.clone();
        let factory: Factory = Box::new(move || {
            let s = s2.clone();
            Box::pin(async move { Arc::new(Scripted(s)) as Arc<dyn Cloud> })
        });
        let c = Clouds::start(factory, DEFAULT_RESYNC, Arc::new(Notify::new()));
        let ips: Vec<IpAddr> = ["198.18.1.40", "198.18.1.41"].iter().map(|s| s.parse().unwrap()).collect();
        let pools = BTreeMap::from([(
            "p".to_string(),
            PoolSelector { tags: [("k".into(), "v".into())].into(), subnet_id: "subnet-1".into() },
        )]);
        c.update(Some("aws:///z/i-1".into()), pools, ips.iter().map(|ip| (*ip, target())).collect());
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
        let s2 = script.clone();
        let factory: Factory = Box::new(move || {
            let s = s2.clone();
            Box::pin(async move { Arc::new(Scripted(s)) as Arc<dyn Cloud> })
        });
        let c = Clouds::start(factory, DEFAULT_RESYNC, Arc::new(Notify::new()));
        let ip: IpAddr = "198.18.1.40".parse().unwrap();
        let want = || BTreeMap::from([(ip, target())]);
        c.update(Some("aws:///z/i-1".into()), BTreeMap::new(), want());
        settle(&c, |c| c.refused().contains(&ip)).await;
        assert!(c.assigned().is_empty());

        // Allowed now: assigned; then the Lease goes and comes back before
        // the task runs again: not served on the old assignment's word.
        script.lock().assign_refused = false;
        c.state.lock().next_try.clear();
        c.wake.notify_one();
        settle(&c, |c| c.assigned().contains(&ip)).await;
        c.update(Some("aws:///z/i-1".into()), BTreeMap::new(), BTreeMap::new());
        c.update(Some("aws:///z/i-1".into()), BTreeMap::new(), want());
        assert!(c.assigned().is_empty(), "a Lease lost and won back needs a new assignment");
        settle(&c, |c| c.assigned().contains(&ip)).await;
    }
}
