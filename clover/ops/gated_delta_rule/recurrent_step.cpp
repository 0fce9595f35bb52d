// One decode step of the gated delta rule, the recurrent state updated in place (fused_recurrent.py
// is the spec): per (row, head), with a = exp(g) and S the [Dk, Dv] state,
//   u = beta (v - a S^T k),  S <- a S + k u^T,  o = scale S^T q.
// q, k [B, 1, H, Dk]; v [B, 1, H, Dv]; g, beta [B, 1, H]; state [B, H, Dk, Dv]; fp32 CPU, state
// contiguous. Two passes over each head's state (the second reads what the first left in L2): the
// state's bytes cross memory once each way, where a compiled graph of the spec's tensor ops sweeps
// the whole state several times and copies it into the cache after. Bound into the extension that
// ops/linear/tiled.py builds; compiled CPU graphs call it (ops.gated_delta_rule.step_into). The
// (row, head) slices run on several threads where the call is large enough (ops/linear/parallel.h),
// each slice whole on one thread: the same numbers whatever the split. With AVX-512 and Dv a multiple
// of 16 up to 128, a slice keeps u, o and the row being updated in registers (step_slice_vec).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "../linear/parallel.h"
#include "../linear/define_op.h"

namespace {

// One (row, head) slice: s [Dk, Dv] updated in place, its output (times scale) to ob; u, o scratch of Dv.
inline void step_slice(float* __restrict__ s, const float* __restrict__ qq, const float* __restrict__ kk,
                       const float* __restrict__ vv, float a, float bt, float scale, int64_t Dk, int64_t Dv,
                       float* __restrict__ uu, float* __restrict__ oo, float* __restrict__ ob) {
  for (int64_t j = 0; j < Dv; ++j) uu[j] = 0.f;
  for (int64_t i = 0; i < Dk; ++i) {  // uu = S^T k
    const float ki = kk[i];
    const float* __restrict__ row = s + i * Dv;
    for (int64_t j = 0; j < Dv; ++j) uu[j] += row[j] * ki;
  }
  for (int64_t j = 0; j < Dv; ++j) {
    uu[j] = (vv[j] - a * uu[j]) * bt;
    oo[j] = 0.f;
  }
  for (int64_t i = 0; i < Dk; ++i) {  // S <- a S + k u^T, o += S^T q
    const float ki = kk[i], qi = qq[i];
    float* __restrict__ row = s + i * Dv;
    for (int64_t j = 0; j < Dv; ++j) {
      const float x = a * row[j] + ki * uu[j];
      row[j] = x;
      oo[j] += x * qi;
    }
  }
  for (int64_t j = 0; j < Dv; ++j) ob[j] = oo[j] * scale;
}

#if defined(__AVX512F__)
// step_slice for Dv = 16 NV (NV <= 8): u, o and the row in registers, the state's only store its own update.
template <int NV>
void step_slice_vec(float* __restrict__ s, const float* __restrict__ qq, const float* __restrict__ kk,
                    const float* __restrict__ vv, float a, float bt, float scale, int64_t Dk, float* __restrict__ ob) {
  __m512 u[NV], o[NV];
  for (int j = 0; j < NV; ++j) u[j] = _mm512_setzero_ps(), o[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < Dk; ++i) {  // u = S^T k
    const __m512 ki = _mm512_set1_ps(kk[i]);
    for (int j = 0; j < NV; ++j) u[j] = _mm512_fmadd_ps(_mm512_loadu_ps(s + i * 16 * NV + 16 * j), ki, u[j]);
  }
  const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(bt);
  for (int j = 0; j < NV; ++j) u[j] = _mm512_mul_ps(_mm512_fnmadd_ps(va, u[j], _mm512_loadu_ps(vv + 16 * j)), vb);
  for (int64_t i = 0; i < Dk; ++i) {  // S <- a S + k u^T, o += S^T q
    const __m512 ki = _mm512_set1_ps(kk[i]), qi = _mm512_set1_ps(qq[i]);
    float* row = s + i * 16 * NV;
    for (int j = 0; j < NV; ++j) {
      const __m512 x = _mm512_fmadd_ps(ki, u[j], _mm512_mul_ps(va, _mm512_loadu_ps(row + 16 * j)));
      _mm512_storeu_ps(row + 16 * j, x);
      o[j] = _mm512_fmadd_ps(x, qi, o[j]);
    }
  }
  for (int j = 0; j < NV; ++j) _mm512_storeu_ps(ob + 16 * j, _mm512_mul_ps(o[j], _mm512_set1_ps(scale)));
}

using SliceFn = void (*)(float*, const float*, const float*, const float*, float, float, float, int64_t, float*);

// The register version for this Dv, or nullptr.
SliceFn vector_slice(int64_t Dv) {
  static constexpr SliceFn fns[] = {step_slice_vec<1>, step_slice_vec<2>, step_slice_vec<3>, step_slice_vec<4>,
                                    step_slice_vec<5>, step_slice_vec<6>, step_slice_vec<7>, step_slice_vec<8>};
  return Dv % 16 == 0 && Dv >= 16 && Dv <= 128 ? fns[Dv / 16 - 1] : nullptr;
}
#else
using SliceFn = void (*)(float*, const float*, const float*, const float*, float, float, float, int64_t, float*);
SliceFn vector_slice(int64_t) { return nullptr; }
#endif

at::Tensor recurrent_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                           const at::Tensor& beta, double scale, at::Tensor& state) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && g.dim() == 3 && beta.dim() == 3 && state.dim() == 4,
              "clover_cpu::recurrent_step_: bad ranks");
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta, static_cast<const at::Tensor*>(&state)})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "clover_cpu::recurrent_step_: fp32 only");
  TORCH_CHECK(state.is_contiguous(), "clover_cpu::recurrent_step_: the state must be contiguous");
  const int64_t B = state.size(0), H = state.size(1), Dk = state.size(2), Dv = state.size(3);
  TORCH_CHECK(q.size(0) == B && q.size(1) == 1 && q.size(2) == H && q.size(3) == Dk && k.sizes() == q.sizes() &&
                  v.size(0) == B && v.size(1) == 1 && v.size(2) == H && v.size(3) == Dv &&
                  g.size(0) == B && g.size(1) == 1 && g.size(2) == H && beta.sizes() == g.sizes(),
              "clover_cpu::recurrent_step_: shapes disagree");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous(),
                   bc = beta.contiguous();
  at::Tensor out = at::empty({B, 1, H, Dv}, v.options());
  const float *Q = qc.data_ptr<float>(), *K = kc.data_ptr<float>(), *V = vc.data_ptr<float>();
  const float *G = gc.data_ptr<float>(), *Beta = bc.data_ptr<float>();
  float* S = state.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const SliceFn vec = vector_slice(Dv);
  const auto slices = [&](int64_t bh0, int64_t bh1) {
    std::vector<float> u(Dv), o(Dv);
    for (int64_t bh = bh0; bh < bh1; ++bh) {
      const float a = std::exp(G[bh]), sc = static_cast<float>(scale);
      if (vec)
        vec(S + bh * Dk * Dv, Q + bh * Dk, K + bh * Dk, V + bh * Dv, a, Beta[bh], sc, Dk, O + bh * Dv);
      else
        step_slice(S + bh * Dk * Dv, Q + bh * Dk, K + bh * Dk, V + bh * Dv, a, Beta[bh], sc, Dk, Dv, u.data(), o.data(), O + bh * Dv);
    }
  };
  clover_parallel::split(B * H, 2 * Dk * Dv, slices);
  return out;
}

}  // namespace

CLOVER_CPU_OP(recurrent_step_, "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor(a!) state) -> Tensor")
