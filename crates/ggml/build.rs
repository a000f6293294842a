//! Reads back how llama-cpp-sys-2 configured llama.cpp, so a build that silently lost
//! `-O3` fails here instead of showing up weeks later as slow prompts.
//!
//! llama-cpp-sys-2 (`links = "llama"`) exports `ggml_cmake_dir` = `$OUT/lib/cmake`;
//! its CMake cache sits at `$OUT/build/CMakeCache.txt`.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_LLAMA_GGML_CMAKE_DIR");
    let build_type = cmake_cache()
        .and_then(|cache| {
            println!("cargo:rerun-if-changed={}", cache.display());
            std::fs::read_to_string(&cache).ok()
        })
        .and_then(|text| cache_value(&text, "CMAKE_BUILD_TYPE"))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=BATON_LLAMA_BUILD_TYPE={build_type}");
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
