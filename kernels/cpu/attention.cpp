// Paged attention for CPU that reads K/V in place through the block tables (no dense copies), after writing
// the step's new K/V into the cache in the same call.
//
// One work item = (sequence, KV head, tile of query tokens). Its rows are the tile's tokens times the query
// heads sharing that KV head (GQA), so each K/V vector is loaded (and for bf16 converted) once for all of them.
// Keys are walked in chunks of KC positions: each row's scores against the chunk are D-wide vector dot
// products, then an online softmax (running max m, sum l) folds the chunk's V into the row's fp32 accumulator. Query token i of a sequence with context_len cached tokens sees
// keys 0..context_len + i. Built by kernels/cpu/build.py with -O3 -march=native, fast-math parts, -fopenmp;
// Work items are shared out by the pool of pool.h.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "pool.h"
#include "vec_math.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int KC = 16;        // keys per chunk: one AVX-512 register of fp32 scores
constexpr int MAX_D = 256;    // largest head_dim
constexpr int MAX_ROWS = 64;  // rows per work item (tile tokens x group)
constexpr int PF_KEYS = 32;   // keys prefetched ahead of the chunk being computed
constexpr float NEG = -1e30f; // finite "minus infinity": exp(NEG - max) is 0 without inf arithmetic

using pagedserve::load;
using pagedserve::store;

// dot and axpy over one head vector. Written with AVX-512 intrinsics where the CPU has them (head_dim a
// multiple of 16): left to itself the compiler fuses neighbouring calls into one scalar loop.
#ifdef __AVX512F__
inline float dot(const float* __restrict x, const float* __restrict y, int n) {
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}
inline void axpy(float* __restrict y, const float* __restrict x, float a, int n) {
  if (n % 16 == 0) {
    const __m512 va = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16)
      _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    return;
  }
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}
#elif defined(__AVX2__)
// The same with AVX2 (head_dim a multiple of 8): CPUs without AVX-512 (AMD before Zen 4, older Intel).
inline float dot(const float* __restrict x, const float* __restrict y, int n) {
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}
inline void axpy(float* __restrict y, const float* __restrict x, float a, int n) {
  if (n % 8 == 0) {
    const __m256 va = _mm256_set1_ps(a);
    for (int i = 0; i < n; i += 8)
      _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    return;
  }
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}
#else
inline float dot(const float* __restrict x, const float* __restrict y, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}
inline void axpy(float* __restrict y, const float* __restrict x, float a, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}
#endif

struct Args {
  const void* q; const void* k_cache; const void* v_cache; void* out;
  const int32_t* block_tables; int64_t bt_stride;
  const int32_t* seq_lens; const int32_t* cu_seqlens_q;
  int num_heads, num_kv_heads, head_dim, block_size;
  float scale;
};

struct Item { int seq, kv_head, q_begin, q_end; };

// Pointers to KC consecutive keys (or values) of one KV head, as fp32 rows: straight into the cache for fp32,
// converted into buf for bf16 (one contiguous, vectorized conversion per vector).
inline void rows_of(const float* cache, const int64_t* off, int nk, int D, float (*)[MAX_D], const float** out) {
  for (int t = 0; t < nk; ++t) out[t] = cache + off[t];
}
inline void rows_of(const uint16_t* cache, const int64_t* off, int nk, int D, float (*buf)[MAX_D],
                    const float** out) {
  for (int t = 0; t < nk; ++t) {
    const uint16_t* src = cache + off[t];
    int d = 0;
#ifdef __AVX512F__
    for (; d + 16 <= D; d += 16) {  // 16 bf16 -> 16 fp32: widen to 32 bits, shift into the high half
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
      _mm512_storeu_ps(buf[t] + d, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
    }
#elif defined(__AVX2__)
    for (; d + 8 <= D; d += 8) {
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d)));
      _mm256_storeu_ps(buf[t] + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
    }
#endif
    for (; d < D; ++d) buf[t][d] = load(src + d);
    out[t] = buf[t];
  }
}

#ifdef __AVX512F__
// Lane t of the result = the sum of the 16 lanes of v[t]: a transpose-and-add tree (about 50 shuffles and adds
// for all 16 sums, against ~8 dependent steps per sum reduced one at a time).
inline __m512 transpose_sum16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)  // 128-bit blocks: (0,1) of v[2i] + its (2,3) | the same for v[2i+1]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // one block of 4 partial sums per vector 4i..4i+3
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  const __m512 y0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 y1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(y0, y1, _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4j + m of z holds the sum of v[4m + j]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// One row's online-softmax update over a chunk of up to KC keys, all in registers (D a multiple of 16). DC is
// D when it is known at compile time (64, 128: the loops unroll, and the 16 keys' dot products run as
// independent chains instead of one chain of D/16 dependent FMAs per key), else 0 (D read at run time).
template <int DC>
inline void chunk_update16(const float* qr, const float* const* kp, const float* const* vp, int visible, int Dr,
                           float* m, float* l, float* acc) {
  const int D = DC > 0 ? DC : Dr;
  __m512 dots[KC];
  if (visible == KC) {
    for (int t = 0; t < KC; ++t) dots[t] = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(kp[t]));
    for (int d = 16; d < D; d += 16)
      for (int t = 0; t < KC; ++t)
        dots[t] = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kp[t] + d), dots[t]);
  } else {
    for (int t = 0; t < KC; ++t) {
      __m512 a = _mm512_setzero_ps();
      if (t < visible)
        for (int d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kp[t] + d), a);
      dots[t] = a;
    }
  }
  const __mmask16 valid = static_cast<__mmask16>((1u << visible) - 1u);
  const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(NEG), transpose_sum16(dots));
  const float mx = std::max(*m, _mm512_reduce_max_ps(s));
  const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
  const float corr = std::exp(*m - mx);
  *l = *l * corr + _mm512_reduce_add_ps(p);
  *m = mx;
  alignas(64) float pv[KC];
  _mm512_store_ps(pv, p);
  const __m512 vcorr = _mm512_set1_ps(corr);
  // p is 0 past the visible keys: a full chunk's loop over keys unrolls (their V rows are valid pointers
  // only up to visible)
  const int keys = visible == KC ? KC : visible;
  for (int d = 0; d < D; d += 16) {
    __m512 a0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), vcorr), a1 = _mm512_setzero_ps();
    if (keys == KC) {
      for (int t = 0; t < KC; t += 2) {
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t]), _mm512_loadu_ps(vp[t] + d), a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t + 1]), _mm512_loadu_ps(vp[t + 1] + d), a1);
      }
    } else {
      for (int t = 0; t < keys; ++t) a0 = _mm512_fmadd_ps(_mm512_set1_ps(pv[t]), _mm512_loadu_ps(vp[t] + d), a0);
    }
    _mm512_storeu_ps(acc + d, _mm512_add_ps(a0, a1));
  }
}
#endif

template <typename T>
void run_item(const Args& a, const Item& it) {
  const int D = a.head_dim, G = a.num_heads / a.num_kv_heads, Hkv = a.num_kv_heads;
  const int seq_len = a.seq_lens[it.seq];
  const int q0 = a.cu_seqlens_q[it.seq];
  const int context = seq_len - (a.cu_seqlens_q[it.seq + 1] - q0);
  const int rows = (it.q_end - it.q_begin) * G;
  const T* q = static_cast<const T*>(a.q);
  const T* kc = static_cast<const T*>(a.k_cache);
  const T* vc = static_cast<const T*>(a.v_cache);
  const int32_t* bt = a.block_tables + it.seq * a.bt_stride;

  alignas(64) float qs[MAX_ROWS][MAX_D];
  alignas(64) float acc[MAX_ROWS][MAX_D];
  alignas(64) float kbuf[KC][MAX_D];
  alignas(64) float vbuf[KC][MAX_D];
  float m[MAX_ROWS], l[MAX_ROWS];
  int limit[MAX_ROWS];  // last visible key of each row
  for (int r = 0; r < rows; ++r) {
    const int tok = it.q_begin + r / G, head = it.kv_head * G + r % G;
    const T* src = q + (static_cast<int64_t>(q0 + tok) * a.num_heads + head) * D;
    for (int d = 0; d < D; ++d) qs[r][d] = load(src + d) * a.scale;
    for (int d = 0; d < D; ++d) acc[r][d] = 0.f;
    m[r] = NEG;
    l[r] = 0.f;
    limit[r] = context + tok;
  }
  const int n_keys = context + it.q_end;  // keys the last token of the tile sees
  int64_t off[KC];
  const float* kp[KC];
  const float* vp[KC];
  int block = 0, in_block = 0;  // key j0 + t's place in the block table, advanced without divisions
  int pf_block = 0, pf_in_block = 0, pf_key = 0;  // the next key to prefetch
  const int line = 64 / static_cast<int>(sizeof(T));
  for (int j0 = 0; j0 < n_keys; j0 += KC) {
    const int nk = n_keys - j0 < KC ? n_keys - j0 : KC;
    // Keys and values PF_KEYS ahead are fetched into L2 while this chunk is computed: one KV head's vectors
    // lie 1/Hkv of a slot apart, and in a decode batch every sequence's blocks are elsewhere.
    for (; pf_key < n_keys && pf_key < j0 + nk + PF_KEYS; ++pf_key) {
      const int64_t o = ((static_cast<int64_t>(bt[pf_block]) * a.block_size + pf_in_block) * Hkv + it.kv_head) * D;
      for (int e = 0; e < D; e += line) {
        __builtin_prefetch(kc + o + e, 0, 2);
        __builtin_prefetch(vc + o + e, 0, 2);
      }
      if (++pf_in_block == a.block_size) pf_in_block = 0, ++pf_block;
    }
    for (int t = 0; t < nk; ++t) {
      const int64_t slot = static_cast<int64_t>(bt[block]) * a.block_size + in_block;
      off[t] = (slot * Hkv + it.kv_head) * D;
      if (++in_block == a.block_size) {
        in_block = 0;
        ++block;
      }
    }
    rows_of(kc, off, nk, D, kbuf, kp);
    rows_of(vc, off, nk, D, vbuf, vp);
    for (int r = 0; r < rows; ++r) {
      int visible = limit[r] - j0 + 1;  // keys of this chunk the row sees
      if (visible <= 0) continue;
      if (visible > nk) visible = nk;
#ifdef __AVX512F__
      if (D % 16 == 0) {
        if (D == 64) chunk_update16<64>(qs[r], kp, vp, visible, D, &m[r], &l[r], acc[r]);
        else if (D == 128) chunk_update16<128>(qs[r], kp, vp, visible, D, &m[r], &l[r], acc[r]);
        else chunk_update16<0>(qs[r], kp, vp, visible, D, &m[r], &l[r], acc[r]);
        continue;
      }
#endif
      float s[KC];
      const float* qr = qs[r];
      float mx = m[r];
      for (int t = 0; t < visible; ++t) {
        s[t] = dot(qr, kp[t], D);
        mx = s[t] > mx ? s[t] : mx;
      }
      const float corr = std::exp(m[r] - mx);
      float sum = 0.f;
#if defined(__AVX2__) && !defined(__AVX512F__)
      for (int t = visible; t < KC; ++t) s[t] = NEG;  // lanes past the visible keys: exp gives 0
      for (int t = 0; t < KC; t += 8)
        _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(mx))));
      for (int t = 0; t < visible; ++t) sum += s[t];
#else
      for (int t = 0; t < visible; ++t) {
        s[t] = std::exp(s[t] - mx);
        sum += s[t];
      }
#endif
      l[r] = l[r] * corr + sum;
      m[r] = mx;
      float* ar = acc[r];
      for (int d = 0; d < D; ++d) ar[d] *= corr;
      for (int t = 0; t < visible; ++t) axpy(ar, vp[t], s[t], D);
    }
  }
  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < rows; ++r) {
    const int tok = it.q_begin + r / G, head = it.kv_head * G + r % G;
    T* dst = out + (static_cast<int64_t>(q0 + tok) * a.num_heads + head) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int d = 0; d < D; ++d) store(dst + d, acc[r][d] * inv);
  }
}

template <typename T>
void run(const Args& a, int num_seqs) {
  const int G = a.num_heads / a.num_kv_heads;
  const int tile = MAX_ROWS / G;
  std::vector<Item> items;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_len = a.cu_seqlens_q[s + 1] - a.cu_seqlens_q[s];
    if (a.seq_lens[s] == 0 || q_len <= 0) {  // padding row: defined as zeros
      T* out = static_cast<T*>(a.out);
      const int64_t n = static_cast<int64_t>(q_len > 0 ? q_len : 0) * a.num_heads * a.head_dim;
      const int64_t base = static_cast<int64_t>(a.cu_seqlens_q[s]) * a.num_heads * a.head_dim;
      for (int64_t i = 0; i < n; ++i) store(out + base + i, 0.f);
      continue;
    }
    // Later tiles see more keys: put them first so the dynamic schedule ends balanced.
    for (int b = ((q_len - 1) / tile) * tile; b >= 0; b -= tile)
      for (int h = 0; h < a.num_kv_heads; ++h)
        items.push_back({s, h, b, b + tile < q_len ? b + tile : q_len});
  }
  const int64_t n = static_cast<int64_t>(items.size());
  pagedserve::parallel_for(n, [&](int64_t i) { run_item<T>(a, items[i]); });
}

// Scatters the step's new K/V rows (heads contiguous, rows k_stride / v_stride elements apart: views of the
// fused qkv output) into their cache slots; slot < 0 marks padding. One memcpy per token and tensor.
void write_kv(const void* k, const void* v, void* k_cache, void* v_cache, const int32_t* slot_mapping,
              int64_t num_tokens, int64_t k_stride, int64_t v_stride, int64_t row, int elem) {
  auto* kc = static_cast<char*>(k_cache);
  auto* vc = static_cast<char*>(v_cache);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(kc + slot * row * elem, static_cast<const char*>(k) + t * k_stride * elem, row * elem);
    std::memcpy(vc + slot * row * elem, static_cast<const char*>(v) + t * v_stride * elem, row * elem);
  }
}

}  // namespace

extern "C" int paged_attention(const void* q, const void* k, const void* v, void* k_cache, void* v_cache,
                               void* out, const int32_t* slot_mapping, int64_t num_tokens, int64_t k_stride,
                               int64_t v_stride, const int32_t* block_tables, int64_t bt_stride,
                               const int32_t* seq_lens, const int32_t* cu_seqlens_q, int num_seqs, int num_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16) {
  if (head_dim > MAX_D || num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_ROWS)
    return 1;
  write_kv(k, v, k_cache, v_cache, slot_mapping, num_tokens, k_stride, v_stride,
           static_cast<int64_t>(num_kv_heads) * head_dim, is_bf16 ? 2 : 4);
  const Args a{q, k_cache, v_cache, out, block_tables, bt_stride, seq_lens, cu_seqlens_q,
               num_heads, num_kv_heads, head_dim, block_size, scale};
  if (is_bf16)
    run<uint16_t>(a, num_seqs);
  else
    run<float>(a, num_seqs);
  return 0;
}
