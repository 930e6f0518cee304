// Linear layers from GGUF blocks with int8 inputs (AVX-512 VNNI): int8 weights, vpdpbusd (64 multiply-adds per
// 512-bit instruction, twice the int16 dpwssd and bf16 dpbf16ps rates). Many rows (prefill, decode batches) by
// tiles; a few rows by dot products, except from interleaved blocks (quant_x16.h): those take the tiles, and up
// to 4 rows the same products straight from registers (group_rows).
//
// Inputs are quantized as llama.cpp quantizes them: per block of 32, scale = max|x| / 127, round to nearest.
// They are stored biased (q + 128, unsigned: vpdpbusd multiplies unsigned by signed bytes), and each weight
// chunk's 128 * sum(w) is subtracted from the int32 sums, so they are the exact products of the signed values.
// The weights are unpacked tile by tile, 16 weight rows at a time, into int8 quads interleaved across the 16
// rows (one 512-bit vector holds weights k..k+3 of every row: what one vpdpbusd multiplies with an input row's
// quad k..k+3 broadcast). The tile (K/4 vectors, the chunks' scales, offsets and weight sums as vectors over its
// 16 rows) stays in L1/L2 and serves every input row: per 32 weights x 16 outputs a row costs 8 vpdpbusd and
// one float scale. Fewer rows (decode) take dot products with the same int8 inputs (one 256-bit vpdpbusd per
// 32 weights and row), so a row's rounding does not depend on how many rows share its step (a prompt prefilled
// whole and one continued from a cached prefix agree).
#include "quant_tiles.h"

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "pool.h"
#include "quant_blocks.h"
#include "quant_x16.h"
#include "vec_math.h"

namespace {

constexpr int TILE_RM = 8;   // input rows per pass over the tile (their sums stay in registers)
constexpr int QUADS = QK / 4;

// Input rows as biased int8 blocks: q[m][K] = round(x / scale) + 128, a scale per block, and per block the
// scale times the sum of the rounded (unbiased) values, for the weight offsets m of Q4_1/Q5_1/Q4_K/Q5_K.
struct Inputs {
  int K = 0;
  std::vector<uint8_t> q;
  std::vector<float> scale, sum;
  const uint8_t* row(int m) const { return q.data() + static_cast<size_t>(m) * K; }
};


template <typename T>
void quantize_row(const T* x, int K, uint8_t* q, float* scale, float* sum) {
  for (int b = 0; b < K / QK; ++b) {
    const __m512 v0 = load16(x + b * QK), v1 = load16(x + b * QK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    const __m512i bias = _mm512_set1_epi32(128);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK), _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, bias)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * QK + 16), _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, bias)));
    scale[b] = d;
    sum[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

template <typename T>
void quantize_inputs(const T* x, int M, int K, Inputs& in) {
  const int nb = K / QK;
  in.K = K;
  in.q.resize(static_cast<size_t>(M) * K);
  in.scale.resize(static_cast<size_t>(M) * nb);
  in.sum.resize(in.scale.size());
  auto one = [&](int64_t m) {
    quantize_row(x + m * K, K, in.q.data() + m * K, in.scale.data() + m * nb, in.sum.data() + m * nb);
  };
  if (M >= 32) pagedserve::parallel_for(M, one);  // prefill-sized inputs: rows shared out like the products
  else for (int m = 0; m < M; ++m) one(m);
}

struct Tile {
  aligned_vector<int32_t> wq;    // [chunk][quad][16 rows]: 4 int8 weights each
  aligned_vector<float> d0, d1, m;  // [chunk][16 rows]: scale of weights 0..15 / 16..31 of the chunk, offset
  aligned_vector<int32_t> wsum;  // [chunk][half][16 rows]: 128 * the sum of the half-chunk's integer weights
};

// 128 * (sum of weights 0..15, sum of weights 16..31) of a chunk of 32 signed bytes.
inline void half_sums(__m256i q, int32_t* lo, int32_t* hi) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
  const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));  // lanes 0..3: weights 0..15
  alignas(32) int32_t s[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(s), quads);
  *lo = 128 * (s[0] + s[1] + s[2] + s[3]);
  *hi = 128 * (s[4] + s[5] + s[6] + s[7]);
}

// Weight rows n0..n0+rows-1 (rows <= 16; the rest zero) unpacked into the tile.
template <int T>
void pack_tile(const uint8_t* w, int64_t row_bytes, int n0, int rows, int K, Tile& tile) {
  constexpr int bb = block_bytes(T), per_block = block_weights(T) / QK;
  const size_t nchunks = K / QK;
  tile.wq.resize(nchunks * QUADS * TILE_N);
  tile.d0.assign(nchunks * TILE_N, 0.0f);
  tile.d1.assign(nchunks * TILE_N, 0.0f);
  tile.m.assign(nchunks * TILE_N, 0.0f);
  tile.wsum.assign(nchunks * 2 * TILE_N, 0);
  alignas(64) int8_t tmp[per_block][TILE_N][QK];
  std::memset(tmp, 0, sizeof(tmp));
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(QUADS));
  for (int blk = 0; blk < K / block_weights(T); ++blk) {
    const int c0 = blk * per_block;
    for (int n = 0; n < rows; ++n) {
      Chunk chunks[per_block];
      decode_block(T, w + (n0 + n) * row_bytes + static_cast<int64_t>(blk) * bb, chunks);
      for (int j = 0; j < per_block; ++j) {
        const size_t at = static_cast<size_t>(c0 + j) * TILE_N + n;
        _mm256_store_si256(reinterpret_cast<__m256i*>(tmp[j][n]), chunks[j].q);
        tile.d0[at] = chunks[j].d0;
        tile.d1[at] = chunks[j].d1;
        tile.m[at] = chunks[j].m;
        const size_t ws = static_cast<size_t>(c0 + j) * 2 * TILE_N + n;
        half_sums(chunks[j].q, &tile.wsum[ws], &tile.wsum[ws + TILE_N]);
      }
    }
    for (int j = 0; j < per_block; ++j) {
      int32_t* dst = tile.wq.data() + static_cast<size_t>(c0 + j) * QUADS * TILE_N;
      for (int p = 0; p < QUADS; ++p)  // quad p of every row: a transpose of the 16 x 8 int32 quads
        _mm512_storeu_si512(dst + p * TILE_N,
                            _mm512_i32gather_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(p)), tmp[j], 4));
    }
  }
}

// The 16 weight rows of an interleaved group (quant_x16.h) unpacked into the tile: no transpose left to do;
// each row's half-chunk weight sums by vpdpbusd with ones.
template <int T>
void pack_tile_interleaved(const uint8_t* group, int K, Tile& tile) {
  const size_t nchunks = K / QK;
  tile.wq.resize(nchunks * QUADS * TILE_N);
  tile.d0.resize(nchunks * TILE_N);
  tile.d1.resize(nchunks * TILE_N);
  tile.m.resize(nchunks * TILE_N);
  tile.wsum.resize(nchunks * 2 * TILE_N);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i quads[QUADS];
  for (size_t c = 0; c < nchunks; ++c) {
    __m512 d0, d1, m;
    interleaved_chunk<T>(group, static_cast<int>(c), quads, &d0, &d1, &m);
    int32_t* dst = tile.wq.data() + c * QUADS * TILE_N;
    __m512i half[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int p = 0; p < QUADS; ++p) {
      _mm512_storeu_si512(dst + p * TILE_N, quads[p]);
      half[p / (QUADS / 2)] = _mm512_dpbusd_epi32(half[p / (QUADS / 2)], ones, quads[p]);
    }
    _mm512_storeu_si512(tile.wsum.data() + c * 2 * TILE_N, _mm512_slli_epi32(half[0], 7));
    _mm512_storeu_si512(tile.wsum.data() + c * 2 * TILE_N + TILE_N, _mm512_slli_epi32(half[1], 7));
    _mm512_storeu_ps(tile.d0.data() + c * TILE_N, d0);
    _mm512_storeu_ps(tile.d1.data() + c * TILE_N, d1);
    _mm512_storeu_ps(tile.m.data() + c * TILE_N, m);
  }
}

// R input rows (from m0) times the tile: out[r][0..n) for the tile's n valid weight rows.
template <int T, int R, typename O>
void tile_rows(const Tile& tile, const Inputs& in, int m0, O* out, int64_t ldo, int n) {
  constexpr bool has_offset = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K, split = T == Q6_K;
  const int nchunks = in.K / QK;
  __m512 acc[R];
  const uint8_t* xq[R];
  const float* xs[R];
  const float* xsum[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm512_setzero_ps();
    xq[r] = in.row(m0 + r);
    xs[r] = in.scale.data() + static_cast<size_t>(m0 + r) * nchunks;
    xsum[r] = in.sum.data() + static_cast<size_t>(m0 + r) * nchunks;
  }
  const int32_t* wq = tile.wq.data();
  for (int c = 0; c < nchunks; ++c, wq += QUADS * TILE_N) {
    const __m512 d0 = _mm512_loadu_ps(tile.d0.data() + c * TILE_N);
    const int32_t* ws = tile.wsum.data() + c * 2 * TILE_N;
    __m512i sum[R];
    // without a split scale both halves' bias corrections are taken at once at the end
    const __m512i corr_all = _mm512_add_epi32(_mm512_loadu_si512(ws), _mm512_loadu_si512(ws + TILE_N));
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int p = 0; p < QUADS; ++p) {
      if (split && p == QUADS / 2) {  // Q6_K: weights 16..31 of the chunk have their own scale
        const __m512i corr = _mm512_loadu_si512(ws);
        for (int r = 0; r < R; ++r) {
          const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], corr));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, d0), _mm512_set1_ps(xs[r][c]), acc[r]);
          sum[r] = _mm512_setzero_si512();
        }
      }
      const __m512i wv = _mm512_loadu_si512(wq + p * TILE_N);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq[r] + QK * c + 4 * p, 4);
        sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(quad), wv);
      }
    }
    const __m512 d = split ? _mm512_loadu_ps(tile.d1.data() + c * TILE_N) : d0;
    const __m512i corr = split ? _mm512_loadu_si512(ws + TILE_N) : corr_all;
    const __m512 mv = _mm512_loadu_ps(tile.m.data() + c * TILE_N);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], corr));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, d), _mm512_set1_ps(xs[r][c]), acc[r]);
      if constexpr (has_offset) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r][c]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(out + r * ldo, acc[r], n);
}

// R input rows times the 16 weight rows of an interleaved group (quant_x16.h), each chunk unpacked into
// registers and used at once: for a few input rows, where writing a tile and reading it back cost more than
// the products (one decode row). The same integer sums and float operations as tile_rows: the same outputs.
template <int T, int R, typename O>
void group_rows(const uint8_t* group, const Inputs& in, O* out, int64_t ldo) {
  constexpr bool has_offset = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K, split = T == Q6_K;
  const int nchunks = in.K / QK;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  __m512i quads[QUADS];
  for (int c = 0; c < nchunks; ++c) {
    __m512 d0, d1, mv;
    interleaved_chunk<T>(group, c, quads, &d0, &d1, &mv);
    __m512i half[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()}, sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int p = 0; p < QUADS; ++p) {
      if (split && p == QUADS / 2) {
        const __m512i corr = _mm512_slli_epi32(half[0], 7);
        for (int r = 0; r < R; ++r) {
          const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], corr));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, d0), _mm512_set1_ps(in.scale[static_cast<size_t>(r) * nchunks + c]), acc[r]);
          sum[r] = _mm512_setzero_si512();
        }
      }
      half[p / (QUADS / 2)] = _mm512_dpbusd_epi32(half[p / (QUADS / 2)], ones, quads[p]);
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, in.row(r) + QK * c + 4 * p, 4);
        sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(quad), quads[p]);
      }
    }
    const __m512i corr = split ? _mm512_slli_epi32(half[1], 7)
                               : _mm512_add_epi32(_mm512_slli_epi32(half[0], 7), _mm512_slli_epi32(half[1], 7));
    const __m512 d = split ? d1 : d0;
    for (int r = 0; r < R; ++r) {
      const size_t at = static_cast<size_t>(r) * nchunks + c;
      const __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], corr));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(s, d), _mm512_set1_ps(in.scale[at]), acc[r]);
      if constexpr (has_offset) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(in.sum[at]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(out + r * ldo, acc[r], TILE_N);
}

// Up to this many input rows, interleaved groups take group_rows. One thread, 1 and 4 rows of 3072x768 and
// 768x1536 weights: Q4_1 0.53x / 0.52-0.61x the tiles' time, Q4_K 0.62-0.64x / 0.65-0.70x; Q6_K (the split
// scale: more live registers) 0.87x at 1 row but 1.1x at 4.
constexpr int GROUP_ROWS_DIRECT = 4;
constexpr int group_direct_rows(int t) { return t == Q6_K ? 1 : GROUP_ROWS_DIRECT; }

template <int T, typename O>
void group_any(const uint8_t* group, const Inputs& in, O* out, int64_t ldo, int R) {
  using Fn = void (*)(const uint8_t*, const Inputs&, O*, int64_t);
  static constexpr Fn fns[GROUP_ROWS_DIRECT] = {group_rows<T, 1, O>, group_rows<T, 2, O>, group_rows<T, 3, O>,
                                                group_rows<T, 4, O>};
  fns[R - 1](group, in, out, ldo);
}

template <int T, typename O>
void tile_any(const Tile& tile, const Inputs& in, int m0, O* out, int64_t ldo, int n, int R) {
  using Fn = void (*)(const Tile&, const Inputs&, int, O*, int64_t, int);
  static constexpr Fn fns[TILE_RM] = {tile_rows<T, 1, O>, tile_rows<T, 2, O>, tile_rows<T, 3, O>, tile_rows<T, 4, O>,
                                      tile_rows<T, 5, O>, tile_rows<T, 6, O>, tile_rows<T, 7, O>, tile_rows<T, 8, O>};
  fns[R - 1](tile, in, m0, out, ldo, n);
}

template <int T, typename O>
void qgemm(const Inputs& in, const uint8_t* w, int M, int N, int64_t row_bytes, O* out, int64_t ldo, bool interleaved) {
  if (interleaved && M <= group_direct_rows(T)) {
    pagedserve::parallel_for(N / TILE_N, [&](int64_t i) {
      group_any<T>(w + i * TILE_N * row_bytes, in, out + i * TILE_N, ldo, M);
    });
    return;
  }
  pagedserve::parallel_for((N + TILE_N - 1) / TILE_N, [&](int64_t i) {
    static thread_local Tile tile;
    const int n0 = static_cast<int>(i) * TILE_N, n = std::min(TILE_N, N - n0);
    if (interleaved) pack_tile_interleaved<T>(w + n0 * row_bytes, in.K, tile);
    else pack_tile<T>(w, row_bytes, n0, n, in.K, tile);
    for (int m0 = 0; m0 < M; m0 += TILE_RM)
      tile_any<T>(tile, in, m0, out + static_cast<int64_t>(m0) * ldo + n0, ldo, n, std::min(TILE_RM, M - m0));
  });
}

// One weight row dotted with R input rows (from m0): each block is decoded once for all R rows; per 32 weights
// a row costs one vpdpbusd (lanes 0..3: weights 0..15, lanes 4..7: 16..31, as Q6_K's two scales split them),
// and each chunk's exact sum is scaled as the tiles scale it (scale_chunk).
template <int T, int R>
void dot_rows(const uint8_t* w, const Inputs& in, int m0, float* out) {
  constexpr int bb = block_bytes(T), per_block = block_weights(T) / QK;
  constexpr bool has_offset = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K;
  const int nchunks = in.K / QK;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  Chunk chunks[per_block];
  for (int blk = 0, c = 0; blk < in.K / block_weights(T); ++blk, w += bb) {
    decode_block(T, w, chunks);
    for (int j = 0; j < per_block; ++j, ++c) {
      const Chunk& ch = chunks[j];
      const __m256i bias = _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(1), ch.q), 7);
      for (int r = 0; r < R; ++r) {
        const size_t at = static_cast<size_t>(m0 + r) * nchunks + c;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.row(m0 + r) + QK * c));
        int32_t lo, hi;
        hsum_halves(_mm256_sub_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), xq, ch.q), bias), &lo, &hi);
        acc[r] = scale_chunk<T == Q6_K, has_offset>(acc[r], lo, hi, ch.d0, ch.d1, ch.m, in.scale[at], in.sum[at]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

constexpr int DOT_ROWS = 4;  // input rows per weight-row decode

template <int T, typename O>
void qdots(const Inputs& in, const uint8_t* w, int M, int N, int64_t row_bytes, O* out, int64_t ldo) {
  using Fn = void (*)(const uint8_t*, const Inputs&, int, float*);
  static constexpr Fn fns[DOT_ROWS] = {dot_rows<T, 1>, dot_rows<T, 2>, dot_rows<T, 3>, dot_rows<T, 4>};
  pagedserve::parallel_for((N + TILE_N - 1) / TILE_N, [&](int64_t i) {
    const int n0 = static_cast<int>(i) * TILE_N, n1 = std::min(N, n0 + TILE_N);
    float res[DOT_ROWS];
    for (int m0 = 0; m0 < M; m0 += DOT_ROWS) {  // input rows outermost: they and these weight rows stay in L1
      const int R = std::min(DOT_ROWS, M - m0);
      for (int n = n0; n < n1; ++n) {
        fns[R - 1](w + n * row_bytes, in, m0, res);
        for (int r = 0; r < R; ++r) pagedserve::store(out + static_cast<int64_t>(m0 + r) * ldo + n, res[r]);
      }
    }
  });
}

template <int T, typename O>
void qlinear8(const Inputs& in, const uint8_t* w, int M, int N, int64_t row_bytes, O* out, int64_t ldo, bool interleaved) {
  // Fewer rows than this: the dot products win (the tile's unpacking is paid once per call, whatever M is),
  // unless the blocks are interleaved: then the unpacking is a few operations per 64 weights.
  if (!interleaved && M < (T == Q8_0 ? 16 : 8)) qdots<T>(in, w, M, N, row_bytes, out, ldo);
  else qgemm<T>(in, w, M, N, row_bytes, out, ldo, interleaved);
}

template <typename O>
void qlinear8_any(int t, const Inputs& in, const uint8_t* w, int M, int N, int64_t row_bytes, O* out, int64_t ldo,
                  bool il) {
  switch (t) {
    case Q4_0: return qlinear8<Q4_0>(in, w, M, N, row_bytes, out, ldo, il);
    case Q4_1: return qlinear8<Q4_1>(in, w, M, N, row_bytes, out, ldo, il);
    case Q5_0: return qlinear8<Q5_0>(in, w, M, N, row_bytes, out, ldo, il);
    case Q5_1: return qlinear8<Q5_1>(in, w, M, N, row_bytes, out, ldo, il);
    case Q8_0: return qlinear8<Q8_0>(in, w, M, N, row_bytes, out, ldo, il);
    case Q4_K: return qlinear8<Q4_K>(in, w, M, N, row_bytes, out, ldo, il);
    case Q5_K: return qlinear8<Q5_K>(in, w, M, N, row_bytes, out, ldo, il);
    default: return qlinear8<Q6_K>(in, w, M, N, row_bytes, out, ldo, il);
  }
}

}  // namespace

namespace pagedserve {

bool qlinear_int8_built() { return true; }

void qlinear_int8(int t, const void* x, bool x_bf16, const uint8_t* w, int M, int N, int K, int64_t row_bytes,
                  void* out, int64_t ldo, bool out_bf16, bool interleaved) {
  static thread_local Inputs in;
  if (x_bf16) quantize_inputs(static_cast<const uint16_t*>(x), M, K, in);
  else quantize_inputs(static_cast<const float*>(x), M, K, in);
  if (out_bf16) qlinear8_any(t, in, w, M, N, row_bytes, static_cast<uint16_t*>(out), ldo, interleaved);
  else qlinear8_any(t, in, w, M, N, row_bytes, static_cast<float*>(out), ldo, interleaved);
}

}  // namespace pagedserve

#else  // no AVX-512 VNNI: every input is rounded to int16 (quant.cpp)

namespace pagedserve {
bool qlinear_int8_built() { return false; }
void qlinear_int8(int, const void*, bool, const uint8_t*, int, int, int, int64_t, void*, int64_t, bool, bool) {}
}  // namespace pagedserve

#endif
