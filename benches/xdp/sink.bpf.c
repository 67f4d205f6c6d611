/* SPDX-License-Identifier: Apache-2.0 */
/*
 * sink.bpf.c - the sink: counts and drops the benchmark's frames (IPv4/UDP or
 * IPv4/TCP to the sink address and port), verifying both checksums on the way, and
 * passes everything else (ARP) to the kernel. Counting in XDP is exact and
 * costs the sink's core little; the counters are per-CPU, summed by the
 * reader, and all live in one map value so that one lookup reads them
 * together (no skew between "frames" and "translated").
 *
 * Counters (index into sink_counts.c):
 *   0 BENCH        benchmark frames received
 *   1 TRANSLATED   ... whose source is in 203.0.113.0/24 (SNATed)
 *   2 BAD_IP_CSUM  ... whose IPv4 header checksum is wrong (RFC 791, 1071)
 *   3 BAD_UDP_CSUM ... whose UDP (or TCP) checksum is wrong or absent (RFC 768)
 *   4 UNCHECKED    ... not the 60-byte shape, checksums not verified
 *   5 REPLIED      ... answered (see "Replies" below)
 *   6 SYN          TCP SYNs received (not benchmark frames: the handshake)
 *
 * Replies: a stateful NAT confirms a UDP flow when the far end answers (the
 * fast path offloads a session after its first reply). While the value in
 * sink_ctl is non-zero, the sink answers the first translated, correctly
 * checksummed frame of each flow (source address and port) once per value:
 * it swaps the MACs, the addresses and the ports and sends the frame back
 * with XDP_TX. Swapping leaves both checksums valid (the one's complement
 * sums are over the same words). Every later frame of the flow is counted
 * and dropped as before. The benchmark sets a fresh value per fast-path
 * window and 0 for every other mode.
 *
 * TCP (issue 32): data segments (60 bytes, IPv4 total length 46) are
 * counted and checked like UDP frames (the TCP checksum over the same 26
 * bytes with protocol 6). A translated SYN with a correct checksum is
 * answered, while sink_ctl is non-zero, with a SYN-ACK: MACs, addresses and
 * ports swapped, seq = SINK_ISN, ack = the SYN's seq + 1, window 65535, no
 * options, the TCP checksum recomputed. That is the handshake every
 * stateful path (conntrack, Egret) must see before the pod's data segments
 * count as an established connection; the sink never acknowledges data.
 */
#include "bench_common.h"

enum {
	SINK_BENCH = 0,
	SINK_TRANSLATED = 1,
	SINK_BAD_IP_CSUM = 2,
	SINK_BAD_UDP_CSUM = 3,
	SINK_UNCHECKED = 4,
	SINK_REPLIED = 5,
	SINK_SYN = 6,
	SINK_COUNTERS = 7,
};

/* The sink's initial sequence number (frame.rs: TCP_SINK_ISN). */
#define SINK_ISN 0x7e570000u
#define SINK_TCP_WINDOW 65535
#define SINK_TCP_HDR_LEN 20

struct sink_cfg {
	__u32 dst_ip;    /* network order */
	__u16 dst_port;  /* network order */
	__u16 pad;
};

const volatile struct sink_cfg cfg = {};

struct sink_counts {
	__u64 c[SINK_COUNTERS];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct sink_counts);
} sink_counters SEC(".maps");

/* [0]: the reply generation; 0 = never reply. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} sink_ctl SEC(".maps");

/* Flow (source address << 16 | source port) -> the generation it was
 * answered in. Twice the largest flow count the benchmark uses. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 131072);
	__type(key, __u64);
	__type(value, __u32);
} sink_seen SEC(".maps");

/* Answer the flow's first frame of this generation; true when it did. */
static __always_inline int reply_once(struct ethhdr *eth, struct iphdr *ip, struct udphdr *udp)
{
	__u32 zero = 0;
	__u32 *gen = bpf_map_lookup_elem(&sink_ctl, &zero);
	if (!gen || *gen == 0)
		return 0;
	__u64 key = ((__u64)ip->saddr << 16) | udp->source;
	__u32 *seen = bpf_map_lookup_elem(&sink_seen, &key);
	if (seen && *seen == *gen)
		return 0;
	__u32 g = *gen;
	bpf_map_update_elem(&sink_seen, &key, &g, BPF_ANY);
	unsigned char mac[ETH_ALEN];
	__builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
	__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
	__builtin_memcpy(eth->h_source, mac, ETH_ALEN);
	__u32 a = ip->saddr;
	ip->saddr = ip->daddr;
	ip->daddr = a;
	__u16 p = udp->source;
	udp->source = udp->dest;
	udp->dest = p;
	return 1;
}

/* The checksum sum of a TCP segment of `words` 16-bit words (a constant,
 * at most BENCH_UDP_LEN / 2; the caller checked that many bytes are in the
 * packet): its pseudo-header (RFC 9293 3.1) plus the segment's words. A
 * correct segment folds to 0xffff. */
static __always_inline __u32 tcp_sum(struct iphdr *ip, __u16 *w, const int words)
{
	__u32 sum = (ip->saddr >> 16) + (ip->saddr & 0xffff) + (ip->daddr >> 16) + (ip->daddr & 0xffff) +
		    bpf_htons(IPPROTO_TCP) + bpf_htons(words * 2);
#pragma unroll
	for (int i = 0; i < words; i++)
		sum += w[i];
	return sum;
}

/* Whether the sink is answering (sink_ctl non-zero). */
static __always_inline int replying(void)
{
	__u32 zero = 0;
	__u32 *gen = bpf_map_lookup_elem(&sink_ctl, &zero);
	return gen && *gen != 0;
}

/* IPv4/TCP to the sink: count and check data segments, answer SYNs. */
static __always_inline int sink_tcp(struct xdp_md *ctx, struct sink_counts *cnt, struct ethhdr *eth, struct iphdr *ip)
{
	void *data_end = (void *)(long)ctx->data_end;
	struct tcphdr *tcp = (void *)(ip + 1);
	/* A SYN forwarded by the kernel lost its Ethernet padding (54 bytes):
	 * only the header must be there. */
	if (ip->ihl != 5 || (void *)tcp + SINK_TCP_HDR_LEN > data_end)
		return XDP_PASS;
	if (tcp->dest != cfg.dst_port)
		return XDP_PASS;
	int translated = (bpf_ntohl(ip->saddr) & 0xffffff00) == 0xcb007100; /* 203.0.113.0/24 */
	__u16 *w = (__u16 *)ip;
	__u32 ipsum = 0;
#pragma unroll
	for (int i = 0; i < BENCH_IP_LEN / 2; i++)
		ipsum += w[i];
	int ip_ok = bench_fold(ipsum) == 0xffff;

	if (tcp->syn && !tcp->ack) {
		cnt->c[SINK_SYN]++;
		if (!translated || !ip_ok || ip->tot_len != bpf_htons(BENCH_IP_LEN + SINK_TCP_HDR_LEN) ||
		    tcp->doff != 5 || !replying())
			return XDP_DROP;
		if (bench_fold(tcp_sum(ip, (__u16 *)tcp, SINK_TCP_HDR_LEN / 2)) != 0xffff)
			return XDP_DROP;
		unsigned char mac[ETH_ALEN];
		__builtin_memcpy(mac, eth->h_dest, ETH_ALEN);
		__builtin_memcpy(eth->h_dest, eth->h_source, ETH_ALEN);
		__builtin_memcpy(eth->h_source, mac, ETH_ALEN);
		__u32 a = ip->saddr;
		ip->saddr = ip->daddr;
		ip->daddr = a;
		__u16 p = tcp->source;
		tcp->source = tcp->dest;
		tcp->dest = p;
		tcp->ack_seq = bpf_htonl(bpf_ntohl(tcp->seq) + 1);
		tcp->seq = bpf_htonl(SINK_ISN);
		tcp->ack = 1;
		tcp->window = bpf_htons(SINK_TCP_WINDOW);
		tcp->urg_ptr = 0;
		tcp->check = 0;
		tcp->check = (__u16)~bench_fold(tcp_sum(ip, (__u16 *)tcp, SINK_TCP_HDR_LEN / 2));
		cnt->c[SINK_REPLIED]++;
		return XDP_TX;
	}
	cnt->c[SINK_BENCH]++;
	if (translated)
		cnt->c[SINK_TRANSLATED]++;
	if (!ip_ok)
		cnt->c[SINK_BAD_IP_CSUM]++;
	if ((void *)tcp + BENCH_UDP_LEN > data_end || ip->tot_len != bpf_htons(BENCH_IP_LEN + BENCH_UDP_LEN) ||
	    tcp->doff != 5) {
		cnt->c[SINK_UNCHECKED]++;
		return XDP_DROP;
	}
	if (bench_fold(tcp_sum(ip, (__u16 *)tcp, BENCH_UDP_LEN / 2)) != 0xffff)
		cnt->c[SINK_BAD_UDP_CSUM]++;
	return XDP_DROP;
}

SEC("xdp")
int xdp_sink(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->daddr != cfg.dst_ip ||
	    (ip->protocol != IPPROTO_UDP && ip->protocol != IPPROTO_TCP))
		return XDP_PASS;
	__u32 zero = 0;
	struct sink_counts *cnt = bpf_map_lookup_elem(&sink_counters, &zero);
	if (!cnt)
		return XDP_PASS;
	if (ip->protocol == IPPROTO_TCP)
		return sink_tcp(ctx, cnt, eth, ip);
	if (ip->ihl != 5) {
		cnt->c[SINK_BENCH]++;
		cnt->c[SINK_UNCHECKED]++;
		return XDP_DROP;
	}
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end || udp->dest != cfg.dst_port)
		return XDP_PASS;
	cnt->c[SINK_BENCH]++;
	if ((bpf_ntohl(ip->saddr) & 0xffffff00) == 0xcb007100) /* 203.0.113.0/24 */
		cnt->c[SINK_TRANSLATED]++;

	__u16 *w = (__u16 *)ip;
	__u32 sum = 0;
#pragma unroll
	for (int i = 0; i < BENCH_IP_LEN / 2; i++)
		sum += w[i];
	int good = 1;
	if (bench_fold(sum) != 0xffff) {
		cnt->c[SINK_BAD_IP_CSUM]++;
		good = 0;
	}

	if ((void *)udp + BENCH_UDP_LEN > data_end || udp->len != bpf_htons(BENCH_UDP_LEN)) {
		cnt->c[SINK_UNCHECKED]++;
		return XDP_DROP;
	}
	/* Pseudo-header (RFC 768): source, destination, protocol, UDP length;
	 * summed as raw words, which RFC 1071 section 2(B) allows. */
	sum = (ip->saddr >> 16) + (ip->saddr & 0xffff) + (ip->daddr >> 16) + (ip->daddr & 0xffff) +
	      bpf_htons(IPPROTO_UDP) + udp->len;
	__u16 *u = (__u16 *)udp;
#pragma unroll
	for (int i = 0; i < BENCH_UDP_LEN / 2; i++)
		sum += u[i];
	if (udp->check == 0 || bench_fold(sum) != 0xffff) {
		cnt->c[SINK_BAD_UDP_CSUM]++;
		good = 0;
	}
	if (good && (bpf_ntohl(ip->saddr) & 0xffffff00) == 0xcb007100 && reply_once(eth, ip, udp)) {
		cnt->c[SINK_REPLIED]++;
		return XDP_TX;
	}
	return XDP_DROP;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
