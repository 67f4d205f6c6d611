//! The GCP provider: static external addresses found by label, delivered to
//! the gateway that holds each address's Lease by **protocol forwarding**.
//!
//! Per gateway instance (per network interface) there is one *target
//! instance* (`egret-<instance name>`, in the instance's zone, `natPolicy:
//! NO_NAT`); per egress address one regional *forwarding rule*
//! (`egret-203-0-113-10`: `IPAddress` the address, `IPProtocol:
//! L3_DEFAULT`, `allPorts`, `loadBalancingScheme: EXTERNAL`) whose `target`
//! is the holder's target instance. A move is one `forwardingRules.setTarget`.
//! GCP delivers packets for the rule's address to the target instance
//! unchanged (no 1:1 NAT), and the instance may send packets from that
//! address, so the gateway translates the pods' traffic to the external
//! address itself.
//!
//! There is therefore no private address on GCP: the trait's "private"
//! address *is* the public one (the control plane records the pairing as
//! the identity), the trait's "interface" is the target instance, and
//! discovery has no private addresses to keep a pairing away from: `used`
//! holds only the four addresses GCP reserves in the subnetwork's primary
//! range (VPC documentation, "Reserved IP addresses in IPv4 subnets": the
//! network address, the default gateway, the second-to-last address and the
//! broadcast address).
//!
//! Every trait call is one attempt through the official client
//! (`google-cloud-compute-v1`) with the client's retries off
//! ([`NeverRetry`]), each HTTP request bounded by [`ATTEMPT_TIMEOUT`] and the
//! whole call, the polls of its long-running operations included, by
//! [`CALL_TIMEOUT`]: the caller (the cloud task) owns the retries. A mutation
//! returns an Operation; the call polls it (through each service's own
//! `get_operation`, the client's LRO poller) until it is `DONE`, because the
//! change takes effect only then, starting after [`POLL_INITIAL`] and
//! doubling up to [`POLL_MAX`] (the client's default starts at 1 s and grows
//! to 60 s, which would make every move wait at least a second). A poll
//! that fails transiently (503, a refused connection) is polled again within
//! the bound; any other failed poll ends the call. The Compute calls, and
//! why each:
//!
//! | trait call | Compute calls |
//! |---|---|
//! | [`Cloud::discover`] | `addresses.list` (region of the subnetwork; `filter` on the labels, ANDed; pages), `forwardingRules.get` for each address used by its `egret-` rule (where it points), `subnetworks.get` (the range) |
//! | [`Cloud::interface`] | `instances.get` (from the Node's `spec.providerID`: the interface in the subnetwork, `canIpForward`), `targetInstances.get` (and `targetInstances.insert`, polled to `DONE`, when it is missing), `forwardingRules.list` (`filter` on `target`: the addresses it receives) |
//! | [`Cloud::assign`] | `addresses.get` (`addresses.list` with a `filter` on the address when no discovered address is given; its `users`: anything but our rule is a refusal), `forwardingRules.get` (our rule; where it points), `targetInstances.get` (the instance behind a current target: not a gateway's is a refusal), then `forwardingRules.insert` when the rule is missing, else always `forwardingRules.setTarget`, polled to `DONE`; an insert answered 409 (the read was stale) is followed by a setTarget, a setTarget answered 404 by an insert |
//! | [`Cloud::primary_interface`] | `instances.get` (the instance's `nic0`, whatever its subnetwork: a worker Node's), `targetInstances.get` of the Node's own target instance `egret-node-<instance>` (and `targetInstances.insert`, polled to `DONE`, when it is missing), `forwardingRules.list` (`filter` on `target`, in the instance's region) |
//! | [`Cloud::add_address`] | none: refused for good, since a Node's address is the external address itself |
//! | [`Cloud::verify`] | `forwardingRules.get` (the rule targets this gateway's target instance) |
//! | [`Cloud::release`] | `forwardingRules.get` (does it still target us?), `forwardingRules.delete` polled to `DONE` |
//!
//! `assign` always makes the mutating call: a read may be stale (another
//! gateway's `setTarget` not visible yet), and a take-over that skipped the
//! call on a stale read would translate to an address GCP delivers
//! elsewhere.
//!
//! `release` reads the rule and deletes it when it still targets this
//! gateway; Compute has no conditional delete, so a take-over whose
//! `setTarget` completes between the two is deleted with it. The new
//! holder's `verify` finds the rule gone at its next refresh and assigns
//! again (an outage of up to one `kubernetes.resyncPeriod`). The old holder
//! releases as soon as it gives the Lease up, usually before another gateway
//! has taken the Lease and moved the rule: the window is rare, not
//! impossible.
//!
//! A worker Node's address (a `PerNode` cloud pool, ADR 0033) is the pool's
//! external address forwarded to the Node's own target instance
//! (`egret-node-<instance>`, on `nic0`, made by `primary_interface`): there
//! is no private address to add (`add_address` refuses), and `assign`,
//! `verify` and `release` take that target instance as a gateway's. The
//! Node's target instance has a name of its own, not the gateways'
//! `egret-<instance>`, so that a rule targeting it is known for a Node's
//! association: `assign` takes the address from it whoever calls (as a
//! public address is taken from any association on AWS and Azure), while
//! a rule targeting a gateway-style target instance of an instance that is
//! not a gateway is still refused. The cost is one target instance per
//! worker Node given an address, and one forwarding rule per Node address.
//!
//! The IAM permissions these calls need (by their names in Compute's
//! permission reference; not yet checked against a real project) are
//! `compute.addresses.get`/`list`/`use`, `compute.forwardingRules.get`/
//! `list`/`create`/`delete`/`setTarget`, `compute.targetInstances.get`/
//! `create`/`use`, `compute.instances.get`/`use`, `compute.subnetworks.get`
//! and `compute.zoneOperations.get`/`compute.regionOperations.get`.
//!
//! Credentials come from the client's default chain (application default
//! credentials: `GOOGLE_APPLICATION_CREDENTIALS`, then the metadata server,
//! which is what workload identity on GKE answers; `GCE_METADATA_HOST`
//! moves the metadata server); the client honours no endpoint variable of
//! its own, so [`GcpCloud::load`] reads [`ENDPOINT_ENV`].
//!
//! Only IPv4: external IPv6 addresses are ranges (a /96), which this
//! provider neither discovers nor forwards.

use std::collections::BTreeSet;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use futures::future::BoxFuture;
use google_cloud_auth::credentials::Credentials;
use google_cloud_compute_v1::client;
use google_cloud_compute_v1::model::{self, address, forwarding_rule, target_instance, Operation};
use google_cloud_gax::error::rpc::{Code, StatusDetails};
use google_cloud_gax::exponential_backoff::ExponentialBackoffBuilder;
use google_cloud_gax::polling_error_policy::Aip194Strict;
use google_cloud_gax::retry_policy::NeverRetry;
use google_cloud_lro::Poller;
use ipnet::IpNet;
use tokio::time::Instant;

use super::{Cloud, CloudError, Discovered, Interface, PoolSelector, PublicAddress, HELD_ELSEWHERE};

/// The bound on one HTTP request (connection and answer included).
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);

/// The bound on one trait call: every request it makes and every poll of
/// its long-running operations until they are `DONE`. A call that runs out
/// of it fails retryably (`timeout`); an operation it leaves running still
/// completes, and the caller's next attempt makes the same idempotent call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The first wait before an operation is polled; it doubles after each
/// poll up to [`POLL_MAX`].
pub const POLL_INITIAL: Duration = Duration::from_millis(250);

/// The longest wait between two polls of an operation.
pub const POLL_MAX: Duration = Duration::from_secs(2);

/// The Compute endpoint for [`GcpCloud::load`] (a URL such as
/// `http://127.0.0.1:8080`, for an emulator; unset: Google's endpoint).
pub const ENDPOINT_ENV: &str = "EGRET_GCP_COMPUTE_ENDPOINT";

/// Names of the forwarding rules and target instances this provider makes.
pub const NAME_PREFIX: &str = "egret-";

/// What the target instances this provider makes say they are for.
const GATEWAY_TARGET: &str = "Egret egress gateway: receives the egress addresses forwarded to this instance";
const NODE_TARGET: &str = "Egret PerNode address: receives the Node's egress addresses forwarded to this instance";

/// The host Compute writes into every link, and the other one it accepts.
const LINK_PREFIX: &str = "https://www.googleapis.com/compute/v1/";
const LINK_PREFIXES: [&str; 2] = [LINK_PREFIX, "https://compute.googleapis.com/compute/v1/"];

/// The longest GCP resource name (RFC 1035 label).
const MAX_NAME: usize = 63;

/// Reasons of Compute's `errors[]` (kept by the client as `ErrorInfo`
/// details) that mean "slow down" or "try again".
const RETRYABLE_REASONS: &[&str] = &[
    "rateLimitExceeded",
    "userRateLimitExceeded",
    "RATE_LIMIT_EXCEEDED",
    "backendError",
    "internalError",
    "conditionNotMet",
    "resourceNotReady",
];

/// Codes of a failed operation's `error.errors[]` that mean the same, or
/// that the state changed while it ran (the next attempt reads again).
const RETRYABLE_OPERATION_CODES: &[&str] = &[
    "RATE_LIMIT_EXCEEDED",
    "CONDITION_NOT_MET",
    "RESOURCE_NOT_READY",
    "RESOURCE_NOT_FOUND",
    "INTERNAL_ERROR",
    "SERVICE_UNAVAILABLE",
];

/// The GCP implementation of [`Cloud`].
#[derive(Clone, Debug)]
pub struct GcpCloud {
    addresses: client::Addresses,
    rules: client::ForwardingRules,
    targets: client::TargetInstances,
    instances: client::Instances,
    subnetworks: client::Subnetworks,
}

macro_rules! build_client {
    ($client:ty, $endpoint:expr, $credentials:expr) => {{
        let polling = ExponentialBackoffBuilder::new()
            .with_initial_delay(POLL_INITIAL)
            .with_maximum_delay(POLL_MAX)
            .with_scaling(2.0)
            .build()
            .map_err(|e| setup(format!("polling backoff: {e}")))?;
        let mut b = <$client>::builder()
            .with_credentials($credentials.clone())
            .with_retry_policy(NeverRetry)
            .with_attempt_timeout(ATTEMPT_TIMEOUT)
            .with_polling_backoff_policy(polling)
            .with_polling_error_policy(Aip194Strict);
        if let Some(endpoint) = $endpoint {
            b = b.with_endpoint(endpoint.clone());
        }
        b.build().await.map_err(|e| setup(e.to_string()))?
    }};
}

impl GcpCloud {
    /// A provider with the client's default credentials (application
    /// default credentials; on GKE with workload identity, the metadata
    /// server) and the endpoint from [`ENDPOINT_ENV`] when it is set.
    ///
    /// Nothing is asked of the metadata server here (the universe domain is
    /// given): a token is fetched on the first call, and a failure to get
    /// one is that call's error.
    pub async fn load() -> Result<Self, CloudError> {
        install_crypto_provider();
        let credentials = google_cloud_auth::credentials::Builder::default()
            .with_universe_domain("googleapis.com")
            .build()
            .map_err(|e| setup(format!("application default credentials: {e}")))?;
        let endpoint = std::env::var(ENDPOINT_ENV).ok().filter(|e| !e.is_empty());
        Self::new(endpoint, credentials).await
    }

    /// A provider for `endpoint` (Google's when `None`) with `credentials`
    /// (tests: anonymous ones, or a static token, against an emulator).
    pub async fn new(endpoint: Option<String>, credentials: Credentials) -> Result<Self, CloudError> {
        install_crypto_provider();
        let endpoint = endpoint.as_ref();
        Ok(Self {
            addresses: build_client!(client::Addresses, endpoint, credentials),
            rules: build_client!(client::ForwardingRules, endpoint, credentials),
            targets: build_client!(client::TargetInstances, endpoint, credentials),
            instances: build_client!(client::Instances, endpoint, credentials),
            subnetworks: build_client!(client::Subnetworks, endpoint, credentials),
        })
    }

    async fn discover_impl(&self, pool: &PoolSelector, call: &Call) -> Result<Discovered, CloudError> {
        let subnet = Subnet::parse(&pool.subnet_id)?;
        let filter = label_filter(&pool.tags)?;
        let mut found = Vec::new();
        let mut token = String::new();
        loop {
            let page = call
                .run(
                    "addresses.list",
                    self.addresses
                        .list()
                        .set_project(&subnet.project)
                        .set_region(&subnet.region)
                        .set_filter(&filter)
                        .set_page_token(&token)
                        .send(),
                )
                .await?;
            found.extend(page.items);
            match page.next_page_token {
                Some(t) if !t.is_empty() => token = t,
                _ => break,
            }
        }
        let mut public = Vec::new();
        for a in &found {
            // addressType absent means EXTERNAL (the reference's default).
            if a.address_type.as_ref().is_some_and(|t| *t != address::AddressType::External) {
                continue;
            }
            let Some(IpAddr::V4(ip)) = a.address.as_deref().and_then(|s| s.parse().ok()) else { continue };
            let Some(self_link) = a.self_link.clone() else { continue };
            let rule = rule_path(&subnet.project, &subnet.region, ip);
            let (private_ip, interface_id) = if a.users.iter().any(|u| path_of(u) == rule) {
                let got = call
                    .find(
                        "forwardingRules.get",
                        self.rules
                            .get()
                            .set_project(&subnet.project)
                            .set_region(&subnet.region)
                            .set_forwarding_rule(rule_name(ip))
                            .send(),
                    )
                    .await?;
                match got {
                    Some(r) if rule_ip(&r) == Some(ip) => (Some(IpAddr::V4(ip)), r.target),
                    // Deleted since the address was read, or not ours.
                    _ => (None, None),
                }
            } else {
                (None, None)
            };
            public.push(PublicAddress {
                public_ip: IpAddr::V4(ip),
                allocation_id: self_link,
                private_ip,
                interface_id,
            });
        }
        public.sort_by_key(|p| p.public_ip);

        let sub = call
            .run(
                "subnetworks.get",
                self.subnetworks
                    .get()
                    .set_project(&subnet.project)
                    .set_region(&subnet.region)
                    .set_subnetwork(&subnet.name)
                    .send(),
            )
            .await?;
        let Some(cidr) = sub.ip_cidr_range else {
            return Err(invalid("subnetworks.get", &format!("subnetwork {} has no IPv4 range", subnet.path())));
        };
        let subnet_cidr: IpNet = cidr.parse().map_err(|_| {
            invalid("subnetworks.get", &format!("subnetwork {}: unparsable range {cidr:?}", subnet.path()))
        })?;
        Ok(Discovered { public, subnet_cidr, used: reserved(subnet_cidr) })
    }

    async fn interface_impl(&self, provider_id: &str, subnet_id: &str, call: &Call) -> Result<Interface, CloudError> {
        let node = parse_provider_id(provider_id)?;
        let subnet = Subnet::parse(subnet_id)?;
        let instance = self.instance(&node, call).await?;
        let nic = instance
            .network_interfaces
            .iter()
            .find(|n| n.subnetwork.as_deref().is_some_and(|s| path_of(s) == subnet.path()))
            .ok_or_else(|| {
                invalid(
                    "instances.get",
                    &format!("instance {} has no network interface in subnetwork {}", node.path(), subnet.path()),
                )
            })?;
        let receiver = Receiver {
            name: target_instance_name(&node.name, nic.name.as_deref().unwrap_or("nic0")),
            description: GATEWAY_TARGET,
            project: &subnet.project,
            region: &subnet.region,
        };
        self.receiving(&node, &instance, nic, receiver, call).await
    }

    /// A worker Node's instance: its `nic0` (whatever its subnetwork) and the
    /// Node's own target instance ([`node_target_instance_name`]), with the
    /// addresses its instance's region forwards to it.
    async fn primary_interface_impl(&self, provider_id: &str, call: &Call) -> Result<Interface, CloudError> {
        let node = parse_provider_id(provider_id)?;
        let region = region_of(&node.zone).unwrap_or_default();
        let instance = self.instance(&node, call).await?;
        let nic = instance
            .network_interfaces
            .first()
            .ok_or_else(|| invalid("instances.get", &format!("instance {} has no network interface", node.path())))?;
        let receiver = Receiver {
            name: node_target_instance_name(&node.name),
            description: NODE_TARGET,
            project: &node.project,
            region,
        };
        self.receiving(&node, &instance, nic, receiver, call).await
    }

    async fn instance(&self, node: &InstanceRef, call: &Call) -> Result<model::Instance, CloudError> {
        call.run(
            "instances.get",
            self.instances.get().set_project(&node.project).set_zone(&node.zone).set_instance(&node.name).send(),
        )
        .await
    }

    /// `nic` of `instance` as the trait's [`Interface`]: its target instance
    /// (made when missing) and the addresses whose rules target it.
    async fn receiving(
        &self,
        node: &InstanceRef,
        instance: &model::Instance,
        nic: &model::NetworkInterface,
        receiver: Receiver<'_>,
        call: &Call,
    ) -> Result<Interface, CloudError> {
        let instance_link = instance.self_link.clone().unwrap_or_else(|| node.link());
        let nic_name = nic.name.as_deref().unwrap_or("nic0");
        let primary = nic.network_ip.as_deref().ok_or_else(|| {
            invalid("instances.get", &format!("instance {}: its interface {nic_name} has no address", node.path()))
        })?;
        let primary_ip = parse_ip("instances.get", primary)?;
        let target = self.ensure_target_instance(node, &instance_link, &receiver, nic.network.as_deref(), call).await?;
        let secondary_ips = self.forwarded_to(receiver.project, receiver.region, &target, call).await?;
        Ok(Interface {
            instance_id: instance_link,
            interface_id: target,
            primary_ip,
            secondary_ips,
            // canIpForward off (the default) drops packets whose source or
            // destination is not the instance's own: the pods' traffic.
            source_dest_check: !instance.can_ip_forward.unwrap_or(false),
        })
    }

    /// The addresses whose rules (ours, by name) in `project`/`region`
    /// target `target` now.
    async fn forwarded_to(
        &self,
        project: &str,
        region: &str,
        target: &str,
        call: &Call,
    ) -> Result<BTreeSet<IpAddr>, CloudError> {
        let filter = format!("(target = {})", quote(target));
        let mut found = BTreeSet::new();
        let mut token = String::new();
        loop {
            let page = call
                .run(
                    "forwardingRules.list",
                    self.rules
                        .list()
                        .set_project(project)
                        .set_region(region)
                        .set_filter(&filter)
                        .set_page_token(&token)
                        .send(),
                )
                .await?;
            for r in &page.items {
                let Some(ip) = rule_ip(r) else { continue };
                if r.name.as_deref() == Some(rule_name(ip).as_str())
                    && r.target.as_deref().is_some_and(|t| path_of(t) == path_of(target))
                {
                    found.insert(IpAddr::V4(ip));
                }
            }
            match page.next_page_token {
                Some(t) if !t.is_empty() => token = t,
                _ => return Ok(found),
            }
        }
    }

    /// The target instance `receiver` names for `instance` (created when
    /// missing, and waited for): its selfLink.
    async fn ensure_target_instance(
        &self,
        node: &InstanceRef,
        instance_link: &str,
        receiver: &Receiver<'_>,
        network: Option<&str>,
        call: &Call,
    ) -> Result<String, CloudError> {
        let name = receiver.name.as_str();
        let get = || {
            call.find(
                "targetInstances.get",
                self.targets.get().set_project(&node.project).set_zone(&node.zone).set_target_instance(name).send(),
            )
        };
        let check = |ti: model::TargetInstance| -> Result<String, CloudError> {
            let link = ti
                .self_link
                .unwrap_or_else(|| scoped_link(&node.project, "zones", &node.zone, "targetInstances", name));
            let for_instance = ti.instance.as_deref().is_some_and(|i| path_of(i) == path_of(instance_link));
            let same_network = match (ti.network.as_deref(), network) {
                (Some(a), Some(b)) => path_of(a) == path_of(b),
                _ => true,
            };
            if for_instance && same_network {
                return Ok(link);
            }
            Err(CloudError {
                operation: "targetInstances.get",
                code: "TargetInstanceConflict".into(),
                message: format!(
                    "target instance {} exists but forwards to {} (network {}), not to {} (network {}): rename or delete it",
                    path_of(&link),
                    ti.instance.as_deref().map_or("nothing", path_of),
                    ti.network.as_deref().map_or("of nic0", path_of),
                    path_of(instance_link),
                    network.map_or("of nic0", path_of),
                ),
                retryable: false,
            })
        };
        if let Some(ti) = get().await? {
            return check(ti);
        }
        let mut body = model::TargetInstance::new()
            .set_name(name)
            .set_instance(instance_link)
            .set_nat_policy(target_instance::NatPolicy::NoNat)
            .set_description(receiver.description);
        if let Some(network) = network {
            body = body.set_network(network);
        }
        let insert =
            self.targets.insert().set_project(&node.project).set_zone(&node.zone).set_body(body).poller().until_done();
        match call.finish("targetInstances.insert", insert).await {
            Ok(()) => {}
            // Made meanwhile by another call of this gateway's: use it.
            Err(f) if f.status == Some(409) => {}
            Err(f) => return Err(f.error),
        }
        match get().await? {
            Some(ti) => check(ti),
            // Created (DONE) but not visible yet: its link is known.
            None => Ok(scoped_link(&node.project, "zones", &node.zone, "targetInstances", name)),
        }
    }

    async fn assign_impl(
        &self,
        target: &str,
        ip: IpAddr,
        public: Option<&PublicAddress>,
        gateways: &BTreeSet<String>,
        call: &Call,
    ) -> Result<(), CloudError> {
        let ip = ipv4_only("forwardingRules.setTarget", ip)?;
        let ti = TargetRef::parse(target)?;
        let region = region_of(&ti.zone).ok_or_else(|| bad_target(target))?;
        if let Some(p) = public {
            if p.public_ip != IpAddr::V4(ip) {
                return Err(CloudError {
                    operation: "forwardingRules.setTarget",
                    code: "InvalidPairing".into(),
                    message: format!(
                        "on GCP an egress address is its own public address; {ip} is paired with {}",
                        p.public_ip
                    ),
                    retryable: false,
                });
            }
        }
        let project = ti.project.clone();
        let addr = self.address(&project, region, ip, public, call).await?;
        let rule = rule_name(ip);
        let our_rule = rule_path(&project, region, ip);
        // Anything else using the address (an access config, another
        // rule) is someone else's: taking the address would break it.
        if let Some(other) = addr.users.iter().find(|u| path_of(u) != our_rule) {
            return Err(held_elsewhere(ip, &format!("it is used by {}", path_of(other))));
        }
        let current = call
            .find(
                "forwardingRules.get",
                self.rules.get().set_project(&project).set_region(region).set_forwarding_rule(&rule).send(),
            )
            .await?;
        if let Some(r) = &current {
            self.refuse_foreign_rule(r, ip, target, gateways, call).await?;
        }
        let set_target = || {
            self.rules
                .set_target()
                .set_project(&project)
                .set_region(region)
                .set_forwarding_rule(&rule)
                .set_body(model::TargetReference::new().set_target(target))
                .poller()
                .until_done()
        };
        let insert = || {
            let mut body = model::ForwardingRule::new()
                .set_name(&rule)
                .set_ip_address(addr.self_link.clone().unwrap_or_else(|| ip.to_string()))
                .set_ip_protocol(forwarding_rule::IPProtocol::L3Default)
                .set_all_ports(true)
                .set_load_balancing_scheme(forwarding_rule::LoadBalancingScheme::External)
                .set_target(target)
                .set_description("Egret egress address: forwarded to the gateway that holds its Lease");
            if let Some(tier) = addr.network_tier.as_ref().and_then(|t| t.name()) {
                body = body.set_network_tier(forwarding_rule::NetworkTier::from(tier));
            }
            self.rules.insert().set_project(&project).set_region(region).set_body(body).poller().until_done()
        };
        // The mutating call is made whatever the read said (it may be
        // stale): setTarget when the rule exists, insert when it does not;
        // each falls back to the other when the read was wrong.
        if current.is_some() {
            match call.finish("forwardingRules.setTarget", set_target()).await {
                Err(f) if f.status == Some(404) && !f.in_operation => {
                    call.finish("forwardingRules.insert", insert()).await.map_err(|f| f.error)
                }
                r => r.map_err(|f| f.error),
            }
        } else {
            match call.finish("forwardingRules.insert", insert()).await {
                Err(f) if f.status == Some(409) => {
                    call.finish("forwardingRules.setTarget", set_target()).await.map_err(|f| f.error)
                }
                r => r.map_err(|f| f.error),
            }
        }
    }

    /// The address resource for `ip`: by its link (the discovered address)
    /// or, without one, by a filter on the address.
    async fn address(
        &self,
        project: &str,
        region: &str,
        ip: Ipv4Addr,
        public: Option<&PublicAddress>,
        call: &Call,
    ) -> Result<model::Address, CloudError> {
        let not_found = || CloudError {
            operation: "addresses.get",
            code: "NotFound".into(),
            message: format!("no reserved external address {ip} in projects/{project}/regions/{region}"),
            retryable: false,
        };
        let addr = match public {
            Some(p) => {
                let link = Scoped::parse(&p.allocation_id, "regions", "addresses").ok_or_else(|| CloudError {
                    operation: "addresses.get",
                    code: "InvalidAddress".into(),
                    message: format!("{:?} is not the link of a regional address", p.allocation_id),
                    retryable: false,
                })?;
                if link.project != project || link.scope != region {
                    return Err(CloudError {
                        operation: "addresses.get",
                        code: "InvalidAddress".into(),
                        message: format!(
                            "address {} is not in projects/{project}/regions/{region}, where the gateway's target instance is",
                            path_of(&p.allocation_id)
                        ),
                        retryable: false,
                    });
                }
                call.find(
                    "addresses.get",
                    self.addresses.get().set_project(project).set_region(region).set_address(&link.name).send(),
                )
                .await?
            }
            None => {
                let page = call
                    .run(
                        "addresses.list",
                        self.addresses
                            .list()
                            .set_project(project)
                            .set_region(region)
                            .set_filter(format!("(address = {})", quote(&ip.to_string())))
                            .send(),
                    )
                    .await?;
                page.items.into_iter().find(|a| a.address.as_deref() == Some(ip.to_string().as_str()))
            }
        };
        let addr = addr.ok_or_else(not_found)?;
        if addr.address.as_deref() != Some(ip.to_string().as_str())
            || addr.address_type.as_ref().is_some_and(|t| *t != address::AddressType::External)
        {
            return Err(not_found());
        }
        Ok(addr)
    }

    /// Refuses (for good, [`HELD_ELSEWHERE`]) when our rule for `ip`
    /// carries another address, or forwards to something that is neither a
    /// gateway's target instance nor a worker Node's ([`is_node_target`]:
    /// the pool's address given to a Node, which any assignment may take, as
    /// AWS's `AllowReassociation` takes an Elastic IP).
    async fn refuse_foreign_rule(
        &self,
        rule: &model::ForwardingRule,
        ip: Ipv4Addr,
        target: &str,
        gateways: &BTreeSet<String>,
        call: &Call,
    ) -> Result<(), CloudError> {
        let name = rule.name.as_deref().unwrap_or_default();
        if rule_ip(rule) != Some(ip) {
            return Err(held_elsewhere(ip, &format!("forwarding rule {name} carries {:?}", rule.ip_address)));
        }
        let Some(current) = rule.target.as_deref().filter(|t| !t.is_empty()) else { return Ok(()) };
        if path_of(current) == path_of(target) {
            return Ok(());
        }
        let Some(other) = TargetRef::parse(current).ok() else {
            return Err(held_elsewhere(ip, &format!("forwarding rule {name} forwards to {}", path_of(current))));
        };
        let ti = call
            .find(
                "targetInstances.get",
                self.targets
                    .get()
                    .set_project(&other.project)
                    .set_zone(&other.zone)
                    .set_target_instance(&other.name)
                    .send(),
            )
            .await?;
        // A target that is gone receives nothing: the rule is ours to point.
        let Some(ti) = ti else { return Ok(()) };
        let instance = ti.instance.as_deref().map(path_of).unwrap_or_default();
        let gateway_instances: BTreeSet<String> =
            gateways.iter().filter_map(|p| parse_provider_id(p).ok()).map(|i| i.path()).collect();
        if gateway_instances.contains(instance) || is_node_target(&other.name, instance) {
            return Ok(());
        }
        Err(held_elsewhere(
            ip,
            &format!(
                "forwarding rule {name} forwards to {} (instance {}), which is neither a gateway Node nor a worker Node's target instance",
                path_of(current),
                if instance.is_empty() { "none" } else { instance }
            ),
        ))
    }

    async fn verify_impl(&self, target: &str, ip: IpAddr, call: &Call) -> Result<bool, CloudError> {
        let ip = ipv4_only("forwardingRules.get", ip)?;
        let ti = TargetRef::parse(target)?;
        let region = region_of(&ti.zone).ok_or_else(|| bad_target(target))?;
        let rule = call
            .find(
                "forwardingRules.get",
                self.rules.get().set_project(&ti.project).set_region(region).set_forwarding_rule(rule_name(ip)).send(),
            )
            .await?;
        Ok(rule.is_some_and(|r| {
            rule_ip(&r) == Some(ip) && r.target.as_deref().is_some_and(|t| path_of(t) == path_of(target))
        }))
    }

    /// Deletes the rule for `ip` if it still targets `target`.
    ///
    /// A worker Node's address is released the same way, for these reasons:
    /// `release` knows no other holder to retarget the rule to; a rule left
    /// targeting the Node would keep delivering the address to a Node that
    /// no longer translates to it, and would keep the address `IN_USE` (the
    /// rule is its user), so that the next Node's `assign` would have to
    /// take it with a `setTarget` anyway. Deleted, the address is free
    /// (`RESERVED`) and the next Node's `assign` inserts a rule of its own. A
    /// rule that targets another Node by then (the address given to it
    /// already) is left alone. The Node's target instance is kept: its other
    /// addresses may target it, Compute has no conditional delete to remove
    /// it only once unused, and the Node's next address reuses it.
    async fn release_impl(&self, target: &str, ip: IpAddr, call: &Call) -> Result<(), CloudError> {
        let ip = ipv4_only("forwardingRules.delete", ip)?;
        let ti = TargetRef::parse(target)?;
        let region = region_of(&ti.zone).ok_or_else(|| bad_target(target))?;
        let rule = rule_name(ip);
        let current = call
            .find(
                "forwardingRules.get",
                self.rules.get().set_project(&ti.project).set_region(region).set_forwarding_rule(&rule).send(),
            )
            .await?;
        // Gone, or pointed at a later holder: released already.
        let Some(current) = current else { return Ok(()) };
        if current.target.as_deref().is_none_or(|t| path_of(t) != path_of(target)) {
            return Ok(());
        }
        let delete = self
            .rules
            .delete()
            .set_project(&ti.project)
            .set_region(region)
            .set_forwarding_rule(&rule)
            .poller()
            .until_done();
        match call.finish("forwardingRules.delete", delete).await {
            Ok(()) => Ok(()),
            // Deleted meanwhile (by an earlier attempt whose answer was lost).
            Err(f) if f.status == Some(404) => Ok(()),
            Err(f) => Err(f.error),
        }
    }
}

impl Cloud for GcpCloud {
    fn name(&self) -> &'static str {
        "gcp"
    }

    fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
        Box::pin(async move {
            let call = Call::new();
            call.bound("discover", self.discover_impl(pool, &call)).await
        })
    }

    fn interface<'a>(
        &'a self,
        provider_id: &'a str,
        subnet_id: &'a str,
    ) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(async move {
            let call = Call::new();
            call.bound("interface", self.interface_impl(provider_id, subnet_id, &call)).await
        })
    }

    fn primary_interface<'a>(&'a self, provider_id: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(async move {
            let call = Call::new();
            call.bound("primary_interface", self.primary_interface_impl(provider_id, &call)).await
        })
    }

    fn add_address<'a>(&'a self, interface_id: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>> {
        Box::pin(async move { Err(no_private_address(interface_id)) })
    }

    fn assign<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
        gateways: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(async move {
            let call = Call::new();
            call.bound("assign", self.assign_impl(interface_id, private, public, gateways, &call)).await
        })
    }

    fn verify<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        _public: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>> {
        // The rule carries the address itself: the public address adds
        // nothing to check.
        Box::pin(async move {
            let call = Call::new();
            call.bound("verify", self.verify_impl(interface_id, private, &call)).await
        })
    }

    fn release<'a>(&'a self, interface_id: &'a str, private: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(async move {
            let call = Call::new();
            call.bound("release", self.release_impl(interface_id, private, &call)).await
        })
    }
}

// ------------------------------------------------------------ one call ---

/// One trait call's time budget ([`CALL_TIMEOUT`]), shared by its requests
/// and polls, so that running out of it names the request that was waiting.
struct Call {
    deadline: Instant,
}

/// A mutation that did not complete: its error, the HTTP status it carried
/// (the request's, or the operation's `httpErrorStatusCode`) and whether the
/// operation, rather than the request, failed.
struct Failure {
    error: CloudError,
    status: Option<u16>,
    in_operation: bool,
}

impl Call {
    fn new() -> Self {
        Self { deadline: Instant::now() + CALL_TIMEOUT }
    }

    /// The whole call within the budget (each step is bounded already; this
    /// is the guard for anything between them).
    async fn bound<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, CloudError>>,
    ) -> Result<T, CloudError> {
        tokio::time::timeout_at(self.deadline, fut).await.unwrap_or_else(|_| Err(out_of_time(operation)))
    }

    /// One request within the budget.
    async fn run<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = google_cloud_gax::Result<T>>,
    ) -> Result<T, CloudError> {
        match tokio::time::timeout_at(self.deadline, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(classify(operation, &e)),
            Err(_) => Err(out_of_time(operation)),
        }
    }

    /// A lookup within the budget: `None` when Compute answers 404.
    async fn find<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = google_cloud_gax::Result<T>>,
    ) -> Result<Option<T>, CloudError> {
        match tokio::time::timeout_at(self.deadline, fut).await {
            Ok(Ok(v)) => Ok(Some(v)),
            Ok(Err(e)) if e.http_status_code() == Some(404) => Ok(None),
            Ok(Err(e)) => Err(classify(operation, &e)),
            Err(_) => Err(out_of_time(operation)),
        }
    }

    /// A mutation and the polls of its operation until `DONE`, within the
    /// budget; an operation that ends with an error is a failure.
    async fn finish(
        &self,
        operation: &'static str,
        fut: impl Future<Output = google_cloud_gax::Result<Operation>>,
    ) -> Result<(), Failure> {
        match tokio::time::timeout_at(self.deadline, fut).await {
            Ok(Ok(op)) => match operation_error(operation, &op) {
                None => Ok(()),
                Some(error) => Err(Failure {
                    error,
                    status: op.http_error_status_code.and_then(|s| u16::try_from(s).ok()),
                    in_operation: true,
                }),
            },
            Ok(Err(e)) => {
                Err(Failure { error: classify(operation, &e), status: e.http_status_code(), in_operation: false })
            }
            Err(_) => Err(Failure { error: out_of_time(operation), status: None, in_operation: false }),
        }
    }
}

fn out_of_time(operation: &'static str) -> CloudError {
    CloudError {
        operation,
        code: "timeout".into(),
        message: format!("no answer (or the operation not DONE) within the call's {} s", CALL_TIMEOUT.as_secs()),
        retryable: true,
    }
}

// ------------------------------------------------------------- errors ---

/// What a failed request means for the caller.
fn classify(operation: &'static str, err: &google_cloud_gax::error::Error) -> CloudError {
    let transport =
        |code: &str, retryable: bool| CloudError { operation, code: code.into(), message: err.to_string(), retryable };
    if err.is_timeout() {
        return transport("timeout", true);
    }
    if err.is_connect() {
        return transport("connect", true);
    }
    if err.is_authentication() {
        // The metadata server not answering yet is transient; a credential
        // file that is wrong is not.
        return transport("credentials", err.is_transient_and_before_rpc());
    }
    if let Some(status) = err.status() {
        let http = err.http_status_code();
        let reason = status.details.iter().find_map(|d| match d {
            StatusDetails::ErrorInfo(info) if !info.reason.is_empty() => Some(info.reason.as_str()),
            _ => None,
        });
        let reason = reason.map(str::to_owned).or_else(|| rate_limited_by_message(http, &status.message));
        let code = match (&reason, status.code) {
            (Some(r), _) => r.clone(),
            (None, Code::Unknown) => http.map_or_else(|| "Unknown".to_owned(), |h| format!("HTTP {h}")),
            (None, c) => c.name().to_owned(),
        };
        let retryable = is_retryable(http, status.code, reason.as_deref());
        return CloudError { operation, code, message: status.message.clone(), retryable };
    }
    if let Some(http) = err.http_status_code() {
        // An answer that is not Google's JSON error (a proxy's page).
        return transport(&format!("HTTP {http}"), is_retryable(Some(http), Code::Unknown, None));
    }
    if err.is_io() || err.is_transport() {
        return transport("transport", true);
    }
    if err.is_deserialization() {
        return transport("response", false);
    }
    if err.is_serialization() || err.is_binding() {
        return transport("request", false);
    }
    if err.is_exhausted() {
        return transport("exhausted", true);
    }
    transport("unknown", true)
}

/// `rateLimitExceeded` when a 403's message says so: older clients drop
/// the `errors[].reason` a 403 carries, and a rate limit and a permission
/// denial share the status.
fn rate_limited_by_message(http: Option<u16>, message: &str) -> Option<String> {
    if http != Some(403) {
        return None;
    }
    let m = message.to_ascii_lowercase();
    let rate = m.contains("rate limit")
        || m.contains("ratelimitexceeded")
        || (m.contains("quota exceeded for quota metric") && m.contains("per minute"));
    rate.then(|| "rateLimitExceeded".to_owned())
}

/// Whether a request's error may succeed when repeated: throttling (429,
/// `rateLimitExceeded`), Google's side (5xx), a stale precondition (412
/// `conditionNotMet`); not other 4xx.
pub fn is_retryable(http: Option<u16>, code: Code, reason: Option<&str>) -> bool {
    http.is_some_and(|s| s >= 500 || s == 429 || s == 412)
        || matches!(
            code,
            Code::Unavailable | Code::ResourceExhausted | Code::Internal | Code::DeadlineExceeded | Code::Aborted
        )
        || reason.is_some_and(|r| RETRYABLE_REASONS.contains(&r))
}

/// The error of an operation that ended `DONE` with one.
fn operation_error(operation: &'static str, op: &Operation) -> Option<CloudError> {
    let first = op.error.as_ref().and_then(|e| e.errors.first());
    if first.is_none() && op.http_error_status_code.is_none() {
        return None;
    }
    let http = op.http_error_status_code.and_then(|s| u16::try_from(s).ok());
    if first.is_none() && http.is_some_and(|s| s < 400) {
        return None;
    }
    let code = first
        .and_then(|e| e.code.clone())
        .unwrap_or_else(|| http.map_or_else(|| "OperationFailed".into(), |h| format!("HTTP {h}")));
    let message = first.and_then(|e| e.message.clone()).or_else(|| op.http_error_message.clone()).unwrap_or_default();
    let retryable =
        http.is_some_and(|s| s >= 500 || s == 429 || s == 412) || RETRYABLE_OPERATION_CODES.contains(&code.as_str());
    let name = op.name.as_deref().unwrap_or("?");
    Some(CloudError { operation, code, message: format!("operation {name}: {message}"), retryable })
}

fn held_elsewhere(ip: Ipv4Addr, why: &str) -> CloudError {
    CloudError {
        operation: "forwardingRules.setTarget",
        code: HELD_ELSEWHERE.into(),
        message: format!("{ip}: {why}; not taking it: free the address or make that instance a gateway Node"),
        retryable: false,
    }
}

fn invalid(operation: &'static str, message: &str) -> CloudError {
    CloudError { operation, code: "NotFound".into(), message: message.to_owned(), retryable: false }
}

/// [`GcpCloud::load`] made by the first call that succeeds in making it: a
/// credential chain that fails (a metadata server not answering yet, a key
/// file not mounted yet) is tried again by the next call, and its error is
/// each call's answer meanwhile. What [`super::providers`] hands out.
#[derive(Debug, Default)]
pub struct LazyGcp(tokio::sync::OnceCell<GcpCloud>);

impl LazyGcp {
    async fn get(&self) -> Result<&GcpCloud, CloudError> {
        self.0.get_or_try_init(GcpCloud::load).await
    }
}

impl Cloud for LazyGcp {
    fn name(&self) -> &'static str {
        "gcp"
    }

    fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
        Box::pin(async move { self.get().await?.discover(pool).await })
    }

    fn interface<'a>(
        &'a self,
        provider_id: &'a str,
        subnet_id: &'a str,
    ) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(async move { self.get().await?.interface(provider_id, subnet_id).await })
    }

    fn primary_interface<'a>(&'a self, provider_id: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(async move { self.get().await?.primary_interface(provider_id).await })
    }

    fn add_address<'a>(&'a self, interface_id: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>> {
        Box::pin(async move { self.get().await?.add_address(interface_id).await })
    }

    fn assign<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
        gateways: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(async move { self.get().await?.assign(interface_id, private, public, gateways).await })
    }

    fn verify<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>> {
        Box::pin(async move { self.get().await?.verify(interface_id, private, public).await })
    }

    fn release<'a>(&'a self, interface_id: &'a str, private: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(async move { self.get().await?.release(interface_id, private).await })
    }
}

fn setup(message: String) -> CloudError {
    CloudError { operation: "client", code: "Setup".into(), message, retryable: false }
}

fn bad_target(target: &str) -> CloudError {
    CloudError {
        operation: "targetInstances",
        code: "InvalidTargetInstance".into(),
        message: format!(
            "{target:?} is not the link of a target instance in a zone (projects/P/zones/Z/targetInstances/N)"
        ),
        retryable: false,
    }
}

/// [`Cloud::add_address`] on GCP: a worker Node's address is the pool's
/// external address itself, forwarded to the Node's target instance
/// (protocol forwarding; [`super::Provider::pairs_privately`] is false, so
/// the caller never asks). Not retryable.
fn no_private_address(target: &str) -> CloudError {
    CloudError {
        operation: "add_address",
        code: "NotApplicable".into(),
        message: format!(
            "on GCP a Node's egress address is the pool's external address itself, forwarded to its target instance {} (protocol forwarding): there is no private address to add",
            path_of(target)
        ),
        retryable: false,
    }
}

fn parse_ip(operation: &'static str, s: &str) -> Result<IpAddr, CloudError> {
    s.parse().map_err(|_| CloudError {
        operation,
        code: "InvalidResponse".into(),
        message: format!("unparsable address {s:?}"),
        retryable: false,
    })
}

/// External IPv6 addresses are ranges (a /96 per forwarding rule), which
/// this provider does not forward yet; refuse them by name.
fn ipv4_only(operation: &'static str, ip: IpAddr) -> Result<Ipv4Addr, CloudError> {
    match ip {
        IpAddr::V4(v4) => Ok(v4),
        IpAddr::V6(_) => Err(CloudError {
            operation,
            code: "Unsupported".into(),
            message: format!("{ip}: IPv6 egress addresses are not supported by the GCP provider yet"),
            retryable: false,
        }),
    }
}

/// rustls (which the client's HTTP stack uses with no provider of its own:
/// its default one is aws-lc) gets ring as the process's provider, unless
/// one is installed already.
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // A race with another installer is harmless: one of them wins.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

// -------------------------------------------------------------- names ---

/// A link's path under `compute/v1/` (`projects/...`): links are written
/// with either host, or as a bare path.
fn path_of(link: &str) -> &str {
    LINK_PREFIXES.iter().find_map(|p| link.strip_prefix(p)).unwrap_or_else(|| link.strip_prefix('/').unwrap_or(link))
}

fn scoped_link(project: &str, scope_kind: &str, scope: &str, collection: &str, name: &str) -> String {
    format!("{LINK_PREFIX}projects/{project}/{scope_kind}/{scope}/{collection}/{name}")
}

/// `projects/P/<regions|zones>/S/<collection>/N`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Scoped {
    project: String,
    scope: String,
    name: String,
}

impl Scoped {
    fn parse(link: &str, scope_kind: &str, collection: &str) -> Option<Self> {
        let mut parts = path_of(link).split('/');
        let (Some("projects"), Some(project), Some(kind), Some(scope), Some(coll), Some(name), None) =
            (parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return None;
        };
        if kind != scope_kind || coll != collection || [project, scope, name].iter().any(|s| s.is_empty()) {
            return None;
        }
        Some(Self { project: project.into(), scope: scope.into(), name: name.into() })
    }
}

/// A pool's subnetwork (`projects/P/regions/R/subnetworks/S`, or its full
/// link).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Subnet {
    pub project: String,
    pub region: String,
    pub name: String,
}

impl Subnet {
    /// Parses a pool's `subnet_id`.
    pub fn parse(subnet_id: &str) -> Result<Self, CloudError> {
        let s = Scoped::parse(subnet_id, "regions", "subnetworks").ok_or_else(|| CloudError {
            operation: "subnetworks.get",
            code: "InvalidSubnet".into(),
            message: format!(
                "subnet {subnet_id:?} is not projects/<project>/regions/<region>/subnetworks/<name> (or its https://www.googleapis.com/compute/v1/ link)"
            ),
            retryable: false,
        })?;
        Ok(Self { project: s.project, region: s.scope, name: s.name })
    }

    fn path(&self) -> String {
        format!("projects/{}/regions/{}/subnetworks/{}", self.project, self.region, self.name)
    }
}

/// A target instance named by its link (the trait's `interface_id`).
struct TargetRef {
    project: String,
    zone: String,
    name: String,
}

impl TargetRef {
    fn parse(link: &str) -> Result<Self, CloudError> {
        let s = Scoped::parse(link, "zones", "targetInstances").ok_or_else(|| bad_target(link))?;
        Ok(Self { project: s.project, zone: s.scope, name: s.name })
    }
}

/// A target instance this provider makes for an instance's interface, and
/// where the rules that may target it are.
struct Receiver<'a> {
    name: String,
    description: &'static str,
    project: &'a str,
    region: &'a str,
}

/// An instance named by a Node's `spec.providerID`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceRef {
    pub project: String,
    pub zone: String,
    pub name: String,
}

impl InstanceRef {
    /// `projects/P/zones/Z/instances/N`.
    pub fn path(&self) -> String {
        format!("projects/{}/zones/{}/instances/{}", self.project, self.zone, self.name)
    }

    fn link(&self) -> String {
        format!("{LINK_PREFIX}{}", self.path())
    }
}

/// The instance in a Node's `spec.providerID`: `gce://<project>/<zone>/<name>`,
/// what the GCP cloud provider writes (`gce://%s/%s/%s` with the project,
/// zone and instance name: `gce_util.go` in kubernetes' legacy-cloud-providers
/// `gce`, now kubernetes/cloud-provider-gcp `providers/gce`).
pub fn parse_provider_id(provider_id: &str) -> Result<InstanceRef, CloudError> {
    let bad = |why: &str| CloudError {
        operation: "providerID",
        code: "InvalidProviderID".into(),
        message: format!("Node spec.providerID {provider_id:?}: {why} (want gce://<project>/<zone>/<instance name>)"),
        retryable: false,
    };
    let rest = provider_id.strip_prefix("gce://").ok_or_else(|| bad("not a GCE provider ID"))?;
    let mut parts = rest.split('/');
    let (Some(project), Some(zone), Some(name), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(bad("not <project>/<zone>/<name>"));
    };
    // Project IDs: lowercase letters, digits and hyphens, starting with a
    // letter; domain-scoped projects add `domain:` (dots and a colon).
    if project.is_empty()
        || !project.starts_with(|c: char| c.is_ascii_lowercase())
        || !project.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '.' | ':'))
    {
        return Err(bad("bad project ID"));
    }
    if !is_name(zone) || region_of(zone).is_none() {
        return Err(bad("bad zone"));
    }
    if !is_name(name) {
        return Err(bad("bad instance name"));
    }
    Ok(InstanceRef { project: project.into(), zone: zone.into(), name: name.into() })
}

/// A GCP resource name: `[a-z]([-a-z0-9]{0,61}[a-z0-9])?`.
fn is_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME
        && b[0].is_ascii_lowercase()
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[b.len() - 1] != b'-'
}

/// A zone's region: zones are `<region>-<letter>` (`us-central1-a`).
fn region_of(zone: &str) -> Option<&str> {
    let (region, suffix) = zone.rsplit_once('-')?;
    (region.contains('-') && !suffix.is_empty()).then_some(region)
}

/// The forwarding rule of an address: `egret-203-0-113-10`.
pub fn rule_name(ip: Ipv4Addr) -> String {
    let [a, b, c, d] = ip.octets();
    format!("{NAME_PREFIX}{a}-{b}-{c}-{d}")
}

fn rule_path(project: &str, region: &str, ip: Ipv4Addr) -> String {
    format!("projects/{project}/regions/{region}/forwardingRules/{}", rule_name(ip))
}

/// The address a rule carries (Compute answers `IPAddress` as the number).
fn rule_ip(rule: &model::ForwardingRule) -> Option<Ipv4Addr> {
    rule.ip_address.as_deref()?.parse().ok()
}

/// The target instance of an instance's interface: `egret-<instance>` for
/// nic0, `egret-<instance>-<nic>` for another; a name longer than 63
/// characters keeps a prefix and ends with 8 hex digits of a SHA-256 of the
/// whole, so that it stays unique and valid.
pub fn target_instance_name(instance: &str, nic: &str) -> String {
    let full =
        if nic == "nic0" { format!("{NAME_PREFIX}{instance}") } else { format!("{NAME_PREFIX}{instance}-{nic}") };
    fit_name(full)
}

/// A worker Node's target instance (ADR 0033): `egret-node-<instance>`, on
/// the instance's `nic0`, shortened as [`target_instance_name`] does. A
/// gateway named `node-<x>` would want the same name as a worker named
/// `<x>` in its zone; the second to come is refused
/// (`TargetInstanceConflict`, naming both) rather than sharing it.
pub fn node_target_instance_name(instance: &str) -> String {
    fit_name(format!("{NAME_PREFIX}node-{instance}"))
}

/// Whether the target instance `name`, forwarding to `instance` (a path),
/// is a worker Node's ([`node_target_instance_name`] of that instance).
fn is_node_target(name: &str, instance: &str) -> bool {
    Scoped::parse(instance, "zones", "instances").is_some_and(|i| name == node_target_instance_name(&i.name))
}

/// `full` if it is a valid name's length, else a prefix of it and 8 hex
/// digits of its SHA-256.
fn fit_name(full: String) -> String {
    if full.len() <= MAX_NAME {
        return full;
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, full.as_bytes());
    let hash: String = digest.as_ref()[..4].iter().map(|b| format!("{b:02x}")).collect();
    let keep = MAX_NAME - hash.len() - 1;
    let prefix = full[..keep].trim_end_matches('-');
    format!("{prefix}-{hash}")
}

/// The `addresses.list` filter for a pool's labels: one parenthesized
/// comparison per label (juxtaposed comparisons are ANDed), values quoted.
/// Keys and values follow GCP's label rules (at most 63 characters of
/// lowercase letters, digits, `_` and `-`; a key starts with a letter), so
/// nothing in them needs escaping.
pub fn label_filter(tags: &std::collections::BTreeMap<String, String>) -> Result<String, CloudError> {
    let bad = |why: String| CloudError {
        operation: "addresses.list",
        code: "InvalidLabels".into(),
        message: why,
        retryable: false,
    };
    if tags.is_empty() {
        // No filter would select every address of the region.
        return Err(bad("a cloud pool needs at least one label to select its addresses".into()));
    }
    let allowed = |c: char| c.is_lowercase() || c.is_ascii_digit() || c == '_' || c == '-';
    let mut parts = Vec::new();
    for (k, v) in tags {
        if k.is_empty() || k.chars().count() > MAX_NAME || !k.starts_with(char::is_lowercase) || !k.chars().all(allowed)
        {
            return Err(bad(format!(
                "label key {k:?}: GCP label keys are 1 to 63 lowercase letters, digits, '_' or '-', starting with a letter"
            )));
        }
        if v.chars().count() > MAX_NAME || !v.chars().all(allowed) {
            return Err(bad(format!(
                "label {k}={v:?}: GCP label values are up to 63 lowercase letters, digits, '_' or '-'"
            )));
        }
        parts.push(format!("(labels.{k} = {})", quote(v)));
    }
    Ok(parts.join(" "))
}

/// A filter value in double quotes.
fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The addresses GCP keeps in a subnetwork's primary IPv4 range: the
/// network address, the default gateway (+1), the second-to-last and the
/// broadcast address.
fn reserved(cidr: IpNet) -> BTreeSet<IpAddr> {
    let IpNet::V4(net) = cidr else { return BTreeSet::new() };
    let first = u32::from(net.network());
    let last = u32::from(net.broadcast());
    [Some(first), first.checked_add(1), last.checked_sub(1), Some(last)]
        .into_iter()
        .flatten()
        .map(|a| IpAddr::V4(Ipv4Addr::from(a)))
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::BTreeMap;

    use super::*;
    use google_cloud_gax::error::rpc::Status;

    #[test]
    fn provider_id_forms() {
        let i = parse_provider_id("gce://egret-lab/us-central1-a/gw-a").unwrap();
        assert_eq!(i, InstanceRef { project: "egret-lab".into(), zone: "us-central1-a".into(), name: "gw-a".into() });
        assert_eq!(i.path(), "projects/egret-lab/zones/us-central1-a/instances/gw-a");
        assert_eq!(parse_provider_id("gce://example.com:lab/europe-west4-b/n1").unwrap().project, "example.com:lab");
        for bad in [
            "",
            "aws:///us-east-1a/i-0abc",
            "gce:///us-central1-a/gw-a",
            "gce://egret-lab/us-central1-a",
            "gce://egret-lab/us-central1-a/gw-a/extra",
            "gce://egret-lab//gw-a",
            "gce://egret-lab/us-central1-a/",
            "gce://Egret-Lab/us-central1-a/gw-a",
            "gce://egret-lab/uscentral1/gw-a",
            "gce://egret-lab/us-central1-a/GW_A",
            "gce://egret-lab/us-central1-a/gw-a-",
            "gw-a",
        ] {
            let e = parse_provider_id(bad).unwrap_err();
            assert!(!e.retryable, "{bad}");
            assert_eq!(e.code, "InvalidProviderID");
            assert!(e.message.contains(&format!("{bad:?}")), "the error names the value: {e}");
        }
    }

    #[test]
    fn subnet_paths_and_links() {
        let want = Subnet { project: "p".into(), region: "us-central1".into(), name: "gateways".into() };
        assert_eq!(Subnet::parse("projects/p/regions/us-central1/subnetworks/gateways").unwrap(), want);
        assert_eq!(
            Subnet::parse("https://www.googleapis.com/compute/v1/projects/p/regions/us-central1/subnetworks/gateways")
                .unwrap(),
            want
        );
        assert_eq!(
            Subnet::parse(
                "https://compute.googleapis.com/compute/v1/projects/p/regions/us-central1/subnetworks/gateways"
            )
            .unwrap(),
            want
        );
        for bad in [
            "subnet-0abc",
            "projects/p/zones/us-central1-a/subnetworks/gateways",
            "projects/p/regions/us-central1/networks/gateways",
            "projects/p/regions/us-central1/subnetworks/",
            "projects/p/regions/us-central1/subnetworks/gateways/x",
            "https://example.com/compute/v1/projects/p/regions/us-central1/subnetworks/gateways",
        ] {
            let e = Subnet::parse(bad).unwrap_err();
            assert_eq!((e.code.as_str(), e.retryable), ("InvalidSubnet", false), "{bad}");
        }
    }

    #[test]
    fn names_follow_gcps_rules() {
        assert_eq!(rule_name("203.0.113.10".parse().unwrap()), "egret-203-0-113-10");
        assert_eq!(target_instance_name("gw-a", "nic0"), "egret-gw-a");
        assert_eq!(target_instance_name("gw-a", "nic1"), "egret-gw-a-nic1");
        let long = "a".repeat(63);
        let n = target_instance_name(&long, "nic0");
        assert_eq!(n.len(), 63, "{n}");
        assert!(is_name(&n), "{n}");
        assert_ne!(n, target_instance_name(&long, "nic1"), "the hash keeps interfaces apart");
        let other = format!("{}b", "a".repeat(62));
        assert_ne!(n, target_instance_name(&other, "nic0"), "and instances");
        // A cut that would end on a hyphen does not leave two in a row.
        let hyphens = format!("{}-{}", "a".repeat(47), "b".repeat(15));
        let n = target_instance_name(&hyphens, "nic0");
        assert!(is_name(&n) && !n.contains("--"), "{n}");
        assert_eq!(region_of("us-central1-a"), Some("us-central1"));
        assert_eq!(region_of("europe-west4-b"), Some("europe-west4"));
        assert_eq!(region_of("uscentral1"), None);
    }

    #[test]
    fn worker_nodes_have_target_instances_of_their_own() {
        assert_eq!(node_target_instance_name("worker-1"), "egret-node-worker-1");
        let long = node_target_instance_name(&"w".repeat(63));
        assert!(long.len() == 63 && is_name(&long), "{long}");
        let zone = "projects/p/zones/us-central1-a/instances";
        assert!(is_node_target("egret-node-worker-1", &format!("{zone}/worker-1")));
        assert!(is_node_target("egret-node-worker-1", &format!("{LINK_PREFIX}{zone}/worker-1")));
        // A gateway's target instance; a gateway named node-worker-1's; another instance's.
        assert!(!is_node_target("egret-worker-1", &format!("{zone}/worker-1")));
        assert!(!is_node_target("egret-node-worker-1", &format!("{zone}/node-worker-1")));
        assert!(!is_node_target("egret-node-worker-1", &format!("{zone}/worker-2")));
        assert!(!is_node_target("egret-node-worker-1", "projects/p/regions/us-central1/instances/worker-1"));
    }

    #[test]
    fn label_filters_are_anded_and_quoted() {
        let tags: BTreeMap<String, String> = [("egret-pool", "prod"), ("team", ""), ("tier_1", "a-b")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            label_filter(&tags).unwrap(),
            r#"(labels.egret-pool = "prod") (labels.team = "") (labels.tier_1 = "a-b")"#
        );
        assert!(!label_filter(&BTreeMap::new()).unwrap_err().retryable);
        for (k, v) in
            [("Pool", "x"), ("1pool", "x"), ("pool", "Prod"), ("po ol", "x"), ("pool", "a\"b"), ("pool", "a b")]
        {
            let tags = BTreeMap::from([(k.to_string(), v.to_string())]);
            let e = label_filter(&tags).unwrap_err();
            assert_eq!((e.code.as_str(), e.retryable), ("InvalidLabels", false), "{k}={v}");
        }
        assert_eq!(quote(r#"a"b\c"#), r#""a\"b\\c""#);
    }

    #[test]
    fn reserved_addresses_of_a_subnetwork() {
        let r = reserved("198.18.1.0/24".parse().unwrap());
        let want: BTreeSet<IpAddr> =
            ["198.18.1.0", "198.18.1.1", "198.18.1.254", "198.18.1.255"].iter().map(|s| s.parse().unwrap()).collect();
        assert_eq!(r, want);
    }

    fn service(http: u16, code: Code, reason: Option<&str>, message: &str) -> google_cloud_gax::error::Error {
        let mut status = Status::default().set_code(code).set_message(message);
        if let Some(reason) = reason {
            let mut info = google_cloud_gax::error::rpc::StatusDetails::ErrorInfo(Default::default());
            if let StatusDetails::ErrorInfo(i) = &mut info {
                i.reason = reason.into();
            }
            status = status.set_details([info]);
        }
        google_cloud_gax::error::Error::service_with_http_metadata(status, Some(http), None)
    }

    #[test]
    fn throttling_and_server_errors_are_retryable() {
        for (http, code, reason, message, want_code) in [
            (403, Code::Unknown, Some("rateLimitExceeded"), "Rate Limit Exceeded", "rateLimitExceeded"),
            // The reason lost: the message tells a rate limit from a denial.
            (403, Code::PermissionDenied, None, "Rate Limit Exceeded", "rateLimitExceeded"),
            (
                403,
                Code::Unknown,
                None,
                "Quota exceeded for quota metric 'Read requests' and limit 'Read requests per minute' of service 'compute.googleapis.com'",
                "rateLimitExceeded",
            ),
            (429, Code::ResourceExhausted, None, "slow down", "RESOURCE_EXHAUSTED"),
            (500, Code::Unknown, Some("backendError"), "oops", "backendError"),
            (503, Code::Unavailable, None, "down", "UNAVAILABLE"),
            (502, Code::Unknown, None, "bad gateway", "HTTP 502"),
            (412, Code::FailedPrecondition, Some("conditionNotMet"), "fingerprint", "conditionNotMet"),
        ] {
            let e = classify("forwardingRules.setTarget", &service(http, code, reason, message));
            assert!(e.retryable, "{http} {reason:?} {message}");
            assert_eq!(e.code, want_code, "{http} {message}");
            assert_eq!(e.operation, "forwardingRules.setTarget");
            assert_eq!(e.message, message);
        }
    }

    #[test]
    fn denials_and_bad_requests_are_not_retryable() {
        for (http, code, reason, message) in [
            (403, Code::PermissionDenied, Some("forbidden"), "Required 'compute.forwardingRules.setTarget' permission"),
            (403, Code::PermissionDenied, None, "Required 'compute.addresses.get' permission"),
            (
                403,
                Code::Unknown,
                Some("quotaExceeded"),
                "Quota 'FORWARDING_RULES' exceeded. Limit: 15.0 in region us-central1.",
            ),
            (401, Code::Unauthenticated, None, "Request is missing required authentication credential"),
            (400, Code::InvalidArgument, Some("invalid"), "Invalid value for field 'resource.target'"),
            (404, Code::NotFound, Some("notFound"), "The resource 'projects/p' was not found"),
            (409, Code::AlreadyExists, Some("alreadyExists"), "already exists"),
        ] {
            let e = classify("addresses.get", &service(http, code, reason, message));
            assert!(!e.retryable, "{http} {reason:?} {message}: {e:?}");
        }
    }

    #[test]
    fn transport_failures_are_retryable() {
        let e = classify("instances.get", &google_cloud_gax::error::Error::timeout("deadline"));
        assert_eq!((e.code.as_str(), e.retryable), ("timeout", true));
        let e = classify("instances.get", &google_cloud_gax::error::Error::connect("refused"));
        assert_eq!((e.code.as_str(), e.retryable), ("connect", true));
        let e = classify("instances.get", &google_cloud_gax::error::Error::io("reset"));
        assert_eq!((e.code.as_str(), e.retryable), ("transport", true));
        let e = classify("instances.get", &google_cloud_gax::error::Error::deser("not JSON"));
        assert_eq!((e.code.as_str(), e.retryable), ("response", false));
    }

    fn failed_operation(code: &str, http: i32) -> Operation {
        let err = model::operation::Error::new().set_errors([model::operation::error::Errors::new()
            .set_code(code)
            .set_message(format!("{code} happened"))]);
        Operation::new()
            .set_name("operation-1")
            .set_status(model::operation::Status::Done)
            .set_error(err)
            .set_http_error_status_code(http)
            .set_http_error_message("BAD REQUEST")
    }

    #[test]
    fn operations_that_end_with_an_error_are_classified() {
        assert!(operation_error("forwardingRules.setTarget", &Operation::new().set_name("ok")).is_none());
        let e =
            operation_error("forwardingRules.insert", &failed_operation("IP_IN_USE_BY_ANOTHER_RESOURCE", 400)).unwrap();
        assert_eq!(
            (e.operation, e.code.as_str(), e.retryable),
            ("forwardingRules.insert", "IP_IN_USE_BY_ANOTHER_RESOURCE", false)
        );
        assert!(
            e.message.contains("operation-1") && e.message.contains("IP_IN_USE_BY_ANOTHER_RESOURCE happened"),
            "{e}"
        );
        for (code, http) in [
            ("RATE_LIMIT_EXCEEDED", 403),
            ("CONDITION_NOT_MET", 412),
            ("INTERNAL_ERROR", 500),
            ("RESOURCE_NOT_FOUND", 404),
        ] {
            let e = operation_error("forwardingRules.setTarget", &failed_operation(code, http)).unwrap();
            assert!(e.retryable, "{code}");
        }
    }

    #[tokio::test]
    async fn ipv6_and_foreign_links_are_refused_before_any_call() {
        // Nothing listens on port 9: a call would fail with `connect`.
        let cloud = GcpCloud::new(
            Some("http://127.0.0.1:9".into()),
            google_cloud_auth::credentials::anonymous::Builder::new().build(),
        )
        .await
        .unwrap();
        let ti = "https://www.googleapis.com/compute/v1/projects/p/zones/us-central1-a/targetInstances/egret-gw-a";
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        for e in [
            cloud.assign(ti, v6, None, &BTreeSet::new()).await.unwrap_err(),
            cloud.release(ti, v6).await.unwrap_err(),
            cloud.verify(ti, v6, None).await.unwrap_err(),
        ] {
            assert_eq!((e.code.as_str(), e.retryable), ("Unsupported", false), "{e}");
            assert!(e.message.contains("2001:db8::1"), "{e}");
        }
        let v4: IpAddr = "203.0.113.10".parse().unwrap();
        let e = cloud.assign("eni-0abc", v4, None, &BTreeSet::new()).await.unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), ("InvalidTargetInstance", false), "{e}");
        let e = cloud
            .interface("aws:///us-east-1a/i-0abc", "projects/p/regions/us-central1/subnetworks/s")
            .await
            .unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), ("InvalidProviderID", false), "{e}");
        // A public address that is not the egress address (GCP pairs each
        // address with itself).
        let public = PublicAddress {
            public_ip: "203.0.113.11".parse().unwrap(),
            allocation_id: "projects/p/regions/us-central1/addresses/a".into(),
            private_ip: None,
            interface_id: None,
        };
        let e = cloud.assign(ti, v4, Some(&public), &BTreeSet::new()).await.unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), ("InvalidPairing", false), "{e}");
        // A Node's address is the external address itself: nothing to add.
        let e = cloud.add_address(ti).await.unwrap_err();
        assert_eq!((e.operation, e.code.as_str(), e.retryable), ("add_address", "NotApplicable", false), "{e}");
        assert!(e.message.contains("projects/p/zones/us-central1-a/targetInstances/egret-gw-a"), "{e}");
        // And the first real call fails retryably: nothing listens.
        let e = cloud.verify(ti, v4, None).await.unwrap_err();
        assert_eq!((e.operation, e.code.as_str(), e.retryable), ("forwardingRules.get", "connect", true), "{e}");
    }
}
