// Small CUDA helpers shared by the kernels in csrc/cuda/ (each op's own constants stay in its file).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

namespace gptfast_kernels {

constexpr int WARP = 32;
constexpr unsigned FULL_MASK = 0xffffffffu;

// Butterfly reductions: every lane of the (converged) warp gets the result.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = WARP / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(FULL_MASK, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = WARP / 2; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
  return v;
}

// Scalar conversions through float (c10::Half / c10::BFloat16 / float).
template <typename T>
__device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <typename scalar_t>
__device__ __forceinline__ scalar_t from_float(float v) { return static_cast<scalar_t>(v); }

// Two 16-bit activations packed in a 32-bit word (the lower-addressed one in the low half) -> floats.
// A bf16 is the upper half of its float: one shift and one mask (converting each half on its own
// costs the upper one a byte permute and a shift).
__device__ __forceinline__ float2 pair_to_float2(unsigned w, c10::Half) {
  return __half22float2(*reinterpret_cast<__half2*>(&w));
}
__device__ __forceinline__ float2 pair_to_float2(unsigned w, c10::BFloat16) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// Word i (0..3) of a 16-byte vector.
__device__ __forceinline__ uint32_t word_of(const int4& v, int i) {
  return static_cast<uint32_t>(i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w);
}

// COUNT consecutive values of type T from 16-byte aligned src, loaded as 16-byte vectors through
// the read-only path, -> floats (16-bit ones a pair per 32-bit word).
template <typename T, int COUNT>
__device__ __forceinline__ void load_to_float(const T* src, float (&out)[COUNT]) {
  static_assert(COUNT * sizeof(T) % 16 == 0, "load_to_float reads whole 16-byte vectors");
  constexpr int VECS = COUNT * sizeof(T) / 16;
  int4 v[VECS];
#pragma unroll
  for (int j = 0; j < VECS; ++j) v[j] = __ldg(reinterpret_cast<const int4*>(src) + j);
#pragma unroll
  for (int j = 0; j < VECS; ++j)
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if constexpr (std::is_same_v<T, float>) {
        out[4 * j + w] = __uint_as_float(word_of(v[j], w));
      } else {
        const float2 pair = pair_to_float2(word_of(v[j], w), T());
        out[8 * j + 2 * w] = pair.x;
        out[8 * j + 2 * w + 1] = pair.y;
      }
    }
}

// Byte i of a word of four int8 values, each stored biased (b ^ 0x80 = b + 128 as unsigned), -> the
// float b, without the conversion unit: the biased byte placed in the mantissa of 2^23 reads as
// 2^23 + 128 + b (exact: the ulp there is 1), so one PRMT (integer pipe) and one FADD give b exactly.
__device__ __forceinline__ float biased_int8_to_float(unsigned biased, int i) {
  constexpr unsigned MAGIC_BITS = 0x4B000000u;  // 2^23 as float bits
  constexpr float MAGIC_PLUS_BIAS = 8388608.f + 128.f;
  // result bytes: [biased byte i, 0, 0, 0x4B] (selector nibbles 7, 5, 4, i over {biased, MAGIC_BITS})
  return __uint_as_float(__byte_perm(biased, MAGIC_BITS, 0x7540u | i)) - MAGIC_PLUS_BIAS;
}

// Programmatic dependent launch (sm_90+). A kernel launched with launch_kernel(..., programmatic =
// true) may start while the kernel before it in the stream is still finishing; it must call
// wait_for_inputs() before it reads anything an earlier kernel wrote and before its first global
// write (the earlier kernel may still read that memory). Work that depends on no earlier kernel
// (loading weights) can go before the wait. allow_dependents() lets the next programmatic launch
// start once every block of this grid has called it or exited. Our kernels call it only after their
// wait: a dependent that starts early then knows that every kernel before this one has finished, so
// it may read their outputs at once and wait only for this one's, as inductor's programmatic kernels
// do (TORCHINDUCTOR_ENABLE_PDL=1: a kernel waits before the loads of buffers its immediate
// predecessor writes, not before the others). Called first (as until 2026-11-28), it let such a
// dependent run while this kernel still waited for the one before. Without the launch attribute,
// or below sm_90, both are no-ops.
__device__ __forceinline__ void wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// Asks L2 for the line holding ptr (no register is written; a hint the hardware may drop).
constexpr int L2_LINE = 128;
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

// kernel<<<grid, block, shared_bytes, stream>>>(args...), as a programmatic dependent launch when
// `programmatic` (see wait_for_inputs).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   bool programmatic, Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

// Host-side grid arithmetic.
inline int64_t ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether a pointer allows 16-byte vector loads / stores.
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// An attribute of the current device (a host-side lookup: no synchronisation).
inline int device_attribute(cudaDeviceAttr attr) {
  int device = 0, value = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  return value;
}

// Whether `kernel`, as it runs on the current device, was compiled for sm_90 or newer: a build whose
// only code for this device is an older architecture's PTX (e.g. TORCH_CUDA_ARCH_LIST="8.0+PTX" on
// an H100, compiled by the driver) has no griddepcontrol.wait in it, so a programmatic launch of it
// could read its inputs before the kernel that writes them is done. Looked up once per kernel and
// device.
inline bool compiled_for_sm90(const void* kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> known;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find({kernel, device});
  if (found != known.end()) return found->second;
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return known[{kernel, device}] = attributes.ptxVersion >= 90;
}

// Whether launches of `kernel` (one of the kernels written for it: the int8 GEMVs and tensor-core
// kernels) are programmatic, on a device of compute capability 9.0 or newer and with code compiled
// for it: yes unless GPTFAST_CUDA_PDL=0 (read once per process; unset, empty or "1": on). On by
// default since the H200 timed it (2026-11-28, a284fc8, a decode step's layers in a CUDA graph):
// never more than 1 % slower, 4-8 rows of 4096 x 4096 8.2 -> 7.2 us, one row of 4096 x 14336
// 19.3 -> 18.3 us; end to end, with the Triton decode attention's launches programmatic too
// (GPTFAST_CUDA_PDL=1), 296 -> 320 decode tokens/s at batch 1.
template <typename... Params>
bool programmatic_launch_enabled(void (*kernel)(Params...)) {
  static const bool requested = [] {
    const char* value = std::getenv("GPTFAST_CUDA_PDL");
    if (value == nullptr || *value == '\0' || std::strcmp(value, "1") == 0) return true;
    TORCH_CHECK(std::strcmp(value, "0") == 0, "the environment variable GPTFAST_CUDA_PDL must be 0 or 1, got '",
                value, "'");
    return false;
  }();
  return requested && device_attribute(cudaDevAttrComputeCapabilityMajor) >= 9 &&
         compiled_for_sm90(reinterpret_cast<const void*>(kernel));
}

// The CUDA type of a 16-bit ATen scalar type, as WMMA fragments take it.
template <typename T>
struct MmaType;
template <>
struct MmaType<c10::Half> { using type = __half; };
template <>
struct MmaType<c10::BFloat16> { using type = __nv_bfloat16; };

}  // namespace gptfast_kernels
