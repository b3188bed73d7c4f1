// Runtime CPUID + XGETBV probing: the OS must enable the register state, not just the CPU.
#include "cpu_features.h"

#include <cstdlib>
#include <cstring>

#include "isa.h"

#ifdef TUNIX_RT_X86
#include <cpuid.h>
#endif

namespace tunix_rt {
namespace {

#ifdef TUNIX_RT_X86
unsigned long long xgetbv0() {
  unsigned eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}
#endif

CpuFeatures detect() {
  CpuFeatures f;
#ifdef TUNIX_RT_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  const bool fma = c & (1u << 12);
  if (!osxsave) return f;
  const unsigned long long xcr0 = xgetbv0();
  const bool ymm_os = (xcr0 & 0x6) == 0x6;
  const bool zmm_os = (xcr0 & 0xe6) == 0xe6;
  const bool amx_os = (xcr0 & 0x60000) == 0x60000;  // XTILECFG and XTILEDATA state
  unsigned a7, b7, c7, d7;
  if (!__get_cpuid_count(7, 0, &a7, &b7, &c7, &d7)) return f;
  unsigned a71 = 0, b71, c71, d71;
  __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
  f.avx2 = ymm_os && (b7 & (1u << 5));
  f.fma = ymm_os && fma;
  f.f16c = ymm_os && (c & (1u << 29));
  f.avxvnni = ymm_os && (a71 & (1u << 4));
  f.avx512f = zmm_os && (b7 & (1u << 16));
  f.avx512bw = f.avx512f && (b7 & (1u << 30));
  f.avx512vl = f.avx512f && (b7 & (1u << 31));
  f.avx512vnni = f.avx512f && (c7 & (1u << 11));
  f.avx512bf16 = f.avx512f && (a71 & (1u << 5));
  f.amx_bf16 = amx_os && (d7 & (1u << 24)) && (d7 & (1u << 22));  // AMX-TILE and AMX-BF16
  unsigned a0, vendor[3];
  __get_cpuid(0, &a0, &vendor[0], &vendor[2], &vendor[1]);  // "AuthenticAMD" in ebx, edx, ecx
  const bool amd = std::memcmp(vendor, "AuthenticAMD", 12) == 0;
  const unsigned family = ((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (a >> 20) & 0xff : 0);
  f.amd_avx512 = amd && family >= 0x19 && f.avx512f;
#endif
  return f;
}

IsaLevel detect_level(const CpuFeatures& f) {
  IsaLevel hw = IsaLevel::kScalar;
  if (f.avx2 && f.fma) hw = IsaLevel::kAvx2;
  if (hw == IsaLevel::kAvx2 && f.avxvnni && f.f16c) hw = IsaLevel::kAvxVnni;
  if (hw >= IsaLevel::kAvx2 && f.avx512f && f.avx512bw && f.avx512vl) hw = IsaLevel::kAvx512;
  const char* cap = std::getenv("TUNIX_RT_ISA");
  if (cap == nullptr) return hw;
  IsaLevel want = hw;
  if (std::strcmp(cap, "scalar") == 0) want = IsaLevel::kScalar;
  if (std::strcmp(cap, "avx2") == 0) want = IsaLevel::kAvx2;
  if (std::strcmp(cap, "avxvnni") == 0) want = IsaLevel::kAvxVnni;
  if (std::strcmp(cap, "avx512") == 0) want = IsaLevel::kAvx512;
  if (want >= hw) return hw;
  return want == IsaLevel::kAvxVnni && !(f.avxvnni && f.f16c) ? IsaLevel::kAvx2 : want;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

// Fixed at first use, like the kernel tables that dispatch on it.
IsaLevel isa_level() {
  static const IsaLevel level = detect_level(cpu_features());
  return level;
}

const char* isa_level_name(IsaLevel level) {
  switch (level) {
    case IsaLevel::kAvx512: return "avx512";
    case IsaLevel::kAvxVnni: return "avxvnni";
    case IsaLevel::kAvx2: return "avx2";
    default: return "scalar";
  }
}

}  // namespace tunix_rt
