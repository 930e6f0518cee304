// The small per-layer ops of a CPU forward, fused: RMSNorm (with the residual add), RoPE (with Qwen3's
// per-head q/k RMSNorm) and SiLU-and-multiply, in fp32 or bf16, with the rounding points of the torch reference (layers/norm.py,
// layers/rotary.py): a decode step of one sequence spent more time dispatching their ~10 torch ops per layer
// than computing them. Rows are shared out by the pool of pool.h.
// Built with the other CPU kernels by kernels/cpu/build.py.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"
#include "pool.h"
#include "vec_math.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t ROWS_PER_INDEX = 16;  // rows per pool index: fewer run on the calling thread alone
constexpr int MAX_D = 512;             // largest head_dim for RoPE

using pagedserve::load;
using pagedserve::store;
// f(r) for every row, ROWS_PER_INDEX rows per index of the pool (pool.h).
template <typename F>
void for_rows(int64_t rows, F&& f) {
  pagedserve::parallel_for((rows + ROWS_PER_INDEX - 1) / ROWS_PER_INDEX, [&](int64_t chunk) {
    const int64_t end = std::min(rows, (chunk + 1) * ROWS_PER_INDEX);
    for (int64_t r = chunk * ROWS_PER_INDEX; r < end; ++r) f(r);
  });
}

template <typename T>
inline float round_to(float f) {  // f as it reads back after a store in T
  T t;
  store(&t, f);
  return load(&t);
}

// h = x * rsqrt(mean(x^2) + eps), rounded to T, times the weight, rounded to T (Hugging Face's order).
template <typename T>
inline void norm_row(const float* x, const T* w, T* out, int n, float eps) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int i = 0; i < n; ++i) store(out + i, round_to<T>(x[i] * inv) * load(w + i));
}

template <typename T>
void rms_norm(const T* x, const T* residual, const T* w, T* out, T* res_out, int64_t rows, int hidden,
              int64_t x_stride, float eps) {
  for_rows(rows, [&](int64_t r) {
    float buf[8192];
    float* h = hidden <= 8192 ? buf : new float[hidden];
    const T* xr = x + r * x_stride;
    if (residual != nullptr) {  // residual' = x + residual, rounded to T: the next layer's residual
      const T* rr = residual + r * hidden;
      T* ro = res_out + r * hidden;
      for (int i = 0; i < hidden; ++i) {
        const float s = round_to<T>(load(xr + i) + load(rr + i));
        store(ro + i, s);
        h[i] = s;
      }
    } else {
      for (int i = 0; i < hidden; ++i) h[i] = load(xr + i);
    }
    norm_row(h, w, out + r * hidden, hidden, eps);
    if (h != buf) delete[] h;
  });
}

// Neox-style rotation of one head in place: [x1 | x2] -> [x1 cos - x2 sin | x2 cos + x1 sin], in fp32.
template <typename T>
inline void rotate_head(T* x, const float* cos, const float* sin, int half, const T* norm_w, float eps) {
  float h[MAX_D];
  for (int i = 0; i < 2 * half; ++i) h[i] = load(x + i);
  if (norm_w != nullptr) {  // Qwen3: RMSNorm of the head first, rounded to T as the reference's output is
    T normed[MAX_D];
    norm_row(h, norm_w, normed, 2 * half, eps);
    for (int i = 0; i < 2 * half; ++i) h[i] = load(normed + i);
  }
  for (int i = 0; i < half; ++i) {
    const float x1 = h[i], x2 = h[half + i];
    store(x + i, x1 * cos[i] - x2 * sin[i]);
    store(x + half + i, x2 * cos[i] + x1 * sin[i]);
  }
}

template <typename T>
void rope(T* q, T* k, const int32_t* positions, const float* cos_sin, int64_t tokens, int num_q_heads,
          int num_k_heads, int head_dim, int64_t q_stride, int64_t k_stride, int64_t cache_stride,
          const T* q_norm_w, const T* k_norm_w, float eps) {
  const int half = head_dim / 2;
  for_rows(tokens, [&](int64_t t) {
    const float* cos = cos_sin + static_cast<int64_t>(positions[t]) * cache_stride;
    const float* sin = cos + half;
    for (int h = 0; h < num_q_heads; ++h) rotate_head(q + t * q_stride + h * head_dim, cos, sin, half, q_norm_w, eps);
    for (int h = 0; h < num_k_heads; ++h) rotate_head(k + t * k_stride + h * head_dim, cos, sin, half, k_norm_w, eps);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// bf16 rounding to nearest even, as dtypes.h's store: the result still in fp32 lanes
inline __m512i bf16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const uint16_t*) {
  return _mm512_castsi512_ps(_mm512_and_si512(bf16_bits(v), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits(v), 16)));
}

#endif

// out = silu(gate) * up for x = [gate | up] rows, rounded to T after the silu and after the product (torch's
// F.silu(gate) * up). 16 lanes at a time where the CPU has AVX-512, with vec_math.h's exp (libm's expf per
// element was 7% of a batch-64 run's samples): about 1 fp32 ulp from torch's, as libm's is.
template <typename T>
void silu_and_mul(const T* x, T* out, int64_t rows, int inter, int64_t x_stride) {
  for_rows(rows, [&](int64_t r) {
    const T* g = x + r * x_stride;
    const T* u = g + inter;
    T* o = out + r * inter;
    int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i + 16 <= inter; i += 16) {
      const __m512 v = load16(g + i);
      const __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
      store16(o + i, _mm512_mul_ps(round16(s, g), load16(u + i)));
    }
#endif
    for (; i < inter; ++i) {
      const float v = load(g + i);
      store(o + i, round_to<T>(v / (1.0f + std::exp(-v))) * load(u + i));
    }
  });
}

}  // namespace

extern "C" int cpu_silu_and_mul(const void* x, void* out, int64_t rows, int inter, int64_t x_stride, int is_bf16) {
  if (is_bf16)
    silu_and_mul(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(out), rows, inter, x_stride);
  else
    silu_and_mul(static_cast<const float*>(x), static_cast<float*>(out), rows, inter, x_stride);
  return 0;
}

extern "C" int cpu_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* res_out,
                            int64_t rows, int hidden, int64_t x_stride, float eps, int is_bf16) {
  if (is_bf16)
    rms_norm(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(residual),
             static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out), static_cast<uint16_t*>(res_out),
             rows, hidden, x_stride, eps);
  else
    rms_norm(static_cast<const float*>(x), static_cast<const float*>(residual), static_cast<const float*>(weight),
             static_cast<float*>(out), static_cast<float*>(res_out), rows, hidden, x_stride, eps);
  return 0;
}

extern "C" int cpu_rope(void* q, void* k, const int32_t* positions, const float* cos_sin, int64_t tokens,
                        int num_q_heads, int num_k_heads, int head_dim, int64_t q_stride, int64_t k_stride,
                        int64_t cache_stride, const void* q_norm_w, const void* k_norm_w, float eps, int is_bf16) {
  if (head_dim > MAX_D || head_dim % 2) return 1;
  if (is_bf16)
    rope(static_cast<uint16_t*>(q), static_cast<uint16_t*>(k), positions, cos_sin, tokens, num_q_heads, num_k_heads,
         head_dim, q_stride, k_stride, cache_stride, static_cast<const uint16_t*>(q_norm_w),
         static_cast<const uint16_t*>(k_norm_w), eps);
  else
    rope(static_cast<float*>(q), static_cast<float*>(k), positions, cos_sin, tokens, num_q_heads, num_k_heads,
         head_dim, q_stride, k_stride, cache_stride, static_cast<const float*>(q_norm_w),
         static_cast<const float*>(k_norm_w), eps);
  return 0;
}
