//! Summaries of a run's samples: medians and spreads per (mode, flows), the
//! CPU of each gateway-side context, the ratios between modes, and the text
//! table and JSON document the command prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::bench::{Mode, Sample};

/// Median, minimum and maximum of some samples.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// Of `values` (empty: all NaN).
    pub fn of(values: &[f64]) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
        if v.is_empty() {
            return Self { median: f64::NAN, min: f64::NAN, max: f64::NAN };
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 };
        Self { median, min: v[0], max: v[n - 1] }
    }

    /// `median (min-max)` to three decimals, as the tables print it.
    pub fn three_places(&self) -> String {
        format!("{:.3} ({:.3}-{:.3})", self.median, self.min, self.max)
    }

    /// `(max - min) / median`, the spread relative to the median.
    pub fn relative(&self) -> f64 {
        (self.max - self.min) / self.median
    }
}

/// The context a watched thread's role belongs to, for the per-context
/// columns: workers are summed, other daemon threads are summed.
pub fn context_of(role: &str) -> String {
    if role.starts_with(crate::egret::WORKER_PREFIX) {
        "egret workers".into()
    } else if role.starts_with("egret ") {
        "egret other threads".into()
    } else {
        role.to_owned()
    }
}

/// One (mode, flows) cell over its rounds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub mode: Mode,
    pub flows: u64,
    pub rounds: usize,
    pub offered_mpps: Spread,
    pub forwarded_mpps: Spread,
    pub loss: Spread,
    /// Gateway CPU seconds per second of window (cores busy).
    pub gateway_cores: Spread,
    pub per_core_mpps: Spread,
    pub ns_per_packet: Spread,
    /// Per context: cores busy (median over rounds).
    pub contexts: BTreeMap<String, f64>,
    /// Per context: seconds per second runnable but waiting (median).
    pub contexts_waiting: BTreeMap<String, f64>,
    /// The gateway core's busy share and the generator core's (medians).
    pub gw_core_busy: f64,
    pub gw_core_steal: f64,
    pub gen_core_busy: f64,
    /// Shares of arriving frames refused by the gateway's RX ring and by
    /// the sink's (medians).
    pub lost_at_gateway_rx: f64,
    pub lost_at_sink_rx: f64,
    /// Egret modes: frames the workers received per forwarded frame.
    pub worker_rx_per_forwarded: Option<f64>,
    pub problems: Vec<String>,
    /// Some round did not measure the mode's path ([`Sample::invalid`]):
    /// no ratios, and the table says INVALID.
    pub invalid: bool,
}

/// Group samples by (mode, flows), in first-seen order.
pub fn summarize(samples: &[Sample]) -> Vec<Summary> {
    let mut keys: Vec<(Mode, u64)> = Vec::new();
    for s in samples {
        if !keys.contains(&(s.mode, s.flows)) {
            keys.push((s.mode, s.flows));
        }
    }
    keys.into_iter()
        .map(|(mode, flows)| {
            let v: Vec<&Sample> = samples.iter().filter(|s| s.mode == mode && s.flows == flows).collect();
            let f = |g: &dyn Fn(&Sample) -> f64| Spread::of(&v.iter().map(|s| g(s)).collect::<Vec<_>>());
            let mut per_ctx: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            let mut per_ctx_wait: BTreeMap<String, Vec<f64>> = BTreeMap::new();
            for s in &v {
                let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
                for t in &s.cpu.threads {
                    let e = sums.entry(context_of(&t.role)).or_default();
                    e.0 += t.cpu_s / s.seconds;
                    e.1 += t.wait_s / s.seconds;
                }
                for (k, (x, w)) in sums {
                    per_ctx.entry(k.clone()).or_default().push(x);
                    per_ctx_wait.entry(k).or_default().push(w);
                }
            }
            let mut problems: Vec<String> = v.iter().flat_map(|s| s.problems()).collect();
            problems.dedup();
            Summary {
                mode,
                flows,
                rounds: v.len(),
                offered_mpps: f(&|s| s.offered_mpps()),
                forwarded_mpps: f(&|s| s.forwarded_mpps()),
                loss: f(&|s| s.loss()),
                gateway_cores: f(&|s| s.cpu.gateway_cpu_s / s.seconds),
                per_core_mpps: f(&|s| s.per_core_mpps()),
                ns_per_packet: f(&|s| s.ns_per_packet()),
                contexts: per_ctx.into_iter().map(|(k, xs)| (k, Spread::of(&xs).median)).collect(),
                contexts_waiting: per_ctx_wait.into_iter().map(|(k, xs)| (k, Spread::of(&xs).median)).collect(),
                gw_core_busy: f(&|s| s.cpu.core_busy_s / s.seconds).median,
                gw_core_steal: f(&|s| s.cpu.core_steal_s / s.seconds).median,
                gen_core_busy: f(&|s| s.cpu.other_core_busy_s / s.seconds).median,
                lost_at_gateway_rx: f(&|s| s.lost_at_gateway_rx()).median,
                lost_at_sink_rx: f(&|s| s.lost_at_sink_rx()).median,
                worker_rx_per_forwarded: v
                    .iter()
                    .all(|s| s.worker_rx().is_some())
                    .then(|| f(&|s| s.worker_rx().unwrap_or(f64::NAN) / s.sink.frames.max(1) as f64).median),
                problems,
                invalid: v.iter().any(|s| !s.invalid().is_empty()),
            }
        })
        .collect()
}

/// A comparison between two modes at one flow count.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Ratio {
    pub name: String,
    pub flows: u64,
    pub value: f64,
    pub unit: &'static str,
}

/// egret/kernel, fastpath/kernel, fastpath/redirect, and against the
/// kernel's flowtable fastpath/kernel-flowtable, egret/kernel-flowtable and
/// kernel-flowtable/kernel (per-core rates), the
/// fast path's (and Egret's) extra ns per packet over XDP_REDIRECT, and
/// each encapsulated mode against its on-link mode (rate ratio, extra ns
/// per packet).
pub fn ratios(summaries: &[Summary]) -> Vec<Ratio> {
    let find = |m: Mode, flows: u64| summaries.iter().find(|s| s.mode == m && s.flows == flows && !s.invalid);
    let mut flows: Vec<u64> = summaries.iter().map(|s| s.flows).filter(|f| *f > 0).collect();
    flows.sort_unstable();
    flows.dedup();
    let mut out = Vec::new();
    for f in flows {
        for (a, b) in [
            (Mode::Egret, Mode::Kernel),
            (Mode::Fastpath, Mode::Kernel),
            (Mode::Fastpath, Mode::Redirect),
            (Mode::Fastpath, Mode::KernelFlowtable),
            (Mode::Egret, Mode::KernelFlowtable),
            (Mode::KernelFlowtable, Mode::Kernel),
            (Mode::NewConnsTranslog, Mode::NewConns),
        ] {
            if let (Some(x), Some(y)) = (find(a, f), find(b, f)) {
                out.push(Ratio {
                    name: format!("{}/{}", a.name(), b.name()),
                    flows: f,
                    value: x.per_core_mpps.median / y.per_core_mpps.median,
                    unit: "x (per-core rate)",
                });
            }
        }
        for a in [Mode::Fastpath, Mode::Egret, Mode::KernelFlowtable, Mode::Kernel] {
            if let (Some(x), Some(r)) = (find(a, f), find(Mode::Redirect, f)) {
                out.push(Ratio {
                    name: format!("{} cost over redirect", a.name()),
                    flows: f,
                    value: x.ns_per_packet.median - r.ns_per_packet.median,
                    unit: "ns/packet",
                });
            }
        }
        // Issue 30: the nodes' tunnel against the same path on-link.
        for a in [Mode::FastpathVxlan, Mode::EgretVxlan] {
            if let (Some(x), Some(y)) = (find(a, f), find(a.on_link(), f)) {
                out.push(Ratio {
                    name: format!("{}/{}", a.name(), a.on_link().name()),
                    flows: f,
                    value: x.per_core_mpps.median / y.per_core_mpps.median,
                    unit: "x (per-core rate)",
                });
                out.push(Ratio {
                    name: format!("{} cost over {}", a.name(), a.on_link().name()),
                    flows: f,
                    value: x.ns_per_packet.median - y.ns_per_packet.median,
                    unit: "ns/packet",
                });
            }
        }
    }
    out
}

fn flows_label(f: u64) -> String {
    if f == 0 {
        "new/frame".into()
    } else {
        f.to_string()
    }
}

/// The human-readable table.
pub fn table(summaries: &[Summary], ratios: &[Ratio], unavailable: &[(Mode, String)]) -> String {
    let mut t = String::new();
    let _ = writeln!(t, "Medians over rounds, (min-max) spread. Rates in Mpps; CPU in cores busy (CPU-s per s).");
    let _ = writeln!(
        t,
        "{:<17} {:>9} {:>21} {:>21} {:>7} {:>9} {:>21} {:>8}",
        "mode", "flows", "offered", "forwarded", "loss", "gw cores", "per-core", "ns/pkt"
    );
    for s in summaries {
        let _ = writeln!(
            t,
            "{:<17} {:>9} {:>21} {:>21} {:>6.1}% {:>9.3} {:>21} {:>8.0}",
            s.mode.name(),
            flows_label(s.flows),
            s.offered_mpps.three_places(),
            s.forwarded_mpps.three_places(),
            s.loss.median * 100.0,
            s.gateway_cores.median,
            s.per_core_mpps.three_places(),
            s.ns_per_packet.median
        );
        let ctx: Vec<String> = s
            .contexts
            .iter()
            .map(|(k, v)| format!("{k} {v:.3} (waited {:.3})", s.contexts_waiting.get(k).copied().unwrap_or(0.0)))
            .collect();
        let _ = writeln!(
            t,
            "{:<17}   contexts: {}; gateway core busy {:.3} (stolen by the host {:.3}), generator core busy {:.3}; lost at gateway RX {:.1}%, at sink RX {:.1}%; {} rounds",
            "",
            ctx.join(", "),
            s.gw_core_busy,
            s.gw_core_steal,
            s.gen_core_busy,
            s.lost_at_gateway_rx * 100.0,
            s.lost_at_sink_rx * 100.0,
            s.rounds
        );
        if let Some(w) = s.worker_rx_per_forwarded {
            let _ = writeln!(t, "{:<17}   egret workers received {:.3} frames per forwarded frame", "", w);
        }
        if s.invalid {
            let _ = writeln!(t, "{:<17}   INVALID: not the mode's path (below); no ratios against it", "");
        }
        for p in &s.problems {
            let _ = writeln!(t, "{:<17}   PROBLEM: {p}", "");
        }
    }
    for (m, why) in unavailable {
        let _ = writeln!(t, "{:<17} not available: {why}", m.name());
    }
    if !ratios.is_empty() {
        let _ = writeln!(t, "\nRatios (medians):");
        for r in ratios {
            let _ = writeln!(t, "  {:<32} flows {:>6}: {:>8.2} {}", r.name, flows_label(r.flows), r.value, r.unit);
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_median_min_max() {
        let s = Spread::of(&[3.0, 1.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        let s = Spread::of(&[4.0, 1.0, 2.0, 3.0]);
        assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 4.0));
        assert!((s.relative() - 1.2).abs() < 1e-12);
        assert!(Spread::of(&[]).median.is_nan());
    }

    fn summary(mode: Mode, per_core: f64, ns: f64) -> Summary {
        let one = |x: f64| Spread { median: x, min: x, max: x };
        Summary {
            mode,
            flows: 50_000,
            rounds: 3,
            offered_mpps: one(1.0),
            forwarded_mpps: one(1.0),
            loss: one(0.0),
            gateway_cores: one(1.0),
            per_core_mpps: one(per_core),
            ns_per_packet: one(ns),
            contexts: BTreeMap::new(),
            contexts_waiting: BTreeMap::new(),
            gw_core_busy: 1.0,
            gw_core_steal: 0.0,
            gen_core_busy: 1.0,
            lost_at_gateway_rx: 0.0,
            lost_at_sink_rx: 0.0,
            worker_rx_per_forwarded: None,
            problems: Vec::new(),
            invalid: false,
        }
    }

    #[test]
    fn the_flowtable_is_compared_with_egret_and_the_kernel() {
        let s = [
            summary(Mode::Kernel, 0.5, 2000.0),
            summary(Mode::KernelFlowtable, 1.0, 1000.0),
            summary(Mode::Egret, 0.75, 1333.0),
            summary(Mode::Fastpath, 3.0, 333.0),
        ];
        let r = ratios(&s);
        let get = |name: &str| r.iter().find(|x| x.name == name).map(|x| x.value);
        assert_eq!(get("fastpath/kernel-flowtable"), Some(3.0));
        assert_eq!(get("egret/kernel-flowtable"), Some(0.75));
        assert_eq!(get("kernel-flowtable/kernel"), Some(2.0));
        assert_eq!(get("egret/kernel"), Some(1.5));
        // Without the flowtable in the run (a kernel without it), none of its ratios.
        assert!(ratios(&[s[0].clone(), s[2].clone()]).iter().all(|x| !x.name.contains("flowtable")));
        // An invalid kernel row (e.g. untranslated TCP) gives no ratios.
        let mut k = s[0].clone();
        k.invalid = true;
        let r = ratios(&[k, s[2].clone(), s[3].clone()]);
        assert!(r.iter().all(|x| !x.name.ends_with("/kernel") && x.name != "kernel cost over redirect"), "{r:?}");
    }

    #[test]
    fn encapsulated_modes_are_compared_with_their_on_link_modes() {
        let s = [
            summary(Mode::Fastpath, 2.0, 500.0),
            summary(Mode::FastpathVxlan, 1.6, 625.0),
            summary(Mode::Egret, 0.5, 2000.0),
            summary(Mode::EgretVxlan, 0.4, 2500.0),
        ];
        let r = ratios(&s);
        let get = |name: &str| r.iter().find(|x| x.name == name).map(|x| x.value).expect(name);
        assert!((get("fastpath-vxlan/fastpath") - 0.8).abs() < 1e-12);
        assert!((get("fastpath-vxlan cost over fastpath") - 125.0).abs() < 1e-12);
        assert!((get("egret-vxlan/egret") - 0.8).abs() < 1e-12);
        assert!((get("egret-vxlan cost over egret") - 500.0).abs() < 1e-12);
        // Without its on-link mode in the run, no ratio.
        assert!(ratios(&s[1..2]).is_empty());
        assert_eq!(Mode::EgretVxlan.on_link(), Mode::Egret);
        assert_eq!(Mode::Kernel.on_link(), Mode::Kernel);
    }

    #[test]
    fn contexts_group_workers_and_daemon_threads() {
        assert_eq!(context_of("egret-worker-0"), "egret workers");
        assert_eq!(context_of("egret-worker-12"), "egret workers");
        assert_eq!(context_of("egret tokio-runtime-w"), "egret other threads");
        assert_eq!(context_of("napi gwin"), "napi gwin");
    }
}
