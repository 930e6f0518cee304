// One decoder layer of a quantized model (llama family) on CPU in a single call: RMSNorm (+ residual), the
// q/k/v projection, RoPE (+ Qwen3's q/k norm), paged attention, o_proj, RMSNorm (+ residual), gate/up,
// SiLU-and-multiply, down. It calls the same kernels, in the same order, as the layer's torch modules do one
// by one (quant.cpp, ops.cpp, attention.cpp), so its output is bitwise the modules'; what it removes is the
// Python between them: at one sequence, a decode step of SmolLM2's 30 layers spent more time dispatching
// those ~20 calls per layer than computing them.
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
int qlinear(const void* x, const void* w, int t, int M, int N, int K, int64_t row_bytes, void* out, int64_t ldo,
            int is_bf16, int out_bf16, int int8_inputs);
int cpu_rms_norm(const void* x, const void* residual, const void* weight, void* out, void* res_out, int64_t rows,
                 int hidden, int64_t x_stride, float eps, int is_bf16);
int cpu_rope(void* q, void* k, const int32_t* positions, const float* cos_sin, int64_t tokens, int num_q_heads,
             int num_k_heads, int head_dim, int64_t q_stride, int64_t k_stride, int64_t cache_stride,
             const void* q_norm_w, const void* k_norm_w, float eps, int is_bf16);
int cpu_silu_and_mul(const void* x, void* out, int64_t rows, int inter, int64_t x_stride, int is_bf16);
int paged_attention(const void* q, const void* k, const void* v, void* k_cache, void* v_cache, void* out,
                    const int32_t* slots, int64_t tokens, int64_t k_stride, int64_t v_stride,
                    const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens, const int32_t* cu_seqlens_q,
                    int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                    int is_bf16);
}

namespace {

constexpr int MAX_SEGMENTS = 4;

// A linear layer's weight as row segments of blocks (a fused q/k/v has one per checkpoint tensor).
struct QLinear {
  int num_segments;
  const void* blocks[MAX_SEGMENTS];
  int qtype[MAX_SEGMENTS];
  int rows[MAX_SEGMENTS];
  int64_t row_bytes[MAX_SEGMENTS];
  int in_features, out_features;
  int int8_inputs;  // inputs rounded to int8 where the build has VNNI (quant_tiles.cpp), else int16
};

}  // namespace

// The per-layer constants (mirrored by kernels/cpu/layer.py's ctypes structures).
struct LayerWeights {
  const void* input_norm;
  const void* post_norm;
  const void* q_norm;  // Qwen3's per-head norms, else null
  const void* k_norm;
  float eps;
  QLinear qkv, o, gate_up, down;
  void* k_cache;
  void* v_cache;
  int num_heads, num_kv_heads, head_dim, block_size;
  float scale;
};

// The per-step inputs shared by every layer.
struct StepInputs {
  int64_t tokens;
  const int32_t* positions;
  const float* cos_sin;
  int64_t cos_sin_stride;
  const int32_t* slot_mapping;
  const int32_t* block_tables;
  int64_t block_tables_stride;
  const int32_t* seq_lens;
  const int32_t* cu_seqlens_q;
  int num_seqs;
  int is_bf16;
};

namespace {

int linear(const QLinear& l, const void* x, int64_t M, void* out, int64_t ldo, int is_bf16) {
  const int elem = is_bf16 ? 2 : 4;
  auto* o = static_cast<char*>(out);
  for (int s = 0; s < l.num_segments; ++s) {
    if (qlinear(x, l.blocks[s], l.qtype[s], static_cast<int>(M), l.rows[s], l.in_features, l.row_bytes[s], o, ldo,
                is_bf16, is_bf16, l.int8_inputs) != 0)
      return 1;
    o += static_cast<int64_t>(l.rows[s]) * elem;
  }
  return 0;
}

char* scratch(std::vector<char>& buf, int64_t elems, int elem) {
  if (buf.size() < static_cast<size_t>(elems * elem)) buf.resize(elems * elem);
  return buf.data();
}

}  // namespace

// hidden [T, hidden_size]: the previous layer's output (the embedding for the first layer), replaced by this
// layer's MLP output; residual [T, hidden_size]: the running residual, updated in place (first: set to hidden).
extern "C" int cpu_decoder_layer(const LayerWeights* w, const StepInputs* s, void* hidden, void* residual, int first) {
  static thread_local std::vector<char> normed_buf, qkv_buf, q_buf, attn_buf, gate_up_buf, act_buf;
  const int64_t T = s->tokens;
  const int elem = s->is_bf16 ? 2 : 4, H = w->o.out_features;
  const int q_size = w->num_heads * w->head_dim, kv_size = w->num_kv_heads * w->head_dim;
  const int width = w->qkv.out_features, inter = w->down.in_features;
  char* normed = scratch(normed_buf, T * H, elem);
  char* qkv = scratch(qkv_buf, T * width, elem);
  char* q = scratch(q_buf, T * q_size, elem);
  char* attn = scratch(attn_buf, T * q_size, elem);
  char* gate_up = scratch(gate_up_buf, T * 2 * inter, elem);
  char* act = scratch(act_buf, T * inter, elem);

  if (first) {
    std::memcpy(residual, hidden, static_cast<size_t>(T * H * elem));
    cpu_rms_norm(hidden, nullptr, w->input_norm, normed, nullptr, T, H, H, w->eps, s->is_bf16);
  } else {
    cpu_rms_norm(hidden, residual, w->input_norm, normed, residual, T, H, H, w->eps, s->is_bf16);
  }
  if (linear(w->qkv, normed, T, qkv, width, s->is_bf16) != 0) return 1;
  char* k = qkv + static_cast<int64_t>(q_size) * elem;
  char* v = k + static_cast<int64_t>(kv_size) * elem;
  if (cpu_rope(qkv, k, s->positions, s->cos_sin, T, w->num_heads, w->num_kv_heads, w->head_dim, width, width,
               s->cos_sin_stride, w->q_norm, w->k_norm, w->eps, s->is_bf16) != 0)
    return 2;
  for (int64_t t = 0; t < T; ++t)  // the attention kernel reads q as contiguous rows
    std::memcpy(q + t * q_size * elem, qkv + t * width * elem, static_cast<size_t>(q_size) * elem);
  if (paged_attention(q, k, v, w->k_cache, w->v_cache, attn, s->slot_mapping, T, width, width, s->block_tables,
                      s->block_tables_stride, s->seq_lens, s->cu_seqlens_q, s->num_seqs, w->num_heads,
                      w->num_kv_heads, w->head_dim, w->block_size, w->scale, s->is_bf16) != 0)
    return 3;
  if (linear(w->o, attn, T, hidden, H, s->is_bf16) != 0) return 1;
  cpu_rms_norm(hidden, residual, w->post_norm, normed, residual, T, H, H, w->eps, s->is_bf16);
  if (linear(w->gate_up, normed, T, gate_up, 2 * inter, s->is_bf16) != 0) return 1;
  cpu_silu_and_mul(gate_up, act, T, inter, 2 * inter, s->is_bf16);
  return linear(w->down, act, T, hidden, H, s->is_bf16);
}
