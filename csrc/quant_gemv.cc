// quant_matmul's GEMV route (see quant_kernels.h): x quantized to int8 per 32-block, integer dot
// products with the weight codes, per ISA tier (scalar, AVX2, AVX-512 VNNI).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "parallel.h"
#include "quant_formats.h"
#include "quant_kernels.h"

#include "isa.h"

namespace tunix_rt {
namespace quant {
namespace {

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
using TileFn = void (*)(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows, int cols,
                        float* y);
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
        dw[c] = _mm256_permutevar8x32_ps(
            _mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(both)))),
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
VNNI_FN void TileQuadStripes(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int, int cols,
                             float* y) {
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
        const int32_t dot = HSum32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, xv)) -
                            (kOffset8 ? 8 * a.qsum[i] : 0);
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
VNNI_FN void TilePairStripes8(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int, int cols,
                              float* y) {
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
          const __m512i dot = _mm512_dpbusd_epi32(init, u,
                                                  _mm512_loadu_si512(a.q.data() + (r0 + r) * a.k + p * 2 * kSub));
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
constexpr TileFn kPairStripes8 =
    ByRows<TilePairStripes8<kF16, 1>, TilePairStripes8<kF16, 2>, TilePairStripes8<kF16, 3>, TilePairStripes8<kF16, 4>>;
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
        kPairStripes8<true>,               // q8_0
        kQuadStripes<true, false, true>,   // q4_0
        kQuadStripes<false, true, true>,   // q4_1
        kPairStripes8<false>,              // int8
        kQuadStripes<true, false, false>,  // int4
    };
    return kFormats[fmt].bits == 4 ? GemvKernel{kVnni[fmt], 4, kMaxTileCols, PrepQuadStripes, QuantizeBlockAvx512}
                                   : GemvKernel{kVnni[fmt], 1, kMaxTileCols, PrepPairs8, QuantizeBlockAvx512};
  }
  if (isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c) {
    static constexpr TileFn kAvx2[kNumFormats] = {
        kAvx2Tiles<8, false, false, true>,   // q8_0
        kAvx2Tiles<4, true, false, true>,    // q4_0
        kAvx2Tiles<4, false, true, true>,    // q4_1
        kAvx2Tiles<8, false, false, false>,  // int8
        kAvx2Tiles<4, true, false, false>,   // int4
    };
    return kFormats[fmt].bits == 4 ? GemvKernel{kAvx2[fmt], 2, kTileCols, PrepPairsAvx2}
                                   : GemvKernel{kAvx2[fmt], 1, kTileCols, nullptr};
  }
#endif
  return GemvKernel{TileScalar, 1, kTileCols, nullptr};
}

}  // namespace

ffi::Future QuantGemv(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y) {
  const Layout& l = w.l;
  const int64_t m = x.dimensions()[0];
  const GemvKernel kernel = SelectGemv(l.format_id());
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
                            l.f->has_min, kernel.quantize_block, act->q.data() + r * l.k, act->d.data() + b0,
                            act->s.data() + b0, l.f->has_min ? act->e.data() + b0 : nullptr, act->qsum.data() + b0);
    }
  }
  if (kernel.prep != nullptr) kernel.prep(*act, l.f->offset8);
  void* out = y.untyped_data();
  const bool out_bf16 = y.element_type() == ffi::DataType::BF16;
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

}  // namespace quant
}  // namespace tunix_rt
