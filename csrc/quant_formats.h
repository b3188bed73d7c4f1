// Weight-only quantization: GGUF q8_0 / q4_0 / q4_1 blocks and int8 / int4 with per-group scales.
//
// A quantized (K, N) weight is stored column-major in blocks, as ggml stores its rows:
//   qs      (N, K) int8 for 8-bit formats; (N, K/2) uint8 for 4-bit ones, where byte j of each
//           32-element sub-block holds element j in its low nibble and element j+16 in its high one
//   scales  (N, K/G) float16 (q* formats, G = 32) or float32 (int* formats, G = 32/64/128)
//   mins    (N, K/G) float16 for q4_1, else (N, 0)
// Quantize/dequantize follow ggml's reference arithmetic step by step (the extension builds with
// -ffp-contract=off), so the bytes equal gguf.quants'.
//
// What the quant_*.cc files share: the format table, a weight's layout and raw view, element codes,
// prefetching, the exact quantizers and dequantizer (quant_formats.cc), and the SIMD loads of codes
// and scales. The matmul routes are in quant_kernels.h.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ffi_common.h"

#include "isa.h"

namespace tunix_rt {
namespace quant {

constexpr int64_t kSub = 32;  // nibble-packing sub-block and activation block

// One row of traits per format (ggml keeps the same kind of table).
struct Format {
  int bits;
  bool has_min;     // q4_1: value = d * q + m
  bool f16_scales;  // GGUF formats store half-precision scales
  bool offset8;     // q4_0 / int4: nibble holds q + 8
};
// One table for every file (inline: one address, so a Layout's pointer into it gives the format id).
inline constexpr Format kFormats[] = {
    {8, false, true, false},   // 0 q8_0
    {4, false, true, true},    // 1 q4_0
    {4, true, true, false},    // 2 q4_1
    {8, false, false, false},  // 3 int8
    {4, false, false, true},   // 4 int4
};
constexpr int32_t kNumFormats = sizeof(kFormats) / sizeof(kFormats[0]);

// log2(group / 32): groups are 32, 64 or 128 elements, so block b lies in group b >> shift.
inline int GroupShift(int64_t group) { return group == 32 ? 0 : (group == 64 ? 1 : 2); }

struct Layout {
  const Format* f;
  int64_t n, k, group;
  int64_t row_bytes() const { return k * f->bits / 8; }
  int64_t groups() const { return k / group; }
  int32_t format_id() const { return static_cast<int32_t>(f - kFormats); }
};

ffi::Error MakeLayout(int32_t fmt, int64_t group, int64_t n, int64_t k, Layout* out);

// Checks qs/scales/mins buffers against the layout, each layer of them for a stack.
ffi::Error CheckWeights(const Layout& l, const ffi::AnyBuffer& qs, const ffi::AnyBuffer& scales,
                        const ffi::AnyBuffer& mins, const Stack& s = {});

// The stack a quant_matmul weight holds: qs of rank 3 is a stack of (N, K*bits/8) codes.
inline Stack StackOf(const ffi::AnyBuffer& qs) {
  const auto d = qs.dimensions();
  return d.size() == 3 ? Stack{true, d[0]} : Stack{};
}

// The GEMV's column-lane scales (optional): for each tile of kLaneColumns columns and each group, the
// tile's scales side by side (then, for formats with mins, its mins): (ceil(N / 16), K / group,
// 16 * (1 + has_min)) in the scales' dtype. The engine lays them out once per weight; without them the
// VNNI GEMV transposes each tile's scales itself, on every call.
constexpr int64_t kLaneColumns = 16;
ffi::Error CheckLanes(const Layout& l, const ffi::AnyBuffer& lanes, const Stack& s);

// Raw pointers of a quantized weight; safe to capture in async tasks.
struct Weights {
  Layout l;
  const uint8_t* qs;
  const void* scales;
  const uint16_t* mins;
  const void* lanes = nullptr;  // the column-lane scales above, or none
  float scale(int64_t col, int64_t g) const {
    const int64_t i = col * l.groups() + g;
    return l.f->f16_scales ? F16ToF32(static_cast<const uint16_t*>(scales)[i]) : static_cast<const float*>(scales)[i];
  }
  float min(int64_t col, int64_t g) const { return F16ToF32(mins[col * l.groups() + g]); }
  const uint8_t* row(int64_t col) const { return qs + col * l.row_bytes(); }
};

// Software prefetch for GEMVs: a small weight (K = 576: 288-byte columns) streams too briefly for
// the hardware prefetchers to ramp up, and decode waits on memory. Kernels walk columns in order,
// so loading columns about kPrefetchBytes ahead (their codes, scales and mins) hides the latency
// (default-model decode forward: about 11 ms -> 6 ms). The lines go to L2, not L1: the VNNI GEMV asks
// for a whole 16-column tile (~5 KB) at once (single-stream decode 104 vs 95 tok/s against L1 in one
// interleaved run on Zen 4; this machine's runs vary by 10 %).
constexpr int64_t kPrefetchBytes = 4096;
inline int64_t PrefetchAhead(const Layout& l) { return (kPrefetchBytes + l.row_bytes() - 1) / l.row_bytes(); }

inline void PrefetchRange(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

// Columns [c0, c0 + count) clipped to the weight.
inline void PrefetchColumns(const Weights& w, int64_t c0, int64_t count) {
  const int64_t c1 = std::min(w.l.n, c0 + count);
  if (c0 >= c1) return;
  const int64_t scale_bytes = w.l.f->f16_scales ? 2 : 4;
  PrefetchRange(w.row(c0), (c1 - c0) * w.l.row_bytes());
  if (w.lanes != nullptr) {  // the lane scales of the tiles holding these columns
    const int64_t t0 = c0 / kLaneColumns, t1 = (c1 - 1) / kLaneColumns + 1;
    const int64_t tile_bytes = w.l.groups() * kLaneColumns * (w.l.f->has_min ? 2 : 1) * scale_bytes;
    PrefetchRange(static_cast<const char*>(w.lanes) + t0 * tile_bytes, (t1 - t0) * tile_bytes);
    return;
  }
  const int64_t g0 = c0 * w.l.groups(), groups = (c1 - c0) * w.l.groups();
  PrefetchRange(static_cast<const char*>(w.scales) + g0 * scale_bytes, groups * scale_bytes);
  if (w.l.f->has_min) PrefetchRange(w.mins + g0, groups * 2);
}

// ---- quantize / dequantize (scalar, exact) ------------------------------------------------------

// Row `row` of the (N, K) weight (x: its K values) into its codes (qs: the row's bytes) and its
// entries of the whole scales and mins arrays.
void QuantizeRow(const Layout& l, const float* x, uint8_t* qs, void* scales, uint16_t* mins, int64_t row);

// Element i's integer code: signed for 8-bit formats, 0..15 for 4-bit ones.
inline int Code(const Layout& l, const uint8_t* row, int64_t i) {
  if (l.f->bits == 8) return reinterpret_cast<const int8_t*>(row)[i];
  const int64_t s = i / kSub, j = i % kSub;
  const uint8_t byte = row[s * kSub / 2 + (j % (kSub / 2))];
  return j < kSub / 2 ? (byte & 0x0f) : (byte >> 4);
}

// Elements [k0, k0 + kk) of column `col` (block aligned) into out[0, kk).
void DequantizeRange(const Weights& w, int64_t col, int64_t k0, int64_t kk, float* out);

// ---- activations: int8 per 32-block (llama.cpp's q8 scheme) -------------------------------------

// One 32-block of x quantized to int8 codes with scale d = amax / 127 (returned): elements 0..15 go
// to lo, 16..31 to hi; *qsum gets the sum of the codes and *sum_x, when given, the f32 sum of x (lanes
// i and i + w added for w = 16, 8, 4, 2, 1). A block holding a NaN or an infinity gets codes 0 and a NaN
// scale and sum. Every tier's quantizer gives the same bytes, scale and sum.
using BlockQuantizer = float (*)(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x);

float QuantizeBlock(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x);

#ifdef TUNIX_RT_X86

// QuantizeBlock with AVX2: the same codes, scale and sum_x (see QuantizeBlockAvx512).
AVX2_FN float QuantizeBlockAvx2(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x);

// QuantizeBlock with AVX-512: the same codes, scale and sum_x (amax, the multiply and the
// round-to-nearest-even convert are exact, and sum_x adds in QuantizeBlock's order).
VNNI_FN float QuantizeBlockAvx512(const float* xb, int8_t* lo, int8_t* hi, int32_t* qsum, float* sum_x);

// ---- SIMD loads of codes and scales -------------------------------------------------------------

// 32 codes of sub-block b as bytes: signed for 8-bit formats, 0..15 for 4-bit ones.
template <int kBits>
AVX2_F16C_FN inline __m256i LoadCodes(const uint8_t* row, int64_t b) {
  if constexpr (kBits == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kSub));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * kSub / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
  }
}

template <bool kF16>
AVX2_F16C_FN inline float ScaleAt(const void* scales, int64_t i) {
  if constexpr (kF16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(scales)[i]);
  } else {
    return static_cast<const float*>(scales)[i];
  }
}
#endif

}  // namespace quant
}  // namespace tunix_rt
