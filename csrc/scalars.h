// The per-tensor float32 constants of each kernel, folded once per tensor in double from
// the Python hyper-parameters. The forward step and its inverse both take them from here,
// so an inverse recomputes the forward's update with the very same constants. Both throw
// std::invalid_argument, naming the hyper-parameters, when a constant overflows float32.
#pragma once
#include <cstdint>
#include "kernel_table.h"

namespace cpu_offload {

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay, grad_scale;
};

// The scalars of the AdamW step whose step count is `step` (1 on the first step): the bias
// corrections 1 - beta^step in double, folded into eps_hat and neg_step_size.
AdamWScalars adamw_scalars(const AdamWHyper& h, int64_t step);

SignSGDScalars sign_sgd_scalars(double lr, double weight_decay, double grad_scale);

}  // namespace cpu_offload
