//! Named network namespaces (`ip netns`, `/run/netns/NAME`): the workspace's
//! one `setns(2)` (and `unshare(2)`) wrapper and, with feature `fixtures`, its one guard that
//! creates namespaces and deletes them on drop.
//!
//! Interface indexes are per namespace, so a socket bound to an interface of
//! another namespace must be created by a thread inside it (the lab, the
//! benchmarks and the namespace tests run gateways this way). `setns(2)`
//! affects only the calling thread; sockets it opens afterwards stay in the
//! namespace for their whole life.
//!
//! - [`enter`], [`enter_path`], [`enter_named`], [`enter_new`]: move the
//!   calling thread;
//! - [`run_in`]: run a closure on a scoped thread inside a namespace;
//! - [`ifindex`]: an interface's index in the calling thread's namespace;
//! - `NetnsGuard` (feature `fixtures`): namespaces created for a test or
//!   a benchmark, deleted (after ending the processes inside) when it drops,
//!   also when the test panics; `list`, `pids`, `kill_processes` and
//!   `delete` are what it is built on (the lab's `NetNs` uses them too).

use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};

/// Where `ip netns` keeps the handles of named namespaces.
pub const NETNS_RUN_DIR: &str = "/run/netns";

/// The handle of the namespace `ip netns` created as `name`.
pub fn path(name: &str) -> PathBuf {
    Path::new(NETNS_RUN_DIR).join(name)
}

/// Moves the calling thread into the network namespace `ns` (an open
/// namespace file, e.g. `/run/netns/NAME` or `/proc/PID/ns/net`).
#[allow(unsafe_code)]
pub fn enter(ns: impl AsFd) -> io::Result<()> {
    // SAFETY: the descriptor is borrowed from an open file for the duration
    // of the call; setns takes no pointers. CLONE_NEWNET asks for the network
    // namespace only.
    let ret = unsafe { libc::setns(ns.as_fd().as_raw_fd(), libc::CLONE_NEWNET) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Enters the network namespace whose handle is the file at `path`.
pub fn enter_path(path: &Path) -> io::Result<()> {
    enter(std::fs::File::open(path)?)
}

/// Moves the calling thread into a new network namespace of its own
/// (`unshare(CLONE_NEWNET)`): unnamed, so nothing is left to delete; it
/// ends with the last thread or descriptor in it. Commands the thread
/// starts afterwards (`ip link add ...`) run inside it.
#[allow(unsafe_code)]
pub fn enter_new() -> io::Result<()> {
    // SAFETY: unshare takes no pointers; CLONE_NEWNET affects the calling
    // thread's network namespace only.
    let ret = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Enters the namespace `ip netns` created as `name` (`/run/netns/<name>`).
pub fn enter_named(name: &str) -> io::Result<()> {
    enter_path(&self::path(name))
}

/// Runs `f` on a scoped thread inside namespace `name` and waits for it; the
/// calling thread's namespace is untouched. The namespace is opened on the
/// calling thread, so a missing one is an error before any thread starts. A
/// panic in `f` is resumed on the calling thread.
pub fn run_in<T: Send>(name: &str, f: impl FnOnce() -> T + Send) -> io::Result<T> {
    let file = std::fs::File::open(self::path(name))?;
    std::thread::scope(|s| {
        let h = s.spawn(move || {
            enter(&file)?;
            Ok(f())
        });
        match h.join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// The index of interface `name` in the calling thread's namespace.
#[allow(unsafe_code)]
pub fn ifindex(name: &str) -> io::Result<u32> {
    let c = std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `c` is a valid NUL-terminated string for the call.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(idx)
}

#[cfg(feature = "fixtures")]
pub use guard::{delete, kill_processes, list, pids, NetnsBuilder, NetnsGuard};

#[cfg(feature = "fixtures")]
mod guard {
    use std::io;
    use std::path::Path;
    use std::process::{Command, Stdio};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    /// Runs `ip ARGS` with stdin closed; its stdout, or an error naming the
    /// command and carrying its stderr. A missing `ip` is
    /// [`io::ErrorKind::NotFound`].
    fn ip(args: &[&str]) -> io::Result<String> {
        let line = format!("ip {}", args.join(" "));
        let out = Command::new("ip")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| io::Error::new(e.kind(), format!("`{line}`: {e}")))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(io::Error::other(format!(
                "`{line}` failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }

    /// The names of every network namespace `ip netns` knows (none when
    /// `ip` fails).
    pub fn list() -> Vec<String> {
        ip(&["netns", "list"])
            .map(|s| s.lines().filter_map(|l| l.split_whitespace().next()).map(str::to_owned).collect())
            .unwrap_or_default()
    }

    /// The ids of the processes (other than this one) whose network
    /// namespace is `name` (`ip netns pids`; none when it fails).
    pub fn pids(name: &str) -> Vec<u32> {
        let me = std::process::id();
        ip(&["netns", "pids", name])
            .map(|s| s.split_whitespace().filter_map(|p| p.parse().ok()).filter(|&p| p != me).collect())
            .unwrap_or_default()
    }

    /// Ends every process inside namespace `name` (daemons a test or the lab
    /// started there): SIGTERM, then SIGKILL after a second.
    pub fn kill_processes(name: &str) {
        for sig in ["-TERM", "-KILL"] {
            let pids = pids(name);
            if pids.is_empty() {
                return;
            }
            for pid in &pids {
                let _ = Command::new("kill").args([sig, &pid.to_string()]).stderr(Stdio::null()).status();
            }
            for _ in 0..50 {
                if self::pids(name).is_empty() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Ends the processes inside namespace `name`, then deletes it (its
    /// interfaces go with it).
    pub fn delete(name: &str) -> io::Result<()> {
        kill_processes(name);
        ip(&["netns", "del", name]).map(drop)
    }

    /// Namespaces created together, deleted together when the guard drops
    /// (after ending the processes inside each), also when a test panics.
    /// A failed deletion is reported on stderr.
    #[derive(Debug)]
    pub struct NetnsGuard {
        names: Vec<String>,
    }

    /// How a [`NetnsGuard`]'s namespaces are named and set up; made by
    /// [`NetnsGuard::unique`] or [`NetnsGuard::named`].
    #[derive(Debug)]
    #[must_use = "nothing is created until `create`"]
    pub struct NetnsBuilder {
        names: Vec<String>,
        /// `Some(prefix)` for [`NetnsGuard::unique`]: stale namespaces of
        /// dead processes with that prefix are removed first, and a
        /// leftover of the same name is replaced.
        unique_prefix: Option<String>,
        lo_up: bool,
        sysctls: Vec<(String, String)>,
    }

    impl NetnsGuard {
        /// Namespaces named `<prefix><pid>-<n>-<member>` (`<prefix><pid>-<n>`
        /// for an empty member): `pid` is this process's id and `n` counts
        /// the guards this process made, so concurrent tests never share a
        /// name. `prefix` must not end with a digit.
        ///
        /// Before creating them, [`NetnsBuilder::create`] deletes every
        /// namespace named `<prefix><digits>...` whose process `<digits>` is
        /// gone (left by a run killed before its guards dropped), and a
        /// namespace of the same name (left by a dead process that had this
        /// id).
        pub fn unique(prefix: &str, members: &[&str]) -> NetnsBuilder {
            static SEQ: AtomicU32 = AtomicU32::new(0);
            debug_assert!(!prefix.ends_with(|c: char| c.is_ascii_digit()), "prefix {prefix:?} ends with a digit");
            let base = format!("{prefix}{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
            let names =
                members.iter().map(|m| if m.is_empty() { base.clone() } else { format!("{base}-{m}") }).collect();
            NetnsBuilder::new(names, Some(prefix.to_owned()))
        }

        /// Namespaces with exactly these names; creating one that exists
        /// fails (and deletes those created before it).
        pub fn named(names: &[&str]) -> NetnsBuilder {
            NetnsBuilder::new(names.iter().map(|n| (*n).to_owned()).collect(), None)
        }

        /// The namespaces' names, in the order given.
        pub fn names(&self) -> &[String] {
            &self.names
        }

        /// The name of namespace `i` (in the order given).
        pub fn name(&self, i: usize) -> &str {
            &self.names[i]
        }

        /// Stops owning the namespaces: dropping the guard leaves them in
        /// place. Returns their names.
        pub fn disown(mut self) -> Vec<String> {
            std::mem::take(&mut self.names)
        }
    }

    impl Drop for NetnsGuard {
        fn drop(&mut self) {
            for name in &self.names {
                if let Err(e) = delete(name) {
                    eprintln!("warning: could not delete network namespace {name}: {e}");
                }
            }
        }
    }

    impl NetnsBuilder {
        fn new(names: Vec<String>, unique_prefix: Option<String>) -> Self {
            Self { names, unique_prefix, lo_up: false, sysctls: Vec::new() }
        }

        /// Brings each namespace's loopback up.
        pub fn lo_up(mut self) -> Self {
            self.lo_up = true;
            self
        }

        /// Sets `key` to `value` in each namespace (`net.*` sysctls are per
        /// namespace), with `ip netns exec NAME sysctl -qw KEY=VALUE`, in
        /// the order given, after the loopback.
        pub fn sysctl(mut self, key: &str, value: &str) -> Self {
            self.sysctls.push((key.to_owned(), value.to_owned()));
            self
        }

        /// Creates the namespaces and sets each up. On an error, the ones
        /// created so far are deleted.
        pub fn create(self) -> io::Result<NetnsGuard> {
            if let Some(prefix) = &self.unique_prefix {
                remove_stale(prefix);
            }
            let mut guard = NetnsGuard { names: Vec::with_capacity(self.names.len()) };
            for name in self.names {
                if self.unique_prefix.is_some() && super::path(&name).exists() {
                    let _ = delete(&name);
                }
                ip(&["netns", "add", &name])?;
                guard.names.push(name.clone());
                if self.lo_up {
                    ip(&["-n", &name, "link", "set", "lo", "up"])?;
                }
                for (key, value) in &self.sysctls {
                    ip(&["netns", "exec", &name, "sysctl", "-qw", &format!("{key}={value}")])?;
                }
            }
            Ok(guard)
        }
    }

    /// Deletes the namespaces named `<prefix><pid>...` whose process `pid`
    /// no longer exists.
    fn remove_stale(prefix: &str) {
        for name in list() {
            let Some(rest) = name.strip_prefix(prefix) else { continue };
            let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
            if !pid.is_empty() && !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = delete(&name);
            }
        }
    }
}
