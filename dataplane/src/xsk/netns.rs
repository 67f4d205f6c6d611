//! Moving the calling thread into a named network namespace.
//!
//! Interface indexes are per namespace, so a socket bound to an interface of
//! another namespace must be created by a thread inside it (the lab and the
//! namespace tests run gateways this way). `setns(2)` affects only the
//! calling thread.

use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;

/// Enter the namespace `ip netns` created as `name` (`/run/netns/<name>`).
pub fn enter_named(name: &str) -> io::Result<()> {
    enter_path(&Path::new("/run/netns").join(name))
}

/// Enter the network namespace whose handle is the file at `path`.
pub fn enter_path(path: &Path) -> io::Result<()> {
    let f = std::fs::File::open(path)?;
    // SAFETY: `f` is an open namespace file for the duration of the call;
    // setns takes no pointers.
    let ret = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The index of interface `name` in the calling thread's namespace.
pub fn ifindex(name: &str) -> io::Result<u32> {
    let c = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated string for the call.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(idx)
}
