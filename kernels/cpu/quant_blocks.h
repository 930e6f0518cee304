// GGUF (ggml) block formats: their layouts, and unpacking them into integer weights with scales and offsets
// (scalar, and AVX2 for the kernel's inner loop). Included by quant.cpp only.
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
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>
#include <new>
#include <vector>

#include "dtypes.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

// std::vector storage on 64-byte boundaries (malloc gives 16): the tiles are written and read in 64-byte
// vectors, and one that straddles two cache lines costs two accesses.
template <typename T>
struct CacheAligned {
  using value_type = T;
  CacheAligned() = default;
  template <typename U>
  CacheAligned(const CacheAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheAligned<U>&) const { return false; }
};
template <typename T>
using aligned_vector = std::vector<T, CacheAligned<T>>;

enum QType { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };  // ggml's ids
constexpr int QK = 32;     // weights per block; also the input rows' quantization block
constexpr int QK_K = 256;  // weights per K-quant super-block

constexpr int block_bytes(int t) {
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

constexpr bool is_k_quant(int t) { return t == Q4_K || t == Q5_K || t == Q6_K; }
constexpr int block_weights(int t) { return is_k_quant(t) ? QK_K : QK; }

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

// The sums of lanes 0..3 and 4..7 of v (the products with weights 0..15 and 16..31 of a chunk).
inline void hsum_halves(__m256i v, int32_t* lo, int32_t* hi) {
  const __m128i a = _mm256_castsi256_si128(v), b = _mm256_extracti128_si256(v, 1);
  const __m128i pairs = _mm_hadd_epi32(a, b);     // a0+a1, a2+a3, b0+b1, b2+b3
  const __m128i quads = _mm_hadd_epi32(pairs, pairs);
  *lo = _mm_cvtsi128_si32(quads);
  *hi = _mm_extract_epi32(quads, 1);
}

// A chunk's exact integer product with one input row, scaled into a row's running sum as the tiles of
// quant.cpp and quant_tiles.cpp scale it into each output (the same float operations in the same order), so
// an output does not depend on how many rows share its step: acc + (lo * d0 [+ hi * d1]) * xs, then + m * xsum.
template <bool split, bool has_offset>
inline float scale_chunk(float acc, int32_t lo, int32_t hi, float d0, float d1, float m, float xs, float xsum) {
  if constexpr (split) {
    acc = std::fma(static_cast<float>(lo) * d0, xs, acc);
    acc = std::fma(static_cast<float>(hi) * d1, xs, acc);
  } else {
    acc = std::fma(static_cast<float>(lo + hi) * d0, xs, acc);
  }
  if constexpr (has_offset) acc = std::fma(m, xsum, acc);
  return acc;
}

// The block's 32 integer weights (offset removed) as bytes, with its scale d and offset m.
inline __attribute__((always_inline)) __m256i block_bytes_avx2(int t, const uint8_t* w, float* d, float* m) {
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
inline __attribute__((always_inline)) int decode_block(int t, const uint8_t* w, Chunk* c) {
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

#endif  // __AVX2__

#if defined(__AVX512BW__) && defined(__AVX512DQ__)
// The block's 32 integer weights (offset removed) as int16 lanes in order, with its scale d and offset m: the
// nibbles are widened once and shifted per half (weights 0..15 low nibbles, 16..31 high), the fifth bits
// added through a mask register.
inline __attribute__((always_inline)) __m512i block_i16_avx512(int t, const uint8_t* w, float* d, float* m) {
  *d = half_at(w);
  *m = (t == Q4_1 || t == Q5_1) ? half_at(w + 2) : 0.0f;
  if (t == Q8_0) return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2)));
  const int nib = t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8;
  const __m512i both = _mm512_cvtepu8_epi16(
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + nib))));
  const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  __m512i q = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi16(0x0f));
  if (t == Q5_0 || t == Q5_1) {
    uint32_t qh;
    std::memcpy(&qh, w + nib - 4, 4);
    q = _mm512_mask_add_epi16(q, static_cast<__mmask32>(qh), q, _mm512_set1_epi16(16));
  }
  if (t == Q4_0) q = _mm512_sub_epi16(q, _mm512_set1_epi16(8));
  if (t == Q5_0) q = _mm512_sub_epi16(q, _mm512_set1_epi16(16));
  return q;
}

constexpr int TILE_N = 16;  // weight rows per tile (quant.cpp's int16 tiles, quant_tiles.cpp's int8 tiles)

// A tile's 16 outputs of one input row, n <= 16 of them valid.
inline void store16(float* out, __m512 v, int n) {
  if (n == TILE_N) _mm512_storeu_ps(out, v);
  else _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1), v);
}
inline void store16(uint16_t* out, __m512 v, int n) {
  alignas(64) float f[TILE_N];
  _mm512_store_ps(f, v);
  for (int i = 0; i < n; ++i) pagedserve::store(out + i, f[i]);
}
#endif  // __AVX512BW__

}  // namespace
