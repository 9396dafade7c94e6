// CPU feature detection with cpuid/xgetbv (the OS must also save the wider registers) on
// x86-64, with the kernel's hardware capabilities (getauxval) on aarch64, and the table of
// kernel builds by ISA. Other architectures know only the scalar path.
#include "dispatch.h"
#include <atomic>
#include <stdexcept>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define CPU_OFFLOAD_X86 1
#elif defined(__aarch64__)
#include <sys/auxv.h>
#include <sys/prctl.h>
#define CPU_OFFLOAD_AARCH64 1
#endif

namespace cpu_offload {
namespace {

struct IsaEntry {
  const char* name;
  const KernelTable* (*table)();
  bool (*supported)();
};

#if CPU_OFFLOAD_X86
struct CpuFeatures {
  bool avx2 = false, avx512 = false, avx512_bf16 = false;
};

uint64_t read_xcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!osxsave) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;        // XMM and YMM state
  const bool os_avx512 = (xcr0 & 0xE6) == 0xE6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 17)) && (b & (1u << 30)) && (b & (1u << 31));  // F DQ BW VL
  f.avx2 = os_avx && avx2 && fma && f16c;
  f.avx512 = f.avx2 && os_avx512 && avx512;
  if (f.avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = a & (1u << 5);
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}
#endif

#if CPU_OFFLOAD_AARCH64
// Linux hwcap bits (asm/hwcap.h), spelled out so that old headers still build.
constexpr unsigned long kHwcapAsimd = 1ul << 1, kHwcapSve = 1ul << 22;
constexpr unsigned long kHwcap2SveBf16 = 1ul << 12, kHwcap2Bf16 = 1ul << 14;
constexpr int kPrSveGetVl = 51, kPrSveVlLenMask = 0xffff;  // PR_SVE_GET_VL, PR_SVE_VL_LEN_MASK

struct CpuFeatures {
  bool neon = false, neon_bf16 = false, sve_bf16 = false;
  int sve_bits = 0;  // this thread's SVE vector length; 0 without SVE
};

CpuFeatures detect() {
  CpuFeatures f;
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  f.neon = hwcap & kHwcapAsimd;
  f.neon_bf16 = f.neon && (hwcap2 & kHwcap2Bf16);
  if (hwcap & kHwcapSve) {
    // NOTE: the length the kernel gives this thread (and the pool threads it starts), which
    // may be shorter than the hardware's; each SVE build runs at exactly one length.
    const int vl = prctl(kPrSveGetVl, 0, 0, 0, 0);
    if (vl > 0) f.sve_bits = (vl & kPrSveVlLenMask) * 8;
    f.sve_bf16 = f.sve_bits > 0 && (hwcap2 & kHwcap2SveBf16);
  }
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect();
  return f;
}
#endif

bool always() { return true; }

const std::vector<IsaEntry>& isa_entries() {
  static const std::vector<IsaEntry> entries = {
      {"scalar", &kernel_table_scalar, &always},
#if CPU_OFFLOAD_X86
      {"avx2", &kernel_table_avx2, [] { return features().avx2; }},
      {"avx512", &kernel_table_avx512, [] { return features().avx512; }},
      {"avx512_bf16", &kernel_table_avx512_bf16, [] { return features().avx512_bf16; }},
#elif CPU_OFFLOAD_AARCH64
      // NOTE: least preferred first (best_table() takes the last supported entry). sve128
      // comes before neon: at equal width dispatch prefers NEON (see vec/sve.h); a wider
      // SVE build, when the vector length matches one, beats both.
      {"sve128", &kernel_table_sve128, [] { return features().sve_bits == 128; }},
      {"sve128_bf16", &kernel_table_sve128_bf16, [] { return features().sve_bits == 128 && features().sve_bf16; }},
      {"neon", &kernel_table_neon, [] { return features().neon; }},
      {"neon_bf16", &kernel_table_neon_bf16, [] { return features().neon_bf16; }},
      {"sve256", &kernel_table_sve256, [] { return features().sve_bits == 256; }},
      {"sve256_bf16", &kernel_table_sve256_bf16, [] { return features().sve_bits == 256 && features().sve_bf16; }},
      {"sve512", &kernel_table_sve512, [] { return features().sve_bits == 512; }},
      {"sve512_bf16", &kernel_table_sve512_bf16, [] { return features().sve_bits == 512 && features().sve_bf16; }},
#endif
  };
  return entries;
}

const KernelTable* best_table() {
  const KernelTable* best = nullptr;
  for (const auto& e : isa_entries())
    if (e.supported()) best = e.table();
  return best;
}

std::atomic<const KernelTable*>& active_slot() {
  static std::atomic<const KernelTable*> slot{best_table()};
  return slot;
}

}  // namespace

std::vector<std::string> known_isas() {
#if CPU_OFFLOAD_AARCH64
  return {"scalar", "sve128", "sve128_bf16", "neon", "neon_bf16", "sve256", "sve256_bf16", "sve512", "sve512_bf16"};
#else
  return {"scalar", "avx2", "avx512", "avx512_bf16"};
#endif
}

std::vector<std::string> available_isas() {
  std::vector<std::string> names;
  for (const auto& e : isa_entries())
    if (e.supported()) names.emplace_back(e.name);
  return names;
}

const KernelTable& active_kernels() { return *active_slot().load(std::memory_order_acquire); }

std::string active_isa() { return active_kernels().name; }

void set_active_isa(const std::string& name) {
  for (const auto& e : isa_entries()) {
    if (name != e.name) continue;
    if (!e.supported())
      throw std::invalid_argument("ISA '" + name + "' is not supported by this CPU");
    active_slot().store(e.table(), std::memory_order_release);
    return;
  }
  for (const auto& k : known_isas())
    if (k == name) throw std::invalid_argument("ISA '" + name + "' is not compiled into this build");
  throw std::invalid_argument("unknown ISA '" + name + "'");
}

}  // namespace cpu_offload
