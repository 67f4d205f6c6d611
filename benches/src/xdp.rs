//! Loading the benchmark's own XDP programs (`xdp/*.bpf.c`, compiled by
//! `build.rs`) with libbpf-rs and attaching them through bpf_links, so the
//! kernel detaches them when the benchmark exits, however it exits.
//!
//! - [`Generator`]: `xdp_gen`, run by `BPF_PROG_TEST_RUN` in live-frame mode
//!   to transmit frames out of the generator's veth.
//! - [`Redirect`]: `xdp_redirect_mac`, the XDP_REDIRECT ceiling.
//! - [`Sink`]: `xdp_sink`, counting (and checking) what arrives.
//! - [`Pass`]: `xdp_pass_all`, on the gateway's outside veth in the kernel
//!   modes, so that it accepts the sink's `XDP_TX` answers.
//!
//! Attaching resolves the interface index in the calling thread's network
//! namespace: callers run these inside [`crate::topology::in_netns`].

use std::net::Ipv4Addr;

use libbpf_rs::{Link, MapCore, MapFlags, Object, ObjectBuilder, ProgramInput};

use crate::frame::{wire_frame, FlowSet, FrameSpec, GenChecksumBase, VxlanSpec};
use crate::topology::NetnsError;

const GEN_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/gen.bpf.o"));
const REDIRECT_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/redirect.bpf.o"));
const SINK_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/sink.bpf.o"));
const PASS_OBJ: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/pass.bpf.o"));

/// `BPF_F_TEST_XDP_LIVE_FRAMES` (include/uapi/linux/bpf.h).
const BPF_F_TEST_XDP_LIVE_FRAMES: u32 = 1 << 1;
/// `XDP_TX`.
const XDP_TX: u32 = 3;
/// `sizeof(struct gen_flows)` in `xdp/gen.bpf.c`.
const GEN_FLOWS_LEN: usize = 48;

/// What failed loading, attaching or reading a program.
#[derive(Debug, thiserror::Error)]
pub enum XdpError {
    #[error("opening the {object} object failed: {source}")]
    Open { object: &'static str, source: libbpf_rs::Error },
    #[error("loading the {object} object failed (verifier or kernel): {source}")]
    Load { object: &'static str, source: libbpf_rs::Error },
    #[error("the {object} object has no {item} named {name}")]
    Missing { object: &'static str, item: &'static str, name: &'static str },
    #[error("attaching {program} to ifindex {ifindex} failed: {source}")]
    Attach { program: &'static str, ifindex: u32, source: libbpf_rs::Error },
    #[error("{op} on map {map} failed: {source}")]
    Map { map: &'static str, op: &'static str, source: libbpf_rs::Error },
    #[error("running the generator failed: {source}")]
    Run { source: libbpf_rs::Error },
    #[error("a signal interrupted the generator's test run")]
    Interrupted,
    #[error("the generator program returned {retval}, not XDP_TX")]
    Verdict { retval: u32 },
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("interface {dev} not found in namespace {ns}: {source}")]
    NoInterface { dev: String, ns: String, source: std::io::Error },
}

/// The index of `dev` in the calling thread's namespace.
pub fn ifindex(ns: &str, dev: &str) -> Result<u32, XdpError> {
    egret_dataplane::netns::ifindex(dev).map_err(|source| XdpError::NoInterface {
        dev: dev.to_owned(),
        ns: ns.to_owned(),
        source,
    })
}

fn open(object: &'static str, bytes: &'static [u8]) -> Result<libbpf_rs::OpenObject, XdpError> {
    ObjectBuilder::default().open_memory(bytes).map_err(|source| XdpError::Open { object, source })
}

/// Write `value` into the object's `.rodata` (its only variable, at offset 0).
fn set_rodata(open: &mut libbpf_rs::OpenObject, object: &'static str, value: &[u8]) -> Result<(), XdpError> {
    for mut map in open.maps_mut() {
        if map.name().to_string_lossy().ends_with(".rodata") {
            let data = map.initial_value_mut().ok_or(XdpError::Missing {
                object,
                item: "initial value of",
                name: ".rodata",
            })?;
            if data.len() < value.len() {
                return Err(XdpError::Missing { object, item: "room in", name: ".rodata" });
            }
            data[..value.len()].copy_from_slice(value);
            return Ok(());
        }
    }
    Err(XdpError::Missing { object, item: "map", name: ".rodata" })
}

fn attach(obj: &mut Object, object: &'static str, program: &'static str, ifindex: u32) -> Result<Link, XdpError> {
    let prog = obj.progs_mut().find(|p| p.name().to_str() == Some(program)).ok_or(XdpError::Missing {
        object,
        item: "program",
        name: program,
    })?;
    prog.attach_xdp(ifindex as i32).map_err(|source| XdpError::Attach { program, ifindex, source })
}

fn map<'o>(obj: &'o Object, object: &'static str, name: &'static str) -> Result<libbpf_rs::Map<'o>, XdpError> {
    obj.maps().find(|m| m.name().to_str() == Some(name)).ok_or(XdpError::Missing { object, item: "map", name })
}

/// The XDP_REDIRECT ceiling, attached to the gateway's inside interface.
#[derive(Debug)]
pub struct Redirect {
    _link: Link,
    _obj: Object,
}

impl Redirect {
    /// Load with the outside interface and next-hop MACs baked in, and
    /// attach to `in_ifindex` (call inside the gateway's namespace).
    pub fn attach(in_ifindex: u32, out_ifindex: u32, src_mac: [u8; 6], dst_mac: [u8; 6]) -> Result<Self, XdpError> {
        // struct redirect_cfg { __u32 out_ifindex; __u8 src_mac[6]; __u8 dst_mac[6]; }
        let mut cfg = [0u8; 16];
        cfg[0..4].copy_from_slice(&out_ifindex.to_ne_bytes());
        cfg[4..10].copy_from_slice(&src_mac);
        cfg[10..16].copy_from_slice(&dst_mac);
        let mut open = open("redirect", REDIRECT_OBJ)?;
        set_rodata(&mut open, "redirect", &cfg)?;
        let mut obj = open.load().map_err(|source| XdpError::Load { object: "redirect", source })?;
        let link = attach(&mut obj, "redirect", "xdp_redirect_mac", in_ifindex)?;
        Ok(Self { _link: link, _obj: obj })
    }
}

/// `xdp_pass_all` attached to one interface: a veth accepts the frames its
/// peer sends with `XDP_TX` or a redirect only if it has an XDP program of
/// its own (threaded NAPI through GRO is not enough: they count as its RX
/// drops). The kernel modes put it on `gwout` so that the sink's SYN-ACKs
/// and UDP replies reach conntrack; it passes everything, and sees only
/// what the interface receives (forwarded frames leave by transmit).
#[derive(Debug)]
pub struct Pass {
    _link: Link,
    _obj: Object,
}

impl Pass {
    /// Load and attach (native mode, through a bpf_link) to `ifindex` (call
    /// inside the interface's namespace).
    pub fn attach(ifindex: u32) -> Result<Self, XdpError> {
        let open = open("pass", PASS_OBJ)?;
        let mut obj = open.load().map_err(|source| XdpError::Load { object: "pass", source })?;
        let link = attach(&mut obj, "pass", "xdp_pass_all", ifindex)?;
        Ok(Self { _link: link, _obj: obj })
    }
}

/// The sink's counters (see `xdp/sink.bpf.c`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct SinkCounts {
    /// Benchmark frames received.
    pub frames: u64,
    /// Of which with a source in 203.0.113.0/24 (translated).
    pub translated: u64,
    pub bad_ip_checksum: u64,
    pub bad_udp_checksum: u64,
    /// Frames not of the 60-byte shape, checksums unverified.
    pub unchecked: u64,
    /// Frames answered (the first of each flow while replies are on, and
    /// every TCP SYN then).
    pub replied: u64,
    /// TCP SYNs received (the handshakes; not in `frames`).
    pub syns: u64,
}

impl SinkCounts {
    /// Field-wise `self - earlier`.
    pub fn since(&self, e: &SinkCounts) -> SinkCounts {
        SinkCounts {
            frames: self.frames.wrapping_sub(e.frames),
            translated: self.translated.wrapping_sub(e.translated),
            bad_ip_checksum: self.bad_ip_checksum.wrapping_sub(e.bad_ip_checksum),
            bad_udp_checksum: self.bad_udp_checksum.wrapping_sub(e.bad_udp_checksum),
            unchecked: self.unchecked.wrapping_sub(e.unchecked),
            replied: self.replied.wrapping_sub(e.replied),
            syns: self.syns.wrapping_sub(e.syns),
        }
    }
}

/// The sink counter program (attached or not).
#[derive(Debug)]
pub struct Sink {
    link: Option<Link>,
    obj: Object,
}

impl Sink {
    /// Load, counting frames to `dst_ip:dst_port`.
    pub fn load(dst_ip: Ipv4Addr, dst_port: u16) -> Result<Self, XdpError> {
        // struct sink_cfg { __u32 dst_ip; __u16 dst_port; __u16 pad; } (network order)
        let mut cfg = [0u8; 8];
        cfg[0..4].copy_from_slice(&dst_ip.octets());
        cfg[4..6].copy_from_slice(&dst_port.to_be_bytes());
        let mut open = open("sink", SINK_OBJ)?;
        set_rodata(&mut open, "sink", &cfg)?;
        let obj = open.load().map_err(|source| XdpError::Load { object: "sink", source })?;
        Ok(Self { link: None, obj })
    }

    /// Attach to `ifindex` (call inside the sink's namespace).
    pub fn attach(&mut self, ifindex: u32) -> Result<(), XdpError> {
        self.link = Some(attach(&mut self.obj, "sink", "xdp_sink", ifindex)?);
        Ok(())
    }

    /// The program, for test runs.
    pub fn program(&mut self) -> Result<libbpf_rs::ProgramMut<'_>, XdpError> {
        self.obj.progs_mut().find(|p| p.name().to_str() == Some("xdp_sink")).ok_or(XdpError::Missing {
            object: "sink",
            item: "program",
            name: "xdp_sink",
        })
    }

    /// Answer the first translated frame of every flow once more under
    /// `generation` (a value not used before in this run), or never (0). A
    /// NAT confirms a UDP flow on its first reply: the fast path offloads
    /// only confirmed sessions.
    pub fn set_reply_generation(&self, generation: u32) -> Result<(), XdpError> {
        let m = map(&self.obj, "sink", "sink_ctl")?;
        m.update(&0u32.to_ne_bytes(), &generation.to_ne_bytes(), MapFlags::ANY).map_err(|source| XdpError::Map {
            map: "sink_ctl",
            op: "update",
            source,
        })
    }

    /// The counters summed over CPUs (one lookup: all seven together).
    pub fn counts(&self) -> Result<SinkCounts, XdpError> {
        let m = map(&self.obj, "sink", "sink_counters")?;
        let per_cpu = m
            .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
            .map_err(|source| XdpError::Map { map: "sink_counters", op: "lookup", source })?
            .unwrap_or_default();
        let mut v = [0u64; 7];
        for cpu in &per_cpu {
            for (i, slot) in v.iter_mut().enumerate() {
                let field = cpu.get(i * 8..i * 8 + 8).and_then(|b| b.try_into().ok()).map_or(0, u64::from_ne_bytes);
                *slot += field;
            }
        }
        Ok(SinkCounts {
            frames: v[0],
            translated: v[1],
            bad_ip_checksum: v[2],
            bad_udp_checksum: v[3],
            unchecked: v[4],
            replied: v[5],
            syns: v[6],
        })
    }
}

/// The XDP generator: a loaded `xdp_gen` (plain frames) or `xdp_gen_vxlan`
/// (a node's VXLAN frames, issue 30) and its configuration map.
#[derive(Debug)]
pub struct Generator {
    obj: Object,
    template: Vec<u8>,
    encap: Option<VxlanSpec>,
}

impl Generator {
    /// Load the program and configure it for `spec`'s frames over `flows`.
    pub fn load(spec: &FrameSpec, flows: &FlowSet) -> Result<Self, XdpError> {
        Self::load_with(spec, None, flows)
    }

    /// The same, each frame wrapped as a node sends it when `encap` is
    /// given (`xdp_gen_vxlan`).
    pub fn load_with(spec: &FrameSpec, encap: Option<&VxlanSpec>, flows: &FlowSet) -> Result<Self, XdpError> {
        let obj = open("gen", GEN_OBJ)?.load().map_err(|source| XdpError::Load { object: "gen", source })?;
        let (ip0, port0) = flows.flow(0);
        let this = Self { obj, template: wire_frame(spec, encap, ip0, port0), encap: encap.copied() };
        this.configure(spec, flows)?;
        Ok(this)
    }

    /// Point the program at another flow set (between runs).
    pub fn configure(&self, spec: &FrameSpec, flows: &FlowSet) -> Result<(), XdpError> {
        let base = GenChecksumBase::of(spec);
        // struct gen_flows { u64 n_flows; u32 n_ips, n_ports, base_ip, base_port, ip_sum, l4_sum, train,
        // proto, seq_base, pad; } (48 bytes), then the template: struct
        // gen_cfg's 60 bytes, padded to 112 (the u64's alignment), or struct
        // gen_vxlan_cfg's 110, padded to 160. The map refuses any other
        // size, which keeps the two layouts in step.
        let (ip0, port0) = flows.flow(0);
        let frame = wire_frame(spec, self.encap.as_ref(), ip0, port0);
        let mut cfg = vec![0u8; (GEN_FLOWS_LEN + frame.len()).next_multiple_of(8)];
        cfg[0..8].copy_from_slice(&flows.flows.to_ne_bytes());
        cfg[8..12].copy_from_slice(&flows.ips.to_ne_bytes());
        cfg[12..16].copy_from_slice(&flows.ports.to_ne_bytes());
        cfg[16..20].copy_from_slice(&u32::from(flows.base_ip).to_ne_bytes());
        cfg[20..24].copy_from_slice(&u32::from(flows.base_port).to_ne_bytes());
        cfg[24..28].copy_from_slice(&base.ip_sum.to_ne_bytes());
        cfg[28..32].copy_from_slice(&base.udp_sum.to_ne_bytes());
        cfg[32..36].copy_from_slice(&flows.train.max(1).to_ne_bytes());
        cfg[36..40].copy_from_slice(&u32::from(spec.proto.number()).to_ne_bytes());
        cfg[40..44].copy_from_slice(&crate::frame::tcp_seq(0).to_ne_bytes());
        cfg[GEN_FLOWS_LEN..GEN_FLOWS_LEN + frame.len()].copy_from_slice(&frame);
        let name = if self.encap.is_some() { "gen_vxlan_config" } else { "gen_config" };
        map(&self.obj, "gen", name)?.update(&0u32.to_ne_bytes(), &cfg, MapFlags::ANY).map_err(|source| XdpError::Map {
            map: name,
            op: "update",
            source,
        })
    }

    fn program(&mut self) -> Result<libbpf_rs::ProgramMut<'_>, XdpError> {
        let name = if self.encap.is_some() { "xdp_gen_vxlan" } else { "xdp_gen" };
        self.obj.progs_mut().find(|p| p.name().to_str() == Some(name)).ok_or(XdpError::Missing {
            object: "gen",
            item: "program",
            name,
        })
    }

    /// Transmit `count` frames out of `ifindex` (live frames; the calling
    /// thread must be in that interface's namespace). Returns when the kernel
    /// has run the program `count` times, or earlier with
    /// [`XdpError::Interrupted`] when a signal arrived (the frames sent so
    /// far are in the program's counter; the caller may simply go on).
    pub fn transmit(&mut self, ifindex: u32, count: u32) -> Result<(), XdpError> {
        let template = self.template.clone();
        let prog = self.program()?;
        // struct xdp_md { data, data_end, data_meta, ingress_ifindex, rx_queue_index, egress_ifindex }
        let mut ctx = [0u8; 24];
        ctx[4..8].copy_from_slice(&(template.len() as u32).to_ne_bytes());
        ctx[12..16].copy_from_slice(&ifindex.to_ne_bytes());
        let input = ProgramInput {
            context_in: Some(&mut ctx),
            data_in: Some(&template),
            flags: BPF_F_TEST_XDP_LIVE_FRAMES,
            repeat: count,
            ..Default::default()
        };
        match prog.test_run(input) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == libbpf_rs::ErrorKind::Interrupted => Err(XdpError::Interrupted),
            Err(source) => Err(XdpError::Run { source }),
        }
    }

    /// Run the program once on `frame` without transmitting (a plain test
    /// run): returns the verdict and the rewritten frame.
    pub fn rewrite_once(&mut self, frame: &[u8]) -> Result<Vec<u8>, XdpError> {
        let prog = self.program()?;
        let mut out = vec![0u8; frame.len() + 256];
        let input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), ..Default::default() };
        let o = prog.test_run(input).map_err(|source| XdpError::Run { source })?;
        if o.return_value != XDP_TX {
            return Err(XdpError::Verdict { retval: o.return_value });
        }
        let len = o.data.map_or(0, |d| d.len());
        out.truncate(len);
        Ok(out)
    }

    /// Start every CPU's flow counter at `next` (and its frame count at 0).
    pub fn set_next(&self, next: u64) -> Result<(), XdpError> {
        let cpus = libbpf_rs::num_possible_cpus().map_err(|source| XdpError::Map {
            map: "gen_states",
            op: "count CPUs for",
            source,
        })?;
        let mut value = [0u8; 16];
        value[..8].copy_from_slice(&next.to_ne_bytes());
        let values: Vec<Vec<u8>> = vec![value.to_vec(); cpus];
        map(&self.obj, "gen", "gen_states")?
            .update_percpu(&0u32.to_ne_bytes(), &values, MapFlags::ANY)
            .map_err(|source| XdpError::Map { map: "gen_states", op: "update", source })
    }

    /// Frames the program produced so far, summed over CPUs.
    pub fn produced(&self) -> Result<u64, XdpError> {
        produced(&map(&self.obj, "gen", "gen_states")?)
    }

    /// A handle on the frame counter, readable from another thread while
    /// this one runs the program.
    pub fn counter(&self) -> Result<GenCounter, XdpError> {
        let m = map(&self.obj, "gen", "gen_states")?;
        let h = libbpf_rs::MapHandle::try_from(&m).map_err(|source| XdpError::Map {
            map: "gen_states",
            op: "dup",
            source,
        })?;
        Ok(GenCounter(h))
    }
}

/// `gen_states[0].runs` summed over CPUs.
fn produced(m: &impl MapCore) -> Result<u64, XdpError> {
    let per_cpu = m
        .lookup_percpu(&0u32.to_ne_bytes(), MapFlags::ANY)
        .map_err(|source| XdpError::Map { map: "gen_states", op: "lookup", source })?
        .unwrap_or_default();
    Ok(per_cpu.iter().filter_map(|b| Some(u64::from_ne_bytes(b.get(8..16)?.try_into().ok()?))).sum())
}

/// The generator's frame counter, exact at any instant (per-CPU map).
#[derive(Debug)]
pub struct GenCounter(libbpf_rs::MapHandle);

impl GenCounter {
    /// Frames produced so far.
    pub fn read(&self) -> Result<u64, XdpError> {
        produced(&self.0)
    }
}

#[cfg(test)]
mod tests {
    //! These load the programs and run them through BPF_PROG_TEST_RUN (no
    //! interface, no namespace): they need root, as every network test of
    //! the project does.
    use super::*;
    use crate::frame::{checksums_ok, Proto, FRAME_LEN, UDP_OFF};
    use crate::topology::{GEN_MAC, GW_IN_MAC, SINK_IP, SINK_PORT};

    const XDP_DROP: u32 = 1;
    const XDP_PASS: u32 = 2;

    fn spec() -> FrameSpec {
        FrameSpec { src_mac: GEN_MAC, dst_mac: GW_IN_MAC, dst_ip: SINK_IP, dst_port: SINK_PORT, proto: Proto::Udp }
    }

    #[test]
    fn generator_program_writes_each_tcp_segment_exactly() {
        egret_dataplane::xsk::sched::pin_current_thread(0).expect("pin");
        let spec = FrameSpec { proto: Proto::Tcp, ..spec() };
        for flows in [
            FlowSet::fixed(1).with_train(16),
            FlowSet::fixed(4000).with_train(16).with_base_port(1100),
            FlowSet::fixed(3).with_train(4),
            FlowSet::fixed(50_000),
        ] {
            let mut g = Generator::load(&spec, &flows).expect("load gen");
            let stale: Vec<u8> = (0..FRAME_LEN as u32).map(|i| (i * 37 + 11) as u8).collect();
            for k in 0..600u64 {
                let out = g.rewrite_once(&stale).expect("run");
                let (ip, port) = flows.flow(flows.flow_of_frame(k));
                let want = spec.build_segment(ip, port, flows.segment_of_frame(k));
                assert_eq!(out, want.to_vec(), "flows {} train {} frame {k}", flows.flows, flows.train);
                assert_eq!(checksums_ok(&out), Some((true, true)));
            }
        }
        // The sequence number wraps after 8192 segments of a flow.
        let flows = FlowSet::fixed(1);
        let mut g = Generator::load(&spec, &flows).expect("load gen");
        g.set_next(crate::frame::TCP_SEQ_WRAP - 1).expect("next");
        let (ip, port) = flows.flow(0);
        let last = g.rewrite_once(&[0u8; FRAME_LEN]).expect("run");
        let first = g.rewrite_once(&[0u8; FRAME_LEN]).expect("run");
        assert_eq!(last, spec.build_segment(ip, port, crate::frame::TCP_SEQ_WRAP - 1).to_vec());
        assert_eq!(first, spec.build_segment(ip, port, 0).to_vec());
    }

    #[test]
    fn generator_program_writes_each_flows_exact_frame() {
        // The flow counter is per CPU: stay on one.
        egret_dataplane::xsk::sched::pin_current_thread(0).expect("pin");
        let spec = spec();
        for flows in
            [FlowSet::fixed(1), FlowSet::fixed(50_000), FlowSet::fixed(50_000).with_train(8), FlowSet::new_flows()]
        {
            let mut g = Generator::load(&spec, &flows).expect("load gen");
            // Feed a page holding something else, as live mode may (a frame
            // the gateway rewrote): the output must not depend on it.
            let stale: Vec<u8> = (0..FRAME_LEN as u32).map(|i| (i * 37 + 11) as u8).collect();
            for k in 0..600u64 {
                let out = g.rewrite_once(&stale).expect("run");
                let (ip, port) = flows.flow(flows.flow_of_frame(k));
                assert_eq!(out, spec.build(ip, port).to_vec(), "flows {} train {} frame {k}", flows.flows, flows.train);
                assert_eq!(checksums_ok(&out), Some((true, true)));
            }
            assert_eq!(g.produced().expect("counter"), 600);
        }
    }

    #[test]
    fn vxlan_generator_program_writes_each_flows_exact_frame() {
        egret_dataplane::xsk::sched::pin_current_thread(0).expect("pin");
        let spec = spec();
        let encap = VxlanSpec {
            outer_src_mac: GEN_MAC,
            outer_dst_mac: GW_IN_MAC,
            node: crate::topology::NODE_IP,
            next_hop: crate::topology::EGRESS_IP,
            port: crate::frame::TUNNEL_PORT,
        };
        let inner =
            FrameSpec { src_mac: crate::topology::NODE_GNV_MAC, dst_mac: crate::topology::NODE_GNV_MAC, ..spec };
        for flows in [FlowSet::fixed(1), FlowSet::fixed(50_000), FlowSet::fixed(50_000).with_train(8)] {
            let mut g = Generator::load_with(&inner, Some(&encap), &flows).expect("load gen");
            let stale: Vec<u8> = (0..crate::frame::VXLAN_FRAME_LEN as u32).map(|i| (i * 37 + 11) as u8).collect();
            for k in 0..600u64 {
                let out = g.rewrite_once(&stale).expect("run");
                let (ip, port) = flows.flow(flows.flow_of_frame(k));
                assert_eq!(out, wire_frame(&inner, Some(&encap), ip, port), "flows {} frame {k}", flows.flows);
                assert_eq!(checksums_ok(&out[crate::frame::VXLAN_OVERHEAD..]), Some((true, true)));
            }
            assert_eq!(g.produced().expect("counter"), 600);
        }
        // The plain program in the same object is unchanged by the other.
        let flows = FlowSet::fixed(50_000);
        let mut g = Generator::load(&spec, &flows).expect("load gen");
        let out = g.rewrite_once(&[0u8; FRAME_LEN]).expect("run");
        let (ip, port) = flows.flow(0);
        assert_eq!(out, spec.build(ip, port).to_vec());
    }

    #[test]
    fn sink_program_counts_checks_and_drops_only_benchmark_frames() {
        let mut sink = Sink::load(SINK_IP, SINK_PORT).expect("load sink");
        let run = |sink: &mut Sink, frame: &[u8]| -> u32 {
            let input = ProgramInput { data_in: Some(frame), ..Default::default() };
            sink.program().expect("prog").test_run(input).expect("run").return_value
        };
        let s = spec();
        let translated = s.build(crate::topology::EGRESS_IP, 40_000);
        let untranslated = s.build(Ipv4Addr::new(198, 18, 1, 3), 1024);
        let mut bad_udp = translated;
        bad_udp[UDP_OFF + 8] ^= 0xff;
        let mut bad_ip = untranslated;
        bad_ip[14 + 8] = 63; // TTL changed, checksum not
        let mut other_port = untranslated;
        other_port[UDP_OFF + 3] = 10;
        let mut arp = [0u8; FRAME_LEN];
        arp[12] = 0x08;
        arp[13] = 0x06;

        assert_eq!(run(&mut sink, &translated), XDP_DROP);
        assert_eq!(run(&mut sink, &untranslated), XDP_DROP);
        assert_eq!(run(&mut sink, &bad_udp), XDP_DROP);
        assert_eq!(run(&mut sink, &bad_ip), XDP_DROP);
        assert_eq!(run(&mut sink, &other_port), XDP_PASS);
        assert_eq!(run(&mut sink, &arp), XDP_PASS);
        assert_eq!(
            sink.counts().expect("counts"),
            SinkCounts {
                frames: 4,
                translated: 2,
                bad_ip_checksum: 1,
                bad_udp_checksum: 1,
                unchecked: 0,
                replied: 0,
                syns: 0
            }
        );
    }

    #[test]
    fn sink_answers_each_translated_flow_once_per_generation() {
        let mut sink = Sink::load(SINK_IP, SINK_PORT).expect("load sink");
        let run = |sink: &mut Sink, frame: &[u8]| -> (u32, Vec<u8>) {
            let mut out = vec![0u8; frame.len()];
            let input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), ..Default::default() };
            let o = sink.program().expect("prog").test_run(input).expect("run");
            (o.return_value, o.data.map(|d| d.to_vec()).unwrap_or_default())
        };
        let s = spec();
        let a = s.build(crate::topology::EGRESS_IP, 40_000);
        let b = s.build(crate::topology::EGRESS_IP, 40_001);
        let untranslated = s.build(Ipv4Addr::new(198, 18, 1, 3), 1024);
        let mut bad_udp = s.build(crate::topology::EGRESS_IP, 40_002);
        bad_udp[UDP_OFF + 8] ^= 0xff;
        // Off by default: counted and dropped.
        assert_eq!(run(&mut sink, &a).0, XDP_DROP);
        sink.set_reply_generation(1).expect("ctl");
        let (verdict, reply) = run(&mut sink, &a);
        assert_eq!(verdict, XDP_TX);
        // MACs, addresses and ports swapped, everything else (checksums) kept.
        let mut want = a;
        want.copy_within(6..12, 0);
        want[6..12].copy_from_slice(&a[0..6]);
        want[26..30].copy_from_slice(&a[30..34]);
        want[30..34].copy_from_slice(&a[26..30]);
        want[UDP_OFF..UDP_OFF + 2].copy_from_slice(&a[UDP_OFF + 2..UDP_OFF + 4]);
        want[UDP_OFF + 2..UDP_OFF + 4].copy_from_slice(&a[UDP_OFF..UDP_OFF + 2]);
        assert_eq!(reply, want.to_vec());
        assert_eq!(run(&mut sink, &a).0, XDP_DROP, "once per flow");
        assert_eq!(run(&mut sink, &b).0, XDP_TX, "another flow");
        assert_eq!(run(&mut sink, &untranslated).0, XDP_DROP, "untranslated frames are not answered");
        assert_eq!(run(&mut sink, &bad_udp).0, XDP_DROP, "bad checksums are not answered");
        sink.set_reply_generation(2).expect("ctl");
        assert_eq!(run(&mut sink, &a).0, XDP_TX, "again in a new generation");
        sink.set_reply_generation(0).expect("ctl");
        assert_eq!(run(&mut sink, &b).0, XDP_DROP);
        assert_eq!(sink.counts().expect("counts").replied, 3);
    }

    #[test]
    fn sink_counts_tcp_segments_and_answers_syns_with_a_syn_ack() {
        let mut sink = Sink::load(SINK_IP, SINK_PORT).expect("load sink");
        let run = |sink: &mut Sink, frame: &[u8]| -> (u32, Vec<u8>) {
            let mut out = vec![0u8; frame.len()];
            let input = ProgramInput { data_in: Some(frame), data_out: Some(&mut out), ..Default::default() };
            let o = sink.program().expect("prog").test_run(input).expect("run");
            (o.return_value, o.data.map(|d| d.to_vec()).unwrap_or_default())
        };
        let s = FrameSpec { proto: Proto::Tcp, ..spec() };
        let egress = crate::topology::EGRESS_IP;
        let data = s.build_segment(egress, 40_000, 5);
        let mut bad = s.build_segment(egress, 40_000, 6);
        bad[FRAME_LEN - 1] ^= 0x40;
        let untranslated = s.build_segment(Ipv4Addr::new(198, 18, 1, 3), 1024, 0);
        let syn = s.build_syn(egress, 40_000);
        assert_eq!(run(&mut sink, &data).0, XDP_DROP);
        assert_eq!(run(&mut sink, &bad).0, XDP_DROP);
        assert_eq!(run(&mut sink, &untranslated).0, XDP_DROP);
        assert_eq!(run(&mut sink, &syn).0, XDP_DROP, "no answer while replies are off");
        sink.set_reply_generation(7).expect("ctl");
        let (verdict, reply) = run(&mut sink, &syn);
        assert_eq!(verdict, XDP_TX);
        // The SYN-ACK, checked by an independent parser.
        assert_eq!(reply[0..6], syn[6..12]);
        assert_eq!(reply[6..12], syn[0..6]);
        let (_, rest) = etherparse::Ethernet2Header::from_slice(&reply).expect("ethernet");
        let (iph, rest) = etherparse::Ipv4Header::from_slice(rest).expect("ipv4");
        assert_eq!(iph.header_checksum, iph.calc_header_checksum());
        assert_eq!((iph.source, iph.destination, iph.total_len), (SINK_IP.octets(), egress.octets(), 40));
        let (tcph, _) = etherparse::TcpHeader::from_slice(rest).expect("tcp");
        assert!(tcph.syn && tcph.ack && !tcph.rst && !tcph.fin);
        assert_eq!((tcph.source_port, tcph.destination_port), (SINK_PORT, 40_000));
        assert_eq!(tcph.sequence_number, crate::frame::TCP_SINK_ISN);
        assert_eq!(tcph.acknowledgment_number, crate::frame::TCP_POD_ISN + 1);
        assert_eq!(tcph.window_size, 65_535);
        assert_eq!(tcph.checksum, tcph.calc_checksum_ipv4(&iph, &[]).expect("checksum"));
        assert_eq!(checksums_ok(&reply), Some((true, true)));
        // Untranslated SYNs and SYNs with a bad checksum get no answer.
        assert_eq!(run(&mut sink, &s.build_syn(Ipv4Addr::new(198, 18, 1, 3), 1024)).0, XDP_DROP);
        let mut bad_syn = syn;
        bad_syn[UDP_OFF + 4] ^= 1;
        assert_eq!(run(&mut sink, &bad_syn).0, XDP_DROP);
        let c = sink.counts().expect("counts");
        assert_eq!(
            (c.frames, c.translated, c.bad_udp_checksum, c.unchecked, c.syns, c.replied),
            (3, 2, 1, 0, 4, 1),
            "{c:?}"
        );
    }
}
