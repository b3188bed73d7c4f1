// The routes of quant_matmul (quant.cc picks one by the caller's `route`) and the dequantizer.
//
// kInt8 quantizes activations to int8 per 32-block on the fly and takes integer dot products
// (llama.cpp's q8 scheme), for any number of rows M: a GEMV up to kGemvRows rows (quant_gemv.cc)
// and, past that on the SIMD tiers, an int8 GEMM (quant_gemm.cc). Both sum each output in one order,
// block after block, so a row's result is the same whichever route and whichever rows beside it.
// kExact takes exact f32 products over dequantized weight panels, the fastest way for the call's M
// (quant_gemm.cc); kExactRowInvariant does the same products with one summation order per row
// whatever M (the GEMV-sized kernel, four rows at a time). Each writes y (M, N) of x's dtype.
#pragma once

#include <cstdint>

#include "cpu_features.h"
#include "ffi_common.h"
#include "quant_formats.h"

#include "isa.h"

namespace tunix_rt {
namespace quant {

constexpr int64_t kGemvRows = 4;
// Kernels that take rows a few at a time walk the columns in blocks of about this many weight bytes, every
// row tile passing over a block before the next: the block stays in L2 and a row tile's activations in L1,
// where walking all M rows per column streamed every row's activations from L2 once per column (the AVX2
// int8 kernels and the row-invariant exact products were bound by it at M = 64).
constexpr int64_t kColumnBlockBytes = 128 << 10;
enum Route : int32_t { kInt8 = 0, kExact = 1, kExactRowInvariant = 2 };

// int8 activations: the GEMV kernels (any M; the int8 GEMM is faster past kGemvRows rows).
ffi::Future QuantGemv(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y);

// The kernels the int8 route runs for a format on this tier, by name (`tunix-rt info`; tests check that
// a tier cap changes them): the GEMV's, and the GEMM's past kGemvRows rows ("none": the GEMV's for every M).
const char* GemvKernelName(int32_t fmt);
const char* Int8GemmName(int32_t fmt);

// Exact f32 products (y equals x @ dequantize(qt) up to f32 summation order), any M; with
// `row_invariant`, each row summed in the same order whatever M.
ffi::Future QuantGemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y,
                      bool row_invariant);

// Elements [k0, k0 + kk) of column `col` (block aligned) into out[0, kk), as DequantizeRange.
using DequantFn = void (*)(const Weights& w, int64_t col, int64_t k0, int64_t kk, float* out);

// The fastest DequantizeRange of a format for the detected ISA tier (the same values).
DequantFn DequantizerFor(int32_t fmt);

#ifdef TUNIX_RT_X86
// AVX-512 VNNI (vpdpbusd: four u8 x s8 products into each int32 lane) with F16C.
inline bool HasVnni() { return isa_level() >= IsaLevel::kAvx512 && cpu_features().avx512vnni && cpu_features().f16c; }
// AVX-VNNI: the same instruction on 256-bit registers (the AVX2 tier's int8 GEMM uses it where it can).
inline bool HasAvxVnni() { return isa_level() >= IsaLevel::kAvxVnni && cpu_features().avxvnni && cpu_features().f16c; }
// An int8 GEMM for this tier: AVX-512 VNNI's, else AVX2's (with AVX-VNNI where the CPU has it).
inline bool HasInt8Gemm() { return isa_level() >= IsaLevel::kAvx2 && cpu_features().f16c; }

// int8 activations, M > kGemvRows, where HasInt8Gemm().
ffi::Future Int8Gemm(ffi::ThreadPool& pool, const Weights& w, const ffi::AnyBuffer& x, ffi::AnyBuffer y);
#endif

}  // namespace quant
}  // namespace tunix_rt
