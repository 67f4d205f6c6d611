//! The lab's raw system calls: raw Ethernet sockets (AF_PACKET) bound to
//! one interface and the kernel's receive time of their frames, a forced
//! socket receive buffer, the open-files limit, and a
//! pass-everything XDP program for the routers' ports facing the gateway.
//! (Entering a network namespace is `egret_dataplane::netns`'s.)
//!
//! This is the test crate's only `unsafe` code; every block says why it is
//! sound. Everything else in the lab goes through std, socket2 or `ip`.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `SIOCGSTAMPNS` (include/uapi/linux/sockios.h; on 64-bit targets the same
/// number as `SIOCGSTAMPNS_OLD`, whose timespec has a 64-bit `time_t`): the
/// receive time of the last frame read from a socket.
#[cfg(target_pointer_width = "64")]
const SIOCGSTAMPNS: libc::Ioctl = 0x8907;

/// Raises the soft limit on open files to `want` (at most the hard limit);
/// returns the soft limit now in force.
pub fn raise_nofile_limit(want: u64) -> io::Result<u64> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit for the kernel to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let target = want.min(lim.rlim_max);
    if lim.rlim_cur >= target {
        return Ok(lim.rlim_cur);
    }
    lim.rlim_cur = target;
    // SAFETY: `lim` is a valid rlimit read above, with a soft limit no
    // larger than its hard limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(target)
}

fn setsockopt_int(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: the option value is a live c_int and the length passed is its
    // size; the descriptor is owned and open.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Sets a socket's receive buffer with SO_RCVBUFFORCE (CAP_NET_ADMIN), past
/// `net.core.rmem_max`, so a burst of replies is not dropped by the socket.
pub fn force_recv_buffer(fd: &OwnedFd, bytes: usize) -> io::Result<()> {
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, bytes.min(i32::MAX as usize) as libc::c_int)
}

const ETH_P_ALL: u16 = 0x0003;

/// A raw Ethernet socket (AF_PACKET, SOCK_RAW, every protocol) bound to one
/// interface of the namespace it was opened in. It receives only frames
/// arriving on that interface (PACKET_IGNORE_OUTGOING), whole, from the
/// Ethernet header on; it sends frames exactly as given.
#[derive(Debug)]
pub struct PacketSocket {
    fd: OwnedFd,
    ifindex: u32,
}

impl PacketSocket {
    /// Opens the socket on interface `ifindex` of the calling thread's
    /// network namespace.
    pub fn bind(ifindex: u32) -> io::Result<Self> {
        let proto = ETH_P_ALL.to_be();
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw =
            unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::c_int::from(proto)) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        setsockopt_int(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, 1)?;
        // SAFETY: sockaddr_ll is plain old data; all-zero is a valid value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as libc::c_int;
        // SAFETY: `sll` is a valid sockaddr_ll and the length is its size.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd, ifindex })
    }

    /// The interface the socket is bound to.
    pub fn ifindex(&self) -> u32 {
        self.ifindex
    }

    /// Sets the receive buffer (see [`force_recv_buffer`]).
    pub fn set_recv_buffer(&self, bytes: usize) -> io::Result<()> {
        force_recv_buffer(&self.fd, bytes)
    }

    /// Has the kernel stamp each frame with its receive time, for
    /// [`PacketSocket::last_stamp`]: the first `SIOCGSTAMPNS` turns the
    /// stamps on (socket(7); it fails here, nothing having been read yet).
    /// Not `SO_TIMESTAMPNS`: with it set the ioctl no longer answers, the
    /// stamp going to a control message instead.
    pub fn enable_timestamps(&self) -> io::Result<()> {
        match self.last_stamp() {
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e),
            Ok(_) => Ok(()),
        }
    }

    /// When the kernel received the frame [`PacketSocket::recv`] returned
    /// last (`SIOCGSTAMPNS`): the wire's time, not the reader's, which a
    /// busy machine can delay by seconds.
    pub fn last_stamp(&self) -> io::Result<SystemTime> {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: SIOCGSTAMPNS writes one struct timespec to the pointer,
        // which is valid and writable for it.
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), SIOCGSTAMPNS, &mut ts as *mut libc::timespec) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        let (secs, nanos) = (u64::try_from(ts.tv_sec), u32::try_from(ts.tv_nsec));
        match (secs, nanos) {
            (Ok(s), Ok(n)) => Ok(UNIX_EPOCH + Duration::new(s, n)),
            _ => Err(io::Error::new(io::ErrorKind::InvalidData, "a negative receive timestamp")),
        }
    }

    /// Sends one frame; returns the bytes sent.
    pub fn send(&self, frame: &[u8]) -> io::Result<usize> {
        // SAFETY: the buffer is valid for `frame.len()` bytes for the call;
        // the socket is bound, so no destination address is needed.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// Receives one frame into `buf`, waiting at most `timeout`. `Ok(None)`
    /// when nothing arrived in time. A frame longer than `buf` is cut.
    pub fn recv(&self, buf: &mut [u8], timeout: Duration) -> io::Result<Option<usize>> {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
        // SAFETY: one valid pollfd, count 1.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted { Ok(None) } else { Err(e) };
        }
        if rc == 0 {
            return Ok(None);
        }
        // SAFETY: the buffer is valid and writable for `buf.len()` bytes.
        let n = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::WouldBlock { Ok(None) } else { Err(e) };
        }
        Ok(Some(n as usize))
    }
}

/// Whether the process runs with effective uid 0 (the lab needs root for
/// namespaces, XDP and raw sockets). Read from `/proc/self`, which is owned
/// by the effective uid.
pub fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false)
}

/// `bpf(2)` commands and constants used here (include/uapi/linux/bpf.h).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_XDP: u32 = 6;
/// `r0 = XDP_PASS (2); exit`, as two `struct bpf_insn` (code, regs, off, imm;
/// little-endian): BPF_ALU64 | BPF_MOV | BPF_K into r0, then BPF_JMP | BPF_EXIT.
const XDP_PASS_PROGRAM: [u8; 16] = [0xb7, 0x00, 0, 0, 2, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0];
/// rtnetlink (include/uapi/linux/if_link.h, rtnetlink.h, netlink.h).
const RTM_SETLINK: u16 = 19;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST_ACK: u16 = 0x1 | 0x4;
const IFLA_XDP: u16 = 43;
const NLA_F_NESTED: u16 = 0x8000;
const IFLA_XDP_FD: u16 = 1;
const IFLA_XDP_FLAGS: u16 = 3;
const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// Attaches, in driver mode, an XDP program that passes every frame to
/// interface `ifindex` of the calling thread's namespace, through netlink,
/// so it stays with the interface (and goes with it). A veth delivers the
/// frames its peer sends with XDP_TX only when it has an XDP program itself
/// (drivers/net/veth.c, veth_xdp_flush), so the lab gives one to the
/// routers' ports facing an XDP gateway.
pub fn attach_xdp_pass(ifindex: u32) -> io::Result<()> {
    let license = c"GPL";
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
    attr[4..8].copy_from_slice(&2u32.to_ne_bytes());
    attr[8..16].copy_from_slice(&(XDP_PASS_PROGRAM.as_ptr() as u64).to_ne_bytes());
    attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
    attr[48..55].copy_from_slice(b"lab_xdp");
    // SAFETY: `attr` is a zeroed bpf_attr of the size passed, whose pointers
    // (the instructions, the licence) stay alive for the call; the kernel
    // only reads them.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_ptr(), attr.len() as u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel returned a new program descriptor that nothing else owns.
    let prog = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };

    // struct nlmsghdr, struct ifinfomsg, IFLA_XDP { IFLA_XDP_FD, IFLA_XDP_FLAGS }.
    let mut msg = Vec::with_capacity(52);
    msg.extend_from_slice(&0u32.to_ne_bytes()); // length, written below
    msg.extend_from_slice(&RTM_SETLINK.to_ne_bytes());
    msg.extend_from_slice(&NLM_F_REQUEST_ACK.to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
    msg.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
    msg.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    msg.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // flags
    msg.extend_from_slice(&0u32.to_ne_bytes()); // change
    msg.extend_from_slice(&20u16.to_ne_bytes());
    msg.extend_from_slice(&(IFLA_XDP | NLA_F_NESTED).to_ne_bytes());
    msg.extend_from_slice(&8u16.to_ne_bytes());
    msg.extend_from_slice(&IFLA_XDP_FD.to_ne_bytes());
    msg.extend_from_slice(&prog.as_raw_fd().to_ne_bytes());
    msg.extend_from_slice(&8u16.to_ne_bytes());
    msg.extend_from_slice(&IFLA_XDP_FLAGS.to_ne_bytes());
    msg.extend_from_slice(&XDP_FLAGS_DRV_MODE.to_ne_bytes());
    let len = msg.len() as u32;
    msg[0..4].copy_from_slice(&len.to_ne_bytes());

    // SAFETY: plain socket creation; the result is checked.
    let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, libc::NETLINK_ROUTE) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a new descriptor that nothing else owns.
    let sock = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: `msg` is live for the call and its length is passed; the
    // socket is open. A netlink socket sends to the kernel by default.
    let n = unsafe { libc::send(sock.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut buf = [0u8; 1024];
    // SAFETY: `buf` is writable for its whole length, which is passed.
    let n = unsafe { libc::recv(sock.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // The acknowledgement: NLMSG_ERROR with error 0, or -errno.
    let n = n as usize;
    if n >= 20 && u16::from_ne_bytes([buf[4], buf[5]]) == NLMSG_ERROR {
        let err = i32::from_ne_bytes([buf[16], buf[17], buf[18], buf[19]]);
        return if err == 0 { Ok(()) } else { Err(io::Error::from_raw_os_error(-err)) };
    }
    Err(io::Error::new(io::ErrorKind::InvalidData, format!("unexpected netlink answer ({n} bytes)")))
}
