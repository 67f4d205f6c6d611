//! `egret cloud discover`: what a cloud pool's selector finds, asked from
//! where the gateway runs.
//!
//! The same provider a gateway builds ([`super::providers`]: the SDK's
//! standard chain for credentials, region and endpoint, and the system's
//! root certificates for TLS) makes the same discovery call the gateway's
//! cloud task makes, once, and prints it. An operator runs it in the
//! gateway's container (`kubectl exec ... -- egret cloud discover ...`)
//! before creating a pool, or when a pool's status reports a cloud error:
//! a wrong tag, a subnet in another zone, missing permissions, credentials
//! that do not load (IRSA) and a TLS root that is not trusted each fail
//! with the call and the provider's message.

use std::fmt::Write;
use std::net::IpAddr;

use super::{Cloud, CloudError, Discovered, PoolSelector};

/// Runs one discovery for `pool` and renders it.
pub async fn discover(cloud: &dyn Cloud, pool: &PoolSelector) -> Result<String, CloudError> {
    cloud.discover(pool).await.map(|d| render(cloud.name(), pool, &d))
}

/// The report: the public addresses the tags select, where each is
/// associated now, and how many private addresses the subnet has left.
pub fn render(provider: &str, pool: &PoolSelector, d: &Discovered) -> String {
    let tags: Vec<String> = pool.tags.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let mut out = String::new();
    let _ = writeln!(out, "provider:  {provider}");
    let _ = writeln!(out, "subnet:    {} ({})", pool.subnet_id, d.subnet_cidr);
    let _ = writeln!(out, "tags:      {}", tags.join(", "));
    let _ = writeln!(out, "public addresses: {}", d.public.len());
    if !d.public.is_empty() {
        let _ = writeln!(out, "  {:<39} {:<26} {:<22} PRIVATE", "PUBLIC", "ALLOCATION", "INTERFACE");
        for p in &d.public {
            let private = p.private_ip.map_or_else(|| "-".to_owned(), |ip| ip.to_string());
            let _ = writeln!(
                out,
                "  {:<39} {:<26} {:<22} {private}",
                p.public_ip.to_string(),
                p.allocation_id,
                p.interface_id.as_deref().unwrap_or("-"),
            );
        }
    }
    let in_subnet = d.used.iter().filter(|ip| d.subnet_cidr.contains(*ip)).count();
    let _ = writeln!(
        out,
        "private addresses in use or reserved: {in_subnet}; free: {}",
        free(d).map_or_else(|| "many".to_owned(), |n| n.to_string())
    );
    out
}

/// The subnet's addresses no interface uses and the provider does not
/// reserve (`None` for a range too large to count in a `u64`).
fn free(d: &Discovered) -> Option<u64> {
    let bits = match d.subnet_cidr.addr() {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    } - u32::from(d.subnet_cidr.prefix_len());
    let size = 1u64.checked_shl(bits).filter(|_| bits < 64)?;
    let used = d.used.iter().filter(|ip| d.subnet_cidr.contains(*ip)).count() as u64;
    Some(size.saturating_sub(used))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::cloud::PublicAddress;
    use std::collections::BTreeSet;

    #[test]
    fn the_report_names_each_address_and_what_is_left() {
        let pool = PoolSelector {
            provider: crate::cloud::Provider::Aws,
            tags: [("egret.dev/pool".to_owned(), "prod".to_owned())].into(),
            subnet_id: "subnet-1".into(),
            ipv6: false,
        };
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut used: BTreeSet<IpAddr> =
            ["198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3", "198.18.1.255"].iter().map(|s| ip(s)).collect();
        used.insert(ip("198.18.1.10"));
        used.insert(ip("192.0.2.9")); // outside the subnet: not counted
        let d = Discovered {
            public: vec![
                PublicAddress {
                    public_ip: ip("203.0.113.5"),
                    allocation_id: "eipalloc-1".into(),
                    private_ip: Some(ip("198.18.1.10")),
                    interface_id: Some("eni-1".into()),
                },
                PublicAddress {
                    public_ip: ip("203.0.113.6"),
                    allocation_id: "eipalloc-2".into(),
                    private_ip: None,
                    interface_id: None,
                },
            ],
            subnet_cidr: "198.18.1.0/24".parse().unwrap(),
            used,
        };
        let out = render("aws", &pool, &d);
        assert!(out.contains("subnet:    subnet-1 (198.18.1.0/24)"), "{out}");
        assert!(out.contains("tags:      egret.dev/pool=prod"), "{out}");
        assert!(out.contains("public addresses: 2"), "{out}");
        let line =
            |needle: &str| out.lines().find(|l| l.contains(needle)).unwrap().split_whitespace().collect::<Vec<_>>();
        assert_eq!(line("203.0.113.5"), ["203.0.113.5", "eipalloc-1", "eni-1", "198.18.1.10"]);
        assert_eq!(line("203.0.113.6"), ["203.0.113.6", "eipalloc-2", "-", "-"]);
        assert!(out.contains("in use or reserved: 6; free: 250"), "{out}");
    }

    #[test]
    fn a_huge_range_is_not_counted() {
        let d = Discovered { public: vec![], subnet_cidr: "2001:db8::/64".parse().unwrap(), used: BTreeSet::new() };
        assert_eq!(free(&d), None);
        let d = Discovered { public: vec![], subnet_cidr: "2001:db8::/65".parse().unwrap(), used: BTreeSet::new() };
        assert_eq!(free(&d), Some(1 << 63));
    }
}
