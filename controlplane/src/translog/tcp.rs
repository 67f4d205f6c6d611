//! Syslog over TCP with octet counting (RFC 6587 §3.4.1: `MSG-LEN SP
//! SYSLOG-MSG`, many messages per write): a bounded queue the exporter
//! pushes framed messages to, and a thread of its own
//! (`egret-translog-tcp`) that connects, writes them in batches and
//! reconnects with a backoff.
//!
//! The exporter never waits: a full queue drops the message (counted
//! `queue_full`). The writer may wait, on its own thread: a connect is
//! given 1 s, a write 1 s (a stopped collector fills the window); a failed
//! write drops the batch it held (counted `send_error`) and the
//! connection. While no connection can be made, one batch waits with the
//! writer and the rest in the queue (it fills, then drops). On stop, what
//! is queued gets one more try.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::{DropReason, Sink, Stats};

/// Messages written at most per write.
const BATCH: usize = 1024;
/// How long a connect or a write may take.
const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Backoff between connection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The writer's nap when the queue is empty.
const IDLE: Duration = Duration::from_millis(5);

/// The queue and the writer thread.
#[derive(Debug)]
pub struct TcpSender {
    queue: SyncSender<Vec<u8>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// `line` framed by its length (RFC 6587 §3.4.1).
pub fn frame(line: &str) -> Vec<u8> {
    format!("{} {line}", line.len()).into_bytes()
}

impl TcpSender {
    /// A sender to `collector` with a queue of `capacity` messages.
    pub fn start(collector: SocketAddr, capacity: usize, stats: Arc<Stats>) -> io::Result<TcpSender> {
        let (queue, rx) = mpsc::sync_channel(capacity.max(1));
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::Builder::new()
            .name("egret-translog-tcp".into())
            .spawn(move || write_loop(collector, &rx, &s, &stats))?;
        Ok(TcpSender { queue, stop, thread: Some(thread) })
    }

    /// Queues one message, or counts it lost (`queue_full`).
    pub fn push(&self, line: &str, stats: &Stats) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.queue.try_send(frame(line)) {
            stats.add_dropped(Sink::Syslog, DropReason::QueueFull, 1);
        }
    }
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn write_loop(collector: SocketAddr, queue: &Receiver<Vec<u8>>, stop: &AtomicBool, stats: &Stats) {
    let mut conn: Option<TcpStream> = None;
    let mut backoff = BACKOFF_MIN;
    let mut buf = Vec::new();
    let mut n = 0u64;
    loop {
        let stopping = stop.load(Ordering::Acquire);
        // Take a batch (what the last failed connect left, and more).
        while n < BATCH as u64 {
            match queue.try_recv() {
                Ok(f) => {
                    buf.extend_from_slice(&f);
                    n += 1;
                }
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
            }
        }
        if n == 0 {
            if stopping {
                return;
            }
            std::thread::sleep(IDLE);
            continue;
        }
        if conn.is_none() {
            match TcpStream::connect_timeout(&collector, IO_TIMEOUT) {
                Ok(s) => {
                    let _ = s.set_write_timeout(Some(IO_TIMEOUT));
                    let _ = s.set_nodelay(true);
                    conn = Some(s);
                    backoff = BACKOFF_MIN;
                }
                Err(e) => {
                    if stopping {
                        let lost = n + queue.try_iter().count() as u64;
                        stats.add_dropped(Sink::Syslog, DropReason::SendError, lost);
                        return;
                    }
                    tracing::debug!(%collector, error = %e, "translation logs: syslog over TCP: no connection");
                    // In short naps, so that a stop is not held up.
                    let until = std::time::Instant::now() + backoff;
                    while std::time::Instant::now() < until && !stop.load(Ordering::Acquire) {
                        std::thread::sleep(IDLE * 10);
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    continue;
                }
            }
        }
        let written = conn.as_mut().is_some_and(|c| c.write_all(&buf).is_ok());
        if written {
            stats.add_sent(Sink::Syslog, n);
        } else {
            stats.add_dropped(Sink::Syslog, DropReason::SendError, n);
            conn = None;
        }
        buf.clear();
        n = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 6587 §3.4.1: the octet count, a space, the message.
    #[test]
    fn frames_carry_their_length() {
        assert_eq!(frame("<134>1 - - - - - -"), b"18 <134>1 - - - - - -");
        assert_eq!(frame(""), b"0 ");
    }
}
