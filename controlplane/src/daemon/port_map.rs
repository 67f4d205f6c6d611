//! Connects the NAT's mapped-port marks (`nat::table::PortMapHook`) to the
//! XDP program's bitmaps (`egret_bpf::MappedPorts`, rule 4a in
//! steer.bpf.c): TCP/UDP to an egress IP's NAT port that no session uses is
//! dropped in XDP, so an unsolicited flood never reaches the workers'
//! queues, where ARP/NDP requests wait too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::num::NonZeroU64;
use std::sync::Arc;

use egret_bpf::{MappedPorts, SlotTicket, SteeringProgram};
use egret_dataplane::engine::Engine;
use egret_dataplane::nat::table::{PortBitsAt, PortMapHook};

/// The program's bitmaps as the NAT of one address family sees them.
struct XdpPortMap(Arc<MappedPorts>);

impl<A: Into<IpAddr> + Copy> PortMapHook<A> for XdpPortMap {
    fn track(&self, egress: A, proto: u8) {
        if let Err(e) = self.0.track(egress.into(), proto) {
            // The pair stays unfiltered: the workers judge its packets.
            tracing::warn!(egress = %egress.into(), proto, "mapped-port filter: {e:#}");
        }
    }

    fn set(&self, egress: A, proto: u8, port: u16, mapped: bool) {
        self.0.set(egress.into(), proto, port, mapped);
    }

    fn forget(&self, egress: A) {
        self.0.forget(egress.into());
    }

    fn locate(&self, egress: A, proto: u8) -> Option<PortBitsAt> {
        self.0.locate(egress.into(), proto).and_then(to_place)
    }

    fn set_at(&self, at: PortBitsAt, port: u16, mapped: bool) -> bool {
        self.0.set_at(from_place(at), port, mapped)
    }
}

/// A slot ticket as the NAT keeps it: the slot plus one in the high half
/// (never zero for the bitmaps' few slots), the generation in the low.
fn to_place(t: SlotTicket) -> Option<PortBitsAt> {
    let packed = (u64::from(t.slot) + 1) << 32 | u64::from(t.generation);
    NonZeroU64::new(packed).map(PortBitsAt)
}

fn from_place(at: PortBitsAt) -> SlotTicket {
    let packed = at.0.get();
    SlotTicket { slot: ((packed >> 32) as u32).wrapping_sub(1), generation: packed as u32 }
}

/// Hands the program's bitmaps to both families' NAT (before any table is
/// published, so every egress IP is tracked from its first publish).
pub(crate) fn connect(engine: &Engine, program: &SteeringProgram) {
    let ports = program.mapped_ports();
    let _ = engine.nat4().set_port_map_hook(Arc::new(XdpPortMap(ports.clone())) as Arc<dyn PortMapHook<Ipv4Addr>>);
    let _ = engine.nat6().set_port_map_hook(Arc::new(XdpPortMap(ports)) as Arc<dyn PortMapHook<Ipv6Addr>>);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_ticket_survives_the_nats_keeping() {
        for t in [
            SlotTicket { slot: 0, generation: 0 },
            SlotTicket { slot: 63, generation: u32::MAX },
            SlotTicket { slot: u32::MAX - 1, generation: 7 },
        ] {
            assert_eq!(to_place(t).map(from_place), Some(t));
        }
    }
}
