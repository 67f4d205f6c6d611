//! Debian's `containernetworking-plugins` (the CNI project's reference
//! plugins: `bridge`, `host-local`, `portmap`), run through the CNI protocol
//! the way a container runtime runs them through libcni
//! (`containernetworking/cni`'s `libcni/api.go`, which containerd and CRI-O
//! use):
//!
//! - a network configuration list (a `.conflist`: `name`, `cniVersion`,
//!   `plugins`) is run plugin by plugin: **ADD** in order, each plugin
//!   getting the previous one's result as `prevResult`; **CHECK** in order
//!   and **DEL** in reverse order, each getting the cached result of the
//!   list's ADD as `prevResult` (CNI 0.4.0 and later);
//! - each plugin's stdin is its own object from the list with the list's
//!   `name` and `cniVersion` injected (`buildOneConfig`), and a
//!   `runtimeConfig` holding those of the runtime's capability arguments
//!   (`portMappings`, ...) that the plugin declares in `capabilities`
//!   (`injectRuntimeConfig`);
//! - its environment is the caller's plus `CNI_COMMAND`, `CNI_CONTAINERID`,
//!   `CNI_NETNS`, `CNI_IFNAME`, `CNI_ARGS` (`K=V;K=V`) and `CNI_PATH`;
//!   a failure is a non-zero exit with a CNI error object
//!   (`code`, `msg`, `details`) on stdout;
//! - the plugin binary is found by `type` in `CNI_PATH` (`FindInPath`),
//!   here Debian's [`CNI_PATH`]; the plugins run in the host's (here: the
//!   worker's) network namespace, `CNI_NETNS` names the pod's;
//! - the list's ADD result is cached per (network, container, interface)
//!   under the cache directory (`results/<network>-<container>-<ifname>`,
//!   libcni's layout, in the lab's directory rather than `/var/lib/cni`)
//!   and removed by DEL.
//!
//! [`RuntimeConf::for_pod`] fills in what containerd's CRI plugin passes for
//! a Kubernetes pod sandbox (`K8S_POD_NAMESPACE`, `K8S_POD_NAME`,
//! `K8S_POD_INFRA_CONTAINER_ID`, `IgnoreUnknown=1`; the pod's `hostPort`s as
//! the `portMappings` capability). [`lab_conflist`] is the list the
//! worker-node lab's CNI variant uses: containerd's example
//! `10-containerd-net.conflist` (bridge `cni0` with `isGateway` and
//! `ipMasq`, host-local IPAM over an IPv4 and an IPv6 range, `portmap` with
//! the `portMappings` capability), with `hairpinMode` as kubenet set it
//! instead of its `promiscMode` (the bridge plugin refuses both at once).
//! Every masquerade, hairpin and port-mapping rule in the worker is then the
//! plugins' own.

use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::error::{LabError, Result};
use crate::netns::{self, NetNs};

/// Where Debian's `containernetworking-plugins` installs the plugins (off
/// `PATH`; `tests/tools.txt` lists them by this path).
pub const CNI_PATH: &str = "/usr/lib/cni";
/// The CNI specification version the lab's configuration list declares
/// (the newest the plugins of Debian bookworm, 1.1.1, support).
pub const CNI_VERSION: &str = "1.0.0";
/// The plugin types this module runs (the list's and its IPAM's).
pub const PLUGINS: [&str; 3] = ["bridge", "host-local", "portmap"];
/// How long one plugin run may take (the machine is busy; the plugins take
/// tens of milliseconds).
const PLUGIN_TIMEOUT: Duration = Duration::from_secs(60);

/// A command that runs plugin `kind` (its `type`) inside `host`, as libcni's
/// `FindInPath` finds it in [`CNI_PATH`].
fn plugin_command(host: &NetNs, kind: &str) -> Result<Command> {
    Ok(match kind {
        "bridge" => host.command("/usr/lib/cni/bridge"),
        "host-local" => host.command("/usr/lib/cni/host-local"),
        "portmap" => host.command("/usr/lib/cni/portmap"),
        other => {
            return Err(LabError::Unexpected {
                from: "the CNI configuration list".into(),
                got: format!("plugin type {other:?} (the lab runs only {PLUGINS:?})"),
            })
        }
    })
}

/// Fails with "missing tool ... (package containernetworking-plugins)"
/// unless every plugin of [`PLUGINS`] is installed in [`CNI_PATH`].
pub fn require_plugins() -> Result<()> {
    for kind in PLUGINS {
        let path = Path::new(CNI_PATH).join(kind);
        if !path.is_file() {
            let path = path.to_string_lossy().into_owned();
            return Err(LabError::MissingTool { message: crate::tools::missing(&path), cmd: path });
        }
    }
    Ok(())
}

/// One `hostPort` of a pod, as the `portMappings` capability carries it
/// (containerd's CRI plugin: protocol in lower case, no host IP: both
/// families).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortMapping {
    /// The node's port.
    pub host_port: u16,
    /// The pod's port.
    pub container_port: u16,
    /// `tcp`, `udp` or `sctp`.
    pub protocol: &'static str,
}

impl PortMapping {
    /// A TCP mapping.
    pub fn tcp(host_port: u16, container_port: u16) -> Self {
        Self { host_port, container_port, protocol: "tcp" }
    }

    fn to_json(self) -> Value {
        json!({"hostPort": self.host_port, "containerPort": self.container_port, "protocol": self.protocol})
    }
}

/// What the runtime passes besides the configuration (libcni's
/// `RuntimeConf`).
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeConf {
    /// `CNI_CONTAINERID`: the sandbox (pause) container's ID.
    pub container_id: String,
    /// `CNI_NETNS`: the sandbox's network namespace.
    pub netns: PathBuf,
    /// `CNI_IFNAME`: the interface to make in it.
    pub ifname: String,
    /// `CNI_ARGS`, as `K=V` pairs.
    pub args: Vec<(String, String)>,
    /// The capability arguments (`portMappings`, ...), offered to each
    /// plugin that declares the capability.
    pub capability_args: Map<String, Value>,
}

impl RuntimeConf {
    /// What containerd's CRI plugin passes for pod `namespace/name` whose
    /// sandbox's network namespace is `sandbox`, with the pod's `hostPort`s.
    /// The container ID is new for each call (64 hex digits, as runtimes
    /// make them).
    pub fn for_pod(namespace: &str, name: &str, sandbox: &NetNs, ports: &[PortMapping]) -> Self {
        let id = container_id(&format!("{namespace}/{name}"));
        let args = [
            ("IgnoreUnknown", "1"),
            ("K8S_POD_NAMESPACE", namespace),
            ("K8S_POD_NAME", name),
            ("K8S_POD_INFRA_CONTAINER_ID", id.as_str()),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let mut capability_args = Map::new();
        if !ports.is_empty() {
            capability_args.insert("portMappings".into(), Value::Array(ports.iter().map(|p| p.to_json()).collect()));
        }
        Self {
            container_id: id,
            netns: PathBuf::from(format!("/run/netns/{}", sandbox.name())),
            ifname: "eth0".into(),
            args,
            capability_args,
        }
    }

    fn cni_args(&self) -> String {
        self.args.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";")
    }
}

/// A container ID: 64 hex digits, unique in this process.
fn container_id(seed: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let state = std::collections::hash_map::RandomState::new();
    (0..4u64)
        .map(|i| {
            let mut h = state.build_hasher();
            h.write(seed.as_bytes());
            h.write_u64(n);
            h.write_u64(i);
            h.write_u32(std::process::id());
            format!("{:016x}", h.finish())
        })
        .collect()
}

/// A plugin's (or the list's) result: the CNI `Result` object.
#[derive(Clone, Debug, PartialEq)]
pub struct CniResult(pub Value);

impl CniResult {
    /// The addresses of `ips`, without their prefix lengths.
    pub fn addresses(&self) -> Vec<IpAddr> {
        self.0["ips"]
            .as_array()
            .map(|ips| {
                ips.iter()
                    .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
                    .collect::<Vec<IpAddr>>()
            })
            .unwrap_or_default()
    }

    /// The first IPv4 address.
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        self.addresses().into_iter().find_map(|a| match a {
            IpAddr::V4(a) => Some(a),
            IpAddr::V6(_) => None,
        })
    }

    /// The first IPv6 address.
    pub fn ipv6(&self) -> Option<Ipv6Addr> {
        self.addresses().into_iter().find_map(|a| match a {
            IpAddr::V6(a) => Some(a),
            IpAddr::V4(_) => None,
        })
    }

    /// The names of the interfaces the result lists on the host side (no
    /// `sandbox`): the bridge and the pod's host-side veth.
    pub fn host_interfaces(&self) -> Vec<String> {
        self.0["interfaces"]
            .as_array()
            .map(|v| {
                v.iter()
                    .filter(|i| i.get("sandbox").is_none())
                    .filter_map(|i| i["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// A pod's attachment to a network: what DEL and CHECK need.
#[derive(Clone, Debug, PartialEq)]
pub struct Attachment {
    /// The runtime's arguments of its ADD.
    pub rt: RuntimeConf,
    /// The list's ADD result.
    pub result: CniResult,
    /// How long the list's ADD took (every plugin run).
    pub took: Duration,
}

/// A network configuration list (a `.conflist`), with the directory where
/// its ADD results are cached.
#[derive(Clone, Debug)]
pub struct NetworkList {
    /// `name`.
    pub name: String,
    /// `cniVersion`.
    pub cni_version: String,
    /// `plugins`, as written.
    pub plugins: Vec<Value>,
    /// The list as written.
    pub text: String,
    cache_dir: PathBuf,
}

/// The configuration list of the lab's CNI variant (see the module doc):
/// network `name`, bridge `bridge` whose gateway addresses are the first of
/// `subnet4` and `subnet6`, host-local keeping its allocations in
/// `data_dir`.
pub fn lab_conflist(name: &str, bridge: &str, subnet4: &str, subnet6: &str, data_dir: &Path) -> String {
    let list = json!({
        "cniVersion": CNI_VERSION,
        "name": name,
        "plugins": [
            {
                "type": "bridge",
                "bridge": bridge,
                "isGateway": true,
                "ipMasq": true,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet4}], [{"subnet": subnet6}]],
                    "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
                    "dataDir": data_dir.to_string_lossy()
                }
            },
            {"type": "portmap", "capabilities": {"portMappings": true}}
        ]
    });
    serde_json::to_string_pretty(&list).unwrap_or_default()
}

fn bad(from: &str, got: impl Into<String>) -> LabError {
    LabError::Unexpected { from: from.into(), got: got.into() }
}

impl NetworkList {
    /// Parses a `.conflist`; ADD results are cached under `cache_dir`.
    pub fn parse(text: &str, cache_dir: &Path) -> Result<Self> {
        let v: Value = serde_json::from_str(text).map_err(|e| bad("the CNI configuration list", e.to_string()))?;
        let name = v["name"].as_str().ok_or_else(|| bad("the CNI configuration list", "no name"))?.to_string();
        let cni_version = v["cniVersion"].as_str().unwrap_or("0.1.0").to_string();
        let plugins = v["plugins"].as_array().cloned().unwrap_or_default();
        if plugins.is_empty() || plugins.iter().any(|p| p["type"].as_str().is_none()) {
            return Err(bad("the CNI configuration list", "no plugins, or a plugin without a type"));
        }
        Ok(Self { name, cni_version, plugins, text: text.to_string(), cache_dir: cache_dir.to_path_buf() })
    }

    /// Each plugin's and each IPAM plugin's `VERSION`: all must support the
    /// list's `cniVersion` (libcni's `ValidateNetworkList`, with IPAM too).
    pub fn validate(&self, host: &NetNs) -> Result<()> {
        let mut kinds: Vec<&str> = Vec::new();
        for p in &self.plugins {
            kinds.extend(p["type"].as_str());
            kinds.extend(p["ipam"]["type"].as_str());
        }
        for kind in kinds {
            let out =
                exec(host, kind, "VERSION", None, json!({"cniVersion": self.cni_version}).to_string().as_bytes())?;
            let v: Value = serde_json::from_slice(&out).map_err(|e| bad(kind, e.to_string()))?;
            let ok = v["supportedVersions"].as_array().is_some_and(|s| s.iter().any(|x| x == &*self.cni_version));
            if !ok {
                return Err(bad(kind, format!("does not support CNI {}: {v}", self.cni_version)));
            }
        }
        Ok(())
    }

    /// The stdin of `plugin` (libcni's `buildOneConfig`): its object with
    /// the list's name and version, `prevResult` if any, and the capability
    /// arguments it declares as `runtimeConfig`.
    fn one_config(&self, plugin: &Value, prev: Option<&CniResult>, rt: &RuntimeConf) -> Value {
        let mut conf = plugin.clone();
        conf["name"] = json!(self.name);
        conf["cniVersion"] = json!(self.cni_version);
        if let Some(prev) = prev {
            conf["prevResult"] = prev.0.clone();
        }
        let mut runtime = Map::new();
        if let Some(caps) = plugin["capabilities"].as_object() {
            for (cap, on) in caps {
                if on.as_bool() == Some(true) {
                    if let Some(arg) = rt.capability_args.get(cap) {
                        runtime.insert(cap.clone(), arg.clone());
                    }
                }
            }
        }
        if !runtime.is_empty() {
            conf["runtimeConfig"] = Value::Object(runtime);
        }
        conf
    }

    fn cache_file(&self, rt: &RuntimeConf) -> PathBuf {
        self.cache_dir.join("results").join(format!("{}-{}-{}", self.name, rt.container_id, rt.ifname))
    }

    /// The cached result of the list's ADD for `rt`, if any.
    pub fn cached_result(&self, rt: &RuntimeConf) -> Option<CniResult> {
        let text = std::fs::read(self.cache_file(rt)).ok()?;
        let v: Value = serde_json::from_slice(&text).ok()?;
        Some(CniResult(v.get("result")?.clone()))
    }

    /// ADD: every plugin in order, each with the previous one's result;
    /// the last result is cached and returned.
    pub fn add(&self, host: &NetNs, rt: &RuntimeConf) -> Result<Attachment> {
        let t = Instant::now();
        let mut result: Option<CniResult> = None;
        for plugin in &self.plugins {
            let kind = plugin["type"].as_str().unwrap_or_default();
            let conf = self.one_config(plugin, result.as_ref(), rt);
            let out = exec(host, kind, "ADD", Some(rt), conf.to_string().as_bytes())?;
            let v: Value = serde_json::from_slice(&out)
                .map_err(|e| bad(&format!("CNI ADD {kind}"), format!("{e}: {}", String::from_utf8_lossy(&out))))?;
            if v["cniVersion"].as_str() != Some(&self.cni_version) {
                return Err(bad(&format!("CNI ADD {kind}"), format!("a result of another version: {v}")));
            }
            result = Some(CniResult(v));
        }
        let result = result.ok_or_else(|| bad("CNI ADD", "no plugin ran"))?;
        let file = self.cache_file(rt);
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| LabError::io(format!("create {}", dir.display()), e))?;
        }
        let cached = json!({
            "kind": "cniCacheV1",
            "containerId": rt.container_id,
            "config": self.text,
            "ifName": rt.ifname,
            "networkName": self.name,
            "netns": rt.netns.to_string_lossy(),
            "cniArgs": rt.args.iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
            "capabilityArgs": rt.capability_args,
            "result": result.0,
        });
        std::fs::write(&file, cached.to_string()).map_err(|e| LabError::io(format!("write {}", file.display()), e))?;
        Ok(Attachment { rt: rt.clone(), result, took: t.elapsed() })
    }

    /// CHECK: every plugin in order, each with the cached ADD result.
    pub fn check(&self, host: &NetNs, rt: &RuntimeConf) -> Result<()> {
        let cached = self
            .cached_result(rt)
            .ok_or_else(|| bad("CNI CHECK", format!("no cached result for container {}", rt.container_id)))?;
        for plugin in &self.plugins {
            let kind = plugin["type"].as_str().unwrap_or_default();
            let conf = self.one_config(plugin, Some(&cached), rt);
            exec(host, kind, "CHECK", Some(rt), conf.to_string().as_bytes())?;
        }
        Ok(())
    }

    /// DEL: every plugin in reverse order, each with the cached ADD result
    /// (none if there is none: DEL must then still succeed); the cache
    /// entry is removed. Returns how long it took.
    pub fn del(&self, host: &NetNs, rt: &RuntimeConf) -> Result<Duration> {
        let t = Instant::now();
        let cached = self.cached_result(rt);
        for plugin in self.plugins.iter().rev() {
            let kind = plugin["type"].as_str().unwrap_or_default();
            let conf = self.one_config(plugin, cached.as_ref(), rt);
            exec(host, kind, "DEL", Some(rt), conf.to_string().as_bytes())?;
        }
        let file = self.cache_file(rt);
        if file.exists() {
            std::fs::remove_file(&file).map_err(|e| LabError::io(format!("remove {}", file.display()), e))?;
        }
        Ok(t.elapsed())
    }
}

/// Runs plugin `kind` with `CNI_COMMAND=command` inside `host`, `stdin` on
/// its standard input; its standard output, or the CNI error it reported.
fn exec(host: &NetNs, kind: &str, command: &str, rt: Option<&RuntimeConf>, stdin: &[u8]) -> Result<Vec<u8>> {
    let mut cmd = plugin_command(host, kind)?;
    cmd.env("CNI_COMMAND", command).env("CNI_PATH", CNI_PATH);
    match rt {
        Some(rt) => cmd
            .env("CNI_CONTAINERID", &rt.container_id)
            .env("CNI_NETNS", &rt.netns)
            .env("CNI_IFNAME", &rt.ifname)
            .env("CNI_ARGS", rt.cni_args()),
        // VERSION (libcni's GetVersionInfo): no container.
        None => cmd.env("CNI_CONTAINERID", "").env("CNI_NETNS", "").env("CNI_IFNAME", "").env("CNI_ARGS", ""),
    };
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let what = match rt {
        Some(rt) => format!("CNI {command} {kind} (container {}, netns {})", rt.container_id, rt.netns.display()),
        None => format!("CNI {command} {kind}"),
    };
    let line = netns::describe(&cmd);
    let mut child = cmd.spawn().map_err(|source| LabError::spawn(&cmd, line.clone(), source))?;
    let pid = child.id();
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin).map_err(|e| LabError::io(format!("{what}: write its stdin"), e))?;
    }
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(PLUGIN_TIMEOUT) {
        Ok(out) => out.map_err(|e| LabError::io(format!("{what}: wait"), e))?,
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).stderr(Stdio::null()).status();
            return Err(LabError::Timeout { what, after: PLUGIN_TIMEOUT });
        }
    };
    if out.status.success() {
        return Ok(out.stdout);
    }
    if let Some(message) = crate::tools::explain_netns_exec(&out) {
        return Err(LabError::MissingTool { cmd: line, message });
    }
    // The CNI error object on stdout, and whatever the plugin logged.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let error = match serde_json::from_str::<Value>(&stdout) {
        Ok(e) => {
            format!("code {}: {} {}", e["code"], e["msg"].as_str().unwrap_or(""), e["details"].as_str().unwrap_or(""))
        }
        Err(_) => stdout.trim().to_string(),
    };
    Err(LabError::Command {
        cmd: what,
        status: out.status.to_string(),
        stderr: format!("{}; stderr: {}", error.trim(), String::from_utf8_lossy(&out.stderr).trim()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rt() -> RuntimeConf {
        RuntimeConf {
            container_id: "c0ffee".into(),
            netns: "/run/netns/pod".into(),
            ifname: "eth0".into(),
            args: vec![("IgnoreUnknown".into(), "1".into()), ("K8S_POD_NAME".into(), "p".into())],
            capability_args: Map::from_iter([(
                "portMappings".to_string(),
                json!([PortMapping::tcp(30080, 8080).to_json()]),
            )]),
        }
    }

    #[test]
    fn each_plugin_gets_the_lists_name_version_prev_result_and_only_its_capabilities() {
        let text = lab_conflist("net", "cni0", "198.18.1.0/24", "2001:db8:18:1::/64", Path::new("/tmp/x"));
        let list = NetworkList::parse(&text, Path::new("/tmp/cache")).unwrap();
        assert_eq!((list.name.as_str(), list.cni_version.as_str(), list.plugins.len()), ("net", CNI_VERSION, 2));
        let rt = rt();
        let bridge = list.one_config(&list.plugins[0], None, &rt);
        assert_eq!(bridge["name"], "net");
        assert_eq!(bridge["cniVersion"], CNI_VERSION);
        assert!(bridge.get("prevResult").is_none() && bridge.get("runtimeConfig").is_none(), "{bridge}");
        let prev = CniResult(json!({"cniVersion": CNI_VERSION, "ips": [{"address": "198.18.1.2/24"}]}));
        let portmap = list.one_config(&list.plugins[1], Some(&prev), &rt);
        assert_eq!(portmap["prevResult"], prev.0);
        assert_eq!(portmap["runtimeConfig"]["portMappings"][0]["hostPort"], 30080);
        assert_eq!(portmap["runtimeConfig"]["portMappings"][0]["protocol"], "tcp");
        assert_eq!(rt.cni_args(), "IgnoreUnknown=1;K8S_POD_NAME=p");
        assert_eq!(prev.ipv4(), Some(Ipv4Addr::new(198, 18, 1, 2)));
        assert_eq!(prev.ipv6(), None);
    }

    #[test]
    fn container_ids_are_64_hex_digits_and_unique() {
        let (a, b) = (container_id("x"), container_id("x"));
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
