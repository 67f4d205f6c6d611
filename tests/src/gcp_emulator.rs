//! The Compute Engine emulator (`tests/emulators/gcp/`, an emulator of the
//! Compute calls the GCP provider makes; not Google Cloud) on 127.0.0.1 for
//! the GCP provider's tests, and its control API (`/_emulator/`: seeding,
//! faults, configuration, the request log and the routing truth).
//!
//! The emulator is started and stopped by `tests/emulators/gcp/gcp-emulator.sh`
//! (Python 3.11's standard library is all it needs); each [`GcpEmulator`]
//! is one emulator with its own state directory, so parallel tests share
//! nothing. A watcher started by the script stops the emulator if the test
//! process dies without dropping the handle. Its README lists the calls it
//! emulates and where it differs from Google Cloud.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::requirement::{self, Requirement, Unavailable};
use crate::script::{Script, ScriptError};

/// Path of the script that runs the emulator.
pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/emulators/gcp/gcp-emulator.sh");

/// The script and its protocol ([`crate::script`]).
const SERVER: Script = Script {
    path: SCRIPT,
    state_env: "EGRET_GCP_EMULATOR_STATE",
    owner_env: "EGRET_GCP_EMULATOR_OWNER_PID",
    state_prefix: "egret-gcp-emulator",
};

/// Set to `1`: an emulator that cannot run fails the test instead of
/// skipping it (CI sets it).
pub const REQUIRE_ENV: &str = "EGRET_REQUIRE_GCP_EMULATOR";

/// What the GCP provider's tests need ([`crate::requirement`]'s rule).
pub const NEEDS: Requirement = Requirement { what: "the GCP Compute emulator", require_env: REQUIRE_ENV };

/// The project of the emulator's default lab (and of the tests' seeds).
pub const PROJECT: &str = "egret-lab";

/// What went wrong while running the emulator or talking to it.
#[derive(Debug, thiserror::Error)]
pub enum GcpEmulatorError {
    /// The script could not be run, or failed.
    #[error(transparent)]
    Script(#[from] ScriptError),
    /// `start` succeeded but printed no endpoint.
    #[error("{SCRIPT} start printed no endpoint URL (stdout {stdout:?})")]
    NoEndpoint { stdout: String },
    /// A request to the emulator failed, or was answered with an error.
    #[error("the GCP emulator at {endpoint}: {method} {path}: {what}")]
    Api { endpoint: String, method: String, path: String, what: String },
}

/// Result of this module's operations.
pub type Result<T, E = GcpEmulatorError> = std::result::Result<T, E>;

/// One answer of the emulator: its HTTP status and JSON body.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

/// One running emulator, stopped on drop.
#[derive(Debug)]
pub struct GcpEmulator {
    endpoint: String,
    addr: SocketAddr,
    state: Option<PathBuf>,
}

impl GcpEmulator {
    /// Whether the emulator can run here (`gcp-emulator.sh check`: Python
    /// 3.11 or newer and curl).
    pub fn availability() -> std::result::Result<(), Unavailable> {
        requirement::script_check(SCRIPT)
    }

    /// `Ok(true)` when the test may go on, `Ok(false)` (after printing why)
    /// when it should return early as skipped, `Err` when [`REQUIRE_ENV`] is
    /// `1` and the emulator cannot run.
    pub fn available_or_skip(test: &str) -> std::result::Result<bool, Unavailable> {
        NEEDS.available_or_skip(test, Self::availability())
    }

    /// Starts a fresh emulator on a free port of 127.0.0.1 (plain HTTP,
    /// requests without credentials allowed: `--allow-anonymous`) and waits
    /// until it answers. It holds the default lab until [`GcpEmulator::reset`].
    pub fn start() -> Result<Self> {
        Self::start_with(&[("EGRET_GCP_EMULATOR_ARGS", "--allow-anonymous --quiet".into())])
    }

    /// An emulator inside network namespace `ns`, listening on `address`
    /// (an address of that namespace), that refuses requests without
    /// credentials: the cloud lab runs it in its control namespace, where
    /// its gateways reach it. The caller must be in that namespace to call it.
    pub fn start_in(ns: &crate::netns::NetNs, address: std::net::IpAddr) -> Result<Self> {
        Self::start_with(&[
            ("EGRET_GCP_EMULATOR_ARGS", "--quiet".into()),
            ("EGRET_GCP_EMULATOR_NETNS", ns.name().to_string()),
            ("EGRET_GCP_EMULATOR_ADDRESS", address.to_string()),
        ])
    }

    fn start_with(env: &[(&str, String)]) -> Result<Self> {
        let state = SERVER.fresh_state_dir();
        let out = match SERVER.run("start", &state, env.iter().map(|(k, v)| (*k, v))) {
            Ok(out) => out,
            Err(e) => {
                let _ = run_script("stop", &state);
                return Err(e.into());
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let parsed = stdout.lines().rev().find_map(|l| {
            let l = l.trim();
            let hostport = l.strip_prefix("http://")?;
            Some((l.to_owned(), hostport.parse::<SocketAddr>().ok()?))
        });
        let Some((endpoint, addr)) = parsed else {
            let _ = run_script("stop", &state);
            return Err(GcpEmulatorError::NoEndpoint { stdout });
        };
        Ok(Self { endpoint, addr, state: Some(state) })
    }

    /// The emulator's URL (`http://127.0.0.1:PORT`: the client's endpoint).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The emulator's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The state directory (every process of this emulator names it).
    pub fn state_dir(&self) -> Option<&Path> {
        self.state.as_deref()
    }

    /// One HTTP request to the emulator (`path` with its query), answered
    /// whatever its status.
    pub async fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Answer> {
        self.request_as(method, path, body, None).await
    }

    /// [`GcpEmulator::request`] with `Authorization: Bearer <token>`.
    pub async fn request_as(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        token: Option<&str>,
    ) -> Result<Answer> {
        let api = |what: String| GcpEmulatorError::Api {
            endpoint: self.endpoint.clone(),
            method: method.to_owned(),
            path: path.to_owned(),
            what,
        };
        let exchange = async {
            let mut s = tokio::net::TcpStream::connect(self.addr).await?;
            let body = body.map(Value::to_string).unwrap_or_default();
            let auth = token.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
            let head = format!(
                "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n",
                self.addr,
                body.len()
            );
            s.write_all(head.as_bytes()).await?;
            s.write_all(body.as_bytes()).await?;
            let mut resp = Vec::new();
            s.read_to_end(&mut resp).await?;
            Ok::<_, std::io::Error>(resp)
        };
        let resp = tokio::time::timeout(Duration::from_secs(30), exchange)
            .await
            .map_err(|_| api("no answer within 30 s".into()))?
            .map_err(|e| api(e.to_string()))?;
        let text = String::from_utf8_lossy(&resp);
        let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| api(format!("not HTTP: {text:?}")))?;
        let status = head
            .lines()
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| api(format!("no status line: {head:?}")))?;
        let body = if body.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(body).map_err(|e| api(format!("answer not JSON ({e}): {body:?}")))?
        };
        Ok(Answer { status, body })
    }

    /// A control call (`/_emulator/<what>`) that must succeed: its answer.
    pub async fn control(&self, method: &str, what: &str, body: Option<&Value>) -> Result<Value> {
        let path = format!("/_emulator/{what}");
        let a = self.request(method, &path, body).await?;
        if a.status != 200 {
            return Err(GcpEmulatorError::Api {
                endpoint: self.endpoint.clone(),
                method: method.to_owned(),
                path,
                what: format!("answered {}: {}", a.status, a.body),
            });
        }
        Ok(a.body)
    }

    /// Forgets everything and seeds `seed` (`None`: the default lab).
    pub async fn reset(&self, seed: Option<&Value>) -> Result<()> {
        self.control("POST", "reset", Some(seed.unwrap_or(&Value::Null))).await.map(drop)
    }

    /// Adds or replaces resources (a seed's format).
    pub async fn seed(&self, seed: &Value) -> Result<()> {
        self.control("POST", "seed", Some(seed)).await.map(drop)
    }

    /// Every resource as stored now (never stale), and every operation.
    pub async fn state(&self) -> Result<Value> {
        self.control("GET", "state", None).await
    }

    /// Changes the configuration (`operationDelay`, `staleness`, `quota`,
    /// `allowAnonymous`, ...); returns the whole of it.
    pub async fn configure(&self, config: &Value) -> Result<Value> {
        self.control("POST", "config", Some(config)).await
    }

    /// Arms a fault (`api`, `status`, `reason`, `message`, `stall`,
    /// `operationError`, `times`); returns it as armed.
    pub async fn arm(&self, fault: &Value) -> Result<Value> {
        self.control("POST", "faults", Some(fault)).await
    }

    /// Disarms every fault.
    pub async fn disarm_all(&self) -> Result<()> {
        self.control("DELETE", "faults", None).await.map(drop)
    }

    /// The request log (the Compute calls, not the control API's) from
    /// sequence number `since` on.
    pub async fn requests(&self, since: u64) -> Result<Vec<Value>> {
        let v = self.control("GET", &format!("requests?since={since}"), None).await?;
        Ok(v.as_array().cloned().unwrap_or_default())
    }

    /// The logged requests to the call `api` (`forwardingRules.setTarget`).
    pub async fn calls(&self, api: &str) -> Result<Vec<Value>> {
        Ok(self.requests(0).await?.into_iter().filter(|r| r["api"] == api).collect())
    }

    /// The logged requests that change something (not GET).
    pub async fn mutations(&self) -> Result<Vec<Value>> {
        Ok(self.requests(0).await?.into_iter().filter(|r| r["method"] != "GET").collect())
    }

    /// Forgets the request log.
    pub async fn clear_requests(&self) -> Result<()> {
        self.control("DELETE", "requests", None).await.map(drop)
    }

    /// The routing truth: for each reserved external address, the instance
    /// GCP would deliver it to now (from `DONE` state only).
    pub async fn routing(&self) -> Result<Value> {
        self.control("GET", "routing", None).await
    }

    /// The name of the instance the routing truth delivers `address` to
    /// (`None`: nowhere, or to several).
    pub async fn routed_to(&self, address: &str) -> Result<Option<String>> {
        let r = self.routing().await?;
        let entry = r["addresses"].as_array().and_then(|a| a.iter().find(|e| e["address"] == address)).cloned();
        Ok(entry.and_then(|e| {
            let i = &e["instance"];
            i["name"].as_str().or_else(|| i.as_str()).map(str::to_owned)
        }))
    }

    /// Replaces the labels of the address `name` of `region`, as an
    /// operator would (README.md, the control API's `labels`).
    pub async fn set_labels(&self, region: &str, name: &str, labels: &Value) -> Result<()> {
        let body = serde_json::json!({"region": region, "name": name, "labels": labels});
        self.control("POST", "labels", Some(&body)).await.map(drop)
    }

    /// Stops the emulator and removes its state.
    pub fn stop(mut self) -> Result<()> {
        match self.state.take() {
            Some(state) => run_script("stop", &state).map(drop),
            None => Ok(()),
        }
    }
}

impl Drop for GcpEmulator {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            if let Err(e) = run_script("stop", &state) {
                eprintln!("GcpEmulator drop: {e}");
            }
        }
    }
}

fn run_script(command: &'static str, state: &Path) -> Result<Output> {
    Ok(SERVER.run(command, state, std::iter::empty::<(&str, &str)>())?)
}
