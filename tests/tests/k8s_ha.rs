//! High availability in the three-gateway Kubernetes lab (issue 16,
//! "Tests"; docs/kubernetes.md, "High availability: measured").
//!
//! The lab (`K8sLab::build_with(.., &Gw::ALL)`): a real kube-apiserver +
//! etcd in the control namespace, three real `egret gateway` processes in
//! Kubernetes mode (nodes `gw-1`, `gw-2`, `gw-3`, default Lease timing,
//! `nat.filtering: endpoint-independent`), one EgressPolicy with one egress
//! IP selecting pod `db`, whose traffic the node router sends to that IP as
//! next hop.
//!
//! Each event runs under fresh load started before it (`egret_tests::load`:
//! new TCP connections back to back, a paced download from the server, a
//! UDP flow in which only the server sends, an inbound flow from a second
//! server address to the pod's endpoint-independent mapping), with an ARP
//! watch on the upstream router's link asking who has the egress IP every
//! 20 ms. Events: `sigkill` (the IP's holder, from its Lease), `cutoff` (the
//! holder's ports taken off both bridges, then put back), `api-down-all`
//! (the API server stopped for `EGRET_HA_API_OUTAGE_SECS`, default 60),
//! `api-cut-holder`, `peers-cut-holder`, `both-cut-holder` (nftables in the
//! holder's namespace dropping its traffic to the API server, to its peers'
//! HA port 4720, or both), `drain` (`egret drain` of the holder),
//! `rolling-restart` (SIGTERM each gateway in turn, wait until it is ready
//! again), `abort-holder` / `abort-taker` (`ss -K` of every channel socket
//! in the holder's namespace, or in the other gateways', as a host
//! firewall flush or a kernel socket abort would: issue 28 §1),
//! `abort-repeat` (the same every 0.3 s for 10 s, alternately on the holder
//! and on the others). Each prints one line
//! `k8s-ha: event=.. server_outage_ms=.. pod_outage_ms=.. conns_kept=a/b
//! bytes_lost=.. udp_lost=.. eim_lost=.. double_owner=..`.
//!
//! Before the events, one forged ARP reply for the egress IP from a MAC no
//! gateway has must be counted as a double owner (the watch can see one).
//! Always asserted: no double owner (no ARP request answered by two MACs,
//! no X, Y, X within 1 s) and no pod address outside (the ARP watch checks
//! every frame on the upstream link; the server side records every source).
//! Always asserted too: new connections work again within 20-30 s of each
//! event's end. Asserted when `EGRET_HA_EXPECT` is not `0` (issue 16's
//! "Done means", issue 28 §5: every row docs/kubernetes.md states;
//! `EGRET_HA_CONFIG=0 EGRET_HA_EXPECT=0` measures the gateways without the
//! channel, the baseline before issue 16): every event keeps every
//! long-lived flow with no download byte lost; SIGKILL is taken over early
//! (the new Lease's acquireTime precedes the killed holder's last sign of
//! life, its renewTime or, when failsafe promises kept it, two retry
//! periods before the kill, plus leaseDuration: proof, without a timing
//! bound, that the take-over did not wait for the expiry; ≤ 1 s from both sides only with
//! `EGRET_HA_EXPECT_TIMES=1`); an API-server outage, a holder cut off from
//! the API server only or from its peers only, and aborted channel sockets
//! cost nothing (no new connection fails, no datagram lost, the IP does not
//! move); a cut-off, a drain and a rolling restart move the IP at most
//! once (a rolling restart twice when it restarts the holder first: its
//! taker is restarted later). Each gateway runs
//! with `kubernetes.ha` (port 4720 on its management address, a key file in
//! the lab's directory) unless `EGRET_HA_CONFIG=0`.
//! `EGRET_HA_EVENTS=sigkill,cutoff` runs only those.
//!
//! ```text
//! sudo cargo test -p egret-tests --test k8s_ha --locked -- --nocapture
//! ```

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

mod k8s_common;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use egret_tests::apiserver::ApiServer;
use egret_tests::env_flag;
use egret_tests::frames::RawLink;
use egret_tests::gateway::Gateway;
use egret_tests::k8slab::{Gw, K8sLab, KPod, CONTROL, UPSTREAM};
use egret_tests::load::{ArpWatch, Load, Outage};
use egret_tests::netns::NetNs;
use egret_tests::plan;
use egret_tests::probe;
use k8s_common::*;

const NAME: &str = "k8s_ha_three_gateways_under_load";
/// The policy's egress IP.
const EIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 40);
/// The HA channel's port (the lead's peer channel, on the mgmt addresses).
const HA_PORT: u16 = 4720;
/// How long a cut lasts: well past the Lease's duration (4 s).
const CUT: Duration = Duration::from_secs(15);
/// The gateways' `kubernetes.retryPeriod` (the default: the lab sets none).
const RETRY_PERIOD_MS: i64 = 500;
/// Time for the load to settle before an event and after its recovery.
const BEFORE: Duration = Duration::from_secs(2);
const AFTER: Duration = Duration::from_secs(4);
/// The events in order.
const EVENTS: [&str; 12] = [
    "abort-holder",
    "abort-taker",
    "abort-repeat",
    // Before sigkill: its early take-over with every flow kept then runs
    // over a channel under the new key.
    "key-roll",
    "sigkill",
    "cutoff",
    "api-down-all",
    "api-cut-holder",
    "peers-cut-holder",
    "both-cut-holder",
    "drain",
    "rolling-restart",
];

/// Events run only when named in `EGRET_HA_EVENTS`.
const OPT_IN: [&str; 1] = [
    // Issue 16 §4's last cell: the API server down for everyone, and a
    // gateway other than the holder restarts during the outage.
    "api-down-peer-restart",
];

/// Whether the HA features' assertions are on (`EGRET_HA_EXPECT`, default on).
fn ha_expect() -> bool {
    env_flag("EGRET_HA_EXPECT", true)
}

fn api_outage() -> Duration {
    let secs = std::env::var("EGRET_HA_API_OUTAGE_SECS").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(60);
    Duration::from_secs(secs)
}

fn selected_events() -> Vec<&'static str> {
    match std::env::var("EGRET_HA_EVENTS") {
        Ok(list) if !list.trim().is_empty() => {
            let want: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
            for w in &want {
                assert!(
                    EVENTS.contains(&w.as_str()) || OPT_IN.contains(&w.as_str()),
                    "EGRET_HA_EVENTS: unknown event {w:?} (known: {EVENTS:?}, {OPT_IN:?})"
                );
            }
            EVENTS.into_iter().chain(OPT_IN).filter(|e| want.iter().any(|w| w == e)).collect()
        }
        _ => EVENTS.to_vec(),
    }
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

#[test]
fn k8s_ha_three_gateways_under_load() {
    run_in_k8s_lab("k8s-ha", NAME, &Gw::ALL, scenario);
}

/// One event's numbers.
struct Row {
    event: &'static str,
    holder: Gw,
    after: Option<Gw>,
    o: Outage,
    double_owner: usize,
    /// How many times the IP's ARP answers changed MAC during the load.
    moves: usize,
    /// Whether a new connection succeeded after the event.
    recovered: bool,
    /// sigkill: whether the new Lease was acquired before the killed
    /// holder's last renewal + leaseDuration (None: not measured).
    early: Option<bool>,
}

impl Row {
    fn line(&self) -> String {
        let o = &self.o;
        format!(
            "k8s-ha: event={} server_outage_ms={} pod_outage_ms={} conns_kept={}/3 bytes_lost={} udp_lost={} eim_lost={} double_owner={} download_stall_ms={} udp_gap_ms={} (ended {}) eim_gap_ms={} churn_failed={}/{} ip_moves={} holder={}->{} download_end={:?}",
            self.event,
            o.server_ms,
            o.pod_ms,
            o.kept,
            o.bytes_lost,
            o.udp_lost,
            o.eim_lost,
            self.double_owner,
            o.download_stall_ms,
            o.udp_gap_ms,
            o.udp_gap_ended.map_or_else(|| "-".to_string(), wall),
            o.eim_gap_ms,
            o.churn_failed,
            o.churn_total,
            self.moves,
            self.holder.node_name(),
            self.after.map_or("none", |g| g.node_name()),
            o.download_died.as_deref().unwrap_or("open"),
        )
    }
}

struct Ctx<'a> {
    lab: &'a K8sLab,
    server: &'a ApiServer,
    rt: tokio::runtime::Runtime,
    client: kube::Client,
    gws: BTreeMap<Gw, Gateway>,
    api_port: u16,
    /// The gateways' key directories (None: `EGRET_HA_CONFIG=0`).
    keys: Option<KeyDirs>,
}

/// Each gateway's channel keys as the kubelet projects a Secret into a pod:
/// `ha-<node>/keys` is a symlink to a versioned directory, replaced by an
/// atomic rename, so each change is read whole.
struct KeyDirs {
    root: std::path::PathBuf,
    version: usize,
    /// The key every gateway has as its primary.
    current: [u8; 32],
}

impl KeyDirs {
    fn new(root: &std::path::Path) -> KeyDirs {
        let mut k = KeyDirs { root: root.to_owned(), version: 0, current: random_ha_key() };
        let key = k.current;
        for g in Gw::ALL {
            std::fs::create_dir_all(k.dir(g)).expect("a gateway's key directory");
            k.write(g, &[("key", &key)]);
        }
        k
    }

    fn dir(&self, g: Gw) -> std::path::PathBuf {
        self.root.join(format!("ha-{}", g.node_name()))
    }

    /// The primary key's path in `g`'s configuration.
    fn key_file(&self, g: Gw) -> std::path::PathBuf {
        self.dir(g).join("keys").join("key")
    }

    /// Replaces `g`'s key files with `files`, at once.
    fn write(&mut self, g: Gw, files: &[(&str, &[u8; 32])]) {
        self.version += 1;
        let dir = self.dir(g);
        let version = format!("keys.{}", self.version);
        std::fs::create_dir(dir.join(&version)).expect("a key version directory");
        for (name, key) in files {
            write_ha_key_bytes(&dir.join(&version).join(name), &key[..]);
        }
        let tmp = dir.join("keys.tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&version, &tmp).expect("the new keys' symlink");
        std::fs::rename(&tmp, dir.join("keys")).expect("swap the keys' symlink");
    }
}

/// A key's id as `egret status` shows it.
fn key_id(key: &[u8; 32]) -> String {
    egret_controlplane::ha::auth::SharedKey::from_bytes(std::path::Path::new("key"), key)
        .expect("a key")
        .id()
        .to_string()
}

fn scenario(lab: &K8sLab, server: &ApiServer) {
    let _keep = KeepLogs(lab, server);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(server.client()).expect("client");
    lab.route_pod_via(KPod::Db, EIP, 111).expect("route db via the policy's IP");
    let token = rt.block_on(ha_lab_cluster(&client, EIP));
    let kubeconfig = lab.dir().join("gateway.kubeconfig");
    write_token_kubeconfig(server.kubeconfig_path(), "egret-gateway", &token, &kubeconfig);
    let api_port = api_port(server);

    let keys = env_flag("EGRET_HA_CONFIG", true).then(|| KeyDirs::new(lab.dir()));
    let ha_block = |g: Gw| keys.as_ref().map_or_else(String::new, |k| ha_section(lab, g, &k.key_file(g), HA_PORT));
    let mut gws = BTreeMap::new();
    for g in Gw::ALL {
        let mut cfg = lab_gateway_config(g, &kubeconfig, ha_block(g));
        // Endpoint-independent filtering, for the inbound flow; inbound
        // datagrams refresh a UDP mapping (the flows here only receive, and
        // the longest outage, 600 s, is past the 300 s UDP timeout).
        cfg.extra = "nat:\n  filtering: endpoint-independent\n  udpInboundRefresh: true\n".into();
        let gw = Gateway::spawn_in(lab.gateway_ns(g), lab.dir(), g.node_name(), &cfg).expect("start egret");
        gws.insert(g, gw);
    }
    for gw in gws.values_mut() {
        gw.wait_ready(Duration::from_secs(30)).expect("egret ready");
    }
    let mut ctx = Ctx { lab, server, rt, client, gws, api_port, keys };
    let http = SocketAddr::new(plan::SERVER.into(), plan::HTTP_PORT);
    let seen = probe::wait_source(lab.pod(KPod::Db), http, EIP.into(), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("db never left with {EIP}: {e}"))
        .0;
    println!("k8s-ha: steady state: db leaves as {seen}");

    let watch = ArpWatch::start(
        lab.upstream(),
        "lan0",
        (plan::UP_MAC, UPSTREAM),
        &[EIP],
        &Gw::ALL.map(Gw::mac),
        "198.18.0.0/16".parse().unwrap(),
    )
    .expect("the ARP watch");
    self_check(lab, &watch);

    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for event in selected_events() {
        let row = run_event(&mut ctx, &watch, event);
        println!("{}", row.line());
        check(&row, &mut failures);
        rows.push(row);
    }
    let (leak_count, leak_shown) = watch.leaks();
    watch.stop().expect("stop the ARP watch");
    let journal_leaks: Vec<String> = lab
        .server()
        .map(|s| s.seen())
        .unwrap_or_default()
        .into_iter()
        .filter(|s| s.src.ip() == IpAddr::V4(KPod::Db.addr()))
        .map(|s| s.to_string())
        .collect();

    println!("k8s-ha: | event | server outage ms | pod outage ms | conns kept | bytes lost | UDP lost | inbound lost | double owner | download stall ms | UDP gap ms | inbound gap ms | churn failed | IP moves | holder |");
    for r in &rows {
        let o = &r.o;
        println!(
            "k8s-ha: | {} | {} | {} | {}/3 | {} | {} | {} | {} | {} | {} | {} | {}/{} | {} | {} -> {} |",
            r.event,
            o.server_ms,
            o.pod_ms,
            o.kept,
            o.bytes_lost,
            o.udp_lost,
            o.eim_lost,
            r.double_owner,
            o.download_stall_ms,
            o.udp_gap_ms,
            o.eim_gap_ms,
            o.churn_failed,
            o.churn_total,
            r.moves,
            r.holder.node_name(),
            r.after.map_or("none", |g| g.node_name())
        );
    }
    for gw in ctx.gws.values_mut() {
        let _ = gw.terminate();
    }
    assert_eq!(leak_count, 0, "frames with the pod's address on the upstream link: {leak_shown:?}");
    assert!(journal_leaks.is_empty(), "the server saw the pod's own address: {journal_leaks:?}");
    assert!(failures.is_empty(), "{} failed expectations:\n{}", failures.len(), failures.join("\n"));
}

/// The assertions: always no double owner, no leak and recovery; with
/// `EGRET_HA_EXPECT` the HA features' bounds.
fn check(r: &Row, failures: &mut Vec<String>) {
    let mut fail = |what: String| failures.push(format!("{}: {what}", r.event));
    if r.double_owner != 0 {
        fail(format!("{} double-owner moments", r.double_owner));
    }
    if !r.recovered {
        fail("no new connection succeeded after the event".into());
    }
    if !ha_expect() {
        return;
    }
    let o = &r.o;
    let kept_all = |fail: &mut dyn FnMut(String)| {
        if o.kept != 3 {
            fail(format!("{}/3 long-lived flows kept", o.kept));
        }
        if o.bytes_lost != 0 {
            fail(format!("{} download bytes lost", o.bytes_lost));
        }
    };
    match r.event {
        "sigkill" => {
            // Issue 16: ≤ 1 s from the kill to traffic flowing, both
            // directions, and no connection lost. The time is a target for
            // the documented run (`EGRET_HA_EXPECT_TIMES=1`), not a timed
            // assertion in CI on a shared machine; the flows kept are.
            let times = if egret_tests::expect_times() { 1000 } else { u64::MAX };
            for (what, v) in [
                ("server-side outage", o.server_ms),
                ("pod-side outage", o.pod_ms),
                ("download stall", o.download_stall_ms),
                ("UDP-replies gap", o.udp_gap_ms),
                ("inbound gap", o.eim_gap_ms),
            ] {
                if v > times {
                    fail(format!("{what} {v} ms > {times} ms"));
                }
            }
            kept_all(&mut fail);
            // Issue 28 §5: the early take-over, proven without a clock bound.
            match r.early {
                Some(true) => {}
                Some(false) => fail("the new Lease was acquired only after the killed holder's Lease expired".into()),
                None => fail("the Leases before and after the kill could not be read".into()),
            }
        }
        // An API-server outage for everyone costs nothing; a holder cut off
        // from the API server only (its peers acknowledge it) or from its
        // peers only (the Lease still renews) keeps serving; channel sockets
        // aborted on a node prove no death (issue 28 §1).
        // A key roll (issue 28 §3) moves nothing and loses nothing either.
        "api-down-all" | "api-cut-holder" | "peers-cut-holder" | "abort-holder" | "abort-taker" | "abort-repeat"
        | "key-roll" => {
            if o.churn_failed != 0 {
                let when: Vec<String> = o.churn_failures.iter().map(|(at, e)| format!("{}: {e}", wall(*at))).collect();
                fail(format!("{}/{} new connections failed ({})", o.churn_failed, o.churn_total, when.join("; ")));
            }
            kept_all(&mut fail);
            if o.udp_lost != 0 || o.eim_lost != 0 {
                fail(format!("datagrams lost: UDP replies {}, inbound {}", o.udp_lost, o.eim_lost));
            }
            if r.moves != 0 || r.after != Some(r.holder) {
                fail(format!(
                    "the IP moved {} times ({} -> {})",
                    r.moves,
                    r.holder.node_name(),
                    r.after.map_or("none", |g| g.node_name())
                ));
            }
        }
        // A holder cut off from everything is taken over at its Lease's
        // expiry by the standby with its copy; a drain hands the IP over
        // with its sessions. Every long-lived flow survives each.
        "cutoff" | "both-cut-holder" | "drain" => {
            kept_all(&mut fail);
            if r.moves > 1 {
                fail(format!("the IP moved {} times", r.moves));
            }
        }
        // A rolling update moves each IP once (issue 16 §5) to a gateway
        // already restarted, which keeps it; unless the holder is restarted
        // first: no gateway has been restarted yet, so its taker is
        // restarted later and the IP moves a second time.
        "rolling-restart" => {
            kept_all(&mut fail);
            let allowed = if r.holder == Gw::ALL[0] { 2 } else { 1 };
            if r.moves > allowed {
                fail(format!(
                    "the IP moved {} times (at most {allowed} with {} restarted {})",
                    r.moves,
                    r.holder.node_name(),
                    if allowed == 1 { "after another gateway" } else { "first" }
                ));
            }
        }
        _ => {}
    }
}

fn run_event(ctx: &mut Ctx, watch: &ArpWatch, event: &'static str) -> Row {
    let lab = ctx.lab;
    let holder = wait_holder(ctx, Duration::from_secs(30));
    println!("k8s-ha: {event}: {EIP} held by {}", holder.node_name());
    let load = Load::start(lab.pod(KPod::Db), lab.server_ns()).expect("start the load");
    std::thread::sleep(BEFORE);
    let t_event = Instant::now();
    // What to undo once the load is stopped.
    let mut restart_after: Option<Gw> = None;
    let mut early = None;
    let recovered = match event {
        "sigkill" => {
            let before = ctx.rt.block_on(holder_lapse(&ctx.client, IpAddr::V4(EIP)));
            let killed_at = k8s_openapi::jiff::Timestamp::now().as_millisecond();
            ctx.gws.get_mut(&holder).unwrap().kill().expect("SIGKILL the holder");
            let ok = wait_recovered(&load, t_event, Duration::from_secs(20));
            restart_after = Some(holder);
            early = taken_early(ctx, holder, before, killed_at);
            ok
        }
        "abort-holder" | "abort-taker" => {
            let on: Vec<Gw> = if event == "abort-holder" {
                vec![holder]
            } else {
                Gw::ALL.into_iter().filter(|g| *g != holder).collect()
            };
            let killed: usize = on.into_iter().map(|g| abort_channel(lab.gateway_ns(g))).sum();
            println!("k8s-ha: {event}: ss -K killed {killed} channel sockets");
            assert!(killed > 0, "{event}: ss -K found no channel socket to kill: the event would prove nothing");
            std::thread::sleep(Duration::from_secs(5));
            wait_recovered(&load, Instant::now(), Duration::from_secs(20))
        }
        "abort-repeat" => {
            let start = Instant::now();
            let (mut i, mut killed) = (0usize, 0usize);
            while start.elapsed() < Duration::from_secs(10) {
                if i % 2 == 0 {
                    killed += abort_channel(lab.gateway_ns(holder));
                } else {
                    for g in Gw::ALL.into_iter().filter(|g| *g != holder) {
                        killed += abort_channel(lab.gateway_ns(g));
                    }
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(300));
            }
            println!("k8s-ha: {event}: {i} rounds of ss -K killed {killed} channel sockets");
            assert!(
                killed >= i,
                "{event}: {killed} sockets killed in {i} rounds: the channel did not come back between them"
            );
            wait_recovered(&load, Instant::now(), Duration::from_secs(20))
        }
        "key-roll" => {
            key_roll(ctx);
            wait_recovered(&load, Instant::now(), Duration::from_secs(20))
        }
        "cutoff" => {
            let role = holder.role();
            lab.lan().ip_batch(&[format!("link set dev p-{role} nomaster")]).expect("cut the holder's segment port");
            lab.control().ip_batch(&[format!("link set dev m-{role} nomaster")]).expect("cut the holder's mgmt port");
            std::thread::sleep(CUT);
            lab.lan().ip_batch(&[format!("link set dev p-{role} master lan")]).expect("restore the segment port");
            lab.control().ip_batch(&[format!("link set dev m-{role} master mgmt")]).expect("restore the mgmt port");
            wait_recovered(&load, Instant::now(), Duration::from_secs(20))
        }
        "api-down-all" => {
            ctx.server.kill_apiserver_blocking().expect("stop the API server");
            let now = k8s_openapi::jiff::Timestamp::now;
            println!("k8s-ha: API server down for {} s from {}", api_outage().as_secs(), now());
            std::thread::sleep(api_outage());
            println!("k8s-ha: API server restarting at {}", now());
            ctx.server.restart_apiserver_blocking().expect("restart the API server");
            println!("k8s-ha: API server ready at {}", now());
            wait_recovered(&load, Instant::now(), Duration::from_secs(30))
        }
        "api-down-peer-restart" => {
            let peer = Gw::ALL.into_iter().find(|g| *g != holder).unwrap();
            ctx.server.kill_apiserver_blocking().expect("stop the API server");
            std::thread::sleep(Duration::from_secs(5));
            let gw = ctx.gws.get_mut(&peer).unwrap();
            let t = Instant::now();
            gw.terminate().expect("SIGTERM a peer");
            gw.start_again().expect("start the peer again");
            println!(
                "k8s-ha: {event}: {} restarted during the outage ({} ms to exec)",
                peer.node_name(),
                ms(t.elapsed())
            );
            std::thread::sleep(api_outage().saturating_sub(Duration::from_secs(5)));
            ctx.server.restart_apiserver_blocking().expect("restart the API server");
            ctx.gws.get_mut(&peer).unwrap().wait_ready(Duration::from_secs(60)).expect("the restarted peer ready");
            wait_recovered(&load, Instant::now(), Duration::from_secs(30))
        }
        "api-cut-holder" | "peers-cut-holder" | "both-cut-holder" => {
            let ns = lab.gateway_ns(holder);
            let api = event != "peers-cut-holder";
            let peers = event != "api-cut-holder";
            cut(ns, lab.dir(), holder, ctx.api_port, api, peers);
            std::thread::sleep(CUT);
            uncut(ns);
            wait_recovered(&load, Instant::now(), Duration::from_secs(20))
        }
        "drain" => {
            // `egret drain` as an operator runs it: the real binary, the
            // cluster admin's kubeconfig.
            let bin = egret_tests::gateway::egret_binary().expect("egret binary");
            let kc = ctx.server.kubeconfig_path().display().to_string();
            // Wall-clock stamps, to set beside the gateways' logs: beside
            // hogs the 20 s below can go to the CLI's retries, the drained
            // gateway's Node watch, or this test's own Lease reads.
            let asked = k8s_openapi::jiff::Timestamp::now();
            let out = lab.control().exec(&[bin.to_str().unwrap(), "drain", holder.node_name(), "--kubeconfig", &kc]);
            out.expect("egret drain");
            let t_drain = Instant::now();
            println!("k8s-ha: drain: egret drain ran from {asked} to {}", k8s_openapi::jiff::Timestamp::now());
            loop {
                let h = wait_holder(ctx, Duration::from_secs(30));
                if h != holder {
                    println!(
                        "k8s-ha: drain: {} took {EIP} {} ms after egret drain",
                        h.node_name(),
                        ms(t_drain.elapsed())
                    );
                    break;
                }
                assert!(
                    t_drain.elapsed() < Duration::from_secs(20),
                    "drain: {EIP} did not move (still {} at {})",
                    h.node_name(),
                    k8s_openapi::jiff::Timestamp::now()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            let ok = wait_recovered(&load, Instant::now(), Duration::from_secs(20));
            lab.control()
                .exec(&[bin.to_str().unwrap(), "drain", holder.node_name(), "--undo", "--kubeconfig", &kc])
                .expect("egret drain --undo");
            ok
        }
        "rolling-restart" => {
            for g in Gw::ALL {
                let gw = ctx.gws.get_mut(&g).unwrap();
                let t = Instant::now();
                gw.terminate().expect("SIGTERM a gateway");
                gw.restart().expect("start it again");
                println!("k8s-ha: rolling restart: {} back in {} ms", g.node_name(), ms(t.elapsed()));
            }
            wait_recovered(&load, Instant::now(), Duration::from_secs(20))
        }
        other => panic!("unknown event {other}"),
    };
    std::thread::sleep(AFTER);
    let report = load.stop().expect("stop the load");
    let leaked = report.leaked(&[KPod::Db.addr()]);
    assert!(leaked.is_empty(), "{event}: the server saw the pod's own address: {leaked:?}");
    let doubles = watch.double_owners(report.started, report.stopped);
    let moves = watch.owners(EIP, report.started, report.stopped).len().saturating_sub(1);
    for d in &doubles {
        println!("k8s-ha: {event}: double owner {} {:02x?} {}", d.ip, d.macs, d.kind);
    }
    if let Some(g) = restart_after {
        ctx.gws.get_mut(&g).unwrap().restart().expect("restart the killed gateway");
    }
    let after = lease_holder(ctx);
    println!("k8s-ha: {event}: event took {} ms", ms(t_event.elapsed()));
    Row { event, holder, after, o: report.outage(), double_owner: doubles.len(), moves, recovered, early }
}

/// A roll of the channel key in three steps (docs/operations.md, "Rotating
/// the channel key"), each reaching the gateways one after the other, as a
/// Secret's update reaches pods: the new key accepted, then primary with
/// the old one accepted, then alone. Waits after each step until every
/// gateway holds the step's keys, and at the end until every channel runs
/// under the new key.
fn key_roll(ctx: &mut Ctx) {
    let Some(keys) = ctx.keys.as_mut() else {
        println!("k8s-ha: key-roll: no channel (EGRET_HA_CONFIG=0): nothing to roll");
        return;
    };
    let (old, new) = (keys.current, random_ha_key());
    let (old_id, new_id) = (key_id(&old), key_id(&new));
    println!("k8s-ha: key-roll: from key {old_id} to {new_id}");
    let steps = [
        ("1 (the new key accepted)", vec![("key", &old), ("next", &new)], vec![&old_id, &new_id]),
        ("2 (the new key primary)", vec![("key", &new), ("previous", &old)], vec![&new_id, &old_id]),
        ("3 (the old key removed)", vec![("key", &new)], vec![&new_id]),
    ];
    for (what, files, want) in steps {
        let t = Instant::now();
        for g in Gw::ALL {
            keys.write(g, &files);
            std::thread::sleep(Duration::from_millis(700));
        }
        wait_gateways(&ctx.gws, &format!("key-roll: step {what}"), |s| {
            let held: Vec<&str> = s["cluster"]["channel_keys"]
                .as_array()
                .map(|a| a.iter().filter_map(|k| k.as_str()).collect())
                .unwrap_or_default();
            held == want.iter().map(|s| s.as_str()).collect::<Vec<_>>()
        });
        println!("k8s-ha: key-roll: step {what}: every gateway holds {want:?} {} ms after the first", ms(t.elapsed()));
    }
    keys.current = new;
    let t = Instant::now();
    wait_gateways(&ctx.gws, "key-roll: every channel up under the new key", |s| {
        s["cluster"]["peers"].as_array().is_some_and(|peers| {
            peers.len() == Gw::ALL.len() - 1
                && peers.iter().all(|p| p["state"] == "up" && p["key"].as_str() == Some(new_id.as_str()))
        })
    });
    println!("k8s-ha: key-roll: every channel up under {new_id} {} ms after step 3", ms(t.elapsed()));
}

/// Polls every gateway's `egret status --json` until `ok` holds for all
/// (30 s at most, then fails showing the last status).
fn wait_gateways(gws: &BTreeMap<Gw, Gateway>, what: &str, ok: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let statuses: Vec<serde_json::Value> =
            gws.values().map(|g| g.admin().status().unwrap_or(serde_json::Value::Null)).collect();
        if statuses.iter().all(&ok) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: not reached in 30 s; statuses: {statuses:#?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether the Lease was taken over before the killed holder's claim could
/// have lapsed: the new holder's acquireTime precedes the holder's last
/// sign of life + leaseDuration. That sign is the renewTime read before
/// the kill (of the IP's Lease, or with liveness Leases of the holder's
/// liveness Lease: `holder_lapse`; the last renewal the killed process made
/// is no earlier), or, when its renewals were not landing and failsafe
/// promises kept it (a starved API server: its renewTime then lags by
/// seconds), the last promise, given no earlier than two retry periods
/// before the kill (rounds run every ¾ retryPeriod). A taker without a
/// proof of death waits for both. None when a Lease could not be read or
/// nobody took it.
fn taken_early(ctx: &Ctx, killed: Gw, before: Option<Lapse>, killed_at_ms: i64) -> Option<bool> {
    let before = before?;
    let renewed = before.renewed_ms;
    let promised = killed_at_ms - 2 * RETRY_PERIOD_MS;
    let duration = before.duration_ms;
    let whose = if before.liveness { "liveness Lease" } else { "Lease" };
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let spec = ctx.rt.block_on(lease_spec(&ctx.client, IpAddr::V4(EIP)))?;
        if spec.holder_identity.as_deref().is_some_and(|h| !h.is_empty() && h != killed.node_name()) {
            break spec;
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let acquired = after.acquire_time?.0.as_millisecond();
    println!(
        "k8s-ha: sigkill: {} acquired {EIP} {} ms after {}'s last renewal seen ({whose}), {} ms after the kill (its {whose} would lapse at +{} ms after the later of that renewal and two retry periods before the kill)",
        after.holder_identity.as_deref().unwrap_or("?"),
        acquired - renewed,
        killed.node_name(),
        acquired - killed_at_ms,
        duration
    );
    Some(acquired < renewed.max(promised) + duration)
}

/// `ss -K` of every socket of the peer channel in `ns` (its port either
/// side): a signed RST goes to each peer, the local side sees an abort.
/// Returns how many sockets it killed (ss lists each, under a header).
fn abort_channel(ns: &NetNs) -> usize {
    let port = format!(":{HA_PORT}");
    let out = ns
        .exec(&["ss", "-K", "-t", "-n", "(", "sport", "=", &port, "or", "dport", "=", &port, ")"])
        .expect("ss -K the channel's sockets");
    out.lines().filter(|l| l.contains(&port)).count()
}

/// The ARP watch can see a double owner in this lab: a reply for the
/// egress IP from a MAC no gateway has, sent from the node router's link
/// between the watch's requests, is counted. The upstream router's kernel
/// may take the forged MAC; the holder's next answers to the watch put its
/// own back, and the neighbour entry is flushed besides.
fn self_check(lab: &K8sLab, watch: &ArpWatch) {
    const FORGED: [u8; 6] = [0x02, 0xe9, 0, 0, 0x01, 0x99];
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let mut f = Vec::with_capacity(42);
    f.extend_from_slice(&plan::UP_MAC);
    f.extend_from_slice(&FORGED);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0x00, 6, 4, 0, 2]);
    f.extend_from_slice(&FORGED);
    f.extend_from_slice(&EIP.octets());
    f.extend_from_slice(&plan::UP_MAC);
    f.extend_from_slice(&UPSTREAM.octets());
    let link = RawLink::open(lab.node(), "lan0").expect("a raw socket on the node router's link");
    link.send(&f).expect("send the forged ARP reply");
    // The watch hands over what it saw once per request round and needs
    // the holder's next answer after the forged one (X, Y, X): on a busy
    // machine its thread runs late, so wait for it, within a bound.
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while seen.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        seen = watch.double_owners(t0, Instant::now());
    }
    println!("k8s-ha: self-check: one forged ARP reply for {EIP} counted as {} double-owner moments", seen.len());
    assert!(!seen.is_empty(), "the ARP watch missed a forged second owner of {EIP}");
    let _ = lab.upstream().ip(&["neigh", "flush", "dev", "lan0", "to", &EIP.to_string()]);
    let _ = lab.node().ip(&["neigh", "flush", "dev", "lan0", "to", &EIP.to_string()]);
    std::thread::sleep(Duration::from_secs(1));
}

/// Waits until a churn connection started after `after` succeeds (or
/// `timeout`); says whether one did.
/// `t` as RFC 3339 UTC, as the gateways' logs print it.
fn wall(t: std::time::SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t).map_or_else(|_| "?".into(), |t| t.to_string())
}

fn wait_recovered(load: &Load, after: Instant, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if load.churn().iter().any(|a| a.started >= after && a.outcome.is_ok()) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("k8s-ha: no new connection succeeded within {} ms", ms(timeout));
    false
}

/// The nftables table that cuts the holder off: its traffic to and from
/// the API server (`api`) and to and from its peers' HA port (`peers`).
/// The management link is not XDP's: the kernel's hooks see all of it.
fn cut(ns: &NetNs, dir: &std::path::Path, holder: Gw, api_port: u16, api: bool, peers: bool) {
    let mut out = Vec::new();
    let mut inp = Vec::new();
    if api {
        out.push(format!("ip daddr {CONTROL} tcp dport {api_port} drop"));
        inp.push(format!("ip saddr {CONTROL} tcp sport {api_port} drop"));
    }
    if peers {
        for g in Gw::ALL.into_iter().filter(|g| *g != holder) {
            let m = g.mgmt_addr();
            out.push(format!("ip daddr {m} tcp dport {HA_PORT} drop"));
            out.push(format!("ip daddr {m} tcp sport {HA_PORT} drop"));
            inp.push(format!("ip saddr {m} tcp dport {HA_PORT} drop"));
            inp.push(format!("ip saddr {m} tcp sport {HA_PORT} drop"));
        }
    }
    let rules = format!(
        "table inet egret_ha_cut {{\n  chain out {{\n    type filter hook output priority 0; policy accept;\n    {}\n  }}\n  chain in {{\n    type filter hook input priority 0; policy accept;\n    {}\n  }}\n}}\n",
        out.join("\n    "),
        inp.join("\n    ")
    );
    let file = dir.join("ha-cut.nft");
    std::fs::write(&file, rules).expect("write the cut's rules");
    ns.exec(&["nft", "-f", &file.to_string_lossy()]).expect("nft: cut the holder off");
}

fn uncut(ns: &NetNs) {
    ns.exec(&["nft", "delete", "table", "inet", "egret_ha_cut"]).expect("nft: remove the cut");
}

/// The API server's port, from the admin kubeconfig (`server: https://a:p`).
fn api_port(server: &ApiServer) -> u16 {
    let text = std::fs::read_to_string(server.kubeconfig_path()).expect("read the kubeconfig");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("server: "))
        .and_then(|u| u.trim().rsplit(':').next())
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("the API server's port in the kubeconfig")
}

fn lease_holder(ctx: &Ctx) -> Option<Gw> {
    ctx.rt.block_on(lease_holder_name(&ctx.client, IpAddr::V4(EIP))).and_then(|h| Gw::by_node_name(&h))
}

fn wait_holder(ctx: &Ctx, timeout: Duration) -> Gw {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(g) = lease_holder(ctx) {
            return g;
        }
        assert!(Instant::now() < deadline, "{EIP} has no holder after {} ms", ms(timeout));
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Keeps the gateways' logs when the test fails, or always with
/// `EGRET_KEEP_LOGS=1` (the lab's directory goes with the lab).
struct KeepLogs<'a>(&'a K8sLab, &'a ApiServer);

impl Drop for KeepLogs<'_> {
    fn drop(&mut self) {
        if !std::thread::panicking() && std::env::var_os("EGRET_KEEP_LOGS").is_none() {
            return;
        }
        let dir = std::env::var_os("EGRET_E2E_ARTIFACTS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("egret-e2e-artifacts"));
        let _ = std::fs::create_dir_all(&dir);
        for g in Gw::ALL {
            let _ = std::fs::copy(
                self.0.dir().join(format!("{}.log", g.node_name())),
                dir.join(format!("{NAME}.{}.log", g.node_name())),
            );
        }
        // The control plane's own logs: slow requests (the API server's
        // traces, etcd's "took too long") explain slow renewals.
        if let Some(state) = self.1.state_dir() {
            for f in ["apiserver.log", "etcd.log"] {
                let _ = std::fs::copy(state.join(f), dir.join(format!("{NAME}.{f}")));
            }
        }
        eprintln!("{NAME}: artifacts in {}", dir.display());
    }
}
