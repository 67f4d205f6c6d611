//! A real IPFIX collector for the translation-log tests (ADR 0034):
//! Debian's nfcapd (nfdump 1.7.1) on 127.0.0.1 writing into a temporary
//! directory, and nfdump reading back what it stored.
//!
//! [`Nfcapd::start`] picks a free UDP port, starts `nfcapd -b 127.0.0.1 -p
//! PORT -w DIR -t 60` in the foreground and waits until the port is bound;
//! [`Nfcapd::start_in`] does the same inside a lab's namespace.
//! [`Nfcapd::stop`] sends SIGTERM (nfcapd flushes and renames its file) and
//! waits; [`Nfcapd::query`] runs `nfdump -q -N -R DIR -o fmt:...` with a
//! filter. Dropping it kills a collector still running and removes the
//! directory. A missing command fails naming its package
//! (tests/tools.txt: nfdump).

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::NetNs;
use crate::tools;

/// A running (or stopped) nfcapd and its directory.
#[derive(Debug)]
pub struct Nfcapd {
    child: Option<Child>,
    dir: PathBuf,
    addr: SocketAddr,
}

impl Nfcapd {
    /// Starts a collector on a free port of 127.0.0.1, storing into a new
    /// temporary directory.
    pub fn start() -> std::io::Result<Nfcapd> {
        let port = UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
        Self::start_on(None, SocketAddr::from(([127, 0, 0, 1], port)))
    }

    /// Starts a collector on 127.0.0.1:`port` inside `ns` (a lab's
    /// gateway namespace: its loopback is the gateway's).
    pub fn start_in(ns: &NetNs, port: u16) -> std::io::Result<Nfcapd> {
        Self::start_on(Some(ns), SocketAddr::from(([127, 0, 0, 1], port)))
    }

    /// Starts a collector on `addr` inside `ns` (a lab's namespace: an
    /// address several gateways reach, e.g. the control namespace's).
    pub fn start_in_at(ns: &NetNs, addr: SocketAddr) -> std::io::Result<Nfcapd> {
        Self::start_on(Some(ns), addr)
    }

    fn start_on(ns: Option<&NetNs>, addr: SocketAddr) -> std::io::Result<Nfcapd> {
        let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("egret-nfcapd-{}-{stamp}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let mut cmd = match ns {
            Some(ns) => ns.command("nfcapd"),
            None => Command::new("nfcapd"),
        };
        let child = cmd
            .args(["-b", &addr.ip().to_string(), "-p", &addr.port().to_string(), "-w"])
            .arg(&dir)
            .args(["-t", "60"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| tools::explain_spawn("nfcapd".as_ref(), e))?;
        let mut n = Nfcapd { child: Some(child), dir, addr };
        // Bound once the same port can no longer be bound here.
        let deadline = Instant::now() + Duration::from_secs(10);
        let free = || match ns {
            Some(ns) => ns.run_in(|| UdpSocket::bind(addr).is_ok()).unwrap_or(false),
            None => UdpSocket::bind(addr).is_ok(),
        };
        while free() {
            if let Some(c) = n.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    return Err(std::io::Error::other(format!("nfcapd exited at start: {status}")));
                }
            }
            if Instant::now() > deadline {
                return Err(std::io::Error::other("nfcapd did not bind its port within 10 s"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        n.addr = addr;
        Ok(n)
    }

    /// Where to send.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The directory it writes.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Stops it with SIGTERM (it flushes its file) and waits for it.
    pub fn stop(&mut self) -> std::io::Result<()> {
        let Some(mut c) = self.child.take() else { return Ok(()) };
        let sent = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .map_err(|e| tools::explain_spawn("kill".as_ref(), e))?;
        if !sent.success() {
            return Err(std::io::Error::other(format!("kill -TERM {}: {sent}", c.id())));
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = c.try_wait()? {
                return if status.success() {
                    Ok(())
                } else {
                    Err(std::io::Error::other(format!("nfcapd exited with {status} after SIGTERM")))
                };
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return Err(std::io::Error::other("nfcapd did not stop within 10 s of SIGTERM"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `nfdump -q -N -R DIR -o fmt:FORMAT FILTER` (times in UTC): one line
    /// per record, fields trimmed.
    pub fn query(&self, format: &str, filter: &str) -> std::io::Result<Vec<Vec<String>>> {
        let out = self.nfdump(&["-q", "-N", "-o", &format!("fmt:{format}"), filter])?;
        Ok(out
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| l.split('|').map(|f| f.trim().to_string()).collect())
            .collect())
    }

    /// `nfdump -I -R DIR`: the summary (flows, sequence failures).
    pub fn summary(&self) -> std::io::Result<String> {
        self.nfdump(&["-I"])
    }

    fn nfdump(&self, args: &[&str]) -> std::io::Result<String> {
        let out = Command::new("nfdump")
            .env("TZ", "UTC")
            .args(args)
            .arg("-R")
            .arg(&self.dir)
            .output()
            .map_err(|e| tools::explain_spawn("nfdump".as_ref(), e))?;
        if !out.status.success() {
            return Err(std::io::Error::other(format!(
                "nfdump {args:?} failed: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for Nfcapd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
