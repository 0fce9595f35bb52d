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
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../linear/parallel.h"
#include "../linear/define_op.h"
#include "../linear/vec_exp.h"

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

#if defined(__AVX512F__)
// n a multiple of 16: two chains of 16 lanes, then the lanes summed.
inline float dot_vec(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
  }
  if (i < n) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

using clover_vec::exp_vec;  // ../linear/vec_exp.h

// p[t] = exp(p[t] - top) for t < T, 16 at a time; returns their sum.
inline float exp_row(float* p, int64_t T, float top) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 m = _mm512_set1_ps(top);
  for (int64_t t = 0; t < T; t += 16) {
    const __mmask16 k = T - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (T - t)) - 1);
    const __m512 e = exp_vec(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + t), m));
    _mm512_mask_storeu_ps(p + t, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(sum);
}

// out[h] = inv[h] * sum_t p[h T + t] v_{keys[t]} for NH heads, Dv a multiple of 64: 64 columns at a
// time, every head's sums in registers while the key rows pass.
template <int NH>
void weighted_values(const float* p, int64_t T, const int64_t* keys, const float* vb, int64_t vs, int64_t Dv,
                     const float* inv, float* out, int64_t ho) {
  for (int64_t c = 0; c < Dv; c += 64) {
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h)
      for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < T; ++t) {
      const float* vt = vb + keys[t] * vs + c;
      __m512 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm512_loadu_ps(vt + 16 * j);
      for (int h = 0; h < NH; ++h) {
        const __m512 pt = _mm512_set1_ps(p[h * T + t]);
        for (int j = 0; j < 4; ++j) acc[h][j] = _mm512_fmadd_ps(pt, v[j], acc[h][j]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + h * ho + c + 16 * j, _mm512_mul_ps(acc[h][j], _mm512_set1_ps(inv[h])));
  }
}
#endif

struct Views {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t Hq, Hkv, Lq, S, D, Dv, mask_heads;
  int64_t ks[3], vs[3];  // k's and v's strides of dims 0-2
};

// One query row i of the heads [h0, h0 + n) that share K/V head kvh and, with a one-head mask, the
// allowed keys: scores, softmax, values; `keys`, `p`, `acc` scratch. With AVX-512, D a multiple of 16
// and Dv of 64: the dot products and exp on 16 lanes, the weighted values in registers (weighted_values).
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
#if defined(__AVX512F__)
  const bool vec = w.D % 16 == 0 && w.Dv % 64 == 0;
#else
  const bool vec = false;
#endif
  for (int64_t t = 0; t < T; ++t) {
    const float* kt = kb + keys[t] * w.ks[2];
    for (int64_t h = 0; h < n; ++h) {
      const float* qh = w.q + ((b * w.Hq + h0 + h) * w.Lq + i) * w.D;
#if defined(__AVX512F__)
      p[h * T + t] = scale * (vec ? dot_vec(qh, kt, w.D) : dot(qh, kt, w.D));
#else
      p[h * T + t] = scale * dot(qh, kt, w.D);
#endif
    }
  }
  std::vector<float> total(n, 0.f);
  for (int64_t h = 0; h < n; ++h) {
    float* ph = p.data() + h * T;
    const float top = T ? *std::max_element(ph, ph + T) : 0.f;
#if defined(__AVX512F__)
    if (vec) {
      total[h] = exp_row(ph, T, top);
      continue;
    }
#endif
    for (int64_t t = 0; t < T; ++t) ph[t] = std::exp(ph[t] - top), total[h] += ph[t];
  }
  for (int64_t h = 0; h < n; ++h) total[h] = T ? 1.f / total[h] : 0.f;
  float* o0 = w.out + ((b * w.Hq + h0) * w.Lq + i) * w.Dv;
#if defined(__AVX512F__)
  if (vec) {
    for (int64_t h = 0; h < n; h += 4) {
      const auto run = [&](auto nh) {
        weighted_values<decltype(nh)::value>(p.data() + h * T, T, keys.data(), vb, w.vs[2], w.Dv, total.data() + h,
                                             o0 + h * w.Lq * w.Dv, w.Lq * w.Dv);
      };
      const int64_t left = std::min<int64_t>(4, n - h);
      left == 4 ? run(std::integral_constant<int, 4>{}) : left == 3 ? run(std::integral_constant<int, 3>{})
          : left == 2 ? run(std::integral_constant<int, 2>{}) : run(std::integral_constant<int, 1>{});
    }
    return;
  }
#endif
  for (int64_t t = 0; t < T; ++t) {
    const float* __restrict__ vt = vb + keys[t] * w.vs[2];
    for (int64_t h = 0; h < n; ++h) {
      const float pt = p[h * T + t];
      float* __restrict__ a = acc.data() + h * w.Dv;
      for (int64_t j = 0; j < w.Dv; ++j) a[j] += pt * vt[j];
    }
  }
  for (int64_t h = 0; h < n; ++h)
    for (int64_t j = 0; j < w.Dv; ++j) o0[h * w.Lq * w.Dv + j] = acc[h * w.Dv + j] * total[h];
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

CLOVER_CPU_OP(decode_attention, "(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor")
