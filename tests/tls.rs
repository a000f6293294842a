//! TLS on every link, with real processes on loopback: the ring still reproduces
//! llama.cpp, a node without the cluster certificate (or without TLS) is refused with
//! an error that says so, and the worker keeps serving.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use baton_cluster::{connect_cluster, ClusterOptions};
use baton_ggml::LlamaModel;
use baton_net::{LinkOptions, TlsConfig};
use common::worker::{assert_prompts_match, greedy, reference, WorkerProc};
use common::{model, GEMMA3, PROMPTS, QWEN2};

const TOKEN: &str = "test-tls-secret";

fn models_dir() -> PathBuf {
    model(QWEN2).parent().unwrap().to_path_buf()
}

fn tempdir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("baton-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A cluster certificate made by `baton cert`, as users make one; removed on drop.
struct Cert {
    cert: PathBuf,
    key: PathBuf,
}

impl Cert {
    fn new(tag: &str) -> Cert {
        let dir = tempdir(tag);
        let out = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["cert", "--out"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        Cert {
            cert: dir.join("cluster.crt"),
            key: dir.join("cluster.key"),
        }
    }

    fn worker_args(&self) -> Vec<&str> {
        vec![
            "--tls-cert",
            self.cert.to_str().unwrap(),
            "--tls-key",
            self.key.to_str().unwrap(),
        ]
    }

    fn config(&self) -> Arc<TlsConfig> {
        Arc::new(TlsConfig::from_pem_files(&self.cert, &self.key).unwrap())
    }
}

impl Drop for Cert {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.cert.parent().unwrap());
    }
}

fn options(tls: Option<Arc<TlsConfig>>) -> ClusterOptions {
    ClusterOptions {
        token: Some(TOKEN.into()),
        n_ctx: 512,
        repack: true,
        link: LinkOptions {
            tls,
            ..LinkOptions::default()
        },
        ..Default::default()
    }
}

#[test]
fn qwen2_on_two_tls_workers_matches_llama_cpp() {
    let cert = Cert::new("tls-ring");
    let path = model(QWEN2);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let w0 = WorkerProc::start(&models_dir(), Some(TOKEN), &cert.worker_args());
    let w1 = WorkerProc::start(&models_dir(), Some(TOKEN), &cert.worker_args());
    let mut ring = connect_cluster(
        &path,
        &[w0.addr.clone(), w1.addr.clone()],
        &options(Some(cert.config())),
    )
    .unwrap();
    assert_eq!(ring.plan.stages.len(), 2);
    assert_prompts_match(&mut ring, &oracle, "qwen2 over TLS");
}

#[test]
fn a_head_without_tls_is_refused_and_the_worker_keeps_serving() {
    let cert = Cert::new("tls-plain-head");
    let path = model(GEMMA3);
    let oracle = LlamaModel::load_full(&path, true).unwrap();
    let mut worker = WorkerProc::start(&models_dir(), Some(TOKEN), &cert.worker_args());
    let err = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options(None))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(&worker.addr) && err.contains("requires TLS") && err.contains("--tls-cert"),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(200));
    let log = worker.log();
    assert!(
        log.contains("dropping connection") && log.contains("plain TCP"),
        "worker log: {log}"
    );

    // A head with the certificate is served.
    let mut ring = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options(Some(cert.config()))).unwrap();
    let prompt = oracle.tokenize(PROMPTS[0], true, true).unwrap();
    assert_eq!(greedy(&mut ring, &prompt, 8, &oracle), reference(&oracle, &prompt, 8));
    assert!(worker.is_running());
}

#[test]
fn a_head_with_another_certificate_is_refused_on_both_sides() {
    let (ours, theirs) = (Cert::new("tls-ours"), Cert::new("tls-theirs"));
    let path = model(GEMMA3);
    let mut worker = WorkerProc::start(&models_dir(), Some(TOKEN), &ours.worker_args());
    let err = connect_cluster(
        &path,
        std::slice::from_ref(&worker.addr),
        &options(Some(theirs.config())),
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(
        err.contains(&worker.addr) && err.contains("not this cluster's"),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(200));
    let log = worker.log();
    assert!(
        log.contains("dropping connection") && log.contains("refused this node's certificate"),
        "worker log: {log}"
    );
    assert!(worker.is_running());
    let ring = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options(Some(ours.config())));
    assert!(ring.is_ok(), "the right certificate is still served");
}

#[test]
fn a_tls_head_against_a_plain_worker_gets_a_clear_error() {
    let cert = Cert::new("tls-plain-worker");
    let path = model(GEMMA3);
    let worker = WorkerProc::start(&models_dir(), Some(TOKEN), &[]);
    let err = connect_cluster(&path, std::slice::from_ref(&worker.addr), &options(Some(cert.config())))
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains(&worker.addr) && err.contains("TLS") && err.contains("without TLS"),
        "{err}"
    );
    std::thread::sleep(Duration::from_millis(200));
    let log = worker.log();
    assert!(log.contains("started a TLS handshake"), "worker log: {log}");
}

#[test]
fn local_workers_get_the_heads_certificate() {
    // `baton run --local-workers` with TLS writes what it writes without TLS.
    let cert = Cert::new("tls-local");
    let run = |tls: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["run", "--model"])
            .arg(model(GEMMA3))
            .args([
                "--local-workers",
                "2",
                "--no-head-stage",
                "--threads",
                "1",
                "--ctx-size",
                "256",
            ])
            .args(["--prompt", PROMPTS[0], "-n", "12"])
            .env_remove("BATON_TOKEN");
        if tls {
            cmd.args(cert.worker_args());
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let plain = run(false);
    assert!(!plain.trim().is_empty());
    assert_eq!(run(true), plain);
}

#[test]
fn baton_cert_writes_a_private_key_and_refuses_to_overwrite() {
    use std::os::unix::fs::PermissionsExt as _;
    let cert = Cert::new("tls-cert");
    let mode = std::fs::metadata(&cert.key).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "key file mode {mode:o}");
    let dir = cert.cert.parent().unwrap();
    let again = |force: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["cert", "--out"]).arg(dir);
        if force {
            cmd.arg("--force");
        }
        cmd.output().unwrap()
    };
    let before = std::fs::read(&cert.cert).unwrap();
    let out = again(false);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("already exists") && stderr.contains("--force"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&cert.cert).unwrap(), before);
    assert!(again(true).status.success());
    assert_ne!(std::fs::read(&cert.cert).unwrap(), before);
}

#[test]
fn bad_certificate_files_stop_a_worker_at_startup_with_the_reason() {
    let cert = Cert::new("tls-bad");
    let other = Cert::new("tls-bad-other");
    let dir = cert.cert.parent().unwrap();
    let not_pem = dir.join("notes.txt");
    std::fs::write(&not_pem, "hello\n").unwrap();
    let missing = dir.join("missing.crt");
    let start = |cert: &Path, key: &Path| {
        let out = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["worker", "--listen", "127.0.0.1:0", "--models"])
            .arg(models_dir())
            .arg("--tls-cert")
            .arg(cert)
            .arg("--tls-key")
            .arg(key)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "exits with an error, not a panic");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let err = start(&missing, &cert.key);
    assert!(err.contains("cannot read") && err.contains("missing.crt"), "{err}");
    let err = start(&not_pem, &cert.key);
    assert!(err.contains("notes.txt") && err.contains("no PEM certificate"), "{err}");
    let err = start(&cert.cert, &not_pem);
    assert!(err.contains("notes.txt") && err.contains("no PEM private key"), "{err}");
    let err = start(&cert.cert, &other.key);
    assert!(err.contains("does not belong"), "{err}");

    // One without the other is a usage error.
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["worker", "--models"])
        .arg(models_dir())
        .arg("--tls-cert")
        .arg(&cert.cert)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--tls-key"));
}
