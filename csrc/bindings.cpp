// PYBIND11_MODULE only: raw pointers and sizes in, named arguments, GIL released while
// kernels run. Input validation that can name a tensor lives in cpu_offload/kernels.py
// (raw pointers cannot be checked here; _C is private); the checks of ops.cpp (overlap,
// counts, dtype codes against element sizes, steps), of pool.cpp and of dispatch.cpp
// raise ValueError through pybind11. TensorBatch.unchanged() and identity_key() are the
// cache check of kernels.py (validation_cache.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>
#include "batch.h"
#include "dispatch.h"
#include "ops.h"
#include "pool.h"
#include "validation_cache.h"

namespace py = pybind11;
using namespace cpu_offload;

namespace {

TensorBatch make_batch(std::vector<int64_t> numels, std::vector<std::tuple<std::string, std::vector<uintptr_t>, int>> ops) {
  std::vector<Operand> operands;
  for (auto& [role, ptrs, elem_size] : ops) operands.push_back({role, std::move(ptrs), elem_size});
  return TensorBatch(std::move(numels), std::move(operands));
}

void set_min_elements_per_worker(int64_t n) {
  if (n < 1) throw std::invalid_argument("min elements per worker must be >= 1");
  g_min_elements_per_worker.store(n);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.doc() = "cpu_offload native kernels (torch-independent; raw pointers and sizes)";
  py::class_<TensorBatch>(m, "TensorBatch")
      .def(py::init(&make_batch), py::arg("numels"), py::arg("operands"))
      .def_property_readonly("size", &TensorBatch::size)
      .def_property_readonly("total", &TensorBatch::total)
      .def("unchanged", &batch_unchanged, py::arg("lists"), py::arg("accessors"));
  m.def(
      "adamw",
      [](const TensorBatch& batch, int grad_dtype, int moment_dtype, int out_kind, uintptr_t steps, double lr,
         double beta1, double beta2, double eps, double weight_decay, double grad_scale) {
        ops::adamw(batch, grad_dtype, moment_dtype, out_kind, steps, {lr, beta1, beta2, eps, weight_decay, grad_scale});
      },
      py::kw_only(), py::arg("batch"), py::arg("grad_dtype"), py::arg("moment_dtype"), py::arg("out_kind"),
      py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("grad_scale"), release());
  m.def(
      "adamw_inverse",
      [](const TensorBatch& batch, int grad_dtype, int moment_dtype, uintptr_t steps, double lr, double beta1,
         double beta2, double eps, double weight_decay, double grad_scale) {
        ops::adamw_inverse(batch, grad_dtype, moment_dtype, steps, {lr, beta1, beta2, eps, weight_decay, grad_scale});
      },
      py::kw_only(), py::arg("batch"), py::arg("grad_dtype"), py::arg("moment_dtype"), py::arg("steps"),
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("grad_scale"), release());
  m.def("sign_sgd", &ops::sign_sgd, py::kw_only(), py::arg("batch"), py::arg("grad_dtype"), py::arg("out_kind"),
        py::arg("lr"), py::arg("weight_decay"), py::arg("grad_scale"), release());
  m.def("sign_sgd_inverse", &ops::sign_sgd_inverse, py::kw_only(), py::arg("batch"), py::arg("grad_dtype"),
        py::arg("lr"), py::arg("weight_decay"), py::arg("grad_scale"), release());
  m.def("accumulate", &ops::accumulate, py::kw_only(), py::arg("batch"), py::arg("grad_dtype"), py::arg("add"),
        release());
  m.def("scale_stream", &ops::scale_stream, py::kw_only(), py::arg("ptr"), py::arg("numel"), py::arg("factor"),
        release());
  m.def("identity_key", &identity_key, py::arg("lists"));
  m.def("isa", &active_isa);
  m.def("available_isas", &available_isas);
  m.def("known_isas", &known_isas);
  m.def("set_isa", &set_active_isa, py::arg("name"));
  m.def("get_num_threads", &pool_num_threads);
  m.def("set_num_threads", &pool_set_num_threads, py::arg("n"));
  m.def("pin_threads", &pool_pin, py::arg("cpus"));
  m.def("pinned_cpus", &pool_pinned_cpus);
  m.def("set_min_elements_per_worker", &set_min_elements_per_worker, py::arg("n"));
}
