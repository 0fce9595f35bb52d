// Row tiles of a kernel's compile-time height: a call's M rows split evenly into tiles of at most Max
// rows, each run by a template instantiated for its height (int4.cpp, int4_q8.cpp).
#pragma once

#include <cstdint>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace clover_tiles {

template <int V>
using Int = std::integral_constant<int, V>;

// fn(Int<r>, m) for a runtime r in [R, Max] (Max where r >= Max).
template <int R, int Max, typename Fn>
inline void with_rows(int64_t r, int64_t m, Fn&& fn) {
  if constexpr (R >= Max) {
    fn(Int<Max>{}, m);
  } else {
    if (r == R) return fn(Int<R>{}, m);
    with_rows<R + 1, Max>(r, m, fn);
  }
}

// Rows [0, M) in tiles of up to Max, shared evenly (6 rows as 3 + 3, not 4 + 2), called as fn(Int<R>, m).
template <int Max, typename Fn>
inline void row_tiles(int64_t M, Fn&& fn) {
  const int64_t tiles = (M + Max - 1) / Max;
  for (int64_t t = 0, m = 0; t < tiles; ++t) {
    const int64_t r = (M - m + tiles - t - 1) / (tiles - t);
    with_rows<1, Max>(r, m, fn);
    m += r;
  }
}

#if defined(__AVX512F__)
// A tile's R x P accumulators (panels of 16 columns) to y's rows, the columns from n0 (a last panel
// past N masked).
template <int R, int P>
inline void store_tile(const __m512 (&acc)[R][P], float* y, int64_t ldy, int64_t n0, int64_t N) {
  for (int p = 0; p < P; ++p) {
    const int64_t n = n0 + p * 16;
    if (n >= N) break;
    const int64_t left = N - n;
    const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy + n, m, acc[r][p]);
  }
}
#endif

}  // namespace clover_tiles
