// quant_matmul's GEMV route (see quant_kernels.h): x quantized to int8 per 32-block, integer dot
// products with the weight codes, per ISA tier (scalar, AVX2, AVX-512 VNNI).
#include <algorithm>
#include <cmath>
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

// Activations quantized per 32-block: x ~= d[b] * q[b*32 + i]. s[b] (formats with mins) is the block's
// exact sum of x, which q4_1's mins multiply (m * sum(x) needs no quantized x); qsum[b] is sum(q), from
// which the kernels' integer corrections come (4-bit codes are centred: minus 8 * qsum).
// With `interleave` P (for 4-bit formats: 2 for AVX2, 4 for AVX-512 VNNI), each run of P blocks is stored as
// [x0[0:16] .. xP-1[0:16] x0[16:32] .. xP-1[16:32]]: the order in which one load of P 4-bit weight
// blocks unpacks (low nibbles, then high ones), so P blocks take one unpack. A last, shorter run
// is interleaved by its own length (one block: natural order).
struct QuantizedActivations {
  int64_t m, k;
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qsum;
  int64_t blocks() const { return k / kSub; }
};

// One row of x (K values) quantized per 32-block by quantize_block, in the layout above; s (formats with
// mins, else null) gets the blocks' exact sums.
void QuantizeActivationRow(const float* x, int64_t k, int interleave, BlockQuantizer quantize_block, int8_t* q,
                           float* d, float* s, int32_t* qsum) {
  const int64_t nb = k / kSub;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t run = b - b % interleave;                          // first block of b's run
    const int64_t length = std::min<int64_t>(interleave, nb - run);  // the last run may be shorter
    // the j-th block of a run of P blocks has its halves at run * 32 + j * 16 and 16 P further
    int8_t* lo = q + run * kSub + (b - run) * 16;
    int8_t* hi = lo + 16 * length;
    d[b] = quantize_block(x + b * kSub, lo, hi, &qsum[b], s != nullptr ? &s[b] : nullptr);
  }
}

// A tile of outputs: rows r0..r0+rows-1 (rows <= 4) by columns col..col+cols-1 (cols <= kMaxTileCols),
// written to y[r * cols + c].
using TileFn = void (*)(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows, int cols,
                        float* y);
constexpr int kTileRows = 4, kTileCols = 1, kMaxTileCols = 16;  // kernels may take more columns (SelectGemv)

// Every tier's kernels compute each output the same way, so the int8 route gives the same bits on every
// tier, for every M: per activation block b, the exact integer dot of the block's codes (4-bit ones
// centred, minus 8) with its int8 activations, then acc = fma(float(dot_b), d_x[b] * d_w, acc) and, for
// q4_1, acc = fma(s_x[b], m + 8 d_w, acc), block after block. The scalar kernel does it one output at a
// time (std::fma: one rounding, as the SIMD kernels' fused multiply-adds).
void TileScalar(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows, int cols,
                float* y) {
  const int64_t per_group = w.l.group / kSub, nb = a.blocks();
  const bool centred = w.l.f->bits == 4, has_min = w.l.f->has_min;
  for (int c = 0; c < cols; ++c) {
    const uint8_t* row = w.row(col + c);
    for (int r = 0; r < rows; ++r) {
      const int8_t* xq = a.q.data() + (r0 + r) * a.k;  // natural order: the scalar tier never pairs
      const int64_t at = (r0 + r) * nb;
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t i = 0; i < kSub; ++i) dot += Code(w.l, row, b * kSub + i) * xq[b * kSub + i];
        if (centred) dot -= 8 * a.qsum[at + b];
        const float dw = w.scale(col + c, b / per_group);
        acc = std::fma(static_cast<float>(dot), a.d[at + b] * dw, acc);
        if (has_min) acc = std::fma(a.s[at + b], w.min(col + c, b / per_group) + 8.0f * dw, acc);
      }
      y[r * cols + c] = acc;
    }
  }
}

#ifdef TUNIX_RT_X86
// The N columns a column-lane kernel's tile reads from `col` and their code rows: a short tile (cols < N)
// repeats its last column (into lanes nobody reads).
template <int N>
inline void TileColumnRows(const Weights& w, int64_t col, int cols, int64_t colv[N], const uint8_t* wrow[N]) {
  for (int c = 0; c < N; ++c) {
    colv[c] = col + std::min(c, cols - 1);
    wrow[c] = w.row(colv[c]);
  }
}

// One kernel per row count (1..kTileRows), dispatched at run time by the tile's shape.
template <TileFn... kRows>
void ByRows(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int rows, int cols, float* y) {
  static constexpr TileFn kTable[] = {kRows...};
  kTable[rows - 1](w, a, col, r0, rows, cols, y);
}

// ---- AVX2 GEMV tiles ----------------------------------------------------------------------------
// Eight columns ride in the 8 lanes, so each output is summed exactly as the AVX2 int8 GEMM sums it
// (quant_gemm.cc), block after block: acc = fma(float(dot_b), d_x[b] * d_w[b], acc), then for q4_1
// acc = fma(s_x[b], m + 8 d_w, acc), where dot_b is the whole block's centred integer dot (4-bit codes
// minus 8; 8-bit codes as they are). A row's result thus never depends on the route its call took
// (GEMV up to kGemvRows rows, the GEMM past them) or on the rows beside it. Per block, each column's
// products come from maddubs (u8 x s8 pairs into int16: 4-bit codes as stored; 8-bit ones as |code|
// against x carrying the code's sign, so a pair's sum fits, |2 * 128 * 127| < 2^15), and the eight
// columns' partial sums fold into one vector of block dots by horizontal adds: for 4-bit in int16
// (|lane| <= 16 * 15 * 127 after three levels), for 8-bit in int32 after madd.

constexpr int kAvx2Columns = 8;  // columns per tile: the lanes

// dw lane c = d_w of column cols[c] at block b and, with mins, mw lane c = m + 8 d_w (the GEMM's
// correction factor, rounded once). From the weight's column-lane scales where it has them (tile
// `col` / 8 is one half of a 16-column lane tile), else gathered column by column.
template <bool kHasMin, bool kF16>
AVX2_F16C_FN inline void BlockColumnScales(const Weights& w, int64_t col, const int64_t* cols, int64_t b, __m256* dw,
                                           __m256* mw) {
  const int64_t g = b >> GroupShift(w.l.group), groups = w.l.groups();
  if (w.lanes != nullptr) {
    constexpr int64_t kWidth = kLaneColumns * (kHasMin ? 2 : 1);
    const int64_t at = ((col / kLaneColumns) * groups + g) * kWidth + col % kLaneColumns;
    if constexpr (kF16) {
      const uint16_t* lane = static_cast<const uint16_t*>(w.lanes) + at;
      *dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lane)));
      if constexpr (kHasMin) {
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lane + kLaneColumns)));
        *mw = _mm256_fmadd_ps(_mm256_set1_ps(8.0f), *dw, m);
      }
    } else {
      *dw = _mm256_loadu_ps(static_cast<const float*>(w.lanes) + at);
    }
    return;
  }
  alignas(32) float d[kAvx2Columns], m[kAvx2Columns];
  for (int c = 0; c < kAvx2Columns; ++c) {
    d[c] = ScaleAt<kF16>(w.scales, cols[c] * groups + g);
    if constexpr (kHasMin) m[c] = _cvtsh_ss(w.mins[cols[c] * groups + g]) + 8.0f * d[c];
  }
  *dw = _mm256_load_ps(d);
  if constexpr (kHasMin) *mw = _mm256_load_ps(m);
}

// The eight columns' integer dots of one activation block (xv: its 32 codes, natural order): 4-bit
// codes[c] are 0..15 (uncentred dots); 8-bit ones are |code| with signs[c] the codes themselves.
template <int kBits>
AVX2_F16C_FN inline __m256i BlockDots(const uint8_t (*codes)[kSub], const int8_t (*signs)[kSub], __m256i xv) {
  __m256i p[kAvx2Columns];
  for (int c = 0; c < kAvx2Columns; ++c) {
    const __m256i u = _mm256_load_si256(reinterpret_cast<const __m256i*>(codes[c]));
    if constexpr (kBits == 4) {
      p[c] = _mm256_maddubs_epi16(u, xv);
    } else {
      const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(signs[c]));
      p[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(xv, s)), _mm256_set1_epi16(1));
    }
  }
  if constexpr (kBits == 4) {  // int16: [columns 0..7 over bytes 0..15 | over bytes 16..31]
    const __m256i h = _mm256_hadd_epi16(
        _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])),
        _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7])));
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(h, 1)));
  } else {  // int32: [columns 0..3 | 0..3] and [4..7 | 4..7] over the halves, then the halves added
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
  }
}

// Two 4-bit blocks' dots with the eight columns at once, over activations interleaved by 2: lo[c] and
// hi[c] hold one 32-byte load of column c's two blocks (low nibbles: elements 0..15 of each block, high
// ones: 16..31), xlo and xhi the run's matching halves, so 128-bit lane j of every product is block j.
// Two horizontal levels in int16 (|lane| <= 16 * 15 * 127), then madd into int32 and a 128-bit regroup.
AVX2_F16C_FN inline void PairDots4(const uint8_t (*lo)[kSub], const uint8_t (*hi)[kSub], __m256i xlo, __m256i xhi,
                                   __m256i dots[2]) {
  __m256i p[kAvx2Columns];
  for (int c = 0; c < kAvx2Columns; ++c)
    p[c] = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(lo[c])), xlo),
                            _mm256_maddubs_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(hi[c])), xhi));
  const __m256i ones = _mm256_set1_epi16(1);
  // lane j: columns 0..3 (then 4..7) of block j
  const __m256i m0 = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3])),
                                       ones);
  const __m256i m1 = _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7])),
                                       ones);
  dots[0] = _mm256_permute2x128_si256(m0, m1, 0x20);
  dots[1] = _mm256_permute2x128_si256(m0, m1, 0x31);
}

// PairDots4 for a single row, read straight from the eight columns' code rows (byte `at` on): with no other
// row to share the unpacked codes with, each column's load is unpacked, multiplied and folded into the
// horizontal adds as it comes, in registers (the shared path's stores and reloads of the codes took a third
// of a one-row tile's instructions). The same operations in the same order: the same bits.
AVX2_F16C_FN inline __m256i ColumnPairRow(const uint8_t* column, __m256i xlo, __m256i xhi) {
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column));
  return _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(raw, mask), xlo),
                          _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), mask), xhi));
}

// lane j: columns c0..c0+3 of block j, as int32
AVX2_F16C_FN inline __m256i FourColumnsRow(const uint8_t* const* wrow, int64_t at, __m256i xlo, __m256i xhi) {
  const __m256i h01 = _mm256_hadd_epi16(ColumnPairRow(wrow[0] + at, xlo, xhi), ColumnPairRow(wrow[1] + at, xlo, xhi));
  const __m256i h23 = _mm256_hadd_epi16(ColumnPairRow(wrow[2] + at, xlo, xhi), ColumnPairRow(wrow[3] + at, xlo, xhi));
  return _mm256_madd_epi16(_mm256_hadd_epi16(h01, h23), _mm256_set1_epi16(1));
}

AVX2_F16C_FN inline void PairDots4Row(const uint8_t* const wrow[kAvx2Columns], int64_t at, __m256i xlo, __m256i xhi,
                                      __m256i dots[2]) {
  const __m256i m0 = FourColumnsRow(wrow, at, xlo, xhi), m1 = FourColumnsRow(wrow + 4, at, xlo, xhi);
  dots[0] = _mm256_permute2x128_si256(m0, m1, 0x20);
  dots[1] = _mm256_permute2x128_si256(m0, m1, 0x31);
}

// acc += one block's products for a row (dot: its uncentred integer dots with the eight columns).
template <int kBits, bool kHasMin>
AVX2_F16C_FN inline __m256 AddBlock(const QuantizedActivations& a, int64_t at, __m256i dot, __m256 dw, __m256 mw,
                                    __m256 acc) {
  if constexpr (kBits == 4) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * a.qsum[at]));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(_mm256_set1_ps(a.d[at]), dw), acc);
  if constexpr (kHasMin) acc = _mm256_fmadd_ps(_mm256_set1_ps(a.s[at]), mw, acc);
  return acc;
}

// 4-bit formats read activations interleaved by 2 (SelectGemv) and take two blocks per step; a last odd
// block, stored in natural order, goes alone. 8-bit ones read them in natural order, a block per step.
template <int kBits, bool kHasMin, bool kF16, int R>
AVX2_F16C_FN void TileColumnsAvx2(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int,
                                  int cols, float* y) {
  const int64_t nb = a.blocks();
  int64_t colv[kAvx2Columns];
  const uint8_t* wrow[kAvx2Columns];
  TileColumnRows<kAvx2Columns>(w, col, cols, colv, wrow);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  alignas(32) uint8_t codes[kAvx2Columns][kSub], high[kBits == 4 ? kAvx2Columns : 1][kSub];
  alignas(32) int8_t signs[kBits == 8 ? kAvx2Columns : 1][kSub];
  int64_t b = 0;
  if constexpr (kBits == 4) {
    const __m256i mask = _mm256_set1_epi8(0x0f);
    if constexpr (R == 1) {
      for (; b + 2 <= nb; b += 2) {
        __m256 dw[2], mw[2];
        BlockColumnScales<kHasMin, kF16>(w, col, colv, b, &dw[0], &mw[0]);
        BlockColumnScales<kHasMin, kF16>(w, col, colv, b + 1, &dw[1], &mw[1]);
        const int8_t* xq = a.q.data() + r0 * a.k + b * kSub;
        __m256i dots[2];
        PairDots4Row(wrow, b * kSub / 2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)),
                     _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + kSub)), dots);
        const int64_t at = r0 * nb + b;
        acc[0] = AddBlock<4, kHasMin>(a, at, dots[0], dw[0], mw[0], acc[0]);
        acc[0] = AddBlock<4, kHasMin>(a, at + 1, dots[1], dw[1], mw[1], acc[0]);
      }
    }
    for (; b + 2 <= nb; b += 2) {
      for (int c = 0; c < kAvx2Columns; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[c] + b * kSub / 2));
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[c]), _mm256_and_si256(raw, mask));
        _mm256_store_si256(reinterpret_cast<__m256i*>(high[c]), _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask));
      }
      __m256 dw[2], mw[2];
      BlockColumnScales<kHasMin, kF16>(w, col, colv, b, &dw[0], &mw[0]);
      BlockColumnScales<kHasMin, kF16>(w, col, colv, b + 1, &dw[1], &mw[1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = a.q.data() + (r0 + r) * a.k + b * kSub;
        __m256i dots[2];
        PairDots4(codes, high, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + kSub)), dots);
        const int64_t at = (r0 + r) * nb + b;
        acc[r] = AddBlock<4, kHasMin>(a, at, dots[0], dw[0], mw[0], acc[r]);
        acc[r] = AddBlock<4, kHasMin>(a, at + 1, dots[1], dw[1], mw[1], acc[r]);
      }
    }
  }
  for (; b < nb; ++b) {
    for (int c = 0; c < kAvx2Columns; ++c) {
      const __m256i raw = LoadCodes<kBits>(wrow[c], b);
      if constexpr (kBits == 8) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[c]), _mm256_sign_epi8(raw, raw));  // -128: 128 as u8
        _mm256_store_si256(reinterpret_cast<__m256i*>(signs[c]), raw);
      } else {
        _mm256_store_si256(reinterpret_cast<__m256i*>(codes[c]), raw);
      }
    }
    __m256 dw, mw;
    BlockColumnScales<kHasMin, kF16>(w, col, colv, b, &dw, &mw);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * a.k + b * kSub));
      acc[r] = AddBlock<kBits, kHasMin>(a, (r0 + r) * nb + b, BlockDots<kBits>(codes, signs, xv), dw, mw, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[kAvx2Columns];
    _mm256_store_ps(out, acc[r]);
    std::memcpy(y + r * cols, out, cols * sizeof(float));
  }
}

template <int kBits, bool kHasMin, bool kF16>
constexpr TileFn kAvx2Columns8 =
    ByRows<TileColumnsAvx2<kBits, kHasMin, kF16, 1>, TileColumnsAvx2<kBits, kHasMin, kF16, 2>,
           TileColumnsAvx2<kBits, kHasMin, kF16, 3>, TileColumnsAvx2<kBits, kHasMin, kF16, 4>>;
// ---- AVX-512 VNNI GEMV tiles --------------------------------------------------------------------
// Sixteen columns ride in the 16 lanes, so each output is summed exactly as the VNNI int8 GEMM sums it, block
// after block: acc = fma(float(dot_b), d_x[b] * d_w[b], acc), then for q4_1 acc = fma(s_x[b], m + 8 d_w,
// acc), where dot_b is the whole block's centred integer dot (codes minus 8 or 128). A row's result
// thus never depends on the route its call took (GEMV up to kGemvRows rows, the GEMM past them) or
// on the rows beside it. Weights are read as stored: one 64-byte load holds four 4-bit blocks (two
// 8-bit ones) of one column, and the integer partial sums of 16 columns are folded into one vector
// of whole-block dots per block by packs/madds (4-bit: |lane| <= 8 * 15 * 127 fits int16) or int32
// unpack-adds (8-bit), then regrouped by 128-bit shuffles. The scales come in lanes too: read from
// the weight's column-lane scales where it has them (the engine lays them out once per weight), else
// a 16-block stripe of them is transposed per tile (columns into lanes); either way the rows share
// them. Transposing on every call took 12 % of single-stream decode's profile samples.

constexpr int kColumnTile = 16;  // columns per tile: the lanes
static_assert(kColumnTile == kLaneColumns, "a tile's column-lane scales are one row of the weight's lanes");
constexpr int64_t kStripe = 16;  // blocks whose scales are transposed at once

VNNI_FN inline __mmask16 FirstLanes(int64_t count) { return static_cast<__mmask16>((1u << count) - 1); }

// 64 bytes, or the first ones `bytes` selects (zeros after them): a plain load where all are wanted.
VNNI_FN inline __m512i LoadBytes(__mmask64 bytes, const void* p) {
  return bytes == ~__mmask64{0} ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(bytes, p);
}

// r[i] lane j <- r[j] lane i (a 16 x 16 transpose of f32).
VNNI_FN inline void Transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
    const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  // r[4q + i] now holds, in 128-bit lane l, elements 4l..4l+3 of column i of rows 4q..4q+3.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// Per block of the stripe [b0, b0 + count): dw[j] lane c = d_w of column cols[c] at block b0 + j and,
// with mins, mw[j] lane c = m + 8 d_w (the GEMM's correction factor, rounded once). From the weight's
// column-lane scales where it has them (tile: the columns' tile), else by transposing the columns'.
template <bool kHasMin, bool kF16>
VNNI_FN void StripeColumnScales(const Weights& w, int64_t tile, const int64_t* cols, int64_t b0, int64_t count,
                                __m512 dw[kStripe], __m512 mw[kStripe]) {
  const int shift = GroupShift(w.l.group);
  const int64_t groups = w.l.groups();
  if (w.lanes != nullptr) {
    constexpr int64_t kWidth = kLaneColumns * (kHasMin ? 2 : 1);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t at = (tile * groups + ((b0 + j) >> shift)) * kWidth;
      if constexpr (kF16) {
        const uint16_t* lane = static_cast<const uint16_t*>(w.lanes) + at;
        dw[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane)));
        if constexpr (kHasMin) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lane + kLaneColumns)));
          mw[j] = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), dw[j], m);
        }
      } else {
        dw[j] = _mm512_loadu_ps(static_cast<const float*>(w.lanes) + at);
      }
    }
    return;
  }
  for (int c = 0; c < kColumnTile; ++c) {
    const int64_t g0 = cols[c] * groups;
    if (shift == 0) {
      if constexpr (kF16) {
        dw[c] = _mm512_cvtph_ps(
            _mm256_maskz_loadu_epi16(FirstLanes(count), static_cast<const uint16_t*>(w.scales) + g0 + b0));
      } else {
        dw[c] = _mm512_maskz_loadu_ps(FirstLanes(count), static_cast<const float*>(w.scales) + g0 + b0);
      }
      if constexpr (kHasMin) mw[c] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(FirstLanes(count), w.mins + g0 + b0));
    } else {
      alignas(64) float d[kStripe] = {}, m[kStripe] = {};
      for (int64_t i = 0; i < count; ++i) {
        d[i] = ScaleAt<kF16>(w.scales, g0 + ((b0 + i) >> shift));
        if constexpr (kHasMin) m[i] = _cvtsh_ss(w.mins[g0 + ((b0 + i) >> shift)]);
      }
      dw[c] = _mm512_load_ps(d);
      if constexpr (kHasMin) mw[c] = _mm512_load_ps(m);
    }
  }
  Transpose16(dw);
  if constexpr (kHasMin) {
    Transpose16(mw);
    for (int j = 0; j < kStripe; ++j) mw[j] = _mm512_fmadd_ps(_mm512_set1_ps(8.0f), dw[j], mw[j]);
  }
}

// out[j] lane 4 q + i <- v[q] lane 4 j + i: 128-bit lane j of four vectors gathered into one.
VNNI_FN inline void Transpose128(const __m512i v[4], __m512i out[4]) {
  const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_i32x4(v[0], v[1], 0xee);
  const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xee);
  out[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
  out[1] = _mm512_shuffle_i32x4(t0, t2, 0xdd);
  out[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
  out[3] = _mm512_shuffle_i32x4(t1, t3, 0xdd);
}

// acc += the blocks [b0, b0 + nq) of one row, dots[j] lane c holding block b0 + j's uncentred dot
// with column c: the GEMM's per-block arithmetic, column by column in the lanes.
template <bool kHasMin>
VNNI_FN inline __m512 AddBlocks(const QuantizedActivations& a, int64_t row, int64_t b0, int64_t nq, int32_t off,
                                const __m512i* dots, const __m512* dw, const __m512* mw, __m512 acc) {
  const int64_t at = row * a.blocks() + b0;
  for (int64_t j = 0; j < nq; ++j) {
    const __m512i dot = _mm512_sub_epi32(dots[j], _mm512_set1_epi32(off * a.qsum[at + j]));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_set1_ps(a.d[at + j]), dw[j]), acc);
    if constexpr (kHasMin) acc = _mm512_fmadd_ps(_mm512_set1_ps(a.s[at + j]), mw[j], acc);
  }
  return acc;
}

// 4-bit formats over activations interleaved by 4 (a last, shorter run by its own length).
template <bool kHasMin, bool kF16, int R>
VNNI_FN void TileColumns4(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int, int cols,
                          float* y) {
  const int64_t nb = a.blocks();
  const __m512i mask = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi16(1);
  int64_t colv[kColumnTile];
  const uint8_t* wrow[kColumnTile];
  TileColumnRows<kColumnTile>(w, col, cols, colv, wrow);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 dw[kStripe], mw[kStripe];
  for (int64_t s0 = 0; s0 < nb; s0 += kStripe) {
    const int64_t sn = std::min(kStripe, nb - s0);
    StripeColumnScales<kHasMin, kF16>(w, col / kColumnTile, colv, s0, sn, dw, mw);
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += 4) {
      const int64_t nq = std::min<int64_t>(4, nb - b0);
      const __mmask64 bytes = nq == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * nq)) - 1;
      __m512i part[R][4];
      for (int cq = 0; cq < 4; ++cq) {
        __m512i lo[4], hi[4];
        for (int i = 0; i < 4; ++i) {
          const __m512i raw = LoadBytes(bytes, wrow[4 * cq + i] + b0 * kSub / 2);
          lo[i] = _mm512_and_si512(raw, mask);
          hi[i] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.q.data() + (r0 + r) * a.k + b0 * kSub;
          const __m512i xlo = LoadBytes(bytes, xq), xhi = LoadBytes(bytes, xq + 16 * nq);
          __m512i dot[4];
          for (int i = 0; i < 4; ++i)
            dot[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[i], xlo), hi[i], xhi);
          const __m512i d01 = _mm512_madd_epi16(_mm512_packs_epi32(dot[0], dot[1]), ones);
          const __m512i d23 = _mm512_madd_epi16(_mm512_packs_epi32(dot[2], dot[3]), ones);
          part[r][cq] = _mm512_madd_epi16(_mm512_packs_epi32(d01, d23), ones);  // lane 4 j + i: block j, column i
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512i dots[4];
        Transpose128(part[r], dots);
        acc[r] = AddBlocks<kHasMin>(a, r0 + r, b0, nq, 8, dots, dw + (b0 - s0), mw + (b0 - s0), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[kColumnTile];
    _mm512_store_ps(out, acc[r]);
    std::memcpy(y + r * cols, out, cols * sizeof(float));
  }
}

// 8-bit formats over activations in natural order: one 64-byte load holds two blocks of a column;
// the codes are the unsigned operand (c ^ 0x80 = c + 128), and 128 * qsum comes off the dot.
// Each column's eight int32 partial sums per block fold into one lane by three unpack-add levels.
template <bool kF16, int R>
VNNI_FN void TileColumns8(const Weights& w, const QuantizedActivations& a, int64_t col, int64_t r0, int, int cols,
                          float* y) {
  const int64_t nb = a.blocks();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t colv[kColumnTile];
  const uint8_t* wrow[kColumnTile];
  TileColumnRows<kColumnTile>(w, col, cols, colv, wrow);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512 dw[kStripe];
  for (int64_t s0 = 0; s0 < nb; s0 += kStripe) {
    const int64_t sn = std::min(kStripe, nb - s0);
    StripeColumnScales<false, kF16>(w, col / kColumnTile, colv, s0, sn, dw, nullptr);
    for (int64_t b0 = s0; b0 < s0 + sn; b0 += 2) {
      const int64_t np = std::min<int64_t>(2, nb - b0);
      const __mmask64 bytes = np == 2 ? ~__mmask64{0} : (__mmask64{1} << 32) - 1;
      __m512i u[kColumnTile];
      for (int c = 0; c < kColumnTile; ++c) u[c] = _mm512_xor_si512(LoadBytes(bytes, wrow[c] + b0 * kSub), flip);
      for (int r = 0; r < R; ++r) {
        const __m512i xv = LoadBytes(bytes, a.q.data() + (r0 + r) * a.k + b0 * kSub);
        __m512i l2[4];
        for (int q = 0; q < 4; ++q) {  // columns 4q..4q+3
          __m512i l1[2];
          for (int h = 0; h < 2; ++h) {
            const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4 * q + 2 * h], xv);
            const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[4 * q + 2 * h + 1], xv);
            l1[h] = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
          }
          l2[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(l1[0], l1[1]), _mm512_unpackhi_epi64(l1[0], l1[1]));
        }
        // l2[q] 128-bit lanes: block b0 (halves 0, 1), block b0 + 1 (halves 0, 1), columns 4q..4q+3
        const __m512i s01 = _mm512_add_epi32(_mm512_shuffle_i32x4(l2[0], l2[1], 0x88),
                                             _mm512_shuffle_i32x4(l2[0], l2[1], 0xdd));
        const __m512i s23 = _mm512_add_epi32(_mm512_shuffle_i32x4(l2[2], l2[3], 0x88),
                                             _mm512_shuffle_i32x4(l2[2], l2[3], 0xdd));
        const __m512i dots[2] = {_mm512_shuffle_i32x4(s01, s23, 0x88), _mm512_shuffle_i32x4(s01, s23, 0xdd)};
        acc[r] = AddBlocks<false>(a, r0 + r, b0, np, 128, dots, dw + (b0 - s0), nullptr, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float out[kColumnTile];
    _mm512_store_ps(out, acc[r]);
    std::memcpy(y + r * cols, out, cols * sizeof(float));
  }
}

template <bool kHasMin, bool kF16>
constexpr TileFn kColumns4 = ByRows<TileColumns4<kHasMin, kF16, 1>, TileColumns4<kHasMin, kF16, 2>,
                                    TileColumns4<kHasMin, kF16, 3>, TileColumns4<kHasMin, kF16, 4>>;

template <bool kF16>
constexpr TileFn kColumns8 =
    ByRows<TileColumns8<kF16, 1>, TileColumns8<kF16, 2>, TileColumns8<kF16, 3>, TileColumns8<kF16, 4>>;
#endif

// The GEMV kernel of a format for the detected ISA tier, with the activation layout it reads
// (`interleave` for QuantizeActivationRow) and the block quantizer the tier's int8 GEMM uses too.
struct GemvKernel {
  const char* name;
  TileFn tile;
  int interleave;
  int tile_cols;
  BlockQuantizer quantize_block = QuantizeBlock;
  bool reads_lanes = false;  // the weight's column-lane scales, where it has them
};

// Every tier's int8 products have the same bits, so AMD's AVX-512 CPUs (cpu_features.h) take the AVX2 GEMV
// beside the AVX-512 VNNI GEMM without a row's result depending on its route.
GemvKernel SelectGemv(int32_t fmt) {
#ifdef TUNIX_RT_X86
  if (HasVnni() && !cpu_features().amd_avx512) {
    static constexpr TileFn kVnni[kNumFormats] = {
        kColumns8<true>,          // q8_0
        kColumns4<false, true>,   // q4_0
        kColumns4<true, true>,    // q4_1
        kColumns8<false>,         // int8
        kColumns4<false, false>,  // int4
    };
    return GemvKernel{"avx512-vnni", kVnni[fmt],          kFormats[fmt].bits == 4 ? 4 : 1,
                      kColumnTile,   QuantizeBlockAvx512, true};
  }
  if (isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c) {
    static constexpr TileFn kAvx2[kNumFormats] = {
        kAvx2Columns8<8, false, true>,   // q8_0
        kAvx2Columns8<4, false, true>,   // q4_0
        kAvx2Columns8<4, true, true>,    // q4_1
        kAvx2Columns8<8, false, false>,  // int8
        kAvx2Columns8<4, false, false>,  // int4
    };
    return GemvKernel{"avx2", kAvx2[fmt], kFormats[fmt].bits == 4 ? 2 : 1, kAvx2Columns, QuantizeBlockAvx2, true};
  }
#endif
  return GemvKernel{"scalar", TileScalar, 1, kTileCols};
}

}  // namespace

const char* GemvKernelName(int32_t fmt) { return SelectGemv(fmt).name; }

ffi::Future QuantGemv(ffi::ThreadPool& pool, const Weights& weights, const ffi::AnyBuffer& x, ffi::AnyBuffer y) {
  const Layout& l = weights.l;
  const int64_t m = x.dimensions()[0];
  const GemvKernel kernel = SelectGemv(l.format_id());
  Weights w = weights;
  if (!kernel.reads_lanes) w.lanes = nullptr;  // so the prefetches fetch the scales this kernel reads
  const TileFn tile_fn = kernel.tile;
  const int tile_cols = kernel.tile_cols;
  auto act = std::make_shared<QuantizedActivations>();
  act->m = m;
  act->k = l.k;
  act->q.resize(m * l.k);
  act->d.resize(m * act->blocks());
  act->s.resize(l.f->has_min ? m * act->blocks() : 0);
  act->qsum.resize(m * act->blocks());
  {
    const bool bf16 = x.element_type() == ffi::DataType::BF16;
    std::vector<float> scratch(l.k);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t b0 = r * act->blocks();
      QuantizeActivationRow(RowAsF32(x.untyped_data(), bf16, r, l.k, scratch.data()), l.k, kernel.interleave,
                            kernel.quantize_block, act->q.data() + r * l.k, act->d.data() + b0,
                            l.f->has_min ? act->s.data() + b0 : nullptr, act->qsum.data() + b0);
    }
  }
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
    const int64_t block_tiles = std::max<int64_t>(1, kColumnBlockBytes / (tile_cols * l.row_bytes()));
    PrefetchColumns(w, begin * tile_cols, ahead);
    for (int64_t t0 = begin; t0 < end; t0 += block_tiles)
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows)
        for (int64_t t = t0; t < std::min(end, t0 + block_tiles); ++t) {
          const int64_t c0 = t * tile_cols;
          const int cols = static_cast<int>(std::min<int64_t>(tile_cols, l.n - c0));
          if (r0 == 0) PrefetchColumns(w, c0 + ahead, cols);
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
    return ffi::Error::Success();
  });
}

}  // namespace quant
}  // namespace tunix_rt
