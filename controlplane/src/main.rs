//! The `egret` binary: the gateway daemon and the CLI that talks to it.
//!
//! ```text
//! egret gateway --config FILE [--metrics-listen ADDR:PORT] [--cluster-pod-cidr CIDR,...]
//!               [--gateway-selector KEY=VALUE] [--nat-ports FIRST-LAST]   run the gateway (root)
//! egret check-config FILE [the gateway's flags]   validate without touching the system
//! egret status|counters|policies|ports [--json] [--socket PATH]
//! egret sessions [--egress-ip IP] [--pod IP] [--proto tcp|udp|icmp] [--limit N]
//! egret who-had ADDR:PORT --at TIME [--proto tcp|udp|icmp] [--remote ADDR:PORT]
//! egret node --cluster-cidr CIDR... [--strict]   run the worker-node agent (root)
//! egret node status [--json] | egret node cleanup
//! ```
//! Logs go to stderr, filtered by `RUST_LOG` (default `info`).

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use egret_controlplane::admin::{self, render, Request};
use egret_controlplane::config;
use egret_controlplane::node;
use egret_controlplane::view::{Counters, PolicyRow, PortRow, SessionFilter, SessionRow, Status, WhoHadAnswer};
use egret_dataplane::nat::port_alloc::PortRange;

#[derive(Parser, Debug)]
#[command(name = "egret", version, about = "Static egress IPs at XDP speed")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug)]
struct Client {
    /// The daemon's admin socket.
    #[arg(long, default_value = "/run/egret/egret.sock")]
    socket: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the gateway from a YAML file.
    Gateway {
        /// The configuration file.
        #[arg(long)]
        config: PathBuf,
        /// Serve /metrics and /ready here instead of the file's
        /// `metrics.listen` (ADDRESS:PORT; an IPv6 address may come without
        /// brackets, as `$(HOST_IP):9469` gives it in a pod).
        #[arg(long, value_parser = parse_listen)]
        metrics_listen: Option<SocketAddr>,
        #[command(flatten)]
        cluster: ClusterFlags,
    },
    /// Remove the fail-closed forwarding rules a gateway leaves in the kernel
    /// (uninstalling Egret from a node). While they stay, a stopped gateway's
    /// kernel drops the traffic Egret would translate instead of forwarding it
    /// with pod addresses.
    Cleanup,
    /// Validate a configuration file and print what it would do (with the
    /// flags `egret gateway` would be given).
    CheckConfig {
        /// The configuration file.
        file: PathBuf,
        /// As `egret gateway --metrics-listen`.
        #[arg(long, value_parser = parse_listen)]
        metrics_listen: Option<SocketAddr>,
        #[command(flatten)]
        cluster: ClusterFlags,
    },
    /// Interfaces, workers, owned addresses, configuration generation.
    Status(Client),
    /// Drops per reason, events, XDP verdicts, worker rings.
    Counters(Client),
    /// Policies and their traffic.
    Policies(Client),
    /// Port usage per egress IP and protocol.
    Ports(Client),
    /// Ports in use per destination and pod: the top N of the last count,
    /// against the range or the pod's quota (docs/operations.md, "Port use").
    PortUse(Client),
    /// Port blocks per egress IP in block mode: blocks held, pods, refusals
    /// (docs/operations.md, "Port blocks").
    PortBlocks(Client),
    /// Live sessions.
    Sessions {
        #[command(flatten)]
        client: Client,
        /// Only sessions on this egress IP.
        #[arg(long)]
        egress_ip: Option<IpAddr>,
        /// Only sessions of this pod.
        #[arg(long)]
        pod: Option<IpAddr>,
        /// Only this protocol.
        #[arg(long, value_parser = ["tcp", "udp", "icmp"])]
        proto: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Which pod held an egress address and port at a time (the
    /// translation logs' journal, docs/operations.md).
    #[command(name = "who-had")]
    WhoHad {
        #[command(flatten)]
        client: Client,
        /// The egress address and port, e.g. 203.0.113.10:41522.
        target: String,
        /// When, RFC 3339 (e.g. 2026-12-01T14:03:07Z).
        #[arg(long)]
        at: String,
        /// Only this protocol.
        #[arg(long)]
        proto: Option<String>,
        /// Only sessions towards this remote address:port.
        #[arg(long)]
        remote: Option<String>,
    },
    /// The worker-node agent: routes selected pods' traffic to the gateway
    /// holding their egress IP (`egret node status`, `egret node cleanup`).
    Node(NodeCli),
    /// Drain a gateway: annotate its Node `egret.dev/drain=true`; it hands
    /// each egress IP to the next candidate once that one holds a copy of
    /// its sessions, and takes none until `--undo`.
    Drain {
        /// The gateway's Node name.
        node: String,
        /// Lift the drain.
        #[arg(long)]
        undo: bool,
        /// Kubeconfig (default: in-cluster, then $KUBECONFIG).
        #[arg(long)]
        kubeconfig: Option<PathBuf>,
    },
    /// Ask the cloud provider what a pool would use, as the gateway asks it.
    #[command(subcommand)]
    Cloud(CloudCommand),
}

/// The cluster's settings on the gateway's command line, replacing the
/// file's (config::Overrides): deploy/manifests passes them from the
/// ConfigMap egret-cluster, which the node agent reads too.
#[derive(clap::Args, Debug, Clone, Default)]
struct ClusterFlags {
    /// The cluster's pod CIDRs (repeat, or comma-separated; blank items
    /// skipped): replace the file's `kubernetes.clusterPodCIDRs`.
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr_item)]
    cluster_pod_cidr: Vec<CidrItem>,
    /// The gateway Nodes' label selector (KEY=VALUE): replaces the file's
    /// `kubernetes.gatewaySelector`.
    #[arg(long, value_parser = parse_selector)]
    gateway_selector: Option<String>,
    /// The NAT port range (FIRST-LAST): replaces the file's `nat.ports`.
    #[arg(long, value_parser = parse_ports)]
    nat_ports: Option<PortRange>,
    /// The UDP port of the nodes' tunnel (1-65535): replaces the file's
    /// `tunnel.port`; the node agents' `--tunnel-port` must be the same.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    tunnel_port: Option<u16>,
}

/// A command-line value that cannot be used. The value parsers' errors
/// (clap puts the flag before them: `invalid value 'V' for '--flag'`)
/// name the value; the others name the flag and the value.
#[derive(Debug, thiserror::Error)]
enum ArgError {
    /// An item of a CIDR list flag (`--cluster-cidr`, `--cluster-pod-cidr`).
    #[error("{value:?}: {source}")]
    NotACidr {
        /// The item, trimmed.
        value: String,
        /// Why.
        #[source]
        source: ipnet::AddrParseError,
    },
    /// `--cluster-pod-cidr` given with only blank items.
    #[error("--cluster-pod-cidr: no CIDR in the value (is egret-cluster's pod-cidrs empty?)")]
    NoClusterPodCidr,
    /// The gateway's `--nat-ports`.
    #[error("{value:?} is not FIRST-LAST (1 <= FIRST <= LAST <= 65535)")]
    NotAPortRange {
        /// The value.
        value: String,
    },
    /// `--gateway-selector`.
    #[error("{value:?} is not a label selector (KEY=VALUE)")]
    NotASelector {
        /// The value.
        value: String,
    },
    /// `egret cloud discover --tag`.
    #[error("--tag {value:?}: expected KEY=VALUE")]
    NotATag {
        /// The value.
        value: String,
    },
    /// `--metrics-listen` (the gateway's and `check-config`'s).
    #[error("{value:?} is not ADDRESS:PORT")]
    NotAListenAddress {
        /// The value.
        value: String,
    },
    /// The agent's `--metrics-listen`.
    #[error("--metrics-listen: {value:?} is not ADDRESS:PORT")]
    NodeMetricsListen {
        /// The value, trimmed.
        value: String,
    },
    /// The agent's `--steer-mark`.
    #[error("--steer-mark: {value:?} is not a number (hex with 0x, or decimal)")]
    SteerMark {
        /// The value.
        value: String,
    },
    /// The agent's `--nat-ports` (a range that parses but is empty or
    /// starts at 0 is refused by [`node::NodeOptions::validate`]).
    #[error("--nat-ports: {value:?} is not FIRST-LAST")]
    NodeNatPorts {
        /// The value.
        value: String,
    },
    /// The agent's settings together ([`node::NodeOptions::validate`]:
    /// it names the flag and the value).
    #[error(transparent)]
    Node(#[from] node::NodeError),
}

/// One item of a comma-separated CIDR flag: a network (truncated to its
/// prefix), or nothing for a blank item (`a,` where a ConfigMap key is
/// empty, `a, b`), so the gateway and the agent read one value alike.
#[derive(Debug, Clone, Copy)]
struct CidrItem(Option<ipnet::IpNet>);

fn parse_cidr_item(s: &str) -> Result<CidrItem, ArgError> {
    let s = s.trim();
    if s.is_empty() {
        return Ok(CidrItem(None));
    }
    s.parse::<ipnet::IpNet>()
        .map(|n| CidrItem(Some(n.trunc())))
        .map_err(|source| ArgError::NotACidr { value: s.to_owned(), source })
}

fn cidrs(items: &[CidrItem]) -> Vec<ipnet::IpNet> {
    items.iter().filter_map(|i| i.0).collect()
}

impl ClusterFlags {
    /// A flag given with nothing in it (`--cluster-pod-cidr=` from an empty
    /// ConfigMap key) is refused: the file's value would stand in silently.
    fn check(&self) -> Result<(), ArgError> {
        if !self.cluster_pod_cidr.is_empty() && cidrs(&self.cluster_pod_cidr).is_empty() {
            return Err(ArgError::NoClusterPodCidr);
        }
        Ok(())
    }

    fn overrides(self) -> config::Overrides {
        config::Overrides {
            cluster_pod_cidrs: Some(cidrs(&self.cluster_pod_cidr)).filter(|c| !c.is_empty()),
            gateway_selector: self.gateway_selector,
            nat_ports: self.nat_ports,
            tunnel_port: self.tunnel_port,
        }
    }
}

/// A port range `FIRST-LAST`, 1 <= FIRST <= LAST.
fn parse_ports(s: &str) -> Result<PortRange, ArgError> {
    let bad = || ArgError::NotAPortRange { value: s.to_owned() };
    let (first, last) = s.split_once('-').ok_or_else(bad)?;
    let r =
        PortRange { first: first.trim().parse().map_err(|_| bad())?, last: last.trim().parse().map_err(|_| bad())? };
    if r.first == 0 || r.first > r.last {
        return Err(bad());
    }
    Ok(r)
}

/// A label selector: not empty, no spaces (`KEY=VALUE`, or any selector
/// the API server takes, e.g. `a=b,c!=d`).
fn parse_selector(s: &str) -> Result<String, ArgError> {
    if s.trim().is_empty() || s.chars().any(char::is_whitespace) {
        return Err(ArgError::NotASelector { value: s.to_owned() });
    }
    Ok(s.to_string())
}

#[derive(Subcommand, Debug)]
enum CloudCommand {
    /// The public addresses a cloud pool's tags select, where each is
    /// associated, and the subnet's free private addresses: one discovery
    /// with the gateway's credentials, region, endpoint and TLS roots.
    Discover {
        /// The pool's provider: `aws`, `azure` or `gcp`.
        #[arg(long, default_value = "aws", value_parser = parse_provider)]
        provider: egret_controlplane::cloud::Provider,
        /// The pool's subnet (`spec.cloud.aws.subnetId`,
        /// `spec.cloud.azure.subnetId`, `spec.cloud.gcp.subnetwork`).
        #[arg(long)]
        subnet: String,
        /// A tag of the pool's `spec.cloud.tags` (KEY=VALUE; repeat).
        #[arg(long = "tag", value_parser = parse_tag, required = true)]
        tags: Vec<(String, String)>,
    },
}

fn parse_provider(s: &str) -> Result<egret_controlplane::cloud::Provider, String> {
    use egret_controlplane::cloud::Provider;
    [Provider::Aws, Provider::Azure, Provider::Gcp]
        .into_iter()
        .find(|p| p.name() == s)
        .ok_or_else(|| format!("{s:?} is not a provider (aws, azure, gcp)"))
}

fn parse_tag(s: &str) -> Result<(String, String), ArgError> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(ArgError::NotATag { value: s.to_owned() }),
    }
}

fn cloud_discover(
    provider: egret_controlplane::cloud::Provider,
    subnet: String,
    tags: Vec<(String, String)>,
) -> ExitCode {
    use egret_controlplane::cloud::{inspect, providers, PoolSelector};
    // The SDK's warnings (no root certificates, a credential source that
    // failed) explain a failure below.
    init_logs_at("warn");
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("egret cloud discover: {e}");
            return ExitCode::FAILURE;
        }
    };
    let pool = PoolSelector { provider, tags: tags.into_iter().collect(), subnet_id: subnet, ipv6: false };
    let res = rt.block_on(async {
        let cloud = providers()(provider).await;
        inspect::discover(cloud.as_ref(), &pool).await
    });
    match res {
        Ok(report) => {
            print(&report);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("egret cloud discover: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
struct NodeCli {
    #[command(subcommand)]
    command: Option<NodeCommand>,
    #[command(flatten)]
    run: NodeArgs,
}

#[derive(clap::Args, Debug, Clone)]
struct TableArgs {
    /// The first routing table the agent may use.
    #[arg(long, default_value_t = node::DEFAULT_TABLE_FIRST)]
    table_first: u32,
    /// How many tables (distinct route sets) it may use.
    #[arg(long, default_value_t = node::DEFAULT_TABLE_COUNT)]
    table_count: u32,
}

#[derive(clap::Args, Debug)]
struct NodeArgs {
    /// This Node's name (default: $NODE_NAME).
    #[arg(long)]
    node_name: Option<String>,
    /// This agent's Pod (default: $POD_NAME): a stop cleans the node up
    /// when the Pod's DaemonSet is deleted or no longer selects the Node
    /// (docs/kubernetes.md, "Uninstall"); outside a pod a stop keeps all.
    #[arg(long)]
    pod_name: Option<String>,
    /// This agent's Pod's namespace (default: $POD_NAMESPACE).
    #[arg(long)]
    pod_namespace: Option<String>,
    /// A kubeconfig (default: in-cluster, then $KUBECONFIG).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// The cluster's pod and Service CIDRs (repeat, or comma-separated):
    /// traffic to them never goes to a gateway. Blank items are skipped (the
    /// manifests join two ConfigMap keys, one of which may be empty).
    #[arg(long, value_delimiter = ',', value_parser = parse_cidr_item)]
    cluster_cidr: Vec<CidrItem>,
    /// Drop a local pod's traffic to outside the cluster until the agent
    /// has classified the pod (docs/kubernetes.md, "Strict mode"):
    /// `--strict` or `--strict=true|false`.
    #[arg(long, num_args = 0..=1, default_value_t = false, default_missing_value = "true", action = clap::ArgAction::Set)]
    strict: bool,
    /// Strict mode: this node's pod CIDRs (default: the Node's spec.podCIDRs,
    /// or, when it has none, the --cluster-cidr ranges).
    #[arg(long, value_delimiter = ',')]
    pod_cidr: Vec<ipnet::IpNet>,
    /// Priority of the agent's `ip rule`s.
    #[arg(long, default_value_t = node::DEFAULT_RULE_PRIORITY)]
    rule_priority: u32,
    /// The packet-mark bit (hex or decimal) set on the connections a
    /// steered pod starts; the agent's rules match only it, so replies to
    /// connections that reached the pod from outside are not steered.
    #[arg(long, default_value = "0x1000")]
    steer_mark: String,
    #[command(flatten)]
    tables: TableArgs,
    /// The gateways' `nat.ports` (FIRST-LAST): must match their file.
    #[arg(long, default_value = "32768-60999")]
    nat_ports: String,
    /// Where /metrics, /ready and /healthz are served (empty: nowhere).
    #[arg(long, default_value = "127.0.0.1:9465")]
    metrics_listen: String,
    /// The status file `egret node status` reads.
    #[arg(long, default_value = node::DEFAULT_STATUS_FILE)]
    status_file: PathBuf,
    /// A full pass at least this often, in seconds.
    #[arg(long, default_value_t = 30)]
    resync_seconds: u64,
    /// Next hops behind a router (docs/adr/0031-workers-in-any-subnet.md):
    /// `auto` decides per next hop from the node's route to it (on a link:
    /// the plain route; through a router: VXLAN (RFC 7348) through
    /// egret-vxlan);
    /// `never` and `always` are for diagnosis and benchmarks.
    #[arg(long, default_value = "auto")]
    tunnel: node::tunnel::TunnelMode,
    /// The tunnel's UDP port; it must equal the gateways' (ConfigMap
    /// egret-cluster, key tunnel-port) and differ from the CNI's VXLAN port
    /// (flannel, Cilium: 8472). Default: $TUNNEL_PORT (the manifests' env
    /// from that key; empty or unset: 6082).
    #[arg(long)]
    tunnel_port: Option<u16>,
    /// The underlay MTU towards the gateways, replacing what the node's
    /// routes say (a smaller MTU between subnets); routes through the
    /// tunnel get it minus 50 (IPv4) or 70 (IPv6). Default: from the routes.
    #[arg(long)]
    tunnel_mtu: Option<u32>,
}

#[derive(Subcommand, Debug)]
enum NodeCommand {
    /// What the agent on this node steers, from its status file.
    Status {
        /// The status file.
        #[arg(long, default_value = node::DEFAULT_STATUS_FILE)]
        status_file: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove every rule, route and nftables table the agent installed.
    Cleanup {
        #[command(flatten)]
        tables: TableArgs,
    },
}

fn init_logs() {
    init_logs_at("info");
}

/// Logs to stderr at `default` unless `RUST_LOG` says otherwise.
fn init_logs_at(default: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
        )
        .with_writer(std::io::stderr)
        .init();
}

fn node_options(a: NodeArgs) -> Result<node::NodeOptions, ArgError> {
    let name = a.node_name.or_else(|| std::env::var("NODE_NAME").ok()).unwrap_or_default();
    let mut o = node::NodeOptions::new(name);
    o.kubeconfig = a.kubeconfig;
    o.pod = egret_controlplane::k8s::uninstall::PodIdentity::new(
        a.pod_namespace.or_else(|| std::env::var("POD_NAMESPACE").ok()),
        a.pod_name.or_else(|| std::env::var("POD_NAME").ok()),
    );
    o.cluster_cidrs = cidrs(&a.cluster_cidr);
    o.strict = a.strict;
    o.pod_cidrs = a.pod_cidr.into_iter().map(|n| n.trunc()).collect();
    o.rule_priority = a.rule_priority;
    let m = a.steer_mark.trim();
    o.steer_mark = match m.strip_prefix("0x").or_else(|| m.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => m.parse(),
    }
    .map_err(|_| ArgError::SteerMark { value: a.steer_mark.clone() })?;
    o.tables = node::reconcile::TableRange { first: a.tables.table_first, count: a.tables.table_count };
    let bad_ports = || ArgError::NodeNatPorts { value: a.nat_ports.clone() };
    let (first, last) = a.nat_ports.split_once('-').ok_or_else(bad_ports)?;
    o.nat_ports = PortRange {
        first: first.trim().parse().map_err(|_| bad_ports())?,
        last: last.trim().parse().map_err(|_| bad_ports())?,
    };
    o.metrics_listen = match a.metrics_listen.trim() {
        "" => None,
        s => Some(parse_listen(s).map_err(|_| ArgError::NodeMetricsListen { value: s.to_owned() })?),
    };
    o.status_file = a.status_file;
    o.resync_period = std::time::Duration::from_secs(a.resync_seconds.max(1));
    let port = a.tunnel_port.map(|p| p.to_string()).or_else(|| std::env::var("TUNNEL_PORT").ok());
    o.tunnel = tunnel_options(a.tunnel, port, a.tunnel_mtu)?;
    o.validate()?;
    Ok(o)
}

/// `--tunnel`, `--tunnel-port` (or `$TUNNEL_PORT`: a blank value takes
/// the default, as a ConfigMap key left empty expands), `--tunnel-mtu`;
/// the error names the flag and the value.
fn tunnel_options(
    mode: node::tunnel::TunnelMode,
    port: Option<String>,
    mtu: Option<u32>,
) -> Result<node::tunnel::TunnelOptions, ArgError> {
    let bad = |m: String| ArgError::Node(node::NodeError::Options(m));
    let mut t = node::tunnel::TunnelOptions { mode, mtu, ..Default::default() };
    if let Some(p) = port.as_deref().map(str::trim).filter(|p| !p.is_empty()) {
        t.port = p.parse().map_err(|_| {
            bad(format!("--tunnel-port (or TUNNEL_PORT): {p:?} is not a UDP port (1-65535; the gateways' tunnel-port)"))
        })?;
    }
    Ok(t)
}

/// A listen address: `ADDRESS:PORT`, `[V6]:PORT`, or an IPv6 address without
/// brackets followed by `:PORT` (what `$(HOST_IP):PORT` expands to on an
/// IPv6 Node; the port is the part after the last colon).
fn parse_listen(s: &str) -> Result<SocketAddr, ArgError> {
    let bad = || ArgError::NotAListenAddress { value: s.to_owned() };
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let (ip, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let ip: std::net::Ipv6Addr = ip.parse().map_err(|_| bad())?;
    Ok(SocketAddr::new(IpAddr::V6(ip), port.parse().map_err(|_| bad())?))
}

fn node_main(cli: NodeCli) -> ExitCode {
    match cli.command {
        Some(NodeCommand::Status { status_file, json }) => match node::status::read(&status_file) {
            Ok(s) if json => {
                print(&format!("{}\n", serde_json::to_string_pretty(&s).unwrap_or_default()));
                ExitCode::SUCCESS
            }
            Ok(s) => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                print(&node::status::render(&s, now));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("egret node status: {e}");
                ExitCode::FAILURE
            }
        },
        Some(NodeCommand::Cleanup { tables }) => {
            match node::cleanup(node::reconcile::TableRange { first: tables.table_first, count: tables.table_count }) {
                Ok(n) => {
                    print(&format!("removed {n} rules and routes and the nftables table inet {}\n", node::nft::TABLE));
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("egret node cleanup: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        None => {
            init_logs();
            let opts = match node_options(cli.run) {
                Ok(o) => o,
                Err(e) => {
                    tracing::error!("{e}");
                    return ExitCode::FAILURE;
                }
            };
            let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!("starting the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let shutdown = async {
                let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
                    return std::future::pending().await;
                };
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            };
            match rt.block_on(node::run(opts, shutdown)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn print(s: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(s.as_bytes());
}

fn client(
    c: &Client,
    req: Request,
    human: impl FnOnce(serde_json::Value) -> Result<String, serde_json::Error>,
) -> ExitCode {
    match admin::call(&c.socket, &req) {
        Ok(v) if c.json => {
            print(&format!("{}\n", serde_json::to_string_pretty(&v).unwrap_or_default()));
            ExitCode::SUCCESS
        }
        Ok(v) => match human(v) {
            Ok(s) => {
                print(&s);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("egret: the daemon's answer was not understood: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("egret: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check_config(file: &std::path::Path, metrics_listen: Option<SocketAddr>, cluster: ClusterFlags) -> ExitCode {
    if let Err(e) = cluster.check() {
        eprintln!("egret: {e}");
        return ExitCode::FAILURE;
    }
    match config::load_with(file, &cluster.overrides()).map(|mut c| {
        if let Some(a) = metrics_listen {
            c.metrics_listen = a;
        }
        c
    }) {
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
        Ok(c) => {
            let mut s = format!("{}: valid\n", c.file);
            for i in &c.interfaces {
                s.push_str(&format!("interface {} ({:?}, queues {:?})\n", i.name, i.role, i.queues).to_lowercase());
            }
            let mut here = c.clone();
            match config::default_route::resolve(&mut here) {
                Ok(()) => {
                    for (_, r) in c.interfaces.iter().zip(&here.interfaces).filter(|(i, r)| i.name != r.name) {
                        s.push_str(&format!(
                            "  defaultRoute: on this host {} (resolved again where the gateway starts)\n",
                            r.name
                        ));
                    }
                }
                Err(e) => s.push_str(&format!("  {e} (on this host; resolved again where the gateway starts)\n")),
            }
            s.push_str(&format!(
                "xdp {} mode; admin socket {}; metrics on {}\n",
                c.xdp.mode.name(),
                c.admin_socket.display(),
                c.metrics_listen
            ));
            s.push_str(&format!("nat ports {}-{}\n", c.tables.nat.ports.first, c.tables.nat.ports.last));
            match &c.tables.tunnel {
                Some(t) if c.kubernetes.is_some() => {
                    s.push_str(&format!("tunnel port {}: from every Node's InternalIPs\n", t.port))
                }
                Some(t) => s.push_str(&format!("tunnel port {}: from {} node addresses\n", t.port, t.nodes.len())),
                None => s.push_str("tunnel off\n"),
            }
            for e in &c.tables.egress_ips {
                let ports = e.ports.unwrap_or(c.tables.nat.ports);
                s.push_str(&format!(
                    "egress IP {} ports {}-{}{}\n",
                    e.ip,
                    ports.first,
                    ports.last,
                    if e.answer_neighbor { "" } else { " (ARP/NDP not answered)" }
                ));
            }
            for p in &c.tables.policies {
                let list = |v: &[ipnet::IpNet]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",");
                s.push_str(&format!(
                    "policy {}: {} -> {}{} via {}\n",
                    p.name,
                    list(&p.sources),
                    list(&p.destinations),
                    if p.except.is_empty() { String::new() } else { format!(" except {}", list(&p.except)) },
                    p.egress_ips.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
                ));
                for family in p.families_without_egress_ip() {
                    s.push_str(&format!(
                        "warning: policy {} selects {family} traffic but has no {family} egress IP: \
                         those packets are dropped (no_egress_ip_for_family); list an {family} egress IP, \
                         or no {family} destinations to leave them to the kernel\n",
                        p.name
                    ));
                }
            }
            s.push_str(&translation_logs_summary(c.translation_logs.as_ref()));
            if let Some(k) = &c.kubernetes {
                s.push_str("kubernetes mode: policies and egress IPs come from the cluster\n");
                let cidrs: Vec<String> = k.cluster_pod_cidrs.iter().map(ToString::to_string).collect();
                s.push_str(&format!(
                    "gateway Nodes: {}; cluster pod CIDRs: {}\n",
                    k.gateway_selector,
                    if cidrs.is_empty() { "none (no source guard)".to_string() } else { cidrs.join(",") }
                ));
                s.push_str(&format!(
                    "leases: duration {:?}, renew deadline {:?}, retry period {:?}; ownership {}\n",
                    k.lease_duration,
                    k.renew_deadline,
                    k.retry_period,
                    if k.liveness {
                        "liveness (one Lease per gateway renewed; an IP's Lease written when it changes hands)"
                    } else {
                        "perIP (every held IP's Lease renewed)"
                    }
                ));
                match &k.ha {
                    None => s.push_str(
                        "ha: off (no channel between gateways: no session sync, no early take-over, no failsafe)\n",
                    ),
                    Some(h) => s.push_str(&format!(
                        "ha: channel on {}:{} (key {}{}), liveness {:?}, resync {:?}, lone failsafe {:?}, peer cache {}\n",
                        h.address.map_or_else(|| "$HOST_IP".to_string(), |a| a.to_string()),
                        h.port,
                        h.key_file.display(),
                        if h.accept_key_files.is_empty() {
                            String::new()
                        } else {
                            let files: Vec<String> =
                                h.accept_key_files.iter().map(|p| p.display().to_string()).collect();
                            format!("; also accepted: {}", files.join(", "))
                        },
                        h.liveness,
                        h.resync_period,
                        h.lone_failsafe,
                        h.peer_cache.as_ref().map_or_else(|| "none".to_string(), |p| p.display().to_string()),
                    )),
                }
            }
            for w in &c.warnings {
                s.push_str(&format!("warning: {w}\n"));
            }
            print(&s);
            ExitCode::SUCCESS
        }
    }
}

/// `egret check-config`'s line on the translation logs: where each sink
/// sends, and where the journal `egret who-had` reads is kept.
fn translation_logs_summary(t: Option<&config::TranslationLogsConfig>) -> String {
    let Some(t) = t else { return "translation logs off\n".to_string() };
    let mut sinks = Vec::new();
    if let Some(i) = &t.ipfix {
        sinks.push(format!("IPFIX to {}", i.collector));
    }
    if let Some(y) = &t.syslog {
        let transport = match y.transport {
            config::SyslogTransport::Udp => "udp",
            config::SyslogTransport::Tcp => "tcp",
        };
        sinks.push(format!("syslog over {transport} to {}", y.collector));
    }
    match &t.journal {
        Some(j) => {
            sinks.push(format!("journal in {} (at most {} MiB, {:?})", j.dir.display(), j.max_bytes >> 20, j.max_age))
        }
        None => sinks.push("no journal (egret who-had cannot answer)".to_string()),
    }
    format!(
        "translation logs: {}; destinations {}\n",
        sinks.join(", "),
        if t.log_destinations { "logged" } else { "not logged" }
    )
}

/// Why `egret drain` could not set or remove the annotation.
#[derive(Debug, thiserror::Error)]
enum DrainError {
    /// No client for the API server (the kubeconfig).
    #[error(transparent)]
    Client(#[from] egret_controlplane::k8s::K8sError),
    /// The API server refused the patch, or did not answer in five
    /// attempts.
    #[error("Node {node}: {source}")]
    Patch {
        /// The Node.
        node: String,
        /// The last attempt's error.
        #[source]
        source: kube::Error,
    },
}

/// `egret drain NODE [--undo]`: sets or removes the drain annotation.
fn drain(node: &str, undo: bool, kubeconfig: Option<&std::path::Path>) -> ExitCode {
    use egret_controlplane::k8s::observe::DRAIN_ANNOTATION;
    use k8s_openapi::api::core::v1::Node;
    use kube::api::{Api, Patch, PatchParams};
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("egret drain: {e}");
            return ExitCode::FAILURE;
        }
    };
    let value = if undo { serde_json::Value::Null } else { serde_json::Value::String("true".into()) };
    let res = rt.block_on(async {
        let client = egret_controlplane::k8s::client(kubeconfig).await?;
        let nodes: Api<Node> = Api::all(client);
        let patch = serde_json::json!({"metadata": {"annotations": {DRAIN_ANNOTATION: value}}});
        // The patch is idempotent: a connection that failed (refused, reset,
        // a TLS handshake cut short on a busy control plane) or a server
        // error (etcd timed out, 429, 5xx) is tried again, four times in
        // about 9 s; any other answer from the API server is final.
        let transient = |e: &kube::Error| match e {
            kube::Error::Service(_) | kube::Error::HyperError(_) => true,
            kube::Error::Api(s) => s.code == 429 || s.code >= 500,
            _ => false,
        };
        let mut attempt = 1;
        loop {
            match nodes.patch(node, &PatchParams::default(), &Patch::Merge(&patch)).await {
                Err(e) if attempt < 5 && transient(&e) => {
                    eprintln!("egret drain: Node {node}: {e} (attempt {attempt} of 5; trying again)");
                    tokio::time::sleep(std::time::Duration::from_millis(400 << attempt.min(3))).await;
                    attempt += 1;
                }
                r => break r.map_err(|source| DrainError::Patch { node: node.to_owned(), source }),
            }
        }
    });
    match res {
        Ok(_) if undo => {
            print(&format!(
                "{node}: drain lifted; it competes for egress IPs again (no pre-emption: held IPs stay where they are)\n"
            ));
            ExitCode::SUCCESS
        }
        Ok(_) => {
            print(&format!("{node}: drained; its egress IPs move to the next candidates once those hold their sessions (egret status on {node} shows them leave)\n"));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("egret drain: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Gateway { config, metrics_listen, cluster } => {
            init_logs();
            if let Err(e) = cluster.check() {
                tracing::error!("{e}");
                return ExitCode::FAILURE;
            }
            // Every load of the file, at start and at each SIGHUP, takes them.
            config::set_overrides(cluster.overrides());
            match egret_controlplane::daemon::run_gateway_with(&config, metrics_listen) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::CheckConfig { file, metrics_listen, cluster } => check_config(&file, metrics_listen, cluster),
        Command::Cleanup => match egret_controlplane::failclosed::remove() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("egret cleanup: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Status(c) => {
            client(&c, Request::Status, |v| serde_json::from_value::<Status>(v).map(|s| render::status(&s)))
        }
        Command::Counters(c) => {
            client(&c, Request::Counters, |v| serde_json::from_value::<Counters>(v).map(|s| render::counters(&s)))
        }
        Command::Policies(c) => {
            client(&c, Request::Policies, |v| serde_json::from_value::<Vec<PolicyRow>>(v).map(|s| render::policies(&s)))
        }
        Command::Ports(c) => {
            client(&c, Request::Ports, |v| serde_json::from_value::<Vec<PortRow>>(v).map(|s| render::ports(&s)))
        }
        Command::PortUse(c) => client(&c, Request::PortUse, |v| {
            serde_json::from_value::<egret_controlplane::port_use::PortUse>(v).map(|u| render::port_use(&u))
        }),
        Command::PortBlocks(c) => client(&c, Request::PortBlocks, |v| {
            serde_json::from_value::<Vec<egret_controlplane::view::BlockRow>>(v).map(|b| render::port_blocks(&b))
        }),
        Command::Node(n) => node_main(n),
        Command::Drain { node, undo, kubeconfig } => drain(&node, undo, kubeconfig.as_deref()),
        Command::Cloud(CloudCommand::Discover { provider, subnet, tags }) => cloud_discover(provider, subnet, tags),
        Command::Sessions { client: c, egress_ip, pod, proto, limit } => {
            let filter = SessionFilter { egress_ip, pod, proto, limit: Some(limit) };
            client(&c, Request::Sessions { filter }, |v| {
                serde_json::from_value::<Vec<SessionRow>>(v).map(|s| render::sessions(&s))
            })
        }
        Command::WhoHad { client: c, target, at, proto, remote } => {
            let query =
                match egret_controlplane::translog::who_had::query(&target, &at, proto.as_deref(), remote.as_deref()) {
                    Ok(q) => q,
                    Err(e) => {
                        eprintln!("egret who-had: {e}");
                        return ExitCode::from(2);
                    }
                };
            let q = query.clone();
            client(&c, Request::WhoHad { query }, move |v| {
                serde_json::from_value::<WhoHadAnswer>(v).map(|a| render::who_had(&q, &a))
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_had_takes_an_address_port_and_a_time() {
        let cli = Cli::try_parse_from([
            "egret",
            "who-had",
            "203.0.113.10:41522",
            "--at",
            "2026-12-01T14:03:07Z",
            "--proto",
            "tcp",
            "--remote",
            "198.51.100.20:443",
            "--json",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        match cli.command {
            Command::WhoHad { client, target, at, proto, remote } => {
                assert!(client.json);
                assert_eq!(
                    (target.as_str(), at.as_str(), proto.as_deref(), remote.as_deref()),
                    ("203.0.113.10:41522", "2026-12-01T14:03:07Z", Some("tcp"), Some("198.51.100.20:443"))
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from(["egret", "who-had", "203.0.113.10:41522"]).is_err(), "--at is required");
    }

    #[test]
    fn the_gateway_takes_a_metrics_listen_address() {
        let cli = Cli::try_parse_from([
            "egret",
            "gateway",
            "--config=/etc/egret/gateway.yaml",
            "--metrics-listen=192.0.2.7:9469",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        match cli.command {
            Command::Gateway { metrics_listen, .. } => {
                assert_eq!(metrics_listen, Some("192.0.2.7:9469".parse().unwrap_or_else(|e| panic!("{e}"))));
            }
            other => panic!("{other:?}"),
        }
        let cli = Cli::try_parse_from(["egret", "gateway", "--config", "f"]).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(cli.command, Command::Gateway { metrics_listen: None, .. }));
        assert!(Cli::try_parse_from(["egret", "gateway", "--config", "f", "--metrics-listen", "localhost:1"]).is_err());
    }

    /// `egret gateway --cluster-pod-cidr --gateway-selector --nat-ports`
    /// (deploy/manifests/30-daemonset.yaml, from the ConfigMap
    /// egret-cluster): parsed into the overrides every load applies;
    /// `check-config` takes the same flags; a bad value names its flag.
    #[test]
    fn the_gateway_takes_the_clusters_settings() {
        let cli = Cli::try_parse_from([
            "egret",
            "gateway",
            "--config=/etc/egret/gateway.yaml",
            "--cluster-pod-cidr=10.1.0.0/16,fd00:10::/56",
            "--cluster-pod-cidr",
            "10.3.0.0/16",
            "--gateway-selector=example.com/egress=yes",
            "--nat-ports=40000-49999",
            "--tunnel-port=7000",
            "--metrics-listen=192.0.2.7:9469",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let Command::Gateway { cluster, .. } = cli.command else { panic!("{:?}", cli.command) };
        let o = cluster.overrides();
        let cidrs: Vec<String> = o.cluster_pod_cidrs.iter().flatten().map(ToString::to_string).collect();
        assert_eq!(cidrs, ["10.1.0.0/16", "fd00:10::/56", "10.3.0.0/16"]);
        assert_eq!(o.gateway_selector.as_deref(), Some("example.com/egress=yes"));
        assert_eq!(o.nat_ports, Some(PortRange { first: 40000, last: 49999 }));
        assert_eq!(o.tunnel_port, Some(7000));
        let cli = Cli::try_parse_from(["egret", "gateway", "--config", "f"]).unwrap_or_else(|e| panic!("{e}"));
        let Command::Gateway { cluster, .. } = cli.command else { panic!("{:?}", cli.command) };
        assert_eq!(cluster.overrides(), config::Overrides::default(), "no flag: the file's values");
        let cli =
            Cli::try_parse_from(["egret", "check-config", "f", "--nat-ports=1024-2047", "--metrics-listen=[::1]:1"])
                .unwrap_or_else(|e| panic!("{e}"));
        let Command::CheckConfig { cluster, metrics_listen, .. } = cli.command else { panic!("{:?}", cli.command) };
        assert_eq!(cluster.overrides().nat_ports, Some(PortRange { first: 1024, last: 2047 }));
        assert!(metrics_listen.is_some());
        for (bad, flag) in [
            ("--cluster-pod-cidr=pods", "--cluster-pod-cidr"),
            ("--gateway-selector=", "--gateway-selector"),
            ("--gateway-selector=a = b", "--gateway-selector"),
            ("--nat-ports=", "--nat-ports"),
            ("--nat-ports=2000-1000", "--nat-ports"),
            ("--nat-ports=0-1000", "--nat-ports"),
            ("--nat-ports=40000", "--nat-ports"),
            ("--nat-ports=1-70000", "--nat-ports"),
            ("--tunnel-port=0", "--tunnel-port"),
            ("--tunnel-port=", "--tunnel-port"),
        ] {
            let e = Cli::try_parse_from(["egret", "gateway", "--config", "f", bad]).expect_err(bad).to_string();
            assert!(e.contains(flag), "{bad}: {e}");
        }
    }

    /// The node agent's arguments in deploy/manifests/50-node-daemonset.yaml
    /// as the kubelet expands them from egret-cluster's values.
    #[test]
    fn the_node_agent_takes_the_manifests_arguments() {
        let cli = Cli::try_parse_from([
            "egret",
            "node",
            "--node-name=w1",
            "--cluster-cidr=10.244.0.0/16,fd00:10::/56,10.96.0.0/12",
            "--steer-mark=0x1000",
            "--nat-ports=40000-49999",
            "--metrics-listen=192.0.2.7:9465",
        ])
        .unwrap_or_else(|e| panic!("{e}"));
        let Command::Node(NodeCli { command: None, run }) = cli.command else { panic!("{:?}", cli.command) };
        let o = node_options(run).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.tunnel, node::tunnel::TunnelOptions::default(), "auto, port 6082, MTU from the routes");
        let cidrs: Vec<String> = o.cluster_cidrs.iter().map(ToString::to_string).collect();
        assert_eq!(cidrs, ["10.244.0.0/16", "fd00:10::/56", "10.96.0.0/12"]);
        assert_eq!(o.nat_ports, PortRange { first: 40000, last: 49999 });
        // egret-cluster's service-cidrs empty: `$(POD_CIDRS),$(SERVICE_CIDRS)`
        // ends in a comma.
        let node = |cidrs: &str| {
            let cli = Cli::try_parse_from(["egret", "node", "--node-name=w1", cidrs]).unwrap_or_else(|e| panic!("{e}"));
            let Command::Node(NodeCli { command: None, run }) = cli.command else { panic!("{:?}", cli.command) };
            node_options(run)
        };
        let o = node("--cluster-cidr=10.244.0.0/16,").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.cluster_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(), ["10.244.0.0/16"]);
        let o = node("--cluster-cidr=10.244.0.0/16, fd00:10::/56").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(o.cluster_cidrs.len(), 2, "a space after the comma");
        let e = Cli::try_parse_from(["egret", "node", "--cluster-cidr=10.244.0.0/16,10.96.0.0/33"])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("--cluster-cidr") && e.contains("10.96.0.0/33"), "{e}");
        // The gateway reads the same value alike.
        for v in ["10.244.0.0/16,", "10.244.0.0/16, fd00:10::/56"] {
            let cli = Cli::try_parse_from(["egret", "gateway", "--config", "f", &format!("--cluster-pod-cidr={v}")])
                .unwrap_or_else(|e| panic!("{v}: {e}"));
            let Command::Gateway { cluster, .. } = cli.command else { panic!("{:?}", cli.command) };
            let want = if v.contains("fd00") { 2 } else { 1 };
            assert!(cluster.check().is_ok(), "{v}");
            assert_eq!(cluster.overrides().cluster_pod_cidrs.map(|c| c.len()), Some(want), "{v}");
        }
        // Given, but empty: refused, not the file's value in silence.
        for v in ["--cluster-pod-cidr=", "--cluster-pod-cidr= , "] {
            let cli =
                Cli::try_parse_from(["egret", "gateway", "--config", "f", v]).unwrap_or_else(|e| panic!("{v}: {e}"));
            let Command::Gateway { cluster, .. } = cli.command else { panic!("{:?}", cli.command) };
            assert!(matches!(cluster.check(), Err(ArgError::NoClusterPodCidr)), "{v}");
            assert!(cluster.check().is_err_and(|e| e.to_string().contains("--cluster-pod-cidr")), "{v}");
        }
    }

    #[test]
    fn a_listen_address_may_be_a_bare_ipv6_address_and_port() {
        let v6: SocketAddr = "[2001:db8::7]:9465".parse().unwrap_or_else(|e| panic!("{e}"));
        let parse = |s: &str| parse_listen(s).map_err(|e| e.to_string());
        assert_eq!(parse("2001:db8::7:9465"), Ok(v6));
        assert_eq!(parse("[2001:db8::7]:9465"), Ok(v6));
        assert_eq!(parse("192.0.2.7:9465"), Ok("192.0.2.7:9465".parse().unwrap_or_else(|e| panic!("{e}"))));
        assert_eq!(parse("192.0.2.7"), Err("\"192.0.2.7\" is not ADDRESS:PORT".into()));
        assert!(parse_listen("192.0.2.7").is_err());
        assert!(parse_listen("2001:db8::7").is_err(), "no port: the last group is not taken as one");
        assert!(parse_listen("").is_err());
    }

    /// Each value error names the value, and the flag where clap does not
    /// put it in front (`invalid value 'V' for '--flag <FLAG>': ...`).
    #[test]
    fn a_bad_value_is_named_with_its_flag() {
        let e = |s: &str| Cli::try_parse_from(s.split(' ')).map(|_| ()).map_err(|e| e.to_string()).expect_err(s);
        let got = e("egret gateway --config f --nat-ports=9-x");
        assert!(got.contains("'--nat-ports <NAT_PORTS>': \"9-x\" is not FIRST-LAST"), "{got}");
        let got = e("egret gateway --config f --gateway-selector=a\t=b");
        assert!(
            got.contains("'--gateway-selector <GATEWAY_SELECTOR>'")
                && got.contains("\"a\\t=b\" is not a label selector (KEY=VALUE)"),
            "{got}"
        );
        let got = e("egret cloud discover --subnet s --tag =v");
        assert!(got.contains("--tag \"=v\": expected KEY=VALUE"), "{got}");
        let got = e("egret cloud discover --provider oci --subnet s --tag k=v");
        assert!(got.contains("\"oci\" is not a provider (aws, azure, gcp)"), "{got}");
        let got = e("egret node --cluster-cidr=10.0.0.0/8,,pods");
        assert!(got.contains("'--cluster-cidr <CLUSTER_CIDR>': \"pods\": "), "{got}");

        let node = |flag: &str| {
            let cli = Cli::try_parse_from(["egret", "node", "--node-name=w1", "--cluster-cidr=10.0.0.0/8", flag])
                .unwrap_or_else(|e| panic!("{e}"));
            let Command::Node(NodeCli { command: None, run }) = cli.command else { panic!("{:?}", cli.command) };
            node_options(run).map(|_| ()).expect_err(flag)
        };
        let got = node("--steer-mark=0x10g0");
        assert!(matches!(&got, ArgError::SteerMark { value } if value == "0x10g0"), "{got:?}");
        assert_eq!(got.to_string(), "--steer-mark: \"0x10g0\" is not a number (hex with 0x, or decimal)");
        let got = node("--nat-ports=40000");
        assert_eq!(got.to_string(), "--nat-ports: \"40000\" is not FIRST-LAST");
        let got = node("--metrics-listen= 192.0.2.7 ");
        assert_eq!(got.to_string(), "--metrics-listen: \"192.0.2.7\" is not ADDRESS:PORT");
        let got = e("egret node --cluster-cidr=10.0.0.0/8 --tunnel=on");
        assert!(got.contains("'--tunnel <TUNNEL>': --tunnel: \"on\" is not auto, never or always"), "{got}");
        let got = e("egret node --cluster-cidr=10.0.0.0/8 --tunnel-mtu=9k");
        assert!(got.contains("'--tunnel-mtu <TUNNEL_MTU>'"), "{got}");
        let got = e("egret node --cluster-cidr=10.0.0.0/8 --tunnel-port=gnv");
        assert!(got.contains("'--tunnel-port <TUNNEL_PORT>'"), "{got}");
        let got = tunnel_options(node::tunnel::TunnelMode::Auto, Some(" 70000".into()), None).unwrap_err().to_string();
        assert!(got.contains("--tunnel-port (or TUNNEL_PORT): \"70000\" is not a UDP port"), "{got}");
        let t = tunnel_options(node::tunnel::TunnelMode::Auto, Some("".into()), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.port, 6082, "an empty ConfigMap value takes the default");
        for (flag, want) in [
            ("--tunnel-port=0", "--tunnel-port: 0 is not a UDP port"),
            ("--tunnel-mtu=100", "--tunnel-mtu: 100 must be between 118 and 65535"),
        ] {
            let got = node(flag).to_string();
            assert!(got.contains(want), "{flag}: {got}");
        }
        let got = node("--nat-ports=2000-1000");
        assert!(matches!(got, ArgError::Node(_)), "{got:?}");
        assert_eq!(got.to_string(), "--nat-ports: 2000-1000 is not a port range");
    }
}
