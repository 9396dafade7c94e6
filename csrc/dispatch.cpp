// CPU feature detection with cpuid/xgetbv (the OS must also save the wider registers),
// and the table of kernel builds by ISA. Non-x86 builds know only the scalar path.
#include "dispatch.h"
#include <atomic>
#include <stdexcept>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#define CPU_OFFLOAD_X86 1
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

bool always() { return true; }

const std::vector<IsaEntry>& isa_entries() {
  static const std::vector<IsaEntry> entries = {
      {"scalar", &kernel_table_scalar, &always},
#if CPU_OFFLOAD_X86
      {"avx2", &kernel_table_avx2, [] { return features().avx2; }},
      {"avx512", &kernel_table_avx512, [] { return features().avx512; }},
      {"avx512_bf16", &kernel_table_avx512_bf16, [] { return features().avx512_bf16; }},
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

std::vector<std::string> known_isas() { return {"scalar", "avx2", "avx512", "avx512_bf16"}; }

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
