//! The address sets of an `EgressIPPool`: parsing its `addresses` and
//! `nextHops` entries (CIDRs, `first-last` ranges, single addresses),
//! counting them, and allocating the lowest free addresses. Pure; the
//! allocation record itself lives in the pool's status (see `desired.rs`).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// A pool entry that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Neither a CIDR, a range nor an address.
    #[error("{field}[{index}]: {value:?} is not a CIDR, a first-last range or an address")]
    Unparsable {
        /// `addresses` or `nextHops`.
        field: &'static str,
        /// Position.
        index: usize,
        /// The entry.
        value: String,
    },
    /// A range whose ends differ in family or run backwards.
    #[error("{field}[{index}]: range {value:?} must go upwards within one address family")]
    BadRange {
        /// `addresses` or `nextHops`.
        field: &'static str,
        /// Position.
        index: usize,
        /// The entry.
        value: String,
    },
    /// Fewer next hops than addresses.
    #[error("nextHops has {next_hops} addresses, fewer than the {addresses} of addresses (they pair by position)")]
    TooFewNextHops {
        /// Next hops.
        next_hops: u128,
        /// Addresses.
        addresses: u128,
    },
    /// No address at all.
    #[error("addresses: must list at least one address")]
    Empty,
}

/// An inclusive range of one family, as integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Span {
    v6: bool,
    first: u128,
    last: u128,
}

impl Span {
    fn len(&self) -> u128 {
        (self.last - self.first).saturating_add(1)
    }
}

fn to_int(ip: IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(a) => (false, u128::from(u32::from(a))),
        IpAddr::V6(a) => (true, u128::from(a)),
    }
}

fn from_int(v6: bool, n: u128) -> IpAddr {
    if v6 {
        IpAddr::V6(Ipv6Addr::from(n))
    } else {
        // Spans of IPv4 never exceed u32::MAX.
        IpAddr::V4(Ipv4Addr::from(u32::try_from(n).unwrap_or(u32::MAX)))
    }
}

/// An ordered set of addresses: the concatenation of its entries' spans.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressSet {
    spans: Vec<Span>,
}

impl AddressSet {
    /// Parses the entries of field `field`.
    pub fn parse(field: &'static str, entries: &[String]) -> Result<AddressSet, PoolError> {
        let mut spans = Vec::with_capacity(entries.len());
        for (index, raw) in entries.iter().enumerate() {
            let value = raw.trim();
            let unparsable = || PoolError::Unparsable { field, index, value: raw.clone() };
            let span = if let Some((a, b)) = value.split_once('-') {
                let a: IpAddr = a.trim().parse().map_err(|_| unparsable())?;
                let b: IpAddr = b.trim().parse().map_err(|_| unparsable())?;
                let (fa, ia) = to_int(a);
                let (fb, ib) = to_int(b);
                if fa != fb || ia > ib {
                    return Err(PoolError::BadRange { field, index, value: raw.clone() });
                }
                Span { v6: fa, first: ia, last: ib }
            } else if value.contains('/') {
                let net: IpNet = value.parse().map_err(|_| unparsable())?;
                let net = net.trunc();
                let (v6, first) = to_int(net.network());
                let (_, last) = to_int(net.broadcast());
                match net {
                    // RFC 3021: /31 and /32 have no network or broadcast address.
                    IpNet::V4(n) if n.prefix_len() <= 30 => Span { v6, first: first + 1, last: last - 1 },
                    // RFC 4291 2.6.1: the subnet-router anycast address.
                    IpNet::V6(n) if n.prefix_len() <= 126 => Span { v6, first: first + 1, last },
                    _ => Span { v6, first, last },
                }
            } else {
                let a: IpAddr = value.parse().map_err(|_| unparsable())?;
                let (v6, n) = to_int(a);
                Span { v6, first: n, last: n }
            };
            spans.push(span);
        }
        Ok(AddressSet { spans })
    }

    /// How many addresses (saturating).
    pub fn len(&self) -> u128 {
        self.spans.iter().fold(0u128, |acc, s| acc.saturating_add(s.len()))
    }

    /// Whether it holds no address.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Position of `ip` (first occurrence).
    pub fn index_of(&self, ip: IpAddr) -> Option<u128> {
        let (v6, n) = to_int(ip);
        let mut base = 0u128;
        for s in &self.spans {
            if s.v6 == v6 && (s.first..=s.last).contains(&n) {
                return Some(base.saturating_add(n - s.first));
            }
            base = base.saturating_add(s.len());
        }
        None
    }

    /// The address at position `index`.
    pub fn nth(&self, mut index: u128) -> Option<IpAddr> {
        for s in &self.spans {
            if index < s.len() {
                return Some(from_int(s.v6, s.first + index));
            }
            index -= s.len();
        }
        None
    }

    /// Each entry's first and last address, in order.
    pub fn ranges(&self) -> impl Iterator<Item = (IpAddr, IpAddr)> + '_ {
        self.spans.iter().map(|s| (from_int(s.v6, s.first), from_int(s.v6, s.last)))
    }

    /// Whether `ip` is in the set.
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.index_of(ip).is_some()
    }

    /// Whether the set has IPv4 and IPv6 addresses: (v4, v6).
    pub fn families(&self) -> (bool, bool) {
        (self.spans.iter().any(|s| !s.v6), self.spans.iter().any(|s| s.v6))
    }

    /// The first address of one family (`v6`) not in `taken`.
    pub fn allocate_one(&self, v6: bool, taken: &BTreeSet<IpAddr>) -> Option<IpAddr> {
        for s in self.spans.iter().filter(|s| s.v6 == v6) {
            let mut n = s.first;
            loop {
                let ip = from_int(s.v6, n);
                if !taken.contains(&ip) {
                    return Some(ip);
                }
                if n == s.last {
                    break;
                }
                n += 1;
            }
        }
        None
    }

    /// The first `count` addresses not in `taken`, in order.
    pub fn allocate(&self, count: usize, taken: &BTreeSet<IpAddr>) -> Vec<IpAddr> {
        let mut out = Vec::with_capacity(count);
        for s in &self.spans {
            let mut n = s.first;
            while out.len() < count {
                let ip = from_int(s.v6, n);
                if !taken.contains(&ip) && !out.contains(&ip) {
                    out.push(ip);
                }
                if n == s.last {
                    break;
                }
                n += 1;
            }
            if out.len() == count {
                break;
            }
        }
        out
    }
}

/// A pool's parsed address set and its companion next hops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    /// Allocatable addresses.
    pub addresses: AddressSet,
    /// Companion next hops by position (empty: none).
    pub next_hops: AddressSet,
}

impl Pool {
    /// Parses a pool's spec entries.
    pub fn parse(addresses: &[String], next_hops: &[String]) -> Result<Pool, PoolError> {
        let addresses = AddressSet::parse("addresses", addresses)?;
        if addresses.is_empty() {
            return Err(PoolError::Empty);
        }
        let next_hops = AddressSet::parse("nextHops", next_hops)?;
        if !next_hops.is_empty() && next_hops.len() < addresses.len() {
            return Err(PoolError::TooFewNextHops { next_hops: next_hops.len(), addresses: addresses.len() });
        }
        Ok(Pool { addresses, next_hops })
    }

    /// The companion next hop of `ip`, if the pool pairs them.
    pub fn next_hop_of(&self, ip: IpAddr) -> Option<IpAddr> {
        if self.next_hops.is_empty() {
            return None;
        }
        self.addresses.index_of(ip).and_then(|i| self.next_hops.nth(i))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn set(entries: &[&str]) -> AddressSet {
        AddressSet::parse("addresses", &entries.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn entries_parse_to_the_documented_addresses() {
        let cases: &[(&[&str], u128, &str, &str)] = &[
            (&["198.51.100.0/29"], 6, "198.51.100.1", "198.51.100.6"),
            (&["198.51.100.8/31"], 2, "198.51.100.8", "198.51.100.9"),
            (&["198.51.100.7/32"], 1, "198.51.100.7", "198.51.100.7"),
            (&["198.51.100.10-198.51.100.12"], 3, "198.51.100.10", "198.51.100.12"),
            (&["203.0.113.5"], 1, "203.0.113.5", "203.0.113.5"),
            (&["2001:db8::/126"], 3, "2001:db8::1", "2001:db8::3"),
            (&["2001:db8::/127"], 2, "2001:db8::", "2001:db8::1"),
            (&["198.51.100.1", "198.51.100.3-198.51.100.4"], 3, "198.51.100.1", "198.51.100.4"),
        ];
        for (entries, len, first, last) in cases {
            let s = set(entries);
            assert_eq!(s.len(), *len, "{entries:?}");
            assert_eq!(s.nth(0), Some(ip(first)), "{entries:?}");
            assert_eq!(s.nth(len - 1), Some(ip(last)), "{entries:?}");
            assert_eq!(s.nth(*len), None, "{entries:?}");
            assert_eq!(s.index_of(ip(last)), Some(len - 1), "{entries:?}");
        }
        assert_eq!(set(&["2001:db8::/64"]).len(), (1u128 << 64) - 1);
    }

    #[test]
    fn bad_entries_name_field_position_and_value() {
        let e = AddressSet::parse("addresses", &["198.51.100.0/24".into(), "nope".into()]).unwrap_err();
        assert_eq!(e.to_string(), "addresses[1]: \"nope\" is not a CIDR, a first-last range or an address");
        let e = AddressSet::parse("nextHops", &["198.51.100.9-198.51.100.1".into()]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "nextHops[0]: range \"198.51.100.9-198.51.100.1\" must go upwards within one address family"
        );
        let e = AddressSet::parse("addresses", &["198.51.100.1-2001:db8::1".into()]).unwrap_err();
        assert!(matches!(e, PoolError::BadRange { index: 0, .. }));
        let e = Pool::parse(&["198.51.100.0/29".into()], &["192.0.2.1-192.0.2.2".into()]).unwrap_err();
        assert_eq!(e, PoolError::TooFewNextHops { next_hops: 2, addresses: 6 });
        assert_eq!(Pool::parse(&[], &[]).unwrap_err(), PoolError::Empty);
    }

    #[test]
    fn allocation_takes_the_lowest_free_addresses() {
        let s = set(&["198.51.100.1-198.51.100.2", "198.51.100.10/32", "198.51.100.20-198.51.100.21"]);
        let taken: BTreeSet<IpAddr> = [ip("198.51.100.1"), ip("198.51.100.10")].into();
        assert_eq!(s.allocate(2, &taken), vec![ip("198.51.100.2"), ip("198.51.100.20")]);
        assert_eq!(s.allocate(9, &taken).len(), 3, "only three are free");
        assert_eq!(s.allocate(0, &taken), Vec::<IpAddr>::new());
    }

    #[test]
    fn next_hops_pair_by_position() {
        let p = Pool::parse(&["203.0.113.8/30".into()], &["192.0.2.101-192.0.2.102".into()]).unwrap();
        assert_eq!(p.next_hop_of(ip("203.0.113.9")), Some(ip("192.0.2.101")));
        assert_eq!(p.next_hop_of(ip("203.0.113.10")), Some(ip("192.0.2.102")));
        assert_eq!(p.next_hop_of(ip("203.0.113.8")), None, "network address is not in the pool");
        let q = Pool::parse(&["203.0.113.8/30".into()], &[]).unwrap();
        assert_eq!(q.next_hop_of(ip("203.0.113.9")), None);
    }
}
