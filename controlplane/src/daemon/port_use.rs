//! Counts port use every `metrics.portUseRefresh` (crate::port_use, ADR
//! 0035): a walk over every pool's per-pod counters on a blocking thread,
//! never on a worker, its snapshot handed to the monitor.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_dataplane::engine::Engine;
use egret_dataplane::nat::key::NatAddr;
use egret_dataplane::nat::table::NatTable;

use crate::port_use::{pool_use, Monitor, PortUse};

/// One walk over both families' pools.
pub fn walk(engine: &Engine, top: usize) -> PortUse {
    let t0 = Instant::now();
    let mut u = PortUse::default();
    walk_family(engine.nat4(), top, &mut u);
    walk_family(engine.nat6(), top, &mut u);
    u.pools.sort_by(|a, b| (a.egress_ip, &a.proto).cmp(&(b.egress_ip, &b.proto)));
    u.walk_micros = t0.elapsed().as_micros() as u64;
    u
}

fn walk_family<A: NatAddr + Into<IpAddr>>(nat: &NatTable<A>, top: usize, u: &mut PortUse) {
    let endpoint_dependent = !nat.mappings.endpoint_independent();
    for (ip, proto, pool) in nat.mappings.pools() {
        let (p, entries) = pool_use(ip, proto, &pool, endpoint_dependent, top);
        u.entries += entries;
        u.pools.push(p);
    }
}

/// Starts the task: a walk every `every`, until aborted.
pub fn spawn(engine: Engine, monitor: Arc<Monitor>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let (engine, top) = (engine.clone(), monitor.top());
            match tokio::task::spawn_blocking(move || walk(&engine, top)).await {
                Ok(u) => {
                    monitor.update(u, Instant::now());
                }
                Err(e) => tracing::warn!(error = %e, "the port-use walk failed"),
            }
        }
    })
}
