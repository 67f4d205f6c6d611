//! The real components that harnesses start through a script
//! (`tests/k8s/apiserver.sh` for etcd and the API server,
//! `tests/moto/moto.sh` for moto) share one protocol, kept here:
//!
//! - each instance has a fresh state directory of its own
//!   ([`Script::fresh_state_dir`]), which the script reads from
//!   `EGRET_<NAME>_STATE` and every process of the instance names on its
//!   command line, so parallel tests never share one;
//! - `EGRET_<NAME>_OWNER_PID` is this test process: a watcher the script
//!   starts stops the instance when that process is gone, so a test that
//!   dies without dropping its handle leaks nothing;
//! - `SCRIPT start|stop|...` does one thing and exits; a failure carries
//!   the script's standard error, and on success that goes to the test's
//!   log (ports, time to ready).

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// A script that runs instances of one component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Script {
    /// The script's path.
    pub path: &'static str,
    /// The variable that names an instance's state directory.
    pub state_env: &'static str,
    /// The variable that names the owning process.
    pub owner_env: &'static str,
    /// The state directories' name prefix under the temporary directory.
    pub state_prefix: &'static str,
}

/// A script that could not be run, or failed.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// The script could not be run at all.
    #[error("cannot run {script} {command}: {source}")]
    Spawn {
        script: &'static str,
        command: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The script ran and failed; `stderr` holds its explanation.
    #[error("{script} {command} (state {state}) exited with {status}:\n{stderr}")]
    Failed { script: &'static str, command: &'static str, state: PathBuf, status: ExitStatus, stderr: String },
}

impl Script {
    /// A state directory no instance of this process has used.
    pub fn fresh_state_dir(&self) -> PathBuf {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("{}-{}-{n}", self.state_prefix, std::process::id()))
    }

    /// Runs `SCRIPT command` for the instance in `state`, with `env` added,
    /// and waits for it.
    pub fn run<K: AsRef<OsStr>, V: AsRef<OsStr>>(
        &self,
        command: &'static str,
        state: &Path,
        env: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Output, ScriptError> {
        let out = self.command(command, state).envs(env).output().map_err(|source| ScriptError::Spawn {
            script: self.path,
            command,
            source,
        })?;
        self.check(command, state, out)
    }

    /// [`Script::run`] without extra variables, on a tokio runtime.
    pub async fn run_async(&self, command: &'static str, state: &Path) -> Result<Output, ScriptError> {
        let out = tokio::process::Command::from(self.command(command, state))
            .output()
            .await
            .map_err(|source| ScriptError::Spawn { script: self.path, command, source })?;
        self.check(command, state, out)
    }

    /// `SCRIPT command` with the instance's state directory and this
    /// process as its owner in the environment.
    fn command(&self, command: &str, state: &Path) -> Command {
        let mut c = Command::new(self.path);
        c.arg(command).env(self.state_env, state).env(self.owner_env, std::process::id().to_string());
        c
    }

    fn check(&self, command: &'static str, state: &Path, out: Output) -> Result<Output, ScriptError> {
        if out.status.success() {
            // The script's progress (ports, time to ready) belongs in the test's log.
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
            return Ok(out);
        }
        Err(ScriptError::Failed {
            script: self.path,
            command,
            state: state.to_owned(),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SH: Script =
        Script { path: "/bin/sh", state_env: "EGRET_T_STATE", owner_env: "EGRET_T_OWNER_PID", state_prefix: "egret-t" };

    #[test]
    fn state_directories_are_fresh_and_named_for_this_process() {
        let (a, b) = (SH.fresh_state_dir(), SH.fresh_state_dir());
        assert_ne!(a, b);
        let name = a.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&format!("egret-t-{}-", std::process::id())), "{name}");
    }

    #[test]
    fn a_failure_carries_the_scripts_stderr_and_state() {
        // `sh -c` runs its argument: the "command" is the script text here.
        let e = SH.run("-c", Path::new("/tmp/egret-t-state"), [("X", "1")]).unwrap_err();
        let text = e.to_string();
        assert!(text.starts_with("/bin/sh -c (state /tmp/egret-t-state) exited with"), "{text}");
        let missing = Script { path: "/nonexistent/egret-t.sh", ..SH };
        let e = missing.run("start", Path::new("/tmp/x"), [("X", "1")]).unwrap_err();
        assert!(e.to_string().starts_with("cannot run /nonexistent/egret-t.sh start: "), "{e}");
    }
}
