// kv_cache_attention CUDA entry point: input checks, launch parameters, and the choice between the
// decode (kv_cache_attention_decode.cu) and prefill (kv_cache_attention_prefill.cu) kernels.
// How the kernels work: kv_cache_attention.cuh.
#include "kv_cache_attention.cuh"

namespace gptfast_kernels {
using namespace kv_attention;

// q [B, Hq, T, D], k / v [B, Hkv, T, D] (head dim contiguous); k_cache / v_cache [B, Hkv, S, D]
// contiguous, written in place; positions [B, T] int64 -> out [B, Hq, T, D] contiguous.
// value_dim = Dv > 0 (values in the keys): v and v_cache are empty and never touched; the kernels'
// V sources are k and k_cache themselves (rows of D, the first Dv read), and out is [B, Hq, T, Dv].
// chunk_size = C > 0: a query at p sees p - p % C .. p (Scoring::first_slot).
// alibi_slopes [Hq] float32: ALiBi, slope * (key position - query position) added to scores (Scoring::biased).
// No host synchronisation: position values are never read on the host, so the op is capturable;
// out-of-range positions are treated as padding by the kernels. ring: the caches are ring buffers
// (position p in slot p % S; with a window or a chunk_size); the caller's span contract on positions
// is not checked here (that would read them), and when violated the kernels still stay inside the
// caches.
at::Tensor kv_cache_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& positions,
                                   double scale, int64_t window, double softcap,
                                   const std::optional<at::Tensor>& sinks, bool ring, int64_t value_dim,
                                   int64_t chunk_size, const std::optional<at::Tensor>& alibi_slopes) {
  constexpr const char* op = "kv_cache_attention";
  const int64_t Dv = check_kv_cache_attention_inputs(q, k, v, k_cache, v_cache, positions, scale, window, softcap,
                                                     sinks, ring, value_dim, chunk_size, alibi_slopes);
  const bool values_in_keys = value_dim > 0;
  // The tensors the values are read from (v may then be an empty tensor of any rank: no strides)
  const at::Tensor& values = values_in_keys ? k : v;
  at::Tensor& value_cache = values_in_keys ? k_cache : v_cache;
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), Dv}, q.options());
  if (q.numel() == 0) return out;
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k_cache.size(2);
  TORCH_CHECK(S <= MAX_SLOTS, op, ": cache length S = ", S, " exceeds ", MAX_SLOTS);
  TORCH_CHECK(Hq <= INT_MAX && T <= INT_MAX, op, ": Hq and T must fit in int32");
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  GPTFAST_DISPATCH_FLOAT_HALF_BF16(q.scalar_type(), "kv_cache_attention_cuda", [&] {
    Params<scalar_t> p{};
    p.q = q.data_ptr<scalar_t>();
    p.k = k.data_ptr<scalar_t>();
    p.v = values.data_ptr<scalar_t>();
    p.k_cache = k_cache.data_ptr<scalar_t>();
    p.v_cache = value_cache.data_ptr<scalar_t>();
    p.positions = positions.data_ptr<int64_t>();
    p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
    p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
    p.out = out.data_ptr<scalar_t>();
    p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_st = q.stride(2);
    p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_st = k.stride(2);
    p.v_sb = values.stride(0), p.v_sh = values.stride(1), p.v_st = values.stride(2);
    p.Hq = static_cast<int>(Hq), p.Hkv = static_cast<int>(Hkv), p.G = static_cast<int>(Hq / Hkv);
    p.T = static_cast<int>(T), p.S = static_cast<int>(S), p.D = static_cast<int>(D), p.Dv = static_cast<int>(Dv);
    constexpr double LOG2_E = 1.4426950408889634;
    p.score.scale_log2 = static_cast<float>(scale * LOG2_E);
    p.score.cap_log2 = static_cast<float>(softcap * LOG2_E);
    p.score.inv_cap_log2 = softcap > 0 ? static_cast<float>(1.0 / (softcap * LOG2_E)) : 0.f;
    p.score.window = static_cast<int>(window);  // checked: fits int
    p.score.chunk = static_cast<int>(chunk_size);  // checked: fits int, and never with a window
    p.score.alibi = alibi_slopes.has_value();
    // 16-byte global vectors need aligned rows: every base pointer and row stride a multiple of them
    // (with values in the keys k's and k_cache's alone; Dv need not be a multiple, see load_vec).
    const int64_t vec = VEC<scalar_t>;
    bool gvec = D % vec == 0;
    for (const at::Tensor* x : {&q, &k, &values}) {
      gvec = gvec && aligned16(x->data_ptr()) && x->stride(0) % vec == 0 && x->stride(1) % vec == 0 &&
             x->stride(2) % vec == 0;
    }
    gvec = gvec && aligned16(k_cache.data_ptr()) && aligned16(value_cache.data_ptr());
    if (T <= DECODE_MAX_T) {
      launch_decode<scalar_t>(p, B, q, gvec, ring, values_in_keys, stream);
    } else {
      launch_prefill<scalar_t>(p, B, gvec, ring, values_in_keys, stream);
    }
  });
  return out;
}

TORCH_LIBRARY_IMPL(gptfast_kernels, CUDA, m) {
  m.impl("kv_cache_attention", &kv_cache_attention_cuda);
}

}  // namespace gptfast_kernels
