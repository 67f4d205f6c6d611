//! The solicited-node multicast groups of the IPv6 addresses the gateway
//! answers NDP for (RFC 4291 2.7.1: ff02::1:ffXX:XXXX, the address's last
//! 24 bits).
//!
//! A Neighbor Solicitation for an address goes to its solicited-node group
//! (RFC 4861 7.2.2), on the wire to the MAC 33:33:ff:XX:XX:XX. A real NIC
//! (virtio_net too) drops multicast frames to a MAC it was not told to
//! receive, before XDP sees them, so the upstream router's solicitation
//! for an egress IP never reached the worker that answers it and its
//! neighbour entry stayed INCOMPLETE (found in the Vagrant lab; veth
//! delivers every multicast frame, which hid it). The kernel programs the
//! NIC's filter when a socket joins the group, and reports the membership
//! by MLD so that a snooping switch forwards the solicitations too; the
//! frames still go to XDP first, where Egret answers them.
//!
//! One UDP socket holds every membership; the set follows each applied
//! configuration.

use std::collections::BTreeSet;
use std::net::{Ipv6Addr, UdpSocket};

/// The group for `ip`.
pub fn solicited_node(ip: Ipv6Addr) -> Ipv6Addr {
    let o = ip.octets();
    Ipv6Addr::new(0xff02, 0, 0, 0, 0, 1, 0xff00 | u16::from(o[13]), u16::from_be_bytes([o[14], o[15]]))
}

/// The memberships held, on one socket.
#[derive(Debug, Default)]
pub struct SolicitedNodeGroups {
    socket: Option<UdpSocket>,
    joined: BTreeSet<(u32, Ipv6Addr)>,
}

impl SolicitedNodeGroups {
    /// Joins the groups of `want` ((ifindex, address) pairs) not joined yet
    /// and leaves the others. A refusal (no IPv6 on the interface) is
    /// logged, and tried again at the next configuration.
    pub fn sync(&mut self, want: impl IntoIterator<Item = (u32, Ipv6Addr)>) {
        let want: BTreeSet<(u32, Ipv6Addr)> = want.into_iter().map(|(i, a)| (i, solicited_node(a))).collect();
        if want.is_empty() && self.joined.is_empty() {
            return;
        }
        if self.socket.is_none() {
            match UdpSocket::bind("[::]:0") {
                Ok(s) => self.socket = Some(s),
                Err(e) => {
                    tracing::warn!(error = %e, "no IPv6 socket for the solicited-node groups: IPv6 neighbour solicitations may be filtered by the NIC");
                    return;
                }
            }
        }
        let Some(sock) = &self.socket else { return };
        let to_leave: Vec<(u32, Ipv6Addr)> = self.joined.difference(&want).copied().collect();
        for (ifindex, group) in to_leave {
            if let Err(e) = sock.leave_multicast_v6(&group, ifindex) {
                tracing::debug!(ifindex, %group, error = %e, "leaving a solicited-node group");
            }
            self.joined.remove(&(ifindex, group));
        }
        let to_join: Vec<(u32, Ipv6Addr)> = want.difference(&self.joined).copied().collect();
        for (ifindex, group) in to_join {
            match sock.join_multicast_v6(&group, ifindex) {
                Ok(()) => {
                    self.joined.insert((ifindex, group));
                }
                Err(e) => tracing::warn!(
                    ifindex,
                    %group,
                    error = %e,
                    "joining a solicited-node group refused (ENOMEM: raise net.core.optmem_max, which bounds one socket's \
                     memberships): the NIC may filter neighbour solicitations for it"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_is_ff02_1_ff_and_the_last_24_bits() {
        let ip: Ipv6Addr = "2001:db8:113::10".parse().unwrap();
        assert_eq!(solicited_node(ip), "ff02::1:ff00:10".parse::<Ipv6Addr>().unwrap());
        let ip: Ipv6Addr = "fe80::2aa:ff:fe28:9c5a".parse().unwrap();
        assert_eq!(solicited_node(ip), "ff02::1:ff28:9c5a".parse::<Ipv6Addr>().unwrap());
    }
}
