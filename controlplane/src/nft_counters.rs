//! Drop counters that survive the replacement of their nftables table.
//!
//! Egret replaces its tables whole (`delete table` and the new table in one
//! `nft -f` transaction: the gateway's `inet egret_failclosed` on every
//! apply, the node agent's `inet egret_node` and `inet egret_node_guard` on
//! every pass), which reset every anonymous `counter` in them: the drop
//! counts operators read with `nft list table` started again from zero
//! every 30 s. The counters that matter are therefore named counter
//! objects, each with a comment that names what it counts (a policy's name,
//! not its index, which changes when policies come and go). Before a
//! replacement the installer lists the table's counters (`nft -j list
//! counters`, which does not list the maps' elements, so it stays cheap
//! beside a table of 65,536 sources) and declares each counter of the new
//! table with the values the old one had under the same comment. Packets
//! counted between the listing and the replacement (a few milliseconds)
//! are lost; a counter whose comment is gone (a deleted policy) goes.

use std::collections::BTreeMap;
use std::process::Command;

use crate::failclosed::{run_bounded_output, NFT_TIMEOUT};

/// Counter values by comment: (packets, bytes).
pub type Carried = BTreeMap<String, (u64, u64)>;

/// The named counters of the `inet` tables `tables` now, in one `nft`
/// run (empty when none exists or nft cannot be run: the new counters then
/// start at zero).
pub fn read(tables: &[&str]) -> Carried {
    let mut cmd = Command::new("nft");
    cmd.args(["-j", "list", "counters"]);
    match run_bounded_output(&mut cmd, &[], NFT_TIMEOUT) {
        Ok(out) => tables.iter().flat_map(|t| parse(&out, t)).collect(),
        Err(_) => Carried::new(),
    }
}

/// The counters of `inet <table>` in `nft -j list counters` output, keyed
/// by comment (by name when a counter has none).
pub fn parse(json: &str, table: &str) -> Carried {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else { return Carried::new() };
    v["nftables"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|item| item.get("counter"))
        .filter(|c| c["table"] == table && c["family"] == "inet")
        .filter_map(|c| {
            let key = c["comment"].as_str().filter(|s| !s.is_empty()).or_else(|| c["name"].as_str())?;
            Some((key.to_owned(), (c["packets"].as_u64()?, c["bytes"].as_u64()?)))
        })
        .collect()
}

/// Declares counter `name` (commented `comment`, quotes removed) with the
/// values `carried` has for that comment; rules count with
/// `counter name "<name>"`.
pub fn declare(out: &mut String, name: &str, comment: &str, carried: &Carried) {
    let comment = comment.replace('"', "");
    let (packets, bytes) = carried.get(&comment).copied().unwrap_or_default();
    out.push_str(&format!(
        "  counter {name} {{\n    comment \"{comment}\"\n    packets {packets} bytes {bytes}\n  }}\n"
    ));
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn counters_are_read_by_comment_and_declared_with_their_values() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
            {"counter": {"family": "inet", "name": "policy_0", "table": "egret_failclosed", "handle": 2,
                         "comment": "policy db", "packets": 5, "bytes": 300}},
            {"counter": {"family": "inet", "name": "untranslated", "table": "egret_failclosed", "handle": 3,
                         "packets": 1, "bytes": 60}},
            {"counter": {"family": "inet", "name": "x", "table": "other", "handle": 4, "packets": 9, "bytes": 9}}]}"#;
        let c = parse(json, "egret_failclosed");
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c["policy db"], (5, 300));
        assert_eq!(c["untranslated"], (1, 60));
        let mut out = String::new();
        declare(&mut out, "policy_3", "policy db", &c);
        assert_eq!(out, "  counter policy_3 {\n    comment \"policy db\"\n    packets 5 bytes 300\n  }\n");
        let mut fresh = String::new();
        declare(&mut fresh, "policy_4", "policy \"new\"", &c);
        assert!(fresh.contains("comment \"policy new\"\n    packets 0 bytes 0"), "{fresh}");
        assert!(parse("not json", "t").is_empty());
    }
}
