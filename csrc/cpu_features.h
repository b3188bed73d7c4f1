// CPU ISA detection and the dispatch level every kernel family selects from.
#pragma once

#include <string>

namespace tunix_rt {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512bw = false;
  bool avx512vl = false;
  bool avx512vnni = false;
  bool avx512bf16 = false;
  bool avxvnni = false;
  bool amx_bf16 = false;  // AMX tiles with bf16 dot products (XLA's CPU dots use them; our kernels do not)
};

// Kernel tiers, ordered: a kernel family picks the highest tier it implements that is <= the
// detected one. TUNIX_RT_ISA=scalar|avx2|avx512 caps the tier (tests use it to cover every path).
enum class IsaLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

const CpuFeatures& cpu_features();
IsaLevel isa_level();
const char* isa_level_name(IsaLevel level);

}  // namespace tunix_rt
