//! The instruction-count guard (issue 32): instructions the engine executes
//! per established packet and per new flow, counted by valgrind's callgrind,
//! against the figures recorded in `benches/instructions.txt`.
//!
//! Instruction counts do not depend on the machine's load, so unlike timings
//! they may be asserted in the test suite: `tests/instructions.sh` (run by
//! `tests/run.sh`) builds this example in release and runs `check`.
//!
//! ```text
//! instructions check  FILE [--runs N]             compare; exit 1 on a rise of more than 10 %
//! instructions record FILE COMMIT DATE [--runs N]  measure and rewrite FILE
//! instructions case   NAME                         one case, the process callgrind counts
//! ```
//!
//! What is counted: `check` runs each case in a process of its own under
//! `valgrind --tool=callgrind --toggle-collect=*icount_measured*`, so only the
//! measured loop (and what it calls) is counted, never the engine's set-up,
//! the sessions' creation or the frames' building. The loop processes a fixed
//! number of frames in engine batches of 64 (`common::run`, as a worker
//! runs a ring's batch); the figure is the loop's count divided by that
//! number.
//! The loop's own fixed cost (one 2 KiB buffer) is below 0.1 instruction per
//! packet at these iteration counts.
//!
//! Determinism: the workers' port generators are seeded (`worker_seeded`),
//! the frames are fixed. What is not seeded is the session and mapping
//! tables' hasher (`ahash::RandomState::new()`, random per process): hash
//! values change the probe sequences and shard choices a little from run to
//! run. docs/benchmarks.md ("Instruction counts") gives the spread seen; the
//! 10 % tolerance is far above it.
//!
//! The set-up is the criterion benchmarks' own (`benches/benches/common`), so
//! the established cases at 1,000 sessions are the work of
//! `established/outbound/1000` and `established/reply/1000` (4,096 frames
//! cycled rather than 65,536), and the new-flow cases that of `new_flow/*`.
//! 100,000 sessions (not criterion's 1M: populating a million under valgrind
//! takes minutes) adds a few seconds.

#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used)]

#[path = "../../benches/benches/common/mod.rs"]
mod common;

use std::fmt::Write as _;
use std::hint::black_box;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::process::{Command, ExitCode};

use egret_dataplane::engine::{Engine, Pipeline};
use egret_dataplane::fixtures;
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::nat::port_blocks::PortBlocks;
use egret_dataplane::tables::MappingBehavior;

/// A rise above this fraction of the recorded figure fails; a drop below it
/// is reported (re-record to keep the guard tight) but passes.
const TOLERANCE: f64 = 0.10;

/// One measured case.
struct Case {
    name: &'static str,
    /// Frames the measured loop processes.
    iters: u64,
    what: &'static str,
    setup: Setup,
}

impl Case {
    /// What one iteration is.
    fn unit(&self) -> &'static str {
        match self.setup {
            Setup::Established { .. } => "packet",
            Setup::NewFlow { .. } | Setup::NewFlowInBlocks(_) => "new flow",
            Setup::Expiry(_) => "session ended",
        }
    }
}

/// What a case's process builds before the measured loop.
enum Setup {
    /// `sessions` live sessions; frames of random ones among them, outbound or replies.
    Established { sessions: u64, reply: bool, v6: bool },
    /// A fresh engine; one frame per distinct new flow; translation logs
    /// on when `logged` (a ring holding every record: the workers' own
    /// cost); IPv6 when `v6` (the IPv4 flows in the benchmarks' IPv6
    /// prefixes, `common::Family`).
    NewFlow { mapping: MappingBehavior, logged: bool, v6: bool },
    /// As `NewFlow` (EIM, no logs), the egress IPs in block mode with these
    /// blocks, and [`BLOCK_PODS`] pods: most flows take a port in their
    /// pod's block, one in about 78 takes a block (nat/port_blocks.rs).
    NewFlowInBlocks(PortBlocks),
    /// `iters` sessions made by new flows (not counted), then the sweep
    /// that expires them all, counted; translation logs on when `true`.
    Expiry(bool),
}

const CASES: &[Case] = &[
    Case {
        name: "established_outbound_1k",
        iters: 20_000,
        what: "established UDP packet, pod to remote, 1,000 sessions (EIM)",
        setup: Setup::Established { sessions: 1000, reply: false, v6: false },
    },
    Case {
        name: "established_reply_1k",
        iters: 20_000,
        what: "established UDP reply, remote to pod, 1,000 sessions (EIM)",
        setup: Setup::Established { sessions: 1000, reply: true, v6: false },
    },
    Case {
        name: "established_v6_outbound_1k",
        iters: 20_000,
        what: "established IPv6 UDP packet, pod to remote, 1,000 sessions (EIM)",
        setup: Setup::Established { sessions: 1000, reply: false, v6: true },
    },
    Case {
        name: "established_v6_reply_1k",
        iters: 20_000,
        what: "established IPv6 UDP reply, remote to pod, 1,000 sessions (EIM)",
        setup: Setup::Established { sessions: 1000, reply: true, v6: true },
    },
    Case {
        name: "established_outbound_100k",
        iters: 20_000,
        what: "established UDP packet, pod to remote, 100,000 sessions (EIM)",
        setup: Setup::Established { sessions: 100_000, reply: false, v6: false },
    },
    Case {
        name: "established_reply_100k",
        iters: 20_000,
        what: "established UDP reply, remote to pod, 100,000 sessions (EIM)",
        setup: Setup::Established { sessions: 100_000, reply: true, v6: false },
    },
    Case {
        name: "new_flow_eim",
        iters: 5_000,
        what: "new UDP flow, endpoint-independent mapping (session and mapping made, port chosen)",
        setup: Setup::NewFlow { mapping: MappingBehavior::EndpointIndependent, logged: false, v6: false },
    },
    Case {
        name: "new_flow_eim_translog",
        iters: 5_000,
        what: "new UDP flow, endpoint-independent mapping, translation logs on (its create record pushed)",
        setup: Setup::NewFlow { mapping: MappingBehavior::EndpointIndependent, logged: true, v6: false },
    },
    Case {
        name: "expiry_eim",
        iters: 5_000,
        what: "a UDP session expired by the sweep, endpoint-independent mapping (slots visited, session and mapping removed)",
        setup: Setup::Expiry(false),
    },
    Case {
        name: "expiry_eim_translog",
        iters: 5_000,
        what: "a UDP session expired by the sweep, translation logs on (its delete record pushed)",
        setup: Setup::Expiry(true),
    },
    Case {
        name: "new_flow_eim_blocks",
        iters: 5_000,
        what: "new UDP flow, endpoint-independent mapping, port blocks of 128 (64 pods: a port in the pod's block)",
        setup: Setup::NewFlowInBlocks(PortBlocks { size: 128, max_per_pod: 4, log_sessions: false }),
    },
    Case {
        name: "new_flow_v6_eim",
        iters: 5_000,
        what: "new IPv6 UDP flow, endpoint-independent mapping (session and mapping made, port chosen)",
        setup: Setup::NewFlow { mapping: MappingBehavior::EndpointIndependent, logged: false, v6: true },
    },
    Case {
        name: "new_flow_edm",
        iters: 5_000,
        what: "new UDP flow, endpoint-dependent mapping (session made, port chosen)",
        setup: Setup::NewFlow { mapping: MappingBehavior::EndpointDependent, logged: false, v6: false },
    },
];

/// Frames cycled through by the established cases (random flows among the sessions).
const ESTABLISHED_FRAMES: usize = 4096;

/// Pods of the block-mode new-flow case: 5,000 flows are about 78 a pod,
/// within one block of 128.
const BLOCK_PODS: u64 = 64;

/// The measured loop: callgrind counts this function and what it calls
/// (`--toggle-collect=*icount_measured*`), nothing else.
#[inline(never)]
fn icount_measured(w: &mut Pipeline, frames: &[Vec<u8>], ingress: u32, iters: u64) -> u64 {
    common::run(w, frames, ingress, iters, 1)
}

/// The measured sweep: ticks at `now` until no session is left; returns
/// the sessions it ended.
#[inline(never)]
fn icount_measured_sweep(w: &mut Pipeline, engine: &Engine, now: egret_dataplane::clock::Timestamp) -> u64 {
    let before = engine.nat4().sessions.len() as u64;
    while !engine.nat4().sessions.is_empty() {
        w.tick(now, 1024);
    }
    before
}

/// Runs case `name` once: set-up, then the measured loop. Fails when a frame
/// is not forwarded (a dropped frame costs less: the count would be wrong).
fn run_case(name: &str) -> Result<(), String> {
    let case = CASES.iter().find(|c| c.name == name).ok_or_else(|| format!("no case {name}"))?;
    let forwarded = match case.setup {
        Setup::Established { sessions: n, reply, v6: false } => established::<Ipv4Addr>(case, n, reply),
        Setup::Established { sessions: n, reply, v6: true } => established::<Ipv6Addr>(case, n, reply),
        Setup::NewFlow { mapping, logged, v6: false } => new_flows::<Ipv4Addr>(case, mapping, logged, None, 4096),
        Setup::NewFlow { mapping, logged, v6: true } => new_flows::<Ipv6Addr>(case, mapping, logged, None, 4096),
        Setup::NewFlowInBlocks(blocks) => {
            new_flows::<Ipv4Addr>(case, MappingBehavior::EndpointIndependent, false, Some(blocks), BLOCK_PODS)
        }
        Setup::Expiry(logged) => {
            let mapping = MappingBehavior::EndpointIndependent;
            let engine = Engine::new(&common::spec((case.iters as usize + 1024) * 2, mapping)).unwrap();
            engine.publish_fib(fixtures::topology());
            if logged {
                assert!(engine.enable_translog(2 * case.iters as usize + 16));
            }
            let mut w = engine.pipeline_seeded(PortRng::new(3));
            let frames: Vec<Vec<u8>> = (0..case.iters)
                .map(|i| {
                    let (pod, pp, remote, rp) = common::flow(i, 4096, 1000, 1_000_000);
                    fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18])).frame()
                })
                .collect();
            let made = common::run(&mut w, &frames, fixtures::INSIDE, case.iters, 1);
            if made != case.iters {
                return Err(format!("{name}: {made} of {} sessions made", case.iters));
            }
            // Idle far past the UDP timeout.
            icount_measured_sweep(&mut w, &engine, egret_dataplane::clock::Timestamp::from_secs(100_000))
        }
    };
    if forwarded != case.iters {
        return Err(format!("{name}: {forwarded} of {} frames forwarded (all must be)", case.iters));
    }
    Ok(())
}

/// An established case of family `A`: `n` sessions, then the measured
/// loop over their outbound (or reply) frames.
fn established<A: common::Family>(case: &Case, n: u64, reply: bool) -> u64 {
    let (engine, mut w, sh) = common::populated_in::<A>(n, MappingBehavior::EndpointIndependent);
    let (out, back) = common::frames_in::<A>(&engine, n, sh, ESTABLISHED_FRAMES, 9);
    let (frames, ingress) = if reply { (back, fixtures::OUTSIDE) } else { (out, fixtures::INSIDE) };
    icount_measured(&mut w, black_box(&frames), ingress, case.iters)
}

/// A new-flow case of family `A`, as the criterion benchmark `new_flow`: a
/// fresh engine, one frame per distinct new flow of `pods` pods, built
/// before the loop; returns the frames forwarded.
fn new_flows<A: common::Family>(
    case: &Case,
    mapping: MappingBehavior,
    logged: bool,
    blocks: Option<PortBlocks>,
    pods: u64,
) -> u64 {
    let mut spec = common::spec_in::<A>((case.iters as usize + 1024) * 2, mapping);
    spec.nat.port_blocks = blocks;
    let engine = Engine::new(&spec).unwrap();
    engine.publish_fib(fixtures::topology());
    if logged {
        assert!(engine.enable_translog(case.iters as usize + 16));
    }
    warm_pools::<A>(&engine, &spec);
    // The session slab's chunks too: one is a 2 MiB page written once
    // (`rep stos`, which callgrind counts per iteration: 2.1 million for
    // 43,690 slots), more than 400 instructions a flow if charged to these.
    A::nat(&engine).sessions.make_chunks(case.iters as usize);
    let mut w = engine.pipeline_seeded(PortRng::new(3));
    let frames: Vec<Vec<u8>> = (0..case.iters)
        .map(|i| {
            let (pod, pp, remote, rp) = common::flow(i, pods, 1000, 1_000_000);
            let (pod, remote) = (A::of(pod), A::of(remote));
            fixtures::from_pod(pod.into(), remote.into(), fixtures::udp(pp, rp, &[0u8; 18])).frame()
        })
        .collect();
    let forwarded = icount_measured(&mut w, black_box(&frames), fixtures::INSIDE, case.iters);
    if blocks.is_some() {
        // The case measures block mode only if the flows took blocks.
        let held: u32 = A::nat(&engine).block_pools().iter().map(|b| b.taken()).sum();
        assert!(held as u64 >= pods, "{}: {held} blocks held by {pods} pods", case.name);
    }
    forwarded
}

/// Creates the port pool of every egress IP for UDP before the measured
/// loop. A pool is made once, on its (egress IP, protocol)'s first flow,
/// and its reverse table of 64,512 owner cells costs about 140,000
/// instructions to build: 64 of them in 5,000 flows were 23 % of the count,
/// which hid a rise of the work every flow does (10 % of it read as 7 %).
fn warm_pools<A: common::Family>(engine: &Engine, spec: &egret_dataplane::tables::TablesSpec) {
    let tables = engine.tables();
    for e in &spec.egress_ips {
        let (Some(ip), Some(entry)) = (A::from_ip(e.ip), tables.egress(e.ip)) else { continue };
        A::nat(engine).mappings.pool(ip, egret_dataplane::nat::key::proto::UDP, entry.ports, tables.generation);
    }
}

/// One recorded figure.
#[derive(Clone, Debug, PartialEq)]
struct Recorded {
    case: String,
    per_packet: f64,
    commit: String,
    date: String,
}

/// Parses the figures file: `case instructions commit date` per line, `#` comments.
fn parse_recorded(text: &str) -> Result<Vec<Recorded>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        let [case, n, commit, date] = f[..] else {
            return Err(format!("line {}: want `case instructions commit date`, got {line:?}", i + 1));
        };
        let per_packet: f64 = n.parse().map_err(|_| format!("line {}: {n:?} is not a number", i + 1))?;
        out.push(Recorded { case: case.into(), per_packet, commit: commit.into(), date: date.into() });
    }
    Ok(out)
}

/// The figures file's text.
fn render(figures: &[Recorded]) -> String {
    let mut s = String::from(
        "# Instructions the engine executes per packet (established) or per new flow,\n\
         # counted by callgrind: tests/instructions.sh (run by tests/run.sh) fails when\n\
         # a case rises more than 10 % above its figure here. After a change to the\n\
         # engine, re-record with `tests/instructions.sh --record` and commit this file.\n\
         # Cases: dataplane/examples/instructions.rs. Release profile, valgrind 3.19.\n\
         #\n\
         # case                      instructions  commit        date (UTC)\n",
    );
    for r in figures {
        let _ = writeln!(s, "{:<27} {:>12.1}  {:<13} {}", r.case, r.per_packet, r.commit, r.date);
    }
    s
}

/// How a measured figure stands against the recorded one.
#[derive(Debug, PartialEq)]
enum Verdict {
    Within,
    /// More than `TOLERANCE` above: fails.
    Rise,
    /// More than `TOLERANCE` below: reported, passes.
    Drop,
}

fn compare(recorded: f64, measured: f64) -> Verdict {
    if measured > recorded * (1.0 + TOLERANCE) {
        Verdict::Rise
    } else if measured < recorded * (1.0 - TOLERANCE) {
        Verdict::Drop
    } else {
        Verdict::Within
    }
}

/// The collected instruction count in a callgrind output file (its `totals:`
/// line, or `summary:` in older formats).
fn callgrind_total(text: &str) -> Option<u64> {
    let line =
        text.lines().find(|l| l.starts_with("totals:")).or_else(|| text.lines().find(|l| l.starts_with("summary:")))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Runs `case` under callgrind: instructions per iteration of the measured loop.
fn measure(exe: &Path, case: &Case) -> Result<f64, String> {
    let dir = std::env::temp_dir();
    let out = dir.join(format!("egret-icount-{}-{}.callgrind", std::process::id(), case.name));
    let status = Command::new("valgrind")
        .arg("--tool=callgrind")
        .arg("--toggle-collect=*icount_measured*")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg("--quiet")
        .arg(exe)
        .args(["case", case.name])
        .status()
        .map_err(|e| format!("cannot run valgrind: {e} (package valgrind: run tests/install-deps.sh)"))?;
    let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()));
    let _ = std::fs::remove_file(&out);
    if !status.success() {
        return Err(format!("{}: the case failed under valgrind ({status})", case.name));
    }
    let total = callgrind_total(&text?).ok_or_else(|| format!("{}: no totals in callgrind's output", case.name))?;
    if total == 0 {
        return Err(format!("{}: callgrind counted nothing: was icount_measured renamed or inlined?", case.name));
    }
    Ok(total as f64 / case.iters as f64)
}

/// Measures every case `runs` times: the median of each, with the spread
/// ((max - min) / median) when `runs` > 1.
fn measure_all(runs: usize) -> Result<Vec<(&'static Case, f64)>, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let mut out = Vec::new();
    for case in CASES {
        let mut v = (0..runs).map(|_| measure(&exe, case)).collect::<Result<Vec<f64>, String>>()?;
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        if runs > 1 {
            let spread = (v[v.len() - 1] - v[0]) / median * 100.0;
            println!("  {:<27} {runs} runs: {:.1} .. {:.1}, spread {spread:.3} %", case.name, v[0], v[v.len() - 1]);
        }
        out.push((case, median));
    }
    Ok(out)
}

fn check(file: &Path, runs: usize) -> Result<bool, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let recorded = parse_recorded(&text).map_err(|e| format!("{}: {e}", file.display()))?;
    let measured = measure_all(runs)?;
    let mut failed = Vec::new();
    println!("  {:<27} {:>10} {:>10} {:>8}", "case", "recorded", "measured", "change");
    for (case, m) in &measured {
        let Some(r) = recorded.iter().find(|r| r.case == case.name) else {
            println!("  {:<27} {:>10} {m:>10.1}", case.name, "-");
            println!(
                "FAIL {}: no figure in {} (record one: tests/instructions.sh --record)",
                case.name,
                file.display()
            );
            failed.push(case.name);
            continue;
        };
        let change = (m / r.per_packet - 1.0) * 100.0;
        println!("  {:<27} {:>10.1} {m:>10.1} {change:>+7.2}%", case.name, r.per_packet);
        match compare(r.per_packet, *m) {
            Verdict::Within => {}
            Verdict::Rise => {
                println!(
                    "FAIL {}: {m:.1} instructions per {}, {change:+.1}% above the {:.1} recorded at {} ({}); \
                     the limit is +{:.0}%. {}. If the rise is intended, re-record: tests/instructions.sh --record",
                    case.name,
                    case.unit(),
                    r.per_packet,
                    r.commit,
                    r.date,
                    TOLERANCE * 100.0,
                    case.what
                );
                failed.push(case.name);
            }
            Verdict::Drop => println!(
                "note {}: {change:+.1}% below the recorded {:.1} (not a failure); re-record to keep the guard \
                 tight: tests/instructions.sh --record",
                case.name, r.per_packet
            ),
        }
    }
    for r in recorded.iter().filter(|r| CASES.iter().all(|c| c.name != r.case)) {
        println!("note: {} has a figure but no case (stale line in {})", r.case, file.display());
    }
    if failed.is_empty() {
        println!("no case rose more than {:.0}% above {}", TOLERANCE * 100.0, file.display());
    } else {
        eprintln!(
            "instructions: {} of {} cases rose more than {:.0}% above {} (or have no figure): {}",
            failed.len(),
            measured.len(),
            TOLERANCE * 100.0,
            file.display(),
            failed.join(", ")
        );
    }
    Ok(failed.is_empty())
}

fn record(file: &Path, commit: &str, date: &str, runs: usize) -> Result<(), String> {
    let figures: Vec<Recorded> = measure_all(runs)?
        .into_iter()
        .map(|(c, m)| Recorded { case: c.name.into(), per_packet: m, commit: commit.into(), date: date.into() })
        .collect();
    std::fs::write(file, render(&figures)).map_err(|e| format!("{}: {e}", file.display()))?;
    for r in &figures {
        println!("  {:<27} {:>10.1}", r.case, r.per_packet);
    }
    println!("recorded in {}", file.display());
    Ok(())
}

/// `--runs N` at the end of the arguments, or 1.
fn runs(args: &[String]) -> Result<usize, String> {
    match args {
        [.., flag, n] if flag == "--runs" => n.parse().ok().filter(|&n| n > 0).ok_or_else(|| format!("--runs {n}")),
        _ => Ok(1),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("case") if args.len() == 2 => run_case(&args[1]).map(|()| true),
        Some("check") if args.len() >= 2 => runs(&args).and_then(|n| check(Path::new(&args[1]), n)),
        Some("record") if args.len() >= 4 => {
            runs(&args).and_then(|n| record(Path::new(&args[1]), &args[2], &args[3], n)).map(|()| true)
        }
        _ => Err("usage: instructions check FILE [--runs N] | record FILE COMMIT DATE [--runs N] | case NAME".into()),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("instructions: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rise_over_ten_percent_fails_a_drop_is_only_reported() {
        assert_eq!(compare(1000.0, 1000.0), Verdict::Within);
        assert_eq!(compare(1000.0, 1099.0), Verdict::Within);
        assert_eq!(compare(1000.0, 1101.0), Verdict::Rise);
        assert_eq!(compare(1000.0, 901.0), Verdict::Within);
        assert_eq!(compare(1000.0, 899.0), Verdict::Drop);
    }

    #[test]
    fn the_file_round_trips() {
        let figures = vec![
            Recorded {
                case: "established_outbound_1k".into(),
                per_packet: 612.26,
                commit: "abc1234".into(),
                date: "2026-12-01".into(),
            },
            Recorded {
                case: "new_flow_eim".into(),
                per_packet: 4321.0,
                commit: "abc1234-dirty".into(),
                date: "2026-12-01".into(),
            },
        ];
        let parsed = parse_recorded(&render(&figures)).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!(parsed[0].case, "established_outbound_1k");
        assert!((parsed[0].per_packet - 612.3).abs() < 1e-9, "one decimal kept");
        assert_eq!(parsed[1], figures[1]);
    }

    #[test]
    fn a_damaged_line_is_named() {
        let e = parse_recorded("# comment\nnew_flow_eim 12x abc 2026-12-01\n").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = parse_recorded("new_flow_eim 12\n").unwrap_err();
        assert!(e.contains("line 1"), "{e}");
    }

    #[test]
    fn callgrind_totals_are_read() {
        let out =
            "version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nsummary: 123\nfn=(1) main\n5 7\ntotals: 12345678\n";
        assert_eq!(callgrind_total(out), Some(12_345_678));
        assert_eq!(callgrind_total("events: Ir\nsummary: 99\n"), Some(99));
        assert_eq!(callgrind_total("events: Ir\n"), None);
    }

    #[test]
    fn runs_is_read() {
        assert_eq!(runs(&["check".into(), "f".into(), "--runs".into(), "5".into()]), Ok(5));
        assert_eq!(runs(&["check".into(), "f".into()]), Ok(1));
        assert!(runs(&["check".into(), "f".into(), "--runs".into(), "0".into()]).is_err());
    }
}
