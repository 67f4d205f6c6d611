//! Makes each session table's next slab chunk off the workers (ADR 0038):
//! every [`EVERY`], on a blocking thread, both families' tables are asked
//! to grow ahead (`SessionTable::grow_ahead`), so a growing table's next
//! huge page is faulted here instead of by the worker whose new flow needs
//! its first slot (0.3-8 ms on this machine).

use std::time::Duration;

use egret_dataplane::engine::Engine;

/// How often: a table may take half a chunk (21,845 IPv4 sessions) of net
/// growth between two calls before its workers make a chunk themselves.
pub const EVERY: Duration = Duration::from_millis(100);

/// Starts the task: a check every `every`, until aborted.
pub fn spawn(engine: Engine, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let engine = engine.clone();
            let grown = tokio::task::spawn_blocking(move || {
                (engine.nat4().sessions.grow_ahead(), engine.nat6().sessions.grow_ahead())
            });
            if let Err(e) = grown.await {
                tracing::warn!(error = %e, "growing the session tables ahead failed");
            }
        }
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use std::net::Ipv4Addr;
    use std::time::Instant;

    use egret_dataplane::fixtures::base_spec;
    use egret_dataplane::nat::key::{proto, SessionTuple};
    use egret_dataplane::nat::session::SessionInit;

    use super::*;

    /// A real engine's IPv4 table filled to half its first chunk: the task
    /// makes the second chunk before any flow needs it, and the IPv6 table,
    /// with no session, keeps none.
    #[tokio::test]
    async fn the_next_chunk_is_made_before_a_flow_needs_it() {
        let mut spec = base_spec();
        spec.nat.max_sessions = 200_000;
        let engine = Engine::new(&spec).unwrap();
        let sessions = &engine.nat4().sessions;
        for i in 0..22_000u32 {
            let tuple = SessionTuple {
                pod: Ipv4Addr::from(0xC612_0000 + (i >> 8)),
                remote: Ipv4Addr::new(203, 0, 113, 9),
                egress: Ipv4Addr::new(198, 51, 100, 1),
                pod_port: 10_000 + (i & 0xff) as u16,
                remote_port: 443,
                egress_port: 1024 + (i % 60_000) as u16,
                proto: proto::UDP,
            };
            sessions.insert(&tuple, &SessionInit::default()).unwrap();
        }
        assert_eq!(sessions.chunks_made(), 1, "22,000 sessions: one chunk of 43,690 made by the inserts");
        let task = spawn(engine.clone(), Duration::from_millis(10));
        let t0 = Instant::now();
        while sessions.chunks_made() < 2 {
            assert!(t0.elapsed() < Duration::from_secs(20), "the second chunk was never made");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(sessions.chunks_made(), 2, "one chunk ahead, no more");
        assert_eq!(engine.nat6().sessions.chunks_made(), 0, "no IPv6 session: no IPv6 page");
        task.abort();
    }
}
