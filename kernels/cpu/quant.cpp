// Linear layers and embedding rows straight from GGUF (ggml) quantized blocks, on CPU.
//
// Formats and their unpacking: quant_blocks.h.
// Decode (a few input rows): each input row is quantized once per call to int16 blocks of 32 (scale =
// max|x| / 32767), then every weight block is unpacked once for up to 4 input rows and dotted with them in
// integers (AVX2 madd: 16 products per instruction), scaled once per 32 weights. int16 (fp32 activations, and
// every CPU without VNNI): ~256x closer to the float product than llama.cpp's int8 activations, for about one
// more instruction per 16 weights; in fp32 int8 noise moved SmolLM2's near-tied README answer. bf16
// activations, whose own rounding is of int8's size, take int8 where the CPU has VNNI (quant_tiles.cpp). The
// weights are read once, in their 4.5-8.5 bits: that read is what a one-stream decode step waits on. Larger
// inputs (prefill, decode batches) with AVX-512 VNNI: where the caller asks for int8 inputs, at any row count
// (quant_tiles.cpp, vpdpbusd); else tiles of 16 weight rows unpacked into interleaved int16 pairs and
// multiplied with every input row by vpdpwssd (qgemm_tiles below; the same int16 inputs as the dot products).
// Blocks kept interleaved across 16 rows (quant_x16.h; every format) unpack into the tiles without a
// transpose, cheaply enough that every row count takes the tiles (one decode row too: 0.25-0.5x the dot
// products' time on SmolLM2's shapes). Without VNNI the caller dequantizes the weight rows (qdequant) for a
// float GEMM. An AVX-512 version of the dot products was slower than this AVX2 code on a Zen 4 core (512-bit
// operations in two halves) (docs/benchmarks.md). Built by kernels/cpu/build.py with -march=native, so each
// path is compiled exactly where the CPU has it; elsewhere a scalar loop does the same arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "pool.h"
#include "quant_blocks.h"
#include "quant_tiles.h"
#include "quant_x16.h"
#include "vec_math.h"
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
#if defined(__AVX512BW__)
  // the scalar loop's arithmetic in 16 lanes (one multiply, round to nearest even): the same values
  for (int b = 0; b < nb; ++b) {
    const __m512 v0 = load16(x + b * QK), v1 = load16(x + b * QK + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = amax / 32767.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b * QK), _mm512_cvtepi32_epi16(q0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + b * QK + 16), _mm512_cvtepi32_epi16(q1));
    r.scale[b] = d;
    r.sum[b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
#else
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
#endif
}

#if defined(__AVX2__)

// One weight row dotted with R quantized input rows: each block is decoded once for all R rows (the decode
// costs about as much as the integer products of one row). The products of 32 weights with the int16 inputs
// are exact in int32 (|q| <= 127, |qx| <= 32767); each chunk's sum is scaled once, as the tiles scale it
// (scale_chunk). The format is a template argument so that the block decode inlines into the loop without
// branches.
template <int T, int R>
void dot_rows(const uint8_t* w, const QRow* x, int K, float* out) {
  constexpr int bb = block_bytes(T), per_block = block_weights(T) / QK;
  constexpr bool has_offset = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K;
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
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
        // lanes 0..3: weights 0..15, lanes 4..7: 16..31
        const __m256i halves = _mm256_hadd_epi32(p0, p1);
        int32_t lo, hi;
        hsum_halves(_mm256_permute4x64_epi64(halves, 0xD8), &lo, &hi);
        acc[r] = scale_chunk<T == Q6_K, has_offset>(acc[r], lo, hi, c.d0, c.d1, c.m, x[r].scale[b], x[r].sum[b]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
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

#if defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
// Many input rows (prefill, large decode batches): the weights are unpacked tile by tile, 16 weight rows at a
// time, into int16 pairs interleaved across the 16 rows (one 512-bit vector holds weights k, k+1 of every row:
// what one VNNI dpwssd multiplies with an input row's pair k, k+1 broadcast). The tile (K/2 vectors and the
// chunks' scales and offsets as vectors over its 16 rows) stays in L1/L2 and serves every input row; each row
// then costs 16 dpwssd per 32 weights x 16 outputs and one float scale per chunk, instead of the dot
// products' widening and per-row float work. Same int16 inputs, same exact int32 chunk sums as dot_rows.
// Below this many input rows the unpacking costs more than it saves: measured against the dot products on a
// 2-vCPU AMD EPYC (Zen 4 core, AVX-512 VNNI), one thread: Q4_1/Q4_K/Q6_K 3072x576..576x1536 even at 8 rows,
// 0.69-0.85x at 12; Q8_0 (SmolLM2's 49152x576 LM head: more bytes to unpack per weight) 1.34x at 12, 1.16x
// at 16.
constexpr int tile_min_rows(int t) { return t == Q8_0 ? 24 : 12; }
constexpr int TILE_RM = 8;        // input rows per pass over the tile (their sums stay in registers)

struct Tile {
  aligned_vector<int32_t> wq;    // [chunk][pair][16 rows]: int16 pairs
  aligned_vector<float> d0, d1, m;  // [chunk][16 rows]: scale of weights 0..15 / 16..31 of the chunk, offset
};

// Weight rows n0..n0+rows-1 (rows <= 16; the rest zero) unpacked into the tile.
template <int T>
void pack_tile(const uint8_t* w, int64_t row_bytes, int n0, int rows, int K, Tile& tile) {
  constexpr int bb = block_bytes(T), per_block = block_weights(T) / QK;
  const int nchunks = K / QK;
  tile.wq.resize(static_cast<size_t>(nchunks) * 16 * TILE_N);
  tile.d0.resize(static_cast<size_t>(nchunks) * TILE_N);
  tile.d1.resize(tile.d0.size());
  tile.m.resize(tile.d0.size());
  alignas(64) int16_t tmp[per_block][TILE_N][QK];
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(QK / 2));
  for (int blk = 0; blk < K / block_weights(T); ++blk) {
    for (int n = 0; n < TILE_N; ++n) {
      const int c0 = blk * per_block;
      if (n >= rows) {
        for (int j = 0; j < per_block; ++j) {
          _mm512_store_si512(tmp[j][n], _mm512_setzero_si512());
          tile.d0[(c0 + j) * TILE_N + n] = tile.d1[(c0 + j) * TILE_N + n] = tile.m[(c0 + j) * TILE_N + n] = 0.0f;
        }
        continue;
      }
      const uint8_t* wb = w + (n0 + n) * row_bytes + static_cast<int64_t>(blk) * bb;
      if constexpr (!is_k_quant(T)) {
        float d, m;
        _mm512_store_si512(tmp[0][n], block_i16_avx512(T, wb, &d, &m));
        tile.d0[c0 * TILE_N + n] = tile.d1[c0 * TILE_N + n] = d;
        tile.m[c0 * TILE_N + n] = m;
      } else {
        Chunk chunks[per_block];
        decode_block(T, wb, chunks);
        for (int j = 0; j < per_block; ++j) {
          _mm512_store_si512(tmp[j][n], _mm512_cvtepi8_epi16(chunks[j].q));
          tile.d0[(c0 + j) * TILE_N + n] = chunks[j].d0;
          tile.d1[(c0 + j) * TILE_N + n] = chunks[j].d1;
          tile.m[(c0 + j) * TILE_N + n] = chunks[j].m;
        }
      }
    }
    for (int j = 0; j < per_block; ++j) {
      int32_t* dst = tile.wq.data() + static_cast<size_t>(blk * per_block + j) * 16 * TILE_N;
      for (int p = 0; p < QK / 2; ++p)  // pair p of every row: a transpose of the 16 x 16 int32 pairs
        _mm512_storeu_si512(dst + p * TILE_N,
                            _mm512_i32gather_epi32(_mm512_add_epi32(lanes, _mm512_set1_epi32(p)), tmp[j], 4));
    }
  }
}

// The 16 weight rows of an interleaved group (quant_x16.h) unpacked into the tile: no transpose left to do.
template <int T>
void pack_tile_interleaved(const uint8_t* group, int K, Tile& tile) {
  const int nchunks = K / QK;
  tile.wq.resize(static_cast<size_t>(nchunks) * 16 * TILE_N);
  tile.d0.resize(static_cast<size_t>(nchunks) * TILE_N);
  tile.d1.resize(tile.d0.size());
  tile.m.resize(tile.d0.size());
  __m512i quads[8], pairs[16];
  for (int c = 0; c < nchunks; ++c) {
    __m512 d0, d1, m;
    interleaved_chunk<T>(group, c, quads, &d0, &d1, &m);
    quads_to_pairs(quads, pairs);
    int32_t* dst = tile.wq.data() + static_cast<size_t>(c) * 16 * TILE_N;
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * TILE_N, pairs[p]);
    _mm512_storeu_ps(tile.d0.data() + c * TILE_N, d0);
    _mm512_storeu_ps(tile.d1.data() + c * TILE_N, d1);
    _mm512_storeu_ps(tile.m.data() + c * TILE_N, m);
  }
}

// R input rows times the tile: out[r][0..n) for the tile's n valid weight rows.
template <int T, int R, typename O>
void tile_rows(const Tile& tile, const QRow* x, int K, O* out, int64_t ldo, int n) {
  constexpr bool has_offset = T == Q4_1 || T == Q5_1 || T == Q4_K || T == Q5_K, split = T == Q6_K;
  __m512 acc[R];
  const int16_t* xq[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), xq[r] = x[r].q.data();
  const int32_t* wq = tile.wq.data();
  for (int c = 0; c < K / QK; ++c, wq += 16 * TILE_N) {
    const __m512 d0 = _mm512_loadu_ps(tile.d0.data() + c * TILE_N);
    __m512i sum[R];
    for (int r = 0; r < R; ++r) sum[r] = _mm512_setzero_si512();
    for (int p = 0; p < 16; ++p) {
      if (split && p == 8) {  // Q6_K: weights 16..31 of the chunk have their own scale
        for (int r = 0; r < R; ++r) {
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[r]), d0), _mm512_set1_ps(x[r].scale[c]), acc[r]);
          sum[r] = _mm512_setzero_si512();
        }
      }
      const __m512i wv = _mm512_loadu_si512(wq + p * TILE_N);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xq[r] + QK * c + 2 * p, 4);
        sum[r] = _mm512_dpwssd_epi32(sum[r], wv, _mm512_set1_epi32(pair));
      }
    }
    const __m512 d = split ? _mm512_loadu_ps(tile.d1.data() + c * TILE_N) : d0;
    const __m512 mv = _mm512_loadu_ps(tile.m.data() + c * TILE_N);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[r]), d), _mm512_set1_ps(x[r].scale[c]), acc[r]);
      if constexpr (has_offset) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(x[r].sum[c]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(out + r * ldo, acc[r], n);
}

template <int T, typename O>
void tile_any(const Tile& tile, const QRow* x, int K, O* out, int64_t ldo, int n, int R) {
  using Fn = void (*)(const Tile&, const QRow*, int, O*, int64_t, int);
  static constexpr Fn fns[TILE_RM] = {tile_rows<T, 1, O>, tile_rows<T, 2, O>, tile_rows<T, 3, O>, tile_rows<T, 4, O>,
                                      tile_rows<T, 5, O>, tile_rows<T, 6, O>, tile_rows<T, 7, O>, tile_rows<T, 8, O>};
  fns[R - 1](tile, x, K, out, ldo, n);
}

template <int T, typename O>
void qgemm_tiles(const std::vector<QRow>& qx, const uint8_t* w, int M, int N, int K, int64_t row_bytes, O* out,
                 int64_t ldo, bool interleaved) {
  pagedserve::parallel_for((N + TILE_N - 1) / TILE_N, [&](int64_t i) {
    static thread_local Tile tile;
    const int n0 = static_cast<int>(i) * TILE_N, n = std::min(TILE_N, N - n0);
    if (interleaved) pack_tile_interleaved<T>(w + n0 * row_bytes, K, tile);
    else pack_tile<T>(w, row_bytes, n0, n, K, tile);
    for (int m0 = 0; m0 < M; m0 += TILE_RM)
      tile_any<T>(tile, &qx[m0], K, out + static_cast<int64_t>(m0) * ldo + n0, ldo, n, std::min(TILE_RM, M - m0));
  });
}

template <typename O>
void qgemm(int t, const std::vector<QRow>& qx, const uint8_t* w, int M, int N, int K, int64_t row_bytes, O* out,
           int64_t ldo, bool interleaved) {
  switch (t) {
    case Q4_0: return qgemm_tiles<Q4_0>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    case Q4_1: return qgemm_tiles<Q4_1>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    case Q5_0: return qgemm_tiles<Q5_0>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    case Q5_1: return qgemm_tiles<Q5_1>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    case Q8_0: return qgemm_tiles<Q8_0>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    case Q4_K: return qgemm_tiles<Q4_K>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    case Q5_K: return qgemm_tiles<Q5_K>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    default: return qgemm_tiles<Q6_K>(qx, w, M, N, K, row_bytes, out, ldo, interleaved);
  }
}
#define PAGEDSERVE_QGEMM 1
#endif

constexpr bool qlinear_interleaved_built() {
#if defined(PAGEDSERVE_QGEMM)
  return true;
#else
  return false;
#endif
}

template <typename T, typename O>
int qlinear(const T* x, const uint8_t* w, int t, int M, int N, int K, int64_t row_bytes, O* out, int64_t ldo,
            bool int8_inputs, bool interleaved) {
  if (int8_inputs && pagedserve::qlinear_int8_built()) {
    pagedserve::qlinear_int8(t, x, sizeof(T) == 2, w, M, N, K, row_bytes, out, ldo, sizeof(O) == 2, interleaved);
    return 0;
  }
  const DotAnyFn dot = dot_for(t);
  std::vector<QRow> qx(M);
  if (M >= 32) {  // prefill-sized inputs: rows shared out like the products
    pagedserve::parallel_for(M, [&](int64_t m) { quantize_row(x + m * K, K, qx[m]); });
  } else {
    for (int m = 0; m < M; ++m) quantize_row(x + static_cast<int64_t>(m) * K, K, qx[m]);
  }
#if defined(PAGEDSERVE_QGEMM)
  if (interleaved || M >= tile_min_rows(t)) {  // interleaved blocks unpack cheaply enough for any M
    qgemm(t, qx, w, M, N, K, row_bytes, out, ldo, interleaved);
    return 0;
  }
#endif
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

// out[0..32) = d * q + m: one multiply and one add per weight (no FMA contraction), as the scalar loop rounds.
template <typename T>
inline void dequant_block(const int8_t* q, float d, float m, T* out) {
#if defined(__AVX2__)
  const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
  for (int j = 0; j < QK; j += 8) {
    const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
    store8(out + j, _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(qi), dv), mv));
  }
#else
  for (int j = 0; j < QK; ++j) pagedserve::store(out + j, d * static_cast<float>(q[j]) + m);
#endif
}

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
    alignas(32) int8_t q[QK];
    float d, m;
#if defined(__AVX2__)
    _mm256_store_si256(reinterpret_cast<__m256i*>(q), block_bytes_avx2(t, w, &d, &m));
#else
    block_ints(t, w, q, &d, &m);
#endif
    dequant_block(q, d, m, out + b * QK);
  }
}

// Row `lane` of an interleaved group of 16 rows (quant_x16.h): block by block as the file stores it.
template <typename T>
void dequant_row_interleaved(int t, const uint8_t* group, int lane, int K, T* out) {
  const int bb = block_bytes(t), per_block = block_weights(t);
  alignas(32) uint8_t block[256];
  for (int b = 0; b < K / per_block; ++b) {
    deinterleave_block(t, group + static_cast<int64_t>(b) * GROUP_ROWS * bb, lane, block);
    dequant_row(t, block, per_block, out + static_cast<int64_t>(b) * per_block);
  }
}

template <typename T>
void dequant(const uint8_t* w, int t, int64_t row_bytes, const int64_t* rows, int n, int K, T* out, bool interleaved) {
  pagedserve::parallel_for((n + ROWS_PER_INDEX - 1) / ROWS_PER_INDEX, [&](int64_t i) {
    const int r0 = static_cast<int>(i) * ROWS_PER_INDEX, r1 = std::min(n, r0 + ROWS_PER_INDEX);
    for (int r = r0; r < r1; ++r) {
      const int64_t src = rows != nullptr ? rows[r] : r;
      if (interleaved)
        dequant_row_interleaved(t, w + src / GROUP_ROWS * GROUP_ROWS * row_bytes, static_cast<int>(src % GROUP_ROWS), K,
                                out + static_cast<int64_t>(r) * K);
      else
        dequant_row(t, w + src * row_bytes, K, out + static_cast<int64_t>(r) * K);
    }
  });
}

bool supported(int t, int K) { return block_bytes(t) != 0 && K % block_weights(t) == 0 && K > 0; }

// Splits the INTERLEAVED flag off a type id; false where this build cannot read that layout for N rows.
bool layout_of(int* t, int N, bool* interleaved) {
  *interleaved = (*t & INTERLEAVED) != 0;
  *t &= ~INTERLEAVED;
  return !*interleaved || (qlinear_interleaved_built() && interleavable(*t) && N % GROUP_ROWS == 0);
}
int64_t row_bytes_of(int t, int K) { return static_cast<int64_t>(K / block_weights(t)) * block_bytes(t); }

}  // namespace

// out[m, n] (row stride ldo) = sum_k x[m, k] * w[n, k], w given as N rows of row_bytes of blocks of type t.
// x is bf16 when is_bf16, out when out_bf16 (else fp32): bf16 activations may ask for fp32 outputs (logits).
// t may carry the INTERLEAVED flag (quant_x16.h).
extern "C" int qlinear(const void* x, const void* w, int t, int M, int N, int K, int64_t row_bytes, void* out,
                       int64_t ldo, int is_bf16, int out_bf16, int int8_inputs) {
  bool il;
  if (!layout_of(&t, N, &il) || !supported(t, K) || M < 1 || N < 1 || row_bytes != row_bytes_of(t, K)) return 1;
  const auto* wb = static_cast<const uint8_t*>(w);
  const auto* xb = static_cast<const uint16_t*>(x);
  const auto* xf = static_cast<const float*>(x);
  auto* ob = static_cast<uint16_t*>(out);
  auto* of = static_cast<float*>(out);
  const bool i8 = int8_inputs != 0;
  if (is_bf16)
    return out_bf16 ? qlinear(xb, wb, t, M, N, K, row_bytes, ob, ldo, i8, il)
                    : qlinear(xb, wb, t, M, N, K, row_bytes, of, ldo, i8, il);
  return out_bf16 ? qlinear(xf, wb, t, M, N, K, row_bytes, ob, ldo, i8, il)
                  : qlinear(xf, wb, t, M, N, K, row_bytes, of, ldo, i8, il);
}

// out[r, :] = dequantized weight row rows[r] (rows null: row r), r < n, of a weight of N rows.
extern "C" int qdequant(const void* w, int t, int64_t row_bytes, int N, const int64_t* rows, int n, int K, void* out,
                        int is_bf16) {
  bool il;
  if (!layout_of(&t, N, &il) || !supported(t, K) || n < 0 || row_bytes != row_bytes_of(t, K)) return 1;
  const auto* wb = static_cast<const uint8_t*>(w);
  if (is_bf16)
    dequant(wb, t, row_bytes, rows, n, K, static_cast<uint16_t*>(out), il);
  else
    dequant(wb, t, row_bytes, rows, n, K, static_cast<float*>(out), il);
  return 0;
}

// Rearranges a weight's N rows of blocks of type t (N a multiple of 16) in place into the interleaved layout
// (quant_x16.h), one group of 16 rows at a time through a copy of that group.
extern "C" int qinterleave(void* w, int t, int N, int K, int64_t row_bytes) {
  if (!interleavable(t) || !supported(t, K) || N % GROUP_ROWS != 0 || row_bytes != row_bytes_of(t, K)) return 1;
  auto* wb = static_cast<uint8_t*>(w);
  pagedserve::parallel_for(N / GROUP_ROWS, [&](int64_t g) {
    uint8_t* group = wb + g * GROUP_ROWS * row_bytes;
    const std::vector<uint8_t> rows(group, group + GROUP_ROWS * row_bytes);
    interleave_group(t, rows.data(), row_bytes, group);
  });
  return 0;
}

// Whether qlinear rounds inputs to int8 when asked to (int8_inputs): with AVX-512 VNNI only.
extern "C" int qlinear_has_int8() { return pagedserve::qlinear_int8_built() ? 1 : 0; }

// Whether qlinear and qdequant read blocks interleaved across 16 rows (quant_x16.h): with
// AVX-512 VNNI only, whose tiles they are for.
extern "C" int qlinear_has_interleaved() { return qlinear_interleaved_built() ? 1 : 0; }

// The most input rows qlinear is meant for: 0 = any (the VNNI tile path computes prefill-sized inputs faster
// than dequantizing the weight for a float GEMM); else the dot products' crossover with dequantize + GEMM.
extern "C" int qlinear_max_rows() {
#if defined(PAGEDSERVE_QGEMM)
  return 0;
#else
  return 16;
#endif
}
