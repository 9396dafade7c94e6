// Batch-level kernel calls: checks, per-tensor scalars, parallel_ranges over the pool.
#include "ops.h"
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>
#include "dispatch.h"

namespace cpu_offload {
namespace ops {
namespace {

void require_roles(const TensorBatch& b, int lo, int hi, const char* kernel) {
  if (b.roles() < lo || b.roles() > hi)
    throw std::invalid_argument(std::string(kernel) + ": batch has the wrong number of operands");
}

DType dtype_of(int code, const char* what) {
  if (code != static_cast<int>(DType::f32) && code != static_cast<int>(DType::bf16))
    throw std::invalid_argument(std::string(what) + ": unknown dtype code " + std::to_string(code));
  return static_cast<DType>(code);
}

// The output kind for a batch whose optional last role (compute_params) is `out_role`.
OutKind out_kind_of(const TensorBatch& b, int out_role, int code) {
  if (b.roles() <= out_role) return OutKind::none;
  if (code != static_cast<int>(OutKind::f32) && code != static_cast<int>(OutKind::bf16))
    throw std::invalid_argument("out_kind: unknown output code " + std::to_string(code));
  return static_cast<OutKind>(code);
}

int width(DType d) { return d == DType::f32 ? 4 : 2; }
int width(OutKind k) { return k == OutKind::bf16 ? 2 : 4; }

// NOTE: the kernels derive element widths from the dtype codes; a batch built with other
// widths would make them read or write past a tensor, so the two must agree.
void require_widths(const TensorBatch& b, std::initializer_list<int> widths, const char* kernel) {
  int r = 0;
  for (int w : widths) {
    if (r < b.roles() && b.elem_size(r) != w)
      throw std::invalid_argument(std::string(kernel) + ": " + b.role_name(r) + " has " +
                                  std::to_string(b.elem_size(r)) + "-byte elements, expected " + std::to_string(w));
    ++r;
  }
}

const int64_t* steps_of(const TensorBatch& b, uintptr_t steps, const char* kernel) {
  if (b.size() > 0 && steps == 0) throw std::invalid_argument(std::string(kernel) + ": steps is a null pointer");
  return reinterpret_cast<const int64_t*>(steps);
}

template <class T = char>
T* at(const TensorBatch& b, int role, int64_t t, int64_t element, int elem_size) {
  return reinterpret_cast<T*>(reinterpret_cast<char*>(b.ptr(role, t)) + element * elem_size);
}

}  // namespace

void adamw(const TensorBatch& b, int grad_dtype, int moment_dtype, int out_kind, uintptr_t steps_ptr,
           const AdamWHyper& h) {
  require_roles(b, 4, 5, "adamw");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
  const DType md = dtype_of(moment_dtype, "moment_dtype");
  const OutKind ok = out_kind_of(b, 4, out_kind);
  require_widths(b, {4, width(gd), width(md), width(md), width(ok)}, "adamw");
  steps_of(b, steps_ptr, "adamw");
  b.require_disjoint(steps_ptr, static_cast<uintptr_t>(b.size()) * sizeof(int64_t), "steps");  // it is written
  auto* steps = reinterpret_cast<int64_t*>(steps_ptr);
  // NOTE: every count is checked before any is incremented: a refused call changes nothing.
  // A negative count would make a bias correction 1 - beta^0 = 0 (an infinite step).
  for (int64_t t = 0; t < b.size(); ++t)
    if (steps[t] < 0 || steps[t] == std::numeric_limits<int64_t>::max())
      throw std::invalid_argument("adamw: steps[" + std::to_string(t) + "] is " + std::to_string(steps[t]) +
                                  "; a step count is >= 0 (the steps taken before this one)");
  // NOTE: adamw_scalars throws for a constant that overflows float32, so every tensor's
  // scalars are computed before any count is incremented.
  std::vector<AdamWScalars> scalars(b.size());
  for (int64_t t = 0; t < b.size(); ++t) scalars[t] = adamw_scalars(h, steps[t] + 1);
  for (int64_t t = 0; t < b.size(); ++t) ++steps[t];
  const KernelTable& k = active_kernels();
  const int gsz = width(gd), msz = width(md), osz = width(ok);
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    k.adamw(scalars[t], at<float>(b, 0, t, lo, 4), at(b, 1, t, lo, gsz), gd, at(b, 2, t, lo, msz),
            at(b, 3, t, lo, msz), md, ok == OutKind::none ? nullptr : at(b, 4, t, lo, osz), ok, hi - lo);
  });
}

void adamw_inverse(const TensorBatch& b, int grad_dtype, int moment_dtype, uintptr_t steps_ptr,
                   const AdamWHyper& h) {
  require_roles(b, 4, 4, "adamw_inverse");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
  const DType md = dtype_of(moment_dtype, "moment_dtype");
  require_widths(b, {4, width(gd), width(md), width(md)}, "adamw_inverse");
  // NOTE: steps is only read, all of it before any element is written.
  const int64_t* steps = steps_of(b, steps_ptr, "adamw_inverse");
  std::vector<AdamWScalars> scalars(b.size());
  for (int64_t t = 0; t < b.size(); ++t) {
    if (steps[t] < 1)
      throw std::invalid_argument("adamw_inverse: steps[" + std::to_string(t) + "] is " + std::to_string(steps[t]) +
                                  "; the count of the step undone is >= 1");
    scalars[t] = adamw_scalars(h, steps[t]);  // the forward's constants for that step
  }
  const KernelTable& k = active_kernels();
  const int gsz = width(gd), msz = width(md);
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    k.adamw_inverse(scalars[t], at<float>(b, 0, t, lo, 4), at(b, 1, t, lo, gsz), gd, at(b, 2, t, lo, msz),
                    at(b, 3, t, lo, msz), md, hi - lo);
  });
}

void sign_sgd(const TensorBatch& b, int grad_dtype, int out_kind, double lr, double weight_decay,
              double grad_scale) {
  require_roles(b, 2, 3, "sign_sgd");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
  const OutKind ok = out_kind_of(b, 2, out_kind);
  require_widths(b, {4, width(gd), width(ok)}, "sign_sgd");
  const SignSGDScalars s = sign_sgd_scalars(lr, weight_decay, grad_scale);
  const KernelTable& k = active_kernels();
  const int gsz = width(gd), osz = width(ok);
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    k.sign_sgd(s, at<float>(b, 0, t, lo, 4), at(b, 1, t, lo, gsz), gd,
               ok == OutKind::none ? nullptr : at(b, 2, t, lo, osz), ok, hi - lo);
  });
}

void sign_sgd_inverse(const TensorBatch& b, int grad_dtype, double lr, double weight_decay, double grad_scale) {
  require_roles(b, 2, 2, "sign_sgd_inverse");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
  require_widths(b, {4, width(gd)}, "sign_sgd_inverse");
  const SignSGDScalars s = sign_sgd_scalars(lr, weight_decay, grad_scale);
  const KernelTable& k = active_kernels();
  const int gsz = width(gd);
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    k.sign_sgd_inverse(s, at<float>(b, 0, t, lo, 4), at(b, 1, t, lo, gsz), gd, hi - lo);
  });
}

void accumulate(const TensorBatch& b, int grad_dtype, bool add) {
  require_roles(b, 2, 2, "accumulate");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
  require_widths(b, {4, width(gd)}, "accumulate");
  const KernelTable& k = active_kernels();
  const int gsz = width(gd);
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    k.accumulate(at<float>(b, 0, t, lo, 4), at(b, 1, t, lo, gsz), gd, add, hi - lo);
  });
}

void scale_stream(uintptr_t ptr, int64_t n, double factor) {
  TensorBatch b({n}, {{"buffer", {ptr}, 4}});
  const KernelTable& k = active_kernels();
  b.parallel_ranges([&](int64_t, int64_t lo, int64_t hi) {
    k.scale_stream(reinterpret_cast<float*>(ptr) + lo, static_cast<float>(factor), hi - lo);
  });
}

}  // namespace ops
}  // namespace cpu_offload
