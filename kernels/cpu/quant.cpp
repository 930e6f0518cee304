// Linear layers and embedding rows straight from GGUF (ggml) quantized blocks, on CPU.
//
// Formats (32 weights per block, one block row after another for each output row, as a .gguf file stores
// them): Q4_0 {fp16 d; 16 bytes of nibbles}: w = d * (q - 8); Q4_1 {fp16 d, m; nibbles}: w = d * q + m;
// Q5_0 {fp16 d; 32 high bits; nibbles}: w = d * (q - 16); Q5_1 {fp16 d, m; high bits; nibbles}: w = d * q + m;
// Q8_0 {fp16 d; 32 int8}: w = d * q. Nibble byte j holds weight j (low) and weight j + 16 (high); high bit i
// of the 32-bit field belongs to weight i.
// K-quants: super-blocks of 256 weights in 8 sub-blocks of 32 (Q4_K, Q5_K: 6-bit scale and min per sub-block,
// packed in 12 bytes; w = d * sc * q - dmin * mn) or 16 sub-blocks of 16 (Q6_K: int8 scale; w = d * sc * (q - 32)).
// Q4_K {fp16 d, dmin; scales[12]; qs[128]}: bytes 32c..32c+31 hold sub-block 2c (low nibbles) and 2c+1 (high).
// Q5_K {fp16 d, dmin; scales[12]; qh[32]; qs[128]}: as Q4_K, plus bit j of qh[l] as bit 4 of weight l of
// sub-block j. Q6_K {ql[128]; qh[64]; int8 scales[16]; fp16 d}: per half n of 128 weights, ql[64n..] low
// nibbles then high nibbles give the low 4 bits of weights 0..63 then 64..127, qh[32n + l]'s bit pairs the top
// 2 bits of weights l, l + 32, l + 64, l + 96.
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

enum QType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's ids
constexpr int QK = 32;     // weights per block; also the input rows' quantization block
constexpr int QK_K = 256;  // weights per K-quant super-block

int block_bytes(int t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

bool is_k_quant(int t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
int block_weights(int t) { return is_k_quant(t) ? QK_K : QK; }

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

// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K super-block, from its 12 packed bytes.
void scale_min_k4(const uint8_t* q, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// A K-quant super-block as 256 integer weights, a scale per 16 weights and an offset per 32: w = scale * q + off.
// The scales are rounded as the gguf package rounds them (d * sc, then times q), so dequantization is exact.
void kblock_ints(int t, const uint8_t* b, int8_t* q, float* scale, float* off) {
  if (t == Q6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < 2; ++n, ql += 64, qh += 32, q += 128) {
      for (int l = 0; l < 32; ++l) {
        q[l] = static_cast<int8_t>(((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32);
        q[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32);
        q[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
        q[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
      }
    }
    for (int g = 0; g < 16; ++g) scale[g] = d * static_cast<float>(sc[g]);
    for (int j = 0; j < 8; ++j) off[j] = 0.0f;
    return;
  }
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* qs = b + (t == Q4_K ? 16 : 48);
  const uint8_t* qh = b + 16;  // Q5_K only
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(b + 4, j, &sc, &mn);
    scale[2 * j] = scale[2 * j + 1] = d * static_cast<float>(sc);
    off[j] = -(dmin * static_cast<float>(mn));
    const uint8_t* p = qs + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      int v = (j % 2 == 0) ? (p[l] & 0x0f) : (p[l] >> 4);
      if (t == Q5_K) v |= ((qh[l] >> j) & 1) << 4;
      q[32 * j + l] = static_cast<int8_t>(v);
    }
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

// bit j of each byte of v as 0x10.
inline __m256i bit_as_16(__m256i v, int j) {
  const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

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

// 32 consecutive weights of a block as signed bytes: w = d0 * q (first 16) or d1 * q (last 16), plus m.
struct Chunk {
  __m256i q;
  float d0, d1, m;
};

// The chunks of one block: 1 for the 32-weight formats, 8 for a K-quant super-block.
int decode_block(int t, const uint8_t* w, Chunk* c) {
  if (!is_k_quant(t)) {
    c->q = block_bytes_avx2(t, w, &c->d0, &c->m);
    c->d1 = c->d0;
    return 1;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0f), low2 = _mm256_set1_epi8(0x03);
  if (t == Q6_K) {
    const float d = half_at(w + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(w + 192);
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * n));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * n + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * n));
      const __m256i lows[4] = {_mm256_and_si256(l0, low4), _mm256_and_si256(l1, low4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), low4)};
      for (int k = 0; k < 4; ++k) {
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * k), low2), 4);
        const int b = 4 * n + k;  // sub-blocks 2b and 2b + 1
        c[b] = {_mm256_sub_epi8(_mm256_or_si256(lows[k], high), _mm256_set1_epi8(32)), d * sc[2 * b],
                d * sc[2 * b + 1], 0.0f};
      }
    }
    return 8;
  }
  const float d = half_at(w), dmin = half_at(w + 2);
  const uint8_t* qs = w + (t == Q4_K ? 16 : 48);
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));  // Q5_K's high bits
  for (int j = 0; j < 8; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j / 2)));
    __m256i q = _mm256_and_si256(j % 2 == 0 ? raw : _mm256_srli_epi16(raw, 4), low4);
    if (t == Q5_K) q = _mm256_or_si256(q, bit_as_16(qh, j));
    int sc, mn;
    scale_min_k4(w + 4, j, &sc, &mn);
    c[j] = {q, d * static_cast<float>(sc), d * static_cast<float>(sc), -(dmin * static_cast<float>(mn))};
  }
  return 8;
}

inline float hsum(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight row dotted with R quantized input rows: each block is decoded once for all R rows (the decode
// costs about as much as the integer products of one row). The products of 32 weights with the int16 inputs
// are exact in int32 (|q| <= 127, |qx| <= 32767); each chunk's sum is scaled once.
template <int R>
void dot_rows(int t, const uint8_t* w, const QRow* x, int K, float* out) {
  const int bb = block_bytes(t), nblocks = K / block_weights(t);
  __m256 acc[R];
  float offset[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    offset[r] = 0.0f;
  }
  Chunk chunks[8];
  for (int blk = 0, b = 0; blk < nblocks; ++blk, w += bb) {
    const int n = decode_block(t, w, chunks);
    for (int j = 0; j < n; ++j, ++b) {
      const Chunk& c = chunks[j];
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c.q));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c.q, 1));
      for (int r = 0; r < R; ++r) {
        const int16_t* qx = x[r].q.data() + 32 * b;
        const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx)));
        const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + 16)));
        const float xs = x[r].scale[b];
        if (c.d0 == c.d1) {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(c.d0 * xs), acc[r]);
        } else {
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(c.d0 * xs), acc[r]);
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(c.d1 * xs), acc[r]);
        }
        offset[r] += c.m * x[r].sum[b];
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

template <int R>
void dot_rows(int t, const uint8_t* w, const QRow* x, int K, float* out) {
  for (int r = 0; r < R; ++r)
    out[r] = is_k_quant(t) ? dot_row_k(t, w, x[r], K / QK_K) : dot_row(t, w, x[r], K / QK);
}
#endif

constexpr int ROWS_PER_INDEX = 16;  // weight rows per pool index

// Rows of input processed together against each weight row: one block decode serves all of them.
constexpr int ROWS_PER_DECODE = 4;

template <typename T, typename O>
int qlinear(const T* x, const uint8_t* w, int t, int M, int N, int K, int64_t row_bytes, O* out, int64_t ldo) {
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
        switch (R) {
          case 4: dot_rows<4>(t, row, &qx[m0], K, res); break;
          case 3: dot_rows<3>(t, row, &qx[m0], K, res); break;
          case 2: dot_rows<2>(t, row, &qx[m0], K, res); break;
          default: dot_rows<1>(t, row, &qx[m0], K, res); break;
        }
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
