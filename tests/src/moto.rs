//! A real EC2 API emulator (getmoto/moto's server) on 127.0.0.1 for the AWS
//! provider's tests, and helpers that seed it with a VPC, instances, ENIs and
//! Elastic IPs through the official SDK.
//!
//! The server is started and stopped by `tests/moto/moto.sh` (installed by
//! `tests/moto/install.sh`, cached outside the clone); each [`Moto`] is one
//! server with its own state directory, so parallel tests do not share EC2
//! state. A watcher started by the script stops the server if the test
//! process dies without dropping the handle.
//!
//! What moto does differently from AWS is listed in docs/kubernetes.md
//! ("Running on AWS"); the tests that meet a difference say so beside it.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use aws_sdk_ec2::config::{BehaviorVersion, Credentials, Region};
use aws_sdk_ec2::types::{ResourceType, Tag, TagSpecification};

use crate::requirement::{self, Requirement, Unavailable};
use crate::script::{Script, ScriptError};

/// Path of the script that runs the server.
pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/moto/moto.sh");

/// The script and its protocol ([`crate::script`]).
const SERVER: Script = Script {
    path: SCRIPT,
    state_env: "EGRET_MOTO_STATE",
    owner_env: "EGRET_MOTO_OWNER_PID",
    state_prefix: "egret-moto",
};

/// Set to `1`: moto missing fails the test instead of skipping it (CI sets it).
pub const REQUIRE_ENV: &str = "EGRET_REQUIRE_MOTO";

/// What the moto tests need ([`crate::requirement`]'s rule).
pub const NEEDS: Requirement = Requirement { what: "moto", require_env: REQUIRE_ENV };

/// The region the tests' resources live in.
pub const REGION: &str = "us-east-1";

/// The seeded VPC and subnet (RFC 2544's benchmarking range, 198.18.0.0/15).
pub const VPC_CIDR: &str = "198.18.0.0/16";
pub const SUBNET_CIDR: &str = "198.18.1.0/24";
/// A second subnet, for an instance with no interface in the first one.
pub const OTHER_SUBNET_CIDR: &str = "198.18.2.0/24";

/// What went wrong while running moto or talking to it.
#[derive(Debug, thiserror::Error)]
pub enum MotoError {
    /// The script could not be run, or failed.
    #[error(transparent)]
    Script(#[from] ScriptError),
    /// `start` succeeded but printed no endpoint.
    #[error("{SCRIPT} start printed no endpoint URL (stdout {stdout:?})")]
    NoEndpoint { stdout: String },
    /// moto's own API (`/moto-api/reset`) failed.
    #[error("moto at {endpoint}: {what}")]
    Api { endpoint: String, what: String },
    /// A seeding call to the EC2 API failed.
    #[error("seeding moto: {call}: {message}")]
    Seed { call: &'static str, message: String },
}

/// Result of this module's operations.
pub type Result<T, E = MotoError> = std::result::Result<T, E>;

/// One running moto server, stopped on drop.
#[derive(Debug)]
pub struct Moto {
    endpoint: String,
    addr: SocketAddr,
    state: Option<PathBuf>,
}

impl Moto {
    /// Whether moto is installed (`moto.sh check`).
    pub fn availability() -> std::result::Result<(), Unavailable> {
        requirement::script_check(SCRIPT)
    }

    /// `Ok(true)` when the test may go on, `Ok(false)` (after printing why)
    /// when it should return early as skipped, `Err` when [`REQUIRE_ENV`] is
    /// `1` and moto is not installed.
    pub fn available_or_skip(test: &str) -> std::result::Result<bool, Unavailable> {
        NEEDS.available_or_skip(test, Self::availability())
    }

    /// Starts a fresh server on a free port of 127.0.0.1 and waits until it
    /// answers (about a second).
    pub fn start() -> Result<Self> {
        Self::start_with(&[])
    }

    /// Starts a fresh server inside network namespace `ns`, listening on
    /// `address` (an address of that namespace): the cloud lab runs it in
    /// its control namespace, where its gateways reach it.
    pub fn start_in(ns: &crate::netns::NetNs, address: std::net::IpAddr) -> Result<Self> {
        Self::start_with(&[("EGRET_MOTO_NETNS", ns.name().to_string()), ("EGRET_MOTO_ADDRESS", address.to_string())])
    }

    /// Starts a fresh server on 127.0.0.1 that speaks only HTTPS, with the
    /// certificate chain [`TestCa::write_server`] wrote into `dir` (its
    /// endpoint is `https://127.0.0.1:PORT`; [`client_for_tls`] trusts it).
    pub fn start_tls(dir: &Path) -> Result<Self> {
        Self::start_with(&[("EGRET_MOTO_TLS_DIR", dir.display().to_string())])
    }

    fn start_with(env: &[(&str, String)]) -> Result<Self> {
        let state = SERVER.fresh_state_dir();
        let out = match run_script_with("start", &state, env) {
            Ok(out) => out,
            Err(e) => {
                let _ = run_script("stop", &state);
                return Err(e);
            }
        };
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let parsed = stdout.lines().rev().find_map(|l| {
            let l = l.trim();
            let hostport = l.strip_prefix("http://").or_else(|| l.strip_prefix("https://"))?;
            Some((l.to_owned(), hostport.parse::<SocketAddr>().ok()?))
        });
        let Some((endpoint, addr)) = parsed else {
            let _ = run_script("stop", &state);
            return Err(MotoError::NoEndpoint { stdout });
        };
        Ok(Self { endpoint, addr, state: Some(state) })
    }

    /// The server's URL (`http://127.0.0.1:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The state directory (every process of this server names it).
    pub fn state_dir(&self) -> Option<&Path> {
        self.state.as_deref()
    }

    /// Forgets every resource (moto's `POST /moto-api/reset`).
    pub fn reset(&self) -> Result<()> {
        let api = |what: String| MotoError::Api { endpoint: self.endpoint.clone(), what };
        let mut s = TcpStream::connect_timeout(&self.addr, Duration::from_secs(5)).map_err(|e| api(e.to_string()))?;
        s.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| api(e.to_string()))?;
        let req = format!(
            "POST /moto-api/reset HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.addr
        );
        s.write_all(req.as_bytes()).map_err(|e| api(e.to_string()))?;
        let mut resp = String::new();
        s.read_to_string(&mut resp).map_err(|e| api(e.to_string()))?;
        match resp.lines().next() {
            Some(l) if l.split_whitespace().nth(1) == Some("200") => Ok(()),
            l => Err(api(format!("reset answered {l:?}"))),
        }
    }

    /// An SDK configuration for `endpoint` (this server, or a proxy in front
    /// of it) with moto's dummy credentials.
    pub fn sdk_config(endpoint: &str) -> aws_sdk_ec2::Config {
        aws_sdk_ec2::Config::builder()
            .behavior_version(BehaviorVersion::latest())
            .region(Region::new(REGION))
            .endpoint_url(endpoint)
            .credentials_provider(Credentials::new("testing", "testing", None, None, "egret-tests"))
            .build()
    }

    /// A plain SDK client for seeding and checking (the SDK's default
    /// retries and timeouts; no fault proxy).
    pub fn client(&self) -> aws_sdk_ec2::Client {
        client_for(&self.endpoint)
    }

    /// What a gateway process needs in its environment to use this server
    /// through the SDK's standard chain (endpoint, dummy credentials, region).
    pub fn gateway_env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ENDPOINT_URL_EC2", self.endpoint.as_str()),
            ("AWS_ACCESS_KEY_ID", "testing"),
            ("AWS_SECRET_ACCESS_KEY", "testing"),
            ("AWS_REGION", REGION),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    /// Stops the server and removes its state.
    pub fn stop(mut self) -> Result<()> {
        match self.state.take() {
            Some(state) => run_script("stop", &state).map(drop),
            None => Ok(()),
        }
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        if let Some(state) = self.state.take() {
            if let Err(e) = run_script("stop", &state) {
                eprintln!("Moto drop: {e}");
            }
        }
    }
}

/// [`Moto::client`] for a server known by its endpoint (another thread's).
pub fn client_for(endpoint: &str) -> aws_sdk_ec2::Client {
    let conf = Moto::sdk_config(endpoint).to_builder().http_client(http_client()).build();
    aws_sdk_ec2::Client::from_conf(conf)
}

/// [`client_for`] over HTTPS, trusting only the PEM certificate `ca` (a
/// server started by [`Moto::start_tls`]).
pub fn client_for_tls(endpoint: &str, ca: &[u8]) -> Result<aws_sdk_ec2::Client> {
    use aws_smithy_http_client::tls;
    let trust = tls::TrustStore::empty().with_native_roots(false).with_pem_certificate(ca.to_vec());
    let context = tls::TlsContext::builder().with_trust_store(trust).build().map_err(|e| MotoError::Api {
        endpoint: endpoint.to_owned(),
        what: format!("a TLS context trusting the test CA: {e}"),
    })?;
    let client = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
        .tls_context(context)
        .build_https();
    Ok(aws_sdk_ec2::Client::from_conf(Moto::sdk_config(endpoint).to_builder().http_client(client).build()))
}

/// A certificate authority made for one test with `openssl`: `ca.pem` and
/// `ca.key` in its directory, and a server certificate for 127.0.0.1
/// signed by it (`server.pem`, `server.key`: what [`Moto::start_tls`] serves).
#[derive(Debug)]
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    /// Makes the CA and the server certificate in `dir` (created).
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        Self::create_for(dir, &[IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)])
    }

    /// [`TestCa::create`] with a server certificate for `addresses` (a
    /// server listening in a lab's namespace).
    pub fn create_for(dir: &Path, addresses: &[IpAddr]) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let openssl = |args: &[&str]| -> std::io::Result<()> {
            let openssl = crate::tools::require("openssl").map_err(std::io::Error::other)?;
            let out = Command::new(openssl).args(args).current_dir(dir).output()?;
            if out.status.success() {
                Ok(())
            } else {
                Err(std::io::Error::other(format!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                )))
            }
        };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend(["-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=Egret test CA"]);
        ca.extend(["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"]);
        openssl(&ca)?;
        let mut req = vec!["req"];
        req.extend(ec);
        req.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=moto"]);
        openssl(&req)?;
        let names: Vec<String> = addresses.iter().map(|a| format!("IP:{a}")).collect();
        std::fs::write(
            dir.join("server.ext"),
            format!("subjectAltName={}\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n", names.join(",")),
        )?;
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-out",
            "server.pem",
            "-extfile",
            "server.ext",
        ])?;
        Ok(Self { dir: dir.to_path_buf() })
    }

    /// The directory ([`Moto::start_tls`] takes it).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The CA's certificate (PEM).
    pub fn ca_pem(&self) -> std::io::Result<Vec<u8>> {
        std::fs::read(self.dir.join("ca.pem"))
    }
}

fn http_client() -> aws_sdk_ec2::config::SharedHttpClient {
    use aws_smithy_http_client::tls;
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring))
        .build_https()
}

fn run_script(command: &'static str, state: &Path) -> Result<Output> {
    run_script_with(command, state, &[])
}

fn run_script_with(command: &'static str, state: &Path, env: &[(&str, String)]) -> Result<Output> {
    Ok(SERVER.run(command, state, env.iter().map(|(k, v)| (*k, v)))?)
}

// ------------------------------------------------------------- seeding ---

/// The seeded VPC: one subnet the gateways are in, one they are not.
#[derive(Clone, Debug)]
pub struct Network {
    pub vpc_id: String,
    pub subnet_id: String,
    pub other_subnet_id: String,
    /// The subnets' availability zone.
    pub zone: String,
    /// An image moto knows, for RunInstances.
    pub image_id: String,
}

/// A seeded instance and its primary ENI.
#[derive(Clone, Debug)]
pub struct Instance {
    pub instance_id: String,
    /// What the AWS cloud provider writes into the Node: `aws:///<zone>/<id>`.
    pub provider_id: String,
    pub eni_id: String,
    pub primary_ip: IpAddr,
}

/// A seeded Elastic IP.
#[derive(Clone, Debug)]
pub struct Eip {
    pub allocation_id: String,
    pub public_ip: IpAddr,
}

fn seed_err<E: std::error::Error + 'static>(
    call: &'static str,
) -> impl Fn(aws_sdk_ec2::error::SdkError<E>) -> MotoError {
    move |e| MotoError::Seed { call, message: aws_sdk_ec2::error::DisplayErrorContext(&e).to_string() }
}

fn missing(call: &'static str, what: &str) -> MotoError {
    MotoError::Seed { call, message: format!("the answer has no {what}") }
}

/// Creates the VPC ([`VPC_CIDR`]) and its subnets ([`SUBNET_CIDR`],
/// [`OTHER_SUBNET_CIDR`]) in one zone.
pub async fn create_network(ec2: &aws_sdk_ec2::Client) -> Result<Network> {
    let vpc = ec2.create_vpc().cidr_block(VPC_CIDR).send().await.map_err(seed_err("CreateVpc"))?;
    let vpc_id = vpc.vpc().and_then(|v| v.vpc_id()).ok_or_else(|| missing("CreateVpc", "VpcId"))?.to_owned();
    let zone = format!("{REGION}a");
    let mut subnets = Vec::new();
    for cidr in [SUBNET_CIDR, OTHER_SUBNET_CIDR] {
        let s = ec2
            .create_subnet()
            .vpc_id(&vpc_id)
            .cidr_block(cidr)
            .availability_zone(&zone)
            .send()
            .await
            .map_err(seed_err("CreateSubnet"))?;
        subnets.push(
            s.subnet().and_then(|s| s.subnet_id()).ok_or_else(|| missing("CreateSubnet", "SubnetId"))?.to_owned(),
        );
    }
    let images = ec2.describe_images().send().await.map_err(seed_err("DescribeImages"))?;
    let image_id =
        images.images().iter().find_map(|i| i.image_id()).ok_or_else(|| missing("DescribeImages", "image"))?;
    let other_subnet_id = subnets.pop().ok_or_else(|| missing("CreateSubnet", "SubnetId"))?;
    let subnet_id = subnets.pop().ok_or_else(|| missing("CreateSubnet", "SubnetId"))?;
    Ok(Network { vpc_id, subnet_id, other_subnet_id, zone, image_id: image_id.to_owned() })
}

/// Runs an instance whose primary ENI is in `subnet_id`, with the ENI's
/// source/destination check set to `source_dest_check`.
pub async fn run_instance(
    ec2: &aws_sdk_ec2::Client,
    net: &Network,
    subnet_id: &str,
    source_dest_check: bool,
) -> Result<Instance> {
    let out = ec2
        .run_instances()
        .image_id(&net.image_id)
        .min_count(1)
        .max_count(1)
        .subnet_id(subnet_id)
        .send()
        .await
        .map_err(seed_err("RunInstances"))?;
    let inst = out.instances().first().ok_or_else(|| missing("RunInstances", "instance"))?;
    let instance_id = inst.instance_id().ok_or_else(|| missing("RunInstances", "InstanceId"))?.to_owned();
    let eni = inst.network_interfaces().first().ok_or_else(|| missing("RunInstances", "network interface"))?;
    let eni_id = eni.network_interface_id().ok_or_else(|| missing("RunInstances", "NetworkInterfaceId"))?.to_owned();
    let primary = eni.private_ip_address().ok_or_else(|| missing("RunInstances", "PrivateIpAddress"))?;
    let primary_ip = primary.parse().map_err(|_| missing("RunInstances", "parsable PrivateIpAddress"))?;
    ec2.modify_network_interface_attribute()
        .network_interface_id(&eni_id)
        .source_dest_check(aws_sdk_ec2::types::AttributeBooleanValue::builder().value(source_dest_check).build())
        .send()
        .await
        .map_err(seed_err("ModifyNetworkInterfaceAttribute"))?;
    let zone = inst.placement().and_then(|p| p.availability_zone()).unwrap_or(&net.zone);
    Ok(Instance { provider_id: format!("aws:///{zone}/{instance_id}"), instance_id, eni_id, primary_ip })
}

/// Adds `ip` as a secondary private address of `eni_id`.
pub async fn add_secondary(ec2: &aws_sdk_ec2::Client, eni_id: &str, ip: IpAddr) -> Result<()> {
    ec2.assign_private_ip_addresses()
        .network_interface_id(eni_id)
        .private_ip_addresses(ip.to_string())
        .send()
        .await
        .map_err(seed_err("AssignPrivateIpAddresses"))
        .map(drop)
}

/// Associates the IPv6 block `cidr` with `subnet_id` (moto does not check
/// it against the VPC's: tests use the documentation prefix, 2001:db8::/32).
pub async fn add_subnet_ipv6(ec2: &aws_sdk_ec2::Client, subnet_id: &str, cidr: &str) -> Result<()> {
    ec2.associate_subnet_cidr_block()
        .subnet_id(subnet_id)
        .ipv6_cidr_block(cidr)
        .send()
        .await
        .map_err(seed_err("AssociateSubnetCidrBlock"))
        .map(drop)
}

/// Adds `ip` as an IPv6 address of `eni_id`.
pub async fn add_ipv6(ec2: &aws_sdk_ec2::Client, eni_id: &str, ip: IpAddr) -> Result<()> {
    ec2.assign_ipv6_addresses()
        .network_interface_id(eni_id)
        .ipv6_addresses(ip.to_string())
        .send()
        .await
        .map_err(seed_err("AssignIpv6Addresses"))
        .map(drop)
}

/// Allocates an Elastic IP carrying `tags`.
pub async fn allocate_eip(ec2: &aws_sdk_ec2::Client, tags: &[(&str, &str)]) -> Result<Eip> {
    let mut req = ec2.allocate_address().domain(aws_sdk_ec2::types::DomainType::Vpc);
    if !tags.is_empty() {
        let mut spec = TagSpecification::builder().resource_type(ResourceType::ElasticIp);
        for (k, v) in tags {
            spec = spec.tags(Tag::builder().key(*k).value(*v).build());
        }
        req = req.tag_specifications(spec.build());
    }
    let out = req.send().await.map_err(seed_err("AllocateAddress"))?;
    let allocation_id = out.allocation_id().ok_or_else(|| missing("AllocateAddress", "AllocationId"))?.to_owned();
    let public = out.public_ip().ok_or_else(|| missing("AllocateAddress", "PublicIp"))?;
    let public_ip = public.parse().map_err(|_| missing("AllocateAddress", "parsable PublicIp"))?;
    // moto < 5 ignored TagSpecifications on AllocateAddress; tag explicitly
    // so that the seeding does not depend on it.
    if !tags.is_empty() {
        set_tags(ec2, &allocation_id, tags).await?;
    }
    Ok(Eip { allocation_id, public_ip })
}

/// Sets `tags` on `resource` (overwriting the values of those keys).
pub async fn set_tags(ec2: &aws_sdk_ec2::Client, resource: &str, tags: &[(&str, &str)]) -> Result<()> {
    let mut req = ec2.create_tags().resources(resource);
    for (k, v) in tags {
        req = req.tags(Tag::builder().key(*k).value(*v).build());
    }
    req.send().await.map_err(seed_err("CreateTags")).map(drop)
}

/// Where an Elastic IP is associated now: `(interface, private address)`.
pub async fn association(ec2: &aws_sdk_ec2::Client, allocation_id: &str) -> Result<Option<(String, String)>> {
    let out =
        ec2.describe_addresses().allocation_ids(allocation_id).send().await.map_err(seed_err("DescribeAddresses"))?;
    let a = out.addresses().first().ok_or_else(|| missing("DescribeAddresses", allocation_id))?;
    // moto sends an unassociated address's fields empty; AWS leaves them out.
    Ok(a.network_interface_id()
        .filter(|eni| !eni.is_empty())
        .map(|eni| (eni.to_owned(), a.private_ip_address().unwrap_or_default().to_owned())))
}

/// Every private address of an ENI (primary first).
pub async fn eni_addresses(ec2: &aws_sdk_ec2::Client, eni_id: &str) -> Result<Vec<IpAddr>> {
    let out = ec2
        .describe_network_interfaces()
        .network_interface_ids(eni_id)
        .send()
        .await
        .map_err(seed_err("DescribeNetworkInterfaces"))?;
    let eni = out.network_interfaces().first().ok_or_else(|| missing("DescribeNetworkInterfaces", eni_id))?;
    Ok(eni.private_ip_addresses().iter().filter_map(|p| p.private_ip_address()?.parse().ok()).collect())
}
