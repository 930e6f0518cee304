// y = x W^T (+ bias) on CPU with few input rows (decode steps), reading W exactly once, in fp32 or bf16.
//
// A decode step of one or a few sequences is a matrix-vector product per layer: it is bound by reading the
// weights, and torch's matmuls (oneDNN for bf16, MKL for fp32) spend more on blocking and dispatch than on that
// read here (docs/benchmarks.md). Each pool index takes CHUNK_BLOCKS blocks of R weight rows and multiplies
// them with up to MB input rows per pass: fp32 with FMAs, bf16 with AVX512_BF16 dot products (pairs of bf16
// products summed into fp32 lanes) and one rounding to bf16 at the end, as torch's bf16 linear does.
// Built with the other CPU kernels by kernels/cpu/build.py; where the CPU lacks the instructions the entry
// point reports "unsupported" and callers use torch.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "pool.h"
#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int R = 4;                 // weight rows per block: R x MB accumulators stay in registers
constexpr int MB = 4;                // input rows per pass
constexpr int64_t CHUNK_BLOCKS = 8;  // blocks per pool index: 32 weight rows

using pagedserve::load;
using pagedserve::store;

// One K step of 16 (fp32) or 32 (bf16) elements: acc += w * x lane-wise.
struct Fp32 {
  using T = float;
  static constexpr int STEP = 16;
  static __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 fma(__m512 acc, __m512 w, __m512 x) { return _mm512_fmadd_ps(w, x, acc); }
  using V = __m512;
};
#if defined(__AVX512BF16__)
struct Bf16 {
  using T = uint16_t;
  static constexpr int STEP = 32;
  static __m512bh load_w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 fma(__m512 acc, __m512bh w, __m512bh x) { return _mm512_dpbf16_ps(acc, w, x); }
  using V = __m512bh;
};
#endif

template <typename Op, int M>
void rows_times_block(const typename Op::T* x, const typename Op::T* w, const typename Op::T* bias,
                      typename Op::T* out, int N, int K, int n0, int rows) {
  using T = typename Op::T;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const T* w_rows[R];
  for (int r = 0; r < R; ++r) w_rows[r] = w + static_cast<int64_t>(n0 + (r < rows ? r : 0)) * K;
  for (int k = 0; k < K; k += Op::STEP) {
    typename Op::V wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Op::load_w(w_rows[r] + k);
    for (int m = 0; m < M; ++m) {
      const typename Op::V xv = Op::load_w(x + static_cast<int64_t>(m) * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = Op::fma(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < rows; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias != nullptr) s += load(bias + n0 + r);
      store(out + static_cast<int64_t>(m) * N + n0 + r, s);
    }
}

// Weight rows b*R.. times every input row, MB input rows per pass.
template <typename Op>
void block_times_rows(const typename Op::T* x, const typename Op::T* w, const typename Op::T* bias,
                      typename Op::T* out, int M, int N, int K, int b) {
  const int n0 = b * R, rows = N - n0 < R ? N - n0 : R;
  for (int m0 = 0; m0 < M; m0 += MB) {
    const auto* xm = x + static_cast<int64_t>(m0) * K;
    auto* om = out + static_cast<int64_t>(m0) * N;
    switch (M - m0 < MB ? M - m0 : MB) {
      case 1: rows_times_block<Op, 1>(xm, w, bias, om, N, K, n0, rows); break;
      case 2: rows_times_block<Op, 2>(xm, w, bias, om, N, K, n0, rows); break;
      case 3: rows_times_block<Op, 3>(xm, w, bias, om, N, K, n0, rows); break;
      default: rows_times_block<Op, 4>(xm, w, bias, om, N, K, n0, rows); break;
    }
  }
}

template <typename Op>
int linear(const void* x, const void* w, const void* bias, void* out, int M, int N, int K) {
  using T = typename Op::T;
  if (K % Op::STEP != 0 || M < 1 || N < 1) return 1;
  const int blocks = (N + R - 1) / R;
  const int64_t chunks = (blocks + CHUNK_BLOCKS - 1) / CHUNK_BLOCKS;
  pagedserve::parallel_for(chunks, [&](int64_t chunk) {
    const int end = static_cast<int>(std::min<int64_t>(blocks, (chunk + 1) * CHUNK_BLOCKS));
    for (int b = static_cast<int>(chunk * CHUNK_BLOCKS); b < end; ++b)
      block_times_rows<Op>(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<const T*>(bias),
                           static_cast<T*>(out), M, N, K, b);
  });
  return 0;
}

}  // namespace

extern "C" int linear_small_m(const void* x, const void* w, const void* bias, void* out, int M, int N, int K,
                              int is_bf16) {
  if (!is_bf16) return linear<Fp32>(x, w, bias, out, M, N, K);
#if defined(__AVX512BF16__)
  return linear<Bf16>(x, w, bias, out, M, N, K);
#else
  return 1;  // no AVX512_BF16 on this CPU
#endif
}
#else
extern "C" int linear_small_m(const void*, const void*, const void*, void*, int, int, int, int) {
  return 1;  // no AVX-512 on this CPU
}
#endif
