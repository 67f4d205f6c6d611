//! `egret-handoff`: what handing a translated reply to the gateway's kernel
//! (the return path through an overlay, docs/adr/0008) costs per packet,
//! against the native path, measured piece by piece in one run with
//! interleaved rounds.
//!
//! A reply to a pod takes the same steps either way up to the engine's
//! verdict: AF_XDP RX copy, the engine, then the egress. Two pieces differ,
//! and each is measured here against its native counterpart:
//!
//! 1. The engine: a native reply takes the established straight pass
//!    (`Ctx::established_v4`); one to a pod behind a tunnel has no MAC to
//!    write and takes the full pipeline to `Verdict::ToKernel`. Measured
//!    as `Pipeline::process` on one UDP session's reply frame, with the
//!    fixtures' native topology and with the pods' /24 behind a kernel
//!    link (`engine-native`, `engine-overlay`).
//! 2. The egress: the native path transmits the frame on an AF_XDP socket
//!    (copy mode on veth: one skb allocation, copy and veth transmit per
//!    frame, a `sendto` kick per batch of 64), the hand-off sends the IP
//!    packet on a raw socket, which the kernel routes through a VXLAN
//!    device configured as flannel's (`flannel.1`, an onlink route, a
//!    permanent neighbour, an FDB entry) and encapsulates onto the same
//!    veth (`xsk-tx`, `raw-vxlan`); `raw-plain` sends it on the raw socket
//!    through a plain on-link route out of the veth, which separates the
//!    raw socket's own cost from the encapsulation's. `tun-vxlan` writes
//!    it to a TUN device instead (the alternative the ADR weighs): the
//!    kernel receives it there and forwards it through the same tunnel.
//!    `raw-vxlan-mmsg` sends the same packets on a raw socket 64 at a time
//!    with `sendmmsg` (one system call per batch, as a worker could per
//!    batch): what batching the hand-off would save.
//!
//! The egress modes run on one pinned thread in namespace
//! `eghand<pid>-0-gw`, towards `eghand<pid>-0-peer`, whose veth end drops
//! every frame in XDP (the benchmarks' sink program, which counts them: a
//! mode whose frames did not all arrive is reported). The veth's receive
//! side runs in the same core's softirq, so wall time per packet on the
//! pinned core is the whole synchronous cost of each path. Needs root;
//! the namespaces are deleted however it ends.

#![allow(clippy::print_stdout)]

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, ExitCode};
use std::time::Instant;

use clap::Parser;
use egret_benches::report::Spread;
use egret_benches::sys;
use egret_benches::topology::in_netns;
use egret_benches::xdp::Sink;
use egret_dataplane::clock::Timestamp;
use egret_dataplane::engine::{ChecksumHint, Engine, RxMeta, Verdict};
use egret_dataplane::fixtures::{self, build, from_outside, from_pod, udp};
use egret_dataplane::kernel_tx::KernelTx;
use egret_dataplane::nat::port_alloc::PortRng;
use egret_dataplane::netns::NetnsGuard;
use egret_dataplane::xsk::{self, PortId, PortSpec, SocketConfig, TxRefused, UmemConfig, XskConfig, XskPorts};

/// Measure the per-packet cost of the overlay return path's pieces against
/// the native path's, interleaved rounds, medians.
#[derive(Debug, Parser)]
#[command(name = "egret-handoff", version)]
struct Args {
    /// Packets per mode per round (egress modes).
    #[arg(long, default_value_t = 300_000)]
    packets: u64,
    /// Frames per mode per round (engine modes).
    #[arg(long, default_value_t = 2_000_000)]
    frames: u64,
    /// Rounds: every mode once per round.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Core the measuring thread is pinned to.
    #[arg(long, default_value_t = 1)]
    cpu: usize,
    /// UDP payload bytes of the measured packets.
    #[arg(long, default_value_t = 18)]
    payload: usize,
}

type Error = Box<dyn std::error::Error + Send + Sync>;

const GW_MAC: &str = "02:e9:00:00:02:02";
const PEER_MAC: [u8; 6] = [0x02, 0xe9, 0, 0, 2, 1];
const VTEP_GW: &str = "02:e9:00:00:01:02";
const VTEP_NODE: &str = "02:e9:00:00:01:0a";
/// A pod behind the tunnel.
const POD_TUNNEL: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
/// The peer's address and the VXLAN port: the sink counts and drops what
/// is sent there, so the native and plain packets go there too (the same
/// cheap receive for every mode).
const PEER: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const SINK_PORT: u16 = 8472;

fn run(args: &[&str]) -> Result<(), Error> {
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if !out.status.success() {
        return Err(format!("{}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()).into());
    }
    Ok(())
}

fn mac_str(m: [u8; 6]) -> String {
    m.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

/// The two namespaces, the veth, flannel's vxlan device and the routes.
fn topology(gw: &str, peer: &str) -> Result<(), Error> {
    let ip = |ns: &str, rest: &str| {
        let mut v = vec!["ip", "-n", ns];
        v.extend(rest.split_whitespace());
        run(&v)
    };
    ip(gw, &format!("link add u0 address {GW_MAC} type veth peer name u0 netns {peer}"))?;
    ip(peer, &format!("link set dev u0 address {}", mac_str(PEER_MAC)))?;
    for (ns, addr) in [(gw, "192.0.2.2/24"), (peer, "192.0.2.1/24")] {
        ip(ns, &format!("addr add {addr} dev u0"))?;
        ip(ns, "link set dev u0 up")?;
    }
    ip(gw, &format!("neigh add 192.0.2.1 lladdr {} dev u0 nud permanent", mac_str(PEER_MAC)))?;
    ip(
        gw,
        &format!("link add flannel.1 address {VTEP_GW} type vxlan id 1 local 192.0.2.2 dev u0 dstport 8472 nolearning"),
    )?;
    ip(gw, "addr add 198.19.0.0/32 dev flannel.1")?;
    ip(gw, "link set dev flannel.1 up")?;
    ip(gw, "route add 198.18.0.0/24 via 198.18.0.0 dev flannel.1 onlink")?;
    ip(gw, &format!("neigh add 198.18.0.0 lladdr {VTEP_NODE} dev flannel.1 nud permanent"))?;
    run(&[
        "bridge",
        "-n",
        gw,
        "fdb",
        "append",
        VTEP_NODE,
        "dev",
        "flannel.1",
        "dst",
        "192.0.2.1",
        "self",
        "permanent",
    ])?;
    Ok(())
}

/// A reply from the server to `dst:dport`, as the engine hands it over
/// (IP packet) and as the native path sends it (Ethernet frame to the peer).
fn reply(dst: Ipv4Addr, dport: u16, payload: usize) -> (Vec<u8>, Vec<u8>) {
    let p = build::Packet {
        eth_src: [0x02, 0xe9, 0, 0, 2, 2],
        eth_dst: PEER_MAC,
        ttl: 63,
        ..from_outside(IpAddr::V4(fixtures::SERVER), IpAddr::V4(dst), udp(53, dport, &vec![b'r'; payload]))
    };
    (p.ip_bytes(), p.frame())
}

/// Sends `n` copies of `frame` on an AF_XDP socket as the worker does:
/// batches of up to 64, a kick per batch, completions reclaimed.
fn xsk_tx(ports: &mut XskPorts, frame: &[u8], n: u64) -> Result<u64, Error> {
    let port = PortId(0);
    let mut sent = 0u64;
    while sent < n {
        let mut batch = 0;
        while batch < 64 && sent < n {
            match ports.transmit_new(port, |buf| {
                buf[..frame.len()].copy_from_slice(frame);
                frame.len()
            }) {
                Ok(()) => {
                    sent += 1;
                    batch += 1;
                }
                Err(TxRefused::RingFull | TxRefused::NoFreeFrame) => break,
                Err(e) => return Err(format!("AF_XDP transmit refused: {e:?}").into()),
            }
        }
        ports.flush_tx(port);
        ports.reclaim(port);
    }
    let deadline = Instant::now() + std::time::Duration::from_secs(2);
    while ports.tx_outstanding(port) > 0 && Instant::now() < deadline {
        ports.flush_tx(port);
        ports.reclaim(port);
    }
    Ok(sent)
}

/// Sends `n` copies of `packet` on the raw socket; a full send buffer is
/// retried (and counted).
fn raw_tx(tx: &KernelTx, packet: &[u8], n: u64) -> Result<u64, Error> {
    let mut retries = 0u64;
    for _ in 0..n {
        loop {
            match tx.send(packet) {
                Ok(()) => break,
                Err(egret_dataplane::kernel_tx::KernelTxError::Send(e))
                    if e.kind() == std::io::ErrorKind::WouldBlock =>
                {
                    retries += 1;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(retries)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    EngineNative,
    EngineOverlay,
    XskTx,
    RawVxlan,
    RawPlain,
    TunVxlan,
    RawVxlanMmsg,
}

impl Mode {
    const ALL: [Mode; 7] = [
        Mode::EngineNative,
        Mode::EngineOverlay,
        Mode::XskTx,
        Mode::RawVxlan,
        Mode::RawPlain,
        Mode::TunVxlan,
        Mode::RawVxlanMmsg,
    ];
    fn name(self) -> &'static str {
        match self {
            Mode::EngineNative => "engine-native",
            Mode::EngineOverlay => "engine-overlay",
            Mode::XskTx => "xsk-tx",
            Mode::RawVxlan => "raw-vxlan",
            Mode::RawPlain => "raw-plain",
            Mode::TunVxlan => "tun-vxlan",
            Mode::RawVxlanMmsg => "raw-vxlan-mmsg",
        }
    }
}

/// An engine with one UDP session of pod A, and the reply frame to it.
fn engine(overlay: bool) -> Result<(egret_dataplane::engine::Pipeline, Vec<u8>), Error> {
    let e = Engine::new(&fixtures::base_spec())?;
    let fib = if overlay { fixtures::overlay_topology() } else { fixtures::topology() };
    e.publish_fib(fib);
    let mut w = e.pipeline_seeded(PortRng::new(1));
    let out = from_pod(IpAddr::V4(fixtures::POD_A), IpAddr::V4(fixtures::SERVER), udp(40000, 53, b"q")).frame();
    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
    buf[..out.len()].copy_from_slice(&out);
    let meta = RxMeta { ifindex: fixtures::INSIDE, checksum: ChecksumHint::Complete };
    if !matches!(w.process(&mut buf, out.len(), meta, Timestamp::from_secs(0)), Verdict::Forward { .. }) {
        return Err("the session's first packet was not forwarded".into());
    }
    let back = from_outside(IpAddr::V4(fixtures::SERVER), IpAddr::V4(fixtures::E1), udp(53, 40000, b"a")).frame();
    Ok((w, back))
}

/// `TUNSETIFF` (linux/if_tun.h: `_IOW('T', 202, int)`).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;

/// Opens `/dev/net/tun` as TUN device `name` (no packet information
/// header) in the calling thread's namespace; it lives while the file is
/// open.
#[allow(unsafe_code)]
fn open_tun(name: &str) -> Result<std::fs::File, Error> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
    let mut req = [0u8; 40]; // struct ifreq: name[16], then the union (flags: short)
    let n = name.as_bytes();
    if n.len() >= 16 {
        return Err(format!("TUN name {name} too long").into());
    }
    req[..n.len()].copy_from_slice(n);
    let flags = (libc::IFF_TUN | libc::IFF_NO_PI) as i16;
    req[16..18].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: `req` is a 40-byte buffer laid out as struct ifreq (name,
    // then flags), alive for the call; TUNSETIFF reads and writes only it.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF, req.as_mut_ptr()) };
    if r != 0 {
        return Err(format!("TUNSETIFF {name}: {}", std::io::Error::last_os_error()).into());
    }
    Ok(f)
}

/// Writes `n` copies of `packet` to the TUN device.
fn tun_tx(tun: &mut std::fs::File, packet: &[u8], n: u64) -> Result<(), Error> {
    use std::io::Write;
    for _ in 0..n {
        tun.write_all(packet)?;
    }
    Ok(())
}

/// Sends `n` copies of the IPv4 `packet` to `dst` on a fresh raw socket,
/// `batch` per `sendmmsg` call; returns how often the send buffer was full.
#[allow(unsafe_code)]
fn raw_mmsg_tx(packet: &[u8], dst: Ipv4Addr, n: u64, batch: usize) -> Result<u64, Error> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: socket(2) takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_NONBLOCK, libc::IPPROTO_RAW) };
    if fd < 0 {
        return Err(format!("raw socket: {}", std::io::Error::last_os_error()).into());
    }
    // SAFETY: `fd` was just opened and is owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let addr = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(dst).to_be() },
        sin_zero: [0; 8],
    };
    let mut iov = libc::iovec { iov_base: packet.as_ptr() as *mut libc::c_void, iov_len: packet.len() };
    let header = libc::msghdr {
        msg_name: &addr as *const libc::sockaddr_in as *mut libc::c_void,
        msg_namelen: std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        msg_iov: &mut iov,
        msg_iovlen: 1,
        msg_control: std::ptr::null_mut(),
        msg_controllen: 0,
        msg_flags: 0,
    };
    let mut msgs: Vec<libc::mmsghdr> = (0..batch).map(|_| libc::mmsghdr { msg_hdr: header, msg_len: 0 }).collect();
    let (mut sent, mut full) = (0u64, 0u64);
    while sent < n {
        let k = (n - sent).min(batch as u64) as libc::c_uint;
        // SAFETY: `msgs` holds `batch` >= k headers, each pointing at
        // `addr`, `iov` and `packet`, all alive across the call; the kernel
        // writes only their `msg_len`.
        let r = unsafe { libc::sendmmsg(fd.as_raw_fd(), msgs.as_mut_ptr(), k, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::WouldBlock {
                full += 1;
                continue;
            }
            return Err(format!("sendmmsg: {e}").into());
        }
        sent += r as u64;
    }
    Ok(full)
}

/// ns per frame of `Pipeline::process` on the reply, `n` times (a copy of
/// the frame into the buffer each time, as a fresh frame arrives).
fn engine_run(overlay: bool, n: u64) -> Result<f64, Error> {
    let (mut w, back) = engine(overlay)?;
    let meta = RxMeta { ifindex: fixtures::OUTSIDE, checksum: ChecksumHint::Complete };
    let mut buf = vec![0u8; fixtures::FRAME_BUFFER];
    let want_kernel = overlay;
    let t = Instant::now();
    for _ in 0..n {
        buf[..back.len()].copy_from_slice(&back);
        let v = w.process(&mut buf, back.len(), meta, Timestamp::from_secs(1));
        if matches!(v, Verdict::ToKernel { .. }) != want_kernel {
            return Err(format!("unexpected verdict {v:?}").into());
        }
    }
    Ok(t.elapsed().as_nanos() as f64 / n as f64)
}

fn bench(args: &Args) -> Result<(), Error> {
    // The benchmark's namespaces, deleted on drop.
    let guard = NetnsGuard::unique("eghand", &["gw", "peer"]).create()?;
    let (gw, peer) = (guard.name(0).to_owned(), guard.name(1).to_owned());
    topology(&gw, &peer)?;
    let sink = in_netns(&peer, || -> Result<Sink, Error> {
        let mut s = Sink::load(PEER, SINK_PORT)?;
        s.attach(egret_dataplane::netns::ifindex("u0")?)?;
        Ok(s)
    })?;
    let (plain_ip, native_frame) = reply(PEER, SINK_PORT, args.payload);
    let (tunnel_ip, _) = reply(POD_TUNNEL, 40000, args.payload);
    let cpu = args.cpu;
    let n = args.packets;
    let frames = args.frames;
    let rounds = args.rounds;
    let results = in_netns(&gw, || -> Result<Vec<(Mode, Vec<f64>)>, Error> {
        sys::set_affinity(sys::gettid(), cpu)?;
        let ifindex = egret_dataplane::netns::ifindex("u0")?;
        let cfg = XskConfig {
            umem: UmemConfig::default(),
            socket: SocketConfig { mode: xsk::BindMode::Copy, ..SocketConfig::default() },
        };
        let mut ports = XskPorts::open(&cfg, &[PortSpec { ifindex, queue: 0 }])?;
        let tx = KernelTx::open()?;
        // The TUN alternative: the kernel forwards what arrives on tun0.
        let mut tun = open_tun("tun0")?;
        for cmd in [
            "sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.tun0.rp_filter=0",
            "ip link set dev tun0 up",
        ] {
            let mut v = vec!["ip", "netns", "exec", gw.as_str()];
            v.extend(cmd.split_whitespace());
            run(&v)?;
        }
        let mut out: Vec<(Mode, Vec<f64>)> = Mode::ALL.iter().map(|m| (*m, Vec::new())).collect();
        for round in 0..rounds {
            for (mode, samples) in out.iter_mut() {
                let before = sink.counts()?.frames;
                let t = Instant::now();
                let (ns, extra) = match mode {
                    Mode::EngineNative => (engine_run(false, frames)?, String::new()),
                    Mode::EngineOverlay => (engine_run(true, frames)?, String::new()),
                    Mode::XskTx => {
                        xsk_tx(&mut ports, &native_frame, n)?;
                        (t.elapsed().as_nanos() as f64 / n as f64, String::new())
                    }
                    Mode::RawVxlan | Mode::RawPlain => {
                        let packet = if *mode == Mode::RawVxlan { &tunnel_ip } else { &plain_ip };
                        let retries = raw_tx(&tx, packet, n)?;
                        (t.elapsed().as_nanos() as f64 / n as f64, format!(" (send buffer full {retries} times)"))
                    }
                    Mode::RawVxlanMmsg => {
                        let full = raw_mmsg_tx(&tunnel_ip, POD_TUNNEL, n, 64)?;
                        (t.elapsed().as_nanos() as f64 / n as f64, format!(" (send buffer full {full} times)"))
                    }
                    Mode::TunVxlan => {
                        tun_tx(&mut tun, &tunnel_ip, n)?;
                        (t.elapsed().as_nanos() as f64 / n as f64, String::new())
                    }
                };
                let arrived = sink.counts()?.frames - before;
                let egress = !matches!(mode, Mode::EngineNative | Mode::EngineOverlay);
                // A veth drops what its peer's ring cannot take (the
                // kernel's count, as on a wire): reported, and a mode that
                // lost more than 1% is not a measurement of sending.
                if egress && arrived * 100 < n * 99 {
                    return Err(format!("{}: only {arrived} of {n} frames reached the peer", mode.name()).into());
                }
                let lost = if egress { format!(", {} lost", n.saturating_sub(arrived)) } else { String::new() };
                println!("round {round} {:<15} {ns:8.1} ns/packet{extra}{lost}", mode.name());
                samples.push(ns);
            }
        }
        Ok(out)
    })?;
    println!(
        "\nmedians over {rounds} rounds ({n} packets per egress run, {frames} frames per engine run, core {cpu}):"
    );
    let mut med = std::collections::HashMap::new();
    for (mode, samples) in results {
        let m = Spread::of(&samples).median;
        med.insert(mode.name(), m);
        println!("  {:<15} {m:8.1} ns/packet", mode.name());
    }
    let g = |k: &str| med.get(k).copied().unwrap_or(f64::NAN);
    let engine_extra = g("engine-overlay") - g("engine-native");
    let egress_extra = g("raw-vxlan") - g("xsk-tx");
    println!("  engine: overlay / native      {:.2}x, +{engine_extra:.1} ns", g("engine-overlay") / g("engine-native"));
    println!("  egress: raw-vxlan / xsk-tx    {:.2}x, +{egress_extra:.1} ns", g("raw-vxlan") / g("xsk-tx"));
    println!("  egress: raw-plain / xsk-tx    {:.2}x", g("raw-plain") / g("xsk-tx"));
    println!("  egress: tun-vxlan / raw-vxlan {:.2}x", g("tun-vxlan") / g("raw-vxlan"));
    println!("  egress: raw-vxlan-mmsg / raw-vxlan {:.2}x", g("raw-vxlan-mmsg") / g("raw-vxlan"));
    println!("  hand-off costs about {:.0} ns per packet more than the native path", engine_extra + egress_extra);
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    match bench(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("egret-handoff: {e}");
            ExitCode::FAILURE
        }
    }
}
