//! The `egret` binary: the gateway daemon and the CLI that talks to it.
//!
//! ```text
//! egret gateway --config FILE        run the gateway (root)
//! egret check-config FILE            validate without touching the system
//! egret status|counters|policies|ports [--json] [--socket PATH]
//! egret sessions [--egress-ip IP] [--pod IP] [--proto tcp|udp|icmp] [--limit N]
//! ```
//! Logs go to stderr, filtered by `RUST_LOG` (default `info`).

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use egret_controlplane::admin::{self, render, Request};
use egret_controlplane::config;
use egret_controlplane::view::{Counters, PolicyRow, PortRow, SessionFilter, SessionRow, Status};

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
    },
    /// Remove the fail-closed forwarding rules a gateway leaves in the kernel
    /// (uninstalling Egret from a node). While they stay, a stopped gateway's
    /// kernel drops the traffic Egret would translate instead of forwarding it
    /// with pod addresses.
    Cleanup,
    /// Validate a configuration file and print what it would do.
    CheckConfig {
        /// The configuration file.
        file: PathBuf,
    },
    /// Interfaces, workers, owned addresses, configuration generation.
    Status(Client),
    /// Drops per reason, events, XDP verdicts, worker rings.
    Counters(Client),
    /// Policies and their traffic.
    Policies(Client),
    /// Port usage per egress IP and protocol.
    Ports(Client),
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

fn check_config(file: &std::path::Path) -> ExitCode {
    match config::load(file) {
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
        Ok(c) => {
            let mut s = format!("{}: valid\n", c.file);
            for i in &c.interfaces {
                s.push_str(&format!("interface {} ({:?}, queues {:?})\n", i.name, i.role, i.queues).to_lowercase());
            }
            s.push_str(&format!(
                "xdp {} mode; admin socket {}; metrics on {}\n",
                c.xdp.mode.name(),
                c.admin_socket.display(),
                c.metrics_listen
            ));
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
            }
            if c.kubernetes.is_some() {
                s.push_str("kubernetes mode: policies and egress IPs come from the cluster\n");
            }
            for w in &c.warnings {
                s.push_str(&format!("warning: {w}\n"));
            }
            print(&s);
            ExitCode::SUCCESS
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Gateway { config } => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
                )
                .with_writer(std::io::stderr)
                .init();
            match egret_controlplane::daemon::run_gateway(&config) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::CheckConfig { file } => check_config(&file),
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
        Command::Sessions { client: c, egress_ip, pod, proto, limit } => {
            let filter = SessionFilter { egress_ip, pod, proto, limit: Some(limit) };
            client(&c, Request::Sessions { filter }, |v| {
                serde_json::from_value::<Vec<SessionRow>>(v).map(|s| render::sessions(&s))
            })
        }
    }
}
