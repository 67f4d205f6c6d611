//! Table-driven tests: good files and their typed result, bad files and the
//! exact error text (file, field path, value).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

const GOOD: &str = r#"
interfaces:
  - name: eth1
    role: both
    queues: all
egressIPs:
  - ip: 203.0.113.10
    ports: 32768-60999
  - ip: 2001:db8::10
    answerNeighbor: false
neighborAddresses: [192.0.2.100]
policies:
  - name: team-a
    sources: [198.18.0.0/24, 2001:db8:1::/64]
    destinations: [0.0.0.0/0, "::/0"]
    except: [198.51.100.128/25]
    egressIPs: [203.0.113.10, 2001:db8::10]
admin:
  socket: /run/egret/test.sock
metrics:
  listen: 127.0.0.1:19469
"#;

fn errors(text: &str) -> Vec<String> {
    match load_str("gw.yaml", text) {
        Ok(_) => vec![],
        Err(e) => e.0.iter().map(|e| e.to_string()).collect(),
    }
}

#[test]
fn the_good_file_and_its_defaults() {
    let c = load_str("gw.yaml", GOOD).unwrap();
    assert_eq!(
        c.interfaces,
        vec![InterfaceConfig { name: "eth1".into(), role: Role::Both, queues: Queues::All, pod_source_macs: vec![] }]
    );
    assert_eq!(
        c.xdp,
        XdpConfig { mode: XdpMode::Native, fast_path: true, fast_path_sessions: FastPathSessions::both(262_144) }
    );
    assert_eq!(
        c.workers,
        WorkersConfig {
            cpus: vec![],
            realtime_priority: 50,
            frame_size: 2048,
            frames: 4096,
            ring_size: 2048,
            batch: 64
        }
    );
    assert_eq!(c.tables.egress_ips.len(), 2);
    assert_eq!(c.tables.egress_ips[0].ports, Some(PortRange { first: 32768, last: 60999 }));
    assert!(c.tables.egress_ips[0].answer_neighbor);
    assert!(!c.tables.egress_ips[1].answer_neighbor);
    assert_eq!(c.tables.neighbor_addresses, vec!["192.0.2.100".parse::<IpAddr>().unwrap()]);
    let p = &c.tables.policies[0];
    assert_eq!(p.name, "team-a");
    assert_eq!(p.sources, vec!["198.18.0.0/24".parse::<IpNet>().unwrap(), "2001:db8:1::/64".parse().unwrap()]);
    assert_eq!(p.except, vec!["198.51.100.128/25".parse::<IpNet>().unwrap()]);
    assert_eq!(c.tables.nat, NatSettings::default());
    assert_eq!(c.admin_socket, PathBuf::from("/run/egret/test.sock"));
    assert_eq!(c.metrics_listen, "127.0.0.1:19469".parse().unwrap());
    assert_eq!((c.port_use_top, c.port_use_refresh), (10, Duration::from_secs(10)));
    assert_eq!(c.kubernetes, None);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn every_documented_field_is_accepted() {
    let text = r#"
interfaces:
  - {name: veth-in, role: inside, queues: 2, podSourceMacs: ["02:00:00:00:00:0a"]}
  - {name: veth-out, role: outside, queues: "1"}
xdp: {mode: generic, fastPath: false, fastPathSessions: 1000}
workers: {cpus: [1], realtimePriority: 0, frameSize: 4096, frames: 1024, ringSize: 256, batch: 32}
egressIPs: [{ip: 203.0.113.10, kernelService: true}]
neighborAddresses: []
policies:
  - {name: p, sources: [198.18.0.7], destinations: [0.0.0.0/0], egressIPs: [203.0.113.10]}
nat:
  mapping: endpoint-dependent
  filtering: address-and-port-dependent
  ports: 1024-65535
  portAllocAttempts: 16
  maxSessions: 1000
  maxSessionsPerSource: 10
  maxPortsPerSource: 500
  newFlowsPerSecondPerSource: 300
  newFlowBurstPerSource: 600
  timeouts: {udp: 120, tcpEstablished: 7440, tcpTransitory: 240, icmp: 60}
  fragments: {cacheEntries: 16, timeout: 3}
  hairpinning: false
  tcpLoosePickup: false
  udpInboundRefresh: true
admin: {socket: /tmp/x.sock}
metrics: {listen: "127.0.0.1:1"}
"#;
    let c = load_str("gw.yaml", text).unwrap();
    assert_eq!(c.interfaces[0].queues, Queues::Count(2));
    assert_eq!(c.interfaces[1].queues, Queues::Count(1));
    assert_eq!(c.interfaces[1].role, Role::Outside);
    assert_eq!(c.interfaces[0].pod_source_macs, vec![[2, 0, 0, 0, 0, 0x0a]]);
    assert_eq!(c.tables.service_addresses, vec!["203.0.113.10".parse::<IpAddr>().unwrap()]);
    assert_eq!(
        c.xdp,
        XdpConfig { mode: XdpMode::Generic, fast_path: false, fast_path_sessions: FastPathSessions::both(1000) }
    );
    assert_eq!(c.workers.cpus, vec![1]);
    assert_eq!(c.workers.realtime_priority, 0);
    assert_eq!(
        c.tables.policies[0].sources,
        vec!["198.18.0.7/32".parse::<IpNet>().unwrap()],
        "a bare address is a /32"
    );
    let n = c.tables.nat;
    assert_eq!(n.mapping, MappingBehavior::EndpointDependent);
    assert_eq!(n.ports, PortRange { first: 1024, last: 65535 });
    assert_eq!((n.port_alloc_attempts, n.max_sessions, n.max_sessions_per_source), (16, 1000, 10));
    assert_eq!(n.max_ports_per_source, Some(500));
    assert_eq!((n.new_flows_per_second_per_source, n.new_flow_burst_per_source), (300, 600));
    assert_eq!(n.timeouts.udp, 120);
    assert_eq!(n.fragments, FragmentSettings { cache_entries: 16, timeout: 3 });
    assert!(!n.hairpinning && !n.tcp_loose_pickup && n.udp_inbound_refresh);
}

#[test]
fn bad_files_name_file_field_and_value() {
    let cases: &[(&str, &str, &[&str])] = &[
        (
            "bad CIDR in a source",
            "198.18.0.0/24, 2001:db8:1::/64",
            &[r#"gw.yaml: policies[0].sources[0]: "198.18.0.0/33": not a CIDR (address/length) or an IP address"#],
        ),
        (
            "host bits",
            "198.18.0.0/24, 2001:db8:1::/64",
            &[r#"gw.yaml: policies[0].sources[0]: "198.18.0.1/24": has host bits set (the network is 198.18.0.0/24)"#],
        ),
        (
            "bad port range",
            "ports: 32768-60999",
            &[r#"gw.yaml: egressIPs[0].ports: "60999-32768": port range must have 1 <= first <= last"#],
        ),
        (
            "not a range",
            "ports: 32768-60999",
            &[r#"gw.yaml: egressIPs[0].ports: "lots": not a port range "first-last" (e.g. "32768-60999")"#],
        ),
        ("bad egress ip", "ip: 203.0.113.10", &[r#"gw.yaml: egressIPs[0].ip: "203.0.113.300": not an IP address"#]),
        ("bad role", "role: both", &[r#"gw.yaml: interfaces[0].role: "middle": must be inside, outside or both"#]),
        (
            "bad metrics",
            "listen: 127.0.0.1:19469",
            &[r#"gw.yaml: metrics.listen: "localhost": not an address:port (e.g. "127.0.0.1:9469")"#],
        ),
        ("bad top", "listen: 127.0.0.1:19469", &[r#"gw.yaml: metrics.portUseTop: "0": must be 1 to 100"#]),
        (
            "bad refresh",
            "listen: 127.0.0.1:19469",
            &[
                r#"gw.yaml: metrics.portUseRefresh: "500ms": must be at least 1s (each refresh walks every pod's port counters)"#,
            ],
        ),
    ];
    let replacements = [
        "198.18.0.0/33, 2001:db8:1::/64",
        "198.18.0.1/24, 2001:db8:1::/64",
        "ports: 60999-32768",
        "ports: lots",
        "ip: 203.0.113.300",
        "role: middle",
        "listen: localhost",
        "listen: 127.0.0.1:19469\n  portUseTop: 0",
        "listen: 127.0.0.1:19469\n  portUseRefresh: 500ms",
    ];
    for ((name, from, want), to) in cases.iter().zip(replacements) {
        let text = GOOD.replacen(from, to, 1);
        assert_ne!(text, GOOD, "{name}: replacement did not apply");
        assert_eq!(errors(&text), *want, "{name}");
    }
}

#[test]
fn every_problem_is_reported_at_once() {
    let text = GOOD
        .replacen("198.18.0.0/24", "banana", 1)
        .replacen("except: [198.51.100.128/25]", "except: [198.51.100.128/25, 300.1.1.1]", 1)
        .replacen("[203.0.113.10, 2001:db8::10]", "[203.0.113.10, ::g]", 1);
    assert_eq!(
        errors(&text),
        vec![
            r#"gw.yaml: policies[0].sources[0]: "banana": not a CIDR (address/length) or an IP address"#,
            r#"gw.yaml: policies[0].except[1]: "300.1.1.1": not a CIDR (address/length) or an IP address"#,
            r#"gw.yaml: policies[0].egressIPs[1]: "::g": not an IP address"#,
        ]
    );
}

#[test]
fn a_new_flow_rate_out_of_range_names_field_and_value() {
    let text = format!("{GOOD}nat:\n  newFlowsPerSecondPerSource: 20000000\n");
    assert_eq!(
        errors(&text),
        vec!["gw.yaml: nat.newFlowsPerSecondPerSource: 20000000 is out of range (0-10000000)".to_string()]
    );
    let text = format!("{GOOD}nat:\n  newFlowBurstPerSource: 0\n");
    assert_eq!(errors(&text), vec!["gw.yaml: nat.newFlowBurstPerSource: 0 is out of range (1-10000000)".to_string()]);
    // 0 turns the limit off.
    let c = load_str("gw.yaml", &format!("{GOOD}nat:\n  newFlowsPerSecondPerSource: 0\n")).unwrap();
    assert_eq!(c.tables.nat.new_flows_per_second_per_source, 0);
}

#[test]
fn a_port_quota_out_of_range_names_field_and_value() {
    for bad in [0u32, 70_000] {
        let text = format!("{GOOD}nat:\n  maxPortsPerSource: {bad}\n");
        assert_eq!(errors(&text), vec![format!("gw.yaml: nat.maxPortsPerSource: {bad} is out of range (1-65536)")]);
    }
}

#[test]
fn port_blocks_per_egress_ip_and_as_the_default() {
    let text = GOOD.replace(
        "    ports: 32768-60999\n",
        "    ports: 32768-60999\n    portBlocks: {size: 256, maxPerPod: 4, logSessions: true}\n",
    );
    let c = load_str("gw.yaml", &format!("{text}nat:\n  portBlocks: {{}}\n")).unwrap();
    assert_eq!(c.tables.egress_ips[0].port_blocks, Some(PortBlocks { size: 256, max_per_pod: 4, log_sessions: true }));
    assert_eq!(c.tables.egress_ips[1].port_blocks, None, "the default applies in the dataplane");
    assert_eq!(c.tables.nat.port_blocks, Some(PortBlocks { size: 128, max_per_pod: 8, log_sessions: false }));
    assert_eq!(load_str("gw.yaml", GOOD).unwrap().tables.nat.port_blocks, None, "off unless given");
}

#[test]
fn bad_port_blocks_name_field_and_value() {
    let cases: &[(&str, &str)] = &[
        ("size: 100", "nat.portBlocks.size: \"100\": must be a power of two, at least 8"),
        ("size: 4", "nat.portBlocks.size: \"4\": must be a power of two, at least 8"),
        ("size: 65536", "nat.portBlocks.size: \"65536\": too large"),
        (
            "size: 32768",
            "nat.portBlocks.size: \"32768\": must be no larger than the port range 32768-60999, with one block \
             aligned to its size inside it",
        ),
        ("maxPerPod: 0", "nat.portBlocks.maxPerPod: \"0\": must be 1-32"),
        ("maxPerPod: 33", "nat.portBlocks.maxPerPod: \"33\": must be 1-32"),
    ];
    for (yaml, want) in cases {
        let text = format!("{GOOD}nat:\n  portBlocks: {{{yaml}}}\n");
        assert_eq!(errors(&text), vec![format!("gw.yaml: {want}")], "{yaml}");
    }
    let text = GOOD.replace("    ports: 32768-60999\n", "    ports: 40000-40100\n    portBlocks: {size: 128}\n");
    assert_eq!(
        errors(&text),
        vec!["gw.yaml: egressIPs[0].portBlocks.size: \"128\": must be no larger than the port range 40000-40100, \
              with one block aligned to its size inside it"
            .to_string()]
    );
    let text = format!("{GOOD}nat:\n  portBlocks: {{size: 8, perPod: 2}}\n");
    assert!(errors(&text)[0].contains("perPod"), "{:?}", errors(&text));
}

#[test]
fn syntax_errors_carry_line_and_column() {
    let cases: &[(&str, &str)] = &[
        ("interfaces: [\n  {name: eth0, role: both\n", "gw.yaml:2:3: unclosed bracket '{'"),
        (
            "interfaces: []\nbogus: 1\n",
            "gw.yaml:2:1: unknown field `bogus`, expected one of interfaces, xdp, workers, egressIPs, neighborAddresses, policies, nat, admin, metrics, kubernetes, tunnel, translationLogs",
        ),
        ("nat:\n  maxSessions: -3\n", "gw.yaml:2:16: invalid u64"),
        ("nat:\n  timeouts: {udp: 300, tcp: 1}\n", "gw.yaml:2:24: unknown field `tcp`, expected one of udp, tcpEstablished, tcpTransitory, icmp"),
    ];
    for (text, want) in cases {
        assert_eq!(errors(text), vec![want.to_string()], "{text}");
    }
}

#[test]
fn rules_across_fields() {
    let two_both = GOOD.replacen("    queues: all\n", "    queues: all\n  - name: eth2\n    role: both\n", 1);
    assert_eq!(
        errors(&two_both),
        vec!["gw.yaml: interfaces: must be one interface with role both (one-arm) or one inside and one outside (two-arm); got 2 both, 0 inside, 0 outside"]
    );
    let dup = GOOD.replacen("    queues: all\n", "    queues: all\n  - name: eth1\n    role: inside\n", 1);
    assert_eq!(errors(&dup)[0], r#"gw.yaml: interfaces[1].name: "eth1": listed twice"#);
    let no_policies = "interfaces: [{name: eth0}]\n";
    assert_eq!(errors(no_policies), vec!["gw.yaml: policies: missing (required without kubernetes:)"]);
    let k8s_with_policies = format!("{GOOD}kubernetes: {{nodeName: gw-1}}\n");
    assert_eq!(
        errors(&k8s_with_policies),
        vec![
            "gw.yaml: policies: must not be set with kubernetes: (the cluster provides it)",
            "gw.yaml: egressIPs: must not be set with kubernetes: (the cluster provides it)",
            "gw.yaml: neighborAddresses: must not be set with kubernetes: (the cluster provides it)",
        ]
    );
    let k8s = "interfaces: [{name: eth0}]\nkubernetes: {nodeName: gw-1, leaseDuration: 10s, renewDeadline: 5s, retryPeriod: 250ms}\n";
    let c = load_str("gw.yaml", k8s).unwrap();
    let k = c.kubernetes.unwrap();
    assert_eq!(
        (k.lease_duration, k.renew_deadline, k.retry_period),
        (Duration::from_secs(10), Duration::from_secs(5), Duration::from_millis(250))
    );
    assert_eq!(k.lease_namespace, "egret-system");
    let bad_k8s = "interfaces: [{name: eth0}]\nkubernetes: {leaseDuration: 2s, renewDeadline: 4s, retryPeriod: soon}\n";
    assert_eq!(
        errors(bad_k8s),
        vec![r#"gw.yaml: kubernetes.retryPeriod: "soon": not a duration (e.g. "4s", "500ms")"#]
    );
    let guard = "interfaces: [{name: eth0}]\nkubernetes: {clusterPodCIDRs: [198.18.0.1/16, 2001:db8:18::/48]}\n";
    let k = load_str("gw.yaml", guard).unwrap().kubernetes.unwrap();
    assert_eq!(
        k.cluster_pod_cidrs,
        vec!["198.18.0.0/16".parse().unwrap(), "2001:db8:18::/48".parse::<ipnet::IpNet>().unwrap()]
    );
    let bad_guard = "interfaces: [{name: eth0}]\nkubernetes: {clusterPodCIDRs: [198.18.0.0/16, pods]}\n";
    assert_eq!(errors(bad_guard), vec![r#"gw.yaml: kubernetes.clusterPodCIDRs[1]: "pods" is not a CIDR"#]);
    assert!(k.liveness, "ownership liveness by default (ADR 0016)");
    let per_ip = "interfaces: [{name: eth0}]\nkubernetes: {ownership: perIP}\n";
    assert!(!load_str("gw.yaml", per_ip).unwrap().kubernetes.unwrap().liveness);
    let liveness = "interfaces: [{name: eth0}]\nkubernetes: {ownership: liveness}\n";
    assert!(load_str("gw.yaml", liveness).unwrap().kubernetes.unwrap().liveness);
    let bad_ownership = "interfaces: [{name: eth0}]\nkubernetes: {ownership: gossip}\n";
    assert_eq!(
        errors(bad_ownership),
        vec![r#"gw.yaml: kubernetes.ownership: "gossip" is neither "perIP" nor "liveness""#]
    );
}

/// `egret gateway --cluster-pod-cidr --gateway-selector --nat-ports`
/// replace the file's values (or set them where it has none); a file
/// without `kubernetes:` keeps only the port range, with a warning.
#[test]
fn overrides_replace_the_files_values() {
    let file = "interfaces: [{name: eth0}]\nkubernetes: {clusterPodCIDRs: [198.18.0.0/16], gatewaySelector: a=b}\nnat: {ports: 1024-2047}\n";
    let o = Overrides {
        cluster_pod_cidrs: Some(vec!["10.1.0.0/16".parse().unwrap(), "fd00:10::/56".parse().unwrap()]),
        gateway_selector: Some("example.com/egress=yes".into()),
        nat_ports: Some(PortRange { first: 40000, last: 49999 }),
        tunnel_port: Some(7000),
    };
    let c = load_str_with("gw.yaml", file, &o).unwrap();
    assert_eq!(c.tables.tunnel.as_ref().map(|t| t.port), Some(7000));
    let k = c.kubernetes.unwrap();
    assert_eq!(k.cluster_pod_cidrs, o.cluster_pod_cidrs.clone().unwrap());
    assert_eq!(k.gateway_selector, "example.com/egress=yes");
    assert_eq!(c.tables.nat.ports, PortRange { first: 40000, last: 49999 });
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // Without flags the file's values; with some, the others stay the file's.
    let k = load_str_with("gw.yaml", file, &Overrides::default()).unwrap().kubernetes.unwrap();
    assert_eq!((k.cluster_pod_cidrs.len(), k.gateway_selector.as_str()), (1, "a=b"));
    let only_ports = Overrides { nat_ports: Some(PortRange { first: 2000, last: 2999 }), ..Overrides::default() };
    let c = load_str_with("gw.yaml", file, &only_ports).unwrap();
    assert_eq!(c.tables.nat.ports, PortRange { first: 2000, last: 2999 });
    assert_eq!(c.kubernetes.unwrap().gateway_selector, "a=b");
    // A file without kubernetes: and without the values.
    let bare = "interfaces: [{name: eth0}]\nkubernetes: {}\n";
    let c = load_str_with("gw.yaml", bare, &o).unwrap();
    assert_eq!(c.kubernetes.unwrap().cluster_pod_cidrs.len(), 2);
    assert_eq!(c.tables.nat.ports, PortRange { first: 40000, last: 49999 });
    let c = load_str_with("gw.yaml", GOOD, &o).unwrap();
    assert_eq!(c.kubernetes, None);
    assert_eq!(c.tables.nat.ports, PortRange { first: 40000, last: 49999 });
    assert_eq!(
        c.warnings,
        [
            "--cluster-pod-cidr and --gateway-selector ignored: the file has no kubernetes: section (not in Kubernetes mode)",
            "--tunnel-port ignored: the file has no tunnel: section",
        ]
    );
    assert_eq!(c.tables.tunnel, None);
}

/// `tunnel:` (docs/config.md): on by default in Kubernetes mode, with the
/// Nodes as senders; in file mode on when given, with its
/// `nodeAddresses`; every mistake names the field and the value.
#[test]
fn the_nodes_tunnel() {
    let k8s = "interfaces: [{name: eth0}]\nkubernetes: {}\n";
    let c = load_str("gw.yaml", k8s).unwrap();
    assert_eq!(c.tables.tunnel, Some(TunnelSpec { port: 6082, nodes: vec![] }));
    let off = format!("{k8s}tunnel: {{enabled: false}}\n");
    assert_eq!(load_str("gw.yaml", &off).unwrap().tables.tunnel, None);
    assert_eq!(load_str("gw.yaml", GOOD).unwrap().tables.tunnel, None, "file mode: off unless given");
    let file = format!("{GOOD}tunnel:\n  port: 7000\n  nodeAddresses: [192.0.2.31, \"2001:db8:2::31\"]\n");
    let c = load_str("gw.yaml", &file).unwrap();
    assert_eq!(
        c.tables.tunnel,
        Some(TunnelSpec { port: 7000, nodes: vec!["192.0.2.31".parse().unwrap(), "2001:db8:2::31".parse().unwrap()] })
    );
    for (tunnel, want) in [
        ("{}", "gw.yaml: tunnel.nodeAddresses: missing or empty: list the nodes that may send (or enabled: false)"),
        ("{nodeAddresses: [node-1]}", r#"gw.yaml: tunnel.nodeAddresses[0]: "node-1": not an IP address"#),
        ("{nodeAddresses: [192.0.2.1, 192.0.2.1]}", r#"gw.yaml: tunnel.nodeAddresses[1]: "192.0.2.1": listed twice"#),
        ("{port: 0, nodeAddresses: [192.0.2.1]}", r#"gw.yaml: tunnel.port: "0": must be 1-65535"#),
        (
            "{port: 40000, nodeAddresses: [192.0.2.1]}",
            "gw.yaml: tunnel.port: 40000 lies in nat.ports 32768-60999; choose a port outside every NAT port range",
        ),
    ] {
        assert_eq!(errors(&format!("{GOOD}tunnel: {tunnel}\n")), [want], "{tunnel}");
    }
    assert_eq!(
        errors(&format!("{k8s}tunnel: {{nodeAddresses: [192.0.2.1]}}\n")),
        [
            r#"gw.yaml: tunnel.nodeAddresses: "1 addresses": must not be set with kubernetes: (the Nodes' InternalIPs are the senders)"#
        ]
    );
}

#[test]
fn engine_errors_are_mapped_to_fields() {
    let short_udp = format!("{GOOD}nat:\n  timeouts: {{udp: 30}}\n");
    assert_eq!(
        errors(&short_udp),
        vec!["gw.yaml: nat.timeouts.udp: 30 s is below the minimum of 120 s (RFC 4787 REQ-5)"]
    );
    let v6_only_egress = GOOD.replacen("[203.0.113.10, 2001:db8::10]", "[2001:db8::10]", 1);
    assert_eq!(
        errors(&v6_only_egress),
        vec![
            r#"gw.yaml: policies[0].egressIPs: no IPv4 egress IP for the IPv4 source 198.18.0.0/24 (policy "team-a")"#
        ]
    );
    let dup_name = GOOD.replacen(
        "admin:",
        "  - {name: team-a, sources: [198.18.1.0/24], destinations: [0.0.0.0/0], egressIPs: [203.0.113.10]}\nadmin:",
        1,
    );
    assert_eq!(
        errors(&dup_name),
        vec![r#"gw.yaml: policies[1].name: "team-a" is used by another policy (policy "team-a")"#]
    );
    let dup_ip = GOOD.replacen("  - ip: 2001:db8::10\n", "  - ip: 203.0.113.10\n", 1);
    assert_eq!(errors(&dup_ip), vec!["gw.yaml: egressIPs[1].ip: 203.0.113.10 is listed twice"]);
}

#[test]
fn warnings_for_probably_unintended_settings() {
    let text = GOOD.replacen("[203.0.113.10, 2001:db8::10]", "[203.0.113.10, 203.0.113.99, 2001:db8::10]", 1).replacen(
        "127.0.0.1:19469",
        "0.0.0.0:19469",
        1,
    );
    let c = load_str("gw.yaml", &text).unwrap();
    assert_eq!(
        c.warnings,
        vec![
            "policies[0].egressIPs[1]: 203.0.113.99 is not in egressIPs: this gateway does not hold it, so the pods it is paired with are dropped (egress_ip_not_owned)",
            "metrics.listen: 0.0.0.0:19469 is not a loopback address",
        ]
    );
}

#[test]
fn restart_only_settings_are_named() {
    let a = load_str("gw.yaml", GOOD).unwrap();
    let b = load_str("gw.yaml", &GOOD.replacen("queues: all", "queues: 1", 1).replacen("19469", "19470", 1)).unwrap();
    assert_eq!(a.restart_only_changes(&b), vec!["interfaces", "metrics.listen"]);
    assert!(a.restart_only_changes(&a.clone()).is_empty());
    let c = load_str("gw.yaml", &format!("{GOOD}xdp: {{fastPath: false, fastPathSessions: 5}}\n")).unwrap();
    assert_eq!(a.restart_only_changes(&c), vec!["xdp.fastPath", "xdp.fastPathSessions"]);
}

#[test]
fn fast_path_sessions_are_bounded() {
    for (value, want) in [
        ("0", r#"gw.yaml: xdp.fastPathSessions: "0": must be between 1 and 4194304"#),
        ("4194305", r#"gw.yaml: xdp.fastPathSessions: "4194305": must be between 1 and 4194304"#),
    ] {
        let text = format!("{GOOD}xdp: {{fastPathSessions: {value}}}\n");
        assert_eq!(errors(&text), vec![want.to_string()], "{value}");
    }
    let c = load_str("gw.yaml", &format!("{GOOD}xdp: {{fastPathSessions: 4194304}}\n")).unwrap();
    assert_eq!(c.xdp.fast_path_sessions, FastPathSessions::both(1 << 22));
}

#[test]
fn fast_path_sessions_per_family() {
    let sessions = |value: &str| {
        load_str("gw.yaml", &format!("{GOOD}xdp:\n  fastPathSessions: {value}\n")).unwrap().xdp.fast_path_sessions
    };
    assert_eq!(sessions("{ipv4: 100000, ipv6: 0}"), FastPathSessions { ipv4: 100_000, ipv6: 0 });
    assert_eq!(sessions("{ipv6: 4096}"), FastPathSessions { ipv4: 262_144, ipv6: 4096 }, "the other family's default");
    assert_eq!(sessions("{ipv4: 0}"), FastPathSessions { ipv4: 0, ipv6: 262_144 });
    for (value, want) in [
        (
            "{ipv4: 0, ipv6: 0}",
            r#"gw.yaml: xdp.fastPathSessions: "{ipv4: 0, ipv6: 0}": at least one family needs sessions (xdp.fastPath: false turns the fast path off)"#,
        ),
        ("{ipv4: 1, ipv6: 4194305}", r#"gw.yaml: xdp.fastPathSessions.ipv6: "4194305": must be between 0 and 4194304"#),
    ] {
        let text = format!("{GOOD}xdp: {{fastPathSessions: {value}}}\n");
        assert_eq!(errors(&text), vec![want.to_string()], "{value}");
    }
    let text = format!("{GOOD}xdp: {{fastPathSessions: {{ipv4: 1, ip6: 2}}}}\n");
    assert_eq!(errors(&text), vec!["gw.yaml:22:35: unknown field `ip6`, expected one of ipv4, ipv6".to_string()]);
    let text = format!("{GOOD}xdp: {{fastPathSessions: lots}}\n");
    assert_eq!(
        errors(&text),
        vec![r#"gw.yaml:22:7: invalid type: string "lots", expected a session count, or {ipv4: count, ipv6: count}"#
            .to_string()]
    );
    let text = format!("{GOOD}xdp: {{fastPathSessions: -1}}\n");
    assert_eq!(
        errors(&text),
        vec!["gw.yaml:22:7: invalid value: integer `-1`, expected a session count, or {ipv4: count, ipv6: count}"
            .to_string()]
    );
    // The tables are sized for them only with the fast path on.
    let on = load_str("gw.yaml", &format!("{GOOD}xdp: {{fastPathSessions: {{ipv6: 0}}}}\n")).unwrap();
    assert_eq!(on.xdp.table_sessions(), FastPathSessions { ipv4: 262_144, ipv6: 0 });
    let off = load_str("gw.yaml", &format!("{GOOD}xdp: {{fastPath: false, fastPathSessions: 5}}\n")).unwrap();
    assert_eq!(off.xdp.table_sessions(), FastPathSessions::both(0));
    // A restart-only setting, per family too.
    let a = load_str("gw.yaml", GOOD).unwrap();
    let b = load_str("gw.yaml", &format!("{GOOD}xdp: {{fastPathSessions: {{ipv6: 0}}}}\n")).unwrap();
    assert_eq!(a.restart_only_changes(&b), vec!["xdp.fastPathSessions"]);
}

#[test]
fn unreadable_file() {
    let e = load(Path::new("/nonexistent/egret.yaml")).unwrap_err();
    assert_eq!(e.to_string(), "/nonexistent/egret.yaml: cannot read: No such file or directory (os error 2)");
}

#[test]
fn pod_source_macs_are_parsed_and_checked() {
    let one_arm = GOOD.replacen(
        "    queues: all\n",
        "    queues: all\n    podSourceMacs: [\"02:00:00:00:00:0A\", 02-e9-00-00-00-0b]\n",
        1,
    );
    let c = load_str("gw.yaml", &one_arm).unwrap();
    assert_eq!(c.interfaces[0].pod_source_macs, vec![[2, 0, 0, 0, 0, 0x0a], [2, 0xe9, 0, 0, 0, 0x0b]]);
    let cases: &[(&str, &[&str])] = &[
        (
            "[02:00:00:00:00]",
            &[
                r#"gw.yaml: interfaces[0].podSourceMacs[0]: "02:00:00:00:00": not a MAC address (six hex octets, e.g. 02:00:00:00:00:01)"#,
            ],
        ),
        (
            "[\"01:00:5e:00:00:01\"]",
            &[
                r#"gw.yaml: interfaces[0].podSourceMacs[0]: "01:00:5e:00:00:01": a multicast or zero MAC cannot be a sender"#,
            ],
        ),
        (
            "[\"02:00:00:00:00:01\", \"02:00:00:00:00:01\"]",
            &[r#"gw.yaml: interfaces[0].podSourceMacs[1]: "02:00:00:00:00:01": listed twice"#],
        ),
    ];
    for (list, want) in cases {
        let text = GOOD.replacen("    queues: all\n", &format!("    queues: all\n    podSourceMacs: {list}\n"), 1);
        assert_eq!(errors(&text), *want, "{list}");
    }
    let outside = r#"
interfaces:
  - {name: in0, role: inside}
  - {name: out0, role: outside, podSourceMacs: ["02:00:00:00:00:01"]}
egressIPs: [{ip: 203.0.113.10}]
policies:
  - {name: p, sources: [198.18.0.7], destinations: [0.0.0.0/0], egressIPs: [203.0.113.10]}
"#;
    assert_eq!(
        errors(outside),
        [
            r#"gw.yaml: interfaces[1].podSourceMacs: "1 addresses": an outside interface never carries pods' traffic; list the node routers' MACs on the inside (or both) interface"#
        ]
    );
}

#[test]
fn translation_logs_and_their_defaults() {
    assert_eq!(load_str("gw.yaml", GOOD).unwrap().translation_logs, None, "off unless given");
    let text = format!(
        "{GOOD}translationLogs:\n  ipfix: {{collector: \"192.0.2.50:4739\"}}\n  syslog: {{collector: \"[2001:db8::50]:514\"}}\n"
    );
    let t = load_str("gw.yaml", &text).unwrap().translation_logs.unwrap();
    assert_eq!(
        t,
        TranslationLogsConfig {
            ring_records: 65_536,
            queue_events: 262_144,
            log_destinations: true,
            enterprise_number: 32_473,
            ipfix: Some(IpfixConfig {
                collector: "192.0.2.50:4739".parse().unwrap(),
                observation_domain: None,
                template_refresh: Duration::from_secs(60),
                mtu: 1400,
            }),
            syslog: Some(SyslogConfig {
                collector: "[2001:db8::50]:514".parse().unwrap(),
                hostname: None,
                transport: SyslogTransport::Udp,
            }),
            journal: Some(JournalConfig {
                dir: "/var/lib/egret/translog".into(),
                max_bytes: 1 << 30,
                max_age: Duration::from_secs(86_400),
            }),
        }
    );
    let text = format!("{GOOD}translationLogs:\n  journal: {{dir: /srv/tl, maxBytes: 2097152, maxAge: 2h}}\n");
    let j = load_str("gw.yaml", &text).unwrap().translation_logs.unwrap().journal.unwrap();
    assert_eq!(j, JournalConfig { dir: "/srv/tl".into(), max_bytes: 2 << 20, max_age: Duration::from_secs(7200) });
    let only_journal = format!("{GOOD}translationLogs: {{}}\n");
    let t = load_str("gw.yaml", &only_journal).unwrap().translation_logs.unwrap();
    assert!(t.ipfix.is_none() && t.syslog.is_none() && t.journal.is_some(), "the journal alone is a sink");
    let days = format!("{GOOD}translationLogs: {{journal: {{maxAge: 7d}}}}\n");
    let j = load_str("gw.yaml", &days).unwrap().translation_logs.unwrap().journal.unwrap();
    assert_eq!(j.max_age, Duration::from_secs(7 * 86_400));
    let text = format!(
        "{GOOD}translationLogs:\n  ringRecords: 4096\n  queueEvents: 10\n  logDestinations: false\n  \
         ipfix: {{collector: \"192.0.2.50:4739\", observationDomain: 7, templateRefresh: 30s, mtu: 9000}}\n"
    );
    let t = load_str("gw.yaml", &text).unwrap().translation_logs.unwrap();
    assert_eq!((t.ring_records, t.queue_events, t.log_destinations), (4096, 10, false));
    let i = t.ipfix.unwrap();
    assert_eq!((i.observation_domain, i.template_refresh, i.mtu), (Some(7), Duration::from_secs(30), 9000));
    let off = format!("{GOOD}translationLogs:\n  enabled: false\n");
    assert_eq!(load_str("gw.yaml", &off).unwrap().translation_logs, None);
}

#[test]
fn translation_logs_bad_values_are_named() {
    let cases: &[(&str, &[&str])] = &[
        (
            "{journal: {enabled: false}}",
            &["gw.yaml: translationLogs: neither ipfix:, syslog: nor the journal is on: give a collector (or enabled: false)"],
        ),
        (
            "{journal: {dir: var/tl}}",
            &[r#"gw.yaml: translationLogs.journal.dir: "var/tl": must be an absolute path"#],
        ),
        (
            "{journal: {maxBytes: 1000}}",
            &[r#"gw.yaml: translationLogs.journal.maxBytes: "1000": must be at least 1048576 (1 MiB)"#],
        ),
        ("{journal: {maxAge: 30s}}", &[r#"gw.yaml: translationLogs.journal.maxAge: "30s": must be 1m-366d"#]),
        ("{journal: {maxAge: 400d}}", &[r#"gw.yaml: translationLogs.journal.maxAge: "400d": must be 1m-366d"#]),
        (
            "{journal: {maxAge: soon}}",
            &[r#"gw.yaml: translationLogs.journal.maxAge: "soon": not a duration (e.g. "4s", "500ms")"#],
        ),
        (
            "{ipfix: {collector: \"192.0.2.50\"}}",
            &[
                r#"gw.yaml: translationLogs.ipfix.collector: "192.0.2.50": not an address:port (e.g. "192.0.2.50:4739", "[2001:db8::50]:4739")"#,
            ],
        ),
        (
            "{ipfix: {}}",
            &[
                r#"gw.yaml: translationLogs.ipfix.collector: "": missing: the collector's address:port (e.g. "192.0.2.50:4739")"#,
            ],
        ),
        (
            "{syslog: {collector: \"0.0.0.0:514\"}}",
            &[
                r#"gw.yaml: translationLogs.syslog.collector: "0.0.0.0:514": needs a port and an address that is not unspecified"#,
            ],
        ),
        (
            "{ringRecords: 10, syslog: {collector: \"192.0.2.50:514\"}}",
            &[r#"gw.yaml: translationLogs.ringRecords: "10": must be 1024-16777216"#],
        ),
        (
            "{queueEvents: 0, syslog: {collector: \"192.0.2.50:514\"}}",
            &[r#"gw.yaml: translationLogs.queueEvents: "0": must be 1-16777216"#],
        ),
        (
            "{ipfix: {collector: \"192.0.2.50:4739\", mtu: 100}}",
            &[r#"gw.yaml: translationLogs.ipfix.mtu: "100": must be 640-65507 (bytes of a UDP payload)"#],
        ),
        (
            "{ipfix: {collector: \"192.0.2.50:4739\", templateRefresh: 2h}}",
            &[r#"gw.yaml: translationLogs.ipfix.templateRefresh: "2h": not a duration (e.g. "4s", "500ms")"#],
        ),
        (
            "{ipfix: {collector: \"192.0.2.50:4739\", templateRefresh: 90m}}",
            &[r#"gw.yaml: translationLogs.ipfix.templateRefresh: "90m": must be at most 60m"#],
        ),
        (
            "{syslog: {collector: \"192.0.2.50:514\", hostname: \"gw a\"}}",
            &[
                r#"gw.yaml: translationLogs.syslog.hostname: "gw a": must be 1-255 printable US-ASCII characters, no space (RFC 5424 HOSTNAME)"#,
            ],
        ),
        (
            "{syslog: {collector: \"192.0.2.50:514\", transport: sctp}}",
            &[r#"gw.yaml: translationLogs.syslog.transport: "sctp": must be udp or tcp"#],
        ),
        (
            "{enterpriseNumber: 0, syslog: {collector: \"192.0.2.50:514\"}}",
            &[
                r#"gw.yaml: translationLogs.enterpriseNumber: "0": must be an IANA Private Enterprise Number (1-4294967295)"#,
            ],
        ),
        (
            "{enterpriseNumber: 4294967296, ipfix: {collector: \"192.0.2.50:4739\"}}",
            &[r#"gw.yaml: translationLogs.enterpriseNumber: "4294967296": must be an IANA Private Enterprise Number (1-4294967295)"#],
        ),
        (
            "{enterpriseNumber: -5, ipfix: {collector: \"192.0.2.50:4739\"}}",
            &[r#"gw.yaml: translationLogs.enterpriseNumber: "-5": must be an IANA Private Enterprise Number (1-4294967295)"#],
        ),
        (
            "{enterpriseNumber: acme, ipfix: {collector: \"192.0.2.50:4739\"}}",
            &[r#"gw.yaml: translationLogs.enterpriseNumber: "acme": must be an IANA Private Enterprise Number (1-4294967295)"#],
        ),
    ];
    for (section, want) in cases {
        assert_eq!(errors(&format!("{GOOD}translationLogs: {section}\n")), *want, "{section}");
    }
}
