// The kernels' one way to use more than one thread: units of work (panel pairs of a linear, experts)
// split over torch's intra-op threads (at::parallel_for: OpenMP, torch.get_num_threads(), so one
// thread where torch is set to one), as many threads as get `min_work()` multiply-adds each. A
// smaller call stays on the calling thread: waking a second thread, and waiting for it on a busy
// machine, costs more than a small product. A unit's outputs are computed by one thread the same
// way whatever the split, so results do not depend on the thread count (tests/test_ops.py,
// tests/test_int4_linear.py).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace clover_parallel {

// Settable for benchmarks and tests (clover_cpu::parallel_min_work); inline: one value for every
// source of the extension.
inline std::atomic<int64_t>& min_work() {
  static std::atomic<int64_t> least{int64_t{1} << 19};
  return least;
}

// fn(begin, end) over [0, units), each unit `unit_work` multiply-adds. Threads claim runs of units
// from a shared counter rather than fixed halves: on a shared machine a thread that starts late
// (descheduled) takes less, and the caller's thread never idles waiting for its share.
template <typename Fn>
inline void split(int64_t units, int64_t unit_work, const Fn& fn) {
  const int64_t least = min_work().load(std::memory_order_relaxed);
  const int64_t grain = unit_work > 0 ? std::max<int64_t>(1, least / unit_work) : units;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), units / grain);
  if (threads < 2 || at::in_parallel_region()) return fn(int64_t{0}, units);
  const int64_t run = std::max<int64_t>(1, units / (4 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(run); u < units; u = next.fetch_add(run)) fn(u, std::min(units, u + run));
  });
}

}  // namespace clover_parallel
