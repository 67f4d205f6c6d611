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

use crate::stats::Direction;

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
    fn half_close_keeps_established_timeout() {
        let p = run(&[(Out, SYN), (In, SYN | ACK), (Out, FIN | ACK)]);
        assert_eq!(p[2], Phase::Established);
        assert!(!p[2].is_transitory());
    }
}
