//! What `egret node status` and the agent's `/metrics` show.
//!
//! The agent writes its status as JSON to a file after every pass
//! (atomically: a temporary file renamed into place), so `egret node status`
//! works without a socket and still shows the last pass when the agent has
//! died (with its time, so staleness is visible).

use std::net::IpAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

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

/// Reads the status file.
pub fn read(path: &Path) -> Result<NodeStatus, String> {
    let text = std::fs::read(path).map_err(|e| {
        format!("{}: {e} (is `egret node` running on this node, with this --status-file?)", path.display())
    })?;
    serde_json::from_slice(&text).map_err(|e| format!("{}: not a status file: {e}", path.display()))
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Prometheus text exposition.
pub fn metrics(s: &NodeStatus) -> String {
    let mut o = String::new();
    let mut family = |name: &str, kind: &str, help: &str, samples: Vec<(String, String)>| {
        o.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (labels, v) in samples {
            o.push_str(&format!("{name}{labels} {v}\n"));
        }
    };
    let one = |v: String| vec![(String::new(), v)];
    family("egret_node_pods", "gauge", "Local pods with an address.", one(s.pods_local.to_string()));
    family(
        "egret_node_pods_steered",
        "gauge",
        "Local pod addresses with an Egret rule (a dual-stack pod counts twice).",
        one(s.pods_steered.to_string()),
    );
    family(
        "egret_node_pods_steered_by_egress_ip",
        "gauge",
        "Local pod addresses using each policy and egress IP (the plan; rules the kernel refused are in the errors).",
        s.uses
            .iter()
            .map(|u| {
                (
                    format!(
                        "{{policy=\"{}\",egress_ip=\"{}\",next_hop=\"{}\"}}",
                        esc(&u.policy),
                        u.egress_ip,
                        u.next_hop
                    ),
                    u.pods.to_string(),
                )
            })
            .collect(),
    );
    family("egret_node_rules", "gauge", "Egret's policy-routing rules in the kernel.", one(s.rules.to_string()));
    family("egret_node_tables", "gauge", "Egret's routing tables in the kernel.", one(s.tables.to_string()));
    family("egret_node_syncs_total", "counter", "Reconcile passes.", one(s.syncs.to_string()));
    family(
        "egret_node_changes_total",
        "counter",
        "Rule and route changes made in the kernel.",
        one(s.changes_total.to_string()),
    );
    family(
        "egret_node_repair_wakes_total",
        "counter",
        "Kernel notifications of a removal (a rule, route, address or the nftables table of the agent's) that started a pass at once.",
        one(s.repair_wakes.to_string()),
    );
    family(
        "egret_node_sync_errors_total",
        "counter",
        "Operations that failed (each is retried on the next pass).",
        one(s.errors_total.to_string()),
    );
    family(
        "egret_node_last_sync_timestamp_seconds",
        "gauge",
        "Unix time of the last pass.",
        one(s.last_sync_unix.to_string()),
    );
    family(
        "egret_node_last_sync_ok",
        "gauge",
        "1 if the last pass applied everything.",
        one(u8::from(s.last_sync_ok).to_string()),
    );
    family("egret_node_strict", "gauge", "1 in strict mode.", one(u8::from(s.strict).to_string()));
    o
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
    fn the_file_round_trips_and_metrics_carry_the_labels() {
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
            ..Default::default()
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.json");
        write(&path, &s).unwrap();
        assert_eq!(read(&path).unwrap(), s);
        let m = metrics(&s);
        assert!(m.contains(
            "egret_node_pods_steered_by_egress_ip{policy=\"egresspolicy/a\",egress_ip=\"203.0.113.10\",next_hop=\"203.0.113.10\"} 3"
        ));
        assert!(m.contains("egret_node_pods_steered 3"));
        let r = render(&s, 105);
        assert!(r.contains("(5 s ago)") && r.contains("egresspolicy/a"), "{r}");
        assert!(read(&dir.path().join("missing")).unwrap_err().contains("is `egret node` running"));
    }
}
