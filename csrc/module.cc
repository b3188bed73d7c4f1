// The _ext Python module: FFI handler capsules for jax.ffi.register_ffi_target, and CPU facts.
#include <nanobind/nanobind.h>

#include "cpu_features.h"
#include "quant_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace tunix_rt {
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormFwdHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RmsNormBwdHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantizeHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(DequantizeHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(QuantMatmulHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(WriteKvHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(EmptyKvHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(PagedAttentionHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeRouteHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoePermuteHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeUnpermuteHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(MoeUnpermuteBwdHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedMatmulHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GroupedMatmulDwHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Bf16MatmulHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Bf16MatmulPlusHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionFwdHandler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(AttentionBwdHandler);
}  // namespace tunix_rt

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "tunix-rt compiled XLA FFI handlers (CPU)";
  m.attr("XLA_FFI_API_VERSION") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);

  m.def("cpu_registrations", [] {
    nb::dict d;
    d["tunix_rt_rms_norm_fwd"] = Capsule(tunix_rt::RmsNormFwdHandler);
    d["tunix_rt_rms_norm_bwd"] = Capsule(tunix_rt::RmsNormBwdHandler);
    d["tunix_rt_quantize"] = Capsule(tunix_rt::QuantizeHandler);
    d["tunix_rt_dequantize"] = Capsule(tunix_rt::DequantizeHandler);
    d["tunix_rt_quant_matmul"] = Capsule(tunix_rt::QuantMatmulHandler);
    d["tunix_rt_write_kv"] = Capsule(tunix_rt::WriteKvHandler);
    d["tunix_rt_empty_kv"] = Capsule(tunix_rt::EmptyKvHandler);
    d["tunix_rt_paged_attention"] = Capsule(tunix_rt::PagedAttentionHandler);
    d["tunix_rt_moe_route"] = Capsule(tunix_rt::MoeRouteHandler);
    d["tunix_rt_moe_permute"] = Capsule(tunix_rt::MoePermuteHandler);
    d["tunix_rt_moe_unpermute"] = Capsule(tunix_rt::MoeUnpermuteHandler);
    d["tunix_rt_moe_unpermute_bwd"] = Capsule(tunix_rt::MoeUnpermuteBwdHandler);
    d["tunix_rt_grouped_matmul"] = Capsule(tunix_rt::GroupedMatmulHandler);
    d["tunix_rt_grouped_matmul_dw"] = Capsule(tunix_rt::GroupedMatmulDwHandler);
    d["tunix_rt_bf16_matmul"] = Capsule(tunix_rt::Bf16MatmulHandler);
    d["tunix_rt_bf16_matmul_plus"] = Capsule(tunix_rt::Bf16MatmulPlusHandler);
    d["tunix_rt_attention_fwd"] = Capsule(tunix_rt::AttentionFwdHandler);
    d["tunix_rt_attention_bwd"] = Capsule(tunix_rt::AttentionBwdHandler);
    return d;
  });

  m.def("cpu_features", [] {
    const auto& f = tunix_rt::cpu_features();
    nb::dict d;
    d["avx2"] = f.avx2;
    d["fma"] = f.fma;
    d["f16c"] = f.f16c;
    d["avx512f"] = f.avx512f;
    d["avx512bw"] = f.avx512bw;
    d["avx512vl"] = f.avx512vl;
    d["avx512_vnni"] = f.avx512vnni;
    d["avx512_bf16"] = f.avx512bf16;
    d["amx_bf16"] = f.amx_bf16;
    d["amd_avx512"] = f.amd_avx512;
    d["avx_vnni"] = f.avxvnni;
    return d;
  });

  m.def("isa_level", [] { return tunix_rt::isa_level_name(tunix_rt::isa_level()); });

  // quant_matmul's int8 route on this tier: format id -> its GEMV's and its int8 GEMM's kernel names.
  m.def("quant_int8_kernels", [](int32_t fmt) {
    if (fmt < 0 || fmt >= tunix_rt::quant::kNumFormats) throw nb::value_error("quant_int8_kernels: unknown format id");
    nb::dict d;
    d["gemv"] = tunix_rt::quant::GemvKernelName(fmt);
    d["gemm"] = tunix_rt::quant::Int8GemmName(fmt);
    return d;
  });
}
