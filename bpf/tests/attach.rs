//! Attaching the steering program to a real veth, inside network namespaces
//! this test creates (and always deletes, through `NetNs`'s guard), with
//! TEST-NET addresses only.
//!
//! The attaching side runs as a child process (this test binary re-run with
//! `ip netns exec`, selecting the ignored `child_process` test), so the parent
//! can SIGKILL it and check that the kernel detached the bpf_link, and can
//! watch the interface with `ip link` from outside.
//!
//! Topology: netns `<a>` holds veth0 (198.51.100.1/24, XDP attached here),
//! netns `<b>` holds its peer veth1 (198.51.100.2/24).
// Test harness: helpers outside #[test] functions unwrap and panic freely.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use std::io::{BufRead, BufReader, Lines, Write};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use egret_bpf::{Action, DstRule, LoadOptions, SrcPrefix, SteeringProgram, XdpMode};
use egret_dataplane::netns::NetnsGuard;

/// The table of the commands tests run and their packages (shared source,
/// no dependency on the `egret-tests` crate).
#[path = "../../tests/src/tools.rs"]
mod tools;

const CHILD_ENV: &str = "EGRET_BPF_ATTACH_CHILD";
const DEV: &str = "veth0";

// ------------------------------------------------------------ namespaces

/// Two network namespaces joined by a veth pair; deleted on drop.
struct NetNs {
    /// `a` and `b`, in that order.
    guard: NetnsGuard,
}

fn ip(args: &[&str]) -> std::process::Output {
    Command::new("ip").args(args).output().expect("run ip (iproute2)")
}

fn ip_ok(args: &[&str]) {
    let out = ip(args);
    assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl NetNs {
    /// `egret-bpf-<pid>-<n>-a` and `-b`; namespaces of this prefix whose
    /// process is gone (a run killed before its guards dropped) are deleted
    /// first.
    fn new() -> Self {
        let guard = NetnsGuard::unique("egret-bpf-", &["a", "b"]).create().unwrap_or_else(|e| panic!("{e}"));
        let ns = Self { guard };
        let (a, b) = (ns.a(), ns.b());
        ip_ok(&["-n", a, "link", "add", DEV, "type", "veth", "peer", "name", "veth1", "netns", b]);
        ip_ok(&["-n", a, "addr", "add", "198.51.100.1/24", "dev", DEV]);
        ip_ok(&["-n", b, "addr", "add", "198.51.100.2/24", "dev", "veth1"]);
        for (n, d) in [(a, DEV), (b, "veth1"), (a, "lo"), (b, "lo")] {
            ip_ok(&["-n", n, "link", "set", d, "up"]);
        }
        ns
    }

    /// The namespace holding veth0 (where XDP is attached).
    fn a(&self) -> &str {
        self.guard.name(0)
    }

    /// The namespace holding the peer, veth1.
    fn b(&self) -> &str {
        self.guard.name(1)
    }

    /// `ip link show` of veth0: whether an XDP program is attached, and how.
    fn xdp_state(&self) -> XdpState {
        let out = ip(&["-n", self.a(), "-d", "link", "show", "dev", DEV]);
        assert!(out.status.success());
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let first = text.lines().next().unwrap_or_default();
        if first.contains(" xdpgeneric ") {
            XdpState::Generic
        } else if first.contains(" xdp ") {
            XdpState::Native
        } else if text.contains("prog/xdp") {
            XdpState::Other(text)
        } else {
            XdpState::None
        }
    }

    fn wait_for(&self, want: XdpState) {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let state = self.xdp_state();
            if state == want {
                return;
            }
            assert!(Instant::now() < deadline, "veth0 is {state:?}, wanted {want:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether veth1 gets an echo reply from veth0. Panics when ping could
    /// not run at all ("missing tool ping (package iputils-ping)", or its
    /// own error), which must never read as "no reply".
    fn ping_from_b(&self) -> bool {
        if let Err(missing) = tools::require("ping") {
            panic!("{missing}");
        }
        let out = Command::new("ip")
            .args(["netns", "exec", self.b(), "ping", "-c", "3", "-i", "0.2", "-W", "1", "-q", "198.51.100.1"])
            .output()
            .unwrap_or_else(|e| panic!("{}", tools::explain_spawn("ip".as_ref(), e)));
        if let Some(missing) = tools::explain_netns_exec(&out) {
            panic!("{missing}");
        }
        // ping: 0 replies came, 1 none came; anything else is an error.
        match out.status.code() {
            Some(0) => true,
            Some(1) => false,
            _ => {
                panic!(
                    "ip netns exec {} ping: {}: {}",
                    self.b(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum XdpState {
    None,
    Native,
    Generic,
    Other(String),
}

// ------------------------------------------------------------ the child

/// A child process that loads and attaches inside netns `a`; killed on drop.
struct Attacher {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Attacher {
    fn spawn(ns: &NetNs, mode: &str) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns.a()])
            .arg(exe)
            .args(["--exact", "child_process", "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, mode)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn child");
        let stdin = child.stdin.take();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut a = Self { child, stdin, lines };
        a.expect_line("EGRET ATTACHED");
        a
    }

    /// Reads the child's stdout up to a line holding `prefix`, and returns
    /// the line from there (libtest may have printed "test ... " before it).
    fn expect_line(&mut self, prefix: &str) -> String {
        for line in self.lines.by_ref() {
            let line = line.unwrap();
            if let Some(at) = line.find(prefix) {
                return line[at..].to_string();
            }
        }
        panic!("child ended before printing {prefix:?}: {:?}", self.child.wait());
    }

    fn send(&mut self, command: &str) {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{command}").unwrap();
        stdin.flush().unwrap();
    }

    /// Asks the child for its verdict counters.
    fn counter(&mut self, name: &str) -> u64 {
        self.send("counters");
        let line = self.expect_line("EGRET COUNTERS");
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.parse().unwrap())
            .unwrap_or_else(|| panic!("no counter {name} in {line}"))
    }
}

impl Drop for Attacher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Not a test on its own: the body of the child process (see module doc).
/// Modes: `native`, `generic`, `steer` (native, and 198.51.100.2 steered
/// everywhere, with no AF_XDP socket bound).
#[test]
#[ignore = "run by the attach tests as their child process"]
fn child_process() {
    let Ok(mode) = std::env::var(CHILD_ENV) else { return };
    let prog = SteeringProgram::load(LoadOptions::default()).unwrap();
    if mode == "steer" {
        let sources = [SrcPrefix { prefix: "198.51.100.2/32".parse().unwrap(), class: 1 }];
        let rules = [DstRule { class: 1, prefix: "0.0.0.0/0".parse().unwrap(), action: Action::Steer, policy_id: 1 }];
        prog.replace_policy(&sources, &rules).unwrap();
    }
    let xdp_mode = if mode == "generic" { XdpMode::Generic } else { XdpMode::Native };
    let ifindex: u32 =
        std::fs::read_to_string(format!("/sys/class/net/{DEV}/ifindex")).unwrap().trim().parse().unwrap();
    let mut link = Some(prog.attach(ifindex, xdp_mode).unwrap());
    println!("EGRET ATTACHED {}", xdp_mode.name());
    for line in std::io::stdin().lines() {
        match line.unwrap().as_str() {
            "detach" => {
                if let Some(l) = link.take() {
                    l.detach();
                }
                println!("EGRET DETACHED");
            }
            "counters" => {
                let counters: Vec<String> =
                    prog.verdict_counters().unwrap().into_iter().map(|(r, n)| format!("{}={n}", r.name())).collect();
                println!("EGRET COUNTERS {}", counters.join(" "));
            }
            other => panic!("unknown command {other}"),
        }
    }
}

// ------------------------------------------------------------ the tests

#[test]
fn attach_native_and_generic_then_detach_on_drop() {
    let ns = NetNs::new();
    assert_eq!(ns.xdp_state(), XdpState::None);
    for (mode, state) in [("native", XdpState::Native), ("generic", XdpState::Generic)] {
        let mut child = Attacher::spawn(&ns, mode);
        assert_eq!(ns.xdp_state(), state, "{mode}");
        child.send("detach");
        child.expect_line("EGRET DETACHED");
        assert_eq!(ns.xdp_state(), XdpState::None, "{mode} after detach");
        drop(child.stdin.take());
        assert!(child.child.wait().unwrap().success(), "{mode} child exit");
    }
}

#[test]
fn sigkill_leaves_nothing_attached() {
    let ns = NetNs::new();
    let mut child = Attacher::spawn(&ns, "native");
    assert_eq!(ns.xdp_state(), XdpState::Native);
    child.child.kill().unwrap(); // SIGKILL
    let status = child.child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    ns.wait_for(XdpState::None);
    // And a new attach works at once (a netlink attach would now fail
    // with "File exists").
    let again = Attacher::spawn(&ns, "native");
    assert_eq!(ns.xdp_state(), XdpState::Native);
    drop(again);
    ns.wait_for(XdpState::None);
}

#[test]
fn real_frames_pass_or_are_dropped_with_no_socket() {
    let ns = NetNs::new();

    // Nothing selected: ARP and ICMP from 198.51.100.2 are the kernel's.
    let mut child = Attacher::spawn(&ns, "native");
    assert!(ns.ping_from_b(), "ping through XDP_PASS");
    assert!(child.counter("pass_unselected_source") >= 3);
    drop(child);
    ns.wait_for(XdpState::None);

    // 198.51.100.2 steered, no AF_XDP socket bound: its packets are dropped,
    // never handed to the kernel untranslated. (Other frames, e.g. IPv6
    // link-local MLD from either side, still pass as unselected.)
    let mut child = Attacher::spawn(&ns, "steer");
    assert!(!ns.ping_from_b(), "a steered source without a socket must not get through");
    assert!(child.counter("drop_no_socket_steered") >= 3);
    drop(child);
    ns.wait_for(XdpState::None);
    assert!(ns.ping_from_b(), "detached again: the kernel answers");
}
