//! `egret gateway --config FILE`: the gateway daemon.
//!
//! Start-up, in an order that never lets a steered frame meet a missing
//! piece ([`run_gateway_with`], then `run`, the composition of steps 2 to 5
//! and what follows them; each step returns what the next one needs):
//!
//! 1. read and validate the file (`config`);
//! 2. `find_interfaces`: dump the kernel's links (`netlink`) to find the
//!    interfaces, their indexes and RX queue counts;
//! 3. `load_and_apply`: create the engine and load the XDP program; apply
//!    the tables (engine + owned addresses + policy maps) through
//!    [`GatewaySink`];
//!    With `xdp.fastPath` (the default) the fast path's shared half is made
//!    and registered as the engine's offload hook before the first apply,
//!    so the first apply already fences;
//! 4. `start_workers`: one worker per RX queue index, each owning AF_XDP
//!    sockets on every configured interface for that queue (shared UMEM),
//!    registered in the XSKMAP under (interface, queue); threads
//!    `egret-worker-N`; and the offload manager, thread `egret-offload`
//!    (crate::offload);
//! 5. `attach_and_serve`: attach the program (bpf_link) to every
//!    interface; serve the RX queues a driver added at attach (virtio_net
//!    does) with more workers, or fail the start when they cannot be;
//!    start the netlink
//!    watcher, the admin socket and the metrics server; announce the owned
//!    addresses. `/ready` answers 200 from here on, once the gateways of the
//!    routes in use are resolved (before that, 503 with the ones that are not).
//!
//! Then `start_kubernetes` starts, in Kubernetes mode, the control plane
//! and its watchdog, and `log_running` logs `gateway running`.
//!
//! `SIGHUP` re-reads the file and applies it through the same sink; a bad
//! file is logged and counted, and the old configuration stays. An apply
//! the sink refuses (too large for the maps, fail-closed rules not
//! installed) is logged with what the gateway runs instead and counted
//! the same way (`config_reload_failures_total`). Settings
//! that only apply at start are reported (`serve_signals`, `reload`).
//! `SIGTERM`/`SIGINT`: workers stop, the links are dropped (the program is
//! detached), the admin socket file is removed, exit 0 (`shut_down`).

mod fail_closed_repair;
mod grow_ahead;
mod multicast;
mod port_map;
mod port_use;
pub mod sink;
mod view;

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_bpf::{LoadOptions, SteeringProgram, XdpLink};
use egret_dataplane::engine::Engine;
use egret_dataplane::kernel_tx::KernelTx;
use egret_dataplane::worker::{Worker, WorkerConfig};
use egret_dataplane::xsk::{PortId, PortSpec, SocketConfig, UmemConfig, XskConfig, XskCounters, XskPorts};
use parking_lot::Mutex;
use tokio::signal::unix::{signal, SignalKind};

use crate::config::{self, ConfigErrors, GatewayConfig, Queues, Role};
use crate::netlink::Watcher;
use crate::offload::{FastPath, OffloadManager};
use crate::sink::TablesSink;
use egret_dataplane::clock::{EngineClock, SCALE_ENV};
use egret_dataplane::handler::{AnnounceQueue, EngineHandler, HandlerStats};
use sink::GatewaySink;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The file is invalid.
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    /// A mode this binary does not run.
    #[error("{0}")]
    Unsupported(String),
    /// An interface is missing.
    #[error("interfaces[{index}].name: {name:?}: no such interface")]
    NoInterface {
        /// Position in the file.
        index: usize,
        /// The name.
        name: String,
    },
    /// A step of start-up failed. Its message shows the source's whole
    /// chain (`{:#}`), as one log line; `source()` gives the error itself.
    #[error("{step}: {source:#}")]
    Start {
        /// What was being done.
        step: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync + 'static>,
    },
    /// The Kubernetes control plane ended without being asked to (a panic,
    /// or an error); its addresses were fenced before the gateway stopped.
    #[error("the Kubernetes control plane stopped unexpectedly ({0}); every egress IP was fenced at once")]
    ControlPlaneDied(String),
}

fn start_err<E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>>(
    step: impl Into<String>,
) -> impl FnOnce(E) -> DaemonError {
    let step = step.into();
    move |source| DaemonError::Start { step, source: source.into() }
}

/// One driven interface.
#[derive(Debug, Clone)]
pub struct Driven {
    /// Name.
    pub name: String,
    /// Index.
    pub ifindex: u32,
    /// Role.
    pub role: Role,
    /// MAC.
    pub mac: [u8; 6],
    /// RX queues served.
    pub queues: u32,
}

/// A worker as the daemon tracks it.
#[derive(Debug)]
pub struct WorkerHandle {
    /// Its queue.
    pub queue: u32,
    /// CPU it is pinned to.
    pub cpu: Option<usize>,
    /// Set while its loop runs.
    pub running: Arc<AtomicBool>,
    /// Loop counters.
    pub loop_stats: Arc<egret_dataplane::worker::LoopStats>,
    /// Handler counters.
    pub handler_stats: Arc<HandlerStats>,
    /// (interface name, socket counters) per port.
    pub sockets: Vec<(String, Arc<XskCounters>)>,
    /// Taken and joined at the stop, whoever else still holds the state
    /// (the admin and metrics servers' views of it).
    thread: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
}

/// Everything the admin socket and metrics look at.
pub struct Shared {
    /// The running configuration (restart-only fields as started).
    pub config: Mutex<GatewayConfig>,
    /// The engine.
    pub engine: Engine,
    /// The XDP program.
    pub program: Arc<SteeringProgram>,
    /// The sink.
    pub sink: Arc<GatewaySink>,
    /// The fast path, when `xdp.fastPath` is on.
    pub fast_path: Option<Arc<FastPath>>,
    /// Engine time (sessions' idle times are shown in it).
    pub clock: EngineClock,
    /// Interfaces.
    pub interfaces: Vec<Driven>,
    /// Workers.
    pub workers: Vec<WorkerHandle>,
    /// Whether the program is attached.
    pub attached: AtomicBool,
    /// Set when stopping.
    pub stopping: AtomicBool,
    /// Reloads rejected.
    pub reload_failures: AtomicU64,
    /// Reloads applied.
    pub reloads: AtomicU64,
    /// Settings changed on reload that need a restart.
    pub restart_pending: Mutex<Vec<String>>,
    /// Start time.
    pub started: Instant,
    /// Whether the routes' next hops are resolved (netlink.rs).
    pub next_hops: Arc<crate::netlink::NextHopStatus>,
    /// Kubernetes mode: the sync loop's heartbeat and report (set once it starts).
    pub cluster: std::sync::OnceLock<Arc<crate::k8s::Heartbeat>>,
    /// The translation log exporter's counters, when logging is on.
    pub translog: Option<Arc<crate::translog::Stats>>,
    /// The translation logs' journal directory, when the journal is on
    /// (`egret who-had` reads it).
    pub journal_dir: Option<PathBuf>,
    /// Port use per destination and pod, and its warnings (crate::port_use).
    pub port_use: Arc<crate::port_use::Monitor>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared").field("interfaces", &self.interfaces).finish_non_exhaustive()
    }
}

/// Why the gateway is not ready (`/ready` answers 503 with it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// The XDP program is not attached yet.
    #[error("the XDP program is not attached")]
    NotAttached,
    /// The gateway is stopping.
    #[error("stopping")]
    Stopping,
    /// A worker (its RX queue) is not running.
    #[error("worker {queue} is not running")]
    Worker {
        /// The worker's queue.
        queue: u32,
    },
    /// The forwarding snapshot is not ready.
    #[error(transparent)]
    NextHops(#[from] crate::netlink::NextHopsNotReady),
    /// Kubernetes mode: no pass has loaded the cluster's state yet.
    #[error("the Kubernetes state is not loaded yet")]
    ClusterNotLoaded,
    /// Kubernetes mode: this gateway is the first standby for these IPs and
    /// has no complete copy of their sessions yet.
    #[error("waiting for the session copies this gateway stands by for: {ips:?}")]
    StandbyPending {
        /// The IPs.
        ips: Vec<IpAddr>,
    },
}

/// Why the gateway counts as dead (`/healthz` answers 503 with it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the Kubernetes sync loop has not run for {} ms", silent.as_millis())]
pub struct NotAlive {
    /// Since its last pass.
    pub silent: Duration,
}

impl Shared {
    /// Attached, every worker running, not stopping, and the next hops of
    /// the routes in use resolved.
    pub fn ready(&self) -> bool {
        self.not_ready().is_none()
    }

    /// Why the gateway is not ready (`/ready` answers 503 with it), or `None`.
    pub fn not_ready(&self) -> Option<NotReady> {
        if !self.attached.load(Ordering::Acquire) {
            return Some(NotReady::NotAttached);
        }
        if self.stopping.load(Ordering::Acquire) {
            return Some(NotReady::Stopping);
        }
        if let Some(w) = self.workers.iter().find(|w| !w.running.load(Ordering::Acquire)) {
            return Some(NotReady::Worker { queue: w.queue });
        }
        if let Some(n) = self.next_hops.not_ready() {
            return Some(NotReady::NextHops(n));
        }
        if let Some(hb) = self.cluster.get() {
            match hb.report() {
                None => return Some(NotReady::ClusterNotLoaded),
                Some(r) if !r.standby_pending.is_empty() => {
                    return Some(NotReady::StandbyPending { ips: r.standby_pending })
                }
                Some(_) => {}
            }
        }
        None
    }

    /// Why the Kubernetes control plane counts as dead (the liveness probe,
    /// `/healthz`): it stopped beating for longer than `limit`.
    pub fn not_alive(&self, limit: Duration) -> Option<NotAlive> {
        let hb = self.cluster.get()?;
        match hb.age(tokio::time::Instant::now().into_std()) {
            Some(age) if age > limit => Some(NotAlive { silent: age }),
            _ => None,
        }
    }
}

/// The addresses to announce for `spec`: every answered egress IP and neighbour address.
fn announced(spec: &egret_dataplane::tables::TablesSpec) -> Vec<IpAddr> {
    let mut v: Vec<IpAddr> = spec.egress_ips.iter().filter(|e| e.answer_neighbor).map(|e| e.ip).collect();
    v.extend(spec.neighbor_addresses.iter().copied());
    v
}

/// The RX queues in use on `name` (`/sys/class/net/NAME/queues/rx-*`: the
/// real count; rtnetlink's `IFLA_NUM_RX_QUEUES` is the allocated count, and
/// binding beyond the real count fails with EINVAL).
fn rx_queues(name: &str) -> Option<u32> {
    let dir = std::fs::read_dir(format!("/sys/class/net/{name}/queues")).ok()?;
    let n = dir.filter_map(Result::ok).filter(|e| e.file_name().to_string_lossy().starts_with("rx-")).count();
    u32::try_from(n).ok().filter(|n| *n > 0)
}

/// Runs the gateway until SIGTERM/SIGINT.
pub fn run_gateway(path: &Path) -> Result<(), DaemonError> {
    run_gateway_with(path, None)
}

/// [`run_gateway`], serving `/metrics` and `/ready` on `metrics_listen`
/// instead of the file's `metrics.listen` when given (`egret gateway
/// --metrics-listen`: in a host-network pod, the Node's address from the
/// downward API, which a file shared by every gateway cannot hold). It
/// holds across `SIGHUP` reloads too.
pub fn run_gateway_with(path: &Path, metrics_listen: Option<SocketAddr>) -> Result<(), DaemonError> {
    let mut cfg = config::load(path)?;
    config::default_route::resolve(&mut cfg)?;
    if let Some(a) = metrics_listen {
        cfg.metrics_listen = a;
    }
    for w in &cfg.warnings {
        tracing::warn!(warning = %w, "configuration");
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(start_err("tokio runtime"))?;
    rt.block_on(run(path.to_path_buf(), cfg, metrics_listen))
}

/// Anti-spoofing (dataplane ingress.rs; the XDP program's rule 5a): each
/// attached interface's role and allowed pod senders, written into the
/// engine and the program before anything is attached.
fn set_interface_roles(
    engine: &Engine,
    program: &SteeringProgram,
    interfaces: &[Driven],
    cfg: &GatewayConfig,
) -> Result<(), DaemonError> {
    use egret_dataplane::ingress::{Ingress, IngressRole, InterfaceIngress};
    let mut rules = Vec::new();
    for i in interfaces {
        let macs =
            cfg.interfaces.iter().find(|c| c.name == i.name).map(|c| c.pod_source_macs.clone()).unwrap_or_default();
        let (role, bpf_role) = match i.role {
            Role::Inside => (IngressRole::Inside, egret_bpf::ROLE_INSIDE),
            Role::Outside => (IngressRole::Outside, egret_bpf::ROLE_OUTSIDE),
            Role::Both => (IngressRole::Both, egret_bpf::ROLE_BOTH),
        };
        if role == IngressRole::Both && macs.is_empty() {
            // Not an error (a one-arm lab or a trusted segment), but the
            // operator should know what it leaves open (docs/operations.md,
            // "Guarantees", anti-spoofing).
            tracing::warn!(
                interface = %i.name,
                "one-arm interface without podSourceMacs: a frame from any sender on this link with a selected \
                 pod's source address is translated; list the node routers' MACs to restrict it"
            );
        }
        let flags = if macs.is_empty() { 0 } else { egret_bpf::IF_CHECK_SRC_MAC };
        program
            .set_interface_role(i.ifindex, egret_bpf::IfRole { role: bpf_role, flags }, &macs)
            .map_err(start_err(format!("setting the role of {}", i.name)))?;
        rules.push(InterfaceIngress { ifindex: i.ifindex, role, pod_source_macs: macs });
    }
    engine.set_ingress(Ingress::new(rules));
    Ok(())
}

/// What every worker is made from: one per RX queue index, owning an
/// AF_XDP socket on every interface with that queue (one shared UMEM).
struct WorkerFactory {
    xsk: XskConfig,
    engine: Engine,
    program: Arc<SteeringProgram>,
    clock: EngineClock,
    nworkers: u32,
    announce: AnnounceQueue,
    stop: Arc<AtomicBool>,
}

impl WorkerFactory {
    /// Opens the sockets of `queue` on the interfaces `on`, registers them
    /// in the XSKMAP and starts the worker's thread.
    fn spawn(&self, queue: u32, on: &[&Driven], w: &config::WorkersConfig) -> Result<WorkerHandle, DaemonError> {
        let specs: Vec<PortSpec> = on.iter().map(|i| PortSpec { ifindex: i.ifindex, queue }).collect();
        let ports =
            XskPorts::open(&self.xsk, &specs).map_err(start_err(format!("AF_XDP sockets for queue {queue}")))?;
        let mut sockets = Vec::new();
        for (p, i) in on.iter().enumerate() {
            let port = PortId(p as u16);
            let fd = ports.raw_fd(port).unwrap_or(-1);
            self.program
                .register_xsk(i.ifindex, queue, fd)
                .map_err(start_err(format!("registering {} queue {queue}", i.name)))?;
            if let Some(c) = ports.counters(port) {
                sockets.push((i.name.clone(), c));
            }
        }
        let cpu = if w.cpus.is_empty() { None } else { w.cpus.get(queue as usize % w.cpus.len()).copied() };
        let wc = WorkerConfig {
            batch_size: w.batch as usize,
            cpu,
            realtime_priority: (w.realtime_priority > 0).then_some(i32::from(w.realtime_priority)),
            ..WorkerConfig::default()
        };
        let handler_stats = Arc::new(HandlerStats::default());
        // Translated packets to pods behind an overlay's tunnel go to the
        // kernel (kernel_tx.rs); one pair of raw sockets per worker.
        let kernel = KernelTx::open().map_err(start_err(format!("worker {queue}'s kernel hand-off")))?;
        if !kernel.has_ipv6() && queue == 0 {
            tracing::warn!("the kernel has no IPv6: replies to IPv6 pods behind a tunnel cannot be handed to it");
        }
        let handler = EngineHandler::new(
            &self.engine,
            on.iter().map(|i| i.ifindex).collect(),
            self.clock,
            self.nworkers,
            handler_stats.clone(),
            (queue == 0).then(|| self.announce.clone()),
            kernel,
        );
        let mut worker =
            Worker::new(ports, handler, wc, self.stop.clone()).map_err(start_err(format!("worker {queue}")))?;
        let loop_stats = worker.stats();
        let running = Arc::new(AtomicBool::new(false));
        let flag = running.clone();
        let thread = std::thread::Builder::new()
            .name(format!("egret-worker-{queue}"))
            .spawn(move || {
                flag.store(true, Ordering::Release);
                if let Err(e) = worker.run() {
                    tracing::error!(queue, error = %e, "worker stopped");
                }
                flag.store(false, Ordering::Release);
            })
            .map_err(start_err(format!("spawning worker {queue}")))?;
        Ok(WorkerHandle {
            queue,
            cpu,
            running,
            loop_stats,
            handler_stats,
            sockets,
            thread: parking_lot::Mutex::new(Some(thread)),
        })
    }
}

/// After the program attached: the interfaces serving all their queues
/// whose RX queue count grew get workers for the new queue indexes. A new
/// queue index that already has a worker (for other interfaces, with its
/// own UMEM) cannot take one more socket: the gateway does not start (it
/// would hold its egress IPs while the flows the NIC spreads onto those
/// queues are dropped), and the error says how to fix it. The same holds
/// for a worker that cannot be made: start-up fails, the links go.
fn serve_added_queues(
    interfaces: &mut [Driven],
    cfg: &GatewayConfig,
    factory: &WorkerFactory,
    workers: &mut Vec<WorkerHandle>,
    w: &config::WorkersConfig,
) -> Result<(), DaemonError> {
    let before = workers.len() as u32;
    for (i, c) in interfaces.iter_mut().zip(&cfg.interfaces) {
        if c.queues != Queues::All {
            continue;
        }
        let now = rx_queues(&i.name).unwrap_or(i.queues);
        if now <= i.queues {
            continue;
        }
        if i.queues < before {
            return Err(DaemonError::Start {
                step: format!("serving the RX queues {} gained when XDP attached", i.name),
                source: format!(
                    "queues {}-{} appeared, and queue indexes up to {} already have workers for other interfaces; \
                     give every interface the same queue count (ethtool -L {} combined N) or set interfaces[].queues",
                    i.queues,
                    now.min(before) - 1,
                    before - 1,
                    i.name
                )
                .into(),
            });
        }
        tracing::warn!(
            interface = %i.name,
            before = i.queues,
            after = now,
            "the driver added RX queues when XDP attached; serving them"
        );
        i.queues = now;
    }
    let after = interfaces.iter().map(|i| i.queues).max().unwrap_or(1);
    for queue in before..after {
        let on: Vec<&Driven> = interfaces.iter().filter(|i| queue < i.queues).collect();
        workers.push(factory.spawn(queue, &on, w)?);
    }
    Ok(())
}

/// The daemon: the start-up steps 2 to 5 of the module doc, the Kubernetes
/// control plane, the signals until a stop, the stop.
async fn run(path: PathBuf, cfg: GatewayConfig, metrics_listen: Option<SocketAddr>) -> Result<(), DaemonError> {
    let started = Instant::now();
    let kernel = find_interfaces(&cfg).await?;
    let loaded = load_and_apply(&cfg, &kernel, started)?;
    let workers = start_workers(&cfg, &kernel.interfaces, &loaded)?;
    let serving = attach_and_serve(
        &cfg,
        kernel,
        &loaded,
        &workers.factory,
        workers.handles,
        workers.translog_stats.clone(),
        started,
    )
    .await?;
    let mut cluster = start_kubernetes(&cfg, &loaded, &serving.shared).await?;
    log_running(&cfg, &serving.shared, started).await;
    let died = serve_signals(&path, &cfg, metrics_listen, &loaded, &serving.shared, &mut cluster.task).await?;
    shut_down(&cfg, serving, cluster, &workers.stop, workers.offload_thread, workers.translog).await;
    match died {
        Some(why) => Err(DaemonError::ControlPlaneDied(why)),
        None => Ok(()),
    }
}

/// Step 2's result: the kernel's links as the start-up dump found them.
struct Kernel {
    /// The configured interfaces, in the file's order.
    interfaces: Vec<Driven>,
    /// The netlink watcher, started: its state is the start-up dump; step 5
    /// runs it.
    watcher: crate::netlink::Running,
}

/// Step 2: dumps the kernel's links to find the configured interfaces,
/// their indexes and the RX queues each serves.
async fn find_interfaces(cfg: &GatewayConfig) -> Result<Kernel, DaemonError> {
    let names: Vec<String> = cfg.interfaces.iter().map(|i| i.name.clone()).collect();
    let watcher = Watcher::new(names.clone());
    let running_watcher = watcher.start().await.map_err(start_err("rtnetlink"))?;
    let mut interfaces = Vec::new();
    for (index, i) in cfg.interfaces.iter().enumerate() {
        let link = running_watcher
            .state()
            .link_by_name(&i.name)
            .ok_or_else(|| DaemonError::NoInterface { index, name: i.name.clone() })?;
        let available = rx_queues(&i.name).unwrap_or(link.rx_queues).max(1);
        let queues = match i.queues {
            Queues::All => available,
            Queues::Count(n) => n.min(available),
        };
        interfaces.push(Driven { name: i.name.clone(), ifindex: link.ifindex, role: i.role, mac: link.mac, queues });
    }
    Ok(Kernel { interfaces, watcher: running_watcher })
}

/// Step 3's result: the engine, the program and the sink, the tables applied.
struct Loaded {
    /// Engine time.
    clock: EngineClock,
    /// The engine.
    engine: Engine,
    /// The XDP program, loaded, not attached.
    program: Arc<SteeringProgram>,
    /// The fast path's shared half, when `xdp.fastPath` is on.
    fast_path: Option<Arc<FastPath>>,
    /// The addresses to announce (worker 0 sends them).
    announce: AnnounceQueue,
    /// The sink the file's tables were applied through.
    sink: Arc<GatewaySink>,
    /// The fast path's next-hop table size, as loaded (the offload manager's).
    fast_path_next_hops: u32,
    /// The pods' identities by address: the Kubernetes controller writes
    /// them, the translation log exporter reads them.
    pod_identities: crate::translog::identity::PodIdentities,
}

/// Step 3: creates the engine and loads the XDP program (the interfaces'
/// roles set), makes the fast path's shared half when `xdp.fastPath` is on,
/// and applies the file's tables through a new [`GatewaySink`].
fn load_and_apply(cfg: &GatewayConfig, kernel: &Kernel, started: Instant) -> Result<Loaded, DaemonError> {
    let interfaces = &kernel.interfaces;
    let clock = EngineClock::from_env(started);
    if clock.scale() != 1 {
        tracing::warn!(
            scale = clock.scale(),
            "{SCALE_ENV} is set: engine time runs faster than real time (tests only)"
        );
    }
    let engine = Engine::new(&cfg.tables).map_err(start_err("engine"))?;
    // Before any worker is made: each gets its ring (translog/).
    if let Some(t) = &cfg.translation_logs {
        engine.enable_translog(t.ring_records);
    }
    let sessions = cfg.xdp.table_sessions();
    let load = LoadOptions {
        xsk_interfaces: interfaces.len() as u32,
        fast_path_sessions_v4: sessions.ipv4,
        fast_path_sessions_v6: sessions.ipv6,
        ..LoadOptions::default()
    };
    let program = Arc::new(SteeringProgram::load(load).map_err(start_err("loading the XDP program"))?);
    set_interface_roles(&engine, &program, interfaces, cfg)?;
    port_map::connect(&engine, &program);
    let fast_path = if cfg.xdp.fast_path {
        let fp = Arc::new(
            FastPath::new(program.clone(), clock, cfg.tables.nat.udp_inbound_refresh)
                .map_err(start_err("enabling the XDP fast path"))?,
        );
        fp.connect(&engine);
        Some(fp)
    } else {
        program.fp_set_enabled(false).map_err(start_err("disabling the XDP fast path"))?;
        None
    };
    let announce: AnnounceQueue = Arc::default();
    let sink = Arc::new(GatewaySink::new(
        engine.clone(),
        program.clone(),
        interfaces.iter().map(|i| (i.ifindex, i.role)).collect(),
        announce.clone(),
        fast_path.clone(),
        clock,
    ));
    if cfg.kubernetes.is_some() {
        // The file's tables are a placeholder: keep the kernel's fail-closed
        // table until the control plane applies the cluster's (failclosed.rs).
        sink.fail_closed.hold();
    }
    // The node's addresses as the start-up dump found them: the first apply
    // excludes them already (later changes re-apply, step 5's netlink task).
    sink.set_node_addresses(kernel.watcher.state().local_addresses());
    sink.apply(&cfg.tables).map_err(start_err("applying the configuration"))?;
    Ok(Loaded {
        clock,
        engine,
        program,
        fast_path,
        announce,
        sink,
        fast_path_next_hops: load.fast_path_next_hops,
        pod_identities: Default::default(),
    })
}

/// Step 4's result: the workers and the offload manager, running.
struct Workers {
    /// Set to stop the workers and the offload manager.
    stop: Arc<AtomicBool>,
    /// Makes the workers of RX queues a driver adds at attach (step 5).
    factory: WorkerFactory,
    /// One per RX queue index, from 0.
    handles: Vec<WorkerHandle>,
    /// The offload manager's thread, with the fast path.
    offload_thread: Option<std::thread::JoinHandle<()>>,
    /// The translation log exporter's thread and its own stop flag (set
    /// once the workers are gone, so their last records are sent).
    translog: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
    /// The exporter's counters (for `/metrics` and `egret counters`).
    translog_stats: Option<Arc<crate::translog::Stats>>,
}

/// Step 4: one worker per RX queue index, each owning AF_XDP sockets on
/// every interface with that queue (registered in the XSKMAP), and the
/// offload manager when the fast path is on.
fn start_workers(cfg: &GatewayConfig, interfaces: &[Driven], loaded: &Loaded) -> Result<Workers, DaemonError> {
    let stop = Arc::new(AtomicBool::new(false));
    let nworkers = interfaces.iter().map(|i| i.queues).max().unwrap_or(1);
    let w = &cfg.workers;
    let xsk = XskConfig {
        umem: UmemConfig { frame_size: w.frame_size, frame_count: w.frames },
        socket: SocketConfig {
            rx_size: w.ring_size,
            tx_size: w.ring_size,
            fill_size: w.ring_size,
            comp_size: w.ring_size,
            ..SocketConfig::default()
        },
    };
    let factory = WorkerFactory {
        xsk,
        engine: loaded.engine.clone(),
        program: loaded.program.clone(),
        clock: loaded.clock,
        nworkers,
        announce: loaded.announce.clone(),
        stop: stop.clone(),
    };
    let mut handles = Vec::new();
    for queue in 0..nworkers {
        let on: Vec<&Driven> = interfaces.iter().filter(|i| queue < i.queues).collect();
        handles.push(factory.spawn(queue, &on, w)?);
    }

    let offload_thread = match &loaded.fast_path {
        Some(fp) => {
            let manager = OffloadManager::new(fp.clone(), loaded.engine.clone(), loaded.fast_path_next_hops);
            let stop = stop.clone();
            Some(
                std::thread::Builder::new()
                    .name("egret-offload".into())
                    .spawn(move || manager.run(stop))
                    .map_err(start_err("spawning the offload manager"))?,
            )
        }
        None => None,
    };
    let translog = match &cfg.translation_logs {
        Some(t) => {
            let node = cfg
                .kubernetes
                .as_ref()
                .and_then(|k| k.node_name.clone())
                .or_else(|| std::env::var("NODE_NAME").ok())
                .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
                .unwrap_or_default();
            let exporter =
                crate::translog::Exporter::new(loaded.engine.clone(), t, &node, loaded.pod_identities.clone())
                    .map_err(start_err("opening the translation logs' sockets"))?;
            let stats = exporter.stats().clone();
            let stop = Arc::new(AtomicBool::new(false));
            let thread = crate::translog::spawn(exporter, loaded.clock, stop.clone())
                .map_err(start_err("spawning the translation log exporter"))?;
            Some(((stop, thread), stats))
        }
        None => None,
    };
    let (translog, translog_stats) = translog.unzip();
    Ok(Workers { stop, factory, handles, offload_thread, translog, translog_stats })
}

/// Step 5's result: the gateway attached and serving.
struct Serving {
    /// The program's links, one per interface (dropping them detaches it).
    links: Vec<XdpLink>,
    /// What the admin socket and the metrics look at.
    shared: Arc<Shared>,
    /// The admin socket's and the metrics server's view of `shared`, held
    /// until the daemon returns.
    view: Arc<dyn crate::view::GatewayView>,
    /// Stops the netlink task.
    stop_tx: tokio::sync::watch::Sender<bool>,
    /// The netlink watcher, running.
    netlink_task: tokio::task::JoinHandle<()>,
    /// The admin socket's server.
    admin_task: tokio::task::JoinHandle<()>,
    /// The metrics server (`/metrics`, `/ready`, `/healthz`).
    metrics_task: tokio::task::JoinHandle<()>,
    /// The fail-closed table's repair task (fail_closed_repair.rs).
    fail_closed_repair: Option<tokio::task::JoinHandle<()>>,
    /// The port-use walks (port_use.rs).
    port_use_task: tokio::task::JoinHandle<()>,
    /// The session slabs' chunks made ahead of the workers (grow_ahead.rs).
    grow_ahead_task: tokio::task::JoinHandle<()>,
}

/// Step 5: attaches the program to every interface and serves the RX queues
/// a driver added at attach; then starts the netlink watcher, the admin
/// socket and the metrics server, and announces the owned addresses.
async fn attach_and_serve(
    cfg: &GatewayConfig,
    kernel: Kernel,
    loaded: &Loaded,
    factory: &WorkerFactory,
    mut workers: Vec<WorkerHandle>,
    translog_stats: Option<Arc<crate::translog::Stats>>,
    started: Instant,
) -> Result<Serving, DaemonError> {
    let Kernel { mut interfaces, watcher: mut running_watcher } = kernel;
    let Loaded { clock, engine, program, fast_path, sink, .. } = loaded;
    let mut links: Vec<XdpLink> = Vec::new();
    for i in &interfaces {
        let link = program.attach(i.ifindex, cfg.xdp.mode).map_err(start_err(format!(
            "attaching XDP ({}) to {}",
            cfg.xdp.mode.name(),
            i.name
        )))?;
        links.push(link);
    }
    // Some drivers add RX queues when a program attaches: virtio_net with
    // twice as many queue pairs as CPUs enables one more pair per CPU for
    // XDP_TX, and the device spreads received flows over them too. Frames
    // on a queue without a socket are dropped (`drop_no_socket_steered`),
    // so serve the new queues now.
    serve_added_queues(&mut interfaces, cfg, factory, &mut workers, &cfg.workers)?;
    let shared = Arc::new(Shared {
        config: Mutex::new(cfg.clone()),
        engine: engine.clone(),
        program: program.clone(),
        sink: sink.clone(),
        fast_path: fast_path.clone(),
        clock: *clock,
        interfaces,
        workers,
        attached: AtomicBool::new(true),
        stopping: AtomicBool::new(false),
        reload_failures: AtomicU64::new(0),
        reloads: AtomicU64::new(0),
        restart_pending: Mutex::new(Vec::new()),
        started,
        next_hops: running_watcher.next_hop_status(),
        cluster: std::sync::OnceLock::new(),
        translog: translog_stats,
        journal_dir: cfg.translation_logs.as_ref().and_then(|t| t.journal.as_ref()).map(|j| j.dir.clone()),
        port_use: Arc::new(crate::port_use::Monitor::new(cfg.port_use_top)),
    });
    let view: Arc<dyn crate::view::GatewayView> = Arc::new(view::LiveView(shared.clone()));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let eng = engine.clone();
    let eng2 = engine.clone();
    running_watcher.keep_alive(engine.neighbor_use().clone());
    let addresses_sink = sink.clone();
    let netlink_task = tokio::spawn(running_watcher.run(
        move |fib| {
            // The node's addresses are every policy's exceptions; a change
            // re-applies the tables (nft and the maps: off this task).
            let local = fib.local_addresses().to_vec();
            eng.publish_fib(fib);
            if addresses_sink.node_addresses_differ(&local) {
                let sink = addresses_sink.clone();
                std::thread::spawn(move || sink.set_node_addresses(local));
            }
        },
        move || eng2.drain_resolve_requests(),
        stop_rx,
    ));

    let admin_listener = crate::admin::bind(&cfg.admin_socket).map_err(start_err("admin socket"))?;
    let admin_task = tokio::spawn(crate::admin::serve(admin_listener, view.clone()));
    let metrics_listener = tokio::net::TcpListener::bind(cfg.metrics_listen)
        .await
        .map_err(start_err(format!("metrics listener {}", cfg.metrics_listen)))?;
    let ready_shared = shared.clone();
    let alive_shared = shared.clone();
    // Dead: the sync loop silent for longer than the watchdog allows.
    let alive_limit =
        cfg.kubernetes.as_ref().map_or(Duration::MAX, |k| k.lease_duration + crate::failclosed::NFT_TIMEOUT);
    let fail_closed_repair = fail_closed_repair::spawn(sink.clone());
    let metrics_task = tokio::spawn(crate::metrics::serve(
        metrics_listener,
        view.clone(),
        Arc::new(move || ready_shared.not_ready().map_or(Ok(()), Err)),
        Arc::new(move || alive_shared.not_alive(alive_limit).map_or(Ok(()), Err)),
    ));

    let port_use_task = port_use::spawn(engine.clone(), shared.port_use.clone(), cfg.port_use_refresh);
    let grow_ahead_task = grow_ahead::spawn(engine.clone(), grow_ahead::EVERY);

    sink.announce(&announced(&cfg.tables));
    Ok(Serving {
        links,
        shared,
        view,
        stop_tx,
        netlink_task,
        admin_task,
        metrics_task,
        fail_closed_repair,
        port_use_task,
        grow_ahead_task,
    })
}

/// The Kubernetes control plane's task and its heartbeat.
type ClusterTask = (tokio::task::JoinHandle<Option<crate::k8s::uninstall::Ending>>, Arc<crate::k8s::Heartbeat>);

/// The Kubernetes control plane and its watchdog (none from the file).
struct Cluster {
    /// Asks the control plane to stop.
    stop_tx: tokio::sync::watch::Sender<bool>,
    /// The control plane, until it ends.
    task: Option<ClusterTask>,
    /// Set to stop the watchdog.
    watchdog_stop: Arc<AtomicBool>,
    /// The watchdog's thread.
    watchdog: Option<std::thread::JoinHandle<()>>,
}

/// Kubernetes mode: the cluster provides policies and egress IPs (the
/// file's tables are empty); Leases decide which IPs this gateway holds.
/// Starts the control plane ([`spawn_kubernetes`]) and its watchdog
/// ([`spawn_watchdog`]): supervision outside this runtime, a sync loop that
/// stops beating is fenced and the process ends (the data plane's
/// valid-until has already stopped serving its IPs by then; this makes the
/// gateway restart).
async fn start_kubernetes(cfg: &GatewayConfig, loaded: &Loaded, shared: &Shared) -> Result<Cluster, DaemonError> {
    let (k8s_stop_tx, k8s_stop_rx) = tokio::sync::watch::channel(false);
    let k8s_task = match &cfg.kubernetes {
        None => None,
        Some(k) => Some(
            spawn_kubernetes(
                k,
                cfg,
                loaded.sink.clone(),
                loaded.pod_identities.clone(),
                shared.port_use.clone(),
                k8s_stop_rx,
            )
            .await?,
        ),
    };
    if let Some((_, heartbeat)) = &k8s_task {
        let _ = shared.cluster.set(heartbeat.clone());
    }
    let watchdog_stop = Arc::new(AtomicBool::new(false));
    let watchdog = match (&k8s_task, &cfg.kubernetes) {
        (Some((_, heartbeat)), Some(k)) => Some(spawn_watchdog(
            heartbeat.clone(),
            loaded.sink.clone(),
            loaded.engine.clone(),
            k.lease_duration + crate::failclosed::NFT_TIMEOUT,
            watchdog_stop.clone(),
        )?),
        _ => None,
    };
    Ok(Cluster { stop_tx: k8s_stop_tx, task: k8s_task, watchdog_stop, watchdog })
}

/// Waits (briefly) for every worker thread to enter its loop, then logs
/// `gateway running`.
async fn log_running(cfg: &GatewayConfig, shared: &Shared, started: Instant) {
    for _ in 0..200 {
        if shared.ready() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tracing::info!(
        interfaces = shared.interfaces.len(),
        workers = shared.workers.len(),
        mode = cfg.xdp.mode.name(),
        fast_path = cfg.xdp.fast_path,
        startup_ms = started.elapsed().as_millis() as u64,
        ready = shared.ready(),
        "gateway running"
    );
}

/// Serves the signals until `SIGTERM`/`SIGINT` (`Ok(None)`) or until the
/// Kubernetes control plane ends unasked (`Ok(Some(why))`; every address
/// fenced, `k8s_task` emptied). `SIGHUP` reloads the file ([`reload`]).
async fn serve_signals(
    path: &Path,
    cfg: &GatewayConfig,
    metrics_listen: Option<SocketAddr>,
    loaded: &Loaded,
    shared: &Shared,
    k8s_task: &mut Option<ClusterTask>,
) -> Result<Option<String>, DaemonError> {
    let sig = |k: SignalKind| signal(k).map_err(start_err("signal handler"));
    let (mut hup, mut term, mut int) =
        (sig(SignalKind::hangup())?, sig(SignalKind::terminate())?, sig(SignalKind::interrupt())?);
    loop {
        tokio::select! {
            _ = hup.recv() => {
                if cfg.kubernetes.is_some() {
                    tracing::warn!("SIGHUP ignored in Kubernetes mode: policies come from the cluster; restart to change file settings");
                } else {
                    reload(path, shared, metrics_listen)
                }
            }
            _ = term.recv() => return Ok(None),
            _ = int.recv() => return Ok(None),
            ended = async {
                match k8s_task.as_mut() {
                    Some((task, _)) => task.await,
                    None => std::future::pending().await,
                }
            } => {
                // Nobody asked it to stop: a panic, or a fatal error. Renewals
                // and fencing have stopped with it, so fence now.
                fence_all(&loaded.sink, &loaded.engine);
                *k8s_task = None;
                let why = match ended {
                    Err(e) if e.is_panic() => "it panicked".to_string(),
                    Err(e) => e.to_string(),
                    Ok(_) => "it returned".to_string(),
                };
                tracing::error!(reason = %why, "kubernetes control plane ended; egress IPs fenced, stopping");
                return Ok(Some(why));
            }
        }
    }
}

/// The stop. In Kubernetes mode, first gives up the egress IPs (fenced out
/// of the tables, Leases released) so another gateway can take them at
/// once; then stops the watchdog, the netlink task, the workers, the admin
/// socket and the metrics server, detaches the program (drops `links`) and
/// removes the admin socket's file.
async fn shut_down(
    cfg: &GatewayConfig,
    serving: Serving,
    cluster: Cluster,
    stop: &AtomicBool,
    offload_thread: Option<std::thread::JoinHandle<()>>,
    translog: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
) {
    let Serving {
        links,
        shared,
        view,
        stop_tx,
        netlink_task,
        admin_task,
        metrics_task,
        fail_closed_repair,
        port_use_task,
        grow_ahead_task,
    } = serving;
    let Cluster { stop_tx: k8s_stop_tx, task: k8s_task, watchdog_stop, watchdog } = cluster;
    tracing::info!("stopping");
    let mut ending = None;
    if let Some((task, _)) = k8s_task {
        let _ = k8s_stop_tx.send(true);
        ending = task.await.ok().flatten();
    }
    watchdog_stop.store(true, Ordering::Release);
    if let Some(w) = watchdog {
        let _ = w.join();
    }
    shared.stopping.store(true, Ordering::Release);
    let _ = stop_tx.send(true);
    stop.store(true, Ordering::Release);
    admin_task.abort();
    metrics_task.abort();
    port_use_task.abort();
    grow_ahead_task.abort();
    if let Some(t) = fail_closed_repair {
        t.abort();
    }
    let _ = netlink_task.await;
    drop(links);
    shared.attached.store(false, Ordering::Release);
    if let Some(t) = offload_thread {
        let _ = t.join();
    }
    // The workers leave their loops on the stop flag (within a poll's
    // timeout); the views the admin and metrics servers keep of `shared`
    // do not hold them up.
    for w in &shared.workers {
        let thread = w.thread.lock().take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
    // The workers' last records, then the exporter.
    if let Some((stop, t)) = translog {
        stop.store(true, Ordering::Release);
        let _ = t.join();
    }
    let _ = std::fs::remove_file(&cfg.admin_socket);
    retire(ending);
    tracing::info!("stopped");
    drop(view);
}

/// After the stop (the egress IPs handed over, the program detached): an
/// uninstall or a retirement removes the fail-closed table too, so nothing
/// of the gateway's is left on the node; a restart keeps it (the next
/// process starts closed).
fn retire(ending: Option<crate::k8s::uninstall::Ending>) {
    match ending {
        Some(e) if e.cleans_up() => match crate::failclosed::remove() {
            Ok(()) => tracing::info!(why = e.reason(), "stopping for good: the fail-closed table removed"),
            Err(err) => {
                tracing::error!(why = e.reason(), error = %err, "stopping for good, but the fail-closed table stays")
            }
        },
        Some(e) => tracing::info!(why = e.reason(), "restart: the fail-closed table stays"),
        None => {}
    }
}

/// Exit status when the watchdog ends a stuck control plane (EX_SOFTWARE).
pub const EXIT_CONTROL_PLANE_STUCK: i32 = 70;

/// The watchdog's period, and how late a period may be before the watchdog
/// concludes the whole process was stopped (SIGSTOP, a VM pause) rather than
/// the control plane alone.
const WATCHDOG_TICK: Duration = Duration::from_millis(100);
const WATCHDOG_STALL: Duration = Duration::from_secs(1);

/// Ends the validity of every address the data plane serves, now, from any
/// thread: the workers and the XDP program stop answering and translating
/// for them before this returns (sink.rs `set_valid_until`).
fn fence_all(sink: &GatewaySink, engine: &Engine) {
    let t = engine.tables();
    let now = Instant::now();
    let all: Vec<(IpAddr, Option<Instant>)> =
        t.egress_ips().map(|(ip, _)| ip).chain(t.neighbor_addresses()).map(|ip| (ip, Some(now))).collect();
    sink.set_valid_until(&all);
}

/// A thread outside the runtime that watches the Kubernetes sync loop's
/// heartbeat: when the loop has not beaten for `limit` (it beats at least
/// every retryPeriod while healthy), every address is fenced and the
/// process exits with [`EXIT_CONTROL_PLANE_STUCK`] so it is restarted. The
/// data plane's valid-until already stopped serving the IPs by then (no
/// renewal moved it); this ends a gateway that would otherwise stay stuck.
/// After the whole process was stopped (the watchdog itself woke late), the
/// loop gets `limit` again to resume before it is judged.
fn spawn_watchdog(
    heartbeat: Arc<crate::k8s::Heartbeat>,
    sink: Arc<GatewaySink>,
    engine: Engine,
    limit: Duration,
    stop: Arc<AtomicBool>,
) -> Result<std::thread::JoinHandle<()>, DaemonError> {
    std::thread::Builder::new()
        .name("egret-watchdog".into())
        .spawn(move || {
            let mut last = Instant::now();
            let mut grace_until = last;
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(WATCHDOG_TICK);
                let now = Instant::now();
                if now.saturating_duration_since(last) > WATCHDOG_STALL {
                    grace_until = now + limit;
                }
                last = now;
                match heartbeat.age(now) {
                    Some(age) if age > limit && now >= grace_until => {
                        fence_all(&sink, &engine);
                        tracing::error!(
                            silent_ms = age.as_millis() as u64,
                            "kubernetes control plane stuck; egress IPs fenced, exiting"
                        );
                        std::process::exit(EXIT_CONTROL_PLANE_STUCK);
                    }
                    _ => {}
                }
            }
        })
        .map_err(start_err("spawning the watchdog"))
}

/// Starts the Kubernetes control plane on this runtime.
async fn spawn_kubernetes(
    k: &config::KubernetesConfig,
    cfg: &GatewayConfig,
    sink: Arc<GatewaySink>,
    pod_identities: crate::translog::identity::PodIdentities,
    port_use: Arc<crate::port_use::Monitor>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Result<(tokio::task::JoinHandle<Option<crate::k8s::uninstall::Ending>>, Arc<crate::k8s::Heartbeat>), DaemonError> {
    use crate::k8s::{self, lease::LeaseTiming, K8sOptions};
    let node = k.node_name.clone().or_else(|| std::env::var("NODE_NAME").ok()).unwrap_or_default();
    let mut opts = K8sOptions::new(node);
    opts.lease_namespace = k.lease_namespace.clone();
    opts.timing = LeaseTiming {
        lease_duration: k.lease_duration,
        renew_deadline: k.renew_deadline,
        retry_period: k.retry_period,
    };
    opts.gateway_selector = k.gateway_selector.clone();
    opts.resync_period = k.resync_period;
    opts.liveness = k.liveness;
    opts.pod_identities = pod_identities;
    opts.port_use = Some(crate::port_use::MonitorRef(port_use));
    opts.nat = cfg.tables.nat;
    opts.tunnel_port = cfg.tables.tunnel.as_ref().map(|t| t.port);
    opts.guard = egret_dataplane::tables::SourceGuard {
        interfaces: cfg.interfaces.iter().map(|i| i.name.clone()).collect(),
        sources: k.cluster_pod_cidrs.clone(),
    };
    if let Some(h) = &k.ha {
        opts.ha = Some(ha_options(h)?);
    }
    opts.validate().map_err(start_err("kubernetes options"))?;
    let client = k8s::gateway_client(k.kubeconfig.as_deref()).await.map_err(start_err("kubernetes client"))?;
    let hold = sink.fail_closed.clone();
    let sink: Arc<dyn crate::sink::TablesSink> = Arc::new(crate::failclosed::ReleaseOnApply::new(sink, hold));
    let ending = k8s::uninstall::Watch::start(client.clone(), k8s::uninstall::PodIdentity::from_env(), &opts.node_name);
    opts.lease_owner = ending.owner();
    tracing::info!(node = %opts.node_name, namespace = %opts.lease_namespace, "kubernetes control plane starting");
    let heartbeat = Arc::new(crate::k8s::Heartbeat::default());
    let beats = heartbeat.clone();
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        match k8s::run_supervised(client, opts, sink, shutdown, beats, Some(ending)).await {
            Ok(ending) => ending,
            Err(e) => {
                tracing::error!(error = %e, "kubernetes control plane stopped");
                None
            }
        }
    });
    Ok((task, heartbeat))
}

/// `kubernetes.ha` resolved: the key read, the address from the file or
/// `$HOST_IP` (the downward API's `status.hostIP`).
fn ha_options(h: &config::HaConfig) -> Result<crate::ha::HaOptions, DaemonError> {
    let files = crate::ha::keys::KeyFiles { primary: h.key_file.clone(), accepted: h.accept_key_files.clone() };
    let keys = files.load().map_err(|e| {
        let field = if e.path() == h.key_file { "kubernetes.ha.keyFile" } else { "kubernetes.ha.acceptKeyFiles" };
        start_err(field)(e)
    })?;
    let address = match h.address {
        Some(a) => a,
        None => {
            let v = std::env::var("HOST_IP").unwrap_or_default();
            v.trim().parse().map_err(|_| {
                start_err("kubernetes.ha.address")(format!(
                    "unset, and $HOST_IP is {v:?}: set the address, or HOST_IP from the downward API (status.hostIP)"
                ))
            })?
        }
    };
    Ok(crate::ha::HaOptions {
        listen: SocketAddr::new(address, h.port),
        port: h.port,
        keys: Arc::new(keys),
        key_files: Some(files),
        liveness: h.liveness,
        resync_period: h.resync_period,
        peer_cache: h.peer_cache.clone(),
        lone_failsafe: h.lone_failsafe,
    })
}

/// `SIGHUP`: re-read, validate, apply; keep the old configuration on error.
fn reload(path: &Path, shared: &Shared, metrics_listen: Option<SocketAddr>) {
    let t0 = Instant::now();
    let new = match config::load(path).and_then(|mut c| config::default_route::resolve(&mut c).map(|()| c)) {
        Ok(mut c) => {
            if let Some(a) = metrics_listen {
                c.metrics_listen = a;
            }
            c
        }
        Err(e) => {
            shared.reload_failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "reload rejected; the old configuration stays");
            return;
        }
    };
    for w in &new.warnings {
        tracing::warn!(warning = %w, "configuration");
    }
    let mut pending = shared.config.lock().restart_only_changes(&new).iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let before: Vec<IpAddr> = shared.engine.tables().neighbor_addresses().collect();
    if let Err(e) = shared.sink.apply(&new.tables) {
        // The error says what the gateway runs now (crate::sink::ApplyError).
        shared.reload_failures.fetch_add(1, Ordering::Relaxed);
        tracing::error!(error = %e, "reload not applied");
        return;
    }
    pending.extend(shared.sink.restart_needed.lock().iter().cloned());
    if !pending.is_empty() {
        tracing::warn!(settings = ?pending, "changed settings take effect only after a restart");
    }
    let added: Vec<IpAddr> = announced(&new.tables).into_iter().filter(|ip| !before.contains(ip)).collect();
    shared.sink.announce(&added);
    *shared.restart_pending.lock() = pending;
    {
        let mut cfg = shared.config.lock();
        let old = cfg.clone();
        *cfg = GatewayConfig { tables: new.tables, warnings: new.warnings, ..old };
    }
    shared.reloads.fetch_add(1, Ordering::Relaxed);
    tracing::info!(
        generation = shared.engine.tables().generation,
        reload_ms = t0.elapsed().as_secs_f64() * 1000.0,
        "reloaded"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("loading egret_steer")]
    struct Load(#[source] std::io::Error);

    #[test]
    fn a_start_error_names_its_step_and_keeps_its_source() {
        let e = start_err("loading the XDP program")(Load(std::io::Error::from_raw_os_error(libc::EPERM)));
        assert_eq!(e.to_string(), "loading the XDP program: loading egret_steer");
        let source = std::error::Error::source(&e).expect("the step's error is its source");
        assert_eq!(source.to_string(), "loading egret_steer");
        let below = source.source().expect("and the chain below it");
        assert_eq!(below.to_string(), std::io::Error::from_raw_os_error(libc::EPERM).to_string());
        let plain = start_err("admin socket")("in use".to_string());
        assert_eq!(plain.to_string(), "admin socket: in use");
    }
}
