//! `new-conns-translog`'s collectors, on the gateway namespace's loopback.
//!
//! Over UDP (IPFIX, syslog) a collector is a bound socket that is never
//! read: a collector that keeps up costs the gateway nothing more, and a
//! full buffer drops silently, as a remote one's would, with no ICMP error
//! for the exporter to count.
//!
//! Over TCP (syslog with `transport: tcp`) a socket that is never read
//! would close the window and measure the exporter's queue filling up, not
//! its cost. So a thread of the benchmark's own accepts the exporter's
//! connections and reads them to the end. Its CPU is not the gateway's
//! (it stands for a remote collector), but on a small machine it competes
//! with the gateway's threads: the figure is, if anything, low.

use std::io::{ErrorKind, Read};
use std::net::{TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::bench::BenchError;

/// The collectors of one run; dropping them stops the reader and closes
/// the sockets.
#[derive(Default)]
pub struct Collectors {
    udp: Vec<UdpSocket>,
    tcp: Option<TcpReader>,
}

impl Collectors {
    /// Binds UDP sockets at `udp` and a TCP listener at `tcp` (both on the
    /// calling thread's namespace, which must be the gateway's).
    pub fn bind(udp: &[&str], tcp: Option<&str>) -> Result<Collectors, BenchError> {
        let io = |what: String| move |source| BenchError::Io { what, source };
        let udp = udp
            .iter()
            .map(|a| UdpSocket::bind(a).map_err(io(format!("binding a translation log collector at {a}"))))
            .collect::<Result<Vec<_>, _>>()?;
        let tcp = match tcp {
            Some(a) => {
                let listener =
                    TcpListener::bind(a).map_err(io(format!("listening for a translation log collector at {a}")))?;
                Some(TcpReader::start(listener).map_err(io(format!("starting the collector's reader at {a}")))?)
            }
            None => None,
        };
        Ok(Collectors { udp, tcp })
    }

    /// Bytes read so far over TCP.
    pub fn tcp_bytes(&self) -> u64 {
        self.tcp.as_ref().map_or(0, |t| t.bytes.load(Ordering::Relaxed))
    }
}

impl std::fmt::Debug for Collectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collectors").field("udp", &self.udp.len()).field("tcp_bytes", &self.tcp_bytes()).finish()
    }
}

/// A thread that accepts connections one after another and reads each to
/// its end (the exporter reconnects after an error).
struct TcpReader {
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

/// How long the reader waits before looking at `stop` again.
const POLL: Duration = Duration::from_millis(50);

impl TcpReader {
    fn start(listener: TcpListener) -> std::io::Result<TcpReader> {
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let bytes = Arc::new(AtomicU64::new(0));
        let (s, b) = (stop.clone(), bytes.clone());
        let thread = std::thread::Builder::new()
            .name("bench-collector".into())
            .spawn(move || read_connections(&listener, &s, &b))?;
        Ok(TcpReader { stop, bytes, thread: Some(thread) })
    }
}

impl Drop for TcpReader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn read_connections(listener: &TcpListener, stop: &AtomicBool, bytes: &AtomicU64) {
    let mut buf = vec![0u8; 256 << 10];
    while !stop.load(Ordering::Relaxed) {
        let mut conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(POLL);
                continue;
            }
            Err(_) => {
                std::thread::sleep(POLL);
                continue;
            }
        };
        // An accepted socket does not inherit O_NONBLOCK on Linux.
        if conn.set_nonblocking(false).and_then(|()| conn.set_read_timeout(Some(POLL))).is_err() {
            continue;
        }
        while !stop.load(Ordering::Relaxed) {
            match conn.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => {}
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_taken_port_is_an_error_naming_it() {
        let taken = UdpSocket::bind("127.0.0.1:0").unwrap();
        let at = taken.local_addr().unwrap().to_string();
        let err = Collectors::bind(&[&at], None).unwrap_err().to_string();
        assert!(err.contains(&at), "{err}");
    }

    #[test]
    fn bytes_written_by_two_connections_in_turn_are_counted() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let at = listener.local_addr().unwrap();
        let reader = TcpReader::start(listener).unwrap();
        for n in [1000usize, 300_000] {
            let mut s = std::net::TcpStream::connect(at).unwrap();
            s.write_all(&vec![b'x'; n]).unwrap();
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while reader.bytes.load(Ordering::Relaxed) < 301_000 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(reader.bytes.load(Ordering::Relaxed), 301_000);
    }
}
