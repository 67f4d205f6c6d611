//! Longest-prefix match over IPv4 or IPv6 addresses.
//!
//! One hash table per prefix length present, probed from the longest length
//! down: a lookup costs one hash probe per distinct length (typically two or
//! three), and the structure is easy to reason about and to mirror into a BPF
//! `LPM_TRIE`. It is built once per configuration snapshot and only read after.

use std::hash::Hash;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ahash::AHashMap;

/// An address family usable as an LPM key.
pub trait LpmAddr: Copy + Eq + std::fmt::Debug + Send + Sync + 'static {
    /// The address as an unsigned integer (network order, most significant bit first).
    type Bits: Copy + Eq + Hash + std::fmt::Debug + Send + Sync;
    /// Address width in bits.
    const WIDTH: u8;
    /// The address as bits.
    fn to_bits(self) -> Self::Bits;
    /// The address from bits.
    fn from_bits(bits: Self::Bits) -> Self;
    /// `bits` with everything after the first `len` bits cleared.
    fn mask(bits: Self::Bits, len: u8) -> Self::Bits;
    /// The generic address.
    fn to_ip(self) -> IpAddr;
    /// The address as a number, for deterministic ordering.
    fn sort_key(self) -> u128;
    /// The all-zeros address.
    fn from_bits_zero() -> Self;
}

impl LpmAddr for Ipv4Addr {
    type Bits = u32;
    const WIDTH: u8 = 32;
    #[inline]
    fn to_bits(self) -> u32 {
        u32::from(self)
    }
    #[inline]
    fn from_bits(bits: u32) -> Self {
        Ipv4Addr::from(bits)
    }
    #[inline]
    fn mask(bits: u32, len: u8) -> u32 {
        match len {
            0 => 0,
            l if l >= 32 => bits,
            l => bits & (u32::MAX << (32 - l)),
        }
    }
    fn to_ip(self) -> IpAddr {
        IpAddr::V4(self)
    }
    fn sort_key(self) -> u128 {
        u128::from(u32::from(self))
    }
    fn from_bits_zero() -> Self {
        Ipv4Addr::UNSPECIFIED
    }
}

impl LpmAddr for Ipv6Addr {
    type Bits = u128;
    const WIDTH: u8 = 128;
    #[inline]
    fn to_bits(self) -> u128 {
        u128::from(self)
    }
    #[inline]
    fn from_bits(bits: u128) -> Self {
        Ipv6Addr::from(bits)
    }
    #[inline]
    fn mask(bits: u128, len: u8) -> u128 {
        match len {
            0 => 0,
            l if l >= 128 => bits,
            l => bits & (u128::MAX << (128 - l)),
        }
    }
    fn to_ip(self) -> IpAddr {
        IpAddr::V6(self)
    }
    fn sort_key(self) -> u128 {
        u128::from(self)
    }
    fn from_bits_zero() -> Self {
        Ipv6Addr::UNSPECIFIED
    }
}

/// A prefix: an address with its host bits cleared, and a length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Prefix<A: LpmAddr> {
    /// The network address (host bits zero).
    pub addr: A,
    /// Prefix length in bits, at most `A::WIDTH`.
    pub len: u8,
}

impl<A: LpmAddr> Prefix<A> {
    /// The prefix of `len` bits containing `addr` (host bits are cleared; a
    /// length above the address width is clamped).
    pub fn new(addr: A, len: u8) -> Self {
        let len = len.min(A::WIDTH);
        Prefix { addr: A::from_bits(A::mask(addr.to_bits(), len)), len }
    }

    /// Whether `addr` lies inside this prefix.
    pub fn contains(&self, addr: A) -> bool {
        A::mask(addr.to_bits(), self.len) == self.addr.to_bits()
    }

    /// Whether `other` lies entirely inside this prefix.
    pub fn covers(&self, other: &Prefix<A>) -> bool {
        other.len >= self.len && self.contains(other.addr)
    }
}

impl<A: LpmAddr> std::fmt::Display for Prefix<A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr.to_ip(), self.len)
    }
}

/// A longest-prefix-match table.
#[derive(Clone, Debug)]
pub struct Lpm<A: LpmAddr, V> {
    /// (prefix length, entries of that length), longest first.
    levels: Vec<(u8, AHashMap<A::Bits, V>)>,
}

impl<A: LpmAddr, V> Default for Lpm<A, V> {
    fn default() -> Self {
        Lpm { levels: Vec::new() }
    }
}

impl<A: LpmAddr, V> Lpm<A, V> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Inserts `value` for `prefix`, returning the value it replaces.
    pub fn insert(&mut self, prefix: Prefix<A>, value: V) -> Option<V> {
        let pos = match self.levels.binary_search_by(|(l, _)| prefix.len.cmp(l)) {
            Ok(i) => i,
            Err(i) => {
                self.levels.insert(i, (prefix.len, AHashMap::default()));
                i
            }
        };
        self.levels[pos].1.insert(prefix.addr.to_bits(), value)
    }

    /// The value of the longest prefix containing `addr`, with that prefix.
    #[inline]
    pub fn lookup(&self, addr: A) -> Option<(Prefix<A>, &V)> {
        let bits = addr.to_bits();
        for (len, table) in &self.levels {
            let key = A::mask(bits, *len);
            if let Some(v) = table.get(&key) {
                return Some((Prefix { addr: A::from_bits(key), len: *len }, v));
            }
        }
        None
    }

    /// The value stored for exactly `prefix`.
    pub fn get_exact(&self, prefix: &Prefix<A>) -> Option<&V> {
        self.levels.iter().find(|(l, _)| *l == prefix.len).and_then(|(_, t)| t.get(&prefix.addr.to_bits()))
    }

    /// Every (prefix, value), longest prefixes first.
    pub fn iter(&self) -> impl Iterator<Item = (Prefix<A>, &V)> + '_ {
        self.levels
            .iter()
            .flat_map(|(len, t)| t.iter().map(move |(bits, v)| (Prefix { addr: A::from_bits(*bits), len: *len }, v)))
    }

    /// Number of prefixes.
    pub fn len(&self) -> usize {
        self.levels.iter().map(|(_, t)| t.len()).sum()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.levels.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p4(s: &str, len: u8) -> Prefix<Ipv4Addr> {
        Prefix::new(s.parse().unwrap(), len)
    }

    #[test]
    fn longest_prefix_wins() {
        let mut t = Lpm::new();
        t.insert(p4("0.0.0.0", 0), "default");
        t.insert(p4("198.51.100.0", 24), "net");
        t.insert(p4("198.51.100.128", 25), "upper");
        t.insert(p4("198.51.100.7", 32), "host");
        let l = |a: &str| t.lookup(a.parse().unwrap()).map(|(p, v)| (p.to_string(), *v));
        assert_eq!(l("198.51.100.7"), Some(("198.51.100.7/32".into(), "host")));
        assert_eq!(l("198.51.100.200"), Some(("198.51.100.128/25".into(), "upper")));
        assert_eq!(l("198.51.100.8"), Some(("198.51.100.0/24".into(), "net")));
        assert_eq!(l("192.0.2.1"), Some(("0.0.0.0/0".into(), "default")));
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn host_bits_are_cleared_and_lengths_clamped() {
        let p = p4("203.0.113.77", 24);
        assert_eq!(p.to_string(), "203.0.113.0/24");
        assert!(p.contains("203.0.113.255".parse().unwrap()));
        assert!(!p.contains("203.0.114.0".parse().unwrap()));
        assert_eq!(p4("203.0.113.77", 40).len, 32);
        assert!(p.covers(&p4("203.0.113.64", 26)));
        assert!(!p.covers(&p4("203.0.112.0", 23)));
    }

    #[test]
    fn ipv6_lookup() {
        let mut t = Lpm::new();
        t.insert(Prefix::new("2001:db8::".parse::<Ipv6Addr>().unwrap(), 32), 1);
        t.insert(Prefix::new("2001:db8:1::".parse::<Ipv6Addr>().unwrap(), 48), 2);
        assert_eq!(t.lookup("2001:db8:1::5".parse().unwrap()).map(|(_, v)| *v), Some(2));
        assert_eq!(t.lookup("2001:db8:2::5".parse().unwrap()).map(|(_, v)| *v), Some(1));
        assert_eq!(t.lookup("2001:db9::".parse().unwrap()), None);
    }

    #[test]
    fn empty_table_misses() {
        let t: Lpm<Ipv4Addr, u8> = Lpm::new();
        assert!(t.lookup(Ipv4Addr::LOCALHOST).is_none());
        assert!(t.is_empty());
    }
}
