//! The AWS provider: Elastic IPs found by tag, moved between gateways' ENIs.
//!
//! Every call is one attempt through the official SDK (`aws-sdk-ec2`) with
//! the SDK's own retries disabled and each operation bounded by
//! [`OPERATION_TIMEOUT`]: the caller (the cloud task) owns the retries, with
//! backoff, so a dead endpoint gives a retryable [`CloudError`] within a few
//! seconds instead of a hang. The EC2 calls, and why each:
//!
//! | trait call | EC2 actions |
//! |---|---|
//! | [`Cloud::discover`] | DescribeAddresses (`tag:K`=V filters ANDed, `domain`=`vpc`), DescribeSubnets (the CIDR), DescribeNetworkInterfaces (`subnet-id`: every private address in use) |
//! | [`Cloud::interface`] | DescribeInstances (the instance named by the Node's `spec.providerID`), DescribeNetworkInterfaces (its ENI in the subnet) |
//! | [`Cloud::primary_interface`] | DescribeInstances (the ENI at device index 0), DescribeNetworkInterfaces |
//! | [`Cloud::add_address`] | DescribeNetworkInterfaces (its addresses now), AssignPrivateIpAddresses (`SecondaryPrivateIpAddressCount`=1: EC2 chooses) |
//! | [`Cloud::assign`] | DescribeNetworkInterfaces (the interface, then its subnet's: who holds the address; an interface that is not a gateway's is a refusal), then always AssignPrivateIpAddresses (`AllowReassignment`) and AssociateAddress (`PrivateIpAddress`, `AllowReassociation`) |
//! | [`Cloud::verify`] | DescribeNetworkInterfaces (the interface has it), DescribeAddresses (the Elastic IP's association names the interface and the private address) |
//! | [`Cloud::release`] | DescribeNetworkInterfaces (is it still there?), UnassignPrivateIpAddresses (IPv6: UnassignIpv6Addresses) |
//!
//! An IPv6 pool ([`PoolSelector::ipv6`]) has no Elastic IPs: discovery reads
//! the subnet's IPv6 range and the IPv6 addresses its ENIs hold, and an
//! assignment unassigns the address from the other gateways' ENIs that hold
//! it (UnassignIpv6Addresses: IPv6 has no reassignment flag), then always
//! calls AssignIpv6Addresses.
//!
//! Both mutating calls are asynchronous on AWS: they return before the VPC
//! delivers to the new holder (API reference, AssignPrivateIpAddresses:
//! "Remapping an IP address is an asynchronous operation"; docs/kubernetes.md
//! "Running on AWS").
//!
//! The least-privilege IAM policy that allows exactly these actions is in
//! docs/kubernetes.md; a new call here must be added there.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

use aws_sdk_ec2::config::retry::RetryConfig;
use aws_sdk_ec2::config::timeout::TimeoutConfig;
use aws_sdk_ec2::config::{BehaviorVersion, Region, SharedHttpClient};
use aws_sdk_ec2::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_ec2::types::{Filter, InstanceNetworkInterface, NetworkInterface};
use futures::future::BoxFuture;
use ipnet::IpNet;

use super::{Cloud, CloudError, Discovered, Interface, PoolSelector, PublicAddress, HELD_ELSEWHERE};

/// The bound on one EC2 operation, connection and response included.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(5);

/// The bound on opening the connection (a part of [`OPERATION_TIMEOUT`]).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// EC2 error codes that mean "slow down" or "our side failed, try again":
/// EC2's throttling code (`RequestLimitExceeded`) and the throttling family
/// the AWS SDKs retry, and EC2's server-error codes (`InternalError`,
/// `Unavailable`, ...). Any 5xx or 429 is retryable too ([`is_retryable`]).
const RETRYABLE_CODES: &[&str] = &[
    "RequestLimitExceeded",
    "Throttling",
    "ThrottlingException",
    "RequestThrottled",
    "InternalError",
    "InternalFailure",
    "ServiceUnavailable",
    "Unavailable",
];

/// The AWS implementation of [`Cloud`].
#[derive(Clone, Debug)]
pub struct AwsCloud {
    client: aws_sdk_ec2::Client,
}

impl AwsCloud {
    /// A provider configured from the standard chain: credentials (env, web
    /// identity/IRSA, profile, ECS/IMDS), region (`AWS_REGION`, profile,
    /// IMDS) and endpoint (`AWS_ENDPOINT_URL_EC2`, `AWS_ENDPOINT_URL`), each
    /// overridden by `region` and `endpoint` when given.
    pub async fn load(region: Option<String>, endpoint: Option<String>) -> Self {
        let mut loader = aws_config::defaults(BehaviorVersion::latest())
            .http_client(https_client())
            .retry_config(RetryConfig::disabled())
            .timeout_config(timeouts());
        if let Some(region) = region {
            loader = loader.region(Region::new(region));
        }
        if let Some(endpoint) = endpoint {
            loader = loader.endpoint_url(endpoint);
        }
        let sdk = loader.load().await;
        Self::from_conf(aws_sdk_ec2::config::Builder::from(&sdk).build())
    }

    /// A provider from an explicit client configuration (tests: a static
    /// credential and a moto endpoint). Retries are disabled and the
    /// timeouts bounded whatever `conf` says; an HTTPS client (rustls with
    /// ring) is supplied when `conf` has none.
    pub fn from_conf(conf: aws_sdk_ec2::Config) -> Self {
        let mut builder = conf.to_builder().retry_config(RetryConfig::disabled()).timeout_config(timeouts());
        if conf.http_client().is_none() {
            builder = builder.http_client(https_client());
        }
        Self { client: aws_sdk_ec2::Client::from_conf(builder.build()) }
    }

    /// The SDK client (for callers that need a call the trait does not
    /// have, such as the tests' checks).
    pub fn client(&self) -> &aws_sdk_ec2::Client {
        &self.client
    }

    async fn discover_impl(&self, pool: &PoolSelector) -> Result<Discovered, CloudError> {
        if pool.ipv6 {
            return self.discover_ipv6(pool).await;
        }
        if pool.tags.is_empty() {
            // No filter would select every Elastic IP in the account.
            return Err(invalid("DescribeAddresses", "a cloud pool needs at least one tag to select its Elastic IPs"));
        }
        let mut req = self.client.describe_addresses().filters(filter("domain", "vpc"));
        for (key, value) in &pool.tags {
            req = req.filters(filter(&format!("tag:{key}"), value));
        }
        let out = req.send().await.map_err(|e| classify("DescribeAddresses", e))?;
        let mut public = Vec::new();
        for a in out.addresses() {
            let Some(ip) = a.public_ip() else { continue };
            let Some(allocation_id) = a.allocation_id() else { continue };
            // An unassociated address has no association fields (moto sends
            // them empty).
            public.push(PublicAddress {
                public_ip: parse_ip("DescribeAddresses", ip)?,
                allocation_id: allocation_id.to_owned(),
                private_ip: present(a.private_ip_address()).map(|p| parse_ip("DescribeAddresses", p)).transpose()?,
                interface_id: present(a.network_interface_id()).map(str::to_owned),
            });
        }
        public.sort_by_key(|p| p.public_ip);

        let subnets = self
            .client
            .describe_subnets()
            .subnet_ids(&pool.subnet_id)
            .send()
            .await
            .map_err(|e| classify("DescribeSubnets", e))?;
        let Some(cidr) = subnets.subnets().iter().find_map(|s| s.cidr_block()) else {
            return Err(invalid(
                "DescribeSubnets",
                &format!("subnet {} not found or has no IPv4 CIDR", pool.subnet_id),
            ));
        };
        let subnet_cidr: IpNet = cidr
            .parse()
            .map_err(|_| invalid("DescribeSubnets", &format!("subnet {}: unparsable CIDR {cidr:?}", pool.subnet_id)))?;

        let mut used = reserved(subnet_cidr);
        for eni in self.subnet_interfaces(&pool.subnet_id).await? {
            used.extend(eni_addresses(&eni)?);
        }
        Ok(Discovered { public, subnet_cidr, used })
    }

    /// An IPv6 pool: no Elastic IPs; the subnet's IPv6 range and the IPv6
    /// addresses its ENIs use.
    async fn discover_ipv6(&self, pool: &PoolSelector) -> Result<Discovered, CloudError> {
        let subnets = self
            .client
            .describe_subnets()
            .subnet_ids(&pool.subnet_id)
            .send()
            .await
            .map_err(|e| classify("DescribeSubnets", e))?;
        let cidr = subnets
            .subnets()
            .iter()
            .flat_map(|s| s.ipv6_cidr_block_association_set())
            // Not one on its way out (moto renders the state unparsably,
            // so "not known to be gone" rather than "associated").
            .filter(|a| {
                let state = a.ipv6_cidr_block_state().and_then(|st| st.state()).map(|st| st.as_str());
                !matches!(state, Some("disassociating" | "disassociated" | "failing" | "failed"))
            })
            .find_map(|a| a.ipv6_cidr_block())
            .ok_or_else(|| {
                invalid(
                    "DescribeSubnets",
                    &format!("subnet {} not found or has no IPv6 CIDR block associated", pool.subnet_id),
                )
            })?;
        let subnet_cidr: IpNet = cidr.parse().map_err(|_| {
            invalid("DescribeSubnets", &format!("subnet {}: unparsable IPv6 CIDR {cidr:?}", pool.subnet_id))
        })?;
        let mut used = BTreeSet::new();
        for eni in self.subnet_interfaces(&pool.subnet_id).await? {
            used.extend(eni_addresses(&eni)?.into_iter().filter(IpAddr::is_ipv6));
        }
        Ok(Discovered { public: Vec::new(), subnet_cidr, used })
    }

    /// Every ENI in `subnet_id` (DescribeNetworkInterfaces pages through
    /// them; a subnet of a /24 has few).
    async fn subnet_interfaces(&self, subnet_id: &str) -> Result<Vec<NetworkInterface>, CloudError> {
        let mut all = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let out = self
                .client
                .describe_network_interfaces()
                .filters(filter("subnet-id", subnet_id))
                .set_next_token(token.take())
                .send()
                .await
                .map_err(|e| classify("DescribeNetworkInterfaces", e))?;
            all.extend(out.network_interfaces().iter().cloned());
            match out.next_token() {
                Some(t) if !t.is_empty() => token = Some(t.to_owned()),
                _ => return Ok(all),
            }
        }
    }

    /// One ENI by id; `None` when EC2 does not know it.
    async fn eni(&self, interface_id: &str) -> Result<Option<NetworkInterface>, CloudError> {
        let out = self.client.describe_network_interfaces().network_interface_ids(interface_id).send().await;
        match out {
            Ok(out) => Ok(out.network_interfaces().first().cloned()),
            Err(e) if e.code() == Some("InvalidNetworkInterfaceID.NotFound") => Ok(None),
            Err(e) => Err(classify("DescribeNetworkInterfaces", e)),
        }
    }

    async fn interface_impl(&self, provider_id: &str, subnet_id: &str) -> Result<Interface, CloudError> {
        let in_subnet = |n: &InstanceNetworkInterface| n.subnet_id() == Some(subnet_id);
        self.instance_interface(provider_id, in_subnet, &format!("in subnet {subnet_id}")).await
    }

    /// The interface of the instance `provider_id` names that `pick`
    /// accepts, the lowest device index first (`which` words the refusal).
    async fn instance_interface(
        &self,
        provider_id: &str,
        pick: impl Fn(&InstanceNetworkInterface) -> bool,
        which: &str,
    ) -> Result<Interface, CloudError> {
        let instance_id = parse_provider_id(provider_id)?;
        let out = self
            .client
            .describe_instances()
            .instance_ids(instance_id)
            .send()
            .await
            .map_err(|e| classify("DescribeInstances", e))?;
        let instance = out
            .reservations()
            .iter()
            .flat_map(|r| r.instances())
            .find(|i| i.instance_id() == Some(instance_id))
            .ok_or_else(|| invalid("DescribeInstances", &format!("instance {instance_id} not found")))?;
        let eni_id = instance
            .network_interfaces()
            .iter()
            .filter(|n| pick(n))
            // The lowest device index first: the primary ENI when it is in the subnet.
            .min_by_key(|n| n.attachment().and_then(|a| a.device_index()).unwrap_or(i32::MAX))
            .and_then(|n| n.network_interface_id())
            .ok_or_else(|| {
                invalid("DescribeInstances", &format!("instance {instance_id} has no network interface {which}"))
            })?;
        // The ENI itself: its own view of the addresses and the check.
        let eni = self.eni(eni_id).await?.ok_or_else(|| {
            invalid("DescribeNetworkInterfaces", &format!("interface {eni_id} of instance {instance_id} not found"))
        })?;
        let primary = eni.private_ip_address().ok_or_else(|| {
            invalid("DescribeNetworkInterfaces", &format!("interface {eni_id} has no primary address"))
        })?;
        let primary_ip = parse_ip("DescribeNetworkInterfaces", primary)?;
        let mut secondary_ips = eni_addresses(&eni)?;
        secondary_ips.remove(&primary_ip);
        Ok(Interface {
            instance_id: instance_id.to_owned(),
            interface_id: eni_id.to_owned(),
            primary_ip,
            secondary_ips,
            // EC2 enables the check on every new ENI; absent means default.
            source_dest_check: eni.source_dest_check().unwrap_or(true),
        })
    }

    /// The instance's primary interface (device index 0), any subnet.
    async fn primary_interface_impl(&self, provider_id: &str) -> Result<Interface, CloudError> {
        let primary = |n: &InstanceNetworkInterface| n.attachment().and_then(|a| a.device_index()).unwrap_or(0) == 0;
        self.instance_interface(provider_id, primary, "at device index 0").await
    }

    /// AssignPrivateIpAddresses with `SecondaryPrivateIpAddressCount=1`: EC2
    /// chooses a free address of the interface's subnet. The answer's
    /// `AssignedPrivateIpAddresses` is the new address on AWS; moto 5.2.5
    /// answers with every address of the interface, so the new one is the
    /// answer's address the interface did not have before the call.
    async fn add_address_impl(&self, interface_id: &str) -> Result<IpAddr, CloudError> {
        let before = match self.eni(interface_id).await? {
            Some(eni) => eni_addresses(&eni)?,
            None => return Err(invalid("DescribeNetworkInterfaces", &format!("interface {interface_id} not found"))),
        };
        let out = self
            .client
            .assign_private_ip_addresses()
            .network_interface_id(interface_id)
            .secondary_private_ip_address_count(1)
            .send()
            .await
            .map_err(|e| classify("AssignPrivateIpAddresses", e))?;
        let mut new = Vec::new();
        for a in out.assigned_private_ip_addresses() {
            let ip = parse_ip("AssignPrivateIpAddresses", a.private_ip_address().unwrap_or_default())?;
            if !before.contains(&ip) {
                new.push(ip);
            }
        }
        match new[..] {
            [ip] => Ok(ip),
            _ => Err(invalid(
                "AssignPrivateIpAddresses",
                &format!("expected one new address on {interface_id}, the answer has {new:?}"),
            )),
        }
    }

    async fn assign_impl(
        &self,
        interface_id: &str,
        private: IpAddr,
        public: Option<&PublicAddress>,
        gateways: &BTreeSet<String>,
    ) -> Result<(), CloudError> {
        let other_gateways = self.other_holders(interface_id, private, gateways).await?;
        if private.is_ipv6() {
            return self.assign_ipv6(interface_id, private, &other_gateways).await;
        }
        // Both calls are made whatever a Describe says is there now: EC2 is
        // eventually consistent, and a take-over that skipped a call on a
        // stale read would translate to an address the VPC delivers elsewhere.
        // Both are idempotent.
        self.client
            .assign_private_ip_addresses()
            .network_interface_id(interface_id)
            .private_ip_addresses(private.to_string())
            .allow_reassignment(true)
            .send()
            .await
            .map_err(|e| classify("AssignPrivateIpAddresses", e))?;
        let Some(public) = public else { return Ok(()) };
        self.client
            .associate_address()
            .allocation_id(&public.allocation_id)
            .network_interface_id(interface_id)
            .private_ip_address(private.to_string())
            .allow_reassociation(true)
            .send()
            .await
            .map_err(|e| classify("AssociateAddress", e))?;
        Ok(())
    }

    /// An IPv6 address has no reassignment flag: it is unassigned from the
    /// other gateways' ENIs that hold it, then assigned to this one (always:
    /// the reads may be stale).
    async fn assign_ipv6(&self, interface_id: &str, private: IpAddr, others: &[String]) -> Result<(), CloudError> {
        for other in others {
            self.client
                .unassign_ipv6_addresses()
                .network_interface_id(other)
                .ipv6_addresses(private.to_string())
                .send()
                .await
                .map_err(|e| classify("UnassignIpv6Addresses", e))?;
        }
        self.client
            .assign_ipv6_addresses()
            .network_interface_id(interface_id)
            .ipv6_addresses(private.to_string())
            .send()
            .await
            .map_err(|e| classify("AssignIpv6Addresses", e))?;
        Ok(())
    }

    /// The other gateways' ENIs that hold `private` now. Refuses (for good,
    /// [`HELD_ELSEWHERE`]) when an ENI other than `interface_id` that is not
    /// attached to a gateway instance holds it: `AllowReassignment` would
    /// take it from whoever holds it.
    async fn other_holders(
        &self,
        interface_id: &str,
        private: IpAddr,
        gateways: &BTreeSet<String>,
    ) -> Result<Vec<String>, CloudError> {
        let gateway_instances: BTreeSet<&str> = gateways.iter().filter_map(|p| parse_provider_id(p).ok()).collect();
        let own = self.eni(interface_id).await?.ok_or_else(|| CloudError {
            operation: "DescribeNetworkInterfaces",
            code: "InvalidNetworkInterfaceID.NotFound".into(),
            message: format!("interface {interface_id} not found"),
            retryable: false,
        })?;
        // Every interface of the subnet, not a filter on the address: the
        // `addresses.private-ip-address` filter would do it in one call on
        // AWS, but moto matches it against primary addresses only, and the
        // subnet's interfaces are what discovery reads anyway.
        let subnet = own.subnet_id().unwrap_or_default();
        let mut others = Vec::new();
        for eni in &self.subnet_interfaces(subnet).await? {
            if !eni_addresses(eni)?.contains(&private) {
                continue;
            }
            let id = eni.network_interface_id().unwrap_or_default();
            if id == interface_id {
                continue;
            }
            let instance = eni.attachment().and_then(|a| a.instance_id());
            let primary = eni.private_ip_address() == Some(private.to_string().as_str());
            let owner = match instance {
                Some(i) if gateway_instances.contains(i) && !primary => {
                    others.push(id.to_owned());
                    continue;
                }
                Some(i) if gateway_instances.contains(i) => format!("the primary address of gateway instance {i}"),
                Some(i) => format!("instance {i}, which is not a gateway Node"),
                None => "no instance".to_string(),
            };
            return Err(CloudError {
                operation: if private.is_ipv6() { "AssignIpv6Addresses" } else { "AssignPrivateIpAddresses" },
                code: HELD_ELSEWHERE.into(),
                message: format!(
                    "{private} is an address of interface {id} ({owner}); not taking it: free it or pair the public address with another private address"
                ),
                retryable: false,
            });
        }
        Ok(others)
    }

    async fn verify_impl(
        &self,
        interface_id: &str,
        private: IpAddr,
        public: Option<&PublicAddress>,
    ) -> Result<bool, CloudError> {
        if !self.holds(interface_id, private).await? {
            return Ok(false);
        }
        let Some(public) = public else { return Ok(true) };
        let now = self
            .client
            .describe_addresses()
            .allocation_ids(&public.allocation_id)
            .send()
            .await
            .map_err(|e| classify("DescribeAddresses", e))?;
        let private = private.to_string();
        Ok(now.addresses().iter().any(|a| {
            a.network_interface_id() == Some(interface_id) && a.private_ip_address() == Some(private.as_str())
        }))
    }

    async fn release_impl(&self, interface_id: &str, private: IpAddr) -> Result<(), CloudError> {
        // Whether the address is still there decides, not an error code: the
        // API reference documents none for "not assigned" (moto answers
        // success), and a later holder may take it at any moment.
        if !self.holds(interface_id, private).await? {
            return Ok(());
        }
        // (whether a transport failed, the error) of the one call.
        let failed: Option<(bool, CloudError)> = if private.is_ipv6() {
            let out = self
                .client
                .unassign_ipv6_addresses()
                .network_interface_id(interface_id)
                .ipv6_addresses(private.to_string())
                .send()
                .await;
            out.err().map(|e| (is_transport(&e), classify("UnassignIpv6Addresses", e)))
        } else {
            let out = self
                .client
                .unassign_private_ip_addresses()
                .network_interface_id(interface_id)
                .private_ip_addresses(private.to_string())
                .send()
                .await;
            out.err().map(|e| (is_transport(&e), classify("UnassignPrivateIpAddresses", e)))
        };
        match failed {
            None => Ok(()),
            // Taken by another interface (or the interface deleted) between
            // the look and the call: released all the same.
            Some((false, _)) if !self.holds(interface_id, private).await? => Ok(()),
            Some((_, e)) => Err(e),
        }
    }

    /// Whether `private` is an address of `interface_id` now (a vanished
    /// interface holds nothing).
    async fn holds(&self, interface_id: &str, private: IpAddr) -> Result<bool, CloudError> {
        match self.eni(interface_id).await? {
            Some(eni) => Ok(eni_addresses(&eni)?.contains(&private)),
            None => Ok(false),
        }
    }
}

impl Cloud for AwsCloud {
    fn name(&self) -> &'static str {
        "aws"
    }

    fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
        Box::pin(self.discover_impl(pool))
    }

    fn interface<'a>(
        &'a self,
        provider_id: &'a str,
        subnet_id: &'a str,
    ) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(self.interface_impl(provider_id, subnet_id))
    }

    fn primary_interface<'a>(&'a self, provider_id: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(self.primary_interface_impl(provider_id))
    }

    fn add_address<'a>(&'a self, interface_id: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>> {
        Box::pin(self.add_address_impl(interface_id))
    }

    fn assign<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
        gateways: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(self.assign_impl(interface_id, private, public, gateways))
    }

    fn verify<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>> {
        Box::pin(self.verify_impl(interface_id, private, public))
    }

    fn release<'a>(&'a self, interface_id: &'a str, private: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(self.release_impl(interface_id, private))
    }
}

/// The instance id in a Node's `spec.providerID`: `aws:///<zone>/<id>` (what
/// the AWS cloud provider writes, kubernetes/cloud-provider-aws
/// `instances.go`) or `aws://<zone>/<id>`.
pub fn parse_provider_id(provider_id: &str) -> Result<&str, CloudError> {
    let bad = |why: &str| CloudError {
        operation: "providerID",
        code: "InvalidProviderID".into(),
        message: format!("Node spec.providerID {provider_id:?}: {why} (want aws:///<zone>/i-<id>)"),
        retryable: false,
    };
    let rest = provider_id.strip_prefix("aws://").ok_or_else(|| bad("not an AWS provider ID"))?;
    let rest = rest.strip_prefix('/').unwrap_or(rest);
    let mut parts = rest.split('/');
    let (Some(zone), Some(id), None) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad("not <zone>/<instance id>"));
    };
    if zone.is_empty() || !zone.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(bad("bad availability zone"));
    }
    let hex = id.strip_prefix("i-").ok_or_else(|| bad("not an EC2 instance id"))?;
    if hex.is_empty() || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(bad("not an EC2 instance id"));
    }
    Ok(id)
}

/// What a failed SDK call means for the caller.
fn classify<E>(operation: &'static str, err: SdkError<E>) -> CloudError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let message = || aws_sdk_ec2::error::DisplayErrorContext(&err).to_string();
    let transport =
        |code: &str, retryable: bool| CloudError { operation, code: code.into(), message: message(), retryable };
    match &err {
        SdkError::ServiceError(s) => {
            let status = s.raw().status().as_u16();
            let code = err.code().map_or_else(|| format!("HTTP {status}"), str::to_owned);
            let retryable = is_retryable(&code, Some(status));
            CloudError { operation, message: err.message().map_or_else(message, str::to_owned), code, retryable }
        }
        SdkError::TimeoutError(_) => transport("timeout", true),
        SdkError::DispatchFailure(d) if d.is_timeout() => transport("timeout", true),
        SdkError::DispatchFailure(d) if d.is_io() => transport("connect", true),
        // A client-side mistake (a bad endpoint URL): the same again fails the same.
        SdkError::DispatchFailure(d) if d.is_user() => transport("dispatch", false),
        SdkError::DispatchFailure(_) => transport("dispatch", true),
        // A response that is not EC2's XML (a proxy's error page, a cut-off body).
        SdkError::ResponseError(r) => {
            let status = r.raw().status().as_u16();
            transport("response", status >= 500 || status == 429 || status < 300)
        }
        SdkError::ConstructionFailure(_) => transport("construction", false),
        _ => transport("unknown", true),
    }
}

/// Whether the call failed before EC2 answered (a timeout or a connection
/// failure): then nothing is known about its effect.
fn is_transport<E, R>(e: &SdkError<E, R>) -> bool {
    matches!(e, SdkError::TimeoutError(_) | SdkError::DispatchFailure(_))
}

/// Whether an EC2 error code (and HTTP status) may succeed when repeated.
pub fn is_retryable(code: &str, status: Option<u16>) -> bool {
    RETRYABLE_CODES.contains(&code) || status.is_some_and(|s| s >= 500 || s == 429)
}

/// IPv6 egress addresses need AssignIpv6Addresses / UnassignIpv6Addresses
/// (and no Elastic IP: they are global), which this provider does not call
/// yet; refuse them by name instead of sending an IPv6 address to the IPv4
/// calls.
fn invalid(operation: &'static str, message: &str) -> CloudError {
    CloudError { operation, code: "NotFound".into(), message: message.to_owned(), retryable: false }
}

fn parse_ip(operation: &'static str, s: &str) -> Result<IpAddr, CloudError> {
    s.parse().map_err(|_| CloudError {
        operation,
        code: "InvalidResponse".into(),
        message: format!("unparsable address {s:?}"),
        retryable: false,
    })
}

/// A field EC2 sent, unless it is empty (moto sends an unassociated
/// address's association fields empty; AWS leaves them out).
fn present(s: Option<&str>) -> Option<&str> {
    s.filter(|s| !s.is_empty())
}

fn filter(name: &str, value: &str) -> Filter {
    Filter::builder().name(name).values(value).build()
}

/// Every private address of an ENI, primary and secondary.
fn eni_addresses(eni: &NetworkInterface) -> Result<BTreeSet<IpAddr>, CloudError> {
    let mut out = BTreeSet::new();
    if let Some(p) = eni.private_ip_address() {
        out.insert(parse_ip("DescribeNetworkInterfaces", p)?);
    }
    for p in eni.private_ip_addresses().iter().filter_map(|p| p.private_ip_address()) {
        out.insert(parse_ip("DescribeNetworkInterfaces", p)?);
    }
    for p in eni.ipv6_addresses().iter().filter_map(|p| p.ipv6_address()) {
        out.insert(parse_ip("DescribeNetworkInterfaces", p)?);
    }
    Ok(out)
}

/// The addresses AWS keeps in every subnet (VPC User Guide, "Subnet CIDR
/// blocks": the network address, the VPC router (+1), DNS (+2), future use
/// (+3) and the last one), so a pairing never picks one of them.
fn reserved(cidr: IpNet) -> BTreeSet<IpAddr> {
    let IpNet::V4(net) = cidr else { return BTreeSet::new() };
    let base = u32::from(net.network());
    let mut out: BTreeSet<IpAddr> =
        (0..4u32).filter_map(|i| base.checked_add(i)).map(|a| IpAddr::V4(Ipv4Addr::from(a))).collect();
    out.insert(IpAddr::V4(net.broadcast()));
    out
}

fn timeouts() -> TimeoutConfig {
    TimeoutConfig::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .operation_timeout(OPERATION_TIMEOUT)
        .operation_attempt_timeout(OPERATION_TIMEOUT)
        .build()
}

/// The SDK's hyper client with rustls on ring (the crate's TLS stack), and
/// no aws-lc.
fn https_client() -> SharedHttpClient {
    use aws_smithy_http_client::tls;
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
        .build_https()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use aws_sdk_ec2::config::http::HttpResponse;
    use aws_sdk_ec2::error::ErrorMetadata;
    use aws_sdk_ec2::operation::associate_address::AssociateAddressError;

    #[test]
    fn provider_id_forms() {
        assert_eq!(parse_provider_id("aws:///us-east-1a/i-0abc123").unwrap(), "i-0abc123");
        assert_eq!(parse_provider_id("aws://us-east-1a/i-0abc123").unwrap(), "i-0abc123");
        for bad in [
            "",
            "gce://proj/zone/name",
            "aws:///i-0abc123",
            "aws:///us-east-1a/",
            "aws:///us-east-1a/fargate-ip-10-0-0-1",
            "aws:///us-east-1a/i-xyz",
            "aws:///us-east-1a/i-0abc/extra",
            "aws:////i-0abc",
            "i-0abc123",
        ] {
            let e = parse_provider_id(bad).unwrap_err();
            assert!(!e.retryable, "{bad}");
            assert_eq!(e.code, "InvalidProviderID");
            assert!(e.message.contains(&format!("{bad:?}")), "the error names the value: {e}");
        }
    }

    fn service_error(code: &str, status: u16) -> SdkError<AssociateAddressError> {
        let meta = ErrorMetadata::builder().code(code).message(format!("{code} says no")).build();
        let raw = HttpResponse::new(status.try_into().unwrap(), aws_smithy_types::body::SdkBody::empty());
        SdkError::service_error(AssociateAddressError::generic(meta), raw)
    }

    #[test]
    fn throttling_and_server_errors_are_retryable() {
        for (code, status) in [
            ("RequestLimitExceeded", 503),
            ("Throttling", 400),
            ("RequestLimitExceeded", 400),
            ("InternalError", 500),
            ("Unavailable", 503),
            ("SomethingNew", 502),
            ("SlowDown", 429),
        ] {
            let e = classify("AssociateAddress", service_error(code, status));
            assert!(e.retryable, "{code} {status}");
            assert_eq!(e.code, code);
            assert_eq!(e.operation, "AssociateAddress");
            assert_eq!(e.message, format!("{code} says no"));
        }
    }

    #[test]
    fn auth_and_validation_errors_are_not_retryable() {
        for (code, status) in [
            ("UnauthorizedOperation", 403),
            ("AuthFailure", 401),
            ("InvalidParameterValue", 400),
            ("InvalidAllocationID.NotFound", 400),
            ("Resource.AlreadyAssociated", 400),
        ] {
            let e = classify("AssociateAddress", service_error(code, status));
            assert!(!e.retryable, "{code} {status}");
            assert_eq!(e.code, code);
        }
    }

    #[test]
    fn transport_failures_are_retryable() {
        use aws_sdk_ec2::error::ConnectorError;
        let timeout: SdkError<AssociateAddressError> = SdkError::timeout_error("operation timed out");
        let e = classify("AssociateAddress", timeout);
        assert_eq!((e.code.as_str(), e.retryable), ("timeout", true));
        let io: SdkError<AssociateAddressError> =
            SdkError::dispatch_failure(ConnectorError::io(std::io::Error::other("connection refused").into()));
        let e = classify("AssociateAddress", io);
        assert_eq!((e.code.as_str(), e.retryable), ("connect", true));
        let user: SdkError<AssociateAddressError> =
            SdkError::dispatch_failure(ConnectorError::user(std::io::Error::other("bad URL").into()));
        let e = classify("AssociateAddress", user);
        assert_eq!((e.code.as_str(), e.retryable), ("dispatch", false));
    }

    #[test]
    fn reserved_addresses_of_a_subnet() {
        let r = reserved("198.18.1.0/24".parse().unwrap());
        let want: BTreeSet<IpAddr> = ["198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3", "198.18.1.255"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(r, want);
    }
}
