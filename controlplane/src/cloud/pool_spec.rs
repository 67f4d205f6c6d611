//! A cloud pool's spec (`EgressIPPool.spec.cloud`), checked over the CRD
//! types alone, and the view of a pool the cloud side reads, so that
//! `cloud/` needs nothing from `k8s::desired` (which uses both).

use std::collections::BTreeMap;

use crate::k8s::crd::{
    reason, AwsPoolSpec, AzurePoolSpec, Cause, EgressIPPoolSpec, EgressIPPoolStatus, GcpPoolSpec, PoolCloudSpec,
};
use crate::k8s::pool::AddressSet;

use super::{PoolSelector, Provider};

/// An `EgressIPPool` as the cloud side reads it: its name, its spec and its
/// status as last written (which holds the recorded pairing).
/// `k8s::desired::PoolInfo` is one.
pub trait PoolView {
    /// `metadata.name`.
    fn pool_name(&self) -> &str;
    /// `spec`.
    fn pool_spec(&self) -> &EgressIPPoolSpec;
    /// `status` as last written.
    fn pool_status(&self) -> Option<&EgressIPPoolStatus>;
}

/// A cloud pool's spec, checked: the provider's selector and the private
/// range (empty: the whole subnet). The error's message names the field
/// and its value.
pub fn cloud_spec(spec: &PoolCloudSpec, addresses: &[String]) -> Result<(PoolSelector, AddressSet), Cause> {
    let named: Vec<&str> = [("aws", spec.aws.is_some()), ("azure", spec.azure.is_some()), ("gcp", spec.gcp.is_some())]
        .iter()
        .filter(|(_, set)| *set)
        .map(|(n, _)| *n)
        .collect();
    let allowed = AddressSet::parse("addresses", addresses)
        .map_err(|e| Cause::new(reason::INVALID_ADDRESS, format!("spec.{e}")))?;
    let (v4, v6) = allowed.families();
    if let (Some(aws), true, false) = (&spec.aws, v6, v4) {
        if named.len() == 1 {
            return aws_ipv6_selector(aws).map(|sel| (sel, allowed));
        }
    }
    let sel = match (&spec.aws, &spec.azure, &spec.gcp) {
        _ if named.len() > 1 => {
            return Err(Cause::new(
                reason::INVALID_SPEC,
                format!(
                    "spec.cloud: names {} providers ({}); a pool's addresses come from one",
                    named.len(),
                    named.join(", ")
                ),
            ))
        }
        (Some(aws), _, _) => aws_selector(aws)?,
        (_, Some(azure), _) => azure_selector(azure)?,
        (_, _, Some(gcp)) => gcp_selector(gcp)?,
        _ => {
            return Err(Cause::new(
                reason::CLOUD_NOT_SUPPORTED,
                "spec.cloud: names no provider; set spec.cloud.aws, spec.cloud.azure or spec.cloud.gcp",
            ))
        }
    };
    let field = sel.provider.name();
    if !sel.provider.pairs_privately() && !addresses.is_empty() {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            format!(
                "spec.addresses: {addresses:?} with spec.cloud.{field}: a GCP pool's egress IPs are its labelled external addresses themselves; remove spec.addresses"
            ),
        ));
    }
    if v6 {
        let why = match sel.provider {
            Provider::Aws => "an AWS pool is either IPv4 (Elastic IPs) or IPv6 (the subnet's addresses): make two pools",
            _ => "IPv6 cloud pools are built for AWS only; an IPv6 pool without a cloud section serves addresses the network routes to the gateways",
        };
        return Err(Cause::new(
            reason::INVALID_ADDRESS,
            format!("spec.addresses: IPv6 with spec.cloud.{field}: {why}"),
        ));
    }
    Ok((sel, allowed))
}

/// `tags` (or GCP's `labels`) of `spec.cloud.<provider>`: never empty (that
/// would select every address of the account), no empty key.
fn tags(field: &str, tags: &BTreeMap<String, String>) -> Result<(), Cause> {
    if tags.is_empty() {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            format!("spec.cloud.{field}: empty; name the tags that mark this pool's public addresses (an empty set would take every address of the account)"),
        ));
    }
    if let Some((k, _)) = tags.iter().find(|(k, _)| k.is_empty()) {
        return Err(Cause::new(reason::INVALID_SPEC, format!("spec.cloud.{field}: the key {k:?} is empty")));
    }
    Ok(())
}

fn aws_selector(aws: &AwsPoolSpec) -> Result<PoolSelector, Cause> {
    tags("aws.tags", &aws.tags)?;
    aws_subnet(aws)
}

fn aws_subnet(aws: &AwsPoolSpec) -> Result<PoolSelector, Cause> {
    let subnet = aws.subnet_id.as_str();
    if !subnet.starts_with("subnet-")
        || subnet.len() <= "subnet-".len()
        || !subnet[7..].bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            format!("spec.cloud.aws.subnetId: {subnet:?} is not a subnet ID (subnet-0123abcd)"),
        ));
    }
    Ok(PoolSelector { provider: Provider::Aws, tags: aws.tags.clone(), subnet_id: aws.subnet_id.clone(), ipv6: false })
}

/// An AWS IPv6 pool: the pool's own addresses (of the subnet's IPv6 range)
/// are assigned to the holder's ENI; there are no Elastic IPs, so no tags.
fn aws_ipv6_selector(aws: &AwsPoolSpec) -> Result<PoolSelector, Cause> {
    if !aws.tags.is_empty() {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            "spec.cloud.aws.tags: set with IPv6 spec.addresses: an IPv6 pool has no Elastic IPs (its addresses are global); remove the tags",
        ));
    }
    let sel = aws_subnet(aws)?;
    Ok(PoolSelector { ipv6: true, ..sel })
}

fn azure_selector(azure: &AzurePoolSpec) -> Result<PoolSelector, Cause> {
    tags("azure.tags", &azure.tags)?;
    let id = azure.subnet_id.as_str();
    // /subscriptions/S/resourceGroups/RG/providers/Microsoft.Network/virtualNetworks/V/subnets/N,
    // the segment names compared without case as ARM does.
    let parts: Vec<&str> = id.split('/').collect();
    let shape = [
        "",
        "subscriptions",
        "",
        "resourcegroups",
        "",
        "providers",
        "microsoft.network",
        "virtualnetworks",
        "",
        "subnets",
        "",
    ];
    let fits = parts.len() == shape.len()
        && parts.iter().zip(shape).all(|(p, want)| if want.is_empty() { true } else { p.eq_ignore_ascii_case(want) })
        && [2, 4, 8, 10].iter().all(|i| !parts[*i].is_empty());
    if !fits || !parts[0].is_empty() {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            format!(
                "spec.cloud.azure.subnetId: {id:?} is not a subnet's resource ID (/subscriptions/S/resourceGroups/RG/providers/Microsoft.Network/virtualNetworks/V/subnets/N)"
            ),
        ));
    }
    Ok(PoolSelector { provider: Provider::Azure, tags: azure.tags.clone(), subnet_id: id.to_string(), ipv6: false })
}

fn gcp_selector(gcp: &GcpPoolSpec) -> Result<PoolSelector, Cause> {
    tags("gcp.labels", &gcp.labels)?;
    // GCP's label rules: keys start with a lowercase letter; keys and values
    // are at most 63 lowercase letters, digits, `_` and `-`.
    let ok = |s: &str| {
        s.len() <= 63 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
    };
    for (k, v) in &gcp.labels {
        if !ok(k) || !k.starts_with(|c: char| c.is_ascii_lowercase()) || !ok(v) {
            return Err(Cause::new(
                reason::INVALID_SPEC,
                format!(
                    "spec.cloud.gcp.labels: {k:?}: {v:?} is not a GCP label (a key starts with a lowercase letter; keys and values are at most 63 lowercase letters, digits, '_' and '-')"
                ),
            ));
        }
    }
    let path = gcp.subnetwork.strip_prefix("https://www.googleapis.com/compute/v1/").unwrap_or(&gcp.subnetwork);
    let parts: Vec<&str> = path.split('/').collect();
    let fits = parts.len() == 6
        && parts[0] == "projects"
        && parts[2] == "regions"
        && parts[4] == "subnetworks"
        && [1, 3, 5].iter().all(|i| !parts[*i].is_empty());
    if !fits {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            format!(
                "spec.cloud.gcp.subnetwork: {:?} is not a subnetwork (projects/P/regions/R/subnetworks/S)",
                gcp.subnetwork
            ),
        ));
    }
    Ok(PoolSelector { provider: Provider::Gcp, tags: gcp.labels.clone(), subnet_id: path.to_string(), ipv6: false })
}
