//! The gateway node image (deploy/images/node/) booted from its disk under
//! QEMU (software emulation, the BIOS boots extlinux from the MBR), with
//! its configuration on a config drive and two virtio-net NICs on tap
//! devices: eth0 towards a pod namespace, eth1 towards a server namespace.
//!
//! Checks, from the serial console and from the traffic:
//! - the boot fail-closed table (the image's, not egret's) was in the kernel
//!   before egret started, and systemd finished loading it before it
//!   started egret;
//! - a pod sending to the server all through the boot never reaches it with
//!   its own address (the node forwards from early boot: only the boot
//!   table stops it until egret runs);
//! - egret becomes ready (native XDP on virtio_net);
//! - a pod's UDP and TCP reach the server with the egress IP, never the
//!   pod's address; an excluded destination gets the pod's own address
//!   through the node's kernel, which shows egret replaced the boot table
//!   (that table drops it).
//!
//! The image comes from `deploy/images/node/build.sh` (cached; EGRET_BIN
//! is passed on). Run as root: `cargo test -p egret-tests --test node_image`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::print_stdout)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egret_tests::client;
use egret_tests::netns::{self, NetNs};
use egret_tests::plan::{self, EXCLUDED, SERVER, STRANGER};
use egret_tests::server::Server;

const PREFIX: &str = "egni-";
/// The pod, the node's pod-side address, the node's outside address, the
/// egress IP (TEST-NET).
const POD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 10);
const NODE_IN: &str = "198.18.0.1";
const NODE_OUT: &str = "198.51.100.1";
const EGRESS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// vCPUs, and queue pairs per NIC: one per vCPU (libvirt's usual setting).
/// With twice as many, virtio_net adds RX queues when XDP attaches; egret
/// then serves them (daemon/mod.rs `serve_added_queues`), and two runs so
/// passed, but a run at f8227f7 lost a TCP connection's every SYN while UDP
/// went through; the likely cause is that a worker of an added queue
/// transmits on the TX queue of that index, which virtio_net keeps for
/// XDP_TX (deploy/images/node/README.md, "virtio_net"). Not yet shown.
const CPUS: usize = 2;
const QUEUES: usize = CPUS;
const VECTORS: usize = 2 * QUEUES + 2;
/// TCG with one host thread running the vCPUs in turn, not one thread
/// each (QEMU's default). A `.ci/run` at 0f4b7d6, beside clippy and the
/// fuzz build, lost the guest 11 s into its boot: both vCPUs sat for the
/// rest of the 420 s at one instruction of `getrandom` (soft lockups of
/// 48 and 75 s), the two-byte NOP of the `crng_is_ready` static key that
/// the kernel patches when "crng init done" (11.68 s in that log). That
/// is the signature of a vCPU still running a translation of the code from
/// before another vCPU patched it; with one thread, a patch invalidates
/// the translations before any vCPU runs again. Seen once in about ten
/// runs, on a busy host only, so "fixed" rests on that reading, not on a
/// reproduction; a pass costs about as long as before (docs/benchmarks.md).
const TCG_THREADS: &str = "tcg,thread=single";
/// How long the boot (QEMU start to egret ready) may take under TCG.
const BOOT_TIMEOUT: Duration = Duration::from_secs(420);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Builds the image (or finds it in the cache): the build script prints its
/// path last.
fn image() -> PathBuf {
    let script = repo().join("deploy/images/node/build.sh");
    let t = Instant::now();
    let mut cmd = Command::new(&script);
    // tests/run.sh: the binary it put in the images it built (the tests'
    // debug build, or the release build with EGRET_RELEASE_IMAGES=1).
    if let Some(b) = std::env::var_os("EGRET_IMAGE_BIN") {
        cmd.env("EGRET_BIN", b);
    }
    let out = cmd.stderr(Stdio::inherit()).output().unwrap_or_else(|e| panic!("{script:?}: {e}"));
    assert!(
        out.status.success(),
        "{} failed ({}): build the image with `deploy/images/node/build.sh` (root; EGRET_BIN=... saves a release build)",
        script.display(),
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = PathBuf::from(stdout.lines().last().unwrap_or_default().trim());
    assert!(path.is_file(), "build.sh printed no image path: {stdout}");
    println!("image {} ready in {:?}", path.display(), t.elapsed());
    path
}

fn run(cmd: &mut Command) -> String {
    netns::run(cmd).unwrap_or_else(|e| panic!("{e}"))
}

/// QEMU, killed when dropped.
struct Vm(Child);

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A vfat volume labelled EGRET-CFG holding the gateway's files.
fn config_drive(dir: &Path) -> PathBuf {
    let files = dir.join("cfg");
    std::fs::create_dir_all(files.join("network")).unwrap();
    let w = |name: &str, text: &str| std::fs::write(files.join(name), text).unwrap();
    w(
        "gateway.yaml",
        &format!(
            "interfaces:\n  - {{name: eth0, role: inside}}\n  - {{name: eth1, role: outside}}\n\
             xdp: {{mode: native}}\n\
             egressIPs:\n  - ip: {EGRESS}\n\
             policies:\n  - name: pods\n    sources: [198.18.0.0/24]\n    destinations: [198.51.100.0/24]\n\
             \x20   except: [198.51.100.128/25]\n    egressIPs: [{EGRESS}]\n"
        ),
    );
    w(
        "node.conf",
        "EGRET_POD_INTERFACES=\"eth0\"\nEGRET_POD_CIDRS=\"198.18.0.0/24\"\nEGRET_KEEP_CIDRS=\"\"\n\
         EGRET_NIC_INTERFACES=\"eth0 eth1\"\nEGRET_IRQ_CPUS=\"0\"\nEGRET_METRICS=\"127.0.0.1:9469\"\n",
    );
    w(
        "network/10-eth0.network",
        &format!("[Match]\nName=eth0\n\n[Network]\nAddress={NODE_IN}/24\nLinkLocalAddressing=no\n"),
    );
    w(
        "network/11-eth1.network",
        &format!("[Match]\nName=eth1\n\n[Network]\nAddress={NODE_OUT}/24\nLinkLocalAddressing=no\n"),
    );
    w("hostname", "egret-node-test\n");
    // The boot window, held open: egret starts once the boot table has
    // dropped a pod datagram (or after 45 s, within systemd's 90 s for the
    // whole start), so every run tests the window in which the node
    // forwards and egret is not yet running. Without the hold it lasts
    // about half a second under TCG and was empty in one CI run (the pod's
    // ARP for the node takes up to a second once eth0 has its address). A
    // drop-in's ExecStartPre runs after the unit's own (failclosed-record's
    // listing, check-config). `$$` is a `$` to systemd.
    std::fs::create_dir_all(files.join("systemd/egret.service.d")).unwrap();
    w(
        "systemd/egret.service.d/boot-hold.conf",
        "[Service]\nExecStartPre=/bin/sh -c 't0=$$(date +%%s); \
         until nft list table inet egret_failclosed | grep -q \"counter packets [1-9]\"; do \
         [ $$(date +%%s) -ge $$((t0+45)) ] && break; sleep 0.1; done; \
         n=$$(nft list table inet egret_failclosed | grep -o \"counter packets [0-9]*\" | head -n 1 | cut -d\" \" -f3); \
         echo \"EGRET-NODE boot-hold dropped=$${n:-0} waited-s=$$(($$(date +%%s)-t0))\" > /dev/console'\n",
    );
    let img = dir.join("cfg.img");
    run(Command::new("mkfs.vfat").args(["-C", "-n", "EGRET-CFG"]).arg(&img).arg("4096"));
    run(Command::new("mcopy")
        .arg("-i")
        .arg(&img)
        .args(["-s"])
        .arg(files.join("gateway.yaml"))
        .arg(files.join("node.conf"))
        .arg(files.join("network"))
        .arg(files.join("hostname"))
        .arg(files.join("systemd"))
        .arg("::"));
    img
}

/// Waits until the serial log has a line containing `what` (or a failure
/// marker); returns the log.
fn wait_serial(log: &Path, what: &str, started: Instant) -> String {
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.contains(what) {
            return text;
        }
        if text.contains("EGRET-NODE not-ready") || text.contains("Kernel panic") {
            panic!("the node failed to become ready; serial log:\n{text}");
        }
        if started.elapsed() > BOOT_TIMEOUT {
            panic!("no {what:?} on the serial console after {BOOT_TIMEOUT:?}; serial log:\n{text}");
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The number after `key=` in the first line containing `marker`.
fn field(log: &str, marker: &str, key: &str) -> f64 {
    let line = log.lines().find(|l| l.contains(marker)).unwrap_or_else(|| panic!("no {marker:?} line"));
    let v = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"));
    v.trim_end_matches(':').parse().unwrap_or_else(|_| panic!("{key}={v} in {line:?}"))
}

#[test]
fn node_image_boots_fail_closed_and_translates() {
    assert!(egret_tests::sys::is_root(), "run as root (namespaces, taps, loop devices)");
    let test_started = Instant::now();
    let image = image();
    NetNs::delete_all_with_prefix(PREFIX);
    let dir = std::env::temp_dir().join(format!("egret-node-image-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = config_drive(&dir);

    // vm: QEMU and its two taps, each bridged to a veth into pod / srv.
    let vm_ns = NetNs::create(&format!("{PREFIX}vm")).unwrap();
    let pod_ns = NetNs::create(&format!("{PREFIX}pod")).unwrap();
    let srv_ns = NetNs::create(&format!("{PREFIX}srv")).unwrap();
    let (pod, srv) = (pod_ns.name().to_string(), srv_ns.name().to_string());
    vm_ns
        .ip_batch(&[
            "tuntap add dev tin mode tap multi_queue".into(),
            "tuntap add dev tout mode tap multi_queue".into(),
            "link add brin type bridge".into(),
            "link add brout type bridge".into(),
            format!("link add vin type veth peer name eth0 netns {pod}"),
            format!("link add vout type veth peer name eth0 netns {srv}"),
            "link set tin master brin".into(),
            "link set vin master brin".into(),
            "link set tout master brout".into(),
            "link set vout master brout".into(),
            "link set tin up".into(),
            "link set tout up".into(),
            "link set vin up".into(),
            "link set vout up".into(),
            "link set brin up".into(),
            "link set brout up".into(),
        ])
        .unwrap();
    pod_ns
        .ip_batch(&[
            format!("addr add {POD}/24 dev eth0"),
            "link set eth0 up".into(),
            format!("route add default via {NODE_IN}"),
        ])
        .unwrap();
    srv_ns
        .ip_batch(&[
            format!("addr add {SERVER}/24 dev eth0"),
            format!("addr add {STRANGER}/24 dev eth0"),
            format!("addr add {EXCLUDED}/24 dev eth0"),
            format!("addr add {}/64 dev eth0 nodad", plan::SERVER6),
            "link set eth0 up".into(),
            // Replies to the egress IP: on the link (egret answers ARP for it).
            "route add 203.0.113.0/24 dev eth0".into(),
            format!("route add 198.18.0.0/24 via {NODE_OUT}"),
        ])
        .unwrap();
    // Frames reach the guest's XDP with full checksums (MACHINE-NOTES: a
    // partial checksum from veth offload is not the gateway's to finish).
    for ns in [&pod_ns, &srv_ns] {
        ns.exec(&["ethtool", "-K", "eth0", "tx", "off"]).unwrap();
    }
    let server = Server::start(&srv_ns, None).unwrap();

    // From before the VM starts until egret is ready, the pod keeps sending
    // to the server: while the node boots, its kernel forwards (ip_forward
    // is on from early boot), so only the fail-closed boot table stands
    // between these datagrams and the server.
    let stop = Arc::new(AtomicBool::new(false));
    let boot_sender = {
        let sock = client::udp_socket(&pod_ns, SocketAddr::new(SERVER.into(), plan::ECHO_PORT)).unwrap();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Errors (no ARP answer yet: EHOSTUNREACH) are expected early on.
                if sock.send(format!("node-image-boot-{sent}").as_bytes()).is_ok() {
                    sent += 1;
                }
                // Every 10 ms: the window in which the node forwards before
                // egret starts lasts about half a second under TCG (11 of
                // 1,365 dropped at one every 50 ms).
                std::thread::sleep(Duration::from_millis(10));
            }
            sent
        })
    };

    let serial = dir.join("serial.log");
    let boot_started = Instant::now();
    let mut qemu = vm_ns.command("qemu-system-x86_64");
    qemu.args([
        // One host thread for both vCPUs (TCG_THREADS).
        "-accel",
        TCG_THREADS,
        "-m",
        "1024",
        "-smp",
        &CPUS.to_string(),
        "-display",
        "none",
        "-monitor",
        "none",
        "-no-reboot",
    ])
    .args(["-snapshot", "-serial"])
    .arg(format!("file:{}", serial.display()))
    .arg("-drive")
    .arg(format!("file={},format=qcow2,if=virtio", image.display()))
    .arg("-drive")
    .arg(format!("file={},format=raw,if=virtio,readonly=on", cfg.display()))
    // Multi-queue NICs, as on a gateway: QUEUES pairs, of which the
    // guest uses one per vCPU and virtio_net keeps the rest for XDP_TX.
    .args(["-netdev", &format!("tap,id=n0,ifname=tin,script=no,downscript=no,queues={QUEUES}")])
    .args(["-device", &format!("virtio-net-pci,netdev=n0,mac=52:54:00:e9:00:01,addr=0x10,mq=on,vectors={VECTORS}")])
    .args(["-netdev", &format!("tap,id=n1,ifname=tout,script=no,downscript=no,queues={QUEUES}")])
    .args(["-device", &format!("virtio-net-pci,netdev=n1,mac=52:54:00:e9:00:02,addr=0x11,mq=on,vectors={VECTORS}")])
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::inherit());
    let _vm = Vm(qemu.spawn().expect("start qemu-system-x86_64"));

    let log = wait_serial(&serial, "EGRET-NODE status-done", boot_started);
    let boot = boot_started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let boot_sent = boot_sender.join().unwrap();
    let leaked: Vec<_> = server.seen().into_iter().filter(|s| s.src.ip() == IpAddr::V4(POD)).collect();
    assert!(
        leaked.is_empty(),
        "{} of the pod's {boot_sent} datagrams during the boot reached the server with its own address, e.g. {:?}",
        leaked.len(),
        leaked.first()
    );
    println!("booted to egret ready in {boot:?}");
    let diag: Vec<&str> = log.lines().filter(|l| l.contains("EGRET-NODE")).collect();
    println!("{}", diag.join("\n"));
    // `egret status` as the node printed it.
    let status = log.split("EGRET-NODE ready").nth(1).unwrap_or_default();
    let status: Vec<&str> = status.lines().skip(1).take_while(|l| !l.contains("EGRET-NODE")).collect();
    println!("egret status on the node:\n{}", status.join("\n"));

    // The boot table was loaded, and was what the kernel held when egret
    // was about to start (its comment is the image's, not egret's).
    assert!(log.contains("EGRET-NODE failclosed-boot loaded mode=pods"), "boot table not loaded:\n{log}");
    let before = log
        .split("EGRET-NODE before-egret table=present")
        .nth(1)
        .unwrap_or_else(|| panic!("no fail-closed table in the kernel when egret.service started:\n{log}"));
    let listing: String = before.lines().take_while(|l| !l.contains("EGRET-NODE")).collect::<Vec<_>>().join("\n");
    assert!(listing.contains("egret not running yet: pod source"), "not the boot table before egret:\n{listing}");
    assert!(listing.contains("198.18.0.0/24"), "boot table without the pod CIDR:\n{listing}");
    assert!(listing.contains("counter packets "), "no counter in the boot table:\n{listing}");
    assert!(log.contains("systemd/egret.service.d/boot-hold.conf"), "the config drive did not apply the hold:\n{log}");
    // The hold's count: the boot table's counter just before egret started.
    let dropped = field(&log, "EGRET-NODE boot-hold", "dropped") as u64;
    println!(
        "boot window: the pod sent {boot_sent} datagrams; the boot table had dropped {dropped} when egret started"
    );
    // The positive control of "nothing leaked during the boot": the pod's
    // datagrams did reach a forwarding node before egret ran, and the boot
    // table, not something else, stopped them.
    assert!(boot_sent > 0, "the pod sent nothing during the boot");
    assert!(
        dropped > 0,
        "the boot table dropped none of the pod's {boot_sent} datagrams before egret started: the boot window was not tested"
    );
    let loaded = field(&log, "EGRET-NODE order", "failclosed-boot-done-us");
    let egret_start = field(&log, "EGRET-NODE order", "egret-start-us");
    assert!(loaded > 0.0 && egret_start > loaded, "boot table done at {loaded} us, egret started at {egret_start} us");
    assert!(
        field(&log, "failclosed-boot loaded", "uptime") < field(&log, "before-egret table=present", "uptime"),
        "console order"
    );
    // Every unit started (systemd prints "[FAILED] Failed to start X").
    let failed: Vec<&str> = log.lines().filter(|l| l.contains("FAILED") && l.contains("Failed to start")).collect();
    assert!(failed.is_empty(), "units failed during the boot:\n{}", failed.join("\n"));
    // Native XDP (ip -d link: "prog/xdp", generic would say "xdpgeneric").
    assert!(
        log.lines().any(|l| l.contains("EGRET-NODE diag") && l.contains("prog/xdp ")),
        "no native XDP program on the NICs:\n{}",
        diag.join("\n")
    );

    // Traffic: the pod's UDP and TCP leave with the egress IP.
    let traffic = Instant::now();
    let to = SocketAddr::new(SERVER.into(), plan::ECHO_PORT);
    let udp = client::udp_echo(&pod_ns, to, "node-image-udp").unwrap();
    assert_eq!(udp.seen.ip(), IpAddr::V4(EGRESS), "UDP source at the server");
    let http = client::http(&pod_ns, SocketAddr::new(SERVER.into(), plan::HTTP_PORT), "/node-image", 0).unwrap();
    assert_eq!(http.seen.ip(), IpAddr::V4(EGRESS), "TCP source at the server");
    // An excluded destination goes through the node's kernel, untranslated:
    // possible only once egret replaced the boot table (which drops it).
    let excluded =
        client::udp_echo(&pod_ns, SocketAddr::new(EXCLUDED.into(), plan::ECHO_PORT), "node-image-excl").unwrap();
    assert_eq!(excluded.seen.ip(), IpAddr::V4(POD), "excluded destination");
    // The server never saw the pod's address towards a steered destination,
    // during the boot (the boot table) or after (egret).
    let leaks: Vec<_> = server
        .seen()
        .into_iter()
        .filter(|s| s.src.ip() == IpAddr::V4(POD) && s.dst.ip() != IpAddr::from(EXCLUDED))
        .collect();
    assert!(leaks.is_empty(), "pod address seen at the server: {leaks:?}");
    println!("traffic checks {:?}; whole test {:?}", traffic.elapsed(), test_started.elapsed());
    let _ = std::fs::remove_dir_all(&dir);
}
