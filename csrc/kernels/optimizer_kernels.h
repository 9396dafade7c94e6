// The optimizer math, written once as templates over a vector type V (vec/*.h).
// Every kernel is a vector loop over whole vectors followed, right under it, by a scalar
// tail doing the same operations through VecScalar (and, for a streamed bf16 output, a
// scalar head up to alignment), so any split of the work gives the same bits. Each forward
// step has its inverse here too (the rollback of a speculative step, see "inverse steps").
// NOTE: no fused multiply-add anywhere (and -ffp-contract=off in the build):
// each step is one correctly rounded IEEE operation, which is what makes every ISA equal
// the scalar path and the pure-torch reference (cpu_offload/reference.py) bit for bit.
#pragma once
#include <cstdint>
#include "../kernel_table.h"
#include "../vec/scalar.h"

namespace cpu_offload {
namespace {

// Loads elements of dtype D as fp32 (bf16 widens exactly: its bits become the high half).
template <class V, DType D>
inline typename V::F load_f32(const void* src, int64_t i) {
  if constexpr (D == DType::f32) return V::load(static_cast<const float*>(src) + i);
  else return V::load_bf16(static_cast<const uint16_t*>(src) + i);
}

// Stores an fp32 moment back as dtype M; bf16 rounds to nearest even like
// tensor.to(torch.bfloat16). NOTE: regular stores: the lines were just read (the moments
// are updated in place), so a non-temporal store would save no traffic.
template <class V, DType M>
inline void store_moment(void* dst, int64_t i, typename V::F x) {
  if constexpr (M == DType::f32) V::store(static_cast<float*>(dst) + i, x);
  else V::store_bf16(static_cast<uint16_t*>(dst) + i, x);
}

// NOTE: the bf16 compute copy is a write-only stream (and, in full offload, pinned memory
// read next by a DMA engine), so the vector body writes it with non-temporal stores: no
// read-for-ownership of lines about to be overwritten, 2 bytes less traffic per element.
// Those stores need vector alignment; elements before the first aligned one take the
// scalar path, which gives the same bits. stream_fence() orders them before the return.
template <class V, OutKind O>
inline void store_out(void* out, int64_t i, typename V::F x) {
  if constexpr (O == OutKind::f32) V::store(static_cast<float*>(out) + i, x);
  else if constexpr (O == OutKind::bf16) V::stream_bf16(static_cast<uint16_t*>(out) + i, x);
}

// Elements to run through the scalar path so that out + i is aligned for stream_bf16.
template <class V, OutKind O>
inline int64_t unaligned_head(const void* out, int64_t n) {
  if constexpr (O != OutKind::bf16 || V::N == 1) return 0;
  const uintptr_t bytes = V::N * sizeof(uint16_t);
  const uintptr_t misalign = reinterpret_cast<uintptr_t>(out) % bytes;
  if (misalign % sizeof(uint16_t) != 0) return n;  // cannot align: all scalar
  const int64_t head = misalign == 0 ? 0 : static_cast<int64_t>((bytes - misalign) / sizeof(uint16_t));
  return head < n ? head : n;
}

// Prefetches element j of each input stream of an AdamW pass (a hint: it never faults and
// changes no result). The address is formed as an integer: j may lie past the range.
template <DType G, DType M>
inline void adamw_prefetch(const float* param, const void* grad, const void* exp_avg,
                           const void* exp_avg_sq, int64_t j) {
  constexpr int64_t gsz = G == DType::f32 ? 4 : 2, msz = M == DType::f32 ? 4 : 2;
  auto at = [j](const void* base, int64_t size) {
    return reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(j * size));
  };
  __builtin_prefetch(at(param, 4), 1, 3);
  __builtin_prefetch(at(grad, gsz), 0, 3);
  __builtin_prefetch(at(exp_avg, msz), 1, 3);
  __builtin_prefetch(at(exp_avg_sq, msz), 1, 3);
}

// NOTE: the AdamW vector loops prefetch their inputs this many elements ahead: the hardware
// prefetchers alone keep too few lines in flight for five streams per thread. Measured on
// one H200 host (16 Xeon cores, 15 pool threads, 270M elements in 256 MiB-slot calls, arms
// alternated in one process): with bf16 moments 44.8 -> 39.2 ms a pass, with fp32 moments
// 58.2 -> 51.8 ms, which is the host's read-modify-write probe; 512 to 4096 elements ahead
// were within 3% of each other (benchmarks/README.md, "Software prefetch in the AdamW pass").
constexpr int64_t kAdamWPrefetchAhead = 2048;

// ---- AdamW (torch.optim.AdamW semantics, decoupled weight decay) ----
// G: gradient dtype; M: moment dtype (both moments). NOTE: with bf16 moments, m and v are
// computed in fp32 from the widened loads and the parameter update uses those unrounded
// values; only what is stored back is rounded to bf16.
template <class V, DType G, DType M, OutKind O>
inline void adamw_at(const AdamWScalars& s, float* param, const void* grad, void* exp_avg,
                     void* exp_avg_sq, void* out, int64_t i) {
  using F = typename V::F;
  F g = V::mul(load_f32<V, G>(grad, i), V::set1(s.grad_scale));
  F p = V::mul(V::load(param + i), V::set1(s.decay));                        // p * (1 - lr*wd)
  F m = V::add(V::mul(load_f32<V, M>(exp_avg, i), V::set1(s.beta1)),
               V::mul(g, V::set1(s.one_minus_beta1)));                       // m = b1*m + (1-b1)*g
  F v = V::add(V::mul(load_f32<V, M>(exp_avg_sq, i), V::set1(s.beta2)),
               V::mul(V::mul(g, V::set1(s.one_minus_beta2)), g));            // v = b2*v + (1-b2)*g*g
  F denom = V::add(V::sqrt(v), V::set1(s.eps_hat));                          // sqrt(v) + eps_hat
  p = V::add(p, V::div(V::mul(V::set1(s.neg_step_size), m), denom));         // p - step_size * m / denom
  V::store(param + i, p);
  store_moment<V, M>(exp_avg, i, m);
  store_moment<V, M>(exp_avg_sq, i, v);
  store_out<V, O>(out, i, p);
}

template <class V, DType G, DType M, OutKind O>
void adamw_range(const AdamWScalars& scalars, float* param, const void* grad, void* exp_avg,
                 void* exp_avg_sq, void* out, int64_t n) {
  // NOTE: a local copy: stores through the float pointers could alias the caller's struct,
  // which would force a reload and broadcast of every constant in every iteration.
  const AdamWScalars s = scalars;
  int64_t i = 0;
  for (const int64_t head = unaligned_head<V, O>(out, n); i < head; ++i)
    adamw_at<VecScalar, G, M, O>(s, param, grad, exp_avg, exp_avg_sq, out, i);
  if constexpr (V::N > 1) {
    for (; i + V::N <= n - kAdamWPrefetchAhead; i += V::N) {
      adamw_prefetch<G, M>(param, grad, exp_avg, exp_avg_sq, i + kAdamWPrefetchAhead);
      adamw_at<V, G, M, O>(s, param, grad, exp_avg, exp_avg_sq, out, i);
    }
  }
  for (; i + V::N <= n; i += V::N) adamw_at<V, G, M, O>(s, param, grad, exp_avg, exp_avg_sq, out, i);
  for (; i < n; ++i) adamw_at<VecScalar, G, M, O>(s, param, grad, exp_avg, exp_avg_sq, out, i);
  if constexpr (O == OutKind::bf16) V::stream_fence();
}

// ---- SignSGD ----
template <class V, DType G, OutKind O>
inline void sign_sgd_at(const SignSGDScalars& s, float* param, const void* grad, void* out, int64_t i) {
  using F = typename V::F;
  // NOTE: sign(g*c) is sign(g) unless g*c rounds to 0 (c == 0, or a tiny g and c <= 0.5):
  // the product is taken as torch's clipped gradient takes it.
  const F g = V::mul(load_f32<V, G>(grad, i), V::set1(s.grad_scale));
  F p = V::mul(V::load(param + i), V::set1(s.decay));  // p * (1 - lr*wd)
  p = V::sub(p, V::mul(V::set1(s.lr), V::sign(g)));    // p - lr * sign(g*c)
  V::store(param + i, p);
  store_out<V, O>(out, i, p);
}

template <class V, DType G, OutKind O>
void sign_sgd_range(const SignSGDScalars& scalars, float* param, const void* grad, void* out, int64_t n) {
  const SignSGDScalars s = scalars;  // local copy, see adamw_range
  int64_t i = 0;
  for (const int64_t head = unaligned_head<V, O>(out, n); i < head; ++i)
    sign_sgd_at<VecScalar, G, O>(s, param, grad, out, i);
  for (; i + V::N <= n; i += V::N) sign_sgd_at<V, G, O>(s, param, grad, out, i);
  for (; i < n; ++i) sign_sgd_at<VecScalar, G, O>(s, param, grad, out, i);
  if constexpr (O == OutKind::bf16) V::stream_fence();
}

// ---- inverse steps: undo one forward step in place ----
// From the state after one step (p1, m1, v1), the gradient that made it and the scalars
// of that step (the same AdamWScalars, so u below has the forward's bits):
//   u = nss*m1/(sqrt(v1) + eps_hat)
//   p0 = (p1 - u)/decay;  m0 = (m1 - (1-b1)*g)/b1;  v0 = max((v1 - ((1-b2)*g)*g)/b2, 0)
// with the division skipped when decay == 0 and a moment whose beta is 0 set to 0 (it
// carries nothing of its old value). NOTE: exact only to float32 rounding: the masters come
// back within about one ulp, the moments within a few ulps of the larger of their terms;
// with bf16 moments u is recomputed from the rounded m1, v1 (off by up to about 2**-8 of
// |u|). The full error model is the header of cpu_offload/_full/rollback.py.
template <class V, DType G, DType M>
inline void adamw_inverse_at(const AdamWScalars& s, float* param, const void* grad, void* exp_avg,
                             void* exp_avg_sq, int64_t i) {
  using F = typename V::F;
  const F zero = V::set1(0.f);
  F g = V::mul(load_f32<V, G>(grad, i), V::set1(s.grad_scale));
  F m = load_f32<V, M>(exp_avg, i);
  F v = load_f32<V, M>(exp_avg_sq, i);
  F denom = V::add(V::sqrt(v), V::set1(s.eps_hat));                          // sqrt(v1) + eps_hat
  F p = V::sub(V::load(param + i), V::div(V::mul(V::set1(s.neg_step_size), m), denom));  // p' = p1 - u
  // NOTE: x/1 == x exactly, so skipping a decay of 1 (wd == 0) saves a division, same bits.
  if (s.decay != 0.f && s.decay != 1.f) p = V::div(p, V::set1(s.decay));    // p0 = p' / (1 - lr*wd)
  m = s.beta1 != 0.f ? V::div(V::sub(m, V::mul(g, V::set1(s.one_minus_beta1))), V::set1(s.beta1))
                     : zero;                                                 // m0 = (m1 - (1-b1)*g)/b1
  v = s.beta2 != 0.f ? V::clamp_min(V::div(V::sub(v, V::mul(V::mul(g, V::set1(s.one_minus_beta2)), g)),
                                           V::set1(s.beta2)), zero)
                     : zero;                                                 // v0 = max((v1 - (1-b2)*g*g)/b2, 0)
  V::store(param + i, p);
  store_moment<V, M>(exp_avg, i, m);
  store_moment<V, M>(exp_avg_sq, i, v);
}

template <class V, DType G, DType M>
void adamw_inverse_range(const AdamWScalars& scalars, float* param, const void* grad, void* exp_avg,
                         void* exp_avg_sq, int64_t n) {
  const AdamWScalars s = scalars;  // local copy, see adamw_range
  int64_t i = 0;
  if constexpr (V::N > 1) {  // prefetch as adamw_range does
    for (; i + V::N <= n - kAdamWPrefetchAhead; i += V::N) {
      adamw_prefetch<G, M>(param, grad, exp_avg, exp_avg_sq, i + kAdamWPrefetchAhead);
      adamw_inverse_at<V, G, M>(s, param, grad, exp_avg, exp_avg_sq, i);
    }
  }
  for (; i + V::N <= n; i += V::N) adamw_inverse_at<V, G, M>(s, param, grad, exp_avg, exp_avg_sq, i);
  for (; i < n; ++i) adamw_inverse_at<VecScalar, G, M>(s, param, grad, exp_avg, exp_avg_sq, i);
}

// SignSGD: p0 = (p1 + lr*sign(g*c))/decay, the division skipped when decay == 0.
template <class V, DType G>
inline void sign_sgd_inverse_at(const SignSGDScalars& s, float* param, const void* grad, int64_t i) {
  using F = typename V::F;
  const F g = V::mul(load_f32<V, G>(grad, i), V::set1(s.grad_scale));
  F p = V::add(V::load(param + i), V::mul(V::set1(s.lr), V::sign(g)));  // p1 + lr*sign(g*c)
  if (s.decay != 0.f && s.decay != 1.f) p = V::div(p, V::set1(s.decay));                   // / (1 - lr*wd)
  V::store(param + i, p);
}

template <class V, DType G>
void sign_sgd_inverse_range(const SignSGDScalars& scalars, float* param, const void* grad, int64_t n) {
  const SignSGDScalars s = scalars;  // local copy, see adamw_range
  int64_t i = 0;
  for (; i + V::N <= n; i += V::N) sign_sgd_inverse_at<V, G>(s, param, grad, i);
  for (; i < n; ++i) sign_sgd_inverse_at<VecScalar, G>(s, param, grad, i);
}

// ---- gradient accumulation: acc <- g (copy) or acc <- acc + g ----
template <class V, DType G, bool Add>
void accumulate_range(float* acc, const void* grad, int64_t n) {
  int64_t i = 0;
  for (; i + V::N <= n; i += V::N) {
    auto g = load_f32<V, G>(grad, i);
    V::store(acc + i, Add ? V::add(V::load(acc + i), g) : g);
  }
  for (; i < n; ++i) {
    float g = load_f32<VecScalar, G>(grad, i);
    acc[i] = Add ? acc[i] + g : g;
  }
}

// ---- bandwidth probe: one read and one write per element ----
template <class V>
void scale_stream_range(float* x, float factor, int64_t n) {
  int64_t i = 0;
  for (; i + V::N <= n; i += V::N) V::store(x + i, V::mul(V::load(x + i), V::set1(factor)));
  for (; i < n; ++i) x[i] = x[i] * factor;
}

// ---- runtime (dtype, output) -> template instantiation ----
template <class V>
struct KernelsFor {
  template <DType G, DType M>
  static void adamw_gm(const AdamWScalars& s, float* p, const void* g, void* m, void* v, void* out,
                       OutKind o, int64_t n) {
    switch (o) {
      case OutKind::none: return adamw_range<V, G, M, OutKind::none>(s, p, g, m, v, out, n);
      case OutKind::f32: return adamw_range<V, G, M, OutKind::f32>(s, p, g, m, v, out, n);
      case OutKind::bf16: return adamw_range<V, G, M, OutKind::bf16>(s, p, g, m, v, out, n);
    }
  }
  template <DType G>
  static void adamw_g(const AdamWScalars& s, float* p, const void* g, void* m, void* v, DType md,
                      void* out, OutKind o, int64_t n) {
    if (md == DType::f32) adamw_gm<G, DType::f32>(s, p, g, m, v, out, o, n);
    else adamw_gm<G, DType::bf16>(s, p, g, m, v, out, o, n);
  }
  static void adamw(const AdamWScalars& s, float* p, const void* g, DType gd, void* m, void* v,
                    DType md, void* out, OutKind o, int64_t n) {
    if (gd == DType::f32) adamw_g<DType::f32>(s, p, g, m, v, md, out, o, n);
    else adamw_g<DType::bf16>(s, p, g, m, v, md, out, o, n);
  }
  template <DType G>
  static void sign_sgd_g(const SignSGDScalars& s, float* p, const void* g, void* out, OutKind o, int64_t n) {
    switch (o) {
      case OutKind::none: return sign_sgd_range<V, G, OutKind::none>(s, p, g, out, n);
      case OutKind::f32: return sign_sgd_range<V, G, OutKind::f32>(s, p, g, out, n);
      case OutKind::bf16: return sign_sgd_range<V, G, OutKind::bf16>(s, p, g, out, n);
    }
  }
  static void sign_sgd(const SignSGDScalars& s, float* p, const void* g, DType gd, void* out,
                       OutKind o, int64_t n) {
    if (gd == DType::f32) sign_sgd_g<DType::f32>(s, p, g, out, o, n);
    else sign_sgd_g<DType::bf16>(s, p, g, out, o, n);
  }
  static void adamw_inverse(const AdamWScalars& s, float* p, const void* g, DType gd, void* m, void* v,
                            DType md, int64_t n) {
    if (gd == DType::f32) md == DType::f32 ? adamw_inverse_range<V, DType::f32, DType::f32>(s, p, g, m, v, n)
                                           : adamw_inverse_range<V, DType::f32, DType::bf16>(s, p, g, m, v, n);
    else md == DType::f32 ? adamw_inverse_range<V, DType::bf16, DType::f32>(s, p, g, m, v, n)
                          : adamw_inverse_range<V, DType::bf16, DType::bf16>(s, p, g, m, v, n);
  }
  static void sign_sgd_inverse(const SignSGDScalars& s, float* p, const void* g, DType gd, int64_t n) {
    if (gd == DType::f32) sign_sgd_inverse_range<V, DType::f32>(s, p, g, n);
    else sign_sgd_inverse_range<V, DType::bf16>(s, p, g, n);
  }
  static void accumulate(float* acc, const void* g, DType gd, bool add, int64_t n) {
    if (gd == DType::f32) add ? accumulate_range<V, DType::f32, true>(acc, g, n)
                              : accumulate_range<V, DType::f32, false>(acc, g, n);
    else add ? accumulate_range<V, DType::bf16, true>(acc, g, n)
             : accumulate_range<V, DType::bf16, false>(acc, g, n);
  }
  static void scale_stream(float* x, float factor, int64_t n) { scale_stream_range<V>(x, factor, n); }

  static const KernelTable* table(const char* name) {
    static const KernelTable t{name, &adamw, &sign_sgd, &adamw_inverse, &sign_sgd_inverse, &accumulate,
                               &scale_stream};
    return &t;
  }
};

}  // namespace
}  // namespace cpu_offload
