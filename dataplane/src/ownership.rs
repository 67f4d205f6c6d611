//! Until when this gateway may serve each address it owns: the data plane's
//! own fence (issue 14 item 6, ADR 0004 "The data plane's deadline").
//!
//! In Kubernetes mode the control plane holds one Lease per egress IP and
//! removes an IP from the tables when it can no longer renew it. That
//! removal needs a live control plane; a frozen process or a stuck control
//! task would keep serving. So every owned address (egress IPs and the
//! companion next hops answered for them) also carries a *valid-until* in
//! engine time, extended only after a successful renewal, and the workers
//! check it for every frame at processing time, whatever the tables say:
//! a frame that would be translated to or from an address past its
//! valid-until, or an ARP/NDP answer for one, is dropped and counted
//! (`ownership_expired`).
//!
//! An address with no valid-until recorded has none (file mode, where no
//! Lease exists). The control plane records one before it publishes tables
//! holding a new Lease's IP.
//!
//! Cost: the per-frame check is one atomic load and compare against the
//! earliest valid-until of all addresses. Only once that has passed (an IP
//! about to be fenced, or a control plane that stopped renewing) does a
//! frame's addresses get looked up ([`Ownership::frame_expired`]).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ahash::AHashMap;
use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::clock::Timestamp;

/// Ethertypes (IEEE 802 numbers, RFC 7042).
const ETH_P_IP: u16 = 0x0800;
const ETH_P_ARP: u16 = 0x0806;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;

/// The valid-until of every address that has one, shared by the control
/// plane (writer) and the workers (readers, lock-free).
#[derive(Debug)]
pub struct Ownership {
    /// Address -> valid-until (engine time). Replaced whole on each change.
    deadlines: ArcSwap<AHashMap<IpAddr, Timestamp>>,
    /// The earliest valid-until in `deadlines`, milliseconds; `u64::MAX`
    /// when there is none.
    earliest_ms: AtomicU64,
    /// Serialises writers.
    write: Mutex<()>,
}

impl Default for Ownership {
    fn default() -> Self {
        Ownership {
            deadlines: ArcSwap::from_pointee(AHashMap::default()),
            earliest_ms: AtomicU64::new(u64::MAX),
            write: Mutex::new(()),
        }
    }
}

impl Ownership {
    /// A shared, empty set (no address has a valid-until).
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Sets or clears (`None`) the valid-until of each address in `changes`.
    pub fn set<I: IntoIterator<Item = (IpAddr, Option<Timestamp>)>>(&self, changes: I) {
        let _w = self.write.lock();
        let mut m: AHashMap<IpAddr, Timestamp> = (**self.deadlines.load()).clone();
        for (ip, until) in changes {
            match until {
                Some(t) => {
                    m.insert(ip, t);
                }
                None => {
                    m.remove(&ip);
                }
            }
        }
        let earliest = m.values().map(|t| t.as_millis()).min().unwrap_or(u64::MAX);
        // Store the map before lowering `earliest`, and raise `earliest` only
        // after: a reader that sees the new bound sees a map at least as new.
        self.deadlines.store(Arc::new(m));
        self.earliest_ms.store(earliest, Ordering::SeqCst);
    }

    /// Ends the validity of `ips` now (fencing without waiting for tables).
    pub fn expire(&self, ips: &[IpAddr]) {
        self.set(ips.iter().map(|ip| (*ip, Some(Timestamp::ZERO))));
    }

    /// The valid-until of `ip`, if it has one.
    pub fn valid_until(&self, ip: IpAddr) -> Option<Timestamp> {
        self.deadlines.load().get(&ip).copied()
    }

    /// Whether every address is valid at `now` (the per-frame check).
    #[inline]
    pub fn all_valid(&self, now: Timestamp) -> bool {
        now.as_millis() < self.earliest_ms.load(Ordering::Acquire)
    }

    /// Whether `ip` may be served at `now`.
    #[inline]
    pub fn valid(&self, ip: IpAddr, now: Timestamp) -> bool {
        self.all_valid(now) || self.deadlines.load().get(&ip).is_none_or(|t| now < *t)
    }

    /// Whether the frame `frame` names an address past its valid-until at
    /// `now`: an IPv4/IPv6 source or destination, or an ARP packet's sender
    /// or target protocol address (RFC 826), after at most two VLAN tags.
    /// Used on a frame as received (an inbound frame to an egress IP, an
    /// ARP request for it) and as it is about to be sent (a translated
    /// frame from an egress IP, an ARP reply or neighbour advertisement for
    /// it). A frame too short to hold the addresses names none.
    pub fn frame_expired(&self, frame: &[u8], now: Timestamp) -> bool {
        if self.all_valid(now) {
            return false;
        }
        let m = self.deadlines.load();
        let expired = |ip: IpAddr| m.get(&ip).is_some_and(|t| now >= *t);
        let mut at = 12;
        let mut ethertype = match frame.get(at..at + 2) {
            Some(b) => u16::from_be_bytes([b[0], b[1]]),
            None => return false,
        };
        for _ in 0..2 {
            if ethertype != ETH_P_8021Q && ethertype != ETH_P_8021AD {
                break;
            }
            at += 4;
            ethertype = match frame.get(at..at + 2) {
                Some(b) => u16::from_be_bytes([b[0], b[1]]),
                None => return false,
            };
        }
        let l3 = at + 2;
        let v4 = |o: usize| frame.get(l3 + o..l3 + o + 4).map(|b| IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])));
        let v6 = |o: usize| {
            frame.get(l3 + o..l3 + o + 16).map(|b| {
                let mut a = [0u8; 16];
                a.copy_from_slice(b);
                IpAddr::V6(Ipv6Addr::from(a))
            })
        };
        let (a, b) = match ethertype {
            // IPv4 header: source at 12, destination at 16 (RFC 791).
            ETH_P_IP => (v4(12), v4(16)),
            // IPv6 header: source at 8, destination at 24 (RFC 8200).
            ETH_P_IPV6 => (v6(8), v6(24)),
            // Ethernet/IPv4 ARP: sender protocol address at 14, target at 24.
            ETH_P_ARP => (v4(14), v4(24)),
            _ => (None, None),
        };
        a.is_some_and(expired) || b.is_some_and(expired)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ipv4_frame(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
        let mut f = vec![0u8; 14 + 20];
        f[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
        f[14] = 0x45;
        f[14 + 12..14 + 16].copy_from_slice(&src);
        f[14 + 16..14 + 20].copy_from_slice(&dst);
        f
    }

    #[test]
    fn addresses_without_a_deadline_never_expire() {
        let o = Ownership::default();
        let far = Timestamp::from_secs(1 << 40);
        assert!(o.all_valid(far));
        assert!(o.valid(ip("198.51.100.1"), far));
        assert!(!o.frame_expired(&ipv4_frame([198, 51, 100, 1], [203, 0, 113, 9]), far));
    }

    #[test]
    fn the_earliest_deadline_gates_the_per_frame_lookup() {
        let o = Ownership::default();
        let (a, b) = (ip("198.51.100.1"), ip("198.51.100.2"));
        o.set([(a, Some(Timestamp::from_secs(10))), (b, Some(Timestamp::from_secs(20)))]);
        assert!(o.all_valid(Timestamp::from_millis(9_999)));
        assert!(!o.all_valid(Timestamp::from_secs(10)));
        assert!(!o.valid(a, Timestamp::from_secs(10)), "valid-until is exclusive");
        assert!(o.valid(b, Timestamp::from_secs(10)));
        // Renewed: valid again; cleared (file mode, or the IP left the tables): no deadline.
        o.set([(a, Some(Timestamp::from_secs(30)))]);
        assert!(o.all_valid(Timestamp::from_secs(15)));
        o.set([(b, None)]);
        assert_eq!(o.valid_until(b), None);
        assert!(o.valid(b, Timestamp::from_secs(1000)));
        o.expire(&[a]);
        assert!(!o.valid(a, Timestamp::ZERO.plus(std::time::Duration::from_millis(1))));
    }

    #[test]
    fn frames_are_judged_by_every_address_they_carry() {
        let o = Ownership::default();
        o.set([
            (ip("198.51.100.1"), Some(Timestamp::from_secs(5))),
            (ip("2001:db8::1"), Some(Timestamp::from_secs(5))),
        ]);
        let now = Timestamp::from_secs(5);
        // Translated outbound (egress source) and inbound (egress destination).
        assert!(o.frame_expired(&ipv4_frame([198, 51, 100, 1], [203, 0, 113, 9]), now));
        assert!(o.frame_expired(&ipv4_frame([203, 0, 113, 9], [198, 51, 100, 1]), now));
        assert!(!o.frame_expired(&ipv4_frame([203, 0, 113, 9], [198, 51, 100, 2]), now));
        assert!(!o.frame_expired(&ipv4_frame([198, 51, 100, 1], [203, 0, 113, 9]), Timestamp::from_millis(4_999)));
        // Behind a VLAN tag.
        let mut tagged = ipv4_frame([198, 51, 100, 1], [203, 0, 113, 9]);
        tagged.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
        assert!(o.frame_expired(&tagged, now));
        // ARP: sender (a reply) or target (a request).
        let mut arp = vec![0u8; 14 + 28];
        arp[12..14].copy_from_slice(&ETH_P_ARP.to_be_bytes());
        arp[14 + 24..14 + 28].copy_from_slice(&[198, 51, 100, 1]);
        assert!(o.frame_expired(&arp, now));
        arp[14 + 24..14 + 28].copy_from_slice(&[198, 51, 100, 7]);
        arp[14 + 14..14 + 18].copy_from_slice(&[198, 51, 100, 1]);
        assert!(o.frame_expired(&arp, now));
        // IPv6 source.
        let mut v6 = vec![0u8; 14 + 40];
        v6[12..14].copy_from_slice(&ETH_P_IPV6.to_be_bytes());
        v6[14 + 8..14 + 24].copy_from_slice(&"2001:db8::1".parse::<Ipv6Addr>().unwrap().octets());
        assert!(o.frame_expired(&v6, now));
        // Truncated: nothing to judge.
        assert!(!o.frame_expired(&arp[..20], now));
    }
}
