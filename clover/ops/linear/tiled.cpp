// fp32 y = x @ W^T (+ b) for the few rows of a decode step, on a weight packed once into panels of
// 16 output columns: packed[p, k, j] = W[16 p + j, k] (zero rows past N). See tiled.py.
// bf16 panels (weights whose values are all bf16) are laid out in k pairs ("VNNI"): [p, k/2, j, 2]
// = W[16 p + j, k], K padded to even with zeros, so one 64-byte load holds columns j's weights for
// k and k+1; the AVX-512 tile widens both exactly, and AMX tiles read the same bytes.
//
// `clover_cpu::linear(x, weight, bias)` keeps the packed copy of each weight it sees (keyed by the
// weight's TensorImpl, held weakly, so a freed weight's entry dies with it) and repacks when the
// weight's version counter moves (an in-place update: copy_, load_state_dict, an optimizer step);
// it can never serve a stale weight. A weight made under inference mode has no version counter:
// it goes to at::linear unpacked.
//
// Each tile is R rows x P panels held in R*P vector accumulators; for every k it loads P panel
// vectors and FMAs each with the broadcast x[r, k]. A panel pair (2 x K x 16 floats, 32 KB at
// K = 256) stays in L1 while every row tile passes over it, so the weight is read from memory once
// per call whatever the row count. AVX-512 where the compiler targets it; AVX2 + FMA (16 registers
// of 8 floats: a panel is two halves, every tile 8 accumulators: 1 row x 4 panels, 2 x 2, up to 4 x 1,
// walk_avx2); else plain C++ that the compiler may vectorise (fp32 panels only), slower than torch's
// linear: graphs route here only where the vector tiles are built (ops.linear.worth_routing).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "parallel.h"
#include "routed_experts.h"
#include <unordered_map>

#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#define CLOVER_BF16_PANELS 1  // the tiles can widen bf16 panels
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CLOVER_AVX2 1
#define CLOVER_BF16_PANELS 1
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define CLOVER_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kPanel = 16;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// A tile's R x P accumulators (+ bias) into y's columns n0 ... (masked past N): every kernel's epilogue.
template <int R, int P>
inline void store_tile(const __m512 (&acc)[R][P], float* y, int64_t ldy, int64_t n0, int64_t N, const float* bias) {
  for (int p = 0; p < P; ++p) {
    const int64_t n = n0 + p * kPanel;
    if (n >= N) break;
    const int64_t left = N - n;
    const __mmask16 m = left >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(m, bias + n) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n, m, _mm512_add_ps(acc[r][p], b));
  }
}

template <int R, int P, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy,
                 int64_t n0, int64_t N, const float* bias) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  if constexpr (std::is_same_v<W, uint16_t>) {  // k pairs: one load, both halves widened exactly
    const int64_t Kp = K + (K & 1);
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t k = 0; k < K; k += 2) {
      __m512 we[P], wo[P];
      for (int p = 0; p < P; ++p) {
        const __m512i v = _mm512_loadu_si512(w + (p * Kp + k) * kPanel);
        we[p] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        wo[p] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      }
      const bool odd = k + 1 < K;
      for (int r = 0; r < R; ++r) {
        const __m512 xe = _mm512_set1_ps(x[r * ldx + k]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xe, we[p], acc[r][p]);
        if (odd) {
          const __m512 xo = _mm512_set1_ps(x[r * ldx + k + 1]);
          for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xo, wo[p], acc[r][p]);
        }
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      __m512 wv[P];
      for (int p = 0; p < P; ++p) wv[p] = load16(w + (p * K + k) * kPanel);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xv, wv[p], acc[r][p]);
      }
    }
  }
  store_tile<R, P>(acc, y, ldy, n0, N, bias);
}
#elif defined(CLOVER_AVX2)
// A tile's R x P x 2 half-panel accumulators (+ bias) into y's columns n0 ... (masked past N).
template <int R, int P>
inline void store_tile(const __m256 (&acc)[R][P][2], float* y, int64_t ldy, int64_t n0, int64_t N, const float* bias) {
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = n0 + p * kPanel + 8 * h;
      if (n >= N) return;
      const int64_t left = N - n;
      if (left >= 8) {
        const __m256 b = bias ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + n, _mm256_add_ps(acc[r][p][h], b));
      } else {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 b = bias ? _mm256_maskload_ps(bias + n, m) : _mm256_setzero_ps();
        for (int r = 0; r < R; ++r) _mm256_maskstore_ps(y + r * ldy + n, m, _mm256_add_ps(acc[r][p][h], b));
      }
    }
}

// Keeps a loaded panel half in a register: without it GCC folds the load into every row's FMA (a
// 256-bit load per FMA), and the fp32 tiles ran at half the FMA rate (load-bound). One row reuses
// nothing, so there the folded loads are the right code.
template <int R>
inline void in_register(__m256& v) {
  if constexpr (R > 1) asm("" : "+x"(v));
}

// R rows x P panels, R*P*2 <= 8 accumulators (walk_avx2 picks the shape). Every output is the same
// chain of FMAs in k order whatever the tile's shape, so a row's result does not depend on the rows
// or panels it shares a call with. GCC's register allocation decides the speed here, and small changes
// upset it (bench/linear.py): the tile inlined into the walk, lambdas over the accumulators or an odd-K
// tail after the pair loop each keep the accumulators on the stack, stored on every k. Hence noinline
// and the plain loops.
template <int R, int P, typename W>
__attribute__((noinline)) void tile(const float* __restrict x, int64_t ldx, const W* __restrict w, int64_t K, float* y, int64_t ldy,
                 int64_t n0, int64_t N, const float* bias) {
  __m256 acc[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
  if constexpr (std::is_same_v<W, uint16_t> && R > 2) {  // k pairs: 8 columns' (k, k + 1) per load, both widened exactly
    const int64_t Kp = K + (K & 1);
    const auto half = [&](int p, int h, int64_t k) {
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p * Kp + k) * kPanel + 16 * h));
    };
    for (int64_t k = 0; k < K; k += 2) {
      {  // k's weights: the low halves shifted up
        __m256 wv[P][2];
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) wv[p][h] = _mm256_castsi256_ps(_mm256_slli_epi32(half(p, h, k), 16));
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
          for (int p = 0; p < P; ++p)
            for (int h = 0; h < 2; ++h) acc[r][p][h] = _mm256_fmadd_ps(xv, wv[p][h], acc[r][p][h]);
        }
      }
      // k + 1's: the high halves, loaded again (from L1) rather than held, so nothing spills. An odd
      // K's last pair holds a zero pad row: skipped. (The test is in the loop: a tail after it made
      // GCC store every accumulator to the stack on every pair, at half the speed.)
      if (k + 1 < K) {
        const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
        __m256 wv[P][2];
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) wv[p][h] = _mm256_and_ps(_mm256_castsi256_ps(half(p, h, k)), high);
        for (int r = 0; r < R; ++r) {
          const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k + 1);
          for (int p = 0; p < P; ++p)
            for (int h = 0; h < 2; ++h) acc[r][p][h] = _mm256_fmadd_ps(xv, wv[p][h], acc[r][p][h]);
        }
      }
    }
  } else if constexpr (R <= 2) {  // 1 row x 4 panels, 2 rows x 2: each half in turn (holding every
    // panel's halves at once, as below, spilled: GCC merged a bf16 half's two loads and kept both forms)
    if constexpr (std::is_same_v<W, uint16_t>) {
      const int64_t Kp = K + (K & 1);
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
      for (int64_t k = 0; k < K; k += 2) {
        const bool odd = k + 1 < K;  // else the pad row: skipped
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (p * Kp + k) * kPanel + 16 * h));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), wo = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            for (int r = 0; r < R; ++r) {
              acc[r][p][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k), we, acc[r][p][h]);
              if (odd) acc[r][p][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k + 1), wo, acc[r][p][h]);
            }
          }
      }
    } else {
      for (int64_t k = 0; k < K; ++k)
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) {
            const __m256 wv = _mm256_loadu_ps(w + (p * K + k) * kPanel + 8 * h);
            for (int r = 0; r < R; ++r) acc[r][p][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k), wv, acc[r][p][h]);
          }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      __m256 wv[P][2];
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < 2; ++h) {
          wv[p][h] = _mm256_loadu_ps(w + (p * K + k) * kPanel + 8 * h);
          in_register<R>(wv[p][h]);
        }
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
        for (int p = 0; p < P; ++p)
          for (int h = 0; h < 2; ++h) acc[r][p][h] = _mm256_fmadd_ps(xv, wv[p][h], acc[r][p][h]);
      }
    }
  }
  store_tile<R, P>(acc, y, ldy, n0, N, bias);
}
#else
template <int R, int P, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t K, float* y, int64_t ldy,
                 int64_t n0, int64_t N, const float* bias) {
  float acc[R][P][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
      for (int p = 0; p < P; ++p)
        for (int j = 0; j < kPanel; ++j) acc[r][p][j] += xv * w[(p * K + k) * kPanel + j];
    }
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < kPanel; ++j) {
      const int64_t n = n0 + p * kPanel + j;
      if (n >= N) break;
      for (int r = 0; r < R; ++r) y[r * ldy + n] = acc[r][p][j] + (bias ? bias[n] : 0.f);
    }
}
#endif

template <int V>
using Int = std::integral_constant<int, V>;

// fn(Int<r>{}) for a row count 1 <= r <= Most as a compile-time constant (r past Most: Most).
template <int Most, typename Fn>
inline void with_rows(int64_t r, Fn&& fn) {
  if constexpr (Most > 1) {
    if (r < Most) return with_rows<Most - 1>(r, fn);
  }
  fn(Int<Most>{});
}

// Row tiles of at most Most rows over M rows, the rows shared evenly among them (9 rows in tiles of
// up to 8: 5 + 4, not 8 + 1): fn(Int<rows>{}, first row) for each.
template <int Most, typename Fn>
inline void even_row_tiles(int64_t M, Fn&& fn) {
  const int64_t tiles = (M + Most - 1) / Most;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = (M - m + tiles - t - 1) / (tiles - t);  // the rows left, shared evenly
    with_rows<Most>(r, [&](auto R) { fn(R, m); });
    m += r;
  }
}

// Every kernel's walk over panels [p0, p1) and M rows (but the AVX2 tiles', walk_avx2): row tiles of
// up to 8 rows, the rows shared evenly among them (9 rows as 5 + 4, not 8 + 1: a tile of few rows
// holds too few independent FMA chains to keep the FMA pipes busy, so a 1-row tail cost about as
// much as a full tile); groups of P panels outermost (a group stays in L1 while every row tile passes
// over it), of 2P panels where M <= 4 (as many accumulators as a full tile: the few rows per expert of
// the routed experts), then single panels. Calls fn(Int<R>, Int<panels>, m, p) with the tile's row
// and panel counts as compile-time constants.
template <int P, typename Fn>
inline void walk_tiles(int64_t M, int64_t p0, int64_t p1, Fn&& fn) {
  const auto rows = [&](auto np, int64_t p) { even_row_tiles<8>(M, [&](auto r, int64_t m) { fn(r, np, m, p); }); };
  int64_t p = p0;
  if (M >= 1 && M <= 4)
    for (; p + 2 * P <= p1; p += 2 * P) with_rows<4>(M, [&](auto r) { fn(r, Int<2 * P>{}, 0, p); });
  for (; p + P <= p1; p += P) rows(Int<P>{}, p);
  for (; p < p1; ++p) rows(Int<1>{}, p);
}

#if defined(CLOVER_AVX2)
// The AVX2 tiles' walk: 8 accumulators of the 16 registers in every shape (12 would spill),
// enough independent FMA chains to keep both FMA pipes busy (a chain waits 4 cycles per FMA). One
// row: 4 panels a tile; two rows: 2 panels; more: single panels under row tiles of up to 4 rows,
// split evenly (6 rows as 3 + 3, not 4 + 2): 4-row tiles alone leave few rows badly served
// (bench/linear.py).
template <typename W, typename Fn>
inline void walk_avx2(int64_t M, int64_t p0, int64_t p1, Fn&& fn) {
  const auto by_panels = [&](auto np, auto&& rows) {
    int64_t p = p0;
    for (; p + decltype(np)::value <= p1; p += decltype(np)::value) rows(np, p);
    for (; p < p1; ++p) rows(Int<1>{}, p);
  };
  if (M == 1) return by_panels(Int<4>{}, [&](auto np, int64_t p) { fn(Int<1>{}, np, 0, p); });
  if (M == 2) {  // fp32 panels: 1 panel (2 x 2 is slower there)
    constexpr int kP = std::is_same_v<W, uint16_t> ? 2 : 1;
    return by_panels(Int<kP>{}, [&](auto np, int64_t p) { fn(Int<2>{}, np, 0, p); });
  }
  by_panels(Int<1>{}, [&](auto np, int64_t p) { even_row_tiles<4>(M, [&](auto r, int64_t m) { fn(r, np, m, p); }); });
}
#endif

#if defined(__AVX512BF16__)
// bf16 activations (clover_cpu::use_bf16_activations, see bf16_activations below): x rounded
// to bf16 once per call, each k pair of a row broadcast as one 32-bit lane and multiplied into the
// weights' k pairs by vdpbf16ps (fp32 accumulators): 32 products an instruction where the exact
// kernel above does 16, and no widening of the weights. Every product bf16(x) * w is exact in fp32;
// the error is x's rounding (2^-9 relative), as in torch's and llama.cpp's bf16 matmuls. xb is
// [rows, Kp] bf16 (Kp even, a zero past an odd K), ldx its row length in pairs.
template <int R, int P>
inline void tile_bf16(const uint32_t* xb, int64_t ldx, const uint16_t* w, int64_t Kp, float* y, int64_t ldy,
                      int64_t n0, int64_t N, const float* bias) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t q = 0; q < Kp / 2; ++q) {
    __m512bh wv[P];
    for (int p = 0; p < P; ++p) wv[p] = (__m512bh)_mm512_loadu_si512(w + (p * Kp + 2 * q) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[r * ldx + q]));
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
    }
  }
  store_tile<R, P>(acc, y, ldy, n0, N, bias);
}

// x [M, K] fp32 -> [M, Kp] bf16, rounded to nearest even (a zero past an odd K).
void round_bf16(const float* x, int64_t M, int64_t K, int64_t Kp, std::vector<uint16_t>& out) {
  out.resize(M * Kp);
  for (int64_t r = 0; r < M; ++r) {
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + r * Kp + k),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * K + k))));
    if (k < K) {
      const __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + r * K + k)));
      _mm256_mask_storeu_epi16(out.data() + r * Kp + k, m, h);
    }
    if (Kp > K) out[r * Kp + K] = 0;
  }
}
#endif

// Whether bf16 panels take bf16 activations: the user asked for them (clover_cpu::use_bf16_activations,
// tiled.py: `--linear-dtype bfloat16`) and the CPU has a bf16 product (AVX512-BF16, AMX). Read once
// per op call, not traced: a compiled graph follows it. Only these linears: torch's own matmuls
// (attention, the delta rule) stay fp32.
constexpr bool kBf16Dot =
#if defined(__AVX512BF16__)
    true;
#else
    false;
#endif

std::atomic<bool> bf16_requested{false};

bool bf16_activations() { return kBf16Dot && bf16_requested.load(std::memory_order_relaxed); }


// Rows of the packed weight's panels: K for fp32 panels, K padded to even for bf16 (k pairs).
template <typename W>
constexpr int64_t panel_k(int64_t K) { return std::is_same_v<W, uint16_t> ? K + (K & 1) : K; }

#if defined(CLOVER_AMX)
// AMX (bf16 tiles, fp32 accumulators) for bf16 panels. The weights are bf16 numbers, and x is split
// exactly-enough into three bf16 terms, x = x1 + x2 + x3 + e with |e| <= 2^-27 |x| (below fp32's own
// rounding), so every product x_i * w is exact in fp32 and only the summation order differs from the
// fp32 kernel: the accuracy of an fp32 GEMM, at AMX's rate (bench/linear.py). Used from kAmxMinRows rows, K a multiple
// of 32 (one tile row of bf16 pairs). Under bf16 activations (bf16_activations above) x is one term,
// its bf16 rounding: a third of the tile products, the numbers of the AVX512-BF16 tile above.
constexpr int64_t kAmxMinRows = 6;
bool amx_enabled = true;  // clover_cpu::use_amx: off for A/B benchmarks and tests of the AVX-512 path

bool amx_ready() {
  static const bool ok = [] {  // Linux hands out the 8 KB tile state only on request
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x [M, K] fp32 -> `terms` (1 or 3) bf16 terms [terms][Mp][K] (rows past M zero), each the rounded
// residual of the last.
void split_terms(const float* x, int64_t M, int64_t K, int64_t Mp, int terms, std::vector<uint16_t>& out) {
  out.resize(terms * Mp * K);
  for (int t = 0; t < terms; ++t)  // only the rows past M need zeros: every other element is written below
    std::fill(out.begin() + (t * Mp + M) * K, out.begin() + (t + 1) * Mp * K, uint16_t{0});
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; k += 16) {
      __m512 rest = _mm512_loadu_ps(x + r * K + k);
      for (int t = 0; t < terms; ++t) {
        const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(rest));  // round to nearest even
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.data() + (t * Mp + r) * K + k), h);
        rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
      }
    }
}

void amx_panels(const float* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N, const float* bias,
                int64_t p0, int64_t p1, int terms) {
  const int64_t Mp = (M + 15) / 16 * 16;
  thread_local std::vector<uint16_t> a;
  split_terms(x, M, K, Mp, terms, a);
  const bool three = terms == 3;
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;  // 0-1 C, 2-4 the x terms, 5-6 panels
  _tile_loadconfig(&cfg);
  alignas(64) float c[2][16][16];
  const int64_t stride = K * 2, chunks = K / 32;
  for (int64_t p = p0; p < p1; p += 2) {
    const bool two = p + 1 < p1;
    const uint16_t* w0 = w + p * K * kPanel;
    const uint16_t* w1 = w0 + K * kPanel;
    for (int64_t m = 0; m < Mp; m += 16) {
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t kc = 0; kc < chunks; ++kc) {
        const uint16_t* ak = a.data() + m * K + kc * 32;
        _tile_loadd(2, ak, stride);
        if (three) {
          _tile_loadd(3, ak + Mp * K, stride);
          _tile_loadd(4, ak + 2 * Mp * K, stride);
        }
        _tile_loadd(5, w0 + kc * 32 * kPanel, 64);
        _tile_dpbf16ps(0, 2, 5);
        if (three) {
          _tile_dpbf16ps(0, 3, 5);
          _tile_dpbf16ps(0, 4, 5);
        }
        if (two) {
          _tile_loadd(6, w1 + kc * 32 * kPanel, 64);
          _tile_dpbf16ps(1, 2, 6);
          if (three) {
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(1, 4, 6);
          }
        }
      }
      _tile_stored(0, c[0], 64);
      if (two) _tile_stored(1, c[1], 64);
      for (int q = 0; q < (two ? 2 : 1); ++q) {
        const int64_t n = (p + q) * kPanel;
        const int64_t left = N - n;
        const __mmask16 mask = left >= kPanel ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
        for (int64_t r = 0; r < std::min<int64_t>(16, M - m); ++r)
          _mm512_mask_storeu_ps(y + (m + r) * N + n, mask, _mm512_add_ps(_mm512_load_ps(c[q][r]), b));
      }
    }
  }
  _tile_release();
}
#endif

// Panels [p0, p1) for every row (walk_tiles). bf16_x: bf16 panels take x rounded to bf16
// (bf16_activations(), read once per op call).
template <typename W>
void panels(const float* x, int64_t M, int64_t K, const W* w, float* y, int64_t N, const float* bias,
            int64_t p0, int64_t p1, bool bf16_x) {
#if defined(CLOVER_AMX)
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (M >= kAmxMinRows && K % 32 == 0 && amx_enabled && amx_ready())
      return amx_panels(x, M, K, w, y, N, bias, p0, p1, bf16_x ? 1 : 3);
  }
#endif
  constexpr int P = 2;
  const int64_t Kp = panel_k<W>(K);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (bf16_x) {
      thread_local std::vector<uint16_t> xb;
      round_bf16(x, M, K, Kp, xb);
      const uint32_t* xq = reinterpret_cast<const uint32_t*>(xb.data());
      const int64_t ldx = Kp / 2;
      walk_tiles<P>(M, p0, p1, [&](auto r, auto np, int64_t m, int64_t p) {
        tile_bf16<decltype(r)::value, decltype(np)::value>(xq + m * ldx, ldx, w + p * Kp * kPanel, Kp, y + m * N, N, p * kPanel, N, bias);
      });
      return;
    }
  }
#endif
  const auto run = [&](auto r, auto np, int64_t m, int64_t p) {
    tile<decltype(r)::value, decltype(np)::value, W>(x + m * K, K, w + p * Kp * kPanel, K, y + m * N, N, p * kPanel, N, bias);
  };
#if defined(CLOVER_AVX2)
  walk_avx2<W>(M, p0, p1, run);
#else
  walk_tiles<P>(M, p0, p1, run);
#endif
}

// Calls fn with the panels' data as const float* or, for bf16 panels, their raw const uint16_t*.
template <typename Fn>
void with_panels(const at::Tensor& packed, Fn&& fn) {
  if (packed.scalar_type() == at::kBFloat16)
    fn(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()));
  else
    fn(static_cast<const float*>(packed.data_ptr<float>()));
}

at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t n) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && (packed.scalar_type() == at::kFloat || packed.scalar_type() == at::kBFloat16),
              "tiled_linear: fp32 activations, fp32 or bf16 panels");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.size(0) * kPanel >= n,
              "tiled_linear: packed must be [ceil(n / 16), K, 16]");
  const int64_t K = x.size(-1);
  const int64_t Kp = packed.scalar_type() == at::kBFloat16 ? K + (K & 1) : K;
  TORCH_CHECK(packed.size(1) == Kp, "tiled_linear: x has ", K, " features, the weight ", packed.size(1));
  // no reshape / view calls (each a dispatcher round trip, 25 linears a step): x's rows are read in
  // place when contiguous and y is made in its final shape
  const at::Tensor x2 = x.is_contiguous() ? x : x.contiguous();
  const at::Tensor w = packed.is_contiguous() ? packed : packed.contiguous();
  int64_t M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) M *= x.size(d);
  c10::SmallVector<int64_t, 4> sizes(x.sizes().begin(), x.sizes().end());
  sizes.back() = n;
  auto y = at::empty(sizes, x.options());
  const float* b = nullptr;
  at::Tensor bc;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "tiled_linear: bias must have n elements");
    bc = bias->contiguous();
    b = bc.data_ptr<float>();
  }
  const int64_t groups = (packed.size(0) + 1) / 2;  // panel pairs: the unit of work per thread
  if (M > 0) {
    const float* xp = x2.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t np = packed.size(0);
    const bool bf16_x = bf16_activations();  // the caller's setting: read here, not in the pool's threads
    with_panels(w, [&](auto wp) {
      clover_parallel::split(groups, M * K * 2 * kPanel, [&](int64_t g0, int64_t g1) {
        panels(xp, M, K, wp, yp, n, b, 2 * g0, std::min<int64_t>(2 * g1, np), bf16_x);
      });
    });
  }
  return y;
}

// [..., N, K] -> [..., ceil(N / 16), K, 16]: every matrix of a stack (the experts) packed alike.
at::Tensor pack(const at::Tensor& w) {
  const int64_t N = w.size(-2), K = w.size(-1), np = (N + kPanel - 1) / kPanel;
  auto lead = w.sizes().vec();
  lead.resize(lead.size() - 2);
  auto padded_sizes = lead;
  padded_sizes.push_back(np * kPanel);
  padded_sizes.push_back(K);
  auto padded = at::zeros(padded_sizes, w.options());
  padded.narrow(-2, 0, N).copy_(w);
  auto view_sizes = lead;
  for (int64_t d : {np, kPanel, K}) view_sizes.push_back(d);
  auto packed = padded.view(view_sizes).transpose(-2, -1).contiguous();
#if defined(CLOVER_BF16_PANELS)
  // Weights that are bf16 values held in fp32 (a bf16 checkpoint loaded as fp32, as the shipped
  // models are) keep their panels in bf16: half the bytes a call reads, widened exactly on load, so
  // the products and their order are those of the fp32 panels. Laid out in k pairs (see the top).
  auto narrow = packed.to(at::kBFloat16);
  if (at::equal(narrow.to(at::kFloat), packed)) {
    if (K & 1) {  // a zero k row to pair the last one with
      auto pad_sizes = narrow.sizes().vec();
      pad_sizes[pad_sizes.size() - 2] = 1;
      narrow = at::cat({narrow, at::zeros(pad_sizes, narrow.options())}, -2);
    }
    auto sizes = narrow.sizes().vec();  // [..., np, Kp, 16] -> [..., np, Kp/2, 2, 16] -> [..., np, Kp/2, 16, 2]
    const int64_t Kp = sizes[sizes.size() - 2];
    sizes.pop_back();
    sizes.pop_back();
    auto pairs = sizes;
    for (int64_t d : {Kp / 2, int64_t{2}, kPanel}) pairs.push_back(d);
    sizes.push_back(Kp);
    sizes.push_back(kPanel);
    return narrow.view(pairs).transpose(-2, -1).contiguous().view(sizes);
  }
#endif
  return packed;
}

struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> weight;
  uint32_t version;
  at::Tensor packed;
};

std::mutex cache_mutex;
std::unordered_map<const c10::TensorImpl*, Entry> cache;

at::Tensor packed_weight(const at::Tensor& w) {
  if (w.is_inference()) return pack(w);  // no version counter to watch: packed afresh every call
  const c10::TensorImpl* key = w.unsafeGetTensorImpl();
  const uint32_t version = w.unsafeGetTensorImpl()->version_counter().current_version();
  std::lock_guard<std::mutex> lock(cache_mutex);
  auto it = cache.find(key);
  if (it != cache.end() && !it->second.weight.expired() && it->second.version == version) return it->second.packed;
  for (auto e = cache.begin(); e != cache.end();)  // drop the entries of freed weights
    e = e->second.weight.expired() ? cache.erase(e) : std::next(e);
  at::Tensor packed;
  {
    at::NoGradGuard no_grad;
    packed = pack(w.detach());
  }
  cache.insert_or_assign(key, Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(w.getIntrusivePtr()), version, packed});
  return packed;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2, "clover_cpu::linear: weight must be 2-D");
  if (weight.is_inference() || x.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat)
    return at::linear(x, weight, bias);
  return tiled_linear(x, packed_weight(weight), bias, weight.size(0));
}

// Routed SwiGLU experts (gate_up [E, 2I, H] rows [gate ; up], down [E, H, I]) of x [T, H] for the
// top-k choices of every token (routed_experts.h), each projection through the packed panels.
template <typename GU, typename DN>
at::Tensor run_experts(const at::Tensor& x, const at::Tensor& top_idx, const at::Tensor& top_w, const at::Tensor& gu,
                       const GU* gup, const at::Tensor& dn, const DN* dnp, int64_t I) {
  const int64_t H = x.size(1), I2 = 2 * I;
  const bool bf16_x = bf16_activations();
  const int64_t gu_stride = gu.size(1) * gu.size(2) * kPanel, dn_stride = dn.size(1) * dn.size(2) * kPanel;
  return clover_experts::routed_experts(x, top_idx, top_w, gu.size(0), I, "clover_cpu::experts",
                                        [&](int64_t e, int which, const float* in, int64_t n, float* out) {
    if (which == 0)
      panels(in, n, H, gup + e * gu_stride, out, I2, nullptr, 0, gu.size(1), bf16_x);
    else
      panels(in, n, I, dnp + e * dn_stride, out, H, nullptr, 0, dn.size(1), bf16_x);
  });
}

at::Tensor experts(const at::Tensor& x, const at::Tensor& top_idx, const at::Tensor& top_w, const at::Tensor& gate_up,
                   const at::Tensor& down) {
  TORCH_CHECK(x.dim() == 2 && top_idx.dim() == 2 && gate_up.dim() == 3 && down.dim() == 3, "clover_cpu::experts: bad ranks");
  TORCH_CHECK(x.scalar_type() == at::kFloat && gate_up.scalar_type() == at::kFloat && down.scalar_type() == at::kFloat,
              "clover_cpu::experts: fp32 only");
  const int64_t H = x.size(1), I = down.size(2);
  TORCH_CHECK(gate_up.size(2) == H && down.size(1) == H && gate_up.size(1) == 2 * I && down.size(0) == gate_up.size(0),
              "clover_cpu::experts: shapes disagree");
  const at::Tensor gu = packed_weight(gate_up), dn = packed_weight(down);  // [E, 2I/16, H, 16], [E, H/16, I, 16]
  at::Tensor y;
  with_panels(gu, [&](auto gup) {
    with_panels(dn, [&](auto dnp) { y = run_experts(x, top_idx, top_w, gu, gup, dn, dnp, I); });
  });
  return y;
}

bool packed_bf16(const at::Tensor& weight) { return packed_weight(weight).scalar_type() == at::kBFloat16; }

// Turns the AMX path on or off (where it is built and the OS grants the tiles); returns whether it
// was usable before the call.
bool use_amx(bool on) {
#if defined(CLOVER_AMX)
  const bool was = amx_enabled && amx_ready();
  amx_enabled = on;
  return was;
#else
  (void)on;
  return false;
#endif
}

bool bf16_dot() { return kBf16Dot; }

// The vector tiles this build runs: "avx512", "avx2" (+ FMA) or "none" (the plain C++, which only
// a compiler's auto-vectorisation speeds up: not worth routing a linear to, tiled.worth_routing).
std::string simd() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(CLOVER_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

// Turns bf16 activations on or off (they run only where bf16_dot()); returns the previous request.
bool use_bf16_activations(bool on) { return bf16_requested.exchange(on); }

// Sets the multiply-adds from which a call splits over threads (parallel.h); returns the previous value.
int64_t parallel_min_work(int64_t least) { return clover_parallel::min_work().exchange(std::max<int64_t>(0, least)); }
bool parallel_helpers_only(bool on) { return clover_parallel::helpers_only().exchange(on); }

int64_t cached_weights() {
  std::lock_guard<std::mutex> lock(cache_mutex);
  int64_t live = 0;
  for (const auto& e : cache) live += !e.second.weight.expired();
  return live;
}

}  // namespace

TORCH_LIBRARY(clover_cpu, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("experts(Tensor x, Tensor top_idx, Tensor top_w, Tensor gate_up, Tensor down) -> Tensor");
  m.def("cached_weights() -> int", &cached_weights);
  m.def("parallel_min_work(int least) -> int", &parallel_min_work);
  m.def("parallel_helpers_only(bool on) -> bool", &parallel_helpers_only);
  m.def("packed_bf16(Tensor weight) -> bool", &packed_bf16);
  m.def("use_amx(bool on) -> bool", &use_amx);
  m.def("bf16_dot() -> bool", &bf16_dot);
  m.def("simd() -> str", &simd);
  m.def("use_bf16_activations(bool on) -> bool", &use_bf16_activations);
}

TORCH_LIBRARY_IMPL(clover_cpu, CPU, m) {
  m.impl("linear", &linear);
  m.impl("experts", &experts);
}


// C entry points for inductor's C++ wrapper (tiled.c_shims, compile.c_shim_config): a compiled graph calls these directly
// instead of looking each op up in the dispatcher by name and boxing its arguments on each of the 29
// calls of an AR step (a few percent of a step at most: BENCHMARKS step-c-shims). Names: aoti_torch_<device>_<op
// name>, the convention the wrapper calls by.
extern "C" {
__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                                            AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using namespace torch::aot_inductor;
    *ret0 = new_tensor_handle((linear)(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(weight),
                                     bias ? std::optional<at::Tensor>(*tensor_handle_to_tensor_pointer(*bias)) : std::nullopt));
  });
}

__attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_experts(AtenTensorHandle x, AtenTensorHandle top_idx,
                                                                             AtenTensorHandle top_w, AtenTensorHandle gate_up,
                                                                             AtenTensorHandle down, AtenTensorHandle* ret0) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    using namespace torch::aot_inductor;
    *ret0 = new_tensor_handle(experts(*tensor_handle_to_tensor_pointer(x), *tensor_handle_to_tensor_pointer(top_idx),
                                      *tensor_handle_to_tensor_pointer(top_w), *tensor_handle_to_tensor_pointer(gate_up),
                                      *tensor_handle_to_tensor_pointer(down)));
  });
}
}
