//! How many shadow sessions a standby may keep (issue 28 §3): a quarter of
//! the process's cgroup memory limit (cgroup v2 `memory.max`, or v1
//! `memory.limit_in_bytes`, as a container's `resources.limits.memory`
//! sets it) at about [`BYTES_PER_SHADOW`] each, never more than
//! [`MAX_SHADOW_SESSIONS`].
//!
//! Before, the bound was a constant 4 M records: about 1.2-1.4 GiB against
//! the chart's 1 GiB limit, so a standby receiving large copies was killed
//! by the kernel's OOM killer before it refused anything. A refused record
//! is counted (`shadow_records_refused` in `egret status`) and its flow is
//! not kept on a take-over; an OOM kill loses the gateway.

use std::path::{Path, PathBuf};

/// The most shadow sessions a standby keeps with no memory limit.
pub const MAX_SHADOW_SESSIONS: usize = 4 << 20;
/// What one shadow session costs: measured 300 bytes for the map alone
/// and about 360 from a full copy's peak RSS (docs/benchmarks.md, "Memory
/// per standby session", "Receiving a copy in place"), rounded up.
pub const BYTES_PER_SHADOW: u64 = 400;
/// The share of the memory limit shadows may take: the rest is the data
/// plane's tables, the frames, the copies being sent, the runtime.
pub const SHARE_DIVISOR: u64 = 4;

/// The bound for a memory limit of `limit` bytes (None: no limit).
pub fn shadow_bound(limit: Option<u64>) -> usize {
    match limit {
        None => MAX_SHADOW_SESSIONS,
        Some(l) => {
            let n = l / SHARE_DIVISOR / BYTES_PER_SHADOW;
            usize::try_from(n).unwrap_or(usize::MAX).min(MAX_SHADOW_SESSIONS)
        }
    }
}

/// Limits at or above this mean none (cgroup v1 writes 2^63 rounded down
/// to a page for "no limit").
const NO_LIMIT: u64 = 1 << 60;

/// A `memory.max` or `memory.limit_in_bytes` file's content: bytes, or None
/// for `max`, v1's huge "no limit" value, or anything unreadable.
pub fn parse_memory_max(text: &str) -> Option<u64> {
    text.trim().parse().ok().filter(|v| *v < NO_LIMIT)
}

/// The files that may hold this process's limit, most specific first, from
/// `/proc/self/cgroup` (`cgroup_file`) under `root` (`/sys/fs/cgroup`):
/// its v2 cgroup's `memory.max`, its v1 memory cgroup's
/// `memory.limit_in_bytes`, then the roots' (a container sees its own
/// cgroup as the root).
fn limit_files(cgroup_file: &str, root: &Path) -> Vec<PathBuf> {
    let rel = |p: &str| p.trim().trim_start_matches('/').to_string();
    let mut out = Vec::new();
    for line in cgroup_file.lines() {
        if let Some(p) = line.strip_prefix("0::") {
            out.push(root.join(rel(p)).join("memory.max"));
        } else if let Some((_, rest)) = line.split_once(':') {
            if let Some((controllers, p)) = rest.split_once(':') {
                if controllers.split(',').any(|c| c == "memory") {
                    out.push(root.join("memory").join(rel(p)).join("memory.limit_in_bytes"));
                }
            }
        }
    }
    out.push(root.join("memory.max"));
    out.push(root.join("memory").join("memory.limit_in_bytes"));
    out
}

/// This process's memory limit (None: none found).
pub fn memory_limit() -> Option<u64> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    limit_files(&cgroup, Path::new("/sys/fs/cgroup"))
        .into_iter()
        .find_map(|f| std::fs::read_to_string(f).ok())
        .and_then(|t| parse_memory_max(&t))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_follows_the_limit() {
        assert_eq!(shadow_bound(None), MAX_SHADOW_SESSIONS);
        // The chart's 1 GiB: 671,088 records (about 256 MiB), not 4 M.
        assert_eq!(shadow_bound(Some(1 << 30)), 671_088);
        assert_eq!(shadow_bound(Some(256 << 20)), 167_772);
        assert_eq!(shadow_bound(Some(64 << 30)), MAX_SHADOW_SESSIONS, "capped");
        assert_eq!(shadow_bound(Some(0)), 0);
    }

    #[test]
    fn memory_max_and_the_own_cgroup_are_read() {
        assert_eq!(parse_memory_max("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max("9223372036854771712\n"), None, "v1's no limit");
        assert_eq!(parse_memory_max(""), None);
        let root = Path::new("/sys/fs/cgroup");
        let files = limit_files("0::/system.slice/egret.service\n", root);
        assert_eq!(files[0], PathBuf::from("/sys/fs/cgroup/system.slice/egret.service/memory.max"));
        let files = limit_files("4:memory:/kubepods/pod1/c1\n3:cpuset:/\n0::/\n", root);
        assert_eq!(files[0], PathBuf::from("/sys/fs/cgroup/memory/kubepods/pod1/c1/memory.limit_in_bytes"));
        assert_eq!(files[1], PathBuf::from("/sys/fs/cgroup/memory.max"));
    }

    /// The child end of `a_real_memory_limit_bounds_the_shadows`: prints
    /// what it reads inside the cgroup the parent put it in.
    #[test]
    fn memory_limit_child() {
        if std::env::var("EGRET_MEMORY_CHILD").is_err() {
            return;
        }
        println!("LIMIT {:?} BOUND {}", memory_limit(), shadow_bound(memory_limit()));
    }

    /// Issue 28 §3 under a real limit: a process in a memory cgroup limited
    /// to 256 MiB (v1 here; v2 where mounted so) reads its limit and keeps
    /// at most 167,772 shadow sessions. Skipped without root or a writable
    /// memory hierarchy.
    #[test]
    fn a_real_memory_limit_bounds_the_shadows() {
        use std::process::Command;
        let v1 = Path::new("/sys/fs/cgroup/memory");
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let dir = if v1.join("memory.limit_in_bytes").exists() {
            v1.join(format!("egret-shadow-test-{}", std::process::id()))
        } else if v2.exists() {
            PathBuf::from(format!("/sys/fs/cgroup/egret-shadow-test-{}", std::process::id()))
        } else {
            crate::test_support::skip("a_real_memory_limit_bounds_the_shadows", "no memory cgroup hierarchy");
            return;
        };
        if let Err(e) = std::fs::create_dir(&dir) {
            let why = format!("cannot create {} ({e}; not root?)", dir.display());
            crate::test_support::skip("a_real_memory_limit_bounds_the_shadows", &why);
            return;
        }
        struct Rm(PathBuf);
        impl Drop for Rm {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir(&self.0);
            }
        }
        let _rm = Rm(dir.clone());
        let file = if dir.starts_with(v1) { "memory.limit_in_bytes" } else { "memory.max" };
        std::fs::write(dir.join(file), (256u64 << 20).to_string()).expect("set the limit");
        let procs = dir.join("cgroup.procs");
        // The child joins the cgroup before it runs the test (sh writes its
        // own pid, then execs).
        let exe = std::env::current_exe().unwrap();
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {} && exec {} --exact ha::memory::tests::memory_limit_child --nocapture --test-threads=1",
                procs.display(),
                exe.display()
            ))
            .env("EGRET_MEMORY_CHILD", "1")
            .output()
            .expect("run the child");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("LIMIT Some(268435456) BOUND 167772"),
            "child: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
