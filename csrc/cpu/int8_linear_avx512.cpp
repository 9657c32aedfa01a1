// int8_linear's GEMV and packed GEMM for AVX-512F + BW (Skylake-SP, Zen 4 and later), taken when the
// CPU has them. int8_linear.cpp chooses among the builds at run time (cpu_isa(), common.h).
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw")
#endif
#define GPTFAST_INT8_GEMV int8_gemv_avx512
#define GPTFAST_INT8_GEMM_PANELS int8_gemm_panels_avx512
#define GPTFAST_INT8_GEMM_ROWS INT8_GEMM_ROWS_AVX512
#define GPTFAST_INT8_GEMM_TRANSPOSE_BYTES 64  // byte unpacks of 64-byte registers (AVX-512BW)
#define GPTFAST_FMA 1
#define GPTFAST_NATIVE_LANES 16
#include "int8_gemv_kernel.h"
#include "int8_gemm_kernel.h"
