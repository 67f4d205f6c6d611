//! A cloud pool's spec (`EgressIPPool.spec.cloud`), checked over the CRD
//! types alone, and the view of a pool the cloud side reads, so that
//! `cloud/` needs nothing from `k8s::desired` (which uses both).

use crate::k8s::crd::{reason, Cause, EgressIPPoolSpec, EgressIPPoolStatus, PoolCloudSpec};
use crate::k8s::pool::AddressSet;

use super::PoolSelector;

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
    let Some(aws) = &spec.aws else {
        return Err(Cause::new(reason::CLOUD_NOT_SUPPORTED, "spec.cloud: names no provider; set spec.cloud.aws"));
    };
    if aws.tags.is_empty() {
        return Err(Cause::new(
            reason::INVALID_SPEC,
            "spec.cloud.aws.tags: empty; name the tags that mark this pool's Elastic IPs (an empty set would take every Elastic IP of the account)",
        ));
    }
    if let Some((k, _)) = aws.tags.iter().find(|(k, _)| k.is_empty()) {
        return Err(Cause::new(reason::INVALID_SPEC, format!("spec.cloud.aws.tags: the key {k:?} is empty")));
    }
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
    let allowed = AddressSet::parse("addresses", addresses)
        .map_err(|e| Cause::new(reason::INVALID_ADDRESS, format!("spec.{e}")))?;
    if allowed.families().1 {
        return Err(Cause::new(
            reason::INVALID_ADDRESS,
            "spec.addresses: IPv6 with spec.cloud.aws: Elastic IPs are IPv4; an IPv6 pool needs no cloud section"
                .to_string(),
        ));
    }
    Ok((PoolSelector { tags: aws.tags.clone(), subnet_id: aws.subnet_id.clone() }, allowed))
}
