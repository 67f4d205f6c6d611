//! The gateways' shared key and the peer channel's handshake and frame
//! sealing: who may talk on the channel, and how each frame is protected.
//!
//! Every key is derived from one cluster secret (a file, mounted from a
//! Kubernetes Secret) with HKDF-SHA256 (RFC 5869):
//!
//! ```text
//! prk          = HKDF-Extract(salt = "egret ha channel v1", secret)
//! tcp_md5_key  = HKDF-Expand(prk, "tcp-md5", 32)          one per cluster (RFC 2385)
//! hmac_key     = HKDF-Expand(prk, "handshake-hmac", 32)
//! key id       = HKDF-Expand(prk, "key-id", 4)            shown in logs, status and metrics
//! traffic key  = HKDF-Expand(prk, "traffic " || dir || SHA-256(transcript), 32)
//!                dir = "dialer->acceptor" | "acceptor->dialer"
//! ```
//!
//! The TCP-MD5 key is one per cluster rather than per pair of addresses: every
//! gateway holds the secret and could derive any pair's key, so per-pair keys
//! would protect nothing more.
//!
//! A gateway may hold more than one key while a new one rolls out
//! ([`super::keys`]): the acceptor proves with its primary key, the dialer
//! finds which of its keys that is, and the connection runs under it.
//!
//! Handshake (in clear, then every frame sealed):
//!
//! ```text
//! dialer   -> acceptor  Hello_d = "EGCH" | version u8 | incarnation u64 BE | nonce [32] | name_len u8 | name
//! acceptor -> dialer    Hello_a | HMAC(hmac_key, "acceptor" | Hello_d | Hello_a)
//! dialer   -> acceptor  HMAC(hmac_key, "dialer" | Hello_d | Hello_a)
//! ```
//!
//! Each side checks the other's proof in constant time (`ring::hmac::verify`).
//! Both nonces are fresh random 32-byte values, so a recorded handshake cannot
//! be replayed, and the role label keeps one side's proof from being reflected
//! as the other's. The transcript (both Hellos: both names, both incarnations,
//! both nonces) fixes the traffic keys, so each connection has its own keys.
//!
//! Frames: `len u32 BE | ChaCha20-Poly1305(body)` with `len` as the associated
//! data and the nonce `0u32 | counter u64 BE`, the counter counting frames per
//! direction from 0. A replayed, dropped, reordered or altered frame fails to
//! open and ends the connection ([`OpenError`]).
#![allow(clippy::module_name_repetitions)]

use std::fmt;
use std::path::{Path, PathBuf};

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use ring::digest;
use ring::hkdf::{self, Salt, HKDF_SHA256};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};

/// The shortest secret accepted: 256 bits.
pub const MIN_KEY_LEN: usize = 32;
/// Protocol version sent in Hello; a peer with another version is refused.
pub const VERSION: u8 = 1;
/// Magic at the start of a Hello.
pub const MAGIC: &[u8; 4] = b"EGCH";
/// Length of a proof (HMAC-SHA256).
pub const PROOF_LEN: usize = 32;
/// Length of the AEAD tag that follows each sealed body.
pub const TAG_LEN: usize = 16;
/// The fixed part of a Hello before the name.
pub const HELLO_FIXED_LEN: usize = 4 + 1 + 8 + 32 + 1;

const HKDF_SALT: &[u8] = b"egret ha channel v1";

/// Why a key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("cannot read the peer channel key {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("the peer channel key {path} is {len} bytes; at least {MIN_KEY_LEN} are required")]
    TooShort { path: PathBuf, len: usize },
}

impl KeyError {
    /// The file at fault.
    pub fn path(&self) -> &Path {
        match self {
            KeyError::Read { path, .. } | KeyError::TooShort { path, .. } => path,
        }
    }
}

/// A key's public name: 4 bytes derived from the secret (module doc), shown
/// as 8 hex digits. It tells keys apart in logs, `egret status` and metrics
/// and reveals nothing usable about the secret.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KeyId(pub [u8; 4]);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The cluster secret and the keys derived from it. `Debug` never shows key
/// material.
pub struct SharedKey {
    source: PathBuf,
    id: KeyId,
    tcp_md5: [u8; 32],
    hmac: hmac::Key,
    prk: hkdf::Prk,
}

impl fmt::Debug for SharedKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedKey").field("source", &self.source).field("id", &self.id).finish_non_exhaustive()
    }
}

impl SharedKey {
    /// Reads the secret from a file. The bytes are used as they are (a
    /// trailing newline is part of the key, on every gateway alike).
    pub fn from_file(path: &Path) -> Result<SharedKey, KeyError> {
        let bytes = std::fs::read(path).map_err(|source| KeyError::Read { path: path.to_owned(), source })?;
        SharedKey::from_bytes(path, &bytes)
    }

    /// Derives the keys from secret bytes; `source` names where they came from
    /// in errors.
    pub fn from_bytes(source: &Path, secret: &[u8]) -> Result<SharedKey, KeyError> {
        if secret.len() < MIN_KEY_LEN {
            return Err(KeyError::TooShort { path: source.to_owned(), len: secret.len() });
        }
        let prk = Salt::new(HKDF_SHA256, HKDF_SALT).extract(secret);
        let tcp_md5 = expand32(&prk, &[b"tcp-md5"]);
        let hmac_bytes = expand32(&prk, &[b"handshake-hmac"]);
        let id = expand32(&prk, &[b"key-id"]);
        Ok(SharedKey {
            source: source.to_owned(),
            id: KeyId([id[0], id[1], id[2], id[3]]),
            tcp_md5,
            hmac: hmac::Key::new(hmac::HMAC_SHA256, &hmac_bytes),
            prk,
        })
    }

    /// The key's public name.
    pub fn id(&self) -> KeyId {
        self.id
    }

    /// Where the secret came from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The RFC 2385 TCP-MD5 key (32 bytes, under the kernel's 80).
    pub fn tcp_md5_key(&self) -> &[u8; 32] {
        &self.tcp_md5
    }

    /// The proof `role` ("dialer" or "acceptor") gives over the transcript.
    pub fn proof(&self, role: Role, transcript: &[u8]) -> [u8; PROOF_LEN] {
        let mut ctx = hmac::Context::with_key(&self.hmac);
        ctx.update(role.label());
        ctx.update(transcript);
        let tag = ctx.sign();
        let mut out = [0u8; PROOF_LEN];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// Checks `role`'s proof over the transcript in constant time.
    pub fn verify(&self, role: Role, transcript: &[u8], proof: &[u8]) -> bool {
        let mut msg = Vec::with_capacity(role.label().len() + transcript.len());
        msg.extend_from_slice(role.label());
        msg.extend_from_slice(transcript);
        hmac::verify(&self.hmac, &msg, proof).is_ok()
    }

    /// The sealing and opening keys of one connection, seen from `me`.
    pub fn traffic(&self, me: Role, transcript: &[u8]) -> (Sealer, Opener) {
        let th = digest::digest(&digest::SHA256, transcript);
        let d2a = expand32(&self.prk, &[b"traffic ", b"dialer->acceptor", th.as_ref()]);
        let a2d = expand32(&self.prk, &[b"traffic ", b"acceptor->dialer", th.as_ref()]);
        let (tx, rx) = match me {
            Role::Dialer => (d2a, a2d),
            Role::Acceptor => (a2d, d2a),
        };
        (Sealer { key: aead_key(&tx), counter: 0 }, Opener { key: aead_key(&rx), counter: 0 })
    }
}

fn expand32(prk: &hkdf::Prk, info: &[&[u8]]) -> [u8; 32] {
    let mut out = [0u8; 32];
    // HKDF-SHA256 can expand up to 255 * 32 bytes; 32 never fails.
    if let Ok(okm) = prk.expand(info, HKDF_SHA256) {
        let _ = okm.fill(&mut out);
    }
    out
}

fn aead_key(bytes: &[u8; 32]) -> LessSafeKey {
    // A 32-byte key is what ChaCha20-Poly1305 takes; `new` only fails on
    // another length.
    #[allow(clippy::expect_used)]
    let key = UnboundKey::new(&CHACHA20_POLY1305, bytes).expect("32-byte ChaCha20-Poly1305 key");
    LessSafeKey::new(key)
}

/// Which end of the TCP connection a side is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Dialer,
    Acceptor,
}

impl Role {
    fn label(self) -> &'static [u8] {
        match self {
            Role::Dialer => b"dialer",
            Role::Acceptor => b"acceptor",
        }
    }
}

/// A fresh random value (incarnations, nonces).
pub fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    let _ = SystemRandom::new().fill(&mut b);
    u64::from_be_bytes(b)
}

/// One side's Hello.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    pub version: u8,
    pub incarnation: u64,
    pub nonce: [u8; 32],
    pub name: String,
}

/// Why a Hello was rejected.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HelloError {
    #[error("bad magic {0:02x?} (not an Egret peer channel)")]
    Magic([u8; 4]),
    #[error("protocol version {0}, this gateway speaks {VERSION}")]
    Version(u8),
    #[error("node name is not UTF-8")]
    Name,
    #[error("node name is empty or longer than 253 bytes")]
    NameLen,
}

impl Hello {
    /// A Hello with a fresh nonce.
    pub fn new(name: &str, incarnation: u64) -> Hello {
        let mut nonce = [0u8; 32];
        let _ = SystemRandom::new().fill(&mut nonce);
        Hello { version: VERSION, incarnation, nonce, name: name.to_owned() }
    }

    /// The wire form (see the module doc).
    pub fn encode(&self) -> Vec<u8> {
        let name = self.name.as_bytes();
        let mut out = Vec::with_capacity(HELLO_FIXED_LEN + name.len());
        out.extend_from_slice(MAGIC);
        out.push(self.version);
        out.extend_from_slice(&self.incarnation.to_be_bytes());
        out.extend_from_slice(&self.nonce);
        out.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        out.extend_from_slice(&name[..name.len().min(usize::from(u8::MAX))]);
        out
    }

    /// Parses the fixed part; returns the name's length still to read.
    pub fn parse_fixed(b: &[u8; HELLO_FIXED_LEN]) -> Result<(u8, u64, [u8; 32], usize), HelloError> {
        let mut magic = [0u8; 4];
        magic.copy_from_slice(&b[..4]);
        if &magic != MAGIC {
            return Err(HelloError::Magic(magic));
        }
        if b[4] != VERSION {
            return Err(HelloError::Version(b[4]));
        }
        let mut inc = [0u8; 8];
        inc.copy_from_slice(&b[5..13]);
        let mut nonce = [0u8; 32];
        nonce.copy_from_slice(&b[13..45]);
        let name_len = usize::from(b[45]);
        if name_len == 0 || name_len > 253 {
            return Err(HelloError::NameLen);
        }
        Ok((b[4], u64::from_be_bytes(inc), nonce, name_len))
    }

    /// Completes a Hello from its fixed part and name bytes.
    pub fn finish(fixed: (u8, u64, [u8; 32], usize), name: &[u8]) -> Result<Hello, HelloError> {
        let name = std::str::from_utf8(name).map_err(|_| HelloError::Name)?;
        Ok(Hello { version: fixed.0, incarnation: fixed.1, nonce: fixed.2, name: name.to_owned() })
    }
}

/// Seals the frames of one direction.
pub struct Sealer {
    key: LessSafeKey,
    counter: u64,
}

impl fmt::Debug for Sealer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sealer").field("counter", &self.counter).finish_non_exhaustive()
    }
}

impl Sealer {
    /// Appends `len u32 BE | sealed(body) | tag` to `out`.
    pub fn seal(&mut self, body: &[u8], out: &mut Vec<u8>) {
        let len = u32::try_from(body.len() + TAG_LEN).unwrap_or(u32::MAX);
        let header = len.to_be_bytes();
        out.extend_from_slice(&header);
        let start = out.len();
        out.extend_from_slice(body);
        let nonce = counter_nonce(self.counter);
        self.counter += 1;
        // Sealing in place only fails when the message exceeds ChaCha20's
        // 256 GiB limit; frames are at most a few MiB.
        if let Ok(tag) = self.key.seal_in_place_separate_tag(nonce, Aad::from(header), &mut out[start..]) {
            out.extend_from_slice(tag.as_ref());
        }
    }
}

/// A frame that did not open: altered, replayed, reordered or under another key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("frame {counter} failed authentication (altered, replayed, out of order or another key)")]
pub struct OpenError {
    pub counter: u64,
}

/// Opens the frames of one direction.
pub struct Opener {
    key: LessSafeKey,
    counter: u64,
}

impl fmt::Debug for Opener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Opener").field("counter", &self.counter).finish_non_exhaustive()
    }
}

impl Opener {
    /// Opens `sealed` (body and tag) whose header carried `len`; returns the body.
    pub fn open<'a>(&mut self, len: u32, sealed: &'a mut [u8]) -> Result<&'a [u8], OpenError> {
        let counter = self.counter;
        let nonce = counter_nonce(counter);
        let body =
            self.key.open_in_place(nonce, Aad::from(len.to_be_bytes()), sealed).map_err(|_| OpenError { counter })?;
        self.counter += 1;
        Ok(body)
    }
}

fn counter_nonce(counter: u64) -> Nonce {
    let mut n = [0u8; aead::NONCE_LEN];
    n[4..].copy_from_slice(&counter.to_be_bytes());
    Nonce::assume_unique_for_key(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: u8) -> SharedKey {
        SharedKey::from_bytes(Path::new("/test/key"), &[b; 32]).unwrap()
    }

    #[test]
    fn short_key_is_refused_naming_path_and_length() {
        let err = SharedKey::from_bytes(Path::new("/etc/egret/peer.key"), &[7; 31]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/etc/egret/peer.key") && msg.contains("31 bytes"), "{msg}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k");
        std::fs::write(&p, b"short\n").unwrap();
        assert!(matches!(SharedKey::from_file(&p), Err(KeyError::TooShort { len: 6, .. })));
        assert!(matches!(SharedKey::from_file(&dir.path().join("none")), Err(KeyError::Read { .. })));
    }

    #[test]
    fn proofs_bind_role_transcript_and_key() {
        let (k, other) = (key(1), key(2));
        let t = b"transcript";
        let p = k.proof(Role::Dialer, t);
        assert!(k.verify(Role::Dialer, t, &p));
        assert!(!k.verify(Role::Acceptor, t, &p), "a reflected proof must not pass");
        assert!(!k.verify(Role::Dialer, b"transcripT", &p));
        assert!(!other.verify(Role::Dialer, t, &p));
        assert_ne!(k.tcp_md5_key(), other.tcp_md5_key());
    }

    #[test]
    fn a_key_id_names_the_secret_not_the_file() {
        let a = SharedKey::from_bytes(Path::new("/a"), &[1; 32]).unwrap();
        let same = SharedKey::from_bytes(Path::new("/b"), &[1; 32]).unwrap();
        assert_eq!(a.id(), same.id());
        assert_ne!(a.id(), key(2).id());
        assert_eq!(a.id().to_string().len(), 8);
        // The id is none of the keys' bytes.
        assert_ne!(a.id().0[..], a.tcp_md5_key()[..4]);
    }

    #[test]
    fn frames_open_in_order_only() {
        let k = key(3);
        let (mut d_tx, _) = k.traffic(Role::Dialer, b"t1");
        let (_, mut a_rx) = k.traffic(Role::Acceptor, b"t1");
        let mut wire = Vec::new();
        d_tx.seal(b"first", &mut wire);
        let first = wire.clone();
        wire.clear();
        d_tx.seal(b"second", &mut wire);
        let second = wire;
        let open = |rx: &mut Opener, w: &[u8]| {
            let len = u32::from_be_bytes([w[0], w[1], w[2], w[3]]);
            let mut body = w[4..].to_vec();
            rx.open(len, &mut body).map(<[u8]>::to_vec)
        };
        // Out of order: the second frame under counter 0 fails.
        assert_eq!(open(&mut a_rx, &second), Err(OpenError { counter: 0 }));
        assert_eq!(open(&mut a_rx, &first).unwrap(), b"first");
        // Replay of the first under counter 1 fails.
        assert!(open(&mut a_rx, &first).is_err());
        assert_eq!(open(&mut a_rx, &second).unwrap(), b"second");
        // Another transcript, other keys.
        let (_, mut other_rx) = k.traffic(Role::Acceptor, b"t2");
        assert!(open(&mut other_rx, &first).is_err());
    }

    #[test]
    fn hello_round_trips_and_rejects_garbage() {
        let h = Hello::new("gw-a", 42);
        let w = h.encode();
        let mut fixed = [0u8; HELLO_FIXED_LEN];
        fixed.copy_from_slice(&w[..HELLO_FIXED_LEN]);
        let f = Hello::parse_fixed(&fixed).unwrap();
        assert_eq!(f.3, 4);
        assert_eq!(Hello::finish(f, &w[HELLO_FIXED_LEN..]).unwrap(), h);
        let mut bad = fixed;
        bad[0] = b'X';
        assert!(matches!(Hello::parse_fixed(&bad), Err(HelloError::Magic(_))));
        let mut bad = fixed;
        bad[4] = 9;
        assert_eq!(Hello::parse_fixed(&bad), Err(HelloError::Version(9)));
        let mut bad = fixed;
        bad[45] = 0;
        assert_eq!(Hello::parse_fixed(&bad), Err(HelloError::NameLen));
    }
}
