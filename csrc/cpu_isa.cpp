// Which instruction set the CPU kernels run (common.h: CpuIsa), and the private ops that read and
// switch it: _cpu_isa(isa="") -> the one in use before the call, _cpu_isas() -> those this CPU runs.
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "common.h"

namespace gptfast_kernels {
namespace {

constexpr const char* ISA_NAMES[] = {"baseline", "avx2", "avx512"};  // by CpuIsa value

bool supported(CpuIsa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  switch (isa) {
    // BW as well as F: the int8 kernels' byte transposes use it, and every AVX-512 CPU but the Xeon Phi has it
    case CpuIsa::avx512: return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    case CpuIsa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::baseline: return true;
  }
  return false;
#else
  return isa == CpuIsa::baseline;
#endif
}

// Those this CPU runs, best first.
std::vector<std::string> supported_names() {
  std::vector<std::string> names;
  for (int64_t i = 2; i >= 0; --i) {
    if (supported(static_cast<CpuIsa>(i))) names.emplace_back(ISA_NAMES[i]);
  }
  return names;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// The value of a supported instruction set's name, or -1.
int64_t find(const std::string& name) {
  for (int64_t i = 0; i < 3; ++i) {
    if (name == ISA_NAMES[i] && supported(static_cast<CpuIsa>(i))) return i;
  }
  return -1;
}

std::atomic<int64_t>& chosen() {
  static std::atomic<int64_t> isa([] {
    const char* forced = std::getenv("GPTFAST_KERNELS_CPU_ISA");
    if (forced != nullptr && forced[0] != '\0') {
      const int64_t i = find(forced);
      TORCH_CHECK(i >= 0, "GPTFAST_KERNELS_CPU_ISA=", forced, " is not an instruction set this CPU runs; it runs: ",
                  joined(supported_names()));
      return i;
    }
    return find(supported_names().front());
  }());
  return isa;
}

std::string cpu_isa_op(const std::string& isa) {
  const std::string before = ISA_NAMES[chosen().load()];
  if (!isa.empty()) {
    const int64_t i = find(isa);
    TORCH_CHECK(i >= 0, "_cpu_isa: isa must be one this CPU runs (", joined(supported_names()), "), got '", isa, "'");
    chosen().store(i);
  }
  return before;
}

}  // namespace

CpuIsa cpu_isa() { return static_cast<CpuIsa>(chosen().load()); }

TORCH_LIBRARY_FRAGMENT(gptfast_kernels, m) {
  m.def("_cpu_isa(str isa=\"\") -> str", &cpu_isa_op);
  m.def("_cpu_isas() -> str[]", &supported_names);
}

}  // namespace gptfast_kernels
