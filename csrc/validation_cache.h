// The cache check of cpu_offload/kernels.py, in native code because it runs on every
// kernel call: identity_key() packs the identities of the tensors of several lists into a
// cache key, batch_unchanged() asks each tensor for its memory through torch.Tensor's own
// descriptors (passed in from Python, so no torch header is needed) and compares it with
// what the batch was validated with. Both need the GIL.
#pragma once
#include <pybind11/pybind11.h>
#include "batch.h"

namespace cpu_offload {

// The identities (addresses) of the tensors in several lists, packed as bytes: a cheap,
// exact cache key for "the same tensor objects as last time". Throws TypeError for an
// entry that is neither None, a list nor a tuple.
pybind11::bytes identity_key(const pybind11::tuple& lists);

// True when every tensor of `lists` (one tuple per role, in the batch's order) still covers
// exactly the bytes the batch was built from: the same data pointer, the same byte count,
// contiguous. `accessors` is (data_ptr, nbytes, is_contiguous) of torch.Tensor. Any mismatch
// or error answers False (the caller then validates from scratch and names what is wrong).
bool batch_unchanged(const TensorBatch& b, const pybind11::tuple& lists, const pybind11::tuple& accessors);

}  // namespace cpu_offload
