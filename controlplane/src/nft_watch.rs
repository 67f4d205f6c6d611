//! Notifications of nftables changes: which of a daemon's own tables a
//! transaction removed.
//!
//! Egret's tables are replaced whole by `nft -f` scripts that delete and
//! add each table in one transaction, so a deletion alone says nothing:
//! [`NftTransactions`] follows the notifications of each transaction
//! (`NFT_MSG_DELTABLE`, `NFT_MSG_NEWTABLE`, ended by `NFT_MSG_NEWGEN`,
//! uapi linux/netfilter/nf_tables.h) and reports one that left a watched
//! table deleted: another program removed it (`nft delete table`, `nft
//! flush ruleset` in a firewall reload). The node agent's repair
//! (`node/repair.rs`) and the gateway's fail-closed table
//! (`daemon::spawn_fail_closed_repair`) use it.

use std::io;

use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::{AsyncSocket, SocketAddr, TokioSocket};

/// `NFNLGRP_NFTABLES` (uapi linux/netfilter/nfnetlink.h) as a group bit.
const NFNLGRP_NFTABLES_BIT: u32 = 1 << (7 - 1);
/// `NFNL_SUBSYS_NFTABLES << 8 |` `NFT_MSG_NEWTABLE`, `NFT_MSG_DELTABLE`,
/// `NFT_MSG_NEWGEN`.
const NFT_NEWTABLE: u16 = 10 << 8;
const NFT_DELTABLE: u16 = (10 << 8) | 2;
const NFT_NEWGEN: u16 = (10 << 8) | 15;
/// `NFTA_TABLE_NAME`.
const NFTA_TABLE_NAME: u16 = 1;
/// `NFPROTO_INET`: Egret's tables are all `inet`.
const NFPROTO_INET: u8 = 1;

/// Whether every one of the `inet` tables `names` is in the kernel now
/// (`nft list tables inet`: names only, cheap whatever the tables hold). A
/// failure to ask counts as missing (a needless repair is harmless).
/// After lost notifications (`ENOBUFS`) this decides, not a blind repair:
/// a repair's own notifications (one per set element) may overrun the
/// socket again, and a blind repair would then repeat without end.
pub fn tables_present(names: &[&str]) -> bool {
    let out = std::process::Command::new("nft").args(["list", "tables", "inet"]).output();
    let Ok(out) = out else { return false };
    if !out.status.success() {
        return false;
    }
    let listed = String::from_utf8_lossy(&out.stdout);
    names.iter().all(|n| listed.lines().any(|l| l.trim() == format!("table inet {n}")))
}

/// A socket subscribed to nftables' notifications in this network namespace.
pub fn subscribe() -> io::Result<TokioSocket> {
    let mut s = TokioSocket::new(NETLINK_NETFILTER)?;
    s.socket_mut().bind(&SocketAddr::new(0, NFNLGRP_NFTABLES_BIT))?;
    let _ = s.socket_mut().set_rx_buf_sz(1 << 20);
    Ok(s)
}

/// What an nftables notification says of the watched tables.
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
/// concern the `inet` tables called `names`.
pub fn nft_event(msg: &[u8], names: &[&str]) -> Option<NftEvent> {
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
            return names.iter().any(|n| n.as_bytes() == name).then_some(kind);
        }
        off += (len + 3) & !3;
    }
    None
}

/// Follows nftables transactions over the `inet` tables called `names`.
#[derive(Debug)]
pub struct NftTransactions {
    names: Vec<&'static str>,
    deleted: i32,
}

impl NftTransactions {
    /// Watches the `inet` tables called `names`.
    pub fn new(names: &[&'static str]) -> Self {
        Self { names: names.to_vec(), deleted: 0 }
    }

    /// Forgets a transaction in progress (notifications were lost).
    pub fn reset(&mut self) {
        self.deleted = 0;
    }

    /// Takes one datagram of notifications; `true` when a transaction in it
    /// ended with one of the tables deleted.
    pub fn on_datagram(&mut self, buf: &[u8]) -> bool {
        let mut removed = false;
        for m in messages(buf) {
            if let Some(e) = nft_event(m, &self.names) {
                removed |= self.on(e);
            }
        }
        removed
    }

    /// Takes one notification; `true` at the end of a transaction that left
    /// one of the tables deleted.
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
pub fn messages(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
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

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "egret_node";
    const GUARD_TABLE: &str = "egret_node_guard";
    const NAMES: &[&str] = &[TABLE, GUARD_TABLE];

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
        assert_eq!(nft_event(&deltable(NFPROTO_INET, TABLE), NAMES), Some(NftEvent::Deleted));
        assert_eq!(nft_event(&deltable(NFPROTO_INET, GUARD_TABLE), NAMES), Some(NftEvent::Deleted));
        assert_eq!(nft_event(&newtable(TABLE), NAMES), Some(NftEvent::Added));
        assert_eq!(nft_event(&deltable(NFPROTO_INET, "filter"), NAMES), None);
        assert_eq!(nft_event(&deltable(2, TABLE), NAMES), None, "ip, not inet");
        assert_eq!(nft_event(&newgen(), NAMES), Some(NftEvent::Generation));
        let whole = deltable(NFPROTO_INET, TABLE);
        assert_eq!(nft_event(&whole[..26], NAMES), None, "a cut name is not read past the message's end");
        assert_eq!(messages(&whole[..whole.len() - 1]).count(), 0, "nor a message shorter than its header says");
    }

    /// The agent's own install (delete and add in one transaction, as `nft
    /// -f` of its script notifies it) wakes nothing; a deletion alone does,
    /// at its transaction's end; the repair's install (adding the table back)
    /// does not.
    #[test]
    fn a_transaction_that_leaves_a_table_deleted_wakes_the_loop() {
        let feed = |t: &mut NftTransactions, msgs: &[Vec<u8>]| -> bool { t.on_datagram(&msgs.concat()) };
        let mut t = NftTransactions::new(NAMES);
        let install = [
            deltable(NFPROTO_INET, TABLE),
            newtable(TABLE),
            deltable(NFPROTO_INET, GUARD_TABLE),
            newtable(GUARD_TABLE),
            newgen(),
        ];
        assert!(!feed(&mut t, &install));
        // Split across datagrams: the same.
        assert!(!feed(&mut t, &install[..2]));
        assert!(!feed(&mut t, &install[2..]));
        assert!(feed(&mut t, &[deltable(NFPROTO_INET, GUARD_TABLE), newgen()]));
        assert!(!feed(&mut t, &[deltable(NFPROTO_INET, "filter"), newgen()]), "another's table");
        assert!(feed(&mut t, &[deltable(NFPROTO_INET, TABLE), deltable(NFPROTO_INET, GUARD_TABLE), newgen()]));
        assert!(!feed(&mut t, &install), "the repair itself");
    }
}
