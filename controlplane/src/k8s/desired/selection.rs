//! Selection, candidates, tables: the pods each source selects, the ranked
//! candidate gateways of each granted egress IP, and this gateway's tables.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use egret_dataplane::tables::{EgressIpSpec, PolicySpec, TablesSpec, TunnelSpec};
use ipnet::IpNet;

use super::sources::{selects, Source};
use super::{rank_gateways, IpAssignment, LocalConfig, NodeInfo, Observed, Owner, PodInfo, Role};

/// What the selection gave.
#[derive(Debug, Default)]
pub(super) struct Selection {
    /// Every egress IP in use, with its ranked candidates.
    pub(super) ips: BTreeMap<IpAddr, IpAssignment>,
    /// `PerNode` policies (their table names) -> Node -> its granted address.
    pub(super) per_node: BTreeMap<String, BTreeMap<String, Vec<IpAddr>>>,
    /// The policies of this gateway's (or node agent's) tables, by name.
    pub(super) policies: Vec<PolicySpec>,
    /// Selected pods of each valid source.
    pub(super) selected_pods: BTreeMap<Owner, usize>,
}

/// Phase "selection, candidates": for each valid source (sorting its grants),
/// the pods it selects, its egress IPs' candidates, and its table policy.
pub(super) fn select(obs: &Observed, local: &LocalConfig, sources: &mut [Source]) -> Selection {
    let gateway_names: Vec<&NodeInfo> = obs.gateways.iter().collect();
    let mut out = Selection::default();
    for s in sources.iter_mut().filter(|s| s.invalid.is_none()) {
        s.granted.sort();
        let pods: Vec<&PodInfo> = obs
            .pods
            .iter()
            .filter(|p| match &s.service {
                Some((ns, sel)) => {
                    p.namespace == *ns && !sel.is_empty() && sel.iter().all(|(k, v)| p.labels.get(k) == Some(v))
                }
                None => {
                    let ns_labels = obs.namespaces.get(&p.namespace).cloned().unwrap_or_default();
                    selects(&s.namespace_selector, &ns_labels) && selects(&s.pod_selector, &p.labels)
                }
            })
            .collect();
        out.selected_pods.insert(s.owner.clone(), pods.len());
        if s.per_node.is_some() {
            out.per_node.insert(s.owner.table_name(), s.node_grants.clone());
            // Only the node agent puts it in its tables, with its own address.
            let own = s.node_grants.get(&local.node_name).cloned().unwrap_or_default();
            if local.role == Role::Node && !own.is_empty() {
                let srcs = pod_sources(&pods, &own);
                if !srcs.is_empty() {
                    out.policies.push(PolicySpec {
                        name: s.owner.table_name(),
                        sources: srcs,
                        destinations: s.destinations.clone(),
                        except: s.except.clone(),
                        egress_ips: own,
                    });
                }
            }
            continue;
        }
        for (ip, nh) in &s.granted {
            let eligible: Vec<&str> = gateway_names
                .iter()
                .filter(|n| selects(&s.gateway_selector, &n.labels))
                .map(|n| n.name.as_str())
                .collect();
            out.ips.insert(
                *ip,
                IpAssignment {
                    owner: s.owner.clone(),
                    next_hop: *nh,
                    egress: s.egress,
                    candidates: rank_gateways(*ip, &eligible),
                    port_blocks: s.port_blocks,
                },
            );
        }
        let egress_ips: Vec<IpAddr> = s.granted.iter().map(|(ip, _)| *ip).collect();
        if !s.egress || egress_ips.is_empty() {
            continue;
        }
        let srcs = pod_sources(&pods, &egress_ips);
        if srcs.is_empty() {
            continue;
        }
        out.policies.push(PolicySpec {
            name: s.owner.table_name(),
            sources: srcs,
            destinations: s.destinations.clone(),
            except: s.except.clone(),
            egress_ips,
        });
    }
    out.policies.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// Phase "tables": this gateway's tables, with `policies` and only the
/// egress IPs (and companion next hops) it holds.
pub(super) fn tables(
    obs: &Observed,
    local: &LocalConfig,
    ips: &BTreeMap<IpAddr, IpAssignment>,
    policies: Vec<PolicySpec>,
) -> TablesSpec {
    let mut egress_ips = Vec::new();
    let mut neighbor_addresses = Vec::new();
    let mut service_addresses = Vec::new();
    for ip in &obs.held {
        let Some(a) = ips.get(ip) else { continue };
        if a.egress {
            egress_ips.push(EgressIpSpec { ip: *ip, ports: None, answer_neighbor: true, port_blocks: a.port_blocks });
            // A Service's VIP: its Service ports stay the kernel's.
            if matches!(a.owner, Owner::Service { .. }) {
                service_addresses.push(*ip);
            }
        } else {
            neighbor_addresses.push(*ip);
        }
        neighbor_addresses.extend(a.next_hop);
    }
    neighbor_addresses.sort();
    TablesSpec {
        policies,
        egress_ips,
        neighbor_addresses,
        nat: local.nat,
        service_addresses,
        guard: local.guard.clone(),
        // The daemon's sink adds the node's addresses (from the kernel).
        local_addresses: Vec::new(),
        tunnel: local.tunnel_port.map(|port| tunnel(obs, port)),
        // The controller's, from what it hands over (k8s/handed_over.rs).
        handed_over: Vec::new(),
    }
}

/// The nodes' tunnel: every Node's InternalIPs, gateways included (a
/// gateway Node's own pods may be steered to another gateway).
fn tunnel(obs: &Observed, port: u16) -> TunnelSpec {
    let nodes: BTreeSet<IpAddr> = obs.nodes.iter().flat_map(|n| n.internal_ips.iter().copied()).collect();
    TunnelSpec { port, nodes: nodes.into_iter().collect() }
}

fn host_net(ip: IpAddr) -> IpNet {
    match ip {
        IpAddr::V4(_) => IpNet::new(ip, 32),
        IpAddr::V6(_) => IpNet::new(ip, 128),
    }
    .unwrap_or_else(|_| IpNet::from(ip))
}

/// The /32s and /128s of `pods` in the families `egress_ips` cover, sorted.
fn pod_sources(pods: &[&PodInfo], egress_ips: &[IpAddr]) -> Vec<IpNet> {
    let has_v4 = egress_ips.iter().any(IpAddr::is_ipv4);
    let has_v6 = egress_ips.iter().any(IpAddr::is_ipv6);
    let mut srcs: Vec<IpNet> = pods
        .iter()
        .flat_map(|p| p.ips.iter())
        .filter(|ip| if ip.is_ipv4() { has_v4 } else { has_v6 })
        .map(|ip| host_net(*ip))
        .collect();
    srcs.sort();
    srcs.dedup();
    srcs
}
