/* SPDX-License-Identifier: Apache-2.0 */
/*
 * egret_maps.h - the map layouts shared with userspace and the map
 * definitions of the steering program.
 *
 * Every struct here has a `#[repr(C)]` twin in bpf/src/maps.rs; a test there
 * compares size and field offsets with the types libbpf-cargo generates from
 * this object's BTF, so the two cannot drift. Rules for this file: fixed-width
 * types only, explicit padding, no bool, no bitfields.
 *
 * max_entries below are defaults; the loader (bpf/src/loader.rs) sets them
 * from LoadOptions before the object is loaded.
 */
#ifndef EGRET_MAPS_H
#define EGRET_MAPS_H

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "verdict.h"

/* owned_addr.flags */
#define OWNED_NAT   1u /* this gateway translates for the address */
#define OWNED_NEIGH 2u /* this gateway answers ARP/NDP for the address */

/* policy_rule.action */
#define POLICY_EXCLUDE 0u
#define POLICY_STEER   1u

/* frag_key.family */
#define EGRET_FAMILY_V4 4
#define EGRET_FAMILY_V6 6

/* Value of owned_v4 (key: __be32 address) and owned_v6 (key: struct egret_in6). */
struct owned_addr {
	__u16 nat_port_lo; /* host order, inclusive */
	__u16 nat_port_hi; /* host order, inclusive */
	__u32 flags;       /* OWNED_* */
};

/* An IPv6 address as map key, network order. */
struct egret_in6 {
	__u8 addr[16];
};

/* policy_src_v4 key: source prefix -> class. prefixlen 0..=32. */
struct policy_src_v4_key {
	__u32 prefixlen;
	__u8 addr[4];
};

/* policy_src_v6 key: source prefix -> class. prefixlen 0..=128. */
struct policy_src_v6_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* Value of policy_src_v4 / policy_src_v6. */
struct policy_class {
	__u32 class_id;
};

/*
 * policy_dst_v4 key: (class, destination prefix) -> rule.
 * prefixlen = 32 (the class, matched exactly) + destination prefix length.
 */
struct policy_dst_v4_key {
	__u32 prefixlen;
	__be32 class_id;
	__u8 addr[4];
};

/* policy_dst_v6 key: prefixlen = 32 + destination prefix length (0..=128). */
struct policy_dst_v6_key {
	__u32 prefixlen;
	__be32 class_id;
	__u8 addr[16];
};

/* Value of policy_dst_v4 / policy_dst_v6. */
struct policy_rule {
	__u32 action;    /* POLICY_EXCLUDE or POLICY_STEER */
	__u32 policy_id; /* for userspace; the program does not read it */
};

/*
 * frag_decisions key: one IP datagram (RFC 791 section 3.2 "identification";
 * RFC 8200 section 4.5). IPv4 addresses occupy the first 4 bytes of src/dst,
 * the rest is zero. id is host order (16-bit IPv4 id widened, or the 32-bit
 * IPv6 Identification). proto is the upper-layer protocol.
 */
struct frag_key {
	__u8 src[16];
	__u8 dst[16];
	__u32 id;
	__u8 proto;
	__u8 family; /* EGRET_FAMILY_V4 or EGRET_FAMILY_V6 */
	__u8 pad[2];
};

/* Value of frag_decisions: the reason the first fragment was given. */
struct frag_decision {
	__u32 reason; /* enum egret_verdict_reason */
};

/*
 * AF_XDP sockets are keyed by (interface slot, RX queue): a two-arm gateway
 * has a socket on the inside and on the outside interface for the same queue
 * index, so the queue alone is not a key. xsk_slots maps the receiving
 * ifindex to a small slot number chosen by userspace; the XSKMAP key is
 * slot * EGRET_XSK_QUEUES_PER_SLOT + rx_queue_index. A queue index at or
 * above EGRET_XSK_QUEUES_PER_SLOT has no socket (rule 7's fallback).
 */
#define EGRET_XSK_QUEUES_PER_SLOT 256u

/* Value of xsk_slots (key: __u32 ifindex, host order). */
struct xsk_slot {
	__u32 slot;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8);
	__type(key, __u32);
	__type(value, struct xsk_slot);
} xsk_slots SEC(".maps");

/* slot * EGRET_XSK_QUEUES_PER_SLOT + queue -> AF_XDP socket. Userspace
 * inserts socket fds; max_entries = slots * EGRET_XSK_QUEUES_PER_SLOT. */
struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 8 * EGRET_XSK_QUEUES_PER_SLOT);
	__type(key, __u32);
	__type(value, __u32);
} xsks_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32); /* IPv4 address, network order */
	__type(value, struct owned_addr);
} owned_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct egret_in6);
	__type(value, struct owned_addr);
} owned_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_src_v4_key);
	__type(value, struct policy_class);
} policy_src_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 16384);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_src_v6_key);
	__type(value, struct policy_class);
} policy_src_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_dst_v4_key);
	__type(value, struct policy_rule);
} policy_dst_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_dst_v6_key);
	__type(value, struct policy_rule);
} policy_dst_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct frag_key);
	__type(value, struct frag_decision);
} frag_decisions SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, EGRET_VERDICT_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} verdict_counters SEC(".maps");

#endif /* EGRET_MAPS_H */
