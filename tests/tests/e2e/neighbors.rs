//! Next hops the gateway's kernel does not know, or would forget (issue 14,
//! items 8 and 9).
//!
//! - `first_datagram_waits_for_its_next_hop`: with the upstream router's
//!   neighbour entry deleted, `/ready` says which next hop is missing, and
//!   the first datagram of a new flow still reaches the server on its only
//!   try: the worker holds it until the kernel has resolved the next hop
//!   (`neighbor_queued`, `neighbor_queue_sent`), as the kernel itself queues
//!   packets on an incomplete neighbour. Before, it was dropped
//!   (`neighbor_unresolved`).
//! - `a_failed_next_hop_is_asked_for_again`: a next hop the kernel marked
//!   FAILED is asked for again while a route uses it, so the gateway is
//!   ready once the router answers.
//! - `neighbors_in_use_outlive_the_kernels_gc`: 300 on-link next hops (the
//!   upstream namespace owns 300 addresses), more than the kernel's
//!   `gc_thresh1` (128), with the gateway's reachable and stale times
//!   lowered to seconds, and traffic to each every half second for 25 s.
//!   The kernel never sees that traffic; without the daemon confirming the
//!   entries in use, its periodic GC (every 15 s: half of the initial
//!   namespace's `base_reachable_time`) deletes them once STALE and unused
//!   for `gc_stale_time`, and frames meet an unresolved next hop. With it,
//!   none does after the first resolution.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use egret_dataplane::stats::{DropReason, Event};
use egret_tests::client;
use egret_tests::gateway::{http_get_in, METRICS};
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::{self, Pod};

fn ready(h: &egret_tests::harness::Harness) -> (u16, String) {
    let addr: SocketAddr = METRICS.parse().unwrap();
    http_get_in(h.lab.gateway_ns(), addr, "/ready").unwrap()
}

fn wait_ready_state(h: &egret_tests::harness::Harness, want: u16, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let (status, body) = ready(h);
        if status == want {
            return body;
        }
        assert!(Instant::now() < deadline, "/ready stayed {status} ({body:?}), want {want}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn first_datagram_waits_for_its_next_hop() {
    let name = "first_datagram_waits_for_its_next_hop";
    let Some(mut h) = crate::start_in(name, Tier::Userspace, LabOptions::for_test(), |_| {}) else { return };
    // The upstream router stops answering ARP until the datagram is on its
    // way: otherwise the gateway's own re-resolution (it asks the kernel as
    // soon as /ready finds the entry gone) can finish first, and the
    // datagram, finding a MAC, never has to wait (a loaded run saw that).
    let (out, upstream, up_dev, body) = forget_the_upstream_router(&h);
    assert!(body.contains(&format!("{upstream} on {out}")), "/ready names the unresolved next hop: {body:?}");

    let before = h.counters().unwrap();
    let s = client::udp_socket(h.lab.pod(Pod::A), Pod::A.echo_endpoint()).unwrap();
    // ARP comes back 300 ms after the datagram left the pod: the gateway's
    // next probe (one a second) then resolves the entry, within the hold
    // queue's 3 s.
    let up_ns = h.lab.upstream().name().to_string();
    let arp_on = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        egret_tests::netns::NetNs::existing(&up_ns)
            .and_then(|ns| ns.ip(&["link", "set", "dev", &up_dev, "arp", "on"]).map(|_| ()))
    });
    // One try: the first datagram itself must arrive.
    let exchanged = client::udp_exchange(&s, "first-datagram", 1, Duration::from_secs(5));
    arp_on.join().expect("the ARP switch thread").expect("ARP back on at the upstream router");
    let (r, _) = exchanged
        .unwrap_or_else(|e| panic!("the first datagram was lost: {e}; {:?}", h.counters().unwrap().delta(&before)));
    assert_eq!(r.seen.ip(), std::net::IpAddr::from(plan::E1), "translated as usual");
    let after = h.counters().unwrap();
    let d = |n: &str| after.get(n) - before.get(n);
    assert!(d(Event::NeighborQueued.name()) >= 1, "the datagram waited: {:?}", after.delta(&before));
    assert!(d(Event::NeighborQueueSent.name()) >= 1, "and was sent: {:?}", after.delta(&before));
    for reason in [DropReason::NeighborUnresolved, DropReason::NeighborQueueTimeout, DropReason::NeighborQueueOverflow]
    {
        assert_eq!(d(reason.name()), 0, "no {reason}: {:?}", after.delta(&before));
    }
    wait_ready_state(&h, 200, Duration::from_secs(5));
    h.finish(&[]).unwrap();
}

/// A next hop the kernel gave up on (FAILED: its probes went unanswered, the
/// router was down) is asked for again while a route uses it: once the
/// router answers, the gateway is ready without any packet of its own
/// toward it. Before, nothing asked again (an entry going from INCOMPLETE to
/// FAILED changes nothing Egret mirrors), and `/ready` stayed 503 until some
/// other traffic made the kernel resolve it (found in the Vagrant lab, when
/// the routers' VM booted after the gateway's).
#[test]
fn a_failed_next_hop_is_asked_for_again() {
    let name = "a_failed_next_hop_is_asked_for_again";
    let Some(mut h) = crate::start_in(name, Tier::Userspace, LabOptions::for_test(), |_| {}) else { return };
    let (out, upstream, up_dev, _) = forget_the_upstream_router(&h);
    // The kernel's probes (3 broadcasts, a second apart) go unanswered.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let state = h.lab.gateway_ns().ip(&["neigh", "show", &upstream, "dev", out]).unwrap();
        if state.contains("FAILED") {
            break;
        }
        assert!(Instant::now() < deadline, "the kernel never gave up on {upstream}: {state:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Stay FAILED a while: any request made by the time the entry failed
    // has run its course.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(ready(&h).0, 503, "not ready while the next hop is FAILED");
    h.lab.upstream().ip(&["link", "set", "dev", &up_dev, "arp", "on"]).unwrap();
    let body = wait_ready_state(&h, 200, Duration::from_secs(15));
    assert_eq!(body.trim(), "ready", "{body:?}");
    h.finish(&[]).unwrap();
}

/// From a ready lab: the upstream router stops answering ARP and the
/// gateway's kernel forgets its MAC, which the daemon mirrors (`/ready`
/// answers 503). Returns the gateway's outside device, the router's
/// address and device, and `/ready`'s body.
fn forget_the_upstream_router(h: &egret_tests::harness::Harness) -> (&'static str, String, String, String) {
    assert_eq!(ready(h).0, 200, "the lab resolved the gateway's next hops before the start");
    let out = h.lab.gateway_outside_dev();
    let upstream = plan::UPSTREAM.to_string();
    let up_dev = upstream_dev(h);
    h.lab.upstream().ip(&["link", "set", "dev", &up_dev, "arp", "off"]).unwrap();
    h.lab.gateway_ns().ip(&["neigh", "del", &upstream, "dev", out]).unwrap();
    let body = wait_ready_state(h, 503, Duration::from_secs(5));
    (out, upstream, up_dev, body)
}

/// The upstream router's device that holds its address on the gateway's link.
fn upstream_dev(h: &egret_tests::harness::Harness) -> String {
    let lines = h.lab.upstream().ip(&["-o", "-4", "addr", "show"]).unwrap();
    let want = format!(" {}/", plan::UPSTREAM);
    lines
        .lines()
        .find(|l| l.contains(&want))
        .and_then(|l| l.split_whitespace().nth(1))
        .map(|d| d.trim_end_matches(':').to_string())
        .unwrap_or_else(|| panic!("no device holds {} in the upstream namespace: {lines}", plan::UPSTREAM))
}

/// Next hops in the lab's benchmark range, away from every other address.
const HOPS: u32 = 300;

fn hop(i: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 19, 64, 10)) + i)
}

#[test]
fn neighbors_in_use_outlive_the_kernels_gc() {
    let name = "neighbors_in_use_outlive_the_kernels_gc";
    // The GC only runs past gc_thresh1 entries (one table for every
    // namespace: it cannot be lowered for one); with more, this test could not fail.
    let thresh1: u32 = std::fs::read_to_string("/proc/sys/net/ipv4/neigh/default/gc_thresh1")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(128);
    assert!(thresh1 < HOPS, "gc_thresh1 is {thresh1}: raise HOPS above it so the kernel's GC runs");
    let Some(mut h) = crate::start_in(name, Tier::Userspace, LabOptions::for_test(), |_| {}) else { return };
    let out = h.lab.gateway_outside_dev();
    // The upstream router owns the next hops (it answers ARP for them).
    let mut up = Vec::new();
    for i in 0..HOPS {
        up.push(format!("addr add {}/22 dev gw", hop(i)));
    }
    h.lab.upstream().ip_batch(&up).unwrap();
    let gw = h.lab.gateway_ns();
    gw.ip(&["route", "add", "198.19.64.0/22", "dev", out]).unwrap();
    // Entries go STALE about a second after they were last confirmed and
    // may be collected 4 s after their last use (defaults: 15-45 s, 60 s).
    for (key, value) in [("base_reachable_time_ms", "1000"), ("delay_first_probe_time", "1"), ("gc_stale_time", "4")] {
        gw.sysctl(&format!("net.ipv4.neigh.{out}.{key}"), value).unwrap();
    }

    let s = h.lab.pod(Pod::A).run_in(|| std::net::UdpSocket::bind("0.0.0.0:0")).unwrap().unwrap();
    let round = || {
        for i in 0..HOPS {
            // Nothing answers; the upstream's port unreachable errors are translated back.
            let _ = s.send_to(b"keep", SocketAddr::new(hop(i).into(), 9));
        }
    };
    // First resolution: the next hops' first frames wait (or, past the
    // worker's hold bound, are dropped counted), the kernel resolves them all.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        round();
        std::thread::sleep(Duration::from_millis(200));
        let table = gw.ip(&["-4", "neigh", "show", "dev", out]).unwrap();
        let resolved = (0..HOPS)
            .filter(|i| {
                let p = format!("{} ", hop(*i));
                table.lines().any(|l| l.starts_with(&p) && l.contains("lladdr") && !l.contains("FAILED"))
            })
            .count();
        if resolved == HOPS as usize {
            break;
        }
        assert!(Instant::now() < deadline, "the kernel resolved {resolved} of {HOPS} next hops:\n{table}");
    }
    std::thread::sleep(Duration::from_millis(300));

    let before = h.counters().unwrap();
    let start = Instant::now();
    let mut rounds = 0u64;
    while start.elapsed() < Duration::from_secs(25) {
        round();
        rounds += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    std::thread::sleep(Duration::from_millis(300));
    let after = h.counters().unwrap();
    let d = |n: &str| after.get(n) - before.get(n);
    let table = gw.ip(&["-4", "neigh", "show", "dev", out]).unwrap();
    assert_eq!(
        (d(DropReason::NeighborUnresolved.name()), d(Event::NeighborQueued.name())),
        (0, 0),
        "after the first resolution no frame met an unresolved next hop in {rounds} rounds to {HOPS}; {:?}; the gateway's neighbours:\n{table}",
        after.delta(&before)
    );
    let sent = d("forwarded");
    assert!(
        sent >= rounds * u64::from(HOPS),
        "{rounds} rounds to {HOPS} next hops, {sent} frames forwarded: {:?}",
        after.delta(&before)
    );
    let kept = (0..HOPS).filter(|i| table.lines().any(|l| l.starts_with(&format!("{} ", hop(*i))))).count();
    assert_eq!(kept, HOPS as usize, "the kernel kept every entry in use:\n{table}");
    h.finish(&[]).unwrap();
}
