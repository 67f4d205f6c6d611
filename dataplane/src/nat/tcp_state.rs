//! TCP connection tracking for timeouts (RFC 5382 5, RFC 7857 3.2).
//!
//! The NAT does not validate sequence numbers; it tracks which control flags
//! it has seen from each side, enough to pick the idle timeout RFC 5382 asks
//! for: 2 h 4 min once established, 4 min while transitory (handshake, closing,
//! after a reset).
//!
//! ```text
//!                    SYN out                   SYN(+ACK) in
//!   (no session) ------------> HANDSHAKE ---------------------> ESTABLISHED
//!        |                     (transitory)                     (2 h 4 min)
//!        | non-SYN segment,      |   ^                            |      |
//!        | loose pick-up         |   | SYN in first, then out     | FIN  | FIN
//!        +-----------------------+---+--------------------------->| one  | both
//!                                                                 | side | sides
//!                                                                 v      v
//!                               ESTABLISHED (half-closed) ----> CLOSING (transitory)
//!
//!   RST from either side, in any state ------------------------> CLOSED  (transitory)
//!   SYN out while CLOSING or CLOSED: a new incarnation of the 5-tuple starts over in HANDSHAKE.
//! ```
//!
//! - Established needs a SYN from both sides (RFC 7857 3.2: both SYNs seen), or
//!   a loose pick-up: a session created from a mid-stream segment, which is how
//!   a gateway that takes over an egress IP keeps existing connections.
//! - A FIN from one side (half close) keeps the established timeout: data may
//!   still flow the other way for hours.
//! - RST does not delete the session at once: a forged RST cannot tear down a
//!   mapping, and late segments still translate (RFC 7857 3.2 recommends
//!   waiting the transitory time).
//! - An inbound RST moves the session to CLOSED only if its sequence number
//!   is acceptable to the pod ([`rst_acceptable`], below); otherwise it is
//!   still translated and forwarded (the pod applies RFC 5961 3.2 and answers
//!   with a challenge ACK, which also helps when the gateway's view is
//!   stale), but the session's state, timeout and offload are left as they
//!   were (`tcp_rst_out_of_window`).
//!
//! # The RST window check
//!
//! For an inbound RST the receiver is the pod. The gateway keeps, per
//! session, one 64-bit word ([`track`]): the acknowledgment number A and the
//! raw 16-bit window W of the latest segment with ACK set the pod sent
//! (the workers record the segments they translate; for an offloaded
//! session the XDP fast path records them in the session's outbound slot,
//! and the newer of the two is used), and the window-scale options of both
//! SYNs. The RST is acceptable when
//!
//! ```text
//!   seq - A (mod 2^32)  <=  max(W << shift, 1)
//! ```
//!
//! that is `seq` in `[A, A + max(W', 1)]`: RFC 793 (RFC 9293 3.10.7.4) accepts
//! a segment whose sequence number lies in the receive window
//! `RCV.NXT =< SEG.SEQ < RCV.NXT + RCV.WND`, and a RST only then (RFC 5961 3.2
//! narrows the endpoint's reaction to an exact match, and answers the rest
//! of the window with a challenge ACK). The pod's RCV.NXT is at least A (it
//! may have received more and not yet acknowledged it), and its peer may send
//! no further than A + W', so a legitimate RST's sequence number lies in
//! that range; Linux conntrack (`nf_conntrack_proto_tcp.c`, `tcp_in_window`
//! and the RST handling in `nf_conntrack_tcp_packet`) applies the same
//! window bounds before it lets a RST change the connection's state.
//!
//! - `shift` is the pod's window shift from its SYN (RFC 7323 2.2-2.3,
//!   capped at 14) when both SYNs carried the option, 0 when both SYNs were
//!   seen and one did not; when a SYN was not seen (a picked-up session, or
//!   a session whose SYNs this gateway missed) it is unknown and 14 is
//!   assumed, so a legitimate RST is never refused, at the price of a wider
//!   window for a blind guess.
//! - While the pod has acknowledged nothing (the handshake: e.g. the RST|ACK
//!   answering the pod's SYN), every RST is accepted, as before: RFC 793
//!   judges a RST in SYN-SENT by its ACK field, and the handshake's timeout
//!   is the transitory one anyway.
//! - Outbound RSTs (from the pod, behind the ingress check) close the
//!   session as before: checking them would need the remote's ACK and
//!   window per session too, 8 more bytes per session.
//! - Malformed or truncated options count as absent; nothing here panics.

use crate::stats::Direction;

/// The TCP header fields the tracker reads (RFC 9293 3.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    /// Sequence number.
    pub seq: u32,
    /// Acknowledgment number (meaningful with ACK set).
    pub ack: u32,
    /// The raw 16-bit window.
    pub window: u16,
    /// Flags (the low byte: FIN .. CWR).
    pub flags: u8,
    /// The window-scale option's shift (a SYN's, capped at 14), if the
    /// segment is a SYN and carries a well-formed one.
    pub wscale: Option<u8>,
}

/// The largest window shift (RFC 7323 2.3).
pub const MAX_WSCALE: u8 = 14;

/// Reads a TCP header (`tcp` from its first byte; at least 20 bytes, the
/// options up to its data offset). `None` when it is shorter than 20 bytes.
pub fn segment(tcp: &[u8]) -> Option<Segment> {
    let h: &[u8; 20] = tcp.get(..20)?.try_into().ok()?;
    let flags = h[13];
    let wscale = if flags & flags::SYN != 0 {
        let doff = usize::from(h[12] >> 4) * 4;
        tcp.get(20..doff).and_then(window_scale)
    } else {
        None
    };
    Some(Segment {
        seq: u32::from_be_bytes([h[4], h[5], h[6], h[7]]),
        ack: u32::from_be_bytes([h[8], h[9], h[10], h[11]]),
        window: u16::from_be_bytes([h[14], h[15]]),
        flags,
        wscale,
    })
}

/// The window-scale option's shift in a SYN's `options` (RFC 7323 2.2:
/// kind 3, length 3), capped at 14 (RFC 7323 2.3). `None` when absent or
/// when the options are malformed (a length below 2 or past the end, a
/// window-scale option of another length).
pub fn window_scale(options: &[u8]) -> Option<u8> {
    let mut i = 0;
    while i < options.len() {
        match options[i] {
            0 => return None, // end of option list
            1 => i += 1,      // no-operation
            kind => {
                let len = usize::from(*options.get(i + 1)?);
                if len < 2 || i + len > options.len() {
                    return None;
                }
                if kind == 3 {
                    return (len == 3).then(|| options[i + 2].min(MAX_WSCALE));
                }
                i += len;
            }
        }
    }
    None
}

/// The per-session word of what the pod acknowledged and advertised (see
/// the module doc), as bits of a `u64`.
pub mod track {
    /// Bits 0-31: the acknowledgment number; bits 32-47: the raw window.
    pub const WINDOW_SHIFT: u32 = 32;
    /// Bits 48-51: the pod's window shift from its SYN.
    pub const SCALE_SHIFT: u32 = 48;
    /// The pod has sent a segment with ACK set: bits 0-47 hold its latest.
    pub const ACKED: u64 = 1 << 52;
    /// The pod's SYN was seen.
    pub const POD_SYN: u64 = 1 << 53;
    /// The pod's SYN carried the window-scale option.
    pub const POD_WS: u64 = 1 << 54;
    /// The remote's SYN was seen.
    pub const REMOTE_SYN: u64 = 1 << 55;
    /// The remote's SYN carried the window-scale option.
    pub const REMOTE_WS: u64 = 1 << 56;
}

/// `a` is at or after `b` in sequence space (RFC 9293 3.4, mod 2^32).
#[inline]
fn not_before(a: u32, b: u32) -> bool {
    a.wrapping_sub(b) as i32 >= 0
}

/// Records an acknowledgment number and raw window the pod sent, unless an
/// acknowledgment already recorded is later (a reordered segment).
#[inline]
pub fn track_ack(t: u64, ack: u32, window: u16) -> u64 {
    if t & track::ACKED != 0 && !not_before(ack, t as u32) {
        return t;
    }
    (t & !0xffff_ffff_ffff) | track::ACKED | u64::from(ack) | (u64::from(window) << track::WINDOW_SHIFT)
}

/// The word after a segment from `dir` translated by the workers: a SYN's
/// window-scale option, and the pod's acknowledgment and window.
#[inline]
pub fn track_segment(t: u64, dir: Direction, seg: &Segment) -> u64 {
    let mut t = t;
    let ack = seg.flags & flags::ACK != 0;
    if seg.flags & flags::SYN != 0 {
        match dir {
            Direction::Outbound => {
                if !ack {
                    // The pod's SYN: a new connection (or its retransmission),
                    // nothing acknowledged yet.
                    t = 0;
                }
                t &= !(track::POD_WS | (0xf << track::SCALE_SHIFT));
                t |= track::POD_SYN;
                if let Some(ws) = seg.wscale {
                    t |= track::POD_WS | (u64::from(ws) << track::SCALE_SHIFT);
                }
            }
            Direction::Inbound => {
                t &= !track::REMOTE_WS;
                t |= track::REMOTE_SYN | if seg.wscale.is_some() { track::REMOTE_WS } else { 0 };
            }
        }
    }
    if dir == Direction::Outbound && ack && seg.flags & flags::RST == 0 {
        t = track_ack(t, seg.ack, seg.window);
    }
    t
}

/// The pod's window shift: its own when both SYNs carried the option, 0
/// when both SYNs were seen without, [`MAX_WSCALE`] when unknown.
#[inline]
pub fn pod_shift(t: u64) -> u32 {
    if t & (track::POD_SYN | track::REMOTE_SYN) != track::POD_SYN | track::REMOTE_SYN {
        return u32::from(MAX_WSCALE);
    }
    if t & (track::POD_WS | track::REMOTE_WS) == track::POD_WS | track::REMOTE_WS {
        ((t >> track::SCALE_SHIFT) & 0xf) as u32
    } else {
        0
    }
}

/// Whether an inbound RST with sequence number `seq` is acceptable to the
/// pod whose recorded word is `t` (the module doc's rule).
#[inline]
pub fn rst_acceptable(t: u64, seq: u32) -> bool {
    if t & track::ACKED == 0 {
        return true;
    }
    let ack = t as u32;
    let window = u32::from((t >> track::WINDOW_SHIFT) as u16) << pod_shift(t).min(u32::from(MAX_WSCALE));
    seq.wrapping_sub(ack) <= window.max(1)
}

/// TCP header flag bits as on the wire.
pub mod flags {
    /// FIN.
    pub const FIN: u8 = 0x01;
    /// SYN.
    pub const SYN: u8 = 0x02;
    /// RST.
    pub const RST: u8 = 0x04;
    /// ACK.
    pub const ACK: u8 = 0x10;
}

/// What the tracker has seen, as bits (stored in the session slot).
pub mod seen {
    /// A SYN from the pod.
    pub const SYN_OUT: u8 = 0x01;
    /// A SYN (or SYN-ACK) from the remote.
    pub const SYN_IN: u8 = 0x02;
    /// A FIN from the pod.
    pub const FIN_OUT: u8 = 0x04;
    /// A FIN from the remote.
    pub const FIN_IN: u8 = 0x08;
    /// A RST from either side.
    pub const RST: u8 = 0x10;
    /// Created from a mid-stream segment (loose pick-up).
    pub const PICKED_UP: u8 = 0x20;
}

/// The phase that decides the timeout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Not both SYNs yet.
    Handshake,
    /// Both SYNs (or picked up), at most one FIN.
    Established,
    /// FIN from both sides.
    Closing,
    /// Reset.
    Closed,
}

impl Phase {
    /// The name shown in session listings.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Handshake => "handshake",
            Phase::Established => "established",
            Phase::Closing => "closing",
            Phase::Closed => "closed",
        }
    }

    /// Whether the transitory timeout applies.
    pub fn is_transitory(self) -> bool {
        self != Phase::Established
    }
}

/// The phase of a set of seen bits.
#[inline]
pub fn phase(s: u8) -> Phase {
    if s & seen::RST != 0 {
        Phase::Closed
    } else if s & (seen::FIN_OUT | seen::FIN_IN) == seen::FIN_OUT | seen::FIN_IN {
        Phase::Closing
    } else if s & (seen::SYN_OUT | seen::SYN_IN) == seen::SYN_OUT | seen::SYN_IN || s & seen::PICKED_UP != 0 {
        Phase::Established
    } else {
        Phase::Handshake
    }
}

/// Whether a segment with these flags can change the tracked state (the fast
/// path only calls [`update`] for those).
#[inline]
pub fn is_control(tcp_flags: u8) -> bool {
    tcp_flags & (flags::SYN | flags::FIN | flags::RST) != 0
}

/// The seen bits of a new session created by a segment from `dir`.
pub fn initial(dir: Direction, tcp_flags: u8) -> u8 {
    if tcp_flags & flags::SYN == 0 {
        // Mid-stream: loose pick-up.
        return update(seen::PICKED_UP, dir, tcp_flags);
    }
    update(0, dir, tcp_flags)
}

/// The seen bits after a segment with `tcp_flags` from `dir`.
#[inline]
pub fn update(s: u8, dir: Direction, tcp_flags: u8) -> u8 {
    let mut s = s;
    if tcp_flags & flags::SYN != 0
        && tcp_flags & flags::ACK == 0
        && dir == Direction::Outbound
        && matches!(phase(s), Phase::Closing | Phase::Closed)
    {
        // A new connection reusing the 5-tuple (e.g. after TIME_WAIT).
        s = 0;
    }
    if tcp_flags & flags::RST != 0 {
        s |= seen::RST;
    }
    if tcp_flags & flags::SYN != 0 {
        s |= match dir {
            Direction::Outbound => seen::SYN_OUT,
            Direction::Inbound => seen::SYN_IN,
        };
    }
    if tcp_flags & flags::FIN != 0 {
        s |= match dir {
            Direction::Outbound => seen::FIN_OUT,
            Direction::Inbound => seen::FIN_IN,
        };
    }
    s
}

#[cfg(test)]
mod tests {
    use super::flags::*;
    use super::*;
    use Direction::{Inbound as In, Outbound as Out};

    fn run(steps: &[(Direction, u8)]) -> Vec<Phase> {
        let mut s = initial(steps[0].0, steps[0].1);
        let mut out = vec![phase(s)];
        for (d, f) in &steps[1..] {
            s = update(s, *d, *f);
            out.push(phase(s));
        }
        out
    }

    #[test]
    fn three_way_handshake_then_orderly_close() {
        use Phase::*;
        assert_eq!(
            run(&[(Out, SYN), (In, SYN | ACK), (Out, ACK), (Out, FIN | ACK), (In, ACK), (In, FIN | ACK), (Out, ACK)]),
            vec![Handshake, Established, Established, Established, Established, Closing, Closing]
        );
    }

    #[test]
    fn reset_closes_from_any_state() {
        assert_eq!(run(&[(Out, SYN), (In, RST | ACK)]), vec![Phase::Handshake, Phase::Closed]);
        assert_eq!(run(&[(Out, SYN), (In, SYN | ACK), (Out, RST)])[2], Phase::Closed);
    }

    #[test]
    fn simultaneous_open_is_established() {
        assert_eq!(run(&[(Out, SYN), (In, SYN)]), vec![Phase::Handshake, Phase::Established]);
    }

    #[test]
    fn mid_stream_segment_is_picked_up_established() {
        assert_eq!(run(&[(Out, ACK)]), vec![Phase::Established]);
        assert_eq!(run(&[(Out, ACK), (In, FIN | ACK), (Out, FIN | ACK)])[2], Phase::Closing);
    }

    #[test]
    fn new_syn_after_close_starts_over() {
        let p = run(&[(Out, SYN), (In, SYN | ACK), (Out, RST), (Out, SYN), (In, SYN | ACK)]);
        assert_eq!(p, vec![Phase::Handshake, Phase::Established, Phase::Closed, Phase::Handshake, Phase::Established]);
    }

    #[test]
    fn inbound_syn_after_close_does_not_reset() {
        // Only the pod's SYN starts a new incarnation; a remote SYN on a closed session stays closed.
        let p = run(&[(Out, SYN), (In, RST), (In, SYN)]);
        assert_eq!(p[2], Phase::Closed);
    }

    #[test]
    fn window_scale_options_and_malformed_ones() {
        assert_eq!(window_scale(&[1, 3, 3, 7]), Some(7));
        assert_eq!(window_scale(&[2, 4, 5, 0xb4, 4, 2, 8, 10, 0, 0, 0, 0, 0, 0, 0, 0, 1, 3, 3, 9]), Some(9));
        assert_eq!(window_scale(&[3, 3, 15]), Some(MAX_WSCALE), "capped (RFC 7323 2.3)");
        assert_eq!(window_scale(&[0, 3, 3, 7]), None, "after the end of the list");
        assert_eq!(window_scale(&[3, 4, 7, 0]), None, "wrong length");
        assert_eq!(window_scale(&[2, 1, 3, 3, 7]), None, "a length below 2");
        assert_eq!(window_scale(&[2, 40, 3, 3, 7]), None, "a length past the end");
        assert_eq!(window_scale(&[1, 3, 3]), None, "truncated");
        assert_eq!(window_scale(&[1, 3]), None, "truncated");
        assert_eq!(window_scale(&[]), None);
        let mut syn = [0u8; 24];
        syn[12] = 6 << 4;
        syn[13] = flags::SYN;
        syn[20..].copy_from_slice(&[1, 3, 3, 4]);
        assert_eq!(segment(&syn).and_then(|s| s.wscale), Some(4));
        syn[12] = 15 << 4; // a data offset past the bytes given: no option read
        assert_eq!(segment(&syn).map(|s| s.wscale), Some(None));
        assert_eq!(segment(&syn[..19]), None);
    }

    #[test]
    fn the_rst_window_wraps_and_tracks_the_latest_ack() {
        let seg = |flags, ack, window, wscale| Segment { seq: 0, ack, window, flags, wscale };
        let mut t = track_segment(0, Out, &seg(SYN, 0, 0, Some(2)));
        t = track_segment(t, In, &seg(SYN | ACK, 0, 0, Some(0)));
        assert!(rst_acceptable(t, 12345), "nothing acknowledged yet");
        t = track_segment(t, Out, &seg(ACK, u32::MAX - 10, 100, None));
        assert_eq!(pod_shift(t), 2);
        assert!(rst_acceptable(t, u32::MAX - 10));
        assert!(rst_acceptable(t, 389), "u32::MAX - 10 + 400 wraps");
        assert!(!rst_acceptable(t, 390));
        assert!(!rst_acceptable(t, u32::MAX - 11));
        let older = track_segment(t, Out, &seg(ACK, u32::MAX - 500, 5000, None));
        assert_eq!(older, t, "a reordered older ACK is ignored");
        let zero = track_segment(t, Out, &seg(ACK, 7, 0, None));
        assert!(rst_acceptable(zero, 7) && rst_acceptable(zero, 8) && !rst_acceptable(zero, 9), "max(W, 1)");
        let picked_up = track_segment(0, Out, &seg(ACK, 0, 1, None));
        assert_eq!(pod_shift(picked_up), u32::from(MAX_WSCALE), "SYNs unseen: the widest window");
    }

    #[test]
    fn half_close_keeps_established_timeout() {
        let p = run(&[(Out, SYN), (In, SYN | ACK), (Out, FIN | ACK)]);
        assert_eq!(p[2], Phase::Established);
        assert!(!p[2].is_transitory());
    }
}
