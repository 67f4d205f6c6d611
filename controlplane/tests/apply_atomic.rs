//! An apply through the daemon's sink (`daemon/sink.rs`) is whole or
//! refused (issue 14, item 1): the engine's tables, the loaded XDP
//! program's maps and the kernel's fail-closed table never end up out of
//! step.
//!
//! A real program is loaded with a small `policy_sources` (4 per family),
//! so a refusal needs only a few pods; frames run through it with
//! BPF_PROG_TEST_RUN (no AF_XDP socket here: a steered frame is dropped by
//! rule 7, an unselected one passed). The fail-closed table is recorded
//! instead of installed (`GatewaySink::with_rules_installer`), so the test
//! sees exactly which classification the kernel would drop. Root only (BPF).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use egret_bpf::{LoadOptions, PolicyEntryCounts, SteeringProgram, VerdictReason as R, XdpAction};
use egret_controlplane::daemon::sink::GatewaySink;
use egret_controlplane::failclosed::{ruleset, FailClosedError};
use egret_controlplane::sink::{ApplyError, TablesSink};
use egret_dataplane::clock::EngineClock;
use egret_dataplane::engine::Engine;
use egret_dataplane::policy::Decision;
use egret_dataplane::tables::{EgressIpSpec, PolicySpec, TablesSpec};

const EGRESS_A: &str = "203.0.113.10";
const EGRESS_B: &str = "203.0.113.11";
const REMOTE: [u8; 4] = [192, 0, 2, 1];
/// Selected by the first configuration.
const OLD_POD: [u8; 4] = [198, 18, 0, 1];
/// Selected only by the second.
const NEW_POD: [u8; 4] = [198, 18, 0, 3];

fn spec(pods: &[&str], held: &[&str]) -> TablesSpec {
    let mut a: Vec<_> = pods.iter().map(|p| format!("{p}/32").parse().unwrap()).collect();
    a.sort();
    TablesSpec {
        policies: vec![
            PolicySpec {
                name: "a".into(),
                sources: a,
                destinations: vec!["0.0.0.0/0".parse().unwrap()],
                except: vec![],
                egress_ips: vec![EGRESS_A.parse().unwrap()],
            },
            PolicySpec {
                name: "b".into(),
                sources: vec!["198.18.1.0/24".parse().unwrap()],
                destinations: vec!["0.0.0.0/0".parse().unwrap()],
                except: vec![],
                egress_ips: vec![EGRESS_B.parse().unwrap()],
            },
        ],
        egress_ips: held
            .iter()
            .map(|ip| EgressIpSpec { ip: ip.parse().unwrap(), ports: None, answer_neighbor: true, port_blocks: None })
            .collect(),
        ..TablesSpec::default()
    }
}

/// The first configuration: two pods of policy "a", both egress IPs held
/// (3 source prefixes: room for one more with the capacity of 4).
fn first() -> TablesSpec {
    spec(&["198.18.0.1", "198.18.0.2"], &[EGRESS_A, EGRESS_B])
}

/// Three more pods (6 source prefixes with the old ones: too many), and
/// egress IP B given up (its Lease lost).
fn too_large() -> TablesSpec {
    spec(&["198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4", "198.18.0.5"], &[EGRESS_A])
}

/// One more pod (fits), and egress IP B given up.
fn one_more() -> TablesSpec {
    spec(&["198.18.0.1", "198.18.0.2", "198.18.0.3"], &[EGRESS_A])
}

/// The fail-closed tables "installed", and whether installing fails.
#[derive(Default)]
struct Kernel {
    installed: Mutex<Vec<String>>,
    fail: AtomicBool,
    /// The policy map counts and the engine's generation seen when each
    /// install ran.
    seen: Mutex<Vec<(PolicyEntryCounts, u64)>>,
}

struct Rig {
    engine: Engine,
    program: Arc<SteeringProgram>,
    sink: GatewaySink,
    kernel: Arc<Kernel>,
}

fn rig() -> Rig {
    let engine = Engine::new(&TablesSpec::default()).unwrap();
    let program = Arc::new(SteeringProgram::load(LoadOptions { policy_sources: 4, ..LoadOptions::default() }).unwrap());
    let kernel = Arc::new(Kernel::default());
    let (k, p, e) = (kernel.clone(), program.clone(), engine.clone());
    let sink = GatewaySink::new(
        engine.clone(),
        program.clone(),
        Vec::new(),
        Arc::default(),
        None,
        EngineClock::new(Instant::now(), 1),
    )
    .with_rules_installer(Box::new(move |tables| {
        k.seen.lock().unwrap().push((p.policy_entry_counts(), e.tables().generation));
        if k.fail.load(Ordering::SeqCst) {
            return Err(FailClosedError::Refused("Error: Could not process rule: No such file or directory".into()));
        }
        k.installed.lock().unwrap().push(ruleset(tables));
        Ok(())
    }));
    Rig { engine, program, sink, kernel }
}

/// An IPv4/UDP frame from `src` to `dst` (header checksum filled in).
fn udp4(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 0x01, 0x02, 0, 0, 0, 0, 0x02, 0x08, 0x00];
    let payload = [0xabu8; 16];
    let total = (20 + 8 + payload.len()) as u16;
    let mut ip = vec![0x45, 0, 0, 0, 0, 1, 0, 0, 64, 17, 0, 0];
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip.extend_from_slice(&src);
    ip.extend_from_slice(&dst);
    let sum = ip.chunks(2).map(|w| u32::from(u16::from_be_bytes([w[0], w[1]]))).sum::<u32>();
    let sum = (sum & 0xffff) + (sum >> 16);
    let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
    ip[10..12].copy_from_slice(&sum.to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&40000u16.to_be_bytes());
    f.extend_from_slice(&443u16.to_be_bytes());
    f.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&payload);
    f
}

/// What the XDP program does with a frame from `pod`, and the reason counted.
fn xdp(program: &SteeringProgram, pod: [u8; 4]) -> (XdpAction, R) {
    let before = program.verdict_counters().unwrap();
    let out = program.test_run(&udp4(pod, REMOTE)).unwrap();
    let after = program.verdict_counters().unwrap();
    let moved: Vec<R> = before.iter().zip(&after).filter(|(b, a)| a.1 != b.1).map(|(_, a)| a.0).collect();
    assert_eq!(moved.len(), 1, "exactly one reason counted: {moved:?}");
    (out.action, moved[0])
}

fn engine_decides(engine: &Engine, pod: [u8; 4]) -> Decision {
    engine.tables().classify::<Ipv4Addr>(Ipv4Addr::from(pod), Ipv4Addr::from(REMOTE))
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// What an IPv4 packet from `src` to `dst` meets in a fail-closed ruleset
/// (controlplane/src/failclosed.rs): the verdict of the source's class's
/// destination map, or None where it is accepted (an unselected source, an
/// unmatched destination). Reads the maps as the kernel would look them up.
fn kernel_verdict(ruleset: &str, src: [u8; 4], dst: [u8; 4]) -> Option<String> {
    let lookup = |map: &str, addr: Ipv4Addr| -> Option<String> {
        let body = ruleset.split(&format!("map {map} {{")).nth(1)?.split('}').next()?;
        let elements = body.split("elements = {").nth(1)?;
        elements.split(',').find_map(|e| {
            let (range, verdict) = e.split_once(" : ")?;
            let (lo, hi) = range.trim().split_once('-').unwrap_or((range.trim(), range.trim()));
            let (lo, hi): (Ipv4Addr, Ipv4Addr) = (lo.parse().unwrap(), hi.parse().unwrap());
            (lo <= addr && addr <= hi).then(|| verdict.trim().to_string())
        })
    };
    let class = lookup("sources4", Ipv4Addr::from(src))?;
    let class = class.strip_prefix("jump ").expect("a source maps to a class chain");
    lookup(&format!("{class}_dst"), Ipv4Addr::from(dst))
}

/// The state the first configuration left, unchanged but for egress IP B.
fn assert_first_state_without_b(r: &Rig, generation_before: u64) {
    // The engine: the old classification (a new generation, for the given-up IP only).
    assert!(r.engine.tables().generation > generation_before);
    assert!(matches!(engine_decides(&r.engine, OLD_POD), Decision::Steer(_)));
    assert_eq!(engine_decides(&r.engine, NEW_POD), Decision::Unselected);
    assert!(r.engine.tables().owns_egress(ip(EGRESS_A)));
    assert!(!r.engine.tables().owns_egress(ip(EGRESS_B)), "a refused apply still gives up the IP it no longer holds");
    // The maps: the old policy entries, B no longer owned.
    assert_eq!(r.program.policy_entry_counts().src_v4, 3);
    assert!(r.program.owned(ip(EGRESS_A)).unwrap().is_some());
    assert_eq!(r.program.owned(ip(EGRESS_B)).unwrap(), None);
    assert_eq!(r.sink.owned().keys().copied().collect::<Vec<_>>(), vec![ip(EGRESS_A)]);
    // XDP: the old pod still steered (dropped here: no socket), the new one not.
    assert_eq!(xdp(&r.program, OLD_POD), (XdpAction::Drop, R::DropNoSocketSteered));
    assert_eq!(xdp(&r.program, NEW_POD), (XdpAction::Pass, R::PassUnselectedSource));
}

#[test]
fn an_apply_too_large_for_the_maps_changes_neither_engine_nor_maps_and_the_kernel_drops_the_new_pods() {
    let r = rig();
    r.sink.apply(&first()).unwrap();
    assert_eq!(r.kernel.installed.lock().unwrap().len(), 1);
    let generation = r.engine.tables().generation;

    let err = r.sink.apply(&too_large()).unwrap_err();
    assert!(matches!(err, ApplyError::TooLarge { fail_closed: Ok(()), .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("policy_src_v4") && msg.contains("capacity of 4"), "{msg}");
    assert!(msg.contains("the previous configuration stays") && msg.contains("given up: 203.0.113.11"), "{msg}");
    assert_eq!(r.sink.apply_failures.load(Ordering::Relaxed), 1);
    assert_eq!(r.sink.applied.load(Ordering::Relaxed), 1);
    assert_first_state_without_b(&r, generation);

    // XDP passes the new pod (its maps could not take it), so the kernel's
    // table must drop it: it was replaced with the new configuration's.
    let installed = r.kernel.installed.lock().unwrap().clone();
    assert_eq!(installed.len(), 2);
    assert_eq!(
        kernel_verdict(&installed[1], NEW_POD, REMOTE).as_deref(),
        Some("jump policy_0"),
        "the kernel must drop the newly selected pod: {}",
        installed[1]
    );
    assert_eq!(kernel_verdict(&installed[1], [198, 18, 0, 9], REMOTE), None, "{}", installed[1]);

    // Once it fits, it applies whole.
    r.sink.apply(&one_more()).unwrap();
    assert!(matches!(engine_decides(&r.engine, NEW_POD), Decision::Steer(_)));
    assert_eq!(r.program.policy_entry_counts().src_v4, 4);
    assert_eq!(xdp(&r.program, NEW_POD), (XdpAction::Drop, R::DropNoSocketSteered));
}

#[test]
fn a_failing_fail_closed_install_leaves_the_previous_state() {
    let r = rig();
    r.sink.apply(&first()).unwrap();
    let generation = r.engine.tables().generation;
    r.kernel.fail.store(true, Ordering::SeqCst);

    let err = r.sink.apply(&one_more()).unwrap_err();
    assert!(matches!(err, ApplyError::FailClosed { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("fail-closed rules not installed") && msg.contains("the previous configuration stays"),
        "{msg}"
    );
    assert_eq!(r.sink.fail_closed_errors.load(Ordering::Relaxed), 1);
    assert_eq!(r.sink.apply_failures.load(Ordering::Relaxed), 1);
    // The kernel's table is still the first configuration's, and so is
    // everything else (but the given-up egress IP).
    assert_eq!(*r.kernel.installed.lock().unwrap(), vec![ruleset(&r.engine.tables())]);
    assert_first_state_without_b(&r, generation);

    r.kernel.fail.store(false, Ordering::SeqCst);
    r.sink.apply(&one_more()).unwrap();
    assert_eq!(xdp(&r.program, NEW_POD), (XdpAction::Drop, R::DropNoSocketSteered));
}

#[test]
fn the_fail_closed_table_is_installed_before_the_maps_and_the_engine_change() {
    let r = rig();
    r.sink.apply(&first()).unwrap();
    let generation = r.engine.tables().generation;
    r.sink.apply(&one_more()).unwrap();
    let seen = r.kernel.seen.lock().unwrap().clone();
    // When the second table was installed, the maps and the engine still
    // held the first configuration.
    assert_eq!(seen[1].0.src_v4, 3);
    assert_eq!(seen[1].1, generation);
    assert_eq!(r.program.policy_entry_counts().src_v4, 4);
    assert!(r.engine.tables().generation > generation);
}
