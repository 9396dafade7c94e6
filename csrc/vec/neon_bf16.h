// NEON with the ARMv8.6 BF16 conversion instruction (BFCVTN, FEAT_BF16) for the bf16
// store; everything else is VecNeon. Compiled only in the neon_bf16 build (+bf16).
// NOTE: BFCVTN rounds to nearest even per FPCR.RMode, and with FPCR.FZ = 0 (pool.cpp sets
// the default FPCR around every kernel call) it rounds denormals exactly, as the integer
// path does. It keeps a NaN's sign and payload (quietened) instead of giving 0x7FC0, so
// NaN lanes are patched with the canonical NaN: the result stays bit-identical to
// VecScalar::store_bf16.
#pragma once
#include "neon.h"

namespace cpu_offload {
namespace {

struct VecNeonBf16 : VecNeon {
  static uint16x4_t round_bf16(F x) {
    const uint16x4_t r = vreinterpret_u16_bf16(vcvt_bf16_f32(x));
    const uint16x4_t not_nan = vmovn_u32(vceqq_f32(x, x));
    return vbsl_u16(not_nan, r, vdup_n_u16(0x7FC0));
  }
  static void store_bf16(uint16_t* p, F x) { vst1_u16(p, round_bf16(x)); }
  static void stream_bf16(uint16_t* p, F x) { store_bf16(p, x); }  // see VecNeon::stream_bf16
};

}  // namespace
}  // namespace cpu_offload
