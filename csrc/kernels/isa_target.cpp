// One kernel build per ISA target: setup.py compiles this file once for each target with
// -DCPU_OFFLOAD_TARGET=<n> and that target's -m flags. Everything here has internal
// linkage (anonymous namespaces), so no inline function compiled for a wider ISA can be
// picked by the linker for a narrower one; only the kernel_table_<isa>() getter is exported.
#include "optimizer_kernels.h"

#define CPU_OFFLOAD_TARGET_SCALAR 0
#define CPU_OFFLOAD_TARGET_AVX2 1
#define CPU_OFFLOAD_TARGET_AVX512 2
#define CPU_OFFLOAD_TARGET_AVX512_BF16 3

#if !defined(CPU_OFFLOAD_TARGET)
#error "CPU_OFFLOAD_TARGET must be defined by the build"
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_SCALAR
namespace cpu_offload {
const KernelTable* kernel_table_scalar() { return KernelsFor<VecScalar>::table("scalar"); }
}  // namespace cpu_offload
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_AVX2
#include "../vec/avx2.h"
namespace cpu_offload {
const KernelTable* kernel_table_avx2() { return KernelsFor<VecAvx2>::table("avx2"); }
}  // namespace cpu_offload
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_AVX512
#include "../vec/avx512.h"
namespace cpu_offload {
const KernelTable* kernel_table_avx512() { return KernelsFor<VecAvx512>::table("avx512"); }
}  // namespace cpu_offload
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_AVX512_BF16
#include "../vec/avx512_bf16.h"
namespace cpu_offload {
const KernelTable* kernel_table_avx512_bf16() {
  return KernelsFor<VecAvx512Bf16>::table("avx512_bf16");
}
}  // namespace cpu_offload
#else
#error "unknown CPU_OFFLOAD_TARGET"
#endif
