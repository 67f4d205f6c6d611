//! The lab's raw system calls: entering a network namespace on one thread,
//! raw Ethernet sockets (AF_PACKET) bound to one interface, a forced socket
//! receive buffer, and the open-files limit.
//!
//! This is the test crate's only `unsafe` code; every block says why it is
//! sound. Everything else in the lab goes through std, socket2 or `ip`.
#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Moves the *calling thread* into the network namespace `ns` (an open
/// `/run/netns/NAME`). Other threads keep theirs (setns(2) acts per thread);
/// sockets created afterwards belong to `ns` for their whole life.
pub fn enter_netns(ns: &File) -> io::Result<()> {
    // SAFETY: setns only reads the descriptor, which `ns` keeps open for the
    // duration of the call; CLONE_NEWNET asks for the network namespace only.
    let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

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
