use std::net::Ipv4Addr;

use egret_dataplane::nat::port_alloc::{PortPool, PortRange, PortRng};
use egret_dataplane::nat::table::{CreateCtx, DeltaFnBox, NatTable, OutboundRequest};
use egret_dataplane::nat::tcp_state;
use egret_dataplane::policy::PolicyId;
use egret_dataplane::stats::{DropReason, WorkerStats};
use egret_dataplane::tables::{EgressIpSpec, MappingBehavior, PolicySlots, PolicySpec, Tables, TablesSpec};

use super::*;

const E: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
const TCP: u8 = 6;

#[test]
fn top_n_keeps_the_largest_most_first_ties_to_the_smaller_key() {
    let mut t = TopN::new(3);
    for (c, k) in [(5, 'a'), (9, 'b'), (1, 'c'), (9, 'a'), (7, 'd'), (5, 'e')] {
        t.offer(c, k);
    }
    assert_eq!(t.into_sorted(), vec![(9, 'a'), (9, 'b'), (7, 'd')]);
    let mut none = TopN::new(0);
    none.offer(1, 'x');
    assert!(none.into_sorted().is_empty());
}

#[test]
fn levels_are_reported_once_and_rearmed_below_the_hysteresis() {
    let l = &WARN_LEVELS;
    // (use of 100, expected reached levels, expected report)
    let steps = [
        (79, 0, None),
        (80, 1, Some(80)),
        (90, 1, None),
        (75, 1, None), // above 80 - 10
        (85, 1, None), // 80 again: not reported, never re-armed
        (69, 0, None), // re-armed
        (80, 1, Some(80)),
        (99, 2, Some(95)),
        (86, 2, None), // above 95 - 10
        (96, 2, None), // not again
        (84, 1, None), // 95 re-armed, 80 kept
        (95, 2, Some(95)),
        (10, 0, None),
        (100, 2, Some(95)), // a jump reports the highest level only
    ];
    let mut crossed = 0;
    for (i, (n, want, report)) in steps.into_iter().enumerate() {
        let (c, r) = step(l, crossed, n, 100);
        assert_eq!((c, r), (want, report), "step {i}: {n}%");
        crossed = c;
    }
    assert_eq!(step(l, 0, 5, 0), (0, None), "no limit, no warning");
    // Integer arithmetic at the edge: 80 % of 28232 is 22585.6.
    assert_eq!(step(l, 0, 22_585, 28_232).1, None);
    assert_eq!(step(l, 0, 22_586, 28_232).1, Some(80));
}

#[test]
fn events_go_to_the_owner_and_for_a_pod_to_the_pod() {
    let e: IpAddr = E.into();
    let unknown: IpAddr = "198.51.100.99".parse().unwrap();
    let pod: IpAddr = "192.0.2.10".parse().unwrap();
    let stranger: IpAddr = "192.0.2.11".parse().unwrap();
    let remote: SocketAddr = "203.0.113.5:443".parse().unwrap();
    let c = |subject: Subject| Crossing { subject, level: 95, in_use: 96, limit: 100 };
    let crossings = [
        c(Subject::Destination { egress_ip: e, proto: "tcp".into(), remote }),
        c(Subject::Pod { egress_ip: e, proto: "tcp".into(), pod, remote: Some(remote) }),
        c(Subject::Pod { egress_ip: e, proto: "tcp".into(), pod: stranger, remote: None }),
        c(Subject::EgressIp { egress_ip: unknown, proto: "udp".into() }),
    ];
    let owner_of = |ip: IpAddr| (ip == e).then(|| "EgressPolicy/team-a".to_string());
    let pod_of = |ip: IpAddr| (ip == pod).then(|| "Pod/default/client".to_string());
    let got: Vec<(String, &str)> =
        events(&crossings, "gw-a", owner_of, pod_of).into_iter().map(|(r, reason, _)| (r, reason)).collect();
    assert_eq!(
        got,
        vec![
            ("EgressPolicy/team-a".into(), reason::PORTS_NEAR_EXHAUSTION),
            ("EgressPolicy/team-a".into(), reason::POD_PORT_QUOTA_NEAR),
            ("Pod/default/client".into(), reason::POD_PORT_QUOTA_NEAR),
            ("EgressPolicy/team-a".into(), reason::POD_PORT_QUOTA_NEAR),
        ],
        "an unknown pod gets none, an IP without owner none"
    );
    let notes = events(&crossings[1..2], "gw-a", owner_of, pod_of);
    assert_eq!(notes[0].2, notes[1].2);
    assert!(notes[0].2.contains("pod 192.0.2.10 holds 96 of its quota of 100 tcp ports on egress IP 198.51.100.1 towards 203.0.113.5:443 (>= 95%) on gateway gw-a"), "{}", notes[0].2);
}

fn ed_pool(egress: IpAddr, dests: &[(SocketAddr, u64)], pods: Vec<PodUse>) -> PoolUse {
    PoolUse {
        egress_ip: egress,
        proto: "tcp".into(),
        endpoint_dependent: true,
        in_use: dests.iter().map(|d| d.1).sum(),
        capacity: 100,
        pod_quota: Some(25),
        destinations: dests.iter().map(|(r, n)| DestinationUse { remote: *r, in_use: *n }).collect(),
        pods,
    }
}

#[test]
fn alarms_follow_destinations_and_pods_and_forget_the_absent() {
    let e: IpAddr = E.into();
    let d1: SocketAddr = "203.0.113.5:443".parse().unwrap();
    let d2: SocketAddr = "203.0.113.6:443".parse().unwrap();
    let pod: IpAddr = "192.0.2.10".parse().unwrap();
    let t0 = Instant::now();
    let mut a = Alarms::default();
    let snap = |dests: &[(SocketAddr, u64)], pod_n: u64| PortUse {
        pools: vec![ed_pool(e, dests, vec![PodUse { pod, remote: Some(d1), in_use: pod_n }])],
        ..PortUse::default()
    };
    let c = a.observe(&snap(&[(d1, 81), (d2, 50)], 20), t0);
    let subjects: Vec<_> = c.iter().map(|c| (c.subject.clone(), c.level, c.in_use, c.limit)).collect();
    assert_eq!(
        subjects,
        vec![
            (Subject::Destination { egress_ip: e, proto: "tcp".into(), remote: d1 }, 80, 81, 100),
            (Subject::Pod { egress_ip: e, proto: "tcp".into(), pod, remote: Some(d1) }, 80, 20, 25),
        ]
    );
    assert_eq!(c[0].reason(), reason::PORTS_NEAR_EXHAUSTION);
    assert_eq!(c[1].reason(), reason::POD_PORT_QUOTA_NEAR);
    assert!(c[0].message("gw1").contains("towards 203.0.113.5:443"), "{}", c[0].message("gw1"));
    assert!(a.observe(&snap(&[(d1, 82), (d2, 50)], 20), t0 + Duration::from_secs(10)).is_empty(), "once");
    // d1 leaves the top N for a while: not reported again when it comes back.
    assert!(a.observe(&snap(&[(d2, 50)], 0), t0 + Duration::from_secs(20)).is_empty());
    assert!(a.observe(&snap(&[(d1, 82)], 0), t0 + Duration::from_secs(30)).is_empty());
    // Gone for longer than FORGET_AFTER: re-armed.
    let later = t0 + Duration::from_secs(30) + FORGET_AFTER;
    assert!(a.observe(&snap(&[], 0), later).is_empty());
    assert!(a.is_empty());
    assert_eq!(a.observe(&snap(&[(d1, 96)], 0), later).len(), 1);
}

#[test]
fn a_quota_at_or_above_the_range_is_not_a_pod_warning() {
    let e: IpAddr = E.into();
    let pod: IpAddr = "192.0.2.10".parse().unwrap();
    let mut p = ed_pool(e, &[], vec![PodUse { pod, remote: None, in_use: 99 }]);
    p.pod_quota = Some(100);
    let u = PortUse { pools: vec![p.clone()], ..PortUse::default() };
    assert!(subjects(&u).is_empty());
    p.pod_quota = None;
    assert!(subjects(&PortUse { pools: vec![p], ..PortUse::default() }).is_empty());
}

#[test]
fn the_monitor_queues_crossings_only_for_a_consumer_and_bounds_them() {
    let e: IpAddr = E.into();
    let m = Monitor::new(10);
    let u = |n: u64| PortUse {
        pools: vec![PoolUse {
            egress_ip: e,
            proto: "udp".into(),
            endpoint_dependent: false,
            in_use: n,
            capacity: 100,
            pod_quota: None,
            destinations: vec![],
            pods: vec![],
        }],
        ..PortUse::default()
    };
    let t0 = Instant::now();
    assert_eq!(m.update(u(90), t0).len(), 1);
    assert!(m.take_crossings().is_empty(), "no consumer yet");
    assert_eq!(m.latest().pools[0].in_use, 90);
    let waker = Arc::new(tokio::sync::Notify::new());
    m.deliver_to(waker);
    m.update(u(10), t0);
    m.update(u(96), t0);
    let c = m.take_crossings();
    assert_eq!((c.len(), c[0].level), (1, 95));
    assert_eq!(m.reported(), 2);
    // One crossing every other update (95 % each time, re-armed at 0).
    for i in 0..2 * (MAX_PENDING as u64 + 5) {
        m.update(u(if i % 2 == 0 { 0 } else { 99 }), t0);
    }
    assert_eq!(m.take_crossings().len(), MAX_PENDING);
    assert_eq!(m.dropped(), 5);
}

fn tables(ports: PortRange, quota: u32) -> Tables {
    let spec = TablesSpec {
        policies: vec![PolicySpec {
            name: "p".into(),
            sources: vec!["192.0.2.0/24".parse().unwrap()],
            destinations: vec!["0.0.0.0/0".parse().unwrap()],
            except: vec![],
            egress_ips: vec![E.into()],
        }],
        egress_ips: vec![EgressIpSpec { ip: E.into(), ports: Some(ports), answer_neighbor: true, port_blocks: None }],
        ..Default::default()
    };
    let mut spec = spec;
    spec.nat.mapping = MappingBehavior::EndpointDependent;
    spec.nat.max_ports_per_source = Some(quota);
    Tables::compile(&spec, 1, &PolicySlots::default()).unwrap()
}

/// A real NAT table in endpoint-dependent mode driven towards one
/// destination until no port is left: the walk sees that destination on
/// top, the warnings come at 80 % and 95 %, and a pod at its quota too.
#[test]
fn endpoint_dependent_exhaustion_towards_one_destination_is_seen_coming() {
    let range = PortRange { first: 40000, last: 40099 };
    let t = tables(range, 30);
    let nat: NatTable<Ipv4Addr> = NatTable::new(&t.nat);
    let policy = t.policy(PolicyId(0)).unwrap();
    let (mut rng, stats) = (PortRng::new(7), WorkerStats::default());
    let hot = Ipv4Addr::new(203, 0, 113, 5);
    let other = Ipv4Addr::new(203, 0, 113, 9);
    let mut open = |pod: Ipv4Addr, pod_port: u16, remote: Ipv4Addr| {
        let r =
            OutboundRequest { pod, pod_port, remote, remote_port: 443, proto: TCP, tcp_flags: tcp_state::flags::SYN };
        let mut ctx = CreateCtx::new(0, &mut rng, &stats, DeltaFnBox(&|_| 0));
        nat.create_outbound(&r, policy, &t, &mut ctx).map(|_| ())
    };
    // Another destination, a little.
    for p in 0..5 {
        open(Ipv4Addr::new(192, 0, 2, 1), 1000 + p, other).unwrap();
    }
    let monitor = Monitor::new(3);
    let walk = || {
        let mut u = PortUse::default();
        for (ip, proto, pool) in nat.mappings.pools() {
            u.pools.push(pool_use(ip, proto, &pool, !nat.mappings.endpoint_independent(), monitor.top()).0);
        }
        u
    };
    let t0 = Instant::now();
    // Pods .10 to .13 open 20 each towards the hot destination (80 of 100),
    // then .20 15 more. Each from a pod port in the range, free towards it:
    // the first candidate is taken, no random probe can miss.
    let mut reports: Vec<(u32, Crossing)> = Vec::new();
    let mut opened = 0u32;
    for pod in 10..14u8 {
        for p in 0..20 {
            open(Ipv4Addr::new(192, 0, 2, pod), 40000 + u16::from(pod - 10) * 20 + p, hot).unwrap();
            opened += 1;
            reports.extend(monitor.update(walk(), t0).into_iter().map(|c| (opened, c)));
        }
    }
    let quota_pod = Ipv4Addr::new(192, 0, 2, 20);
    for p in 0..15 {
        open(quota_pod, 40080 + p, hot).unwrap();
        opened += 1;
        reports.extend(monitor.update(walk(), t0).into_iter().map(|c| (opened, c)));
    }
    let u = walk();
    let pool = &u.pools[0];
    assert_eq!((pool.in_use, pool.capacity, pool.pod_quota), (100, 100, Some(30)));
    assert_eq!(pool.destinations[0], DestinationUse { remote: SocketAddr::new(hot.into(), 443), in_use: 95 });
    assert_eq!(pool.destinations[1], DestinationUse { remote: SocketAddr::new(other.into(), 443), in_use: 5 });
    assert_eq!(pool.pods.len(), 3, "top 3 only");
    assert_eq!(pool.pods[0].in_use, 20, "{:?}", pool.pods);
    let hot_subject =
        Subject::Destination { egress_ip: E.into(), proto: "tcp".into(), remote: SocketAddr::new(hot.into(), 443) };
    let seen: Vec<(u32, u64)> =
        reports.iter().filter(|(_, c)| c.subject == hot_subject).map(|(n, c)| (*n, c.level)).collect();
    assert_eq!(seen, vec![(80, 80), (95, 95)], "warned at 80 and 95 sessions towards it, once each");
    // The last five ports towards it: then exhaustion, as warned.
    for p in 15..20 {
        open(quota_pod, 40080 + p, hot).unwrap();
    }
    assert_eq!(open(Ipv4Addr::new(192, 0, 2, 30), 4000, hot), Err(DropReason::PortsExhausted));
    // Another destination still has its whole range.
    open(Ipv4Addr::new(192, 0, 2, 30), 4000, other).unwrap();
    assert!(monitor.update(walk(), t0).is_empty(), "no second warning at 100 %");

    // A pod near its quota towards one destination (another pool range).
    let t = tables(PortRange { first: 41000, last: 41099 }, 10);
    let nat: NatTable<Ipv4Addr> = NatTable::new(&t.nat);
    let policy = t.policy(PolicyId(0)).unwrap();
    let monitor = Monitor::new(3);
    let mut levels = Vec::new();
    for p in 0..10 {
        let r = OutboundRequest {
            pod: quota_pod,
            pod_port: 5000 + p,
            remote: hot,
            remote_port: 443,
            proto: TCP,
            tcp_flags: tcp_state::flags::SYN,
        };
        let mut ctx = CreateCtx::new(0, &mut rng, &stats, DeltaFnBox(&|_| 0));
        nat.create_outbound(&r, policy, &t, &mut ctx).unwrap();
        let mut u = PortUse::default();
        for (ip, proto, pool) in nat.mappings.pools() {
            u.pools.push(pool_use(ip, proto, &pool, true, 3).0);
        }
        for c in monitor.update(u, t0) {
            if matches!(c.subject, Subject::Pod { .. }) {
                levels.push((p + 1, c.level, c.reason()));
            }
        }
    }
    assert_eq!(levels, vec![(8, 80, reason::POD_PORT_QUOTA_NEAR), (10, 95, reason::POD_PORT_QUOTA_NEAR)]);
}

/// The walk's cost on 1 M sessions, each its own (pod, destination) entry
/// (the worst case: a walk costs per entry), and how long a worker's
/// admission waits meanwhile. Figures in docs/benchmarks.md ("Port use").
#[test]
#[ignore = "timing: cargo test -p egret-controlplane --lib walk_cost -- --ignored --nocapture"]
fn walk_cost_on_a_million_sessions() {
    use std::sync::atomic::AtomicBool;
    let pool: Arc<PortPool<Ipv4Addr>> = Arc::new(PortPool::new(PortRange::default(), false));
    let t = Instant::now();
    for pod in 0..1000u32 {
        for d in 0..1000u32 {
            assert!(pool.admit_source_towards(Ipv4Addr::from(0x0af4_0000 | pod), Ipv4Addr::from(0xcb00_0000 | d), 443));
        }
    }
    println!("filled 1 M entries in {:?}", t.elapsed());
    // The part under the shards' locks: the copy.
    let mut copies = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let mut v = Vec::new();
        pool.for_each_source(|a, b, c, d| v.push((a, b, c, d)));
        copies.push(t.elapsed());
        assert_eq!(v.len(), 1_000_000);
    }
    copies.sort();
    println!("copy of 1 M entries (all shards): min {:?} median {:?} max {:?}", copies[0], copies[2], copies[4]);
    // A worker's admission and release of one session, timed, while the
    // walks run (and before, for comparison).
    let admit = |pool: &PortPool<Ipv4Addr>, stop: &AtomicBool| {
        let mut times = Vec::new();
        let mut i = 0u32;
        while !stop.load(Ordering::Relaxed) {
            let (pod, remote) = (Ipv4Addr::from(0x0af5_0000 | (i % 4096)), Ipv4Addr::from(0xc633_6400 | (i % 251)));
            let t = Instant::now();
            pool.admit_source_towards(pod, remote, 80);
            pool.release_source_towards(pod, remote, 80);
            times.push(t.elapsed().as_nanos() as u64);
            i = i.wrapping_add(1);
        }
        times.sort_unstable();
        let q = |p: f64| times[((times.len() - 1) as f64 * p) as usize];
        (times.len(), q(0.5), q(0.99), q(0.9999), times[times.len() - 1])
    };
    let stop = AtomicBool::new(false);
    let idle = std::thread::scope(|s| {
        let h = s.spawn(|| admit(&pool, &stop));
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    println!(
        "admit+release, no walk: n {} p50 {} ns p99 {} ns p99.99 {} ns max {} ns",
        idle.0, idle.1, idle.2, idle.3, idle.4
    );
    stop.store(false, Ordering::Relaxed);
    let mut walks = Vec::new();
    let busy = std::thread::scope(|s| {
        let h = s.spawn(|| admit(&pool, &stop));
        for _ in 0..5 {
            let t = Instant::now();
            let (u, entries) = pool_use(Ipv4Addr::new(198, 51, 100, 1), TCP, &pool, true, DEFAULT_TOP);
            walks.push(t.elapsed());
            assert!(entries >= 1_000_000 && u.destinations.len() == DEFAULT_TOP && u.pods.len() == DEFAULT_TOP);
        }
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap()
    });
    walks.sort();
    println!("walk of 1 M entries, top {DEFAULT_TOP}: min {:?} median {:?} max {:?}", walks[0], walks[2], walks[4]);
    println!(
        "admit+release during walks: n {} p50 {} ns p99 {} ns p99.99 {} ns max {} ns",
        busy.0, busy.1, busy.2, busy.3, busy.4
    );
}
