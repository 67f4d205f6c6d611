//! The external server: it tells every client the source address and port
//! it saw, over each protocol the tests use, and remembers what it saw.
//!
//! - HTTP on TCP port 80 (v4 and v6): any request gets
//!   `saw <src> <method> <path> received=<body bytes>\n` and the connection
//!   closes; a request body (`Content-Length`) is read and counted, so a
//!   large upload exercises path MTU discovery. `GET /download/<n>` adds
//!   `n` bytes (`y`, at most [`MAX_DOWNLOAD`]) after that line: a download.
//! - Line echo on TCP port 7: each line `L` gets `saw <src> L\n`; the
//!   connection stays open (the reload test keeps one alive).
//! - UDP echo on port 7 of each server address: a datagram `P` gets
//!   `saw <src> P` from the address it was sent to.
//! - ICMP and ICMPv6 echo: the kernel answers; a raw socket records each
//!   request's source, identifier and payload.
//!
//! Sockets are opened inside the server's namespace and served by threads
//! of this process (or of `egret-lab serve` under `ip netns exec`).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use crate::error::{LabError, Result};
use crate::netns::NetNs;
use crate::plan;

/// A protocol the server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Proto {
    /// TCP (HTTP or line echo).
    Tcp,
    /// UDP echo.
    Udp,
    /// ICMP or ICMPv6 echo request.
    Icmp,
}

impl Proto {
    fn name(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Icmp => "icmp",
        }
    }
}

/// One thing the server saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// Protocol.
    pub proto: Proto,
    /// Source address and port (ICMP: the echo identifier).
    pub src: SocketAddr,
    /// Destination address and port (ICMP: port 0).
    pub dst: SocketAddr,
    /// The request's token: UDP/ICMP payload, the HTTP path, the first echo line.
    pub token: String,
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {} {}", self.proto.name(), self.src, self.dst, self.token)
    }
}

#[derive(Debug, Default)]
struct Journal {
    seen: Mutex<Vec<Seen>>,
    changed: Condvar,
    log: Mutex<Option<std::fs::File>>,
}

impl Journal {
    fn record(&self, s: Seen) {
        if let Ok(mut log) = self.log.lock() {
            if let Some(f) = log.as_mut() {
                let _ = writeln!(f, "{s}");
            }
        }
        if let Ok(mut v) = self.seen.lock() {
            v.push(s);
        }
        self.changed.notify_all();
    }
}

const POLL: Duration = Duration::from_millis(100);

/// The running server. Dropping it stops its threads.
#[derive(Debug)]
pub struct Server {
    stop: Arc<AtomicBool>,
    journal: Arc<Journal>,
    threads: Vec<JoinHandle<()>>,
}

struct Sockets {
    udp: Vec<UdpSocket>,
    tcp: Vec<(TcpListener, u16)>,
    icmp4: UdpSocket,
    icmp6: UdpSocket,
}

fn bind_all() -> Result<Sockets> {
    let mut udp = Vec::new();
    for a in plan::server_addrs() {
        let s = UdpSocket::bind(SocketAddr::new(a, plan::ECHO_PORT))
            .map_err(|e| LabError::io(format!("bind UDP {a}:{}", plan::ECHO_PORT), e))?;
        s.set_read_timeout(Some(POLL)).map_err(|e| LabError::io("UDP read timeout", e))?;
        // Room for a burst of datagrams (the many-flows test sends waves).
        let fd = std::os::fd::OwnedFd::from(s);
        crate::sys::force_recv_buffer(&fd, 8 << 20).map_err(|e| LabError::io("UDP receive buffer", e))?;
        udp.push(UdpSocket::from(fd));
    }
    let mut tcp = Vec::new();
    for port in [plan::HTTP_PORT, plan::ECHO_PORT] {
        for any in [IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V6(Ipv6Addr::UNSPECIFIED)] {
            let addr = SocketAddr::new(any, port);
            let what = format!("listen TCP {addr}");
            let s = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))
                .map_err(|e| LabError::io(&what, e))?;
            if any.is_ipv6() {
                s.set_only_v6(true).map_err(|e| LabError::io(&what, e))?;
            }
            s.set_reuse_address(true).map_err(|e| LabError::io(&what, e))?;
            s.bind(&addr.into()).map_err(|e| LabError::io(&what, e))?;
            s.listen(1024).map_err(|e| LabError::io(&what, e))?;
            // SO_RCVTIMEO bounds accept(), so the loop can notice `stop`.
            s.set_read_timeout(Some(POLL)).map_err(|e| LabError::io(&what, e))?;
            tcp.push((TcpListener::from(s), port));
        }
    }
    let raw = |domain, proto| -> Result<UdpSocket> {
        let s = Socket::new(domain, Type::RAW, Some(proto)).map_err(|e| LabError::io("raw ICMP socket", e))?;
        s.set_read_timeout(Some(POLL)).map_err(|e| LabError::io("raw ICMP timeout", e))?;
        Ok(UdpSocket::from(s))
    };
    Ok(Sockets { udp, tcp, icmp4: raw(Domain::IPV4, Protocol::ICMPV4)?, icmp6: raw(Domain::IPV6, Protocol::ICMPV6)? })
}

impl Server {
    /// Starts the server inside `ns`; `log` also appends every [`Seen`] to a
    /// file, one line each.
    pub fn start(ns: &NetNs, log: Option<PathBuf>) -> Result<Self> {
        let sockets = ns.run_in(bind_all)??;
        Self::serve(sockets, log)
    }

    /// Starts the server in the calling thread's namespace (`egret-lab serve`
    /// runs under `ip netns exec`).
    pub fn start_here(log: Option<PathBuf>) -> Result<Self> {
        Self::serve(bind_all()?, log)
    }

    fn serve(sockets: Sockets, log: Option<PathBuf>) -> Result<Self> {
        let journal = Arc::new(Journal::default());
        if let Some(path) = log {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| LabError::io(format!("open {}", path.display()), e))?;
            if let Ok(mut l) = journal.log.lock() {
                *l = Some(f);
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut threads = Vec::new();
        let mut spawn = |name: String, f: Box<dyn FnOnce() + Send>| -> Result<()> {
            let h =
                std::thread::Builder::new().name(name).spawn(f).map_err(|e| LabError::io("spawn server thread", e))?;
            threads.push(h);
            Ok(())
        };
        for s in sockets.udp {
            let (stop, journal) = (stop.clone(), journal.clone());
            spawn("srv-udp".into(), Box::new(move || udp_echo(s, &stop, &journal)))?;
        }
        for (l, port) in sockets.tcp {
            let (stop, journal) = (stop.clone(), journal.clone());
            spawn(format!("srv-tcp{port}"), Box::new(move || tcp_accept(l, port, &stop, &journal)))?;
        }
        for (s, v6) in [(sockets.icmp4, false), (sockets.icmp6, true)] {
            let (stop, journal) = (stop.clone(), journal.clone());
            spawn("srv-icmp".into(), Box::new(move || icmp_watch(s, v6, &stop, &journal)))?;
        }
        Ok(Self { stop, journal, threads })
    }

    /// Everything seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.journal.seen.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Waits until something matching `pred` has been seen.
    pub fn wait_for(&self, timeout: Duration, pred: impl Fn(&Seen) -> bool) -> Option<Seen> {
        let deadline = Instant::now() + timeout;
        let mut guard = self.journal.seen.lock().ok()?;
        loop {
            if let Some(s) = guard.iter().find(|s| pred(s)) {
                return Some(s.clone());
            }
            let left = deadline.checked_duration_since(Instant::now())?;
            guard = self.journal.changed.wait_timeout(guard, left).ok()?.0;
        }
    }

    /// Waits for the ICMP echo request carrying `token`.
    pub fn wait_icmp(&self, token: &str, timeout: Duration) -> Option<Seen> {
        self.wait_for(timeout, |s| s.proto == Proto::Icmp && s.token == token)
    }

    /// Blocks until the server is stopped from elsewhere (the CLI's `serve`).
    pub fn join(mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted)
}

fn udp_echo(s: UdpSocket, stop: &AtomicBool, journal: &Journal) {
    let local = s.local_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        match s.recv_from(&mut buf) {
            Ok((n, src)) => {
                let token = String::from_utf8_lossy(&buf[..n]).into_owned();
                let reply = format!("saw {src} {token}");
                let _ = s.send_to(reply.as_bytes(), src);
                journal.record(Seen { proto: Proto::Udp, src, dst: local, token });
            }
            Err(e) if would_block(&e) => {}
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

fn tcp_accept(l: TcpListener, port: u16, stop: &Arc<AtomicBool>, journal: &Arc<Journal>) {
    while !stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((conn, _)) => {
                let (stop, journal) = (stop.clone(), journal.clone());
                let _ = std::thread::Builder::new().name(format!("srv-conn{port}")).spawn(move || {
                    let _ = conn.set_read_timeout(Some(POLL));
                    if port == plan::HTTP_PORT {
                        http_conn(conn, &stop, &journal);
                    } else {
                        echo_conn(conn, &stop, &journal);
                    }
                });
            }
            Err(e) if would_block(&e) => {}
            Err(_) => std::thread::sleep(POLL),
        }
    }
}

fn addrs(conn: &TcpStream) -> Option<(SocketAddr, SocketAddr)> {
    Some((conn.peer_addr().ok()?, conn.local_addr().ok()?))
}

/// Reads into `buf` until `stop`, a timeout of `idle`, EOF or an error.
fn read_some(conn: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool, idle: Duration) -> Option<usize> {
    let start = Instant::now();
    while !stop.load(Ordering::Relaxed) && start.elapsed() < idle {
        match conn.read(buf) {
            Ok(0) => return None,
            Ok(n) => return Some(n),
            Err(e) if would_block(&e) => {}
            Err(_) => return None,
        }
    }
    None
}

/// The largest download `GET /download/<n>` serves.
pub const MAX_DOWNLOAD: usize = 64 << 20;

fn http_conn(mut conn: TcpStream, stop: &AtomicBool, journal: &Journal) {
    let Some((src, dst)) = addrs(&conn) else { return };
    let idle = Duration::from_secs(30);
    let mut head = Vec::new();
    let mut chunk = vec![0u8; 65536];
    let end = loop {
        if let Some(i) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if head.len() > 65536 {
            return;
        }
        let Some(n) = read_some(&mut conn, &mut chunk, stop, idle) else { return };
        head.extend_from_slice(&chunk[..n]);
    };
    let text = String::from_utf8_lossy(&head[..end]).into_owned();
    let mut words = text.split_whitespace();
    let method = words.next().unwrap_or("?").to_string();
    let path = words.next().unwrap_or("?").to_string();
    let length: usize = text
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let mut received = head.len() - end;
    while received < length {
        let Some(n) = read_some(&mut conn, &mut chunk, stop, idle) else { break };
        received += n;
    }
    journal.record(Seen { proto: Proto::Tcp, src, dst, token: path.clone() });
    let body = format!("saw {src} {method} {path} received={received}\n");
    let download = path.strip_prefix("/download/").and_then(|n| n.parse().ok()).unwrap_or(0usize).min(MAX_DOWNLOAD);
    let reply = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len() + download
    );
    let _ = conn.write_all(reply.as_bytes());
    let filler = vec![b'y'; 64 * 1024];
    let mut left = download;
    while left > 0 {
        let n = left.min(filler.len());
        if conn.write_all(&filler[..n]).is_err() {
            break;
        }
        left -= n;
    }
    let _ = conn.shutdown(std::net::Shutdown::Write);
    // Drain until the client closes, so the close is orderly (no RST).
    while read_some(&mut conn, &mut chunk, stop, Duration::from_secs(5)).is_some() {}
}

fn echo_conn(mut conn: TcpStream, stop: &AtomicBool, journal: &Journal) {
    let Some((src, dst)) = addrs(&conn) else { return };
    let mut pending = Vec::new();
    let mut chunk = vec![0u8; 4096];
    let mut first = true;
    // Idle connections are kept for an hour: the reload test holds one open.
    while let Some(n) = read_some(&mut conn, &mut chunk, stop, Duration::from_secs(3600)) {
        pending.extend_from_slice(&chunk[..n]);
        while let Some(i) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line[..i]).trim_end_matches('\r').to_string();
            if first {
                journal.record(Seen { proto: Proto::Tcp, src, dst, token: line.clone() });
                first = false;
            }
            if conn.write_all(format!("saw {src} {line}\n").as_bytes()).is_err() {
                return;
            }
        }
    }
}

fn icmp_watch(s: UdpSocket, v6: bool, stop: &AtomicBool, journal: &Journal) {
    let mut buf = vec![0u8; 65536];
    while !stop.load(Ordering::Relaxed) {
        let (n, from) = match s.recv_from(&mut buf) {
            Ok(x) => x,
            Err(e) if would_block(&e) => continue,
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        };
        let pkt = &buf[..n];
        // A raw IPv4 socket delivers the IP header; a raw ICMPv6 socket does not.
        let (icmp, src, dst) = if v6 {
            (pkt, from.ip(), IpAddr::V6(plan::SERVER6))
        } else {
            let Some(&vihl) = pkt.first() else { continue };
            let ihl = usize::from(vihl & 0x0f) * 4;
            if pkt.len() < ihl.max(20) {
                continue;
            }
            let a = |o: usize| IpAddr::V4(Ipv4Addr::new(pkt[o], pkt[o + 1], pkt[o + 2], pkt[o + 3]));
            (&pkt[ihl..], a(12), a(16))
        };
        let request = if v6 { 128 } else { 8 };
        if icmp.len() < 8 || icmp[0] != request {
            continue;
        }
        let ident = u16::from_be_bytes([icmp[4], icmp[5]]);
        let token = String::from_utf8_lossy(&icmp[8..]).trim_end_matches('\0').to_string();
        journal.record(Seen {
            proto: Proto::Icmp,
            src: SocketAddr::new(src, ident),
            dst: SocketAddr::new(dst, 0),
            token,
        });
    }
}
