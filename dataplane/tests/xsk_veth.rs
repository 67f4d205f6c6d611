//! AF_XDP sockets and the worker loop on veth pairs between network
//! namespaces this test creates and always deletes (copy mode; TEST-NET
//! addresses only). Needs root, `ip` (iproute2) and `ethtool`.
//!
//! - `bounce_returns_the_exact_frames`: one socket, a handler that swaps MAC
//!   addresses; every UDP frame the peer sends comes back byte for byte.
//! - `two_arm_forwards_between_interfaces_over_one_umem`: frames received on
//!   interface A leave on interface B (socket sharing A's UMEM) and are
//!   captured, rewritten exactly as the handler said, in B's peer namespace.
//! - `full_tx_ring_refuses_without_panic_then_resumes`: with no kick, a
//!   copy-mode TX ring fills; further transmits are refused (frame handed
//!   back, counted), and after the kick every queued frame leaves.
//! - `tiny_rings_under_a_flood_never_overrun_then_traffic_resumes`: TX ring
//!   16 against RX batches of 64 and a pool smaller than the rings need: the
//!   worker caps batches at TX room, the kernel counts what overflowed, and
//!   paced traffic afterwards all comes back.
//! - `bounce_throughput` (ignored; run by hand): packets per second.

// Test-only crate: helpers outside `#[test]` fns may panic and print.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::io::Read;
use std::net::UdpSocket;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use egret_dataplane::netns::{self, NetnsGuard};
use egret_dataplane::worker::{
    Action, FrameHandler, Frames, HoldEvent, HoldKey, LoopStats, LoopStatsSnapshot, RxInfo, Worker, WorkerConfig,
};
use egret_dataplane::xsk::test_prog::{XdpMode, XskRedirectProg};
use egret_dataplane::xsk::{
    BindMode, PortId, PortSpec, SocketConfig, UmemConfig, XskConfig, XskCounters, XskCountersSnapshot, XskPorts,
};

/// The tests share the two cores: run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const MAGIC: &[u8; 8] = b"EGRETXSK";

// ---------------------------------------------------------------- namespaces

/// A network namespace deleted on drop (also when the test panics), with
/// IPv6 off: no autoconfiguration noise on the links.
struct Netns {
    guard: NetnsGuard,
}

impl Netns {
    fn new(tag: &str) -> Self {
        assert!(is_root(), "the AF_XDP namespace tests need root (CAP_NET_ADMIN, CAP_BPF)");
        let guard = NetnsGuard::unique("egx", &[tag])
            .sysctl("net.ipv6.conf.all.disable_ipv6", "1")
            .sysctl("net.ipv6.conf.default.disable_ipv6", "1")
            .create()
            .unwrap_or_else(|e| panic!("{e}"));
        Self { guard }
    }

    fn name(&self) -> &str {
        self.guard.name(0)
    }

    fn ip(&self, args: &[&str]) {
        let mut v = vec!["ip", "-n", self.name()];
        v.extend_from_slice(args);
        run(&v);
    }

    fn exec(&self, args: &[&str]) {
        let mut v = vec!["ip", "netns", "exec", self.name()];
        v.extend_from_slice(args);
        run(&v);
    }

    fn mac(&self, dev: &str) -> [u8; 6] {
        let out = Command::new("ip").args(["-n", self.name(), "-br", "link", "show", "dev", dev]).output().expect("ip");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let field = text.split_whitespace().nth(2).unwrap_or_default();
        let bytes: Vec<u8> = field.split(':').filter_map(|h| u8::from_str_radix(h, 16).ok()).collect();
        bytes.try_into().unwrap_or_else(|_| panic!("no MAC for {dev} in {}: {text:?}", self.name()))
    }

    /// Run `f` on a new thread inside this namespace.
    fn spawn<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> JoinHandle<T> {
        let name = self.name().to_owned();
        std::thread::spawn(move || {
            netns::enter_named(&name).expect("setns");
            f()
        })
    }
}

fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("spawn");
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

// ---------------------------------------------------------------- frames

/// Payload of datagram `seq`: magic, sequence number, a pattern from `seq`.
fn payload(seq: u32, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(len);
    p.extend_from_slice(MAGIC);
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend((12..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(seq) as u8));
    p
}

/// The sequence number of an IPv4/UDP test frame, if it is one.
fn test_seq(frame: &[u8]) -> Option<u32> {
    if frame.len() < 14 + 20 + 8 + 12 || frame[12..14] != [0x08, 0x00] || frame[23] != 17 {
        return None;
    }
    let ihl = usize::from(frame[14] & 0x0f) * 4;
    let p = frame.get(14 + ihl + 8..)?;
    if p.len() < 12 || &p[..8] != MAGIC {
        return None;
    }
    Some(u32::from_be_bytes([p[8], p[9], p[10], p[11]]))
}

/// An AF_PACKET socket seeing every frame of its namespace (both directions).
#[allow(unsafe_code)] // one setsockopt: socket2 has no SO_RCVBUFFORCE
fn capture() -> socket2::Socket {
    // ETH_P_ALL in network byte order.
    let eth_p_all = i32::from(0x0003u16.to_be());
    let s =
        socket2::Socket::new(socket2::Domain::PACKET, socket2::Type::RAW, Some(eth_p_all.into())).expect("AF_PACKET");
    s.set_read_timeout(Some(Duration::from_millis(50))).expect("timeout");
    // Room for every frame of a test even when the collecting thread is not
    // scheduled for a while (the default buffer holds a few hundred: a run
    // beside another test missed 203 of 2,000 sent frames). SO_RCVBUFFORCE:
    // root, past rmem_max.
    let bytes: libc::c_int = 64 << 20;
    // SAFETY: a valid socket and a c_int option value of the length given.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&s),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", std::io::Error::last_os_error());
    s
}

/// Read frames until `done(frames)` or `deadline`; keeps test frames only.
fn collect(sock: &mut socket2::Socket, deadline: Instant, mut done: impl FnMut(&[Vec<u8>]) -> bool) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut buf = vec![0u8; 4096];
    while Instant::now() < deadline && !done(&frames) {
        if let Ok(n) = sock.read(&mut buf) {
            if test_seq(&buf[..n]).is_some() {
                frames.push(buf[..n].to_vec());
            }
        }
    }
    frames
}

/// Send `count` datagrams from `seq0`, pausing every `burst` to stay under
/// the capture socket's buffer.
fn send_udp(sock: &UdpSocket, to: &str, seq0: u32, count: u32, len: usize, burst: u32) {
    for i in 0..count {
        sock.send_to(&payload(seq0 + i, len), to).expect("send");
        if burst > 0 && (i + 1) % burst == 0 {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// From the peer: `n` 100-byte datagrams to 192.0.2.1:9 (pausing every
/// `burst`), capturing until both directions' frames are in (or 10 s).
fn send_and_capture(peer: &Netns, n: u32, burst: u32) -> Vec<Vec<u8>> {
    peer.spawn(move || {
        let mut cap = capture();
        let udp = UdpSocket::bind("192.0.2.2:40000").expect("bind");
        let sender = std::thread::spawn(move || send_udp(&udp, "192.0.2.1:9", 0, n, 100, burst));
        let frames = collect(&mut cap, Instant::now() + Duration::from_secs(10), |f| f.len() >= 2 * n as usize);
        sender.join().expect("sender");
        frames
    })
    .join()
    .expect("peer thread")
}

// ---------------------------------------------------------------- handlers

/// Swap destination and source MAC, send back out of the receiving port.
struct Bounce;

impl FrameHandler for Bounce {
    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, _now: Instant) -> Action {
        if len < 14 {
            return Action::Drop;
        }
        let mut dst = [0u8; 6];
        dst.copy_from_slice(&buf[0..6]);
        buf.copy_within(6..12, 0);
        buf[6..12].copy_from_slice(&dst);
        Action::Transmit { port: rx.port, len }
    }
}

/// Bounce, a batch at a time: looks at (peeks) up to `PIECE` frames ahead,
/// then handles them, checking each is the frame peeked, byte for byte,
/// in order; every third batch it leaves its last piece unhandled, for
/// the worker to hand to `handle` one frame at a time.
#[derive(Default)]
struct PeekingBounce {
    batches: u64,
    peeked: std::collections::VecDeque<Vec<u8>>,
    in_batch: u64,
    one_by_one: u64,
    longest_batch: usize,
    mismatched: u64,
}

impl PeekingBounce {
    const PIECE: usize = 48;
}

impl FrameHandler for PeekingBounce {
    fn handle_batch(&mut self, frames: &mut Frames<'_>) {
        self.batches += 1;
        self.longest_batch = self.longest_batch.max(frames.len());
        let (rx, now) = (frames.rx(), frames.now());
        while !frames.is_empty() {
            let n = frames.len().min(Self::PIECE);
            if self.batches.is_multiple_of(3) && n == frames.len() {
                return;
            }
            for i in 0..n {
                let f = frames.peek(i).expect("a frame within the batch").to_vec();
                self.peeked.push_back(f);
            }
            assert!(frames.peek(frames.len()).is_none(), "nothing past the batch");
            frames.handle(n, |buf, len| {
                if self.peeked.pop_front().as_deref() != Some(&buf[..len]) {
                    self.mismatched += 1;
                }
                self.in_batch += 1;
                Bounce.handle(buf, len, rx, now)
            });
        }
    }

    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, now: Instant) -> Action {
        self.one_by_one += 1;
        Bounce.handle(buf, len, rx, now)
    }
}

/// Bounce, holding every fourth frame (by its sequence number) under one
/// of eight next hops, each offered back at once by the worker
/// (`release`): checks that every held frame is queued (`held`), comes
/// back once, and in its next hop's order.
#[derive(Default)]
struct HoldingBounce {
    held: u64,
    queued: u64,
    overflowed: u64,
    released: std::collections::BTreeMap<u8, Vec<u32>>,
}

impl HoldingBounce {
    fn next_hop(seq: u32) -> HoldKey {
        HoldKey::NextHop(0, std::net::IpAddr::from([192, 0, 2, 100 + (seq / 4 % 8) as u8]))
    }
}

impl FrameHandler for HoldingBounce {
    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, now: Instant) -> Action {
        match test_seq(&buf[..len]) {
            Some(seq) if seq % 4 == 0 => {
                self.held += 1;
                Action::Hold { key: Self::next_hop(seq), len }
            }
            _ => Bounce.handle(buf, len, rx, now),
        }
    }

    fn release(&mut self, key: HoldKey, buf: &mut [u8], len: usize, now: Instant) -> Option<Action> {
        let (HoldKey::NextHop(_, std::net::IpAddr::V4(hop)), Some(seq)) = (key, test_seq(&buf[..len])) else {
            return Some(Action::Drop);
        };
        self.released.entry(hop.octets()[3]).or_default().push(seq);
        Some(Bounce.handle(buf, len, RxInfo { port: PortId(0), queue: 0 }, now))
    }

    fn held(&mut self, _key: HoldKey, event: HoldEvent) {
        match event {
            HoldEvent::Queued => self.queued += 1,
            HoldEvent::Overflow | HoldEvent::Expired => self.overflowed += 1,
        }
    }
}

/// Two-arm: frames from port 0 get B-side MACs and leave on port 1; anything
/// else is dropped.
struct Forward {
    dst: [u8; 6],
    src: [u8; 6],
    ticks: u64,
}

impl FrameHandler for Forward {
    fn handle(&mut self, buf: &mut [u8], len: usize, rx: RxInfo, _now: Instant) -> Action {
        if rx.port != PortId(0) || test_seq(&buf[..len]).is_none() {
            return Action::Drop;
        }
        buf[0..6].copy_from_slice(&self.dst);
        buf[6..12].copy_from_slice(&self.src);
        Action::Transmit { port: PortId(1), len }
    }

    fn tick(&mut self, _now: Instant) {
        self.ticks += 1;
    }
}

// ---------------------------------------------------------------- gateway

type Finished<H> = (LoopStatsSnapshot, Vec<XskCountersSnapshot>, H, u64);

struct Gateway<H> {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Finished<H>>>,
    /// Live views of the worker's counters (read while it runs).
    stats: Arc<LoopStats>,
    counters: Vec<Arc<XskCounters>>,
}

impl<H: FrameHandler + Send + 'static> Gateway<H> {
    /// Start a worker inside `ns` over `(interface, queue)` ports; the test
    /// program steers `xdp_on`'s queues to the sockets of that interface.
    fn start(
        ns: &Netns,
        ports: &[(&str, u32)],
        xdp_on: &[&str],
        config: XskConfig,
        worker_config: WorkerConfig,
        handler: H,
    ) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        type Ready = Result<(Arc<LoopStats>, Vec<Arc<XskCounters>>), String>;
        let (ready_tx, ready_rx) = mpsc::channel::<Ready>();
        let ports: Vec<(String, u32)> = ports.iter().map(|(d, q)| ((*d).to_owned(), *q)).collect();
        let xdp_on: Vec<String> = xdp_on.iter().map(|d| (*d).to_owned()).collect();
        let stop2 = Arc::clone(&stop);
        let thread = ns.spawn(move || {
            let setup = || -> Result<_, String> {
                let specs: Vec<PortSpec> = ports
                    .iter()
                    .map(|(d, q)| {
                        Ok(PortSpec { ifindex: netns::ifindex(d).map_err(|e| format!("{d}: {e}"))?, queue: *q })
                    })
                    .collect::<Result<_, String>>()?;
                let xsk = XskPorts::open(&config, &specs).map_err(|e| e.to_string())?;
                let mut progs = Vec::new();
                for dev in &xdp_on {
                    let ifindex = netns::ifindex(dev).map_err(|e| e.to_string())?;
                    let prog = XskRedirectProg::attach(ifindex, 4, XdpMode::Driver).map_err(|e| e.to_string())?;
                    for (i, s) in specs.iter().enumerate() {
                        if s.ifindex == ifindex {
                            let fd = xsk.raw_fd(PortId(i as u16)).ok_or("no fd")?;
                            prog.insert(s.queue, fd).map_err(|e| e.to_string())?;
                        }
                    }
                    progs.push(prog);
                }
                let worker = Worker::new(xsk, handler, worker_config, stop2).map_err(|e| e.to_string())?;
                Ok((worker, progs))
            };
            let (mut worker, progs) = match setup() {
                Ok(v) => {
                    let counters =
                        (0..v.0.ports().len()).filter_map(|i| v.0.ports().counters(PortId(i as u16))).collect();
                    let _ = ready_tx.send(Ok((v.0.stats(), counters)));
                    v
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e.clone()));
                    panic!("gateway setup: {e}");
                }
            };
            worker.run().expect("worker loop");
            drop(progs);
            let stats = worker.stats().snapshot();
            let counters: Vec<XskCountersSnapshot> = (0..worker.ports().len())
                .filter_map(|i| worker.ports().counters(PortId(i as u16)))
                .map(|c| c.snapshot())
                .collect();
            let bad = worker.ports().frame_pool_bad_releases();
            let (_ports, handler) = worker.into_parts();
            (stats, counters, handler, bad)
        });
        let (stats, counters) = match ready_rx.recv_timeout(Duration::from_secs(10)) {
            Ok(Ok(v)) => v,
            Ok(Err(e)) => panic!("gateway setup failed: {e}"),
            Err(e) => panic!("gateway did not start: {e}"),
        };
        Self { stop, thread: Some(thread), stats, counters }
    }

    /// Wait (up to 5 s) until `cond` holds on the live counters.
    fn wait_until(&self, what: &str, cond: impl Fn(&LoopStatsSnapshot, &[XskCountersSnapshot]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let stats = self.stats.snapshot();
            let counters: Vec<_> = self.counters.iter().map(|c| c.snapshot()).collect();
            if cond(&stats, &counters) {
                return;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}: worker {stats:?} sockets {counters:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn finish(mut self) -> Finished<H> {
        self.stop.store(true, Ordering::Release);
        self.thread.take().expect("thread").join().expect("worker thread panicked")
    }
}

impl<H> Drop for Gateway<H> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
    }
}

fn copy_mode(socket: SocketConfig) -> XskConfig {
    XskConfig { umem: UmemConfig::default(), socket: SocketConfig { mode: BindMode::Copy, ..socket } }
}

/// gw (`xg0`, 192.0.2.1) <-> peer (`xp0`, 192.0.2.2); the peer reaches
/// 192.0.2.1 through a static neighbour entry (no ARP), checksums in full.
fn one_arm(tag: &str, gw_queues: u32) -> (Netns, Netns) {
    let gw = Netns::new(&format!("{tag}g"));
    let peer = Netns::new(&format!("{tag}p"));
    let q = gw_queues.to_string();
    // The peer has one TX queue, so every frame lands on the gateway's RX
    // queue 0 (veth maps the sender's TX queue to the receiver's RX queue).
    gw.ip(&[
        "link",
        "add",
        "name",
        "xg0",
        "numtxqueues",
        &q,
        "numrxqueues",
        &q,
        "type",
        "veth",
        "peer",
        "name",
        "xp0",
        "numtxqueues",
        "1",
        "numrxqueues",
        "1",
        "netns",
        peer.name(),
    ]);
    gw.ip(&["addr", "add", "192.0.2.1/24", "dev", "xg0"]);
    peer.ip(&["addr", "add", "192.0.2.2/24", "dev", "xp0"]);
    gw.ip(&["link", "set", "xg0", "up"]);
    peer.ip(&["link", "set", "xp0", "up"]);
    let gw_mac = gw.mac("xg0");
    peer.ip(&["neigh", "replace", "192.0.2.1", "lladdr", &fmt_mac(&gw_mac), "dev", "xp0", "nud", "permanent"]);
    peer.exec(&["ethtool", "-K", "xp0", "tx", "off"]);
    (gw, peer)
}

fn fmt_mac(m: &[u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

fn swap_macs(frame: &[u8]) -> Vec<u8> {
    let mut f = frame.to_vec();
    f[0..6].copy_from_slice(&frame[6..12]);
    f[6..12].copy_from_slice(&frame[0..6]);
    f
}

/// Split captured frames into (sent by `mac`, received by `mac`), keyed by seq.
type Numbered = Vec<(u32, Vec<u8>)>;

fn by_direction(frames: &[Vec<u8>], mac: &[u8; 6]) -> (Numbered, Numbered) {
    let mut out = Vec::new();
    let mut back = Vec::new();
    for f in frames {
        let Some(seq) = test_seq(f) else { continue };
        if f[6..12] == mac[..] {
            out.push((seq, f.clone()));
        } else if f[0..6] == mac[..] {
            back.push((seq, f.clone()));
        }
    }
    (out, back)
}

// ---------------------------------------------------------------- tests

#[test]
fn bounce_returns_the_exact_frames() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gw, peer) = one_arm("b", 1);
    let peer_mac = peer.mac("xp0");
    let gw_mac = gw.mac("xg0");
    let gateway = Gateway::start(
        &gw,
        &[("xg0", 0)],
        &["xg0"],
        copy_mode(SocketConfig::default()),
        WorkerConfig::default(),
        Bounce,
    );

    const N: u32 = 2000;
    let frames = send_and_capture(&peer, N, 50);
    gateway.wait_until("all completions", |_, c| c[0].tx_completed >= u64::from(N));
    let (stats, counters, _, bad_releases) = gateway.finish();

    let (out, back) = by_direction(&frames, &peer_mac);
    assert_eq!(out.len(), N as usize, "peer sent");
    assert_eq!(back.len(), N as usize, "frames bounced back (worker {stats:?}, socket {:?})", counters[0]);
    let mut sent: Vec<Option<Vec<u8>>> = vec![None; N as usize];
    for (seq, f) in out {
        sent[seq as usize] = Some(f);
    }
    for (seq, f) in &back {
        let orig = sent[*seq as usize].as_ref().expect("bounced a frame that was sent");
        assert_eq!(&f[0..6], &peer_mac, "dst MAC is the peer's");
        assert_eq!(&f[6..12], &gw_mac, "src MAC is the gateway's");
        assert_eq!(f, &swap_macs(orig), "frame {seq} came back byte for byte, MACs swapped");
    }
    let c = &counters[0];
    assert_eq!((stats.rx_frames, stats.tx_frames, stats.dropped), (u64::from(N), u64::from(N), 0));
    assert_eq!((c.rx_frames, c.tx_frames, c.tx_completed), (u64::from(N), u64::from(N), u64::from(N)));
    assert_eq!(c.rx_bytes, back.iter().map(|(_, f)| f.len() as u64).sum::<u64>());
    assert!(c.tx_kicks > 0, "copy-mode TX needs kicks: {c:?}");
    assert_eq!((c.tx_ring_full, c.tx_kick_errors, c.rx_bad_desc, bad_releases), (0, 0, 0, 0));
    assert_eq!(c.kernel.rx_dropped + c.kernel.rx_invalid_descs + c.kernel.tx_invalid_descs, 0, "{c:?}");
}

#[test]
fn a_batch_is_lent_in_order_and_what_the_handler_leaves_is_handled_one_by_one() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gw, peer) = one_arm("g", 1);
    // Batches longer than the handler's piece.
    let config = WorkerConfig { batch_size: PeekingBounce::PIECE + 52, ..WorkerConfig::default() };
    let gateway = Gateway::start(
        &gw,
        &[("xg0", 0)],
        &["xg0"],
        copy_mode(SocketConfig::default()),
        config,
        PeekingBounce::default(),
    );
    const N: u32 = 3000;
    let frames = send_and_capture(&peer, N, 200);
    gateway.wait_until("all completions", |_, c| c[0].tx_completed >= u64::from(N));
    let (stats, _, h, _) = gateway.finish();
    let (_, back) = by_direction(&frames, &peer.mac("xp0"));
    assert_eq!(back.len(), N as usize, "every frame bounced (worker {stats:?})");
    assert_eq!(h.in_batch + h.one_by_one, u64::from(N));
    assert!(h.one_by_one > 0, "no batch of three left frames to the worker ({} batches)", h.batches);
    assert_eq!(h.mismatched, 0, "peeked and handled frames differ");
    assert!(h.peeked.is_empty(), "{} frames peeked and never handled", h.peeked.len());
    assert!(h.longest_batch <= PeekingBounce::PIECE + 52, "a batch longer than batch_size: {}", h.longest_batch);
    assert_eq!((stats.rx_frames, stats.dropped), (u64::from(N), 0));
}

#[test]
fn held_frames_are_queued_after_their_batch_and_released_in_order() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gw, peer) = one_arm("h", 1);
    let gateway = Gateway::start(
        &gw,
        &[("xg0", 0)],
        &["xg0"],
        copy_mode(SocketConfig::default()),
        WorkerConfig::default(),
        HoldingBounce::default(),
    );
    const N: u32 = 3000;
    let frames = send_and_capture(&peer, N, 200);
    gateway.wait_until("all completions", |_, c| c[0].tx_completed >= u64::from(N));
    let (stats, _, h, _) = gateway.finish();
    let (_, back) = by_direction(&frames, &peer.mac("xp0"));
    assert_eq!(back.len(), N as usize, "every frame bounced, the held ones too (worker {stats:?})");
    assert_eq!(h.held, u64::from(N / 4));
    assert_eq!((h.queued, h.overflowed), (h.held, 0), "each held frame queued once, none displaced");
    let released: usize = h.released.values().map(Vec::len).sum();
    assert_eq!(released as u64, h.held, "each held frame released once");
    for (hop, seqs) in &h.released {
        assert!(seqs.windows(2).all(|w| w[0] < w[1]), "next hop .{hop} released out of order: {seqs:?}");
    }
    assert_eq!((stats.rx_frames, stats.dropped), (u64::from(N), 0));
}

#[test]
fn two_arm_forwards_between_interfaces_over_one_umem() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let gw = Netns::new("tg");
    let a = Netns::new("ta");
    let b = Netns::new("tb");
    for (dev, peer_dev, ns) in [("xa", "pa", &a), ("xb", "pb", &b)] {
        gw.ip(&[
            "link",
            "add",
            "name",
            dev,
            "numtxqueues",
            "1",
            "numrxqueues",
            "1",
            "type",
            "veth",
            "peer",
            "name",
            peer_dev,
            "numtxqueues",
            "1",
            "numrxqueues",
            "1",
            "netns",
            ns.name(),
        ]);
    }
    for (ns, dev, addr) in [
        (&gw, "xa", "192.0.2.1/24"),
        (&a, "pa", "192.0.2.2/24"),
        (&gw, "xb", "198.51.100.1/24"),
        (&b, "pb", "198.51.100.2/24"),
    ] {
        ns.ip(&["addr", "add", addr, "dev", dev]);
        ns.ip(&["link", "set", dev, "up"]);
    }
    let (xa_mac, xb_mac, pa_mac, pb_mac) = (gw.mac("xa"), gw.mac("xb"), a.mac("pa"), b.mac("pb"));
    a.ip(&["neigh", "replace", "192.0.2.1", "lladdr", &fmt_mac(&xa_mac), "dev", "pa", "nud", "permanent"]);
    a.ip(&["route", "add", "198.51.100.0/24", "via", "192.0.2.1"]);
    a.exec(&["ethtool", "-K", "pa", "tx", "off"]);

    let gateway = Gateway::start(
        &gw,
        &[("xa", 0), ("xb", 0)],
        &["xa"],
        copy_mode(SocketConfig::default()),
        WorkerConfig::default(),
        Forward { dst: pb_mac, src: xb_mac, ticks: 0 },
    );

    const N: u32 = 1000;
    // B side: capture everything and receive the datagrams on a UDP socket
    // (which also proves the forwarded checksums are valid).
    let (b_ready_tx, b_ready_rx) = mpsc::channel();
    let b_side = b.spawn(move || {
        let mut cap = capture();
        let udp = UdpSocket::bind("198.51.100.2:7000").expect("bind B");
        udp.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
        let receiver = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = [0u8; 2048];
            loop {
                match udp.recv_from(&mut buf) {
                    Ok((n, from)) => got.push((from, buf[..n].to_vec())),
                    // A stop and continue of the process cuts a timed
                    // receive short (signal(7)): not the end of the traffic.
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break, // 200 ms without a datagram: all sent
                }
            }
            got
        });
        let _ = b_ready_tx.send(());
        let frames = collect(&mut cap, Instant::now() + Duration::from_secs(10), |f| f.len() >= N as usize);
        (frames, receiver.join().expect("receiver"))
    });
    b_ready_rx.recv_timeout(Duration::from_secs(5)).expect("B side ready");
    let a_frames = a
        .spawn(move || {
            let mut cap = capture();
            let udp = UdpSocket::bind("192.0.2.2:40001").expect("bind A");
            let sender = std::thread::spawn(move || send_udp(&udp, "198.51.100.2:7000", 0, N, 200, 50));
            let frames = collect(&mut cap, Instant::now() + Duration::from_secs(10), |f| f.len() >= N as usize);
            sender.join().expect("sender");
            frames
        })
        .join()
        .expect("A thread");
    let (b_frames, datagrams) = b_side.join().expect("B thread");
    gateway.wait_until("all completions", |_, c| c[1].tx_completed >= u64::from(N));
    let (stats, counters, handler, bad_releases) = gateway.finish();

    let (sent, _) = by_direction(&a_frames, &pa_mac);
    let (_, forwarded) = by_direction(&b_frames, &pb_mac);
    assert_eq!(sent.len(), N as usize);
    assert_eq!(forwarded.len(), N as usize, "worker {stats:?} sockets {counters:?}");
    let mut originals: Vec<Option<Vec<u8>>> = vec![None; N as usize];
    for (seq, f) in sent {
        originals[seq as usize] = Some(f);
    }
    for (seq, f) in &forwarded {
        let mut want = originals[*seq as usize].clone().expect("forwarded a frame that was sent");
        want[0..6].copy_from_slice(&pb_mac);
        want[6..12].copy_from_slice(&xb_mac);
        assert_eq!(f, &want, "frame {seq}: exactly the sent frame with B-side MACs");
    }
    assert_eq!(datagrams.len(), N as usize, "UDP socket in B received every datagram");
    for (i, (from, data)) in datagrams.iter().enumerate() {
        assert_eq!(from.to_string(), "192.0.2.2:40001");
        let seq = u32::from_be_bytes([data[8], data[9], data[10], data[11]]);
        assert_eq!(data, &payload(seq, 200), "datagram {i}");
    }
    // RX counted on port 0 only, TX on port 1 only: the frames moved between
    // sockets of one UMEM.
    assert_eq!((counters[0].rx_frames, counters[0].tx_frames), (u64::from(N), 0));
    assert_eq!(
        (counters[1].rx_frames, counters[1].tx_frames, counters[1].tx_completed),
        (0, u64::from(N), u64::from(N))
    );
    assert_eq!((stats.tx_frames, stats.dropped, stats.bad_port, bad_releases), (u64::from(N), 0, 0, 0));
    assert!(handler.ticks >= stats.iterations.min(1), "tick runs every iteration");
}

#[test]
fn full_tx_ring_refuses_without_panic_then_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gw, peer) = one_arm("r", 1);
    let peer_mac = peer.mac("xp0");
    const TX: u32 = 16;
    const SENT: u32 = 40;
    let (ready_tx, ready_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    // The peer: capture, send SENT datagrams, wait, capture what comes back.
    let peer_side = peer.spawn(move || {
        let mut cap = capture();
        let udp = UdpSocket::bind("192.0.2.2:40002").expect("bind");
        let _ = ready_rx.recv();
        send_udp(&udp, "192.0.2.1:9", 0, SENT, 100, 0);
        let _ = go_rx.recv();
        collect(&mut cap, Instant::now() + Duration::from_secs(3), |f| {
            f.iter().filter(|f| f[0..6] == peer_mac[..]).count() >= TX as usize
        })
    });
    // The gateway, driven by hand (no worker): receive everything, then
    // transmit without kicking. Copy-mode TX moves only on a kick, so the
    // ring fills after TX entries and must refuse the rest.
    let result = gw
        .spawn(move || {
            let ifindex = netns::ifindex("xg0").expect("xg0");
            let config = copy_mode(SocketConfig { tx_size: TX, tx_skb_budget: None, ..SocketConfig::default() });
            let mut ports = XskPorts::open(&config, &[PortSpec { ifindex, queue: 0 }]).expect("open");
            let prog = XskRedirectProg::attach(ifindex, 1, XdpMode::Driver).expect("attach");
            prog.insert(0, ports.raw_fd(PortId(0)).expect("fd")).expect("insert");
            let p = PortId(0);
            let _ = ready_tx.send(());
            let mut frames = Vec::with_capacity(64);
            let deadline = Instant::now() + Duration::from_secs(5);
            while frames.len() < SENT as usize && Instant::now() < deadline {
                ports.rx_burst(p, 64, &mut frames);
            }
            assert_eq!(frames.len(), SENT as usize, "received every datagram");
            let free_before = ports.frames_free();
            let (mut queued, mut refused) = (0u32, 0u32);
            for f in frames.drain(..) {
                let len = f.len();
                let buf = ports.frame_mut(&f);
                let mut dst = [0u8; 6];
                dst.copy_from_slice(&buf[0..6]);
                buf.copy_within(6..12, 0);
                buf[6..12].copy_from_slice(&dst);
                match ports.transmit(p, f, len) {
                    Ok(()) => queued += 1,
                    Err((f, why)) => {
                        assert_eq!(why, egret_dataplane::xsk::TxRefused::RingFull);
                        refused += 1;
                        ports.recycle(f);
                    }
                }
            }
            let full = ports.counters(p).expect("counters").snapshot();
            // Publish without a kick: nothing may leave yet.
            let free_after_refusals = ports.frames_free();
            std::thread::sleep(Duration::from_millis(200));
            let reclaimed_unkicked = ports.reclaim(p);
            ports.flush_tx(p);
            let _ = go_tx.send(());
            let mut completed = 0;
            let deadline = Instant::now() + Duration::from_secs(3);
            while completed < queued as usize && Instant::now() < deadline {
                completed += ports.reclaim(p);
                ports.flush_tx(p);
            }
            let after = ports.counters(p).expect("counters").snapshot();
            drop(prog);
            (
                queued,
                refused,
                full,
                free_before,
                free_after_refusals,
                reclaimed_unkicked,
                completed,
                after,
                ports.frames_free(),
                ports.frames_total(),
                ports.frame_pool_bad_releases(),
            )
        })
        .join()
        .expect("gateway thread");
    let back = peer_side.join().expect("peer thread");
    let (queued, refused, full, free_before, free_after, unkicked, completed, after, free_end, total, bad) = result;
    assert_eq!((queued, refused), (TX, SENT - TX), "the ring took {TX}, refused the rest");
    assert_eq!(full.tx_ring_full, u64::from(SENT - TX), "each refusal counted: {full:?}");
    assert_eq!(full.tx_frames, u64::from(TX));
    assert_eq!(free_after, free_before + (SENT - TX) as usize, "refused frames went back to the pool");
    assert_eq!(unkicked, 0, "nothing completes before the kick");
    assert_eq!(completed, TX as usize, "after the kick every queued frame completes: {after:?}");
    assert!(after.tx_kicks > 0);
    let (_, back) = by_direction(&back, &peer_mac);
    let mut seqs: Vec<u32> = back.iter().map(|(s, _)| *s).collect();
    seqs.sort_unstable();
    assert_eq!(seqs, (0..TX).collect::<Vec<_>>(), "the first {TX} frames came back");
    // Every frame is back: in the pool or lent to the kernel's fill ring.
    assert!(free_end <= total as usize && bad == 0);
}

#[test]
fn tiny_rings_under_a_flood_never_overrun_then_traffic_resumes() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gw, peer) = one_arm("s", 1);
    let peer_mac = peer.mac("xp0");
    // TX ring and completion ring of 16 against RX batches of 64; a pool of
    // 96 frames against a 64-entry fill ring: the worker must cap each batch
    // at the TX room, and runs its pool dry under the flood.
    let socket = SocketConfig {
        rx_size: 64,
        tx_size: 16,
        fill_size: 64,
        comp_size: 16,
        mode: BindMode::Copy,
        need_wakeup: true,
        tx_skb_budget: None,
    };
    let config = XskConfig { umem: UmemConfig { frame_size: 2048, frame_count: 96 }, socket };
    let gateway = Gateway::start(&gw, &[("xg0", 0)], &["xg0"], config, WorkerConfig::default(), Bounce);

    const FLOOD: u32 = 20_000;
    const AFTER: u32 = 200;
    let (flood_back, after_back) = peer
        .spawn(move || {
            let udp = UdpSocket::bind("192.0.2.2:40003").expect("bind");
            let mut cap = capture();
            send_udp(&udp, "192.0.2.1:9", 0, FLOOD, 100, 0);
            let flood = collect(&mut cap, Instant::now() + Duration::from_millis(500), |_| false);
            // Then paced traffic: every frame must come back.
            let sender = std::thread::spawn(move || send_udp(&udp, "192.0.2.1:9", 100_000, AFTER, 100, 4));
            let after = collect(&mut cap, Instant::now() + Duration::from_secs(10), |f| {
                f.iter().filter(|f| f[0..6] == peer_mac[..] && test_seq(f).is_some_and(|s| s >= 100_000)).count()
                    >= AFTER as usize
            });
            sender.join().expect("sender");
            (by_direction(&flood, &peer_mac).1.len(), by_direction(&after, &peer_mac).1)
        })
        .join()
        .expect("peer thread");
    gateway.wait_until("all completions", |w, c| c[0].tx_completed >= w.tx_frames);
    let (stats, counters, _, bad_releases) = gateway.finish();
    let c = &counters[0];
    let msg = format!("worker {stats:?}\nsocket {c:?}\nflood frames seen back {flood_back}");
    let resumed: Vec<u32> = after_back.iter().map(|(s, _)| *s).filter(|s| *s >= 100_000).collect();
    assert_eq!(resumed.len(), AFTER as usize, "paced traffic after the flood all came back: {msg}");
    assert_eq!(stats.tx_refused_full, 0, "no transmit met a full ring: {msg}");
    assert_eq!(stats.rx_frames, stats.tx_frames, "every frame pulled was queued: {msg}");
    assert_eq!(c.tx_frames, c.tx_completed, "and completed: {msg}");
    assert_eq!(c.tx_ring_full, 0, "{msg}");
    assert!(stats.rx_frames < u64::from(FLOOD + AFTER), "the flood overran the tiny rings somewhere: {msg}");
    assert!(
        c.kernel.rx_ring_full + c.kernel.rx_fill_ring_empty_descs + c.kernel.rx_dropped > 0,
        "the kernel counted what the rings could not take: {msg}"
    );
    assert_eq!(bad_releases, 0);
    println!("{msg}");
}

/// Packets per second through the bounce path; prints, asserts nothing
/// beyond "frames came back". `cargo test --release -p egret-dataplane
/// --test xsk_veth -- --ignored --nocapture bounce_throughput`
#[test]
#[ignore = "measurement, run by hand"]
fn bounce_throughput() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (gw, peer) = one_arm("t", 1);
    let peer_mac = peer.mac("xp0");
    let worker_config = WorkerConfig { cpu: Some(1), realtime_priority: Some(50), ..WorkerConfig::default() };
    let gateway =
        Gateway::start(&gw, &[("xg0", 0)], &["xg0"], copy_mode(SocketConfig::default()), worker_config, Bounce);
    let secs = 3;
    let (sent, seen) = peer
        .spawn(move || {
            let mut cap = capture();
            let udp = UdpSocket::bind("192.0.2.2:40004").expect("bind");
            let t0 = Instant::now();
            let mut sent = 0u32;
            let sender = std::thread::spawn(move || {
                while t0.elapsed() < Duration::from_secs(secs) {
                    let _ = udp.send_to(&payload(sent, 18), "192.0.2.1:9");
                    sent += 1;
                }
                sent
            });
            let frames = collect(&mut cap, t0 + Duration::from_secs(secs + 1), |_| false);
            let (_, back) = by_direction(&frames, &peer_mac);
            (sender.join().expect("sender"), back.len())
        })
        .join()
        .expect("peer");
    let (stats, counters, _, _) = gateway.finish();
    let c = &counters[0];
    println!(
        "sent {sent} in {secs}s ({} pps); worker rx {} tx {} ({} pps); captured back {seen}; idle polls {}; kicks {}; kernel {:?}",
        sent / secs as u32,
        stats.rx_frames,
        stats.tx_frames,
        stats.tx_frames / secs,
        stats.idle_polls,
        c.tx_kicks,
        c.kernel
    );
    assert!(stats.tx_frames > 0);
}
