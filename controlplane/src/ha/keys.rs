//! The channel's keys and their rotation (issue 28 §3, ADR 0029): which key
//! this gateway proves with, which others it also accepts while a new one
//! rolls out, and the task that re-reads them when their files change.
//!
//! # The rule
//! A connection runs under the **acceptor's primary key**. The acceptor
//! signs its SYN-ACK with that key's TCP-MD5 key and proves with it; the
//! dialer, which holds the primary and the accepted keys, finds which of
//! them that is: it connects with each key's TCP-MD5 key in turn (the
//! acceptor's kernel drops a SYN signed with another), starting with the one
//! that last worked for that peer, and then checks the acceptor's proof
//! against each key it holds. So two gateways talk whenever the dialer holds
//! the acceptor's primary key.
//!
//! # A roll in three steps (docs/operations.md)
//! Each step may reach the gateways at different times (a Secret's update
//! reaches each pod within the kubelet's sync period); at every moment of it,
//! every gateway holds every other gateway's primary key:
//!
//! | step | files | primary | accepted |
//! |---|---|---|---|
//! | 0 | `key` = old | old | |
//! | 1 | `key` = old, `next` = new | old | new |
//! | 2 | `key` = new, `previous` = old | new | old |
//! | 3 | `key` = new | new | |
//!
//! A connection whose key this gateway no longer holds is ended (a Goodbye,
//! not a death) and made again under a key it holds, so a retired key
//! protects no traffic after step 3; a connection under a key still held
//! keeps running (no needless resync).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::auth::{KeyError, KeyId, Role, SharedKey};

/// How often [`watch`] re-reads the key files. A Kubernetes Secret's update
/// reaches a pod's volume within the kubelet's sync period (about a minute),
/// so this adds little; reading two or three small files costs nothing.
pub const CHECK_PERIOD: Duration = Duration::from_secs(2);

/// The keys this gateway holds: the primary first.
#[derive(Debug, Clone)]
pub struct KeyRing {
    keys: Vec<Arc<SharedKey>>,
}

impl From<SharedKey> for KeyRing {
    fn from(k: SharedKey) -> KeyRing {
        KeyRing { keys: vec![Arc::new(k)] }
    }
}

impl KeyRing {
    /// The primary key and the accepted ones; an accepted key equal to one
    /// before it is dropped.
    pub fn new(primary: SharedKey, accepted: Vec<SharedKey>) -> KeyRing {
        let mut keys = vec![Arc::new(primary)];
        for k in accepted {
            if keys.iter().all(|h| h.id() != k.id()) {
                keys.push(Arc::new(k));
            }
        }
        KeyRing { keys }
    }

    /// The key this gateway proves with as an acceptor.
    pub fn primary(&self) -> &Arc<SharedKey> {
        &self.keys[0]
    }

    /// The accepted keys (all but the primary).
    pub fn accepted(&self) -> &[Arc<SharedKey>] {
        &self.keys[1..]
    }

    /// The keys' ids, the primary first.
    pub fn ids(&self) -> Vec<KeyId> {
        self.keys.iter().map(|k| k.id()).collect()
    }

    /// Whether `id` is held.
    pub fn holds(&self, id: KeyId) -> bool {
        self.keys.iter().any(|k| k.id() == id)
    }

    /// The keys in the order a dialer tries them: `hint` (the key that last
    /// worked with that peer) first, then the primary, then the rest.
    pub fn dial_order(&self, hint: Option<KeyId>) -> Vec<Arc<SharedKey>> {
        let mut out: Vec<Arc<SharedKey>> = self.keys.iter().filter(|k| Some(k.id()) == hint).cloned().collect();
        out.extend(self.keys.iter().filter(|k| Some(k.id()) != hint).cloned());
        out
    }

    /// The held key under which `role`'s proof over `transcript` verifies
    /// (each checked in constant time), `first` tried first.
    pub fn verifying(
        &self,
        first: Option<KeyId>,
        role: Role,
        transcript: &[u8],
        proof: &[u8],
    ) -> Option<Arc<SharedKey>> {
        self.dial_order(first).into_iter().find(|k| k.verify(role, transcript, proof))
    }
}

/// Where the keys come from: `kubernetes.ha.keyFile` and
/// `kubernetes.ha.acceptKeyFiles`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyFiles {
    pub primary: PathBuf,
    pub accepted: Vec<PathBuf>,
}

impl KeyFiles {
    /// Reads every file. The primary must exist; an accepted file that does
    /// not exist is no key (a Secret's data key not yet added, or removed);
    /// one that exists must be a valid key.
    pub fn load(&self) -> Result<KeyRing, KeyError> {
        let primary = SharedKey::from_file(&self.primary)?;
        let mut accepted = Vec::new();
        for path in &self.accepted {
            match SharedKey::from_file(path) {
                Ok(k) => accepted.push(k),
                Err(KeyError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(KeyRing::new(primary, accepted))
    }
}

/// Describes a ring for a log line: `primary=<id> accepted=[<id>, ...]`.
pub fn describe(ring: &KeyRing) -> String {
    let accepted: Vec<String> = ring.accepted().iter().map(|k| k.id().to_string()).collect();
    format!("primary={} accepted=[{}]", ring.primary().id(), accepted.join(", "))
}

/// Re-reads `files` every `period` and hands a changed ring to `apply`. A
/// ring that fails to load (a file unreadable, a key too short) is logged
/// once per distinct error and the keys in use stay.
pub async fn watch(files: KeyFiles, mut current: Vec<KeyId>, period: Duration, apply: impl Fn(KeyRing)) {
    let mut last_error: Option<String> = None;
    loop {
        tokio::time::sleep(period).await;
        match files.load() {
            Ok(ring) => {
                last_error = None;
                if ring.ids() != current {
                    tracing::info!(keys = %describe(&ring), file = %files.primary.display(), "peer channel: keys changed");
                    current = ring.ids();
                    apply(ring);
                }
            }
            Err(e) => {
                let msg = e.to_string();
                if last_error.as_deref() != Some(msg.as_str()) {
                    tracing::error!(error = %msg, "peer channel: the key files do not load; the keys in use stay");
                    last_error = Some(msg);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn key(b: u8) -> SharedKey {
        SharedKey::from_bytes(Path::new("/test/key"), &[b; 32]).unwrap()
    }

    fn beside(primary: &Path, name: &str) -> PathBuf {
        primary.with_file_name(name)
    }

    #[test]
    fn the_primary_comes_first_and_duplicates_go() {
        let r = KeyRing::new(key(1), vec![key(2), key(1), key(2), key(3)]);
        assert_eq!(r.ids(), vec![key(1).id(), key(2).id(), key(3).id()]);
        assert_eq!(r.primary().id(), key(1).id());
        assert_eq!(r.accepted().len(), 2);
        assert!(r.holds(key(3).id()) && !r.holds(key(4).id()));
        let order: Vec<KeyId> = r.dial_order(Some(key(3).id())).iter().map(|k| k.id()).collect();
        assert_eq!(order, vec![key(3).id(), key(1).id(), key(2).id()]);
    }

    /// Every pair of adjacent steps of a roll can talk in both directions:
    /// the dialer holds the acceptor's primary.
    #[test]
    fn every_step_of_a_roll_talks_to_its_neighbours() {
        let (old, new) = (1, 2);
        let steps = [
            KeyRing::new(key(old), vec![]),
            KeyRing::new(key(old), vec![key(new)]),
            KeyRing::new(key(new), vec![key(old)]),
            KeyRing::new(key(new), vec![]),
        ];
        let t = b"transcript";
        let talks = |dialer: &KeyRing, acceptor: &KeyRing| {
            let proof = acceptor.primary().proof(Role::Acceptor, t);
            dialer.verifying(None, Role::Acceptor, t, &proof).is_some()
        };
        for w in steps.windows(2) {
            assert!(talks(&w[0], &w[1]) && talks(&w[1], &w[0]));
        }
        // Skipping a step breaks it: the old key alone and the new key alone.
        assert!(!talks(&steps[0], &steps[3]) && !talks(&steps[3], &steps[0]));
        // And so does skipping step 1 (step 2 reached a gateway still at 0).
        assert!(!talks(&steps[0], &steps[2]));
    }

    #[test]
    fn files_load_absent_accepted_files_are_no_key_bad_ones_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let primary = dir.path().join("key");
        std::fs::write(&primary, [1u8; 32]).unwrap();
        let files = KeyFiles { primary: primary.clone(), accepted: vec![beside(&primary, "next")] };
        assert_eq!(files.load().unwrap().ids(), vec![key(1).id()]);
        std::fs::write(beside(&primary, "next"), [2u8; 32]).unwrap();
        assert_eq!(files.load().unwrap().ids(), vec![key(1).id(), key(2).id()]);
        std::fs::write(beside(&primary, "next"), b"short").unwrap();
        let e = files.load().unwrap_err().to_string();
        assert!(e.contains("next") && e.contains("5 bytes"), "{e}");
        std::fs::remove_file(&primary).unwrap();
        assert!(files.load().unwrap_err().to_string().contains(&primary.display().to_string()));
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_applies_a_change_once_and_keeps_the_keys_on_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let primary = dir.path().join("key");
        std::fs::write(&primary, [1u8; 32]).unwrap();
        let files = KeyFiles { primary: primary.clone(), accepted: vec![beside(&primary, "next")] };
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let s = seen.clone();
        let task =
            tokio::spawn(watch(files, vec![key(1).id()], Duration::from_secs(1), move |r| s.lock().push(r.ids())));
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(seen.lock().is_empty(), "nothing changed");
        std::fs::write(beside(&primary, "next"), [2u8; 32]).unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(*seen.lock(), vec![vec![key(1).id(), key(2).id()]]);
        std::fs::write(&primary, b"oops").unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(seen.lock().len(), 1, "a bad file changes nothing");
        std::fs::write(&primary, [2u8; 32]).unwrap();
        std::fs::remove_file(beside(&primary, "next")).unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(seen.lock().last().unwrap(), &vec![key(2).id()]);
        task.abort();
    }
}
