//! What a user sees when the command line points at something wrong: a model file that
//! is missing, not a GGUF, truncated or of an unsupported architecture, and a worker
//! that cannot be reached. Each is said once, plainly, by baton itself, without
//! llama.cpp's log lines around it (issue 12: every case ended in "libllama could not
//! load FILE" after a llama.cpp log line; an unreachable worker printed the OS error
//! twice).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{model, GEMMA3};

/// Runs `baton run` with `args`; returns its stderr, which must hold exactly one line
/// starting with "error: " and nothing from llama.cpp.
fn run_error(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("run")
        .args(args)
        .env_remove("BATON_GGML_LOG")
        .output()
        .expect("baton runs");
    assert!(!out.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("llama_model_load"), "llama.cpp's log leaked: {stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error: ")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    errors[0].to_string()
}

fn temp_file(name: &str, bytes: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("baton-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn run_model(path: &Path) -> String {
    run_error(&["--model", path.to_str().unwrap(), "-n", "1"])
}

#[test]
fn bad_model_files_are_named_by_baton() {
    let missing = run_model(Path::new("/nonexistent/model.gguf"));
    assert_eq!(
        missing,
        "error: cannot read model file /nonexistent/model.gguf: No such file or directory (os error 2)"
    );

    let not_gguf = run_model(&temp_file("text.gguf", b"# not a model\n"));
    assert!(not_gguf.contains("not a GGUF file"), "{not_gguf}");

    let real = std::fs::read(model(GEMMA3)).unwrap();
    let header_cut = run_model(&temp_file("header.gguf", &real[..1 << 20]));
    assert!(header_cut.contains("the file is truncated or corrupt"), "{header_cut}");

    let gguf = baton_gguf::Gguf::parse(&real).unwrap();
    let data_cut = gguf.data_offset as usize + 4096;
    let data_cut = run_model(&temp_file("data.gguf", &real[..data_cut]));
    assert!(
        data_cut.contains("lies beyond the end of the file") && data_cut.contains("the file is truncated"),
        "{data_cut}"
    );

    let other = baton_gguf::GgufWriter::new()
        .kv_str("general.architecture", "rwkv7")
        .to_bytes();
    let unsupported = run_model(&temp_file("rwkv.gguf", &other));
    assert!(
        unsupported.contains("unsupported model architecture 'rwkv7'"),
        "{unsupported}"
    );
}

#[test]
fn an_unreachable_worker_is_named_with_what_to_check() {
    // A port nothing listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let error = run_error(&[
        "--workers",
        &addr,
        "--token",
        "0123456789abcdef",
        "--no-head-stage",
        "-n",
        "1",
    ]);
    assert!(
        error.contains(&format!("worker {addr} could not be reached")),
        "{error}"
    );
    assert!(error.contains("baton worker --listen"), "{error}");
    assert_eq!(error.matches("os error 111").count(), 1, "{error}");
}

/// `--tp` that cannot be formed is said before anything starts.
#[test]
fn tp_flags_that_cannot_form_a_group_are_refused() {
    let model = model(GEMMA3);
    let model = model.to_str().unwrap();
    let auto = run_error(&["--model", model, "--tp", "auto", "-n", "1"]);
    assert!(auto.contains("--tp auto chooses groups of workers"), "{auto}");
    let zero = run_error(&["--model", model, "--tp", "0", "-n", "1"]);
    assert!(
        zero.contains("'0' is neither a group size from 1 to 64 nor auto"),
        "{zero}"
    );
    let few = run_error(&[
        "--model",
        model,
        "--tp",
        "3",
        "--workers",
        "127.0.0.1:1,127.0.0.1:2",
        "-n",
        "1",
    ]);
    assert!(
        few.contains("--tp 3 needs at least 3 workers to form one group; 2 given"),
        "{few}"
    );
    let both = run_error(&[
        "--model",
        model,
        "--tp",
        "2",
        "--tp-members",
        "127.0.0.1:1",
        "--local-workers",
        "2",
        "-n",
        "1",
    ]);
    assert!(both.contains("--tp-members makes this process member 0"), "{both}");
}

/// A KV cache type llama.cpp's `-ctk`/`-ctv` do not take is refused with the list of
/// those they do.
#[test]
fn unknown_kv_cache_types_are_refused_with_the_types_there_are() {
    let model = model(GEMMA3);
    let model = model.to_str().unwrap();
    for flag in ["--cache-type-k", "--cache-type-v"] {
        let error = run_error(&["--model", model, flag, "q3_k", "-n", "1"]);
        assert!(
            error.contains(&format!("invalid value 'q3_k' for '{flag}"))
                && error.contains(
                    "'q3_k' is not a KV cache type; the types are f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1"
                ),
            "{error}"
        );
    }
}

/// A --ctx-size that the memory cannot hold is refused before anything loads, with
/// what it needs and what is offered: on this machine (gemma3, one sequence: 3 KiB of
/// f16 cache a token in its 3 global layers plus 15 MiB of window caches, 1M tokens
/// against --head-memory of 10^9 bytes), and on workers (the nodes' offers, each named;
/// 10^8 cells, 293 GiB: two workers on one machine each offer its free memory).
#[test]
fn a_context_that_does_not_fit_is_refused_with_the_numbers() {
    let model = model(GEMMA3);
    let model = model.to_str().unwrap();
    let here = run_error(&[
        "--model",
        model,
        "--stages",
        "1",
        "--ctx-size",
        "1000000",
        "--head-memory",
        "1000000000",
        "-n",
        "1",
    ]);
    assert!(
        here.contains("a context of 1000000 tokens needs 2945 MiB of KV cache (f16/f16)")
            && here.contains("but this machine offers 954 MiB (--head-memory)"),
        "{here}"
    );
    let workers = run_error(&[
        "--model",
        model,
        "--local-workers",
        "2",
        "--no-head-stage",
        "--threads",
        "1",
        "--ctx-size",
        "100000000",
        "-n",
        "1",
    ]);
    assert!(
        workers.contains("the nodes cannot hold the model")
            && workers.contains("a KV cache of 100000000 cells (f16/f16) is part of that; offered by node: unix:")
            && workers.matches(" MiB").count() == 2,
        "{workers}"
    );
}
