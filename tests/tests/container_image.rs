//! The gateway's container image, run as Kubernetes would run it
//! (deploy/images/container/README.md).
//!
//! Each runtime test builds the image (`deploy/images/container/build.sh`,
//! cached; with the `egret` binary the other tests use), unpacks it into an
//! OCI runtime bundle (`umoci unpack`), and writes the bundle's
//! `config.json` from the DaemonSet itself (deploy/manifests/30-daemonset.yaml,
//! read here, never copied): its arguments and environment (the cluster's
//! settings from the ConfigMap egret-cluster in 20-configmap.yaml), its
//! capabilities (drop ALL, add the five), `readOnlyRootFilesystem`,
//! `allowPrivilegeEscalation: false` (no_new_privs), `privileged: false`,
//! the memory limit, its volume mounts (the configuration read-only,
//! `/run/egret` writable, the peer channel's Secret read-only: a temporary
//! 48-byte key, mode 0400) and `hostNetwork` (the container joins the lab's
//! gateway namespace, which plays the host's), with the masked and
//! read-only /proc and /sys paths a CRI runtime sets for an unprivileged
//! container. `seccompProfile: RuntimeDefault` becomes the default profile
//! Debian's container stack ships (containers-common's
//! /usr/share/containers/seccomp.json, what CRI-O and podman apply),
//! converted to the OCI form for the granted capabilities by [`seccomp`]
//! (what those runtimes do at container creation). Then Debian's `runc`
//! runs it in the lab (crun 1.8 refuses this machine's hybrid cgroup
//! layout: [`Container::runtime`]), and the lab's traffic crosses it.
//!
//! - [`image_passes_the_labs_traffic_under_the_daemonsets_security_context`]
//!   shows the pods' traffic leaving with the egress IPs, never with a pod's address.
//!   Its seccomp profile is Debian's plus one rule (see [`with_bpf_for_cap_bpf`]).
//! - [`debians_runtime_default_profile_refuses_the_program_load`] shows that Debian
//!   bookworm's profile as shipped allows `bpf()` only with `CAP_SYS_ADMIN`,
//!   so the gateway never becomes ready under it.
//! - [`without_cap_bpf_the_gateway_never_becomes_ready`] runs the same spec with
//!   `BPF` left out of the capabilities (the seccomp profile still allowing
//!   `bpf()`): the kernel refuses the load.
//! - [`without_cap_perfmon_the_verifier_refuses_the_steering_program`]
//!   shows that without `PERFMON` the verifier applies its Spectre v1 sanitation and
//!   refuses the steering program's packet pointer arithmetic. (This test
//!   found that the DaemonSet lacked `PERFMON`.)
//! - [`realtime_workers_in_the_container`] shows that `SYS_NICE` alone gets
//!   the workers no SCHED_FIFO on a cgroup v1 node with real-time group
//!   scheduling (this machine): the container's cgroup has no real-time
//!   budget.
//! - [`the_image_reaches_the_cloud_over_tls_with_its_bundle_and_a_private_ca`]
//!   runs `egret cloud discover` from the image against moto over HTTPS:
//!   the image's CA bundle loads, a private CA is added the documented way,
//!   and IRSA's token is traded at STS over HTTPS.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use egret_tests::capture::{self, Capture};
use egret_tests::client;
use egret_tests::gateway::{self, Admin, GatewayConfig};
use egret_tests::kubelet::expand;
use egret_tests::lab::{Lab, LabOptions};
use egret_tests::netns::{self, NetNs};
use egret_tests::plan::{self, Pod};
use serde_json::{json, Value};

/// Where the configuration and the admin socket are inside the container
/// (the DaemonSet's mounts).
const CONTAINER_CONFIG: &str = "/etc/egret/gateway.yaml";
const CONTAINER_SOCKET: &str = "/run/egret/egret.sock";

/// The prefix of this file's namespaces and container ids.
const PREFIX: &str = "egctr";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

// ---------------------------------------------------------------------------
// The image.

/// The built image: its OCI layout and tag.
#[derive(Debug, Clone)]
struct Image {
    layout: PathBuf,
    tag: String,
}

impl Image {
    /// Builds (or finds cached) the image through the build script, with
    /// `$EGRET_IMAGE_BIN` (tests/run.sh: the binary it put in the images it
    /// built, the tests' debug build or, with `EGRET_RELEASE_IMAGES=1`, the
    /// release build), or else the `egret` binary these tests use.
    fn build() -> Image {
        let bin = match std::env::var_os("EGRET_IMAGE_BIN") {
            Some(b) => PathBuf::from(b),
            None => gateway::egret_binary().unwrap(),
        };
        let script = repo().join("deploy/images/container/build.sh");
        let mut cmd = Command::new(&script);
        cmd.env("EGRET_BIN", &bin);
        let out = netns::run(&mut cmd)
            .unwrap_or_else(|e| panic!("building the image failed ({e}); run {}", script.display()));
        let line = out
            .lines()
            .find_map(|l| l.strip_prefix("OCI layout:"))
            .unwrap_or_else(|| panic!("build.sh printed no layout:\n{out}"));
        // `<path> (egret:<version>)`: the layout's reference name is
        // `egret:<version>`.
        let (path, tag) = line.trim().rsplit_once(" (").unwrap();
        Image { layout: PathBuf::from(path), tag: tag.trim_end_matches(')').to_string() }
    }

    /// The image's configuration (`config` of the OCI image config blob).
    fn config(&self) -> Value {
        let read = |digest: &str| -> Value {
            let hex = digest.strip_prefix("sha256:").unwrap();
            serde_json::from_slice(&std::fs::read(self.layout.join("blobs/sha256").join(hex)).unwrap()).unwrap()
        };
        let index: Value = serde_json::from_slice(&std::fs::read(self.layout.join("index.json")).unwrap()).unwrap();
        let manifest = read(index["manifests"][0]["digest"].as_str().unwrap());
        read(manifest["config"]["digest"].as_str().unwrap())["config"].clone()
    }

    /// `umoci unpack` into `bundle` (which must not exist).
    fn unpack(&self, bundle: &Path) {
        netns::run(
            Command::new("umoci")
                .args(["unpack", "--image"])
                .arg(format!("{}:{}", self.layout.display(), self.tag))
                .arg(bundle),
        )
        .unwrap();
    }
}

// ---------------------------------------------------------------------------
// The DaemonSet.

/// What of the DaemonSet's gateway container the runtime spec is made of.
#[derive(Debug, Clone)]
struct PodSpec {
    args: Vec<String>,
    env: Vec<String>,
    caps_add: Vec<String>,
    caps_drop: Vec<String>,
    privileged: bool,
    allow_privilege_escalation: bool,
    read_only_root: bool,
    host_network: bool,
    seccomp: String,
    memory_limit: Option<u64>,
    /// (mount path, read-only, volume: `configMap` or `hostPath`).
    mounts: Vec<(String, bool, String)>,
}

/// The documents of a YAML file, as Kubernetes' clients read them (YAML
/// 1.1 as sigs.k8s.io/yaml: `yes` is a boolean, `0400` octal), as JSON values.
fn yaml(text: &str) -> Vec<Value> {
    serde_saphyr::from_multiple_with_options(text, serde_saphyr::options! { legacy_octal_numbers: true })
        .unwrap_or_else(|e| panic!("{e}"))
}

fn quantity(q: &str) -> u64 {
    let units = [("Ki", 1u64 << 10), ("Mi", 1 << 20), ("Gi", 1 << 30)];
    for (suffix, mult) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().unwrap() * mult;
        }
    }
    q.parse().unwrap()
}

impl PodSpec {
    /// Reads deploy/manifests/30-daemonset.yaml.
    fn daemonset() -> PodSpec {
        let path = repo().join("deploy/manifests/30-daemonset.yaml");
        let ds = yaml(&std::fs::read_to_string(&path).unwrap()).remove(0);
        // The ConfigMaps its variables may come from (configMapKeyRef).
        let config_maps = yaml(&std::fs::read_to_string(repo().join("deploy/manifests/20-configmap.yaml")).unwrap());
        let config_map_key = |name: &str, key: &str| -> String {
            let cm = config_maps
                .iter()
                .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == name)
                .unwrap_or_else(|| panic!("no ConfigMap {name} in deploy/manifests/20-configmap.yaml"));
            cm["data"][key].as_str().unwrap_or_else(|| panic!("ConfigMap {name} has no key {key}")).to_string()
        };
        let pod = &ds["spec"]["template"]["spec"];
        let containers = pod["containers"].as_array().unwrap();
        let c = containers.iter().find(|c| c["name"].as_str() == Some("gateway")).unwrap();
        let strings = |v: &Value| -> Vec<String> {
            v.as_array().map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect()).unwrap_or_default()
        };
        let sc = &c["securityContext"];
        let flag = |k: &str, default: bool| sc[k].as_bool().unwrap_or(default);
        let volumes = pod["volumes"].as_array().unwrap();
        let mounts = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let name = m["name"].as_str().unwrap();
                let v = volumes.iter().find(|v| v["name"].as_str() == Some(name)).unwrap();
                let kind = ["configMap", "hostPath", "emptyDir", "secret"]
                    .into_iter()
                    .find(|k| !v[*k].is_null())
                    .unwrap_or_else(|| panic!("volume {name}: a kind this test does not know"));
                (
                    m["mountPath"].as_str().unwrap().to_string(),
                    m["readOnly"].as_bool().unwrap_or(false),
                    kind.to_string(),
                )
            })
            .collect();
        // Environment: literal values as they are; the downward API's
        // fields as the kubelet fills them for the lab's gateway (the Node's
        // name, and its address: the gateway namespace's, where the lab
        // probes /ready); a ConfigMap's key (the cluster's settings) as
        // deploy/manifests gives it.
        let env: Vec<(String, String)> = c["env"]
            .as_array()
            .map(|s| {
                s.iter()
                    .map(|e| {
                        let name = e["name"].as_str().unwrap().to_string();
                        let value = match (e["value"].as_str(), e["valueFrom"]["fieldRef"]["fieldPath"].as_str()) {
                            (Some(v), _) => v.to_string(),
                            (None, None) if e["valueFrom"]["configMapKeyRef"].is_object() => {
                                let r = &e["valueFrom"]["configMapKeyRef"];
                                config_map_key(r["name"].as_str().unwrap(), r["key"].as_str().unwrap())
                            }
                            (None, Some("spec.nodeName")) => "lab-gateway".to_string(),
                            // The pod's own name (k8s/uninstall.rs reads its
                            // DaemonSet owner; a Pod not found keeps the node
                            // as it is at a stop).
                            (None, Some("metadata.name")) => "egret-gateway-lab".to_string(),
                            (None, Some("metadata.namespace")) => "egret-system".to_string(),
                            (None, Some("status.hostIP")) => {
                                gateway::METRICS.parse::<SocketAddr>().unwrap().ip().to_string()
                            }
                            (None, other) => panic!("env {name}: a source this test does not know ({other:?})"),
                        };
                        (name, value)
                    })
                    .collect()
            })
            .unwrap_or_default();
        PodSpec {
            args: strings(&c["args"]).iter().map(|a| expand(a, &env)).collect(),
            env: env.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            caps_add: strings(&sc["capabilities"]["add"]),
            caps_drop: strings(&sc["capabilities"]["drop"]),
            privileged: flag("privileged", false),
            // Kubernetes' default is true.
            allow_privilege_escalation: flag("allowPrivilegeEscalation", true),
            read_only_root: flag("readOnlyRootFilesystem", false),
            host_network: pod["hostNetwork"].as_bool().unwrap_or(false),
            seccomp: c["securityContext"]["seccompProfile"]["type"]
                .as_str()
                .or(pod["securityContext"]["seccompProfile"]["type"].as_str())
                .unwrap_or("Unconfined")
                .to_string(),
            memory_limit: c["resources"]["limits"]["memory"].as_str().map(quantity),
            mounts,
        }
    }

    /// The capabilities the container process holds, `CAP_` names: with
    /// `drop: [ALL]` exactly the added ones.
    fn capabilities(&self) -> Vec<String> {
        assert!(
            self.caps_drop.iter().any(|c| c == "ALL"),
            "the DaemonSet does not drop ALL capabilities: this test models only that case"
        );
        let mut caps: Vec<String> = self.caps_add.iter().map(|c| format!("CAP_{c}")).collect();
        caps.sort();
        caps.dedup();
        caps
    }
}

// ---------------------------------------------------------------------------
// Seccomp.

/// Converts a container engine's seccomp profile (the Docker/moby format
/// containers-common also uses: `archMap`, and per rule `includes` and
/// `excludes` of capabilities, architectures and a minimum kernel) into the
/// OCI runtime spec's `linux.seccomp` for a container holding `caps` on
/// `arch` (Go's name: `amd64`) and a kernel of version `kernel`: a rule is
/// kept when every capability it includes is held, its included
/// architectures name `arch`, its minimum kernel is met, no capability it
/// excludes is held and its excluded architectures do not name `arch`.
/// The same semantics as moby's `profiles/seccomp` and containers/common's
/// `pkg/seccomp` setupSeccomp.
mod seccomp {
    use serde_json::{json, Value};

    /// libseccomp's architecture name for Go's `arch`.
    fn scmp_arch(arch: &str) -> &'static str {
        match arch {
            "amd64" => "SCMP_ARCH_X86_64",
            "arm64" => "SCMP_ARCH_AARCH64",
            "s390x" => "SCMP_ARCH_S390X",
            other => panic!("architecture {other}: not mapped"),
        }
    }

    fn list(v: &Value) -> Vec<&str> {
        v.as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default()
    }

    fn kernel_at_least(kernel: (u32, u32), min: &str) -> bool {
        let mut it = min.split('.').map(|p| p.parse::<u32>().unwrap_or(0));
        let want = (it.next().unwrap_or(0), it.next().unwrap_or(0));
        kernel >= want
    }

    /// The conversion (see the module).
    pub fn convert(profile: &Value, caps: &[String], arch: &str, kernel: (u32, u32)) -> Value {
        let held = |c: &str| caps.iter().any(|h| h == c);
        let native = scmp_arch(arch);
        let mut arches = vec![Value::from(native)];
        if let Some(entry) = profile["archMap"].as_array().and_then(|m| m.iter().find(|e| e["architecture"] == native))
        {
            arches.extend(list(&entry["subArchitectures"]).into_iter().map(Value::from));
        }
        let mut syscalls = Vec::new();
        for rule in profile["syscalls"].as_array().into_iter().flatten() {
            let inc = &rule["includes"];
            let exc = &rule["excludes"];
            let inc_arches = list(&inc["arches"]);
            let exc_arches = list(&exc["arches"]);
            let keep = list(&inc["caps"]).into_iter().all(held)
                && (inc_arches.is_empty() || inc_arches.contains(&arch))
                && inc["minKernel"].as_str().is_none_or(|m| kernel_at_least(kernel, m))
                && !list(&exc["caps"]).into_iter().any(held)
                && !exc_arches.contains(&arch);
            if !keep {
                continue;
            }
            let mut out = json!({
                "names": rule["names"],
                "action": rule["action"],
                "args": rule["args"].as_array().cloned().unwrap_or_default(),
            });
            if let Some(e) = rule["errnoRet"].as_u64() {
                out["errnoRet"] = e.into();
            }
            syscalls.push(out);
        }
        let mut s = json!({
            "defaultAction": profile["defaultAction"],
            "architectures": arches,
            "syscalls": syscalls,
        });
        if let Some(e) = profile["defaultErrnoRet"].as_u64() {
            s["defaultErrnoRet"] = e.into();
        }
        s
    }

    /// The action the converted profile `s` takes for `syscall` called with
    /// no argument filter (the last unconditional rule naming it wins, as
    /// libseccomp resolves an allow beside an errno by the rule order the
    /// runtime adds them in; both profiles here never name a syscall twice
    /// without arguments in one conversion).
    pub fn action_for(s: &Value, syscall: &str) -> String {
        let mut action = s["defaultAction"].as_str().unwrap_or("").to_string();
        for r in s["syscalls"].as_array().into_iter().flatten() {
            let unconditional = r["args"].as_array().is_none_or(|a| a.is_empty());
            if unconditional && list(&r["names"]).contains(&syscall) {
                action = r["action"].as_str().unwrap_or("").to_string();
            }
        }
        action
    }
}

/// The profile Debian's container stack applies for `RuntimeDefault`.
const DEBIAN_PROFILE: &str = "/usr/share/containers/seccomp.json";

/// `profile` (containers-common's format) with `bpf()` allowed to a
/// process holding `CAP_BPF` (Linux >= 5.8), as Docker's current default
/// profile has it (moby/moby `profiles/seccomp/default.json`: a rule
/// `bpf` allowed with `includes.caps: [CAP_BPF]`) and Debian bookworm's
/// containers-common 0.50 does not: there, `bpf()` is allowed only with
/// `CAP_SYS_ADMIN` (which the DaemonSet does not grant) and refused with
/// EPERM otherwise. The patch takes `bpf` out of that refusing rule, adds
/// it back refused only when neither capability is held, and adds the
/// allowing rule; nothing else changes.
fn with_bpf_for_cap_bpf(mut profile: Value) -> Value {
    let rules = profile["syscalls"].as_array_mut().unwrap();
    let mut refusals = 0;
    for r in rules.iter_mut() {
        let refuses_without_admin = r["action"] == "SCMP_ACT_ERRNO"
            && r["excludes"]["caps"].as_array().is_some_and(|c| c.iter().any(|c| c == "CAP_SYS_ADMIN"));
        if let Some(names) = r["names"].as_array_mut().filter(|_| refuses_without_admin) {
            let before = names.len();
            names.retain(|n| n != "bpf");
            refusals += before - names.len();
        }
    }
    assert_eq!(
        refusals, 1,
        "the profile's refusal of bpf() without CAP_SYS_ADMIN was not found: the patch no longer fits"
    );
    rules.push(json!({"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1, "args": [],
        "includes": {}, "excludes": {"caps": ["CAP_SYS_ADMIN", "CAP_BPF"]}}));
    rules.push(json!({"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {"caps": ["CAP_BPF"]}, "excludes": {}}));
    profile
}

fn debian_profile() -> Value {
    let text = std::fs::read_to_string(DEBIAN_PROFILE).unwrap_or_else(|e| {
        panic!("{DEBIAN_PROFILE}: {e} (package golang-github-containers-common; deploy/images/container/build.sh installs it)")
    });
    serde_json::from_str(&text).unwrap()
}

fn kernel_version() -> (u32, u32) {
    let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut it = r.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

fn go_arch() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => panic!("{other}: not mapped"),
    }
}

// ---------------------------------------------------------------------------
// The runtime spec and the container.

/// The bundle's `config.json`: the image's entrypoint and environment, the
/// DaemonSet's arguments, environment, security context and mounts, with
/// `process_caps` as the process's capabilities and `seccomp` as its filter.
/// `config_dir` is the ConfigMap's content, `run_dir` the hostPath
/// `/run/egret`, `secret_dir` the Secret `egret-ha`'s (the peer channel's
/// key); `netns` the namespace hostNetwork shares.
#[allow(clippy::too_many_arguments)]
fn runtime_spec(
    image: &Value,
    pod: &PodSpec,
    process_caps: &[String],
    seccomp: Value,
    netns: &Path,
    config_dir: &Path,
    run_dir: &Path,
    secret_dir: &Path,
) -> Value {
    assert!(!pod.privileged, "the DaemonSet's container is privileged: nothing of its security context would hold");
    assert!(
        pod.host_network,
        "the DaemonSet does not use the host network: the lab's gateway namespace would be wrong"
    );
    assert_eq!(pod.seccomp, "RuntimeDefault", "the DaemonSet's seccomp profile");
    let mut args: Vec<Value> = image["Entrypoint"].as_array().cloned().unwrap_or_default();
    // Kubernetes: `args` replaces the image's Cmd, the Entrypoint stays.
    args.extend(pod.args.iter().map(|a| Value::from(a.as_str())));
    let mut env: Vec<Value> = image["Env"].as_array().cloned().unwrap_or_default();
    env.extend(pod.env.iter().map(|e| Value::from(e.as_str())));
    env.push("RUST_LOG=info".into());
    env.push("NO_COLOR=1".into());
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}),
    ];
    for (path, ro, kind) in &pod.mounts {
        let source = match (path.as_str(), kind.as_str()) {
            ("/etc/egret", "configMap") => config_dir,
            ("/run/egret", "hostPath") => run_dir,
            ("/etc/egret-ha", "secret") => secret_dir,
            _ => panic!("DaemonSet mount {path} ({kind}): this test does not know what to mount there"),
        };
        let mut options = vec!["rbind", "nosuid", "nodev"];
        options.push(if *ro { "ro" } else { "rw" });
        mounts.push(json!({"destination": path, "type": "bind", "source": source, "options": options}));
    }
    let mut linux = json!({
        "namespaces": [
            {"type": "pid"},
            {"type": "ipc"},
            {"type": "mount"},
            {"type": "network", "path": netns},
        ],
        // What containerd and CRI-O mask and make read-only in an
        // unprivileged container.
        "maskedPaths": [
            "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
            "/sys/firmware", "/sys/devices/virtual/powercap"
        ],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        "seccomp": seccomp,
    });
    if let Some(limit) = pod.memory_limit {
        linux["resources"] = json!({"memory": {"limit": limit}});
    }
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env,
            "cwd": "/",
            "capabilities": {
                "bounding": process_caps,
                "effective": process_caps,
                "permitted": process_caps,
            },
            "noNewPrivileges": !pod.allow_privilege_escalation,
        },
        "root": {"path": "rootfs", "readonly": pod.read_only_root},
        "mounts": mounts,
        "linux": linux,
    })
}

/// A container run by `runc` (see [`Container::runtime`]; state under its
/// own root directory).
/// Dropping it kills and deletes the container (`runc delete -f`) and waits
/// for `runc run`.
#[derive(Debug)]
struct Container {
    id: String,
    state: PathBuf,
    child: Option<Child>,
    log: PathBuf,
    started: Instant,
}

impl Container {
    /// The OCI runtime: Debian's runc (1.1), the runtime containerd runs
    /// Kubernetes pods with by default. Debian's crun 1.8 refuses this
    /// machine's cgroup layout (v1 controllers with `hugetlb` on the
    /// unified hierarchy: "cgroups in hybrid mode not supported, drop all
    /// controllers from cgroupv2"), and without cgroups the DaemonSet's
    /// memory limit would not be applied.
    fn runtime(&self) -> Command {
        let mut c = Command::new("runc");
        c.arg("--root").arg(&self.state);
        c
    }

    /// `runc run --bundle <bundle> <id>`, its output into `log`.
    fn run(bundle: &Path, state: &Path, id: &str, log: &Path) -> Container {
        let out = std::fs::File::create(log).unwrap();
        let err = out.try_clone().unwrap();
        let mut c = Container {
            id: id.to_string(),
            state: state.to_path_buf(),
            child: None,
            log: log.to_path_buf(),
            started: Instant::now(),
        };
        let mut cmd = c.runtime();
        cmd.args(["run", "--bundle"]).arg(bundle).arg(id).stdin(Stdio::null()).stdout(out).stderr(err);
        let line = netns::describe(&cmd);
        c.child = Some(cmd.spawn().unwrap_or_else(|e| panic!("{line}: {e}")));
        c
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `/ready` answers 200 in `ns`: `Ok(time since start)`, or
    /// `Err(why not)` once the container exited or `timeout` passed.
    fn wait_ready(&mut self, ns: &NetNs, timeout: Duration) -> Result<Duration, String> {
        let metrics: SocketAddr = gateway::METRICS.parse().unwrap();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(st) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                return Err(format!("the container exited ({st}) before ready"));
            }
            if gateway::http_status(ns, metrics, "/ready").ok() == Some(200) {
                return Ok(self.started.elapsed());
            }
            if Instant::now() > deadline {
                return Err(format!("not ready after {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn delete(&mut self) {
        let _ = self.runtime().args(["kill", &self.id, "KILL"]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        let _ = self.runtime().args(["delete", "-f", &self.id]).stdout(Stdio::null()).stderr(Stdio::null()).status();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Container {
    fn drop(&mut self) {
        self.delete();
        if std::thread::panicking() {
            eprintln!("---- container log ({}) ----\n{}\n----", self.log.display(), self.log_text());
        }
    }
}

/// How a test wants the container: which capabilities the process holds
/// (the DaemonSet's, or fewer), and the seccomp profile.
#[derive(Default)]
struct Setup {
    drop_caps: Vec<&'static str>,
    /// Debian's profile patched by [`with_bpf_for_cap_bpf`].
    with_bpf_rule: bool,
    /// `workers.realtimePriority` (the lab's configuration says 0).
    realtime_priority: Option<u32>,
    /// A real-time budget for the container's cgroup
    /// (`linux.resources.cpu.realtimeRuntime`, µs per second), which no
    /// Kubernetes field sets.
    rt_runtime: Option<i64>,
}

/// A lab with the gateway image running in its gateway namespace. Fields
/// drop in order: the container first, then the capture, then the lab.
struct Run {
    container: Container,
    capture: Option<Capture>,
    admin: Admin,
    config: GatewayConfig,
    lab: Lab,
}

static N: AtomicU32 = AtomicU32::new(0);

/// Removes what a killed earlier run left (its guards never ran): for each
/// `egctr<pid>x<n>` lab whose process is gone, its container (`runc
/// delete -f`), its namespaces (their processes ended first) and its
/// directory.
fn remove_stale_runs() {
    let mut prefixes = BTreeSet::new();
    for name in netns::list() {
        let Some((lab, _role)) = name.split_once('-') else { continue };
        let Some((pid, _)) = lab.strip_prefix(PREFIX).and_then(|r| r.split_once('x')) else { continue };
        if !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()) && !Path::new(&format!("/proc/{pid}")).exists() {
            prefixes.insert(lab.to_string());
        }
    }
    for lab in prefixes {
        let dir = std::env::temp_dir().join(format!("egret-lab-{lab}"));
        let _ = Command::new("runc")
            .arg("--root")
            .arg(dir.join("runc"))
            .args(["delete", "-f", &format!("{lab}-gateway")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        NetNs::delete_all_with_prefix(&format!("{lab}-"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Builds a lab (namespaces `egctr<pid>x<n>-*`), the image, the bundle, and
/// starts the container.
fn start(setup: &Setup) -> Run {
    remove_stale_runs();
    let n = N.fetch_add(1, Ordering::Relaxed);
    let prefix = format!("{PREFIX}{}x{n}", std::process::id());
    let lab = Lab::build(LabOptions { prefix: prefix.clone(), ..LabOptions::for_test() }).unwrap();
    let image = Image::build();
    let pod = PodSpec::daemonset();

    let dir = lab.dir().to_path_buf();
    let (config_dir, run_dir, secret_dir, bundle, state) =
        (dir.join("config"), dir.join("run"), dir.join("ha-key"), dir.join("bundle"), dir.join("runc"));
    for d in [&config_dir, &run_dir, &secret_dir, &state] {
        std::fs::create_dir_all(d).unwrap();
    }
    write_ha_key(&secret_dir);
    let config = GatewayConfig::lab_default(&lab);
    let metrics: SocketAddr = gateway::METRICS.parse().unwrap();
    let mut yaml = config.yaml(Path::new(CONTAINER_SOCKET), metrics);
    if let Some(p) = setup.realtime_priority {
        assert!(yaml.contains("realtimePriority: 0\n"), "the lab's configuration changed:\n{yaml}");
        yaml = yaml.replace("realtimePriority: 0\n", &format!("realtimePriority: {p}\n"));
    }
    std::fs::write(config_dir.join("gateway.yaml"), yaml).unwrap();
    assert!(
        pod.args.windows(2).any(|w| w[0] == "--config" && w[1] == CONTAINER_CONFIG)
            || pod.args.iter().any(|a| a.strip_prefix("--config=") == Some(CONTAINER_CONFIG)),
        "the DaemonSet's arguments {:?} do not read {CONTAINER_CONFIG}",
        pod.args
    );

    image.unpack(&bundle);
    let caps = pod.capabilities();
    let mut profile = debian_profile();
    if setup.with_bpf_rule {
        profile = with_bpf_for_cap_bpf(profile);
    }
    // The profile is made for the DaemonSet's capabilities (what the
    // runtime sees); the process may be given fewer.
    let filter = seccomp::convert(&profile, &caps, go_arch(), kernel_version());
    let process_caps: Vec<String> =
        caps.iter().filter(|c| !setup.drop_caps.iter().any(|d| c.as_str() == format!("CAP_{d}"))).cloned().collect();
    let netns_path = Path::new("/run/netns").join(lab.gateway_ns().name());
    let mut spec =
        runtime_spec(&image.config(), &pod, &process_caps, filter, &netns_path, &config_dir, &run_dir, &secret_dir);
    if let Some(us) = setup.rt_runtime {
        spec["linux"]["resources"]["cpu"] = json!({"realtimeRuntime": us, "realtimePeriod": 1_000_000});
    }
    std::fs::write(bundle.join("config.json"), serde_json::to_vec_pretty(&spec).unwrap()).unwrap();

    let capture = Capture::start(lab.upstream(), "gw").unwrap();
    let container = Container::run(&bundle, &state, &format!("{prefix}-gateway"), &dir.join("container.log"));
    let admin = Admin { bin: gateway::egret_binary().unwrap(), socket: run_dir.join("egret.sock") };
    Run { container, capture: Some(capture), admin, config, lab }
}

/// The Secret `egret-ha` as the kubelet writes it (`defaultMode: 0400`):
/// the file `key`, 48 random bytes.
fn write_ha_key(dir: &Path) {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let mut key = [0u8; 48];
    std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut key)).unwrap();
    let path = dir.join("key");
    std::fs::write(&path, key).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
}

fn root_or_skip(name: &str) -> bool {
    egret_tests::lab_available(name)
}

#[test]
fn image_passes_the_labs_traffic_under_the_daemonsets_security_context() {
    if !root_or_skip("image_passes_the_labs_traffic_under_the_daemonsets_security_context") {
        return;
    }
    let mut r = start(&Setup { with_bpf_rule: true, ..Setup::default() });
    let took = r
        .container
        .wait_ready(r.lab.gateway_ns(), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}; log:\n{}", r.container.log_text()));
    eprintln!("container ready {took:?} after `runc run`");

    // The process really runs confined as the spec says: the container's
    // init (pid 1 in its pid namespace) is egret, with exactly the
    // DaemonSet's capabilities and no_new_privs.
    let state = netns::run(r.container.runtime().args(["state", &r.container.id])).unwrap();
    let state: Value = serde_json::from_str(&state).unwrap();
    let pid = state["pid"].as_u64().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).map(str::trim).unwrap().to_string();
    let caps = PodSpec::daemonset().capabilities();
    let want_mask: u64 = caps.iter().map(|c| 1u64 << cap_number(c)).sum();
    assert_eq!(u64::from_str_radix(&field("CapEff:"), 16).unwrap(), want_mask, "effective capabilities {caps:?}");
    assert_eq!(u64::from_str_radix(&field("CapBnd:"), 16).unwrap(), want_mask, "bounding set");
    assert_eq!(field("NoNewPrivs:"), "1");
    assert_eq!(field("Seccomp:"), "2", "a seccomp filter is in force");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert!(exe.ends_with("usr/bin/egret"), "pid {pid} is {}", exe.display());

    // Traffic, as tests/tests/e2e/traffic.rs checks it.
    for pod in [Pod::A, Pod::B, Pod::C, Pod::U] {
        let ns = r.lab.pod(pod);
        let want = Lab::expected_source(pod, pod.server());
        let udp = client::udp_echo(ns, pod.echo_endpoint(), &format!("ctr-udp-{}", pod.name())).unwrap();
        assert_eq!(udp.seen.ip(), want, "{pod:?}: UDP source at the server");
        let http = client::http(ns, pod.http_endpoint(), &format!("/{}", pod.name()), 0).unwrap();
        assert_eq!(http.seen.ip(), want, "{pod:?}: TCP source at the server");
        assert_eq!(http.rest, format!("GET /{} received=0", pod.name()));
    }
    let token = "ctr-icmp-a";
    client::ping(r.lab.pod(Pod::A), Pod::A.server(), token, Duration::from_secs(3)).unwrap();
    let seen = r.lab.server().unwrap().wait_icmp(token, Duration::from_secs(2)).unwrap();
    assert_eq!(seen.src.ip(), std::net::IpAddr::from(plan::E1), "ICMP source at the server");

    // The admin socket through the hostPath mount: the sessions are there.
    let sessions = r.admin.sessions().unwrap();
    for needle in [plan::POD_A.to_string(), plan::E1.to_string(), plan::POD_C.to_string(), plan::E2.to_string()] {
        assert!(sessions.contains(&needle), "`egret sessions` mentions {needle}:\n{sessions}");
    }
    // The fail-closed table (nft inside the image) is in the namespace.
    let tables = r.lab.gateway_ns().exec(&["nft", "list", "tables"]).unwrap();
    assert!(tables.contains("egret_failclosed"), "nft list tables:\n{tables}");

    // Nothing left with a selected pod's address.
    let frames = r.capture.take().unwrap().stop().unwrap();
    let cfg = r.config.clone();
    let leaks = capture::leaks(&frames, r.lab.gateway_outside_mac(), |s, d| cfg.selects(s, d));
    assert!(leaks.is_empty(), "frames left with a pod's address: {:?}", &leaks[..leaks.len().min(5)]);
    eprintln!("{} frames on the outside link, none with a pod's address", frames.len());
}

/// The capability's number (capability.h).
fn cap_number(c: &str) -> u32 {
    match c {
        "CAP_NET_RAW" => 13,
        "CAP_NET_ADMIN" => 12,
        "CAP_IPC_LOCK" => 14,
        "CAP_SYS_ADMIN" => 21,
        "CAP_SYS_NICE" => 23,
        "CAP_BPF" => 39,
        "CAP_PERFMON" => 38,
        other => panic!("{other}: add it to cap_number"),
    }
}

/// Runs the container with `setup` and requires that it never becomes
/// ready; returns its log.
fn never_ready(name: &str, setup: &Setup) -> String {
    let mut r = start(setup);
    let res = r.container.wait_ready(r.lab.gateway_ns(), Duration::from_secs(20));
    let log = r.container.log_text();
    assert!(res.is_err(), "{name}: the gateway became ready; log:\n{log}");
    eprintln!("{name}: {}", res.unwrap_err());
    log
}

#[test]
fn debians_runtime_default_profile_refuses_the_program_load() {
    if !root_or_skip("debians_runtime_default_profile_refuses_the_program_load") {
        return;
    }
    // (The build script installs the profile's package: run first.)
    let log = never_ready("debian profile", &Setup::default());
    assert!(log.contains("Operation not permitted"), "the log names the refusal:\n{log}");

    // The converted profile itself: bpf() is refused for the DaemonSet's
    // capabilities, allowed with CAP_SYS_ADMIN.
    let caps = PodSpec::daemonset().capabilities();
    let profile = debian_profile();
    let s = seccomp::convert(&profile, &caps, go_arch(), kernel_version());
    assert_eq!(seccomp::action_for(&s, "bpf"), "SCMP_ACT_ERRNO", "{DEBIAN_PROFILE} for {caps:?}");
    let mut admin = caps.clone();
    admin.push("CAP_SYS_ADMIN".into());
    assert_eq!(
        seccomp::action_for(&seccomp::convert(&profile, &admin, go_arch(), kernel_version()), "bpf"),
        "SCMP_ACT_ALLOW"
    );
    // And the patched profile the passing test uses: allowed with CAP_BPF,
    // refused without it.
    let patched = with_bpf_for_cap_bpf(profile.clone());
    assert_eq!(
        seccomp::action_for(&seccomp::convert(&patched, &caps, go_arch(), kernel_version()), "bpf"),
        "SCMP_ACT_ALLOW"
    );
    let no_bpf: Vec<String> = caps.iter().filter(|c| *c != "CAP_BPF").cloned().collect();
    assert_eq!(
        seccomp::action_for(&seccomp::convert(&patched, &no_bpf, go_arch(), kernel_version()), "bpf"),
        "SCMP_ACT_ERRNO"
    );
}

#[test]
fn without_cap_bpf_the_gateway_never_becomes_ready() {
    if !root_or_skip("without_cap_bpf_the_gateway_never_becomes_ready") {
        return;
    }
    let log =
        never_ready("without CAP_BPF", &Setup { drop_caps: vec!["BPF"], with_bpf_rule: true, ..Setup::default() });
    assert!(log.contains("Operation not permitted"), "the log names the refusal:\n{log}");
}

#[test]
fn without_cap_perfmon_the_verifier_refuses_the_steering_program() {
    if !root_or_skip("without_cap_perfmon_the_verifier_refuses_the_steering_program") {
        return;
    }
    let log = never_ready(
        "without CAP_PERFMON",
        &Setup { drop_caps: vec!["PERFMON"], with_bpf_rule: true, ..Setup::default() },
    );
    assert!(log.contains("prohibited for !root"), "the verifier's refusal:\n{log}");
}

/// The scheduling policy of each thread of `pid`, by thread name
/// (`/proc/<pid>/task/<tid>/stat` field 41: 0 normal, 1 SCHED_FIFO).
fn thread_policies(pid: u64) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let t = t.unwrap().path();
        let (Ok(stat), Ok(comm)) = (std::fs::read_to_string(t.join("stat")), std::fs::read_to_string(t.join("comm")))
        else {
            continue;
        };
        let after: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        // Fields from the state (3rd) on: policy is the 41st field.
        out.push((comm.trim().to_string(), after[38].parse().unwrap()));
    }
    out
}

/// The DaemonSet grants `SYS_NICE` for SCHED_FIFO workers
/// (`workers.realtimePriority`). On a cgroup v1 node whose kernel has
/// real-time group scheduling (`cpu.rt_runtime_us` exists, as here), a
/// container's cpu cgroup gets no real-time budget, so SCHED_FIFO is
/// refused despite the capability and the workers run at normal priority
/// (the daemon warns and goes on); given a budget, which only the runtime
/// can give (no Kubernetes field sets it), they run SCHED_FIFO. Without
/// real-time group scheduling the capability alone must do.
#[test]
fn realtime_workers_in_the_container() {
    if !root_or_skip("realtime_workers_in_the_container") {
        return;
    }
    let fifo_workers = |r: &mut Run| -> (bool, String) {
        r.container.wait_ready(r.lab.gateway_ns(), Duration::from_secs(30)).unwrap();
        let st: Value =
            serde_json::from_str(&netns::run(r.container.runtime().args(["state", &r.container.id])).unwrap()).unwrap();
        let threads = thread_policies(st["pid"].as_u64().unwrap());
        let workers: Vec<&(String, u32)> = threads.iter().filter(|(n, _)| n.starts_with("egret-worker")).collect();
        assert!(!workers.is_empty(), "no worker thread among {threads:?}");
        (workers.iter().all(|(_, p)| *p == 1), r.container.log_text())
    };
    let rt_groups = Path::new("/sys/fs/cgroup/cpu/cpu.rt_runtime_us").exists();
    let mut r = start(&Setup { with_bpf_rule: true, realtime_priority: Some(50), ..Setup::default() });
    let (fifo, log) = fifo_workers(&mut r);
    drop(r);
    if rt_groups {
        assert!(!fifo, "SCHED_FIFO granted without a real-time budget; log:\n{log}");
        assert!(log.contains("SCHED_FIFO refused"), "the daemon says so:\n{log}");
        let mut r = start(&Setup {
            with_bpf_rule: true,
            realtime_priority: Some(50),
            rt_runtime: Some(100_000),
            ..Setup::default()
        });
        let (fifo, log) = fifo_workers(&mut r);
        assert!(fifo, "with a 100 ms/s real-time budget the workers run SCHED_FIFO; log:\n{log}");
    } else {
        assert!(fifo, "the workers run SCHED_FIFO with CAP_SYS_NICE; log:\n{log}");
    }
}

// ---------------------------------------------------------------------------
// The converter's semantics, on a small profile (no root needed).

#[test]
fn seccomp_conversion_keeps_the_rules_the_capabilities_and_architecture_select() {
    let profile = json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": 38,
        "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86", "SCMP_ARCH_X32"]}],
        "syscalls": [
            {"names": ["read"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {}, "excludes": {}},
            {"names": ["bpf"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {"caps": ["CAP_SYS_ADMIN"]}, "excludes": {}},
            {"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1, "args": [], "includes": {}, "excludes": {"caps": ["CAP_SYS_ADMIN"]}},
            {"names": ["arch_prctl"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {"arches": ["amd64"]}, "excludes": {}},
            {"names": ["set_tls"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {"arches": ["arm64"]}, "excludes": {}},
            {"names": ["io_uring_setup"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {"minKernel": "5.1"}, "excludes": {}},
            {"names": ["both"], "action": "SCMP_ACT_ALLOW", "args": [], "includes": {"caps": ["CAP_BPF", "CAP_NET_ADMIN"]}, "excludes": {}},
        ],
    });
    let caps = |c: &[&str]| c.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let names = |s: &Value| -> BTreeSet<String> {
        s["syscalls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| format!("{}:{}", r["names"][0].as_str().unwrap(), r["action"].as_str().unwrap()))
            .collect()
    };
    let plain = seccomp::convert(&profile, &caps(&["CAP_BPF"]), "amd64", (6, 1));
    assert_eq!(plain["architectures"], json!(["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]));
    assert_eq!(plain["defaultErrnoRet"], 38);
    assert_eq!(
        names(&plain),
        ["read:SCMP_ACT_ALLOW", "bpf:SCMP_ACT_ERRNO", "arch_prctl:SCMP_ACT_ALLOW", "io_uring_setup:SCMP_ACT_ALLOW"]
            .into_iter()
            .map(String::from)
            .collect()
    );
    assert_eq!(seccomp::action_for(&plain, "bpf"), "SCMP_ACT_ERRNO");
    let admin = seccomp::convert(&profile, &caps(&["CAP_SYS_ADMIN", "CAP_BPF", "CAP_NET_ADMIN"]), "amd64", (5, 0));
    assert_eq!(seccomp::action_for(&admin, "bpf"), "SCMP_ACT_ALLOW");
    assert_eq!(seccomp::action_for(&admin, "both"), "SCMP_ACT_ALLOW", "every included capability held");
    assert_eq!(seccomp::action_for(&admin, "io_uring_setup"), "SCMP_ACT_ERRNO", "kernel 5.0 < minKernel 5.1");
    assert_eq!(seccomp::action_for(&admin, "set_tls"), "SCMP_ACT_ERRNO", "another architecture's rule");
}

#[test]
fn the_daemonset_is_read_as_written() {
    let pod = PodSpec::daemonset();
    assert_eq!(
        pod.capabilities(),
        ["CAP_BPF", "CAP_IPC_LOCK", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_PERFMON", "CAP_SYS_NICE"]
    );
    assert!(pod.read_only_root && !pod.allow_privilege_escalation && !pod.privileged && pod.host_network);
    assert_eq!(pod.seccomp, "RuntimeDefault");
    assert_eq!(pod.memory_limit, Some(1 << 30));
    assert_eq!(
        pod.mounts,
        [
            ("/etc/egret".to_string(), true, "configMap".to_string()),
            ("/run/egret".to_string(), false, "hostPath".to_string()),
            ("/etc/egret-ha".to_string(), true, "secret".to_string())
        ]
    );
    let spec = runtime_spec(
        &json!({"Entrypoint": ["/usr/bin/egret"], "Env": ["PATH=/usr/bin"]}),
        &pod,
        &pod.capabilities(),
        json!({}),
        Path::new("/run/netns/x"),
        Path::new("/c"),
        Path::new("/r"),
        Path::new("/s"),
    );
    // `$(HOST_IP)` expanded as the kubelet does, to the lab's address.
    // The cluster's settings from the ConfigMap egret-cluster.
    assert_eq!(
        spec["process"]["args"],
        json!([
            "/usr/bin/egret",
            "gateway",
            format!("--config={CONTAINER_CONFIG}"),
            "--cluster-pod-cidr=10.244.0.0/16",
            "--gateway-selector=egret.dev/gateway=true",
            "--nat-ports=32768-60999",
            "--tunnel-port=6082",
            format!("--metrics-listen={}", gateway::METRICS)
        ])
    );
    assert_eq!(spec["process"]["noNewPrivileges"], true);
    assert_eq!(spec["root"]["readonly"], true);
    // The peer channel's key: the Secret's directory, read-only.
    let key = spec["mounts"].as_array().unwrap().iter().find(|m| m["destination"] == "/etc/egret-ha").unwrap();
    assert_eq!(key["source"], "/s");
    assert!(key["options"].as_array().unwrap().contains(&json!("ro")), "{key}");
    assert!(!spec["process"]["capabilities"]["effective"].as_array().unwrap().contains(&json!("CAP_SYS_ADMIN")));
}

/// Readiness of the gateway in the container against the bare binary, in
/// interleaved rounds on one lab (docs/benchmarks.md, "Container image"):
/// `cargo test -p egret-tests --test container_image --locked --
/// --ignored --nocapture readiness_container_vs_bare`. Prints the figures;
/// asserts nothing about them.
#[test]
#[ignore = "benchmark: run by hand"]
fn readiness_container_vs_bare() {
    if !root_or_skip("readiness_container_vs_bare") {
        return;
    }
    let rounds: usize = std::env::var("EGRET_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let mut r = start(&Setup { with_bpf_rule: true, ..Setup::default() });
    r.container.wait_ready(r.lab.gateway_ns(), Duration::from_secs(30)).unwrap();
    r.container.delete();
    let bundle = r.lab.dir().join("bundle");
    let state = r.lab.dir().join("runc");
    let (mut ctr, mut bare) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let mut c = Container::run(&bundle, &state, &format!("{}-r{i}", r.container.id), &r.lab.dir().join("r.log"));
        ctr.push(c.wait_ready(r.lab.gateway_ns(), Duration::from_secs(30)).unwrap());
        c.delete();
        let t = Instant::now();
        let mut g = gateway::Gateway::spawn(&r.lab, &r.config).unwrap();
        g.wait_ready(Duration::from_secs(30)).unwrap();
        bare.push(t.elapsed());
        g.terminate().unwrap();
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    eprintln!("container (runc run -> /ready): {ctr:?}");
    eprintln!("bare (ip netns exec egret -> /ready): {bare:?}");
    eprintln!("medians: container {:?}, bare {:?}", median(&mut ctr), median(&mut bare));
}

// ---------------------------------------------------------------------------
// The cloud path from the image (issue 29 §2).

/// Where the documented private CA is mounted (docs/kubernetes.md, "A
/// private CA"; the chart's `extraCA.configMap`).
const PRIVATE_CA_DIR: &str = "/etc/egret-ca";
/// Where EKS mounts a service account's projected token for IRSA.
const IRSA_TOKEN_DIR: &str = "/var/run/secrets/eks.amazonaws.com/serviceaccount";

/// Runs `egret <args>` in the image as the DaemonSet's container (its
/// capabilities, seccomp, read-only root, memory limit) in this host's
/// network namespace (moto listens on its loopback), with `env` added and
/// `mounts` (host directory, container path) read-only; waits for it to
/// exit: (success, what it printed).
fn run_in_image(
    dir: &Path,
    name: &str,
    args: &[&str],
    env: &[(&str, String)],
    mounts: &[(&Path, &str)],
) -> (bool, String) {
    let image = Image::build();
    let pod = PodSpec::daemonset();
    let bundle = dir.join(format!("bundle-{name}"));
    let state = dir.join("runc");
    let (config_dir, run_dir, secret_dir) = (dir.join("config"), dir.join("run"), dir.join("ha-key"));
    for d in [&state, &config_dir, &run_dir, &secret_dir] {
        std::fs::create_dir_all(d).unwrap();
    }
    image.unpack(&bundle);
    let caps = pod.capabilities();
    let filter = seccomp::convert(&debian_profile(), &caps, go_arch(), kernel_version());
    let mut spec =
        runtime_spec(&image.config(), &pod, &caps, filter, Path::new("/unused"), &config_dir, &run_dir, &secret_dir);
    // The host's network namespace (hostNetwork on a node whose loopback
    // has the cloud API's emulator).
    spec["linux"]["namespaces"].as_array_mut().unwrap().retain(|n| n["type"] != "network");
    let entrypoint = image.config()["Entrypoint"].as_array().cloned().unwrap();
    spec["process"]["args"] =
        Value::from(entrypoint.into_iter().chain(args.iter().map(|a| Value::from(*a))).collect::<Vec<_>>());
    let envs = spec["process"]["env"].as_array_mut().unwrap();
    envs.retain(|e| !e.as_str().unwrap().starts_with("RUST_LOG="));
    envs.push("RUST_LOG=warn".into());
    envs.extend(env.iter().map(|(k, v)| Value::from(format!("{k}={v}"))));
    for (source, dest) in mounts {
        spec["mounts"].as_array_mut().unwrap().push(
            json!({"destination": dest, "type": "bind", "source": source, "options": ["rbind", "nosuid", "nodev", "ro"]}),
        );
    }
    std::fs::write(bundle.join("config.json"), serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    let id = format!("{PREFIX}{}-{name}", std::process::id());
    let mut c = Container::run(&bundle, &state, &id, &dir.join(format!("{name}.log")));
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(st) = c.child.as_mut().unwrap().try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "`egret {}` in the image did not exit in 60 s:\n{}",
            args.join(" "),
            c.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = c.log_text();
    drop(c);
    let _ = std::fs::remove_dir_all(&bundle);
    (status.success(), out)
}

/// The image carries Debian's CA bundle and the SDK loads it; a private CA
/// added the documented way (`SSL_CERT_DIR` with the mounted CA, keeping
/// `SSL_CERT_FILE` on the image's bundle) lets `egret cloud discover` reach
/// EC2 over HTTPS, with credentials from IRSA (a web identity token traded
/// at STS, over HTTPS too), from the image users run.
#[test]
fn the_image_reaches_the_cloud_over_tls_with_its_bundle_and_a_private_ca() {
    const NAME: &str = "the_image_reaches_the_cloud_over_tls_with_its_bundle_and_a_private_ca";
    use egret_tests::moto::{self, Moto, TestCa};
    if !root_or_skip(NAME) {
        return;
    }
    match Moto::available_or_skip(NAME) {
        Ok(true) => {}
        Ok(false) => return,
        Err(e) => panic!("{e}"),
    }
    let dir = std::env::temp_dir().join(format!("egret-{PREFIX}{}-tls", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ca = TestCa::create(&dir.join("tls")).unwrap();
    let server = Moto::start_tls(ca.dir()).unwrap();
    assert!(server.endpoint().starts_with("https://"), "{}", server.endpoint());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let ec2 = moto::client_for_tls(server.endpoint(), &ca.ca_pem().unwrap()).unwrap();
    let (network, eip) = rt.block_on(async {
        let network = moto::create_network(&ec2).await.unwrap();
        let eip = moto::allocate_eip(&ec2, &[("egret.dev/pool", "tls")]).await.unwrap();
        (network, eip)
    });

    // The bundle is Debian's (well over a hundred roots).
    let image = Image::build();
    let rootfs = dir.join("inspect");
    image.unpack(&rootfs);
    let bundle = std::fs::read_to_string(rootfs.join("rootfs/etc/ssl/certs/ca-certificates.crt")).unwrap();
    let roots = bundle.matches("-----BEGIN CERTIFICATE-----").count();
    assert!(roots > 100, "the image's CA bundle has {roots} certificates");
    let _ = std::fs::remove_dir_all(&rootfs);

    let private_ca = dir.join("private-ca");
    std::fs::create_dir_all(&private_ca).unwrap();
    std::fs::write(private_ca.join("egret-test-ca.pem"), ca.ca_pem().unwrap()).unwrap();
    let token = dir.join("irsa");
    std::fs::create_dir_all(&token).unwrap();
    std::fs::write(token.join("token"), "eyJhbGciOiJSUzI1NiJ9.e30.c2ln").unwrap();

    let args = ["cloud", "discover", "--subnet", network.subnet_id.as_str(), "--tag", "egret.dev/pool=tls"];
    let static_creds = || -> Vec<(&str, String)> {
        vec![
            ("AWS_ENDPOINT_URL_EC2", server.endpoint().to_owned()),
            ("AWS_REGION", moto::REGION.to_owned()),
            ("AWS_ACCESS_KEY_ID", "testing".to_owned()),
            ("AWS_SECRET_ACCESS_KEY", "testing".to_owned()),
        ]
    };
    const NO_ROOTS: &str = "no native root CA certificates found";

    // 1. The image's own roots: loaded (no warning), and the test CA is
    //    not among them, so the handshake is refused by name.
    let (ok, out) = run_in_image(&dir, "roots", &args, &static_creds(), &[]);
    assert!(!ok, "the test CA is trusted without being added:\n{out}");
    assert!(out.contains("UnknownIssuer"), "the refusal names the unknown issuer:\n{out}");
    assert!(!out.contains(NO_ROOTS), "the SDK found no root certificates in the image:\n{out}");

    // 2. Control: with the bundle hidden, the SDK says it has no roots (so
    //    step 1's check can fail).
    let mut env = static_creds();
    env.push(("SSL_CERT_FILE", "/dev/null".to_owned()));
    let (ok, out) = run_in_image(&dir, "noroots", &args, &env, &[]);
    assert!(!ok && out.contains(NO_ROOTS), "without a bundle the SDK warns of no roots:\n{out}");

    // 3. The documented private CA, and IRSA instead of static keys.
    let env = vec![
        ("AWS_ENDPOINT_URL_EC2", server.endpoint().to_owned()),
        ("AWS_ENDPOINT_URL_STS", server.endpoint().to_owned()),
        ("AWS_REGION", moto::REGION.to_owned()),
        ("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/egret-gateway".to_owned()),
        ("AWS_WEB_IDENTITY_TOKEN_FILE", format!("{IRSA_TOKEN_DIR}/token")),
        ("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt".to_owned()),
        ("SSL_CERT_DIR", PRIVATE_CA_DIR.to_owned()),
    ];
    let (ok, out) =
        run_in_image(&dir, "private-ca", &args, &env, &[(&private_ca, PRIVATE_CA_DIR), (&token, IRSA_TOKEN_DIR)]);
    assert!(ok, "`egret cloud discover` from the image with the private CA:\n{out}");
    assert!(out.contains(&format!("subnet:    {} ({})", network.subnet_id, moto::SUBNET_CIDR)), "{out}");
    assert!(out.contains("public addresses: 1"), "{out}");
    assert!(
        out.lines().any(|l| l.contains(&eip.public_ip.to_string()) && l.contains(&eip.allocation_id)),
        "the tagged Elastic IP is listed:\n{out}"
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}
