//! Drop counters that survive the replacement of their nftables table.
//!
//! Egret replaces its tables whole (`delete table` and the new table in one
//! `nft -f` transaction: the gateway's `inet egret_failclosed` on every
//! apply, the node agent's `inet egret_node` and `inet egret_node_guard` on
//! every pass), which resets every anonymous `counter` in them: the drop
//! counts operators read with `nft list` started again from zero every
//! 30 s. The counters that matter are therefore named counter objects.
//! Before a replacement the installer reads the table's counters and
//! declares each counter of the new table with the values the old one had
//! under the same name. Packets counted between the read and the
//! replacement (a few milliseconds) are lost; a counter whose name is gone
//! (a deleted policy) goes.
//!
//! The read is one nfnetlink dump (`NFT_MSG_GETOBJ` filtered by the kernel
//! to the table and to counters), not `nft list counters`: nft before 1.1.1
//! fetches the whole ruleset for that, set elements included (0.45 s beside
//! a fail-closed map of 65,536 sources, 1.7 s beside a CNI's 250,000
//! elements, measured with nft 1.0.6). A policy's counter is named after a
//! hash of the policy's name (`p_<16 hex digits>`): names may be longer
//! than an nft comment's 128 bytes and hold any character, and kernels
//! before 5.10 drop counter objects' comments; the comment (cut to fit)
//! only tells a reader which policy it is.

use std::collections::BTreeMap;
use std::io;
use std::time::{Duration, Instant};

use netlink_sys::protocols::NETLINK_NETFILTER;
use netlink_sys::{Socket, SocketAddr};

/// Counter values by counter name: (packets, bytes).
pub type Carried = BTreeMap<String, (u64, u64)>;

/// How long the read may take before the new counters start from zero.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// `NFNL_SUBSYS_NFTABLES << 8 |` `NFT_MSG_GETOBJ` / `NFT_MSG_NEWOBJ`.
const NFT_GETOBJ: u16 = (10 << 8) | 19;
const NFT_NEWOBJ: u16 = (10 << 8) | 18;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NFPROTO_INET: u8 = 1;
/// `NFTA_OBJ_TABLE`, `NFTA_OBJ_NAME`, `NFTA_OBJ_TYPE`, `NFTA_OBJ_DATA`.
const NFTA_OBJ_TABLE: u16 = 1;
const NFTA_OBJ_NAME: u16 = 2;
const NFTA_OBJ_TYPE: u16 = 3;
const NFTA_OBJ_DATA: u16 = 4;
/// `NFT_OBJECT_COUNTER`; `NFTA_COUNTER_BYTES`, `NFTA_COUNTER_PACKETS`.
const NFT_OBJECT_COUNTER: u32 = 1;
const NFTA_COUNTER_BYTES: u16 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;

/// The named counters of the `inet` tables `tables` now. A table that does
/// not exist has none; a read that fails is logged and its counters start
/// again from zero (never an apply's failure).
pub fn read(tables: &[&str]) -> Carried {
    let mut all = Carried::new();
    for t in tables {
        match dump(t) {
            Ok(c) => all.extend(c),
            Err(e) => tracing::warn!(table = t, error = %e, "nftables counters not read; they start again from zero"),
        }
    }
    all
}

/// The counter name of the policy called `policy`: `p_` and 16 hex digits
/// of its name's FNV-1a hash (stable across versions and restarts).
pub fn policy_counter(policy: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in policy.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("p_{h:016x}")
}

/// Declares counter `name` (with `comment`, made safe for nft: no quotes
/// or control characters, at most 128 bytes) with the values `carried`
/// has for `name`; rules count with `counter name "<name>"`.
pub fn declare(out: &mut String, name: &str, comment: &str, carried: &Carried) {
    let (packets, bytes) = carried.get(name).copied().unwrap_or_default();
    let comment = safe_comment(comment);
    out.push_str(&format!(
        "  counter {name} {{\n    comment \"{comment}\"\n    packets {packets} bytes {bytes}\n  }}\n"
    ));
}

/// `text` as an nft comment: quotes and control characters dropped, cut at
/// a character boundary to nft's 128 bytes.
pub fn safe_comment(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars().filter(|c| *c != '"' && !c.is_control()) {
        if out.len() + c.len_utf8() > 128 {
            break;
        }
        out.push(c);
    }
    out
}

/// One `NFT_MSG_GETOBJ` dump of `inet <table>`'s counters.
fn dump(table: &str) -> io::Result<Carried> {
    let mut s = Socket::new(NETLINK_NETFILTER)?;
    s.bind_auto()?;
    s.connect(&SocketAddr::new(0, 0))?;
    s.set_non_blocking(true)?;
    s.send(&request(table), 0)?;
    let deadline = Instant::now() + READ_TIMEOUT;
    let mut out = Carried::new();
    loop {
        let mut buf: Vec<u8> = Vec::with_capacity(1 << 16);
        match s.recv(&mut buf, 0) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    return Err(io::Error::new(io::ErrorKind::TimedOut, "no answer within 1 s"));
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Err(e) => return Err(e),
        }
        for m in crate::nft_watch::messages(&buf) {
            match u16::from_ne_bytes([m[4], m[5]]) {
                NLMSG_DONE => return Ok(out),
                NLMSG_ERROR => {
                    let code = m.get(16..20).map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                    // No such table: no counters.
                    if code == -libc::ENOENT || code == 0 {
                        return Ok(out);
                    }
                    return Err(io::Error::from_raw_os_error(-code));
                }
                NFT_NEWOBJ => {
                    if let Some((name, values)) = counter(m) {
                        out.insert(name, values);
                    }
                }
                _ => {}
            }
        }
    }
}

/// The dump request: nlmsghdr, nfgenmsg (inet), the table and the type.
fn request(table: &str) -> Vec<u8> {
    let mut m = vec![0u8; 16];
    m[4..6].copy_from_slice(&NFT_GETOBJ.to_ne_bytes());
    m[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    m[8..12].copy_from_slice(&1u32.to_ne_bytes());
    m.extend_from_slice(&[NFPROTO_INET, 0, 0, 0]);
    let mut name = table.as_bytes().to_vec();
    name.push(0);
    attr(&mut m, NFTA_OBJ_TABLE, &name);
    attr(&mut m, NFTA_OBJ_TYPE, &NFT_OBJECT_COUNTER.to_be_bytes());
    let len = m.len() as u32;
    m[0..4].copy_from_slice(&len.to_ne_bytes());
    m
}

fn attr(m: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let len = 4 + value.len();
    m.extend_from_slice(&(len as u16).to_ne_bytes());
    m.extend_from_slice(&kind.to_ne_bytes());
    m.extend_from_slice(value);
    m.resize(m.len() + ((4 - len % 4) % 4), 0);
}

/// The attributes of `buf` as (type without flags, value).
fn attrs(buf: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut off = 0;
    std::iter::from_fn(move || {
        if off + 4 > buf.len() {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([buf[off], buf[off + 1]]));
        let kind = u16::from_ne_bytes([buf[off + 2], buf[off + 3]]) & 0x3fff;
        if len < 4 || off + len > buf.len() {
            return None;
        }
        let value = &buf[off + 4..off + len];
        off += (len + 3) & !3;
        Some((kind, value))
    })
}

/// A `NFT_MSG_NEWOBJ` counter: its name and (packets, bytes).
fn counter(msg: &[u8]) -> Option<(String, (u64, u64))> {
    let (mut name, mut packets, mut bytes) = (None, None, None);
    for (kind, value) in attrs(msg.get(20..)?) {
        match kind {
            NFTA_OBJ_NAME => {
                name = Some(String::from_utf8_lossy(value.split(|b| *b == 0).next().unwrap_or_default()).into_owned());
            }
            NFTA_OBJ_DATA => {
                for (k, v) in attrs(value) {
                    let n = <[u8; 8]>::try_from(v).ok().map(u64::from_be_bytes);
                    match k {
                        NFTA_COUNTER_BYTES => bytes = n,
                        NFTA_COUNTER_PACKETS => packets = n,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((name?, (packets?, bytes?)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn counters_are_declared_with_their_carried_values_and_safe_comments() {
        let carried = Carried::from([("p_1".to_string(), (5, 300))]);
        let mut out = String::new();
        declare(&mut out, "p_1", "policy \"db\"\n", &carried);
        assert_eq!(out, "  counter p_1 {\n    comment \"policy db\"\n    packets 5 bytes 300\n  }\n");
        let long = format!("policy service/{}/{}", "n".repeat(63), "é".repeat(40));
        let c = safe_comment(&long);
        assert!(c.len() <= 128 && long.starts_with(&c), "{c}");
    }

    #[test]
    fn policy_counter_names_are_stable_and_distinct() {
        assert_eq!(policy_counter("egresspolicy/db"), policy_counter("egresspolicy/db"));
        assert_ne!(policy_counter("a\"b"), policy_counter("ab"));
        let n = policy_counter(&"x".repeat(300));
        assert_eq!(n.len(), 18, "{n}");
        // FNV-1a 64 of the empty string: the offset basis.
        assert_eq!(policy_counter(""), "p_cbf29ce484222325");
    }

    #[test]
    fn a_counter_object_message_is_read() {
        let mut m = vec![0u8; 16];
        m[4..6].copy_from_slice(&NFT_NEWOBJ.to_ne_bytes());
        m.extend_from_slice(&[NFPROTO_INET, 0, 0, 0]);
        attr(&mut m, NFTA_OBJ_TABLE, b"egret_failclosed\0");
        attr(&mut m, NFTA_OBJ_NAME, b"untranslated\0");
        let mut data = Vec::new();
        attr(&mut data, NFTA_COUNTER_BYTES, &300u64.to_be_bytes());
        attr(&mut data, NFTA_COUNTER_PACKETS, &5u64.to_be_bytes());
        attr(&mut m, NFTA_OBJ_DATA | 0x8000, &data);
        assert_eq!(counter(&m), Some(("untranslated".to_string(), (5, 300))));
        let r = request("egret_node");
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().unwrap()) as usize, r.len());
    }
}
