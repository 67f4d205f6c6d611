//! A worker's memo of the port pools its new flows allocate from.
//!
//! A new flow needs the [`PortPool`] of its (egress IP, protocol). The pools
//! live in the shared [`Mappings`](super::mapping::Mappings); asking there
//! costs a shard's read lock, a hash probe and an `Arc` clone and drop: two
//! atomic writes to a line that every worker making flows on that egress IP
//! writes too. The memo keeps the worker's own reference per (egress IP,
//! protocol) in a direct-mapped array, for one snapshot of the tables: it is
//! emptied when the tables' generation changes, the only time a pool can be
//! forgotten (its egress IP given up, `Engine::publish`, engine/mod.rs), and
//! by the worker's periodic tick once the generation moved on, so a memo
//! does not keep a forgotten IP's pool alive (ADR 0042: a pool goes only
//! when no reference but the map's is left). A pool is never replaced (a
//! new range moves the same pool's), so the memo's pool is the one the
//! shared map holds, and a flow allocates from the same pool either way.
//!
//! Each entry also keeps the worker's next random port in its pool, drawn
//! one allocation ahead so that its owner cell is in cache by the claim
//! ([`PortAhead`], ADR 0043).

use std::sync::Arc;

use super::key::NatAddr;
use super::port_alloc::{PortAhead, PortPool};

/// The pools a worker used lately, by (egress IP, protocol).
#[derive(Debug)]
pub struct PoolMemo<A: NatAddr> {
    /// The tables' generation the entries were made under.
    generation: u64,
    /// Empty until the first new flow.
    entries: Vec<Option<Entry<A>>>,
}

type Entry<A> = (A, u8, Arc<PortPool<A>>, PortAhead);

impl<A: NatAddr> Default for PoolMemo<A> {
    fn default() -> Self {
        PoolMemo { generation: 0, entries: Vec::new() }
    }
}

impl<A: NatAddr> PoolMemo<A> {
    /// Entries: 2^8 (8 KiB for IPv6, made on first use). Two egress IPs'
    /// pools that share an entry take turns in it: a miss asks the map.
    const BITS: u32 = 8;

    /// The pool of (`egress`, `proto`) under the tables of `generation`:
    /// the memo's, or `make`'s (the shared map's), which it then keeps;
    /// with the worker's port drawn ahead in it (none yet in a new entry).
    #[inline]
    pub fn get(
        &mut self,
        generation: u64,
        egress: A,
        proto: u8,
        make: impl FnOnce() -> Arc<PortPool<A>>,
    ) -> (&Arc<PortPool<A>>, &mut PortAhead) {
        if self.generation != generation || self.entries.is_empty() {
            self.reset(generation);
        }
        let entry = &mut self.entries[Self::slot(egress, proto)];
        if !matches!(entry, Some((ip, p, _, _)) if *ip == egress && *p == proto) {
            *entry = None;
        }
        let (_, _, pool, ahead) = entry.get_or_insert_with(|| (egress, proto, make(), PortAhead::default()));
        (pool, ahead)
    }

    /// Drops every reference when the tables moved past the memo's
    /// generation (the worker's tick; nothing to do otherwise).
    #[inline]
    pub fn let_go(&mut self, generation: u64) {
        if self.generation != generation && !self.entries.is_empty() {
            self.generation = generation;
            self.entries.clear();
        }
    }

    #[cold]
    fn reset(&mut self, generation: u64) {
        self.generation = generation;
        self.entries.clear();
        self.entries.resize_with(1 << Self::BITS, || None);
    }

    /// The entry of (`egress`, `proto`): a multiplicative hash of the
    /// address folded with the protocol.
    #[inline]
    fn slot(egress: A, proto: u8) -> usize {
        let k = egress.sort_key();
        let f = (k as u64) ^ ((k >> 64) as u64) ^ (u64::from(proto) << 40);
        (f.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - Self::BITS)) as usize
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;
    use crate::nat::key::proto;
    use crate::nat::port_alloc::PortRange;

    fn pool() -> Arc<PortPool<Ipv4Addr>> {
        Arc::new(PortPool::new(PortRange { first: 1024, last: 2047 }, false))
    }

    #[test]
    fn a_pool_is_asked_for_once_per_generation() {
        let mut memo = PoolMemo::default();
        let ip = Ipv4Addr::new(203, 0, 113, 10);
        let (a, b) = (pool(), pool());
        let mut asked = 0;
        let (got, _) = memo.get(1, ip, proto::UDP, || {
            asked += 1;
            a.clone()
        });
        assert!(Arc::ptr_eq(got, &a));
        let (got, _) = memo.get(1, ip, proto::UDP, || {
            asked += 1;
            b.clone()
        });
        assert!(Arc::ptr_eq(got, &a), "the memo's pool within a generation");
        assert_eq!(asked, 1);
        // A new snapshot may have forgotten the pool.
        let (got, _) = memo.get(2, ip, proto::UDP, || b.clone());
        assert!(Arc::ptr_eq(got, &b), "asked again under a new generation");
    }

    /// The tick lets go of a past generation's pools: a forgotten egress
    /// IP's pool goes only once no reference but the map's is left.
    #[test]
    fn the_tick_lets_go_of_a_past_generations_pools() {
        let mut memo = PoolMemo::default();
        let a = pool();
        memo.get(1, Ipv4Addr::new(203, 0, 113, 10), proto::UDP, || a.clone());
        memo.let_go(1);
        assert_eq!(Arc::strong_count(&a), 2, "its generation is current: kept");
        memo.let_go(2);
        assert_eq!(Arc::strong_count(&a), 1);
    }

    /// The port drawn ahead lives in its pool's entry: a new generation,
    /// or another pool taking the slot, forgets it with the entry.
    #[test]
    fn a_drawn_port_goes_with_its_entry() {
        let mut memo = PoolMemo::default();
        let ip = Ipv4Addr::new(203, 0, 113, 10);
        let a = pool();
        let mut rng = crate::nat::port_alloc::PortRng::new(3);
        let (got, ahead) = memo.get(1, ip, proto::UDP, || a.clone());
        assert_eq!(ahead.port(), None, "a new entry has drawn nothing yet");
        let got = got.clone();
        ahead.refill(&got, got.range(), &mut rng);
        let drawn = ahead.port();
        assert!(drawn.is_some());
        assert_eq!(memo.get(1, ip, proto::UDP, || a.clone()).1.port(), drawn, "kept in its entry");
        assert_eq!(memo.get(2, ip, proto::UDP, || a.clone()).1.port(), None, "a new generation forgets it");
        memo.get(2, ip, proto::UDP, || a.clone()).1.refill(&got, got.range(), &mut rng);
        let other = (0..1u32 << 16)
            .map(|i| Ipv4Addr::from(0xC633_0000 + i))
            .find(|o| PoolMemo::<Ipv4Addr>::slot(*o, proto::UDP) == PoolMemo::<Ipv4Addr>::slot(ip, proto::UDP))
            .expect("an address sharing the slot");
        memo.get(2, other, proto::UDP, pool);
        assert_eq!(memo.get(2, ip, proto::UDP, || a.clone()).1.port(), None, "another pool took the slot");
    }

    #[test]
    fn protocols_and_addresses_have_their_own_pools() {
        let mut memo = PoolMemo::default();
        let pools: Vec<_> = (0..300u32).map(|_| pool()).collect();
        let key = |i: usize| (Ipv4Addr::from(0xCB00_7100 + (i as u32 / 2)), [proto::UDP, proto::TCP][i % 2]);
        for round in 0..2 {
            for (i, want) in pools.iter().enumerate() {
                let (ip, p) = key(i);
                let (got, _) = memo.get(7, ip, p, || want.clone());
                assert!(Arc::ptr_eq(got, want), "round {round}: ({ip}, {p}) got another key's pool");
            }
        }
    }
}
