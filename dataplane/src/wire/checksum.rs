//! The Internet checksum: full computation (RFC 1071), pseudo-headers, and the
//! incremental update the NAT fast path applies per packet (RFC 1624).
//!
//! Vocabulary:
//! - a **sum** (`u32`) is a ones' complement partial sum of big-endian 16-bit
//!   words, not yet folded. Sums combine with [`add`] (or by passing one as the
//!   `initial` of [`sum`]). Any `u32` is a valid sum: only its value modulo
//!   0xFFFF matters, and a sum of non-zero data is never 0.
//! - [`fold`] reduces a sum to 16 bits with end-around carry (no complement);
//!   [`finish`] is `!fold(sum)`, the value written into a checksum field.
//! - a [`Delta`] is what a rewrite adds to a checksum: precompute it once per
//!   session (VPP style) and [`Delta::apply`] it per packet.
//!
//! Zero, -0 and the UDP case (RFC 1624 section 3 and RFC 768):
//! ones' complement arithmetic has two zeros, 0x0000 (+0) and 0xFFFF (-0).
//! A checksum computed in full over data that is not all zero is never 0xFFFF
//! (the folded sum is in 1..=0xFFFF, its complement in 0..=0xFFFE). Eqn. 3,
//! `HC' = ~(~HC + ~m + m')`, computes the same representative: its result is
//! 0x0000 exactly when a full recomputation yields 0x0000, and it never yields
//! 0xFFFF unless `HC` was 0xFFFF and the delta is zero. (Eqn. 2,
//! `HC - ~m - m'`, is the one that can produce 0xFFFF where a recomputation
//! gives 0x0000; it is not used here.)
//! UDP over IPv4 reserves a checksum field of 0 for "no checksum", and a
//! computed 0 is transmitted as 0xFFFF: [`apply_udp`] keeps both rules.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The ones' complement sum of `data` as big-endian 16-bit words, added to
/// `initial` (RFC 1071). An odd trailing byte is the high byte of a last word
/// padded with zero, so `data` must start at an even offset of the
/// checksummed bytes (it does for whole headers and segments).
///
/// How it is fast (RFC 1071 section 2): the bulk is summed eight bytes at a
/// time as native-endian `u64`s split into their two 32-bit halves (a 32-bit
/// word `hi << 16 | lo` is congruent to `hi + lo` modulo 0xFFFF) into a `u64`
/// accumulator, with no byte swap per word: ones' complement addition is
/// byte-order independent (2(B)), so only the folded 16-bit result is
/// swapped to big-endian. The loop vectorises; the tail takes fixed-size
/// steps. The accumulator cannot overflow below 16 GiB of input.
#[inline]
pub fn sum(data: &[u8], initial: u32) -> u32 {
    let mut chunks = data.chunks_exact(8);
    let mut native: u64 = 0;
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_ne_bytes(word);
        native += (w >> 32) + (w & 0xFFFF_FFFF);
    }
    // The folded native-endian sum, read back as a big-endian word.
    let folded = fold(fold64(native));
    let mut acc = u64::from(u16::from_be_bytes(folded.to_ne_bytes())) + u64::from(initial);
    // The tail, 0..=7 bytes, starts at an even offset: a 4-byte word, a
    // 2-byte word, then an odd byte as the high byte of a padded word.
    let mut rest = chunks.remainder();
    if let [a, b, c, d, tail @ ..] = rest {
        acc += u64::from(u32::from_be_bytes([*a, *b, *c, *d]));
        rest = tail;
    }
    if let [a, b, tail @ ..] = rest {
        acc += u64::from(u16::from_be_bytes([*a, *b]));
        rest = tail;
    }
    if let [a] = rest {
        acc += u64::from(*a) << 8;
    }
    fold64(acc)
}

/// Folds a 64-bit accumulator into 32 bits with end-around carry.
#[inline]
fn fold64(acc: u64) -> u32 {
    let s = (acc & 0xFFFF_FFFF) + (acc >> 32); // <= 0x1_FFFF_FFFE
    let s = (s & 0xFFFF_FFFF) + (s >> 32); // <= 0xFFFF_FFFF
    s as u32
}

/// Adds two sums with end-around carry.
#[inline]
pub fn add(a: u32, b: u32) -> u32 {
    let (s, carry) = a.overflowing_add(b);
    // On overflow s <= 0xFFFF_FFFE, so adding the carry cannot overflow.
    s + u32::from(carry)
}

/// Folds a sum to 16 bits with end-around carry, without complementing.
/// A non-zero sum folds to a value in 1..=0xFFFF.
#[inline]
pub fn fold(sum: u32) -> u16 {
    let s = (sum & 0xFFFF) + (sum >> 16); // <= 0x1FFFE
    let s = (s & 0xFFFF) + (s >> 16); // <= 0xFFFF
    s as u16
}

/// The checksum field value for a sum: `!fold(sum)`.
#[inline]
pub fn finish(sum: u32) -> u16 {
    !fold(sum)
}

/// The IPv4 pseudo-header sum (RFC 9293 3.1, RFC 768): source, destination,
/// zero + protocol, and the TCP/UDP length.
#[inline]
pub fn pseudo_header_v4(src: Ipv4Addr, dst: Ipv4Addr, protocol: u8, l4_len: u32) -> u32 {
    let s = src.to_bits();
    let d = dst.to_bits();
    (s >> 16) + (s & 0xFFFF) + (d >> 16) + (d & 0xFFFF) + u32::from(protocol) + (l4_len >> 16) + (l4_len & 0xFFFF)
}

/// The IPv6 pseudo-header sum (RFC 8200 8.1): source, destination, the
/// 32-bit upper-layer packet length (payload length minus the extension
/// headers before it) and the upper-layer next header.
#[inline]
pub fn pseudo_header_v6(src: &Ipv6Addr, dst: &Ipv6Addr, next_header: u8, l4_len: u32) -> u32 {
    // [`sum`]'s method over the two addresses in one pass (four native
    // `u64`s, one fold, one swap): an established IPv6 packet pays this to
    // tell a partial checksum, and two calls of `sum` cost twice the folds.
    let (s, d) = (u128::from_ne_bytes(src.octets()), u128::from_ne_bytes(dst.octets()));
    let half = |w: u128| -> u64 {
        let (hi, lo) = ((w >> 64) as u64, w as u64);
        (hi >> 32) + (hi & 0xFFFF_FFFF) + (lo >> 32) + (lo & 0xFFFF_FFFF)
    };
    let folded = fold(fold64(half(s) + half(d)));
    add(
        u32::from(u16::from_be_bytes(folded.to_ne_bytes())),
        u32::from(next_header) + (l4_len >> 16) + (l4_len & 0xFFFF),
    )
}

/// True when a TCP/UDP checksum field holds only the folded pseudo-header
/// sum, uncomplemented: what Linux leaves in a packet whose checksum is to be
/// completed by the device (`CHECKSUM_PARTIAL`, TX checksum offload), e.g.
/// `th->check = ~tcp_v4_check(len, saddr, daddr, 0)` in `__tcp_v4_send_check`
/// and the same for UDP. Frames from a veth peer with TX offload on reach XDP
/// (and an AF_XDP socket) in this state, with the offload metadata lost.
///
/// `pseudo_sum` is [`pseudo_header_v4`] / [`pseudo_header_v6`] of the packet
/// as received, with the L4 length the kernel used (the segment length for
/// TCP, the UDP length for UDP; a GSO super-packet is not seen in XDP).
///
/// A correctly completed checksum equals this value only by coincidence, for
/// about 1 packet in 65536. In that case recomputing the full checksum over
/// the segment yields the correct value again (a full computation ignores the
/// old field), so the rule "recompute in full when `is_partial`, else update
/// incrementally" is always safe; the cost of a false positive is one full
/// computation. Applying an incremental [`Delta`] to a partial field would be
/// wrong: the result would be neither partial nor complete. A UDP field of 0
/// ("no checksum") is never partial: a non-zero pseudo sum never folds to 0.
///
/// Seen on this machine: frames captured on a veth with TX offload on carry
/// exactly this value (see the `*_PARTIAL` frames in the tests).
#[inline]
pub fn is_partial(field: u16, pseudo_sum: u32) -> bool {
    field == fold(pseudo_sum)
}

/// RFC 1624 eqn. 3 for one rewrite: the checksum after the bytes `old` were
/// replaced by `new`. Both slices must sit at the same even offset of the
/// checksummed data and have the same length (an odd length is padded the
/// same way on both sides, so it is also correct at an even offset).
#[inline]
pub fn update(csum: u16, old: &[u8], new: &[u8]) -> u16 {
    Delta::between(old, new).apply(csum)
}

/// [`Delta::apply`] for a UDP-over-IPv4 checksum field: 0 means "no checksum"
/// and stays 0; a result of 0 is sent as 0xFFFF (RFC 768).
///
/// For UDP over IPv6 a zero checksum is not allowed (RFC 8200 8.1); this
/// function is still correct there for any non-zero field.
#[inline]
pub fn apply_udp(csum: u16, delta: Delta) -> u16 {
    if csum == 0 {
        return 0;
    }
    match delta.apply(csum) {
        0 => 0xFFFF,
        c => c,
    }
}

/// A precomputed checksum change: the ones' complement sum of `~m + m'` over
/// the rewritten 16-bit words (RFC 1624 eqn. 3). Deltas of independent
/// rewrites combine with [`Delta::add`]; a session stores one delta per
/// checksum it touches and applies it to each packet.
///
/// The ones' complement zero is kept as 0 (never 0xFFFF), so [`Delta::NONE`]
/// is the only identity and `apply(NONE)` returns its input unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Delta(u16);

impl Delta {
    /// No change.
    pub const NONE: Delta = Delta(0);

    #[inline]
    const fn normalized(v: u16) -> Delta {
        if v == 0xFFFF {
            Delta(0)
        } else {
            Delta(v)
        }
    }

    /// The change from bytes `old` to bytes `new` (same length, same even
    /// offset in the checksummed data).
    #[inline]
    pub fn between(old: &[u8], new: &[u8]) -> Delta {
        // sum(~m_i) == ~sum(m_i) in ones' complement arithmetic.
        let minus_old = u32::from(!fold(sum(old, 0)));
        Delta::normalized(fold(sum(new, minus_old)))
    }

    /// The change from one IPv4 address to another.
    #[inline]
    pub fn between_ipv4(old: Ipv4Addr, new: Ipv4Addr) -> Delta {
        Delta::between(&old.octets(), &new.octets())
    }

    /// The change from one IPv6 address to another.
    #[inline]
    pub fn between_ipv6(old: &Ipv6Addr, new: &Ipv6Addr) -> Delta {
        Delta::between(&old.octets(), &new.octets())
    }

    /// The change from one 16-bit word (a port, an ICMP identifier) to another.
    #[inline]
    pub fn between_u16(old: u16, new: u16) -> Delta {
        Delta::normalized(fold(u32::from(!old) + u32::from(new)))
    }

    /// Both changes.
    #[inline]
    #[must_use]
    #[allow(clippy::should_implement_trait)]
    pub fn add(self, other: Delta) -> Delta {
        Delta::normalized(fold(u32::from(self.0) + u32::from(other.0)))
    }

    /// The opposite change (`Delta::between(new, old)`).
    #[inline]
    #[must_use]
    pub fn negate(self) -> Delta {
        Delta::normalized(!self.0)
    }

    /// True for [`Delta::NONE`].
    #[inline]
    pub fn is_none(self) -> bool {
        self.0 == 0
    }

    /// The raw folded value.
    #[inline]
    pub fn value(self) -> u16 {
        self.0
    }

    /// A delta from its raw folded value (as stored in a session; 0xFFFF,
    /// the other ones' complement zero, becomes [`Delta::NONE`]).
    #[inline]
    pub const fn from_value(v: u16) -> Delta {
        Delta::normalized(v)
    }

    /// `HC' = ~(~HC + delta)`: the checksum field after the change.
    #[inline]
    pub fn apply(self, csum: u16) -> u16 {
        !fold(u32::from(!csum) + u32::from(self.0))
    }

    /// `then.apply(self.apply(csum))` in one fold: `~(~HC + self + then)`.
    /// The same field, bit for bit, whenever `then` is not [`Delta::NONE`]:
    /// both sums are then non-zero and congruent modulo 0xFFFF, and a
    /// non-zero sum has one folded form (1..=0xFFFF). Not the same as
    /// `self.add(then).apply(csum)`, whose normalized zero would turn a
    /// field of 0xFFFF into 0xFFFF where the two steps give 0.
    #[inline]
    pub fn apply_then(self, then: Delta, csum: u16) -> u16 {
        debug_assert!(!then.is_none());
        !fold(u32::from(!csum) + u32::from(self.0) + u32::from(then.0))
    }
}

/// The IPv4 header checksum's change when the TTL drops by one: TTL is the
/// high byte of the (TTL, protocol) word, so `~(ttl << 8 | p) + ((ttl - 1)
/// << 8 | p)` folds to 0xFFFF - 0x0100 for every TTL of at least 1 and
/// every protocol ([`Delta::between_u16`] of the two words). The XDP fast
/// path applies the same constant (bpf/src/bpf/fast_path.h).
pub const TTL_DECREMENT: Delta = Delta(0xFEFF);

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The plain RFC 1071 loop, 16 bits at a time, as the reference.
    fn reference_sum(data: &[u8]) -> u16 {
        let mut acc: u64 = 0;
        for pair in data.chunks(2) {
            let hi = u64::from(pair[0]) << 8;
            let lo = pair.get(1).copied().map_or(0, u64::from);
            acc += hi | lo;
        }
        while acc > 0xFFFF {
            acc = (acc & 0xFFFF) + (acc >> 16);
        }
        acc as u16
    }

    fn etherparse_sum(data: &[u8]) -> u16 {
        // etherparse sums native-endian words and returns !fold in native
        // order (its callers apply `.to_be()`); undo both.
        !etherparse::checksum::Sum16BitWords::new().add_slice(data).ones_complement().to_be()
    }

    #[test]
    fn rfc1071_example() {
        // RFC 1071 section 3: the words 0001 f203 f4f5 f6f7 sum to ddf2.
        let data = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(fold(sum(&data, 0)), 0xddf2);
        assert_eq!(finish(sum(&data, 0)), 0x220d);
        // Odd length: a trailing byte is the high byte of a word.
        assert_eq!(fold(sum(&[0x01, 0x02, 0x03], 0)), 0x0102 + 0x0300);
        assert_eq!(fold(sum(&[], 0)), 0);
        assert_eq!(fold(sum(&[0xff, 0xff], 0)), 0xffff);
        assert_eq!(fold(sum(&[0xff, 0xff, 0x00, 0x01], 0)), 0x0001);
        // Jumbo-sized all-ones data with an all-ones initial value: -0.
        assert_eq!(fold(sum(&[0xff; 9001], 0xffff_ffff)), 0xff00);
        assert_eq!(fold(sum(&[0xff; 9000], 0xffff_ffff)), 0xffff);
        // Byte order: the native-endian bulk and the big-endian tail agree.
        let mixed: Vec<u8> = (0u8..=22).collect();
        assert_eq!(fold(sum(&mixed, 0)), reference_sum(&mixed));
        assert_eq!(fold(sum(&mixed, 0)), 0x8479);
    }

    #[test]
    fn real_ipv4_header_checksum() {
        // IPv4 header of a captured echo request, checksum a454.
        let hdr = [
            0x45, 0x00, 0x00, 0x54, 0x11, 0x55, 0x40, 0x00, 0x40, 0x01, 0xa4, 0x54, 0xc0, 0x00, 0x02, 0x01, 0xc0, 0x00,
            0x02, 0xfe,
        ];
        assert_eq!(fold(sum(&hdr, 0)), 0xffff);
        let mut zeroed = hdr;
        zeroed[10] = 0;
        zeroed[11] = 0;
        assert_eq!(finish(sum(&zeroed, 0)), 0xa454);
    }

    #[test]
    fn pseudo_headers() {
        let v4 = pseudo_header_v4(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(198, 51, 100, 2), 17, 17);
        let manual = [192, 0, 2, 1, 198, 51, 100, 2, 0, 17, 0, 17];
        assert_eq!(fold(v4), fold(sum(&manual, 0)));
        let a: Ipv6Addr = "2001:db8:a::1".parse().unwrap();
        let b: Ipv6Addr = "2001:db8:b::2".parse().unwrap();
        let v6 = pseudo_header_v6(&a, &b, 58, 0x0001_0008);
        let mut manual6 = Vec::new();
        manual6.extend_from_slice(&a.octets());
        manual6.extend_from_slice(&b.octets());
        manual6.extend_from_slice(&0x0001_0008u32.to_be_bytes());
        manual6.extend_from_slice(&[0, 0, 0, 58]);
        assert_eq!(fold(v6), fold(sum(&manual6, 0)));
    }

    #[test]
    fn delta_none_is_identity_for_every_value() {
        for c in 0..=u16::MAX {
            assert_eq!(Delta::NONE.apply(c), c);
        }
        assert_eq!(Delta::between(&[1, 2, 3, 4], &[1, 2, 3, 4]), Delta::NONE);
        assert_eq!(Delta::between_u16(0xffff, 0xffff), Delta::NONE);
        assert_eq!(Delta::between_u16(0, 0xffff), Delta::NONE); // +0 -> -0
    }

    #[test]
    fn update_reaching_zero_matches_full_recompute() {
        // A segment whose checksum after the rewrite is exactly 0x0000: eqn. 3
        // must produce 0x0000 too (eqn. 2 would produce 0xFFFF).
        let mut data = vec![0x12, 0x34, 0x00, 0x00, 0xab, 0xcd, 0x00, 0x00];
        // Choose the last word so that the rewritten data sums to 0xFFFF.
        let new_word = [0x43, 0x21];
        let mut after = data.clone();
        after[0..2].copy_from_slice(&new_word);
        let s = fold(sum(&after, 0));
        let fill = 0xFFFF - s;
        data[6..8].copy_from_slice(&fill.to_be_bytes());
        after[6..8].copy_from_slice(&fill.to_be_bytes());
        assert_eq!(finish(sum(&after, 0)), 0x0000);
        let before = finish(sum(&data, 0));
        assert_ne!(before, 0);
        assert_eq!(update(before, &data[0..2], &new_word), 0x0000);
    }

    #[test]
    fn udp_zero_rules() {
        let d = Delta::between_u16(1000, 2000);
        assert_eq!(apply_udp(0, d), 0, "no checksum stays no checksum");
        // A field whose update lands on 0 is sent as 0xFFFF.
        let c = d.negate().apply(0x0000); // a checksum that `d` brings to 0
        assert_eq!(d.apply(c), 0x0000);
        assert_eq!(apply_udp(c, d), 0xFFFF);
        // 0xFFFF (a computed 0) with no change stays 0xFFFF.
        assert_eq!(apply_udp(0xFFFF, Delta::NONE), 0xFFFF);
    }

    #[test]
    fn is_partial_on_captured_frames() {
        use crate::wire::testdata::{self, hex};
        // A UDP datagram captured on a veth with TX offload on: field 0xec5b.
        let f = hex(testdata::UDP4_PARTIAL);
        let pseudo = pseudo_header_v4(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(198, 51, 100, 2), 17, 19);
        assert!(is_partial(0xec5b, pseudo));
        // The completed checksum tcpdump computed for it: 0x569d.
        let mut seg = f[34..53].to_vec();
        seg[6] = 0;
        seg[7] = 0;
        assert_eq!(finish(sum(&seg, pseudo)), 0x569d);
        assert!(!is_partial(0x569d, pseudo));
        // A full checksum from the same capture with offload off is not partial.
        let g = hex(testdata::UDP4);
        let pseudo_g = pseudo_header_v4(Ipv4Addr::new(192, 0, 2, 1), Ipv4Addr::new(198, 51, 100, 2), 17, 17);
        assert_eq!(u16::from_be_bytes([g[40], g[41]]), 0xa519);
        assert!(!is_partial(0xa519, pseudo_g));
    }

    #[test]
    fn ttl_decrement_is_the_words_delta_for_every_ttl_and_protocol() {
        for ttl in 1..=255u8 {
            for proto in 0..=255u8 {
                let old = u16::from_be_bytes([ttl, proto]);
                let new = u16::from_be_bytes([ttl - 1, proto]);
                assert_eq!(Delta::between_u16(old, new), TTL_DECREMENT, "ttl {ttl} protocol {proto}");
            }
        }
    }

    #[test]
    fn apply_then_is_two_applies_for_every_field_and_delta_at_the_edges() {
        let edges = [0u16, 1, 0x00FF, 0x0100, 0x7FFF, 0x8000, 0xFEFF, 0xFF00, 0xFFFE, 0xFFFF];
        for csum in 0..=u16::MAX {
            for d in edges {
                let d = Delta::from_value(d);
                assert_eq!(d.apply_then(TTL_DECREMENT, csum), TTL_DECREMENT.apply(d.apply(csum)), "{csum:#x} {d:?}");
            }
        }
    }

    proptest! {
        #[test]
        fn apply_then_is_two_applies(csum in any::<u16>(), d in any::<u16>(), then in 1..u16::MAX) {
            let (d, then) = (Delta::from_value(d), Delta::from_value(then));
            prop_assert_eq!(d.apply_then(then, csum), then.apply(d.apply(csum)));
        }

        #[test]
        fn sum_matches_reference(data in proptest::collection::vec(any::<u8>(), 0..300),
                                 initial in any::<u32>()) {
            let ours = fold(sum(&data, initial));
            let reference = fold(add(u32::from(reference_sum(&data)), initial));
            // Compare modulo the two zeros: 0 and 0xffff are the same number.
            prop_assert_eq!(ours % 0xffff, reference % 0xffff);
            prop_assert_eq!(fold(sum(&data, 0)), reference_sum(&data));
            prop_assert_eq!(fold(sum(&data, 0)) % 0xffff, etherparse_sum(&data) % 0xffff);
        }

        #[test]
        fn sum_is_splittable_at_even_offsets(data in proptest::collection::vec(any::<u8>(), 0..200),
                                             cut in 0usize..100) {
            let cut = (cut * 2).min(data.len() & !1);
            let whole = fold(sum(&data, 0));
            let parts = fold(sum(&data[cut..], sum(&data[..cut], 0)));
            prop_assert_eq!(whole, parts);
        }

        #[test]
        fn update_equals_full_recompute(
            mut data in proptest::collection::vec(any::<u8>(), 10..120),
            at in 0usize..60,
            new in proptest::collection::vec(any::<u8>(), 1..8),
        ) {
            // Keep a non-zero byte the rewrite cannot reach, so the data is
            // never all zero and its checksum is a real one.
            let n = data.len();
            data[n - 1] |= 1;
            let at = ((at * 2) % (n - 8)) & !1;
            let old = data[at..at + new.len()].to_vec();
            let csum = finish(sum(&data, 0));
            data[at..at + new.len()].copy_from_slice(&new);
            let full = finish(sum(&data, 0));
            prop_assert_eq!(update(csum, &old, &new), full);
        }

        #[test]
        fn delta_algebra(a in any::<u16>(), b in any::<u16>(), c in any::<u16>(), csum in any::<u16>()) {
            let d1 = Delta::between_u16(a, b);
            let d2 = Delta::between_u16(b, c);
            prop_assert_eq!(d1.add(d2), Delta::between_u16(a, c));
            prop_assert_eq!(d1, Delta::between(&a.to_be_bytes(), &b.to_be_bytes()));
            prop_assert_eq!(d1.negate(), Delta::between_u16(b, a));
            prop_assert!(d1.add(d1.negate()).is_none());
            // Applying a change and its inverse returns the same number
            // (modulo the two zeros when csum is 0xffff).
            let back = d1.negate().apply(d1.apply(csum));
            prop_assert_eq!(back % 0xffff, csum % 0xffff);
            prop_assert_ne!(d1.value(), 0xffff);
        }

        #[test]
        fn pseudo_header_v6_is_the_sum_of_its_bytes(src in any::<u128>(), dst in any::<u128>(),
                                                    next_header in any::<u8>(), len in any::<u32>(),
                                                    ones in any::<bool>()) {
            // `ones`: addresses of 0xFFFF words, where an end-around carry
            // is easy to lose.
            let (src, dst) = if ones { (src | !0xFFFFu128, dst | !0xFF_0000u128) } else { (src, dst) };
            let (s, d) = (Ipv6Addr::from(src), Ipv6Addr::from(dst));
            let mut bytes = Vec::new();
            bytes.extend_from_slice(&s.octets());
            bytes.extend_from_slice(&d.octets());
            bytes.extend_from_slice(&len.to_be_bytes());
            bytes.extend_from_slice(&[0, 0, 0, next_header]);
            prop_assert_eq!(fold(pseudo_header_v6(&s, &d, next_header, len)), fold(sum(&bytes, 0)));
        }

        #[test]
        fn partial_detection(src in any::<u32>(), dst in any::<u32>(),
                             payload in proptest::collection::vec(any::<u8>(), 0..64),
                             v6 in any::<bool>(), tcp in any::<bool>()) {
            let proto = if tcp { 6 } else { 17 };
            let len = payload.len() as u32 + 8;
            let pseudo = if v6 {
                let s = Ipv6Addr::from(u128::from(src) << 64 | 0x2001_0db8);
                let d = Ipv6Addr::from(u128::from(dst) << 32 | 0x2001_0db8);
                pseudo_header_v6(&s, &d, proto, len)
            } else {
                pseudo_header_v4(Ipv4Addr::from(src), Ipv4Addr::from(dst), proto, len)
            };
            // What the kernel leaves: ~csum_fold(pseudo) complemented again.
            let partial = fold(pseudo);
            prop_assert!(is_partial(partial, pseudo));
            // Completing it as a NIC does: sum the segment with the partial
            // value in the field and complement.
            let mut seg = vec![0x30, 0x39, 0x00, 0x35, 0, 0, 0, 0];
            seg.extend_from_slice(&payload);
            seg[6..8].copy_from_slice(&partial.to_be_bytes());
            let completed = finish(sum(&seg, 0));
            seg[6..8].copy_from_slice(&[0, 0]);
            let full = finish(sum(&seg, pseudo));
            prop_assert_eq!(completed, full);
            // And a full checksum is flagged only when it collides.
            prop_assert_eq!(is_partial(full, pseudo), full == partial);
        }
    }
}
