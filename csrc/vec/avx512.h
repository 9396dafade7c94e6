// 16-lane float vector for AVX-512 F/BW/VL/DQ. Integer bf16 rounding identical to
// VecScalar::store_bf16. Compiled only inside the avx512 builds of kernels/isa_target.cpp.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace cpu_offload {
namespace {

struct VecAvx512 {
  using F = __m512;
  static constexpr int N = 16;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  // bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word.
  // NOTE: one word permute does the widening: odd words (high halves) take elements 0-15 of
  // the 256-bit load, the zero mask clears the even words (low halves).
  static F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i to_high_half = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                                  7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high_half, w));
  }
  // fp32 -> bf16, round to nearest even: the high half of u + 0x7FFF + lsb, where lsb is
  // bit 16 of u (the last bit kept), so a tie rounds up exactly when lsb is odd; the carry
  // out of the low half also rounds denormals and overflows to inf correctly. NaN -> 0x7FC0.
  static __m256i round_bf16(F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    // NOTE: one masked word permute gathers the 16 high halves into the low 256 bits and
    // puts the canonical NaN in the lanes of NaN inputs (mask bit i: element i is not NaN),
    // where the rounding sum is wrong (a payload can carry into the exponent or the sign).
    const __mmask32 not_nan = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    const __m512i high_halves = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                 31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_castsi512_si256(
        _mm512_mask_permutexvar_epi16(_mm512_set1_epi16(0x7FC0), not_nan, high_halves, r));
  }
  static void store_bf16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round_bf16(x));
  }
  // Non-temporal store of 16 bf16; p must be 32-byte aligned.
  static void stream_bf16(uint16_t* p, F x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), round_bf16(x)); }
  static void stream_fence() { _mm_sfence(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  // maxps(lo, x) answers x when either is NaN or both are zero: x < lo ? lo : x, as VecScalar.
  static F clamp_min(F x, F lo) { return _mm512_max_ps(lo, x); }
  static F sign(F x) {
    const F zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
    F pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), one);
    F neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one);
    return _mm512_sub_ps(pos, neg);
  }
};

}  // namespace
}  // namespace cpu_offload
