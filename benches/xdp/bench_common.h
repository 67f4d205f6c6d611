/* SPDX-License-Identifier: Apache-2.0 */
/*
 * bench_common.h - what the benchmark's three XDP programs share: the fixed
 * layout of the benchmark frame (Ethernet II, IPv4 without options, UDP,
 * 60 bytes without the FCS: 64 on the wire) and RFC 1071 checksum helpers.
 */
#ifndef EGRET_BENCH_COMMON_H
#define EGRET_BENCH_COMMON_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#define BENCH_ETH_LEN 14
#define BENCH_IP_LEN 20
#define BENCH_UDP_OFF (BENCH_ETH_LEN + BENCH_IP_LEN)
/* The whole frame, without the FCS. */
#define BENCH_FRAME_LEN 60
/* UDP header + payload of the 60-byte frame. */
#define BENCH_UDP_LEN 26

/* RFC 1071 section 4.1: fold a 32-bit one's complement sum to 16 bits. */
static __always_inline __u16 bench_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

#endif
