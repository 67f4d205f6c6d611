//! Raw frames for the lab: a raw socket to inject hand-made (even
//! malformed) frames on an interface and read what arrives, and an ARP
//! (RFC 826) parser. Frames themselves come from the fixture table's
//! builders (`egret_dataplane::fixtures::build`).

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use crate::error::{LabError, Result};
use crate::netns::NetNs;
use crate::sys::PacketSocket;

/// A raw socket on one interface of a namespace: sends frames exactly as
/// given and receives what arrives there.
#[derive(Debug)]
pub struct RawLink {
    sock: PacketSocket,
    what: String,
}

impl RawLink {
    /// Opens `dev` in `ns`.
    pub fn open(ns: &NetNs, dev: &str) -> Result<Self> {
        let ifindex = ns.ifindex(dev)?;
        let what = format!("{}:{dev}", ns.name());
        let sock =
            ns.run_in(|| PacketSocket::bind(ifindex))?.map_err(|e| LabError::io(format!("raw socket on {what}"), e))?;
        Ok(Self { sock, what })
    }

    /// Sends one frame.
    pub fn send(&self, frame: &[u8]) -> Result<()> {
        self.sock.send(frame).map_err(|e| LabError::io(format!("send {} bytes on {}", frame.len(), self.what), e))?;
        Ok(())
    }

    /// Receives frames for `wait`, returning the first `pred` accepts.
    pub fn recv_matching(&self, wait: Duration, pred: impl Fn(&[u8]) -> bool) -> Result<Option<Vec<u8>>> {
        let deadline = Instant::now() + wait;
        let mut buf = vec![0u8; 65536];
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.sock.recv(&mut buf, left) {
                Ok(Some(n)) if pred(&buf[..n]) => return Ok(Some(buf[..n].to_vec())),
                Ok(_) => {}
                Err(e) => return Err(LabError::io(format!("receive on {}", self.what), e)),
            }
        }
        Ok(None)
    }
}

/// An ARP packet's fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arp {
    /// Ethernet destination.
    pub eth_dst: [u8; 6],
    /// Ethernet source.
    pub eth_src: [u8; 6],
    /// Operation: 1 request, 2 reply.
    pub op: u16,
    /// Sender hardware address.
    pub sha: [u8; 6],
    /// Sender protocol address.
    pub spa: Ipv4Addr,
    /// Target hardware address.
    pub tha: [u8; 6],
    /// Target protocol address.
    pub tpa: Ipv4Addr,
}

/// Parses an Ethernet/IPv4 ARP frame.
pub fn parse_arp(f: &[u8]) -> Option<Arp> {
    if f.len() < 42 || f[12..14] != [0x08, 0x06] || f[14..20] != [0, 1, 0x08, 0x00, 6, 4] {
        return None;
    }
    let mac = |o: usize| -> [u8; 6] { f[o..o + 6].try_into().unwrap_or([0; 6]) };
    let ip = |o: usize| Ipv4Addr::new(f[o], f[o + 1], f[o + 2], f[o + 3]);
    Some(Arp {
        eth_dst: mac(0),
        eth_src: mac(6),
        op: u16::from_be_bytes([f[20], f[21]]),
        sha: mac(22),
        spa: ip(28),
        tha: mac(32),
        tpa: ip(38),
    })
}
