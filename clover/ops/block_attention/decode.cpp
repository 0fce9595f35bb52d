// Masked softmax attention for a decode step's few query rows over a cache (sdpa.py's contract,
// naive.py the reference): q [B, Hq, Lq, D]; k [B, Hkv, S, D], v [B, Hkv, S, Dv] (any strides but a
// unit last one: the cache's own storage, never copied); mask bool [B, 1 or Hq, Lq, S]; out
// [B, Hq, Lq, Dv] fp32. Only the keys a row's mask allows are read (a cache's tail past its length
// costs nothing), and the Hq / Hkv query heads sharing a K/V head take each key and value row in
// turn while it is in L1. A row whose mask allows no key gets zeros (as torch's CPU kernels).
//
// Per (row, query, head): scores s_t = scale * q . k_t in 16 partial sums (fixed order), m = max s,
// p_t = exp(s_t - m), out = (sum_t p_t v_t) / (sum_t p_t), the sums in key order. The (row, K/V
// head) pairs run on several threads where the call is large enough (ops/linear/parallel.h), each
// pair whole on one thread: the same numbers whatever the split. Bound into the extension that
// ops/linear/tiled.py builds; compiled CPU graphs call it (block_attention.masked_attention).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../linear/parallel.h"

namespace {

constexpr int kLanes = 16;

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) part[l] += a[i] * b[i];
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

struct Views {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t Hq, Hkv, Lq, S, D, Dv, mask_heads;
  int64_t ks[3], vs[3];  // k's and v's strides of dims 0-2
};

// One query row i of the heads [h0, h0 + n) that share K/V head kvh and, with a one-head mask, the
// allowed keys: scores, softmax, values; `keys`, `p`, `acc` scratch.
void rows(const Views& w, int64_t b, int64_t kvh, int64_t h0, int64_t n, int64_t i, float scale,
          std::vector<int64_t>& keys, std::vector<float>& p, std::vector<float>& acc) {
  const bool* m = w.mask + ((b * w.mask_heads + (w.mask_heads > 1 ? h0 : 0)) * w.Lq + i) * w.S;
  keys.clear();
  for (int64_t t = 0; t < w.S; ++t)
    if (m[t]) keys.push_back(t);
  const int64_t T = static_cast<int64_t>(keys.size());
  const float* kb = w.k + b * w.ks[0] + kvh * w.ks[1];
  const float* vb = w.v + b * w.vs[0] + kvh * w.vs[1];
  p.resize(n * T), acc.assign(n * w.Dv, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* kt = kb + keys[t] * w.ks[2];
    for (int64_t h = 0; h < n; ++h) p[h * T + t] = scale * dot(w.q + ((b * w.Hq + h0 + h) * w.Lq + i) * w.D, kt, w.D);
  }
  std::vector<float> total(n, 0.f);
  for (int64_t h = 0; h < n; ++h) {
    float* ph = p.data() + h * T;
    const float top = T ? *std::max_element(ph, ph + T) : 0.f;
    for (int64_t t = 0; t < T; ++t) ph[t] = std::exp(ph[t] - top), total[h] += ph[t];
  }
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict__ vt = vb + keys[t] * w.vs[2];
    for (int64_t h = 0; h < n; ++h) {
      const float pt = p[h * T + t];
      float* __restrict__ a = acc.data() + h * w.Dv;
      for (int64_t j = 0; j < w.Dv; ++j) a[j] += pt * vt[j];
    }
  }
  for (int64_t h = 0; h < n; ++h) {
    const float inv = T ? 1.f / total[h] : 0.f;
    float* o = w.out + ((b * w.Hq + h0 + h) * w.Lq + i) * w.Dv;
    for (int64_t j = 0; j < w.Dv; ++j) o[j] = acc[h * w.Dv + j] * inv;
  }
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                            double scale) {
  const char* op = "clover_cpu::decode_attention";
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, op, ": bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  mask.scalar_type() == at::kBool, op, ": fp32 q, k, v and a bool mask only");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == S && k.size(3) == D &&
                  Hkv > 0 && Hq % Hkv == 0 && mask.size(0) == B && (mask.size(1) == 1 || mask.size(1) == Hq) &&
                  mask.size(2) == Lq && mask.size(3) == S, op, ": shapes disagree");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, op, ": k and v need a unit last stride");
  const at::Tensor qc = q.contiguous(), mc = mask.contiguous();
  const int64_t Dv = v.size(3);
  at::Tensor out = at::empty({B, Hq, Lq, Dv}, q.options());
  const Views w{qc.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), mc.data_ptr<bool>(), out.data_ptr<float>(),
                Hq, Hkv, Lq, S, D, Dv, mask.size(1), {k.stride(0), k.stride(1), k.stride(2)},
                {v.stride(0), v.stride(1), v.stride(2)}};
  const int64_t group = Hq / Hkv, per = w.mask_heads > 1 ? 1 : group;  // heads sharing one key list
  clover_parallel::split(B * Hkv, group * Lq * S * (D + Dv), [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> keys;
    std::vector<float> p, acc;
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t i = 0; i < Lq; ++i)
        for (int64_t h = 0; h < group; h += per)
          rows(w, u / Hkv, u % Hkv, (u % Hkv) * group + h, per, i, static_cast<float>(scale), keys, p, acc);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clover_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(clover_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
