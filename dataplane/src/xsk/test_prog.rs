//! A minimal XDP program that steers every frame to the AF_XDP socket of its
//! RX queue, loaded with raw `bpf(2)` calls: test and lab support, so the
//! dataplane crate needs no libbpf. The product's steering program is
//! `egret-bpf`'s.
//!
//! The program is six instructions:
//!
//! ```text
//! r2 = *(u32 *)(r1 + 16)        ; ctx->rx_queue_index
//! r1 = map_fd(xsks) ll          ; two slots (BPF_LD | BPF_DW | BPF_IMM)
//! r3 = XDP_PASS                 ; fallback when the slot is empty
//! call bpf_redirect_map         ; helper #51
//! exit
//! ```
//!
//! It is attached through a bpf_link (`BPF_LINK_CREATE`), so the kernel
//! detaches it when the last fd goes away, even if the process dies.

use std::io;
use std::mem::size_of;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use super::XskError;

// bpf(2) commands (include/uapi/linux/bpf.h).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;

const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
const BPF_XDP: u32 = 37;
const BPF_FUNC_REDIRECT_MAP: i32 = 51;
const BPF_PSEUDO_MAP_FD: u8 = 1;
const XDP_PASS: i32 = 2;
/// `offsetof(struct xdp_md, rx_queue_index)`.
const XDP_MD_RX_QUEUE_INDEX: i16 = 16;

/// `XDP_FLAGS_*` attach modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XdpMode {
    /// Generic (skb) XDP: works on any device.
    Generic,
    /// Native (driver) XDP: veth and real NICs.
    Driver,
}

impl XdpMode {
    fn flags(self) -> u32 {
        match self {
            XdpMode::Generic => 1 << 1,
            XdpMode::Driver => 1 << 2,
        }
    }
}

#[repr(C)]
#[derive(Default)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
}

#[repr(C)]
#[derive(Default)]
struct MapUpdateAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// `struct bpf_insn`: opcode, dst (low nibble) and src (high nibble)
/// registers, offset, immediate.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const _: () = assert!(size_of::<Insn>() == 8);

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn { code, regs: dst | (src << 4), off, imm }
}

fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<RawFd> {
    // SAFETY: `attr` is a valid, exclusively borrowed bpf_attr variant of
    // the size passed; any pointers inside it point to live buffers owned by
    // the caller for the duration of the call.
    let ret = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>() as u32) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret as RawFd)
}

fn owned(fd: RawFd) -> OwnedFd {
    // SAFETY: `fd` was just returned by bpf(2) as a new descriptor that
    // nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// The program, its XSKMAP and the link attaching it to one interface.
#[derive(Debug)]
pub struct XskRedirectProg {
    // Link first: dropping it detaches the program.
    link: OwnedFd,
    prog: OwnedFd,
    map: OwnedFd,
    ifindex: u32,
}

impl XskRedirectProg {
    /// Create an XSKMAP with `queues` slots, load the program and attach it to
    /// `ifindex` in `mode`.
    pub fn attach(ifindex: u32, queues: u32, mode: XdpMode) -> Result<Self, XskError> {
        let err = |op: &'static str| move |source: io::Error| XskError::Bpf { op, ifindex, source };
        let mut mc = MapCreateAttr {
            map_type: BPF_MAP_TYPE_XSKMAP,
            key_size: 4,
            value_size: 4,
            max_entries: queues.max(1),
            ..Default::default()
        };
        mc.map_name[..4].copy_from_slice(b"xsks");
        let map = owned(bpf(BPF_MAP_CREATE, &mut mc).map_err(err("BPF_MAP_CREATE xskmap"))?);

        let prog_insns = [
            insn(0x61, 2, 1, XDP_MD_RX_QUEUE_INDEX, 0), // BPF_LDX | BPF_MEM | BPF_W
            insn(0x18, 1, BPF_PSEUDO_MAP_FD, 0, map.as_raw_fd()),
            insn(0x00, 0, 0, 0, 0),
            insn(0xb7, 3, 0, 0, XDP_PASS), // BPF_ALU64 | BPF_MOV | BPF_K
            insn(0x85, 0, 0, 0, BPF_FUNC_REDIRECT_MAP),
            insn(0x95, 0, 0, 0, 0), // exit
        ];
        let license = b"Dual MIT/GPL\0";
        let mut log = vec![0u8; 4096];
        let mut pl = ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_XDP,
            insn_cnt: prog_insns.len() as u32,
            insns: prog_insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            log_level: 1,
            log_size: log.len() as u32,
            log_buf: log.as_mut_ptr() as u64,
            expected_attach_type: BPF_XDP,
            ..Default::default()
        };
        pl.prog_name[..9].copy_from_slice(b"xsk_steer");
        let prog = match bpf(BPF_PROG_LOAD, &mut pl) {
            Ok(fd) => owned(fd),
            Err(source) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let log = String::from_utf8_lossy(&log[..end]).into_owned();
                return Err(XskError::ProgLoad { log, source });
            }
        };

        let mut lc = LinkCreateAttr {
            prog_fd: prog.as_raw_fd() as u32,
            target_ifindex: ifindex,
            attach_type: BPF_XDP,
            flags: mode.flags(),
        };
        let link = owned(bpf(BPF_LINK_CREATE, &mut lc).map_err(err("BPF_LINK_CREATE xdp"))?);
        Ok(Self { link, prog, map, ifindex })
    }

    /// Steer `queue`'s frames to the socket `xsk_fd`.
    pub fn insert(&self, queue: u32, xsk_fd: RawFd) -> Result<(), XskError> {
        let value = xsk_fd as u32;
        let mut up = MapUpdateAttr {
            map_fd: self.map.as_raw_fd() as u32,
            key: &queue as *const u32 as u64,
            value: &value as *const u32 as u64,
            ..Default::default()
        };
        bpf(BPF_MAP_UPDATE_ELEM, &mut up).map(drop).map_err(|source| XskError::Bpf {
            op: "BPF_MAP_UPDATE_ELEM xskmap",
            ifindex: self.ifindex,
            source,
        })
    }

    /// The XSKMAP's fd.
    pub fn map_fd(&self) -> RawFd {
        self.map.as_raw_fd()
    }

    /// The bpf_link's fd (dropping `self` closes it and detaches).
    pub fn link_fd(&self) -> RawFd {
        self.link.as_raw_fd()
    }

    /// The program's fd.
    pub fn prog_fd(&self) -> RawFd {
        self.prog.as_raw_fd()
    }
}
