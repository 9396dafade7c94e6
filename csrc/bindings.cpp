// PYBIND11_MODULE only: raw pointers and sizes in, GIL released while kernels run.
// Input validation that can name a tensor lives in cpu_offload/kernels.py (raw pointers
// cannot be checked here; _C is private); the checks here (overlap, counts, dtype codes
// against element sizes, steps aliasing, ISA names) raise ValueError through pybind11.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include "batch.h"
#include "dispatch.h"
#include "pool.h"

namespace py = pybind11;
using namespace cpu_offload;

namespace {

TensorBatch make_batch(std::vector<int64_t> numels, std::vector<std::tuple<std::string, std::vector<uintptr_t>, int>> ops) {
  std::vector<Operand> operands;
  for (auto& [role, ptrs, elem_size] : ops) operands.push_back({role, std::move(ptrs), elem_size});
  return TensorBatch(std::move(numels), std::move(operands));
}

void require_roles(const TensorBatch& b, int lo, int hi, const char* kernel) {
  if (b.roles() < lo || b.roles() > hi)
    throw std::invalid_argument(std::string(kernel) + ": batch has the wrong number of operands");
}

DType grad_dtype_of(int code) {
  if (code != static_cast<int>(DType::f32) && code != static_cast<int>(DType::bf16))
    throw std::invalid_argument("grad_dtype: unknown dtype code " + std::to_string(code));
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

// Roles: params, grads, exp_avgs, exp_avg_sqs[, compute_params]. steps: int64[size()].
void adamw(const TensorBatch& b, int grad_dtype, int out_kind, uintptr_t steps_ptr, double lr, double beta1,
           double beta2, double eps, double weight_decay, double grad_scale) {
  require_roles(b, 4, 5, "adamw");
  const DType gd = grad_dtype_of(grad_dtype);
  const OutKind ok = out_kind_of(b, 4, out_kind);
  require_widths(b, {4, width(gd), 4, 4, width(ok)}, "adamw");
  if (b.size() > 0 && steps_ptr == 0) throw std::invalid_argument("adamw: steps is a null pointer");
  // steps is written too, so it must not share memory with any operand.
  const uintptr_t steps_end = steps_ptr + static_cast<uintptr_t>(b.size()) * sizeof(int64_t);
  for (int r = 0; r < b.roles(); ++r)
    for (int64_t t = 0; t < b.size(); ++t)
      if (b.numel(t) > 0 && b.ptr(r, t) < steps_end && steps_ptr < b.ptr(r, t) + b.numel(t) * b.elem_size(r))
        throw std::invalid_argument("steps and " + b.role_name(r) + "[" + std::to_string(t) + "] overlap in memory");
  py::gil_scoped_release release;
  auto* steps = reinterpret_cast<int64_t*>(steps_ptr);
  std::vector<AdamWScalars> scalars(b.size());
  for (int64_t t = 0; t < b.size(); ++t) {
    const double step = static_cast<double>(++steps[t]);
    const double bc1 = 1.0 - std::pow(beta1, step);  // bias corrections, once per tensor, in double
    const double bc2 = 1.0 - std::pow(beta2, step);
    const double bc2_sqrt = std::sqrt(bc2);
    scalars[t] = {static_cast<float>(grad_scale),        static_cast<float>(1.0 - lr * weight_decay),
                  static_cast<float>(beta1),             static_cast<float>(1.0 - beta1),
                  static_cast<float>(beta2),             static_cast<float>(1.0 - beta2),
                  static_cast<float>(eps * bc2_sqrt),    static_cast<float>(-(lr * bc2_sqrt / bc1))};
  }
  const KernelTable& k = active_kernels();
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    const int gsz = width(gd), osz = width(ok);
    k.adamw(scalars[t], reinterpret_cast<float*>(b.ptr(0, t)) + lo,
            reinterpret_cast<const char*>(b.ptr(1, t)) + lo * gsz, gd,
            reinterpret_cast<float*>(b.ptr(2, t)) + lo, reinterpret_cast<float*>(b.ptr(3, t)) + lo,
            ok == OutKind::none ? nullptr : reinterpret_cast<char*>(b.ptr(4, t)) + lo * osz, ok, hi - lo);
  });
}

// Roles: params, grads[, compute_params].
void sign_sgd(const TensorBatch& b, int grad_dtype, int out_kind, double lr, double weight_decay) {
  require_roles(b, 2, 3, "sign_sgd");
  const DType gd = grad_dtype_of(grad_dtype);
  const OutKind ok = out_kind_of(b, 2, out_kind);
  require_widths(b, {4, width(gd), width(ok)}, "sign_sgd");
  py::gil_scoped_release release;
  const SignSGDScalars s{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(lr)};
  const KernelTable& k = active_kernels();
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    const int gsz = width(gd), osz = width(ok);
    k.sign_sgd(s, reinterpret_cast<float*>(b.ptr(0, t)) + lo,
               reinterpret_cast<const char*>(b.ptr(1, t)) + lo * gsz, gd,
               ok == OutKind::none ? nullptr : reinterpret_cast<char*>(b.ptr(2, t)) + lo * osz, ok, hi - lo);
  });
}

// Roles: accumulators, grads.
void accumulate(const TensorBatch& b, int grad_dtype, bool add) {
  require_roles(b, 2, 2, "accumulate");
  const DType gd = grad_dtype_of(grad_dtype);
  require_widths(b, {4, width(gd)}, "accumulate");
  py::gil_scoped_release release;
  const KernelTable& k = active_kernels();
  const int gsz = width(gd);
  b.parallel_ranges([&](int64_t t, int64_t lo, int64_t hi) {
    k.accumulate(reinterpret_cast<float*>(b.ptr(0, t)) + lo,
                 reinterpret_cast<const char*>(b.ptr(1, t)) + lo * gsz, gd, add, hi - lo);
  });
}

void scale_stream(uintptr_t ptr, int64_t n, double factor) {
  TensorBatch b({n}, {{"buffer", {ptr}, 4}});
  py::gil_scoped_release release;
  const KernelTable& k = active_kernels();
  b.parallel_ranges([&](int64_t, int64_t lo, int64_t hi) {
    k.scale_stream(reinterpret_cast<float*>(ptr) + lo, static_cast<float>(factor), hi - lo);
  });
}

// The identities (addresses) of the tensors in several lists, packed as bytes: a cheap,
// exact cache key for "the same tensor objects as last time" (see kernels.py).
py::bytes identity_key(const py::tuple& lists) {
  std::string key;
  for (py::handle lst : lists) {
    Py_ssize_t n = 0;
    if (!lst.is_none()) {
      if (!PyList_Check(lst.ptr()) && !PyTuple_Check(lst.ptr()))
        throw py::type_error("identity_key: expected lists or tuples");
      n = PySequence_Fast_GET_SIZE(lst.ptr());
    }
    const size_t at = key.size();
    key.resize(at + sizeof(Py_ssize_t) + sizeof(PyObject*) * n);
    std::memcpy(&key[at], &n, sizeof(n));
    PyObject** items = n ? PySequence_Fast_ITEMS(lst.ptr()) : nullptr;
    if (n) std::memcpy(&key[at + sizeof(Py_ssize_t)], items, sizeof(PyObject*) * n);
  }
  return py::bytes(key);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpu_offload native kernels (torch-independent; raw pointers and sizes)";
  py::class_<TensorBatch>(m, "TensorBatch")
      .def(py::init(&make_batch), py::arg("numels"), py::arg("operands"))
      .def_property_readonly("size", &TensorBatch::size)
      .def_property_readonly("total", &TensorBatch::total);
  m.def("adamw", &adamw);
  m.def("sign_sgd", &sign_sgd);
  m.def("accumulate", &accumulate);
  m.def("scale_stream", &scale_stream);
  m.def("identity_key", &identity_key);
  m.def("isa", &active_isa);
  m.def("available_isas", &available_isas);
  m.def("known_isas", &known_isas);
  m.def("set_isa", &set_active_isa);
  m.def("get_num_threads", &pool_num_threads);
  m.def("set_num_threads", &pool_set_num_threads);
  m.def("pin_threads", &pool_pin);
  m.def("pinned_cpus", &pool_pinned_cpus);
  m.def("set_min_elements_per_worker", [](int64_t n) {
    if (n < 1) throw std::invalid_argument("min elements per worker must be >= 1");
    g_min_elements_per_worker.store(n);
  });
}
