//! Network address translation: sessions in both directions, mappings and
//! port allocation, TCP state, expiry, fragments and ICMP errors.
//!
//! - [`key`]: flow keys and session tuples, generic over IPv4/IPv6.
//! - [`session`]: the shared session table (both directions, one index).
//! - [`session_index`]: its index, which slot each flow key leads to.
//! - [`shard_map`]: the new-flow path's small shared maps, spin-locked shards (ADR 0046).
//! - [`flow_cache`]: a worker's exact-match cache of session refs in front of it.
//! - [`flow_rate`]: a worker's per-source limit on new sessions a second.
//! - [`mapping`], [`port_alloc`]: endpoint-independent mappings, try-insert port allocation.
//! - [`pool_memo`]: a worker's memo of the port pools its new flows allocate from.
//! - [`port_blocks`]: blocks of ports per pod and egress IP, logged per block (ADR 0034 §6).
//! - [`tcp_state`]: the TCP tracker that picks timeouts (diagram inside).
//! - [`fragments`]: virtual reassembly of fragmented datagrams.
//! - [`sync`]: session records for a standby gateway, the change journal.
//! - [`table`]: one family's NAT instance: creation, expiry, revalidation, eviction.

pub mod flow_cache;
pub mod flow_rate;
pub mod fragments;
pub mod icmp_error;
pub mod key;
pub mod mapping;
pub mod pool_memo;
pub mod port_alloc;
pub mod port_blocks;
pub mod rewrite;
pub mod session;
pub mod session_index;
pub mod shard_map;
pub mod sync;
pub mod table;
pub mod tcp_state;
