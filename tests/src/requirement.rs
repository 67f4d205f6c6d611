//! One rule for a test that needs something this machine may lack: a built
//! API server or kube-proxy, an installed moto, root. When it is there the
//! test runs; when it is not, the test says `SKIPPED` and why on standard
//! error (past libtest's capture, so it shows for a passing test too) and
//! returns early, unless the `EGRET_REQUIRE_*` variable named for that
//! thing is `1`: `.ci/run` sets them all, so there a build that silently
//! failed fails the tests instead of turning them into skips.
//!
//! The harnesses of [`crate::apiserver`], [`crate::moto`] and
//! [`crate::kubeproxy`] say what they need ([`Requirement`]) and how to tell
//! whether it is there ([`script_check`], [`root`]); this module applies the
//! rule. The network-namespace labs' own rule ([`crate::skip`]) is the same
//! with `EGRET_REQUIRE_PRIVILEGES`.

use std::fmt;
use std::io::Write;
use std::process::Command;

/// Why something a test needs cannot run here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

/// Something tests need, named for the messages, and the variable that
/// makes its absence a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requirement {
    /// What cannot run ("the API server", "moto").
    pub what: &'static str,
    /// `EGRET_REQUIRE_...`: set to `1`, an absence fails the test.
    pub require_env: &'static str,
}

impl Requirement {
    /// `Ok(true)` when the test may go on; `Ok(false)`, after saying why on
    /// standard error, when it should return early as skipped; `Err`
    /// naming the test, the variable and the reason when the variable is
    /// `1`.
    pub fn available_or_skip(&self, test: &str, availability: Result<(), Unavailable>) -> Result<bool, Unavailable> {
        self.decide(test, availability, std::env::var(self.require_env).as_deref() == Ok("1"))
    }

    /// [`Requirement::available_or_skip`] with the variable already read.
    fn decide(&self, test: &str, availability: Result<(), Unavailable>, required: bool) -> Result<bool, Unavailable> {
        match availability {
            Ok(()) => Ok(true),
            Err(why) if required => {
                Err(Unavailable(format!("{test}: {}=1 but {} cannot run: {why}", self.require_env, self.what)))
            }
            Err(why) => {
                let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
                Ok(false)
            }
        }
    }
}

/// `SCRIPT check`: available when it exits 0; otherwise its standard error
/// says what is missing.
pub fn script_check(script: &str) -> Result<(), Unavailable> {
    match Command::new(script).arg("check").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(Unavailable(String::from_utf8_lossy(&out.stderr).trim().to_owned())),
        Err(e) => Err(Unavailable(format!("cannot run {script} check: {e}"))),
    }
}

/// Root (an effective uid of 0); otherwise the uid and `who_runs_as_root`
/// ("the lab runs as root").
pub fn root(who_runs_as_root: &str) -> Result<(), Unavailable> {
    match effective_uid() {
        Some(0) => Ok(()),
        Some(uid) => Err(Unavailable(format!("not root (euid {uid}); {who_runs_as_root}"))),
        None => Err(Unavailable("cannot read the euid from /proc/self/status".into())),
    }
}

fn effective_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    // "Uid:\treal\teffective\tsaved\tfs"
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEEDS: Requirement = Requirement { what: "the thing", require_env: "EGRET_REQUIRE_NOTHING_REAL_0" };

    #[test]
    fn available_goes_on_and_unavailable_skips_unless_required() {
        assert_eq!(NEEDS.available_or_skip("t", Ok(())), Ok(true));
        assert_eq!(NEEDS.available_or_skip("t", Err(Unavailable("gone".into()))), Ok(false));
        // Required (the variable read as "1"; no set_var while other tests run).
        assert_eq!(NEEDS.decide("t", Ok(()), true), Ok(true));
        assert_eq!(
            NEEDS.decide("t", Err(Unavailable("gone".into())), true),
            Err(Unavailable("t: EGRET_REQUIRE_NOTHING_REAL_0=1 but the thing cannot run: gone".into()))
        );
    }

    #[test]
    fn a_script_that_is_not_there_is_named() {
        let e = script_check("/nonexistent/egret-check.sh").unwrap_err();
        assert!(e.0.starts_with("cannot run /nonexistent/egret-check.sh check: "), "{e}");
    }
}
