// The CPU attention kernel of kv_cache_attention, written once over GCC vectors of the CPU's width
// and compiled once per instruction set: kv_cache_attention_{baseline,avx2,avx512}.cpp each set a
// target and then include this file with GPTFAST_ATTEND_ROWS naming the function to define and
// GPTFAST_NATIVE_LANES the floats per register (16, 8, 4).
//
// Every operation is lane-wise, or a dot product summed as if over 16 lanes whatever the register
// width (lane l takes d = l, l + 16, ... in order, then a fixed tree), multiply-adds are explicit
// (fused where the build's CPUs have FMA) and the compiler contracts nothing else (setup.py:
// -ffp-contract=off). So the AVX2 and AVX-512 builds give the same bits (the baseline's unfused
// products round differently, within float32 rounding), and a query row's result does not depend on
// which other rows share its work item (blocks of SLOT_BLOCK positions are aligned to absolute
// positions, kv_cache_attention_cpu.h).
//
// Only C headers and internal linkage here (see kv_cache_attention_cpu.h for why).
#include <stdint.h>

#include "kv_cache_attention_cpu.h"
#include "simd.h"

#if !defined(GPTFAST_ATTEND_ROWS)
#error "define GPTFAST_ATTEND_ROWS, GPTFAST_NATIVE_LANES and GPTFAST_FMA before including kv_cache_attention_kernel.h"
#endif

namespace gptfast_kernels {
namespace cpu {
namespace {

constexpr int64_t DOT_LANES = 16;                 // lanes a dot product is summed over, in any build
constexpr int64_t PARTS = DOT_LANES / LANES;      // registers per 16 dot-product lanes
static_assert(PARTS * LANES == DOT_LANES, "GPTFAST_NATIVE_LANES must divide 16");
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));

GPTFAST_INLINE float bits_to_float(uint32_t w) {
  float f;
  __builtin_memcpy(&f, &w, 4);
  return f;
}
GPTFAST_INLINE uint32_t float_to_bits(float f) {
  uint32_t w;
  __builtin_memcpy(&w, &f, 4);
  return w;
}

// IEEE half -> float, exact, branch-free: normal numbers by moving the exponent and scaling by
// 2^-112; subnormals (exponent 0) as (0.5 + m * 2^-24) - 0.5 from a float built around 0.5.
GPTFAST_INLINE vfloat half_to_float(vhalf h) {
  const vuint w = __builtin_convertvector(h, vuint) << 16;
  const vuint sign = w & usplat(0x80000000u);
  const vuint two_w = w + w;
  const vfloat normal = (vfloat)((two_w >> 4) + usplat(0xE0u << 23)) * splat(0x1.0p-112f);
  const vfloat subnormal = (vfloat)((two_w >> 17) | usplat(126u << 23)) - splat(0.5f);
  return (vfloat)(sign | (two_w < usplat(1u << 27) ? (vuint)subnormal : (vuint)normal));
}
GPTFAST_INLINE float half_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t two_w = w + w;
  const float normal = bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  return bits_to_float((w & 0x80000000u) | (two_w < (1u << 27) ? float_to_bits(subnormal) : float_to_bits(normal)));
}

// LANES / 1 numbers of a cache or query buffer as float, at element index i.
template <Elem E>
GPTFAST_INLINE vfloat loadv(const void* base, int64_t i) {
  if constexpr (E == Elem::F32) {
    return load_floats(static_cast<const float*>(base) + i);
  } else {
    vhalf h;
    __builtin_memcpy(&h, static_cast<const uint16_t*>(base) + i, sizeof(h));
    if constexpr (E == Elem::BF16) return (vfloat)(__builtin_convertvector(h, vuint) << 16);
    else return half_to_float(h);
  }
}
template <Elem E>
GPTFAST_INLINE float load1(const void* base, int64_t i) {
  if constexpr (E == Elem::F32) {
    return static_cast<const float*>(base)[i];
  } else {
    const uint16_t h = static_cast<const uint16_t*>(base)[i];
    if constexpr (E == Elem::BF16) return bits_to_float(static_cast<uint32_t>(h) << 16);
    else return half_to_float(h);
  }
}

// The sum of 16 dot-product lanes held in PARTS registers (lane l = part l / LANES, lane l % LANES),
// as the tree that adds lanes l and l + 8, then l + 4, l + 2, l + 1: the same bits at any width (the
// steps across registers here, those within one in reduce_add, simd.h).
GPTFAST_INLINE float dot_sum(vfloat* parts) {
  for (int64_t half = PARTS / 2; half >= 1; half /= 2) {
    for (int64_t i = 0; i < half; ++i) parts[i] += parts[i + half];
  }
  return reduce_add(parts[0]);
}

// e^x in float32 to about 2 ulp: 2^n e^r with n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts)
// and e^r by its Taylor polynomial of degree 7 (|r| <= ln 2 / 2). Below -86.6 it returns 0 (e^-86.6
// is 2e-38; here x is a score minus the running maximum, and -inf on a row's first block), above
// 88.72 +inf, NaN for NaN.
constexpr float EXP_LOW = -86.6f, EXP_HIGH = 88.72f;
constexpr float ROUNDER = 12582912.f;  // 1.5 * 2^23: adding it rounds |y| < 2^22 to an integer
constexpr float LOG2E = 1.44269504088896341f, LN2_HIGH = 0.693145751953125f, LN2_LOW = 1.428606765330187e-06f;
constexpr float INV_FACTORIALS[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};

GPTFAST_INLINE vfloat exp_lanes(vfloat x) {
  const vfloat low = splat(EXP_LOW), high = splat(EXP_HIGH);
  vfloat xc = x < low ? low : x;
  xc = xc > high ? high : xc;
  const vfloat t = xc * LOG2E + ROUNDER;
  const vfloat n = t - ROUNDER;
  vfloat r = xc - n * LN2_HIGH;
  r = r - n * LN2_LOW;
  vfloat p = r * INV_FACTORIALS[7] + INV_FACTORIALS[6];
  for (int i = 5; i >= 0; --i) p = p * r + INV_FACTORIALS[i];
  // 2^(n - 1) (n <= 128 here) and one doubling after: overflows only where e^x does
  const vfloat half_scale = (vfloat)(((vuint)t - usplat(float_to_bits(ROUNDER)) + usplat(126u)) << 23);
  const vfloat y = p * half_scale * 2.f;
  return x < low ? splat(0.f) : (x > high ? splat(__builtin_inff()) : y);
}
// One number through the same lanes: the same bits as exp_lanes gives it.
GPTFAST_INLINE float exp1(float x) { return exp_lanes(splat(x))[0]; }

// q . key row (float32, 16-bit caches converted per block first): 16 dot-product lanes (dot_sum),
// then the tail in order.
GPTFAST_INLINE float dot1(const float* q, const float* keys, int64_t row, int64_t D) {
  vfloat acc[PARTS] = {};
  int64_t d = 0;
  for (; d + DOT_LANES <= D; d += DOT_LANES) {
    for (int64_t i = 0; i < PARTS; ++i) {
      acc[i] = mul_add(load_floats(q + d + i * LANES), load_floats(keys + row + d + i * LANES), acc[i]);
    }
  }
  float s = dot_sum(acc);
  for (; d < D; ++d) s = mul_add(q[d], keys[row + d], s);
  return s;
}

// Four key rows at once (independent sums, q loaded once); each equals dot1's result.
GPTFAST_INLINE void dot4(const float* q, const float* keys, const int64_t* rows, int64_t D, float* out) {
  vfloat acc[4][PARTS] = {};
  int64_t d = 0;
  for (; d + DOT_LANES <= D; d += DOT_LANES) {
    for (int64_t i = 0; i < PARTS; ++i) {
      const vfloat qv = load_floats(q + d + i * LANES);
      for (int k = 0; k < 4; ++k) acc[k][i] = mul_add(qv, load_floats(keys + rows[k] + d + i * LANES), acc[k][i]);
    }
  }
  float s[4];
  for (int k = 0; k < 4; ++k) s[k] = dot_sum(acc[k]);
  for (; d < D; ++d) {
    for (int k = 0; k < 4; ++k) s[k] = mul_add(q[d], keys[rows[k] + d], s[k]);
  }
  for (int k = 0; k < 4; ++k) out[k] = s[k];
}

// acc[0..Dv) = acc * correction + sum_j p[j] * value row j, j = j0 .. j1 - 1 in order; the
// accumulators of 4 registers' columns stay in registers across the block's rows.
GPTFAST_INLINE void accumulate_values(float* acc, float correction, const float* p, const float* values,
                                      const int64_t* rows, int64_t j0, int64_t j1, int64_t Dv) {
  int64_t d = 0;
  for (; d + 4 * LANES <= Dv; d += 4 * LANES) {
    vfloat a0 = load_floats(acc + d) * correction, a1 = load_floats(acc + d + LANES) * correction;
    vfloat a2 = load_floats(acc + d + 2 * LANES) * correction, a3 = load_floats(acc + d + 3 * LANES) * correction;
    for (int64_t j = j0; j < j1; ++j) {
      const vfloat pj = splat(p[j]);
      const int64_t row = rows[j] + d;
      a0 = mul_add(pj, load_floats(values + row), a0);
      a1 = mul_add(pj, load_floats(values + row + LANES), a1);
      a2 = mul_add(pj, load_floats(values + row + 2 * LANES), a2);
      a3 = mul_add(pj, load_floats(values + row + 3 * LANES), a3);
    }
    store_floats(acc + d, a0);
    store_floats(acc + d + LANES, a1);
    store_floats(acc + d + 2 * LANES, a2);
    store_floats(acc + d + 3 * LANES, a3);
  }
  for (; d + LANES <= Dv; d += LANES) {
    vfloat a = load_floats(acc + d) * correction;
    for (int64_t j = j0; j < j1; ++j) a = mul_add(splat(p[j]), load_floats(values + rows[j] + d), a);
    store_floats(acc + d, a);
  }
  for (; d < Dv; ++d) {
    float a = acc[d] * correction;
    for (int64_t j = j0; j < j1; ++j) a = mul_add(p[j], values[rows[j] + d], a);
    acc[d] = a;
  }
}

// First position a query at pos (>= 0) sees: its window's start, its chunk's start, or 0.
GPTFAST_INLINE int64_t first_position(int64_t pos, int64_t window, int64_t chunk) {
  if (window > 0) return pos - window + 1 > 0 ? pos - window + 1 : 0;
  return chunk > 0 ? pos - pos % chunk : 0;
}

// x[0..count) of a cache row (element offset row) as float.
template <Elem E>
GPTFAST_INLINE void to_floats(const void* cache, int64_t row, int64_t count, float* x) {
  int64_t d = 0;
  for (; d + LANES <= count; d += LANES) store_floats(x + d, loadv<E>(cache, row + d));
  for (; d < count; ++d) x[d] = load1<E>(cache, row + d);
}

// One block of positions s0 .. s0 + n - 1 for every query row that reads some of them: scores, the
// online-softmax update and the value sum. Keys and values are float32 rows at the given offsets
// (the cache itself, or a block converted from a 16-bit cache).
GPTFAST_INLINE void attend_block(const AttendArgs& a, int64_t s0, int64_t n, int64_t R, const int64_t* first,
                                 const int64_t* last, const float* q, float* acc, float* row_max, float* row_sum,
                                 float* scores, const float* keys, const int64_t* key_rows, const float* values,
                                 const int64_t* value_rows) {
  const int64_t D = a.D, Dv = a.Dv;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t j0 = first[r] - s0 > 0 ? first[r] - s0 : 0;
    const int64_t j1 = last[r] + 1 - s0 < n ? last[r] + 1 - s0 : n;
    if (j0 >= j1) continue;
    float* p = scores + r * SLOT_BLOCK;
    const float* qr = q + r * D;
    int64_t j = j0;
    for (; j + 4 <= j1; j += 4) dot4(qr, keys, key_rows + j, D, p + j);
    for (; j < j1; ++j) p[j] = dot1(qr, keys, key_rows[j], D);
    if (a.softcap > 0.f) {
      for (j = j0; j < j1; ++j) p[j] = a.softcap * __builtin_tanhf(p[j] / a.softcap);
    }
    float block_max = p[j0];
    for (j = j0 + 1; j < j1; ++j) block_max = p[j] > block_max ? p[j] : block_max;
    const float new_max = block_max > row_max[r] ? block_max : row_max[r];
    const float correction = exp1(row_max[r] - new_max);  // 0 on the first block (max was -inf)
    row_max[r] = new_max;
    for (j = j0; j + LANES <= j1; j += LANES) store_floats(p + j, exp_lanes(load_floats(p + j) - new_max));
    for (; j < j1; ++j) p[j] = exp1(p[j] - new_max);
    float block_sum = 0.f;
    for (j = j0; j < j1; ++j) block_sum += p[j];
    row_sum[r] = row_sum[r] * correction + block_sum;
    accumulate_values(acc + r * Dv, correction, p, values, value_rows, j0, j1, Dv);
  }
}

template <Elem E>
void attend_rows_impl(const AttendArgs& a, int64_t b, int64_t h, int64_t g0, int64_t g1, int64_t t0, int64_t t1,
                      float* out, float* scratch, int64_t* int_scratch) {
  const int64_t D = a.D, Dv = a.Dv, heads = g1 - g0, tokens = t1 - t0, R = heads * tokens;
  float* q = scratch;             // [R, D] scaled queries; row r = (g - g0) * tokens + (t - t0), out's order
  float* acc = q + R * D;         // [R, Dv]
  float* row_max = acc + R * Dv;  // [R]
  float* row_sum = row_max + R;   // [R]
  float* scores = row_sum + R;    // [R, SLOT_BLOCK]
  float* key_block = scores + R * SLOT_BLOCK;      // [SLOT_BLOCK, D] a block's keys as float (16-bit caches)
  float* value_block = key_block + SLOT_BLOCK * D;  // [SLOT_BLOCK, Dv] its values
  int64_t* key_rows = int_scratch;                    // [SLOT_BLOCK] element offsets of a block's cache rows
  int64_t* block_key_rows = key_rows + SLOT_BLOCK;    // [SLOT_BLOCK] the same rows in key_block
  int64_t* block_value_rows = block_key_rows + SLOT_BLOCK;  // [SLOT_BLOCK] and in value_block
  int64_t* first = block_value_rows + SLOT_BLOCK;  // [R] each query row's first and last position,
  int64_t* last = first + R;                       //     last = -1 for padding (no position)

  int64_t lowest = INT64_MAX, highest = -1;
  for (int64_t tt = 0; tt < tokens; ++tt) {
    const int64_t pos = a.positions[b * a.T + t0 + tt];
    const int64_t lo = pos >= 0 ? first_position(pos, a.window, a.chunk) : 0;
    if (pos >= 0) {
      lowest = lo < lowest ? lo : lowest;
      highest = pos > highest ? pos : highest;
    }
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r = (g - g0) * tokens + tt;
      first[r] = lo;
      last[r] = pos;
      const int64_t head = h * a.G + g;
      const int64_t base = b * a.q_stride_b + head * a.q_stride_h + (t0 + tt) * a.q_stride_t;
      for (int64_t d = 0; d < D; ++d) q[r * D + d] = load1<E>(a.q, base + d * a.q_stride_d) * a.scale;
      for (int64_t d = 0; d < Dv; ++d) acc[r * Dv + d] = 0.f;
      // a sink is one more logit, sinks[head], whose value is 0: a first slot of weight e^sink
      row_max[r] = a.sinks ? a.sinks[head] : -__builtin_inff();
      row_sum[r] = a.sinks ? 1.f : 0.f;
    }
  }

  const int64_t head_row = (b * a.Hkv + h) * a.S * a.D;  // element offset of this kv head's slot 0
  const bool values_in_keys = a.values == a.keys;
  for (int64_t s0 = highest < 0 ? 0 : lowest - lowest % SLOT_BLOCK; s0 <= highest; s0 += SLOT_BLOCK) {
    const int64_t n = highest + 1 - s0 < SLOT_BLOCK ? highest + 1 - s0 : SLOT_BLOCK;
    int64_t used_lo = n, used_hi = 0;  // the block's slots some row reads lie in [used_lo, used_hi)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t j0 = first[r] - s0 > 0 ? first[r] - s0 : 0;
      const int64_t j1 = last[r] + 1 - s0 < n ? last[r] + 1 - s0 : n;
      if (j0 >= j1) continue;
      used_lo = j0 < used_lo ? j0 : used_lo;
      used_hi = j1 > used_hi ? j1 : used_hi;
    }
    if (used_lo >= used_hi) continue;  // a gap between the rows' ranges (shuffled or far-apart positions)
    for (int64_t j = 0, slot = a.ring ? s0 % a.S : s0; j < n; ++j, slot = slot + 1 == a.S ? 0 : slot + 1) {
      key_rows[j] = head_row + slot * a.D;
    }
    if constexpr (E == Elem::F32) {
      attend_block(a, s0, n, R, first, last, q, acc, row_max, row_sum, scores, static_cast<const float*>(a.keys),
                   key_rows, static_cast<const float*>(a.values), key_rows);
    } else {
      // 16-bit caches: the rows read are converted to float once here, not once per query row
      for (int64_t j = used_lo; j < used_hi; ++j) {
        to_floats<E>(a.keys, key_rows[j], D, key_block + j * D);
        if (!values_in_keys) to_floats<E>(a.values, key_rows[j], Dv, value_block + j * Dv);
        block_key_rows[j] = j * D;
        block_value_rows[j] = values_in_keys ? j * D : j * Dv;
      }
      attend_block(a, s0, n, R, first, last, q, acc, row_max, row_sum, scores, key_block, block_key_rows,
                   values_in_keys ? key_block : value_block, block_value_rows);
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    const float inv = last[r] >= 0 ? 1.f / row_sum[r] : 0.f;  // padding rows: zeros
    for (int64_t d = 0; d < Dv; ++d) out[r * Dv + d] = acc[r * Dv + d] * inv;
  }
}

#undef GPTFAST_INLINE

}  // namespace

void GPTFAST_ATTEND_ROWS(const AttendArgs& args, int64_t b, int64_t h, int64_t g0, int64_t g1, int64_t t0,
                         int64_t t1, float* out, float* scratch, int64_t* int_scratch) {
  switch (args.elem) {
    case Elem::F32: return attend_rows_impl<Elem::F32>(args, b, h, g0, g1, t0, t1, out, scratch, int_scratch);
    case Elem::F16: return attend_rows_impl<Elem::F16>(args, b, h, g0, g1, t0, t1, out, scratch, int_scratch);
    case Elem::BF16: return attend_rows_impl<Elem::BF16>(args, b, h, g0, g1, t0, t1, out, scratch, int_scratch);
  }
}

}  // namespace cpu
}  // namespace gptfast_kernels
