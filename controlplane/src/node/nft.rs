//! The node's nftables table `inet egret_node`: what the pod starts is
//! marked for steering, the masquerade bypass, and strict mode.
//!
//! **Only what the pod starts is steered.** The agent's `ip rule from <pod>`
//! matches only packets carrying the steering bit (`fwmark M/M`,
//! [`super::NodeOptions::steer_mark`]). A chain at `prerouting` priority
//! `mangle` (after conntrack, before the routing decision) sets that bit on
//! a steered pod's packets of connections the pod originated (`ct direction
//! original`), and on its packets conntrack does not track or finds
//! invalid (they go to the gateway as before, which translates or drops
//! them, rather than leave unmasqueraded). The pod's replies to a
//! connection that arrived from outside (through kube-proxy's DNAT of a
//! NodePort, a LoadBalancer VIP or a ClusterIP, a webhook call from the API
//! server, a client on a routed network) are `ct direction reply`: they take
//! the node's main routing and reach the node that forwarded the
//! connection, which reverses its NAT, as in a cluster without Egret. The
//! bit is set with `meta mark set meta mark or M`: other bits stay as
//! kube-proxy, the CNI or a service mesh set them.
//!
//! **Keeping the pod's source.** Most CNIs masquerade pod traffic that
//! leaves the node (flannel's `-s clusterCIDR -j MASQUERADE`, Calico's
//! `natOutgoing`, kindnet's nft table at `srcnat - 10`, ip-masq-agent). A
//! selected pod's packets must reach the gateway with the pod's address, or
//! the gateway cannot tell the pod (and would see the node). A rule that
//! merely accepts does not help: the kernel runs every NAT hook in priority
//! order until one *sets a binding* (`nf_nat_inet_fn`), so an accept in one
//! table lets the next table's masquerade fire. So this table binds first:
//! at `srcnat - 50`, before any of them, a packet from a steered pod that
//! the routing decision sends to one of Egret's next hops (`rt ip nexthop`,
//! the route's gateway) gets `snat to ip saddr`, a binding to its own
//! address. The connection's later NAT hooks are then skipped, and nothing
//! else changes: unselected pods, and steered pods' excluded destinations
//! (which leave through the node's own route, not a gateway), are still
//! masqueraded as before.
//!
//! **Strict mode.** Between a pod getting its address and the agent
//! installing its rule, the pod's first packets leave through the node's
//! default path with the node's address. In strict mode a forward-hook
//! chain drops traffic from the node's pod CIDRs to outside the cluster
//! unless the agent has classified the source: either it is steered and its
//! rule is in place, or it is a local pod no policy selects. Unknown pods
//! reach the cluster (their CIDRs are exempt) but not the outside until the
//! agent has seen them.
//!
//! **The tunnel** (`tunnel.rs`), while `egret-vxlan` is in use. Nothing
//! legitimate arrives on it (the gateways send nothing back through it;
//! replies follow the pod network), but the device decapsulates whatever
//! reaches its UDP port: a `prerouting` chain at priority `raw` drops and
//! counts it before conntrack or routing sees it. Steered SYNs leaving
//! through it get their MSS clamped to the route's MTU (`tcp option maxseg
//! size set rt mtu`, in a `forward` chain: the route, hence `rt mtu`, is
//! known only after the routing decision, and pods' packets are forwarded),
//! so TCP does not depend on the node's Fragmentation Needed reaching the
//! pod. The kernel only ever lowers an MSS there (`nft_exthdr_tcp_set_eval`
//! skips a value that is not smaller). `iifname`/`oifname` match by name,
//! so the rules load whether or not the device exists yet. The masquerade
//! bypass needs nothing new: an encapsulated route is `via N ... onlink`,
//! so `rt ip nexthop` is still N.
//!
//! The whole table is replaced in one `nft -f` transaction per change.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

use crate::failclosed::{run_nft, FailClosedError};
use crate::nft_counters::{self, Carried};

/// The table's name (family `inet`).
pub const TABLE: &str = "egret_node";
/// The table of the kept-source guard alone, apart so that a host that
/// deletes the agent's main table (a targeted `nft delete table`) leaves it:
/// a connection kept on the pod's source is then dropped, never sent out
/// with the pod's address, until the repair (`repair.rs`).
pub const GUARD_TABLE: &str = "egret_node_guard";
/// The masquerade bypass's priority: `srcnat - 50`, before kindnet's
/// `srcnat - 10` and the iptables `nat` table's 100.
pub const KEEP_SOURCE_PRIORITY: i32 = 50;

/// The conntrack mark bit of connections whose source the bypass kept
/// (others' bits are preserved: the AWS VPC CNI uses 0x80).
pub const KEPT: u32 = 0x0010_0000;

/// What the table holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sets {
    /// The packet-mark bit the agent's rules match (0: no marking; the
    /// rules then match every packet).
    pub steer_mark: u32,
    /// Pod addresses with an Egret rule.
    pub steered: BTreeSet<IpAddr>,
    /// Next hops of Egret's routes.
    pub next_hops: BTreeSet<IpAddr>,
    /// Strict mode: `Some((local pod CIDRs, cluster CIDRs, classified pods))`.
    pub strict: Option<Strict>,
    /// `PerNode` policies: per pod, destination ranges (first, last address
    /// as numbers) SNATed to one of the node's own addresses.
    pub snat: BTreeMap<IpAddr, Vec<(u128, u128, IpAddr)>>,
    /// Whether `egret-vxlan` is (or is about to be) in use: its chains.
    pub tunnel: bool,
}

/// Strict mode's sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Strict {
    /// This node's pod CIDRs (sources strict mode guards).
    pub local: Vec<IpNet>,
    /// The cluster's pod and Service CIDRs (always reachable).
    pub cluster: Vec<IpNet>,
    /// Local pods the agent has classified.
    pub known: BTreeSet<IpAddr>,
}

/// Why nft failed.
#[derive(Debug, thiserror::Error)]
#[error("nftables table inet {TABLE}: {0}")]
pub struct NftError(String);

fn set(out: &mut String, name: &str, ty: &str, interval: bool, elems: impl Iterator<Item = String>) {
    let elems: Vec<String> = elems.collect();
    let _ = write!(out, "  set {name} {{\n    type {ty}\n");
    if interval {
        out.push_str("    flags interval\n    auto-merge\n");
    }
    if !elems.is_empty() {
        let _ = writeln!(out, "    elements = {{ {} }}", elems.join(", "));
    }
    out.push_str("  }\n");
}

fn addrs<'a>(v: impl Iterator<Item = &'a IpAddr>, v4: bool) -> impl Iterator<Item = String> {
    v.filter(move |a| a.is_ipv4() == v4).map(|a| a.to_string()).collect::<Vec<_>>().into_iter()
}

fn nets<'a>(v: impl Iterator<Item = &'a IpNet>, v4: bool) -> impl Iterator<Item = String> {
    v.filter(move |n| n.addr().is_ipv4() == v4).map(|n| n.trunc().to_string()).collect::<Vec<_>>().into_iter()
}

/// The comment (and carried key) of strict mode's drop counter.
const STRICT_DROPS: &str = "egret strict: pod not classified yet";
/// The comment (and carried key) of the kept-source guard's drop counter.
const KEPT_SOURCE_DROPS: &str = "egret: a kept pod source not leaving through a gateway";
/// The comment (and carried key) of the counter of connections bound to
/// their pod's own source.
const KEPT_SOURCES: &str = "egret: connections bound to the pod's own source";
/// The comment (and carried key) of the counter of packets that arrived
/// through the tunnel device.
const TUNNEL_DROPS: &str = "egret: arrived on egret-vxlan, where nothing legitimate arrives";

/// The whole script: creates the table if missing, deletes it, and writes
/// it anew, in one transaction (counters from zero).
pub fn ruleset(s: &Sets) -> String {
    ruleset_carrying(s, &Carried::new())
}

/// [`ruleset`] with its named counters starting from `carried` (both
/// tables' counters, by comment: [`crate::nft_counters`]).
pub fn ruleset_carrying(s: &Sets, carried: &Carried) -> String {
    let mut out = format!("table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    nft_counters::declare(&mut out, "kept_sources", KEPT_SOURCES, carried);
    set(&mut out, "steered4", "ipv4_addr", false, addrs(s.steered.iter(), true));
    set(&mut out, "steered6", "ipv6_addr", false, addrs(s.steered.iter(), false));
    set(&mut out, "hops4", "ipv4_addr", false, addrs(s.next_hops.iter(), true));
    set(&mut out, "hops6", "ipv6_addr", false, addrs(s.next_hops.iter(), false));
    if s.steer_mark != 0 {
        let m = s.steer_mark;
        let _ = write!(
            out,
            "  chain steer {{\n    type filter hook prerouting priority mangle; policy accept;\n    ip saddr @steered4 ct direction original meta mark set meta mark or {m:#x} comment \"egret: a connection the pod started\"\n    ip6 saddr @steered6 ct direction original meta mark set meta mark or {m:#x} comment \"egret: a connection the pod started\"\n    ip saddr @steered4 ct state invalid,untracked meta mark set meta mark or {m:#x} comment \"egret: untracked, to the gateway\"\n    ip6 saddr @steered6 ct state invalid,untracked meta mark set meta mark or {m:#x} comment \"egret: untracked, to the gateway\"\n  }}\n"
        );
    }
    let _ = write!(
        out,
        "  chain keep_source {{\n    type nat hook postrouting priority {KEEP_SOURCE_PRIORITY}; policy accept;\n"
    );
    // PerNode policies: the pod's steered destinations to the node's own
    // address, binding before the CNI's masquerade like the rules below.
    for (pod, ranges) in &s.snat {
        let (fam, num): (&str, fn(u128) -> String) = if pod.is_ipv4() {
            ("ip", |n| Ipv4Addr::from(n as u32).to_string())
        } else {
            ("ip6", |n| Ipv6Addr::from(n).to_string())
        };
        let elems: Vec<String> = ranges
            .iter()
            .map(
                |(lo, hi, a)| {
                    if lo == hi {
                        format!("{} : {a}", num(*lo))
                    } else {
                        format!("{}-{} : {a}", num(*lo), num(*hi))
                    }
                },
            )
            .collect();
        let _ = writeln!(
            out,
            "    {fam} saddr {pod} counter snat {fam} to {fam} daddr map {{ {} }} comment \"egret per-node\"",
            elems.join(", ")
        );
    }
    let _ = write!(
        out,
        "    ip saddr @steered4 rt ip nexthop @hops4 counter name \"kept_sources\" ct mark set ct mark or {KEPT:#010x} snat ip to ip saddr\n    ip6 saddr @steered6 rt ip6 nexthop @hops6 counter name \"kept_sources\" ct mark set ct mark or {KEPT:#010x} snat ip6 to ip6 saddr\n  }}\n"
    );
    if let Some(st) = &s.strict {
        nft_counters::declare(&mut out, "strict_drops", STRICT_DROPS, carried);
        strict(&mut out, st);
    }
    if s.tunnel {
        let dev = super::tunnel::DEVICE;
        nft_counters::declare(&mut out, "tunnel_drops", TUNNEL_DROPS, carried);
        let _ = write!(
            out,
            "  chain tunnel_in {{\n    type filter hook prerouting priority raw; policy accept;\n    iifname \"{dev}\" counter name \"tunnel_drops\" drop comment \"{TUNNEL_DROPS}\"\n  }}\n  chain tunnel_mss {{\n    type filter hook forward priority mangle; policy accept;\n    oifname \"{dev}\" tcp flags & (syn | rst) == syn tcp option maxseg size set rt mtu comment \"egret: MSS to the tunnel route's MTU\"\n  }}\n"
        );
    }
    out.push_str("}\n");
    // A connection bound to the pod's own source keeps that binding after
    // the pod stops being steered (its rule is gone, an `except` was added,
    // the host removed the rule or the main table): its later packets would
    // leave through the node's own route with the pod's address. They are
    // dropped instead; the application's next connection is masqueraded (or
    // steered) as usual. Only the original direction: the replies to the pod
    // are routed to the pod itself.
    let _ = write!(out, "table inet {GUARD_TABLE}\ndelete table inet {GUARD_TABLE}\ntable inet {GUARD_TABLE} {{\n");
    set(&mut out, "hops4", "ipv4_addr", false, addrs(s.next_hops.iter(), true));
    set(&mut out, "hops6", "ipv6_addr", false, addrs(s.next_hops.iter(), false));
    nft_counters::declare(&mut out, "kept_source_drops", KEPT_SOURCE_DROPS, carried);
    let _ = write!(
        out,
        "  chain kept_source_guard {{\n    type filter hook postrouting priority 300; policy accept;\n    ct direction original ct mark and {KEPT:#010x} == {KEPT:#010x} meta nfproto ipv4 rt ip nexthop != @hops4 counter name \"kept_source_drops\" drop comment \"{KEPT_SOURCE_DROPS}\"\n    ct direction original ct mark and {KEPT:#010x} == {KEPT:#010x} meta nfproto ipv6 rt ip6 nexthop != @hops6 counter name \"kept_source_drops\" drop comment \"{KEPT_SOURCE_DROPS}\"\n  }}\n"
    );
    out.push_str("}\n");
    out
}

/// Strict mode's sets and chain (in the main table).
fn strict(out: &mut String, st: &Strict) {
    set(out, "local4", "ipv4_addr", true, nets(st.local.iter(), true));
    set(out, "local6", "ipv6_addr", true, nets(st.local.iter(), false));
    set(out, "cluster4", "ipv4_addr", true, nets(st.cluster.iter(), true));
    set(out, "cluster6", "ipv6_addr", true, nets(st.cluster.iter(), false));
    set(out, "known4", "ipv4_addr", false, addrs(st.known.iter(), true));
    set(out, "known6", "ipv6_addr", false, addrs(st.known.iter(), false));
    out.push_str(
        "  chain strict {\n    type filter hook forward priority -10; policy accept;\n    ip saddr @local4 ip daddr != @cluster4 ip saddr != @known4 counter name \"strict_drops\" drop comment \"egret strict: pod not classified yet\"\n    ip6 saddr @local6 ip6 daddr != @cluster6 ip6 saddr != @known6 counter name \"strict_drops\" drop comment \"egret strict: pod not classified yet\"\n  }\n",
    );
}

fn nft(script: &str) -> Result<(), NftError> {
    run_nft(script).map_err(|e| {
        NftError(match e {
            FailClosedError::Spawn(e) => format!("running nft: {e} (install nftables)"),
            FailClosedError::Refused(m) => format!("nft refused the ruleset: {m}"),
            FailClosedError::TimedOut(t) => format!("nft did not finish within {t:?} and was killed"),
        })
    })
}

/// Replaces both tables, their counters carried over.
pub fn install(s: &Sets) -> Result<(), NftError> {
    nft(&ruleset_carrying(s, &nft_counters::read(&[TABLE, GUARD_TABLE])))
}

/// Deletes both tables (`egret node cleanup`).
pub fn remove() -> Result<(), NftError> {
    nft(&format!(
        "table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {GUARD_TABLE}\ndelete table inet {GUARD_TABLE}\n"
    ))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::failclosed::{run_bounded, NFT_TIMEOUT};
    use std::process::Command;

    fn sets(strict: bool) -> Sets {
        Sets {
            steer_mark: 0x1000,
            steered: ["198.18.0.10", "2001:db8:18::10"].iter().map(|s| s.parse().unwrap()).collect(),
            next_hops: ["203.0.113.10"].iter().map(|s| s.parse().unwrap()).collect(),
            strict: strict.then(|| Strict {
                local: vec!["198.18.0.0/24".parse().unwrap()],
                cluster: vec!["198.18.0.0/16".parse().unwrap(), "2001:db8:18::/48".parse().unwrap()],
                known: ["198.18.0.12".parse().unwrap()].into(),
            }),
            snat: BTreeMap::from([
                (
                    "198.18.0.11".parse().unwrap(),
                    vec![
                        (0, 0xc633_647f, "203.0.113.50".parse().unwrap()),
                        (0xc633_6500, 0xffff_ffff, "203.0.113.50".parse().unwrap()),
                    ],
                ),
                ("2001:db8:18::11".parse().unwrap(), vec![(0, u128::MAX, "2001:db8:113::50".parse().unwrap())]),
            ]),
            tunnel: false,
        }
    }

    #[test]
    fn the_tunnel_chains_are_there_only_while_the_device_is_used() {
        let mut s = sets(false);
        let off = ruleset(&s);
        assert!(!off.contains("egret-vxlan"), "{off}");
        s.tunnel = true;
        let on = ruleset(&s);
        assert!(
            on.contains("hook prerouting priority raw;")
                && on.contains("iifname \"egret-vxlan\" counter name \"tunnel_drops\" drop"),
            "{on}"
        );
        assert!(
            on.contains("hook forward priority mangle;")
                && on.contains(
                    "oifname \"egret-vxlan\" tcp flags & (syn | rst) == syn tcp option maxseg size set rt mtu"
                ),
            "{on}"
        );
        assert!(on.contains("rt ip nexthop @hops4"), "the masquerade bypass is unchanged: {on}");
    }

    #[test]
    fn the_script_names_every_set_and_only_strict_mode_has_the_forward_chain() {
        let s = ruleset(&sets(false));
        assert!(s.contains("elements = { 198.18.0.10 }"), "{s}");
        assert!(s.contains("elements = { 2001:db8:18::10 }"), "{s}");
        assert!(s.contains("priority 50;"), "{s}");
        assert!(
            s.contains("ip saddr 198.18.0.11 counter snat ip to ip daddr map { 0.0.0.0-198.51.100.127 : 203.0.113.50, 198.51.101.0-255.255.255.255 : 203.0.113.50 }"),
            "{s}"
        );
        assert!(!s.contains("hook forward"), "{s}");
        assert!(
            s.contains("ip saddr @steered4 ct direction original meta mark set meta mark or 0x1000"),
            "only the pod's own connections are marked: {s}"
        );
        assert!(!s.contains("ct direction reply"), "{s}");
        let s = ruleset(&sets(true));
        assert!(s.contains("hook forward"), "{s}");
        assert!(s.contains("elements = { 198.18.0.0/16 }"), "{s}");
    }

    /// `nft -c` (check only) accepts both variants; skipped without nft.
    #[test]
    fn nft_accepts_the_script() {
        if !crate::test_support::has_tool("nft", "--version") || !crate::test_support::is_root() {
            crate::test_support::skip("nft_accepts_the_script", "needs root and nft");
            return;
        }
        for (strict, tunnel) in [(false, false), (true, false), (false, true), (true, true)] {
            let mut cmd = Command::new("nft");
            cmd.args(["-c", "-f", "-"]);
            run_bounded(&mut cmd, ruleset(&Sets { tunnel, ..sets(strict) }).as_bytes(), NFT_TIMEOUT).unwrap();
        }
    }
}
