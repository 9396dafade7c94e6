// identity_key and batch_unchanged: see validation_cache.h.
#include "validation_cache.h"
#include <cstring>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace cpu_offload {
namespace {

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

}  // namespace

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

// NOTE: data pointer, byte count and contiguity fix the memory a kernel touches,
// [ptr, ptr + nbytes), as the tensor's own live memory, so a hit can never write through a
// stale pointer; a tensor whose dtype was changed in place to another of the same byte
// count is read in the old one.
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

}  // namespace cpu_offload
