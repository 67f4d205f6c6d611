//! Status writes, bounded (docs/adr/0019-status-writes-bounded.md).
//!
//! *Who* writes: one gateway at a time ([`is_writer`]): the first by name
//! among those holding a live Lease, or, when no Lease looks live (an API
//! outage: nobody could renew), the first eligible gateway by name.
//!
//! *How*: each object has its own slot with at most one write in flight.
//! The newest status handed to a slot replaces the one waiting there (the
//! latest wins, nothing queues). After a failure the slot waits 1 s,
//! doubling to 60 s (each wait drawn between half and all of that, so the
//! gateways' writes do not fall in step), then writes the newest status
//! again; a success resets the wait. A status just written is not written
//! again for [`STATUS_RESEND`] while the watch catches up.
//!
//! Before this, a gateway spawned one write per pass and object, every
//! gateway wrote during an outage, and kube-client's retry layer held each
//! write for minutes against a slow API server: ~105 PATCHes piled up and
//! kept the restarted API server from ever becoming ready.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::desired::LeaseInfo;

/// How long an unchanged status just written is not written again while the
/// watch catches up.
pub const STATUS_RESEND: Duration = Duration::from_secs(5);
/// The first wait after a failed write.
pub const BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// The longest wait after failed writes.
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// How long one write may take before it counts as failed (the API server's
/// own default request timeout: it normally answers first).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(60);

/// Whether gateway `me` writes status: the first by name among the holders
/// of a live Lease (renewed within its duration by `wall`); when none is
/// live, the first of `eligible` (the gateway Nodes that are not drained) by
/// name, so that an outage, during which every Lease looks expired, does not
/// turn every gateway into a writer. With no eligible gateway at all (none
/// labelled) each writes for itself.
pub fn is_writer<'a>(
    me: &str,
    leases: impl IntoIterator<Item = &'a LeaseInfo>,
    eligible: impl IntoIterator<Item = &'a str>,
    wall: Timestamp,
) -> bool {
    let live = leases.into_iter().filter_map(|l| {
        let h = l.holder.as_deref().filter(|h| !h.is_empty())?;
        let renewed = l.renew_time?;
        (renewed.checked_add(l.duration).ok()? >= wall).then_some(h)
    });
    match live.min().or_else(|| eligible.into_iter().min()) {
        None => true,
        Some(first) => first == me,
    }
}

/// How one write ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// Written.
    Ok,
    /// Refused because the object changed meanwhile (a precondition): not
    /// written again until a different status comes; no backoff.
    Stale,
    /// Failed (unreachable, timed out, refused): written again after a backoff.
    Failed(String),
}

/// Sends one status (the object's name, the body).
pub type WriteFn = Arc<dyn Fn(String, Value) -> BoxFuture<'static, Written> + Send + Sync>;

/// The wait after failed writes: [`BACKOFF_FIRST`] doubling to
/// [`BACKOFF_MAX`], each drawn between half and all of it.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    random: fn() -> u64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { next: BACKOFF_FIRST, random: crate::ha::auth::random_u64 }
    }
}

impl Backoff {
    /// With `random` as the source of jitter.
    pub fn with_random(random: fn() -> u64) -> Self {
        Backoff { next: BACKOFF_FIRST, random }
    }

    /// The wait after one more failure.
    pub fn failed(&mut self) -> Duration {
        let base = self.next;
        self.next = (base * 2).min(BACKOFF_MAX);
        jittered(base, (self.random)())
    }

    /// After a success: the next failure waits [`BACKOFF_FIRST`] again.
    pub fn reset(&mut self) {
        self.next = BACKOFF_FIRST;
    }
}

/// Between half (`r` = 0) and all (`r` = `u64::MAX`) of `base`.
fn jittered(base: Duration, r: u64) -> Duration {
    let half = base / 2;
    let extra = half.as_millis() * u128::from(r) / u128::from(u64::MAX);
    half + Duration::from_millis(u64::try_from(extra).unwrap_or(u64::MAX))
}

struct Slot {
    tx: watch::Sender<Option<Value>>,
    task: JoinHandle<()>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One kind's status writes (policies or pools): a slot per object.
pub struct StatusWriter {
    kind: &'static str,
    write: WriteFn,
    backoff: fn() -> Backoff,
    slots: HashMap<String, Slot>,
}

impl StatusWriter {
    /// Writes of `kind` through `write`.
    pub fn new(kind: &'static str, write: WriteFn) -> Self {
        Self::with_backoff(kind, write, Backoff::default)
    }

    /// [`Self::new`] with each slot's backoff from `backoff`.
    pub fn with_backoff(kind: &'static str, write: WriteFn, backoff: fn() -> Backoff) -> Self {
        StatusWriter { kind, write, backoff, slots: HashMap::new() }
    }

    /// `name` should have status `value`: written at once when nothing is in
    /// flight or waiting out a backoff for it, else it replaces the status
    /// waiting there.
    pub fn submit(&mut self, name: &str, value: Value) {
        if let Some(slot) = self.slots.get(name) {
            slot.tx.send_replace(Some(value));
            return;
        }
        let (tx, rx) = watch::channel(Some(value));
        let task = tokio::spawn(drive(self.kind, name.to_string(), rx, self.write.clone(), (self.backoff)()));
        self.slots.insert(name.to_string(), Slot { tx, task });
    }

    /// Nothing to write for `name` (the object shows its status, or this
    /// gateway no longer writes): a status waiting is dropped, a write in
    /// flight finishes.
    pub fn settle(&mut self, name: &str) {
        if let Some(slot) = self.slots.get(name) {
            slot.tx.send_replace(None);
        }
    }

    /// [`Self::settle`] for every object.
    pub fn settle_all(&mut self) {
        for slot in self.slots.values() {
            slot.tx.send_replace(None);
        }
    }

    /// Forgets the objects `keep` refuses (deleted): their writes end.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.slots.retain(|name, _| keep(name));
    }
}

impl std::fmt::Debug for StatusWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusWriter").field("kind", &self.kind).field("objects", &self.slots.len()).finish()
    }
}

/// One object's writes: the newest status in `rx`, one at a time.
async fn drive(
    kind: &'static str,
    name: String,
    mut rx: watch::Receiver<Option<Value>>,
    write: WriteFn,
    mut backoff: Backoff,
) {
    let mut done: Option<(Value, Instant)> = None;
    let mut failures: u32 = 0;
    loop {
        let current = rx.borrow_and_update().clone();
        let value = match current {
            Some(v) if !done.as_ref().is_some_and(|(w, at)| *w == v && Instant::now() < *at + STATUS_RESEND) => v,
            _ => {
                if rx.changed().await.is_err() {
                    return;
                }
                continue;
            }
        };
        let result = match tokio::time::timeout(WRITE_TIMEOUT, write(name.clone(), value.clone())).await {
            Ok(r) => r,
            Err(_) => Written::Failed(format!("no answer within {WRITE_TIMEOUT:?}")),
        };
        match result {
            Written::Ok => {
                if failures > 0 {
                    tracing::info!(kind, name, failures, "status written again");
                }
                failures = 0;
                backoff.reset();
                done = Some((value, Instant::now()));
            }
            Written::Stale => {
                tracing::debug!(kind, name, "object changed meanwhile; status recomputed next pass");
                done = Some((value, Instant::now()));
            }
            Written::Failed(error) => {
                failures += 1;
                done = None;
                let wait = backoff.failed();
                tracing::warn!(
                    kind,
                    name,
                    error,
                    failures,
                    retry_in_ms = wait.as_millis() as u64,
                    "status not written; the newest status is written after the wait"
                );
                tokio::time::sleep(wait).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use parking_lot::Mutex;
    use serde_json::json;
    use std::collections::VecDeque;
    use tokio::sync::Semaphore;

    fn ts(secs: i64) -> Timestamp {
        Timestamp::from_second(1_700_000_000 + secs).unwrap()
    }

    fn lease(holder: &str, renewed: i64) -> LeaseInfo {
        LeaseInfo {
            holder: Some(holder.into()),
            acquire_time: Some(ts(renewed)),
            renew_time: Some(ts(renewed)),
            duration: Duration::from_secs(15),
        }
    }

    #[test]
    fn the_first_live_holder_writes() {
        let leases = [lease("gw-3", 100), lease("gw-2", 100), lease("gw-1", 50)];
        let gws = ["gw-1", "gw-2", "gw-3"];
        let who: Vec<&str> = gws.iter().copied().filter(|me| is_writer(me, &leases, gws, ts(105))).collect();
        assert_eq!(who, ["gw-2"], "gw-1's Lease expired at 65");
    }

    #[test]
    fn without_a_live_lease_only_the_first_eligible_gateway_writes() {
        // An outage: every Lease looks expired.
        let leases = [lease("gw-3", 100), lease("gw-2", 100)];
        let gws = ["gw-3", "gw-2", "gw-1"];
        let who: Vec<&str> = gws.iter().copied().filter(|me| is_writer(me, &leases, gws, ts(500))).collect();
        assert_eq!(who, ["gw-1"]);
        // No Leases at all: the same.
        let who: Vec<&str> = gws.iter().copied().filter(|me| is_writer(me, [], gws, ts(500))).collect();
        assert_eq!(who, ["gw-1"]);
        // A drained gateway is not eligible; an unlabelled one never.
        assert!(!is_writer("gw-1", [], ["gw-2", "gw-3"], ts(500)));
        assert!(is_writer("gw-2", [], ["gw-2", "gw-3"], ts(500)));
        // Nobody labelled: each writes for itself.
        assert!(is_writer("gw-9", [], [], ts(500)));
    }

    #[test]
    fn backoff_doubles_caps_and_resets() {
        // The largest draw: the whole base.
        let mut b = Backoff::with_random(|| u64::MAX);
        let top: Vec<u64> = (0..9).map(|_| b.failed().as_millis() as u64).collect();
        assert_eq!(top, [1000, 2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000]);
        let mut b = Backoff::with_random(|| 0);
        let low: Vec<u64> = (0..9).map(|_| b.failed().as_secs()).collect();
        assert_eq!(low, [0, 1, 2, 4, 8, 16, 30, 30, 30], "half of 1, 2, 4 .. 60 s");
        b.reset();
        assert_eq!(b.failed(), Duration::from_millis(500));
        for r in [0, 1, 499, 500, 12345, u64::MAX / 3, u64::MAX] {
            let d = jittered(Duration::from_secs(1), r);
            assert!(d >= Duration::from_millis(500) && d <= Duration::from_secs(1), "{d:?}");
        }
        assert_eq!(jittered(Duration::from_secs(1), u64::MAX / 2), Duration::from_millis(749));
    }

    /// A write function whose calls wait for a permit and take their result
    /// from a script (then `Ok`); it records each call and the most in flight.
    #[derive(Clone, Default)]
    struct Fake {
        calls: Arc<Mutex<Vec<(Value, Instant)>>>,
        results: Arc<Mutex<VecDeque<Written>>>,
        in_flight: Arc<Mutex<(u32, u32)>>,
        gate: Option<Arc<Semaphore>>,
    }

    impl Fake {
        fn write_fn(&self) -> WriteFn {
            let f = self.clone();
            Arc::new(move |_name, value| {
                let f = f.clone();
                Box::pin(async move {
                    f.calls.lock().push((value, Instant::now()));
                    {
                        let mut g = f.in_flight.lock();
                        g.0 += 1;
                        g.1 = g.1.max(g.0);
                    }
                    if let Some(gate) = &f.gate {
                        gate.acquire().await.unwrap().forget();
                    }
                    f.in_flight.lock().0 -= 1;
                    f.results.lock().pop_front().unwrap_or(Written::Ok)
                })
            })
        }

        fn values(&self) -> Vec<Value> {
            self.calls.lock().iter().map(|(v, _)| v.clone()).collect()
        }

        fn gaps(&self) -> Vec<Duration> {
            self.calls.lock().windows(2).map(|w| w[1].1 - w[0].1).collect()
        }
    }

    fn steady() -> Backoff {
        Backoff::with_random(|| u64::MAX)
    }

    async fn settle_tasks() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn one_write_in_flight_and_the_latest_wins() {
        let gate = Arc::new(Semaphore::new(0));
        let fake = Fake { gate: Some(gate.clone()), ..Default::default() };
        let mut w = StatusWriter::with_backoff("policy", fake.write_fn(), steady);
        w.submit("p", json!(1));
        settle_tasks().await;
        for v in 2..=5 {
            w.submit("p", json!(v));
            settle_tasks().await;
        }
        assert_eq!(fake.values(), [json!(1)], "the first is in flight; the others wait");
        // Another object has its own slot.
        w.submit("q", json!("q"));
        settle_tasks().await;
        assert_eq!(fake.values().len(), 2);
        gate.add_permits(10);
        settle_tasks().await;
        let values = fake.values();
        assert_eq!(values.iter().filter(|v| v.is_number()).collect::<Vec<_>>(), [&json!(1), &json!(5)]);
        assert_eq!(fake.in_flight.lock().1, 2, "one per object");
        // Written just now: the same status is not written again until
        // STATUS_RESEND passed.
        w.submit("p", json!(5));
        settle_tasks().await;
        assert_eq!(fake.values().len(), 3);
        tokio::time::advance(STATUS_RESEND).await;
        w.submit("p", json!(5));
        settle_tasks().await;
        assert_eq!(fake.values().len(), 4);
    }

    #[tokio::test(start_paused = true)]
    async fn failures_back_off_doubling_to_the_cap_and_a_success_resets() {
        let fake = Fake::default();
        fake.results.lock().extend((0..9).map(|i| Written::Failed(format!("504 #{i}"))));
        fake.results.lock().push_back(Written::Ok);
        fake.results.lock().extend((0..2).map(|_| Written::Failed("503".into())));
        let mut w = StatusWriter::with_backoff("policy", fake.write_fn(), steady);
        w.submit("p", json!(1));
        tokio::time::sleep(Duration::from_secs(600)).await;
        // 9 failures, then a success: 10 calls.
        let secs: Vec<u64> = fake.gaps().iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60, 60]);
        // After the success a new status fails twice: the waits start at 1 s again.
        w.submit("p", json!(2));
        tokio::time::sleep(Duration::from_secs(600)).await;
        let secs: Vec<u64> = fake.gaps().iter().map(Duration::as_secs).collect();
        assert_eq!(&secs[10..], [1, 2]);
        assert_eq!(fake.values().len(), 13);
    }

    #[tokio::test(start_paused = true)]
    async fn a_status_submitted_during_the_wait_is_the_one_retried() {
        let fake = Fake::default();
        fake.results.lock().push_back(Written::Failed("504".into()));
        let mut w = StatusWriter::with_backoff("policy", fake.write_fn(), steady);
        w.submit("p", json!(1));
        settle_tasks().await;
        w.submit("p", json!(2));
        w.submit("p", json!(3));
        settle_tasks().await;
        assert_eq!(fake.values(), [json!(1)], "nothing before the wait ends");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(fake.values(), [json!(1), json!(3)]);
        // Settled during a wait: nothing is retried.
        fake.results.lock().push_back(Written::Failed("504".into()));
        w.submit("p", json!(4));
        settle_tasks().await;
        w.settle("p");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(fake.values(), [json!(1), json!(3), json!(4)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stale_write_is_not_repeated_at_once() {
        let fake = Fake::default();
        fake.results.lock().push_back(Written::Stale);
        let mut w = StatusWriter::with_backoff("pool", fake.write_fn(), steady);
        w.submit("p", json!(1));
        settle_tasks().await;
        w.submit("p", json!(1));
        settle_tasks().await;
        assert_eq!(fake.values(), [json!(1)]);
        w.submit("p", json!(2));
        settle_tasks().await;
        assert_eq!(fake.values(), [json!(1), json!(2)], "a new status goes at once, without a wait");
    }

    #[tokio::test(start_paused = true)]
    async fn a_hung_write_times_out_and_counts_as_failed() {
        let gate = Arc::new(Semaphore::new(0));
        let fake = Fake { gate: Some(gate.clone()), ..Default::default() };
        let mut w = StatusWriter::with_backoff("policy", fake.write_fn(), steady);
        w.submit("p", json!(1));
        tokio::time::sleep(WRITE_TIMEOUT + Duration::from_millis(500)).await;
        assert_eq!(fake.values().len(), 1, "waiting out the backoff");
        gate.add_permits(1);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(fake.values().len(), 2);
        assert_eq!(fake.gaps()[0], WRITE_TIMEOUT + BACKOFF_FIRST);
    }
}
