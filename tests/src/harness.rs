//! What every end-to-end test does around its own checks: build a lab with
//! unique namespaces, start the gateway, capture the outside link for the
//! whole test, and at the end assert that no selected pod's address left on
//! it. On failure the capture (pcap) and the gateway's log are kept under
//! `dir/artifacts/<test>.*` and their paths printed.
//!
//! A test can run in either [`Tier`]: with the XDP fast path on (and then
//! [`Harness::finish`] also checks that established flows took it, so the
//! run cannot pass by leaving everything to userspace) or off.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::capture::{self, Capture};
use crate::error::{LabError, Result};
use crate::gateway::{Counters, Gateway, GatewayConfig};
use crate::lab::{Lab, LabOptions};

/// Which tier translates a test's established flows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// `xdp.fastPath: true`, on a lab whose veths complete checksums before
    /// sending (`LabOptions::tx_checksum_offload` off), as frames arrive
    /// from a wire: confirmed TCP/UDP sessions are translated in XDP.
    /// [`Harness::finish`] fails unless the fast path's hit counter grew.
    FastPath,
    /// `xdp.fastPath: false` and the kernel's default offloads (partial
    /// checksums): every steered frame goes through the AF_XDP workers.
    Userspace,
}

impl Tier {
    /// Both tiers.
    pub const BOTH: [Tier; 2] = [Tier::FastPath, Tier::Userspace];

    /// Short name (artifact file names).
    pub fn name(self) -> &'static str {
        match self {
            Tier::FastPath => "fastpath",
            Tier::Userspace => "userspace",
        }
    }

    /// The lab options of this tier.
    pub fn lab_options(self, opts: &mut LabOptions) {
        if self == Tier::FastPath {
            opts.tx_checksum_offload = false;
        }
    }

    /// The gateway configuration of this tier.
    pub fn config(self, cfg: &mut GatewayConfig) {
        cfg.fast_path = self == Tier::FastPath;
    }
}

/// A lab with a running gateway and a capture on the outside link. Fields
/// drop in order: capture, gateway, lab.
#[derive(Debug)]
pub struct Harness {
    /// The test's name (artifact file names).
    pub name: String,
    /// The outside-link capture (taken by [`Harness::finish`]).
    pub capture: Option<Capture>,
    /// The gateway.
    pub gw: Gateway,
    /// The lab.
    pub lab: Lab,
    /// The tier the test runs in, if it chose one.
    pub tier: Option<Tier>,
    /// With [`Tier::FastPath`]: whether [`Harness::finish`] requires fast-path
    /// hits (a test whose traffic has no established TCP/UDP flow clears it).
    pub expect_fast_path_hits: bool,
    artifacts: PathBuf,
    started: Instant,
}

impl Harness {
    /// Builds the lab from `opts`, starts the gateway with the lab's default
    /// configuration changed by `tweak`, and starts the capture.
    pub fn start(name: &str, opts: LabOptions, tweak: impl FnOnce(&mut GatewayConfig)) -> Result<Self> {
        Self::start_with(name, None, opts, tweak)
    }

    /// [`Harness::start`] in `tier`: the tier's lab options and `xdp.fastPath`
    /// are set before `tweak` sees the configuration.
    pub fn start_in(name: &str, tier: Tier, opts: LabOptions, tweak: impl FnOnce(&mut GatewayConfig)) -> Result<Self> {
        Self::start_with(name, Some(tier), opts, tweak)
    }

    fn start_with(
        name: &str,
        tier: Option<Tier>,
        mut opts: LabOptions,
        tweak: impl FnOnce(&mut GatewayConfig),
    ) -> Result<Self> {
        let started = Instant::now();
        if let Some(t) = tier {
            t.lab_options(&mut opts);
        }
        let lab = Lab::build(opts)?;
        let mut cfg = GatewayConfig::lab_default(&lab);
        if let Some(t) = tier {
            t.config(&mut cfg);
        }
        tweak(&mut cfg);
        // Capture from before the gateway starts, so its first frames count.
        let capture = Capture::start(lab.upstream(), "gw")?;
        let gw = Gateway::start(&lab, &cfg)?;
        let artifacts = std::env::var_os("EGRET_E2E_ARTIFACTS")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("egret-e2e-artifacts"));
        Ok(Self {
            name: name.to_string(),
            capture: Some(capture),
            gw,
            lab,
            tier,
            expect_fast_path_hits: tier == Some(Tier::FastPath),
            artifacts,
            started,
        })
    }

    /// Frames the fast path translated so far (the current daemon's count).
    pub fn fast_path_hits(&self) -> Result<u64> {
        Ok(self.counters()?.fast_path_hits())
    }

    /// The gateway's counters now.
    pub fn counters(&self) -> Result<Counters> {
        self.gw.counters()
    }

    /// Waits until `pred` holds for the counters (they are read from
    /// per-worker snapshots, so they may lag a packet by a moment).
    pub fn wait_counters(&self, timeout: Duration, what: &str, pred: impl Fn(&Counters) -> bool) -> Result<Counters> {
        let deadline = Instant::now() + timeout;
        loop {
            let c = self.counters()?;
            if pred(&c) {
                return Ok(c);
            }
            if Instant::now() > deadline {
                return Err(LabError::Timeout { what: format!("counters: {what}; last: {:?}", c.0), after: timeout });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the capture and checks that no frame the gateway sent on the
    /// outside link carries a selected pod's address as its source towards a
    /// destination its policy selects (under the configuration in force,
    /// plus `also`: earlier configurations of a reloaded gateway). Returns
    /// the frames.
    /// With [`Tier::FastPath`] (unless the test cleared
    /// `expect_fast_path_hits`) it first checks that the fast path
    /// translated frames.
    pub fn finish(&mut self, also: &[GatewayConfig]) -> Result<Vec<capture::Frame>> {
        let mut hits = None;
        if self.tier == Some(Tier::FastPath) && self.expect_fast_path_hits {
            let c = self.counters()?;
            if c.fast_path_hits() == 0 {
                return Err(LabError::Gateway(format!(
                    "{}: the fast path translated nothing (fast-path counters {:?})",
                    self.name,
                    c.0.iter().filter(|(k, _)| k.starts_with("fast_path.")).collect::<Vec<_>>()
                )));
            }
            hits = Some(c.fast_path_hits());
        }
        let cap = self.capture.take().ok_or_else(|| LabError::Gateway("capture already finished".into()))?;
        let frames = cap.stop()?;
        let mut cfgs = vec![self.gw.current.clone()];
        cfgs.extend_from_slice(also);
        let selected = |s: IpAddr, d: IpAddr| cfgs.iter().any(|c| c.selects(s, d));
        let leaks = capture::leaks(&frames, self.lab.gateway_outside_mac(), selected);
        if !leaks.is_empty() {
            let pcap = self.save(&frames);
            return Err(LabError::Gateway(format!(
                "{} frames left with a selected pod's address ({pcap}); first: {}",
                leaks.len(),
                leaks.iter().take(5).cloned().collect::<Vec<_>>().join("; ")
            )));
        }
        let tier = self.tier.map(|t| format!(" [{}]", t.name())).unwrap_or_default();
        let hits = hits.map(|h| format!(", {h} fast-path hits")).unwrap_or_default();
        eprintln!(
            "{}{tier}: {} frames on the outside link, none leaked{hits}; {:?}",
            self.name,
            frames.len(),
            self.started.elapsed()
        );
        Ok(frames)
    }

    /// Saves `frames` and the gateway log as artifacts; returns a note with
    /// their paths.
    pub fn save(&self, frames: &[capture::Frame]) -> String {
        let _ = std::fs::create_dir_all(&self.artifacts);
        let pcap = self.artifacts.join(format!("{}.pcap", self.name));
        let log = self.artifacts.join(format!("{}.egret.log", self.name));
        let _ = capture::write_pcap(&pcap, frames);
        let _ = std::fs::copy(self.gw.log_path(), &log);
        format!("capture {}, gateway log {}", pcap.display(), log.display())
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let frames = self.capture.as_ref().map(Capture::snapshot).unwrap_or_default();
            eprintln!("{} failed; kept {}", self.name, self.save(&frames));
        }
    }
}
