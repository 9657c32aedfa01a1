// kv_cache_attention's CPU attention kernel for AVX2 and FMA (x86-64 since Haswell and Zen), taken
// when the CPU has them but not AVX-512F + BW.
// kv_cache_attention.cpp chooses among the builds at run time (cpu_isa(), common.h).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#define GPTFAST_ATTEND_ROWS attend_rows_avx2
#define GPTFAST_FMA 1
#define GPTFAST_NATIVE_LANES 8
#include "kv_cache_attention_kernel.h"
