// AVX-512 with the BF16 conversion instruction (vcvtneps2bf16) for the bf16 store.
// NOTE: the instruction flushes denormal inputs to zero and keeps NaN payloads, unlike
// c10::BFloat16; those lanes are patched with the integer rounding so the result stays
// bit-identical to VecScalar::store_bf16. Compiled only in the avx512_bf16 build.
#pragma once
#include "avx512.h"

namespace cpu_offload {
namespace {

struct VecAvx512Bf16 : VecAvx512 {
  static __m256i round_bf16(F x) {
    __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
    // fpclass 0x81: quiet or signalling NaN; 0x20: denormal.
    __mmask16 special = _mm512_fpclass_ps_mask(x, 0x81 | 0x20);
    if (special) r = _mm256_mask_blend_epi16(special, r, VecAvx512::round_bf16(x));
    return r;
  }
  static void store_bf16(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16(x)); }
  static void stream_bf16(uint16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), round_bf16(x)); }
};

}  // namespace
}  // namespace cpu_offload
