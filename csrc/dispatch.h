// CPU feature detection (once) and the active kernel table. The best ISA the CPU and OS
// support is chosen on first use; set_active_isa() overrides it (CPU_OFFLOAD_ISA).
#pragma once
#include <string>
#include <vector>
#include "kernel_table.h"

namespace cpu_offload {

// ISA names from least to most preferred: x86-64 "scalar", "avx2", "avx512", "avx512_bf16";
// aarch64 "scalar", "sve128", "sve128_bf16", "neon", "neon_bf16", "sve256", "sve256_bf16",
// "sve512", "sve512_bf16" (an SVE build runs only at its own vector length, vec/sve.h).
std::vector<std::string> known_isas();
std::vector<std::string> available_isas();   // compiled in and supported by this CPU
const KernelTable& active_kernels();
std::string active_isa();
// Throws std::invalid_argument for an unknown name or one this CPU cannot run.
void set_active_isa(const std::string& name);

}  // namespace cpu_offload
