/* SPDX-License-Identifier: Apache-2.0 */
/*
 * steer.bpf.c - Egret's XDP steering program: the single SEC("xdp") entry.
 *
 * It decides, per received frame, whether the frame is Egret's (redirect to
 * the AF_XDP socket of the receiving queue) or the kernel's (XDP_PASS), and
 * translates the packets of established sessions itself (rule 0). Every
 * frame increments exactly one reason counter (verdict.h). The rules, in
 * order (docs/adr/0003-xdp-steering.md, docs/adr/0005-xdp-fast-path.md):
 *
 * 0d. Decapsulation (decap.h; docs/adr/0031-workers-in-any-subnet.md), when
 *    tunnel_config says enabled, before everything else: Ethernet (zero or
 *    one 802.1Q tag), IPv4 without options and not a later fragment, or
 *    IPv6 with next header UDP; UDP to the tunnel port; destination in
 *    owned_v4/owned_v6 with OWNED_NAT. Such a frame is Egret's: never
 *    passed. DROP unless the address is live (drop_egress_expired), the
 *    interface is not an outside one, the outer source is in
 *    node_addrs_v4/v6 (this replaces rule 5a's pod_macs check: the outer
 *    source MAC is a router's), it is no outer first fragment, lengths and
 *    VXLAN are Egret's (the I flag alone, the VNI) and the inner frame is untagged IPv4/IPv6, each under
 *    its own drop_decap_* reason. Then the head moves to the inner
 *    Ethernet header and rule 0 runs on the inner frame; on a miss the head
 *    moves back and the inner packet decides: to an OWNED_NAT address (a
 *    hairpin), or steered by rule 5/5b: the whole encapsulated frame is
 *    redirected (redirect_decap, rule 7 as for a steered source); else
 *    DROP (drop_decap_not_steered). Other frames go on untouched.
 * 0. The fast path (fast_path.h), when fp_config says enabled: an untagged
 *    IPv4 (no options) / IPv6 (no extension headers) unfragmented TCP/UDP
 *    packet matching an offloaded session is translated and sent with
 *    XDP_TX or bpf_redirect. Misses and the cases the engine must see
 *    (SYN/FIN/RST, TTL <= 1, partial checksums, unresolved next hops,
 *    malformed) continue below untouched, counted in fp_counters.
 * 1. Ethernet with zero or one 802.1Q tag. Anything unparseable or not
 *    IPv4/IPv6/ARP: PASS.
 * 2. ARP request (Ethernet/IPv4) whose target is in owned_v4 with OWNED_NEIGH:
 *    redirect (userspace answers). Other ARP: PASS.
 * 3. ICMPv6 Neighbor Solicitation whose target is in owned_v6 with
 *    OWNED_NEIGH: redirect; other NS: PASS. Other ND types (133-137): PASS
 *    unless the destination is an OWNED_NAT address or rule 5 steers the
 *    source (then rules 4-5 judge them: a selected pod's packet carrying an
 *    ND type is still the pod's packet). Extension
 *    headers are walked in a bounded loop (at most EGRET_IPV6_MAX_EXT).
 * 4. Destination in owned_v4/owned_v6 with OWNED_NAT: TCP/UDP with the
 *    destination port in [nat_port_lo, nat_port_hi]: redirect; ICMP errors
 *    (v4 3, 4, 5, 11, 12; v6 every type below 128, as the engine reads
 *    them) and echo replies (0, 129): redirect.
 *    The rest depends on OWNED_KERNEL_SERVICE (the address is also a
 *    Service VIP, whose ingress the kernel serves): with it, other ports,
 *    ICMP queries and other protocols PASS; without it (the kernel does not
 *    own the address) echo requests are redirected (the workers answer
 *    them) and everything else is DROPPED.
 *    4a. TCP/UDP to a NAT port that no session maps (nat_port_bits, written
 *    by the workers) is DROPPED: unsolicited floods never reach the
 *    workers' queues, where ARP/NDP requests wait too.
 * 5. Otherwise classify: policy_src LPM(source) -> class;
 *    policy_dst LPM(class, destination) -> steer: redirect; exclude or no
 *    match: PASS. Addresses only, so it also judges non-first fragments and
 *    packets whose upper layers we could not parse.
 *    5b. An ICMP error rule 5 does not steer is judged by its embedded
 *    header too (RFC 5508 section 4): if the embedded packet is one a
 *    steered source received (embedded destination -> embedded source
 *    steers), or one it sent that is not being reported back to it
 *    (embedded source -> destination steers, outer destination is not the
 *    embedded source), redirect: the workers translate it by its session or
 *    drop it; passed, the kernel would forward a pod's address.
 *    5a. Anti-spoofing, for every redirect of rules 5 and 5b (and later
 *    fragments steered by rule 5): the receiving interface's if_roles entry
 *    must allow pods' traffic: role outside DROPS; with
 *    EGRET_IF_CHECK_SRC_MAC the Ethernet source must be in pod_macs, or
 *    DROP. An interface without an entry is not restricted.
 * 6. Fragments: a first fragment is judged by rules 4-5 and its reason stored
 *    under (src, dst, id, protocol): rule 5's in frag_decisions, rule 4's
 *    redirects only in frag_decisions_in (outside senders cannot evict
 *    pods' decisions); later fragments follow
 *    the stored decision (a drop too). A later fragment without one (it
 *    came before its first, RFC 4787 REQ-14, or the first was dropped):
 *    rule 5 if the destination is not an OWNED_NAT address (a steered one
 *    is redirected: the workers hold it until its first fragment comes);
 *    PASS to a Service VIP; to another egress address, redirect within
 *    the CPU's budget (EGRET_ORPHAN_FRAGMENTS_PER_SEC, a token bucket: the
 *    workers hold it), DROP beyond.
 * 7. A redirect first checks that the receiving (interface, queue) has a
 *    socket: xsk_slots gives the interface's slot, xsks_map is keyed by
 *    slot * EGRET_XSK_QUEUES_PER_SLOT + queue. If not:
 *    ARP/NS PASS (the kernel may own the address), inbound to the NAT DROP
 *    (the kernel has no state for those ports), steered sources DROP (the
 *    kernel would forward the pod's packet untranslated: never).
 */
#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "egret_maps.h"
#include "parse.h"
#include "verdict.h"

/* ICMP types (RFC 792); <linux/icmp.h> would pull in glibc's socket headers. */
#define EGRET_ICMP_ECHOREPLY 0
#define EGRET_ICMP_DEST_UNREACH 3
#define EGRET_ICMP_SOURCE_QUENCH 4
#define EGRET_ICMP_REDIRECT 5
#define EGRET_ICMP_ECHO 8
#define EGRET_ICMP_TIME_EXCEEDED 11
#define EGRET_ICMP_PARAMETERPROB 12

/* ICMPv6 types (RFC 4443 section 2.1). */
#define EGRET_ICMPV6_DEST_UNREACH 1
#define EGRET_ICMPV6_PKT_TOOBIG 2
#define EGRET_ICMPV6_TIME_EXCEED 3
#define EGRET_ICMPV6_PARAMPROB 4
#define EGRET_ICMPV6_ECHO_REQUEST 128
#define EGRET_ICMPV6_ECHO_REPLY 129

/* Length of the ICMP/ICMPv6 error header before the embedded packet. */
#define EGRET_ICMP_ERROR_HDR_LEN 8

/* ICMPv6 Neighbor Discovery message types (RFC 4861 section 4). */
#define EGRET_ND_ROUTER_SOLICIT 133
#define EGRET_ND_NEIGHBOR_SOLICIT 135
#define EGRET_ND_REDIRECT 137

#if defined(EGRET_FP_FIB_LOOKUP) && !defined(EGRET_FP_FIB_APACHE_LICENSE)
/* The measurement variant calls bpf_fib_lookup, which the kernel offers to
 * GPL-compatible programs only (docs/adr/0005-xdp-fast-path.md). It is
 * built for tests and never loaded by the gateway. */
char LICENSE[] SEC("license") = "GPL";
#else
/* The gateway's program uses no GPL-only helper; the string matches the
 * SPDX tag. (Built with EGRET_FP_FIB_APACHE_LICENSE, the fib-lookup variant
 * keeps this string too: a test shows the kernel refusing it.) */
char LICENSE[] SEC("license") = "Apache-2.0";
#endif

static __always_inline void count(__u32 reason)
{
	__u64 *slot = bpf_map_lookup_elem(&verdict_counters, &reason);

	if (slot)
		*slot += 1; /* per-CPU slot: no atomics needed */
}

/* Rule 7: redirect to the queue's socket, or take the fallback (counted
 * under no_socket) when the queue has none. bpf_redirect_map's own fallback
 * covers the race with a socket removed between the lookup and the call. */
static __always_inline int redirect_or(struct xdp_md *ctx, __u32 counted, __u32 no_socket,
				       __u64 fallback)
{
	__u32 ifindex = ctx->ingress_ifindex;
	__u32 queue = ctx->rx_queue_index;
	struct xsk_slot *slot = bpf_map_lookup_elem(&xsk_slots, &ifindex);
	__u32 key;

	if (!slot || queue >= EGRET_XSK_QUEUES_PER_SLOT) {
		count(no_socket);
		return (int)fallback;
	}
	key = slot->slot * EGRET_XSK_QUEUES_PER_SLOT + queue;
	if (!bpf_map_lookup_elem(&xsks_map, &key)) {
		count(no_socket);
		return (int)fallback;
	}
	count(counted);
	return (int)bpf_redirect_map(&xsks_map, key, fallback);
}

#include "fast_path.h"

static __always_inline int reason_redirects(__u32 reason)
{
	switch (reason) {
	case EGRET_REDIRECT_ARP_OWNED:
	case EGRET_REDIRECT_NS_OWNED:
	case EGRET_REDIRECT_NAT_PORT:
	case EGRET_REDIRECT_ICMP_TO_EGRESS:
	case EGRET_REDIRECT_STEERED_SOURCE:
	case EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE:
	case EGRET_REDIRECT_ICMP_ERROR_EMBEDDED:
	case EGRET_REDIRECT_ECHO_TO_EGRESS:
	case EGRET_REDIRECT_FRAGMENT_TO_EGRESS:
		return 1;
	default:
		return 0;
	}
}

static __always_inline int reason_drops(__u32 reason)
{
	switch (reason) {
	case EGRET_DROP_STEERED_ON_OUTSIDE:
	case EGRET_DROP_STEERED_FROM_UNKNOWN_MAC:
	case EGRET_DROP_UNSERVED_TO_EGRESS:
	case EGRET_DROP_FRAGMENT:
	case EGRET_DROP_NEIGH_EXPIRED:
	case EGRET_DROP_EGRESS_EXPIRED:
	case EGRET_DROP_FRAGMENT_RATE:
		return 1;
	default:
		return 0;
	}
}

/* Rule 5a: may a frame that rules 5/5b would steer arrive where it did?
 * `steer` is the reason a redirect would be counted under; the answer is
 * that reason or the drop that replaces it. */
static __always_inline __u32 check_ingress(struct xdp_md *ctx, __u32 steer)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 ifindex = ctx->ingress_ifindex;
	struct if_role *role = bpf_map_lookup_elem(&if_roles, &ifindex);
	struct pod_mac_key key = { .ifindex = ifindex };
	struct ethhdr *eth = data;

	if (!role)
		return steer;
	if (role->role == EGRET_ROLE_OUTSIDE)
		return EGRET_DROP_STEERED_ON_OUTSIDE;
	if (!(role->flags & EGRET_IF_CHECK_SRC_MAC))
		return steer;
	if ((void *)(eth + 1) > data_end)
		return EGRET_DROP_STEERED_FROM_UNKNOWN_MAC;
	__builtin_memcpy(key.mac, eth->h_source, sizeof(key.mac));
	if (!bpf_map_lookup_elem(&pod_macs, &key))
		return EGRET_DROP_STEERED_FROM_UNKNOWN_MAC;
	return steer;
}

/*
 * Carry out a decision. `decided` is the reason that fixes the action and
 * the no-socket fallback; `counted` is the reason counted. They differ only
 * for a later fragment following its first fragment's stored decision.
 */
static __always_inline int apply(struct xdp_md *ctx, __u32 counted, __u32 decided)
{
	switch (decided) {
	case EGRET_REDIRECT_ARP_OWNED:
	case EGRET_REDIRECT_NS_OWNED:
		return redirect_or(ctx, counted, EGRET_PASS_NO_SOCKET_NEIGH, XDP_PASS);
	case EGRET_REDIRECT_NAT_PORT:
	case EGRET_REDIRECT_ICMP_TO_EGRESS:
		return redirect_or(ctx, counted, EGRET_DROP_NO_SOCKET_TO_EGRESS, XDP_DROP);
	case EGRET_REDIRECT_STEERED_SOURCE:
	case EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE:
	case EGRET_REDIRECT_ICMP_ERROR_EMBEDDED:
	case EGRET_REDIRECT_DECAP: /* a pod's packet, inside its node's tunnel */
		return redirect_or(ctx, counted, EGRET_DROP_NO_SOCKET_STEERED, XDP_DROP);
	case EGRET_REDIRECT_ECHO_TO_EGRESS:
	case EGRET_REDIRECT_FRAGMENT_TO_EGRESS:
		return redirect_or(ctx, counted, EGRET_DROP_NO_SOCKET_TO_EGRESS, XDP_DROP);
	case EGRET_DROP_STEERED_ON_OUTSIDE:
	case EGRET_DROP_STEERED_FROM_UNKNOWN_MAC:
	case EGRET_DROP_UNSERVED_TO_EGRESS:
	case EGRET_DROP_FRAGMENT:
	case EGRET_DROP_UNMAPPED_NAT_PORT:
	case EGRET_DROP_NEIGH_EXPIRED:
	case EGRET_DROP_EGRESS_EXPIRED:
	case EGRET_DROP_FRAGMENT_RATE:
	case EGRET_DROP_DECAP_OUTSIDE:
	case EGRET_DROP_DECAP_UNKNOWN_NODE:
	case EGRET_DROP_DECAP_FRAGMENT:
	case EGRET_DROP_DECAP_MALFORMED:
	case EGRET_DROP_DECAP_NOT_IP:
	case EGRET_DROP_DECAP_NOT_STEERED:
	case EGRET_DROP_DECAP_UNAVAILABLE:
		count(counted);
		return XDP_DROP;
	default:
		count(counted);
		return XDP_PASS;
	}
}

static __always_inline int pass(__u32 reason)
{
	count(reason);
	return XDP_PASS;
}

/* Whether an owned address may still be served: before its valid_until_ns
 * on the kernel's CLOCK_MONOTONIC (egret_maps.h). The clock is read only
 * for an address with a deadline. */
static __always_inline int owned_live(const struct owned_addr *owned)
{
	return owned->valid_until_ns == EGRET_VALID_FOREVER || bpf_ktime_get_ns() < owned->valid_until_ns;
}

/* Rule 4 past the deadline: nothing goes to the workers for the address. */
static __always_inline __u32 check_live(const struct owned_addr *owned, __u32 reason)
{
	if (reason_redirects(reason) && !owned_live(owned))
		return EGRET_DROP_EGRESS_EXPIRED;
	return reason;
}

/* Rule 2 (RFC 826): only Ethernet/IPv4 requests for an owned target. */
static __always_inline int handle_arp(struct xdp_md *ctx, void *l3, void *data_end)
{
	struct egret_arp_hdr *hdr = l3;
	struct egret_arp_eth_ipv4 *arp = l3;
	struct owned_addr *owned;
	__u32 target;

	if ((void *)(hdr + 1) > data_end)
		return pass(EGRET_PASS_MALFORMED);
	if (hdr->htype != bpf_htons(EGRET_ARP_HTYPE_ETHER) || hdr->ptype != bpf_htons(ETH_P_IP) ||
	    hdr->hlen != ETH_ALEN || hdr->plen != 4 || hdr->oper != bpf_htons(EGRET_ARP_OP_REQUEST))
		return pass(EGRET_PASS_ARP_OTHER);
	if ((void *)(arp + 1) > data_end)
		return pass(EGRET_PASS_MALFORMED);

	__builtin_memcpy(&target, arp->tpa, sizeof(target));
	owned = bpf_map_lookup_elem(&owned_v4, &target);
	if (!owned || !(owned->flags & OWNED_NEIGH))
		return pass(EGRET_PASS_ARP_NOT_OWNED);
	if (!owned_live(owned))
		return apply(ctx, EGRET_DROP_NEIGH_EXPIRED, EGRET_DROP_NEIGH_EXPIRED);
	return apply(ctx, EGRET_REDIRECT_ARP_OWNED, EGRET_REDIRECT_ARP_OWNED);
}

/* Rule 5b: ICMP error types, exactly as the engine's wire::icmpv4::is_error
 * and wire::icmpv6::is_error read them: IPv4 3, 4 (Source Quench), 5
 * (Redirect), 11, 12 (RFC 792); IPv6 every type below 128 (RFC 4443
 * section 2.1: a clear high-order bit marks an error, assigned or not). */
static __always_inline int icmp_is_error(__u8 type, int v6)
{
	if (v6)
		return type < 128;
	return type == EGRET_ICMP_DEST_UNREACH || type == EGRET_ICMP_SOURCE_QUENCH ||
	       type == EGRET_ICMP_REDIRECT || type == EGRET_ICMP_TIME_EXCEEDED ||
	       type == EGRET_ICMP_PARAMETERPROB;
}

/* Rule 4, ICMP part: which ICMP messages to an egress address are replies to
 * translated traffic: every error type the engine translates (rule 5b's
 * list) and echo replies. */
static __always_inline int icmp_belongs_to_nat(__u8 type, int v6)
{
	if (icmp_is_error(type, v6))
		return 1;
	return type == (v6 ? EGRET_ICMPV6_ECHO_REPLY : EGRET_ICMP_ECHOREPLY);
}

/* Rule 4: traffic to an OWNED_NAT address, judged by its upper layer. What
 * Egret does not serve is the kernel's on a Service VIP
 * (OWNED_KERNEL_SERVICE) and dropped elsewhere: the kernel does not own the
 * address, it would fail to resolve it or send the packet back upstream. */
static __always_inline __u32 judge_to_egress(const struct owned_addr *owned, __u8 proto, void *l4,
					     void *data_end, int v6)
{
	int kernel = owned->flags & OWNED_KERNEL_SERVICE;

	if (proto == IPPROTO_TCP || proto == IPPROTO_UDP) {
		struct egret_ports *ports = l4;
		__u16 port;

		if ((void *)(ports + 1) > data_end)
			return EGRET_PASS_MALFORMED;
		port = bpf_ntohs(ports->dest);
		if (port >= owned->nat_port_lo && port <= owned->nat_port_hi)
			return EGRET_REDIRECT_NAT_PORT;
		return kernel ? EGRET_PASS_SERVICE_PORT : EGRET_DROP_UNSERVED_TO_EGRESS;
	}
	if (proto == (v6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP)) {
		__u8 *type = l4;

		if ((void *)(type + 1) > data_end)
			return EGRET_PASS_MALFORMED;
		if (icmp_belongs_to_nat(*type, v6))
			return EGRET_REDIRECT_ICMP_TO_EGRESS;
		if (kernel)
			return EGRET_PASS_ICMP_QUERY_TO_EGRESS;
		if (*type == (v6 ? EGRET_ICMPV6_ECHO_REQUEST : EGRET_ICMP_ECHO))
			return EGRET_REDIRECT_ECHO_TO_EGRESS;
		return EGRET_DROP_UNSERVED_TO_EGRESS;
	}
	return kernel ? EGRET_PASS_OTHER_PROTO_TO_EGRESS : EGRET_DROP_UNSERVED_TO_EGRESS;
}


/* Rule 5 for IPv4: two longest-prefix lookups (docs/architecture.md,
 * "Policy classification"). */
static __always_inline __u32 classify_v4(__be32 src, __be32 dst)
{
	struct policy_src_v4_key skey = { .prefixlen = 32 };
	struct policy_dst_v4_key dkey = { .prefixlen = 32 + 32 };
	struct policy_class *class;
	struct policy_rule *rule;

	__builtin_memcpy(skey.addr, &src, sizeof(skey.addr));
	class = bpf_map_lookup_elem(&policy_src_v4, &skey);
	if (!class)
		return EGRET_PASS_UNSELECTED_SOURCE;

	dkey.class_id = bpf_htonl(class->class_id);
	__builtin_memcpy(dkey.addr, &dst, sizeof(dkey.addr));
	rule = bpf_map_lookup_elem(&policy_dst_v4, &dkey);
	if (!rule)
		return EGRET_PASS_UNMATCHED_DESTINATION;
	return rule->action == POLICY_STEER ? EGRET_REDIRECT_STEERED_SOURCE
					    : EGRET_PASS_EXCLUDED_DESTINATION;
}

/* Rule 5 for IPv6, on two addresses (`src`, `dst`: 16 bytes each). */
static __always_inline __u32 classify_v6_addrs(const void *src, const void *dst)
{
	struct policy_src_v6_key skey = { .prefixlen = 128 };
	struct policy_dst_v6_key dkey = { .prefixlen = 32 + 128 };
	struct policy_class *class;
	struct policy_rule *rule;

	__builtin_memcpy(skey.addr, src, sizeof(skey.addr));
	class = bpf_map_lookup_elem(&policy_src_v6, &skey);
	if (!class)
		return EGRET_PASS_UNSELECTED_SOURCE;

	dkey.class_id = bpf_htonl(class->class_id);
	__builtin_memcpy(dkey.addr, dst, sizeof(dkey.addr));
	rule = bpf_map_lookup_elem(&policy_dst_v6, &dkey);
	if (!rule)
		return EGRET_PASS_UNMATCHED_DESTINATION;
	return rule->action == POLICY_STEER ? EGRET_REDIRECT_STEERED_SOURCE
					    : EGRET_PASS_EXCLUDED_DESTINATION;
}

/* Rule 5 for an IPv6 header. */
static __always_inline __u32 classify_v6(const struct ipv6hdr *ip6)
{
	return classify_v6_addrs(&ip6->saddr, &ip6->daddr);
}

/* Rule 5b for IPv4: `reason` is rule 5's answer for the outer header, kept
 * unless the message is an ICMP error about a steered source's packet. The
 * embedded header must be a whole IPv4 header (the engine's
 * nat::icmp_error reads the same bytes). */
static __always_inline __u32 judge_icmp_error_v4(__u32 reason, const struct iphdr *outer, void *l4,
						 void *data_end)
{
	__u8 *type = l4;
	struct iphdr *inner = l4 + EGRET_ICMP_ERROR_HDR_LEN;
	__be32 outer_dst = outer->daddr;

	if (reason == EGRET_REDIRECT_STEERED_SOURCE || outer->protocol != IPPROTO_ICMP)
		return reason;
	if ((void *)(type + 1) > data_end || !icmp_is_error(*type, 0))
		return reason;
	if ((void *)(inner + 1) > data_end || inner->version != 4 || inner->ihl < 5)
		return reason;
	/* The embedded header must lie within the datagram (its total length),
	 * not merely within the frame: trailing padding is no part of it. */
	if ((__u32)((void *)(inner + 1) - (void *)outer) > bpf_ntohs(outer->tot_len))
		return reason;
	/* About a packet the steered source received (RFC 5508 section 4.2:
	 * the error travels out, as the session's outbound direction). */
	if (classify_v4(inner->daddr, inner->saddr) == EGRET_REDIRECT_STEERED_SOURCE)
		return EGRET_REDIRECT_ICMP_ERROR_EMBEDDED;
	/* About a packet it sent, reported somewhere other than to it. */
	if (inner->saddr != outer_dst &&
	    classify_v4(inner->saddr, inner->daddr) == EGRET_REDIRECT_STEERED_SOURCE)
		return EGRET_REDIRECT_ICMP_ERROR_EMBEDDED;
	return reason;
}

static __always_inline int in6_equal(const __u8 *a, const __u8 *b)
{
	__u8 diff = 0;
	int i;

#pragma unroll
	for (i = 0; i < 16; i++)
		diff |= a[i] ^ b[i];
	return diff == 0;
}

/* Rule 5b for IPv6 (embedded extension headers are not walked: the
 * addresses are in the fixed header). */
static __always_inline __u32 judge_icmp_error_v6(__u32 reason, __u8 proto, void *l4, void *data_end,
						 const struct ipv6hdr *outer)
{
	__u8 *type = l4;
	struct ipv6hdr *inner;

	if (reason == EGRET_REDIRECT_STEERED_SOURCE || proto != IPPROTO_ICMPV6 || !l4)
		return reason;
	inner = l4 + EGRET_ICMP_ERROR_HDR_LEN;
	if ((void *)(type + 1) > data_end || !icmp_is_error(*type, 1))
		return reason;
	if ((void *)(inner + 1) > data_end || inner->version != 6)
		return reason;
	/* Within the packet (its payload length), not merely within the frame. */
	if ((__u32)((void *)(inner + 1) - (void *)(outer + 1)) > bpf_ntohs(outer->payload_len))
		return reason;
	if (classify_v6_addrs(&inner->daddr, &inner->saddr) == EGRET_REDIRECT_STEERED_SOURCE)
		return EGRET_REDIRECT_ICMP_ERROR_EMBEDDED;
	if (!in6_equal((const __u8 *)&inner->saddr, (const __u8 *)&outer->daddr) &&
	    classify_v6_addrs(&inner->saddr, &inner->daddr) == EGRET_REDIRECT_STEERED_SOURCE)
		return EGRET_REDIRECT_ICMP_ERROR_EMBEDDED;
	return reason;
}

/* Rule 4a's lookup, a global function: the verifier checks it once, on its
 * own, instead of on every path of the entry point that reaches it (the
 * entry would exceed the verifier's instruction budget). The destination
 * address comes as four words (IPv4: a0 only), `fpp` packs the family
 * (bits 24-31), the protocol (16-23) and the port (0-15). Returns 0 when the
 * (address, protocol) is tracked and no session maps the port, else 1. */
__attribute__((noinline)) int egret_nat_port_mapped(__u32 a0, __u32 a1, __u32 a2, __u32 a3, __u32 fpp)
{
	struct nat_port_key key = {};
	struct nat_port_slot *slot;
	__u16 port = fpp & 0xffff;
	__u64 *word;
	__u32 index;

	key.family = fpp >> 24;
	key.proto = (fpp >> 16) & 0xff;
	__builtin_memcpy(&key.addr[0], &a0, 4);
	__builtin_memcpy(&key.addr[4], &a1, 4);
	__builtin_memcpy(&key.addr[8], &a2, 4);
	__builtin_memcpy(&key.addr[12], &a3, 4);
	slot = bpf_map_lookup_elem(&nat_port_slots, &key);
	if (!slot || slot->slot >= EGRET_NAT_PORT_SLOTS)
		return 1;
	index = slot->slot * EGRET_NAT_PORT_WORDS + (port >> 6);
	word = bpf_map_lookup_elem(&nat_port_bits, &index);
	if (!word)
		return 1;
	return (*word >> (port & 63)) & 1;
}

/* Rule 4a: a NAT-port redirect stands only if a session maps the port
 * (nat_port_bits); `addr` is the destination, 4 or 16 bytes. An (address,
 * protocol) without a slot is not filtered. */
static __always_inline __u32 check_mapped(__u32 reason, const void *addr, __u8 family, __u8 proto,
					  void *l4, void *data_end)
{
	struct egret_ports *ports = l4;
	__u32 a[4] = {};

	if (reason != EGRET_REDIRECT_NAT_PORT || (void *)(ports + 1) > data_end)
		return reason;
	if (family == EGRET_FAMILY_V4)
		__builtin_memcpy(a, addr, 4);
	else
		__builtin_memcpy(a, addr, 16);
	if (egret_nat_port_mapped(a[0], a[1], a[2], a[3],
				  ((__u32)family << 24) | ((__u32)proto << 16) | bpf_ntohs(ports->dest)))
		return reason;
	return EGRET_DROP_UNMAPPED_NAT_PORT;
}

/* Rule 6: a first fragment's reason is worth storing when Egret had an
 * opinion about the datagram (rule 4, or rule 5 with a classified source).
 * Unrelated traffic (unselected sources) is not stored: a later fragment
 * without an entry reaches the same answer through rule 5. */
static __always_inline void remember_fragment(const struct frag_key *key, __u32 reason, int to_egress)
{
	struct frag_decision decision = { .reason = reason };

	if (reason == EGRET_PASS_UNSELECTED_SOURCE || reason == EGRET_PASS_MALFORMED)
		return;
	/* Rule 4's decisions live apart (frag_decisions_in), and only its
	 * redirects: outside senders reach rule 4 at will, and must not evict
	 * pods' decisions nor, with unmapped ports, the replies' decisions. */
	if (to_egress) {
		if (reason_redirects(reason))
			bpf_map_update_elem(&frag_decisions_in, key, &decision, BPF_ANY);
		return;
	}
	bpf_map_update_elem(&frag_decisions, key, &decision, BPF_ANY);
}

/* Rule 6: whether this CPU may send one more orphan fragment (a later
 * fragment to an egress address, nothing stored) to the workers: a token
 * bucket of EGRET_ORPHAN_FRAGMENTS_PER_SEC, EGRET_ORPHAN_FRAGMENT_BURST deep.
 * Per CPU: no atomics, and the bound scales with the queues. */
static __always_inline int orphan_fragment_admitted(void)
{
	__u32 zero = 0;
	struct orphan_fragment_budget *b = bpf_map_lookup_elem(&orphan_fragment_budget, &zero);
	__u64 now = bpf_ktime_get_ns();
	__u64 earned;

	if (!b)
		return 0;
	earned = (now - b->refilled_ns) / EGRET_ORPHAN_FRAGMENT_NS;
	if (earned) {
		if (b->tokens + earned >= EGRET_ORPHAN_FRAGMENT_BURST) {
			b->tokens = EGRET_ORPHAN_FRAGMENT_BURST;
			b->refilled_ns = now;
		} else {
			b->tokens += earned;
			b->refilled_ns += earned * EGRET_ORPHAN_FRAGMENT_NS;
		}
	}
	if (!b->tokens)
		return 0;
	b->tokens -= 1;
	return 1;
}

/* Rule 6 for a later fragment: follow the first fragment, else rule 5
 * (addresses only) unless the destination is an OWNED_NAT address. */
static __always_inline int later_fragment(struct xdp_md *ctx, const struct frag_key *key,
					  const struct owned_addr *owned_dst, __u32 by_policy)
{
	struct frag_decision *stored;

	if (owned_dst && (owned_dst->flags & OWNED_NAT))
		stored = bpf_map_lookup_elem(&frag_decisions_in, key);
	else
		stored = bpf_map_lookup_elem(&frag_decisions, key);

	if (stored) {
		__u32 decided = stored->reason;

		if (reason_redirects(decided)) {
			if (owned_dst && (owned_dst->flags & OWNED_NAT) && !owned_live(owned_dst))
				return apply(ctx, EGRET_DROP_EGRESS_EXPIRED, EGRET_DROP_EGRESS_EXPIRED);
			return apply(ctx, EGRET_REDIRECT_FRAGMENT, decided);
		}
		if (reason_drops(decided))
			return apply(ctx, EGRET_DROP_FRAGMENT, EGRET_DROP_FRAGMENT);
		return pass(EGRET_PASS_FRAGMENT);
	}
	if (owned_dst && (owned_dst->flags & OWNED_NAT)) {
		if (owned_dst->flags & OWNED_KERNEL_SERVICE)
			return pass(EGRET_PASS_FRAGMENT_UNKNOWN);
		if (!owned_live(owned_dst))
			return apply(ctx, EGRET_DROP_EGRESS_EXPIRED, EGRET_DROP_EGRESS_EXPIRED);
		if (!orphan_fragment_admitted())
			return apply(ctx, EGRET_DROP_FRAGMENT_RATE, EGRET_DROP_FRAGMENT_RATE);
		return apply(ctx, EGRET_REDIRECT_FRAGMENT_TO_EGRESS, EGRET_REDIRECT_FRAGMENT_TO_EGRESS);
	}
	if (by_policy == EGRET_REDIRECT_STEERED_SOURCE) {
		__u32 reason = check_ingress(ctx, EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE);

		return apply(ctx, reason, reason);
	}
	return pass(EGRET_PASS_FRAGMENT_UNKNOWN);
}

/* IPv4 (RFC 791): rules 4, 5 and 6. */
static __always_inline int handle_ipv4(struct xdp_md *ctx, void *l3, void *data_end)
{
	struct iphdr *ip = l3;
	struct frag_key fkey = {};
	struct owned_addr *owned;
	__u32 hdr_len, reason;
	__u16 frag;
	__be32 daddr;
	void *l4;

	if ((void *)(ip + 1) > data_end)
		return pass(EGRET_PASS_MALFORMED);
	hdr_len = (__u32)ip->ihl * 4;
	if (ip->version != 4 || hdr_len < sizeof(*ip) || bpf_ntohs(ip->tot_len) < hdr_len)
		return pass(EGRET_PASS_MALFORMED);
	l4 = l3 + hdr_len;
	if (l4 > data_end)
		return pass(EGRET_PASS_MALFORMED);

	daddr = ip->daddr;
	owned = bpf_map_lookup_elem(&owned_v4, &daddr);
	frag = bpf_ntohs(ip->frag_off);
	if (frag & (EGRET_IP_MF | EGRET_IP_OFFSET_MASK)) {
		__builtin_memcpy(fkey.src, &ip->saddr, 4);
		__builtin_memcpy(fkey.dst, &ip->daddr, 4);
		fkey.id = bpf_ntohs(ip->id);
		fkey.proto = ip->protocol;
		fkey.family = EGRET_FAMILY_V4;
		if (frag & EGRET_IP_OFFSET_MASK)
			return later_fragment(ctx, &fkey, owned, classify_v4(ip->saddr, daddr));
	}

	if (owned && (owned->flags & OWNED_NAT)) {
		reason = judge_to_egress(owned, ip->protocol, l4, data_end, 0);
		reason = check_mapped(reason, &daddr, EGRET_FAMILY_V4, ip->protocol, l4, data_end);
		reason = check_live(owned, reason);
	} else {
		reason = classify_v4(ip->saddr, daddr);
		reason = judge_icmp_error_v4(reason, ip, l4, data_end);
		if (reason_redirects(reason))
			reason = check_ingress(ctx, reason);
	}

	if (frag & EGRET_IP_MF)
		remember_fragment(&fkey, reason, owned && (owned->flags & OWNED_NAT));
	return apply(ctx, reason, reason);
}

/* IPv6 (RFC 8200): rules 3, 4, 5 and 6. */
/*
 * An IPv6 packet the program cannot read to the end of what its rules need,
 * whose addresses it can read: a steered source's is still steered (the
 * workers drop it and count it malformed), since the kernel would forward
 * it untranslated; anything else passes, counted as `reason`.
 */
static __always_inline int unreadable_v6(struct xdp_md *ctx, struct ipv6hdr *ip6, struct owned_addr *owned,
					 __u32 reason)
{
	if (!(owned && (owned->flags & OWNED_NAT)) &&
	    classify_v6(ip6) == EGRET_REDIRECT_STEERED_SOURCE)
		reason = check_ingress(ctx, EGRET_REDIRECT_STEERED_SOURCE);
	return apply(ctx, reason, reason);
}

static __always_inline int handle_ipv6(struct xdp_md *ctx, void *l3, void *data_end)
{
	struct ipv6hdr *ip6 = l3;
	struct ipv6_layout layout = {};
	struct egret_in6 daddr;
	struct frag_key fkey = {};
	struct owned_addr *owned;
	__u32 reason;
	int rc;

	if ((void *)(ip6 + 1) > data_end)
		return pass(EGRET_PASS_MALFORMED);
	if (ip6->version != 6)
		return pass(EGRET_PASS_MALFORMED);

	__builtin_memcpy(daddr.addr, &ip6->daddr, sizeof(daddr.addr));
	owned = bpf_map_lookup_elem(&owned_v6, &daddr);

	rc = walk_ipv6(ip6, data_end, &layout);
	if (rc != EGRET_PARSE_OK)
		return unreadable_v6(ctx, ip6, owned,
				     rc == EGRET_PARSE_EXT_LIMIT ? EGRET_PASS_IPV6_EXT_LIMIT
								 : EGRET_PASS_MALFORMED);

	if (layout.is_fragment) {
		__builtin_memcpy(fkey.src, &ip6->saddr, 16);
		__builtin_memcpy(fkey.dst, &ip6->daddr, 16);
		fkey.id = layout.frag_id;
		/* The Fragment header's Next Header, not the upper layer: with
		 * extension headers after the Fragment header the first
		 * fragment reaches the upper layer and later ones do not. */
		fkey.proto = layout.frag_proto;
		fkey.family = EGRET_FAMILY_V6;
		if (layout.later_fragment)
			return later_fragment(ctx, &fkey, owned, classify_v6(ip6));
	}

	/* Rule 3: Neighbor Discovery (RFC 4861 section 4.3, 7.2.3). */
	if (layout.proto == IPPROTO_ICMPV6) {
		struct egret_nd_ns *ns = layout.l4;
		struct owned_addr *target_owned;
		struct egret_in6 target;

		/* No type byte, or a Neighbor Solicitation shorter than its
		 * 24 bytes (RFC 4861 section 7.1.1: the kernel discards it). */
		if ((void *)&ns->type + 1 > data_end)
			return unreadable_v6(ctx, ip6, owned, EGRET_PASS_MALFORMED);
		if (ns->type == EGRET_ND_NEIGHBOR_SOLICIT) {
			if ((void *)(ns + 1) > data_end)
				return unreadable_v6(ctx, ip6, owned, EGRET_PASS_MALFORMED);
			__builtin_memcpy(target.addr, ns->target, sizeof(target.addr));
			target_owned = bpf_map_lookup_elem(&owned_v6, &target);
			if (!target_owned || !(target_owned->flags & OWNED_NEIGH))
				return pass(EGRET_PASS_NS_NOT_OWNED);
			if (!owned_live(target_owned))
				return apply(ctx, EGRET_DROP_NEIGH_EXPIRED, EGRET_DROP_NEIGH_EXPIRED);
			return apply(ctx, EGRET_REDIRECT_NS_OWNED, EGRET_REDIRECT_NS_OWNED);
		}
		/* Other ND types pass only where rules 4-5 would pass them too:
		 * a selected pod's packet that merely carries an ND type is no ND
		 * message the kernel would keep on the link (RFC 4861 7.1), and
		 * passing it would let the kernel forward it with the pod's
		 * address; one to an egress address is judged by rule 4. */
		if (ns->type >= EGRET_ND_ROUTER_SOLICIT && ns->type <= EGRET_ND_REDIRECT &&
		    !(owned && (owned->flags & OWNED_NAT)) &&
		    classify_v6(ip6) != EGRET_REDIRECT_STEERED_SOURCE)
			return pass(EGRET_PASS_NDP_OTHER);
	}

	if (owned && (owned->flags & OWNED_NAT)) {
		reason = judge_to_egress(owned, layout.proto, layout.l4, data_end, 1);
		reason = check_mapped(reason, daddr.addr, EGRET_FAMILY_V6, layout.proto, layout.l4, data_end);
		reason = check_live(owned, reason);
	} else {
		reason = classify_v6(ip6);
		reason = judge_icmp_error_v6(reason, layout.proto, layout.l4, data_end, ip6);
		if (reason_redirects(reason))
			reason = check_ingress(ctx, reason);
	}

	if (layout.is_fragment)
		remember_fragment(&fkey, reason, owned && (owned->flags & OWNED_NAT));
	return apply(ctx, reason, reason);
}

#include "decap.h"

SEC("xdp")
int egret_steer(struct xdp_md *ctx)
{
	void *data, *data_end;
	__be16 proto;
	void *l3;
	int fp;

	/* Rule 0d first (decap.h): its program takes the frame over. */
	if (egret_tunnel_frame(ctx)) {
		bpf_tail_call(ctx, &decap_prog, 0);
		/* Only without the program in decap_prog (the loader puts it
		 * there before anything can switch the tunnel on). */
		return apply(ctx, EGRET_DROP_DECAP_UNAVAILABLE, EGRET_DROP_DECAP_UNAVAILABLE);
	}

	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	if (parse_ethernet(data, data_end, &l3, &proto) != EGRET_PARSE_OK)
		return pass(EGRET_PASS_MALFORMED);

	fp = fast_path(ctx, data, data_end, l3, proto);
	if (fp != EGRET_FP_CONTINUE)
		return fp;

	if (proto == bpf_htons(ETH_P_IP))
		return handle_ipv4(ctx, l3, data_end);
	if (proto == bpf_htons(ETH_P_IPV6))
		return handle_ipv6(ctx, l3, data_end);
	if (proto == bpf_htons(ETH_P_ARP))
		return handle_arp(ctx, l3, data_end);
	return pass(EGRET_PASS_NOT_IP);
}
