//! What can go wrong while building or driving the lab.

use std::time::Duration;

/// A lab operation that failed, naming what was attempted.
#[derive(Debug, thiserror::Error)]
pub enum LabError {
    /// A command could not be started.
    #[error("cannot run `{cmd}`: {source}")]
    Spawn {
        /// The command line.
        cmd: String,
        /// Why.
        source: std::io::Error,
    },
    /// A command the test needs is not installed (`tests/tools.txt` names
    /// its package; `tests/install-deps.sh` installs it).
    #[error("`{cmd}`: {message}")]
    MissingTool {
        /// The command line.
        cmd: String,
        /// "missing tool X (package Y): run tests/install-deps.sh".
        message: String,
    },
    /// A command exited unsuccessfully.
    #[error("`{cmd}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// Its exit status.
        status: String,
        /// What it wrote to stderr.
        stderr: String,
    },
    /// A system call or socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// Why it failed.
        source: std::io::Error,
    },
    /// Something did not happen in time.
    #[error("timed out after {after:?}: {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long we waited.
        after: Duration,
    },
    /// A peer answered something unexpected.
    #[error("unexpected answer from {from}: {got:?}")]
    Unexpected {
        /// Who answered.
        from: String,
        /// What it said.
        got: String,
    },
    /// The gateway daemon misbehaved (exited, refused its config, ...).
    #[error("gateway: {0}")]
    Gateway(String),
}

impl LabError {
    /// The error for `cmd` (described as `line`) that could not start: a
    /// [`LabError::MissingTool`] when its program does not exist.
    pub fn spawn(cmd: &std::process::Command, line: String, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            Self::MissingTool { cmd: line, message: crate::tools::missing(&cmd.get_program().to_string_lossy()) }
        } else {
            Self::Spawn { cmd: line, source }
        }
    }

    /// An [`LabError::Io`] with context.
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io { what: what.into(), source }
    }
}

/// The lab's result type.
pub type Result<T> = std::result::Result<T, LabError>;
