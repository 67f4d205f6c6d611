//! `egret-vxlan`, the node's end of the tunnel to gateways in other subnets
//! (docs/adr/0031-workers-in-any-subnet.md): made, checked, repaired and
//! removed over rtnetlink. A VXLAN device (RFC 7348) in metadata mode: each
//! encapsulated route gives the VNI, the outer addresses and the TTL.

use super::*;

impl Kernel {
    /// `egret-vxlan`'s index, if it exists (any kind).
    pub async fn tunnel_index(&mut self) -> Result<Option<u32>, KernelError> {
        Ok(self.link(0, Some(DEVICE)).await?.map(|l| l.header.index))
    }

    async fn change_link(&mut self, msg: RouteNetlinkMessage, flags: u16, op: String) -> Result<(), KernelError> {
        self.requests.call(msg, flags).await.map(drop).map_err(|source| KernelError::Change { op, source })
    }

    /// Makes `egret-vxlan` what the tunnel needs: kind vxlan (RFC 7348) in
    /// metadata mode (`IFLA_VXLAN_COLLECT_METADATA`, `ip`'s `external`: each
    /// route gives the VNI, the outer addresses and the TTL, so the device
    /// has no `IFLA_VXLAN_ID`, group, local address or lower link), on UDP
    /// port `port` (`IFLA_VXLAN_PORT`), without FDB learning
    /// (`IFLA_VXLAN_LEARNING` 0; the kernel's default is on, and the
    /// destination is per route, never learnt), NOARP (the neighbour
    /// subsystem would otherwise send ARP into a device that has no
    /// destination for it), no IPv6 address generation (so it holds no
    /// link-local address and sends no router or neighbour solicitations),
    /// MTU `mtu`, up. A VXLAN device of another configuration (port,
    /// metadata mode, learning, address generation) is replaced (its
    /// routes go with it, and the pass after this one puts them back); a
    /// device of another kind is left alone and reported. Returns its
    /// index.
    ///
    /// The kernel keeps one metadata-collecting VXLAN device per UDP port
    /// and one socket per port: the CNI's VXLAN device (flannel's and
    /// Cilium's on 8472, others on the IANA port 4789) and Egret's cannot
    /// share one, and the error says so with the port.
    pub async fn ensure_tunnel(&mut self, port: u16, mtu: u32) -> Result<u32, KernelError> {
        let ack = NLM_F_REQUEST | NLM_F_ACK;
        let mut existing = self.link(0, Some(DEVICE)).await?;
        if let Some(l) = &existing {
            match tunnel_shape(l, Some(port)) {
                Shape::Foreign(kind) => {
                    self.tunnel = None;
                    return Err(KernelError::Device(format!(
                        "exists and is a {kind} device, not Egret's vxlan: remove or rename it"
                    )));
                }
                Shape::Other(why) => {
                    let mut del = LinkMessage::default();
                    del.header.index = l.header.index;
                    self.change_link(
                        RouteNetlinkMessage::DelLink(del),
                        ack,
                        format!("link del {DEVICE} (to recreate it: {why})"),
                    )
                    .await?;
                    existing = None;
                }
                Shape::Ours => {}
            }
        }
        let index = match existing {
            Some(l) => l.header.index,
            None => self.create_tunnel(port, mtu).await?,
        };
        // MTU, NOARP and up, repaired every pass. Going up opens the UDP
        // sockets (vxlan_open): a port another socket holds fails here.
        let l = self.link(index, None).await?.ok_or_else(|| KernelError::Device("vanished".into()))?;
        let have_mtu = l.attributes.iter().find_map(|a| if let LinkAttribute::Mtu(m) = a { Some(*m) } else { None });
        let want = LinkFlags::Up | LinkFlags::Noarp;
        if have_mtu != Some(mtu) || !l.header.flags.contains(want) {
            let mut m = LinkMessage::default();
            m.header.index = index;
            m.header.flags = want;
            m.header.change_mask = want;
            m.attributes.push(LinkAttribute::Mtu(mtu));
            let op = format!("link set {DEVICE} up arp off mtu {mtu}");
            match self.requests.call(RouteNetlinkMessage::SetLink(m), ack).await {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EADDRINUSE) => {
                    return Err(port_taken(
                        &op,
                        port,
                        "a UDP socket that is not Egret's (another VXLAN device's, e.g. the CNI's, or a program's)",
                    ));
                }
                Err(source) => return Err(KernelError::Change { op, source }),
            }
        }
        self.tunnel = Some(index);
        Ok(index)
    }

    /// Creates `egret-vxlan` (down; [`Kernel::ensure_tunnel`] brings it up)
    /// and turns its IPv6 address generation off. Returns its index.
    async fn create_tunnel(&mut self, port: u16, mtu: u32) -> Result<u32, KernelError> {
        let ack = NLM_F_REQUEST | NLM_F_ACK;
        let mut m = LinkMessage::default();
        m.header.flags = LinkFlags::Noarp;
        m.header.change_mask = LinkFlags::Noarp;
        m.attributes.push(LinkAttribute::IfName(DEVICE.to_string()));
        m.attributes.push(LinkAttribute::Mtu(mtu));
        m.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Vxlan),
            LinkInfo::Data(InfoData::Vxlan(vec![
                InfoVxlan::CollectMetadata(true),
                // A host-order value: the crate writes it in network order,
                // as the kernel reads IFLA_VXLAN_PORT (nla_get_be16).
                InfoVxlan::Port(port),
                InfoVxlan::Learning(false),
            ])),
        ]));
        let op = format!("link add {DEVICE} type vxlan external dstport {port} nolearning mtu {mtu}");
        match self.requests.call(RouteNetlinkMessage::NewLink(m), ack | NLM_F_CREATE | NLM_F_EXCL).await {
            Ok(_) => {}
            // vxlan_config_validate: a metadata-collecting device (VNI 0)
            // on the same port exists ("A VXLAN device with the specified
            // VNI already exists"), unless the name itself appeared since.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) && self.link(0, Some(DEVICE)).await?.is_none() => {
                return Err(port_taken(&op, port, "another metadata-collecting VXLAN device"));
            }
            // rtnl_newlink: no such link kind registered.
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                return Err(KernelError::Device(format!(
                    "{op}: this kernel has no VXLAN (module vxlan, CONFIG_VXLAN)"
                )));
            }
            Err(source) => return Err(KernelError::Change { op, source }),
        }
        let l = self
            .link(0, Some(DEVICE))
            .await?
            .ok_or_else(|| KernelError::Device("missing right after its creation".into()))?;
        // Before it goes up: an IPv6 device with EUI-64 generation would
        // get its link-local address then.
        let mut g = LinkMessage::default();
        g.header.index = l.header.index;
        g.attributes.push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(
            In6AddrGenMode::None,
        )])]));
        match self.requests.call(RouteNetlinkMessage::SetLink(g), ack).await {
            Ok(_) => {}
            // No IPv6 on this device (ipv6.disable=1, or an MTU below
            // 1280): nothing to generate.
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => {}
            Err(source) => {
                return Err(KernelError::Change { op: format!("link set {DEVICE} addrgenmode none"), source })
            }
        }
        Ok(l.header.index)
    }

    /// Removes `egret-vxlan` if it is a VXLAN device (a device of another
    /// kind with that name is not Egret's). Returns whether one was removed.
    pub async fn remove_tunnel(&mut self) -> Result<bool, KernelError> {
        self.tunnel = None;
        let Some(l) = self.link(0, Some(DEVICE)).await? else { return Ok(false) };
        if matches!(tunnel_shape(&l, None), Shape::Foreign(_)) {
            return Ok(false);
        }
        let mut del = LinkMessage::default();
        del.header.index = l.header.index;
        match self.requests.call(RouteNetlinkMessage::DelLink(del), NLM_F_REQUEST | NLM_F_ACK).await {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(false),
            Err(source) => Err(KernelError::Change { op: format!("link del {DEVICE}"), source }),
        }
    }
}

/// The tunnel's port is held by `by`: the error names the port and the
/// flag, and the CNIs' usual ports.
fn port_taken(op: &str, port: u16, by: &str) -> KernelError {
    KernelError::Device(format!(
        "{op}: UDP port {port} is taken by {by}; set --tunnel-port and the gateways' tunnel-port (ConfigMap egret-cluster) to a free port, different from the CNI's VXLAN port (flannel and Cilium: 8472; IANA: 4789)"
    ))
}

/// What an existing `egret-vxlan` is.
#[derive(Debug)]
enum Shape {
    /// VXLAN, collect_md, on the wanted port, not learning, IPv6 address
    /// generation off: kept.
    Ours,
    /// VXLAN, configured otherwise (what differs): replaced.
    Other(String),
    /// Another kind: not Egret's.
    Foreign(String),
}

fn vxlan_info(l: &LinkMessage) -> Option<&Vec<InfoVxlan>> {
    l.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Data(InfoData::Vxlan(v)) => Some(v),
            _ => None,
        }),
        _ => None,
    })
}

/// The UDP port of a VXLAN link message.
pub fn tunnel_port(l: &LinkMessage) -> Option<u16> {
    vxlan_info(l)?.iter().find_map(|x| if let InfoVxlan::Port(p) = x { Some(*p) } else { None })
}

/// Whether `l` collects metadata (the kernel dumps the flag as 0 or 1).
pub fn collects_metadata(l: &LinkMessage) -> bool {
    vxlan_info(l).is_some_and(|v| v.contains(&InfoVxlan::CollectMetadata(true)))
}

/// Whether `l` learns FDB entries from what it receives (a dump without the
/// attribute says nothing, and replacing the device would not change it).
pub fn learns(l: &LinkMessage) -> bool {
    vxlan_info(l).is_some_and(|v| v.contains(&InfoVxlan::Learning(true)))
}

fn tunnel_shape(l: &LinkMessage, port: Option<u16>) -> Shape {
    let kind = l.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Kind(k) => Some(k.clone()),
            _ => None,
        }),
        _ => None,
    });
    match kind {
        Some(InfoKind::Vxlan) => {}
        Some(k) => return Shape::Foreign(format!("{k:?}").to_lowercase()),
        None => return Shape::Foreign("kindless".into()),
    }
    let gen_none = l.attributes.iter().any(|a| match a {
        LinkAttribute::AfSpecUnspec(v) => v.iter().any(|x| match x {
            AfSpecUnspec::Inet6(i6) => i6.contains(&AfSpecInet6::AddrGenMode(In6AddrGenMode::None)),
            _ => false,
        }),
        _ => false,
    });
    // No IPv6 state at all (no Inet6 spec) counts as no generation.
    let has_inet6 = l
        .attributes
        .iter()
        .any(|a| matches!(a, LinkAttribute::AfSpecUnspec(v) if v.iter().any(|x| matches!(x, AfSpecUnspec::Inet6(_)))));
    let mut wrong = Vec::new();
    if !collects_metadata(l) {
        wrong.push("not external (collect_md)".to_string());
    }
    if let Some(p) = port.filter(|p| tunnel_port(l) != Some(*p)) {
        let have = tunnel_port(l).map_or_else(|| "none".to_string(), |h| h.to_string());
        wrong.push(format!("dstport {have}, not --tunnel-port {p}"));
    }
    if learns(l) {
        wrong.push("learning on".to_string());
    }
    if has_inet6 && !gen_none {
        wrong.push("IPv6 address generation on".to_string());
    }
    if wrong.is_empty() {
        Shape::Ours
    } else {
        Shape::Other(wrong.join(", "))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::tests::wire_round_trip;
    use super::*;

    fn vxlan_link(data: Vec<InfoVxlan>, gen: Option<In6AddrGenMode>) -> LinkMessage {
        let mut l = LinkMessage::default();
        l.attributes.push(LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Vxlan),
            LinkInfo::Data(InfoData::Vxlan(data)),
        ]));
        if let Some(g) = gen {
            l.attributes
                .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![AfSpecInet6::AddrGenMode(g)])]));
        }
        let back = wire_round_trip(RouteNetlinkMessage::NewLink(l));
        let RouteNetlinkMessage::NewLink(back) = back else { panic!("{back:?}") };
        back
    }

    #[test]
    fn the_tunnel_device_message_reads_back() {
        let ours = || vec![InfoVxlan::CollectMetadata(true), InfoVxlan::Port(6082), InfoVxlan::Learning(false)];
        let back = vxlan_link(ours(), Some(In6AddrGenMode::None));
        assert_eq!(tunnel_port(&back), Some(6082));
        assert!(collects_metadata(&back) && !learns(&back));
        assert!(matches!(tunnel_shape(&back, Some(6082)), Shape::Ours));
        assert!(matches!(tunnel_shape(&back, None), Shape::Ours));
        // IFLA_VXLAN_PORT travels in network order.
        let mut l = LinkMessage::default();
        l.attributes.push(LinkAttribute::LinkInfo(vec![LinkInfo::Data(InfoData::Vxlan(vec![InfoVxlan::Port(6082)]))]));
        let mut buf = vec![0u8; netlink_packet_core::Emitable::buffer_len(&l)];
        netlink_packet_core::Emitable::emit(&l, &mut buf);
        // struct nlattr (length 6, type IFLA_VXLAN_PORT 15, host order),
        // then the port big-endian.
        let (len, kind, port) = (6u16.to_ne_bytes(), 15u16.to_ne_bytes(), 6082u16.to_be_bytes());
        let want = [len[0], len[1], kind[0], kind[1], port[0], port[1]];
        assert!(buf.windows(6).any(|w| w == want), "{buf:?}");
        // As the kernel dumps a device without IPv6 state: still ours.
        assert!(matches!(tunnel_shape(&vxlan_link(ours(), None), Some(6082)), Shape::Ours));
        // Each wrong setting: replaced, saying which.
        let other = |data: Vec<InfoVxlan>, gen| match tunnel_shape(&vxlan_link(data, gen), Some(6082)) {
            Shape::Other(why) => why,
            s => panic!("{s:?}"),
        };
        let none = Some(In6AddrGenMode::None);
        assert_eq!(other(ours(), Some(In6AddrGenMode::Eui64)), "IPv6 address generation on");
        let mut v = ours();
        v[1] = InfoVxlan::Port(7000);
        assert_eq!(other(v, none), "dstport 7000, not --tunnel-port 6082");
        let mut v = ours();
        v[0] = InfoVxlan::CollectMetadata(false);
        assert_eq!(other(v, none), "not external (collect_md)");
        let mut v = ours();
        v[2] = InfoVxlan::Learning(true);
        assert_eq!(other(v, none), "learning on");
        assert_eq!(
            other(vec![InfoVxlan::Id(1), InfoVxlan::Learning(true)], none),
            "not external (collect_md), dstport none, not --tunnel-port 6082, learning on"
        );
        // Another kind with the name: not Egret's.
        let mut gnv = LinkMessage::default();
        gnv.attributes.push(LinkAttribute::LinkInfo(vec![LinkInfo::Kind(InfoKind::Geneve)]));
        assert!(matches!(tunnel_shape(&gnv, Some(6082)), Shape::Foreign(k) if k == "geneve"));
        assert!(matches!(tunnel_shape(&LinkMessage::default(), Some(6082)), Shape::Foreign(k) if k == "kindless"));
    }
}
