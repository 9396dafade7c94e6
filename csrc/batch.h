// A validated list of tensors as raw memory: per-tensor element counts and, per operand
// role (params, grads, ...), one pointer per tensor. parallel_ranges() cuts the whole
// list into equal element blocks shared by the pool, so tensor sizes do not matter for balance.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <atomic>
#include <vector>

namespace cpu_offload {

// Work is only split when each worker gets at least this many elements (tests lower it
// to exercise every split on small tensors).
extern std::atomic<int64_t> g_min_elements_per_worker;

struct Operand {
  std::string role;                // e.g. "params", used in error messages
  std::vector<uintptr_t> ptrs;     // one per tensor
  int elem_size;                   // bytes per element
};

class TensorBatch {
 public:
  // Throws std::invalid_argument naming roles and indices if two operands overlap.
  TensorBatch(std::vector<int64_t> numels, std::vector<Operand> operands);
  int64_t size() const { return static_cast<int64_t>(numels_.size()); }
  int64_t total() const { return offsets_.back(); }
  int64_t numel(int64_t t) const { return numels_[t]; }
  uintptr_t ptr(int role, int64_t t) const { return operands_[role].ptrs[t]; }
  int roles() const { return static_cast<int>(operands_.size()); }
  int elem_size(int role) const { return operands_[role].elem_size; }
  const std::string& role_name(int role) const { return operands_[role].role; }

  // Throws std::invalid_argument naming `what` and the operand if [begin, begin + bytes)
  // overlaps any tensor of the batch (e.g. a steps array the kernel writes).
  void require_disjoint(uintptr_t begin, uintptr_t bytes, const std::string& what) const;

  // Calls fn(tensor, begin, end) for disjoint element ranges covering every tensor,
  // spread over up to pool_num_threads() workers.
  void parallel_ranges(const std::function<void(int64_t, int64_t, int64_t)>& fn) const;

 private:
  std::vector<int64_t> numels_;
  std::vector<int64_t> offsets_;   // prefix sums, size() + 1 entries
  std::vector<Operand> operands_;
};

}  // namespace cpu_offload
