//! A steady stream of *new* TCP connections from one pod, to time failovers.
//!
//! Every `every`, a fresh socket in the pod's namespace connects to the
//! server's HTTP port with a connect timeout shorter than the kernel's first
//! SYN retransmission (1 s), sends one request and reads which source the
//! server saw. Each attempt runs on its own thread, so a lost SYN delays no
//! later attempt: the first attempt that succeeds after an outage tells when
//! the path came back, to about `every`. Every attempt is kept with its start
//! and end times (monotonic clock) and its outcome.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::client::parse_saw;
use crate::error::{LabError, Result};
use crate::netns::NetNs;

/// One connection attempt.
#[derive(Clone, Debug)]
pub struct Attempt {
    /// Its sequence number (also in the request path, `/probe/<n>`).
    pub seq: u64,
    /// When the socket was opened.
    pub started: Instant,
    /// When the answer (or the failure) came.
    pub finished: Instant,
    /// The source address the server saw, or what went wrong.
    pub outcome: std::result::Result<SocketAddr, String>,
}

impl Attempt {
    /// The source the server saw, if the attempt succeeded.
    pub fn seen(&self) -> Option<SocketAddr> {
        self.outcome.as_ref().ok().copied()
    }
}

/// Attempts running in the background; [`Prober::stop`] returns them all.
#[derive(Debug)]
pub struct Prober {
    stop: Arc<AtomicBool>,
    attempts: Arc<Mutex<Vec<Attempt>>>,
    launcher: Option<JoinHandle<Vec<JoinHandle<Result<()>>>>>,
}

/// Connect timeout of one attempt: below the first SYN retransmission, so an
/// attempt is one SYN.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(900);
/// How long an attempt waits for the answer once connected.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(2);

fn one(to: SocketAddr, seq: u64) -> std::result::Result<SocketAddr, String> {
    let mut s = TcpStream::connect_timeout(&to, CONNECT_TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    s.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(|e| format!("read timeout: {e}"))?;
    s.write_all(format!("GET /probe/{seq} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n").as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    let mut text = String::new();
    s.read_to_string(&mut text).map_err(|e| format!("read: {e}"))?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    parse_saw(body).map(|(seen, _)| seen).ok_or_else(|| format!("unexpected answer {text:?}"))
}

/// One attempt from `ns` to `to`, now: the source the server saw.
pub fn once(ns: &NetNs, to: SocketAddr) -> Result<std::result::Result<SocketAddr, String>> {
    ns.run_in(|| one(to, u64::MAX))
}

/// New connections from `ns` to `to`, one after another (100 ms apart),
/// until the server sees source address `want`: that source and how long it
/// took. A connection seen with any other source, or none by `timeout`, is
/// an error naming what was seen.
pub fn wait_source(
    ns: &NetNs,
    to: SocketAddr,
    want: IpAddr,
    timeout: Duration,
) -> std::result::Result<(SocketAddr, Duration), String> {
    let t = Instant::now();
    loop {
        let last = match once(ns, to).map_err(|e| e.to_string())? {
            Ok(seen) if seen.ip() == want => return Ok((seen, t.elapsed())),
            Ok(seen) => return Err(format!("{} left as {seen}, expected {want}", ns.name())),
            Err(e) => e,
        };
        if t.elapsed() >= timeout {
            return Err(format!("{} never got through as {want} in {timeout:?}: {last}", ns.name()));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Prober {
    /// Starts attempts from `ns` to `to` every `every`.
    pub fn start(ns: &NetNs, to: SocketAddr, every: Duration) -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let attempts = Arc::new(Mutex::new(Vec::new()));
        let seq = Arc::new(AtomicU64::new(0));
        // Check the namespace once, here, so a typo fails the caller.
        ns.run_in(|| ())?;
        let ns_name = ns.name().to_string();
        let (stop2, attempts2) = (stop.clone(), attempts.clone());
        let launcher = std::thread::Builder::new()
            .name("prober".into())
            .spawn(move || {
                let mut running = Vec::new();
                let ns = match NetNs::existing(&ns_name) {
                    Ok(ns) => ns,
                    Err(_) => return running,
                };
                let mut next = Instant::now();
                while !stop2.load(Ordering::Relaxed) {
                    let n = seq.fetch_add(1, Ordering::Relaxed);
                    let attempts = attempts2.clone();
                    let spawned = ns.spawn_in(&format!("probe-{n}"), move || {
                        let started = Instant::now();
                        let outcome = one(to, n);
                        let a = Attempt { seq: n, started, finished: Instant::now(), outcome };
                        if let Ok(mut v) = attempts.lock() {
                            v.push(a);
                        }
                    });
                    if let Ok(h) = spawned {
                        running.push(h);
                    }
                    // Reap finished threads as we go.
                    running.retain(|h| !h.is_finished());
                    next += every;
                    if let Some(wait) = next.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    } else {
                        next = Instant::now();
                    }
                }
                running
            })
            .map_err(|e| LabError::io("spawn prober", e))?;
        Ok(Self { stop, attempts, launcher: Some(launcher) })
    }

    /// The attempts finished so far, in order of start.
    pub fn attempts(&self) -> Vec<Attempt> {
        let mut v = self.attempts.lock().map(|v| v.clone()).unwrap_or_default();
        v.sort_by_key(|a| a.started);
        v
    }

    /// Waits until an attempt started at or after `after` satisfies `pred`;
    /// returns it.
    pub fn wait_for(&self, after: Instant, timeout: Duration, pred: impl Fn(&Attempt) -> bool) -> Option<Attempt> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(a) = self.attempts().into_iter().find(|a| a.started >= after && pred(a)) {
                return Some(a);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops launching, waits for the attempts under way, returns them all.
    pub fn stop(mut self) -> Vec<Attempt> {
        self.halt();
        self.attempts()
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(l) = self.launcher.take() {
            if let Ok(running) = l.join() {
                for h in running {
                    let _ = h.join();
                }
            }
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.halt();
    }
}
