//! The sysctls the labs set in their namespaces, and the one way to set
//! them (`sysctl -w` inside the namespace). Set before the interfaces are
//! made: `default.*` applies to interfaces created afterwards.

use crate::error::Result;
use crate::netns::NetNs;

/// Every namespace of a lab: no duplicate address detection (addresses are
/// usable at once).
pub const COMMON: [&str; 2] = ["net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"];

/// A pod's, besides [`COMMON`]: unprivileged ICMP echo sockets (the lab's
/// pings run as any user).
pub const POD: [&str; 1] = ["net.ipv4.ping_group_range=0 2147483647"];

/// A router's (IPv4): forwarding, no reverse-path filter, and no redirects
/// (one-arm: forwarding out of the interface a packet came in on).
pub const ROUTER: [&str; 5] = [
    "net.ipv4.ip_forward=1",
    "net.ipv4.conf.all.rp_filter=0",
    "net.ipv4.conf.default.rp_filter=0",
    "net.ipv4.conf.all.send_redirects=0",
    "net.ipv4.conf.default.send_redirects=0",
];

/// IPv6 forwarding, for a dual-stack router.
pub const FORWARD6: [&str; 1] = ["net.ipv6.conf.all.forwarding=1"];

/// `sysctl -q -w` each `key=value` of every list in `lists`, in `ns`.
pub fn set(ns: &NetNs, lists: &[&[&str]]) -> Result<()> {
    let mut argv = vec!["sysctl", "-q", "-w"];
    for l in lists {
        argv.extend_from_slice(l);
    }
    ns.exec(&argv).map(|_| ())
}
