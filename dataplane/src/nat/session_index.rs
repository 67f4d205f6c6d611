//! The session table's index: which slot each flow key leads to.
//!
//! Every session has two keys (outbound and inbound, nat/key.rs), and a
//! packet from either side finds its slot through this index. It replaced a
//! `dashmap` of `FlowKey -> SessionRef` (ADR 0040): a key lives in its slot
//! already, so the index need not hold it. An entry is eight bytes, the
//! key's 32-bit hash tag and the [`SessionRef`]; a lookup reads the one
//! line of the key's bucket and then the slot a tag-matching entry names,
//! which [`SessionTable`](super::session::SessionTable) checks as it checks
//! a worker's flow cache's answer (live, and deriving this very key).
//!
//! - **Layout.** Buckets of seven entries and an overflow count, one
//!   64-byte line each, in 2 MiB pages made on first use (on huge pages
//!   where the kernel gives them, as the slots are: ADR 0038). The number
//!   of buckets is fixed by the table's capacity: two keys a session at
//!   most 80 % of the entries, so a full table still finds nearly every
//!   key in its first bucket and never grows or rehashes under a worker.
//! - **Probing.** A key's home bucket comes from the hash's low word (a
//!   multiply, not a mask: any number of buckets), the tag from its high
//!   word. A full bucket sends a key on to the next (linear probing), and
//!   counts it in its overflow count (F14's scheme, folly/container/F14.md):
//!   a lookup stops at the first bucket whose count is zero, and a removal
//!   walks the same way down, so an emptied entry needs no tombstone.
//! - **Concurrency.** Lookups take no lock: entries are single atomic
//!   words, and a reader that races a writer sees the entry before or after,
//!   either of which the slot check judges. Inserts and removals lock one of
//!   [`STRIPES`] mutexes chosen by the key's home bucket, so two inserts of
//!   one key are one after the other (the uniqueness an inbound key's port
//!   claim and two workers' first packets of one flow need); an empty entry
//!   two keys of different stripes both want is claimed by compare-and-swap.
//!
//! Memory: 9.1 bytes per entry slot (64 / 7), 25.6 bytes per session of
//! capacity at the 80 % fill, paid for the capacity once a family's first
//! session is made (a family no flow uses keeps no page).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use super::key::{FlowKey, NatAddr};
use super::session::SessionRef;
use crate::huge_pages::HugeSlice;
use crate::spin_lock::SpinMutex;

/// Entries per bucket: seven, and the bucket's overflow count, fill a line.
const PER_BUCKET: usize = 7;

/// Locks for inserts and removals, chosen by a key's home bucket: enough
/// that workers and the sweeper rarely meet on one.
pub const STRIPES: usize = 1024;

/// One line of the index.
#[derive(Debug, Default)]
#[repr(C, align(64))]
struct Bucket {
    /// `tag << 32 | ref`, zero when empty (a tag is never zero).
    entries: [AtomicU64; PER_BUCKET],
    /// Keys whose home bucket is at or before this one and that lie after
    /// it (they found it full on their way).
    overflow: AtomicU64,
}

type Page = OnceLock<HugeSlice<Bucket>>;

/// Buckets per page: 32,768 (one 2 MiB page).
const PER_PAGE: usize = HugeSlice::<Bucket>::PER_PAGE;

/// Why an insert did not add its entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The key is there already, leading to this ref.
    Exists(SessionRef),
    /// No empty entry anywhere (or no memory for a page).
    Full,
}

/// Where a key is looked for: its home bucket and the tag its entries hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    home: usize,
    tag: u64,
}

/// A key-less, fixed-size concurrent hash index of session refs (module doc).
#[derive(Debug)]
pub struct SessionIndex {
    pages: Box<[Page]>,
    buckets: usize,
    stripes: Box<[SpinMutex<()>]>,
    hasher: ahash::RandomState,
}

impl SessionIndex {
    /// An index with room for the two keys of `sessions` sessions at 80 %
    /// of its entries (at least one page).
    pub fn new(sessions: usize) -> Self {
        let entries = sessions.saturating_mul(2).saturating_mul(5) / 4;
        let pages = entries.div_ceil(PER_BUCKET).div_ceil(PER_PAGE).max(1);
        SessionIndex {
            pages: (0..pages).map(|_| OnceLock::new()).collect(),
            buckets: pages * PER_PAGE,
            stripes: (0..STRIPES).map(|_| SpinMutex::new(())).collect(),
            hasher: ahash::RandomState::new(),
        }
    }

    /// Where `key` lives.
    #[inline]
    pub fn place<A: NatAddr>(&self, key: &FlowKey<A>) -> Place {
        let h = self.hasher.hash_one(key);
        let home = ((h & 0xffff_ffff) * self.buckets as u64) >> 32;
        Place { home: home as usize, tag: (h | 1 << 32) >> 32 << 32 }
    }

    /// Keys held, counted entry by entry (for tests and listings: no
    /// counter is kept, which every insert would write from every worker).
    pub fn len(&self) -> usize {
        let pages = self.pages.iter().filter_map(OnceLock::get);
        let entries = pages.flat_map(|p| p.iter()).flat_map(|b| b.entries.iter());
        entries.filter(|e| e.load(Ordering::Relaxed) != 0).count()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pages the index has room for (each 2 MiB once made).
    pub fn pages(&self) -> usize {
        self.pages.len()
    }

    /// Pages made so far (each 2 MiB).
    pub fn pages_made(&self) -> usize {
        self.pages.iter().filter(|p| p.get().is_some()).count()
    }

    /// Makes every page not made yet (off the workers: a page is 2 MiB
    /// written, and a new table's first keys land in every page at once).
    pub fn make_pages(&self) {
        for p in self.pages.iter() {
            p.get_or_init(|| HugeSlice::page(|_| Bucket::default()));
        }
    }

    #[inline(always)]
    fn bucket(&self, i: usize) -> Option<&Bucket> {
        self.pages.get(i / PER_PAGE)?.get()?.get(i % PER_PAGE)
    }

    fn bucket_made(&self, i: usize) -> Option<&Bucket> {
        let page = self.pages.get(i / PER_PAGE)?;
        page.get_or_init(|| HugeSlice::page(|_| Bucket::default())).get(i % PER_PAGE)
    }

    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.buckets {
            0
        } else {
            i + 1
        }
    }

    /// Asks for the line of `place`'s home bucket.
    #[inline]
    pub fn prefetch(&self, place: Place) {
        if let Some(b) = self.bucket(place.home) {
            crate::prefetch::read(b);
        }
    }

    /// The first ref at `place` that `matches` accepts (the caller checks
    /// the slot: the index holds no key). Lock-free.
    #[inline]
    pub fn find(&self, place: Place, mut matches: impl FnMut(SessionRef) -> bool) -> Option<SessionRef> {
        let mut i = place.home;
        for _ in 0..self.buckets {
            let b = self.bucket(i)?;
            for e in &b.entries {
                let v = e.load(Ordering::Acquire);
                if v & !0xffff_ffff == place.tag {
                    let r = SessionRef::from_bits(v as u32);
                    if matches(r) {
                        return Some(r);
                    }
                }
            }
            if b.overflow.load(Ordering::Acquire) == 0 {
                return None;
            }
            i = self.next(i);
        }
        None
    }

    /// Adds `r` at `place` unless a ref there that `matches` accepts is
    /// the key's already: then that ref. Inserts of one key are serialised
    /// by its stripe's lock; `matches` is asked under it.
    ///
    /// One walk down the key's buckets, as [`Self::find`] walks them, both
    /// looks for the key and notes the first empty entry it passes, which
    /// is where the key goes (the first empty entry from its home, as the
    /// overflow counts assume). Only when another stripe's insert claimed
    /// that entry in between, every bucket walked was full, or the walk
    /// reached a page not made yet, does a second walk look further.
    #[inline]
    pub fn insert(
        &self,
        place: Place,
        r: SessionRef,
        mut matches: impl FnMut(SessionRef) -> bool,
    ) -> Result<(), Refused> {
        let _stripe = self.stripes[place.home % STRIPES].lock();
        let entry = place.tag | u64::from(r.bits());
        let mut free = None;
        let mut i = place.home;
        for walked in 0..self.buckets {
            let Some(b) = self.bucket(i) else { break };
            for e in &b.entries {
                let v = e.load(Ordering::Acquire);
                if v == 0 {
                    free = free.or(Some((e, walked)));
                } else if v & !0xffff_ffff == place.tag && matches(SessionRef::from_bits(v as u32)) {
                    return Err(Refused::Exists(SessionRef::from_bits(v as u32)));
                }
            }
            if b.overflow.load(Ordering::Acquire) == 0 {
                break;
            }
            i = self.next(i);
        }
        if let Some((e, walked)) = free {
            if e.compare_exchange(0, entry, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
                self.count_overflow(place.home, walked, true);
                return Ok(());
            }
        }
        self.claim_first_free(place.home, entry)
    }

    /// Puts `entry` in the first empty entry from bucket `home` on, making
    /// pages as it goes (the caller holds `home`'s stripe).
    fn claim_first_free(&self, home: usize, entry: u64) -> Result<(), Refused> {
        let mut i = home;
        for walked in 0..self.buckets {
            let b = self.bucket_made(i).ok_or(Refused::Full)?;
            for e in &b.entries {
                if e.load(Ordering::Relaxed) == 0
                    && e.compare_exchange(0, entry, Ordering::AcqRel, Ordering::Relaxed).is_ok()
                {
                    self.count_overflow(home, walked, true);
                    return Ok(());
                }
            }
            i = self.next(i);
        }
        Err(Refused::Full)
    }

    /// Removes the entry `r` at `place`; returns whether it was there.
    pub fn remove(&self, place: Place, r: SessionRef) -> bool {
        let _stripe = self.stripes[place.home % STRIPES].lock();
        let entry = place.tag | u64::from(r.bits());
        let mut i = place.home;
        for walked in 0..self.buckets {
            let Some(b) = self.bucket(i) else { return false };
            for e in &b.entries {
                // Only this stripe's holder removes this key's entries.
                if e.load(Ordering::Relaxed) == entry {
                    e.store(0, Ordering::Release);
                    self.count_overflow(place.home, walked, false);
                    return true;
                }
            }
            if b.overflow.load(Ordering::Acquire) == 0 {
                return false;
            }
            i = self.next(i);
        }
        false
    }

    /// Counts a key placed `walked` buckets past `home` in the overflow of
    /// each bucket it passed (`add`), or uncounts it.
    fn count_overflow(&self, home: usize, walked: usize, add: bool) {
        let mut i = home;
        for _ in 0..walked {
            if let Some(b) = self.bucket(i) {
                if add {
                    b.overflow.fetch_add(1, Ordering::AcqRel);
                } else {
                    b.overflow.fetch_sub(1, Ordering::AcqRel);
                }
            }
            i = self.next(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::sync::Arc;

    use super::*;
    use crate::nat::key::proto;

    fn key(i: u32) -> FlowKey<Ipv4Addr> {
        FlowKey::new(Ipv4Addr::from(0xC612_0000 + i), Ipv4Addr::new(203, 0, 113, 7), 1024 + i as u16, 443, proto::TCP)
    }

    /// An index whose callers' slots are a vector: slot `i` holds key `i`.
    fn holds(i: u32) -> impl Fn(SessionRef) -> bool {
        move |r| r.index() == i
    }

    #[test]
    fn a_bucket_is_one_line_and_a_page_is_two_mib() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(PER_PAGE, 32_768);
        // The default 2^20 sessions: 12 pages, 24 MiB, 24 bytes a session.
        assert_eq!(SessionIndex::new(1 << 20).pages.len(), 12);
    }

    #[test]
    fn keys_are_found_removed_and_refused_twice() {
        let ix = SessionIndex::new(1000);
        for i in 0..1000 {
            assert_eq!(ix.insert(ix.place(&key(i)), SessionRef::new(i, false), holds(i)), Ok(()));
        }
        assert_eq!(ix.len(), 1000);
        for i in 0..1000 {
            assert_eq!(ix.find(ix.place(&key(i)), holds(i)), Some(SessionRef::new(i, false)), "key {i}");
            // A second insert of the key finds the first.
            assert_eq!(
                ix.insert(ix.place(&key(i)), SessionRef::new(i + 5000, false), holds(i)),
                Err(Refused::Exists(SessionRef::new(i, false)))
            );
        }
        for i in (0..1000).step_by(2) {
            assert!(ix.remove(ix.place(&key(i)), SessionRef::new(i, false)));
            assert!(!ix.remove(ix.place(&key(i)), SessionRef::new(i, false)), "removed once");
        }
        for i in 0..1000 {
            let found = ix.find(ix.place(&key(i)), holds(i));
            assert_eq!(found.is_some(), i % 2 == 1, "key {i}");
        }
        assert_eq!(ix.len(), 500);
    }

    #[test]
    fn keys_past_a_full_bucket_are_found_and_their_counts_undone() {
        // Every key in one home bucket: the overflow counts carry the
        // lookups over the full buckets and back to zero on removal.
        let ix = SessionIndex::new(10);
        let place = |i: u32| Place { home: 5, tag: (u64::from(i) + 1) << 32 };
        for i in 0..40 {
            assert_eq!(ix.insert(place(i), SessionRef::new(i, true), |_| false), Ok(()));
        }
        for i in 0..40 {
            assert_eq!(ix.find(place(i), |r| r.index() == i), Some(SessionRef::new(i, true)));
        }
        let counts = |ix: &SessionIndex| {
            (5..11).map(|b| ix.bucket(b).unwrap().overflow.load(Ordering::Relaxed)).collect::<Vec<_>>()
        };
        // 40 keys: 7 in each of buckets 5..=9 and 5 in bucket 10.
        assert_eq!(counts(&ix), vec![33, 26, 19, 12, 5, 0]);
        for i in 0..40 {
            assert!(ix.remove(place(i), SessionRef::new(i, true)));
        }
        assert_eq!(counts(&ix), vec![0; 6]);
        assert_eq!(ix.find(place(39), |_| true), None);
    }

    #[test]
    fn a_hole_is_refilled_and_keys_past_it_still_refuse_their_twin() {
        // Ten keys homed in bucket 5: seven fill it, three lie in bucket 6.
        // With one of the seven removed, the insert's walk passes an empty
        // entry before it reaches the three, and must still find each of
        // them; a new key takes the hole, the first empty entry from home.
        let ix = SessionIndex::new(10);
        let place = |i: u32| Place { home: 5, tag: (u64::from(i) + 1) << 32 };
        for i in 0..10 {
            assert_eq!(ix.insert(place(i), SessionRef::new(i, true), |_| false), Ok(()));
        }
        assert!(ix.remove(place(2), SessionRef::new(2, true)));
        for i in 7..10 {
            assert_eq!(
                ix.insert(place(i), SessionRef::new(100 + i, true), |r| r.index() == i),
                Err(Refused::Exists(SessionRef::new(i, true))),
                "key {i} past the hole"
            );
        }
        assert_eq!(ix.insert(place(20), SessionRef::new(20, true), |_| false), Ok(()));
        assert_eq!(
            ix.bucket(5).unwrap().entries[2].load(Ordering::Relaxed),
            place(20).tag | u64::from(SessionRef::new(20, true).bits())
        );
        assert_eq!(ix.bucket(5).unwrap().overflow.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn the_last_bucket_wraps_to_the_first() {
        let ix = SessionIndex::new(10);
        let last = ix.buckets - 1;
        let place = |i: u32| Place { home: last, tag: (u64::from(i) + 1) << 32 };
        for i in 0..10 {
            assert_eq!(ix.insert(place(i), SessionRef::new(i, false), |_| false), Ok(()));
        }
        assert_eq!(ix.find(place(9), |r| r.index() == 9), Some(SessionRef::new(9, false)));
        assert_eq!(ix.bucket(0).unwrap().entries[2].load(Ordering::Relaxed) >> 32, 10);
    }

    #[test]
    fn a_tag_that_differs_asks_nothing() {
        let ix = SessionIndex::new(10);
        let p = ix.place(&key(1));
        ix.insert(p, SessionRef::new(1, false), |_| false).unwrap();
        let other = Place { tag: p.tag ^ (1 << 40), ..p };
        let mut asked = 0;
        assert_eq!(
            ix.find(other, |_| {
                asked += 1;
                true
            }),
            None
        );
        assert_eq!(asked, 0);
    }

    #[test]
    fn an_unused_index_makes_no_page() {
        let ix = SessionIndex::new(1 << 20);
        assert_eq!(ix.find(ix.place(&key(1)), |_| true), None);
        assert_eq!(ix.pages_made(), 0);
        ix.insert(ix.place(&key(1)), SessionRef::new(1, false), |_| false).unwrap();
        assert_eq!(ix.pages_made(), 1);
        ix.make_pages();
        assert_eq!(ix.pages_made(), 12);
    }

    #[test]
    fn threads_inserting_one_key_add_it_once() {
        // Four threads race to insert each of 2,000 keys (as two workers'
        // first packets of one flow do): exactly one insert of each wins,
        // and all four agree on the winner.
        let ix = Arc::new(SessionIndex::new(4000));
        let threads: Vec<_> = (0..4u32)
            .map(|t| {
                let ix = ix.clone();
                std::thread::spawn(move || {
                    (0..2000u32)
                        .map(|i| {
                            let mine = SessionRef::new(i * 4 + t, false);
                            let same_key = move |r: SessionRef| r.index() / 4 == i;
                            match ix.insert(ix.place(&key(i)), mine, same_key) {
                                Ok(()) => (i, mine),
                                Err(Refused::Exists(r)) => (i, r),
                                Err(Refused::Full) => panic!("full at {i}"),
                            }
                        })
                        .collect::<Vec<(u32, SessionRef)>>()
                })
            })
            .collect();
        let winners: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(ix.len(), 2000);
        for w in &winners[1..] {
            assert_eq!(w, &winners[0]);
        }
    }
}
