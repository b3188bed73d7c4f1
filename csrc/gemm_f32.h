// f32 matrix products shared by op families: micro-kernels per ISA tier and a strided GEMM on them.
//
// A micro-kernel adds a packed A tile (kMR rows, k-major: ap[k * kMR + r]) times a packed B panel
// (nr columns, k-major: bp[k * nr + j]) into kMR x nr outputs held in registers. nr is 16 on the
// scalar and AVX2 tiers, 32 on AVX-512. quant.cc feeds it dequantized weight panels; GemmAccumulate
// packs plain strided f32 matrices (MoE's grouped matmuls, forward and backward).
#pragma once

#include <cstdint>

#include "cpu_features.h"

namespace tunix_rt {

constexpr int kMR = 6, kNR = 16, kMaxNR = 32;

// c[r * ldc + j] += sum_k ap[k * kMR + r] * bp[k * nr + j], for r < rows, j < cols, k < kk.
using MicroFn = void (*)(const float* ap, const float* bp, int64_t kk, float* c, int64_t ldc, int rows, int cols);

struct MicroKernel {
  MicroFn fn;
  int nr;  // panel width the kernel reads
};

// The k step of a kMR-row micro-kernel over its named accumulator pairs c00, c01 .. c50, c51 (GCC keeps
// a 2-D array of them on the stack, storing 12 per step): ROW(r, lo, hi) for each row r < R.
#define TUNIX_RT_MICRO_ROWS(R, ROW)       \
  if constexpr ((R) > 0) ROW(0, c00, c01) \
  if constexpr ((R) > 1) ROW(1, c10, c11) \
  if constexpr ((R) > 2) ROW(2, c20, c21) \
  if constexpr ((R) > 3) ROW(3, c30, c31) \
  if constexpr ((R) > 4) ROW(4, c40, c41) \
  if constexpr ((R) > 5) ROW(5, c50, c51)

// The best micro-kernel at or below `level` that this CPU runs.
MicroKernel MicroKernelFor(IsaLevel level);

// Element (i, j) is data[i * row_stride + j * col_stride]: a row-major matrix or its transpose.
struct StridedMatrix {
  const float* data;
  int64_t row_stride, col_stride;
};

// c (m x n, row stride ldc) += a (m x k) @ b (k x n), at the detected ISA tier. One thread; callers
// split c's columns or independent products over the thread pool.
void GemmAccumulate(StridedMatrix a, StridedMatrix b, int64_t m, int64_t n, int64_t k, float* c, int64_t ldc);

}  // namespace tunix_rt
