// bf16 matmul with f32 accumulation: C = op(A) @ op(B), op = identity or transpose, for the linear
// layers of bf16-compute training (forward, and both backward products through the transposes).
// The "plus" form adds a second product, C = op(A) @ op(B) + U @ op(V), in the same sums: a LoRA layer's
// low-rank path (U = s x A, V = B forward; U = s dy B^T, V = A^T for dx) rides along as R more k, so
// neither its (M, N) product nor the add of two bf16 results is ever written.
//
// With AVX-512 BF16, vdpbf16ps adds two bf16 products into each f32 lane: B is packed into 32-column
// panels whose consecutive k pairs sit side by side (one 64-byte load = 16 columns x 2 k), A into
// 6-row tiles of k pairs (one 32-bit broadcast per row and pair), and a 6 x 32 tile of f32 sums lives
// in 12 registers across a 256-deep K slab. Without it the operands are widened to f32 once and run
// through the shared f32 GEMM (gemm_f32.h). Products of bf16 values are exact in f32, so both tiers differ
// only in summation order. The output is f32 or bf16 (rounded to nearest even once, at the end).
// f32 operands run the shared f32 GEMM in place (f32 output): the engine's products of f32 weights.
//
// Every output element is one chain of multiply-adds over a K slab whose depth depends on K alone,
// added slab after slab into a zeroed sum: no step depends on M, on the work partition or on the
// other rows, so a row's result is the same in a batch of one and of many (the engine's batch
// invariance rests on it).
#include <algorithm>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "gemm_f32.h"
#include "parallel.h"

#include "isa.h"

namespace tunix_rt {
namespace {

// A bf16 matrix element (i, j) = data[i * row_stride + j * col_stride].
struct Bf16Matrix {
  const uint16_t* data;
  int64_t row_stride, col_stride;
};

constexpr int64_t kSlabK = 512;         // k per packed slab (even)
constexpr int64_t kBlockRows = 192;     // most rows per work item (a multiple of kMR)
constexpr int64_t kBlockCols = 256;     // most columns per work item (a multiple of kMaxNR)
constexpr int64_t kItemsPerWorker = 8;  // work items wanted per worker: equal items claimed one at a
                                        // time leave no worker idle for long

// A row-major with even k is read in place by the micro-kernel: its k pairs are aligned 32-bit words.
bool ReadsAInPlace(Bf16Matrix a) { return a.col_stride == 1 && a.row_stride % 2 == 0; }

struct Partition {
  int64_t block_rows, block_cols;
};

// Work items of at most kBlockRows x kBlockCols, about kItemsPerWorker per worker, cut where the
// packing they repeat is least: every row block packs all of B (a gather costs twice an interleave
// when B is transposed), every column block packs all of A unless A is read in place.
Partition ChoosePartition(int64_t m, int64_t n, int64_t workers, bool packs_a, bool gathers_b) {
  const int64_t tiles = (m + kMR - 1) / kMR, wanted = kItemsPerWorker * workers;
  Partition best{0, 0};
  double best_cost = 0;
  for (int64_t cols = kBlockCols; cols >= kMaxNR; cols /= 2) {
    const int64_t col_blocks = (n + cols - 1) / cols;
    const int64_t row_blocks = std::min(
        tiles, std::max((m + kBlockRows - 1) / kBlockRows, (wanted + col_blocks - 1) / col_blocks));
    const double cost = double(row_blocks) * n * (gathers_b ? 2 : 1) + (packs_a ? double(col_blocks) * m : 0.0);
    if (best.block_cols == 0 || cost < best_cost) {
      best = {kMR * ((tiles + row_blocks - 1) / row_blocks), cols};
      best_cost = cost;
    }
  }
  return best;
}

#ifdef TUNIX_RT_X86

// out[2i], out[2i + 1] = lo[i], hi[i] for i < width (<= 32): two bf16 rows interleaved into k pairs
// (hi null: zeros). With `pad`, all 32 pairs are written, zero past width.
BF16_FN void InterleaveRows(const uint16_t* lo, const uint16_t* hi, int width, uint32_t* out, bool pad) {
  const __mmask32 mask = static_cast<__mmask32>(width >= 32 ? ~0u : (1u << width) - 1u);
  const __m512i a = _mm512_maskz_loadu_epi16(mask, lo);
  const __m512i b = hi ? _mm512_maskz_loadu_epi16(mask, hi) : _mm512_setzero_si512();
  alignas(64) static constexpr uint16_t kFirst[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kSecond[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                       24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i first = _mm512_permutex2var_epi16(a, _mm512_load_si512(kFirst), b);
  const __m512i second = _mm512_permutex2var_epi16(a, _mm512_load_si512(kSecond), b);
  const __mmask16 m0 = pad ? 0xffff : static_cast<__mmask16>((1u << std::clamp(width, 0, 16)) - 1u);
  const __mmask16 m1 = pad ? 0xffff : static_cast<__mmask16>((1u << std::clamp(width - 16, 0, 16)) - 1u);
  _mm512_mask_storeu_epi32(out, m0, first);
  _mm512_mask_storeu_epi32(out + 16, m1, second);
}

// A rows [r0, r0 + rows) x k [k0, k0 + kk) as k pairs, pair-major: out[q * rows + r] holds
// (A[r, 2q], A[r, 2q + 1]), the second zero past kk.
BF16_FN void PackPairsA(Bf16Matrix a, int64_t r0, int64_t rows, int64_t k0, int64_t kk, uint32_t* out) {
  const int64_t pairs = (kk + 1) / 2;
  if (a.row_stride == 1) {  // A transposed: each k is a contiguous run of rows
    for (int64_t q = 0; q < pairs; ++q) {
      const uint16_t* lo = a.data + r0 + (k0 + 2 * q) * a.col_stride;
      const uint16_t* hi = 2 * q + 1 < kk ? lo + a.col_stride : nullptr;
      for (int64_t i = 0; i < rows; i += 32)
        InterleaveRows(lo + i, hi ? hi + i : nullptr, static_cast<int>(std::min<int64_t>(32, rows - i)),
                       out + q * rows + i, false);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = a.data + (r0 + r) * a.row_stride + k0 * a.col_stride;
    for (int64_t q = 0; q < pairs; ++q) {
      const uint32_t lo = src[2 * q * a.col_stride];
      const uint32_t hi = 2 * q + 1 < kk ? src[(2 * q + 1) * a.col_stride] : 0;
      out[q * rows + r] = lo | hi << 16;
    }
  }
}

// B k [k0, k0 + kk) x columns [c0, c0 + cols) as 32-column panels of k pairs: panel s, pair q,
// column j holds (B[2q, j], B[2q + 1, j]) at out[(s * pairs + q) * 32 + j]; padding is zero.
BF16_FN void PackPairsB(Bf16Matrix b, int64_t k0, int64_t kk, int64_t c0, int64_t cols, uint32_t* out) {
  const int64_t pairs = (kk + 1) / 2, panels = (cols + kMaxNR - 1) / kMaxNR;
  for (int64_t s = 0; s < panels; ++s) {
    const int width = static_cast<int>(std::min<int64_t>(kMaxNR, cols - s * kMaxNR));
    uint32_t* panel = out + s * pairs * kMaxNR;
    const uint16_t* base = b.data + k0 * b.row_stride + (c0 + s * kMaxNR) * b.col_stride;
    if (b.col_stride == 1) {  // row-major B: interleave rows 2q and 2q + 1
      for (int64_t q = 0; q < pairs; ++q)
        InterleaveRows(base + 2 * q * b.row_stride, 2 * q + 1 < kk ? base + (2 * q + 1) * b.row_stride : nullptr, width,
                       panel + q * kMaxNR, true);
      continue;
    }
    // B transposed (row_stride 1): a pair is one 32-bit word of a column, gathered 16 columns at a time.
    const int64_t full = kk / 2;
    const __m512i step = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int32_t>(b.col_stride * 2)));
    for (int half = 0; half < 2; ++half) {
      const __mmask16 mask = static_cast<__mmask16>((1u << std::clamp(width - 16 * half, 0, 16)) - 1u);
      const uint16_t* col = base + 16 * half * b.col_stride;
      for (int64_t q = 0; q < full; ++q)
        _mm512_storeu_si512(panel + q * kMaxNR + 16 * half,
                            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, step, col + 2 * q, 1));
    }
    if (kk & 1)
      for (int j = 0; j < kMaxNR; ++j) panel[full * kMaxNR + j] = j < width ? base[j * b.col_stride + (kk - 1)] : 0;
  }
}

// c (R x cols, row stride ldc) += A tile x B panel over `pairs` k pairs; A's pair q of row r is the
// word a[r * a_row + q * a_pair].
template <int R>
BF16_FN void MicroBf16(const uint32_t* a, int64_t a_row, int64_t a_pair, const uint32_t* bp, int64_t pairs, float* c,
                       int64_t ldc, int cols) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  const uint32_t* a0 = a;
  const uint32_t* a1 = a + a_row;
  const uint32_t* a2 = a + 2 * a_row;
  const uint32_t* a3 = a + 3 * a_row;
  const uint32_t* a4 = a + 4 * a_row;
  const uint32_t* a5 = a + 5 * a_row;
  for (int64_t q = 0, off = 0; q < pairs; ++q, off += a_pair) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + q * kMaxNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + q * kMaxNR + 16);
#define TUNIX_RT_ROW(r, lo, hi)                                                   \
  {                                                                               \
    const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a##r[off])); \
    lo = _mm512_dpbf16_ps(lo, ar, b0);                                            \
    hi = _mm512_dpbf16_ps(hi, ar, b1);                                            \
  }
    TUNIX_RT_MICRO_ROWS(R, TUNIX_RT_ROW)
#undef TUNIX_RT_ROW
  }
  const __m512 acc[kMR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  const __mmask16 lo = static_cast<__mmask16>((1u << std::clamp(cols, 0, 16)) - 1u);
  const __mmask16 hi = static_cast<__mmask16>((1u << std::clamp(cols - 16, 0, 16)) - 1u);
  for (int r = 0; r < R; ++r) {
    float* out = c + r * ldc;
    _mm512_mask_storeu_ps(out, lo, _mm512_add_ps(_mm512_maskz_loadu_ps(lo, out), acc[r][0]));
    _mm512_mask_storeu_ps(out + 16, hi, _mm512_add_ps(_mm512_maskz_loadu_ps(hi, out + 16), acc[r][1]));
  }
}

// c (rows x cols, row stride ldc) += rows [r0, r0 + rows) x columns [c0, c0 + cols) of A @ B, in k slabs.
// A row-major with even k is read in place (its k pairs are 32-bit words); otherwise it is packed.
void AccumulateBf16(Bf16Matrix a, Bf16Matrix b, int64_t r0, int64_t rows, int64_t c0, int64_t cols, int64_t k, float* c,
                    int64_t ldc) {
  if (k == 0) return;
  using Micro = void (*)(const uint32_t*, int64_t, int64_t, const uint32_t*, int64_t, float*, int64_t, int);
  static constexpr Micro kTable[kMR] = {MicroBf16<1>, MicroBf16<2>, MicroBf16<3>,
                                        MicroBf16<4>, MicroBf16<5>, MicroBf16<6>};
  const bool a_in_place = ReadsAInPlace(a);
  const int64_t tiles = (rows + kMR - 1) / kMR, panels = (cols + kMaxNR - 1) / kMaxNR;
  // Per-thread scratch, reused across calls: packing never waits on the allocator.
  thread_local std::vector<uint32_t> ap, bp;
  if (!a_in_place && ap.size() < static_cast<size_t>(rows * (kSlabK / 2))) ap.resize(rows * (kSlabK / 2));
  if (bp.size() < static_cast<size_t>(panels * (kSlabK / 2) * kMaxNR)) bp.resize(panels * (kSlabK / 2) * kMaxNR);
  // Slabs of equal even depth (at most kSlabK): K = 576 runs as 3 x 192, not 256 + 256 + 64.
  const int64_t slabs = (k + kSlabK - 1) / kSlabK, depth = 2 * ((k + 2 * slabs - 1) / (2 * slabs));
  for (int64_t k0 = 0; k0 < k; k0 += depth) {
    const int64_t kk = std::min(depth, k - k0), pairs = (kk + 1) / 2;
    PackPairsB(b, k0, kk, c0, cols, bp.data());
    const uint32_t* a_words;
    int64_t a_row, a_pair;
    if (a_in_place) {
      a_words = reinterpret_cast<const uint32_t*>(a.data + r0 * a.row_stride + k0);
      a_row = a.row_stride / 2;
      a_pair = 1;
    } else {
      PackPairsA(a, r0, rows, k0, kk, ap.data());
      a_words = ap.data();
      a_row = 1;
      a_pair = rows;
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kMR, rows - t * kMR));
      for (int64_t s = 0; s < panels; ++s)
        kTable[tile_rows - 1](a_words + t * kMR * a_row, a_row, a_pair, bp.data() + s * pairs * kMaxNR, pairs,
                              c + t * kMR * ldc + s * kMaxNR, ldc,
                              static_cast<int>(std::min<int64_t>(kMaxNR, cols - s * kMaxNR)));
    }
  }
}

// dst[j] = bf16(src[j]) for j < count, rounded as F32ToBf16 rounds (to nearest even; NaN stays NaN).
BF16_FN void RoundToBf16(const float* src, int64_t count, uint16_t* dst) {
  int64_t j = 0;
  for (; j + 16 <= count; j += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(src + j));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(r));
  }
  for (; j < count; ++j) dst[j] = F32ToBf16(src[j]);
}
#endif

bool HasBf16Kernels() {
#ifdef TUNIX_RT_X86
  return isa_level() >= IsaLevel::kAvx512 && cpu_features().avx512bf16;
#else
  return false;
#endif
}

// The second product of the "plus" form, C = op(A) @ op(B) + U @ op(V): U (M, R) row-major, V (R, N) or,
// with transpose_v, (N, R). LoRA's low-rank path rides along as R more k after A @ B's (R = 0: none).
struct Extra {
  const void* u = nullptr;
  const void* v = nullptr;
  int64_t r = 0;
  bool transpose_v = false;
};

// a (M, K) or, with transpose_a, (K, M); b (K, N) or, with transpose_b, (N, K); both bf16 (c (M, N) f32
// or bf16) or both f32 (c f32). b may be a stack (S, ...) of such weights: its layer `layer` is read in place.
// Each output is A @ B's k slabs, then the extra product's, summed in one f32 chain and rounded once.
ffi::Future Bf16MatmulImpl(const char* op, ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, int32_t at,
                           Extra extra, ffi::Result<ffi::AnyBuffer> c, bool transpose_a, bool transpose_b) {
  const Stack s = b.dimensions().size() == 3 ? Stack{true, b.dimensions()[0]} : Stack{};
  ffi::Span<const int64_t> bd;
  const auto ad = a.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || !LayerDims(b, s, &bd) || bd.size() != 2 || cd.size() != 2)
    return ReadyFuture(InvalidArgument(std::string(op) + ": operands must be 2-D (b may be a stack (S, ...) of them)"));
  if (ffi::Error e = CheckLayer(op, at, s); !e.success()) return ReadyFuture(e);
  const bool f32 = a.element_type() == ffi::DataType::F32;
  if ((!f32 && a.element_type() != ffi::DataType::BF16) || b.element_type() != a.element_type() ||
      !IsF32OrBf16(c->element_type()) || (f32 && c->element_type() != ffi::DataType::F32))
    return ReadyFuture(
        InvalidArgument(std::string(op) + ": operands must be both bf16 (f32 or bf16 result) or both f32"));
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t n = transpose_b ? bd[0] : bd[1], kb = transpose_b ? bd[1] : bd[0];
  if (kb != k || cd[0] != m || cd[1] != n)
    return ReadyFuture(InvalidArgument(std::string(op) + ": shapes do not agree"));
  const int64_t r = extra.r;
  const uint16_t* ap = static_cast<const uint16_t*>(a.untyped_data());
  const uint16_t* bp = static_cast<const uint16_t*>(LayerData(b, s, at));
  const uint16_t* up = static_cast<const uint16_t*>(extra.u);
  const uint16_t* vp = static_cast<const uint16_t*>(extra.v);
  const Bf16Matrix am = transpose_a ? Bf16Matrix{ap, 1, m} : Bf16Matrix{ap, k, 1};
  const Bf16Matrix bm = transpose_b ? Bf16Matrix{bp, 1, k} : Bf16Matrix{bp, n, 1};
  const Bf16Matrix um{up, r, 1};
  const Bf16Matrix vm = extra.transpose_v ? Bf16Matrix{vp, 1, r} : Bf16Matrix{vp, n, 1};
  const bool out_f32 = c->element_type() == ffi::DataType::F32;
  float* cf = out_f32 ? static_cast<float*>(c->untyped_data()) : nullptr;
  uint16_t* c16 = out_f32 ? nullptr : static_cast<uint16_t*>(c->untyped_data());
  // Without BF16 kernels bf16 operands are widened once and every block runs the f32 GEMM on them.
  const bool bf16_kernels = !f32 && HasBf16Kernels();
  std::shared_ptr<std::vector<float>> af, bf, uf, vf;
  const float* a32 = static_cast<const float*>(a.untyped_data());
  const float* b32 = static_cast<const float*>(LayerData(b, s, at));
  const float* u32 = static_cast<const float*>(extra.u);
  const float* v32 = static_cast<const float*>(extra.v);
  if (!f32 && !bf16_kernels) {
    af = WidenBf16(ap, a.element_count());
    bf = WidenBf16(bp, b.element_count() / s.depth);
    a32 = af->data();
    b32 = bf->data();
    if (r > 0) {
      uf = WidenBf16(up, m * r);
      vf = WidenBf16(vp, r * n);
      u32 = uf->data();
      v32 = vf->data();
    }
  }
  if (k == 0 && r == 0) {
    if (cf) std::fill(cf, cf + m * n, 0.0f);
    if (c16) std::fill(c16, c16 + m * n, 0);
    return ReadyFuture(ffi::Error::Success());
  }
  const Partition part = ChoosePartition(m, n, Workers(pool), bf16_kernels && !ReadsAInPlace(am),
                                         bf16_kernels && bm.col_stride != 1);
  const int64_t block_rows = part.block_rows, block_cols = part.block_cols;
  const int64_t col_blocks = (n + block_cols - 1) / block_cols,
                items = ((m + block_rows - 1) / block_rows) * col_blocks;
  return ParallelFor(pool, items, items, [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = (i / col_blocks) * block_rows, c0 = (i % col_blocks) * block_cols;
      const int64_t rows = std::min(block_rows, m - r0), cols = std::min(block_cols, n - c0);
      // An f32 result is summed in place; a bf16 one in a per-thread block, rounded once at the end.
      thread_local std::vector<float> sums;
      if (c16 && sums.size() < static_cast<size_t>(rows * cols)) sums.resize(rows * cols);
      float* block = c16 ? sums.data() : cf + r0 * n + c0;
      const int64_t ldc = c16 ? cols : n;
      for (int64_t row = 0; row < rows; ++row) std::fill(block + row * ldc, block + row * ldc + cols, 0.0f);
      if (bf16_kernels) {
#ifdef TUNIX_RT_X86
        AccumulateBf16(am, bm, r0, rows, c0, cols, k, block, ldc);
        AccumulateBf16(um, vm, r0, rows, c0, cols, r, block, ldc);
#endif
      } else {
        GemmAccumulate({a32 + r0 * am.row_stride, am.row_stride, am.col_stride},
                       {b32 + c0 * bm.col_stride, bm.row_stride, bm.col_stride}, rows, cols, k, block, ldc);
        if (r > 0)
          GemmAccumulate({u32 + r0 * r, r, 1}, {v32 + c0 * vm.col_stride, vm.row_stride, vm.col_stride}, rows, cols, r,
                         block, ldc);
      }
      if (c16)
        for (int64_t row = 0; row < rows; ++row) {
#ifdef TUNIX_RT_X86
          if (bf16_kernels) {
            RoundToBf16(block + row * ldc, cols, c16 + (r0 + row) * n + c0);
            continue;
          }
#endif
          for (int64_t j = 0; j < cols; ++j) c16[(r0 + row) * n + c0 + j] = F32ToBf16(block[row * ldc + j]);
        }
    }
    (void)af;
    (void)bf;
    (void)uf;
    (void)vf;
    return ffi::Error::Success();
  });
}

ffi::Future Bf16Matmul(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::BufferR0<ffi::S32> layer,
                       ffi::Result<ffi::AnyBuffer> c, bool transpose_a, bool transpose_b) {
  return Bf16MatmulImpl("bf16_matmul", pool, a, b, layer.typed_data()[0], Extra{}, c, transpose_a, transpose_b);
}

// op(a) @ op(b) + u @ op(v): u (M, R), v (R, N) or, with transpose_v, (N, R), of a's element type.
ffi::Future Bf16MatmulPlus(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer u, ffi::AnyBuffer v,
                           ffi::Result<ffi::AnyBuffer> c, bool transpose_a, bool transpose_b, bool transpose_v) {
  const auto ud = u.dimensions(), vd = v.dimensions(), cd = c->dimensions();
  if (b.dimensions().size() != 2 || ud.size() != 2 || vd.size() != 2 || cd.size() != 2)
    return ReadyFuture(InvalidArgument("bf16_matmul_plus: b, u and v must be 2-D (no stack of b)"));
  if (u.element_type() != a.element_type() || v.element_type() != a.element_type())
    return ReadyFuture(InvalidArgument("bf16_matmul_plus: u and v must have a's element type"));
  const int64_t r = ud[1], vr = transpose_v ? vd[1] : vd[0], vn = transpose_v ? vd[0] : vd[1];
  if (ud[0] != cd[0] || vr != r || vn != cd[1])
    return ReadyFuture(InvalidArgument("bf16_matmul_plus: u (M, R) and v (R, N) do not agree with the result"));
  return Bf16MatmulImpl("bf16_matmul_plus", pool, a, b, 0, Extra{u.untyped_data(), v.untyped_data(), r, transpose_v}, c,
                        transpose_a, transpose_b);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulHandler, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulPlusHandler, Bf16MatmulPlus,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b")
                                  .Attr<bool>("transpose_v"));

}  // namespace tunix_rt
