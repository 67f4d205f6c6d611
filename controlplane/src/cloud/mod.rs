//! Cloud egress IPs: where the VPC, not ARP, decides which gateway receives
//! an address.
//!
//! In a cloud an egress IP is two addresses. The **private** one is a
//! secondary address on the gateway's network interface (ENI): pods' traffic
//! is translated to it and the VPC delivers its replies to whichever
//! interface holds it. The **public** one (an AWS Elastic IP) is associated
//! with the private one, and the VPC's gateway rewrites one to the other 1:1.
//!
//! - [`Cloud`]: what a provider does (discover tagged public addresses and
//!   the subnet's used addresses, find a Node's interface, assign, release).
//!   AWS ([`aws`]) is the first implementation; ADR 0014 says what GCP and
//!   Azure need from the same four calls.
//! - [`cloud_spec`]: a pool's `spec.cloud` checked, over the CRD types
//!   ([`PoolView`] is what this module reads of a pool).
//! - [`pairing`]: which private address stands for each public one, recorded
//!   in the pool's status so every gateway and node agent agrees.
//! - [`inspect`]: `egret cloud discover`, the same discovery asked once from
//!   the command line.
//! - [`task`]: the gateway's side: discovery, and moving each address with
//!   its Lease (assign before translating, release when it is given up).

#[cfg(feature = "aws")]
pub mod aws;
#[cfg(feature = "azure")]
pub mod azure;
#[cfg(feature = "gcp")]
pub mod gcp;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use futures::future::BoxFuture;
use ipnet::IpNet;

pub mod inspect;
pub mod node_addresses;
pub mod pairing;
mod pool_spec;
#[cfg(test)]
mod scripted;
pub mod task;

pub use pool_spec::{cloud_spec, PoolView};

/// A cloud provider, as `EgressIPPool.spec.cloud` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Provider {
    /// `spec.cloud.aws`: Elastic IPs.
    #[default]
    Aws,
    /// `spec.cloud.azure`: public IP addresses.
    Azure,
    /// `spec.cloud.gcp`: static external addresses.
    Gcp,
}

impl Provider {
    /// The name in `spec.cloud`.
    pub fn name(self) -> &'static str {
        match self {
            Provider::Aws => "aws",
            Provider::Azure => "azure",
            Provider::Gcp => "gcp",
        }
    }

    /// Whether each public address stands for a private address of the
    /// subnet (AWS, Azure: a 1:1 NAT in the provider's network), or is the
    /// egress IP itself (GCP's protocol forwarding delivers the external
    /// address unchanged to the holder, which translates to it).
    pub fn pairs_privately(self) -> bool {
        !matches!(self, Provider::Gcp)
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which public addresses and which subnet a cloud pool uses (from
/// `EgressIPPool.spec.cloud`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolSelector {
    /// Whose addresses.
    pub provider: Provider,
    /// Public addresses carrying all of these tags (`key` -> `value`; GCP's
    /// labels). Empty for an IPv6 pool.
    pub tags: BTreeMap<String, String>,
    /// An IPv6 pool: no public addresses; the pool's own addresses (of the
    /// subnet's IPv6 range) move with their Leases (AWS: AssignIpv6Addresses).
    pub ipv6: bool,
    /// The subnet the gateways' interfaces and the private addresses are in.
    pub subnet_id: String,
}

/// A public address the provider found for a pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublicAddress {
    /// The address itself.
    pub public_ip: IpAddr,
    /// The provider's handle for it (AWS: `eipalloc-...`).
    pub allocation_id: String,
    /// The private address it is associated with now, if any.
    pub private_ip: Option<IpAddr>,
    /// The interface it is associated with now, if any.
    pub interface_id: Option<String>,
}

/// What discovery found for one pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovered {
    /// The tagged public addresses, by public IP.
    pub public: Vec<PublicAddress>,
    /// The subnet's range.
    pub subnet_cidr: IpNet,
    /// Addresses in the subnet that some interface uses (primary or
    /// secondary) and those the provider reserves (AWS: the first four and
    /// the last), so a new pairing never takes one.
    pub used: BTreeSet<IpAddr>,
}

/// A gateway's network interface in a pool's subnet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    /// The instance (from the Node's `spec.providerID`).
    pub instance_id: String,
    /// The interface (AWS: `eni-...`).
    pub interface_id: String,
    /// Its primary private address.
    pub primary_ip: IpAddr,
    /// Its secondary private addresses.
    pub secondary_ips: BTreeSet<IpAddr>,
    /// Whether the provider drops traffic not addressed to the interface's
    /// own addresses (AWS: source/destination check). A gateway needs it off.
    pub source_dest_check: bool,
}

/// A worker Node's address in a `PerNode` cloud pool (ADR 0033): the
/// private address on the Node's own interface that the public address is
/// associated with. On a provider whose public address is the egress IP
/// itself (GCP, [`Provider::pairs_privately`] false) `private_ip` is the
/// public address and `interface_id` the handle traffic for it is
/// forwarded to.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeAddress {
    /// The Node's interface (AWS: `eni-...`).
    pub interface_id: String,
    /// The address the Node's selected pods are translated to.
    pub private_ip: IpAddr,
}

/// One failed call to the provider.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct CloudError {
    /// The call (`AssignPrivateIpAddresses`).
    pub operation: &'static str,
    /// The provider's error code (`RequestLimitExceeded`), or a transport
    /// failure's kind (`timeout`, `connect`).
    pub code: String,
    /// The provider's message.
    pub message: String,
    /// Whether trying again may succeed (throttling, 5xx, transport).
    pub retryable: bool,
}

impl fmt::Display for CloudError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.operation, self.code, self.message)
    }
}

/// The error code of an assignment refused because the private address is
/// on an interface that is not a gateway's ([`Cloud::assign`]).
pub const HELD_ELSEWHERE: &str = "AddressHeldElsewhere";

/// A cloud provider's calls. Implementations are cheap to share
/// (`Arc<dyn Cloud>`); each call is one bounded attempt (the caller retries
/// with backoff).
pub trait Cloud: Send + Sync {
    /// The provider's name in `EgressIPPool.spec.cloud` (`aws`).
    fn name(&self) -> &'static str;

    /// The pool's tagged public addresses, with their current associations,
    /// and the addresses in use in its subnet.
    fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>>;

    /// The interface of the instance named by `provider_id` (a Node's
    /// `spec.providerID`, e.g. `aws:///us-east-1a/i-0abc`) in `subnet_id`.
    fn interface<'a>(
        &'a self,
        provider_id: &'a str,
        subnet_id: &'a str,
    ) -> BoxFuture<'a, Result<Interface, CloudError>>;

    /// The primary interface of the instance named by `provider_id`,
    /// whatever its subnet: a worker Node's, for a `PerNode` cloud pool
    /// (ADR 0033). Worker nodes may sit in any subnet (ADR 0031).
    fn primary_interface<'a>(&'a self, provider_id: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>>;

    /// Adds a secondary private address to `interface_id`, chosen by the
    /// provider from the interface's subnet, and returns it: a worker
    /// Node's address for a `PerNode` cloud pool (ADR 0033). The provider
    /// chooses, never Egret, because the CNI may give the same subnet's
    /// addresses to the same interfaces at the same time (AWS VPC CNI).
    /// Only for providers that pair privately ([`Provider::pairs_privately`]).
    fn add_address<'a>(&'a self, interface_id: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>>;

    /// Makes `private` a secondary address of `interface_id`, taking it from
    /// another gateway's interface, and associates `public` with it, taking
    /// it from any other association. Idempotent, and it always makes the
    /// provider's idempotent calls: a stale read (the provider's API is
    /// eventually consistent) must not make a take-over skip one.
    ///
    /// `gateways` are the `spec.providerID`s of the instances Egret manages:
    /// the gateway Nodes, and the worker Nodes of `PerNode` cloud pools when
    /// the call is for a worker. An address on an interface of any other
    /// instance (or of none) is someone else's,
    /// and the call refuses it (code [`HELD_ELSEWHERE`], not retryable)
    /// instead of taking it.
    fn assign<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
        gateways: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>>;

    /// Whether the provider's view has `private` on `interface_id` and
    /// `public` associated with it now (a refresh's check for drift: an
    /// address moved by someone else, or a call the provider lost).
    fn verify<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>>;

    /// Removes `private` from `interface_id` if it is still there (a later
    /// holder may have taken it already: that is success).
    fn release<'a>(&'a self, interface_id: &'a str, private: IpAddr) -> BoxFuture<'a, Result<(), CloudError>>;
}

/// The cloud pools whose spec is valid, by name.
pub fn selectors<P: PoolView>(pools: &[P]) -> BTreeMap<String, PoolSelector> {
    pools
        .iter()
        .filter_map(|p| {
            let spec = p.pool_spec();
            let cloud = spec.cloud.as_ref()?;
            let (sel, _) = cloud_spec(cloud, &spec.addresses).ok()?;
            Some((p.pool_name().to_string(), sel))
        })
        .collect()
}

/// Every cloud address of the valid cloud pools, by the egress IP: where a
/// gateway holding its Lease must put it. These are the recorded pairings
/// (private address and the public one that stands for it), and the
/// allocated addresses of IPv6 pools (which have no public address).
pub fn targets<P: PoolView>(pools: &[P]) -> BTreeMap<IpAddr, task::Target> {
    let sel = selectors(pools);
    let mut out = BTreeMap::new();
    for p in pools {
        let Some(s) = sel.get(p.pool_name()) else { continue };
        let target = |public| task::Target { provider: s.provider, subnet_id: s.subnet_id.clone(), public };
        if s.ipv6 {
            let allocated = p.pool_status().into_iter().flat_map(|st| st.allocations.iter()).flat_map(|a| a.ips.iter());
            for ip in allocated.filter_map(|ip| ip.parse::<IpAddr>().ok()).filter(IpAddr::is_ipv6) {
                out.entry(ip).or_insert(target(None));
            }
            continue;
        }
        for a in p.pool_status().iter().flat_map(|st| st.cloud_addresses.iter()) {
            let (Ok(private), Ok(public)) = (a.private_ip.parse::<IpAddr>(), a.public_ip.parse::<IpAddr>()) else {
                continue;
            };
            let public = PublicAddress {
                public_ip: public,
                allocation_id: a.allocation_id.clone(),
                private_ip: Some(private),
                interface_id: None,
            };
            // A private address two records name (a race the pairing
            // resolves in its next pass): the first pool by name keeps it,
            // as the pairing does.
            out.entry(private).or_insert(target(Some(public)));
        }
    }
    out
}

/// The providers a gateway can use, each made on first use with its
/// standard credential chain (AWS: `AWS_REGION`, `AWS_ENDPOINT_URL_EC2`, the
/// instance profile or IRSA; Azure: workload identity, else managed
/// identity, `EGRET_AZURE_ARM_ENDPOINT`; GCP: application default
/// credentials or the metadata server, `EGRET_GCP_COMPUTE_ENDPOINT`). A provider this build does not include (a
/// cargo feature off) refuses every call for good, naming the feature.
pub fn providers() -> task::Factory {
    Box::new(|provider| {
        Box::pin(async move {
            match provider {
                #[cfg(feature = "aws")]
                Provider::Aws => Arc::new(aws::AwsCloud::load(None, None).await) as Arc<dyn Cloud>,
                #[cfg(feature = "azure")]
                Provider::Azure => Arc::new(azure::AzureCloud::load()) as Arc<dyn Cloud>,
                #[cfg(feature = "gcp")]
                Provider::Gcp => Arc::new(gcp::LazyGcp::default()) as Arc<dyn Cloud>,
                // Reached in a build without one of the features.
                #[allow(unreachable_patterns)]
                other => Arc::new(NotBuilt(other)) as Arc<dyn Cloud>,
            }
        })
    })
}

/// A provider this build does not include: every call fails for good,
/// naming the missing cargo feature.
#[derive(Debug)]
struct NotBuilt(Provider);

impl NotBuilt {
    fn refuse<T: Send + 'static>(&self, operation: &'static str) -> BoxFuture<'static, Result<T, CloudError>> {
        let name = self.0.name();
        Box::pin(async move {
            Err(CloudError {
                operation,
                code: "NotBuilt".into(),
                message: format!("this egret was built without the `{name}` feature"),
                retryable: false,
            })
        })
    }
}

impl Cloud for NotBuilt {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn discover<'a>(&'a self, _: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
        self.refuse("discover")
    }
    fn interface<'a>(&'a self, _: &'a str, _: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        self.refuse("interface")
    }
    fn primary_interface<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        self.refuse("primary_interface")
    }
    fn add_address<'a>(&'a self, _: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>> {
        self.refuse("add_address")
    }
    fn assign<'a>(
        &'a self,
        _: &'a str,
        _: IpAddr,
        _: Option<&'a PublicAddress>,
        _: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        self.refuse("assign")
    }
    fn verify<'a>(
        &'a self,
        _: &'a str,
        _: IpAddr,
        _: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>> {
        self.refuse("verify")
    }
    fn release<'a>(&'a self, _: &'a str, _: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
        self.refuse("release")
    }
}
