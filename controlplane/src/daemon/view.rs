//! [`GatewayView`] over the running daemon: the engine's tables, counters
//! and NAT state, the XDP program's verdict counters, the workers' rings.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use egret_dataplane::nat::key::NatAddr;
use egret_dataplane::nat::table::NatTable;
use egret_dataplane::nat::tcp_state;
use egret_dataplane::stats::{DropReason, Event};
use egret_dataplane::tables::{PolicyFamily, Tables};

use super::Shared;
use crate::view::{
    mac_string, proto_name, BlockRow, Counters, GatewayView, InterfaceStatus, OwnedIp, PolicyRow, PortRow, RingStats,
    SessionFilter, SessionRow, Status, WhoHadAnswer, WhoHadQuery, WorkerStatus,
};

/// The live gateway.
pub(super) struct LiveView(pub Arc<Shared>);

/// One row per egress IP of `nat` with port blocks (nat/port_blocks.rs).
fn block_rows<A: NatAddr + PolicyFamily>(nat: &NatTable<A>, tables: &Tables, out: &mut Vec<BlockRow>) {
    for pool in nat.block_pools() {
        let egress_ip = pool.egress().ip();
        let cfg = pool.config();
        // A pool retired by a change of range has the same configuration
        // as the current one, but not its range (ADR 0042).
        let configured =
            tables.egress(egress_ip).is_some_and(|e| e.blocks == Some(cfg) && pool.same_geometry(cfg, e.ports));
        out.push(BlockRow {
            egress_ip,
            configured,
            block_size: cfg.size,
            max_per_pod: cfg.max_per_pod,
            capacity: pool.len() as u64,
            in_use: u64::from(pool.taken()),
            pods: pool.pods() as u64,
            exhausted: pool.exhausted(),
            pod_limit: pool.pod_limit_hits(),
        });
    }
}

fn sessions_of<A: NatAddr + PolicyFamily + Into<IpAddr>>(
    nat: &NatTable<A>,
    now: u32,
    filter: &SessionFilter,
    out: &mut Vec<SessionRow>,
    limit: usize,
) {
    for v in nat.sessions.iter() {
        if out.len() >= limit {
            return;
        }
        let t = v.tuple;
        let row = SessionRow {
            proto: proto_name(t.proto).into(),
            pod: t.pod.into(),
            pod_port: t.pod_port,
            egress: t.egress.into(),
            egress_port: t.egress_port,
            remote: t.remote.into(),
            remote_port: t.remote_port,
            idle_secs: u64::from(now.saturating_sub(nat.last_seen(&v))),
            state: if t.proto == 6 { tcp_state::phase(v.tcp).name().into() } else { String::new() },
            offloaded: v.offload & egret_dataplane::nat::session::offload::INSTALLED != 0,
        };
        if filter.matches(&row) {
            out.push(row);
        }
    }
}

impl GatewayView for LiveView {
    fn status(&self) -> Status {
        let s = &self.0;
        let tables = s.engine.tables();
        let cfg = s.config.lock().clone();
        let fib = s.engine.fib();
        let (routes, neighbours) = fib.sizes();
        let mut owned: Vec<OwnedIp> = s
            .sink
            .owned()
            .into_iter()
            .map(|(ip, o)| OwnedIp {
                ip,
                ports: if o.flags & egret_bpf::OWNED_NAT != 0 {
                    format!("{}-{}", o.nat_port_lo, o.nat_port_hi)
                } else {
                    String::new()
                },
                answer_neighbor: o.flags & egret_bpf::OWNED_NEIGH != 0,
                egress: o.flags & egret_bpf::OWNED_NAT != 0,
                served: o.valid_until_ns == egret_bpf::VALID_FOREVER || o.valid_until_ns > egret_bpf::monotonic_ns(),
            })
            .collect();
        owned.sort_by_key(|o| o.ip);
        Status {
            cluster: s.cluster.get().and_then(|h| h.report()),
            config_file: cfg.file.clone(),
            generation: tables.generation,
            uptime_secs: s.started.elapsed().as_secs(),
            ready: s.ready(),
            interfaces: s
                .interfaces
                .iter()
                .map(|i| InterfaceStatus {
                    name: i.name.clone(),
                    ifindex: i.ifindex,
                    role: format!("{:?}", i.role).to_lowercase(),
                    mac: mac_string(fib.interface(i.ifindex).map_or(i.mac, |f| f.mac)),
                    xdp_mode: cfg.xdp.mode.name().into(),
                    attached: s.attached.load(Ordering::Acquire),
                    queues: i.queues,
                })
                .collect(),
            workers: s
                .workers
                .iter()
                .map(|w| WorkerStatus {
                    id: w.queue,
                    thread: format!("egret-worker-{}", w.queue),
                    running: w.running.load(Ordering::Acquire),
                    cpu: w.cpu,
                })
                .collect(),
            owned,
            policy_errors: tables.errors.iter().map(|e| e.to_string()).collect(),
            restart_pending: s.restart_pending.lock().clone(),
            reloads: s.reloads.load(Ordering::Relaxed),
            reload_failures: s.reload_failures.load(Ordering::Relaxed),
            apply_failures: s.sink.apply_failures.load(Ordering::Relaxed),
            fail_closed_errors: s.sink.fail_closed_errors.load(Ordering::Relaxed),
            fail_closed_repairs: s.sink.fail_closed_repairs.load(Ordering::Relaxed),
            sessions: (s.engine.nat4().sessions.len() as u64, s.engine.nat6().sessions.len() as u64),
            session_capacity: (s.engine.nat4().sessions.capacity() as u64, s.engine.nat6().sessions.capacity() as u64),
            fib_routes: routes as u64,
            fib_neighbors: neighbours as u64,
            fib_generation: fib.generation(),
        }
    }

    fn counters(&self) -> Counters {
        let s = &self.0;
        let st = s.engine.stats();
        let xdp = match s.program.verdict_counters() {
            Ok(v) => v.into_iter().map(|(r, n)| (r.name().to_string(), n)).collect(),
            Err(e) => {
                tracing::warn!(error = %e, "reading the XDP verdict counters failed");
                Vec::new()
            }
        };
        let mut rings = Vec::new();
        let (mut misdirected, mut announcements) = (0, 0);
        for w in &s.workers {
            misdirected += w.handler_stats.misdirected.load(Ordering::Relaxed);
            announcements += w.handler_stats.announced.load(Ordering::Relaxed);
            for (name, c) in &w.sockets {
                let c = c.snapshot();
                rings.push(RingStats {
                    worker: w.queue,
                    interface: name.clone(),
                    queue: w.queue,
                    rx: c.rx_frames,
                    tx: c.tx_frames,
                    tx_ring_full: c.tx_ring_full,
                    fill_ring_empty: c.frame_pool_empty,
                    kernel_rx_dropped: c.kernel.rx_dropped,
                    kernel_rx_invalid_descs: c.kernel.rx_invalid_descs,
                    kernel_tx_invalid_descs: c.kernel.tx_invalid_descs,
                    kernel_rx_ring_full: c.kernel.rx_ring_full,
                    kernel_rx_fill_ring_empty_descs: c.kernel.rx_fill_ring_empty_descs,
                    kernel_tx_ring_empty_descs: c.kernel.tx_ring_empty_descs,
                });
            }
        }
        Counters {
            forwarded: st.forwarded,
            answered: st.answered,
            misdirected,
            drops: DropReason::ALL.iter().map(|r| (r.name().to_string(), st.dropped(*r))).collect(),
            events: Event::ALL.iter().map(|e| (e.name().to_string(), st.event(*e))).collect(),
            xdp,
            rings,
            announcements,
            fast_path: s.fast_path.as_ref().map(|fp| fp.snapshot()).unwrap_or_default(),
            translog: s.translog.as_ref().map(|t| t.counters()).unwrap_or_default(),
        }
    }

    fn policies(&self) -> Vec<PolicyRow> {
        let tables = self.0.engine.tables();
        let st = self.0.engine.stats();
        tables
            .policies
            .iter()
            .map(|p| {
                let mut t = st.policy.get(usize::from(p.counter_slot)).copied().unwrap_or_default();
                // Packets the fast path translated never reached the engine.
                if self.0.fast_path.is_some() {
                    match self.0.program.fp_policy_traffic(p.counter_slot) {
                        Ok(k) => {
                            for (d, k) in k.iter().enumerate() {
                                t[d].0 += k.packets;
                                t[d].1 += k.bytes;
                            }
                        }
                        Err(e) => tracing::warn!(error = %e, "reading the fast path's policy counters failed"),
                    }
                }
                PolicyRow {
                    name: p.name.clone(),
                    sources: p.spec.sources.iter().map(|n| n.to_string()).collect(),
                    destinations: p.spec.destinations.iter().map(|n| n.to_string()).collect(),
                    except: p.spec.except.iter().map(|n| n.to_string()).collect(),
                    egress_ips: p.spec.egress_ips.clone(),
                    packets_out: t[0].0,
                    bytes_out: t[0].1,
                    packets_in: t[1].0,
                    bytes_in: t[1].1,
                }
            })
            .collect()
    }

    fn ports(&self) -> Vec<PortRow> {
        let tables = self.0.engine.tables();
        let mut rows = Vec::new();
        let mut push = |ip: IpAddr, proto: u8, in_use: u32, exhausted: u64| {
            let capacity = tables.egress(ip).map_or(0, |e| u64::from(e.ports.len()));
            rows.push(PortRow {
                egress_ip: ip,
                proto: proto_name(proto).into(),
                in_use: u64::from(in_use),
                capacity,
                exhausted,
            });
        };
        for (ip, proto, pool) in self.0.engine.nat4().mappings.pools() {
            push(IpAddr::V4(ip), proto, pool.in_use(), pool.exhausted());
        }
        for (ip, proto, pool) in self.0.engine.nat6().mappings.pools() {
            push(IpAddr::V6(ip), proto, pool.in_use(), pool.exhausted());
        }
        rows.sort_by(|a, b| (a.egress_ip, &a.proto).cmp(&(b.egress_ip, &b.proto)));
        rows
    }

    fn port_blocks(&self) -> Vec<BlockRow> {
        let tables = self.0.engine.tables();
        let mut rows = Vec::new();
        block_rows(self.0.engine.nat4(), &tables, &mut rows);
        block_rows(self.0.engine.nat6(), &tables, &mut rows);
        rows.sort_by_key(|r| r.egress_ip);
        rows
    }

    fn port_use(&self) -> Arc<crate::port_use::PortUse> {
        self.0.port_use.latest()
    }

    fn sessions(&self, filter: &SessionFilter) -> Vec<SessionRow> {
        let now = self.0.clock.now().secs();
        let limit = filter.limit.unwrap_or(1000);
        let mut out = Vec::new();
        sessions_of::<Ipv4Addr>(self.0.engine.nat4(), now, filter, &mut out, limit);
        sessions_of::<Ipv6Addr>(self.0.engine.nat6(), now, filter, &mut out, limit);
        out
    }

    fn who_had(&self, q: &WhoHadQuery) -> Result<WhoHadAnswer, String> {
        let Some(dir) = &self.0.journal_dir else {
            return Err(
                "this gateway keeps no translation log journal (translationLogs.journal): ask the collector".into()
            );
        };
        let clocks = crate::translog::Clocks::now(&self.0.clock);
        // The sessions on that egress address, for those the journal has
        // no end for.
        let filter = SessionFilter { egress_ip: Some(q.egress), limit: Some(usize::MAX), ..SessionFilter::default() };
        let rows = self.sessions(&filter);
        let live = |e: &crate::translog::Event| crate::translog::who_had::live_in(&rows, &clocks, e);
        crate::translog::who_had::answer(dir, q, &live)
    }
}

#[cfg(test)]
mod tests {
    use egret_dataplane::nat::port_alloc::{PortRange, PortRng};
    use egret_dataplane::nat::port_blocks::PortBlocks;
    use egret_dataplane::tables::{EgressIpSpec, PolicySlots, TablesSpec};

    use super::*;

    /// After a change of range in block mode, the blocks of the old range
    /// still held are a row of their own, leaving, beside the current
    /// pool's (the same size and `maxPerPod`: only the range tells them
    /// apart; ADR 0042).
    #[test]
    fn blocks_of_a_changed_range_are_a_leaving_row() {
        let e = Ipv4Addr::new(198, 51, 100, 1);
        let cfg = PortBlocks { size: 16, max_per_pod: 2, log_sessions: false };
        let (old_range, range) = (PortRange { first: 40000, last: 40999 }, PortRange { first: 40000, last: 41999 });
        let spec = TablesSpec {
            egress_ips: vec![EgressIpSpec {
                ip: e.into(),
                ports: Some(range),
                answer_neighbor: true,
                port_blocks: Some(cfg),
            }],
            ..Default::default()
        };
        let tables = Tables::compile(&spec, 2, &PolicySlots::default()).unwrap();
        let nat = NatTable::<Ipv4Addr>::new(&tables.nat);
        let old = nat.block_pool(e, cfg, old_range, 1);
        old.allocate(Ipv4Addr::new(192, 0, 2, 10), 4, &mut PortRng::new(1), None, Some).unwrap();
        drop(old);
        nat.block_pool(e, cfg, range, 2);
        let mut rows = Vec::new();
        block_rows(&nat, &tables, &mut rows);
        rows.sort_by_key(|r| r.configured);
        let seen: Vec<_> = rows.iter().map(|r| (r.configured, r.capacity, r.in_use)).collect();
        assert_eq!(seen, vec![(false, 62, 1), (true, 125, 0)]);
    }
}
