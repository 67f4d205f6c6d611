//! A real Kubernetes control plane (kube-apiserver 1.20 + etcd 3.4) on 127.0.0.1 for
//! integration tests.
//!
//! The processes are started, stopped and cut off by `tests/k8s/apiserver.sh`; the
//! binary comes from `tests/k8s/build-apiserver.sh` (cached outside the clone). This
//! module owns the test-side handle: which state directory belongs to which test, a
//! `kube::Client` that trusts the CA the API server generated for its self-signed
//! serving certificate (no insecure-skip), and clean-up that stops only what it started.
//!
//! `EGRET_APISERVER_KUBECONFIG=<path>` makes [`ApiServer::start`] reuse a server that is
//! already running (started by hand or by CI) instead of starting one; such a server is
//! never stopped, killed or restarted from here.
//!
//! [`ApiServer::start_in`] runs the pair inside a network namespace instead (the
//! Kubernetes lab's control namespace, [`crate::k8slab`]): etcd on that namespace's
//! loopback, the API server on an address of one of its links. Such a server is always
//! started fresh (a reused one could not be in the lab's namespace), and its clients must
//! connect from inside a namespace that reaches that address.

use std::ffi::OsString;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Output;

use kube::config::{KubeConfigOptions, Kubeconfig, KubeconfigError};

use crate::requirement::{self, Requirement};
use crate::script::{Script, ScriptError};

/// Path of the script that runs the control plane.
pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/k8s/apiserver.sh");

/// The script and its protocol ([`crate::script`]).
const PAIR: Script = Script {
    path: SCRIPT,
    state_env: "EGRET_APISERVER_STATE",
    owner_env: "EGRET_APISERVER_OWNER_PID",
    state_prefix: "egret-apiserver",
};

/// Set to a kubeconfig path: reuse that running API server instead of starting one.
pub const REUSE_ENV: &str = "EGRET_APISERVER_KUBECONFIG";

/// Set to `1`: a missing binary or a non-root user fails the test instead of skipping it
/// (CI sets it, so a build that silently failed cannot turn into skipped tests).
pub const REQUIRE_ENV: &str = "EGRET_REQUIRE_APISERVER";

/// What went wrong while running the control plane or connecting to it.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// The script could not be run, or failed.
    #[error(transparent)]
    Script(#[from] ScriptError),
    /// `start` succeeded but did not print the kubeconfig path it wrote.
    #[error("{script} start printed no kubeconfig path (stdout {stdout:?})")]
    NoKubeconfigPath { script: &'static str, stdout: String },
    /// The kubeconfig could not be read or turned into a client configuration.
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: KubeconfigError,
    },
    /// The client could not be built from the configuration.
    #[error("kube client for {path}: {source}")]
    Client {
        path: PathBuf,
        #[source]
        source: kube::Error,
    },
    /// Killing or restarting was asked of a server this handle did not start.
    #[error(
        "the API server behind {kubeconfig} was not started by this handle ({REUSE_ENV}); refusing to {action} it"
    )]
    NotOwned { kubeconfig: PathBuf, action: &'static str },
}

/// Result of this module's operations.
pub type Result<T, E = ApiServerError> = std::result::Result<T, E>;

pub use crate::requirement::Unavailable;

/// What the API server tests need ([`crate::requirement`]'s rule).
pub const NEEDS: Requirement = Requirement { what: "the API server", require_env: REQUIRE_ENV };

/// A running kube-apiserver + etcd pair (or a reused one).
#[derive(Debug)]
pub struct ApiServer {
    kubeconfig: PathBuf,
    /// The state directory of a server this handle started; `None` when reused.
    owned_state: Option<PathBuf>,
}

impl ApiServer {
    /// Whether [`ApiServer::start`] can work here: a reused server is always fine;
    /// otherwise root and the built binaries (`apiserver.sh check`) are needed.
    pub fn availability() -> std::result::Result<(), Unavailable> {
        if std::env::var_os(REUSE_ENV).is_some() {
            return Ok(());
        }
        requirement::root("the API server tests run as root")?;
        requirement::script_check(SCRIPT)
    }

    /// `Ok(true)` when the test may go on, `Ok(false)` (after printing why) when it
    /// should return early as skipped, `Err` when [`REQUIRE_ENV`] is `1` and the
    /// control plane is unavailable.
    pub fn available_or_skip(test: &str) -> std::result::Result<bool, Unavailable> {
        NEEDS.available_or_skip(test, Self::availability())
    }

    /// Whether [`ApiServer::start_in`] can work here: root and the built binaries
    /// (`apiserver.sh check`); [`REUSE_ENV`] does not help a lab that needs the server
    /// inside its own namespace.
    pub fn lab_availability() -> std::result::Result<(), Unavailable> {
        requirement::root("the lab runs as root")?;
        requirement::script_check(SCRIPT)
    }

    /// [`ApiServer::available_or_skip`] for a lab test ([`ApiServer::lab_availability`]).
    pub fn lab_available_or_skip(test: &str) -> std::result::Result<bool, Unavailable> {
        NEEDS.available_or_skip(test, Self::lab_availability())
    }

    /// Starts etcd and the API server inside network namespace `netns`, the API server
    /// bound to `address` (which must be configured there) and its Service range set to
    /// `service_cidr` (only stored, never configured on a link); waits until `/readyz`
    /// answers. Blocks for the start-up (6-15 s on a 2-core machine).
    pub fn start_in(netns: &str, address: IpAddr, service_cidr: &str) -> Result<Self> {
        // Once in many runs on a loaded machine the script saw the API
        // server gone before it was ready with an empty log (a fresh-clone
        // run of k8s_ha, stop 24); the harness tries a second time, in a new
        // state directory, and says so. A server that cannot start fails twice.
        Self::start_in_once(netns, address, service_cidr).or_else(|e| {
            eprintln!("kube-apiserver did not start in {netns} ({e}); trying once more");
            Self::start_in_once(netns, address, service_cidr)
        })
    }

    fn start_in_once(netns: &str, address: IpAddr, service_cidr: &str) -> Result<Self> {
        let state = PAIR.fresh_state_dir();
        let extra = [
            ("EGRET_APISERVER_NETNS", OsString::from(netns)),
            ("EGRET_APISERVER_ADDRESS", OsString::from(address.to_string())),
            ("EGRET_APISERVER_SERVICE_CIDR", OsString::from(service_cidr)),
        ];
        let out = match PAIR.run("start", &state, extra) {
            Ok(out) => out,
            Err(e) => {
                let _ = run_script_blocking("stop", &state);
                return Err(e.into());
            }
        };
        Self::from_start_output(state, &out)
    }

    fn from_start_output(state: PathBuf, out: &Output) -> Result<Self> {
        let stdout = String::from_utf8_lossy(&out.stdout);
        let Some(path) = stdout.lines().rev().find(|l| !l.trim().is_empty()) else {
            // The pair may be up; do not leak it.
            let _ = run_script_blocking("stop", &state);
            return Err(ApiServerError::NoKubeconfigPath { script: SCRIPT, stdout: stdout.into_owned() });
        };
        Ok(Self { kubeconfig: PathBuf::from(path.trim()), owned_state: Some(state) })
    }

    /// Starts etcd and the API server in a fresh state directory and waits until
    /// `/readyz` answers; or reuses the server named by [`REUSE_ENV`].
    ///
    /// Blocks for the start-up (a few seconds). A watcher started by the script stops
    /// the pair if this process dies without dropping the handle.
    pub fn start() -> Result<Self> {
        if let Some(path) = std::env::var_os(REUSE_ENV) {
            return Ok(Self { kubeconfig: PathBuf::from(path), owned_state: None });
        }
        let state = PAIR.fresh_state_dir();
        let out = run_script_blocking("start", &state)?;
        Self::from_start_output(state, &out)
    }

    /// The kubeconfig that authenticates as the admin (group `system:masters`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The state directory of a server this handle started (`None` when reused).
    /// Every process of the pair carries this path on its command line.
    pub fn state_dir(&self) -> Option<&Path> {
        self.owned_state.as_deref()
    }

    /// A client for the admin user. Must be called inside a tokio runtime.
    pub async fn client(&self) -> Result<kube::Client> {
        let kubeconfig = Kubeconfig::read_from(&self.kubeconfig)
            .map_err(|source| ApiServerError::Kubeconfig { path: self.kubeconfig.clone(), source })?;
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|source| ApiServerError::Kubeconfig { path: self.kubeconfig.clone(), source })?;
        kube::Client::try_from(config)
            .map_err(|source| ApiServerError::Client { path: self.kubeconfig.clone(), source })
    }

    /// [`ApiServer::kill_apiserver`] for callers without a tokio runtime.
    pub fn kill_apiserver_blocking(&self) -> Result<()> {
        let state = self.owned("kill")?;
        run_script_blocking("kill-apiserver", state).map(drop)
    }

    /// [`ApiServer::restart_apiserver`] for callers without a tokio runtime.
    pub fn restart_apiserver_blocking(&self) -> Result<()> {
        let state = self.owned("restart")?;
        run_script_blocking("restart-apiserver", state).map(drop)
    }

    /// SIGKILLs the API server (etcd and the data stay): clients see connection errors
    /// until [`ApiServer::restart_apiserver`].
    pub async fn kill_apiserver(&self) -> Result<()> {
        let state = self.owned("kill")?;
        run_script("kill-apiserver", state).await.map(drop)
    }

    /// Starts the API server again on the same address, certificate and token; returns
    /// once `/readyz` answers.
    pub async fn restart_apiserver(&self) -> Result<()> {
        let state = self.owned("restart")?;
        run_script("restart-apiserver", state).await.map(drop)
    }

    /// Stops what this handle started and removes its state directory; a reused server
    /// is left running.
    pub fn stop(mut self) -> Result<()> {
        match self.owned_state.take() {
            Some(state) => run_script_blocking("stop", &state).map(drop),
            None => Ok(()),
        }
    }

    fn owned(&self, action: &'static str) -> Result<&Path> {
        self.owned_state
            .as_deref()
            .ok_or_else(|| ApiServerError::NotOwned { kubeconfig: self.kubeconfig.clone(), action })
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(state) = self.owned_state.take() {
            if let Err(e) = run_script_blocking("stop", &state) {
                eprintln!("ApiServer drop: {e}");
            }
        }
    }
}

/// Processes whose command line names a path inside `state_dir` (etcd, the API server,
/// the watcher): `(pid, command line)`. Empty once a server was stopped.
pub fn processes_of(state_dir: &Path) -> Vec<(u32, String)> {
    // With the separator, `/tmp/x-1` does not match the processes of `/tmp/x-10`.
    let needle = format!("{}/", state_dir.to_string_lossy());
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(&needle) {
            found.push((pid, cmdline.trim_end().to_owned()));
        }
    }
    found
}

fn run_script_blocking(command: &'static str, state: &Path) -> Result<Output> {
    Ok(PAIR.run(command, state, std::iter::empty::<(&str, &str)>())?)
}

async fn run_script(command: &'static str, state: &Path) -> Result<Output> {
    Ok(PAIR.run_async(command, state).await?)
}
