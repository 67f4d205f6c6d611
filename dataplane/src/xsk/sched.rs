//! Worker thread placement: CPU affinity and real-time priority.
//!
//! These are raw syscalls, so they live in the crate's one unsafe module.
//! MACHINE-NOTES: a copy-mode AF_XDP worker must block in `poll()` and run
//! `SCHED_FIFO` on its core, or it and the NAPI thread take turns and the
//! kernel copies frames that are then dropped.

use std::io;

/// Pin the calling thread to one CPU (`sched_setaffinity(0, ...)`).
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::from(io::ErrorKind::InvalidInput));
    }
    // SAFETY: `cpu_set_t` is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu < CPU_SETSIZE` (checked above), so the bit is in the set.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the
    // calling thread.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Run the calling thread `SCHED_FIFO` at `priority` (1..=99).
pub fn set_fifo_priority(priority: i32) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: priority };
    // SAFETY: `param` is a valid sched_param; pid 0 is the calling thread.
    let ret = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The calling thread's scheduling policy (`SCHED_OTHER`, `SCHED_FIFO`, ...).
pub fn current_policy() -> io::Result<i32> {
    // SAFETY: no arguments but the pid (0: the calling thread).
    let ret = unsafe { libc::sched_getscheduler(0) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(ret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_priority_and_pinning_apply_to_the_calling_thread_only() {
        let (policy, pinned) = std::thread::spawn(|| {
            let pinned = pin_current_thread(0);
            (set_fifo_priority(10).and_then(|()| current_policy()), pinned)
        })
        .join()
        .expect("thread");
        // Root (the project's test environment) may do both.
        assert_eq!(policy.expect("SCHED_FIFO as root"), libc::SCHED_FIFO);
        assert!(pinned.is_ok(), "{pinned:?}");
        assert_eq!(current_policy().expect("policy"), libc::SCHED_OTHER, "the test thread is unchanged");
        assert!(pin_current_thread(libc::CPU_SETSIZE as usize).is_err());
    }
}
