//! Wakes the reconcile loop when the host removes what the agent installed.
//!
//! systemd-networkd deletes the routing-policy rules and routes it does not
//! manage when it starts or reconfigures (`ManageForeignRoutingPolicyRules=`
//! and `ManageForeignRoutes=`, both on by default); NetworkManager, cloud
//! agents and a firewall reload (`nft flush ruleset`) do alike. The agent's
//! resync would put everything back only at its next period (30 s), and
//! meanwhile selected pods leave with their node's address. This task
//! listens to the kernel's own notifications and wakes the loop, whose next
//! pass (after its 20 ms debounce) reads the kernel and repairs the
//! difference like any other:
//!
//! - rtnetlink (the rule, route, address and link groups): a rule or a route
//!   with Egret's protocol ([`RTPROT_EGRET`]) deleted, any address deleted
//!   (a PerNode address, or one a route of ours went through), any link
//!   change (the kernel removes an IPv4 route through a link that goes down
//!   without telling);
//! - rtnetlink: any other route of the main table added or deleted whose
//!   prefix covers a next hop in use: the node's path to that next hop may
//!   have changed between on-link and through a router (`tunnel.rs`), and
//!   the pass decides it again;
//! - nftables (`NFNLGRP_NFTABLES`): a transaction that deleted the
//!   `inet egret_node` or `inet egret_node_guard` table and did not add it
//!   back (the agent's own install deletes and adds both in one
//!   transaction; the notifications of a transaction end with
//!   `NFT_MSG_NEWGEN`).
//!
//! The agent's own removals wake it once more, which changes nothing, so
//! this does not loop. rtnetlink notifications lost to an overrun socket
//! (`ENOBUFS`) wake the loop too; lost nftables ones only when a table is
//! then missing (each pass's install notifies every set element, which may
//! overrun the socket: a pass for every overrun would never end).

use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ipnet::IpNet;
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage};
use netlink_packet_route::AddressFamily;
use parking_lot::Mutex;

use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::rule::RuleAttribute;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::protocols::NETLINK_ROUTE;
use netlink_sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket};
use tokio::sync::Notify;

use super::kernel::RTPROT_EGRET;
use super::nft;
use crate::nft_watch::{self, NftTransactions};

// rtnetlink multicast groups (uapi linux/rtnetlink.h, the legacy RTMGRP_*
// bits; the rule groups' bits are 1 << (RTNLGRP_*_RULE - 1)).
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV4_RULE: u32 = 0x80;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;
const RTMGRP_IPV6_RULE: u32 = 1 << (19 - 1);

/// What the task saw (the agent's metrics).
#[derive(Debug, Default)]
pub struct RepairCounters {
    /// Kernel notifications that woke the loop.
    pub wakes: AtomicU64,
    /// Times the kernel dropped notifications (each wakes the loop).
    pub overruns: AtomicU64,
}

/// The next hops the agent's routes use now (the agent updates it every
/// pass): a main-table route change covering one of them wakes a pass.
pub type NextHops = Arc<Mutex<BTreeSet<IpAddr>>>;

/// The main table (`RT_TABLE_MAIN`).
const RT_TABLE_MAIN: u32 = 254;

/// Whether `r`, a route of someone else's, is in the main table and covers
/// one of `hops`.
fn covers_a_next_hop(r: &RouteMessage, hops: &BTreeSet<IpAddr>) -> bool {
    if u8::from(r.header.protocol) == RTPROT_EGRET || hops.is_empty() {
        return false;
    }
    let mut table = u32::from(r.header.table);
    let mut dst = None;
    for a in &r.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Destination(RouteAddress::Inet(a)) => dst = Some(IpAddr::V4(*a)),
            RouteAttribute::Destination(RouteAddress::Inet6(a)) => dst = Some(IpAddr::V6(*a)),
            _ => {}
        }
    }
    if table != RT_TABLE_MAIN {
        return false;
    }
    let base = match (dst, r.header.address_family) {
        (Some(d), _) => d,
        (None, AddressFamily::Inet) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        (None, AddressFamily::Inet6) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
        _ => return false,
    };
    let Ok(net) = IpNet::new(base, r.header.destination_prefix_length) else { return false };
    hops.iter().any(|h| net.contains(h))
}

/// Whether an rtnetlink notification may mean something of the agent's is
/// gone, or the node's path to a next hop in `hops` changed.
pub fn route_wakes(msg: &RouteNetlinkMessage, hops: &BTreeSet<IpAddr>) -> bool {
    match msg {
        RouteNetlinkMessage::DelRule(r) => {
            r.attributes.iter().any(|a| matches!(a, RuleAttribute::Protocol(p) if u8::from(*p) == RTPROT_EGRET))
        }
        RouteNetlinkMessage::DelRoute(r) => u8::from(r.header.protocol) == RTPROT_EGRET || covers_a_next_hop(r, hops),
        RouteNetlinkMessage::NewRoute(r) => covers_a_next_hop(r, hops),
        RouteNetlinkMessage::DelAddress(_) | RouteNetlinkMessage::NewLink(_) | RouteNetlinkMessage::DelLink(_) => true,
        _ => false,
    }
}

fn subscribe(protocol: isize, groups: u32) -> io::Result<TokioSocket> {
    let mut s = TokioSocket::new(protocol)?;
    s.socket_mut().bind(&SocketAddr::new(0, groups))?;
    let _ = s.socket_mut().set_rx_buf_sz(1 << 20);
    Ok(s)
}

/// Subscribes (errors here are the caller's: the agent starts without
/// repairs, saying so) and returns the task's future.
pub fn start(
    wake: Arc<Notify>,
    counters: Arc<RepairCounters>,
    hops: NextHops,
) -> io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let groups = RTMGRP_LINK
        | RTMGRP_IPV4_IFADDR
        | RTMGRP_IPV6_IFADDR
        | RTMGRP_IPV4_ROUTE
        | RTMGRP_IPV6_ROUTE
        | RTMGRP_IPV4_RULE
        | RTMGRP_IPV6_RULE;
    let route = subscribe(NETLINK_ROUTE, groups)?;
    let netfilter = nft_watch::subscribe()?;
    Ok(run(route, netfilter, wake, counters, hops))
}

async fn run(
    route: TokioSocket,
    netfilter: TokioSocket,
    wake: Arc<Notify>,
    counters: Arc<RepairCounters>,
    hops: NextHops,
) {
    let mut transactions = NftTransactions::new(&[nft::TABLE, nft::GUARD_TABLE]);
    let woke = |why: &str| {
        counters.wakes.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(why, "the kernel reports a removal; reconciling now");
        wake.notify_one();
    };
    loop {
        tokio::select! {
            r = route.recv_from_full() => match r {
                Ok((buf, _)) => {
                    let hops = hops.lock().clone();
                    let hit = crate::netlink::decode(&buf).iter().any(|m| match &m.payload {
                        NetlinkPayload::InnerMessage(inner) => route_wakes(inner, &hops),
                        _ => false,
                    });
                    if hit {
                        woke("rtnetlink");
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    counters.overruns.fetch_add(1, Ordering::Relaxed);
                    woke("rtnetlink overrun");
                }
                Err(e) => {
                    tracing::error!(error = %e, "rtnetlink notifications failed; removals are repaired at the resync only");
                    return;
                }
            },
            r = netfilter.recv_from_full() => match r {
                Ok((buf, _)) => {
                    if transactions.on_datagram(&buf) {
                        woke("nftables");
                    }
                }
                // Lost notifications (a pass's install notifies every set
                // element): a pass only if a table is gone, else the pass's
                // own notifications could overrun the socket again forever.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    transactions.reset();
                    counters.overruns.fetch_add(1, Ordering::Relaxed);
                    if !tokio::task::block_in_place(|| nft_watch::tables_present(&[nft::TABLE, nft::GUARD_TABLE])) {
                        woke("nftables overrun, a table missing");
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, "nftables notifications failed; removals are repaired at the resync only");
                    return;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removals_of_ours_wake_the_loop_and_additions_do_not() {
        use netlink_packet_route::route::{RouteMessage, RouteProtocol};
        use netlink_packet_route::rule::RuleMessage;
        let none = BTreeSet::new();
        let mut rule = RuleMessage::default();
        rule.attributes.push(RuleAttribute::Protocol(RouteProtocol::from(RTPROT_EGRET)));
        assert!(route_wakes(&RouteNetlinkMessage::DelRule(rule.clone()), &none));
        assert!(!route_wakes(&RouteNetlinkMessage::NewRule(rule), &none));
        assert!(!route_wakes(&RouteNetlinkMessage::DelRule(RuleMessage::default()), &none), "another's rule");
        let mut r = RouteMessage::default();
        r.header.protocol = RouteProtocol::from(RTPROT_EGRET);
        assert!(route_wakes(&RouteNetlinkMessage::DelRoute(r.clone()), &none));
        assert!(!route_wakes(&RouteNetlinkMessage::NewRoute(r), &none));
        assert!(!route_wakes(&RouteNetlinkMessage::DelRoute(RouteMessage::default()), &none), "a kernel route");
    }

    #[test]
    fn a_main_table_route_towards_a_next_hop_wakes_the_loop() {
        use netlink_packet_route::route::RouteProtocol;
        let hops: BTreeSet<IpAddr> = ["203.0.113.40", "2001:db8:113::40"].iter().map(|s| s.parse().unwrap()).collect();
        let route = |dst: Option<&str>, len: u8, table: u32| {
            let mut r = RouteMessage::default();
            r.header.address_family = AddressFamily::Inet;
            r.header.protocol = RouteProtocol::Static;
            r.header.destination_prefix_length = len;
            r.header.table = 254;
            r.attributes.push(RouteAttribute::Table(table));
            if let Some(d) = dst {
                let ip: IpAddr = d.parse().unwrap();
                r.header.address_family = if ip.is_ipv4() { AddressFamily::Inet } else { AddressFamily::Inet6 };
                r.attributes.push(RouteAttribute::Destination(match ip {
                    IpAddr::V4(a) => RouteAddress::Inet(a),
                    IpAddr::V6(a) => RouteAddress::Inet6(a),
                }));
            }
            r
        };
        for (r, want, what) in [
            (route(Some("203.0.113.0"), 24, 254), true, "its subnet"),
            (route(Some("203.0.113.40"), 32, 254), true, "a host route"),
            (route(None, 0, 254), true, "a default route"),
            (route(Some("2001:db8:113::"), 64, 254), true, "IPv6"),
            (route(Some("198.51.100.0"), 24, 254), false, "elsewhere"),
            (route(Some("203.0.113.0"), 24, 1_000_000), false, "another table"),
        ] {
            assert_eq!(route_wakes(&RouteNetlinkMessage::NewRoute(r.clone()), &hops), want, "new: {what}");
            assert_eq!(route_wakes(&RouteNetlinkMessage::DelRoute(r.clone()), &hops), want, "del: {what}");
            assert!(!route_wakes(&RouteNetlinkMessage::NewRoute(r), &BTreeSet::new()), "{what}: no next hops");
        }
    }
}
