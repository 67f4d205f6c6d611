//! Named drop reasons and per-worker counters.
//!
//! Every frame the engine refuses is counted under a [`DropReason`] (VPP and
//! Katran style): no logging on the hot path, and never a panic. Each worker
//! owns one [`WorkerStats`]; it is the only writer, so counters are bumped with
//! a relaxed load and store instead of an atomic read-modify-write. Readers
//! (metrics, the admin socket) sum the workers' snapshots.

use std::sync::atomic::{AtomicU64, Ordering};

/// A counter with a single writer (its worker) and any number of readers.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`. Only the owning worker may call this.
    #[inline]
    pub fn add(&self, n: u64) {
        // Single writer: a plain load + store is enough and avoids a locked RMW.
        self.0.store(self.0.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
    }

    /// Adds one.
    #[inline]
    pub fn inc(&self) {
        self.add(1);
    }

    /// The current value.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

macro_rules! named_enum {
    ($(#[$m:meta])* $vis:vis enum $name:ident { $($(#[$vm:meta])* $variant:ident => $text:literal,)* }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[repr(u16)]
        $vis enum $name { $($(#[$vm])* $variant,)* }

        impl $name {
            /// Every value, in declaration order (`ALL[x as usize] == x`).
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];
            /// How many values there are.
            pub const COUNT: usize = $name::ALL.len();

            /// The snake_case name used in metrics and admin output.
            pub const fn name(self) -> &'static str {
                match self { $($name::$variant => $text,)* }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

named_enum! {
    /// Why a frame was dropped. Stable names: they are metric labels.
    pub enum DropReason {
        /// Ethernet header truncated, or more than one VLAN tag.
        MalformedEthernet => "malformed_ethernet",
        /// ARP that is not Ethernet/IPv4 or is truncated.
        MalformedArp => "malformed_arp",
        /// IPv4 header invalid (version, IHL, total length).
        MalformedIpv4 => "malformed_ipv4",
        /// IPv4 header checksum wrong (RFC 1812 5.2.2).
        BadIpv4Checksum => "bad_ipv4_checksum",
        /// IPv6 header or extension headers invalid, or too many of them.
        MalformedIpv6 => "malformed_ipv6",
        /// TCP header invalid (data offset, truncated).
        MalformedTcp => "malformed_tcp",
        /// UDP header invalid (length, truncated).
        MalformedUdp => "malformed_udp",
        /// ICMP or ICMPv6 header truncated.
        MalformedIcmp => "malformed_icmp",
        /// An ICMP error whose checksum does not verify (it would be rewritten).
        BadIcmpChecksum => "bad_icmp_checksum",
        /// A neighbour solicitation failing RFC 4861 7.1.1 validation.
        MalformedNeighborSolicit => "malformed_neighbor_solicit",
        /// A selected source sent a protocol Egret cannot translate (not TCP, UDP, ICMP).
        UnsupportedProtocol => "unsupported_protocol",
        /// A selected source sent an ICMP type that is neither echo nor an error.
        UnsupportedIcmpType => "unsupported_icmp_type",
        /// A TCP segment without SYN and no session, with loose pick-up disabled.
        TcpNoSession => "tcp_no_session",
        /// The policy's egress IP for this source is held by another gateway.
        EgressIpNotOwned => "egress_ip_not_owned",
        /// The policy has no egress IP of the packet's address family.
        NoEgressIpForFamily => "no_egress_ip_for_family",
        /// No free port on the egress IP within the bounded attempts.
        PortsExhausted => "ports_exhausted",
        /// The session table is full and nothing could be evicted.
        SessionTableFull => "session_table_full",
        /// The source already has its maximum number of sessions.
        SourceSessionLimit => "source_session_limit",
        /// Inbound to a NAT port that no mapping uses.
        InboundNoMapping => "inbound_no_mapping",
        /// Inbound to a mapped port from an endpoint the pod did not contact.
        InboundFiltered => "inbound_filtered",
        /// An ICMP error whose embedded header matches no session.
        IcmpErrorUnmatched => "icmp_error_unmatched",
        /// An ICMP error whose embedded packet is too short to match.
        IcmpErrorTruncated => "icmp_error_truncated",
        /// A non-first fragment whose first fragment was not seen.
        FragmentUnmatched => "fragment_unmatched",
        /// The fragment cache had no room for a new datagram.
        FragmentCacheFull => "fragment_cache_full",
        /// A later fragment waiting for its first fragment was displaced by a
        /// newer one (its datagram's, its source's or the worker's queue was full).
        FragmentHoldOverflow => "fragment_hold_overflow",
        /// A later fragment waited for its first fragment longer than the
        /// hold's timeout (1 s): the first was lost, or never sent.
        FragmentHoldTimeout => "fragment_hold_timeout",
        /// TTL or hop limit would reach zero.
        TtlExceeded => "ttl_exceeded",
        /// No route to the translated destination.
        NoRoute => "no_route",
        /// The next hop's link-layer address is not known yet (resolution requested).
        NeighborUnresolved => "neighbor_unresolved",
        /// The frame buffer is too small for the reply to be written.
        BufferTooSmall => "buffer_too_small",
        /// The source already holds its quota of ports on the egress IP (`nat.maxPortsPerSource`).
        SourcePortQuota => "source_port_quota",
        /// The frame would be sent from or to (or answer ARP/NDP for) an
        /// address past its valid-until: its Lease may be another gateway's
        /// by now (ownership.rs).
        OwnershipExpired => "ownership_expired",
        /// A frame waiting for its next hop's resolution was displaced by a
        /// newer one (the next hop's queue or the worker's queues were full;
        /// the kernel's `unres_discards`).
        NeighborQueueOverflow => "neighbor_queue_overflow",
        /// A frame waited for its next hop's resolution longer than the
        /// queue's timeout (the kernel gives up after about 3 s too).
        NeighborQueueTimeout => "neighbor_queue_timeout",
        /// A selected source arrived on an outside interface (anti-spoofing, docs/config.md).
        SteeredOnOutside => "steered_on_outside",
        /// A selected source from a link-layer sender not in the interface's `podSourceMacs`.
        SteeredFromUnknownMac => "steered_from_unknown_mac",
        /// To an egress IP that is not a Service VIP: not a NAT port, ICMP error or echo.
        UnservedToEgress => "unserved_to_egress",
        /// An echo request to an egress IP beyond the worker's answer rate.
        EchoRateLimited => "echo_rate_limited",
        /// An outbound ICMP error about a session, sent by another selected
        /// source than the session's pod (a pod speaking for another pod).
        IcmpErrorSpoofed => "icmp_error_spoofed",
        /// Larger than the egress interface's MTU (IPv4 with DF set, or not:
        /// Egret does not fragment; IPv6): Fragmentation Needed / Packet Too
        /// Big goes back to the sender, rate-limited.
        MtuExceeded => "mtu_exceeded",
        /// A source creating sessions faster than `nat.newFlowsPerSecondPerSource`
        /// (beyond its burst) on this worker: its new flow is dropped, its
        /// existing sessions are untouched (nat/flow_rate.rs).
        NewFlowRateLimited => "new_flow_rate_limited",
        /// A new flow's packet (outbound, or inbound under
        /// endpoint-independent filtering) that met its flow's session
        /// being made by another worker and still not live after a short
        /// wait (its maker stopped between two steps), or being removed
        /// (nat/table.rs `made_first`): dropped; the flow's next packet
        /// finds the session, or makes it again.
        SessionRace => "session_race",
        /// A translated packet to a pod behind a link Egret does not drive
        /// (an overlay's tunnel) that the gateway's kernel refused
        /// (kernel_tx.rs: over the route's MTU, send buffer full, no route).
        KernelSendFailed => "kernel_send_failed",
        /// A tunnel frame (UDP to the tunnel port of an egress IP) on an
        /// outside interface: nodes send from the inside (docs/adr/0031).
        DecapOnOutside => "decap_on_outside",
        /// A tunnel frame whose outer source is no Node's InternalIP.
        DecapUnknownNode => "decap_unknown_node",
        /// A tunnel frame that is an outer IPv4 fragment (the nodes' route
        /// MTU keeps them whole; a smaller path MTU between subnets shows here).
        DecapFragment => "decap_fragment",
        /// A tunnel frame with bad lengths or a Geneve header Egret's nodes
        /// do not send (version, options, O/C bits, protocol, VNI).
        DecapMalformed => "decap_malformed",
        /// A tunnel frame whose inner frame is not untagged IPv4 or IPv6.
        DecapNotIp => "decap_not_ip",
        /// A tunnel frame whose inner packet is not a selected pod's to
        /// translate (it would be passed or answered otherwise: never).
        DecapNotSteered => "decap_not_steered",
    }
}

named_enum! {
    /// Events that are not drops but are worth counting.
    pub enum Event {
        /// A session was created from an outbound packet.
        SessionCreatedOutbound => "session_created_outbound",
        /// A session was created from an inbound packet (endpoint-independent filtering).
        SessionCreatedInbound => "session_created_inbound",
        /// A session expired (idle timeout) and was removed.
        SessionExpired => "session_expired",
        /// A session was evicted because the table was full.
        SessionEvicted => "session_evicted",
        /// A session was removed because its policy or egress IP no longer holds.
        SessionInvalidated => "session_invalidated",
        /// A frame arrived with a partial (pseudo-header only) checksum and was completed.
        PartialChecksumCompleted => "partial_checksum_completed",
        /// A frame's full checksum happened to equal its pseudo-header sum,
        /// the mark of a partial one (about 1 frame in 65536): found complete
        /// over the segment and translated as such. The fast path punts these
        /// as `punt_partial_checksum`.
        ChecksumLookedPartial => "checksum_looked_partial",
        /// A hairpinned packet (pod to another pod's mapping) was translated twice.
        Hairpinned => "hairpinned",
        /// A frame from a node's tunnel was decapsulated by a worker
        /// (the XDP program's own count is `fast_path` / `redirect_decap`).
        Decapsulated => "decapsulated",
        /// An ICMP error was translated by its embedded header.
        IcmpErrorTranslated => "icmp_error_translated",
        /// A non-first fragment was translated through the fragment cache.
        FragmentTranslated => "fragment_translated",
        /// A later fragment that arrived before its first fragment was held.
        FragmentHeld => "fragment_held",
        /// A held fragment was sent once its first fragment was translated.
        FragmentHeldSent => "fragment_held_sent",
        /// An ARP request or neighbour solicitation was answered.
        NeighborAnswered => "neighbor_answered",
        /// The pod's own port was kept as the external port.
        PortPreserved => "port_preserved",
        /// A random external port was chosen (the pod's port was taken or out of range).
        PortRandomized => "port_randomized",
        /// A confirmed session was queued for the XDP fast path.
        OffloadRequested => "offload_requested",
        /// A frame to an unresolved next hop was queued until it resolves.
        NeighborQueued => "neighbor_queued",
        /// A queued frame was sent once its next hop resolved.
        NeighborQueueSent => "neighbor_queue_sent",
        /// An echo request to an egress IP was answered.
        EchoAnswered => "echo_answered",
        /// An ICMP error (Time Exceeded, Fragmentation Needed, Packet Too
        /// Big) was generated for a dropped packet.
        IcmpErrorSent => "icmp_error_sent",
        /// An ICMP error was not generated: beyond the worker's rate
        /// (RFC 1812 4.3.2.8, RFC 4443 2.4(f)).
        IcmpErrorRateLimited => "icmp_error_rate_limited",
        /// A TCP RST outside the session's receive window: passed on without
        /// closing the session (RFC 5961 3.2).
        TcpRstOutOfWindow => "tcp_rst_out_of_window",
        /// A translated packet to a pod whose route leaves through a link
        /// Egret does not drive (an overlay's tunnel device) was handed to
        /// the gateway's kernel, which encapsulates it (kernel_tx.rs).
        ToKernel => "to_kernel",
        /// A translation log record (a session's creation or end) was
        /// dropped: the worker's ring was full, the exporter behind
        /// (translog.rs, docs/adr/0034-translation-logs.md).
        TranslogRingFull => "translog_ring_full",
    }
}

/// Traffic direction through the gateway.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Direction {
    /// Pod to the outside (source translated).
    Outbound = 0,
    /// Outside to the pod (destination translated back).
    Inbound = 1,
}

/// How many policies per-policy counters can tell apart. Policies beyond this
/// share the last slot (their traffic is still counted, under "other").
pub const POLICY_COUNTER_SLOTS: usize = 1024;

/// Packets and bytes for one policy slot in one direction.
#[derive(Debug, Default)]
pub struct Traffic {
    /// Packets.
    pub packets: Counter,
    /// Bytes (Ethernet frame length).
    pub bytes: Counter,
}

/// The counters of one worker.
#[derive(Debug)]
pub struct WorkerStats {
    /// Frames rewritten and sent on.
    pub forwarded: Counter,
    /// Frames answered (ARP, NDP).
    pub answered: Counter,
    /// Frames left to the kernel.
    pub passed: Counter,
    drops: Box<[Counter]>,
    events: Box<[Counter]>,
    policy: Box<[[Traffic; 2]]>,
}

impl Default for WorkerStats {
    fn default() -> Self {
        WorkerStats {
            forwarded: Counter::default(),
            answered: Counter::default(),
            passed: Counter::default(),
            drops: (0..DropReason::COUNT).map(|_| Counter::default()).collect(),
            events: (0..Event::COUNT).map(|_| Counter::default()).collect(),
            policy: (0..POLICY_COUNTER_SLOTS).map(|_| Default::default()).collect(),
        }
    }
}

impl WorkerStats {
    /// Counts a drop.
    #[inline]
    pub fn dropped(&self, reason: DropReason) {
        if let Some(c) = self.drops.get(reason as usize) {
            c.inc();
        }
    }

    /// Counts an event.
    #[inline]
    pub fn event(&self, event: Event) {
        if let Some(c) = self.events.get(event as usize) {
            c.inc();
        }
    }

    /// Counts a translated packet for a policy slot.
    #[inline]
    pub fn traffic(&self, slot: u16, dir: Direction, bytes: usize) {
        let i = (slot as usize).min(POLICY_COUNTER_SLOTS - 1);
        if let Some(t) = self.policy.get(i) {
            let t = &t[dir as usize];
            t.packets.inc();
            t.bytes.add(bytes as u64);
        }
    }

    /// A copy of every counter.
    pub fn snapshot(&self) -> StatsSnapshot {
        let mut s = StatsSnapshot::default();
        s.add_worker(self);
        s
    }
}

/// Summed counters, for metrics and the admin socket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Frames forwarded.
    pub forwarded: u64,
    /// Frames answered.
    pub answered: u64,
    /// Frames passed to the kernel.
    pub passed: u64,
    /// Drops, indexed by `DropReason as usize`.
    pub drops: Vec<u64>,
    /// Events, indexed by `Event as usize`.
    pub events: Vec<u64>,
    /// Per policy slot: [outbound, inbound] (packets, bytes).
    pub policy: Vec<[(u64, u64); 2]>,
}

impl Default for StatsSnapshot {
    fn default() -> Self {
        StatsSnapshot {
            forwarded: 0,
            answered: 0,
            passed: 0,
            drops: vec![0; DropReason::COUNT],
            events: vec![0; Event::COUNT],
            policy: vec![[(0, 0); 2]; POLICY_COUNTER_SLOTS],
        }
    }
}

impl StatsSnapshot {
    /// Adds one worker's counters to this sum.
    pub fn add_worker(&mut self, w: &WorkerStats) {
        self.forwarded += w.forwarded.get();
        self.answered += w.answered.get();
        self.passed += w.passed.get();
        for (d, c) in self.drops.iter_mut().zip(w.drops.iter()) {
            *d += c.get();
        }
        for (d, c) in self.events.iter_mut().zip(w.events.iter()) {
            *d += c.get();
        }
        for (d, t) in self.policy.iter_mut().zip(w.policy.iter()) {
            for dir in 0..2 {
                d[dir].0 += t[dir].packets.get();
                d[dir].1 += t[dir].bytes.get();
            }
        }
    }

    /// The count for one drop reason.
    pub fn dropped(&self, reason: DropReason) -> u64 {
        self.drops.get(reason as usize).copied().unwrap_or(0)
    }

    /// The count for one event.
    pub fn event(&self, event: Event) -> u64 {
        self.events.get(event as usize).copied().unwrap_or(0)
    }

    /// Total drops.
    pub fn total_drops(&self) -> u64 {
        self.drops.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enum_tables_are_consistent() {
        for (i, r) in DropReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        for (i, e) in Event::ALL.iter().enumerate() {
            assert_eq!(*e as usize, i);
        }
        let mut names: Vec<_> = DropReason::ALL.iter().map(|r| r.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), DropReason::COUNT, "drop reason names must be unique");
    }

    #[test]
    fn counters_sum_across_workers() {
        let a = WorkerStats::default();
        let b = WorkerStats::default();
        a.dropped(DropReason::PortsExhausted);
        b.dropped(DropReason::PortsExhausted);
        b.dropped(DropReason::NoRoute);
        a.traffic(3, Direction::Inbound, 100);
        b.traffic(3, Direction::Inbound, 60);
        a.traffic(5000, Direction::Outbound, 1);
        let mut s = a.snapshot();
        s.add_worker(&b);
        assert_eq!(s.dropped(DropReason::PortsExhausted), 2);
        assert_eq!(s.dropped(DropReason::NoRoute), 1);
        assert_eq!(s.total_drops(), 3);
        assert_eq!(s.policy[3][1], (2, 160));
        assert_eq!(s.policy[POLICY_COUNTER_SLOTS - 1][0], (1, 1));
    }
}
