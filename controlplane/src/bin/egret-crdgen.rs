//! Writes Egret's CustomResourceDefinitions, generated from the Rust types in
//! `controlplane/src/k8s/crd.rs`, into a deploy directory:
//! `egret-crdgen DEPLOY_DIR` writes `DEPLOY_DIR/crds/*.yaml` and
//! `DEPLOY_DIR/helm/egret/crds/*.yaml`; without an argument the CRDs go to
//! stdout as one multi-document YAML stream.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use egret_controlplane::k8s::crd::crd_files;

fn main() -> ExitCode {
    let files = match crd_files() {
        Ok(f) => f,
        Err(e) => {
            eprintln!("egret-crdgen: cannot serialise the CRDs: {e}");
            return ExitCode::FAILURE;
        }
    };
    match std::env::args_os().nth(1).map(PathBuf::from) {
        None => {
            let mut out = std::io::stdout().lock();
            for (_, body) in &files {
                if let Err(e) = out.write_all(body.as_bytes()) {
                    eprintln!("egret-crdgen: stdout: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        Some(deploy) => {
            for dir in [deploy.join("crds"), deploy.join("helm").join("egret").join("crds")] {
                if let Err(e) = std::fs::create_dir_all(&dir) {
                    eprintln!("egret-crdgen: {}: {e}", dir.display());
                    return ExitCode::FAILURE;
                }
                for (name, body) in &files {
                    let path = dir.join(name);
                    if let Err(e) = std::fs::write(&path, body) {
                        eprintln!("egret-crdgen: {}: {e}", path.display());
                        return ExitCode::FAILURE;
                    }
                    eprintln!("wrote {}", path.display());
                }
            }
        }
    }
    ExitCode::SUCCESS
}
