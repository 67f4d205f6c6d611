//! The fast path's next-hop table (`fp_next_hops`): one entry per
//! (output interface, next-hop address) that an installed session direction
//! uses, holding the interface, its MAC and the next hop's MAC from the
//! kernel's routes and neighbours (the engine's [`Fib`]). Sessions point at
//! entries by id, so a neighbour's new MAC is one map update, not one per
//! session (docs/adr/0005-xdp-fast-path.md).
//!
//! A direction's key is resolved as the engine resolves its next hop
//! (`Fib::next_hop`): the longest matching route gives the interface and
//! the gateway (or the destination itself when on-link). An unresolved
//! neighbour is an entry marked invalid, so the program punts those packets
//! to the engine, which asks the kernel to resolve it; once the neighbour
//! appears the entry turns valid with no change to the sessions.
//!
//! Frames the program forwards never reach the workers, which stamp the next
//! hops they use for the daemon to keep the kernel's neighbour entries alive
//! (`Fib`'s `NeighborUse`); [`NextHopTable::touch_in_use`] stamps every
//! next hop an installed session points at, so those stay alive too.
//!
//! Ids are reference counted by installed directions. A freed id rests for
//! [`QUARANTINE`] before it is reused, so a packet that read a session entry
//! just before its deletion cannot meet a recycled next hop.
//!
//! An entry on a two-arm gateway's outside link is marked
//! `NEXT_HOP_NOT_BACK`: the program punts a hit that arrived on that same
//! link instead of sending it back out of it. A legitimate outbound frame
//! arrives on an inside link; one from outside that carries a pod's
//! outbound 5-tuple is spoofed, and the steering rules drop it (rule 5a),
//! as they drop every other pod-sourced frame from outside.
//!
//! The table is owned by the offload manager's thread; nothing here is
//! shared.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use egret_bpf::FpNextHop;
use egret_dataplane::fib::{Fib, NeighborUse, NextHop};

/// How long a freed id rests before reuse.
pub const QUARANTINE: Duration = Duration::from_secs(1);

/// (output interface, next-hop address).
pub type HopKey = (u32, IpAddr);

/// Why a next hop could not be given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HopError {
    /// No route, or a route through an interface nobody told the Fib about.
    NoRoute,
    /// A route through a link the gateway does not drive (an overlay's
    /// tunnel device): XDP cannot send there (no `ndo_xdp_xmit`).
    KernelRoute,
    /// Every id is in use (`LoadOptions::fast_path_next_hops`).
    Full,
}

/// The (interface, next hop) the engine would use for `dst`.
pub fn route_key(fib: &Fib, dst: IpAddr) -> Option<HopKey> {
    let route = fib.route(dst)?;
    fib.interface(route.oif)?;
    Some((route.oif, route.gateway.unwrap_or(dst)))
}

/// Why `dst` has no [`route_key`]: its route leaves through a kernel link
/// (an overlay's tunnel: the engine hands those packets to the kernel, and
/// XDP cannot send into such a device), or there is no route at all.
pub fn no_key_because(fib: &Fib, dst: IpAddr) -> HopError {
    match fib.next_hop(dst) {
        NextHop::Kernel { .. } => HopError::KernelRoute,
        _ => HopError::NoRoute,
    }
}

/// The table entry for `key` under `fib`: valid when the interface and the
/// neighbour are known; `not_back` when the interface is a two-arm
/// gateway's outside link (module doc).
pub fn hop_value(fib: &Fib, key: HopKey, not_back: bool) -> FpNextHop {
    match (fib.interface(key.0), fib.neighbor(key.0, key.1)) {
        (Some(iface), Some(mac)) => FpNextHop::resolved(key.0, iface.mac, mac).with_mtu(iface.mtu).not_back(not_back),
        _ => FpNextHop::invalid(key.0),
    }
}

#[derive(Debug)]
struct Hop {
    id: u32,
    refs: u32,
    value: FpNextHop,
}

/// The ids in use and what they hold.
#[derive(Debug)]
pub struct NextHopTable {
    capacity: u32,
    hops: HashMap<HopKey, Hop>,
    keys: HashMap<u32, HopKey>,
    free: Vec<u32>,
    resting: VecDeque<(u32, Instant)>,
    next_unused: u32,
    /// Interfaces whose entries are marked `NEXT_HOP_NOT_BACK`.
    not_back: HashSet<u32>,
}

impl NextHopTable {
    /// A table of `capacity` ids (the map's size).
    pub fn new(capacity: u32) -> Self {
        Self {
            capacity,
            hops: HashMap::new(),
            keys: HashMap::new(),
            free: Vec::new(),
            resting: VecDeque::new(),
            next_unused: 0,
            not_back: HashSet::new(),
        }
    }

    /// This table, marking the entries on `ifindexes` (a two-arm gateway's
    /// outside links) `NEXT_HOP_NOT_BACK`.
    pub fn not_back(mut self, ifindexes: impl IntoIterator<Item = u32>) -> Self {
        self.not_back = ifindexes.into_iter().collect();
        self
    }

    /// Ids in use.
    pub fn len(&self) -> usize {
        self.hops.len()
    }

    /// Whether no id is in use.
    pub fn is_empty(&self) -> bool {
        self.hops.is_empty()
    }

    /// The key an id stands for.
    pub fn key_of(&self, id: u32) -> Option<HopKey> {
        self.keys.get(&id).copied()
    }

    /// Takes a reference on the next hop towards `dst`. Returns its id and,
    /// for an entry new to the map, the value to write before any session
    /// entry points at it.
    pub fn acquire(&mut self, fib: &Fib, dst: IpAddr, now: Instant) -> Result<(u32, Option<FpNextHop>), HopError> {
        let key = route_key(fib, dst).ok_or_else(|| no_key_because(fib, dst))?;
        self.acquire_key(fib, key, now)
    }

    /// [`acquire`](Self::acquire) for a known key.
    pub fn acquire_key(&mut self, fib: &Fib, key: HopKey, now: Instant) -> Result<(u32, Option<FpNextHop>), HopError> {
        if let Some(h) = self.hops.get_mut(&key) {
            h.refs += 1;
            return Ok((h.id, None));
        }
        while let Some(&(id, since)) = self.resting.front() {
            if now.saturating_duration_since(since) < QUARANTINE {
                break;
            }
            self.resting.pop_front();
            self.free.push(id);
        }
        let id = match self.free.pop() {
            Some(id) => id,
            None if self.next_unused < self.capacity => {
                self.next_unused += 1;
                self.next_unused - 1
            }
            None => return Err(HopError::Full),
        };
        let value = hop_value(fib, key, self.not_back.contains(&key.0));
        self.hops.insert(key, Hop { id, refs: 1, value });
        self.keys.insert(id, key);
        Ok((id, Some(value)))
    }

    /// Drops a reference; the last one frees the id (after the quarantine).
    pub fn release(&mut self, id: u32, now: Instant) {
        let Some(key) = self.keys.get(&id).copied() else { return };
        let Some(h) = self.hops.get_mut(&key) else { return };
        h.refs = h.refs.saturating_sub(1);
        if h.refs == 0 {
            self.hops.remove(&key);
            self.keys.remove(&id);
            self.resting.push_back((id, now));
        }
    }

    /// Stamps every next hop an installed direction uses as used at `secs`
    /// (engine seconds) in `uses`.
    pub fn touch_in_use(&self, uses: &NeighborUse, secs: u32) {
        for (ifindex, addr) in self.hops.keys() {
            uses.touch(NeighborUse::slot(*ifindex, *addr), secs);
        }
    }

    /// Recomputes every entry from a new snapshot; returns the ids whose
    /// value changed, with the new value (to write to the map).
    pub fn sync(&mut self, fib: &Fib) -> Vec<(u32, FpNextHop)> {
        let mut changed = Vec::new();
        for (key, h) in &mut self.hops {
            let v = hop_value(fib, *key, self.not_back.contains(&key.0));
            if v != h.value {
                h.value = v;
                changed.push((h.id, v));
            }
        }
        changed
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use egret_dataplane::fib::{Interface, Route};

    use super::*;

    fn fib(mac: [u8; 6]) -> Fib {
        let mut f = Fib::new();
        f.add_interface(Interface { ifindex: 3, name: "out".into(), mac: [2, 0, 0, 0, 0, 3], mtu: 1500 })
            .add_route(
                IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                0,
                Route { oif: 3, gateway: Some(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1))) },
            )
            .add_route(IpAddr::V4(Ipv4Addr::new(203, 0, 113, 0)), 24, Route { oif: 3, gateway: None })
            .add_route(IpAddr::V4(Ipv4Addr::new(198, 18, 0, 0)), 15, Route { oif: 9, gateway: None })
            .add_neighbor(3, IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)), mac);
        f
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
    }

    #[test]
    fn shared_by_destinations_behind_one_gateway_and_freed_after_rest() {
        let f = fib([2, 0, 0, 0, 0, 0xfe]);
        let t0 = Instant::now();
        let mut t = NextHopTable::new(2);
        let (a, va) = t.acquire(&f, ip("198.51.100.7"), t0).unwrap_or((99, None));
        assert_eq!(va, Some(FpNextHop::resolved(3, [2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 0xfe]).with_mtu(1500)));
        let (b, vb) = t.acquire(&f, ip("192.0.2.9"), t0).unwrap_or((99, None));
        assert_eq!((a, b, vb), (0, 0, None), "same gateway: same id, nothing to write");
        // On-link and unresolved: its own entry, invalid.
        let (c, vc) = t.acquire(&f, ip("203.0.113.50"), t0).unwrap_or((99, None));
        assert_eq!((c, vc), (1, Some(FpNextHop::invalid(3))));
        assert_eq!(t.acquire(&f, ip("203.0.113.51"), t0), Err(HopError::Full));
        assert_eq!(t.acquire(&f, ip("198.18.0.1"), t0), Err(HopError::NoRoute), "interface unknown");
        let mut overlay = f.clone();
        overlay.add_kernel_link(9, 1450);
        assert_eq!(t.acquire(&overlay, ip("198.18.0.1"), t0), Err(HopError::KernelRoute), "an overlay's tunnel");
        t.release(a, t0);
        t.release(c, t0);
        assert_eq!(t.len(), 1);
        assert_eq!(t.acquire(&f, ip("203.0.113.51"), t0), Err(HopError::Full), "id 1 rests");
        let later = t0 + QUARANTINE;
        assert_eq!(t.acquire(&f, ip("203.0.113.51"), later).map(|x| x.0), Ok(1));
        t.release(b, later);
        assert_eq!(t.key_of(0), None);
    }

    /// Entries on an outside link carry the flag, also after a MAC change;
    /// others, and unresolved ones, do not.
    #[test]
    fn outside_links_entries_are_marked_not_back() {
        let now = Instant::now();
        let mut f = fib([2, 0, 0, 0, 0, 0xfe]);
        f.add_interface(Interface { ifindex: 4, name: "in".into(), mac: [2, 0, 0, 0, 0, 4], mtu: 9000 })
            .add_route(ip("198.18.0.0"), 15, Route { oif: 4, gateway: None })
            .add_neighbor(4, ip("198.18.0.9"), [2, 0, 0, 0, 0, 9]);
        let mut t = NextHopTable::new(8).not_back([3]);
        let (a, va) = t.acquire(&f, ip("198.51.100.7"), now).unwrap_or((99, None));
        assert_eq!(va.map(|v| v.flags), Some(egret_bpf::fast_path::NEXT_HOP_NOT_BACK));
        let (_, vb) = t.acquire(&f, ip("198.18.0.9"), now).unwrap_or((99, None));
        assert_eq!(vb, Some(FpNextHop::resolved(4, [2, 0, 0, 0, 0, 4], [2, 0, 0, 0, 0, 9]).with_mtu(9000)));
        let (_, vc) = t.acquire(&f, ip("203.0.113.50"), now).unwrap_or((99, None));
        assert_eq!(vc, Some(FpNextHop::invalid(3)), "unresolved: invalid, unflagged");
        f.add_neighbor(3, ip("203.0.113.1"), [2, 0, 0, 0, 0, 0xaa]);
        let changed = t.sync(&f);
        let new_a = changed.iter().find(|c| c.0 == a).map(|c| c.1);
        assert_eq!(
            new_a,
            Some(FpNextHop::resolved(3, [2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 0xaa]).with_mtu(1500).not_back(true))
        );
    }

    #[test]
    fn sync_reports_changed_macs_only() {
        let mut t = NextHopTable::new(8);
        let now = Instant::now();
        let f = fib([2, 0, 0, 0, 0, 0xfe]);
        let (a, _) = t.acquire(&f, ip("198.51.100.7"), now).unwrap_or((99, None));
        let (c, _) = t.acquire(&f, ip("203.0.113.50"), now).unwrap_or((99, None));
        assert!(t.sync(&f).is_empty());
        let mut g = fib([2, 0, 0, 0, 0, 0xaa]);
        g.add_neighbor(3, ip("203.0.113.50"), [2, 0, 0, 0, 0, 0x50]);
        let mut changed = t.sync(&g);
        changed.sort_by_key(|x| x.0);
        assert_eq!(
            changed,
            vec![
                (a, FpNextHop::resolved(3, [2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 0xaa]).with_mtu(1500)),
                (c, FpNextHop::resolved(3, [2, 0, 0, 0, 0, 3], [2, 0, 0, 0, 0, 0x50]).with_mtu(1500)),
            ]
        );
        assert!(t.sync(&g).is_empty());
    }

    #[test]
    fn installed_next_hops_are_stamped_as_used() {
        let f = fib([2, 0, 0, 0, 0, 0xfe]);
        let now = Instant::now();
        let mut t = NextHopTable::new(8);
        let uses = NeighborUse::default();
        let (a, _) = t.acquire(&f, ip("198.51.100.7"), now).unwrap_or((99, None));
        t.touch_in_use(&uses, 5);
        assert_eq!(uses.stamp(3, ip("203.0.113.1")), 5, "the gateway of an installed direction");
        assert_eq!(uses.stamp(3, ip("203.0.113.50")), 0, "no installed direction goes there");
        t.release(a, now);
        t.touch_in_use(&uses, 6);
        assert_eq!(uses.stamp(3, ip("203.0.113.1")), 5, "released: no longer stamped");
    }
}
