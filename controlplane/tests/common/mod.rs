//! Network-namespace helpers for the control plane's root tests: namespaces
//! and veth pairs that are always deleted (a guard with Drop), TEST-NET
//! addresses only.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

use egret_dataplane::netns::NetnsGuard;

/// Runs `ip ARGS`, panicking with its stderr on failure.
pub fn ip(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(out.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `cmd ARGS` inside namespace `ns`.
pub fn in_ns(ns: &str, cmd: &[&str]) -> std::process::Output {
    Command::new("ip").args(["netns", "exec", ns]).args(cmd).output().expect("ip netns exec")
}

/// Namespaces `<prefix><pid>-<n>-<name>` for each name, loopback up,
/// deleted on drop (their veths go with them); `name(i)` is namespace `i`.
pub fn netns(prefix: &str, names: &[&str]) -> NetnsGuard {
    NetnsGuard::unique(prefix, names).lo_up().create().unwrap_or_else(|e| panic!("{e}"))
}

/// A veth pair `a` (in `ns_a`) <-> `b` (in `ns_b`), both up, with addresses.
pub fn veth(ns_a: &str, a: &str, addr_a: &str, ns_b: &str, b: &str, addr_b: &str) {
    ip(&["link", "add", a, "netns", ns_a, "type", "veth", "peer", "name", b, "netns", ns_b]);
    for (ns, dev, addr) in [(ns_a, a, addr_a), (ns_b, b, addr_b)] {
        if !addr.is_empty() {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
        }
        ip(&["-n", ns, "link", "set", dev, "up"]);
    }
}

/// The MAC of `dev` in `ns`.
pub fn mac(ns: &str, dev: &str) -> [u8; 6] {
    let out = ip(&["-n", ns, "-j", "link", "show", dev]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let s = v[0]["address"].as_str().unwrap();
    let mut m = [0u8; 6];
    for (i, p) in s.split(':').enumerate() {
        m[i] = u8::from_str_radix(p, 16).unwrap();
    }
    m
}

/// The ifindex of `dev` in `ns`.
pub fn ifindex(ns: &str, dev: &str) -> u32 {
    let out = ip(&["-n", ns, "-j", "link", "show", dev]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v[0]["ifindex"].as_u64().unwrap() as u32
}
