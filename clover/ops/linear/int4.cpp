// int4 y = x @ W^T for the few rows of a decode step (quant/int4.py's group-wise asymmetric format),
// fp32 activations. See int4_linear.py.
//
// Layout (built once from the stored format by int4_linear.pack, never stored):
// * `panels` uint8 [P, K/2, 16]: panels of 16 output columns; byte [p, i, j] holds W's codes
//   q[16 p + j, 2 i] (low nibble) and q[16 p + j, 2 i + 1] (high nibble); columns past N are code 0.
// * `sz` fp32 [P, G, 2, 16]: per group of g input columns and output column, the scale s and -z * s
//   (z the integer zero point); columns past N are 0, so they compute 0.
//
// Each k's 16 weights are dequantised in registers as fma(q, s, -z s) = (q - z) * s: exact in fp32
// ((q - z) is an integer of at most 4 bits, s a bf16), so the weight is the reference's dequantised
// weight bit for bit, and every output is one fp32 FMA chain over k in order, whatever the tile shape
// or the rows a call holds: the numbers of the fp32 reference F.linear up to summation order.
// Tiles of R rows x P panels keep R*P accumulators; the dequantised panel vectors are shared by the
// tile's rows. AVX-512 (16 lanes), AVX2 + FMA (a panel as two 8-lane halves), else plain C++.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "int4_ops.h"
#include "parallel.h"
#include "row_tiles.h"

namespace {

constexpr int64_t kPanel = 16;

#if defined(__AVX512F__)
using clover_tiles::store_tile;

// R rows x P panels over k in [0, K): panel p's bytes at w + p * (K/2) * 16, its (s, -zs) at sz + p * G * 32.
template <int R, int P>
__attribute__((noinline)) void tile(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w,
                                    const float* __restrict sz, int64_t K, int64_t g, float* y, int64_t ldy,
                                    int64_t n0, int64_t N) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  const int64_t G = K / g, half = K / 2 * kPanel;
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t gi = 0; gi < G; ++gi) {
    __m512 s[P], z[P];
    for (int p = 0; p < P; ++p) {
      s[p] = _mm512_loadu_ps(sz + (p * G + gi) * 2 * kPanel);
      z[p] = _mm512_loadu_ps(sz + (p * G + gi) * 2 * kPanel + kPanel);
    }
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 2) {
      __m512 we[P], wo[P];
      for (int p = 0; p < P; ++p) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * half + k / 2 * kPanel)));
        we[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s[p], z[p]);
        wo[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s[p], z[p]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xe = _mm512_set1_ps(x[r * ldx + k]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xe, we[p], acc[r][p]);
        const __m512 xo = _mm512_set1_ps(x[r * ldx + k + 1]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xo, wo[p], acc[r][p]);
      }
    }
  }
  store_tile<R, P>(acc, y, ldy, n0, N);
}
constexpr int kMaxRows = 8;  // 8 x 2 accumulators + 2 x 4 dequantised / scale vectors of the 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
// The same tile on 8-lane halves: R x P x 2 accumulators (R * P * 2 <= 8 of the 16 registers).
template <int R, int P>
__attribute__((noinline)) void tile(const float* __restrict x, int64_t ldx, const uint8_t* __restrict w,
                                    const float* __restrict sz, int64_t K, int64_t g, float* y, int64_t ldy,
                                    int64_t n0, int64_t N) {
  __m256 acc[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  const int64_t G = K / g, half = K / 2 * kPanel;
  const __m256i low = _mm256_set1_epi32(0x0F);
  for (int64_t gi = 0; gi < G; ++gi) {
    for (int h = 0; h < 2; ++h) {  // each half in turn: both at once would spill
      __m256 s[P], z[P];
      for (int p = 0; p < P; ++p) {
        s[p] = _mm256_loadu_ps(sz + (p * G + gi) * 2 * kPanel + 8 * h);
        z[p] = _mm256_loadu_ps(sz + (p * G + gi) * 2 * kPanel + kPanel + 8 * h);
      }
      for (int64_t k = gi * g; k < (gi + 1) * g; k += 2) {
        for (int p = 0; p < P; ++p) {
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + p * half + k / 2 * kPanel + 8 * h)));
          const __m256 we = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), s[p], z[p]);
          const __m256 wo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), s[p], z[p]);
          for (int r = 0; r < R; ++r) {
            acc[r][p][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k), we, acc[r][p][h]);
            acc[r][p][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k + 1), wo, acc[r][p][h]);
          }
        }
      }
    }
  }
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + p * kPanel + 8 * h;
      if (n >= N) return;
      const int64_t left = N - n;
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * ldy + n, m, acc[r][p][h]);
    }
}
constexpr int kMaxRows = 4;
#else
template <int R, int P>
void tile(const float* x, int64_t ldx, const uint8_t* w, const float* sz, int64_t K, int64_t g, float* y,
          int64_t ldy, int64_t n0, int64_t N) {
  float acc[R][P][kPanel] = {};
  const int64_t G = K / g, half = K / 2 * kPanel;
  for (int64_t k = 0; k < K; ++k)
    for (int p = 0; p < P; ++p) {
      const float* s = sz + (p * G + k / g) * 2 * kPanel;
      for (int j = 0; j < kPanel; ++j) {
        const uint8_t b = w[p * half + k / 2 * kPanel + j];
        const float wv = std::fma(static_cast<float>(k & 1 ? b >> 4 : b & 0x0F), s[j], s[kPanel + j]);
        for (int r = 0; r < R; ++r) acc[r][p][j] = std::fma(x[r * ldx + k], wv, acc[r][p][j]);
      }
    }
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < kPanel; ++j) {
      const int64_t n = n0 + p * kPanel + j;
      if (n >= N) break;
      for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r][p][j];
    }
}
constexpr int kMaxRows = 4;
#endif

using clover_tiles::Int;
using clover_tiles::row_tiles;

#if defined(__AVX512F__)
// From kBufferRows rows, each panel pair is dequantised once into an fp32 buffer (the same exact
// values) and every row tile runs plain fp32 FMAs on it: dequantising in every row tile costs more
// than the buffer's stores and loads once the rows are many. Same FMA chains, same results.
constexpr int64_t kBufferRows = 16;

// Panels [0, P) of the panel group at w / sz -> buf [P, K, 16] fp32.
void dequantise(const uint8_t* w, const float* sz, int64_t K, int64_t g, int64_t P, float* buf) {
  const int64_t G = K / g, half = K / 2 * kPanel;
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t gi = 0; gi < G; ++gi) {
      const __m512 s = _mm512_loadu_ps(sz + (p * G + gi) * 2 * kPanel), z = _mm512_loadu_ps(sz + (p * G + gi) * 2 * kPanel + kPanel);
      for (int64_t k = gi * g; k < (gi + 1) * g; k += 2) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * half + k / 2 * kPanel)));
        _mm512_storeu_ps(buf + (p * K + k) * kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), s, z));
        _mm512_storeu_ps(buf + (p * K + k + 1) * kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s, z));
      }
    }
}

// R rows x P panels of fp32 panels buf [P, K, 16]: acc = fma(x[r, k], w[k], acc) in k order, as `tile`.
template <int R, int P>
__attribute__((noinline)) void ftile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
                                     float* y, int64_t ldy, int64_t n0, int64_t N) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[P];
    for (int p = 0; p < P; ++p) wv[p] = _mm512_loadu_ps(w + (p * K + k) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
    }
  }
  store_tile<R, P>(acc, y, ldy, n0, N);
}

void buffered_panels(const float* x, int64_t M, int64_t K, int64_t g, const uint8_t* w, const float* sz, float* y,
                     int64_t N, int64_t p0, int64_t p1) {
  const int64_t half = K / 2 * kPanel, zs = K / g * 2 * kPanel;
  thread_local std::vector<float> buf;
  buf.resize(2 * K * kPanel);
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    dequantise(w + p * half, sz + p * zs, K, g, two ? 2 : 1, buf.data());
    row_tiles<8>(M, [&](auto r, int64_t m) {
      constexpr int R = decltype(r)::value;
      if (two)
        ftile<R, 2>(x + m * K, K, buf.data(), K, y + m * N, N, p * kPanel, N);
      else
        ftile<R, 1>(x + m * K, K, buf.data(), K, y + m * N, N, p * kPanel, N);
    });
  }
}
#endif

// Panels [p0, p1) for every row: one row takes 4 panels a tile (4 independent FMA chains), more rows
// 2 (AVX-512) or 1 (AVX2, plain), from kBufferRows rows the buffered tiles above; the panel group
// stays in L1 while every row tile passes it.
void panels(const float* x, int64_t M, int64_t K, int64_t g, const uint8_t* w, const float* sz, float* y,
            int64_t N, int64_t p0, int64_t p1) {
  const int64_t half = K / 2 * kPanel, zs = K / g * 2 * kPanel;
  const auto over = [&](auto np) {
    constexpr int kP = decltype(np)::value;
    const auto run = [&](auto pn, int64_t p) {
      row_tiles<kMaxRows>(M, [&](auto r, int64_t m) {
        tile<decltype(r)::value, decltype(pn)::value>(x + m * K, K, w + p * half, sz + p * zs, K, g, y + m * N, N,
                                                      p * kPanel, N);
      });
    };
    int64_t p = p0;
    for (; p + kP <= p1; p += kP) run(np, p);
    for (; p < p1; ++p) run(Int<1>{}, p);
  };
  if (M == 1) return over(Int<4>{});
#if defined(__AVX512F__)
  if (M >= kBufferRows) return buffered_panels(x, M, K, g, w, sz, y, N, p0, p1);
  over(Int<2>{});
#else
  over(Int<1>{});
#endif
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size,
                       int64_t n) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == kPanel,
              "clover_cpu::int4_linear: packed must be uint8 [ceil(n / 16), K / 2, 16]");
  const int64_t K = x.size(-1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K && P * kPanel >= n, "clover_cpu::int4_linear: x has ", K,
              " features, the weight ", packed.size(1) * 2);
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0,
              "clover_cpu::int4_linear: the group size must be even and divide K");
  TORCH_CHECK(sz.scalar_type() == at::kFloat && sz.dim() == 4 && sz.size(0) == P && sz.size(1) == K / group_size &&
                  sz.size(2) == 2 && sz.size(3) == kPanel,
              "clover_cpu::int4_linear: sz must be fp32 [ceil(n / 16), K / group_size, 2, 16]");
  const at::Tensor xf = x.scalar_type() == at::kFloat ? (x.is_contiguous() ? x : x.contiguous()) : x.to(at::kFloat).contiguous();
  const at::Tensor w = packed.contiguous(), s = sz.contiguous();
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  auto y = at::empty(sizes, xf.options());
  if (M > 0 && n > 0) {
    const float* xp = xf.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* sp = s.data_ptr<float>();
    const int64_t np = (n + kPanel - 1) / kPanel, groups = (np + 1) / 2;  // panel pairs: a thread's unit
    clover_parallel::split(groups, M * K * 2 * kPanel, [&](int64_t g0, int64_t g1) {
      panels(xp, M, K, group_size, wp, sp, yp, n, 2 * g0, std::min<int64_t>(2 * g1, np));
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Routed SwiGLU experts on int4 stacks (gate_up [E, 2I, H] rows [gate ; up], down [E, H, I], each
// in the layout above with a leading expert dim) for the top-k choices of every token
// (routed_experts.h), each projection through `panels` (one thread), as tiled.cpp's fp32 `experts`.
at::Tensor int4_experts(const at::Tensor& x, const at::Tensor& top_idx, const at::Tensor& top_w, const at::Tensor& gate_up,
                        const at::Tensor& gate_up_sz, const at::Tensor& down, const at::Tensor& down_sz, int64_t group_size,
                        int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && top_idx.dim() == 2 && gate_up.dim() == 4 && down.dim() == 4 && gate_up_sz.dim() == 5 &&
                  down_sz.dim() == 5, "clover_cpu::int4_experts: bad ranks");
  TORCH_CHECK(gate_up.scalar_type() == at::kByte && down.scalar_type() == at::kByte && gate_up_sz.scalar_type() == at::kFloat &&
                  down_sz.scalar_type() == at::kFloat, "clover_cpu::int4_experts: uint8 panels, fp32 sz");
  const int64_t H = x.size(1), E = gate_up.size(0), I = inter, I2 = 2 * inter;
  TORCH_CHECK(gate_up.size(2) * 2 == H && down.size(2) * 2 == I && down.size(0) == E && H % group_size == 0 &&
                  I % group_size == 0 && gate_up.size(1) * kPanel >= I2 && down.size(1) * kPanel >= H,
              "clover_cpu::int4_experts: shapes disagree");
  return clover_int4::experts("clover_cpu::int4_experts", x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, inter,
                              [&](const float* in, int64_t rows, int64_t K, const uint8_t* w, const float* sz, float* out,
                                  int64_t N, int64_t np) { panels(in, rows, K, group_size, w, sz, out, N, 0, np); });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clover_cpu, m) { clover_int4::define_ops(m, "int4"); }

TORCH_LIBRARY_IMPL(clover_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_experts", &int4_experts);
}
