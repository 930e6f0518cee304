// GGUF blocks of every format the kernel computes with, interleaved across 16 weight rows: the layout the
// tiles of quant.cpp (int16 inputs) and quant_tiles.cpp (int8 inputs) are unpacked from with a few vector
// operations per 16 x 4 weights, where the file's layout (each row's blocks in a row) needs a per-row block
// decode and a transpose by gathers.
//
// qinterleave (quant.cpp) rearranges a weight of N rows (N a multiple of 16) at load, in place (the same
// bytes, moved; tests/test_quantized.py holds an independent torch version of the layout): rows 16g..16g+15
// hold group g, which holds for each block column c, in 16 * block_bytes bytes, each field of the block for
// the 16 rows together (Fields): the fp16 fields (d; Q4_1/Q5_1's m; Q4_K/Q5_K's d and dmin), 16 at a time,
// then the K-quants' scale bytes, byte i of the 16 rows together, then the quantized bytes (Q5's and Q5_K's
// high bits, Q6_K's ql and qh included) as 32-bit words, word j of rows 0..15 together (64 bytes). Word j
// holds the file's bytes 4j..4j+3 of that part, so its weights are the file's: e.g. a Q4_0 word j holds
// weights 4j..4j+3 in its low nibbles and 16+4j..16+4j+3 in its high ones. Type ids with the INTERLEAVED flag
// name this layout.
#pragma once
#include <cstdint>

#include "quant_blocks.h"

namespace {

constexpr int INTERLEAVED = 256;  // type id flag: the blocks are interleaved across 16 rows
constexpr int GROUP_ROWS = 16;

constexpr bool interleavable(int t) { return block_bytes(t) != 0; }  // every format the kernel computes with

// A block's bytes by kind: [h0, h1) fp16 fields, [b0, b1) one-byte fields, [w0, w1) quantized bytes, read as
// 32-bit words. In a block column they come in that order, each field of the 16 rows together.
struct Fields {
  int h0, h1, b0, b1, w0, w1;
};
constexpr Fields fields_of(int t) {
  switch (t) {
    case Q4_1: return {0, 4, 4, 4, 4, 20};
    case Q5_0: return {0, 2, 2, 2, 2, 22};      // d; qh, qs
    case Q5_1: return {0, 4, 4, 4, 4, 24};      // d, m; qh, qs
    case Q8_0: return {0, 2, 2, 2, 2, 34};
    case Q4_K: return {0, 4, 4, 16, 16, 144};   // d, dmin; 12 packed scale bytes; qs
    case Q5_K: return {0, 4, 4, 16, 16, 176};   // d, dmin; 12 packed scale bytes; qh, qs
    case Q6_K: return {208, 210, 192, 208, 0, 192};  // d; 16 int8 scales; ql, qh
    default: return {0, 2, 2, 2, 2, 18};        // Q4_0
  }
}
constexpr int quant_words_at(int t) {
  return 16 * (fields_of(t).h1 - fields_of(t).h0) + 16 * (fields_of(t).b1 - fields_of(t).b0);
}
constexpr int byte_fields_at(int t) { return 16 * (fields_of(t).h1 - fields_of(t).h0); }

// Where byte i of row r's block lands in its block column.
constexpr int interleaved_offset(int t, int i, int r) {
  const Fields f = fields_of(t);
  if (i >= f.h0 && i < f.h1) return 16 * ((i - f.h0) & ~1) + 2 * r + (i - f.h0) % 2;
  if (i >= f.b0 && i < f.b1) return byte_fields_at(t) + 16 * (i - f.b0) + r;
  return quant_words_at(t) + 64 * ((i - f.w0) / 4) + 4 * r + (i - f.w0) % 4;
}

// Row `lane` (0..15) of a group's block column as the file stores the block: the layout's scalar reading.
[[maybe_unused]] void deinterleave_block(int t, const uint8_t* col, int lane, uint8_t* block) {
  for (int i = 0; i < block_bytes(t); ++i) block[i] = col[interleaved_offset(t, i, lane)];
}

// The file's 16 rows of a group (row r at rows + r * row_bytes) written into `group` interleaved: each field
// copied whole (2, 1 or 4 bytes).
[[maybe_unused]] void interleave_group(int t, const uint8_t* rows, int64_t row_bytes, uint8_t* group) {
  const int bb = block_bytes(t);
  const Fields f = fields_of(t);
  for (int64_t c = 0; c < row_bytes / bb; ++c) {
    uint8_t* col = group + c * GROUP_ROWS * bb;
    for (int r = 0; r < GROUP_ROWS; ++r) {
      const uint8_t* b = rows + r * row_bytes + c * bb;
      for (int i = f.h0; i < f.h1; i += 2) std::memcpy(col + interleaved_offset(t, i, r), b + i, 2);
      for (int i = f.b0; i < f.b1; ++i) col[interleaved_offset(t, i, r)] = b[i];
      for (int i = f.w0; i < f.w1; i += 4) std::memcpy(col + interleaved_offset(t, i, r), b + i, 4);
    }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
// quads[p], p = 0..7: weights 4p..4p+3 of the 16 rows (4 signed bytes per row, offset removed) of chunk c (32
// weights) of a group: what quant_tiles.cpp's int8 tiles hold; with the chunk's 16 scales (d0: weights 0..15,
// d1: 16..31, different for Q6_K only) and offsets m (w = d * q + m), rounded as decode_block (quant_blocks.h)
// rounds them.
template <int T>
inline void interleaved_chunk(const uint8_t* group, int c, __m512i* quads, __m512* d0, __m512* d1, __m512* m) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const auto byte_field = [](const uint8_t* col, int i) {  // byte field i of the 16 rows
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + byte_fields_at(T) + 16 * i));
  };
  if constexpr (T == Q6_K) {
    // chunk c = 4n + k: weights 32k..32k+31 of half n; low 4 bits from ql (k = 0, 1: low nibbles of words 16n +
    // 8k + p; k = 2, 3: high nibbles of words 16n + 8(k - 2) + p), top 2 bits from bits 2k, 2k+1 of qh word
    // 32 + 8n + p
    const uint8_t* col = group + static_cast<int64_t>(c / 8) * GROUP_ROWS * block_bytes(T);
    const int n = (c % 8) / 4, k = c % 4;
    const uint8_t* words = col + quant_words_at(T);
    const __m512i low2 = _mm512_set1_epi8(0x03);
    for (int p = 0; p < 8; ++p) {
      const __m512i ql = _mm512_loadu_si512(words + 64 * (16 * n + 8 * (k % 2) + p));
      const __m512i qh = _mm512_loadu_si512(words + 64 * (32 + 8 * n + p));
      const __m512i lo = _mm512_and_si512(k < 2 ? ql : _mm512_srli_epi16(ql, 4), low4);
      const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 2 * k), low2), 4);
      quads[p] = _mm512_sub_epi8(_mm512_or_si512(lo, hi), _mm512_set1_epi8(32));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col)));
    const int b = c % 8;  // sub-blocks 2b and 2b + 1 of 16 weights
    *d0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(byte_field(col, 2 * b))));
    *d1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(byte_field(col, 2 * b + 1))));
    *m = _mm512_setzero_ps();
    return;
  }
  if constexpr (T == Q4_K || T == Q5_K) {
    // sub-block j: nibbles of qs words 8(j / 2) + p (low for even j); Q5_K's fifth bits: bit j of qh word p
    const uint8_t* col = group + static_cast<int64_t>(c / 8) * GROUP_ROWS * block_bytes(T);
    const int j = c % 8;
    const uint8_t* qh = col + quant_words_at(T);
    const uint8_t* words = qh + 64 * ((T == Q5_K ? 8 : 0) + 8 * (j / 2));
    for (int p = 0; p < 8; ++p) {
      const __m512i v = _mm512_loadu_si512(words + 64 * p);
      quads[p] = _mm512_and_si512(j % 2 == 0 ? v : _mm512_srli_epi16(v, 4), low4);
      if constexpr (T == Q5_K) {
        const __m512i h = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(qh + 64 * p), j), _mm512_set1_epi8(1));
        quads[p] = _mm512_or_si512(quads[p], _mm512_slli_epi16(h, 4));
      }
    }
    // scale_min_k4 for the 16 rows at once
    const __m128i six = _mm_set1_epi8(63), four = _mm_set1_epi8(0x0f);
    const auto top2 = [](__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 6), _mm_set1_epi8(3)); };
    __m128i sc, mn;
    if (j < 4) {
      sc = _mm_and_si128(byte_field(col, j), six);
      mn = _mm_and_si128(byte_field(col, j + 4), six);
    } else {
      const __m128i b = byte_field(col, j + 4);
      sc = _mm_or_si128(_mm_and_si128(b, four), _mm_slli_epi16(top2(byte_field(col, j - 4)), 4));
      mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), four), _mm_slli_epi16(top2(byte_field(col, j)), 4));
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + 32)));
    *d0 = *d1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    *m = _mm512_xor_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))), _mm512_set1_ps(-0.0f));
    return;
  }
  const uint8_t* col = group + static_cast<int64_t>(c) * GROUP_ROWS * block_bytes(T);
  *d0 = *d1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col)));
  *m = T == Q4_1 || T == Q5_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + 32))) : _mm512_setzero_ps();
  const uint8_t* words = col + quant_words_at(T);
  if constexpr (T == Q8_0) {
    for (int p = 0; p < 8; ++p) quads[p] = _mm512_loadu_si512(words + 64 * p);
    return;
  }
  constexpr bool five = T == Q5_0 || T == Q5_1;
  const __m512i qh = five ? _mm512_loadu_si512(words) : _mm512_setzero_si512();
  // bits s..s+3 of each row's qh as 0x10 in its bytes 0..3 (the multiply moves bit k to bit 8k)
  const auto fifth = [qh](int s) {
    const __m512i bits = _mm512_and_si512(_mm512_srli_epi32(qh, s), _mm512_set1_epi32(0x0f));
    const __m512i spread = _mm512_mullo_epi32(bits, _mm512_set1_epi32(0x00204081));
    return _mm512_slli_epi32(_mm512_and_si512(spread, _mm512_set1_epi32(0x01010101)), 4);
  };
  constexpr int offset = T == Q4_0 ? 8 : T == Q5_0 ? 16 : 0;
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(words + 64 * (five + j));
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (five) {
      lo = _mm512_or_si512(lo, fifth(4 * j));
      hi = _mm512_or_si512(hi, fifth(16 + 4 * j));
    }
    if constexpr (offset != 0) {
      lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(offset));
      hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(offset));
    }
    quads[j] = lo;
    quads[j + 4] = hi;
  }
}

// pairs[2p], pairs[2p + 1]: weights (4p, 4p+1) and (4p+2, 4p+3) of the 16 rows as int16 pairs, from quads[p]:
// what quant.cpp's int16 tiles hold. Each 256-bit half widens to 8 rows x 4 int16; the even and odd 32-bit
// lanes of the two halves are the pairs.
inline void quads_to_pairs(const __m512i* quads, __m512i* pairs) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int p = 0; p < 8; ++p) {
    const __m512i a = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(quads[p]));
    const __m512i b = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(quads[p], 1));
    pairs[2 * p] = _mm512_permutex2var_epi32(a, even, b);
    pairs[2 * p + 1] = _mm512_permutex2var_epi32(a, odd, b);
  }
}
#endif

}  // namespace
