// Bit-exactness driver for the native kernels, no Python and no torch: every entry of the
// kernel table (adamw, sign_sgd, their inverses, accumulate, scale_stream), in every dtype / output
// combination, on every ISA compiled into this build (x86-64: avx2, avx512, avx512_bf16;
// aarch64: neon, neon_bf16, sve<bits>[_bf16]) and on the scalar path itself, is compared
// bit for bit against one whole-range call of the scalar path, on fixed pseudo-random
// inputs: sizes 0, 1, 7, 16, 23, 257, 65537 and 1,000,003; denormals, +-0, +-Inf, NaNs with
// payloads (quiet, signalling, negative), bf16 rounding ties and near-ties, values that
// round to Inf, and every bf16 bit pattern as a bf16 input. Each ISA runs every case
// several ways: the whole range in one call, the range cut into pieces at odd offsets,
// and through the worker pool (TensorBatch::parallel_ranges, as bindings.cpp calls it)
// on 1, 2 and 5 threads (3 at the largest size), also from a caller that has set
// flush-to-zero (the pool must run the kernels without it); buffers start at varying
// misalignments.
// ISAs the CPU lacks are skipped with the reason (an SVE build runs only at its own vector
// length); --require=a,b fails the run if one of those is not run. Exit status 0 only
// when every compared value is bit-identical (an fp32 NaN may carry another NaN's payload,
// see is_nan32 below). Built and run by tools/check_kernel_bits.sh (natively
// on x86-64; cross-compiled and under qemu-aarch64 at several SVE vector lengths).
// NOTE: to add a kernel to the table, add one Check to checks() below.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>
#include "../../csrc/batch.h"
#include "../../csrc/dispatch.h"
#include "../../csrc/kernel_table.h"
#include "../../csrc/pool.h"
#if defined(__aarch64__)
#include <sys/auxv.h>
int sve_probe_bytes();  // sve_probe.cpp: svcntb(), built vector-length agnostic
#endif

using namespace cpu_offload;

namespace {

// ---- deterministic inputs ----
struct Rng {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  double uniform() { return (next() >> 11) * (1.0 / 9007199254740992.0); }
};

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// One fp32 value: mostly ordinary magnitudes, about a quarter special bit patterns.
// positive: clears the sign of the ordinary values (second moments), not of the specials.
uint32_t value_bits(Rng& r, bool positive) {
  const uint32_t sign = (r.u32() & 1u) << 31, k = r.u32() % 32;
  switch (k) {
    case 0: return r.u32();                                            // any pattern
    case 1: return sign | (r.u32() & 0x007FFFFFu);                     // denormal (or 0)
    case 2: return sign;                                               // +-0
    case 3: return sign | 0x7F800000u;                                 // +-Inf
    case 4: return sign | 0x7FC00000u | (r.u32() & 0x003FFFFFu);       // quiet NaN, payload
    case 5: return sign | 0x7F800000u | (1u + r.u32() % 0x003FFFFFu);  // signalling NaN
    case 6: return (r.u32() & 0xFFFF0000u) | 0x8000u;                  // bf16 tie
    case 7: return (r.u32() & 0xFFFF0000u) | ((r.u32() & 1) ? 0x7FFFu : 0x8001u);  // near tie
    case 8: return sign | 0x7F7F0000u | (r.u32() & 0xFFFFu);           // rounds to Inf in bf16
    default: {
      const double mag = std::ldexp(0.5 + 0.5 * r.uniform(), static_cast<int>(r.u32() % 40) - 30);
      uint32_t u;
      const float f = static_cast<float>(mag);
      std::memcpy(&u, &f, 4);
      return positive ? u : (u | sign);
    }
  }
}

// ---- buffers: 64-byte aligned storage, data starting `shift` elements in ----
struct Buffer {
  const char* role;
  int elem;  // bytes per element: 4 (fp32) or 2 (bf16)
  int64_t n;
  int shift;
  std::shared_ptr<unsigned char> storage;
  unsigned char* data() const { return storage.get() + shift * elem; }
  size_t bytes() const { return static_cast<size_t>(n) * elem; }
  Buffer clone() const {
    Buffer b = alloc(role, elem, n, shift);
    std::memcpy(b.data(), data(), bytes());
    return b;
  }
  static Buffer alloc(const char* role, int elem, int64_t n, int shift) {
    const size_t size = ((static_cast<size_t>(n + shift) * elem) / 64 + 1) * 64;
    return {role, elem, n, shift, std::shared_ptr<unsigned char>(static_cast<unsigned char*>(std::aligned_alloc(64, size)), std::free)};
  }
};

// fp32 values, or the high halves of such values as bf16 (so ties and NaNs stay in), or
// with `every_bf16`, all 65536 bf16 bit patterns in a scrambled order.
Buffer make_input(const char* role, DType dt, int64_t n, Rng& r, bool positive, bool every_bf16 = false) {
  Buffer b = Buffer::alloc(role, dt == DType::f32 ? 4 : 2, n, static_cast<int>(r.u32() % 5));
  const uint32_t offset = r.u32();
  for (int64_t i = 0; i < n; ++i) {
    if (dt == DType::f32) {
      const uint32_t u = value_bits(r, positive);
      std::memcpy(b.data() + 4 * i, &u, 4);
    } else {
      const uint16_t h = every_bf16 ? static_cast<uint16_t>(40503u * static_cast<uint32_t>(i) + offset)
                                    : static_cast<uint16_t>(value_bits(r, positive) >> 16);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
  }
  return b;
}

Buffer make_output(const char* role, int elem, int64_t n, Rng& r) {
  Buffer b = Buffer::alloc(role, elem, n, static_cast<int>(r.u32() % 5));
  std::memset(b.data(), 0xA5, b.bytes());  // any stale content must be overwritten
  return b;
}

// ---- one case: buffers and a call of one table entry on the element range [lo, hi) ----
using RangeCall = std::function<void(const KernelTable&, const std::vector<Buffer>&, int64_t, int64_t)>;
struct Case {
  std::string label;
  int64_t n;
  std::vector<Buffer> buffers;
  RangeCall call;
};
// A table entry: its name, how many configurations (dtypes, output, constants) it has, and
// the case of one configuration at one size.
// NOTE: the 1,000,003-element size runs only large_configs (all when empty): it is slow
// under emulation and the small sizes already cover every configuration.
struct Check {
  const char* entry;
  int configs;
  std::function<Case(int64_t n, Rng& r, int config)> make;
  std::vector<int> large_configs;
};

template <class T>
T* at(const Buffer& b, int64_t i) {
  return reinterpret_cast<T*>(b.data() + i * b.elem);
}

const char* dname(DType d) { return d == DType::f32 ? "f32" : "bf16"; }
const char* oname(OutKind o) { return o == OutKind::none ? "none" : o == OutKind::f32 ? "f32" : "bf16"; }

// AdamW constants computed as csrc/scalars.cpp computes them (double, once per tensor).
AdamWScalars adamw_scalars(double lr, double beta1, double beta2, double eps, double wd, double grad_scale,
                           double step) {
  const double bc1 = 1.0 - std::pow(beta1, step), bc2 = 1.0 - std::pow(beta2, step), bc2_sqrt = std::sqrt(bc2);
  return {static_cast<float>(grad_scale),     static_cast<float>(1.0 - lr * wd),
          static_cast<float>(beta1),          static_cast<float>(1.0 - beta1),
          static_cast<float>(beta2),          static_cast<float>(1.0 - beta2),
          static_cast<float>(eps * bc2_sqrt), static_cast<float>(-(lr * bc2_sqrt / bc1))};
}

std::vector<Check> checks() {
  std::vector<Check> c;
  // config = 6*g + 3*m + out (g, m: 0 f32, 1 bf16; out: 0 none, 1 f32, 2 bf16)
  c.push_back({"adamw", 2 * 2 * 3, [](int64_t n, Rng& r, int config) {
    const AdamWScalars sets[] = {adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 1),
                                 adamw_scalars(3e-4, 0.9, 0.95, 1e-6, 0.1, 0.25, 7),
                                 adamw_scalars(1.0, 0.0, 0.5, 1e-30, 0.0, 3.0, 2)};
    const DType g = config / 6 ? DType::bf16 : DType::f32, m = config / 3 % 2 ? DType::bf16 : DType::f32;
    const OutKind o = static_cast<OutKind>(config % 3);
    const int which = (config / 3 + config % 3) % 3;  // each (g, m) meets every set once
    const AdamWScalars s = sets[which];
    std::vector<Buffer> b = {make_input("param", DType::f32, n, r, false),
                             make_input("grad", g, n, r, false, g == DType::bf16),
                             make_input("exp_avg", m, n, r, false), make_input("exp_avg_sq", m, n, r, true)};
    if (o != OutKind::none) b.push_back(make_output("out", o == OutKind::f32 ? 4 : 2, n, r));
    return Case{std::string("g=") + dname(g) + " m=" + dname(m) + " out=" + oname(o) + " scalars=" +
                    std::to_string(which), n, b,
                [s, g, m, o](const KernelTable& k, const std::vector<Buffer>& b, int64_t lo, int64_t hi) {
                  k.adamw(s, at<float>(b[0], lo), at<char>(b[1], lo), g, at<char>(b[2], lo), at<char>(b[3], lo), m,
                          o == OutKind::none ? nullptr : at<char>(b[4], lo), o, hi - lo);
                }};
  }, {2, 4, 8, 11}});
  // config = 9*g + 3*out + constants
  c.push_back({"sign_sgd", 2 * 3 * 3, [](int64_t n, Rng& r, int config) {
    // {1, 0} is the identity step: out = p, so a bf16 out checks the rounding of raw fp32
    // patterns (ties, NaN payloads, denormals) directly.
    const SignSGDScalars sets[] = {{static_cast<float>(1.0 - 1e-3 * 0.01), 1e-3f, 1.0f}, {1.0f, 0.5f, 0.25f},
                                   {1.0f, 0.0f, 1.0f}};
    const DType g = config / 9 ? DType::bf16 : DType::f32;
    const OutKind o = static_cast<OutKind>(config / 3 % 3);
    const int which = config % 3;
    const SignSGDScalars s = sets[which];
    std::vector<Buffer> b = {make_input("param", DType::f32, n, r, false),
                             make_input("grad", g, n, r, false, g == DType::bf16)};
    if (o != OutKind::none) b.push_back(make_output("out", o == OutKind::f32 ? 4 : 2, n, r));
    return Case{std::string("g=") + dname(g) + " out=" + oname(o) + " scalars=" + std::to_string(which), n, b,
                [s, g, o](const KernelTable& k, const std::vector<Buffer>& b, int64_t lo, int64_t hi) {
                  k.sign_sgd(s, at<float>(b[0], lo), at<char>(b[1], lo), g,
                             o == OutKind::none ? nullptr : at<char>(b[2], lo), o, hi - lo);
                }};
  }, {3, 17}});
  // config = 2*g + m (g, m: 0 f32, 1 bf16), times the three constant sets
  c.push_back({"adamw_inverse", 2 * 2 * 3, [](int64_t n, Rng& r, int config) {
    const AdamWScalars sets[] = {adamw_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 1),
                                 adamw_scalars(3e-4, 0.9, 0.95, 1e-6, 0.1, 0.25, 7),
                                 adamw_scalars(1.0, 0.0, 0.5, 1e-30, 0.0, 3.0, 2)};
    const DType g = config / 6 ? DType::bf16 : DType::f32, m = config / 3 % 2 ? DType::bf16 : DType::f32;
    const int which = config % 3;
    const AdamWScalars s = sets[which];
    std::vector<Buffer> b = {make_input("param", DType::f32, n, r, false),
                             make_input("grad", g, n, r, false, g == DType::bf16),
                             make_input("exp_avg", m, n, r, false), make_input("exp_avg_sq", m, n, r, true)};
    return Case{std::string("g=") + dname(g) + " m=" + dname(m) + " scalars=" + std::to_string(which), n, b,
                [s, g, m](const KernelTable& k, const std::vector<Buffer>& b, int64_t lo, int64_t hi) {
                  k.adamw_inverse(s, at<float>(b[0], lo), at<char>(b[1], lo), g, at<char>(b[2], lo),
                                  at<char>(b[3], lo), m, hi - lo);
                }};
  }, {1, 10}});
  // config = 3*g + constants
  c.push_back({"sign_sgd_inverse", 2 * 3, [](int64_t n, Rng& r, int config) {
    const SignSGDScalars sets[] = {{static_cast<float>(1.0 - 1e-3 * 0.01), 1e-3f, 1.0f}, {1.0f, 0.5f, 1e-30f},
                                   {0.0f, 1.0f, 0.0f}};
    const DType g = config / 3 ? DType::bf16 : DType::f32;
    const int which = config % 3;
    const SignSGDScalars s = sets[which];
    std::vector<Buffer> b = {make_input("param", DType::f32, n, r, false),
                             make_input("grad", g, n, r, false, g == DType::bf16)};
    return Case{std::string("g=") + dname(g) + " scalars=" + std::to_string(which), n, b,
                [s, g](const KernelTable& k, const std::vector<Buffer>& b, int64_t lo, int64_t hi) {
                  k.sign_sgd_inverse(s, at<float>(b[0], lo), at<char>(b[1], lo), g, hi - lo);
                }};
  }, {4}});
  // config = 2*g + add
  c.push_back({"accumulate", 2 * 2, [](int64_t n, Rng& r, int config) {
    const DType g = config / 2 ? DType::bf16 : DType::f32;
    const bool add = config % 2;
    std::vector<Buffer> b = {make_input("acc", DType::f32, n, r, false),
                             make_input("grad", g, n, r, false, g == DType::bf16)};
    return Case{std::string("g=") + dname(g) + (add ? " add" : " copy"), n, b,
                [g, add](const KernelTable& k, const std::vector<Buffer>& b, int64_t lo, int64_t hi) {
                  k.accumulate(at<float>(b[0], lo), at<char>(b[1], lo), g, add, hi - lo);
                }};
  }, {0, 3}});
  c.push_back({"scale_stream", 4, [](int64_t n, Rng& r, int config) {
    static const float factors[] = {0.5f, 3.0f, 1e-30f, 1e30f};  // exact, rounding, into denormals, to Inf
    const float factor = factors[config];
    std::vector<Buffer> b = {make_input("x", DType::f32, n, r, false)};
    char label[32];
    std::snprintf(label, sizeof label, "factor=%g", factor);
    return Case{label, n, b, [factor](const KernelTable& k, const std::vector<Buffer>& b, int64_t lo, int64_t hi) {
                  k.scale_stream(at<float>(b[0], lo), factor, hi - lo);
                }};
  }, {1}});
  return c;
}

// ---- ways of covering [0, n) with calls ----
struct Split {
  std::string name;
  int threads;        // 0: direct calls on this thread
  bool ftz = false;   // the calling thread flushes denormals (the pool must undo it)
};

// Sets (or restores) flush-to-zero on this thread: FPCR.FZ on aarch64, MXCSR FTZ|DAZ on x86.
struct FlushToZero {
#if defined(__aarch64__)
  uint64_t saved;
  FlushToZero() {
    __asm__ volatile("mrs %0, fpcr" : "=r"(saved));
    __asm__ volatile("msr fpcr, %0" : : "r"(saved | (1ull << 24)));
  }
  ~FlushToZero() { __asm__ volatile("msr fpcr, %0" : : "r"(saved)); }
#elif defined(__x86_64__)
  unsigned saved;
  FlushToZero() {
    __asm__ volatile("stmxcsr %0" : "=m"(saved));
    unsigned v = saved | 0x8040u;
    __asm__ volatile("ldmxcsr %0" : : "m"(v));
  }
  ~FlushToZero() { __asm__ volatile("ldmxcsr %0" : : "m"(saved)); }
#endif
};

void run_split(const Split& sp, const KernelTable& k, const Case& c, const std::vector<Buffer>& b, uint64_t seed) {
  if (sp.threads == 0 && sp.name == "whole") return c.call(k, b, 0, c.n);
  if (sp.threads == 0) {  // pieces: cuts at 1, n-1 and a few pseudo-random odd offsets
    std::set<int64_t> cuts = {0, c.n};
    Rng r{seed};
    if (c.n > 2) cuts.insert({1, c.n - 1});
    for (int i = 0; i < 4 && c.n > 0; ++i) cuts.insert(static_cast<int64_t>(r.next() % static_cast<uint64_t>(c.n)) | 1);
    for (auto it = cuts.begin(); std::next(it) != cuts.end(); ++it)
      if (*std::next(it) > *it) c.call(k, b, *it, std::min(*std::next(it), c.n));
    return;
  }
  // The pool, as bindings.cpp uses it: one tensor, blocks of the range over the workers.
  // NOTE: with ftz, the caller flushes denormals; the pool runs every task (also the one it
  // may run on the caller's thread) in the default FP environment, so the bits must not change.
  std::unique_ptr<FlushToZero> ftz(sp.ftz ? new FlushToZero : nullptr);
  pool_set_num_threads(sp.threads);
  std::vector<Operand> ops;
  for (const Buffer& x : b) ops.push_back({x.role, {reinterpret_cast<uintptr_t>(x.data())}, x.elem});
  TensorBatch batch({c.n}, ops);
  batch.parallel_ranges([&](int64_t, int64_t lo, int64_t hi) { c.call(k, b, lo, hi); });
}

struct Tally {
  std::string isa;
  const KernelTable* table = nullptr;
  std::string skip;  // reason, when not run
  int64_t runs = 0, values = 0, mismatches = 0;
  int64_t nan_payloads = 0;  // fp32 NaN against fp32 NaN of another sign or payload
  double seconds = 0;
};

// NOTE: which NaN an operation with two NaN operands passes on (and so the sign and payload
// of an fp32 NaN result) is the compiler's choice: it may swap the operands of a
// commutative add or multiply, differently in each build and in each loop of one build
// (x86 shows it too, between the scalar build and its own scalar tail). So an fp32 NaN
// matches any fp32 NaN, as tests/test_kernels.py has it; every other fp32 value, and every
// bf16 value (a bf16 NaN is always 0x7FC0), must be bit-identical.
bool is_nan32(uint32_t u) { return (u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu) != 0; }

uint32_t bits_at(const Buffer& b, int64_t i) {
  uint32_t u = 0;
  std::memcpy(&u, b.data() + i * b.elem, b.elem);
  return u;
}

std::string platform_line() {
#if defined(__aarch64__)
  uint64_t fpcr;
  __asm__ volatile("mrs %0, fpcr" : "=r"(fpcr));
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  std::ostringstream s;
  s << "aarch64: asimd=" << !!(hwcap & (1ul << 1)) << " bf16=" << !!(hwcap2 & (1ul << 14))
    << " sve=" << !!(hwcap & (1ul << 22)) << " svebf16=" << !!(hwcap2 & (1ul << 12));
  if (hwcap & (1ul << 22)) s << " svcntb()=" << sve_probe_bytes() << " (" << 8 * sve_probe_bytes() << "-bit SVE)";
  s << " FPCR=0x" << std::hex << fpcr << (fpcr & (1u << 24) ? " (FZ set!)" : " (FZ clear)");
  return s.str();
#elif defined(__x86_64__)
  return "x86-64";
#else
  return "unknown architecture";
#endif
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  std::set<std::string> required;
  int expect_sve_bytes = -1;
  std::string expect_pick;  // the ISA dispatch must choose by itself on this CPU
  std::set<std::string> only;  // run just these ISAs (all when empty)
  bool quick = false;
  for (int a = 1; a < argc; ++a) {
    std::string arg = argv[a];
    if (arg.rfind("--require=", 0) == 0) {
      std::stringstream ss(arg.substr(10));
      for (std::string x; std::getline(ss, x, ',');) if (!x.empty()) required.insert(x);
    } else if (arg.rfind("--expect-sve-bits=", 0) == 0) {
      expect_sve_bytes = std::atoi(arg.c_str() + 18) / 8;
    } else if (arg.rfind("--only=", 0) == 0) {
      std::stringstream ss(arg.substr(7));
      for (std::string x; std::getline(ss, x, ',');) if (!x.empty()) only.insert(x);
    } else if (arg.rfind("--expect-pick=", 0) == 0) {
      expect_pick = arg.substr(14);
    } else if (arg == "--quick") {  // sizes up to 257 only (a dispatch smoke test)
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--require=isa,...] [--expect-sve-bits=N] [--expect-pick=isa] [--only=isa,...] [--quick]\n", argv[0]);
      return 2;
    }
  }
  std::printf("%s\n", platform_line().c_str());
  // NOTE: denormal arithmetic must be kept (no flush-to-zero) for the scalar path to mean
  // what torch computes; the pool sets the default FP environment, this thread must have it.
  volatile float tiny = 1e-38f;
  if (tiny * 0.5f == 0.f) {
    std::printf("FAIL: this thread flushes denormals to zero\n");
    return 1;
  }
  std::printf("dispatch picks: %s; available: %s; known: %s\n", active_isa().c_str(), join(available_isas()).c_str(),
              join(known_isas()).c_str());
  int failures = 0;
  if (!expect_pick.empty() && active_isa() != expect_pick) {
    std::printf("FAIL: dispatch should pick %s here\n", expect_pick.c_str());
    ++failures;
  }
#if defined(__aarch64__)
  if (expect_sve_bytes >= 0) {
    const int got = (getauxval(AT_HWCAP) & (1ul << 22)) ? sve_probe_bytes() : 0;
    if (got != expect_sve_bytes) {
      std::printf("FAIL: expected a %d-bit SVE vector, this CPU has %d bits\n", 8 * expect_sve_bytes, 8 * got);
      ++failures;
    }
  }
#else
  if (expect_sve_bytes > 0) {
    std::printf("FAIL: --expect-sve-bits on a CPU without SVE\n");
    ++failures;
  }
#endif

  const KernelTable* scalar = kernel_table_scalar();
  std::vector<Tally> tallies;
  const std::vector<std::string> available = available_isas();
  for (const std::string& isa : known_isas()) {
    Tally t;
    t.isa = isa;
    try {
      set_active_isa(isa);
      t.table = &active_kernels();
    } catch (const std::exception& e) {
      t.skip = e.what();
#if defined(__aarch64__)
      if (isa.rfind("sve", 0) == 0) {
        const int bits = (getauxval(AT_HWCAP) & (1ul << 22)) ? 8 * sve_probe_bytes() : 0;
        t.skip += bits ? " (its SVE vector is " + std::to_string(bits) + " bits)" : " (no SVE)";
      }
#endif
    }
    if (t.table && !only.empty() && !only.count(isa)) {
      t.table = nullptr;
      t.skip = "not selected (--only)";
    }
    tallies.push_back(t);
  }
  for (const std::string& r : required) {
    bool ran = false;
    for (const Tally& t : tallies) ran |= t.isa == r && t.table;
    if (!ran) {
      std::printf("FAIL: required ISA %s does not run here\n", r.c_str());
      ++failures;
    }
  }

  std::vector<int64_t> sizes = {0, 1, 7, 16, 23, 257, 65537, 1000003};
  if (quick) sizes = {0, 1, 7, 16, 23, 257};
  const std::vector<Split> small_splits = {{"whole", 0}, {"pieces", 0}, {"pool2", 2}, {"pool5", 5},
                                           {"pool1_ftz", 1, true}, {"pool2_ftz", 2, true}};
  // NOTE: at 1,000,003 elements (slow under emulation) each case runs once, through the
  // pool at 3 threads and the module's default minimum block, as a large tensor is split.
  const std::vector<Split> large_splits = {{"pool3", 3}};
  int printed = 0;
  uint64_t seed = 1;
  for (const Check& check : checks()) {
    for (int64_t n : sizes) {
      Rng rng{0x5EED0000u + static_cast<uint64_t>(n) * 31 + std::strlen(check.entry)};
      const bool large = n > 100000;
      g_min_elements_per_worker.store(large ? 32768 : 1);
      for (int config = 0; config < check.configs; ++config) {
        const auto& lc = check.large_configs;
        if (large && !lc.empty() && std::find(lc.begin(), lc.end(), config) == lc.end()) continue;
        const Case c = check.make(n, rng, config);
        std::vector<Buffer> want;
        for (const Buffer& b : c.buffers) want.push_back(b.clone());
        c.call(*scalar, want, 0, c.n);
        for (Tally& t : tallies) {
          if (!t.table) continue;
          for (const Split& sp : large ? large_splits : small_splits) {
            std::vector<Buffer> got;
            for (const Buffer& b : c.buffers) got.push_back(b.clone());
            const auto t0 = std::chrono::steady_clock::now();
            run_split(sp, *t.table, c, got, ++seed);
            t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            ++t.runs;
            for (size_t j = 0; j < got.size(); ++j) {
              t.values += got[j].n;
              if (std::memcmp(got[j].data(), want[j].data(), got[j].bytes()) == 0) continue;
              for (int64_t i = 0; i < c.n; ++i) {
                const uint32_t w = bits_at(want[j], i), g = bits_at(got[j], i);
                if (w == g) continue;
                if (got[j].elem == 4 && is_nan32(w) && is_nan32(g)) {
                  ++t.nan_payloads;
                  continue;
                }
                ++t.mismatches;
                if (printed++ < 20)
                  std::printf("MISMATCH %s %s %s n=%" PRId64 " split=%s %s[%" PRId64 "]: scalar 0x%08x, got 0x%08x\n",
                              t.isa.c_str(), check.entry, c.label.c_str(), c.n, sp.name.c_str(), got[j].role, i, w, g);
              }
            }
          }
        }
      }
    }
  }
  pool_set_num_threads(1);

  for (const Tally& t : tallies) {
    if (!t.table) {
      std::printf("SKIP %-12s %s\n", t.isa.c_str(), t.skip.c_str());
      continue;
    }
    std::printf("%s %-12s %6" PRId64 " runs, %11" PRId64 " values compared, %" PRId64
                " differ (and %" PRId64 " fp32 NaNs with another payload), kernels %.1f s\n",
                t.mismatches ? "FAIL" : "PASS", t.isa.c_str(), t.runs, t.values, t.mismatches, t.nan_payloads,
                t.seconds);
    failures += t.mismatches ? 1 : 0;
  }
  std::printf("%s\n", failures ? "kernel bits: FAILED" : "kernel bits: all equal to the scalar path");
  return failures ? 1 : 0;
}
