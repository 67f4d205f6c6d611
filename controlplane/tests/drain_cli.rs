//! `egret drain` against an API server that refuses connections: it tries
//! again (the patch is idempotent; beside two CPU hogs the HA lab's control
//! plane refused connections or answered 500 "etcdserver: request timed
//! out"), then fails naming the Node and the error.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

#[test]
fn drain_retries_a_refused_connection_then_names_the_node() {
    // A port nothing listens on (bound, then closed), on loopback.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: http://127.0.0.1:{port}\n\
             contexts:\n- name: c\n  context:\n    cluster: c\n    user: u\ncurrent-context: c\n\
             users:\n- name: u\n  user:\n    token: t\n"
        ),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_egret"))
        .args(["drain", "gw-9", "--kubeconfig", kubeconfig.to_str().unwrap()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    for attempt in 1..5 {
        assert!(stderr.contains(&format!("(attempt {attempt} of 5; trying again)")), "{stderr}");
    }
    assert!(stderr.lines().last().is_some_and(|l| l.starts_with("egret drain: Node gw-9: ")), "{stderr}");
}
