//! SIGKILL leaves nothing behind: the XDP program is attached through a
//! bpf_link owned by the daemon, so the kernel detaches it when the process
//! dies (no "File exists" on the next attach); a restarted gateway works.

use std::time::{Duration, Instant};

use egret_tests::client;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

fn xdp_attached(h: &egret_tests::harness::Harness) -> Vec<String> {
    let out = h.lab.gateway_ns().ip(&["-d", "link", "show"]).unwrap();
    let mut attached = Vec::new();
    let mut dev = String::new();
    for line in out.lines() {
        if !line.starts_with(' ') {
            dev = line.split(':').nth(1).unwrap_or_default().trim().split('@').next().unwrap_or_default().to_string();
        }
        if line.contains(" xdp") || line.contains("prog/xdp") {
            attached.push(dev.clone());
        }
    }
    attached.sort();
    attached.dedup();
    attached
}

/// Packets the gateway's fail-closed table dropped: every named counter of
/// `inet egret_failclosed` but `dnat_replies`, which counts replies it lets
/// through.
fn fail_closed_drops(h: &egret_tests::harness::Harness) -> u64 {
    let text = h.lab.gateway_ns().exec(&["nft", "list", "counters", "table", "inet", "egret_failclosed"]).unwrap();
    let mut name = "";
    let mut dropped = 0;
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("counter ") {
            name = rest.split_whitespace().next().unwrap_or_default();
        } else if let Some(rest) = line.strip_prefix("packets ") {
            let n: u64 = rest.split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0);
            if name != "dnat_replies" {
                dropped += n;
            }
        }
    }
    dropped
}

both_tiers!(sigkill_detaches_xdp_and_restart_recovers, sigkill_then_restart);

fn sigkill_then_restart(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    let mut want: Vec<String> = h.lab.gateway_interfaces().iter().map(|(n, _)| n.to_string()).collect();
    want.sort();
    assert_eq!(xdp_attached(&h), want, "XDP attached on every gateway interface while running");
    let r = client::udp_echo(h.lab.pod(Pod::A), Pod::A.echo_endpoint(), "before").unwrap();
    assert_eq!(r.seen.ip(), std::net::IpAddr::from(plan::E1));
    crate::established_flows(&h, Pod::C, 3);

    let status = h.gw.kill().unwrap();
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "killed by SIGKILL: {status}");
    let deadline = Instant::now() + Duration::from_secs(3);
    while !xdp_attached(&h).is_empty() {
        assert!(Instant::now() < deadline, "XDP still attached after SIGKILL: {:?}", xdp_attached(&h));
        std::thread::sleep(Duration::from_millis(20));
    }

    let t = Instant::now();
    h.gw.restart().unwrap();
    eprintln!("{name}: restarted and ready in {:?}", t.elapsed());
    assert_eq!(xdp_attached(&h), want, "XDP attached again");
    for pod in [Pod::A, Pod::C] {
        let r = client::udp_echo(h.lab.pod(pod), pod.echo_endpoint(), &format!("after-{}", pod.name())).unwrap();
        assert_eq!(Some(r.seen.ip()), pod.egress(), "{pod:?} after restart");
        let r = client::http(h.lab.pod(pod), pod.http_endpoint(), "/after", 0).unwrap();
        assert_eq!(Some(r.seen.ip()), pod.egress(), "{pod:?} TCP after restart");
    }
    // The restarted daemon's fast path starts empty and fills again.
    crate::established_flows(&h, Pod::A, 3);
    h.finish(&[]).unwrap();
}

both_tiers!(dead_gateway_does_not_leak, dead_gateway);

/// While the daemon is dead (between a crash and its restart) its bpf_link is
/// gone, so no XDP program steers anything, and the gateway's kernel would
/// forward the selected pods' traffic with their own addresses. The
/// fail-closed nftables rules the daemon left behind (controlplane
/// failclosed.rs) drop it instead: nothing leaves with a pod address.
fn dead_gateway(name: &str, tier: Tier) {
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    // An established flow first: with the fast path on, in the kernel's
    // maps, which go with the program when the daemon dies.
    crate::established_flows(&h, Pod::A, 2);
    h.gw.kill().unwrap();
    let before = fail_closed_drops(&h);
    // Whether or not an answer comes back, nothing may leave with pod A's address.
    let _ = client::udp_echo(h.lab.pod(Pod::A), Pod::A.echo_endpoint(), "while-dead");
    // The positive control: the datagram reached the dead gateway and its
    // table dropped it (a datagram lost on the way would prove nothing).
    let after = fail_closed_drops(&h);
    assert!(after > before, "the fail-closed table dropped nothing while the gateway was dead ({before} -> {after})");
    // The finish reads counters from the (dead) daemon: its check of the
    // fast path was made above.
    h.expect_fast_path_hits = false;
    h.finish(&[]).unwrap();
}

/// A firewall reload or an `nft delete table` removes the fail-closed table
/// while the gateway runs: the gateway puts it back at once
/// (controlplane/src/daemon/fail_closed_repair.rs; file mode has no resync
/// that would), so a crash afterwards still leaks nothing.
#[test]
fn a_removed_fail_closed_table_is_put_back() {
    const NAME: &str = "a_removed_fail_closed_table_is_put_back";
    let Some(mut h) = crate::start_in(NAME, Tier::FastPath, LabOptions::for_test(), |_| {}) else { return };
    crate::established_flows(&h, Pod::A, 2);
    let ns = h.lab.gateway_ns();
    // The listing without its counters' values.
    let table = || {
        let text = ns.exec(&["nft", "list", "table", "inet", "egret_failclosed"]).unwrap_or_default();
        let mut words: Vec<&str> = text.split_whitespace().collect();
        for i in 1..words.len() {
            if matches!(words[i - 1], "packets" | "bytes") {
                words[i] = "N";
            }
        }
        words.join(" ")
    };
    let installed = table();
    assert!(installed.contains("table inet egret_failclosed"), "the gateway installed its table:\n{installed}");
    for wipe in [&["nft", "delete", "table", "inet", "egret_failclosed"][..], &["nft", "flush", "ruleset"][..]] {
        let t0 = Instant::now();
        ns.exec(wipe).unwrap();
        while table() != installed {
            assert!(t0.elapsed() < Duration::from_secs(10), "`{}`: the table is not back after 10 s", wipe.join(" "));
            std::thread::sleep(Duration::from_millis(5));
        }
        println!("{NAME}: `{}`: the fail-closed table was back {} ms later", wipe.join(" "), t0.elapsed().as_millis());
    }
    let status = h.gw.admin().status().unwrap();
    assert_eq!(status["fail_closed_repairs"], 2, "two repairs counted: {status}");
    // Then a crash: the table does its work.
    h.gw.kill().unwrap();
    let before = fail_closed_drops(&h);
    let _ = client::udp_echo(h.lab.pod(Pod::A), Pod::A.echo_endpoint(), "after-repair-while-dead");
    let after = fail_closed_drops(&h);
    assert!(after > before, "the repaired table dropped nothing while the gateway was dead ({before} -> {after})");
    h.expect_fast_path_hits = false;
    h.finish(&[]).unwrap();
}
