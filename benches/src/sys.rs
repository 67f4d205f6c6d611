//! The benchmark's raw system calls, and its only unsafe code: clock ticks,
//! CPU affinity of other threads, signal flags, an AF_PACKET sender
//! (`PACKET_QDISC_BYPASS` + `sendmmsg`) and a netlink socket. Every `unsafe`
//! block says why it is sound.
#![allow(unsafe_code)]

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// `USER_HZ`: the unit of /proc's tick counters.
pub fn user_hz() -> u64 {
    // SAFETY: sysconf takes an integer and touches no memory of ours.
    let v = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if v > 0 {
        v as u64
    } else {
        100
    }
}

/// Pin thread `tid` (any process) to `cpu`.
pub fn set_affinity(tid: u32, cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { zeroed() };
    // SAFETY: cpu < CPU_SETSIZE (checked), so the bit lies inside the set.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; the kernel only
    // reads it.
    let r = unsafe { libc::sched_setaffinity(tid as libc::pid_t, size_of::<libc::cpu_set_t>(), &set) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Async-signal-safe: one atomic store.
    STOP.store(true, Ordering::SeqCst);
}

/// Route SIGINT and SIGTERM to a flag that [`stop_requested`] reads, so the
/// benchmark can unwind and delete its namespaces.
pub fn install_stop_handler() -> io::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: sigaction is plain data; zeroed means no flags, empty mask.
        let mut act: libc::sigaction = unsafe { zeroed() };
        act.sa_sigaction = on_signal as *const () as libc::sighandler_t;
        // SAFETY: `act` is initialised; the handler only does an atomic
        // store; the old action is not wanted (null).
        let r = unsafe { libc::sigaction(sig, &act, std::ptr::null_mut()) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether SIGINT or SIGTERM arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// An AF_PACKET socket bound to one interface, sending whole Ethernet frames
/// straight to the driver (`PACKET_QDISC_BYPASS`), many per `sendmmsg`.
#[derive(Debug)]
pub struct PacketSender {
    fd: OwnedFd,
    iov: Vec<libc::iovec>,
    msgs: Vec<libc::mmsghdr>,
}

// SAFETY: the raw pointers in `iov`/`msgs` are scratch rewritten before every
// use and never dereferenced by us; the socket fd is thread-agnostic.
unsafe impl Send for PacketSender {}

impl PacketSender {
    /// Open and bind to `ifindex` in the calling thread's namespace, with
    /// room for `batch` frames per call (at most 1024, `UIO_MAXIOV`).
    pub fn open(ifindex: u32, batch: usize) -> io::Result<Self> {
        // Protocol 0: a send-only socket that receives nothing.
        // SAFETY: plain socket(2) call.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_ll is plain data.
        let mut sll: libc::sockaddr_ll = unsafe { zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_IP as u16).to_be();
        sll.sll_ifindex = ifindex as i32;
        // SAFETY: `sll` is a valid sockaddr_ll and its size is passed.
        let r = unsafe {
            libc::bind(fd.as_raw_fd(), (&sll as *const libc::sockaddr_ll).cast(), size_of::<libc::sockaddr_ll>() as u32)
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let one: libc::c_int = 1;
        // SAFETY: the option value is a c_int of the size passed.
        let r = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_QDISC_BYPASS,
                (&one as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as u32,
            )
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let batch = batch.clamp(1, 1024);
        // SAFETY: iovec and mmsghdr are plain data; null/zero is a valid
        // (unused) value, rewritten before each call.
        let iov = vec![unsafe { zeroed::<libc::iovec>() }; batch];
        // SAFETY: as above.
        let msgs = vec![unsafe { zeroed::<libc::mmsghdr>() }; batch];
        Ok(Self { fd, iov, msgs })
    }

    /// Send up to `batch` of `frames`; returns how many the kernel took (an
    /// error only when it took none).
    pub fn send<F: AsRef<[u8]>>(&mut self, frames: &[F]) -> io::Result<usize> {
        let n = frames.len().min(self.msgs.len());
        for ((iov, msg), frame) in self.iov.iter_mut().zip(self.msgs.iter_mut()).zip(frames) {
            let frame = frame.as_ref();
            *iov = libc::iovec { iov_base: frame.as_ptr() as *mut libc::c_void, iov_len: frame.len() };
            // SAFETY: msghdr is plain data; zeroed means no name, no control.
            let mut h: libc::msghdr = unsafe { zeroed() };
            h.msg_iov = iov;
            h.msg_iovlen = 1;
            *msg = libc::mmsghdr { msg_hdr: h, msg_len: 0 };
        }
        // SAFETY: msgs[..n] point at iov[..n], which point at `frames`; all
        // live for the call and the kernel only reads the frames.
        let r = unsafe { libc::sendmmsg(self.fd.as_raw_fd(), self.msgs.as_mut_ptr(), n as u32, 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(r as usize)
    }
}

/// A netlink socket of protocol `proto` (e.g. `NETLINK_GENERIC`) in the
/// calling thread's namespace.
#[derive(Debug)]
pub struct Netlink {
    fd: OwnedFd,
}

impl Netlink {
    /// Open and bind (kernel-assigned port id).
    pub fn open(proto: libc::c_int) -> io::Result<Self> {
        // SAFETY: plain socket(2) call.
        let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a new fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain data; zero pid lets the kernel assign.
        let mut sa: libc::sockaddr_nl = unsafe { zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        // SAFETY: `sa` is a valid sockaddr_nl and its size is passed.
        let r = unsafe {
            libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_nl).cast(), size_of::<libc::sockaddr_nl>() as u32)
        };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// Send one message to the kernel.
    pub fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: `msg` is a valid buffer of the length passed.
        let r = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Receive one datagram (one or more netlink messages) into `buf`.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: `buf` is a valid writable buffer of the length passed.
        let r = unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(r as usize)
    }
}

/// Send signal `sig` to process `pid`.
pub fn send_signal(pid: u32, sig: libc::c_int) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    if pid <= 0 {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: kill(2) takes two integers; pid > 0 names one process.
    if unsafe { libc::kill(pid, sig) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Set thread `tid`'s nice value (`setpriority(PRIO_PROCESS, tid)` acts on
/// one thread on Linux).
pub fn set_nice(tid: u32, nice: i32) -> io::Result<()> {
    // SAFETY: setpriority takes integers only.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid, nice) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Run thread `tid` `SCHED_FIFO` at `priority`.
pub fn set_fifo(tid: u32, priority: i32) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: priority };
    // SAFETY: `param` is a valid sched_param the kernel only reads.
    if unsafe { libc::sched_setscheduler(tid as libc::pid_t, libc::SCHED_FIFO, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's id.
pub fn gettid() -> u32 {
    // SAFETY: gettid has no arguments and cannot fail.
    unsafe { libc::gettid() as u32 }
}
