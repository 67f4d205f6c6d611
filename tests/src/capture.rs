//! Capturing every frame that arrives on one interface (a raw AF_PACKET
//! socket on a thread inside the interface's namespace), the "no pod
//! address leaves" check over a capture, and a pcap writer so a failing
//! test leaves something Wireshark can open.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{LabError, Result};
use crate::netns::NetNs;
use crate::sys::PacketSocket;

/// A captured frame.
#[derive(Clone, Debug)]
pub struct Frame {
    /// When it arrived, from the start of the capture.
    pub at: Duration,
    /// The frame from its Ethernet header on.
    pub data: Vec<u8>,
}

/// A capture running on a thread; stop it to get the frames.
#[derive(Debug)]
pub struct Capture {
    what: String,
    stop: Arc<AtomicBool>,
    frames: Arc<Mutex<Vec<Frame>>>,
    thread: Option<JoinHandle<Result<Result<()>>>>,
}

impl Capture {
    /// Starts capturing frames arriving on `dev` in `ns`; returns once the
    /// socket is bound, so nothing sent afterwards is missed.
    pub fn start(ns: &NetNs, dev: &str) -> Result<Self> {
        let ifindex = ns.ifindex(dev)?;
        let what = format!("{}:{dev}", ns.name());
        let stop = Arc::new(AtomicBool::new(false));
        let frames = Arc::new(Mutex::new(Vec::new()));
        let (ready_tx, ready_rx) = mpsc::channel();
        let (stop2, frames2, what2) = (stop.clone(), frames.clone(), what.clone());
        let thread = ns.spawn_in("capture", move || -> Result<()> {
            let sock = match PacketSocket::bind(ifindex).and_then(|s| s.set_recv_buffer(64 << 20).map(|_| s)) {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready_tx.send(Err(LabError::io(format!("capture on {what2}"), e)));
                    return Ok(());
                }
            };
            let _ = ready_tx.send(Ok(()));
            let start = Instant::now();
            let mut buf = vec![0u8; 65536];
            loop {
                match sock.recv(&mut buf, Duration::from_millis(50)) {
                    Ok(Some(n)) => {
                        let f = Frame { at: start.elapsed(), data: buf[..n].to_vec() };
                        if let Ok(mut v) = frames2.lock() {
                            v.push(f);
                        }
                    }
                    // Stop only once the socket is drained.
                    Ok(None) if stop2.load(Ordering::Relaxed) => return Ok(()),
                    Ok(None) => {}
                    Err(e) => return Err(LabError::io(format!("capture on {what2}"), e)),
                }
            }
        })?;
        match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(LabError::Timeout {
                    what: format!("capture on {what} to start"),
                    after: Duration::from_secs(5),
                })
            }
        }
        let thread = Some(thread);
        Ok(Self { what, stop, frames, thread })
    }

    /// The frames captured so far.
    pub fn snapshot(&self) -> Vec<Frame> {
        self.frames.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Stops the capture and returns every frame.
    pub fn stop(mut self) -> Result<Vec<Frame>> {
        self.halt()?;
        Ok(std::mem::take(&mut *self.frames.lock().map_err(|_| LabError::Gateway("capture lock poisoned".into()))?))
    }

    fn halt(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(r) => r??,
                Err(_) => return Err(LabError::Gateway(format!("capture thread on {} panicked", self.what))),
            }
        }
        Ok(())
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.halt();
    }
}

/// The IP header fields of a frame, if it carries IPv4 or IPv6 (after at
/// most one 802.1Q tag).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpInfo {
    /// Ethernet source.
    pub eth_src: [u8; 6],
    /// IP source.
    pub src: IpAddr,
    /// IP destination.
    pub dst: IpAddr,
    /// Protocol / next header (IPv6: of the fixed header).
    pub proto: u8,
}

/// Parses the Ethernet and IP headers of `f`.
pub fn ip_info(f: &[u8]) -> Option<IpInfo> {
    let eth_src: [u8; 6] = f.get(6..12)?.try_into().ok()?;
    let mut off = 12;
    let mut ethertype = u16::from_be_bytes([*f.get(off)?, *f.get(off + 1)?]);
    if ethertype == 0x8100 {
        off += 4;
        ethertype = u16::from_be_bytes([*f.get(off)?, *f.get(off + 1)?]);
    }
    let l3 = f.get(off + 2..)?;
    match ethertype {
        0x0800 if l3.len() >= 20 => {
            let a = |o: usize| IpAddr::V4(Ipv4Addr::new(l3[o], l3[o + 1], l3[o + 2], l3[o + 3]));
            Some(IpInfo { eth_src, src: a(12), dst: a(16), proto: l3[9] })
        }
        0x86dd if l3.len() >= 40 => {
            let a = |o: usize| {
                let b: [u8; 16] = l3[o..o + 16].try_into().unwrap_or([0; 16]);
                IpAddr::V6(Ipv6Addr::from(b))
            };
            Some(IpInfo { eth_src, src: a(8), dst: a(24), proto: l3[6] })
        }
        _ => None,
    }
}

/// Frames sent by `from_mac` whose IP source and destination `selected`
/// says should have been translated: each is a leak of a pod address.
/// Returns a description of each.
pub fn leaks(frames: &[Frame], from_mac: [u8; 6], selected: impl Fn(IpAddr, IpAddr) -> bool) -> Vec<String> {
    frames
        .iter()
        .filter_map(|f| {
            let ip = ip_info(&f.data)?;
            (ip.eth_src == from_mac && selected(ip.src, ip.dst))
                .then(|| format!("at {:?}: {} -> {} proto {} ({} bytes)", f.at, ip.src, ip.dst, ip.proto, f.data.len()))
        })
        .collect()
}

/// Writes `frames` as a pcap file (Ethernet link type).
pub fn write_pcap(path: &Path, frames: &[Frame]) -> Result<()> {
    let mut out = Vec::new();
    // Global header: magic, version 2.4, zone 0, sigfigs 0, snaplen, LINKTYPE_ETHERNET.
    out.extend_from_slice(&0xa1b2_c3d4u32.to_le_bytes());
    out.extend_from_slice(&2u16.to_le_bytes());
    out.extend_from_slice(&4u16.to_le_bytes());
    out.extend_from_slice(&0i32.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&65535u32.to_le_bytes());
    out.extend_from_slice(&1u32.to_le_bytes());
    let base = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    for f in frames {
        let t = base + f.at;
        out.extend_from_slice(&(t.as_secs() as u32).to_le_bytes());
        out.extend_from_slice(&t.subsec_micros().to_le_bytes());
        out.extend_from_slice(&(f.data.len() as u32).to_le_bytes());
        out.extend_from_slice(&(f.data.len() as u32).to_le_bytes());
        out.extend_from_slice(&f.data);
    }
    std::fs::write(path, out).map_err(|e| LabError::io(format!("write {}", path.display()), e))
}
