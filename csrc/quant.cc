// Weight-only quantization's FFI handlers: quantize, dequantize and quant_matmul (formats and layout
// in quant_formats.h; the matmul routes in quant_kernels.h).
#include <algorithm>
#include <vector>

#include "ffi_common.h"
#include "parallel.h"
#include "quant_formats.h"
#include "quant_kernels.h"

#include "isa.h"

namespace tunix_rt {
namespace quant {
namespace {

bool FloatInput(const ffi::AnyBuffer& b) { return IsF32OrBf16(b.element_type()); }

ffi::Future Quantize(ffi::ThreadPool pool, ffi::AnyBuffer wt, ffi::Result<ffi::AnyBuffer> qs,
                     ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> mins, int32_t fmt, int64_t group) {
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
  if (od.size() != 2 || !FloatInput(*out))
    return ReadyFuture(InvalidArgument("dequantize: output must be 2-D f32/bf16"));
  Layout l;
  if (ffi::Error e = MakeLayout(fmt, group, od[0], od[1], &l); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckWeights(l, qs, scales, mins); !e.success()) return ReadyFuture(e);
  const Weights w{l, static_cast<const uint8_t*>(qs.untyped_data()), scales.untyped_data(),
                  static_cast<const uint16_t*>(mins.untyped_data())};
  void* dst = out->untyped_data();
  const bool bf16 = out->element_type() == ffi::DataType::BF16;
  const DequantFn deq = DequantizerFor(fmt);
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

// x @ the weight, or with a stack of weights (qs, scales, mins and lanes on a leading axis) x @ its layer
// `layer`, read in place.
ffi::Future QuantMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer qs, ffi::AnyBuffer scales,
                        ffi::AnyBuffer mins, ffi::AnyBuffer lanes, ffi::BufferR0<ffi::S32> layer,
                        ffi::Result<ffi::AnyBuffer> y, int32_t fmt, int64_t group, int32_t route) {
  if (route < kInt8 || route > kExactRowInvariant)
    return ReadyFuture(InvalidArgument("quant_matmul: route must be 0 (int8), 1 (exact) or 2 (exact, row-invariant)"));
  const auto xd = x.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || !FloatInput(x) || y->element_type() != x.element_type() || yd[0] != xd[0])
    return ReadyFuture(InvalidArgument("quant_matmul: x must be (M, K) f32/bf16 and y (M, N) of x's dtype"));
  Layout l;
  if (ffi::Error e = MakeLayout(fmt, group, yd[1], xd[1], &l); !e.success()) return ReadyFuture(e);
  const Stack s = StackOf(qs);
  if (ffi::Error e = CheckWeights(l, qs, scales, mins, s); !e.success()) return ReadyFuture(e);
  if (ffi::Error e = CheckLanes(l, lanes, s); !e.success()) return ReadyFuture(e);
  const int32_t at = layer.typed_data()[0];
  if (ffi::Error e = CheckLayer("quant_matmul", at, s); !e.success()) return ReadyFuture(e);
  const int64_t m = xd[0];
  if (m == 0 || l.n == 0) return ReadyFuture(ffi::Error::Success());
  const Weights w{l, static_cast<const uint8_t*>(LayerData(qs, s, at)), LayerData(scales, s, at),
                  static_cast<const uint16_t*>(LayerData(mins, s, at)),
                  lanes.element_count() > 0 ? LayerData(lanes, s, at) : nullptr};
  if (route != kInt8) return QuantGemm(pool, w, x, *y, route == kExactRowInvariant);
#ifdef TUNIX_RT_X86
  if (m > kGemvRows && HasInt8Gemm()) return Int8Gemm(pool, w, x, *y);
#endif
  return QuantGemv(pool, w, x, *y);
}

}  // namespace
}  // namespace quant

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeHandler, quant::Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DequantizeHandler, quant::Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantMatmulHandler, quant::QuantMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int32_t>("fmt")
                                  .Attr<int64_t>("group")
                                  .Attr<int32_t>("route"));

}  // namespace tunix_rt
