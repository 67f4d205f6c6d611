//! Egret's network-namespace lab and the helpers its end-to-end tests share.
//!
//! - [`plan`]: the address plan (the fixture table's addresses and MACs).
//! - [`lab`]: the topology ([`lab::Lab`]: pods, node router, gateway,
//!   upstream router, server), deleted on drop.
//! - [`netns`]: namespaces, commands and threads inside them.
//! - [`gateway`]: the `egret` daemon's config, process, admin CLI.
//! - [`server`], [`client`]: the external server that reports the source it
//!   saw, and the pods' clients.
//! - [`capture`], [`frames`]: captures on a link, the leak check, raw frames.
//! - [`harness`]: lab + gateway + outside capture + leak check, per test.
//! - [`sys`]: the few raw system calls (the crate's only unsafe code).
//! - [`tools`]: the external commands the tests run, the package of each
//!   (`tests/tools.txt`), and the "missing tool" message.
//! - [`apiserver`]: a real kube-apiserver + etcd for the control-plane tests,
//!   on loopback or inside a lab namespace.
//! - [`k8slab`]: the Kubernetes lab (two gateways in Kubernetes mode, the API
//!   server inside the lab; or three, [`k8slab::K8sLab::build_with`]),
//!   [`probe`]: streams of new connections to time failovers, [`load`]: the
//!   load and the ARP watch of the high-availability tests.
//! - [`nodelab`]: the worker-node lab (two worker Nodes running `egret node`
//!   behind CNI-style masquerades, two gateways, the API server).
//! - [`cni`]: the CNI project's reference plugins (Debian's
//!   containernetworking-plugins) run through the CNI protocol as a
//!   container runtime runs them: the worker-node lab's CNI variant.
//! - [`kubeproxy`]: the real kube-proxy (1.20, iptables mode) in a lab
//!   namespace, and the EndpointSlices it reads, written as the
//!   endpoint-slice controller would.
//! - [`moto`]: an EC2 API emulator (moto's server) on loopback, and helpers
//!   that seed it; [`faultproxy`]: a proxy in front of it that fails chosen
//!   EC2 actions (errors, stalls), for the AWS provider's tests.
//! - [`azure_emulator`]: the ARM emulator (`tests/emulators/azure`) over
//!   HTTPS on loopback, its control API and seeding, for the Azure
//!   provider's tests.
//! - [`gcp_emulator`]: the Compute Engine emulator (`tests/emulators/gcp/`)
//!   on loopback and its control API (seeds, faults, request log, routing
//!   truth), for the GCP provider's tests.
//! - [`nfcapd`]: a real IPFIX collector (nfdump's nfcapd) on loopback, and
//!   nfdump reading back what it stored (translation logs, ADR 0034).
//! - [`prometheus`]: a real Prometheus scraping a lab, queried over its API,
//!   and `promtool` for the alert rules' unit tests.
//!
//! The `egret-lab` binary (`src/bin/egret-lab.rs`) drives the same code for
//! `tests/lab.sh`; docs/lab.md describes both.

pub mod apiserver;
pub mod azure_emulator;
pub mod capture;
pub mod client;
pub mod cloudlab;
pub mod cluster_net;
pub mod cni;
pub mod error;
pub mod faultproxy;
pub mod frames;
pub mod gateway;
pub mod gcp_emulator;
pub mod harness;
pub mod k8slab;
pub mod kubelet;
pub mod kubeproxy;
pub mod lab;
pub mod load;
pub mod moto;
pub mod netns;
pub mod nfcapd;
pub mod nodelab;
pub mod plan;
pub mod probe;
pub mod prometheus;
pub mod requirement;
pub mod script;
pub mod server;
pub mod sys;
pub mod sysctl;
pub mod tools;

pub use error::{LabError, Result};

/// Whether the lab can run here: it needs root (namespaces, XDP, raw
/// sockets). When it cannot, the calling test is skipped ([`skip`]).
pub fn lab_available(test: &str) -> bool {
    if sys::is_root() {
        return true;
    }
    skip(test, "the network-namespace lab needs root (run the tests as root; CI does)");
    false
}

/// Skips `test`, saying why on stderr past libtest's output capture (so that
/// it shows for a passing test too), or fails it when
/// `EGRET_REQUIRE_PRIVILEGES=1` (.ci/run sets it): there, a test that could
/// not run for want of a privilege or a tool is a test that tested nothing.
/// (The API server, kube-proxy and moto have their own `EGRET_REQUIRE_*`.)
pub fn skip(test: &str, why: &str) {
    assert!(
        std::env::var("EGRET_REQUIRE_PRIVILEGES").map_or(true, |v| v.trim() != "1"),
        "{test} cannot run: {why}; EGRET_REQUIRE_PRIVILEGES=1 makes that a failure"
    );
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}

/// An on/off environment variable: unset is `default`; `0`, `false`, `off`
/// or empty is off; anything else is on.
pub fn env_flag(name: &str, default: bool) -> bool {
    std::env::var(name).map(|v| !matches!(v.trim(), "0" | "false" | "off" | "")).unwrap_or(default)
}

/// Whether the labs assert their documented time bounds (a failover within
/// so many seconds), `EGRET_HA_EXPECT_TIMES=1`. Off by default: speed is a
/// benchmark's to bound (docs/benchmarks.md), a test's default run asserts
/// what happened and in which order (nobody took an IP before its Lease could
/// expire, a data plane fenced before the take-over), which holds on a busy
/// machine too.
pub fn expect_times() -> bool {
    env_flag("EGRET_HA_EXPECT_TIMES", false)
}
