//! Handing translated packets to the gateway's kernel: the return path
//! through an overlay.
//!
//! On a gateway in a cluster whose CNI uses an overlay (flannel's vxlan
//! backend, Calico VXLAN or IPIP, Cilium's tunnel mode), the kernel's route
//! back to a pod leaves through a tunnel device (`flannel.1`,
//! `vxlan.calico`, `tunl0`) that Egret does not drive and XDP cannot
//! redirect into (no `ndo_xdp_xmit`). The engine gives such a translated
//! packet [`Verdict::ToKernel`](crate::engine::Verdict::ToKernel); the worker
//! sends its IP part here, on a raw socket of its family
//! (`socket(AF_INET/AF_INET6, SOCK_RAW, IPPROTO_RAW)`, `raw(7)`: the header
//! is the caller's, `IP_HDRINCL` / `IPV6_HDRINCL`), addressed to the
//! packet's own destination. The kernel routes it as a packet of its own
//! (the `output` and `postrouting` hooks, never `forward`), so the CNI's
//! tunnel route and encapsulation carry it to the pod's node.
//!
//! What the kernel does and does not do with it (`raw_send_hdrinc`,
//! `rawv6_send_hdrinc`): it keeps the addresses, TTL, transport header and
//! checksum as given, fills in the IPv4 header checksum (and an ID of 0),
//! and refuses a packet larger than the route's MTU with `EMSGSIZE`; the
//! engine has decremented the TTL and checked the tunnel's MTU before, as
//! the router it is. The socket is non-blocking: a full send buffer is a
//! counted drop (`kernel_send_failed`), never a stalled worker.
//! docs/adr/0008-overlay-return-through-the-kernel.md compares this with a
//! TUN device and with XDP_PASS, with measurements.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Send buffer asked for on each socket (the kernel doubles and caps it at
/// `net.core.wmem_max`): room for a worker's batch of full-size packets.
pub const SEND_BUFFER: usize = 1 << 20;

/// Why a packet could not be handed to the kernel.
#[derive(Debug, thiserror::Error)]
pub enum KernelTxError {
    /// A raw socket could not be opened (needs CAP_NET_RAW).
    #[error("opening a raw IPPROTO_RAW socket for {family}: {source}")]
    Open {
        /// "IPv4" or "IPv6".
        family: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The packet is not an IPv4 or IPv6 header the kernel can take.
    #[error("not a complete IPv4 or IPv6 header ({len} bytes)")]
    NotIp {
        /// The packet's length.
        len: usize,
    },
    /// The kernel refused it (`EMSGSIZE` over the route's MTU, `EAGAIN`
    /// with the send buffer full, `ENETUNREACH` with no route any more).
    #[error("the kernel refused the packet: {0}")]
    Send(io::Error),
    /// An IPv6 packet, on a node whose kernel has IPv6 disabled (no IPv6
    /// socket could be opened).
    #[error("an IPv6 packet, and the kernel has no IPv6")]
    NoIpv6,
}

/// One raw socket per family; a worker owns one.
#[derive(Debug)]
pub struct KernelTx {
    v4: Socket,
    /// `None` on a kernel without IPv6 (`ipv6.disable=1`): no IPv6 pod can
    /// be behind its tunnels either.
    v6: Option<Socket>,
}

impl KernelTx {
    /// Opens both sockets in the calling thread's network namespace. A
    /// kernel without IPv6 (`EAFNOSUPPORT`) gives an IPv4-only sender
    /// ([`KernelTx::has_ipv6`]); any other failure is an error.
    pub fn open() -> Result<Self, KernelTxError> {
        let v6 = match open(Domain::IPV6, "IPv6") {
            Ok(s) => Some(s),
            Err(KernelTxError::Open { source, .. }) if source.raw_os_error() == Some(libc::EAFNOSUPPORT) => None,
            Err(e) => return Err(e),
        };
        Ok(Self { v4: open(Domain::IPV4, "IPv4")?, v6 })
    }

    /// Whether IPv6 packets can be sent (the kernel has IPv6).
    pub fn has_ipv6(&self) -> bool {
        self.v6.is_some()
    }

    /// Hands one IP packet (from its version nibble to its end) to the
    /// kernel, to be routed to its destination address.
    pub fn send(&self, packet: &[u8]) -> Result<(), KernelTxError> {
        let (sock, to) = match destination(packet)? {
            IpAddr::V4(d) => (&self.v4, SockAddr::from(SocketAddrV4::new(d, 0))),
            IpAddr::V6(d) => {
                (self.v6.as_ref().ok_or(KernelTxError::NoIpv6)?, SockAddr::from(SocketAddrV6::new(d, 0, 0, 0)))
            }
        };
        sock.send_to(packet, &to).map(|_| ()).map_err(KernelTxError::Send)
    }
}

/// The destination address of an IP packet (the socket address the raw
/// socket is given; the kernel routes by it).
pub fn destination(packet: &[u8]) -> Result<IpAddr, KernelTxError> {
    let not_ip = || KernelTxError::NotIp { len: packet.len() };
    match packet.first().map(|b| b >> 4) {
        Some(4) => {
            let d: [u8; 4] = packet.get(16..20).and_then(|d| d.try_into().ok()).ok_or_else(not_ip)?;
            Ok(IpAddr::V4(Ipv4Addr::from(d)))
        }
        Some(6) => {
            let d: [u8; 16] = packet.get(24..40).and_then(|d| d.try_into().ok()).ok_or_else(not_ip)?;
            Ok(IpAddr::V6(Ipv6Addr::from(d)))
        }
        _ => Err(not_ip()),
    }
}

fn open(domain: Domain, family: &'static str) -> Result<Socket, KernelTxError> {
    let err = |source| KernelTxError::Open { family, source };
    let s = Socket::new(domain, Type::RAW, Some(Protocol::from(libc::IPPROTO_RAW))).map_err(err)?;
    // IPPROTO_RAW implies the header is included for both families; say
    // so anyway, so a kernel that did not imply it still takes our header.
    if domain == Domain::IPV4 {
        s.set_header_included_v4(true).map_err(err)?;
    } else {
        s.set_header_included_v6(true).map_err(err)?;
    }
    s.set_nonblocking(true).map_err(err)?;
    // Best effort: the default is enough for a trickle.
    let _ = s.set_send_buffer_size(SEND_BUFFER);
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The destination comes from the header of the packet's own family;
    /// what is not a whole IPv4 or IPv6 header is refused before any
    /// system call. (Sending needs CAP_NET_RAW and a namespace with routes:
    /// the e2e overlay test covers it.)
    #[test]
    fn the_destination_is_the_headers() {
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        v4[16..20].copy_from_slice(&[198, 18, 1, 5]);
        assert_eq!(destination(&v4).unwrap(), "198.18.1.5".parse::<IpAddr>().unwrap());
        let mut v6 = [0u8; 40];
        v6[0] = 0x60;
        v6[24..40].copy_from_slice(&"2001:db8::5".parse::<Ipv6Addr>().unwrap().octets());
        assert_eq!(destination(&v6).unwrap(), "2001:db8::5".parse::<IpAddr>().unwrap());
        assert!(matches!(destination(&[]), Err(KernelTxError::NotIp { len: 0 })));
        assert!(matches!(destination(&v4[..19]), Err(KernelTxError::NotIp { len: 19 })));
        assert!(matches!(destination(&v6[..39]), Err(KernelTxError::NotIp { len: 39 })));
        let mut v5 = v4;
        v5[0] = 0x55;
        assert!(matches!(destination(&v5), Err(KernelTxError::NotIp { len: 20 })));
    }
}
