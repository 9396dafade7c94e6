// Folding of the hyper-parameters into the float32 constants of kernel_table.h.
#include "scalars.h"
#include <cmath>

namespace cpu_offload {

AdamWScalars adamw_scalars(const AdamWHyper& h, int64_t step) {
  const double n = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(h.beta1, n);  // bias corrections, once per tensor, in double
  const double bc2 = 1.0 - std::pow(h.beta2, n);
  const double bc2_sqrt = std::sqrt(bc2);
  AdamWScalars s;
  s.grad_scale = static_cast<float>(h.grad_scale);
  s.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps_hat = static_cast<float>(h.eps * bc2_sqrt);               // eps * sqrt(bc2)
  s.neg_step_size = static_cast<float>(-(h.lr * bc2_sqrt / bc1));  // -lr * sqrt(bc2) / bc1
  return s;
}

SignSGDScalars sign_sgd_scalars(double lr, double weight_decay) {
  return {static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(lr)};
}

}  // namespace cpu_offload
