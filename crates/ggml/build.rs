//! Reads back how llama-cpp-sys-2 configured llama.cpp, so a build that silently lost
//! `-O3` fails here instead of showing up weeks later as slow prompts, and checks that
//! llama.cpp's compiler really stores ggml's AMX tile configuration (GCC 12 does not:
//! every tile configured 0x0, and the first `tileloadd` raises #UD), failing the build
//! when AMX code is compiled in with such a compiler.
//!
//! llama-cpp-sys-2 (`links = "llama"`) exports `ggml_cmake_dir` = `$OUT/lib/cmake`;
//! its CMake cache sits at `$OUT/build/CMakeCache.txt`.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_LLAMA_GGML_CMAKE_DIR");
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() == Ok("x86_64") {
        // The start-up guard (src/cpu.rs): for plain x86-64, whatever target-cpu the Rust
        // code has, so that it runs on the CPUs it must refuse. The last -march wins.
        println!("cargo:rerun-if-changed=csrc/cpu_guard.c");
        cc::Build::new()
            .file("csrc/cpu_guard.c")
            .flag("-march=x86-64")
            .flag("-mtune=generic")
            .flag_if_supported("-mno-avx")
            .opt_level(2)
            .compile("baton_cpu_guard");
    }
    let build_type = cmake_cache()
        .and_then(|cache| {
            println!("cargo:rerun-if-changed={}", cache.display());
            std::fs::read_to_string(&cache).ok()
        })
        .and_then(|text| cache_value(&text, "CMAKE_BUILD_TYPE"))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=BATON_LLAMA_BUILD_TYPE={build_type}");
    let cache_text = cmake_cache().and_then(|cache| std::fs::read_to_string(cache).ok());
    let cxx = cache_text
        .as_deref()
        .and_then(|text| cache_value(text, "CMAKE_CXX_COMPILER"))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=BATON_LLAMA_CXX={cxx}");
    let mut tile_config = amx_tile_config(&cxx);
    if tile_config == "stored" && !amx_macros_defined(&cxx, cache_text.as_deref().unwrap_or("")) {
        tile_config = "stored, but __AMX_INT8__ undefined: ggml's AMX kernels are compiled out \
                       (clang before 16; CMAKE_PROJECT_INCLUDE=crates/ggml/csrc/amx-macros.cmake \
                       maps the names)"
            .to_string();
    }
    println!("cargo:rustc-env=BATON_AMX_TILECFG={tile_config}");
    if tile_config == "dropped" {
        if let Some(why) = cache_text.as_deref().and_then(amx_compiled_in) {
            panic!(
                "llama.cpp's compiler {cxx} drops the stores of ggml's AMX tile configuration \
                 (GCC 12's `_tile_loadconfig` declares an 8-byte operand for 64 bytes), and \
                 this build compiles ggml's AMX kernels ({why}): every tile would be 0x0 and \
                 the first AMX instruction would kill baton with SIGILL. Build llama.cpp with \
                 clang (scripts/setup installs it; .cargo/config.toml sets \
                 CC_x86_64_unknown_linux_gnu/CXX_x86_64_unknown_linux_gnu = clang), then \
                 `cargo clean -p llama-cpp-sys-2` (docs/devices.md)"
            );
        }
    }
    if std::env::var_os("CARGO_FEATURE_DYNAMIC_BACKENDS").is_some() {
        // llama-cpp-sys-2's own `dynamic-backends` builds a dozen CPU variants (20 minutes
        // on 2 cores); baton asks CMake for one CPU library through GGML_BACKEND_DL.
        let dl = cmake_cache()
            .and_then(|cache| std::fs::read_to_string(cache).ok())
            .and_then(|text| cache_value(&text, "GGML_BACKEND_DL"));
        if dl.as_deref() != Some("ON") {
            panic!(
                "the dynamic-backends feature needs llama.cpp configured with GGML_BACKEND_DL=ON \
                 (found {dl:?}): build with scripts/dyn-cargo"
            );
        }
    }
    if build_type != "Release" && std::env::var("BATON_ALLOW_SLOW_LLAMA").is_err() {
        panic!(
            "llama.cpp was configured as {build_type:?}, not Release (-O3): set \
             LLAMA_LIB_PROFILE=Release (.cargo/config.toml does) and run `cargo clean -p \
             llama-cpp-sys-2` (CMake keeps its first configuration), or set \
             BATON_ALLOW_SLOW_LLAMA=1"
        );
    }
}

fn cmake_cache() -> Option<PathBuf> {
    let cmake_dir = PathBuf::from(std::env::var("DEP_LLAMA_GGML_CMAKE_DIR").ok()?);
    // $OUT/lib/cmake -> $OUT
    let out = cmake_dir.ancestors().nth(2).map(Path::to_path_buf)?;
    let cache = out.join("build").join("CMakeCache.txt");
    cache.is_file().then_some(cache)
}

/// `KEY:TYPE=VALUE` lines of a CMake cache.
fn cache_value(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let (name, value) = line.split_once('=')?;
        (name.split(':').next()? == key).then(|| value.trim().to_string())
    })
}

/// A reproduction of ggml's `ggml_tile_config_init` (ggml-cpu/amx/mmq.cpp): a local
/// configuration, a few field stores, `_tile_loadconfig`. Rows 13 and 52 column bytes
/// are immediates no zeroing store can make.
const TILE_CONFIG_PROBE: &str = r#"
#include <immintrin.h>
#include <string.h>
struct tile_config { unsigned char palette_id, start_row, reserved[14];
                     unsigned short colsb[16]; unsigned char rows[16]; };
void baton_tile_config_probe(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    cfg.rows[0] = 13;
    cfg.colsb[0] = 52;
    _tile_loadconfig(&cfg);
}
"#;

/// Compiles [`TILE_CONFIG_PROBE`] with `cxx` at -O3 and reads the assembly: `stored`
/// when both field stores precede `ldtilecfg`, `dropped` when the compiler removed
/// them, `not checked (why)` when the probe does not apply or could not be compiled.
fn amx_tile_config(cxx: &str) -> String {
    if std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() != Ok("x86_64") {
        return "not checked (not x86-64)".to_string();
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let source = out.join("tile_config_probe.cpp");
    if std::fs::write(&source, TILE_CONFIG_PROBE).is_err() {
        return "not checked (cannot write the probe)".to_string();
    }
    let asm = std::process::Command::new(cxx)
        .args(["-O3", "-mamx-tile", "-S", "-o", "-"])
        .arg(&source)
        .output();
    match asm {
        Ok(asm) if asm.status.success() => tile_config_verdict(&String::from_utf8_lossy(&asm.stdout)).to_string(),
        Ok(asm) => format!(
            "not checked ({cxx} failed: {})",
            String::from_utf8_lossy(&asm.stderr).lines().next().unwrap_or("")
        ),
        Err(e) => format!("not checked ({cxx}: {e})"),
    }
}

/// Whether `cxx` with `-mamx-int8`, and the header llama.cpp's build force-includes
/// (when its CMake cache names it), defines GCC's `__AMX_INT8__`, the name ggml compiles
/// its AMX kernels under.
fn amx_macros_defined(cxx: &str, cache: &str) -> bool {
    let header = Path::new(env!("CARGO_MANIFEST_DIR")).join("csrc/amx-macros.h");
    let mut command = std::process::Command::new(cxx);
    command.args(["-mamx-tile", "-mamx-int8", "-dM", "-E", "-x", "c++", "/dev/null"]);
    let included = ["CMAKE_PROJECT_INCLUDE", "CMAKE_CXX_FLAGS"]
        .iter()
        .any(|key| cache_value(cache, key).is_some_and(|v| v.contains("amx-macros")));
    if included {
        command.arg("-include").arg(&header);
    }
    command
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains("#define __AMX_INT8__"))
}

/// `stored` when the assembly writes both probe values before `ldtilecfg`.
fn tile_config_verdict(asm: &str) -> &'static str {
    let before = asm.split("ldtilecfg").next().unwrap_or("");
    let stores = |value: &str| {
        before
            .lines()
            .any(|l| l.trim_start().starts_with("mov") && l.contains(value))
    };
    if asm.contains("ldtilecfg") && stores("$13,") && stores("$52,") {
        "stored"
    } else {
        "dropped"
    }
}

/// Why ggml's CPU code in this build holds AMX kernels, or `None`: `-march=native` on a
/// CPU with AMX, every CPU variant (one is Sapphire Rapids), or AMX asked for by name.
fn amx_compiled_in(cache: &str) -> Option<String> {
    let on = |key: &str| cache_value(cache, key).is_some_and(|v| v == "ON");
    if on("GGML_CPU_ALL_VARIANTS") {
        return Some("GGML_CPU_ALL_VARIANTS builds a Sapphire Rapids variant".to_string());
    }
    if on("GGML_AMX_TILE") || on("GGML_AMX_INT8") {
        return Some("GGML_AMX_TILE/GGML_AMX_INT8".to_string());
    }
    let host_has_amx = std::fs::read_to_string("/proc/cpuinfo")
        .is_ok_and(|info| info.lines().any(|l| l.starts_with("flags") && l.contains(" amx_tile")));
    (on("GGML_NATIVE") && host_has_amx).then(|| "-march=native on a CPU with AMX".to_string())
}
