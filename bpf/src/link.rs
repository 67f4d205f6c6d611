//! Attaching the XDP program through a bpf_link with an explicit mode.
//!
//! libbpf-rs's `attach_xdp` creates a link without flags, so the kernel picks
//! the mode. Egret wants to choose (native on real NICs and veth, generic as
//! a fallback), and `BPF_LINK_CREATE` takes the XDP mode flags in
//! `link_create.flags`, so this module calls libbpf's `bpf_link_create`
//! directly. A link detaches the program when its last fd closes, which is
//! also what happens when the owning process dies (unlike a netlink attach,
//! which outlives a crash: MACHINE-NOTES).
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

/// Creates an XDP bpf_link for `prog` on `ifindex` with `XDP_FLAGS_*` `flags`.
pub(crate) fn create_xdp_link(prog: BorrowedFd<'_>, ifindex: u32, flags: u32) -> io::Result<OwnedFd> {
    let target = i32::try_from(ifindex).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let opts = libbpf_sys::bpf_link_create_opts {
        sz: std::mem::size_of::<libbpf_sys::bpf_link_create_opts>() as libbpf_sys::size_t,
        flags,
        ..Default::default()
    };
    // SAFETY: `prog` is a live program fd borrowed for the call; `opts` is a
    // fully initialised bpf_link_create_opts whose `sz` is its own size, and
    // libbpf only reads it during the call. No pointer is retained.
    let fd = unsafe { libbpf_sys::bpf_link_create(prog.as_raw_fd(), target, libbpf_sys::BPF_XDP, &opts) };
    if fd < 0 {
        // libbpf returns -errno.
        return Err(io::Error::from_raw_os_error(-fd));
    }
    // SAFETY: `fd` is a new file descriptor returned by BPF_LINK_CREATE that
    // nothing else owns; OwnedFd takes sole ownership and closes it on drop.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
