//! What `egret node status` and the agent's `/metrics` show.
//!
//! The agent writes its status as JSON to a file after every pass
//! (atomically: a temporary file renamed into place), so `egret node status`
//! works without a socket and still shows the last pass when the agent has
//! died (with its time, so staleness is visible).

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use serde::{Deserialize, Serialize};

use crate::metrics::Families;

/// Pods using one (policy, egress IP).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UseRow {
    /// The policy (`egresspolicy/NAME`, `service/NS/NAME`).
    pub policy: String,
    /// The egress IP.
    pub egress_ip: IpAddr,
    /// The next hop the node routes to.
    pub next_hop: IpAddr,
    /// Pods steered.
    pub pods: usize,
}

/// One next hop's path (`tunnel.rs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NextHopRow {
    /// The next hop.
    pub next_hop: IpAddr,
    /// `onlink`, `vxlan` or `none`.
    pub path: String,
    /// Why `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `vxlan`: the outer source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<IpAddr>,
    /// `vxlan`: the route MTU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// `none`: selected pod addresses left unsteered because of it.
    #[serde(default)]
    pub pods_unsteered: usize,
}

/// The agent's state after its last pass.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStatus {
    /// This node.
    pub node: String,
    /// The agent's process id.
    pub pid: u32,
    /// Strict mode on.
    pub strict: bool,
    /// Whether the watches have synced (nothing is programmed before).
    pub synced: bool,
    /// Wall-clock time of the last pass (RFC 3339).
    pub last_sync: Option<String>,
    /// Unix seconds of the last pass.
    pub last_sync_unix: u64,
    /// Whether the last pass applied everything in the kernel.
    pub last_sync_ok: bool,
    /// Whether some pass has applied everything (`/ready`).
    pub programmed: bool,
    /// Passes so far.
    pub syncs: u64,
    /// Operations that failed so far.
    pub errors_total: u64,
    /// The last pass's errors.
    pub errors: Vec<String>,
    /// Local pods with an address.
    pub pods_local: usize,
    /// Local pod addresses with an Egret rule (a dual-stack pod counts twice).
    pub pods_steered: usize,
    /// Rules the kernel holds.
    pub rules: usize,
    /// Tables the kernel holds.
    pub tables: usize,
    /// Rule/route changes so far.
    pub changes_total: u64,
    /// Kernel notifications of a removal that woke the loop (`repair.rs`).
    #[serde(default)]
    pub repair_wakes: u64,
    /// Per policy and egress IP.
    pub uses: Vec<UseRow>,
    /// Selected pod addresses not steered: a next hop of theirs has no path.
    #[serde(default)]
    pub pods_unsteered: usize,
    /// Per next hop, its path.
    #[serde(default)]
    pub next_hops: Vec<NextHopRow>,
}

/// Writes `s` to `path` atomically.
pub fn write(path: &Path, s: &NodeStatus) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec_pretty(s).unwrap_or_default())?;
    std::fs::rename(&tmp, path)
}

/// Why the status file could not be read (`egret node status`).
#[derive(Debug, thiserror::Error)]
pub enum StatusFileError {
    /// The file could not be read (no agent on this node yet, another
    /// `--status-file`, no permission).
    #[error("{}: {source} (is `egret node` running on this node, with this --status-file?)", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file was read but holds no [`NodeStatus`].
    #[error("{}: not a status file: {source}", path.display())]
    NotAStatusFile {
        /// The file.
        path: PathBuf,
        /// Where the JSON stops being a status.
        #[source]
        source: serde_json::Error,
    },
}

/// Reads the status file.
pub fn read(path: &Path) -> Result<NodeStatus, StatusFileError> {
    let text =
        std::fs::read(path).map_err(|source| StatusFileError::Unreadable { path: path.to_path_buf(), source })?;
    serde_json::from_slice(&text).map_err(|source| StatusFileError::NotAStatusFile { path: path.to_path_buf(), source })
}

/// The agent's exposition: one [`NodeStatus`] encoded by prometheus-client
/// (OpenMetrics text, [`crate::metrics::CONTENT_TYPE`]).
#[derive(Debug)]
struct Exposition(NodeStatus);

impl Collector for Exposition {
    fn encode(&self, encoder: DescriptorEncoder) -> std::fmt::Result {
        let (s, mut o) = (&self.0, Families(encoder));
        o.gauge("node_pods", "Local pods with an address.")?.sample(&[], s.pods_local as u64)?;
        o.gauge("node_pods_steered", "Local pod addresses with an Egret rule (a dual-stack pod counts twice).")?
            .sample(&[], s.pods_steered as u64)?;
        let mut f = o.gauge(
            "node_pods_steered_by_egress_ip",
            "Local pod addresses using each policy and egress IP (the plan; rules the kernel refused are in the errors).",
        )?;
        for u in &s.uses {
            let (ip, hop) = (u.egress_ip.to_string(), u.next_hop.to_string());
            f.sample(&[("policy", &u.policy), ("egress_ip", &ip), ("next_hop", &hop)], u.pods as u64)?;
        }
        o.gauge(
            "node_pods_unsteered",
            "Selected local pod addresses not steered because a next hop of theirs has no path (egret node status says why).",
        )?
        .sample(&[], s.pods_unsteered as u64)?;
        let mut f = o.gauge(
            "node_next_hop_path",
            "1 for each next hop's current path (onlink, vxlan: through egret-vxlan, none: not steered), 0 for the others.",
        )?;
        for h in &s.next_hops {
            let hop = h.next_hop.to_string();
            for kind in super::tunnel::PATH_KINDS {
                f.sample(&[("next_hop", &hop), ("path", kind)], u64::from(h.path == kind))?;
            }
        }
        o.gauge("node_rules", "Egret's policy-routing rules in the kernel.")?.sample(&[], s.rules as u64)?;
        o.gauge("node_tables", "Egret's routing tables in the kernel.")?.sample(&[], s.tables as u64)?;
        o.counter("node_syncs", "Reconcile passes.")?.sample(&[], s.syncs)?;
        o.counter("node_changes", "Rule and route changes made in the kernel.")?.sample(&[], s.changes_total)?;
        o.counter(
            "node_repair_wakes",
            "Kernel notifications of a removal (a rule, route, address or the nftables table of the agent's) that started a pass at once.",
        )?
        .sample(&[], s.repair_wakes)?;
        o.counter("node_sync_errors", "Operations that failed (each is retried on the next pass).")?
            .sample(&[], s.errors_total)?;
        o.seconds("node_last_sync_timestamp", "Unix time of the last pass.")?.sample(&[], s.last_sync_unix)?;
        o.gauge("node_last_sync_ok", "1 if the last pass applied everything.")?
            .sample(&[], u64::from(s.last_sync_ok))?;
        o.gauge("node_strict", "1 in strict mode.")?.sample(&[], u64::from(s.strict))?;
        Ok(())
    }
}

/// The agent's `/metrics`: one snapshot of `s` as OpenMetrics text.
pub fn metrics(s: &NodeStatus) -> String {
    crate::metrics::exposition(Exposition(s.clone()))
}

/// The human-readable `egret node status`.
pub fn render(s: &NodeStatus, now_unix: u64) -> String {
    let age = if s.last_sync_unix == 0 {
        "never".to_string()
    } else {
        format!("{} ({} s ago)", s.last_sync.as_deref().unwrap_or("-"), now_unix.saturating_sub(s.last_sync_unix))
    };
    let mut out = format!(
        "node        {}\nagent pid   {}\nmode        {}\nsynced      {}\nlast sync   {}{}\npods        {} local addresses, {} with a rule\nkernel      {} rules, {} tables\nchanges     {}\nerrors      {} total\n",
        s.node,
        s.pid,
        if s.strict { "strict" } else { "permissive" },
        if s.synced { "yes" } else { "no (waiting for the API server)" },
        age,
        if s.last_sync_ok { "" } else { " FAILED" },
        s.pods_local,
        s.pods_steered,
        s.rules,
        s.tables,
        s.changes_total,
        s.errors_total,
    );
    for e in &s.errors {
        out.push_str(&format!("error       {e}\n"));
    }
    if s.pods_unsteered > 0 {
        out.push_str(&format!(
            "UNSTEERED   {} selected pod addresses have no path to their gateway\n",
            s.pods_unsteered
        ));
    }
    if !s.next_hops.is_empty() {
        out.push_str(&format!("\n{:<39}  {:<6}  DETAIL\n", "NEXT HOP", "PATH"));
        for h in &s.next_hops {
            let detail = match (&h.reason, h.source, h.mtu) {
                (Some(why), _, _) => format!("{} pods unsteered: {why}", h.pods_unsteered),
                (None, Some(src), Some(mtu)) => format!("{} from {src}, mtu {mtu}", super::tunnel::DEVICE),
                _ => String::new(),
            };
            out.push_str(&format!("{:<39}  {:<6}  {detail}\n", h.next_hop.to_string(), h.path));
        }
    }
    if !s.uses.is_empty() {
        let w = s.uses.iter().map(|u| u.policy.len()).max().unwrap_or(6).max(6);
        out.push_str(&format!("\n{:<w$}  {:<39}  {:<39}  PODS\n", "POLICY", "EGRESS IP", "NEXT HOP"));
        for u in &s.uses {
            out.push_str(&format!(
                "{:<w$}  {:<39}  {:<39}  {}\n",
                u.policy,
                u.egress_ip.to_string(),
                u.next_hop.to_string(),
                u.pods
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_file_round_trips_and_renders() {
        let s = NodeStatus {
            node: "worker-1".into(),
            synced: true,
            last_sync_unix: 100,
            last_sync_ok: true,
            pods_steered: 3,
            uses: vec![UseRow {
                policy: "egresspolicy/a".into(),
                egress_ip: "203.0.113.10".parse().unwrap(),
                next_hop: "203.0.113.10".parse().unwrap(),
                pods: 3,
            }],
            pods_unsteered: 1,
            next_hops: vec![
                NextHopRow {
                    next_hop: "203.0.113.10".parse().unwrap(),
                    path: "onlink".into(),
                    reason: None,
                    source: None,
                    mtu: None,
                    pods_unsteered: 0,
                },
                NextHopRow {
                    next_hop: "203.0.113.11".parse().unwrap(),
                    path: "none".into(),
                    reason: Some("no route to 203.0.113.11: Network is unreachable".into()),
                    source: None,
                    mtu: None,
                    pods_unsteered: 1,
                },
            ],
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.json");
        write(&path, &s).unwrap();
        assert_eq!(read(&path).unwrap(), s);
        let r = render(&s, 105);
        assert!(r.contains("(5 s ago)") && r.contains("egresspolicy/a"), "{r}");
        assert!(r.contains("UNSTEERED   1 selected pod addresses"), "{r}");
        assert!(r.contains("203.0.113.11") && r.contains("none    1 pods unsteered: no route to 203.0.113.11"), "{r}");
        // A status file of an agent without tunnels still reads.
        std::fs::write(&path, br#"{"node":"w","pid":1,"strict":false,"synced":true,"lastSync":null,"lastSyncUnix":0,"lastSyncOk":true,"programmed":true,"syncs":1,"errorsTotal":0,"errors":[],"podsLocal":0,"podsSteered":0,"rules":0,"tables":0,"changesTotal":0,"uses":[]}"#).unwrap();
        assert_eq!(read(&path).unwrap().next_hops, vec![]);
        write(&path, &s).unwrap();
        let missing = dir.path().join("missing");
        let e = read(&missing).unwrap_err();
        assert!(matches!(&e, StatusFileError::Unreadable { path, .. } if *path == missing), "{e:?}");
        let e = e.to_string();
        assert!(e.starts_with(&format!("{}: ", missing.display())) && e.contains("is `egret node` running"), "{e}");
    }

    #[test]
    fn a_file_that_is_not_a_status_is_named_with_where_it_stops() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.json");
        std::fs::write(&path, b"{\"node\": 7}").unwrap();
        let e = read(&path).unwrap_err();
        assert!(matches!(&e, StatusFileError::NotAStatusFile { path: p, .. } if *p == path), "{e:?}");
        let e = e.to_string();
        assert!(e.starts_with(&format!("{}: not a status file: ", path.display())), "{e}");
        assert!(e.contains("invalid type: integer `7`"), "{e}");
    }

    #[test]
    fn metrics_have_every_family_declared_before_its_samples() {
        let s = NodeStatus {
            strict: true,
            last_sync_unix: 100,
            last_sync_ok: true,
            syncs: 4,
            errors_total: 2,
            pods_local: 5,
            pods_steered: 3,
            rules: 6,
            tables: 2,
            changes_total: 9,
            repair_wakes: 1,
            uses: vec![UseRow {
                policy: "egresspolicy/a".into(),
                egress_ip: "203.0.113.10".parse().unwrap(),
                next_hop: "203.0.113.10".parse().unwrap(),
                pods: 3,
            }],
            pods_unsteered: 2,
            next_hops: vec![NextHopRow {
                next_hop: "203.0.113.10".parse().unwrap(),
                path: "vxlan".into(),
                reason: None,
                source: Some("192.0.2.7".parse().unwrap()),
                mtu: Some(1450),
                pods_unsteered: 0,
            }],
            ..Default::default()
        };
        let m = metrics(&s);
        let want = [
            ("egret_node_pods", "gauge", "egret_node_pods 5"),
            ("egret_node_pods_steered", "gauge", "egret_node_pods_steered 3"),
            (
                "egret_node_pods_steered_by_egress_ip",
                "gauge",
                "egret_node_pods_steered_by_egress_ip{policy=\"egresspolicy/a\",egress_ip=\"203.0.113.10\",next_hop=\"203.0.113.10\"} 3",
            ),
            ("egret_node_pods_unsteered", "gauge", "egret_node_pods_unsteered 2"),
            ("egret_node_next_hop_path", "gauge", "egret_node_next_hop_path{next_hop=\"203.0.113.10\",path=\"vxlan\"} 1"),
            ("egret_node_rules", "gauge", "egret_node_rules 6"),
            ("egret_node_tables", "gauge", "egret_node_tables 2"),
            ("egret_node_syncs", "counter", "egret_node_syncs_total 4"),
            ("egret_node_changes", "counter", "egret_node_changes_total 9"),
            ("egret_node_repair_wakes", "counter", "egret_node_repair_wakes_total 1"),
            ("egret_node_sync_errors", "counter", "egret_node_sync_errors_total 2"),
            ("egret_node_last_sync_timestamp_seconds", "gauge", "egret_node_last_sync_timestamp_seconds 100"),
            ("egret_node_last_sync_ok", "gauge", "egret_node_last_sync_ok 1"),
            ("egret_node_strict", "gauge", "egret_node_strict 1"),
        ];
        for (_, _, line) in want {
            assert!(m.lines().any(|l| l == line), "missing {line:?} in\n{m}");
        }
        for other in ["onlink", "none"] {
            let line = format!("egret_node_next_hop_path{{next_hop=\"203.0.113.10\",path=\"{other}\"}} 0");
            assert!(m.lines().any(|l| l == line), "missing {line:?} in\n{m}");
        }
        assert!(m.lines().any(|l| l == "# UNIT egret_node_last_sync_timestamp_seconds seconds"), "{m}");
        assert!(m.ends_with("\n# EOF\n"), "{m}");
        // Every family: HELP, then TYPE, once, before its samples (a
        // counter's samples end in _total).
        let mut declared = std::collections::BTreeMap::new();
        for l in m.lines().filter(|l| *l != "# EOF") {
            if let Some(rest) = l.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                assert!(m.contains(&format!("# HELP {name} ")), "{name}: no HELP");
                assert!(declared.insert(name.to_string(), kind.to_string()).is_none(), "{name} twice");
            } else if !l.starts_with('#') {
                let name = l.split(['{', ' ']).next().unwrap();
                let ok = declared.get(name).is_some_and(|k| k == "gauge")
                    || name.strip_suffix("_total").is_some_and(|f| declared.get(f).is_some_and(|k| k == "counter"));
                assert!(ok, "{name} has no TYPE line before it:\n{m}");
            }
        }
        let want: std::collections::BTreeMap<String, String> =
            want.iter().map(|(n, k, _)| (n.to_string(), k.to_string())).collect();
        assert_eq!(declared, want, "{m}");
    }
}
