// f32 micro-kernels per ISA tier and the strided GEMM built on them (see gemm_f32.h).
#include "gemm_f32.h"

#include <algorithm>
#include <vector>

#include "isa.h"

namespace tunix_rt {
namespace {

void MicroScalar(const float* xp, const float* panel, int64_t kk, float* y, int64_t ldy, int rows, int cols) {
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t k = 0; k < kk; ++k) acc += xp[k * kMR + r] * panel[k * kNR + j];
      y[r * ldy + j] += acc;
    }
}

#ifdef TUNIX_RT_X86

template <int R>
AVX2_FN void MicroAvx2(const float* xp, const float* panel, int64_t kk, float* y, int64_t ldy, int cols) {
  // Named accumulators: GCC keeps a 2-D array of them on the stack, storing 12 per step.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kk; ++k) {
    const __m256 b0 = _mm256_loadu_ps(panel + k * kNR), b1 = _mm256_loadu_ps(panel + k * kNR + 8);
    const float* a = xp + k * kMR;
#define TUNIX_RT_ROW(r, lo, hi)                   \
  {                                               \
    const __m256 ar = _mm256_broadcast_ss(a + r); \
    lo = _mm256_fmadd_ps(ar, b0, lo);             \
    hi = _mm256_fmadd_ps(ar, b1, hi);             \
  }
    TUNIX_RT_MICRO_ROWS(R, TUNIX_RT_ROW)
#undef TUNIX_RT_ROW
  }
  alignas(32) float tile[kMR][kNR];
  const __m256 acc[kMR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(tile[r], acc[r][0]);
    _mm256_store_ps(tile[r] + 8, acc[r][1]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < cols; ++j) y[r * ldy + j] += tile[r][j];
}

void MicroAvx2Any(const float* xp, const float* panel, int64_t kk, float* y, int64_t ldy, int rows, int cols) {
  using F = void (*)(const float*, const float*, int64_t, float*, int64_t, int);
  static constexpr F kTable[kMR] = {MicroAvx2<1>, MicroAvx2<2>, MicroAvx2<3>, MicroAvx2<4>, MicroAvx2<5>, MicroAvx2<6>};
  kTable[rows - 1](xp, panel, kk, y, ldy, cols);
}

// The AVX-512 micro-kernel: R rows x 32 columns (two zmm per row) of a 32-wide panel.
template <int R>
AVX512_FN void MicroAvx512(const float* xp, const float* panel, int64_t kk, float* y, int64_t ldy, int cols) {
  __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < kk; ++k) {
    const __m512 b0 = _mm512_loadu_ps(panel + k * kMaxNR), b1 = _mm512_loadu_ps(panel + k * kMaxNR + 16);
    const float* a = xp + k * kMR;
#define TUNIX_RT_ROW(r, lo, hi)             \
  {                                         \
    const __m512 ar = _mm512_set1_ps(a[r]); \
    lo = _mm512_fmadd_ps(ar, b0, lo);       \
    hi = _mm512_fmadd_ps(ar, b1, hi);       \
  }
    TUNIX_RT_MICRO_ROWS(R, TUNIX_RT_ROW)
#undef TUNIX_RT_ROW
  }
  const __m512 acc[kMR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41}, {c50, c51}};
  if (cols == kMaxNR) {
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) {
        float* out = y + r * ldy + 16 * h;
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), acc[r][h]));
      }
    return;
  }
  alignas(64) float tile[kMR][kMaxNR];
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(tile[r], acc[r][0]);
    _mm512_store_ps(tile[r] + 16, acc[r][1]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < cols; ++j) y[r * ldy + j] += tile[r][j];
}

void MicroAvx512Any(const float* xp, const float* panel, int64_t kk, float* y, int64_t ldy, int rows, int cols) {
  using F = void (*)(const float*, const float*, int64_t, float*, int64_t, int);
  static constexpr F kTable[kMR] = {MicroAvx512<1>, MicroAvx512<2>, MicroAvx512<3>,
                                    MicroAvx512<4>, MicroAvx512<5>, MicroAvx512<6>};
  kTable[rows - 1](xp, panel, kk, y, ldy, cols);
}
#endif

// Packing for GemmAccumulate: K runs in kPackK-deep slabs; B is packed kPackN columns at a time
// (one L2-sized block) into nr-wide panels, A into kMR-row tiles, both k-major and zero-padded.
constexpr int64_t kPackK = 256, kPackN = 256;

void PackA(StridedMatrix a, int64_t m, int64_t k0, int64_t kk, float* out) {
  const int64_t tiles = (m + kMR - 1) / kMR;
  for (int64_t t = 0; t < tiles; ++t) {
    float* tile = out + t * kk * kMR;
    const int rows = static_cast<int>(std::min<int64_t>(kMR, m - t * kMR));
    if (rows < kMR) std::fill(tile, tile + kk * kMR, 0.0f);
    for (int r = 0; r < rows; ++r) {
      const float* src = a.data + (t * kMR + r) * a.row_stride + k0 * a.col_stride;
      if (a.col_stride == 1) {
        for (int64_t p = 0; p < kk; ++p) tile[p * kMR + r] = src[p];
      } else {
        for (int64_t p = 0; p < kk; ++p) tile[p * kMR + r] = src[p * a.col_stride];
      }
    }
  }
}

void PackB(StridedMatrix b, int64_t k0, int64_t kk, int64_t j0, int64_t cols, int nr, float* out) {
  for (int64_t jp = 0; jp < cols; jp += nr) {
    float* panel = out + (jp / nr) * kk * nr;
    const int64_t w = std::min<int64_t>(nr, cols - jp);
    if (b.col_stride == 1) {  // rows of b are contiguous: copy runs of nr
      for (int64_t p = 0; p < kk; ++p) {
        const float* src = b.data + (k0 + p) * b.row_stride + j0 + jp;
        float* dst = panel + p * nr;
        std::copy(src, src + w, dst);
        std::fill(dst + w, dst + nr, 0.0f);
      }
      continue;
    }
    if (w < nr) std::fill(panel, panel + kk * nr, 0.0f);
    for (int64_t j = 0; j < w; ++j) {  // columns of b are contiguous (a transposed weight)
      const float* src = b.data + (j0 + jp + j) * b.col_stride + k0 * b.row_stride;
      for (int64_t p = 0; p < kk; ++p) panel[p * nr + j] = src[p * b.row_stride];
    }
  }
}

// Few rows of a row-major b: packing b would cost more than the product, so rows of b are read in
// place. Each output element sees the micro-kernels' exact arithmetic (a chain from zero over each
// kPackK slab, fused on the SIMD tiers, then added to c), so a row's result never depends on how
// many rows share its product: MoE tokens come out the same whatever else was routed with them.
void SmallRowsScalar(StridedMatrix a, StridedMatrix b, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc) {
  std::vector<float> acc(n);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k0 = 0; k0 < k; k0 += kPackK) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = k0; p < std::min(k, k0 + kPackK); ++p) {
        const float s = a.data[i * a.row_stride + p * a.col_stride];
        const float* bp = b.data + p * b.row_stride;
        for (int64_t j = 0; j < n; ++j) acc[j] += s * bp[j];
      }
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] += acc[j];
    }
}

#ifdef TUNIX_RT_X86
constexpr int kSmallVectors = 8;  // accumulators per pass over a slab

AVX512_FN void SmallRowsAvx512(StridedMatrix a, StridedMatrix b, int64_t m, int64_t n, int64_t k, float* c,
                               int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j0 = 0; j0 < n; j0 += 16 * kSmallVectors) {
      __mmask16 mask[kSmallVectors];
      for (int v = 0; v < kSmallVectors; ++v) {
        const int64_t left = std::clamp<int64_t>(n - j0 - 16 * v, 0, 16);
        mask[v] = static_cast<__mmask16>((1u << left) - 1u);
      }
      for (int64_t k0 = 0; k0 < k; k0 += kPackK) {
        __m512 acc[kSmallVectors];
        for (int v = 0; v < kSmallVectors; ++v) acc[v] = _mm512_setzero_ps();
        for (int64_t p = k0; p < std::min(k, k0 + kPackK); ++p) {
          const __m512 s = _mm512_set1_ps(a.data[i * a.row_stride + p * a.col_stride]);
          const float* bp = b.data + p * b.row_stride + j0;
          for (int v = 0; v < kSmallVectors; ++v)
            acc[v] = _mm512_fmadd_ps(s, _mm512_maskz_loadu_ps(mask[v], bp + 16 * v), acc[v]);
        }
        float* ci = c + i * ldc + j0;
        for (int v = 0; v < kSmallVectors; ++v)
          _mm512_mask_storeu_ps(ci + 16 * v, mask[v],
                                _mm512_add_ps(_mm512_maskz_loadu_ps(mask[v], ci + 16 * v), acc[v]));
      }
    }
}

AVX2_FN void SmallRowsAvx2(StridedMatrix a, StridedMatrix b, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j0 = 0; j0 < n; j0 += 8 * kSmallVectors) {
      __m256i mask[kSmallVectors];
      for (int v = 0; v < kSmallVectors; ++v) {
        const int64_t left = std::clamp<int64_t>(n - j0 - 8 * v, 0, 8);
        mask[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      }
      for (int64_t k0 = 0; k0 < k; k0 += kPackK) {
        __m256 acc[kSmallVectors];
        for (int v = 0; v < kSmallVectors; ++v) acc[v] = _mm256_setzero_ps();
        for (int64_t p = k0; p < std::min(k, k0 + kPackK); ++p) {
          const __m256 s = _mm256_set1_ps(a.data[i * a.row_stride + p * a.col_stride]);
          const float* bp = b.data + p * b.row_stride + j0;
          for (int v = 0; v < kSmallVectors; ++v)
            acc[v] = _mm256_fmadd_ps(s, _mm256_maskload_ps(bp + 8 * v, mask[v]), acc[v]);
        }
        float* ci = c + i * ldc + j0;
        for (int v = 0; v < kSmallVectors; ++v)
          _mm256_maskstore_ps(ci + 8 * v, mask[v], _mm256_add_ps(_mm256_maskload_ps(ci + 8 * v, mask[v]), acc[v]));
      }
    }
}
#endif

using SmallRowsFn = void (*)(StridedMatrix, StridedMatrix, int64_t, int64_t, int64_t, float*, int64_t);

SmallRowsFn SelectSmallRows() {
#ifdef TUNIX_RT_X86
  if (isa_level() >= IsaLevel::kAvx512) return SmallRowsAvx512;
  if (isa_level() >= IsaLevel::kAvx2) return SmallRowsAvx2;
#endif
  return SmallRowsScalar;
}

}  // namespace

MicroKernel MicroKernelFor(IsaLevel level) {
#ifdef TUNIX_RT_X86
  if (level >= IsaLevel::kAvx512 && isa_level() >= IsaLevel::kAvx512) return {MicroAvx512Any, kMaxNR};
  if (level >= IsaLevel::kAvx2 && isa_level() >= IsaLevel::kAvx2) return {MicroAvx2Any, kNR};
#endif
  return {MicroScalar, kNR};
}

void GemmAccumulate(StridedMatrix a, StridedMatrix b, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc) {
  if (m <= 0 || n <= 0 || k <= 0) return;
  if (m <= 2 && b.col_stride == 1) return SelectSmallRows()(a, b, m, n, k, c, ldc);
  const MicroKernel mk = MicroKernelFor(isa_level());
  const int64_t tiles = (m + kMR - 1) / kMR;
  // Packing scratch sized to this product and kept per thread: small products (attention tiles) are
  // called thousands of times, and fresh zeroed buffers cost more than their multiply-adds.
  thread_local std::vector<float> ap, bp;
  const size_t ap_size = tiles * std::min(k, kPackK) * kMR;
  const size_t bp_size = std::min(k, kPackK) * (std::min(n, kPackN) + mk.nr);
  if (ap.size() < ap_size) ap.resize(ap_size);
  if (bp.size() < bp_size) bp.resize(bp_size);
  for (int64_t k0 = 0; k0 < k; k0 += kPackK) {
    const int64_t kk = std::min(kPackK, k - k0);
    PackA(a, m, k0, kk, ap.data());
    for (int64_t j0 = 0; j0 < n; j0 += kPackN) {
      const int64_t cols = std::min(kPackN, n - j0);
      PackB(b, k0, kk, j0, cols, mk.nr, bp.data());
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(kMR, m - t * kMR));
        for (int64_t jp = 0; jp < cols; jp += mk.nr) {
          const int w = static_cast<int>(std::min<int64_t>(mk.nr, cols - jp));
          mk.fn(ap.data() + t * kk * kMR, bp.data() + (jp / mk.nr) * kk * mk.nr, kk, c + t * kMR * ldc + j0 + jp, ldc,
                rows, w);
        }
      }
    }
  }
}

}  // namespace tunix_rt
