/* SPDX-License-Identifier: Apache-2.0 */
/*
 * gen.bpf.c - the traffic generator's XDP program, run by the kernel itself
 * through BPF_PROG_TEST_RUN with BPF_F_TEST_XDP_LIVE_FRAMES
 * (Documentation/bpf/bpf_prog_run.rst, "XDP live frame mode"): every run
 * rewrites the template frame into the next flow's frame and returns XDP_TX,
 * which transmits it out of the interface named as the run's ingress
 * interface (the generator's veth).
 *
 * Live-frame pages are recycled without being re-initialised, and a page
 * that went through the gateway comes back as the gateway left it (MACs
 * rewritten, TTL decremented, source translated). So every run first copies
 * the whole template frame from the config map, then writes the flow's
 * fields and checksums: nothing depends on what the page held before.
 *
 * Flow k of n (k = run counter / train mod n, or the counter itself in
 * new-flow mode; train frames of one flow go out in a row):
 *   source address = base_ip + k mod n_ips
 *   source port    = base_port + (k / n_ips) mod n_ports
 * Checksums (RFC 1071): userspace passes the one's complement sums of every
 * 16-bit word except the varying ones (IPv4 header without saddr and check;
 * UDP pseudo-header, header and payload without saddr, sport and check).
 *
 * TCP (proto 6, issue 32): the template is a data segment (ACK, 6 bytes of
 * payload); segment s of its flow (s = passes over the flow set * train +
 * place in the train) carries sequence number
 *   seq = seq_base + 6 * (s mod 8192)
 * (frame.rs, tcp_seq), added to the checksum like the source fields.
 *
 * xdp_gen_vxlan does the same on the pod's frame inside a node's VXLAN
 * frame (see struct gen_vxlan_cfg).
 */
#include "bench_common.h"

/* What both generator programs need to pick and write a flow: the first
 * 48 bytes of either config. */
struct gen_flows {
	__u64 n_flows;   /* 0: every run is a new flow (new-connection mode) */
	__u32 n_ips;
	__u32 n_ports;
	__u32 base_ip;   /* host order */
	__u32 base_port; /* host order */
	__u32 ip_sum;    /* partial sums, host-order words */
	__u32 l4_sum;    /* UDP's or TCP's */
	__u32 train;     /* frames of one flow in a row, >= 1 */
	__u32 proto;     /* IPPROTO_UDP or IPPROTO_TCP */
	__u32 seq_base;  /* TCP: the first data byte's sequence number */
	__u32 pad;
};

/* TCP: payload bytes per segment, and segments before a flow's sequence
 * number goes back to seq_base (frame.rs: TCP_PAYLOAD, TCP_SEQ_WRAP). */
#define GEN_TCP_PAYLOAD 6
#define GEN_TCP_SEQ_WRAP 8192

struct gen_cfg {
	struct gen_flows f;
	__u8 frame[BENCH_FRAME_LEN]; /* the template, any flow's */
};

/* The encapsulated generator (issue 30, ADR 0031): the template is a whole
 * node-to-gateway VXLAN frame (outer Ethernet, IPv4, UDP with a zero
 * checksum as the nodes' lightweight tunnel sends it, VXLAN, then the
 * pod's 60-byte frame); the flow's fields are written into the inner frame
 * and the outer UDP source port is a hash of the inner flow, as the nodes'
 * kernel makes it (udp_flow_src_port). */
struct gen_vxlan_cfg {
	struct gen_flows f;
	__u8 frame[BENCH_VXLAN_FRAME_LEN];
};

struct gen_state {
	__u64 next;      /* the next flow counter */
	__u64 runs;      /* frames produced */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_cfg);
} gen_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_vxlan_cfg);
} gen_vxlan_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct gen_state);
} gen_states SEC(".maps");

/* Write the next flow's source address, port and checksums into the
 * 60-byte frame at `frame` (already a copy of the template); returns the
 * flow's source address and port (host order) in *src and *port. */
static __always_inline void gen_write_flow(const struct gen_flows *cfg, struct gen_state *st, void *frame,
					   __u32 *src_out, __u32 *port_out)
{
	struct iphdr *ip = frame + BENCH_ETH_LEN;
	struct udphdr *udp = frame + BENCH_UDP_OFF;
	struct tcphdr *tcp = frame + BENCH_UDP_OFF;

	__u64 n = st->next++;
	__u64 k = n;
	st->runs++;
	if (cfg->n_flows) {
		if (cfg->train > 1)
			k = k / cfg->train;
		k = k % cfg->n_flows;
	}
	__u32 src = cfg->base_ip + (__u32)(k % cfg->n_ips);
	__u32 port = cfg->base_port + (__u32)((k / cfg->n_ips) % cfg->n_ports);
	__u32 src_words = (src >> 16) + (src & 0xffff);

	ip->saddr = bpf_htonl(src);
	ip->check = bpf_htons((__u16)~bench_fold(cfg->ip_sum + src_words));
	if (cfg->proto == IPPROTO_TCP) {
		__u64 seg = 0;
		if (cfg->n_flows) {
			__u64 train = cfg->train > 1 ? cfg->train : 1;
			seg = (n / (train * cfg->n_flows)) * train + n % train;
		}
		__u32 seq = cfg->seq_base + GEN_TCP_PAYLOAD * (__u32)(seg % GEN_TCP_SEQ_WRAP);
		tcp->source = bpf_htons((__u16)port);
		tcp->seq = bpf_htonl(seq);
		/* TCP has no "no checksum": a computed zero is sent as is. */
		tcp->check = bpf_htons(
			(__u16)~bench_fold(cfg->l4_sum + src_words + (port & 0xffff) + (seq >> 16) + (seq & 0xffff)));
	} else {
		udp->source = bpf_htons((__u16)port);
		__u16 ucheck = (__u16)~bench_fold(cfg->l4_sum + src_words + (port & 0xffff));
		/* RFC 768: a computed zero is sent as all ones. */
		udp->check = bpf_htons(ucheck ? ucheck : 0xffff);
	}
	*src_out = src;
	*port_out = port;
}

SEC("xdp")
int xdp_gen(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0, src, port;
	struct gen_cfg *cfg = bpf_map_lookup_elem(&gen_config, &zero);
	struct gen_state *st = bpf_map_lookup_elem(&gen_states, &zero);
	if (!cfg || !st || cfg->f.n_ips == 0 || cfg->f.n_ports == 0)
		return XDP_ABORTED;
	if (data + BENCH_FRAME_LEN > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(data, cfg->frame, BENCH_FRAME_LEN);
	gen_write_flow(&cfg->f, st, data, &src, &port);
	return XDP_TX;
}

SEC("xdp")
int xdp_gen_vxlan(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0, src, port;
	struct gen_vxlan_cfg *cfg = bpf_map_lookup_elem(&gen_vxlan_config, &zero);
	struct gen_state *st = bpf_map_lookup_elem(&gen_states, &zero);
	if (!cfg || !st || cfg->f.n_ips == 0 || cfg->f.n_ports == 0)
		return XDP_ABORTED;
	if (data + BENCH_VXLAN_FRAME_LEN > data_end)
		return XDP_ABORTED;
	__builtin_memcpy(data, cfg->frame, BENCH_VXLAN_FRAME_LEN);
	gen_write_flow(&cfg->f, st, data + BENCH_VXLAN_OVERHEAD, &src, &port);
	struct udphdr *outer = data + BENCH_UDP_OFF;
	outer->source = bpf_htons(bench_outer_port(src, port));
	return XDP_TX;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
