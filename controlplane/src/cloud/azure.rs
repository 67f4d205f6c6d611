//! The Azure provider: public IP addresses found by tag, moved between
//! gateways' network interfaces (NICs) as secondary IP configurations.
//!
//! There is no official Azure *management* crate for Rust (the Azure SDK for
//! Rust ships `azure_core` and `azure_identity`, and no Microsoft.Network or
//! Microsoft.Compute client), so the few Azure Resource Manager (ARM) calls
//! below are written by hand on `azure_core`'s HTTP pipeline: its bearer-token
//! policy (credentials from `azure_identity`: workload identity when
//! `AZURE_FEDERATED_TOKEN_FILE` is set, else the managed identity, with
//! `AZURE_CLIENT_ID` naming a user-assigned one), its retry policy turned off,
//! its error model (ARM's `{"error": {"code", "message"}}`) and its
//! long-running-operation [`Poller`]. The transport is hyper with rustls on
//! ring (what the crate already builds for kube), not reqwest.
//!
//! Every trait call is one attempt bounded in time ([`Bounds`]): each HTTP
//! request by [`Bounds::request`], a call that only reads by [`Bounds::read`],
//! and a call that updates NICs by [`Bounds::update`], which covers the
//! operations' polls (a NIC update is a long-running operation that takes
//! seconds on Azure). The caller (the cloud task) owns the retries.
//!
//! | trait call | ARM calls |
//! |---|---|
//! | [`Cloud::discover`] | Subnets - Get (the prefix and its IP configurations), Network Interfaces - List per resource group of those IP configurations (every private address in use), Public IP Addresses - List All in the subnet's subscription (tags filtered here), Network Interfaces - Get for an associated public IP whose NIC is outside the subnet |
//! | [`Cloud::interface`] | Virtual Machines - Get (the VM named by the providerID), Network Interfaces - Get for its NICs, primary first, until one has an IP configuration in the subnet |
//! | [`Cloud::primary_interface`] | Virtual Machines - Get, Network Interfaces - Get of its primary NIC (whatever its subnet: a worker Node's) |
//! | [`Cloud::add_address`] | Network Interfaces - Get, then Network Interfaces - Create Or Update with one more IP configuration (`egret-node-<n>`, `privateIPAllocationMethod: Dynamic`, in the primary IP configuration's subnet: Azure chooses the address), waited for, then Network Interfaces - Get (the address Azure gave it) |
//! | [`Cloud::assign`] | Network Interfaces - Get (ours), Subnets - Get (ours, to find the one holding the address), Network Interfaces - List per resource group (who holds the private address), Public IP Addresses - Get (who holds the public one); then Network Interfaces - Create Or Update on each other NIC that holds either (its IP configuration removed, or its association cleared), each waited for, then always on ours (the IP configuration added), waited for |
//! | [`Cloud::verify`] | Network Interfaces - Get (ours has an IP configuration with the private address referencing the public IP) |
//! | [`Cloud::release`] | Network Interfaces - Get, then Network Interfaces - Create Or Update without the IP configuration if it is still there, waited for |
//!
//! A worker Node's address (a `PerNode` cloud pool, ADR 0033) is made with
//! the same calls: `primary_interface`, `add_address` (the provider, not
//! Egret, picks a free address of the Node's own subnet), then `assign` with
//! that address and only the Node's providerID as `gateways`. `assign` finds
//! the IP configuration `add_address` made (it holds the address), keeps its
//! name and address (now Static: the same address, which only this IP
//! configuration holds), and takes the public IP from whichever
//! NIC holds it (a Node that had it before); a private address held by any
//! other VM's NIC is refused ([`HELD_ELSEWHERE`]). `release` removes the IP
//! configuration, which frees the address and ends the association.
//!
//! Each Create Or Update sends `If-Match` with the etag the Get read, so a
//! concurrent change fails it (412, retryable) instead of being overwritten,
//! and is followed through its `Azure-AsyncOperation` URL until it succeeds
//! or fails. A move is two updates because Azure has no "reassociate" flag:
//! it refuses a NIC update naming a private address or public IP that
//! another NIC's IP configuration holds (`PrivateIPAddressIsAllocated`,
//! `PublicIPAddressInUse`), including one whose update is still running.
//!
//! The identity needs `Microsoft.Network/networkInterfaces/read` and
//! `/write`, `Microsoft.Network/publicIPAddresses/read` and `/join/action`,
//! `Microsoft.Network/virtualNetworks/subnets/read` and `/join/action`,
//! `Microsoft.Compute/virtualMachines/read`, and
//! `Microsoft.Network/locations/operations/read`. For worker Nodes' addresses
//! the same permissions must also cover the workers' NICs, their resource
//! groups (Network Interfaces - List of a worker subnet's holders) and the
//! workers' subnets (`subnets/read`, and `subnets/join/action` for the new
//! IP configuration).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use azure_core::credentials::TokenCredential;
use azure_core::error::{ErrorKind, ErrorResponse};
use azure_core::http::headers::{HeaderName, HeaderValue, Headers, RETRY_AFTER};
use azure_core::http::policies::auth::BearerTokenAuthorizationPolicy;
use azure_core::http::policies::Policy;
use azure_core::http::poller::{
    Poller, PollerContinuation, PollerOptions, PollerResult, PollerState, PollerStatus, StatusMonitor,
};
use azure_core::http::{
    AsyncRawResponse, Body, ClientOptions, Context, HttpClient, JsonFormat, Method, Pipeline, RawResponse, Request,
    Response, RetryOptions, StatusCode, Transport, Url,
};
use futures::future::BoxFuture;
use futures::StreamExt;
use ipnet::IpNet;
use serde::Deserialize;
use serde_json::Value;

use super::{Cloud, CloudError, Discovered, Interface, PoolSelector, PublicAddress, HELD_ELSEWHERE};

/// Azure's public cloud ARM endpoint (the default).
pub const DEFAULT_ENDPOINT: &str = "https://management.azure.com";

/// The variable [`AzureCloud::load`] reads the ARM endpoint from (a
/// sovereign cloud, or a test's emulator). The Azure SDKs define none for
/// ARM (they take it from code or from a cloud profile), so Egret names its
/// own.
pub const ENDPOINT_ENV: &str = "EGRET_AZURE_ARM_ENDPOINT";

/// The variable [`AzureCloud::load`] reads a PEM file of extra CA
/// certificates from, trusted for the ARM endpoint besides the system's
/// (a test's emulator serves HTTPS with its own CA).
pub const CA_FILE_ENV: &str = "EGRET_AZURE_ARM_CA_FILE";

/// The api-version of the Microsoft.Network calls (the emulator serves
/// exactly these; tests/emulators/azure/README.md).
const NETWORK_API: &str = "2024-05-01";
/// The api-version of Virtual Machines - Get.
const COMPUTE_API: &str = "2024-07-01";

/// The prefix of the IP configurations this provider adds: `egret-` and the
/// address with dashes (`egret-198-18-1-40`).
pub const IPCONFIG_PREFIX: &str = "egret-";

/// The prefix of the IP configurations [`Cloud::add_address`] adds to a
/// worker Node's NIC: `egret-node-` and the lowest number free on the NIC
/// (the address is Azure's choice, unknown until the update completes).
pub const NODE_IPCONFIG_PREFIX: &str = "egret-node-";

/// ARM error codes that may succeed when the call is repeated, beside any
/// 429, 412 or 5xx ([`is_retryable`]):
/// - `AnotherOperationInProgress`, `RetryableErrorDueToAnotherOperation`:
///   the NIC (or a resource it references) is locked by another update
///   (ARM's throttling page, "Network throttling");
/// - `ReferencedResourceNotProvisioned`: a referenced public IP or subnet is
///   itself being updated;
/// - `PrivateIPAddressIsAllocated`, `PublicIPAddressInUse`: the holder scan
///   read a stale state (ARM reads are eventually consistent); the next
///   attempt reads again, and refuses for good ([`HELD_ELSEWHERE`]) if the
///   holder is not a gateway;
/// - the operation failures `InternalServerError`, `OperationPreempted`,
///   `Canceled`/`OperationCanceled`.
const RETRYABLE_CODES: &[&str] = &[
    "AnotherOperationInProgress",
    "RetryableErrorDueToAnotherOperation",
    "ReferencedResourceNotProvisioned",
    "PrivateIPAddressIsAllocated",
    "PublicIPAddressInUse",
    "InternalServerError",
    "OperationPreempted",
    "Canceled",
    "OperationCanceled",
];

/// How long the provider waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Opening a connection.
    pub connect: Duration,
    /// One HTTP request, connection and body included.
    pub request: Duration,
    /// A call that only reads (discover, interface, verify), all its
    /// requests together.
    pub read: Duration,
    /// A call that updates NICs (assign, release), all its requests and the
    /// operations' polls together.
    pub update: Duration,
    /// The longest wait between two polls of an operation: ARM's
    /// `Retry-After` is honoured up to this (NRP often says 10 s for an
    /// update that completes in two; a failover should not wait for it).
    pub poll_max: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(3),
            request: Duration::from_secs(10),
            read: Duration::from_secs(30),
            update: Duration::from_secs(90),
            poll_max: Duration::from_secs(5),
        }
    }
}

/// The Azure implementation of [`Cloud`]. A provider that could not be
/// configured ([`AzureCloud::load`]) answers every call with that error.
#[derive(Clone, Debug)]
pub struct AzureCloud {
    arm: Result<Arm, CloudError>,
}

/// ARM behind one pipeline.
#[derive(Clone, Debug)]
struct Arm {
    pipeline: Pipeline,
    endpoint: Url,
    bounds: Bounds,
}

impl AzureCloud {
    /// A provider for `endpoint` (`https://...`; [`DEFAULT_ENDPOINT`] on
    /// Azure) authenticating with `credential` (tokens for
    /// `<endpoint>/.default`), trusting the system's CA certificates and
    /// those of `ca_pem` (PEM) when given.
    pub fn new(
        credential: Arc<dyn TokenCredential>,
        endpoint: &str,
        ca_pem: Option<&[u8]>,
        bounds: Bounds,
    ) -> Result<Self, CloudError> {
        let transport = HyperTransport::new(ca_pem, true, bounds)?;
        Ok(Self { arm: Ok(Arm::new(credential, endpoint, transport, bounds)?) })
    }

    /// A provider configured from the environment, as a gateway Pod on AKS
    /// has it: the endpoint from [`ENDPOINT_ENV`] (default
    /// [`DEFAULT_ENDPOINT`]), extra CAs from [`CA_FILE_ENV`], and the
    /// credential from `azure_identity`: workload identity when
    /// `AZURE_FEDERATED_TOKEN_FILE` is set (with `AZURE_CLIENT_ID` and
    /// `AZURE_TENANT_ID`, as the workload-identity webhook sets them), else
    /// the managed identity (IMDS), a user-assigned one when
    /// `AZURE_CLIENT_ID` is set. A configuration that fails makes a provider
    /// whose every call fails, not retryably, saying why.
    pub fn load() -> Self {
        Self { arm: Self::load_arm(Bounds::default()) }
    }

    fn load_arm(bounds: Bounds) -> Result<Arm, CloudError> {
        let endpoint = std::env::var(ENDPOINT_ENV).unwrap_or_else(|_| DEFAULT_ENDPOINT.to_owned());
        let ca =
            match std::env::var_os(CA_FILE_ENV) {
                Some(path) => Some(std::fs::read(&path).map_err(|e| {
                    config_error(format!("{CA_FILE_ENV}={}: {e}", std::path::Path::new(&path).display()))
                })?),
                None => None,
            };
        let arm_transport = HyperTransport::new(ca.as_deref(), true, bounds)?;
        // The identity endpoints: Entra ID over HTTPS, IMDS over plain HTTP.
        let identity = Transport::new(Arc::new(HyperTransport::new(ca.as_deref(), false, bounds)?));
        let client_options =
            ClientOptions { transport: Some(identity), retry: RetryOptions::none(), ..Default::default() };
        let credential: Arc<dyn TokenCredential> = if std::env::var_os("AZURE_FEDERATED_TOKEN_FILE").is_some() {
            let mut options = azure_identity::WorkloadIdentityCredentialOptions::default();
            options.credential_options.client_options = client_options;
            azure_identity::WorkloadIdentityCredential::new(Some(options))
                .map_err(|e| config_error(format!("workload identity: {e}")))?
        } else {
            let options = azure_identity::ManagedIdentityCredentialOptions {
                user_assigned_id: std::env::var("AZURE_CLIENT_ID")
                    .ok()
                    .filter(|id| !id.is_empty())
                    .map(azure_identity::UserAssignedId::ClientId),
                client_options,
            };
            azure_identity::ManagedIdentityCredential::new(Some(options))
                .map_err(|e| config_error(format!("managed identity: {e}")))?
        };
        Arm::new(credential, &endpoint, arm_transport, bounds)
    }

    fn arm(&self) -> Result<&Arm, CloudError> {
        self.arm.as_ref().map_err(Clone::clone)
    }
}

impl Cloud for AzureCloud {
    fn name(&self) -> &'static str {
        "azure"
    }

    fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("discover", arm.bounds.read, arm.discover(pool)).await
        })
    }

    fn interface<'a>(
        &'a self,
        provider_id: &'a str,
        subnet_id: &'a str,
    ) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("interface", arm.bounds.read, arm.interface(provider_id, subnet_id)).await
        })
    }

    fn primary_interface<'a>(&'a self, provider_id: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("primary_interface", arm.bounds.read, arm.primary_interface(provider_id)).await
        })
    }

    fn add_address<'a>(&'a self, interface_id: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("add_address", arm.bounds.update, arm.add_address(interface_id)).await
        })
    }

    fn assign<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
        gateways: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("assign", arm.bounds.update, arm.assign(interface_id, private, public, gateways)).await
        })
    }

    fn verify<'a>(
        &'a self,
        interface_id: &'a str,
        private: IpAddr,
        public: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("verify", arm.bounds.read, arm.verify(interface_id, private, public)).await
        })
    }

    fn release<'a>(&'a self, interface_id: &'a str, private: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
        Box::pin(async move {
            let arm = self.arm()?;
            bounded("release", arm.bounds.update, arm.release(interface_id, private)).await
        })
    }
}

/// `fut`, or a retryable timeout naming `call` once `bound` has passed.
async fn bounded<T>(
    call: &'static str,
    bound: Duration,
    fut: impl std::future::Future<Output = Result<T, CloudError>>,
) -> Result<T, CloudError> {
    match tokio::time::timeout(bound, fut).await {
        Ok(r) => r,
        Err(_) => Err(CloudError {
            operation: call,
            code: "timeout".into(),
            message: format!("the {call} call did not finish within {} s", bound.as_secs_f32()),
            retryable: true,
        }),
    }
}

// ------------------------------------------------------------------ ARM ---

/// A NIC as read: the JSON kept whole (a PUT replaces the resource, so what
/// this provider does not model must go back as it came) and the fields it
/// reads.
#[derive(Clone, Debug)]
struct Nic {
    raw: Value,
    id: String,
    etag: Option<String>,
    vm_id: Option<String>,
    forwarding: bool,
    ipconfigs: Vec<IpConfig>,
}

#[derive(Clone, Debug)]
struct IpConfig {
    name: String,
    private_ip: Option<IpAddr>,
    subnet_id: Option<String>,
    primary: bool,
    public_ip_id: Option<String>,
}

impl Nic {
    fn parse(raw: Value) -> Result<Self, CloudError> {
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct View {
            id: String,
            etag: Option<String>,
            #[serde(default)]
            properties: Props,
        }
        #[derive(Default, Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Props {
            #[serde(rename = "enableIPForwarding", default)]
            enable_ip_forwarding: bool,
            virtual_machine: Option<IdRef>,
            #[serde(default)]
            ip_configurations: Vec<IpcView>,
        }
        #[derive(Deserialize)]
        struct IpcView {
            name: String,
            #[serde(default)]
            properties: IpcProps,
        }
        #[derive(Default, Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct IpcProps {
            #[serde(rename = "privateIPAddress")]
            private_ip_address: Option<String>,
            subnet: Option<IdRef>,
            #[serde(default)]
            primary: bool,
            #[serde(rename = "publicIPAddress")]
            public_ip_address: Option<IdRef>,
        }
        let view: View = serde_json::from_value(raw.clone())
            .map_err(|e| invalid_response("NetworkInterfaces_Get", format!("a network interface: {e}")))?;
        let mut ipconfigs = Vec::new();
        for c in view.properties.ip_configurations {
            let private_ip = match c.properties.private_ip_address.as_deref().filter(|s| !s.is_empty()) {
                Some(s) => Some(parse_ip("NetworkInterfaces_Get", s)?),
                None => None,
            };
            ipconfigs.push(IpConfig {
                name: c.name,
                private_ip,
                subnet_id: c.properties.subnet.map(|r| r.id),
                primary: c.properties.primary,
                public_ip_id: c.properties.public_ip_address.map(|r| r.id),
            });
        }
        Ok(Self {
            raw,
            id: view.id,
            etag: view.etag,
            vm_id: view.properties.virtual_machine.map(|r| r.id),
            forwarding: view.properties.enable_ip_forwarding,
            ipconfigs,
        })
    }

    fn holding(&self, private: IpAddr) -> Option<&IpConfig> {
        self.ipconfigs.iter().find(|c| c.private_ip == Some(private))
    }

    /// The primary IP configuration (one alone is the primary).
    fn primary(&self) -> Option<&IpConfig> {
        self.ipconfigs.iter().find(|c| c.primary).or_else(|| self.ipconfigs.first())
    }

    /// `<prefix><n>` with the lowest `n` from 1 that no IP configuration of
    /// this NIC is named (ARM compares the names without case).
    fn free_name(&self, prefix: &str) -> String {
        let taken = |name: &str| self.ipconfigs.iter().any(|c| c.name.eq_ignore_ascii_case(name));
        (1..).map(|n| format!("{prefix}{n}")).find(|name| !taken(name)).unwrap_or_default()
    }

    fn in_subnet(&self, subnet_id: &str) -> bool {
        self.ipconfigs.iter().any(|c| c.subnet_id.as_deref().is_some_and(|s| same_id(s, subnet_id)))
    }

    /// The NIC's JSON with its IP configurations passed through `edit`
    /// (each as ARM sent it), ready to PUT back.
    fn edited(&self, edit: impl FnOnce(&mut Vec<Value>)) -> Value {
        let mut body = self.raw.clone();
        if let Some(list) = body.pointer_mut("/properties/ipConfigurations").and_then(Value::as_array_mut) {
            edit(list);
        }
        body
    }
}

#[derive(Clone, Debug, Deserialize)]
struct IdRef {
    id: String,
}

#[derive(Deserialize)]
struct Page<T> {
    #[serde(default = "Vec::new")]
    value: Vec<T>,
    #[serde(rename = "nextLink")]
    next_link: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Subnet {
    id: String,
    #[serde(default)]
    properties: SubnetProps,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SubnetProps {
    address_prefix: Option<String>,
    #[serde(default)]
    address_prefixes: Vec<String>,
    #[serde(default)]
    ip_configurations: Vec<IdRef>,
}

impl Subnet {
    /// The subnet's IPv4 prefix (`addressPrefix`, else the first IPv4 one of
    /// `addressPrefixes`).
    fn prefix(&self) -> Result<IpNet, CloudError> {
        let candidates = self.properties.address_prefix.iter().chain(self.properties.address_prefixes.iter());
        for p in candidates {
            if let Ok(net @ IpNet::V4(_)) = p.parse::<IpNet>() {
                return Ok(net);
            }
        }
        Err(not_found("Subnets_Get", format!("subnet {} has no IPv4 address prefix", self.id)))
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PublicIp {
    id: String,
    #[serde(default)]
    tags: BTreeMap<String, String>,
    #[serde(default)]
    properties: PublicIpProps,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PublicIpProps {
    ip_address: Option<String>,
    ip_configuration: Option<IdRef>,
}

#[derive(Deserialize)]
struct Vm {
    id: String,
    #[serde(default)]
    properties: VmProps,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct VmProps {
    network_profile: Option<NetworkProfile>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NetworkProfile {
    #[serde(default)]
    network_interfaces: Vec<NicRef>,
}

#[derive(Deserialize)]
struct NicRef {
    id: String,
    properties: Option<NicRefProps>,
}

#[derive(Deserialize)]
struct NicRefProps {
    primary: Option<bool>,
}

/// An operation's status (the `Azure-AsyncOperation` URL's answer).
#[derive(Deserialize)]
struct OperationStatus {
    status: PollerStatus,
    error: Option<azure_core::error::ErrorDetail>,
}

impl StatusMonitor for OperationStatus {
    type Output = OperationStatus;
    type Format = JsonFormat;
    fn status(&self) -> PollerStatus {
        self.status.clone()
    }
}

impl Arm {
    fn new(
        credential: Arc<dyn TokenCredential>,
        endpoint: &str,
        transport: HyperTransport,
        bounds: Bounds,
    ) -> Result<Self, CloudError> {
        let endpoint: Url = endpoint
            .trim_end_matches('/')
            .parse()
            .map_err(|e| config_error(format!("ARM endpoint {endpoint:?}: {e}")))?;
        if endpoint.scheme() != "https" {
            // azure_core's bearer-token policy sends no token over plain HTTP.
            return Err(config_error(format!("ARM endpoint {endpoint}: not https")));
        }
        let scope = format!("{}/.default", endpoint.as_str().trim_end_matches('/'));
        let auth: Arc<dyn Policy> = Arc::new(BearerTokenAuthorizationPolicy::new(credential, [scope]));
        let options = ClientOptions {
            transport: Some(Transport::new(Arc::new(transport))),
            retry: RetryOptions::none(),
            ..Default::default()
        };
        let pipeline = Pipeline::new(
            Some(env!("CARGO_PKG_NAME")),
            Some(env!("CARGO_PKG_VERSION")),
            options,
            Vec::new(),
            vec![auth],
            None,
        );
        Ok(Self { pipeline, endpoint, bounds })
    }

    /// The URL of an ARM resource (`id` is its path).
    fn url(&self, id: &str, api: &str) -> Url {
        let mut url = self.endpoint.clone();
        url.set_path(id);
        url.query_pairs_mut().append_pair("api-version", api);
        url
    }

    /// A URL ARM handed out (a nextLink, an operation): only to the endpoint
    /// this provider was given, which the bearer token is for.
    fn follow(&self, operation: &'static str, link: &str) -> Result<Url, CloudError> {
        let url: Url = link.parse().map_err(|e| invalid_response(operation, format!("link {link:?}: {e}")))?;
        if url.origin() != self.endpoint.origin() {
            return Err(invalid_response(
                operation,
                format!("link {link} is not on the ARM endpoint {}", self.endpoint),
            ));
        }
        Ok(url)
    }

    async fn send(&self, operation: &'static str, req: &mut Request) -> Result<RawResponse, Failure> {
        self.pipeline.send(&Context::new(), req, None).await.map_err(|e| classify(operation, e))
    }

    async fn get_url<T: serde::de::DeserializeOwned>(&self, operation: &'static str, url: Url) -> Result<T, Failure> {
        let resp = self.send(operation, &mut Request::new(url, Method::Get)).await?;
        serde_json::from_slice(resp.body()).map_err(|e| invalid_response(operation, e.to_string()).into())
    }

    /// GET of a resource; `None` when ARM answers 404.
    async fn get_opt<T: serde::de::DeserializeOwned>(
        &self,
        operation: &'static str,
        id: &str,
        api: &str,
    ) -> Result<Option<T>, CloudError> {
        match self.get_url(operation, self.url(id, api)).await {
            Ok(v) => Ok(Some(v)),
            Err(Failure { http_status: Some(404), .. }) => Ok(None),
            Err(f) => Err(f.error),
        }
    }

    /// Every item of a list, following `nextLink`.
    async fn list<T: serde::de::DeserializeOwned>(
        &self,
        operation: &'static str,
        mut url: Url,
    ) -> Result<Vec<T>, CloudError> {
        let mut all = Vec::new();
        loop {
            let page: Page<T> = self.get_url(operation, url).await?;
            all.extend(page.value);
            match page.next_link.filter(|l| !l.is_empty()) {
                Some(link) => url = self.follow(operation, &link)?,
                None => return Ok(all),
            }
        }
    }

    async fn nic(&self, id: &str) -> Result<Option<Nic>, CloudError> {
        match self.get_opt::<Value>("NetworkInterfaces_Get", id, NETWORK_API).await? {
            Some(raw) => Ok(Some(Nic::parse(raw)?)),
            None => Ok(None),
        }
    }

    async fn subnet(&self, id: &str) -> Result<Subnet, CloudError> {
        self.get_opt("Subnets_Get", id, NETWORK_API)
            .await?
            .ok_or_else(|| not_found("Subnets_Get", format!("subnet {id} not found")))
    }

    /// Every NIC with an IP configuration in `subnet`: those the subnet
    /// lists, read with one Network Interfaces - List per resource group
    /// (ARM has no filter by subnet or address, and a List costs one read
    /// where a Get per NIC costs one each), and any other NIC of those
    /// groups and of `extra_groups` that names the subnet (the subnet's list
    /// may lag). IP configurations of other kinds (load balancer frontends,
    /// scale-set NICs) are not readable here and are counted in the second
    /// value.
    async fn subnet_nics(
        &self,
        subnet: &Subnet,
        extra_groups: &[&str],
    ) -> Result<(BTreeMap<String, Nic>, usize), CloudError> {
        let mut groups: BTreeMap<String, String> = BTreeMap::new();
        let mut foreign = 0;
        for ipc in &subnet.properties.ip_configurations {
            match nic_of_ipconfig(&ipc.id).and_then(resource_group_of) {
                Some(g) => {
                    groups.entry(g.to_ascii_lowercase()).or_insert_with(|| g.to_owned());
                }
                None => foreign += 1,
            }
        }
        for g in extra_groups {
            groups.entry(g.to_ascii_lowercase()).or_insert_with(|| (*g).to_owned());
        }
        let listed: BTreeSet<String> = subnet
            .properties
            .ip_configurations
            .iter()
            .filter_map(|c| nic_of_ipconfig(&c.id))
            .map(str::to_ascii_lowercase)
            .collect();
        let mut nics = BTreeMap::new();
        for group in groups.values() {
            let url = self.url(&format!("{group}/providers/Microsoft.Network/networkInterfaces"), NETWORK_API);
            for raw in self.list::<Value>("NetworkInterfaces_List", url).await? {
                let nic = Nic::parse(raw)?;
                let key = nic.id.to_ascii_lowercase();
                if listed.contains(&key) || nic.in_subnet(&subnet.id) {
                    nics.insert(key, nic);
                }
            }
        }
        Ok((nics, foreign))
    }

    // ------------------------------------------------------- discover ---

    async fn discover(&self, pool: &PoolSelector) -> Result<Discovered, CloudError> {
        if pool.tags.is_empty() {
            return Err(CloudError {
                operation: "PublicIPAddresses_ListAll",
                code: "InvalidPool".into(),
                message: "a cloud pool needs at least one tag to select its public IP addresses".into(),
                retryable: false,
            });
        }
        let parsed = parse_subnet_id(&pool.subnet_id)?;
        let subnet = self.subnet(&pool.subnet_id).await?;
        let subnet_cidr = subnet.prefix()?;
        let (nics, foreign) = self.subnet_nics(&subnet, &[]).await?;
        if foreign > 0 {
            tracing::warn!(subnet = %subnet.id, count = foreign,
                "IP configurations in the subnet that are not network interfaces' (load balancers, scale sets): their addresses are not counted as used");
        }
        let mut used = reserved(subnet_cidr);
        for nic in nics.values() {
            used.extend(
                nic.ipconfigs
                    .iter()
                    .filter(|c| c.subnet_id.as_deref().is_some_and(|s| same_id(s, &subnet.id)))
                    .filter_map(|c| c.private_ip),
            );
        }

        // Public IP Addresses - List All, filtered here on every tag: ARM's
        // Resources - List takes one tag pair only and, with it, leaves the
        // tags out of its rows ("When you filter by a tag name and value,
        // the tags for each resource are not returned", Resources - List,
        // `$filter`), so each row would need a Get; and it is served from
        // ARM's resource cache, which lags the network provider's state.
        // List All is one paged call with tags and associations, from the
        // network provider itself.
        let url = self.url(
            &format!("/subscriptions/{}/providers/Microsoft.Network/publicIPAddresses", parsed.subscription),
            NETWORK_API,
        );
        let mut public = Vec::new();
        for pip in self.list::<PublicIp>("PublicIPAddresses_ListAll", url).await? {
            if !has_tags(&pip.tags, &pool.tags) {
                continue;
            }
            // A dynamic public IP not allocated now has no address.
            let Some(ip) = pip.properties.ip_address.as_deref().filter(|s| !s.is_empty()) else { continue };
            let public_ip = parse_ip("PublicIPAddresses_ListAll", ip)?;
            let (mut private_ip, mut interface_id) = (None, None);
            if let Some(ipc) = &pip.properties.ip_configuration {
                match split_ipconfig(&ipc.id) {
                    Some((nic_id, name)) => {
                        let nic = match nics.get(&nic_id.to_ascii_lowercase()) {
                            Some(n) => Some(n.clone()),
                            None => self.nic(nic_id).await?,
                        };
                        private_ip = nic.as_ref().and_then(|n| {
                            n.ipconfigs.iter().find(|c| c.name.eq_ignore_ascii_case(name)).and_then(|c| c.private_ip)
                        });
                        interface_id = Some(nic.map_or_else(|| nic_id.to_owned(), |n| n.id));
                    }
                    // A load balancer's frontend, say: no NIC, no private address here.
                    None => interface_id = Some(parent_of(&ipc.id).to_owned()),
                }
            }
            public.push(PublicAddress { public_ip, allocation_id: pip.id, private_ip, interface_id });
        }
        public.sort_by_key(|p| p.public_ip);
        Ok(Discovered { public, subnet_cidr, used })
    }

    // ------------------------------------------------------ interface ---

    async fn interface(&self, provider_id: &str, subnet_id: &str) -> Result<Interface, CloudError> {
        let in_subnet = |_: usize, nic: &Nic| nic.in_subnet(subnet_id);
        self.vm_interface(provider_id, in_subnet, &format!("in subnet {subnet_id}")).await
    }

    /// The VM's primary NIC, whatever its subnet (a worker Node's).
    async fn primary_interface(&self, provider_id: &str) -> Result<Interface, CloudError> {
        self.vm_interface(provider_id, |i, _| i == 0, "readable as its primary").await
    }

    /// The first NIC of the VM `provider_id` names that `pick` accepts (with
    /// its place in the VM's list, the primary first), read one by one;
    /// `which` words the refusal when none is.
    async fn vm_interface(
        &self,
        provider_id: &str,
        pick: impl Fn(usize, &Nic) -> bool,
        which: &str,
    ) -> Result<Interface, CloudError> {
        let vm_id = parse_provider_id(provider_id)?;
        let vm: Vm = self
            .get_opt("VirtualMachines_Get", &vm_id, COMPUTE_API)
            .await?
            .ok_or_else(|| not_found("VirtualMachines_Get", format!("virtual machine {vm_id} not found")))?;
        let mut refs: Vec<&NicRef> = vm.properties.network_profile.iter().flat_map(|p| &p.network_interfaces).collect();
        // The primary NIC first (one alone is the primary).
        let single = refs.len() == 1;
        refs.sort_by_key(|r| !(single || r.properties.as_ref().and_then(|p| p.primary).unwrap_or(false)));
        for (i, r) in refs.into_iter().enumerate() {
            let Some(nic) = self.nic(&r.id).await? else { continue };
            if pick(i, &nic) {
                return vm_nic(vm.id, nic);
            }
        }
        Err(not_found("VirtualMachines_Get", format!("virtual machine {} has no network interface {which}", vm.id)))
    }

    // ---------------------------------------------------- add_address ---

    /// One more IP configuration on `nic_id`, in its primary IP
    /// configuration's subnet, with `privateIPAllocationMethod: Dynamic`:
    /// Azure gives it "the next available unassigned or unreserved IP
    /// address in the subnet's address range" (Microsoft Learn, "Private IP
    /// addresses", allocation methods), never one the CNI or another NIC
    /// holds. The address is read back once the update completed. If the
    /// call fails after the update was accepted, the IP configuration stays
    /// on the NIC unrecorded: it is not adopted by a later call, since two
    /// of the Node's addresses could then take the same one.
    async fn add_address(&self, nic_id: &str) -> Result<IpAddr, CloudError> {
        parse_nic_id(nic_id)?;
        let nic = self
            .nic(nic_id)
            .await?
            .ok_or_else(|| not_found("NetworkInterfaces_Get", format!("network interface {nic_id} not found")))?;
        let subnet = nic.primary().and_then(|c| c.subnet_id.clone()).ok_or_else(|| {
            not_found(
                "NetworkInterfaces_Get",
                format!("network interface {} has no primary IP configuration in a subnet", nic.id),
            )
        })?;
        let name = nic.free_name(NODE_IPCONFIG_PREFIX);
        let body = nic.edited(|list| {
            list.push(serde_json::json!({"name": name, "properties": {
                "privateIPAllocationMethod": "Dynamic",
                "privateIPAddressVersion": "IPv4",
                "primary": false,
                "subnet": {"id": subnet},
            }}));
        });
        self.put_nic(&nic.id, nic.etag.as_deref(), &body).await?;
        let given = self.nic(&nic.id).await?.and_then(|n| {
            n.ipconfigs.into_iter().find(|c| c.name.eq_ignore_ascii_case(&name)).and_then(|c| c.private_ip)
        });
        given.ok_or_else(|| {
            invalid_response(
                "NetworkInterfaces_Get",
                format!("IP configuration {name} of {} shows no address after its update completed", nic.id),
            )
        })
    }

    // --------------------------------------------------------- assign ---

    async fn assign(
        &self,
        nic_id: &str,
        private: IpAddr,
        public: Option<&PublicAddress>,
        gateways: &BTreeSet<String>,
    ) -> Result<(), CloudError> {
        const OP: &str = "NetworkInterfaces_CreateOrUpdate";
        ipv4_only(OP, private)?;
        parse_nic_id(nic_id)?;
        let ours = self
            .nic(nic_id)
            .await?
            .ok_or_else(|| not_found("NetworkInterfaces_Get", format!("network interface {nic_id} not found")))?;
        let subnet = self.subnet_of(&ours, private).await?;
        let own_group = resource_group_of(&ours.id).unwrap_or_default();
        let (mut nics, _) = self.subnet_nics(&subnet, &[own_group]).await?;
        nics.remove(&ours.id.to_ascii_lowercase());

        // Who holds the public IP now, wherever that is.
        let public_holder = match public {
            Some(p) => {
                let pip: PublicIp =
                    self.get_opt("PublicIPAddresses_Get", &p.allocation_id, NETWORK_API).await?.ok_or_else(|| {
                        not_found("PublicIPAddresses_Get", format!("public IP address {} not found", p.allocation_id))
                    })?;
                match pip.properties.ip_configuration.map(|r| r.id) {
                    Some(ipc) => match split_ipconfig(&ipc) {
                        Some((holder, _)) if same_id(holder, &ours.id) => None,
                        Some((holder, _)) => Some(holder.to_owned()),
                        None => {
                            return Err(CloudError {
                                operation: OP,
                                code: HELD_ELSEWHERE.into(),
                                message: format!(
                                    "public IP address {} is associated with {ipc}, which is not a network interface: dissociate it",
                                    p.allocation_id
                                ),
                                retryable: false,
                            })
                        }
                    },
                    None => None,
                }
            }
            None => None,
        };
        if let Some(holder) = &public_holder {
            if let std::collections::btree_map::Entry::Vacant(slot) = nics.entry(holder.to_ascii_lowercase()) {
                if let Some(n) = self.nic(holder).await? {
                    slot.insert(n);
                }
            }
        }

        // Refuse, before any change, a private address that is not a
        // gateway's to give: on a NIC of no VM or of a VM that is not a
        // gateway Node, or the primary address of any NIC.
        let gateway_vms: BTreeSet<String> =
            gateways.iter().filter_map(|p| parse_provider_id(p).ok()).map(|id| id.to_ascii_lowercase()).collect();
        for nic in nics.values() {
            let Some(ipc) = nic.holding(private) else { continue };
            let owner = match &nic.vm_id {
                Some(vm) if gateway_vms.contains(&vm.to_ascii_lowercase()) && !ipc.primary => continue,
                Some(vm) if gateway_vms.contains(&vm.to_ascii_lowercase()) => {
                    format!("the primary address of gateway VM {vm}")
                }
                Some(vm) => format!("VM {vm}, which is not a gateway Node (nor, for a Node's address, that Node)"),
                None => "no VM".to_owned(),
            };
            return Err(held_elsewhere(private, &nic.id, &ipc.name, &owner));
        }
        if let Some(ipc) = ours.holding(private).filter(|c| c.primary) {
            return Err(held_elsewhere(private, &ours.id, &ipc.name, "this gateway's own primary address"));
        }

        // Take what other NICs hold: one update each, waited for.
        let public_id = public.map(|p| p.allocation_id.as_str());
        for nic in nics.values() {
            let has_private = nic.holding(private).is_some();
            let has_public = public_id.is_some_and(|p| {
                nic.ipconfigs.iter().any(|c| c.public_ip_id.as_deref().is_some_and(|q| same_id(q, p)))
            });
            if !has_private && !has_public {
                continue;
            }
            let body = nic.edited(|list| {
                list.retain(|c| ipconfig_address(c) != Some(private));
                if let Some(p) = public_id {
                    for c in list.iter_mut() {
                        clear_public(c, p);
                    }
                }
            });
            tracing::info!(from = %nic.id, ip = %private, "taking the address from another gateway's network interface");
            self.put_nic(&nic.id, nic.etag.as_deref(), &body).await?;
        }

        // Ours, always (a Get may be stale): the IP configuration holding
        // the address (adopted if it has another name) with the public IP,
        // which no other IP configuration of ours keeps.
        let name = ours.holding(private).map_or_else(|| ipconfig_name(private), |c| c.name.clone());
        let body = ours.edited(|list| {
            list.retain(|c| !json_name(c).eq_ignore_ascii_case(&name));
            if let Some(p) = public_id {
                for c in list.iter_mut() {
                    clear_public(c, p);
                }
            }
            let mut props = serde_json::json!({
                "privateIPAddress": private.to_string(),
                "privateIPAllocationMethod": "Static",
                "privateIPAddressVersion": "IPv4",
                "primary": false,
                "subnet": {"id": subnet.id},
            });
            if let Some(p) = public_id {
                props["publicIPAddress"] = serde_json::json!({"id": p});
            }
            list.push(serde_json::json!({"name": name, "properties": props}));
        });
        self.put_nic(&ours.id, ours.etag.as_deref(), &body).await
    }

    /// The subnet of one of `nic`'s IP configurations that contains `private`.
    async fn subnet_of(&self, nic: &Nic, private: IpAddr) -> Result<Subnet, CloudError> {
        let mut seen = BTreeSet::new();
        for id in nic.ipconfigs.iter().filter_map(|c| c.subnet_id.as_deref()) {
            if !seen.insert(id.to_ascii_lowercase()) {
                continue;
            }
            let subnet = self.subnet(id).await?;
            if subnet.prefix().is_ok_and(|p| p.contains(&private)) {
                return Ok(subnet);
            }
        }
        Err(CloudError {
            operation: "Subnets_Get",
            code: "PrivateIPAddressNotInSubnet".into(),
            message: format!("{private} is in no subnet of network interface {}", nic.id),
            retryable: false,
        })
    }

    /// Network Interfaces - Create Or Update of `body`, conditional on
    /// `etag`, followed until its operation ends.
    async fn put_nic(&self, id: &str, etag: Option<&str>, body: &Value) -> Result<(), CloudError> {
        const OP: &str = "NetworkInterfaces_CreateOrUpdate";
        let mut req = Request::new(self.url(id, NETWORK_API), Method::Put);
        req.insert_header(HeaderName::from_static("content-type"), HeaderValue::from_static("application/json"));
        if let Some(etag) = etag {
            req.insert_header(HeaderName::from_static("if-match"), HeaderValue::from(etag.to_owned()));
        }
        let bytes = serde_json::to_vec(body).map_err(|e| invalid_response(OP, e.to_string()))?;
        req.set_body(bytes);
        let resp = self.send(OP, &mut req).await?;
        let async_op =
            resp.headers().get_optional_str(&HeaderName::from_static("azure-asyncoperation")).map(str::to_owned);
        let Some(link) = async_op else {
            // Without an operation to follow, the answer itself must say done.
            let state: Option<String> = serde_json::from_slice::<Value>(resp.body())
                .ok()
                .and_then(|v| v.pointer("/properties/provisioningState").and_then(Value::as_str).map(str::to_owned));
            return match state.as_deref() {
                Some("Succeeded") => Ok(()),
                other => Err(CloudError {
                    operation: OP,
                    code: "NoOperation".into(),
                    message: format!(
                        "update of {id} answered without Azure-AsyncOperation, provisioningState {other:?}"
                    ),
                    retryable: true,
                }),
            };
        };
        let url = self.follow(OP, &link)?;
        self.wait(id, url, self.poll_wait(resp.headers())).await
    }

    /// How long to wait before the next poll: ARM's `Retry-After`, at least
    /// 1 s and at most [`Bounds::poll_max`].
    fn poll_wait(&self, headers: &Headers) -> Duration {
        let hinted = azure_core::http::policies::get_retry_after(
            headers,
            azure_core::time::OffsetDateTime::now_utc,
            &[RETRY_AFTER],
        )
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or(Duration::from_secs(1));
        hinted.clamp(Duration::from_secs(1).min(self.bounds.poll_max), self.bounds.poll_max)
    }

    /// Polls an operation's `Azure-AsyncOperation` URL (azure_core's
    /// [`Poller`]) until it succeeds, fails or is canceled.
    async fn wait(&self, nic_id: &str, url: Url, first: Duration) -> Result<(), CloudError> {
        const OP: &str = "NetworkInterfaces_CreateOrUpdate (operation)";
        let arm = self.clone();
        let poll_url = url.clone();
        let poller = Poller::<OperationStatus>::new(
            move |state: PollerState, options: PollerOptions<'static>| {
                let arm = arm.clone();
                let url = poll_url.clone();
                Box::pin(async move {
                    if state == PollerState::Initial {
                        tokio::time::sleep(first).await;
                    }
                    let mut req = Request::new(url.clone(), Method::Get);
                    let resp = arm.pipeline.send(&options.context, &mut req, None).await?;
                    let wait = arm.poll_wait(resp.headers());
                    let (status, headers, body) = resp.deconstruct();
                    let monitor: OperationStatus = azure_core::json::from_json(&body)?;
                    let response: Response<OperationStatus> = RawResponse::from_bytes(status, headers, body).into();
                    Ok(match monitor.status {
                        PollerStatus::Succeeded | PollerStatus::Failed | PollerStatus::Canceled => {
                            PollerResult::Done { response }
                        }
                        // InProgress and anything ARM adds: not terminal.
                        _ => PollerResult::InProgress {
                            response,
                            retry_after: azure_core::time::Duration::try_from(wait)
                                .unwrap_or(azure_core::time::Duration::seconds(1)),
                            continuation: PollerContinuation::Links { next_link: url, final_link: None },
                        },
                    })
                })
            },
            None,
        );
        let mut poller = poller;
        let mut last = None;
        while let Some(r) = poller.next().await {
            let r = r.map_err(|e| classify(OP, e))?;
            last = Some(r.into_model().map_err(|e| invalid_response(OP, e.to_string()))?);
        }
        let Some(last) = last else {
            return Err(invalid_response(OP, format!("no status for the update of {nic_id}")));
        };
        match last.status {
            PollerStatus::Succeeded => Ok(()),
            PollerStatus::Canceled => Err(CloudError {
                operation: OP,
                code: "OperationCanceled".into(),
                message: format!("the update of {nic_id} was canceled"),
                retryable: true,
            }),
            _ => {
                let code = last.error.as_ref().and_then(|e| e.code.clone()).unwrap_or_else(|| "OperationFailed".into());
                let message = last.error.as_ref().and_then(|e| e.message.clone()).unwrap_or_default();
                Err(CloudError {
                    operation: OP,
                    // A failed operation says why by its code alone.
                    retryable: is_retryable_code(&code),
                    message: format!("the update of {nic_id} failed: {message}"),
                    code,
                })
            }
        }
    }

    // --------------------------------------------------------- verify ---

    async fn verify(&self, nic_id: &str, private: IpAddr, public: Option<&PublicAddress>) -> Result<bool, CloudError> {
        let Some(nic) = self.nic(nic_id).await? else { return Ok(false) };
        let Some(ipc) = nic.holding(private) else { return Ok(false) };
        Ok(match public {
            Some(p) => ipc.public_ip_id.as_deref().is_some_and(|id| same_id(id, &p.allocation_id)),
            None => true,
        })
    }

    // -------------------------------------------------------- release ---

    async fn release(&self, nic_id: &str, private: IpAddr) -> Result<(), CloudError> {
        const OP: &str = "NetworkInterfaces_CreateOrUpdate";
        ipv4_only(OP, private)?;
        let Some(nic) = self.nic(nic_id).await? else { return Ok(()) };
        let Some(ipc) = nic.holding(private) else { return Ok(()) };
        if ipc.primary {
            return Err(held_elsewhere(
                private,
                &nic.id,
                &ipc.name,
                "this NIC's primary address, which is never released",
            ));
        }
        let body = nic.edited(|list| list.retain(|c| ipconfig_address(c) != Some(private)));
        match self.put_nic(&nic.id, nic.etag.as_deref(), &body).await {
            Ok(()) => Ok(()),
            // ARM refused it because the NIC changed or went (deleted, or the
            // address taken by another gateway): released if it no longer
            // holds the address. After a transport failure nothing is known.
            Err(e) if !TRANSPORT_CODES.contains(&e.code.as_str()) && !self.holds(nic_id, private).await? => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn holds(&self, nic_id: &str, private: IpAddr) -> Result<bool, CloudError> {
        Ok(self.nic(nic_id).await?.is_some_and(|n| n.holding(private).is_some()))
    }
}

/// `nic` of the VM `vm_id` as the trait's [`Interface`].
fn vm_nic(vm_id: String, nic: Nic) -> Result<Interface, CloudError> {
    let Some(primary_ip) = nic.primary().and_then(|c| c.private_ip) else {
        return Err(not_found("NetworkInterfaces_Get", format!("network interface {} has no primary address", nic.id)));
    };
    let secondary_ips = nic.ipconfigs.iter().filter_map(|c| c.private_ip).filter(|ip| *ip != primary_ip).collect();
    Ok(Interface {
        instance_id: vm_id,
        interface_id: nic.id,
        primary_ip,
        secondary_ips,
        source_dest_check: !nic.forwarding,
    })
}

fn ipconfig_address(c: &Value) -> Option<IpAddr> {
    c.pointer("/properties/privateIPAddress").and_then(Value::as_str).and_then(|s| s.parse().ok())
}

fn json_name(c: &Value) -> &str {
    c.get("name").and_then(Value::as_str).unwrap_or_default()
}

/// Removes `public_id` from an IP configuration's JSON if it references it.
fn clear_public(c: &mut Value, public_id: &str) {
    let refs =
        c.pointer("/properties/publicIPAddress/id").and_then(Value::as_str).is_some_and(|id| same_id(id, public_id));
    if refs {
        if let Some(props) = c.get_mut("properties").and_then(Value::as_object_mut) {
            props.remove("publicIPAddress");
        }
    }
}

/// The IP configuration name for `private`: `egret-198-18-1-40`.
pub fn ipconfig_name(private: IpAddr) -> String {
    format!("{IPCONFIG_PREFIX}{}", private.to_string().replace(['.', ':'], "-"))
}

fn held_elsewhere(private: IpAddr, nic: &str, ipconfig: &str, owner: &str) -> CloudError {
    CloudError {
        operation: "NetworkInterfaces_CreateOrUpdate",
        code: HELD_ELSEWHERE.into(),
        message: format!(
            "{private} is held by IP configuration {ipconfig} of network interface {nic} ({owner}); not taking it: free it or pair the public address with another private address"
        ),
        retryable: false,
    }
}

/// Whether `have` carries every tag of `want`: names compared without case
/// (as Azure does), values exactly.
fn has_tags(have: &BTreeMap<String, String>, want: &BTreeMap<String, String>) -> bool {
    want.iter().all(|(k, v)| have.iter().any(|(hk, hv)| hk.eq_ignore_ascii_case(k) && hv == v))
}

// ------------------------------------------------------------ ARM IDs ---

/// Whether two ARM IDs name one resource (ARM compares them without case).
fn same_id(a: &str, b: &str) -> bool {
    a.trim_end_matches('/').eq_ignore_ascii_case(b.trim_end_matches('/'))
}

/// `id`'s segments matched against `pattern`: `Some(word)` is that word
/// (without case), `None` any non-empty name.
fn match_id<'a>(id: &'a str, pattern: &[Option<&str>]) -> Option<Vec<&'a str>> {
    let rest = id.strip_prefix('/')?;
    let parts: Vec<&str> = rest.split('/').collect();
    if parts.len() != pattern.len() {
        return None;
    }
    let mut names = Vec::new();
    for (part, want) in parts.iter().zip(pattern) {
        match want {
            Some(w) if part.eq_ignore_ascii_case(w) => {}
            None if valid_name(part) => names.push(*part),
            _ => return None,
        }
    }
    Some(names)
}

/// An ARM resource name as this provider accepts one in an ID: not empty,
/// and no character that would change a URL's meaning.
fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.()".contains(c))
}

const NIC_PATTERN: [Option<&str>; 8] = [
    Some("subscriptions"),
    None,
    Some("resourceGroups"),
    None,
    Some("providers"),
    Some("Microsoft.Network"),
    Some("networkInterfaces"),
    None,
];

/// A subnet's ARM ID, parsed.
#[derive(Debug, PartialEq, Eq)]
struct SubnetId<'a> {
    subscription: &'a str,
}

fn parse_subnet_id(id: &str) -> Result<SubnetId<'_>, CloudError> {
    let names = match_id(
        id,
        &[
            Some("subscriptions"),
            None,
            Some("resourceGroups"),
            None,
            Some("providers"),
            Some("Microsoft.Network"),
            Some("virtualNetworks"),
            None,
            Some("subnets"),
            None,
        ],
    )
    .ok_or_else(|| CloudError {
        operation: "Subnets_Get",
        code: "InvalidSubnetId".into(),
        message: format!(
            "subnet {id:?} is not /subscriptions/<s>/resourceGroups/<rg>/providers/Microsoft.Network/virtualNetworks/<vnet>/subnets/<subnet>"
        ),
        retryable: false,
    })?;
    Ok(SubnetId { subscription: names[0] })
}

fn parse_nic_id(id: &str) -> Result<(), CloudError> {
    match_id(id, &NIC_PATTERN).map(drop).ok_or_else(|| CloudError {
        operation: "NetworkInterfaces_Get",
        code: "InvalidNetworkInterfaceId".into(),
        message: format!(
            "{id:?} is not /subscriptions/<s>/resourceGroups/<rg>/providers/Microsoft.Network/networkInterfaces/<nic>"
        ),
        retryable: false,
    })
}

/// A NIC IP configuration's ID split into the NIC's ID and the
/// configuration's name; `None` for another kind of IP configuration.
fn split_ipconfig(id: &str) -> Option<(&str, &str)> {
    let (nic, name) = id.trim_end_matches('/').rsplit_once('/')?;
    let (nic, kind) = nic.rsplit_once('/')?;
    (kind.eq_ignore_ascii_case("ipConfigurations") && match_id(nic, &NIC_PATTERN).is_some()).then_some((nic, name))
}

fn nic_of_ipconfig(id: &str) -> Option<&str> {
    split_ipconfig(id).map(|(nic, _)| nic)
}

/// `/subscriptions/<s>/resourceGroups/<rg>` of a resource ID.
fn resource_group_of(id: &str) -> Option<&str> {
    let mut end = 0;
    for (i, part) in id.split('/').enumerate().take(5) {
        end += part.len() + usize::from(i > 0);
    }
    let scope = &id[..end.min(id.len())];
    match_id(scope, &[Some("subscriptions"), None, Some("resourceGroups"), None]).map(|_| scope)
}

/// The resource an ID's last `/<kind>/<name>` belongs to.
fn parent_of(id: &str) -> &str {
    let t = id.trim_end_matches('/');
    t.rsplit_once('/').and_then(|(p, _)| p.rsplit_once('/')).map_or(t, |(p, _)| p)
}

/// The VM's ARM ID in a Node's `spec.providerID`:
/// `azure:///subscriptions/<s>/resourceGroups/<rg>/providers/Microsoft.Compute/virtualMachines/<vm>`,
/// what cloud-provider-azure writes for a standalone VM. A scale-set
/// instance (`.../virtualMachineScaleSets/<ss>/virtualMachines/<n>`) is
/// refused by name: its NICs are updated through the scale set's model, a
/// call this provider does not make.
pub fn parse_provider_id(provider_id: &str) -> Result<String, CloudError> {
    let bad = |why: &str| {
        CloudError {
        operation: "providerID",
        code: "InvalidProviderID".into(),
        message: format!(
            "Node spec.providerID {provider_id:?}: {why} (want azure:///subscriptions/<s>/resourceGroups/<rg>/providers/Microsoft.Compute/virtualMachines/<vm>)"
        ),
        retryable: false,
    }
    };
    let id = provider_id.strip_prefix("azure://").ok_or_else(|| bad("not an Azure provider ID"))?;
    if match_id(
        id,
        &[
            Some("subscriptions"),
            None,
            Some("resourceGroups"),
            None,
            Some("providers"),
            Some("Microsoft.Compute"),
            Some("virtualMachineScaleSets"),
            None,
            Some("virtualMachines"),
            None,
        ],
    )
    .is_some()
    {
        return Err(bad("a virtual machine scale set instance, which this provider does not support yet"));
    }
    match_id(
        id,
        &[
            Some("subscriptions"),
            None,
            Some("resourceGroups"),
            None,
            Some("providers"),
            Some("Microsoft.Compute"),
            Some("virtualMachines"),
            None,
        ],
    )
    .ok_or_else(|| bad("not a virtual machine's resource ID"))?;
    Ok(id.to_owned())
}

// ------------------------------------------------------------- errors ---

/// A classified failure, with ARM's HTTP status when it answered.
#[derive(Debug)]
struct Failure {
    error: CloudError,
    http_status: Option<u16>,
}

impl From<Failure> for CloudError {
    fn from(f: Failure) -> Self {
        f.error
    }
}

/// What a failed call means for the caller: ARM's code and message, and
/// whether trying again may succeed.
fn classify(operation: &'static str, err: azure_core::Error) -> Failure {
    let transport = |code: &str, retryable: bool| Failure {
        error: CloudError { operation, code: code.into(), message: err.to_string(), retryable },
        http_status: None,
    };
    match err.kind() {
        ErrorKind::HttpResponse { status, error_code, raw_response } => {
            let status = u16::from(*status);
            let detail = raw_response
                .as_ref()
                .and_then(|r| serde_json::from_slice::<ErrorResponse>(r.body()).ok())
                .and_then(|r| r.error);
            let code = detail
                .as_ref()
                .and_then(|d| d.code.clone())
                .or_else(|| error_code.clone())
                .unwrap_or_else(|| format!("HTTP {status}"));
            let mut message =
                detail.and_then(|d| d.message).unwrap_or_else(|| format!("HTTP {status} without an ARM error body"));
            if let Some(after) =
                raw_response.as_ref().and_then(|r| r.headers().get_optional_str(&RETRY_AFTER).map(str::to_owned))
            {
                message.push_str(&format!(" (Retry-After: {after})"));
            }
            Failure {
                error: CloudError { operation, retryable: is_retryable(status, &code), code, message },
                http_status: Some(status),
            }
        }
        ErrorKind::Connection => transport("connect", true),
        ErrorKind::Io if err.downcast_ref::<RequestTimeout>().is_some() => transport("timeout", true),
        ErrorKind::Io => transport("io", true),
        // The token could not be had (IMDS or Entra ID down, or a
        // misconfiguration the message names): the backoff retries it.
        ErrorKind::Credential => transport("credential", true),
        // An answer that is not ARM's JSON (a proxy's page, a cut-off body).
        ErrorKind::DataConversion => transport("response", true),
        _ => transport("client", false),
    }
}

impl From<CloudError> for Failure {
    fn from(error: CloudError) -> Self {
        Self { error, http_status: None }
    }
}

/// The codes [`classify`] gives failures that are not ARM's answers.
const TRANSPORT_CODES: &[&str] = &["connect", "timeout", "io", "credential", "response", "client"];

/// Whether an ARM answer (HTTP status and error code) may succeed when
/// repeated: throttling (429), a precondition that failed because the
/// resource changed (412), server errors (5xx), and [`RETRYABLE_CODES`].
pub fn is_retryable(status: u16, code: &str) -> bool {
    status == 429 || status == 412 || status >= 500 || is_retryable_code(code)
}

/// Whether an ARM error code alone says a repeat may succeed ([`RETRYABLE_CODES`]).
pub fn is_retryable_code(code: &str) -> bool {
    RETRYABLE_CODES.iter().any(|c| c.eq_ignore_ascii_case(code))
}

fn config_error(message: String) -> CloudError {
    CloudError { operation: "configuration", code: "InvalidConfiguration".into(), message, retryable: false }
}

fn not_found(operation: &'static str, message: String) -> CloudError {
    CloudError { operation, code: "NotFound".into(), message, retryable: false }
}

fn invalid_response(operation: &'static str, message: String) -> CloudError {
    CloudError { operation, code: "InvalidResponse".into(), message, retryable: true }
}

fn parse_ip(operation: &'static str, s: &str) -> Result<IpAddr, CloudError> {
    s.parse().map_err(|_| CloudError {
        operation,
        code: "InvalidResponse".into(),
        message: format!("unparsable address {s:?}"),
        retryable: false,
    })
}

/// IPv6 IP configurations need `privateIPAddressVersion: IPv6` and an IPv6
/// public IP; not done yet: refused by name before any call.
fn ipv4_only(operation: &'static str, private: IpAddr) -> Result<(), CloudError> {
    if private.is_ipv4() {
        return Ok(());
    }
    Err(CloudError {
        operation,
        code: "Unsupported".into(),
        message: format!("{private}: IPv6 egress addresses are not supported by the Azure provider yet"),
        retryable: false,
    })
}

/// The addresses Azure keeps in every subnet: the network address, the
/// default gateway (+1), two for Azure DNS (+2, +3) and the broadcast
/// address (Virtual Network FAQ, "Are there any restrictions on using IP
/// addresses within these subnets?").
fn reserved(cidr: IpNet) -> BTreeSet<IpAddr> {
    let IpNet::V4(net) = cidr else { return BTreeSet::new() };
    let base = u32::from(net.network());
    let mut out: BTreeSet<IpAddr> =
        (0..4u32).filter_map(|i| base.checked_add(i)).map(|a| IpAddr::V4(Ipv4Addr::from(a))).collect();
    out.insert(IpAddr::V4(net.broadcast()));
    out
}

// ---------------------------------------------------------- transport ---

/// A request that did not finish within [`Bounds::request`].
#[derive(Debug, thiserror::Error)]
#[error("no answer within {0:?}")]
struct RequestTimeout(Duration);

type HyperClient = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    http_body_util::Full<hyper::body::Bytes>,
>;

/// azure_core's [`HttpClient`] on hyper and rustls (ring), each request
/// bounded by [`Bounds::request`].
#[derive(Clone)]
struct HyperTransport {
    client: HyperClient,
    timeout: Duration,
}

impl std::fmt::Debug for HyperTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HyperTransport").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

impl HyperTransport {
    /// Trusting the system's CAs and `extra_ca` (PEM); HTTPS only, or
    /// plain HTTP too (for IMDS).
    fn new(extra_ca: Option<&[u8]>, https_only: bool, bounds: Bounds) -> Result<Self, CloudError> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::CertificateDer;
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        roots.add_parsable_certificates(native.certs);
        if let Some(pem) = extra_ca {
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<_, _>>()
                .map_err(|e| config_error(format!("CA certificates: {e}")))?;
            if certs.is_empty() {
                return Err(config_error("CA certificates: no certificate in the PEM".into()));
            }
            for c in certs {
                roots.add(c).map_err(|e| config_error(format!("CA certificate: {e}")))?;
            }
        }
        if roots.is_empty() {
            return Err(config_error("no CA certificates: none in the system's store, none given".into()));
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| config_error(format!("TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(bounds.connect));
        let builder = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls);
        let connector =
            if https_only { builder.https_only() } else { builder.https_or_http() }.enable_http1().wrap_connector(http);
        let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self { client, timeout: bounds.request })
    }
}

#[async_trait]
impl HttpClient for HyperTransport {
    async fn execute_request(&self, request: &Request) -> azure_core::Result<AsyncRawResponse> {
        let other = |m: String| azure_core::Error::with_message(ErrorKind::Other, m);
        let body = match request.body() {
            Body::Bytes(b) => b.clone(),
            #[allow(unreachable_patterns)]
            _ => return Err(other("a streamed request body (this provider sends none)".into())),
        };
        let method = match request.method() {
            Method::Get => hyper::Method::GET,
            Method::Put => hyper::Method::PUT,
            Method::Post => hyper::Method::POST,
            Method::Delete => hyper::Method::DELETE,
            Method::Patch => hyper::Method::PATCH,
            Method::Head => hyper::Method::HEAD,
            m => return Err(other(format!("HTTP method {m:?}"))),
        };
        let mut builder = hyper::Request::builder().method(method).uri(request.url().as_str());
        for (name, value) in request.headers().iter() {
            builder = builder.header(name.as_str(), value.as_str());
        }
        let req = builder.body(http_body_util::Full::new(body)).map_err(|e| other(format!("request: {e}")))?;
        let exchange = async {
            let resp = self.client.request(req).await.map_err(|e| {
                let kind = if e.is_connect() { ErrorKind::Connection } else { ErrorKind::Io };
                azure_core::Error::new(kind, e)
            })?;
            let (parts, body) = resp.into_parts();
            let bytes = http_body_util::BodyExt::collect(body)
                .await
                .map_err(|e| azure_core::Error::new(ErrorKind::Io, e))?
                .to_bytes();
            Ok::<_, azure_core::Error>((parts, bytes))
        };
        let (parts, bytes) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| azure_core::Error::new(ErrorKind::Io, RequestTimeout(self.timeout)))??;
        let headers: HashMap<HeaderName, HeaderValue> = parts
            .headers
            .iter()
            .filter_map(|(k, v)| {
                v.to_str().ok().map(|v| (HeaderName::from(k.as_str().to_owned()), HeaderValue::from(v.to_owned())))
            })
            .collect();
        Ok(AsyncRawResponse::from_bytes(StatusCode::from(parts.status.as_u16()), Headers::from(headers), bytes))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    const SUB: &str = "00000000-0000-4000-8000-000000000001";

    #[test]
    fn provider_id_forms() {
        let vm = format!("/subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Compute/virtualMachines/gw-a");
        assert_eq!(parse_provider_id(&format!("azure://{vm}")).unwrap(), vm);
        // cloud-provider-azure lower-cases the resource group on some versions.
        let lower = format!(
            "azure:///subscriptions/{SUB}/resourcegroups/mc_egret/providers/microsoft.compute/virtualmachines/gw-b"
        );
        assert!(parse_provider_id(&lower).is_ok());
        for bad in [
            String::new(),
            "aws:///us-east-1a/i-0abc".into(),
            format!("azure://{vm}/extra"),
            format!("azure:///subscriptions/{SUB}/resourceGroups//providers/Microsoft.Compute/virtualMachines/gw"),
            format!("azure:///subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Network/networkInterfaces/n"),
            format!("azure:///subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/0"),
            format!("azure:///subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Compute/virtualMachines/a?b"),
            vm.clone(),
        ] {
            let e = parse_provider_id(&bad).unwrap_err();
            assert!(!e.retryable, "{bad}");
            assert_eq!(e.code, "InvalidProviderID");
            assert!(e.message.contains(&format!("{bad:?}")), "the error names the value: {e}");
        }
        let e = parse_provider_id(&format!(
            "azure:///subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Compute/virtualMachineScaleSets/ss/virtualMachines/0"
        ))
        .unwrap_err();
        assert!(e.message.contains("scale set"), "{e}");
    }

    #[test]
    fn arm_ids() {
        let nic =
            format!("/subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Network/networkInterfaces/nic-a");
        let ipc = format!("{nic}/ipConfigurations/egret-198-18-1-40");
        assert_eq!(split_ipconfig(&ipc), Some((nic.as_str(), "egret-198-18-1-40")));
        assert_eq!(nic_of_ipconfig(&ipc.to_uppercase()).map(str::to_owned), Some(nic.to_uppercase()));
        let lb = format!("/subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Network/loadBalancers/lb/frontendIPConfigurations/fe");
        assert_eq!(split_ipconfig(&lb), None);
        assert!(parent_of(&lb).ends_with("/loadBalancers/lb"));
        assert_eq!(resource_group_of(&nic), Some(format!("/subscriptions/{SUB}/resourceGroups/egret").as_str()));
        assert_eq!(resource_group_of("/subscriptions/x"), None);
        assert!(same_id(&nic, &nic.to_lowercase()));
        let subnet = format!(
            "/subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Network/virtualNetworks/vnet/subnets/gw"
        );
        assert_eq!(parse_subnet_id(&subnet).unwrap().subscription, SUB);
        assert!(!parse_subnet_id("subnet-0abc").unwrap_err().retryable);
        assert!(parse_nic_id(&nic).is_ok() && parse_nic_id("eni-0abc").is_err());
    }

    #[test]
    fn ipconfig_names_and_tags() {
        assert_eq!(ipconfig_name("198.18.1.40".parse().unwrap()), "egret-198-18-1-40");
        let have: BTreeMap<String, String> = [("Egret-Pool", "prod"), ("team", "payments")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let want = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
        };
        assert!(has_tags(&have, &want(&[("egret-pool", "prod")])), "names without case");
        assert!(has_tags(&have, &want(&[("egret-pool", "prod"), ("team", "payments")])));
        assert!(!has_tags(&have, &want(&[("egret-pool", "Prod")])), "values exactly");
        assert!(!has_tags(&have, &want(&[("egret-pool", "prod"), ("cost", "x")])), "ANDed");
    }

    #[test]
    fn node_ipconfig_names_take_the_lowest_free_number() {
        let nic = Nic::parse(serde_json::json!({
            "id": format!("/subscriptions/{SUB}/resourceGroups/egret/providers/Microsoft.Network/networkInterfaces/n"),
            "properties": {"ipConfigurations": [
                {"name": "EGRET-NODE-1", "properties": {"privateIPAddress": "198.18.2.5"}},
                {"name": "ipconfig1", "properties": {"primary": true, "privateIPAddress": "198.18.2.4"}},
                {"name": "egret-node-3", "properties": {}},
            ]},
        }))
        .unwrap();
        assert_eq!(nic.free_name(NODE_IPCONFIG_PREFIX), "egret-node-2", "names compare without case");
        assert_eq!(nic.primary().map(|c| c.name.as_str()), Some("ipconfig1"));
    }

    fn http_error(status: u16, body: &str, retry_after: Option<&str>) -> azure_core::Error {
        let mut headers = Headers::new();
        if let Some(a) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(a.to_owned()));
        }
        let raw = RawResponse::from_bytes(StatusCode::from(status), headers, body.as_bytes().to_vec());
        ErrorKind::HttpResponse {
            status: StatusCode::from(status),
            error_code: None,
            raw_response: Some(Box::new(raw)),
        }
        .into_error()
    }

    #[test]
    fn arm_errors_are_classified() {
        for (status, code, retryable) in [
            (429, "SubscriptionRequestsThrottled", true),
            (429, "RetryableErrorDueToAnotherOperation", true),
            (409, "AnotherOperationInProgress", true),
            (412, "PreconditionFailed", true),
            (500, "InternalServerError", true),
            (503, "ServiceUnavailable", true),
            (400, "PrivateIPAddressIsAllocated", true),
            (401, "InvalidAuthenticationToken", false),
            (403, "AuthorizationFailed", false),
            (404, "ResourceNotFound", false),
            (400, "InvalidRequestFormat", false),
            (409, "Conflict", false),
        ] {
            let body = format!(r#"{{"error": {{"code": "{code}", "message": "{code} says no"}}}}"#);
            let f = classify("NetworkInterfaces_Get", http_error(status, &body, Some("7")));
            assert_eq!((f.error.code.as_str(), f.error.retryable, f.http_status), (code, retryable, Some(status)));
            assert_eq!(f.error.operation, "NetworkInterfaces_Get");
            assert!(f.error.message.starts_with(&format!("{code} says no")), "{:?}", f.error);
            assert!(f.error.message.contains("Retry-After: 7"), "{:?}", f.error);
        }
        // No ARM body: the status stands for the code.
        let f = classify("Subnets_Get", http_error(502, "<html>bad gateway</html>", None));
        assert_eq!((f.error.code.as_str(), f.error.retryable), ("HTTP 502", true));
    }

    #[test]
    fn transport_failures_are_retryable() {
        let timeout = azure_core::Error::new(ErrorKind::Io, RequestTimeout(Duration::from_secs(10)));
        let f = classify("Subnets_Get", timeout);
        assert_eq!((f.error.code.as_str(), f.error.retryable), ("timeout", true));
        let refused = azure_core::Error::new(ErrorKind::Connection, std::io::Error::other("connection refused"));
        assert_eq!(classify("Subnets_Get", refused).error.code, "connect");
        let plain = azure_core::Error::with_message(ErrorKind::Other, "not https");
        assert!(!classify("Subnets_Get", plain).error.retryable);
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

    #[test]
    fn a_plain_http_endpoint_is_refused() {
        #[derive(Debug)]
        struct NoToken;
        #[async_trait]
        impl TokenCredential for NoToken {
            async fn get_token(
                &self,
                _: &[&str],
                _: Option<azure_core::credentials::TokenRequestOptions<'_>>,
            ) -> azure_core::Result<azure_core::credentials::AccessToken> {
                Err(azure_core::Error::with_message(ErrorKind::Credential, "none"))
            }
        }
        let e = AzureCloud::new(Arc::new(NoToken), "http://127.0.0.1:9", None, Bounds::default()).unwrap_err();
        assert_eq!((e.code.as_str(), e.retryable), ("InvalidConfiguration", false), "{e}");
    }
}
