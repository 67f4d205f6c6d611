//! Load that runs through a high-availability event (issue 16, "Tests";
//! `tests/tests/k8s_ha.rs`), and the watch on the shared segment that counts
//! double owners.
//!
//! [`Load::start`] starts four flows between one pod and the external
//! server's namespace, each with both ends in this process (threads inside
//! the namespaces, [`NetNs::spawn_in`]):
//!
//! - churn: the pod opens a new TCP connection every [`CHURN_EVERY`]
//!   (connect, one line, the answer, close), each with a short timeout; the
//!   server keeps each connection's source and time.
//! - download: the pod connects once and the server streams to it at
//!   [`DOWNLOAD_RATE`], paced; the pod keeps when bytes arrived (the longest
//!   stall), whether the connection survived and how many bytes came.
//! - UDP replies: the pod sends one datagram to open a mapping, then only the
//!   server sends, a sequence number every [`UDP_EVERY`], to the address and
//!   port it saw; the pod counts what arrives.
//! - inbound to an endpoint-independent mapping: the pod opens a mapping to
//!   one server address, then a second address
//!   ([`plan::STRANGER`](crate::plan)) sends to the mapped address and port
//!   every [`UDP_EVERY`]; the pod counts what arrives. Needs the gateways'
//!   `nat.filtering: endpoint-independent`.
//!
//! The server side records the source address of everything it receives
//! ([`Load::sources`]): a pod's own address there is a leak.
//!
//! [`ArpWatch`] runs on the upstream router's segment link: it asks who has
//! each egress IP every [`ARP_EVERY`], keeps every reply's sender MAC (and
//! every gratuitous ARP) with its time, and checks every frame on the link
//! for a pod source address ([`ArpWatch::leaks`]).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{LabError, Result};
use crate::frames::{self, RawLink};
use crate::netns::NetNs;
use crate::plan;

/// The server's port for the churn's connections.
pub const CHURN_PORT: u16 = 9100;
/// The server's port for the download.
pub const DOWNLOAD_PORT: u16 = 9101;
/// The server's port the UDP-replies flow opens its mapping to.
pub const REPLIES_PORT: u16 = 9102;
/// The server's port the inbound flow opens its mapping to; the second
/// address sends from the same port.
pub const EIM_PORT: u16 = 9103;
/// One new connection this often (paced: a port per connection stays in
/// the gateway's session table for `tcpTransitory`, and a pod gets at most
/// `maxPortsPerSource`).
pub const CHURN_EVERY: Duration = Duration::from_millis(100);
/// A churn connection's connect and answer timeout.
pub const CHURN_TIMEOUT: Duration = Duration::from_millis(500);
/// The download's pace, bytes per second.
pub const DOWNLOAD_RATE: u64 = 2_000_000;
/// The server sends a datagram this often on each UDP flow.
pub const UDP_EVERY: Duration = Duration::from_millis(10);
/// The ARP watch asks for each IP this often.
pub const ARP_EVERY: Duration = Duration::from_millis(20);

const POLL: Duration = Duration::from_millis(100);

/// One thing the server side received.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// When.
    pub at: Instant,
    /// Which flow (`churn`, `download`, `udp-replies`, `eim`).
    pub flow: &'static str,
    /// The source address and port the server saw.
    pub src: SocketAddr,
}

/// One churn connection, as the pod saw it.
#[derive(Clone, Debug)]
pub struct ChurnAttempt {
    /// Its sequence number.
    pub seq: u64,
    /// When its socket was opened.
    pub started: Instant,
    /// When it ended.
    pub finished: Instant,
    /// The source the server saw, or what went wrong.
    pub outcome: std::result::Result<SocketAddr, String>,
}

/// How the download ended.
#[derive(Clone, Debug, Default)]
pub struct Download {
    /// When the pod connected.
    pub started: Option<Instant>,
    /// Bytes received.
    pub bytes: u64,
    /// When bytes arrived (one entry per read that returned data).
    pub arrivals: Vec<Instant>,
    /// Why the connection ended before the pod stopped it (reset, closed,
    /// connect failure); `None`: it was open when the load stopped.
    pub died: Option<String>,
    /// When it died.
    pub died_at: Option<Instant>,
}

/// A UDP flow in which only the far side sends: what the pod received.
#[derive(Clone, Debug, Default)]
pub struct Received {
    /// Each datagram's sequence number and arrival time, in arrival order.
    pub got: Vec<(u64, Instant)>,
    /// Whether the flow was opened at all (the pod's first datagram was
    /// answered within 5 s).
    pub opened: bool,
}

#[derive(Debug, Default)]
struct Shared {
    sources: Mutex<Vec<Source>>,
    churn: Mutex<Vec<ChurnAttempt>>,
    download: Mutex<Download>,
    replies: Mutex<Received>,
    eim: Mutex<Received>,
    downloaded_sent: AtomicU64,
    replies_sent: AtomicU64,
    eim_sent: AtomicU64,
}

impl Shared {
    fn source(&self, flow: &'static str, src: SocketAddr) {
        if let Ok(mut v) = self.sources.lock() {
            v.push(Source { at: Instant::now(), flow, src });
        }
    }
}

/// The four flows, running. [`Load::stop`] ends them and returns what
/// happened; dropping it stops them too.
#[derive(Debug)]
pub struct Load {
    shared: Arc<Shared>,
    /// Stops the server's UDP senders (first, so the pods can drain).
    senders_stop: Arc<AtomicBool>,
    /// Stops the pod's side.
    pod_stop: Arc<AtomicBool>,
    /// Stops the server's listeners and the download.
    server_stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<()>>>,
    started: Instant,
}

/// Everything one run of the load saw.
#[derive(Clone, Debug)]
pub struct Report {
    /// When the load started.
    pub started: Instant,
    /// When it began to stop (the UDP senders stop then).
    pub stopped: Instant,
    /// The server side's sources.
    pub sources: Vec<Source>,
    /// The churn's attempts.
    pub churn: Vec<ChurnAttempt>,
    /// The download.
    pub download: Download,
    /// Bytes the server wrote into the download's socket.
    pub download_sent: u64,
    /// The UDP-replies flow.
    pub replies: Received,
    /// Datagrams the server sent on it.
    pub replies_sent: u64,
    /// The inbound flow to the endpoint-independent mapping.
    pub eim: Received,
    /// Datagrams the second address sent on it.
    pub eim_sent: u64,
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LabError {
    let what = what.into();
    move |e| LabError::io(what, e)
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

impl Load {
    /// Starts the server side in `srv` (listening on [`plan::SERVER`], the
    /// second address [`plan::STRANGER`]) and the pod side in `pod`; returns
    /// once both UDP mappings are open (or 5 s passed) and the download
    /// runs.
    pub fn start(pod: &NetNs, srv: &NetNs) -> Result<Self> {
        let shared = Arc::new(Shared::default());
        let senders_stop = Arc::new(AtomicBool::new(false));
        let pod_stop = Arc::new(AtomicBool::new(false));
        let server_stop = Arc::new(AtomicBool::new(false));
        let mut load = Self {
            shared: shared.clone(),
            senders_stop: senders_stop.clone(),
            pod_stop: pod_stop.clone(),
            server_stop: server_stop.clone(),
            threads: Vec::new(),
            started: Instant::now(),
        };
        let server = SocketAddr::new(plan::SERVER.into(), 0);
        let at = move |port: u16| SocketAddr::new(server.ip(), port);

        // Server side: sockets bound in the server's namespace, served by
        // threads that stay there.
        let (churn_l, dl_l, replies_s, eim_s, eim_second) = srv.run_in(|| -> Result<_> {
            let listen = |port: u16| -> Result<TcpListener> {
                let addr = at(port);
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)
                    .map_err(io(format!("listen {addr}")))?;
                s.set_reuse_address(true).map_err(io(format!("listen {addr}")))?;
                s.bind(&addr.into()).map_err(io(format!("bind {addr}")))?;
                s.listen(128).map_err(io(format!("listen {addr}")))?;
                s.set_read_timeout(Some(POLL)).map_err(io("accept timeout"))?;
                Ok(s.into())
            };
            let udp = |addr: SocketAddr| -> Result<UdpSocket> {
                let s = UdpSocket::bind(addr).map_err(io(format!("bind UDP {addr}")))?;
                s.set_read_timeout(Some(Duration::from_millis(5))).map_err(io("UDP timeout"))?;
                Ok(s)
            };
            Ok((
                listen(CHURN_PORT)?,
                listen(DOWNLOAD_PORT)?,
                udp(at(REPLIES_PORT))?,
                udp(at(EIM_PORT))?,
                udp(SocketAddr::new(plan::STRANGER.into(), EIM_PORT))?,
            ))
        })??;
        let spawn = |load: &mut Self, ns: &NetNs, name: &str, f: Box<dyn FnOnce() -> Result<()> + Send>| {
            let h = ns.spawn_in(name, f)?;
            load.threads.push(spawn_flatten(h));
            Ok::<(), LabError>(())
        };
        {
            let (sh, stop) = (shared.clone(), server_stop.clone());
            spawn(&mut load, srv, "load-churn-srv", Box::new(move || serve_churn(&churn_l, &sh, &stop)))?;
        }
        {
            let (sh, stop) = (shared.clone(), server_stop.clone());
            spawn(&mut load, srv, "load-dl-srv", Box::new(move || serve_download(&dl_l, &sh, &stop)))?;
        }
        {
            let (sh, stop) = (shared.clone(), senders_stop.clone());
            spawn(
                &mut load,
                srv,
                "load-udp-srv",
                Box::new(move || serve_replies(&replies_s, None, "udp-replies", &sh, &stop)),
            )?;
        }
        {
            let (sh, stop) = (shared.clone(), senders_stop.clone());
            spawn(
                &mut load,
                srv,
                "load-eim-srv",
                Box::new(move || serve_replies(&eim_s, Some(&eim_second), "eim", &sh, &stop)),
            )?;
        }

        // Pod side.
        {
            let (sh, stop) = (shared.clone(), pod_stop.clone());
            spawn(&mut load, pod, "load-churn", Box::new(move || churn(at(CHURN_PORT), &sh, &stop)))?;
        }
        {
            let (sh, stop) = (shared.clone(), pod_stop.clone());
            spawn(&mut load, pod, "load-dl", Box::new(move || download(at(DOWNLOAD_PORT), &sh, &stop)))?;
        }
        for (flow, port) in [("udp-replies", REPLIES_PORT), ("eim", EIM_PORT)] {
            let (sh, stop) = (shared.clone(), pod_stop.clone());
            let from = if flow == "eim" { IpAddr::V4(plan::STRANGER) } else { server.ip() };
            spawn(&mut load, pod, "load-udp", Box::new(move || receive(at(port), from, flow, &sh, &stop)))?;
        }
        // Until both mappings are open and the download has bytes.
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let open = |m: &Mutex<Received>| m.lock().map(|r| !r.got.is_empty()).unwrap_or(false);
            let dl = shared.download.lock().map(|d| d.bytes > 0).unwrap_or(false);
            if open(&shared.replies) && open(&shared.eim) && dl {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        load.started = Instant::now();
        Ok(load)
    }

    /// The server side's sources so far.
    pub fn sources(&self) -> Vec<Source> {
        self.shared.sources.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The churn's attempts so far.
    pub fn churn(&self) -> Vec<ChurnAttempt> {
        self.shared.churn.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Stops everything (the UDP senders first, then, after the pod drained
    /// what was in flight, the pod's side, then the server's) and returns
    /// what happened.
    pub fn stop(mut self) -> Result<Report> {
        let stopped = Instant::now();
        self.halt()?;
        let sh = &self.shared;
        let take = |m: &Mutex<Received>| m.lock().map(|r| r.clone()).unwrap_or_default();
        Ok(Report {
            started: self.started,
            stopped,
            sources: self.sources(),
            churn: self.churn(),
            download: sh.download.lock().map(|d| d.clone()).unwrap_or_default(),
            download_sent: sh.downloaded_sent.load(Ordering::Relaxed),
            replies: take(&sh.replies),
            replies_sent: sh.replies_sent.load(Ordering::Relaxed),
            eim: take(&sh.eim),
            eim_sent: sh.eim_sent.load(Ordering::Relaxed),
        })
    }

    fn halt(&mut self) -> Result<()> {
        self.senders_stop.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(300));
        self.pod_stop.store(true, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(200));
        self.server_stop.store(true, Ordering::Relaxed);
        let mut first_err = None;
        for t in self.threads.drain(..) {
            let r = t.join().map_err(|_| LabError::Gateway("a load thread panicked".into())).and_then(|r| r);
            if let (Err(e), None) = (r, &first_err) {
                first_err = Some(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

/// A thread of [`NetNs::spawn_in`] returns `Result<Result<()>>`; one level.
fn spawn_flatten(h: JoinHandle<Result<Result<()>>>) -> JoinHandle<Result<()>> {
    std::thread::spawn(move || match h.join() {
        Ok(r) => r.and_then(|r| r),
        Err(_) => Err(LabError::Gateway("a load thread panicked".into())),
    })
}

fn serve_churn(l: &TcpListener, sh: &Shared, stop: &AtomicBool) -> Result<()> {
    while !stop.load(Ordering::Relaxed) {
        let (mut s, peer) = match l.accept() {
            Ok(x) => x,
            Err(e) if is_timeout(&e) => continue,
            Err(e) => return Err(LabError::io("accept a churn connection", e)),
        };
        sh.source("churn", peer);
        let _ = s.set_read_timeout(Some(CHURN_TIMEOUT));
        let mut line = [0u8; 64];
        if matches!(s.read(&mut line), Ok(n) if n > 0) {
            let _ = s.write_all(format!("saw {peer}\n").as_bytes());
        }
    }
    Ok(())
}

fn churn(to: SocketAddr, sh: &Shared, stop: &AtomicBool) -> Result<()> {
    let one = |seq: u64| -> std::result::Result<SocketAddr, String> {
        let mut s = TcpStream::connect_timeout(&to, CHURN_TIMEOUT).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(CHURN_TIMEOUT)).map_err(|e| format!("timeout: {e}"))?;
        s.write_all(format!("churn {seq}\n").as_bytes()).map_err(|e| format!("send: {e}"))?;
        let mut text = String::new();
        s.read_to_string(&mut text).map_err(|e| format!("read: {e}"))?;
        text.trim().strip_prefix("saw ").and_then(|a| a.parse().ok()).ok_or_else(|| format!("answer {text:?}"))
    };
    let mut seq = 0;
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let started = Instant::now();
        let outcome = one(seq);
        if let Ok(mut v) = sh.churn.lock() {
            v.push(ChurnAttempt { seq, started, finished: Instant::now(), outcome });
        }
        seq += 1;
        next += CHURN_EVERY;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    }
    Ok(())
}

fn serve_download(l: &TcpListener, sh: &Shared, stop: &AtomicBool) -> Result<()> {
    // One download per load; later connections (none expected) are served
    // the same way in turn.
    while !stop.load(Ordering::Relaxed) {
        let (mut s, peer) = match l.accept() {
            Ok(x) => x,
            Err(e) if is_timeout(&e) => continue,
            Err(e) => return Err(LabError::io("accept the download", e)),
        };
        sh.source("download", peer);
        s.set_write_timeout(Some(POLL)).map_err(io("download write timeout"))?;
        let chunk = vec![b'y'; 16 * 1024];
        let t0 = Instant::now();
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let due = (t0.elapsed().as_secs_f64() * DOWNLOAD_RATE as f64) as u64;
            if sent >= due {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            let n = (due - sent).min(chunk.len() as u64) as usize;
            match s.write(&chunk[..n]) {
                Ok(w) => {
                    sent += w as u64;
                    sh.downloaded_sent.fetch_add(w as u64, Ordering::Relaxed);
                }
                Err(e) if is_timeout(&e) => {}
                // The pod closed it, or the connection was reset.
                Err(_) => break,
            }
        }
    }
    Ok(())
}

fn download(to: SocketAddr, sh: &Shared, stop: &AtomicBool) -> Result<()> {
    let set = |f: &dyn Fn(&mut Download)| {
        if let Ok(mut d) = sh.download.lock() {
            f(&mut d);
        }
    };
    let mut s = match TcpStream::connect_timeout(&to, Duration::from_secs(3)) {
        Ok(s) => s,
        Err(e) => {
            let why = format!("connect: {e}");
            set(&|d| {
                d.died = Some(why.clone());
                d.died_at = Some(Instant::now());
            });
            return Ok(());
        }
    };
    let now = Instant::now();
    set(&|d| d.started = Some(now));
    s.set_read_timeout(Some(POLL)).map_err(io("download read timeout"))?;
    let mut buf = vec![0u8; 64 * 1024];
    while !stop.load(Ordering::Relaxed) {
        match s.read(&mut buf) {
            Ok(0) => {
                set(&|d| {
                    d.died = Some("closed by the far end".into());
                    d.died_at = Some(Instant::now());
                });
                break;
            }
            Ok(n) => {
                let now = Instant::now();
                set(&|d| {
                    d.bytes += n as u64;
                    d.arrivals.push(now);
                });
            }
            Err(e) if is_timeout(&e) => {}
            Err(e) => {
                let why = e.to_string();
                set(&|d| {
                    d.died = Some(why.clone());
                    d.died_at = Some(Instant::now());
                });
                break;
            }
        }
    }
    Ok(())
}

/// The server side of a UDP flow: waits for the pod's datagram on `s`, then
/// sends a sequence number every [`UDP_EVERY`] to the source it saw, from
/// `s` or, for the inbound flow, from `second` (another address).
fn serve_replies(
    s: &UdpSocket,
    second: Option<&UdpSocket>,
    flow: &'static str,
    sh: &Shared,
    stop: &AtomicBool,
) -> Result<()> {
    let counter = if second.is_some() { &sh.eim_sent } else { &sh.replies_sent };
    let mut to: Option<SocketAddr> = None;
    let mut seq = 0u64;
    let mut next = Instant::now();
    let mut buf = [0u8; 256];
    if let Some(second) = second {
        second.set_nonblocking(true).map_err(io(format!("the {flow} flow's second socket")))?;
    }
    while !stop.load(Ordering::Relaxed) {
        // Whatever arrives (the opening datagram, retries): its source.
        match s.recv_from(&mut buf) {
            Ok((_, src)) => {
                sh.source(flow, src);
                to = Some(src);
            }
            Err(e) if is_timeout(&e) => {}
            Err(e) => return Err(LabError::io(format!("receive on the {flow} flow"), e)),
        }
        if let Some(second) = second {
            // The second address's socket receives nothing legitimately:
            // anything there is recorded too.
            while let Ok((_, src)) = second.recv_from(&mut buf) {
                sh.source(flow, src);
            }
        }
        let Some(dst) = to else { continue };
        while Instant::now() >= next {
            let out = second.unwrap_or(s);
            if out.send_to(&seq.to_be_bytes(), dst).is_ok() {
                counter.fetch_add(1, Ordering::Relaxed);
            }
            seq += 1;
            next += UDP_EVERY;
        }
    }
    Ok(())
}

/// The pod side of a UDP flow: sends the opening datagram to `to` (again
/// every 200 ms until something arrives, for at most 5 s), then counts the
/// sequence numbers arriving from `from`.
fn receive(to: SocketAddr, from: IpAddr, flow: &'static str, sh: &Shared, stop: &AtomicBool) -> Result<()> {
    let slot = if flow == "eim" { &sh.eim } else { &sh.replies };
    let s = UdpSocket::bind("0.0.0.0:0").map_err(io(format!("bind the {flow} flow's socket")))?;
    s.set_read_timeout(Some(Duration::from_millis(50))).map_err(io("UDP timeout"))?;
    let mut buf = [0u8; 64];
    let t0 = Instant::now();
    let mut last_open = None::<Instant>;
    let mut opened = false;
    while !stop.load(Ordering::Relaxed) {
        if !opened
            && t0.elapsed() < Duration::from_secs(5)
            && last_open.is_none_or(|t| t.elapsed() >= Duration::from_millis(200))
        {
            s.send_to(b"open", to).map_err(io(format!("open the {flow} flow")))?;
            last_open = Some(Instant::now());
        }
        match s.recv_from(&mut buf) {
            Ok((8, src)) if src.ip() == from => {
                let seq = u64::from_be_bytes(buf[..8].try_into().unwrap_or_default());
                opened = true;
                if let Ok(mut r) = slot.lock() {
                    r.opened = true;
                    r.got.push((seq, Instant::now()));
                }
            }
            Ok(_) => {}
            Err(e) if is_timeout(&e) => {}
            // An ICMP error (port unreachable during a failover) is not the end.
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
            Err(e) => return Err(LabError::io(format!("receive on the {flow} flow"), e)),
        }
    }
    Ok(())
}

/// What the load lost in a window of time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outage {
    /// The longest time between two successive churn connections the
    /// server accepted (steady state: about [`CHURN_EVERY`]).
    pub server_ms: u64,
    /// The longest time, at the pod, between two successive churn
    /// connections that succeeded.
    pub pod_ms: u64,
    /// The longest stall of the download at the pod.
    pub download_stall_ms: u64,
    /// The longest gap between datagrams of the UDP-replies flow at the pod.
    pub udp_gap_ms: u64,
    /// When that gap ended, on the wall clock (the gateways' logs' clock).
    pub udp_gap_ended: Option<SystemTime>,
    /// The longest gap between datagrams of the inbound flow at the pod.
    pub eim_gap_ms: u64,
    /// Long-lived flows (download, UDP replies, inbound) still carrying
    /// traffic in the load's last second, of 3.
    pub kept: usize,
    /// Bytes the download did not deliver: what the pace had due by the end
    /// (when the load began to stop) minus what came; 0 when the connection
    /// survived and caught up.
    pub bytes_lost: u64,
    /// Datagrams of the UDP-replies flow sent and never received.
    pub udp_lost: u64,
    /// Datagrams of the inbound flow sent and never received.
    pub eim_lost: u64,
    /// Why the download's connection ended before the load stopped it
    /// (reset, closed, connect failure); `None`: it was still open (maybe
    /// stalled).
    pub download_died: Option<String>,
    /// Churn attempts that failed.
    pub churn_failed: usize,
    /// Churn attempts in all.
    pub churn_total: usize,
    /// The first few failed churn attempts: when each started (wall clock)
    /// and what went wrong.
    pub churn_failures: Vec<(SystemTime, String)>,
}

/// The longest gap between successive instants of `times` (sorted here),
/// counting from `from` and up to `to` too (a flow that stopped for good
/// has its gap to the end).
fn longest_gap(times: Vec<Instant>, from: Instant, to: Instant) -> Duration {
    longest_gap_ending(times, from, to).0
}

/// [`longest_gap`] and the instant it ended.
fn longest_gap_ending(mut times: Vec<Instant>, from: Instant, to: Instant) -> (Duration, Instant) {
    times.retain(|t| *t >= from && *t <= to);
    times.sort();
    let mut prev = from;
    let mut gap = (Duration::ZERO, from);
    for t in times.into_iter().chain([to]) {
        let d = t.saturating_duration_since(prev);
        if d > gap.0 {
            gap = (d, t);
        }
        prev = t;
    }
    gap
}

/// `at` on the wall clock, to set beside the gateways' logs.
fn wall_clock(at: Instant) -> SystemTime {
    let now = Instant::now();
    SystemTime::now() - now.saturating_duration_since(at) + at.saturating_duration_since(now)
}

impl Report {
    /// The summary of the whole run.
    pub fn outage(&self) -> Outage {
        let (from, to) = (self.started, self.stopped);
        let ms = |d: Duration| d.as_millis() as u64;
        let accepted: Vec<Instant> = self.sources.iter().filter(|s| s.flow == "churn").map(|s| s.at).collect();
        let ok: Vec<Instant> = self.churn.iter().filter(|a| a.outcome.is_ok()).map(|a| a.finished).collect();
        let udp_times = |r: &Received| r.got.iter().map(|(_, t)| *t).collect::<Vec<_>>();
        let last_second = |times: &[Instant]| times.iter().any(|t| *t + Duration::from_secs(1) >= to);
        let lost = |r: &Received, sent: u64| {
            let distinct: BTreeSet<u64> = r.got.iter().map(|(s, _)| *s).collect();
            sent.saturating_sub(distinct.len() as u64)
        };
        let dl = &self.download;
        let kept = [
            dl.died.is_none() && last_second(&dl.arrivals),
            last_second(&udp_times(&self.replies)),
            last_second(&udp_times(&self.eim)),
        ]
        .iter()
        .filter(|k| **k)
        .count();
        // What the pace had the server send by the end and never arrived: a
        // stall that recovered catches up (the server sends what is due at
        // once), one that never did (no reset, but nothing arrives: the
        // server's segments reach a gateway without the session) counts.
        let since = dl.started.unwrap_or(self.started);
        let due = (to.saturating_duration_since(since).as_secs_f64() * DOWNLOAD_RATE as f64) as u64;
        let bytes_lost = due.saturating_sub(dl.bytes);
        let udp_gap = longest_gap_ending(udp_times(&self.replies), from, to);
        Outage {
            server_ms: ms(longest_gap(accepted, from, to)),
            pod_ms: ms(longest_gap(ok, from, to)),
            download_stall_ms: ms(longest_gap(dl.arrivals.clone(), from, to)),
            udp_gap_ms: ms(udp_gap.0),
            udp_gap_ended: Some(wall_clock(udp_gap.1)),
            eim_gap_ms: ms(longest_gap(udp_times(&self.eim), from, to)),
            kept,
            bytes_lost,
            udp_lost: lost(&self.replies, self.replies_sent),
            eim_lost: lost(&self.eim, self.eim_sent),
            download_died: dl.died.clone(),
            churn_failed: self.churn.iter().filter(|a| a.outcome.is_err()).count(),
            churn_total: self.churn.len(),
            churn_failures: self
                .churn
                .iter()
                .filter_map(|a| a.outcome.as_ref().err().map(|e| (wall_clock(a.started), e.clone())))
                .take(5)
                .collect(),
        }
    }

    /// Sources the server saw that are in `pods` (a pod's own address
    /// reached the outside: a leak).
    pub fn leaked(&self, pods: &[Ipv4Addr]) -> Vec<Source> {
        self.sources.iter().filter(|s| matches!(s.src.ip(), IpAddr::V4(a) if pods.contains(&a))).cloned().collect()
    }
}

/// One ARP frame about a watched IP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArpSeen {
    /// When it arrived.
    pub at: Instant,
    /// The IP it is about (its sender protocol address).
    pub ip: Ipv4Addr,
    /// Its sender MAC.
    pub mac: [u8; 6],
    /// The watch's request it answers (the last one sent for `ip` before it).
    pub request: u64,
    /// A gratuitous ARP (request or reply with target = sender address).
    pub gratuitous: bool,
}

#[derive(Debug, Default)]
struct WatchState {
    seen: Vec<ArpSeen>,
    requests: BTreeMap<Ipv4Addr, u64>,
    leaks: Vec<String>,
    leak_count: u64,
}

/// The ARP watch on the upstream router's link (see the module's docs).
#[derive(Debug)]
pub struct ArpWatch {
    state: Arc<Mutex<WatchState>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<()>>>,
}

/// A double-owner moment: two MACs answering one request, or replies from
/// MACs X, Y, X for one IP within [`FLAP_WINDOW`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DoubleOwner {
    /// When (the later reply).
    pub at: Instant,
    /// The IP.
    pub ip: Ipv4Addr,
    /// The MACs involved.
    pub macs: Vec<[u8; 6]>,
    /// `one request` or `X,Y,X`.
    pub kind: &'static str,
}

/// Replies from X, then Y, then X again within this are two owners.
pub const FLAP_WINDOW: Duration = Duration::from_secs(1);

impl ArpWatch {
    /// Starts watching `dev` in `ns`, asking for each of `ips` every
    /// [`ARP_EVERY`] as `sender` (`mac`, `ip`); `gw_macs` are the gateways'
    /// MACs and `pods` the prefix of the pods' addresses, for the leak check
    /// (a frame with a pod source that is addressed to `mac` or comes from a
    /// gateway).
    pub fn start(
        ns: &NetNs,
        dev: &str,
        sender: ([u8; 6], Ipv4Addr),
        ips: &[Ipv4Addr],
        gw_macs: &[[u8; 6]],
        pods: ipnet::Ipv4Net,
    ) -> Result<Self> {
        let link = RawLink::open(ns, dev)?;
        let state = Arc::new(Mutex::new(WatchState::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, halt, ips, gw_macs) = (state.clone(), stop.clone(), ips.to_vec(), gw_macs.to_vec());
        let thread = std::thread::Builder::new()
            .name("arp-watch".into())
            .spawn(move || -> Result<()> {
                let (mac, me) = sender;
                let pending = RefCell::new(Vec::<ArpSeen>::new());
                let leaks = RefCell::new(Vec::<String>::new());
                let mut req = 0u64;
                while !halt.load(Ordering::Relaxed) {
                    req += 1;
                    for ip in &ips {
                        link.send(&frames::arp_request(mac, me, *ip))?;
                    }
                    let now = req;
                    link.recv_matching(ARP_EVERY, |f| {
                        inspect(f, now, &ips, mac, &gw_macs, pods, &pending, &leaks);
                        false
                    })?;
                    if let Ok(mut s) = st.lock() {
                        s.seen.append(&mut pending.borrow_mut());
                        for ip in &ips {
                            s.requests.insert(*ip, req);
                        }
                        for l in leaks.borrow_mut().drain(..) {
                            s.leak_count += 1;
                            if s.leaks.len() < 20 {
                                s.leaks.push(l);
                            }
                        }
                    }
                }
                Ok(())
            })
            .map_err(io("spawn the ARP watch"))?;
        Ok(Self { state, stop, thread: Some(thread) })
    }

    /// Every ARP frame about a watched IP so far.
    pub fn seen(&self) -> Vec<ArpSeen> {
        self.state.lock().map(|s| s.seen.clone()).unwrap_or_default()
    }

    /// Frames with a pod source seen so far: their count and the first 20.
    pub fn leaks(&self) -> (u64, Vec<String>) {
        self.state.lock().map(|s| (s.leak_count, s.leaks.clone())).unwrap_or_default()
    }

    /// Double-owner moments between `from` and `to`.
    pub fn double_owners(&self, from: Instant, to: Instant) -> Vec<DoubleOwner> {
        let seen: Vec<ArpSeen> = self.seen().into_iter().filter(|s| s.at >= from && s.at <= to).collect();
        double_owners(&seen)
    }

    /// The MACs that answered for `ip` between `from` and `to`, one entry
    /// per run of answers from one MAC: a clean failover is two entries.
    pub fn owners(&self, ip: Ipv4Addr, from: Instant, to: Instant) -> Vec<[u8; 6]> {
        let mut runs: Vec<[u8; 6]> = Vec::new();
        for s in self.seen().into_iter().filter(|s| s.ip == ip && s.at >= from && s.at <= to) {
            if runs.last() != Some(&s.mac) {
                runs.push(s.mac);
            }
        }
        runs
    }

    /// Stops the watch.
    pub fn stop(mut self) -> Result<()> {
        self.halt()
    }

    fn halt(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(|t| t.join()) {
            Some(Ok(r)) => r,
            Some(Err(_)) => Err(LabError::Gateway("the ARP watch panicked".into())),
            None => Ok(()),
        }
    }
}

impl Drop for ArpWatch {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

#[allow(clippy::too_many_arguments)]
fn inspect(
    f: &[u8],
    req: u64,
    ips: &[Ipv4Addr],
    me: [u8; 6],
    gw_macs: &[[u8; 6]],
    pods: ipnet::Ipv4Net,
    pending: &RefCell<Vec<ArpSeen>>,
    leaks: &RefCell<Vec<String>>,
) {
    if let Some(a) = frames::parse_arp(f) {
        let gratuitous = a.spa == a.tpa;
        let reply_to_us = a.op == 2 && a.tha == me;
        if ips.contains(&a.spa) && a.sha != me && (reply_to_us || gratuitous) {
            pending.borrow_mut().push(ArpSeen { at: Instant::now(), ip: a.spa, mac: a.sha, request: req, gratuitous });
        }
        return;
    }
    if let Some(i) = crate::capture::ip_info(f) {
        if let IpAddr::V4(src) = i.src {
            if pods.contains(&src) && (f[..6] == me || gw_macs.contains(&i.eth_src)) {
                leaks.borrow_mut().push(format!("{} -> {} proto {} from {:02x?}", i.src, i.dst, i.proto, i.eth_src));
            }
        }
    }
}

/// The double-owner moments in `seen` (in arrival order).
pub fn double_owners(seen: &[ArpSeen]) -> Vec<DoubleOwner> {
    let mut out = Vec::new();
    // Two MACs answering one request.
    let mut by_req: BTreeMap<(Ipv4Addr, u64), Vec<&ArpSeen>> = BTreeMap::new();
    for s in seen.iter().filter(|s| !s.gratuitous) {
        by_req.entry((s.ip, s.request)).or_default().push(s);
    }
    for ((ip, _), v) in by_req {
        let macs: BTreeSet<[u8; 6]> = v.iter().map(|s| s.mac).collect();
        if macs.len() > 1 {
            let at = v.iter().map(|s| s.at).max().unwrap_or_else(Instant::now);
            out.push(DoubleOwner { at, ip, macs: macs.into_iter().collect(), kind: "one request" });
        }
    }
    // X, Y, X within the window (runs of one MAC: first and last time).
    let ips: BTreeSet<Ipv4Addr> = seen.iter().map(|s| s.ip).collect();
    for ip in ips {
        let mut runs: Vec<([u8; 6], Instant, Instant)> = Vec::new();
        for s in seen.iter().filter(|s| s.ip == ip) {
            match runs.last_mut() {
                Some(r) if r.0 == s.mac => r.2 = s.at,
                _ => runs.push((s.mac, s.at, s.at)),
            }
        }
        for w in runs.windows(3) {
            if w[0].0 == w[2].0 && w[2].1.saturating_duration_since(w[0].2) <= FLAP_WINDOW {
                out.push(DoubleOwner { at: w[2].1, ip, macs: vec![w[0].0, w[1].0], kind: "X,Y,X" });
            }
        }
    }
    out.sort_by_key(|d| d.at);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t0: Instant, ms: u64, mac: u8, request: u64) -> ArpSeen {
        ArpSeen {
            at: t0 + Duration::from_millis(ms),
            ip: Ipv4Addr::new(203, 0, 113, 40),
            mac: [2, 0, 0, 0, 0, mac],
            request,
            gratuitous: false,
        }
    }

    #[test]
    fn a_clean_failover_has_no_double_owner() {
        let t0 = Instant::now();
        let seen = [at(t0, 0, 1, 1), at(t0, 20, 1, 2), at(t0, 4000, 2, 200), at(t0, 4020, 2, 201)];
        assert!(double_owners(&seen).is_empty());
        // Back to the first owner after more than the window: a second move.
        let back = [at(t0, 0, 1, 1), at(t0, 20, 2, 2), at(t0, 1500, 1, 75)];
        assert!(double_owners(&back).is_empty());
    }

    #[test]
    fn two_answers_to_one_request_and_flapping_are_double_owners() {
        let t0 = Instant::now();
        let two = double_owners(&[at(t0, 0, 1, 1), at(t0, 1, 2, 1)]);
        assert_eq!(two.len(), 1);
        assert_eq!(two[0].kind, "one request");
        let flap = double_owners(&[at(t0, 0, 1, 1), at(t0, 20, 2, 2), at(t0, 40, 1, 3)]);
        assert_eq!(flap.iter().map(|d| d.kind).collect::<Vec<_>>(), ["X,Y,X"]);
    }

    #[test]
    fn the_longest_gap_counts_to_the_end() {
        let t0 = Instant::now();
        let ts = vec![t0 + Duration::from_millis(100), t0 + Duration::from_millis(200)];
        assert_eq!(longest_gap(ts, t0, t0 + Duration::from_millis(1200)), Duration::from_millis(1000));
    }
}
