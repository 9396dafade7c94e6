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
  static F load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static __m256i round_bf16(F x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(is_nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
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
  static F sign(F x) {
    const F zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.f);
    F pos = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ), one);
    F neg = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, zero, _CMP_LT_OQ), one);
    return _mm512_sub_ps(pos, neg);
  }
};

}  // namespace
}  // namespace cpu_offload
