//! Which traffic a policy selects: the two-level classification shared with
//! the XDP program.
//!
//! A policy selects sources (prefixes) and destinations (prefixes) with
//! exceptions. Compiled per address family into:
//!
//! 1. a source LPM: every distinct source prefix any policy names -> a *class*;
//! 2. per class, a destination LPM: boundary prefix -> [`DstAction`].
//!
//! The decision for a destination `d` from a source in class `c` is made per
//! policy, independently: a policy applies when its longest own prefix (among
//! its destinations and exceptions) containing `d` is a destination, not an
//! exception. Among the policies that apply, the one whose matching
//! destination is longest wins, then the one whose source prefix is longest,
//! then the first by name. Because the destination LPM is keyed by every
//! boundary prefix of every policy of the class, the longest boundary prefix
//! containing `d` determines the answer, and it is computed once at compile
//! time. No match means the source is not selected for that destination.
//!
//! Classes whose policies and source specificities are identical share one
//! destination table, so a thousand pod /32s selected by one policy cost one
//! table.

use std::collections::BTreeMap;

use crate::lpm::{Lpm, LpmAddr, Prefix};

/// Index of a policy in the configuration snapshot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyId(pub u32);

/// (destination length, source length, earlier name first) of a candidate policy.
type Rank = (u8, u8, std::cmp::Reverse<usize>);

/// What the destination level decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DstAction {
    /// Translate with this policy.
    Steer(PolicyId),
    /// Every policy of the class that covers this destination excludes it.
    Exclude,
}

/// The classification result for one (source, destination).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Translate with this policy.
    Steer(PolicyId),
    /// Selected source, excluded destination: the kernel routes it untouched.
    Excluded,
    /// No policy selects this source for this destination.
    Unselected,
}

/// One policy's prefixes in one address family.
#[derive(Clone, Debug)]
pub struct PolicyRules<A: LpmAddr> {
    /// The policy.
    pub id: PolicyId,
    /// Selected sources.
    pub sources: Vec<Prefix<A>>,
    /// Selected destinations.
    pub destinations: Vec<Prefix<A>>,
    /// Destinations excluded from `destinations`.
    pub except: Vec<Prefix<A>>,
}

/// The compiled two-level classifier for one address family.
#[derive(Clone, Debug)]
pub struct Classifier<A: LpmAddr> {
    src: Lpm<A, u32>,
    dst: Vec<Lpm<A, DstAction>>,
}

impl<A: LpmAddr> Default for Classifier<A> {
    fn default() -> Self {
        Classifier { src: Lpm::new(), dst: Vec::new() }
    }
}

impl<A: LpmAddr> Classifier<A> {
    /// Compiles the rules of every policy. `rules` must be ordered by policy
    /// name (the last tie-break).
    pub fn build(rules: &[PolicyRules<A>]) -> Self {
        let mut sources: Vec<Prefix<A>> = rules.iter().flat_map(|r| r.sources.iter().copied()).collect();
        sources.sort_by_key(|p| (p.len, p.addr.sort_key()));
        sources.dedup();

        let mut out = Classifier::default();
        // Signature of a class: for each applicable policy (by position in
        // `rules`), the length of its longest source prefix covering the class.
        let mut tables: BTreeMap<Vec<(usize, u8)>, u32> = BTreeMap::new();
        for class_prefix in sources {
            let signature: Vec<(usize, u8)> = rules
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    r.sources.iter().filter(|s| s.covers(&class_prefix)).map(|s| s.len).max().map(|l| (i, l))
                })
                .collect();
            let class = match tables.get(&signature) {
                Some(c) => *c,
                None => {
                    let c = out.dst.len() as u32;
                    out.dst.push(Self::destination_table(rules, &signature));
                    tables.insert(signature, c);
                    c
                }
            };
            out.src.insert(class_prefix, class);
        }
        out
    }

    fn destination_table(rules: &[PolicyRules<A>], signature: &[(usize, u8)]) -> Lpm<A, DstAction> {
        let mut boundaries: Vec<Prefix<A>> = signature
            .iter()
            .flat_map(|(i, _)| rules[*i].destinations.iter().chain(rules[*i].except.iter()).copied())
            .collect();
        boundaries.sort_by_key(|p| (p.len, p.addr.sort_key()));
        boundaries.dedup();

        let mut table = Lpm::new();
        for region in boundaries {
            // (destination length, source length, -position) of the best policy.
            let mut best: Option<(Rank, PolicyId)> = None;
            for (i, src_len) in signature {
                let r = &rules[*i];
                let dest = r.destinations.iter().filter(|d| d.covers(&region)).map(|d| d.len).max();
                let exc = r.except.iter().filter(|d| d.covers(&region)).map(|d| d.len).max();
                let applies = match (dest, exc) {
                    (Some(d), Some(e)) => d > e,
                    (Some(_), None) => true,
                    _ => false,
                };
                if let (true, Some(d)) = (applies, dest) {
                    let rank = (d, *src_len, std::cmp::Reverse(*i));
                    if best.as_ref().is_none_or(|(b, _)| rank > *b) {
                        best = Some((rank, r.id));
                    }
                }
            }
            let action = match best {
                Some((_, id)) => DstAction::Steer(id),
                None => DstAction::Exclude,
            };
            table.insert(region, action);
        }
        table
    }

    /// Classifies one (source, destination).
    #[inline]
    pub fn classify(&self, src: A, dst: A) -> Decision {
        let Some((_, class)) = self.src.lookup(src) else {
            return Decision::Unselected;
        };
        match self.dst.get(*class as usize).and_then(|t| t.lookup(dst)) {
            Some((_, DstAction::Steer(p))) => Decision::Steer(*p),
            Some((_, DstAction::Exclude)) => Decision::Excluded,
            None => Decision::Unselected,
        }
    }

    /// Whether any policy selects this source at all (for any destination).
    pub fn selects_source(&self, src: A) -> bool {
        self.src.lookup(src).is_some()
    }

    /// The source level: (prefix, class), for the XDP program's maps.
    pub fn source_entries(&self) -> impl Iterator<Item = (Prefix<A>, u32)> + '_ {
        self.src.iter().map(|(p, c)| (p, *c))
    }

    /// The destination level: (class, prefix, action), for the XDP program's maps.
    pub fn destination_entries(&self) -> impl Iterator<Item = (u32, Prefix<A>, DstAction)> + '_ {
        self.dst.iter().enumerate().flat_map(|(c, t)| t.iter().map(move |(p, a)| (c as u32, p, *a)))
    }

    /// Number of distinct destination tables (classes after sharing).
    pub fn class_count(&self) -> usize {
        self.dst.len()
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn p(s: &str) -> Prefix<Ipv4Addr> {
        let (a, l) = s.split_once('/').unwrap();
        Prefix::new(a.parse().unwrap(), l.parse().unwrap())
    }

    fn rules(id: u32, src: &[&str], dst: &[&str], exc: &[&str]) -> PolicyRules<Ipv4Addr> {
        PolicyRules {
            id: PolicyId(id),
            sources: src.iter().map(|s| p(s)).collect(),
            destinations: dst.iter().map(|s| p(s)).collect(),
            except: exc.iter().map(|s| p(s)).collect(),
        }
    }

    fn c(cl: &Classifier<Ipv4Addr>, s: &str, d: &str) -> Decision {
        cl.classify(s.parse().unwrap(), d.parse().unwrap())
    }

    #[test]
    fn destinations_and_exceptions() {
        let cl = Classifier::build(&[rules(0, &["192.0.2.0/28"], &["0.0.0.0/0"], &["198.51.100.0/24"])]);
        assert_eq!(c(&cl, "192.0.2.3", "203.0.113.9"), Decision::Steer(PolicyId(0)));
        assert_eq!(c(&cl, "192.0.2.3", "198.51.100.9"), Decision::Excluded);
        assert_eq!(c(&cl, "192.0.2.17", "203.0.113.9"), Decision::Unselected);
    }

    #[test]
    fn an_exception_of_one_policy_does_not_hide_another() {
        // Policy 0 excludes 198.51.100.0/24; policy 1 selects 198.51.0.0/16.
        let cl = Classifier::build(&[
            rules(0, &["192.0.2.0/24"], &["0.0.0.0/0"], &["198.51.100.0/24"]),
            rules(1, &["192.0.2.0/24"], &["198.51.0.0/16"], &[]),
        ]);
        assert_eq!(c(&cl, "192.0.2.1", "198.51.100.1"), Decision::Steer(PolicyId(1)));
        assert_eq!(c(&cl, "192.0.2.1", "198.51.7.1"), Decision::Steer(PolicyId(1)));
        assert_eq!(c(&cl, "192.0.2.1", "203.0.113.1"), Decision::Steer(PolicyId(0)));
    }

    #[test]
    fn exception_inside_destination_inside_broader_destination() {
        let cl = Classifier::build(&[rules(0, &["192.0.2.0/24"], &["203.0.113.0/24"], &["203.0.113.128/25"])]);
        assert_eq!(c(&cl, "192.0.2.1", "203.0.113.1"), Decision::Steer(PolicyId(0)));
        assert_eq!(c(&cl, "192.0.2.1", "203.0.113.200"), Decision::Excluded);
        assert_eq!(c(&cl, "192.0.2.1", "203.0.112.1"), Decision::Unselected);
    }

    #[test]
    fn longer_destination_then_longer_source_then_name_order() {
        let cl = Classifier::build(&[
            rules(0, &["192.0.2.0/24"], &["203.0.113.0/24"], &[]),
            rules(1, &["192.0.2.0/25"], &["203.0.113.0/24"], &[]),
            rules(2, &["192.0.2.0/24"], &["203.0.113.0/26"], &[]),
            rules(3, &["192.0.2.0/24"], &["203.0.113.0/24"], &[]),
        ]);
        // /26 destination beats everything.
        assert_eq!(c(&cl, "192.0.2.1", "203.0.113.1"), Decision::Steer(PolicyId(2)));
        // Equal /24 destination: the /25 source wins for sources inside it...
        assert_eq!(c(&cl, "192.0.2.1", "203.0.113.100"), Decision::Steer(PolicyId(1)));
        // ...and outside it, policy 0 beats policy 3 by name order.
        assert_eq!(c(&cl, "192.0.2.200", "203.0.113.100"), Decision::Steer(PolicyId(0)));
    }

    #[test]
    fn identical_classes_share_one_table() {
        let hosts: Vec<String> = (1..=200).map(|i| format!("192.0.2.{i}/32")).collect();
        let refs: Vec<&str> = hosts.iter().map(String::as_str).collect();
        let cl = Classifier::build(&[rules(0, &refs, &["0.0.0.0/0"], &[])]);
        assert_eq!(cl.class_count(), 1);
        assert_eq!(cl.source_entries().count(), 200);
        assert_eq!(c(&cl, "192.0.2.150", "203.0.113.1"), Decision::Steer(PolicyId(0)));
        assert_eq!(c(&cl, "192.0.2.0", "203.0.113.1"), Decision::Unselected);
    }

    #[test]
    fn ipv6_classification() {
        let r = PolicyRules {
            id: PolicyId(7),
            sources: vec![Prefix::new("2001:db8:a::".parse::<Ipv6Addr>().unwrap(), 64)],
            destinations: vec![Prefix::new(Ipv6Addr::UNSPECIFIED, 0)],
            except: vec![Prefix::new("2001:db8:ff::".parse::<Ipv6Addr>().unwrap(), 48)],
        };
        let cl = Classifier::build(&[r]);
        let s: Ipv6Addr = "2001:db8:a::5".parse().unwrap();
        assert_eq!(cl.classify(s, "2001:db8:1::1".parse().unwrap()), Decision::Steer(PolicyId(7)));
        assert_eq!(cl.classify(s, "2001:db8:ff::1".parse().unwrap()), Decision::Excluded);
    }
}
