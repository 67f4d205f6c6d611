//! The external commands the tests and scripts run are all in
//! `tests/tools.txt`, with the package that provides each, and each is
//! installed by the script the table names.
//!
//! The scan reads the repository's test and script sources:
//! - Rust (every `.rs` under the crates' `src/`, `tests/`, `benches/`,
//!   `examples/`): `Command::new("x")`, `ip netns exec NS "x"` argument
//!   lists, `NetNs::command("x")`, and argv arrays given to the helpers that
//!   run them (`exec(&["x", ...])`, `in_ns(ns, &["x", ...])`,
//!   `run(&["x", ...])`);
//! - shell (`tests/*.sh`, `tests/k8s/*.sh`, `tests/moto/*.sh`,
//!   `tests/emulators/azure/*.sh`, `tests/emulators/gcp/*.sh`, `tests/guest-kernel/*.sh`,
//!   `tests/helm-render/*.sh`, `deploy/images/*/*.sh`, `vagrant/*.sh`): the
//!   command word of every simple command, also inside `$(...)`, after
//!   `exec`/`timeout`/`setsid`/`ip netns exec NS`, and `command -v x`.
//!   Builtins, functions the scripts define, variables and paths are not
//!   commands. Heredoc bodies and single-quoted strings are text, not code.
//!   `tests/guest-kernel/initramfs-init` is not scanned: it runs inside the
//!   guest's initramfs, where every command is a busybox applet; nor is
//!   `deploy/images/node/rootfs/`, which runs inside the node image, nor
//!   `vagrant/guest/`, which runs inside the Vagrant lab's VMs.
//!
//! The scan is a heuristic: it finds what the code's own idioms run. A new
//! idiom (another helper taking an argv) must be added to it.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use egret_tests::tools::{self, Tool};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

// ---------------------------------------------------------------- Rust ---

/// The string literal starting at `s` (after optional whitespace), if any.
fn literal_at(s: &str) -> Option<&str> {
    let s = s.trim_start().strip_prefix('"')?;
    let end = s.find('"')?;
    Some(&s[..end])
}

/// Where the bracket opened just before `s` closes, with strings skipped:
/// the text of the group up to it (exclusive), split into its top-level
/// arguments by `,`.
fn top_level_args(s: &str) -> Vec<&str> {
    let (mut depth, mut in_str, mut prev, mut start) = (0usize, false, ' ', 0);
    let mut args = Vec::new();
    for (i, c) in s.char_indices() {
        if in_str {
            if c == '"' && prev != '\\' {
                in_str = false;
            }
        } else {
            match c {
                '"' => in_str = true,
                '(' | '[' | '{' => depth += 1,
                ')' | ']' | '}' if depth == 0 => {
                    args.push(&s[start..i]);
                    return args;
                }
                ')' | ']' | '}' => depth -= 1,
                ',' if depth == 0 => {
                    args.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        prev = if prev == '\\' && c == '\\' { ' ' } else { c };
    }
    args.push(&s[start..]);
    args
}

/// The commands a Rust source runs, by line.
fn rust_commands(text: &str) -> Vec<(usize, String)> {
    // Line comments out (doc examples are not runs); keep line numbers.
    let code: String =
        text.lines().map(|l| if l.trim_start().starts_with("//") { "" } else { l }).collect::<Vec<_>>().join("\n");
    let line_of = |pos: usize| code[..pos].matches('\n').count() + 1;
    let mut found = Vec::new();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    // Command::new("x") and NetNs::command("x").
    for pat in ["Command::new(", ".command("] {
        for (pos, _) in code.match_indices(pat) {
            if let Some(lit) = literal_at(&code[pos + pat.len()..]) {
                found.push((line_of(pos), lit.to_string()));
            }
        }
    }
    // Command::new("setpriv").args(["--reuid=65534", "socat", ...]): the
    // first argument that is not an option is a command too.
    for (pos, _) in code.match_indices("Command::new(") {
        let rest = &code[pos + "Command::new(".len()..];
        if !literal_at(rest).is_some_and(|w| PROGRAM_WRAPPERS.contains(&w)) {
            continue;
        }
        let call = &rest[..rest.find(';').unwrap_or(rest.len())];
        let mut lits = call.split('"').skip(1).step_by(2).skip(1);
        if let Some(cmd) = lits.find(|l| !l.starts_with('-') && !l.chars().all(|c| c.is_ascii_digit())) {
            found.push((line_of(pos), cmd.to_string()));
        }
    }
    // "netns", "exec", NS, "x"
    for (pos, m) in code.match_indices("\"exec\"") {
        let before = code[..pos].trim_end().strip_suffix(',').map(str::trim_end);
        if !before.is_some_and(|b| b.ends_with("\"netns\"")) {
            continue;
        }
        let args = top_level_args(code[pos + m.len()..].trim_start().strip_prefix(',').unwrap_or(""));
        if let Some(lit) = args.get(1).and_then(|a| literal_at(a)) {
            found.push((line_of(pos), lit.to_string()));
        }
    }
    // exec(&["x", ...]), exec(ns, &["x", ...]), in_ns(ns, &["x", ...]), run(&["x", ...])
    for name in ["exec(", "in_ns(", "run("] {
        for (pos, _) in code.match_indices(name) {
            if code[..pos].chars().next_back().is_some_and(ident) {
                continue;
            }
            for arg in top_level_args(&code[pos + name.len()..]).iter().take(2) {
                let arg = arg.trim_start();
                let arg = arg.strip_prefix('&').unwrap_or(arg);
                if let Some(lit) = arg.strip_prefix('[').and_then(literal_at) {
                    found.push((line_of(pos), lit.to_string()));
                    break;
                }
            }
        }
    }
    found
}

// --------------------------------------------------------------- shell ---

/// Shell words that are not external commands.
const SHELL_WORDS: &[&str] = &[
    // keywords and builtins (bash)
    "!",
    "{",
    "}",
    "[",
    "[[",
    "]]",
    "((",
    "))",
    ":",
    ".",
    "case",
    "esac",
    "for",
    "select",
    "in",
    "if",
    "then",
    "else",
    "elif",
    "fi",
    "while",
    "until",
    "do",
    "done",
    "function",
    "time",
    "alias",
    "break",
    "builtin",
    "cd",
    "continue",
    "declare",
    "echo",
    "eval",
    "exit",
    "export",
    "false",
    "getopts",
    "hash",
    "kill",
    "let",
    "local",
    "mapfile",
    "printf",
    "pwd",
    "read",
    "readarray",
    "readonly",
    "return",
    "set",
    "shift",
    "source",
    "test",
    "trap",
    "true",
    "type",
    "ulimit",
    "umask",
    "unset",
    "wait",
];

/// Programs that run the command given after their options (themselves
/// commands too).
const PROGRAM_WRAPPERS: &[&str] = &["setsid", "setpriv", "sudo", "nice", "env", "xargs"];

/// Words after which the next word is a command again.
const WRAPPERS: &[&str] = &["exec", "then", "do", "else", "elif", "if", "while", "until", "!", "{", "time"];

/// Splits a line of shell into words and command separators, keeping
/// quoted strings as one word (single-quoted: opaque text). `$(` opens a
/// nested command list, returned separately.
fn shell_tokens(line: &str, nested: &mut Vec<String>) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut word = String::new();
    let chars: Vec<char> = line.chars().collect();
    let (mut i, mut depth) = (0, 0usize);
    let flush = |word: &mut String, tokens: &mut Vec<String>| {
        if !word.is_empty() {
            tokens.push(std::mem::take(word));
        }
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            '\'' => {
                let end = chars[i + 1..].iter().position(|&x| x == '\'').map_or(chars.len(), |p| i + 1 + p);
                word.extend(&chars[i..(end + 1).min(chars.len())]);
                i = end + 1;
                continue;
            }
            '$' | '(' if arithmetic(&chars, i).is_some() => {
                // $(( )) and (( )): arithmetic, no commands.
                let end = arithmetic(&chars, i).unwrap_or(chars.len());
                if c == '$' {
                    word.push_str("$(())");
                } else {
                    flush(&mut word, &mut tokens);
                }
                i = end;
                continue;
            }
            ')' if depth == 0 => {
                // A case pattern (`down)`, `-h|--help)`): not commands.
                word.clear();
                tokens.clear();
                tokens.push(";".into());
            }
            '(' if word.ends_with('=') => {
                // `x=(a b)`: an array's elements, data.
                let end = chars[i..].iter().position(|&x| x == ')').map_or(chars.len(), |p| i + p + 1);
                word.push_str("()");
                i = end;
                continue;
            }
            '$' if chars.get(i + 1) == Some(&'(') => {
                // $( ... ) with nesting: its text is a command list of its own.
                let (mut depth, mut j) = (1, i + 2);
                while j < chars.len() && depth > 0 {
                    match chars[j] {
                        '(' => depth += 1,
                        ')' => depth -= 1,
                        _ => {}
                    }
                    j += 1;
                }
                nested.push(chars[i + 2..j.saturating_sub(1).max(i + 2)].iter().collect());
                word.push_str("$()");
                i = j;
                continue;
            }
            '"' => {
                // Double quotes: one word, but $( ) inside still runs.
                let mut j = i + 1;
                word.push('"');
                while j < chars.len() && chars[j] != '"' {
                    if chars[j] == '\\' {
                        j += 2;
                        continue;
                    }
                    if let Some(end) = arithmetic(&chars, j) {
                        word.push_str("$(())");
                        j = end;
                        continue;
                    }
                    if chars[j] == '$' && chars.get(j + 1) == Some(&'(') {
                        let (mut depth, mut k) = (1, j + 2);
                        while k < chars.len() && depth > 0 {
                            match chars[k] {
                                '(' => depth += 1,
                                ')' => depth -= 1,
                                _ => {}
                            }
                            k += 1;
                        }
                        nested.push(chars[j + 2..k.saturating_sub(1).max(j + 2)].iter().collect());
                        word.push_str("$()");
                        j = k;
                        continue;
                    }
                    word.push(chars[j]);
                    j += 1;
                }
                word.push('"');
                i = j + 1;
                continue;
            }
            ' ' | '\t' => flush(&mut word, &mut tokens),
            ';' | '|' | '&' | '(' | ')' | '`' => {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                flush(&mut word, &mut tokens);
                tokens.push(";".into());
                // `>&2`, `2>&1`: a redirection, not a separator.
                if c == '&' && (tokens.len() >= 2 && tokens[tokens.len() - 2].ends_with('>')) {
                    tokens.pop();
                }
            }
            '#' if word.is_empty() => break,
            _ => word.push(c),
        }
        i += 1;
    }
    flush(&mut word, &mut tokens);
    tokens
}

/// If `$((` or `((` starts at `i`: the index just past its closing `))`.
fn arithmetic(chars: &[char], i: usize) -> Option<usize> {
    let open = match chars.get(i) {
        Some('$') => i + 1,
        Some('(') => i,
        _ => return None,
    };
    if chars.get(open) != Some(&'(') || chars.get(open + 1) != Some(&'(') {
        return None;
    }
    let mut depth = 0usize;
    for (k, &c) in chars.iter().enumerate().skip(open) {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(k + 1);
                }
            }
            _ => {}
        }
    }
    Some(chars.len())
}

/// Whether `text` ends inside a quoted string (which then goes on on the
/// next line).
fn open_quote(text: &str) -> bool {
    let (mut single, mut double, mut escaped) = (false, false, false);
    let mut prev = ' ';
    for c in text.chars() {
        if escaped {
            escaped = false;
        } else if single {
            single = c != '\'';
        } else if c == '\\' {
            escaped = true;
        } else if double {
            double = c != '"';
        } else if c == '#' && (prev == ' ' || prev == '\t') {
            return false;
        } else if c == '\'' {
            single = true;
        } else if c == '"' {
            double = true;
        }
        prev = c;
    }
    single || double
}

/// The command words of one line's simple commands.
fn line_commands(line: &str, functions: &BTreeSet<String>, out: &mut Vec<String>) {
    let mut nested = Vec::new();
    let tokens = shell_tokens(line, &mut nested);
    for segment in tokens.split(|t| t == ";") {
        let mut words = segment.iter().map(String::as_str).peekable();
        // Case patterns (`--keep)` arrives as `--keep` then a separator).
        let mut expect_command = true;
        while let Some(w) = words.next() {
            if !expect_command {
                break;
            }
            if w.contains('=') && !w.starts_with('=') && !w.starts_with('-') && !w.starts_with('"') {
                continue; // an assignment before the command
            }
            if w.starts_with('<') || w.starts_with('>') || w.chars().next().is_some_and(|c| c.is_ascii_digit()) {
                if matches!(w, "<" | ">" | ">>" | "<<<" | "2>" | "2>>") {
                    words.next();
                }
                continue; // a redirection
            }
            if WRAPPERS.contains(&w) {
                continue;
            }
            if PROGRAM_WRAPPERS.contains(&w) {
                out.push(w.into());
                while words.peek().is_some_and(|n| n.starts_with('-') || n.contains('=')) {
                    words.next();
                }
                continue;
            }
            if w == "timeout" {
                out.push(w.into());
                while words.peek().is_some_and(|n| n.starts_with('-')) {
                    words.next();
                }
                words.next(); // the duration
                continue;
            }
            if w == "command" {
                if words.peek() == Some(&"-v") {
                    words.next();
                }
                continue;
            }
            if w == "ip" {
                let rest: Vec<&str> = words.clone().take(3).collect();
                if rest.len() == 3 && rest[0] == "netns" && rest[1] == "exec" {
                    out.push("ip".into());
                    words.nth(2);
                    continue;
                }
            }
            if w == "inns" {
                continue; // apiserver.sh's wrapper: runs "$@" (in a namespace or not)
            }
            expect_command = false;
            let bare = w.trim_matches('"');
            if bare.is_empty()
                || bare.contains('$')
                || bare.contains('/')
                || bare.ends_with(')')
                || bare.starts_with('-')
                || SHELL_WORDS.contains(&bare)
                || functions.contains(bare)
                || !bare.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+'))
            {
                continue;
            }
            out.push(bare.to_string());
        }
    }
    for n in nested {
        line_commands(&n, functions, out);
    }
}

/// The `$(...)` command substitutions of a line of text.
fn substitutions(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut subs = Vec::new();
    let mut i = 0;
    while i + 1 < chars.len() {
        if chars[i] == '$' && chars[i + 1] == '(' && chars.get(i + 2) != Some(&'(') {
            let (mut depth, mut j) = (1, i + 2);
            while j < chars.len() && depth > 0 {
                match chars[j] {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                j += 1;
            }
            subs.push(chars[i + 2..j.saturating_sub(1).max(i + 2)].iter().collect());
            i = j;
        } else {
            i += 1;
        }
    }
    subs
}

/// The functions a script defines (`name() {`).
fn shell_functions(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim_start().trim_start_matches("function ");
            let (name, rest) = l.split_once("()")?;
            (rest.trim_start().starts_with('{') && name.chars().all(|c| c.is_alphanumeric() || c == '_'))
                .then(|| name.to_string())
        })
        .collect()
}

/// The commands a shell script runs, by line.
fn shell_commands(text: &str, functions: &BTreeSet<String>) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut heredoc: Option<(String, bool)> = None;
    let mut pending = String::new();
    let mut start_line = 0;
    let mut in_array = false;
    for (n, raw) in text.lines().enumerate() {
        if let Some((end, expands)) = &heredoc {
            if raw.trim() == end {
                heredoc = None;
            } else if *expands {
                // An unquoted delimiter: `$(...)` in the body runs.
                let mut cmds = Vec::new();
                for sub in substitutions(raw) {
                    line_commands(&sub, functions, &mut cmds);
                }
                found.extend(cmds.into_iter().map(|c| (n + 1, c)));
            }
            continue;
        }
        if pending.is_empty() {
            start_line = n + 1;
        }
        // Continuation lines join the next one.
        if let Some(head) = raw.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(raw);
        if open_quote(&pending) {
            pending.push('\n');
            continue;
        }
        let line = std::mem::take(&mut pending);
        // An array assignment's elements are data: `x=(a b)`, also over
        // several lines up to a line `)`.
        if in_array {
            in_array = line.trim() != ")";
            continue;
        }
        if line.trim_end().ends_with("=(") {
            in_array = true;
            continue;
        }
        if let Some(pos) = line.find("<<") {
            let tag = line[pos + 2..].trim_start_matches(['-', '<']).trim_start();
            let quoted = tag.starts_with(['\'', '"']);
            let tag: String =
                tag.trim_start_matches(['\'', '"']).chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            if !tag.is_empty() {
                heredoc = Some((tag, !quoted));
            }
        }
        let mut cmds = Vec::new();
        line_commands(&line, functions, &mut cmds);
        found.extend(cmds.into_iter().map(|c| (start_line, c)));
    }
    found
}

// ---------------------------------------------------------------- scan ---

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | "fuzz" | ".git") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// Every (file, line, command) the tests and scripts run.
fn scan() -> Vec<(String, usize, String)> {
    let root = repo();
    let mut found = Vec::new();
    let mut sources = Vec::new();
    for krate in ["bpf", "dataplane", "controlplane", "tests", "benches"] {
        for sub in ["src", "tests", "benches", "examples"] {
            rust_files(&root.join(krate).join(sub), &mut sources);
        }
        sources.push(root.join(krate).join("build.rs"));
    }
    // Not this file: its examples are not runs (it runs dpkg-query, listed
    // for the scripts, and dpkg, of the same package and always there).
    for file in sources.iter().filter(|p| p.exists() && !p.ends_with("tests/tests/tools_table.rs")) {
        let text = std::fs::read_to_string(file).unwrap();
        let rel = file.strip_prefix(&root).unwrap().display().to_string();
        found.extend(rust_commands(&text).into_iter().map(|(l, c)| (rel.clone(), l, c)));
    }
    let mut scripts = Vec::new();
    for dir in [
        "tests",
        "tests/k8s",
        "tests/moto",
        "tests/emulators/azure",
        "tests/emulators/gcp",
        "tests/guest-kernel",
        "tests/helm-render",
        "deploy/images/node",
        "deploy/images/container",
        "vagrant",
    ] {
        for e in std::fs::read_dir(root.join(dir)).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "sh") {
                scripts.push(p);
            }
        }
    }
    scripts.sort();
    let texts: Vec<(PathBuf, String)> =
        scripts.into_iter().map(|p| (p.clone(), std::fs::read_to_string(&p).unwrap())).collect();
    // Functions of any script count everywhere (common.sh is sourced by the others).
    let functions: BTreeSet<String> = texts.iter().flat_map(|(_, t)| shell_functions(t)).collect();
    for (p, text) in &texts {
        let rel = p.strip_prefix(&root).unwrap().display().to_string();
        found.extend(shell_commands(text, &functions).into_iter().map(|(l, c)| (rel.clone(), l, c)));
    }
    found
}

/// The places whose command is not in `table`, as report lines.
fn unlisted(found: &[(String, usize, String)], table: &[Tool]) -> Vec<String> {
    let known: BTreeSet<&str> = table.iter().map(|t| t.command).collect();
    found
        .iter()
        .filter(|(_, _, c)| !known.contains(c.as_str()))
        .map(|(f, l, c)| format!("{f}:{l}: runs `{c}`, which tests/tools.txt does not list"))
        .collect()
}

#[test]
fn every_command_the_tests_and_scripts_run_is_in_the_table() {
    let found = scan();
    // The scan finds what it must: a guard against a scanner that finds nothing.
    for (file, cmd) in [
        ("bpf/tests/attach.rs", "ping"),
        ("tests/src/netns.rs", "ip"),
        ("tests/guest-kernel/egret-tests.sh", "python3"),
        ("tests/k8s/apiserver.sh", "openssl"),
        ("tests/k8s/apiserver.sh", "curl"),
        ("tests/emulators/azure/azure-emulator.sh", "python3"),
        ("tests/emulators/gcp/gcp-emulator.sh", "curl"),
        ("tests/guest-kernel/run.sh", "qemu-system-x86_64"),
    ] {
        assert!(found.iter().any(|(f, _, c)| f == file && c == cmd), "the scan did not find `{cmd}` in {file}");
    }
    let mut per_command: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for (f, _, c) in &found {
        per_command.entry(c).or_default().insert(f);
    }
    for (c, files) in &per_command {
        println!("tools_table: {c:<20} {}", files.iter().copied().collect::<Vec<_>>().join(" "));
    }
    let bad = unlisted(&found, &tools::table());
    assert!(
        bad.is_empty(),
        "commands missing from tests/tools.txt (add each with its Debian package):\n{}",
        bad.join("\n")
    );
    // Every row is used somewhere (a stale row would hide nothing, but mislead).
    let used: BTreeSet<&str> = found.iter().map(|(_, _, c)| c.as_str()).collect();
    let stale: Vec<&str> = tools::table().iter().map(|t| t.command).filter(|c| !used.contains(c)).collect();
    assert!(stale.is_empty(), "tests/tools.txt lists commands nothing runs: {stale:?}");
}

#[test]
fn a_table_without_ping_is_caught_naming_the_file() {
    let mut table = tools::table();
    table.retain(|t| t.command != "ping");
    let bad = unlisted(&scan(), &table);
    assert!(
        bad.iter().any(|l| l.starts_with("bpf/tests/attach.rs:")
            && l.ends_with("runs `ping`, which tests/tools.txt does not list")),
        "{bad:?}"
    );
}

#[test]
fn the_scanners_find_the_idioms() {
    let rust = r#"
        // Command::new("commented")
        let a = Command::new("ip").args(["netns", "exec", &self.b, "ping", "-c", "1"]);
        let b = std::process::Command::new(
            "kill");
        ns.exec(&["ethtool", "-K"]);
        topo.exec(ns, &["nft", "-f"], None);
        common::in_ns(&ns, &["sysctl", "-w"]);
        run(&["tc", "qdisc"]);
        let c = ns.command("tcpdump");
        fixtures::run(&s);
        self.ip(&["link", "add"]);
        cmd.args(["netns", "exec", &self.ns]).arg(&bin);
    "#;
    let got: Vec<String> = rust_commands(rust).into_iter().map(|(_, c)| c).collect();
    assert_eq!(got, ["ip", "kill", "tcpdump", "ping", "ethtool", "nft", "sysctl", "tc"]);

    let functions = shell_functions("helper() { :; }\n");
    let sh =
        "set -e\nx=$(awk '{print $1; sed}' f | sort -u)\nFOO=1 timeout 5 qemu-img info \"$(command -v busybox)\"\n\
              helper arg\ncat <<EOF\nip netns list\nEOF\nif ! grep -q x y; then exec setsid socat - -; fi\n\
              ip netns exec \"$ns\" curl -s x >&2 || true\n  --keep) keep=1 ;;\n\"$bin\" down\nlong \\\n  --arg\n";
    let got: Vec<String> = shell_commands(sh, &functions).into_iter().map(|(_, c)| c).collect();
    assert_eq!(
        got,
        ["awk", "sort", "timeout", "qemu-img", "busybox", "cat", "grep", "setsid", "socat", "ip", "curl", "long"]
    );
    // Arithmetic, case patterns and multi-line quotes hold no commands.
    let sh = "if ((keep)); then n=$((lo - 1)); fi\ncase $1 in\n  down|up) tr a b ;;\nesac\nbash -c 'one\nimport x\n' && \"$(( 1 + 2 ))\"\n";
    let got: Vec<String> = shell_commands(sh, &functions).into_iter().map(|(_, c)| c).collect();
    assert_eq!(got, ["tr", "bash"]);
    let sh = "cat <<EOF\nkey: $(base64 -w0 <f)\nip netns list\nEOF\ncat <<'EOF'\n$(gzip)\nEOF\n";
    let got: Vec<String> = shell_commands(sh, &functions).into_iter().map(|(_, c)| c).collect();
    assert_eq!(got, ["cat", "base64", "cat"]);
    let got: Vec<String> =
        rust_commands(r#"Command::new("setpriv").args(["--reuid=1", "--clear-groups", "socat", "-"]);"#)
            .into_iter()
            .map(|(_, c)| c)
            .collect();
    assert_eq!(got, ["setpriv", "socat"]);
    let sh = "PKGS=(clang llvm)\nlist=(\n  one\n  \"two|\"\n)\nmake x\n";
    let got: Vec<String> = shell_commands(sh, &functions).into_iter().map(|(_, c)| c).collect();
    assert_eq!(got, ["make"]);
}

/// What `dpkg -L package` lists for the package and the packages it
/// directly (pre-)depends on (`python3` brings `/usr/bin/python3` through
/// `python3-minimal`); None when dpkg does not have the
/// package installed.
fn package_files(package: &str) -> Option<Vec<PathBuf>> {
    let status =
        Command::new("dpkg-query").args(["-W", "-f=${Status}\\t${Pre-Depends}, ${Depends}", package]).output().ok()?;
    let text = String::from_utf8_lossy(&status.stdout).into_owned();
    let (state, depends) = text.split_once('\t')?;
    if !status.status.success() || !state.ends_with("install ok installed") {
        return None;
    }
    let mut names = vec![package.to_string()];
    names.extend(
        depends
            .split([',', '|'])
            .filter_map(|d| d.split_whitespace().next())
            .map(|d| d.split(':').next().unwrap_or(d).to_string()),
    );
    let mut files = Vec::new();
    for name in names {
        let Ok(out) = Command::new("dpkg").args(["-L", &name]).output() else { continue };
        files.extend(String::from_utf8_lossy(&out.stdout).lines().map(PathBuf::from));
    }
    Some(files)
}

#[test]
fn every_table_entry_is_installed_by_its_script_and_present() {
    let root = repo();
    let mut problems = Vec::new();
    let mut by_installer: BTreeMap<&str, usize> = BTreeMap::new();
    for t in tools::table() {
        *by_installer.entry(t.installer).or_default() += 1;
        if t.installer == "rustup" {
            if tools::on_path(t.command).is_none() {
                problems.push(tools::missing(t.command));
            }
            continue;
        }
        let script = root.join(t.installer);
        let Ok(text) = std::fs::read_to_string(&script) else {
            problems.push(format!("{}: installer {} is not a script of the repository", t.command, t.installer));
            continue;
        };
        // The script installs the package: install-deps.sh from this table, the
        // others name it themselves (or through common.sh's lists).
        let names_it = if t.installer == "tests/install-deps.sh" {
            text.contains("tests/tools.txt") || text.contains("tools.txt")
        } else {
            let common = std::fs::read_to_string(root.join("tests/k8s/common.sh")).unwrap_or_default();
            let word = |c: char| c.is_alphanumeric() || matches!(c, '-' | '.' | '+');
            text.split(|c| !word(c)).chain(common.split(|c| !word(c))).any(|w| w == t.package)
        };
        if !names_it {
            problems.push(format!("{}: {} does not install package {}", t.command, t.installer, t.package));
        }
        // Present: what install-deps.sh installs must be there now; what another
        // script installs, once that package is installed.
        let files = package_files(t.package);
        if files.is_none() && t.installer != "tests/install-deps.sh" {
            continue;
        }
        let Some(files) = files else {
            problems.push(format!("{}: package not installed", tools::missing(t.command)));
            continue;
        };
        // The package (or one it depends on) has the command in a bin
        // directory, or has the file the command on PATH resolves to (`awk`
        // is mawk's through the alternatives system).
        let in_bin = files.iter().any(|f| {
            f.file_name().is_some_and(|n| n == t.command)
                && f.parent().and_then(Path::file_name).is_some_and(|d| d == "bin" || d == "sbin")
        });
        let resolved = tools::on_path(t.command).and_then(|p| std::fs::canonicalize(p).ok());
        let provided =
            in_bin || resolved.is_some_and(|r| files.iter().any(|f| std::fs::canonicalize(f).is_ok_and(|c| c == r)));
        if !provided {
            problems.push(format!("{}: package {} does not provide it (dpkg -L)", t.command, t.package));
        }
        // What install-deps.sh installs is runnable now. (Go, from another
        // script, lives off PATH in /usr/lib/go-1.19/bin.)
        if t.installer == "tests/install-deps.sh" && tools::on_path(t.command).is_none() {
            problems.push(format!("{}: package installed, yet not on PATH", tools::missing(t.command)));
        }
    }
    println!("tools_table: {by_installer:?}");
    assert!(problems.is_empty(), "tests/tools.txt entries not as they say:\n{}", problems.join("\n"));
}
