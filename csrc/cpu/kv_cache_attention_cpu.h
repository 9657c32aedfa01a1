// What kv_cache_attention.cpp hands the CPU attention kernel, which is compiled once per instruction
// set (kv_cache_attention_kernel.h, included by kv_cache_attention_{baseline,avx2,avx512}.cpp) and
// chosen at run time by what the CPU supports.
//
// This header is included under those files' `#pragma GCC target`, so it holds only plain types,
// constants and functions of internal linkage (static): an inline function or template with external
// linkage would be compiled once per instruction set and, as a weak symbol, the linker could keep the
// AVX-512 copy for every caller.
#pragma once

#include <stdint.h>

namespace gptfast_kernels {
namespace cpu {

// The cache's and queries' element type.
enum class Elem : int32_t { F32 = 0, F16 = 1, BF16 = 2 };

// Slots per online-softmax step, aligned to absolute positions (a block holds positions
// [i * SLOT_BLOCK, (i + 1) * SLOT_BLOCK)): a query's blocks depend only on its own range, never on
// which other queries share its work item, so decode, verification and prefill compute a row
// identically.
constexpr int64_t SLOT_BLOCK = 32;

struct AttendArgs {
  const void* q;                       // [B, Hq, T, D], strides in elements below
  int64_t q_stride_b, q_stride_h, q_stride_t, q_stride_d;
  const void* keys;                    // k_cache [B, Hkv, S, D], contiguous
  const void* values;                  // rows of D numbers: v_cache, or k_cache with values in keys
  const int64_t* positions;            // [B, T], -1 = padding
  const float* sinks;                  // [Hq] or null
  const float* alibi_slopes;           // [Hq] or null: score += slope * (slot's position - query's)
  int64_t Hq, Hkv, T, D, Dv, S, G;
  int64_t window, chunk;               // at most one of them > 0
  float scale, softcap;                // softcap 0 = none
  bool ring;                           // position p lives in slot p % S
  Elem elem;
};

// Floats of scratch attend_rows needs for `rows` query rows (G heads x tokens): the scaled
// queries, accumulators, running max and sum, ALiBi slope, one block's scores per row, and one block
// of keys and values converted to float.
static constexpr int64_t scratch_floats(int64_t rows, int64_t D, int64_t Dv) {
  return rows * (D + Dv + 3 + SLOT_BLOCK) + SLOT_BLOCK * (D + Dv);
}
// int64 scratch: one block's row offsets in the cache and in the converted block, and each row's
// first and last position.
static constexpr int64_t scratch_ints(int64_t rows) { return 3 * SLOT_BLOCK + 2 * rows; }

// Attends query tokens t0 .. t1 - 1 of batch row b with query heads g0 .. g1 - 1 of kv head h's group,
// reading the cache (already written) once for all of them. out: [g1 - g0, t1 - t0, Dv] float32,
// zeros for padding queries; scratch sized by scratch_floats / scratch_ints for (g1 - g0) x (t1 - t0)
// rows.
using AttendRowsFn = void (*)(const AttendArgs& args, int64_t b, int64_t h, int64_t g0, int64_t g1, int64_t t0,
                              int64_t t1, float* out, float* scratch, int64_t* int_scratch);

// One per instruction set; kv_cache_attention.cpp picks among them.
void attend_rows_baseline(const AttendArgs&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*,
                          int64_t*);
void attend_rows_avx2(const AttendArgs&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*,
                      int64_t*);
void attend_rows_avx512(const AttendArgs&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float*, float*,
                        int64_t*);

}  // namespace cpu
}  // namespace gptfast_kernels
