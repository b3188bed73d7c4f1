// Weight-only quantization: GGUF q8_0 / q4_0 / q4_1 blocks and int8 / int4 with per-group scales.
//
// A quantized (K, N) weight is stored column-major in blocks, as ggml stores its rows:
//   qs      (N, K) int8 for 8-bit formats; (N, K/2) uint8 for 4-bit ones, where byte j of each
//           32-element sub-block holds element j in its low nibble and element j+16 in its high one
//   scales  (N, K/G) float16 (q* formats, G = 32) or float32 (int* formats, G = 32/64/128)
//   mins    (N, K/G) float16 for q4_1, else (N, 0)
// Quantize/dequantize follow ggml's reference arithmetic step by step (this file builds with
// -ffp-contract=off), so the bytes equal gguf.quants'. The matmul quantizes activations to int8
// per 32-block on the fly and takes integer dot products (llama.cpp's q8 scheme) for up to
// kInt8Rows rows (Python decides how many: quant_matmul's int8_rows); more rows, or `exact`, take
// exact f32 products over dequantized weight panels.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "gemm_f32.h"
#include "parallel.h"

#include "isa.h"

namespace tunix_rt {
namespace {

constexpr int64_t kSub = 32;  // nibble-packing sub-block and activation block

// One row of traits per format (ggml keeps the same kind of table).
struct Format {
  int bits;
  bool has_min;     // q4_1: value = d * q + m
  bool f16_scales;  // GGUF formats store half-precision scales
  bool offset8;     // q4_0 / int4: nibble holds q + 8
};
constexpr Format kFormats[] = {
    {8, false, true, false},   // 0 q8_0
    {4, false, true, true},    // 1 q4_0
    {4, true, true, false},    // 2 q4_1
    {8, false, false, false},  // 3 int8
    {4, false, false, true},   // 4 int4
};
constexpr int32_t kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

// log2(group / 32): groups are 32, 64 or 128 elements, so block b lies in group b >> shift.
inline int GroupShift(int64_t group) { return group == 32 ? 0 : (group == 64 ? 1 : 2); }

struct Layout {
  const Format* f;
  int64_t n, k, group;
  int64_t row_bytes() const { return k * f->bits / 8; }
  int64_t groups() const { return k / group; }
};

ffi::Error MakeLayout(int32_t fmt, int64_t group, int64_t n, int64_t k, Layout* out) {
  if (fmt < 0 || fmt >= kNumFormats) return InvalidArgument("quant: unknown format id");
  if (group != 32 && group != 64 && group != 128) return InvalidArgument("quant: group must be 32, 64 or 128");
  if (k % group != 0) return InvalidArgument("quant: K must be a multiple of the group size");
  *out = Layout{&kFormats[fmt], n, k, group};
  return ffi::Error::Success();
}

// Checks qs/scales/mins buffers against the layout.
ffi::Error CheckWeights(const Layout& l, const ffi::AnyBuffer& qs, const ffi::AnyBuffer& scales,
                        const ffi::AnyBuffer& mins) {
  const auto qd = qs.dimensions(), sd = scales.dimensions(), md = mins.dimensions();
  if (qd.size() != 2 || qd[0] != l.n || qd[1] != l.row_bytes())
    return InvalidArgument("quant: qs shape does not match (N, K*bits/8)");
  if (sd.size() != 2 || sd[0] != l.n || sd[1] != l.groups())
    return InvalidArgument("quant: scales shape does not match (N, K/group)");
  const auto want_scale = l.f->f16_scales ? ffi::DataType::F16 : ffi::DataType::F32;
  if (scales.element_type() != want_scale) return InvalidArgument("quant: scales dtype does not match the format");
  if (md.size() != 2 || md[0] != l.n || md[1] != (l.f->has_min ? l.groups() : 0))
    return InvalidArgument("quant: mins shape does not match the format");
  if (l.f->has_min && mins.element_type() != ffi::DataType::F16)
    return InvalidArgument("quant: mins must be float16");
  return ffi::Error::Success();
}

// Raw pointers of a quantized weight; safe to capture in async tasks.
struct Weights {
  Layout l;
  const uint8_t* qs;
  const void* scales;
  const uint16_t* mins;
  float scale(int64_t col, int64_t g) const {
    const int64_t i = col * l.groups() + g;
    return l.f->f16_scales ? F16ToF32(static_cast<const uint16_t*>(scales)[i]) : static_cast<const float*>(scales)[i];
  }
  float min(int64_t col, int64_t g) const { return F16ToF32(mins[col * l.groups() + g]); }
  const uint8_t* row(int64_t col) const { return qs + col * l.row_bytes(); }
};

// Software prefetch for GEMVs: a small weight (K = 576: 288-byte columns) streams too briefly for
// the hardware prefetchers to ramp up, and decode waits on memory. Kernels walk columns in order,
// so loading columns about kPrefetchBytes ahead (their codes, scales and mins) hides the latency
// (default-model decode forward: about 11 ms -> 6 ms).
constexpr int64_t kPrefetchBytes = 4096;
inline int64_t PrefetchAhead(const Layout& l) { return (kPrefetchBytes + l.row_bytes() - 1) / l.row_bytes(); }

inline void PrefetchRange(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

// Columns [c0, c0 + count) clipped to the weight.
inline void PrefetchColumns(const Weights& w, int64_t c0, int64_t count) {
  const int64_t c1 = std::min(w.l.n, c0 + count);
  if (c0 >= c1) return;
  const int64_t scale_bytes = w.l.f->f16_scales ? 2 : 4;
  PrefetchRange(w.row(c0), (c1 - c0) * w.l.row_bytes());
  const int64_t g0 = c0 * w.l.groups(), groups = (c1 - c0) * w.l.groups();
  PrefetchRange(static_cast<const char*>(w.scales) + g0 * scale_bytes, groups * scale_bytes);
  if (w.l.f->has_min) PrefetchRange(w.mins + g0, groups * 2);
}

// ---- quantize / dequantize (scalar, exact) ------------------------------------------------------

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

// Element i's integer code: signed for 8-bit formats, 0..15 for 4-bit ones.
inline int Code(const Layout& l, const uint8_t* row, int64_t i) {
  if (l.f->bits == 8) return reinterpret_cast<const int8_t*>(row)[i];
  const int64_t s = i / kSub, j = i % kSub;
  const uint8_t byte = row[s * kSub / 2 + (j % (kSub / 2))];
  return j < kSub / 2 ? (byte & 0x0f) : (byte >> 4);
}

// Elements [k0, k0 + kk) of column `col` (block aligned) into out[0, kk).
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

// ---- matmul -------------------------------------------------------------------------------------

// Activations quantized per 32-block: x ~= xd[b] * xq[b*32 + i]; xs[b] = xd[b] * sum(xq in block).
// s[b] is the block's sum of x: exact for formats with mins (m * sum(x) needs no quantized x), and
// d * sum(q) for offset formats, whose -8 * sum must cancel against the quantized dot exactly.
// e[b] (formats with mins) is exact - d * sum(q): q4_1 codes are 0..15, all of one sign, so the
// kernels take the dot on q - 8 (centred, as accurate as q4_0) by adding 8 * d_w * e.
// qsum[b] is sum(q) itself, from which the SIMD kernels' integer corrections come.
// With `interleave` P (2 for AVX2, 4 for AVX-512), each run of P blocks is stored as
// [x0[0:16] .. xP-1[0:16] x0[16:32] .. xP-1[16:32]]: the order in which one load of P 4-bit weight
// blocks unpacks (low nibbles, then high ones), so P blocks take one unpack. Blocks past the last
// full run stay in natural order. pd and pc are per-kernel lanes of scales and integer corrections
// (the kernel's prep function fills them; see each kernel).
struct QuantizedActivations {
  int64_t m, k;
  std::vector<int8_t> q;
  std::vector<float> d, s, e, pd;
  std::vector<int32_t> qsum, pc;
  int64_t blocks() const { return k / kSub; }
};

// One 32-block of x quantized to int8 codes with scale d = amax / 127 (returned): elements 0..15 go
// to lo, 16..31 to hi; *qsum gets the sum of the codes and *sum_x, when given, the f32 sum of x.
using BlockQuantizer = float (*)(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x);

float QuantizeBlock(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x) {
  float amax = 0.0f;
  for (int64_t i = 0; i < kSub; ++i) amax = std::max(amax, std::fabs(xb[i]));
  const float d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  int sum = 0;
  float exact = 0.0f;
  for (int64_t i = 0; i < kSub; ++i) {
    exact += xb[i];
    const int v = static_cast<int>(std::nearbyint(xb[i] * id));
    (i < 16 ? lo : hi - 16)[i] = static_cast<int8_t>(v);
    sum += v;
  }
  *qsum = sum;
  if (sum_x != nullptr) *sum_x = exact;
  return d;
}

// x (M, K) rows quantized per 32-block by quantize_block, in the layout above.
void QuantizeActivationRow(const float* x, int64_t k, int interleave, bool exact_sums, BlockQuantizer quantize_block,
                           int8_t* q, float* d, float* s, float* e, int32_t* qsum) {
  const int64_t nb = k / kSub;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t run = b - b % interleave;  // first block of b's run
    const bool in_run = interleave > 1 && run + interleave <= nb;
    // in a run, the j-th block's halves go to run * 32 + j * 16 and 16 P further
    int8_t* lo = q + (in_run ? run * kSub + (b - run) * 16 : b * kSub);
    int8_t* hi = in_run ? lo + 16 * interleave : lo + 16;
    float exact = 0.0f;
    d[b] = quantize_block(x + b * kSub, lo, hi, &qsum[b], exact_sums ? &exact : nullptr);
    s[b] = exact_sums ? exact : d[b] * static_cast<float>(qsum[b]);
    if (exact_sums) e[b] = exact - d[b] * static_cast<float>(qsum[b]);
  }
}

// A tile of outputs: rows r0..r0+rows-1 (rows <= 4) by columns col..col+cols-1 (cols <= 2),
// written to y[r * cols + c].
using TileFn = void (*)(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows,
                        int cols, float* y);
constexpr int kTileRows = 4, kTileCols = 1, kMaxTileCols = 4;  // kernels may take more columns (SelectGemv)

// Every kernel computes, per weight group g and activation block b in g:
//   d_w[g] * d_x[b] * sum(code * xq)  +  correction,
// where codes are the stored integers (0..15 for 4-bit formats) and the correction is
// -8 * d_w[g] * xs[b] for offset formats (q4_0, int4) and m[g] * xs[b] for q4_1.
void TileScalar(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows, int cols,
                float* y) {
  const int64_t per_group = w.l.group / kSub;
  for (int c = 0; c < cols; ++c) {
    const uint8_t* row = w.row(col + c);
    for (int r = 0; r < rows; ++r) {
      const int8_t* xq = a.q.data() + (r0 + r) * a.k;  // natural order: the scalar tier never pairs
      const float* xd = a.d.data() + (r0 + r) * a.blocks();
      const float* xs = a.s.data() + (r0 + r) * a.blocks();
      const float* xe = w.l.f->has_min ? a.e.data() + (r0 + r) * a.blocks() : nullptr;
      float acc = 0.0f, corr = 0.0f;
      for (int64_t b = 0; b < a.blocks(); ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kSub; ++i) dot += Code(w.l, row, b * kSub + i) * xq[b * kSub + i];
        const float dw = w.scale(col + c, b / per_group);
        acc += dw * xd[b] * static_cast<float>(dot);
        if (w.l.f->offset8) corr -= 8.0f * dw * xs[b];
        if (w.l.f->has_min) corr += w.min(col + c, b / per_group) * xs[b] + 8.0f * dw * xe[b];
      }
      y[r * cols + c] = acc + corr;
    }
  }
}

#ifdef TUNIX_RT_X86

// AVX-512 VNNI (vpdpbusd: four u8 x s8 products into each int32 lane) with F16C.
bool HasVnni() { return isa_level() >= IsaLevel::kAvx512 && cpu_features().avx512vnni && cpu_features().f16c; }

// QuantizeBlock with AVX-512: the same codes and scale (amax, the multiply and the
// round-to-nearest-even convert are exact); sum_x adds in another order.
VNNI_FN float QuantizeBlockAvx512(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x) {
  const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
  const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.0f;
  const __m512 id = _mm512_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(q1));
  *qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  if (sum_x != nullptr) *sum_x = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
  return d;
}

// 32 codes of sub-block b as bytes: signed for 8-bit formats, 0..15 for 4-bit ones.
template <int kBits>
AVX2_F16C_FN inline __m256i LoadCodes(const uint8_t* row, int64_t b) {
  if constexpr (kBits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kSub));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kSub / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
  }
}

template <bool kF16>
AVX2_F16C_FN inline float ScaleAt(const void* scales, int64_t i) {
  if constexpr (kF16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(scales)[i]);
  } else {
    return static_cast<const float*>(scales)[i];
  }
}

template <int kBits, bool kOffset8, bool kHasMin, bool kF16, int R, int C>
AVX2_F16C_FN void TileAvx2(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int, int,
                      float* y) {
  const int64_t nb = a.blocks(), per_group = w.l.group / kSub, groups = w.l.groups();
  (void)nb;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][C];
  float corr[R][C];
  const uint8_t* wrow[C];
  const int8_t* xq[R];
  const float *xd[R], *xs[R];
  for (int c = 0; c < C; ++c) wrow[c] = w.row(col + c);
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q.data() + (r0 + r) * a.k;
    xd[r] = a.d.data() + (r0 + r) * nb;
    xs[r] = a.s.data() + (r0 + r) * nb;
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      corr[r][c] = 0.0f;
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float dw[C], mw[C];
    for (int c = 0; c < C; ++c) {
      dw[c] = ScaleAt<kF16>(w.scales, (col + c) * groups + g);
      mw[c] = kHasMin ? _cvtsh_ss(w.mins[(col + c) * groups + g]) : 0.0f;
    }
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      __m256i codes[C], wu[C];
      for (int c = 0; c < C; ++c) {
        codes[c] = LoadCodes<kBits>(wrow[c], b);
        // maddubs multiplies unsigned by signed bytes: signed codes move their signs onto x.
        wu[c] = kBits == 8 ? _mm256_sign_epi8(codes[c], codes[c]) : codes[c];
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * kSub));
        const float xdb = xd[r][b], xsb = xs[r][b];
        for (int c = 0; c < C; ++c) {
          const __m256i xsgn = kBits == 8 ? _mm256_sign_epi8(xv, codes[c]) : xv;
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wu[c], xsgn), ones);
          acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw[c] * xdb), acc[r][c]);
          if constexpr (kOffset8) corr[r][c] += dw[c] * xsb;
          if constexpr (kHasMin) corr[r][c] += mw[c] * xsb;
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * C + c] = HSum8(acc[r][c]) + (kOffset8 ? -8.0f * corr[r][c] : corr[r][c]);
}

// q4_1's correction for one column and activation row: the sum over blocks of m * s + 8 * d * e
// (see QuantizedActivations), eight blocks per step.
AVX2_F16C_FN inline float MinCorrectionAvx2(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t row) {
  const int64_t nb = a.blocks(), groups = w.l.groups();
  const int shift = GroupShift(w.l.group);
  const float* xs = a.s.data() + row * nb;
  const float* xe = a.e.data() + row * nb;
  const uint16_t* mc = w.mins + col * groups;
  const uint16_t* dc = static_cast<const uint16_t*>(w.scales) + col * groups;
  __m256 v = _mm256_setzero_ps();
  int64_t b = 0;
  if (shift == 0)
    for (; b + 8 <= nb; b += 8) {
      const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mc + b)));
      const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dc + b)));
      v = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xs + b), v);
      v = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(8.0f), d8), _mm256_loadu_ps(xe + b), v);
    }
  float tail = 0.0f;
  for (; b < nb; ++b) tail += _cvtsh_ss(mc[b >> shift]) * xs[b] + 8.0f * _cvtsh_ss(dc[b >> shift]) * xe[b];
  return HSum8(v) + tail;
}

// 4-bit formats over paired activations: one 32-byte load unpacks two weight blocks; both
// blocks' int16 products add before one madd (|sum| <= 4 * 15 * 127, no saturation), and the
// per-block scales multiply the 8 int32 lanes as [s0 x4, s1 x4].
template <bool kOffset8, bool kHasMin, bool kF16, int R, int C>
AVX2_F16C_FN void TilePairsAvx2(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int, int,
                           float* y) {
  const int64_t nb = a.blocks(), groups = w.l.groups();
  const int shift = GroupShift(w.l.group);  // block -> group: b >> shift
  const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0f);
  __m256 acc[R][C];
  float corr[R][C];
  const uint8_t* wrow[C];
  const int8_t* xq[R];
  const float *xs[R], *xd[R], *pd[R];
  const int32_t* pc[R];
  for (int c = 0; c < C; ++c) wrow[c] = w.row(col + c);
  for (int r = 0; r < R; ++r) {
    xq[r] = a.q.data() + (r0 + r) * a.k;
    xd[r] = a.d.data() + (r0 + r) * nb;
    xs[r] = a.s.data() + (r0 + r) * nb;
    pd[r] = a.pd.data() + (r0 + r) * nb * 4;
    pc[r] = kOffset8 ? a.pc.data() + (r0 + r) * nb * 4 : nullptr;
    for (int c = 0; c < C; ++c) {
      acc[r][c] = _mm256_setzero_ps();
      corr[r][c] = 0.0f;
    }
  }
  const int64_t pairs = nb / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t b0 = 2 * p, b1 = b0 + 1;
    __m256i lo[C], hi[C];
    __m256 dw[C];
    for (int c = 0; c < C; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[c] + p * kSub));
      lo[c] = _mm256_and_si256(raw, mask);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
      const int64_t s0 = (col + c) * groups + (b0 >> shift), s1 = (col + c) * groups + (b1 >> shift);
      if (kF16 && shift == 0) {  // two adjacent halves: one load, one conversion, one permute
        uint32_t both;
        std::memcpy(&both, static_cast<const uint16_t*>(w.scales) + s0, sizeof(both));
        dw[c] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both)))),
                                         _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
      } else {
        dw[c] = _mm256_set_m128(_mm_set1_ps(ScaleAt<kF16>(w.scales, s1)), _mm_set1_ps(ScaleAt<kF16>(w.scales, s0)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + p * 2 * kSub));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + p * 2 * kSub + kSub));
      const __m256 xdv = _mm256_loadu_ps(pd[r] + p * 8);
      __m256i pcv = _mm256_setzero_si256();
      if constexpr (kOffset8) pcv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc[r] + p * 8));
      for (int c = 0; c < C; ++c) {
        const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], xlo), _mm256_maddubs_epi16(hi[c], xhi));
        __m256i dot = _mm256_madd_epi16(s16, ones);
        if constexpr (kOffset8) dot = _mm256_sub_epi32(dot, pcv);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw[c], xdv), acc[r][c]);
      }
    }
  }
  if (nb % 2) {  // the last, unpaired block (natural order)
    const int64_t b = nb - 1;
    for (int c = 0; c < C; ++c) {
      const __m256i codes = LoadCodes<4>(wrow[c], b);
      const float d = ScaleAt<kF16>(w.scales, (col + c) * groups + (b >> shift));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * kSub));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), ones);
        acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xd[r][b]), acc[r][c]);
        if constexpr (kOffset8) corr[r][c] += d * xs[r][b];
      }
    }
  }
  if constexpr (kHasMin)
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) corr[r][c] = MinCorrectionAvx2(w, a, col + c, r0 + r);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[r * C + c] = HSum8(acc[r][c]) + (kOffset8 ? -8.0f * corr[r][c] : corr[r][c]);
}

// TilePairsAvx2's lanes: pd[b * 4 + j] = d[b] (j < 4), the scales as its 8 lanes hold a pair's
// blocks; pc (offset formats) [8 qsum[b], 0, 0, 0] per block, subtracted from the integer dot:
// sum((code - 8) * q) exactly, with no scalar correction.
void PrepPairsAvx2(QuantizedActivations& a, bool offset8) {
  const int64_t nb = a.blocks(), paired = nb / 2 * 2;
  a.pd.assign(a.m * nb * 4, 0.0f);
  a.pc.assign(offset8 ? a.m * nb * 4 : 0, 0);
  for (int64_t r = 0; r < a.m; ++r)
    for (int64_t b = 0; b < paired; ++b) {
      const int64_t i = r * nb + b;
      std::fill_n(a.pd.data() + i * 4, 4, a.d[i]);
      if (offset8) a.pc[i * 4] = 8 * a.qsum[i];
    }
}

// The AVX2 kernel of a format for R rows by C columns.
template <int kBits, bool kOffset8, bool kHasMin, bool kF16, int R, int C>
constexpr TileFn Tile() {
  if constexpr (kBits == 8) {
    return TileAvx2<kBits, kOffset8, kHasMin, kF16, R, C>;
  } else {
    return TilePairsAvx2<kOffset8, kHasMin, kF16, R, C>;
  }
}

// One kernel per row count (1..kTileRows), dispatched at run time by the tile's shape.
template <TileFn... kRows>
void ByRows(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows, int cols, float* y) {
  static constexpr TileFn kTable[] = {kRows...};
  kTable[rows - 1](w, a, col, r0, rows, cols, y);
}

template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
constexpr TileFn kAvx2Tiles =
    ByRows<Tile<kBits, kOffset8, kHasMin, kF16, 1, kTileCols>(), Tile<kBits, kOffset8, kHasMin, kF16, 2, kTileCols>(),
           Tile<kBits, kOffset8, kHasMin, kF16, 3, kTileCols>(), Tile<kBits, kOffset8, kHasMin, kF16, 4, kTileCols>()>;

// ---- AVX-512 VNNI GEMV tiles --------------------------------------------------------------------
// Both walk K in stripes of 16 blocks, so that one f32 vector holds a stripe's scale products
// d_w * d_x and the float work (convert, scale, accumulate) is shared by 16 lanes of block dots.
// Columns run one after another; the rows (R <= 4) share each column's codes.

constexpr int64_t kStripe = 16;  // blocks

VNNI_FN inline __mmask16 FirstLanes(int64_t count) { return static_cast<__mmask16>((1u << count) - 1); }

VNNI_FN inline int32_t HSum32(__m256i v) { return _mm512_reduce_add_epi32(_mm512_zextsi256_si512(v)); }

// Scales of blocks [b0, b0 + count) of column col (count <= 16), natural order, zero past count.
template <bool kF16>
VNNI_FN inline __m512 StripeScales(const Weights& w, int64_t col, int64_t b0, int64_t count, int shift) {
  const int64_t g0 = col * w.l.groups();
  if (shift == 0) {
    if constexpr (kF16) {
      return _mm512_cvtph_ps(
          _mm256_maskz_loadu_epi16(FirstLanes(count), static_cast<const uint16_t*>(w.scales) + g0 + b0));
    } else {
      return _mm512_maskz_loadu_ps(FirstLanes(count), static_cast<const float*>(w.scales) + g0 + b0);
    }
  }
  alignas(64) float d[kStripe] = {};
  for (int64_t i = 0; i < count; ++i) d[i] = ScaleAt<kF16>(w.scales, g0 + ((b0 + i) >> shift));
  return _mm512_load_ps(d);
}

// 4-bit formats over activations interleaved by 4. One 64-byte load holds a quad of four weight
// blocks (128-bit lane j: block j), whose low and high nibbles meet x in two vpdpbusd. A lane's
// dot is at most 8 * 15 * 127 in magnitude, so a stripe's four quads reduce by int16 packs and
// pairwise madds to one vector of whole-block dots, lane 4 j + q holding block 4 q + j. pd holds
// the activation scales in that order and pc (offset formats) 8 * qsum, subtracted from the
// integer dots: sum((code - 8) * q) exactly. The weights' scales take one permute per stripe.
alignas(64) constexpr int32_t kTransposed[kStripe] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

int64_t QuadStripes(int64_t blocks) { return (blocks / 4 + 3) / 4; }

void PrepQuadStripes(QuantizedActivations& a, bool offset8) {
  const int64_t nb = a.blocks(), quad_blocks = nb / 4 * 4, stripes = QuadStripes(nb);
  a.pd.assign(a.m * stripes * kStripe, 0.0f);
  a.pc.assign(offset8 ? a.m * stripes * kStripe : 0, 0);
  for (int64_t r = 0; r < a.m; ++r)
    for (int64_t s = 0; s < stripes; ++s)
      for (int lane = 0; lane < kStripe; ++lane) {
        const int64_t b = s * kStripe + kTransposed[lane], at = (r * stripes + s) * kStripe + lane;
        if (b >= quad_blocks) continue;
        a.pd[at] = a.d[r * nb + b];
        if (offset8) a.pc[at] = 8 * a.qsum[r * nb + b];
      }
}

template <bool kOffset8, bool kHasMin, bool kF16, int R>
VNNI_FN void TileQuadStripes(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int,
                             int cols, float* y) {
  const int64_t nb = a.blocks(), quads = nb / 4, stripes = QuadStripes(nb), groups = w.l.groups();
  const int shift = GroupShift(w.l.group);
  const __m512i mask = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi16(1), zero = _mm512_setzero_si512();
  const __m512i transpose = _mm512_load_si512(kTransposed);
  for (int c = 0; c < cols; ++c) {
    const uint8_t* wrow = w.row(col + c);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < stripes; ++s) {
      const int64_t q0 = s * 4, nq = std::min<int64_t>(4, quads - q0);
      __m512i lo[4], hi[4];
      for (int q = 0; q < 4; ++q) {
        const __m512i raw = q < nq ? _mm512_loadu_si512(wrow + (q0 + q) * 2 * kSub) : zero;
        lo[q] = _mm512_and_si512(raw, mask);
        hi[q] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
      }
      const __m512 dw = _mm512_permutexvar_ps(transpose, StripeScales<kF16>(w, col + c, q0 * 4, nq * 4, shift));
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q.data() + (r0 + r) * a.k + q0 * 4 * kSub;
        __m512i dot[4];
        for (int q = 0; q < 4; ++q)
          dot[q] = q < nq ? _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo[q], _mm512_loadu_si512(xq + q * 4 * kSub)),
                                                hi[q], _mm512_loadu_si512(xq + q * 4 * kSub + 2 * kSub))
                          : zero;
        const __m512i d01 = _mm512_madd_epi16(_mm512_packs_epi32(dot[0], dot[1]), ones);
        const __m512i d23 = _mm512_madd_epi16(_mm512_packs_epi32(dot[2], dot[3]), ones);
        __m512i blocks = _mm512_madd_epi16(_mm512_packs_epi32(d01, d23), ones);
        const int64_t lanes = ((r0 + r) * stripes + s) * kStripe;
        if constexpr (kOffset8) blocks = _mm512_sub_epi32(blocks, _mm512_loadu_si512(a.pc.data() + lanes));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(blocks), _mm512_mul_ps(dw, _mm512_loadu_ps(a.pd.data() + lanes)),
                                 acc[r]);
      }
    }
    float tail[R] = {};
    for (int64_t b = quads * 4; b < nb; ++b) {  // blocks past the last quad (natural order)
      const __m256i codes = LoadCodes<4>(wrow, b);
      const float d = ScaleAt<kF16>(w.scales, (col + c) * groups + (b >> shift));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * a.k + b * kSub));
        const int32_t dot = HSum32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xv)) - (kOffset8 ? 8 * a.qsum[i] : 0);
        tail[r] += d * a.d[i] * static_cast<float>(dot);
      }
    }
    for (int r = 0; r < R; ++r) {
      const float corr = kHasMin ? MinCorrectionAvx2(w, a, col + c, r0 + r) : 0.0f;
      y[r * cols + c] = _mm512_reduce_add_ps(acc[r]) + tail[r] + corr;
    }
  }
}

// 8-bit formats over activations in natural order. A 64-byte load holds two weight blocks;
// vpdpbusd takes the codes as unsigned (c ^ 0x80 = c + 128), starting from pc's -128 * qsum in
// lane 0 of each block's eight, which leaves sum(c * q) exactly. One permute per pair spreads
// the stripe's scale products over the pair's lanes.
void PrepPairs8(QuantizedActivations& a, bool) {
  a.pc.assign(a.m * a.blocks() * 8, 0);
  for (int64_t i = 0; i < a.m * a.blocks(); ++i) a.pc[i * 8] = -128 * a.qsum[i];
}

template <bool kF16, int R>
VNNI_FN void TilePairStripes8(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int,
                              int cols, float* y) {
  const int64_t nb = a.blocks(), pairs = nb / 2, groups = w.l.groups();
  const int shift = GroupShift(w.l.group);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80)), two = _mm512_set1_epi32(2);
  const __m512i first_pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int c = 0; c < cols; ++c) {
    const uint8_t* wrow = w.row(col + c);
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < pairs; p0 += kStripe / 2) {
      const int64_t np = std::min<int64_t>(kStripe / 2, pairs - p0);
      const __m512 dw = StripeScales<kF16>(w, col + c, 2 * p0, 2 * np, shift);
      __m512 dwx[R];
      for (int r = 0; r < R; ++r)
        dwx[r] = _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(FirstLanes(2 * np), a.d.data() + (r0 + r) * nb + 2 * p0));
      __m512i spread = first_pair;
      for (int64_t p = p0; p < p0 + np; ++p, spread = _mm512_add_epi32(spread, two)) {
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(wrow + p * 2 * kSub), flip);
        for (int r = 0; r < R; ++r) {
          const __m512i init = _mm512_loadu_si512(a.pc.data() + ((r0 + r) * nb + 2 * p) * 8);
          const __m512i dot = _mm512_dpbusd_epi32(init, u, _mm512_loadu_si512(a.q.data() + (r0 + r) * a.k + p * 2 * kSub));
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(spread, dwx[r]), acc[r]);
        }
      }
    }
    float tail[R] = {};
    if (nb % 2) {  // the last, unpaired block
      const int64_t b = nb - 1;
      const __m256i u = _mm256_xor_si256(LoadCodes<8>(wrow, b), _mm256_set1_epi8(static_cast<char>(0x80)));
      const float d = ScaleAt<kF16>(w.scales, (col + c) * groups + (b >> shift));
      for (int r = 0; r < R; ++r) {
        const int64_t i = (r0 + r) * nb + b;
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * a.k + b * kSub));
        const int32_t dot = HSum32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, xv)) - 128 * a.qsum[i];
        tail[r] = d * a.d[i] * static_cast<float>(dot);
      }
    }
    for (int r = 0; r < R; ++r) y[r * cols + c] = _mm512_reduce_add_ps(acc[r]) + tail[r];
  }
}

template <bool kOffset8, bool kHasMin, bool kF16>
constexpr TileFn kQuadStripes =
    ByRows<TileQuadStripes<kOffset8, kHasMin, kF16, 1>, TileQuadStripes<kOffset8, kHasMin, kF16, 2>,
           TileQuadStripes<kOffset8, kHasMin, kF16, 3>, TileQuadStripes<kOffset8, kHasMin, kF16, 4>>;

template <bool kF16>
constexpr TileFn kPairStripes8 = ByRows<TilePairStripes8<kF16, 1>, TilePairStripes8<kF16, 2>,
                                        TilePairStripes8<kF16, 3>, TilePairStripes8<kF16, 4>>;
#endif

// The GEMV kernel of a format for the detected ISA tier, with the activation layout it reads:
// `interleave` for QuantizeActivationRow, and `prep` (or none) to fill its pd / pc lanes.
struct GemvKernel {
  TileFn tile;
  int interleave;
  int tile_cols;
  void (*prep)(QuantizedActivations& a, bool offset8);
  BlockQuantizer quantize_block = QuantizeBlock;
};

GemvKernel SelectGemv(int32_t fmt) {
#ifdef TUNIX_RT_X86
  if (HasVnni()) {
    static constexpr TileFn kVnni[kNumFormats] = {
        kPairStripes8<true>,                   // q8_0
        kQuadStripes<true, false, true>,       // q4_0
        kQuadStripes<false, true, true>,       // q4_1
        kPairStripes8<false>,                  // int8
        kQuadStripes<true, false, false>,      // int4
    };
    return kFormats[fmt].bits == 4 ? GemvKernel{kVnni[fmt], 4, kMaxTileCols, PrepQuadStripes, QuantizeBlockAvx512}
                                   : GemvKernel{kVnni[fmt], 1, kMaxTileCols, PrepPairs8, QuantizeBlockAvx512};
  }
  if (isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c) {
    static constexpr TileFn kAvx2[kNumFormats] = {
        kAvx2Tiles<8, false, false, true>,  // q8_0
        kAvx2Tiles<4, true, false, true>,   // q4_0
        kAvx2Tiles<4, false, true, true>,   // q4_1
        kAvx2Tiles<8, false, false, false>, // int8
        kAvx2Tiles<4, true, false, false>,  // int4
    };
    return kFormats[fmt].bits == 4 ? GemvKernel{kAvx2[fmt], 2, kTileCols, PrepPairsAvx2}
                                   : GemvKernel{kAvx2[fmt], 1, kTileCols, nullptr};
  }
#endif
  return GemvKernel{TileScalar, 1, kTileCols, nullptr};
}

// ---- GEMM: exact f32 products over dequantized weight panels ------------------------------------
//
// Large M (training, scoring, prefill) takes the exact route: y equals x @ dequantize(qt) up to
// f32 summation order. `exact` sends small M here too (output heads, whose logits int8
// activations would perturb). A panel holds nr columns (16, or 32 on AVX-512) x kPanelK rows of
// dequantized weights, k-major (panel[k * nr + j]); x is packed per k panel into kMR-row tiles,
// k-major too (xp[k * kMR + r]: rows of x are K apart, and a power-of-two K would make them fight
// over the same L1 sets). The micro-kernel broadcasts one x value per row into nr columns at
// once, keeping kMR x nr outputs in registers.
constexpr int64_t kGemvRows = 4;
constexpr int64_t kPanelK = 256;  // a multiple of every group size
// Stride of the dequantized-column scratch: not a multiple of 1 KiB, so columns 4 apart do not
// alias in the low 12 address bits (false store-to-load dependencies).
constexpr int64_t kColStride = kPanelK + 16;

using DequantFn = void (*)(const Weights& w, int64_t col, int64_t k0, int64_t kk, float* out);
using TransposeFn = void (*)(const float* colbuf, int64_t kk, float* panel);  // nr columns
// The exact path's small-M kernel: y[r * ldy + col] = x[r] . dequantize(column col) for r < m,
// without building panels. `column` is scratch for K floats (the scalar version's).
using ColumnDotsFn = void (*)(const Weights& w, int64_t col, const float* x, int64_t m, float* column, float* y,
                              int64_t ldy);

void ColumnDotsScalar(const Weights& w, int64_t col, const float* x, int64_t m, float* column, float* y,
                      int64_t ldy) {
  const int64_t k = w.l.k;
  DequantizeRange(w, col, 0, k, column);
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t i = 0; i < k; ++i) acc += x[r * k + i] * column[i];
    y[r * ldy + col] = acc;
  }
}

void TransposePanelScalar(const float* colbuf, int64_t kk, float* panel) {
  for (int j = 0; j < kNR; ++j)
    for (int64_t i = 0; i < kk; ++i) panel[i * kNR + j] = colbuf[j * kColStride + i];
}
#ifdef TUNIX_RT_X86
// The panel (k-major, kNRt wide) from kNRt dequantized columns (colbuf[j * kColStride + i]), by
// 8 x 8 register transposes: strided scalar stores cost more than the multiply-adds they feed.
template <int kNRt>
AVX2_F16C_FN void TransposePanelAvx2(const float* colbuf, int64_t kk, float* panel) {
  for (int jb = 0; jb < kNRt; jb += 8) {
    for (int64_t i0 = 0; i0 < kk; i0 += 8) {
      __m256 r[8];
      for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(colbuf + (jb + j) * kColStride + i0);
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xee);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xee);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xee);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xee);
      const __m256 out[8] = {
          _mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
          _mm256_permute2f128_ps(u2, u6, 0x20), _mm256_permute2f128_ps(u3, u7, 0x20),
          _mm256_permute2f128_ps(u0, u4, 0x31), _mm256_permute2f128_ps(u1, u5, 0x31),
          _mm256_permute2f128_ps(u2, u6, 0x31), _mm256_permute2f128_ps(u3, u7, 0x31)};
      for (int k = 0; k < 8; ++k) _mm256_storeu_ps(panel + (i0 + k) * kNRt + jb, out[k]);
    }
  }
}


// Codes of 8 elements as f32: 4-bit codes come as bytes already unpacked.
AVX2_F16C_FN inline __m256 BytesToF32(__m128i bytes8, bool is_signed) {
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

// Block b of column `col` as four 8-lane vectors in element order, with DequantizeRange's
// arithmetic (d * (q - 8), d * q + m, d * q).
template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
AVX2_F16C_FN inline void DequantBlockAvx2(const Weights& w, int64_t col, int64_t b, __m256 v[4]) {
  const uint8_t* row = w.row(col);
  const int64_t si = col * w.l.groups() + (b >> GroupShift(w.l.group));
  const __m256 d = _mm256_set1_ps(ScaleAt<kF16>(w.scales, si));
  __m128i lo, hi;
  if constexpr (kBits == 8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kSub));
    lo = _mm256_castsi256_si128(raw);
    hi = _mm256_extracti128_si256(raw, 1);
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kSub / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    lo = _mm_and_si128(raw, mask);
    hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  }
  const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int j = 0; j < 4; ++j) {
    __m256 q = BytesToF32(part[j], kBits == 8);
    if constexpr (kOffset8) q = _mm256_sub_ps(q, _mm256_set1_ps(8.0f));
    v[j] = _mm256_mul_ps(d, q);
    if constexpr (kHasMin) v[j] = _mm256_add_ps(v[j], _mm256_set1_ps(_cvtsh_ss(w.mins[si])));
  }
}

template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
AVX2_F16C_FN void DequantizeRangeAvx2(const Weights& w, int64_t col, int64_t k0, int64_t kk, float* out) {
  for (int64_t b = k0 / kSub; b < (k0 + kk) / kSub; ++b) {
    __m256 v[4];
    DequantBlockAvx2<kBits, kOffset8, kHasMin, kF16>(w, col, b, v);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * kSub - k0 + 8 * j, v[j]);
  }
}

// Dequantize-and-dot for up to kGemvRows rows: each 32-block's weights are dequantized in
// registers (DequantBlockAvx2) and multiplied into every row's accumulators.
template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
AVX2_F16C_FN void ColumnDotsAvx2(const Weights& w, int64_t col, const float* x, int64_t m, float*, float* y, int64_t ldy) {
  const int64_t k = w.l.k;
  __m256 acc0[kGemvRows], acc1[kGemvRows];
  for (int64_t r = 0; r < m; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kSub; ++b) {
    __m256 v[4];
    DequantBlockAvx2<kBits, kOffset8, kHasMin, kF16>(w, col, b, v);
    for (int64_t r = 0; r < m; ++r) {
      const float* xb = x + r * k + b * kSub;
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), v[0], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v[1], acc1[r]);
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], acc1[r]);
    }
  }
  for (int64_t r = 0; r < m; ++r) y[r * ldy + col] = HSum8(_mm256_add_ps(acc0[r], acc1[r]));
}

// ColumnDotsAvx2 with 16 lanes: the same dequantized values (d * q, or d * q + m) from 16 codes
// at a time; two accumulators per row halve the multiply-add chain.
template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
AVX512_F16C_FN void ColumnDotsAvx512(const Weights& w, int64_t col, const float* x, int64_t m, float*, float* y,
                                int64_t ldy) {
  const int64_t k = w.l.k, groups = w.l.groups();
  const int shift = GroupShift(w.l.group);
  const uint8_t* row = w.row(col);
  __m512 acc0[kGemvRows], acc1[kGemvRows];
  for (int64_t r = 0; r < m; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kSub; ++b) {
    __m512i c0, c1;
    if constexpr (kBits == 8) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kSub));
      c0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw));
      c1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1));
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kSub / 2));
      const __m128i mask = _mm_set1_epi8(0x0f);
      c0 = _mm512_cvtepu8_epi32(_mm_and_si128(raw, mask));
      c1 = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    }
    const int64_t si = col * groups + (b >> shift);
    const __m512 d = _mm512_set1_ps(ScaleAt<kF16>(w.scales, si));
    __m512 q0 = _mm512_cvtepi32_ps(c0), q1 = _mm512_cvtepi32_ps(c1);
    if constexpr (kOffset8) {
      q0 = _mm512_sub_ps(q0, _mm512_set1_ps(8.0f));
      q1 = _mm512_sub_ps(q1, _mm512_set1_ps(8.0f));
    }
    __m512 v0 = _mm512_mul_ps(d, q0), v1 = _mm512_mul_ps(d, q1);
    if constexpr (kHasMin) {
      const __m512 mn = _mm512_set1_ps(_cvtsh_ss(w.mins[si]));
      v0 = _mm512_add_ps(v0, mn);
      v1 = _mm512_add_ps(v1, mn);
    }
    for (int64_t r = 0; r < m; ++r) {
      const float* xb = x + r * k + b * kSub;
      acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), v0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), v1, acc1[r]);
    }
  }
  for (int64_t r = 0; r < m; ++r) y[r * ldy + col] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}
#endif

struct GemmKernels {
  DequantFn deq;
  TransposeFn transpose;
  MicroFn micro;
  ColumnDotsFn column_dots;
  int nr;  // panel width
};

GemmKernels SelectGemm(int32_t fmt) {
  GemmKernels g{DequantizeRange, TransposePanelScalar, MicroKernelFor(IsaLevel::kScalar).fn, ColumnDotsScalar, kNR};
#ifdef TUNIX_RT_X86
  if (isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c) {
    static constexpr DequantFn kDeq[kNumFormats] = {
        DequantizeRangeAvx2<8, false, false, true>, DequantizeRangeAvx2<4, true, false, true>,
        DequantizeRangeAvx2<4, false, true, true>,  DequantizeRangeAvx2<8, false, false, false>,
        DequantizeRangeAvx2<4, true, false, false>,
    };
    static constexpr ColumnDotsFn kDots[kNumFormats] = {
        ColumnDotsAvx2<8, false, false, true>, ColumnDotsAvx2<4, true, false, true>,
        ColumnDotsAvx2<4, false, true, true>,  ColumnDotsAvx2<8, false, false, false>,
        ColumnDotsAvx2<4, true, false, false>,
    };
    static constexpr ColumnDotsFn kDots512[kNumFormats] = {
        ColumnDotsAvx512<8, false, false, true>, ColumnDotsAvx512<4, true, false, true>,
        ColumnDotsAvx512<4, false, true, true>,  ColumnDotsAvx512<8, false, false, false>,
        ColumnDotsAvx512<4, true, false, false>,
    };
    const MicroKernel micro = MicroKernelFor(isa_level());
    g = micro.nr == kMaxNR ? GemmKernels{kDeq[fmt], TransposePanelAvx2<kMaxNR>, micro.fn, kDots512[fmt], kMaxNR}
                           : GemmKernels{kDeq[fmt], TransposePanelAvx2<kNR>, micro.fn, kDots[fmt], kNR};
  }
#endif
  return g;
}

// Columns [c_begin, c_end) of y (f32, row stride n, zeroed) from f32 x (M, K).
// x (M, K) in the micro-kernels' layout, once per call (every column chunk reads it): per K panel,
// kMR-row tiles k-major, rows past M zero. Panel p, tile t starts at ((p * row_tiles + t) * kPanelK) * kMR.
std::vector<float> PackPanels(const float* x, int64_t m, int64_t k) {
  const int64_t row_tiles = (m + kMR - 1) / kMR, panels = (k + kPanelK - 1) / kPanelK;
  std::vector<float> xp(panels * row_tiles * kPanelK * kMR, 0.0f);
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t k0 = p * kPanelK, kk = std::min(kPanelK, k - k0);
    for (int64_t row = 0; row < m; ++row) {
      float* dst = xp.data() + ((p * row_tiles + row / kMR) * kPanelK) * kMR + row % kMR;
      const float* src = x + row * k + k0;
      for (int64_t i = 0; i < kk; ++i) dst[i * kMR] = src[i];
    }
  }
  return xp;
}

// Columns [c_begin, c_end) of y (f32, row stride n, zeroed) from x (M, K) f32, or, past kGemvRows
// rows, from x packed by PackPanels.
void GemmColumns(const Weights& w, const GemmKernels& g, const float* x, const float* xp_all, int64_t m, float* y,
                 int64_t c_begin, int64_t c_end) {
  const int64_t k = w.l.k, n = w.l.n;
  if (m <= kGemvRows) {  // too few rows to pay for panels: dequantize a column, dot it with each row
    std::vector<float> column(k);
    const int64_t ahead = PrefetchAhead(w.l);
    PrefetchColumns(w, c_begin, ahead);
    for (int64_t c = c_begin; c < c_end; ++c) {
      PrefetchColumns(w, c + ahead, 1);
      g.column_dots(w, c, x, m, column.data(), y, n);
    }
    return;
  }
  const int64_t row_tiles = (m + kMR - 1) / kMR;
  std::vector<float> panel(kPanelK * g.nr), columns(g.nr * kColStride);
  for (int64_t k0 = 0; k0 < k; k0 += kPanelK) {
    const int64_t kk = std::min(kPanelK, k - k0);
    const float* xp = xp_all + (k0 / kPanelK) * row_tiles * kPanelK * kMR;
    for (int64_t c0 = c_begin; c0 < c_end; c0 += g.nr) {
      const int cols = static_cast<int>(std::min<int64_t>(g.nr, c_end - c0));
      for (int j = 0; j < g.nr; ++j) {  // columns past the end stay zero
        float* col = columns.data() + j * kColStride;
        if (j < cols) {
          g.deq(w, c0 + j, k0, kk, col);
        } else {
          std::fill(col, col + kk, 0.0f);
        }
      }
      g.transpose(columns.data(), kk, panel.data());
      for (int64_t r0 = 0; r0 < m; r0 += kMR) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, m - r0));
        g.micro(xp + (r0 / kMR) * kPanelK * kMR, panel.data(), kk, y + r0 * n + c0, n, rows, cols);
      }
    }
  }
}

// ---- int8 GEMM with AVX-512 VNNI: kGemvRows < M <= kInt8Rows ----------------------------------
//
// vpdpbusd adds four u8 x s8 products into each int32 lane. Rows ride in the 16 lanes: x is
// repacked once per call so that one 64-byte load holds 4 consecutive k of 16 rows, and each
// weight column's 4 codes are broadcast to every lane, so no weight is ever repacked. The weight
// codes are the unsigned operand: 4-bit codes as stored (0..15), 8-bit ones plus 128 (c ^ 0x80);
// the lanes start at -off * sum(xq) (off = 8 or 128), which leaves sum((code - off) * xq), the
// same centred dot as the GEMV kernels. q4_1 adds (m + 8 d) times the exact block sum of x.
// Each 32-block's int32 dot is scaled by d_w * d_x into f32 accumulators, C columns x G row groups
// at a time. K runs in panels so x's panel stays in L1; the f32 partial sums live in a
// column-major scratch (16 rows per vector) between panels and are transposed into y at the end.
constexpr int64_t kInt8Rows = 64;
constexpr int kLanes = 16;
constexpr int64_t kVnniPanelBlocks = 8;  // 256-deep K panels

struct RowPackedActivations {
  int64_t m, nb, groups;   // rows, 32-blocks, groups of 16 rows
  std::vector<int8_t> x;   // [group][block][quad 8][lane 16][4]
  std::vector<int32_t> off;  // [group][block][lane]: -off * sum(xq)
  std::vector<float> d, s;   // [group][block][lane]: x block scale; exact block sum (formats with mins)
  int64_t at(int64_t g, int64_t b) const { return g * nb + b; }
};

#ifdef TUNIX_RT_X86

// x (M, K) quantized per 32-block by QuantizeBlockAvx512, in the row-packed layout.
VNNI_FN std::shared_ptr<RowPackedActivations> PackRows(const ffi::AnyBuffer& x, const Layout& l) {
  auto a = std::make_shared<RowPackedActivations>();
  const int64_t m = x.dimensions()[0], k = l.k, nb = k / kSub;
  a->m = m;
  a->nb = nb;
  a->groups = (m + kLanes - 1) / kLanes;
  a->x.assign(a->groups * nb * kSub * kLanes, 0);
  a->off.assign(a->groups * nb * kLanes, 0);
  a->d.assign(a->groups * nb * kLanes, 0.0f);
  a->s.assign(l.f->has_min ? a->groups * nb * kLanes : 0, 0.0f);
  const int32_t off = l.f->bits == 8 ? 128 : 8;
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  std::vector<float> scratch(k);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t g = r / kLanes, lane = r % kLanes;
    const float* row = RowAsF32(x.untyped_data(), bf16, r, k, scratch.data());
    for (int64_t b = 0; b < nb; ++b) {
      alignas(32) int8_t q[kSub];
      int32_t qsum;
      float sum_x;
      const float d = QuantizeBlockAvx512(row + b * kSub, q, q + 16, &qsum, l.f->has_min ? &sum_x : nullptr);
      int8_t* dst = a->x.data() + a->at(g, b) * kSub * kLanes + lane * 4;
      for (int quad = 0; quad < kSub / 4; ++quad) std::memcpy(dst + quad * kLanes * 4, q + 4 * quad, 4);
      const int64_t v = a->at(g, b) * kLanes + lane;
      a->off[v] = -off * qsum;
      a->d[v] = d;
      if (l.f->has_min) a->s[v] = sum_x;
    }
  }
  return a;
}

// acc[c * ld + g * 16 + lane] += row (g * 16 + lane) of x . column cols[c], over blocks [b0, b1).
template <int G, int C, int kBits, bool kHasMin, bool kF16>
VNNI_FN void VnniColumns(const Weights& w, const RowPackedActivations& a, int64_t g0, const int64_t* cols,
                         int64_t b0, int64_t b1, float* acc_out, int64_t ld) {
  acc_out += g0 * kLanes;
  const int shift = GroupShift(w.l.group);
  const int64_t groups = w.l.groups();
  __m512 acc[G][C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g][c] = _mm512_loadu_ps(acc_out + c * ld + g * kLanes);
  alignas(64) uint8_t codes[C][kSub];
  for (int64_t b = b0; b < b1; ++b) {
    float dw[C], mw[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const uint8_t* row = w.row(cols[c]);
      if constexpr (kBits == 8) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kSub));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[c]), _mm256_xor_si256(raw, _mm256_set1_epi8(-128)));
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kSub / 2));
        const __m128i mask = _mm_set1_epi8(0x0f);
        _mm_store_si128(reinterpret_cast<__m128i*>(codes[c]), _mm_and_si128(raw, mask));
        _mm_store_si128(reinterpret_cast<__m128i*>(codes[c] + 16), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
      }
      const int64_t si = cols[c] * groups + (b >> shift);
      dw[c] = ScaleAt<kF16>(w.scales, si);
      if constexpr (kHasMin) mw[c] = _cvtsh_ss(w.mins[si]) + 8.0f * dw[c];
    }
    __m512i dot[G][C];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const __m512i init = _mm512_loadu_si512(a.off.data() + a.at(g0 + g, b) * kLanes);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) dot[g][c] = init;
    }
#pragma GCC unroll 8
    for (int quad = 0; quad < kSub / 4; ++quad) {
      __m512i wb[C];
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        int32_t four;
        std::memcpy(&four, codes[c] + 4 * quad, sizeof(four));
        wb[c] = _mm512_set1_epi32(four);
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512i xv = _mm512_loadu_si512(a.x.data() + (a.at(g0 + g, b) * (kSub / 4) + quad) * kLanes * 4);
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) dot[g][c] = _mm512_dpbusd_epi32(dot[g][c], wb[c], xv);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const __m512 dx = _mm512_loadu_ps(a.d.data() + a.at(g0 + g, b) * kLanes);
      __m512 sx = _mm512_setzero_ps();
      if constexpr (kHasMin) sx = _mm512_loadu_ps(a.s.data() + a.at(g0 + g, b) * kLanes);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) {
        acc[g][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g][c]), _mm512_mul_ps(dx, _mm512_set1_ps(dw[c])), acc[g][c]);
        if constexpr (kHasMin) acc[g][c] = _mm512_fmadd_ps(sx, _mm512_set1_ps(mw[c]), acc[g][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(acc_out + c * ld + g * kLanes, acc[g][c]);
}

using VnniColumnsFn = void (*)(const Weights&, const RowPackedActivations&, int64_t, const int64_t*, int64_t, int64_t,
                               float*, int64_t);
// One call covers `cols` columns and two row groups (`pair`), or one (`single`, for an odd last
// group): 8 int32 and 8 f32 accumulators plus the broadcast codes fit the 32 vector registers.
struct VnniKernel {
  VnniColumnsFn pair, single;
  int cols;
};

template <int kBits, bool kHasMin, bool kF16>
VnniKernel VnniFor(int64_t groups) {
  if (groups == 1) return {nullptr, VnniColumns<1, 8, kBits, kHasMin, kF16>, 8};
  return {VnniColumns<2, 4, kBits, kHasMin, kF16>, VnniColumns<1, 4, kBits, kHasMin, kF16>, 4};
}

VnniKernel SelectVnni(int32_t fmt, int64_t groups) {
  switch (fmt) {
    case 0: return VnniFor<8, false, true>(groups);   // q8_0
    case 1: return VnniFor<4, false, true>(groups);   // q4_0
    case 2: return VnniFor<4, true, true>(groups);    // q4_1
    case 3: return VnniFor<8, false, false>(groups);  // int8
    default: return VnniFor<4, false, false>(groups); // int4
  }
}

ffi::Future VnniGemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y) {
  const std::shared_ptr<RowPackedActivations> a = PackRows(x, w.l);
  const VnniKernel kernel = SelectVnni(static_cast<int32_t>(w.l.f - kFormats), a->groups);
  const int64_t n = w.l.n, m = a->m, ld = a->groups * kLanes, nb = a->nb;
  void* out = y.untyped_data();
  const bool out_bf16 = y.element_type() == ffi::DataType::BF16;
  const int64_t tiles = (n + kernel.cols - 1) / kernel.cols;
  const int64_t work_per_tile = std::max<int64_t>(1, ld * w.l.k * kernel.cols);
  const int64_t chunks = NumChunks(pool, tiles, std::max<int64_t>(1, (1 << 18) / work_per_tile));
  return ParallelFor(pool, tiles, chunks, [=](int64_t, int64_t begin, int64_t end) {
    const int64_t c_begin = begin * kernel.cols, c_end = std::min(n, end * kernel.cols);
    std::vector<float> acc((end - begin) * kernel.cols * ld, 0.0f);
    int64_t cols[8];
    for (int64_t p0 = 0; p0 < nb; p0 += kVnniPanelBlocks) {
      const int64_t p1 = std::min(nb, p0 + kVnniPanelBlocks);
      for (int64_t t = begin; t < end; ++t) {
        // a short last tile repeats its last column (into scratch columns nobody reads)
        for (int c = 0; c < kernel.cols; ++c) cols[c] = std::min(n - 1, t * kernel.cols + c);
        float* tile = acc.data() + (t - begin) * kernel.cols * ld;
        int64_t g = 0;
        for (; g + 2 <= a->groups; g += 2) kernel.pair(w, *a, g, cols, p0, p1, tile, ld);
        if (g < a->groups) kernel.single(w, *a, g, cols, p0, p1, tile, ld);
      }
    }
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = c_begin; c < c_end; ++c) {
        const float v = acc[(c - c_begin) * ld + r];
        if (out_bf16) {
          static_cast<uint16_t*>(out)[r * n + c] = F32ToBf16(v);
        } else {
          static_cast<float*>(out)[r * n + c] = v;
        }
      }
    (void)a;  // keeps the packed activations alive until every task is done
    return ffi::Error::Success();
  });
}
#endif

// ---- handlers -----------------------------------------------------------------------------------

bool FloatInput(const ffi::AnyBuffer& b) { return IsF32OrBf16(b.element_type()); }

ffi::Future Quantize(ffi::ThreadPool pool, ffi::AnyBuffer wt, ffi::Result<ffi::AnyBuffer> qs,
                     ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> mins, int32_t fmt,
                     int64_t group) {
  const auto wd = wt.dimensions();
  if (wd.size() != 2 || !FloatInput(wt)) return ReadyFuture(InvalidArgument("quantize: w must be 2-D f32 or bf16"));
  Layout l;
  if (ffi::Error e = MakeLayout(fmt, group, wd[0], wd[1], &l); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckWeights(l, *qs, *scales, *mins); !e.success()) return ReadyFuture(e);
  const void* src = wt.untyped_data();
  const bool bf16 = wt.element_type() == ffi::DataType::BF16;
  uint8_t* q = static_cast<uint8_t*>(qs->untyped_data());
  void* s = scales->untyped_data();
  uint16_t* m = static_cast<uint16_t*>(mins->untyped_data());
  const int64_t chunks = NumChunks(pool, l.n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(l.k, 1)));
  return ParallelFor(pool, l.n, chunks, [=](int64_t, int64_t begin, int64_t end) {
    std::vector<float> scratch(l.k);
    for (int64_t r = begin; r < end; ++r)
      QuantizeRow(l, RowAsF32(src, bf16, r, l.k, scratch.data()), q + r * l.row_bytes(), s, m, r);
    return ffi::Error::Success();
  });
}

ffi::Future Dequantize(ffi::ThreadPool pool, ffi::AnyBuffer qs, ffi::AnyBuffer scales, ffi::AnyBuffer mins,
                       ffi::Result<ffi::AnyBuffer> out, int32_t fmt, int64_t group) {
  const auto od = out->dimensions();
  if (od.size() != 2 || !FloatInput(*out)) return ReadyFuture(InvalidArgument("dequantize: output must be 2-D f32/bf16"));
  Layout l;
  if (ffi::Error e = MakeLayout(fmt, group, od[0], od[1], &l); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckWeights(l, qs, scales, mins); !e.success()) return ReadyFuture(e);
  const Weights w{l, static_cast<const uint8_t*>(qs.untyped_data()), scales.untyped_data(),
                  static_cast<const uint16_t*>(mins.untyped_data())};
  void* dst = out->untyped_data();
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  const DequantFn deq = SelectGemm(fmt).deq;
  const int64_t chunks = NumChunks(pool, l.n, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(l.k, 1)));
  return ParallelFor(pool, l.n, chunks, [=](int64_t, int64_t begin, int64_t end) {
    std::vector<float> row(l.k);
    for (int64_t c = begin; c < end; ++c) {
      float* target = bf16 ? row.data() : static_cast<float*>(dst) + c * l.k;
      deq(w, c, 0, l.k, target);
      if (bf16) {
        uint16_t* o = static_cast<uint16_t*>(dst) + c * l.k;
        for (int64_t i = 0; i < l.k; ++i) o[i] = F32ToBf16(row[i]);
      }
    }
    return ffi::Error::Success();
  });
}

ffi::Future QuantGemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y) {
  const int64_t m = x.dimensions()[0], k = w.l.k, n = w.l.n;
  // f32 views of x and y: the buffers themselves for f32, converted copies for bf16.
  std::shared_ptr<std::vector<float>> x_copy, y_copy;
  const float* xf = AsF32(x, &x_copy);
  const bool out_bf16 = y.element_type() == ffi::DataType::BF16;
  float* yf = static_cast<float*>(y.untyped_data());
  if (out_bf16) {
    y_copy = std::make_shared<std::vector<float>>(m * n);
    yf = y_copy->data();
  }
  uint16_t* y_bf16 = out_bf16 ? static_cast<uint16_t*>(y.untyped_data()) : nullptr;
  const GemmKernels kernels = SelectGemm(static_cast<int32_t>(w.l.f - kFormats));
  auto xp = std::make_shared<std::vector<float>>(m > kGemvRows ? PackPanels(xf, m, k) : std::vector<float>());
  const int64_t nr = kernels.nr, col_tiles = (n + nr - 1) / nr;
  const int64_t chunks = NumChunks(pool, col_tiles, std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, m * k * nr)));
  return ParallelFor(pool, col_tiles, chunks, [=](int64_t, int64_t begin, int64_t end) {
    const int64_t c_begin = begin * nr, c_end = std::min(n, end * nr);
    for (int64_t r = 0; r < m; ++r) std::fill(yf + r * n + c_begin, yf + r * n + c_end, 0.0f);
    GemmColumns(w, kernels, xf, xp->data(), m, yf, c_begin, c_end);
    if (y_bf16)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = c_begin; c < c_end; ++c) y_bf16[r * n + c] = F32ToBf16(yf[r * n + c]);
    (void)x_copy;  // keeps the bf16 conversions and the packed x alive until every task is done
    (void)y_copy;
    (void)xp;
    return ffi::Error::Success();
  });
}

ffi::Future QuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer qs, ffi::AnyBuffer scales,
                        ffi::AnyBuffer mins, ffi::Result<ffi::AnyBuffer> y, int32_t fmt, int64_t group, bool exact) {
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || !FloatInput(x) || y->element_type() != x.element_type() ||
      yd[0] != xd[0])
    return ReadyFuture(InvalidArgument("quant_matmul: x must be (M, K) f32/bf16 and y (M, N) of x's dtype"));
  Layout l;
  if (ffi::Error e = MakeLayout(fmt, group, yd[1], xd[1], &l); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckWeights(l, qs, scales, mins); !e.success()) return ReadyFuture(e);
  const int64_t m = xd[0];
  if (m == 0 || l.n == 0) return ReadyFuture(ffi::Error::Success());
  const Weights w{l, static_cast<const uint8_t*>(qs.untyped_data()), scales.untyped_data(),
                  static_cast<const uint16_t*>(mins.untyped_data())};
  if (exact || m > kInt8Rows) return QuantGemm(pool, w, x, *y);
#ifdef TUNIX_RT_X86
  if (m > kGemvRows && HasVnni()) return VnniGemm(pool, w, x, *y);
#endif

  const GemvKernel kernel = SelectGemv(fmt);
  const TileFn tile_fn = kernel.tile;
  const int tile_cols = kernel.tile_cols;
  auto act = std::make_shared<QuantizedActivations>();
  act->m = m;
  act->k = l.k;
  act->q.resize(m * l.k);
  act->d.resize(m * act->blocks());
  act->s.resize(m * act->blocks());
  act->e.resize(l.f->has_min ? m * act->blocks() : 0);
  act->qsum.resize(m * act->blocks());
  {
    const bool bf16 = x.element_type() == ffi::DataType::BF16;
    std::vector<float> scratch(l.k);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t b0 = r * act->blocks();
      QuantizeActivationRow(RowAsF32(x.untyped_data(), bf16, r, l.k, scratch.data()), l.k, kernel.interleave,
                            l.f->has_min, kernel.quantize_block, act->q.data() + r * l.k, act->d.data() + b0, act->s.data() + b0,
                            l.f->has_min ? act->e.data() + b0 : nullptr, act->qsum.data() + b0);
    }
  }
  if (kernel.prep != nullptr) kernel.prep(*act, l.f->offset8);
  void* out = y->untyped_data();
  const bool out_bf16 = y->element_type() == ffi::DataType::BF16;
  const int64_t col_tiles = (l.n + tile_cols - 1) / tile_cols;
  const int64_t work_per_tile = std::max<int64_t>(1, m * l.k * tile_cols);
  // ~16K multiply-adds per chunk: even a 576 x 576 GEMV splits over both threads, which keeps
  // twice the weight loads in flight (decode is memory-bound; the pool's workers are awake).
  const int64_t chunks = NumChunks(pool, col_tiles, std::max<int64_t>(1, (int64_t{1} << 14) / work_per_tile));
  return ParallelFor(pool, col_tiles, chunks, [=](int64_t, int64_t begin, int64_t end) {
    float tile[kTileRows * kMaxTileCols];
    const int64_t ahead = PrefetchAhead(w.l);
    PrefetchColumns(w, begin * tile_cols, ahead);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t c0 = t * tile_cols;
      const int cols = static_cast<int>(std::min<int64_t>(tile_cols, l.n - c0));
      PrefetchColumns(w, c0 + ahead, cols);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        tile_fn(w, *act, c0, r0, rows, cols, tile);
        for (int r = 0; r < rows; ++r) {
          for (int c = 0; c < cols; ++c) {
            const int64_t i = (r0 + r) * l.n + c0 + c;
            if (out_bf16) {
              static_cast<uint16_t*>(out)[i] = F32ToBf16(tile[r * cols + c]);
            } else {
              static_cast<float*>(out)[i] = tile[r * cols + c];
            }
          }
        }
      }
    }
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeHandler, Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeHandler, Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulHandler, QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("exact"));

}  // namespace tunix_rt
