//! Puts the fail-closed table back when another program removes it.
//!
//! The table (`crate::failclosed`) matters only once this process is gone:
//! it makes the kernel drop what XDP would have translated. A firewall
//! reload (`nft flush ruleset` at the top of most `nftables.conf` files) or
//! an `nft delete table` removes it while the gateway runs, and nothing
//! showed it until the next apply; a crash in between leaked the selected
//! pods' own addresses. This task follows nftables' notifications
//! ([`crate::nft_watch`]) and reinstalls the table for the tables the data
//! plane runs as soon as a transaction leaves it deleted
//! ([`GatewaySink::reinstall_fail_closed`], serialised with applies).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use netlink_sys::{AsyncSocketExt, TokioSocket};

use super::sink::GatewaySink;
use crate::nft_watch::{self, NftTransactions};

/// Subscribes and starts the task; `None` (with a warning) when this kernel
/// gives no nftables notifications.
pub fn spawn(sink: Arc<GatewaySink>) -> Option<tokio::task::JoinHandle<()>> {
    match nft_watch::subscribe() {
        Ok(socket) => Some(tokio::spawn(run(socket, sink))),
        Err(e) => {
            tracing::warn!(error = %e, "no nftables notifications: a removed fail-closed table is put back at the next apply only");
            None
        }
    }
}

async fn run(socket: TokioSocket, sink: Arc<GatewaySink>) {
    let mut transactions = NftTransactions::new(&[crate::failclosed::TABLE]);
    loop {
        match socket.recv_from_full().await {
            Ok((buf, _)) => {
                if transactions.on_datagram(&buf) {
                    tracing::warn!(
                        table = crate::failclosed::TABLE,
                        "another program removed the fail-closed table; putting it back"
                    );
                    repair(&sink).await;
                }
            }
            // Notifications lost (a large install notifies every set
            // element): repair only if the table is gone.
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                transactions.reset();
                let present =
                    tokio::task::spawn_blocking(|| nft_watch::tables_present(&[crate::failclosed::TABLE])).await;
                if !present.unwrap_or(false) {
                    tracing::warn!(
                        table = crate::failclosed::TABLE,
                        "the fail-closed table is missing; putting it back"
                    );
                    repair(&sink).await;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "nftables notifications failed; a removed fail-closed table is put back at the next apply only");
                return;
            }
        }
    }
}

async fn repair(sink: &Arc<GatewaySink>) {
    let s = sink.clone();
    match tokio::task::spawn_blocking(move || s.reinstall_fail_closed()).await {
        Ok(Ok(true)) => tracing::info!(
            repairs = sink.fail_closed_repairs.load(Ordering::Relaxed),
            "fail-closed table in place again"
        ),
        Ok(Ok(false)) => tracing::info!(
            "the kernel's table is not this gateway's yet (held until the cluster's first apply); left alone"
        ),
        Ok(Err(e)) => tracing::error!(error = %e, "the fail-closed table could not be put back"),
        Err(e) => tracing::error!(error = %e, "the fail-closed repair panicked"),
    }
}
