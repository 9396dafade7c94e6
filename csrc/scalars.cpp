// Folding of the hyper-parameters into the float32 constants of kernel_table.h. A constant
// that is not finite in float32 (a value finite as a double, or a product of two such,
// beyond FLT_MAX) throws std::invalid_argument naming the hyper-parameters, which pybind11
// raises as ValueError: the kernels would write inf/NaN weights with it.
#include "scalars.h"
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace cpu_offload {

namespace {

// NOTE: IEEE conversion (round to nearest even): a double beyond FLT_MAX + half an ulp
// becomes +-inf, which is what is checked (the Python side's check_float32 agrees).
float narrow(double value, const char* what) {
  const float f = static_cast<float>(value);
  if (!std::isfinite(f)) {
    char shown[32];
    std::snprintf(shown, sizeof shown, "%g", value);
    throw std::invalid_argument(std::string(what) + " = " + shown +
                                ", which overflows float32: the kernels compute in float32");
  }
  return f;
}

}  // namespace

AdamWScalars adamw_scalars(const AdamWHyper& h, int64_t step) {
  const double n = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(h.beta1, n);  // bias corrections, once per tensor, in double
  const double bc2 = 1.0 - std::pow(h.beta2, n);
  const double bc2_sqrt = std::sqrt(bc2);
  AdamWScalars s;
  s.grad_scale = narrow(h.grad_scale, "grad_scale");
  s.decay = narrow(1.0 - h.lr * h.weight_decay, "lr * weight_decay: the decay factor 1 - lr * weight_decay");
  s.beta1 = static_cast<float>(h.beta1);  // in [0, 1)
  s.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  s.eps_hat = narrow(h.eps * bc2_sqrt, "eps: eps * sqrt(1 - beta2^step)");  // eps * sqrt(bc2)
  if (h.eps > 0 && s.eps_hat == 0.0f) {
    // NOTE: eps_hat is added to sqrt(v): where it is 0, an element with v = 0 steps by 0/0
    // (NaN), where torch, adding eps after the division, leaves the element as it is
    char shown[96];
    std::snprintf(shown, sizeof shown, " = %g at step %lld", h.eps * bc2_sqrt, static_cast<long long>(step));
    throw std::invalid_argument(std::string("eps: eps * sqrt(1 - beta2^step)") + shown +
                                ", which rounds to 0 in float32: an element with a zero second moment would step "
                                "by 0/0; use a larger eps");
  }
  // -lr * sqrt(bc2) / bc1
  s.neg_step_size = narrow(-(h.lr * bc2_sqrt / bc1),
                           ("lr: the bias-corrected step size -lr * sqrt(1 - beta2^step) / (1 - beta1^step) at step " +
                            std::to_string(step)).c_str());
  return s;
}

SignSGDScalars sign_sgd_scalars(double lr, double weight_decay, double grad_scale) {
  return {narrow(1.0 - lr * weight_decay, "lr * weight_decay: the decay factor 1 - lr * weight_decay"),
          narrow(lr, "lr"), narrow(grad_scale, "grad_scale")};
}

}  // namespace cpu_offload
