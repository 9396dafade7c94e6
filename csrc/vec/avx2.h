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
  // bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word.
  // NOTE: the 8 bf16 are loaded into both 128-bit lanes (a broadcast load costs no shuffle
  // port) and one in-lane byte shuffle moves elements 0-3 (low lane) and 4-7 (high lane)
  // into the high halves of the dwords, zeroing the low halves.
  static F load_bf16(const uint16_t* p) {
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i to_high_half = _mm256_setr_epi8(-1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
                                                  -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(both, to_high_half));
  }
  static void store_bf16(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), round_bf16(x)); }
  // Non-temporal store of 8 bf16; p must be 16-byte aligned.
  static void stream_bf16(uint16_t* p, F x) { _mm_stream_si128(reinterpret_cast<__m128i*>(p), round_bf16(x)); }
  static void stream_fence() { _mm_sfence(); }
  // fp32 -> bf16, round to nearest even: the high half of u + 0x7FFF + lsb, where lsb is
  // bit 16 of u (the last bit kept), so a tie rounds up exactly when lsb is odd; the carry
  // out of the low half also rounds denormals and overflows to inf correctly. NaN -> 0x7FC0.
  static __m128i round_bf16(F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
    // NOTE: the rounding sum is wrong for NaN (a payload can carry into the exponent or
    // past the sign), so NaN lanes are replaced by the canonical quiet NaN; NaN is rare, so
    // the test costs a compare and a movemask and the blend runs only when one is present.
    const __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    if (_mm256_movemask_ps(is_nan))
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(is_nan));
    // The high halves (bytes 2-3 of each dword) go to the low 8 bytes of each 128-bit lane;
    // the permute joins the two lanes' low 8 bytes into the 8 results in order.
    const __m256i high_halves = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                                 2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, high_halves), 0x08);
    return _mm256_castsi256_si128(packed);
  }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  // maxps(lo, x) answers x when either is NaN or both are zero: x < lo ? lo : x, as VecScalar.
  static F clamp_min(F x, F lo) { return _mm256_max_ps(lo, x); }
  static F sign(F x) {
    const F zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.f);
    F pos = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ), one);
    F neg = _mm256_and_ps(_mm256_cmp_ps(x, zero, _CMP_LT_OQ), one);
    return _mm256_sub_ps(pos, neg);
  }
};

}  // namespace
}  // namespace cpu_offload
