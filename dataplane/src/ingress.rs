//! Anti-spoofing: where pods' traffic may arrive from.
//!
//! Steering and session creation judge a frame by its addresses; without
//! this table a frame with a selected pod's source address arriving on the
//! outside interface would be translated to the pod's egress IP. [`Ingress`]
//! says, per receiving interface, whether it carries pods' traffic at all
//! (roles inside and both do, outside does not) and, optionally, from which
//! link-layer senders only (one-arm: pods and the outside share the link, so
//! the node routers' MACs are the only thing that tells them apart).
//!
//! The XDP program applies the same rule (its rule 5a, `if_roles` and
//! `pod_macs` in bpf/src/bpf/egret_maps.h): the daemon writes both from the
//! configuration's interfaces before it attaches. An empty table (tests,
//! benchmarks) restricts nothing; a non-empty one refuses pods' traffic on
//! any interface it does not list.

use crate::fib::Mac;
use crate::stats::DropReason;

/// What an interface is for (the configuration's `interfaces[].role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IngressRole {
    /// Towards the pods' nodes (two-arm).
    Inside,
    /// Towards the outside world (two-arm): never carries pods' traffic.
    Outside,
    /// One-arm: both.
    Both,
}

/// One receiving interface's rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfaceIngress {
    /// The interface.
    pub ifindex: u32,
    /// Its role.
    pub role: IngressRole,
    /// When not empty: pods' traffic is accepted only from these
    /// link-layer senders (the node routers).
    pub pod_source_macs: Vec<Mac>,
}

/// Every receiving interface's rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ingress {
    interfaces: Vec<InterfaceIngress>,
}

impl Ingress {
    /// A table over `interfaces` (empty: no restriction).
    pub fn new(interfaces: Vec<InterfaceIngress>) -> Self {
        Ingress { interfaces }
    }

    /// The rules, in the order given.
    pub fn interfaces(&self) -> &[InterfaceIngress] {
        &self.interfaces
    }

    /// Whether a frame from link-layer sender `src_mac`, received on
    /// `ifindex`, may be translated as a pod's; if not, the drop reason.
    #[inline]
    pub fn admits_pods(&self, ifindex: u32, src_mac: &[u8]) -> Result<(), DropReason> {
        if self.interfaces.is_empty() {
            return Ok(());
        }
        let Some(i) = self.interfaces.iter().find(|i| i.ifindex == ifindex) else {
            return Err(DropReason::SteeredOnOutside);
        };
        if i.role == IngressRole::Outside {
            return Err(DropReason::SteeredOnOutside);
        }
        if !i.pod_source_macs.is_empty() && !i.pod_source_macs.iter().any(|m| m[..] == *src_mac) {
            return Err(DropReason::SteeredFromUnknownMac);
        }
        Ok(())
    }

    /// The interfaces whose role is outside (two-arm): a translated frame
    /// that arrived on one is never sent back out of it
    /// (controlplane/src/offload/next_hops.rs).
    pub fn outside_interfaces(&self) -> impl Iterator<Item = u32> + '_ {
        self.interfaces.iter().filter(|i| i.role == IngressRole::Outside).map(|i| i.ifindex)
    }

    /// Whether any interface's rule can refuse a frame (a cheap test for the
    /// per-packet path).
    #[inline]
    pub fn restricts(&self) -> bool {
        !self.interfaces.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTER: Mac = [2, 0, 0, 0, 0, 1];

    #[test]
    fn roles_and_senders() {
        let t = Ingress::new(vec![
            InterfaceIngress { ifindex: 2, role: IngressRole::Inside, pod_source_macs: vec![] },
            InterfaceIngress { ifindex: 3, role: IngressRole::Outside, pod_source_macs: vec![] },
            InterfaceIngress { ifindex: 4, role: IngressRole::Both, pod_source_macs: vec![ROUTER] },
        ]);
        assert_eq!(t.admits_pods(2, &[9; 6]), Ok(()));
        assert_eq!(t.admits_pods(3, &ROUTER), Err(DropReason::SteeredOnOutside));
        assert_eq!(t.admits_pods(4, &ROUTER), Ok(()));
        assert_eq!(t.admits_pods(4, &[9; 6]), Err(DropReason::SteeredFromUnknownMac));
        assert_eq!(t.admits_pods(5, &ROUTER), Err(DropReason::SteeredOnOutside), "an unlisted interface");
        assert_eq!(Ingress::default().admits_pods(3, &ROUTER), Ok(()), "an empty table restricts nothing");
        assert_eq!(t.outside_interfaces().collect::<Vec<_>>(), vec![3]);
    }
}
