//! Which egress IPs this gateway handed over with a current session copy
//! (ADR 0034 §8, "An old holder that lives on"): published with the
//! tables (`TablesSpec::handed_over`), so the data plane records the
//! removals of those IPs' sessions, when revalidation finds them, as
//! `handed-over` (the local journal's only; the next holder, which
//! imported them, logs their ends to the collectors).
//!
//! An IP counts as handed over when it leaves the tables while its
//! replication was current ([`crate::ha::Ha::in_sync`]: a connected
//! standby, the full copy acknowledged, no sync overflow since), as last
//! seen while this gateway held it: a fenced IP is no longer replicated
//! once fenced (it stays in the tables, dormant, until someone takes it),
//! and the copy its standby had then is the one the next holder imports.
//! An IP back in the tables is no longer handed over.

use std::collections::BTreeSet;
use std::net::IpAddr;

use egret_dataplane::tables::TablesSpec;

/// See the module's documentation.
#[derive(Debug, Default)]
pub struct HandOvers {
    /// IPs whose standby held their latest copy when last looked at while held.
    current: BTreeSet<IpAddr>,
    /// IPs that left the tables while current.
    handed: BTreeSet<IpAddr>,
}

impl HandOvers {
    /// Notes, for each IP `held` now, whether its replication is current
    /// (`in_sync`). IPs not held (dormant, released) keep what was last
    /// noted.
    pub fn observe(&mut self, held: &BTreeSet<IpAddr>, in_sync: impl Fn(IpAddr) -> bool) {
        for ip in held {
            if in_sync(*ip) {
                self.current.insert(*ip);
            } else {
                self.current.remove(ip);
            }
        }
    }

    /// Sets `spec.handed_over` for tables about to replace tables whose
    /// egress IPs were `before`: an IP leaving them while current joins
    /// the handed-over set; an IP in `spec` leaves it.
    pub fn mark(&mut self, before: &BTreeSet<IpAddr>, spec: &mut TablesSpec) {
        let now: BTreeSet<IpAddr> = spec.egress_ips.iter().map(|e| e.ip).collect();
        for ip in before.difference(&now) {
            if self.current.remove(ip) {
                self.handed.insert(*ip);
            }
        }
        self.handed.retain(|ip| !now.contains(ip));
        spec.handed_over = self.handed.iter().copied().collect();
    }

    /// The IPs handed over (for tests and status).
    pub fn handed(&self) -> &BTreeSet<IpAddr> {
        &self.handed
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use egret_dataplane::tables::EgressIpSpec;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn spec(ips: &[&str]) -> TablesSpec {
        TablesSpec {
            egress_ips: ips
                .iter()
                .map(|s| EgressIpSpec { ip: ip(s), ports: None, answer_neighbor: true, port_blocks: None })
                .collect(),
            ..TablesSpec::default()
        }
    }

    fn set(ips: &[&str]) -> BTreeSet<IpAddr> {
        ips.iter().map(|s| ip(s)).collect()
    }

    /// A drain: the copies current, the IP leaves the tables: handed over,
    /// and it stays so in later tables until the IP comes back.
    #[test]
    fn an_ip_leaving_the_tables_in_sync_is_handed_over_until_it_returns() {
        let mut h = HandOvers::default();
        let (a, b) = ("203.0.113.10", "203.0.113.11");
        h.observe(&set(&[a, b]), |x| x == ip(a));
        let mut s = spec(&[]);
        h.mark(&set(&[a, b]), &mut s);
        assert_eq!(s.handed_over, vec![ip(a)], "only the IP whose copy was current");
        let mut later = spec(&[]);
        h.mark(&set(&[]), &mut later);
        assert_eq!(later.handed_over, vec![ip(a)], "kept in later tables: revalidation is lazy");
        let mut back = spec(&[a]);
        h.observe(&set(&[]), |_| true);
        h.mark(&set(&[]), &mut back);
        assert!(back.handed_over.is_empty(), "held again: its removals are this gateway's own");
        let mut again = spec(&[]);
        h.mark(&set(&[a]), &mut again);
        assert!(again.handed_over.is_empty(), "held again without a current copy seen: not handed over");
    }

    /// A fence: the IP stops being held (dormant) and replicated, stays
    /// in the tables; what was seen while held decides when it leaves.
    #[test]
    fn a_fenced_ip_keeps_what_was_seen_while_held() {
        let mut h = HandOvers::default();
        let (a, b) = ("203.0.113.10", "2001:db8::10");
        h.observe(&set(&[a, b]), |x| x == ip(a));
        // Fenced: not held; the replicator forgot both (in_sync false).
        h.observe(&set(&[]), |_| false);
        let mut dormant = spec(&[a, b]);
        h.mark(&set(&[a, b]), &mut dormant);
        assert!(dormant.handed_over.is_empty());
        let mut taken = spec(&[]);
        h.mark(&set(&[a, b]), &mut taken);
        assert_eq!(taken.handed_over, vec![ip(a)]);
        assert_eq!(h.handed(), &set(&[a]));
    }

    /// Replication lost before the IP left (no standby, an overflow): its
    /// removals are exported as `invalidated`.
    #[test]
    fn an_ip_whose_copy_went_stale_is_not_handed_over() {
        let mut h = HandOvers::default();
        let a = "203.0.113.10";
        h.observe(&set(&[a]), |_| true);
        h.observe(&set(&[a]), |_| false);
        let mut s = spec(&[]);
        h.mark(&set(&[a]), &mut s);
        assert!(s.handed_over.is_empty());
    }
}
