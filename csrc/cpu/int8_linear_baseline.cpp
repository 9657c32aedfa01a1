// int8_linear's GEMV for the instruction set the whole extension is built for (on x86-64: SSE2); runs
// on any CPU. int8_linear.cpp chooses among the builds at run time (cpu_isa(), common.h).
#define GPTFAST_INT8_GEMV int8_gemv_baseline
#define GPTFAST_FMA 0
#define GPTFAST_NATIVE_LANES 4
#include "int8_gemv_kernel.h"
