// Linear layers and embedding rows straight from GGUF (ggml) quantized blocks, on CPU.
//
// Formats (32 weights per block, one block row after another for each output row, as a .gguf file stores
// them): Q4_0 {fp16 d; 16 bytes of nibbles}: w = d * (q - 8); Q4_1 {fp16 d, m; nibbles}: w = d * q + m;
// Q5_0 {fp16 d; 32 high bits; nibbles}: w = d * (q - 16); Q5_1 {fp16 d, m; high bits; nibbles}: w = d * q + m;
// Q8_0 {fp16 d; 32 int8}: w = d * q. Nibble byte j holds weight j (low) and weight j + 16 (high); high bit i
// of the 32-bit field belongs to weight i.
//
// Decode (a few input rows): each input row is quantized once per call to int16 blocks of 32 (scale =
// max|x| / 32767), then every weight block is dotted with it in integers (AVX2 madd: 16 products per
// instruction) and scaled once per block. int16, not llama.cpp's int8 activations: with int8 the rounding
// of the hidden state in SmolLM2's LM head alone moved a logit by ~0.1 and flipped the README's greedy
// answer; int16 is ~256x closer to the float product for about one more instruction per 16 weights. The weights are read once, in their
// 4.5-5 bits: that read is what a one-stream decode step waits on. Larger inputs (prefill) dequantize the
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
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum QType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8 };  // ggml's type ids
constexpr int QK = 32;

int block_bytes(int t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    default: return 0;
  }
}

#if !defined(__F16C__)
float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while ((man & 0x400u) == 0);
    bits = sign | static_cast<uint32_t>(112 - e) << 23 | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
#endif

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return fp16_to_fp32(h);
#endif
}

// The 32 integer weights of one block (before scale and offset), their scale d and offset m (w = d*q + m).
[[maybe_unused]] void block_ints(int t, const uint8_t* b, int8_t* q, float* d, float* m) {
  *d = half_at(b);
  *m = 0.0f;
  if (t == Q8_0) {
    std::memcpy(q, b + 2, QK);
    return;
  }
  const bool has_m = t == Q4_1 || t == Q5_1, five = t == Q5_0 || t == Q5_1;
  if (has_m) *m = half_at(b + 2);
  const uint8_t* p = b + (has_m ? 4 : 2);
  uint32_t qh = 0;
  if (five) {
    std::memcpy(&qh, p, 4);
    p += 4;
  }
  const int offset = has_m ? 0 : (five ? 16 : 8);
  for (int j = 0; j < 16; ++j) {
    int lo = p[j] & 0x0f, hi = p[j] >> 4;
    if (five) {
      lo |= ((qh >> j) & 1u) << 4;
      hi |= ((qh >> (j + 16)) & 1u) << 4;
    }
    q[j] = static_cast<int8_t>(lo - offset);
    q[j + 16] = static_cast<int8_t>(hi - offset);
  }
}

// One input row as int16 blocks: qx[K], a scale per block, the int sum of each block's qx (Q4_0/Q5_0
// subtract 8 or 16 times it) and that sum times the scale (the offset m of Q4_1/Q5_1 multiplies it). The
// quantized sum, not the exact one: then m's term and the product with unsigned q share one rounding of x and
// cancel as the weights d*q + m do, instead of leaving x's rounding error times the mean of q.
struct QRow {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
  std::vector<int32_t> isum;
};

template <typename T>
void quantize_row(const T* x, int K, QRow& r) {
  const int nb = K / QK;
  r.q.resize(K);
  r.scale.resize(nb);
  r.sum.resize(nb);
  r.isum.resize(nb);
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
    r.isum[b] = is;
  }
}

#if defined(__AVX2__)
// 32 unsigned nibble values (weights 0..15, in order) from 16 bytes.
inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(0x0f));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0f));
  return _mm256_set_m128i(hi, lo);
}

// 0x10 in byte i where bit i of the 32-bit field is set.
inline __m256i high_bits(const uint8_t* p) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(qh)),
      _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// sum over the block of 32 weights (bytes, in order; unsigned or signed) times the int16 qx, as 8 int32 lanes.
template <bool SIGNED>
inline __m256i dot_block(__m256i w, const int16_t* qx) {
  const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
  const __m256i w0 = SIGNED ? _mm256_cvtepi8_epi16(lo) : _mm256_cvtepu8_epi16(lo);
  const __m256i w1 = SIGNED ? _mm256_cvtepi8_epi16(hi) : _mm256_cvtepu8_epi16(hi);
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
}

// One weight row (nb blocks) dotted with one quantized input row.
float dot_row(int t, const uint8_t* w, const QRow& x, int nb) {
  const int bb = block_bytes(t);
  __m256 acc = _mm256_setzero_ps();
  float offset_sum = 0.0f;  // sum of m * sum(x) (Q4_1, Q5_1)
  for (int b = 0; b < nb; ++b, w += bb) {
    const int16_t* qx = x.q.data() + b * QK;
    const float d = half_at(w) * x.scale[b];
    __m256i dot;
    switch (t) {
      case Q8_0: {
        dot = dot_block<true>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2)), qx);
        break;
      }
      case Q4_0:
        dot = dot_block<false>(nibbles(w + 2), qx);
        dot = _mm256_sub_epi32(dot, _mm256_setr_epi32(8 * x.isum[b], 0, 0, 0, 0, 0, 0, 0));
        break;
      case Q4_1:
        dot = dot_block<false>(nibbles(w + 4), qx);
        offset_sum += half_at(w + 2) * x.sum[b];
        break;
      case Q5_0:
        dot = dot_block<false>(_mm256_or_si256(nibbles(w + 6), high_bits(w + 2)), qx);
        dot = _mm256_sub_epi32(dot, _mm256_setr_epi32(16 * x.isum[b], 0, 0, 0, 0, 0, 0, 0));
        break;
      default:  // Q5_1
        dot = dot_block<false>(_mm256_or_si256(nibbles(w + 8), high_bits(w + 4)), qx);
        offset_sum += half_at(w + 2) * x.sum[b];
        break;
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d), acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s) + offset_sum;
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
#endif

constexpr int ROWS_PER_INDEX = 16;  // weight rows per pool index

template <typename T>
int qlinear(const T* x, const uint8_t* w, int t, int M, int N, int K, int64_t row_bytes, T* out, int64_t ldo) {
  const int nb = K / QK;
  std::vector<QRow> qx(M);
  for (int m = 0; m < M; ++m) quantize_row(x + static_cast<int64_t>(m) * K, K, qx[m]);
  pagedserve::parallel_for((N + ROWS_PER_INDEX - 1) / ROWS_PER_INDEX, [&](int64_t i) {
    const int n0 = static_cast<int>(i) * ROWS_PER_INDEX, n1 = std::min(N, n0 + ROWS_PER_INDEX);
    for (int n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      for (int m = 0; m < M; ++m) pagedserve::store(out + m * ldo + n, dot_row(t, row, qx[m], nb));
    }
  });
  return 0;
}

#if defined(__AVX2__)
// The block's 32 integer weights (offset removed) as bytes, with its scale d and offset m.
inline __m256i block_bytes_avx2(int t, const uint8_t* w, float* d, float* m) {
  *d = half_at(w);
  *m = (t == Q4_1 || t == Q5_1) ? half_at(w + 2) : 0.0f;
  switch (t) {
    case Q8_0: return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    case Q4_0: return _mm256_sub_epi8(nibbles(w + 2), _mm256_set1_epi8(8));
    case Q4_1: return nibbles(w + 4);
    case Q5_0: return _mm256_sub_epi8(_mm256_or_si256(nibbles(w + 6), high_bits(w + 2)), _mm256_set1_epi8(16));
    default: return _mm256_or_si256(nibbles(w + 8), high_bits(w + 4));  // Q5_1
  }
}

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

bool supported(int t, int K) { return block_bytes(t) != 0 && K % QK == 0 && K > 0; }

}  // namespace

// out[m, n] (row stride ldo) = sum_k x[m, k] * w[n, k], w given as N rows of row_bytes of blocks of type t.
extern "C" int qlinear(const void* x, const void* w, int t, int M, int N, int K, int64_t row_bytes, void* out,
                       int64_t ldo, int is_bf16) {
  if (!supported(t, K) || M < 1 || N < 1 || row_bytes != static_cast<int64_t>(K / QK) * block_bytes(t)) return 1;
  const auto* wb = static_cast<const uint8_t*>(w);
  if (is_bf16)
    return qlinear(static_cast<const uint16_t*>(x), wb, t, M, N, K, row_bytes, static_cast<uint16_t*>(out), ldo);
  return qlinear(static_cast<const float*>(x), wb, t, M, N, K, row_bytes, static_cast<float*>(out), ldo);
}

// out[r, :] = dequantized weight row rows[r] (rows null: row r), r < n.
extern "C" int qdequant(const void* w, int t, int64_t row_bytes, const int64_t* rows, int n, int K, void* out,
                        int is_bf16) {
  if (!supported(t, K) || n < 0 || row_bytes != static_cast<int64_t>(K / QK) * block_bytes(t)) return 1;
  const auto* wb = static_cast<const uint8_t*>(w);
  if (is_bf16)
    dequant(wb, t, row_bytes, rows, n, K, static_cast<uint16_t*>(out));
  else
    dequant(wb, t, row_bytes, rows, n, K, static_cast<float*>(out));
  return 0;
}
