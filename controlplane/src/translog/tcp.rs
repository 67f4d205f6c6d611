//! Syslog over TCP with octet counting (RFC 6587 §3.4.1: `MSG-LEN SP
//! SYSLOG-MSG`, many messages per write): a bounded queue the exporter
//! hands framed messages to, a batch at a time, and a thread of its own
//! (`egret-translog-tcp`) that connects, writes them and reconnects with a
//! backoff.
//!
//! The exporter formats each event straight into the batch it is filling
//! (one buffer, no allocation per message) and hands the batch over when it
//! holds [`BATCH`] messages or the pass ends. The queue's size is counted in
//! messages, the batch being filled included: a message that finds it full
//! is dropped (counted `queue_full`). The exporter never waits. The writer may wait,
//! on its own thread: a connect is given 1 s, a write 1 s (a stopped
//! collector fills the window); a failed write drops what it held (counted
//! `send_error`) and the connection. While no connection can be made, one
//! batch waits with the writer and the rest in the queue (it fills, then
//! drops). On stop, what is queued gets one more try.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::syslog::Lines;
use super::{DropReason, Event, Sink, Stats};

/// Messages per batch handed to the writer, and per write at most.
pub const BATCH: u64 = 1024;
/// How long a connect or a write may take.
const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Backoff between connection attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The writer's nap when the queue is empty.
const IDLE: Duration = Duration::from_millis(5);

/// Framed messages, and how many.
#[derive(Debug, Default)]
pub struct Batch {
    bytes: Vec<u8>,
    messages: u64,
}

impl Batch {
    /// Appends `line` framed: its octet count, a space, the line.
    pub fn push(&mut self, line: &[u8]) {
        self.bytes.extend_from_slice(super::syslog::decimal(line.len() as u64, &mut [0; 20]));
        self.bytes.push(b' ');
        self.bytes.extend_from_slice(line);
        self.messages += 1;
    }

    /// The framed bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// The queue and the writer thread.
#[derive(Debug)]
pub struct TcpSender {
    queue: Sender<Batch>,
    /// Messages in the queue (the writer subtracts what it takes).
    queued: Arc<AtomicU64>,
    capacity: u64,
    /// The batch being filled, and the line being formatted.
    filling: Batch,
    line: Vec<u8>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl TcpSender {
    /// A sender to `collector` with a queue of `capacity` messages.
    pub fn start(collector: SocketAddr, capacity: usize, stats: Arc<Stats>) -> io::Result<TcpSender> {
        let (queue, rx) = mpsc::channel();
        let queued = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, q) = (stop.clone(), queued.clone());
        let thread = std::thread::Builder::new()
            .name("egret-translog-tcp".into())
            .spawn(move || write_loop(collector, &rx, &q, &s, &stats))?;
        Ok(TcpSender {
            queue,
            queued,
            capacity: capacity.max(1) as u64,
            filling: Batch::default(),
            line: Vec::with_capacity(512),
            stop,
            thread: Some(thread),
        })
    }

    /// Formats `e` into the batch being filled; hands the batch over when
    /// it is full. A message the queue has no room for, counting the batch
    /// being filled, is counted lost (`queue_full`) without being formatted.
    pub fn push(&mut self, lines: &mut Lines, e: &Event, stats: &Stats) {
        if self.queued.load(Ordering::Acquire) + self.filling.messages >= self.capacity {
            // The writer may have made room since the last hand-over.
            self.flush(stats);
            if self.queued.load(Ordering::Acquire) >= self.capacity {
                stats.add_dropped(Sink::Syslog, DropReason::QueueFull, 1);
                return;
            }
        }
        self.line.clear();
        lines.write_line(e, &mut self.line);
        self.filling.push(&self.line);
        if self.filling.messages >= BATCH {
            self.flush(stats);
        }
    }

    /// Hands the batch being filled to the writer, or counts its messages
    /// lost (`queue_full`) when the queue has no room for them.
    pub fn flush(&mut self, stats: &Stats) {
        let n = self.filling.messages;
        if n == 0 {
            return;
        }
        let batch = std::mem::take(&mut self.filling);
        if self.queued.fetch_add(n, Ordering::AcqRel) + n > self.capacity {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            stats.add_dropped(Sink::Syslog, DropReason::QueueFull, n);
            self.filling = Batch { bytes: reuse(batch.bytes), messages: 0 };
            return;
        }
        if self.queue.send(batch).is_err() {
            self.queued.fetch_sub(n, Ordering::AcqRel);
            stats.add_dropped(Sink::Syslog, DropReason::QueueFull, n);
        }
    }
}

/// An emptied buffer, kept for the next batch.
fn reuse(mut bytes: Vec<u8>) -> Vec<u8> {
    bytes.clear();
    bytes
}

impl Drop for TcpSender {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn write_loop(collector: SocketAddr, queue: &Receiver<Batch>, queued: &AtomicU64, stop: &AtomicBool, stats: &Stats) {
    let mut conn: Option<TcpStream> = None;
    let mut backoff = BACKOFF_MIN;
    let mut buf = Vec::new();
    let mut n = 0u64;
    loop {
        let stopping = stop.load(Ordering::Acquire);
        // Take a batch (what the last failed connect left, and more).
        while n < BATCH {
            match queue.try_recv() {
                Ok(b) => {
                    queued.fetch_sub(b.messages, Ordering::AcqRel);
                    buf.extend_from_slice(&b.bytes);
                    n += b.messages;
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
                        let lost = n + queue.try_iter().map(|b| b.messages).sum::<u64>();
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
        let mut b = Batch::default();
        b.push(b"<134>1 - - - - - -");
        b.push(b"");
        assert_eq!(b.bytes(), b"18 <134>1 - - - - - -0 ");
        assert_eq!(b.messages, 2);
    }
}
