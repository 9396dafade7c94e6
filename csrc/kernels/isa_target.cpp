// One kernel build per ISA target: setup.py compiles this file once for each target with
// -DCPU_OFFLOAD_TARGET=<n> and that target's -m flags. Everything here has internal
// linkage (anonymous namespaces), so no inline function compiled for a wider ISA can be
// picked by the linker for a narrower one; only the kernel_table_<isa>() getter is exported.
#include "optimizer_kernels.h"

#define CPU_OFFLOAD_TARGET_SCALAR 0
#define CPU_OFFLOAD_TARGET_AVX2 1
#define CPU_OFFLOAD_TARGET_AVX512 2
#define CPU_OFFLOAD_TARGET_AVX512_BF16 3
#define CPU_OFFLOAD_TARGET_NEON 4
#define CPU_OFFLOAD_TARGET_NEON_BF16 5
#define CPU_OFFLOAD_TARGET_SVE 6        // the length comes from -msve-vector-bits (vec/sve.h)
#define CPU_OFFLOAD_TARGET_SVE_BF16 7

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
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_NEON
#include "../vec/neon.h"
namespace cpu_offload {
const KernelTable* kernel_table_neon() { return KernelsFor<VecNeon>::table("neon"); }
}  // namespace cpu_offload
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_NEON_BF16
#include "../vec/neon_bf16.h"
namespace cpu_offload {
const KernelTable* kernel_table_neon_bf16() { return KernelsFor<VecNeonBf16>::table("neon_bf16"); }
}  // namespace cpu_offload
#elif CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_SVE || CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_SVE_BF16
#if CPU_OFFLOAD_TARGET == CPU_OFFLOAD_TARGET_SVE
#include "../vec/sve.h"
#define CPU_OFFLOAD_SVE_VEC VecSve
#define CPU_OFFLOAD_SVE_SUFFIX
#else
#include "../vec/sve_bf16.h"
#define CPU_OFFLOAD_SVE_VEC VecSveBf16
#define CPU_OFFLOAD_SVE_SUFFIX _bf16
#endif
// kernel_table_sve<bits>[_bf16](), named "sve<bits>[_bf16]".
#define CPU_OFFLOAD_CAT3(a, b, c) a##b##c
#define CPU_OFFLOAD_SVE_GETTER(bits, suffix) CPU_OFFLOAD_CAT3(kernel_table_sve, bits, suffix)
#define CPU_OFFLOAD_STR(x) #x
#define CPU_OFFLOAD_SVE_NAME(bits, suffix) "sve" CPU_OFFLOAD_STR(bits) CPU_OFFLOAD_STR(suffix)
#if __ARM_FEATURE_SVE_BITS != 128 && __ARM_FEATURE_SVE_BITS != 256 && __ARM_FEATURE_SVE_BITS != 512
#error "SVE builds exist for -msve-vector-bits=128, 256 and 512"
#endif
namespace cpu_offload {
const KernelTable* CPU_OFFLOAD_SVE_GETTER(__ARM_FEATURE_SVE_BITS, CPU_OFFLOAD_SVE_SUFFIX)() {
  return KernelsFor<CPU_OFFLOAD_SVE_VEC>::table(CPU_OFFLOAD_SVE_NAME(__ARM_FEATURE_SVE_BITS, CPU_OFFLOAD_SVE_SUFFIX));
}
}  // namespace cpu_offload
#else
#error "unknown CPU_OFFLOAD_TARGET"
#endif
