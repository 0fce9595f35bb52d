// The kernels' one way to use more than one thread: units of work (panel pairs of a linear, experts)
// split over torch.get_num_threads() threads (one where torch is set to one), as many as get
// `min_work()` multiply-adds each. A smaller call stays on the calling thread: waking a second thread
// costs more than a small product. A unit's outputs are computed by one thread the same way whatever
// the split, so results do not depend on the thread count (tests/test_ops.py, test_int4_linear.py).
//
// The helpers are threads of our own, not torch's OpenMP team: an OpenMP region ends in a barrier
// where the caller waits for every thread of the team, and on a machine shared with other processes
// a thread that has not been scheduled yet stalled calls for a whole time slice. Here the caller
// claims runs of units from a shared counter alongside the helpers and waits only for runs a helper
// has started: a helper that wakes late finds the job done.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>

namespace clover_parallel {

// Settable for benchmarks and tests (clover_cpu::parallel_min_work); inline: one value for every
// source of the extension.
inline std::atomic<int64_t>& min_work() {
  static std::atomic<int64_t> least{int64_t{1} << 19};
  return least;
}

// Tests only (clover_cpu::parallel_helpers_only): the caller claims no work and waits while the
// helpers run every unit, so a test sees what a helper thread computes (its thread_local state).
inline std::atomic<bool>& helpers_only() {
  static std::atomic<bool> on{false};
  return on;
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The one job in flight. Its fields are written while `open` is false and read by a helper only
// after it has entered (`active`) and seen `open`; the caller closes the job and waits for `active`
// to drain before it returns, so no helper touches a finished job's closure.
struct Pool {
  std::mutex caller;  // one caller at a time: another one meanwhile runs alone
  std::atomic<uint32_t> generation{0};
  std::atomic<bool> open{false};
  std::atomic<int> active{0};
  std::atomic<int64_t> next{0};
  int64_t units = 0, run = 1;
  int helpers = 0, started = 0;
  const void* fn = nullptr;
  void (*call)(const void*, int64_t, int64_t) = nullptr;

  void claim() {
    for (int64_t u = next.fetch_add(run); u < units; u = next.fetch_add(run)) call(fn, u, std::min(units, u + run));
  }
};

inline Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: the helpers sleep on it until the process ends
  return *p;
}

// A helper: spins a little after each job (the next one may follow at once), then sleeps. Short:
// a spinning helper holds a core that torch's own threads (its ops between ours) may want.
constexpr int kSpins = 1024;

// `seen`: the generation before the job that started it, so a helper started for a job takes part in it.
inline void helper(int index, uint32_t seen) {
  Pool& p = pool();
  for (;;) {
    for (int i = 0; i < kSpins && p.generation.load(std::memory_order_acquire) == seen; ++i) relax();
    p.generation.wait(seen);
    seen = p.generation.load();
    if (!p.open.load()) continue;  // done already: the usual case for a helper that woke late
    p.active.fetch_add(1);
    if (p.open.load() && index < p.helpers) p.claim();
    p.active.fetch_sub(1);
  }
}

// An int8 multiply-add (int4_q8.cpp's 4-way dot products: four times the products of an fp32 FMA per
// instruction) takes a fraction of an fp32 one's time: `split`'s work counts this many as one
// (bench/linear.py --scaling).
constexpr int64_t kInt8MacsPerFp32 = 3;

// fn(begin, end) over [0, units), each unit `unit_work` fp32 multiply-adds (or their equivalent in time).
template <typename Fn>
inline void split(int64_t units, int64_t unit_work, const Fn& fn) {
  const int64_t least = min_work().load(std::memory_order_relaxed);
  const int64_t grain = unit_work > 0 ? std::max<int64_t>(1, least / unit_work) : units;
  const int64_t threads = std::min<int64_t>({at::get_num_threads(), units / grain, 64});
  Pool& p = pool();
  std::unique_lock<std::mutex> lock(p.caller, std::defer_lock);
  if (threads < 2 || at::in_parallel_region() || !lock.try_lock()) return fn(int64_t{0}, units);
  for (; p.started < threads - 1; ++p.started) std::thread(helper, p.started, p.generation.load()).detach();
  p.units = units, p.run = std::max<int64_t>(1, units / (4 * threads)), p.helpers = static_cast<int>(threads - 1);
  p.fn = &fn, p.call = [](const void* f, int64_t begin, int64_t end) { (*static_cast<const Fn*>(f))(begin, end); };
  p.next.store(0);
  p.open.store(true);
  p.generation.fetch_add(1);
  p.generation.notify_all();
  if (helpers_only().load(std::memory_order_relaxed))
    while (p.next.load() < units) std::this_thread::yield();
  else
    p.claim();
  p.open.store(false);
  for (int i = 0; p.active.load() != 0; ++i) i < 4096 ? relax() : std::this_thread::yield();
}

}  // namespace clover_parallel
