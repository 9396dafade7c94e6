// PYBIND11_MODULE only: raw pointers and sizes in, GIL released while kernels run.
// Input validation that can name a tensor lives in cpu_offload/kernels.py (raw pointers
// cannot be checked here; _C is private); the checks here (overlap, counts, dtype codes
// against element sizes, steps aliasing, ISA names) raise ValueError through pybind11.
// TensorBatch.unchanged() is the cache check of kernels.py: it asks each tensor for its
// memory through torch.Tensor's own descriptors, passed in, so no torch header is needed.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <cmath>
#include <cstring>
#include <string_view>
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

// Roles: params, grads, exp_avgs, exp_avg_sqs[, compute_params]. steps: int64[size()].
// moment_dtype is the dtype of both exp_avgs and exp_avg_sqs.
void adamw(const TensorBatch& b, int grad_dtype, int moment_dtype, int out_kind, uintptr_t steps_ptr, double lr,
           double beta1, double beta2, double eps, double weight_decay, double grad_scale) {
  require_roles(b, 4, 5, "adamw");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
  const DType md = dtype_of(moment_dtype, "moment_dtype");
  const OutKind ok = out_kind_of(b, 4, out_kind);
  require_widths(b, {4, width(gd), width(md), width(md), width(ok)}, "adamw");
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
    const int gsz = width(gd), msz = width(md), osz = width(ok);
    k.adamw(scalars[t], reinterpret_cast<float*>(b.ptr(0, t)) + lo,
            reinterpret_cast<const char*>(b.ptr(1, t)) + lo * gsz, gd,
            reinterpret_cast<char*>(b.ptr(2, t)) + lo * msz, reinterpret_cast<char*>(b.ptr(3, t)) + lo * msz, md,
            ok == OutKind::none ? nullptr : reinterpret_cast<char*>(b.ptr(4, t)) + lo * osz, ok, hi - lo);
  });
}

// Roles: params, grads[, compute_params].
void sign_sgd(const TensorBatch& b, int grad_dtype, int out_kind, double lr, double weight_decay) {
  require_roles(b, 2, 3, "sign_sgd");
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
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
  const DType gd = dtype_of(grad_dtype, "grad_dtype");
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

// ---------------------------------------------------------------- cache check

// One torch.Tensor accessor (a method or getset descriptor), called through its C entry
// point. NOTE: that is what CPython's descriptor call does, minus building a bound method
// or an argument tuple; the check below runs it several times per tensor per call, and
// that has to stay well below the kernel's own time (see kernels.py).
class Accessor {
 public:
  explicit Accessor(py::handle descr) : descr_(descr.ptr()) {
    if (Py_TYPE(descr_) == &PyGetSetDescr_Type) {
      getset_ = reinterpret_cast<PyGetSetDescrObject*>(descr_)->d_getset;
      if (!getset_->get) throw std::invalid_argument("accessor: getset descriptor without getter");
    } else if (Py_TYPE(descr_) == &PyMethodDescr_Type) {
      method_ = reinterpret_cast<PyMethodDescrObject*>(descr_)->d_method;
      const int flags = method_->ml_flags & ~METH_COEXIST;
      if (flags != METH_NOARGS && flags != (METH_VARARGS | METH_KEYWORDS)) method_ = nullptr;  // generic call
    } else {
      throw std::invalid_argument("accessor: expected a method or getset descriptor");
    }
    type_ = PyDescr_TYPE(descr_);
  }
  PyTypeObject* type() const { return type_; }

  // A new reference, or nullptr with a Python error set. `self` must be a type() instance.
  PyObject* operator()(PyObject* self) const {
    if (getset_) return getset_->get(self, getset_->closure);
    if (!method_) return PyObject_Vectorcall(descr_, &self, 1, nullptr);
    if (method_->ml_flags & METH_NOARGS) return method_->ml_meth(self, nullptr);
    static PyObject* const no_args = PyTuple_New(0);  // NOTE: immortal for the process
    return reinterpret_cast<PyCFunctionWithKeywords>(reinterpret_cast<void (*)(void)>(method_->ml_meth))(
        self, no_args, nullptr);
  }

 private:
  PyObject* descr_;
  PyTypeObject* type_ = nullptr;
  PyGetSetDef* getset_ = nullptr;
  PyMethodDef* method_ = nullptr;
};

// True when every tensor of `lists` (one tuple per role, in the batch's order) still covers
// exactly the bytes the batch was built from: the same data pointer, the same byte count,
// contiguous. `accessors` is (data_ptr, nbytes, is_contiguous) of torch.Tensor. Any
// mismatch or error answers False (the caller then validates from scratch and names what is
// wrong). NOTE: those three fix the memory a kernel touches, [ptr, ptr + nbytes), as the
// tensor's own live memory, so a hit can never write through a stale pointer; a tensor whose
// dtype was changed in place to another of the same byte count is read in the old one.
bool batch_unchanged(const TensorBatch& b, const py::tuple& lists, const py::tuple& accessors) {
  if (accessors.size() != 3) throw std::invalid_argument("unchanged: expected 3 accessors");
  const Accessor data_ptr(accessors[0]), nbytes(accessors[1]), is_contiguous(accessors[2]);
  PyTypeObject* tensor_type = data_ptr.type();
  for (const Accessor* a : {&nbytes, &is_contiguous})
    if (a->type() != tensor_type) throw std::invalid_argument("unchanged: accessors of different types");
  if (static_cast<int>(lists.size()) != b.roles()) return false;

  auto take = [](PyObject* r) {  // consumes r; the value of a Python int, or ~0 on error
    if (!r) return ~0ULL;
    const unsigned long long v = PyLong_Check(r) ? PyLong_AsUnsignedLongLongMask(r) : ~0ULL;
    Py_DECREF(r);
    return v;
  };
  bool ok = true;
  for (int r = 0; ok && r < b.roles(); ++r) {
    // NOTE: tuples only: nothing can change them (or free their tensors) during the check.
    PyObject* lst = lists[r].ptr();
    if (!PyTuple_Check(lst) || PyTuple_GET_SIZE(lst) != b.size()) return false;
    PyObject* const* items = &PyTuple_GET_ITEM(lst, 0);
    const unsigned long long width = static_cast<unsigned long long>(b.elem_size(r));
    for (int64_t t = 0; ok && t < b.size(); ++t) {
      PyObject* x = items[t];
      PyObject* contiguous = nullptr;
      ok = PyObject_TypeCheck(x, tensor_type) && take(data_ptr(x)) == b.ptr(r, t) &&
           take(nbytes(x)) == static_cast<unsigned long long>(b.numel(t)) * width &&
           (contiguous = is_contiguous(x)) == Py_True;
      Py_XDECREF(contiguous);
    }
  }
  if (PyErr_Occurred()) PyErr_Clear();
  return ok;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "cpu_offload native kernels (torch-independent; raw pointers and sizes)";
  py::class_<TensorBatch>(m, "TensorBatch")
      .def(py::init(&make_batch), py::arg("numels"), py::arg("operands"))
      .def_property_readonly("size", &TensorBatch::size)
      .def_property_readonly("total", &TensorBatch::total)
      .def("unchanged", &batch_unchanged, py::arg("lists"), py::arg("accessors"));
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
