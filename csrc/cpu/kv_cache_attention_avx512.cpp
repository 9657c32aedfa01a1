// kv_cache_attention's CPU attention kernel for AVX-512F (Skylake-SP, Zen 4 and later), taken
// when the CPU has AVX-512F + BW (cpu_isa(): the int8 kernels of the same CpuIsa need BW).
// kv_cache_attention.cpp chooses among the builds at run time (cpu_isa(), common.h).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f")
#endif
#define GPTFAST_ATTEND_ROWS attend_rows_avx512
#define GPTFAST_FMA 1
#define GPTFAST_NATIVE_LANES 16
#include "kv_cache_attention_kernel.h"
