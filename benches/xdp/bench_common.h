/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_common.h - what the benchmark's three XDP programs share: the fixed
 * layout of the benchmark frame (Ethernet II, IPv4 without options, UDP,
 * 60 bytes without the FCS: 64 on the wire), its VXLAN encapsulation, and
 * RFC 1071 checksum helpers.
 */
#ifndef EGRET_BENCH_COMMON_H
#define EGRET_BENCH_COMMON_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <linux/tcp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define BENCH_ETH_LEN 14
#define BENCH_IP_LEN 20
#define BENCH_UDP_OFF (BENCH_ETH_LEN + BENCH_IP_LEN)
/* The whole frame, without the FCS. */
#define BENCH_FRAME_LEN 60
/* UDP header + payload of the 60-byte frame. */
#define BENCH_UDP_LEN 26

/* VXLAN over IPv4 (ADR 0031): outer Ethernet, IPv4 and UDP (at
 * BENCH_UDP_OFF, as the plain frame's), the 8-byte VXLAN header without
 * options, then the pod's 60-byte frame. */
#define BENCH_VXLAN_OVERHEAD (BENCH_UDP_OFF + 8 + 8)
#define BENCH_VXLAN_FRAME_LEN (BENCH_VXLAN_OVERHEAD + BENCH_FRAME_LEN)

/* The outer UDP source port of a flow (host-order source address and
 * port): a hash of the two (MurmurHash3's 32-bit finaliser) scaled onto
 * 1-65535, as the nodes' kernel spreads flows over the port range
 * (udp_flow_src_port). frame.rs has the same arithmetic (outer_src_port). */
static __always_inline __u16 bench_outer_port(__u32 src, __u32 port)
{
	__u32 h = src ^ (port * 0x9e3779b1u);
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return (__u16)((((__u64)h * 65535) >> 32) + 1);
}

/* RFC 1071 section 4.1: fold a 32-bit one's complement sum to 16 bits. */
static __always_inline __u16 bench_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

#endif
