//! The ARM emulator (`tests/emulators/azure`, its README says what it
//! emulates and where it differs from Azure) on 127.0.0.1 for the Azure
//! provider's tests, over HTTPS with a test CA (azure_core sends a bearer
//! token over HTTPS only), and helpers that seed it and read its control
//! API (`/_emulator/`: seeding, settings, faults, the request log, the
//! routing truth).
//!
//! The server is started and stopped by `azure-emulator.sh` (the protocol of
//! [`crate::script`]); each [`AzureEmulator`] is one server with its own
//! state directory, and a watcher stops it if the test process dies. The
//! control API is called with `curl` (the emulator serves it on the same
//! HTTPS listener as ARM).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{json, Value};

use crate::moto::TestCa;
use crate::requirement::{self, Requirement, Unavailable};
use crate::script::{Script, ScriptError};

/// Path of the script that runs the emulator.
pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/emulators/azure/azure-emulator.sh");

const SERVER: Script = Script {
    path: SCRIPT,
    state_env: "EGRET_AZURE_EMU_STATE",
    owner_env: "EGRET_AZURE_EMU_OWNER_PID",
    state_prefix: "egret-azure-emu",
};

/// Set to `1`: an emulator that cannot run fails the test instead of
/// skipping it (CI sets it).
pub const REQUIRE_ENV: &str = "EGRET_REQUIRE_AZURE_EMULATOR";

/// What the Azure provider's tests need ([`crate::requirement`]'s rule).
pub const NEEDS: Requirement = Requirement { what: "the ARM emulator", require_env: REQUIRE_ENV };

/// The seeded subscription and resource group (the emulator's default
/// subscription).
pub const SUBSCRIPTION: &str = "00000000-0000-4000-8000-000000000001";
pub const RESOURCE_GROUP: &str = "egret";
/// The seeded subnets (RFC 2544's benchmarking range, as the AWS tests).
pub const SUBNET_CIDR: &str = "198.18.1.0/24";
pub const OTHER_SUBNET_CIDR: &str = "198.18.2.0/24";

/// What went wrong while running the emulator or talking to it.
#[derive(Debug, thiserror::Error)]
pub enum EmulatorError {
    #[error(transparent)]
    Script(#[from] ScriptError),
    #[error("{SCRIPT} start printed no endpoint URL (stdout {stdout:?})")]
    NoEndpoint { stdout: String },
    #[error("the test CA: {0}")]
    Ca(#[from] std::io::Error),
    /// A control or ARM call failed.
    #[error("ARM emulator {endpoint}: {what}")]
    Api { endpoint: String, what: String },
}

pub type Result<T, E = EmulatorError> = std::result::Result<T, E>;

/// One running emulator over HTTPS, stopped on drop.
#[derive(Debug)]
pub struct AzureEmulator {
    endpoint: String,
    ca: PathBuf,
    state: Option<PathBuf>,
    _tls: tempdir::Dir,
}

/// A seeded virtual network: the gateways' subnet and another.
#[derive(Clone, Debug)]
pub struct Network {
    pub subnet_id: String,
    pub other_subnet_id: String,
}

/// A seeded VM with one NIC.
#[derive(Clone, Debug)]
pub struct Vm {
    pub vm_id: String,
    /// What cloud-provider-azure writes into the Node: `azure://<vm id>`.
    pub provider_id: String,
    pub nic_id: String,
    pub nic_name: String,
    pub primary_ip: IpAddr,
}

/// A seeded public IP address.
#[derive(Clone, Debug)]
pub struct PublicIp {
    pub id: String,
    pub ip: IpAddr,
}

impl AzureEmulator {
    /// Whether the emulator can run here (`azure-emulator.sh check`: python3
    /// 3.11 and curl) and openssl is there for its certificate.
    pub fn availability() -> std::result::Result<(), Unavailable> {
        requirement::script_check(SCRIPT)?;
        crate::tools::require("openssl").map(drop).map_err(Unavailable)
    }

    /// `Ok(true)` when the test may go on, `Ok(false)` (after printing why)
    /// when it should return early as skipped, `Err` when [`REQUIRE_ENV`] is
    /// `1` and the emulator cannot run.
    pub fn available_or_skip(test: &str) -> std::result::Result<bool, Unavailable> {
        NEEDS.available_or_skip(test, Self::availability())
    }

    /// Starts a fresh emulator on a free port of 127.0.0.1, serving HTTPS
    /// with a certificate from a CA made for it ([`AzureEmulator::ca_pem`]).
    pub fn start() -> Result<Self> {
        Self::start_with(None)
    }

    /// [`AzureEmulator::start`] inside network namespace `ns`, listening on
    /// `address` (an address of that namespace, which the certificate
    /// names): the cloud lab runs it in its control namespace, where its
    /// gateways reach it. The caller must be in that namespace to call it.
    pub fn start_in(ns: &crate::netns::NetNs, address: IpAddr) -> Result<Self> {
        Self::start_with(Some((ns.name().to_string(), address)))
    }

    fn start_with(netns: Option<(String, IpAddr)>) -> Result<Self> {
        let tls = tempdir::Dir::new("egret-azure-emu-tls")?;
        let address = netns.as_ref().map_or(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), |(_, a)| *a);
        TestCa::create_for(tls.path(), &[address])?;
        let state = SERVER.fresh_state_dir();
        let mut env = vec![("EGRET_AZURE_EMU_TLS_DIR", tls.path().display().to_string())];
        if let Some((ns, address)) = netns {
            env.push(("EGRET_AZURE_EMU_NETNS", ns));
            env.push(("EGRET_AZURE_EMU_ADDRESS", address.to_string()));
        }
        let out = match SERVER.run("start", &state, env.iter().map(|(k, v)| (*k, v))) {
            Ok(out) => out,
            Err(e) => {
                let _ = run_script("stop", &state);
                return Err(e.into());
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let Some(endpoint) = stdout.lines().rev().map(str::trim).find(|l| l.starts_with("https://")) else {
            let _ = run_script("stop", &state);
            return Err(EmulatorError::NoEndpoint { stdout });
        };
        Ok(Self { endpoint: endpoint.to_owned(), ca: tls.path().join("ca.pem"), state: Some(state), _tls: tls })
    }

    /// `https://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The CA certificate (PEM) the emulator's certificate chains to.
    pub fn ca_pem(&self) -> Result<Vec<u8>> {
        Ok(std::fs::read(&self.ca)?)
    }

    /// The CA certificate's path.
    pub fn ca_path(&self) -> &Path {
        &self.ca
    }

    /// Stops the emulator and removes its state.
    pub fn stop(mut self) -> Result<()> {
        match self.state.take() {
            Some(state) => run_script("stop", &state).map(drop),
            None => Ok(()),
        }
    }

    // ------------------------------------------------------------ HTTP ---

    /// One request to the emulator with curl: the status and the JSON body
    /// (`Null` when empty).
    pub fn call(
        &self,
        method: &str,
        path_and_query: &str,
        body: Option<&Value>,
        token: Option<&str>,
    ) -> Result<(u16, Value)> {
        let api = |what: String| EmulatorError::Api { endpoint: self.endpoint.clone(), what };
        let curl = crate::tools::require("curl").map_err(api)?;
        let url = format!("{}{path_and_query}", self.endpoint);
        let mut cmd = Command::new(curl);
        cmd.args(["-sS", "--max-time", "20", "--cacert"]).arg(&self.ca).args(["-X", method, "-w", "\n%{http_code}"]);
        if let Some(t) = token {
            cmd.args(["-H", &format!("Authorization: Bearer {t}")]);
        }
        if let Some(b) = body {
            cmd.args(["-H", "Content-Type: application/json", "--data-binary", &b.to_string()]);
        }
        let out = cmd.arg(&url).output().map_err(|e| api(format!("curl {url}: {e}")))?;
        if !out.status.success() {
            return Err(api(format!("curl {method} {url}: {}", String::from_utf8_lossy(&out.stderr).trim())));
        }
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').ok_or_else(|| api(format!("curl {url}: no status in {text:?}")))?;
        let status: u16 = status.trim().parse().map_err(|_| api(format!("curl {url}: status {status:?}")))?;
        let body = if body.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(body).map_err(|e| api(format!("{url}: {e}: {body}")))?
        };
        Ok((status, body))
    }

    /// A control call (`/_emulator/<what>`) that must answer 200.
    pub fn control(&self, method: &str, what: &str, body: Option<&Value>) -> Result<Value> {
        let (status, reply) = self.call(method, &format!("/_emulator/{what}"), body, None)?;
        if status != 200 {
            return Err(EmulatorError::Api {
                endpoint: self.endpoint.clone(),
                what: format!("{method} /_emulator/{what} answered {status}: {reply}"),
            });
        }
        Ok(reply)
    }

    /// Adds resources (README.md, "Seeding"); the IDs made.
    pub fn seed(&self, spec: &Value) -> Result<Value> {
        self.control("POST", "seed", Some(spec))
    }

    /// Changes settings (`asyncDelay`, `staleness`, `pageSize`, `tokens`, ...).
    pub fn configure(&self, settings: &Value) -> Result<()> {
        self.control("PUT", "config", Some(settings)).map(drop)
    }

    /// Arms a fault (README.md, "Faults").
    pub fn fault(&self, spec: &Value) -> Result<()> {
        self.control("POST", "faults", Some(spec)).map(drop)
    }

    /// The request log.
    pub fn requests(&self) -> Result<Vec<Value>> {
        match self.control("GET", "requests", None)? {
            Value::Array(v) => Ok(v),
            other => Err(EmulatorError::Api { endpoint: self.endpoint.clone(), what: format!("request log {other}") }),
        }
    }

    /// Empties the request log.
    pub fn clear_requests(&self) -> Result<()> {
        self.control("DELETE", "requests", None).map(drop)
    }

    /// The Entra ID token requests the emulator answered (README.md,
    /// "Entra ID's token endpoint").
    pub fn token_requests(&self) -> Result<Vec<Value>> {
        match self.control("GET", "tokens", None)? {
            Value::Array(v) => Ok(v),
            other => Err(EmulatorError::Api { endpoint: self.endpoint.clone(), what: format!("token log {other}") }),
        }
    }

    /// Replaces the tags of the resource `id` (a public IP), as an operator would.
    pub fn set_tags(&self, id: &str, tags: &[(&str, &str)]) -> Result<()> {
        let tags: serde_json::Map<String, Value> = tags.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        self.control("PUT", "tags", Some(&json!({"id": id, "tags": tags}))).map(drop)
    }

    /// The routing truth (`{"publicIPAddresses": ..., "privateIPAddresses": ...}`).
    pub fn routing(&self) -> Result<Value> {
        self.control("GET", "routing", None)
    }

    /// Where the routing truth puts a private address: its NIC's ID and its
    /// public address, or `None` when no NIC holds it.
    pub fn private_route(&self, private: IpAddr) -> Result<Option<(String, Option<String>)>> {
        let r = self.routing()?;
        Ok(r["privateIPAddresses"].get(private.to_string()).map(|p| {
            (
                p["networkInterface"].as_str().unwrap_or_default().to_owned(),
                p["publicIPAddress"].as_str().map(str::to_owned),
            )
        }))
    }

    /// Where the routing truth puts a public address: the NIC and private
    /// address it reaches, or `None` when unassociated.
    pub fn public_route(&self, public: IpAddr) -> Result<Option<(String, String)>> {
        let r = self.routing()?;
        let p = &r["publicIPAddresses"][public.to_string()];
        Ok(p["networkInterface"]
            .as_str()
            .map(|nic| (nic.to_owned(), p["privateIPAddress"].as_str().unwrap_or_default().to_owned())))
    }

    // --------------------------------------------------------- seeding ---

    /// The virtual network `vnet` in [`RESOURCE_GROUP`] with subnets
    /// `gateways` ([`SUBNET_CIDR`]) and `other` ([`OTHER_SUBNET_CIDR`]).
    pub fn network(&self) -> Result<Network> {
        let made = self.seed(&json!({"virtualNetworks": [{
            "resourceGroup": RESOURCE_GROUP, "name": "vnet",
            "subnets": [{"name": "gateways", "addressPrefix": SUBNET_CIDR},
                        {"name": "other", "addressPrefix": OTHER_SUBNET_CIDR}]}]}))?;
        Ok(Network {
            subnet_id: id_in(&made, "subnets", "vnet/gateways")?,
            other_subnet_id: id_in(&made, "subnets", "vnet/other")?,
        })
    }

    /// A VM `name` with one NIC `<name>-nic` whose primary IP configuration
    /// is in `subnet` (`gateways` or `other`) at `primary` (the lowest free
    /// address when `None`), with `secondaries` (`(name, address)`) beside it.
    pub fn vm(
        &self,
        name: &str,
        subnet: &str,
        primary: Option<&str>,
        forwarding: bool,
        secondaries: &[(&str, &str)],
    ) -> Result<Vm> {
        let nic_name = format!("{name}-nic");
        let mut configs = vec![json!({"name": "ipconfig1", "subnet": format!("vnet/{subnet}"), "primary": true})];
        if let Some(p) = primary {
            configs[0]["privateIPAddress"] = json!(p);
        }
        for (n, a) in secondaries {
            configs.push(json!({"name": n, "privateIPAddress": a}));
        }
        let made = self.seed(&json!({
            "networkInterfaces": [{"resourceGroup": RESOURCE_GROUP, "name": nic_name, "enableIPForwarding": forwarding,
                                   "ipConfigurations": configs}],
            "virtualMachines": [{"resourceGroup": RESOURCE_GROUP, "name": name, "networkInterfaces": [nic_name]}],
        }))?;
        let vm_id = id_in(&made, "virtualMachines", name)?;
        let nic_id = id_in(&made, "networkInterfaces", &nic_name)?;
        let routing = self.routing()?;
        let primary_ip = routing["privateIPAddresses"]
            .as_object()
            .and_then(|m| {
                m.iter().find(|(_, p)| {
                    p["primary"] == json!(true)
                        && p["networkInterface"].as_str().is_some_and(|n| n.eq_ignore_ascii_case(&nic_id))
                })
            })
            .and_then(|(a, _)| a.parse().ok())
            .ok_or_else(|| EmulatorError::Api {
                endpoint: self.endpoint.clone(),
                what: format!("no primary address of {nic_id}"),
            })?;
        Ok(Vm { provider_id: format!("azure://{vm_id}"), vm_id, nic_id, nic_name, primary_ip })
    }

    /// A public IP address `name` at `ip` with `tags`.
    pub fn public_ip(&self, name: &str, ip: &str, tags: &[(&str, &str)]) -> Result<PublicIp> {
        let tags: serde_json::Map<String, Value> = tags.iter().map(|(k, v)| (k.to_string(), json!(v))).collect();
        let made = self.seed(&json!({"publicIPAddresses": [
            {"resourceGroup": RESOURCE_GROUP, "name": name, "ipAddress": ip, "tags": tags}]}))?;
        Ok(PublicIp {
            id: id_in(&made, "publicIPAddresses", name)?,
            ip: ip.parse().map_err(|_| EmulatorError::Api {
                endpoint: self.endpoint.clone(),
                what: format!("bad address {ip}"),
            })?,
        })
    }

    /// ARM's path for a resource of [`RESOURCE_GROUP`] (`kind/name`).
    pub fn arm_path(kind: &str, name: &str, api: &str) -> String {
        format!(
            "/subscriptions/{SUBSCRIPTION}/resourceGroups/{RESOURCE_GROUP}/providers/{kind}/{name}?api-version={api}"
        )
    }

    /// The ARM calls of the request log that match `method` and whose path
    /// ends with `path_suffix` (without case).
    pub fn calls(&self, method: &str, path_suffix: &str) -> Result<Vec<Value>> {
        let suffix = path_suffix.to_ascii_lowercase();
        Ok(self
            .requests()?
            .into_iter()
            .filter(|r| {
                r["method"] == json!(method)
                    && r["path"].as_str().is_some_and(|p| p.to_ascii_lowercase().ends_with(&suffix))
            })
            .collect())
    }
}

impl Drop for AzureEmulator {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            if let Err(e) = run_script("stop", &state) {
                eprintln!("AzureEmulator drop: {e}");
            }
        }
    }
}

fn id_in(made: &Value, kind: &str, name: &str) -> Result<String> {
    made[kind][name].as_str().map(str::to_owned).ok_or_else(|| EmulatorError::Api {
        endpoint: String::new(),
        what: format!("the seed answer has no {kind} {name}: {made}"),
    })
}

fn run_script(command: &'static str, state: &Path) -> Result<Output> {
    Ok(SERVER.run(command, state, std::iter::empty::<(&str, &str)>())?)
}

/// A temporary directory removed on drop (the test CA's files).
mod tempdir {
    use std::path::{Path, PathBuf};

    #[derive(Debug)]
    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(prefix: &str) -> std::io::Result<Self> {
            static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let p = std::env::temp_dir().join(format!("{prefix}-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&p)?;
            Ok(Self(p))
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
