//! The XDP program that steers the frames Egret handles to AF_XDP sockets,
//! its map layouts shared with Rust, and its loader.
//!
//! - `src/bpf/`: the C program (`steer.bpf.c`, the one `SEC("xdp")` entry;
//!   `egret_maps.h` map layouts; `parse.h` header parsing; `verdict.h` the
//!   reason enum). Its steering rules are listed at the top of `steer.bpf.c`
//!   and argued in `docs/adr/0003-xdp-steering.md`.
//! - [`maps`]: `#[repr(C)]` twins of the map keys and values, and
//!   [`VerdictReason`], checked against the object's BTF and `verdict.h`.
//! - [`fast_path`]: the fast path's map layouts (session entries per
//!   direction, next hops) and [`FastPathReason`], checked the same way.
//! - [`tunnel`]: rule 0d's configuration ([`Tunnel`]) and its layout.
//! - [`loader`]: [`SteeringProgram`]: load with sizes, attach through a
//!   bpf_link, update the maps, read the counters, test-run frames.
//!
//! The crate does not depend on the engine: policy arrives as plain
//! [`SrcPrefix`]/[`DstRule`] lists already compiled to two LPM levels.

/// Test helper: a Rust map type and its C twin (from the program's BTF,
/// `maps::skel::types`) have the same size and field offsets.
#[cfg(test)]
macro_rules! same_layout {
    ($rust:ty, $c:ty, [$(($rf:ident, $cf:ident)),* $(,)?]) => {{
        assert_eq!(std::mem::size_of::<$rust>(), std::mem::size_of::<$c>(), "size of {}", stringify!($rust));
        $( assert_eq!(std::mem::offset_of!($rust, $rf), std::mem::offset_of!($c, $cf),
               "offset of {}.{}", stringify!($rust), stringify!($rf)); )*
    }};
}

mod error;
pub mod fast_path;
pub mod grace;
mod link;
pub mod loader;
pub mod mapped_ports;
pub mod maps;
mod raw_map;
pub mod session_table;
pub mod tunnel;

pub use error::BpfError;
pub use fast_path::{
    FastPathReason, FpEntry, FpEntryV4, FpEntryV6, FpKey, FpKeyV4, FpKeyV6, FpNextHop, FpRewrite, FpTraffic, Octets,
};
pub use loader::{
    Action, DstRule, LoadOptions, PolicyEntryCounts, ProgramVariant, SrcPrefix, SteeringProgram, TestRunOutput,
    XdpLink, XdpMode, FP_COARSE_CLOCK_SLACK_NS,
};
pub use mapped_ports::{MappedPorts, SlotTicket};
pub use maps::{
    IfRole, OwnedAddr, VerdictReason, XdpAction, IF_CHECK_SRC_MAC, OWNED_KERNEL_SERVICE, OWNED_NAT, OWNED_NEIGH,
    ROLE_BOTH, ROLE_INSIDE, ROLE_OUTSIDE, VALID_FOREVER, XSK_QUEUES_PER_SLOT,
};
pub use raw_map::monotonic_ns;
pub use tunnel::{NodeAddrSync, Tunnel};
