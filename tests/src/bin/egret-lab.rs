//! `egret-lab`: brings the network-namespace lab up, shows what the server
//! sees from each pod next to the gateway's sessions and counters, and
//! tears it down. `tests/lab.sh` drives it; docs/lab.md explains the lab.
//!
//! ```text
//! egret-lab up [--one-arm] [--server-mtu N] [--no-tx-checksum] [--no-gateway]
//! egret-lab demo
//! egret-lab down
//! egret-lab serve [--log FILE]      (the external server; runs inside the server namespace)
//! ```
#![allow(clippy::print_stdout)]

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use egret_tests::client;
use egret_tests::gateway::{egret_binary, Admin, Gateway, GatewayConfig};
use egret_tests::lab::{Arm, Lab, LabOptions};
use egret_tests::netns::{self, NetNs};
use egret_tests::plan::{self, Pod};
use egret_tests::server::Server;
use egret_tests::{LabError, Result};

const PREFIX: &str = "egret-lab";
const DIR: &str = "/run/egret-lab";

fn usage() -> ExitCode {
    eprintln!(
        "usage: egret-lab up [--one-arm] [--server-mtu N] [--no-tx-checksum] [--no-gateway] | demo | down | serve [--log FILE]\n\
         see docs/lab.md"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(cmd) = args.first() else { return usage() };
    let rest = &args[1..];
    let r = match cmd.as_str() {
        "up" => up(rest),
        "demo" => demo(),
        "down" => {
            down();
            Ok(true)
        }
        "serve" => serve(rest),
        _ => return usage(),
    };
    match r {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("egret-lab {cmd}: {e}");
            ExitCode::from(1)
        }
    }
}

fn flag_value(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn up(args: &[String]) -> Result<bool> {
    if netns::list().iter().any(|n| n.starts_with(&format!("{PREFIX}-"))) {
        eprintln!("egret-lab: a lab is already up (namespaces {PREFIX}-*); run `egret-lab down` first");
        return Ok(false);
    }
    let arm = if args.iter().any(|a| a == "--one-arm") { Arm::One } else { Arm::Two };
    let server_link_mtu = flag_value(args, "--server-mtu").and_then(|v| v.parse().ok());
    let _ = std::fs::remove_dir_all(DIR);
    let t = Instant::now();
    let lab = Lab::build(LabOptions {
        prefix: PREFIX.into(),
        arm,
        server_link_mtu,
        server: false,
        dir: Some(PathBuf::from(DIR)),
        tx_checksum_offload: !args.iter().any(|a| a == "--no-tx-checksum"),
    })?;
    println!("lab: {} namespaces up ({arm:?}-arm) in {:?}", lab.namespaces().len(), t.elapsed());

    // The server: this binary again, inside the server namespace, in its own
    // process group so the script's Ctrl-C reaches only the script (whose
    // trap runs `down`).
    let exe = std::env::current_exe().map_err(|e| LabError::io("current_exe", e))?;
    let out = std::fs::File::create(lab.dir().join("server.out")).map_err(|e| LabError::io("server.out", e))?;
    let mut cmd = lab.server_ns().command(&exe.to_string_lossy());
    cmd.args(["serve", "--log"])
        .arg(lab.dir().join("server.log"))
        .stdin(Stdio::null())
        .stdout(out.try_clone().map_err(|e| LabError::io("dup", e))?)
        .stderr(out);
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    cmd.spawn().map_err(|source| LabError::Spawn { cmd: netns::describe(&cmd), source })?;
    wait_server(&lab)?;
    println!("server: listening on {} and {} (HTTP :80, echo TCP/UDP :7, ping)", plan::SERVER, plan::SERVER6);

    if !args.iter().any(|a| a == "--no-gateway") {
        let cfg = GatewayConfig::lab_default(&lab);
        match Gateway::start(&lab, &cfg) {
            Ok(g) => {
                println!(
                    "gateway: egret running in {} (config {})",
                    lab.gateway_ns().name(),
                    g.config_path().display()
                );
                g.detach();
            }
            Err(e) => {
                // The guard deletes the namespaces.
                return Err(e);
            }
        }
    }
    lab.persist();
    Ok(true)
}

fn wait_server(lab: &Lab) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let addr = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    loop {
        let ok = lab
            .server_ns()
            .run_in(|| std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok())?;
        if ok {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(LabError::Timeout {
                what: format!("the lab server on {addr}"),
                after: Duration::from_secs(10),
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn serve(args: &[String]) -> Result<bool> {
    let log = flag_value(args, "--log").map(PathBuf::from);
    let server = Server::start_here(log)?;
    server.join();
    Ok(true)
}

fn down() {
    let gone = NetNs::delete_all_with_prefix(&format!("{PREFIX}-"));
    let _ = std::fs::remove_dir_all(DIR);
    if gone.is_empty() {
        println!("lab: nothing to remove");
    } else {
        println!("lab: removed {} namespaces ({})", gone.len(), gone.join(" "));
    }
}

struct Row {
    pod: Pod,
    what: String,
    saw: String,
    want: IpAddr,
    ok: bool,
}

fn server_log_icmp(token: &str) -> Option<String> {
    // Lines: "icmp <src:ident> <dst> <token>".
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let text = std::fs::read_to_string(format!("{DIR}/server.log")).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.starts_with("icmp ") && l.ends_with(&format!(" {token}"))) {
            return l.split_whitespace().nth(1).map(str::to_string);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn demo() -> Result<bool> {
    let ns = |role: &str| NetNs::existing(&format!("{PREFIX}-{role}"));
    let mut rows = Vec::new();
    let mut record = |pod: Pod, what: String, r: Result<String>, want: IpAddr| {
        let (saw, ok) = match r {
            Ok(s) => {
                let ip = s.parse::<SocketAddr>().map(|a| a.ip()).ok();
                (s, ip == Some(want))
            }
            Err(e) => (format!("FAILED: {e}"), false),
        };
        rows.push(Row { pod, what, saw, want, ok });
    };
    for pod in Pod::ALL {
        let pns = ns(&format!("pod-{}", pod.name()))?;
        let want = Lab::expected_source(pod, pod.server());
        let http = client::http(&pns, pod.http_endpoint(), "/demo", 0).map(|r| r.seen.to_string());
        record(pod, format!("HTTP {}", pod.http_endpoint()), http, want);
        let udp =
            client::udp_echo(&pns, pod.echo_endpoint(), &format!("demo-{}", pod.name())).map(|r| r.seen.to_string());
        record(pod, format!("UDP  {}", pod.echo_endpoint()), udp, want);
        let token = format!("demo-ping-{}-{}", pod.name(), std::process::id());
        let ping = client::ping(&pns, pod.server(), &token, Duration::from_secs(3)).and_then(|_| {
            server_log_icmp(&token).ok_or_else(|| LabError::Gateway("server log has no such ping".into()))
        });
        record(pod, format!("ping {}", pod.server()), ping, want);
    }
    // An excluded destination: policy "a" leaves 198.51.100.128/25 to the kernel.
    let a = ns("pod-a")?;
    let excluded = SocketAddr::new(plan::EXCLUDED.into(), plan::ECHO_PORT);
    let udp = client::udp_echo(&a, excluded, "demo-excluded").map(|r| r.seen.to_string());
    record(Pod::A, format!("UDP  {excluded} (excluded)"), udp, Lab::expected_source(Pod::A, plan::EXCLUDED.into()));

    println!("\nWhat the server saw (source address:port; for ping, address:identifier):\n");
    println!("{:<6} {:<16} {:<34} {:<32} {:<16} ok", "pod", "address", "request", "server saw", "expected");
    let mut all_ok = true;
    for r in &rows {
        all_ok &= r.ok;
        println!(
            "{:<6} {:<16} {:<34} {:<32} {:<16} {}",
            r.pod.name(),
            r.pod.addr().to_string(),
            r.what,
            r.saw,
            r.want.to_string(),
            if r.ok { "yes" } else { "NO" }
        );
    }

    match egret_binary() {
        Ok(bin) => {
            let admin = Admin { bin, socket: PathBuf::from(DIR).join("egret.sock") };
            println!("\n$ egret sessions\n{}", admin.sessions().unwrap_or_else(|e| format!("({e})")));
            match admin.counters() {
                Ok(c) => {
                    println!("$ egret counters --json   (non-zero values)");
                    for (k, v) in c.0.iter().filter(|(_, v)| **v > 0) {
                        println!("  {k:<48} {v}");
                    }
                }
                Err(e) => println!("$ egret counters --json\n({e})"),
            }
        }
        Err(e) => println!("\n(no egret binary: {e})"),
    }
    let gw = ns("gw")?;
    let links = gw.ip(&["-brief", "link"]).unwrap_or_default();
    let xdp = Command::new("ip")
        .args(["-n", gw.name(), "link", "show"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    println!("\ngateway interfaces:\n{links}XDP attached: {}", if xdp.contains("xdp") { "yes" } else { "no" });
    if !all_ok {
        println!("\nSome requests did not leave with the expected source (see the table).");
    }
    Ok(all_ok)
}
