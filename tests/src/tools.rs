//! The external commands Egret's tests and scripts run, and where each comes
//! from: the table `tests/tools.txt` (command, Debian package, the script
//! that installs it), which `tests/install-deps.sh` installs from and the
//! test `tests/tests/tools_table.rs` keeps complete.
//!
//! A command that is not there must fail as "missing tool X (package Y):
//! run tests/install-deps.sh", not as a puzzling assertion further on. This
//! file has no dependencies beyond std so that the test code of every crate
//! can include it without depending on `egret-tests` (which would make a
//! cycle): `#[path = "../../tests/src/tools.rs"] mod tools;`.

#![allow(dead_code)] // Each including crate uses a part of it.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Output;

/// The table, as read at build time.
pub const TABLE: &str = include_str!("../tools.txt");

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tool {
    /// The command, as the tests and scripts run it.
    pub command: &'static str,
    /// The Debian package that provides it.
    pub package: &'static str,
    /// What installs that package (a script of the repository, or `rustup`).
    pub installer: &'static str,
}

/// Parses table text: `command package installer` per line, `#` comments.
/// Errors name the line that is not of that form.
pub fn parse(text: &'static str) -> Result<Vec<Tool>, String> {
    let mut tools = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&'static str> = line.split_whitespace().collect();
        match f.as_slice() {
            [command, package, installer] => tools.push(Tool { command, package, installer }),
            _ => return Err(format!("tests/tools.txt line {}: want `command package installer`: {line:?}", n + 1)),
        }
    }
    Ok(tools)
}

/// The table's rows.
///
/// # Panics
/// When `tests/tools.txt` is malformed (the tools_table test says where).
pub fn table() -> Vec<Tool> {
    #[allow(clippy::panic)]
    parse(TABLE).unwrap_or_else(|e| panic!("{e}"))
}

/// The row of `command`: the row that names it as given (a command off
/// `PATH` is listed by its path, `/usr/lib/cni/bridge`), else the row of its
/// file name (`/usr/bin/nft` is `nft`'s).
pub fn lookup(command: &str) -> Option<Tool> {
    let name = Path::new(command).file_name().and_then(OsStr::to_str).unwrap_or(command);
    let table = table();
    table.iter().find(|t| t.command == command).or_else(|| table.iter().find(|t| t.command == name)).copied()
}

/// The message for a command that is not installed.
pub fn missing(command: &str) -> String {
    match lookup(command) {
        Some(t) if t.installer == "rustup" => {
            format!("missing tool {} (from {}): install Rust (https://rustup.rs)", t.command, t.package)
        }
        Some(t) => format!("missing tool {} (package {}): run {}", t.command, t.package, t.installer),
        None => format!(
            "missing tool {command} (not in tests/tools.txt: add it there with its Debian package, \
             then run tests/install-deps.sh)"
        ),
    }
}

/// Where `command` is found on `PATH` (as `execvp` and `ip netns exec`
/// would find it).
pub fn on_path(command: &str) -> Option<PathBuf> {
    if command.contains('/') {
        return Path::new(command).is_file().then(|| PathBuf::from(command));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(command)).find(|p| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// `Ok` when `command` is on `PATH`, else the "missing tool" message.
pub fn require(command: &str) -> Result<PathBuf, String> {
    on_path(command).ok_or_else(|| missing(command))
}

/// Turns a failure to spawn `program` into the "missing tool" message when
/// the program does not exist (`NotFound`); other errors stay as they are.
pub fn explain_spawn(program: &OsStr, e: std::io::Error) -> std::io::Error {
    if e.kind() == std::io::ErrorKind::NotFound {
        std::io::Error::new(e.kind(), missing(&program.to_string_lossy()))
    } else {
        e
    }
}

/// The program `ip netns exec` could not start, from a failed run's stderr
/// (`exec of "ping" failed: No such file or directory`), as the "missing
/// tool" message.
pub fn explain_netns_exec(out: &Output) -> Option<String> {
    if out.status.success() {
        return None;
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let rest = stderr.split("exec of \"").nth(1)?;
    let (program, tail) = rest.split_once('"')?;
    tail.contains("No such file or directory").then(|| missing(program))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_tool_its_package_and_the_script() {
        assert_eq!(missing("ping"), "missing tool ping (package iputils-ping): run tests/install-deps.sh");
        assert_eq!(missing("/usr/bin/nft"), "missing tool nft (package nftables): run tests/install-deps.sh");
        assert_eq!(
            missing("/usr/lib/cni/bridge"),
            "missing tool /usr/lib/cni/bridge (package containernetworking-plugins): run tests/install-deps.sh"
        );
        assert!(missing("no-such-tool").contains("not in tests/tools.txt"));
        let e = explain_spawn(OsStr::new("ping"), std::io::Error::from(std::io::ErrorKind::NotFound));
        assert_eq!(e.to_string(), missing("ping"));
    }

    #[test]
    fn an_ip_netns_exec_of_a_missing_program_is_explained() {
        use std::os::unix::process::ExitStatusExt;
        let out = Output {
            status: std::process::ExitStatus::from_raw(255 << 8),
            stdout: Vec::new(),
            stderr: b"exec of \"ping\" failed: No such file or directory\n".to_vec(),
        };
        assert_eq!(explain_netns_exec(&out), Some(missing("ping")));
        assert_eq!(explain_netns_exec(&Output { stderr: b"RTNETLINK answers: File exists".to_vec(), ..out }), None);
    }

    #[test]
    fn the_table_parses_and_names_each_command_once() {
        let t = parse(TABLE).unwrap();
        let mut names: Vec<&str> = t.iter().map(|t| t.command).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a command listed twice in tests/tools.txt");
        assert!(parse("ping iputils-ping\n").is_err());
    }
}
