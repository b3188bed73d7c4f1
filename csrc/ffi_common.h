// Helpers shared by every op family: dtype conversion and buffer shape access.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace tunix_rt {

namespace ffi = xla::ffi;

inline float Bf16ToF32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round to nearest even, as XLA and ml_dtypes do; NaN stays NaN.
inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE half precision, exact both ways (round to nearest even, subnormals, inf/NaN), matching
// numpy's astype(float16): GGUF block scales must round exactly as ggml's reference does.
inline float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    float f = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24, exact
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

uint16_t F32ToF16(float f);  // defined in ffi_common.cc (needs <cmath>)

// Product of all dimensions but the last; the last dimension.
inline int64_t LeadingSize(ffi::Span<const int64_t> dims) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) n *= dims[i];
  return n;
}
inline int64_t LastDim(ffi::Span<const int64_t> dims) { return dims.size() == 0 ? 1 : dims.back(); }

inline bool IsF32OrBf16(ffi::DataType t) { return t == ffi::DataType::F32 || t == ffi::DataType::BF16; }

// Row r of a row-major (R, c) f32 or bf16 buffer as f32: a pointer into the buffer itself for
// f32, or into `scratch` (c floats) after conversion for bf16.
inline const float* RowAsF32(const void* data, bool bf16, int64_t r, int64_t c, float* scratch) {
  if (!bf16) return static_cast<const float*>(data) + r * c;
  const uint16_t* src = static_cast<const uint16_t*>(data) + r * c;
  for (int64_t i = 0; i < c; ++i) scratch[i] = Bf16ToF32(src[i]);
  return scratch;
}

// `count` bf16 values widened to f32, in a shared vector asynchronous work can keep alive.
inline std::shared_ptr<std::vector<float>> WidenBf16(const uint16_t* src, size_t count) {
  auto out = std::make_shared<std::vector<float>>(count);
  for (size_t i = 0; i < count; ++i) (*out)[i] = Bf16ToF32(src[i]);
  return out;
}

// An f32 view of a whole f32 or bf16 buffer: the buffer itself, or a widened copy that `keep` owns.
inline const float* AsF32(const ffi::AnyBuffer& b, std::shared_ptr<std::vector<float>>* keep) {
  if (b.element_type() == ffi::DataType::F32) return static_cast<const float*>(b.untyped_data());
  *keep = WidenBf16(static_cast<const uint16_t*>(b.untyped_data()), b.element_count());
  return (*keep)->data();
}

inline ffi::Error InvalidArgument(const std::string& msg) { return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg); }

// Weights stacked on a leading axis of `depth` layers, read one layer in place (a scanned decoder's
// slice of a stacked weight would be copied every iteration). Without the axis (`axis` false) the
// buffer is a stack of one.
struct Stack {
  bool axis = false;
  int64_t depth = 1;
};

// A stacked buffer's dimensions past the stack axis; false when it lacks the axis or its depth differs.
inline bool LayerDims(const ffi::AnyBuffer& b, const Stack& s, ffi::Span<const int64_t>* out) {
  const auto d = b.dimensions();
  if (!s.axis) {
    *out = d;
    return true;
  }
  if (d.size() == 0 || d[0] != s.depth) return false;
  *out = d.last(d.size() - 1);
  return true;
}

// The layer index an op got as data: `op`'s error unless 0 <= layer < the stack's depth.
inline ffi::Error CheckLayer(const char* op, int32_t layer, const Stack& s) {
  if (layer >= 0 && layer < s.depth) return ffi::Error::Success();
  return InvalidArgument(std::string(op) + ": layer = " + std::to_string(layer) + " is outside the stack's [0, " +
                         std::to_string(s.depth) + ")");
}

// Layer `layer` (checked) of a buffer stacked `s.depth` deep.
inline const void* LayerData(const ffi::AnyBuffer& b, const Stack& s, int32_t layer) {
  return static_cast<const char*>(b.untyped_data()) + layer * (b.size_bytes() / s.depth);
}

}  // namespace tunix_rt
