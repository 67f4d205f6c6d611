//! Driving the `egret` gateway daemon in the lab: its YAML configuration
//! (docs/config.md, Kubernetes mode included), starting it in a gateway
//! namespace, waiting until it is ready, asking it for sessions and counters
//! through the admin socket, reloading it (SIGHUP), killing it.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ipnet::IpNet;

use crate::error::{LabError, Result};
use crate::lab::Lab;
use crate::netns::{self, NetNs};

/// An egress IP in the gateway's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EgressIp {
    /// The address.
    pub ip: IpAddr,
    /// Its NAT port range, if not the default.
    pub ports: Option<(u16, u16)>,
    /// Whether Egret answers ARP/NDP for it.
    pub answer_neighbor: bool,
}

/// A policy in the gateway's configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Name.
    pub name: String,
    /// Selected sources.
    pub sources: Vec<IpNet>,
    /// Selected destinations.
    pub destinations: Vec<IpNet>,
    /// Excluded destinations.
    pub except: Vec<IpNet>,
    /// Egress IPs.
    pub egress_ips: Vec<IpAddr>,
}

/// The gateway's configuration, written as docs/config.md's YAML.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayConfig {
    /// Interfaces and roles (`inside`, `outside`, `both`); an empty name
    /// is written `defaultRoute: true`.
    pub interfaces: Vec<(String, String)>,
    /// `native` or `generic`.
    pub xdp_mode: String,
    /// Egress IPs held.
    pub egress_ips: Vec<EgressIp>,
    /// Policies.
    pub policies: Vec<Policy>,
    /// `xdp.fastPath`: established flows translated in XDP (the daemon's
    /// default, on).
    pub fast_path: bool,
    /// `xdp.fastPathSessions` as written (a count or `{ipv4: .., ipv6: ..}`);
    /// `None` for the daemon's default.
    pub fast_path_sessions: Option<String>,
    /// Extra YAML appended verbatim (a `nat:` section, say).
    pub extra: String,
    /// Egress IPs written with `kernelService: true` (the kernel serves
    /// their ports outside the NAT range; others drop them).
    pub kernel_service_ips: Vec<IpAddr>,
    /// Not YAML: engine time runs this many times faster than real time
    /// (`EGRET_TEST_CLOCK_SCALE`, tests only), so RFC-minimum timeouts pass
    /// in seconds.
    pub clock_scale: Option<u32>,
    /// Not YAML: more environment for the daemon (the cloud lab's
    /// `AWS_ENDPOINT_URL_EC2` and credentials).
    pub env: Vec<(String, String)>,
    /// Kubernetes mode: the `kubernetes:` section. The file then lists no
    /// egress IPs or policies (`egress_ips` and `policies` are not written).
    pub kubernetes: Option<KubernetesSection>,
}

/// The `kubernetes:` section of a gateway's file (docs/config.md).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesSection {
    /// `nodeName`: the gateway's identity in Leases.
    pub node_name: String,
    /// `kubeconfig`: how the control plane reaches the API server.
    pub kubeconfig: PathBuf,
    /// `leaseDuration`, `renewDeadline`, `retryPeriod` as written (e.g. `4s`,
    /// `500ms`); `None` keeps the daemon's defaults.
    pub timing: Option<(String, String, String)>,
    /// `clusterPodCIDRs` (the fail-closed table's source guard); empty: unset.
    pub cluster_pod_cidrs: Vec<String>,
    /// More keys of the section, written verbatim after the others (each
    /// line indented by two spaces, e.g. `  ha: {port: 4720}\n`).
    pub extra: String,
}

impl GatewayConfig {
    /// The fixture table's base configuration (`fixtures::base_spec`):
    /// policy "a" (198.18.0.0/24 and 2001:db8:18::/64 to everything but
    /// 198.51.100.128/25, via E1 / E6) and "c" (198.18.1.0/24 to
    /// 198.51.100.0/24 via E2), on the lab's interfaces.
    pub fn lab_default(lab: &Lab) -> Self {
        let spec = egret_dataplane::fixtures::base_spec();
        Self {
            interfaces: lab.gateway_interfaces().into_iter().map(|(n, r)| (n.to_string(), r.to_string())).collect(),
            xdp_mode: "native".into(),
            egress_ips: spec
                .egress_ips
                .iter()
                .map(|e| EgressIp {
                    ip: e.ip,
                    ports: e.ports.map(|p| (p.first, p.last)),
                    answer_neighbor: e.answer_neighbor,
                })
                .collect(),
            policies: spec
                .policies
                .iter()
                .map(|p| Policy {
                    name: p.name.clone(),
                    sources: p.sources.clone(),
                    destinations: p.destinations.clone(),
                    except: p.except.clone(),
                    egress_ips: p.egress_ips.clone(),
                })
                .collect(),
            fast_path: true,
            fast_path_sessions: None,
            extra: String::new(),
            kernel_service_ips: Vec::new(),
            clock_scale: None,
            env: Vec::new(),
            kubernetes: None,
        }
    }

    /// A gateway in Kubernetes mode on `interfaces` (name, role): policies and
    /// egress IPs come from the cluster.
    pub fn kubernetes(interfaces: &[(&str, &str)], section: KubernetesSection) -> Self {
        Self {
            interfaces: interfaces.iter().map(|(n, r)| (n.to_string(), r.to_string())).collect(),
            xdp_mode: "native".into(),
            egress_ips: Vec::new(),
            policies: Vec::new(),
            fast_path: true,
            fast_path_sessions: None,
            extra: String::new(),
            kernel_service_ips: Vec::new(),
            kubernetes: Some(section),
            clock_scale: None,
            env: Vec::new(),
        }
    }

    /// The policy named `name`, to change it.
    pub fn policy_mut(&mut self, name: &str) -> Option<&mut Policy> {
        self.policies.iter_mut().find(|p| p.name == name)
    }

    /// Whether a policy selects traffic from `src` to `dst` (the source is
    /// in its sources, the destination in its destinations and not in its
    /// exceptions): such traffic must never leave with `src`.
    pub fn selects(&self, src: IpAddr, dst: IpAddr) -> bool {
        self.policies.iter().any(|p| {
            p.sources.iter().any(|n| n.contains(&src))
                && p.destinations.iter().any(|n| n.contains(&dst))
                && !p.except.iter().any(|n| n.contains(&dst))
        })
    }

    /// The YAML text, with the admin socket at `socket` and metrics on
    /// `metrics` (inside the gateway's namespace).
    pub fn yaml(&self, socket: &Path, metrics: SocketAddr) -> String {
        let list = |v: &[IpNet]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(", ");
        let mut y = String::from("# Written by egret-tests (tests/src/gateway.rs) for the lab.\ninterfaces:\n");
        for (name, role) in &self.interfaces {
            if name.is_empty() {
                y += &format!("  - defaultRoute: true\n    role: {role}\n");
            } else {
                y += &format!("  - name: {name}\n    role: {role}\n");
            }
        }
        y += &format!("xdp:\n  mode: {}\n  fastPath: {}\n", self.xdp_mode, self.fast_path);
        if let Some(n) = &self.fast_path_sessions {
            y += &format!("  fastPathSessions: {n}\n");
        }
        // Normal priority: the lab shares two cores with the tests.
        y += "workers:\n  realtimePriority: 0\n";
        if let Some(k) = &self.kubernetes {
            y += &format!("kubernetes:\n  nodeName: {}\n  kubeconfig: {}\n", k.node_name, k.kubeconfig.display());
            if let Some((d, r, p)) = &k.timing {
                y += &format!("  leaseDuration: {d}\n  renewDeadline: {r}\n  retryPeriod: {p}\n");
            }
            // EGRET_OWNERSHIP=perIP runs a Kubernetes lab with per-IP
            // Leases (ADR 0004); unset, the default (liveness, ADR 0016).
            if let Ok(o) = std::env::var("EGRET_OWNERSHIP") {
                y += &format!("  ownership: {o}\n");
            }
            if !k.cluster_pod_cidrs.is_empty() {
                y += &format!("  clusterPodCIDRs: [{}]\n", k.cluster_pod_cidrs.join(", "));
            }
            y += &k.extra;
            y += &format!("admin:\n  socket: {}\nmetrics:\n  listen: {metrics}\n", socket.display());
            y += &self.extra;
            return y;
        }
        y += "egressIPs:\n";
        for e in &self.egress_ips {
            y += &format!("  - ip: {}\n", e.ip);
            if let Some((a, b)) = e.ports {
                y += &format!("    ports: {a}-{b}\n");
            }
            y += &format!("    answerNeighbor: {}\n", e.answer_neighbor);
            if self.kernel_service_ips.contains(&e.ip) {
                y += "    kernelService: true\n";
            }
        }
        y += "policies:\n";
        for p in &self.policies {
            y += &format!(
                "  - name: {}\n    sources: [{}]\n    destinations: [{}]\n",
                p.name,
                list(&p.sources),
                list(&p.destinations)
            );
            if !p.except.is_empty() {
                y += &format!("    except: [{}]\n", list(&p.except));
            }
            let ips = p.egress_ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(", ");
            y += &format!("    egressIPs: [{ips}]\n");
        }
        y += &format!("admin:\n  socket: {}\nmetrics:\n  listen: {metrics}\n", socket.display());
        y += &self.extra;
        y
    }
}

/// Where the `egret` binary is: `$EGRET_BIN`; else `egret` in this
/// executable's target directory (`target/<profile>/egret`, next to
/// `egret-lab` or above a test's `deps/`). Under `cargo test`, if that binary
/// is missing or older than any source of the daemon (controlplane, dataplane,
/// bpf, Cargo.lock), it is built first (`cargo build -p egret-controlplane
/// -p egret-tests --bin egret`, same profile), so a test never runs a stale
/// daemon. `cargo test --workspace` builds it anyway (the control plane's own
/// integration tests need it), and then nothing is compiled twice.
pub fn egret_binary() -> Result<PathBuf> {
    static BIN: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(find_or_build_egret).clone().map_err(LabError::Gateway)
}

/// Directories under the daemon's crates that are not its sources: build
/// output (the fuzz crate's own `target/`), and the fuzz crate (its own
/// workspace), whose corpus a fuzz run keeps writing. Counted as sources,
/// a `cargo fuzz build` beside the tests made them rebuild the daemon.
const NOT_SOURCES: [&str; 3] = ["target", "fuzz", "proptest-regressions"];

/// The newest modification time of any file under `paths`, but for
/// [`NOT_SOURCES`].
fn newest_source(paths: &[PathBuf]) -> Option<std::time::SystemTime> {
    let mut newest = None;
    let mut stack: Vec<PathBuf> = paths.to_vec();
    while let Some(p) = stack.pop() {
        let Ok(meta) = std::fs::metadata(&p) else { continue };
        if meta.is_dir() {
            if p.file_name().and_then(|n| n.to_str()).is_some_and(|n| NOT_SOURCES.contains(&n)) {
                continue;
            }
            if let Ok(rd) = std::fs::read_dir(&p) {
                stack.extend(rd.filter_map(|e| e.ok()).map(|e| e.path()));
            }
        } else if let Ok(m) = meta.modified() {
            newest = newest.max(Some(m));
        }
    }
    newest
}

fn find_or_build_egret() -> std::result::Result<PathBuf, String> {
    if let Some(p) = std::env::var_os("EGRET_BIN") {
        return Ok(PathBuf::from(p));
    }
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut dir = exe.parent().map(Path::to_path_buf).unwrap_or_default();
    let under_cargo_test = dir.ends_with("deps") && std::env::var_os("CARGO").is_some();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join("egret");
    if under_cargo_test {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let sources: Vec<PathBuf> =
            ["controlplane", "dataplane", "bpf", "Cargo.lock"].iter().map(|p| root.join(p)).collect();
        let built = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
        let stale = match (built, newest_source(&sources)) {
            (Some(b), Some(src)) => src > b,
            _ => true,
        };
        if stale {
            let target = dir.parent().map(Path::to_path_buf).unwrap_or_default();
            let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
            // With egret-tests selected too, dependencies resolve to the same
            // features as `cargo test -p egret-tests`.
            cmd.args(["build", "--quiet", "-p", "egret-controlplane", "-p", "egret-tests", "--bin", "egret"])
                .arg("--manifest-path")
                .arg(root.join("Cargo.toml"))
                .env("CARGO_TARGET_DIR", &target);
            if dir.ends_with("release") {
                cmd.arg("--release");
            }
            let line = netns::describe(&cmd);
            let status = cmd.stdin(Stdio::null()).status().map_err(|e| format!("{line}: {e}"))?;
            if !status.success() {
                return Err(format!("{line}: {status}"));
            }
        }
    }
    if bin.exists() {
        Ok(bin)
    } else {
        Err(format!(
            "no egret binary at {} (build it: cargo build -p egret-controlplane, or set EGRET_BIN)",
            bin.display()
        ))
    }
}

/// Counters from `egret counters --json`, flattened to dotted paths
/// (`drops.inbound_no_mapping`; `[name, value]` pairs become `list.name`,
/// other array elements `list.<index>`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters(pub BTreeMap<String, u64>);

impl Counters {
    /// Parses the JSON text.
    pub fn parse(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| LabError::Unexpected { from: "egret counters --json".into(), got: format!("{e}: {text}") })?;
        let mut m = BTreeMap::new();
        flatten("", &v, &mut m);
        Ok(Self(m))
    }

    /// The sum of every counter whose last path component is `name` (so the
    /// layout of the JSON, per worker or total, does not matter).
    pub fn get(&self, name: &str) -> u64 {
        self.0.iter().filter(|(k, _)| k.rsplit('.').next() == Some(name)).map(|(_, v)| *v).sum()
    }

    /// The counter at exactly `path` (0 when absent).
    pub fn get_path(&self, path: &str) -> u64 {
        self.0.get(path).copied().unwrap_or(0)
    }

    /// Frames the XDP fast path translated (`fast_path.packets.hit`).
    pub fn fast_path_hits(&self) -> u64 {
        self.get_path("fast_path.packets.hit")
    }

    /// What changed from `before` to `self`, counters that grew only.
    pub fn delta(&self, before: &Counters) -> BTreeMap<String, u64> {
        self.0
            .iter()
            .filter_map(|(k, v)| {
                let d = v.saturating_sub(before.0.get(k).copied().unwrap_or(0));
                (d > 0).then(|| (k.clone(), d))
            })
            .collect()
    }
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut BTreeMap<String, u64>) {
    let key = |k: &str| if prefix.is_empty() { k.to_string() } else { format!("{prefix}.{k}") };
    match v {
        serde_json::Value::Object(o) => o.iter().for_each(|(k, v)| flatten(&key(k), v, out)),
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                // A `[name, value]` pair (the daemon's drops/events/xdp lists).
                if let Some([serde_json::Value::String(n), x @ serde_json::Value::Number(_)]) =
                    v.as_array().map(Vec::as_slice)
                {
                    flatten(&key(n), x, out);
                } else {
                    flatten(&key(&i.to_string()), v, out);
                }
            }
        }
        serde_json::Value::Number(n) => {
            if let Some(x) = n.as_u64() {
                out.insert(prefix.to_string(), x);
            }
        }
        _ => {}
    }
}

/// The daemon's admin interface: the `egret` CLI pointed at its socket.
#[derive(Clone, Debug)]
pub struct Admin {
    /// The `egret` binary.
    pub bin: PathBuf,
    /// The admin socket.
    pub socket: PathBuf,
}

impl Admin {
    /// Runs `egret <args> --socket <admin socket>` and returns its stdout.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        netns::run(Command::new(&self.bin).args(args).arg("--socket").arg(&self.socket))
    }

    /// `egret sessions`.
    pub fn sessions(&self) -> Result<String> {
        self.cli(&["sessions"])
    }

    /// `egret counters --json`, parsed.
    pub fn counters(&self) -> Result<Counters> {
        Counters::parse(&self.cli(&["counters", "--json"])?)
    }

    /// `egret sessions --json --limit N`: one JSON object per session
    /// (`proto`, `pod`, `pod_port`, `egress`, `egress_port`, `remote`, ...).
    pub fn sessions_json(&self, limit: usize) -> Result<Vec<serde_json::Value>> {
        let text = self.cli(&["sessions", "--json", "--limit", &limit.to_string()])?;
        match serde_json::from_str(&text) {
            Ok(serde_json::Value::Array(v)) => Ok(v),
            _ => Err(LabError::Unexpected { from: "egret sessions --json".into(), got: text }),
        }
    }

    /// `egret status --json`.
    pub fn status(&self) -> Result<serde_json::Value> {
        let text = self.cli(&["status", "--json"])?;
        serde_json::from_str(&text)
            .map_err(|e| LabError::Unexpected { from: "egret status --json".into(), got: format!("{e}: {text}") })
    }
}

/// The daemon running in the lab's gateway namespace. Dropping it kills it
/// (and, if the thread is panicking, prints the end of its log).
#[derive(Debug)]
pub struct Gateway {
    child: Option<Child>,
    ns: String,
    admin: Admin,
    config: PathBuf,
    log: PathBuf,
    metrics: SocketAddr,
    /// The configuration last written.
    pub current: GatewayConfig,
}

/// Where the daemon serves metrics and `/ready`, inside its namespace.
pub const METRICS: &str = "127.0.0.1:9469";

impl Gateway {
    /// Writes `cfg` into the lab's directory and starts the daemon; waits
    /// (up to 20 s) until it is ready.
    pub fn start(lab: &Lab, cfg: &GatewayConfig) -> Result<Self> {
        let mut g = Self::spawn(lab, cfg)?;
        g.wait_ready(Duration::from_secs(20))?;
        Ok(g)
    }

    /// Starts the daemon without waiting for it.
    pub fn spawn(lab: &Lab, cfg: &GatewayConfig) -> Result<Self> {
        Self::spawn_in(lab.gateway_ns(), lab.dir(), "egret", cfg)
    }

    /// Starts a daemon in namespace `ns` without waiting for it; its files in
    /// `dir` are named after `name` (`<name>.yaml`, `.sock`, `.log`), so
    /// several gateways can share one directory.
    pub fn spawn_in(ns: &NetNs, dir: &Path, name: &str, cfg: &GatewayConfig) -> Result<Self> {
        let metrics: SocketAddr =
            METRICS.parse().map_err(|_| LabError::Gateway(format!("bad metrics address {METRICS}")))?;
        Self::spawn_in_at(ns, dir, name, cfg, metrics)
    }

    /// [`Gateway::spawn_in`] with metrics and `/ready` on `metrics` (an
    /// address of the namespace another one can reach, for a Prometheus).
    pub fn spawn_in_at(ns: &NetNs, dir: &Path, name: &str, cfg: &GatewayConfig, metrics: SocketAddr) -> Result<Self> {
        let bin = egret_binary()?;
        let mut g = Self {
            child: None,
            ns: ns.name().to_string(),
            admin: Admin { bin, socket: dir.join(format!("{name}.sock")) },
            config: dir.join(format!("{name}.yaml")),
            log: dir.join(format!("{name}.log")),
            metrics,
            current: cfg.clone(),
        };
        g.write_config(cfg)?;
        g.launch()?;
        Ok(g)
    }

    /// [`Gateway::spawn_in`], then waits (up to 20 s) until it is ready.
    pub fn start_in(ns: &NetNs, dir: &Path, name: &str, cfg: &GatewayConfig) -> Result<Self> {
        let mut g = Self::spawn_in(ns, dir, name, cfg)?;
        g.wait_ready(Duration::from_secs(20))?;
        Ok(g)
    }

    fn write_config(&mut self, cfg: &GatewayConfig) -> Result<()> {
        std::fs::write(&self.config, cfg.yaml(&self.admin.socket, self.metrics))
            .map_err(|e| LabError::io(format!("write {}", self.config.display()), e))?;
        self.current = cfg.clone();
        Ok(())
    }

    fn launch(&mut self) -> Result<()> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns])
            .arg(&self.admin.bin)
            .arg("gateway")
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
            // Plain log lines: tests read them back (timestamps, events).
            .env("NO_COLOR", "1")
            .env("EGRET_TEST_CLOCK_SCALE", self.current.clock_scale.unwrap_or(1).to_string())
            .envs(self.current.env.iter().map(|(k, v)| (k, v)));
        self.child = Some(netns::spawn_logged(&mut cmd, &self.log)?);
        Ok(())
    }

    /// The daemon's pid (`ip netns exec` execs it, so this is egret itself).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The configuration file's path.
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The admin interface.
    pub fn admin(&self) -> &Admin {
        &self.admin
    }

    /// The log file's path.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The whole log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the process is still running (not exited, not killed).
    pub fn is_running(&mut self) -> bool {
        self.child.is_some() && self.exited().is_none()
    }

    /// The last `lines` lines of the daemon's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = text.lines().collect();
        v[v.len().saturating_sub(lines)..].join("\n")
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits until `/ready` answers 200 in the gateway's namespace; fails
    /// early, with the log, if the daemon exits.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let ns = NetNs::existing(&self.ns)?;
        loop {
            if let Some(st) = self.exited() {
                return Err(LabError::Gateway(format!("egret exited ({st}) before ready:\n{}", self.log_tail(30))));
            }
            if http_status(&ns, self.metrics, "/ready").ok() == Some(200) {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(LabError::Timeout {
                    what: format!("egret /ready on {} in {}; log:\n{}", self.metrics, self.ns, self.log_tail(30)),
                    after: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `egret sessions`.
    pub fn sessions(&self) -> Result<String> {
        self.admin.sessions()
    }

    /// `egret counters --json`, parsed.
    pub fn counters(&self) -> Result<Counters> {
        self.admin.counters()
    }

    /// Leaves the daemon running when this handle drops (the CLI's `up`).
    pub fn detach(mut self) {
        self.child.take();
    }

    /// Writes `cfg` and sends SIGHUP.
    pub fn reload(&mut self, cfg: &GatewayConfig) -> Result<()> {
        self.write_config(cfg)?;
        self.signal("HUP")
    }

    fn signal(&self, sig: &str) -> Result<()> {
        let pid = self.pid().ok_or_else(|| LabError::Gateway("not running".into()))?;
        netns::run(Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string())).map(|_| ())
    }

    /// SIGKILL, then waits for the process.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.signal("KILL")?;
        self.wait()
    }

    /// SIGTERM, then waits for the process.
    pub fn terminate(&mut self) -> Result<ExitStatus> {
        self.signal("TERM")?;
        self.wait()
    }

    fn wait(&mut self) -> Result<ExitStatus> {
        let mut c = self.child.take().ok_or_else(|| LabError::Gateway("not running".into()))?;
        c.wait().map_err(|e| LabError::io("wait for egret", e))
    }

    /// Starts the daemon again with the current configuration, without
    /// waiting for it to be ready (it may not be: a Kubernetes-mode gateway
    /// started while the API server is down).
    pub fn start_again(&mut self) -> Result<()> {
        self.launch()
    }

    /// Starts the daemon again with the current configuration and waits
    /// until it is ready.
    pub fn restart(&mut self) -> Result<()> {
        if self.child.is_some() {
            self.terminate()?;
        }
        self.launch()?;
        self.wait_ready(Duration::from_secs(20))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- egret log ({}) ----\n{}\n----", self.log.display(), self.log_tail(60));
        }
    }
}

/// The lines of a daemon log that contain `needle`, each with the time it was
/// written (the log's RFC 3339 UTC prefix; colour codes are skipped).
pub fn log_events(text: &str, needle: &str) -> Vec<(std::time::SystemTime, String)> {
    text.lines()
        .filter(|l| l.contains(needle))
        .filter_map(|l| {
            let plain = strip_ansi(l);
            let stamp = plain.split_whitespace().next()?;
            let t: k8s_openapi::jiff::Timestamp = stamp.parse().ok()?;
            Some((std::time::SystemTime::from(t), plain))
        })
        .collect()
}

fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte (0x40..=0x7e).
            for d in chars.by_ref() {
                if ('@'..='~').contains(&d) && d != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// GET `path` on `addr` from inside `ns`; returns the HTTP status.
pub fn http_status(ns: &NetNs, addr: SocketAddr, path: &str) -> Result<u16> {
    http_get_in(ns, addr, path).map(|(s, _)| s)
}

/// GET `path` on `addr` from inside `ns`; returns status and body.
pub fn http_get_in(ns: &NetNs, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = ns
        .run_in(|| TcpStream::connect_timeout(&addr, Duration::from_secs(1)))?
        .map_err(|e| LabError::io(format!("connect {addr} in {}", ns.name()), e))?;
    let io = |e| LabError::io(format!("GET {path} from {addr}"), e);
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(io)?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).map_err(io)?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(io)?;
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_events_parse_plain_and_coloured_lines() {
        let text =
            "2026-11-22T14:42:07.048379Z  INFO egret_controlplane::k8s::controller: took egress IP ip=203.0.113.10\n\
                    \u{1b}[2m2026-11-22T14:42:08.5Z\u{1b}[0m \u{1b}[32m INFO\u{1b}[0m took egress IP ip=203.0.113.11\n\
                    2026-11-22T14:42:09Z  WARN fenced\n";
        let ev = log_events(text, "took egress IP");
        assert_eq!(ev.len(), 2);
        let secs = |t: std::time::SystemTime| t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        assert_eq!(secs(ev[1].0) - secs(ev[0].0), Duration::from_micros(1_451_621));
        assert!(ev[1].1.starts_with("2026-11-22T14:42:08.5Z  INFO took egress IP"), "{}", ev[1].1);
    }
}
