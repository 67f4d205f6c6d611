//! `interfaces[].defaultRoute: true`: the interface of the default route.
//!
//! One name in a chart's values cannot match every cluster's nodes (`eth0`,
//! `ens5`, `enp1s0`...), while on a one-arm gateway the interface the pods'
//! traffic arrives on and leaves by is almost always the one the default
//! route goes through. `defaultRoute: true` (instead of a `name`) stands
//! for it (held as the name [`DEFAULT_ROUTE`] until resolved): the
//! interface of the usable IPv4 default route with the lowest metric in the
//! main table, read from the kernel (`/proc/net/route`: this process's
//! network namespace) each time the file is loaded, at start and at every
//! reload. IPv6-only gateways name their interface: `/proc/net/ipv6_route`
//! lists every routing table, so a policy table's default could be taken.
//! A host without a usable default route, or a name resolved to an
//! interface the file also lists, is refused naming the field.

use std::path::Path;

use super::{ConfigError, ConfigErrors, GatewayConfig};

/// The name held for `defaultRoute: true` until it is resolved (no
/// interface name in a file may start with `@`).
pub const DEFAULT_ROUTE: &str = "@default";

/// The interface of the lowest-metric usable IPv4 default route in `route`
/// (the text of `/proc/net/route`: the main table only): up, not a reject
/// route (unreachable, blackhole, prohibit: `RTF_REJECT`, interface `*`).
pub fn default_route_interface(route: &str) -> Option<String> {
    route
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            let (iface, dest, flags, metric, mask) = (f.first()?, f.get(1)?, f.get(3)?, f.get(6)?, f.get(7)?);
            let flags = u32::from_str_radix(flags, 16).ok()?;
            let usable = flags & 0x1 != 0 && flags & 0x200 == 0 && *iface != "*";
            (usable && *dest == "00000000" && *mask == "00000000")
                .then(|| Some((metric.parse::<u32>().ok()?, iface.to_string())))
                .flatten()
        })
        .min()
        .map(|(_, iface)| iface)
}

/// Replaces `defaultRoute: true` in `cfg` with the default route's interface as this
/// process sees it now.
pub fn resolve(cfg: &mut GatewayConfig) -> Result<(), ConfigErrors> {
    if !cfg.interfaces.iter().any(|i| i.name == DEFAULT_ROUTE) {
        return Ok(());
    }
    let found = default_route_interface(&std::fs::read_to_string(Path::new("/proc/net/route")).unwrap_or_default());
    resolve_with(cfg, found)
}

/// [`resolve`] with the default route's interface given (`None`: none).
pub fn resolve_with(cfg: &mut GatewayConfig, found: Option<String>) -> Result<(), ConfigErrors> {
    let invalid = |i: usize, reason: String| {
        ConfigErrors(vec![ConfigError::Invalid {
            file: cfg.file.clone(),
            path: format!("interfaces[{i}].defaultRoute"),
            value: "true".into(),
            reason,
        }])
    };
    let Some(at) = cfg.interfaces.iter().position(|i| i.name == DEFAULT_ROUTE) else { return Ok(()) };
    let Some(name) = found else {
        return Err(invalid(at, "this host has no default route (IPv4 or IPv6) to take the interface from".into()));
    };
    if let Some(other) = cfg.interfaces.iter().position(|i| i.name == name) {
        return Err(invalid(
            at,
            format!("the default route's interface is {name}, which interfaces[{other}] lists too"),
        ));
    }
    tracing::info!(interface = %name, "interfaces[{at}]: defaultRoute: the default route's interface");
    cfg.interfaces[at].name = name;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const ROUTE: &str = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
        ens5\t00000000\t0101A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n\
        ens6\t00000000\t0102A8C0\t0003\t0\t0\t50\t00000000\t0\t0\t0\n\
        ens5\t0001A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
        down0\t00000000\t0103A8C0\t0002\t0\t0\t1\t00000000\t0\t0\t0\n\
        *\t00000000\t00000000\t0201\t0\t0\t2\t00000000\t0\t0\t0\n";

    #[test]
    fn the_lowest_metric_usable_ipv4_default_wins() {
        assert_eq!(
            default_route_interface(ROUTE).as_deref(),
            Some("ens6"),
            "metric 50 over 100; down0 is not up; the unreachable default (metric 2) is not usable"
        );
        assert_eq!(default_route_interface("Iface\tDestination\n"), None);
        assert_eq!(default_route_interface(""), None);
    }

    #[test]
    fn at_default_is_replaced_or_refused_naming_the_field() {
        let k8s = "kubernetes: {nodeName: gw-1}\n";
        let text = format!("interfaces:\n  - defaultRoute: true\n    role: both\n{k8s}");
        let mut cfg = crate::config::load_str("gw.yaml", &text).unwrap();
        let mut again = cfg.clone();
        resolve_with(&mut cfg, Some("ens5".into())).unwrap();
        assert_eq!(cfg.interfaces[0].name, "ens5");
        let e = resolve_with(&mut again, None).unwrap_err().to_string();
        assert!(e.contains("interfaces[0].defaultRoute") && e.contains("no default route"), "{e}");
        let text =
            format!("interfaces:\n  - defaultRoute: true\n    role: inside\n  - name: ens5\n    role: outside\n{k8s}");
        let mut two = crate::config::load_str("gw.yaml", &text).unwrap();
        let e = resolve_with(&mut two, Some("ens5".into())).unwrap_err().to_string();
        assert!(e.contains("interfaces[1] lists too"), "{e}");
        let both = format!("interfaces:\n  - name: ens5\n    defaultRoute: true\n{k8s}");
        let e = crate::config::load_str("gw.yaml", &both).unwrap_err().to_string();
        assert!(e.contains("interfaces[0].name") && e.contains("not both"), "{e}");
        let neither = format!("interfaces:\n  - role: both\n{k8s}");
        let e = crate::config::load_str("gw.yaml", &neither).unwrap_err().to_string();
        assert!(e.contains("interfaces[0].name") && e.contains("missing"), "{e}");
        let at = format!("interfaces:\n  - name: \"@default\"\n{k8s}");
        assert!(crate::config::load_str("gw.yaml", &at).is_err(), "a name may not pose as the placeholder");
    }
}
