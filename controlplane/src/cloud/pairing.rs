//! Which private address stands for each public one.
//!
//! The pairing is recorded in `EgressIPPool.status.cloudAddresses`, written
//! by the status writer alone (with the pool's `resourceVersion`, so two
//! writers cannot both win), and read by every gateway and node agent: the
//! private address is the egress IP of the tables and the Lease's name. A
//! pairing, once recorded, never changes while its public address stays in
//! the pool: a re-pairing would move every session to a new address.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;

use super::Discovered;
use crate::k8s::crd::CloudAddressStatus;
use crate::k8s::pool::AddressSet;

/// The outcome of one pairing.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pairing {
    /// Every public address found with its private address, by public address.
    pub addresses: Vec<CloudAddressStatus>,
    /// Public addresses found no free private address for.
    pub unpaired: Vec<IpAddr>,
}

/// Whether `ip` is one of the addresses AWS reserves in every subnet: the
/// network address, the next three (router, DNS, future use) and the last.
/// Other providers reserve a subset of these, so skipping them is safe.
pub fn reserved(subnet: &IpNet, ip: IpAddr) -> bool {
    match (subnet, ip) {
        (IpNet::V4(n), IpAddr::V4(a)) => {
            let off = u32::from(a).wrapping_sub(u32::from(n.network()));
            off < 4 || a == n.broadcast()
        }
        _ => true,
    }
}

/// Pairs every public address `found` with a private address of its subnet
/// (inside `allowed` when the pool restricts them):
/// 1. the recorded pairing, while its private address is still in the
///    subnet and allowed;
/// 2. else the private address the public one is associated with now (a
///    pairing whose record was lost, or one made by hand);
/// 3. else the lowest free address: not reserved, not used by any
///    interface, not paired already.
///
/// Public addresses no longer found drop out (their private address is free
/// again once its holder releases it).
///
/// `others`: private addresses other pools of the same subnet use (their
/// recorded pairings, and what the pools paired before this one in the same
/// pass proposed), which this pool never takes.
pub fn pair(
    recorded: &[CloudAddressStatus],
    found: &Discovered,
    allowed: Option<&AddressSet>,
    others: &BTreeSet<IpAddr>,
) -> Pairing {
    let subnet = found.subnet_cidr;
    let usable = |ip: IpAddr| {
        subnet.contains(&ip)
            && !reserved(&subnet, ip)
            && !others.contains(&ip)
            && allowed.is_none_or(|a| a.is_empty() || a.contains(ip))
    };
    let mut public: Vec<&super::PublicAddress> = found.public.iter().filter(|p| p.public_ip.is_ipv4()).collect();
    public.sort_by_key(|p| p.public_ip);
    public.dedup_by_key(|p| p.public_ip);

    let mut taken: BTreeSet<IpAddr> = BTreeSet::new();
    let mut chosen: Vec<Option<IpAddr>> = vec![None; public.len()];
    // 1. Recorded pairings.
    for (i, p) in public.iter().enumerate() {
        let rec = recorded.iter().find(|r| r.public_ip.parse() == Ok(p.public_ip));
        if let Some(ip) = rec.and_then(|r| r.private_ip.parse::<IpAddr>().ok()) {
            if usable(ip) && taken.insert(ip) {
                chosen[i] = Some(ip);
            }
        }
    }
    // 2. Current associations.
    for (i, p) in public.iter().enumerate() {
        if chosen[i].is_some() {
            continue;
        }
        if let Some(ip) = p.private_ip.filter(|ip| usable(*ip) && !taken.contains(ip)) {
            taken.insert(ip);
            chosen[i] = Some(ip);
        }
    }
    // 3. The lowest free address.
    let mut out = Pairing::default();
    let mut next = free_addresses(&subnet, &found.used, &taken, &usable);
    for (i, p) in public.iter().enumerate() {
        let ip = chosen[i].or_else(|| next.next());
        match ip {
            Some(ip) => out.addresses.push(CloudAddressStatus {
                public_ip: p.public_ip.to_string(),
                allocation_id: p.allocation_id.clone(),
                private_ip: ip.to_string(),
            }),
            None => out.unpaired.push(p.public_ip),
        }
    }
    out
}

/// The pairing of a provider whose public addresses are the egress IPs
/// themselves (GCP's protocol forwarding, [`super::Provider::pairs_privately`]):
/// each public IPv4 address stands for itself.
pub fn identity(found: &Discovered) -> Pairing {
    let mut addresses: Vec<CloudAddressStatus> = found
        .public
        .iter()
        .filter(|p| p.public_ip.is_ipv4())
        .map(|p| CloudAddressStatus {
            public_ip: p.public_ip.to_string(),
            allocation_id: p.allocation_id.clone(),
            private_ip: p.public_ip.to_string(),
        })
        .collect();
    addresses.sort_by_key(|a| a.public_ip.parse::<IpAddr>().ok());
    addresses.dedup_by(|a, b| a.public_ip == b.public_ip);
    Pairing { addresses, unpaired: Vec::new() }
}

/// The subnet's usable addresses, ascending, that no interface uses and no
/// pairing took (IPv4: public addresses are IPv4 only).
fn free_addresses<'a>(
    subnet: &'a IpNet,
    used: &'a BTreeSet<IpAddr>,
    taken: &'a BTreeSet<IpAddr>,
    usable: &'a impl Fn(IpAddr) -> bool,
) -> impl Iterator<Item = IpAddr> + 'a {
    let (first, last) = match subnet {
        IpNet::V4(n) => (u32::from(n.network()), u32::from(n.broadcast())),
        IpNet::V6(_) => (1, 0),
    };
    (first..=last)
        .map(|n| IpAddr::V4(Ipv4Addr::from(n)))
        .filter(move |ip| usable(*ip) && !used.contains(ip) && !taken.contains(ip))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::PublicAddress;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn public(p: &str, alloc: &str, private: Option<&str>) -> PublicAddress {
        PublicAddress {
            public_ip: ip(p),
            allocation_id: alloc.into(),
            private_ip: private.map(ip),
            interface_id: private.map(|_| "eni-1".into()),
        }
    }

    fn rec(p: &str, alloc: &str, private: &str) -> CloudAddressStatus {
        CloudAddressStatus { public_ip: p.into(), allocation_id: alloc.into(), private_ip: private.into() }
    }

    fn found(public: Vec<PublicAddress>, used: &[&str]) -> Discovered {
        Discovered { public, subnet_cidr: "198.18.1.0/28".parse().unwrap(), used: used.iter().map(|s| ip(s)).collect() }
    }

    #[test]
    fn new_public_addresses_take_the_lowest_free_private_addresses() {
        // .0-.3 and .15 are reserved, .4 is an interface's primary address.
        let f = found(
            vec![public("192.0.2.2", "eipalloc-b", None), public("192.0.2.1", "eipalloc-a", None)],
            &["198.18.1.4"],
        );
        let p = pair(&[], &f, None, &BTreeSet::new());
        assert_eq!(
            p.addresses,
            vec![rec("192.0.2.1", "eipalloc-a", "198.18.1.5"), rec("192.0.2.2", "eipalloc-b", "198.18.1.6")]
        );
        assert!(p.unpaired.is_empty());
    }

    #[test]
    fn a_recorded_pairing_stays_although_its_address_is_now_in_use() {
        // The holder assigned .9 to its interface: discovery sees it used.
        let f = found(vec![public("192.0.2.1", "eipalloc-a", Some("198.18.1.9"))], &["198.18.1.4", "198.18.1.9"]);
        let p = pair(&[rec("192.0.2.1", "eipalloc-a", "198.18.1.9")], &f, None, &BTreeSet::new());
        assert_eq!(p.addresses, vec![rec("192.0.2.1", "eipalloc-a", "198.18.1.9")]);
    }

    #[test]
    fn a_lost_record_is_rebuilt_from_the_association() {
        let f = found(vec![public("192.0.2.1", "eipalloc-a", Some("198.18.1.12"))], &["198.18.1.12"]);
        assert_eq!(
            pair(&[], &f, None, &BTreeSet::new()).addresses,
            vec![rec("192.0.2.1", "eipalloc-a", "198.18.1.12")]
        );
    }

    #[test]
    fn a_public_address_that_left_the_pool_frees_its_private_address() {
        let f = found(vec![public("192.0.2.2", "eipalloc-b", None)], &[]);
        let p = pair(
            &[rec("192.0.2.1", "eipalloc-a", "198.18.1.5"), rec("192.0.2.2", "eipalloc-b", "198.18.1.6")],
            &f,
            None,
            &BTreeSet::new(),
        );
        assert_eq!(p.addresses, vec![rec("192.0.2.2", "eipalloc-b", "198.18.1.6")]);
    }

    #[test]
    fn the_pool_range_restricts_the_private_addresses_and_runs_out() {
        let allowed = AddressSet::parse("spec.addresses", &["198.18.1.10-198.18.1.11".to_string()]).unwrap();
        let f = found(
            vec![
                public("192.0.2.1", "a", None),
                public("192.0.2.2", "b", Some("198.18.1.5")),
                public("192.0.2.3", "c", None),
            ],
            &["198.18.1.10"],
        );
        let p = pair(&[rec("192.0.2.3", "c", "198.18.1.6")], &f, Some(&allowed), &BTreeSet::new());
        // .10 is used, .5 and .6 are outside the range: only .11 is left.
        assert_eq!(p.addresses, vec![rec("192.0.2.1", "a", "198.18.1.11")]);
        assert_eq!(p.unpaired, vec![ip("192.0.2.2"), ip("192.0.2.3")]);
    }

    #[test]
    fn another_pool_of_the_subnet_keeps_its_private_addresses() {
        // Another pool has .4 recorded and proposed .5 in this pass; this
        // pool's record of .5 (a race of two writers) gives way too.
        let f = found(vec![public("192.0.2.9", "z", None), public("192.0.2.8", "y", None)], &[]);
        let others: BTreeSet<IpAddr> = [ip("198.18.1.4"), ip("198.18.1.5")].into();
        let p = pair(&[rec("192.0.2.8", "y", "198.18.1.5")], &f, None, &others);
        assert_eq!(p.addresses, vec![rec("192.0.2.8", "y", "198.18.1.6"), rec("192.0.2.9", "z", "198.18.1.7")]);
    }

    #[test]
    fn two_public_addresses_never_share_a_private_one() {
        // Both records claim .5 (a hand edit): the first keeps it, the
        // second gets the lowest free address.
        let f = found(vec![public("192.0.2.1", "a", None), public("192.0.2.2", "b", None)], &[]);
        let p = pair(
            &[rec("192.0.2.1", "a", "198.18.1.5"), rec("192.0.2.2", "b", "198.18.1.5")],
            &f,
            None,
            &BTreeSet::new(),
        );
        assert_eq!(p.addresses, vec![rec("192.0.2.1", "a", "198.18.1.5"), rec("192.0.2.2", "b", "198.18.1.4")]);
    }

    #[test]
    fn an_identity_pairing_is_each_public_address_itself() {
        let found = Discovered {
            public: vec![
                public("203.0.113.9", "projects/p/regions/r/addresses/b", Some("203.0.113.9")),
                public("203.0.113.7", "projects/p/regions/r/addresses/a", None),
                public("2001:db8::7", "projects/p/regions/r/addresses/v6", None),
            ],
            subnet_cidr: "198.18.1.0/24".parse().unwrap(),
            used: BTreeSet::new(),
        };
        let p = identity(&found);
        let pairs: Vec<(&str, &str, &str)> = p
            .addresses
            .iter()
            .map(|a| (a.public_ip.as_str(), a.private_ip.as_str(), a.allocation_id.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("203.0.113.7", "203.0.113.7", "projects/p/regions/r/addresses/a"),
                ("203.0.113.9", "203.0.113.9", "projects/p/regions/r/addresses/b")
            ]
        );
        assert!(p.unpaired.is_empty());
    }
}
