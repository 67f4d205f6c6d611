//! Loading the steering program, attaching it, and keeping its maps.
//!
//! `SteeringProgram` owns the loaded object (embedded at build time from
//! `OUT_DIR/steer.bpf.o`) and a handle on every map. Map sizes come from
//! `LoadOptions` and are set before load. Attaching returns an `XdpLink`: a
//! bpf_link that the kernel tears down when its fd closes, including when the
//! process dies, so a crashed gateway never leaves a program steering frames
//! to sockets that no longer exist.
//!
//! The fast path's maps (`fp_*`, docs/adr/0005-xdp-fast-path.md) are written
//! through the `fp_*` methods: session entries per direction, the next-hop
//! table, the on/off switch, and its counters.
//!
//! Policy replacement is two-generation: the loader owns the top bit of every
//! class id in the maps. A replacement writes the new generation's
//! (class, destination) rules first, then points the source prefixes at the
//! new classes (one atomic update per prefix), then deletes stale sources and
//! finally the old generation's rules. A lookup therefore always meets a
//! complete rule set, old or new, and a source selected in both generations is
//! never unclassified.

use std::collections::{BTreeSet, HashSet};
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::Duration;

use ipnet::IpNet;
use libbpf_rs::{ErrorKind, MapCore, MapFlags, MapHandle, Object, ObjectBuilder, ProgramInput};

use crate::error::BpfError;
use crate::fast_path::{
    FastPathReason, FpConfig, FpEntry, FpEntryV6, FpKey, FpKeyV6, FpNextHop, FpTraffic, FP_NEXT_HOP_LEN, POLICY_SLOTS,
};
use crate::grace::GracePeriod;
use crate::link::create_xdp_link;
use crate::mapped_ports::{MappedPorts, NAT_PORT_BITS_MAP, NAT_PORT_SLOTS_MAP};
use crate::maps::{
    IfRole, In6Key, OwnedAddr, PodMacKey, PolicyClass, PolicyDstV4Key, PolicyDstV6Key, PolicyRule, PolicySrcV4Key,
    PolicySrcV6Key, VerdictReason, XdpAction, XskSlot, POLICY_EXCLUDE, POLICY_STEER, XSK_QUEUES_PER_SLOT,
};
use crate::raw_map::{self, MappedArray};
use crate::session_table::{self, SessionTable, SlotShape, SHAPE_V4, SHAPE_V6};
use crate::tunnel::{NodeAddrSync, Tunnel, TunnelConfig, MAX_VNI};

/// The compiled steering object, built by build.rs.
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/steer.bpf.o"));

/// The fast path's measurement variant (next hops from `bpf_fib_lookup`,
/// GPL-only helper): for tests and the ADR's measurement, never the gateway.
static OBJECT_FIB_LOOKUP: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/steer_fib.bpf.o"));

/// The same variant with the gateway's Apache-2.0 licence string.
static OBJECT_FIB_LOOKUP_APACHE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/steer_fib_apache.bpf.o"));

/// Builds of the program (docs/adr/0005-xdp-fast-path.md). Only
/// [`ProgramVariant::Gateway`] is ever attached by the daemon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgramVariant {
    /// The gateway's program: fast-path next hops from `fp_next_hops`.
    Gateway,
    /// Next hops from `bpf_fib_lookup` per packet; licence string GPL.
    FibLookup,
    /// The same with the Apache-2.0 licence string: the verifier refuses it.
    FibLookupApacheLicensed,
}

/// The `SEC("xdp")` entry point in steer.bpf.c.
const PROGRAM: &str = "egret_steer";

/// Rule 0d's program (decap.h), which the entry point tail-calls through
/// `decap_prog`; never attached itself.
const DECAP_PROGRAM: &str = "egret_decap";

const XSKS_MAP: &str = "xsks_map";
const XSK_SLOTS: &str = "xsk_slots";
const OWNED_V4: &str = "owned_v4";
const OWNED_V6: &str = "owned_v6";
const POLICY_SRC_V4: &str = "policy_src_v4";
const POLICY_SRC_V6: &str = "policy_src_v6";
const POLICY_DST_V4: &str = "policy_dst_v4";
const POLICY_DST_V6: &str = "policy_dst_v6";
const FRAG_DECISIONS: &str = "frag_decisions";
const FRAG_DECISIONS_IN: &str = "frag_decisions_in";
const VERDICT_COUNTERS: &str = "verdict_counters";
const FP_SESSIONS_V4: &str = "fp_sessions_v4";
const FP_SESSIONS_V6: &str = "fp_sessions_v6";
const FP_NEXT_HOPS: &str = "fp_next_hops";
const FP_CONFIG: &str = "fp_config";

/// How much earlier than an owned address's valid-until the fast path stops
/// ([`SteeringProgram::fp_set_valid_until`]): more than one tick of the
/// coarse clock it reads (`bpf_ktime_get_coarse_ns`, updated every jiffy:
/// 10 ms at HZ=100, the slowest common setting).
pub const FP_COARSE_CLOCK_SLACK_NS: u64 = 20_000_000;
const FP_COUNTERS: &str = "fp_counters";
const FP_POLICY_TRAFFIC: &str = "fp_policy_traffic";
const IF_ROLES: &str = "if_roles";
const TUNNEL_CONFIG: &str = "tunnel_config";
const NODE_ADDRS_V4: &str = "node_addrs_v4";
const NODE_ADDRS_V6: &str = "node_addrs_v6";
const DECAP_PROG: &str = "decap_prog";
const POD_MACS: &str = "pod_macs";

/// `BPF_ANY` for map updates.
const BPF_ANY: u64 = 0;

/// The top bit of a class id in the maps names the policy generation.
const GENERATION_BIT: u32 = 1 << 31;

/// Map sizes, set before the object is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Interfaces that can carry AF_XDP sockets (`xsk_slots` entries);
    /// `xsks_map` holds `XSK_QUEUES_PER_SLOT` queues for each.
    pub xsk_interfaces: u32,
    /// `owned_v4` and `owned_v6` entries each (egress IPs and next hops).
    pub owned_addresses: u32,
    /// `policy_src_v4` and `policy_src_v6` entries each (source prefixes).
    /// A replacement holds the old and the new prefixes side by side (one
    /// key for a prefix in both), so this bounds the two selections together.
    pub policy_sources: u32,
    /// `policy_dst_v4` and `policy_dst_v6` entries each. A replacement holds
    /// two generations at once, so this is twice the largest rule set.
    pub policy_rules: u32,
    /// `frag_decisions` entries (datagrams in flight whose first fragment
    /// was judged), LRU.
    pub fragments: u32,
    /// Offloaded IPv4 sessions (`xdp.fastPathSessions`): the session table
    /// holds one slot per direction, twice this many, in four slots per
    /// session rounded up to a power of two (64 bytes each), allocated at
    /// load. 0 leaves the family to the engine: its table is the smallest
    /// (64 slots) and takes nothing.
    pub fast_path_sessions_v4: u32,
    /// Offloaded IPv6 sessions, the same way (128-byte slots).
    pub fast_path_sessions_v6: u32,
    /// `fp_next_hops` entries (distinct (interface, next hop) pairs in use).
    pub fast_path_next_hops: u32,
    /// `node_addrs_v4` and `node_addrs_v6` entries each: the Nodes'
    /// InternalIPs rule 0d accepts tunnelled frames from (one per Node and
    /// family).
    pub node_addresses: u32,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            xsk_interfaces: 8,
            owned_addresses: 1024,
            // 65,536 pods per family (one /32 or /128 each). Unused entries
            // cost nothing (BPF_F_NO_PREALLOC); full, about 4 MiB per family.
            // The fail-closed table, reinstalled on every apply, is what
            // makes more impractical (docs/kubernetes.md, "How many pods").
            policy_sources: 65_536,
            policy_rules: 131_072,
            fragments: 16_384,
            fast_path_sessions_v4: 262_144,
            fast_path_sessions_v6: 262_144,
            fast_path_next_hops: 4096,
            // Far above Kubernetes' tested 5,000 Nodes; a preallocated hash
            // element is about 100 bytes, so about 6 MiB per family.
            node_addresses: 65_536,
        }
    }
}

/// XDP attach mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// In the driver (`XDP_FLAGS_DRV_MODE`); veth and most NICs support it.
    Native,
    /// In the generic stack after skb allocation (`XDP_FLAGS_SKB_MODE`).
    Generic,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            Self::Native => libbpf_sys::XDP_FLAGS_DRV_MODE,
            Self::Generic => libbpf_sys::XDP_FLAGS_SKB_MODE,
        }
    }

    /// `native` or `generic`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Generic => "generic",
        }
    }
}

/// An attached program. Dropping it (or the process dying) detaches it.
#[derive(Debug)]
pub struct XdpLink {
    fd: OwnedFd,
    ifindex: u32,
    mode: XdpMode,
}

impl XdpLink {
    /// The interface the program is attached to.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// The mode it was attached in.
    pub fn mode(&self) -> XdpMode {
        self.mode
    }

    /// Detaches now (the same as dropping).
    pub fn detach(self) {
        drop(self.fd);
    }
}

/// What a destination rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Leave the traffic to the kernel (an `except`).
    Exclude,
    /// Redirect it to userspace for translation.
    Steer,
}

/// Level 1 of policy classification: a source prefix and its class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SrcPrefix {
    /// The source prefix (host bits are ignored).
    pub prefix: IpNet,
    /// Its class, below 2^31.
    pub class: u32,
}

/// Level 2: within a class, a destination prefix and what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DstRule {
    /// The class this rule belongs to, below 2^31.
    pub class: u32,
    /// The destination prefix (host bits are ignored).
    pub prefix: IpNet,
    /// Steer or exclude.
    pub action: Action,
    /// The policy that produced the rule (stored for userspace).
    pub policy_id: u32,
}

/// The result of one BPF_PROG_TEST_RUN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestRunOutput {
    /// What the program returned.
    pub action: XdpAction,
    /// The frame as the program left it.
    pub frame: Vec<u8>,
    /// The kernel's average time per run.
    pub duration: Duration,
}

/// How many entries each policy map holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicyEntryCounts {
    /// `policy_src_v4` entries.
    pub src_v4: usize,
    /// `policy_src_v6` entries.
    pub src_v6: usize,
    /// `policy_dst_v4` entries.
    pub dst_v4: usize,
    /// `policy_dst_v6` entries.
    pub dst_v6: usize,
}

#[derive(Debug)]
struct Maps {
    xsks: MapHandle,
    xsk_slots: MapHandle,
    owned_v4: MapHandle,
    owned_v6: MapHandle,
    policy_src_v4: MapHandle,
    policy_src_v6: MapHandle,
    policy_dst_v4: MapHandle,
    policy_dst_v6: MapHandle,
    frag_decisions: MapHandle,
    frag_decisions_in: MapHandle,
    verdict_counters: MapHandle,
    fp_next_hops: MapHandle,
    fp_config: MapHandle,
    fp_counters: MapHandle,
    fp_policy_traffic: MapHandle,
    if_roles: MapHandle,
    pod_macs: MapHandle,
    tunnel_config: MapHandle,
    node_addrs_v4: MapHandle,
    node_addrs_v6: MapHandle,
}

/// The loaded steering program and its maps.
#[derive(Debug)]
pub struct SteeringProgram {
    object: Object,
    maps: Maps,
    options: LoadOptions,
    /// The generation (0 or 1) of the policy entries currently in the maps;
    /// the lock also serialises replacements.
    generation: Mutex<u32>,
    /// The ifindex holding each `xsk_slots` slot, in slot order.
    slots: Mutex<Vec<u32>>,
    /// The session tables' writers (`fp_sessions_v4`, `fp_sessions_v6`).
    fp_v4: Mutex<SessionTable<MappedArray>>,
    fp_v6: Mutex<SessionTable<MappedArray>>,
    /// `fp_config.seed`: the tables' hash seed, random per load.
    fp_seed: u64,
    /// `fp_config.enabled` and `fp_config.valid_until_ns` as last written.
    fp_state: Mutex<(bool, u64)>,
    /// The writer of `nat_port_slots` / `nat_port_bits` (rule 4a).
    mapped_ports: std::sync::Arc<MappedPorts>,
    /// Waits out the program's runs in flight (policy replacement, fences).
    grace: GracePeriod,
}

/// A lock whose holder panicked is still usable: every writer leaves its
/// data consistent between statements.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn map_op(map: &'static str, op: &'static str, key: impl ToString) -> impl FnOnce(libbpf_rs::Error) -> BpfError {
    move |source| BpfError::MapOp { map, op, key: key.to_string(), source }
}

impl SteeringProgram {
    /// Opens the embedded object, sizes its maps and loads it.
    pub fn load(options: LoadOptions) -> Result<Self, BpfError> {
        Self::load_object(OBJECT, options)
    }

    /// Loads a build of the program: the fib-lookup variants exist for the
    /// measurement in docs/adr/0005-xdp-fast-path.md and its tests only.
    pub fn load_variant(variant: ProgramVariant, options: LoadOptions) -> Result<Self, BpfError> {
        Self::load_object(
            match variant {
                ProgramVariant::Gateway => OBJECT,
                ProgramVariant::FibLookup => OBJECT_FIB_LOOKUP,
                ProgramVariant::FibLookupApacheLicensed => OBJECT_FIB_LOOKUP_APACHE,
            },
            options,
        )
    }

    fn load_object(object: &'static [u8], options: LoadOptions) -> Result<Self, BpfError> {
        let sizes = [
            ("xsk_interfaces", options.xsk_interfaces),
            ("owned_addresses", options.owned_addresses),
            ("policy_sources", options.policy_sources),
            ("policy_rules", options.policy_rules),
            ("fragments", options.fragments),
            ("fast_path_next_hops", options.fast_path_next_hops),
            ("node_addresses", options.node_addresses),
        ];
        if let Some((field, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return Err(BpfError::ZeroMapSize { field });
        }

        let slots = |field: &'static str, sessions: u32| {
            session_table::slots_for(sessions).ok_or(BpfError::SessionTableSize { field, sessions })
        };
        let slots_v4 = slots("fast_path_sessions_v4", options.fast_path_sessions_v4)?;
        let slots_v6 = slots("fast_path_sessions_v6", options.fast_path_sessions_v6)?;

        let mut open = ObjectBuilder::default().open_memory(object).map_err(BpfError::Open)?;
        for mut map in open.maps_mut() {
            let (name, entries) = match map.name().to_str() {
                Some(XSKS_MAP) => (XSKS_MAP, options.xsk_interfaces.saturating_mul(XSK_QUEUES_PER_SLOT)),
                Some(XSK_SLOTS) => (XSK_SLOTS, options.xsk_interfaces),
                Some(OWNED_V4) => (OWNED_V4, options.owned_addresses),
                Some(OWNED_V6) => (OWNED_V6, options.owned_addresses),
                Some(POLICY_SRC_V4) => (POLICY_SRC_V4, options.policy_sources),
                Some(POLICY_SRC_V6) => (POLICY_SRC_V6, options.policy_sources),
                Some(POLICY_DST_V4) => (POLICY_DST_V4, options.policy_rules),
                Some(POLICY_DST_V6) => (POLICY_DST_V6, options.policy_rules),
                Some(FRAG_DECISIONS) => (FRAG_DECISIONS, options.fragments),
                Some(FRAG_DECISIONS_IN) => (FRAG_DECISIONS_IN, options.fragments),
                Some(FP_SESSIONS_V4) => (FP_SESSIONS_V4, slots_v4),
                Some(FP_SESSIONS_V6) => (FP_SESSIONS_V6, slots_v6),
                Some(FP_NEXT_HOPS) => (FP_NEXT_HOPS, options.fast_path_next_hops),
                Some(NODE_ADDRS_V4) => (NODE_ADDRS_V4, options.node_addresses),
                Some(NODE_ADDRS_V6) => (NODE_ADDRS_V6, options.node_addresses),
                _ => continue,
            };
            map.set_max_entries(entries).map_err(|source| BpfError::MapSize { map: name, entries, source })?;
        }
        let object = open.load().map_err(BpfError::Load)?;

        let handle = |name: &'static str| -> Result<MapHandle, BpfError> {
            let map =
                object.maps().find(|m| m.name().to_str() == Some(name)).ok_or(BpfError::MissingMap { map: name })?;
            MapHandle::try_from(&map).map_err(|source| BpfError::MapHandle { map: name, source })
        };
        let maps = Maps {
            xsks: handle(XSKS_MAP)?,
            xsk_slots: handle(XSK_SLOTS)?,
            owned_v4: handle(OWNED_V4)?,
            owned_v6: handle(OWNED_V6)?,
            policy_src_v4: handle(POLICY_SRC_V4)?,
            policy_src_v6: handle(POLICY_SRC_V6)?,
            policy_dst_v4: handle(POLICY_DST_V4)?,
            policy_dst_v6: handle(POLICY_DST_V6)?,
            frag_decisions: handle(FRAG_DECISIONS)?,
            frag_decisions_in: handle(FRAG_DECISIONS_IN)?,
            verdict_counters: handle(VERDICT_COUNTERS)?,
            fp_next_hops: handle(FP_NEXT_HOPS)?,
            fp_config: handle(FP_CONFIG)?,
            fp_counters: handle(FP_COUNTERS)?,
            fp_policy_traffic: handle(FP_POLICY_TRAFFIC)?,
            if_roles: handle(IF_ROLES)?,
            pod_macs: handle(POD_MACS)?,
            tunnel_config: handle(TUNNEL_CONFIG)?,
            node_addrs_v4: handle(NODE_ADDRS_V4)?,
            node_addrs_v6: handle(NODE_ADDRS_V6)?,
        };
        let fp_seed = std::collections::hash_map::RandomState::new().hash_one(0x65_6772_6574u64);
        let table = |name: &'static str,
                     shape: SlotShape,
                     table_slots: u32,
                     sessions: u32|
         -> Result<Mutex<SessionTable<MappedArray>>, BpfError> {
            let bytes = table_slots as usize * shape.slot_words * 8;
            let capacity = sessions as usize * 2;
            let map = handle(name)?;
            let mem = MappedArray::map(map.as_fd(), bytes).map_err(|source| BpfError::SessionTableMap {
                map: name,
                bytes,
                source,
            })?;
            Ok(Mutex::new(SessionTable::new(mem, shape, table_slots, capacity, fp_seed)))
        };
        let fp_v4 = table(FP_SESSIONS_V4, SHAPE_V4, slots_v4, options.fast_path_sessions_v4)?;
        let fp_v6 = table(FP_SESSIONS_V6, SHAPE_V6, slots_v6, options.fast_path_sessions_v6)?;
        let mapped_ports =
            std::sync::Arc::new(MappedPorts::new(handle(NAT_PORT_SLOTS_MAP)?, &handle(NAT_PORT_BITS_MAP)?)?);
        let decap_prog = handle(DECAP_PROG)?;
        let this = Self {
            object,
            maps,
            options,
            generation: Mutex::new(0),
            slots: Mutex::new(Vec::new()),
            fp_v4,
            fp_v6,
            fp_seed,
            fp_state: Mutex::new((false, crate::maps::VALID_FOREVER)),
            mapped_ports,
            grace: GracePeriod::new()?,
        };
        this.fp_set_enabled(false)?;
        this.program()?;
        // Rule 0d's program in the slot the entry point tail-calls, before
        // anything can switch the tunnel on.
        let decap = this
            .object
            .progs()
            .find(|p| p.name().to_str() == Some(DECAP_PROGRAM))
            .ok_or(BpfError::MissingProgram { program: DECAP_PROGRAM })?;
        let fd = decap.as_fd().as_raw_fd();
        decap_prog.update(&0u32.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY).map_err(map_op(
            DECAP_PROG,
            "update",
            format!("0 ({DECAP_PROGRAM})"),
        ))?;
        Ok(this)
    }

    /// The sizes the maps were created with.
    pub fn options(&self) -> LoadOptions {
        self.options
    }

    fn program(&self) -> Result<libbpf_rs::Program<'_>, BpfError> {
        self.object
            .progs()
            .find(|p| p.name().to_str() == Some(PROGRAM))
            .ok_or(BpfError::MissingProgram { program: PROGRAM })
    }

    /// Attaches to `ifindex` through a bpf_link. The program stays attached
    /// while the returned link lives, even if `self` is dropped.
    pub fn attach(&self, ifindex: u32, mode: XdpMode) -> Result<XdpLink, BpfError> {
        let program = self.program()?;
        let fd = create_xdp_link(program.as_fd(), ifindex, mode.flags()).map_err(|source| BpfError::Attach {
            ifindex,
            mode: mode.name(),
            source,
        })?;
        Ok(XdpLink { fd, ifindex, mode })
    }

    /// Inserts or replaces an owned address.
    pub fn set_owned(&self, addr: IpAddr, owned: OwnedAddr) -> Result<(), BpfError> {
        let value = owned.to_bytes();
        match addr {
            IpAddr::V4(a) => {
                self.maps.owned_v4.update(&a.octets(), &value, MapFlags::ANY).map_err(map_op(OWNED_V4, "update", a))
            }
            IpAddr::V6(a) => self
                .maps
                .owned_v6
                .update(&In6Key::from(a).addr, &value, MapFlags::ANY)
                .map_err(map_op(OWNED_V6, "update", a)),
        }
    }

    /// Sets the anti-spoofing role of interface `ifindex` (rule 5a): pods'
    /// traffic arriving on an outside interface is dropped, and on an
    /// interface with `IF_CHECK_SRC_MAC` it is steered only from the
    /// link-layer senders in `pod_macs` (which replace the interface's
    /// previous list). Write it before attaching: an interface without a
    /// role is not restricted.
    pub fn set_interface_role(&self, ifindex: u32, role: IfRole, pod_macs: &[[u8; 6]]) -> Result<(), BpfError> {
        let key = ifindex.to_ne_bytes();
        let stale: Vec<Vec<u8>> = self
            .maps
            .pod_macs
            .keys()
            .filter(|k| k.get(0..4) == Some(&key[..]) && !pod_macs.iter().any(|m| k.get(4..10) == Some(&m[..])))
            .collect();
        for k in stale {
            match self.maps.pod_macs.delete(&k) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(BpfError::MapOp {
                        map: POD_MACS,
                        op: "delete",
                        key: format!("ifindex {ifindex}"),
                        source,
                    })
                }
            }
        }
        for mac in pod_macs {
            let k = PodMacKey { ifindex, mac: *mac, pad: [0; 2] };
            self.maps.pod_macs.update(&k.to_bytes(), &1u32.to_ne_bytes(), MapFlags::ANY).map_err(map_op(
                POD_MACS,
                "update",
                format!("ifindex {ifindex} mac {mac:02x?}"),
            ))?;
        }
        self.maps.if_roles.update(&key, &role.to_bytes(), MapFlags::ANY).map_err(map_op(
            IF_ROLES,
            "update",
            format!("ifindex {ifindex}"),
        ))
    }

    // ------------------------------------------------------------ tunnel

    /// Turns rule 0d (decapsulation of the nodes' VXLAN frames,
    /// docs/adr/0031-workers-in-any-subnet.md) on for `tunnel`'s port and
    /// VNI, or off with `None` (as loaded: then no frame is treated
    /// differently). Port 0 and a VNI above 24 bits are
    /// [`BpfError::InvalidTunnel`], and nothing is written.
    pub fn set_tunnel(&self, tunnel: Option<Tunnel>) -> Result<(), BpfError> {
        if let Some(t) = tunnel {
            if t.port == 0 || t.vni > MAX_VNI {
                return Err(BpfError::InvalidTunnel { port: t.port, vni: t.vni });
            }
        }
        self.maps
            .tunnel_config
            .update(&0u32.to_ne_bytes(), &TunnelConfig::new(tunnel).to_bytes(), MapFlags::ANY)
            .map_err(map_op(TUNNEL_CONFIG, "update", "0"))
    }

    /// The tunnel rule 0d decapsulates, as written (`None`: off).
    pub fn tunnel(&self) -> Result<Option<Tunnel>, BpfError> {
        let bytes = self
            .maps
            .tunnel_config
            .lookup(&0u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(map_op(TUNNEL_CONFIG, "lookup", "0"))?
            .unwrap_or_default();
        let config = TunnelConfig::from_bytes(&bytes).ok_or(BpfError::MapValueSize {
            map: TUNNEL_CONFIG,
            key: "0".to_string(),
            len: bytes.len(),
            expected: std::mem::size_of::<TunnelConfig>(),
        })?;
        Ok(config.tunnel())
    }

    /// Makes `node_addrs_v4` / `node_addrs_v6` hold exactly `addrs` (the
    /// Nodes' InternalIPs, the only outer sources rule 0d accepts): deletes
    /// the stale ones, then adds the missing ones, and says how many of
    /// each. More addresses of a family than `LoadOptions::node_addresses`
    /// is [`BpfError::TooManyNodeAddrs`], refused before anything is
    /// written; a failed write names its address and leaves the earlier
    /// writes in place (the next sync finishes the job).
    pub fn sync_node_addrs(&self, addrs: &BTreeSet<IpAddr>) -> Result<NodeAddrSync, BpfError> {
        let capacity = self.options.node_addresses;
        let families = [
            (&self.maps.node_addrs_v4, NODE_ADDRS_V4, addrs.iter().filter(|a| a.is_ipv4()).count()),
            (&self.maps.node_addrs_v6, NODE_ADDRS_V6, addrs.iter().filter(|a| a.is_ipv6()).count()),
        ];
        for (_, map, count) in families {
            if count > capacity as usize {
                return Err(BpfError::TooManyNodeAddrs { map, count, capacity });
            }
        }
        let present = self.node_addrs();
        let mut done = NodeAddrSync::default();
        // Stale first: the maps never need room for both sets.
        for addr in present.difference(addrs) {
            let (map, name) = self.node_map(*addr);
            match map.delete(&addr_key(*addr)) {
                Ok(()) => done.removed += 1,
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(source) => return Err(BpfError::MapOp { map: name, op: "delete", key: addr.to_string(), source }),
            }
        }
        for addr in addrs.difference(&present) {
            let (map, name) = self.node_map(*addr);
            map.update(&addr_key(*addr), &1u32.to_ne_bytes(), MapFlags::ANY).map_err(map_op(name, "update", addr))?;
            done.added += 1;
        }
        Ok(done)
    }

    /// The Node addresses rule 0d accepts, both families.
    pub fn node_addrs(&self) -> BTreeSet<IpAddr> {
        let v4 =
            self.maps.node_addrs_v4.keys().filter_map(|k| <[u8; 4]>::try_from(k.as_slice()).ok().map(IpAddr::from));
        let v6 =
            self.maps.node_addrs_v6.keys().filter_map(|k| <[u8; 16]>::try_from(k.as_slice()).ok().map(IpAddr::from));
        v4.chain(v6).collect()
    }

    fn node_map(&self, addr: IpAddr) -> (&MapHandle, &'static str) {
        match addr {
            IpAddr::V4(_) => (&self.maps.node_addrs_v4, NODE_ADDRS_V4),
            IpAddr::V6(_) => (&self.maps.node_addrs_v6, NODE_ADDRS_V6),
        }
    }

    /// Reads an owned address back.
    pub fn owned(&self, addr: IpAddr) -> Result<Option<OwnedAddr>, BpfError> {
        let (map, name, key) = match addr {
            IpAddr::V4(a) => (&self.maps.owned_v4, OWNED_V4, a.octets().to_vec()),
            IpAddr::V6(a) => (&self.maps.owned_v6, OWNED_V6, a.octets().to_vec()),
        };
        let Some(bytes) = map.lookup(&key, MapFlags::ANY).map_err(map_op(name, "lookup", addr))? else {
            return Ok(None);
        };
        OwnedAddr::from_bytes(&bytes).map(Some).ok_or(BpfError::MapValueSize {
            map: name,
            key: addr.to_string(),
            len: bytes.len(),
            expected: std::mem::size_of::<OwnedAddr>(),
        })
    }

    /// Removes an owned address. Returns whether it was present.
    pub fn remove_owned(&self, addr: IpAddr) -> Result<bool, BpfError> {
        let result = match addr {
            IpAddr::V4(a) => self.maps.owned_v4.delete(&a.octets()).map_err(|e| (OWNED_V4, e)),
            IpAddr::V6(a) => self.maps.owned_v6.delete(&a.octets()).map_err(|e| (OWNED_V6, e)),
        };
        match result {
            Ok(()) => Ok(true),
            Err((_, e)) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err((map, source)) => Err(BpfError::MapOp { map, op: "delete", key: addr.to_string(), source }),
        }
    }

    /// The `xsks_map` key of (`ifindex`, `queue`), giving `ifindex` a slot
    /// in `xsk_slots` if it has none yet.
    fn xsk_key(&self, ifindex: u32, queue: u32, assign: bool) -> Result<Option<u32>, BpfError> {
        if queue >= XSK_QUEUES_PER_SLOT {
            return Err(BpfError::QueueOutOfRange { ifindex, queue, max: XSK_QUEUES_PER_SLOT });
        }
        // A poisoned lock only means another registration failed half way;
        // the slot list it guards matches what was written.
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let slot = match slots.iter().position(|i| *i == ifindex) {
            Some(s) => s as u32,
            None if !assign => return Ok(None),
            None => {
                let slot = slots.len() as u32;
                if slot >= self.options.xsk_interfaces {
                    return Err(BpfError::NoXskSlot { ifindex, slots: self.options.xsk_interfaces });
                }
                self.maps
                    .xsk_slots
                    .update(&ifindex.to_ne_bytes(), &XskSlot { slot }.to_bytes(), MapFlags::ANY)
                    .map_err(map_op(XSK_SLOTS, "update", format!("ifindex {ifindex}")))?;
                slots.push(ifindex);
                slot
            }
        };
        Ok(Some(slot * XSK_QUEUES_PER_SLOT + queue))
    }

    /// Puts the AF_XDP socket `fd` on RX queue `queue` of interface
    /// `ifindex`. The kernel checks that `fd` is an AF_XDP socket.
    pub fn register_xsk(&self, ifindex: u32, queue: u32, fd: RawFd) -> Result<(), BpfError> {
        let Some(key) = self.xsk_key(ifindex, queue, true)? else {
            return Err(BpfError::NoXskSlot { ifindex, slots: self.options.xsk_interfaces });
        };
        self.maps.xsks.update(&key.to_ne_bytes(), &fd.to_ne_bytes(), MapFlags::ANY).map_err(map_op(
            XSKS_MAP,
            "update",
            format!("ifindex {ifindex} queue {queue} (fd {fd})"),
        ))
    }

    /// Removes the socket of (`ifindex`, `queue`), if any. The kernel
    /// reports no difference between an empty and a filled slot (and refuses
    /// lookups of XSKMAP entries from userspace), so neither does this.
    pub fn unregister_xsk(&self, ifindex: u32, queue: u32) -> Result<(), BpfError> {
        let Some(key) = self.xsk_key(ifindex, queue, false)? else { return Ok(()) };
        self.maps.xsks.delete(&key.to_ne_bytes()).map_err(map_op(
            XSKS_MAP,
            "delete",
            format!("ifindex {ifindex} queue {queue}"),
        ))
    }

    /// Checks, writing nothing, that [`replace_policy`](Self::replace_policy)
    /// would take `sources` and `rules` now: every entry well formed, no key
    /// twice, and each map able to hold the new generation beside what it
    /// holds (`LoadOptions::policy_sources`, `LoadOptions::policy_rules`).
    /// A caller that must change several things at once checks first.
    pub fn check_policy(&self, sources: &[SrcPrefix], rules: &[DstRule]) -> Result<(), BpfError> {
        let generation = self.generation.lock().unwrap_or_else(|p| p.into_inner());
        self.policy_plan(*generation ^ 1, sources, rules).map(drop)
    }

    /// The entries of generation `next` and the keys a replacement deletes,
    /// its capacity checked against the maps' present contents.
    fn policy_plan(&self, next: u32, sources: &[SrcPrefix], rules: &[DstRule]) -> Result<PolicyPlan, BpfError> {
        let tag = |class: u32, what: &dyn Fn() -> String| -> Result<u32, BpfError> {
            if class & GENERATION_BIT != 0 {
                return Err(BpfError::ClassOutOfRange { what: what(), class });
            }
            Ok(class | (next * GENERATION_BIT))
        };

        let mut src = Entries::new(POLICY_SRC_V4, POLICY_SRC_V6);
        for s in sources {
            let class = tag(s.class, &|| format!("source {}", s.prefix))?;
            let value = PolicyClass { class_id: class }.to_bytes().to_vec();
            match s.prefix.trunc() {
                IpNet::V4(n) => src.v4.push((
                    PolicySrcV4Key { prefixlen: u32::from(n.prefix_len()), addr: n.network().octets() }
                        .to_bytes()
                        .to_vec(),
                    value,
                    n.to_string(),
                )),
                IpNet::V6(n) => src.v6.push((
                    PolicySrcV6Key { prefixlen: u32::from(n.prefix_len()), addr: n.network().octets() }
                        .to_bytes()
                        .to_vec(),
                    value,
                    n.to_string(),
                )),
            }
        }
        let mut dst = Entries::new(POLICY_DST_V4, POLICY_DST_V6);
        for r in rules {
            let class = tag(r.class, &|| format!("rule class {} -> {}", r.class, r.prefix))?;
            let action = match r.action {
                Action::Exclude => POLICY_EXCLUDE,
                Action::Steer => POLICY_STEER,
            };
            let value = PolicyRule { action, policy_id: r.policy_id }.to_bytes().to_vec();
            let what = format!("class {} {}", r.class, r.prefix.trunc());
            match r.prefix.trunc() {
                IpNet::V4(n) => dst.v4.push((
                    PolicyDstV4Key::new(class, n.network(), n.prefix_len()).to_bytes().to_vec(),
                    value,
                    what,
                )),
                IpNet::V6(n) => dst.v6.push((
                    PolicyDstV6Key::new(class, n.network(), n.prefix_len()).to_bytes().to_vec(),
                    value,
                    what,
                )),
            }
        }

        let m = &self.maps;
        let families = [
            (&src.v4, &m.policy_src_v4, src.names.0, self.options.policy_sources),
            (&src.v6, &m.policy_src_v6, src.names.1, self.options.policy_sources),
            (&dst.v4, &m.policy_dst_v4, dst.names.0, self.options.policy_rules),
            (&dst.v6, &m.policy_dst_v6, dst.names.1, self.options.policy_rules),
        ];
        // Old and new generations side by side: a source prefix in both is
        // one key (updated in place), a rule never is (its class carries the
        // generation), so the rules need room for both rule sets.
        let mut stale: [Vec<Vec<u8>>; 4] = Default::default();
        for ((entries, map, name, capacity), stale) in families.into_iter().zip(stale.iter_mut()) {
            let wanted = unique_keys(entries, name)?;
            let existing: Vec<Vec<u8>> = map.keys().collect();
            let count = wanted.len() + existing.iter().filter(|k| !wanted.contains(*k)).count();
            if count > capacity as usize {
                return Err(BpfError::PolicyTooLarge { map: name, count, capacity });
            }
            *stale = existing.into_iter().filter(|k| !wanted.contains(k)).collect();
        }
        Ok(PolicyPlan { src, dst, stale })
    }

    /// Replaces the whole policy classification (both levels, both
    /// families) without a window in which a source selected before and after
    /// is unclassified or meets a partial rule set (see the module doc).
    /// A replacement that does not fit ([`BpfError::PolicyTooLarge`]) is
    /// refused before anything is written.
    pub fn replace_policy(&self, sources: &[SrcPrefix], rules: &[DstRule]) -> Result<(), BpfError> {
        // A poisoned lock only means another replacement failed half way;
        // the generation number it guards is still the one in the maps.
        let mut generation = self.generation.lock().unwrap_or_else(|p| p.into_inner());
        let next = *generation ^ 1;
        let PolicyPlan { src, dst, stale } = self.policy_plan(next, sources, rules)?;
        let m = &self.maps;
        let families = [
            (&src.v4, &m.policy_src_v4, src.names.0),
            (&src.v6, &m.policy_src_v6, src.names.1),
            (&dst.v4, &m.policy_dst_v4, dst.names.0),
            (&dst.v6, &m.policy_dst_v6, dst.names.1),
        ];

        // 1. The next generation's rules: unreachable until sources point at them.
        // 2. The sources, each flipped to its next-generation class atomically.
        for (entries, map, name) in [families[2], families[3], families[0], families[1]] {
            for (key, value, what) in entries.iter() {
                map.update(key, value, MapFlags::ANY).map_err(map_op(name, "update", what))?;
            }
        }
        let delete_stale = |i: usize| -> Result<(), BpfError> {
            let (_, map, name) = families[i];
            for key in &stale[i] {
                match map.delete(key) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(source) => return Err(BpfError::MapOp { map: name, op: "delete", key: hex(key), source }),
                }
            }
            Ok(())
        };
        // 3. Stale sources.
        delete_stale(0)?;
        delete_stale(1)?;
        // 3b. A grace period before any rule goes: a run that read its
        // source's class before step 2 or 3 would otherwise find its rules
        // gone and pass a steered frame. Nothing to wait for when no rule
        // goes (the first replacement, or the same rules again).
        if !stale[2].is_empty() || !stale[3].is_empty() {
            self.grace.wait()?;
        }
        // 4. Every rule not in the next generation.
        delete_stale(2)?;
        delete_stale(3)?;
        *generation = next;
        Ok(())
    }

    /// Returns once every run of the program that started before the call
    /// has finished ([`GracePeriod`]): a value deleted before the call is in
    /// no run's hands after it. Takes a grace period (milliseconds).
    pub fn wait_for_runs_in_flight(&self) -> Result<(), BpfError> {
        self.grace.wait()
    }

    // ------------------------------------------------------------ fast path

    /// Turns rule 0 on or off (`fp_config.enabled`). Off, the program does
    /// not look sessions up at all. The rest of `fp_config` (the tables'
    /// masks and hash seed) is written with it.
    pub fn fp_set_enabled(&self, enabled: bool) -> Result<(), BpfError> {
        let mut state = lock(&self.fp_state);
        self.write_fp_config(enabled, state.1)?;
        state.0 = enabled;
        Ok(())
    }

    /// Sets `fp_config.valid_until_ns`: the fast path translates nothing at
    /// or after `valid_until_ns` (CLOCK_MONOTONIC; [`crate::maps::VALID_FOREVER`]:
    /// no deadline). The program reads it with the coarse clock, which lags
    /// the fine one by at most a tick (10 ms at HZ=100): the value written
    /// is `valid_until_ns` less [`FP_COARSE_CLOCK_SLACK_NS`], so the fast
    /// path stops before the deadline, never after, and the workers judge
    /// the frames in between.
    pub fn fp_set_valid_until(&self, valid_until_ns: u64) -> Result<(), BpfError> {
        let mut state = lock(&self.fp_state);
        let at = if valid_until_ns == crate::maps::VALID_FOREVER {
            valid_until_ns
        } else {
            valid_until_ns.saturating_sub(FP_COARSE_CLOCK_SLACK_NS)
        };
        self.write_fp_config(state.0, at)?;
        state.1 = at;
        Ok(())
    }

    fn write_fp_config(&self, enabled: bool, valid_until_ns: u64) -> Result<(), BpfError> {
        let config = FpConfig {
            enabled: u32::from(enabled),
            mask_v4: lock(&self.fp_v4).mask(),
            mask_v6: lock(&self.fp_v6).mask(),
            pad: 0,
            seed: self.fp_seed,
            valid_until_ns,
        };
        self.maps
            .fp_config
            .update(&0u32.to_ne_bytes(), &config.to_bytes(), MapFlags::ANY)
            .map_err(map_op(FP_CONFIG, "update", "0"))
    }

    /// The session table of `N`-byte addresses (4: IPv4, 16: IPv6) and its
    /// map's name.
    fn fp_table<const N: usize>(&self) -> (&Mutex<SessionTable<MappedArray>>, &'static str) {
        const { assert!(N == 4 || N == 16, "session tables exist for 4- and 16-byte addresses") };
        if N == 4 {
            (&self.fp_v4, FP_SESSIONS_V4)
        } else {
            (&self.fp_v6, FP_SESSIONS_V6)
        }
    }

    /// Installs (or replaces) one direction of a session ([`FpKeyV4`] or
    /// [`FpKeyV6`]). A table that cannot take it is
    /// [`BpfError::FastPathFull`].
    pub fn fp_insert<const N: usize>(&self, key: &FpKey<N>, entry: &FpEntry<N>) -> Result<(), BpfError> {
        let (table, map) = self.fp_table::<N>();
        let (mut k, mut e) = ([0u8; FpKeyV6::LEN], [0u8; FpEntryV6::LEN]);
        lock(table).insert(key.write_to(&mut k), entry.write_to(&mut e)).map_err(|_| BpfError::FastPathFull { map })
    }

    /// Removes one direction of a session; returns whether it was there.
    pub fn fp_delete<const N: usize>(&self, key: &FpKey<N>) -> Result<bool, BpfError> {
        let mut k = [0u8; FpKeyV6::LEN];
        Ok(lock(self.fp_table::<N>().0).remove(key.write_to(&mut k)))
    }

    /// Reads one direction of a session (its last-seen stamp).
    pub fn fp_get<const N: usize>(&self, key: &FpKey<N>) -> Result<Option<FpEntry<N>>, BpfError> {
        let (mut k, mut out) = ([0u8; FpKeyV6::LEN], [0u8; FpEntryV6::LEN]);
        let out = &mut out[..FpEntry::<N>::LEN];
        let found = lock(self.fp_table::<N>().0).get(key.write_to(&mut k), out);
        Ok(if found { FpEntry::from_bytes(out) } else { None })
    }

    /// The acknowledgment number and raw window of the latest TCP segment
    /// with ACK set the program translated under `key` since its slot was
    /// last written (`SessionTable::tcp_seen`), if any.
    pub fn fp_tcp_seen<const N: usize>(&self, key: &FpKey<N>) -> Option<(u32, u16)> {
        let mut k = [0u8; FpKeyV6::LEN];
        lock(self.fp_table::<N>().0).tcp_seen(key.write_to(&mut k))
    }

    /// Session directions in the two tables (IPv4, IPv6).
    pub fn fp_entry_counts(&self) -> (usize, usize) {
        (lock(&self.fp_v4).len(), lock(&self.fp_v6).len())
    }

    /// The session tables' sizes in slots as the kernel allocated them
    /// (IPv4, IPv6): `max_entries` of `fp_sessions_v4` and `fp_sessions_v6`.
    pub fn fp_table_slots(&self) -> Result<(u32, u32), BpfError> {
        let slots = |name: &'static str| -> Result<u32, BpfError> {
            let map = self
                .object
                .maps()
                .find(|m| m.name().to_str() == Some(name))
                .ok_or(BpfError::MissingMap { map: name })?;
            let info = map.info().map_err(|source| BpfError::MapHandle { map: name, source })?;
            Ok(info.info.max_entries)
        };
        Ok((slots(FP_SESSIONS_V4)?, slots(FP_SESSIONS_V6)?))
    }

    /// Deletes every session entry of both families (the fast path turned
    /// off, or a test resetting). Returns how many were deleted.
    pub fn fp_clear(&self) -> Result<usize, BpfError> {
        Ok(lock(&self.fp_v4).clear() + lock(&self.fp_v6).clear())
    }

    /// Writes next hop `id` (below `LoadOptions::fast_path_next_hops`).
    pub fn fp_set_next_hop(&self, id: u32, next_hop: &FpNextHop) -> Result<(), BpfError> {
        raw_map::update(&self.maps.fp_next_hops, &id.to_ne_bytes(), &next_hop.to_bytes(), BPF_ANY)
            .map_err(|source| BpfError::FastPathOp { map: FP_NEXT_HOPS, op: "update", key: id.to_string(), source })
    }

    /// Reads next hop `id`.
    pub fn fp_next_hop(&self, id: u32) -> Result<Option<FpNextHop>, BpfError> {
        let mut out = [0u8; FP_NEXT_HOP_LEN];
        let found = raw_map::lookup(&self.maps.fp_next_hops, &id.to_ne_bytes(), &mut out)
            .map_err(|source| BpfError::FastPathOp { map: FP_NEXT_HOPS, op: "lookup", key: id.to_string(), source })?;
        Ok(if found { FpNextHop::from_bytes(&out) } else { None })
    }

    /// Every fast-path reason's counter, summed over CPUs, in reason order.
    pub fn fp_counters(&self) -> Result<Vec<(FastPathReason, u64)>, BpfError> {
        let mut out = Vec::with_capacity(FastPathReason::ALL.len());
        for &reason in FastPathReason::ALL {
            let sum = self.percpu_u64_sum(&self.maps.fp_counters, FP_COUNTERS, reason.index(), reason.name())?;
            out.push((reason, sum));
        }
        Ok(out)
    }

    fn percpu_u64_sum(&self, map: &MapHandle, name: &'static str, index: u32, what: &str) -> Result<u64, BpfError> {
        let per_cpu = map
            .lookup_percpu(&index.to_ne_bytes(), MapFlags::ANY)
            .map_err(map_op(name, "lookup", what.to_string()))?
            .unwrap_or_default();
        let mut sum = 0u64;
        for value in per_cpu {
            let bytes: [u8; 8] = value.as_slice().try_into().map_err(|_| BpfError::MapValueSize {
                map: name,
                key: what.to_string(),
                len: value.len(),
                expected: 8,
            })?;
            sum = sum.wrapping_add(u64::from_ne_bytes(bytes));
        }
        Ok(sum)
    }

    /// Packets and bytes the fast path translated for policy counter slot
    /// `slot`, summed over CPUs: `[outbound, inbound]`.
    pub fn fp_policy_traffic(&self, slot: u16) -> Result<[FpTraffic; 2], BpfError> {
        let mut out = [FpTraffic::default(); 2];
        let slot = u32::from(slot).min(POLICY_SLOTS - 1);
        for (dir, t) in out.iter_mut().enumerate() {
            let index = slot * 2 + dir as u32;
            let per_cpu = self
                .maps
                .fp_policy_traffic
                .lookup_percpu(&index.to_ne_bytes(), MapFlags::ANY)
                .map_err(map_op(FP_POLICY_TRAFFIC, "lookup", index))?
                .unwrap_or_default();
            for value in per_cpu {
                let bytes: [u8; 16] = value.as_slice().try_into().map_err(|_| BpfError::MapValueSize {
                    map: FP_POLICY_TRAFFIC,
                    key: index.to_string(),
                    len: value.len(),
                    expected: 16,
                })?;
                let (p, b) = bytes.split_at(8);
                t.packets = t.packets.wrapping_add(u64::from_ne_bytes(p.try_into().unwrap_or_default()));
                t.bytes = t.bytes.wrapping_add(u64::from_ne_bytes(b.try_into().unwrap_or_default()));
            }
        }
        Ok(out)
    }

    /// Every reason's counter, summed over CPUs, in reason order.
    pub fn verdict_counters(&self) -> Result<Vec<(VerdictReason, u64)>, BpfError> {
        let mut out = Vec::with_capacity(VerdictReason::ALL.len());
        for &reason in VerdictReason::ALL {
            let key = reason.index().to_ne_bytes();
            let per_cpu = self
                .maps
                .verdict_counters
                .lookup_percpu(&key, MapFlags::ANY)
                .map_err(map_op(VERDICT_COUNTERS, "lookup", reason.name()))?
                .unwrap_or_default();
            let mut sum = 0u64;
            for value in per_cpu {
                let bytes: [u8; 8] = value.as_slice().try_into().map_err(|_| BpfError::MapValueSize {
                    map: VERDICT_COUNTERS,
                    key: reason.name().to_string(),
                    len: value.len(),
                    expected: 8,
                })?;
                sum = sum.wrapping_add(u64::from_ne_bytes(bytes));
            }
            out.push((reason, sum));
        }
        Ok(out)
    }

    /// Entries currently in the four policy maps.
    pub fn policy_entry_counts(&self) -> PolicyEntryCounts {
        let m = &self.maps;
        PolicyEntryCounts {
            src_v4: m.policy_src_v4.keys().count(),
            src_v6: m.policy_src_v6.keys().count(),
            dst_v4: m.policy_dst_v4.keys().count(),
            dst_v6: m.policy_dst_v6.keys().count(),
        }
    }

    /// Number of datagrams with a stored first-fragment decision.
    pub fn fragment_decisions(&self) -> usize {
        self.maps.frag_decisions.keys().count()
    }

    /// Number of datagrams to an egress address (rule 4) with a stored
    /// first-fragment decision (`frag_decisions_in`).
    pub fn fragment_decisions_inbound(&self) -> usize {
        self.maps.frag_decisions_in.keys().count()
    }

    /// The writer of the mapped-port bitmaps the program filters inbound
    /// NAT ports with (rule 4a): the NAT's workers hold it.
    pub fn mapped_ports(&self) -> std::sync::Arc<MappedPorts> {
        self.mapped_ports.clone()
    }

    /// Runs the program once on `frame` through BPF_PROG_TEST_RUN (RX queue
    /// 0 of the loopback device; nothing is transmitted).
    pub fn test_run(&self, frame: &[u8]) -> Result<TestRunOutput, BpfError> {
        self.test_run_repeat(frame, 1)
    }

    /// Runs the program `repeat` times on `frame`; `duration` is the
    /// kernel's average per run (used to measure the program's cost).
    pub fn test_run_repeat(&self, frame: &[u8], repeat: u32) -> Result<TestRunOutput, BpfError> {
        self.test_run_inner(frame, None, repeat)
    }

    /// Runs the program on `frame` as received on RX queue `queue` of
    /// interface `ingress_ifindex` of the calling thread's network namespace
    /// (BPF_PROG_TEST_RUN with an `xdp_md` context; the interface must
    /// exist). The fast path sends with XDP_TX when its next hop is out of
    /// that interface.
    pub fn test_run_on(
        &self,
        frame: &[u8],
        ingress_ifindex: u32,
        queue: u32,
        repeat: u32,
    ) -> Result<TestRunOutput, BpfError> {
        self.test_run_inner(frame, Some((ingress_ifindex, queue)), repeat)
    }

    fn test_run_inner(
        &self,
        frame: &[u8],
        ingress: Option<(u32, u32)>,
        repeat: u32,
    ) -> Result<TestRunOutput, BpfError> {
        let program = self
            .object
            .progs_mut()
            .find(|p| p.name().to_str() == Some(PROGRAM))
            .ok_or(BpfError::MissingProgram { program: PROGRAM })?;
        // The program never grows a frame; leave room for the kernel anyway.
        let mut out = vec![0u8; frame.len() + 256];
        // struct xdp_md: data, data_end, data_meta, ingress_ifindex,
        // rx_queue_index, egress_ifindex (u32 each); the kernel requires
        // data = data_meta = 0 and data_end = the frame's length.
        let mut ctx = [0u8; 24];
        if let Some((ifindex, queue)) = ingress {
            ctx[4..8].copy_from_slice(&(frame.len() as u32).to_ne_bytes());
            ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
            ctx[16..20].copy_from_slice(&queue.to_ne_bytes());
        }
        let mut input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), repeat, ..Default::default() };
        if ingress.is_some() {
            input.context_in = Some(&mut ctx);
        }
        let output = program.test_run(input).map_err(|source| BpfError::TestRun { len: frame.len(), source })?;
        let action = XdpAction::from(output.return_value);
        let frame_out = output.data.map(|d| d.to_vec()).unwrap_or_default();
        Ok(TestRunOutput { action, frame: frame_out, duration: output.duration })
    }
}

/// A checked policy replacement: the next generation's entries and the keys
/// to delete once they are in (`policy_src_v4`, `_v6`, `policy_dst_v4`, `_v6`).
struct PolicyPlan {
    src: Entries,
    dst: Entries,
    stale: [Vec<Vec<u8>>; 4],
}

/// Policy entries of one level, per family: (key bytes, value bytes, key for humans).
struct Entries {
    v4: Vec<(Vec<u8>, Vec<u8>, String)>,
    v6: Vec<(Vec<u8>, Vec<u8>, String)>,
    names: (&'static str, &'static str),
}

impl Entries {
    fn new(v4: &'static str, v6: &'static str) -> Self {
        Self { v4: Vec::new(), v6: Vec::new(), names: (v4, v6) }
    }
}

fn unique_keys(entries: &[(Vec<u8>, Vec<u8>, String)], map: &'static str) -> Result<HashSet<Vec<u8>>, BpfError> {
    let mut keys = HashSet::with_capacity(entries.len());
    for (key, _, what) in entries {
        if !keys.insert(key.clone()) {
            return Err(BpfError::DuplicatePolicyKey { map, key: what.clone() });
        }
    }
    Ok(keys)
}

/// An address as the maps key it: its octets, network order.
fn addr_key(addr: IpAddr) -> Vec<u8> {
    match addr {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
