//! One benchmark run: the modes (what forwards between the gateway's two
//! veths), their setup and teardown, the placement of every context on its
//! core, and the measurement window.
//!
//! Placement (2 cores): the generator thread and the sink's threaded NAPI
//! on the generator core; everything of the gateway on the gateway core:
//! the threaded NAPI kthreads of `gwin`/`gwout` (pinned here after every
//! change that may re-create them), Egret's workers (pinned by Egret from
//! its config, `SCHED_FIFO` 50), and the core's `ksoftirqd`.
//!
//! A window: start the generator, wait out the warm-up, snapshot (time,
//! frames offered, sink counters, /proc of every watched thread and both
//! cores), wait `seconds`, snapshot again, stop the generator.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::cpu::{self, Snapshot, Watched, WindowUse};
use crate::egret::{self, BenchConfig, Daemon, EgretError};
use crate::frame::{FlowSet, FrameSpec, Proto, VxlanSpec};
use crate::generator::{self as generator, Engine, GenError, GenSpec, Running};
use crate::napi::{self, NapiError};
use crate::topology::{self, in_netns, LinkCounters, NetnsError, Topology, TopologyError, GW_IN, GW_OUT};
use crate::xdp::{self, Pass, Redirect, Sink, SinkCounts, XdpError};

/// What forwards the frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// The kernel: ip_forward and nftables `snat to` the egress IP.
    Kernel,
    /// `kernel` plus an nftables flowtable on both of the gateway's
    /// interfaces: established flows take the kernel's software fast path
    /// (issue 32).
    KernelFlowtable,
    /// Egret with `xdp.fastPath: false` (AF_XDP workers).
    Egret,
    /// Egret with `xdp.fastPath: true` (issue 5).
    Fastpath,
    /// A bare XDP program: rewrite MACs, bpf_redirect (the ceiling).
    Redirect,
    /// New UDP flows per second through Egret's slow path.
    NewConns,
    /// New UDP flows per second through the kernel's conntrack + SNAT.
    KernelNewConns,
    /// `new-conns` with translation logs on (issue 34, ADR 0034): every
    /// session's creation and end exported as IPFIX and syslog to the
    /// gateway namespace's loopback (`collector.rs`: UDP sockets bound
    /// there and never read, or a TCP listener whose connections are read).
    NewConnsTranslog,
    /// `fastpath` with every frame sent as a worker node in another subnet
    /// sends it: in Egret's VXLAN tunnel (issue 30, ADR 0031). The XDP
    /// program checks, strips and translates established flows itself.
    FastpathVxlan,
    /// `egret` (fast path off) with the frames in the tunnel: the workers
    /// decapsulate and translate.
    EgretVxlan,
}

impl Mode {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Kernel => "kernel",
            Mode::KernelFlowtable => "kernel-flowtable",
            Mode::Egret => "egret",
            Mode::Fastpath => "fastpath",
            Mode::Redirect => "redirect",
            Mode::NewConns => "new-conns",
            Mode::KernelNewConns => "kernel-new-conns",
            Mode::NewConnsTranslog => "new-conns-translog",
            Mode::FastpathVxlan => "fastpath-vxlan",
            Mode::EgretVxlan => "egret-vxlan",
        }
    }

    /// Whether Egret runs with its XDP fast path on.
    pub fn fast_path(self) -> bool {
        matches!(self, Mode::Fastpath | Mode::FastpathVxlan)
    }

    /// Whether the generator sends its frames in the nodes' VXLAN tunnel.
    pub fn encapsulated(self) -> bool {
        matches!(self, Mode::FastpathVxlan | Mode::EgretVxlan)
    }

    /// The mode that forwards the same frames sent on-link (itself for
    /// on-link modes): what an encapsulated mode is compared with.
    pub fn on_link(self) -> Mode {
        match self {
            Mode::FastpathVxlan => Mode::Fastpath,
            Mode::EgretVxlan => Mode::Egret,
            m => m,
        }
    }

    /// Whether every frame is a new flow.
    pub fn new_flows(self) -> bool {
        matches!(self, Mode::NewConns | Mode::KernelNewConns | Mode::NewConnsTranslog)
    }

    /// Whether the kernel forwards (conntrack and nftables SNAT).
    pub fn kernel(self) -> bool {
        matches!(self, Mode::Kernel | Mode::KernelFlowtable | Mode::KernelNewConns)
    }

    /// Whether the mode keeps per-flow state that TCP segments must find
    /// established (a handshake before the window): every mode but the
    /// stateless redirect.
    pub fn stateful(self) -> bool {
        self != Mode::Redirect
    }

    /// Whether the mode runs the Egret daemon.
    pub fn uses_egret(self) -> bool {
        matches!(
            self,
            Mode::Egret
                | Mode::Fastpath
                | Mode::NewConns
                | Mode::NewConnsTranslog
                | Mode::FastpathVxlan
                | Mode::EgretVxlan
        )
    }

    /// Whether forwarded frames must carry the egress IP.
    pub fn translates(self) -> bool {
        self != Mode::Redirect
    }
}

/// Everything that can stop a run.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Topology(#[from] TopologyError),
    #[error(transparent)]
    Xdp(#[from] XdpError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    Egret(#[from] EgretError),
    #[error(transparent)]
    Gen(#[from] GenError),
    #[error(transparent)]
    Cpu(#[from] cpu::CpuError),
    #[error(transparent)]
    Window(#[from] cpu::WindowError),
    #[error("NAPI lookup for {dev}: {source}")]
    Napi { dev: &'static str, source: NapiError },
    #[error("{dev} has no threaded NAPI instance after setting up {mode}; its receive work would not run in a thread on the gateway core")]
    NoNapiThread { dev: &'static str, mode: &'static str },
    #[error("pinning {what} (tid {tid}) to CPU {cpu} failed: {source}")]
    Pin { what: String, tid: u32, cpu: usize, source: std::io::Error },
    #[error("no {name} thread found in /proc")]
    NoKthread { name: String },
    #[error("reading Egret's metrics failed: {reason}")]
    Metrics { reason: String },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("interrupted")]
    Interrupted,
    /// The mode cannot run here (e.g. a kernel without flowtables).
    #[error("{mode} is not available: {reason}")]
    Unavailable { mode: &'static str, reason: String },
}

/// Options that shape every window.
#[derive(Debug, Clone)]
pub struct Options {
    pub engine: Engine,
    pub gen_cpu: usize,
    pub gw_cpu: usize,
    pub seconds: f64,
    pub warmup: f64,
    pub new_conns_seconds: f64,
    pub rate: Option<u64>,
    pub egret: PathBuf,
    pub workdir: PathBuf,
    pub metrics_port: u16,
    pub user_hz: u64,
    /// Raise the benchmark's own contexts above the machine's other load:
    /// gateway NAPI threads SCHED_FIFO 49, the sink's NAPI thread
    /// SCHED_FIFO 60, the generator nice -20.
    pub priorities: bool,
    /// Egret's `xdp.fastPathSessions` (None: the daemon's default).
    pub fast_path_sessions: Option<u32>,
    /// Frames of one flow in a row (1: round-robin over the flows).
    pub train: u32,
    /// The nodes' VXLAN port (`tunnel.port`) in the encapsulated modes.
    pub tunnel_port: u16,
    /// The transport of the fixed-flow modes' frames (new-connection and
    /// encapsulated modes send UDP).
    pub proto: Proto,
    /// The sinks `new-conns-translog` exports to.
    pub translog_sinks: crate::egret::TranslogSinks,
    /// `new-conns-translog` with port blocks of this size, one record per
    /// block (`nat.portBlocks`, `logSessions: false`); `new-conns` keeps
    /// per-session ports, so the ratio includes the blocks' own cost.
    pub translog_port_blocks: Option<u16>,
    /// `new-conns-translog`'s `translationLogs.ringRecords` (None: the
    /// daemon's default).
    pub translog_ring_records: Option<u32>,
}

/// Nice value of the generator thread.
pub const BENCH_NICE: i32 = -20;
/// SCHED_FIFO priority of the gateway's NAPI threads: above every normal
/// thread, below Egret's workers (50), which must preempt them.
pub const GW_NAPI_FIFO: i32 = 49;
/// SCHED_FIFO priority of the sink's NAPI thread.
pub const SINK_FIFO: i32 = 60;

/// Sleep `secs`, returning early with an error on SIGINT/SIGTERM.
pub fn sleep_checked(secs: f64) -> Result<(), BenchError> {
    let end = Instant::now() + Duration::from_secs_f64(secs.max(0.0));
    loop {
        if crate::sys::stop_requested() {
            return Err(BenchError::Interrupted);
        }
        let now = Instant::now();
        if now >= end {
            return Ok(());
        }
        std::thread::sleep((end - now).min(Duration::from_millis(50)));
    }
}

/// The pid of kernel thread `name` (e.g. `ksoftirqd/1`).
pub fn kthread_pid(name: &str) -> Result<u32, BenchError> {
    let rd = std::fs::read_dir("/proc").map_err(|source| cpu::CpuError::Read { path: "/proc".into(), source })?;
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == name) {
            return Ok(pid);
        }
    }
    Err(BenchError::NoKthread { name: name.to_owned() })
}

/// The sink: its XDP counter on `sink0`, and its NAPI thread pinned to the
/// generator core. Lives for the whole run.
#[derive(Debug)]
pub struct SinkSide {
    pub sink: Sink,
    pub napi_tid: u32,
}

impl SinkSide {
    /// Attach the sink program and place its NAPI thread.
    pub fn setup(topo: &Topology, cpu: usize, priorities: bool) -> Result<Self, BenchError> {
        let mut sink = Sink::load(topology::SINK_IP, topology::SINK_PORT)?;
        let ns = topo.sink_ns.clone();
        let ifindex = in_netns(&ns, || -> Result<u32, BenchError> {
            let i = xdp::ifindex(&ns, topology::SINK_IF)?;
            sink.attach(i)?;
            Ok(i)
        })?;
        topo.set_threaded(&topo.sink_ns, topology::SINK_IF)?;
        let tids = napi_threads(&topo.sink_ns, topology::SINK_IF, ifindex)?;
        let napi_tid = *tids.first().ok_or(BenchError::NoNapiThread { dev: topology::SINK_IF, mode: "sink" })?;
        crate::sys::set_affinity(napi_tid, cpu).map_err(|source| BenchError::Pin {
            what: "sink NAPI".into(),
            tid: napi_tid,
            cpu,
            source,
        })?;
        if priorities {
            crate::sys::set_fifo(napi_tid, SINK_FIFO).map_err(|source| BenchError::Pin {
                what: "sink NAPI (SCHED_FIFO)".into(),
                tid: napi_tid,
                cpu,
                source,
            })?;
        }
        Ok(Self { sink, napi_tid })
    }
}

/// The kthread pids of `dev`'s threaded NAPI instances in `ns`.
fn napi_threads(ns: &str, dev: &'static str, ifindex: u32) -> Result<Vec<u32>, BenchError> {
    let infos = in_netns(ns, || napi::napi_of(ifindex).map_err(|source| BenchError::Napi { dev, source }))?;
    Ok(infos.into_iter().filter_map(|i| i.pid).collect())
}

enum State {
    Nothing,
    /// `pass`: the pass-everything program on gwout while the sink answers.
    Kernel {
        flowtable: bool,
        pass: Option<Pass>,
    },
    Redirect(#[allow(dead_code)] Redirect),
    Egret(Daemon),
}

/// A mode set up on the gateway; dropping it undoes the setup.
pub struct Gateway<'t> {
    topo: &'t Topology,
    pub mode: Mode,
    state: State,
    /// Gateway-side threads whose CPU time is the gateway's.
    pub watched: Vec<Watched>,
    /// Facts worth printing (placement, thread names).
    pub notes: Vec<String>,
    /// Where Egret's metrics are (namespace, port), for Egret modes.
    pub metrics: Option<(String, u16)>,
    /// `new-conns-translog`'s collectors (`collector.rs`).
    collectors: crate::collector::Collectors,
}

impl std::fmt::Debug for Gateway<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway").field("mode", &self.mode).field("watched", &self.watched).finish()
    }
}

const NFT_TABLE: &str = "egret_bench";
/// The `kernel-flowtable` mode's table (family inet: flowtables are not
/// tied to the NAT table's family).
pub const NFT_FLOWTABLE_TABLE: &str = "egret_bench_ft";
/// Its named counter: packets that went through the forward chain, i.e.
/// were not forwarded by the flowtable.
pub const NFT_SLOW_PATH_COUNTER: &str = "slow_path";

/// The `kernel-flowtable` mode's nftables table: a flowtable on both of
/// the gateway's interfaces (hook ingress, priority 0) and a forward chain
/// that counts every TCP and UDP packet it sees and adds its connection to
/// the flowtable. The kernel adds a connection once conntrack has seen its
/// reply (UDP) or its handshake completed (TCP, ESTABLISHED); from then on
/// the flowtable's ingress hook forwards (and translates) its packets
/// before the IP stack, and they no longer reach the forward chain.
pub fn flowtable_ruleset(devices: &[&str]) -> String {
    let devs: Vec<String> = devices.iter().map(|d| format!("\"{d}\"")).collect();
    format!(
        "table inet {NFT_FLOWTABLE_TABLE} {{\n  counter {NFT_SLOW_PATH_COUNTER} {{ }}\n  \
         flowtable ft {{\n    hook ingress priority 0; devices = {{ {} }};\n  }}\n  \
         chain forward {{\n    type filter hook forward priority 0; policy accept;\n    \
         meta l4proto {{ tcp, udp }} counter name \"{NFT_SLOW_PATH_COUNTER}\" flow add @ft\n  }}\n}}\n",
        devs.join(", ")
    )
}

/// The packet count of a named counter from `nft -j list counter ...`.
pub fn nft_counter_packets(json: &str) -> Option<u64> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.get("nftables")?.as_array()?.iter().find_map(|o| o.get("counter")?.get("packets")?.as_u64())
}

/// Connections marked `[OFFLOAD]` (in a flowtable) in the text of
/// `/proc/net/nf_conntrack`, and all connections.
pub fn count_offloaded(conntrack: &str) -> (u64, u64) {
    conntrack.lines().filter(|l| !l.trim().is_empty()).fold((0, 0), |(o, n), l| {
        (o + u64::from(l.split_whitespace().any(|w| w == "[OFFLOAD]" || w == "[HW_OFFLOAD]")), n + 1)
    })
}

/// TCP connections conntrack still lists `[UNREPLIED]` (it has seen no
/// packet of their reply direction) in the text of
/// `/proc/net/nf_conntrack`, and all TCP connections.
pub fn count_unreplied_tcp(conntrack: &str) -> (u64, u64) {
    conntrack.lines().fold((0, 0), |(u, n), l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        if w.get(2) != Some(&"tcp") {
            return (u, n);
        }
        (u + u64::from(w.contains(&"[UNREPLIED]")), n + 1)
    })
}

/// The egress IPs of new-connection runs: 203.0.113.10-25, each with ports
/// 1024-65535 (about a million mappings to one destination).
pub const NEW_CONNS_EGRESS: [Ipv4Addr; 16] = {
    let mut a = [Ipv4Addr::new(203, 0, 113, 10); 16];
    let mut i = 0;
    while i < 16 {
        a[i] = Ipv4Addr::new(203, 0, 113, 10 + i as u8);
        i += 1;
    }
    a
};

impl<'t> Gateway<'t> {
    /// Set `mode` up and place its contexts. Egret gets NAT ports
    /// 1024-65535, as the kernel's SNAT has; new-connection runs use the 16
    /// [`NEW_CONNS_EGRESS`] addresses.
    pub fn setup(topo: &'t Topology, mode: Mode, opts: &Options) -> Result<Self, BenchError> {
        let gw = topo.gw_ns.clone();
        let (in_idx, out_idx) = in_netns(&gw, || -> Result<(u32, u32), BenchError> {
            Ok((xdp::ifindex(&gw, GW_IN)?, xdp::ifindex(&gw, GW_OUT)?))
        })?;
        // The guard exists before the first change, so a failure half-way
        // still undoes what was done.
        let mut g = Gateway {
            topo,
            mode,
            state: State::Nothing,
            watched: Vec::new(),
            notes: Vec::new(),
            metrics: None,
            collectors: Default::default(),
        };
        if mode == Mode::NewConnsTranslog {
            let tcp = opts.translog_sinks == egret::TranslogSinks::SyslogTcp;
            let udp: &[&str] =
                if tcp { &[egret::IPFIX_COLLECTOR] } else { &[egret::IPFIX_COLLECTOR, egret::SYSLOG_COLLECTOR] };
            g.collectors =
                in_netns(&gw, || crate::collector::Collectors::bind(udp, tcp.then_some(egret::SYSLOG_COLLECTOR)))?;
        }
        // A stopped Egret leaves its fail-closed nftables table behind on
        // purpose (docs/operations.md): it would drop the kernel mode's
        // forwarded traffic. Every mode starts without it.
        topo.exec(&gw, &["nft", "-f", "-"], Some("table inet egret_failclosed\ndelete table inet egret_failclosed\n"))?;
        match mode {
            Mode::Kernel | Mode::KernelNewConns | Mode::KernelFlowtable => {
                let flowtable = mode == Mode::KernelFlowtable;
                g.state = State::Kernel { flowtable, pass: None };
                // Start from an empty conntrack table (earlier rounds' flows
                // would otherwise still be there: UDP entries live 30 s).
                in_netns(&gw, || {
                    napi::flush_conntrack().map_err(|source| BenchError::Napi { dev: "conntrack", source })
                })?;
                topo.sysctl(&gw, "net.ipv4.ip_forward", "1")?;
                // New-connection runs translate to the same 16 addresses as
                // Egret's, so neither runs out of ports first.
                let to = if mode == Mode::KernelNewConns {
                    format!("{}-{}", NEW_CONNS_EGRESS[0], NEW_CONNS_EGRESS[NEW_CONNS_EGRESS.len() - 1])
                } else {
                    topology::EGRESS_IP.to_string()
                };
                let rules = format!(
                    "table ip {NFT_TABLE} {{\n  chain post {{\n    type nat hook postrouting priority srcnat; policy accept;\n    \
                     oifname \"{GW_OUT}\" ip saddr {} ip daddr {} snat to {}\n  }}\n}}\n",
                    topology::POD_RANGE,
                    topology::SINK_RANGE,
                    to
                );
                topo.exec(&gw, &["nft", "-f", "-"], Some(&rules))?;
                // veth has NAPI only with XDP or GRO; GRO gives the kernel
                // path a NAPI instance without an XDP program (and its copy).
                topo.ethtool_feature(&gw, GW_IN, "gro", true)?;
                g.notes.push("kernel: nftables snat, ip_forward=1, GRO on gwin for NAPI".into());
                // The sink's answers (UDP replies, SYN-ACKs) come back with
                // XDP_TX, which a veth accepts only with an XDP program of
                // its own (with NAPI through GRO alone, they are gwout's RX
                // drops and conntrack never sees them): a pass-everything
                // program on gwout, where the kernel must see them. It
                // sees only what gwout receives, i.e. the answers: what the
                // gateway forwards leaves gwout by transmit.
                if flowtable || proto_of(mode, opts) == Proto::Tcp {
                    let pass = in_netns(&gw, || Pass::attach(out_idx))?;
                    if let State::Kernel { pass: p, .. } = &mut g.state {
                        *p = Some(pass);
                    }
                    g.notes
                        .push("kernel: XDP pass program on gwout (the sink's answers arrive as XDP_TX frames)".into());
                }
                // TCP: gwin's GRO merges a train's segments, gwout segments
                // them again and would leave each with a partial checksum
                // (veth "offloads" it): the kernel completes them, as a
                // NIC's offload would.
                if opts.proto == Proto::Tcp && mode != Mode::KernelNewConns {
                    topo.ethtool_feature(&gw, GW_OUT, "tx", false)?;
                    g.notes.push("kernel: TX checksum offload off on gwout (full checksums on GSO segments)".into());
                }
                if flowtable {
                    let rules = flowtable_ruleset(&[GW_IN, GW_OUT]);
                    if let Err(e) = topo.exec(&gw, &["nft", "-f", "-"], Some(&rules)) {
                        return Err(BenchError::Unavailable {
                            mode: mode.name(),
                            reason: format!(
                                "nftables refused the flowtable ({e}); a kernel built without CONFIG_NF_FLOW_TABLE (and CONFIG_NF_FLOW_TABLE_INET) answers \"No such file or directory\""
                            ),
                        });
                    }
                    g.notes.push(format!(
                        "kernel: flowtable ft on {GW_IN} and {GW_OUT} (table inet {NFT_FLOWTABLE_TABLE})"
                    ));
                }
            }
            Mode::Redirect => {
                let r = in_netns(&gw, || Redirect::attach(in_idx, out_idx, topology::GW_OUT_MAC, topology::SINK_MAC))?;
                g.state = State::Redirect(r);
            }
            Mode::Egret
            | Mode::Fastpath
            | Mode::NewConns
            | Mode::NewConnsTranslog
            | Mode::FastpathVxlan
            | Mode::EgretVxlan => {
                let binary = egret::locate(&opts.egret)?;
                let egress_ips: Vec<Ipv4Addr> =
                    if mode.new_flows() { NEW_CONNS_EGRESS.to_vec() } else { vec![topology::EGRESS_IP] };
                let config = BenchConfig {
                    inside: GW_IN.into(),
                    outside: GW_OUT.into(),
                    fast_path: mode.fast_path(),
                    fast_path_sessions: opts.fast_path_sessions,
                    cpu: opts.gw_cpu,
                    realtime_priority: 50,
                    // The kernel's SNAT may use every port from 1024: give
                    // Egret the same (its default, 32768-60999, is fewer
                    // than 50,000 flows need on one egress IP). The
                    // tunnel's port must lie outside it: the encapsulated
                    // modes get the larger side (6083-65535 for 6082).
                    ports: Some(if mode.encapsulated() { nat_ports_beside(opts.tunnel_port) } else { (1024, 65535) }),
                    tunnel: mode.encapsulated().then(|| egret::TunnelConfig {
                        port: opts.tunnel_port,
                        node_addresses: vec![topology::NODE_IP],
                    }),
                    egress_ips,
                    sources: topology::POD_RANGE.into(),
                    destinations: topology::SINK_RANGE.into(),
                    metrics_port: opts.metrics_port,
                    admin_socket: opts.workdir.join("egret.sock"),
                    translog: (mode == Mode::NewConnsTranslog).then_some(opts.translog_sinks),
                    port_blocks: opts.translog_port_blocks.filter(|_| mode == Mode::NewConnsTranslog),
                    ring_records: opts.translog_ring_records,
                };
                let path = opts.workdir.join(format!("egret-{}.yaml", mode.name()));
                egret::write_config(&path, &config)?;
                egret::check_config(&binary, &path)?;
                let log = opts.workdir.join(format!("egret-{}.log", mode.name()));
                let d = Daemon::start(&binary, &gw, &path, &log, opts.metrics_port)?;
                g.notes.push(format!("egret pid {}; config {}; log {}", d.pid(), path.display(), log.display()));
                g.state = State::Egret(d);
                g.metrics = Some((gw.clone(), opts.metrics_port));
                if let State::Egret(d) = &mut g.state {
                    d.wait_ready(Duration::from_secs(30), crate::sys::stop_requested)?;
                }
            }
        }
        g.place(in_idx, out_idx, opts)?;
        Ok(g)
    }

    /// Thread every NAPI instance of the gateway's veths, pin the kthreads
    /// to the gateway core, and list what to watch.
    fn place(&mut self, in_idx: u32, out_idx: u32, opts: &Options) -> Result<(), BenchError> {
        let gw = self.topo.gw_ns.clone();
        for (dev, idx) in [(GW_IN, in_idx), (GW_OUT, out_idx)] {
            // A veth without NAPI refuses `threaded` (EIO): only the inside
            // one must have it.
            let has_napi =
                !in_netns(&gw, || napi::napi_of(idx).map_err(|source| BenchError::Napi { dev, source }))?.is_empty();
            if has_napi {
                self.topo.set_threaded(&gw, dev)?;
            }
            let tids = napi_threads(&gw, dev, idx)?;
            if dev == GW_IN && tids.is_empty() {
                return Err(BenchError::NoNapiThread { dev, mode: self.mode.name() });
            }
            for tid in tids {
                crate::sys::set_affinity(tid, opts.gw_cpu).map_err(|source| BenchError::Pin {
                    what: format!("napi {dev}"),
                    tid,
                    cpu: opts.gw_cpu,
                    source,
                })?;
                if opts.priorities {
                    crate::sys::set_fifo(tid, GW_NAPI_FIFO).map_err(|source| BenchError::Pin {
                        what: format!("napi {dev} (SCHED_FIFO)"),
                        tid,
                        cpu: opts.gw_cpu,
                        source,
                    })?;
                }
                self.watched.push(Watched { role: format!("napi {dev}"), pid: tid, tid, may_end: false });
            }
        }
        let ksoftirqd = kthread_pid(&format!("ksoftirqd/{}", opts.gw_cpu))?;
        self.watched.push(Watched {
            role: format!("ksoftirqd/{}", opts.gw_cpu),
            pid: ksoftirqd,
            tid: ksoftirqd,
            may_end: false,
        });
        if let State::Egret(d) = &self.state {
            let pid = d.pid();
            let threads = cpu::threads_of(pid)?;
            let workers = threads.iter().filter(|(_, c)| c.starts_with(egret::WORKER_PREFIX)).count();
            if workers == 0 {
                self.notes.push(format!(
                    "warning: no thread named {}-N in egret (pid {pid}); counting all its threads as one context: {:?}",
                    egret::WORKER_PREFIX,
                    threads.iter().map(|(_, c)| c.as_str()).collect::<Vec<_>>()
                ));
            }
            for (tid, comm) in threads {
                let is_worker = comm.starts_with(egret::WORKER_PREFIX);
                if is_worker {
                    // The config asks for SCHED_FIFO 50 on the gateway core:
                    // say so if the daemon did not do it.
                    if let Ok(st) = cpu::sample_thread(pid, tid) {
                        let (policy, prio, last) = (st.stat.policy, st.stat.rt_priority, st.stat.processor as usize);
                        if policy != 1 || prio != 50 || last != opts.gw_cpu {
                            self.notes.push(format!(
                                "warning: {comm} runs policy {policy} priority {prio} on CPU {last}, not SCHED_FIFO 50 on CPU {}",
                                opts.gw_cpu
                            ));
                        }
                    }
                }
                let role = if is_worker { comm.clone() } else { format!("egret {comm}") };
                self.watched.push(Watched { role, pid, tid, may_end: !is_worker });
            }
        }
        Ok(())
    }
}

impl Drop for Gateway<'_> {
    fn drop(&mut self) {
        let gw = self.topo.gw_ns.clone();
        match &mut self.state {
            State::Kernel { flowtable, pass } => {
                // Detach before GRO goes off (XDP keeps GRO on while attached).
                *pass = None;
                if *flowtable {
                    let _ = self.topo.exec(&gw, &["nft", "delete", "table", "inet", NFT_FLOWTABLE_TABLE], None);
                }
                let _ = self.topo.exec(&gw, &["nft", "delete", "table", "ip", NFT_TABLE], None);
                let _ = self.topo.sysctl(&gw, "net.ipv4.ip_forward", "0");
                let _ = self.topo.ethtool_feature(&gw, GW_IN, "gro", false);
                let _ = self.topo.ethtool_feature(&gw, GW_OUT, "gro", false);
                let _ = self.topo.ethtool_feature(&gw, GW_OUT, "tx", true);
            }
            State::Nothing | State::Redirect(_) => {}
            State::Egret(d) => {
                if let Some(s) = d.stop() {
                    if !s.success() && s.code().is_some() {
                        eprintln!("warning: egret exited with {s}");
                    }
                }
            }
        }
    }
}

/// One measurement window's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub mode: Mode,
    /// The frames' transport.
    pub proto: Proto,
    /// Distinct flows (0: a new flow per frame).
    pub flows: u64,
    pub round: u32,
    pub seconds: f64,
    /// Frames the generator handed to its veth.
    pub offered: u64,
    /// Egret modes: the change of every `*_total` metric over the window
    /// (summed over labels), e.g. `egret_xsk_rx_frames_total`, and of each
    /// labelled series, e.g. `egret_fastpath_packets_total{outcome="hit"}`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub egret_metrics: BTreeMap<String, f64>,
    /// Interface counters over the window (read just outside it, so they
    /// are for locating loss, not for rates).
    pub links: BTreeMap<String, LinkCounters>,
    /// Benchmark frames counted at the sink.
    pub sink: SinkCounts,
    pub cpu: WindowUse,
    /// `kernel-flowtable`: packets that went through the forward chain
    /// over the window (read just outside it), i.e. not forwarded by the
    /// flowtable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slow_path: Option<u64>,
    /// `kernel-flowtable`: connections in a flowtable (`[OFFLOAD]` in
    /// conntrack) and all connections, read before the window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub offloaded: Option<(u64, u64)>,
    /// Kernel modes with TCP: the connections conntrack still listed
    /// `[UNREPLIED]` after the handshake (it never saw their SYN-ACK).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unreplied: Option<u64>,
}

impl Sample {
    pub fn offered_mpps(&self) -> f64 {
        self.offered as f64 / self.seconds / 1e6
    }
    pub fn forwarded_mpps(&self) -> f64 {
        self.sink.frames as f64 / self.seconds / 1e6
    }
    /// Share of offered frames not counted at the sink.
    pub fn loss(&self) -> f64 {
        if self.offered == 0 {
            return 0.0;
        }
        1.0 - (self.sink.frames as f64 / self.offered as f64).min(1.0)
    }
    /// Forwarded frames per gateway CPU second, in millions.
    pub fn per_core_mpps(&self) -> f64 {
        if self.cpu.gateway_cpu_s <= 0.0 {
            return 0.0;
        }
        self.sink.frames as f64 / self.cpu.gateway_cpu_s / 1e6
    }
    /// Gateway CPU ns per forwarded frame.
    pub fn ns_per_packet(&self) -> f64 {
        if self.sink.frames == 0 {
            return f64::INFINITY;
        }
        self.cpu.gateway_cpu_s * 1e9 / self.sink.frames as f64
    }
    /// Share of the frames arriving at the gateway's inside veth that its
    /// full ring refused (the gateway did not take them in time and spent
    /// nothing on them). From gwin's counters: `rx_dropped / (rx_dropped +
    /// rx_packets)`.
    pub fn lost_at_gateway_rx(&self) -> f64 {
        self.links.get(topology::GW_IN).map_or(0.0, LinkCounters::rx_drop_share)
    }

    /// The same at the sink's veth: frames the gateway forwarded that the
    /// sink did not take (a benchmark artefact unless ~0).
    pub fn lost_at_sink_rx(&self) -> f64 {
        self.links.get(topology::SINK_IF).map_or(0.0, LinkCounters::rx_drop_share)
    }

    /// Frames Egret's workers received over the window (Egret modes).
    pub fn worker_rx(&self) -> Option<f64> {
        self.egret_metrics.get(egret::WORKER_RX_METRIC).copied()
    }

    /// Why the sample does not measure its mode's path at all (empty: it
    /// does): nothing forwarded, over 1% of the frames forwarded untranslated (e.g. the
    /// kernel passing TCP segments conntrack finds INVALID without NAT), a
    /// kernel TCP handshake conntrack did not see answered. An invalid
    /// sample's summary gets no ratios and is flagged INVALID.
    pub fn invalid(&self) -> Vec<String> {
        let mut p = Vec::new();
        let s = &self.sink;
        if s.frames == 0 {
            p.push("nothing reached the sink".into());
        }
        // The counters are read one after the other while frames arrive:
        // allow that skew, nothing more.
        let untranslated = s.frames.saturating_sub(s.translated);
        if self.mode.translates() && untranslated > 64 && untranslated as f64 > 0.01 * s.frames as f64 {
            p.push(format!("{untranslated} of {} frames reached the sink untranslated", s.frames));
        }
        // A few SYN-ACKs may be lost in a full ring (their segments would
        // show as untranslated above); more than 1% is a broken handshake.
        if let Some(u) = self.unreplied {
            if u > 0 && u as f64 > 0.01 * self.flows as f64 {
                p.push(format!(
                    "conntrack saw no SYN-ACK for {u} of {} connections ([UNREPLIED] after the handshake): their segments are INVALID to it and not translated",
                    self.flows
                ));
            }
        }
        p
    }

    /// What looks wrong with the sample (translation, checksums): the
    /// reasons it is [`Sample::invalid`], then lesser ones.
    pub fn problems(&self) -> Vec<String> {
        let mut p = self.invalid();
        let s = &self.sink;
        // Fewer than 1% untranslated (e.g. a few kernel TCP connections
        // whose SYN-ACK was lost): flagged, the rate still the mode's.
        let untranslated = s.frames.saturating_sub(s.translated);
        if self.mode.translates() && untranslated > 64 && untranslated as f64 <= 0.01 * s.frames as f64 {
            p.push(format!("{untranslated} of {} frames reached the sink untranslated", s.frames));
        }
        if self.lost_at_sink_rx() > 0.01 {
            p.push(format!(
                "{:.1}% of the frames reaching the sink were dropped at its ring: the sink core is overloaded",
                self.lost_at_sink_rx() * 100.0
            ));
        }
        let metric = |name: &str| self.egret_metrics.get(name).copied().unwrap_or(0.0);
        if metric("egret_ports_exhausted_total") > 0.0 {
            p.push(format!("Egret ran out of NAT ports {:.0} times", metric("egret_ports_exhausted_total")));
        }
        let out_of_blocks = metric("egret_port_blocks_exhausted_total") + metric("egret_port_blocks_pod_limit_total");
        if out_of_blocks > 0.0 {
            p.push(format!(
                "Egret refused {out_of_blocks:.0} new flows for want of a port block (egret_port_blocks_exhausted_total, _pod_limit_total): take smaller blocks"
            ));
        }
        if metric("egret_translog_dropped_total") > 0.0 {
            p.push(format!(
                "Egret dropped {:.0} translation log records (egret_translog_dropped_total): the figure is of an exporter that did not keep up",
                metric("egret_translog_dropped_total")
            ));
        }
        if metric("egret_drops_total") > 0.001 * s.frames as f64 {
            p.push(format!("Egret dropped {:.0} frames (egret_drops_total)", metric("egret_drops_total")));
        }
        if s.frames > 1000 && self.ns_per_packet() < 50.0 {
            p.push(format!(
                "implausibly cheap ({:.0} ns/packet): the gateway's work ran outside the watched threads",
                self.ns_per_packet()
            ));
        }
        if s.bad_ip_checksum + s.bad_udp_checksum > 0 {
            p.push(format!(
                "bad checksums: {} IPv4, {} {}",
                s.bad_ip_checksum,
                s.bad_udp_checksum,
                self.proto.name().to_uppercase()
            ));
        }
        if let Some(slow) = self.slow_path {
            if slow as f64 > 0.01 * s.frames as f64 {
                p.push(format!(
                    "{slow} of {} forwarded frames went through the forward chain: the flowtable did not carry the flows",
                    s.frames
                ));
            }
        }
        // The sink checks only frames of the 60-byte shape: an inner frame
        // forwarded with anything of its tunnel left would show here.
        if self.mode.encapsulated() && s.unchecked > 64 {
            p.push(format!("{} frames reached the sink not of the pod's 60-byte shape", s.unchecked));
        }
        let decap_drops: Vec<String> =
            self.decap_drops().into_iter().filter(|(_, v)| *v > 64.0).map(|(k, v)| format!("{k} {v:.0}")).collect();
        if !decap_drops.is_empty() {
            p.push(format!("tunnel frames dropped: {}", decap_drops.join(", ")));
        }
        p
    }

    /// The tunnel's drops over the window, per series (the XDP program's
    /// `drop_decap_*` verdicts, the workers' `decap_*` drop reasons).
    pub fn decap_drops(&self) -> Vec<(String, f64)> {
        self.egret_metrics
            .iter()
            .filter(|(k, _)| {
                (k.starts_with("egret_xdp_verdicts_total{") && k.contains("drop_decap"))
                    || (k.starts_with("egret_drops_total{") && k.contains("decap"))
            })
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    /// One labelled series' change over the window (0 when absent).
    pub fn series(&self, name: &str, label: &str, value: &str) -> f64 {
        self.egret_metrics.get(&format!("{name}{{{label}=\"{value}\"}}")).copied().unwrap_or(0.0)
    }
}

/// NAT ports 1024-65535 without `tunnel_port`: the larger of the two
/// ranges either side of it (the daemon refuses a tunnel port inside
/// `nat.ports`).
pub fn nat_ports_beside(tunnel_port: u16) -> (u16, u16) {
    if tunnel_port < 1024 {
        return (1024, 65535);
    }
    let below = tunnel_port - 1024;
    let above = 65535 - tunnel_port;
    if above >= below {
        (tunnel_port + 1, 65535)
    } else {
        (1024, tunnel_port - 1)
    }
}

/// Rate at which the fast-path mode establishes its flows: low enough that
/// the workers and the offload manager (which share the gateway core with
/// the saturated path in the window) confirm and install every session.
const ESTABLISH_PPS: u64 = 100_000;
/// How long establishing may take before the window starts anyway.
const ESTABLISH_MAX: Duration = Duration::from_secs(30);

/// Send `spec`'s flows at [`ESTABLISH_PPS`] until Egret reports every one
/// installed in the fast path (`egret_fastpath_sessions`), or
/// [`ESTABLISH_MAX`] passes (the window then shows what was installed, and
/// the fast-path check reports a mode that was not in effect). The sink
/// answers each flow once per quarter second (a reply lost in a full ring
/// is sent again), and stops answering before the window.
fn establish_fast_path(gateway: &Gateway<'_>, sink: &SinkSide, spec: &GenSpec, flows: u64) -> Result<(), BenchError> {
    // TCP windows bring connections of their own (new ports): the earlier
    // windows' sessions stay installed beside them.
    let before = if spec.frame.proto == Proto::Tcp {
        scrape(gateway)?.get("egret_fastpath_sessions").copied().unwrap_or(0.0)
    } else {
        0.0
    };
    let mut slow = spec.clone();
    // AF_PACKET paces evenly; the XDP engine's 50 ms bursts overflow gwin's
    // ring and, with 50,000 flows a multiple of the burst, lose the same
    // flows on every pass.
    slow.engine = Engine::AfPacket;
    slow.rate = Some(ESTABLISH_PPS);
    let gen = Running::start(slow)?;
    let t0 = Instant::now();
    let mut installed = 0.0;
    let mut passes = 0u32;
    while t0.elapsed() < ESTABLISH_MAX {
        sink.sink.set_reply_generation(next_reply_generation())?;
        sleep_checked(0.25)?;
        passes += 1;
        // TCP: a connection whose SYN-ACK was lost on the way back (the
        // workers' ring) never completes its handshake: every 2 s, the SYNs
        // again (Egret takes a SYN on an established session as a
        // retransmission; the sink answers while replies are on).
        if spec.frame.proto == Proto::Tcp && passes.is_multiple_of(8) {
            generator::send_syns(&spec.netns, &spec.dev, &spec.frame, &spec.flows, HANDSHAKE_PPS)?;
        }
        installed = scrape(gateway)?.get("egret_fastpath_sessions").copied().unwrap_or(0.0) - before;
        if installed >= flows as f64 {
            break;
        }
    }
    sink.sink.set_reply_generation(0)?;
    drop(gen);
    eprintln!(
        "  fastpath: {installed:.0} of {flows} flows installed in XDP after {:.1} s of establishing at {} pps",
        t0.elapsed().as_secs_f64(),
        ESTABLISH_PPS
    );
    Ok(())
}

/// Rate of the handshake's SYNs (TCP).
const HANDSHAKE_PPS: u64 = 25_000;

/// TCP: complete every flow's handshake before the window, so that the
/// window's segments belong to established connections on every stateful
/// path (the kernel's conntrack: SYN_SENT, SYN_RECV, then ESTABLISHED on the
/// first data segment; Egret: both SYNs seen). The generator's namespace
/// sends each flow's SYN (sequence number [`crate::frame::TCP_POD_ISN`])
/// while the sink answers every translated SYN with a SYN-ACK (sequence
/// number [`crate::frame::TCP_SINK_ISN`]), which goes back through the
/// gateway. The pod never needs to see it: its data segments acknowledge
/// the sink's ISN + 1, known in advance. SYNs the sink did not answer (lost
/// in a full ring) are sent again, twice at most. Returns the number of
/// SYN-ACKs sent.
///
/// `unreplied` (the kernel modes): how many connections the gateway has
/// not seen answered (conntrack's `[UNREPLIED]`). A SYN-ACK the sink sent
/// can still be lost on its way into the gateway (its veth's XDP ring);
/// while any is, the SYNs go again (twice at most) and the sink answers
/// every one again (a new reply generation). Conntrack ignores a SYN on an
/// established connection and resynchronises on its SYN-ACK, and the
/// sequence numbers are the same.
fn handshake(
    sink: &SinkSide,
    spec: &GenSpec,
    flows: u64,
    unreplied: Option<&dyn Fn() -> Result<u64, BenchError>>,
) -> Result<u64, BenchError> {
    sink.sink.set_reply_generation(next_reply_generation())?;
    let mut answered = 0;
    for pass in 0..3 {
        let before = sink.sink.counts()?;
        generator::send_syns(&spec.netns, &spec.dev, &spec.frame, &spec.flows, HANDSHAKE_PPS)?;
        // The last SYN-ACKs cross the gateway.
        sleep_checked(0.1)?;
        answered = sink.sink.counts()?.since(&before).replied;
        match unreplied {
            Some(unreplied) => {
                let u = unreplied()?;
                if u == 0 {
                    break;
                }
                if pass < 2 {
                    eprintln!("  tcp: the gateway saw no SYN-ACK for {u} connections: the SYNs again");
                    sink.sink.set_reply_generation(next_reply_generation())?;
                }
            }
            None if answered >= flows => break,
            None => {}
        }
    }
    sink.sink.set_reply_generation(0)?;
    eprintln!("  tcp: {answered} of {flows} SYNs answered with a SYN-ACK");
    Ok(answered)
}

/// Packets that went through `kernel-flowtable`'s forward chain so far.
fn slow_path_packets(topo: &Topology) -> Result<u64, BenchError> {
    let text = topo.exec(
        &topo.gw_ns,
        &["nft", "-j", "list", "counter", "inet", NFT_FLOWTABLE_TABLE, NFT_SLOW_PATH_COUNTER],
        None,
    )?;
    nft_counter_packets(&text).ok_or_else(|| BenchError::Unavailable {
        mode: Mode::KernelFlowtable.name(),
        reason: format!("no packet count in nft's answer: {text}"),
    })
}

/// The gateway's conntrack connections in a flowtable, and all of them
/// (`/proc/net/nf_conntrack` read inside the gateway's namespace).
fn conntrack_offloaded(topo: &Topology) -> Result<(u64, u64), BenchError> {
    Ok(count_offloaded(&conntrack_text(topo)?))
}

/// The gateway's `/proc/net/nf_conntrack` (read inside its namespace).
fn conntrack_text(topo: &Topology) -> Result<String, BenchError> {
    let path = "/proc/thread-self/net/nf_conntrack";
    in_netns(&topo.gw_ns, || -> Result<String, BenchError> {
        std::fs::read_to_string(path).map_err(|source| cpu::CpuError::Read { path: path.into(), source }.into())
    })
}

/// `kernel-flowtable`: send the flows at [`ESTABLISH_PPS`], the sink
/// answering each (UDP) once per quarter second, until the forward chain
/// sees almost nothing (at most 1% of what was sent over the last quarter
/// second, after one second at least: every flow is in the flowtable), or
/// [`ESTABLISH_MAX`] passes. Returns the offloaded and all connections
/// conntrack lists afterwards.
fn establish_flowtable(topo: &Topology, sink: &SinkSide, spec: &GenSpec, flows: u64) -> Result<(u64, u64), BenchError> {
    let mut slow = spec.clone();
    slow.engine = Engine::AfPacket;
    slow.rate = Some(ESTABLISH_PPS);
    let gen = Running::start(slow)?;
    let t0 = Instant::now();
    let mut last = (slow_path_packets(topo)?, gen.sent()?);
    let mut last_share = 1.0;
    while t0.elapsed() < ESTABLISH_MAX {
        sink.sink.set_reply_generation(next_reply_generation())?;
        sleep_checked(0.25)?;
        let now = (slow_path_packets(topo)?, gen.sent()?);
        let (through_chain, sent) = (now.0.saturating_sub(last.0), now.1.saturating_sub(last.1));
        last = now;
        last_share = through_chain as f64 / sent.max(1) as f64;
        if t0.elapsed() >= Duration::from_secs(1) && last_share <= 0.01 {
            break;
        }
    }
    sink.sink.set_reply_generation(0)?;
    drop(gen);
    let (offloaded, all) = conntrack_offloaded(topo)?;
    eprintln!(
        "  kernel-flowtable: after {:.1} s at {ESTABLISH_PPS} pps, {:.1}% of the last quarter second's frames took the forward chain; conntrack: {offloaded} of {all} connections [OFFLOAD] ({flows} flows sent)",
        t0.elapsed().as_secs_f64(),
        last_share * 100.0
    );
    Ok((offloaded, all))
}

/// A reply generation for the sink not used before in this run.
fn next_reply_generation() -> u32 {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Offered, forwarded and CPU counters at one instant: the midpoint of the
/// reads (a few hundred microseconds apart unless the reader is preempted).
fn sample_all(
    gen: &Running,
    sink: &SinkSide,
    watched: &[Watched],
) -> Result<(Instant, u64, SinkCounts, Snapshot), BenchError> {
    let before = Instant::now();
    let offered = gen.sent()?;
    let counts = sink.sink.counts()?;
    let snap = Snapshot::take(watched)?;
    let after = Instant::now();
    Ok((before + (after - before) / 2, offered, counts, snap))
}

/// Egret's metrics now (empty for other modes).
fn scrape(gateway: &Gateway<'_>) -> Result<BTreeMap<String, f64>, BenchError> {
    match &gateway.metrics {
        Some((ns, port)) => egret::scrape(ns, *port).map_err(|reason| BenchError::Metrics { reason }),
        None => Ok(BTreeMap::new()),
    }
}

/// The transport `mode`'s frames use under `opts`: new-connection and
/// encapsulated modes always send UDP.
pub fn proto_of(mode: Mode, opts: &Options) -> Proto {
    if mode.new_flows() || mode.encapsulated() {
        Proto::Udp
    } else {
        opts.proto
    }
}

/// The source ports of a TCP window's connections: from [`crate::frame::BASE_PORT`]
/// plus `used` (the ports earlier windows on this gateway set-up took), or
/// from the base again when they would not fit below 65536.
pub fn tcp_base_port(used: u32, ports: u32) -> u16 {
    let base = u32::from(crate::frame::BASE_PORT);
    if base + used + ports > 65_536 {
        crate::frame::BASE_PORT
    } else {
        (base + used) as u16
    }
}

/// Measure one window of `mode` with `flows` (ignored for new-flow modes).
/// `next_fresh` is the new-flow counter, advanced past what was sent.
/// `tcp_ports` counts the source ports TCP windows used on this gateway
/// set-up: each TCP window's connections are new ones (their own ports),
/// with their own handshake.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    topo: &Topology,
    gateway: &Gateway<'_>,
    sink: &SinkSide,
    opts: &Options,
    flows: u32,
    round: u32,
    next_fresh: &mut u64,
    tcp_ports: &mut u32,
) -> Result<Sample, BenchError> {
    let mode = gateway.mode;
    let proto = proto_of(mode, opts);
    let mut flow_set =
        if mode.new_flows() { FlowSet::new_flows() } else { FlowSet::fixed(flows).with_train(opts.train) };
    if proto == Proto::Tcp {
        let base = tcp_base_port(*tcp_ports, flow_set.ports);
        flow_set = flow_set.with_base_port(base);
        *tcp_ports = u32::from(base - crate::frame::BASE_PORT) + flow_set.ports;
    }
    let spec = GenSpec {
        engine: opts.engine,
        netns: topo.gen_ns.clone(),
        dev: topology::GEN_IF.into(),
        cpu: opts.gen_cpu,
        // On-link, the pods' frames come from the generator's MAC. In the
        // tunnel, the pod's frame is the inner one (between the node's
        // VXLAN device's MAC and itself), and the outer frame comes from
        // the router (gen0) to the gateway.
        frame: FrameSpec {
            src_mac: if mode.encapsulated() { topology::NODE_GNV_MAC } else { topology::GEN_MAC },
            dst_mac: if mode.encapsulated() { topology::NODE_GNV_MAC } else { topology::GW_IN_MAC },
            dst_ip: topology::SINK_IP,
            dst_port: topology::SINK_PORT,
            proto,
        },
        encap: mode.encapsulated().then_some(VxlanSpec {
            outer_src_mac: topology::GEN_MAC,
            outer_dst_mac: topology::GW_IN_MAC,
            node: topology::NODE_IP,
            next_hop: topology::EGRESS_IP,
            port: opts.tunnel_port,
        }),
        flows: flow_set,
        first_flow: if mode.new_flows() { *next_fresh } else { 0 },
        rate: opts.rate,
        nice: opts.priorities.then_some(BENCH_NICE),
    };
    let (warmup, seconds) = if mode.new_flows() { (0.5, opts.new_conns_seconds) } else { (opts.warmup, opts.seconds) };
    // The fast path offloads a UDP session once it is confirmed by a reply:
    // before the window, the flows are established at a rate the gateway's
    // slow path keeps up with, the sink answering them, until Egret has
    // installed them all. The window then measures established flows.
    sink.sink.set_reply_generation(0)?;
    let kernel_unreplied = || -> Result<u64, BenchError> { Ok(count_unreplied_tcp(&conntrack_text(topo)?).0) };
    if proto == Proto::Tcp && mode.stateful() {
        let check: Option<&dyn Fn() -> Result<u64, BenchError>> =
            if mode.kernel() { Some(&kernel_unreplied) } else { None };
        handshake(sink, &spec, flow_set.flows, check)?;
    }
    // The kernel: every connection of the window must have seen its
    // SYN-ACK. One conntrack still lists `[UNREPLIED]` (SYN_SENT) takes the
    // window's ACKs as INVALID and lets them through untranslated: not the
    // SNAT path. (Earlier windows' connections are established by now, so
    // the unreplied ones are this window's.)
    let unreplied = if proto == Proto::Tcp && mode.kernel() {
        let (unreplied, all) = count_unreplied_tcp(&conntrack_text(topo)?);
        eprintln!(
            "  conntrack: {unreplied} of {all} TCP connections [UNREPLIED] after the handshake ({} this window)",
            flow_set.flows
        );
        Some(unreplied)
    } else {
        None
    };
    if mode.fast_path() {
        establish_fast_path(gateway, sink, &spec, u64::from(flows))?;
    }
    let offloaded = if mode == Mode::KernelFlowtable {
        Some(establish_flowtable(topo, sink, &spec, flow_set.flows)?)
    } else {
        None
    };
    let mut gen = Running::start(spec)?;
    let result = (|| -> Result<Sample, BenchError> {
        sleep_checked(warmup)?;
        // Slowest reads outermost: interface counters (four `ip` runs), then
        // Egret's metrics, then the window's own counters.
        let l0 = topo.link_counters()?;
        let f0 = if mode == Mode::KernelFlowtable { Some(slow_path_packets(topo)?) } else { None };
        let m0 = scrape(gateway)?;
        let (t0, o0, s0, c0) = sample_all(&gen, sink, &gateway.watched)?;
        sleep_checked(seconds)?;
        let (t1, o1, s1, c1) = sample_all(&gen, sink, &gateway.watched)?;
        let m1 = scrape(gateway)?;
        let f1 = if mode == Mode::KernelFlowtable { Some(slow_path_packets(topo)?) } else { None };
        let l1 = topo.link_counters()?;
        let links = l1.iter().map(|(k, v)| (k.clone(), v.since(&l0.get(k).copied().unwrap_or_default()))).collect();
        let egret_metrics = m1
            .iter()
            .filter(|(k, _)| k.split('{').next().is_some_and(|n| n.ends_with("_total")))
            .map(|(k, v)| (k.clone(), v - m0.get(k).copied().unwrap_or(0.0)))
            .collect();
        Ok(Sample {
            egret_metrics,
            links,
            mode,
            proto,
            flows: if mode.new_flows() { 0 } else { u64::from(flows.max(1)) },
            round,
            seconds: (t1 - t0).as_secs_f64(),
            offered: o1 - o0,
            sink: s1.since(&s0),
            cpu: cpu::window(&c0, &c1, opts.user_hz, opts.gw_cpu, opts.gen_cpu)?,
            slow_path: f0.zip(f1).map(|(a, b)| b.saturating_sub(a)),
            offloaded,
            unreplied,
        })
    })();
    let total = gen.finish()?;
    if mode.new_flows() {
        *next_fresh += total + 1;
    }
    // Let the gateway drain before the next window.
    sleep_checked(0.3)?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flowtable_ruleset_covers_both_interfaces_and_counts_the_slow_path() {
        let r = flowtable_ruleset(&["gwin", "gwout"]);
        assert!(r.starts_with("table inet egret_bench_ft {\n"), "{r}");
        assert!(r.contains("counter slow_path { }"), "{r}");
        assert!(r.contains("flowtable ft {\n    hook ingress priority 0; devices = { \"gwin\", \"gwout\" };"), "{r}");
        assert!(r.contains("type filter hook forward priority 0; policy accept;"), "{r}");
        assert!(r.contains("meta l4proto { tcp, udp } counter name \"slow_path\" flow add @ft"), "{r}");
        assert_eq!(r.matches('{').count(), r.matches('}').count(), "{r}");
    }

    #[test]
    fn nft_counter_json_is_read() {
        let text = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}, {"counter": {"family": "inet", "name": "slow_path", "table": "egret_bench_ft", "handle": 2, "packets": 1234, "bytes": 74040}}]}"#;
        assert_eq!(nft_counter_packets(text), Some(1234));
        assert_eq!(nft_counter_packets(r#"{"nftables": [{"metainfo": {}}]}"#), None);
        assert_eq!(nft_counter_packets("Error: No such file or directory"), None);
    }

    #[test]
    fn offloaded_connections_are_counted_from_conntrack() {
        let text = "\
ipv4     2 udp      17 29 src=198.18.1.0 dst=198.51.100.1 sport=1024 dport=9 src=198.51.100.1 dst=203.0.113.10 sport=9 dport=1024 [OFFLOAD] mark=0 zone=0 use=3
ipv4     2 udp      17 27 src=198.18.1.1 dst=198.51.100.1 sport=1024 dport=9 src=198.51.100.1 dst=203.0.113.10 sport=9 dport=1025 mark=0 zone=0 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src=198.18.1.2 dst=198.51.100.1 sport=1024 dport=9 src=198.51.100.1 dst=203.0.113.10 sport=9 dport=1026 [OFFLOAD] [ASSURED] mark=0 zone=0 use=3
";
        assert_eq!(count_offloaded(text), (2, 3));
        assert_eq!(count_offloaded(""), (0, 0));
    }

    #[test]
    fn unreplied_tcp_connections_are_counted_from_conntrack() {
        let text = "\
ipv4     2 tcp      6 113 SYN_SENT src=198.18.1.9 dst=198.51.100.1 sport=1031 dport=9 [UNREPLIED] src=198.51.100.1 dst=203.0.113.10 sport=9 dport=10585 mark=0 zone=0 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src=198.18.1.2 dst=198.51.100.1 sport=1024 dport=9 src=198.51.100.1 dst=203.0.113.10 sport=9 dport=1026 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 58 SYN_RECV src=198.18.1.3 dst=198.51.100.1 sport=1024 dport=9 src=198.51.100.1 dst=203.0.113.10 sport=9 dport=1027 mark=0 zone=0 use=2
ipv4     2 udp      17 29 src=198.18.1.0 dst=198.51.100.1 sport=1024 dport=9 [UNREPLIED] src=198.51.100.1 dst=203.0.113.10 sport=9 dport=1024 mark=0 zone=0 use=2
";
        assert_eq!(count_unreplied_tcp(text), (1, 3));
        assert_eq!(count_unreplied_tcp(""), (0, 0));
    }

    fn kernel_tcp_sample(frames: u64, translated: u64, unreplied: Option<u64>) -> Sample {
        Sample {
            mode: Mode::Kernel,
            proto: Proto::Tcp,
            flows: 50_000,
            round: 0,
            seconds: 1.0,
            offered: frames,
            egret_metrics: BTreeMap::new(),
            links: BTreeMap::new(),
            sink: SinkCounts { frames, translated, ..SinkCounts::default() },
            cpu: cpu::WindowUse {
                threads: Vec::new(),
                gateway_cpu_s: 1.0,
                core_busy_s: 1.0,
                core_softirq_s: 0.0,
                core_irq_s: 0.0,
                core_steal_s: 0.0,
                other_core_busy_s: 1.0,
            },
            slow_path: None,
            offloaded: None,
            unreplied,
        }
    }

    #[test]
    fn untranslated_kernel_tcp_windows_are_invalid() {
        // The first run's kernel TCP windows: every segment untranslated.
        let s = kernel_tcp_sample(1_000_000, 0, Some(50_000));
        assert_eq!(s.invalid().len(), 2, "{:?}", s.invalid());
        assert!(s.invalid()[0].contains("1000000 of 1000000 frames reached the sink untranslated"));
        assert!(s.invalid()[1].contains("no SYN-ACK for 50000 of 50000"));
        // A few lost SYN-ACKs: flagged, still the SNAT path.
        let s = kernel_tcp_sample(1_000_000, 996_000, Some(60));
        assert!(s.invalid().is_empty(), "{:?}", s.invalid());
        assert_eq!(s.problems(), ["4000 of 1000000 frames reached the sink untranslated"]);
        assert!(kernel_tcp_sample(1_000_000, 1_000_000, Some(0)).problems().is_empty());
    }

    #[test]
    fn tcp_windows_get_ports_of_their_own() {
        // 1, 4,000 and 50,000 flows: 1, 20 and 250 ports per address.
        let mut used = 0u32;
        let mut bases = Vec::new();
        for flows in [1u32, 4000, 50_000] {
            let set = FlowSet::fixed(flows);
            let base = tcp_base_port(used, set.ports);
            bases.push(base);
            used = u32::from(base - crate::frame::BASE_PORT) + set.ports;
        }
        assert_eq!(bases, [1024, 1025, 1045]);
        assert_eq!(used, 271);
        // Back to the base rather than past 65535.
        assert_eq!(tcp_base_port(64_400, 250), 1024);
        assert_eq!(tcp_base_port(64_262, 250), 65_286);
    }

    #[test]
    fn modes_name_and_classify() {
        assert_eq!(Mode::KernelFlowtable.name(), "kernel-flowtable");
        assert!(Mode::KernelFlowtable.kernel() && Mode::KernelFlowtable.translates());
        assert!(!Mode::KernelFlowtable.uses_egret() && !Mode::KernelFlowtable.fast_path());
        assert!(!Mode::Redirect.stateful() && Mode::Kernel.stateful() && Mode::Fastpath.stateful());
        let opts = Options {
            engine: Engine::Xdp,
            gen_cpu: 0,
            gw_cpu: 1,
            seconds: 1.0,
            warmup: 1.0,
            new_conns_seconds: 1.0,
            rate: None,
            egret: PathBuf::new(),
            workdir: PathBuf::new(),
            metrics_port: 1,
            user_hz: 100,
            priorities: false,
            fast_path_sessions: None,
            train: 16,
            tunnel_port: 6082,
            proto: Proto::Tcp,
            translog_sinks: crate::egret::TranslogSinks::Both,
            translog_port_blocks: None,
            translog_ring_records: None,
        };
        assert_eq!(proto_of(Mode::Kernel, &opts), Proto::Tcp);
        assert_eq!(proto_of(Mode::KernelFlowtable, &opts), Proto::Tcp);
        assert_eq!(proto_of(Mode::NewConns, &opts), Proto::Udp, "new flows are UDP");
        assert_eq!(proto_of(Mode::FastpathVxlan, &opts), Proto::Udp, "the tunnel modes send UDP");
    }
}
