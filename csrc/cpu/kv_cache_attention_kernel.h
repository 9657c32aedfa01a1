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

// The key and value rows the block functions below read are of element type KE: float32 (a float32
// cache, or a block of a 16-bit cache converted first) or the 16-bit cache itself, widened as it is
// read (exact either way, so the same bits).

// q . key row: 16 dot-product lanes (dot_sum), then the tail in order.
template <Elem KE>
GPTFAST_INLINE float dot1(const float* q, const void* keys, int64_t row, int64_t D) {
  vfloat acc[PARTS] = {};
  int64_t d = 0;
  for (; d + DOT_LANES <= D; d += DOT_LANES) {
    for (int64_t i = 0; i < PARTS; ++i) {
      acc[i] = mul_add(load_floats(q + d + i * LANES), loadv<KE>(keys, row + d + i * LANES), acc[i]);
    }
  }
  float s = dot_sum(acc);
  for (; d < D; ++d) s = mul_add(q[d], load1<KE>(keys, row + d), s);
  return s;
}

// The dots of RB query rows with KB = LANES / RB key rows, each equal to dot1's: one register per dot
// and part, so LANES independent multiply-adds fill the FMA units, each q and key register serves
// several dots, and the 16-lane sums are reduced all at once (reduce_add_each, simd.h). A part's lanes
// take their d in dot1's order whatever the other parts do, so each part's loop runs whole before the
// next's (half the registers of the narrower builds), and the parts are added as dot_sum adds them:
// (0 + 2) + (1 + 3), 0 + 1, or the one part. out[rr][kk]: row rr's dot with key kk.
template <Elem KE, int64_t RB>
GPTFAST_INLINE void dot_rows(const float* const* q, const void* keys, const int64_t* rows, int64_t D,
                             float* const* out) {
  constexpr int64_t KB = LANES / RB;
  const int64_t D16 = D - D % DOT_LANES;
  vfloat part_sums[PARTS > 1 ? 2 : 1][LANES];
  for (int64_t i = 0; i < PARTS; ++i) {
    vfloat acc[LANES] = {};
    for (int64_t d = i * LANES; d < D16; d += DOT_LANES) {
      vfloat qv[RB];
      for (int64_t rr = 0; rr < RB; ++rr) qv[rr] = load_floats(q[rr] + d);
      for (int64_t kk = 0; kk < KB; ++kk) {
        const vfloat kv = loadv<KE>(keys, rows[kk] + d);
        for (int64_t rr = 0; rr < RB; ++rr) acc[rr * KB + kk] = mul_add(qv[rr], kv, acc[rr * KB + kk]);
      }
    }
    for (int64_t k = 0; k < LANES; ++k) part_sums[i % 2][k] = i < 2 ? acc[k] : part_sums[i % 2][k] + acc[k];
  }
  if constexpr (PARTS > 1) {
    for (int64_t k = 0; k < LANES; ++k) part_sums[0][k] += part_sums[1][k];
  }
  float s[LANES];
  store_floats(s, reduce_add_each(part_sums[0]));
  for (int64_t d = D16; d < D; ++d) {
    for (int64_t rr = 0; rr < RB; ++rr) {
      for (int64_t kk = 0; kk < KB; ++kk) {
        s[rr * KB + kk] = mul_add(q[rr][d], load1<KE>(keys, rows[kk] + d), s[rr * KB + kk]);
      }
    }
  }
  for (int64_t rr = 0; rr < RB; ++rr) {
    for (int64_t kk = 0; kk < KB; ++kk) out[rr][kk] = s[rr * KB + kk];
  }
}

// Scores p[rr][j] = q[rr] . key j for j0 <= j < j1 and RB rows: dot_rows over KB keys at a time, then
// one key at a time.
template <Elem KE, int64_t RB>
GPTFAST_INLINE void score_rows(const float* const* q, const void* keys, const int64_t* rows, int64_t j0, int64_t j1,
                               int64_t D, float* const* p) {
  constexpr int64_t KB = LANES / RB;
  int64_t j = j0;
  for (; j + KB <= j1; j += KB) {
    float* out[RB];
    for (int64_t rr = 0; rr < RB; ++rr) out[rr] = p[rr] + j;
    dot_rows<KE, RB>(q, keys, rows + j, D, out);
  }
  for (; j < j1; ++j) {
    for (int64_t rr = 0; rr < RB; ++rr) p[rr][j] = dot1<KE>(q[rr], keys, rows[j], D);
  }
}

// acc[rr][0..Dv) = acc[rr] * correction[rr] + sum_j p[rr][j] * value row j, j = j0 .. j1 - 1 in order,
// for RB rows that read the same positions; VB registers of columns per row stay in registers across
// the block's rows (RB x VB accumulators: 16 in the AVX-512 build, at most 8 in the others, which
// have 16 registers in all), each value register loaded once for the RB rows.
template <Elem KE, int64_t RB>
GPTFAST_INLINE void accumulate_values(float* const* acc, const float* correction, const float* const* p,
                                      const void* values, const int64_t* rows, int64_t j0, int64_t j1, int64_t Dv) {
  constexpr int64_t VB = RB == 4 && LANES < 16 ? 2 : 4;
  int64_t d = 0;
  for (; d + VB * LANES <= Dv; d += VB * LANES) {
    vfloat a[RB][VB];
    for (int64_t rr = 0; rr < RB; ++rr) {
      for (int64_t v = 0; v < VB; ++v) a[rr][v] = load_floats(acc[rr] + d + v * LANES) * correction[rr];
    }
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t row = rows[j] + d;
      vfloat x[VB];
      for (int64_t v = 0; v < VB; ++v) x[v] = loadv<KE>(values, row + v * LANES);
      for (int64_t rr = 0; rr < RB; ++rr) {
        const vfloat pj = broadcast(p[rr] + j);
        for (int64_t v = 0; v < VB; ++v) a[rr][v] = mul_add(pj, x[v], a[rr][v]);
      }
    }
    for (int64_t rr = 0; rr < RB; ++rr) {
      for (int64_t v = 0; v < VB; ++v) store_floats(acc[rr] + d + v * LANES, a[rr][v]);
    }
  }
  for (; d + LANES <= Dv; d += LANES) {
    for (int64_t rr = 0; rr < RB; ++rr) {
      vfloat a = load_floats(acc[rr] + d) * correction[rr];
      for (int64_t j = j0; j < j1; ++j) a = mul_add(broadcast(p[rr] + j), loadv<KE>(values, rows[j] + d), a);
      store_floats(acc[rr] + d, a);
    }
  }
  for (; d < Dv; ++d) {
    for (int64_t rr = 0; rr < RB; ++rr) {
      float a = acc[rr][d] * correction[rr];
      for (int64_t j = j0; j < j1; ++j) a = mul_add(p[rr][j], load1<KE>(values, rows[j] + d), a);
      acc[rr][d] = a;
    }
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

// Query rows scored, and summed over values, together at most: LANES dots of 16 lanes (dot_rows), and
// 4 registers of value columns for each of them (accumulate_values).
constexpr int64_t GROUP_ROWS = 4;
static_assert(GROUP_ROWS == 4, "split_group splits a group as 4, or 2 + 1");

// Rows<RB>: a row count known at compile time (split_group hands one to its callback).
template <int64_t RB>
struct Rows {
  static constexpr int64_t value = RB;
};
// Runs a group of count <= GROUP_ROWS rows as the instantiated row counts: f(Rows<RB>{}, i) for rows
// i .. i + RB - 1, all 4 at once, else 2 and / or 1.
template <typename F>
GPTFAST_INLINE void split_group(int64_t count, F&& f) {
  if (count == 4) return f(Rows<4>{}, 0);
  if (count >= 2) f(Rows<2>{}, 0);
  if (count % 2 == 1) f(Rows<1>{}, count - 1);
}

// The block's slots [j0, j1) query row r reads (empty where it reads none).
struct SlotRange {
  int64_t j0, j1;
};
GPTFAST_INLINE SlotRange slot_range(const int64_t* first, const int64_t* last, int64_t r, int64_t s0, int64_t n) {
  return {first[r] - s0 > 0 ? first[r] - s0 : 0, last[r] + 1 - s0 < n ? last[r] + 1 - s0 : n};
}

// Scores of up to 4 rows at once (rows[0 .. count)) over every slot any of them reads: a row's
// scores outside its own range come from key rows the block holds, and are never read.
template <Elem KE>
GPTFAST_INLINE void score_group(const float* q, const void* keys, const int64_t* key_rows, int64_t D, float* scores,
                                const int64_t* rows, int64_t count, int64_t j0, int64_t j1) {
  const float* qs[GROUP_ROWS];
  float* ps[GROUP_ROWS];
  for (int64_t i = 0; i < count; ++i) {
    qs[i] = q + rows[i] * D;
    ps[i] = scores + rows[i] * SLOT_BLOCK;
  }
  split_group(count, [&](auto rows, int64_t i) {
    score_rows<KE, decltype(rows)::value>(qs + i, keys, key_rows, j0, j1, D, ps + i);
  });
}

// The online-softmax step of `count` rows over their scores p[i][j0, j1) of the block at position s0:
// softcap, ALiBi (with a.alibi_slopes: + slope[i] * (s0 + j - pos[i]), pos[i] row i's query position),
// the new running max, p = e^(p - max), the running sum; correction[i]: the factor row i's accumulated values are
// scaled by. The max is taken lane-wise (exact in any order: a NaN score makes the row NaN whichever
// max it picks, and a max of -0 or +0 gives the same exponentials), the sums add p[j0], p[j0 + 1], ...
// in order, the rows' sums interleaved so that their additions overlap.
GPTFAST_INLINE void softmax_step(const AttendArgs& a, float* const* p, int64_t count, int64_t s0, int64_t j0,
                                 int64_t j1, const float* slope, const int64_t* pos, float* row_max, float* row_sum,
                                 float* correction) {
  float block_sum[GROUP_ROWS];
  for (int64_t i = 0; i < count; ++i) {
    float* pi = p[i];
    int64_t j;
    if (a.softcap > 0.f) {
      for (j = j0; j < j1; ++j) pi[j] = a.softcap * __builtin_tanhf(pi[j] / a.softcap);
    }
    if (a.alibi_slopes) {
      for (j = j0; j < j1; ++j) pi[j] += slope[i] * static_cast<float>(s0 + j - pos[i]);
    }
    float block_max = pi[j0];
    j = j0 + 1;
    if (j + LANES <= j1) {
      vfloat m = load_floats(pi + j);
      for (j += LANES; j + LANES <= j1; j += LANES) {
        const vfloat x = load_floats(pi + j);
        m = x > m ? x : m;
      }
      for (int64_t l = 0; l < LANES; ++l) block_max = m[l] > block_max ? m[l] : block_max;
    }
    for (; j < j1; ++j) block_max = pi[j] > block_max ? pi[j] : block_max;
    const float new_max = block_max > row_max[i] ? block_max : row_max[i];
    correction[i] = exp1(row_max[i] - new_max);  // 0 on the first block (max was -inf)
    row_max[i] = new_max;
    for (j = j0; j + LANES <= j1; j += LANES) store_floats(pi + j, exp_lanes(load_floats(pi + j) - new_max));
    for (; j < j1; ++j) pi[j] = exp1(pi[j] - new_max);
    block_sum[i] = 0.f;
  }
  for (int64_t j = j0; j < j1; ++j) {
    for (int64_t i = 0; i < count; ++i) block_sum[i] += p[i][j];
  }
  for (int64_t i = 0; i < count; ++i) row_sum[i] = row_sum[i] * correction[i] + block_sum[i];
}

// One block of positions s0 .. s0 + n - 1 for every query row that reads some of them: scores (up to
// 4 rows at once), the online-softmax update and the value sum (up to 4 rows that read the same
// slots at once: decode's heads of a group, and prefill's rows on blocks below the diagonal). Keys and
// values are rows of KE at the given offsets (the cache itself, or a block of a 16-bit cache converted
// to float32). Each row's operations and their order are the same however rows are grouped.
template <Elem KE>
GPTFAST_INLINE void attend_block(const AttendArgs& a, int64_t s0, int64_t n, int64_t R, const int64_t* first,
                                 const int64_t* last, const float* q, float* acc, float* row_max, float* row_sum,
                                 const float* row_slope, float* scores, const void* keys, const int64_t* key_rows,
                                 const void* values, const int64_t* value_rows) {
  const int64_t D = a.D, Dv = a.Dv;
  int64_t group[GROUP_ROWS], count = 0, lo = n, hi = 0;
  for (int64_t r = 0; r < R; ++r) {
    const SlotRange range = slot_range(first, last, r, s0, n);
    if (range.j0 >= range.j1) continue;
    group[count++] = r;
    lo = range.j0 < lo ? range.j0 : lo;
    hi = range.j1 > hi ? range.j1 : hi;
    if (count == GROUP_ROWS) {
      score_group<KE>(q, keys, key_rows, D, scores, group, count, lo, hi);
      count = 0, lo = n, hi = 0;
    }
  }
  if (count > 0) score_group<KE>(q, keys, key_rows, D, scores, group, count, lo, hi);

  for (int64_t r = 0; r < R;) {
    const SlotRange range = slot_range(first, last, r, s0, n);
    if (range.j0 >= range.j1) {
      ++r;
      continue;
    }
    count = 1;
    while (count < GROUP_ROWS && r + count < R) {
      const SlotRange next = slot_range(first, last, r + count, s0, n);
      if (next.j0 != range.j0 || next.j1 != range.j1) break;
      ++count;
    }
    float correction[GROUP_ROWS], *accs[GROUP_ROWS], *ps[GROUP_ROWS];
    for (int64_t i = 0; i < count; ++i) {
      accs[i] = acc + (r + i) * Dv;
      ps[i] = scores + (r + i) * SLOT_BLOCK;
    }
    softmax_step(a, ps, count, s0, range.j0, range.j1, row_slope + r, last + r, row_max + r, row_sum + r,
                 correction);
    split_group(count, [&](auto rows, int64_t i) {
      accumulate_values<KE, decltype(rows)::value>(accs + i, correction + i, ps + i, values, value_rows, range.j0,
                                                   range.j1, Dv);
    });
    r += count;
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
  float* row_slope = row_sum + R;  // [R] ALiBi slopes (unused without)
  float* scores = row_slope + R;   // [R, SLOT_BLOCK]
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
      row_slope[r] = a.alibi_slopes ? a.alibi_slopes[head] : 0.f;
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
    if (E == Elem::F32 || R <= GROUP_ROWS) {
      // float32, or one group of rows (score_group, attend_block): the cache rows are read as they are
      attend_block<E>(a, s0, n, R, first, last, q, acc, row_max, row_sum, row_slope, scores, a.keys, key_rows,
                      a.values, key_rows);
    } else {
      // 16-bit caches read by several groups of rows: the rows read are converted to float once here,
      // not once per group
      for (int64_t j = used_lo; j < used_hi; ++j) {
        to_floats<E>(a.keys, key_rows[j], D, key_block + j * D);
        if (!values_in_keys) to_floats<E>(a.values, key_rows[j], Dv, value_block + j * Dv);
        block_key_rows[j] = j * D;
        block_value_rows[j] = values_in_keys ? j * D : j * Dv;
      }
      attend_block<Elem::F32>(a, s0, n, R, first, last, q, acc, row_max, row_sum, row_slope, scores, key_block,
                              block_key_rows, values_in_keys ? key_block : value_block, block_value_rows);
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
