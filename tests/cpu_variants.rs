//! Every CPU: a build for a newer CPU refuses an older one with an error that names the
//! missing instruction set (never `Illegal instruction`), and where the CPU has AMX,
//! ggml's AMX kernels run and give libllama's greedy text (docs/devices.md).

mod common;

use std::process::Command;

use common::{model, GEMMA3};

/// A qemu CPU model that lacks an instruction set this binary was compiled for, and the
/// instruction set the error must name; `None` when the binary runs on any x86-64.
fn older_cpu() -> Option<(&'static str, &'static str)> {
    if cfg!(target_feature = "avx512f") {
        // qemu 7.2 emulates up to AVX2 (no AVX-512): Haswell is x86-64-v3.
        Some(("Haswell", "avx512f"))
    } else if cfg!(target_feature = "avx2") {
        Some(("Nehalem", "avx"))
    } else if cfg!(target_feature = "sse4.2") {
        Some(("core2duo", "sse4.2"))
    } else {
        None
    }
}

#[test]
fn a_build_for_a_newer_cpu_says_which_instruction_set_is_missing() {
    if !cfg!(target_arch = "x86_64") {
        eprintln!("skipped: the x86 instruction-set guard (this is not x86-64)");
        return;
    }
    let Some((cpu, missing)) = older_cpu() else {
        eprintln!("skipped: this build runs on every x86-64 CPU (compiled for x86-64-v1)");
        return;
    };
    if Command::new("qemu-x86_64").arg("--version").output().is_err() {
        eprintln!("skipped: qemu-x86_64 is not installed (scripts/setup installs qemu-user)");
        return;
    }
    let out = Command::new("qemu-x86_64")
        .args(["-cpu", cpu, env!("CARGO_BIN_EXE_baton"), "devices"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "on a {cpu}: {:?}, stderr: {stderr}",
        out.status
    );
    assert!(
        stderr.contains("this CPU lacks") && stderr.contains(missing),
        "{stderr}"
    );
    assert!(stderr.contains("scripts/package"), "{stderr}");
}

#[test]
fn amx_kernels_run_and_give_llama_cpps_text_where_the_cpu_has_amx() {
    if !baton_ggml::cpu::cpu_has_amx() {
        eprintln!("skipped: this CPU has no AMX (CPUID 7: AMX-TILE, AMX-INT8)");
        return;
    }
    let devices = Command::new(env!("CARGO_BIN_EXE_baton"))
        .arg("devices")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&devices.stdout);
    assert!(
        devices.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&devices.stderr)
    );
    // A native build (`-march=native`) compiles ggml's AMX kernels on such a CPU; a build
    // with backends loaded at run time has them where a Sapphire Rapids variant is there.
    if cfg!(feature = "dynamic-backends") && !text.contains("sapphirerapids") {
        eprintln!("no AMX variant beside this build: {text}");
    } else {
        assert!(text.contains("AMX: used"), "{text}");
    }
    let check = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["devices", "--check"])
        .arg(model(GEMMA3))
        .args(["-n", "24"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(
        check.status.success() && out.contains("check: same"),
        "{out}{}",
        String::from_utf8_lossy(&check.stderr)
    );
}
