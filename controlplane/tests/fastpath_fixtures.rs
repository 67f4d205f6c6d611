//! One fixture table, two implementations (docs/fast-path.md).
//!
//! Every scenario of the engine's fixture table (`egret_dataplane::fixtures`)
//! is replayed through the engine exactly as `fixtures::run` does, with the
//! daemon's offload manager (`egret_controlplane::offload`) installing every
//! session the engine confirms into a loaded XDP program's maps, and the
//! sweeper run before each step (the manager and the sweeper have caught up).
//! Before the engine sees a step, its frame runs through BPF_PROG_TEST_RUN
//! as received on the step's interface. The rules the program must follow
//! are restated here, independently of its C source:
//!
//! - an untagged, unfragmented IPv4 (no options) or IPv6 (no extension
//!   headers) TCP/UDP packet whose session is installed is translated: the
//!   action is XDP_REDIRECT (another interface) or XDP_TX (the same), and
//!   the frame is byte-identical to the fixture's expected frame;
//! - the same packet with SYN, FIN or RST, a TTL of 1, a partial checksum,
//!   an unresolved next hop, or malformed lengths is punted: the frame is
//!   untouched and exactly that reason's counter moves;
//! - tagged frames, options, fragments, extension headers and other
//!   protocols are skipped, anything else is a miss, each counted.
//!
//! For every hit, variants of its frame (TTL 1, partial checksum, SYN, FIN,
//! RST, options, a fragment, a tag, a bad header checksum, the next hop
//! unresolved) must be punted with their reason. Root only (BPF, a network
//! namespace whose interfaces 2 and 3 stand for the fixture's inside and
//! outside).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use egret_bpf::{
    FastPathReason as F, FpKeyV4, FpKeyV6, FpNextHop, LoadOptions, SteeringProgram, VerdictReason as R, XdpAction,
};
use egret_controlplane::daemon::sink::{owned_entries, policy_entries};
use egret_controlplane::offload::{FastPath, OffloadManager};
use egret_dataplane::clock::EngineClock;
use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, Pipeline, RxMeta, Verdict};
use egret_dataplane::fib::Fib;
use egret_dataplane::fixtures::{self, build, Expect, Scenario, FRAME_BUFFER, INSIDE, OUTSIDE};
use egret_dataplane::nat::key::FlowKey;
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::nat::session::offload;
use egret_dataplane::netns::{self, NetnsGuard};

// ------------------------------------------------------------ namespace

/// A namespace with veths whose gateway ends are ifindex 2 (inside) and 3
/// (outside), entered by the calling thread; deleted on drop.
fn enter_ns(tag: &str) -> NetnsGuard {
    let ns = NetnsGuard::unique("egfpfx", &[tag]).create().unwrap_or_else(|e| panic!("{e}"));
    let name = ns.name(0);
    let ip = |args: &[&str]| {
        let out = Command::new("ip").args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    ip(&["-n", name, "link", "add", "inside", "index", "2", "type", "veth", "peer", "name", "inside-p", "index", "12"]);
    ip(&[
        "-n",
        name,
        "link",
        "add",
        "outside",
        "index",
        "3",
        "type",
        "veth",
        "peer",
        "name",
        "outside-p",
        "index",
        "13",
    ]);
    netns::enter_named(name).expect("enter the namespace (root)");
    assert_eq!(netns::ifindex("inside").unwrap(), INSIDE);
    assert_eq!(netns::ifindex("outside").unwrap(), OUTSIDE);
    ns
}

// ------------------------------------------------------------ the rig

struct Rig {
    engine: Engine,
    worker: Pipeline,
    program: Arc<SteeringProgram>,
    fp: Arc<FastPath>,
    manager: OffloadManager,
}

/// Runs `frame` through the rig's worker as received on `ingress` at `at`
/// seconds: the verdict and the (rewritten) buffer.
fn process(r: &mut Rig, frame: &[u8], ingress: u32, at: u64) -> (Verdict, Vec<u8>) {
    let mut buf = vec![0u8; FRAME_BUFFER];
    buf[..frame.len()].copy_from_slice(frame);
    let meta = RxMeta { ifindex: ingress, checksum: ChecksumHint::Unknown };
    let v = r.worker.process(&mut buf, frame.len(), meta, Timestamp::from_secs(at));
    (v, buf)
}

fn rig(spec: &egret_dataplane::tables::TablesSpec, fib: Fib) -> Rig {
    let engine = Engine::new(spec).unwrap();
    engine.publish_fib(fib);
    let program = Arc::new(
        SteeringProgram::load(LoadOptions {
            fast_path_sessions_v4: 4096,
            fast_path_sessions_v6: 4096,
            ..LoadOptions::default()
        })
        .unwrap(),
    );
    // The steering maps as the daemon fills them, so punted frames get the
    // verdict they get in production (minus the AF_XDP socket: no socket
    // here, so steered frames are dropped by rule 7).
    let tables = engine.tables();
    for (ip, o) in owned_entries(&tables) {
        program.set_owned(ip, o).unwrap();
    }
    let (mut src, mut dst) = (Vec::new(), Vec::new());
    policy_entries::<Ipv4Addr>(&tables.classify_v4, &mut src, &mut dst);
    policy_entries::<Ipv6Addr>(&tables.classify_v6, &mut src, &mut dst);
    program.replace_policy(&src, &dst).unwrap();
    let fp = Arc::new(
        FastPath::new(program.clone(), EngineClock::new(Instant::now(), 1), spec.nat.udp_inbound_refresh).unwrap(),
    );
    assert!(fp.connect(&engine));
    let manager = OffloadManager::new(fp.clone(), engine.clone(), 64);
    // The seed fixtures::run uses: the same ports, the same expected frames.
    let worker = engine.pipeline_seeded(PortRng::new(0x5eed));
    Rig { engine, worker, program, fp, manager }
}

// ------------------------------------------------------------ the rules, restated

/// What the fast path must do with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    /// Not an IP frame it looks at (non-IP, or IP cut short): no counter.
    Nothing,
    /// Skipped, missed or punted for this reason; the frame untouched.
    Reason(F),
    /// Translated.
    Hit,
}

/// The fields of a frame the rules read.
#[derive(Debug, Clone, Copy)]
struct Seen {
    v6: bool,
    key4: Option<FlowKey<Ipv4Addr>>,
    key6: Option<FlowKey<Ipv6Addr>>,
    /// Lengths consistent (what the engine would not call malformed).
    lengths_ok: bool,
    tcp_control: bool,
    hop_limit: u8,
    partial: bool,
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn fold(mut s: u32) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

fn words(b: &[u8]) -> u32 {
    b.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]))).sum()
}

/// Reads a frame as the rules do: `Err(want)` when it is decided before a
/// lookup.
fn inspect(f: &[u8]) -> Result<Seen, Want> {
    if f.len() < 14 {
        return Err(Want::Nothing);
    }
    let et = be16(f, 12);
    if et == 0x8100 {
        let inner = if f.len() >= 18 { be16(f, 16) } else { 0 };
        return Err(if inner == 0x0800 || inner == 0x86dd { Want::Reason(F::SkipVlan) } else { Want::Nothing });
    }
    let ip = &f[14..];
    let (v6, l4, proto, l4_len, hop_limit, src, dst, lengths_ok) = match et {
        0x0800 => {
            if ip.len() < 20 || ip[0] >> 4 != 4 || ip[0] & 0xf < 5 {
                return Err(Want::Nothing);
            }
            if ip[0] & 0xf != 5 {
                return Err(Want::Reason(F::SkipIpOptions));
            }
            if be16(ip, 6) & 0x3fff != 0 {
                return Err(Want::Reason(F::SkipFragment));
            }
            let tot = usize::from(be16(ip, 2));
            let ok = tot >= 20 && tot <= ip.len() && fold(words(&ip[..20])) == 0xffff;
            let s = IpAddr::V4(Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]));
            let d = IpAddr::V4(Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]));
            (false, 20, ip[9], tot.saturating_sub(20), ip[8], s, d, ok)
        }
        0x86dd => {
            if ip.len() < 40 || ip[0] >> 4 != 6 {
                return Err(Want::Nothing);
            }
            match ip[6] {
                6 | 17 => {}
                44 => return Err(Want::Reason(F::SkipFragment)),
                0 | 43 | 60 => return Err(Want::Reason(F::SkipIpv6Ext)),
                _ => return Err(Want::Reason(F::SkipNotTcpUdp)),
            }
            let len = usize::from(be16(ip, 4));
            let s = IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap()));
            let d = IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap()));
            (true, 40, ip[6], len, ip[7], s, d, 40 + len <= ip.len())
        }
        _ => return Err(Want::Nothing),
    };
    if proto != 6 && proto != 17 {
        return Err(Want::Reason(F::SkipNotTcpUdp));
    }
    if ip.len() < l4 + 4 {
        return Err(Want::Nothing);
    }
    let t = &ip[l4..];
    let (sport, dport) = (be16(t, 0), be16(t, 2));
    let mut lengths_ok = lengths_ok;
    let (mut tcp_control, mut partial) = (false, false);
    let csum_at = if proto == 6 { 16 } else { 6 };
    if t.len() < csum_at + 2 || l4_len < if proto == 6 { 20 } else { 8 } {
        lengths_ok = false;
    } else {
        if proto == 6 {
            let doff = usize::from(t[12] >> 4) * 4;
            lengths_ok &= doff >= 20 && doff <= l4_len;
            tcp_control = t[13] & 0x07 != 0;
        } else {
            let ulen = usize::from(be16(t, 4));
            lengths_ok &= ulen >= 8 && ulen <= l4_len;
            lengths_ok &= !(v6 && be16(t, 6) == 0);
        }
        let csum = be16(t, csum_at);
        let pseudo = words(&ip[if v6 { 8 } else { 12 }..if v6 { 40 } else { 20 }])
            + u32::from(proto)
            + (l4_len as u32 >> 16)
            + (l4_len as u32 & 0xffff);
        partial = csum != 0 && csum == fold(pseudo);
    }
    let (key4, key6) = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => (Some(FlowKey::new(s, d, sport, dport, proto)), None),
        (IpAddr::V6(s), IpAddr::V6(d)) => (None, Some(FlowKey::new(s, d, sport, dport, proto))),
        _ => (None, None),
    };
    Ok(Seen { v6, key4, key6, lengths_ok, tcp_control, hop_limit, partial })
}

/// The destination after translation of an installed session's direction,
/// or `None` when the frame matches no installed session.
fn installed_session(engine: &Engine, s: &Seen) -> Option<IpAddr> {
    if let Some(k) = s.key4 {
        let (r, v) = engine.nat4().sessions.lookup(&k)?;
        (v.offload & offload::INSTALLED != 0).then(|| {
            if r.is_inbound() {
                v.tuple.pod.into()
            } else {
                v.tuple.remote.into()
            }
        })
    } else if let Some(k) = s.key6 {
        let (r, v) = engine.nat6().sessions.lookup(&k)?;
        (v.offload & offload::INSTALLED != 0).then(|| {
            if r.is_inbound() {
                v.tuple.pod.into()
            } else {
                v.tuple.remote.into()
            }
        })
    } else {
        None
    }
}

fn want(engine: &Engine, f: &[u8]) -> Want {
    let s = match inspect(f) {
        Ok(s) => s,
        Err(w) => return w,
    };
    let Some(new_dst) = installed_session(engine, &s) else { return Want::Reason(F::Miss) };
    if !s.lengths_ok {
        return Want::Reason(F::PuntMalformed);
    }
    if s.tcp_control {
        return Want::Reason(F::PuntTcpControl);
    }
    if s.hop_limit <= 1 {
        return Want::Reason(F::PuntTtl);
    }
    if s.partial {
        return Want::Reason(F::PuntPartialChecksum);
    }
    match engine.fib().next_hop(new_dst) {
        egret_dataplane::fib::NextHop::Resolved { .. } => Want::Hit,
        _ => Want::Reason(F::PuntNextHop),
    }
}

// ------------------------------------------------------------ running

fn moved<T: Copy + std::fmt::Debug>(all: &[T], before: &[u64], after: &[u64]) -> Vec<(T, u64)> {
    all.iter().zip(before.iter().zip(after)).filter(|(_, (b, a))| a != b).map(|(r, (b, a))| (*r, a - b)).collect()
}

fn counters(p: &SteeringProgram) -> (Vec<u64>, Vec<u64>) {
    (
        p.verdict_counters().unwrap().into_iter().map(|(_, n)| n).collect(),
        p.fp_counters().unwrap().into_iter().map(|(_, n)| n).collect(),
    )
}

/// Runs `frame` through the program as received on `ingress`; checks it
/// against `want` and, for a hit, against `expected` (the frame and
/// interface the engine must produce). Returns a mismatch, if any.
fn check_bpf(
    p: &SteeringProgram,
    what: &str,
    frame: &[u8],
    ingress: u32,
    want: Want,
    expected: Option<(u32, &[u8])>,
) -> Option<String> {
    let (v0, f0) = counters(p);
    let out = p.test_run_on(frame, ingress, 0, 1).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    let (v1, f1) = counters(p);
    let (verdicts, reasons) = (moved(R::ALL, &v0, &v1), moved(F::ALL, &f0, &f1));
    let translated = verdicts.iter().any(|(v, _)| matches!(v, R::TxFastPath | R::RedirectFastPath));
    if want != Want::Hit && translated {
        return Some(format!("{what}: translated by the fast path but should not be ({want:?})"));
    }
    match want {
        Want::Hit => {
            let Some((oif, frame_out)) = expected else {
                return Some(format!("{what}: a hit, but the engine does not forward it"));
            };
            let (action, verdict) = if oif == ingress {
                (XdpAction::Tx, R::TxFastPath)
            } else {
                (XdpAction::Redirect, R::RedirectFastPath)
            };
            if out.action != action || verdicts != vec![(verdict, 1)] || !reasons.is_empty() {
                return Some(format!(
                    "{what}: want {action:?}/{verdict:?}, got {:?} {verdicts:?} {reasons:?}",
                    out.action
                ));
            }
            if out.frame != frame_out {
                return Some(format!(
                    "{what}: frames differ\n   engine {}\n   xdp    {}",
                    fixtures::hex(frame_out),
                    fixtures::hex(&out.frame)
                ));
            }
        }
        Want::Reason(r) => {
            if reasons != vec![(r, 1)] || out.frame != frame {
                return Some(format!(
                    "{what}: want {r:?} untouched, got {reasons:?}, frame changed: {}",
                    out.frame != frame
                ));
            }
        }
        Want::Nothing => {
            if !reasons.is_empty() || out.frame != frame {
                return Some(format!("{what}: want no fast-path counter, got {reasons:?}"));
            }
        }
    }
    None
}

/// Variants of a hit's frame that must be punted, with their reason.
fn punt_variants(f: &[u8], v6: bool, tcp: bool) -> Vec<(&'static str, Vec<u8>, F)> {
    let mut v = Vec::new();
    let l3 = 14;
    let l4 = l3 + if v6 { 40 } else { 20 };
    let fix_ip_csum = |g: &mut Vec<u8>| {
        if !v6 {
            let ihl = usize::from(g[l3] & 0xf) * 4;
            g[l3 + 10] = 0;
            g[l3 + 11] = 0;
            let c = !fold(words(&g[l3..l3 + ihl]));
            g[l3 + 10..l3 + 12].copy_from_slice(&c.to_be_bytes());
        }
    };
    let mut ttl1 = f.to_vec();
    ttl1[l3 + if v6 { 7 } else { 8 }] = 1;
    fix_ip_csum(&mut ttl1);
    v.push(("ttl 1", ttl1, F::PuntTtl));
    let mut partial = f.to_vec();
    let l4_len = if v6 { usize::from(be16(f, l3 + 4)) } else { usize::from(be16(f, l3 + 2)) - 20 };
    let pseudo =
        words(&f[if v6 { l3 + 8 } else { l3 + 12 }..l4]) + u32::from(if tcp { 6u8 } else { 17 }) + l4_len as u32;
    let at = l4 + if tcp { 16 } else { 6 };
    partial[at..at + 2].copy_from_slice(&fold(pseudo).to_be_bytes());
    v.push(("partial checksum", partial, F::PuntPartialChecksum));
    if tcp {
        for (name, bit) in [("SYN", 0x02u8), ("FIN", 0x01), ("RST", 0x04)] {
            let mut g = f.to_vec();
            g[l4 + 13] |= bit;
            v.push((name, g, F::PuntTcpControl));
        }
    }
    let mut tagged = f.to_vec();
    tagged.splice(12..12, [0x81, 0x00, 0x00, 0x64]);
    v.push(("802.1Q tag", tagged, F::SkipVlan));
    if !v6 {
        let mut frag = f.to_vec();
        frag[l3 + 6] |= 0x20;
        fix_ip_csum(&mut frag);
        v.push(("more fragments", frag, F::SkipFragment));
        let mut opts = f.to_vec();
        opts.splice(l4..l4, [1, 1, 1, 0]); // NOP NOP NOP EOL
        opts[l3] = 0x46;
        let tot = be16(&opts, l3 + 2) + 4;
        opts[l3 + 2..l3 + 4].copy_from_slice(&tot.to_be_bytes());
        fix_ip_csum(&mut opts);
        v.push(("IPv4 options", opts, F::SkipIpOptions));
        let mut bad = f.to_vec();
        bad[l3 + 10] ^= 0x5a;
        v.push(("bad IPv4 header checksum", bad, F::PuntMalformed));
    } else {
        let mut frag = f.to_vec();
        frag[l3 + 6] = 44;
        v.push(("IPv6 fragment header", frag, F::SkipFragment));
    }
    v
}

#[derive(Default)]
struct Tally {
    hits: usize,
    hits_inbound: usize,
    hits_v6: usize,
    punts: usize,
    steps: usize,
}

/// Replays one scenario; returns mismatches.
fn replay(s: &Scenario, fib: Fib, tally: &mut Tally, variants: bool) -> Vec<String> {
    let mut r = rig(&s.spec, fib);
    // As the daemon's workers do (daemon/handler.rs).
    r.worker.set_hold_fragments(true);
    let mut held = fixtures::Held::default();
    let mut errors = Vec::new();
    for (i, st) in s.steps.iter().enumerate() {
        let what = format!("{} step {i} ({})", s.name, st.what);
        let now = Timestamp::from_secs(st.at);
        r.worker.tick(now, 1 << 20);
        r.manager.run_once();
        let expected = match &st.expect {
            Expect::Forward { ifindex, frame } => Some((*ifindex, frame.as_slice())),
            _ => None,
        };
        if st.frame.len() >= 14 {
            let w = want(&r.engine, &st.frame);
            if let Some(e) = check_bpf(&r.program, &what, &st.frame, st.ingress, w, expected) {
                errors.push(e);
            }
            if w == Want::Hit {
                tally.hits += 1;
                tally.hits_inbound += usize::from(st.ingress == OUTSIDE);
                let seen = inspect(&st.frame).ok();
                let v6 = seen.is_some_and(|x| x.v6);
                tally.hits_v6 += usize::from(v6);
                if variants {
                    let tcp = seen.is_some_and(|x| x.key4.map(|k| k.proto).or(x.key6.map(|k| k.proto)) == Some(6));
                    for (name, frame, reason) in punt_variants(&st.frame, v6, tcp) {
                        tally.punts += 1;
                        let what = format!("{what} / {name}");
                        if let Some(e) = check_bpf(&r.program, &what, &frame, st.ingress, Want::Reason(reason), None) {
                            errors.push(e);
                        }
                    }
                    // The next hop unresolved: punted; resolved again: a hit.
                    // The entry this packet matches names its next hop.
                    let id = seen.and_then(|x| match (x.key4, x.key6) {
                        (Some(k), _) => r
                            .program
                            .fp_get(&FpKeyV4::new(k.src, k.dst, k.sport(), k.dport(), k.proto))
                            .unwrap()
                            .map(|e| e.next_hop),
                        (_, Some(k)) => r
                            .program
                            .fp_get(&FpKeyV6::new(k.src, k.dst, k.sport(), k.dport(), k.proto))
                            .unwrap()
                            .map(|e| e.next_hop),
                        _ => None,
                    });
                    if let Some(id) = id {
                        let keep = r.program.fp_next_hop(id).unwrap().unwrap();
                        r.program.fp_set_next_hop(id, &FpNextHop::invalid(keep.ifindex)).unwrap();
                        tally.punts += 1;
                        if let Some(e) = check_bpf(
                            &r.program,
                            &format!("{what} / next hop unresolved"),
                            &st.frame,
                            st.ingress,
                            Want::Reason(F::PuntNextHop),
                            None,
                        ) {
                            errors.push(e);
                        }
                        r.program.fp_set_next_hop(id, &keep).unwrap();
                        if keep.ifindex != expected.map_or(0, |e| e.0) {
                            errors.push(format!("{what}: next hop {id} is out of {} ", keep.ifindex));
                        }
                    } else {
                        errors.push(format!("{what}: no next hop entry towards interface {:?}", expected.map(|e| e.0)));
                    }
                }
            }
        }
        // Then the engine, which must still meet the fixture's expectation
        // (and set free what the fixture says, of what it held).
        errors.extend(fixtures::play(&mut r.worker, &mut held, s.name, i, st));
        tally.steps += 1;
    }
    // Nothing installed is left behind for a session the engine ended.
    let (v4, v6) = r.fp.installed();
    let live = r
        .engine
        .nat4()
        .sessions
        .iter()
        .chain(std::iter::empty())
        .filter(|v| v.offload & offload::INSTALLED != 0)
        .count()
        + r.engine.nat6().sessions.iter().filter(|v| v.offload & offload::INSTALLED != 0).count();
    if v4 + v6 != live {
        errors.push(format!("{}: {} sessions indexed as installed, {live} installed in the engine", s.name, v4 + v6));
    }
    let (e4, e6) = r.program.fp_entry_counts();
    if e4 + e6 != 2 * live {
        errors.push(format!("{}: {} kernel entries for {live} installed sessions", s.name, e4 + e6));
    }
    errors
}

#[test]
fn the_fixture_table_through_the_fast_path_and_the_engine() {
    let _ns = enter_ns("a");
    let mut tally = Tally::default();
    let mut errors = Vec::new();
    for s in fixtures::scenarios() {
        errors.extend(replay(&s, fixtures::topology(), &mut tally, true));
    }
    assert!(errors.is_empty(), "{} mismatches:\n{}", errors.len(), errors.join("\n"));
    eprintln!(
        "{} steps; {} translated in XDP ({} inbound, {} IPv6); {} punt variants",
        tally.steps, tally.hits, tally.hits_inbound, tally.hits_v6, tally.punts
    );
    // The table must exercise the fast path, both ways: a replay that
    // installs nothing would pass every check above.
    assert!(tally.hits >= 4 && tally.hits_inbound >= 3, "only {} hits ({} inbound)", tally.hits, tally.hits_inbound);
    assert!(tally.punts >= 30, "{} punt variants", tally.punts);
}

/// Scenarios the table lacks, in the table's own form: established TCP and
/// UDP in both families and both directions, many packets each.
fn established_flows() -> Scenario {
    use fixtures::{from_outside, from_pod, sent_in, sent_out, tcp, udp, E1, E6, POD6, POD_A, SERVER, SERVER6};
    let (p4, s4, e1) = (IpAddr::V4(POD_A), IpAddr::V4(SERVER), IpAddr::V4(E1));
    let (p6, s6, e6) = (IpAddr::V6(POD6), IpAddr::V6(SERVER6), IpAddr::V6(E6));
    let mut steps = Vec::new();
    let mut step = |what: &'static str, at, ingress, p: &build::Packet, exp: Option<build::Packet>, out: u32| {
        let expect = match exp {
            Some(e) => Expect::Forward { ifindex: out, frame: e.frame() },
            None => Expect::Pass,
        };
        steps.push(fixtures::Step { what, at, ingress, frame: p.frame(), expect, released: Vec::new() });
    };
    for (pod, server, egress, port) in [(p4, s4, e1, 42000u16), (p6, s6, e6, 42001)] {
        let syn = from_pod(pod, server, tcp(port, 443, 100, None, 0x02, b""));
        let synack = from_outside(server, egress, tcp(443, port, 900, Some(101), 0x02, b""));
        step("SYN", 0, INSIDE, &syn, Some(sent_out(&syn, egress, port)), OUTSIDE);
        step("SYN-ACK", 0, OUTSIDE, &synack, Some(sent_in(&synack, pod, port)), INSIDE);
        for k in 0..6u32 {
            let a = from_pod(pod, server, tcp(port, 443, 101 + k * 10, Some(901), 0, &[k as u8; 10]));
            step("data out", 1, INSIDE, &a, Some(sent_out(&a, egress, port)), OUTSIDE);
            let b = from_outside(server, egress, tcp(443, port, 901 + k * 7, Some(111 + k * 10), 0, &[0xee; 7]));
            step("data in", 1, OUTSIDE, &b, Some(sent_in(&b, pod, port)), INSIDE);
        }
        let q = from_pod(pod, server, udp(port, 53, b"q"));
        step("UDP query", 2, INSIDE, &q, Some(sent_out(&q, egress, port)), OUTSIDE);
        for k in 0..4u8 {
            let a = from_outside(server, egress, udp(53, port, &[k; 33]));
            step("UDP answer", 2, OUTSIDE, &a, Some(sent_in(&a, pod, port)), INSIDE);
            let b = from_pod(pod, server, udp(port, 53, &[k; 21]));
            step("UDP again", 2, INSIDE, &b, Some(sent_out(&b, egress, port)), OUTSIDE);
        }
    }
    Scenario { name: "established_flows", spec: fixtures::base_spec(), steps }
}

#[test]
fn established_flows_in_both_families_and_directions() {
    let _ns = enter_ns("b");
    let mut tally = Tally::default();
    let errors = replay(&established_flows(), fixtures::topology(), &mut tally, true);
    assert!(errors.is_empty(), "{} mismatches:\n{}", errors.len(), errors.join("\n"));
    assert!(tally.hits >= 30 && tally.hits_v6 >= 15, "{} hits, {} IPv6", tally.hits, tally.hits_v6);
}

/// One-arm: both sides on interface 2 (the inside link carries everything),
/// so translated frames go back out of the receiving interface: XDP_TX. The
/// engine's own output is the reference.
#[test]
fn one_arm_uses_xdp_tx_and_matches_the_engine() {
    use egret_dataplane::fib::{Interface, Route};
    let _ns = enter_ns("c");
    let mut fib = Fib::new();
    fib.add_interface(Interface { ifindex: INSIDE, name: "arm".into(), mac: fixtures::GW_IN, mtu: 1500 })
        .add_route(
            IpAddr::V4(Ipv4Addr::new(198, 18, 0, 0)),
            16,
            Route { oif: INSIDE, gateway: Some(fixtures::NODE.into()) },
        )
        .add_route(
            IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            0,
            Route { oif: INSIDE, gateway: Some(fixtures::UPSTREAM.into()) },
        )
        .add_neighbor(INSIDE, fixtures::NODE.into(), fixtures::NODE_MAC)
        .add_neighbor(INSIDE, fixtures::UPSTREAM.into(), fixtures::UP_MAC);
    let mut r = rig(&fixtures::base_spec(), fib);
    let out =
        fixtures::from_pod(IpAddr::V4(fixtures::POD_A), IpAddr::V4(fixtures::SERVER), fixtures::udp(40000, 53, b"q"));
    let mut back =
        fixtures::from_outside(IpAddr::V4(fixtures::SERVER), IpAddr::V4(fixtures::E1), fixtures::udp(53, 40000, b"a"));
    back.eth_dst = fixtures::GW_IN;
    let mut hits = 0;
    for (k, p) in [&out, &back, &out, &back, &out].into_iter().enumerate() {
        r.manager.run_once();
        let frame = p.frame();
        let w = want(&r.engine, &frame);
        // The engine's output for the same frame, in a copy of the state
        // that does not matter here (UDP refresh only).
        let mut buf = vec![0u8; FRAME_BUFFER];
        buf[..frame.len()].copy_from_slice(&frame);
        let v = r.worker.process(
            &mut buf,
            frame.len(),
            RxMeta { ifindex: INSIDE, checksum: ChecksumHint::Unknown },
            Timestamp::from_secs(k as u64),
        );
        let Verdict::Forward { ifindex, len } = v else { panic!("step {k}: the engine gave {v:?}") };
        assert_eq!(ifindex, INSIDE);
        if w == Want::Hit {
            hits += 1;
        }
        if let Some(e) =
            check_bpf(&r.program, &format!("one-arm step {k}"), &frame, INSIDE, w, Some((ifindex, &buf[..len])))
        {
            panic!("{e}");
        }
    }
    assert_eq!(hits, 3, "after the first reply, every packet is translated in XDP");
}

/// The overlay return path (ADR 0008): with the pods' /24 behind a link
/// Egret does not drive (flannel's `198.18.0.0/24 via 198.18.0.0 dev
/// flannel.1 onlink`), the offload manager refuses pod A's confirmed
/// session (`refused_kernel_route`), so the program translates neither of
/// its directions: every frame misses the fast path and goes to the
/// workers, whose engine hands the replies to the kernel. Pod C, natively
/// routed, in the same run: installed, and translated in XDP byte for byte
/// as the engine does.
#[test]
fn sessions_to_pods_behind_a_tunnel_stay_out_of_the_fast_path() {
    use egret_dataplane::fib::Route;
    use fixtures::{from_outside, from_pod, udp, E1, E2, POD_A, POD_C, SERVER};
    use std::sync::atomic::Ordering;
    let _ns = enter_ns("d");
    let mut fib = fixtures::topology();
    fib.add_kernel_link(9, 1450).add_route(
        IpAddr::V4(Ipv4Addr::new(198, 18, 0, 0)),
        24,
        Route { oif: 9, gateway: Some(IpAddr::V4(Ipv4Addr::new(198, 18, 0, 0))) },
    );
    let mut r = rig(&fixtures::base_spec(), fib);
    let (mut c_hits, mut a_kernel) = (0, 0);
    for k in 0..4u64 {
        // Pod A (behind the tunnel) and pod C (native): a query, then its answer.
        for (pod, egress, port) in [(POD_A, E1, 40000u16), (POD_C, E2, 40001)] {
            r.manager.run_once();
            let out = from_pod(IpAddr::V4(pod), IpAddr::V4(SERVER), udp(port, 53, b"q")).frame();
            let w = want(&r.engine, &out);
            let (v, buf) = process(&mut r, &out, INSIDE, k);
            let Verdict::Forward { ifindex, len } = v else { panic!("{pod} query {k}: the engine gave {v:?}") };
            if let Some(e) =
                check_bpf(&r.program, &format!("{pod} query {k}"), &out, INSIDE, w, Some((ifindex, &buf[..len])))
            {
                panic!("{e}");
            }
            let eport = u16::from_be_bytes([buf[34], buf[35]]);
            r.manager.run_once();
            let back = from_outside(IpAddr::V4(SERVER), IpAddr::V4(egress), udp(53, eport, b"a")).frame();
            let w = want(&r.engine, &back);
            let (v, buf) = process(&mut r, &back, OUTSIDE, k);
            let expected = match v {
                Verdict::Forward { ifindex, len } => Some((ifindex, &buf[..len])),
                Verdict::ToKernel { .. } if pod == POD_A => {
                    a_kernel += 1;
                    None
                }
                other => panic!("{pod} answer {k}: the engine gave {other:?}"),
            };
            if pod == POD_A {
                assert_eq!(w, Want::Reason(F::Miss), "pod A's session is never in the fast path");
            } else if w == Want::Hit {
                c_hits += 1;
            }
            if let Some(e) = check_bpf(&r.program, &format!("{pod} answer {k}"), &back, OUTSIDE, w, expected) {
                panic!("{e}");
            }
        }
    }
    let stats = &r.fp.stats;
    assert_eq!(a_kernel, 4, "every answer to pod A went to the kernel");
    assert_eq!(stats.refused_kernel_route.load(Ordering::Relaxed), 1, "pod A's session refused once");
    assert_eq!(stats.installed.load(Ordering::Relaxed), 1, "pod C's session installed");
    assert!(c_hits >= 2, "pod C's later answers are translated in XDP ({c_hits})");
}

/// A route that moves onto a tunnel takes an installed session out of the
/// fast path: pod A's UDP session is installed and translated in XDP with
/// the native topology; once the pods' /24 is routed through a kernel link
/// the manager withdraws it, the program no longer translates its frames,
/// and the engine hands the answers to the kernel.
#[test]
fn a_route_moving_onto_a_tunnel_withdraws_the_session() {
    use fixtures::{from_outside, from_pod, udp, E1, POD_A, SERVER};
    use std::sync::atomic::Ordering;
    let _ns = enter_ns("e");
    let mut r = rig(&fixtures::base_spec(), fixtures::topology());
    let out = from_pod(IpAddr::V4(POD_A), IpAddr::V4(SERVER), udp(40000, 53, b"q")).frame();
    let back = from_outside(IpAddr::V4(SERVER), IpAddr::V4(E1), udp(53, 40000, b"a")).frame();
    for (frame, ingress) in [(&out, INSIDE), (&back, OUTSIDE)] {
        r.manager.run_once();
        assert!(matches!(process(&mut r, frame, ingress, 0).0, Verdict::Forward { .. }));
    }
    r.manager.run_once();
    let (v, buf) = process(&mut r, &back, OUTSIDE, 1);
    let Verdict::Forward { ifindex, len } = v else { panic!("native answer: {v:?}") };
    assert_eq!(want(&r.engine, &back), Want::Hit, "installed");
    if let Some(e) = check_bpf(&r.program, "native answer", &back, OUTSIDE, Want::Hit, Some((ifindex, &buf[..len]))) {
        panic!("{e}");
    }
    let withdrawn = r.fp.stats.withdrawn.load(Ordering::Relaxed);
    r.engine.publish_fib(fixtures::overlay_topology());
    r.manager.run_once();
    assert_eq!(r.fp.stats.withdrawn.load(Ordering::Relaxed), withdrawn + 1, "withdrawn on the route change");
    let w = want(&r.engine, &back);
    assert_eq!(w, Want::Reason(F::Miss), "no longer installed");
    if let Some(e) = check_bpf(&r.program, "answer behind the tunnel", &back, OUTSIDE, w, None) {
        panic!("{e}");
    }
    assert!(matches!(process(&mut r, &back, OUTSIDE, 2).0, Verdict::ToKernel { .. }));
}

/// A dormant egress IP (issue 28 §2: fenced by its deadline, kept in the
/// tables with its sessions): `FastPath::set_expired` takes its installed
/// sessions out of the kernel, so the program no longer translates them,
/// while the engine keeps each session (its kernel stamp folded in) and
/// another egress IP's session stays in XDP. While it is expired its
/// sessions are refused (`refused_invalid`); once valid again, the next
/// confirmed packet installs them again.
#[test]
fn an_expired_egress_ip_leaves_the_fast_path_and_keeps_its_sessions() {
    use fixtures::{from_outside, from_pod, udp, E1, E2, POD_A, POD_C, SERVER};
    use std::collections::BTreeSet;
    use std::sync::atomic::Ordering;
    let _ns = enter_ns("f");
    let mut r = rig(&fixtures::base_spec(), fixtures::topology());
    let flows = [(POD_A, E1, 40000u16), (POD_C, E2, 40001)];
    let mut answers = Vec::new();
    for (pod, egress, port) in flows {
        let out = from_pod(IpAddr::V4(pod), IpAddr::V4(SERVER), udp(port, 53, b"q")).frame();
        r.manager.run_once();
        let (v, buf) = process(&mut r, &out, INSIDE, 0);
        assert!(matches!(v, Verdict::Forward { .. }), "{pod} query: {v:?}");
        let eport = u16::from_be_bytes([buf[34], buf[35]]);
        let back = from_outside(IpAddr::V4(SERVER), IpAddr::V4(egress), udp(53, eport, b"a")).frame();
        r.manager.run_once();
        assert!(matches!(process(&mut r, &back, OUTSIDE, 0).0, Verdict::Forward { .. }), "{pod} answer");
        answers.push(back);
    }
    r.manager.run_once();
    for back in &answers {
        assert_eq!(want(&r.engine, back), Want::Hit, "both installed");
    }
    let session_of = |r: &Rig, back: &[u8]| {
        let s = inspect(back).unwrap();
        r.engine.nat4().sessions.lookup(&s.key4.unwrap()).map(|(_, v)| v)
    };
    let a_before = session_of(&r, &answers[0]).expect("pod A's session");

    // E1's deadline passed.
    let out = r.fp.set_expired(&r.engine, BTreeSet::from([IpAddr::V4(E1)]));
    assert_eq!(out, 1, "pod A's session left the kernel");
    assert_eq!(r.fp.stats.expired.load(Ordering::Relaxed), 1);
    let a = session_of(&r, &answers[0]).expect("the engine keeps pod A's session");
    assert_eq!((a.index, a.seq), (a_before.index, a_before.seq), "the same session");
    assert_eq!(a.offload & offload::INSTALLED, 0);
    assert_eq!(want(&r.engine, &answers[0]), Want::Reason(F::Miss));
    if let Some(e) = check_bpf(&r.program, "E1 expired", &answers[0], OUTSIDE, Want::Reason(F::Miss), None) {
        panic!("{e}");
    }
    assert_eq!(want(&r.engine, &answers[1]), Want::Hit, "E2's session stays in XDP");
    let (v, buf) = process(&mut r, &answers[1], OUTSIDE, 1);
    let Verdict::Forward { ifindex, len } = v else { panic!("E2 answer: {v:?}") };
    if let Some(e) =
        check_bpf(&r.program, "E2 still valid", &answers[1], OUTSIDE, Want::Hit, Some((ifindex, &buf[..len])))
    {
        panic!("{e}");
    }

    // Not installed again while expired, although the engine asks.
    let refused = r.fp.stats.refused_invalid.load(Ordering::Relaxed);
    assert!(matches!(process(&mut r, &answers[0], OUTSIDE, 1).0, Verdict::Forward { .. }));
    r.manager.run_once();
    assert_eq!(r.fp.stats.refused_invalid.load(Ordering::Relaxed), refused + 1, "refused while expired");
    assert_eq!(want(&r.engine, &answers[0]), Want::Reason(F::Miss));

    // Valid again: the next answer asks, and it is installed.
    assert_eq!(r.fp.set_expired(&r.engine, BTreeSet::new()), 0);
    assert!(matches!(process(&mut r, &answers[0], OUTSIDE, 2).0, Verdict::Forward { .. }));
    r.manager.run_once();
    assert_eq!(want(&r.engine, &answers[0]), Want::Hit, "installed again");
    let a = session_of(&r, &answers[0]).unwrap();
    assert_eq!((a.index, a.seq), (a_before.index, a_before.seq), "still the same session");
}
