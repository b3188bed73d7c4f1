// What the op families' SIMD code shares: the x86 guard, the target attribute of each dispatch tier, the vector exp and
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
// IsaLevel::kAvxVnni and cpu_features().avxvnni, f16c.
#define AVX_VNNI_FN __attribute__((target("avx2,fma,f16c,avxvnni")))
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

// e^x as 2^n e^r, n = round(x log2 e), r = x - n ln 2 in two parts, e^r by Cephes' expf polynomial
// (about 1 ulp); x is clamped to where the result is 0 or finite (max/min return their second
// operand when one is NaN, so a NaN score stays NaN and reaches the output as the reference's would).
AVX2_FN inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));  // NaN stays NaN
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

// As Exp8, 16 lanes; AVX-512's scalef gives 2^n with gradual underflow.
AVX512_FN inline __m512 Exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.3f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));  // NaN stays NaN
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);  // 2^n with gradual underflow
}

}  // namespace tunix_rt
#endif
