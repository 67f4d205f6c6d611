/* SPDX-License-Identifier: Apache-2.0 */
/*
 * verdict.h - why the steering program returned what it returned.
 *
 * Every frame increments exactly one slot of `verdict_counters`, indexed by
 * this enum. The numbering is part of the userspace ABI: it is mirrored by
 * `VerdictReason` in bpf/src/maps.rs (a test checks both against the BTF of
 * the compiled object). Append new reasons before EGRET_VERDICT_COUNT; never
 * renumber or reuse a value.
 *
 * Naming: EGRET_<ACTION>_<why>. ACTION is the XDP action returned:
 * PASS (kernel), REDIRECT (the queue's AF_XDP socket, or for the fast path
 * another interface), TX (back out of the receiving interface), DROP.
 */
#ifndef EGRET_VERDICT_H
#define EGRET_VERDICT_H

enum egret_verdict_reason {
	/* Rule 1: L2. Not IPv4/IPv6/ARP after at most one 802.1Q tag. */
	EGRET_PASS_NOT_IP = 0,
	/* A header the rules needed was truncated or invalid. */
	EGRET_PASS_MALFORMED = 1,
	/* Rule 2: ARP. Not an Ethernet/IPv4 ARP request (replies, other hw). */
	EGRET_PASS_ARP_OTHER = 2,
	/* Rule 2: ARP request for a target we do not answer for. */
	EGRET_PASS_ARP_NOT_OWNED = 3,
	/* Rule 2: ARP request for an owned OWNED_NEIGH target. */
	EGRET_REDIRECT_ARP_OWNED = 4,
	/* Rule 3: Neighbor Solicitation for a target we do not answer for. */
	EGRET_PASS_NS_NOT_OWNED = 5,
	/* Rule 3: Neighbor Solicitation for an owned OWNED_NEIGH target. */
	EGRET_REDIRECT_NS_OWNED = 6,
	/* Rule 3: other Neighbor Discovery messages (RS, RA, NA, Redirect). */
	EGRET_PASS_NDP_OTHER = 7,
	/* IPv6 with more extension headers than we walk (EGRET_IPV6_MAX_EXT). */
	EGRET_PASS_IPV6_EXT_LIMIT = 8,
	/* Rule 4: TCP/UDP to an owned OWNED_NAT address, port in its NAT range. */
	EGRET_REDIRECT_NAT_PORT = 9,
	/* Rule 4: TCP/UDP to an owned OWNED_NAT address, port outside the range. */
	EGRET_PASS_SERVICE_PORT = 10,
	/* Rule 4: ICMP error or echo reply to an owned OWNED_NAT address. */
	EGRET_REDIRECT_ICMP_TO_EGRESS = 11,
	/* Rule 4: echo request or other ICMP query to an owned OWNED_NAT address. */
	EGRET_PASS_ICMP_QUERY_TO_EGRESS = 12,
	/* Rule 4: another protocol to an owned OWNED_NAT address. */
	EGRET_PASS_OTHER_PROTO_TO_EGRESS = 13,
	/* Rule 5: the (class, destination) rule says steer. */
	EGRET_REDIRECT_STEERED_SOURCE = 14,
	/* Rule 5: the (class, destination) rule says exclude. */
	EGRET_PASS_EXCLUDED_DESTINATION = 15,
	/* Rule 5: the source has a class, no rule covers the destination. */
	EGRET_PASS_UNMATCHED_DESTINATION = 16,
	/* Rule 5: no policy selects the source. */
	EGRET_PASS_UNSELECTED_SOURCE = 17,
	/* Rule 6: a later fragment following its first fragment's redirect. */
	EGRET_REDIRECT_FRAGMENT = 18,
	/* Rule 6: a later fragment following its first fragment's pass. */
	EGRET_PASS_FRAGMENT = 19,
	/* Rule 6: a later fragment with no stored decision, steered by rule 5. */
	EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE = 20,
	/* Rule 6: a later fragment with no stored decision, not steered. */
	EGRET_PASS_FRAGMENT_UNKNOWN = 21,
	/* Rule 7: ARP/NS to redirect, no socket on the queue: the kernel gets it. */
	EGRET_PASS_NO_SOCKET_NEIGH = 22,
	/* Rule 7: inbound to the NAT, no socket on the queue. */
	EGRET_DROP_NO_SOCKET_TO_EGRESS = 23,
	/* Rule 7: from a steered source, no socket on the queue (never leak). */
	EGRET_DROP_NO_SOCKET_STEERED = 24,
	/* Rule 0: translated by the fast path, sent back out of the receiving
	 * interface (one-arm). */
	EGRET_TX_FAST_PATH = 25,
	/* Rule 0: translated by the fast path, redirected to another interface. */
	EGRET_REDIRECT_FAST_PATH = 26,
	/* Rule 5a (anti-spoofing): a source rule 5 or 5b would steer, arriving
	 * on an outside interface (if_roles). Passing it would let the kernel
	 * forward it; redirecting it would let it leave as an egress IP. */
	EGRET_DROP_STEERED_ON_OUTSIDE = 27,
	/* Rule 5a: the same on an interface that checks link-layer senders
	 * (EGRET_IF_CHECK_SRC_MAC), from a sender not in pod_macs. */
	EGRET_DROP_STEERED_FROM_UNKNOWN_MAC = 28,
	/* Rule 5b: an ICMP error whose outer addresses rule 5 does not steer,
	 * about a packet a steered source sent or received (its embedded
	 * header, RFC 5508 section 4): the workers translate or drop it. */
	EGRET_REDIRECT_ICMP_ERROR_EMBEDDED = 29,
	/* Rule 4: echo request to an egress address that is not a Service VIP:
	 * the workers answer it (rate-limited). */
	EGRET_REDIRECT_ECHO_TO_EGRESS = 30,
	/* Rule 4: to an egress address that is not a Service VIP, anything but
	 * the NAT ports, ICMP errors, echo: the kernel does not own it. */
	EGRET_DROP_UNSERVED_TO_EGRESS = 31,
	/* Rule 6: a later fragment following its first fragment's drop, or
	 * with no stored decision to an egress address that is not a VIP. */
	EGRET_DROP_FRAGMENT = 32,
	/* Rule 4: TCP/UDP to a NAT port no session maps (nat_port_bits): an
	 * unsolicited packet, dropped before it can take a worker's queue. */
	EGRET_DROP_UNMAPPED_NAT_PORT = 33,
	/* Rules 2/3: ARP request or Neighbor Solicitation for an owned target
	 * past its valid_until_ns (its Lease may be another gateway's now). */
	EGRET_DROP_NEIGH_EXPIRED = 34,
	/* Rule 4: what would go to the workers for an owned egress address
	 * past its valid_until_ns. */
	EGRET_DROP_EGRESS_EXPIRED = 35,
	/* Rule 6: a later fragment with no stored decision to an egress
	 * address that is not a VIP: its first fragment may still come (out
	 * of order, RFC 4787 REQ-14); the workers hold it until it does. */
	EGRET_REDIRECT_FRAGMENT_TO_EGRESS = 36,
	/* Rule 6: the same beyond the CPU's budget of such fragments
	 * (EGRET_ORPHAN_FRAGMENTS_PER_SEC): a flood of orphan fragments from
	 * the outside stops here, before the workers' queues. */
	EGRET_DROP_FRAGMENT_RATE = 37,

	/* Rule 0 (decapsulation, docs/adr/0031-workers-in-any-subnet.md):
	 * a VXLAN frame from a node, checked, whose inner packet the fast
	 * path did not translate and rule 5 steers (or which goes to another
	 * egress address, a hairpin): the whole encapsulated frame goes to
	 * the workers, which decapsulate it again. */
	EGRET_REDIRECT_DECAP = 38,
	/* Rule 0: a tunnel frame received on an outside interface (if_roles):
	 * nodes reach the gateway from the inside. */
	EGRET_DROP_DECAP_OUTSIDE = 39,
	/* Rule 0: a tunnel frame whose outer source is no Node's InternalIP
	 * (node_addrs_v4/v6). */
	EGRET_DROP_DECAP_UNKNOWN_NODE = 40,
	/* Rule 0: an outer IPv4 first fragment (MF set) of a tunnel datagram:
	 * the program does not reassemble (a path MTU below the node's
	 * route MTU shows here). */
	EGRET_DROP_DECAP_FRAGMENT = 41,
	/* Rule 0: outer lengths inconsistent or truncated, or a VXLAN header
	 * other than Egret's (the I flag alone, the configured VNI), or an
	 * inner IP header cut short. */
	EGRET_DROP_DECAP_MALFORMED = 42,
	/* Rule 0: the inner frame is not untagged Ethernet carrying IPv4 or
	 * IPv6 (ARP, a VLAN tag, anything else). */
	EGRET_DROP_DECAP_NOT_IP = 43,
	/* Rule 0: the inner packet is not one rule 5 steers nor one to an
	 * egress address: never passed, the kernel would forward it. */
	EGRET_DROP_DECAP_NOT_STEERED = 44,

	/* Rule 0d: a tunnel frame, but its program (egret_decap) was not in
	 * decap_prog, or the tunnel was switched off between the match and
	 * the program. Dropped: the frame was Egret's. */
	EGRET_DROP_DECAP_UNAVAILABLE = 45,

	EGRET_VERDICT_COUNT = 46,
};

#endif /* EGRET_VERDICT_H */
