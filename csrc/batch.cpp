// TensorBatch: overlap validation and the element-count split of a tensor list.
#include "batch.h"
#include <algorithm>
#include <atomic>
#include <stdexcept>
#include "pool.h"

namespace cpu_offload {
namespace {

// Split points fall on multiples of this many elements (a 64-byte line of fp32).
constexpr int64_t kSplitAlign = 16;
// Work blocks per worker thread, and the fewest elements a block holds (see parallel_ranges).
constexpr int64_t kBlocksPerWorker = 64;
constexpr int64_t kMinBlock = 16384;

struct Span {
  uintptr_t begin, end;
  int role;
  int64_t index;
};

}  // namespace

// Below this many elements per worker the wake-up costs more than the work.
std::atomic<int64_t> g_min_elements_per_worker{32768};

TensorBatch::TensorBatch(std::vector<int64_t> numels, std::vector<Operand> operands)
    : numels_(std::move(numels)), operands_(std::move(operands)) {
  offsets_.resize(numels_.size() + 1, 0);
  for (size_t t = 0; t < numels_.size(); ++t) {
    if (numels_[t] < 0) throw std::invalid_argument("negative element count");
    offsets_[t + 1] = offsets_[t] + numels_[t];
  }
  std::vector<Span> spans;
  for (int r = 0; r < static_cast<int>(operands_.size()); ++r) {
    const Operand& op = operands_[r];
    if (op.ptrs.size() != numels_.size())
      throw std::invalid_argument(op.role + ": expected " + std::to_string(numels_.size()) + " pointers");
    for (size_t t = 0; t < numels_.size(); ++t)
      if (numels_[t] > 0) spans.push_back({op.ptrs[t], op.ptrs[t] + numels_[t] * op.elem_size, r, int64_t(t)});
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].begin < spans[i - 1].end) {
      const Span& a = spans[i - 1];
      const Span& b = spans[i];
      throw std::invalid_argument(operands_[a.role].role + "[" + std::to_string(a.index) + "] and " +
                                  operands_[b.role].role + "[" + std::to_string(b.index) +
                                  "] overlap in memory; every tensor of one call must be distinct memory");
    }
  }
}

void TensorBatch::require_disjoint(uintptr_t begin, uintptr_t bytes, const std::string& what) const {
  if (bytes == 0) return;
  const uintptr_t end = begin + bytes;
  for (int r = 0; r < roles(); ++r)
    for (int64_t t = 0; t < size(); ++t)
      if (numel(t) > 0 && ptr(r, t) < end && begin < ptr(r, t) + numel(t) * elem_size(r))
        throw std::invalid_argument(what + " and " + role_name(r) + "[" + std::to_string(t) + "] overlap in memory");
}

void TensorBatch::parallel_ranges(const std::function<void(int64_t, int64_t, int64_t)>& fn) const {
  const int64_t n = total();
  if (n == 0) return;
  const int64_t min_per_worker = std::max<int64_t>(1, g_min_elements_per_worker.load());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(pool_num_threads(), n / min_per_worker));
  // NOTE: the elements are cut into about kBlocksPerWorker blocks per worker (none under
  // kMinBlock elements, or under the split's minimum when that is lower), taken from a
  // shared counter, so a worker that starts late or shares its core does not hold up the
  // call: the others take its blocks. The call ends with its last block, so each worker
  // idles for up to one block's time at the end: small blocks keep that tail short (with 8
  // blocks per worker the AdamW pass was 1 to 11% slower on the H200 host's 16 cores,
  // benchmarks/README.md). Results do not depend on who runs which block.
  const int64_t least = (std::min<int64_t>(kMinBlock, min_per_worker) + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  const int64_t block = std::max<int64_t>(
      least, (n / (workers * kBlocksPerWorker) + kSplitAlign - 1) / kSplitAlign * kSplitAlign);
  std::atomic<int64_t> next_block{0};
  pool_run(static_cast<int>(workers), [&](int) {
    for (;;) {
      int64_t lo = next_block.fetch_add(1, std::memory_order_relaxed) * block;
      if (lo >= n) return;
      const int64_t hi = std::min(n, lo + block);
      int64_t t = std::upper_bound(offsets_.begin(), offsets_.end(), lo) - offsets_.begin() - 1;
      while (lo < hi) {
        const int64_t stop = std::min(hi, offsets_[t + 1]);
        if (stop > lo) fn(t, lo - offsets_[t], stop - offsets_[t]);
        lo = stop;
        ++t;
      }
    }
  });
}

}  // namespace cpu_offload
