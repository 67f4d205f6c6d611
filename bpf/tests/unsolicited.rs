//! Unsolicited inbound traffic through BPF_PROG_TEST_RUN: NAT ports no
//! session maps are dropped in XDP (rule 4a, `nat_port_bits`), and first
//! fragments sent to an egress address cannot evict a pod's datagram's
//! decision (rule 6, `frag_decisions_in` apart from `frag_decisions`).
//!
//! World (TEST-NET only): 203.0.113.10 an egress address with NAT ports
//! 20000-29999; 198.51.100.0/24 pods steered to 0.0.0.0/0; an AF_XDP socket
//! (unbound, enough for the XSKMAP lookup) on the loopback's queue 0,
//! BPF_PROG_TEST_RUN's receiving interface. Needs root.
// Test harness: helpers outside #[test] functions unwrap and panic freely.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::IpAddr;
use std::os::fd::AsRawFd;

use egret_bpf::{Action, DstRule, LoadOptions, OwnedAddr, SrcPrefix, SteeringProgram, VerdictReason as R, XdpAction};
use etherparse::{IpFragOffset, IpHeaders, IpNumber, Ipv4Header, PacketBuilder};

const GW_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const EGRESS: [u8; 4] = [203, 0, 113, 10];
const POD: [u8; 4] = [198, 51, 100, 7];
const INTERNET: [u8; 4] = [203, 0, 113, 99];
const REMOTE: [u8; 4] = [192, 0, 2, 5];
const NAT_LO: u16 = 20000;
const NAT_HI: u16 = 29999;
const LO: u32 = 1;
const UDP: u8 = 17;
const TCP: u8 = 6;

fn udp(src: [u8; 4], dst: [u8; 4], dport: u16) -> Vec<u8> {
    let b = PacketBuilder::ethernet2(PEER_MAC, GW_MAC).ipv4(src, dst, 64).udp(40000, dport);
    let mut v = Vec::new();
    b.write(&mut v, &[0u8; 8]).unwrap();
    v
}

fn tcp(src: [u8; 4], dst: [u8; 4], dport: u16) -> Vec<u8> {
    let b = PacketBuilder::ethernet2(PEER_MAC, GW_MAC).ipv4(src, dst, 64).tcp(40000, dport, 1, 1024).syn();
    let mut v = Vec::new();
    b.write(&mut v, &[]).unwrap();
    v
}

/// An IPv4 fragment of datagram `id`: offset 0 carries a UDP header to
/// `dport`, later ones 8 bytes of payload.
fn frag(src: [u8; 4], dst: [u8; 4], id: u16, offset_units: u16, more: bool, dport: u16) -> Vec<u8> {
    let mut h = Ipv4Header::new(0, 64, IpNumber::UDP, src, dst).unwrap();
    h.identification = id;
    h.more_fragments = more;
    h.fragment_offset = IpFragOffset::try_new(offset_units).unwrap();
    let mut payload = Vec::new();
    if offset_units == 0 {
        payload.extend_from_slice(&40000u16.to_be_bytes());
        payload.extend_from_slice(&dport.to_be_bytes());
        payload.extend_from_slice(&[0, 16, 0, 0]);
    }
    payload.extend_from_slice(&[0u8; 8]);
    h.set_payload_len(payload.len()).unwrap();
    let b = PacketBuilder::ethernet2(PEER_MAC, GW_MAC).ip(IpHeaders::Ipv4(h, Default::default()));
    let mut v = Vec::new();
    b.write(&mut v, IpNumber::UDP, &payload).unwrap();
    v
}

struct World {
    prog: SteeringProgram,
    _xsk: socket2::Socket,
}

fn world(options: LoadOptions) -> World {
    let prog = SteeringProgram::load(options).expect("load (run as root)");
    prog.set_owned(IpAddr::from(EGRESS), OwnedAddr::egress(NAT_LO, NAT_HI)).unwrap();
    let sources = vec![SrcPrefix { prefix: "198.51.100.0/24".parse().unwrap(), class: 1 }];
    let rules = vec![DstRule { class: 1, prefix: "0.0.0.0/0".parse().unwrap(), action: Action::Steer, policy_id: 1 }];
    prog.replace_policy(&sources, &rules).unwrap();
    let xsk = socket2::Socket::new(socket2::Domain::from(libc::AF_XDP), socket2::Type::from(libc::SOCK_RAW), None)
        .expect("AF_XDP socket (run as root)");
    prog.register_xsk(LO, 0, xsk.as_raw_fd()).unwrap();
    World { prog, _xsk: xsk }
}

fn counter(prog: &SteeringProgram, reason: R) -> u64 {
    prog.verdict_counters().unwrap().into_iter().find(|(r, _)| *r == reason).map_or(0, |(_, n)| n)
}

/// Runs `frame` and checks the action and that `reason` counted it.
fn check(prog: &SteeringProgram, what: &str, frame: &[u8], action: XdpAction, reason: R) {
    let before = counter(prog, reason);
    let out = prog.test_run(frame).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert_eq!((out.action, counter(prog, reason) - before), (action, 1), "{what}: action and {reason:?}");
}

#[test]
fn unmapped_nat_ports_are_dropped_in_xdp_and_mapped_ones_reach_the_workers() {
    let w = world(LoadOptions::default());
    let ports = w.prog.mapped_ports();
    let egress = IpAddr::from(EGRESS);
    // Not tracked: not filtered (the workers judge it, as before).
    check(&w.prog, "untracked", &udp(REMOTE, EGRESS, NAT_LO), XdpAction::Redirect, R::RedirectNatPort);
    ports.track(egress, UDP).unwrap();
    ports.track(egress, TCP).unwrap();
    for port in [NAT_LO, 24_321, NAT_HI] {
        check(&w.prog, "unmapped udp", &udp(REMOTE, EGRESS, port), XdpAction::Drop, R::DropUnmappedNatPort);
        check(&w.prog, "unmapped tcp", &tcp(REMOTE, EGRESS, port), XdpAction::Drop, R::DropUnmappedNatPort);
    }
    // A session maps UDP 24321: its replies (and only UDP's) pass on.
    ports.set(egress, UDP, 24_321, true);
    assert_eq!(ports.is_mapped(egress, UDP, 24_321), Some(true));
    check(&w.prog, "mapped udp", &udp(REMOTE, EGRESS, 24_321), XdpAction::Redirect, R::RedirectNatPort);
    check(&w.prog, "a neighbour port", &udp(REMOTE, EGRESS, 24_320), XdpAction::Drop, R::DropUnmappedNatPort);
    check(&w.prog, "tcp, same port", &tcp(REMOTE, EGRESS, 24_321), XdpAction::Drop, R::DropUnmappedNatPort);
    // Its last session gone: dropped again.
    ports.set(egress, UDP, 24_321, false);
    check(&w.prog, "unmapped again", &udp(REMOTE, EGRESS, 24_321), XdpAction::Drop, R::DropUnmappedNatPort);
    // Forgotten (the egress IP moved away): the slot's entry is gone.
    ports.forget(egress);
    assert_eq!(ports.is_mapped(egress, UDP, 24_321), None);
    check(&w.prog, "forgotten", &udp(REMOTE, EGRESS, NAT_LO), XdpAction::Redirect, R::RedirectNatPort);
}

#[test]
fn external_first_fragments_do_not_evict_a_steered_datagrams_decision() {
    // A small LRU, so the flood is many times its size.
    let w = world(LoadOptions { fragments: 64, ..LoadOptions::default() });
    let ports = w.prog.mapped_ports();
    let egress = IpAddr::from(EGRESS);
    ports.track(egress, UDP).unwrap();
    ports.set(egress, UDP, NAT_LO, true);

    check(
        &w.prog,
        "pod's first fragment",
        &frag(POD, INTERNET, 7, 0, true, 53),
        XdpAction::Redirect,
        R::RedirectSteeredSource,
    );
    // The flood: first fragments to the egress address, to the mapped port
    // (stored, apart) and to unmapped ones (dropped, not stored).
    for id in 0..2_000u16 {
        let dport = if id % 2 == 0 { NAT_LO } else { NAT_LO + 1 + id };
        let frame = frag(REMOTE, EGRESS, id, 0, true, dport);
        w.prog.test_run(&frame).unwrap();
    }
    assert_eq!(counter(&w.prog, R::DropUnmappedNatPort), 1_000);
    assert!(w.prog.fragment_decisions_inbound() <= 64 + 64, "bounded by its own LRU");
    // The pod's later fragment follows its stored decision (not rule 5's
    // fallback, which would count RedirectFragmentSteeredSource).
    check(
        &w.prog,
        "pod's later fragment",
        &frag(POD, INTERNET, 7, 9, false, 0),
        XdpAction::Redirect,
        R::RedirectFragment,
    );
    // A recent reply's later fragment still follows its own decision.
    check(
        &w.prog,
        "reply's later fragment",
        &frag(REMOTE, EGRESS, 1_998, 9, false, 0),
        XdpAction::Redirect,
        R::RedirectFragment,
    );
    // An unmapped port's later fragment has nothing stored: an orphan,
    // redirected within the CPU's budget (the workers hold it until its
    // hold times out; ADR 0020).
    check(
        &w.prog,
        "unmapped later fragment",
        &frag(REMOTE, EGRESS, 1_999, 9, false, 0),
        XdpAction::Redirect,
        R::RedirectFragmentToEgress,
    );
}

/// A writer's kept place ([`egret_bpf::SlotTicket`]) marks the pair's
/// ports without the lookup, and once the pair is forgotten it writes
/// nothing, even after every other slot is taken and the pair's old slot
/// is another address's.
#[test]
fn a_kept_slot_marks_its_pair_until_the_pair_is_forgotten() {
    let w = world(LoadOptions::default());
    let ports = w.prog.mapped_ports();
    let egress = IpAddr::from(EGRESS);
    ports.track(egress, UDP).unwrap();
    let at = ports.locate(egress, UDP).expect("tracked");
    assert!(ports.set_at(at, 24_321, true));
    assert_eq!(ports.is_mapped(egress, UDP, 24_321), Some(true));
    check(&w.prog, "marked through the ticket", &udp(REMOTE, EGRESS, 24_321), XdpAction::Redirect, R::RedirectNatPort);
    assert!(ports.set_at(at, 24_321, false));
    check(&w.prog, "cleared through it", &udp(REMOTE, EGRESS, 24_321), XdpAction::Drop, R::DropUnmappedNatPort);

    ports.forget(egress);
    assert!(!ports.set_at(at, 24_321, true), "a forgotten pair's ticket is stale");
    // Take every slot: freed slots are reused last, so the last pair
    // tracked gets the forgotten pair's.
    let others: Vec<IpAddr> =
        (0..egret_bpf::maps::NAT_PORT_SLOTS).map(|i| IpAddr::from([198, 18, (i >> 8) as u8, i as u8])).collect();
    for a in &others {
        ports.track(*a, UDP).unwrap();
    }
    let reuser = others.iter().copied().find(|a| ports.locate(*a, UDP).is_some_and(|t| t.slot == at.slot));
    let reuser = reuser.expect("the forgotten slot is taken again");
    assert!(!ports.set_at(at, 24_321, true), "stale on a slot another address now has");
    assert_eq!(ports.is_mapped(reuser, UDP, 24_321), Some(false), "the new owner's bits untouched");
    assert_ne!(ports.locate(reuser, UDP), Some(at), "a new generation");
}
