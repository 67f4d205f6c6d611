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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use std::net::SocketAddr;

    use egret_dataplane::clock::Timestamp;
    use egret_dataplane::engine::{ChecksumHint, RxMeta, Verdict};
    use egret_dataplane::fixtures::{self, base_spec, from_pod, topology, udp, E1, INSIDE, POD_A, SERVER};
    use egret_dataplane::nat::port_alloc::{PortRange, PortRng};
    use egret_dataplane::tables::MappingBehavior;

    use super::*;
    use crate::port_use::{Crossing, DestinationUse, Subject};

    /// Real frames through the engine in endpoint-dependent mode, 17 of a
    /// 20-port range towards one server: the walk sees that destination,
    /// and the monitor warns at 80 % once.
    #[test]
    fn the_walk_sees_a_destination_filled_by_real_frames() {
        let mut spec = base_spec();
        spec.nat.new_flows_per_second_per_source = 0;
        spec.nat.mapping = MappingBehavior::EndpointDependent;
        spec.nat.max_ports_per_source = Some(20);
        for e in &mut spec.egress_ips {
            if e.ip == IpAddr::V4(E1) {
                e.ports = Some(PortRange { first: 40000, last: 40019 });
            }
        }
        let engine = Engine::new(&spec).unwrap();
        engine.publish_fib(topology());
        let mut w = engine.pipeline_seeded(PortRng::new(1));
        let monitor = Monitor::new(3);
        let mut crossings: Vec<(u16, Crossing)> = Vec::new();
        for i in 0..17u16 {
            let p = from_pod(IpAddr::V4(POD_A), IpAddr::V4(SERVER), udp(40000 + i, 53, b"q"));
            let f = p.frame();
            let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
            buf[..f.len()].copy_from_slice(&f);
            let meta = RxMeta { ifindex: INSIDE, checksum: ChecksumHint::Unknown };
            let v = w.process(&mut buf, f.len(), meta, Timestamp::from_millis(1000));
            assert!(matches!(v, Verdict::Forward { .. }), "flow {i}: {v:?}");
            crossings.extend(monitor.update(walk(&engine, 3), Instant::now()).into_iter().map(|c| (i + 1, c)));
        }
        let u = walk(&engine, 3);
        let pool = u.pools.iter().find(|p| p.egress_ip == IpAddr::V4(E1) && p.proto == "udp").unwrap();
        assert!(pool.endpoint_dependent);
        assert_eq!((pool.in_use, pool.capacity, pool.pod_quota), (17, 20, Some(20)));
        let server = SocketAddr::new(IpAddr::V4(SERVER), 53);
        assert_eq!(pool.destinations, vec![DestinationUse { remote: server, in_use: 17 }]);
        assert_eq!(pool.pods.len(), 1);
        assert_eq!((pool.pods[0].pod, pool.pods[0].remote, pool.pods[0].in_use), (IpAddr::V4(POD_A), Some(server), 17));
        let subject = Subject::Destination { egress_ip: IpAddr::V4(E1), proto: "udp".into(), remote: server };
        let got: Vec<(u16, &Subject, u64)> = crossings.iter().map(|(n, c)| (*n, &c.subject, c.level)).collect();
        assert_eq!(got, vec![(16, &subject, 80)], "16 of 20 is 80 %; the quota equals the range: no pod warning");
        assert_eq!(u.entries, 1, "one (pod, destination) entry");
    }
}
