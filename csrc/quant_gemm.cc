// quant_matmul's GEMM routes (see quant_kernels.h): exact f32 products over dequantized weight
// panels on the shared f32 micro-kernels (gemm_f32.h), and the int8 GEMMs (AVX-512 VNNI, AVX-VNNI, AVX2).
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "gemm_f32.h"
#include "parallel.h"
#include "quant_formats.h"
#include "quant_kernels.h"

#include "isa.h"

namespace tunix_rt {
namespace quant {
namespace {

// ---- GEMM: exact f32 products over dequantized weight panels ------------------------------------
//
// Large M (training, scoring, prefill) takes the exact route: y equals x @ dequantize(qt) up to
// f32 summation order. `exact` sends small M here too (output heads, whose logits int8
// activations would perturb). A panel holds nr columns (16, or 32 on AVX-512) x kPanelK rows of
// dequantized weights, k-major (panel[k * nr + j]); x is packed per k panel into kMR-row tiles,
// k-major too (xp[k * kMR + r]: rows of x are K apart, and a power-of-two K would make them fight
// over the same L1 sets). The micro-kernel broadcasts one x value per row into nr columns at
// once, keeping kMR x nr outputs in registers.
constexpr int64_t kPanelK = 256;  // a multiple of every group size
// Stride of the dequantized-column scratch: not a multiple of 1 KiB, so columns 4 apart do not
// alias in the low 12 address bits (false store-to-load dependencies).
constexpr int64_t kColStride = kPanelK + 16;
// Columns the row-invariant route dequantizes together past kGemvRows rows (8 x K floats: L1-sized for
// model widths up to ~1K, L2 beyond).
constexpr int64_t kDequantizedColumns = 8;

using TransposeFn = void (*)(const float* colbuf, int64_t kk, float* panel);  // nr columns
// The exact path's small-M kernel: y[r * ldy + col] = x[r] . dequantize(column col) for r < m,
// without building panels. `column` is scratch for K floats (the scalar version's).
using ColumnDotsFn = void (*)(const Weights& w, int64_t col, const float* x, int64_t m, float* column, float* y,
                              int64_t ldy);

void ColumnDotsScalar(const Weights& w, int64_t col, const float* x, int64_t m, float* column, float* y, int64_t ldy) {
  const int64_t k = w.l.k;
  DequantizeRange(w, col, 0, k, column);
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t i = 0; i < k; ++i) acc += x[r * k + i] * column[i];
    y[r * ldy + col] = acc;
  }
}

// The same products and sums as a tier's ColumnDotsFn, from the column's dequantized values (`column`, K
// floats from DequantizerFor's kernel, which computes each value as the column dots do in registers): for
// many rows, a column is dequantized once instead of once per kGemvRows rows, and every row's result keeps
// its bits (the row-invariant route's contract).
using DequantizedDotsFn = void (*)(const float* column, int64_t k, const float* x, int64_t m, float* y, int64_t ldy);

void DequantizedDotsScalar(const float* column, int64_t k, const float* x, int64_t m, float* y, int64_t ldy) {
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.0f;
    for (int64_t i = 0; i < k; ++i) acc += x[r * k + i] * column[i];
    y[r * ldy] = acc;
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
      const __m256 out[8] = {_mm256_permute2f128_ps(u0, u4, 0x20), _mm256_permute2f128_ps(u1, u5, 0x20),
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
  __m128i part[4];
  if constexpr (kBits == 8) {  // 8 codes at a time sign-extended straight from memory: loads, not three shuffles
    for (int j = 0; j < 4; ++j) part[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + b * kSub + 8 * j));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kSub / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    part[0] = lo;
    part[1] = _mm_srli_si128(lo, 8);
    part[2] = hi;
    part[3] = _mm_srli_si128(hi, 8);
  }
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
template <int kBits, bool kOffset8, bool kHasMin, bool kF16, int R>
AVX2_F16C_FN void ColumnDotsAvx2Rows(const Weights& w, int64_t col, const float* x, float* y, int64_t ldy) {
  const int64_t k = w.l.k;
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kSub; ++b) {
    __m256 v[4];
    DequantBlockAvx2<kBits, kOffset8, kHasMin, kF16>(w, col, b, v);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + b * kSub;
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), v[0], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v[1], acc1[r]);
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v[2], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v[3], acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy + col] = HSum8(_mm256_add_ps(acc0[r], acc1[r]));
}

template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
void ColumnDotsAvx2(const Weights& w, int64_t col, const float* x, int64_t m, float*, float* y, int64_t ldy) {
  using F = void (*)(const Weights&, int64_t, const float*, float*, int64_t);
  static constexpr F kRows[kGemvRows] = {
      ColumnDotsAvx2Rows<kBits, kOffset8, kHasMin, kF16, 1>, ColumnDotsAvx2Rows<kBits, kOffset8, kHasMin, kF16, 2>,
      ColumnDotsAvx2Rows<kBits, kOffset8, kHasMin, kF16, 3>, ColumnDotsAvx2Rows<kBits, kOffset8, kHasMin, kF16, 4>};
  kRows[m - 1](w, col, x, y, ldy);
}

// ColumnDotsAvx2's order (two accumulators taking alternate 8-element quarters of each block) from memory,
// for R rows: a compile-time count keeps every accumulator in a register (a runtime one spills them).
template <int R>
AVX2_FN void DequantizedDotsAvx2Rows(const float* column, int64_t k, const float* x, float* y, int64_t ldy) {
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += kSub) {
    const __m256 v0 = _mm256_loadu_ps(column + i), v1 = _mm256_loadu_ps(column + i + 8);
    const __m256 v2 = _mm256_loadu_ps(column + i + 16), v3 = _mm256_loadu_ps(column + i + 24);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + i;
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), v0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), v1, acc1[r]);
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), v2, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), v3, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = HSum8(_mm256_add_ps(acc0[r], acc1[r]));
}

void DequantizedDotsAvx2(const float* column, int64_t k, const float* x, int64_t m, float* y, int64_t ldy) {
  using F = void (*)(const float*, int64_t, const float*, float*, int64_t);
  static constexpr F kRows[kGemvRows] = {DequantizedDotsAvx2Rows<1>, DequantizedDotsAvx2Rows<2>,
                                         DequantizedDotsAvx2Rows<3>, DequantizedDotsAvx2Rows<4>};
  kRows[m - 1](column, k, x, y, ldy);
}

// ColumnDotsAvx2 with 16 lanes: the same dequantized values (d * q, or d * q + m) from 16 codes
// at a time; two accumulators per row halve the multiply-add chain.
template <int kBits, bool kOffset8, bool kHasMin, bool kF16, int R>
AVX512_F16C_FN void ColumnDotsAvx512Rows(const Weights& w, int64_t col, const float* x, float* y, int64_t ldy) {
  const int64_t k = w.l.k, groups = w.l.groups();
  const int shift = GroupShift(w.l.group);
  const uint8_t* row = w.row(col);
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
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
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + b * kSub;
      acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), v0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), v1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy + col] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

template <int kBits, bool kOffset8, bool kHasMin, bool kF16>
void ColumnDotsAvx512(const Weights& w, int64_t col, const float* x, int64_t m, float*, float* y, int64_t ldy) {
  using F = void (*)(const Weights&, int64_t, const float*, float*, int64_t);
  static constexpr F kRows[kGemvRows] = {
      ColumnDotsAvx512Rows<kBits, kOffset8, kHasMin, kF16, 1>, ColumnDotsAvx512Rows<kBits, kOffset8, kHasMin, kF16, 2>,
      ColumnDotsAvx512Rows<kBits, kOffset8, kHasMin, kF16, 3>, ColumnDotsAvx512Rows<kBits, kOffset8, kHasMin, kF16, 4>};
  kRows[m - 1](w, col, x, y, ldy);
}

// ColumnDotsAvx512's order (each block's two 16-element halves into two accumulators) from memory, R rows.
template <int R>
AVX512_FN void DequantizedDotsAvx512Rows(const float* column, int64_t k, const float* x, float* y, int64_t ldy) {
  __m512 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kSub) {
    const __m512 v0 = _mm512_loadu_ps(column + i), v1 = _mm512_loadu_ps(column + i + 16);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + r * k + i;
      acc0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb), v0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xb + 16), v1, acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r], acc1[r]));
}

void DequantizedDotsAvx512(const float* column, int64_t k, const float* x, int64_t m, float* y, int64_t ldy) {
  using F = void (*)(const float*, int64_t, const float*, float*, int64_t);
  static constexpr F kRows[kGemvRows] = {DequantizedDotsAvx512Rows<1>, DequantizedDotsAvx512Rows<2>,
                                         DequantizedDotsAvx512Rows<3>, DequantizedDotsAvx512Rows<4>};
  kRows[m - 1](column, k, x, y, ldy);
}
#endif

struct GemmKernels {
  DequantFn deq;
  TransposeFn transpose;
  MicroFn micro;
  ColumnDotsFn column_dots;
  DequantizedDotsFn dequantized_dots;  // column_dots' arithmetic from a dequantized column
  int nr;                              // panel width
};

GemmKernels SelectGemm(int32_t fmt) {
  GemmKernels g{DequantizerFor(fmt), TransposePanelScalar,  MicroKernelFor(IsaLevel::kScalar).fn,
                ColumnDotsScalar,    DequantizedDotsScalar, kNR};
#ifdef TUNIX_RT_X86
  if (isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c) {
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
    g = micro.nr == kMaxNR
            ? GemmKernels{g.deq, TransposePanelAvx2<kMaxNR>, micro.fn, kDots512[fmt], DequantizedDotsAvx512, kMaxNR}
            : GemmKernels{g.deq, TransposePanelAvx2<kNR>, micro.fn, kDots[fmt], DequantizedDotsAvx2, kNR};
  }
#endif
  return g;
}

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
// rows and unless `row_invariant`, from x packed by PackPanels. The column dots sum each row alone, in
// one order whatever M (past kGemvRows rows from the column dequantized once): the row-invariant route.
void GemmColumns(const Weights& w, const GemmKernels& g, const float* x, const float* xp_all, int64_t m, float* y,
                 int64_t c_begin, int64_t c_end, bool row_invariant) {
  const int64_t k = w.l.k, n = w.l.n;
  if (m == 0) return;  // the column dots dispatch on a row count of 1 to kGemvRows
  if (m <= kGemvRows || row_invariant) {
    const int64_t ahead = PrefetchAhead(w.l);
    PrefetchColumns(w, c_begin, ahead);
    if (m <= kGemvRows) {  // each column dequantized in registers
      std::vector<float> column(k);
      for (int64_t c = c_begin; c < c_end; ++c) {
        PrefetchColumns(w, c + ahead, 1);
        g.column_dots(w, c, x, m, column.data(), y, n);
      }
      return;
    }
    // kDequantizedColumns columns dequantized once, then dotted with every row, kGemvRows rows at a time:
    // those rows of x and the columns stay in L1 while they meet.
    std::vector<float> columns(kDequantizedColumns * k);
    for (int64_t c0 = c_begin; c0 < c_end; c0 += kDequantizedColumns) {
      const int64_t cols = std::min(kDequantizedColumns, c_end - c0);
      for (int64_t j = 0; j < cols; ++j) {
        PrefetchColumns(w, c0 + j + ahead, 1);
        g.deq(w, c0 + j, 0, k, columns.data() + j * k);
      }
      for (int64_t r0 = 0; r0 < m; r0 += kGemvRows)
        for (int64_t j = 0; j < cols; ++j)
          g.dequantized_dots(columns.data() + j * k, k, x + r0 * k, std::min(kGemvRows, m - r0), y + r0 * n + c0 + j,
                             n);
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

// ---- int8 GEMM with AVX-512 VNNI: M > kGemvRows ---------------------------------------------
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
constexpr int kLanes = 16;
constexpr int64_t kPanelBlocks = 8;  // 256-deep K panels (every int8 GEMM)

struct RowPackedActivations {
  int64_t m, nb, groups;     // rows, 32-blocks, groups of `lanes` rows
  std::vector<int8_t> x;     // [group][block][quad 8][lane][4]
  std::vector<int32_t> off;  // [group][block][lane]: -off * sum(xq)
  std::vector<float> d, s;   // [group][block][lane]: x block scale; exact block sum (formats with mins)
  int64_t at(int64_t g, int64_t b) const { return g * nb + b; }
};

#ifdef TUNIX_RT_X86

// x (M, K) quantized per 32-block by `quantize` (the tier's GEMV quantizes with the same function), rows
// packed `lanes` to a vector; `off` is the offset of the codes the kernel multiplies (0: none).
std::shared_ptr<RowPackedActivations> PackRows(const ffi::AnyBuffer& x, const Layout& l, int64_t lanes,
                                               BlockQuantizer quantize, int32_t off) {
  auto a = std::make_shared<RowPackedActivations>();
  const int64_t m = x.dimensions()[0], k = l.k, nb = k / kSub;
  a->m = m;
  a->nb = nb;
  a->groups = (m + lanes - 1) / lanes;
  a->x.assign(a->groups * nb * kSub * lanes, 0);
  a->off.assign(a->groups * nb * lanes, 0);
  a->d.assign(a->groups * nb * lanes, 0.0f);
  a->s.assign(l.f->has_min ? a->groups * nb * lanes : 0, 0.0f);
  const bool bf16 = x.element_type() == ffi::DataType::BF16;
  std::vector<float> scratch(k);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t g = r / lanes, lane = r % lanes;
    const float* row = RowAsF32(x.untyped_data(), bf16, r, k, scratch.data());
    for (int64_t b = 0; b < nb; ++b) {
      alignas(32) int8_t q[kSub];
      int32_t qsum;
      float sum_x;
      const float d = quantize(row + b * kSub, q, q + 16, &qsum, l.f->has_min ? &sum_x : nullptr);
      int8_t* dst = a->x.data() + a->at(g, b) * kSub * lanes + lane * 4;
      for (int quad = 0; quad < kSub / 4; ++quad) std::memcpy(dst + quad * lanes * 4, q + 4 * quad, 4);
      const int64_t v = a->at(g, b) * lanes + lane;
      a->off[v] = -off * qsum;
      a->d[v] = d;
      if (l.f->has_min) a->s[v] = sum_x;
    }
  }
  return a;
}

// acc[c * ld + g * 16 + lane] += row (g * 16 + lane) of x . column cols[c], over blocks [b0, b1).
template <int G, int C, int kBits, bool kHasMin, bool kF16>
VNNI_FN void VnniColumns(const Weights& w, const RowPackedActivations& a, int64_t g0, const int64_t* cols, int64_t b0,
                         int64_t b1, float* acc_out, int64_t ld) {
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
    asm volatile("" ::: "memory");  // codes are broadcast from memory (load ports), not shuffled from registers
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

// ---- int8 GEMM with AVX2 or AVX-VNNI: M > kGemvRows where AVX-512 VNNI is not --------------------
//
// The VNNI GEMM's scheme on 8 lanes (quant_int8_columns.inc, one copy per tier): rows ride in the lanes of
// x packed 4 k at a time, each weight column's 4 codes are broadcast. AVX2 multiplies with maddubs
// (u8 x s8 pairs into int16): 4-bit codes as stored (0..15), whose products over a whole block add in
// int16 (|lane| <= 16 * 15 * 127) before one madd into int32, minus 8 * sum(xq) from the lanes' start;
// 8-bit codes as |code| against x with the code's sign moved onto it (a pair's sum fits int16:
// 2 * 128 * 127 < 2^15), then madd into int32 every 4 k. AVX-VNNI's vpdpbusd sums into int32 directly
// (8-bit codes plus 128, as the VNNI GEMM). Every tier ends a block with the same exact integer dot, scaled
// as the VNNI GEMM and the AVX2 GEMV (quant_gemv.cc) scale it, so a row's result never depends on M.
constexpr int64_t kAvx2Lanes = 8;

#define INT8_COLUMNS_NAME Avx2Columns
#define INT8_COLUMNS_FN AVX2_F16C_FN
#define INT8_COLUMNS_VNNI 0
#include "quant_int8_columns.inc"
#undef INT8_COLUMNS_NAME
#undef INT8_COLUMNS_FN
#undef INT8_COLUMNS_VNNI

#define INT8_COLUMNS_NAME AvxVnniColumns
#define INT8_COLUMNS_FN AVX_VNNI_FN
#define INT8_COLUMNS_VNNI 1
#include "quant_int8_columns.inc"
#undef INT8_COLUMNS_NAME
#undef INT8_COLUMNS_FN
#undef INT8_COLUMNS_VNNI

using Int8ColumnsFn = void (*)(const Weights&, const RowPackedActivations&, int64_t, const int64_t*, int64_t, int64_t,
                               float*, int64_t);
// A tier's int8 GEMM: one call covers `cols` columns and two row groups (`pair`), or one (`single`, for
// an odd last group); `lanes` rows per group, x quantized by `quantize`, 8-bit codes offset by `off8`.
// AVX-512 VNNI: 8 int32 and 8 f32 accumulators plus the broadcast codes fit its 32 vector registers;
// AVX2: 8 integer accumulators, two x vectors and a broadcast fit its 16 (f32 sums go through L1).
struct Int8Kernel {
  const char* name;
  Int8ColumnsFn pair, single;
  int cols;
  int64_t lanes;
  BlockQuantizer quantize;
  int32_t off8;
};

// Two row groups by 4 columns per call, an odd last group alone; a single group takes 8 columns at a time.
Int8Kernel MakeInt8(const char* name, int64_t groups, Int8ColumnsFn pair4, Int8ColumnsFn single4, Int8ColumnsFn single8,
                    int64_t lanes, BlockQuantizer quantize, int32_t off8) {
  if (groups == 1) return {name, nullptr, single8, 8, lanes, quantize, off8};
  return {name, pair4, single4, 4, lanes, quantize, off8};
}

template <int kBits, bool kHasMin, bool kF16>
Int8Kernel VnniFor(int64_t groups) {
  return MakeInt8("avx512-vnni", groups, VnniColumns<2, 4, kBits, kHasMin, kF16>,
                  VnniColumns<1, 4, kBits, kHasMin, kF16>, VnniColumns<1, 8, kBits, kHasMin, kF16>, kLanes,
                  QuantizeBlockAvx512, 128);
}

template <int kBits, bool kHasMin, bool kF16>
Int8Kernel Avx2For(int64_t groups) {
  if (HasAvxVnni())
    return MakeInt8("avx-vnni", groups, AvxVnniColumns<2, 4, kBits, kHasMin, kF16>,
                    AvxVnniColumns<1, 4, kBits, kHasMin, kF16>, AvxVnniColumns<1, 8, kBits, kHasMin, kF16>, kAvx2Lanes,
                    QuantizeBlockAvx2, 128);
  return MakeInt8("avx2", groups, Avx2Columns<2, 4, kBits, kHasMin, kF16>, Avx2Columns<1, 4, kBits, kHasMin, kF16>,
                  Avx2Columns<1, 8, kBits, kHasMin, kF16>, kAvx2Lanes, QuantizeBlockAvx2, 0);
}

// The int8 GEMM kernel of a format for the detected tier (groups: of the tier's lanes, over M rows).
Int8Kernel SelectInt8(int32_t fmt, int64_t m) {
  const bool vnni = HasVnni();
  const int64_t groups = (m + (vnni ? kLanes : kAvx2Lanes) - 1) / (vnni ? kLanes : kAvx2Lanes);
  switch (fmt) {
    case 0: return vnni ? VnniFor<8, false, true>(groups) : Avx2For<8, false, true>(groups);     // q8_0
    case 1: return vnni ? VnniFor<4, false, true>(groups) : Avx2For<4, false, true>(groups);     // q4_0
    case 2: return vnni ? VnniFor<4, true, true>(groups) : Avx2For<4, true, true>(groups);       // q4_1
    case 3: return vnni ? VnniFor<8, false, false>(groups) : Avx2For<8, false, false>(groups);   // int8
    default: return vnni ? VnniFor<4, false, false>(groups) : Avx2For<4, false, false>(groups);  // int4
  }
}
#endif

}  // namespace

const char* Int8GemmName(int32_t fmt) {
#ifdef TUNIX_RT_X86
  if (HasInt8Gemm()) return SelectInt8(fmt, kGemvRows + 1).name;
#endif
  return "none";
}

DequantFn DequantizerFor(int32_t fmt) {
#ifdef TUNIX_RT_X86
  if (isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c) {
    static constexpr DequantFn kDeq[kNumFormats] = {
        DequantizeRangeAvx2<8, false, false, true>, DequantizeRangeAvx2<4, true, false, true>,
        DequantizeRangeAvx2<4, false, true, true>,  DequantizeRangeAvx2<8, false, false, false>,
        DequantizeRangeAvx2<4, true, false, false>,
    };
    return kDeq[fmt];
  }
#endif
  return DequantizeRange;
}

ffi::Future QuantGemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y,
                      bool row_invariant) {
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
  const GemmKernels kernels = SelectGemm(w.l.format_id());
  const bool panels = m > kGemvRows && !row_invariant;
  auto xp = std::make_shared<std::vector<float>>(panels ? PackPanels(xf, m, k) : std::vector<float>());
  const int64_t nr = kernels.nr, col_tiles = (n + nr - 1) / nr;
  const int64_t chunks = NumChunks(pool, col_tiles, std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, m * k * nr)));
  return ParallelFor(pool, col_tiles, chunks, [=](int64_t, int64_t begin, int64_t end) {
    const int64_t c_begin = begin * nr, c_end = std::min(n, end * nr);
    for (int64_t r = 0; r < m; ++r) std::fill(yf + r * n + c_begin, yf + r * n + c_end, 0.0f);
    GemmColumns(w, kernels, xf, xp->data(), m, yf, c_begin, c_end, row_invariant);
    if (y_bf16)
      for (int64_t r = 0; r < m; ++r)
        for (int64_t c = c_begin; c < c_end; ++c) y_bf16[r * n + c] = F32ToBf16(yf[r * n + c]);
    (void)x_copy;  // keeps the bf16 conversions and the packed x alive until every task is done
    (void)y_copy;
    (void)xp;
    return ffi::Error::Success();
  });
}

#ifdef TUNIX_RT_X86
ffi::Future Int8Gemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y) {
  const Int8Kernel kernel = SelectInt8(w.l.format_id(), x.dimensions()[0]);
  const std::shared_ptr<RowPackedActivations> a = PackRows(x, w.l, kernel.lanes, kernel.quantize,
                                                           w.l.f->bits == 8 ? kernel.off8 : 8);
  const int64_t n = w.l.n, m = a->m, ld = a->groups * kernel.lanes, nb = a->nb;
  void* out = y.untyped_data();
  const bool out_bf16 = y.element_type() == ffi::DataType::BF16;
  const int64_t tiles = (n + kernel.cols - 1) / kernel.cols;
  const int64_t work_per_tile = std::max<int64_t>(1, ld * w.l.k * kernel.cols);
  const int64_t chunks = NumChunks(pool, tiles, std::max<int64_t>(1, (1 << 18) / work_per_tile));
  return ParallelFor(pool, tiles, chunks, [=](int64_t, int64_t begin, int64_t end) {
    const int64_t c_begin = begin * kernel.cols, c_end = std::min(n, end * kernel.cols);
    std::vector<float> acc((end - begin) * kernel.cols * ld, 0.0f);
    int64_t cols[8];
    for (int64_t p0 = 0; p0 < nb; p0 += kPanelBlocks) {
      const int64_t p1 = std::min(nb, p0 + kPanelBlocks);
      for (int64_t t = begin; t < end; ++t) {
        // a short last tile repeats its last column (into scratch columns nobody reads)
        for (int c = 0; c < kernel.cols; ++c) cols[c] = std::min(n - 1, t * kernel.cols + c);
        float* tile = acc.data() + (t - begin) * kernel.cols * ld;
        int64_t g = 0;
        for (; g + 2 <= a->groups; g += 2) kernel.pair(w, *a, g, cols, p0, p1, tile, ld);
        if (g < a->groups) kernel.single(w, *a, g, cols, p0, p1, tile, ld);
      }
    }
    // acc is column-major (ld rows a column): kAvx2Lanes rows at a time, each column's values for them are one
    // contiguous read and the rows' output lines fill in order (row by row, the reads strode ld floats apart)
    for (int64_t r0 = 0; r0 < m; r0 += kAvx2Lanes) {
      const int64_t rows = std::min(kAvx2Lanes, m - r0);
      for (int64_t c = c_begin; c < c_end; ++c) {
        const float* v = acc.data() + (c - c_begin) * ld + r0;
        for (int64_t i = 0; i < rows; ++i) {
          if (out_bf16) {
            static_cast<uint16_t*>(out)[(r0 + i) * n + c] = F32ToBf16(v[i]);
          } else {
            static_cast<float*>(out)[(r0 + i) * n + c] = v[i];
          }
        }
      }
    }
    (void)a;  // keeps the packed activations alive until every task is done
    return ffi::Error::Success();
  });
}
#endif

}  // namespace quant
}  // namespace tunix_rt
