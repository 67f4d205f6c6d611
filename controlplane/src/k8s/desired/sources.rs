//! Sources of egress: every `EgressPolicy` and annotated Service, parsed
//! into a [`Source`], oldest first.

use std::collections::BTreeMap;
use std::net::IpAddr;

use egret_dataplane::nat::port_alloc::PortRange;
use egret_dataplane::nat::port_blocks::PortBlocks;
use egret_dataplane::tables::NatSettings;
use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::jiff::Timestamp;
use kube::core::{ParseExpressionError, Selector, SelectorExt};

use super::{Labels, Observed, Owner, PolicyInfo, ServiceInfo, ServiceProblem};
use crate::k8s::crd::{self, reason, Cause};

/// Every source of egress, oldest first (creation time, then owner), and
/// the problems of annotated Services found while parsing them.
pub(super) struct SourceList {
    /// Policies and Services, oldest first.
    pub(super) sources: Vec<Source>,
    /// Problems of annotated Services (reported as Events).
    pub(super) service_problems: Vec<ServiceProblem>,
}

/// Phase "sources, oldest first": parses every policy and annotated Service.
pub(super) fn sources(obs: &Observed, nat: &NatSettings) -> SourceList {
    let mut sources: Vec<Source> = obs.policies.iter().map(|p| policy_source(p, obs, nat)).collect();
    let mut service_problems = Vec::new();
    for svc in &obs.services {
        let (s, problem) = service_source(svc, nat);
        service_problems.extend(problem);
        sources.push(s);
    }
    sources.sort_by(|a, b| {
        let key = |s: &Source| (s.created.is_none(), s.created, s.owner.clone());
        key(a).cmp(&key(b))
    });
    SourceList { sources, service_problems }
}

/// What one source of egress (policy or Service) asks for, after parsing.
#[derive(Debug)]
pub(super) struct Source {
    pub(super) owner: Owner,
    pub(super) created: Option<Timestamp>,
    /// Spec error: the source takes part in nothing.
    pub(super) invalid: Option<Cause>,
    /// Requested IPs (explicit or recorded pool allocation) with next hops.
    pub(super) requested: Vec<(IpAddr, Option<IpAddr>)>,
    /// The IPs it won.
    pub(super) granted: Vec<(IpAddr, Option<IpAddr>)>,
    /// Why IPs are missing (conflicts, pool trouble), first reason wins.
    pub(super) ip_problem: Option<Cause>,
    /// Whether pods leave with its IPs (false: Service VIP only announced).
    pub(super) egress: bool,
    pub(super) pool: Option<(String, usize)>,
    pub(super) gateway_selector: Option<Selector>,
    pub(super) pod_selector: Option<Selector>,
    pub(super) namespace_selector: Option<Selector>,
    /// Service: its namespace and selector.
    pub(super) service: Option<(String, Labels)>,
    pub(super) destinations: Vec<IpNet>,
    pub(super) except: Vec<IpNet>,
    /// `PerNode`: `Some(nodeSelector)`; its granted address per Node.
    pub(super) per_node: Option<Option<Selector>>,
    pub(super) node_grants: BTreeMap<String, Vec<IpAddr>>,
    /// `PerNode`: the pool addresses recorded for each Node (a cloud pool's
    /// public addresses; otherwise the same as `node_grants`).
    pub(super) node_claims: BTreeMap<String, Vec<IpAddr>>,
    /// `PerNode` on a cloud pool: where each recorded (Node, public
    /// address) is associated, per the record.
    pub(super) node_cloud: BTreeMap<crate::cloud::node_addresses::NodeKey, crate::cloud::NodeAddress>,
    /// Port blocks on its egress IPs: the policy's, else its pool's.
    pub(super) port_blocks: Option<PortBlocks>,
}

impl Source {
    /// A source that asks for nothing yet: valid, no IPs, pods leave with
    /// its IPs (`egress`).
    fn new(owner: Owner, created: Option<Timestamp>) -> Source {
        Source {
            owner,
            created,
            invalid: None,
            requested: Vec::new(),
            granted: Vec::new(),
            ip_problem: None,
            egress: true,
            pool: None,
            gateway_selector: None,
            pod_selector: None,
            namespace_selector: None,
            service: None,
            destinations: Vec::new(),
            except: Vec::new(),
            per_node: None,
            node_grants: BTreeMap::new(),
            node_claims: BTreeMap::new(),
            node_cloud: BTreeMap::new(),
            port_blocks: None,
        }
    }

    pub(super) fn problem(&mut self, r: &'static str, m: String) {
        if self.ip_problem.is_none() {
            self.ip_problem = Some(Cause::new(r, m));
        }
    }
}

/// `portBlocks` of a policy (`field` `spec.portBlocks`) or of its pool,
/// checked against the NAT port range its egress IPs use.
fn port_blocks(field: &str, b: &crd::PortBlocksSpec, range: PortRange) -> Result<PortBlocks, Cause> {
    let inv = |f: &str, v: u32, m: &str| Cause::new(reason::INVALID_SPEC, format!("{field}.{f}: {v}: must be {m}"));
    let size = b.size.unwrap_or(u32::from(crate::config::DEFAULT_BLOCK_SIZE));
    let max_per_pod = b.max_per_pod.unwrap_or(u32::from(crate::config::DEFAULT_BLOCKS_PER_POD));
    let size16 = u16::try_from(size).map_err(|_| inv("size", size, "at most 32768"))?;
    let max16 = u16::try_from(max_per_pod).map_err(|_| inv("maxPerPod", max_per_pod, "at most 32"))?;
    let blocks = PortBlocks { size: size16, max_per_pod: max16, log_sessions: b.log_sessions.unwrap_or(false) };
    blocks.validate(range).map_err(|e| inv(e.field, e.value, &e.need))?;
    Ok(blocks)
}

fn policy_source(p: &PolicyInfo, obs: &Observed, nat: &NatSettings) -> Source {
    let mut s = Source::new(Owner::Policy(p.name.clone()), p.created);
    let parsed = (|| -> Result<(), Cause> {
        let inv = |m: String| Cause::new(reason::INVALID_SPEC, m);
        let bad = |e: SpecFieldError| Cause::new(reason::INVALID_SPEC, e.to_string());
        s.port_blocks = match (&p.spec.port_blocks, &p.spec.pool) {
            (Some(b), _) => Some(port_blocks("spec.portBlocks", b, nat.ports)?),
            (None, Some(pool)) => match obs.pools.iter().find(|x| x.name == pool.name).and_then(|x| x.spec.port_blocks)
            {
                Some(b) => Some(port_blocks(&format!("EgressIPPool {}: spec.portBlocks", pool.name), &b, nat.ports)?),
                None => None,
            },
            (None, None) => None,
        };
        s.pod_selector = parse_selector("spec.podSelector", &p.spec.pod_selector).map_err(bad)?;
        s.namespace_selector = parse_selector("spec.namespaceSelector", &p.spec.namespace_selector).map_err(bad)?;
        s.gateway_selector = parse_selector("spec.gatewaySelector", &p.spec.gateway_selector).map_err(bad)?;
        s.destinations = parse_cidrs("spec.destinations", &p.spec.destinations).map_err(bad)?;
        if s.destinations.is_empty() {
            return Err(inv(
                "spec.destinations: must list at least one CIDR (0.0.0.0/0 for every IPv4 destination)".into()
            ));
        }
        s.except = parse_cidrs("spec.except", &p.spec.except).map_err(bad)?;
        if p.spec.mode == Some(crd::PolicyMode::PerNode) {
            if !p.spec.egress_ips.is_empty() || p.spec.gateway_selector.is_some() {
                return Err(inv(
                    "spec.mode: PerNode takes its addresses from spec.pool, one per Node: remove spec.egressIPs and spec.gatewaySelector".into(),
                ));
            }
            let Some(pool) = &p.spec.pool else {
                return Err(Cause::new(
                    reason::NO_EGRESS_IP,
                    "spec.mode: PerNode needs spec.pool (one address per Node)",
                ));
            };
            s.per_node = Some(parse_selector("spec.nodeSelector", &p.spec.node_selector).map_err(bad)?);
            s.pool = Some((pool.name.clone(), 1));
            return Ok(());
        }
        if p.spec.node_selector.is_some() {
            return Err(inv("spec.nodeSelector: only for spec.mode: PerNode".into()));
        }
        match (&p.spec.pool, p.spec.egress_ips.is_empty()) {
            (Some(_), false) => {
                return Err(Cause::new(reason::NO_EGRESS_IP, "set either spec.egressIPs or spec.pool, not both"));
            }
            (None, true) => {
                return Err(Cause::new(
                    reason::NO_EGRESS_IP,
                    "set spec.egressIPs or spec.pool: the policy has no egress IP",
                ));
            }
            (Some(pool), true) => {
                let count = pool.count.unwrap_or(1).max(1) as usize;
                s.pool = Some((pool.name.clone(), count));
            }
            (None, false) => {
                for (i, e) in p.spec.egress_ips.iter().enumerate() {
                    let ip = parse_ip(&format!("spec.egressIPs[{i}].ip"), &e.ip).map_err(bad)?;
                    let nh = match &e.next_hop {
                        Some(n) => Some(parse_ip(&format!("spec.egressIPs[{i}].nextHop"), n).map_err(bad)?),
                        None => None,
                    };
                    if s.requested.iter().any(|(x, _)| *x == ip) {
                        return Err(inv(format!("spec.egressIPs[{i}].ip: {ip} is listed twice")));
                    }
                    s.requested.push((ip, nh));
                }
            }
        }
        Ok(())
    })();
    if let Err(e) = parsed {
        s.invalid = Some(e);
    }
    s
}

fn service_source(svc: &ServiceInfo, nat: &NatSettings) -> (Source, Option<ServiceProblem>) {
    let owner = Owner::Service { namespace: svc.namespace.clone(), name: svc.name.clone() };
    let mut s = Source {
        requested: svc.ingress_ips.iter().map(|ip| (*ip, None)).collect(),
        service: Some((svc.namespace.clone(), svc.selector.clone())),
        destinations: vec![IpNet::V4(Default::default()), IpNet::V6(Default::default())],
        ..Source::new(owner, svc.created)
    };
    let problem = |reason: &'static str, message: String| ServiceProblem {
        namespace: svc.namespace.clone(),
        name: svc.name.clone(),
        reason,
        message,
    };
    if !svc.load_balancer {
        s.invalid = Some(Cause::new(reason::NOT_LOAD_BALANCER, ""));
        let m = format!(
            "Service {}/{} is annotated {}=true but is not of type LoadBalancer: only a LoadBalancer VIP can be an egress IP",
            svc.namespace, svc.name, crd::SERVICE_EGRESS_ANNOTATION
        );
        return (s, Some(problem(reason::NOT_LOAD_BALANCER, m)));
    }
    if svc.ingress_ips.is_empty() {
        s.invalid = Some(Cause::new(reason::NO_INGRESS_IP, ""));
        let m = format!(
            "Service {}/{} has no status.loadBalancer.ingress IP yet: its pods get an egress IP once the load balancer assigns one",
            svc.namespace, svc.name
        );
        return (s, Some(problem(reason::NO_INGRESS_IP, m)));
    }
    let ranges = nat.ports;
    let clash: Vec<String> = svc
        .ports
        .iter()
        .filter(|p| (ranges.first..=ranges.last).contains(&p.port))
        .map(|p| format!("{}/{}", p.port, p.protocol))
        .collect();
    if !clash.is_empty() {
        // Announce the VIP (ingress keeps working) but do not translate with
        // it: replies to NAT ports and the Service port would be confused.
        s.egress = false;
        let m = format!(
            "Service {}/{} port {} lies in the gateway's NAT port range {}-{}: its VIP is announced but not used as an egress IP; use Service ports below {} or move nat.ports",
            svc.namespace,
            svc.name,
            clash.join(", "),
            ranges.first,
            ranges.last,
            ranges.first
        );
        return (s, Some(problem(reason::SERVICE_PORT_IN_NAT_RANGE, m)));
    }
    if svc.external_traffic_local {
        // Egress works; inbound does not: the gateway holding the VIP runs
        // none of the Service's endpoints, and kube-proxy there has no local
        // endpoint to send `Local` traffic to (k8s_kube_proxy measures it).
        let m = format!(
            "Service {}/{} has externalTrafficPolicy: Local: its VIP is held by an Egret gateway, which runs none of its endpoints, so kube-proxy there drops the VIP's inbound traffic (its pods still leave with the VIP); use externalTrafficPolicy: Cluster",
            svc.namespace, svc.name
        );
        return (s, Some(problem(reason::EXTERNAL_TRAFFIC_POLICY_LOCAL, m)));
    }
    (s, None)
}

/// A field of a policy's (or a pool's) spec that does not parse; the
/// message names the field and the value (the policy's `Ready` condition
/// shows it).
#[derive(Debug, thiserror::Error)]
pub(super) enum SpecFieldError {
    /// Not an IP address (`spec.egressIPs[i].ip`, `.nextHop`).
    #[error("{field}: {value:?} is not an IP address")]
    NotAnIp {
        /// The field.
        field: String,
        /// The value, as written.
        value: String,
    },
    /// An item of a CIDR list that is not a CIDR (`spec.destinations`,
    /// `spec.except`).
    #[error("{field}[{index}]: {value:?} is not a CIDR")]
    NotACidr {
        /// The list.
        field: String,
        /// The item's index.
        index: usize,
        /// The item, as written.
        value: String,
    },
    /// A label selector the API machinery's rules refuse (kube names the
    /// expression's problem).
    #[error("{field}: {source}")]
    Selector {
        /// The field.
        field: String,
        /// Why.
        #[source]
        source: ParseExpressionError,
    },
}

/// A parsed selector; absent means "everything".
pub(super) fn parse_selector(field: &str, s: &Option<LabelSelector>) -> Result<Option<Selector>, SpecFieldError> {
    match s {
        None => Ok(None),
        Some(sel) => Selector::try_from(sel.clone())
            .map(Some)
            .map_err(|source| SpecFieldError::Selector { field: field.to_owned(), source }),
    }
}

pub(super) fn selects(sel: &Option<Selector>, labels: &Labels) -> bool {
    sel.as_ref().is_none_or(|s| s.matches(labels))
}

fn parse_cidrs(field: &str, v: &[String]) -> Result<Vec<IpNet>, SpecFieldError> {
    v.iter()
        .enumerate()
        .map(|(index, s)| {
            s.trim().parse::<IpNet>().map(|n| n.trunc()).map_err(|_| SpecFieldError::NotACidr {
                field: field.to_owned(),
                index,
                value: s.clone(),
            })
        })
        .collect()
}

fn parse_ip(field: &str, s: &str) -> Result<IpAddr, SpecFieldError> {
    s.trim().parse().map_err(|_| SpecFieldError::NotAnIp { field: field.to_owned(), value: s.to_owned() })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn a_field_that_does_not_parse_is_named_with_its_value() {
        let e = parse_ip("spec.egressIPs[2].nextHop", " 198.51.100.300").unwrap_err();
        assert!(
            matches!(&e, SpecFieldError::NotAnIp { field, value }
                if field == "spec.egressIPs[2].nextHop" && value == " 198.51.100.300"),
            "{e:?}"
        );
        assert_eq!(e.to_string(), "spec.egressIPs[2].nextHop: \" 198.51.100.300\" is not an IP address");
        assert_eq!(parse_ip("f", " 2001:db8::1 ").unwrap(), "2001:db8::1".parse::<IpAddr>().unwrap());
        let e = parse_cidrs("spec.except", &["10.0.0.0/8".into(), "10.1.0.0/33".into()]).unwrap_err();
        assert!(matches!(&e, SpecFieldError::NotACidr { index: 1, .. }), "{e:?}");
        assert_eq!(e.to_string(), "spec.except[1]: \"10.1.0.0/33\" is not a CIDR");
    }
}
