// Float vector for AArch64 SVE, one build per vector length: 128, 256 or 512 bits
// (4, 8 or 16 lanes). Integer bf16 rounding identical to VecScalar::store_bf16. Compiled
// only inside the sve<bits> builds of kernels/isa_target.cpp (+sve -msve-vector-bits=<bits>).
//
// NOTE: fixed length, not vector-length agnostic. The kernels (kernels/optimizer_kernels.h)
// need a compile-time lane count V::N: the vector loop steps by it, the scalar tail and
// the bf16-output alignment head are sized by it. Sizeless SVE types (svfloat32_t) cannot
// give one, so each build fixes the length with -msve-vector-bits=<bits>, which turns the
// ACLE types into ordinary sized vectors (arm_sve_vector_bits) and every predicate into
// all-true. The price: a build only runs on a CPU whose vector length is exactly its own.
// dispatch.cpp reads the length the kernel gives this process (prctl(PR_SVE_GET_VL)) and
// offers only the matching build; on a length with no build (1024, 2048 bits) it falls
// back to NEON. The alternative, a vector type wrapping predicated VLA loops, would mean a
// second way of writing every kernel, which the one-source design rules out.
// NOTE: the vector length is a per-thread property: the pool's workers inherit it from the
// thread that starts them. A process that changes it with prctl(PR_SVE_SET_VL) after
// import must not use the SVE builds (set CPU_OFFLOAD_ISA=neon).
//
// Dispatch preference: SVE is picked only when its vector is wider than NEON's (A64FX 512,
// Graviton3 / Neoverse V1 256). At 128 bits (Grace / Neoverse V2, Graviton4) both do the
// same work per instruction on the same four 128-bit pipes and this kernel is memory-bound,
// so NEON (neon_bf16 on Grace) is preferred: it needs no length-matched build and has no
// predicate set-up. Unmeasured (no aarch64 machine here); CPU_OFFLOAD_ISA=sve128 forces
// the SVE build for a comparison on the hardware.
// NOTE: as in neon.h, only non-fused, correctly rounded operations: FMUL/FADD/FSUB, FDIV,
// FSQRT (no FMLA/FMAD, no FRECPE/FRSQRTE), all honouring FPCR like the scalar path.
#pragma once
#include <arm_sve.h>
#include <cstdint>

#if !defined(__ARM_FEATURE_SVE_BITS) || __ARM_FEATURE_SVE_BITS == 0
#error "vec/sve.h needs a fixed vector length: build with -msve-vector-bits=128|256|512"
#endif

namespace cpu_offload {
namespace {

typedef svfloat32_t SveF32 __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));
typedef svuint32_t SveU32 __attribute__((arm_sve_vector_bits(__ARM_FEATURE_SVE_BITS)));

struct VecSve {
  using F = SveF32;
  static constexpr int N = __ARM_FEATURE_SVE_BITS / 32;
  static svbool_t all() { return svptrue_b32(); }
  static F load(const float* p) { return svld1_f32(all(), p); }
  static void store(float* p, F x) { svst1_f32(all(), p, x); }
  // bf16 -> fp32 is exact: LD1H zero-extends each element into a 32-bit lane, the shift
  // makes its 16 bits the high half of the fp32 word.
  static F load_bf16(const uint16_t* p) {
    return svreinterpret_f32_u32(svlsl_n_u32_x(all(), svld1uh_u32(all(), p), 16));
  }
  // fp32 -> bf16, round to nearest even: the high half of u + 0x7FFF + lsb, where lsb is
  // bit 16 of u (the last bit kept), so a tie rounds up exactly when lsb is odd; the carry
  // out of the low half also rounds denormals and overflows to inf correctly. NaN -> 0x7FC0.
  // Returns the bf16 bits in the low half of each 32-bit lane (what ST1H stores).
  static SveU32 round_bf16(F x) {
    const svbool_t pg = all();
    const svuint32_t u = svreinterpret_u32_f32(x);
    const svuint32_t lsb = svand_n_u32_x(pg, svlsr_n_u32_x(pg, u, 16), 1);
    const svuint32_t r = svlsr_n_u32_x(pg, svadd_u32_x(pg, svadd_n_u32_x(pg, u, 0x7FFF), lsb), 16);
    // NOTE: the rounding sum is wrong for NaN (a payload can carry into the exponent or
    // past the sign): NaN lanes (unordered with themselves) take the canonical quiet NaN.
    return svsel_u32(svcmpuo_f32(pg, x, x), svdup_n_u32(0x7FC0), r);
  }
  // ST1H of 32-bit lanes stores the low 16 bits of each: the bf16 results, in order.
  static void store_bf16(uint16_t* p, F x) { svst1h_u32(all(), p, round_bf16(x)); }
  // NOTE: a regular store: SVE's non-temporal STNT1H stores only 16-bit lanes (it would
  // need a pack first), and Arm cores switch to write-streaming (no read-for-ownership)
  // by themselves for whole lines written in order. So no fence is needed either.
  static void stream_bf16(uint16_t* p, F x) { store_bf16(p, x); }
  static void stream_fence() {}
  static F set1(float x) { return svdup_n_f32(x); }
  static F add(F a, F b) { return svadd_f32_x(all(), a, b); }
  static F sub(F a, F b) { return svsub_f32_x(all(), a, b); }
  static F mul(F a, F b) { return svmul_f32_x(all(), a, b); }
  static F div(F a, F b) { return svdiv_f32_x(all(), a, b); }
  static F sqrt(F a) { return svsqrt_f32_x(all(), a); }
  // x < lo ? lo : x, as VecScalar: the compare is false for NaN and for -0 vs 0, so x stays.
  static F clamp_min(F x, F lo) { return svsel_f32(svcmplt_f32(all(), x, lo), lo, x); }
  // sign(x) in {-1, 0, +1}: (x > 0) - (x < 0) as floats, like VecScalar::sign; NaN -> +0.
  static F sign(F x) {
    const svbool_t pg = all();
    const svfloat32_t zero = svdup_n_f32(0.f), one = svdup_n_f32(1.f);
    const svfloat32_t pos = svsel_f32(svcmpgt_n_f32(pg, x, 0.f), one, zero);
    const svfloat32_t neg = svsel_f32(svcmplt_n_f32(pg, x, 0.f), one, zero);
    return svsub_f32_x(pg, pos, neg);
  }
};

}  // namespace
}  // namespace cpu_offload
