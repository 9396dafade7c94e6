// A persistent pool of native worker threads (no OpenMP, so no second runtime next to
// torch's). run() hands task k in [0, tasks) to worker k and blocks until all are done;
// the first exception thrown by a task is rethrown on the caller's thread.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace cpu_offload {

// Number of worker threads; default: the CPUs in the process's affinity mask.
int pool_num_threads();
void pool_set_num_threads(int n);
// Pin worker k to cpus[k % cpus.size()]; an empty list unpins.
void pool_pin(const std::vector<int>& cpus);
std::vector<int> pool_pinned_cpus();
// Runs task(k) for k in [0, tasks) (tasks <= pool_num_threads()) on the workers;
// a single task runs on the calling thread.
void pool_run(int tasks, const std::function<void(int)>& task);

}  // namespace cpu_offload
