/* SPDX-License-Identifier: Apache-2.0 */
/*
 * decap.h - rule 0 of the steering program for frames Egret's nodes
 * tunnel to it (docs/adr/0031-workers-in-any-subnet.md, "The gateway: XDP
 * checks, strips, and reuses the fast path").
 *
 * A node outside the gateway's subnet sends a selected pod's frame inside
 * VXLAN (RFC 7348): outer Ethernet (at most one 802.1Q tag), outer IPv4
 * without options or IPv6 without extension headers, UDP to the cluster's
 * tunnel port (tunnel_config), the VXLAN header with the I flag alone and
 * the cluster's VNI, then the pod's own Ethernet frame. The outer destination is an egress address
 * (owned_v4/v6 with OWNED_NAT). Such a frame is Egret's: it is sent to the
 * workers or dropped, each drop under its own reason, never passed to the
 * kernel (which would forward the inner packet untranslated once it had
 * decapsulated it, or answer the node with a port unreachable).
 *
 * The checks come first, in the ADR's order, and read the frame only:
 * the address is live (ADR 0013's fence), the frame did not arrive on an
 * outside interface, its outer source is a Node's (node_addrs_v4/v6; the
 * pod_macs check of rule 5a does not apply: the outer source MAC is a
 * router's), it is no outer fragment, its lengths and VXLAN header are
 * Egret's, the inner frame is untagged IPv4/IPv6. Then
 * bpf_xdp_adjust_head() (net/core/filter.c; Linux 4.10) moves the frame's
 * start to the inner Ethernet header and the fast path (fast_path.h) runs
 * on the inner frame unchanged: a hit is translated and sent from there.
 * A miss, which leaves the bytes untouched, is judged by rule 5 on the
 * inner packet (a hairpin to an egress address is the workers' too), the
 * head is moved back, and the whole encapsulated frame goes to the
 * workers (who decapsulate it again, dataplane/src/tunnel.rs) or is
 * dropped.
 *
 * Two parts, for the verifier's limits. The entry point asks
 * egret_tunnel_frame (a global function with a tiny stack: the entry's
 * own frame leaves 32 bytes of the 512 on Linux 6.1, which rounds every
 * frame to 32) whether the frame has the rule's shape, and if so
 * tail-calls the program egret_decap through decap_prog (loader.rs puts it
 * there at load). A tail call replaces the entry's frame, so egret_decap
 * gets a whole stack for the fast path's keys, and the verifier checks it
 * as its own program, within its own instruction budget: the entry's is
 * nearly full (see egret_nat_port_mapped).
 */
#ifndef EGRET_DECAP_H
#define EGRET_DECAP_H

/* The VXLAN header (RFC 7348 section 5). */
struct egret_vxlan_hdr {
	__u8 flags;       /* I (0x08: the VNI is valid); the rest reserved */
	__u8 reserved1[3];
	__u8 vni[3];
	__u8 reserved2;
};

/* The flags Egret's nodes send: I alone. An extension's flags (VXLAN-GBP's
 * G 0x80, VXLAN-GPE's P 0x04, whose payload need not be Ethernet) are
 * refused. */
#define EGRET_VXLAN_FLAGS 0x08

/* UDP, VXLAN and the inner Ethernet header: what the outer IP packet
 * carries before the inner IP header. */
#define EGRET_DECAP_TUNNEL_HDRS                                                                   \
	(sizeof(struct egret_udp_hdr) + sizeof(struct egret_vxlan_hdr) + sizeof(struct ethhdr))

/* The longest outer part: Ethernet with a tag (18), IPv6 (40), the rest. */
#define EGRET_DECAP_MAX_OUTER (18 + 40 + sizeof(struct egret_udp_hdr) + sizeof(struct egret_vxlan_hdr))

/* What decap_match found in a frame of rule 0d's shape. */
struct decap_outer {
	struct egret_udp_hdr *udp;
	struct owned_addr *owned;
	void *saddr;     /* the outer source address in the frame, 4 or 16 bytes */
	__u32 ip_payload; /* bytes after the outer IP header by its length
			   * field, 0 when that is wrong or beyond the frame */
	__u8 v6;
	__u8 fragment;   /* an outer IPv4 first fragment (MF) */
};

/*
 * Rule 0d's match: Ethernet (zero or one tag), IPv4 without options and not
 * a later fragment or IPv6 with next header UDP, UDP to the tunnel port,
 * an OWNED_NAT destination. Returns 1 and fills `o`, else 0. Reads only.
 */
static __always_inline int decap_match(void *data, void *data_end, const struct tunnel_config *cfg,
				       struct decap_outer *o)
{
	__be16 proto;
	void *l3;

	if (parse_ethernet(data, data_end, &l3, &proto) != EGRET_PARSE_OK)
		return 0;
	if (proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		__u32 tot_len;

		if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl != 5 ||
		    ip->protocol != IPPROTO_UDP)
			return 0;
		/* A later fragment has no UDP header; the bytes where it would
		 * be are the datagram's middle, and reading a port there would
		 * now and then take a reply's fragment for a tunnel frame. Such
		 * fragments go by rule 6 like any other; without their first
		 * fragment (dropped by rule 0d) they are never reassembled. */
		if (ip->frag_off & bpf_htons(EGRET_IP_OFFSET_MASK))
			return 0;
		o->udp = (void *)(ip + 1);
		if ((void *)(o->udp + 1) > data_end || o->udp->dest != cfg->port)
			return 0;
		/* Packet bytes as the key: the helper reads them in place. */
		o->owned = bpf_map_lookup_elem(&owned_v4, &ip->daddr);
		if (!o->owned || !(o->owned->flags & OWNED_NAT))
			return 0;
		o->saddr = &ip->saddr;
		o->v6 = 0;
		o->fragment = (ip->frag_off & bpf_htons(EGRET_IP_MF)) != 0;
		tot_len = be16_len(ip->tot_len);
		o->ip_payload = 0; /* a wrong total length fails the UDP length check */
		if (tot_len >= sizeof(*ip) && (void *)ip + tot_len <= data_end)
			o->ip_payload = tot_len - sizeof(*ip);
		return 1;
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = l3;
		__u32 payload_len;

		/* Next header UDP: no extension header, so no Fragment header
		 * either (RFC 8200 section 4.5); anything else is not this rule. */
		if ((void *)(ip6 + 1) > data_end || ip6->version != 6 || ip6->nexthdr != IPPROTO_UDP)
			return 0;
		o->udp = (void *)(ip6 + 1);
		if ((void *)(o->udp + 1) > data_end || o->udp->dest != cfg->port)
			return 0;
		o->owned = bpf_map_lookup_elem(&owned_v6, &ip6->daddr);
		if (!o->owned || !(o->owned->flags & OWNED_NAT))
			return 0;
		o->saddr = &ip6->saddr;
		o->v6 = 1;
		o->fragment = 0;
		payload_len = be16_len(ip6->payload_len);
		o->ip_payload = (void *)(ip6 + 1) + payload_len <= data_end ? payload_len : 0;
		return 1;
	}
	return 0;
}

/* The tunnel's configuration when rule 0d is on, else NULL. */
static __always_inline const struct tunnel_config *decap_enabled(void)
{
	__u32 zero = 0;
	const struct tunnel_config *cfg = bpf_map_lookup_elem(&tunnel_config, &zero);

	return cfg && cfg->enabled ? cfg : NULL;
}

/*
 * Whether the frame is rule 0d's (1) or not (0). A global function, for
 * its stack: the entry point's frame and this one's must fit 512 bytes
 * together. Reads only.
 */
__attribute__((noinline)) int egret_tunnel_frame(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const struct tunnel_config *cfg = decap_enabled();
	struct decap_outer o;

	if (!cfg)
		return 0;
	return decap_match(data, data_end, cfg, &o);
}

static __always_inline int decap_on_outside(struct xdp_md *ctx)
{
	__u32 ifindex = ctx->ingress_ifindex;
	struct if_role *role = bpf_map_lookup_elem(&if_roles, &ifindex);

	return role && role->role == EGRET_ROLE_OUTSIDE;
}

/*
 * The tunnel's own checks, after the UDP header (`udp`, whose outer IP
 * packet says `ip_payload` bytes follow its header, 0 when the IP length
 * itself is wrong; the caller has checked that many are in the frame).
 * Returns 0 when the frame is Egret's tunnel frame with an inner IPv4/IPv6
 * header, else the drop reason.
 */
static __always_inline __u32 decap_check_tunnel(const struct tunnel_config *cfg, struct egret_udp_hdr *udp,
						__u32 ip_payload, void *data_end)
{
	struct egret_vxlan_hdr *vx = (void *)(udp + 1);
	struct ethhdr *inner = (void *)(vx + 1);
	__u32 ulen = be16_len(udp->len);
	__u32 vni;

	/* The UDP datagram is the whole IP payload (RFC 768; what the node's
	 * vxlan_xmit_one builds) and holds the tunnel headers. */
	if (ulen != ip_payload || ulen < EGRET_DECAP_TUNNEL_HDRS)
		return EGRET_DROP_DECAP_MALFORMED;
	if ((void *)(inner + 1) > data_end)
		return EGRET_DROP_DECAP_MALFORMED;
	/* The I flag alone; the reserved fields are ignored on receipt (RFC
	 * 7348 section 5). */
	if (vx->flags != EGRET_VXLAN_FLAGS)
		return EGRET_DROP_DECAP_MALFORMED;
	vni = ((__u32)vx->vni[0] << 16) | ((__u32)vx->vni[1] << 8) | vx->vni[2];
	if (vni != cfg->vni)
		return EGRET_DROP_DECAP_MALFORMED;

	/* The inner IP header must be whole, within the datagram. */
	if (inner->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(inner + 1);

		if (ulen < EGRET_DECAP_TUNNEL_HDRS + sizeof(*ip) || (void *)(ip + 1) > data_end)
			return EGRET_DROP_DECAP_MALFORMED;
		if (ip->version != 4 || ip->ihl < 5)
			return EGRET_DROP_DECAP_MALFORMED;
		return 0;
	}
	if (inner->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(inner + 1);

		if (ulen < EGRET_DECAP_TUNNEL_HDRS + sizeof(*ip6) || (void *)(ip6 + 1) > data_end)
			return EGRET_DROP_DECAP_MALFORMED;
		if (ip6->version != 6)
			return EGRET_DROP_DECAP_MALFORMED;
		return 0;
	}
	return EGRET_DROP_DECAP_NOT_IP;
}

/*
 * Rule 5 on the inner packet of a checked tunnel frame whose inner
 * Ethernet header starts at `data`: EGRET_REDIRECT_DECAP when the workers
 * take it, EGRET_DROP_DECAP_NOT_STEERED otherwise. A packet to an egress
 * address (a pod reaching another egress IP: a hairpin) is theirs; so is
 * what rule 5 steers by its addresses (inner fragments too: the addresses
 * are in every fragment) or rule 5b by its embedded header. Rule 5a's
 * interface check was made on the outer frame.
 */
static __always_inline __u32 decap_judge_inner(void *data, void *data_end)
{
	struct ethhdr *eth = data;
	void *l3 = eth + 1;
	struct owned_addr *owned;
	__u32 reason;

	if (l3 > data_end)
		return EGRET_DROP_DECAP_MALFORMED;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = l3;
		__be32 daddr;

		if ((void *)(ip + 1) > data_end)
			return EGRET_DROP_DECAP_MALFORMED;
		daddr = ip->daddr;
		owned = bpf_map_lookup_elem(&owned_v4, &daddr);
		if (owned && (owned->flags & OWNED_NAT))
			return EGRET_REDIRECT_DECAP;
		reason = classify_v4(ip->saddr, daddr);
		/* A later fragment carries no ICMP header. */
		if (!(ip->frag_off & bpf_htons(EGRET_IP_OFFSET_MASK)))
			reason = judge_icmp_error_v4(reason, ip, l3 + (__u32)ip->ihl * 4, data_end);
	} else {
		struct ipv6hdr *ip6 = l3;
		struct egret_in6 daddr;

		if ((void *)(ip6 + 1) > data_end)
			return EGRET_DROP_DECAP_MALFORMED;
		__builtin_memcpy(daddr.addr, &ip6->daddr, sizeof(daddr.addr));
		owned = bpf_map_lookup_elem(&owned_v6, &daddr);
		if (owned && (owned->flags & OWNED_NAT))
			return EGRET_REDIRECT_DECAP;
		reason = classify_v6(ip6);
		/* Rule 5b when the ICMPv6 header follows the fixed header; behind
		 * extension headers the addresses alone decide (the chain is not
		 * walked a second time here). */
		if (ip6->nexthdr == IPPROTO_ICMPV6)
			reason = judge_icmp_error_v6(reason, IPPROTO_ICMPV6, ip6 + 1, data_end, ip6);
	}
	return reason_redirects(reason) ? EGRET_REDIRECT_DECAP : EGRET_DROP_DECAP_NOT_STEERED;
}

/*
 * Rule 0d for a frame egret_tunnel_frame matched, entered by the entry
 * point's tail call: the XDP action, counted once. Never XDP_PASS.
 */
SEC("xdp")
int egret_decap(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	const struct tunnel_config *cfg = decap_enabled();
	struct decap_outer o;
	struct ethhdr *eth;
	__u32 reason, outer;
	int fp;

	/* Matched a moment ago by the same code; only a tunnel switched off
	 * or reconfigured in between fails here. The frame was Egret's. */
	if (!cfg || !decap_match(data, data_end, cfg, &o))
		return apply(ctx, EGRET_DROP_DECAP_UNAVAILABLE, EGRET_DROP_DECAP_UNAVAILABLE);

	if (!owned_live(o.owned))
		return apply(ctx, EGRET_DROP_EGRESS_EXPIRED, EGRET_DROP_EGRESS_EXPIRED);
	if (decap_on_outside(ctx))
		return apply(ctx, EGRET_DROP_DECAP_OUTSIDE, EGRET_DROP_DECAP_OUTSIDE);
	if (!(o.v6 ? bpf_map_lookup_elem(&node_addrs_v6, o.saddr) : bpf_map_lookup_elem(&node_addrs_v4, o.saddr)))
		return apply(ctx, EGRET_DROP_DECAP_UNKNOWN_NODE, EGRET_DROP_DECAP_UNKNOWN_NODE);
	if (o.fragment)
		return apply(ctx, EGRET_DROP_DECAP_FRAGMENT, EGRET_DROP_DECAP_FRAGMENT);
	reason = decap_check_tunnel(cfg, o.udp, o.ip_payload, data_end);
	if (reason)
		return apply(ctx, reason, reason);

	/* The outer part's length: 50, 54, 70 or 74 bytes. Hidden from the
	 * verifier's constant tracking (one bounded unknown instead of four
	 * constants), so what follows is checked once, not per outer shape. */
	outer = (__u32)((void *)(o.udp + 1) + sizeof(struct egret_vxlan_hdr) - data);
	asm volatile("" : "+r"(outer));
	if (outer > EGRET_DECAP_MAX_OUTER)
		return apply(ctx, EGRET_DROP_DECAP_MALFORMED, EGRET_DROP_DECAP_MALFORMED);

	/* Start the frame at the inner Ethernet header. The helper refuses
	 * only to leave less than ETH_HLEN, which the checks above exclude;
	 * every packet pointer is read again after it (the verifier
	 * requires it). */
	if (bpf_xdp_adjust_head(ctx, (int)outer))
		return apply(ctx, EGRET_DROP_DECAP_MALFORMED, EGRET_DROP_DECAP_MALFORMED);
	data = (void *)(long)ctx->data;
	data_end = (void *)(long)ctx->data_end;
	eth = data;
	if ((void *)(eth + 1) > data_end)
		return apply(ctx, EGRET_DROP_DECAP_MALFORMED, EGRET_DROP_DECAP_MALFORMED);

	/* The fast path on the inner frame: a hit writes the next hop's MACs
	 * over the inner Ethernet header and sends from there. */
	fp = fast_path(ctx, data, data_end, eth + 1, eth->h_proto);
	if (fp != EGRET_FP_CONTINUE)
		return fp;

	/* A miss left the bytes as they came: judge the inner packet, then
	 * put the outer headers back in front for the workers. */
	reason = decap_judge_inner(data, data_end);
	if (bpf_xdp_adjust_head(ctx, -(int)outer))
		return apply(ctx, EGRET_DROP_DECAP_MALFORMED, EGRET_DROP_DECAP_MALFORMED);
	return apply(ctx, reason, reason);
}

#endif /* EGRET_DECAP_H */
