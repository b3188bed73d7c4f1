// bf16 matmul with f32 accumulation: C = op(A) @ op(B), op = identity or transpose, for the linear
// layers of bf16-compute training (forward, and both backward products through the transposes).
//
// With AVX-512 BF16, vdpbf16ps adds two bf16 products into each f32 lane: B is packed into 32-column
// panels whose consecutive k pairs sit side by side (one 64-byte load = 16 columns x 2 k), A into
// 6-row tiles of k pairs (one 32-bit broadcast per row and pair), and a 6 x 32 tile of f32 sums lives
// in 12 registers across a 256-deep K slab. Without it the operands are widened to f32 once and run
// through the shared f32 GEMM (gemm_f32.h). Products of bf16 values are exact in f32, so both tiers differ
// only in summation order. The output is f32 or bf16 (rounded to nearest even once, at the end).
#include <algorithm>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "gemm_f32.h"
#include "parallel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TUNIX_RT_X86 1
#endif

namespace tunix_rt {
namespace {

// A bf16 matrix element (i, j) = data[i * row_stride + j * col_stride].
struct Bf16Matrix {
  const uint16_t* data;
  int64_t row_stride, col_stride;
};

constexpr int64_t kSlabK = 256;       // k per packed slab (even)
constexpr int64_t kBlockRows = 192;   // rows per work item (a multiple of kMR)
constexpr int64_t kBlockCols = 256;   // columns per work item (a multiple of kMaxNR)

#ifdef TUNIX_RT_X86
#define BF16_FN __attribute__((target("avx512f,avx512bw,avx512bf16")))

// A rows [r0, r0 + rows) x k [k0, k0 + kk) as kMR-row tiles of k pairs: tile t, pair q, row r holds
// (A[r, 2q], A[r, 2q + 1]) at out[((t * pairs + q) * kMR + r) * 2]; padding is zero.
void PackPairsA(Bf16Matrix a, int64_t r0, int64_t rows, int64_t k0, int64_t kk, uint16_t* out) {
  const int64_t pairs = (kk + 1) / 2, tiles = (rows + kMR - 1) / kMR;
  if (kk & 1 || rows % kMR) std::fill(out, out + tiles * pairs * kMR * 2, 0);
  for (int64_t i = 0; i < rows; ++i) {
    uint16_t* dst = out + (i / kMR) * pairs * kMR * 2 + (i % kMR) * 2;
    const uint16_t* src = a.data + (r0 + i) * a.row_stride + k0 * a.col_stride;
    for (int64_t p = 0; p + 1 < kk; p += 2, dst += kMR * 2) {
      dst[0] = src[p * a.col_stride];
      dst[1] = src[(p + 1) * a.col_stride];
    }
    if (kk & 1) dst[0] = src[(kk - 1) * a.col_stride];
  }
}

// B k [k0, k0 + kk) x columns [c0, c0 + cols) as 32-column panels of k pairs: panel s, pair q,
// column j holds (B[2q, j], B[2q + 1, j]) at out[((s * pairs + q) * 32 + j) * 2].
void PackPairsB(Bf16Matrix b, int64_t k0, int64_t kk, int64_t c0, int64_t cols, uint16_t* out) {
  const int64_t pairs = (kk + 1) / 2, panels = (cols + kMaxNR - 1) / kMaxNR;
  if (kk & 1 || cols % kMaxNR) std::fill(out, out + panels * pairs * kMaxNR * 2, 0);
  for (int64_t s = 0; s < panels; ++s) {
    const int64_t width = std::min<int64_t>(kMaxNR, cols - s * kMaxNR);
    uint16_t* panel = out + s * pairs * kMaxNR * 2;
    for (int64_t p = 0; p < kk; ++p) {
      const uint16_t* src = b.data + (k0 + p) * b.row_stride + (c0 + s * kMaxNR) * b.col_stride;
      uint16_t* dst = panel + (p / 2) * kMaxNR * 2 + (p & 1);
      for (int64_t j = 0; j < width; ++j) dst[j * 2] = src[j * b.col_stride];
    }
  }
}

template <int R>
BF16_FN void MicroBf16(const uint16_t* ap, const uint16_t* bp, int64_t pairs, float* c, int64_t ldc, int cols) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp + q * kMaxNR * 2);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bp + q * kMaxNR * 2 + 32);
    const int32_t* a = reinterpret_cast<const int32_t*>(ap + q * kMR * 2);
#define TUNIX_RT_ROW(r, lo, hi)                                   \
  if constexpr (R > r) {                                          \
    const __m512bh ar = (__m512bh)_mm512_set1_epi32(a[r]);        \
    lo = _mm512_dpbf16_ps(lo, ar, b0);                            \
    hi = _mm512_dpbf16_ps(hi, ar, b1);                            \
  }
    TUNIX_RT_ROW(0, c00, c01)
    TUNIX_RT_ROW(1, c10, c11)
    TUNIX_RT_ROW(2, c20, c21)
    TUNIX_RT_ROW(3, c30, c31)
    TUNIX_RT_ROW(4, c40, c41)
    TUNIX_RT_ROW(5, c50, c51)
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

void BlockBf16(Bf16Matrix a, Bf16Matrix b, int64_t r0, int64_t rows, int64_t c0, int64_t cols, int64_t k, float* c,
               int64_t n) {
  using Micro = void (*)(const uint16_t*, const uint16_t*, int64_t, float*, int64_t, int);
  static constexpr Micro kTable[kMR] = {MicroBf16<1>, MicroBf16<2>, MicroBf16<3>,
                                        MicroBf16<4>, MicroBf16<5>, MicroBf16<6>};
  const int64_t tiles = (rows + kMR - 1) / kMR, panels = (cols + kMaxNR - 1) / kMaxNR;
  std::vector<uint16_t> ap(tiles * (kSlabK / 2) * kMR * 2), bp(panels * (kSlabK / 2) * kMaxNR * 2);
  for (int64_t i = 0; i < rows; ++i) std::fill(c + (r0 + i) * n + c0, c + (r0 + i) * n + c0 + cols, 0.0f);
  for (int64_t k0 = 0; k0 < k; k0 += kSlabK) {
    const int64_t kk = std::min(kSlabK, k - k0), pairs = (kk + 1) / 2;
    PackPairsA(a, r0, rows, k0, kk, ap.data());
    PackPairsB(b, k0, kk, c0, cols, bp.data());
    for (int64_t t = 0; t < tiles; ++t) {
      const int tile_rows = static_cast<int>(std::min<int64_t>(kMR, rows - t * kMR));
      for (int64_t s = 0; s < panels; ++s)
        kTable[tile_rows - 1](ap.data() + t * pairs * kMR * 2, bp.data() + s * pairs * kMaxNR * 2, pairs,
                              c + (r0 + t * kMR) * n + c0 + s * kMaxNR, n,
                              static_cast<int>(std::min<int64_t>(kMaxNR, cols - s * kMaxNR)));
    }
  }
}
#endif

bool HasBf16Kernels() {
#ifdef TUNIX_RT_X86
  return isa_level() >= IsaLevel::kAvx512 && cpu_features().avx512bf16;
#else
  return false;
#endif
}

// a (M, K) or, with transpose_a, (K, M); b (K, N) or, with transpose_b, (N, K); c (M, N) f32 or bf16.
ffi::Future Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> a, ffi::Buffer<ffi::BF16> b,
                       ffi::Result<ffi::AnyBuffer> c, bool transpose_a, bool transpose_b) {
  const auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ReadyFuture(InvalidArgument("bf16_matmul: operands must be 2-D"));
  const int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  const int64_t n = transpose_b ? bd[0] : bd[1], kb = transpose_b ? bd[1] : bd[0];
  if (kb != k || cd[0] != m || cd[1] != n) return ReadyFuture(InvalidArgument("bf16_matmul: shapes do not agree"));
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(a.typed_data());
  const uint16_t* bp = reinterpret_cast<const uint16_t*>(b.typed_data());
  const Bf16Matrix am = transpose_a ? Bf16Matrix{ap, 1, m} : Bf16Matrix{ap, k, 1};
  const Bf16Matrix bm = transpose_b ? Bf16Matrix{bp, 1, k} : Bf16Matrix{bp, n, 1};
  const bool out_f32 = c->element_type() == ffi::DataType::F32;
  auto scratch = std::make_shared<std::vector<float>>(out_f32 ? 0 : m * n);
  float* cf = out_f32 ? static_cast<float*>(c->untyped_data()) : scratch->data();
  uint16_t* c16 = out_f32 ? nullptr : static_cast<uint16_t*>(c->untyped_data());
  // Without BF16 kernels both operands are widened once and every block runs the f32 GEMM on them.
  const bool bf16_kernels = HasBf16Kernels();
  std::shared_ptr<std::vector<float>> af, bf;
  if (!bf16_kernels) {
    af = WidenBf16(ap, a.element_count());
    bf = WidenBf16(bp, b.element_count());
  }
  if (k == 0) {
    std::fill(cf, cf + m * n, 0.0f);
    if (c16) std::fill(c16, c16 + m * n, 0);
    return ReadyFuture(ffi::Error::Success());
  }
  const int64_t row_blocks = (m + kBlockRows - 1) / kBlockRows, col_blocks = (n + kBlockCols - 1) / kBlockCols;
  const int64_t items = row_blocks * col_blocks;
  return ParallelFor(pool, items, NumChunks(pool, items, 1), [=](int64_t, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r0 = (i / col_blocks) * kBlockRows, c0 = (i % col_blocks) * kBlockCols;
      const int64_t rows = std::min(kBlockRows, m - r0), cols = std::min(kBlockCols, n - c0);
      if (bf16_kernels) {
#ifdef TUNIX_RT_X86
        BlockBf16(am, bm, r0, rows, c0, cols, k, cf, n);
#endif
      } else {
        for (int64_t r = r0; r < r0 + rows; ++r) std::fill(cf + r * n + c0, cf + r * n + c0 + cols, 0.0f);
        GemmAccumulate({af->data() + r0 * am.row_stride, am.row_stride, am.col_stride},
                       {bf->data() + c0 * bm.col_stride, bm.row_stride, bm.col_stride}, rows, cols, k, cf + r0 * n + c0, n);
      }
      if (c16)
        for (int64_t r = r0; r < r0 + rows; ++r)
          for (int64_t j = c0; j < c0 + cols; ++j) c16[r * n + j] = F32ToBf16(cf[r * n + j]);
    }
    (void)scratch;
    (void)af;
    (void)bf;
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Bf16MatmulHandler, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

}  // namespace tunix_rt
