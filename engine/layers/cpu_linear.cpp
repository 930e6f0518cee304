// y = x W^T (+ bias) for bfloat16 on CPU with few input rows (decode steps), reading W exactly once.
//
// A decode step of one or two sequences is a matrix-vector product per layer: it is bound by reading the
// weights, and oneDNN's bf16 matmul spends more on blocking and dispatch than on that read here (23 ms for
// all of SmolLM2's linears at one row vs 14 ms for this loop, docs/benchmarks.md). Each work item takes R
// weight rows and multiplies them with up to MB input rows per pass using AVX512_BF16 dot products
// (pairs of bf16 products summed into fp32 lanes), then rounds to bf16 once, as torch's bf16 linear does.
// Built with engine/attention/cpu_kernel.cpp by engine/cpu_build.py; without AVX512_BF16 the entry point
// reports "unsupported" and callers use torch.
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int R = 4;   // weight rows per work item: R x MB accumulators stay in registers
constexpr int MB = 4;  // input rows per pass

inline __m512bh load_pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

template <int M>
void rows_times_block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out, int N, int K,
                      int n0, int rows) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* w_rows[R];
  for (int r = 0; r < R; ++r) w_rows[r] = w + static_cast<int64_t>(n0 + (r < rows ? r : 0)) * K;
  for (int k = 0; k < K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_pairs(w_rows[r] + k);
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = load_pairs(x + static_cast<int64_t>(m) * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < rows; ++r) {
      float s = _mm512_reduce_add_ps(acc[m][r]);
      if (bias != nullptr) s += bf16_to_float(bias[n0 + r]);
      out[static_cast<int64_t>(m) * N + n0 + r] = float_to_bf16(s);
    }
}

}  // namespace

extern "C" int linear_bf16_small_m(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* out,
                                   int M, int N, int K) {
  if (K % 32 != 0 || M < 1 || N < 1) return 1;
  const int blocks = (N + R - 1) / R;
#pragma omp parallel for schedule(static)
  for (int b = 0; b < blocks; ++b) {
    const int n0 = b * R, rows = N - n0 < R ? N - n0 : R;
    for (int m0 = 0; m0 < M; m0 += MB) {
      const uint16_t* xm = x + static_cast<int64_t>(m0) * K;
      uint16_t* om = out + static_cast<int64_t>(m0) * N;
      switch (M - m0 < MB ? M - m0 : MB) {
        case 1: rows_times_block<1>(xm, w, bias, om, N, K, n0, rows); break;
        case 2: rows_times_block<2>(xm, w, bias, om, N, K, n0, rows); break;
        case 3: rows_times_block<3>(xm, w, bias, om, N, K, n0, rows); break;
        default: rows_times_block<4>(xm, w, bias, om, N, K, n0, rows); break;
      }
    }
  }
  return 0;
}
#else
extern "C" int linear_bf16_small_m(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int, int, int) {
  return 1;  // no AVX512_BF16 on this CPU
}
#endif
