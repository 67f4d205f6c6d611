//! Port blocks from the real daemon (ADR 0034 §6): with
//! `nat.portBlocks: {size: 8, maxPerPod: 2}`, pods A and B share egress
//! IP E1. A opens 16 UDP flows: the ports the server sees fill exactly two
//! aligned blocks of 8, and A's 17th flow is refused at its limit (counted
//! `source_port_quota`, never sent with another port or address). B's
//! three flows take one block of their own. `egret port-blocks` and
//! `/metrics` must then report three blocks held by two pods, and the
//! capture must show no pod address on the outside link.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use egret_tests::client;
use egret_tests::gateway::{http_get_in, METRICS};
use egret_tests::lab::LabOptions;
use egret_tests::plan::{Pod, E1, NAT_PORTS};

const SIZE: u16 = 8;
const MAX_PER_POD: usize = 2;

/// Opens `n` UDP flows from `pod` and returns the external ports the server saw.
fn flows(h: &egret_tests::harness::Harness, pod: Pod, n: usize, keep: &mut Vec<std::net::UdpSocket>) -> Vec<u16> {
    (0..n)
        .map(|i| {
            let s = client::udp_socket(h.lab.pod(pod), pod.echo_endpoint()).unwrap();
            let (r, _) = client::udp_exchange(&s, &format!("{pod:?}-{i}"), 3, Duration::from_secs(1))
                .unwrap_or_else(|e| panic!("{pod:?}'s flow {i}: {e}"));
            assert_eq!(r.seen.ip(), IpAddr::from(E1), "{pod:?}'s flow {i}: the egress address");
            keep.push(s);
            r.seen.port()
        })
        .collect()
}

#[test]
fn port_blocks_bound_each_pods_ports() {
    let name = "port_blocks";
    let Some(mut h) = crate::start(name, LabOptions::for_test(), |cfg| {
        cfg.extra += &format!("nat:\n  portBlocks: {{size: {SIZE}, maxPerPod: {MAX_PER_POD}}}\n");
    }) else {
        return;
    };
    h.expect_fast_path_hits = false;
    let mut open = Vec::new();
    let before = h.counters().unwrap();

    // A fills its two blocks exactly; B takes one of its own.
    let a = flows(&h, Pod::A, MAX_PER_POD * usize::from(SIZE), &mut open);
    let b = flows(&h, Pod::B, 3, &mut open);
    let block = |p: &u16| p / SIZE;
    let (a_blocks, b_blocks): (BTreeSet<u16>, BTreeSet<u16>) =
        (a.iter().map(block).collect(), b.iter().map(block).collect());
    assert_eq!(a.iter().collect::<BTreeSet<_>>().len(), a.len(), "A's ports are distinct: {a:?}");
    assert_eq!(a_blocks.len(), MAX_PER_POD, "A's 16 ports fill two blocks of {SIZE}: {a:?}");
    assert_eq!(b_blocks.len(), 1, "B's 3 ports lie in one block: {b:?}");
    assert!(a_blocks.is_disjoint(&b_blocks), "A's blocks {a_blocks:?} and B's {b_blocks:?}");
    for p in a.iter().chain(&b) {
        assert!((NAT_PORTS.0..=NAT_PORTS.1).contains(p), "port {p} outside nat.ports");
    }

    // A's 17th flow: no port left in its blocks, and no third block.
    let extra = client::udp_socket(h.lab.pod(Pod::A), Pod::A.echo_endpoint()).unwrap();
    assert!(
        client::udp_exchange(&extra, "A-over", 2, Duration::from_millis(500)).is_err(),
        "A's flow beyond maxPerPod x size was answered"
    );
    let after = h
        .wait_counters(Duration::from_secs(3), "the refusal counted", |k| {
            k.get("source_port_quota") > before.get("source_port_quota")
        })
        .unwrap();
    assert!(after.get("source_port_quota") >= 2, "both tries refused: {:?}", after.0);

    // `egret port-blocks`.
    let rows: serde_json::Value = serde_json::from_str(&h.gw.admin().cli(&["port-blocks", "--json"]).unwrap()).unwrap();
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{rows:?}");
    let r = &rows[0];
    // The blocks wholly inside nat.ports (aligned to their size).
    let size = u32::from(SIZE);
    let blocks_in_range = u64::from((u32::from(NAT_PORTS.1) + 1) / size - u32::from(NAT_PORTS.0).div_ceil(size));
    let want = serde_json::json!({
        "egress_ip": E1.to_string(), "configured": true, "block_size": SIZE, "max_per_pod": MAX_PER_POD,
        "capacity": blocks_in_range, "in_use": 3, "pods": 2, "exhausted": 0,
    });
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(&r[k], v, "port-blocks' {k}: {r}");
    }
    assert!(r["pod_limit"].as_u64().unwrap() >= 1, "the refusal counted in port-blocks: {r}");

    // The same on /metrics.
    let metrics: SocketAddr = METRICS.parse().unwrap();
    let (status, text) = http_get_in(h.lab.gateway_ns(), metrics, "/metrics").unwrap();
    assert_eq!(status, 200);
    let labels = format!("{{egress_ip=\"{E1}\",block_size=\"{SIZE}\"}}");
    for (family, value) in [
        ("egret_port_blocks_in_use", "3".to_string()),
        ("egret_port_blocks_pods", "2".to_string()),
        ("egret_port_blocks_capacity", blocks_in_range.to_string()),
    ] {
        let line = format!("{family}{labels} {value}");
        assert!(text.lines().any(|l| l == line), "no {line:?} in /metrics:\n{text}");
    }
    assert!(
        text.lines()
            .any(|l| l.starts_with(&format!("egret_port_blocks_pod_limit_total{labels} ")) && !l.ends_with(" 0")),
        "egret_port_blocks_pod_limit_total counted the refusal:\n{text}"
    );
    drop(open);
    h.finish(&[]).unwrap();
}
