//! Network namespaces: created with `ip netns add`, deleted (after ending the
//! processes started inside) when their guard drops, even when a test fails.
//! The guard, the `setns(2)` call and the process listing are the
//! workspace's one implementation, `egret_dataplane::netns`.
//!
//! Two ways to act inside a namespace:
//! - [`NetNs::command`]: a process under `ip netns exec` (the gateway, `ip`,
//!   `sysctl`); [`spawn_logged`] starts such a daemon with its output in a
//!   log file;
//! - [`NetNs::run_in`] / [`NetNs::spawn_in`]: a thread of this process that
//!   first enters the namespace (setns(2) acts per thread). Sockets it opens
//!   stay in the namespace for their whole life, wherever they are used
//!   afterwards, which lets one test hold thousands of pod sockets without a
//!   process per pod.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;

use egret_dataplane::netns::{self as dp, NetnsGuard};

use crate::error::{LabError, Result};

/// Runs `cmd`, returns its stdout; fails with its stderr if it exits non-zero.
pub fn run(cmd: &mut Command) -> Result<String> {
    let line = describe(cmd);
    let out: Output = cmd.stdin(Stdio::null()).output().map_err(|source| LabError::spawn(cmd, line.clone(), source))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else if let Some(message) = crate::tools::explain_netns_exec(&out) {
        // `ip netns exec NS PROGRAM` with no PROGRAM installed.
        Err(LabError::MissingTool { cmd: line, message })
    } else {
        Err(LabError::Command {
            cmd: line,
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Spawns `cmd` (a daemon under `ip netns exec`) with stdin closed and
/// stdout and stderr appended to `log`, in its own process group: a Ctrl-C
/// meant for the lab script reaches the script (whose trap tears the lab
/// down), not the daemon directly.
pub fn spawn_logged(cmd: &mut Command, log: &Path) -> Result<Child> {
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| LabError::io(format!("open {}", log.display()), e))?;
    let err = out.try_clone().map_err(|e| LabError::io("dup log", e))?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    std::os::unix::process::CommandExt::process_group(cmd, 0);
    let line = describe(cmd);
    cmd.spawn().map_err(|source| LabError::spawn(cmd, line, source))
}

/// A command line as text, for error messages.
pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// A network namespace. When created by [`NetNs::create`], dropping the
/// guard ends every process inside it and deletes it.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    /// Deletes the namespace on drop; `None` when it is not ours.
    guard: Option<NetnsGuard>,
}

impl NetNs {
    /// Creates namespace `name` with its loopback up. Fails if it exists.
    pub fn create(name: &str) -> Result<Self> {
        let guard = NetnsGuard::named(&[name]).lo_up().create().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                LabError::MissingTool { cmd: format!("ip netns add {name}"), message: crate::tools::missing("ip") }
            } else {
                LabError::io(format!("create namespace {name}"), e)
            }
        })?;
        Ok(Self { name: name.to_string(), guard: Some(guard) })
    }

    /// Refers to an existing namespace without owning it (dropping this
    /// deletes nothing): the lab CLI's `demo` uses the namespaces `up` made.
    pub fn existing(name: &str) -> Result<Self> {
        let path = format!("/run/netns/{name}");
        if !std::path::Path::new(&path).exists() {
            return Err(LabError::io(format!("namespace {name}"), std::io::ErrorKind::NotFound.into()));
        }
        Ok(Self { name: name.to_string(), guard: None })
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip -n NAME ARGS...`; returns its stdout.
    pub fn ip(&self, args: &[&str]) -> Result<String> {
        run(Command::new("ip").arg("-n").arg(&self.name).args(args))
    }

    /// Runs many `ip` commands (one per line, without the leading `ip`) in
    /// the namespace with one process (`ip -n NAME -batch -`); stops at the
    /// first failure.
    pub fn ip_batch(&self, lines: &[String]) -> Result<()> {
        use std::io::Write;
        let mut cmd = Command::new("ip");
        cmd.args(["-n", &self.name, "-batch", "-"]);
        let line = format!("{} <<< {:?}", describe(&cmd), lines);
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| LabError::spawn(&cmd, line.clone(), source))?;
        if let Some(mut stdin) = child.stdin.take() {
            let text = lines.join("\n") + "\n";
            stdin.write_all(text.as_bytes()).map_err(|e| LabError::io(format!("write to {line}"), e))?;
        }
        let out = child.wait_with_output().map_err(|e| LabError::io(format!("wait for {line}"), e))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(LabError::Command {
                cmd: line,
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            })
        }
    }

    /// A command that runs `program` inside the namespace (`ip netns exec`).
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs `argv` inside the namespace; returns its stdout.
    pub fn exec(&self, argv: &[&str]) -> Result<String> {
        let Some((program, args)) = argv.split_first() else {
            return Ok(String::new());
        };
        run(self.command(program).args(args))
    }

    /// Sets a sysctl inside the namespace (`net.*` keys are per namespace).
    pub fn sysctl(&self, key: &str, value: &str) -> Result<()> {
        self.exec(&["sysctl", "-q", "-w", &format!("{key}={value}")]).map(|_| ())
    }

    /// The interface index of `dev` in this namespace.
    pub fn ifindex(&self, dev: &str) -> Result<u32> {
        let out = self.ip(&["-o", "link", "show", "dev", dev])?;
        out.split(':')
            .next()
            .and_then(|n| n.trim().parse().ok())
            .ok_or_else(|| LabError::Unexpected { from: format!("ip -n {} link show {dev}", self.name), got: out })
    }

    fn open(&self) -> Result<File> {
        let path = dp::path(&self.name);
        File::open(&path).map_err(|e| LabError::io(format!("open {}", path.display()), e))
    }

    /// Runs `f` on a thread that is inside the namespace, and waits for it.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        dp::run_in(&self.name, f).map_err(|e| LabError::io(format!("enter namespace {}", self.name), e))
    }

    /// Starts `f` on a new thread inside the namespace (a server loop).
    pub fn spawn_in<T: Send + 'static>(
        &self,
        thread_name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<JoinHandle<Result<T>>> {
        let file = self.open()?;
        let name = self.name.clone();
        std::thread::Builder::new()
            .name(thread_name.to_string())
            .spawn(move || {
                dp::enter(&file).map_err(|e| LabError::io(format!("setns into {name}"), e))?;
                Ok(f())
            })
            .map_err(|e| LabError::io("spawn thread", e))
    }

    /// The ids of the processes (other than this one) whose network
    /// namespace this is.
    pub fn pids(&self) -> Vec<u32> {
        dp::pids(&self.name)
    }

    /// Ends every process inside the namespace (processes the lab started
    /// there: gateway, server): SIGTERM, then SIGKILL after a second.
    pub fn kill_processes(&self) {
        dp::kill_processes(&self.name);
    }

    /// Stops owning the namespace: dropping the guard leaves it in place
    /// (the lab CLI's `up` hands it to a later `down`).
    pub fn disown(&mut self) {
        if let Some(guard) = self.guard.take() {
            guard.disown();
        }
    }

    /// Ends the processes inside and deletes the namespace now (also one
    /// this guard does not own).
    pub fn delete(mut self) {
        self.disown();
        let _ = dp::delete(&self.name);
    }

    /// Deletes every namespace whose name starts with `prefix` (ending the
    /// processes inside first); `lab down` and stale-lab cleanup use it.
    pub fn delete_all_with_prefix(prefix: &str) -> Vec<String> {
        let mut gone = Vec::new();
        for name in list() {
            if name.starts_with(prefix) {
                let _ = dp::delete(&name);
                gone.push(name);
            }
        }
        gone
    }
}

/// The names of every network namespace `ip netns` knows.
pub fn list() -> Vec<String> {
    dp::list()
}
