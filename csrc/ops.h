// The kernels over a validated TensorBatch: the checks raw pointers allow (operand counts,
// dtype codes against element widths, steps), the per-tensor scalars (scalars.h), and the
// split over the pool. No Python here: bindings.cpp calls these with the GIL released.
// Every check throws std::invalid_argument (ValueError in Python) before anything is written.
#pragma once
#include <cstdint>
#include "batch.h"
#include "scalars.h"

namespace cpu_offload {
namespace ops {

// Roles: params, grads, exp_avgs, exp_avg_sqs[, compute_params]; exp_avgs and exp_avg_sqs
// are both moment_dtype. steps: int64[b.size()], each incremented first (the bias
// corrections use the new count), so it must not overlap any operand.
void adamw(const TensorBatch& b, int grad_dtype, int moment_dtype, int out_kind, uintptr_t steps,
           const AdamWHyper& h);
// Undoes one adamw step. Roles: params, grads, exp_avgs, exp_avg_sqs. steps: int64[b.size()],
// read only: the count each undone step used (>= 1). The caller decrements its own counts.
void adamw_inverse(const TensorBatch& b, int grad_dtype, int moment_dtype, uintptr_t steps, const AdamWHyper& h);
// Roles: params, grads[, compute_params].
void sign_sgd(const TensorBatch& b, int grad_dtype, int out_kind, double lr, double weight_decay, double grad_scale);
// Undoes one sign_sgd step. Roles: params, grads.
void sign_sgd_inverse(const TensorBatch& b, int grad_dtype, double lr, double weight_decay, double grad_scale);
// Roles: accumulators, grads.
void accumulate(const TensorBatch& b, int grad_dtype, bool add);
// Bandwidth probe over n floats at ptr: x <- x * factor.
void scale_stream(uintptr_t ptr, int64_t n, double factor);

}  // namespace ops
}  // namespace cpu_offload
