//! Fail-closed forwarding: the gateway's kernel never forwards what Egret
//! would have translated.
//!
//! The XDP program is attached through a bpf_link, so a crashed or stopped
//! gateway leaves nothing attached (a requirement: a dead process must not
//! leave a half-working dataplane behind). But the gateway's kernel forwards
//! (it must: unselected pods and excluded destinations go through it), and
//! with the XDP program gone it would forward selected pods' traffic with the
//! pods' own addresses. So the daemon keeps an nftables table in the kernel
//! that drops, in the forward path, exactly the traffic the classification
//! steers to Egret. While Egret runs, that traffic is redirected in XDP and
//! never reaches the forward path, so the rules cost nothing; the table
//! outlives the process, so when Egret is gone the traffic is dropped instead
//! of leaking. Excluded destinations and unselected sources stay accepted.
//!
//! The rules are generated from the same compiled classification the engine
//! and the XDP program use: for each selected source prefix, longest first,
//! its class's destination entries, longest first (steer: drop; exclude:
//! accept), then accept; a first match in that order is the longest-prefix
//! answer. A leading set lookup lets unselected sources through at once.
//! The whole table is replaced atomically (`nft -f`, one transaction).
//! The daemon's sink (daemon/sink.rs) installs it first in every apply,
//! before the XDP maps and the engine change, so the table is never older
//! than what XDP passes; an apply whose table cannot be installed changes
//! nothing else (but giving up addresses it no longer holds).
//!
//! When an apply may replace the table ([`Hold`], [`ReleaseOnApply`]): in
//! file mode every apply does. In Kubernetes mode the file's tables are an
//! empty placeholder until the control plane has loaded the cluster, so the
//! daemon's start-up apply leaves whatever table the kernel has (a crashed
//! predecessor's, or the node image's; docs/operations.md); the table is
//! replaced from the control plane's first apply on, which
//! `k8s::controller::run` makes only once its watches are synced, i.e. with
//! the cluster's whole desired state. Otherwise a gateway restarted right
//! after a crash would, for the ~0.3 s until then, forward the selected pods'
//! traffic untranslated (the node router still sends it there).

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_dataplane::lpm::{LpmAddr, Prefix};
use egret_dataplane::policy::{Classifier, DstAction};
use egret_dataplane::tables::{Tables, TablesSpec};

use crate::sink::{ApplyError, TablesSink};

/// The nftables table Egret owns.
pub const TABLE: &str = "egret_failclosed";

/// Why the rules could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum FailClosedError {
    /// `nft` could not be run.
    #[error("running nft: {0} (install nftables: without it a stopped gateway forwards selected pods' traffic untranslated)")]
    Spawn(std::io::Error),
    /// `nft` refused the ruleset.
    #[error("nft refused the fail-closed ruleset: {0}")]
    Refused(String),
    /// `nft` did not finish in time; it was killed, the ruleset is the one
    /// before (nft applies a file as one transaction).
    #[error("nft did not finish within {0:?} and was killed")]
    TimedOut(Duration),
}

fn family_rules<A: LpmAddr>(c: &Classifier<A>, ip: &str, policy_name: &dyn Fn(u32) -> String, out: &mut String) {
    let mut sources: Vec<(Prefix<A>, u32)> = c.source_entries().collect();
    sources.sort_by(|a, b| b.0.len.cmp(&a.0.len).then(a.0.addr.sort_key().cmp(&b.0.addr.sort_key())));
    let mut dst: Vec<(u32, Prefix<A>, DstAction)> = c.destination_entries().collect();
    dst.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.len.cmp(&a.1.len)).then(a.1.addr.sort_key().cmp(&b.1.addr.sort_key())));
    for (src, class) in &sources {
        for (_, d, action) in dst.iter().filter(|(c, _, _)| c == class) {
            match action {
                DstAction::Steer(p) => out.push_str(&format!(
                    "    {ip} saddr {src} {ip} daddr {d} counter drop comment \"policy {}\"\n",
                    policy_name(p.0)
                )),
                DstAction::Exclude => out.push_str(&format!("    {ip} saddr {src} {ip} daddr {d} accept\n")),
            }
        }
        out.push_str(&format!("    {ip} saddr {src} accept\n"));
    }
}

fn set<A: LpmAddr>(name: &str, ty: &str, c: &Classifier<A>, out: &mut String) {
    let mut elems: Vec<String> = c.source_entries().map(|(p, _)| p.to_string()).collect();
    elems.sort();
    out.push_str(&format!("  set {name} {{\n    type {ty}; flags interval; auto-merge;\n"));
    if !elems.is_empty() {
        out.push_str(&format!("    elements = {{ {} }}\n", elems.join(", ")));
    }
    out.push_str("  }\n");
}

/// The nftables script that replaces Egret's table with rules for `tables`.
pub fn ruleset(tables: &Tables) -> String {
    let name = |id: u32| tables.policies.get(id as usize).map_or_else(|| id.to_string(), |p| p.name.replace('"', ""));
    let mut s = String::new();
    // Create-then-delete makes the replacement work whether or not the table
    // exists; nft applies the whole file as one transaction.
    s.push_str(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n"));
    s.push_str(&format!("table inet {TABLE} {{\n"));
    set::<Ipv4Addr>("selected4", "ipv4_addr", &tables.classify_v4, &mut s);
    set::<Ipv6Addr>("selected6", "ipv6_addr", &tables.classify_v6, &mut s);
    s.push_str("  chain forward {\n    type filter hook forward priority filter - 10; policy accept;\n");
    s.push_str("    meta nfproto ipv4 ip saddr != @selected4 accept\n");
    s.push_str("    meta nfproto ipv6 ip6 saddr != @selected6 accept\n");
    family_rules::<Ipv4Addr>(&tables.classify_v4, "ip", &name, &mut s);
    family_rules::<Ipv6Addr>(&tables.classify_v6, "ip6", &name, &mut s);
    s.push_str("  }\n}\n");
    s
}

/// How long `nft -f` may take before it is killed and the install fails
/// (a hung nft must not hold up the caller: Kubernetes mode applies from
/// the control plane's runtime thread, which also renews the Leases).
pub const NFT_TIMEOUT: Duration = Duration::from_secs(5);

fn nft(script: &str) -> Result<(), FailClosedError> {
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    run_bounded(&mut cmd, script.as_bytes(), NFT_TIMEOUT)
}

/// Runs `cmd` with `input` on its standard input, and waits for it at most
/// `timeout`: on expiry the child is killed and reaped. Its input is written
/// and its error output read by two short-lived threads, so neither a child
/// that stops reading nor one that writes much can block the caller past
/// the timeout. A non-zero exit is `Refused` with the error output.
fn run_bounded(cmd: &mut Command, input: &[u8], timeout: Duration) -> Result<(), FailClosedError> {
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(FailClosedError::Spawn)?;
    let writer = child.stdin.take().map(|mut stdin| {
        let input = input.to_vec();
        // A write error (the child exited or was killed) shows in its status.
        std::thread::spawn(move || drop(stdin.write_all(&input)))
    });
    let reader = child.stderr.take().map(|mut stderr| {
        std::thread::spawn(move || {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut err);
            err
        })
    });
    let status = loop {
        match child.try_wait().map_err(FailClosedError::Spawn)? {
            Some(status) => break Some(status),
            None if started.elapsed() >= timeout => {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    };
    if let Some(w) = writer {
        let _ = w.join();
    }
    let err = reader.and_then(|r| r.join().ok()).unwrap_or_default();
    match status {
        None => Err(FailClosedError::TimedOut(timeout)),
        Some(s) if s.success() => Ok(()),
        Some(_) => Err(FailClosedError::Refused(err.trim().to_string())),
    }
}

/// Installs (replaces) the fail-closed rules for `tables`.
pub fn install(tables: &Tables) -> Result<(), FailClosedError> {
    nft(&ruleset(tables))
}

/// Removes Egret's table (`egret cleanup`): after this, a stopped gateway's
/// kernel forwards selected pods' traffic untranslated again.
pub fn remove() -> Result<(), FailClosedError> {
    nft(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n"))
}

/// Whether applies may replace the kernel's table: released (every apply
/// replaces it) or held (applies leave the kernel's table as it is).
#[derive(Debug, Default)]
pub struct Hold {
    held: AtomicBool,
}

/// What [`Hold::install`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// The kernel's table was replaced with rules for the tables.
    Replaced,
    /// Held: the kernel's table (if any) was left as it is.
    Kept,
}

impl Hold {
    /// From now on applies leave the kernel's table alone (Kubernetes mode,
    /// before the start-up apply).
    pub fn hold(&self) {
        self.held.store(true, Ordering::Release);
    }

    /// Whether applies currently leave the kernel's table alone.
    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }

    /// From now on every apply replaces the table.
    pub fn release(&self) {
        self.held.store(false, Ordering::Release);
    }

    /// Runs `install` for `tables` unless held.
    pub fn install_with(
        &self,
        tables: &Tables,
        install: impl FnOnce(&Tables) -> Result<(), FailClosedError>,
    ) -> Result<Installed, FailClosedError> {
        if self.is_held() {
            return Ok(Installed::Kept);
        }
        install(tables).map(|()| Installed::Replaced)
    }

    /// [`install`] for `tables` unless held.
    pub fn install(&self, tables: &Tables) -> Result<Installed, FailClosedError> {
        self.install_with(tables, install)
    }
}

/// The sink the Kubernetes control plane applies through: releases the
/// gateway's [`Hold`] before each apply, so the control plane's first apply
/// (its whole desired state, made once its watches are synced) is the first
/// to replace the kernel's table.
pub struct ReleaseOnApply<S: ?Sized> {
    inner: Arc<S>,
    hold: Arc<Hold>,
}

impl<S: ?Sized> ReleaseOnApply<S> {
    /// Wraps `inner`, whose applies consult `hold`.
    pub fn new(inner: Arc<S>, hold: Arc<Hold>) -> Self {
        Self { inner, hold }
    }
}

impl<S: ?Sized> std::fmt::Debug for ReleaseOnApply<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReleaseOnApply").field("hold", &self.hold).finish_non_exhaustive()
    }
}

impl<S: TablesSink + ?Sized> TablesSink for ReleaseOnApply<S> {
    fn apply(&self, spec: &TablesSpec) -> Result<(), ApplyError> {
        self.hold.release();
        self.inner.apply(spec)
    }

    fn announce(&self, ips: &[IpAddr]) {
        self.inner.announce(ips);
    }

    fn set_valid_until(&self, deadlines: &[(IpAddr, Option<std::time::Instant>)]) {
        self.inner.set_valid_until(deadlines);
    }
}

#[cfg(test)]
mod tests {
    use egret_dataplane::tables::{EgressIpSpec, PolicySlots, PolicySpec};

    use super::*;

    fn tables() -> Tables {
        let spec = TablesSpec {
            policies: vec![
                PolicySpec {
                    name: "a".into(),
                    sources: vec!["198.18.0.0/24".parse().unwrap(), "2001:db8:18::/64".parse().unwrap()],
                    destinations: vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()],
                    except: vec!["198.51.100.128/25".parse().unwrap()],
                    egress_ips: vec!["203.0.113.10".parse().unwrap(), "2001:db8:113::10".parse().unwrap()],
                },
                PolicySpec {
                    name: "pod".into(),
                    sources: vec!["198.18.0.7/32".parse().unwrap()],
                    destinations: vec!["198.51.100.0/24".parse().unwrap()],
                    except: vec![],
                    egress_ips: vec!["203.0.113.11".parse().unwrap()],
                },
            ],
            egress_ips: vec![EgressIpSpec { ip: "203.0.113.10".parse().unwrap(), ports: None, answer_neighbor: true }],
            ..Default::default()
        };
        Tables::compile(&spec, 1, &PolicySlots::default()).unwrap()
    }

    #[test]
    fn rules_follow_longest_prefix_order() {
        let r = ruleset(&tables());
        let lines: Vec<&str> = r.lines().map(str::trim).filter(|l| l.contains("saddr 198.18")).collect();
        assert_eq!(
            lines,
            vec![
                // The /32 pod first: its class covers policy "pod" (for 198.51.100.0/24) and
                // policy "a" (everything else, except the /25).
                "ip saddr 198.18.0.7/32 ip daddr 198.51.100.128/25 counter drop comment \"policy pod\"",
                "ip saddr 198.18.0.7/32 ip daddr 198.51.100.0/24 counter drop comment \"policy pod\"",
                "ip saddr 198.18.0.7/32 ip daddr 0.0.0.0/0 counter drop comment \"policy a\"",
                "ip saddr 198.18.0.7/32 accept",
                "ip saddr 198.18.0.0/24 ip daddr 198.51.100.128/25 accept",
                "ip saddr 198.18.0.0/24 ip daddr 0.0.0.0/0 counter drop comment \"policy a\"",
                "ip saddr 198.18.0.0/24 accept",
            ]
        );
        assert!(r.contains("elements = { 198.18.0.0/24, 198.18.0.7/32 }"), "{r}");
        assert!(r.contains("ip6 saddr 2001:db8:18::/64 ip6 daddr ::/0 counter drop"), "{r}");
        assert!(r.starts_with("table inet egret_failclosed\ndelete table inet egret_failclosed\n"));
    }

    #[test]
    fn no_policies_still_makes_a_valid_table() {
        let t = Tables::compile(&TablesSpec::default(), 1, &PolicySlots::default()).unwrap();
        let r = ruleset(&t);
        assert!(!r.contains("elements"), "{r}");
        assert!(r.contains("ip saddr != @selected4 accept"));
    }

    /// The generated ruleset is accepted by the real nft (checked with
    /// `nft -c`, which parses and validates without installing).
    #[test]
    fn nft_accepts_the_ruleset() {
        let Ok(out) = Command::new("nft").arg("--version").output() else {
            eprintln!("SKIPPED nft_accepts_the_ruleset: nft not installed");
            return;
        };
        if !out.status.success() {
            return;
        }
        let mut child =
            Command::new("nft").args(["-c", "-f", "-"]).stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(ruleset(&tables()).as_bytes()).unwrap();
        let o = child.wait_with_output().unwrap();
        // Without CAP_NET_ADMIN nft -c cannot open its netlink socket.
        let err = String::from_utf8_lossy(&o.stderr);
        if err.contains("Operation not permitted") {
            eprintln!("SKIPPED nft_accepts_the_ruleset: needs root");
            return;
        }
        assert!(o.status.success(), "{err}");
    }

    #[test]
    fn hold_keeps_the_kernel_table_until_released() {
        let t = tables();
        let installs = std::cell::RefCell::new(Vec::new());
        let record = |t: &Tables| {
            installs.borrow_mut().push(ruleset(t));
            Ok(())
        };
        // File mode: released from the start, every apply replaces.
        let file = Hold::default();
        assert_eq!(file.install_with(&t, record).unwrap(), Installed::Replaced);
        assert_eq!(installs.borrow().len(), 1);
        // Kubernetes mode: the start-up apply keeps the kernel's table.
        let k8s = Hold::default();
        k8s.hold();
        assert_eq!(k8s.install_with(&t, record).unwrap(), Installed::Kept);
        assert_eq!(installs.borrow().len(), 1, "a held apply must not run nft");
        k8s.release();
        assert_eq!(k8s.install_with(&t, record).unwrap(), Installed::Replaced);
        assert_eq!(installs.borrow().len(), 2);
        assert_eq!(installs.borrow()[1], ruleset(&t));
        // An nft failure is reported, not hidden behind the hold.
        let err = k8s.install_with(&t, |_| Err(FailClosedError::Refused("no".into()))).unwrap_err();
        assert_eq!(err.to_string(), "nft refused the fail-closed ruleset: no");
    }

    /// Issue 14 item 6: a command that hangs is killed at the timeout
    /// instead of blocking its caller (before, `nft -f` was waited for
    /// without limit); a quick one's refusal still carries its message, and
    /// a child that never reads its input cannot block the write.
    #[test]
    fn external_commands_are_bounded_by_a_timeout() {
        let r = run_bounded(Command::new("sleep").arg("30"), b"", Duration::from_millis(200));
        assert!(matches!(r, Err(FailClosedError::TimedOut(_))), "{r:?}");
        let big = vec![b'x'; 4 << 20]; // more than a pipe holds
        let r = run_bounded(Command::new("sleep").arg("30"), &big, Duration::from_millis(200));
        assert!(matches!(r, Err(FailClosedError::TimedOut(_))), "{r:?}");
        let r = run_bounded(
            Command::new("sh").args(["-c", "cat >/dev/null; echo refused >&2; exit 3"]),
            b"x",
            Duration::from_secs(20),
        );
        assert_eq!(r.unwrap_err().to_string(), "nft refused the fail-closed ruleset: refused");
        assert!(run_bounded(Command::new("sh").args(["-c", "cat >/dev/null"]), &big, Duration::from_secs(20)).is_ok());
    }

    /// A sink that records, for each call, whether the hold was still held.
    #[derive(Default)]
    struct Seen {
        hold: Arc<Hold>,
        calls: std::sync::Mutex<Vec<(&'static str, bool)>>,
    }

    impl TablesSink for Seen {
        fn apply(&self, _spec: &TablesSpec) -> Result<(), ApplyError> {
            self.calls.lock().unwrap().push(("apply", self.hold.is_held()));
            Ok(())
        }
        fn announce(&self, _ips: &[IpAddr]) {
            self.calls.lock().unwrap().push(("announce", self.hold.is_held()));
        }
        fn set_valid_until(&self, _deadlines: &[(IpAddr, Option<std::time::Instant>)]) {
            self.calls.lock().unwrap().push(("set_valid_until", self.hold.is_held()));
        }
    }

    #[test]
    fn the_control_planes_first_apply_releases_the_hold() {
        let hold = Arc::new(Hold::default());
        hold.hold();
        let gateway = Arc::new(Seen { hold: hold.clone(), ..Seen::default() });
        // The daemon's own start-up apply goes to the gateway's sink directly: still held.
        gateway.apply(&TablesSpec::default()).unwrap();
        let cluster = ReleaseOnApply::new(gateway.clone(), hold.clone());
        assert!(hold.is_held(), "wrapping alone releases nothing");
        cluster.announce(&["203.0.113.10".parse().unwrap()]);
        assert!(hold.is_held(), "an announcement is not an apply");
        cluster.apply(&TablesSpec::default()).unwrap();
        cluster.apply(&TablesSpec::default()).unwrap();
        assert_eq!(
            *gateway.calls.lock().unwrap(),
            vec![("apply", true), ("announce", true), ("apply", false), ("apply", false)]
        );
    }
}
