// Helpers shared by every op family: dtype conversion and buffer shape access.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

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

// Product of all dimensions but the last; the last dimension.
inline int64_t LeadingSize(ffi::Span<const int64_t> dims) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) n *= dims[i];
  return n;
}
inline int64_t LastDim(ffi::Span<const int64_t> dims) { return dims.size() == 0 ? 1 : dims.back(); }

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, msg);
}

}  // namespace tunix_rt
