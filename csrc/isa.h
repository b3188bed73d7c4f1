// What the op families' SIMD code shares: the x86 guard, the target attribute of each dispatch tier and
// the horizontal sum. A function marked with a tier's attribute may only run where isa_level() (and, for
// a tier with an extra feature, that cpu_features() bit) says the CPU has it: each family's dispatch
// checks exactly that before calling it.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TUNIX_RT_X86 1

// IsaLevel::kAvx2.
#define AVX2_FN __attribute__((target("avx2,fma")))
// IsaLevel::kAvx2 and cpu_features().f16c (the fp16 scales of quantized weights).
#define AVX2_F16C_FN __attribute__((target("avx2,fma,f16c")))
// IsaLevel::kAvx512 (F, BW and VL).
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
// IsaLevel::kAvx512 and cpu_features().f16c.
#define AVX512_F16C_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
// IsaLevel::kAvx512, cpu_features().avx512vnni and f16c.
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
// IsaLevel::kAvx512 and cpu_features().avx512bf16.
#define BF16_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace tunix_rt {

// The sum of 8 lanes in one fixed order: the two halves, then pairs, then the last two.
AVX2_FN inline float HSum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

}  // namespace tunix_rt
#endif
