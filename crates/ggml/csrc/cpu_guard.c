/* The start-up guard against running on a CPU older than the build (see src/cpu.rs).
 *
 * In C, compiled by crates/ggml/build.rs for plain x86-64 (-march=x86-64, no AVX):
 * Rust code compiled with target-cpu=native may use AVX-512 anywhere, even in the
 * few instructions that would compare the CPU's features, so the check, the message and
 * the exit must all be code that any x86-64 CPU runs. */
#include <cpuid.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Same order as FEATURES in src/cpu.rs (a unit test compares them). */
static const char *const NAMES[] = {
    "sse3", "ssse3", "sse4.1", "sse4.2", "popcnt", "avx", "avx2", "bmi1", "bmi2", "fma",
    "f16c", "lzcnt", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl",
    "avx512vnni", "avx512vbmi", "avx512vbmi2", "avx512bitalg", "avx512vpopcntdq",
    "avx512ifma", "avx512bf16", "avx512fp16", "avxvnni", "gfni", "vaes", "vpclmulqdq",
};
#define N_FEATURES (sizeof NAMES / sizeof NAMES[0])

const char *baton_cpu_feature_name(unsigned i) { return i < N_FEATURES ? NAMES[i] : 0; }

unsigned baton_cpu_feature_count(void) { return N_FEATURES; }

/* Bit i set: this CPU (and its OS, for the AVX and AVX-512 register state) has NAMES[i].
 * Bit 63: AMX-TILE and AMX-INT8. */
uint64_t baton_cpu_present(void) {
    unsigned a, b, c, d;
    unsigned l1c = 0, l7b = 0, l7c = 0, l7d = 0, l71a = 0, e1c = 0;
    uint64_t xcr0 = 0;
    unsigned max = __get_cpuid_max(0, 0);
    if (max >= 1) { __cpuid_count(1, 0, a, b, c, d); l1c = c; }
    if (max >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        l7b = b; l7c = c; l7d = d;
        if (a >= 1) { __cpuid_count(7, 1, a, b, c, d); l71a = a; }
    }
    if ((unsigned)__get_cpuid_max(0x80000000u, 0) >= 0x80000001u) { __cpuid_count(0x80000001u, 0, a, b, c, d); e1c = c; }
    if (l1c & (1u << 27)) { /* OSXSAVE: XGETBV may run */
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        xcr0 = ((uint64_t)hi << 32) | lo;
    }
    int avx_os = (xcr0 & 6) == 6;
    int avx512_os = avx_os && (xcr0 & 0xe0) == 0xe0;
#define BIT(r, n) (((r) >> (n)) & 1u)
    const int has[] = {
        BIT(l1c, 0), BIT(l1c, 9), BIT(l1c, 19), BIT(l1c, 20), BIT(l1c, 23),
        BIT(l1c, 28) && avx_os, BIT(l7b, 5) && avx_os, BIT(l7b, 3), BIT(l7b, 8),
        BIT(l1c, 12) && avx_os, BIT(l1c, 29) && avx_os, BIT(e1c, 5), BIT(l1c, 22),
        BIT(l7b, 16) && avx512_os, BIT(l7b, 30) && avx512_os, BIT(l7b, 28) && avx512_os,
        BIT(l7b, 17) && avx512_os, BIT(l7b, 31) && avx512_os, BIT(l7c, 11) && avx512_os,
        BIT(l7c, 1) && avx512_os, BIT(l7c, 6) && avx512_os, BIT(l7c, 12) && avx512_os,
        BIT(l7c, 14) && avx512_os, BIT(l7b, 21) && avx512_os, BIT(l71a, 5) && avx512_os,
        BIT(l7d, 23) && avx512_os, BIT(l71a, 4) && avx_os, BIT(l7c, 8),
        BIT(l7c, 9) && avx_os, BIT(l7c, 10) && avx_os,
    };
    _Static_assert(sizeof has / sizeof has[0] == N_FEATURES, "one check per name");
    uint64_t present = 0;
    for (unsigned i = 0; i < N_FEATURES; i++) present |= (uint64_t)(has[i] != 0) << i;
    if (BIT(l7d, 24) && BIT(l7d, 25)) present |= (uint64_t)1 << 63;
    return present;
}

/* Exits with an error naming what is missing when `compiled` (bit i: the build was
 * compiled for NAMES[i]) asks for more than this CPU has. `portable`: the build is the
 * portable archive's (its own code for x86-64-v2, ggml's per CPU level). */
void baton_require_cpu(uint64_t compiled, int portable) {
    uint64_t missing = compiled & ~baton_cpu_present() & ~((uint64_t)1 << 63);
    if (!missing) return;
    int v1 = 0, v2 = 0, v3 = 0;
    fputs("error: this CPU lacks", stderr);
    const char *sep = " ";
    for (unsigned i = 0; i < N_FEATURES; i++) {
        if (!((missing >> i) & 1)) continue;
        fprintf(stderr, "%s%s", sep, NAMES[i]);
        sep = ", ";
        if (i <= 4) v1 = 1; else if (i <= 12) v2 = 1; else v3 = 1;
    }
    if (portable) {
        fputs(" which baton's own code in this build was compiled for (a build with ggml's CPU "
              "code chosen at start, such as the portable archive, which needs x86-64-v2: "
              "SSE4.2, POPCNT). Build baton on this machine instead: cargo build --release "
              "(docs/devices.md)\n", stderr);
        exit(1);
    }
    fprintf(stderr,
            " which this build of baton was compiled for (it was built for another machine's "
            "CPU, e.g. with target-cpu=native; this CPU is at most %s). Use the portable "
            "archive (scripts/package: one binary, ggml's CPU code for each x86-64 level "
            "chosen at start), or build here: cargo build --release (docs/devices.md)\n",
            v1 ? "x86-64-v1" : v2 ? "x86-64-v2" : v3 ? "x86-64-v3 (AVX2)" : "x86-64-v4");
    exit(1);
}
