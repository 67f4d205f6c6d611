//! The loader's error type: every variant names what failed (the map, the
//! key, the interface) and keeps the kernel's error as its source.

use std::io;

/// What went wrong while loading, attaching or updating the steering program.
#[derive(Debug, thiserror::Error)]
pub enum BpfError {
    /// The embedded object could not be parsed by libbpf.
    #[error("opening the embedded steering object failed")]
    Open(#[source] libbpf_rs::Error),

    /// The object lacks a map the loader expects (the C and Rust sides disagree).
    #[error("the steering object has no map named {map}")]
    MissingMap {
        /// The map's name.
        map: &'static str,
    },

    /// The object lacks the XDP program.
    #[error("the steering object has no program named {program}")]
    MissingProgram {
        /// The program's name.
        program: &'static str,
    },

    /// Setting a map's size before load failed.
    #[error("setting max_entries of map {map} to {entries} failed")]
    MapSize {
        /// The map's name.
        map: &'static str,
        /// The requested size.
        entries: u32,
        /// libbpf's error.
        #[source]
        source: libbpf_rs::Error,
    },

    /// A size in `LoadOptions` is zero.
    #[error("LoadOptions.{field} must be at least 1")]
    ZeroMapSize {
        /// The field of `LoadOptions`.
        field: &'static str,
    },

    /// `LoadOptions.fast_path_sessions_v4` or `_v6` asks for a session table
    /// larger than a map can be (four slots per session, rounded up to a
    /// power of two).
    #[error("LoadOptions.{field} {sessions} needs more than 2^32 table slots")]
    SessionTableSize {
        /// The field of `LoadOptions`.
        field: &'static str,
        /// The requested sessions.
        sessions: u32,
    },

    /// Mapping a session table into the daemon's memory failed.
    #[error("mapping the session table {map} ({bytes} bytes) failed")]
    SessionTableMap {
        /// The map's name.
        map: &'static str,
        /// The mapping's length.
        bytes: usize,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },

    /// Creating or updating the map of maps behind
    /// [`GracePeriod`](crate::grace::GracePeriod) failed.
    #[error("{op} of map {} (waiting for BPF runs in flight) failed", crate::grace::GRACE_MAP)]
    GraceMap {
        /// "create" or "update".
        op: &'static str,
        /// libbpf's error.
        #[source]
        source: libbpf_rs::Error,
    },

    /// The kernel refused the object (the verifier log goes to stderr).
    #[error("loading the steering program into the kernel failed")]
    Load(#[source] libbpf_rs::Error),

    /// Duplicating a map's file descriptor failed.
    #[error("taking a handle on map {map} failed")]
    MapHandle {
        /// The map's name.
        map: &'static str,
        /// libbpf's error.
        #[source]
        source: libbpf_rs::Error,
    },

    /// A map update, delete, lookup or iteration failed.
    #[error("{op} of key {key} in map {map} failed")]
    MapOp {
        /// The map's name.
        map: &'static str,
        /// `update`, `delete`, `lookup` or `iterate`.
        op: &'static str,
        /// The key, written for a human (an address, a prefix, a queue).
        key: String,
        /// libbpf's error (it carries the errno).
        #[source]
        source: libbpf_rs::Error,
    },

    /// A value read back from a map had an unexpected size.
    #[error("map {map} returned {len} bytes for key {key}, expected {expected}")]
    MapValueSize {
        /// The map's name.
        map: &'static str,
        /// The key.
        key: String,
        /// The length read.
        len: usize,
        /// The length expected.
        expected: usize,
    },

    /// A class id uses the bit the loader reserves for its two generations.
    #[error("{what} uses class {class}; class ids must be below 2^31")]
    ClassOutOfRange {
        /// The source prefix or rule, written for a human.
        what: String,
        /// The class id.
        class: u32,
    },

    /// Two entries of one replacement share a key (a compiler bug upstream).
    #[error("map {map} would get key {key} twice in one policy replacement")]
    DuplicatePolicyKey {
        /// The map's name.
        map: &'static str,
        /// The key, written for a human.
        key: String,
    },

    /// More policy entries than the map can hold during a replacement.
    #[error("{count} entries for map {map} exceed its capacity of {capacity} (two generations must fit)")]
    PolicyTooLarge {
        /// The map's name.
        map: &'static str,
        /// Entries in the new generation plus those of the old one still present.
        count: usize,
        /// The map's max_entries.
        capacity: u32,
    },

    /// Attaching through a bpf_link failed.
    #[error("attaching XDP in {mode} mode to ifindex {ifindex} failed")]
    Attach {
        /// The interface index.
        ifindex: u32,
        /// `native` or `generic`.
        mode: &'static str,
        /// The kernel's error (errno).
        #[source]
        source: io::Error,
    },

    /// BPF_PROG_TEST_RUN failed.
    #[error("BPF_PROG_TEST_RUN of a {len}-byte frame failed")]
    TestRun {
        /// The frame's length.
        len: usize,
        /// libbpf's error.
        #[source]
        source: libbpf_rs::Error,
    },

    /// An RX queue index beyond what one interface slot of the XSKMAP holds.
    #[error("RX queue {queue} of ifindex {ifindex} is beyond the XSKMAP's {max} queues per interface")]
    QueueOutOfRange {
        /// The interface.
        ifindex: u32,
        /// The queue.
        queue: u32,
        /// `XSK_QUEUES_PER_SLOT`.
        max: u32,
    },

    /// More interfaces with AF_XDP sockets than `LoadOptions.xsk_interfaces`.
    #[error("ifindex {ifindex} needs an XSKMAP slot but all {slots} are taken (LoadOptions.xsk_interfaces)")]
    NoXskSlot {
        /// The interface.
        ifindex: u32,
        /// How many slots the program was loaded with.
        slots: u32,
    },

    /// A fast-path session table cannot take the session: it holds its
    /// configured number, or every slot near the key's home is taken. The
    /// session stays in userspace.
    #[error("fast-path map {map} is full")]
    FastPathFull {
        /// The map's name.
        map: &'static str,
    },

    /// A tunnel rule 0d cannot use: port 0, or a VNI wider than 24 bits.
    #[error("tunnel port {port} VNI {vni}: the port must not be 0 and the VNI must fit 24 bits")]
    InvalidTunnel {
        /// The UDP port.
        port: u16,
        /// The VNI.
        vni: u32,
    },

    /// More Node addresses of one family than the map holds.
    #[error("{count} addresses for map {map} exceed its capacity of {capacity} (LoadOptions.node_addresses)")]
    TooManyNodeAddrs {
        /// The map's name.
        map: &'static str,
        /// Addresses of the family asked for.
        count: usize,
        /// The map's max_entries.
        capacity: u32,
    },

    /// A fast-path map operation failed.
    #[error("{op} of key {key} in map {map} failed")]
    FastPathOp {
        /// The map's name.
        map: &'static str,
        /// `update`, `delete` or `lookup`.
        op: &'static str,
        /// The key, written for a human.
        key: String,
        /// The kernel's error.
        #[source]
        source: io::Error,
    },
}
