// int4 weights x int8 activations: y = x @ W^T for quant/int4.py's group-wise asymmetric format, the
// activations quantised per row and block of 32 to int8 (as llama.cpp's q8_0). See int4_q8.py.
//
// Layout (built once from the stored format by int4_q8.pack, never stored):
// * `packed` uint8 [P, K/8, 16, 4]: panels of 16 output columns; byte [p, c, j, t] holds W's codes
//   q[16 p + j, 8 c + t] (low nibble) and q[16 p + j, 8 c + 4 + t] (high nibble); columns past N are 0.
//   The low nibbles of a chunk's 64 bytes are, per column, its 4 codes k = 8c..8c+3 in one 32-bit
//   lane; the high nibbles the next 4: one u8 x s8 4-way dot product each (VNNI vpdpbusd, or AVX2's
//   maddubs + madd).
// * `sz` fp32 [P, G, 2, 16]: per group and column (s, -z * s), as int4.cpp; 0 past N.
//
// Activations: per row and block of 32 columns, d = max|x| / 127 and a = round(x * (1 / d)) (nearest
// even; a = 0 where d = 0), so x ~ d * a. Per group of g columns and output column:
//   y += s * sum_b d_b * (sum_{k in b} q_k a_k) + (-z s) * sum_b d_b * (sum_{k in b} a_k)
// = sum_k W_k * (d a)_k exactly in real numbers: the zero-point term takes the quantised activations'
// sums, so the result is F.linear(dequantised activations, dequantised weight) up to fp32 rounding
// (naive.naive_int4_q8_linear). The integer dot products are exact; each block's sum is converted
// and scaled once (one rounding), the blocks and groups summed in order in fp32. A row's result does
// not depend on the rows it shares a call with.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "int4_ops.h"
#include "parallel.h"
#include "row_tiles.h"

namespace {

using clover_tiles::Int;
using clover_tiles::row_tiles;

constexpr int64_t kPanel = 16, kBlock = 32, kChunk = 8;

// The rows below which a call's time is its codes' reading, not its multiply-adds: `split` counts a
// call of fewer rows as this many, so that a one-row product over a few hundred KiB of codes, which a
// second thread reads at once beside the first, is split (bench/step_ab.py --rows 1 --threads 2).
constexpr int64_t kStreamRows = 12;

// Quantised activations of M rows of K columns: a int8 [M, K], d [M, K/32], zsum [M, K/g] (per group,
// sum over its blocks in order of d_b * sum(a over b)).
struct Acts {
  std::vector<int8_t> a;
  std::vector<float> d, zsum;
  int64_t K = 0, g = 0;
};

// One block of 32: a = round(x * (1 / d)) (nearest even: the default rounding mode), clamped to +-127;
// returns sum(a). d = max|x| / 127. The vector versions compute the scalar one's numbers (finite x) exactly.
inline int quantise_block(const float* xb, float& d, int8_t* a) {
#if defined(__AVX512F__)
  const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  d = amax / 127.f;
  const __m512 inv = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i q0 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv))));
  const __m512i q1 = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv))));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(a + 16), _mm512_cvtepi32_epi8(q1));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#elif defined(__AVX2__)
  __m256 v[4], m = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  d = _mm_cvtss_f32(h) / 127.f;
  const __m256 inv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i q[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_min_epi32(hi, _mm256_max_epi32(lo, _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv))));
    sum = _mm256_add_epi32(sum, q[i]);
  }
  // int32 -> int8 (in range: no saturation); the packs work per 128-bit lane, the permute restores the order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(a),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
#else
  float amax = 0.f;
  for (int t = 0; t < kBlock; ++t) amax = std::max(amax, std::fabs(xb[t]));
  d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int t = 0; t < kBlock; ++t) {
    const float v = std::min(127.f, std::max(-127.f, std::nearbyint(xb[t] * inv)));
    a[t] = static_cast<int8_t>(v);
    sum += static_cast<int>(v);
  }
  return sum;
#endif
}

void quantise(const float* x, int64_t M, int64_t K, int64_t g, Acts& q) {
  const int64_t nb = K / kBlock, G = K / g, per = g / kBlock;
  q.K = K, q.g = g;
  q.a.resize(M * K), q.d.resize(M * nb), q.zsum.resize(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t gi = 0; gi < G; ++gi) {
      float zs = 0.f;
      for (int64_t b = gi * per; b < (gi + 1) * per; ++b) {
        float& d = q.d[m * nb + b];
        const int sum = quantise_block(x + m * K + b * kBlock, d, q.a.data() + m * K + b * kBlock);
        zs += d * static_cast<float>(sum);
      }
      q.zsum[m * G + gi] = zs;
    }
}

inline int32_t four(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return v;
}

// The vector operations the tile below needs, stamped for a width: X the intrinsics' prefix (_mm512_,
// _mm256_), SI their integer vectors' suffix (si512, si256); F and I the float and integer vector types.
#define CLOVER_VEC_OPS(X, SI)                                                                 \
  static F fzero() { return X##setzero_ps(); }                                                \
  static I izero() { return X##setzero_##SI(); }                                              \
  static I codes(const uint8_t* p) { return X##loadu_##SI(reinterpret_cast<const I*>(p)); }   \
  static I low(I v) { return X##and_##SI(v, X##set1_epi8(0x0F)); }                           \
  static I high(I v) { return X##and_##SI(X##srli_epi16(v, 4), X##set1_epi8(0x0F)); }         \
  static I four(const int8_t* a) { return X##set1_epi32(::four(a)); }                         \
  static F fma(F a, F b, F c) { return X##fmadd_ps(a, b, c); }                                \
  static F to_float(I v) { return X##cvtepi32_ps(v); }                                        \
  static F set1(float x) { return X##set1_ps(x); }                                            \
  static F load(const float* p) { return X##loadu_ps(p); }                                     \
  static void put(float* p, F v) { X##storeu_ps(p, v); }                                      \
  /* u8 x s8 4-way dot products added to acc without VNNI (a VNNI build's dot4 hides this one) */ \
  template <typename = void>                                                                  \
  static I dot4(I acc, I u, I s) { return X##add_epi32(acc, X##madd_epi16(X##maddubs_epi16(u, s), X##set1_epi16(1))); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 fp32 lanes: a panel of 16 columns at once.
struct Vec {
  using F = __m512;
  using I = __m512i;
  static constexpr int kHalves = 1, kLanes = 16;  // a panel in kHalves passes of kLanes columns
  static constexpr int kUnroll = 4;  // a block's chunks as straight code: no register copies between them
  CLOVER_VEC_OPS(_mm512_, si512)
#if defined(__AVX512VNNI__)
  static I dot4(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
#endif
  template <int R, int P>
  static constexpr auto store = clover_tiles::store_tile<R, P>;
};
constexpr int kMaxRows = 6, kPanels = 2, kOneRowPanels = 4;  // 2 x 6 x 2 sums + 2 x 2 code vectors of 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
// The same on 8 lanes: a panel in two halves, each in turn (both at once would spill the 16 registers).
struct Vec {
  using F = __m256;
  using I = __m256i;
  static constexpr int kHalves = 2, kLanes = 8;
  static constexpr int kUnroll = 1;  // a loop: unrolled, it ran slower on 16 registers (bench/linear.py)
  CLOVER_VEC_OPS(_mm256_, si256)
#if defined(__AVXVNNI__)
  static I dot4(I acc, I u, I s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif
  template <int R, int P>
  static void store(const F (&acc)[R][P], float* y, int64_t ldy, int64_t n0, int64_t N) {
    for (int p = 0; p < P; ++p) {
      const int64_t n = n0 + p * kPanel;
      if (n >= N) break;
      const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(N - n, 8))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * ldy + n, m, acc[r][p]);
    }
  }
};
constexpr int kMaxRows = 4, kPanels = 1, kOneRowPanels = 2;  // 2 x 4 sums + 2 code vectors of 16 registers
#endif

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
// R rows (activations from row m0 of q) x P panels (bytes at w, panel stride 8K; (s, -zs) at sz, stride
// G * 32): per group the blocks' integer dot products (exact), each scaled by its block's d, then by
// the group's s, plus -z s times the group's sum of rounded activations. Registers hold a block's
// integer sums and the group's scaled sums; the running totals over groups wait in `acc` (L1), read
// and written once a group, which leaves the registers to more rows sharing each unpacked code vector.
template <int R, int P>
__attribute__((noinline)) void tile(const Acts& q, int64_t m0, const uint8_t* __restrict w, const float* __restrict sz,
                                    float* y, int64_t ldy, int64_t n0, int64_t N) {
  using F = Vec::F;
  using I = Vec::I;
  constexpr int L = Vec::kLanes;
  const int64_t K = q.K, g = q.g, G = K / g, nb = K / kBlock, stride = K * kPanel / 2;
  const int8_t* a = q.a.data() + m0 * K;
  const float* d = q.d.data() + m0 * nb;
  const float* zsum = q.zsum.data() + m0 * G;
  alignas(64) float acc[R][P][L];
  for (int h = 0; h < Vec::kHalves; ++h) {
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) Vec::put(acc[r][p], Vec::fzero());
    for (int64_t gi = 0; gi < G; ++gi) {
      F fg[R][P];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < P; ++p) fg[r][p] = Vec::fzero();
      for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += kBlock) {
        I ia[R][P];
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < P; ++p) ia[r][p] = Vec::izero();
#pragma GCC unroll Vec::kUnroll
        for (int c = 0; c < kBlock / kChunk; ++c) {
          const int64_t k = k0 + c * kChunk;
          I lo[P], hi[P];
          for (int p = 0; p < P; ++p) {
            const I v = Vec::codes(w + p * stride + k * kPanel / 2 + 4 * L * h);
            lo[p] = Vec::low(v);
            hi[p] = Vec::high(v);
          }
          for (int r = 0; r < R; ++r) {
            const I x0 = Vec::four(a + r * K + k), x1 = Vec::four(a + r * K + k + 4);
            for (int p = 0; p < P; ++p) ia[r][p] = Vec::dot4(Vec::dot4(ia[r][p], lo[p], x0), hi[p], x1);
          }
        }
        for (int r = 0; r < R; ++r) {
          const F db = Vec::set1(d[r * nb + k0 / kBlock]);
          for (int p = 0; p < P; ++p) fg[r][p] = Vec::fma(Vec::to_float(ia[r][p]), db, fg[r][p]);
        }
      }
      for (int p = 0; p < P; ++p) {
        const float* at = sz + (p * G + gi) * 2 * kPanel + L * h;
        const F s = Vec::load(at), zs = Vec::load(at + kPanel);
        for (int r = 0; r < R; ++r)
          Vec::put(acc[r][p], Vec::fma(zs, Vec::set1(zsum[r * G + gi]), Vec::fma(fg[r][p], s, Vec::load(acc[r][p]))));
      }
    }
    F out[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) out[r][p] = Vec::load(acc[r][p]);
    Vec::store<R, P>(out, y, ldy, n0 + L * h, N);
  }
}
#else
template <int R, int P>
void tile(const Acts& q, int64_t m0, const uint8_t* w, const float* sz, float* y, int64_t ldy, int64_t n0, int64_t N) {
  const int64_t K = q.K, g = q.g, G = K / g, nb = K / kBlock, stride = K * kPanel / 2;
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int j = 0; j < kPanel && n0 + p * kPanel + j < N; ++j) {
        const int8_t* a = q.a.data() + (m0 + r) * K;
        float acc = 0.f;
        for (int64_t gi = 0; gi < G; ++gi) {
          float fg = 0.f;
          for (int64_t k0 = gi * g; k0 < (gi + 1) * g; k0 += kBlock) {
            int32_t ia = 0;
            for (int64_t k = k0; k < k0 + kBlock; ++k) {
              const uint8_t b = w[p * stride + k / kChunk * kChunk * kPanel / 2 + j * 4 + k % 4];
              ia += (k % kChunk < 4 ? b & 0x0F : b >> 4) * a[k];
            }
            fg = std::fma(static_cast<float>(ia), q.d[(m0 + r) * nb + k0 / kBlock], fg);
          }
          const float* at = sz + (p * G + gi) * 2 * kPanel + j;
          acc = std::fma(at[kPanel], q.zsum[(m0 + r) * G + gi], std::fma(fg, at[0], acc));
        }
        y[r * ldy + n0 + p * kPanel + j] = acc;
      }
}
constexpr int kMaxRows = 4, kPanels = 1, kOneRowPanels = 1;
#endif

// Panels [p0, p1) for every row of q: one row takes kOneRowPanels panels a tile (independent chains),
// more rows kPanels; the panel group stays in L1 while every row tile passes it.
void panels(const Acts& q, int64_t M, const uint8_t* w, const float* sz, float* y, int64_t N, int64_t p0, int64_t p1) {
  const int64_t stride = q.K * kPanel / 2, zs = q.K / q.g * 2 * kPanel;
  const auto over = [&](auto np) {
    const auto run = [&](auto pn, int64_t p) {
      row_tiles<kMaxRows>(M, [&](auto r, int64_t m) {
        tile<decltype(r)::value, decltype(pn)::value>(q, m, w + p * stride, sz + p * zs, y + m * N, N, p * kPanel, N);
      });
    };
    int64_t p = p0;
    for (; p + decltype(np)::value <= p1; p += decltype(np)::value) run(np, p);
    for (; p < p1; ++p) run(Int<1>{}, p);
  };
  if (M == 1) return over(Int<kOneRowPanels>{});
  over(Int<kPanels>{});
}

void check_layout(const char* op, const at::Tensor& packed, const at::Tensor& sz, int64_t K, int64_t g, int64_t lead) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == lead + 4 && packed.size(-1) == 4 &&
                  packed.size(-2) == kPanel && packed.size(-3) * kChunk == K,
              op, ": packed must be uint8 [ceil(n / 16), K / 8, 16, 4] for K = ", K);
  TORCH_CHECK(g > 0 && g % kBlock == 0 && K % g == 0, op, ": the group size must be a multiple of 32 dividing K");
  TORCH_CHECK(sz.scalar_type() == at::kFloat && sz.dim() == lead + 4 && sz.size(-4) == packed.size(-4) &&
                  sz.size(-3) == K / g && sz.size(-2) == 2 && sz.size(-1) == kPanel,
              op, ": sz must be fp32 [ceil(n / 16), K / group_size, 2, 16]");
}

at::Tensor int4_q8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size,
                          int64_t n) {
  const int64_t K = x.size(-1);
  check_layout("clover_cpu::int4_q8_linear", packed, sz, K, group_size, 0);
  TORCH_CHECK(packed.size(0) * kPanel >= n, "clover_cpu::int4_q8_linear: the weight has fewer than ", n, " outputs");
  const at::Tensor xf = x.to(at::kFloat).contiguous(), w = packed.contiguous(), s = sz.contiguous();
  const int64_t M = K ? xf.numel() / K : 0;
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  auto y = at::empty(sizes, xf.options());
  if (M > 0 && n > 0) {
    thread_local Acts mine;  // kept between calls: no allocation per call
    Acts& q = mine;  // the caller's, named so: in the lambda below `mine` would be each helper thread's own (empty)
    quantise(xf.data_ptr<float>(), M, K, group_size, q);
    float* yp = y.data_ptr<float>();
    const uint8_t* wp = w.data_ptr<uint8_t>();
    const float* sp = s.data_ptr<float>();
    const int64_t np = (n + kPanel - 1) / kPanel, pairs = (np + 1) / 2;
    // a pair's work: its int8 multiply-adds, but at least what reading its codes costs, which every
    // call pays whatever its rows and which a call of a few rows is bound by (kStreamRows)
    const int64_t rows = std::max<int64_t>(M, kStreamRows);
    clover_parallel::split(pairs, rows * K * 2 * kPanel / clover_parallel::kInt8MacsPerFp32, [&](int64_t g0, int64_t g1) {
      panels(q, M, wp, sp, yp, n, 2 * g0, std::min<int64_t>(2 * g1, np));
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Routed SwiGLU experts (routed_experts.h) on int4 stacks in this layout with a leading expert dim:
// each projection's input rows quantised, then `panels`, as int4.cpp's `int4_experts`.
at::Tensor int4_q8_experts(const at::Tensor& x, const at::Tensor& top_idx, const at::Tensor& top_w, const at::Tensor& gate_up,
                           const at::Tensor& gate_up_sz, const at::Tensor& down, const at::Tensor& down_sz,
                           int64_t group_size, int64_t inter) {
  const char* op = "clover_cpu::int4_q8_experts";
  TORCH_CHECK(x.dim() == 2 && top_idx.dim() == 2, op, ": bad ranks");
  const int64_t H = x.size(1), E = gate_up.size(0), I = inter, I2 = 2 * inter;
  check_layout(op, gate_up, gate_up_sz, H, group_size, 1);
  check_layout(op, down, down_sz, I, group_size, 1);
  TORCH_CHECK(down.size(0) == E && gate_up.size(1) * kPanel >= I2 && down.size(1) * kPanel >= H, op, ": shapes disagree");
  return clover_int4::experts(op, x, top_idx, top_w, gate_up, gate_up_sz, down, down_sz, inter,
                              [&](const float* in, int64_t rows, int64_t K, const uint8_t* w, const float* sz, float* out,
                                  int64_t N, int64_t np) {
    thread_local Acts q;  // experts may run on several threads (routed_experts.h): each its own
    quantise(in, rows, K, group_size, q);
    panels(q, rows, w, sz, out, N, 0, np);
  }, clover_parallel::kInt8MacsPerFp32);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(clover_cpu, m) { clover_int4::define_ops(m, "int4_q8"); }

TORCH_LIBRARY_IMPL(clover_cpu, CPU, m) {
  m.impl("int4_q8_linear", &int4_q8_linear);
  m.impl("int4_q8_experts", &int4_q8_experts);
}
