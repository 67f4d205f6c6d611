//! Running the Egret gateway daemon for a measurement: its YAML config
//! (docs/config.md), the process inside the gateway's namespace, readiness
//! (`GET /ready` on the metrics listener answers 200 once the XDP program is
//! attached and every worker runs), its threads, and SIGTERM to stop it.
//!
//! The harness only relies on that contract; it finds the daemon's threads
//! through /proc and recognises workers by their name (`egret-worker-N`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::topology::{in_netns, NetnsError};

/// Thread-name prefix of the daemon's AF_XDP workers.
pub const WORKER_PREFIX: &str = "egret-worker";

/// What failed around the daemon.
#[derive(Debug, thiserror::Error)]
pub enum EgretError {
    #[error("egret binary not found at {path} (build it with `cargo build --release -p egret-controlplane`, pass --egret PATH, or leave egret/fastpath/new-conns out of --modes)")]
    NotFound { path: PathBuf },
    #[error("writing {path} failed: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("starting {binary} failed: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
    #[error("`egret check-config {config}` refused it ({status}): {output}")]
    CheckConfig { config: PathBuf, status: String, output: String },
    #[error("the egret daemon exited ({status}) before it was ready; its log ({log}) ends with:\n{tail}")]
    Exited { status: String, log: PathBuf, tail: String },
    #[error("the egret daemon was not ready after {secs} s (GET /ready on 127.0.0.1:{port}: {last}); its log ({log}) ends with:\n{tail}")]
    NotReady { secs: u64, port: u16, last: String, log: PathBuf, tail: String },
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

/// The gateway config the benchmark runs Egret with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchConfig {
    pub inside: String,
    pub outside: String,
    pub fast_path: bool,
    /// `xdp.fastPathSessions`, when not the default.
    pub fast_path_sessions: Option<u32>,
    pub cpu: usize,
    pub realtime_priority: u32,
    pub egress_ips: Vec<Ipv4Addr>,
    pub sources: String,
    pub destinations: String,
    /// `nat.ports`, when not the default.
    pub ports: Option<(u16, u16)>,
    pub metrics_port: u16,
    pub admin_socket: PathBuf,
    /// `tunnel:` (issue 30), when the nodes' VXLAN tunnel is on.
    pub tunnel: Option<TunnelConfig>,
    /// `translationLogs:` (issue 34) to the gateway namespace's loopback.
    pub translog: Option<TranslogSinks>,
    /// `nat.portBlocks.size` (ADR 0034 §6), when each pod takes blocks of
    /// ports and the logs hold one record per block (`logSessions: false`).
    pub port_blocks: Option<u16>,
    /// `translationLogs.ringRecords`, when not the daemon's default.
    pub ring_records: Option<u32>,
}

/// `nat.portBlocks.maxPerPod` with [`BenchConfig::port_blocks`]: the most
/// the daemon accepts, so that a pod's new flows in a window are refused
/// only when the egress IP's blocks run out.
pub const PORT_BLOCKS_PER_POD: u16 = 32;

/// Where `new-conns-translog` sends IPFIX: the gateway namespace's loopback.
pub const IPFIX_COLLECTOR: &str = "127.0.0.1:4739";
/// Where `new-conns-translog` sends syslog.
pub const SYSLOG_COLLECTOR: &str = "127.0.0.1:5514";

/// Which collectors `new-conns-translog` exports to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TranslogSinks {
    /// IPFIX only (about 40 records per datagram).
    Ipfix,
    /// Syslog only (a datagram per event).
    Syslog,
    /// Syslog only, over TCP (`transport: tcp`, RFC 6587 octet counting,
    /// written in batches by a thread of the exporter's own).
    SyslogTcp,
    /// IPFIX and syslog over UDP.
    Both,
}

/// The gateway's `tunnel:` section in file mode (docs/config.md, "The
/// nodes' tunnel").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelConfig {
    pub port: u16,
    pub node_addresses: Vec<Ipv4Addr>,
}

impl BenchConfig {
    /// The YAML text (docs/config.md).
    pub fn to_yaml(&self) -> String {
        let mut y = String::new();
        let ips: Vec<String> = self.egress_ips.iter().map(ToString::to_string).collect();
        let _ = writeln!(y, "# Written by egret-throughput; see docs/benchmarks-throughput.md.");
        let _ = writeln!(y, "interfaces:");
        let _ = writeln!(y, "  - {{name: {}, role: inside}}", self.inside);
        let _ = writeln!(y, "  - {{name: {}, role: outside}}", self.outside);
        match self.fast_path_sessions {
            Some(n) => {
                let _ = writeln!(y, "xdp: {{mode: native, fastPath: {}, fastPathSessions: {n}}}", self.fast_path);
            }
            None => {
                let _ = writeln!(y, "xdp: {{mode: native, fastPath: {}}}", self.fast_path);
            }
        }
        let _ = writeln!(y, "workers: {{cpus: [{}], realtimePriority: {}}}", self.cpu, self.realtime_priority);
        let _ = writeln!(y, "egressIPs:");
        for ip in &ips {
            let _ = writeln!(y, "  - {{ip: {ip}}}");
        }
        let _ = writeln!(y, "policies:");
        let _ = writeln!(y, "  - name: bench");
        let _ = writeln!(y, "    sources: [{}]", self.sources);
        let _ = writeln!(y, "    destinations: [{}]", self.destinations);
        let _ = writeln!(y, "    egressIPs: [{}]", ips.join(", "));
        let mut nat = Vec::new();
        if let Some((lo, hi)) = self.ports {
            nat.push(format!("ports: {lo}-{hi}"));
        }
        if let Some(size) = self.port_blocks {
            nat.push(format!("portBlocks: {{size: {size}, maxPerPod: {PORT_BLOCKS_PER_POD}, logSessions: false}}"));
        }
        if !nat.is_empty() {
            let _ = writeln!(y, "nat: {{{}}}", nat.join(", "));
        }
        if let Some(t) = &self.tunnel {
            let nodes: Vec<String> = t.node_addresses.iter().map(ToString::to_string).collect();
            let _ = writeln!(y, "tunnel: {{port: {}, nodeAddresses: [{}]}}", t.port, nodes.join(", "));
        }
        if let Some(sinks) = self.translog {
            let ipfix = format!("ipfix: {{collector: \"{IPFIX_COLLECTOR}\"}}");
            let syslog = format!("syslog: {{collector: \"{SYSLOG_COLLECTOR}\"}}");
            let body = match sinks {
                TranslogSinks::Ipfix => ipfix,
                TranslogSinks::Syslog => syslog,
                TranslogSinks::SyslogTcp => format!("syslog: {{collector: \"{SYSLOG_COLLECTOR}\", transport: tcp}}"),
                TranslogSinks::Both => format!("{ipfix}, {syslog}"),
            };
            // The journal (on by default) is not one of the sinks measured.
            let ring = self.ring_records.map(|n| format!(", ringRecords: {n}")).unwrap_or_default();
            let _ = writeln!(y, "translationLogs: {{{body}, journal: {{enabled: false}}{ring}}}");
        }
        let _ = writeln!(y, "metrics: {{listen: \"127.0.0.1:{}\"}}", self.metrics_port);
        let _ = writeln!(y, "admin: {{socket: {}}}", self.admin_socket.display());
        y
    }
}

/// Fail early, with the path, when the binary is missing.
pub fn locate(binary: &Path) -> Result<PathBuf, EgretError> {
    if binary.is_file() {
        Ok(binary.to_path_buf())
    } else {
        Err(EgretError::NotFound { path: binary.to_path_buf() })
    }
}

/// Write `config` to `path`.
pub fn write_config(path: &Path, config: &BenchConfig) -> Result<(), EgretError> {
    std::fs::write(path, config.to_yaml()).map_err(|source| EgretError::Write { path: path.to_path_buf(), source })
}

/// `egret check-config FILE`: whether the daemon accepts the file.
pub fn check_config(binary: &Path, config: &Path) -> Result<(), EgretError> {
    let out = Command::new(binary)
        .arg("check-config")
        .arg(config)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| EgretError::Spawn { binary: binary.to_path_buf(), source })?;
    if out.status.success() {
        return Ok(());
    }
    let mut output = String::from_utf8_lossy(&out.stderr).into_owned();
    output.push_str(&String::from_utf8_lossy(&out.stdout));
    Err(EgretError::CheckConfig {
        config: config.to_path_buf(),
        status: out.status.to_string(),
        output: output.trim().to_owned(),
    })
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// `GET path` on 127.0.0.1:`port` inside `netns`: the whole response text.
pub fn http_get(netns: &str, port: u16, path: &str) -> Result<String, String> {
    let r: Result<Result<String, String>, NetnsError> = in_netns(netns, || {
        let attempt = || -> std::io::Result<String> {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes())?;
            let mut buf = Vec::new();
            s.take(8 << 20).read_to_end(&mut buf)?;
            Ok(String::from_utf8_lossy(&buf).into_owned())
        };
        Ok(attempt().map_err(|e| e.to_string()))
    });
    r.map_err(|e| e.to_string())?
}

/// The status code of `GET /ready` on 127.0.0.1:`port` inside `netns`.
pub fn ready_status(netns: &str, port: u16) -> Result<u16, String> {
    let text = http_get(netns, port, "/ready")?;
    parse_status(&text).ok_or_else(|| format!("bad answer {text:?}"))
}

/// Prometheus text exposition: every sample's value summed per metric name
/// (labels dropped), and each labelled sample also under its whole series
/// name as written (`egret_drops_total{reason="no_route"}`); comments and
/// unparsable lines skipped.
pub fn parse_metrics(body: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in body.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(line.len());
        let name = &line[..name_end];
        let rest = match line[name_end..].rfind('}') {
            Some(i) if line[name_end..].starts_with('{') => &line[name_end + i + 1..],
            _ => &line[name_end..],
        };
        if let Some(v) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) {
            *out.entry(name.to_owned()).or_insert(0.0) += v;
            let series = line[..line.len() - rest.len()].trim_end();
            if series.len() > name.len() {
                *out.entry(series.to_owned()).or_insert(0.0) += v;
            }
        }
    }
    out
}

/// `GET /metrics`, parsed.
pub fn scrape(netns: &str, port: u16) -> Result<BTreeMap<String, f64>, String> {
    let text = http_get(netns, port, "/metrics")?;
    if parse_status(&text) != Some(200) {
        return Err(format!("GET /metrics: {}", text.lines().next().unwrap_or_default()));
    }
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok(parse_metrics(body))
}

/// Frames Egret's workers took off their RX rings (every socket).
pub const WORKER_RX_METRIC: &str = "egret_xsk_rx_frames_total";

/// The status code of an HTTP/1.x response.
pub fn parse_status(response: &str) -> Option<u16> {
    let line = response.lines().next()?;
    let mut it = line.split_whitespace();
    if !it.next()?.starts_with("HTTP/1.") {
        return None;
    }
    it.next()?.parse().ok()
}

/// A running daemon; dropping it stops it (SIGTERM, then SIGKILL after 5 s).
#[derive(Debug)]
pub struct Daemon {
    child: Child,
    netns: String,
    port: u16,
    log: PathBuf,
}

impl Daemon {
    /// `ip netns exec <netns> <binary> gateway --config <config>`, output to
    /// `log`. `ip netns exec` execs in place, so the child is the daemon.
    pub fn start(binary: &Path, netns: &str, config: &Path, log: &Path, port: u16) -> Result<Self, EgretError> {
        let out = File::create(log).map_err(|source| EgretError::Write { path: log.to_path_buf(), source })?;
        let err = out.try_clone().map_err(|source| EgretError::Write { path: log.to_path_buf(), source })?;
        let child = Command::new("ip")
            .args(["netns", "exec", netns])
            .arg(binary)
            .arg("gateway")
            .arg("--config")
            .arg(config)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|source| EgretError::Spawn { binary: binary.to_path_buf(), source })?;
        Ok(Self { child, netns: netns.to_owned(), port, log: log.to_path_buf() })
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Poll `/ready` until 200, the process exits, or `timeout` passes.
    pub fn wait_ready(&mut self, timeout: Duration, stop: impl Fn() -> bool) -> Result<(), EgretError> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(EgretError::Exited {
                    status: status.to_string(),
                    log: self.log.clone(),
                    tail: tail(&self.log, 20),
                });
            }
            let last = match ready_status(&self.netns, self.port) {
                Ok(200) => return Ok(()),
                Ok(code) => format!("status {code}"),
                Err(e) => e,
            };
            if start.elapsed() >= timeout || stop() {
                return Err(EgretError::NotReady {
                    secs: timeout.as_secs(),
                    port: self.port,
                    last,
                    log: self.log.clone(),
                    tail: tail(&self.log, 20),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stop with SIGTERM (SIGKILL after 5 s) and reap.
    pub fn stop(&mut self) -> Option<ExitStatus> {
        if let Ok(Some(s)) = self.child.try_wait() {
            return Some(s);
        }
        let _ = crate::sys::send_signal(self.child.id(), libc::SIGTERM);
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        self.child.wait().ok()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_text_is_the_documented_shape() {
        let c = BenchConfig {
            inside: "gwin".into(),
            outside: "gwout".into(),
            fast_path: false,
            fast_path_sessions: None,
            cpu: 1,
            realtime_priority: 50,
            egress_ips: vec![Ipv4Addr::new(203, 0, 113, 10), Ipv4Addr::new(203, 0, 113, 11)],
            sources: "198.18.0.0/16".into(),
            destinations: "198.51.100.0/24".into(),
            ports: Some((1024, 65535)),
            metrics_port: 19469,
            admin_socket: PathBuf::from("/tmp/x/egret.sock"),
            tunnel: None,
            translog: None,
            port_blocks: None,
            ring_records: None,
        };
        assert_eq!(
            c.to_yaml(),
            "# Written by egret-throughput; see docs/benchmarks-throughput.md.\n\
             interfaces:\n  - {name: gwin, role: inside}\n  - {name: gwout, role: outside}\n\
             xdp: {mode: native, fastPath: false}\n\
             workers: {cpus: [1], realtimePriority: 50}\n\
             egressIPs:\n  - {ip: 203.0.113.10}\n  - {ip: 203.0.113.11}\n\
             policies:\n  - name: bench\n    sources: [198.18.0.0/16]\n    destinations: [198.51.100.0/24]\n    \
             egressIPs: [203.0.113.10, 203.0.113.11]\n\
             nat: {ports: 1024-65535}\n\
             metrics: {listen: \"127.0.0.1:19469\"}\n\
             admin: {socket: /tmp/x/egret.sock}\n"
        );
        let sized = BenchConfig { fast_path: true, fast_path_sessions: Some(16384), ..c.clone() };
        assert!(sized.to_yaml().contains("\nxdp: {mode: native, fastPath: true, fastPathSessions: 16384}\n"));
        let logged = BenchConfig { translog: Some(TranslogSinks::Both), ..c.clone() };
        assert!(logged.to_yaml().contains(
            "\ntranslationLogs: {ipfix: {collector: \"127.0.0.1:4739\"}, syslog: {collector: \"127.0.0.1:5514\"}, journal: {enabled: false}}\nmetrics:"
        ));
        let over_tcp = BenchConfig { translog: Some(TranslogSinks::SyslogTcp), ..c.clone() };
        assert!(over_tcp.to_yaml().contains(
            "\ntranslationLogs: {syslog: {collector: \"127.0.0.1:5514\", transport: tcp}, journal: {enabled: false}}\nmetrics:"
        ));
        let blocks = BenchConfig { translog: Some(TranslogSinks::Syslog), port_blocks: Some(16), ..c.clone() };
        assert!(blocks
            .to_yaml()
            .contains("\nnat: {ports: 1024-65535, portBlocks: {size: 16, maxPerPod: 32, logSessions: false}}\n"));
        let small_ring = BenchConfig { translog: Some(TranslogSinks::Ipfix), ring_records: Some(4096), ..c.clone() };
        assert!(small_ring.to_yaml().contains(
            "\ntranslationLogs: {ipfix: {collector: \"127.0.0.1:4739\"}, journal: {enabled: false}, ringRecords: 4096}\n"
        ));
        let tunnelled = BenchConfig {
            ports: Some((6083, 65535)),
            tunnel: Some(TunnelConfig { port: 6082, node_addresses: vec![Ipv4Addr::new(192, 0, 2, 31)] }),
            ..c
        };
        assert!(tunnelled
            .to_yaml()
            .contains("\nnat: {ports: 6083-65535}\ntunnel: {port: 6082, nodeAddresses: [192.0.2.31]}\nmetrics:"));
    }

    #[test]
    fn http_status_lines() {
        assert_eq!(parse_status("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"), Some(200));
        assert_eq!(parse_status("HTTP/1.0 503 Service Unavailable\r\n"), Some(503));
        assert_eq!(parse_status("SSH-2.0-x\r\n"), None);
        assert_eq!(parse_status(""), None);
    }

    #[test]
    fn metrics_are_summed_per_name() {
        let body = "# HELP egret_xsk_rx_frames_total Frames received from the RX ring.\n\
            # TYPE egret_xsk_rx_frames_total counter\n\
            egret_xsk_rx_frames_total{worker=\"0\",interface=\"gwin\",queue=\"0\"} 21\n\
            egret_xsk_rx_frames_total{worker=\"0\",interface=\"gwout\",queue=\"0\"} 4\n\
            egret_drops_total{reason=\"a } b\"} 3\n\
            egret_ready 1\n\
            garbage\n";
        let m = parse_metrics(body);
        assert_eq!(m.get(WORKER_RX_METRIC), Some(&25.0));
        assert_eq!(m.get("egret_drops_total"), Some(&3.0));
        assert_eq!(m.get("egret_ready"), Some(&1.0));
        // Each labelled series under its own name too.
        assert_eq!(m.get("egret_drops_total{reason=\"a } b\"}"), Some(&3.0));
        assert_eq!(m.get("egret_xsk_rx_frames_total{worker=\"0\",interface=\"gwout\",queue=\"0\"}"), Some(&4.0));
        assert_eq!(m.len(), 6);
    }

    #[test]
    fn a_missing_binary_is_named() {
        let e = locate(Path::new("/nonexistent/egret")).expect_err("missing");
        assert!(e.to_string().starts_with("egret binary not found at /nonexistent/egret"), "{e}");
    }
}
