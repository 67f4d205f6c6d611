//! Clients run from the pods: each opens its socket inside the pod's
//! namespace and reads back what the server says it saw ("saw <src> ...",
//! see [`crate::server`]).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, Socket, Type};

use crate::error::{LabError, Result};
use crate::netns::NetNs;

/// What came back from the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The source the server saw (after translation).
    pub seen: SocketAddr,
    /// The client socket's own address (before translation).
    pub local: SocketAddr,
    /// The rest of the server's answer (token, or HTTP details).
    pub rest: String,
}

/// Parses `saw <addr> <rest>`.
pub fn parse_saw(text: &str) -> Option<(SocketAddr, String)> {
    let t = text.strip_prefix("saw ")?;
    let (addr, rest) = t.split_once(' ').unwrap_or((t, ""));
    Some((addr.trim().parse().ok()?, rest.trim_end_matches('\n').to_string()))
}

fn unspecified(to: &SocketAddr) -> SocketAddr {
    match to {
        SocketAddr::V4(_) => SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), 0),
        SocketAddr::V6(_) => SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0),
    }
}

/// Opens a UDP socket in `ns` connected to `to`.
pub fn udp_socket(ns: &NetNs, to: SocketAddr) -> Result<UdpSocket> {
    udp_socket_from(ns, 0, to)
}

/// Opens a UDP socket in `ns` on local port `port` (0: any), connected to `to`.
pub fn udp_socket_from(ns: &NetNs, port: u16, to: SocketAddr) -> Result<UdpSocket> {
    ns.run_in(|| -> Result<UdpSocket> {
        let mut local = unspecified(&to);
        local.set_port(port);
        let s = UdpSocket::bind(local).map_err(|e| LabError::io(format!("bind UDP {local}"), e))?;
        s.connect(to).map_err(|e| LabError::io(format!("connect UDP {to}"), e))?;
        Ok(s)
    })?
}

/// Sends `token` on `s` and waits for the echo carrying it, resending up to
/// `tries` times (UDP may lose a datagram; the lab counts how often).
pub fn udp_exchange(s: &UdpSocket, token: &str, tries: u32, wait: Duration) -> Result<(Reply, u32)> {
    let local = s.local_addr().map_err(|e| LabError::io("UDP local address", e))?;
    let peer = s.peer_addr().map_err(|e| LabError::io("UDP peer address", e))?;
    let mut buf = vec![0u8; 2048];
    for attempt in 0..tries.max(1) {
        s.send(token.as_bytes()).map_err(|e| LabError::io(format!("send UDP to {peer}"), e))?;
        let deadline = Instant::now() + wait;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            s.set_read_timeout(Some(left.max(Duration::from_millis(1)))).map_err(|e| LabError::io("UDP timeout", e))?;
            match s.recv(&mut buf) {
                Ok(n) => {
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let Some((seen, rest)) = parse_saw(&text) else {
                        return Err(LabError::Unexpected { from: peer.to_string(), got: text.into_owned() });
                    };
                    if rest == token {
                        return Ok((Reply { seen, local, rest }, attempt));
                    }
                    // A late answer to an earlier token: keep waiting.
                }
                Err(e) if interrupted(&e) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
                Err(e) => return Err(LabError::io(format!("recv UDP from {peer}"), e)),
            }
        }
    }
    Err(LabError::Timeout {
        what: format!("UDP echo of {token:?} from {peer} via {local}"),
        after: wait * tries.max(1),
    })
}

/// One UDP echo from `ns` to `to` with payload `token`.
pub fn udp_echo(ns: &NetNs, to: SocketAddr, token: &str) -> Result<Reply> {
    let s = udp_socket(ns, to)?;
    udp_exchange(&s, token, 3, Duration::from_secs(1)).map(|(r, _)| r)
}

/// Whether a receive was cut short without an answer, to be tried again.
/// EINTR comes even with no handler installed: a receive on a socket with
/// SO_RCVTIMEO fails so when the process is stopped and continued
/// (signal(7); seen once in a fresh-clone run).
fn interrupted(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::Interrupted
}

/// `recv()`, called again when EINTR cut it short (see [`interrupted`]):
/// the socket's read timeout then starts over, so a wait is at most a few
/// timeouts long.
fn retried<T>(mut recv: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    for _ in 0..3 {
        match recv() {
            Err(e) if interrupted(&e) => continue,
            r => return r,
        }
    }
    recv()
}

/// `s.recv(buf)`, received again when EINTR cut it short ([`retried`]).
pub fn udp_recv(s: &UdpSocket, buf: &mut [u8]) -> std::io::Result<usize> {
    retried(|| s.recv(buf))
}

/// `s.recv_from(buf)`, as [`udp_recv`].
pub fn udp_recv_from(s: &UdpSocket, buf: &mut [u8]) -> std::io::Result<(usize, SocketAddr)> {
    retried(|| s.recv_from(buf))
}

/// Waits `window` on `s` and fails if a datagram arrives in it (the
/// unsolicited-inbound checks). A receive cut short by EINTR waits on for
/// the rest of the window.
pub fn udp_expect_silence(s: &UdpSocket, window: Duration) -> Result<()> {
    let peer = s.peer_addr().map_err(|e| LabError::io("UDP peer address", e))?;
    let deadline = Instant::now() + window;
    let mut buf = vec![0u8; 2048];
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        s.set_read_timeout(Some(left.max(Duration::from_millis(1)))).map_err(|e| LabError::io("UDP timeout", e))?;
        match s.recv(&mut buf) {
            Ok(n) => {
                return Err(LabError::Unexpected {
                    from: peer.to_string(),
                    got: format!("a datagram where none may come: {:?}", String::from_utf8_lossy(&buf[..n])),
                })
            }
            Err(e) if interrupted(&e) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
            Err(e) => return Err(LabError::io(format!("recv UDP from {peer}"), e)),
        }
    }
    Ok(())
}

/// Opens a TCP connection from `ns`.
pub fn tcp_connect(ns: &NetNs, to: SocketAddr, timeout: Duration) -> Result<TcpStream> {
    let s = ns
        .run_in(|| TcpStream::connect_timeout(&to, timeout))?
        .map_err(|e| LabError::io(format!("TCP connect from {} to {to}", ns.name()), e))?;
    s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| LabError::io("TCP read timeout", e))?;
    s.set_write_timeout(Some(Duration::from_secs(30))).map_err(|e| LabError::io("TCP write timeout", e))?;
    Ok(s)
}

/// An HTTP request from `ns` (GET, or POST with `body_len` bytes); returns
/// what the server saw. The connection closes after the answer.
pub fn http(ns: &NetNs, to: SocketAddr, path: &str, body_len: usize) -> Result<Reply> {
    let mut s = tcp_connect(ns, to, Duration::from_secs(5))?;
    let local = s.local_addr().map_err(|e| LabError::io("TCP local address", e))?;
    let head = if body_len == 0 {
        format!("GET {path} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n")
    } else {
        format!("POST {path} HTTP/1.1\r\nHost: {to}\r\nContent-Length: {body_len}\r\nConnection: close\r\n\r\n")
    };
    let io = |what: &str, e| LabError::io(format!("HTTP {what} {to} from {local}"), e);
    s.write_all(head.as_bytes()).map_err(|e| io("send to", e))?;
    let chunk = vec![b'x'; 64 * 1024];
    let mut left = body_len;
    while left > 0 {
        let n = left.min(chunk.len());
        s.write_all(&chunk[..n]).map_err(|e| io("upload to", e))?;
        left -= n;
    }
    let mut answer = String::new();
    s.read_to_string(&mut answer).map_err(|e| io("read from", e))?;
    let body = answer.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    let (seen, rest) =
        parse_saw(body).ok_or_else(|| LabError::Unexpected { from: to.to_string(), got: answer.clone() })?;
    Ok(Reply { seen, local, rest })
}

/// A download of `bytes` bytes from the server's HTTP port
/// (`GET /download/<bytes>`): what the server saw, and how many bytes came
/// after its `saw` line.
pub fn download(ns: &NetNs, to: SocketAddr, bytes: usize) -> Result<(Reply, usize)> {
    let mut s = tcp_connect(ns, to, Duration::from_secs(5))?;
    let local = s.local_addr().map_err(|e| LabError::io("TCP local address", e))?;
    let io = |what: &str, e| LabError::io(format!("download {what} {to} from {local}"), e);
    let head = format!("GET /download/{bytes} HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n");
    s.write_all(head.as_bytes()).map_err(|e| io("request to", e))?;
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).map_err(|e| io("read from", e))?;
    let unexpected = || LabError::Unexpected {
        from: to.to_string(),
        got: String::from_utf8_lossy(&answer[..answer.len().min(300)]).into_owned(),
    };
    let body = answer.windows(4).position(|w| w == b"\r\n\r\n").map(|i| &answer[i + 4..]).ok_or_else(unexpected)?;
    let line_end = body.iter().position(|&b| b == b'\n').ok_or_else(unexpected)?;
    let (seen, rest) = parse_saw(&String::from_utf8_lossy(&body[..=line_end])).ok_or_else(unexpected)?;
    let filler = &body[line_end + 1..];
    if filler.iter().any(|&b| b != b'y') {
        return Err(unexpected());
    }
    Ok((Reply { seen, local, rest }, filler.len()))
}

/// A long-lived TCP line-echo connection (server port 7).
#[derive(Debug)]
pub struct TcpSession {
    stream: TcpStream,
    pending: Vec<u8>,
    /// The client socket's own address.
    pub local: SocketAddr,
}

impl TcpSession {
    /// Connects from `ns`.
    pub fn connect(ns: &NetNs, to: SocketAddr) -> Result<Self> {
        let stream = tcp_connect(ns, to, Duration::from_secs(5))?;
        let local = stream.local_addr().map_err(|e| LabError::io("TCP local address", e))?;
        Ok(Self { stream, pending: Vec::new(), local })
    }

    /// Sends a line and returns the source the server saw for it.
    pub fn line(&mut self, text: &str) -> Result<Reply> {
        let io = |e| LabError::io(format!("TCP echo line {text:?} via {}", self.local), e);
        self.stream.write_all(format!("{text}\n").as_bytes()).map_err(io)?;
        let mut chunk = [0u8; 1024];
        loop {
            if let Some(i) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=i).collect();
                let line = String::from_utf8_lossy(&line).into_owned();
                let (seen, rest) = parse_saw(&line)
                    .ok_or_else(|| LabError::Unexpected { from: "TCP echo".into(), got: line.clone() })?;
                return Ok(Reply { seen, local: self.local, rest });
            }
            let n = match self.stream.read(&mut chunk) {
                Err(e) if interrupted(&e) => continue,
                r => r.map_err(|e| LabError::io(format!("TCP echo read via {}", self.local), e))?,
            };
            if n == 0 {
                return Err(LabError::Unexpected { from: "TCP echo".into(), got: "connection closed".into() });
            }
            self.pending.extend_from_slice(&chunk[..n]);
        }
    }
}

/// What an echo reply said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pong {
    /// Who answered.
    pub from: IpAddr,
    /// The echo identifier the pod's socket used.
    pub ident: u16,
}

/// Sends one ICMP (or ICMPv6) echo request with payload `token` from `ns` to
/// `dst` through an unprivileged ping socket, and waits for its reply.
pub fn ping(ns: &NetNs, dst: IpAddr, token: &str, timeout: Duration) -> Result<Pong> {
    let (domain, proto, request, reply) = match dst {
        IpAddr::V4(_) => (Domain::IPV4, Protocol::ICMPV4, 8u8, 0u8),
        IpAddr::V6(_) => (Domain::IPV6, Protocol::ICMPV6, 128, 129),
    };
    let s = ns
        .run_in(|| Socket::new(domain, Type::DGRAM, Some(proto)))?
        .map_err(|e| LabError::io(format!("ping socket in {}", ns.name()), e))?;
    let s = UdpSocket::from(s);
    s.connect(SocketAddr::new(dst, 0)).map_err(|e| LabError::io(format!("ping connect {dst}"), e))?;
    let mut msg = vec![request, 0, 0, 0, 0, 0, 0, 1];
    msg.extend_from_slice(token.as_bytes());
    let deadline = Instant::now() + timeout;
    let mut buf = vec![0u8; 2048];
    // Up to three requests (same sequence number), as ping would retry.
    for _ in 0..3 {
        s.send(&msg).map_err(|e| LabError::io(format!("ping {dst}"), e))?;
        let round = Instant::now() + timeout / 3;
        while let Some(left) = round.min(deadline).checked_duration_since(Instant::now()) {
            s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(|e| LabError::io("ping timeout", e))?;
            match s.recv_from(&mut buf) {
                Ok((n, from)) => {
                    let r = &buf[..n];
                    if r.len() >= 8 && r[0] == reply && &r[8..] == token.as_bytes() {
                        return Ok(Pong { from: from.ip(), ident: u16::from_be_bytes([r[4], r[5]]) });
                    }
                }
                Err(e) if interrupted(&e) => {}
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
                Err(e) => return Err(LabError::io(format!("ping reply from {dst}"), e)),
            }
        }
    }
    Err(LabError::Timeout { what: format!("echo reply from {dst} to {}", ns.name()), after: timeout })
}

/// The path MTU the namespace's kernel has cached towards `dst`
/// (`ip route get`), if any.
pub fn cached_pmtu(ns: &NetNs, dst: IpAddr) -> Result<Option<u32>> {
    let out = ns.ip(&["route", "get", &dst.to_string()])?;
    let mut words = out.split_whitespace();
    while let Some(w) = words.next() {
        if w == "mtu" {
            return Ok(words.next().and_then(|v| v.parse().ok()));
        }
    }
    Ok(None)
}

/// Sends whole IP packets (headers included: fragments, say) from `ns` to
/// `dst` through a raw socket (`IPPROTO_RAW`: `IP_HDRINCL`, or
/// `IPV6_HDRINCL` since Linux 4.5), in the order given. The kernel routes
/// each as it is, and fills in only the IPv4 header checksum.
pub fn send_ip_packets(ns: &NetNs, dst: IpAddr, packets: &[Vec<u8>]) -> Result<()> {
    ns.run_in(|| -> Result<()> {
        let domain = if dst.is_ipv4() { Domain::IPV4 } else { Domain::IPV6 };
        let s = Socket::new(domain, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW)))
            .map_err(|e| LabError::io("raw IPPROTO_RAW socket (root)", e))?;
        let to = socket2::SockAddr::from(SocketAddr::new(dst, 0));
        for p in packets {
            s.send_to(p, &to).map_err(|e| LabError::io(format!("send a {}-byte IP packet to {dst}", p.len()), e))?;
        }
        Ok(())
    })?
}
