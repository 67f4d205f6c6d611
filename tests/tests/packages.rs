//! `tests/packages.sh`, the one package installer, on a machine whose
//! packages differ from the archive's: a sandboxed apt (its own status
//! file, lists, cache and a `file:` archive, through `APT_CONFIG` and
//! `DPKG_ADMINDIR`; the machine's own apt and dpkg are not touched) models
//! what a fresh machine of this kind has. It came with `qemu-utils` 10.0 from
//! bookworm-backports, whose `Breaks: qemu-system-common (<< 8.0)` made apt
//! remove it when a script installed bookworm's `qemu-system-x86` 7.2 alone,
//! so `qemu-img` vanished mid-run (issue 27, part 0). Here `fam-utils` 2.0
//! (installed, no archive carries it) breaks `fam-common` << 2.0, which the
//! archive's `fam-system` 1.0 needs: the same shape.
//!
//! The installer runs in its dry-run mode (it plans with `apt-get -s` and
//! prints the transaction it would run); what it asks apt for is checked.
//! Skipped (with a message) without apt.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic, clippy::print_stdout)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

const ARCHIVE: &str = "\
Package: fam-utils
Version: 1.0
Architecture: amd64
Source: fam
Maintainer: egret <egret@example.org>
Filename: fam-utils_1.0_amd64.deb
Size: 1
Description: the archive's build of the family's tools

Package: fam-common
Version: 1.0
Architecture: amd64
Source: fam
Maintainer: egret <egret@example.org>
Filename: fam-common_1.0_amd64.deb
Size: 1
Description: what fam-system needs at its own version

Package: fam-system
Version: 1.0
Architecture: amd64
Source: fam
Depends: fam-common (= 1.0)
Maintainer: egret <egret@example.org>
Filename: fam-system_1.0_amd64.deb
Size: 1
Description: like qemu-system-x86

Package: plain
Version: 3.0
Architecture: amd64
Maintainer: egret <egret@example.org>
Filename: plain_3.0_amd64.deb
Size: 1
Description: a package with no family
";

/// What the machine has: fam-utils 2.0 (like qemu-utils from backports),
/// and `lonely`, which no archive carries and which also breaks fam-common.
fn status(lonely: bool) -> String {
    let mut s = String::from(
        "Package: fam-utils\nStatus: install ok installed\nVersion: 2.0\nArchitecture: amd64\nSource: fam\n\
         Breaks: fam-common (<< 2.0)\nMaintainer: egret <egret@example.org>\nDescription: a newer build\n",
    );
    if lonely {
        s.push_str(
            "\nPackage: lonely\nStatus: install ok installed\nVersion: 9.0\nArchitecture: amd64\n\
             Breaks: fam-common (<< 2.0)\nMaintainer: egret <egret@example.org>\nDescription: no archive has it\n",
        );
    }
    s
}

struct Sandbox {
    dir: PathBuf,
}

impl Sandbox {
    fn new(name: &str, lonely: bool) -> Option<Sandbox> {
        if Command::new("apt-get").arg("--version").output().is_err() {
            egret_tests::skip(name, "no apt-get");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("egret-packages-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for d in ["repo", "lists/partial", "cache/archives/partial", "parts", "prefs", "admin/info", "admin/updates"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        std::fs::write(dir.join("repo/Packages"), ARCHIVE).unwrap();
        std::fs::write(dir.join("admin/status"), status(lonely)).unwrap();
        std::fs::write(dir.join("admin/available"), "").unwrap();
        std::fs::write(dir.join("sources.list"), format!("deb [trusted=yes] file:{} ./\n", dir.join("repo").display()))
            .unwrap();
        let d = dir.display();
        std::fs::write(
            dir.join("apt.conf"),
            format!(
                "Dir::State::status \"{d}/admin/status\";\nDir::State::Lists \"{d}/lists\";\nDir::Cache \"{d}/cache\";\n\
                 Dir::Etc::SourceList \"{d}/sources.list\";\nDir::Etc::SourceParts \"{d}/parts\";\n\
                 Dir::Etc::Preferences \"{d}/preferences\";\nDir::Etc::PreferencesParts \"{d}/prefs\";\n\
                 APT::Sandbox::User \"root\";\nAPT::Architecture \"amd64\";\nAPT::Architectures {{ \"amd64\"; }};\n\
                 Dir::Bin::dpkg \"/bin/false\";\n"
            ),
        )
        .unwrap();
        std::fs::write(dir.join("tools.txt"), "fam-img fam-utils tests/install-deps.sh\n").unwrap();
        let sb = Sandbox { dir };
        let update = sb.command("apt-get").args(["update", "-q"]).output().unwrap();
        assert!(update.status.success(), "apt-get update in the sandbox: {}", String::from_utf8_lossy(&update.stderr));
        Some(sb)
    }

    fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        c.env("APT_CONFIG", self.dir.join("apt.conf"))
            .env("DPKG_ADMINDIR", self.dir.join("admin"))
            .env("EGRET_TOOLS_TABLE", self.dir.join("tools.txt"))
            .env("EGRET_PKGS_DRY_RUN", "1");
        c
    }

    /// `egret_ensure_pkgs PKGS` in dry-run mode.
    fn ensure(&self, pkgs: &str) -> Output {
        let script = format!("source {}; egret_ensure_pkgs {pkgs}", repo().join("tests/packages.sh").display());
        self.command("bash").args(["-c", &script]).output().unwrap()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The transaction the installer would run: the line after `apt-get install`.
fn transaction(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout);
    out.lines()
        .find_map(|l| l.trim().strip_prefix("apt-get install "))
        .map(|l| l.split(" (missing").next().unwrap_or(l).to_owned())
        .unwrap_or_default()
}

#[test]
fn a_newer_package_the_machine_came_with_is_never_removed() {
    let Some(sb) = Sandbox::new("newer", false) else {
        return;
    };
    // The reproduction: what a script that installed only the missing
    // package used to run makes apt remove the newer build.
    let plain = sb.command("apt-get").args(["install", "-s", "-q", "fam-system"]).output().unwrap();
    let plan = String::from_utf8_lossy(&plain.stdout);
    assert!(plan.lines().any(|l| l.starts_with("Remv fam-utils")), "the sandbox reproduces the removal:\n{plan}");

    // The installer asks for the family at the archive's version, in one
    // transaction: fam-utils stays (at 1.0, which agrees with fam-system).
    for asked in ["fam-system", "fam-system fam-utils"] {
        let o = sb.ensure(asked);
        assert!(o.status.success(), "{asked}: {}", String::from_utf8_lossy(&o.stderr));
        let t = transaction(&o);
        let words: Vec<&str> = t.split_whitespace().collect();
        assert!(words.contains(&"fam-system") && words.contains(&"fam-utils=1.0"), "{asked}: asked for {t:?}");
        // That transaction removes nothing.
        let sim =
            sb.command("apt-get").args(["install", "-s", "-q", "--allow-downgrades"]).args(&words).output().unwrap();
        let sim = String::from_utf8_lossy(&sim.stdout);
        assert!(!sim.lines().any(|l| l.starts_with("Remv")), "{asked}: {t} removes something:\n{sim}");
    }

    // A package with no family is asked for as it is.
    assert_eq!(transaction(&sb.ensure("plain")), "plain");
}

#[test]
fn what_cannot_be_installed_without_a_removal_fails_naming_it() {
    let Some(sb) = Sandbox::new("lonely", true) else {
        return;
    };
    let o = sb.ensure("fam-system");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "nothing may be removed: {}", String::from_utf8_lossy(&o.stdout));
    assert!(err.contains("without removing lonely"), "{err}");
    assert!(transaction(&o).is_empty(), "nothing was installed");
}

#[test]
fn a_command_missing_after_an_install_is_named_with_its_package() {
    let script = format!(
        "source {}; egret_check_tools 'egret-no-such-command some-package' 'apt-get install x'",
        repo().join("tests/packages.sh").display()
    );
    let o = Command::new("bash").args(["-c", &script]).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("after apt-get install x, the command egret-no-such-command (package some-package) is missing"),
        "{err}"
    );
}
