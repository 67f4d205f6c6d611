//! [`GatewaySink`]: the daemon's [`TablesSink`]. `apply` publishes the
//! engine's tables, then makes the XDP program's maps match them before it
//! returns:
//!
//! 0. with the fast path on: the new tables are compiled first and every
//!    session installed in the kernel that they will not hold (its policy
//!    gone or changed, its egress IP or port range gone) is deleted from
//!    the fast path's maps ([`FastPath::fence`]); installations wait until
//!    step 1 is done. From here the engine sees those sessions' packets;
//! 1. `engine.publish(spec)`: the workers translate with the new tables from
//!    their next frame; sessions of removed egress IPs stop matching.
//! 2. owned addresses: removed ones deleted, the others written with their
//!    NAT port range and flags (`OWNED_NAT` for egress IPs, `OWNED_NEIGH`
//!    when ARP/NDP is answered);
//! 3. the policy classification (`replace_policy`, two generations, no
//!    window), from the engine's compiled classifier, so the program and the
//!    engine classify identically.
//!
//! Applies are serialised. `announce` queues gratuitous ARP / unsolicited
//! NA (twice, one second apart: RFC 5227 2.3's ANNOUNCE_NUM) for worker 0.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_bpf::{Action as BpfAction, DstRule, OwnedAddr, SrcPrefix, SteeringProgram, OWNED_NAT, OWNED_NEIGH};
use egret_dataplane::engine::Engine;
use egret_dataplane::lpm::LpmAddr;
use egret_dataplane::policy::{Classifier, DstAction};
use egret_dataplane::tables::{PolicySlots, Tables, TablesSpec};
use ipnet::IpNet;
use parking_lot::Mutex;

use super::handler::{AnnounceQueue, Announcement};
use crate::config::Role;
use crate::offload::FastPath;
use crate::sink::{ApplyError, TablesSink};

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
    /// Times the fail-closed nftables rules could not be installed.
    pub fail_closed_errors: AtomicU64,
    /// Whether applies replace the kernel's fail-closed table (released
    /// unless Kubernetes mode holds it: crate::failclosed::Hold).
    pub fail_closed: Arc<crate::failclosed::Hold>,
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

/// What the owned-address maps should hold for `tables`.
pub fn owned_entries(tables: &Tables) -> HashMap<IpAddr, OwnedAddr> {
    let mut m = HashMap::new();
    for (ip, e) in tables.egress_ips() {
        let flags = OWNED_NAT | if e.answer_neighbor { OWNED_NEIGH } else { 0 };
        m.insert(ip, OwnedAddr { nat_port_lo: e.ports.first, nat_port_hi: e.ports.last, flags });
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
    ) -> Self {
        Self {
            engine,
            program,
            interfaces,
            owned: Mutex::new(HashMap::new()),
            announce,
            fast_path,
            restart_needed: Mutex::new(Vec::new()),
            applied: AtomicU64::new(0),
            fail_closed_errors: AtomicU64::new(0),
            fail_closed: Arc::default(),
        }
    }

    /// The addresses currently in the owned maps.
    pub fn owned(&self) -> HashMap<IpAddr, OwnedAddr> {
        self.owned.lock().clone()
    }

    fn apply_maps(&self, tables: &Tables) -> Result<(), egret_bpf::BpfError> {
        let want = owned_entries(tables);
        let mut owned = self.owned.lock();
        for ip in owned.keys().filter(|ip| !want.contains_key(ip)) {
            self.program.remove_owned(*ip)?;
        }
        for (ip, o) in &want {
            if owned.get(ip) != Some(o) {
                self.program.set_owned(*ip, *o)?;
            }
        }
        *owned = want;
        drop(owned);
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        policy_entries::<Ipv4Addr>(&tables.classify_v4, &mut src, &mut dst);
        policy_entries::<Ipv6Addr>(&tables.classify_v6, &mut src, &mut dst);
        self.program.replace_policy(&src, &dst)
    }
}

impl TablesSink for GatewaySink {
    fn apply(&self, spec: &TablesSpec) -> Result<(), ApplyError> {
        static SERIAL: Mutex<()> = Mutex::new(());
        let _serial = SERIAL.lock();
        let fence = match &self.fast_path {
            Some(fp) => {
                // The same compile the engine does (counter slots aside, which
                // validity does not depend on); an error here is its error.
                let next = Tables::compile(spec, 0, &PolicySlots::default())
                    .map_err(|e| ApplyError::Rejected(e.to_string()))?;
                let (fenced, guard) = fp.fence(&next);
                if fenced > 0 {
                    tracing::info!(
                        sessions = fenced,
                        "fast path: sessions the new configuration ends deleted from the kernel"
                    );
                }
                Some(guard)
            }
            None => None,
        };
        let published = self.engine.publish(spec).map_err(|e| ApplyError::Rejected(e.to_string()))?;
        drop(fence);
        *self.restart_needed.lock() = published.restart_needed.iter().map(|s| s.to_string()).collect();
        for e in &published.tables.errors {
            tracing::warn!(error = %e, "policy left out");
        }
        self.apply_maps(&published.tables).map_err(|e| ApplyError::Maps(e.to_string()))?;
        // The kernel's fallback: what the XDP program steers, the forward
        // path drops (crate::failclosed). A failure does not stop the gateway
        // but is loud: it means a stopped gateway would leak pod addresses.
        match self.fail_closed.install(&published.tables) {
            Ok(crate::failclosed::Installed::Replaced) => {}
            Ok(crate::failclosed::Installed::Kept) => {
                tracing::info!("fail-closed rules: the kernel's table is kept until the cluster's tables are applied")
            }
            Err(e) => {
                self.fail_closed_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, "fail-closed rules not installed");
            }
        }
        self.applied.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            generation = published.tables.generation,
            policies = published.tables.policies.len(),
            egress_ips = published.tables.egress_ips().count(),
            "configuration applied"
        );
        Ok(())
    }

    fn announce(&self, ips: &[IpAddr]) {
        let tables = self.engine.tables();
        let now = Instant::now();
        let mut q = self.announce.lock();
        for ip in ips {
            if !tables.answers_neighbor(*ip) {
                continue;
            }
            // Egress IPs face the outside; other answered addresses (next
            // hops for the pods' nodes) the inside. One-arm: the one interface.
            let egress = tables.owns_egress(*ip);
            for (ifindex, role) in &self.interfaces {
                let wanted = match role {
                    Role::Both => true,
                    Role::Outside => egress,
                    Role::Inside => !egress,
                };
                if wanted {
                    for delay in [Duration::ZERO, Duration::from_secs(1)] {
                        q.push(Announcement { ifindex: *ifindex, ip: *ip, due: now + delay });
                    }
                }
            }
        }
    }
}
