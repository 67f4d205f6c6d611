//! Endpoint-independent mappings (RFC 4787 REQ-1, RFC 5382 REQ-1).
//!
//! While any session of (pod, pod port) towards an egress IP lives, every new
//! session of that pod port reuses the same external (egress IP, port),
//! whatever the destination. The forward index maps (pod, pod port, protocol,
//! egress IP) to the external port; the [`PortPool`]'s owner cells are the
//! reverse index and hold the reference count.

use std::sync::{Arc, OnceLock};

use dashmap::DashMap;

use super::key::{proto, NatAddr};
use super::port_alloc::{candidates_ahead, PortAhead, PortMarks, PortPool, PortRange, PortRng};
use super::shard_map::ShardMap;
use super::table::PortMapHook;

/// Key of the forward index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct InsideKey<A> {
    pod: A,
    egress: A,
    pod_port: [u8; 2],
    proto: u8,
}

/// What a mapping is asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingRequest<A> {
    /// The egress IP.
    pub egress: A,
    /// The pod.
    pub pod: A,
    /// The pod's port.
    pub pod_port: u16,
    /// The protocol.
    pub proto: u8,
}

/// The result of acquiring a mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// An existing mapping was reused.
    Existing(u16),
    /// A new mapping kept the pod's own port.
    Preserved(u16),
    /// A new mapping took a random port.
    Random(u16),
}

impl Acquired {
    /// The external port.
    pub fn port(self) -> u16 {
        match self {
            Acquired::Existing(p) | Acquired::Preserved(p) | Acquired::Random(p) => p,
        }
    }
}

/// Why no mapping was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AcquireError {
    /// The pod already holds its quota of ports on this egress IP.
    SourceQuota,
    /// The bounded attempts found no free port.
    Exhausted,
}

/// Why [`Mappings::claim_exact`] could not claim its port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimError {
    /// The pod already holds its quota of ports on this egress IP.
    SourceQuota,
    /// Another mapping holds the port, or the pod port's mapping is on another port.
    Taken,
}

/// Port pools and endpoint-independent mappings of one address family.
pub struct Mappings<A: NatAddr> {
    pools: DashMap<(A, u8), Arc<PortPool<A>>, ahash::RandomState>,
    by_inside: ShardMap<InsideKey<A>, u16>,
    with_owners: bool,
    /// The mapped-port filter every pool marks its ports through, once
    /// connected ([`PortMarks`]).
    marks: OnceLock<Arc<dyn PortMapHook<A>>>,
}

impl<A: NatAddr> std::fmt::Debug for Mappings<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mappings")
            .field("pools", &self.pools)
            .field("by_inside", &self.by_inside)
            .field("with_owners", &self.with_owners)
            .field("marks", &self.marks.get().is_some())
            .finish()
    }
}

impl<A: NatAddr> Mappings<A> {
    /// `endpoint_independent` allocates owner cells (the reverse table).
    pub fn new(endpoint_independent: bool) -> Self {
        Mappings {
            pools: DashMap::with_hasher(ahash::RandomState::new()),
            by_inside: ShardMap::with_default_shards(),
            with_owners: endpoint_independent,
            marks: OnceLock::new(),
        }
    }

    /// Connects the mapped-port filter (once): every pool, those made
    /// from now on and those in use, marks its held ports through `hook`
    /// (endpoint-independent mode; [`PortMarks`]). Whether it was
    /// connected now.
    pub fn connect_marks(&self, hook: Arc<dyn PortMapHook<A>>) -> bool {
        if self.marks.set(hook).is_err() {
            return false;
        }
        for ((egress, proto), pool) in self.pools.iter().map(|e| (*e.key(), e.value().clone())) {
            if let Some(marks) = self.marks_for(egress, proto) {
                pool.connect_marks(marks);
            }
        }
        true
    }

    /// Where the pool of (egress, proto) marks its ports: TCP's and UDP's,
    /// once the filter is connected (XDP filters no other protocol's).
    fn marks_for(&self, egress: A, proto: u8) -> Option<PortMarks<A>> {
        let hook = self.marks.get().filter(|_| proto == proto::TCP || proto == proto::UDP)?;
        Some(PortMarks::new(hook.clone(), egress, proto))
    }

    /// Sets the bits of the ports `egress`'s pools hold again (the filter
    /// forgot the IP and tracks it anew while sessions still hold ports).
    pub fn remark(&self, egress: A) {
        for p in POOL_PROTOCOLS {
            if let Some(pool) = self.existing_pool(egress, p) {
                pool.remark();
            }
        }
    }

    /// Whether owner cells are kept (endpoint-independent mapping).
    pub fn endpoint_independent(&self) -> bool {
        self.with_owners
    }

    /// The pool of (egress, proto), created with `range` on first use,
    /// for the tables of `generation`. A pool whose range differs is kept,
    /// its range moved (unless set for a later generation): the sessions
    /// made before keep their ports until they end (those outside the new
    /// range are removed as no longer valid) and release them into it
    /// (ADR 0042).
    pub fn pool(&self, egress: A, proto: u8, range: PortRange, generation: u64) -> Arc<PortPool<A>> {
        let p = match self.pools.get(&(egress, proto)) {
            Some(p) => p.clone(),
            None => self
                .pools
                .entry((egress, proto))
                .or_insert_with(|| {
                    let p = PortPool::new(range, self.with_owners);
                    p.set_range(range, generation);
                    if let Some(marks) = self.marks_for(egress, proto) {
                        p.set_marks(marks);
                    }
                    Arc::new(p)
                })
                .clone(),
        };
        if p.range() != range {
            p.set_range(range, generation);
        }
        p
    }

    /// The existing pool of (egress, proto).
    pub fn existing_pool(&self, egress: A, proto: u8) -> Option<Arc<PortPool<A>>> {
        self.pools.get(&(egress, proto)).map(|p| p.clone())
    }

    /// Every pool: (egress, proto, pool).
    pub fn pools(&self) -> Vec<(A, u8, Arc<PortPool<A>>)> {
        self.pools.iter().map(|e| (e.key().0, e.key().1, e.value().clone())).collect()
    }

    /// Drops the pools of an egress IP this gateway no longer holds that
    /// nothing holds any more. A pool still held by a session (its sweep
    /// has not reached it yet) stays, so the session releases into it, and
    /// the IP, back before then, finds its ports still claimed. Returns
    /// whether every pool of `egress` is gone. (An idle pool has no
    /// mapping left: each mapping's index entry went with its last
    /// session, so there is none to drop here.)
    pub fn forget_egress(&self, egress: A) -> bool {
        let mut left = false;
        for p in POOL_PROTOCOLS {
            self.pools.remove_if(&(egress, p), |_, pool| unused(pool));
            left |= self.pools.contains_key(&(egress, p));
        }
        !left
    }

    /// Asks for the line of the mapping of (pod, pod port, protocol) on
    /// `req.egress` (nat/shard_map.rs).
    #[inline]
    pub fn prefetch(&self, req: MappingRequest<A>) {
        let MappingRequest { egress, pod, pod_port, proto } = req;
        self.by_inside.prefetch(&InsideKey { pod, egress, pod_port: pod_port.to_be_bytes(), proto });
    }

    /// Acquires the endpoint-independent mapping of (pod, pod_port, proto) on
    /// `egress`: the existing one, or a new one claimed by try-insert.
    /// `None` means no port: the pod is at its quota or the bounded attempts
    /// found no free port (both counted on the pool).
    pub fn acquire(
        &self,
        pool: &PortPool<A>,
        req: MappingRequest<A>,
        attempts: u32,
        rng: &mut PortRng,
    ) -> Option<Acquired> {
        self.try_acquire(pool, req, pool.range(), attempts, rng, None).ok()
    }

    /// [`Mappings::acquire`] with a new port drawn from `range` (the egress
    /// IP's, in the caller's configuration), saying why no port was given.
    /// Reusing an existing mapping costs no quota; a new one counts against
    /// the pod's quota in `pool` until it is freed.
    ///
    /// With `ahead` (the worker's port drawn ahead in this pool, kept in its
    /// pool memo), the first random candidate is that port, and a new one
    /// is drawn and its owner cell asked for once it is used ([`PortAhead`]).
    pub fn try_acquire(
        &self,
        pool: &PortPool<A>,
        req: MappingRequest<A>,
        range: PortRange,
        attempts: u32,
        rng: &mut PortRng,
        mut ahead: Option<&mut PortAhead>,
    ) -> Result<Acquired, AcquireError> {
        let got = self.try_acquire_by(pool, req, || {
            claim_first(pool, req, candidates_ahead(req.pod_port, range, attempts, ahead.as_deref_mut(), rng))
        });
        if let Some(ahead) = ahead {
            ahead.refill(pool, range, rng);
        }
        got
    }

    /// [`Mappings::try_acquire`] with the new port found by `claim`, which
    /// claims it in `pool` (try-insert) for (pod, pod port) or says why it
    /// could not: port blocks (nat/port_blocks.rs) choose their candidates
    /// this way. `claim` runs only when the pod port has no mapping yet
    /// and the pod is under its quota.
    pub fn try_acquire_by(
        &self,
        pool: &PortPool<A>,
        req: MappingRequest<A>,
        claim: impl FnOnce() -> Result<Acquired, AcquireError>,
    ) -> Result<Acquired, AcquireError> {
        let MappingRequest { egress, pod, pod_port, proto } = req;
        let key = InsideKey { pod, egress, pod_port: pod_port.to_be_bytes(), proto };
        // The shard stays locked throughout: two workers cannot create two
        // mappings for one pod port.
        self.by_inside.update(&key, |l| {
            if let Some(&port) = l.get(&key) {
                if pool.add_ref(port, pod, pod_port) {
                    return Ok(Acquired::Existing(port));
                }
                // Stale (its pool was dropped meanwhile): allocate afresh.
                l.remove(&key);
            }
            if !pool.admit_source(pod) {
                return Err(AcquireError::SourceQuota);
            }
            match claim() {
                Ok(a) => {
                    l.insert(key, a.port());
                    Ok(a)
                }
                Err(e) => {
                    pool.release_source(pod);
                    Err(e)
                }
            }
        })
    }

    /// Claims exactly `port` for the endpoint-independent mapping of
    /// (pod, pod port, protocol) on `req.egress`, for a session imported
    /// from the gateway that held the egress IP before (nat/sync.rs): joins
    /// the mapping when the pod port already has it on `port`; otherwise
    /// claims `port` if it is free and the pod is under its quota.
    pub fn claim_exact(&self, pool: &PortPool<A>, req: MappingRequest<A>, port: u16) -> Result<Acquired, ClaimError> {
        let MappingRequest { egress, pod, pod_port, proto } = req;
        let key = InsideKey { pod, egress, pod_port: pod_port.to_be_bytes(), proto };
        // The shard stays locked throughout, as in `try_acquire`.
        self.by_inside.update(&key, |l| {
            if let Some(&existing) = l.get(&key) {
                if existing == port && pool.add_ref(port, pod, pod_port) {
                    return Ok(Acquired::Existing(port));
                }
                if existing != port && pool.owner(existing).is_some_and(|w| w.pod == pod && w.pod_port == pod_port) {
                    // The pod port's live mapping is on another port.
                    return Err(ClaimError::Taken);
                }
                // Stale (its pool was dropped meanwhile): claim afresh.
                l.remove(&key);
            }
            if !pool.admit_source(pod) {
                return Err(ClaimError::SourceQuota);
            }
            if pool.try_claim(port, pod, pod_port) {
                l.insert(key, port);
                return Ok(Acquired::Random(port));
            }
            pool.release_source(pod);
            Err(ClaimError::Taken)
        })
    }

    /// Adds a session to an existing mapping (an inbound-created session).
    pub fn add_ref(&self, pool: &PortPool<A>, port: u16, pod: A, pod_port: u16) -> bool {
        pool.add_ref(port, pod, pod_port)
    }

    /// Releases one session's use of its mapping.
    pub fn release(&self, egress: A, pod: A, pod_port: u16, proto: u8, port: u16) {
        let key = InsideKey { pod, egress, pod_port: pod_port.to_be_bytes(), proto };
        self.by_inside.update(&key, |l| {
            if l.get(&key) != Some(&port) {
                return;
            }
            let gone = match self.pools.get(&(egress, proto)).map(|p| p.clone()) {
                Some(pool) => {
                    let freed = pool.release(port, pod, pod_port);
                    freed || pool.owner(port).is_none_or(|w| w.pod != pod || w.pod_port != pod_port)
                }
                None => true,
            };
            if gone {
                l.remove(&key);
            }
        });
    }

    /// Number of live endpoint-independent mappings.
    pub fn len(&self) -> usize {
        self.by_inside.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.by_inside.is_empty()
    }
}

/// The protocols with port pools: TCP and UDP ports, ICMP and ICMPv6
/// query identifiers.
const POOL_PROTOCOLS: [u8; 4] = [proto::TCP, proto::UDP, proto::ICMP, proto::ICMPV6];

/// Whether nothing holds `pool`: no port or pod counted in it, and no
/// reference but the map's (a worker on an older snapshot may be about to
/// claim in a pool it already holds; its claim then keeps the pool).
/// Asked under the map's shard lock, which every new reference is taken
/// under.
fn unused<A: NatAddr>(pool: &Arc<PortPool<A>>) -> bool {
    if Arc::strong_count(pool) != 1 {
        return false;
    }
    // The last other reference was dropped (a release decrement) after
    // its claims were counted: see them.
    std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
    pool.is_idle()
}

/// Claims the first free port of `candidates` for (pod, pod port): the pod's
/// own port if it comes first and is free (preserved), else a random one.
fn claim_first<A: NatAddr>(
    pool: &PortPool<A>,
    req: MappingRequest<A>,
    candidates: impl Iterator<Item = u16>,
) -> Result<Acquired, AcquireError> {
    for (i, port) in candidates.enumerate() {
        if pool.try_claim(port, req.pod, req.pod_port) {
            return Ok(if i == 0 && port == req.pod_port { Acquired::Preserved(port) } else { Acquired::Random(port) });
        }
    }
    pool.count_exhausted();
    Err(AcquireError::Exhausted)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::nat::key::proto::{TCP, UDP};

    const E: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
    const POD: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
    const POD2: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);

    #[test]
    fn same_pod_port_gets_same_mapping_until_released() {
        let m = Mappings::new(true);
        let pool = m.pool(E, UDP, PortRange::default(), 1);
        let mut rng = PortRng::new(3);
        let a =
            m.acquire(&pool, MappingRequest { egress: E, pod: POD, pod_port: 40000, proto: UDP }, 8, &mut rng).unwrap();
        assert_eq!(a, Acquired::Preserved(40000));
        let b =
            m.acquire(&pool, MappingRequest { egress: E, pod: POD, pod_port: 40000, proto: UDP }, 8, &mut rng).unwrap();
        assert_eq!(b, Acquired::Existing(40000));
        // Another pod with the same port gets a random one.
        let c = m
            .acquire(&pool, MappingRequest { egress: E, pod: POD2, pod_port: 40000, proto: UDP }, 8, &mut rng)
            .unwrap();
        assert!(matches!(c, Acquired::Random(p) if p != 40000));
        // TCP is a separate pool.
        let tpool = m.pool(E, TCP, PortRange::default(), 1);
        assert_eq!(
            m.acquire(&tpool, MappingRequest { egress: E, pod: POD2, pod_port: 40000, proto: TCP }, 8, &mut rng),
            Some(Acquired::Preserved(40000))
        );
        m.release(E, POD, 40000, UDP, 40000);
        assert_eq!(pool.owner(40000).map(|o| o.refs), Some(1));
        m.release(E, POD, 40000, UDP, 40000);
        assert_eq!(pool.owner(40000), None);
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn exhaustion_is_counted_and_never_falls_back() {
        let m = Mappings::new(true);
        let range = PortRange { first: 50000, last: 50001 };
        let pool = m.pool(E, UDP, range, 1);
        let mut rng = PortRng::new(9);
        assert!(m
            .acquire(&pool, MappingRequest { egress: E, pod: POD, pod_port: 1, proto: UDP }, 64, &mut rng)
            .is_some());
        assert!(m
            .acquire(&pool, MappingRequest { egress: E, pod: POD, pod_port: 2, proto: UDP }, 64, &mut rng)
            .is_some());
        assert_eq!(
            m.acquire(&pool, MappingRequest { egress: E, pod: POD, pod_port: 3, proto: UDP }, 64, &mut rng),
            None
        );
        assert_eq!(pool.exhausted(), 1);
        assert_eq!(pool.in_use(), 2);
        assert_eq!(m.len(), 2, "the failed attempt leaves no index entry");
    }

    /// A worker's port drawn ahead (its pool memo's) is the first random
    /// candidate: a pod whose own port is taken gets it, and the next one
    /// is drawn; a port drawn ahead that another mapping took meanwhile is
    /// passed over like any taken candidate.
    #[test]
    fn a_new_mapping_takes_the_port_drawn_ahead() {
        let m = Mappings::new(true);
        let range = PortRange { first: 50000, last: 50999 };
        let pool = m.pool(E, UDP, range, 1);
        let mut rng = PortRng::new(11);
        let mut ahead = PortAhead::default();
        let ask = |pod, pod_port, rng: &mut PortRng, ahead: &mut PortAhead| {
            m.try_acquire(&pool, MappingRequest { egress: E, pod, pod_port, proto: UDP }, range, 8, rng, Some(ahead))
        };
        assert_eq!(ask(POD, 50001, &mut rng, &mut ahead), Ok(Acquired::Preserved(50001)));
        let drawn = ahead.port().expect("drawn after the first allocation");
        assert_eq!(ask(POD2, 50001, &mut rng, &mut ahead), Ok(Acquired::Random(drawn)), "its own port is taken");
        let next = ahead.port().expect("drawn again once used");
        assert_eq!(pool.owner(drawn).map(|o| o.pod), Some(POD2));
        // Another worker takes the next port drawn ahead first.
        assert!(pool.try_claim(next, POD, 7));
        let got = ask(POD2, 50001 + 1, &mut rng, &mut ahead).expect("a port");
        assert!(matches!(got, Acquired::Preserved(50002)), "{got:?}");
        let got = ask(POD2, 50001, &mut rng, &mut ahead).expect("a port");
        assert_eq!(got, Acquired::Existing(drawn), "the pod port's mapping is reused");
        let got = ask(POD, 7, &mut rng, &mut ahead).expect("a port");
        assert!(matches!(got, Acquired::Random(p) if p != next && range.contains(p)), "passed over: {got:?}");
        assert!(ahead.port().is_some_and(|p| p != next), "drawn again after the taken one was tried");
    }

    #[test]
    fn a_pod_at_its_quota_is_refused_while_another_gets_a_port() {
        let m = Mappings::new(true);
        let pool = m.pool(E, UDP, PortRange { first: 50000, last: 50009 }, 1);
        pool.set_source_quota(3);
        let mut rng = PortRng::new(5);
        let ask = |pod, pod_port, rng: &mut PortRng| {
            m.try_acquire(&pool, MappingRequest { egress: E, pod, pod_port, proto: UDP }, pool.range(), 64, rng, None)
        };
        for p in 1..=3 {
            assert!(ask(POD, p, &mut rng).is_ok());
        }
        assert_eq!(ask(POD, 4, &mut rng), Err(AcquireError::SourceQuota));
        assert!(matches!(ask(POD, 2, &mut rng), Ok(Acquired::Existing(_))), "an existing mapping costs nothing");
        assert!(ask(POD2, 4, &mut rng).is_ok(), "another pod still gets a port");
        assert_eq!((pool.over_quota(), pool.exhausted(), pool.source_ports(POD)), (1, 0, 3));
        assert_eq!(m.len(), 4, "the refused request leaves no index entry");
    }

    #[test]
    fn changing_the_range_keeps_the_pool_and_its_claims() {
        let m = Mappings::new(true);
        let p1 = m.pool(E, UDP, PortRange { first: 1000, last: 1999 }, 1);
        let mut rng = PortRng::new(1);
        let req = MappingRequest { egress: E, pod: POD, pod_port: 1500, proto: UDP };
        assert_eq!(m.acquire(&p1, req, 4, &mut rng), Some(Acquired::Preserved(1500)));
        let p2 = m.pool(E, UDP, PortRange { first: 1000, last: 2999 }, 2);
        assert!(Arc::ptr_eq(&p1, &p2), "one pool for the IP's life");
        assert_eq!(p2.range(), PortRange { first: 1000, last: 2999 });
        m.pool(E, UDP, PortRange { first: 1000, last: 1999 }, 1);
        assert_eq!(p2.range(), PortRange { first: 1000, last: 2999 }, "a worker on the older tables moves nothing");
        // The pod port's next flow joins its mapping; another pod never gets the port.
        assert_eq!(m.acquire(&p2, req, 4, &mut rng), Some(Acquired::Existing(1500)));
        assert!(!p2.try_claim(1500, POD2, 1500));
        // A narrowed range draws from the new one; the old port is still held.
        let p3 = m.pool(E, UDP, PortRange { first: 2000, last: 2999 }, 3);
        let other = MappingRequest { egress: E, pod: POD2, pod_port: 1500, proto: UDP };
        assert!(matches!(m.acquire(&p3, other, 4, &mut rng), Some(Acquired::Random(p)) if (2000..=2999).contains(&p)));
        m.release(E, POD, 1500, UDP, 1500);
        assert_eq!(p3.owner(1500).map(|o| o.refs), Some(1));
        m.release(E, POD, 1500, UDP, 1500);
        assert_eq!(p3.owner(1500), None);
    }

    #[test]
    fn a_forgotten_egress_ip_keeps_a_pool_something_holds() {
        let m = Mappings::new(true);
        let pool = m.pool(E, UDP, PortRange::default(), 1);
        let mut rng = PortRng::new(2);
        let req = MappingRequest { egress: E, pod: POD, pod_port: 40000, proto: UDP };
        assert!(m.acquire(&pool, req, 4, &mut rng).is_some());
        assert!(!m.forget_egress(E), "a reference besides the map's");
        drop(pool);
        assert!(!m.forget_egress(E), "a mapping lives");
        // Back before its session ended: the same pool, the mapping joined.
        let pool = m.pool(E, UDP, PortRange::default(), 1);
        assert_eq!(m.acquire(&pool, req, 4, &mut rng), Some(Acquired::Existing(40000)));
        m.release(E, POD, 40000, UDP, 40000);
        m.release(E, POD, 40000, UDP, 40000);
        drop(pool);
        assert_eq!(m.len(), 0, "the mapping's entry went with its last session");
        assert!(m.forget_egress(E), "nothing holds it");
        assert!(m.existing_pool(E, UDP).is_none());
    }
}
