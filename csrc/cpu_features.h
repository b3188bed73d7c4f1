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
  // AMD's AVX-512 (Zen 4, family 19h; Zen 5, 1Ah): there the memory-bound int8 GEMV runs faster on
  // 256-bit registers (measured on a Zen 5 EPYC: default-model decode 3.6 against 4.9 ms of int8 products
  // per step at 1 stream, 6.2 against 7.8 at 4), while the compute-bound int8 GEMM gains from AVX-512 VNNI.
  bool amd_avx512 = false;
};

// Kernel tiers, ordered: a kernel family picks the highest tier it implements that is <= the
// detected one. kAvxVnni is AVX2 with AVX-VNNI (vpdpbusd on 256-bit registers, VEX-encoded: Intel
// Alder Lake and later, AMD Zen 5); a CPU can have AVX-512 without it, so kernels of that tier check
// cpu_features().avxvnni as well. TUNIX_RT_ISA=scalar|avx2|avxvnni|avx512 caps the tier (tests use it
// to cover every path); a cap at avxvnni on a CPU without AVX-VNNI gives avx2.
enum class IsaLevel { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512 = 3 };

const CpuFeatures& cpu_features();
IsaLevel isa_level();
const char* isa_level_name(IsaLevel level);

}  // namespace tunix_rt
