/* Force-included into every C/C++ file of llama.cpp (see .cargo/config.toml,
 * scripts/package, bench/peer): ggml compiles its AMX kernels only under GCC's names
 * __AMX_INT8__ and __AMX_TILE__, while clang before 16 defines __AMXINT8__ and
 * __AMXTILE__ for -mamx-int8/-mamx-tile. Without this, a clang 14 build (Debian 12's)
 * silently has no AMX kernels at all. Defines nothing where AMX is not enabled. */
#if defined(__AMXINT8__) && !defined(__AMX_INT8__)
#define __AMX_INT8__ 1
#endif
#if defined(__AMXTILE__) && !defined(__AMX_TILE__)
#define __AMX_TILE__ 1
#endif
#if defined(__AMXBF16__) && !defined(__AMX_BF16__)
#define __AMX_BF16__ 1
#endif
