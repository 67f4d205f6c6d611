//! Watches that start over when the Lease watch is seen to lag.
//!
//! A watch is one long HTTP response. When the path to the API server
//! drops packets for a while (a firewall, a partition: `k8s_ha`'s
//! `both-cut-holder` drops them for 15 s), the server's retransmissions of
//! the watch's data back off exponentially; once the path is back, the
//! watch stays silent until the next retransmission, seconds later, while
//! new requests (renewals) get through at once. A gateway then decides on
//! a view several seconds old: in `k8s_ha` a drain's released Lease reached
//! the cut gateway 4.3-5.1 s late, and until then it waited for the holder's
//! liveness Lease to look expired (it saw that Lease only through the
//! answers to its refused expiries).
//!
//! Nothing in a watch says it lags, but the gateway's own writes do: each
//! renewal the API server answers must come back through the Lease watch.
//! The renewer keeps the oldest answered write not yet seen
//! ([`super::renewer::WatchProbe`]); when the watch has not shown it
//! renewDeadline after the answer, every watch starts over ([`Restartable`]:
//! a fresh list, then a new watch, on a new connection), at most once per
//! leaseDuration.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};
use kube::api::Api;
use kube::runtime::watcher::{self, watcher};
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::lease::LeaseRecord;
use super::renewer::WatchProbe;

/// A watcher that starts over (its first event is `Init`, so a reflector
/// replaces its store once the new list is complete) each time `restart`
/// is notified with `notify_waiters`.
pub struct Restartable<K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static> {
    api: Api<K>,
    cfg: watcher::Config,
    restart: Arc<Notify>,
    inner: BoxStream<'static, watcher::Result<watcher::Event<K>>>,
    restarted: BoxFuture<'static, ()>,
}

impl<K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + 'static> std::fmt::Debug for Restartable<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Restartable").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

/// A wait for `n`'s next `notify_waiters`, registered from now on (not
/// from its first poll).
fn notified(n: &Arc<Notify>) -> BoxFuture<'static, ()> {
    n.clone().notified_owned().boxed()
}

impl<K> Restartable<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    /// A watch of `api` with `cfg`, started over on `restart`.
    pub fn new(api: Api<K>, cfg: watcher::Config, restart: Arc<Notify>) -> Self {
        let inner = watcher(api.clone(), cfg.clone()).boxed();
        let restarted = notified(&restart);
        Restartable { api, cfg, restart, inner, restarted }
    }
}

impl<K> Stream for Restartable<K>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
    K::DynamicType: Default,
{
    type Item = watcher::Result<watcher::Event<K>>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.restarted.poll_unpin(cx).is_ready() {
            this.inner = watcher(this.api.clone(), this.cfg.clone()).boxed();
            this.restarted = notified(&this.restart);
        }
        this.inner.poll_next_unpin(cx)
    }
}

/// The newest `resourceVersion` among the Leases the watch shows: the
/// watch has delivered every change up to it. The probe's own Lease is not
/// enough: an IP's Lease deleted (the IP left its policy) right after a
/// renewal never shows that renewal, and its absence restarted a watch that
/// did not lag.
pub fn newest_version<'a>(leases: impl Iterator<Item = &'a LeaseRecord>) -> Option<u64> {
    leases.filter_map(|r| r.resource_version.parse::<u64>().ok()).max()
}

/// Whether the Lease watch lags `probe`, the oldest answered write it has
/// not shown, at `now`: `seen` is the newest `resourceVersion` the watch
/// shows of any Lease ([`newest_version`]; None: none). `Some(true)`:
/// shown, drop the probe; `Some(false)`: it lags by more than `bound`;
/// None: wait.
pub fn watch_shows(probe: &WatchProbe, seen: Option<u64>, now: Instant, bound: Duration) -> Option<bool> {
    if seen.is_some_and(|s| s >= probe.resource_version) {
        return Some(true);
    }
    (now >= probe.answered + bound).then_some(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_unseen_past_the_bound_is_a_lagging_watch() {
        let t0 = Instant::now();
        let p = WatchProbe { ip: None, resource_version: 120, answered: t0 };
        let b = Duration::from_secs(2);
        assert_eq!(watch_shows(&p, Some(120), t0, b), Some(true));
        assert_eq!(watch_shows(&p, Some(131), t0, b), Some(true), "a later version shows it too");
        assert_eq!(watch_shows(&p, Some(119), t0 + Duration::from_millis(1999), b), None);
        assert_eq!(watch_shows(&p, Some(119), t0 + b, b), Some(false));
        assert_eq!(watch_shows(&p, None, t0 + b, b), Some(false));
    }

    #[test]
    fn the_watch_is_past_a_write_once_any_lease_it_shows_is_newer() {
        let rec = |rv: &str| LeaseRecord { resource_version: rv.into(), ..Default::default() };
        // The probe's Lease deleted since: another Lease, newer, shows the
        // watch got past the write.
        let shown = [rec("118"), rec("131"), rec("not-a-number")];
        assert_eq!(newest_version(shown.iter()), Some(131));
        assert_eq!(newest_version([].iter()), None);
        let t0 = Instant::now();
        let p = WatchProbe { ip: Some("198.51.100.10".parse().unwrap()), resource_version: 120, answered: t0 };
        let b = Duration::from_secs(2);
        assert_eq!(watch_shows(&p, newest_version(shown.iter()), t0 + b, b), Some(true));
    }
}
