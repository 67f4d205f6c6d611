//! What the unit tests that need root or a system tool share: one way to
//! tell whether they can run, and one way to skip.

use std::io::Write;

/// Whether this process runs as root (uid 0).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// Whether `cmd --version` (or `cmd -V`) runs and succeeds.
pub fn has_tool(cmd: &str, version_flag: &str) -> bool {
    std::process::Command::new(cmd).arg(version_flag).output().is_ok_and(|o| o.status.success())
}

/// Skips `test`, saying why past libtest's capture (so that a passing test
/// shows it too), or fails it when `EGRET_REQUIRE_PRIVILEGES=1` (.ci/run
/// sets it): there, a test that could not run is a test that tested
/// nothing.
pub fn skip(test: &str, why: &str) {
    assert!(
        std::env::var("EGRET_REQUIRE_PRIVILEGES").map_or(true, |v| v.trim() != "1"),
        "{test} cannot run: {why}; EGRET_REQUIRE_PRIVILEGES=1 makes that a failure"
    );
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}
