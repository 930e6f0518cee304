// Linear layers and embedding rows straight from GGUF (ggml) quantized blocks, on CPU.
//
// Formats and their unpacking: quant_blocks.h.
// Decode (a few input rows): each input row is quantized once per call to int16 blocks of 32 (scale =
// max|x| / 32767), then every weight block is unpacked once for up to 4 input rows and dotted with them in
// integers (AVX2 madd: 16 products per instruction), scaled once per 32 weights. int16, not llama.cpp's int8
// activations: with int8 the rounding of the hidden state in SmolLM2's LM head alone moved a logit by ~0.1
// and flipped the README's greedy answer; int16 is ~256x closer to the float product for about one more
// instruction per 16 weights. The weights are read once, in their 4.5-8.5 bits: that read is what a
// one-stream decode step waits on. Larger inputs (prefill) dequantize the
// weight rows (qdequant) into a float GEMM done by the caller. Built by kernels/cpu/build.py with
// -march=native, so the AVX2 path is compiled exactly where the CPU has it; elsewhere a scalar loop does the
// same arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "pool.h"
#include "quant_blocks.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// One input row as int16 blocks: qx[K], a scale per block and the sum of each block's rounded values (the
// offset m of Q4_1/Q5_1/K-quant weights multiplies it). The rounded sum, not the exact one: then m's term and
// the product with unsigned q share one rounding of x and cancel as the weights d*q + m do, instead of
// leaving x's rounding error times the mean of q.
struct QRow {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};

template <typename T>
void quantize_row(const T* x, int K, QRow& r) {
  const int nb = K / QK;
  r.q.resize(K);
  r.scale.resize(nb);
  r.sum.resize(nb);
  for (int b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(pagedserve::load(x + b * QK + j)));
    const float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t is = 0;
    for (int j = 0; j < QK; ++j) {
      const int q = static_cast<int>(std::nearbyint(pagedserve::load(x + b * QK + j) * id));
      r.q[b * QK + j] = static_cast<int16_t>(q);
      is += q;
    }
    r.scale[b] = d;
    r.sum[b] = d * static_cast<float>(is);
  }
}

#if defined(__AVX2__)
inline float hsum(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight row dotted with R quantized input rows: each block is decoded once for all R rows (the decode
// costs about as much as the integer products of one row). The products of 32 weights with the int16 inputs
// are exact in int32 (|q| <= 127, |qx| <= 32767); each chunk's sum is scaled once.
// One weight row dotted with R quantized input rows: each block is decoded once for all R rows (the decode
// costs about as much as the integer products of one row). The products of 32 weights with the int16 inputs
// are exact in int32 (|q| <= 127, |qx| <= 32767); each chunk's sum is scaled once. The format is a template
// argument so that the block decode inlines into the loop without branches.
template <int T, int R>
void dot_rows(const uint8_t* w, const QRow* x, int K, float* out) {
  constexpr int bb = block_bytes(T), per_block = block_weights(T) / QK;
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  Chunk chunks[per_block];
  for (int blk = 0, b = 0; blk < K / block_weights(T); ++blk, w += bb) {
    decode_block(T, w, chunks);
    for (int j = 0; j < per_block; ++j, ++b) {
      const Chunk& c = chunks[j];
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c.q));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c.q, 1));
      for (int r = 0; r < R; ++r) {
        const int16_t* qx = x[r].q.data() + 32 * b;
        const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx)));
        const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 16)));
        const float xs = x[r].scale[b];
        if constexpr (T != Q6_K) {  // one scale per 32 weights
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(c.d0 * xs), acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(c.d0 * xs), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(c.d1 * xs), acc[r]);
        }
        if constexpr (T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K) offset[r] += c.m * x[r].sum[b];
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]) + offset[r];
}
#else
float dot_row(int t, const uint8_t* w, const QRow& x, int nb) {
  const int bb = block_bytes(t);
  float total = 0.0f;
  int8_t q[QK];
  for (int b = 0; b < nb; ++b, w += bb) {
    float d, m;
    block_ints(t, w, q, &d, &m);
    int32_t s = 0;
    for (int j = 0; j < QK; ++j) s += static_cast<int32_t>(q[j]) * x.q[b * QK + j];
    total += d * x.scale[b] * static_cast<float>(s) + m * x.sum[b];
  }
  return total;
}
float dot_row_k(int t, const uint8_t* w, const QRow& x, int nsb) {
  const int bb = block_bytes(t);
  float total = 0.0f;
  int8_t q[QK_K];
  float scale[16], off[8];
  for (int sb = 0; sb < nsb; ++sb, w += bb) {
    kblock_ints(t, w, q, scale, off);
    for (int g = 0; g < 16; ++g) {
      const int b = sb * 8 + g / 2;
      int32_t s = 0;
      for (int l = 0; l < 16; ++l) s += static_cast<int32_t>(q[16 * g + l]) * x.q[sb * QK_K + 16 * g + l];
      total += scale[g] * x.scale[b] * static_cast<float>(s);
    }
    for (int j = 0; j < 8; ++j) total += off[j] * x.sum[sb * 8 + j];
  }
  return total;
}

template <int T, int R>
void dot_rows(const uint8_t* w, const QRow* x, int K, float* out) {
  for (int r = 0; r < R; ++r) out[r] = is_k_quant(T) ? dot_row_k(T, w, x[r], K / QK_K) : dot_row(T, w, x[r], K / QK);
}
#endif

constexpr int ROWS_PER_INDEX = 16;  // weight rows per pool index

// Rows of input processed together against each weight row: one block decode serves all of them.
constexpr int ROWS_PER_DECODE = 4;

using DotFn = void (*)(const uint8_t*, const QRow*, int, float*);

template <int T>
void dot_any(const uint8_t* w, const QRow* x, int K, float* out, int R) {
  static constexpr DotFn fns[ROWS_PER_DECODE] = {dot_rows<T, 1>, dot_rows<T, 2>, dot_rows<T, 3>, dot_rows<T, 4>};
  fns[R - 1](w, x, K, out);
}

using DotAnyFn = void (*)(const uint8_t*, const QRow*, int, float*, int);

DotAnyFn dot_for(int t) {
  switch (t) {
    case Q4_0: return dot_any<Q4_0>;
    case Q4_1: return dot_any<Q4_1>;
    case Q5_0: return dot_any<Q5_0>;
    case Q5_1: return dot_any<Q5_1>;
    case Q8_0: return dot_any<Q8_0>;
    case Q4_K: return dot_any<Q4_K>;
    case Q5_K: return dot_any<Q5_K>;
    default: return dot_any<Q6_K>;
  }
}

template <typename T, typename O>
int qlinear(const T* x, const uint8_t* w, int t, int M, int N, int K, int64_t row_bytes, O* out, int64_t ldo) {
  const DotAnyFn dot = dot_for(t);
  std::vector<QRow> qx(M);
  for (int m = 0; m < M; ++m) quantize_row(x + static_cast<int64_t>(m) * K, K, qx[m]);
  pagedserve::parallel_for((N + ROWS_PER_INDEX - 1) / ROWS_PER_INDEX, [&](int64_t i) {
    const int n0 = static_cast<int>(i) * ROWS_PER_INDEX, n1 = std::min(N, n0 + ROWS_PER_INDEX);
    float res[ROWS_PER_DECODE];
    // input rows outermost: a few of them and this index's weight rows stay in L1 together
    for (int m0 = 0; m0 < M; m0 += ROWS_PER_DECODE) {
      const int R = std::min(ROWS_PER_DECODE, M - m0);
      for (int n = n0; n < n1; ++n) {
        const uint8_t* row = w + n * row_bytes;
        dot(row, &qx[m0], K, res, R);
        for (int r = 0; r < R; ++r) pagedserve::store(out + static_cast<int64_t>(m0 + r) * ldo + n, res[r]);
      }
    }
  });
  return 0;
}

#if defined(__AVX2__)
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
inline void store8(uint16_t* out, __m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  for (int i = 0; i < 8; ++i) pagedserve::store(out + i, f[i]);
}
#endif

template <typename T>
void dequant_row(int t, const uint8_t* w, int K, T* out) {
  const int bb = block_bytes(t);
  if (is_k_quant(t)) {
    int8_t q[QK_K];
    float scale[16], off[8];
    for (int sb = 0; sb < K / QK_K; ++sb, w += bb, out += QK_K) {
      kblock_ints(t, w, q, scale, off);
      for (int i = 0; i < QK_K; ++i) pagedserve::store(out + i, scale[i / 16] * static_cast<float>(q[i]) + off[i / 32]);
    }
    return;
  }
  for (int b = 0; b < K / QK; ++b, w += bb) {
    float d, m;
#if defined(__AVX2__)
    // d * q + m in the same float ops as the scalar loop below (one multiply, one add: no FMA contraction)
    alignas(32) int8_t q[QK];
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), block_bytes_avx2(t, w, &d, &m));
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    for (int j = 0; j < QK; j += 8) {
      const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
      store8(out + b * QK + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(qi), dv), mv));
    }
#else
    int8_t q[QK];
    block_ints(t, w, q, &d, &m);
    for (int j = 0; j < QK; ++j) pagedserve::store(out + b * QK + j, d * static_cast<float>(q[j]) + m);
#endif
  }
}

template <typename T>
void dequant(const uint8_t* w, int t, int64_t row_bytes, const int64_t* rows, int n, int K, T* out) {
  pagedserve::parallel_for((n + ROWS_PER_INDEX - 1) / ROWS_PER_INDEX, [&](int64_t i) {
    const int r0 = static_cast<int>(i) * ROWS_PER_INDEX, r1 = std::min(n, r0 + ROWS_PER_INDEX);
    for (int r = r0; r < r1; ++r) {
      const int64_t src = rows != nullptr ? rows[r] : r;
      dequant_row(t, w + src * row_bytes, K, out + static_cast<int64_t>(r) * K);
    }
  });
}

bool supported(int t, int K) { return block_bytes(t) != 0 && K % block_weights(t) == 0 && K > 0; }
int64_t row_bytes_of(int t, int K) { return static_cast<int64_t>(K / block_weights(t)) * block_bytes(t); }

}  // namespace

// out[m, n] (row stride ldo) = sum_k x[m, k] * w[n, k], w given as N rows of row_bytes of blocks of type t.
// x is bf16 when is_bf16, out when out_bf16 (else fp32): bf16 activations may ask for fp32 outputs (logits).
extern "C" int qlinear(const void* x, const void* w, int t, int M, int N, int K, int64_t row_bytes, void* out,
                       int64_t ldo, int is_bf16, int out_bf16) {
  if (!supported(t, K) || M < 1 || N < 1 || row_bytes != row_bytes_of(t, K)) return 1;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* xb = static_cast<const uint16_t*>(x);
  const auto* xf = static_cast<const float*>(x);
  auto* ob = static_cast<uint16_t*>(out);
  auto* of = static_cast<float*>(out);
  if (is_bf16) return out_bf16 ? qlinear(xb, wb, t, M, N, K, row_bytes, ob, ldo) : qlinear(xb, wb, t, M, N, K, row_bytes, of, ldo);
  return out_bf16 ? qlinear(xf, wb, t, M, N, K, row_bytes, ob, ldo) : qlinear(xf, wb, t, M, N, K, row_bytes, of, ldo);
}

// out[r, :] = dequantized weight row rows[r] (rows null: row r), r < n.
extern "C" int qdequant(const void* w, int t, int64_t row_bytes, const int64_t* rows, int n, int K, void* out,
                        int is_bf16) {
  if (!supported(t, K) || n < 0 || row_bytes != row_bytes_of(t, K)) return 1;
  const auto* wb = static_cast<const uint8_t*>(w);
  if (is_bf16)
    dequant(wb, t, row_bytes, rows, n, K, static_cast<uint16_t*>(out));
  else
    dequant(wb, t, row_bytes, rows, n, K, static_cast<float*>(out));
  return 0;
}
