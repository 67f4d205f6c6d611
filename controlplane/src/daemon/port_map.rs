//! Connects the NAT's mapped-port marks (`nat::table::PortMapHook`) to the
//! XDP program's bitmaps (`egret_bpf::MappedPorts`, rule 4a in
//! steer.bpf.c): TCP/UDP to an egress IP's NAT port that no session uses is
//! dropped in XDP, so an unsolicited flood never reaches the workers'
//! queues, where ARP/NDP requests wait too.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use egret_bpf::{MappedPorts, SteeringProgram};
use egret_dataplane::engine::Engine;
use egret_dataplane::nat::table::PortMapHook;

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
}

/// Hands the program's bitmaps to both families' NAT (before any table is
/// published, so every egress IP is tracked from its first publish).
pub(crate) fn connect(engine: &Engine, program: &SteeringProgram) {
    let ports = program.mapped_ports();
    let _ = engine.nat4().set_port_map_hook(Arc::new(XdpPortMap(ports.clone())) as Arc<dyn PortMapHook<Ipv4Addr>>);
    let _ = engine.nat6().set_port_map_hook(Arc::new(XdpPortMap(ports)) as Arc<dyn PortMapHook<Ipv6Addr>>);
}
