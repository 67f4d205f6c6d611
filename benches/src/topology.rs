//! The benchmark's network: three namespaces joined by two veth pairs, built
//! with `ip`, torn down by a guard (`egret_dataplane::netns::NetnsGuard`)
//! that deletes the namespaces (and with them every veth) however the run
//! ends.
//!
//! ```text
//!  ns <tag>-gen              ns <tag>-gw                          ns <tag>-sink
//!  gen0 198.18.0.1/15 ---- gwin 198.19.255.254/15                 
//!  (core 0: generator)      [kernel SNAT | Egret | redirect]       
//!                           gwout 198.51.100.254/24 ---- sink0 198.51.100.1/24
//!                           (core 1: gateway)                (core 0: XDP sink counter)
//! ```
//!
//! Every veth has one RX and one TX queue (one AF_XDP socket per queue).
//! Addresses are TEST-NET/benchmark ranges only (RFC 2544 198.18.0.0/15,
//! RFC 5737 198.51.100.0/24 and 203.0.113.0/24).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};

use egret_dataplane::netns::NetnsGuard;

/// The generator's interface (namespace `gen`).
pub const GEN_IF: &str = "gen0";
/// The gateway's inside interface (towards the pods).
pub const GW_IN: &str = "gwin";
/// The gateway's outside interface (towards the sink).
pub const GW_OUT: &str = "gwout";
/// The sink's interface.
pub const SINK_IF: &str = "sink0";

pub const GEN_MAC: [u8; 6] = [0x02, 0xeb, 0, 0, 0, 0x01];
pub const GW_IN_MAC: [u8; 6] = [0x02, 0xeb, 0, 0, 0, 0x02];
pub const GW_OUT_MAC: [u8; 6] = [0x02, 0xeb, 0, 0, 0, 0x03];
pub const SINK_MAC: [u8; 6] = [0x02, 0xeb, 0, 0, 0, 0x04];

pub const GEN_ADDR: &str = "198.18.0.1/15";
pub const GW_IN_ADDR: &str = "198.19.255.254/15";
pub const GW_OUT_ADDR: &str = "198.51.100.254/24";
pub const SINK_ADDR: &str = "198.51.100.1/24";
/// The pods' range (the generator's flow sources) as policies name it.
pub const POD_RANGE: &str = "198.18.0.0/16";
/// The sink range (destinations).
pub const SINK_RANGE: &str = "198.51.100.0/24";
/// Where every benchmark frame goes.
pub const SINK_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
/// UDP discard (RFC 863).
pub const SINK_PORT: u16 = 9;
/// The egress IP the gateway translates to.
pub const EGRESS_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The worker node that encapsulates in the VXLAN modes (issue 30): the
/// outer source of its frames, in the gateway's `tunnel.nodeAddresses`.
/// Nothing holds it; the generator writes it into its frames, which come
/// from the router's MAC (`gen0`'s), as they would from another subnet.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 31);
/// The MAC of the node's VXLAN device, both addresses of the inner
/// Ethernet header (a NOARP device resolves every neighbour to itself).
pub const NODE_GNV_MAC: [u8; 6] = [0x02, 0xeb, 0, 0, 0, 0x11];

/// What failed building or changing the topology.
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error("running `{command}` failed: {source}")]
    Spawn { command: String, source: std::io::Error },
    #[error("`{command}` exited with {status}: {stderr}")]
    Failed { command: String, status: String, stderr: String },
    #[error("creating the namespaces failed: {0}")]
    Netns(std::io::Error),
}

/// Entering a network namespace failed.
#[derive(Debug, thiserror::Error)]
#[error("entering network namespace {ns} failed: {source}")]
pub struct NetnsError {
    pub ns: String,
    pub source: std::io::Error,
}

/// Run `f` on a scoped thread inside network namespace `ns` (an `ip netns`
/// name) and return its result; the calling thread's namespace is untouched.
/// A panic in `f` is returned as an error.
pub fn in_netns<T: Send, E: Send + From<NetnsError>>(
    ns: &str,
    f: impl FnOnce() -> Result<T, E> + Send,
) -> Result<T, E> {
    let netns_error = |source| E::from(NetnsError { ns: ns.to_owned(), source });
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| egret_dataplane::netns::run_in(ns, f)))
        .unwrap_or_else(|_| Err(std::io::Error::other("thread panicked")))
        .map_err(netns_error)?
}

/// An interface's packet and drop counters (`stats64`). On veth, frames
/// refused because the peer's ring is full count as the sender's TX drops
/// and the receiver's RX drops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkCounters {
    pub rx_packets: u64,
    pub rx_dropped: u64,
    pub tx_packets: u64,
    pub tx_dropped: u64,
}

impl LinkCounters {
    /// From `ip -j -s link show DEV` output.
    pub fn from_ip_json(text: &str) -> Option<Self> {
        let v: serde_json::Value = serde_json::from_str(text).ok()?;
        let st = v.get(0)?.get("stats64")?;
        let n =
            |dir: &str, f: &str| st.get(dir).and_then(|d| d.get(f)).and_then(serde_json::Value::as_u64).unwrap_or(0);
        Some(Self {
            rx_packets: n("rx", "packets"),
            rx_dropped: n("rx", "dropped"),
            tx_packets: n("tx", "packets"),
            tx_dropped: n("tx", "dropped"),
        })
    }

    /// `rx_dropped / (rx_dropped + rx_packets)`: the share of arriving
    /// frames the interface refused (0 when nothing arrived).
    pub fn rx_drop_share(&self) -> f64 {
        let total = self.rx_dropped + self.rx_packets;
        if total == 0 {
            0.0
        } else {
            self.rx_dropped as f64 / total as f64
        }
    }

    /// Field-wise `self - earlier`.
    pub fn since(&self, e: &LinkCounters) -> LinkCounters {
        LinkCounters {
            rx_packets: self.rx_packets.saturating_sub(e.rx_packets),
            rx_dropped: self.rx_dropped.saturating_sub(e.rx_dropped),
            tx_packets: self.tx_packets.saturating_sub(e.tx_packets),
            tx_dropped: self.tx_dropped.saturating_sub(e.tx_dropped),
        }
    }
}

/// Format a MAC address.
pub fn mac_str(m: &[u8; 6]) -> String {
    let mut s = String::with_capacity(17);
    for (i, b) in m.iter().enumerate() {
        if i > 0 {
            s.push(':');
        }
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Run a command, returning its stdout; non-zero exit is an error carrying
/// stderr. `stdin`, when given, is written to the command's input.
pub fn run(args: &[&str], stdin: Option<&str>) -> Result<String, TopologyError> {
    let command = args.join(" ");
    let (prog, rest) = args.split_first().ok_or_else(|| TopologyError::Failed {
        command: String::new(),
        status: "not run".into(),
        stderr: "empty command".into(),
    })?;
    let mut cmd = Command::new(prog);
    cmd.args(rest).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() });
    let mut child = cmd.spawn().map_err(|source| TopologyError::Spawn { command: command.clone(), source })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(|source| TopologyError::Spawn { command: command.clone(), source })?;
    }
    let out = child.wait_with_output().map_err(|source| TopologyError::Spawn { command: command.clone(), source })?;
    if !out.status.success() {
        return Err(TopologyError::Failed {
            command,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The three namespaces of one run. Dropping it deletes them (and ends the
/// processes left inside).
#[derive(Debug)]
pub struct Topology {
    pub gen_ns: String,
    pub gw_ns: String,
    pub sink_ns: String,
    _namespaces: NetnsGuard,
}

impl Topology {
    /// Build the namespaces, veths, addresses, routes and neighbours. Names
    /// start with `tag` (unique per run: the benchmark uses its pid).
    pub fn create(tag: &str) -> Result<Self, TopologyError> {
        let (gen_ns, gw_ns, sink_ns) = (format!("{tag}-gen"), format!("{tag}-gw"), format!("{tag}-sink"));
        let namespaces = NetnsGuard::named(&[&gen_ns, &gw_ns, &sink_ns]).create().map_err(TopologyError::Netns)?;
        let t = Topology { gen_ns, gw_ns, sink_ns, _namespaces: namespaces };
        let (gen, gw, sink) = (t.gen_ns.clone(), t.gw_ns.clone(), t.sink_ns.clone());
        let pair = |a_ns: &str, a: &str, a_mac: &[u8; 6], b_ns: &str, b: &str, b_mac: &[u8; 6]| {
            run(
                &[
                    "ip",
                    "link",
                    "add",
                    a,
                    "netns",
                    a_ns,
                    "address",
                    &mac_str(a_mac),
                    "numrxqueues",
                    "1",
                    "numtxqueues",
                    "1",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    b,
                    "netns",
                    b_ns,
                    "address",
                    &mac_str(b_mac),
                    "numrxqueues",
                    "1",
                    "numtxqueues",
                    "1",
                ],
                None,
            )
        };
        pair(&gen, GEN_IF, &GEN_MAC, &gw, GW_IN, &GW_IN_MAC)?;
        pair(&gw, GW_OUT, &GW_OUT_MAC, &sink, SINK_IF, &SINK_MAC)?;
        for (ns, dev, addr) in [
            (&gen, GEN_IF, GEN_ADDR),
            (&gw, GW_IN, GW_IN_ADDR),
            (&gw, GW_OUT, GW_OUT_ADDR),
            (&sink, SINK_IF, SINK_ADDR),
        ] {
            run(&["ip", "-n", ns, "addr", "add", addr, "dev", dev], None)?;
            run(&["ip", "-n", ns, "link", "set", dev, "up"], None)?;
            run(&["ip", "-n", ns, "link", "set", "lo", "up"], None)?;
        }
        // veth hands skbs to its peer's NAPI only when they cannot need
        // segmentation (veth_skb_is_eligible_for_gro): without this the
        // af-packet engine's frames would be processed by netif_rx on the
        // generator's core.
        t.ethtool_feature(&gen, GEN_IF, "tso", false)?;
        for (key, value) in [
            ("net.ipv4.ip_forward", "0"),
            ("net.ipv4.conf.all.rp_filter", "0"),
            ("net.ipv4.conf.default.rp_filter", "0"),
        ] {
            t.sysctl(&gw, key, value)?;
        }
        for dev in [GW_IN, GW_OUT] {
            t.sysctl(&gw, &format!("net.ipv4.conf.{dev}.rp_filter"), "0")?;
        }
        // The gateway's L2 next hop to the sink: static, so no ARP is needed
        // during a measurement (Egret reads it from the kernel).
        run(
            &[
                "ip",
                "-n",
                &gw,
                "neigh",
                "replace",
                &SINK_IP.to_string(),
                "lladdr",
                &mac_str(&SINK_MAC),
                "dev",
                GW_OUT,
                "nud",
                "permanent",
            ],
            None,
        )?;
        // And the sink's way back to the egress IP (not measured, but a
        // gateway answering ARP for it would otherwise see requests).
        run(
            &[
                "ip",
                "-n",
                &sink,
                "neigh",
                "replace",
                &EGRESS_IP.to_string(),
                "lladdr",
                &mac_str(&GW_OUT_MAC),
                "dev",
                SINK_IF,
                "nud",
                "permanent",
            ],
            None,
        )?;
        run(&["ip", "-n", &sink, "route", "add", &format!("{EGRESS_IP}/32"), "dev", SINK_IF], None)?;
        Ok(t)
    }

    /// Set a sysctl inside namespace `ns`.
    pub fn sysctl(&self, ns: &str, key: &str, value: &str) -> Result<(), TopologyError> {
        run(&["ip", "netns", "exec", ns, "sysctl", "-q", "-w", &format!("{key}={value}")], None).map(drop)
    }

    /// Run a command inside namespace `ns`.
    pub fn exec(&self, ns: &str, args: &[&str], stdin: Option<&str>) -> Result<String, TopologyError> {
        let mut full = vec!["ip", "netns", "exec", ns];
        full.extend_from_slice(args);
        run(&full, stdin)
    }

    /// Turn threaded NAPI on for `dev` in `ns` (`/sys/class/net/<dev>/threaded`;
    /// the device must have NAPI: veth gets it from XDP or GRO). Idempotent.
    pub fn set_threaded(&self, ns: &str, dev: &str) -> Result<(), TopologyError> {
        self.exec(ns, &["sh", "-c", &format!("echo 1 > /sys/class/net/{dev}/threaded")], None).map(drop)
    }

    /// `ethtool -K <dev> <feature> on|off` in `ns`.
    pub fn ethtool_feature(&self, ns: &str, dev: &str, feature: &str, on: bool) -> Result<(), TopologyError> {
        self.exec(ns, &["ethtool", "-K", dev, feature, if on { "on" } else { "off" }], None).map(drop)
    }

    /// Packet and drop counters of every interface of the topology, keyed by
    /// interface name (`ip -j -s link show`).
    pub fn link_counters(&self) -> Result<BTreeMap<String, LinkCounters>, TopologyError> {
        let mut out = BTreeMap::new();
        for (ns, dev) in [(&self.gen_ns, GEN_IF), (&self.gw_ns, GW_IN), (&self.gw_ns, GW_OUT), (&self.sink_ns, SINK_IF)]
        {
            let text = run(&["ip", "-n", ns, "-j", "-s", "link", "show", dev], None)?;
            out.insert(dev.to_owned(), LinkCounters::from_ip_json(&text).unwrap_or_default());
        }
        Ok(out)
    }

    /// `ip -s link show` of every interface, for the report when a run
    /// looks wrong.
    pub fn link_stats(&self) -> String {
        let mut s = String::new();
        for (ns, dev) in [(&self.gen_ns, GEN_IF), (&self.gw_ns, GW_IN), (&self.gw_ns, GW_OUT), (&self.sink_ns, SINK_IF)]
        {
            if let Ok(o) = run(&["ip", "-n", ns, "-s", "link", "show", dev], None) {
                s.push_str(&o);
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_formatting() {
        assert_eq!(mac_str(&GW_IN_MAC), "02:eb:00:00:00:02");
    }

    #[test]
    fn link_counters_from_ip_json() {
        let text = r#"[{"ifindex":3,"ifname":"gwin","stats64":{"rx":{"bytes":60,"packets":1,"errors":0,"dropped":7,"over_errors":0,"multicast":0},"tx":{"bytes":0,"packets":2,"errors":0,"dropped":3,"carrier_errors":0,"collisions":0}}}]"#;
        let c = LinkCounters::from_ip_json(text).expect("parse");
        assert_eq!(c, LinkCounters { rx_packets: 1, rx_dropped: 7, tx_packets: 2, tx_dropped: 3 });
        assert_eq!(c.since(&LinkCounters { rx_packets: 1, rx_dropped: 2, tx_packets: 0, tx_dropped: 5 }).rx_dropped, 5);
        assert_eq!(LinkCounters::from_ip_json("[]"), None);
        assert!((c.rx_drop_share() - 0.875).abs() < 1e-12);
        assert_eq!(LinkCounters::default().rx_drop_share(), 0.0);
    }

    #[test]
    fn failing_commands_report_stderr() {
        let e = run(&["sh", "-c", "echo oops >&2; exit 3"], None).expect_err("must fail");
        let msg = e.to_string();
        assert!(msg.contains("oops") && msg.contains("exit status: 3"), "{msg}");
        assert_eq!(run(&["cat"], Some("in")).expect("cat"), "in");
    }
}
