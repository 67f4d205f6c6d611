//! AF_XDP I/O: the UMEM, the four rings, sockets, and the raw syscalls the
//! worker needs. This is the only module of the crate with unsafe code (but
//! for `netns.rs`'s `setns` and `if_nametoindex`); every `unsafe` block says
//! why it is sound, and ring index loads/stores name the kernel barrier they
//! pair with (`ring.rs`).
//!
//! Our own ring code over `libc`, not a binding crate: see
//! `docs/adr/0002-af-xdp-binding.md`. Kernel ABI: `include/uapi/linux/if_xdp.h`
//! and Documentation/networking/af_xdp.rst; needs Linux 5.10+ (shared UMEM
//! across devices, need-wakeup), measured on 6.18.
//!
//! | file | owns |
//! |---|---|
//! | `sys.rs` | uapi structs and constants, syscall wrappers, mappings |
//! | `ring.rs` | producer/consumer rings, index arithmetic, barriers |
//! | `umem.rs` | the UMEM area and the frame allocator |
//! | `socket.rs` | one bound socket, its rings and counters |
//! | `ports.rs` | a worker's sockets over one shared UMEM; frame ownership |
//! | `sched.rs` | CPU pinning and `SCHED_FIFO` for worker threads |
//! | `test_prog.rs` | a raw-`bpf(2)` XSKMAP redirect program (lab, tests) |
#![allow(unsafe_code)]

mod ports;
pub mod ring;
pub mod sched;
mod socket;
pub mod sys;
pub mod test_prog;
mod umem;

use std::io;

pub use ports::{Frame, PortId, PortSpec, TxRefused, XskConfig, XskPorts, MAX_PORTS};
pub use socket::{BindMode, SocketConfig, XskCounters, XskCountersSnapshot, XskSocket};
pub use sys::XdpStatistics;
pub use umem::{FramePool, Umem, UmemConfig, DEFAULT_FRAME_COUNT, DEFAULT_FRAME_SIZE, XDP_PACKET_HEADROOM};

/// What failed while setting up AF_XDP I/O.
#[derive(Debug, thiserror::Error)]
pub enum XskError {
    #[error("UMEM frame size {frame_size} is not 2048 or 4096")]
    InvalidFrameSize { frame_size: u32 },
    #[error("UMEM frame count {frame_count} must be at least 1")]
    InvalidFrameCount { frame_count: u32 },
    #[error("{ring} ring size {size} is not a power of two")]
    InvalidRingSize { ring: &'static str, size: u32 },
    #[error("a worker serves 1 to {max} ports, not {count}")]
    PortCount { count: usize, max: usize },
    #[error("mapping a UMEM of {len} bytes failed: {source}")]
    UmemMap { len: usize, source: io::Error },
    #[error("registering a UMEM of {len} bytes with {frame_size}-byte frames failed: {source}")]
    UmemRegister { len: u64, frame_size: u32, source: io::Error },
    #[error("{op} for ifindex {ifindex} queue {queue} failed: {source}")]
    Socket { op: &'static str, ifindex: u32, queue: u32, source: io::Error },
    #[error("setting {option} = {value} on the socket for ifindex {ifindex} queue {queue} failed: {source}")]
    SetOption { option: &'static str, value: u32, ifindex: u32, queue: u32, source: io::Error },
    #[error("mapping the {ring} ring of the socket for ifindex {ifindex} queue {queue} failed: {source}")]
    RingMap { ring: &'static str, ifindex: u32, queue: u32, source: io::Error },
    #[error("binding to ifindex {ifindex} queue {queue} (flags {flags:#x}) failed: {source}")]
    Bind { ifindex: u32, queue: u32, flags: u16, source: io::Error },
    #[error("{op} for ifindex {ifindex} failed: {source}")]
    Bpf { op: &'static str, ifindex: u32, source: io::Error },
    #[error("loading the XSK redirect program failed: {source}; verifier log: {log}")]
    ProgLoad { log: String, source: io::Error },
}
