//! [`GatewaySink`]: the daemon's [`TablesSink`]. `apply` makes a desired
//! state the gateway's whole state, or none of it, before it returns.
//!
//! Three things must agree: the engine's tables (what the workers
//! translate), the XDP program's maps (what is steered to them, which
//! addresses are answered) and the kernel's fail-closed table
//! (crate::failclosed: what the forward path drops). XDP passes to the
//! kernel whatever its maps do not steer, so the fail-closed table must
//! never be older than the maps: a source the new tables select, still
//! passed by XDP, must meet a table that drops it. The order:
//!
//! 1. **compile and check**, changing nothing: the new tables are compiled
//!    (an invalid spec is [`ApplyError::Rejected`]) and every map the apply
//!    writes is checked against its `max_entries`: owned addresses per
//!    family, and the policy source and rule LPMs per family with the
//!    replacement's two generations side by side
//!    ([`SteeringProgram::check_policy`]). Too large is
//!    [`ApplyError::TooLarge`];
//! 2. **fail-closed table** for the new tables (`nft -f`, one transaction;
//!    not while Kubernetes mode holds the kernel's table). From here the
//!    kernel drops what the new tables steer; the XDP maps still steer what
//!    the old ones did, to an engine that translates it. A failure is
//!    [`ApplyError::FailClosed`] and nothing else changes;
//! 3. **XDP maps**: owned addresses (removed ones deleted, the others
//!    written with their NAT port range and `OWNED_NAT` / `OWNED_NEIGH`),
//!    then the policy classification (`replace_policy`: two generations, no
//!    window), from the same compiled classifier the engine uses. A source
//!    newly steered reaches workers that may still hold the old tables for
//!    a moment: they drop it (a worker counts frames it would pass as
//!    misdirected); one no longer steered is passed to a kernel whose table
//!    already agrees. A kernel error here puts the maps back as the engine's
//!    tables have them ([`ApplyError::Maps`]);
//! 4. with the fast path on: every session installed in the kernel that the
//!    new tables will not hold (its policy gone or changed, its egress IP or
//!    port range gone) is deleted from the fast path ([`FastPath::fence`]);
//!    installations wait until step 5 is done;
//! 5. `engine.publish`: the workers translate with the new tables from
//!    their next frame; sessions of removed egress IPs stop matching.
//!
//! **A refused apply still gives up addresses.** When the new state is too
//! large or its fail-closed table cannot be installed, the previous state
//! stays, less the egress IPs and answered addresses the new one no longer
//! holds: giving an address up needs no room and no new kernel rule (the
//! classification stays the old one, which the kernel's table already
//! covers), and a control plane that lost a Lease must be able to fence.
//! A too-large state still gets its fail-closed table, so the sources it
//! newly selects are dropped by the kernel instead of leaving with their
//! own address while the maps cannot steer them.
//!
//! Applies are serialised. `announce` queues gratuitous ARP / unsolicited
//! NA (twice, one second apart: RFC 5227 2.3's ANNOUNCE_NUM) for worker 0.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_bpf::{
    Action as BpfAction, DstRule, OwnedAddr, SrcPrefix, SteeringProgram, OWNED_KERNEL_SERVICE, OWNED_NAT, OWNED_NEIGH,
    VALID_FOREVER,
};
use egret_dataplane::engine::Engine;
use egret_dataplane::lpm::LpmAddr;
use egret_dataplane::policy::{Classifier, DstAction};
use egret_dataplane::tables::{PolicySlots, Tables, TablesSpec};
use ipnet::IpNet;
use parking_lot::Mutex;

use crate::config::Role;
use crate::failclosed::{FailClosedError, Installed};
use crate::offload::FastPath;
use crate::sink::{ApplyError, TablesSink};
use egret_dataplane::clock::EngineClock;
use egret_dataplane::handler::{AnnounceQueue, Announcement};

/// What installs the fail-closed table for some tables
/// ([`crate::failclosed::install`]; tests put another in).
pub type RulesInstaller = Box<dyn Fn(&Tables) -> Result<(), FailClosedError> + Send + Sync>;

/// Why a state does not fit the XDP maps (step 1 of the module doc).
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// More owned addresses of a family than `owned_v4` / `owned_v6` hold.
    #[error(
        "{count} owned {family} addresses (egress IPs and answered next hops) exceed the map's capacity of {capacity}"
    )]
    OwnedAddresses {
        /// `IPv4` or `IPv6`.
        family: &'static str,
        /// Addresses the state owns.
        count: usize,
        /// The map's `max_entries`.
        capacity: usize,
    },
    /// The policy source or rule LPMs cannot take the classification (the
    /// error names the map, the entries and its capacity).
    #[error(transparent)]
    Policy(#[from] egret_bpf::BpfError),
    /// More Nodes' addresses of a family than `node_addrs_v4` / `_v6` hold.
    #[error("{count} {family} Node addresses (the tunnel's senders) exceed the map's capacity of {capacity}")]
    NodeAddresses {
        /// `IPv4` or `IPv6`.
        family: &'static str,
        /// Addresses the state lists.
        count: usize,
        /// The map's `max_entries`.
        capacity: usize,
    },
}

/// The daemon's sink.
pub struct GatewaySink {
    engine: Engine,
    program: Arc<SteeringProgram>,
    /// (ifindex, role) of every driven interface.
    interfaces: Vec<(u32, Role)>,
    owned: Mutex<HashMap<IpAddr, OwnedAddr>>,
    announce: AnnounceQueue,
    fast_path: Option<Arc<FastPath>>,
    /// Settings that changed but need a restart (from the last apply).
    pub restart_needed: Mutex<Vec<String>>,
    /// Applies that succeeded.
    pub applied: AtomicU64,
    /// Applies that failed (any [`ApplyError`]).
    pub apply_failures: AtomicU64,
    /// Times the fail-closed nftables rules could not be installed.
    pub fail_closed_errors: AtomicU64,
    /// Times the fail-closed table was put back after another program
    /// removed it ([`GatewaySink::reinstall_fail_closed`]).
    pub fail_closed_repairs: AtomicU64,
    /// Whether applies replace the kernel's fail-closed table (released
    /// unless Kubernetes mode holds it: crate::failclosed::Hold).
    pub fail_closed: Arc<crate::failclosed::Hold>,
    install_rules: RulesInstaller,
    /// The spec the engine and the maps hold (after the first apply), with
    /// the node's addresses merged in.
    current: Mutex<Option<TablesSpec>>,
    /// The node's own addresses as the kernel last reported them
    /// ([`GatewaySink::set_node_addresses`]).
    node_addresses: Mutex<Vec<IpAddr>>,
    /// Engine time, for the owned addresses' valid-until.
    clock: EngineClock,
    /// Each address's valid-until on CLOCK_MONOTONIC (`set_valid_until`),
    /// written into its owned-map entry; absent: no deadline.
    valid_until_ns: Mutex<HashMap<IpAddr, u64>>,
    /// The solicited-node groups of the IPv6 addresses answered, joined on
    /// the interfaces that answer them (multicast.rs).
    groups: Mutex<super::multicast::SolicitedNodeGroups>,
}

impl std::fmt::Debug for GatewaySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewaySink").field("interfaces", &self.interfaces).finish_non_exhaustive()
    }
}

fn net<A: LpmAddr + Into<IpAddr>>(addr: A, len: u8) -> Option<IpNet> {
    IpNet::new(addr.into(), len).ok()
}

/// The XDP program's two policy levels from the engine's classifier.
pub fn policy_entries<A: LpmAddr + Into<IpAddr>>(c: &Classifier<A>, src: &mut Vec<SrcPrefix>, dst: &mut Vec<DstRule>) {
    for (p, class) in c.source_entries() {
        if let Some(prefix) = net(p.addr, p.len) {
            src.push(SrcPrefix { prefix, class });
        }
    }
    for (class, p, action) in c.destination_entries() {
        let Some(prefix) = net(p.addr, p.len) else { continue };
        let (action, policy_id) = match action {
            DstAction::Steer(id) => (BpfAction::Steer, id.0),
            DstAction::Exclude => (BpfAction::Exclude, 0),
        };
        dst.push(DstRule { class, prefix, action, policy_id });
    }
}

/// CLOCK_MONOTONIC nanoseconds at `t` (`Instant` is CLOCK_MONOTONIC on
/// Linux; the two clocks are read back to back, so the error is the gap
/// between the reads, tens of nanoseconds, rounded towards earlier).
fn monotonic_ns_at(t: Instant) -> u64 {
    let (mono, now) = (egret_bpf::monotonic_ns(), Instant::now());
    match t.checked_duration_since(now) {
        Some(ahead) => mono.saturating_add(ahead.as_nanos() as u64),
        None => mono.saturating_sub(now.duration_since(t).as_nanos() as u64),
    }
}

/// The earliest valid-until among the owned addresses but `skip`: the fast
/// path's (every offloaded session translates to or from one of them; an
/// address in `skip` has none installed, `FastPath::set_expired`).
fn earliest_valid_until(owned: &HashMap<IpAddr, OwnedAddr>, skip: &BTreeSet<IpAddr>) -> u64 {
    owned.iter().filter(|(ip, _)| !skip.contains(ip)).map(|(_, o)| o.valid_until_ns).min().unwrap_or(VALID_FOREVER)
}

/// What the owned-address maps should hold for `tables`.
pub fn owned_entries(tables: &Tables) -> HashMap<IpAddr, OwnedAddr> {
    let mut m = HashMap::new();
    for (ip, e) in tables.egress_ips() {
        let flags = OWNED_NAT
            | if e.answer_neighbor { OWNED_NEIGH } else { 0 }
            // A Service VIP: XDP passes what Egret does not serve (rule 4).
            | if e.kernel_service { OWNED_KERNEL_SERVICE } else { 0 };
        m.insert(
            ip,
            OwnedAddr { nat_port_lo: e.ports.first, nat_port_hi: e.ports.last, flags, ..OwnedAddr::default() },
        );
    }
    for ip in tables.neighbor_addresses() {
        m.entry(ip).or_insert_with(OwnedAddr::neighbour_only);
    }
    m
}

impl GatewaySink {
    /// A sink over a loaded program (not necessarily attached yet), fencing
    /// the fast path's sessions when there is one.
    pub fn new(
        engine: Engine,
        program: Arc<SteeringProgram>,
        interfaces: Vec<(u32, Role)>,
        announce: AnnounceQueue,
        fast_path: Option<Arc<FastPath>>,
        clock: EngineClock,
    ) -> Self {
        Self {
            clock,
            valid_until_ns: Mutex::new(HashMap::new()),
            engine,
            program,
            interfaces,
            owned: Mutex::new(HashMap::new()),
            announce,
            fast_path,
            restart_needed: Mutex::new(Vec::new()),
            applied: AtomicU64::new(0),
            apply_failures: AtomicU64::new(0),
            fail_closed_errors: AtomicU64::new(0),
            fail_closed_repairs: AtomicU64::new(0),
            fail_closed: Arc::default(),
            install_rules: Box::new(crate::failclosed::install),
            current: Mutex::new(None),
            node_addresses: Mutex::default(),
            groups: Mutex::default(),
        }
    }

    /// The interfaces that answer neighbour requests for `ip`: egress IPs
    /// face the outside, other answered addresses (next hops for the pods'
    /// nodes) the inside; one-arm: the one interface.
    fn answering_interfaces<'a>(&'a self, tables: &'a Tables, ip: IpAddr) -> impl Iterator<Item = u32> + 'a {
        let egress = tables.owns_egress(ip);
        self.interfaces.iter().filter_map(move |(ifindex, role)| {
            let wanted = match role {
                Role::Both => true,
                Role::Outside => egress,
                Role::Inside => !egress,
            };
            wanted.then_some(*ifindex)
        })
    }

    /// Joins the solicited-node groups of the IPv6 addresses `tables`
    /// answers, and leaves the others.
    fn sync_groups(&self, tables: &Tables) {
        let want: Vec<(u32, Ipv6Addr)> = tables
            .neighbor_addresses()
            .filter_map(|ip| match ip {
                IpAddr::V6(v6) => Some(v6),
                IpAddr::V4(_) => None,
            })
            .flat_map(|v6| self.answering_interfaces(tables, IpAddr::V6(v6)).map(move |i| (i, v6)))
            .collect();
        self.groups.lock().sync(want);
    }

    /// Installs the fail-closed table with `install` instead of `nft`
    /// (tests: a failing or recording installer).
    pub fn with_rules_installer(mut self, install: RulesInstaller) -> Self {
        self.install_rules = install;
        self
    }

    /// The addresses currently in the owned maps.
    pub fn owned(&self) -> HashMap<IpAddr, OwnedAddr> {
        self.owned.lock().clone()
    }

    /// The egress IPs whose sessions the fast path keeps out of the kernel.
    fn fast_path_expired(&self) -> BTreeSet<IpAddr> {
        self.fast_path.as_ref().map(|fp| fp.expired()).unwrap_or_default()
    }

    fn write_fp_valid_until(&self, ns: u64) {
        if let Err(e) = self.program.fp_set_valid_until(ns) {
            tracing::error!(error = %e, "valid-until not written to the fast path's configuration");
        }
    }

    /// Checks that the maps can take `plan` now (step 1 of the module doc).
    fn check_capacity(&self, plan: &MapPlan) -> Result<(), CapacityError> {
        let capacity = self.program.options().owned_addresses as usize;
        let v4 = plan.owned.keys().filter(|ip| ip.is_ipv4()).count();
        for (family, count) in [("IPv4", v4), ("IPv6", plan.owned.len() - v4)] {
            if count > capacity {
                return Err(CapacityError::OwnedAddresses { family, count, capacity });
            }
        }
        let capacity = self.program.options().node_addresses as usize;
        let v4 = plan.nodes.iter().filter(|ip| ip.is_ipv4()).count();
        for (family, count) in [("IPv4", v4), ("IPv6", plan.nodes.len() - v4)] {
            if count > capacity {
                return Err(CapacityError::NodeAddresses { family, count, capacity });
            }
        }
        Ok(self.program.check_policy(&plan.src, &plan.dst)?)
    }

    /// Makes the maps hold `plan` (step 3). The record of owned addresses
    /// follows every write, so a later call starts from what is there.
    fn write_maps(&self, plan: &MapPlan) -> Result<(), egret_bpf::BpfError> {
        let mut owned = self.owned.lock();
        let deadlines = self.valid_until_ns.lock();
        let gone: Vec<IpAddr> = owned.keys().filter(|ip| !plan.owned.contains_key(ip)).copied().collect();
        for ip in gone {
            self.program.remove_owned(ip)?;
            owned.remove(&ip);
        }
        for (ip, o) in &plan.owned {
            let o = o.valid_until(deadlines.get(ip).copied().unwrap_or(VALID_FOREVER));
            if owned.get(ip) != Some(&o) {
                self.program.set_owned(*ip, o)?;
                owned.insert(*ip, o);
            }
        }
        self.program.fp_set_valid_until(earliest_valid_until(&owned, &self.fast_path_expired()))?;
        drop(deadlines);
        drop(owned);
        self.program.replace_policy(&plan.src, &plan.dst)?;
        // The senders before the switch: a tunnel turned on never meets
        // an empty list, one turned off stops before its list goes.
        if plan.tunnel.is_some() {
            self.program.sync_node_addrs(&plan.nodes)?;
            self.program.set_tunnel(plan.tunnel)
        } else {
            self.program.set_tunnel(None)?;
            self.program.sync_node_addrs(&plan.nodes).map(drop)
        }
    }

    /// Steps 3-5 for tables already checked and covered by the kernel's
    /// table. On a map error the maps are put back as the engine has them.
    fn commit(&self, spec: &TablesSpec, next: &Tables) -> Result<(), ApplyError> {
        if let Err(e) = self.write_maps(&MapPlan::of(next)) {
            let restored = self.write_maps(&MapPlan::of(&self.engine.tables()));
            return Err(ApplyError::Maps { error: e.to_string(), restored });
        }
        let fence = self.fast_path.as_ref().map(|fp| {
            let (fenced, guard) = fp.fence(next);
            if fenced > 0 {
                tracing::info!(
                    sessions = fenced,
                    "fast path: sessions the new configuration ends deleted from the kernel"
                );
            }
            guard
        });
        let published = match self.engine.publish(spec) {
            Ok(p) => p,
            Err(e) => {
                // Not expected: `next` was compiled from the same spec.
                drop(fence);
                let restored = self.write_maps(&MapPlan::of(&self.engine.tables()));
                return Err(ApplyError::Maps { error: format!("engine refused the tables: {e}"), restored });
            }
        };
        drop(fence);
        *self.restart_needed.lock() = published.restart_needed.iter().map(|s| s.to_string()).collect();
        *self.current.lock() = Some(spec.clone());
        Ok(())
    }

    /// Puts the fail-closed table back for the tables the data plane runs
    /// now, after another program removed it (a firewall reload's `nft
    /// flush ruleset`, an `nft delete table`): while it is missing, a crash
    /// of this process would let the kernel forward selected pods' traffic
    /// with their own addresses. Serialised with applies, so the table is
    /// never older than what XDP passes. Held (Kubernetes mode before the
    /// cluster's first apply): nothing, the kernel's table is not ours yet.
    /// `Ok(true)` when it installed the table.
    pub fn reinstall_fail_closed(&self) -> Result<bool, FailClosedError> {
        let _serial = SERIAL.lock();
        if self.fail_closed.is_held() {
            return Ok(false);
        }
        let tables = self.engine.tables();
        self.install_fail_closed(&tables)?;
        self.fail_closed_repairs.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Installs the fail-closed table for `tables` unless held.
    fn install_fail_closed(&self, tables: &Tables) -> Result<(), FailClosedError> {
        match self.fail_closed.install_with(tables, &self.install_rules) {
            Ok(Installed::Replaced) => Ok(()),
            Ok(Installed::Kept) => {
                tracing::info!("fail-closed rules: the kernel's table is kept until the cluster's tables are applied");
                Ok(())
            }
            Err(e) => {
                self.fail_closed_errors.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    /// After a refusal: the current state less the addresses `spec` no
    /// longer holds (see the module doc). Its classification is the
    /// current one, which the kernel's table covers, and it needs no more
    /// room than the current state.
    fn give_up_removed(&self, spec: &TablesSpec) -> String {
        let Some(current) = self.current.lock().clone() else {
            return "nothing to give up".into();
        };
        let mut kept = current.clone();
        kept.egress_ips.retain(|e| spec.egress_ips.iter().any(|n| n.ip == e.ip));
        kept.neighbor_addresses.retain(|a| spec.neighbor_addresses.contains(a));
        if kept == current {
            return "nothing to give up".into();
        }
        let gone: Vec<String> = current
            .egress_ips
            .iter()
            .map(|e| e.ip)
            .chain(current.neighbor_addresses.iter().copied())
            .filter(|ip| !kept.egress_ips.iter().any(|e| e.ip == *ip) && !kept.neighbor_addresses.contains(ip))
            .map(|ip| ip.to_string())
            .collect();
        let result = Tables::compile(&kept, 0, &PolicySlots::default())
            .map_err(|e| ApplyError::Rejected(e.to_string()))
            .and_then(|t| self.commit(&kept, &t));
        match result {
            Ok(()) => format!("given up: {}", gone.join(", ")),
            Err(e) => format!("giving up {} failed: {e}", gone.join(", ")),
        }
    }

    fn apply_inner(&self, spec: &TablesSpec) -> Result<Tables, ApplyError> {
        // 1. Compile and check: nothing has changed yet.
        let next =
            Tables::compile(spec, 0, &PolicySlots::default()).map_err(|e| ApplyError::Rejected(e.to_string()))?;
        if let Err(reason) = self.check_capacity(&MapPlan::of(&next)) {
            // The sources the new tables select are dropped by the kernel
            // while the maps cannot steer them.
            let fail_closed = self.install_fail_closed(&next);
            let kept = self.give_up_removed(spec);
            return Err(ApplyError::TooLarge { reason, fail_closed, kept });
        }
        // 2. The kernel's table first: never older than what XDP passes.
        if let Err(error) = self.install_fail_closed(&next) {
            let kept = self.give_up_removed(spec);
            return Err(ApplyError::FailClosed { error, kept });
        }
        // 3-5.
        self.commit(spec, &next)?;
        Ok(next)
    }
}

/// What [`GatewaySink`] writes into the XDP maps for some tables.
#[derive(Debug, Default)]
pub struct MapPlan {
    /// `owned_v4` / `owned_v6`.
    pub owned: HashMap<IpAddr, OwnedAddr>,
    /// `policy_src_v4` / `policy_src_v6`.
    pub src: Vec<SrcPrefix>,
    /// `policy_dst_v4` / `policy_dst_v6`.
    pub dst: Vec<DstRule>,
    /// `tunnel_config` (None: off).
    pub tunnel: Option<egret_bpf::Tunnel>,
    /// `node_addrs_v4` / `node_addrs_v6`: the tunnel's senders.
    pub nodes: BTreeSet<IpAddr>,
}

impl MapPlan {
    /// The entries for `tables`.
    pub fn of(tables: &Tables) -> Self {
        let t = tables.tunnel();
        let mut plan = Self {
            owned: owned_entries(tables),
            tunnel: t.map(|t| egret_bpf::Tunnel { port: t.port, vni: t.vni }),
            nodes: t.map(|t| t.nodes.iter().copied().collect()).unwrap_or_default(),
            ..Self::default()
        };
        policy_entries::<Ipv4Addr>(&tables.classify_v4, &mut plan.src, &mut plan.dst);
        policy_entries::<Ipv6Addr>(&tables.classify_v6, &mut plan.src, &mut plan.dst);
        plan
    }
}

/// The engine's sessions for session sync (`crate::ha`): the journal is
/// turned on when this is made, i.e. only when the channel runs.
struct EngineSessions {
    engine: Engine,
    clock: EngineClock,
}

/// Journal capacity per family (about 2 MB for IPv4, 4.5 MB for IPv6):
/// at the channel task's 20 ms tick, 3 M changes/s before an overflow
/// forces full copies.
const SYNC_JOURNAL: usize = 1 << 16;

impl crate::ha::SessionStore for EngineSessions {
    fn drain(&self, max: usize) -> Vec<egret_dataplane::nat::sync::SyncEvent> {
        self.engine.drain_sync_events(max, self.clock.now().secs())
    }

    fn overflows(&self) -> u64 {
        self.engine.sync_overflows()
    }

    fn export(&self, ip: IpAddr) -> Vec<egret_dataplane::nat::sync::SessionRecord> {
        self.engine.export_sessions(ip, self.clock.now().secs())
    }

    fn import(
        &self,
        records: &[egret_dataplane::nat::sync::SessionRecord],
    ) -> egret_dataplane::nat::sync::ImportReport {
        let tables = self.engine.tables();
        let now = self.clock.now();
        let report = self.engine.import_sessions(records, &tables, now.secs());
        // The holder exported these sessions' creates: their ends are
        // logged here (ADR 0034 §8, `not-adopted`).
        self.engine.log_not_adopted(&report, &tables, now.as_millis());
        report
    }
}

/// The node's addresses that routed traffic can reach, sorted: loopback,
/// link-local and multicast addresses are left out (no pod's routed packet
/// is addressed to them, and IPv6 link-local ones come and go with links).
fn sorted(mut v: Vec<IpAddr>) -> Vec<IpAddr> {
    v.retain(|ip| match ip {
        IpAddr::V4(a) => !(a.is_loopback() || a.is_link_local() || a.is_multicast() || a.is_unspecified()),
        IpAddr::V6(a) => !(a.is_loopback() || a.is_unicast_link_local() || a.is_multicast() || a.is_unspecified()),
    });
    v.sort();
    v.dedup();
    v
}

/// Applies are serialised: the control plane's and the re-applies after the
/// node's addresses changed.
static SERIAL: Mutex<()> = Mutex::new(());

/// `spec` with [`TablesSpec::local_addresses`] set to the node's addresses
/// less those Egret serves itself (the egress IPs, the answered next hops,
/// Service VIPs): traffic to those is Egret's (hairpinning, a VIP's ports).
fn with_node_addresses(spec: &TablesSpec, node: &[IpAddr]) -> TablesSpec {
    let mut spec = spec.clone();
    let ours = |ip: &IpAddr| {
        spec.egress_ips.iter().any(|e| e.ip == *ip)
            || spec.neighbor_addresses.contains(ip)
            || spec.service_addresses.contains(ip)
    };
    let local: Vec<IpAddr> = node.iter().filter(|ip| !ours(ip)).copied().collect();
    spec.local_addresses = local;
    spec
}

impl GatewaySink {
    fn with_node_addresses(&self, spec: &TablesSpec) -> TablesSpec {
        with_node_addresses(spec, &self.node_addresses.lock())
    }

    /// Whether `addresses` differ from the node's addresses last set.
    pub fn node_addresses_differ(&self, addresses: &[IpAddr]) -> bool {
        *self.node_addresses.lock() != sorted(addresses.to_vec())
    }

    /// The node's addresses changed (the rtnetlink watcher, on every
    /// published `Fib`): when they differ from the last ones, the current
    /// spec is applied again with them, so a selected pod's traffic to a
    /// new address of the node is never translated. Blocking (an apply
    /// runs nft): call it off the async runtime.
    pub fn set_node_addresses(&self, addresses: Vec<IpAddr>) {
        let addresses = sorted(addresses);
        {
            let mut have = self.node_addresses.lock();
            if *have == addresses {
                return;
            }
            *have = addresses;
        }
        let _serial = SERIAL.lock();
        let Some(current) = self.current.lock().clone() else {
            return;
        };
        let next = self.with_node_addresses(&current);
        if next == current {
            return;
        }
        match self.apply_inner(&next) {
            Ok(_) => {
                tracing::info!(addresses = ?next.local_addresses, "the node's addresses changed: policies exclude them")
            }
            Err(e) => {
                self.apply_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "the node's addresses changed, and the tables excluding them were not applied");
            }
        }
    }
}

impl TablesSink for GatewaySink {
    fn sessions(&self) -> Option<Arc<dyn crate::ha::SessionStore>> {
        self.engine.enable_sync_journal(SYNC_JOURNAL);
        Some(Arc::new(EngineSessions { engine: self.engine.clone(), clock: self.clock }))
    }

    fn apply(&self, spec: &TablesSpec) -> Result<(), ApplyError> {
        let _serial = SERIAL.lock();
        match self.apply_inner(&self.with_node_addresses(spec)) {
            Ok(tables) => {
                for e in &tables.errors {
                    tracing::warn!(error = %e, "policy left out");
                }
                self.applied.fetch_add(1, Ordering::Relaxed);
                let tables = self.engine.tables();
                self.sync_groups(&tables);
                tracing::info!(
                    generation = tables.generation,
                    policies = tables.policies.len(),
                    egress_ips = tables.egress_ips().count(),
                    "configuration applied"
                );
                Ok(())
            }
            Err(e) => {
                self.apply_failures.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn set_valid_until(&self, deadlines: &[(IpAddr, Option<Instant>)]) {
        // The workers first: engine time rounds down to the millisecond,
        // never later than asked.
        self.engine.ownership().set(deadlines.iter().map(|(ip, t)| (*ip, t.map(|t| self.clock.at(t)))));
        // Then the XDP program: each owned entry, and the fast path's
        // earliest. A kernel refusal is logged; the workers' check stands.
        let mut owned = self.owned.lock();
        let mut ns = self.valid_until_ns.lock();
        for (ip, t) in deadlines {
            let v = t.map_or(VALID_FOREVER, monotonic_ns_at);
            ns.insert(*ip, v);
            if let Some(o) = owned.get_mut(ip) {
                if o.valid_until_ns != v {
                    match self.program.set_owned(*ip, o.valid_until(v)) {
                        Ok(()) => o.valid_until_ns = v,
                        Err(e) => tracing::error!(%ip, error = %e, "valid-until not written to the XDP maps"),
                    }
                }
            }
        }
        // The fast path's deadline: first over every address but those
        // whose sessions are already out of the kernel and stay out, then
        // the sessions of addresses past their deadline leave the kernel
        // (a dormant egress IP's stay with the workers), and only then may
        // the deadline leave those addresses out (issue 28 §2: a dormant
        // IP must not hold back the others' fast path).
        // A renewal (the usual call) changes no set: one write.
        let now_ns = egret_bpf::monotonic_ns();
        let expired: BTreeSet<IpAddr> =
            ns.iter().filter(|(_, v)| **v != VALID_FOREVER && **v <= now_ns).map(|(ip, _)| *ip).collect();
        let before = self.fast_path_expired();
        if let Some(fp) = self.fast_path.as_ref().filter(|_| before != expired) {
            let kept_out: BTreeSet<IpAddr> = before.intersection(&expired).copied().collect();
            self.write_fp_valid_until(earliest_valid_until(&owned, &kept_out));
            let n = fp.set_expired(&self.engine, expired.clone());
            if n > 0 {
                tracing::info!(
                    sessions = n,
                    "fast path: sessions of egress IPs past their deadline taken out of the kernel"
                );
            }
        }
        self.write_fp_valid_until(earliest_valid_until(&owned, &expired));
    }

    fn announce(&self, ips: &[IpAddr]) {
        let tables = self.engine.tables();
        let now = Instant::now();
        let mut q = self.announce.lock();
        for ip in ips {
            if !tables.answers_neighbor(*ip) {
                continue;
            }
            for ifindex in self.answering_interfaces(&tables, *ip) {
                for delay in [Duration::ZERO, Duration::from_secs(1)] {
                    q.push(Announcement { ifindex, ip: *ip, due: now + delay });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use egret_dataplane::tables::EgressIpSpec;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// The node's routable addresses become exceptions; the addresses Egret
    /// serves itself (an egress IP assigned to the node, as a cloud does, a
    /// companion next hop, a VIP) and loopback, link-local and multicast
    /// ones do not; a spec's own exceptions are left as they are.
    #[test]
    fn the_nodes_addresses_less_egrets_own_become_exceptions() {
        let spec = TablesSpec {
            egress_ips: vec![EgressIpSpec {
                ip: ip("203.0.113.40"),
                ports: None,
                answer_neighbor: true,
                port_blocks: None,
            }],
            neighbor_addresses: vec![ip("203.0.113.41")],
            service_addresses: vec![ip("203.0.113.42")],
            ..Default::default()
        };
        let node = sorted(vec![
            ip("203.0.113.22"),
            ip("203.0.113.40"),
            ip("203.0.113.41"),
            ip("203.0.113.42"),
            ip("2001:db8:113::22"),
            ip("127.0.0.1"),
            ip("::1"),
            ip("169.254.0.9"),
            ip("fe80::1"),
            ip("203.0.113.22"),
        ]);
        let merged = with_node_addresses(&spec, &node);
        assert_eq!(merged.local_addresses, vec![ip("203.0.113.22"), ip("2001:db8:113::22")]);
        assert_eq!(TablesSpec { local_addresses: Vec::new(), ..merged }, spec, "nothing else changes");
    }

    #[test]
    fn too_many_owned_addresses_are_named_with_the_family_count_and_capacity() {
        let e = CapacityError::OwnedAddresses { family: "IPv6", count: 5, capacity: 4 };
        assert_eq!(
            e.to_string(),
            "5 owned IPv6 addresses (egress IPs and answered next hops) exceed the map's capacity of 4"
        );
    }
}
