/* SPDX-License-Identifier: Apache-2.0 */
/*
 * redirect.bpf.c - the ceiling: the least a forwarder can do. Every IPv4
 * frame gets the next hop's MAC addresses and is bpf_redirect()ed out of the
 * outside interface; nothing else is touched (no TTL, no NAT, no lookup).
 * Anything else (ARP) goes to the kernel. The addresses are constants in
 * .rodata, set by the loader before load, so the verifier sees literals.
 */
#include "bench_common.h"

struct redirect_cfg {
	__u32 out_ifindex;
	__u8 src_mac[ETH_ALEN];
	__u8 dst_mac[ETH_ALEN];
};

const volatile struct redirect_cfg cfg = {};

SEC("xdp")
int xdp_redirect_mac(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return XDP_PASS;
	if (eth->h_proto != bpf_htons(ETH_P_IP))
		return XDP_PASS;
#pragma unroll
	for (int i = 0; i < ETH_ALEN; i++) {
		eth->h_source[i] = cfg.src_mac[i];
		eth->h_dest[i] = cfg.dst_mac[i];
	}
	return bpf_redirect(cfg.out_ifindex, 0);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
