//! The mapped-port bitmaps the XDP program filters unsolicited inbound
//! traffic with (rule 4a in steer.bpf.c).
//!
//! `nat_port_slots` gives each tracked (egress address, protocol) a slot;
//! `nat_port_bits` (an mmap-able array) holds 65,536 bits per slot, one per
//! port, 8 KiB. The NAT's workers set a port's bit before the first packet of
//! the port's first session is sent and clear it once its last session is
//! gone (`egret_dataplane::nat::table`); they write through the mmap with
//! atomic read-modify-writes, so no syscall and no lock is taken per
//! session. A slot is zeroed before its `nat_port_slots` entry is inserted
//! and the entry is deleted before the slot is reused, so the program never
//! reads another address's bits.
//!
//! A writer that keeps a pair's place ([`MappedPorts::locate`], a
//! [`SlotTicket`]) writes without the lookup: each slot has a generation,
//! raised when the slot is freed, and a write through a ticket of an older
//! generation is refused ([`MappedPorts::set_at`]).

use std::net::IpAddr;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock};

use ahash::AHashMap;
use libbpf_rs::{MapCore, MapFlags, MapHandle};

use crate::error::BpfError;
use crate::maps::{NatPortKey, NAT_PORT_SLOTS, NAT_PORT_WORDS};
use crate::raw_map::MappedArray;

pub(crate) const NAT_PORT_SLOTS_MAP: &str = "nat_port_slots";
pub(crate) const NAT_PORT_BITS_MAP: &str = "nat_port_bits";

/// The writer of `nat_port_slots` and `nat_port_bits`. Cheap to share
/// (`Arc`); every method takes `&self`.
#[derive(Debug)]
pub struct MappedPorts {
    slots_map: MapHandle,
    bits: MappedArray,
    /// (address, protocol) -> slot, as in `nat_port_slots`. Read by the
    /// workers for every session made and ended: a `RwLock` whose read is
    /// one uncontended atomic (an `ArcSwap` snapshot was tried and showed
    /// no gain: docs/benchmarks.md, "Where the AF_XDP path's time goes"),
    /// hashed with ahash, not SipHash.
    slots: RwLock<AHashMap<(IpAddr, u8), u32>>,
    /// Slots not in use; also serialises slot assignment.
    free: Mutex<Vec<u32>>,
    /// Each slot's generation, raised as the slot is freed: a
    /// [`SlotTicket`] of an older one is stale.
    generations: Box<[AtomicU32]>,
}

/// Where a tracked (address, protocol)'s bits were when
/// [`MappedPorts::locate`] was asked: its slot, and the slot's generation
/// then. Good until the pair is forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotTicket {
    /// The slot in `nat_port_bits`.
    pub slot: u32,
    /// The slot's generation when the ticket was given.
    pub generation: u32,
}

impl MappedPorts {
    pub(crate) fn new(slots_map: MapHandle, bits_map: &MapHandle) -> Result<Self, BpfError> {
        let bytes = NAT_PORT_SLOTS as usize * NAT_PORT_WORDS as usize * 8;
        let bits = MappedArray::map(bits_map.as_fd(), bytes).map_err(|source| BpfError::SessionTableMap {
            map: NAT_PORT_BITS_MAP,
            bytes,
            source,
        })?;
        Ok(MappedPorts {
            slots_map,
            bits,
            slots: RwLock::new(AHashMap::new()),
            free: Mutex::new((0..NAT_PORT_SLOTS).rev().collect()),
            generations: (0..NAT_PORT_SLOTS).map(|_| AtomicU32::new(0)).collect(),
        })
    }

    fn words(&self, slot: u32) -> &[AtomicU64] {
        let first = slot as usize * NAT_PORT_WORDS as usize;
        &self.bits.as_ref()[first..first + NAT_PORT_WORDS as usize]
    }

    fn slot(&self, addr: IpAddr, proto: u8) -> Option<u32> {
        self.slots.read().unwrap_or_else(|p| p.into_inner()).get(&(addr, proto)).copied()
    }

    /// Starts filtering (`addr`, `proto`): from now on the program drops its
    /// NAT ports whose bit is clear (all of them, until [`Self::set`]).
    /// Idempotent. Fails when every slot is taken (the pair then stays
    /// unfiltered: the workers judge its packets, as without this map).
    pub fn track(&self, addr: IpAddr, proto: u8) -> Result<(), BpfError> {
        if self.slot(addr, proto).is_some() {
            return Ok(());
        }
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if self.slot(addr, proto).is_some() {
            return Ok(());
        }
        let slot = free.pop().ok_or(BpfError::MapOp {
            map: NAT_PORT_SLOTS_MAP,
            op: "insert",
            key: format!("{addr}/{proto}"),
            source: libbpf_rs::Error::from(std::io::Error::from_raw_os_error(libc::E2BIG)),
        })?;
        for w in self.words(slot) {
            w.store(0, Ordering::Relaxed);
        }
        let key = NatPortKey::new(addr, proto).to_bytes();
        if let Err(e) = self.slots_map.update(&key, &slot.to_ne_bytes(), MapFlags::ANY) {
            free.push(slot);
            return Err(BpfError::MapOp {
                map: NAT_PORT_SLOTS_MAP,
                op: "update",
                key: format!("{addr}/{proto}"),
                source: e,
            });
        }
        self.slots.write().unwrap_or_else(|p| p.into_inner()).insert((addr, proto), slot);
        Ok(())
    }

    /// Sets (`mapped`) or clears `port`'s bit for (`addr`, `proto`), tracking
    /// the pair first if it is not yet. The caller serialises the set and
    /// clear of one port (the NAT does: under the port's owner cell lock in
    /// endpoint-independent mode, its per-port count's in endpoint-dependent
    /// mode; ADR 0048).
    pub fn set(&self, addr: IpAddr, proto: u8, port: u16, mapped: bool) {
        let slot = match self.slot(addr, proto) {
            Some(s) => s,
            None if mapped => {
                if self.track(addr, proto).is_err() {
                    return;
                }
                match self.slot(addr, proto) {
                    Some(s) => s,
                    None => return,
                }
            }
            None => return,
        };
        self.write(slot, port, mapped);
    }

    /// Where (`addr`, `proto`)'s bits are now, for [`Self::set_at`]; `None`
    /// if the pair is not tracked.
    pub fn locate(&self, addr: IpAddr, proto: u8) -> Option<SlotTicket> {
        let slots = self.slots.read().unwrap_or_else(|p| p.into_inner());
        let slot = *slots.get(&(addr, proto))?;
        // Under the read lock: `forget` raises the generation under the
        // write lock, so the pair still owns the slot at this generation.
        Some(SlotTicket { slot, generation: self.generations[slot as usize].load(Ordering::Acquire) })
    }

    /// [`Self::set`] through a ticket, without the lookup. False, and
    /// nothing written, when the pair was forgotten since the ticket was
    /// given (its slot may now be another pair's): the caller then goes
    /// through [`Self::set`]. A forget between the check and the write
    /// leaves the write in a freed slot, as a lookup just before a forget
    /// does (freed slots are reused last).
    pub fn set_at(&self, at: SlotTicket, port: u16, mapped: bool) -> bool {
        match self.generations.get(at.slot as usize) {
            Some(g) if g.load(Ordering::Acquire) == at.generation => {
                self.write(at.slot, port, mapped);
                true
            }
            _ => false,
        }
    }

    #[inline]
    fn write(&self, slot: u32, port: u16, mapped: bool) {
        let word = &self.words(slot)[usize::from(port >> 6)];
        let bit = 1u64 << (port & 63);
        // Release: a worker's session insert happens before the bit is seen set.
        if mapped {
            word.fetch_or(bit, Ordering::Release);
        } else {
            word.fetch_and(!bit, Ordering::Release);
        }
    }

    /// Whether `port` is marked mapped for (`addr`, `proto`); `None` if the
    /// pair is not tracked.
    pub fn is_mapped(&self, addr: IpAddr, proto: u8, port: u16) -> Option<bool> {
        let slot = self.slot(addr, proto)?;
        Some(self.words(slot)[usize::from(port >> 6)].load(Ordering::Acquire) & (1u64 << (port & 63)) != 0)
    }

    /// Ports marked mapped for (`addr`, `proto`).
    pub fn count(&self, addr: IpAddr, proto: u8) -> u32 {
        self.slot(addr, proto)
            .map_or(0, |slot| self.words(slot).iter().map(|w| w.load(Ordering::Relaxed).count_ones()).sum())
    }

    /// Stops tracking `addr` (both protocols): its entries go first, then
    /// its slots are freed.
    pub fn forget(&self, addr: IpAddr) {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        let mut slots = self.slots.write().unwrap_or_else(|p| p.into_inner());
        let gone: Vec<_> = slots.keys().filter(|(a, _)| *a == addr).copied().collect();
        for (a, proto) in gone {
            let key = NatPortKey::new(a, proto).to_bytes();
            // A failed delete keeps the slot reserved: its entry may still
            // point at it, so it must not be reused.
            if self.slots_map.delete(&key).is_ok() {
                if let Some(slot) = slots.remove(&(a, proto)) {
                    // Every ticket for the slot is stale from here.
                    self.generations[slot as usize].fetch_add(1, Ordering::Release);
                    // Reused last: a worker that read the slot just before
                    // may still clear a bit in it (an unmapped port there
                    // then reaches the workers, which is harmless).
                    free.insert(0, slot);
                }
            }
        }
    }
}
