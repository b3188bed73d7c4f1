// Fused RMSNorm forward/backward: y = x * rsqrt(mean(x^2) + eps) * (offset + w).
//
// x is (..., D); w is (..., D) whose leading size G divides x's row count: row r uses weight
// group r / (rows / G). G is 1 for a plain call; G > 1 appears when jax.vmap batches w too
// (vmap_method="broadcast_all" puts the batch dimensions in front of both). All math is f32;
// bf16 buffers are converted per row. The backward pass reduces dw per chunk and the last chunk
// to finish sums the partials in chunk order, so results do not depend on thread timing.
#include <cmath>
#include <memory>
#include <vector>

#include "cpu_features.h"
#include "ffi_common.h"
#include "parallel.h"

#include "isa.h"

namespace tunix_rt {
namespace {

// One row's primitives per ISA tier, selected once (cf. ggml's per-type trait tables).
struct RowKernels {
  float (*sumsq)(const float* x, int64_t n);
  float (*dot3)(const float* a, const float* b, const float* c, int64_t n);
  void (*fwd)(const float* x, const float* g, float r, float* y, int64_t n);
  // dx = r*dy*g - c*x ; dw += r*dy*x
  void (*bwd)(const float* x, const float* dy, const float* g, float r, float c, float* dx, float* dw, int64_t n);
};

float SumSqScalar(const float* x, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j] * x[i + j];
  float s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}
float Dot3Scalar(const float* a, const float* b, const float* c, int64_t n) {
  float acc[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  float s = 0;
  for (int j = 0; j < 8; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i] * c[i];
  return s;
}
void FwdScalar(const float* x, const float* g, float r, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * g[i];
}
void BwdScalar(const float* x, const float* dy, const float* g, float r, float c, float* dx, float* dw, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dx[i] = r * dy[i] * g[i] - c * x[i];
    dw[i] += r * dy[i] * x[i];
  }
}

#ifdef TUNIX_RT_X86
AVX2_FN float SumSqAvx2(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = HSum8(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}
AVX2_FN float Dot3Avx2(const float* a, const float* b, const float* c, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)), _mm256_loadu_ps(c + i), acc);
  float s = HSum8(acc);
  for (; i < n; ++i) s += a[i] * b[i] * c[i];
  return s;
}
AVX2_FN void FwdAvx2(const float* x, const float* g, float r, float* y, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(g + i)));
  for (; i < n; ++i) y[i] = x[i] * r * g[i];
}
AVX2_FN void BwdAvx2(const float* x, const float* dy, const float* g, float r, float c, float* dx, float* dw,
                     int64_t n) {
  const __m256 rv = _mm256_set1_ps(r), cv = _mm256_set1_ps(c);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 xv = _mm256_loadu_ps(x + i);
    const __m256 rdy = _mm256_mul_ps(rv, _mm256_loadu_ps(dy + i));
    _mm256_storeu_ps(dx + i, _mm256_fmsub_ps(rdy, _mm256_loadu_ps(g + i), _mm256_mul_ps(cv, xv)));
    _mm256_storeu_ps(dw + i, _mm256_fmadd_ps(rdy, xv, _mm256_loadu_ps(dw + i)));
  }
  BwdScalar(x + i, dy + i, g + i, r, c, dx + i, dw + i, n - i);
}

AVX512_FN float SumSqAvx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return _mm512_reduce_add_ps(acc);
}
AVX512_FN float Dot3Avx512(const float* a, const float* b, const float* c, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)), _mm512_loadu_ps(c + i), acc);
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i)),
                          _mm512_maskz_loadu_ps(m, c + i), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
AVX512_FN void FwdAvx512(const float* x, const float* g, float r, float* y, int64_t n) {
  const __m512 rv = _mm512_set1_ps(r);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), rv), _mm512_loadu_ps(g + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(
        y + i, m, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), rv), _mm512_maskz_loadu_ps(m, g + i)));
  }
}
AVX512_FN void BwdAvx512(const float* x, const float* dy, const float* g, float r, float c, float* dx, float* dw,
                         int64_t n) {
  const __m512 rv = _mm512_set1_ps(r), cv = _mm512_set1_ps(c);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    const __m512 rdy = _mm512_mul_ps(rv, _mm512_loadu_ps(dy + i));
    _mm512_storeu_ps(dx + i, _mm512_fmsub_ps(rdy, _mm512_loadu_ps(g + i), _mm512_mul_ps(cv, xv)));
    _mm512_storeu_ps(dw + i, _mm512_fmadd_ps(rdy, xv, _mm512_loadu_ps(dw + i)));
  }
  BwdScalar(x + i, dy + i, g + i, r, c, dx + i, dw + i, n - i);
}
#endif  // TUNIX_RT_X86

const RowKernels& Kernels() {
  static const RowKernels kernels = [] {
#ifdef TUNIX_RT_X86
    switch (isa_level()) {
      case IsaLevel::kAvx512: return RowKernels{SumSqAvx512, Dot3Avx512, FwdAvx512, BwdAvx512};
      case IsaLevel::kAvxVnni:  // no integer dots here: AVX2's
      case IsaLevel::kAvx2: return RowKernels{SumSqAvx2, Dot3Avx2, FwdAvx2, BwdAvx2};
      default: break;
    }
#endif
    return RowKernels{SumSqScalar, Dot3Scalar, FwdScalar, BwdScalar};
  }();
  return kernels;
}

// A row-major (rows, d) f32 or bf16 buffer, captured by raw pointer: async tasks may outlive the
// handler's call frame, so they never hold the ffi buffer objects themselves.
struct Rows {
  void* data;
  bool bf16;
  int64_t d;
  explicit Rows(const ffi::AnyBuffer& b)
      : data(b.untyped_data()), bf16(b.element_type() == ffi::DataType::BF16), d(LastDim(b.dimensions())) {}

  // Row r as f32: a pointer into the buffer for f32, or into `scratch` after conversion.
  const float* Read(int64_t r, float* scratch) const { return RowAsF32(data, bf16, r, d, scratch); }
  // Where to compute row r's f32 result: in place for f32, else in scratch, then Flush().
  float* Target(int64_t r, float* scratch) const { return bf16 ? scratch : static_cast<float*>(data) + r * d; }
  void Flush(int64_t r, const float* src) const {
    if (!bf16) return;
    uint16_t* dst = static_cast<uint16_t*>(data) + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = F32ToBf16(src[i]);
  }
};

struct Geometry {
  int64_t rows, d, groups, rows_per_group;
};

ffi::Error CheckGeometry(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, Geometry* g) {
  if (!IsF32OrBf16(x.element_type()) || !IsF32OrBf16(w.element_type()))
    return InvalidArgument("rms_norm: x and w must be float32 or bfloat16");
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() == 0 || wd.size() == 0 || LastDim(xd) != LastDim(wd))
    return InvalidArgument("rms_norm: x and w must share their last dimension");
  g->d = LastDim(xd);
  g->rows = LeadingSize(xd);
  g->groups = LeadingSize(wd);
  if (g->groups <= 0 || g->rows % g->groups != 0)
    return InvalidArgument("rms_norm: weight groups must divide the rows of x");
  g->rows_per_group = g->rows / g->groups;
  return ffi::Error::Success();
}

// offset + w, as f32, for every weight group.
std::shared_ptr<std::vector<float>> GainTable(const ffi::AnyBuffer& w, const Geometry& g, float offset) {
  auto gain = std::make_shared<std::vector<float>>(g.groups * g.d);
  const Rows wr(w);
  for (int64_t grp = 0; grp < g.groups; ++grp) {
    const float* row = wr.Read(grp, gain->data() + grp * g.d);
    for (int64_t i = 0; i < g.d; ++i) (*gain)[grp * g.d + i] = row[i] + offset;
  }
  return gain;
}

constexpr int64_t kGrainElements = 1 << 14;

ffi::Future RmsNormFwd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> y,
                       float eps, float offset) {
  Geometry g;
  if (ffi::Error err = CheckGeometry(x, w, &g); !err.success()) return ReadyFuture(err);
  if (g.rows == 0 || g.d == 0) return ReadyFuture(ffi::Error::Success());
  auto gain = GainTable(w, g, offset);
  const int64_t chunks = NumChunks(pool, g.rows, std::max<int64_t>(1, kGrainElements / g.d));
  const Rows xv(x), yv(*y);
  return ParallelFor(pool, g.rows, chunks, [=](int64_t, int64_t begin, int64_t end) {
    const RowKernels& k = Kernels();
    std::vector<float> xs(g.d), ys(g.d);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xv.Read(r, xs.data());
      float* yr = yv.Target(r, ys.data());
      const float rstd = 1.0f / std::sqrt(k.sumsq(xr, g.d) / g.d + eps);
      k.fwd(xr, gain->data() + (r / g.rows_per_group) * g.d, rstd, yr, g.d);
      yv.Flush(r, yr);
    }
    return ffi::Error::Success();
  });
}

ffi::Future RmsNormBwd(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer dy,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw, float eps, float offset) {
  Geometry g;
  if (ffi::Error err = CheckGeometry(x, w, &g); !err.success()) return ReadyFuture(err);
  if (dy.element_type() != x.element_type() || dy.dimensions().size() != x.dimensions().size() ||
      LeadingSize(dy.dimensions()) != g.rows || LastDim(dy.dimensions()) != g.d)
    return ReadyFuture(InvalidArgument("rms_norm_bwd: dy must match x in shape and dtype"));
  if (g.d == 0) return ReadyFuture(ffi::Error::Success());
  auto gain = GainTable(w, g, offset);
  const int64_t chunks = NumChunks(pool, g.rows, std::max<int64_t>(1, kGrainElements / g.d));
  // Partial dw per (chunk, group); a chunk touches only the groups its rows fall in.
  const int64_t n_chunks = std::max<int64_t>(chunks, 1);
  auto partial = std::make_shared<std::vector<float>>(n_chunks * g.groups * g.d, 0.0f);
  const Rows xv(x), dyv(dy), dxv(*dx), dwv(*dw);
  auto body = [=](int64_t chunk, int64_t begin, int64_t end) {
    const RowKernels& k = Kernels();
    std::vector<float> xs(g.d), dys(g.d), dxs(g.d);
    float* dw_acc = partial->data() + chunk * g.groups * g.d;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t grp = r / g.rows_per_group;
      const float* xr = xv.Read(r, xs.data());
      const float* dyr = dyv.Read(r, dys.data());
      const float* gr = gain->data() + grp * g.d;
      float* dxr = dxv.Target(r, dxs.data());
      const float rstd = 1.0f / std::sqrt(k.sumsq(xr, g.d) / g.d + eps);
      const float c = k.dot3(dyr, gr, xr, g.d) * rstd * rstd * rstd / g.d;
      k.bwd(xr, dyr, gr, rstd, c, dxr, dw_acc + grp * g.d, g.d);
      dxv.Flush(r, dxr);
    }
    return ffi::Error::Success();
  };
  auto finish = [=]() {
    std::vector<float> sum(g.d);
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t c = 0; c < n_chunks; ++c) {
        const float* p = partial->data() + (c * g.groups + grp) * g.d;
        for (int64_t i = 0; i < g.d; ++i) sum[i] += p[i];
      }
      float* out = dwv.Target(grp, sum.data());
      if (out != sum.data()) std::copy(sum.begin(), sum.end(), out);
      dwv.Flush(grp, sum.data());
    }
    return ffi::Error::Success();
  };
  return ParallelFor(pool, g.rows, chunks, body, finish);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormFwdHandler, RmsNormFwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RmsNormBwdHandler, RmsNormBwd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("eps")
                                  .Attr<float>("offset"));

}  // namespace tunix_rt
