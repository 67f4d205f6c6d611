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
//! of leaking. Excluded destinations and unselected sources stay accepted,
//! and so do the replies of connections this node's kernel DNATed
//! (kube-proxy serving a LoadBalancer VIP or NodePort on the gateway node):
//! their source is a pod's in the forward path but is restored to the
//! address the client connected to in postrouting.
//!
//! The rules are generated from the same compiled classification the engine
//! and the XDP program use, in the same two levels: an interval verdict map
//! from source address to the source's class chain, and per class an
//! interval verdict map from destination address to a verdict (steer: jump
//! to the policy's counting drop chain; exclude: accept); what a map does not
//! hold is accepted (unselected source, unmatched destination). nftables'
//! interval maps refuse overlapping elements, so nested prefixes are split
//! into disjoint ranges first, each with its longest prefix's answer
//! ([`disjoint_ranges`]): a map lookup is then the longest-prefix answer.
//! Maps, not one rule per source, because `nft -f` loads them about nine
//! times faster at 65,536 pods, in an eighth of the memory (docs/benchmarks.md,
//! "Fail-closed table").
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

use crate::nft_counters::{self, Carried};
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

/// The first and last address of `p`, as numbers.
fn bounds<A: LpmAddr>(p: &Prefix<A>) -> (u128, u128) {
    let lo = p.addr.sort_key();
    let host = u32::from(A::WIDTH - p.len);
    let hi = if host >= 128 { u128::MAX } else { lo | ((1u128 << host) - 1) };
    (lo, hi)
}

/// Splits possibly nested prefixes (prefixes never partly overlap) into
/// disjoint, ascending address ranges, each carrying the value of the
/// longest prefix that covers it; adjacent ranges with equal values are
/// merged. Addresses no prefix covers are in no range. This is what an
/// nftables interval map needs: it refuses overlapping elements, and its
/// lookup must give the longest-prefix answer the XDP program's LPM maps
/// give.
pub(crate) fn disjoint_ranges<A: LpmAddr, V: Clone + PartialEq>(
    entries: impl Iterator<Item = (Prefix<A>, V)>,
) -> Vec<(u128, u128, V)> {
    let mut items: Vec<(u128, u128, u8, V)> = entries
        .map(|(p, v)| {
            let (lo, hi) = bounds(&p);
            (lo, hi, p.len, v)
        })
        .collect();
    // Parents before the prefixes nested in them.
    items.sort_by(|a, b| a.0.cmp(&b.0).then(a.2.cmp(&b.2)));
    let mut out: Vec<(u128, u128, V)> = Vec::new();
    let emit = |out: &mut Vec<(u128, u128, V)>, lo: u128, hi: u128, v: &V| {
        if lo > hi {
            return;
        }
        if let Some(last) = out.last_mut() {
            if last.1 < u128::MAX && last.1 + 1 == lo && last.2 == *v {
                last.1 = hi;
                return;
            }
        }
        out.push((lo, hi, v.clone()));
    };
    // The open prefixes, innermost last, and the first address not yet emitted.
    let mut open: Vec<(u128, V)> = Vec::new();
    let mut cursor: u128 = 0;
    for (lo, hi, _, v) in items {
        while let Some((top_hi, top_v)) = open.last() {
            if *top_hi >= lo {
                break;
            }
            emit(&mut out, cursor, *top_hi, top_v);
            cursor = top_hi + 1; // top_hi < lo: no overflow
            open.pop();
        }
        if let Some((_, top_v)) = open.last() {
            if cursor < lo {
                emit(&mut out, cursor, lo - 1, top_v);
            }
        }
        cursor = lo;
        open.push((hi, v));
    }
    while let Some((top_hi, top_v)) = open.pop() {
        emit(&mut out, cursor, top_hi, &top_v);
        match top_hi.checked_add(1) {
            Some(next) => cursor = next,
            None => break, // the end of the address space: every outer prefix ends there too
        }
    }
    out
}

/// One interval map's element list (`lo-hi : verdict`, or `a : verdict`).
fn elements(ranges: &[(u128, u128, String)], addr: &dyn Fn(u128) -> String) -> String {
    let elems: Vec<String> = ranges
        .iter()
        .map(
            |(lo, hi, v)| {
                if lo == hi {
                    format!("{} : {v}", addr(*lo))
                } else {
                    format!("{}-{} : {v}", addr(*lo), addr(*hi))
                }
            },
        )
        .collect();
    elems.join(", ")
}

fn interval_map(
    name: &str,
    ty: &str,
    ranges: &[(u128, u128, String)],
    addr: &dyn Fn(u128) -> String,
    out: &mut String,
) {
    out.push_str(&format!("  map {name} {{\n    type {ty} : verdict; flags interval;\n"));
    if !ranges.is_empty() {
        out.push_str(&format!("    elements = {{ {} }}\n", elements(ranges, addr)));
    }
    out.push_str("  }\n");
}

/// One family's maps and chains: `sources{fam}` maps each selected source
/// range to its class's chain `class{fam}_{c}`, which looks the destination
/// up in `class{fam}_{c}_dst` (steer: jump to the policy's counting drop
/// chain; exclude: `pass`) and gives `pass` to what that map does not hold.
/// `pass` is `accept`, or `return` when the source guard must see the rest.
fn family<A: LpmAddr>(
    c: &Classifier<A>,
    fam: &str,
    ip: &str,
    ty: &str,
    addr: &dyn Fn(u128) -> String,
    pass: &str,
    out: &mut String,
) -> String {
    let sources = disjoint_ranges(c.source_entries().map(|(p, class)| (p, format!("jump class{fam}_{class}"))));
    interval_map(&format!("sources{fam}"), ty, &sources, addr, out);
    let mut chains = String::new();
    for class in 0..c.class_count() as u32 {
        let dst = disjoint_ranges(c.destination_entries().filter(|(k, _, _)| *k == class).map(|(_, p, a)| {
            let verdict = match a {
                DstAction::Steer(id) => format!("jump policy_{}", id.0),
                DstAction::Exclude => pass.to_string(),
            };
            (p, verdict)
        }));
        let map = format!("class{fam}_{class}_dst");
        interval_map(&map, ty, &dst, addr, out);
        chains.push_str(&format!("  chain class{fam}_{class} {{\n    {ip} daddr vmap @{map}\n    {pass}\n  }}\n"));
    }
    chains
}

/// The nftables script that replaces Egret's table with rules for `tables`.
///
/// Its size grows with the number of selected source ranges only in map
/// elements, which nft loads far faster than rules (docs/kubernetes.md,
/// "How many pods"). Every policy has a chain `policy_<index>` with a
/// counter: the packets it dropped, over both families and all classes.
pub fn ruleset(tables: &Tables) -> String {
    ruleset_carrying(tables, &Carried::new())
}

/// [`ruleset`] with its drop counters starting from `carried` (the
/// replaced table's, [`crate::nft_counters`]): one per policy (named after
/// a hash of its name, commented `policy <name>`), `untranslated` (the
/// guard) and `dnat_replies`.
pub fn ruleset_carrying(tables: &Tables, carried: &Carried) -> String {
    let name = |id: usize| tables.policies.get(id).map_or_else(|| id.to_string(), |p| p.name.clone());
    let mut s = String::new();
    // Create-then-delete makes the replacement work whether or not the table
    // exists; nft applies the whole file as one transaction.
    s.push_str(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n"));
    s.push_str(&format!("table inet {TABLE} {{\n"));
    let v4 = |a: u128| Ipv4Addr::from(a as u32).to_string();
    let v6 = |a: u128| Ipv6Addr::from(a).to_string();
    let guard = &tables.spec.guard;
    let guarded = !guard.sources.is_empty() && !guard.interfaces.is_empty();
    // With the guard, what Egret does not translate goes on to it.
    let pass = if guarded { "return" } else { "accept" };
    let mut chains = family::<Ipv4Addr>(&tables.classify_v4, "4", "ip", "ipv4_addr", &v4, pass, &mut s);
    chains.push_str(&family::<Ipv6Addr>(&tables.classify_v6, "6", "ip6", "ipv6_addr", &v6, pass, &mut s));
    // Every policy, and any policy index a rule names (none beyond them today).
    let mut ids: std::collections::BTreeSet<usize> = (0..tables.policies.len()).collect();
    let steers = |a: DstAction| if let DstAction::Steer(p) = a { Some(p.0 as usize) } else { None };
    ids.extend(tables.classify_v4.destination_entries().filter_map(|(_, _, a)| steers(a)));
    ids.extend(tables.classify_v6.destination_entries().filter_map(|(_, _, a)| steers(a)));
    for id in ids {
        let counter = nft_counters::policy_counter(&name(id));
        let comment = nft_counters::safe_comment(&format!("policy {}", name(id)));
        nft_counters::declare(&mut s, &counter, &comment, carried);
        s.push_str(&format!(
            "  chain policy_{id} {{\n    counter name \"{counter}\" drop comment \"{comment}\"\n  }}\n"
        ));
    }
    nft_counters::declare(&mut s, "dnat_replies", DNAT_REPLIES, carried);
    s.push_str(&chains);
    if guarded {
        for (name, ty, v4) in [("guard4", "ipv4_addr", true), ("guard6", "ipv6_addr", false)] {
            let elems: Vec<String> =
                guard.sources.iter().filter(|n| n.addr().is_ipv4() == v4).map(|n| n.trunc().to_string()).collect();
            s.push_str(&format!("  set {name} {{\n    type {ty}\n    flags interval\n    auto-merge\n"));
            if !elems.is_empty() {
                s.push_str(&format!("    elements = {{ {} }}\n", elems.join(", ")));
            }
            s.push_str("  }\n");
        }
        nft_counters::declare(&mut s, "untranslated", UNTRANSLATED, carried);
    }
    s.push_str("  chain forward {\n    type filter hook forward priority filter - 10; policy accept;\n");
    // A reply of a connection this node's kernel DNATed (kube-proxy serving
    // a LoadBalancer VIP or a NodePort on the gateway node, masquerading to
    // the node's address): conntrack has already undone the masquerade, so
    // here it reads "from the pod to the client", which the maps below
    // would drop as untranslated; postrouting then restores its source to
    // the VIP or node address the client connected to. Never a pod's own
    // source on the wire, so it passes.
    s.push_str(&format!(
        "    ct direction reply ct status dnat counter name \"dnat_replies\" accept comment \"{DNAT_REPLIES}\"\n"
    ));
    s.push_str("    meta nfproto ipv4 ip saddr vmap @sources4\n");
    s.push_str("    meta nfproto ipv6 ip6 saddr vmap @sources6\n");
    if guarded {
        // Reached by everything the classification does not drop: an
        // unselected source, and a selected source's destination no policy
        // of its class steers (a node agent ahead of this gateway after a
        // policy change). Pod-to-pod traffic (a pod on this Node) passes.
        let ifs: Vec<String> = guard.interfaces.iter().map(|i| format!("\"{}\"", i.replace('"', ""))).collect();
        let ifs = ifs.join(", ");
        s.push_str(&format!(
            "    iifname {{ {ifs} }} ip saddr @guard4 ip daddr != @guard4 counter name \"untranslated\" drop comment \"{UNTRANSLATED}\"\n    iifname {{ {ifs} }} ip6 saddr @guard6 ip6 daddr != @guard6 counter name \"untranslated\" drop comment \"{UNTRANSLATED}\"\n"
        ));
    }
    s.push_str("  }\n}\n");
    s
}

/// How long `nft -f` may take before it is killed and the install fails
/// (a hung nft must not hold up the caller: Kubernetes mode's applies, on a
/// blocking thread, hold the sink's lock the next apply waits for).
pub const NFT_TIMEOUT: Duration = Duration::from_secs(5);

/// The bound until one `nft` run of this process has succeeded. The first
/// run on a host may autoload nf_tables and its expression modules
/// (nft_ct, nft_counter, nft_objref, ...) and fetch a cold ruleset cache:
/// on tests/guest-kernel's emulated Linux 6.1 beside the CI's other work
/// that took more than [`NFT_TIMEOUT`] (the daemon then never started).
/// Nothing waits on the sink's lock before the first apply has finished.
pub const NFT_FIRST_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether one `nft` run of this process has succeeded.
static NFT_RAN: AtomicBool = AtomicBool::new(false);

/// Runs `nft -f -` with `script`, bounded by [`NFT_FIRST_TIMEOUT`] until a
/// run has succeeded and by [`NFT_TIMEOUT`] after.
pub(crate) fn run_nft(script: &str) -> Result<(), FailClosedError> {
    let mut cmd = Command::new("nft");
    cmd.args(["-f", "-"]);
    let bound = if NFT_RAN.load(Ordering::Acquire) { NFT_TIMEOUT } else { NFT_FIRST_TIMEOUT };
    let result = run_bounded(&mut cmd, script.as_bytes(), bound);
    if result.is_ok() {
        NFT_RAN.store(true, Ordering::Release);
    }
    result
}

/// Runs `cmd` with `input` on its standard input, and waits for it at most
/// `timeout`: on expiry the child is killed and reaped. Its input is written
/// and its error output read by two short-lived threads, so neither a child
/// that stops reading nor one that writes much can block the caller past
/// the timeout. A non-zero exit is `Refused` with the error output.
pub(crate) fn run_bounded(cmd: &mut Command, input: &[u8], timeout: Duration) -> Result<(), FailClosedError> {
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

/// Installs (replaces) the fail-closed rules for `tables`, its drop
/// counters carried over from the table it replaces.
pub fn install(tables: &Tables) -> Result<(), FailClosedError> {
    run_nft(&ruleset_carrying(tables, &nft_counters::read(&[TABLE])))
}

/// The comment (and carried key) of the guard's drop counter.
const UNTRANSLATED: &str = "untranslated pod source";
/// The comment (and carried key) of the DNAT-reply counter.
const DNAT_REPLIES: &str = "reply of a connection this node DNATed";

/// Removes Egret's table (`egret cleanup`): after this, a stopped gateway's
/// kernel forwards selected pods' traffic untranslated again.
pub fn remove() -> Result<(), FailClosedError> {
    run_nft(&format!("table inet {TABLE}\ndelete table inet {TABLE}\n"))
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

    fn sessions(&self) -> Option<std::sync::Arc<dyn crate::ha::SessionStore>> {
        self.inner.sessions()
    }

    fn set_valid_until(&self, deadlines: &[(IpAddr, Option<std::time::Instant>)]) {
        self.inner.set_valid_until(deadlines);
    }
}

#[cfg(test)]
mod tests {
    use egret_dataplane::netns::NetnsGuard;
    use egret_dataplane::policy::Decision;
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
            egress_ips: vec![EgressIpSpec {
                ip: "203.0.113.10".parse().unwrap(),
                ports: None,
                answer_neighbor: true,
                port_blocks: None,
            }],
            ..Default::default()
        };
        Tables::compile(&spec, 1, &PolicySlots::default()).unwrap()
    }

    #[test]
    fn maps_split_nested_prefixes_longest_first() {
        let r = ruleset(&tables());
        // The /32 pod is its own class (policies "pod" and "a"), inside the /24's class.
        assert!(
            r.contains(
                "elements = { 198.18.0.0-198.18.0.6 : jump class4_0, 198.18.0.7 : jump class4_1, \
                 198.18.0.8-198.18.0.255 : jump class4_0 }"
            ),
            "{r}"
        );
        // Class 1: policy pod's /24 (policy a's /25 exception does not apply to
        // it) inside policy a's /0; class 0: the /25 exception inside the /0.
        assert!(
            r.contains(
                "elements = { 0.0.0.0-198.51.99.255 : jump policy_0, 198.51.100.0-198.51.100.255 : jump policy_1, \
                 198.51.101.0-255.255.255.255 : jump policy_0 }"
            ),
            "{r}"
        );
        assert!(
            r.contains(
                "elements = { 0.0.0.0-198.51.100.127 : jump policy_0, 198.51.100.128-198.51.100.255 : accept, \
                 198.51.101.0-255.255.255.255 : jump policy_0 }"
            ),
            "{r}"
        );
        let pod = crate::nft_counters::policy_counter("pod");
        assert!(
            r.contains(&format!("chain policy_1 {{\n    counter name \"{pod}\" drop comment \"policy pod\"\n  }}")),
            "{r}"
        );
        assert!(
            r.contains(&format!("counter {pod} {{\n    comment \"policy pod\"\n    packets 0 bytes 0\n  }}")),
            "{r}"
        );
        assert!(r.contains("elements = { 2001:db8:18::-2001:db8:18:0:ffff:ffff:ffff:ffff : jump class6_0 }"), "{r}");
        assert!(r.contains("elements = { ::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff : jump policy_0 }"), "{r}");
        assert!(r.starts_with("table inet egret_failclosed\ndelete table inet egret_failclosed\n"));
        // Replies of connections the node DNATed pass before any policy map.
        let dnat = r
            .find("ct direction reply ct status dnat counter name \"dnat_replies\" accept")
            .expect("the DNAT-reply rule");
        assert!(dnat < r.find("ip saddr vmap @sources4").unwrap(), "{r}");
    }

    /// Longest match over `prefixes`, by brute force.
    fn longest(prefixes: &[(Prefix<Ipv4Addr>, u32)], a: u128) -> Option<u32> {
        prefixes
            .iter()
            .filter(|(p, _)| (bounds(p).0..=bounds(p).1).contains(&a))
            .max_by_key(|(p, _)| p.len)
            .map(|(_, v)| *v)
    }

    /// The disjoint ranges answer as a longest-prefix lookup does, at every
    /// prefix's edges and just outside them, for nested, adjacent and equal
    /// -valued prefixes, including ones reaching either end of the space.
    #[test]
    fn disjoint_ranges_give_the_longest_prefix_answer() {
        let p = |s: &str, v: u32| {
            let (a, l) = s.split_once('/').unwrap();
            (Prefix::new(a.parse::<Ipv4Addr>().unwrap(), l.parse().unwrap()), v)
        };
        let cases = [
            vec![p("0.0.0.0/0", 1), p("10.0.0.0/8", 2), p("10.1.0.0/16", 3), p("10.1.2.0/24", 2), p("10.1.2.3/32", 4)],
            vec![p("0.0.0.0/1", 1), p("128.0.0.0/1", 1), p("255.255.255.255/32", 2), p("0.0.0.0/32", 3)],
            vec![p("198.18.0.0/24", 1), p("198.18.1.0/24", 1), p("198.18.0.128/25", 2), p("198.18.0.128/26", 1)],
            vec![p("255.0.0.0/8", 5), p("255.255.0.0/16", 6), p("255.255.255.0/24", 5)],
            vec![],
        ];
        for prefixes in cases {
            let ranges = disjoint_ranges(prefixes.iter().copied());
            for w in ranges.windows(2) {
                assert!(w[0].1 < w[1].0, "overlap or disorder in {ranges:?}");
                assert!(!(w[0].1 + 1 == w[1].0 && w[0].2 == w[1].2), "unmerged neighbours in {ranges:?}");
            }
            let mut probes = vec![0u128, u128::from(u32::MAX)];
            for (q, _) in &prefixes {
                let (lo, hi) = bounds(q);
                probes.extend([lo, hi, lo.saturating_sub(1), (hi + 1).min(u128::from(u32::MAX))]);
            }
            for a in probes {
                let got = ranges.iter().find(|(lo, hi, _)| (*lo..=*hi).contains(&a)).map(|r| r.2);
                assert_eq!(got, longest(&prefixes, a), "address {} in {prefixes:?}", Ipv4Addr::from(a as u32));
            }
        }
    }

    #[test]
    fn no_policies_still_makes_a_valid_table() {
        let t = Tables::compile(&TablesSpec::default(), 1, &PolicySlots::default()).unwrap();
        let r = ruleset(&t);
        assert!(!r.contains("elements"), "{r}");
        assert!(r.contains("ip saddr vmap @sources4"));
    }

    /// The generated ruleset is accepted by the real nft (checked with
    /// `nft -c`, which parses and validates without installing).
    #[test]
    fn nft_accepts_the_ruleset() {
        if !crate::test_support::has_tool("nft", "--version") {
            crate::test_support::skip("nft_accepts_the_ruleset", "nft is not installed or does not run");
            return;
        }
        let mut child =
            Command::new("nft").args(["-c", "-f", "-"]).stdin(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        child.stdin.take().unwrap().write_all(ruleset(&tables()).as_bytes()).unwrap();
        let o = child.wait_with_output().unwrap();
        // Without CAP_NET_ADMIN nft -c cannot open its netlink socket.
        let err = String::from_utf8_lossy(&o.stderr);
        if err.contains("Operation not permitted") {
            crate::test_support::skip("nft_accepts_the_ruleset", "nft -c needs CAP_NET_ADMIN (root)");
            return;
        }
        assert!(o.status.success(), "{err}");
    }

    /// Runs a command, returning whether it succeeded.
    fn sh(args: &[&str]) -> bool {
        Command::new(args[0])
            .args(&args[1..])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// The ruleset, installed in a real kernel that routes between a client
    /// and a server namespace, drops exactly what the classifier steers
    /// (nested sources: a /32 pod inside a /24; nested destinations: a /24
    /// and a /25 exception inside a /0) and forwards the rest, and counts
    /// the drops in the policy's chain.
    #[test]
    fn the_kernel_drops_exactly_what_the_classifier_steers() {
        if !crate::test_support::is_root() || !sh(&["nft", "--version"]) || !sh(&["ip", "-V"]) {
            crate::test_support::skip("the_kernel_drops_exactly_what_the_classifier_steers", "needs root, ip and nft");
            return;
        }
        // Unique names; namespaces a killed run left are removed first.
        let ns = NetnsGuard::unique("efc", &["cli", "rtr", "srv"]).lo_up().create().expect("namespaces");
        let (cli, rtr, srv) = (ns.name(0), ns.name(1), ns.name(2));
        let setup = [
            format!("ip link add efc14c netns {cli} type veth peer name efc14rc netns {rtr}"),
            format!("ip link add efc14s netns {srv} type veth peer name efc14rs netns {rtr}"),
            format!("ip -n {cli} link set efc14c up"),
            format!("ip -n {cli} addr add 192.0.2.2/24 dev efc14c"),
            format!("ip -n {cli} addr add 198.18.0.7/32 dev efc14c"),
            format!("ip -n {cli} addr add 198.18.0.1/32 dev efc14c"),
            format!("ip -n {cli} addr add 198.18.1.1/32 dev efc14c"),
            format!("ip -n {cli} route add default via 192.0.2.1"),
            format!("ip -n {rtr} link set efc14rc up"),
            format!("ip -n {rtr} link set efc14rs up"),
            format!("ip -n {rtr} addr add 192.0.2.1/24 dev efc14rc"),
            format!("ip -n {rtr} addr add 198.51.100.253/24 dev efc14rs"),
            format!("ip -n {rtr} route add 198.18.0.0/15 via 192.0.2.2"),
            format!("ip -n {rtr} route add 203.0.113.0/24 via 198.51.100.254"),
            format!("ip netns exec {rtr} sysctl -qw net.ipv4.ip_forward=1"),
            format!("ip -n {srv} link set efc14s up"),
            format!("ip -n {srv} addr add 198.51.100.254/24 dev efc14s"),
            format!("ip -n {srv} addr add 198.51.100.1/32 dev efc14s"),
            format!("ip -n {srv} addr add 198.51.100.200/32 dev efc14s"),
            format!("ip -n {srv} addr add 203.0.113.5/32 dev efc14s"),
            format!("ip -n {srv} route add default via 198.51.100.253"),
        ];
        for c in setup {
            assert!(sh(&c.split(' ').collect::<Vec<_>>()), "{c}");
        }
        let t = tables();
        let install_carrying = |t: &Tables, carried: &crate::nft_counters::Carried| {
            let mut child = Command::new("ip")
                .args(["netns", "exec", rtr, "nft", "-f", "-"])
                .stdin(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(ruleset_carrying(t, carried).as_bytes()).unwrap();
            let o = child.wait_with_output().unwrap();
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        };
        let install = |t: &Tables| install_carrying(t, &Default::default());
        install(&t);
        let ping = |src: &str, dst: &str| sh(&["ip", "netns", "exec", cli, "ping", "-q", "-c1", "-W1", "-I", src, dst]);
        // Unselected, and the two classes (the /32 pod, the rest of the /24).
        let sources = ["198.18.1.1", "198.18.0.7", "198.18.0.1"];
        // Inside policy pod's /24 and outside policy a's /25 exception; inside both; only policy a's /0.
        let destinations = ["198.51.100.1", "198.51.100.200", "203.0.113.5"];
        let mut drops = 0;
        for src in sources {
            for dst in destinations {
                let steer =
                    matches!(t.classify_v4.classify(src.parse().unwrap(), dst.parse().unwrap()), Decision::Steer(_));
                drops += usize::from(steer);
                assert_eq!(ping(src, dst), !steer, "{src} -> {dst}: steered {steer}");
            }
        }
        assert_eq!(drops, 5, "the probes cover steered and forwarded pairs");
        // The counters as nft lists them in the router's namespace (the
        // installer reads them over nfnetlink in its own).
        let counters = || -> crate::nft_counters::Carried {
            let out = Command::new("ip")
                .args(["netns", "exec", rtr, "nft", "-j", "list", "counters", "table", "inet", TABLE])
                .output()
                .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            v["nftables"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|i| i.get("counter"))
                .map(|c| {
                    let n = |k: &str| c[k].as_u64().unwrap();
                    (c["name"].as_str().unwrap().to_string(), (n("packets"), n("bytes")))
                })
                .collect()
        };
        let pod = crate::nft_counters::policy_counter("pod");
        // 198.18.0.7 to both 198.51.100.x addresses: one echo request each.
        let before = counters();
        assert_eq!(before.get(&pod).map(|c| c.0), Some(2), "{before:?}");
        // A replacement (every apply) carries the counts over, by policy
        // name, as install() does with the table's own listing.
        install_carrying(&t, &before);
        assert_eq!(counters(), before, "the counts survive the table's replacement");
        install(&t);
        assert_eq!(counters().get(&pod).map(|c| c.0), Some(0), "without carrying they would reset");

        // The source guard: the pod CIDR's untranslated traffic arriving on
        // the guarded interface is dropped, whatever the policies say;
        // excluded destinations of selected sources and other sources pass.
        let guarded = |interface: &str| {
            let mut spec = t.spec.clone();
            spec.guard = egret_dataplane::tables::SourceGuard {
                interfaces: vec![interface.into()],
                sources: vec!["198.18.0.0/16".parse().unwrap(), "198.19.255.0/24".parse().unwrap()],
            };
            Tables::compile(&spec, 2, &PolicySlots::default()).unwrap()
        };
        // A "pod" on the far side (a pod on the gateway's own Node).
        for c in [
            format!("ip -n {srv} addr add 198.19.255.1/32 dev efc14s"),
            format!("ip -n {rtr} route add 198.19.255.0/24 via 198.51.100.254"),
        ] {
            assert!(sh(&c.split(' ').collect::<Vec<_>>()), "{c}");
        }
        let excluded = ("198.18.0.1", "198.51.100.200");
        assert!(!matches!(
            t.classify_v4.classify(excluded.0.parse().unwrap(), excluded.1.parse().unwrap()),
            Decision::Steer(_)
        ));
        assert!(ping(excluded.0, excluded.1), "unguarded: a selected source's excluded destination is forwarded");
        install(&guarded("efc14rc"));
        assert!(!ping("198.18.1.1", "203.0.113.5"), "an unselected pod source is dropped, not forwarded");
        assert!(!ping("198.18.0.1", "203.0.113.5"), "steered: dropped as before");
        assert!(!ping(excluded.0, excluded.1), "guarded: what Egret does not translate is dropped too");
        assert!(ping("198.18.1.1", "198.19.255.1"), "pod to pod (a pod on the gateway's Node) passes");
        assert!(ping("192.0.2.2", "203.0.113.5"), "a source outside the guard is forwarded");
        install(&guarded("other0"));
        assert!(ping("198.18.1.1", "203.0.113.5"), "the guard applies only on its interfaces");
        assert!(ping(excluded.0, excluded.1), "...and exclusions are the classification's again");
    }

    /// Measurement, not a check: how long `nft -f` of the ruleset takes, and
    /// its peak RSS, for many selected pods (/32s in 198.18.0.0/15, pod `i`
    /// in policy `i % 64`, so no two neighbours merge: one map element per
    /// pod). Run as root: `cargo test --release -p egret-controlplane --lib
    /// failclosed::tests::measure_nft_load --locked -- --ignored --nocapture`
    /// (sizes in `EGRET_NFT_PODS`, comma-separated; default 16384,65536,131072).
    #[test]
    #[ignore = "measurement; needs root, nft and /usr/bin/time"]
    fn measure_nft_load() {
        let sizes = std::env::var("EGRET_NFT_PODS").unwrap_or_else(|_| "16384,65536,131072".into());
        let ns = NetnsGuard::unique("efcm", &[""]).create().expect("needs root");
        for n in sizes.split(',').map(|n| n.trim().parse::<u32>().unwrap()) {
            let base = u32::from(Ipv4Addr::new(198, 18, 0, 0));
            let policies = (0..64u32)
                .map(|k| PolicySpec {
                    name: format!("p{k}"),
                    sources: (0..n)
                        .filter(|i| i % 64 == k)
                        .map(|i| format!("{}/32", Ipv4Addr::from(base + i)).parse().unwrap())
                        .collect(),
                    destinations: vec!["0.0.0.0/0".parse().unwrap()],
                    except: vec![format!("203.0.113.{k}/32").parse().unwrap()],
                    egress_ips: vec!["203.0.113.200".parse().unwrap()],
                })
                .collect();
            let spec = TablesSpec { policies, ..Default::default() };
            let t = Tables::compile(&spec, 1, &PolicySlots::default()).unwrap();
            let script = ruleset(&t);
            let path = std::env::temp_dir().join(format!("efc14-ruleset-{n}.nft"));
            std::fs::write(&path, &script).unwrap();
            let o = Command::new("/usr/bin/time")
                .args(["-f", "%e s %M KiB", "ip", "netns", "exec", ns.name(0), "nft", "-f"])
                .arg(&path)
                .output()
                .unwrap();
            let _ = std::fs::remove_file(&path);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(o.status.success(), "{err}");
            println!("{n} selected pods: {} bytes of script, nft -f: {}", script.len(), err.trim());
        }
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
