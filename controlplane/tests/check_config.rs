//! `egret check-config` on a Kubernetes-mode file: it prints the Lease
//! timing and what `kubernetes.ha` resolves to (issue 28 §6: it said
//! nothing of the channel), and names a bad HA field with its value.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

const K8S: &str = r#"
interfaces:
  - name: eth1
    role: both
kubernetes:
  nodeName: gw-1
  ha:
    address: 192.0.2.11
    keyFile: /etc/egret-ha/key
    acceptKeyFiles: ACCEPT
    loneFailsafe: LONE
"#;

fn check(lone: &str) -> (bool, String) {
    check_with(lone, "[]")
}

fn check_with(lone: &str, accept: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gw.yaml");
    std::fs::write(&file, K8S.replace("LONE", lone).replace("ACCEPT", accept)).unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_egret")).args(["check-config", file.to_str().unwrap()]).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn check_config_shows_the_channel_and_names_a_bad_field() {
    let (ok, text) = check("2m");
    assert!(ok, "{text}");
    assert!(text.contains("leases: duration 4s, renew deadline 2s, retry period 500ms"), "{text}");
    assert!(
        text.contains("ha: channel on 192.0.2.11:4720 (key /etc/egret-ha/key), liveness 2s, resync 30s, lone failsafe 120s, peer cache none"),
        "{text}"
    );
    let (ok, text) = check("soon");
    assert!(!ok);
    assert!(text.contains("kubernetes.ha.loneFailsafe"), "{text}");
    assert!(text.contains("\"soon\""), "{text}");
}

/// The keys a roll adds (ADR 0029): shown, and a bad list refused naming
/// the entry and its value.
#[test]
fn check_config_shows_the_accepted_keys_and_names_a_bad_entry() {
    let (ok, text) = check_with("2m", "[/etc/egret-ha/next, /etc/egret-ha/previous]");
    assert!(ok, "{text}");
    assert!(
        text.contains("(key /etc/egret-ha/key; also accepted: /etc/egret-ha/next, /etc/egret-ha/previous)"),
        "{text}"
    );
    let (ok, text) = check_with("2m", "[/etc/egret-ha/next, /etc/egret-ha/key]");
    assert!(!ok);
    assert!(text.contains("kubernetes.ha.acceptKeyFiles[1]: \"/etc/egret-ha/key\" is named twice"), "{text}");
    let (ok, text) = check_with("2m", "[\"\"]");
    assert!(!ok);
    assert!(text.contains("kubernetes.ha.acceptKeyFiles[0]: empty"), "{text}");
}
