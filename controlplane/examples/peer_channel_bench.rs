//! Measures the peer channel (docs/benchmarks.md, "Peer channel (issue 16)"):
//! connect + handshake time, throughput of 1 KiB frames over loopback with
//! AEAD and the process's CPU, and the time from SIGKILL of a peer process to
//! `Down { end: Gone }`.
//!
//! `cargo run --release -p egret-controlplane --example peer_channel_bench`
#![allow(clippy::print_stdout, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_controlplane::ha::auth::SharedKey;
use egret_controlplane::ha::channel::{ChannelConfig, End, PeerEvent, Peers, SendError};
use tokio::sync::mpsc;

const SECRET: &[u8] = b"egret-bench-secret-0123456789abcdef";

fn cfg(me: &str) -> ChannelConfig {
    cfg_md5(me, true)
}

fn cfg_md5(me: &str, md5: bool) -> ChannelConfig {
    let key = Arc::new(SharedKey::from_bytes(Path::new("/bench/key"), SECRET).unwrap().into());
    let mut c = ChannelConfig::new(me, "127.0.0.1:0".parse().unwrap(), key);
    c.max_bytes_per_sec = 10_000_000_000;
    c.tcp_md5 = md5;
    c
}

async fn until(rx: &mut mpsc::Receiver<PeerEvent>, want: impl Fn(&PeerEvent) -> bool) -> PeerEvent {
    loop {
        let ev = rx.recv().await.expect("events closed");
        if want(&ev) {
            return ev;
        }
    }
}

/// utime + stime of this process, in seconds.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

async fn handshake() {
    let mut ms = Vec::new();
    for _ in 0..20 {
        let (a, mut ra) = Peers::start(cfg("gw-a")).await.unwrap();
        let (b, mut rb) = Peers::start(cfg("gw-b")).await.unwrap();
        let t0 = Instant::now();
        b.set_peers(BTreeMap::from([("gw-a".to_owned(), a.local_addr())]));
        a.set_peers(BTreeMap::from([("gw-b".to_owned(), b.local_addr())]));
        until(&mut ra, |e| matches!(e, PeerEvent::Up { .. })).await;
        until(&mut rb, |e| matches!(e, PeerEvent::Up { .. })).await;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        a.shutdown("bench").await;
        b.shutdown("bench").await;
    }
    let (lo, med, hi) = median(ms);
    println!("handshake (set_peers to Up on both, 20 runs): min {lo:.2} ms, median {med:.2} ms, max {hi:.2} ms");
}

async fn throughput(frame: usize, md5: bool) {
    let (a, mut ra) = Peers::start(cfg_md5("gw-a", md5)).await.unwrap();
    let (b, mut rb) = Peers::start(cfg_md5("gw-b", md5)).await.unwrap();
    b.set_peers(BTreeMap::from([("gw-a".to_owned(), a.local_addr())]));
    a.set_peers(BTreeMap::from([("gw-b".to_owned(), b.local_addr())]));
    until(&mut ra, |e| matches!(e, PeerEvent::Up { .. })).await;
    until(&mut rb, |e| matches!(e, PeerEvent::Up { .. })).await;
    let run = Duration::from_secs(3);
    let counter = tokio::spawn(async move {
        let (mut n, mut bytes) = (0u64, 0u64);
        while let Some(ev) = rb.recv().await {
            if let PeerEvent::Frame { payload, .. } = ev {
                n += 1;
                bytes += payload.len() as u64;
            }
        }
        (n, bytes)
    });
    let (cpu0, t0) = (cpu_seconds(), Instant::now());
    let mut full = 0u64;
    while t0.elapsed() < run {
        match a.send("gw-b", 1, vec![0x5a; frame]) {
            Ok(()) => {}
            Err(SendError::Full { .. }) => {
                full += 1;
                // The queue (16 MiB) is full: let the writer drain it
                // instead of spinning on a core it needs.
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
    let sent_frames = a.status()[0].frames_out;
    let wall = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    a.shutdown("bench").await;
    b.shutdown("bench").await;
    let (n, bytes) = counter.await.unwrap();
    println!(
        "throughput {frame} B frames, TCP-MD5 {md5}: {:.0} frames/s, {:.1} MB/s payload received ({n} frames, {sent_frames} written), \
         process CPU {:.0}% of one core (both ends and the sending loop), Full {full} times",
        n as f64 / wall,
        bytes as f64 / wall / 1e6,
        cpu / wall * 100.0
    );
}

async fn sigkill(exe: &str) {
    let (b, mut rb) = Peers::start(cfg("gw-b")).await.unwrap();
    b.set_peers(BTreeMap::from([("gw-a".to_owned(), "127.0.0.1:9".parse().unwrap())]));
    let mut ms = Vec::new();
    for _ in 0..10 {
        let mut child =
            Command::new(exe).args(["child", &b.local_addr().to_string()]).stdout(Stdio::null()).spawn().unwrap();
        until(&mut rb, |e| matches!(e, PeerEvent::Up { .. })).await;
        let t0 = Instant::now();
        child.kill().unwrap();
        let ev = until(&mut rb, |e| matches!(e, PeerEvent::Down { .. })).await;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
        assert!(matches!(ev, PeerEvent::Down { end: End::Gone, .. }), "{ev:?}");
        let _ = child.wait();
    }
    let (lo, med, hi) = median(ms);
    println!("SIGKILL to Down{{Gone}} (10 runs): min {lo:.2} ms, median {med:.2} ms, max {hi:.2} ms");
    b.shutdown("bench").await;
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        let (a, _rx) = Peers::start(cfg("gw-a")).await.unwrap();
        a.set_peers(BTreeMap::from([("gw-b".to_owned(), args[2].parse().unwrap())]));
        tokio::time::sleep(Duration::from_secs(60)).await;
        return;
    }
    let probe = Peers::start(cfg("gw-probe")).await.unwrap().0;
    println!("end_authenticated (TCP-MD5): {}", probe.end_authenticated());
    probe.shutdown("bench").await;
    handshake().await;
    // Interleaved rounds: TCP-MD5 on and off (AEAD always on).
    for _ in 0..3 {
        throughput(1024, true).await;
        throughput(1024, false).await;
    }
    throughput(16 << 10, true).await;
    sigkill(&args[0]).await;
}
