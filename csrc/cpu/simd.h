// Float vectors of the register width for the CPU kernels compiled once per instruction set
// (kv_cache_attention_kernel.h, int8_gemv_kernel.h, int8_gemm_kernel.h): the including file sets a
// `#pragma GCC target` and defines GPTFAST_NATIVE_LANES (floats per register: 16, 8, 4) and
// GPTFAST_FMA (1 where the build's CPUs fuse multiply-adds).
//
// Only C headers and internal linkage here: an inline function with external linkage would be
// compiled once per instruction set and, as a weak symbol, the linker could keep the AVX-512 copy
// for every caller.
#pragma once

#include <stdint.h>
#if GPTFAST_FMA
#include <immintrin.h>  // intrinsics are gnu_inline: never emitted out of line, so safe here
#endif

#if !defined(GPTFAST_NATIVE_LANES) || !defined(GPTFAST_FMA)
#error "define GPTFAST_NATIVE_LANES and GPTFAST_FMA before including simd.h"
#endif

namespace gptfast_kernels {
namespace cpu {
namespace {

#define GPTFAST_INLINE inline __attribute__((always_inline))

constexpr int64_t LANES = GPTFAST_NATIVE_LANES;  // floats per register
typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef uint32_t vuint __attribute__((vector_size(LANES * 4)));
typedef int32_t vint __attribute__((vector_size(LANES * 4)));

GPTFAST_INLINE vfloat splat(float x) { return vfloat{} + x; }
GPTFAST_INLINE vuint usplat(uint32_t x) { return vuint{} + x; }

// *p in every lane, read straight into the register (splat adds it to zeros first, which the
// compiler may not drop: -0 + 0 is +0).
#if GPTFAST_FMA && GPTFAST_NATIVE_LANES == 16
GPTFAST_INLINE vfloat broadcast(const float* p) { return _mm512_set1_ps(*p); }
#elif GPTFAST_FMA && GPTFAST_NATIVE_LANES == 8
GPTFAST_INLINE vfloat broadcast(const float* p) { return _mm256_set1_ps(*p); }
#elif GPTFAST_NATIVE_LANES == 4
GPTFAST_INLINE vfloat broadcast(const float* p) {  // one shuffle (a loop of lane stores made four)
  const vfloat x = {*p, 0.f, 0.f, 0.f};
  return __builtin_shufflevector(x, x, 0, 0, 0, 0);
}
#else
GPTFAST_INLINE vfloat broadcast(const float* p) {
  vfloat v;
  for (int64_t l = 0; l < LANES; ++l) v[l] = *p;
  return v;
}
#endif

// a * b + c: one fused multiply-add in the builds for CPUs that have it (GPTFAST_FMA: AVX2, AVX-512),
// a product and a sum in the baseline build. Nothing else is fused (setup.py: -ffp-contract=off).
#if GPTFAST_FMA && GPTFAST_NATIVE_LANES == 16
GPTFAST_INLINE vfloat mul_add(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
#elif GPTFAST_FMA && GPTFAST_NATIVE_LANES == 8
GPTFAST_INLINE vfloat mul_add(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
#else
GPTFAST_INLINE vfloat mul_add(vfloat a, vfloat b, vfloat c) { return a * b + c; }
#endif
#if GPTFAST_FMA
GPTFAST_INLINE float mul_add(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
GPTFAST_INLINE float mul_add(float a, float b, float c) { return a * b + c; }
#endif

// LANES int8 weights at p as floats (sign-extended, then converted: exact). GCC 12 makes scalar code
// of __builtin_convertvector from int8, so the sign extension is an intrinsic where there is one (the
// masked AVX-512 form: the plain one starts from _mm512_undefined_epi32, which GCC warns is used
// uninitialized), and in the baseline build each byte is unpacked to the top of its lane and shifted
// down (SSE2 has no byte sign extension).
#if GPTFAST_FMA && GPTFAST_NATIVE_LANES == 16
GPTFAST_INLINE vfloat widen(const int8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return __builtin_convertvector((vint)_mm512_maskz_cvtepi8_epi32(static_cast<__mmask16>(0xFFFF), bytes), vfloat);
}
#elif GPTFAST_FMA && GPTFAST_NATIVE_LANES == 8
GPTFAST_INLINE vfloat widen(const int8_t* p) {
  return __builtin_convertvector((vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), vfloat);
}
#elif GPTFAST_NATIVE_LANES == 4
GPTFAST_INLINE vfloat widen(const int8_t* p) {
  typedef int8_t vbytes16 __attribute__((vector_size(16)));
  typedef int16_t vshorts8 __attribute__((vector_size(16)));
  uint32_t word;
  __builtin_memcpy(&word, p, 4);
  const vbytes16 bytes = (vbytes16)(vuint{word, 0, 0, 0});  // movd
  const vbytes16 pairs = __builtin_shufflevector(bytes, bytes, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const vshorts8 quads = __builtin_shufflevector((vshorts8)pairs, (vshorts8)pairs, 0, 0, 1, 1, 2, 2, 3, 3);
  return __builtin_convertvector((vint)quads >> 24, vfloat);
}
#endif

// The sum of v's lanes, added pairwise: lane l + lane l + LANES / 2, then the same over the halved
// vector, down to one lane. The same order in every build of a width, and vector adds on the way.
typedef float vfloat8 __attribute__((vector_size(32)));
typedef float vfloat4 __attribute__((vector_size(16)));
typedef float vfloat2 __attribute__((vector_size(8)));
GPTFAST_INLINE float reduce_add(vfloat v) {
#if GPTFAST_NATIVE_LANES == 16
  const vfloat8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif GPTFAST_NATIVE_LANES == 8
  const vfloat8 v8 = v;
#endif
#if GPTFAST_NATIVE_LANES >= 8
  const vfloat4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
#else
  const vfloat4 v4 = v;
#endif
  const vfloat2 v2 = __builtin_shufflevector(v4, v4, 0, 1) + __builtin_shufflevector(v4, v4, 2, 3);
  return v2[0] + v2[1];
}

// reduce_add of LANES vectors at once, transposed: lane k of the result is reduce_add(v[k]), the same
// pairs added in the same order, so the same bits. Each step folds two vectors whose lanes hold groups
// of W partial sums (one group per original vector) into one with twice the groups of half the width:
// a group's lane m is added to its lane m + W / 2, as reduce_add does; x's groups come first, then y's,
// so the groups stay in v's order. LANES / 2 + LANES / 4 + ... + 1 adds, each of two shuffles.
constexpr int64_t fold_source(int64_t W, int64_t high, int64_t i) {
  const int64_t group = i / (W / 2), groups = LANES / W;
  return (group < groups ? group * W : LANES + (group - groups) * W) + i % (W / 2) + high * (W / 2);
}
#if GPTFAST_NATIVE_LANES == 16
#define GPTFAST_FOLD_LANES(W, high)                                                                             \
  fold_source(W, high, 0), fold_source(W, high, 1), fold_source(W, high, 2), fold_source(W, high, 3),          \
      fold_source(W, high, 4), fold_source(W, high, 5), fold_source(W, high, 6), fold_source(W, high, 7),      \
      fold_source(W, high, 8), fold_source(W, high, 9), fold_source(W, high, 10), fold_source(W, high, 11),    \
      fold_source(W, high, 12), fold_source(W, high, 13), fold_source(W, high, 14), fold_source(W, high, 15)
#elif GPTFAST_NATIVE_LANES == 8
#define GPTFAST_FOLD_LANES(W, high)                                                                             \
  fold_source(W, high, 0), fold_source(W, high, 1), fold_source(W, high, 2), fold_source(W, high, 3),          \
      fold_source(W, high, 4), fold_source(W, high, 5), fold_source(W, high, 6), fold_source(W, high, 7)
#else
#define GPTFAST_FOLD_LANES(W, high) fold_source(W, high, 0), fold_source(W, high, 1), fold_source(W, high, 2), \
                                    fold_source(W, high, 3)
#endif
template <int64_t W>
GPTFAST_INLINE void fold_groups(vfloat* v) {  // v[0 .. W) -> v[0 .. W / 2)
  for (int64_t i = 0; i < W / 2; ++i) {
    const vfloat x = v[2 * i], y = v[2 * i + 1];
    v[i] = __builtin_shufflevector(x, y, GPTFAST_FOLD_LANES(W, 0)) +
           __builtin_shufflevector(x, y, GPTFAST_FOLD_LANES(W, 1));
  }
  if constexpr (W > 2) fold_groups<W / 2>(v);
}
#undef GPTFAST_FOLD_LANES
GPTFAST_INLINE vfloat reduce_add_each(vfloat* v) {  // v[0 .. LANES), overwritten
  fold_groups<LANES>(v);
  return v[0];
}

GPTFAST_INLINE vfloat load_floats(const float* p) {
  vfloat x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}
GPTFAST_INLINE void store_floats(float* p, vfloat x) { __builtin_memcpy(p, &x, sizeof(x)); }

}  // namespace
}  // namespace cpu
}  // namespace gptfast_kernels
