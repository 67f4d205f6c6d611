//! What gateways say to each other over the channel (`channel.rs` carries
//! the frames; this file gives their payloads meaning).
//!
//! Every payload is a small hand-written binary encoding (the channel
//! already authenticates, orders and bounds frames): addresses are one
//! family byte (4 or 6) and the octets, counts and epochs are big-endian,
//! strings are a u16 length and UTF-8. Session records use the data
//! plane's own encoding (`egret_dataplane::nat::sync`). Anything malformed
//! is an error naming what was wrong, never a panic.
//!
//! | kind | message | direction |
//! |---|---|---|
//! | 1 | [`Message::Sessions`]: upserts and removals of one egress IP's sessions | holder -> standby |
//! | 2 | [`Message::FullBegin`]: a full copy of one IP's sessions starts (epoch) | holder -> standby |
//! | 3 | [`Message::FullEnd`]: it ended, with the count sent | holder -> standby |
//! | 4 | [`Message::SyncAck`]: the standby holds that full copy | standby -> holder |
//! | 5 | [`Message::FailsafeRequest`]: may I keep these IPs? (API server unreachable) | holder -> peers |
//! | 6 | [`Message::FailsafeReply`]: accepted / refused, per IP | peer -> holder |
//! | 7 | [`Message::DropShadow`]: you are no longer the standby of this IP | holder -> standby |
//! | 8 | [`Message::PromisesKept`]: my promises to you for these IPs outlive my restart (only right before a Goodbye) | peer -> holder |

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use egret_dataplane::nat::sync::{SessionKeyRecord, SessionRecord};

/// One message between gateways.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Changes to the sessions of `ip`: part of full copy `epoch`, or
    /// incremental when `epoch` is 0.
    Sessions {
        /// The egress IP.
        ip: IpAddr,
        /// The full copy this belongs to (0: incremental).
        epoch: u64,
        /// Sessions created or refreshed.
        upserts: Vec<SessionRecord>,
        /// Sessions removed.
        removes: Vec<SessionKeyRecord>,
    },
    /// A full copy of `ip`'s sessions starts: the standby collects it aside.
    FullBegin {
        /// The egress IP.
        ip: IpAddr,
        /// Its number (increasing per holder process).
        epoch: u64,
    },
    /// The full copy ended; `count` records were sent in it.
    FullEnd {
        /// The egress IP.
        ip: IpAddr,
        /// Its number.
        epoch: u64,
        /// Records sent.
        count: u64,
    },
    /// The standby replaced its shadow of `ip` with full copy `epoch`.
    SyncAck {
        /// The egress IP.
        ip: IpAddr,
        /// The copy.
        epoch: u64,
    },
    /// The sender holds these IPs and cannot renew their Leases: may it
    /// keep them? (Patroni's failsafe POST.)
    FailsafeRequest {
        /// Matches the reply.
        id: u64,
        /// The IPs.
        ips: Vec<IpAddr>,
    },
    /// The answer: accepted IPs carry the promise not to take them for
    /// leaseDuration; refused ones say why.
    FailsafeReply {
        /// The request's id.
        id: u64,
        /// Accepted.
        accepted: Vec<IpAddr>,
        /// Refused, with the reason.
        refused: Vec<(IpAddr, String)>,
    },
    /// The receiver is no longer the standby of `ip`: forget its shadow.
    DropShadow {
        /// The egress IP.
        ip: IpAddr,
    },
    /// The sender stops gracefully and wrote its failsafe promises to the
    /// receiver for `ips` into its peer cache: its next process on this node
    /// keeps them (`ha::promises`). Sent only in the same write as the
    /// Goodbye (`Peers::send_before_goodbye`).
    PromisesKept {
        /// The IPs.
        ips: Vec<IpAddr>,
    },
}

/// Why a payload could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Shorter than its fields say.
    #[error("message kind {kind}: truncated at byte {at} reading {what}")]
    Truncated {
        /// The frame kind.
        kind: u8,
        /// Offset.
        at: usize,
        /// The field.
        what: &'static str,
    },
    /// A field holds an impossible value.
    #[error("message kind {kind}: {what} is invalid ({detail})")]
    Invalid {
        /// The frame kind.
        kind: u8,
        /// The field.
        what: &'static str,
        /// Details.
        detail: String,
    },
    /// Bytes left over after the last field.
    #[error("message kind {kind}: {extra} bytes after the end")]
    Trailing {
        /// The frame kind.
        kind: u8,
        /// How many.
        extra: usize,
    },
    /// Not a kind this version knows.
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
}

/// Frame kinds.
pub mod kind {
    /// [`super::Message::Sessions`].
    pub const SESSIONS: u8 = 1;
    /// [`super::Message::FullBegin`].
    pub const FULL_BEGIN: u8 = 2;
    /// [`super::Message::FullEnd`].
    pub const FULL_END: u8 = 3;
    /// [`super::Message::SyncAck`].
    pub const SYNC_ACK: u8 = 4;
    /// [`super::Message::FailsafeRequest`].
    pub const FAILSAFE_REQUEST: u8 = 5;
    /// [`super::Message::FailsafeReply`].
    pub const FAILSAFE_REPLY: u8 = 6;
    /// [`super::Message::DropShadow`].
    pub const DROP_SHADOW: u8 = 7;
    /// [`super::Message::PromisesKept`].
    pub const PROMISES_KEPT: u8 = 8;
}

fn put_ip(out: &mut Vec<u8>, ip: IpAddr) {
    match ip {
        IpAddr::V4(a) => {
            out.push(4);
            out.extend_from_slice(&a.octets());
        }
        IpAddr::V6(a) => {
            out.push(6);
            out.extend_from_slice(&a.octets());
        }
    }
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_be_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let b = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    out.extend_from_slice(&(b.len() as u16).to_be_bytes());
    out.extend_from_slice(b);
}

fn put_count(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&(u32::try_from(n).unwrap_or(u32::MAX)).to_be_bytes());
}

struct Reader<'a> {
    kind: u8,
    buf: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.buf.len());
        let Some(end) = end else { return Err(DecodeError::Truncated { kind: self.kind, at: self.at, what }) };
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        let b = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_be_bytes(a))
    }

    fn count(&mut self, what: &'static str, min_each: usize) -> Result<usize, DecodeError> {
        let b = self.take(4, what)?;
        let n = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize;
        // Each element takes at least `min_each` bytes: a count larger than
        // what is left is a lie, refused before anything is allocated.
        if n.saturating_mul(min_each.max(1)) > self.buf.len() - self.at {
            return Err(DecodeError::Invalid {
                kind: self.kind,
                what,
                detail: format!("{n} elements in {} bytes", self.buf.len() - self.at),
            });
        }
        Ok(n)
    }

    fn ip(&mut self, what: &'static str) -> Result<IpAddr, DecodeError> {
        match self.take(1, what)?[0] {
            4 => {
                let b = self.take(4, what)?;
                Ok(IpAddr::V4(Ipv4Addr::new(b[0], b[1], b[2], b[3])))
            }
            6 => {
                let mut a = [0u8; 16];
                a.copy_from_slice(self.take(16, what)?);
                Ok(IpAddr::V6(Ipv6Addr::from(a)))
            }
            f => Err(DecodeError::Invalid { kind: self.kind, what, detail: format!("address family {f}") }),
        }
    }

    fn string(&mut self, what: &'static str) -> Result<String, DecodeError> {
        let b = self.take(2, what)?;
        let n = u16::from_be_bytes([b[0], b[1]]) as usize;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|e| DecodeError::Invalid { kind: self.kind, what, detail: e.to_string() })
    }

    fn ips(&mut self, what: &'static str) -> Result<Vec<IpAddr>, DecodeError> {
        let n = self.count(what, 5)?;
        (0..n).map(|_| self.ip(what)).collect()
    }

    fn end(&self) -> Result<(), DecodeError> {
        match self.buf.len() - self.at {
            0 => Ok(()),
            extra => Err(DecodeError::Trailing { kind: self.kind, extra }),
        }
    }
}

impl Message {
    /// The frame kind and payload.
    pub fn encode(&self) -> (u8, Vec<u8>) {
        let mut out = Vec::new();
        let k = match self {
            Message::Sessions { ip, epoch, upserts, removes } => {
                put_ip(&mut out, *ip);
                put_u64(&mut out, *epoch);
                put_count(&mut out, upserts.len());
                for r in upserts {
                    r.encode(&mut out);
                }
                put_count(&mut out, removes.len());
                for r in removes {
                    r.encode(&mut out);
                }
                kind::SESSIONS
            }
            Message::FullBegin { ip, epoch } => {
                put_ip(&mut out, *ip);
                put_u64(&mut out, *epoch);
                kind::FULL_BEGIN
            }
            Message::FullEnd { ip, epoch, count } => {
                put_ip(&mut out, *ip);
                put_u64(&mut out, *epoch);
                put_u64(&mut out, *count);
                kind::FULL_END
            }
            Message::SyncAck { ip, epoch } => {
                put_ip(&mut out, *ip);
                put_u64(&mut out, *epoch);
                kind::SYNC_ACK
            }
            Message::FailsafeRequest { id, ips } => {
                put_u64(&mut out, *id);
                put_count(&mut out, ips.len());
                for ip in ips {
                    put_ip(&mut out, *ip);
                }
                kind::FAILSAFE_REQUEST
            }
            Message::FailsafeReply { id, accepted, refused } => {
                put_u64(&mut out, *id);
                put_count(&mut out, accepted.len());
                for ip in accepted {
                    put_ip(&mut out, *ip);
                }
                put_count(&mut out, refused.len());
                for (ip, why) in refused {
                    put_ip(&mut out, *ip);
                    put_str(&mut out, why);
                }
                kind::FAILSAFE_REPLY
            }
            Message::DropShadow { ip } => {
                put_ip(&mut out, *ip);
                kind::DROP_SHADOW
            }
            Message::PromisesKept { ips } => {
                put_count(&mut out, ips.len());
                for ip in ips {
                    put_ip(&mut out, *ip);
                }
                kind::PROMISES_KEPT
            }
        };
        (k, out)
    }

    /// Reads a frame's payload.
    pub fn decode(k: u8, buf: &[u8]) -> Result<Message, DecodeError> {
        let mut r = Reader { kind: k, buf, at: 0 };
        let m = match k {
            kind::SESSIONS => {
                let ip = r.ip("ip")?;
                let epoch = r.u64("epoch")?;
                let n = r.count("upserts", 8)?;
                let mut upserts = Vec::with_capacity(n);
                for _ in 0..n {
                    let (rec, used) = SessionRecord::decode(&buf[r.at..]).map_err(|e| DecodeError::Invalid {
                        kind: k,
                        what: "upserts",
                        detail: e.to_string(),
                    })?;
                    r.at += used;
                    upserts.push(rec);
                }
                let n = r.count("removes", 8)?;
                let mut removes = Vec::with_capacity(n);
                for _ in 0..n {
                    let (rec, used) = SessionKeyRecord::decode(&buf[r.at..]).map_err(|e| DecodeError::Invalid {
                        kind: k,
                        what: "removes",
                        detail: e.to_string(),
                    })?;
                    r.at += used;
                    removes.push(rec);
                }
                Message::Sessions { ip, epoch, upserts, removes }
            }
            kind::FULL_BEGIN => Message::FullBegin { ip: r.ip("ip")?, epoch: r.u64("epoch")? },
            kind::FULL_END => Message::FullEnd { ip: r.ip("ip")?, epoch: r.u64("epoch")?, count: r.u64("count")? },
            kind::SYNC_ACK => Message::SyncAck { ip: r.ip("ip")?, epoch: r.u64("epoch")? },
            kind::FAILSAFE_REQUEST => Message::FailsafeRequest { id: r.u64("id")?, ips: r.ips("ips")? },
            kind::FAILSAFE_REPLY => {
                let id = r.u64("id")?;
                let accepted = r.ips("accepted")?;
                let n = r.count("refused", 7)?;
                let mut refused = Vec::with_capacity(n);
                for _ in 0..n {
                    refused.push((r.ip("refused")?, r.string("refused reason")?));
                }
                Message::FailsafeReply { id, accepted, refused }
            }
            kind::DROP_SHADOW => Message::DropShadow { ip: r.ip("ip")? },
            kind::PROMISES_KEPT => Message::PromisesKept { ips: r.ips("ips")? },
            other => return Err(DecodeError::UnknownKind(other)),
        };
        r.end()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn every_message_round_trips_and_truncation_is_an_error() {
        let msgs = vec![
            Message::FullBegin { ip: ip("198.51.100.10"), epoch: 7 },
            Message::FullEnd { ip: ip("2001:db8::10"), epoch: 7, count: 12_345 },
            Message::SyncAck { ip: ip("198.51.100.10"), epoch: u64::MAX },
            Message::FailsafeRequest { id: 3, ips: vec![ip("198.51.100.10"), ip("2001:db8::1")] },
            Message::FailsafeReply {
                id: 3,
                accepted: vec![ip("198.51.100.10")],
                refused: vec![(ip("2001:db8::1"), "the Lease names gw-3".into())],
            },
            Message::DropShadow { ip: ip("198.51.100.11") },
            Message::PromisesKept { ips: vec![ip("198.51.100.10"), ip("2001:db8::1")] },
            Message::Sessions { ip: ip("198.51.100.10"), epoch: 0, upserts: vec![], removes: vec![] },
        ];
        for m in msgs {
            let (k, bytes) = m.encode();
            assert_eq!(Message::decode(k, &bytes).unwrap(), m);
            for cut in 0..bytes.len() {
                assert!(Message::decode(k, &bytes[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut long = bytes.clone();
            long.push(0);
            assert!(matches!(Message::decode(k, &long), Err(DecodeError::Trailing { .. })));
        }
        assert_eq!(Message::decode(99, &[]), Err(DecodeError::UnknownKind(99)));
        // A count that cannot fit in what is left is refused before allocating.
        let mut lie = Vec::new();
        put_u64(&mut lie, 1);
        lie.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(Message::decode(kind::FAILSAFE_REQUEST, &lie), Err(DecodeError::Invalid { what: "ips", .. })));
    }
}
