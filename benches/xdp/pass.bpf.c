/* SPDX-License-Identifier: Apache-2.0 */
/*
 * pass.bpf.c - XDP_PASS for every frame. Attached to the gateway's outside
 * veth (gwout) in the kernel modes while the sink answers: a veth drops the
 * frames its peer sends with XDP_TX (the sink's SYN-ACKs and UDP replies)
 * unless it has an XDP program of its own (NAPI through GRO is not enough,
 * docs/benchmarks-throughput.md). The program sees only what gwout receives;
 * what the gateway forwards leaves gwout by transmit and never meets it.
 */
#include "bench_common.h"

SEC("xdp")
int xdp_pass_all(struct xdp_md *ctx)
{
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
