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
#include "fast_path_reason.h"

/* owned_addr.flags */
#define OWNED_NAT   1u /* this gateway translates for the address */
#define OWNED_NEIGH 2u /* this gateway answers ARP/NDP for the address */
#define OWNED_KERNEL_SERVICE 4u /* also a Service VIP (Kubernetes): its ports outside
				* the NAT range, ICMP queries and other protocols
				* are the kernel's (Service ingress); without this
				* flag they are dropped (rule 4) */

/* policy_rule.action */
#define POLICY_EXCLUDE 0u
#define POLICY_STEER   1u

/* frag_key.family */
#define EGRET_FAMILY_V4 4
#define EGRET_FAMILY_V6 6

/* owned_addr.valid_until_ns / fp_config.valid_until_ns: no deadline
 * (file mode: no Lease). */
#define EGRET_VALID_FOREVER 0xffffffffffffffffULL

/*
 * Value of owned_v4 (key: __be32 address) and owned_v6 (key: struct egret_in6).
 * valid_until_ns is the data plane's own fence (ADR 0004): the address is
 * answered for and translated to only while bpf_ktime_get_ns()
 * (CLOCK_MONOTONIC) is below it. The control plane moves it forward after
 * each successful Lease renewal, never past the renewal's send time +
 * renewDeadline.
 */
struct owned_addr {
	__u16 nat_port_lo; /* host order, inclusive */
	__u16 nat_port_hi; /* host order, inclusive */
	__u32 flags;       /* OWNED_* */
	__u64 valid_until_ns; /* CLOCK_MONOTONIC, exclusive; EGRET_VALID_FOREVER */
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
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_src_v4_key);
	__type(value, struct policy_class);
} policy_src_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 65536);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_src_v6_key);
	__type(value, struct policy_class);
} policy_src_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 131072);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, struct policy_dst_v4_key);
	__type(value, struct policy_rule);
} policy_dst_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_LPM_TRIE);
	__uint(max_entries, 131072);
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

/* ------------------------------------------------------------------------
 * The fast path (docs/adr/0005-xdp-fast-path.md, docs/fast-path.md).
 *
 * One entry per direction of an offloaded session, keyed by the packet's
 * 5-tuple as it arrives; the value is what the userspace engine would do to
 * it (nat::rewrite::direction_rewrite): new addresses and ports, the RFC 1624
 * checksum deltas, the next hop, the policy counter slot and direction, and
 * the last time the entry translated a packet.
 */

/* Policy counter slots (dataplane stats::POLICY_COUNTER_SLOTS). */
#define EGRET_POLICY_SLOTS 1024u

/* fp_entry_*.direction, as the engine's stats::Direction. */
#define EGRET_DIR_OUTBOUND 0
#define EGRET_DIR_INBOUND  1

/* fp_next_hop.valid */
#define EGRET_NEXT_HOP_VALID 1u
/* fp_next_hop.flags: a frame that arrived on the next hop's own interface is
 * punted, never sent back out of it (a two-arm gateway's outside link: a
 * frame from outside that matches a pod's outbound session is not a pod's). */
#define EGRET_NEXT_HOP_NOT_BACK 1u

/* Key of a fp_sessions_v4 slot: addresses and ports network order. */
struct fp_key_v4 {
	__u8 src[4];
	__u8 dst[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

/* Key of a fp_sessions_v6 slot. */
struct fp_key_v6 {
	__u8 src[16];
	__u8 dst[16];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 pad[3];
};

/*
 * Entry of a fp_sessions_v4 slot: one direction's rewrite. The deltas are host
 * order ones' complement values, applied as ~(~HC + delta) (RFC 1624 eqn. 3).
 * last_seen_ns is CLOCK_MONOTONIC (bpf_ktime_get_coarse_ns), written only
 * when it moves by a second or more; 0 = never.
 */
struct fp_entry_v4 {
	__u8 new_src[4];
	__u8 new_dst[4];
	__be16 new_sport;
	__be16 new_dport;
	__u16 l3_delta;
	__u16 l4_delta;
	__u32 next_hop;    /* index into fp_next_hops */
	__u16 policy_slot; /* < EGRET_POLICY_SLOTS */
	__u8 direction;    /* EGRET_DIR_* */
	__u8 flags;        /* reserved, 0 */
	__u64 last_seen_ns;
};

/* Entry of a fp_sessions_v6 slot (l3_delta is 0: IPv6 has no header checksum). */
struct fp_entry_v6 {
	__u8 new_src[16];
	__u8 new_dst[16];
	__be16 new_sport;
	__be16 new_dport;
	__u16 l3_delta;
	__u16 l4_delta;
	__u32 next_hop;
	__u16 policy_slot;
	__u8 direction;
	__u8 flags;
	__u64 last_seen_ns;
};

/* Value of fp_next_hops: where a translated frame goes, kept current by
 * userspace from the kernel's routes and neighbours. */
struct fp_next_hop {
	__u32 ifindex;
	__u8 dst_mac[6];
	__u8 src_mac[6];
	__u32 valid; /* EGRET_NEXT_HOP_VALID, else punt */
	__u32 mtu;   /* the output link's MTU: a larger IP datagram is punted
		      * (the engine answers Fragmentation Needed / Packet Too
		      * Big); 0: not known, not checked */	__u32 flags; /* EGRET_NEXT_HOP_NOT_BACK */
};

/*
 * The session tables (docs/adr/0006-fast-path-session-table.md): one array
 * slot per session direction, key and entry in one slot, so a hit costs one
 * cache line (two for IPv6). Open addressing: a key lives within
 * EGRET_FP_PROBES slots of its home, fp_hash(seed, key) & mask, with no
 * empty slot between home and key (userspace deletes by backward shift).
 * Only userspace writes slots, through an mmap of the map, under a sequence
 * count: seq is odd while a slot is rewritten, and a reader that sees seq
 * change (or odd) treats the frame as a miss. The program itself writes
 * only entry.last_seen_ns.
 */
#define EGRET_FP_PROBES 16

/*
 * tcp_seen: written by the program only, one 8-byte store, for the engine's
 * RST window check (dataplane/src/nat/tcp_state.rs): the acknowledgment
 * number (bits 0-31, host order) and raw window (bits 32-47, host order) of
 * the latest TCP segment with ACK set translated in this direction, and in
 * bits 48-63 the tag (seq & 0xffff) | 1 of the slot's seq under which the
 * program found the key. Userspace trusts the word only while the tag
 * matches the slot's current seq: a word written for a previous tenant of
 * the slot, or before a rewrite, never matches (and 0, the initial value,
 * never does: tags are odd). Outside key and entry, so the seqlock reader's
 * check is not disturbed.
 */
struct fp_slot_v4 {
	__u32 seq;  /* odd while userspace rewrites the slot */
	__u32 live; /* 1: key and entry hold a session direction; 0: empty */
	struct fp_key_v4 key;
	struct fp_entry_v4 entry;
	__u64 tcp_seen;
}; /* 64 bytes: one cache line */

struct fp_slot_v6 {
	__u32 seq;
	__u32 live;
	struct fp_key_v6 key;
	struct fp_entry_v6 entry;
	__u64 tcp_seen;
	__u8 pad[16];
}; /* 128 bytes: two cache lines */

/* Value of fp_config (one entry), written by userspace after loading. */
struct fp_config {
	__u32 enabled; /* 0: the program skips the fast path entirely */
	__u32 mask_v4; /* slots in fp_sessions_v4, minus one (a power of two) */
	__u32 mask_v6; /* the same for fp_sessions_v6 */
	__u32 pad;
	__u64 seed;    /* fp_hash's seed, random per load */
	/* The earliest valid_until_ns of the owned addresses, less the coarse
	 * clock's lag (userspace: bpf/src/loader.rs fp_set_valid_until): no
	 * entry is translated at or after it (EGRET_FP_PUNT_EXPIRED). One field
	 * in the line the fast path reads anyway, instead of a lookup per
	 * packet. */
	__u64 valid_until_ns;
};

/* Value of fp_policy_traffic, index policy_slot * 2 + direction, per CPU. */
struct fp_traffic {
	__u64 packets;
	__u64 bytes;
};

/* max_entries: slots, a power of two (the loader: four per configured
 * session, so the table is at most half full). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1u << 20);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct fp_slot_v4);
} fp_sessions_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1u << 20);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, struct fp_slot_v6);
} fp_sessions_v6 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct fp_next_hop);
} fp_next_hops SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct fp_config);
} fp_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, EGRET_FP_COUNT);
	__type(key, __u32);
	__type(value, __u64);
} fp_counters SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, EGRET_POLICY_SLOTS * 2);
	__type(key, __u32);
	__type(value, struct fp_traffic);
} fp_policy_traffic SEC(".maps");

/* ------------------------------------------------------------------------
 * Anti-spoofing (rule 5a): where a steered source may arrive from.
 *
 * if_roles gives the role of a receiving interface; the daemon writes one
 * entry per attached interface before it attaches. Only inside and both
 * interfaces carry pods' traffic: a selected source arriving on an outside
 * interface is dropped. An interface with EGRET_IF_CHECK_SRC_MAC (one-arm:
 * pods and the outside share the link) carries pods' traffic only from the
 * link-layer senders listed in pod_macs (the node routers). An interface
 * with no entry (BPF_PROG_TEST_RUN's loopback, a program not yet set up) is
 * not restricted.
 */
#define EGRET_ROLE_BOTH    0u
#define EGRET_ROLE_INSIDE  1u
#define EGRET_ROLE_OUTSIDE 2u

/* if_role.flags */
#define EGRET_IF_CHECK_SRC_MAC 1u

/* Value of if_roles (key: __u32 ifindex, host order). */
struct if_role {
	__u32 role;  /* EGRET_ROLE_* */
	__u32 flags; /* EGRET_IF_* */
};

/* Key of pod_macs: a link-layer sender allowed to hand pods' traffic to
 * the gateway on one interface. The value (__u32) is unused (1). */
struct pod_mac_key {
	__u32 ifindex;
	__u8 mac[6];
	__u8 pad[2];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 8);
	__type(key, __u32);
	__type(value, struct if_role);
} if_roles SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, struct pod_mac_key);
	__type(value, __u32);
} pod_macs SEC(".maps");

/* ------------------------------------------------------------------------
 * Mapped NAT ports (rule 4) and the inbound fragment decisions (rule 6).
 *
 * nat_port_slots gives an (egress address, protocol) a slot; nat_port_bits
 * holds one bit per port for each slot: slot * EGRET_NAT_PORT_WORDS +
 * port / 64, bit port % 64. The workers set a port's bit before the first
 * packet of its first session leaves and clear it after its last session is
 * gone (dataplane nat::table), through an mmap of the array. TCP/UDP to a
 * NAT port whose bit is clear is dropped here (EGRET_DROP_UNMAPPED_NAT_PORT)
 * instead of reaching the workers' queues; an (address, protocol) without a
 * slot is not filtered (the workers judge it, as before).
 */
#define EGRET_NAT_PORT_WORDS 1024u /* 65536 ports / 64 */
#define EGRET_NAT_PORT_SLOTS 256u  /* (egress address, protocol) pairs */

/* Key of nat_port_slots. IPv4 addresses occupy the first 4 bytes of addr,
 * the rest is zero. */
struct nat_port_key {
	__u8 addr[16];
	__u8 family; /* EGRET_FAMILY_V4 or EGRET_FAMILY_V6 */
	__u8 proto;  /* IPPROTO_TCP or IPPROTO_UDP */
	__u8 pad[2];
};

/* Value of nat_port_slots. */
struct nat_port_slot {
	__u32 slot; /* < EGRET_NAT_PORT_SLOTS */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, EGRET_NAT_PORT_SLOTS);
	__type(key, struct nat_port_key);
	__type(value, struct nat_port_slot);
} nat_port_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, EGRET_NAT_PORT_SLOTS * EGRET_NAT_PORT_WORDS);
	__uint(map_flags, BPF_F_MMAPABLE);
	__type(key, __u32);
	__type(value, __u64);
} nat_port_bits SEC(".maps");

/*
 * Rule 6's decisions for datagrams to an owned NAT address (rule 4), apart
 * from frag_decisions (rule 5: pods' datagrams): anyone on the outside can
 * send first fragments to an egress address, and in one LRU their entries
 * would evict pods' decisions. Only redirects are stored here (a mapped NAT
 * port, an ICMP error, an echo): a later fragment without an entry gets the
 * same pass or drop a stored one would have given.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct frag_key);
	__type(value, struct frag_decision);
} frag_decisions_in SEC(".maps");

/*
 * Rule 6's budget of orphan fragments (later fragments to an egress address
 * with no stored decision) that one CPU sends to the workers, which hold
 * them until their first fragment comes: 32,768 a second, 1,024 deep. More
 * is a flood (anyone outside may send them) and is dropped here.
 */
#define EGRET_ORPHAN_FRAGMENTS_PER_SEC 32768
#define EGRET_ORPHAN_FRAGMENT_NS (1000000000ULL / EGRET_ORPHAN_FRAGMENTS_PER_SEC)
#define EGRET_ORPHAN_FRAGMENT_BURST 1024

struct orphan_fragment_budget {
	__u64 refilled_ns;
	__u64 tokens;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct orphan_fragment_budget);
} orphan_fragment_budget SEC(".maps");

/* ------------------------------------------------------------------------
 * Workers in any subnet (docs/adr/0031-workers-in-any-subnet.md): a node
 * outside the gateway's subnet sends its selected pods' frames inside
 * VXLAN (RFC 7348) over UDP to the egress address itself; rule 0 of
 * steer.bpf.c (egret_decap) checks and strips the outer headers.
 *
 * tunnel_config (one entry) holds the port and VNI the cluster chose
 * (dataplane wire::vxlan DEFAULT_PORT 6082, EGRET_VNI 1). Zeroed, as
 * loaded, the rule is off and no frame is treated differently.
 */
struct tunnel_config {
	__be16 port;    /* UDP destination port, network order */
	__u16 enabled;  /* 0: rule 0's decapsulation is off */
	__u32 vni;      /* host order, below 2^24 */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct tunnel_config);
} tunnel_config SEC(".maps");

/*
 * The cluster's Nodes' InternalIPs: the only outer sources whose tunnelled
 * frames are taken (anti-spoofing for encapsulated frames: the outer
 * source MAC is a router's, so pod_macs cannot vouch for them). The value
 * (__u32) is unused (1). 65,536 per family by default (the loader's
 * LoadOptions::node_addresses): a hash entry costs about 100 bytes with
 * its preallocated element, so a full family is about 6 MiB.
 */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32); /* IPv4 address, network order */
	__type(value, __u32);
} node_addrs_v4 SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct egret_in6);
	__type(value, __u32);
} node_addrs_v6 SEC(".maps");

/* Rule 0d's program (egret_decap), which the entry point tail-calls; the
 * loader puts it at index 0 after loading. */
struct {
	__uint(type, BPF_MAP_TYPE_PROG_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} decap_prog SEC(".maps");

#endif /* EGRET_MAPS_H */
