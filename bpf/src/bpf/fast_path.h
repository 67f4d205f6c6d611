/* SPDX-License-Identifier: Apache-2.0 */
/*
 * fast_path.h - rule 0 of the steering program: established sessions
 * translated in XDP (docs/adr/0005-xdp-fast-path.md).
 *
 * Userspace (the daemon's offload manager) installs both directions of a
 * confirmed session into the slot tables fp_sessions_v4/v6 (egret_maps.h).
 * A frame is looked up when it is
 * untagged IPv4 without options or IPv6 without extension headers, not a
 * fragment, and TCP or UDP. On a hit it is translated exactly as the
 * userspace engine would translate it (nat/rewrite.rs, engine.rs forward()):
 *
 *   1. addresses and ports from the entry;
 *   2. IPv4 header checksum: the entry's l3 delta and the TTL decrement's
 *      constant delta in one fold (RFC 1624 eqn. 3, ~(~HC + m + m'), the
 *      field the two updates in turn give: wire::checksum::Delta::apply_then);
 *   3. transport checksum: the entry's l4 delta; a UDP/IPv4 checksum of 0
 *      stays 0 and a computed 0 is sent as 0xFFFF (RFC 768);
 *   4. TTL / hop limit minus one; MACs from the entry's next hop;
 *   5. XDP_TX when the next hop is out of the receiving interface, else
 *      bpf_redirect() to it.
 *
 * A translated TCP segment with ACK set also leaves its acknowledgment
 * number and window in the slot's tcp_seen word (fp_record_tcp), which the
 * engine reads for the RST window check of an offloaded session.
 *
 * It returns EGRET_FP_CONTINUE, leaving the frame untouched, for a miss and
 * for every case that needs the engine (each counted, fast_path_reason.h):
 * TCP SYN/FIN/RST, TTL <= 1, a partial transport checksum (TX offload of a
 * local sender: the field equals the folded pseudo-header sum, as
 * wire::checksum::is_partial decides), an invalid next hop, a time at or
 * after fp_config.valid_until_ns (an egress address's ownership may have
 * ended: fp_expired), and anything the engine would count as malformed. Every check happens before the first
 * write, so a punted frame reaches the steering rules as it arrived.
 *
 * Built with -DEGRET_FP_FIB_LOOKUP (tests only), the next hop comes from
 * bpf_fib_lookup() instead of fp_next_hops: the variant the ADR measured.
 */
#ifndef EGRET_FAST_PATH_H
#define EGRET_FAST_PATH_H

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

/* Not the fast path's frame: go on with the steering rules. */
#define EGRET_FP_CONTINUE (-1)

/* TCP flags byte (RFC 9293 section 3.1): offset 13 of the header. */
#define EGRET_TCP_FLAGS_OFFSET 13
#define EGRET_TCP_FIN 0x01
#define EGRET_TCP_SYN 0x02
#define EGRET_TCP_RST 0x04
#define EGRET_TCP_ACK 0x10

#define EGRET_NSEC_PER_SEC 1000000000ULL

/*
 * The IPv4 header checksum delta of TTL - 1 (TTL is the high byte of the
 * (TTL, protocol) word): fold(~(ttl << 8 | p) + ((ttl - 1) << 8 | p)) =
 * 0xFFFF - 0x0100 for every TTL >= 1, the value the engine's
 * Delta::between_u16 computes (its constant: wire::checksum::TTL_DECREMENT).
 */
#define EGRET_TTL_DECREMENT_DELTA 0xFEFF

struct egret_tcp_min {
	__be16 source;
	__be16 dest;
	__be32 seq;
	__be32 ack_seq;
	__u8 doff_res; /* data offset in the high nibble */
	__u8 flags;
	__be16 window;
	__be16 check;
	__be16 urg_ptr;
};

struct egret_udp_hdr {
	__be16 source;
	__be16 dest;
	__be16 len;
	__be16 check;
};

static __always_inline void fp_count(__u32 reason)
{
	__u64 *slot = bpf_map_lookup_elem(&fp_counters, &reason);

	if (slot)
		*slot += 1; /* per-CPU slot */
}

static __always_inline int fp_punt(__u32 reason)
{
	fp_count(reason);
	return EGRET_FP_CONTINUE;
}

/* The fast path's configuration, or NULL when it is off. */
static __always_inline const struct fp_config *fp_enabled(void)
{
	__u32 zero = 0;
	const struct fp_config *cfg = bpf_map_lookup_elem(&fp_config, &zero);

	return cfg && cfg->enabled ? cfg : NULL;
}

/*
 * The session tables (egret_maps.h; docs/adr/0006-fast-path-session-table.md).
 * fp_hash must equal bpf/src/session_table.rs `hash`: the key read as
 * native-endian 64-bit words, each mixed in by a multiply and a fold.
 */
#define EGRET_FP_HASH_MUL 0x9e3779b97f4a7c15ULL
#define FP_READ_ONCE(x) (*(volatile __typeof__(x) *)&(x))

static __always_inline __u64 fp_mix(__u64 h, __u64 w)
{
	h = (h ^ w) * EGRET_FP_HASH_MUL;
	return h ^ (h >> 32);
}

/* A packet's key, addressable as the words fp_hash reads. */
union fp_key_v4_words {
	struct fp_key_v4 k;
	__u64 w[sizeof(struct fp_key_v4) / 8];
};

union fp_key_v6_words {
	struct fp_key_v6 k;
	__u64 w[sizeof(struct fp_key_v6) / 8];
};

/*
 * fp_dep(x): 0, computed from x by an instruction the compiler cannot see
 * through. Added to an address, it makes the next load's address depend on
 * the loads that produced x, and every CPU Linux runs eBPF on keeps such a
 * load after them (an address dependency; memory-barriers.txt). This is the
 * seqlock reader's ordering below: free on x86, which keeps loads in order
 * anyway, and what arm64 needs, where loads may pass loads. (The kernel's
 * BPF load-acquire, Linux 6.15, is newer than the oldest kernel Egret
 * supports and than the clang it is built with.)
 */
static __always_inline __u64 fp_dep(__u64 x)
{
	asm volatile("%[x] &= 0" : [x] "+r"(x));
	return x;
}

/*
 * fp_find_v4 / fp_find_v6: the slot holding `key`, with its entry copied to
 * `copy` under the slot's sequence count, or NULL (a miss: no such key, or
 * the slot was being rewritten, which the engine then handles). Probing
 * stops at the first empty slot.
 *
 * The reader's order, each step's loads addressed through a dependency on
 * the step before (fp_dep): seq; live, key and entry; seq again. The writer
 * (bpf/src/session_table.rs) orders seq odd, the words, seq even.
 */
#define FP_DEFINE_FIND(fam, table, mask_field)                                                         \
	static __always_inline struct fp_slot_##fam *fp_find_##fam(const struct fp_config *cfg,         \
								  const union fp_key_##fam##_words *key,   \
								  struct fp_entry_##fam *copy,             \
								  __u32 *seq_out)                          \
	{                                                                                               \
		const int words = sizeof(key->w) / 8;                                                   \
		const int entry_words = sizeof(*copy) / 8;                                              \
		__u64 *cw = (__u64 *)copy;                                                              \
		__u64 h = cfg->seed;                                                                    \
		__u32 i, j;                                                                             \
                                                                                                        \
		for (j = 0; j < words; j++)                                                             \
			h = fp_mix(h, key->w[j]);                                                       \
		for (i = 0; i < EGRET_FP_PROBES; i++) {                                                 \
			__u32 at = ((__u32)h + i) & cfg->mask_field;                                    \
			struct fp_slot_##fam *s = bpf_map_lookup_elem(&table, &at);                     \
			const struct fp_slot_##fam *after_seq;                                          \
			const __u64 *sw, *ew;                                                           \
			__u64 diff = 0, dep;                                                            \
			__u32 seq;                                                                      \
                                                                                                        \
			if (!s)                                                                         \
				return NULL;                                                            \
			seq = FP_READ_ONCE(s->seq);                                                     \
			after_seq = (const void *)s + fp_dep(seq);                                      \
			if ((seq & 1) || !after_seq->live)                                              \
				return NULL;                                                            \
			sw = (const __u64 *)&after_seq->key;                                            \
			for (j = 0; j < words; j++)                                                     \
				diff |= sw[j] ^ key->w[j];                                              \
			dep = fp_dep(diff); /* before the branch: the key's loads, not a constant */    \
			if (diff)                                                                       \
				continue;                                                               \
			ew = (const __u64 *)&after_seq->entry;                                          \
			for (j = 0; j < entry_words; j++) {                                             \
				__u64 w = FP_READ_ONCE(ew[j]);                                          \
                                                                                                        \
				cw[j] = w;                                                              \
				dep |= w;                                                               \
			}                                                                               \
			if (FP_READ_ONCE(*(const __u32 *)((const void *)&s->seq + fp_dep(dep))) != seq) \
				return NULL;                                                            \
			*seq_out = seq;                                                                 \
			return s;                                                                       \
		}                                                                                       \
		return NULL;                                                                            \
	}

FP_DEFINE_FIND(v4, fp_sessions_v4, mask_v4)
FP_DEFINE_FIND(v6, fp_sessions_v6, mask_v6)

/* Folds a 32-bit ones' complement sum to 16 bits (end-around carry). */
static __always_inline __u16 csum_fold(__u32 s)
{
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)s;
}

/* RFC 1624 eqn. 3: HC' = ~(~HC + m'), host order. */
static __always_inline __u16 csum_apply(__u16 csum, __u16 delta)
{
	return (__u16)~csum_fold((__u32)(__u16)~csum + delta);
}

/*
 * csum_apply(csum_apply(csum, delta), then) in one fold, bit for bit the same
 * when `then` is not 0 (both sums are then non-zero and congruent modulo
 * 0xFFFF, and a non-zero sum has one folded form): the engine's
 * wire::checksum::Delta::apply_then.
 */
static __always_inline __u16 csum_apply_then(__u16 csum, __u16 delta, __u16 then)
{
	return (__u16)~csum_fold((__u32)(__u16)~csum + delta + then);
}

/* Sum of the 16-bit words of an address (host order values). */
static __always_inline __u32 addr_sum(const __u8 *a, int len)
{
	__u32 s = 0;
	int i;

#pragma unroll
	for (i = 0; i < len; i += 2)
		s += ((__u32)a[i] << 8) | a[i + 1];
	return s;
}

/*
 * Whether a TCP/UDP checksum field holds only the pseudo-header sum
 * (RFC 9293 3.1 / RFC 768 / RFC 8200 8.1 pseudo-header over the addresses as
 * received, the protocol and the transport length). A field of 0 is never
 * partial (a UDP "no checksum").
 */
static __always_inline int csum_is_partial(__u16 field, __u32 pseudo_sum)
{
	return field != 0 && field == csum_fold(pseudo_sum);
}

/* The IPv4 header (20 bytes, no options) sums to 0xFFFF when valid. */
static __always_inline int ipv4_header_ok(const struct iphdr *ip)
{
	const __u16 *w = (const __u16 *)ip;
	__u32 s = 0;
	int i;

#pragma unroll
	for (i = 0; i < 10; i++)
		s += w[i];
	return csum_fold(s) == 0xffff;
}

/*
 * Whether the fast path must stop translating: at or after the earliest
 * valid-until of the owned addresses (fp_config.valid_until_ns, which
 * userspace writes already less the coarse clock's lag of at most a tick,
 * so the coarse clock read here never lets a frame through late). Every
 * offloaded session translates to or from an owned egress address; past
 * that instant the workers judge each frame by its own address instead.
 * One field in the fp_config line the hit has read anyway, and the coarse
 * clock read fp_stamp uses (one read per hit, as before): no map lookup
 * and no helper call is added to the hot path, one load and a compare.
 */
static __always_inline int fp_expired(const struct fp_config *cfg, __u64 now)
{
	return now >= cfg->valid_until_ns; /* never for EGRET_VALID_FOREVER */
}

/*
 * Records a translated TCP segment's acknowledgment number and window in its
 * slot's tcp_seen word (egret_maps.h), tagged with the seq the slot was found
 * under: one 8-byte store, on the line the hit has just read, and only when
 * the word changes. `rec` is fp_check_l4's (0: not TCP, or no ACK). The
 * frame is not touched: the translation is the same with or without it.
 */
static __always_inline void fp_record_tcp(__u64 *tcp_seen, __u64 rec, __u32 seq)
{
	__u64 w;

	if (!(rec >> 48))
		return;
	w = (rec & 0xffffffffffffULL) | ((__u64)((seq & 0xffff) | 1) << 48);
	if (*tcp_seen != w)
		*tcp_seen = w;
}

/* Stamps an entry at most once a second: one cache-line write per second
 * per direction, not per packet. */
static __always_inline void fp_stamp(__u64 *last_seen_ns, __u64 now)
{

	if (now - *last_seen_ns >= EGRET_NSEC_PER_SEC)
		*last_seen_ns = now;
}

static __always_inline void fp_account(__u16 policy_slot, __u8 direction, __u64 bytes)
{
	__u32 idx = (__u32)policy_slot * 2 + (direction & 1);
	struct fp_traffic *t = bpf_map_lookup_elem(&fp_policy_traffic, &idx);

	if (t) {
		t->packets += 1;
		t->bytes += bytes;
	}
}

/* The L4 checks shared by both families: returns 0 when the frame may be
 * translated, else the punt reason. *csum_at points at the checksum field. */
static __always_inline int fp_check_l4(void *l4, void *data_end, __u8 proto, __u32 l4_len, int v6,
				       __be16 **csum_at, __u64 *tcp_rec)
{
	if (proto == IPPROTO_TCP) {
		struct egret_tcp_min *th = l4;
		__u32 doff;

		if ((void *)(th + 1) > data_end || l4_len < sizeof(*th))
			return EGRET_FP_PUNT_MALFORMED;
		doff = (__u32)(th->doff_res >> 4) * 4;
		if (doff < sizeof(*th) || doff > l4_len)
			return EGRET_FP_PUNT_MALFORMED;
		if (th->flags & (EGRET_TCP_SYN | EGRET_TCP_FIN | EGRET_TCP_RST))
			return EGRET_FP_PUNT_TCP_CONTROL;
		*csum_at = &th->check;
		/* What fp_record_tcp stores: bit 48 marks "an ACK was seen". */
		if (th->flags & EGRET_TCP_ACK)
			*tcp_rec = (__u64)bpf_ntohl(th->ack_seq) | ((__u64)bpf_ntohs(th->window) << 32) |
				   (1ULL << 48);
		return 0;
	}
	{
		struct egret_udp_hdr *uh = l4;
		__u32 ulen;

		if ((void *)(uh + 1) > data_end || l4_len < sizeof(*uh))
			return EGRET_FP_PUNT_MALFORMED;
		ulen = bpf_ntohs(uh->len);
		if (ulen < sizeof(*uh) || ulen > l4_len)
			return EGRET_FP_PUNT_MALFORMED;
		/* RFC 8200 8.1: UDP over IPv6 must carry a checksum. */
		if (v6 && uh->check == 0)
			return EGRET_FP_PUNT_MALFORMED;
		*csum_at = &uh->check;
		return 0;
	}
}

/* Writes the transport checksum after the rewrite. */
static __always_inline void fp_fix_l4(__be16 *csum_at, __u8 proto, __u16 delta)
{
	__u16 c;

	if (proto == IPPROTO_UDP) {
		if (*csum_at == 0)
			return; /* RFC 768: no checksum stays no checksum */
		c = csum_apply(bpf_ntohs(*csum_at), delta);
		*csum_at = bpf_htons(c ? c : 0xffff);
		return;
	}
	*csum_at = bpf_htons(csum_apply(bpf_ntohs(*csum_at), delta));
}

/*
 * The next hop of a hit: writes the frame's MACs and returns the output
 * ifindex, or 0 (nothing written, *why the punt reason) when the next hop
 * cannot be used or the frame may not go back out of its link. The
 * gateway's build reads fp_next_hops[id]; the measurement variant
 * (EGRET_FP_FIB_LOOKUP, tests only: bpf_fib_lookup is GPL-only) asks the
 * kernel's FIB and neighbour table per packet, from the new addresses.
 */
static __always_inline __u32 fp_set_next_hop(struct xdp_md *ctx, struct ethhdr *eth, __u32 id, int v6,
					     const __u8 *new_src, const __u8 *new_dst, __u8 proto, __u16 tot_len,
					     __u32 *why)
{
#ifndef EGRET_FP_FIB_LOOKUP
	struct fp_next_hop *nh = bpf_map_lookup_elem(&fp_next_hops, &id);

	*why = EGRET_FP_PUNT_NEXT_HOP;
	if (!nh || nh->valid != EGRET_NEXT_HOP_VALID || !nh->ifindex)
		return 0;
	/* Larger than the output link's MTU: the engine answers it (RFC 1191,
	 * RFC 8201); punted as a next hop that cannot take the frame. */
	if (nh->mtu && tot_len > nh->mtu)
		return 0;
	/* Never back out of a two-arm outside link: what arrives there is not
	 * a pod's, whatever its 5-tuple (anti-spoofing, rule 5a's twin). */
	if ((nh->flags & EGRET_NEXT_HOP_NOT_BACK) && nh->ifindex == ctx->ingress_ifindex) {
		*why = EGRET_FP_PUNT_WRONG_LINK;
		return 0;
	}
	__builtin_memcpy(eth->h_dest, nh->dst_mac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, nh->src_mac, ETH_ALEN);
	return nh->ifindex;
#else
	struct bpf_fib_lookup p;

	__builtin_memset(&p, 0, sizeof(p));
	p.family = v6 ? 10 /* AF_INET6 */ : 2 /* AF_INET */;
	p.l4_protocol = proto;
	p.tot_len = tot_len;
	p.ifindex = ctx->ingress_ifindex;
	if (v6) {
		__builtin_memcpy(p.ipv6_src, new_src, 16);
		__builtin_memcpy(p.ipv6_dst, new_dst, 16);
	} else {
		__builtin_memcpy(&p.ipv4_src, new_src, 4);
		__builtin_memcpy(&p.ipv4_dst, new_dst, 4);
	}
	*why = EGRET_FP_PUNT_NEXT_HOP;
	if (bpf_fib_lookup(ctx, &p, sizeof(p), 0) != BPF_FIB_LKUP_RET_SUCCESS || !p.ifindex)
		return 0;
	__builtin_memcpy(eth->h_dest, p.dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, p.smac, ETH_ALEN);
	return p.ifindex;
#endif
}

/* Sends a translated frame: XDP_TX back out of the receiving interface, or
 * a redirect to the next hop's interface. Counted as a verdict. */
static __always_inline int fp_send(struct xdp_md *ctx, __u32 ifindex)
{
	if (ifindex == ctx->ingress_ifindex) {
		count(EGRET_TX_FAST_PATH);
		return XDP_TX;
	}
	count(EGRET_REDIRECT_FAST_PATH);
	return (int)bpf_redirect(ifindex, 0);
}

/*
 * The checks a hit makes in both families once its IP header passed its own:
 * the transport header (fp_check_l4), TTL / hop limit, and a partial
 * checksum (pseudo-header over `addrs`, the received addresses' word sum,
 * the protocol and `l4_len`). Returns 0 with *csum_at set, or the punt
 * reason. Writes nothing.
 */
static __always_inline int fp_check_hit(void *l4, void *data_end, __u8 proto, __u32 l4_len, int v6, __u8 ttl,
					__u32 addrs, __be16 **csum_at, __u64 *tcp_rec)
{
	int rc = fp_check_l4(l4, data_end, proto, l4_len, v6, csum_at, tcp_rec);

	if (rc)
		return rc;
	if (!*csum_at)
		return EGRET_FP_PUNT_MALFORMED;
	if (ttl <= 1)
		return EGRET_FP_PUNT_TTL;
	if (csum_is_partial(bpf_ntohs(**csum_at), addrs + proto + (l4_len >> 16) + (l4_len & 0xffff)))
		return EGRET_FP_PUNT_PARTIAL_CHECKSUM;
	return 0;
}

/*
 * The writes a hit makes in both families after its addresses, TTL and IP
 * checksum: the ports and the transport checksum from the entry (`e`, either
 * family's: the fields after the addresses are the same), the slot's stamp
 * and TCP record (`slot`, either family's), the policy's traffic; then the
 * frame is sent out of `ifindex`.
 */
#define fp_finish(ctx, eth, data_end, ports, csum_at, proto, e, slot, seq, tcp_rec, ifindex, now)          \
	({                                                                                                     \
		(ports)->source = (e)->new_sport;                                                              \
		(ports)->dest = (e)->new_dport;                                                                \
		fp_fix_l4(csum_at, proto, (e)->l4_delta);                                                      \
		fp_stamp(&(slot)->entry.last_seen_ns, now);                                                    \
		fp_record_tcp(&(slot)->tcp_seen, tcp_rec, seq);                                                \
		fp_account((e)->policy_slot, (e)->direction, (__u64)((data_end) - (void *)(eth)));             \
		fp_send(ctx, ifindex);                                                                         \
	})

/* Rule 0 for IPv4 (RFC 791). `l3` follows an untagged Ethernet header. */
static __always_inline int fast_path_v4(struct xdp_md *ctx, const struct fp_config *cfg, struct ethhdr *eth,
					void *l3, void *data_end)
{
	struct iphdr *ip = l3;
	union fp_key_v4_words key = {};
	struct fp_entry_v4 entry, *e = &entry;
	struct fp_slot_v4 *slot;
	struct egret_ports *ports;
	__be16 *csum_at = NULL;
	__u64 tcp_rec = 0;
	__u32 seq = 0;
	__u32 why = EGRET_FP_PUNT_NEXT_HOP;
	__u32 tot_len, l4_len;
	__u32 ifindex;
	__u64 now;
	int rc;

	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl < 5)
		return EGRET_FP_CONTINUE; /* the steering rules and the engine judge it */
	if (ip->ihl != 5)
		return fp_punt(EGRET_FP_SKIP_IP_OPTIONS);
	if (ip->frag_off & bpf_htons(EGRET_IP_MF | EGRET_IP_OFFSET_MASK))
		return fp_punt(EGRET_FP_SKIP_FRAGMENT);
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return fp_punt(EGRET_FP_SKIP_NOT_TCP_UDP);
	ports = (void *)(ip + 1);
	if ((void *)(ports + 1) > data_end)
		return EGRET_FP_CONTINUE;

	__builtin_memcpy(key.k.src, &ip->saddr, 4);
	__builtin_memcpy(key.k.dst, &ip->daddr, 4);
	key.k.sport = ports->source;
	key.k.dport = ports->dest;
	key.k.proto = ip->protocol;
	slot = fp_find_v4(cfg, &key, &entry, &seq);
	if (!slot)
		return fp_punt(EGRET_FP_MISS);
	now = bpf_ktime_get_coarse_ns();
	if (fp_expired(cfg, now))
		return fp_punt(EGRET_FP_PUNT_EXPIRED);

	/* A hit. Nothing before the next hop writes; everything after it does. */
	tot_len = be16_len(ip->tot_len);
	if (tot_len < sizeof(*ip) || (void *)ip + tot_len > data_end || !ipv4_header_ok(ip))
		return fp_punt(EGRET_FP_PUNT_MALFORMED);
	l4_len = tot_len - sizeof(*ip);
	rc = fp_check_hit(ports, data_end, ip->protocol, l4_len, 0, ip->ttl,
			  addr_sum(key.k.src, 4) + addr_sum(key.k.dst, 4), &csum_at, &tcp_rec);
	if (rc)
		return fp_punt(rc);
	ifindex = fp_set_next_hop(ctx, eth, e->next_hop, 0, e->new_src, e->new_dst, ip->protocol, tot_len, &why);
	if (!ifindex)
		return fp_punt(why);

	__builtin_memcpy(&ip->saddr, e->new_src, 4);
	__builtin_memcpy(&ip->daddr, e->new_dst, 4);
	ip->check = bpf_htons(csum_apply_then(bpf_ntohs(ip->check), e->l3_delta, EGRET_TTL_DECREMENT_DELTA));
	ip->ttl -= 1;
	return fp_finish(ctx, eth, data_end, ports, csum_at, ip->protocol, e, slot, seq, tcp_rec, ifindex, now);
}

/* Rule 0 for IPv6 (RFC 8200): no extension headers, so the transport header
 * follows the fixed header and its length is the payload length. */
static __always_inline int fast_path_v6(struct xdp_md *ctx, const struct fp_config *cfg, struct ethhdr *eth,
					void *l3, void *data_end)
{
	struct ipv6hdr *ip6 = l3;
	union fp_key_v6_words key = {};
	struct fp_entry_v6 entry, *e = &entry;
	struct fp_slot_v6 *slot;
	struct egret_ports *ports;
	__be16 *csum_at = NULL;
	__u64 tcp_rec = 0;
	__u32 seq = 0;
	__u32 why = EGRET_FP_PUNT_NEXT_HOP;
	__u32 l4_len;
	__u32 ifindex;
	__u8 proto;
	__u64 now;
	int rc;

	if ((void *)(ip6 + 1) > data_end || ip6->version != 6)
		return EGRET_FP_CONTINUE;
	proto = ip6->nexthdr;
	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP) {
		if (proto == IPPROTO_FRAGMENT)
			return fp_punt(EGRET_FP_SKIP_FRAGMENT);
		if (is_ipv6_ext(proto))
			return fp_punt(EGRET_FP_SKIP_IPV6_EXT);
		return fp_punt(EGRET_FP_SKIP_NOT_TCP_UDP);
	}
	ports = (void *)(ip6 + 1);
	if ((void *)(ports + 1) > data_end)
		return EGRET_FP_CONTINUE;

	__builtin_memcpy(key.k.src, &ip6->saddr, 16);
	__builtin_memcpy(key.k.dst, &ip6->daddr, 16);
	key.k.sport = ports->source;
	key.k.dport = ports->dest;
	key.k.proto = proto;
	slot = fp_find_v6(cfg, &key, &entry, &seq);
	if (!slot)
		return fp_punt(EGRET_FP_MISS);
	now = bpf_ktime_get_coarse_ns();
	if (fp_expired(cfg, now))
		return fp_punt(EGRET_FP_PUNT_EXPIRED);

	/* A hit. Nothing before the next hop writes; everything after it does. */
	l4_len = be16_len(ip6->payload_len);
	if ((void *)(ip6 + 1) + l4_len > data_end)
		return fp_punt(EGRET_FP_PUNT_MALFORMED);
	rc = fp_check_hit(ports, data_end, proto, l4_len, 1, ip6->hop_limit,
			  addr_sum(key.k.src, 16) + addr_sum(key.k.dst, 16), &csum_at, &tcp_rec);
	if (rc)
		return fp_punt(rc);
	ifindex = fp_set_next_hop(ctx, eth, e->next_hop, 1, e->new_src, e->new_dst, proto, 40 + l4_len, &why);
	if (!ifindex)
		return fp_punt(why);

	__builtin_memcpy(&ip6->saddr, e->new_src, 16);
	__builtin_memcpy(&ip6->daddr, e->new_dst, 16);
	ip6->hop_limit -= 1;
	return fp_finish(ctx, eth, data_end, ports, csum_at, proto, e, slot, seq, tcp_rec, ifindex, now);
}

/* Rule 0: the fast path, when enabled, for untagged IPv4/IPv6 frames. */
static __always_inline int fast_path(struct xdp_md *ctx, void *data, void *data_end, void *l3, __be16 proto)
{
	struct ethhdr *eth = data;

	const struct fp_config *cfg;

	if (proto != bpf_htons(ETH_P_IP) && proto != bpf_htons(ETH_P_IPV6))
		return EGRET_FP_CONTINUE;
	cfg = fp_enabled();
	if (!cfg)
		return EGRET_FP_CONTINUE;
	if (l3 != (void *)(eth + 1))
		return fp_punt(EGRET_FP_SKIP_VLAN);
	if (proto == bpf_htons(ETH_P_IP))
		return fast_path_v4(ctx, cfg, eth, l3, data_end);
	return fast_path_v6(ctx, cfg, eth, l3, data_end);
}

#endif /* EGRET_FAST_PATH_H */
