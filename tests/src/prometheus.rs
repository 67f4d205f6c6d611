//! A real Prometheus (Debian's `prometheus` package) for the monitoring lab:
//! started with a configuration the test writes, in the namespace of the
//! calling thread, listening on loopback there; queried over its HTTP API;
//! killed on drop. `promtool` (same package) runs rule unit tests.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::error::{LabError, Result};
use crate::netns;

/// A running `prometheus`.
#[derive(Debug)]
pub struct Prometheus {
    child: Option<Child>,
    listen: SocketAddr,
    log: PathBuf,
}

impl Prometheus {
    /// Starts `prometheus` with `config` (the YAML text, written to
    /// `dir/prometheus.yml`), its database in `dir/prometheus-data`, its web
    /// API on `listen`; waits (up to 30 s) until `/-/ready` answers 200.
    pub fn start(dir: &Path, config: &str, listen: SocketAddr) -> Result<Self> {
        let file = dir.join("prometheus.yml");
        std::fs::write(&file, config).map_err(|e| LabError::io(format!("write {}", file.display()), e))?;
        let log = dir.join("prometheus.log");
        let mut cmd = Command::new("prometheus");
        cmd.arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("prometheus-data").display()))
            .arg(format!("--web.listen-address={listen}"))
            .arg("--log.level=info");
        let child = netns::spawn_logged(&mut cmd, &log)?;
        let mut p = Self { child: Some(child), listen, log };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = p.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                return Err(LabError::Gateway(format!("prometheus exited ({st}):\n{}", p.log_tail(20))));
            }
            if p.get("/-/ready").ok().map(|(s, _)| s) == Some(200) {
                return Ok(p);
            }
            if Instant::now() > deadline {
                return Err(LabError::Gateway(format!("prometheus not ready after 30 s:\n{}", p.log_tail(20))));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let v: Vec<&str> = text.lines().collect();
        v[v.len().saturating_sub(n)..].join("\n")
    }

    /// GET `path_and_query`: status and body.
    pub fn get(&self, path_and_query: &str) -> Result<(u16, String)> {
        let io = |e| LabError::io(format!("GET {path_and_query} from prometheus"), e);
        let mut s = TcpStream::connect_timeout(&self.listen, Duration::from_secs(2)).map_err(io)?;
        s.set_read_timeout(Some(Duration::from_secs(10))).map_err(io)?;
        let req = format!("GET {path_and_query} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n", self.listen);
        s.write_all(req.as_bytes()).map_err(io)?;
        let mut text = String::new();
        s.read_to_string(&mut text).map_err(io)?;
        let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
            dechunk(body)
        } else {
            body.to_string()
        };
        Ok((status, body))
    }

    /// `GET /api/v1/<what>?<query>` as JSON, its `data` member; an error
    /// names the API's own error text.
    pub fn api(&self, what: &str, params: &[(&str, &str)]) -> Result<serde_json::Value> {
        let q: Vec<String> = params.iter().map(|(k, v)| format!("{k}={}", url_encode(v))).collect();
        let (status, body) = self.get(&format!("/api/v1/{what}?{}", q.join("&")))?;
        let v: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| LabError::Gateway(format!("prometheus /api/v1/{what}: {status}: not JSON ({e}): {body}")))?;
        if v["status"] != "success" {
            return Err(LabError::Gateway(format!("prometheus /api/v1/{what} {params:?}: {status}: {body}")));
        }
        Ok(v["data"].clone())
    }

    /// The result vector of the instant query `expr` (now).
    pub fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>> {
        let data = self.api("query", &[("query", expr)])?;
        Ok(data["result"].as_array().cloned().unwrap_or_default())
    }

    /// The active alerts (pending and firing), from the rules it evaluates.
    pub fn alerts(&self) -> Result<Vec<serde_json::Value>> {
        let (status, body) = self.get("/api/v1/alerts")?;
        let v: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| LabError::Gateway(format!("prometheus /api/v1/alerts: {status}: not JSON ({e})")))?;
        Ok(v["data"]["alerts"].as_array().cloned().unwrap_or_default())
    }

    /// Its scrape targets (`/api/v1/targets`, the active ones).
    pub fn targets(&self) -> Result<Vec<serde_json::Value>> {
        let data = self.api("targets", &[("state", "active")])?;
        Ok(data["activeTargets"].as_array().cloned().unwrap_or_default())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `promtool ARGS...`: its combined output, or an error with it.
pub fn promtool(args: &[&str]) -> Result<String> {
    let out = Command::new("promtool").args(args).output().map_err(|e| LabError::io("run promtool", e))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text)
    } else {
        Err(LabError::Gateway(format!("promtool {}: {}:\n{text}", args.join(" "), out.status)))
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
pub fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The body of a chunked HTTP/1.1 response.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else { break };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").unwrap_or(&rest[n..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_promql() {
        assert_eq!(url_encode("up{job=\"egret-gateway\"} == 0"), "up%7Bjob%3D%22egret-gateway%22%7D%20%3D%3D%200");
    }

    #[test]
    fn dechunks() {
        assert_eq!(dechunk("4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n"), "abcdefg");
    }
}
