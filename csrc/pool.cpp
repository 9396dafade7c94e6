// Worker pool implementation: one generation counter under a mutex wakes the workers;
// each worker runs its own task index and the caller waits for a countdown to reach zero.
// NOTE: after fork() the child has none of the parent's threads; the atfork handler drops
// the (now thread-less) pool so the child lazily builds a fresh one.
#include "pool.h"
#include <pthread.h>
#include <sched.h>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

namespace cpu_offload {
namespace {

// NOTE: kernels run with the default floating-point environment (round to nearest, no
// flush-to-zero) whatever the calling thread set, so results never depend on the thread.
struct DefaultFloatEnv {
#if defined(__x86_64__) || defined(_M_X64)
  unsigned saved = _mm_getcsr();
  DefaultFloatEnv() { _mm_setcsr(0x1F80); }
  ~DefaultFloatEnv() { _mm_setcsr(saved); }
#endif
};

int affinity_cpu_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

class Pool {
 public:
  Pool(int n, std::vector<int> cpus) : cpus_(std::move(cpus)) {
    for (int k = 0; k < n; ++k) threads_.emplace_back([this, k] { worker(k); });
    apply_pinning();
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  int size() const { return static_cast<int>(threads_.size()); }
  const std::vector<int>& cpus() const { return cpus_; }

  void pin(std::vector<int> cpus) {
    cpus_ = std::move(cpus);
    apply_pinning();
  }

  void run(int tasks, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> lock(mu_);
    task_ = &task;
    tasks_ = tasks;
    pending_ = size();
    error_ = nullptr;
    ++generation_;
    wake_.notify_all();
    done_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void apply_pinning() {
    for (int k = 0; k < size(); ++k) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (cpus_.empty()) {
        sched_getaffinity(0, sizeof(set), &set);
      } else {
        CPU_SET(cpus_[k % cpus_.size()], &set);
      }
      int rc = pthread_setaffinity_np(threads_[k].native_handle(), sizeof(set), &set);
      if (rc != 0 && !cpus_.empty())
        throw std::runtime_error("cannot pin worker thread to CPU " +
                                 std::to_string(cpus_[k % cpus_.size()]));
    }
  }

  void worker(int k) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task;
      int tasks;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        task = task_;
        tasks = tasks_;
      }
      std::exception_ptr err;
      if (k < tasks) {
        try {
          DefaultFloatEnv env;
          (*task)(k);
        } catch (...) {
          err = std::current_exception();
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (err && !error_) error_ = err;
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> threads_;
  std::vector<int> cpus_;
  std::mutex mu_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* task_ = nullptr;
  int tasks_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
};

// Guards the pool pointer and serializes run() calls from several Python threads.
std::mutex& pool_mutex() {
  static std::mutex mu;
  return mu;
}
Pool* g_pool = nullptr;
int g_requested_threads = 0;     // 0: default from the affinity mask
std::vector<int> g_cpus;

void forget_pool_after_fork() {
  g_pool = nullptr;  // NOTE: leaked on purpose: its threads do not exist in the child.
  new (&pool_mutex()) std::mutex();
}

Pool& pool_locked() {
  static bool atfork_registered = (pthread_atfork(nullptr, nullptr, &forget_pool_after_fork), true);
  (void)atfork_registered;
  if (!g_pool) g_pool = new Pool(g_requested_threads > 0 ? g_requested_threads : affinity_cpu_count(), g_cpus);
  return *g_pool;
}

}  // namespace

int pool_num_threads() {
  std::lock_guard<std::mutex> lock(pool_mutex());
  if (g_pool) return g_pool->size();
  return g_requested_threads > 0 ? g_requested_threads : affinity_cpu_count();
}

void pool_set_num_threads(int n) {
  if (n < 1) throw std::invalid_argument("num_threads must be >= 1, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(pool_mutex());
  g_requested_threads = n;
  if (g_pool && g_pool->size() != n) {
    delete g_pool;
    g_pool = nullptr;
  }
}

void pool_pin(const std::vector<int>& cpus) {
  for (int c : cpus)
    if (c < 0 || c >= CPU_SETSIZE) throw std::invalid_argument("cpus: invalid CPU id " + std::to_string(c));
  std::lock_guard<std::mutex> lock(pool_mutex());
  g_cpus = cpus;
  if (g_pool) g_pool->pin(cpus);
}

std::vector<int> pool_pinned_cpus() {
  std::lock_guard<std::mutex> lock(pool_mutex());
  return g_cpus;
}

void pool_run(int tasks, const std::function<void(int)>& task) {
  if (tasks <= 1) {  // small work: the wake-up would cost more than the work
    DefaultFloatEnv env;
    task(0);
    return;
  }
  std::lock_guard<std::mutex> lock(pool_mutex());
  pool_locked().run(tasks, task);
}

}  // namespace cpu_offload
