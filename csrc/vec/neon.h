// 4-lane float vector for AArch64 Advanced SIMD (NEON, every ARMv8-A CPU). Integer bf16
// rounding identical to VecScalar::store_bf16. Compiled only inside the neon builds of
// kernels/isa_target.cpp (-march=armv8-a).
// NOTE: on AArch64 (unlike AArch32 NEON) vector arithmetic honours FPCR exactly as the
// scalar FP instructions do: the same rounding, the same NaN propagation, and no
// flush-to-zero while FPCR.FZ is 0, which pool.cpp guarantees for every kernel call. Only
// the non-fused, correctly rounded instructions are used: FMUL/FADD/FSUB, FDIV (never a
// reciprocal estimate) and FSQRT (never FRSQRTE); nothing here may become FMLA/FMLS.
#pragma once
#include <arm_neon.h>
#include <cstdint>

namespace cpu_offload {
namespace {

struct VecNeon {
  using F = float32x4_t;
  static constexpr int N = 4;
  static F load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  // bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word (USHLL #16).
  static F load_bf16(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  // fp32 -> bf16, round to nearest even: the high half of u + 0x7FFF + lsb, where lsb is
  // bit 16 of u (the last bit kept), so a tie rounds up exactly when lsb is odd; the carry
  // out of the low half also rounds denormals and overflows to inf correctly. NaN -> 0x7FC0.
  static uint16x4_t round_bf16(F x) {
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t r = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb);
    // NOTE: the rounding sum is wrong for NaN (a payload can carry into the exponent or
    // past the sign), so NaN lanes (x != x) take the canonical quiet NaN; one select.
    const uint32x4_t not_nan = vceqq_f32(x, x);
    return vshrn_n_u32(vbslq_u32(not_nan, r, vdupq_n_u32(0x7FC00000)), 16);
  }
  static void store_bf16(uint16_t* p, F x) { vst1_u16(p, round_bf16(x)); }
  // NOTE: a regular store. AArch64 has no single-register non-temporal store (STNP needs a
  // pair, and 4 bf16 are 8 bytes), and Arm cores switch to write-streaming (no
  // read-for-ownership, no allocation) by themselves when whole lines are written in order,
  // which is what this output stream does. So no fence is needed either.
  static void stream_bf16(uint16_t* p, F x) { store_bf16(p, x); }
  static void stream_fence() {}
  static F set1(float x) { return vdupq_n_f32(x); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F sqrt(F a) { return vsqrtq_f32(a); }
  // x < lo ? lo : x, as VecScalar: the compare is false for NaN and for -0 vs 0, so x stays.
  static F clamp_min(F x, F lo) { return vbslq_f32(vcltq_f32(x, lo), lo, x); }
  // sign(x) in {-1, 0, +1}: (x > 0) - (x < 0) as floats, like VecScalar::sign; NaN -> +0.
  static F sign(F x) {
    const F zero = vdupq_n_f32(0.f);
    const uint32x4_t one = vreinterpretq_u32_f32(vdupq_n_f32(1.f));
    const F pos = vreinterpretq_f32_u32(vandq_u32(vcgtq_f32(x, zero), one));
    const F neg = vreinterpretq_f32_u32(vandq_u32(vcltq_f32(x, zero), one));
    return vsubq_f32(pos, neg);
  }
};

}  // namespace
}  // namespace cpu_offload
