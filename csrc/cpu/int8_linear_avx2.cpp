// int8_linear's GEMV and packed GEMM for AVX2 and FMA (x86-64 since Haswell and Zen), taken when the
// CPU has them but not AVX-512F + BW. int8_linear.cpp chooses among the builds at run time (cpu_isa(),
// common.h).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma")
#endif
#define GPTFAST_INT8_GEMV int8_gemv_avx2
#define GPTFAST_INT8_GEMM_PANELS int8_gemm_panels_avx2
#define GPTFAST_INT8_GEMM_ROWS INT8_GEMM_ROWS_AVX2
#define GPTFAST_INT8_GEMM_TRANSPOSE_BYTES 32
#define GPTFAST_FMA 1
#define GPTFAST_NATIVE_LANES 8
#include "int8_gemv_kernel.h"
#include "int8_gemm_kernel.h"
