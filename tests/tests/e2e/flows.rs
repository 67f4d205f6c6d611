//! Ten thousand concurrent UDP flows: 10,000 sockets across pods A, B and C
//! each send one datagram to the server's UDP echo and wait for the reply.
//! Every flow is translated to its pod's egress IP with a port of its own,
//! every reply comes back to the socket that asked, and all the sessions
//! exist at once. Datagrams are sent in waves of 256 (the rings and socket
//! buffers are finite; UDP may drop under a burst); a flow whose datagram
//! or reply was lost is retried, and the retries are reported.

use std::collections::{BTreeMap, HashSet};
use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use egret_dataplane::stats::Event;
use egret_tests::client::parse_saw;
use egret_tests::harness::Tier;
use egret_tests::lab::LabOptions;
use egret_tests::plan::Pod;

const FLOWS: usize = 10_000;
const WAVE: usize = 256;

both_tiers!(ten_thousand_concurrent_udp_flows, ten_thousand_flows);

fn ten_thousand_flows(name: &str, tier: Tier) {
    // One tier at a time: 10,000 sockets each, and the machine's cores.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    if egret_tests::sys::is_root() {
        let limit = egret_tests::sys::raise_nofile_limit(FLOWS as u64 + 4096).unwrap();
        assert!(limit as usize > FLOWS + 1000, "open-files limit {limit} too low for {FLOWS} sockets");
    }
    let Some(mut h) = crate::start_in(name, tier, LabOptions::for_test(), |_| {}) else { return };
    let before = h.counters().unwrap();
    let t0 = Instant::now();
    let pods = [Pod::A, Pod::B, Pod::C];
    let mut socks: Vec<(Pod, UdpSocket)> = Vec::with_capacity(FLOWS);
    for (i, pod) in pods.iter().enumerate() {
        let n = FLOWS / pods.len() + usize::from(i < FLOWS % pods.len());
        let to = pod.echo_endpoint();
        let v = h
            .lab
            .pod(*pod)
            .run_in(|| -> std::io::Result<Vec<UdpSocket>> {
                (0..n)
                    .map(|_| {
                        let s = UdpSocket::bind("0.0.0.0:0")?;
                        s.connect(to)?;
                        s.set_nonblocking(true)?;
                        Ok(s)
                    })
                    .collect()
            })
            .unwrap()
            .unwrap();
        socks.extend(v.into_iter().map(|s| (*pod, s)));
    }
    eprintln!("{name}: {} sockets open in {:?}", socks.len(), t0.elapsed());

    let t1 = Instant::now();
    let (seen, retries) = exchange_all(&socks, "flow");
    let elapsed = t1.elapsed();

    let mut external = HashSet::new();
    let mut per_ip: BTreeMap<String, usize> = BTreeMap::new();
    for (i, addr) in seen.iter().copied().enumerate() {
        let pod = socks[i].0;
        assert_eq!(Some(addr.ip()), pod.egress(), "flow {i} from {pod:?}");
        assert!(external.insert(addr), "flow {i}: external {addr} used twice");
        *per_ip.entry(addr.ip().to_string()).or_default() += 1;
    }
    let after = h.counters().unwrap();
    let created = after.get(Event::SessionCreatedOutbound.name()) - before.get(Event::SessionCreatedOutbound.name());
    assert!(created >= FLOWS as u64, "sessions created {created}");
    // All of them at once: no session has expired or been evicted meanwhile.
    for ev in [Event::SessionExpired, Event::SessionEvicted] {
        assert_eq!(after.get(ev.name()), before.get(ev.name()), "{ev} during the test");
    }
    // The gateway's own view: every flow is a live session, pod port to the
    // external address the server saw.
    let rows = h.gw.admin().sessions_json(4 * FLOWS).unwrap();
    let mut table = std::collections::HashMap::new();
    for r in &rows {
        let get = |k: &str| r.get(k).map(|v| v.to_string().trim_matches('"').to_string()).unwrap_or_default();
        if get("proto") == "udp" && get("remote") == "198.51.100.7" {
            table.insert((get("pod"), get("pod_port")), (get("egress"), get("egress_port")));
        }
    }
    for (i, (pod, s)) in socks.iter().enumerate() {
        let local = s.local_addr().unwrap();
        let ext = seen[i];
        assert_eq!(
            table.get(&(pod.addr().to_string(), local.port().to_string())),
            Some(&(ext.ip().to_string(), ext.port().to_string())),
            "flow {i}: `egret sessions` maps {}:{} to what the server saw",
            pod.addr(),
            local.port()
        );
    }
    eprintln!(
        "{name}: {FLOWS} flows, {retries} retried, external per IP {per_ip:?}, exchanged in {elapsed:?} ({:.0} flows/s)",
        FLOWS as f64 / elapsed.as_secs_f64()
    );

    // A second datagram on every flow, now that all are confirmed: with the
    // fast path on, all ten thousand sessions are installed in XDP first
    // and every datagram and reply is translated there.
    if tier == Tier::FastPath {
        let installed = |c: &egret_tests::gateway::Counters| c.get_path("fast_path.offloads.installed");
        h.wait_counters(Duration::from_secs(20), "every flow installed in the fast path", |c| {
            installed(c) >= installed(&before) + FLOWS as u64
        })
        .unwrap();
    }
    let mid = h.counters().unwrap();
    let t2 = Instant::now();
    let (again, retries2) = exchange_all(&socks, "again");
    assert_eq!(again, seen, "every flow kept its external address and port");
    let end = h.counters().unwrap();
    let hits = end.fast_path_hits() - mid.fast_path_hits();
    if tier == Tier::FastPath {
        // A full checksum equals the pseudo-header-only value of a partial
        // one for about 1 frame in 65536 (wire::checksum::is_partial); the
        // fast path punts those to the workers, which find them complete
        // (`checksum_looked_partial`). The lab sends no partial checksums.
        let punted = end.get_path("fast_path.packets.punt_partial_checksum")
            - mid.get_path("fast_path.packets.punt_partial_checksum");
        let looked = end.get("checksum_looked_partial") - mid.get("checksum_looked_partial");
        assert!(
            hits + punted >= 2 * FLOWS as u64 && punted <= looked,
            "second round: {hits} fast-path hits and {punted} partial-checksum punts ({looked} found complete) \
             for {FLOWS} round trips; {:?}",
            end.delta(&mid)
        );
    } else {
        assert_eq!(end.fast_path_hits(), 0);
    }
    eprintln!("{name}: second round in {:?}, {retries2} retried, {hits} fast-path hits", t2.elapsed());
    drop(socks);
    h.finish(&[]).unwrap();
}

/// One datagram `<tag>-<i>` on every socket, in waves, and its echo; up to
/// four rounds for the flows whose datagram or reply was lost. Returns the
/// source the server saw for each flow and the number of retries.
fn exchange_all(socks: &[(Pod, UdpSocket)], tag: &str) -> (Vec<SocketAddr>, usize) {
    let n_flows = socks.len();
    let mut seen: Vec<Option<SocketAddr>> = vec![None; n_flows];
    let mut retries = 0usize;
    for round in 0..4 {
        let pending: Vec<usize> = (0..n_flows).filter(|&i| seen[i].is_none()).collect();
        if pending.is_empty() {
            break;
        }
        if round > 0 {
            retries += pending.len();
        }
        for wave in pending.chunks(WAVE) {
            for &i in wave {
                socks[i].1.send(format!("{tag}-{i}").as_bytes()).unwrap();
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            let mut left: Vec<usize> = wave.to_vec();
            let mut buf = [0u8; 256];
            while !left.is_empty() && Instant::now() < deadline {
                left.retain(|&i| match socks[i].1.recv(&mut buf) {
                    Ok(n) => {
                        let text = String::from_utf8_lossy(&buf[..n]);
                        let (addr, token) = parse_saw(&text).unwrap_or_else(|| panic!("flow {i}: bad reply {text:?}"));
                        if token != format!("{tag}-{i}") {
                            // A late reply of an earlier round of this flow: wait on.
                            assert!(token.ends_with(&format!("-{i}")), "flow {i} got another flow's reply: {token}");
                            return true;
                        }
                        seen[i] = Some(addr);
                        false
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => true,
                    Err(e) => panic!("flow {i}: {e}"),
                });
                if !left.is_empty() {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    let missing = seen.iter().filter(|s| s.is_none()).count();
    assert_eq!(missing, 0, "{tag}: {missing} of {n_flows} flows never came back (after {retries} retries)");
    (seen.into_iter().flatten().collect(), retries)
}
