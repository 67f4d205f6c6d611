//! `egret-throughput`: small-packet forwarding through the kernel's SNAT
//! (with and without its flowtable), Egret (AF_XDP workers, and with its
//! XDP fast path) and a bare XDP_REDIRECT, in one run over one topology,
//! UDP datagrams or TCP segments; see docs/benchmarks-throughput.md.

use std::io::Write as _;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use egret_benches::bench::{self, BenchError, Gateway, Mode, Options, Sample, SinkSide};
use egret_benches::frame::Proto;
use egret_benches::generator::Engine;
use egret_benches::report;
use egret_benches::topology::Topology;

/// Measure 64-byte UDP (or TCP) forwarding between two veths (generator -> gateway
/// -> sink namespaces) through each mode: offered and forwarded rates, loss,
/// CPU of every gateway-side context and the per-core rate. Needs root;
/// creates and always deletes its own network namespaces.
#[derive(Debug, Parser)]
#[command(name = "egret-throughput", version)]
struct Args {
    /// Flow counts to measure (distinct source address/port pairs).
    #[arg(long, value_delimiter = ',', default_value = "1,50000")]
    flows: Vec<u32>,
    /// Length of each measurement window, seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Traffic before each window starts, seconds.
    #[arg(long, default_value_t = 2.0)]
    warmup: f64,
    /// Rounds: every mode is measured once per round, rounds interleave.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Modes, in order: kernel, kernel-flowtable (the kernel with an
    /// nftables flowtable: its software fast path), egret, fastpath,
    /// redirect, new-conns (Egret's slow path), kernel-new-conns (the
    /// kernel's, for reference),
    /// fastpath-vxlan and egret-vxlan (fastpath and egret with the pods'
    /// frames in the nodes' VXLAN tunnel, issue 30; compared with
    /// fastpath and egret when those are in the run).
    #[arg(
        long,
        alias = "mode",
        value_enum,
        value_delimiter = ',',
        default_value = "kernel,egret,fastpath,redirect,new-conns"
    )]
    modes: Vec<Mode>,
    /// Window length for the new-connection modes (after 0.5 s of
    /// warm-up): Egret's port space (about a million mappings) and the
    /// kernel's conntrack table (262,144 entries here) must outlast it.
    #[arg(long, default_value_t = 1.0)]
    new_conns_seconds: f64,
    /// The egret binary [default: `egret` beside this binary].
    #[arg(long)]
    egret: Option<PathBuf>,
    /// Traffic generator engine.
    #[arg(long, value_enum, default_value_t = Engine::Xdp)]
    engine: Engine,
    /// Offered frames per second (default: as fast as the generator goes).
    #[arg(long)]
    rate: Option<u64>,
    /// Core for the generator and the sink.
    #[arg(long, default_value_t = 0)]
    gen_cpu: usize,
    /// Core for the gateway (NAPI threads, Egret's workers).
    #[arg(long, default_value_t = 1)]
    gw_cpu: usize,
    /// Egret's metrics port (inside the gateway namespace, 127.0.0.1).
    #[arg(long, default_value_t = 19469)]
    metrics_port: u16,
    /// Leave scheduling alone (by default the gateway's NAPI threads and
    /// the generator run at nice -20 and the sink's NAPI thread SCHED_FIFO
    /// 60, so other load on the machine does not set the rates).
    #[arg(long)]
    no_priorities: bool,
    /// Egret's `xdp.fastPathSessions` (default: the daemon's, 262144): the
    /// size of the fast path's session tables (docs/fast-path.md).
    #[arg(long)]
    fast_path_sessions: Option<u32>,
    /// Frames of one flow sent in a row before the next flow's (1: the
    /// flows round-robin, every frame another flow's, the figure the
    /// targets are stated against). Default: 1 for UDP, 16 for TCP (a bulk
    /// transfer's train of segments). New-connection modes ignore it.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=65536))]
    train: Option<u32>,
    /// The frames' transport: udp (64-byte datagrams) or tcp (64-byte data
    /// segments of connections whose handshake completed before the
    /// window). New-connection and VXLAN modes always send UDP.
    #[arg(long, value_enum, default_value_t = Proto::Udp)]
    proto: Proto,
    /// The nodes' VXLAN port (`tunnel.port`) in fastpath-vxlan and
    /// egret-vxlan; those modes get NAT ports on the larger side of it
    /// (6083-65535 for 6082).
    #[arg(long, default_value_t = egret_benches::frame::TUNNEL_PORT, value_parser = clap::value_parser!(u16).range(1..))]
    tunnel_port: u16,
    /// The collectors `new-conns-translog` exports to, on the gateway
    /// namespace's loopback: UDP sockets bound there and never read, or a
    /// TCP listener whose connections a thread of the benchmark reads.
    #[arg(long, value_enum, default_value_t = egret_benches::egret::TranslogSinks::Both)]
    translog_sinks: egret_benches::egret::TranslogSinks,
    /// `new-conns-translog` with port blocks of this many ports per block
    /// (`nat.portBlocks`, a power of two from 8; `logSessions: false`, so
    /// the logs hold one record per block, RFC 7422's way). `new-conns`
    /// keeps per-session ports: the ratio includes the blocks' own cost.
    /// With the 16 egress IPs and 16,384 pod addresses of the new-flow
    /// modes, 16 leaves every pod room for a window's flows.
    #[arg(long, value_parser = port_block_size)]
    translog_port_blocks: Option<u16>,
    /// `new-conns-translog`'s `translationLogs.ringRecords`: each worker's
    /// ring of records (default: the daemon's, 65,536; 1,024 to 16 M).
    #[arg(long)]
    translog_ring_records: Option<u32>,
    /// Write samples, summaries and ratios to this file as JSON.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// `--translog-port-blocks`: the sizes `nat.portBlocks.size` accepts that
/// the new-flow modes' 16 egress IPs can give each of 16,384 pods (the
/// daemon's own check names the rest).
fn port_block_size(s: &str) -> Result<u16, String> {
    let n: u16 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
    if n.is_power_of_two() && (8..=1024).contains(&n) {
        Ok(n)
    } else {
        Err(format!("{n}: a power of two from 8 to 1024"))
    }
}

/// Removes the run's scratch directory.
struct Workdir(PathBuf);

impl Drop for Workdir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn default_egret() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("egret")))
        .unwrap_or_else(|| PathBuf::from("target/release/egret"))
}

/// What happened to an encapsulated window's frames at the gateway: the
/// XDP program's fast-path hits and misses, what the workers received and
/// decapsulated, and the tunnel's drops.
fn tunnel_note(s: &Sample) -> String {
    let hit = s.series("egret_fastpath_packets_total", "outcome", "hit");
    let miss = s.series("egret_fastpath_packets_total", "outcome", "miss");
    let decap = s.series("egret_events_total", "event", "decapsulated");
    let drops: Vec<String> =
        s.decap_drops().iter().filter(|(_, v)| *v > 0.0).map(|(k, v)| format!("{k} {v:.0}")).collect();
    format!(
        "tunnel: offered {}, sink {} ({} translated); fast path hit {hit:.0}, miss {miss:.0}; workers received {:.0}, decapsulated {decap:.0}; drops: {}",
        s.offered,
        s.sink.frames,
        s.sink.translated,
        s.worker_rx().unwrap_or(0.0),
        if drops.is_empty() { "none".to_string() } else { drops.join(", ") }
    )
}

/// Frames of one flow in a row: `--train`, else 1 for UDP and
/// [`TCP_TRAIN`] for TCP.
fn train_of(args: &Args) -> u32 {
    args.train.unwrap_or(match args.proto {
        Proto::Udp => 1,
        Proto::Tcp => TCP_TRAIN,
    })
}

/// The default train of TCP runs: 16 segments of one connection in a row
/// (a bulk sender's burst within its congestion window, or what GSO/TSO
/// hands the NIC at once).
const TCP_TRAIN: u32 = 16;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(BenchError::Interrupted) => {
            eprintln!("egret-throughput: interrupted; namespaces deleted");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("egret-throughput: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), BenchError> {
    let egret = args.egret.clone().unwrap_or_else(default_egret);
    // Egret and new-conns need the binary: say so before building anything.
    // The fast path is reported as not available instead.
    if args.modes.iter().any(|m| m.uses_egret()) {
        egret_benches::egret::locate(&egret)?;
    }
    egret_benches::sys::install_stop_handler().map_err(|source| BenchError::Pin {
        what: "signal handler".into(),
        tid: 0,
        cpu: 0,
        source,
    })?;
    let tag = format!("egtput{}", std::process::id());
    let workdir = Workdir(std::env::temp_dir().join(&tag));
    std::fs::create_dir_all(&workdir.0)
        .map_err(|source| egret_benches::egret::EgretError::Write { path: workdir.0.clone(), source })?;
    let opts = Options {
        engine: args.engine,
        gen_cpu: args.gen_cpu,
        gw_cpu: args.gw_cpu,
        seconds: args.seconds,
        warmup: args.warmup,
        new_conns_seconds: args.new_conns_seconds,
        rate: args.rate,
        egret,
        workdir: workdir.0.clone(),
        metrics_port: args.metrics_port,
        user_hz: egret_benches::sys::user_hz(),
        priorities: !args.no_priorities,
        fast_path_sessions: args.fast_path_sessions,
        train: train_of(args),
        tunnel_port: args.tunnel_port,
        proto: args.proto,
        translog_sinks: args.translog_sinks,
        translog_port_blocks: args.translog_port_blocks,
        translog_ring_records: args.translog_ring_records,
    };

    if opts.priorities {
        // The measuring thread reads /proc and the counters at the window's
        // edges: keep it from being preempted there.
        egret_benches::sys::set_nice(egret_benches::sys::gettid(), bench::BENCH_NICE)
            .map_err(|source| BenchError::Pin { what: "the measuring thread (nice)".into(), tid: 0, cpu: 0, source })?;
    }
    eprintln!("building namespaces {tag}-{{gen,gw,sink}}");
    let topo = Topology::create(&tag)?;
    let sink = SinkSide::setup(&topo, opts.gen_cpu, opts.priorities)?;
    let mut samples: Vec<Sample> = Vec::new();
    // Fast-path samples taken while the fast path was not in effect.
    let mut inactive: Vec<Sample> = Vec::new();
    let mut unavailable: Vec<(Mode, String)> = Vec::new();
    let mut next_fresh = 0u64;

    for round in 0..args.rounds {
        for &mode in &args.modes {
            if unavailable.iter().any(|(m, _)| *m == mode) {
                continue;
            }
            let gateway = match Gateway::setup(&topo, mode, &opts) {
                Ok(g) => g,
                Err(BenchError::Unavailable { reason, .. }) => {
                    eprintln!("{}: not available: {reason}", mode.name());
                    unavailable.push((mode, reason));
                    continue;
                }
                Err(BenchError::Egret(e)) if mode.fast_path() => {
                    eprintln!("{}: not available: {e}", mode.name());
                    unavailable.push((mode, e.to_string()));
                    continue;
                }
                Err(e) => return Err(e),
            };
            for n in &gateway.notes {
                eprintln!("  {n}");
            }
            let flow_list: Vec<u32> = if mode.new_flows() { vec![0] } else { args.flows.clone() };
            let mut fast_path_inactive = None;
            // TCP: each window's connections are new (their own ports).
            let mut tcp_ports = 0u32;
            for &flows in &flow_list {
                let s = bench::measure(&topo, &gateway, &sink, &opts, flows, round, &mut next_fresh, &mut tcp_ports)?;
                eprintln!(
                    "round {round} {:<16} flows {:>6}: offered {:.3} Mpps, forwarded {:.3} Mpps, loss {:.1}%, gateway {:.3} cores, {:.3} Mpps/core{}",
                    mode.name(),
                    if s.flows == 0 { "new".to_string() } else { s.flows.to_string() },
                    s.offered_mpps(),
                    s.forwarded_mpps(),
                    s.loss() * 100.0,
                    s.cpu.gateway_cpu_s / s.seconds,
                    s.per_core_mpps(),
                    match (s.invalid().is_empty(), s.problems().is_empty()) {
                        (_, true) => String::new(),
                        (true, false) => format!(" PROBLEM: {}", s.problems().join("; ")),
                        (false, false) => format!(" INVALID, PROBLEM: {}", s.problems().join("; ")),
                    }
                );
                if mode.encapsulated() {
                    eprintln!("  {}", tunnel_note(&s));
                }
                if let Some(slow) = s.slow_path {
                    eprintln!(
                        "  kernel-flowtable: {slow} packets took the forward chain in the window ({:.2}% of those forwarded)",
                        100.0 * slow as f64 / s.sink.frames.max(1) as f64
                    );
                }
                // The fast path is in effect only if established flows bypass
                // the workers: judge by what the workers received.
                if mode.fast_path() {
                    match s.worker_rx() {
                        Some(rx) if s.sink.frames > 0 && rx >= 0.5 * s.sink.frames as f64 => {
                            fast_path_inactive = Some(format!(
                                "Egret accepted xdp.fastPath: true but its workers received {rx:.0} frames for {} forwarded ({WORKER_RX}): no fast path in effect",
                                s.sink.frames,
                                WORKER_RX = egret_benches::egret::WORKER_RX_METRIC
                            ));
                        }
                        None => eprintln!(
                            "warning: Egret exports no {}; cannot tell whether the fast path is in effect",
                            egret_benches::egret::WORKER_RX_METRIC
                        ),
                        _ => {}
                    }
                }
                if fast_path_inactive.is_some() {
                    inactive.push(s);
                } else {
                    samples.push(s);
                }
            }
            drop(gateway);
            if let Some(why) = fast_path_inactive {
                eprintln!("{}: not available: {why}", mode.name());
                unavailable.push((mode, why));
            }
        }
    }
    drop(sink);
    drop(topo);

    let summaries = report::summarize(&samples);
    let ratios = report::ratios(&summaries);
    // The result table is the command's output (progress goes to stderr).
    let frames = format!(
        "frames: 64-byte {}, trains of {} (new-connection modes: UDP, a new flow per frame; VXLAN modes: UDP)\n",
        args.proto.name().to_uppercase(),
        train_of(args)
    );
    let _ = std::io::stdout().lock().write_all(frames.as_bytes());
    let _ = std::io::stdout().lock().write_all(report::table(&summaries, &ratios, &unavailable).as_bytes());
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>(),
            "kernel": std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim(),
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "engine": args.engine,
            "train": train_of(args),
            "proto": args.proto,
            "tunnel": args.modes.iter().any(|m| m.encapsulated()).then(|| serde_json::json!({
                "port": args.tunnel_port,
                "node": egret_benches::topology::NODE_IP.to_string(),
                "next_hop": egret_benches::topology::EGRESS_IP.to_string(),
            })),
            "samples": samples,
            "fastpath_inactive_samples": inactive,
            "summaries": summaries,
            "ratios": ratios,
            "unavailable": unavailable.iter().map(|(m, w)| serde_json::json!({"mode": m, "reason": w})).collect::<Vec<_>>(),
        });
        let text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        std::fs::write(path, text)
            .map_err(|source| egret_benches::egret::EgretError::Write { path: path.clone(), source })?;
    }
    Ok(())
}
