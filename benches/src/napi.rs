//! Netlink requests the benchmark needs: an interface's NAPI instances and
//! their kernel threads through the `netdev` generic netlink family (`NETDEV_CMD_NAPI_GET`, Linux 6.9+:
//! the `pid` attribute is present when the NAPI instance is threaded).
//!
//! Thread names (`napi/<dev>-<id>`) are truncated to 15 characters and are
//! not unique across namespaces; the netlink answer is exact. And flushing
//! a namespace's conntrack table between kernel runs (ctnetlink). Message
//! layouts: `include/uapi/linux/netlink.h`, `genetlink.h`, `netdev.h`,
//! `netfilter/nfnetlink.h`.

use std::io;

use crate::sys::Netlink;

const NLMSG_HDR: usize = 16;
const GENL_HDR: usize = 4;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const GENL_ID_CTRL: u16 = 0x10;
const CTRL_CMD_GETFAMILY: u8 = 3;
const CTRL_ATTR_FAMILY_ID: u16 = 1;
const CTRL_ATTR_FAMILY_NAME: u16 = 2;
const NETDEV_CMD_NAPI_GET: u8 = 11;
const NETDEV_A_NAPI_IFINDEX: u16 = 1;
const NETDEV_A_NAPI_ID: u16 = 2;
const NETDEV_A_NAPI_PID: u16 = 4;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// One NAPI instance of an interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NapiInfo {
    pub ifindex: u32,
    pub id: u32,
    /// The kthread polling it, when threaded.
    pub pid: Option<u32>,
}

/// What failed asking the kernel.
#[derive(Debug, thiserror::Error)]
pub enum NapiError {
    #[error("netlink I/O for {what} failed: {source}")]
    Io { what: &'static str, source: io::Error },
    #[error("the kernel answered {what} with error {errno}")]
    Kernel { what: &'static str, errno: i32 },
    #[error("malformed netlink answer to {what}")]
    Malformed { what: &'static str },
    #[error("the kernel has no netdev netlink family (Linux 6.9+ needed for NAPI threads)")]
    NoFamily,
}

fn push_attr(buf: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&ty.to_ne_bytes());
    buf.extend_from_slice(payload);
    while !buf.len().is_multiple_of(4) {
        buf.push(0);
    }
}

/// A generic netlink request: header, genl header, attributes.
fn genl_request(family: u16, flags: u16, seq: u32, cmd: u8, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut b = vec![0u8; NLMSG_HDR];
    b.extend_from_slice(&[cmd, 1, 0, 0]);
    for (ty, p) in attrs {
        push_attr(&mut b, *ty, p);
    }
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..6].copy_from_slice(&family.to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// One message of a datagram: (type, payload after the netlink header).
fn messages(buf: &[u8]) -> impl Iterator<Item = Option<(u16, &[u8])>> {
    let mut off = 0usize;
    std::iter::from_fn(move || {
        if off + NLMSG_HDR > buf.len() {
            return None;
        }
        let len = u32::from_ne_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        let ty = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        if len < NLMSG_HDR || off + len > buf.len() {
            off = buf.len();
            return Some(None);
        }
        let payload = &buf[off + NLMSG_HDR..off + len];
        off += (len + 3) & !3;
        Some(Some((ty, payload)))
    })
}

/// Attributes of a genl payload (after the 4-byte genl header).
fn attrs(payload: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    let mut off = GENL_HDR;
    std::iter::from_fn(move || {
        if off + 4 > payload.len() {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([payload[off], payload[off + 1]]));
        let ty = u16::from_ne_bytes([payload[off + 2], payload[off + 3]]) & NLA_TYPE_MASK;
        if len < 4 || off + len > payload.len() {
            return None;
        }
        let v = &payload[off + 4..off + len];
        off += (len + 3) & !3;
        Some((ty, v))
    })
}

fn u32_of(v: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(v.get(..4)?.try_into().ok()?))
}

fn error_code(payload: &[u8]) -> i32 {
    payload.get(..4).and_then(|b| b.try_into().ok()).map_or(0, i32::from_ne_bytes)
}

/// Parse the NAPI entries of one dump datagram; `Ok(true)` when the dump is
/// done.
fn parse_napi_datagram(buf: &[u8], out: &mut Vec<NapiInfo>) -> Result<bool, NapiError> {
    const WHAT: &str = "NAPI_GET";
    for m in messages(buf) {
        let (ty, payload) = m.ok_or(NapiError::Malformed { what: WHAT })?;
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let errno = error_code(payload);
                if errno != 0 {
                    return Err(NapiError::Kernel { what: WHAT, errno });
                }
            }
            _ => {
                let (mut ifindex, mut id, mut pid) = (None, None, None);
                for (a, v) in attrs(payload) {
                    match a {
                        NETDEV_A_NAPI_IFINDEX => ifindex = u32_of(v),
                        NETDEV_A_NAPI_ID => id = u32_of(v),
                        NETDEV_A_NAPI_PID => pid = u32_of(v),
                        _ => {}
                    }
                }
                let (Some(ifindex), Some(id)) = (ifindex, id) else {
                    return Err(NapiError::Malformed { what: WHAT });
                };
                out.push(NapiInfo { ifindex, id, pid: pid.filter(|p| *p != 0) });
            }
        }
    }
    Ok(false)
}

/// The NAPI instances of `ifindex` in the calling thread's namespace.
pub fn napi_of(ifindex: u32) -> Result<Vec<NapiInfo>, NapiError> {
    let nl = Netlink::open(libc::NETLINK_GENERIC).map_err(|source| NapiError::Io { what: "socket", source })?;
    let mut buf = vec![0u8; 32 * 1024];

    let req = genl_request(GENL_ID_CTRL, 0, 1, CTRL_CMD_GETFAMILY, &[(CTRL_ATTR_FAMILY_NAME, b"netdev\0")]);
    nl.send(&req).map_err(|source| NapiError::Io { what: "GETFAMILY", source })?;
    let n = nl.recv(&mut buf).map_err(|source| NapiError::Io { what: "GETFAMILY", source })?;
    let mut family = None;
    for m in messages(&buf[..n]) {
        let (ty, payload) = m.ok_or(NapiError::Malformed { what: "GETFAMILY" })?;
        if ty == NLMSG_ERROR {
            return match error_code(payload) {
                0 => continue,
                e if e == -libc::ENOENT => Err(NapiError::NoFamily),
                errno => Err(NapiError::Kernel { what: "GETFAMILY", errno }),
            };
        }
        family = attrs(payload)
            .find(|(a, _)| *a == CTRL_ATTR_FAMILY_ID)
            .and_then(|(_, v)| Some(u16::from_ne_bytes(v.get(..2)?.try_into().ok()?)));
    }
    let family = family.ok_or(NapiError::NoFamily)?;

    let req =
        genl_request(family, NLM_F_DUMP, 2, NETDEV_CMD_NAPI_GET, &[(NETDEV_A_NAPI_IFINDEX, &ifindex.to_ne_bytes())]);
    nl.send(&req).map_err(|source| NapiError::Io { what: "NAPI_GET", source })?;
    let mut out = Vec::new();
    loop {
        let n = nl.recv(&mut buf).map_err(|source| NapiError::Io { what: "NAPI_GET", source })?;
        if parse_napi_datagram(&buf[..n], &mut out)? {
            break;
        }
    }
    out.retain(|i| i.ifindex == ifindex);
    Ok(out)
}

/// The request that flushes the conntrack table of the calling thread's
/// namespace: ctnetlink `IPCTNL_MSG_CT_DELETE` with no attributes, for IPv4
/// (`include/uapi/linux/netfilter/nfnetlink_conntrack.h`).
fn conntrack_flush_request(seq: u32) -> Vec<u8> {
    const NFNL_SUBSYS_CTNETLINK: u16 = 1;
    const IPCTNL_MSG_CT_DELETE: u16 = 2;
    const NLM_F_ACK: u16 = 0x4;
    let mut b = Vec::with_capacity(20);
    b.extend_from_slice(&20u32.to_ne_bytes());
    b.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE).to_ne_bytes());
    b.extend_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    b.extend_from_slice(&seq.to_ne_bytes());
    b.extend_from_slice(&0u32.to_ne_bytes());
    // struct nfgenmsg: family, version, res_id (big endian).
    b.extend_from_slice(&[libc::AF_INET as u8, 0, 0, 0]);
    b
}

/// Flush the IPv4 conntrack table of the calling thread's namespace.
pub fn flush_conntrack() -> Result<(), NapiError> {
    const WHAT: &str = "conntrack flush";
    let nl = Netlink::open(libc::NETLINK_NETFILTER).map_err(|source| NapiError::Io { what: WHAT, source })?;
    nl.send(&conntrack_flush_request(1)).map_err(|source| NapiError::Io { what: WHAT, source })?;
    let mut buf = vec![0u8; 4096];
    let n = nl.recv(&mut buf).map_err(|source| NapiError::Io { what: WHAT, source })?;
    for m in messages(&buf[..n]) {
        let (ty, payload) = m.ok_or(NapiError::Malformed { what: WHAT })?;
        if ty == NLMSG_ERROR {
            return match error_code(payload) {
                0 => Ok(()),
                errno => Err(NapiError::Kernel { what: WHAT, errno }),
            };
        }
    }
    Err(NapiError::Malformed { what: WHAT })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reply(ty: u16, attrs_: &[(u16, &[u8])]) -> Vec<u8> {
        let mut b = genl_request(ty, 0, 0, 1, attrs_);
        b[6..8].copy_from_slice(&0u16.to_ne_bytes());
        b
    }

    #[test]
    fn request_layout() {
        let r = genl_request(0x1a, NLM_F_DUMP, 7, NETDEV_CMD_NAPI_GET, &[(NETDEV_A_NAPI_IFINDEX, &5u32.to_ne_bytes())]);
        assert_eq!(r.len(), 16 + 4 + 8);
        assert_eq!(u32::from_ne_bytes(r[0..4].try_into().expect("4")), 28);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 0x1a);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), 0x301);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().expect("4")), 7);
        assert_eq!(&r[16..20], &[11, 1, 0, 0]);
        assert_eq!(&r[20..24], &[8, 0, 1, 0]);
        assert_eq!(&r[24..28], &5u32.to_ne_bytes());
        // Strings are padded to 4 bytes.
        let g = genl_request(GENL_ID_CTRL, 0, 1, CTRL_CMD_GETFAMILY, &[(CTRL_ATTR_FAMILY_NAME, b"netdev\0")]);
        assert_eq!(g.len(), 16 + 4 + 12);
    }

    #[test]
    fn conntrack_flush_layout() {
        let r = conntrack_flush_request(9);
        assert_eq!(r.len(), 20);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), 0x0102);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), 0x5);
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().expect("4")), 9);
        assert_eq!(&r[16..20], &[2, 0, 0, 0]);
    }

    #[test]
    fn dump_parsing() {
        let mut d = reply(0x1a, &[(1, &7u32.to_ne_bytes()), (2, &289u32.to_ne_bytes()), (4, &5727u32.to_ne_bytes())]);
        d.extend(reply(0x1a, &[(1, &7u32.to_ne_bytes()), (2, &290u32.to_ne_bytes())]));
        let mut out = Vec::new();
        assert!(!parse_napi_datagram(&d, &mut out).expect("parse"));
        assert_eq!(
            out,
            vec![NapiInfo { ifindex: 7, id: 289, pid: Some(5727) }, NapiInfo { ifindex: 7, id: 290, pid: None }]
        );
        let done = reply(NLMSG_DONE, &[]);
        assert!(parse_napi_datagram(&done, &mut out).expect("done"));
        let mut err = reply(NLMSG_ERROR, &[]);
        err[16..20].copy_from_slice(&(-95i32).to_ne_bytes());
        assert!(matches!(parse_napi_datagram(&err, &mut out), Err(NapiError::Kernel { errno: -95, .. })));
        let missing_id = reply(0x1a, &[(1, &7u32.to_ne_bytes())]);
        assert!(matches!(parse_napi_datagram(&missing_id, &mut out), Err(NapiError::Malformed { .. })));
    }
}
