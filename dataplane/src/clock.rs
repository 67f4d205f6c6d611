//! Engine time. The engine never reads a clock: callers pass a [`Timestamp`],
//! so tests and benchmarks are deterministic.
//!
//! The daemon's workers take theirs from an [`EngineClock`]: milliseconds
//! since the daemon's epoch (the moment it started; `std::time::Instant`,
//! which is CLOCK_MONOTONIC on Linux). The XDP fast path stamps its entries
//! with `bpf_ktime_get_coarse_ns`, also CLOCK_MONOTONIC; the clock records
//! where the epoch lies on that clock so a stamp converts to engine seconds.
//!
//! Test-only speed-up: `EGRET_TEST_CLOCK_SCALE=N` (1-1000, default 1) makes
//! engine time run N times faster than real time, for worker timestamps,
//! session idle times and kernel stamps alike, so an end-to-end test can
//! watch a 120 s UDP timeout pass in 6 s. It is read once at start and
//! logged; never set it in production.

use std::time::{Duration, Instant};

/// Milliseconds since an arbitrary epoch chosen by the caller (the worker loop
/// uses the moment the engine was created).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The epoch.
    pub const ZERO: Timestamp = Timestamp(0);

    /// A timestamp `ms` milliseconds after the epoch.
    pub const fn from_millis(ms: u64) -> Self {
        Timestamp(ms)
    }

    /// A timestamp `s` seconds after the epoch.
    pub const fn from_secs(s: u64) -> Self {
        Timestamp(s.saturating_mul(1000))
    }

    /// Milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// Whole seconds since the epoch, as stored in sessions (wraps after 136 years).
    pub const fn secs(self) -> u32 {
        (self.0 / 1000) as u32
    }

    /// This timestamp plus `d`.
    pub fn plus(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(d.as_millis() as u64))
    }
}

/// The environment variable of the test-only speed-up.
pub const SCALE_ENV: &str = "EGRET_TEST_CLOCK_SCALE";

const NS_PER_SEC: u64 = 1_000_000_000;

/// The daemon's engine clock.
#[derive(Debug, Clone, Copy)]
pub struct EngineClock {
    epoch: Instant,
    /// The epoch on CLOCK_MONOTONIC, nanoseconds.
    epoch_mono_ns: u64,
    scale: u64,
}

impl EngineClock {
    /// A clock whose epoch is `epoch`, running `scale` times real time.
    pub fn new(epoch: Instant, scale: u64) -> Self {
        let (now_mono, now) = (monotonic_ns(), Instant::now());
        let since = now.saturating_duration_since(epoch).as_nanos() as u64;
        Self { epoch, epoch_mono_ns: now_mono.saturating_sub(since), scale: scale.clamp(1, 1000) }
    }

    /// A real-time clock, or the scale from [`SCALE_ENV`] when set to a
    /// number in 1-1000 (tests).
    pub fn from_env(epoch: Instant) -> Self {
        let scale =
            std::env::var(SCALE_ENV).ok().and_then(|v| v.parse::<u64>().ok()).filter(|s| (1..=1000).contains(s));
        Self::new(epoch, scale.unwrap_or(1))
    }

    /// The speed-up (1 in production).
    pub fn scale(&self) -> u64 {
        self.scale
    }

    /// The epoch.
    pub fn epoch(&self) -> Instant {
        self.epoch
    }

    /// Engine time at `at`.
    pub fn at(&self, at: Instant) -> Timestamp {
        let ms = at.saturating_duration_since(self.epoch).as_millis() as u64;
        Timestamp::from_millis(ms.saturating_mul(self.scale))
    }

    /// Engine time now.
    pub fn now(&self) -> Timestamp {
        self.at(Instant::now())
    }

    /// The engine second of a fast-path stamp (CLOCK_MONOTONIC ns), `None`
    /// for 0 (never stamped). The program writes a stamp only when it moves
    /// by a second or more, so the entry's last packet lies in the second
    /// after the stamp: the end of that second is returned. An offloaded
    /// session may thus live up to a second longer than its timeout, never
    /// less (RFC 4787 REQ-5 and RFC 5382 REQ-5 set minimums).
    pub fn stamp_secs(&self, stamp_ns: u64) -> Option<u32> {
        if stamp_ns == 0 {
            return None;
        }
        let real = stamp_ns.saturating_sub(self.epoch_mono_ns).saturating_add(NS_PER_SEC);
        let engine_ms = real / 1_000_000 * self.scale;
        Some((engine_ms / 1000) as u32)
    }
}

/// The kernel's CLOCK_MONOTONIC in nanoseconds: the clock of
/// `bpf_ktime_get_ns` and `bpf_ktime_get_coarse_ns`, whose stamps the fast
/// path leaves in its entries (0 if it cannot be read, which Linux never does).
#[allow(unsafe_code)]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the call; CLOCK_MONOTONIC
    // is always available on Linux, so the call cannot fail.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_truncate() {
        assert_eq!(Timestamp::from_millis(1999).secs(), 1);
        assert_eq!(Timestamp::from_secs(7).as_millis(), 7000);
        assert_eq!(Timestamp::from_secs(1).plus(Duration::from_millis(500)).as_millis(), 1500);
    }

    #[test]
    fn stamps_convert_to_the_end_of_their_second() {
        let epoch = Instant::now();
        let c = EngineClock::new(epoch, 1);
        let epoch_ns = c.epoch_mono_ns;
        assert_eq!(c.stamp_secs(0), None);
        assert_eq!(c.stamp_secs(epoch_ns), Some(1));
        assert_eq!(c.stamp_secs(epoch_ns + 5 * NS_PER_SEC + 999_999_999), Some(6));
        assert_eq!(c.stamp_secs(epoch_ns - 1), Some(1), "a stamp just before the epoch: its second ends after it");
        // The clock agrees with the kernel's: a stamp taken now is now (+1 s).
        std::thread::sleep(Duration::from_millis(30));
        let now = c.now().secs();
        let s = c.stamp_secs(monotonic_ns()).unwrap_or(0);
        assert!(s == now + 1 || s == now + 2, "{s} vs {now}");
    }

    #[test]
    fn scale_speeds_up_engine_time_and_stamps_alike() {
        let epoch = Instant::now();
        let c = EngineClock::new(epoch, 20);
        assert_eq!(c.at(epoch + Duration::from_millis(1500)).as_millis(), 30_000);
        assert_eq!(c.stamp_secs(c.epoch_mono_ns + 1_500_000_000), Some(50), "(1.5 s + 1 s) x 20");
        assert_eq!(EngineClock::new(epoch, 0).scale(), 1);
        assert_eq!(EngineClock::new(epoch, 5000).scale(), 1000);
    }
}
