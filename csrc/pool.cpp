// Worker pool implementation: one generation counter under a mutex wakes the workers;
// each worker runs its own task index and the caller waits for a countdown to reach zero.
// NOTE: after fork() the child has none of the parent's threads; the atfork handler drops
// the (now thread-less) pool so the child lazily builds a fresh one.
// NOTE: nothing here may reach std::terminate: a Pool whose construction fails stops and
// joins the threads it started before rethrowing, and g_cpus only ever holds ids that
// were validated against the affinity mask and accepted by the OS.
#include "pool.h"
#include <pthread.h>
#include <sched.h>
#include <cerrno>
#include <condition_variable>
#include <cstring>
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
#elif defined(__aarch64__)
  // FPCR = 0: round to nearest even, FZ = 0 (no flush-to-zero), DN = 0, AH = 0, no traps.
  uint64_t saved = get();
  DefaultFloatEnv() { set(0); }
  ~DefaultFloatEnv() { set(saved); }
  static uint64_t get() {
    uint64_t v;
    __asm__ volatile("mrs %0, fpcr" : "=r"(v));
    return v;
  }
  static void set(uint64_t v) { __asm__ volatile("msr fpcr, %0" : : "r"(v)); }
#endif
};

int affinity_cpu_count() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

// "0-3,8" for the calling thread's affinity mask (for error messages).
std::string allowed_cpu_list() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return "unknown";
  std::string out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (!CPU_ISSET(c, &set) || (c > 0 && CPU_ISSET(c - 1, &set))) continue;
    int last = c;
    while (last + 1 < CPU_SETSIZE && CPU_ISSET(last + 1, &set)) ++last;
    out += (out.empty() ? "" : ",") + std::to_string(c) + (last > c ? "-" + std::to_string(last) : "");
  }
  return out;
}

// Throws std::invalid_argument naming the first id outside the calling thread's affinity mask.
void check_cpus(const std::vector<int>& cpus) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) != 0) CPU_ZERO(&allowed);
  for (size_t i = 0; i < cpus.size(); ++i) {
    const int c = cpus[i];
    if (c < 0 || c >= CPU_SETSIZE || !CPU_ISSET(c, &allowed))
      throw std::invalid_argument("cpus[" + std::to_string(i) + "]=" + std::to_string(c) +
                                  " is not in this process's affinity mask (allowed CPUs: " +
                                  allowed_cpu_list() + ")");
  }
}

// The OS refused a worker's CPU mask (pthread_setaffinity_np failed).
struct PinError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Pool {
 public:
  Pool(int n, const std::vector<int>& cpus) {
    try {
      threads_.reserve(n);
      for (int k = 0; k < n; ++k) threads_.emplace_back([this, k] { worker(k); });
      set_affinity(cpus);
    } catch (...) {
      shutdown();  // NOTE: a joinable std::thread destroyed by the unwinding would terminate
      throw;
    }
    cpus_ = cpus;
  }
  ~Pool() { shutdown(); }
  int size() const { return static_cast<int>(threads_.size()); }
  const std::vector<int>& cpus() const { return cpus_; }

  // Strong guarantee: on failure the workers keep their previous pinning.
  void pin(const std::vector<int>& cpus) {
    set_affinity(cpus);
    cpus_ = cpus;
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
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_)
      if (t.joinable()) t.join();
  }

  // The mask worker k gets for `cpus`; an empty list means the calling thread's mask.
  static cpu_set_t mask_for(const std::vector<int>& cpus, int k) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (cpus.empty()) {
      if (sched_getaffinity(0, sizeof(set), &set) != 0) CPU_ZERO(&set);
    } else {
      CPU_SET(cpus[k % cpus.size()], &set);  // ids checked by check_cpus(): < CPU_SETSIZE
    }
    return set;
  }

  // Applies `cpus` to every worker; if the OS refuses one, restores the workers already
  // changed to their previous masks (best effort) and throws.
  void set_affinity(const std::vector<int>& cpus) {
    for (int k = 0; k < size(); ++k) {
      cpu_set_t set = mask_for(cpus, k);
      const int rc = CPU_COUNT(&set) == 0 ? EINVAL
                                          : pthread_setaffinity_np(threads_[k].native_handle(), sizeof(set), &set);
      if (rc == 0) continue;
      for (int j = 0; j < k; ++j) {
        cpu_set_t old = mask_for(cpus_, j);
        if (CPU_COUNT(&old) > 0) pthread_setaffinity_np(threads_[j].native_handle(), sizeof(old), &old);
      }
      if (cpus.empty()) throw PinError("cannot unpin worker thread: " + std::string(std::strerror(rc)));
      throw PinError("cannot pin worker thread to CPU " + std::to_string(cpus[k % cpus.size()]) + ": " +
                     std::strerror(rc) + " (allowed CPUs: " + allowed_cpu_list() + ")");
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
  if (!g_pool) {
    const int n = g_requested_threads > 0 ? g_requested_threads : affinity_cpu_count();
    try {
      g_pool = new Pool(n, g_cpus);
    } catch (const PinError& e) {
      // NOTE: the pinned CPUs were valid when pin_threads() took them but the OS refuses
      // them now (the affinity mask or cpuset shrank): drop them rather than keep ids that
      // would fail every later call.
      if (g_cpus.empty()) throw;
      g_cpus.clear();
      throw std::runtime_error(std::string(e.what()) + "; the worker pinning was dropped, call pin_threads() again");
    }
  }
  return *g_pool;
}

}  // namespace

int pool_num_threads() {
  std::lock_guard<std::mutex> lock(pool_mutex());
  if (g_pool) return g_pool->size();
  return g_requested_threads > 0 ? g_requested_threads : affinity_cpu_count();
}

void pool_set_num_threads(int n) {
  if (n < 1 || n > kMaxPoolThreads)
    throw std::invalid_argument("num_threads must be in [1, " + std::to_string(kMaxPoolThreads) + "], got " +
                                std::to_string(n));
  std::lock_guard<std::mutex> lock(pool_mutex());
  g_requested_threads = n;
  if (g_pool && g_pool->size() != n) {
    delete g_pool;
    g_pool = nullptr;
  }
}

void pool_pin(const std::vector<int>& cpus) {
  check_cpus(cpus);
  std::lock_guard<std::mutex> lock(pool_mutex());
  if (g_pool) g_pool->pin(cpus);  // throws with the old pinning still in place
  g_cpus = cpus;
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
