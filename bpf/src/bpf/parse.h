/* SPDX-License-Identifier: Apache-2.0 */
/*
 * parse.h - bounds-checked header parsing for the steering program.
 *
 * Every helper checks `if ((void *)(hdr + 1) > data_end)` before it reads a
 * header, and reports truncation as an error instead of reading past the
 * frame. Nothing here decides a verdict: steer.bpf.c does.
 */
#ifndef EGRET_PARSE_H
#define EGRET_PARSE_H

#include <linux/types.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

/* Extension headers walked before giving up (hop-by-hop, routing, fragment,
 * destination options; RFC 8200 section 4.1 allows each at most once or twice). */
#define EGRET_IPV6_MAX_EXT 6

/* IEEE 802.1Q tag after the source MAC: TCI, then the inner EtherType. */
struct egret_vlan_hdr {
	__be16 tci;
	__be16 encapsulated_proto;
};

/* ARP for Ethernet/IPv4 (RFC 826). Addresses are byte arrays: they are not
 * 4-byte aligned in the frame. */
struct egret_arp_hdr {
	__be16 htype;
	__be16 ptype;
	__u8 hlen;
	__u8 plen;
	__be16 oper;
};

struct egret_arp_eth_ipv4 {
	struct egret_arp_hdr hdr;
	__u8 sha[6];
	__u8 spa[4];
	__u8 tha[6];
	__u8 tpa[4];
};

#define EGRET_ARP_HTYPE_ETHER 1
#define EGRET_ARP_OP_REQUEST 1

/* IPv6 Fragment header (RFC 8200 section 4.5). */
struct egret_frag_hdr {
	__u8 nexthdr;
	__u8 reserved;
	__be16 frag_off; /* offset << 3 | res(2) | M */
	__be32 identification;
};

#define EGRET_IP6_OFFSET_MASK 0xfff8
#define EGRET_IP6_MORE_FRAGMENTS 0x0001

/* IPv4 flags/fragment offset (RFC 791 section 3.1). */
#define EGRET_IP_MF 0x2000
#define EGRET_IP_OFFSET_MASK 0x1fff

/* ICMPv6 Neighbor Solicitation (RFC 4861 section 4.3), without options. */
struct egret_nd_ns {
	__u8 type;
	__u8 code;
	__be16 checksum;
	__be32 reserved;
	__u8 target[16];
};

/* The two port fields that open both TCP and UDP headers. */
struct egret_ports {
	__be16 source;
	__be16 dest;
};

/*
 * A 16-bit length field in host order, with bounds the verifier can see
 * before the length is added to a packet pointer. Linux 6.1's verifier (the
 * kernel of Debian bookworm) forgets every bound of a byte-swapped value, so
 * `pkt + bpf_ntohs(len)` is refused there ("math between pkt pointer and
 * register with unbounded min value"). The empty asm hides the swap's range
 * from the compiler, which would otherwise drop the mask as redundant; the
 * mask then gives the verifier [0, 0xffff]. The 6.18 verifier of the
 * machines Egret is built on accepted the plain swap.
 */
static __always_inline __u32 be16_len(__be16 field)
{
	__u32 v = bpf_ntohs(field);

	asm volatile("" : "+r"(v));
	return v & 0xffff;
}

enum egret_parse_rc {
	EGRET_PARSE_OK = 0,
	EGRET_PARSE_TRUNCATED = -1,
	EGRET_PARSE_EXT_LIMIT = -2,
};

/* Rule 1: Ethernet with zero or one 802.1Q tag. On success *l3 is the first
 * byte after the (inner) EtherType and *proto that EtherType (network order). */
static __always_inline int parse_ethernet(void *data, void *data_end, void **l3, __be16 *proto)
{
	struct ethhdr *eth = data;
	struct egret_vlan_hdr *vlan;

	if ((void *)(eth + 1) > data_end)
		return EGRET_PARSE_TRUNCATED;
	*proto = eth->h_proto;
	*l3 = eth + 1;
	if (*proto != bpf_htons(ETH_P_8021Q))
		return EGRET_PARSE_OK;

	vlan = *l3;
	if ((void *)(vlan + 1) > data_end)
		return EGRET_PARSE_TRUNCATED;
	*proto = vlan->encapsulated_proto;
	*l3 = vlan + 1;
	return EGRET_PARSE_OK;
}

/* Where the upper-layer header of an IPv6 packet is, after its extension
 * headers, and whether the packet is a fragment. */
struct ipv6_layout {
	void *l4;            /* upper-layer header; NULL for a later fragment */
	__u32 frag_id;       /* host order, valid if is_fragment */
	__u8 proto;          /* upper-layer protocol (Next Header) */
	__u8 is_fragment;    /* a Fragment header with offset != 0 or M set */
	__u8 later_fragment; /* offset != 0: no upper-layer header here */
	__u8 frag_proto;     /* the Fragment header's Next Header, valid if
			      * is_fragment: the fragment key's protocol, the
			      * same in every fragment of a datagram (RFC 8200
			      * section 4.5), whereas `proto` is the upper
			      * layer only the first fragment reaches */
};

static __always_inline int is_ipv6_ext(__u8 nexthdr)
{
	return nexthdr == IPPROTO_HOPOPTS || nexthdr == IPPROTO_ROUTING ||
	       nexthdr == IPPROTO_FRAGMENT || nexthdr == IPPROTO_DSTOPTS;
}

/*
 * Walk the extension headers after a fixed IPv6 header (RFC 8200 section 4),
 * at most EGRET_IPV6_MAX_EXT of them, in a bounded loop. Hop-by-hop, routing
 * and destination options share the generic (next header, length in 8-octet
 * units not counting the first 8) layout of RFC 8200 section 4.3-4.6.
 * An atomic fragment (offset 0, M clear; RFC 6946) is not a fragment.
 */
static __always_inline int walk_ipv6(struct ipv6hdr *ip6, void *data_end, struct ipv6_layout *out)
{
	void *pos = ip6 + 1;
	__u8 nexthdr = ip6->nexthdr;
	int i;

	out->is_fragment = 0;
	out->later_fragment = 0;
	out->frag_id = 0;
	out->frag_proto = 0;

	for (i = 0; i < EGRET_IPV6_MAX_EXT; i++) {
		if (nexthdr == IPPROTO_FRAGMENT) {
			struct egret_frag_hdr *fh = pos;
			__u16 off;

			if ((void *)(fh + 1) > data_end)
				return EGRET_PARSE_TRUNCATED;
			off = bpf_ntohs(fh->frag_off);
			nexthdr = fh->nexthdr;
			pos = fh + 1;
			if (off & (EGRET_IP6_OFFSET_MASK | EGRET_IP6_MORE_FRAGMENTS)) {
				out->is_fragment = 1;
				out->frag_id = bpf_ntohl(fh->identification);
				out->frag_proto = nexthdr;
				if (off & EGRET_IP6_OFFSET_MASK) {
					/* What follows is the middle of the datagram. */
					out->later_fragment = 1;
					out->proto = nexthdr;
					out->l4 = NULL;
					return EGRET_PARSE_OK;
				}
			}
		} else if (is_ipv6_ext(nexthdr)) {
			struct ipv6_opt_hdr *opt = pos;

			if ((void *)(opt + 1) > data_end)
				return EGRET_PARSE_TRUNCATED;
			nexthdr = opt->nexthdr;
			pos += ((__u32)opt->hdrlen + 1) * 8;
		} else {
			break;
		}
	}
	if (is_ipv6_ext(nexthdr))
		return EGRET_PARSE_EXT_LIMIT;
	out->proto = nexthdr;
	out->l4 = pos;
	return EGRET_PARSE_OK;
}

#endif /* EGRET_PARSE_H */
