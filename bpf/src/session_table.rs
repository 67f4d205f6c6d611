//! The writer of the fast path's session tables, `fp_sessions_v4` and
//! `fp_sessions_v6` (`src/bpf/egret_maps.h`,
//! docs/adr/0006-fast-path-session-table.md).
//!
//! Each table is a `BPF_MAP_TYPE_ARRAY` of slots that the daemon maps into
//! its memory. A slot holds one session direction, key and entry together,
//! so the program's lookup touches one cache line (two for IPv6) instead of
//! a hash map's bucket and element. The layout, in 64-bit words:
//!
//! ```text
//!  word 0        seq (u32) | live (u32)   seq is odd while the slot is rewritten
//!  words 1..     key  (fp_key_v4: 2 words, fp_key_v6: 5)
//!  then          entry (fp_entry_v4: 4 words, fp_entry_v6: 7; last_seen_ns is its last word)
//!  then          tcp_seen (1 word, written by the program only; see [`SessionTable::tcp_seen`])
//!  then          padding to 8 / 16 words
//! ```
//!
//! Open addressing with linear probing: a key's home slot is
//! [`hash`]`(seed, key) & mask`, and it lives at most [`PROBES`] - 1 slots
//! further on, with no empty slot in between (the program stops at the
//! first empty slot). Deletion shifts later keys of the run back
//! (backward-shift deletion), so no tombstones build up. A key the table
//! cannot place (capacity reached, or no free slot within [`PROBES`]) is
//! refused: the session simply stays in userspace.
//!
//! Only this writer changes slots, one table behind one lock. Each change is
//! a sequence-count write: seq made odd, the words written, seq made even
//! with release ordering. The program copies the entry between two reads of
//! seq and treats a changed or odd seq as a miss, so it never translates with
//! a torn entry. While a key moves during a backward shift it is briefly in
//! two slots (the same translation) or, for a reader that probed past it,
//! in none: a miss, which the engine handles. The program's only writes are
//! the entry's `last_seen_ns` word and the `tcp_seen` word after the entry,
//! which the writer never writes: it carries a tag of the slot's seq instead
//! (see [`SessionTable::tcp_seen`]).

use std::collections::HashMap;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// How far past its home slot a key may live (C `EGRET_FP_PROBES`).
pub const PROBES: u32 = 16;

/// The multiplier of [`hash`] (C `EGRET_FP_HASH_MUL`).
const HASH_MUL: u64 = 0x9e37_79b9_7f4a_7c15;

/// Slots per configured session and family: two directions, and the table
/// at most half full, where linear probing stays short.
pub const SLOTS_PER_SESSION: u32 = 4;

/// The smallest table: one page of IPv4 slots (an mmap is whole pages).
pub const MIN_SLOTS: u32 = 64;

/// The table's slot count for `sessions` configured sessions (a power of
/// two), or `None` when it would not fit in a `u32`.
pub fn slots_for(sessions: u32) -> Option<u32> {
    sessions.checked_mul(SLOTS_PER_SESSION)?.max(MIN_SLOTS).checked_next_power_of_two()
}

/// One mixing step of [`hash`] (C `fp_mix`).
fn mix(h: u64, w: u64) -> u64 {
    let h = (h ^ w).wrapping_mul(HASH_MUL);
    h ^ (h >> 32)
}

/// The program's `fp_hash`: the key's native-endian 64-bit words, each
/// mixed into the seed. The slot is the low bits.
pub fn hash(seed: u64, key: &[u8]) -> u64 {
    let mut words = [0u64; MAX_KEY_WORDS];
    let n = key.len() / 8;
    words_of(key, &mut words[..n]);
    hash_words(seed, &words[..n])
}

/// [`hash`] of a key already read as words.
fn hash_words(seed: u64, words: &[u64]) -> u64 {
    words.iter().fold(seed, |h, w| mix(h, *w))
}

/// The shape of one family's slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotShape {
    /// Words of the key.
    pub key_words: usize,
    /// Words of the entry; its last word is `last_seen_ns`.
    pub entry_words: usize,
    /// Words of the whole slot (a whole number of cache lines).
    pub slot_words: usize,
}

/// `struct fp_slot_v4`: 16-byte key, 32-byte entry, 64-byte slot.
pub const SHAPE_V4: SlotShape = SlotShape { key_words: 2, entry_words: 4, slot_words: 8 };
/// `struct fp_slot_v6`: 40-byte key, 56-byte entry, 128-byte slot.
pub const SHAPE_V6: SlotShape = SlotShape { key_words: 5, entry_words: 7, slot_words: 16 };

/// The largest key, in words (IPv6).
const MAX_KEY_WORDS: usize = 5;

type KeyWords = [u64; MAX_KEY_WORDS];

fn word0(seq: u32, live: bool) -> u64 {
    let mut b = [0u8; 8];
    b[..4].copy_from_slice(&seq.to_ne_bytes());
    b[4..].copy_from_slice(&u32::from(live).to_ne_bytes());
    u64::from_ne_bytes(b)
}

fn seq_live(w: u64) -> (u32, bool) {
    let b = w.to_ne_bytes();
    (u32::from_ne_bytes([b[0], b[1], b[2], b[3]]), u32::from_ne_bytes([b[4], b[5], b[6], b[7]]) != 0)
}

fn words_of(bytes: &[u8], out: &mut [u64]) {
    for (w, chunk) in out.iter_mut().zip(bytes.chunks_exact(8)) {
        let mut b = [0u8; 8];
        b.copy_from_slice(chunk);
        *w = u64::from_ne_bytes(b);
    }
}

/// Why an insertion was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// The table holds its configured number of session directions.
    Capacity,
    /// Every slot within [`PROBES`] of the key's home is taken.
    Probes,
}

/// One family's table over its slot memory `M` (the mapped map, or plain
/// memory in tests).
#[derive(Debug)]
pub struct SessionTable<M> {
    mem: M,
    shape: SlotShape,
    mask: u32,
    seed: u64,
    capacity: usize,
    index: HashMap<KeyWords, u32>,
}

impl<M: AsRef<[AtomicU64]>> SessionTable<M> {
    /// A table over `mem` (`slots` slots of `shape`, a power of two, all
    /// empty), holding at most `capacity` keys, hashing with `seed`.
    ///
    /// # Panics
    /// If `mem` is not exactly `slots` slots or `slots` is not a power of two:
    /// the loader sizes both from one value.
    pub fn new(mem: M, shape: SlotShape, slots: u32, capacity: usize, seed: u64) -> Self {
        assert!(slots.is_power_of_two(), "slots must be a power of two");
        assert_eq!(mem.as_ref().len(), slots as usize * shape.slot_words, "slot memory size");
        Self { mem, shape, mask: slots - 1, seed, capacity, index: HashMap::new() }
    }

    /// `slots - 1`, the program's `fp_config.mask_*`.
    pub fn mask(&self) -> u32 {
        self.mask
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    fn slot(&self, at: u32) -> &[AtomicU64] {
        let w = self.shape.slot_words;
        &self.mem.as_ref()[at as usize * w..][..w]
    }

    fn key_words(&self, key: &[u8]) -> KeyWords {
        let mut k = [0u64; MAX_KEY_WORDS];
        words_of(key, &mut k[..self.shape.key_words]);
        k
    }

    fn home(&self, key: &KeyWords) -> u32 {
        (hash_words(self.seed, &key[..self.shape.key_words]) as u32) & self.mask
    }

    fn live(&self, at: u32) -> bool {
        seq_live(self.slot(at)[0].load(Ordering::Relaxed)).1
    }

    /// Rewrites slot `at` under its sequence count: `payload` (key then
    /// entry words) when given, and the live flag.
    fn publish(&self, at: u32, live: bool, payload: Option<&[u64]>) {
        let slot = self.slot(at);
        let (seq, was_live) = seq_live(slot[0].load(Ordering::Relaxed));
        slot[0].store(word0(seq.wrapping_add(1), was_live), Ordering::Relaxed);
        fence(Ordering::Release);
        if let Some(words) = payload {
            for (dst, w) in slot[1..].iter().zip(words) {
                dst.store(*w, Ordering::Relaxed);
            }
        }
        slot[0].store(word0(seq.wrapping_add(2), live), Ordering::Release);
    }

    /// Installs `entry` under `key` (exactly the shape's bytes), replacing
    /// the entry of a key already held.
    pub fn insert(&mut self, key: &[u8], entry: &[u8]) -> Result<(), Refused> {
        let k = self.key_words(key);
        let mut payload = [0u64; MAX_KEY_WORDS + 8];
        let kw = self.shape.key_words;
        payload[..kw].copy_from_slice(&k[..kw]);
        words_of(entry, &mut payload[kw..kw + self.shape.entry_words]);
        let payload = &payload[..kw + self.shape.entry_words];
        if let Some(&at) = self.index.get(&k) {
            self.publish(at, true, Some(payload));
            return Ok(());
        }
        if self.index.len() >= self.capacity {
            return Err(Refused::Capacity);
        }
        let home = self.home(&k);
        let free = (0..PROBES).map(|d| home.wrapping_add(d) & self.mask).find(|&at| !self.live(at));
        let at = free.ok_or(Refused::Probes)?;
        self.publish(at, true, Some(payload));
        self.index.insert(k, at);
        Ok(())
    }

    /// Removes `key`; whether it was held. Later keys of the run whose home
    /// is at or before the freed slot move back into it, one at a time.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        let Some(mut hole) = self.index.remove(&self.key_words(key)) else { return false };
        self.publish(hole, false, None);
        let mut d = 1;
        while d < PROBES {
            let j = hole.wrapping_add(d) & self.mask;
            if !self.live(j) {
                break;
            }
            let payload = self.payload(j);
            let mut k = [0u64; MAX_KEY_WORDS];
            k[..self.shape.key_words].copy_from_slice(&payload[..self.shape.key_words]);
            let home = self.home(&k);
            let displacement = j.wrapping_sub(home) & self.mask;
            let to_hole = hole.wrapping_sub(home) & self.mask;
            if to_hole < displacement {
                // The key may live in the hole: copy it there, then free j.
                self.publish(hole, true, Some(&payload[..self.shape.key_words + self.shape.entry_words]));
                self.index.insert(k, hole);
                self.publish(j, false, None);
                hole = j;
                d = 1;
            } else {
                d += 1;
            }
        }
        true
    }

    /// The key and entry words of slot `at`, as they are now.
    fn payload(&self, at: u32) -> [u64; MAX_KEY_WORDS + 8] {
        let mut out = [0u64; MAX_KEY_WORDS + 8];
        let n = self.shape.key_words + self.shape.entry_words;
        for (o, w) in out[..n].iter_mut().zip(&self.slot(at)[1..]) {
            *o = w.load(Ordering::Relaxed);
        }
        out
    }

    /// The entry bytes held under `key`, with the program's latest stamp.
    pub fn get(&self, key: &[u8], out: &mut [u8]) -> bool {
        let Some(&at) = self.index.get(&self.key_words(key)) else { return false };
        let payload = self.payload(at);
        let entry = &payload[self.shape.key_words..self.shape.key_words + self.shape.entry_words];
        for (chunk, w) in out.chunks_exact_mut(8).zip(entry) {
            chunk.copy_from_slice(&w.to_ne_bytes());
        }
        true
    }

    /// The acknowledgment number and raw window of the latest TCP segment
    /// with ACK set that the program translated under `key` since the key's
    /// slot was last written (C `fp_record_tcp`, `fp_slot_v4.tcp_seen`).
    ///
    /// The word is trusted only when its tag, `(seq & 0xffff) | 1` of the
    /// seq the program found the slot under, matches the slot's seq now: a
    /// word the program wrote for the slot's previous tenant, or before the
    /// entry was rewritten or moved by a backward shift, is ignored (`None`;
    /// the engine then uses its own, older record). One 8-byte load of a
    /// word the program writes with one 8-byte store: never torn.
    pub fn tcp_seen(&self, key: &[u8]) -> Option<(u32, u16)> {
        let &at = self.index.get(&self.key_words(key))?;
        let slot = self.slot(at);
        let (seq, live) = seq_live(slot[0].load(Ordering::Acquire));
        let w = slot[1 + self.shape.key_words + self.shape.entry_words].load(Ordering::Acquire);
        let tag = (w >> 48) as u16;
        (live && seq & 1 == 0 && tag == ((seq as u16) | 1)).then_some((w as u32, (w >> 32) as u16))
    }

    /// Empties the table; returns how many keys it held.
    pub fn clear(&mut self) -> usize {
        let slots: Vec<u32> = self.index.drain().map(|(_, at)| at).collect();
        for at in &slots {
            self.publish(*at, false, None);
        }
        slots.len()
    }

    /// The program's lookup, in Rust: the slot holding `key`, probing from
    /// its home and stopping at the first empty slot (for tests of the
    /// table's invariant).
    pub fn probe(&self, key: &[u8]) -> Option<u32> {
        let k = self.key_words(key);
        let home = self.home(&k);
        for d in 0..PROBES {
            let at = home.wrapping_add(d) & self.mask;
            if !self.live(at) {
                return None;
            }
            if self.payload(at)[..self.shape.key_words] == k[..self.shape.key_words] {
                return Some(at);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(slots: u32, capacity: usize, seed: u64) -> SessionTable<Vec<AtomicU64>> {
        let mem = (0..slots as usize * SHAPE_V4.slot_words).map(|_| AtomicU64::new(0)).collect();
        SessionTable::new(mem, SHAPE_V4, slots, capacity, seed)
    }

    fn key(n: u32) -> [u8; 16] {
        let mut k = [0u8; 16];
        k[..4].copy_from_slice(&n.to_be_bytes());
        k[12] = 17;
        k
    }

    fn entry(n: u32) -> [u8; 32] {
        let mut e = [0u8; 32];
        e[..4].copy_from_slice(&n.to_ne_bytes());
        e
    }

    /// Every key held is where the program would find it, and nothing else is.
    fn check(t: &SessionTable<Vec<AtomicU64>>, held: &std::collections::BTreeSet<u32>, universe: u32) {
        for n in 0..universe {
            let found = t.probe(&key(n));
            assert_eq!(found.is_some(), held.contains(&n), "key {n}");
            if let Some(at) = found {
                assert_eq!(t.index.get(&t.key_words(&key(n))), Some(&at), "index of key {n}");
                let mut out = [0u8; 32];
                assert!(t.get(&key(n), &mut out));
                assert_eq!(out, entry(n));
            }
        }
        let live = (0..=t.mask).filter(|&at| t.live(at)).count();
        assert_eq!(live, held.len(), "live slots");
        assert_eq!(t.len(), held.len());
    }

    #[test]
    fn the_hash_reads_native_words_and_differs_by_seed() {
        let k = key(7);
        let w0 = u64::from_ne_bytes([k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7]]);
        let w1 = u64::from_ne_bytes([k[8], k[9], k[10], k[11], k[12], k[13], k[14], k[15]]);
        assert_eq!(hash(3, &k), mix(mix(3, w0), w1));
        assert_ne!(hash(3, &k), hash(4, &k));
        // Known values, computed apart from this code (little-endian
        // words): they pin the function the C side implements.
        #[cfg(target_endian = "little")]
        assert_eq!(hash(3, &k), 0x7ba5_d01a_8ccb_505c);
        assert_eq!(mix(0, 1), 0x9e37_79b9_e17d_05ac);
    }

    #[test]
    fn slots_are_four_per_session_in_powers_of_two() {
        assert_eq!(slots_for(1), Some(64));
        assert_eq!(slots_for(262_144), Some(1 << 20));
        assert_eq!(slots_for(100_000), Some(1 << 19));
        assert_eq!(slots_for(u32::MAX / 2), None);
    }

    #[test]
    fn random_inserts_and_removals_keep_every_key_findable() {
        // A small table at half load with a fixed seed: long runs, many
        // backward shifts. Deterministic xorshift, no external randomness.
        let mut t = table(64, 32, 0x5eed);
        let mut held = std::collections::BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..4000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 48) as u32;
            if held.contains(&n) {
                assert!(t.remove(&key(n)));
                held.remove(&n);
            } else {
                match t.insert(&key(n), &entry(n)) {
                    Ok(()) => {
                        held.insert(n);
                    }
                    Err(Refused::Capacity) => assert_eq!(held.len(), 32),
                    Err(Refused::Probes) => {}
                }
            }
            check(&t, &held, 48);
        }
    }

    #[test]
    fn capacity_and_probe_limits_refuse_and_replacing_keeps_one_slot() {
        let mut t = table(64, 3, 1);
        for n in 0..3 {
            t.insert(&key(n), &entry(n)).unwrap();
        }
        assert_eq!(t.insert(&key(9), &entry(9)), Err(Refused::Capacity));
        t.insert(&key(1), &entry(1)).unwrap();
        assert_eq!(t.len(), 3);

        // Fill every slot within PROBES of one key's home: the next key with
        // that home is refused.
        let mut t = table(64, 64, 1);
        let home = t.home(&t.key_words(&key(0)));
        let same_home: Vec<u32> = (0..100_000).filter(|&n| t.home(&t.key_words(&key(n))) == home).take(17).collect();
        assert_eq!(same_home.len(), 17);
        for &n in &same_home[..16] {
            t.insert(&key(n), &entry(n)).unwrap();
        }
        assert_eq!(t.insert(&key(same_home[16]), &entry(0)), Err(Refused::Probes));
        // Removing the first moves the rest back; the refused one now fits.
        assert!(t.remove(&key(same_home[0])));
        t.insert(&key(same_home[16]), &entry(same_home[16])).unwrap();
        let held: std::collections::BTreeSet<u32> = same_home[1..].iter().copied().collect();
        for n in &held {
            assert!(t.probe(&key(*n)).is_some());
        }
        assert_eq!(t.clear(), 16);
        assert!(t.is_empty());
        assert!((0..64).all(|at| !t.live(at)));
    }

    /// The program's TCP record is read only under the seq it was tagged
    /// with: a rewrite of the slot (another tenant, a replaced entry)
    /// invalidates it.
    #[test]
    fn the_tcp_record_counts_only_under_its_tag() {
        let mut t = table(64, 8, 2);
        t.insert(&key(1), &entry(1)).unwrap();
        let at = t.probe(&key(1)).unwrap();
        let word = |seq: u32, ack: u32, win: u16| {
            u64::from(ack) | (u64::from(win) << 32) | (u64::from((seq as u16) | 1) << 48)
        };
        let tcp_at = 1 + SHAPE_V4.key_words + SHAPE_V4.entry_words;
        assert_eq!(t.tcp_seen(&key(1)), None, "nothing recorded yet");
        t.slot(at)[tcp_at].store(word(2, 0xdead_beef, 0x1234), Ordering::Relaxed);
        assert_eq!(t.tcp_seen(&key(1)), Some((0xdead_beef, 0x1234)));
        t.insert(&key(1), &entry(7)).unwrap();
        assert_eq!(t.tcp_seen(&key(1)), None, "written before the entry was rewritten");
        t.slot(at)[tcp_at].store(word(4, 7, 8), Ordering::Relaxed);
        assert_eq!(t.tcp_seen(&key(1)), Some((7, 8)));
        // The slot's next tenant (a key with the same home) inherits the
        // word but not its tag.
        let home = t.home(&t.key_words(&key(1)));
        let other = (2..100_000).find(|&n| t.home(&t.key_words(&key(n))) == home).unwrap();
        assert!(t.remove(&key(1)));
        t.insert(&key(other), &entry(other)).unwrap();
        assert_eq!(t.probe(&key(other)), Some(at));
        assert_eq!(t.tcp_seen(&key(other)), None, "another tenant's word");
    }

    #[test]
    fn every_write_leaves_an_even_sequence_count_that_moved() {
        let mut t = table(64, 8, 2);
        t.insert(&key(1), &entry(1)).unwrap();
        let at = t.probe(&key(1)).unwrap();
        let (seq, live) = seq_live(t.slot(at)[0].load(Ordering::Relaxed));
        assert_eq!((seq, live), (2, true));
        t.insert(&key(1), &entry(5)).unwrap();
        assert_eq!(seq_live(t.slot(at)[0].load(Ordering::Relaxed)), (4, true));
        assert!(t.remove(&key(1)));
        assert_eq!(seq_live(t.slot(at)[0].load(Ordering::Relaxed)), (6, false));
    }
}
