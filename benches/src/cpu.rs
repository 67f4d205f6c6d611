//! CPU accounting from /proc: who on the gateway's side spent how much CPU
//! during a measurement window.
//!
//! Two sources, both read at the start and the end of the window:
//!
//! - Per thread (`/proc/<pid>/task/<tid>/`): `schedstat`'s first field is the
//!   thread's `sum_exec_runtime` in nanoseconds (CONFIG_SCHED_INFO), exact;
//!   `stat` fields 14 and 15 are `utime` and `stime` in clock ticks
//!   (`USER_HZ`), the same total split by tick sampling and rounded to 10 ms.
//!   The benchmark's CPU figure is the schedstat total; utime/stime are
//!   reported beside it. On a kernel without CONFIG_IRQ_TIME_ACCOUNTING (the
//!   machine this was written on), interrupts and softirqs that run on top
//!   of a thread are charged to that thread, so a threaded NAPI poll and any
//!   softirq raised inside it count as the NAPI thread's time.
//! - Per core (`/proc/stat` `cpuN` lines, clock ticks): everything the core
//!   did, whoever did it. Used as an upper bound and to see softirq work
//!   that ran outside any watched thread (e.g. on the idle task).
//!
//! Parsers are pure functions over the file text, tested on fixtures.

use std::fmt;
use std::fs;
use std::path::PathBuf;

/// What went wrong reading or parsing a /proc file.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error("reading {path} failed: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("parsing {what} from {text:?} failed")]
    Parse { what: &'static str, text: String },
}

fn parse_err(what: &'static str, text: &str) -> CpuError {
    let mut t = text.to_owned();
    t.truncate(200);
    CpuError::Parse { what, text: t }
}

/// The fields of `/proc/<pid>/task/<tid>/stat` (proc(5)) the benchmark uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStat {
    pub tid: u32,
    /// Thread name (may contain spaces and parentheses).
    pub comm: String,
    /// Run state (field 3): R, S, D, ...
    pub state: char,
    /// Field 14, clock ticks in user mode.
    pub utime: u64,
    /// Field 15, clock ticks in kernel mode.
    pub stime: u64,
    /// Field 39, the CPU it last ran on.
    pub processor: u32,
    /// Field 40, real-time priority (0 for normal threads).
    pub rt_priority: u32,
    /// Field 41, scheduling policy (0 SCHED_OTHER, 1 SCHED_FIFO, ...).
    pub policy: u32,
}

/// Parse one `stat` line. The name is field 2 in parentheses and may itself
/// contain `)`, so the fields after it are split at the *last* `)`.
pub fn parse_task_stat(text: &str) -> Result<TaskStat, CpuError> {
    let open = text.find('(').ok_or_else(|| parse_err("stat: '('", text))?;
    let close = text.rfind(')').ok_or_else(|| parse_err("stat: ')'", text))?;
    if close < open {
        return Err(parse_err("stat: comm", text));
    }
    let tid = text[..open].trim().parse().map_err(|_| parse_err("stat: pid", text))?;
    let comm = text[open + 1..close].to_owned();
    // rest[0] is field 3.
    let rest: Vec<&str> = text[close + 1..].split_whitespace().collect();
    let field = |n: usize, what: &'static str| -> Result<u64, CpuError> {
        rest.get(n - 3).and_then(|s| s.parse().ok()).ok_or_else(|| parse_err(what, text))
    };
    let state = rest.first().and_then(|s| s.chars().next()).ok_or_else(|| parse_err("stat: state", text))?;
    Ok(TaskStat {
        tid,
        comm,
        state,
        utime: field(14, "stat: utime")?,
        stime: field(15, "stat: stime")?,
        processor: field(39, "stat: processor")? as u32,
        rt_priority: field(40, "stat: rt_priority")? as u32,
        policy: field(41, "stat: policy")? as u32,
    })
}

/// `/proc/<pid>/task/<tid>/schedstat`: on-CPU time, run-queue wait time
/// (both ns), and the number of times it ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedStat {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub timeslices: u64,
}

/// Parse a `schedstat` line.
pub fn parse_schedstat(text: &str) -> Result<SchedStat, CpuError> {
    let mut it = text.split_whitespace().map(str::parse::<u64>);
    let mut next = |what| it.next().and_then(Result::ok).ok_or_else(|| parse_err(what, text));
    Ok(SchedStat {
        run_ns: next("schedstat: run")?,
        wait_ns: next("schedstat: wait")?,
        timeslices: next("schedstat: slices")?,
    })
}

/// One `cpuN` line of `/proc/stat`, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CoreTimes {
    pub user: u64,
    pub nice: u64,
    pub system: u64,
    pub idle: u64,
    pub iowait: u64,
    pub irq: u64,
    pub softirq: u64,
    pub steal: u64,
}

impl CoreTimes {
    /// Ticks the core did work (steal and idle excluded; guest time is
    /// already inside user).
    pub fn busy(&self) -> u64 {
        self.user + self.nice + self.system + self.irq + self.softirq
    }

    /// Field-wise `self - earlier` (saturating: counters only grow).
    pub fn since(&self, earlier: &CoreTimes) -> CoreTimes {
        CoreTimes {
            user: self.user.saturating_sub(earlier.user),
            nice: self.nice.saturating_sub(earlier.nice),
            system: self.system.saturating_sub(earlier.system),
            idle: self.idle.saturating_sub(earlier.idle),
            iowait: self.iowait.saturating_sub(earlier.iowait),
            irq: self.irq.saturating_sub(earlier.irq),
            softirq: self.softirq.saturating_sub(earlier.softirq),
            steal: self.steal.saturating_sub(earlier.steal),
        }
    }
}

/// The per-core lines of `/proc/stat` (not the `cpu` total), indexed by
/// core number.
pub fn parse_proc_stat(text: &str) -> Result<Vec<CoreTimes>, CpuError> {
    let mut cores: Vec<(usize, CoreTimes)> = Vec::new();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let Some(name) = it.next() else { continue };
        let Some(n) = name.strip_prefix("cpu").filter(|n| !n.is_empty()) else { continue };
        let core: usize = n.parse().map_err(|_| parse_err("/proc/stat: core number", line))?;
        let v: Vec<u64> =
            it.map(str::parse).collect::<Result<_, _>>().map_err(|_| parse_err("/proc/stat: ticks", line))?;
        if v.len() < 8 {
            return Err(parse_err("/proc/stat: 8 fields", line));
        }
        let t = CoreTimes {
            user: v[0],
            nice: v[1],
            system: v[2],
            idle: v[3],
            iowait: v[4],
            irq: v[5],
            softirq: v[6],
            steal: v[7],
        };
        cores.push((core, t));
    }
    let len = cores.iter().map(|(c, _)| c + 1).max().unwrap_or(0);
    let mut out = vec![CoreTimes::default(); len];
    for (c, t) in cores {
        out[c] = t;
    }
    Ok(out)
}

/// A thread the benchmark watches, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Watched {
    /// The context it stands for ("napi gwin", "egret-worker-0", ...).
    pub role: String,
    pub pid: u32,
    pub tid: u32,
    /// Whether it may end during a window without spoiling it: one of the
    /// daemon's helper threads (tokio's blocking pool ends a thread after
    /// 10 s idle), never a worker or a NAPI thread.
    pub may_end: bool,
}

/// One thread's counters at one instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadSample {
    pub stat: TaskStat,
    pub sched: SchedStat,
}

fn read(path: PathBuf) -> Result<String, CpuError> {
    fs::read_to_string(&path).map_err(|source| CpuError::Read { path, source })
}

/// Read one thread's `stat` and `schedstat`.
pub fn sample_thread(pid: u32, tid: u32) -> Result<ThreadSample, CpuError> {
    let dir = PathBuf::from(format!("/proc/{pid}/task/{tid}"));
    let stat = parse_task_stat(&read(dir.join("stat"))?)?;
    let sched = parse_schedstat(&read(dir.join("schedstat"))?)?;
    Ok(ThreadSample { stat, sched })
}

/// Read `/proc/stat`.
pub fn sample_cores() -> Result<Vec<CoreTimes>, CpuError> {
    parse_proc_stat(&read(PathBuf::from("/proc/stat"))?)
}

/// The threads of process `pid` as (tid, name).
pub fn threads_of(pid: u32) -> Result<Vec<(u32, String)>, CpuError> {
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let entries = fs::read_dir(&dir).map_err(|source| CpuError::Read { path: dir.clone(), source })?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        // A thread may exit between the listing and the read: skip it.
        if let Ok(comm) = fs::read_to_string(e.path().join("comm")) {
            out.push((tid, comm.trim_end().to_owned()));
        }
    }
    out.sort();
    Ok(out)
}

/// Counters of every watched thread and of every core at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Each watched thread's counters, `None` for one that may end and has.
    pub threads: Vec<(Watched, Option<ThreadSample>)>,
    pub cores: Vec<CoreTimes>,
}

impl Snapshot {
    /// Sample `watched` and the cores now. A watched thread that has gone is
    /// an error (its time would be lost from the window) unless it
    /// [`may_end`](Watched::may_end).
    pub fn take(watched: &[Watched]) -> Result<Self, CpuError> {
        let threads = watched
            .iter()
            .map(|w| match sample_thread(w.pid, w.tid) {
                Ok(s) => Ok((w.clone(), Some(s))),
                Err(_) if w.may_end => Ok((w.clone(), None)),
                Err(e) => Err(e),
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { threads, cores: sample_cores()? })
    }
}

/// One watched thread's use over a window.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ThreadUse {
    pub role: String,
    pub tid: u32,
    pub comm: String,
    /// On-CPU seconds (schedstat).
    pub cpu_s: f64,
    /// Seconds runnable but waiting for the CPU (schedstat): how much other
    /// work on its core delayed it.
    pub wait_s: f64,
    /// utime and stime over the window, seconds (tick-sampled).
    pub user_s: f64,
    pub system_s: f64,
    /// CPU it ran on last, and its policy and RT priority at the end.
    pub last_cpu: u32,
    pub policy: u32,
    pub rt_priority: u32,
    /// It ended during the window (a helper thread that [`Watched::may_end`]):
    /// its time between the first sample and its end is not counted. A
    /// blocking-pool thread ends after 10 s idle, so that time is about 0.
    pub ended: bool,
}

/// All gateway-side CPU use over a window.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct WindowUse {
    pub threads: Vec<ThreadUse>,
    /// Sum of the watched threads' on-CPU seconds: the benchmark's figure.
    pub gateway_cpu_s: f64,
    /// The gateway core's busy seconds (all work on it, ours or not).
    pub core_busy_s: f64,
    /// Of which softirq and hardirq seconds (tick-sampled).
    pub core_softirq_s: f64,
    pub core_irq_s: f64,
    /// Seconds the hypervisor ran something else instead of the gateway
    /// core (`steal`; with CONFIG_PARAVIRT_TIME_ACCOUNTING, as here, it is
    /// not in any thread's time).
    pub core_steal_s: f64,
    /// The generator/sink core's busy seconds.
    pub other_core_busy_s: f64,
}

/// Errors comparing two snapshots.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("thread {tid} ({role}) changed identity during the window (was {before:?}, now {after:?})")]
    ThreadChanged { role: String, tid: u32, before: String, after: String },
    #[error("the snapshots watch different threads")]
    Mismatch,
    #[error("core {core} is not in /proc/stat")]
    NoSuchCore { core: usize },
}

impl fmt::Display for ThreadUse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{} {}] {:.3}s", self.role, self.tid, self.comm, self.cpu_s)
    }
}

/// What happened between `a` and `b`, with `user_hz` ticks per second, the
/// gateway on core `gw_core` and the generator on `other_core`.
pub fn window(
    a: &Snapshot,
    b: &Snapshot,
    user_hz: u64,
    gw_core: usize,
    other_core: usize,
) -> Result<WindowUse, WindowError> {
    if a.threads.len() != b.threads.len() {
        return Err(WindowError::Mismatch);
    }
    let hz = user_hz.max(1) as f64;
    let mut threads = Vec::with_capacity(a.threads.len());
    for ((wa, sa), (wb, sb)) in a.threads.iter().zip(&b.threads) {
        if wa != wb {
            return Err(WindowError::Mismatch);
        }
        let (Some(sa), Some(sb)) = (sa, sb) else {
            // Gone by the end (or already at the start): nothing measurable.
            threads.push(ThreadUse {
                role: wa.role.clone(),
                tid: wa.tid,
                comm: sa.as_ref().map(|s| s.stat.comm.clone()).unwrap_or_default(),
                cpu_s: 0.0,
                wait_s: 0.0,
                user_s: 0.0,
                system_s: 0.0,
                last_cpu: sa.as_ref().map_or(0, |s| s.stat.processor),
                policy: 0,
                rt_priority: 0,
                ended: true,
            });
            continue;
        };
        if sa.stat.comm != sb.stat.comm {
            return Err(WindowError::ThreadChanged {
                role: wa.role.clone(),
                tid: wa.tid,
                before: sa.stat.comm.clone(),
                after: sb.stat.comm.clone(),
            });
        }
        threads.push(ThreadUse {
            role: wa.role.clone(),
            tid: wa.tid,
            comm: sb.stat.comm.clone(),
            cpu_s: sb.sched.run_ns.saturating_sub(sa.sched.run_ns) as f64 / 1e9,
            wait_s: sb.sched.wait_ns.saturating_sub(sa.sched.wait_ns) as f64 / 1e9,
            user_s: sb.stat.utime.saturating_sub(sa.stat.utime) as f64 / hz,
            system_s: sb.stat.stime.saturating_sub(sa.stat.stime) as f64 / hz,
            last_cpu: sb.stat.processor,
            policy: sb.stat.policy,
            rt_priority: sb.stat.rt_priority,
            ended: false,
        });
    }
    let core = |s: &Snapshot, c: usize| s.cores.get(c).copied().ok_or(WindowError::NoSuchCore { core: c });
    let gw = core(b, gw_core)?.since(&core(a, gw_core)?);
    let other = core(b, other_core)?.since(&core(a, other_core)?);
    Ok(WindowUse {
        gateway_cpu_s: threads.iter().map(|t| t.cpu_s).sum(),
        threads,
        core_busy_s: gw.busy() as f64 / hz,
        core_softirq_s: gw.softirq as f64 / hz,
        core_irq_s: gw.irq as f64 / hz,
        core_steal_s: gw.steal as f64 / hz,
        other_core_busy_s: other.busy() as f64 / hz,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    // A napi kthread as /proc shows it on Linux 6.18 (stime 1234 ticks,
    // last ran on CPU 1, SCHED_OTHER).
    const NAPI_STAT: &str = "5727 (napi/gwin-289) S 2 0 0 0 -1 2129984 0 0 0 0 0 1234 0 0 20 0 1 0 24958 0 0 \
        18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
    // A SCHED_FIFO 50 worker whose name holds a space and parentheses.
    const WORKER_STAT: &str = "4242 (w) (x 1)) R 4200 4200 29614 0 -1 4194304 97 0 0 0 310 52 0 0 -51 0 9 0 \
        249582 3133440 382 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 50 1 0 0 0 1 1 1 1 1 1 1 0\n";
    const PROC_STAT: &str = "cpu  296653 0 37560 157651 730 0 577 7025 0 0\n\
        cpu0 147989 0 19017 78901 528 0 175 3456 0 0\n\
        cpu1 148664 0 18542 78750 201 3 402 3568 0 0\n\
        intr 3181456 0 0 0\nctxt 1\nbtime 1\nprocesses 2\nprocs_running 1\nsoftirq 1 2 3\n";

    #[test]
    fn task_stat_fields() {
        let s = parse_task_stat(NAPI_STAT).expect("parse");
        assert_eq!(
            s,
            TaskStat {
                tid: 5727,
                comm: "napi/gwin-289".into(),
                state: 'S',
                utime: 0,
                stime: 1234,
                processor: 1,
                rt_priority: 0,
                policy: 0
            }
        );
        let w = parse_task_stat(WORKER_STAT).expect("parse");
        assert_eq!((w.tid, w.comm.as_str(), w.state), (4242, "w) (x 1)", 'R'));
        assert_eq!((w.utime, w.stime, w.processor, w.rt_priority, w.policy), (310, 52, 1, 50, 1));
    }

    #[test]
    fn task_stat_rejects_truncated_text() {
        assert!(parse_task_stat("12 (x) S 1 2 3").is_err());
        assert!(parse_task_stat("no parens").is_err());
        assert!(parse_task_stat("x (y) S").is_err());
    }

    #[test]
    fn schedstat_fields() {
        assert_eq!(
            parse_schedstat("95916676 21210250 376\n").expect("parse"),
            SchedStat { run_ns: 95_916_676, wait_ns: 21_210_250, timeslices: 376 }
        );
        assert!(parse_schedstat("1 2").is_err());
    }

    #[test]
    fn proc_stat_cores() {
        let c = parse_proc_stat(PROC_STAT).expect("parse");
        assert_eq!(c.len(), 2);
        assert_eq!(
            c[1],
            CoreTimes {
                user: 148_664,
                nice: 0,
                system: 18_542,
                idle: 78_750,
                iowait: 201,
                irq: 3,
                softirq: 402,
                steal: 3568
            }
        );
        assert_eq!(c[1].busy(), 148_664 + 18_542 + 3 + 402);
        assert!(parse_proc_stat("cpu0 1 2 3\n").is_err());
    }

    fn sample(stat: &str, run_ns: u64) -> ThreadSample {
        ThreadSample {
            stat: parse_task_stat(stat).expect("fixture"),
            sched: SchedStat { run_ns, wait_ns: run_ns / 10, timeslices: 0 },
        }
    }

    #[test]
    fn window_sums_watched_threads_and_reads_the_cores() {
        let napi = Watched { role: "napi gwin".into(), pid: 5727, tid: 5727, may_end: false };
        let worker = Watched { role: "egret-worker-0".into(), pid: 4200, tid: 4242, may_end: false };
        let later_napi = NAPI_STAT.replace(" 0 1234 0 0 ", " 0 1434 0 0 ");
        let later_worker = WORKER_STAT.replace(" 310 52 ", " 560 102 ");
        let a = Snapshot {
            threads: vec![
                (napi.clone(), Some(sample(NAPI_STAT, 1_000_000_000))),
                (worker.clone(), Some(sample(WORKER_STAT, 5_000_000_000))),
            ],
            cores: parse_proc_stat(PROC_STAT).expect("fixture"),
        };
        let b = Snapshot {
            threads: vec![
                (napi, Some(sample(&later_napi, 3_000_000_000))),
                (worker, Some(sample(&later_worker, 8_000_000_000))),
            ],
            cores: parse_proc_stat(
                &PROC_STAT
                    .replace("cpu1 148664 0 18542 78750 201 3 402", "cpu1 148964 0 18842 78850 201 3 452")
                    .replace("cpu0 147989", "cpu0 148089"),
            )
            .expect("fixture"),
        };
        let w = window(&a, &b, 100, 1, 0).expect("window");
        assert_eq!(w.threads.len(), 2);
        assert!((w.threads[0].cpu_s - 2.0).abs() < 1e-9);
        assert!((w.threads[0].wait_s - 0.2).abs() < 1e-9);
        assert!((w.threads[0].system_s - 2.0).abs() < 1e-9);
        assert!((w.threads[1].cpu_s - 3.0).abs() < 1e-9);
        assert!((w.threads[1].user_s - 2.5).abs() < 1e-9 && (w.threads[1].system_s - 0.5).abs() < 1e-9);
        assert!((w.gateway_cpu_s - 5.0).abs() < 1e-9);
        assert!((w.core_busy_s - 6.5).abs() < 1e-9, "{}", w.core_busy_s);
        assert!((w.core_softirq_s - 0.5).abs() < 1e-9);
        assert!(w.core_steal_s.abs() < 1e-9);
        assert!((w.other_core_busy_s - 1.0).abs() < 1e-9);
    }

    #[test]
    fn window_refuses_a_thread_that_changed() {
        let napi = Watched { role: "napi gwin".into(), pid: 5727, tid: 5727, may_end: false };
        let cores = parse_proc_stat(PROC_STAT).expect("fixture");
        let a = Snapshot { threads: vec![(napi.clone(), Some(sample(NAPI_STAT, 1)))], cores: cores.clone() };
        let other = NAPI_STAT.replace("napi/gwin-289", "kworker/1:2");
        let b = Snapshot { threads: vec![(napi, Some(sample(&other, 2)))], cores };
        assert!(matches!(window(&a, &b, 100, 1, 0), Err(WindowError::ThreadChanged { tid: 5727, .. })));
        assert!(matches!(window(&a, &a, 100, 7, 0), Err(WindowError::NoSuchCore { core: 7 })));
    }

    #[test]
    fn a_helper_thread_may_end_during_the_window_a_worker_may_not() {
        // No thread has tid u32::MAX: it has "ended".
        let pid = std::process::id();
        let gone = |may_end| Watched { role: "egret tokio-runtime-w".into(), pid, tid: u32::MAX, may_end };
        assert!(Snapshot::take(&[gone(false)]).is_err(), "a worker that ends spoils the window");
        let a = Snapshot::take(&[gone(true)]).expect("a helper that ended is no error");
        assert!(a.threads[0].1.is_none());
        // Present at the start, gone at the end: counted as nothing, marked.
        let helper = Watched { role: "egret helper".into(), pid: 4200, tid: 4242, may_end: true };
        let cores = parse_proc_stat(PROC_STAT).expect("fixture");
        let a = Snapshot { threads: vec![(helper.clone(), Some(sample(WORKER_STAT, 5)))], cores: cores.clone() };
        let b = Snapshot { threads: vec![(helper, None)], cores };
        let w = window(&a, &b, 100, 1, 0).expect("window");
        assert!(w.threads[0].ended && w.threads[0].cpu_s == 0.0 && w.gateway_cpu_s == 0.0);
    }

    #[test]
    fn reads_this_process() {
        let pid = std::process::id();
        let threads = threads_of(pid).expect("own threads");
        assert!(threads.iter().any(|(tid, _)| *tid == pid));
        let s = sample_thread(pid, pid).expect("own stat");
        assert_eq!(s.stat.tid, pid);
        assert!(!sample_cores().expect("/proc/stat").is_empty());
    }
}
