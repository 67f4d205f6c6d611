//! Forged TCP RSTs against an offloaded session (nat/tcp_state.rs,
//! docs/operations.md "A TCP RST"): a real connection from a pod, offloaded
//! to XDP, carries megabytes both ways, so the pod's acknowledgments move
//! far past anything the workers saw; then an outside sender who knows the
//! 5-tuple forges RSTs. One with a sequence number outside the pod's window
//! is forwarded but leaves the session established and offloaded (and the
//! connection alive); one at the pod's next expected sequence number, which
//! only the fast path's record of the pod's acknowledgments can place in
//! the window, closes it.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use egret_dataplane::fixtures::build::Packet;
use egret_dataplane::fixtures::tcp;
use egret_dataplane::nat::tcp_state::flags::RST;
use egret_dataplane::stats::Event;
use egret_tests::capture::{Capture, Frame};
use egret_tests::client::TcpSession;
use egret_tests::frames::RawLink;
use egret_tests::gateway::Counters;
use egret_tests::harness::{Harness, Tier};
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

fn installed(c: &Counters) -> u64 {
    c.get_path("fast_path.offloads.installed")
}

/// The acknowledgment number of the latest segment from `from` to `to`
/// (IPv4 TCP) among `frames`.
fn last_ack(frames: &[Frame], from: SocketAddr, to: SocketAddr) -> Option<u32> {
    frames.iter().rev().find_map(|f| {
        let d = &f.data;
        if d.len() < 34 || d[12..14] != [0x08, 0x00] || d[23] != 6 {
            return None;
        }
        let l4 = 14 + usize::from(d[14] & 0x0f) * 4;
        let t = d.get(l4..l4 + 20)?;
        let src =
            SocketAddr::new(IpAddr::from(<[u8; 4]>::try_from(&d[26..30]).ok()?), u16::from_be_bytes([t[0], t[1]]));
        let dst =
            SocketAddr::new(IpAddr::from(<[u8; 4]>::try_from(&d[30..34]).ok()?), u16::from_be_bytes([t[2], t[3]]));
        (src == from && dst == to && t[13] & 0x10 != 0).then(|| u32::from_be_bytes([t[8], t[9], t[10], t[11]]))
    })
}

/// The session of `ext` (its external address) in `egret sessions --json`.
fn session(h: &Harness, ext: SocketAddr) -> serde_json::Value {
    let rows = h.gw.admin().sessions_json(1000).unwrap();
    rows.into_iter()
        .find(|r| {
            r["proto"].as_str() == Some("tcp")
                && r["egress"].as_str() == Some(&ext.ip().to_string())
                && r["egress_port"].as_u64() == Some(u64::from(ext.port()))
        })
        .unwrap_or_else(|| panic!("no session for {ext}"))
}

#[test]
fn a_forged_rst_closes_an_offloaded_session_only_inside_the_pods_window() {
    let name = "rst_window_offloaded";
    // Full checksums from the lab's senders, so data segments take XDP.
    let opts = LabOptions { tx_checksum_offload: false, ..LabOptions::for_test() };
    let Some(mut h) = crate::start_in(name, Tier::FastPath, opts, |_| {}) else { return };
    let pod = Pod::A;
    let server = pod.echo_endpoint();
    let cap = Capture::start(h.lab.server_ns(), "eth0").unwrap();
    let before = h.counters().unwrap();
    let mut conn = TcpSession::connect(h.lab.pod(pod), server).unwrap();
    let ext = conn.line("first").unwrap().seen;
    h.wait_counters(Duration::from_secs(3), "the session installed", |c| installed(c) > installed(&before)).unwrap();
    assert_eq!(session(&h, ext)["offloaded"].as_bool(), Some(true));

    // 16 MiB of lines, echoed back: the pod acknowledges them in XDP.
    let bulk = h.counters().unwrap();
    for i in 0..16 {
        let r = conn.line(&format!("bulk-{i}-{}", "x".repeat(1 << 20))).unwrap();
        assert_eq!(r.seen, ext, "line {i}: the same translation");
    }
    conn.line("last").unwrap();
    std::thread::sleep(Duration::from_millis(500)); // the pod's delayed ACK
    let hits = h.counters().unwrap().fast_path_hits() - bulk.fast_path_hits();
    assert!(hits > 1000, "the bulk data went through XDP: {hits} hits");
    let rcv_nxt = last_ack(&cap.caught_up(Duration::from_secs(10)).unwrap(), ext, server)
        .expect("the pod's segments at the server");

    let up = RawLink::open(h.lab.upstream(), "gw").unwrap();
    let forged = |seq: u32| {
        Packet {
            eth_src: plan::UP_MAC,
            eth_dst: h.lab.gateway_outside_mac(),
            vlan: None,
            src: server.ip(),
            dst: ext.ip(),
            ttl: 63,
            ident: 0x5151,
            options: Vec::new(),
            transport: tcp(server.port(), ext.port(), seq, None, RST, b""),
        }
        .frame()
    };
    let out_of_window = Event::TcpRstOutOfWindow.name();

    // A guess half the sequence space away: forwarded, counted, no effect.
    let c0 = h.counters().unwrap();
    up.send(&forged(rcv_nxt.wrapping_add(1 << 31))).unwrap();
    h.wait_counters(Duration::from_secs(3), "tcp_rst_out_of_window", |c| c.get(out_of_window) > c0.get(out_of_window))
        .unwrap();
    let s = session(&h, ext);
    assert_eq!(s["state"].as_str(), Some("established"), "{s}");
    assert_eq!(s["offloaded"].as_bool(), Some(true), "{s}");
    assert_eq!(conn.line("still here").unwrap().seen, ext, "the connection lives on");
    std::thread::sleep(Duration::from_millis(500));
    let rcv_nxt = last_ack(&cap.caught_up(Duration::from_secs(10)).unwrap(), ext, server)
        .expect("the pod's segments at the server");

    // The pod's next expected sequence number: the session closes (and the
    // pod's socket is reset: RFC 5961 3.2, an exact match).
    let c1 = h.counters().unwrap();
    up.send(&forged(rcv_nxt)).unwrap();
    let mut state = String::new();
    for _ in 0..30 {
        state = session(&h, ext)["state"].as_str().unwrap_or_default().to_string();
        if state == "closed" {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(state, "closed");
    assert_eq!(h.counters().unwrap().get(out_of_window), c1.get(out_of_window), "in the window");
    assert!(conn.line("after the reset").is_err(), "the pod's connection was reset");
    cap.stop().unwrap();
    h.finish(&[]).unwrap();
}
