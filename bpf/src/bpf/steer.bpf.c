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
 *    OWNED_NEIGH: redirect. Other NS and other ND messages: PASS. Extension
 *    headers are walked in a bounded loop (at most EGRET_IPV6_MAX_EXT).
 * 4. Destination in owned_v4/owned_v6 with OWNED_NAT: TCP/UDP with the
 *    destination port in [nat_port_lo, nat_port_hi]: redirect; ICMP errors
 *    (v4 3, 11, 12; v6 1, 2, 3, 4) and echo replies (0, 129): redirect; echo
 *    requests, other ICMP, other ports, other protocols: PASS.
 * 5. Otherwise classify: policy_src LPM(source) -> class;
 *    policy_dst LPM(class, destination) -> steer: redirect; exclude or no
 *    match: PASS. Addresses only, so it also judges non-first fragments and
 *    packets whose upper layers we could not parse.
 * 6. Fragments: a first fragment is judged by rules 4-5 and its reason stored
 *    in frag_decisions under (src, dst, id, protocol); later fragments follow
 *    the stored decision. A later fragment without one: rule 5 if the
 *    destination is not an OWNED_NAT address, otherwise PASS.
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
#define EGRET_ICMP_TIME_EXCEEDED 11
#define EGRET_ICMP_PARAMETERPROB 12

/* ICMPv6 types (RFC 4443 section 2.1). */
#define EGRET_ICMPV6_DEST_UNREACH 1
#define EGRET_ICMPV6_PKT_TOOBIG 2
#define EGRET_ICMPV6_TIME_EXCEED 3
#define EGRET_ICMPV6_PARAMPROB 4
#define EGRET_ICMPV6_ECHO_REPLY 129

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
		return 1;
	default:
		return 0;
	}
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
		return redirect_or(ctx, counted, EGRET_DROP_NO_SOCKET_STEERED, XDP_DROP);
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
	return apply(ctx, EGRET_REDIRECT_ARP_OWNED, EGRET_REDIRECT_ARP_OWNED);
}

/* Rule 4, ICMP part: which ICMP messages to an egress address are replies to
 * translated traffic. RFC 792 (v4 types), RFC 4443 section 2.1 (v6 types). */
static __always_inline int icmp_belongs_to_nat(__u8 type, int v6)
{
	if (v6)
		return type == EGRET_ICMPV6_DEST_UNREACH || type == EGRET_ICMPV6_PKT_TOOBIG ||
		       type == EGRET_ICMPV6_TIME_EXCEED || type == EGRET_ICMPV6_PARAMPROB ||
		       type == EGRET_ICMPV6_ECHO_REPLY;
	return type == EGRET_ICMP_DEST_UNREACH || type == EGRET_ICMP_TIME_EXCEEDED ||
	       type == EGRET_ICMP_PARAMETERPROB || type == EGRET_ICMP_ECHOREPLY;
}

/* Rule 4: traffic to an OWNED_NAT address, judged by its upper layer. */
static __always_inline __u32 judge_to_egress(const struct owned_addr *owned, __u8 proto, void *l4,
					     void *data_end, int v6)
{
	if (proto == IPPROTO_TCP || proto == IPPROTO_UDP) {
		struct egret_ports *ports = l4;
		__u16 port;

		if ((void *)(ports + 1) > data_end)
			return EGRET_PASS_MALFORMED;
		port = bpf_ntohs(ports->dest);
		if (port >= owned->nat_port_lo && port <= owned->nat_port_hi)
			return EGRET_REDIRECT_NAT_PORT;
		return EGRET_PASS_SERVICE_PORT;
	}
	if (proto == (v6 ? IPPROTO_ICMPV6 : IPPROTO_ICMP)) {
		__u8 *type = l4;

		if ((void *)(type + 1) > data_end)
			return EGRET_PASS_MALFORMED;
		if (icmp_belongs_to_nat(*type, v6))
			return EGRET_REDIRECT_ICMP_TO_EGRESS;
		return EGRET_PASS_ICMP_QUERY_TO_EGRESS;
	}
	return EGRET_PASS_OTHER_PROTO_TO_EGRESS;
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

/* Rule 5 for IPv6. */
static __always_inline __u32 classify_v6(const struct ipv6hdr *ip6)
{
	struct policy_src_v6_key skey = { .prefixlen = 128 };
	struct policy_dst_v6_key dkey = { .prefixlen = 32 + 128 };
	struct policy_class *class;
	struct policy_rule *rule;

	__builtin_memcpy(skey.addr, &ip6->saddr, sizeof(skey.addr));
	class = bpf_map_lookup_elem(&policy_src_v6, &skey);
	if (!class)
		return EGRET_PASS_UNSELECTED_SOURCE;

	dkey.class_id = bpf_htonl(class->class_id);
	__builtin_memcpy(dkey.addr, &ip6->daddr, sizeof(dkey.addr));
	rule = bpf_map_lookup_elem(&policy_dst_v6, &dkey);
	if (!rule)
		return EGRET_PASS_UNMATCHED_DESTINATION;
	return rule->action == POLICY_STEER ? EGRET_REDIRECT_STEERED_SOURCE
					    : EGRET_PASS_EXCLUDED_DESTINATION;
}

/* Rule 6: a first fragment's reason is worth storing when Egret had an
 * opinion about the datagram (rule 4, or rule 5 with a classified source).
 * Unrelated traffic (unselected sources) is not stored: a later fragment
 * without an entry reaches the same answer through rule 5. */
static __always_inline void remember_fragment(const struct frag_key *key, __u32 reason)
{
	struct frag_decision decision = { .reason = reason };

	if (reason == EGRET_PASS_UNSELECTED_SOURCE || reason == EGRET_PASS_MALFORMED)
		return;
	bpf_map_update_elem(&frag_decisions, key, &decision, BPF_ANY);
}

/* Rule 6 for a later fragment: follow the first fragment, else rule 5
 * (addresses only) unless the destination is an OWNED_NAT address. */
static __always_inline int later_fragment(struct xdp_md *ctx, const struct frag_key *key,
					  const struct owned_addr *owned_dst, __u32 by_policy)
{
	struct frag_decision *stored = bpf_map_lookup_elem(&frag_decisions, key);

	if (stored) {
		__u32 decided = stored->reason;

		if (reason_redirects(decided))
			return apply(ctx, EGRET_REDIRECT_FRAGMENT, decided);
		return pass(EGRET_PASS_FRAGMENT);
	}
	if (owned_dst && (owned_dst->flags & OWNED_NAT))
		return pass(EGRET_PASS_FRAGMENT_UNKNOWN);
	if (by_policy == EGRET_REDIRECT_STEERED_SOURCE)
		return apply(ctx, EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE,
			     EGRET_REDIRECT_FRAGMENT_STEERED_SOURCE);
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

	if (owned && (owned->flags & OWNED_NAT))
		reason = judge_to_egress(owned, ip->protocol, l4, data_end, 0);
	else
		reason = classify_v4(ip->saddr, daddr);

	if (frag & EGRET_IP_MF)
		remember_fragment(&fkey, reason);
	return apply(ctx, reason, reason);
}

/* IPv6 (RFC 8200): rules 3, 4, 5 and 6. */
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
	if (rc != EGRET_PARSE_OK) {
		/* The addresses are readable even if the chain is not: a steered
		 * source is still steered (userspace counts the malformed packet),
		 * since the kernel would forward it untranslated. */
		reason = rc == EGRET_PARSE_EXT_LIMIT ? EGRET_PASS_IPV6_EXT_LIMIT
						     : EGRET_PASS_MALFORMED;
		if (!(owned && (owned->flags & OWNED_NAT)) &&
		    classify_v6(ip6) == EGRET_REDIRECT_STEERED_SOURCE)
			reason = EGRET_REDIRECT_STEERED_SOURCE;
		return apply(ctx, reason, reason);
	}

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

		if ((void *)&ns->type + 1 > data_end)
			return pass(EGRET_PASS_MALFORMED);
		if (ns->type == EGRET_ND_NEIGHBOR_SOLICIT) {
			if ((void *)(ns + 1) > data_end)
				return pass(EGRET_PASS_MALFORMED);
			__builtin_memcpy(target.addr, ns->target, sizeof(target.addr));
			target_owned = bpf_map_lookup_elem(&owned_v6, &target);
			if (!target_owned || !(target_owned->flags & OWNED_NEIGH))
				return pass(EGRET_PASS_NS_NOT_OWNED);
			return apply(ctx, EGRET_REDIRECT_NS_OWNED, EGRET_REDIRECT_NS_OWNED);
		}
		if (ns->type >= EGRET_ND_ROUTER_SOLICIT && ns->type <= EGRET_ND_REDIRECT)
			return pass(EGRET_PASS_NDP_OTHER);
	}

	if (owned && (owned->flags & OWNED_NAT))
		reason = judge_to_egress(owned, layout.proto, layout.l4, data_end, 1);
	else
		reason = classify_v6(ip6);

	if (layout.is_fragment)
		remember_fragment(&fkey, reason);
	return apply(ctx, reason, reason);
}

SEC("xdp")
int egret_steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__be16 proto;
	void *l3;

	int fp;

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
