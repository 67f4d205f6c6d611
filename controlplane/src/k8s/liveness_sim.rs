//! A simulation of liveness-Lease ownership (ADR 0016) against an API
//! server with optimistic concurrency: three gateways' [`LeaseManager`]s,
//! requests that take a while to apply and to answer (some answers lost),
//! watches that lag by up to several seconds, and gateways frozen for up to
//! twice leaseDuration. At every 10 ms step no egress IP may be valid in two
//! gateways' data planes at once (each IP's deadline, which the data plane
//! enforces by itself), and once the freezes end every IP is served.
//! Deterministic: each seed is one run.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::net::IpAddr;
use std::time::Duration;

use tokio::time::Instant;

use super::desired::rank_gateways;
use super::lease::{lease_name, Action, Failure, LeaseManager, LeaseRecord, LeaseTiming};
use super::liveness::{liveness_lease_name, LivenessAction};

const NAMES: [&str; 3] = ["gw-a", "gw-b", "gw-c"];
const STEP: Duration = Duration::from_millis(10);

/// xorshift64*: deterministic per seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
    fn chance(&mut self, per_million: u64) -> bool {
        self.next() % 1_000_000 < per_million
    }
}

/// One write, as the API server applies it.
#[derive(Clone, Debug)]
enum Write {
    Ip { ip: IpAddr, action: Action, epoch: Option<u64> },
    Own(LivenessAction),
}

#[derive(Debug)]
struct Pending {
    gw: usize,
    write: Write,
    sent: Instant,
    apply_at: Instant,
    answer_at: Instant,
    /// The API server's answer once applied (None before).
    result: Option<Result<Option<LeaseRecord>, Failure>>,
    fresh: Option<LeaseRecord>,
    /// The client gives up or loses the answer: it sees this failure.
    lost: bool,
    applied: bool,
    answered: bool,
}

/// The API server: objects by name, one resourceVersion counter, each
/// change queued to every watcher with its own lag.
#[derive(Default)]
struct Api {
    objects: BTreeMap<String, LeaseRecord>,
    rv: u64,
    writes: u64,
}

impl Api {
    fn apply(&mut self, gw: usize, w: &Write) -> (String, Result<Option<LeaseRecord>, Failure>) {
        let me = NAMES[gw].to_string();
        let (name, precondition, new): (String, Option<String>, Option<LeaseRecord>) = match w {
            Write::Ip { ip, action, epoch } => {
                let name = lease_name(*ip);
                let rec = |holder: Option<String>| LeaseRecord { holder, epoch: *epoch, ..Default::default() };
                match action {
                    Action::Create => (name, None, Some(rec(Some(me)))),
                    Action::Acquire { resource_version, .. } | Action::Renew { resource_version } => {
                        (name, Some(resource_version.clone()), Some(rec(Some(me))))
                    }
                    Action::Release { resource_version } => (name, Some(resource_version.clone()), Some(rec(None))),
                    Action::Delete { resource_version } => (name, Some(resource_version.clone()), None),
                    Action::Expire(la) => return self.apply_liveness(&me, la),
                }
            }
            Write::Own(la) => return self.apply_liveness(&me, la),
        };
        self.commit(name, precondition, new)
    }

    fn apply_liveness(&mut self, me: &str, la: &LivenessAction) -> (String, Result<Option<LeaseRecord>, Failure>) {
        let d = LeaseTiming::default().lease_duration;
        let own = |epoch: u64| LeaseRecord {
            holder: Some(me.to_string()),
            epoch: Some(epoch),
            duration: d,
            ..Default::default()
        };
        match la {
            LivenessAction::Create { epoch } => self.commit(liveness_lease_name(me), None, Some(own(*epoch))),
            LivenessAction::Acquire { resource_version, epoch, .. } => {
                self.commit(liveness_lease_name(me), Some(resource_version.clone()), Some(own(*epoch)))
            }
            LivenessAction::Renew { resource_version } => {
                let name = liveness_lease_name(me);
                let epoch = self.objects.get(&name).and_then(|r| r.epoch).unwrap_or_default();
                self.commit(name, Some(resource_version.clone()), Some(own(epoch)))
            }
            LivenessAction::Expire { holder, resource_version, .. } => {
                let name = liveness_lease_name(holder);
                let mut r = self.objects.get(&name).cloned().unwrap_or_default();
                r.holder = None;
                self.commit(name, Some(resource_version.clone()), Some(r))
            }
        }
    }

    fn commit(
        &mut self,
        name: String,
        precondition: Option<String>,
        new: Option<LeaseRecord>,
    ) -> (String, Result<Option<LeaseRecord>, Failure>) {
        let current = self.objects.get(&name);
        let result = match (precondition, current) {
            (None, Some(_)) => Err(Failure::Conflict),
            (Some(_), None) => Err(Failure::NotFound),
            (Some(rv), Some(c)) if c.resource_version != rv => Err(Failure::Conflict),
            _ => Ok(()),
        };
        if let Err(f) = result {
            return (name, Err(f));
        }
        self.writes += 1;
        self.rv += 1;
        match new {
            Some(mut r) => {
                r.resource_version = self.rv.to_string();
                self.objects.insert(name.clone(), r.clone());
                (name, Ok(Some(r)))
            }
            None => {
                self.objects.remove(&name);
                (name, Ok(None))
            }
        }
    }
}

struct Gateway {
    mgr: LeaseManager,
    /// The watch's view: Lease name -> record.
    store: BTreeMap<String, LeaseRecord>,
    events: VecDeque<(Instant, String, Option<LeaseRecord>)>,
    frozen_until: Instant,
}

struct Sim {
    rng: Rng,
    api: Api,
    gws: Vec<Gateway>,
    pending: Vec<Pending>,
    ips: Vec<IpAddr>,
    cands: BTreeMap<IpAddr, Vec<String>>,
    max_latency: u64,
    max_lag: u64,
    /// Per million requests: one takes 1-3 s to apply (past the client's
    /// timeout); one's answer is lost.
    slow_rate: u64,
    loss_rate: u64,
    /// Per million steps and gateway: a freeze starts.
    freeze_rate: u64,
    max_freeze: u64,
    freezes: u64,
    t0: Instant,
    /// What happened, for the message of a failed run.
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64, n_ips: u8, t0: Instant) -> Sim {
        let ips: Vec<IpAddr> = (0..n_ips).map(|i| IpAddr::from([198, 51, 100, 10 + i])).collect();
        let cands = ips.iter().map(|ip| (*ip, rank_gateways(*ip, &NAMES))).collect();
        let gws = NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let mut mgr = LeaseManager::new(*n, LeaseTiming::default());
                mgr.renew_elsewhere();
                let _ = i;
                mgr.use_liveness(t0);
                Gateway { mgr, store: BTreeMap::new(), events: VecDeque::new(), frozen_until: t0 }
            })
            .collect();
        Sim {
            rng: Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1),
            api: Api::default(),
            gws,
            pending: Vec::new(),
            ips,
            cands,
            max_latency: 300,
            max_lag: 3000,
            slow_rate: 20_000,
            loss_rate: 20_000,
            freeze_rate: 1000,
            max_freeze: 8000,
            freezes: 0,
            t0,
            log: Vec::new(),
        }
    }

    fn send(&mut self, gw: usize, write: Write, now: Instant) {
        // Mostly quick, sometimes past the client's timeout (the server
        // still applies it).
        let slow = self.rng.chance(self.slow_rate);
        let apply_at = now + if slow { self.rng.ms(1000, 3000) } else { self.rng.ms(2, self.max_latency) };
        let mut answer_at = apply_at + self.rng.ms(2, self.max_latency);
        let bound = now + LeaseTiming::default().renew_deadline;
        let lost = self.rng.chance(self.loss_rate) || answer_at > bound;
        if lost {
            answer_at = answer_at.min(bound);
        }
        self.log.push(format!(
            "{:>9.3} {} sends {write:?} (applied +{:?}, answered +{:?}{})",
            (now - self.t0).as_secs_f64(),
            NAMES[gw],
            apply_at - now,
            answer_at - now,
            if lost { ", lost" } else { "" }
        ));
        self.pending.push(Pending {
            gw,
            write,
            sent: now,
            apply_at,
            answer_at,
            result: None,
            fresh: None,
            lost,
            applied: false,
            answered: false,
        });
    }

    fn apply_due(&mut self, now: Instant) {
        for i in 0..self.pending.len() {
            if self.pending[i].applied || self.pending[i].apply_at > now {
                continue;
            }
            let (gw, write) = (self.pending[i].gw, self.pending[i].write.clone());
            let (name, result) = self.api.apply(gw, &write);
            let fresh =
                if matches!(result, Err(Failure::Conflict)) { self.api.objects.get(&name).cloned() } else { None };
            if result.is_ok() {
                let rec = self.api.objects.get(&name).cloned();
                for g in &mut self.gws {
                    let lag = Duration::from_millis(self.rng.next() % (self.max_lag + 1));
                    let at = g.events.back().map_or(now + lag, |(t, _, _)| (*t).max(now + lag));
                    g.events.push_back((at, name.clone(), rec.clone()));
                }
            }
            self.log.push(format!(
                "{:>9.3} api applies {}'s write sent at {:.3}: {result:?}",
                (now - self.t0).as_secs_f64(),
                NAMES[gw],
                (self.pending[i].sent - self.t0).as_secs_f64()
            ));
            let p = &mut self.pending[i];
            p.applied = true;
            p.result = Some(result);
            p.fresh = fresh;
        }
        self.pending.retain(|p| !(p.applied && p.answered));
    }

    fn step_gateway(&mut self, g: usize, now: Instant) {
        if now < self.gws[g].frozen_until {
            return;
        }
        if self.freeze_rate > 0 && self.rng.chance(self.freeze_rate) {
            let d = self.rng.ms(100, self.max_freeze);
            self.gws[g].frozen_until = now + d;
            self.freezes += 1;
            self.log.push(format!("{:>9.3} {} frozen for {d:?}", (now - self.t0).as_secs_f64(), NAMES[g]));
            return;
        }
        // The watch.
        let gw = &mut self.gws[g];
        while gw.events.front().is_some_and(|(t, _, _)| *t <= now) {
            let (_, name, rec) = gw.events.pop_front().unwrap();
            match rec {
                Some(r) => gw.store.insert(name, r),
                None => gw.store.remove(&name),
            };
        }
        for ip in &self.ips {
            gw.mgr.observe(*ip, gw.store.get(&lease_name(*ip)).cloned(), now);
        }
        let liveness: BTreeMap<String, LeaseRecord> = NAMES
            .iter()
            .filter_map(|n| gw.store.get(&liveness_lease_name(n)).map(|r| (n.to_string(), r.clone())))
            .collect();
        gw.mgr.observe_liveness_all(&liveness, now);
        // Answers.
        let mut answered = false;
        for p in &mut self.pending {
            if p.gw != g || p.answered || p.answer_at > now {
                continue;
            }
            p.answered = true;
            answered = true;
            let (result, fresh) = match (&p.result, p.lost) {
                (Some(r), false) => (r.clone(), p.fresh.clone()),
                _ => (Err(Failure::Other("no answer".into())), None),
            };
            let mgr = &mut self.gws[g].mgr;
            match p.write.clone() {
                Write::Own(la) => {
                    mgr.on_liveness_result(&la, p.sent, result, fresh, now);
                }
                Write::Ip { ip, action, .. } => {
                    mgr.on_result(ip, &action, p.sent, result, now);
                    if let (Action::Expire(LivenessAction::Expire { holder, .. }), Some(f)) = (&action, fresh.clone()) {
                        mgr.observe_liveness(holder, Some(f), now);
                    } else if let Some(f) = fresh {
                        mgr.observe(ip, Some(f), now);
                    }
                }
            }
        }
        // Fence, then plan: after answers, else every 50 ms (a pass).
        let competing: BTreeSet<IpAddr> = self.ips.iter().copied().collect();
        let mgr = &mut self.gws[g].mgr;
        mgr.fence(now, &competing);
        if !answered && !(now - self.t0).as_millis().is_multiple_of(50) {
            return;
        }
        let (own, _) = mgr.plan_liveness(now);
        let actions = mgr.plan(now, &self.cands, true);
        let epoch = mgr.liveness().map(|l| l.epoch());
        if let Some(la) = own {
            self.send(g, Write::Own(la), now);
        }
        for (ip, action) in actions {
            self.send(g, Write::Ip { ip, action, epoch }, now);
        }
    }

    /// Runs until `end`, checking one owner per IP at every step.
    fn run(&mut self, t0: Instant, from: Instant, end: Instant) {
        let mut now = from;
        while now < end {
            self.apply_due(now);
            for g in 0..self.gws.len() {
                self.step_gateway(g, now);
            }
            let held: Vec<BTreeSet<IpAddr>> = self.gws.iter().map(|g| g.mgr.held(now)).collect();
            for ip in &self.ips {
                let holders: Vec<&str> =
                    held.iter().zip(NAMES).filter(|(h, _)| h.contains(ip)).map(|(_, n)| n).collect();
                if holders.len() > 1 {
                    let tail: Vec<&String> = self.log.iter().rev().take(400).rev().collect();
                    for l in tail {
                        eprintln!("{l}");
                    }
                    for (g, n) in self.gws.iter().zip(NAMES) {
                        eprintln!(
                            "{n}: deadline {:?} epoch {:?}",
                            g.mgr.deadline(*ip).map(|d| d - t0),
                            g.mgr.liveness().map(|l| l.epoch())
                        );
                    }
                }
                assert!(holders.len() <= 1, "{ip} valid in {holders:?} at {:?}", now - t0);
            }
            now += STEP;
        }
    }

    fn served(&self, now: Instant) -> usize {
        self.ips.iter().filter(|ip| self.gws.iter().any(|g| g.mgr.held(now).contains(ip))).count()
    }
}

#[test]
fn never_two_owners_under_lagging_watches_slow_answers_and_freezes() {
    // EGRET_SIM_SEEDS=n runs n seeds (8 by default).
    let seeds = std::env::var("EGRET_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(8u64);
    let mut double_checked = 0;
    for seed in 1..=seeds {
        let t0 = Instant::now();
        let mut sim = Sim::new(seed, 12, t0);
        let t1 = t0 + Duration::from_secs(90);
        sim.run(t0, t0, t1);
        // Calm: no freezes, short lags, no slow or lost requests;
        // everything is served again. (A slow liveness renewal in the calm
        // leaves its gateway's records unserved for a moment, rightly:
        // seed 18 failed on one sent 2.4 s before the check.)
        sim.freeze_rate = 0;
        sim.max_lag = 200;
        sim.slow_rate = 0;
        sim.loss_rate = 0;
        let t2 = t1 + sim.gws.iter().map(|g| g.frozen_until).max().unwrap().saturating_duration_since(t1);
        let t3 = t2 + Duration::from_secs(20);
        sim.run(t0, t1, t3);
        assert_eq!(sim.served(t3), sim.ips.len(), "seed {seed}: every IP served once calm");
        let lost: u64 = sim.gws.iter().map(|g| g.mgr.liveness().unwrap().lost).sum();
        let expired: u64 = sim.gws.iter().map(|g| g.mgr.liveness().unwrap().expired).sum();
        eprintln!("seed {seed}: {} freezes, {expired} expiries, {lost} losses, {} writes", sim.freezes, sim.api.writes);
        assert!(expired > 0, "seed {seed}: the run never expired a liveness Lease (nothing tested)");
        double_checked += lost;
    }
    assert!(double_checked > 0, "no gateway ever lost its liveness Lease to a peer: the freezes test nothing");
}

#[test]
fn steady_state_writes_grow_with_gateways_not_ips() {
    let t0 = Instant::now();
    let mut sim = Sim::new(7, 100, t0);
    sim.freeze_rate = 0;
    sim.max_lag = 100;
    // Every IP served at some moment of the first 20 s (a slow answer, 1-3
    // s now and then, lets a gateway's liveness lapse for a moment, calm or
    // not: one instant proves nothing either way).
    let mut t1 = t0;
    while sim.served(t1) < 100 {
        assert!(t1 < t0 + Duration::from_secs(20), "not every IP served in 20 s: {}", sim.served(t1));
        let next = t1 + Duration::from_millis(500);
        sim.run(t0, t1, next);
        t1 = next;
    }
    let before = sim.api.writes;
    let t2 = t1 + Duration::from_secs(10);
    sim.run(t0, t1, t2);
    let per_s = (sim.api.writes - before) as f64 / 10.0;
    // Three gateways renewing every 500 ms after their last renewal was
    // sent (less often when an answer takes long): at most 6 writes/s,
    // whatever the IPs (per-IP renewals would be 200/s).
    assert!((2.5..=6.5).contains(&per_s), "{per_s} writes/s for 100 IPs");
}
