/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fast_path_reason.h - what the XDP fast path did with an IP frame.
 *
 * Every IPv4/IPv6 frame the fast path looks at while it is enabled increments
 * at most one slot of `fp_counters`, indexed by this enum. A frame that the
 * fast path translates is counted in `verdict_counters` instead
 * (EGRET_TX_FAST_PATH / EGRET_REDIRECT_FAST_PATH), so hits are not counted
 * twice. The numbering is part of the userspace ABI: it is mirrored by
 * `FastPathReason` in bpf/src/fast_path.rs (a test reads this file). Append
 * before EGRET_FP_COUNT; never renumber or reuse a value.
 *
 * Naming: EGRET_FP_<what>_<why>.
 *   SKIP:  the frame's shape is not one the fast path translates; it was not
 *          looked up and goes on to the steering rules.
 *   MISS:  looked up, no session entry: the steering rules.
 *   PUNT:  a session entry matched but this packet must be handled by the
 *          userspace engine: the steering rules send it there (they steer
 *          every frame a session entry can match: both keys are steered).
 */
#ifndef EGRET_FAST_PATH_REASON_H
#define EGRET_FAST_PATH_REASON_H

enum egret_fp_reason {
	/* Looked up (TCP/UDP, plain header), no session entry. */
	EGRET_FP_MISS = 0,
	/* An 802.1Q tag: the fast path translates untagged frames only. */
	EGRET_FP_SKIP_VLAN = 1,
	/* IPv4 with options (IHL > 5). */
	EGRET_FP_SKIP_IP_OPTIONS = 2,
	/* IPv4 or IPv6 fragment (first or later). */
	EGRET_FP_SKIP_FRAGMENT = 3,
	/* IPv6 with an extension header before the transport header. */
	EGRET_FP_SKIP_IPV6_EXT = 4,
	/* Neither TCP nor UDP (ICMP, ...). */
	EGRET_FP_SKIP_NOT_TCP_UDP = 5,
	/* Hit, but lengths or the IPv4 header checksum are wrong (the engine
	 * drops such packets and counts why). */
	EGRET_FP_PUNT_MALFORMED = 6,
	/* Hit, TCP SYN, FIN or RST: state changes stay in userspace. */
	EGRET_FP_PUNT_TCP_CONTROL = 7,
	/* Hit, TTL or hop limit <= 1 (userspace drops it as ttl_exceeded). */
	EGRET_FP_PUNT_TTL = 8,
	/* Hit, the transport checksum holds only the pseudo-header sum (TX
	 * checksum offload of a local sender): completing it needs the payload. */
	EGRET_FP_PUNT_PARTIAL_CHECKSUM = 9,
	/* Hit, the entry's next hop is unresolved or unknown, or the IP
	 * datagram is larger than its link's MTU (the engine answers it). */
	EGRET_FP_PUNT_NEXT_HOP = 10,
	/* Hit, at or after fp_config.valid_until_ns: an egress address's
	 * ownership may have ended; the workers judge each frame. */
	EGRET_FP_PUNT_EXPIRED = 11,
	/* Hit, but the frame arrived on the interface its next hop is on and
	 * that link is marked EGRET_NEXT_HOP_NOT_BACK (a two-arm outside
	 * link): a frame from outside carrying a pod's outbound 5-tuple. The
	 * steering rules then judge it (rule 5a drops it). */
	EGRET_FP_PUNT_WRONG_LINK = 12,

	EGRET_FP_COUNT = 13,
};

#endif /* EGRET_FAST_PATH_REASON_H */
