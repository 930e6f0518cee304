// Q4_0, Q4_1 and Q8_0 blocks interleaved across 16 weight rows: the layout the tiles of quant.cpp (int16
// inputs) and quant_tiles.cpp (int8 inputs) are unpacked from with a few vector operations per 16 x 4
// weights, where the file's layout (each row's blocks in a row) needs a transpose by gathers.
//
// qinterleave (quant.cpp) rearranges a weight of N rows (N a multiple of 16) at load, in place (the same
// bytes, moved; tests/test_quantized.py holds an independent torch version of the layout): rows 16g..16g+15 hold group g, which holds for each block
// column c, in 16 * block_bytes bytes: the 16 rows' fp16 scales d, then (Q4_1) their fp16 offsets m, then the
// rows' quantized bytes as 32-bit words, word j of rows 0..15 together (64 bytes). A Q4 word j holds weights
// 4j..4j+3 in its low nibbles and 16+4j..16+4j+3 in its high ones (the file's nibble order); a Q8_0 word j
// holds weights 4j..4j+3. Type ids with the INTERLEAVED flag name this layout.
#pragma once
#include <cstdint>

#include "quant_blocks.h"

namespace {

constexpr int INTERLEAVED = 256;  // type id flag: the blocks are interleaved across 16 rows
constexpr int GROUP_ROWS = 16;

constexpr bool interleavable(int t) { return t == Q4_0 || t == Q4_1 || t == Q8_0; }
constexpr int quant_words_at(int t) { return t == Q4_1 ? 64 : 32; }  // after the 16 d (and 16 m)

// Row `lane` (0..15) of a group's block column as 32 integer weights (offset removed), its d and m: the
// layout's scalar reading (dequantization).
[[maybe_unused]] void interleaved_block_ints(int t, const uint8_t* col, int lane, int8_t* q, float* d, float* m) {
  *d = half_at(col + 2 * lane);
  *m = t == Q4_1 ? half_at(col + 32 + 2 * lane) : 0.0f;
  const uint8_t* words = col + quant_words_at(t) + 4 * lane;
  if (t == Q8_0) {
    for (int j = 0; j < 8; ++j) std::memcpy(q + 4 * j, words + 64 * j, 4);
    return;
  }
  const int offset = t == Q4_0 ? 8 : 0;
  for (int j = 0; j < 4; ++j)
    for (int k = 0; k < 4; ++k) {
      const uint8_t b = words[64 * j + k];
      q[4 * j + k] = static_cast<int8_t>((b & 0x0f) - offset);
      q[16 + 4 * j + k] = static_cast<int8_t>((b >> 4) - offset);
    }
}

// The file's 16 rows of a group (row r at rows + r * row_bytes) written into `group` interleaved.
[[maybe_unused]] void interleave_group(int t, const uint8_t* rows, int64_t row_bytes, uint8_t* group) {
  const int bb = block_bytes(t), head = t == Q4_1 ? 4 : 2, words = (bb - head) / 4;
  for (int64_t c = 0; c < row_bytes / bb; ++c) {
    uint8_t* col = group + c * GROUP_ROWS * bb;
    for (int r = 0; r < GROUP_ROWS; ++r) {
      const uint8_t* b = rows + r * row_bytes + c * bb;
      std::memcpy(col + 2 * r, b, 2);                                  // d
      if (t == Q4_1) std::memcpy(col + 32 + 2 * r, b + 2, 2);          // m
      for (int j = 0; j < words; ++j) std::memcpy(col + quant_words_at(t) + 64 * j + 4 * r, b + head + 4 * j, 4);
    }
  }
}

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
// The 16 rows' scales and offsets of a block column.
inline __m512 interleaved_d(const uint8_t* col) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col)));
}
inline __m512 interleaved_m(int t, const uint8_t* col) {
  return t == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + 32)))
                   : _mm512_setzero_ps();
}

// quads[p], p = 0..7: weights 4p..4p+3 of the 16 rows (4 signed bytes per row, offset removed) of a block
// column: what quant_tiles.cpp's int8 tiles hold.
template <int T>
inline void interleaved_quads(const uint8_t* col, __m512i* quads) {
  const uint8_t* words = col + quant_words_at(T);
  if constexpr (T == Q8_0) {
    for (int p = 0; p < 8; ++p) quads[p] = _mm512_loadu_si512(words + 64 * p);
    return;
  }
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(words + 64 * j);
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    if constexpr (T == Q4_0) {
      lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(8));
      hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(8));
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
