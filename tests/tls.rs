//! TLS on every link, with real processes on loopback: the ring still reproduces
//! llama.cpp, a node without the cluster certificate (or without TLS) is refused with
//! an error that says so, and the worker keeps serving.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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

/// Invites to a TLS cluster carry the certificate's fingerprint; the joining worker gets
/// the certificate and key with the token, checks them against it, and joins over TLS.
#[test]
fn a_worker_invited_to_a_tls_cluster_gets_the_certificate_the_code_names_and_joins() {
    use common::server::{Server, KEY};
    let _guard = common::server::lock();
    let cert = Cert::new("tls-invite");
    let first = WorkerProc::start(&models_dir(), Some(TOKEN), &cert.worker_args());
    let mut extra = vec!["--no-head-stage"];
    extra.extend(cert.worker_args());
    let server = Server::start_on_workers(std::slice::from_ref(&first.addr), TOKEN, &extra);
    let invite = || {
        let out = Command::new(env!("CARGO_BIN_EXE_baton"))
            .args(["invite", "--url", &server.url(), "--api-key", KEY])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let dir = tempdir("tls-invite-models");
    let model = model(QWEN2);
    let linked = dir.join(model.file_name().unwrap());
    if std::fs::hard_link(&model, &linked).is_err() {
        std::fs::copy(&model, &linked).unwrap();
    }
    let join = |code: &str| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_baton"));
        cmd.args(["worker", "--listen", "127.0.0.1:0", "--threads", "1", "--models"])
            .arg(&dir)
            .env("BATON_JOIN", code)
            .env_remove("BATON_TOKEN");
        cmd
    };

    // A code whose fingerprint is not the cluster's certificate: the worker refuses
    // what the head sends.
    let mut forged = baton_proto::invite::Invite::parse(&invite()).unwrap();
    assert!(
        forged.fingerprint.is_some(),
        "a TLS cluster's code names its certificate"
    );
    forged.fingerprint = Some("ab".repeat(32));
    let refused = join(&forged.code()).output().unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("not the one the invite names"), "{err}");

    let mut joiner = join(&invite())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let joined = common::printed_addr(&mut joiner, "listening on ");
    assert_eq!(
        std::fs::read(dir.join(".baton/cluster.crt")).unwrap(),
        std::fs::read(&cert.cert).unwrap()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut health = String::new();
    while std::time::Instant::now() < deadline {
        health = server.request("GET", "/health", None, Some(KEY)).1;
        if health.contains(&format!("\"{joined} layers")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(
        health.contains(&format!("\"{joined} layers")),
        "{joined} got layers: {health}"
    );
    let answer = server.post(
        "/v1/completions",
        &serde_json::json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert!(!answer["choices"][0]["text"].as_str().unwrap().is_empty());
    let _ = joiner.kill();
    let _ = joiner.wait();
    let _ = std::fs::remove_dir_all(&dir);
}
