//! Capturing every frame that arrives on one interface (a raw AF_PACKET
//! socket on a thread inside the interface's namespace), the "no pod
//! address leaves" check over a capture, and a pcap writer so a failing
//! test leaves something Wireshark can open.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{LabError, Result};
use crate::netns::NetNs;
use crate::sys::PacketSocket;

/// A captured frame.
#[derive(Clone, Debug)]
pub struct Frame {
    /// When it arrived, from the start of the capture
    /// ([`Capture::started`]): the kernel's receive time, so a capture
    /// thread that lags the wire does not move it.
    pub at: Duration,
    /// The frame from its Ethernet header on.
    pub data: Vec<u8>,
}

/// A capture running on a thread; stop it to get the frames.
#[derive(Debug)]
pub struct Capture {
    what: String,
    started: Instant,
    stop: Arc<AtomicBool>,
    frames: Arc<Mutex<Vec<Frame>>>,
    /// How many times the thread found the socket's queue empty: each time,
    /// every frame the kernel had queued before is in `frames`.
    drained: Arc<AtomicU64>,
    /// While the first is set, the thread reads nothing, and says so in the
    /// second ([`Capture::hold_reading`]).
    held: Arc<(AtomicBool, AtomicBool)>,
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
        let drained = Arc::new(AtomicU64::new(0));
        let held = Arc::new((AtomicBool::new(false), AtomicBool::new(false)));
        let (ready_tx, ready_rx) = mpsc::channel();
        let (stop2, frames2, drained2, held2, what2) =
            (stop.clone(), frames.clone(), drained.clone(), held.clone(), what.clone());
        let thread = ns.spawn_in("capture", move || -> Result<()> {
            // The zero of every frame's `at`, taken before the socket
            // exists so no frame is stamped before it.
            let (started, started_wall) = (Instant::now(), SystemTime::now());
            let sock = match PacketSocket::bind(ifindex)
                .and_then(|s| s.set_recv_buffer(64 << 20).map(|_| s))
                .and_then(|s| s.enable_timestamps().map(|_| s))
            {
                Ok(s) => s,
                Err(e) => {
                    let _ = ready_tx.send(Err(LabError::io(format!("capture on {what2}"), e)));
                    return Ok(());
                }
            };
            let _ = ready_tx.send(Ok(started));
            let mut buf = vec![0u8; 65536];
            let keep = |n: usize, buf: &[u8]| {
                let at = match sock.last_stamp() {
                    Ok(t) => t.duration_since(started_wall).unwrap_or_default(),
                    Err(_) => started.elapsed(),
                };
                if let Ok(mut v) = frames2.lock() {
                    v.push(Frame { at, data: buf[..n].to_vec() });
                }
            };
            loop {
                let holding = held2.0.load(Ordering::Acquire) && !stop2.load(Ordering::Relaxed);
                held2.1.store(holding, Ordering::Release);
                if holding {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                match sock.recv(&mut buf, Duration::ZERO) {
                    Ok(Some(n)) => keep(n, &buf),
                    Ok(None) => {
                        drained2.fetch_add(1, Ordering::AcqRel);
                        // Stop only once the socket is drained.
                        if stop2.load(Ordering::Relaxed) {
                            return Ok(());
                        }
                        match sock.recv(&mut buf, Duration::from_millis(50)) {
                            Ok(Some(n)) => keep(n, &buf),
                            Ok(None) => {}
                            Err(e) => return Err(LabError::io(format!("capture on {what2}"), e)),
                        }
                    }
                    Err(e) => return Err(LabError::io(format!("capture on {what2}"), e)),
                }
            }
        })?;
        let started = match ready_rx.recv_timeout(Duration::from_secs(5)) {
            Ok(Ok(started)) => started,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(LabError::Timeout {
                    what: format!("capture on {what} to start"),
                    after: Duration::from_secs(5),
                })
            }
        };
        let thread = Some(thread);
        Ok(Self { what, started, stop, frames, drained, held, thread })
    }

    /// Stops (`true`) or resumes (`false`) the thread's reading, leaving
    /// the frames in the kernel's queue: a lagging capture on demand, for
    /// the capture's own tests. A hold returns once the thread has stopped
    /// (it may be in the middle of a read for up to 50 ms).
    pub fn hold_reading(&self, held: bool) -> Result<()> {
        self.held.0.store(held, Ordering::Release);
        let deadline = Instant::now() + Duration::from_secs(5);
        while held && !self.held.1.load(Ordering::Acquire) {
            if Instant::now() >= deadline {
                return Err(LabError::Timeout {
                    what: format!("capture on {} to hold its reading", self.what),
                    after: Duration::from_secs(5),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        Ok(())
    }

    /// The instant every frame's [`Frame::at`] counts from.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// The frames captured so far. A frame already on the wire may not be
    /// among them yet: see [`Capture::caught_up`].
    pub fn snapshot(&self) -> Vec<Frame> {
        self.frames.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The frames captured so far, once the capture's thread has read every
    /// frame the kernel had queued for it when this was called: on a busy
    /// machine the thread lags the wire (CI once saw none of the frames a
    /// test had just exchanged, while the pcap written moments later held
    /// them all). Errs if it has not caught up within `within`.
    pub fn caught_up(&self, within: Duration) -> Result<Vec<Frame>> {
        // Two more empty queues than now: the second one's look began after
        // this call, whatever the thread was doing at it.
        let goal = self.drained.load(Ordering::Acquire) + 2;
        let deadline = Instant::now() + within;
        while self.drained.load(Ordering::Acquire) < goal {
            if Instant::now() >= deadline {
                return Err(LabError::Timeout { what: format!("capture on {} to catch up", self.what), after: within });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(self.snapshot())
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
