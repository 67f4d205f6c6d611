//! What the data plane is told about each address's deadline (ADR 0004,
//! "The data plane's own deadline"), shared by the sync loop and the
//! renewer (issue 28 §2) so that both push through one record and an older
//! deadline can never overwrite a newer one.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;

use super::lease::LeaseManager;
use crate::sink::TablesSink;

/// The deadlines sent, and the next-hop pairs of the newest tables.
pub struct ValidUntil {
    sink: Arc<dyn TablesSink>,
    /// What the data plane was last told about each address.
    sent: BTreeMap<IpAddr, Option<std::time::Instant>>,
    /// A past instant: the valid-until of an address not held.
    expired: Instant,
    /// (egress IP, next hop) of the tables applied or about to be.
    pairs: Vec<(IpAddr, IpAddr)>,
}

impl std::fmt::Debug for ValidUntil {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ValidUntil").field("sent", &self.sent).field("pairs", &self.pairs).finish_non_exhaustive()
    }
}

impl ValidUntil {
    /// Nothing sent yet.
    pub fn new(sink: Arc<dyn TablesSink>) -> ValidUntil {
        ValidUntil { sink, sent: BTreeMap::new(), expired: Instant::now(), pairs: Vec::new() }
    }

    /// Tells the data plane until when it may serve each egress IP (its
    /// renew deadline: the last successful renewal's send time +
    /// renewDeadline) and each companion next hop (the latest of the held
    /// IPs it serves); an IP not held, or a next hop of none, is expired.
    /// `pairs`: the (egress IP, next hop) pairs of tables about to be
    /// applied (None: those of the last call). Only changes are sent. Runs
    /// under this record's lock, with the Lease state machine's read inside
    /// it, so two callers cannot send deadlines out of order.
    pub fn push(&mut self, mgr: &Mutex<LeaseManager>, pairs: Option<&[(IpAddr, IpAddr)]>) {
        if let Some(p) = pairs {
            self.pairs = p.to_vec();
        }
        let mut want: BTreeMap<IpAddr, Instant> = BTreeMap::new();
        let deadlines: Vec<_> = mgr.lock().deadlines().collect();
        for (ip, deadline) in deadlines {
            want.insert(ip, deadline.unwrap_or(self.expired));
        }
        for (ip, nh) in self.pairs.iter().copied() {
            let d = want.get(&ip).copied().unwrap_or(self.expired);
            let e = want.entry(nh).or_insert(self.expired);
            *e = (*e).max(d);
        }
        for ip in self.sent.keys() {
            want.entry(*ip).or_insert(self.expired);
        }
        let changes: Vec<(IpAddr, Option<std::time::Instant>)> = want
            .into_iter()
            .map(|(ip, t)| (ip, Some(t.into_std())))
            .filter(|(ip, t)| self.sent.get(ip) != Some(t))
            .collect();
        if changes.is_empty() {
            return;
        }
        self.sink.set_valid_until(&changes);
        self.sent.extend(changes);
    }
}
