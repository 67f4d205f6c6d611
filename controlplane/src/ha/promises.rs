//! Failsafe promises that outlive a graceful restart (issue 16 §4, "a peer
//! that restarts during the outage"; ADR 0013).
//!
//! A gateway that stops gracefully while it keeps failsafe promises
//! (`LeaseManager::promise`: not to take an IP before an instant) writes
//! them beside its peer cache, `<peerCache>.promises`, before it says
//! Goodbye, and tells each holder which of its promises were written
//! (`Message::PromisesKept`, in the same write as the Goodbye). Its next
//! process on the node loads them at start and keeps them like live ones
//! (`LeaseManager::restore_promise`), so the holder may go on counting it as
//! accepting while it is away (`failsafe::Failsafe::bridge`).
//!
//! The file holds wall-clock instants (an `Instant` means nothing to another
//! process): `egret-promises 1`, then one `IP HOLDER UNTIL_UNIX_MS` line per
//! promise. It is written to a temporary file, synced and renamed, so it is
//! either whole or absent. Loading drops ended promises and shortens any
//! that ends more than `max_remaining` (leaseDuration: no promise is given
//! for longer) after now: only a wall clock stepped back can make one look
//! longer, and now + leaseDuration is still later than its real end. A wall
//! clock stepped *forward* between the stop and the start shortens the
//! kept promises by the step: the holder's margin (`MIN_FENCING_MARGIN`)
//! covers small steps, not large ones (ADR 0013, Limits).

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// The first line of the file.
const HEADER: &str = "egret-promises 1";

/// One kept promise: no take-over of `ip` from `holder` before `until`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptPromise {
    /// The egress IP.
    pub ip: IpAddr,
    /// The gateway it was promised to.
    pub holder: String,
    /// The end of the promise, in this process's clock.
    pub until: Instant,
}

/// Why the promise file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum PromiseFileError {
    /// Reading or writing failed.
    #[error("promise file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A line is not what this version writes.
    #[error("promise file {path}, line {line}: {detail}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// 1-based.
        line: usize,
        /// What is wrong.
        detail: String,
    },
}

/// Where the promises of a gateway with peer cache `peer_cache` are kept.
pub fn path_for(peer_cache: &Path) -> PathBuf {
    let mut name = peer_cache.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    name.push(".promises");
    peer_cache.with_file_name(name)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Writes `promises` (those still running at `now`; `wall` is the wall
/// clock at `now`) to `path`, whole or not at all. No promise left: the
/// file is removed.
pub fn save(path: &Path, promises: &[KeptPromise], now: Instant, wall: SystemTime) -> Result<(), PromiseFileError> {
    let io = |source| PromiseFileError::Io { path: path.to_path_buf(), source };
    let live: Vec<&KeptPromise> = promises.iter().filter(|p| p.until > now).collect();
    if live.is_empty() {
        return match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io(e)),
            _ => Ok(()),
        };
    }
    let mut text = format!("{HEADER}\n");
    for p in live {
        // Rounded up: the promise is kept a little longer, never shorter.
        let left = p.until - now;
        let until = unix_ms(wall) + u64::try_from(left.as_millis()).unwrap_or(u64::MAX) + 1;
        text.push_str(&format!("{} {} {until}\n", p.ip, p.holder));
    }
    let mut tmp_name = path.file_name().map(|n| n.to_os_string()).unwrap_or_default();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    };
    write().map_err(io)
}

/// Reads the promises at `path` (none when it does not exist), as instants
/// of this process (`wall` is the wall clock at `now`). Ended ones are
/// dropped; one ending more than `max_remaining` after now ends then.
pub fn load(
    path: &Path,
    now: Instant,
    wall: SystemTime,
    max_remaining: Duration,
) -> Result<Vec<KeptPromise>, PromiseFileError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(PromiseFileError::Io { path: path.to_path_buf(), source }),
    };
    let corrupt = |line: usize, detail: String| PromiseFileError::Corrupt { path: path.to_path_buf(), line, detail };
    let mut lines = text.lines();
    if lines.next() != Some(HEADER) {
        return Err(corrupt(1, format!("expected {HEADER:?}")));
    }
    let wall_ms = unix_ms(wall);
    let mut out = Vec::new();
    for (i, l) in lines.enumerate() {
        let n = i + 2;
        let f: Vec<&str> = l.split(' ').collect();
        let [ip, holder, until] = f[..] else {
            return Err(corrupt(n, format!("{} fields, expected 3", f.len())));
        };
        let ip: IpAddr = ip.parse().map_err(|e| corrupt(n, format!("address {ip:?}: {e}")))?;
        if holder.is_empty() {
            return Err(corrupt(n, "empty holder".into()));
        }
        let until: u64 = until.parse().map_err(|e| corrupt(n, format!("until {until:?}: {e}")))?;
        if until <= wall_ms {
            continue;
        }
        let left = Duration::from_millis(until - wall_ms).min(max_remaining);
        out.push(KeptPromise { ip, holder: holder.to_string(), until: now + left });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const D: Duration = Duration::from_secs(4);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_path_sits_beside_the_peer_cache() {
        assert_eq!(path_for(Path::new("/run/egret/peers")), PathBuf::from("/run/egret/peers.promises"));
    }

    /// Written on a graceful stop, read by the next process: the same
    /// promises, ending no earlier (by the wall clock both read), and those
    /// ended meanwhile are dropped.
    #[test]
    fn promises_written_at_stop_are_read_back_and_ended_ones_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = path_for(&dir.path().join("peers"));
        let t0 = Instant::now();
        let w0 = SystemTime::now();
        let x: IpAddr = "198.51.100.10".parse().unwrap();
        let y: IpAddr = "2001:db8::10".parse().unwrap();
        let z: IpAddr = "198.51.100.12".parse().unwrap();
        let kept = vec![
            KeptPromise { ip: x, holder: "gw-a".into(), until: t0 + ms(3_900) },
            KeptPromise { ip: y, holder: "gw-c".into(), until: t0 + ms(1_000) },
            KeptPromise { ip: z, holder: "gw-a".into(), until: t0 },
        ];
        save(&path, &kept, t0, w0).unwrap();
        // The next process, 1.5 s of wall clock later, with its own Instants.
        let t1 = Instant::now() + ms(50);
        let back = load(&path, t1, w0 + ms(1_500), D).unwrap();
        assert_eq!(back.len(), 1, "y ended during the restart, z had ended at the stop: {back:?}");
        assert_eq!((back[0].ip, back[0].holder.as_str()), (x, "gw-a"));
        assert!(back[0].until >= t1 + ms(2_400), "never shorter than what was left");
        assert!(back[0].until <= t1 + ms(2_401));
        // Nothing left to keep: the file goes.
        save(&path, &[], t1, w0).unwrap();
        assert!(!path.exists());
        assert!(load(&path, t1, w0, D).unwrap().is_empty(), "no file: nothing kept");
    }

    /// A wall clock stepped back makes a promise look longer than any is
    /// given: kept for leaseDuration from now (still later than its end).
    #[test]
    fn a_promise_longer_than_a_lease_duration_is_shortened_to_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("peers.promises");
        let t0 = Instant::now();
        let w0 = SystemTime::now();
        let x: IpAddr = "198.51.100.10".parse().unwrap();
        save(&path, &[KeptPromise { ip: x, holder: "gw-a".into(), until: t0 + ms(3_000) }], t0, w0).unwrap();
        let back = load(&path, t0, w0 - Duration::from_secs(3_600), D).unwrap();
        assert_eq!(back[0].until, t0 + D);
    }

    #[test]
    fn a_corrupt_file_is_an_error_naming_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("peers.promises");
        let (t0, w0) = (Instant::now(), SystemTime::now());
        for (text, line) in [
            ("garbage\n", 1),
            ("egret-promises 1\n198.51.100.10 gw-a\n", 2),
            ("egret-promises 1\n198.51.100.10 gw-a 99999999999999\nnot-an-ip gw-a 1\n", 3),
            ("egret-promises 1\n198.51.100.10 gw-a soon\n", 2),
            ("egret-promises 1\n198.51.100.10  1\n", 2),
        ] {
            std::fs::write(&path, text).unwrap();
            match load(&path, t0, w0, D) {
                Err(PromiseFileError::Corrupt { line: l, .. }) => assert_eq!(l, line, "{text:?}"),
                other => panic!("{text:?}: {other:?}"),
            }
        }
    }
}
