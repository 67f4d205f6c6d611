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
//! - nftables (`NFNLGRP_NFTABLES`): a transaction that deleted the
//!   `inet egret_node` or `inet egret_node_guard` table and did not add it
//!   back (the agent's own install deletes and adds both in one
//!   transaction; the notifications of a transaction end with
//!   `NFT_MSG_NEWGEN`).
//!
//! The agent's own removals wake it once more, which changes nothing, so
//! this does not loop. Kernel notifications lost to an overrun socket
//! (`ENOBUFS`) wake the loop too.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use netlink_packet_core::NetlinkPayload;
use netlink_packet_route::rule::RuleAttribute;
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::protocols::{NETLINK_NETFILTER, NETLINK_ROUTE};
use netlink_sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket};
use tokio::sync::Notify;

use super::kernel::RTPROT_EGRET;
use super::nft;

// rtnetlink multicast groups (uapi linux/rtnetlink.h, the legacy RTMGRP_*
// bits; the rule groups' bits are 1 << (RTNLGRP_*_RULE - 1)).
const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV4_RULE: u32 = 0x80;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;
const RTMGRP_IPV6_RULE: u32 = 1 << (19 - 1);
/// `NFNLGRP_NFTABLES` (uapi linux/netfilter/nfnetlink.h) as a group bit.
const NFNLGRP_NFTABLES_BIT: u32 = 1 << (7 - 1);
/// `NFNL_SUBSYS_NFTABLES << 8 |` `NFT_MSG_NEWTABLE`, `NFT_MSG_DELTABLE`,
/// `NFT_MSG_NEWGEN` (uapi linux/netfilter/nf_tables.h).
const NFT_NEWTABLE: u16 = 10 << 8;
const NFT_DELTABLE: u16 = (10 << 8) | 2;
const NFT_NEWGEN: u16 = (10 << 8) | 15;
/// `NFTA_TABLE_NAME`.
const NFTA_TABLE_NAME: u16 = 1;
/// `NFPROTO_INET`.
const NFPROTO_INET: u8 = 1;

/// What the task saw (the agent's metrics).
#[derive(Debug, Default)]
pub struct RepairCounters {
    /// Kernel notifications that woke the loop.
    pub wakes: AtomicU64,
    /// Times the kernel dropped notifications (each wakes the loop).
    pub overruns: AtomicU64,
}

/// Whether an rtnetlink notification may mean something of the agent's is
/// gone.
pub fn route_wakes(msg: &RouteNetlinkMessage) -> bool {
    match msg {
        RouteNetlinkMessage::DelRule(r) => {
            r.attributes.iter().any(|a| matches!(a, RuleAttribute::Protocol(p) if u8::from(*p) == RTPROT_EGRET))
        }
        RouteNetlinkMessage::DelRoute(r) => u8::from(r.header.protocol) == RTPROT_EGRET,
        RouteNetlinkMessage::DelAddress(_) | RouteNetlinkMessage::NewLink(_) | RouteNetlinkMessage::DelLink(_) => true,
        _ => false,
    }
}

/// What an nftables notification says of the agent's tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NftEvent {
    /// One of them was deleted (in the transaction being notified).
    Deleted,
    /// One of them was added.
    Added,
    /// A transaction ended (`NFT_MSG_NEWGEN`).
    Generation,
}

/// Reads one nfnetlink message (header included); `None` for what does not
/// concern the agent's tables.
pub fn nft_event(msg: &[u8]) -> Option<NftEvent> {
    if msg.len() < 20 {
        return None;
    }
    let kind = match u16::from_ne_bytes([msg[4], msg[5]]) {
        NFT_NEWGEN => return Some(NftEvent::Generation),
        NFT_DELTABLE => NftEvent::Deleted,
        NFT_NEWTABLE => NftEvent::Added,
        _ => return None,
    };
    if msg[16] != NFPROTO_INET {
        return None;
    }
    // Attributes after the header (16) and nfgenmsg (4).
    let mut off = 20;
    while off + 4 <= msg.len() {
        let len = usize::from(u16::from_ne_bytes([msg[off], msg[off + 1]]));
        let attr = u16::from_ne_bytes([msg[off + 2], msg[off + 3]]) & 0x3fff;
        if len < 4 || off + len > msg.len() {
            return None;
        }
        if attr == NFTA_TABLE_NAME {
            let name = &msg[off + 4..off + len];
            let name = name.split(|b| *b == 0).next().unwrap_or_default();
            let ours = name == nft::TABLE.as_bytes() || name == nft::GUARD_TABLE.as_bytes();
            return ours.then_some(kind);
        }
        off += (len + 3) & !3;
    }
    None
}

/// Follows nftables transactions: the agent's own install deletes and adds
/// its tables in one transaction; a transaction that deleted one of them
/// without adding it back removed it.
#[derive(Debug, Default)]
pub struct NftTransactions {
    deleted: i32,
}

impl NftTransactions {
    /// Takes one notification; `true` at the end of a transaction that left
    /// one of the agent's tables deleted.
    pub fn on(&mut self, e: NftEvent) -> bool {
        match e {
            NftEvent::Deleted => self.deleted += 1,
            NftEvent::Added => self.deleted -= 1,
            NftEvent::Generation => return std::mem::take(&mut self.deleted) > 0,
        }
        false
    }
}

/// Each netlink message of a datagram, as byte slices.
fn messages(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut off = 0;
    std::iter::from_fn(move || {
        if off + 16 > buf.len() {
            return None;
        }
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        if len < 16 || off + len > buf.len() {
            return None;
        }
        let m = &buf[off..off + len];
        off += (len + 3) & !3;
        Some(m)
    })
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
) -> io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let groups = RTMGRP_LINK
        | RTMGRP_IPV4_IFADDR
        | RTMGRP_IPV6_IFADDR
        | RTMGRP_IPV4_ROUTE
        | RTMGRP_IPV6_ROUTE
        | RTMGRP_IPV4_RULE
        | RTMGRP_IPV6_RULE;
    let route = subscribe(NETLINK_ROUTE, groups)?;
    let netfilter = subscribe(NETLINK_NETFILTER, NFNLGRP_NFTABLES_BIT)?;
    Ok(run(route, netfilter, wake, counters))
}

async fn run(route: TokioSocket, netfilter: TokioSocket, wake: Arc<Notify>, counters: Arc<RepairCounters>) {
    let mut transactions = NftTransactions::default();
    let woke = |why: &str| {
        counters.wakes.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(why, "the kernel reports a removal; reconciling now");
        wake.notify_one();
    };
    loop {
        tokio::select! {
            r = route.recv_from_full() => match r {
                Ok((buf, _)) => {
                    let hit = crate::netlink::decode(&buf).iter().any(|m| match &m.payload {
                        NetlinkPayload::InnerMessage(inner) => route_wakes(inner),
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
                    let mut removed = false;
                    for e in messages(&buf).filter_map(nft_event) {
                        removed |= transactions.on(e);
                    }
                    if removed {
                        woke("nftables");
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    transactions = NftTransactions::default();
                    counters.overruns.fetch_add(1, Ordering::Relaxed);
                    woke("nftables overrun");
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

    /// An nfnetlink NFT_MSG_DELTABLE for `family`/`name`, as the kernel
    /// sends it (nlmsghdr, nfgenmsg, NFTA_TABLE_NAME, NFTA_TABLE_FLAGS).
    fn deltable(family: u8, name: &str) -> Vec<u8> {
        let mut attrs = Vec::new();
        let mut name_attr = name.as_bytes().to_vec();
        name_attr.push(0);
        let len = 4 + name_attr.len();
        attrs.extend((len as u16).to_ne_bytes());
        attrs.extend(NFTA_TABLE_NAME.to_ne_bytes());
        attrs.extend(&name_attr);
        while attrs.len() % 4 != 0 {
            attrs.push(0);
        }
        attrs.extend(8u16.to_ne_bytes());
        attrs.extend(2u16.to_ne_bytes());
        attrs.extend(0u32.to_be_bytes());
        let total = 16 + 4 + attrs.len();
        let mut m = Vec::new();
        m.extend((total as u32).to_ne_bytes());
        m.extend(NFT_DELTABLE.to_ne_bytes());
        m.extend(0u16.to_ne_bytes());
        m.extend(0u32.to_ne_bytes());
        m.extend(0u32.to_ne_bytes());
        m.extend([family, 0, 0, 0]);
        m.extend(attrs);
        m
    }

    /// A NEWGEN as the kernel sends it (its attributes do not matter here).
    fn newgen() -> Vec<u8> {
        let mut m = deltable(0, "x");
        m[4..6].copy_from_slice(&NFT_NEWGEN.to_ne_bytes());
        m
    }

    fn newtable(name: &str) -> Vec<u8> {
        let mut m = deltable(NFPROTO_INET, name);
        m[4..6].copy_from_slice(&NFT_NEWTABLE.to_ne_bytes());
        m
    }

    #[test]
    fn only_the_deletion_of_our_inet_tables_is_read() {
        assert_eq!(nft_event(&deltable(NFPROTO_INET, nft::TABLE)), Some(NftEvent::Deleted));
        assert_eq!(nft_event(&deltable(NFPROTO_INET, nft::GUARD_TABLE)), Some(NftEvent::Deleted));
        assert_eq!(nft_event(&newtable(nft::TABLE)), Some(NftEvent::Added));
        assert_eq!(nft_event(&deltable(NFPROTO_INET, "filter")), None);
        assert_eq!(nft_event(&deltable(2, nft::TABLE)), None, "ip, not inet");
        assert_eq!(nft_event(&newgen()), Some(NftEvent::Generation));
        let whole = deltable(NFPROTO_INET, nft::TABLE);
        assert_eq!(nft_event(&whole[..26]), None, "a cut name is not read past the message's end");
        assert_eq!(messages(&whole[..whole.len() - 1]).count(), 0, "nor a message shorter than its header says");
    }

    /// The agent's own install (delete and add in one transaction, as `nft
    /// -f` of its script notifies it) wakes nothing; a deletion alone does,
    /// at its transaction's end; so does the agent's first install after one.
    #[test]
    fn a_transaction_that_leaves_a_table_deleted_wakes_the_loop() {
        let feed = |t: &mut NftTransactions, msgs: &[Vec<u8>]| -> bool {
            let buf: Vec<u8> = msgs.concat();
            let mut woke = false;
            for e in messages(&buf).filter_map(nft_event) {
                woke |= t.on(e);
            }
            woke
        };
        let mut t = NftTransactions::default();
        let install = [
            deltable(NFPROTO_INET, nft::TABLE),
            newtable(nft::TABLE),
            deltable(NFPROTO_INET, nft::GUARD_TABLE),
            newtable(nft::GUARD_TABLE),
            newgen(),
        ];
        assert!(!feed(&mut t, &install));
        // Split across datagrams: the same.
        assert!(!feed(&mut t, &install[..2]));
        assert!(!feed(&mut t, &install[2..]));
        assert!(feed(&mut t, &[deltable(NFPROTO_INET, nft::GUARD_TABLE), newgen()]));
        assert!(!feed(&mut t, &[deltable(NFPROTO_INET, "filter"), newgen()]), "another's table");
        assert!(feed(
            &mut t,
            &[deltable(NFPROTO_INET, nft::TABLE), deltable(NFPROTO_INET, nft::GUARD_TABLE), newgen()]
        ));
        assert!(!feed(&mut t, &install), "the repair itself");
    }

    #[test]
    fn removals_of_ours_wake_the_loop_and_additions_do_not() {
        use netlink_packet_route::route::{RouteMessage, RouteProtocol};
        use netlink_packet_route::rule::RuleMessage;
        let mut rule = RuleMessage::default();
        rule.attributes.push(RuleAttribute::Protocol(RouteProtocol::from(RTPROT_EGRET)));
        assert!(route_wakes(&RouteNetlinkMessage::DelRule(rule.clone())));
        assert!(!route_wakes(&RouteNetlinkMessage::NewRule(rule)));
        assert!(!route_wakes(&RouteNetlinkMessage::DelRule(RuleMessage::default())), "another's rule");
        let mut r = RouteMessage::default();
        r.header.protocol = RouteProtocol::from(RTPROT_EGRET);
        assert!(route_wakes(&RouteNetlinkMessage::DelRoute(r.clone())));
        assert!(!route_wakes(&RouteNetlinkMessage::NewRoute(r)));
        assert!(!route_wakes(&RouteNetlinkMessage::DelRoute(RouteMessage::default())), "a kernel route");
    }
}
