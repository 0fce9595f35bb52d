// Routed SwiGLU experts, the part every weight layout shares (tiled.cpp's fp32 panels, int4.cpp's
// int4 panels): the (token, slot) pairs grouped per expert, each used expert's rows gathered, run
// through its gate_up projection (`project(e, 0, in, rows, out)`: out [rows, 2I] = [gate ; up]),
// SwiGLU, its down projection (`project(e, 1, in, rows, out)`: out [rows, H]), and the pair
// outputs summed per token in slot order, weighted: the order ops/moe/naive.py sums them in. The
// used experts run on several threads where the call is large enough (parallel.h), each expert
// whole on one thread: the same numbers whatever the split.
#pragma once

#include <ATen/ATen.h>

#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_exp.h"

namespace clover_experts {

// a[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u for j < I: 16 lanes at a time where AVX-512 is
// built (vec_exp.h, the tail masked), else std::exp.
inline void swiglu(const float* g, const float* u, float* a, int64_t I) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < I; j += 16) {
    const __mmask16 m = I - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (I - j)) - 1);
    const __m512 gv = _mm512_maskz_loadu_ps(m, g + j), uv = _mm512_maskz_loadu_ps(m, u + j);
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), clover_vec::exp_vec(_mm512_sub_ps(_mm512_setzero_ps(), gv)));
    _mm512_mask_storeu_ps(a + j, m, _mm512_mul_ps(_mm512_div_ps(gv, den), uv));
  }
#else
  for (int64_t j = 0; j < I; ++j) a[j] = g[j] / (1.f + std::exp(-g[j])) * u[j];
#endif
}

// `macs_per_work`: multiply-adds per unit of parallel.h's work (clover_parallel::kInt8MacsPerFp32 for int8 ones).
template <typename Project>
at::Tensor routed_experts(const at::Tensor& x, const at::Tensor& top_idx, const at::Tensor& top_w, int64_t E, int64_t I,
                          const char* op, Project&& project, int64_t macs_per_work = 1) {
  const int64_t T = x.size(0), k = top_idx.size(1), H = x.size(1), I2 = 2 * I;
  const auto xc = x.to(at::kFloat).contiguous();
  const auto idx = top_idx.to(at::kLong).contiguous();
  const auto wts = top_w.to(at::kFloat).contiguous();
  const float* xp = xc.data_ptr<float>();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const float* wp = wts.data_ptr<float>();
  std::vector<std::vector<int64_t>> pairs(E);  // pair = token * k + slot, per expert
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(ip[p] >= 0 && ip[p] < E, op, ": expert index out of range");
    pairs[ip[p]].push_back(p);
  }
  std::vector<int64_t> used;
  for (int64_t e = 0; e < E; ++e)
    if (!pairs[e].empty()) used.push_back(e);
  std::vector<float> out(T * k * H);
  const auto run = [&](int64_t e, std::vector<float>& xs, std::vector<float>& h, std::vector<float>& a, std::vector<float>& o) {
    const int64_t n = static_cast<int64_t>(pairs[e].size());
    xs.resize(n * H), h.resize(n * I2), a.resize(n * I), o.resize(n * H);
    for (int64_t r = 0; r < n; ++r) std::copy_n(xp + (pairs[e][r] / k) * H, H, xs.data() + r * H);
    project(e, 0, xs.data(), n, h.data());
    for (int64_t r = 0; r < n; ++r) swiglu(h.data() + r * I2, h.data() + r * I2 + I, a.data() + r * I, I);
    project(e, 1, a.data(), n, o.data());
    for (int64_t r = 0; r < n; ++r) std::copy_n(o.data() + r * H, H, out.data() + pairs[e][r] * H);
  };
  // the used experts over threads (parallel.h), each expert's rows and pair outputs its own: one
  // expert's average work per unit
  const int64_t units = static_cast<int64_t>(used.size());
  clover_parallel::split(units, units ? T * k * 3 * I * H / units / macs_per_work : 0, [&](int64_t u0, int64_t u1) {
    std::vector<float> xs, h, a, o;
    for (int64_t u = u0; u < u1; ++u) run(used[u], xs, h, a, o);
  });
  auto y = at::empty({T, H}, xc.options());
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* row = yp + t * H;
    std::fill_n(row, H, 0.f);
    for (int64_t s = 0; s < k; ++s) {
      const float w = wp[t * k + s];
      const float* src = out.data() + (t * k + s) * H;
      for (int64_t j = 0; j < H; ++j) row[j] += src[j] * w;
    }
  }
  return y;
}

}  // namespace clover_experts
