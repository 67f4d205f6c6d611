//! A scripted provider for the cloud task's unit tests: every call is
//! logged, and failures and drift are set by the test. The providers
//! themselves are tested against moto and the emulators
//! (tests/tests/cloud_*.rs).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use futures::future::BoxFuture;
use ipnet::IpNet;
use parking_lot::Mutex;

use super::task::Factory;
use super::{Cloud, CloudError, Discovered, Interface, PoolSelector, PublicAddress};

#[derive(Default)]
pub struct Script {
    /// Assign calls fail while this is above 0 (counting down).
    pub assign_failures: u32,
    /// Assign calls fail for good (not retryable).
    pub assign_refused: bool,
    /// Verify calls answer "not there" while this is above 0.
    pub drifts: u32,
    /// Private addresses someone else holds: assigning them is refused
    /// ([`super::HELD_ELSEWHERE`]).
    pub held_elsewhere: BTreeSet<IpAddr>,
    /// Addresses added so far ([`Cloud::add_address`] gives 198.18.1.100 up).
    pub added: u8,
    /// Every call, in order.
    pub calls: Vec<String>,
}

pub struct Scripted(Arc<Mutex<Script>>);

fn err(op: &'static str) -> CloudError {
    CloudError { operation: op, code: "RequestLimitExceeded".into(), message: "slow down".into(), retryable: true }
}

impl Cloud for Scripted {
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn discover<'a>(&'a self, pool: &'a PoolSelector) -> BoxFuture<'a, Result<Discovered, CloudError>> {
        self.0.lock().calls.push(format!("discover {}", pool.subnet_id));
        Box::pin(async {
            Ok(Discovered {
                public: vec![],
                subnet_cidr: "198.18.1.0/24".parse::<IpNet>().unwrap(),
                used: BTreeSet::new(),
            })
        })
    }
    fn interface<'a>(&'a self, provider_id: &'a str, subnet: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        self.0.lock().calls.push(format!("interface {provider_id} {subnet}"));
        Box::pin(async {
            Ok(Interface {
                instance_id: "i-1".into(),
                interface_id: "eni-1".into(),
                primary_ip: "198.18.1.4".parse().unwrap(),
                secondary_ips: BTreeSet::new(),
                source_dest_check: false,
            })
        })
    }
    fn primary_interface<'a>(&'a self, provider_id: &'a str) -> BoxFuture<'a, Result<Interface, CloudError>> {
        self.0.lock().calls.push(format!("primary_interface {provider_id}"));
        let instance = provider_id.rsplit('/').next().unwrap_or_default().to_string();
        Box::pin(async move {
            Ok(Interface {
                interface_id: format!("eni-{instance}"),
                instance_id: instance,
                primary_ip: "198.18.1.5".parse().unwrap(),
                secondary_ips: BTreeSet::new(),
                source_dest_check: true,
            })
        })
    }
    fn add_address<'a>(&'a self, i: &'a str) -> BoxFuture<'a, Result<IpAddr, CloudError>> {
        let mut s = self.0.lock();
        s.added += 1;
        let ip = IpAddr::from([198, 18, 1, 99 + s.added]);
        s.calls.push(format!("add_address {i} {ip}"));
        Box::pin(async move { Ok(ip) })
    }
    fn assign<'a>(
        &'a self,
        i: &'a str,
        p: IpAddr,
        _: Option<&'a PublicAddress>,
        gateways: &'a BTreeSet<String>,
    ) -> BoxFuture<'a, Result<(), CloudError>> {
        let mut s = self.0.lock();
        s.calls.push(format!("assign {i} {p} {gateways:?}"));
        let fail = s.assign_failures > 0;
        s.assign_failures = s.assign_failures.saturating_sub(1);
        let refused = s.assign_refused;
        let held = s.held_elsewhere.contains(&p);
        Box::pin(async move {
            if held {
                Err(CloudError {
                    operation: "AssignPrivateIpAddresses",
                    code: super::HELD_ELSEWHERE.into(),
                    message: format!("{p} is someone else's"),
                    retryable: false,
                })
            } else if refused {
                Err(CloudError {
                    operation: "AssignPrivateIpAddresses",
                    code: "UnauthorizedOperation".into(),
                    message: "not allowed".into(),
                    retryable: false,
                })
            } else if fail {
                Err(err("AssignPrivateIpAddresses"))
            } else {
                Ok(())
            }
        })
    }
    fn verify<'a>(
        &'a self,
        i: &'a str,
        p: IpAddr,
        _: Option<&'a PublicAddress>,
    ) -> BoxFuture<'a, Result<bool, CloudError>> {
        let mut s = self.0.lock();
        s.calls.push(format!("verify {i} {p}"));
        let there = s.drifts == 0;
        s.drifts = s.drifts.saturating_sub(1);
        Box::pin(async move { Ok(there) })
    }
    fn release<'a>(&'a self, i: &'a str, p: IpAddr) -> BoxFuture<'a, Result<(), CloudError>> {
        self.0.lock().calls.push(format!("release {i} {p}"));
        Box::pin(async { Ok(()) })
    }
}

/// A factory that makes the scripted provider, whatever is asked for.
pub fn scripted(script: &Arc<Mutex<Script>>) -> Factory {
    let script = script.clone();
    Box::new(move |_| {
        let s = script.clone();
        Box::pin(async move { Arc::new(Scripted(s)) as Arc<dyn Cloud> })
    })
}
