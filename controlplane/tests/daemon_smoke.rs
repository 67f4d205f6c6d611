//! A smoke test of the whole daemon (root), in three namespaces:
//!
//! ```text
//!  pod (198.18.0.7) --veth-- [in0 198.18.0.1  gw  out0 203.0.113.1] --veth-- remote (203.0.113.2)
//! ```
//!
//! `egret gateway` runs two-arm in `gw` (generic XDP: the veth peers carry no
//! program) with one policy translating 198.18.0.0/24 -> 203.0.113.0/24 to
//! egress IP 203.0.113.10, which only the gateway answers ARP for. One UDP
//! exchange goes through it and the receiver sees the translated source;
//! SIGHUP moves the policy to 203.0.113.11 and a new exchange shows it;
//! SIGTERM exits 0 and leaves no XDP program attached. The gateway
//! namespace does not forward (ip_forward is 0): only the worker can have
//! carried the traffic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ip, netns, veth};
use egret_dataplane::netns::enter_named;

const CONFIG: &str = r#"
interfaces:
  - {name: in0, role: inside, queues: all}
  - {name: out0, role: outside, queues: all}
xdp: {mode: generic}
workers: {realtimePriority: 0, frames: 1024, ringSize: 256}
egressIPs:
  - {ip: 203.0.113.10}
policies:
  - name: team-a
    sources: [198.18.0.0/24]
    destinations: [203.0.113.0/24]
    egressIPs: [203.0.113.10]
admin: {socket: SOCKET}
metrics: {listen: "127.0.0.1:19469"}
"#;

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, sig: &str) {
    let st = Command::new("kill").args(["-s", sig, &child.id().to_string()]).status().unwrap();
    assert!(st.success());
}

/// Runs `f` on a thread inside namespace `ns`.
fn in_netns<T: Send>(ns: &str, f: impl FnOnce() -> T + Send) -> T {
    egret_dataplane::netns::run_in(ns, f).unwrap()
}

/// Sends from the pod's `port` until the remote's echo comes back; returns
/// the source address the remote saw.
fn exchange(pod_ns: &str, remote_ns: &str, port: u16) -> SocketAddr {
    let remote_ns = remote_ns.to_string();
    let server = std::thread::spawn(move || {
        enter_named(&remote_ns).unwrap();
        let s = UdpSocket::bind("203.0.113.2:7000").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 64];
        let (n, from) = loop {
            match s.recv_from(&mut buf) {
                Ok(got) => break got,
                // A stop and continue of the process cuts a timed receive
                // short (signal(7)): wait on.
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => panic!("the remote received nothing: {e}"),
            }
        };
        // Echo a few times (the first reply may meet an unresolved neighbour).
        for _ in 0..20 {
            s.send_to(&buf[..n], from).unwrap();
            std::thread::sleep(Duration::from_millis(100));
        }
        from
    });
    std::thread::sleep(Duration::from_millis(100));
    let got = in_netns(pod_ns, move || {
        let s = UdpSocket::bind(("198.18.0.7", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let mut buf = [0u8; 64];
        for _ in 0..40 {
            s.send_to(b"egret", "203.0.113.2:7000").unwrap();
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                return Some((buf[..n].to_vec(), from));
            }
        }
        None
    });
    let from = server.join().unwrap();
    let (payload, replier) = got.expect("no echo came back to the pod");
    assert_eq!(payload, b"egret");
    assert_eq!(replier, "203.0.113.2:7000".parse().unwrap(), "the reply is translated back to the remote's address");
    from
}

fn http_get(ns: &str, path: &'static str) -> String {
    in_netns(ns, move || {
        let mut s = std::net::TcpStream::connect("127.0.0.1:19469").unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    })
}

fn egret(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_egret")).args(args).output().unwrap();
    assert!(out.status.success(), "egret {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn gateway_translates_reloads_and_detaches() {
    let ns = netns("egsm", &["pod", "gw", "remote"]);
    let (pod, gw, remote) = (ns.name(0).to_string(), ns.name(1).to_string(), ns.name(2).to_string());
    veth(&pod, "p0", "198.18.0.7/24", &gw, "in0", "198.18.0.1/24");
    veth(&gw, "out0", "203.0.113.1/24", &remote, "r0", "203.0.113.2/24");
    ip(&["-n", &pod, "route", "add", "default", "via", "198.18.0.1"]);
    // A new namespace may inherit the host's forwarding (Linux 6.18 does):
    // switch it off, so that only the worker can move a packet.
    common::in_ns(&gw, &["sysctl", "-qw", "net.ipv4.ip_forward=0"]);
    let fwd = common::in_ns(&gw, &["sysctl", "-n", "net.ipv4.ip_forward"]);
    assert_eq!(String::from_utf8_lossy(&fwd.stdout).trim(), "0");

    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("egret.sock");
    let cfg_path = dir.path().join("gw.yaml");
    std::fs::write(&cfg_path, CONFIG.replace("SOCKET", sock.to_str().unwrap())).unwrap();
    assert!(egret(&["check-config", cfg_path.to_str().unwrap()])
        .contains("policy team-a: 198.18.0.0/24 -> 203.0.113.0/24 via 203.0.113.10"));

    let t0 = Instant::now();
    let child = Command::new("ip")
        .args(["netns", "exec", &gw, env!("CARGO_BIN_EXE_egret"), "gateway", "--config", cfg_path.to_str().unwrap()])
        .env("RUST_LOG", "info")
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut daemon = Daemon(child);
    // Ready: /ready answers 200. The deadline only catches a daemon that
    // never gets there: start-up is printed, not judged. It loads and
    // verifies the XDP program, which took the daemon 9.6 s to ready on the
    // emulated Linux 6.1 of tests/guest-kernel.
    let mut ready = false;
    for _ in 0..1200 {
        std::thread::sleep(Duration::from_millis(50));
        let r = in_netns(&gw, || std::net::TcpStream::connect("127.0.0.1:19469").is_ok());
        if r && http_get(&gw, "/ready").starts_with("HTTP/1.1 200") {
            ready = true;
            break;
        }
    }
    assert!(ready, "not ready within 60 s");
    println!("start-up to ready: {} ms", t0.elapsed().as_millis());
    assert!(ip(&["-n", &gw, "link", "show", "in0"]).contains("xdpgeneric"));
    let threads = std::fs::read_dir(format!("/proc/{}/task", daemon_pid(&daemon))).unwrap().count();
    assert!(threads >= 2);

    // One exchange: the remote sees the egress IP.
    let from = exchange(&pod, &remote, 40000);
    assert_eq!(from.ip().to_string(), "203.0.113.10", "translated source");
    let sessions = egret(&["sessions", "--socket", sock.to_str().unwrap(), "--json"]);
    let rows: serde_json::Value = serde_json::from_str(&sessions).unwrap();
    assert!(
        rows.as_array().unwrap().iter().any(|r| r["pod_port"] == 40000 && r["egress"] == "203.0.113.10"),
        "{sessions}"
    );
    let counters: serde_json::Value =
        serde_json::from_str(&egret(&["counters", "--socket", sock.to_str().unwrap(), "--json"])).unwrap();
    assert!(counters["announcements"].as_u64() >= Some(1), "the gratuitous ARP for 203.0.113.10 went out: {counters}");
    assert_eq!(counters["misdirected"].as_u64(), Some(0), "{counters}");
    let metrics = http_get(&gw, "/metrics");
    let (head, body) = metrics.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_lowercase().contains("content-type: application/openmetrics-text; version=1.0.0; charset=utf-8"),
        "{head}"
    );
    assert!(body.contains("egret_policy_packets_total{policy=\"team-a\",direction=\"outbound\"}"), "{body}");
    assert!(body.contains("\negret_config_generation 2\n") && body.ends_with("\n# EOF\n"), "{body}");
    assert!(body.contains("\negret_sessions_capacity{family=\"ipv6\"} "), "{body}");

    // Generation 1 is the engine's own compile; the first apply publishes 2.
    // SIGHUP with the policy moved to another egress IP.
    let moved = CONFIG
        .replace("SOCKET", sock.to_str().unwrap())
        .replace("  - {ip: 203.0.113.10}", "  - {ip: 203.0.113.10}\n  - {ip: 203.0.113.11}")
        .replace("egressIPs: [203.0.113.10]", "egressIPs: [203.0.113.11]");
    std::fs::write(&cfg_path, moved).unwrap();
    signal(&daemon.0, "HUP");
    let mut reloaded = false;
    for _ in 0..50 {
        std::thread::sleep(Duration::from_millis(50));
        if egret(&["status", "--socket", sock.to_str().unwrap()]).contains("generation  3\n") {
            reloaded = true;
            break;
        }
    }
    assert!(reloaded, "no reload seen");
    let from = exchange(&pod, &remote, 40001);
    assert_eq!(from.ip().to_string(), "203.0.113.11", "translated source after the reload");

    // A bad file is rejected and the running configuration stays.
    std::fs::write(&cfg_path, "interfaces: [\n").unwrap();
    signal(&daemon.0, "HUP");
    std::thread::sleep(Duration::from_millis(300));
    let status = egret(&["status", "--socket", sock.to_str().unwrap(), "--json"]);
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!((v["generation"].as_u64(), v["reload_failures"].as_u64()), (Some(3), Some(1)), "{status}");

    // SIGTERM: exit 0, nothing attached.
    signal(&daemon.0, "TERM");
    let st = daemon.0.wait().unwrap();
    assert!(st.success(), "{st:?}");
    for dev in ["in0", "out0"] {
        let l = ip(&["-n", &gw, "link", "show", dev]);
        assert!(!l.contains("xdp"), "{dev} still has XDP: {l}");
    }
    assert!(!sock.exists(), "admin socket removed");
}

fn daemon_pid(d: &Daemon) -> u32 {
    // `ip netns exec` execs the binary: same pid.
    d.0.id()
}
