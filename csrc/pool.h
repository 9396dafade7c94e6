// A persistent pool of native worker threads (no OpenMP, so no second runtime next to
// torch's). run() hands task k in [0, tasks) to worker k and blocks until all are done;
// the first exception thrown by a task is rethrown on the caller's thread.
// Every entry point validates its arguments and is exception-safe: a failure (bad CPU id,
// a thread that cannot be started or pinned) throws and leaves the previous state intact.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace cpu_offload {

// Most worker threads a pool may have (oversubscription is allowed up to this bound).
constexpr int kMaxPoolThreads = 1024;

// Number of worker threads; default: the CPUs in the process's affinity mask.
int pool_num_threads();
// Throws std::invalid_argument unless 1 <= n <= kMaxPoolThreads.
void pool_set_num_threads(int n);
// Pin worker k to cpus[k % cpus.size()]; an empty list unpins. Throws
// std::invalid_argument, before anything changes, for an id outside the calling thread's
// affinity mask, and std::runtime_error (pinning unchanged) if the OS refuses a CPU.
void pool_pin(const std::vector<int>& cpus);
std::vector<int> pool_pinned_cpus();
// Runs task(k) for k in [0, tasks) (tasks <= pool_num_threads()) on the workers;
// a single task runs on the calling thread.
void pool_run(int tasks, const std::function<void(int)>& task);

}  // namespace cpu_offload
