// kv_cache_attention's CPU attention kernel for the instruction set the whole extension is built
// for (on x86-64: SSE2); runs on any CPU.
// kv_cache_attention.cpp chooses among the builds at run time (cpu_isa(), common.h).
#define GPTFAST_ATTEND_ROWS attend_rows_baseline
#define GPTFAST_FMA 0
#define GPTFAST_NATIVE_LANES 4
#include "kv_cache_attention_kernel.h"
