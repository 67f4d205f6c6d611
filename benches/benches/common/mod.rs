//! Shared set-up for the engine benchmarks: an engine holding N live IPv4
//! (or, through the `_in` forms, IPv6) sessions, and frames of existing
//! flows in both directions.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, Pipeline, RxMeta, Verdict};
use egret_dataplane::fixtures::{self, build::Packet};
use egret_dataplane::nat::key::{proto, FlowKey, SessionTuple};
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::nat::rewrite;
use egret_dataplane::nat::rewrite::IpFamily;
use egret_dataplane::nat::table::{CreateCtx, DeltaFnBox, NatTable, OutboundRequest};
use egret_dataplane::policy::PolicyId;
use egret_dataplane::stats::WorkerStats;
use egret_dataplane::tables::{EgressIpSpec, MappingBehavior, PolicySpec, TablesSpec, TunnelSpec};

/// Egress IPs in the benchmark configuration.
pub const EGRESS_IPS: u8 = 64;

/// A family the benchmarks populate. IPv6 has the IPv4 population's
/// flows, each host number moved into an IPv6 prefix: pods in
/// 2001:db8:18::/48, remotes in 2001:db8:51::/48, egress IPs
/// 2001:db8:113::10-4f.
pub trait Family: IpFamily + Into<IpAddr> {
    /// The pods' prefix and the whole family's.
    const NETS: [&'static str; 2];
    /// The family's address for IPv4 population address `v4`.
    fn of(v4: Ipv4Addr) -> Self;
    /// Egress IP `i` (0 to [`EGRESS_IPS`] - 1).
    fn egress(i: u8) -> IpAddr;
    /// The engine's table of the family.
    fn nat(engine: &Engine) -> &NatTable<Self>;
}

impl Family for Ipv4Addr {
    const NETS: [&'static str; 2] = ["198.18.0.0/15", "0.0.0.0/0"];
    fn of(v4: Ipv4Addr) -> Self {
        v4
    }
    fn egress(i: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(203, 0, 113, 10 + i))
    }
    fn nat(engine: &Engine) -> &NatTable<Self> {
        engine.nat4()
    }
}

impl Family for Ipv6Addr {
    const NETS: [&'static str; 2] = ["2001:db8:18::/48", "::/0"];
    fn of(v4: Ipv4Addr) -> Self {
        // 198.18.x.y (pods) -> 2001:db8:18::x:y, 198.51.x.y (remotes) -> 2001:db8:51::x:y.
        let [a, b, c, d] = v4.octets();
        let net = if [a, b] == [198, 18] { 0x18 } else { 0x51 };
        Ipv6Addr::new(0x2001, 0xdb8, net, 0, 0, 0, u16::from(c), u16::from(d))
    }
    fn egress(i: u8) -> IpAddr {
        IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0x113, 0, 0, 0, 0, 0x10 + u16::from(i)))
    }
    fn nat(engine: &Engine) -> &NatTable<Self> {
        engine.nat6()
    }
}

/// The benchmark configuration: pods 198.18.0.0/15 to anywhere, over 64
/// egress IPs 203.0.113.10-73 (paired pooling spreads the pods).
pub fn spec(max_sessions: usize, mapping: MappingBehavior) -> TablesSpec {
    spec_in::<Ipv4Addr>(max_sessions, mapping)
}

/// [`spec`] in family `A`.
pub fn spec_in<A: Family>(max_sessions: usize, mapping: MappingBehavior) -> TablesSpec {
    let egress: Vec<IpAddr> = (0..EGRESS_IPS).map(A::egress).collect();
    let mut s = TablesSpec {
        policies: vec![PolicySpec {
            name: "bench".into(),
            sources: vec![A::NETS[0].parse().unwrap()],
            destinations: vec![A::NETS[1].parse().unwrap()],
            except: vec![],
            egress_ips: egress.clone(),
        }],
        egress_ips: egress
            .into_iter()
            .map(|ip| EgressIpSpec { ip, ports: None, answer_neighbor: true, port_blocks: None })
            .collect(),
        ..Default::default()
    };
    s.nat.max_sessions = max_sessions;
    s.nat.max_sessions_per_source = u32::MAX;
    // Thousands of new flows per source at one instant: no new-flow rate
    // limit (it would drop them; nat/flow_rate.rs).
    s.nat.new_flows_per_second_per_source = 0;
    s.nat.mapping = mapping;
    s
}

/// Flow `i` of a population of `pods` pods x `ports` ports x `remotes` remotes.
pub fn flow(i: u64, pods: u64, ports: u64, remotes: u64) -> (Ipv4Addr, u16, Ipv4Addr, u16) {
    let pod = i % pods;
    let port = (i / pods) % ports;
    let remote = (i / (pods * ports)) % remotes;
    (
        Ipv4Addr::from(0xC612_0000u32 + 1 + pod as u32),
        32768 + port as u16,
        Ipv4Addr::from(0xC633_6400u32 + 1 + (remote as u32 % 250)),
        1000 + (remote / 250) as u16,
    )
}

/// A shape of `n` sessions: (pods, ports per pod, remotes per port).
pub fn shape(n: u64) -> (u64, u64, u64) {
    match n {
        0..=1_000 => (10, 10, n.div_ceil(100).max(1)),
        1_001..=1_000_000 => (1000, 100, n.div_ceil(100_000)),
        _ => (1000, 1000, n.div_ceil(1_000_000)),
    }
}

/// An engine with `n` live IPv4 UDP sessions (created through the NAT API,
/// as the slow path would), its worker, and the shape used.
pub fn populated(n: u64, mapping: MappingBehavior) -> (Engine, Pipeline, (u64, u64, u64)) {
    populated_in::<Ipv4Addr>(n, mapping)
}

/// [`populated`] in family `A`.
pub fn populated_in<A: Family>(n: u64, mapping: MappingBehavior) -> (Engine, Pipeline, (u64, u64, u64)) {
    populated_with::<A>(n, mapping, |_| {})
}

/// [`populated_in`] with the configuration changed by `edit` first (for
/// example [`with_tunnel`]).
pub fn populated_with<A: Family>(
    n: u64,
    mapping: MappingBehavior,
    edit: impl FnOnce(&mut TablesSpec),
) -> (Engine, Pipeline, (u64, u64, u64)) {
    let mut spec = spec_in::<A>((n as usize + n as usize / 8).max(1024), mapping);
    edit(&mut spec);
    let engine = Engine::new(&spec).unwrap();
    engine.publish_fib(fixtures::topology());
    let worker = engine.pipeline_seeded(PortRng::new(42));
    let tables = engine.tables();
    let policy = tables.policy(PolicyId(0)).unwrap();
    let stats = WorkerStats::default();
    let mut rng = PortRng::new(1);
    let deltas = |t: &SessionTuple<A>| rewrite::outbound_deltas(t);
    let sh = shape(n);
    for i in 0..n {
        let (pod, pod_port, remote, remote_port) = flow(i, sh.0, sh.1, sh.2);
        let (pod, remote) = (A::of(pod), A::of(remote));
        let req = OutboundRequest { pod, pod_port, remote, remote_port, proto: proto::UDP, tcp_flags: 0 };
        let mut ctx = CreateCtx::new(0, &mut rng, &stats, DeltaFnBox(&deltas));
        A::nat(&engine).create_outbound(&req, policy, &tables, &mut ctx).expect("session");
    }
    assert_eq!(A::nat(&engine).sessions.len() as u64, n);
    (engine, worker, sh)
}

/// 64-byte frames (plus Ethernet header) of existing flows: outbound from the
/// pod, and the remote's reply to the egress IP and port.
pub fn frames(engine: &Engine, n: u64, sh: (u64, u64, u64), count: usize, seed: u64) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    frames_in::<Ipv4Addr>(engine, n, sh, count, seed)
}

/// [`frames`] in family `A` (IPv6 frames are 20 bytes longer).
pub fn frames_in<A: Family>(
    engine: &Engine,
    n: u64,
    sh: (u64, u64, u64),
    count: usize,
    seed: u64,
) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
    let mut rng = PortRng::new(seed);
    let mut out = Vec::with_capacity(count);
    let mut back = Vec::with_capacity(count);
    for _ in 0..count {
        let i = rng.next_u64() % n;
        let (pod, pp, remote, rp) = flow(i, sh.0, sh.1, sh.2);
        let (pod, remote) = (A::of(pod), A::of(remote));
        let o: Packet = fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18]));
        let key = FlowKey::new(pod, remote, pp, rp, proto::UDP);
        let (_, v) = A::nat(engine).sessions.lookup(&key).expect("session exists");
        let b = fixtures::from_outside(
            remote.into(),
            v.tuple.egress.into(),
            fixtures::udp(rp, v.tuple.egress_port, &[0u8; 18]),
        );
        out.push(o.frame());
        back.push(b.frame());
    }
    (out, back)
}

/// The VXLAN tunnel from the fixtures' worker node in another subnet
/// (`fixtures::TUNNEL_NODE`, `TUNNEL_NODE6`) to the egress IPs.
pub fn with_tunnel(spec: &mut TablesSpec) {
    spec.tunnel = Some(TunnelSpec {
        port: egret_dataplane::wire::vxlan::DEFAULT_PORT,
        nodes: vec![IpAddr::V4(fixtures::TUNNEL_NODE), IpAddr::V6(fixtures::TUNNEL_NODE6)],
    });
}

/// `frames` (a pod's, as its node hands them over) as that node sends them
/// through the tunnel instead, to egress IP 0 of their family (the
/// fixtures' E1 and E6; [`with_tunnel`]).
pub fn through_tunnel(frames: &[Vec<u8>]) -> Vec<Vec<u8>> {
    frames.iter().enumerate().map(|(i, f)| fixtures::tunnelled(f, i as u16).expect("an IP frame")).collect()
}

/// Frames a worker takes from a ring at once (its default `batch_size`):
/// [`run`] opens one engine batch ([`Pipeline::batch`]) for each.
pub const BATCH: u64 = 64;

/// Processes `frames` cyclically `iters` times, [`BATCH`] frames to a
/// batch as a worker does; returns how many were forwarded.
#[inline]
pub fn run<F: AsRef<[u8]>>(w: &mut Pipeline, frames: &[F], ingress: u32, iters: u64, now: u64) -> u64 {
    let mut buf = vec![0u8; 2048];
    let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
    let t = Timestamp::from_secs(now);
    let mut ok = 0;
    let mut idx = 0;
    let mut done = 0;
    while done < iters {
        let n = BATCH.min(iters - done);
        let mut batch = w.batch(t);
        for _ in 0..n {
            let f = frames[idx].as_ref();
            idx += 1;
            if idx == frames.len() {
                idx = 0;
            }
            buf[..f.len()].copy_from_slice(f);
            if let Verdict::Forward { .. } = batch.process(&mut buf, f.len(), meta) {
                ok += 1;
            }
        }
        done += n;
    }
    ok
}

/// As [`run`], every frame a batch of its own ([`Pipeline::process`]):
/// what the batch saves is the difference (benches/engine.rs).
#[inline]
pub fn run_frame_by_frame(w: &mut Pipeline, frames: &[Vec<u8>], ingress: u32, iters: u64, now: u64) -> u64 {
    let mut buf = vec![0u8; 2048];
    let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
    let t = Timestamp::from_secs(now);
    let mut ok = 0;
    let mut idx = 0;
    for _ in 0..iters {
        let f = &frames[idx];
        idx += 1;
        if idx == frames.len() {
            idx = 0;
        }
        buf[..f.len()].copy_from_slice(f);
        if let Verdict::Forward { .. } = w.process(&mut buf, f.len(), meta, t) {
            ok += 1;
        }
    }
    ok
}

/// As [`run`], in batches of `batch` frames staged first (the engine's
/// `prefetch_flow`, `prefetch_session` then `prefetch_lookup` for every frame of the batch,
/// then the batch's `process` for each): what a worker does with a ring's batch.
#[inline]
pub fn run_staged<F: AsRef<[u8]>>(
    w: &mut Pipeline,
    frames: &[F],
    ingress: u32,
    iters: u64,
    now: u64,
    batch: usize,
) -> u64 {
    use egret_dataplane::engine::Staged;
    let mut bufs = vec![vec![0u8; 2048]; batch];
    let mut lens = vec![0usize; batch];
    let mut staged = vec![Staged::default(); batch];
    let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
    let t = Timestamp::from_secs(now);
    let mut ok = 0;
    let mut idx = 0;
    let mut done = 0u64;
    while done < iters {
        let n = batch.min((iters - done) as usize);
        for (buf, len) in bufs.iter_mut().zip(lens.iter_mut()).take(n) {
            let f = frames[idx].as_ref();
            idx += 1;
            if idx == frames.len() {
                idx = 0;
            }
            buf[..f.len()].copy_from_slice(f);
            *len = f.len();
        }
        for (s, (buf, len)) in staged.iter_mut().zip(bufs.iter().zip(&lens)).take(n) {
            *s = w.prefetch_flow(&buf[..*len]);
        }
        for s in staged.iter().take(n) {
            w.prefetch_session(*s);
        }
        for s in staged.iter().take(n) {
            w.prefetch_lookup(*s);
        }
        let mut b = w.batch(t);
        for (buf, len) in bufs.iter_mut().zip(&lens).take(n) {
            if let Verdict::Forward { .. } = b.process(buf, *len, meta) {
                ok += 1;
            }
        }
        done += n as u64;
    }
    ok
}
