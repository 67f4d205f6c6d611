//! Port use per egress IP, per destination and per pod, and the warnings
//! before it runs out (ADR 0035).
//!
//! What runs out depends on the mapping behaviour. Endpoint-independent: an
//! egress IP's range per protocol (one port per pod mapping), and a pod's
//! quota (`nat.maxPortsPerSource`) of mappings. Endpoint-dependent: a port
//! is taken towards one remote (address, port) only, so the range runs out
//! per (egress IP, protocol, remote address, remote port), a *destination*,
//! and a pod's quota counts its sessions towards each destination.
//!
//! The workers do nothing more for this: each pool already counts what every
//! pod holds ([`PortPool::for_each_source`]). Every `metrics.portUseRefresh`
//! the daemon walks those counters on a blocking thread ([`pool_use`]): it
//! sums them per destination and keeps the top `metrics.portUseTop`
//! destinations and pods of each pool ([`TopN`]). The result is one
//! [`PortUse`] snapshot, which the metrics and `egret ports` show as it is
//! (the label set is the last walk's, so series cannot grow without bound),
//! and which [`Alarms`] compares against the warning levels: a subject that
//! reaches a level is reported once, and again only after its use fell
//! [`HYSTERESIS`] points below that level. [`Monitor`] holds the snapshot,
//! the alarms and the crossings the Kubernetes control plane turns into
//! Warning Events.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_dataplane::nat::key::NatAddr;
use egret_dataplane::nat::port_alloc::PortPool;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Destinations and pods kept per pool when `metrics.portUseTop` is not set.
pub const DEFAULT_TOP: usize = 10;
/// The largest `metrics.portUseTop`: 100 destinations and 100 pods per
/// (egress IP, protocol) is already more series than a dashboard reads.
pub const MAX_TOP: usize = 100;
/// How often the counters are walked when `metrics.portUseRefresh` is not set.
pub const DEFAULT_REFRESH: Duration = Duration::from_secs(10);
/// The warning levels, percent of the limit (the range, or the pod's
/// quota), ascending: the first leaves time to act (add an egress IP,
/// widen the range), the second says it is about to happen.
pub const WARN_LEVELS: [u64; 2] = [80, 95];
/// A level is reported again only after use fell this many points below it.
pub const HYSTERESIS: u64 = 10;
/// A subject absent from every top N this long is forgotten (its levels
/// are re-armed); until then a return is not reported again.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);
/// Crossings waiting for the Kubernetes control plane; older ones are dropped
/// (and counted) beyond this.
pub const MAX_PENDING: usize = 256;

/// Ports in use towards one destination (endpoint-dependent mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DestinationUse {
    /// Remote address and port.
    pub remote: SocketAddr,
    /// Ports (sessions) in use towards it.
    pub in_use: u64,
}

/// Ports a pod holds (towards one destination in endpoint-dependent mode).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodUse {
    /// The pod's address.
    pub pod: IpAddr,
    /// The destination (endpoint-dependent mode), None for mappings.
    pub remote: Option<SocketAddr>,
    /// Ports held.
    pub in_use: u64,
}

/// One (egress IP, protocol)'s use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolUse {
    /// The egress IP.
    pub egress_ip: IpAddr,
    /// tcp | udp | icmp.
    pub proto: String,
    /// Endpoint-dependent mode: the range is per destination.
    pub endpoint_dependent: bool,
    /// Ports in use (endpoint-dependent: sessions, over all destinations).
    pub in_use: u64,
    /// The range's size: per destination in endpoint-dependent mode.
    pub capacity: u64,
    /// Ports one pod may hold (per destination in endpoint-dependent mode);
    /// None while the pool has allocated nothing (no quota set yet).
    pub pod_quota: Option<u64>,
    /// The top destinations by ports in use, most first (endpoint-dependent
    /// mode; empty otherwise).
    pub destinations: Vec<DestinationUse>,
    /// The top pods by ports held, most first.
    pub pods: Vec<PodUse>,
}

/// One walk over every pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PortUse {
    /// Per (egress IP, protocol), sorted.
    pub pools: Vec<PoolUse>,
    /// Counter entries walked.
    pub entries: u64,
    /// How long the walk took, microseconds.
    pub walk_micros: u64,
    /// Warnings (levels reached) since start, this one's included.
    pub warnings: u64,
}

/// The `n` largest of what is offered, by count, ties to the smaller key:
/// a min-heap of `n`, so a walk over M entries costs O(M log n) and `n`
/// entries of memory.
#[derive(Debug)]
pub struct TopN<K: Ord> {
    n: usize,
    heap: BinaryHeap<Reverse<(u64, Reverse<K>)>>,
}

impl<K: Ord> TopN<K> {
    /// Keeps at most `n`.
    pub fn new(n: usize) -> Self {
        TopN { n, heap: BinaryHeap::with_capacity(n + 1) }
    }

    /// Offers `key` with `count`.
    pub fn offer(&mut self, count: u64, key: K) {
        if self.n == 0 {
            return;
        }
        let item = Reverse((count, Reverse(key)));
        if self.heap.len() < self.n {
            self.heap.push(item);
        } else if self.heap.peek().is_some_and(|min| item < *min) {
            // `item < min` in the reversed order: it ranks above the smallest kept.
            self.heap.pop();
            self.heap.push(item);
        }
    }

    /// The kept entries, largest first.
    pub fn into_sorted(self) -> Vec<(u64, K)> {
        // Ascending order of `Reverse(..)` is descending order of (count, Reverse(key)).
        self.heap.into_sorted_vec().into_iter().map(|Reverse((c, Reverse(k)))| (c, k)).collect()
    }
}

/// Walks one pool's counters: the top `top` destinations (endpoint-dependent
/// mode) and pods. Returns the use and the entries walked.
pub fn pool_use<A: NatAddr>(
    egress: A,
    proto: u8,
    pool: &PortPool<A>,
    endpoint_dependent: bool,
    top: usize,
) -> (PoolUse, u64) {
    // Copied out first: the walk holds each shard of the counters while it
    // visits it, and a worker admitting a pod of that shard waits; a copy
    // is a few ns per entry, the sums and the ranking below are not.
    let mut copy: Vec<(A, A, u16, u32)> = Vec::new();
    pool.for_each_source(|pod, remote, remote_port, n| copy.push((pod, remote, remote_port, n)));
    let entries = copy.len() as u64;
    let mut per_destination: HashMap<(A, u16), u64> = HashMap::new();
    let mut pods = TopN::new(top);
    for (pod, remote, remote_port, n) in copy {
        if endpoint_dependent {
            *per_destination.entry((remote, remote_port)).or_default() += u64::from(n);
        }
        pods.offer(u64::from(n), (pod, remote, remote_port));
    }
    let mut destinations = TopN::new(top);
    for (k, n) in per_destination {
        destinations.offer(n, k);
    }
    let quota = pool.source_quota();
    let u = PoolUse {
        egress_ip: egress.ip(),
        proto: crate::view::proto_name(proto).into(),
        endpoint_dependent,
        in_use: u64::from(pool.in_use()),
        capacity: u64::from(pool.range().len()),
        pod_quota: (quota != u32::MAX).then_some(u64::from(quota)),
        destinations: destinations
            .into_sorted()
            .into_iter()
            .map(|(in_use, (r, p))| DestinationUse { remote: SocketAddr::new(r.ip(), p), in_use })
            .collect(),
        pods: pods
            .into_sorted()
            .into_iter()
            .map(|(in_use, (pod, r, p))| PodUse {
                pod: pod.ip(),
                remote: endpoint_dependent.then(|| SocketAddr::new(r.ip(), p)),
                in_use,
            })
            .collect(),
    };
    (u, entries)
}

/// What a warning is about.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Subject {
    /// Endpoint-independent mode: an egress IP's range for a protocol.
    EgressIp {
        /// The egress IP.
        egress_ip: IpAddr,
        /// The protocol.
        proto: String,
    },
    /// Endpoint-dependent mode: an egress IP's range towards one destination.
    Destination {
        /// The egress IP.
        egress_ip: IpAddr,
        /// The protocol.
        proto: String,
        /// The destination.
        remote: SocketAddr,
    },
    /// A pod against its quota (towards one destination in endpoint-dependent mode).
    Pod {
        /// The egress IP.
        egress_ip: IpAddr,
        /// The protocol.
        proto: String,
        /// The pod's address.
        pod: IpAddr,
        /// The destination (endpoint-dependent mode).
        remote: Option<SocketAddr>,
    },
}

impl Subject {
    /// The egress IP it is about.
    pub fn egress_ip(&self) -> IpAddr {
        match self {
            Subject::EgressIp { egress_ip, .. }
            | Subject::Destination { egress_ip, .. }
            | Subject::Pod { egress_ip, .. } => *egress_ip,
        }
    }
}

/// Event reasons.
pub mod reason {
    /// An egress IP's ports (towards a destination) near exhaustion.
    pub const PORTS_NEAR_EXHAUSTION: &str = "PortsNearExhaustion";
    /// A pod near its port quota.
    pub const POD_PORT_QUOTA_NEAR: &str = "PodPortQuotaNearExhaustion";
}

/// A subject reached a warning level.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Crossing {
    /// What.
    pub subject: Subject,
    /// The level reached, percent.
    pub level: u64,
    /// Ports in use.
    pub in_use: u64,
    /// The limit: the range, or the pod's quota.
    pub limit: u64,
}

impl Crossing {
    /// The Event's reason.
    pub fn reason(&self) -> &'static str {
        match self.subject {
            Subject::Pod { .. } => reason::POD_PORT_QUOTA_NEAR,
            _ => reason::PORTS_NEAR_EXHAUSTION,
        }
    }

    /// The Event's note (`gateway`: this gateway's name).
    pub fn message(&self, gateway: &str) -> String {
        let (n, l, lv) = (self.in_use, self.limit, self.level);
        match &self.subject {
            Subject::EgressIp { egress_ip, proto } => format!(
                "egress IP {egress_ip} uses {n} of its {l} {proto} ports (>= {lv}%) on gateway {gateway}: new connections are refused once none is free; add egress IPs or widen the port range"
            ),
            Subject::Destination { egress_ip, proto, remote } => format!(
                "egress IP {egress_ip} uses {n} of its {l} {proto} ports towards {remote} (>= {lv}%) on gateway {gateway}: new connections to it are refused once none is free; add egress IPs or widen the port range"
            ),
            Subject::Pod { egress_ip, proto, pod, remote } => {
                let towards = remote.map(|r| format!(" towards {r}")).unwrap_or_default();
                format!(
                    "pod {pod} holds {n} of its quota of {l} {proto} ports on egress IP {egress_ip}{towards} (>= {lv}%) on gateway {gateway}: its new connections are refused at the quota (nat.maxPortsPerSource)"
                )
            }
        }
    }
}

/// The Warning Events of `crossings` (`gateway`: this gateway's name), as
/// (object, reason, note): each on the egress IP's owner (`owner_of`: its
/// policy or Service) and, for a pod's quota, on the pod too (`pod_of`).
/// An object not known (an IP whose owner is gone, a pod not in the watch)
/// gets none: the crossing was logged already.
pub fn events<R>(
    crossings: &[Crossing],
    gateway: &str,
    owner_of: impl Fn(IpAddr) -> Option<R>,
    pod_of: impl Fn(IpAddr) -> Option<R>,
) -> Vec<(R, &'static str, String)> {
    let mut out = Vec::new();
    for c in crossings {
        let note = c.message(gateway);
        if let Some(owner) = owner_of(c.subject.egress_ip()) {
            out.push((owner, c.reason(), note.clone()));
        }
        if let Subject::Pod { pod, .. } = &c.subject {
            if let Some(p) = pod_of(*pod) {
                out.push((p, c.reason(), note));
            }
        }
    }
    out
}

/// The levels a subject's use has reached, after a new reading: `crossed`
/// levels were reached before; returns the levels reached now and the level
/// to report, if one was newly reached (only the highest, once). A level
/// stays reached until use falls [`HYSTERESIS`] points below it.
pub fn step(levels: &[u64], crossed: usize, in_use: u64, limit: u64) -> (usize, Option<u64>) {
    if limit == 0 {
        return (crossed, None);
    }
    let pct100 = u128::from(in_use) * 100;
    let at = |level: u64| u128::from(level) * u128::from(limit);
    let reached = levels.iter().take_while(|l| pct100 >= at(**l)).count();
    if reached > crossed {
        return (reached, Some(levels[reached - 1]));
    }
    let mut c = crossed.min(levels.len());
    while c > 0 && pct100 < at(levels[c - 1].saturating_sub(HYSTERESIS)) {
        c -= 1;
    }
    (c, None)
}

/// The subjects of a snapshot with their use and limit.
pub fn subjects(u: &PortUse) -> Vec<(Subject, u64, u64)> {
    let mut out = Vec::new();
    for p in &u.pools {
        if p.endpoint_dependent {
            for d in &p.destinations {
                let s = Subject::Destination { egress_ip: p.egress_ip, proto: p.proto.clone(), remote: d.remote };
                out.push((s, d.in_use, p.capacity));
            }
        } else {
            out.push((Subject::EgressIp { egress_ip: p.egress_ip, proto: p.proto.clone() }, p.in_use, p.capacity));
        }
        // A quota at or above the range is the range's limit, warned above.
        let Some(quota) = p.pod_quota.filter(|q| *q < p.capacity) else { continue };
        for pod in &p.pods {
            let s = Subject::Pod { egress_ip: p.egress_ip, proto: p.proto.clone(), pod: pod.pod, remote: pod.remote };
            out.push((s, pod.in_use, quota));
        }
    }
    out
}

/// Each subject's reached levels, between snapshots.
#[derive(Debug, Default)]
pub struct Alarms {
    state: HashMap<Subject, (usize, Instant)>,
}

impl Alarms {
    /// Compares a snapshot with the levels: the crossings to report.
    pub fn observe(&mut self, u: &PortUse, now: Instant) -> Vec<Crossing> {
        let mut out = Vec::new();
        for (subject, in_use, limit) in subjects(u) {
            let crossed = self.state.get(&subject).map_or(0, |s| s.0);
            let (crossed, report) = step(&WARN_LEVELS, crossed, in_use, limit);
            if let Some(level) = report {
                out.push(Crossing { subject: subject.clone(), level, in_use, limit });
            }
            if crossed == 0 {
                self.state.remove(&subject);
            } else {
                self.state.insert(subject, (crossed, now));
            }
        }
        self.state.retain(|_, (_, seen)| now.saturating_duration_since(*seen) < FORGET_AFTER);
        out
    }

    /// Subjects with a level reached.
    pub fn len(&self) -> usize {
        self.state.len()
    }

    /// Whether no subject has a level reached.
    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }
}

/// The latest snapshot, the alarms, and the crossings waiting for the
/// Kubernetes control plane.
#[derive(Debug)]
pub struct Monitor {
    top: usize,
    latest: Mutex<Arc<PortUse>>,
    alarms: Mutex<Alarms>,
    pending: Mutex<Option<VecDeque<Crossing>>>,
    dropped: AtomicU64,
    reported: AtomicU64,
    waker: Mutex<Option<Arc<tokio::sync::Notify>>>,
}

impl Monitor {
    /// A monitor keeping the top `top` per pool.
    pub fn new(top: usize) -> Self {
        Monitor {
            top,
            latest: Mutex::new(Arc::default()),
            alarms: Mutex::new(Alarms::default()),
            pending: Mutex::new(None),
            dropped: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            waker: Mutex::new(None),
        }
    }

    /// How many destinations and pods are kept per pool.
    pub fn top(&self) -> usize {
        self.top
    }

    /// From now on crossings are also kept for [`Monitor::take_crossings`],
    /// and `waker` is notified when one is.
    pub fn deliver_to(&self, waker: Arc<tokio::sync::Notify>) {
        self.pending.lock().get_or_insert_with(VecDeque::new);
        *self.waker.lock() = Some(waker);
    }

    /// A new snapshot: it becomes the latest; its crossings are logged,
    /// counted, queued (bounded) and returned.
    pub fn update(&self, mut u: PortUse, now: Instant) -> Vec<Crossing> {
        let crossings = self.alarms.lock().observe(&u, now);
        u.warnings = self.reported.fetch_add(crossings.len() as u64, Ordering::Relaxed) + crossings.len() as u64;
        *self.latest.lock() = Arc::new(u);
        if crossings.is_empty() {
            return crossings;
        }
        for c in &crossings {
            tracing::warn!(subject = ?c.subject, level = c.level, in_use = c.in_use, limit = c.limit, "ports near exhaustion");
        }
        let queued = {
            let mut pending = self.pending.lock();
            match pending.as_mut() {
                None => false,
                Some(q) => {
                    q.extend(crossings.iter().cloned());
                    while q.len() > MAX_PENDING {
                        q.pop_front();
                        self.dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    true
                }
            }
        };
        if queued {
            if let Some(w) = self.waker.lock().as_ref() {
                w.notify_one();
            }
        }
        crossings
    }

    /// The latest snapshot.
    pub fn latest(&self) -> Arc<PortUse> {
        self.latest.lock().clone()
    }

    /// The crossings queued since the last call.
    pub fn take_crossings(&self) -> Vec<Crossing> {
        self.pending.lock().as_mut().map(|q| q.drain(..).collect()).unwrap_or_default()
    }

    /// Crossings reported (logged) since start.
    pub fn reported(&self) -> u64 {
        self.reported.load(Ordering::Relaxed)
    }

    /// Crossings dropped because the control plane did not take them.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

/// A shared [`Monitor`] in options compared by identity.
#[derive(Debug, Clone)]
pub struct MonitorRef(pub Arc<Monitor>);

impl PartialEq for MonitorRef {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for MonitorRef {}

#[cfg(test)]
mod tests;
