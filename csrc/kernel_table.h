// Types shared by the dispatcher and the per-ISA kernel builds: element types, the
// per-tensor scalars each kernel needs (computed once per tensor, in double, by
// scalars.cpp), and the table of per-range kernel entry points that one ISA build fills in.
// Non-goal: any torch type. Everything here is raw pointers and sizes.
#pragma once
#include <cstdint>

namespace cpu_offload {

enum class DType : int { f32 = 0, bf16 = 1 };
enum class OutKind : int { none = 0, f32 = 1, bf16 = 2 };

// AdamW, decoupled weight decay (torch.optim.AdamW), as float32 constants:
//   p <- p * decay;  m <- beta1*m + (1-beta1)*g;  v <- beta2*v + ((1-beta2)*g)*g
//   p <- p + (neg_step_size * m) / (sqrt(v) + eps_hat)
// with the bias corrections folded into the constants (Kingma & Ba, sec. 2):
//   lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) == (lr*sqrt(bc2)/bc1) * m / (sqrt(v) + eps*sqrt(bc2))
// which saves one division per element. The inverse step (adamw_inverse) takes the
// same struct, folded for the step it undoes, so its update u has the forward's bits.
struct AdamWScalars {
  float grad_scale;
  float decay;            // 1 - lr*wd
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps_hat;          // eps * sqrt(1 - beta2^step)
  float neg_step_size;    // -lr * sqrt(1 - beta2^step) / (1 - beta1^step)
};

// SignSGD: p <- p * decay; p <- p - lr * sign(g), sign(0) = 0 (the inverse: the same struct).
struct SignSGDScalars {
  float decay;            // 1 - lr*wd (exactly 1 when wd == 0)
  float lr;
  float grad_scale;       // the gradient's factor: the step takes sign(g*grad_scale)
};

// One ISA's kernels. Each entry updates one contiguous range of one tensor;
// splitting tensors into ranges and ranges over threads happens in the caller.
struct KernelTable {
  const char* name;
  // exp_avg and exp_avg_sq are both moment_dtype: fp32, or bf16 (widened to fp32 on load,
  // rounded to nearest even on store; the parameter update uses the unrounded fp32 values).
  void (*adamw)(const AdamWScalars& s, float* param, const void* grad, DType grad_dtype,
                void* exp_avg, void* exp_avg_sq, DType moment_dtype, void* out, OutKind out_kind, int64_t n);
  void (*sign_sgd)(const SignSGDScalars& s, float* param, const void* grad, DType grad_dtype,
                   void* out, OutKind out_kind, int64_t n);
  // Undo one adamw / sign_sgd step in place, from the state after it and its gradient
  // (the error model: cpu_offload/_full/rollback.py's header).
  void (*adamw_inverse)(const AdamWScalars& s, float* param, const void* grad, DType grad_dtype,
                        void* exp_avg, void* exp_avg_sq, DType moment_dtype, int64_t n);
  void (*sign_sgd_inverse)(const SignSGDScalars& s, float* param, const void* grad, DType grad_dtype, int64_t n);
  void (*accumulate)(float* acc, const void* grad, DType grad_dtype, bool add, int64_t n);
  void (*scale_stream)(float* x, float factor, int64_t n);  // bandwidth probe: x <- x * factor
};

const KernelTable* kernel_table_scalar();
const KernelTable* kernel_table_avx2();
const KernelTable* kernel_table_avx512();
const KernelTable* kernel_table_avx512_bf16();
#if defined(__aarch64__)
// aarch64 builds (setup.py AARCH64_TARGETS): NEON, and fixed-length SVE per vector length.
const KernelTable* kernel_table_neon();
const KernelTable* kernel_table_neon_bf16();
const KernelTable* kernel_table_sve128();
const KernelTable* kernel_table_sve128_bf16();
const KernelTable* kernel_table_sve256();
const KernelTable* kernel_table_sve256_bf16();
const KernelTable* kernel_table_sve512();
const KernelTable* kernel_table_sve512_bf16();
#endif

}  // namespace cpu_offload
