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

use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};

use egret_dataplane::lpm::{LpmAddr, Prefix};
use egret_dataplane::policy::{Classifier, DstAction};
use egret_dataplane::tables::Tables;

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

fn nft(script: &str) -> Result<(), FailClosedError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(FailClosedError::Spawn)?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes()).map_err(FailClosedError::Spawn)?;
    }
    let out = child.wait_with_output().map_err(FailClosedError::Spawn)?;
    if !out.status.success() {
        return Err(FailClosedError::Refused(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use egret_dataplane::tables::{EgressIpSpec, PolicySlots, PolicySpec, TablesSpec};

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
}
