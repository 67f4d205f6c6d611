//! What a worker node's kernel should hold for its own pods: a pure function.
//!
//! Input: the gateways' compiled [`Tables`] (the same [`desired`] output
//! every gateway computes, restricted to this node's pods), each egress IP's
//! companion next hop, and the cluster's pod and Service CIDRs. Output: per
//! selected pod, the route set of its table.
//!
//! The routes are read off the dataplane's own classifier, so the node and
//! the gateways cannot disagree: for the pod's source class, every boundary
//! prefix of the class's destination LPM becomes a route, `via` the next hop
//! of the egress IP the gateways pair the pod with ([`Policy::egress_for`],
//! i.e. `paired_egress`) when the classifier steers it, or `throw` when every
//! policy covering it excludes it. The kernel's routing lookup is a longest
//! prefix match too, so a destination gets the classifier's answer: steered
//! destinations go to the gateway, excluded ones fall through (`throw`) to
//! the next rule and the node's own path, and destinations no policy of the
//! pod covers have no route in the table, which falls through the same way.
//!
//! The cluster's own CIDRs never go to a gateway: boundary prefixes inside
//! one are dropped and the CIDR itself becomes a `throw`, which as the
//! longer prefix wins over any shorter steered route containing it.
//!
//! Pods with identical route sets share one kernel table (the reconciler,
//! `reconcile.rs`, keys tables by content), so a thousand pods of one policy
//! pairing with the same egress IP cost one table and a thousand rules.
//!
//! [`desired`]: crate::k8s::desired::desired

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egret_dataplane::lpm::{LpmAddr, Prefix};
use egret_dataplane::policy::{Classifier, DstAction};
use egret_dataplane::tables::{Policy, Tables};
use ipnet::IpNet;

/// One route of a pod's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    /// Destination prefix.
    pub dst: IpNet,
    /// The next hop (an egress IP or its companion next hop); `None`: a
    /// `throw` route (the lookup goes on with the next rule).
    pub via: Option<IpAddr>,
    /// The next hop is behind a router: `via` on Egret's VXLAN device
    /// (`onlink`), encapsulated to the next hop (`tunnel.rs`). `None`: the
    /// on-link route, as the plan makes it. Part of equality, so a changed
    /// source, destination, MTU or TTL is repaired like any other route.
    pub encap: Option<Encap>,
}

/// A route's encapsulation: `dev egret-vxlan onlink mtu MTU encap ip id VNI
/// src SRC dst DST ttl TTL` (IPv6: `encap ip6 ... hoplimit TTL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Encap {
    /// Outer source: the Node's InternalIP of the family.
    pub src: IpAddr,
    /// Outer destination: the next hop itself (it moves with its Lease).
    pub dst: IpAddr,
    /// The route's MTU (`RTAX_MTU`): underlay MTU minus the overhead.
    pub mtu: u32,
    /// Outer TTL / hop limit.
    pub ttl: u8,
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.via, self.encap) {
            (Some(v), None) => write!(f, "{} via {v}", self.dst),
            (Some(v), Some(e)) => write!(
                f,
                "{} via {v} dev {} onlink mtu {} encap {} id {} src {} dst {} {} {}",
                self.dst,
                super::tunnel::DEVICE,
                e.mtu,
                if e.dst.is_ipv4() { "ip" } else { "ip6" },
                egret_dataplane::wire::vxlan::EGRET_VNI,
                e.src,
                e.dst,
                if e.dst.is_ipv4() { "ttl" } else { "hoplimit" },
                e.ttl
            ),
            (None, _) => write!(f, "throw {}", self.dst),
        }
    }
}

/// A table's whole content.
pub type RouteSet = BTreeSet<Route>;

/// Which policy and egress IP a steered pod uses (for status and metrics).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Use {
    /// The policy's table name (`egresspolicy/NAME`, `service/NS/NAME`).
    pub policy: String,
    /// The egress IP the gateways translate the pod to.
    pub egress_ip: IpAddr,
}

/// The node's desired steering.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Per steered pod address: its table's routes (at least one `via`).
    pub pods: BTreeMap<IpAddr, RouteSet>,
    /// Per steered pod address: the policies and egress IPs it uses.
    pub uses: BTreeMap<IpAddr, BTreeSet<Use>>,
    /// Every next hop some route uses (the masquerade bypass matches them).
    pub next_hops: BTreeSet<IpAddr>,
    /// `PerNode` policies: per pod address, the destination ranges
    /// (first, last address as numbers) whose traffic the node SNATs, and
    /// to which of its own addresses; disjoint, longest prefix first.
    pub snat: BTreeMap<IpAddr, Vec<(u128, u128, IpAddr)>>,
    /// The node's own `PerNode` addresses in use.
    pub node_addresses: BTreeSet<IpAddr>,
}

impl Plan {
    /// Pods per (policy, egress IP).
    pub fn pods_per_use(&self) -> BTreeMap<&Use, usize> {
        let mut out = BTreeMap::new();
        for uses in self.uses.values() {
            for u in uses {
                *out.entry(u).or_insert(0) += 1;
            }
        }
        out
    }
}

fn net<A: LpmAddr>(p: &Prefix<A>) -> IpNet {
    IpNet::new(p.addr.to_ip(), p.len).unwrap_or_else(|_| IpNet::from(p.addr.to_ip()))
}

/// The class of `pod` in `c`: the class of the longest source prefix
/// containing it.
fn class_of<A: LpmAddr>(c: &Classifier<A>, pod: A) -> Option<u32> {
    c.source_entries().filter(|(p, _)| Prefix::new(pod, p.len) == *p).max_by_key(|(p, _)| p.len).map(|(_, class)| class)
}

/// Per-family pieces of [`plan`].
trait Family: LpmAddr {
    fn classifier(t: &Tables) -> &Classifier<Self>;
    fn egress(p: &Policy, pod: Self) -> Option<IpAddr>;
    fn of(ip: IpAddr) -> Option<Self>;
}

impl Family for Ipv4Addr {
    fn classifier(t: &Tables) -> &Classifier<Self> {
        &t.classify_v4
    }
    fn egress(p: &Policy, pod: Self) -> Option<IpAddr> {
        p.egress_for(pod).map(IpAddr::V4)
    }
    fn of(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        }
    }
}

impl Family for Ipv6Addr {
    fn classifier(t: &Tables) -> &Classifier<Self> {
        &t.classify_v6
    }
    fn egress(p: &Policy, pod: Self) -> Option<IpAddr> {
        p.egress_for(pod).map(IpAddr::V6)
    }
    fn of(ip: IpAddr) -> Option<Self> {
        match ip {
            IpAddr::V6(a) => Some(a),
            IpAddr::V4(_) => None,
        }
    }
}

/// One pod's steering: its table (if it routes anything to a gateway),
/// the policies and IPs it uses, its SNAT ranges (`PerNode` policies).
type PodSteering = (Option<RouteSet>, BTreeSet<Use>, Vec<(u128, u128, IpAddr)>);

fn pod_routes<A: Family>(
    tables: &Tables,
    pod: A,
    next_hop: &dyn Fn(IpAddr) -> IpAddr,
    cluster: &[IpNet],
    per_node: &BTreeSet<String>,
) -> Option<PodSteering> {
    let c = A::classifier(tables);
    let class = class_of(c, pod)?;
    let cluster: Vec<IpNet> = cluster.iter().copied().filter(|n| n.addr().is_ipv4() == pod.to_ip().is_ipv4()).collect();
    let mut routes = RouteSet::new();
    let mut uses = BTreeSet::new();
    // Every boundary prefix with the node's own address to SNAT to, or
    // None (a gateway's, excluded, or the cluster's): the longest wins.
    let mut snat: Vec<(Prefix<A>, Option<IpAddr>)> = Vec::new();
    for (_, prefix, action) in c.destination_entries().filter(|(k, _, _)| *k == class) {
        let dst = net(&prefix);
        if cluster.iter().any(|n| n.contains(&dst)) {
            continue;
        }
        let via = match action {
            DstAction::Exclude => None,
            DstAction::Steer(id) => {
                let policy = tables.policies.get(id.0 as usize)?;
                let egress = A::egress(policy, pod)?;
                uses.insert(Use { policy: policy.spec.name.clone(), egress_ip: egress });
                if per_node.contains(&policy.spec.name) {
                    // The node's own address: its usual path, SNATed.
                    snat.push((prefix, Some(egress)));
                    routes.insert(Route { dst, via: None, encap: None });
                    continue;
                }
                Some(next_hop(egress))
            }
        };
        snat.push((prefix, None));
        routes.insert(Route { dst, via, encap: None });
    }
    snat.extend(cluster.iter().filter_map(|n| Some((Prefix::new(A::of(n.addr())?, n.prefix_len()), None))));
    let snat: Vec<(u128, u128, IpAddr)> = crate::failclosed::disjoint_ranges(snat.into_iter())
        .into_iter()
        .filter_map(|(lo, hi, v)| v.map(|a| (lo, hi, a)))
        .collect();
    let table = routes.iter().any(|r| r.via.is_some()).then(|| {
        routes.extend(cluster.iter().map(|n| Route { dst: *n, via: None, encap: None }));
        routes
    });
    if table.is_none() && snat.is_empty() {
        return None;
    }
    Some((table, uses, snat))
}

/// The steering of `pods` (this node's pods' addresses). `next_hops` maps an
/// egress IP to its companion next hop; an egress IP without one is its own
/// next hop. `cluster` lists the pod and Service CIDRs, which stay inside.
/// `per_node` names the `PerNode` policies: their destinations are not
/// routed to a gateway but SNATed on the node to its own address (the
/// policy's egress IP in this node's tables).
pub fn plan(
    tables: &Tables,
    pods: &[IpAddr],
    next_hops: &BTreeMap<IpAddr, IpAddr>,
    cluster: &[IpNet],
    per_node: &BTreeSet<String>,
) -> Plan {
    let hop = |egress: IpAddr| next_hops.get(&egress).copied().unwrap_or(egress);
    let mut out = Plan::default();
    for ip in pods {
        let steered = match *ip {
            IpAddr::V4(a) => pod_routes(tables, a, &hop, cluster, per_node),
            IpAddr::V6(a) => pod_routes(tables, a, &hop, cluster, per_node),
        };
        if let Some((routes, uses, snat)) = steered {
            if let Some(routes) = routes {
                out.next_hops.extend(routes.iter().filter_map(|r| r.via));
                out.pods.insert(*ip, routes);
            }
            if !snat.is_empty() {
                out.node_addresses.extend(snat.iter().map(|(_, _, a)| *a));
                out.snat.insert(*ip, snat);
            }
            out.uses.insert(*ip, uses);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use egret_dataplane::tables::{paired_egress, PolicySlots, PolicySpec, TablesSpec};

    use super::*;

    fn n(s: &str) -> IpNet {
        s.parse().unwrap()
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    fn via(dst: &str, hop: &str) -> Route {
        Route { dst: n(dst), via: Some(ip(hop)), encap: None }
    }
    fn throw(dst: &str) -> Route {
        Route { dst: n(dst), via: None, encap: None }
    }
    fn policy(name: &str, sources: &[&str], dst: &[&str], except: &[&str], egress: &[&str]) -> PolicySpec {
        PolicySpec {
            name: name.into(),
            sources: sources.iter().map(|s| n(s)).collect(),
            destinations: dst.iter().map(|s| n(s)).collect(),
            except: except.iter().map(|s| n(s)).collect(),
            egress_ips: egress.iter().map(|s| ip(s)).collect(),
        }
    }
    fn tables(policies: Vec<PolicySpec>) -> Tables {
        Tables::compile(&TablesSpec { policies, ..Default::default() }, 1, &PolicySlots::default()).unwrap()
    }
    const CLUSTER: [&str; 3] = ["198.18.0.0/16", "198.19.0.0/24", "2001:db8:18::/48"];
    fn cluster() -> Vec<IpNet> {
        CLUSTER.iter().map(|s| n(s)).collect()
    }

    struct Case {
        name: &'static str,
        policies: Vec<PolicySpec>,
        next_hops: Vec<(&'static str, &'static str)>,
        pods: Vec<&'static str>,
        want: Vec<(&'static str, Vec<Route>)>,
    }

    #[test]
    fn route_sets_follow_the_classifier() {
        let cases = vec![
            Case {
                name: "one policy, every destination, egress IP is its own next hop",
                policies: vec![policy("egresspolicy/a", &["198.18.0.10/32"], &["0.0.0.0/0"], &[], &["203.0.113.10"])],
                next_hops: vec![],
                pods: vec!["198.18.0.10", "198.18.0.11"],
                want: vec![(
                    "198.18.0.10",
                    vec![via("0.0.0.0/0", "203.0.113.10"), throw("198.18.0.0/16"), throw("198.19.0.0/24")],
                )],
            },
            Case {
                name: "except becomes throw; companion next hop replaces the egress IP",
                policies: vec![policy(
                    "egresspolicy/a",
                    &["198.18.0.10/32"],
                    &["0.0.0.0/0"],
                    &["198.51.100.128/25"],
                    &["192.0.2.10"],
                )],
                next_hops: vec![("192.0.2.10", "203.0.113.30")],
                pods: vec!["198.18.0.10"],
                want: vec![(
                    "198.18.0.10",
                    vec![
                        via("0.0.0.0/0", "203.0.113.30"),
                        throw("198.18.0.0/16"),
                        throw("198.19.0.0/24"),
                        throw("198.51.100.128/25"),
                    ],
                )],
            },
            Case {
                name: "destinations inside the cluster's CIDRs are never steered",
                policies: vec![policy(
                    "egresspolicy/a",
                    &["198.18.0.10/32"],
                    &["198.18.5.0/24", "198.51.100.0/24"],
                    &[],
                    &["203.0.113.10"],
                )],
                next_hops: vec![],
                pods: vec!["198.18.0.10"],
                want: vec![(
                    "198.18.0.10",
                    vec![via("198.51.100.0/24", "203.0.113.10"), throw("198.18.0.0/16"), throw("198.19.0.0/24")],
                )],
            },
            Case {
                name: "a policy only inside the cluster steers nothing: no table",
                policies: vec![policy(
                    "egresspolicy/a",
                    &["198.18.0.10/32"],
                    &["198.18.5.0/24"],
                    &[],
                    &["203.0.113.10"],
                )],
                next_hops: vec![],
                pods: vec!["198.18.0.10"],
                want: vec![],
            },
            Case {
                name: "two policies: the longer destination wins per prefix, as on the gateway",
                policies: vec![
                    policy("egresspolicy/a", &["198.18.0.10/32"], &["0.0.0.0/0"], &[], &["203.0.113.10"]),
                    policy("egresspolicy/b", &["198.18.0.10/32"], &["198.51.100.0/24"], &[], &["203.0.113.11"]),
                ],
                next_hops: vec![],
                pods: vec!["198.18.0.10"],
                want: vec![(
                    "198.18.0.10",
                    vec![
                        via("0.0.0.0/0", "203.0.113.10"),
                        throw("198.18.0.0/16"),
                        throw("198.19.0.0/24"),
                        via("198.51.100.0/24", "203.0.113.11"),
                    ],
                )],
            },
            Case {
                name: "an exception of one policy inside another policy's destination is steered by the other",
                policies: vec![
                    policy(
                        "egresspolicy/a",
                        &["198.18.0.10/32"],
                        &["0.0.0.0/0"],
                        &["198.51.100.0/24"],
                        &["203.0.113.10"],
                    ),
                    policy("egresspolicy/b", &["198.18.0.10/32"], &["198.51.100.0/24"], &[], &["203.0.113.11"]),
                ],
                next_hops: vec![],
                pods: vec!["198.18.0.10"],
                want: vec![(
                    "198.18.0.10",
                    vec![
                        via("0.0.0.0/0", "203.0.113.10"),
                        throw("198.18.0.0/16"),
                        throw("198.19.0.0/24"),
                        via("198.51.100.0/24", "203.0.113.11"),
                    ],
                )],
            },
            Case {
                name: "IPv6 pod of a dual-stack policy; its cluster CIDR is thrown",
                policies: vec![policy(
                    "egresspolicy/a",
                    &["198.18.0.10/32", "2001:db8:18::10/128"],
                    &["0.0.0.0/0", "::/0"],
                    &[],
                    &["203.0.113.10", "2001:db8:113::10"],
                )],
                next_hops: vec![],
                pods: vec!["198.18.0.10", "2001:db8:18::10"],
                want: vec![
                    (
                        "198.18.0.10",
                        vec![via("0.0.0.0/0", "203.0.113.10"), throw("198.18.0.0/16"), throw("198.19.0.0/24")],
                    ),
                    ("2001:db8:18::10", vec![via("::/0", "2001:db8:113::10"), throw("2001:db8:18::/48")]),
                ],
            },
        ];
        for c in cases {
            let t = tables(c.policies);
            let hops: BTreeMap<IpAddr, IpAddr> = c.next_hops.iter().map(|(a, b)| (ip(a), ip(b))).collect();
            let pods: Vec<IpAddr> = c.pods.iter().map(|p| ip(p)).collect();
            let got = plan(&t, &pods, &hops, &cluster(), &BTreeSet::new());
            let want: BTreeMap<IpAddr, RouteSet> =
                c.want.into_iter().map(|(p, r)| (ip(p), r.into_iter().collect())).collect();
            assert_eq!(got.pods, want, "{}", c.name);
            let hops_used: BTreeSet<IpAddr> = want.values().flatten().filter_map(|r| r.via).collect();
            assert_eq!(got.next_hops, hops_used, "{}", c.name);
        }
    }

    #[test]
    fn per_node_destinations_are_snat_ranges_not_routes() {
        let t = tables(vec![
            policy("egresspolicy/gw", &["198.18.0.10/32"], &["198.51.100.0/24"], &[], &["203.0.113.10"]),
            policy(
                "egresspolicy/node",
                &["198.18.0.10/32", "198.18.0.11/32"],
                &["0.0.0.0/0"],
                &["192.0.2.0/24"],
                &["203.0.113.50"],
            ),
        ]);
        let per_node = BTreeSet::from(["egresspolicy/node".to_string()]);
        let pods = [ip("198.18.0.10"), ip("198.18.0.11")];
        let got = plan(&t, &pods, &BTreeMap::new(), &cluster(), &per_node);
        // .10: the gateway policy's /24 is routed; everything else of the
        // per-node policy goes its usual way (throw) and is SNATed.
        let want10: RouteSet = [
            throw("0.0.0.0/0"),
            throw("192.0.2.0/24"),
            via("198.51.100.0/24", "203.0.113.10"),
            throw("198.18.0.0/16"),
            throw("198.19.0.0/24"),
        ]
        .into_iter()
        .collect();
        assert_eq!(got.pods.get(&ip("198.18.0.10")), Some(&want10));
        assert_eq!(got.pods.get(&ip("198.18.0.11")), None, ".11 routes nothing to a gateway: no table");
        let n = |s: &str| u128::from(u32::from(s.parse::<Ipv4Addr>().unwrap()));
        let a = ip("203.0.113.50");
        assert_eq!(
            got.snat[&ip("198.18.0.11")],
            vec![
                (0, n("192.0.1.255"), a),
                (n("192.0.3.0"), n("198.17.255.255"), a),
                (n("198.19.1.0"), n("255.255.255.255"), a),
            ],
            "0.0.0.0/0 minus the exception and the cluster's CIDRs"
        );
        let ranges10 = &got.snat[&ip("198.18.0.10")];
        assert!(
            ranges10.iter().all(|(lo, hi, _)| *hi < n("198.51.100.0") || *lo > n("198.51.100.255")),
            "the gateway's /24 is not SNATed: {ranges10:?}"
        );
        assert_eq!(got.node_addresses, BTreeSet::from([a]));
        assert!(got.uses[&ip("198.18.0.11")].contains(&Use { policy: "egresspolicy/node".into(), egress_ip: a }));
    }

    #[test]
    fn a_pool_of_egress_ips_pairs_each_pod_as_the_gateway_does() {
        let egress = ["203.0.113.10", "203.0.113.11", "203.0.113.12"];
        let pods: Vec<IpAddr> = (10..60).map(|i| IpAddr::V4(Ipv4Addr::new(198, 18, 0, i))).collect();
        let sources: Vec<String> = pods.iter().map(|p| format!("{p}/32")).collect();
        let src_refs: Vec<&str> = sources.iter().map(String::as_str).collect();
        let t = tables(vec![policy("egresspolicy/pool", &src_refs, &["0.0.0.0/0"], &[], &egress)]);
        let got = plan(&t, &pods, &BTreeMap::new(), &cluster(), &BTreeSet::new());
        let list: Vec<Ipv4Addr> = egress.iter().map(|e| e.parse().unwrap()).collect();
        let mut seen = BTreeSet::new();
        for p in &pods {
            let IpAddr::V4(a) = p else { unreachable!() };
            let want = IpAddr::V4(paired_egress(*a, &list).unwrap());
            let routes = &got.pods[p];
            assert!(routes.contains(&Route { dst: n("0.0.0.0/0"), via: Some(want), encap: None }), "pod {p}");
            assert_eq!(got.uses[p], BTreeSet::from([Use { policy: "egresspolicy/pool".into(), egress_ip: want }]));
            seen.insert(want);
        }
        assert_eq!(seen.len(), 3, "50 pods spread over the 3 egress IPs");
        let per_use: usize = got.pods_per_use().values().sum();
        assert_eq!(per_use, 50);
    }
}
