//! Engine time. The engine never reads a clock: callers pass a [`Timestamp`],
//! so tests and benchmarks are deterministic.

use std::time::Duration;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_truncate() {
        assert_eq!(Timestamp::from_millis(1999).secs(), 1);
        assert_eq!(Timestamp::from_secs(7).as_millis(), 7000);
        assert_eq!(Timestamp::from_secs(1).plus(Duration::from_millis(500)).as_millis(), 1500);
    }
}
