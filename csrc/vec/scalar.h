// The scalar "vector" of width 1: the reference every ISA must equal bit for bit, and
// the tail loop of every vector kernel. Same operation set as vec/avx2.h and vec/avx512.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace cpu_offload {
namespace {

// fp32 -> bf16, round to nearest even, exactly like c10::BFloat16 (NaN -> 0x7FC0).
inline uint16_t bf16_round_scalar(float x) {
  if (std::isnan(x)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

struct VecScalar {
  using F = float;
  static constexpr int N = 1;
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  static F load_bf16(const uint16_t* p) {
    uint32_t u = static_cast<uint32_t>(*p) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static void store_bf16(uint16_t* p, F x) { *p = bf16_round_scalar(x); }
  static void stream_bf16(uint16_t* p, F x) { *p = bf16_round_scalar(x); }
  static void stream_fence() {}
  static F set1(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  // x < lo ? lo : x, like torch.clamp(x, min=lo): NaN stays NaN, -0 stays -0 for lo = 0.
  static F clamp_min(F x, F lo) { return x < lo ? lo : x; }
  // sign(x) in {-1, 0, +1}; NaN -> 0, like torch.sign on the CPU.
  static F sign(F x) { return static_cast<float>(x > 0.f) - static_cast<float>(x < 0.f); }
};

}  // namespace
}  // namespace cpu_offload
