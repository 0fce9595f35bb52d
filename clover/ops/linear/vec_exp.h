// exp of 16 fp32 lanes (AVX-512), shared by the CPU kernels that need one: the routed experts'
// SwiGLU (routed_experts.h) and the decode attention's softmax (ops/block_attention/decode.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace clover_vec {

// exp(x): Cephes' expf polynomial on x - n ln2 (ln2 in two parts), scaled by 2^n (scalef: inf past
// fp32's range); within 2 ulp of std::exp. x below -88 counts as -88 (so -inf, a masked score,
// gives a tiny positive number, never nan).
inline __m512 exp_vec(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace clover_vec
#endif
