// The exact weight quantizers and dequantizer, and the activations' block quantizers (see quant_formats.h).
#include "quant_formats.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace tunix_rt {
namespace quant {
namespace {

void StoreScale(const Layout& l, void* scales, int64_t i, float d) {
  if (l.f->f16_scales) {
    static_cast<uint16_t*>(scales)[i] = F32ToF16(d);
  } else {
    static_cast<float*>(scales)[i] = d;
  }
}

void PackNibbles(const uint8_t* q, int64_t count, uint8_t* out) {
  for (int64_t s = 0; s < count; s += kSub)
    for (int64_t j = 0; j < kSub / 2; ++j) out[s / 2 + j] = static_cast<uint8_t>(q[s + j] | (q[s + j + kSub / 2] << 4));
}

}  // namespace

ffi::Error MakeLayout(int32_t fmt, int64_t group, int64_t n, int64_t k, Layout* out) {
  if (fmt < 0 || fmt >= kNumFormats) return InvalidArgument("quant: unknown format id");
  if (group != 32 && group != 64 && group != 128) return InvalidArgument("quant: group must be 32, 64 or 128");
  if (k % group != 0) return InvalidArgument("quant: K must be a multiple of the group size");
  *out = Layout{&kFormats[fmt], n, k, group};
  return ffi::Error::Success();
}

ffi::Error CheckWeights(const Layout& l, const ffi::AnyBuffer& qs, const ffi::AnyBuffer& scales,
                        const ffi::AnyBuffer& mins, const Stack& s) {
  ffi::Span<const int64_t> qd, sd, md;
  if (!LayerDims(qs, s, &qd) || qd.size() != 2 || qd[0] != l.n || qd[1] != l.row_bytes())
    return InvalidArgument("quant: qs shape does not match ([S,] N, K*bits/8)");
  if (!LayerDims(scales, s, &sd) || sd.size() != 2 || sd[0] != l.n || sd[1] != l.groups())
    return InvalidArgument("quant: scales shape does not match ([S,] N, K/group)");
  const auto want_scale = l.f->f16_scales ? ffi::DataType::F16 : ffi::DataType::F32;
  if (scales.element_type() != want_scale) return InvalidArgument("quant: scales dtype does not match the format");
  if (!LayerDims(mins, s, &md) || md.size() != 2 || md[0] != l.n || md[1] != (l.f->has_min ? l.groups() : 0))
    return InvalidArgument("quant: mins shape does not match the format");
  if (l.f->has_min && mins.element_type() != ffi::DataType::F16) return InvalidArgument("quant: mins must be float16");
  return ffi::Error::Success();
}

ffi::Error CheckLanes(const Layout& l, const ffi::AnyBuffer& lanes, const Stack& s) {
  if (lanes.element_count() == 0) return ffi::Error::Success();
  ffi::Span<const int64_t> d;
  const int64_t tiles = (l.n + kLaneColumns - 1) / kLaneColumns;
  if (!LayerDims(lanes, s, &d) || d.size() != 3 || d[0] != tiles || d[1] != l.groups() ||
      d[2] != kLaneColumns * (l.f->has_min ? 2 : 1))
    return InvalidArgument("quant: lanes shape does not match ([S,] ceil(N/16), K/group, 16 * (1 + has_min))");
  const auto want = l.f->f16_scales ? ffi::DataType::F16 : ffi::DataType::F32;
  if (lanes.element_type() != want) return InvalidArgument("quant: lanes dtype does not match the scales'");
  return ffi::Error::Success();
}

void QuantizeRow(const Layout& l, const float* x, uint8_t* qs, void* scales, uint16_t* mins, int64_t row) {
  std::vector<uint8_t> q(l.group);
  for (int64_t g = 0; g < l.groups(); ++g) {
    const float* b = x + g * l.group;
    const int64_t si = row * l.groups() + g;
    if (l.f->bits == 8) {  // q8_0 / int8: symmetric, d = amax / 127, q = round(x / d)
      float amax = 0.0f;
      for (int64_t i = 0; i < l.group; ++i) amax = std::max(amax, std::fabs(b[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* out = reinterpret_cast<int8_t*>(qs) + g * l.group;
      for (int64_t i = 0; i < l.group; ++i) out[i] = static_cast<int8_t>(std::round(b[i] * id));
      StoreScale(l, scales, si, d);
    } else if (!l.f->has_min) {  // q4_0 / int4: d = (signed value of largest magnitude) / -8
      int64_t imax = 0;
      for (int64_t i = 1; i < l.group; ++i)
        if (std::fabs(b[i]) > std::fabs(b[imax])) imax = i;
      const float d = b[imax] / -8.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t i = 0; i < l.group; ++i) {
        const float t = std::trunc(b[i] * id + 8.5f);
        q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, t)));
      }
      PackNibbles(q.data(), l.group, qs + g * l.group / 2);
      StoreScale(l, scales, si, d);
    } else {  // q4_1: d = (max - min) / 15, m = min
      float mx = b[0], mn = b[0];
      for (int64_t i = 1; i < l.group; ++i) {
        mx = std::max(mx, b[i]);
        mn = std::min(mn, b[i]);
      }
      const float d = (mx - mn) / 15.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      for (int64_t i = 0; i < l.group; ++i) {
        const float t = std::trunc((b[i] - mn) * id + 0.5f);
        q[i] = static_cast<uint8_t>(std::min(15.0f, std::max(0.0f, t)));
      }
      PackNibbles(q.data(), l.group, qs + g * l.group / 2);
      StoreScale(l, scales, si, d);
      mins[si] = F32ToF16(mn);
    }
  }
}

void DequantizeRange(const Weights& w, int64_t col, int64_t k0, int64_t kk, float* out) {
  const uint8_t* row = w.row(col);
  for (int64_t i = k0; i < k0 + kk; ++i) {
    const int64_t g = i / w.l.group;
    const float d = w.scale(col, g);
    const int q = Code(w.l, row, i);
    if (w.l.f->has_min) {
      out[i - k0] = d * static_cast<float>(q) + w.min(col, g);
    } else {
      out[i - k0] = d * static_cast<float>(w.l.f->offset8 ? q - 8 : q);
    }
  }
}

namespace {
// A block holding a NaN or an infinity: all codes 0 and a NaN scale (and sum), so every product it enters
// is NaN, as a float product's would be (not a finite value from codes cast out of range).
float NonFiniteBlock(int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x) {
  std::memset(lo, 0, 16);
  std::memset(hi, 0, 16);
  *qsum = 0;
  if (sum_x != nullptr) *sum_x = std::numeric_limits<float>::quiet_NaN();
  return std::numeric_limits<float>::quiet_NaN();
}

// 1 / d for a block's scale d = amax / 127 >= 0, or 0 where d is 0 or so small (subnormal) that 1 / d
// overflows: that block's codes are all 0 on every tier, never an infinity converted to int8.
inline float InverseScale(float d) {
  const float inv = 1.0f / d;
  return inv <= std::numeric_limits<float>::max() ? inv : 0.0f;
}
}  // namespace

float QuantizeBlock(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kSub; ++i) {
    const float a = std::fabs(xb[i]);
    if (!(a <= std::numeric_limits<float>::max())) return NonFiniteBlock(lo, hi, qsum, sum_x);
    amax = std::max(amax, a);
  }
  const float d = amax / 127.0f;
  const float id = InverseScale(d);
  int sum = 0;
  for (int64_t i = 0; i < kSub; ++i) {
    const int v = static_cast<int>(std::nearbyint(xb[i] * id));
    (i < 16 ? lo : hi - 16)[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *qsum = sum;
  if (sum_x != nullptr) {  // halves added lane by lane, then halving widths: QuantizeBlockAvx512's order
    float s[16];
    for (int i = 0; i < 16; ++i) s[i] = xb[i] + xb[16 + i];
    for (int width = 8; width >= 1; width /= 2)
      for (int i = 0; i < width; ++i) s[i] += s[i + width];
    *sum_x = s[0];
  }
  return d;
}

#ifdef TUNIX_RT_X86
AVX2_FN float QuantizeBlockAvx2(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x) {
  __m256 x[4];
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 finite_max = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 amax = _mm256_setzero_ps(), nonfinite = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(xb + 8 * i);
    const __m256 a = _mm256_and_ps(x[i], abs_mask);
    nonfinite = _mm256_or_ps(nonfinite, _mm256_cmp_ps(a, finite_max, _CMP_NLE_UQ));  // > max, or NaN
    amax = _mm256_max_ps(amax, a);
  }
  if (_mm256_movemask_ps(nonfinite) != 0) return NonFiniteBlock(lo, hi, qsum, sum_x);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))) / 127.0f;
  const __m256 id = _mm256_set1_ps(InverseScale(d));
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(x[i], id));  // round to nearest even
  // packs interleave 4-code groups across the 128-bit lanes; the permute restores element order
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm256_castsi256_si128(bytes));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm256_extracti128_si256(bytes, 1));
  const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
  s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
  *qsum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
  if (sum_x != nullptr) {  // QuantizeBlock's order: lanes i and i + width added, width 16, 8, 4, 2, 1
    const __m256 s8 = _mm256_add_ps(_mm256_add_ps(x[0], x[2]), _mm256_add_ps(x[1], x[3]));
    const __m128 f4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 f2 = _mm_add_ps(f4, _mm_movehl_ps(f4, f4));
    *sum_x = _mm_cvtss_f32(_mm_add_ss(f2, _mm_shuffle_ps(f2, f2, 1)));
  }
  return d;
}

VNNI_FN float QuantizeBlockAvx512(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 finite_max = _mm512_set1_ps(std::numeric_limits<float>::max());
  if ((_mm512_cmp_ps_mask(a0, finite_max, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(a1, finite_max, _CMP_NLE_UQ)) != 0)
    return NonFiniteBlock(lo, hi, qsum, sum_x);
  const float d = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) / 127.0f;
  const __m512 id = _mm512_set1_ps(InverseScale(d));
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(q1));
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  if (sum_x != nullptr) {  // QuantizeBlock's order: lanes i and i + width added, width 16, 8, 4, 2, 1
    const __m512 s16 = _mm512_add_ps(x0, x1);
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(s16),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1)));
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *sum_x = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  return d;
}
#endif

}  // namespace quant
}  // namespace tunix_rt
