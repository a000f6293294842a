//! What the CPU can run and what this build was compiled for: the start-up guard that
//! turns a missing instruction set into an error instead of `Illegal instruction`
//! (`csrc/cpu_guard.c`), the
//! CPU variant ggml chose (builds that load the CPU backend at run time), and whether
//! ggml's AMX kernels are in use.

use crate::device::{BufferType, Device};

/// Instruction sets the binary's own code (and, in builds without backends loaded at run
/// time, ggml's, compiled with the same `-march`) may use, in the order of
/// `csrc/cpu_guard.c`'s names: bit i of [`COMPILED`] says the build was compiled for
/// `FEATURES[i]` (the C side prints the names; the tests compare the two lists).
#[cfg(all(test, target_arch = "x86_64"))]
#[rustfmt::skip]
const FEATURES: [&str; 30] = [
    "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "avx", "avx2", "bmi1", "bmi2", "fma",
    "f16c", "lzcnt", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
    "avx512vnni", "avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq",
    "avx512ifma", "avx512bf16", "avx512fp16", "avxvnni", "gfni", "vaes", "vpclmulqdq",
];

/// Bit i: compiled for [`FEATURES`]`[i]` (known when compiling, so no code computes it).
#[cfg(target_arch = "x86_64")]
const COMPILED: u64 = {
    macro_rules! mask {
        ($($i:literal $name:tt),*) => { 0 $(| ((cfg!(target_feature = $name) as u64) << $i))* };
    }
    mask!(0 "sse3", 1 "ssse3", 2 "sse4.1", 3 "sse4.2", 4 "popcnt", 5 "avx", 6 "avx2", 7 "bmi1",
          8 "bmi2", 9 "fma", 10 "f16c", 11 "lzcnt", 12 "movbe", 13 "avx512f", 14 "avx512bw",
          15 "avx512cd", 16 "avx512dq", 17 "avx512vl", 18 "avx512vnni", 19 "avx512vbmi",
          20 "avx512vbmi2", 21 "avx512bitalg", 22 "avx512vpopcntdq", 23 "avx512ifma",
          24 "avx512bf16", 25 "avx512fp16", 26 "avxvnni", 27 "gfni", 28 "vaes", 29 "vpclmulqdq")
};

#[cfg(target_arch = "x86_64")]
extern "C" {
    fn baton_require_cpu(compiled: u64, portable: i32);
    fn baton_cpu_present() -> u64;
    #[cfg(test)]
    fn baton_cpu_feature_name(i: u32) -> *const std::os::raw::c_char;
    #[cfg(test)]
    fn baton_cpu_feature_count() -> u32;
}

/// Exits with an error naming the missing instruction sets (and the build to use
/// instead) when this CPU lacks one this binary was compiled for. Call first thing in
/// `main`: code compiled for a newer CPU dies with SIGILL at its first such
/// instruction, and that can be any instruction of any Rust function, the comparison
/// itself included (`is_x86_feature_detected!` even answers `true` for a feature
/// enabled at compile time without asking the CPU). So the check, the message and the
/// exit are C compiled for plain x86-64 (`csrc/cpu_guard.c`).
#[inline(never)]
pub fn require_instruction_sets() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a plain C function over CPUID/XGETBV; it returns or exits the process.
    unsafe {
        baton_require_cpu(COMPILED, cfg!(feature = "dynamic-backends") as i32)
    };
}

/// Whether the CPU has AMX tiles with int8 (CPUID leaf 7: AMX-TILE, AMX-INT8), whatever
/// the build and the kernel allow.
pub fn cpu_has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: a plain C function over CPUID/XGETBV.
        let present = unsafe { baton_cpu_present() };
        present & (1 << 63) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether ggml's AMX kernels compute here: the CPU backend offers its AMX buffer type,
/// which it does only when its code was compiled with AMX, the CPU has it and the
/// kernel granted the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM)`).
pub fn amx_in_use() -> bool {
    BufferType::cpu_extra().iter().any(|buft| buft.name() == "AMX")
}

/// How this build's compiler for llama.cpp stored AMX tile configurations, checked by
/// the build script on a reproduction of ggml's `ggml_tile_config_init`: `stored`,
/// `dropped` (the GCC 12 bug), or `not checked (...)`.
pub const AMX_TILE_CONFIG: &str = env!("BATON_AMX_TILECFG");

/// The compiler llama.cpp was built with (from its CMake cache), e.g. `/usr/bin/clang++`.
pub const LLAMA_CXX_COMPILER: &str = env!("BATON_LLAMA_CXX");

/// The shared library ggml's CPU backend was loaded from, e.g.
/// `libggml-cpu-sapphirerapids.so` (builds that load backends at run time; `None` when
/// the CPU backend is linked in).
pub fn cpu_backend_library() -> Option<String> {
    let _ = Device::cpu();
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter_map(|path| path.rsplit('/').next())
        .find(|name| name.starts_with("libggml-cpu"))
        .map(str::to_string)
}

/// The CPU features ggml's CPU backend reports as compiled in and present (`AVX2`,
/// `AVX512`, `AMX_INT8`, ...), as `name=value` pairs.
pub fn cpu_backend_features() -> Vec<String> {
    let dev = Device::cpu().raw();
    let mut out = Vec::new();
    // SAFETY: registry lookups return static singletons or null; the features array is a
    // static of the CPU backend, terminated by an entry with a null name.
    unsafe {
        let reg = llama_cpp_sys_2::ggml_backend_dev_backend_reg(dev);
        let proc = llama_cpp_sys_2::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_get_features".as_ptr());
        if proc.is_null() {
            return out;
        }
        // The registry returns this function under exactly this name and type.
        let get: llama_cpp_sys_2::ggml_backend_get_features_t = std::mem::transmute(proc);
        let Some(get) = get else { return out };
        let mut feature = get(reg);
        while !feature.is_null() && !(*feature).name.is_null() {
            let name = std::ffi::CStr::from_ptr((*feature).name).to_string_lossy();
            let value = std::ffi::CStr::from_ptr((*feature).value).to_string_lossy();
            out.push(format!("{name}={value}"));
            feature = feature.add(1);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_c_guard_names_the_same_features_in_the_same_order() {
        // SAFETY: static strings of the C table, for indices below its count.
        let names: Vec<String> = unsafe {
            (0..baton_cpu_feature_count())
                .map(|i| {
                    std::ffi::CStr::from_ptr(baton_cpu_feature_name(i))
                        .to_string_lossy()
                        .into_owned()
                })
                .collect()
        };
        assert_eq!(names, FEATURES);
        // COMPILED's bit i is FEATURES[i]: this test binary is compiled for sse2 at least,
        // and each bit agrees with the cfg of its name.
        macro_rules! check {
            ($($name:tt),*) => {$(
                let i = FEATURES.iter().position(|f| *f == $name).unwrap();
                assert_eq!(COMPILED >> i & 1 == 1, cfg!(target_feature = $name), $name);
            )*};
        }
        check!(
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "avx",
            "avx2",
            "bmi1",
            "bmi2",
            "fma",
            "f16c",
            "lzcnt",
            "movbe",
            "avx512f",
            "avx512bw",
            "avx512cd",
            "avx512dq",
            "avx512vl",
            "avx512vnni",
            "avx512vbmi",
            "avx512vbmi2",
            "avx512bitalg",
            "avx512vpopcntdq",
            "avx512ifma",
            "avx512bf16",
            "avx512fp16",
            "avxvnni",
            "gfni",
            "vaes",
            "vpclmulqdq"
        );
    }

    /// The CPUID bits read for each instruction set agree with the kernel's names for
    /// them in /proc/cpuinfo (a wrong bit number would pass or refuse the wrong CPUs).
    #[test]
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    fn cpuid_bits_agree_with_proc_cpuinfo() {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap();
        let flags: Vec<&str> = info
            .lines()
            .find(|l| l.starts_with("flags"))
            .unwrap()
            .split_whitespace()
            .collect();
        let kernel_name = |name: &str| {
            match name {
                "sse3" => "pni",
                "sse4.1" => "sse4_1",
                "sse4.2" => "sse4_2",
                "lzcnt" => "abm",
                "avx512vnni" => "avx512_vnni",
                "avx512vbmi2" => "avx512_vbmi2",
                "avx512bitalg" => "avx512_bitalg",
                "avx512vpopcntdq" => "avx512_vpopcntdq",
                "avx512bf16" => "avx512_bf16",
                "avx512fp16" => "avx512_fp16",
                "avxvnni" => "avx_vnni",
                other => other,
            }
            .to_string()
        };
        // SAFETY: a plain C function over CPUID/XGETBV.
        let present = unsafe { baton_cpu_present() };
        for (i, name) in FEATURES.iter().enumerate() {
            assert_eq!(
                present >> i & 1 == 1,
                flags.contains(&kernel_name(name).as_str()),
                "{name}"
            );
        }
        assert_eq!(
            cpu_has_amx(),
            flags.contains(&"amx_tile") && flags.contains(&"amx_int8")
        );
    }

    #[test]
    fn this_test_binary_runs_on_this_cpu() {
        // Returns (rather than exiting the test process with an error).
        require_instruction_sets();
    }

    #[test]
    fn amx_is_used_only_where_the_cpu_has_it() {
        if amx_in_use() {
            assert!(cpu_has_amx());
            assert_eq!(AMX_TILE_CONFIG, "stored");
        }
    }
}
