// The routes of quant_matmul, by the number of rows M of x (quant.cc picks one), and the dequantizer.
//
// The matmul quantizes activations to int8 per 32-block on the fly and takes integer dot products
// (llama.cpp's q8 scheme) for up to kInt8Rows rows (Python decides how many: quant_matmul's
// int8_rows): a GEMV for up to kGemvRows rows (quant_gemv.cc), and past that, on AVX-512 VNNI, an
// int8 GEMM (quant_gemm.cc). More rows, or `exact`, take exact f32 products over dequantized
// weight panels (quant_gemm.cc). Each writes y (M, N) of x's dtype, f32 or bf16.
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "ffi_common.h"
#include "quant_formats.h"

#include "isa.h"

namespace tunix_rt {
namespace quant {

constexpr int64_t kGemvRows = 4;
constexpr int64_t kInt8Rows = 64;

// int8 activations, up to kInt8Rows rows: the GEMV kernels.
ffi::Future QuantGemv(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y);

// Exact f32 products (y equals x @ dequantize(qt) up to f32 summation order), any M.
ffi::Future QuantGemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y);

// Elements [k0, k0 + kk) of column `col` (block aligned) into out[0, kk), as DequantizeRange.
using DequantFn = void (*)(const Weights& w, int64_t col, int64_t k0, int64_t kk, float* out);

// The fastest DequantizeRange of a format for the detected ISA tier (the same values).
DequantFn DequantizerFor(int32_t fmt);

#ifdef TUNIX_RT_X86
// AVX-512 VNNI (vpdpbusd: four u8 x s8 products into each int32 lane) with F16C.
inline bool HasVnni() { return isa_level() >= IsaLevel::kAvx512 && cpu_features().avx512vnni && cpu_features().f16c; }

// int8 activations, kGemvRows < M <= kInt8Rows, where HasVnni().
ffi::Future VnniGemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y);
#endif

}  // namespace quant
}  // namespace tunix_rt
