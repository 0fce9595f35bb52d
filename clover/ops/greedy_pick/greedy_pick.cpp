// Greedy token choice without the distribution: for each row of `logits` [..., V] (fp32 CPU), the
// first index of the largest logit among the ids not in `banned` (int64, any order), and that
// token's softmax probability over the same ids, 1 / sum_v exp(l_v - max). naive.py is the spec
// (softmax with the banned ids at -inf, argmax, gather); the fill policies scored by probability
// (low_confidence, topk) need nothing else. Three passes over a row held in L1 (max, first index of
// the max, sum of exponentials) on vector-register values (GCC/Clang vector extensions: 16 floats on AVX-512, 8 on
// AVX2), with Cephes' expf polynomial (~1 ulp), instead of forming the softmax, its argmax and a
// gather. Rows run in parallel (at::parallel_for).
// Bound into the extension ops/linear/tiled.py builds (clover_cpu_ops).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "../linear/define_op.h"

namespace {

// One vector register of floats as one value (GCC/Clang vector extension): 16 lanes on AVX-512, else
// 8 (AVX2): wider values on an AVX2 build are split into halves through memory.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float f16v __attribute__((vector_size(4 * kLanes)));
typedef int32_t i16v __attribute__((vector_size(4 * kLanes)));

inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline f16v splat(float x) { return f16v{} + x; }

// exp(x) lane by lane for x <= 0 (x - max), Cephes' expf (~1 ulp). Below -87 it gives exp(-87) ~ 1.6e-38,
// which adds nothing to a sum that is at least 1 (the max's own term); NaN stays NaN.
inline f16v exp_nonpositive(f16v x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const f16v magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer held in the low bits
  const f16v t = x * 1.44269504088896341f + magic;
  const f16v n = t - magic;
  i16v ni, mi;
  std::memcpy(&ni, &t, sizeof t);
  std::memcpy(&mi, &magic, sizeof magic);
  const i16v scale_bits = ((ni - mi) + 127) << 23;
  f16v scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const f16v r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  f16v p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return (p * r * r + r + 1.0f) * scale;
}

float exp_nonpositive(float x) {  // the same for one value (a span's tail)
  float lanes[kLanes] = {x};
  f16v v = load(lanes);
  v = exp_nonpositive(v);
  return v[0];
}

struct Span {
  int64_t begin, end;
};

float span_max(const float* x, Span s, float m) {
  int64_t i = s.begin;
  f16v acc = splat(m);
  for (; i + kLanes <= s.end; i += kLanes) {
    const f16v v = load(x + i);
    acc = acc < v ? v : acc;
  }
  for (; i < s.end; ++i) m = m < x[i] ? x[i] : m;
  for (int k = 0; k < kLanes; ++k) m = m < acc[k] ? acc[k] : m;
  return m;
}

int64_t span_find(const float* x, Span s, float m) {  // the first i with x[i] == m, or -1
  int64_t i = s.begin;
  const f16v mv = splat(m);
  const i16v none{};
  for (; i + kLanes <= s.end; i += kLanes) {
    const i16v eq = load(x + i) == mv;
    if (std::memcmp(&eq, &none, sizeof eq) != 0) break;
  }
  for (; i < s.end; ++i)
    if (x[i] == m) return i;
  return -1;
}

float span_exp_sum(const float* x, Span s, float m) {
  int64_t i = s.begin;
  f16v acc{};
  for (; i + kLanes <= s.end; i += kLanes) acc += exp_nonpositive(load(x + i) - m);
  float sum = 0.0f;
  for (; i < s.end; ++i) sum += exp_nonpositive(x[i] - m);
  for (int k = 0; k < kLanes; ++k) sum += acc[k];
  return sum;
}

std::tuple<at::Tensor, at::Tensor> greedy_pick(const at::Tensor& logits, const at::Tensor& banned) {
  TORCH_CHECK(logits.dim() >= 1 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(),
              "clover_cpu::greedy_pick: logits must be an fp32 CPU tensor of rank >= 1");
  TORCH_CHECK(banned.dim() == 1 && banned.scalar_type() == at::kLong && banned.device().is_cpu(),
              "clover_cpu::greedy_pick: banned must be a 1-D int64 CPU tensor");
  const int64_t V = logits.size(-1);
  TORCH_CHECK(V > 0, "clover_cpu::greedy_pick: empty vocabulary");
  const at::Tensor x = logits.contiguous();
  std::vector<int64_t> ids(banned.data_ptr<int64_t>(), banned.data_ptr<int64_t>() + banned.numel());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  std::vector<Span> spans;  // the allowed ids: [0, V) between the banned ones
  int64_t start = 0;
  for (int64_t b : ids) {
    TORCH_CHECK(b >= 0 && b < V, "clover_cpu::greedy_pick: banned id ", b, " is outside the vocabulary");
    if (b > start) spans.push_back({start, b});
    start = b + 1;
  }
  if (start < V) spans.push_back({start, V});

  auto lead = logits.sizes().vec();
  lead.pop_back();
  at::Tensor tokens = at::empty(lead, logits.options().dtype(at::kLong));
  at::Tensor probs = at::empty(lead, logits.options());
  const int64_t rows = tokens.numel();
  const float* X = x.data_ptr<float>();
  int64_t* T = tokens.data_ptr<int64_t>();
  float* P = probs.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = X + r * V;
      float m = -std::numeric_limits<float>::infinity();
      for (const Span& s : spans) m = span_max(row, s, m);
      int64_t token = spans.empty() ? 0 : spans.front().begin;  // every allowed logit -inf: the first allowed id
      for (const Span& s : spans) {
        const int64_t i = span_find(row, s, m);
        if (i >= 0) {
          token = i;
          break;
        }
      }
      float sum = 0.0f;
      for (const Span& s : spans) sum += span_exp_sum(row, s, m);
      T[r] = token;
      P[r] = spans.empty() || std::isinf(m) ? std::numeric_limits<float>::quiet_NaN() : 1.0f / sum;
    }
  });
  return {tokens, probs};
}

}  // namespace

CLOVER_CPU_OP(greedy_pick, "(Tensor logits, Tensor banned) -> (Tensor, Tensor)")
