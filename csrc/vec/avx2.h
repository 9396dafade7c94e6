// 8-lane float vector for AVX2 (+FMA/F16C targets). Integer bf16 rounding identical to
// VecScalar::store_bf16. Compiled only inside the avx2 build of kernels/isa_target.cpp.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace cpu_offload {
namespace {

struct VecAvx2 {
  using F = __m256;
  static constexpr int N = 8;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16(x)); }
  // Non-temporal store of 8 bf16; p must be 16-byte aligned.
  static void stream_bf16(uint16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), round_bf16(x)); }
  static void stream_fence() { _mm_sfence(); }
  static __m128i round_bf16(F x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), is_nan);
    // NOTE: packus works per 128-bit lane; the permute puts the 8 results in order.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    return _mm256_castsi256_si128(packed);
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F sign(F x) {
    const F zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
    F pos = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), one);
    F neg = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one);
    return _mm256_sub_ps(pos, neg);
  }
};

}  // namespace
}  // namespace cpu_offload
