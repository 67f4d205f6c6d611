//! Rule 0, the fast path, through BPF_PROG_TEST_RUN with hand-made entries:
//! a hit must produce exactly the frame a full recompute produces (built
//! with etherparse, checksums and all); everything the engine must see must
//! leave the frame untouched, move exactly one fast-path counter (its
//! reason) and then get the steering verdict it would get without the fast
//! path. The deltas here come from a small independent RFC 1624 sum, not
//! from the engine. Also: the switch, the once-a-second stamp, per-policy
//! traffic, a full map, and (ignored) the cost measurement behind
//! docs/adr/0005-xdp-fast-path.md.
//!
//! World (TEST-NET): pod 198.51.100.7 / 2001:db8:1::5 (steered), egress
//! 203.0.113.10 / 2001:db8:e::10 (NAT ports 20000-29999), remote
//! 203.0.113.99 / 2001:db8:2::1. An AF_XDP socket sits on queue 0 of `lo`
//! (ifindex 1, where BPF_PROG_TEST_RUN delivers), so punted frames are
//! redirected to it by the steering rules.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, Ipv6Addr};
use std::os::fd::AsRawFd;

use egret_bpf::{
    Action, DstRule, FastPathReason as F, FpEntry, FpEntryV4, FpEntryV6, FpKey, FpKeyV4, FpKeyV6, FpNextHop, FpRewrite,
    LoadOptions, OwnedAddr, ProgramVariant, SrcPrefix, SteeringProgram, VerdictReason as R, XdpAction,
};
use egret_dataplane::netns::NetnsGuard;
use etherparse::{
    IpHeaders, IpNumber, Ipv4Header, Ipv6Extensions, Ipv6Header, Ipv6RawExtHeader, PacketBuilder, PacketBuilderStep,
};

const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const GW_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const OUT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x03];
const NH_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xfe];

const POD4: [u8; 4] = [198, 51, 100, 7];
const EGRESS4: [u8; 4] = [203, 0, 113, 10];
const REMOTE4: [u8; 4] = [203, 0, 113, 99];
const LO: u32 = 1;
const OTHER_IF: u32 = 7;
const NAT_LO: u16 = 20000;
const NAT_HI: u16 = 29999;
const POD_PORT: u16 = 40000;
const EGRESS_PORT: u16 = 20000;
const REMOTE_PORT: u16 = 443;
const PAYLOAD: &[u8] = b"egret fast path payload";

fn v6(s: &str) -> [u8; 16] {
    s.parse::<Ipv6Addr>().unwrap().octets()
}
fn pod6() -> [u8; 16] {
    v6("2001:db8:1::5")
}
fn egress6() -> [u8; 16] {
    v6("2001:db8:e::10")
}
fn remote6() -> [u8; 16] {
    v6("2001:db8:2::1")
}
fn net(s: &str) -> ipnet::IpNet {
    s.parse().unwrap()
}

// ------------------------------------------------------------ RFC 1624

fn fold(mut s: u32) -> u16 {
    while s >> 16 != 0 {
        s = (s & 0xffff) + (s >> 16);
    }
    s as u16
}

/// The delta of replacing `old` by `new` (equal even lengths): the sum of
/// ~m + m' over the 16-bit words, folded, with 0xFFFF kept as 0.
fn delta(old: &[u8], new: &[u8]) -> u16 {
    let mut s = 0u32;
    for (o, n) in old.chunks(2).zip(new.chunks(2)) {
        s += u32::from(!u16::from_be_bytes([o[0], o[1]]));
        s += u32::from(u16::from_be_bytes([n[0], n[1]]));
    }
    norm(fold(s))
}

fn norm(d: u16) -> u16 {
    if d == 0xffff {
        0
    } else {
        d
    }
}

fn add(a: u16, b: u16) -> u16 {
    norm(fold(u32::from(a) + u32::from(b)))
}

// ------------------------------------------------------------ frames

#[derive(Clone, Copy)]
enum L4 {
    Udp,
    /// TCP with these flags (ACK is always set).
    Tcp {
        syn: bool,
        fin: bool,
        rst: bool,
    },
}

const ACK: L4 = L4::Tcp { syn: false, fin: false, rst: false };

/// The transport header and payload of a test frame, after its IP header.
fn with_l4(b: PacketBuilderStep<IpHeaders>, sport: u16, dport: u16, l4: L4) -> Vec<u8> {
    let mut v = Vec::new();
    match l4 {
        L4::Udp => b.udp(sport, dport).write(&mut v, PAYLOAD).unwrap(),
        L4::Tcp { syn, fin, rst } => {
            let mut t = b.tcp(sport, dport, 1000, 4096).ack(77);
            if syn {
                t = t.syn();
            }
            if fin {
                t = t.fin();
            }
            if rst {
                t = t.rst();
            }
            t.write(&mut v, PAYLOAD).unwrap()
        }
    }
    v
}

fn frame4(macs: ([u8; 6], [u8; 6]), src: [u8; 4], dst: [u8; 4], ttl: u8, sport: u16, dport: u16, l4: L4) -> Vec<u8> {
    with_l4(PacketBuilder::ethernet2(macs.0, macs.1).ipv4(src, dst, ttl), sport, dport, l4)
}

fn frame6(macs: ([u8; 6], [u8; 6]), src: [u8; 16], dst: [u8; 16], hops: u8, sport: u16, dport: u16, l4: L4) -> Vec<u8> {
    with_l4(PacketBuilder::ethernet2(macs.0, macs.1).ipv6(src, dst, hops), sport, dport, l4)
}

fn proto(l4: L4) -> u8 {
    match l4 {
        L4::Udp => 17,
        L4::Tcp { .. } => 6,
    }
}

/// Offset of the transport checksum in a frame without VLAN or options.
fn csum_at(frame: &[u8], v6: bool) -> usize {
    let l4 = if v6 { 14 + 40 } else { 14 + 20 };
    let proto = if v6 { frame[14 + 6] } else { frame[14 + 9] };
    l4 + if proto == 6 { 16 } else { 6 }
}

/// Replaces the transport checksum by the folded pseudo-header sum, as a
/// sender with TX checksum offload leaves it.
fn make_partial(frame: &mut [u8], v6: bool) {
    let (src, dst, len, proto) = if v6 {
        let len = u16::from_be_bytes([frame[18], frame[19]]) as u32;
        (&frame[22..38], &frame[38..54], len, frame[20])
    } else {
        let tot = u16::from_be_bytes([frame[16], frame[17]]) as u32;
        (&frame[26..30], &frame[30..34], tot - 20, frame[23])
    };
    let mut s = 0u32;
    for w in src.chunks(2).chain(dst.chunks(2)) {
        s += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    s += u32::from(proto) + (len >> 16) + (len & 0xffff);
    let at = csum_at(frame, v6);
    frame[at..at + 2].copy_from_slice(&fold(s).to_be_bytes());
}

/// Sets the IPv4 TTL and fixes the header checksum from scratch.
fn set_ttl4(frame: &mut [u8], ttl: u8) {
    frame[14 + 8] = ttl;
    frame[14 + 10] = 0;
    frame[14 + 11] = 0;
    let mut s = 0u32;
    for w in frame[14..34].chunks(2) {
        s += u32::from(u16::from_be_bytes([w[0], w[1]]));
    }
    let c = !fold(s);
    frame[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
}

// ------------------------------------------------------------ world

struct World {
    prog: SteeringProgram,
    _xsk: socket2::Socket,
}

fn world() -> World {
    world_with(LoadOptions::default())
}

fn world_with(options: LoadOptions) -> World {
    let prog = SteeringProgram::load(options).expect("load (run as root)");
    prog.set_owned(IpAddr::from(EGRESS4), OwnedAddr::egress(NAT_LO, NAT_HI)).unwrap();
    prog.set_owned(IpAddr::from(egress6()), OwnedAddr::egress(NAT_LO, NAT_HI)).unwrap();
    let sources = vec![
        SrcPrefix { prefix: net("198.51.100.0/24"), class: 1 },
        SrcPrefix { prefix: net("2001:db8:1::/64"), class: 2 },
    ];
    let rules = vec![
        DstRule { class: 1, prefix: net("0.0.0.0/0"), action: Action::Steer, policy_id: 1 },
        DstRule { class: 2, prefix: net("::/0"), action: Action::Steer, policy_id: 1 },
    ];
    prog.replace_policy(&sources, &rules).unwrap();
    let xsk = socket2::Socket::new(socket2::Domain::from(libc::AF_XDP), socket2::Type::from(libc::SOCK_RAW), None)
        .expect("AF_XDP socket (run as root)");
    prog.register_xsk(LO, 0, xsk.as_raw_fd()).unwrap();
    prog.fp_set_enabled(true).unwrap();
    // Next hop 0: out of another interface; 1: out of lo (one-arm); 2: unresolved.
    prog.fp_set_next_hop(0, &FpNextHop::resolved(OTHER_IF, OUT_MAC, NH_MAC)).unwrap();
    prog.fp_set_next_hop(1, &FpNextHop::resolved(LO, GW_MAC, PEER_MAC)).unwrap();
    prog.fp_set_next_hop(2, &FpNextHop::invalid(OTHER_IF)).unwrap();
    World { prog, _xsk: xsk }
}

/// One outbound entry for the session pod:POD_PORT -> remote:REMOTE_PORT
/// (any protocol: the deltas cover addresses and ports), leaving as
/// `egress`:`port` through `next_hop`.
fn outbound_entry<const N: usize>(
    pod: [u8; N],
    remote: [u8; N],
    egress: [u8; N],
    port: u16,
    next_hop: u32,
    policy_slot: u16,
) -> FpEntry<N> {
    let ports = |a: u16, b: u16| [a.to_be_bytes(), b.to_be_bytes()].concat();
    let addrs = delta(&[pod, remote].concat(), &[egress, remote].concat());
    let r = FpRewrite {
        new_sport: port,
        new_dport: REMOTE_PORT,
        l3_delta: if N == 4 { addrs } else { 0 },
        l4_delta: add(addrs, delta(&ports(POD_PORT, REMOTE_PORT), &ports(port, REMOTE_PORT))),
        next_hop,
        policy_slot,
        direction: egret_bpf::fast_path::DIR_OUTBOUND,
    };
    FpEntry::new(egress, remote, &r)
}

/// Installs both directions of a session pod:POD_PORT -> remote:REMOTE_PORT
/// seen as egress:EGRESS_PORT, with `next_hop` for both directions. The
/// IPv4 header checksum delta is the addresses'; IPv6 has none (0).
fn install<const N: usize>(
    prog: &SteeringProgram,
    [pod, egress, remote]: [[u8; N]; 3],
    l4: L4,
    next_hop: u32,
    policy_slot: u16,
) {
    let p = proto(l4);
    let ports = |a: u16, b: u16| [a.to_be_bytes(), b.to_be_bytes()].concat();
    let header = |d: u16| if N == 4 { d } else { 0 };
    let out = outbound_entry(pod, remote, egress, EGRESS_PORT, next_hop, policy_slot);
    prog.fp_insert(&FpKey::new(pod, remote, POD_PORT, REMOTE_PORT, p), &out).unwrap();
    let in_addrs = delta(&[remote, egress].concat(), &[remote, pod].concat());
    let inb = FpRewrite {
        new_sport: REMOTE_PORT,
        new_dport: POD_PORT,
        l3_delta: header(in_addrs),
        l4_delta: add(in_addrs, delta(&ports(REMOTE_PORT, EGRESS_PORT), &ports(REMOTE_PORT, POD_PORT))),
        next_hop,
        policy_slot,
        direction: egret_bpf::fast_path::DIR_INBOUND,
    };
    prog.fp_insert(&FpKey::new(remote, egress, REMOTE_PORT, EGRESS_PORT, p), &FpEntry::new(remote, pod, &inb)).unwrap();
}

fn install4(prog: &SteeringProgram, l4: L4, next_hop: u32, policy_slot: u16) {
    install(prog, [POD4, EGRESS4, REMOTE4], l4, next_hop, policy_slot);
}

fn install6(prog: &SteeringProgram, l4: L4, next_hop: u32, policy_slot: u16) {
    install(prog, [pod6(), egress6(), remote6()], l4, next_hop, policy_slot);
}

fn verdicts(prog: &SteeringProgram) -> Vec<u64> {
    prog.verdict_counters().unwrap().into_iter().map(|(_, n)| n).collect()
}

fn fps(prog: &SteeringProgram) -> Vec<u64> {
    prog.fp_counters().unwrap().into_iter().map(|(_, n)| n).collect()
}

fn moved<T: Copy>(all: &[T], before: &[u64], after: &[u64]) -> Vec<(T, u64)> {
    all.iter().zip(before.iter().zip(after)).filter(|(_, (b, a))| a != b).map(|(r, (b, a))| (*r, a - b)).collect()
}

type Moved = (egret_bpf::TestRunOutput, Vec<(R, u64)>, Vec<(F, u64)>);

/// Runs `frame`; returns the output and the verdict and fast-path counters that moved.
fn run(prog: &SteeringProgram, frame: &[u8]) -> Moved {
    let (v0, f0) = (verdicts(prog), fps(prog));
    let out = prog.test_run(frame).unwrap();
    let (v1, f1) = (verdicts(prog), fps(prog));
    (out, moved(R::ALL, &v0, &v1), moved(F::ALL, &f0, &f1))
}

fn expect_hit(prog: &SteeringProgram, what: &str, frame: &[u8], want: &[u8], action: XdpAction) {
    let (out, v, f) = run(prog, frame);
    let reason = if action == XdpAction::Tx { R::TxFastPath } else { R::RedirectFastPath };
    assert_eq!(out.action, action, "{what}: action");
    assert_eq!(v, vec![(reason, 1)], "{what}: verdicts");
    assert_eq!(f, vec![], "{what}: a hit moves no fast-path reason");
    assert_eq!(egret_dataplane::fixtures::hex(&out.frame), egret_dataplane::fixtures::hex(want), "{what}: frame");
}

fn expect_punt(prog: &SteeringProgram, what: &str, frame: &[u8], reason: F, steering: R) {
    let (out, v, f) = run(prog, frame);
    assert_eq!(f, vec![(reason, 1)], "{what}: fast-path counters");
    assert_eq!(v, vec![(steering, 1)], "{what}: verdicts");
    assert_eq!(out.action, steering.action(), "{what}: action");
    assert_eq!(out.frame, frame, "{what}: a punted frame must be untouched");
}

// ------------------------------------------------------------ tests

#[test]
fn hits_produce_the_fully_recomputed_frame() {
    let w = world();
    let p = &w.prog;
    for l4 in [L4::Udp, ACK] {
        p.fp_clear().unwrap();
        install4(p, l4, 0, 3);
        install6(p, l4, 0, 3);
        let macs_in = (PEER_MAC, GW_MAC);
        let macs_out = (OUT_MAC, NH_MAC);
        let name = if matches!(l4, L4::Udp) { "udp" } else { "tcp" };

        let out4 = frame4(macs_in, POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, l4);
        let want4 = frame4(macs_out, EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, l4);
        expect_hit(p, &format!("{name}4 outbound"), &out4, &want4, XdpAction::Redirect);
        let in4 = frame4(macs_in, REMOTE4, EGRESS4, 50, REMOTE_PORT, EGRESS_PORT, l4);
        let want_in4 = frame4(macs_out, REMOTE4, POD4, 49, REMOTE_PORT, POD_PORT, l4);
        expect_hit(p, &format!("{name}4 inbound"), &in4, &want_in4, XdpAction::Redirect);

        let out6 = frame6(macs_in, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, l4);
        let want6 = frame6(macs_out, egress6(), remote6(), 63, EGRESS_PORT, REMOTE_PORT, l4);
        expect_hit(p, &format!("{name}6 outbound"), &out6, &want6, XdpAction::Redirect);
        let in6 = frame6(macs_in, remote6(), egress6(), 2, REMOTE_PORT, EGRESS_PORT, l4);
        let want_in6 = frame6(macs_out, remote6(), pod6(), 1, REMOTE_PORT, POD_PORT, l4);
        expect_hit(p, &format!("{name}6 inbound"), &in6, &want_in6, XdpAction::Redirect);
    }
}

#[test]
fn many_ttls_and_payloads_keep_checksums_exact() {
    // Every TTL from 2 to 255 with a payload byte varying: the IPv4 header
    // checksum (address delta, then the TTL delta) and the UDP checksum
    // must equal a full recompute each time.
    let w = world();
    install4(&w.prog, L4::Udp, 0, 0);
    for ttl in 2..=255u8 {
        let mut f = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, ttl, POD_PORT, REMOTE_PORT, L4::Udp);
        let mut want = frame4((OUT_MAC, NH_MAC), EGRESS4, REMOTE4, ttl - 1, EGRESS_PORT, REMOTE_PORT, L4::Udp);
        // Vary the payload's first byte in both and fix the UDP checksum of each from scratch.
        for v in [&mut f, &mut want] {
            let at = 14 + 20 + 8;
            v[at] = ttl;
            let src: [u8; 4] = v[26..30].try_into().unwrap();
            let dst: [u8; 4] = v[30..34].try_into().unwrap();
            let h = etherparse::UdpHeader::from_slice(&v[34..42]).unwrap().0;
            let c = h.calc_checksum_ipv4_raw(src, dst, &v[42..]).unwrap();
            v[40..42].copy_from_slice(&c.to_be_bytes());
        }
        expect_hit(&w.prog, &format!("ttl {ttl}"), &f, &want, XdpAction::Redirect);
    }
}

#[test]
fn one_arm_sends_back_out_with_xdp_tx() {
    let w = world();
    install4(&w.prog, L4::Udp, 1, 0);
    let f = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let want = frame4((GW_MAC, PEER_MAC), EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    expect_hit(&w.prog, "one-arm", &f, &want, XdpAction::Tx);
}

#[test]
fn udp4_without_checksum_stays_without() {
    let w = world();
    install4(&w.prog, L4::Udp, 0, 0);
    let mut f = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let mut want = frame4((OUT_MAC, NH_MAC), EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    f[40..42].copy_from_slice(&[0, 0]);
    want[40..42].copy_from_slice(&[0, 0]);
    expect_hit(&w.prog, "udp checksum 0", &f, &want, XdpAction::Redirect);
}

#[test]
fn punts_leave_the_frame_untouched_and_name_the_reason() {
    let w = world();
    let p = &w.prog;
    install4(p, L4::Udp, 0, 0);
    install4(p, ACK, 0, 0);
    install6(p, L4::Udp, 0, 0);
    install6(p, ACK, 0, 0);
    let mi = (PEER_MAC, GW_MAC);
    let udp_out = || frame4(mi, POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let udp_in = || frame4(mi, REMOTE4, EGRESS4, 64, REMOTE_PORT, EGRESS_PORT, L4::Udp);
    let steered = R::RedirectSteeredSource;
    let nat = R::RedirectNatPort;

    let tcp = |syn, fin, rst| frame4(mi, POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Tcp { syn, fin, rst });
    expect_punt(p, "SYN", &tcp(true, false, false), F::PuntTcpControl, steered);
    expect_punt(p, "FIN", &tcp(false, true, false), F::PuntTcpControl, steered);
    expect_punt(p, "RST", &tcp(false, false, true), F::PuntTcpControl, steered);
    let rst_in =
        frame4(mi, REMOTE4, EGRESS4, 64, REMOTE_PORT, EGRESS_PORT, L4::Tcp { syn: false, fin: false, rst: true });
    expect_punt(p, "RST inbound", &rst_in, F::PuntTcpControl, nat);
    let fin6 = frame6(mi, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Tcp { syn: false, fin: true, rst: false });
    expect_punt(p, "FIN v6", &fin6, F::PuntTcpControl, steered);

    let mut ttl1 = udp_out();
    set_ttl4(&mut ttl1, 1);
    expect_punt(p, "TTL 1", &ttl1, F::PuntTtl, steered);
    let mut ttl0 = udp_in();
    set_ttl4(&mut ttl0, 0);
    expect_punt(p, "TTL 0 inbound", &ttl0, F::PuntTtl, nat);
    let hop1 = frame6(mi, remote6(), egress6(), 1, REMOTE_PORT, EGRESS_PORT, L4::Udp);
    expect_punt(p, "hop limit 1", &hop1, F::PuntTtl, nat);

    for (name, v6, mut f) in [
        ("partial udp", false, udp_out()),
        ("partial tcp", false, tcp(false, false, false)),
        ("partial udp inbound", false, udp_in()),
        ("partial udp6", true, frame6(mi, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp)),
        ("partial tcp6", true, frame6(mi, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, ACK)),
    ] {
        make_partial(&mut f, v6);
        expect_punt(p, name, &f, F::PuntPartialChecksum, if name.contains("inbound") { nat } else { steered });
    }

    let mut bad_ip = udp_out();
    bad_ip[14 + 10] ^= 0x5a;
    expect_punt(p, "bad IPv4 header checksum", &bad_ip, F::PuntMalformed, steered);
    let mut long_udp = udp_out();
    long_udp[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&200u16.to_be_bytes());
    expect_punt(p, "UDP length beyond the datagram", &long_udp, F::PuntMalformed, steered);
    let mut short_tot = udp_out();
    let n = short_tot.len();
    short_tot.truncate(n - 4);
    expect_punt(p, "IPv4 total length beyond the frame", &short_tot, F::PuntMalformed, steered);
    let mut zero6 = frame6(mi, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let at = csum_at(&zero6, true);
    zero6[at..at + 2].copy_from_slice(&[0, 0]);
    expect_punt(p, "UDP over IPv6 without checksum", &zero6, F::PuntMalformed, steered);
    let mut bad_doff = tcp(false, false, false);
    bad_doff[14 + 20 + 12] = 0x40; // data offset 4 words
    expect_punt(p, "TCP data offset below 5", &bad_doff, F::PuntMalformed, steered);

    // Frames the fast path does not look up.
    let mut opts = Ipv4Header::new(0, 64, IpNumber::UDP, POD4, REMOTE4).unwrap();
    opts.options = [0x94, 0x04, 0, 0][..].try_into().unwrap();
    let mut with_options = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, GW_MAC)
        .ip(IpHeaders::Ipv4(opts, Default::default()))
        .udp(POD_PORT, REMOTE_PORT)
        .write(&mut with_options, PAYLOAD)
        .unwrap();
    expect_punt(p, "IPv4 options", &with_options, F::SkipIpOptions, steered);
    let mut frag = udp_out();
    frag[14 + 6] = 0x20; // MF
    set_ttl4(&mut frag, 64);
    expect_punt(p, "IPv4 first fragment", &frag, F::SkipFragment, steered);
    let exts = Ipv6Extensions {
        destination_options: Some(Ipv6RawExtHeader::new_raw(IpNumber::UDP, &[1, 4, 0, 0, 0, 0]).unwrap()),
        ..Default::default()
    };
    let hdr = Ipv6Header { source: pod6(), destination: remote6(), hop_limit: 64, ..Default::default() };
    let mut with_ext = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, GW_MAC)
        .ip(IpHeaders::Ipv6(hdr, exts))
        .udp(POD_PORT, REMOTE_PORT)
        .write(&mut with_ext, PAYLOAD)
        .unwrap();
    expect_punt(p, "IPv6 destination options", &with_ext, F::SkipIpv6Ext, steered);
    let mut frag6 = frame6(mi, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp);
    // Next header: fragment. The UDP ports now read as a fragment header
    // whose offset is 443 >> 3: a later fragment to the steering rules.
    frag6[14 + 6] = 44;
    expect_punt(p, "IPv6 fragment header", &frag6, F::SkipFragment, R::RedirectFragmentSteeredSource);
    let mut vlan = udp_out();
    vlan.splice(12..12, [0x81, 0x00, 0x00, 0x64]);
    expect_punt(p, "802.1Q tag", &vlan, F::SkipVlan, steered);
    let mut icmp = Vec::new();
    PacketBuilder::ethernet2(PEER_MAC, GW_MAC)
        .ipv4(POD4, REMOTE4, 64)
        .icmpv4_echo_request(POD_PORT, 1)
        .write(&mut icmp, PAYLOAD)
        .unwrap();
    expect_punt(p, "ICMP echo", &icmp, F::SkipNotTcpUdp, steered);
    let other = frame4(mi, POD4, REMOTE4, 64, POD_PORT + 1, REMOTE_PORT, L4::Udp);
    expect_punt(p, "another flow", &other, F::Miss, steered);
    let stranger = frame4(mi, [203, 0, 113, 98], EGRESS4, 64, REMOTE_PORT, EGRESS_PORT, L4::Udp);
    expect_punt(p, "another remote to the mapped port", &stranger, F::Miss, nat);
    let unselected = frame4(mi, [192, 0, 2, 9], REMOTE4, 64, 1, 2, L4::Udp);
    expect_punt(p, "the kernel's traffic", &unselected, F::Miss, R::PassUnselectedSource);

    // An unresolved next hop.
    p.fp_clear().unwrap();
    install4(p, L4::Udp, 2, 0);
    expect_punt(p, "next hop unresolved", &udp_out(), F::PuntNextHop, steered);
    install4(p, L4::Udp, 3, 0); // never written: all zero, not valid
    expect_punt(p, "next hop never written", &udp_out(), F::PuntNextHop, steered);
    install4(p, L4::Udp, 1_000_000, 0); // beyond the table
    expect_punt(p, "next hop beyond the table", &udp_out(), F::PuntNextHop, steered);
    // Marked valid again: translated.
    p.fp_set_next_hop(2, &FpNextHop::resolved(OTHER_IF, OUT_MAC, NH_MAC)).unwrap();
    install4(p, L4::Udp, 2, 0);
    let (out, _, f) = run(p, &udp_out());
    assert_eq!((out.action, f), (XdpAction::Redirect, vec![]));
}

/// Issue 14 item 12: a hit larger than its next hop's link MTU is punted
/// untouched (the engine answers Fragmentation Needed / Packet Too Big),
/// counted as a next hop that cannot take it; one that fits is translated.
/// Before, the program sent it, and the next link dropped it in silence.
#[test]
fn a_hit_larger_than_the_next_hops_mtu_is_punted() {
    let w = world();
    let p = &w.prog;
    let mi = (PEER_MAC, GW_MAC);
    let out4 = frame4(mi, POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let out6 = frame6(mi, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let (len4, len6) = ((out4.len() - 14) as u32, (out6.len() - 14) as u32);
    install4(p, L4::Udp, 2, 0);
    install6(p, L4::Udp, 2, 0);
    for (mtu, fits) in [(len4.min(len6) - 1, false), (len4.max(len6), true), (0, true)] {
        p.fp_set_next_hop(2, &FpNextHop::resolved(OTHER_IF, OUT_MAC, NH_MAC).with_mtu(mtu)).unwrap();
        for (what, frame) in [("v4", &out4), ("v6", &out6)] {
            if fits {
                let (out, _, f) = run(p, frame);
                assert_eq!((out.action, f), (XdpAction::Redirect, vec![]), "{what} under MTU {mtu}");
            } else {
                expect_punt(p, &format!("{what} over MTU {mtu}"), frame, F::PuntNextHop, R::RedirectSteeredSource);
            }
        }
    }
}

/// Issue 14 item 3 on the fast path: a next hop marked NEXT_HOP_NOT_BACK
/// (a two-arm gateway's outside link) is never used for a frame that
/// arrived on its own interface: a frame from outside that carries a pod's
/// outbound 5-tuple is punted untouched to the steering rules (which drop
/// it by the interface's role, rule 5a). Unmarked, the same frame is
/// translated back out (one-arm); marked, a frame from another interface is
/// still translated.
#[test]
fn a_hit_never_goes_back_out_of_a_not_back_link() {
    let w = world();
    let p = &w.prog;
    // BPF_PROG_TEST_RUN without a context receives on lo: next hop 1 is out of lo.
    install4(p, L4::Udp, 1, 0);
    install6(p, L4::Udp, 1, 0);
    let out4 = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let out6 = frame6((PEER_MAC, GW_MAC), pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let want4 = frame4((GW_MAC, PEER_MAC), EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    let want6 = frame6((GW_MAC, PEER_MAC), egress6(), remote6(), 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    expect_hit(p, "unmarked v4", &out4, &want4, XdpAction::Tx);
    expect_hit(p, "unmarked v6", &out6, &want6, XdpAction::Tx);
    p.fp_set_next_hop(1, &FpNextHop::resolved(LO, GW_MAC, PEER_MAC).not_back(true)).unwrap();
    expect_punt(p, "marked, arrived on its link, v4", &out4, F::PuntWrongLink, R::RedirectSteeredSource);
    expect_punt(p, "marked, arrived on its link, v6", &out6, F::PuntWrongLink, R::RedirectSteeredSource);
    // Marked, out of another interface than the one the frame came in on.
    p.fp_set_next_hop(1, &FpNextHop::resolved(OTHER_IF, OUT_MAC, NH_MAC).not_back(true)).unwrap();
    let want4 = frame4((OUT_MAC, NH_MAC), EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    expect_hit(p, "marked, other link, v4", &out4, &want4, XdpAction::Redirect);
}

/// Issue 14 item 6: past `fp_config.valid_until_ns` (the earliest owned
/// address's valid-until, less the coarse clock's slack) no session is
/// translated; the frame goes on to the steering rules untouched. Before
/// it, and with no deadline, the same frames are translated.
#[test]
fn past_the_valid_until_offloaded_sessions_are_not_translated() {
    let w = world();
    let p = &w.prog;
    install4(p, L4::Udp, 0, 0);
    install6(p, L4::Udp, 0, 0);
    let out4 = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let want4 = frame4((OUT_MAC, NH_MAC), EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    let out6 = frame6((PEER_MAC, GW_MAC), pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let want6 = frame6((OUT_MAC, NH_MAC), egress6(), remote6(), 63, EGRESS_PORT, REMOTE_PORT, L4::Udp);
    // An hour ahead: translated.
    p.fp_set_valid_until(egret_bpf::monotonic_ns() + 3_600_000_000_000).unwrap();
    expect_hit(p, "valid v4", &out4, &want4, XdpAction::Redirect);
    expect_hit(p, "valid v6", &out6, &want6, XdpAction::Redirect);
    // Within the coarse clock's slack of the deadline: already stopped.
    p.fp_set_valid_until(egret_bpf::monotonic_ns() + egret_bpf::FP_COARSE_CLOCK_SLACK_NS / 2).unwrap();
    expect_punt(p, "within the slack v4", &out4, F::PuntExpired, R::RedirectSteeredSource);
    // Past it (the kernel's CLOCK_MONOTONIC is the clock monotonic_ns reads).
    p.fp_set_valid_until(egret_bpf::monotonic_ns()).unwrap();
    expect_punt(p, "expired v4", &out4, F::PuntExpired, R::RedirectSteeredSource);
    expect_punt(p, "expired v6", &out6, F::PuntExpired, R::RedirectSteeredSource);
    // Switching the fast path off and on keeps the deadline.
    p.fp_set_enabled(false).unwrap();
    p.fp_set_enabled(true).unwrap();
    expect_punt(p, "expired after a toggle", &out4, F::PuntExpired, R::RedirectSteeredSource);
    // No deadline (file mode): translated again.
    p.fp_set_valid_until(egret_bpf::VALID_FOREVER).unwrap();
    expect_hit(p, "no deadline", &out4, &want4, XdpAction::Redirect);
}

#[test]
fn switched_off_the_fast_path_is_not_consulted() {
    let w = world();
    install4(&w.prog, L4::Udp, 0, 0);
    w.prog.fp_set_enabled(false).unwrap();
    let f = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let (out, v, fp) = run(&w.prog, &f);
    assert_eq!((out.action, v, fp), (XdpAction::Redirect, vec![(R::RedirectSteeredSource, 1)], vec![]));
    assert_eq!(out.frame, f);
}

#[test]
fn last_seen_is_stamped_at_most_once_a_second_and_traffic_is_counted() {
    let w = world();
    install4(&w.prog, L4::Udp, 0, 5);
    let key = FpKeyV4::new(POD4, REMOTE4, POD_PORT, REMOTE_PORT, 17);
    let in_key = FpKeyV4::new(REMOTE4, EGRESS4, REMOTE_PORT, EGRESS_PORT, 17);
    assert_eq!(w.prog.fp_get(&key).unwrap().unwrap().last_seen_ns, 0);
    let f = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp);
    let before = egret_bpf::monotonic_ns();
    w.prog.test_run(&f).unwrap();
    let first = w.prog.fp_get(&key).unwrap().unwrap().last_seen_ns;
    // The coarse clock may lag the precise one by a tick (a few ms).
    assert!(first + 20_000_000 >= before && first <= egret_bpf::monotonic_ns(), "{first} vs {before}");
    // Up to 100 more runs, all within half a second of the first stamp (a
    // slow machine, or the guest under TCG, runs fewer), so none of them
    // may stamp again.
    let mut runs = 0;
    while runs < 100 && egret_bpf::monotonic_ns() < first + 500_000_000 {
        w.prog.test_run(&f).unwrap();
        runs += 1;
    }
    assert!(runs > 0, "no run within half a second of the first stamp");
    assert_eq!(w.prog.fp_get(&key).unwrap().unwrap().last_seen_ns, first, "no write within the second");
    assert_eq!(w.prog.fp_get(&in_key).unwrap().unwrap().last_seen_ns, 0, "the other direction saw nothing");
    std::thread::sleep(std::time::Duration::from_millis(1100));
    w.prog.test_run(&f).unwrap();
    let later = w.prog.fp_get(&key).unwrap().unwrap().last_seen_ns;
    assert!(later >= first + 1_000_000_000, "{later} vs {first}");

    let t = w.prog.fp_policy_traffic(5).unwrap();
    assert_eq!((t[0].packets, t[0].bytes), (runs + 2, (runs + 2) * f.len() as u64));
    assert_eq!((t[1].packets, t[1].bytes), (0, 0));
    assert_eq!(w.prog.fp_policy_traffic(4).unwrap()[0].packets, 0);
}

#[test]
fn a_full_map_is_reported_as_such() {
    let w = world_with(LoadOptions { fast_path_sessions_v4: 1, fast_path_sessions_v6: 1, ..LoadOptions::default() });
    install4(&w.prog, L4::Udp, 0, 0); // two entries: the map is full
    let r = FpRewrite::default();
    let err =
        w.prog.fp_insert(&FpKeyV4::new(POD4, REMOTE4, 1, 2, 17), &FpEntryV4::new(EGRESS4, REMOTE4, &r)).unwrap_err();
    assert!(matches!(err, egret_bpf::BpfError::FastPathFull { map: "fp_sessions_v4" }), "{err}");
    // Replacing an existing key still works; deleting frees room.
    install4(&w.prog, L4::Udp, 1, 0);
    assert_eq!(w.prog.fp_entry_counts(), (2, 0));
    assert!(w.prog.fp_delete(&FpKeyV4::new(POD4, REMOTE4, POD_PORT, REMOTE_PORT, 17)).unwrap());
    assert!(!w.prog.fp_delete(&FpKeyV4::new(POD4, REMOTE4, POD_PORT, REMOTE_PORT, 17)).unwrap());
    assert_eq!(w.prog.fp_entry_counts(), (1, 0));
    assert_eq!(w.prog.fp_clear().unwrap(), 1);
}

/// Sizes per family: a family given no sessions gets the smallest table and
/// holds nothing (its flows stay in the engine), the other is unaffected.
#[test]
fn a_family_given_no_sessions_holds_none_and_the_other_is_unaffected() {
    let w = world_with(LoadOptions { fast_path_sessions_v4: 8, fast_path_sessions_v6: 0, ..LoadOptions::default() });
    assert_eq!(w.prog.fp_table_slots().unwrap(), (64, 64), "IPv6 gets the smallest table");
    let r = FpRewrite::default();
    let err = w
        .prog
        .fp_insert(&FpKeyV6::new(pod6(), remote6(), 1, 2, 17), &FpEntryV6::new(egress6(), remote6(), &r))
        .unwrap_err();
    assert!(matches!(err, egret_bpf::BpfError::FastPathFull { map: "fp_sessions_v6" }), "{err}");
    install4(&w.prog, L4::Udp, 0, 0);
    assert_eq!(w.prog.fp_entry_counts(), (2, 0));

    let w =
        world_with(LoadOptions { fast_path_sessions_v4: 100_000, fast_path_sessions_v6: 16, ..LoadOptions::default() });
    assert_eq!(w.prog.fp_table_slots().unwrap(), (1 << 19, 64));
}

/// A table at its configured load (64 slots, 32 directions) with a random
/// seed: keys displaced from their home slot, and moved back by removals,
/// are found by the program exactly where the daemon's writer put them,
/// and removed keys are not. Both families (IPv6 slots are two lines).
#[test]
fn a_crowded_session_table_finds_every_installed_key_and_no_removed_one() {
    let w = world_with(LoadOptions { fast_path_sessions_v4: 16, fast_path_sessions_v6: 16, ..LoadOptions::default() });
    let p = &w.prog;
    let macs_in = (PEER_MAC, GW_MAC);
    let macs_out = (OUT_MAC, NH_MAC);
    let steered = R::RedirectSteeredSource;
    let rewrite = |old: &[u8], new: &[u8], port: u16| {
        let l3 = delta(old, new);
        FpRewrite {
            new_sport: port,
            new_dport: REMOTE_PORT,
            l3_delta: if old.len() == 8 { l3 } else { 0 },
            l4_delta: l3,
            next_hop: 0,
            policy_slot: 0,
            direction: egret_bpf::fast_path::DIR_OUTBOUND,
        }
    };
    let ports: Vec<u16> = (0..32).map(|i| 40_000 + i * 7).collect();
    let mut held4 = Vec::new();
    let mut held6 = Vec::new();
    for &port in &ports {
        let r4 = rewrite(&[POD4, REMOTE4].concat(), &[EGRESS4, REMOTE4].concat(), port);
        let k4 = FpKeyV4::new(POD4, REMOTE4, port, REMOTE_PORT, 17);
        if p.fp_insert(&k4, &FpEntryV4::new(EGRESS4, REMOTE4, &r4)).is_ok() {
            held4.push(port);
        }
        let r6 = rewrite(&[pod6(), remote6()].concat(), &[egress6(), remote6()].concat(), port);
        let k6 = FpKeyV6::new(pod6(), remote6(), port, REMOTE_PORT, 17);
        if p.fp_insert(&k6, &FpEntryV6::new(egress6(), remote6(), &r6)).is_ok() {
            held6.push(port);
        }
    }
    // Sixteen keys cannot fill sixteen slots past any home: at least the
    // first sixteen of each family are in.
    assert!(held4.len() >= 16 && held6.len() >= 16, "{} / {}", held4.len(), held6.len());
    let check = |held4: &[u16], held6: &[u16], what: &str| {
        for &port in &ports {
            let f4 = frame4(macs_in, POD4, REMOTE4, 64, port, REMOTE_PORT, L4::Udp);
            let f6 = frame6(macs_in, pod6(), remote6(), 64, port, REMOTE_PORT, L4::Udp);
            if held4.contains(&port) {
                let want = frame4(macs_out, EGRESS4, REMOTE4, 63, port, REMOTE_PORT, L4::Udp);
                expect_hit(p, &format!("{what}: v4 port {port}"), &f4, &want, XdpAction::Redirect);
            } else {
                expect_punt(p, &format!("{what}: v4 port {port}"), &f4, F::Miss, steered);
            }
            if held6.contains(&port) {
                let want = frame6(macs_out, egress6(), remote6(), 63, port, REMOTE_PORT, L4::Udp);
                expect_hit(p, &format!("{what}: v6 port {port}"), &f6, &want, XdpAction::Redirect);
            } else {
                expect_punt(p, &format!("{what}: v6 port {port}"), &f6, F::Miss, steered);
            }
        }
    };
    check(&held4, &held6, "installed");
    for port in ports.iter().step_by(2) {
        if held4.contains(port) {
            assert!(p.fp_delete(&FpKeyV4::new(POD4, REMOTE4, *port, REMOTE_PORT, 17)).unwrap());
        }
        if held6.contains(port) {
            assert!(p.fp_delete(&FpKeyV6::new(pod6(), remote6(), *port, REMOTE_PORT, 17)).unwrap());
        }
    }
    let odd = |held: &[u16]| -> Vec<u16> {
        held.iter().copied().filter(|port| ports.iter().position(|p| p == port).unwrap_or(0) % 2 == 1).collect()
    };
    let (left4, left6) = (odd(&held4), odd(&held6));
    assert_eq!(p.fp_entry_counts(), (left4.len(), left6.len()));
    check(&left4, &left6, "after removing every other one");
}

/// The sequence count, under fire: one thread rewrites a session's slot
/// without pause, flipping it between two translations that differ in
/// every word of the entry (address, port and checksum delta, next hop),
/// while this thread runs the session's frame through the program. Each
/// run must give one translation whole, or a miss with the frame untouched
/// (the slot was being rewritten); a frame mixing the two is a torn read.
///
/// What it can catch here: a reader or writer that ignores the odd count
/// (with the first check removed it fails within a few hundred runs). It
/// cannot catch a missing re-check or a missing load order: on x86 the
/// slot's line arrives whole, and 1,000,000 runs without the re-check gave
/// no torn read.
#[test]
fn a_slot_rewritten_while_it_is_read_gives_one_translation_or_a_miss() {
    const RUNS: usize = 100_000;
    let w = world();
    let p = &w.prog;
    let egress4b = [203, 0, 113, 11];
    let egress6b = v6("2001:db8:e::11");
    let (macs_in, out_redirect, out_tx) = ((PEER_MAC, GW_MAC), (OUT_MAC, NH_MAC), (GW_MAC, PEER_MAC));
    let port_b = EGRESS_PORT + 1;

    let v4 = (
        frame4(macs_in, POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Udp),
        frame4(out_redirect, EGRESS4, REMOTE4, 63, EGRESS_PORT, REMOTE_PORT, L4::Udp),
        frame4(out_tx, egress4b, REMOTE4, 63, port_b, REMOTE_PORT, L4::Udp),
    );
    let v6f = (
        frame6(macs_in, pod6(), remote6(), 64, POD_PORT, REMOTE_PORT, L4::Udp),
        frame6(out_redirect, egress6(), remote6(), 63, EGRESS_PORT, REMOTE_PORT, L4::Udp),
        frame6(out_tx, egress6b, remote6(), 63, port_b, REMOTE_PORT, L4::Udp),
    );
    let k4 = FpKeyV4::new(POD4, REMOTE4, POD_PORT, REMOTE_PORT, 17);
    let k6 = FpKeyV6::new(pod6(), remote6(), POD_PORT, REMOTE_PORT, 17);
    // A: redirected out of the other interface; B: sent back out of lo (XDP_TX).
    let e4 = [
        outbound_entry(POD4, REMOTE4, EGRESS4, EGRESS_PORT, 0, 0),
        outbound_entry(POD4, REMOTE4, egress4b, port_b, 1, 0),
    ];
    let e6 = [
        outbound_entry(pod6(), remote6(), egress6(), EGRESS_PORT, 0, 0),
        outbound_entry(pod6(), remote6(), egress6b, port_b, 1, 0),
    ];
    p.fp_insert(&k4, &e4[0]).unwrap();
    p.fp_insert(&k6, &e6[0]).unwrap();
    expect_hit(p, "v4 A before the writer starts", &v4.0, &v4.1, XdpAction::Redirect);
    expect_hit(p, "v6 A before the writer starts", &v6f.0, &v6f.1, XdpAction::Redirect);

    let stop = std::sync::atomic::AtomicBool::new(false);
    let (mut a, mut b, mut missed, mut writes) = ([0usize; 2], [0usize; 2], [0usize; 2], 0u64);
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let i = (n & 1) as usize;
                p.fp_insert(&k4, &e4[i]).unwrap();
                p.fp_insert(&k6, &e6[i]).unwrap();
                n += 1;
            }
            n
        });
        for run in 0..RUNS {
            let fam = run & 1;
            let (input, want_a, want_b) = if fam == 0 { (&v4.0, &v4.1, &v4.2) } else { (&v6f.0, &v6f.1, &v6f.2) };
            let out = p.test_run(input).unwrap();
            if out.action == XdpAction::Redirect && out.frame == *want_a {
                a[fam] += 1;
            } else if out.action == XdpAction::Tx && out.frame == *want_b {
                b[fam] += 1;
            } else if out.action == XdpAction::Redirect && out.frame == *input {
                missed[fam] += 1; // steered to the AF_XDP socket, untouched
            } else {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                panic!(
                    "run {run} (IPv{}): {:?} with a frame that is neither translation nor the input:\n{}\nA: {}\nB: {}",
                    if fam == 0 { 4 } else { 6 },
                    out.action,
                    egret_dataplane::fixtures::hex(&out.frame),
                    egret_dataplane::fixtures::hex(want_a),
                    egret_dataplane::fixtures::hex(want_b)
                );
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        writes = writer.join().unwrap();
    });
    eprintln!(
        "{writes} rewrites of each slot; IPv4 A {} B {} miss {}; IPv6 A {} B {} miss {}",
        a[0], b[0], missed[0], a[1], b[1], missed[1]
    );
    // Both translations were read whole in each family, so the runs did
    // overlap the rewrites.
    assert!(a.iter().chain(&b).all(|&n| n > 0), "A {a:?} B {b:?} after {writes} rewrites");
}

// ------------------------------------------------------------ measurement

/// A namespace with a veth device `out0`, an on-link route to the
/// remote side and a permanent neighbour, so `bpf_fib_lookup` resolves the
/// same next hop the table holds. Deleted on drop.
fn fib_ns() -> NetnsGuard {
    let ns = NetnsGuard::unique("egfp", &[""]).lo_up().create().unwrap_or_else(|e| panic!("{e}"));
    let name = ns.name(0);
    let ip = |args: &[&str]| {
        let out = std::process::Command::new("ip").args(args).output().unwrap();
        assert!(out.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    // No dummy driver on this kernel: a veth pair.
    ip(&["-n", name, "link", "add", "out0", "address", "02:00:00:00:00:03", "type", "veth", "peer", "name", "out1"]);
    ip(&["-n", name, "link", "set", "out0", "up"]);
    ip(&["-n", name, "link", "set", "out1", "up"]);
    ip(&["-n", name, "addr", "add", "203.0.113.2/24", "dev", "out0"]);
    // bpf_fib_lookup answers "forwarding disabled" otherwise.
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", name, "sysctl", "-qw", "net.ipv4.conf.all.forwarding=1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    ip(&["-n", name, "route", "add", "198.51.100.0/24", "via", "203.0.113.1", "dev", "out0"]);
    ip(&["-n", name, "neigh", "add", "203.0.113.1", "lladdr", "02:00:00:00:00:fe", "dev", "out0", "nud", "permanent"]);
    ip(&["-n", name, "neigh", "add", "203.0.113.99", "lladdr", "02:00:00:00:00:fe", "dev", "out0", "nud", "permanent"]);
    // The measurement translates inbound frames back to the egress IP.
    ip(&["-n", name, "neigh", "add", "203.0.113.10", "lladdr", "02:00:00:00:00:fe", "dev", "out0", "nud", "permanent"]);
    ns
}

/// Makes translated frames translate back: an entry for the frame `fwd`
/// produces, undoing it (negated deltas). BPF_PROG_TEST_RUN repeats run on
/// the same buffer, so without this every run after the first would measure
/// a miss. Each run is then a hit; TTL falls by one per run.
fn ping_pong4(prog: &SteeringProgram, fwd: &FpKeyV4, to: &FpEntryV4) {
    let back_key = FpKeyV4 {
        src: to.new_src,
        dst: to.new_dst,
        sport: to.new_sport,
        dport: to.new_dport,
        proto: fwd.proto,
        pad: [0; 3],
    };
    let old = [fwd.src, fwd.dst].concat();
    let new = [to.new_src, to.new_dst].concat();
    let old_p = [fwd.sport, fwd.dport].concat();
    let new_p = [to.new_sport, to.new_dport].concat();
    let r = FpRewrite {
        new_sport: u16::from_be_bytes(fwd.sport),
        new_dport: u16::from_be_bytes(fwd.dport),
        l3_delta: delta(&new, &old),
        l4_delta: add(delta(&new, &old), delta(&new_p, &old_p)),
        next_hop: to.next_hop,
        policy_slot: 0,
        direction: egret_bpf::fast_path::DIR_OUTBOUND,
    };
    prog.fp_insert(&back_key, &FpEntryV4::new(fwd.src, fwd.dst, &r)).unwrap();
}

/// Not a check: the fast path's in-kernel cost per frame with the next-hop
/// table and with `bpf_fib_lookup`, next to the steering paths it replaces.
/// `cargo test -p egret-bpf --release --test fast_path measure -- --ignored --nocapture`
#[test]
#[ignore = "measurement, prints numbers"]
fn measure_fast_path_cost() {
    let ns = fib_ns();
    let name = ns.name(0).to_owned();
    std::thread::spawn(move || {
        egret_dataplane::netns::enter_named(&name).unwrap();
        let ingress = egret_dataplane::netns::ifindex("out0").unwrap();
        let table = world();
        let fib = SteeringProgram::load_variant(ProgramVariant::FibLookup, LoadOptions::default())
            .expect("fib variant loads");
        fib.fp_set_enabled(true).unwrap();
        for p in [&table.prog, &fib] {
            install4(p, L4::Udp, 0, 0);
            for (k, e) in [
                (FpKeyV4::new(POD4, REMOTE4, POD_PORT, REMOTE_PORT, 17), true),
                (FpKeyV4::new(REMOTE4, EGRESS4, REMOTE_PORT, EGRESS_PORT, 17), false),
            ] {
                let entry = p.fp_get(&k).unwrap().unwrap();
                let _ = e;
                ping_pong4(p, &k, &entry);
            }
        }
        let out = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 255, POD_PORT, REMOTE_PORT, L4::Udp);
        let inbound = frame4((PEER_MAC, GW_MAC), REMOTE4, EGRESS4, 255, REMOTE_PORT, EGRESS_PORT, L4::Udp);
        let miss = frame4((PEER_MAC, GW_MAC), POD4, REMOTE4, 255, POD_PORT + 1, REMOTE_PORT, L4::Udp);
        // 200 runs per call (TTL 255 -> 55: every run a hit), best of 2000
        // calls; ingress out0, so bpf_fib_lookup resolves in this namespace.
        let best = |p: &SteeringProgram, f: &[u8]| {
            let mut best = std::time::Duration::MAX;
            let mut action = XdpAction::Aborted;
            for _ in 0..2000 {
                let o = p.test_run_on(f, ingress, 0, 200).unwrap();
                best = best.min(o.duration);
                action = o.action;
            }
            (best.as_nanos(), action)
        };
        let hits = |p: &SteeringProgram| {
            p.verdict_counters()
                .unwrap()
                .into_iter()
                .filter(|(r, _)| *r == R::RedirectFastPath)
                .map(|(_, n)| n)
                .sum::<u64>()
        };
        let h0 = hits(&table.prog);
        let rows = [
            ("hit, next-hop table (outbound)", best(&table.prog, &out)),
            ("hit, next-hop table (inbound)", best(&table.prog, &inbound)),
            ("hit, bpf_fib_lookup (outbound)", best(&fib, &out)),
            ("hit, bpf_fib_lookup (inbound)", best(&fib, &inbound)),
            ("miss, then steered to AF_XDP (no socket here: drop)", best(&table.prog, &miss)),
        ];
        assert_eq!(hits(&table.prog) - h0, 2 * 2000 * 200, "every measured run of the table was a hit");
        let punts: Vec<_> = fib.fp_counters().unwrap().into_iter().filter(|(_, n)| *n > 0).collect();
        println!("fib variant's fast-path counters: {punts:?}");
        table.prog.fp_set_enabled(false).unwrap();
        let off = best(&table.prog, &out);
        for (name, (ns, action)) in rows {
            println!("{name:55} {ns:>4} ns/frame  ({action:?})");
        }
        println!("{:55} {:>4} ns/frame  ({:?})", "fast path off: steering only (drop, no socket)", off.0, off.1);
    })
    .join()
    .unwrap();
    drop(ns);
}

#[test]
fn bpf_fib_lookup_is_refused_to_the_gateways_licence() {
    // The same source with the fib-lookup next hop: with the licence string
    // "GPL" it loads; with the gateway's "Apache-2.0" the verifier refuses
    // it (bpf_fib_lookup is a GPL-only helper). The gateway's build does not
    // reference the helper and loads under Apache-2.0 (every other test).
    //
    // libbpf prints the verifier's refusal (about 300 lines, ending "BPF
    // program load failed: Invalid argument") through its print callback:
    // collected here instead, so the expected refusal does not look like a
    // failure in the test output, and checked for the reason.
    static LOG: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());
    fn collect(_: libbpf_rs::PrintLevel, msg: String) {
        LOG.lock().unwrap_or_else(|e| e.into_inner()).push_str(&msg);
    }
    let gpl = SteeringProgram::load_variant(ProgramVariant::FibLookup, LoadOptions::default());
    assert!(gpl.is_ok(), "{:?}", gpl.err());
    let previous = libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Warn, collect)));
    let apache = SteeringProgram::load_variant(ProgramVariant::FibLookupApacheLicensed, LoadOptions::default());
    libbpf_rs::set_print(previous);
    let log = std::mem::take(&mut *LOG.lock().unwrap_or_else(|e| e.into_inner()));
    assert!(matches!(apache, Err(egret_bpf::BpfError::Load(_))), "{:?}", apache.err());
    assert!(
        log.contains("cannot call GPL-restricted function from non-GPL compatible program"),
        "refused for another reason:\n{log}"
    );
}

/// A TCP segment with ACK `ack` and window `window` (no payload), as
/// `frame4`/`frame6` build them otherwise.
fn ack_segment<const N: usize>(
    macs: ([u8; 6], [u8; 6]),
    src: [u8; N],
    dst: [u8; N],
    hops: u8,
    ports: (u16, u16),
    (ack, window): (u32, u16),
) -> Vec<u8> {
    let eth = PacketBuilder::ethernet2(macs.0, macs.1);
    let ip = match (<[u8; 4]>::try_from(&src[..]), <[u8; 4]>::try_from(&dst[..])) {
        (Ok(s), Ok(d)) => eth.ipv4(s, d, hops),
        _ => {
            let (s, d) = (<[u8; 16]>::try_from(&src[..]).unwrap(), <[u8; 16]>::try_from(&dst[..]).unwrap());
            eth.ipv6(s, d, hops)
        }
    };
    let mut v = Vec::new();
    ip.tcp(ports.0, ports.1, 1000, window).ack(ack).write(&mut v, &[]).unwrap();
    v
}

/// The fast path records, in each direction's own slot, the acknowledgment
/// number and window of the TCP segments with ACK it translates (the
/// engine's RST window check of an offloaded session reads them); the
/// translated frame is what it is without the record, and a punted segment
/// or a rewrite of the slot leaves no record that counts.
#[test]
fn translated_tcp_segments_leave_their_ack_and_window_in_their_slot() {
    let w = world();
    let p = &w.prog;
    p.fp_clear().unwrap();
    install4(p, ACK, 0, 3);
    install6(p, ACK, 0, 3);
    let (macs_in, macs_out) = ((PEER_MAC, GW_MAC), (OUT_MAC, NH_MAC));
    let tcp = 6;
    let out4 = FpKey::new(POD4, REMOTE4, POD_PORT, REMOTE_PORT, tcp);
    let in4 = FpKey::new(REMOTE4, EGRESS4, REMOTE_PORT, EGRESS_PORT, tcp);
    let out6 = FpKey::new(pod6(), remote6(), POD_PORT, REMOTE_PORT, tcp);
    assert_eq!((p.fp_tcp_seen(&out4), p.fp_tcp_seen(&in4), p.fp_tcp_seen(&out6)), (None, None, None));

    let seg = (0xfffe_0001, 513);
    let frame = ack_segment(macs_in, POD4, REMOTE4, 64, (POD_PORT, REMOTE_PORT), seg);
    let want = ack_segment(macs_out, EGRESS4, REMOTE4, 63, (EGRESS_PORT, REMOTE_PORT), seg);
    expect_hit(p, "ack4 outbound", &frame, &want, XdpAction::Redirect);
    assert_eq!(p.fp_tcp_seen(&out4), Some(seg), "recorded in the outbound slot");
    assert_eq!(p.fp_tcp_seen(&in4), None, "the other direction's slot is its own");

    let later = (0x0000_0010, 0);
    let frame = ack_segment(macs_in, POD4, REMOTE4, 64, (POD_PORT, REMOTE_PORT), later);
    let want = ack_segment(macs_out, EGRESS4, REMOTE4, 63, (EGRESS_PORT, REMOTE_PORT), later);
    expect_hit(p, "a later ack4", &frame, &want, XdpAction::Redirect);
    assert_eq!(p.fp_tcp_seen(&out4), Some(later), "the latest segment's, a zero window included");

    let back = (77, 65535);
    let frame = ack_segment(macs_in, REMOTE4, EGRESS4, 50, (REMOTE_PORT, EGRESS_PORT), back);
    let want = ack_segment(macs_out, REMOTE4, POD4, 49, (REMOTE_PORT, POD_PORT), back);
    expect_hit(p, "ack4 inbound", &frame, &want, XdpAction::Redirect);
    assert_eq!(p.fp_tcp_seen(&in4), Some(back));
    assert_eq!(p.fp_tcp_seen(&out4), Some(later));

    let seg6 = (0x1234_5678, 0xffff);
    let frame = ack_segment(macs_in, pod6(), remote6(), 64, (POD_PORT, REMOTE_PORT), seg6);
    let want = ack_segment(macs_out, egress6(), remote6(), 63, (EGRESS_PORT, REMOTE_PORT), seg6);
    expect_hit(p, "ack6 outbound", &frame, &want, XdpAction::Redirect);
    assert_eq!(p.fp_tcp_seen(&out6), Some(seg6));

    // A punted segment (a FIN) records nothing: the engine sees it itself.
    let fin = frame4(macs_in, POD4, REMOTE4, 64, POD_PORT, REMOTE_PORT, L4::Tcp { syn: false, fin: true, rst: false });
    let (out, _, f) = run(p, &fin);
    assert_eq!(f, vec![(F::PuntTcpControl, 1)]);
    assert_eq!(out.frame, fin);
    assert_eq!(p.fp_tcp_seen(&out4), Some(later), "a punted segment is not recorded");

    // Userspace rewriting the entry (a re-route, a new tenant) voids the record.
    install4(p, ACK, 0, 3);
    assert_eq!(p.fp_tcp_seen(&out4), None, "a record from before the rewrite does not count");
}
